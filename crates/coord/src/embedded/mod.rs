//! The embedded back-end: an in-process coordination store.
//!
//! One task owns the `Tree` and the `Persister`; sessions talk to it through a
//! bounded queue. The task takes every queued command (up to a batch limit),
//! applies them in arrival order, appends the resulting transactions to the log
//! with **one** sync, and only then answers and fires watches, so nothing is ever
//! observed before it is durable (group commit: many writers share an fsync).
//!
//! While the file system of its directory has less than
//! [`EmbeddedOptions::min_free_disk`] free, the store refuses new writes
//! (creates, sets, deletes, multis) with [`CoordError::DiskFull`] before
//! applying anything of them, and takes them again by itself once space
//! returns: the rule is a [`SpaceBreaker`] fed the free space of its disk by
//! [`watch_free_space`]; the store task only consults it. Reads, watches,
//! session keep-alives, closes and expiries go on (the margin is there for
//! what they write).
//!
//! Sessions are kept alive by a heartbeat of their handle; a session not heard from
//! for its timeout expires, its ephemerals are deleted and its owner sees
//! [`SessionState::Expired`]. After a restart every session of the previous run is
//! dead, so recovery deletes all ephemerals it finds.
//!
//! The simulator reuses this store unchanged: it passes a simulated [`Disk`], and
//! can expire sessions on demand with [`EmbeddedStore::expire_session`].
//!
//! Here: the options and errors, the commands sessions send the store task,
//! the store's state, and the [`EmbeddedStore`] and [`EmbeddedSession`]
//! handles; in the submodules:
//! * `task`: the store task's loop, the dispatch of commands, and the group
//!   commit (the batch made durable, then watches fired and answers sent);
//! * `session`: sessions opened, kept alive by their heartbeat, expired or
//!   closed, and the session handle's own state;
//! * `ops`: requests (reads, creates, multis) applied to the tree, and the
//!   [`Coordination`](crate::Coordination) API of a session that sends them;
//! * `watches`: watches registered by reads, fired by the changes applied,
//!   and ended with their session;
//! * `persist`: the transaction log and snapshots;
//! * `tree`: the data tree, a pure state machine.

mod ops;
mod persist;
mod session;
mod task;
mod tree;
mod watches;

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use ferry_env::space::{watch_free_space, SpaceBreaker};
use ferry_env::Disk;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{CoordError, Result};
use crate::metrics::CoordMetrics;
use crate::types::{Op, OpResult, SessionState, Stat, WatchEvent};

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
    /// New writes are refused ([`CoordError::DiskFull`]) while less than
    /// this many bytes are free on the file system of the store's directory,
    /// and taken again once an eighth more is free ([`SpaceBreaker`]); 0:
    /// never. A store kept in memory has no disk to watch.
    pub min_free_disk: u64,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions {
            snapshot_every_txns: 10_000,
            snapshot_log_bytes: 64 << 20,
            queue_capacity: 4096,
            max_batch: 512,
            expiry_check_interval: Duration::from_millis(100),
            min_free_disk: 0,
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
    /// The disk-full breaker (`None`: never full): new writes are refused
    /// while it is open.
    space: Option<SpaceBreaker>,
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
    space: Option<SpaceBreaker>,
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
        let space = match options.min_free_disk {
            0 => None,
            min_free => {
                let breaker = SpaceBreaker::new("coordination store", min_free);
                // A store opened on a full disk refuses writes from its first
                // request on; the watch below follows the disk from here.
                match disk.free_bytes().await {
                    Ok(free) => {
                        breaker.observe(free);
                    }
                    Err(e) => tracing::warn!(error = %e, "could not read the free disk space"),
                }
                Some((breaker, Arc::clone(&disk)))
            }
        };
        let (persister, tree) = Persister::open(disk, dir, policy).await?;
        Self::start(tree, Some(persister), space, options).await
    }

    /// A store that keeps nothing on disk: for tests and for measuring the cost of
    /// persistence. Everything is lost when it stops.
    pub async fn in_memory(options: EmbeddedOptions) -> Result<EmbeddedStore, EmbeddedError> {
        Self::start(Tree::new(), None, None, options).await
    }

    /// `space`: the disk-full breaker and the disk it watches.
    async fn start(
        mut tree: Tree,
        mut persister: Option<Persister>,
        space: Option<(SpaceBreaker, Arc<dyn Disk>)>,
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
            space: space.as_ref().map(|(breaker, _)| breaker.clone()),
            txns: Vec::new(),
            changes: Vec::new(),
            pending: Vec::new(),
            watch_fires: Vec::new(),
            state_changes: Vec::new(),
        };
        let (tx, rx) = mpsc::channel(options.queue_capacity.max(1));
        let breaker = space.as_ref().map(|(breaker, _)| breaker.clone());
        // The watch lives as long as the store task (which aborts it).
        let space_watch =
            space.map(|(breaker, disk)| tokio::spawn(watch_free_space(disk, breaker)));
        let task = tokio::spawn(store.run(rx, tx.downgrade(), space_watch, options));
        Ok(EmbeddedStore {
            tx,
            task: Arc::new(std::sync::Mutex::new(Some(task))),
            space: breaker,
        })
    }

    /// The disk-full breaker (`None`: [`EmbeddedOptions::min_free_disk`] is
    /// 0, or the store is in memory): `Some` of it while writes are refused
    /// is what a status shows.
    pub fn space(&self) -> Option<&SpaceBreaker> {
        self.space.as_ref()
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
