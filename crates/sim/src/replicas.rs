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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::array::{AsArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::Int64Type;
use bytes::Bytes;
use ferry_env::{Cpu, Disk};
use ferry_replica::{SharedReplica, StreamConfig};
use ferry_safekeeper::acceptor::AcceptorConfig;
use ferry_safekeeper::backup::BackupConfig;
use ferry_safekeeper::server::{SafekeeperServer, ServerConfig};
use ferry_table::Table;
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn};
use ferry_writer::driver::{Insert, Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::coord::CoordFaults;
use crate::disk::SimDisk;
use crate::net::NetOptions;
use crate::objstore::ObjectFaults;
use crate::world::{Failure, World};

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

fn sk_name(i: usize) -> String {
    format!("sk{i}")
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

#[derive(Debug, Clone)]
enum Event {
    /// A new insert of this many rows.
    Insert(usize),
    /// An acknowledged insert sent again with its key (a client retry).
    Retry,
    CrashReplica(usize),
    CrashSafekeeper(usize),
    PartitionReplica(usize, usize),
    /// The writer cut off from a safekeeper, which falls behind while its
    /// walsenders still talk.
    PartitionWriter(usize),
    Repair,
}

/// One insert as a client sends it: its key and its records.
#[derive(Debug, Clone)]
struct Request {
    key: String,
    ids: Vec<i64>,
    inserts: Vec<Insert>,
}

fn request(n: u64, first_id: i64, rows: usize) -> Request {
    let def = table().def;
    let ids: Vec<i64> = (first_id..first_id + rows as i64).collect();
    let batch = RecordBatch::try_new(
        def.arrow_schema(),
        vec![
            Arc::new(Int64Array::from(ids.clone())),
            Arc::new(StringArray::from_iter_values(
                ids.iter()
                    .map(|i| PARTITIONS[(*i as usize / 3) % PARTITIONS.len()]),
            )),
            // Bulk, so that the WAL spans many segments: backed up, removed
            // and read back from the backup by replicas that were down.
            Arc::new(StringArray::from_iter_values(
                ids.iter().map(|i| format!("{i:0>300}")),
            )),
        ],
    )
    .expect("batch");
    let rows_in = ferry_table::Rows {
        rows: batch.num_rows(),
        batches: vec![batch],
    };
    let key = format!("req-{n}");
    let inserts = ferry_table::rows::split_by_shard(&def, &rows_in)
        .expect("split")
        .into_iter()
        .map(|(shard, b)| Insert {
            table_id: TABLE_ID,
            shard,
            idempotency_key: Bytes::from(key.clone().into_bytes()),
            arrow_ipc: ferry_table::rows::to_ipc(&b).expect("ipc"),
        })
        .collect();
    Request { key, ids, inserts }
}

/// What one seed did.
#[derive(Debug)]
pub struct Outcome {
    pub seed: u64,
    pub events: usize,
    pub simulated: Duration,
    pub acknowledged: usize,
    pub rows: usize,
    pub replica_crashes: usize,
    pub merges: u64,
    pub log_hash: u32,
    pub log: Vec<String>,
}

/// An insert's request and whether it was acknowledged.
type ResultTx = mpsc::UnboundedSender<(Request, bool)>;
type ResultRx = mpsc::UnboundedReceiver<(Request, bool)>;

/// A running replica: the node as the product assembles it, and the
/// simulation's monitor of its reported position.
struct ReplicaNode {
    node: ferry_node::ReplicaNode,
    monitor: tokio::task::JoinHandle<()>,
}

impl ReplicaNode {
    fn shared(&self) -> &SharedReplica {
        &self.node.replica
    }

    /// A crash: every task ends at once.
    async fn stop(self) {
        self.node.stop().await;
        self.monitor.abort();
        let _ = self.monitor.await;
    }
}

struct Sim {
    world: World,
    sk_disks: Vec<SimDisk>,
    servers: Vec<Option<Arc<SafekeeperServer>>>,
    /// Taken by the clean shutdown at the end.
    writer: Option<Arc<Writer>>,
    /// Draws each safekeeper start's backup and removal settings.
    config_rng: SmallRng,
    /// The writer's max_replication_flush_lag (0: no back-pressure).
    flush_lag: u64,
    /// Writer's and safekeepers' replica expiry in this run.
    replica_expiry: Duration,
    expiry_rng: SmallRng,
    /// The writer's term, its end of WAL and the slowest replica position
    /// it knew at the last step (see `check_steps`).
    back_pressure_seen: Option<(ferry_wal::Term, Lsn, Lsn)>,
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

    fn acceptor_config(i: usize) -> AcceptorConfig {
        AcceptorConfig {
            cluster_id: ClusterId::new("replica-sim").expect("id"),
            node_id: i as u64,
            timeline_id: 1,
            segment_size: SegmentSize::new(SEGMENT_BYTES).expect("segment size"),
            preallocation: Default::default(),
        }
    }

    async fn start_safekeeper(&mut self, i: usize, create: bool) -> Result<(), Failure> {
        // WAL backup to the lake and removal behind every replica, drawn at
        // every start from a generator of their own (the schedule's draws
        // stay as they were): a replica that was down long reads removed
        // WAL back from the backup.
        let config = ServerConfig {
            backup: Some(BackupConfig {
                location: self.world.lake.clone(),
                parallel_jobs: self.config_rng.random_range(1..=4),
            }),
            walsenders_keep_horizon: self.config_rng.random_bool(0.5),
            removal_interval: Duration::from_millis(self.config_rng.random_range(100..=2000)),
            replica_expiry: self.replica_expiry,
            ..ServerConfig::default()
        };
        let described = format!(
            "backup jobs {}, keep-horizon {}, removal every {:?}, replica expiry {:?}",
            config.backup.as_ref().map_or(0, |b| b.parallel_jobs),
            config.walsenders_keep_horizon,
            config.removal_interval,
            config.replica_expiry
        );
        let listener = self
            .world
            .net
            .node(&sk_name(i))
            .bind(&sk_name(i))
            .await
            .map_err(|e| self.fail(format!("sk{i} cannot listen: {e}")))?;
        let disk: Arc<dyn Disk> = Arc::new(self.sk_disks[i].clone());
        let open = if create {
            ferry_node::SafekeeperOpen::Create
        } else {
            ferry_node::SafekeeperOpen::Open
        };
        let server = ferry_node::start_safekeeper(
            disk,
            &sk_name(i),
            open,
            Self::acceptor_config(i),
            listener,
            config,
        )
        .await
        .map_err(|e| match e {
            ferry_node::SafekeeperNodeError::State(e) => {
                self.fail(format!("sk{i} cannot open: {e}"))
            }
            ferry_node::SafekeeperNodeError::Serve(e) => {
                self.fail(format!("sk{i} cannot listen: {e}"))
            }
        })?;
        self.servers[i] = Some(Arc::new(server));
        self.log(format!("sk{i} started ({described})"));
        Ok(())
    }

    async fn crash_safekeeper(&mut self, i: usize) {
        if let Some(server) = self.servers[i].take() {
            server.kill().await;
            self.world.crash_disk(&sk_name(i));
            self.log(format!("sk{i} crashed"));
        }
    }

    /// Opens replica `i` from its disk, checking it kept what it reported.
    async fn start_replica(&mut self, i: usize) -> Result<(), Failure> {
        let name = replica_name(i);
        let disk: Arc<dyn Disk> = Arc::new(self.world.disk(&name));
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
        let mut status = node.status.clone();
        // The step check: the position never goes back.
        let monitor = tokio::spawn({
            let reported = Arc::clone(&self.reported);
            let violations = Arc::clone(&self.violations);
            async move {
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
            }
        });
        self.replicas[i] = Some(ReplicaNode { node, monitor });
        self.log(format!("{} started at {opened}", replica_name(i)));
        Ok(())
    }

    async fn crash_replica(&mut self, i: usize) -> Result<(), Failure> {
        let name = replica_name(i);
        if let Some(node) = self.replicas[i].take() {
            // Most crashes wait for a write, so they land before its fsync.
            let disk = self.world.disk(&name);
            if self.world.rng.random_bool(0.7)
                && disk.wait_for_unsynced_write(Duration::from_secs(1)).await
            {
                self.log(format!("{name} crashes right after a write"));
            }
            node.stop().await;
            self.world.crash_disk(&name);
            self.replica_crashes += 1;
            self.log(format!("{name} crashed"));
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
    async fn restart_kept_down(&mut self, all: bool) -> Result<(), Failure> {
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

    fn send(&mut self, req: Request) {
        let Some(writer) = self.writer.clone() else {
            return;
        };
        let tx = self.results.0.clone();
        self.in_flight += 1;
        tokio::spawn(async move {
            let ok = writer.insert(req.inserts.clone()).await.is_ok();
            let _ = tx.send((req, ok));
        });
    }

    fn collect_results(&mut self) {
        while let Ok((req, ok)) = self.results.1.try_recv() {
            self.in_flight -= 1;
            if ok {
                self.acked.insert(req.key.clone(), req);
            } else {
                // Outcome unknown: the client will retry with the same key.
                self.unknown.push(req);
            }
        }
    }

    async fn apply(&mut self, event: &Event) -> Result<(), Failure> {
        match event {
            Event::Insert(rows) => {
                let req = request(self.next_request, self.next_id, *rows);
                self.next_request += 1;
                self.next_id += *rows as i64;
                self.send(req);
            }
            Event::Retry => {
                let n = self.acked.len();
                if n > 0 {
                    let pick = self.world.rng.random_range(0..n);
                    if let Some(req) = self.acked.values().nth(pick).cloned() {
                        self.log(format!("retry of {}", req.key));
                        self.send(req);
                    }
                }
            }
            Event::CrashReplica(i) => self.crash_replica(*i).await?,
            Event::CrashSafekeeper(i) => {
                // At most one safekeeper down at a time: a quorum stays.
                let down = self.servers.iter().filter(|s| s.is_none()).count();
                if down == 0 {
                    self.crash_safekeeper(*i).await;
                } else if self.servers[*i].is_none() {
                    self.start_safekeeper(*i, false).await?;
                }
            }
            Event::PartitionReplica(r, s) => {
                let (a, b) = (replica_name(*r), sk_name(*s));
                self.world.partition(&a, &b);
            }
            Event::PartitionWriter(s) => self.world.partition("writer", &sk_name(*s)),
            Event::Repair => self.world.repair_all(),
        }
        self.collect_results();
        self.check_steps()
    }

    fn check_steps(&mut self) -> Result<(), Failure> {
        // Back-pressure: the writer releases no append while the end of WAL
        // is past the limit (plus the one insert released last) ahead of the
        // slowest replica it heard of. The slowest position it knows can drop
        // (a replica first heard late, through a safekeeper cut off from the
        // writer until then): the end may be past the limit then, through no
        // fault of the writer, but must not move until the lag is back in it.
        if let (Some(writer), true) = (&self.writer, self.flush_lag > 0) {
            let s = writer.status();
            let end: Lsn = s.end_lsn.parse().unwrap_or(Lsn(0));
            let now = s
                .overall_minimum
                .map(|min| (s.term, end, min.disk_consistent_lsn));
            let previous = std::mem::replace(&mut self.back_pressure_seen, now);
            if let (Some((term, end, min)), Some((prev_term, prev_end, prev_min))) = (now, previous)
            {
                let lag = end.distance_from(min);
                // The same writer, knowing no slower replica than before,
                // moved the end past the limit.
                if term == prev_term
                    && min >= prev_min
                    && end > prev_end
                    && lag > self.flush_lag + MAX_INSERT_WAL
                {
                    return Err(self.fail(format!(
                        "the end of WAL {end} ran {lag} bytes ahead of the slowest replica's {min} (limit {} and one insert)",
                        self.flush_lag
                    )));
                }
            }
        }
        let v = self
            .violations
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default();
        match v.first() {
            Some(first) => Err(self.fail(first.clone())),
            None => Ok(()),
        }
    }

    /// Retries inserts of unknown outcome until every insert sent is
    /// acknowledged (by `deadline`, or the run fails saying `when`); returns
    /// the writer's commit_lsn then.
    async fn complete_inserts(&mut self, deadline: Instant, when: &str) -> Result<Lsn, Failure> {
        loop {
            self.collect_results();
            for req in std::mem::take(&mut self.unknown) {
                self.send(req);
            }
            if self.in_flight == 0 && self.unknown.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                return Err(self.fail(format!("inserts did not complete {when}")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let Some(writer) = &self.writer else {
            return Err(self.fail("the writer was shut down"));
        };
        writer
            .status()
            .commit_lsn
            .parse()
            .map_err(|e| self.fail(format!("writer commit_lsn: {e}")))
    }

    /// Faults stop: every safekeeper up, partitions repaired, unknown outcomes
    /// retried until acknowledged, every replica caught up and merges settled.
    async fn settle(&mut self) -> Result<Lsn, Failure> {
        self.world.repair_all();
        if let Some(latest) = self.down_until.iter().flatten().max().copied() {
            tokio::time::sleep_until(latest).await;
        }
        self.restart_kept_down(true).await?;
        for i in 0..SAFEKEEPERS {
            if self.servers[i].is_none() {
                self.start_safekeeper(i, false).await?;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        self.complete_inserts(deadline, "after faults stopped")
            .await?;
        // Neon's stop_and_wait: the writer commits its shutdown checkpoint
        // and waits until every running replica applied it durably, as it
        // learns from their feedback relayed by the safekeepers.
        let Some(mut writer) = self.writer.take() else {
            return Err(self.fail("the writer was shut down already"));
        };
        let writer = loop {
            match Arc::try_unwrap(writer) {
                Ok(w) => break w,
                Err(shared) if Instant::now() < deadline => {
                    // An insert task still drops its handle.
                    writer = shared;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(_) => return Err(self.fail("the writer is still shared after the inserts")),
            }
        };
        let running: Vec<(u32, u32)> = (0..replicas())
            .filter(|&i| self.replicas[i].is_some())
            .map(|i| (i as u32 / REPLICAS_PER_SHARD, i as u32 % REPLICAS_PER_SHARD))
            .collect();
        let heard = writer.subscribe();
        let end = writer
            .shutdown_and_wait_for_replicas(
                &running,
                deadline.saturating_duration_since(Instant::now()),
            )
            .await;
        let end = match end {
            Ok(end) => end,
            Err(e) => {
                // Where each replica really is, next to what the writer heard.
                let mut at = Vec::new();
                for i in 0..replicas() {
                    if let Some(node) = &self.replicas[i] {
                        let s = node.shared().lock().await.subscribe().borrow().clone();
                        at.push(format!(
                            "{} applied {} received {}",
                            replica_name(i),
                            s.disk_consistent_lsn,
                            s.last_received_lsn
                        ));
                    }
                }
                let heard: Vec<String> = heard
                    .borrow()
                    .replicas
                    .iter()
                    .map(|f| {
                        format!(
                            "r{}{} applied {} at {}",
                            f.shard_number,
                            f.replica_number,
                            f.disk_consistent_lsn,
                            f.reply_time_micros
                        )
                    })
                    .collect();
                return Err(self.fail(format!(
                    "clean shutdown with every replica applied: {e} (replicas: {}; the writer heard: {})",
                    at.join(", "),
                    heard.join(", ")
                )));
            }
        };
        self.log(format!(
            "writer stopped; every replica applied its checkpoint at {end}"
        ));
        for i in 0..replicas() {
            let Some(node) = &self.replicas[i] else {
                continue;
            };
            let mut status = node.shared().lock().await.subscribe();
            let reached = tokio::time::timeout_at(
                deadline,
                status.wait_for(|s| {
                    (s.disk_consistent_lsn >= end && s.pending_merges == 0) || s.error.is_some()
                }),
            )
            .await
            .is_ok();
            let s = status.borrow().clone();
            if let Some(e) = s.error {
                return Err(self.fail(format!("{} stopped: {e}", replica_name(i))));
            }
            if !reached {
                return Err(self.fail(format!(
                    "{} reached {} of {end} ({} merges pending) after faults stopped",
                    replica_name(i),
                    s.disk_consistent_lsn,
                    s.pending_merges
                )));
            }
        }
        self.check_steps()?;
        Ok(end)
    }

    /// The rows of every replica against the acknowledged inserts.
    async fn check_replicas(&mut self) -> Result<(usize, u64), Failure> {
        let mut expected: BTreeMap<u32, Vec<i64>> = BTreeMap::new();
        let def = table().def;
        for req in self.acked.values() {
            let ids = Int64Array::from(req.ids.clone());
            let shards = ferry_table::keys::shard_numbers(
                SHARDS,
                &(Arc::new(ids) as arrow::array::ArrayRef),
            );
            for (id, shard) in req.ids.iter().zip(shards) {
                expected.entry(shard).or_default().push(*id);
            }
        }
        let _ = def;
        let mut per_shard_parts: BTreeMap<u32, Vec<(String, u64, u32)>> = BTreeMap::new();
        let mut rows_total = 0;
        let mut merges = 0;
        for i in 0..replicas() {
            let name = replica_name(i);
            let shard = i as u32 / REPLICAS_PER_SHARD;
            let Some(node) = &self.replicas[i] else {
                continue;
            };
            let r = node.shared().lock().await;
            merges += r.subscribe().borrow().merges_done;
            let mut ids = Vec::new();
            let mut parts = Vec::new();
            for p in r.parts(TABLE_ID) {
                let bytes = r
                    .disk()
                    .read(&r.part_path(TABLE_ID, &p.name))
                    .await
                    .map_err(|e| self.fail(format!("{name}: reading part {}: {e}", p.name)))?;
                let batches = ferry_replica::part::read_rows(&p.name, Bytes::from(bytes))
                    .map_err(|e| self.fail(format!("{name}: {e}")))?;
                for b in &batches {
                    let col = b.column(0).as_primitive::<Int64Type>();
                    ids.extend((0..col.len()).map(|j| col.value(j)));
                }
                parts.push((p.name.to_string(), p.rows, p.checksum));
            }
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            let unique: BTreeSet<i64> = sorted.iter().copied().collect();
            if unique.len() != sorted.len() {
                return Err(self.fail(format!(
                    "{name} holds {} rows more than once",
                    sorted.len() - unique.len()
                )));
            }
            let mut want = expected.get(&shard).cloned().unwrap_or_default();
            want.sort_unstable();
            if sorted != want {
                let missing: Vec<i64> = want
                    .iter()
                    .filter(|x| !unique.contains(x))
                    .copied()
                    .take(5)
                    .collect();
                return Err(self.fail(format!(
                    "{name} holds {} rows of shard {shard}, the acknowledged inserts {} (missing e.g. {missing:?})",
                    sorted.len(),
                    want.len()
                )));
            }
            rows_total += sorted.len();
            match per_shard_parts.get(&shard) {
                Some(other) if *other != parts => {
                    return Err(self.fail(format!(
                        "{name}'s parts differ from its shard's other replica: {} against {} parts",
                        parts.len(),
                        other.len()
                    )))
                }
                Some(_) => {}
                None => {
                    per_shard_parts.insert(shard, parts);
                }
            }
        }
        Ok((rows_total, merges))
    }
}

fn generate(rng: &mut SmallRng) -> Vec<(Duration, Event)> {
    let n = rng.random_range(30..80);
    let mut at = Duration::ZERO;
    let mut events = Vec::with_capacity(n);
    for _ in 0..n {
        at += Duration::from_millis(rng.random_range(5..300));
        let event = match rng.random_range(0..100) {
            0..=59 => Event::Insert(rng.random_range(1..40)),
            60..=69 => Event::Retry,
            70..=81 => Event::CrashReplica(rng.random_range(0..replicas())),
            82..=89 => Event::CrashSafekeeper(rng.random_range(0..SAFEKEEPERS)),
            90..=93 => Event::PartitionReplica(
                rng.random_range(0..replicas()),
                rng.random_range(0..SAFEKEEPERS),
            ),
            94..=96 => Event::PartitionWriter(rng.random_range(0..SAFEKEEPERS)),
            _ => Event::Repair,
        };
        events.push((at, event));
    }
    events
}

impl Sim {
    /// A world with three safekeepers, the writer and every replica running.
    async fn start(seed: u64, rng: &mut SmallRng, verbose: bool) -> Result<Sim, Failure> {
        let mut world = World::new(
            seed,
            rng,
            NetOptions::default(),
            CoordFaults::default(),
            ObjectFaults::default(),
            verbose,
        )
        .await?;
        let sk_disks = (0..SAFEKEEPERS).map(|i| world.disk(&sk_name(i))).collect();
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
            sk_disks,
            servers: vec![None, None, None],
            writer: Some(writer),
            config_rng,
            flush_lag,
            replica_expiry,
            expiry_rng,
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

/// A safekeeper cut off from the writer falls behind while its walsenders
/// still send keepalives: the replicas streaming from it must move to a
/// safekeeper that is ahead and apply every acknowledged insert while the
/// partition lasts. Returns how long (simulated) the last replica took to
/// apply them once they were acknowledged.
pub fn run_lagging_safekeeper(seed: u64) -> Result<Duration, Failure> {
    crate::run_seeded(seed, async move {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x6c61_6767_696e_6721);
        let mut sim = Sim::start(seed, &mut rng, false).await?;
        // Replicas start on safekeeper i % 3: r00 and r11 stream from sk0.
        sim.world.partition("writer", &sk_name(0));
        for _ in 0..40 {
            sim.apply(&Event::Insert(30)).await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let end = sim
            .complete_inserts(Instant::now() + Duration::from_secs(60), "with sk0 cut off")
            .await?;
        let acknowledged = Instant::now();
        // The partition still holds: sk0 stays behind.
        for i in 0..replicas() {
            let Some(node) = &sim.replicas[i] else {
                continue;
            };
            let mut status = node.shared().lock().await.subscribe();
            let reached = tokio::time::timeout(
                Duration::from_secs(30),
                status.wait_for(|s| s.disk_consistent_lsn >= end || s.error.is_some()),
            )
            .await
            .is_ok();
            let s = status.borrow().clone();
            if !reached || s.error.is_some() {
                return Err(sim.fail(format!(
                    "{} applied up to {} of {end} within 30 s while sk0 lagged ({:?})",
                    replica_name(i),
                    s.disk_consistent_lsn,
                    s.error
                )));
            }
        }
        let took = acknowledged.elapsed();
        sim.settle().await?;
        sim.check_replicas().await?;
        for node in sim.replicas.iter_mut().filter_map(Option::take) {
            node.stop().await;
        }
        Ok(took)
    })
}

pub fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    crate::run_seeded(seed, run_seed_async(seed, verbose))
}

async fn run_seed_async(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x7265_706c_6963_6173);
    let events = generate(&mut rng);
    let mut sim = Sim::start(seed, &mut rng, verbose).await?;
    sim.log(format!("seed {seed}: {} events", events.len()));
    for (at, event) in &events {
        tokio::time::sleep_until(sim.world.start + *at).await;
        sim.restart_kept_down(false).await?;
        sim.log(format!("{event:?}"));
        sim.apply(event).await?;
    }
    let end = sim.settle().await?;
    let (rows, merges) = sim.check_replicas().await?;
    let (mut removed, mut uploads, mut forgotten) = (0, 0, 0);
    for server in sim.servers.iter().flatten() {
        let status = server.status().await;
        removed += status.segments_removed;
        uploads += status.backup_uploads;
        forgotten += status.replicas_forgotten;
    }
    let writer_forgot = sim
        .writer
        .as_ref()
        .map_or(0, |w| w.status().replicas_forgotten);
    sim.log(format!(
        "settled at {end}: {rows} rows on all replicas, {merges} merges; since their last start the safekeepers uploaded {uploads} segments, removed {removed} and forgot {forgotten} replicas (the writer {writer_forgot})"
    ));
    for i in 0..replicas() {
        if let Some(node) = sim.replicas[i].take() {
            node.stop().await;
        }
    }
    let log_hash = sim
        .world
        .log_lines()
        .iter()
        .fold(0u32, |h, line| crc32c::crc32c_append(h, line.as_bytes()));
    Ok(Outcome {
        seed,
        events: events.len(),
        simulated: sim.world.start.elapsed(),
        acknowledged: sim.acked.len(),
        rows,
        replica_crashes: sim.replica_crashes,
        merges,
        log_hash,
        log: sim.world.into_log(),
    })
}
