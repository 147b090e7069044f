//! The export random test: three nodes, each a production `Replica` (every
//! shard) with its merge task and its production `Exporter`, share exports
//! of partitions to simulated object storage, coordinated through simulated
//! coordination. Inserts reach the replicas as WAL, each node applying at
//! its own pace, so a request must wait for its replica. The schedule mixes
//! inserts, exports (some forced), kills, node crashes (disk losing unsynced
//! data, sessions abandoned), session expiries and partitions from
//! coordination, with coordination requests lost before or after they were
//! applied and object-store requests failing before or after a write.
//! Between events it looks for new commit files every 50 ms and kills half
//! of those exports at once: the window between a commit file and COMPLETED
//! (a committer whose status write failed or who crashed) is reached.
//!
//! Checked once faults stop and every task settled (SPEC.md section 6):
//! * every task reaches a terminal state, and a task the schedule did not
//!   (or may not have) killed is COMPLETED;
//! * a commit file lists exactly one file per part of its task's snapshot,
//!   each present with the listed size, and together the files hold exactly
//!   the partition's rows as of the request (each row once);
//! * a FAILED or KILLED task, and a kill the schedule saw succeed, has no
//!   commit file;
//! * no data file is written twice under different names (one checksum per
//!   part name);
//! * a reader of the lake reads, of every partition, its current commit,
//!   which holds every row any commit of the partition holds;
//! * in half of the runs the second destination is an Iceberg table
//!   (commits race on its metadata versions; snapshots are expired now and
//!   then): every export is committed in at most one snapshot, and that
//!   snapshot holds the partition's rows as of the request, each once; the
//!   current snapshot holds each partition's current export; versions are
//!   contiguous (none overwritten); a COMPLETED export was committed, or
//!   its content or a later export of the partition already was;
//! * no lock of the export protocol (cleanup, commit and part locks, worker
//!   registrations) outlives its owner's session;
//! * compaction (`retention`): before some events the schedule appends a
//!   `Compact` record; the unforced exports act as a policy's (they follow
//!   the replicas' merges), so the checks above see lake files replaced;
//! * retention (`retention`): before some events the schedule retires a
//!   partition from the replicas by the files of a destination's current
//!   commit; every node then holds each partition's rows exactly once
//!   between its parts and its retired files, and every retired file is in
//!   the current commit of its destination.
//! * export policy (`policy`): in half of the runs the table exports itself
//!   to the first destination: every node runs the product's policy runner
//!   (one at a time holds the table's policy lock), whose increments,
//!   compactions and retirements race the schedule's exports, kills and
//!   retirements; its upkeep records reach the WAL through a simulated
//!   writer that loses some answers; its upkeep (expiring superseded
//!   commits, removing orphan data files) runs every half second with half
//!   a second of grace, on object times of the simulated clock. Its commit
//!   files pass the checks above (rows as of the snapshot position they
//!   name, at least); once faults stop, every inserted row reaches the
//!   current commit of its partition within a bound (the freshness promise
//!   after a heal), each once, and with retention every partition then
//!   leaves every replica.
//!
//! * `schedule`: the events and how a seed draws them;
//! * `nodes`: starting and crashing the nodes (replica node, exporter and
//!   the feeder of its WAL);
//! * `checks`: the final checks of every task, commit file and lock;
//! * `driver`: the run loop ([`run_seed`]) and the schedule's requests
//!   (inserts, exports, kills);
//! * `policy`: the policy runs (the catalog's policy, the simulated
//!   writer of upkeep records, the caught-up check).

pub(crate) mod checks;
mod driver;
mod iceberg;
mod nodes;
mod policy;
mod retention;
mod schedule;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use ferry_coord::{Session, SessionFactory};
use ferry_export::model::LakeFormat;
use ferry_table::Table;
use ferry_wal::Lsn;
use rand::rngs::SmallRng;
use tokio::sync::watch;

pub(crate) use checks::check_export_locks;
pub use driver::run_seed;

use crate::world::{Failure, Lake, Run, World};
use nodes::Node;

const NODES: usize = 3;
const TABLE_ID: u64 = 1;
const PARTITIONS: [&str; 3] = ["p0", "p1", "p2"];
/// Destinations: two prefixes of the simulated lake.
const DESTINATIONS: [&str; 2] = ["sim://lake/d0", "sim://lake/d1"];
/// The destination that is an Iceberg table in Iceberg runs.
const ICEBERG_DESTINATION: usize = 1;
const SESSION_TIMEOUT: Duration = Duration::from_secs(2);
/// How often, between events, the schedule looks for new commit files.
const COMMIT_WATCH_STEP: Duration = Duration::from_millis(50);

fn table() -> Table {
    ferry_testkit::table::id_p_table(TABLE_ID, "t", 2, &[])
}

fn partition_of(id: i64) -> &'static str {
    PARTITIONS[(id as usize / 5) % PARTITIONS.len()]
}

fn node_name(i: usize) -> String {
    format!("n{i}")
}

/// What the schedule knows of an export it asked for.
#[derive(Debug, Clone)]
struct Asked {
    partition: String,
    destination: String,
    /// The request was refused (the task may still exist if the refusal was
    /// a lost answer).
    refused: bool,
    /// Ids of the partition's rows the snapshot must hold.
    ids: BTreeSet<i64>,
    /// The schedule killed it, or may have (a lost answer, a forced
    /// replacement).
    maybe_killed: bool,
    /// A kill answered KILLED.
    killed: bool,
    /// `ids` is what the snapshot holds at least, not exactly (a policy's
    /// snapshot may include rows its replica applied past the position).
    at_least: bool,
}

/// What one seed did.
#[derive(Debug)]
pub struct Outcome {
    pub run: Run,
    pub exports: usize,
    pub completed: usize,
    /// Iceberg snapshots checked.
    pub snapshots: usize,
    pub killed: usize,
    pub crashes: usize,
    pub injected_object_faults: u64,
    /// Retire records appended, and rows the first node holds as retired
    /// files at the end.
    pub retirements: usize,
    pub retired_rows: u64,
    pub compactions: usize,
    /// Whether the table exported itself, and the upkeep records its policy
    /// had written.
    pub policy: bool,
    pub policy_records: usize,
    pub orphans_removed: u64,
}

/// The export workload, as the seed harness runs it.
pub struct Export;

impl crate::seeds::Workload for Export {
    type Outcome = Outcome;
    const NAME: &'static str = "export";

    fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
        run_seed(seed, verbose)
    }

    fn run(outcome: &Outcome) -> &Run {
        &outcome.run
    }

    fn counters(o: &Outcome) -> Vec<String> {
        vec![
            format!("{} exports asked", o.exports),
            format!("{} commit files checked", o.completed),
            format!("{} Iceberg snapshots checked", o.snapshots),
            format!("{} killed", o.killed),
            format!("{} crashes", o.crashes),
            format!("{} object faults", o.injected_object_faults),
            format!(
                "{} retirements ({} rows retired)",
                o.retirements, o.retired_rows
            ),
            format!("{} compactions", o.compactions),
            if o.policy {
                format!(
                    "policy ({} upkeep records, {} orphans removed)",
                    o.policy_records, o.orphans_removed
                )
            } else {
                "no policy".to_string()
            },
        ]
    }

    fn totals(outcomes: &[Outcome], _wall_secs: f64) -> Vec<String> {
        let sum = |count: fn(&Outcome) -> usize| outcomes.iter().map(count).sum::<usize>();
        vec![
            format!("{} exports asked", sum(|o| o.exports)),
            format!("{} commit files checked", sum(|o| o.completed)),
            format!("{} Iceberg snapshots checked", sum(|o| o.snapshots)),
            format!("{} killed", sum(|o| o.killed)),
            format!("{} crashes", sum(|o| o.crashes)),
            format!("{} retirements", sum(|o| o.retirements)),
            format!("{} compactions", sum(|o| o.compactions)),
            format!(
                "{} runs with a policy ({} upkeep records, {} orphans removed)",
                outcomes.iter().filter(|o| o.policy).count(),
                sum(|o| o.policy_records),
                outcomes.iter().map(|o| o.orphans_removed).sum::<u64>()
            ),
            format!(
                "{} rows retired",
                outcomes.iter().map(|o| o.retired_rows).sum::<u64>()
            ),
        ]
    }
}

struct Sim {
    world: World,
    nodes: Vec<Option<Node>>,
    /// The WAL as inserted so far, and its end (the "commit position").
    wal: BytesMut,
    /// The WAL as the replicas may read it (a copy of `wal`).
    fed: watch::Sender<Bytes>,
    /// Rows by partition with the LSN of their record's end.
    rows: Vec<(Lsn, i64)>,
    next_id: i64,
    asked: BTreeMap<String, Asked>,
    /// Exports whose commit file the schedule saw (and maybe killed).
    killed_on_commit: BTreeSet<String>,
    crashes: usize,
    /// Whether the second destination is an Iceberg table (half of the
    /// runs); the first is always Parquet with commit files.
    iceberg: bool,
    /// Draws the lake upkeep (snapshot expiry) of Iceberg runs, apart from
    /// the world's generator so that Parquet runs draw what they drew
    /// before Iceberg existed.
    upkeep_rng: SmallRng,
    /// Draws the retirements (retention), apart from the others likewise.
    retire_rng: SmallRng,
    retirements: usize,
    compactions: usize,
    /// The export policy of policy runs.
    policy: Option<policy::PolicyRun>,
    /// Partitions of a destination the schedule exported with force (which
    /// replaces, so may kill, a policy's task).
    forced: BTreeSet<(String, String)>,
}

impl Sim {
    fn log(&mut self, line: impl AsRef<str>) {
        self.world.log(line);
    }

    fn fail(&self, reason: impl Into<String>) -> Failure {
        self.world.fail(reason)
    }

    /// A session of the workload itself (`role`: what it is for), not of a
    /// node: no node's crash or partition touches it, and it outlives the
    /// run.
    async fn own_session(&self, role: &str) -> Result<Session, Failure> {
        self.world
            .coord
            .factory(role, Duration::from_secs(600))
            .open()
            .await
            .map_err(|e| self.fail(format!("{role} session: {e}")))
    }

    fn lake(&self) -> Lake {
        Lake(Arc::new(self.world.lake_store.clone()))
    }

    /// The format of destination `d` in this run.
    fn format_of(&self, d: usize) -> LakeFormat {
        if self.iceberg && d == ICEBERG_DESTINATION {
            LakeFormat::Iceberg
        } else {
            LakeFormat::Parquet
        }
    }
}
