//! The store task: takes every queued command (up to the batch limit),
//! applies them in arrival order, makes the batch durable with one append to
//! the log, and only then fires the batch's watches and sends its answers.
//! A failed log write stops the store serving (fail-stop). While its
//! disk-full breaker is open, new writes are refused before anything of them
//! is applied (`Store::request`), and no snapshot is started.

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Command, EmbeddedOptions, Pending, Store};
use crate::error::CoordError;
use crate::types::SessionState;

impl Store {
    pub(super) async fn run(
        mut self,
        mut rx: mpsc::Receiver<Command>,
        self_tx: mpsc::WeakSender<Command>,
        space_watch: Option<JoinHandle<()>>,
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
        if let Some(watch) = space_watch {
            watch.abort();
        }
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
        // A snapshot needs room for a copy of the tree: short of disk space,
        // it waits until space returns (the log holds every transaction).
        let space_short = self.space.as_ref().is_some_and(|s| s.check().is_err());
        if self.failed.is_none() && !space_short {
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
