//! The membership random test (`ferry-sim membership`): fixed regression
//! seeds, random ones from the day's window, and a determinism check.

use ferry_sim::membership::MembershipChanges;
use ferry_sim::seeds;

/// Seeds that failed under planted bugs (each of the first 1000 seeds):
/// 42, 79, 114, 374 and 431 (8 of 1000, with peer recovery and writers
/// taking a newer configuration in place) when the change driver switches
/// to the new set without waiting for it to catch up (acknowledged writes
/// missing from the final set's WAL, or the final writer's election going
/// back below an acknowledged write); before writers took configurations in
/// place, 67, 92, 276, 491 and 701 (16 of 1000; 701: two writers elected in
/// one term by members the term floor never reached) and, before peer
/// recovery, 18 and 23 did; they stay as coverage. 3, 4 and 6 (572 of
/// 1000) fail when a safekeeper lets a writer of an older generation vote,
/// elect or append (a generation 0 writer gets a vote). A pull without the
/// donor's removal hold fails safe (see `wal_random.rs`). 407 and 1404 (2
/// of the first 2000, with joining safekeepers pulled first) fail when a
/// joining safekeeper copies its donor's WAL up to its flush_lsn instead of
/// its commit_lsn: the writer finds it past its own end when bringing it
/// back, leaves it out, and the change never finishes. Since a joining
/// safekeeper follows its donor on one connection, that plant (with the
/// acceptor's own commit limit removed too) fails 2205, 2959, 4184, 4223
/// and 4497 of seeds 2000..14000 instead (4497: a safekeeper that took
/// uncommitted WAL recorded a commit past it, found damaged at restart).
/// 90405883 (a soak window) found two writers elected in one term: a
/// removed safekeeper added back empty took generation 1 from a stale
/// writer's greeting and voted again in a term it had voted in; since, a
/// safekeeper takes its first configuration from the change driver only.
const REGRESSION_SEEDS: &[u64] = &[
    3, 4, 6, 18, 23, 42, 67, 79, 92, 114, 276, 374, 407, 431, 491, 701, 1404, 2205, 2959, 4497,
    90405883,
];

#[test]
fn regression_seeds() {
    seeds::regression::<MembershipChanges>(REGRESSION_SEEDS);
}

#[test]
fn random_seeds() {
    seeds::today::<MembershipChanges>(150, |day| 300_000 + (day % 10_000) * 1_000);
}

#[test]
fn same_seed_same_log() {
    seeds::same_seed_same_log::<MembershipChanges>(&[7, 8, 9]);
}
