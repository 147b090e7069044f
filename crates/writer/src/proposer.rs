//! The proposer state machine.
//!
//! Election (after Neon's walproposer, itself Paxos-like):
//! 1. greet every safekeeper; once a quorum answered, take a term above every
//!    term heard and ask everyone for a vote;
//! 2. with a quorum of votes, the donor is the voter with the highest
//!    `(last_log_term, flush_lsn)`; its flush_lsn is the epoch start: all WAL the
//!    new term builds on. Every committed record is on a quorum, and that quorum
//!    intersects the voters, so the donor holds it: an election never proposes less
//!    than the committed LSN;
//! 3. each safekeeper is told where its WAL stops agreeing with the donor's
//!    (`start_streaming_at`); it truncates there and receives WAL from there on.
//!    WAL the writer does not hold yet is read from the donor first.
//!
//! Commit: `commit_lsn` is the highest LSN flushed by a quorum *in this term*;
//! flush positions below the epoch start count as nothing, so WAL of an older term
//! is committed only together with the new term's start (no commit from a previous
//! term). Appends always carry whole records, so every flush_lsn and commit_lsn is
//! a record boundary.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use ferry_wal::proto::{
    AppendRequest, ForgottenReplica, FromSafekeeper, Greeting, GreetingResponse, ProposerElected,
    ShardFeedback, ToSafekeeper, VoteResponse, MAX_READ_WAL_BYTES,
};
use ferry_wal::record;
use ferry_wal::{ClusterId, Lsn, Term, TermHistory};

use crate::buffer::WalBuffer;

/// Limits and identity of a proposer.
#[derive(Debug, Clone)]
pub struct ProposerConfig {
    /// The cluster whose safekeepers this writer writes to (they refuse others).
    pub cluster_id: ClusterId,
    /// Number of safekeepers; a quorum is a majority of them.
    pub safekeepers: usize,
    pub timeline_id: u64,
    pub segment_bytes: u64,
    /// Random id of this writer incarnation.
    pub proposer_id: u128,
    /// Elect a term strictly above this one (a restarted writer passes the term it
    /// last held, so it never reuses it).
    pub min_term: Term,
    /// WAL known to be committed from a record outside the safekeepers (the
    /// coordination store's last known commit state). An election whose voters
    /// all hold less is not completed: the quorum is younger than what was
    /// committed (a safekeeper's data was lost or restored from an old copy),
    /// and electing it would silently drop acknowledged WAL.
    pub known_commit_lsn: Lsn,
    /// Most WAL bytes in one append message (whole records; a bigger record goes
    /// alone).
    pub max_append_bytes: usize,
    /// Most unacknowledged WAL bytes in flight to one safekeeper.
    pub max_in_flight_bytes: u64,
    /// Most WAL bytes kept in memory for safekeepers that lag behind; beyond it the
    /// buffer is trimmed to the quorum, and a lagging safekeeper is caught up by
    /// reading from an up-to-date one.
    pub max_buffered_bytes: u64,
    /// A safekeeper whose flush_lsn is this far behind commit_lsn or more is
    /// not given the backup duty (Neon's max_offloader_lag).
    pub max_offloader_lag_bytes: u64,
    /// Most WAL bytes asked for in one recovery read (1 to
    /// [`MAX_READ_WAL_BYTES`]); a longer range is read as several.
    pub max_read_wal_bytes: u64,
}

impl ProposerConfig {
    /// Defaults for `safekeepers` safekeepers.
    pub fn new(
        cluster_id: ClusterId,
        safekeepers: usize,
        timeline_id: u64,
        segment_bytes: u64,
        proposer_id: u128,
    ) -> ProposerConfig {
        ProposerConfig {
            cluster_id,
            known_commit_lsn: Lsn(0),
            safekeepers,
            timeline_id,
            segment_bytes,
            proposer_id,
            min_term: 0,
            max_append_bytes: 1 << 20,
            max_in_flight_bytes: 16 << 20,
            max_buffered_bytes: 256 << 20,
            max_offloader_lag_bytes: 128 << 20,
            max_read_wal_bytes: MAX_READ_WAL_BYTES,
        }
    }
}

/// Most replicas whose feedback the writer keeps.
pub const MAX_FEEDBACK_REPLICAS: usize = 4096;

/// Positions a replica reports, or the lowest of several replicas'.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ReplicaPositions {
    pub last_received_lsn: Lsn,
    pub disk_consistent_lsn: Lsn,
    pub remote_consistent_lsn: Lsn,
}

impl ReplicaPositions {
    pub fn of(fb: &ShardFeedback) -> ReplicaPositions {
        ReplicaPositions {
            last_received_lsn: fb.last_received_lsn,
            disk_consistent_lsn: fb.disk_consistent_lsn,
            remote_consistent_lsn: fb.remote_consistent_lsn,
        }
    }

    /// Each position the lower of the two.
    pub fn min(self, other: ReplicaPositions) -> ReplicaPositions {
        ReplicaPositions {
            last_received_lsn: self.last_received_lsn.min(other.last_received_lsn),
            disk_consistent_lsn: self.disk_consistent_lsn.min(other.disk_consistent_lsn),
            remote_consistent_lsn: self.remote_consistent_lsn.min(other.remote_consistent_lsn),
        }
    }
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Send {
        to: usize,
        msg: ToSafekeeper,
    },
    /// This writer is elected: from now on [`Proposer::append`] works.
    Elected {
        term: Term,
        epoch_start_lsn: Lsn,
    },
    /// WAL up to here is committed: acknowledge inserts that end at or below it.
    Committed {
        commit_lsn: Lsn,
    },
    /// A higher term exists after this writer was elected: it must stop;
    /// nothing it has not seen committed may be acknowledged.
    Superseded {
        term: Term,
        reason: String,
    },
    /// A higher term exists before this writer was elected (left by a writer
    /// that may be long gone): this election is lost and a new one must start
    /// above `term`, after a pause. Nothing was acknowledged in this attempt.
    ElectionLost {
        term: Term,
        reason: String,
    },
    /// The connection to this safekeeper is in a bad state: drop it and connect
    /// again (the safekeeper then starts over with a greeting).
    Reconnect {
        peer: usize,
    },
    /// A quorum voted, but no voter holds the WAL known to be committed
    /// ([`ProposerConfig::known_commit_lsn`]): the election waits for the other
    /// safekeepers. With `all_voted`, every safekeeper answered and none has
    /// it: the WAL quorum is younger than the record, and this writer must stop
    /// (electing would lose committed WAL).
    BehindKnownCommit {
        best_flush_lsn: Lsn,
        known_commit_lsn: Lsn,
        all_voted: bool,
    },
    /// Every safekeeper refused this writer's greeting (another cluster,
    /// timeline or segment size): no election can ever succeed with this
    /// configuration, so the writer must stop and name the refusals.
    RefusedByAll {
        reasons: Vec<String>,
    },
}

/// Why [`Proposer::append`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProposerError {
    #[error("not elected (yet)")]
    NotElected,
    #[error("superseded by term {0}")]
    Superseded(Term),
    #[error("invalid WAL: {0}")]
    InvalidRecords(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Peer {
    Offline,
    /// Greeting sent.
    Greeting,
    /// Refused the greeting (another cluster, timeline or segment size, or a
    /// safekeeper stopped on a disk error). Greeted again on its next
    /// connection; every safekeeper refused at once stops the writer.
    Refused {
        reason: String,
    },
    /// Greeted; its term is known.
    Greeted {
        term: Term,
    },
    /// Vote request sent.
    Voting,
    /// Answered the vote request of this term.
    Voted(VoteResponse),
    /// Restored from the backup, quarantine over, greeted: it does not vote;
    /// brought back once this writer is elected and proved current.
    Restored {
        flush_lsn: Lsn,
    },
    /// Restored, and waiting for a quorum of the others to answer an append
    /// carrying `probe` (sent after its greeting) in this term.
    Rejoining {
        flush_lsn: Lsn,
        probe: u64,
    },
    /// ProposerElected sent; waiting for its answer.
    Electing {
        start: Lsn,
    },
    /// Receives WAL.
    Streaming {
        flush_lsn: Lsn,
        next_send: Lsn,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Greeting,
    Voting,
    Elected,
    /// Saw a higher term while electing; waits to be replaced by a new attempt.
    Lost,
    Stopped,
}

/// A read of WAL the writer does not hold, from an up-to-date safekeeper.
#[derive(Debug, Clone)]
struct Fetch {
    /// The safekeeper read from; `None` while paused: the source went away and
    /// no other can serve yet. What was received is kept, so a long read (from
    /// a peer's WAL backup, where a transient failure is common) resumes from
    /// where it stopped instead of starting over.
    source: Option<usize>,
    begin: Lsn,
    end: Lsn,
    /// The end of the reads asked for so far: one read at a time, each at
    /// most `max_read_wal_bytes`.
    requested: Lsn,
    received: BytesMut,
}

/// The proposer of one writer incarnation.
#[derive(Debug)]
pub struct Proposer {
    config: ProposerConfig,
    quorum: usize,
    phase: Phase,
    term: Term,
    peers: Vec<Peer>,
    history: TermHistory,
    epoch_start_lsn: Lsn,
    /// WAL held in memory for the safekeepers.
    buffer: WalBuffer,
    fetch: Option<Fetch>,
    /// The donor of the election: its WAL up to the epoch start is this term's.
    donor: Option<usize>,
    commit_lsn: Lsn,
    truncate_lsn: Lsn,
    /// The newest feedback of each (shard, replica), relayed by safekeepers.
    feedback: BTreeMap<(u32, u32), ShardFeedback>,
    /// The last greeting refusal logged per safekeeper.
    refusals_logged: Vec<Option<String>>,
    /// Forgotten replicas: their feedback up to a tombstone is ignored.
    forgotten: ferry_wal::liveness::Tombstones,
    /// The commit_lsn each safekeeper last reported (it learns it from appends).
    peer_commit: Vec<Lsn>,
    /// The highest backup_lsn any safekeeper reported; relayed to all of them.
    backup_lsn: Lsn,
    /// Carried by every append; raised to prove a safekeeper's term after
    /// some point (a restored safekeeper's greeting).
    probe: u64,
    /// The highest probe each safekeeper echoed in this term.
    peer_probe: Vec<u64>,
}

impl Proposer {
    pub fn new(config: ProposerConfig) -> Proposer {
        assert!(config.safekeepers >= 1, "need at least one safekeeper");
        let n = config.safekeepers;
        Proposer {
            quorum: config.safekeepers / 2 + 1,
            peers: vec![Peer::Offline; config.safekeepers],
            term: config.min_term,
            config,
            phase: Phase::Greeting,
            history: TermHistory::default(),
            epoch_start_lsn: Lsn(0),
            buffer: WalBuffer::new(Lsn(0)),
            fetch: None,
            donor: None,
            commit_lsn: Lsn(0),
            truncate_lsn: Lsn(0),
            feedback: BTreeMap::new(),
            forgotten: Default::default(),
            refusals_logged: vec![None; n],
            peer_commit: vec![Lsn(0); n],
            backup_lsn: Lsn(0),
            probe: 0,
            peer_probe: vec![0; n],
        }
    }

    pub fn term(&self) -> Term {
        self.term
    }

    pub fn is_elected(&self) -> bool {
        self.phase == Phase::Elected
    }

    pub fn commit_lsn(&self) -> Lsn {
        self.commit_lsn
    }

    pub fn epoch_start_lsn(&self) -> Lsn {
        self.epoch_start_lsn
    }

    /// End of the WAL this writer has produced or recovered.
    pub fn end_lsn(&self) -> Lsn {
        self.buffer.end()
    }

    /// Forgets a replica's feedback up to `forget.reply_time_micros` (a
    /// safekeeper forgot it: unregistered, or silent past the replica
    /// expiry; or this writer's own expiry): it stops holding back-pressure
    /// and the removal horizon this writer relays. Returns whether it was
    /// known. A newer reply registers it again.
    pub fn forget_replica(&mut self, forget: ForgottenReplica) -> bool {
        let key = (forget.shard_number, forget.replica_number);
        let known = self
            .feedback
            .get(&key)
            .is_some_and(|f| f.reply_time_micros <= forget.reply_time_micros);
        if known {
            self.feedback.remove(&key);
        }
        self.forgotten.add(forget);
        known
    }

    /// The latest feedback of every replica, in (shard, replica) order.
    pub fn replica_feedback(&self) -> impl Iterator<Item = &ShardFeedback> {
        self.feedback.values()
    }

    /// For each shard, the lowest positions over its replicas: how far the
    /// slowest replica of the shard is (back-pressure acts on it).
    pub fn shard_minimums(&self) -> BTreeMap<u32, ReplicaPositions> {
        let mut out: BTreeMap<u32, ReplicaPositions> = BTreeMap::new();
        for fb in self.feedback.values() {
            let p = ReplicaPositions::of(fb);
            out.entry(fb.shard_number)
                .and_modify(|m| *m = m.min(p))
                .or_insert(p);
        }
        out
    }

    /// The lowest positions over every replica of every shard.
    pub fn overall_minimum(&self) -> Option<ReplicaPositions> {
        self.feedback
            .values()
            .map(ReplicaPositions::of)
            .reduce(ReplicaPositions::min)
    }

    /// Flush positions of the safekeepers that stream in this term.
    pub fn peer_flush_lsns(&self) -> Vec<Option<Lsn>> {
        self.peers
            .iter()
            .map(|p| match p {
                Peer::Streaming { flush_lsn, .. } => Some(*flush_lsn),
                _ => None,
            })
            .collect()
    }

    /// How many streaming safekeepers reported a commit_lsn at or past `lsn`, and
    /// how many stream at all.
    pub fn peers_knowing_commit(&self, lsn: Lsn) -> (usize, usize) {
        let mut knowing = 0;
        let mut streaming = 0;
        for (peer, state) in self.peers.iter().enumerate() {
            if matches!(state, Peer::Streaming { .. }) {
                streaming += 1;
                if self.peer_commit[peer] >= lsn {
                    knowing += 1;
                }
            }
        }
        (knowing, streaming)
    }

    /// A connection to safekeeper `peer` is up.
    pub fn on_connected(&mut self, peer: usize) -> Vec<Action> {
        if matches!(self.phase, Phase::Stopped | Phase::Lost) || peer >= self.peers.len() {
            return Vec::new();
        }
        self.peers[peer] = Peer::Greeting;
        vec![Action::Send {
            to: peer,
            msg: ToSafekeeper::Greeting(Greeting {
                cluster_id: self.config.cluster_id.clone(),
                proposer_id: self.config.proposer_id,
                timeline_id: self.config.timeline_id,
                segment_bytes: self.config.segment_bytes,
            }),
        }]
    }

    /// The connection to `peer` broke; anything in flight to it is forgotten and
    /// it starts over with a greeting when it reconnects.
    pub fn on_disconnected(&mut self, peer: usize) -> Vec<Action> {
        if peer >= self.peers.len() {
            return Vec::new();
        }
        self.peers[peer] = Peer::Offline;
        let mut actions = Vec::new();
        self.pause_fetch_from(peer, &mut actions);
        actions
    }

    /// Sends an empty append to every streaming safekeeper, carrying the current
    /// commit_lsn (call periodically).
    pub fn heartbeat(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.phase != Phase::Elected {
            return actions;
        }
        for peer in 0..self.peers.len() {
            if let Peer::Streaming { next_send, .. } = self.peers[peer] {
                actions.push(self.append_to(peer, next_send, Bytes::new()));
            }
        }
        actions
    }

    /// An append of `wal` starting at `begin` for `peer`, carrying the current
    /// commit and truncate positions, the backup position and duty and the
    /// slowest replica (empty `wal`: a heartbeat).
    fn append_to(&self, peer: usize, begin: Lsn, wal: Bytes) -> Action {
        Action::Send {
            to: peer,
            msg: ToSafekeeper::Append(AppendRequest {
                term: self.term,
                begin_lsn: begin,
                end_lsn: Lsn(begin.0 + wal.len() as u64),
                commit_lsn: self.commit_lsn,
                truncate_lsn: self.truncate_lsn,
                backup_lsn: self.backup_lsn,
                backup_duty: self.offloader() == Some(peer),
                remote_consistent_lsn: self
                    .feedback
                    .values()
                    .map(|f| f.remote_consistent_lsn)
                    .min(),
                probe: self.probe,
                wal,
            }),
        }
    }

    /// The safekeeper that uploads whole segments now: among the streaming
    /// ones less than `max_offloader_lag_bytes` behind commit_lsn, in index
    /// order, the one at `term % count`. Deterministic, so every writer of a
    /// term picks the same one from the same facts; a new term, or a
    /// safekeeper falling behind or coming back, moves the duty. Two
    /// safekeepers uploading the same segment for a moment (an old duty
    /// not yet withdrawn) is harmless: a whole segment's bytes are committed
    /// WAL, the same on every safekeeper.
    pub fn offloader(&self) -> Option<usize> {
        if self.phase != Phase::Elected {
            return None;
        }
        // Asked for every append: counted, then picked, without a list.
        let candidate = |p: &Peer| match p {
            Peer::Streaming { flush_lsn, .. } => {
                flush_lsn.0 + self.config.max_offloader_lag_bytes > self.commit_lsn.0
            }
            _ => false,
        };
        let count = self.peers.iter().filter(|p| candidate(p)).count();
        if count == 0 {
            return None;
        }
        let pick = (self.term % count as u64) as usize;
        self.peers
            .iter()
            .enumerate()
            .filter(|(_, p)| candidate(p))
            .nth(pick)
            .map(|(i, _)| i)
    }

    /// The highest backup_lsn a safekeeper reported.
    pub fn backup_lsn(&self) -> Lsn {
        self.backup_lsn
    }

    /// Appends whole, valid records; returns the LSN just past them: they are
    /// durable once [`Action::Committed`] reaches it.
    pub fn append(&mut self, records: &Bytes) -> Result<(Lsn, Vec<Action>), ProposerError> {
        let end = self.append_unsent(records)?;
        let mut actions = Vec::new();
        self.pump_all(&mut actions);
        Ok((end, actions))
    }

    /// Like [`Proposer::append`] without sending anything yet: a driver that has
    /// several appends at hand adds them all, then calls [`Proposer::send_pending`]
    /// once, so they travel in one message per safekeeper.
    pub fn append_unsent(&mut self, records: &Bytes) -> Result<Lsn, ProposerError> {
        match self.phase {
            Phase::Elected => {}
            Phase::Stopped => return Err(ProposerError::Superseded(self.term)),
            _ => return Err(ProposerError::NotElected),
        }
        let ends =
            record_ends(records).map_err(|e| ProposerError::InvalidRecords(e.to_string()))?;
        self.buffer.push_back(records, &ends);
        Ok(self.end_lsn())
    }

    /// Like [`Proposer::append_unsent`] for records this writer encoded itself,
    /// whose record ends the encoder already knows: they are not checked again
    /// (a second checksum pass over every byte of an insert), except in debug
    /// builds.
    pub fn append_encoded_unsent(
        &mut self,
        records: &Bytes,
        ends: &[usize],
    ) -> Result<Lsn, ProposerError> {
        match self.phase {
            Phase::Elected => {}
            Phase::Stopped => return Err(ProposerError::Superseded(self.term)),
            _ => return Err(ProposerError::NotElected),
        }
        debug_assert_eq!(
            record_ends(records).ok().as_deref(),
            Some(ends),
            "the encoder's record ends"
        );
        self.buffer.push_back(records, ends);
        Ok(self.end_lsn())
    }

    /// Sends what [`Proposer::append_unsent`] added.
    pub fn send_pending(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.phase == Phase::Elected {
            self.pump_all(&mut actions);
        }
        actions
    }

    /// Handles one message from safekeeper `peer`.
    pub fn on_message(&mut self, peer: usize, msg: FromSafekeeper) -> Vec<Action> {
        let mut actions = Vec::new();
        if matches!(self.phase, Phase::Stopped | Phase::Lost) || peer >= self.peers.len() {
            return actions;
        }
        match msg {
            FromSafekeeper::Greeting(g) => self.on_greeting(peer, &g, &mut actions),
            FromSafekeeper::Vote(v) => self.on_vote(peer, v, &mut actions),
            FromSafekeeper::Append(a) => {
                if a.term > self.term {
                    self.stop(a.term, "a safekeeper is in a higher term", &mut actions);
                    return actions;
                }
                for forget in &a.forgotten_replicas {
                    self.forget_replica(*forget);
                }
                for fb in &a.shard_feedback {
                    let key = (fb.shard_number, fb.replica_number);
                    if self.forgotten.hides(fb) {
                        continue;
                    }
                    let newer = self
                        .feedback
                        .get(&key)
                        .is_none_or(|old| old.reply_time_micros <= fb.reply_time_micros);
                    if newer
                        && (self.feedback.len() < MAX_FEEDBACK_REPLICAS
                            || self.feedback.contains_key(&key))
                    {
                        self.feedback.insert(key, *fb);
                    }
                }
                self.peer_commit[peer] = self.peer_commit[peer].max(a.commit_lsn);
                self.backup_lsn = self.backup_lsn.max(a.backup_lsn);
                if a.term == self.term {
                    self.peer_probe[peer] = self.peer_probe[peer].max(a.probe);
                }
                self.on_append_response(peer, a.flush_lsn, &mut actions);
                self.bring_back_restored(&mut actions);
            }
            FromSafekeeper::Wal { begin_lsn, wal, .. } => {
                self.on_fetched(peer, begin_lsn, wal, &mut actions)
            }
            FromSafekeeper::Refused { reason, .. } if self.peers[peer] == Peer::Greeting => {
                // Only identity is checked at a greeting, so this refusal is
                // not a term contest: the safekeeper is not ours.
                self.on_greeting_refused(peer, reason, &mut actions);
            }
            FromSafekeeper::Refused { term, reason } => {
                if term > self.term {
                    self.stop(term, &reason, &mut actions);
                } else {
                    tracing::warn!(peer, %reason, "safekeeper refused; reconnecting to it");
                    self.peers[peer] = Peer::Offline;
                    actions.push(Action::Reconnect { peer });
                    self.pause_fetch_from(peer, &mut actions);
                }
            }
            // Walsender answers: never sent to a writer.
            FromSafekeeper::Keepalive { .. }
            | FromSafekeeper::WalRemoved { .. }
            | FromSafekeeper::Forgotten { .. } => {}
        }
        actions
    }

    fn on_greeting_refused(&mut self, peer: usize, reason: String, actions: &mut Vec<Action>) {
        // A new connection greets again (the safekeeper may have been
        // repaired or restarted meanwhile); the same refusal is logged once.
        if self.refusals_logged[peer].as_deref() != Some(reason.as_str()) {
            tracing::warn!(peer, %reason, "safekeeper refused this writer's greeting");
            self.refusals_logged[peer] = Some(reason.clone());
        }
        self.peers[peer] = Peer::Refused { reason };
        let reasons: Vec<String> = self
            .peers
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p {
                Peer::Refused { reason } => Some(format!("safekeeper {i}: {reason}")),
                _ => None,
            })
            .collect();
        if reasons.len() == self.peers.len() {
            self.phase = Phase::Lost;
            actions.push(Action::RefusedByAll { reasons });
        }
    }

    /// A higher term was seen: an elected writer is superseded and stops; one
    /// still electing has lost this attempt only.
    fn stop(&mut self, term: Term, reason: &str, actions: &mut Vec<Action>) {
        if self.phase == Phase::Elected {
            self.phase = Phase::Stopped;
            actions.push(Action::Superseded {
                term,
                reason: reason.to_string(),
            });
        } else {
            self.phase = Phase::Lost;
            self.term = self.term.max(term);
            actions.push(Action::ElectionLost {
                term,
                reason: reason.to_string(),
            });
        }
    }

    /// This attempt lost its election to a higher term; [`Proposer::term`] is
    /// that term, which the next attempt must exceed.
    pub fn lost_election(&self) -> bool {
        self.phase == Phase::Lost
    }

    fn on_greeting(&mut self, peer: usize, g: &GreetingResponse, actions: &mut Vec<Action>) {
        if self.peers[peer] != Peer::Greeting {
            return;
        }
        let term = g.term;
        if let Some(restored) = g.restored {
            // A safekeeper rebuilt from the backup: never a voter. In its
            // quarantine, greet it again later.
            if !restored.ready {
                tracing::debug!(peer, "restored safekeeper in quarantine; greeting it later");
                self.peers[peer] = Peer::Offline;
                actions.push(Action::Reconnect { peer });
                return;
            }
            tracing::info!(peer, flush_lsn = %restored.flush_lsn, "restored safekeeper greeted");
            self.peers[peer] = Peer::Restored {
                flush_lsn: restored.flush_lsn,
            };
            if self.phase == Phase::Elected {
                self.start_rejoin(peer, actions);
            }
            return;
        }
        match self.phase {
            Phase::Greeting => {
                self.peers[peer] = Peer::Greeted { term };
                let greeted: Vec<Term> = self
                    .peers
                    .iter()
                    .filter_map(|p| match p {
                        Peer::Greeted { term } => Some(*term),
                        _ => None,
                    })
                    .collect();
                if greeted.len() >= self.quorum {
                    let highest = greeted.iter().copied().max().unwrap_or(0);
                    self.term = self.term.max(highest) + 1;
                    self.phase = Phase::Voting;
                    for p in 0..self.peers.len() {
                        if matches!(self.peers[p], Peer::Greeted { .. }) {
                            self.peers[p] = Peer::Voting;
                            actions.push(Action::Send {
                                to: p,
                                msg: ToSafekeeper::VoteRequest { term: self.term },
                            });
                        }
                    }
                }
            }
            Phase::Voting | Phase::Elected => {
                if term > self.term {
                    self.stop(term, "a safekeeper greeted with a higher term", actions);
                    return;
                }
                // Late safekeeper: its vote response tells us where its WAL is.
                self.peers[peer] = Peer::Voting;
                actions.push(Action::Send {
                    to: peer,
                    msg: ToSafekeeper::VoteRequest { term: self.term },
                });
            }
            Phase::Lost | Phase::Stopped => {}
        }
    }

    fn on_vote(&mut self, peer: usize, vote: VoteResponse, actions: &mut Vec<Action>) {
        if self.peers[peer] != Peer::Voting {
            return;
        }
        if vote.term > self.term {
            self.stop(vote.term, "a safekeeper voted in a higher term", actions);
            return;
        }
        if !vote.term_history.is_well_formed() {
            tracing::warn!(peer, "malformed term history in a vote response");
            self.peers[peer] = Peer::Offline;
            return;
        }
        match self.phase {
            Phase::Voting => {
                if !vote.vote_given {
                    // Voted for a rival with the same term: it cannot count.
                    self.peers[peer] = Peer::Offline;
                    return;
                }
                self.peers[peer] = Peer::Voted(vote);
                let votes = self
                    .peers
                    .iter()
                    .filter(|p| matches!(p, Peer::Voted(_)))
                    .count();
                if votes >= self.quorum {
                    self.become_elected(actions);
                }
            }
            Phase::Elected => {
                // A late safekeeper: same term at most, so it may stream from us.
                self.send_elected(peer, &vote, actions);
            }
            _ => {}
        }
    }

    fn become_elected(&mut self, actions: &mut Vec<Action>) {
        let voters: Vec<(usize, VoteResponse)> = self
            .peers
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p {
                Peer::Voted(v) => Some((i, v.clone())),
                _ => None,
            })
            .collect();
        let Some((donor, donor_vote)) = voters
            .iter()
            .max_by_key(|(i, v)| {
                (
                    v.term_history.last_term(),
                    v.flush_lsn,
                    std::cmp::Reverse(*i),
                )
            })
            .cloned()
        else {
            return;
        };
        // The donor holds every committed record a quorum could have: if even it
        // lacks what is known committed, this quorum lost data. Waiting for the
        // others may find a voter that has it.
        let best_flush_lsn = donor_vote.flush_lsn;
        if best_flush_lsn < self.config.known_commit_lsn {
            let all_voted = voters.len() == self.peers.len();
            tracing::warn!(
                best = %best_flush_lsn,
                known = %self.config.known_commit_lsn,
                voters = voters.len(),
                "no voter holds the WAL known to be committed; not electing"
            );
            if all_voted {
                self.phase = Phase::Stopped;
            }
            actions.push(Action::BehindKnownCommit {
                best_flush_lsn,
                known_commit_lsn: self.config.known_commit_lsn,
                all_voted,
            });
            return;
        }
        self.phase = Phase::Elected;
        self.epoch_start_lsn = donor_vote.flush_lsn;
        self.truncate_lsn = voters
            .iter()
            .map(|(_, v)| v.truncate_lsn)
            .max()
            .unwrap_or(Lsn(0));
        self.history = donor_vote.term_history.clone();
        self.history.push(self.term, self.epoch_start_lsn);
        // The writer holds no WAL yet; what safekeepers miss below the epoch start
        // is fetched from the donor.
        self.buffer = WalBuffer::new(self.epoch_start_lsn);
        tracing::info!(
            term = self.term,
            donor,
            epoch_start = %self.epoch_start_lsn,
            "elected"
        );
        actions.push(Action::Elected {
            term: self.term,
            epoch_start_lsn: self.epoch_start_lsn,
        });
        for (peer, vote) in voters {
            self.send_elected(peer, &vote, actions);
        }
        self.donor = Some(donor);
        self.start_fetch_if_needed(actions);
        for peer in 0..self.peers.len() {
            if matches!(self.peers[peer], Peer::Restored { .. }) {
                self.start_rejoin(peer, actions);
            }
        }
    }

    /// Starts bringing back restored safekeeper `peer`, greeted after its
    /// quarantine: a new probe goes to every streaming safekeeper.
    fn start_rejoin(&mut self, peer: usize, actions: &mut Vec<Action>) {
        let Peer::Restored { flush_lsn } = self.peers[peer] else {
            return;
        };
        if flush_lsn > self.end_lsn() {
            // Its WAL is committed WAL, which this writer's holds: a restored
            // end past ours means the backup is not this timeline's.
            tracing::error!(peer, %flush_lsn, end = %self.end_lsn(), "restored safekeeper holds WAL past this writer's end; leaving it out");
            self.peers[peer] = Peer::Offline;
            return;
        }
        self.probe += 1;
        self.peers[peer] = Peer::Rejoining {
            flush_lsn,
            probe: self.probe,
        };
        for p in 0..self.peers.len() {
            if let Peer::Streaming { next_send, .. } = self.peers[p] {
                actions.push(self.append_to(p, next_send, Bytes::new()));
            }
        }
        self.bring_back_restored(actions);
    }

    /// Brings back every rejoining safekeeper whose probe a quorum of the
    /// others answered in this term: no writer of a higher term was elected
    /// by them before that answer, and none holding the restored
    /// safekeeper's lost votes can be elected after it (its quarantine
    /// outlasted those elections), so its acknowledgements are safe to count.
    fn bring_back_restored(&mut self, actions: &mut Vec<Action>) {
        if self.phase != Phase::Elected {
            return;
        }
        for peer in 0..self.peers.len() {
            let Peer::Rejoining { flush_lsn, probe } = self.peers[peer] else {
                continue;
            };
            let confirmed = (0..self.peers.len())
                .filter(|&p| {
                    p != peer
                        && matches!(self.peers[p], Peer::Streaming { .. })
                        && self.peer_probe[p] >= probe
                })
                .count();
            if confirmed < self.quorum {
                continue;
            }
            tracing::info!(peer, start = %flush_lsn, "bringing back a restored safekeeper");
            if self.donor == Some(peer) {
                // It lost the WAL it gave this election.
                self.donor = None;
            }
            self.send_elected_at(peer, flush_lsn, true, actions);
        }
    }

    fn send_elected(&mut self, peer: usize, vote: &VoteResponse, actions: &mut Vec<Action>) {
        // Our WAL is the donor's up to the epoch start, then this term's up to
        // end_lsn; a safekeeper already streaming in this term agrees with it up
        // to its own flush_lsn.
        let start = self
            .history
            .common_prefix_end(self.end_lsn(), &vote.term_history, vote.flush_lsn)
            .unwrap_or_else(|| self.history.0.first().map_or(Lsn(0), |e| e.lsn));
        self.send_elected_at(peer, start, false, actions);
    }

    /// Tells `peer` this writer is elected and that it streams from `start`
    /// (`rejoin`: a restored safekeeper brought back at its end).
    fn send_elected_at(
        &mut self,
        peer: usize,
        start: Lsn,
        rejoin: bool,
        actions: &mut Vec<Action>,
    ) {
        self.peers[peer] = Peer::Electing { start };
        actions.push(Action::Send {
            to: peer,
            msg: ToSafekeeper::Elected(ProposerElected {
                term: self.term,
                start_streaming_at: start,
                term_history: self.history.clone(),
                timeline_start_lsn: Lsn(0),
                rejoin,
            }),
        });
    }

    fn on_append_response(&mut self, peer: usize, flush: Lsn, actions: &mut Vec<Action>) {
        match self.peers[peer].clone() {
            Peer::Electing { start } => {
                if flush != start {
                    tracing::warn!(peer, %flush, %start, "safekeeper did not truncate where told");
                    self.peers[peer] = Peer::Offline;
                    actions.push(Action::Reconnect { peer });
                    return;
                }
                self.peers[peer] = Peer::Streaming {
                    flush_lsn: flush,
                    next_send: start,
                };
                // A quorum already at the epoch start commits it right away (what
                // sync mode waits for).
                self.advance_commit(actions);
                self.start_fetch_if_needed(actions);
            }
            Peer::Streaming {
                flush_lsn,
                next_send,
            } => {
                if flush > next_send {
                    tracing::warn!(peer, %flush, %next_send, "safekeeper flushed more than was sent");
                    self.peers[peer] = Peer::Offline;
                    actions.push(Action::Reconnect { peer });
                    return;
                }
                self.peers[peer] = Peer::Streaming {
                    flush_lsn: flush_lsn.max(flush),
                    next_send,
                };
                self.advance_commit(actions);
                self.trim_buffer();
            }
            _ => return,
        }
        self.pump(peer, actions);
    }

    fn advance_commit(&mut self, actions: &mut Vec<Action>) {
        let mut flushes: Vec<Lsn> = self
            .peers
            .iter()
            .filter_map(|p| match p {
                // No commit from a previous term: positions below the epoch start
                // prove nothing about this term's WAL.
                Peer::Streaming { flush_lsn, .. } if *flush_lsn >= self.epoch_start_lsn => {
                    Some(*flush_lsn)
                }
                _ => None,
            })
            .collect();
        if flushes.len() < self.quorum {
            return;
        }
        flushes.sort_unstable_by(|a, b| b.cmp(a));
        let candidate = flushes[self.quorum - 1];
        if candidate > self.commit_lsn {
            self.commit_lsn = candidate;
            actions.push(Action::Committed {
                commit_lsn: candidate,
            });
        }
        let all = self.streaming_flushes();
        if all.len() == self.peers.len() {
            let horizon = all
                .iter()
                .copied()
                .min()
                .unwrap_or(Lsn(0))
                .min(self.commit_lsn);
            self.truncate_lsn = self.truncate_lsn.max(horizon);
        }
    }

    /// Flush positions of the safekeepers streaming in this term.
    fn streaming_flushes(&self) -> Vec<Lsn> {
        self.peer_flush_lsns().into_iter().flatten().collect()
    }

    /// Drops WAL no safekeeper can need from the buffer: below every streaming
    /// safekeeper's flush when all stream, else below the commit once the buffer
    /// is over its limit (a returning safekeeper then reads from a peer).
    fn trim_buffer(&mut self) {
        // A running read ends at the buffer's start: the buffer stays put
        // until it lands. A paused one reads on to the new start on resuming.
        if self.fetch.as_ref().is_some_and(|f| f.source.is_some()) {
            return;
        }
        let streaming = self.streaming_flushes();
        let target = if streaming.len() == self.peers.len() {
            streaming
                .iter()
                .copied()
                .min()
                .unwrap_or(self.buffer.start())
        } else if self.buffer.len() > self.config.max_buffered_bytes {
            self.commit_lsn
                .min(streaming.iter().copied().min().unwrap_or(self.commit_lsn))
        } else {
            return;
        };
        self.buffer.trim_to(target);
    }

    fn pump_all(&mut self, actions: &mut Vec<Action>) {
        // What was appended leaves now, as one piece for every safekeeper.
        self.buffer.freeze_tail();
        for peer in 0..self.peers.len() {
            self.pump(peer, actions);
        }
    }

    /// Sends WAL to a streaming safekeeper, whole records only, up to the in-flight
    /// limit.
    fn pump(&mut self, peer: usize, actions: &mut Vec<Action>) {
        let Peer::Streaming {
            flush_lsn,
            mut next_send,
        } = self.peers[peer]
        else {
            return;
        };
        while next_send.distance_from(flush_lsn) < self.config.max_in_flight_bytes {
            let Some(wal) = self
                .buffer
                .next_piece(next_send, self.config.max_append_bytes)
            else {
                break;
            };
            let begin = next_send;
            next_send = Lsn(next_send.0 + wal.len() as u64);
            actions.push(self.append_to(peer, begin, wal));
        }
        self.peers[peer] = Peer::Streaming {
            flush_lsn,
            next_send,
        };
        if next_send < self.buffer.start() {
            self.start_fetch_if_needed(actions);
        }
    }

    /// A read from `peer` stops (it went away or refused): kept with what it
    /// received and resumed from another safekeeper, or from this one when it
    /// is back.
    fn pause_fetch_from(&mut self, peer: usize, actions: &mut Vec<Action>) {
        if let Some(fetch) = self.fetch.as_mut().filter(|f| f.source == Some(peer)) {
            fetch.source = None;
            self.start_fetch_if_needed(actions);
        }
    }

    /// Starts (or resumes) reading WAL below the buffer that a safekeeper needs,
    /// from the donor or from a safekeeper that already streams in this term.
    /// Below the buffer's start every such safekeeper holds the same WAL (each
    /// was truncated to its common point with the donor), so a read may change
    /// source midway.
    fn start_fetch_if_needed(&mut self, actions: &mut Vec<Action>) {
        if self.phase != Phase::Elected || self.fetch.as_ref().is_some_and(|f| f.source.is_some()) {
            return;
        }
        let needed = self
            .peers
            .iter()
            .filter_map(|p| match p {
                Peer::Streaming { next_send, .. } => Some(*next_send),
                _ => None,
            })
            .filter(|lsn| *lsn < self.buffer.start())
            .min();
        let Some(needed) = needed else {
            self.fetch = None;
            return;
        };
        let end = self.buffer.start();
        // A paused read resumes when it still covers what is needed.
        let (begin, received) = match self.fetch.take() {
            Some(paused) if paused.begin <= needed => (paused.begin, paused.received),
            _ => (needed, BytesMut::new()),
        };
        let have = Lsn(begin.0 + received.len() as u64);
        // The donor holds the WAL up to the epoch start unless it lost it:
        // a donor restored from the backup since is a safekeeper like any.
        let donor_ok = self.donor.filter(|&d| match self.peers[d] {
            Peer::Streaming { flush_lsn, .. } => flush_lsn >= end,
            Peer::Offline
            | Peer::Greeting
            | Peer::Refused { .. }
            | Peer::Restored { .. }
            | Peer::Rejoining { .. } => false,
            _ => true,
        });
        let source = donor_ok.or_else(|| {
            self.peers
                .iter()
                .position(|p| matches!(p, Peer::Streaming { flush_lsn, .. } if *flush_lsn >= end))
        });
        let Some(source) = source else {
            if self.donor.is_none() && self.commit_lsn < self.epoch_start_lsn {
                // The donor lost its disk before anyone else got the WAL this
                // term starts from: nobody holds it (so it was never
                // committed), and this term can never commit. Nothing of it
                // was acknowledged: give it up for a new election.
                self.phase = Phase::Stopped;
                actions.push(Action::Superseded {
                    term: self.term,
                    reason: format!(
                        "the WAL up to this term's start {end} was lost with its donor's data; electing again"
                    ),
                });
                return;
            }
            tracing::warn!(%begin, %have, %end, "no safekeeper can provide the WAL a lagging safekeeper needs yet");
            self.fetch = Some(Fetch {
                source: None,
                begin,
                end,
                requested: have,
                received,
            });
            return;
        };
        if have > begin {
            tracing::info!(source, %begin, %have, %end, "resuming a recovery read");
        }
        let requested = self.read_wal_end(have, end);
        self.fetch = Some(Fetch {
            source: Some(source),
            begin,
            end,
            requested,
            received,
        });
        if have >= end {
            // Paused right at its end (a read returned more than asked).
            self.finish_fetch(source, actions);
            return;
        }
        actions.push(Action::Send {
            to: source,
            msg: ToSafekeeper::ReadWal {
                term: self.term,
                begin_lsn: have,
                end_lsn: requested,
            },
        });
    }

    /// The end of one recovery read from `begin` towards `end`.
    fn read_wal_end(&self, begin: Lsn, end: Lsn) -> Lsn {
        let most = self.config.max_read_wal_bytes.clamp(1, MAX_READ_WAL_BYTES);
        Lsn(end.0.min(begin.0.saturating_add(most)))
    }

    fn on_fetched(&mut self, peer: usize, begin: Lsn, wal: Bytes, actions: &mut Vec<Action>) {
        let Some(fetch) = self.fetch.as_mut() else {
            return;
        };
        if fetch.source != Some(peer) || begin != Lsn(fetch.begin.0 + fetch.received.len() as u64) {
            return;
        }
        fetch.received.extend_from_slice(&wal);
        let have = Lsn(fetch.begin.0 + fetch.received.len() as u64);
        if have >= fetch.end {
            self.finish_fetch(peer, actions);
            return;
        }
        if have >= fetch.requested {
            // This read is done: the next one, from the same safekeeper.
            let end = fetch.end;
            let next = self.read_wal_end(have, end);
            if let Some(fetch) = self.fetch.as_mut() {
                fetch.requested = next;
            }
            tracing::debug!(source = peer, %have, %next, "next recovery read");
            actions.push(Action::Send {
                to: peer,
                msg: ToSafekeeper::ReadWal {
                    term: self.term,
                    begin_lsn: have,
                    end_lsn: next,
                },
            });
        }
    }

    /// The read reached the buffer's start: its WAL goes in front of the
    /// buffer and the lagging safekeepers are sent what they miss.
    fn finish_fetch(&mut self, last_source: usize, actions: &mut Vec<Action>) {
        let Some(fetch) = self.fetch.take() else {
            return;
        };
        let mut received = fetch.received;
        if received.len() as u64 > fetch.end.distance_from(fetch.begin) {
            tracing::warn!(last_source, "recovery read returned more than asked");
        }
        received.truncate(fetch.end.distance_from(fetch.begin) as usize);
        let data = received.freeze();
        let ends = match record_ends(&data) {
            Ok(ends) => ends,
            Err(e) => {
                tracing::error!(last_source, error = %e, "recovered WAL is not whole records");
                self.peers[last_source] = Peer::Offline;
                actions.push(Action::Reconnect { peer: last_source });
                return;
            }
        };
        self.buffer.push_front(fetch.begin, data, &ends);
        self.pump_all(actions);
        self.start_fetch_if_needed(actions);
    }
}

/// The end of each record in `records` (relative to its start), which must be
/// whole, valid records.
fn record_ends(records: &[u8]) -> Result<Vec<usize>, record::RecordError> {
    let mut at = 0;
    let mut ends = Vec::new();
    while at < records.len() {
        at += record::check(&records[at..])?;
        ends.push(at);
    }
    Ok(ends)
}
