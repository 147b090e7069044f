//! When a replica stopped talking, by the observer's own clock.
//!
//! A replica that stopped for good would hold WAL removal (and the writer's
//! back-pressure) at its last position for ever. Safekeepers and the writer
//! each watch every replica's feedback: feedback whose reply time has not
//! changed for the replica expiry is forgotten. The observer's clock is used,
//! never the replica's (whose clock may be off), and only changes count, so
//! the same feedback relayed again and again does not keep a gone replica
//! alive.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::proto::{ForgottenReplica, ShardFeedback};

/// Most tombstones kept; past it the oldest goes first.
pub const MAX_TOMBSTONES: usize = 4096;

/// Forgotten replicas, each with the newest reply time forgotten: feedback
/// at or below it is stale (a copy relayed again) and ignored; newer
/// feedback means the replica came back, and clears the tombstone.
#[derive(Debug, Default, Clone)]
pub struct Tombstones(BTreeMap<(u32, u32), u64>);

impl Tombstones {
    /// Whether `fb` is forgotten feedback (and must be ignored). Newer
    /// feedback clears the tombstone.
    pub fn hides(&mut self, fb: &ShardFeedback) -> bool {
        let key = (fb.shard_number, fb.replica_number);
        match self.0.get(&key) {
            Some(&up_to) if fb.reply_time_micros <= up_to => true,
            Some(_) => {
                self.0.remove(&key);
                false
            }
            None => false,
        }
    }

    /// Records that feedback up to `forget.reply_time_micros` is forgotten.
    pub fn add(&mut self, forget: ForgottenReplica) {
        let up_to = self
            .0
            .entry((forget.shard_number, forget.replica_number))
            .or_insert(0);
        *up_to = (*up_to).max(forget.reply_time_micros);
        if self.0.len() > MAX_TOMBSTONES {
            if let Some(oldest) = self.0.iter().min_by_key(|(_, t)| **t).map(|(k, _)| *k) {
                self.0.remove(&oldest);
            }
        }
    }

    pub fn list(&self) -> Vec<ForgottenReplica> {
        self.0
            .iter()
            .map(
                |(&(shard_number, replica_number), &reply_time_micros)| ForgottenReplica {
                    shard_number,
                    replica_number,
                    reply_time_micros,
                },
            )
            .collect()
    }
}

/// Default replica expiry, for safekeepers and writers alike: a day.
pub const DEFAULT_REPLICA_EXPIRY: Duration = Duration::from_secs(24 * 3600);

/// The last change of each replica's feedback, as one observer saw it.
#[derive(Debug, Default)]
pub struct ReplicaLiveness {
    /// (shard, replica) → (the reply time last seen, when it was first seen).
    changed: BTreeMap<(u32, u32), (u64, Instant)>,
}

impl ReplicaLiveness {
    /// Looks at the feedback known `now`; returns the replicas whose feedback
    /// has not changed for `expiry`. Replicas no longer in `current` are
    /// dropped from the watch.
    pub fn expired<'a>(
        &mut self,
        current: impl Iterator<Item = &'a ShardFeedback>,
        now: Instant,
        expiry: Duration,
    ) -> Vec<ShardFeedback> {
        let mut seen = BTreeMap::new();
        let mut expired = Vec::new();
        for fb in current {
            let key = (fb.shard_number, fb.replica_number);
            let since = match self.changed.get(&key) {
                Some(&(reply, since)) if reply == fb.reply_time_micros => since,
                _ => now,
            };
            if now.saturating_duration_since(since) >= expiry {
                expired.push(*fb);
            }
            seen.insert(key, (fb.reply_time_micros, since));
        }
        self.changed = seen;
        expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Lsn;

    fn fb(replica: u32, reply: u64) -> ShardFeedback {
        ShardFeedback {
            shard_number: 0,
            replica_number: replica,
            last_received_lsn: Lsn(1),
            disk_consistent_lsn: Lsn(1),
            remote_consistent_lsn: Lsn(1),
            reply_time_micros: reply,
        }
    }

    #[test]
    fn only_feedback_that_stopped_changing_expires() {
        let expiry = Duration::from_secs(10);
        let mut l = ReplicaLiveness::default();
        let start = Instant::now();
        assert!(l
            .expired([fb(0, 1), fb(1, 1)].iter(), start, expiry)
            .is_empty());
        // Replica 0 keeps replying; replica 1 is silent, relayed unchanged.
        let later = start + Duration::from_secs(6);
        assert!(l
            .expired([fb(0, 2), fb(1, 1)].iter(), later, expiry)
            .is_empty());
        let expired = l.expired([fb(0, 3), fb(1, 1)].iter(), start + expiry, expiry);
        assert_eq!(expired, vec![fb(1, 1)]);
        // Replica 0 changed 4 s before: not expired yet.
        assert!(l
            .expired([fb(0, 3)].iter(), start + Duration::from_secs(15), expiry)
            .is_empty());
        // A replica back with a new reply starts over.
        assert!(l
            .expired(
                [fb(0, 3), fb(1, 9)].iter(),
                start + Duration::from_secs(16),
                expiry
            )
            .is_empty());
        assert_eq!(
            l.expired(
                [fb(0, 3), fb(1, 9)].iter(),
                start + Duration::from_secs(20),
                expiry
            ),
            vec![fb(0, 3)]
        );
    }

    fn forget(replica: u32, up_to: u64) -> ForgottenReplica {
        ForgottenReplica {
            shard_number: 0,
            replica_number: replica,
            reply_time_micros: up_to,
        }
    }

    /// A forgotten replica's feedback relayed again (by a safekeeper
    /// restarted with it in its control file, or delayed on the way) stays
    /// forgotten; feedback newer than the tombstone means the replica is
    /// back, and clears it.
    #[test]
    fn a_tombstone_hides_stale_feedback_until_the_replica_replies_again() {
        let mut t = Tombstones::default();
        assert!(!t.hides(&fb(1, 5)), "nothing forgotten yet");
        t.add(forget(1, 5));
        assert!(t.hides(&fb(1, 5)), "the forgotten feedback itself");
        assert!(t.hides(&fb(1, 4)), "older feedback");
        assert!(!t.hides(&fb(0, 5)), "another replica");
        assert_eq!(t.list(), vec![forget(1, 5)]);
        // An older tombstone does not lower the newer one.
        t.add(forget(1, 3));
        assert!(t.hides(&fb(1, 4)));
        assert!(!t.hides(&fb(1, 6)), "the replica replied again");
        assert!(!t.hides(&fb(1, 5)), "its tombstone is gone");
        assert!(t.list().is_empty());
    }

    #[test]
    fn tombstones_are_bounded_and_the_oldest_goes_first() {
        let mut t = Tombstones::default();
        for r in 0..=MAX_TOMBSTONES as u32 {
            t.add(forget(r, 1_000 + u64::from(r)));
        }
        let list = t.list();
        assert_eq!(list.len(), MAX_TOMBSTONES);
        assert!(
            !list.iter().any(|f| f.replica_number == 0),
            "the oldest went"
        );
    }
}
