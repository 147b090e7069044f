//! The simulated world every workload runs in: nodes of any role and count,
//! each with its own disk, one network, one coordination service, one object
//! store and one clock, all drawn from the seed; crashes, restarts and
//! partitions of nodes; and the time-stamped event log whose hash identifies
//! a run.
//!
//! Each workload (`wal`, `replicas`, `export`) holds one `World`, starts its
//! nodes on the world's seams, drives a schedule of its own and checks its
//! invariants; the world holds nothing of any protocol.
//!
//! * [`disk`]: a node's disk, which loses unsynced writes on a crash;
//! * [`net`]: byte streams between named nodes, with delays, broken links
//!   and partitions;
//! * [`clock`]: virtual Unix time from a seeded start;
//! * [`coord`]: coordination with ZooKeeper's failure behaviour;
//! * [`objstore`]: object storage with errors, latency and failures after a
//!   successful write (from `ferry-testkit`, which tests outside the
//!   simulator use too);
//! * [`faults`]: the faults a workload's schedule can hold.

pub mod clock;
pub mod coord;
pub mod disk;
pub mod faults;
pub mod net;
pub use ferry_testkit::objstore;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ferry_export::Destinations;
use ferry_storage::{Location, StorageError};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use clock::SimClock;
use coord::{CoordFaults, SimCoordination};
use disk::{CrashStats, DiskLatency, SimDisk};
use net::{NetOptions, SimNet};
use objstore::{FaultyObjectStore, ObjectFaults};

/// The simulated lake as an `s3://` URL (what a table's export policy must
/// name): the same store as `sim://lake/`.
pub const LAKE_BUCKET: &str = "s3://sim-lake/";

/// The simulated lake as export destinations see it: `sim://lake/<prefix>`
/// or [`LAKE_BUCKET`]`<prefix>`.
pub struct Lake(pub Arc<dyn object_store::ObjectStore>);

impl Destinations for Lake {
    fn open(&self, url: &str) -> Result<Location, StorageError> {
        let prefix = url
            .strip_prefix("sim://lake/")
            .or_else(|| url.strip_prefix(LAKE_BUCKET))
            .ok_or_else(|| StorageError::InvalidUrl {
                url: url.to_string(),
                reason: "not a simulated lake".into(),
            })?;
        Location::from_store(url, Arc::clone(&self.0), prefix)
    }
}

/// A broken invariant (or a run that could not finish), with the log so far.
#[derive(Debug, Clone)]
pub struct Failure {
    pub seed: u64,
    pub reason: String,
    pub log: Vec<String>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seed {}: {}", self.seed, self.reason)
    }
}

/// What every run reports, whatever its workload.
#[derive(Debug, Clone)]
pub struct Run {
    pub seed: u64,
    /// Events in its schedule.
    pub events: usize,
    /// Virtual time from the world's start to the end of the run.
    pub simulated: Duration,
    /// crc32c of the event log: equal for equal runs.
    pub log_hash: u32,
    /// The time-stamped event log.
    pub log: Vec<String>,
}

/// How a workload times its crashes of a node (see `World::crash`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AfterAWrite {
    /// The share of crashes that wait for a write.
    pub prob: f64,
    /// How long one waits at most.
    pub within: Duration,
}

/// A node of a workload, stopped as a crash stops it (every task ends at
/// once).
pub(crate) trait Stop {
    async fn stop(self);
}

/// Stops every running node of `nodes` in order (the end of a run: a node
/// left running would keep its tasks, and their timers, alive).
pub(crate) async fn stop_all<N: Stop>(nodes: &mut [Option<N>]) {
    for node in nodes.iter_mut().filter_map(Option::take) {
        node.stop().await;
    }
}

/// Everything outside the nodes of one simulated run.
pub struct World {
    pub seed: u64,
    pub start: Instant,
    /// The world's own random choices (crash timing, policies, tearing).
    pub rng: SmallRng,
    pub net: SimNet,
    pub clock: SimClock,
    pub coord: SimCoordination,
    /// Object storage (in memory, with faults), as node code sees it.
    pub lake: Location,
    pub lake_store: FaultyObjectStore,
    disks: BTreeMap<String, SimDisk>,
    disk_latency: Option<DiskLatency>,
    log: Vec<String>,
    verbose: bool,
}

impl World {
    /// A world drawn from `rng` (the run's seed), with `net` network settings.
    pub async fn new(
        seed: u64,
        rng: &mut SmallRng,
        net: NetOptions,
        coord_faults: CoordFaults,
        object_faults: ObjectFaults,
        verbose: bool,
    ) -> Result<World, Failure> {
        let fail = |reason: String| Failure {
            seed,
            reason,
            log: Vec::new(),
        };
        let coord = SimCoordination::new(rng.random(), coord_faults)
            .await
            .map_err(|e| fail(format!("cannot start simulated coordination: {e}")))?;
        let lake_store = FaultyObjectStore::new(rng.random(), object_faults);
        let lake = Location::from_store("sim://lake", Arc::new(lake_store.clone()), "")
            .map_err(|e| fail(format!("cannot open simulated object storage: {e}")))?;
        Ok(World {
            seed,
            start: Instant::now(),
            net: SimNet::new(rng.random(), net),
            clock: SimClock::seeded(rng),
            rng: SmallRng::seed_from_u64(rng.random()),
            coord,
            lake,
            lake_store,
            disks: BTreeMap::new(),
            disk_latency: Some(DiskLatency::ssd()),
            log: Vec::new(),
            verbose,
        })
    }

    /// Appends a time-stamped line to the event log.
    pub fn log(&mut self, msg: impl AsRef<str>) {
        let t = self.start.elapsed();
        let line = format!("{:>9.3}s {}", t.as_secs_f64(), msg.as_ref());
        if self.verbose {
            println!("{line}");
        }
        self.log.push(line);
    }

    /// A failure of this run, with the log so far.
    pub fn fail(&self, reason: impl Into<String>) -> Failure {
        Failure {
            seed: self.seed,
            reason: reason.into(),
            log: self.log.clone(),
        }
    }

    /// The end of a run of a schedule of `events` events: its duration, its
    /// log and the log's hash.
    pub fn finish(self, events: usize) -> Run {
        Run {
            seed: self.seed,
            events,
            simulated: self.start.elapsed(),
            log_hash: self.log_hash(),
            log: self.log,
        }
    }

    /// crc32c of the event log: two runs of a seed that differ anywhere
    /// differ here, which is cheaper to compare and to print than the log.
    pub fn log_hash(&self) -> u32 {
        self.log
            .iter()
            .fold(0u32, |h, line| crc32c::crc32c_append(h, line.as_bytes()))
    }

    /// The disk of `node`, made on first use (with the world's disk latency);
    /// it outlives the node's crashes.
    pub fn disk(&mut self, node: &str) -> SimDisk {
        if let Some(d) = self.disks.get(node) {
            return d.clone();
        }
        let disk = SimDisk::new();
        disk.set_latency(self.disk_latency, self.rng.random());
        self.disks.insert(node.to_string(), disk.clone());
        disk
    }

    /// Power-cuts `node`'s disk (its process must be stopped first): unsynced
    /// writes are lost, the last ones maybe torn; its coordination sessions
    /// are abandoned (they expire after their timeout).
    pub fn crash_disk(&mut self, node: &str) {
        if let Some(disk) = self.disks.get(node).cloned() {
            disk.crash(&mut self.rng, true);
        }
        self.coord.crash_node(node);
    }

    /// Crashes `node` (named `name`), which the workload has just taken
    /// out of its running nodes: with `after_a_write`, the crash may first
    /// wait for the node's next write, so that it lands between that write
    /// and its fsync (an idle disk holds nothing unsynced to lose); then
    /// every task of the node ends at once and its disk is power-cut (see
    /// [`World::crash_disk`]).
    pub(crate) async fn crash<N: Stop>(
        &mut self,
        name: &str,
        node: N,
        after_a_write: Option<AfterAWrite>,
    ) {
        if let Some(after) = after_a_write {
            let disk = self.disk(name);
            if self.rng.random_bool(after.prob) && disk.wait_for_unsynced_write(after.within).await
            {
                self.log(format!("{name} crashes right after a write"));
            }
        }
        node.stop().await;
        self.crash_disk(name);
        self.log(format!("{name} crashed"));
    }

    /// Cuts the network between two nodes (and `a`'s coordination link when
    /// `b` is "coord").
    pub fn partition(&mut self, a: &str, b: &str) {
        self.net.partition(a, b);
        self.log(format!("partition {a} | {b}"));
    }

    /// Repairs the network between `a` and `b` only.
    pub fn heal(&mut self, a: &str, b: &str) {
        self.net.heal(a, b);
        self.log(format!("heal {a} | {b}"));
    }

    pub fn repair_all(&mut self) {
        self.net.repair_all();
        self.coord.repair_all();
        self.log("partitions repaired");
    }

    /// What crashes found on every disk of the world, summed.
    pub fn crash_stats(&self) -> CrashStats {
        self.disks
            .values()
            .map(SimDisk::crash_stats)
            .fold(CrashStats::default(), |a, b| CrashStats {
                crashes: a.crashes + b.crashes,
                found_unsynced: a.found_unsynced + b.found_unsynced,
                bytes_lost: a.bytes_lost + b.bytes_lost,
                torn: a.torn + b.torn,
                fenced_ops: a.fenced_ops + b.fenced_ops,
            })
    }

    /// fsyncs of every disk, by node (they make the log sensitive to any
    /// change of the execution).
    pub fn fsyncs(&self) -> Vec<(String, u64)> {
        self.disks
            .iter()
            .map(|(n, d)| (n.clone(), d.fsyncs()))
            .collect()
    }
}
