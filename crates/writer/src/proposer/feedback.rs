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
            self.replicas_forgotten += 1;
        }
        self.forgotten.add(forget);
        known
    }

    /// Replicas forgotten since this writer started, whoever forgot them
    /// first (this writer's expiry, or a safekeeper's relayed tombstone:
    /// expiry or unregistration). Each one may have lowered the slowest
    /// position when heard again.
    pub fn replicas_forgotten(&self) -> u64 {
        self.replicas_forgotten
    }

    /// Keeps `fb` if it is the newest of its replica (and the replica is not
    /// forgotten up to it, and there is room).
    pub(super) fn take_feedback(&mut self, fb: &ShardFeedback) {
        let key = (fb.shard_number, fb.replica_number);
        if self.forgotten.hides(fb) {
            return;
        }
        let old = self.feedback.get(&key);
        if old.is_some_and(|old| old.reply_time_micros > fb.reply_time_micros) {
            return;
        }
        if old.is_none() && self.feedback.len() >= MAX_FEEDBACK_REPLICAS {
            return;
        }
        // Only durable positions: a restarted replica receives again from
        // what it applied, so last_received_lsn falls without a loss.
        if old.is_some_and(|old| {
            fb.disk_consistent_lsn < old.disk_consistent_lsn
                || fb.remote_consistent_lsn < old.remote_consistent_lsn
        }) {
            self.replica_setbacks += 1;
        }
        self.feedback.insert(key, *fb);
    }

    /// How many times a replica's newer feedback reported a durable position
    /// (disk_consistent_lsn or remote_consistent_lsn) behind its previous one: it lost its data dir and was built again (from a
    /// peer, at a lower LSN), so the slowest position fell and the end of WAL
    /// may be past a back-pressure limit through no append of this writer.
    pub fn replica_setbacks(&self) -> u64 {
        self.replica_setbacks
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proposer::ProposerConfig;

    fn feedback(replica: u32, disk: u64, at: u64) -> ShardFeedback {
        ShardFeedback {
            shard_number: 0,
            replica_number: replica,
            last_received_lsn: Lsn(disk),
            disk_consistent_lsn: Lsn(disk),
            remote_consistent_lsn: Lsn(disk),
            reply_time_micros: at,
        }
    }

    #[test]
    fn a_replica_heard_behind_its_previous_feedback_is_a_setback() {
        let config = ProposerConfig::new(ferry_wal::ClusterId::from_random(1), 3, 1, 1 << 20, 7);
        let mut p = Proposer::new(config);
        p.take_feedback(&feedback(0, 100, 1));
        p.take_feedback(&feedback(1, 300, 1));
        p.take_feedback(&feedback(0, 200, 2));
        assert_eq!(p.replica_setbacks(), 0, "moving forward is no setback");
        assert_eq!(
            p.overall_minimum().map(|m| m.disk_consistent_lsn),
            Some(Lsn(200))
        );
        // Older feedback relayed late is ignored, not a setback.
        p.take_feedback(&feedback(0, 50, 1));
        assert_eq!(p.replica_setbacks(), 0);
        assert_eq!(
            p.overall_minimum().map(|m| m.disk_consistent_lsn),
            Some(Lsn(200))
        );
        // Newer feedback behind the previous one: rebuilt lower.
        p.take_feedback(&feedback(1, 150, 3));
        assert_eq!(p.replica_setbacks(), 1);
        assert_eq!(
            p.overall_minimum().map(|m| m.disk_consistent_lsn),
            Some(Lsn(150))
        );
        // Only remote_consistent_lsn behind counts too.
        let mut fb = feedback(0, 250, 4);
        fb.remote_consistent_lsn = Lsn(10);
        p.take_feedback(&fb);
        assert_eq!(p.replica_setbacks(), 2);
        // last_received_lsn behind alone is a restart, not a setback.
        let mut fb = feedback(0, 260, 5);
        fb.remote_consistent_lsn = Lsn(10);
        fb.last_received_lsn = Lsn(5);
        p.take_feedback(&fb);
        assert_eq!(p.replica_setbacks(), 2);
        // Forgetting counts once, whoever forgets first.
        let forget = ForgottenReplica {
            shard_number: 0,
            replica_number: 1,
            reply_time_micros: 3,
        };
        assert!(p.forget_replica(forget));
        assert!(!p.forget_replica(forget));
        assert_eq!(p.replicas_forgotten(), 1);
        assert_eq!(
            p.overall_minimum().map(|m| m.disk_consistent_lsn),
            Some(Lsn(260)),
            "the forgotten replica no longer holds the minimum"
        );
    }
}
