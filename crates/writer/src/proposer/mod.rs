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
//!
//! Here: the configuration, the actions and errors, the per-safekeeper
//! state, connections, and the dispatch of safekeeper messages; in the
//! submodules:
//! * `election`: greetings, votes, the donor and the epoch start, and
//!   restored safekeepers brought back;
//! * `append`: appends and heartbeats, the commit and truncate positions,
//!   the buffer's trimming, and the backup duty;
//! * `recovery`: WAL below the buffer read from the donor or an up-to-date
//!   safekeeper for those that lag;
//! * `feedback`: replica feedback and the minimums back-pressure acts on.

mod append;
mod election;
mod feedback;
mod recovery;

use std::collections::BTreeMap;

use ferry_wal::membership::{Configuration, Generation};
use ferry_wal::proto::{FromSafekeeper, Greeting, ShardFeedback, ToSafekeeper, VoteResponse};
use ferry_wal::record;
use ferry_wal::{ClusterId, Lsn, Term, TermHistory};

use crate::buffer::WalBuffer;

pub use feedback::{ReplicaPositions, MAX_FEEDBACK_REPLICAS};
use recovery::Fetch;

/// Default most WAL bytes of one recovery read: as large as the biggest
/// append, so a catch-up delays its source's acknowledgements by about as
/// long as one append does.
pub const DEFAULT_READ_WAL_BYTES: u64 = 1 << 20;

/// Limits and identity of a proposer.
#[derive(Debug, Clone)]
pub struct ProposerConfig {
    /// The cluster whose safekeepers this writer writes to (they refuse others).
    pub cluster_id: ClusterId,
    /// Number of safekeepers (slots); without a configuration a quorum is a
    /// majority of them.
    pub safekeepers: usize,
    /// The membership configuration the writer starts with (`None`:
    /// generation 0, every slot a member). Its slots are
    /// [`Configuration::all_members`]; quorums are the configuration's
    /// (both majorities during a change). A safekeeper that answers with a
    /// higher generation makes the proposer stop with
    /// [`Action::Reconfigure`].
    pub configuration: Option<Configuration>,
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
    /// [`MAX_READ_WAL_BYTES`]); a longer range is read as several. A read's
    /// answer travels on its source's connection ahead of that
    /// safekeeper's acknowledgements, so its size bounds how long a
    /// catch-up delays commits that count that safekeeper
    /// ([`DEFAULT_READ_WAL_BYTES`]).
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
            configuration: None,
            timeline_id,
            segment_bytes,
            proposer_id,
            min_term: 0,
            max_append_bytes: 1 << 20,
            max_in_flight_bytes: 16 << 20,
            max_buffered_bytes: 256 << 20,
            max_offloader_lag_bytes: 128 << 20,
            max_read_wal_bytes: DEFAULT_READ_WAL_BYTES,
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
    /// A safekeeper holds a configuration of a higher generation and this
    /// proposer was not elected yet: it stopped (its quorums are no longer
    /// the cluster's); the driver starts over with it.
    Reconfigure {
        configuration: Configuration,
    },
    /// The elected proposer took a higher configuration in place (same
    /// term, same WAL; its quorums are the new configuration's from now
    /// on, and every member is greeted again with it). The driver keeps a
    /// connection to each slot with `Some` address and closes the others.
    Members {
        configuration: Configuration,
        slots: Vec<Option<String>>,
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

/// The proposer of one writer incarnation.
#[derive(Debug)]
pub struct Proposer {
    config: ProposerConfig,
    /// The safekeeper id of each slot (with a configuration).
    slot_ids: Vec<u64>,
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
    /// Newer feedback that reported a replica behind its previous feedback.
    replica_setbacks: u64,
    /// Replicas forgotten while known (see [`Proposer::replicas_forgotten`]).
    replicas_forgotten: u64,
    /// The commit_lsn each safekeeper last reported (it learns it from appends).
    peer_commit: Vec<Lsn>,
    /// The highest backup_lsn any safekeeper reported; relayed to all of them.
    backup_lsn: Lsn,
    /// Carried by every append; raised to prove a safekeeper's term after
    /// some point (a restored safekeeper's greeting).
    probe: u64,
    /// The highest probe each safekeeper echoed in this term.
    peer_probe: Vec<u64>,
    /// Safekeepers whose last answer to an append refused it for lack of
    /// disk space (`ferry_wal::proto::DISK_FULL`); an accepted append
    /// clears it.
    peer_disk_full: Vec<bool>,
}

impl Proposer {
    pub fn new(config: ProposerConfig) -> Proposer {
        assert!(config.safekeepers >= 1, "need at least one safekeeper");
        let n = config.safekeepers;
        let slot_ids: Vec<u64> = match &config.configuration {
            Some(conf) => conf.all_members().iter().map(|m| m.id).collect(),
            None => (0..n as u64).collect(),
        };
        assert_eq!(
            slot_ids.len(),
            n,
            "a writer's slots are its configuration's safekeepers"
        );
        Proposer {
            slot_ids,
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
            replica_setbacks: 0,
            replicas_forgotten: 0,
            refusals_logged: vec![None; n],
            peer_commit: vec![Lsn(0); n],
            backup_lsn: Lsn(0),
            probe: 0,
            peer_probe: vec![0; n],
            peer_disk_full: vec![false; n],
        }
    }

    /// Whether `slot` is a member of this proposer's configuration.
    pub(super) fn is_member(&self, slot: usize) -> bool {
        match &self.config.configuration {
            None => true,
            Some(conf) => conf.contains(self.slot_ids[slot]),
        }
    }

    /// Whether `slot` is in the old set of a change and not in the new one.
    pub(super) fn is_leaving(&self, slot: usize) -> bool {
        match &self.config.configuration {
            Some(Configuration {
                members,
                new_members: Some(new),
                ..
            }) => {
                let id = self.slot_ids[slot];
                members.iter().any(|m| m.id == id) && !new.iter().any(|m| m.id == id)
            }
            _ => false,
        }
    }

    /// How many slots are members.
    pub(super) fn member_count(&self) -> usize {
        (0..self.peers.len()).filter(|&p| self.is_member(p)).count()
    }

    /// Takes `conf`, of a higher generation, in place: new members get
    /// slots (slots are never reused), slots no longer members go offline,
    /// and every connected member is greeted again with `conf`, so that
    /// its acknowledgements count under the new quorums. Commits counted
    /// before stay: they were made of acknowledgements the old quorums'
    /// safekeepers gave before they took the newer generation, which the
    /// change driver's sync position covers (`docs/protocols/membership.md`).
    pub(super) fn adopt_in_place(&mut self, conf: Configuration, actions: &mut Vec<Action>) {
        tracing::info!(
            configuration = %conf.describe(),
            term = self.term,
            "a safekeeper holds a newer configuration; taking it in place"
        );
        for m in conf.all_members() {
            if !self.slot_ids.contains(&m.id) {
                self.slot_ids.push(m.id);
                self.peers.push(Peer::Offline);
                self.refusals_logged.push(None);
                self.peer_commit.push(Lsn(0));
                self.peer_probe.push(0);
                self.peer_disk_full.push(false);
            }
        }
        let slots: Vec<Option<String>> = self
            .slot_ids
            .iter()
            .map(|id| {
                conf.all_members()
                    .into_iter()
                    .find(|m| m.id == *id)
                    .map(|m| m.addr)
            })
            .collect();
        self.config.safekeepers = self.slot_ids.len();
        self.config.configuration = Some(conf.clone());
        for (slot, addr) in slots.iter().enumerate() {
            let member = addr.is_some();
            let connected = !matches!(self.peers[slot], Peer::Offline);
            if member && connected {
                self.peers[slot] = Peer::Greeting;
                actions.push(Action::Send {
                    to: slot,
                    msg: self.greeting(),
                });
            } else if !member {
                self.peers[slot] = Peer::Offline;
            }
            self.pause_fetch_from(slot, actions);
        }
        actions.push(Action::Members {
            configuration: conf,
            slots,
        });
    }

    fn greeting(&self) -> ToSafekeeper {
        ToSafekeeper::Greeting(Greeting {
            cluster_id: self.config.cluster_id.clone(),
            proposer_id: self.config.proposer_id,
            timeline_id: self.config.timeline_id,
            segment_bytes: self.config.segment_bytes,
            configuration: self.config.configuration.clone(),
        })
    }

    /// The safekeepers refusing appends for lack of disk space, when too
    /// few others are left to commit: new appends are refused before
    /// anything is written (`None`: a quorum takes appends).
    pub fn quorum_out_of_space(&self) -> Option<Vec<usize>> {
        let full: Vec<usize> = (0..self.peers.len())
            .filter(|&p| self.peer_disk_full[p])
            .collect();
        (!self.is_quorum(|p| !self.peer_disk_full[p])).then_some(full)
    }

    /// The generation of this proposer's configuration (0: none recorded).
    pub fn generation(&self) -> Generation {
        self.config
            .configuration
            .as_ref()
            .map_or(0, |c| c.generation)
    }

    /// Whether the slots for which `has` holds make a quorum: a majority of
    /// all slots, or the configuration's quorum (both majorities during a
    /// change).
    fn is_quorum(&self, has: impl Fn(usize) -> bool) -> bool {
        match &self.config.configuration {
            None => {
                let n = self.peers.len();
                (0..n).filter(|&p| has(p)).count() > n / 2
            }
            Some(conf) => conf.is_quorum(|id| self.slot_of(id).is_some_and(&has)),
        }
    }

    /// The highest value a quorum of slots reached (`value`: each slot's,
    /// `None` for one without).
    fn quorum_value(&self, value: impl Fn(usize) -> Option<Lsn>) -> Option<Lsn> {
        match &self.config.configuration {
            None => {
                let n = self.peers.len();
                let mut values: Vec<Lsn> = (0..n).filter_map(&value).collect();
                values.sort_unstable_by(|a, b| b.cmp(a));
                values.get(n / 2).copied()
            }
            Some(conf) => conf.quorum_value(|id| self.slot_of(id).and_then(&value)),
        }
    }

    fn slot_of(&self, id: u64) -> Option<usize> {
        self.slot_ids.iter().position(|&s| s == id)
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

    /// A connection to safekeeper `peer` is up.
    pub fn on_connected(&mut self, peer: usize) -> Vec<Action> {
        if matches!(self.phase, Phase::Stopped | Phase::Lost)
            || peer >= self.peers.len()
            || !self.is_member(peer)
        {
            return Vec::new();
        }
        self.peers[peer] = Peer::Greeting;
        vec![Action::Send {
            to: peer,
            msg: self.greeting(),
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
                    self.take_feedback(fb);
                }
                self.peer_disk_full[peer] = false;
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
            FromSafekeeper::Refused { reason, .. }
                if self.peers[peer] == Peer::Greeting
                    && reason.starts_with(ferry_wal::proto::GENERATION) =>
            {
                // An answer to a message sent before this greeting, in the
                // older generation: the greeting's answer settles it.
            }
            FromSafekeeper::Refused { reason, .. } if self.peers[peer] == Peer::Greeting => {
                // Only identity is checked at a greeting, so this refusal is
                // not a term contest: the safekeeper is not ours.
                self.on_greeting_refused(peer, reason, &mut actions);
            }
            FromSafekeeper::Refused { term, reason }
                if term <= self.term && reason.starts_with(ferry_wal::proto::GENERATION) =>
            {
                // Its configuration is newer (the change driver handed it
                // over): greeted again on this connection, its answer tells
                // which.
                tracing::info!(peer, %reason, "safekeeper holds a newer configuration; greeting it again");
                self.peers[peer] = Peer::Greeting;
                actions.push(Action::Send {
                    to: peer,
                    msg: self.greeting(),
                });
                self.pause_fetch_from(peer, &mut actions);
            }
            FromSafekeeper::Refused { term, reason } => {
                if term > self.term {
                    self.stop(term, &reason, &mut actions);
                } else {
                    let full = ferry_wal::proto::is_disk_full(&reason);
                    if !full {
                        tracing::warn!(peer, %reason, "safekeeper refused; reconnecting to it");
                    } else if !self.peer_disk_full[peer] {
                        // Once per spell: it refuses every append until
                        // space returns.
                        tracing::warn!(peer, %reason, "safekeeper short of disk space refuses appends; trying it again until it takes them");
                    }
                    self.peer_disk_full[peer] = full;
                    self.peers[peer] = Peer::Offline;
                    actions.push(Action::Reconnect { peer });
                    self.pause_fetch_from(peer, &mut actions);
                }
            }
            // Walsender and pull answers: never sent to a writer.
            FromSafekeeper::Keepalive { .. }
            | FromSafekeeper::WalRemoved { .. }
            | FromSafekeeper::Forgotten { .. }
            | FromSafekeeper::PullStart(_)
            | FromSafekeeper::PullEnd { .. }
            | FromSafekeeper::Configured(_) => {}
        }
        actions
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
