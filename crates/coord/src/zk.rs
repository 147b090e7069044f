//! The ZooKeeper back-end: the [`Coordination`] API over a real ensemble, through
//! the `zookeeper-client` crate.
//!
//! Requests are validated with the same rules as the embedded back-end before they
//! are sent, so bad input gets the same typed error from both.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{watch, RwLock};
use tokio::task::JoinHandle;
use zookeeper_client as zkc;

use crate::error::{CoordError, Result};
use crate::metrics::{CoordMetrics, RequestKind};
use crate::path;
use crate::types::{
    validate_multi, CreateMode, Op, OpResult, SessionState, Stat, Watch, WatchEvent, WatchEventKind,
};
use crate::Coordination;

/// How to reach the ensemble.
#[derive(Debug, Clone)]
pub struct ZkOptions {
    /// Connection string: `host:port[,host:port...][/chroot]`. The chroot node
    /// must exist.
    pub connect: String,
    /// Session timeout requested from the server (which bounds it to
    /// [2, 20] × its tickTime).
    pub session_timeout: Duration,
    /// How long to try to establish a session before giving up.
    pub connect_timeout: Duration,
}

impl ZkOptions {
    /// Options with a 10 s session timeout and a 10 s connect timeout.
    pub fn new(connect: impl Into<String>) -> ZkOptions {
        ZkOptions {
            connect: connect.into(),
            session_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// A ZooKeeper session.
pub struct ZkSession {
    client: RwLock<Option<zkc::Client>>,
    /// Length of the chroot the client prefixes to every path on the wire.
    chroot_bytes: usize,
    id: i64,
    info: zkc::SessionInfo,
    state: watch::Receiver<SessionState>,
    metrics: Arc<CoordMetrics>,
    state_task: JoinHandle<()>,
}

impl Drop for ZkSession {
    fn drop(&mut self) {
        // Dropping the client (with the struct) sends CloseSession.
        self.state_task.abort();
    }
}

fn map_state(state: zkc::SessionState) -> SessionState {
    match state {
        zkc::SessionState::SyncConnected | zkc::SessionState::ConnectedReadOnly => {
            SessionState::Connected
        }
        zkc::SessionState::Expired => SessionState::Expired,
        zkc::SessionState::Closed | zkc::SessionState::AuthFailed => SessionState::Closed,
        _ => SessionState::Disconnected,
    }
}

/// Maps a client error for an operation on `path` onto [`CoordError`].
fn map_error(e: zkc::Error, path: &str) -> CoordError {
    let path = path.to_string();
    match e {
        zkc::Error::NoNode => CoordError::NoNode { path },
        zkc::Error::NodeExists => CoordError::NodeExists { path },
        zkc::Error::BadVersion => CoordError::BadVersion { path },
        zkc::Error::NotEmpty => CoordError::NotEmpty { path },
        zkc::Error::NoChildrenForEphemerals => CoordError::NoChildrenForEphemerals { path },
        zkc::Error::SessionExpired => CoordError::SessionExpired,
        zkc::Error::ClientClosed => CoordError::SessionClosed,
        // The client reports connection-level failures (no response in time, a
        // broken socket) as custom errors; a request caught in one may or may not
        // have been applied, which is exactly connection loss.
        zkc::Error::ConnectionLoss
        | zkc::Error::Timeout
        | zkc::Error::NoHosts
        | zkc::Error::Custom(_) => CoordError::ConnectionLoss {
            detail: e.to_string(),
        },
        zkc::Error::BadArguments(reason) => CoordError::InvalidPath { path, reason },
        other => CoordError::Backend(other.to_string()),
    }
}

/// The length of the chroot in a connection string (`hosts[/chroot]`).
fn chroot_bytes(connect: &str) -> usize {
    match connect.find('/') {
        Some(i) if connect[i..] != *"/" => connect.len() - i,
        _ => 0,
    }
}

fn map_stat(s: &zkc::Stat) -> Stat {
    Stat {
        czxid: s.czxid,
        mzxid: s.mzxid,
        pzxid: s.pzxid,
        version: s.version,
        cversion: s.cversion,
        ephemeral_owner: s.ephemeral_owner,
        data_length: s.data_length,
        num_children: s.num_children,
    }
}

fn map_watch(watcher: zkc::OneshotWatcher) -> Watch {
    Watch::new(async move {
        let event = watcher.changed().await;
        let kind = match event.event_type {
            zkc::EventType::NodeCreated => WatchEventKind::NodeCreated,
            zkc::EventType::NodeDeleted => WatchEventKind::NodeDeleted,
            zkc::EventType::NodeDataChanged => WatchEventKind::NodeDataChanged,
            zkc::EventType::NodeChildrenChanged => WatchEventKind::NodeChildrenChanged,
            zkc::EventType::Session => match map_state(event.session_state) {
                SessionState::Expired => WatchEventKind::SessionExpired,
                SessionState::Closed => WatchEventKind::SessionClosed,
                _ => WatchEventKind::Disconnected,
            },
        };
        WatchEvent {
            kind,
            path: event.path,
        }
    })
}

fn zk_mode(mode: CreateMode) -> zkc::CreateMode {
    match mode {
        CreateMode::Persistent => zkc::CreateMode::Persistent,
        CreateMode::Ephemeral => zkc::CreateMode::Ephemeral,
        CreateMode::PersistentSequential => zkc::CreateMode::PersistentSequential,
        CreateMode::EphemeralSequential => zkc::CreateMode::EphemeralSequential,
    }
}

impl ZkSession {
    /// Establishes a session.
    pub async fn connect(options: &ZkOptions) -> Result<ZkSession> {
        Self::connect_with_metrics(options, Arc::new(CoordMetrics::default())).await
    }

    /// Establishes a session counting its traffic into shared metrics.
    pub async fn connect_with_metrics(
        options: &ZkOptions,
        metrics: Arc<CoordMetrics>,
    ) -> Result<ZkSession> {
        let connector = zkc::Client::connector()
            .with_session_timeout(options.session_timeout)
            .with_connection_timeout(options.connect_timeout);
        Self::finish_connect(connector, options, metrics).await
    }

    /// Attaches to an existing session (ZooKeeper's session re-establishment).
    /// Closing the returned session ends the original one too; tests use this to
    /// expire a session on demand.
    pub async fn attach(options: &ZkOptions, session: zkc::SessionInfo) -> Result<ZkSession> {
        let connector = zkc::Client::connector()
            .with_session_timeout(options.session_timeout)
            .with_connection_timeout(options.connect_timeout)
            .with_session(session);
        Self::finish_connect(connector, options, Arc::new(CoordMetrics::default())).await
    }

    async fn finish_connect(
        connector: zkc::Connector,
        options: &ZkOptions,
        metrics: Arc<CoordMetrics>,
    ) -> Result<ZkSession> {
        let connect = connector.connect(&options.connect);
        let client = match tokio::time::timeout(options.connect_timeout, connect).await {
            Ok(result) => result.map_err(|e| map_error(e, "/"))?,
            Err(_) => {
                return Err(CoordError::ConnectionLoss {
                    detail: format!("no session with {} established in time", options.connect),
                })
            }
        };
        let mut watcher = client.state_watcher();
        let (tx, state) = watch::channel(map_state(watcher.peek_state()));
        let state_task = tokio::spawn(async move {
            loop {
                let next = map_state(watcher.changed().await);
                tx.send_replace(next);
                if next.is_terminal() {
                    return;
                }
            }
        });
        Ok(ZkSession {
            chroot_bytes: chroot_bytes(&options.connect),
            id: client.session_id().0,
            info: client.session().clone(),
            client: RwLock::new(Some(client)),
            state,
            metrics,
            state_task,
        })
    }

    /// The session's id and password, for [`ZkSession::attach`].
    pub fn session_info(&self) -> zkc::SessionInfo {
        self.info.clone()
    }

    /// Runs one request against the client, counting it.
    async fn with_client<T, F, Fut>(&self, kind: RequestKind, ops: usize, f: F) -> Result<T>
    where
        F: FnOnce(zkc::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let client = self.client.read().await.clone();
        let result = match client {
            Some(client) => f(client).await,
            None => Err(CoordError::SessionClosed),
        };
        self.metrics.record(kind, ops, result.is_err());
        result
    }
}

#[async_trait]
impl Coordination for ZkSession {
    fn session_id(&self) -> i64 {
        self.id
    }

    fn session_state(&self) -> watch::Receiver<SessionState> {
        self.state.clone()
    }

    fn metrics(&self) -> Arc<CoordMetrics> {
        Arc::clone(&self.metrics)
    }

    fn path_prefix_bytes(&self) -> usize {
        self.chroot_bytes
    }

    async fn create(&self, path: &str, data: &[u8], mode: CreateMode) -> Result<(String, Stat)> {
        self.with_client(RequestKind::Create, 1, |client| async move {
            path::validate_create_path(path, mode.is_sequential())?;
            path::validate_data(data)?;
            let options = zk_mode(mode).with_acls(zkc::Acls::anyone_all());
            let (stat, seq) = client
                .create(path, data, &options)
                .await
                .map_err(|e| map_error(e, path))?;
            let created = if mode.is_sequential() {
                format!("{path}{seq}")
            } else {
                path.to_string()
            };
            Ok((created, map_stat(&stat)))
        })
        .await
    }

    async fn get(&self, path: &str) -> Result<(Vec<u8>, Stat)> {
        self.with_client(RequestKind::Get, 1, |client| async move {
            path::validate_path(path)?;
            let (data, stat) = client
                .get_data(path)
                .await
                .map_err(|e| map_error(e, path))?;
            Ok((data, map_stat(&stat)))
        })
        .await
    }

    async fn get_watch(&self, path: &str) -> Result<(Vec<u8>, Stat, Watch)> {
        self.with_client(RequestKind::Get, 1, |client| async move {
            path::validate_path(path)?;
            let (data, stat, watcher) = client
                .get_and_watch_data(path)
                .await
                .map_err(|e| map_error(e, path))?;
            Ok((data, map_stat(&stat), map_watch(watcher)))
        })
        .await
    }

    async fn exists(&self, path: &str) -> Result<Option<Stat>> {
        self.with_client(RequestKind::Exists, 1, |client| async move {
            path::validate_path(path)?;
            let stat = client
                .check_stat(path)
                .await
                .map_err(|e| map_error(e, path))?;
            Ok(stat.as_ref().map(map_stat))
        })
        .await
    }

    async fn exists_watch(&self, path: &str) -> Result<(Option<Stat>, Watch)> {
        self.with_client(RequestKind::Exists, 1, |client| async move {
            path::validate_path(path)?;
            let (stat, watcher) = client
                .check_and_watch_stat(path)
                .await
                .map_err(|e| map_error(e, path))?;
            Ok((stat.as_ref().map(map_stat), map_watch(watcher)))
        })
        .await
    }

    async fn set(&self, path: &str, data: &[u8], version: Option<i32>) -> Result<Stat> {
        self.with_client(RequestKind::Set, 1, |client| async move {
            path::validate_path(path)?;
            path::validate_data(data)?;
            path::validate_version(path, version)?;
            let stat = client
                .set_data(path, data, version)
                .await
                .map_err(|e| map_error(e, path))?;
            Ok(map_stat(&stat))
        })
        .await
    }

    async fn delete(&self, path: &str, version: Option<i32>) -> Result<()> {
        self.with_client(RequestKind::Delete, 1, |client| async move {
            path::validate_delete_path(path)?;
            path::validate_version(path, version)?;
            client
                .delete(path, version)
                .await
                .map_err(|e| map_error(e, path))
        })
        .await
    }

    async fn children(&self, path: &str) -> Result<(Vec<String>, Stat)> {
        self.with_client(RequestKind::Children, 1, |client| async move {
            path::validate_path(path)?;
            let (mut children, stat) = client
                .get_children(path)
                .await
                .map_err(|e| map_error(e, path))?;
            children.sort();
            Ok((children, map_stat(&stat)))
        })
        .await
    }

    async fn children_watch(&self, path: &str) -> Result<(Vec<String>, Stat, Watch)> {
        self.with_client(RequestKind::Children, 1, |client| async move {
            path::validate_path(path)?;
            let (mut children, stat, watcher) = client
                .get_and_watch_children(path)
                .await
                .map_err(|e| map_error(e, path))?;
            children.sort();
            Ok((children, map_stat(&stat), map_watch(watcher)))
        })
        .await
    }

    async fn multi(&self, ops: Vec<Op>) -> Result<Vec<OpResult>> {
        let n = ops.len();
        let chroot_bytes = self.chroot_bytes;
        self.with_client(RequestKind::Multi, n, |client| async move {
            validate_multi(&ops, chroot_bytes)?;
            let mut writer = client.new_multi_writer();
            for op in &ops {
                let added = match op {
                    Op::Check { path, version } => writer.add_check_version(path, *version),
                    Op::Create { path, data, mode } => {
                        let options = zk_mode(*mode).with_acls(zkc::Acls::anyone_all());
                        writer.add_create(path, data, &options)
                    }
                    Op::Set {
                        path,
                        data,
                        version,
                    } => writer.add_set_data(path, data, *version),
                    Op::Delete { path, version } => writer.add_delete(path, *version),
                };
                added.map_err(|e| map_error(e, op.path()))?;
            }
            let results = writer.commit().await.map_err(|e| match e {
                zkc::MultiWriteError::OperationFailed { index, source } => {
                    let path = ops.get(index).map_or("", Op::path);
                    CoordError::MultiFailed {
                        index,
                        source: Box::new(map_error(source, path)),
                    }
                }
                zkc::MultiWriteError::RequestFailed { source } => map_error(source, "/"),
            })?;
            results
                .into_iter()
                .map(|r| match r {
                    zkc::MultiWriteResult::Check => Ok(OpResult::Check),
                    // The stat is dropped: see `OpResult::Create`.
                    zkc::MultiWriteResult::Create { path, .. } => Ok(OpResult::Create { path }),
                    zkc::MultiWriteResult::SetData { stat } => Ok(OpResult::Set {
                        stat: map_stat(&stat),
                    }),
                    zkc::MultiWriteResult::Delete => Ok(OpResult::Delete),
                    other => Err(CoordError::Backend(format!(
                        "unexpected multi result {other:?}"
                    ))),
                })
                .collect()
        })
        .await
    }

    async fn close(&self) {
        let client = self.client.write().await.take();
        if client.is_none() {
            return;
        }
        drop(client);
        let mut state = self.state.clone();
        let wait = state.wait_for(|s| s.is_terminal());
        let _ = tokio::time::timeout(Duration::from_secs(10), wait).await;
    }
}
