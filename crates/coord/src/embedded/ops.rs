//! Operations: a request checked by the session, sent to the store, and
//! applied there to the tree (writes become the batch's transactions, reads
//! may register a watch); and the [`Coordination`] API of a session.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use super::watches::{register, watch_from};
use super::{send, stopped, Command, EmbeddedSession, Request, Response, Store};
use crate::error::{CoordError, Result};
use crate::metrics::{CoordMetrics, RequestKind};
use crate::path;
use crate::types::{validate_multi, CreateMode, Op, OpResult, SessionState, Stat, Watch};
use crate::Coordination;

impl Store {
    pub(super) fn request(&mut self, session: i64, request: Request) -> Result<Response> {
        let Some(entry) = self.sessions.get_mut(&session) else {
            return Err(CoordError::SessionExpired);
        };
        entry.last_heard = Instant::now();
        // Short of disk space, a write is refused before anything of it is
        // applied: nothing changes, and the answer is definite.
        if request.is_write() {
            if let Some(space) = &self.space {
                space.check()?;
            }
        }
        match request {
            Request::Multi(ops) => {
                // No chroot: paths are stored as given.
                validate_multi(&ops, 0)?;
                let (results, txn) = self.tree.apply(&ops, session, &mut self.changes)?;
                self.txns.extend(txn);
                Ok(Response::Multi(results))
            }
            Request::Create(op) => {
                validate_multi(std::slice::from_ref(&op), 0).map_err(|e| e.root().clone())?;
                let (mut results, txn) = self
                    .tree
                    .apply(std::slice::from_ref(&op), session, &mut self.changes)
                    .map_err(|e| e.root().clone())?;
                self.txns.extend(txn);
                match results.pop() {
                    Some(OpResult::Create { path }) => {
                        let stat = self.tree.node(&path).map(|n| n.stat).unwrap_or_default();
                        Ok(Response::Created(path, stat))
                    }
                    _ => Err(unexpected()),
                }
            }
            Request::Get { path, watch } => {
                path::validate_path(&path)?;
                let node = self
                    .tree
                    .node(&path)
                    .ok_or_else(|| CoordError::NoNode { path: path.clone() })?;
                let (data, stat) = (node.data.clone(), node.stat);
                let rx = watch.then(|| register(&mut self.data_watches, session, path));
                Ok(Response::Get(data, stat, rx))
            }
            Request::Exists { path, watch } => {
                path::validate_path(&path)?;
                let stat = self.tree.node(&path).map(|n| n.stat);
                let rx = watch.then(|| register(&mut self.data_watches, session, path));
                Ok(Response::Exists(stat, rx))
            }
            Request::Children { path, watch } => {
                path::validate_path(&path)?;
                let node = self
                    .tree
                    .node(&path)
                    .ok_or_else(|| CoordError::NoNode { path: path.clone() })?;
                let (children, stat) = (node.children.iter().cloned().collect(), node.stat);
                let rx = watch.then(|| register(&mut self.child_watches, session, path));
                Ok(Response::Children(children, stat, rx))
            }
        }
    }
}

impl Request {
    /// Whether the request may change the tree (creates, sets, deletes and
    /// multis are all sent as one of these).
    fn is_write(&self) -> bool {
        match self {
            Request::Multi(_) | Request::Create(_) => true,
            Request::Get { .. } | Request::Exists { .. } | Request::Children { .. } => false,
        }
    }
}

/// The checks the store makes of a request, made by the session first.
fn validate_request(request: &Request) -> Result<()> {
    match request {
        Request::Multi(ops) => validate_multi(ops, 0),
        Request::Create(op) => {
            validate_multi(std::slice::from_ref(op), 0).map_err(|e| e.root().clone())
        }
        Request::Get { path, .. }
        | Request::Exists { path, .. }
        | Request::Children { path, .. } => path::validate_path(path),
    }
}

fn unexpected() -> CoordError {
    CoordError::Backend("embedded store answered with the wrong response kind".to_string())
}

impl EmbeddedSession {
    async fn call(&self, kind: RequestKind, ops: usize, request: Request) -> Result<Response> {
        let result = async {
            // The order of ZooKeeper's client: a closed handle answers at once;
            // otherwise bad input is refused before the session is asked about,
            // so an expired session still reports an invalid path as such.
            if self.closed.load(std::sync::atomic::Ordering::Acquire) {
                return Err(CoordError::SessionClosed);
            }
            validate_request(&request)?;
            if let Some(e) = self.local_state_error() {
                return Err(e);
            }
            let (reply, rx) = oneshot::channel();
            send(
                &self.tx,
                Command::Request {
                    session: self.id,
                    request,
                    reply,
                },
            )
            .await?;
            rx.await.map_err(|_| stopped())?
        }
        .await;
        self.metrics.record(kind, ops, result.is_err());
        result
    }

    async fn single(&self, kind: RequestKind, op: Op) -> Result<OpResult> {
        match self.call(kind, 1, Request::Multi(vec![op])).await {
            Ok(Response::Multi(mut results)) if results.len() == 1 => {
                results.pop().ok_or_else(unexpected)
            }
            Ok(_) => Err(unexpected()),
            Err(CoordError::MultiFailed { source, .. }) => Err(*source),
            Err(e) => Err(e),
        }
    }
}

#[async_trait]
impl Coordination for EmbeddedSession {
    fn session_id(&self) -> i64 {
        self.id
    }

    fn session_state(&self) -> watch::Receiver<SessionState> {
        self.state.clone()
    }

    fn metrics(&self) -> Arc<CoordMetrics> {
        Arc::clone(&self.metrics)
    }

    async fn create(&self, path: &str, data: &[u8], mode: CreateMode) -> Result<(String, Stat)> {
        let request = Request::Create(Op::create(path, data, mode));
        match self.call(RequestKind::Create, 1, request).await? {
            Response::Created(path, stat) => Ok((path, stat)),
            _ => Err(unexpected()),
        }
    }

    async fn get(&self, path: &str) -> Result<(Vec<u8>, Stat)> {
        let request = Request::Get {
            path: path.to_string(),
            watch: false,
        };
        match self.call(RequestKind::Get, 1, request).await? {
            Response::Get(data, stat, _) => Ok((data, stat)),
            _ => Err(unexpected()),
        }
    }

    async fn get_watch(&self, path: &str) -> Result<(Vec<u8>, Stat, Watch)> {
        let request = Request::Get {
            path: path.to_string(),
            watch: true,
        };
        match self.call(RequestKind::Get, 1, request).await? {
            Response::Get(data, stat, Some(rx)) => Ok((data, stat, watch_from(rx))),
            _ => Err(unexpected()),
        }
    }

    async fn exists(&self, path: &str) -> Result<Option<Stat>> {
        let request = Request::Exists {
            path: path.to_string(),
            watch: false,
        };
        match self.call(RequestKind::Exists, 1, request).await? {
            Response::Exists(stat, _) => Ok(stat),
            _ => Err(unexpected()),
        }
    }

    async fn exists_watch(&self, path: &str) -> Result<(Option<Stat>, Watch)> {
        let request = Request::Exists {
            path: path.to_string(),
            watch: true,
        };
        match self.call(RequestKind::Exists, 1, request).await? {
            Response::Exists(stat, Some(rx)) => Ok((stat, watch_from(rx))),
            _ => Err(unexpected()),
        }
    }

    async fn set(&self, path: &str, data: &[u8], version: Option<i32>) -> Result<Stat> {
        match self
            .single(RequestKind::Set, Op::set(path, data, version))
            .await?
        {
            OpResult::Set { stat } => Ok(stat),
            _ => Err(unexpected()),
        }
    }

    async fn delete(&self, path: &str, version: Option<i32>) -> Result<()> {
        match self
            .single(RequestKind::Delete, Op::delete(path, version))
            .await?
        {
            OpResult::Delete => Ok(()),
            _ => Err(unexpected()),
        }
    }

    async fn children(&self, path: &str) -> Result<(Vec<String>, Stat)> {
        let request = Request::Children {
            path: path.to_string(),
            watch: false,
        };
        match self.call(RequestKind::Children, 1, request).await? {
            Response::Children(children, stat, _) => Ok((children, stat)),
            _ => Err(unexpected()),
        }
    }

    async fn children_watch(&self, path: &str) -> Result<(Vec<String>, Stat, Watch)> {
        let request = Request::Children {
            path: path.to_string(),
            watch: true,
        };
        match self.call(RequestKind::Children, 1, request).await? {
            Response::Children(children, stat, Some(rx)) => Ok((children, stat, watch_from(rx))),
            _ => Err(unexpected()),
        }
    }

    async fn multi(&self, ops: Vec<Op>) -> Result<Vec<OpResult>> {
        let n = ops.len();
        match self
            .call(RequestKind::Multi, n, Request::Multi(ops))
            .await?
        {
            Response::Multi(results) => Ok(results),
            _ => Err(unexpected()),
        }
    }

    async fn close(&self) {
        self.heartbeat.abort();
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        if self.state.borrow().is_terminal() {
            return;
        }
        let (reply, rx) = oneshot::channel();
        let cmd = Command::End {
            session: self.id,
            state: SessionState::Closed,
            reply: Some(reply),
        };
        if send(&self.tx, cmd).await.is_ok() {
            let _ = rx.await;
        }
    }
}
