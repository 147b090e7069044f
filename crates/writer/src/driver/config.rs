//! How to run a writer: its safekeepers, timers and limits, and the
//! back-pressure limits on how far replicas may lag.

use std::time::Duration;

use ferry_wal::Lsn;
use serde::Serialize;

use crate::proposer::{ProposerConfig, ReplicaPositions};

/// How to run a writer.
#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// Addresses of the safekeepers, in a fixed order (their index is their id
    /// for the proposer). An empty address is a member known to be down: it
    /// counts in the quorum size, but nothing connects to it.
    pub safekeepers: Vec<String>,
    pub proposer: ProposerConfig,
    /// Pause between connection attempts to one safekeeper.
    pub reconnect_delay: Duration,
    /// Period of empty appends that carry commit_lsn to the safekeepers.
    pub heartbeat: Duration,
    /// A connection on which nothing arrived for this long is dropped and made
    /// again (a silent partition sends no reset).
    pub peer_timeout: Duration,
    /// Give up an election that has not succeeded in this time and try again
    /// with a higher term (split votes).
    pub election_timeout: Duration,
    /// Appends waiting for election or commit, at most; more are refused.
    pub max_pending_appends: usize,
    /// When superseded, fail what was in flight and start a new election above
    /// the higher term instead of stopping. For a process that is the only
    /// writer of its safekeepers (`ferry dev`), where a higher term can only be
    /// one left by an earlier run; where writers may really compete, stopping
    /// lets the newest one win.
    pub reelect_when_superseded: bool,
    /// Inserts wait while the slowest replica lags this far behind.
    pub back_pressure: BackPressure,
    /// A replica whose feedback has not changed for this long is forgotten:
    /// it no longer holds back-pressure or the removal horizon relayed to
    /// the safekeepers (which forget it after the same time).
    pub replica_expiry: Duration,
}

/// Neon's `max_replication_{write,flush,apply}_lag`: the most WAL bytes the
/// end of WAL may run ahead of the lowest position any replica reported
/// (received, durably applied, and applied remotely); 0 disables a limit.
/// Appends past a limit wait, in order, until the slowest replica catches up:
/// one slow shard slows the writer and loses nothing. A clean shutdown's
/// checkpoint (and what waits before it) is never held back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BackPressure {
    pub max_write_lag: u64,
    pub max_flush_lag: u64,
    pub max_apply_lag: u64,
}

impl BackPressure {
    /// Which limit `end` exceeds over the lowest replica positions `min`, if any.
    pub fn exceeded(&self, end: Lsn, min: &ReplicaPositions) -> Option<(&'static str, u64)> {
        let checks = [
            ("write", self.max_write_lag, min.last_received_lsn),
            ("flush", self.max_flush_lag, min.disk_consistent_lsn),
            ("apply", self.max_apply_lag, min.remote_consistent_lsn),
        ];
        checks.into_iter().find_map(|(name, limit, lsn)| {
            let lag = end.distance_from(lsn);
            (limit > 0 && lag > limit).then_some((name, lag))
        })
    }
}

impl WriterConfig {
    pub fn new(safekeepers: Vec<String>, proposer: ProposerConfig) -> WriterConfig {
        WriterConfig {
            safekeepers,
            proposer,
            reconnect_delay: Duration::from_millis(200),
            heartbeat: Duration::from_millis(100),
            peer_timeout: Duration::from_secs(2),
            election_timeout: Duration::from_secs(3),
            max_pending_appends: 100_000,
            reelect_when_superseded: false,
            back_pressure: BackPressure::default(),
            replica_expiry: ferry_wal::liveness::DEFAULT_REPLICA_EXPIRY,
        }
    }
}
