//! The WAL random test: three safekeepers, writers and a simulated replica
//! under a random schedule of writes, crashes, restarts, partitions, disk
//! stalls and failures, writer restarts and takeovers, a misbehaving
//! proposer, a lost data dir rebuilt from the backup or a peer, disks
//! nearly full, and crashes inside partial uploads, checked against the
//! invariants of the WAL quorum.
//!
//! * [`schedule`]: the events and how a seed draws them;
//! * `nodes`: starting, crashing, losing and rebuilding safekeepers;
//! * `writers`: starting, killing and replacing writers, and the known
//!   commit kept in coordination;
//! * `checks`: the checks at every step and the final ones;
//! * `driver`: the run loop ([`run_seed`]);
//! * [`rogue`]: the misbehaving proposer;
//! * [`walreceiver`]: the simulated replica, which checks every walsender
//!   frame.

mod checks;
mod driver;
mod nodes;
pub mod rogue;
pub mod schedule;
pub mod walreceiver;
mod writers;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_safekeeper::wal_storage::Preallocation;
use ferry_wal::record::Record;
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn};
use ferry_writer::driver::{Writer, WriterError, WriterStatus};
use tokio::sync::{mpsc, watch};

pub use crate::world::Failure;
pub use driver::run_seed;
pub use schedule::{
    add_disk_full, add_disk_loss, add_idle_periods, add_partial_crashes, add_pull_during_catch_up,
    generate_schedule, Event, Schedule,
};

use crate::safekeepers::{name as node_name, Safekeepers};
use crate::world::coord::SimSessions;
use crate::world::disk::CrashStats;
use crate::world::{Run, World};
use walreceiver::SharedReceived;

const SAFEKEEPERS: usize = 3;
const SEGMENT_BYTES: u64 = 64 << 10;
const TIMELINE: u64 = 1;

fn cluster_id() -> ClusterId {
    ClusterId::new("sim").unwrap_or_else(|_| unreachable!("a valid cluster id"))
}
/// After the faults stop, a write must commit within this (virtual) time.
const LIVENESS_BOUND: Duration = Duration::from_secs(60);

/// What one seed did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub run: Run,
    pub acknowledged: usize,
    pub elections: usize,
    pub commit_lsn: Lsn,
    /// Lost safekeepers rebuilt from a peer.
    pub pulled: usize,
    /// What the safekeeper crashes found on their disks, summed.
    pub crash_stats: CrashStats,
}

/// The WAL workload, as the seed harness runs it.
pub struct Wal;

impl crate::seeds::Workload for Wal {
    type Outcome = Outcome;
    const NAME: &'static str = "wal";

    fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
        run_seed(seed, verbose)
    }

    fn run(outcome: &Outcome) -> &Run {
        &outcome.run
    }

    fn counters(o: &Outcome) -> Vec<String> {
        vec![
            format!("{} acknowledged writes", o.acknowledged),
            format!("{} elections", o.elections),
            format!("commit_lsn {}", o.commit_lsn),
            format!("{} safekeepers pulled from a peer", o.pulled),
        ]
    }

    fn totals(outcomes: &[Outcome], wall_secs: f64) -> Vec<String> {
        let simulated: Duration = outcomes.iter().map(|o| o.run.simulated).sum();
        vec![format!(
            "{:.0} simulated s per wall s",
            simulated.as_secs_f64() / wall_secs.max(1e-9)
        )]
    }

    fn notes(outcomes: &[Outcome]) -> Vec<String> {
        let mut crashes = CrashStats::default();
        for o in outcomes {
            crashes.crashes += o.crash_stats.crashes;
            crashes.found_unsynced += o.crash_stats.found_unsynced;
            crashes.bytes_lost += o.crash_stats.bytes_lost;
            crashes.torn += o.crash_stats.torn;
            crashes.fenced_ops += o.crash_stats.fenced_ops;
        }
        vec![format!(
            "safekeeper crashes: {}, of which {} ({:.0}%) found unsynced data or directory entries; they dropped {} unsynced bytes and tore {} files' last writes; tasks of crashed processes tried {} disk operations after their crash (fenced)",
            crashes.crashes,
            crashes.found_unsynced,
            100.0 * crashes.found_unsynced as f64 / crashes.crashes.max(1) as f64,
            crashes.bytes_lost,
            crashes.torn,
            crashes.fenced_ops
        )]
    }
}

/// Each writer incarnation runs on a node of its own (another machine), so a
/// partition can cut an old writer off while a new one takes over.
/// Whether the writers of the run of `seed` catch safekeepers up in
/// recovery reads of a few KiB (a quarter of the runs; see
/// `Sim::start_writer_knowing`).
fn small_recovery_reads(seed: u64) -> bool {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 62 == 0
}

fn writer_node(incarnation: u64) -> String {
    format!("writer{incarnation}")
}

/// The deterministic payload of insert `block`.
fn insert_record(block: u64, bytes: usize) -> Record {
    let mut payload = Vec::with_capacity(bytes + 8);
    payload.extend_from_slice(&block.to_le_bytes());
    payload.extend((0..bytes).map(|i| (block as usize * 31 + i) as u8));
    Record::Insert {
        shard: 0,
        idempotency_key: bytes::Bytes::new(),
        table_id: 1,
        block_number: block,
        arrow_ipc: Bytes::from(payload),
    }
}

fn payload_is_intact(block: u64, arrow_ipc: &Bytes) -> bool {
    arrow_ipc.len() >= 8
        && arrow_ipc[..8] == block.to_le_bytes()
        && arrow_ipc[8..]
            .iter()
            .enumerate()
            .all(|(i, b)| *b == (block as usize * 31 + i) as u8)
}

/// (writer incarnation, block, outcome) of one append.
type AppendResult = (u64, u64, Result<Lsn, WriterError>);

struct Sim {
    /// Network, disks, coordination, object storage, clock and the event log.
    world: World,
    /// The safekeepers' disks and running nodes.
    safekeepers: Safekeepers,
    /// The WAL preallocation policy each safekeeper was last started with (drawn
    /// at every start: preallocated and growing segments, and switches between
    /// them across restarts, all meet crashes).
    preallocation: Vec<Preallocation>,
    writer: Option<Arc<Writer>>,
    status: Option<watch::Receiver<WriterStatus>>,
    /// Writers replaced by a takeover and still running, by incarnation.
    old_writers: BTreeMap<u64, (Arc<Writer>, watch::Receiver<WriterStatus>)>,
    writers_started: u64,
    pending_writes: Vec<tokio::task::JoinHandle<()>>,
    next_block: u64,
    acked: BTreeMap<u64, Lsn>,
    /// Blocks whose append failed (not acknowledged: outcome unknown).
    not_acked: BTreeSet<u64>,
    /// Of those, the ones refused for lack of disk space: nothing of them
    /// may be written.
    refused_unwritten: BTreeSet<u64>,
    results: (
        mpsc::UnboundedSender<AppendResult>,
        mpsc::UnboundedReceiver<AppendResult>,
    ),
    /// Highest LSN known committed (acknowledgements and writer reports).
    committed: Lsn,
    /// Highest LSN each writer incarnation got committed.
    committed_by: BTreeMap<u64, Lsn>,
    /// The election of each writer incarnation: (term, epoch start).
    elected: BTreeMap<u64, (u64, Lsn)>,
    /// Which incarnation was elected in each term (at most one).
    term_owner: BTreeMap<u64, u64>,
    /// Highest end of WAL any writer produced.
    produced: Lsn,
    elections: usize,
    /// What the simulated replica received through walsenders.
    received: SharedReceived,
    /// Per safekeeper: the highest term seen (across restarts: it is
    /// persisted) and the commit_lsn seen in its current incarnation.
    seen_terms: Vec<u64>,
    seen_commits: Vec<Lsn>,
    /// Sessions of the "control" node that reads the known commit, and its
    /// current session.
    control_sessions: SimSessions,
    control: Option<ferry_coord::Session>,
    /// Sessions of the writers' commit records, and each running writer's
    /// recorder (the product's, `ferry_node::commit_record`), by incarnation:
    /// it lives and dies with its writer.
    recorder_sessions: SimSessions,
    recorders: BTreeMap<u64, tokio::task::JoinHandle<()>>,
    /// The safekeeper whose data dir was lost, where the WAL its restore or
    /// pull put back starts, and that WAL (checked at the end against the
    /// committed WAL).
    restored: Option<(usize, Lsn, Bytes)>,
    /// Whether each attempt to rebuild the lost safekeeper pulls it from a
    /// peer or restores it from the backup: drawn apart from the world's
    /// generator, so that the seeds drawn before pulls existed keep their
    /// events.
    pull_rng: rand::rngs::SmallRng,
    /// Safekeepers rebuilt from a peer (the others of `restored` came from
    /// the backup).
    pulled: usize,
    /// The safekeeper whose data dir was lost and whose restore has not
    /// succeeded yet (the backup may lack what it needs until the others
    /// upload it): it stays down, and the restore is tried again between
    /// events, as an operator would retry, while the world goes on.
    restoring: Option<usize>,
    /// How the next rebuild runs when an [`Event::PullDuringCatchUp`] asked
    /// for it: a pull whose disk stalls, and when the replica comes back.
    pull_plan: Option<PullPlan>,
}

/// See [`Event::PullDuringCatchUp`].
#[derive(Debug, Clone, Copy)]
struct PullPlan {
    stall: Duration,
    heal: Duration,
}

impl Sim {
    fn log(&mut self, msg: impl AsRef<str>) {
        self.world.log(msg);
    }

    fn fail(&self, reason: impl Into<String>) -> Failure {
        self.world.fail(reason)
    }

    fn segment() -> SegmentSize {
        SegmentSize::new(SEGMENT_BYTES)
            .unwrap_or_else(|_| unreachable!("64 KiB is a valid segment size"))
    }
}
