//! The replica random test: inserts through the real writer into three real
//! safekeepers, and replicas of 2 shards x 2 replicas (the production
//! `Replica`, walreceiver and merge task) streaming from them, under replica
//! crashes that land between writes and fsyncs (unsynced data lost, torn
//! files), safekeeper crashes under a streaming replica, partitions between
//! replicas and safekeepers and between the writer and a safekeeper (which
//! then lags while its walsenders still talk), and retried inserts with their
//! idempotency keys. [`run_lagging_safekeeper`] is a fixed scenario: the
//! replicas on a lagging safekeeper must leave it while the partition lasts.
//!
//! Checked at every step: a replica's `disk_consistent_lsn` never goes back,
//! not within an incarnation and not across a crash (what it reported was
//! durable). Checked once faults stop and everything settled: every replica
//! holds exactly the rows of its shard's acknowledged inserts, each once (a
//! retried insert included); the replicas of a shard hold the same parts,
//! name for name and checksum for checksum; no replica stopped.
//!
//! * `schedule`: the events, the inserts they send, and how a seed draws
//!   them;
//! * `nodes`: the world with its safekeepers (through the shared
//!   [`crate::safekeepers`] harness), the writer and the replicas; starting
//!   and crashing them;
//! * `checks`: the step checks and the final check of every replica's rows;
//! * `driver`: the run loop ([`run_seed`], [`run_lagging_safekeeper`]).

mod checks;
mod driver;
mod nodes;
mod schedule;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_table::Table;
use ferry_wal::Lsn;
use ferry_writer::driver::Writer;
use rand::rngs::SmallRng;
use tokio::sync::mpsc;
use tokio::time::Instant;

pub use driver::{run_lagging_safekeeper, run_seed};
pub(crate) use nodes::{copy_lost_replica, watch_position};

use crate::safekeepers::{name as sk_name, Safekeepers};
use crate::world::{Failure, Run, World};
use nodes::ReplicaNode;
use schedule::Request;

const SAFEKEEPERS: usize = 3;
const SHARDS: u32 = 2;
const REPLICAS_PER_SHARD: u32 = 2;
const SEGMENT_BYTES: u64 = 64 << 10;
/// More than the WAL of the largest insert of the schedule (39 rows).
const MAX_INSERT_WAL: u64 = 32 << 10;
const TABLE_ID: u64 = 1;
const PARTITIONS: [&str; 3] = ["p0", "p1", "p2"];
/// Bytes a replica's safekeeper may fall behind another before it moves.
const LAG_BYTES: u64 = 4 << 10;

fn table() -> Table {
    ferry_testkit::table::id_p_table(TABLE_ID, "t", 2, &["pad"])
}

fn replica_name(i: usize) -> String {
    format!(
        "r{}{}",
        i as u32 / REPLICAS_PER_SHARD,
        i as u32 % REPLICAS_PER_SHARD
    )
}

fn replicas() -> usize {
    (SHARDS * REPLICAS_PER_SHARD) as usize
}

/// What one seed did.
#[derive(Debug)]
pub struct Outcome {
    pub run: Run,
    pub acknowledged: usize,
    pub rows: usize,
    pub replica_crashes: usize,
    /// Replicas built from a peer's copy after losing their data dir.
    pub rebuilds: usize,
    pub merges: u64,
}

/// An insert's request and whether it was acknowledged.
type ResultTx = mpsc::UnboundedSender<(Request, bool)>;
type ResultRx = mpsc::UnboundedReceiver<(Request, bool)>;

/// The replica workload, as the seed harness runs it.
pub struct Replicas;

impl crate::seeds::Workload for Replicas {
    type Outcome = Outcome;
    const NAME: &'static str = "replicas";

    fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
        run_seed(seed, verbose)
    }

    fn run(outcome: &Outcome) -> &Run {
        &outcome.run
    }

    fn counters(o: &Outcome) -> Vec<String> {
        vec![
            format!("{} acknowledged inserts", o.acknowledged),
            format!("{} rows per shard copy", o.rows),
            format!("{} replica crashes", o.replica_crashes),
            format!("{} rebuilt from a peer", o.rebuilds),
            format!("{} merges", o.merges),
        ]
    }

    fn totals(outcomes: &[Outcome], _wall_secs: f64) -> Vec<String> {
        let crashes: usize = outcomes.iter().map(|o| o.replica_crashes).sum();
        let merges: u64 = outcomes.iter().map(|o| o.merges).sum();
        let rebuilds: usize = outcomes.iter().map(|o| o.rebuilds).sum();
        vec![
            format!("{crashes} replica crashes"),
            format!("{rebuilds} rebuilt from a peer"),
            format!("{merges} merges"),
        ]
    }
}

struct Sim {
    world: World,
    /// The safekeepers' disks and running nodes.
    safekeepers: Safekeepers,
    /// Taken by the clean shutdown at the end.
    writer: Option<Arc<Writer>>,
    /// Draws each safekeeper start's backup and removal settings.
    config_rng: SmallRng,
    /// The writer's max_replication_flush_lag (0: no back-pressure).
    flush_lag: u64,
    /// Writer's and safekeepers' replica expiry in this run.
    replica_expiry: Duration,
    expiry_rng: SmallRng,
    rebuild_rng: SmallRng,
    rebuilds: usize,
    /// What the writer showed of back-pressure at the last step (see
    /// `check_steps`).
    back_pressure_seen: Option<BackPressureSample>,
    replicas: Vec<Option<ReplicaNode>>,
    /// Replicas kept down past the replica expiry, and until when: the
    /// events go on meanwhile (safekeeper crashes and restarts too).
    down_until: Vec<Option<Instant>>,
    /// Highest `disk_consistent_lsn` each replica reported (durable).
    reported: Arc<Mutex<Vec<Lsn>>>,
    violations: Arc<Mutex<Vec<String>>>,
    acked: BTreeMap<String, Request>,
    unknown: Vec<Request>,
    results: (ResultTx, ResultRx),
    in_flight: usize,
    next_request: u64,
    next_id: i64,
    replica_crashes: usize,
}

impl Sim {
    fn log(&mut self, line: impl AsRef<str>) {
        self.world.log(line);
    }

    fn fail(&self, reason: impl Into<String>) -> Failure {
        self.world.fail(reason)
    }
}

/// What the back-pressure check saw of the writer at one step.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BackPressureSample {
    term: ferry_wal::Term,
    /// The end of WAL.
    end: Lsn,
    /// The slowest replica's disk_consistent_lsn the writer knows.
    min: Lsn,
    /// The replicas the writer knows (shard, replica).
    known: std::collections::BTreeSet<(u32, u32)>,
    /// How many replicas the writer forgot since it started.
    forgotten: u64,
    /// How many times the writer heard a replica go back (rebuilt lower).
    setbacks: u64,
}
