//! What an operator sees of a writer: its term and positions, its
//! safekeepers, back-pressure and the replicas' feedback; published by the
//! driver after every change.

use ferry_wal::proto::ShardFeedback;
use ferry_wal::Term;
use serde::Serialize;

use super::Driver;
use crate::proposer::ReplicaPositions;

/// One safekeeper as the writer sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerStatus {
    pub addr: String,
    pub connected: bool,
    pub flush_lsn: Option<String>,
    /// Whether this safekeeper has the backup duty now.
    pub backup_duty: bool,
}

/// What an operator sees of a writer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WriterStatus {
    /// The generation of the safekeeper configuration the writer runs with
    /// (0: none recorded; its safekeepers are the ones it was started with).
    pub generation: u32,
    pub term: Term,
    pub elected: bool,
    /// Where this term's WAL starts (the donor's end of WAL at the election).
    pub epoch_start_lsn: String,
    /// True once a quorum has committed everything up to the epoch start: the
    /// safekeepers agree on a common committed end (sync mode waits for this).
    pub synced: bool,
    pub commit_lsn: String,
    pub end_lsn: String,
    /// Set when a higher term ended this writer's leadership (of `term`, which
    /// started at `epoch_start_lsn`); the writer has stopped.
    pub superseded_by: Option<Term>,
    /// Why the election cannot complete: no voter holds the WAL known to be
    /// committed. Once every safekeeper voted, the writer stops with this.
    pub election_blocked: Option<String>,
    /// Set when the writer stopped because electing would lose committed WAL.
    pub refused: Option<String>,
    pub peers: Vec<PeerStatus>,
    /// The highest backup_lsn a safekeeper reported.
    pub backup_lsn: String,
    /// Set while appends wait for a lagging replica: which lag, how many bytes.
    pub back_pressure: Option<String>,
    /// Appends waiting (for the election or for back-pressure).
    pub waiting_appends: usize,
    /// The latest feedback of every replica.
    pub replicas: Vec<ShardFeedback>,
    /// Per shard, the lowest positions over its replicas.
    pub shard_minimums: Vec<ShardMinimum>,
    /// The lowest positions over all replicas of all shards.
    pub overall_minimum: Option<ReplicaPositions>,
    /// Replicas this writer forgot since it started (silent past the
    /// replica expiry, this writer's or a safekeeper's, or unregistered:
    /// they no longer hold back-pressure).
    pub replicas_forgotten: u64,
    /// Times a replica's newer feedback reported it behind its previous
    /// feedback (rebuilt at a lower LSN after losing its data dir): the
    /// slowest position fell, so the end of WAL may be past a back-pressure
    /// limit until the replica catches up.
    pub replica_setbacks: u64,
}

/// The slowest replica positions of one shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShardMinimum {
    pub shard_number: u32,
    pub positions: ReplicaPositions,
}

impl Driver {
    pub(super) fn publish_status(&self) {
        let flushes = self.proposer.peer_flush_lsns();
        let offloader = self.proposer.offloader();
        let status = WriterStatus {
            generation: self.proposer.generation(),
            term: self.proposer.term(),
            elected: self.proposer.is_elected(),
            epoch_start_lsn: self.proposer.epoch_start_lsn().to_string(),
            synced: self.proposer.is_elected()
                && self.proposer.commit_lsn() >= self.proposer.epoch_start_lsn(),
            commit_lsn: self.proposer.commit_lsn().to_string(),
            end_lsn: self.proposer.end_lsn().to_string(),
            superseded_by: self.superseded_by,
            election_blocked: self.election_blocked.clone(),
            refused: self.refused.clone(),
            peers: self
                .config
                .safekeepers
                .iter()
                .enumerate()
                .map(|(i, addr)| PeerStatus {
                    addr: addr.clone(),
                    connected: self.conns[i].is_some(),
                    flush_lsn: flushes[i].map(|l| l.to_string()),
                    backup_duty: offloader == Some(i),
                })
                .collect(),
            backup_lsn: self.proposer.backup_lsn().to_string(),
            back_pressure: self
                .throttle()
                .map(|(name, lag)| format!("{name} lag {lag} bytes")),
            waiting_appends: self.queued.len(),
            replicas: self.proposer.replica_feedback().copied().collect(),
            shard_minimums: self
                .proposer
                .shard_minimums()
                .into_iter()
                .map(|(shard_number, positions)| ShardMinimum {
                    shard_number,
                    positions,
                })
                .collect(),
            overall_minimum: self.proposer.overall_minimum(),
            replicas_forgotten: self.proposer.replicas_forgotten(),
            replica_setbacks: self.proposer.replica_setbacks(),
        };
        self.status.send_if_modified(|old| {
            if *old == status {
                false
            } else {
                *old = status;
                true
            }
        });
    }
}
