//! The end-to-end random test (`ferry_sim::e2e`): a window of random seeds
//! that moves every day, seeds that once failed, and a determinism check.
//! A failure prints the seed and the command that replays it
//! (`ferry-sim e2e --seed N --log`); `scripts/soak.sh` runs thousands more.

use ferry_sim::e2e::{EndToEnd, Outcome};
use ferry_sim::seeds;

/// Seeds 3 and 7 (of the first window) stopped a replica whose table
/// lookup met a lost coordination answer. The soak's seed 89300531: an
/// operator's export created during the policy's orphan removal reused an
/// old orphan file the removal then deleted, and the Iceberg snapshot it
/// committed named a missing file (no task is created now while a removal
/// runs). 89301956: a replica reopening after a crash stopped because a
/// half-written part it listed was gone when it removed it (a removal of
/// what is gone now succeeds). 89300661 (at commit fab553f): a replica
/// lacked acknowledged rows after crashes, because a request its aborted
/// endpoint was serving ran on after the crash and wrote its state file
/// over parts the crash had lost (the simulator's defect: an aborted
/// endpoint now ends its requests, and a dead process's disk is fenced;
/// at today's schedules the seed no longer reaches it, the unit tests of
/// both fences hold it). 89301932 (day 20793): the workload compared the
/// replicas with a writer elected a moment before, whose commit_lsn read
/// 0/0 until its epoch start committed. The rest are early seeds.
///
/// Planted bugs, each in a release `ferry-sim e2e` of seeds 0..1000 (with
/// the fences; at commit e46eeb4 or later):
/// * a walsender sending up to its flush_lsn instead of commit_lsn: 2
///   failed (87: a replica stopped on WAL a truncation garbled; 564: a
///   replica lacked acknowledged rows, applied over the truncated WAL);
/// * the replicas' idempotency window not persisted (`#[serde(skip)]` on
///   the state's window): 382 (a retried key applied again after a
///   replica restart: the lake and the replicas hold ids twice);
/// * an export increment keyed by part names (exports the parts whose
///   names the lake lacks, carries every file): 618 of the first 630
///   (98%; the run was cut there): rows read twice from the lake;
/// * the commit file or Iceberg snapshot written before the task's
///   decision: 0, also with each commit file matched against its task's
///   decision (`check_commits_decided`): here a kill seldom lands between
///   a task's last part and its commit, and a replaced task's commit file
///   is never current; the export workload's kill plants (a kill ignoring
///   a commit file written, KILLED set without a decision) catch the rule;
/// * retention without its gate (a partition retired though the lake's
///   commit lacks rows the replicas hold): 0, as in the export workload:
///   a replica drops only parts a retired file holds whole, so a
///   retirement the gate would refuse drops nothing the lake lacks (that
///   rule's own plant fails 139 of 300 export seeds).
///
/// Earlier, without the fences: an increment keyed without its shard
/// failed 4 of 0..200 (92, 99, 147, 195).
///
/// 589400124 and 589401450 (11 of the 2,000 of that soak window) failed
/// the harness, not the product: a cut copy left for a plain start had
/// written its state file before the cut, and the next event copied over
/// a built replica (the harness now starts it as it is).
const REGRESSION_SEEDS: &[u64] = &[
    0, 1, 2, 3, 7, 89300531, 89300661, 89301932, 89301956, 589400124, 589401450,
];

#[test]
fn regression_seeds() {
    seeds::regression::<EndToEnd>(REGRESSION_SEEDS);
}

#[test]
fn random_seeds() {
    let outcomes = seeds::today::<EndToEnd>(60, |day| 500_000_000 + day * 10_000);
    let reached = |what: fn(&Outcome) -> bool| outcomes.iter().any(what);
    assert!(
        reached(|o| o.acknowledged > 0)
            && reached(|o| o.given_up > 0)
            && reached(|o| o.refused > 0)
            && reached(|o| o.replica_crashes > 0)
            && reached(|o| o.writers > 1)
            && reached(|o| o.retention)
            && reached(|o| o.format == ferry_export::model::LakeFormat::Iceberg)
            && reached(|o| o.safekeepers_restored > 0)
            && reached(|o| o.replicas_rebuilt > 0),
        "the schedules reach acknowledged, given-up and refused inserts, crashes, takeovers, retention, Iceberg, a safekeeper restored from the backup and a replica rebuilt from its peer"
    );
    // Every task of a crashed node ends with it: none reaches its disk
    // after the crash (the simulator's disk would fence it, hiding what it
    // would have done).
    let fenced: u64 = outcomes.iter().map(|o| o.fenced_disk_ops).sum();
    assert_eq!(
        fenced, 0,
        "tasks of crashed nodes reached their disks after the crash"
    );
}

#[test]
fn same_seed_same_log() {
    seeds::same_seed_same_log::<EndToEnd>(&[3]);
}
