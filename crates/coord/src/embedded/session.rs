//! Sessions: opened by the store (ids in a boot epoch), kept alive by the
//! heartbeat of their handle, expired when not heard from for their timeout
//! or closed by their owner, taking their ephemerals and watches with them;
//! and the session handle's own state (paused heartbeats, abandonment, a
//! closed or expired session answering at once).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::{
    send, stopped, Command, EmbeddedSession, EmbeddedStore, SessionEntry, Store,
    MAX_SESSION_TIMEOUT, MIN_SESSION_TIMEOUT, SESSION_COUNTER_BITS,
};
use crate::error::{CoordError, Result};
use crate::metrics::CoordMetrics;
use crate::types::{SessionState, WatchEventKind};

impl EmbeddedStore {
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
    pub(super) fn open_session(
        &mut self,
        timeout: Duration,
    ) -> Result<(i64, watch::Receiver<SessionState>)> {
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

    pub(super) fn end_session(&mut self, session: i64, state: SessionState) -> bool {
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

    pub(super) fn local_state_error(&self) -> Option<CoordError> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Some(CoordError::SessionClosed);
        }
        match *self.state.borrow() {
            SessionState::Expired => Some(CoordError::SessionExpired),
            SessionState::Closed => Some(CoordError::SessionClosed),
            SessionState::Connected | SessionState::Disconnected => None,
        }
    }
}
