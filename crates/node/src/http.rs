//! HTTP over the network seam: a node's endpoint is served on a
//! [`ferry_env::Listener`] and node-to-node calls connect through a
//! [`ferry_env::Network`], so that the simulator carries them in its world
//! (delays, loss, partitions) like the WAL protocol, and the product runs
//! them on TCP.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use ferry_env::{BoxConnection, Listener, Network};
use ferry_export::peers::{PeerCalls, ShardSnapshotAnswer, ShardSnapshotBody, UnpinBody};
use ferry_wal::Lsn;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::Request;
pub use hyper::{Method, StatusCode};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A pause after the listener failed to accept (out of file descriptors),
/// so that a persistent failure does not spin.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// The largest answer a node accepts from another: a shard snapshot lists
/// every part of a partition (about 200 bytes each), so this holds a
/// partition of several hundred thousand parts.
pub const MAX_PEER_ANSWER_BYTES: usize = 64 << 20;

/// A seam listener as axum serves it (`axum::serve(SeamListener::new(l), router)`).
pub struct SeamListener {
    inner: Box<dyn Listener>,
}

impl SeamListener {
    pub fn new(inner: Box<dyn Listener>) -> SeamListener {
        SeamListener { inner }
    }
}

impl axum::serve::Listener for SeamListener {
    type Io = BoxConnection;
    type Addr = String;

    async fn accept(&mut self) -> (BoxConnection, String) {
        loop {
            match self.inner.accept().await {
                Ok(accepted) => return accepted,
                // One connection's trouble: the next one is accepted at once.
                Err(e) if is_connection_error(&e) => {
                    tracing::debug!(error = %e, "an HTTP connection failed as it was accepted");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accepting HTTP connections failed");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<String> {
        self.inner.local_addr()
    }
}

/// How long a stopping endpoint waits for requests in progress (inserts
/// waiting for their commit) before it drops them.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A running endpoint.
pub struct HttpServer {
    /// The address others reach it at (with the real port when bound to port 0).
    pub addr: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl HttpServer {
    /// Ends the endpoint at once, as a crash would: every request in
    /// progress ends where it is, unanswered (the simulator's crashes).
    pub async fn abort(self) {
        self.task.abort();
        let _ = self.task.await;
    }

    /// Stops taking requests, lets those in progress finish (at most
    /// [`DRAIN_TIMEOUT`]), and returns once every route (and what it holds) is
    /// dropped.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(DRAIN_TIMEOUT, &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!("HTTP requests still running after {DRAIN_TIMEOUT:?}; dropping them");
            self.task.abort();
            let _ = self.task.await;
        }
    }
}

/// Serves `app` on `listener` until [`HttpServer::stop`].
pub fn serve(listener: Box<dyn Listener>, app: axum::Router) -> io::Result<HttpServer> {
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve_connections(SeamListener::new(listener), app, stopped));
    Ok(HttpServer {
        addr,
        stop: Some(stop),
        task,
    })
}

/// Accepts connections until `stopped` fires (or its sender is dropped),
/// then lets every connection finish the request it serves and close.
///
/// Each connection is a task of a set this future owns, so that aborting
/// the endpoint ([`HttpServer::abort`], a crash in the simulator) ends every
/// request in progress with it, as a process's death does: a request
/// handler outliving its node's crash would write to a disk and a
/// coordination store the restarted node already read.
async fn serve_connections(
    mut listener: SeamListener,
    app: axum::Router,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    use axum::serve::Listener as _;
    let mut connections = tokio::task::JoinSet::new();
    let (drain, draining) = tokio::sync::watch::channel(false);
    loop {
        // `biased`: the simulator needs the same choice for the same inputs.
        tokio::select! {
            biased;
            _ = &mut stopped => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            (io, _peer) = listener.accept() => {
                let service = hyper_util::service::TowerToHyperService::new(app.clone());
                let mut draining = draining.clone();
                connections.spawn(async move {
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(io), service);
                    tokio::pin!(conn);
                    tokio::select! {
                        biased;
                        result = conn.as_mut() => {
                            if let Err(e) = result {
                                tracing::debug!(error = %e, "an HTTP connection ended with an error");
                            }
                            return;
                        }
                        _ = draining.wait_for(|d| *d) => conn.as_mut().graceful_shutdown(),
                    }
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "an HTTP connection ended with an error");
                    }
                });
            }
        }
    }
    let _ = drain.send(true);
    while connections.join_next().await.is_some() {}
}

/// An accept error that concerns one connection only (its peer reset or
/// aborted it), not the listener.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Why a call to another node failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("connecting to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("{addr}: {detail}")]
    Http { addr: String, detail: String },
    #[error("{addr} answered {status}: {body}")]
    Status {
        addr: String,
        status: StatusCode,
        body: String,
    },
    #[error("{addr} answered what is not the expected JSON: {detail}")]
    Decode { addr: String, detail: String },
    #[error("{addr} did not answer within {0:?}", .timeout)]
    Timeout { addr: String, timeout: Duration },
}

/// JSON calls to other nodes' endpoints: one connection per call (calls
/// between nodes are few: an export request's shard snapshots, unpins and
/// the commit position), each bounded by its timeout and its answer by
/// [`MAX_PEER_ANSWER_BYTES`].
#[derive(Clone)]
pub struct HttpPeers {
    network: Arc<dyn Network>,
    /// The cluster's API token (every node is started with the same one).
    token: Option<String>,
}

impl HttpPeers {
    pub fn new(network: Arc<dyn Network>, token: Option<String>) -> HttpPeers {
        HttpPeers {
            network,
            token: token.filter(|t| !t.is_empty()),
        }
    }

    /// `GET path` on `addr`.
    pub async fn get<T: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        timeout: Duration,
    ) -> Result<T, CallError> {
        self.call(addr, Method::GET, path, None, timeout).await
    }

    /// `POST path` on `addr` with `body` as JSON.
    pub async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &B,
        timeout: Duration,
    ) -> Result<T, CallError> {
        let json = serde_json::to_vec(body).map_err(|e| CallError::Http {
            addr: addr.to_string(),
            detail: format!("encoding the request: {e}"),
        })?;
        self.call(addr, Method::POST, path, Some(json), timeout)
            .await
    }

    /// `method path` on `addr` with `body` of `content_type` and extra
    /// `headers`: the answer's status and body whatever the status (an
    /// insert's client decides what a 409 or a 503 means). Bounded by
    /// `timeout` and [`MAX_PEER_ANSWER_BYTES`].
    #[allow(clippy::too_many_arguments)] // one per part of a request
    pub async fn request(
        &self,
        addr: &str,
        method: Method,
        path: &str,
        content_type: &str,
        headers: &[(&'static str, String)],
        body: Bytes,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), CallError> {
        let exchange = async {
            let (response, driver) = self
                .send_with(addr, method, path, Some((content_type, body)), headers)
                .await?;
            let status = response.status();
            let bytes = Limited::new(response.into_body(), MAX_PEER_ANSWER_BYTES)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .map_err(|e| CallError::Http {
                    addr: addr.to_string(),
                    detail: format!("reading the answer: {e}"),
                });
            driver.abort();
            Ok((status, bytes?))
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Timeout {
                addr: addr.to_string(),
                timeout,
            }),
        }
    }

    async fn call<T: DeserializeOwned>(
        &self,
        addr: &str,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<T, CallError> {
        match tokio::time::timeout(timeout, self.exchange(addr, method, path, body)).await {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Timeout {
                addr: addr.to_string(),
                timeout,
            }),
        }
    }

    async fn exchange<T: DeserializeOwned>(
        &self,
        addr: &str,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, CallError> {
        let (response, driver) = self.send(addr, method, path, body).await?;
        let answer = async {
            let status = response.status();
            let bytes = Limited::new(response.into_body(), MAX_PEER_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| CallError::Http {
                    addr: addr.to_string(),
                    detail: format!("reading the answer: {e}"),
                })?
                .to_bytes();
            if !status.is_success() {
                return Err(CallError::Status {
                    addr: addr.to_string(),
                    status,
                    body: String::from_utf8_lossy(&bytes).into_owned(),
                });
            }
            serde_json::from_slice(&bytes).map_err(|e| CallError::Decode {
                addr: addr.to_string(),
                detail: e.to_string(),
            })
        }
        .await;
        driver.abort();
        answer
    }

    /// Sends a request on a connection of its own; returns the answer's head
    /// (its body still to read) and the task driving the connection, which
    /// the caller aborts once it read what it wanted.
    async fn send(
        &self,
        addr: &str,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<
        (
            hyper::Response<hyper::body::Incoming>,
            tokio::task::JoinHandle<()>,
        ),
        CallError,
    > {
        let body = body.map(|json| ("application/json", Bytes::from(json)));
        self.send_with(addr, method, path, body, &[]).await
    }

    async fn send_with(
        &self,
        addr: &str,
        method: Method,
        path: &str,
        body: Option<(&str, Bytes)>,
        headers: &[(&'static str, String)],
    ) -> Result<
        (
            hyper::Response<hyper::body::Incoming>,
            tokio::task::JoinHandle<()>,
        ),
        CallError,
    > {
        let http = |detail: String| CallError::Http {
            addr: addr.to_string(),
            detail,
        };
        let conn = self
            .network
            .connect(addr)
            .await
            .map_err(|source| CallError::Connect {
                addr: addr.to_string(),
                source,
            })?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(conn))
            .await
            .map_err(|e| http(e.to_string()))?;
        // Drives the connection; it ends when the exchange is done (or
        // dropped, with the call's timeout).
        let driver = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "a connection to a peer ended");
            }
        });
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, addr);
        if let Some(token) = &self.token {
            request = request.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let request = match body {
            Some((content_type, bytes)) => request
                .header(CONTENT_TYPE, content_type)
                .body(Full::new(bytes)),
            None => request.body(Full::new(Bytes::new())),
        }
        .map_err(|e| http(e.to_string()))?;
        match sender.send_request(request).await {
            Ok(response) => Ok((response, driver)),
            Err(e) => {
                driver.abort();
                Err(http(e.to_string()))
            }
        }
    }

    /// `GET path` on `addr`, its answer's body read as it comes: the head
    /// within `timeout`, then each chunk within `idle` of the one before (a
    /// large body takes as long as it takes, a stalled one fails).
    pub async fn get_stream(
        &self,
        addr: &str,
        path: &str,
        timeout: Duration,
        idle: Duration,
    ) -> Result<HttpBody, CallError> {
        let sent = tokio::time::timeout(timeout, self.send(addr, Method::GET, path, None)).await;
        let (response, driver) = match sent {
            Ok(sent) => sent?,
            Err(_) => {
                return Err(CallError::Timeout {
                    addr: addr.to_string(),
                    timeout,
                })
            }
        };
        let status = response.status();
        let mut body = HttpBody {
            addr: addr.to_string(),
            body: response.into_body(),
            idle,
            driver,
        };
        if !status.is_success() {
            let mut text = Vec::new();
            while let Ok(Some(chunk)) = body.next_chunk().await {
                text.extend_from_slice(&chunk);
                if text.len() > 64 << 10 {
                    break;
                }
            }
            return Err(CallError::Status {
                addr: addr.to_string(),
                status,
                body: String::from_utf8_lossy(&text).into_owned(),
            });
        }
        Ok(body)
    }
}

/// An answer's body being read (see [`HttpPeers::get_stream`]); dropping it
/// closes the connection.
pub struct HttpBody {
    addr: String,
    body: hyper::body::Incoming,
    idle: Duration,
    driver: tokio::task::JoinHandle<()>,
}

impl HttpBody {
    /// The next chunk of the body; `None` at its end.
    pub async fn next_chunk(&mut self) -> Result<Option<Bytes>, CallError> {
        loop {
            let frame = match tokio::time::timeout(self.idle, self.body.frame()).await {
                Err(_) => {
                    return Err(CallError::Timeout {
                        addr: self.addr.clone(),
                        timeout: self.idle,
                    })
                }
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => {
                    return Err(CallError::Http {
                        addr: self.addr.clone(),
                        detail: format!("reading the answer: {e}"),
                    })
                }
                Ok(Some(Ok(frame))) => frame,
            };
            if let Ok(data) = frame.into_data() {
                return Ok(Some(data));
            }
        }
    }
}

impl Drop for HttpBody {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

#[async_trait]
impl PeerCalls for HttpPeers {
    async fn shard_snapshot(
        &self,
        addr: &str,
        body: &ShardSnapshotBody,
        timeout: Duration,
    ) -> Result<ShardSnapshotAnswer, String> {
        self.post(addr, "/exports/shard-snapshot", body, timeout)
            .await
            .map_err(|e| e.to_string())
    }

    async fn unpin(&self, addr: &str, body: &UnpinBody, timeout: Duration) -> Result<(), String> {
        self.post::<_, serde_json::Value>(addr, "/exports/unpin", body, timeout)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    async fn writer_maintain(
        &self,
        addr: &str,
        table: &str,
        record: &ferry_wal::record::Maintenance,
        timeout: Duration,
    ) -> Result<Lsn, String> {
        let answer: serde_json::Value = self
            .post(
                addr,
                &format!("/tables/{table}/maintenance"),
                record,
                timeout,
            )
            .await
            .map_err(|e| e.to_string())?;
        commit_lsn_in(&answer).ok_or_else(|| "no commit_lsn in its answer".to_string())
    }

    async fn writer_commit_lsn(&self, addr: &str, timeout: Duration) -> Result<Lsn, String> {
        let status: serde_json::Value = self
            .get(addr, "/status", timeout)
            .await
            .map_err(|e| e.to_string())?;
        commit_lsn_in(&status).ok_or_else(|| "no commit_lsn in its status".to_string())
    }
}

/// The `commit_lsn` field of a writer's answer.
fn commit_lsn_in(answer: &serde_json::Value) -> Option<Lsn> {
    answer
        .get("commit_lsn")
        .and_then(|v| v.as_str())
        .and_then(|s| s.parse::<Lsn>().ok())
}
