//! The driver task: its loop over connection events, commands and the
//! heartbeat tick, the election timeout and replica expiry on each tick, the
//! proposer's actions carried out (frames sent, appends acknowledged, a lost
//! leadership), and the end of a clean shutdown.

use std::collections::VecDeque;
use std::time::Duration;

use ferry_wal::proto::ForgottenReplica;
use tokio::sync::mpsc;

use super::connection::{epoch_of, Event};
use super::{Command, Driver, WriterError};
use crate::proposer::{Action, Proposer};

/// How long a clean shutdown waits for the safekeepers to learn the final
/// commit_lsn once the checkpoint is committed.
const SHUTDOWN_ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(5);

/// Most queued commands taken together into one send.
const MAX_COMMANDS_PER_BATCH: usize = 1024;

impl Driver {
    pub(super) async fn run(
        mut self,
        mut events: mpsc::Receiver<Event>,
        mut commands: mpsc::Receiver<Command>,
    ) {
        let mut heartbeat = tokio::time::interval(self.config.heartbeat);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let actions = tokio::select! {
                biased;
                Some(event) = events.recv() => self.on_event(event),
                Some(cmd) = commands.recv() => {
                    // Take every append already waiting, so that they leave in one
                    // message per safekeeper (the writer's half of group commit).
                    self.batching = true;
                    let mut actions = self.on_command(cmd);
                    // Let the other tasks that are ready run first: callers woken
                    // by the same commit queue their next appends meanwhile.
                    tokio::task::yield_now().await;
                    for _ in 0..MAX_COMMANDS_PER_BATCH {
                        match commands.try_recv() {
                            Ok(cmd) => actions.extend(self.on_command(cmd)),
                            Err(_) => break,
                        }
                    }
                    self.batching = false;
                    actions.extend(self.proposer.send_pending());
                    actions
                }
                _ = heartbeat.tick() => self.on_tick(),
                else => return,
            };
            if !self.apply(actions) {
                return;
            }
            // Feedback may have moved the slowest replica: what waited for it
            // goes now.
            if !self.queued.is_empty() {
                let released = self.release_queued();
                if !released.is_empty() && !self.apply(released) {
                    return;
                }
            }
            if let Some((target, deadline)) = self.announcing {
                let (knowing, streaming) = self.proposer.peers_knowing_commit(target);
                let quorum = self.config.safekeepers.len() / 2 + 1;
                let everyone = knowing == streaming && knowing >= quorum;
                if everyone || tokio::time::Instant::now() >= deadline {
                    if !everyone {
                        tracing::warn!(
                            knowing,
                            streaming,
                            "shutdown: not every safekeeper confirmed the final commit_lsn in time"
                        );
                    }
                    if let Some(reply) = self.shutdown.take() {
                        let _ = reply.send(Ok(target));
                    }
                    self.publish_status();
                    if !self.linger_after_shutdown {
                        return;
                    }
                    self.announcing = None;
                }
            }
            self.publish_status();
        }
    }

    fn on_event(&mut self, event: Event) -> Vec<Action> {
        match event {
            Event::Connected(peer, generation, tx) => {
                if epoch_of(generation) != self.conn_epoch || peer >= self.conns.len() {
                    // A connection of a replaced configuration.
                    return Vec::new();
                }
                self.conns[peer] = Some((generation, tx));
                self.proposer.on_connected(peer)
            }
            Event::Message(peer, generation, msg) => {
                if self
                    .conns
                    .get(peer)
                    .and_then(|c| c.as_ref())
                    .is_some_and(|(g, _)| *g == generation)
                {
                    self.proposer.on_message(peer, msg)
                } else {
                    Vec::new()
                }
            }
            Event::Disconnected(peer, generation) => {
                if self
                    .conns
                    .get(peer)
                    .and_then(|c| c.as_ref())
                    .is_some_and(|(g, _)| *g == generation)
                {
                    self.conns[peer] = None;
                    self.proposer.on_disconnected(peer)
                } else {
                    Vec::new()
                }
            }
        }
    }

    fn on_tick(&mut self) -> Vec<Action> {
        let timed_out = !self.proposer.is_elected()
            && self.attempt_started.elapsed() > self.config.election_timeout;
        if timed_out || self.proposer.lost_election() {
            // Split vote, lost quorum, or a higher term left by another writer
            // (perhaps long gone): start over above every term seen.
            let term = self.proposer.term();
            tracing::info!(term, "starting a new election above this term");
            self.restart_proposer(term);
            return Vec::new();
        }
        self.expire_replicas();
        self.proposer.heartbeat()
    }

    /// Forgets replicas silent past the replica expiry (see
    /// [`ferry_wal::liveness`]).
    fn expire_replicas(&mut self) {
        let now = tokio::time::Instant::now();
        let known: Vec<_> = self.proposer.replica_feedback().copied().collect();
        for fb in self
            .liveness
            .expired(known.iter(), now, self.config.replica_expiry)
        {
            tracing::warn!(
                shard = fb.shard_number,
                replica = fb.replica_number,
                disk_consistent_lsn = %fb.disk_consistent_lsn,
                expiry = ?self.config.replica_expiry,
                "replica silent past the replica expiry: it no longer holds back-pressure"
            );
            self.proposer.forget_replica(ForgottenReplica {
                shard_number: fb.shard_number,
                replica_number: fb.replica_number,
                reply_time_micros: fb.reply_time_micros,
            });
        }
    }

    /// Carries out actions; returns false when the writer must stop.
    fn apply(&mut self, actions: Vec<Action>) -> bool {
        let mut queue: VecDeque<Action> = actions.into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Send { to, msg } => {
                    let sent = match &self.conns[to] {
                        Some((_, tx)) => tx.try_send(msg).is_ok(),
                        None => true,
                    };
                    if !sent {
                        // The connection cannot keep up: start it over.
                        self.conns[to] = None;
                        queue.extend(self.proposer.on_disconnected(to));
                    }
                }
                Action::Elected {
                    term,
                    epoch_start_lsn,
                } => {
                    tracing::info!(term, %epoch_start_lsn, "writer elected");
                    self.election_blocked = None;
                    queue.extend(self.release_queued());
                }
                Action::Committed { commit_lsn } => {
                    while self
                        .waiters
                        .front()
                        .is_some_and(|(end, _)| *end <= commit_lsn)
                    {
                        if let Some((end, reply)) = self.waiters.pop_front() {
                            let _ = reply.send(Ok(end));
                        }
                    }
                    if self.waiters.is_empty()
                        && self.queued.is_empty()
                        && self.shutdown.is_some()
                        && self.announcing.is_none()
                    {
                        // The checkpoint is committed. Tell the safekeepers, so
                        // that their walsenders can hand it to the replicas.
                        self.announcing = Some((
                            commit_lsn,
                            tokio::time::Instant::now() + SHUTDOWN_ANNOUNCE_TIMEOUT,
                        ));
                        queue.extend(self.proposer.heartbeat());
                    }
                }
                Action::Superseded { term, reason } => {
                    self.superseded_by = Some(term);
                    // Sent but not known committed: the outcome is unknown.
                    for (_, reply) in self.waiters.drain(..) {
                        let _ = reply.send(Err(WriterError::Superseded { term }));
                    }
                    if let Some(reply) = self.shutdown.take() {
                        let _ = reply.send(Err(WriterError::Superseded { term }));
                    }
                    if self.config.reelect_when_superseded {
                        // Appends not yet sent wait for the new election.
                        tracing::warn!(term, %reason, "writer superseded; electing again above that term");
                        self.restart_proposer(term);
                        // What the old proposer asked for no longer applies.
                        queue.clear();
                        continue;
                    }
                    tracing::warn!(term, %reason, "writer superseded; stopping");
                    for (_, reply) in self.queued.drain(..) {
                        let _ = reply.send(Err(WriterError::Superseded { term }));
                    }
                    self.publish_status();
                    return false;
                }
                Action::Reconnect { peer } => {
                    self.conns[peer] = None;
                }
                Action::BehindKnownCommit {
                    best_flush_lsn,
                    known_commit_lsn,
                    all_voted,
                } => {
                    let reason = format!(
                        "the WAL quorum is younger than the cluster: WAL up to {known_commit_lsn} is known committed, but the safekeepers that voted hold WAL only up to {best_flush_lsn}"
                    );
                    if all_voted {
                        tracing::error!(%reason, "every safekeeper voted; the writer stops");
                        self.fail_pending();
                        self.refused = Some(format!("{reason} (every safekeeper answered)"));
                        self.publish_status();
                        return false;
                    }
                    self.election_blocked =
                        Some(format!("{reason}; waiting for the other safekeepers"));
                }
                Action::RefusedByAll { reasons } => {
                    let reason = format!(
                        "every safekeeper refused this writer: {}",
                        reasons.join("; ")
                    );
                    tracing::error!(%reason, "the writer stops");
                    self.fail_pending();
                    self.refused = Some(reason);
                    self.publish_status();
                    return false;
                }
                Action::Members {
                    configuration,
                    slots,
                } => {
                    tracing::info!(
                        configuration = %configuration.describe(),
                        "the safekeeper set changed; the writer goes on with it in its term"
                    );
                    // The proposer's slots now; a new election starts on
                    // the configuration's own (`restart_proposer`).
                    self.config.proposer.configuration = Some(configuration);
                    self.config.safekeepers = slots
                        .iter()
                        .map(|s| s.clone().unwrap_or_default())
                        .collect();
                    self.conns.resize(slots.len(), None);
                    for (slot, addr) in slots.iter().enumerate() {
                        if addr.is_none() {
                            self.conns[slot] = None;
                        }
                    }
                    self.connections.set_slots(&self.config.safekeepers);
                }
                Action::Reconfigure { configuration } => {
                    self.reconfigure(configuration);
                    // What the old proposer asked for no longer applies.
                    queue.clear();
                }
                Action::ElectionLost { term, reason } => {
                    // Queued appends wait for the next attempt (started by the
                    // next tick, above `term`).
                    tracing::info!(term, %reason, "election lost to a higher term; trying again");
                }
            }
        }
        true
    }

    /// Starts over with a newer configuration: appends in flight have an
    /// unknown outcome (a writer of the new configuration may or may not
    /// keep them), appends not sent yet wait for the new election, which
    /// runs above this writer's term and never below what it saw committed.
    fn reconfigure(&mut self, configuration: ferry_wal::membership::Configuration) {
        let generation = configuration.generation;
        tracing::info!(
            configuration = %configuration.describe(),
            "the safekeeper set changed; the writer starts over with it"
        );
        for (_, reply) in self.waiters.drain(..) {
            let _ = reply.send(Err(WriterError::Reconfigured { generation }));
        }
        if let Some(reply) = self.shutdown.take() {
            let _ = reply.send(Err(WriterError::Reconfigured { generation }));
        }
        self.announcing = None;
        self.config.proposer.configuration = Some(configuration);
        self.config.proposer.known_commit_lsn = self
            .config
            .proposer
            .known_commit_lsn
            .max(self.proposer.commit_lsn());
        self.restart_proposer(self.proposer.term());
        self.publish_status();
    }

    /// A new proposer for an election above `min_term`. Its slots are its
    /// configuration's members; when they differ from the connections' (a
    /// configuration taken since), the connections start over on them, else
    /// each is dropped and made again (a clean stream for the greeting).
    fn restart_proposer(&mut self, min_term: ferry_wal::Term) {
        let mut config = self.config.proposer.clone();
        config.min_term = min_term;
        let members: Option<Vec<String>> = config
            .configuration
            .as_ref()
            .map(|c| c.all_members().into_iter().map(|m| m.addr).collect());
        match members {
            Some(addrs) if addrs != self.config.safekeepers => {
                config.safekeepers = addrs.len();
                self.config.safekeepers = addrs;
                self.conns = vec![None; self.config.safekeepers.len()];
                self.conn_epoch = self.connections.start(&self.config.safekeepers);
            }
            _ => {
                // Dropping the senders makes the connection tasks reconnect.
                for conn in self.conns.iter_mut() {
                    *conn = None;
                }
            }
        }
        self.config.proposer.safekeepers = config.safekeepers;
        self.proposer = Proposer::new(config);
        self.attempt_started = tokio::time::Instant::now();
    }

    /// Fails everything waiting for an election that will not come: nothing
    /// was sent in this attempt, so it simply did not happen.
    fn fail_pending(&mut self) {
        for (_, reply) in self.queued.drain(..) {
            let _ = reply.send(Err(WriterError::Stopped));
        }
        if let Some(reply) = self.shutdown.take() {
            let _ = reply.send(Err(WriterError::Stopped));
        }
    }
}
