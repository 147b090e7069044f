//! The export random test (`ferry_sim::export`): at least 1,000 random seeds
//! from a window that moves every day, seeds that once failed, and a
//! determinism check. A failure prints the seed and the command that
//! replays it.

use ferry_sim::export::{Export, Outcome};
use ferry_sim::seeds;

/// Seeds that found real defects while the workload was written: a commit
/// lock left behind by a release whose answer was lost (2, 9: the task never
/// committed), a stale mirror committing a task a forced export had replaced
/// (157: FAILED), a half-removed task that kept every other task from loading
/// (1190, 1911), a lock left by a lost release that blocked its part (0).
/// Planted bugs, caught (seeds of 0..300 unless said): a commit that does
/// not check that every part is processed (142: a commit file listing 3 of
/// 8 parts), a request that snapshots without waiting for its replica to
/// apply the acknowledged inserts (75 of 200, e.g. 1, 4, 5, 6: rows
/// missing), merges that remove parts a pending export pinned (59, 118, 142,
/// 161: the task never completes); a kill that ignores a commit file already
/// written (15 of 1000 seeds once the schedule kills exports as their commit
/// files appear, e.g. 36, 299, 315: a commit file of a task answered
/// KILLED; before that, 0 of 1000); the prune before taking other
/// workers' parts keeping the finished parts instead of the ones left (8, 9,
/// 15, 26, ...: the task never completes); once a task's end is decided by
/// its `decision` node, a kill that sets KILLED without creating it (22 of
/// 1000 seeds, e.g. 26, 42, 45: a commit file of a task answered KILLED); a
/// coordination store that keeps an expired session's ephemerals (250 of
/// 300 seeds fail: locks outlive their sessions, tasks stall); a lake
/// reader that takes a partition's oldest commit for its current one (78 of
/// 300, e.g. 2, 14, 18: the current commit lacks rows a later export of the
/// partition committed). A commit that reuses the current commit's sequence
/// instead of the next one is not caught (0 of 300): ties fall back to the
/// create time and the time-ordered transaction id, which pick the later
/// commit anyway. With the exporter's scheduling in its own core
/// (`worker::queue`) and its rules apart (`worker::rules`): the prune
/// inverted in `PartQueue::prune` (71 of the first 300, e.g. 9, 14, 20: the
/// task never completes); the cleanup killing PENDING tasks before their
/// timeout instead of after it, in `rules::cleanup_duty` (196 of 300, e.g.
/// 0, 1, 2: a task KILLED though nobody killed it).
/// With retention (the schedule retiring partitions by a destination's
/// current commit): a replica that kept one set of retired files per
/// partition across destinations, so a retirement from a second
/// destination named the first one's files under the second's URL (18, 53:
/// a retired file not in its destination's current commit). Planted (seeds
/// 0..300): parts dropped when their blocks merely meet a retired file
/// instead of lying inside one (139 of 300, e.g. 0, 1, 3: rows dropped that
/// the lake lacks); snapshots that leave the retired files out, so an
/// export does not carry them (45 of 300, e.g. 3, 7, 18: a commit without
/// the retired rows).
/// With compaction records too: the merge policy taking the oldest eight
/// parts of a level though a compacted part of another level lay between
/// them, so a merge overlapped it (41: rows twice in a snapshot); a request
/// whose create answer was lost releasing its snapshot's pins though the
/// task existed, so merges took its parts from under it (977: the task
/// never completes).
/// With the product's policy runner in half of the runs (seeds 0..200):
/// an increment keyed by part names (carry every file of the current
/// commit, export the parts whose name it lacks) fails 119 of 200 (e.g. 0,
/// 1, 2: rows twice in a commit, or a policy lake that never equals the
/// rows); the policy's orphan removal without its "no export in flight"
/// guard fails 5 of 200 (13, 29, 41, 113, 168: a commit lists a data file
/// the upkeep deleted). The policy's retention gate removed is not caught
/// (0 of 200), and cannot be: the replicas drop only parts inside a
/// retired file, so a retirement the gate would have refused drops
/// nothing the lake lacks (that replica rule's plant is caught, above).
/// The policy runner found a stale mirror: an exporter whose status watch
/// event was lost kept mirroring a COMPLETED task as PENDING, and its
/// node's policy waited on it forever (207920171: a partition never
/// exported again); the safety poll now reads the status of every task it
/// mirrors as in flight.
/// Two removers of one finished task raced (a policy's request and a
/// manual one, 89300691): the slower deleted by path the status and parts
/// of the task the faster had created since, which stayed PENDING with
/// parts missing for good; removal now marks the task it removes and
/// checks the mark at every delete (`task::remove`).
/// A task whose part is on no replica any more fails (`worker::lost`);
/// without the grace before it does, a node holding the part but away for
/// a moment let the others fail the task (207930376, 207930826).
/// Seed numbers are those of the schedule when each bug was planted. They
/// must stay green.
const REGRESSION_SEEDS: &[u64] = &[
    0, 1, 2, 3, 4, 7, 9, 13, 14, 18, 26, 29, 36, 41, 53, 59, 113, 142, 157, 977, 1190, 1911,
    207920171, 89300691, 207930376, 207930826,
];

#[test]
fn regression_seeds() {
    seeds::regression::<Export>(REGRESSION_SEEDS);
}

#[test]
fn random_seeds() {
    let outcomes = seeds::today::<Export>(1000, |day| day * 10_000);
    let reached = |what: fn(&Outcome) -> usize| outcomes.iter().any(|o| what(o) > 0);
    assert!(
        reached(|o| o.completed) && reached(|o| o.killed) && reached(|o| o.crashes),
        "the schedules reach commits, kills and crashes"
    );
}

#[test]
fn same_seed_same_log() {
    seeds::same_seed_same_log::<Export>(&[3, 157]);
}
