//! The end-to-end workload's nodes, each assembled as the product's roles
//! assemble it: safekeepers (the shared harness, backup to the lake);
//! writer incarnations (writer, `WriterNode` with catalog, insert API and
//! commit record, its HTTP endpoint, its registration for peers); replicas
//! (`ReplicaNode` streaming from the safekeepers with merges and exporter,
//! the export API and policies of `ferry_node::exports` over the peers
//! found in coordination, the copy endpoint, the registration), each
//! watched so that its reported position never goes back.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_coord::{RenewingSession, SessionFactory};
use ferry_env::{Clock, Cpu, Disk};
use ferry_export::peers::{self, Peers, Registration};
use ferry_export::{ExporterConfig, ReplicaSet};
use ferry_ingest::{ApiLimits, Catalog, IngestMetrics};
use ferry_node::exports::{ExportApi, Policies, TransactionIds};
use ferry_node::http::{HttpPeers, HttpServer};
use ferry_node::{SafekeeperOpen, WriterNode};
use ferry_replica::StreamConfig;
use ferry_safekeeper::acceptor::AcceptorConfig;
use ferry_safekeeper::partial::PartialBackupConfig;
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn};
use ferry_writer::driver::{Writer, WriterConfig, WriterStatus};
use ferry_writer::proposer::ProposerConfig;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{
    replica_name, replicas, Failure, Sim, REPLICAS_PER_SHARD, SAFEKEEPERS, SEGMENT_BYTES,
    SESSION_TIMEOUT,
};
use crate::safekeepers::{draw_backup_settings, name as sk_name, Safekeepers};
use crate::world::coord::CoordFaults;
use crate::world::net::NetOptions;
use crate::world::objstore::ObjectFaults;
use crate::world::{AfterAWrite, Lake, Stop, World};

/// Most replica crashes wait for a write, so they land before its fsync.
const CRASH: AfterAWrite = AfterAWrite {
    prob: 0.6,
    within: Duration::from_secs(1),
};
/// How long a supervisor waits before starting a writer again.
const SUPERVISOR_RESTART: Duration = Duration::from_secs(1);
/// What compaction aims lake files at: small, so that merges and
/// compactions happen within a run.
const TARGET_FILE_BYTES: u64 = 16 << 10;

fn cluster_id() -> ClusterId {
    ClusterId::new("e2e-sim").unwrap_or_else(|_| unreachable!("a valid cluster id"))
}

/// Where replica `i` serves its export API and its copies.
pub(super) fn replica_http(i: usize) -> String {
    format!("{}-http", replica_name(i))
}

pub(super) fn writer_name(n: u64) -> String {
    format!("writer{n}")
}

pub(super) fn writer_http(n: u64) -> String {
    format!("writer{n}-http")
}

/// A running writer process: the writer, its node and its endpoint.
pub(super) struct WriterIncarnation {
    pub(super) number: u64,
    pub(super) writer: Arc<Writer>,
    pub(super) status: watch::Receiver<WriterStatus>,
    node: WriterNode,
    http: HttpServer,
}

impl Stop for WriterIncarnation {
    /// The process ends at once.
    async fn stop(self) {
        self.http.abort().await;
        let _ = self.node.stop().await;
        self.writer.abort();
    }
}

/// A running replica node and what the simulation watches of it.
pub(super) struct ReplicaNode {
    pub(super) node: ferry_node::ReplicaNode,
    policies: Policies,
    http: HttpServer,
    registration: JoinHandle<()>,
    monitor: JoinHandle<()>,
}

impl Stop for ReplicaNode {
    /// A crash: every task ends at once.
    async fn stop(self) {
        self.http.abort().await;
        self.policies.abort().await;
        self.registration.abort();
        let _ = self.registration.await;
        self.node.stop().await;
        self.monitor.abort();
        let _ = self.monitor.await;
    }
}

/// Retries `what` (a coordination step a node takes when it starts) until
/// it succeeds, up to `attempts` times a second apart: a process that
/// cannot reach coordination exits and is started again.
async fn retried<T, E: std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    attempts: u32,
    mut what: impl FnMut() -> F,
) -> Result<T, String> {
    let mut last = String::new();
    for _ in 0..attempts {
        match what().await {
            Ok(t) => return Ok(t),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Err(last)
}

impl Sim {
    /// A world with three safekeepers, a writer, the table and every
    /// replica running.
    pub(super) async fn start(
        seed: u64,
        rng: &mut SmallRng,
        verbose: bool,
    ) -> Result<Sim, Failure> {
        let mut world = World::new(
            seed,
            rng,
            NetOptions::default(),
            CoordFaults {
                fail_before_prob: 0.01,
                fail_after_prob: 0.01,
                ..CoordFaults::default()
            },
            ObjectFaults {
                fail_prob: 0.03,
                fail_after_write_prob: 0.03,
                multipart: true,
                deletes: true,
                ..ObjectFaults::default()
            },
            verbose,
        )
        .await?;
        let safekeepers = Safekeepers::new(&mut world, SAFEKEEPERS);
        let mut draws = SmallRng::seed_from_u64(seed ^ 0xE2E0_F0E2_0000_0001);
        let format = if draws.random_bool(0.5) {
            ferry_export::model::LakeFormat::Iceberg
        } else {
            ferry_export::model::LakeFormat::Parquet
        };
        let retention = draws.random_bool(0.3).then(|| draws.random_range(1..5));
        let mut sim = Sim {
            world,
            safekeepers,
            config_rng: SmallRng::seed_from_u64(seed ^ 0x5EC0_0B0C_CA11_0001),
            writers: Vec::new(),
            writers_started: 0,
            restart_writer_at: None,
            replicas: (0..replicas()).map(|_| None).collect(),
            reported: Arc::new(Mutex::new(vec![Lsn(0); replicas()])),
            violations: Arc::new(Mutex::new(Vec::new())),
            replica_crashes: 0,
            table_id: 0,
            format,
            retention,
            sent: BTreeMap::new(),
            acked: BTreeMap::new(),
            given_up: Default::default(),
            refused: Default::default(),
            results: mpsc::unbounded_channel(),
            in_flight: 0,
            next_request: 0,
            next_id: 0,
            exports_asked: 0,
            client_rng: draws,
            loss_rng: SmallRng::seed_from_u64(seed ^ 0x4c05_7d15_c0de_0002),
            restoring: None,
            rebuilding: BTreeSet::new(),
            safekeepers_restored: 0,
            replicas_rebuilt: 0,
            copies_cut: 0,
            unfinished_copies_refused: 0,
        };
        sim.log(format!(
            "the table exports itself to {} as {} (freshness {} s, retention {:?} s)",
            super::DESTINATION,
            format,
            super::FRESHNESS_SECONDS,
            retention
        ));
        for i in 0..SAFEKEEPERS {
            sim.start_safekeeper(i, true).await?;
        }
        sim.start_writer().await?;
        sim.create_table().await?;
        for i in 0..replicas() {
            sim.start_replica(i).await?;
        }
        Ok(sim)
    }

    fn acceptor_config(i: usize) -> AcceptorConfig {
        AcceptorConfig {
            cluster_id: cluster_id(),
            node_id: i as u64,
            timeline_id: 1,
            segment_size: SegmentSize::new(SEGMENT_BYTES)
                .unwrap_or_else(|_| unreachable!("64 KiB is a valid segment size")),
            preallocation: Default::default(),
        }
    }

    /// Starts safekeeper `i` (a lost one is restored from the backup first,
    /// see [`Sim::try_restore`]).
    pub(super) async fn start_safekeeper(&mut self, i: usize, create: bool) -> Result<(), Failure> {
        if self.restoring == Some(i) {
            return self.try_restore().await;
        }
        self.run_safekeeper(i, create).await
    }

    /// Starts safekeeper `i`'s process on its disk.
    async fn run_safekeeper(&mut self, i: usize, create: bool) -> Result<(), Failure> {
        let mut config = draw_backup_settings(&mut self.config_rng, &self.world.lake);
        config.partial_backup = self.loss_rng.random_bool(0.7).then(|| PartialBackupConfig {
            timeout: Duration::from_millis(self.loss_rng.random_range(100..=3000)),
        });
        // Above the writers' election timeout, as the default is.
        config.restore_quarantine = Duration::from_secs(5);
        let described = format!(
            "backup jobs {}, keep-horizon {}, removal every {:?}, partial backup {:?}",
            config.backup.as_ref().map_or(0, |b| b.parallel_jobs),
            config.walsenders_keep_horizon,
            config.removal_interval,
            config.partial_backup.map(|p| p.timeout),
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

    /// Safekeepers not running (crashed, or lost and not restored yet).
    pub(super) fn safekeepers_down(&self) -> usize {
        self.safekeepers
            .servers
            .iter()
            .filter(|s| s.is_none())
            .count()
    }

    pub(super) async fn crash_safekeeper(&mut self, i: usize) {
        self.safekeepers
            .crash(
                &mut self.world,
                i,
                Some(AfterAWrite {
                    prob: 0.5,
                    within: Duration::from_millis(500),
                }),
            )
            .await;
    }

    /// Safekeeper `i` loses its data dir (while the others run: a quorum
    /// stays) and is restored from the backup, as `ferry safekeeper
    /// --restore-from-backup` does; it then waits out its quarantine until
    /// a writer brings it back. One loss per run.
    pub(super) async fn lose_safekeeper(&mut self, i: usize) -> Result<(), Failure> {
        if self.safekeepers_down() > 0 || self.safekeepers_restored > 0 {
            self.log(format!(
                "sk{i} keeps its data dir: another safekeeper is down"
            ));
            return Ok(());
        }
        self.crash_safekeeper(i).await;
        self.safekeepers.disks[i].lose(&sk_name(i));
        self.log(format!("sk{i} lost its data dir"));
        self.restoring = Some(i);
        self.try_restore().await
    }

    /// One attempt to restore the lost safekeeper from the backup; it
    /// starts once restored. A failed attempt (the object store failing)
    /// leaves it down until the next event.
    pub(super) async fn try_restore(&mut self) -> Result<(), Failure> {
        use ferry_safekeeper::restore::{restore_from_backup, RestoreError};
        let Some(i) = self.restoring else {
            return Ok(());
        };
        let disk: Arc<dyn Disk> = Arc::new(self.safekeepers.disks[i].for_process());
        let config = Self::acceptor_config(i);
        match restore_from_backup(disk, &sk_name(i), &config, &self.world.lake).await {
            Ok(report) => {
                self.log(format!(
                    "sk{i} restored {} whole segments and partial {:?}: WAL up to {}",
                    report.whole_segments, report.partial, report.restored_lsn
                ));
                self.restoring = None;
                self.safekeepers_restored += 1;
                self.run_safekeeper(i, false).await
            }
            Err(RestoreError::Exists(path)) => {
                Err(self.fail(format!("sk{i}: the restore found {path} on a lost disk")))
            }
            Err(e) => {
                self.log(format!("sk{i} restore failed: {e}"));
                Ok(())
            }
        }
    }

    /// Starts a new writer process, as its supervisor does: it reads the
    /// commit record, is elected, and serves the insert API. A process that
    /// cannot reach coordination exits: the supervisor tries again later.
    pub(super) async fn start_writer(&mut self) -> Result<(), Failure> {
        self.writers_started += 1;
        let n = self.writers_started;
        let name = writer_name(n);
        let sessions: Arc<dyn SessionFactory> =
            Arc::new(self.world.coord.factory(&name, SESSION_TIMEOUT));
        let opened = retried(3, || async {
            let session = sessions.open().await.map_err(|e| e.to_string())?;
            let known = ferry_node::commit_record::read_wal_state(&*session)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((session, known))
        })
        .await;
        let (session, known) = match opened {
            Ok(o) => o,
            Err(e) => {
                self.log(format!("{name} exits: coordination: {e}"));
                self.restart_writer_at = Some(Instant::now() + SUPERVISOR_RESTART);
                return Ok(());
            }
        };
        let mut proposer =
            ProposerConfig::new(cluster_id(), SAFEKEEPERS, 1, SEGMENT_BYTES, u128::from(n));
        proposer.min_term = known.term;
        proposer.known_commit_lsn = known.commit_lsn;
        let mut config = WriterConfig::new((0..SAFEKEEPERS).map(sk_name).collect(), proposer);
        config.reconnect_delay = Duration::from_millis(50);
        config.peer_timeout = Duration::from_secs(1);
        let writer = Arc::new(Writer::start(self.world.net.node(&name), config));
        let status = writer.subscribe();
        let session = RenewingSession::with(Arc::clone(&sessions), session);
        let mut registry = prometheus_client::registry::Registry::default();
        let limits = ApiLimits {
            commit_timeout: Duration::from_secs(5),
            ..ApiLimits::default()
        };
        let started = retried(3, || {
            WriterNode::start(
                Arc::clone(&writer),
                Arc::clone(&sessions),
                session.clone(),
                Cpu::Inline,
                limits.clone(),
                IngestMetrics::register(&mut registry),
            )
        })
        .await;
        let mut node = match started {
            Ok(node) => node,
            Err(e) => {
                writer.abort();
                self.world.coord.crash_node(&name);
                self.log(format!("{name} exits: catalog: {e}"));
                self.restart_writer_at = Some(Instant::now() + SUPERVISOR_RESTART);
                return Ok(());
            }
        };
        let status_route = {
            let status = writer.subscribe();
            move || {
                let s = serde_json::to_value(status.borrow().clone()).unwrap_or_default();
                async move { axum::Json(s) }
            }
        };
        let router = node
            .router()
            .route("/status", axum::routing::get(status_route));
        let listener = self
            .world
            .net
            .node(&name)
            .bind(&writer_http(n))
            .await
            .map_err(|e| self.fail(format!("{name}: binding its endpoint: {e}")))?;
        let http = ferry_node::http::serve(listener, router)
            .map_err(|e| self.fail(format!("{name}: serving its endpoint: {e}")))?;
        node.register_for_peers(&writer_http(n));
        self.writers.push(WriterIncarnation {
            number: n,
            writer,
            status,
            node,
            http,
        });
        self.restart_writer_at = None;
        self.log(format!(
            "{name} started (commit record: term {}, commit_lsn {})",
            known.term, known.commit_lsn
        ));
        Ok(())
    }

    /// Writer process `n` ends at once (killed, or exiting because it was
    /// superseded); its sessions are abandoned.
    pub(super) async fn stop_writer(&mut self, n: u64, why: &str) {
        let Some(at) = self.writers.iter().position(|w| w.number == n) else {
            return;
        };
        let w = self.writers.remove(at);
        w.stop().await;
        self.world.coord.crash_node(&writer_name(n));
        self.log(format!("{} {why}", writer_name(n)));
        if self.writers.is_empty() {
            self.restart_writer_at = Some(Instant::now() + SUPERVISOR_RESTART);
        }
    }

    /// What a supervisor does between events: a writer that stopped being
    /// the writer (superseded, refused) exits; one is started again when
    /// none runs.
    pub(super) async fn supervise_writers(&mut self) -> Result<(), Failure> {
        let ended: Vec<(u64, String)> = self
            .writers
            .iter()
            .filter_map(|w| {
                let s = w.status.borrow();
                if let Some(term) = s.superseded_by {
                    Some((w.number, format!("exits: superseded by term {term}")))
                } else {
                    s.refused
                        .as_ref()
                        .map(|why| (w.number, format!("exits: refused to be elected: {why}")))
                }
            })
            .collect();
        for (n, why) in ended {
            self.stop_writer(n, &why).await;
        }
        if self
            .restart_writer_at
            .is_some_and(|at| Instant::now() >= at && self.writers.is_empty())
        {
            self.start_writer().await?;
        }
        Ok(())
    }

    /// Creates the table with its export policy through the insert API (as
    /// `ferry table create` does), retrying what coordination faults fail.
    async fn create_table(&mut self) -> Result<(), Failure> {
        let mut def = ferry_testkit::table::id_p_toml(super::TABLE, super::SHARDS)
            .column("pad", "Utf8")
            .def();
        def.export = Some(ferry_table::def::ExportDefaults {
            format: self.format,
            policy: Some(ferry_table::def::ExportPolicy {
                to: super::DESTINATION.to_string(),
                freshness_seconds: super::FRESHNESS_SECONDS,
                retention_seconds: self.retention,
            }),
        });
        let body = serde_json::to_vec(&def).map_err(|e| self.fail(format!("{e}")))?;
        for _ in 0..20 {
            let answer = self
                .http_call(
                    ferry_node::http::Method::POST,
                    "/tables",
                    "application/json",
                    &[],
                    body.clone().into(),
                )
                .await;
            if let Ok((status, bytes)) = &answer {
                if status.is_success() {
                    let table: ferry_table::Table = serde_json::from_slice(bytes)
                        .map_err(|e| self.fail(format!("the created table: {e}")))?;
                    self.table_id = table.id;
                    self.log(format!(
                        "table {} created with id {}",
                        super::TABLE,
                        table.id
                    ));
                    return Ok(());
                }
            }
            self.log(format!("creating the table: {answer:?}"));
            tokio::time::sleep(Duration::from_millis(500)).await;
            self.supervise_writers().await?;
        }
        Err(self.fail("the table could not be created"))
    }

    /// Starts replica `i` from its disk, checking it kept what it reported.
    /// A replica that cannot reach coordination to open its catalog is
    /// started again at the next event.
    pub(super) async fn start_replica(&mut self, i: usize) -> Result<(), Failure> {
        if self.rebuilding.contains(&i) {
            return self.try_rebuild(i).await;
        }
        self.run_replica(i).await
    }

    /// Starts replica `i`'s process on its disk.
    async fn run_replica(&mut self, i: usize) -> Result<(), Failure> {
        let name = replica_name(i);
        let (shard, number) = (i as u32 / REPLICAS_PER_SHARD, i as u32 % REPLICAS_PER_SHARD);
        let sessions: Arc<dyn SessionFactory> =
            Arc::new(self.world.coord.factory(&name, SESSION_TIMEOUT));
        let catalog = match retried(3, || Catalog::open(Arc::clone(&sessions))).await {
            Ok(c) => c,
            Err(e) => {
                self.world.coord.crash_node(&name);
                self.log(format!("{name} exits: catalog: {e}"));
                return Ok(());
            }
        };
        let disk: Arc<dyn Disk> = Arc::new(self.world.disk(&name).for_process());
        let mut stream = StreamConfig::new((0..SAFEKEEPERS).map(sk_name).collect());
        stream.reconnect_delay = Duration::from_millis(100);
        stream.lag_probe_interval = Duration::from_secs(1);
        stream.safekeepers.rotate_left(i % SAFEKEEPERS);
        let mut exporter = ExporterConfig::new(name.clone());
        exporter.tick = Duration::from_millis(100);
        exporter.cleanup_interval = Duration::from_millis(500);
        exporter.safety_poll = Duration::from_secs(5);
        exporter.creating_grace = Duration::from_secs(30);
        exporter.upload_budget = ferry_storage::UploadBudget {
            part_bytes: 8 << 10,
            max_in_flight: 2,
        };
        let lake: Arc<dyn ferry_export::Destinations> =
            Arc::new(Lake(Arc::new(self.world.lake_store.clone())));
        let clock: Arc<dyn Clock> = Arc::new(self.world.clock.clone());
        let node = ferry_node::ReplicaNode::start(
            ferry_node::ReplicaNodeConfig {
                dir: "replica".into(),
                shard,
                replica: number,
                wal: ferry_node::WalSource::Safekeepers {
                    network: self.world.net.node(&name),
                    config: stream,
                },
                merges: Some(Duration::from_secs(2)),
                export: Some(ferry_node::ExportSeams {
                    config: exporter,
                    sessions: Arc::clone(&sessions),
                    destinations: Arc::clone(&lake),
                }),
            },
            ferry_node::ReplicaSeams {
                disk,
                clock: Arc::clone(&clock),
                cpu: Cpu::Inline,
                tables: Arc::new(ferry_node::CatalogTables(catalog.clone())),
            },
        )
        .await;
        let node = match node {
            Ok(node) => node,
            Err(e @ ferry_replica::ReplicaError::CopyUnfinished { .. })
                if self.rebuilding.contains(&i) =>
            {
                self.log(format!("{name} refused to start: {e}"));
                self.world.coord.crash_node(&name);
                self.unfinished_copies_refused += 1;
                return Ok(());
            }
            Err(e) => return Err(self.fail(format!("{name} cannot reopen: {e}"))),
        };
        let opened = node.replica.lock().await.disk_consistent_lsn();
        let reported = self.reported.lock().map(|r| r[i]).unwrap_or_default();
        if opened < reported {
            node.stop().await;
            return Err(self.fail(format!(
                "{name} reopened at {opened}, below the {reported} it reported as durable"
            )));
        }
        let registered_as = peers::replica_node(shard, number);
        let peers = Arc::new(Peers::new(
            catalog.renewing_session(),
            registered_as.clone(),
            Arc::new(HttpPeers::new(self.world.net.node(&name), None)),
        ));
        let view = node
            .exports
            .clone()
            .ok_or_else(|| self.fail(format!("{name} runs no exporter")))?;
        let commit_peers = Arc::clone(&peers);
        let maintain_peers = Arc::clone(&peers);
        let api = Arc::new(ExportApi {
            session: catalog.renewing_session(),
            sessions: Arc::clone(&sessions),
            parts: Arc::new(
                ReplicaSet::new(vec![Arc::clone(&node.replica)])
                    .with_remote(Arc::clone(&peers) as Arc<dyn ferry_export::RemoteShards>),
            ),
            local: Arc::clone(&node.parts),
            destinations: lake,
            replica_name: name.clone(),
            clock: Arc::clone(&clock),
            commit_lsn: Arc::new(move || {
                let peers = Arc::clone(&commit_peers);
                Box::pin(async move { peers.commit_lsn().await })
            }),
            maintain: Arc::new(move |table, record| {
                let peers = Arc::clone(&maintain_peers);
                Box::pin(async move { peers.maintain(&table, &record).await })
            }),
            target_file_bytes: TARGET_FILE_BYTES,
            view,
            ids: TransactionIds::new(self.world.rng.random()),
        });
        let policies = Policies::start(&api);
        let donor = Arc::new(ferry_replica::replica::bootstrap::LocalDonor {
            replica: Arc::clone(&node.replica),
            clock,
            name: registered_as.clone(),
        });
        let router = ferry_node::exports::router(api).merge(ferry_node::bootstrap::router(donor));
        let listener = self
            .world
            .net
            .node(&name)
            .bind(&replica_http(i))
            .await
            .map_err(|e| self.fail(format!("{name}: binding its endpoint: {e}")))?;
        let http = ferry_node::http::serve(listener, router)
            .map_err(|e| self.fail(format!("{name}: serving its endpoint: {e}")))?;
        let addr = replica_http(i);
        let registration = tokio::spawn(peers::register(
            catalog.renewing_session(),
            registered_as,
            node.reader.status.clone(),
            move |s: &ferry_replica::ReplicaStatus| Registration {
                http: addr.clone(),
                disk_consistent_lsn: Some(s.disk_consistent_lsn.to_string()),
            },
        ));
        let monitor = crate::replicas::watch_position(
            name.clone(),
            i,
            node.reader.status.clone(),
            Arc::clone(&self.reported),
            Arc::clone(&self.violations),
        );
        self.replicas[i] = Some(ReplicaNode {
            node,
            policies,
            http,
            registration,
            monitor,
        });
        self.log(format!("{name} started at {opened}"));
        Ok(())
    }

    pub(super) async fn crash_replica(&mut self, i: usize) -> Result<(), Failure> {
        let name = replica_name(i);
        if let Some(node) = self.replicas[i].take() {
            self.world.crash(&name, node, Some(CRASH)).await;
            self.replica_crashes += 1;
        }
        self.start_replica(i).await
    }

    /// Replica `i` crashes, loses its data dir, and is built from a copy of
    /// its shard's other replica over HTTP, as `ferry replica
    /// --bootstrap-from` does (see [`Sim::try_rebuild`]). Without its peer
    /// running it is an ordinary crash.
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
        self.log(format!("{name} lost its data dir"));
        self.rebuilding.insert(i);
        self.try_rebuild(i).await
    }

    /// One attempt to build lost replica `i` from its peer; it starts once
    /// built. Half of the attempts are cut by a power cut first (the next
    /// copy goes on over what the cut left). A donor out of reach (down, or
    /// cut off by a partition) leaves it down until the next event, as
    /// `ferry replica --bootstrap-from` keeps trying.
    async fn try_rebuild(&mut self, i: usize) -> Result<(), Failure> {
        use ferry_replica::replica::bootstrap::BootstrapError;
        let peer = i ^ 1;
        let name = replica_name(i);
        if self.replicas[peer].is_none() {
            return Ok(());
        }
        let source = ferry_node::bootstrap::HttpDonor {
            peers: HttpPeers::new(self.world.net.node(&name), None),
            addr: replica_http(peer),
        };
        let (shard, number) = (i as u32 / REPLICAS_PER_SHARD, i as u32 % REPLICAS_PER_SHARD);
        let cut = self
            .loss_rng
            .random_bool(0.5)
            .then(|| Duration::from_millis(self.loss_rng.random_range(0..300)));
        // Every other cut copy is not resumed at once: the process is
        // started plainly first, as a supervisor that dropped
        // `--bootstrap-from` would, and must refuse the unfinished copy
        // (the next event copies again). Counted, not drawn: the seeds'
        // draws stay where they were.
        let resume = match cut {
            Some(_) => {
                self.copies_cut += 1;
                self.copies_cut.is_multiple_of(2)
            }
            None => true,
        };
        let copied = crate::replicas::copy_lost_replica(
            &mut self.world,
            &name,
            shard,
            number,
            &source,
            cut,
            0,
            resume,
        )
        .await
        .map_err(|e| self.fail(e))?;
        if copied.left_after_cut {
            return self.start_over_unfinished_copy(i).await;
        }
        let position = match copied.built {
            Some(Err(e @ BootstrapError::Source { .. })) => {
                self.log(format!("{name}: copy failed, tried again later: {e}"));
                return Ok(());
            }
            Some(Err(e)) => {
                return Err(self.fail(format!("{name}: copying {}: {e}", replica_name(peer))))
            }
            Some(Ok(b)) => b.disk_consistent_lsn,
            None => Lsn(0),
        };
        self.log(format!(
            "{name} built from {} at {position}",
            replica_name(peer)
        ));
        self.rebuilding.remove(&i);
        self.replicas_rebuilt += 1;
        // A new replica under the old name: its position starts at the copy's.
        if let Ok(mut r) = self.reported.lock() {
            r[i] = position;
        }
        self.run_replica(i).await
    }

    /// Starts lost replica `i` without a copy over what a cut copy left:
    /// with the copy's marker down it must refuse to open (a new replica
    /// would stream from 0/0 over the copied parts); the replica stays
    /// lost until a copy finishes.
    async fn start_over_unfinished_copy(&mut self, i: usize) -> Result<(), Failure> {
        let name = replica_name(i);
        let unfinished = ferry_replica::replica::bootstrap::copy_unfinished(
            &self.world.disk(&name).for_process(),
            "replica",
        )
        .await
        .map_err(|e| self.fail(format!("{name}: {e}")))?;
        if !unfinished {
            // Cut before its first part: a plain start would be a new
            // replica, which is not what is tested here.
            return Ok(());
        }
        let refused = self.unfinished_copies_refused;
        self.run_replica(i).await?;
        if self.replicas[i].is_some() {
            return Err(self.fail(format!("{name} opened an unfinished copy as a new replica")));
        }
        if self.unfinished_copies_refused == refused {
            self.log(format!("{name} exited before opening its data dir"));
        }
        Ok(())
    }

    /// Replicas that exited (no coordination when they started) start again.
    pub(super) async fn restart_exited_replicas(&mut self) -> Result<(), Failure> {
        for i in 0..replicas() {
            if self.replicas[i].is_none() {
                self.start_replica(i).await?;
            }
        }
        Ok(())
    }
}
