//! Coordination with the ZooKeeper data model.
//!
//! One API ([`Coordination`]), two back-ends: [`embedded`], an in-process store
//! persisted under the data dir (the default of `ferry dev` and the simulator's
//! coordination), and [`zk`], a client of a real ZooKeeper ensemble. Both pass the
//! same conformance suite (`tests/conformance.rs`); code above this crate never
//! knows which one it talks to.
//!
//! What the API guarantees (on both back-ends):
//! * requests of one session are applied in the order they were issued;
//! * a multi is atomic: all of its operations or none, and a failure names the
//!   index of the failing operation;
//! * a watch is set atomically with the read that returns it and fires once, on the
//!   first change after that read, or on a session event;
//! * [`CoordError::ConnectionLoss`] means *outcome unknown*: the request may have
//!   been applied; everything else is a definite answer.

mod counted;
pub mod embedded;
mod error;
mod metrics;
pub mod path;
mod types;
pub mod zk;

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::watch;

pub use counted::CountedSession;
pub use error::{CoordError, Result};
pub use metrics::{CoordMetrics, MetricsSnapshot, RequestKind};
pub use types::{
    multi_request_bytes, validate_multi, CreateMode, Op, OpResult, SessionState, Stat, Watch,
    WatchEvent, WatchEventKind,
};

/// A session with a coordination service.
///
/// Ephemeral nodes belong to the session; they vanish when it is closed or expires.
/// Dropping the last handle closes the session.
#[async_trait]
pub trait Coordination: Send + Sync + 'static {
    /// The session id (the owner recorded in ephemeral nodes' stats).
    fn session_id(&self) -> i64;

    /// Follows the session state; expiry is seen here as [`SessionState::Expired`].
    fn session_state(&self) -> watch::Receiver<SessionState>;

    /// Traffic counters of this session.
    fn metrics(&self) -> Arc<CoordMetrics>;

    /// Bytes the back-end puts in front of every path on the wire (a ZooKeeper
    /// chroot; 0 for the embedded store). A multi is accepted when
    /// [`multi_request_bytes`]`(ops, path_prefix_bytes())` is at most
    /// [`path::MAX_REQUEST_BYTES`]: callers that split a large transaction into
    /// chunks size them with the same two functions.
    fn path_prefix_bytes(&self) -> usize {
        0
    }

    /// Creates a node; returns its actual path (with the sequence suffix) and stat.
    async fn create(&self, path: &str, data: &[u8], mode: CreateMode) -> Result<(String, Stat)>;

    /// Reads a node's data and stat.
    async fn get(&self, path: &str) -> Result<(Vec<u8>, Stat)>;

    /// Reads a node and watches it for a data change or deletion.
    async fn get_watch(&self, path: &str) -> Result<(Vec<u8>, Stat, Watch)>;

    /// The node's stat, or `None` if it does not exist.
    async fn exists(&self, path: &str) -> Result<Option<Stat>>;

    /// Like [`Coordination::exists`], and watches for creation, change or deletion.
    async fn exists_watch(&self, path: &str) -> Result<(Option<Stat>, Watch)>;

    /// Replaces a node's data if its version matches (`None`: any version).
    async fn set(&self, path: &str, data: &[u8], version: Option<i32>) -> Result<Stat>;

    /// Deletes a childless node if its version matches (`None`: any version).
    async fn delete(&self, path: &str, version: Option<i32>) -> Result<()>;

    /// The names of a node's children, sorted, and the node's stat.
    async fn children(&self, path: &str) -> Result<(Vec<String>, Stat)>;

    /// Like [`Coordination::children`], and watches for a child added or removed or
    /// the node deleted.
    async fn children_watch(&self, path: &str) -> Result<(Vec<String>, Stat, Watch)>;

    /// Applies all operations atomically, or none of them.
    async fn multi(&self, ops: Vec<Op>) -> Result<Vec<OpResult>>;

    /// Ends the session now: its ephemerals are deleted before this returns.
    async fn close(&self);
}

/// A shared session handle, as node code holds it.
pub type Session = Arc<dyn Coordination>;

/// Opens sessions of one back-end. A node holds one, so that after its
/// session expired (its ephemerals gone, its watches dead) it opens a new one
/// and re-registers, without knowing whether it talks to the embedded store,
/// ZooKeeper or the simulator.
#[async_trait]
pub trait SessionFactory: Send + Sync + 'static {
    /// A new session.
    async fn open(&self) -> Result<Session>;
}

/// A session that is replaced by a new one of the same back-end once it has
/// ended (expired or closed): what a long-running node holds, so that it
/// outlives a session expiry. A request caught by the expiry fails once; the
/// next one runs on the new session. Ephemerals of the old session are gone:
/// whoever owns them must notice (they are tied to [`Coordination::session_id`]).
#[derive(Clone)]
pub struct RenewingSession {
    sessions: Arc<dyn SessionFactory>,
    current: Arc<tokio::sync::Mutex<Session>>,
    renewals: Arc<std::sync::atomic::AtomicU64>,
}

impl RenewingSession {
    /// Opens the first session.
    pub async fn open(sessions: Arc<dyn SessionFactory>) -> Result<RenewingSession> {
        let session = sessions.open().await?;
        Ok(RenewingSession::with(sessions, session))
    }

    /// Starts from a session already open (of the same back-end as `sessions`).
    pub fn with(sessions: Arc<dyn SessionFactory>, session: Session) -> RenewingSession {
        RenewingSession {
            sessions,
            current: Arc::new(tokio::sync::Mutex::new(session)),
            renewals: Arc::default(),
        }
    }

    /// The live session, a new one if the last one ended.
    pub async fn session(&self) -> Result<Session> {
        let mut current = self.current.lock().await;
        let ended = current.session_state().borrow().is_terminal();
        if ended {
            tracing::warn!(
                session = current.session_id(),
                "coordination session ended; opening a new one"
            );
            *current = self.sessions.open().await?;
            self.renewals
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(Arc::clone(&current))
    }

    /// How many times a new session replaced an ended one.
    pub fn renewals(&self) -> u64 {
        self.renewals.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Closes the current session (at shutdown).
    pub async fn close(&self) {
        self.current.lock().await.close().await;
    }
}

/// Sessions of an embedded store, all with one timeout.
#[derive(Debug, Clone)]
pub struct EmbeddedSessions {
    pub store: embedded::EmbeddedStore,
    pub timeout: std::time::Duration,
    pub metrics: Arc<CoordMetrics>,
}

#[async_trait]
impl SessionFactory for EmbeddedSessions {
    async fn open(&self) -> Result<Session> {
        let session = self
            .store
            .session_with_metrics(self.timeout, Arc::clone(&self.metrics))
            .await?;
        Ok(Arc::new(session))
    }
}

/// Sessions of a ZooKeeper ensemble.
#[derive(Debug, Clone)]
pub struct ZkSessions {
    pub options: zk::ZkOptions,
    pub metrics: Arc<CoordMetrics>,
}

#[async_trait]
impl SessionFactory for ZkSessions {
    async fn open(&self) -> Result<Session> {
        let session =
            zk::ZkSession::connect_with_metrics(&self.options, Arc::clone(&self.metrics)).await?;
        Ok(Arc::new(session))
    }
}

/// Creates every missing node on the way to `path` (persistent, empty data);
/// nodes that already exist are left alone.
pub async fn create_all(session: &dyn Coordination, path: &str) -> Result<()> {
    path::validate_path(path)?;
    if path == "/" {
        return Ok(());
    }
    let mut prefix = String::new();
    for component in path[1..].split('/') {
        prefix.push('/');
        prefix.push_str(component);
        match session.create(&prefix, b"", CreateMode::Persistent).await {
            Ok(_) | Err(CoordError::NodeExists { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
