//! Replica feedback relayed by the safekeepers: the newest of each replica,
//! forgotten replicas, and the lowest positions back-pressure acts on.

use std::collections::BTreeMap;

use ferry_wal::proto::{ForgottenReplica, ShardFeedback};
use ferry_wal::Lsn;

use super::Proposer;

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

impl Proposer {
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
}
