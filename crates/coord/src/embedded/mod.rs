//! The embedded back-end: an in-process coordination store.
//!
//! One task owns the [`Tree`] and the [`Persister`]; sessions talk to it through a
//! bounded queue. The task takes every queued command (up to a batch limit),
//! applies them in arrival order, appends the resulting transactions to the log
//! with **one** sync, and only then answers and fires watches, so nothing is ever
//! observed before it is durable (group commit: many writers share an fsync).
//!
//! Sessions are kept alive by a heartbeat of their handle; a session not heard from
//! for its timeout expires, its ephemerals are deleted and its owner sees
//! [`SessionState::Expired`]. After a restart every session of the previous run is
//! dead, so recovery deletes all ephemerals it finds.
//!
//! The simulator reuses this store unchanged: it passes a simulated [`Disk`], and
//! can expire sessions on demand with [`EmbeddedStore::expire_session`].

mod persist;
mod tree;

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferry_env::Disk;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{CoordError, Result};
use crate::metrics::{CoordMetrics, RequestKind};
use crate::path;
use crate::types::{
    validate_multi, CreateMode, Op, OpResult, SessionState, Stat, Watch, WatchEvent, WatchEventKind,
};
use crate::Coordination;

use persist::{Persister, SnapshotPolicy};
use tree::{Change, Tree, Txn};

/// Failure to open the embedded store.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error("coordination store I/O error: {0}")]
    Io(#[from] io::Error),
    /// The persisted state is damaged; the store refuses to start rather than
    /// silently lose or invent data.
    #[error("coordination store is corrupt: {0}")]
    Corrupt(String),
}

/// Tuning of the embedded store; the defaults suit `ferry dev`.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// Snapshot after this many logged transactions.
    pub snapshot_every_txns: u64,
    /// Snapshot once the current log reaches this many bytes.
    pub snapshot_log_bytes: u64,
    /// Capacity of the command queue; senders wait when it is full.
    pub queue_capacity: usize,
    /// Most commands handled per group commit.
    pub max_batch: usize,
    /// How often idle sessions are looked for.
    pub expiry_check_interval: Duration,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions {
            snapshot_every_txns: 10_000,
            snapshot_log_bytes: 64 << 20,
            queue_capacity: 4096,
            max_batch: 512,
            expiry_check_interval: Duration::from_millis(100),
        }
    }
}

/// Shortest session timeout accepted (ZooKeeper's usual floor is two ticks).
pub const MIN_SESSION_TIMEOUT: Duration = Duration::from_millis(100);
/// Longest session timeout accepted.
pub const MAX_SESSION_TIMEOUT: Duration = Duration::from_secs(600);

type WatchSender = oneshot::Sender<WatchEvent>;

enum Request {
    Multi(Vec<Op>),
    /// A single create, answered with the stat of the node as created.
    Create(Op),
    Get {
        path: String,
        watch: bool,
    },
    Exists {
        path: String,
        watch: bool,
    },
    Children {
        path: String,
        watch: bool,
    },
}

enum Response {
    Multi(Vec<OpResult>),
    Created(String, Stat),
    Get(Vec<u8>, Stat, Option<oneshot::Receiver<WatchEvent>>),
    Exists(Option<Stat>, Option<oneshot::Receiver<WatchEvent>>),
    Children(Vec<String>, Stat, Option<oneshot::Receiver<WatchEvent>>),
}

type OpenReply = oneshot::Sender<Result<(i64, watch::Receiver<SessionState>)>>;

enum Command {
    Open {
        timeout: Duration,
        reply: OpenReply,
    },
    Request {
        session: i64,
        request: Request,
        reply: oneshot::Sender<Result<Response>>,
    },
    Ping {
        session: i64,
    },
    End {
        session: i64,
        state: SessionState,
        reply: Option<oneshot::Sender<bool>>,
    },
    ExpireIdle,
    LiveSessions {
        reply: oneshot::Sender<Vec<i64>>,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// An answer held back until the batch is durable.
enum Pending {
    Open(OpenReply, Result<(i64, watch::Receiver<SessionState>)>),
    Request(oneshot::Sender<Result<Response>>, Result<Response>),
    End(oneshot::Sender<bool>, bool),
    Shutdown(oneshot::Sender<()>),
}

struct SessionEntry {
    timeout: Duration,
    last_heard: Instant,
    state: watch::Sender<SessionState>,
}

/// Bits of a session id below the boot epoch.
const SESSION_COUNTER_BITS: u32 = 24;

struct Store {
    tree: Tree,
    persister: Option<Persister>,
    sessions: BTreeMap<i64, SessionEntry>,
    session_epoch: i64,
    next_session: i64,
    data_watches: BTreeMap<String, Vec<(i64, WatchSender)>>,
    child_watches: BTreeMap<String, Vec<(i64, WatchSender)>>,
    /// Set when the log could not be written: the store stops serving (fail-stop)
    /// because its memory is ahead of its disk.
    failed: Option<String>,
    // Per-batch buffers.
    txns: Vec<Txn>,
    changes: Vec<Change>,
    pending: Vec<Pending>,
    /// Watches fired by the batch, delivered once it is durable. A change takes
    /// its watches out of the registry the moment it is applied, so a watch set
    /// later in the same batch (by a read that already saw the change) waits
    /// for the next change, as on ZooKeeper.
    watch_fires: Vec<(WatchSender, WatchEvent)>,
    state_changes: Vec<(watch::Sender<SessionState>, SessionState)>,
}

/// Handle of a running embedded store.
#[derive(Clone)]
pub struct EmbeddedStore {
    tx: mpsc::Sender<Command>,
    task: Arc<std::sync::Mutex<Option<JoinHandle<()>>>>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EmbeddedStore")
    }
}

impl EmbeddedStore {
    /// Opens (recovering if needed) the store persisted in `dir` of `disk` and
    /// starts its task on the current tokio runtime.
    pub async fn open(
        disk: Arc<dyn Disk>,
        dir: &str,
        options: EmbeddedOptions,
    ) -> Result<EmbeddedStore, EmbeddedError> {
        let policy = SnapshotPolicy {
            every_txns: options.snapshot_every_txns.max(1),
            log_bytes: options.snapshot_log_bytes.max(1),
        };
        let (persister, tree) = Persister::open(disk, dir, policy).await?;
        Self::start(tree, Some(persister), options).await
    }

    /// A store that keeps nothing on disk: for tests and for measuring the cost of
    /// persistence. Everything is lost when it stops.
    pub async fn in_memory(options: EmbeddedOptions) -> Result<EmbeddedStore, EmbeddedError> {
        Self::start(Tree::new(), None, options).await
    }

    async fn start(
        mut tree: Tree,
        mut persister: Option<Persister>,
        options: EmbeddedOptions,
    ) -> Result<EmbeddedStore, EmbeddedError> {
        // Every session of a previous run is dead: delete its ephemerals, and
        // open a new session-id epoch.
        let mut startup = Vec::new();
        let mut changes = Vec::new();
        for owner in tree.ephemeral_owners() {
            startup.extend(tree.end_session(owner, &mut changes));
        }
        let boot = tree.next_boot();
        let session_epoch = boot.zxid;
        startup.push(boot);
        if let Some(p) = persister.as_mut() {
            p.append(&startup).await?;
        }
        let store = Store {
            tree,
            persister,
            sessions: BTreeMap::new(),
            session_epoch,
            next_session: 1,
            data_watches: BTreeMap::new(),
            child_watches: BTreeMap::new(),
            failed: None,
            txns: Vec::new(),
            changes: Vec::new(),
            pending: Vec::new(),
            watch_fires: Vec::new(),
            state_changes: Vec::new(),
        };
        let (tx, rx) = mpsc::channel(options.queue_capacity.max(1));
        let task = tokio::spawn(store.run(rx, tx.downgrade(), options));
        Ok(EmbeddedStore {
            tx,
            task: Arc::new(std::sync::Mutex::new(Some(task))),
        })
    }

    /// Opens a new session with the given timeout (clamped to
    /// [`MIN_SESSION_TIMEOUT`]..=[`MAX_SESSION_TIMEOUT`]).
    pub async fn session(&self, timeout: Duration) -> Result<EmbeddedSession> {
        self.session_with_metrics(timeout, Arc::new(CoordMetrics::default()))
            .await
    }

    /// Like [`EmbeddedStore::session`], counting traffic into shared metrics.
    pub async fn session_with_metrics(
        &self,
        timeout: Duration,
        metrics: Arc<CoordMetrics>,
    ) -> Result<EmbeddedSession> {
        let timeout = timeout.clamp(MIN_SESSION_TIMEOUT, MAX_SESSION_TIMEOUT);
        let (reply, rx) = oneshot::channel();
        send(&self.tx, Command::Open { timeout, reply }).await?;
        let (id, state) = rx.await.map_err(|_| stopped())??;
        let (paused, paused_rx) = watch::channel(false);
        let heartbeat = tokio::spawn(heartbeat(
            self.tx.clone(),
            id,
            timeout,
            state.clone(),
            paused_rx,
        ));
        Ok(EmbeddedSession {
            paused,
            close_on_drop: std::sync::atomic::AtomicBool::new(true),
            closed: std::sync::atomic::AtomicBool::new(false),
            id,
            tx: self.tx.clone(),
            state,
            metrics,
            heartbeat,
        })
    }

    /// Expires a session now, as if it had not been heard from for its timeout:
    /// its ephemerals are deleted and its owner sees [`SessionState::Expired`].
    /// Returns false if there was no such live session.
    pub async fn expire_session(&self, session: i64) -> Result<bool> {
        let (reply, rx) = oneshot::channel();
        send(
            &self.tx,
            Command::End {
                session,
                state: SessionState::Expired,
                reply: Some(reply),
            },
        )
        .await?;
        rx.await.map_err(|_| stopped())
    }

    /// The ids of the sessions alive now (not expired, not closed): checkers
    /// use it to see that no ephemeral node outlives its session.
    pub async fn live_sessions(&self) -> Result<Vec<i64>> {
        let (reply, rx) = oneshot::channel();
        send(&self.tx, Command::LiveSessions { reply }).await?;
        rx.await.map_err(|_| stopped())
    }

    /// Stops the store after the commands queued before this call; later requests
    /// of its sessions fail with connection loss.
    pub async fn shutdown(&self) {
        let (reply, rx) = oneshot::channel();
        if send(&self.tx, Command::Shutdown { reply }).await.is_ok() {
            let _ = rx.await;
        }
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

fn stopped() -> CoordError {
    CoordError::ConnectionLoss {
        detail: "embedded coordination store stopped".to_string(),
    }
}

async fn send(tx: &mpsc::Sender<Command>, cmd: Command) -> Result<()> {
    tx.send(cmd).await.map_err(|_| stopped())
}

async fn heartbeat(
    tx: mpsc::Sender<Command>,
    session: i64,
    timeout: Duration,
    mut state: watch::Receiver<SessionState>,
    paused: watch::Receiver<bool>,
) {
    let period = timeout / 3;
    loop {
        tokio::select! {
            biased;
            changed = state.changed() => {
                if changed.is_err() || state.borrow().is_terminal() {
                    return;
                }
            }
            () = tokio::time::sleep(period) => {
                if *paused.borrow() {
                    continue;
                }
                if tx.send(Command::Ping { session }).await.is_err() {
                    return;
                }
            }
        }
    }
}

impl Store {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Command>,
        self_tx: mpsc::WeakSender<Command>,
        options: EmbeddedOptions,
    ) {
        let mut batch = Vec::with_capacity(options.max_batch);
        let expiry_check = {
            let self_tx = self_tx.clone();
            let interval = options.expiry_check_interval;
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(interval).await;
                    let Some(tx) = self_tx.upgrade() else { return };
                    if tx.send(Command::ExpireIdle).await.is_err() {
                        return;
                    }
                }
            })
        };
        let mut shutting_down = false;
        while !shutting_down {
            let Some(first) = rx.recv().await else { break };
            batch.push(first);
            while batch.len() < options.max_batch.max(1) {
                match rx.try_recv() {
                    Ok(cmd) => batch.push(cmd),
                    Err(_) => break,
                }
            }
            for cmd in batch.drain(..) {
                if matches!(cmd, Command::Shutdown { .. }) {
                    shutting_down = true;
                }
                self.handle(cmd);
            }
            self.commit_batch().await;
        }
        expiry_check.abort();
        // Dropping the store ends every watch and session channel: owners see
        // their requests fail with connection loss.
    }

    fn handle(&mut self, cmd: Command) {
        if let Some(reason) = &self.failed {
            let err = CoordError::ConnectionLoss {
                detail: format!("embedded coordination store failed: {reason}"),
            };
            match cmd {
                Command::Open { reply, .. } => self.pending.push(Pending::Open(reply, Err(err))),
                Command::Request { reply, .. } => {
                    self.pending.push(Pending::Request(reply, Err(err)))
                }
                Command::End { reply, .. } => {
                    if let Some(reply) = reply {
                        self.pending.push(Pending::End(reply, false));
                    }
                }
                Command::Shutdown { reply } => self.pending.push(Pending::Shutdown(reply)),
                Command::LiveSessions { reply } => {
                    let _ = reply.send(Vec::new());
                }
                Command::Ping { .. } | Command::ExpireIdle => {}
            }
            return;
        }
        match cmd {
            Command::Open { timeout, reply } => {
                let result = self.open_session(timeout);
                self.pending.push(Pending::Open(reply, result));
            }
            Command::Request {
                session,
                request,
                reply,
            } => {
                let result = self.request(session, request);
                self.collect_fires();
                self.pending.push(Pending::Request(reply, result));
            }
            Command::Ping { session } => {
                if let Some(entry) = self.sessions.get_mut(&session) {
                    entry.last_heard = Instant::now();
                }
            }
            Command::End {
                session,
                state,
                reply,
            } => {
                let ended = self.end_session(session, state);
                if let Some(reply) = reply {
                    self.pending.push(Pending::End(reply, ended));
                }
            }
            Command::ExpireIdle => {
                let now = Instant::now();
                let idle: Vec<i64> = self
                    .sessions
                    .iter()
                    .filter(|(_, s)| now.duration_since(s.last_heard) > s.timeout)
                    .map(|(id, _)| *id)
                    .collect();
                for session in idle {
                    tracing::info!(session, "coordination session expired");
                    self.end_session(session, SessionState::Expired);
                }
            }
            Command::LiveSessions { reply } => {
                let _ = reply.send(self.sessions.keys().copied().collect());
            }
            Command::Shutdown { reply } => self.pending.push(Pending::Shutdown(reply)),
        }
    }

    fn open_session(&mut self, timeout: Duration) -> Result<(i64, watch::Receiver<SessionState>)> {
        if self.next_session >= 1 << SESSION_COUNTER_BITS {
            let boot = self.tree.next_boot();
            self.session_epoch = boot.zxid;
            self.next_session = 1;
            self.txns.push(boot);
        }
        let id = (self.session_epoch << SESSION_COUNTER_BITS) | self.next_session;
        self.next_session += 1;
        let (state, rx) = watch::channel(SessionState::Connected);
        self.sessions.insert(
            id,
            SessionEntry {
                timeout,
                last_heard: Instant::now(),
                state,
            },
        );
        Ok((id, rx))
    }

    fn end_session(&mut self, session: i64, state: SessionState) -> bool {
        let Some(entry) = self.sessions.remove(&session) else {
            return false;
        };
        self.txns
            .extend(self.tree.end_session(session, &mut self.changes));
        self.state_changes.push((entry.state, state));
        if state == SessionState::Closed {
            // As on ZooKeeper, the closing session's own watches see the
            // deletion of its ephemerals, then the session closed.
            self.collect_fires();
            self.end_watches(session, WatchEventKind::SessionClosed);
        } else {
            // An expired session's owner is gone: its watches only learn that.
            self.end_watches(session, WatchEventKind::SessionExpired);
            self.collect_fires();
        }
        true
    }

    /// Fires every remaining watch of `session` with a session event.
    fn end_watches(&mut self, session: i64, kind: WatchEventKind) {
        for registry in [&mut self.data_watches, &mut self.child_watches] {
            registry.retain(|_, watchers| {
                let mut i = 0;
                while i < watchers.len() {
                    if watchers[i].0 == session {
                        let (_, tx) = watchers.remove(i);
                        self.watch_fires.push((
                            tx,
                            WatchEvent {
                                kind,
                                path: String::new(),
                            },
                        ));
                    } else {
                        i += 1;
                    }
                }
                !watchers.is_empty()
            });
        }
    }

    fn request(&mut self, session: i64, request: Request) -> Result<Response> {
        let Some(entry) = self.sessions.get_mut(&session) else {
            return Err(CoordError::SessionExpired);
        };
        entry.last_heard = Instant::now();
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

    fn fire(
        registry: &mut BTreeMap<String, Vec<(i64, WatchSender)>>,
        path: &str,
        kind: WatchEventKind,
        out: &mut Vec<(WatchSender, WatchEvent)>,
    ) {
        if let Some(watchers) = registry.remove(path) {
            for (_, tx) in watchers {
                out.push((
                    tx,
                    WatchEvent {
                        kind,
                        path: path.to_string(),
                    },
                ));
            }
        }
    }

    /// Takes the watches the changes applied so far fire out of the registry
    /// (delivered when the batch is durable).
    fn collect_fires(&mut self) {
        for change in std::mem::take(&mut self.changes) {
            match change {
                Change::Created(p) => {
                    Self::fire(
                        &mut self.data_watches,
                        &p,
                        WatchEventKind::NodeCreated,
                        &mut self.watch_fires,
                    );
                    Self::fire(
                        &mut self.child_watches,
                        path::parent(&p),
                        WatchEventKind::NodeChildrenChanged,
                        &mut self.watch_fires,
                    );
                }
                Change::Deleted(p) => {
                    Self::fire(
                        &mut self.data_watches,
                        &p,
                        WatchEventKind::NodeDeleted,
                        &mut self.watch_fires,
                    );
                    Self::fire(
                        &mut self.child_watches,
                        &p,
                        WatchEventKind::NodeDeleted,
                        &mut self.watch_fires,
                    );
                    Self::fire(
                        &mut self.child_watches,
                        path::parent(&p),
                        WatchEventKind::NodeChildrenChanged,
                        &mut self.watch_fires,
                    );
                }
                Change::DataChanged(p) => {
                    Self::fire(
                        &mut self.data_watches,
                        &p,
                        WatchEventKind::NodeDataChanged,
                        &mut self.watch_fires,
                    );
                }
            }
        }
    }

    /// Makes the batch durable, then answers and notifies.
    async fn commit_batch(&mut self) {
        if !self.txns.is_empty() {
            if let Some(persister) = self.persister.as_mut() {
                if let Err(e) = persister.append(&self.txns).await {
                    tracing::error!(error = %e, "coordination log write failed; the store stops serving");
                    self.fail(e.to_string());
                }
            }
            self.txns.clear();
        }
        if self.failed.is_none() {
            if let Some(persister) = self.persister.as_mut() {
                if persister.wants_snapshot() {
                    if let Err(e) = persister.snapshot(&self.tree).await {
                        // Nothing is lost: the log still holds every transaction.
                        tracing::warn!(error = %e, "coordination snapshot failed; will retry");
                    }
                }
            }
        }
        // As on ZooKeeper, a client sees a watch event (and a session's end)
        // before the answer to any request that could show it the change: the
        // events are delivered before the answers of the batch that caused them.
        for (tx, event) in self.watch_fires.drain(..) {
            let _ = tx.send(event);
        }
        for (tx, state) in self.state_changes.drain(..) {
            tx.send_replace(state);
        }
        for pending in self.pending.drain(..) {
            match pending {
                Pending::Open(reply, result) => {
                    let _ = reply.send(result);
                }
                Pending::Request(reply, result) => {
                    let _ = reply.send(result);
                }
                Pending::End(reply, ended) => {
                    let _ = reply.send(ended);
                }
                Pending::Shutdown(reply) => {
                    let _ = reply.send(());
                }
            }
        }
    }

    fn fail(&mut self, reason: String) {
        let err = CoordError::ConnectionLoss {
            detail: format!("embedded coordination store failed: {reason}"),
        };
        for pending in &mut self.pending {
            match pending {
                Pending::Open(_, result) => *result = Err(err.clone()),
                Pending::Request(_, result) => *result = Err(err.clone()),
                Pending::End(..) | Pending::Shutdown(_) => {}
            }
        }
        self.changes.clear();
        // The batch's changes are not durable: their watches are dropped, and
        // their owners see a disconnection (changes may have been missed).
        self.watch_fires.clear();
        self.failed = Some(reason);
    }
}

fn register(
    registry: &mut BTreeMap<String, Vec<(i64, WatchSender)>>,
    session: i64,
    path: String,
) -> oneshot::Receiver<WatchEvent> {
    let (tx, rx) = oneshot::channel();
    registry.entry(path).or_default().push((session, tx));
    rx
}

/// A session of the embedded store. Dropping it closes the session.
pub struct EmbeddedSession {
    id: i64,
    tx: mpsc::Sender<Command>,
    state: watch::Receiver<SessionState>,
    metrics: Arc<CoordMetrics>,
    heartbeat: JoinHandle<()>,
    paused: watch::Sender<bool>,
    close_on_drop: std::sync::atomic::AtomicBool,
    /// Set by `close` before anything is sent: every later request of this
    /// handle fails with `SessionClosed`, whatever the store has done yet.
    closed: std::sync::atomic::AtomicBool,
}

impl Drop for EmbeddedSession {
    fn drop(&mut self) {
        self.heartbeat.abort();
        let close = self
            .close_on_drop
            .load(std::sync::atomic::Ordering::Relaxed);
        if close && !self.state.borrow().is_terminal() {
            // Best effort: if the queue is full the session simply expires.
            let _ = self.tx.try_send(Command::End {
                session: self.id,
                state: SessionState::Closed,
                reply: None,
            });
        }
    }
}

fn watch_from(rx: oneshot::Receiver<WatchEvent>) -> Watch {
    Watch::new(async move {
        rx.await.unwrap_or(WatchEvent {
            kind: WatchEventKind::Disconnected,
            path: String::new(),
        })
    })
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
    /// Pauses or resumes the heartbeat, as a hung or partitioned process would:
    /// a session that sends nothing expires after its timeout; resumed in time, it
    /// lives on. For fault injection.
    pub fn set_heartbeats_paused(&self, paused: bool) {
        self.paused.send_replace(paused);
    }

    /// Forgets the session without closing it, as a crashed process does: it
    /// expires after its timeout, taking its ephemerals with it. For fault
    /// injection.
    pub fn abandon(&self) {
        self.set_heartbeats_paused(true);
        self.close_on_drop
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    fn local_state_error(&self) -> Option<CoordError> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Some(CoordError::SessionClosed);
        }
        match *self.state.borrow() {
            SessionState::Expired => Some(CoordError::SessionExpired),
            SessionState::Closed => Some(CoordError::SessionClosed),
            SessionState::Connected | SessionState::Disconnected => None,
        }
    }

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
