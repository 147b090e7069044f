//! The replica workload's nodes: three safekeepers (started and crashed
//! through the shared [`crate::safekeepers`] harness, their settings drawn
//! from a generator of their own), one writer, and 2 shards x 2 replicas as
//! the product assembles them (`ferry_node::ReplicaNode`), each watched so
//! that its reported position never goes back; crashes of replicas, some
//! kept down past the replica expiry, and some losing their data dir and
//! built again from the other replica of their shard.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_env::{Cpu, Disk};
use ferry_node::SafekeeperOpen;
use ferry_replica::replica::bootstrap::{
    copy_from_peer, needs_copy, BootstrapError, Bootstrapped, CopyCheck,
};
use ferry_replica::{SharedReplica, StreamConfig};
use ferry_safekeeper::acceptor::AcceptorConfig;
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn};
use ferry_writer::driver::{Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{
    replica_name, replicas, sk_name, table, Failure, Sim, LAG_BYTES, REPLICAS_PER_SHARD,
    SAFEKEEPERS, SEGMENT_BYTES,
};
use crate::safekeepers::{draw_backup_settings, Safekeepers};
use crate::world::coord::CoordFaults;
use crate::world::net::NetOptions;
use crate::world::objstore::ObjectFaults;
use crate::world::{AfterAWrite, Stop, World};

/// Most replica crashes wait for a write, so they land before its fsync.
const CRASH: AfterAWrite = AfterAWrite {
    prob: 0.7,
    within: Duration::from_secs(1),
};

/// A running replica: the node as the product assembles it, and the
/// simulation's monitor of its reported position.
pub(super) struct ReplicaNode {
    node: ferry_node::ReplicaNode,
    monitor: tokio::task::JoinHandle<()>,
    /// Its endpoint serving copies of it (`ferry_node::bootstrap::router`).
    http: ferry_node::http::HttpServer,
}

/// Where replica `i` serves copies of itself on the simulated network.
fn http_addr(i: usize) -> String {
    format!("{}-http", replica_name(i))
}

impl ReplicaNode {
    pub(super) fn shared(&self) -> &SharedReplica {
        &self.node.replica
    }
}

impl Stop for ReplicaNode {
    /// A crash: every task ends at once.
    async fn stop(self) {
        self.http.abort().await;
        self.node.stop().await;
        self.monitor.abort();
        let _ = self.monitor.await;
    }
}

impl Sim {
    pub(super) fn acceptor_config(i: usize) -> AcceptorConfig {
        AcceptorConfig {
            cluster_id: ClusterId::new("replica-sim").expect("id"),
            node_id: i as u64,
            timeline_id: 1,
            segment_size: SegmentSize::new(SEGMENT_BYTES).expect("segment size"),
            preallocation: Default::default(),
        }
    }

    /// Starts safekeeper `i` (`create`: for the first time) with WAL backup
    /// to the lake and removal behind every replica, drawn at every start
    /// from a generator of their own (the schedule's draws stay as they
    /// were): a replica that was down long reads removed WAL back from the
    /// backup.
    pub(super) async fn start_safekeeper(&mut self, i: usize, create: bool) -> Result<(), Failure> {
        let mut config = draw_backup_settings(&mut self.config_rng, &self.world.lake);
        config.replica_expiry = self.replica_expiry;
        let described = format!(
            "backup jobs {}, keep-horizon {}, removal every {:?}, replica expiry {:?}",
            config.backup.as_ref().map_or(0, |b| b.parallel_jobs),
            config.walsenders_keep_horizon,
            config.removal_interval,
            config.replica_expiry
        );
        let open = if create {
            SafekeeperOpen::Create
        } else {
            SafekeeperOpen::Open
        };
        self.safekeepers
            .start(
                &mut self.world,
                i,
                open,
                Self::acceptor_config(i),
                config,
                "cannot open",
                &described,
            )
            .await
    }

    pub(super) async fn crash_safekeeper(&mut self, i: usize) {
        self.safekeepers.crash(&mut self.world, i, None).await;
    }

    /// Opens replica `i` from its disk, checking it kept what it reported.
    pub(super) async fn start_replica(&mut self, i: usize) -> Result<(), Failure> {
        let name = replica_name(i);
        let disk: Arc<dyn Disk> = Arc::new(self.world.disk(&name).for_process());
        let mut config = StreamConfig::new((0..SAFEKEEPERS).map(sk_name).collect());
        config.reconnect_delay = Duration::from_millis(100);
        config.lag_probe_interval = Duration::from_secs(1);
        config.max_lag_bytes = LAG_BYTES;
        // Each replica starts on another safekeeper.
        config.safekeepers.rotate_left(i % SAFEKEEPERS);
        let node = ferry_node::ReplicaNode::start(
            ferry_node::ReplicaNodeConfig {
                dir: "replica".into(),
                shard: i as u32 / REPLICAS_PER_SHARD,
                replica: i as u32 % REPLICAS_PER_SHARD,
                wal: ferry_node::WalSource::Safekeepers {
                    network: self.world.net.node(&name),
                    config,
                },
                merges: Some(Duration::from_secs(2)),
                export: None,
            },
            ferry_node::ReplicaSeams {
                disk,
                clock: Arc::new(self.world.clock.clone()),
                cpu: Cpu::Inline,
                tables: Arc::new(ferry_testkit::table::FixedTables::new([table()])),
            },
        )
        .await
        .map_err(|e| self.fail(format!("{name} cannot reopen: {e}")))?;
        let opened = node.replica.lock().await.disk_consistent_lsn();
        let reported = self.reported.lock().map(|r| r[i]).unwrap_or_default();
        if opened < reported {
            node.stop().await;
            return Err(self.fail(format!(
                "{name} reopened at {opened}, below the {reported} it reported as durable"
            )));
        }
        // The step check: the position never goes back.
        let monitor = watch_position(
            name,
            i,
            node.reader.status.clone(),
            Arc::clone(&self.reported),
            Arc::clone(&self.violations),
        );
        let name = replica_name(i);
        let donor = ferry_replica::replica::bootstrap::LocalDonor {
            replica: Arc::clone(&node.replica),
            clock: Arc::new(self.world.clock.clone()),
            name: name.clone(),
        };
        let listener = self
            .world
            .net
            .node(&name)
            .bind(&http_addr(i))
            .await
            .map_err(|e| self.fail(format!("{name}: binding its endpoint: {e}")))?;
        let http =
            ferry_node::http::serve(listener, ferry_node::bootstrap::router(Arc::new(donor)))
                .map_err(|e| self.fail(format!("{name}: serving its endpoint: {e}")))?;
        self.replicas[i] = Some(ReplicaNode {
            node,
            monitor,
            http,
        });
        self.log(format!("{} started at {opened}", replica_name(i)));
        Ok(())
    }

    /// Replica `i` crashes, loses its data dir, and is built from a copy of
    /// the other replica of its shard, running meanwhile (applying WAL and
    /// merging): through the product's copy, the donor's hold and the new
    /// replica's checks. Half of the copies are cut by a power cut first and
    /// done again over what the cut left. Without a running peer (or while
    /// `i` is kept down) it is an ordinary crash.
    pub(super) async fn rebuild_replica(&mut self, i: usize) -> Result<(), Failure> {
        let peer = i ^ 1; // the other replica of the shard (2 per shard)
        if self.replicas[peer].is_none() || self.replicas[i].is_none() {
            return self.crash_replica(i).await;
        }
        let Some(node) = self.replicas[i].take() else {
            return Ok(());
        };
        let name = replica_name(i);
        self.world.crash(&name, node, Some(CRASH)).await;
        self.replica_crashes += 1;
        self.world.disk(&name).lose("replica");
        // Over HTTP on the simulated network, as `ferry replica
        // --bootstrap-from` copies.
        let source = ferry_node::bootstrap::HttpDonor {
            peers: ferry_node::http::HttpPeers::new(self.world.net.node(&name), None),
            addr: http_addr(peer),
        };
        let (shard, number) = (i as u32 / REPLICAS_PER_SHARD, i as u32 % REPLICAS_PER_SHARD);
        // A quarter of the copies meet a cut between the copier and its
        // donor for a while: the copy stalls past its idle timeout, fails,
        // and is tried again (as `ferry replica` does).
        if self.rebuild_rng.random_bool(0.25) {
            let after = Duration::from_millis(self.rebuild_rng.random_range(0..300));
            let lasts = Duration::from_millis(self.rebuild_rng.random_range(100..5_000));
            let (net, a, b) = (self.world.net.clone(), name.clone(), replica_name(peer));
            self.log(format!(
                "{a} | {b} cut for {lasts:?}, {after:?} into the copy"
            ));
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                net.partition(&a, &b);
                tokio::time::sleep(lasts).await;
                net.heal(&a, &b);
            });
        }
        let cut = self
            .rebuild_rng
            .random_bool(0.5)
            .then(|| Duration::from_millis(self.rebuild_rng.random_range(0..300)));
        let copied = copy_lost_replica(
            &mut self.world,
            &name,
            shard,
            number,
            &source,
            cut,
            10,
            true,
        )
        .await
        .map_err(|e| self.fail(e))?;
        let built = copied
            .built
            .transpose()
            .map_err(|e| self.fail(format!("{name}: copying {}: {e}", replica_name(peer))))?;
        if copied.failed_attempts > 0 {
            self.log(format!(
                "{name}: {} copies from {} failed and were tried again",
                copied.failed_attempts,
                replica_name(peer)
            ));
        }
        self.rebuilds += 1;
        let position = built
            .as_ref()
            .map(|b| b.disk_consistent_lsn)
            .unwrap_or_default();
        self.log(format!(
            "{name} lost its data dir, built from {} at {position}: {:?}",
            replica_name(peer),
            built
        ));
        // A new replica under the old name: its position starts at the copy's.
        if let Ok(mut r) = self.reported.lock() {
            r[i] = position;
        }
        self.start_replica(i).await
    }

    pub(super) async fn crash_replica(&mut self, i: usize) -> Result<(), Failure> {
        let name = replica_name(i);
        if let Some(node) = self.replicas[i].take() {
            self.world.crash(&name, node, Some(CRASH)).await;
            self.replica_crashes += 1;
            // With a short replica expiry, some crashed replicas stay down
            // past it while the events go on: forgotten, WAL removed past
            // them, they come back reading it from the backup.
            if self.replica_expiry < ferry_wal::liveness::DEFAULT_REPLICA_EXPIRY
                && self.expiry_rng.random_bool(0.3)
            {
                let down = self.replica_expiry * 2 + Duration::from_secs(2);
                self.log(format!("{name} stays down {down:?}"));
                self.down_until[i] = Some(Instant::now() + down);
                return Ok(());
            }
        } else if self.down_until[i].is_some() {
            // Kept down: it comes back when its time is up.
            return Ok(());
        }
        self.start_replica(i).await
    }

    /// Starts the replicas kept down whose time is up (all of them when
    /// `all`). A replica silent that long must be forgotten by the writer,
    /// which has run all along: no feedback of it relayed again by a
    /// safekeeper (one restarted meanwhile still lists it until its own
    /// expiry) may bring it back.
    pub(super) async fn restart_kept_down(&mut self, all: bool) -> Result<(), Failure> {
        for i in 0..replicas() {
            let Some(until) = self.down_until[i] else {
                continue;
            };
            if !all && Instant::now() < until {
                continue;
            }
            self.down_until[i] = None;
            let (shard, replica) = (i as u32 / REPLICAS_PER_SHARD, i as u32 % REPLICAS_PER_SHARD);
            if let Some(writer) = &self.writer {
                let held = writer
                    .status()
                    .replicas
                    .iter()
                    .any(|f| f.shard_number == shard && f.replica_number == replica);
                if held && Instant::now() >= until {
                    return Err(self.fail(format!(
                        "{} was down for twice the replica expiry ({:?}) and more, yet the writer still holds its feedback",
                        replica_name(i),
                        self.replica_expiry
                    )));
                }
            }
            self.start_replica(i).await?;
        }
        Ok(())
    }

    /// A world with three safekeepers, the writer and every replica running.
    pub(super) async fn start(
        seed: u64,
        rng: &mut SmallRng,
        verbose: bool,
    ) -> Result<Sim, Failure> {
        let mut world = World::new(
            seed,
            rng,
            NetOptions::default(),
            CoordFaults::default(),
            ObjectFaults::default(),
            verbose,
        )
        .await?;
        let safekeepers = Safekeepers::new(&mut world, SAFEKEEPERS);
        let mut config = WriterConfig::new(
            (0..SAFEKEEPERS).map(sk_name).collect(),
            ProposerConfig::new(
                ClusterId::new("replica-sim").expect("id"),
                SAFEKEEPERS,
                1,
                SEGMENT_BYTES,
                1,
            ),
        );
        config.reconnect_delay = Duration::from_millis(50);
        config.peer_timeout = Duration::from_secs(1);
        config.reelect_when_superseded = true;
        let mut config_rng = SmallRng::seed_from_u64(seed ^ 0x5EC0_0B0C_CA11_0000);
        // Back-pressure in half of the runs: inserts wait while the slowest
        // replica has durably applied less than the end of WAL minus this.
        let flush_lag = if config_rng.random_bool(0.5) {
            config_rng.random_range(64u64 << 10..=512 << 10)
        } else {
            0
        };
        config.back_pressure.max_flush_lag = flush_lag;
        // A short replica expiry in a third of the runs (a generator of its
        // own, so the other draws stay as they were): a replica down or cut
        // off that long is forgotten by the writer and the safekeepers, WAL
        // is removed past it, and it reads that WAL back from the backup.
        let mut expiry_rng = SmallRng::seed_from_u64(seed ^ 0xE4B1_12E5_0000_0001);
        let replica_expiry = if expiry_rng.random_bool(1.0 / 3.0) {
            Duration::from_millis(expiry_rng.random_range(1000..=4000))
        } else {
            ferry_wal::liveness::DEFAULT_REPLICA_EXPIRY
        };
        config.replica_expiry = replica_expiry;
        let writer = Arc::new(Writer::start(world.net.node("writer"), config));
        let mut sim = Sim {
            world,
            safekeepers,
            writer: Some(writer),
            config_rng,
            flush_lag,
            replica_expiry,
            expiry_rng,
            // Which replica crashes lose their data dir (a generator of its
            // own: the schedule's draws stay as they were).
            rebuild_rng: SmallRng::seed_from_u64(seed ^ 0xB007_5724_0000_0002),
            rebuilds: 0,
            back_pressure_seen: None,
            replicas: (0..replicas()).map(|_| None).collect(),
            down_until: vec![None; replicas()],
            reported: Arc::new(Mutex::new(vec![Lsn(0); replicas()])),
            violations: Arc::new(Mutex::new(Vec::new())),
            acked: BTreeMap::new(),
            unknown: Vec::new(),
            results: mpsc::unbounded_channel(),
            in_flight: 0,
            next_request: 0,
            next_id: 0,
            replica_crashes: 0,
        };
        for i in 0..SAFEKEEPERS {
            sim.start_safekeeper(i, true).await?;
        }
        for i in 0..replicas() {
            sim.start_replica(i).await?;
        }
        Ok(sim)
    }
}

/// Watches replica `i`'s reported position: each one it reports is kept in
/// `reported[i]` (durable, so it must never go back, not across a crash
/// either); one below it is pushed to `violations` (the step checks fail on
/// it).
pub(crate) fn watch_position(
    name: String,
    i: usize,
    mut status: tokio::sync::watch::Receiver<ferry_replica::ReplicaStatus>,
    reported: Arc<Mutex<Vec<Lsn>>>,
    violations: Arc<Mutex<Vec<String>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let lsn = status.borrow_and_update().disk_consistent_lsn;
            if let (Ok(mut r), Ok(mut v)) = (reported.lock(), violations.lock()) {
                if lsn < r[i] {
                    v.push(format!(
                        "{name}: disk_consistent_lsn went back from {} to {lsn}",
                        r[i]
                    ));
                }
                r[i] = r[i].max(lsn);
            }
            if status.changed().await.is_err() {
                return;
            }
        }
    })
}

/// What [`copy_lost_replica`] did.
pub(crate) struct LostReplicaCopy {
    /// The copy's result (`None`: a power cut came after the copy wrote its
    /// state file, so the replica is built as the cut left it).
    pub(crate) built: Option<Result<Bootstrapped, BootstrapError>>,
    /// Copies that failed on their donor and were tried again.
    pub(crate) failed_attempts: u32,
    /// The copy was cut and not resumed (`resume_after_cut` false): `built`
    /// is `None` and the data dir holds what the cut left.
    pub(crate) left_after_cut: bool,
}

/// Copies lost replica `name` (its data dir `replica` gone) of `shard`,
/// replica `number`, from `source`, as `ferry replica --bootstrap-from`
/// does: with `cut`, the first copy is cut by a power cut after that long,
/// and the copy goes on over what the cut left in a new process (the old
/// one's disk handle is fenced); a copy that fails on its donor is tried
/// again a second later, up to `source_retries` times. Without
/// `resume_after_cut` a cut copy is left as the cut left it. The workloads
/// that rebuild replicas share it.
#[allow(clippy::too_many_arguments)] // one call per workload, each names all
pub(crate) async fn copy_lost_replica(
    world: &mut World,
    name: &str,
    shard: u32,
    number: u32,
    source: &ferry_node::bootstrap::HttpDonor,
    cut: Option<Duration>,
    source_retries: u32,
    resume_after_cut: bool,
) -> Result<LostReplicaCopy, String> {
    let failed_attempts = std::cell::Cell::new(0u32);
    let copy = |disk: Arc<dyn Disk>| {
        let failed_attempts = &failed_attempts;
        async move {
            loop {
                match copy_from_peer(
                    &disk,
                    "replica",
                    shard,
                    number,
                    Cpu::Inline,
                    CopyCheck::Rows,
                    source,
                )
                .await
                {
                    Err(BootstrapError::Source { .. })
                        if failed_attempts.get() < source_retries =>
                    {
                        failed_attempts.set(failed_attempts.get() + 1);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    done => return done,
                }
            }
        }
    };
    let mut disk: Arc<dyn Disk> = Arc::new(world.disk(name).for_process());
    let mut built = None;
    if let Some(cut) = cut {
        match tokio::time::timeout(cut, copy(Arc::clone(&disk))).await {
            Ok(done) => built = Some(done),
            Err(_) => {
                world.crash_disk(name);
                disk = Arc::new(world.disk(name).for_process());
                world.log(format!("{name}: copy cut after {cut:?}"));
            }
        }
    }
    let needs = needs_copy(disk.as_ref(), "replica")
        .await
        .map_err(|e| format!("{name}: {e}"))?;
    // A cut that came after the state file leaves a built replica, which
    // starts as it is, resumed or not.
    if built.is_none() && needs && !resume_after_cut {
        return Ok(LostReplicaCopy {
            built: None,
            failed_attempts: failed_attempts.get(),
            left_after_cut: true,
        });
    }
    let built = match built {
        Some(done) => Some(done),
        None if needs => Some(copy(Arc::clone(&disk)).await),
        None => None,
    };
    Ok(LostReplicaCopy {
        built,
        failed_attempts: failed_attempts.get(),
        left_after_cut: false,
    })
}
