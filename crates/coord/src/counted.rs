//! A session that counts the requests made through it, whatever the
//! back-end's own metrics share: a node that wants to know what one piece of
//! its work cost in coordination (the exporter, per task) reads the count
//! before and after.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::{
    CoordMetrics, Coordination, CreateMode, Op, OpResult, Result, Session, SessionState, Stat,
    Watch,
};

/// [`Coordination`] passed through to `inner`, counting round trips.
pub struct CountedSession {
    inner: Session,
    round_trips: AtomicU64,
}

impl CountedSession {
    pub fn new(inner: Session) -> Arc<CountedSession> {
        Arc::new(CountedSession {
            inner,
            round_trips: AtomicU64::new(0),
        })
    }

    /// Requests sent through this handle so far (answered or not).
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    fn count(&self) {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
    }
}

#[async_trait]
impl Coordination for CountedSession {
    fn session_id(&self) -> i64 {
        self.inner.session_id()
    }

    fn session_state(&self) -> watch::Receiver<SessionState> {
        self.inner.session_state()
    }

    fn metrics(&self) -> Arc<CoordMetrics> {
        self.inner.metrics()
    }

    fn path_prefix_bytes(&self) -> usize {
        self.inner.path_prefix_bytes()
    }

    async fn create(&self, path: &str, data: &[u8], mode: CreateMode) -> Result<(String, Stat)> {
        self.count();
        self.inner.create(path, data, mode).await
    }

    async fn get(&self, path: &str) -> Result<(Vec<u8>, Stat)> {
        self.count();
        self.inner.get(path).await
    }

    async fn get_watch(&self, path: &str) -> Result<(Vec<u8>, Stat, Watch)> {
        self.count();
        self.inner.get_watch(path).await
    }

    async fn exists(&self, path: &str) -> Result<Option<Stat>> {
        self.count();
        self.inner.exists(path).await
    }

    async fn exists_watch(&self, path: &str) -> Result<(Option<Stat>, Watch)> {
        self.count();
        self.inner.exists_watch(path).await
    }

    async fn set(&self, path: &str, data: &[u8], version: Option<i32>) -> Result<Stat> {
        self.count();
        self.inner.set(path, data, version).await
    }

    async fn delete(&self, path: &str, version: Option<i32>) -> Result<()> {
        self.count();
        self.inner.delete(path, version).await
    }

    async fn children(&self, path: &str) -> Result<(Vec<String>, Stat)> {
        self.count();
        self.inner.children(path).await
    }

    async fn children_watch(&self, path: &str) -> Result<(Vec<String>, Stat, Watch)> {
        self.count();
        self.inner.children_watch(path).await
    }

    async fn multi(&self, ops: Vec<Op>) -> Result<Vec<OpResult>> {
        self.count();
        self.inner.multi(ops).await
    }

    async fn close(&self) {
        self.inner.close().await
    }
}
