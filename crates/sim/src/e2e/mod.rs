//! The end-to-end random test: the whole system in one simulated world,
//! judged where users stand.
//!
//! A client inserts over the product's HTTP API (the writer node's router,
//! served on the simulated network) with idempotency keys: it retries
//! inserts of unknown outcome with the same key (and gives some up), sends
//! acknowledged inserts again, and reuses keys with other content. Behind
//! the API: three safekeepers with WAL backup and removal, the writer with
//! its commit record and a supervisor that starts a new one when it stops
//! (and takeovers by a new incarnation), 2 shards x 2 replicas streaming
//! from the safekeepers, with merges, each registered for its peers and
//! serving the product's export API (`ferry_node::exports`), and the
//! table's export policy (continuous export with a freshness target, to a
//! Parquet or an Iceberg destination, with retention in some runs) running
//! on the replicas; the schedule also asks for exports (some forced) and
//! kills through the export API of a replica.
//!
//! Faults, all in one schedule: replica crashes (most right after a write,
//! before its fsync), safekeeper crashes, partitions between any two nodes
//! and between a node and coordination, session expiries, coordination
//! answers lost before and after they were applied, object-store requests
//! failing before and after a write, writer kills and takeovers.
//!
//! Checked at every step: a replica's position never goes back (not across
//! a crash either). Once faults stop and everything settled (every unknown
//! outcome retried until answered, the policy caught up):
//! * what a reader of the lake reads (each partition's current commit, or
//!   the Iceberg table's current snapshot) holds every insert answered 200
//!   exactly once, an insert given up after an unknown outcome at most
//!   once, and nothing else (no row of an insert refused);
//! * every replica holds, of its shard, each acknowledged row at most once
//!   and nothing unacknowledged, and every acknowledged row it lacks was
//!   retired (its partition's files are in the lake);
//! * no lock of the export protocol outlives its session.
//!
//! * `schedule`: the events and how a seed draws them;
//! * `nodes`: the world, safekeepers, writers and replicas;
//! * `client`: inserts over HTTP and what their answers mean;
//! * `checks`: the step checks and the final ones;
//! * `driver`: the run loop ([`run_seed`]).

mod checks;
mod client;
mod driver;
mod nodes;
mod schedule;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_export::model::LakeFormat;
use ferry_wal::Lsn;
use rand::rngs::SmallRng;

pub use driver::run_seed;

use crate::safekeepers::Safekeepers;
use crate::world::{Failure, Run, World};
use client::Sent;
use nodes::{ReplicaNode, WriterIncarnation};

const SAFEKEEPERS: usize = 3;
const SHARDS: u32 = 2;
const REPLICAS_PER_SHARD: u32 = 2;
const SEGMENT_BYTES: u64 = 64 << 10;
const PARTITIONS: [&str; 3] = ["p0", "p1", "p2"];
const TABLE: &str = "t";
/// The policy's destination.
const DESTINATION: &str = "s3://sim-lake/lake";
const SESSION_TIMEOUT: Duration = Duration::from_secs(2);
const FRESHNESS_SECONDS: u64 = 1;
/// Once faults stop, every acknowledged row is in the lake within this.
const CAUGHT_UP_WITHIN: Duration = Duration::from_secs(180);

fn replicas() -> usize {
    (SHARDS * REPLICAS_PER_SHARD) as usize
}

fn replica_name(i: usize) -> String {
    format!(
        "r{}{}",
        i as u32 / REPLICAS_PER_SHARD,
        i as u32 % REPLICAS_PER_SHARD
    )
}

fn partition_of(id: i64) -> &'static str {
    PARTITIONS[(id as usize / 4) % PARTITIONS.len()]
}

/// What one seed did.
#[derive(Debug)]
pub struct Outcome {
    pub run: Run,
    pub acknowledged: usize,
    /// Inserts given up after an unknown outcome, and reused keys refused.
    pub given_up: usize,
    pub refused: usize,
    pub rows_in_lake: usize,
    pub format: LakeFormat,
    pub retention: bool,
    pub writers: u64,
    pub replica_crashes: usize,
    pub exports_asked: usize,
    pub safekeepers_restored: usize,
    pub replicas_rebuilt: usize,
    /// Plain starts of a replica holding an unfinished copy, refused.
    pub unfinished_copies_refused: usize,
    /// Commit files in the lake matched with their task's decision.
    pub commit_files_checked: usize,
    /// Disk operations tasks of crashed processes tried after their crash
    /// (fenced: they never complete).
    pub fenced_disk_ops: u64,
}

/// The end-to-end workload, as the seed harness runs it.
pub struct EndToEnd;

impl crate::seeds::Workload for EndToEnd {
    type Outcome = Outcome;
    const NAME: &'static str = "e2e";

    fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
        run_seed(seed, verbose)
    }

    fn run(outcome: &Outcome) -> &Run {
        &outcome.run
    }

    fn counters(o: &Outcome) -> Vec<String> {
        vec![
            format!("{} acknowledged inserts", o.acknowledged),
            format!("{} given up", o.given_up),
            format!("{} refused", o.refused),
            format!("{} rows in the lake ({})", o.rows_in_lake, o.format),
            format!("retention {}", if o.retention { "on" } else { "off" }),
            format!("{} writers", o.writers),
            format!("{} replica crashes", o.replica_crashes),
            format!("{} exports asked", o.exports_asked),
            format!("{} safekeepers restored", o.safekeepers_restored),
            format!("{} replicas rebuilt", o.replicas_rebuilt),
            format!(
                "{} starts over an unfinished copy refused",
                o.unfinished_copies_refused
            ),
            format!(
                "{} commit files matched with their decision",
                o.commit_files_checked
            ),
            format!("{} disk operations fenced after crashes", o.fenced_disk_ops),
        ]
    }

    fn totals(outcomes: &[Outcome], wall_secs: f64) -> Vec<String> {
        let sum = |count: fn(&Outcome) -> usize| outcomes.iter().map(count).sum::<usize>();
        vec![
            format!("{} acknowledged inserts", sum(|o| o.acknowledged)),
            format!("{} given up", sum(|o| o.given_up)),
            format!("{} refused", sum(|o| o.refused)),
            format!("{} rows read from lakes", sum(|o| o.rows_in_lake)),
            format!(
                "{} Iceberg runs, {} with retention",
                outcomes
                    .iter()
                    .filter(|o| o.format == LakeFormat::Iceberg)
                    .count(),
                outcomes.iter().filter(|o| o.retention).count()
            ),
            format!("{} replica crashes", sum(|o| o.replica_crashes)),
            format!(
                "{} safekeepers restored from the backup",
                sum(|o| o.safekeepers_restored)
            ),
            format!(
                "{} replicas rebuilt from a peer",
                sum(|o| o.replicas_rebuilt)
            ),
            format!(
                "{} starts over an unfinished copy refused",
                sum(|o| o.unfinished_copies_refused)
            ),
            format!(
                "{} commit files matched with their decision",
                sum(|o| o.commit_files_checked)
            ),
            format!(
                "{} disk operations fenced after crashes",
                outcomes.iter().map(|o| o.fenced_disk_ops).sum::<u64>()
            ),
            format!(
                "{:.1} seeds per wall second",
                outcomes.len() as f64 / wall_secs.max(1e-9)
            ),
        ]
    }
}

struct Sim {
    world: World,
    safekeepers: Safekeepers,
    /// Draws each safekeeper start's backup and removal settings.
    config_rng: SmallRng,
    /// The running writer incarnations, the current (newest) last.
    writers: Vec<WriterIncarnation>,
    writers_started: u64,
    /// When the supervisor starts a new writer (the current one stopped).
    restart_writer_at: Option<tokio::time::Instant>,
    replicas: Vec<Option<ReplicaNode>>,
    /// Highest position each replica reported (durable).
    reported: Arc<Mutex<Vec<Lsn>>>,
    violations: Arc<Mutex<Vec<String>>>,
    replica_crashes: usize,
    /// The table's id in the catalog, once created.
    table_id: u64,
    format: LakeFormat,
    retention: Option<u64>,
    /// Every insert the client sent, by key, and the answers.
    sent: BTreeMap<String, Sent>,
    /// Keys acknowledged (200), with the ids they carry.
    acked: BTreeMap<String, Vec<i64>>,
    /// Ids of requests given up after an unknown outcome (at most once).
    given_up: BTreeSet<i64>,
    /// Ids of refused requests (never in the lake).
    refused: BTreeSet<i64>,
    results: (
        tokio::sync::mpsc::UnboundedSender<client::Answer>,
        tokio::sync::mpsc::UnboundedReceiver<client::Answer>,
    ),
    in_flight: usize,
    next_request: u64,
    next_id: i64,
    exports_asked: usize,
    /// The client's and the schedule's own draws.
    client_rng: SmallRng,
    /// Draws of what came with data-dir losses (partial backup settings,
    /// cut copies), apart from the other generators so that adding them
    /// moved no earlier draw.
    loss_rng: SmallRng,
    /// The safekeeper whose data dir was lost, until its restore succeeds.
    restoring: Option<usize>,
    /// Replicas whose data dir was lost, until a copy from their peer
    /// succeeds.
    rebuilding: BTreeSet<usize>,
    safekeepers_restored: usize,
    replicas_rebuilt: usize,
    /// Copies from a peer cut by a power cut.
    copies_cut: usize,
    /// Plain starts (no copy asked) of a replica holding an unfinished
    /// copy, refused as they must be.
    unfinished_copies_refused: usize,
}

impl Sim {
    fn log(&mut self, line: impl AsRef<str>) {
        self.world.log(line);
    }

    fn fail(&self, reason: impl Into<String>) -> Failure {
        self.world.fail(reason)
    }
}
