//! Simulated coordination: the embedded store (in memory) behind a fault
//! injector that gives each node ZooKeeper's failure behaviour.
//!
//! * Every request takes a random latency.
//! * A request may fail with connection loss before it reaches the store, or
//!   *after* it was applied (the caller cannot tell which).
//! * A node cut off from coordination gets connection loss for every request and
//!   stops heartbeating: if the cut outlasts its session timeout, the session
//!   expires and its ephemerals vanish; healed earlier, the session lives on.
//! * A crashed node's sessions are abandoned, not closed: their ephemerals stay
//!   until the timeout, as with a real ZooKeeper.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use ferry_coord::embedded::{EmbeddedOptions, EmbeddedSession, EmbeddedStore};
use ferry_coord::{
    CoordError, CoordMetrics, Coordination, CreateMode, Op, OpResult, Result, SessionState, Stat,
    Watch,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

/// Fault settings of simulated coordination.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CoordFaults {
    pub min_latency: Duration,
    pub max_latency: Duration,
    /// Chance a request fails with connection loss without being applied.
    pub fail_before_prob: f64,
    /// Chance a request is applied and then reported as connection loss.
    pub fail_after_prob: f64,
}

impl Default for CoordFaults {
    fn default() -> Self {
        CoordFaults {
            min_latency: Duration::from_millis(1),
            max_latency: Duration::from_millis(3),
            fail_before_prob: 0.0,
            fail_after_prob: 0.0,
        }
    }
}

struct State {
    rng: SmallRng,
    faults: CoordFaults,
    partitioned: BTreeSet<String>,
    sessions: Vec<(String, Weak<FaultySession>)>,
}

/// Opens the sessions of one simulated node.
#[derive(Clone)]
pub struct SimSessions {
    sim: SimCoordination,
    node: String,
    timeout: Duration,
}

#[async_trait::async_trait]
impl ferry_coord::SessionFactory for SimSessions {
    async fn open(&self) -> Result<ferry_coord::Session> {
        let session: ferry_coord::Session = self.sim.session(&self.node, self.timeout).await?;
        Ok(session)
    }
}

/// Coordination for a simulated world.
#[derive(Clone)]
pub struct SimCoordination {
    store: EmbeddedStore,
    state: Arc<Mutex<State>>,
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

fn loss(detail: &str) -> CoordError {
    CoordError::ConnectionLoss {
        detail: detail.to_string(),
    }
}

impl SimCoordination {
    pub async fn new(seed: u64, faults: CoordFaults) -> Result<SimCoordination> {
        let store = EmbeddedStore::in_memory(EmbeddedOptions::default())
            .await
            .map_err(|e| CoordError::Backend(e.to_string()))?;
        Ok(SimCoordination {
            store,
            state: Arc::new(Mutex::new(State {
                rng: SmallRng::seed_from_u64(seed),
                faults,
                partitioned: BTreeSet::new(),
                sessions: Vec::new(),
            })),
        })
    }

    pub fn set_faults(&self, faults: CoordFaults) {
        lock(&self.state).faults = faults;
    }

    /// A session for `node`.
    pub async fn session(&self, node: &str, timeout: Duration) -> Result<Arc<FaultySession>> {
        let inner = self.store.session(timeout).await?;
        inner.set_heartbeats_paused(self.partitioned(node));
        let session = Arc::new(FaultySession {
            id: inner.session_id(),
            inner: Mutex::new(Some(Arc::new(inner))),
            node: node.to_string(),
            sim: self.clone(),
        });
        let mut st = lock(&self.state);
        st.sessions.retain(|(_, w)| w.strong_count() > 0);
        st.sessions
            .push((node.to_string(), Arc::downgrade(&session)));
        Ok(session)
    }

    /// A [`SessionFactory`](ferry_coord::SessionFactory) that opens `node`'s
    /// sessions, as node code holds one to recover from session expiry.
    pub fn factory(&self, node: &str, timeout: Duration) -> SimSessions {
        SimSessions {
            sim: self.clone(),
            node: node.to_string(),
            timeout,
        }
    }

    fn sessions_of(&self, node: &str) -> Vec<Arc<FaultySession>> {
        lock(&self.state)
            .sessions
            .iter()
            .filter(|(n, _)| n == node)
            .filter_map(|(_, w)| w.upgrade())
            .collect()
    }

    /// Cuts `node` off from coordination.
    pub fn partition(&self, node: &str) {
        lock(&self.state).partitioned.insert(node.to_string());
        for s in self.sessions_of(node) {
            s.with_inner(|i| i.set_heartbeats_paused(true));
        }
    }

    /// Reconnects every node.
    pub fn repair_all(&self) {
        let nodes: Vec<String> = std::mem::take(&mut lock(&self.state).partitioned)
            .into_iter()
            .collect();
        for node in nodes {
            for s in self.sessions_of(&node) {
                s.with_inner(|i| i.set_heartbeats_paused(false));
            }
        }
    }

    /// `node` crashed: its sessions are abandoned (they expire after their
    /// timeout) and every handle it held stops working.
    pub fn crash_node(&self, node: &str) {
        for s in self.sessions_of(node) {
            if let Some(inner) = s.take_inner() {
                inner.abandon();
            }
        }
    }

    /// Expires every live session of `node` now (as a long partition or a
    /// stalled process would); returns how many.
    pub async fn expire_node(&self, node: &str) -> Result<usize> {
        let mut n = 0;
        for s in self.sessions_of(node) {
            if s.current().is_some() && self.store.expire_session(s.id).await? {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Expires a session now.
    pub async fn expire(&self, session_id: i64) -> Result<bool> {
        self.store.expire_session(session_id).await
    }

    /// The sessions the store holds alive now.
    pub async fn live_sessions(&self) -> Result<Vec<i64>> {
        self.store.live_sessions().await
    }

    fn partitioned(&self, node: &str) -> bool {
        lock(&self.state).partitioned.contains(node)
    }

    fn draw(&self) -> (Duration, bool, bool) {
        let mut s = lock(&self.state);
        let f = s.faults;
        let lo = f.min_latency.as_micros() as u64;
        let hi = (f.max_latency.as_micros() as u64).max(lo);
        let latency = Duration::from_micros(s.rng.random_range(lo..=hi));
        let before = f.fail_before_prob > 0.0 && s.rng.random_bool(f.fail_before_prob.min(1.0));
        let after = f.fail_after_prob > 0.0 && s.rng.random_bool(f.fail_after_prob.min(1.0));
        (latency, before, after)
    }
}

/// A node's session through the fault injector.
pub struct FaultySession {
    inner: Mutex<Option<Arc<EmbeddedSession>>>,
    id: i64,
    node: String,
    sim: SimCoordination,
}

impl FaultySession {
    fn with_inner<T>(&self, f: impl FnOnce(&EmbeddedSession) -> T) -> Option<T> {
        self.current().map(|s| f(&s))
    }

    fn current(&self) -> Option<Arc<EmbeddedSession>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn take_inner(&self) -> Option<Arc<EmbeddedSession>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// The first half of a request: latency, partition and loss on the way.
    async fn before(&self) -> Result<(Arc<EmbeddedSession>, Duration, bool)> {
        let (latency, fail_before, fail_after) = self.sim.draw();
        tokio::time::sleep(latency).await;
        if self.sim.partitioned(&self.node) {
            return Err(loss("partitioned from coordination"));
        }
        if fail_before {
            return Err(loss("injected: request lost on the way"));
        }
        let inner = self.current().ok_or_else(|| loss("node crashed"))?;
        Ok((inner, latency, fail_after))
    }

    /// The second half: latency back, and an answer lost after the request was
    /// applied.
    async fn after<T>(&self, result: Result<T>, latency: Duration, fail_after: bool) -> Result<T> {
        tokio::time::sleep(latency).await;
        if fail_after && result.is_ok() {
            return Err(loss("injected: applied, answer lost"));
        }
        result
    }
}

/// One request through the fault injector.
macro_rules! faulty {
    ($self:ident, $call:ident ( $($arg:expr),* )) => {{
        let (inner, latency, fail_after) = $self.before().await?;
        let result = inner.$call($($arg),*).await;
        $self.after(result, latency, fail_after).await
    }};
}

#[async_trait]
impl Coordination for FaultySession {
    fn session_id(&self) -> i64 {
        self.id
    }

    fn session_state(&self) -> watch::Receiver<SessionState> {
        self.with_inner(|i| i.session_state())
            .unwrap_or_else(|| watch::channel(SessionState::Closed).1)
    }

    fn metrics(&self) -> Arc<CoordMetrics> {
        self.with_inner(|i| i.metrics()).unwrap_or_default()
    }

    async fn create(&self, path: &str, data: &[u8], mode: CreateMode) -> Result<(String, Stat)> {
        faulty!(self, create(path, data, mode))
    }

    async fn get(&self, path: &str) -> Result<(Vec<u8>, Stat)> {
        faulty!(self, get(path))
    }

    async fn get_watch(&self, path: &str) -> Result<(Vec<u8>, Stat, Watch)> {
        faulty!(self, get_watch(path))
    }

    async fn exists(&self, path: &str) -> Result<Option<Stat>> {
        faulty!(self, exists(path))
    }

    async fn exists_watch(&self, path: &str) -> Result<(Option<Stat>, Watch)> {
        faulty!(self, exists_watch(path))
    }

    async fn set(&self, path: &str, data: &[u8], version: Option<i32>) -> Result<Stat> {
        faulty!(self, set(path, data, version))
    }

    async fn delete(&self, path: &str, version: Option<i32>) -> Result<()> {
        faulty!(self, delete(path, version))
    }

    async fn children(&self, path: &str) -> Result<(Vec<String>, Stat)> {
        faulty!(self, children(path))
    }

    async fn children_watch(&self, path: &str) -> Result<(Vec<String>, Stat, Watch)> {
        faulty!(self, children_watch(path))
    }

    async fn multi(&self, ops: Vec<Op>) -> Result<Vec<OpResult>> {
        faulty!(self, multi(ops))
    }

    async fn close(&self) {
        if let Some(inner) = self.take_inner() {
            inner.close().await;
        }
    }
}
