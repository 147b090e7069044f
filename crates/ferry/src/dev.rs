//! `ferry dev`: the whole system in one process on embedded defaults.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry_coord::embedded::{EmbeddedOptions, EmbeddedStore};
use ferry_coord::Coordination;
use ferry_env::RealDisk;
use ferry_safekeeper::wal_storage::Preallocation;
use ferry_wal::segment::SegmentSize;
use ferry_wal::ClusterId;

use ferry_host::cluster::{self, ClusterRecord, ClusterState};
use ferry_host::local::{LocalQuorum, Member, QuorumSpec, SafekeeperSpec};
use ferry_node::commit_record::{self, WalState};

#[derive(Debug, clap::Args)]
pub struct DevArgs {
    /// Data directory (coordination store, WAL, object storage); created if
    /// missing. Default: $FERRY_DATA_DIR, else ./ferry-data.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// HTTP status endpoint (`GET /status`).
    #[arg(long, default_value = "127.0.0.1:7878")]
    http: String,
    /// Number of safekeepers of a new data dir; an existing data dir keeps the
    /// number it was made with, and a different one is refused. Default: 3.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_SAFEKEEPERS))]
    safekeepers: Option<u64>,
    /// WAL segment size in bytes of a new data dir (a power of two, 64 KiB to
    /// 1 GiB); an existing data dir keeps its own. Default: 16777216 (16 MiB).
    #[arg(long, value_parser = parse_segment_size)]
    segment_bytes: Option<SegmentSize>,
    /// Folders a `file://` export destination must lie in, comma-separated
    /// (created if missing; a request naming any other local folder is
    /// refused before anything is written). Default: `<data dir>/lake`.
    /// Env: FERRY_EXPORT_ROOTS.
    #[arg(long, value_delimiter = ',', env = "FERRY_EXPORT_ROOTS")]
    export_roots: Vec<PathBuf>,
    /// The size a table that exports itself makes its lake files near to:
    /// a partition whose rows stopped changing has its small parts merged
    /// on the replicas up to it, and the next increment replaces the
    /// lake's small files by the merged ones. MiB.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=16384))]
    lake_target_file_mib: u64,
    /// Replicas, each holding every shard of every table: 2 (a copy to
    /// rebuild the other from), or 1 to see what the second costs. A data
    /// dir run with fewer replicas than before keeps the others' folders;
    /// the safekeepers keep WAL for them until the replica expiry.
    #[arg(long, default_value_t = DEV_REPLICAS, value_parser = clap::value_parser!(u32).range(1..=2))]
    replicas: u32,
    #[command(flatten)]
    pub wal: ferry_host::local::WalServiceArgs,
    #[command(flatten)]
    pub back_pressure: ferry_host::local::BackPressureArgs,
    /// When WAL segments are zero-filled ahead of time: auto (while commits are
    /// small), always or never.
    #[arg(long, default_value_t = Preallocation::Auto)]
    wal_preallocation: Preallocation,
    #[command(flatten)]
    api: ferry_host::api::ApiArgs,
    /// Runs a demonstration and exits: creates a sample table partitioned by
    /// month, inserts generated rows spread over 12 months through the HTTP
    /// API, waits until both replicas applied them and shows their partitions
    /// and parts.
    #[arg(long)]
    demo: bool,
    /// Rows the demonstration inserts.
    #[arg(long, default_value_t = 1_200_000, requires = "demo")]
    demo_rows: usize,
}

/// Replicas that `ferry dev` runs by default; each holds every shard of
/// every table.
const DEV_REPLICAS: u32 = 2;
/// How long a clean stop waits for the replicas to apply the checkpoint.
const DEV_REPLICA_STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Most safekeepers of one local quorum.
pub const MAX_SAFEKEEPERS: u64 = 15;

pub fn parse_segment_size(s: &str) -> Result<SegmentSize, String> {
    let bytes: u64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number of bytes: {e}"))?;
    SegmentSize::new(bytes).map_err(|e| e.to_string())
}

/// How long the writer may take to get elected before `ferry dev` gives up.
const ELECTION_BOUND: Duration = Duration::from_secs(30);

/// The embedded coordination store of a data dir and the sessions on it.
struct EmbeddedCoordination {
    store: EmbeddedStore,
    sessions: Arc<ferry_coord::EmbeddedSessions>,
    metrics: Arc<ferry_coord::CoordMetrics>,
    dir: PathBuf,
    _lock: ferry_host::lockfile::DirLock,
}

impl EmbeddedCoordination {
    fn factory(&self) -> Arc<dyn ferry_coord::SessionFactory> {
        Arc::clone(&self.sessions) as Arc<dyn ferry_coord::SessionFactory>
    }
}

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let mut shutdown = ferry_host::signals::ShutdownSignal::install()?;
    // Everything that can be checked without the data dir is, and every
    // listener is bound, before the data dir is touched.
    let data_dir = ferry_host::paths::data_dir(
        args.data_dir.as_deref(),
        "FERRY_DATA_DIR",
        Some(crate::default_data_dir()),
    )?;
    anyhow::ensure!(
        !args.demo || args.replicas == DEV_REPLICAS,
        "--demo compares {DEV_REPLICAS} replicas: it cannot run with --replicas {}",
        args.replicas
    );
    let http_listener = ferry_host::http::bind(&args.http).await?;
    let token = args.api.token()?;

    let data_dir = ferry_host::paths::absolute(&data_dir)?;
    let _lock = ferry_host::lockfile::lock_dir(&data_dir)?;
    let coord = open_coordination(&data_dir, args.wal.min_free_disk).await?;
    let lake_url = format!("file://{}", data_dir.join("lake").display());
    let lake = ferry_storage::open(&lake_url, &ferry_host::s3_settings_from_env())
        .context("opening the object storage")?;
    let session: ferry_coord::Session = ferry_coord::SessionFactory::open(&*coord.sessions)
        .await
        .context("opening a coordination session")?;
    let (record, quorum) = match start_wal(&args, &data_dir, &coord, &*session).await {
        Ok(started) => started,
        Err(e) => {
            session.close().await;
            coord.store.shutdown().await;
            return Err(e);
        }
    };
    let quorum = Arc::new(quorum);
    let session = ferry_coord::RenewingSession::with(coord.factory(), session);
    let mut registry = prometheus_client::registry::Registry::default();
    let writer_node = ferry_node::WriterNode::start(
        Arc::clone(&quorum.writer),
        coord.factory(),
        session.clone(),
        ferry_env::Cpu::BlockingPool,
        args.api.limits(),
        ferry_ingest::IngestMetrics::register(&mut registry),
    )
    .await
    .context("opening the table catalog")?;
    let catalog = writer_node.catalog().clone();
    let recording = writer_node.recording();
    let elections = ferry_host::metrics::count_elections(&mut registry, quorum.writer.subscribe());
    let destinations: Arc<dyn ferry_export::Destinations> =
        Arc::new(ferry_export::StorageDestinations::new(
            ferry_host::s3_settings_from_env(),
            ferry_host::paths::export_roots(&args.export_roots, &data_dir)?,
        ));
    let mut nodes = start_replicas(
        &data_dir,
        &coord,
        &catalog,
        &quorum,
        &destinations,
        args.wal.min_free_disk,
        args.replicas,
    )
    .await?;
    let exports = export_api(
        &nodes,
        &coord,
        &session,
        &quorum,
        destinations,
        args.lake_target_file_mib << 20,
    )?;
    // Tables that export themselves.
    let policies = ferry_node::exports::Policies::start(&exports);
    let metrics = dev_metrics(
        registry,
        &quorum,
        &coord,
        &recording,
        &nodes,
        policies.status.clone(),
    );
    let router = writer_node
        .router()
        .merge(ferry_host::reads::router(Arc::new(
            ferry_host::reads::Reads {
                catalog,
                replicas: nodes.iter().map(|n| n.reader.clone()).collect(),
            },
        )))
        .merge(ferry_node::exports::router(exports))
        .merge(ferry_host::http::node_routes(
            dev_status(
                &record,
                &quorum,
                &coord,
                &nodes,
                recording,
                policies.status.clone(),
            ),
            Arc::new(metrics),
        ));
    let server = ferry_host::http::serve(http_listener, router, token)?;
    let http = server.addr.clone();
    announce(
        &data_dir,
        &record,
        &coord,
        &lake,
        &quorum,
        &http,
        nodes.len(),
    );

    let demo_result = if args.demo {
        let result = crate::demo::run(&format!("http://{http}"), args.demo_rows, lake.url()).await;
        if let Err(e) = &result {
            say!("the demo failed: {e:#}");
        }
        Some(result)
    } else {
        let why = shutdown.recv().await;
        tracing::info!(signal = why, "stopping");
        None
    };
    // Inserts in progress finish (or time out) before the writer stops.
    server.stop().await;
    policies.stop().await;
    // A replica is consistent at any instant: stopping its stream is safe.
    // Exporters stop first: their uploads are abandoned (a part's upload
    // leaves nothing visible unless it finished) and their locks go with
    // their sessions.
    for node in &mut nodes {
        node.stop_exporter().await;
    }
    elections.abort();
    let session = writer_node.stop().await;
    let term = quorum.writer.status().term;
    let quorum = Arc::into_inner(quorum).context("status endpoint still holds the quorum")?;
    // The replicas still stream: the writer's checkpoint reaches them and the
    // stop waits (bounded) until both applied it, so a clean stop leaves
    // every acknowledged insert in their parts.
    let every_replica: Vec<(u32, u32)> = (0..args.replicas)
        .map(|r| (ferry_replica::ALL_SHARDS, r))
        .collect();
    let end = quorum
        .shutdown_waiting_for(&every_replica, DEV_REPLICA_STOP_WAIT)
        .await?;
    for node in nodes {
        node.stop().await;
    }
    commit_record::record_wal_state(
        &*session.session().await?,
        WalState {
            term,
            commit_lsn: end,
        },
    )
    .await?;
    session.close().await;
    coord.store.shutdown().await;
    tracing::info!(checkpoint = %end, "stopped cleanly");
    say!("ferry dev stopped cleanly; shutdown checkpoint committed at {end}");
    demo_result.unwrap_or(Ok(()))
}

/// Opens the data dir's embedded coordination store (`<data dir>/coord`,
/// locked for this process); it refuses writes while less than
/// `min_free_disk` is free on the data dir's file system (as the
/// safekeepers and replicas beside it do).
async fn open_coordination(
    data_dir: &Path,
    min_free_disk: u64,
) -> anyhow::Result<EmbeddedCoordination> {
    let dir = data_dir.join("coord");
    let lock = ferry_host::lockfile::lock_dir(&dir)?;
    let disk = Arc::new(
        RealDisk::open_root(data_dir)
            .with_context(|| format!("opening the data dir {}", data_dir.display()))?,
    );
    let options = EmbeddedOptions {
        min_free_disk,
        ..EmbeddedOptions::default()
    };
    let store = EmbeddedStore::open(disk, "coord", options)
        .await
        .with_context(|| {
            format!(
                "opening the embedded coordination store in {}",
                dir.display()
            )
        })?;
    let metrics = Arc::new(ferry_coord::CoordMetrics::default());
    let sessions = Arc::new(ferry_coord::EmbeddedSessions {
        store: store.clone(),
        timeout: Duration::from_secs(10),
        metrics: Arc::clone(&metrics),
    });
    Ok(EmbeddedCoordination {
        store,
        sessions,
        metrics,
        dir,
        _lock: lock,
    })
}

/// Identifies the cluster (or starts creating it), starts its WAL quorum
/// and waits until the writer is elected; a new cluster is recorded as
/// ready once its safekeepers exist.
async fn start_wal(
    args: &DevArgs,
    data_dir: &Path,
    coord: &EmbeddedCoordination,
    session: &dyn Coordination,
) -> anyhow::Result<(ClusterRecord, LocalQuorum)> {
    let wal_dir = data_dir.join("wal");
    let record = identify(session, args, &coord.dir, &wal_dir).await?;
    let creating = record.state == ClusterState::Creating;
    let known = commit_record::read_wal_state(session).await?;
    let segment =
        SegmentSize::new(record.segment_bytes).context("the segment size in the cluster record")?;
    let wal_server = args.wal.server_config(Some(&data_dir.join("wal-backup")))?;
    let spec = QuorumSpec {
        dir: wal_dir,
        safekeepers: record.safekeepers,
        safekeeper: SafekeeperSpec {
            cluster_id: record.cluster_id.clone(),
            segment,
            preallocation: args.wal_preallocation,
            create: creating,
            restore: false,
            pull_from: Vec::new(),
            server: wal_server,
        },
        min_term: known.term,
        known_commit_lsn: known.commit_lsn,
        back_pressure: args.back_pressure.limits(),
        pull_lost: !creating,
    };
    let quorum = LocalQuorum::start(&spec)
        .await
        .context("starting the WAL quorum")?;
    if creating {
        cluster::write_record(
            session,
            &ClusterRecord {
                state: ClusterState::Ready,
                ..record.clone()
            },
        )
        .await?;
    }
    if let Some(why) = election_refused(&quorum).await {
        quorum.stop().await;
        anyhow::bail!("{why}");
    }
    Ok((record, quorum))
}

/// Waits (at most [`ELECTION_BOUND`]) until the writer is elected; says why
/// it was not.
async fn election_refused(quorum: &LocalQuorum) -> Option<String> {
    let mut writer_status = quorum.writer.subscribe();
    let elected = tokio::time::timeout(
        ELECTION_BOUND,
        writer_status.wait_for(|s| s.elected || s.refused.is_some()),
    )
    .await;
    let status = quorum.writer.status();
    match elected {
        Ok(Ok(s)) => s.refused.clone(),
        Ok(Err(_)) => Some("the writer stopped".into()),
        Err(_) => Some(format!(
            "the writer was not elected in {ELECTION_BOUND:?}{}",
            status
                .election_blocked
                .as_deref()
                .map(|b| format!(": {b}"))
                .unwrap_or_default()
        )),
    }
}

/// The replica nodes: each holds every shard of every table, streams from
/// the safekeepers and exports as its own node.
async fn start_replicas(
    data_dir: &Path,
    coord: &EmbeddedCoordination,
    catalog: &ferry_ingest::Catalog,
    quorum: &LocalQuorum,
    destinations: &Arc<dyn ferry_export::Destinations>,
    min_free_disk: u64,
    replicas: u32,
) -> anyhow::Result<Vec<ferry_node::ReplicaNode>> {
    let disk: Arc<dyn ferry_env::Disk> = Arc::new(
        RealDisk::open_root(data_dir)
            .with_context(|| format!("opening the data dir {}", data_dir.display()))?,
    );
    let tables: Arc<dyn ferry_replica::Tables> =
        Arc::new(ferry_host::reads::CatalogTables(catalog.clone()));
    let safekeeper_addrs: Vec<String> = quorum.servers().map(|s| s.addr().to_string()).collect();
    // A replica without a state file beside one with (its folder lost) is
    // built from a copy of the other: replicas with state start first.
    let mut lost = Vec::new();
    for r in 0..replicas {
        lost.push(
            ferry_replica::replica::bootstrap::needs_copy(disk.as_ref(), &format!("replicas/r{r}"))
                .await?,
        );
    }
    let donor = (0..replicas).find(|r| !lost[*r as usize]);
    let order: Vec<u32> = (0..replicas)
        .filter(|r| Some(*r) == donor)
        .chain((0..replicas).filter(|r| Some(*r) != donor))
        .collect();
    let mut started: Vec<Option<ferry_node::ReplicaNode>> = (0..replicas).map(|_| None).collect();
    for r in order {
        let dir = format!("replicas/r{r}");
        let donor_node = donor
            .filter(|d| *d != r && lost[r as usize])
            .and_then(|d| started[d as usize].as_ref().map(|n| (d, n)));
        if let Some((d, donor_node)) = donor_node {
            let source = ferry_replica::replica::bootstrap::LocalDonor {
                replica: Arc::clone(&donor_node.replica),
                clock: Arc::new(ferry_env::SystemClock),
                name: format!("replica {d}"),
            };
            let built = ferry_replica::replica::bootstrap::copy_from_peer(
                &disk,
                &dir,
                ferry_replica::ALL_SHARDS,
                r,
                ferry_env::Cpu::BlockingPool,
                ferry_replica::replica::bootstrap::CopyCheck::Rows,
                &source,
            )
            .await
            .with_context(|| format!("building replica {r} from replica {d}"))?;
            say!(
                "replica {r} had no state (its folder {} was lost): built from replica {d} at {}, {} parts ({} bytes copied)",
                data_dir.join(&dir).display(),
                built.disk_consistent_lsn,
                built.parts,
                built.bytes_copied
            );
        }
        let node = ferry_node::ReplicaNode::start(
            ferry_node::ReplicaNodeConfig {
                dir: dir.clone(),
                shard: ferry_replica::ALL_SHARDS,
                replica: r,
                wal: ferry_node::WalSource::Safekeepers {
                    network: Arc::new(ferry_env::TcpNetwork),
                    config: ferry_replica::StreamConfig {
                        space: (min_free_disk > 0).then(|| {
                            ferry_env::space::SpaceBreaker::new(
                                format!("replica {r}"),
                                min_free_disk,
                            )
                        }),
                        ..ferry_replica::StreamConfig::new(safekeeper_addrs.clone())
                    },
                },
                merges: Some(ferry_node::replica::REPLACED_PART_GRACE),
                export: Some(ferry_node::ExportSeams {
                    config: ferry_export::ExporterConfig::new(exporter_name(r)),
                    sessions: coord.factory(),
                    destinations: Arc::clone(destinations),
                }),
            },
            ferry_node::ReplicaSeams {
                disk: Arc::clone(&disk),
                clock: Arc::new(ferry_env::SystemClock),
                cpu: ferry_env::Cpu::BlockingPool,
                tables: Arc::clone(&tables),
            },
        )
        .await
        .with_context(|| format!("opening replica {}", data_dir.join(&dir).display()))?;
        started[r as usize] = Some(node);
    }
    Ok(started.into_iter().flatten().collect())
}

/// The exporter name of dev replica `r`.
fn exporter_name(r: u32) -> String {
    format!("dev-r{r}")
}

/// The export API: requests go through the first replica, whose exporter's
/// listing answers `GET /exports`.
fn export_api(
    nodes: &[ferry_node::ReplicaNode],
    coord: &EmbeddedCoordination,
    session: &ferry_coord::RenewingSession,
    quorum: &Arc<LocalQuorum>,
    destinations: Arc<dyn ferry_export::Destinations>,
    target_file_bytes: u64,
) -> anyhow::Result<Arc<ferry_node::exports::ExportApi>> {
    let first = nodes.first().context("no replica")?;
    let view = first
        .exports
        .clone()
        .context("a dev replica runs an exporter")?;
    let commit_writer = Arc::clone(&quorum.writer);
    Ok(Arc::new(ferry_node::exports::ExportApi {
        session: session.clone(),
        sessions: coord.factory(),
        parts: Arc::clone(&first.parts) as Arc<dyn ferry_export::LocalParts>,
        local: Arc::clone(&first.parts),
        destinations,
        replica_name: exporter_name(0),
        clock: Arc::new(ferry_env::SystemClock),
        commit_lsn: Arc::new(move || {
            let lsn = commit_writer
                .status()
                .commit_lsn
                .parse()
                .map_err(|e| format!("the writer's commit_lsn: {e}"));
            Box::pin(async move { lsn })
        }),
        target_file_bytes,
        maintain: {
            let writer = Arc::clone(&quorum.writer);
            Arc::new(move |_table, record| {
                let writer = Arc::clone(&writer);
                Box::pin(async move {
                    writer
                        .append(record.into_record().to_bytes())
                        .await
                        .map_err(|e| e.to_string())
                })
            })
        },
        view,
        // The edge's randomness: transaction ids only need to differ.
        ids: ferry_node::exports::TransactionIds::new(rand::random()),
    }))
}

/// `GET /metrics`: the registry's live counters and what the writer, the
/// commit record, the safekeepers, coordination and the exporters report.
fn dev_metrics(
    registry: prometheus_client::registry::Registry,
    quorum: &Arc<LocalQuorum>,
    coord: &EmbeddedCoordination,
    recording: &tokio::sync::watch::Receiver<commit_record::WalStateRecording>,
    nodes: &[ferry_node::ReplicaNode],
    policies: tokio::sync::watch::Receiver<ferry_export::policy::PolicyStatus>,
) -> ferry_host::metrics::NodeMetrics {
    let quorum = Arc::clone(quorum);
    let coord_metrics = Arc::clone(&coord.metrics);
    let recording = recording.clone();
    let exports: Vec<(
        String,
        tokio::sync::watch::Receiver<ferry_export::ExportsView>,
    )> = nodes
        .iter()
        .enumerate()
        .filter_map(|(r, n)| Some((exporter_name(r as u32), n.exports.clone()?)))
        .collect();
    ferry_host::metrics::NodeMetrics::new(registry, move || {
        let q = Arc::clone(&quorum);
        let coord = Arc::clone(&coord_metrics);
        let exports: Vec<(String, ferry_export::ExportsView)> = exports
            .iter()
            .map(|(n, rx)| (n.clone(), rx.borrow().clone()))
            .collect();
        let commit_record = ferry_host::metrics::commit_record(&recording.borrow());
        let policies = ferry_host::metrics::export_policies(&policies.borrow());
        Box::pin(async move {
            let mut out = ferry_host::metrics::writer(&q.writer.status());
            out.extend(policies);
            out.extend(commit_record);
            for s in q.servers() {
                out.extend(ferry_host::metrics::safekeeper(&s.status().await));
            }
            out.extend(ferry_host::metrics::coordination(&coord));
            for (node, view) in &exports {
                out.extend(ferry_host::metrics::exporter(node, view));
            }
            out
        })
    })
}

/// `GET /status`: the cluster, the writer, the commit record, every
/// safekeeper and every replica.
fn dev_status(
    record: &ClusterRecord,
    quorum: &Arc<LocalQuorum>,
    coord: &EmbeddedCoordination,
    nodes: &[ferry_node::ReplicaNode],
    recording: tokio::sync::watch::Receiver<commit_record::WalStateRecording>,
    policies: tokio::sync::watch::Receiver<ferry_export::policy::PolicyStatus>,
) -> impl Fn() -> futures::future::BoxFuture<'static, serde_json::Value> + Clone + Send + Sync + 'static
{
    let quorum = Arc::clone(quorum);
    let replicas: Vec<ferry_replica::ReplicaReader> =
        nodes.iter().map(|n| n.reader.clone()).collect();
    let cluster_id = record.cluster_id.clone();
    let coord_space = coord.store.space().cloned();
    move || {
        let q = Arc::clone(&quorum);
        let replicas: Vec<_> = replicas.iter().map(|r| r.status()).collect();
        let cluster_id = cluster_id.clone();
        let commit_record = recording.borrow().clone();
        let export_policies = policies.borrow().tables.clone();
        // Why the coordination store refuses writes, while it does.
        let coord_disk_full = coord_space
            .as_ref()
            .and_then(|s| s.check().err())
            .map(|e| e.to_string());
        Box::pin(async move {
            serde_json::json!({
                "cluster_id": cluster_id,
                "writer": q.writer.status(),
                "commit_record": commit_record,
                "coordination": { "disk_full": coord_disk_full },
                "safekeepers": q.member_status().await,
                "replicas": replicas,
                "export_policies": export_policies,
            })
        })
    }
}

/// Says the node is ready, where everything is, and which safekeepers are down.
fn announce(
    data_dir: &Path,
    record: &ClusterRecord,
    coord: &EmbeddedCoordination,
    lake: &ferry_storage::Location,
    quorum: &LocalQuorum,
    http: &str,
    replicas: usize,
) {
    let down: Vec<String> = quorum
        .members
        .iter()
        .filter_map(|m| match m {
            Member::Down { id, .. } => Some(format!("sk{id}")),
            Member::Up(_) => None,
        })
        .collect();
    if !down.is_empty() {
        say!(
            "running on the healthy majority: {} down (see /status for why; its data must be repaired or rebuilt explicitly)",
            down.join(", ")
        );
    }
    say!(
        "ferry dev ready: data dir {}, cluster {}, coordination store {}, object storage {}, {} safekeepers ({}), writer term {}, status on http://{http}/status",
        data_dir.display(),
        record.cluster_id,
        coord.dir.display(),
        lake.url(),
        record.safekeepers,
        quorum.servers().map(|s| s.addr().to_string()).collect::<Vec<_>>().join(", "),
        quorum.writer.status().term,
    );
    say!("tables and inserts on http://{http}/tables, {replicas} replica(s) holding every shard (GET /replicas), partition export (POST /exports, GET /exports); press Ctrl-C to stop");
}

/// Checks the data dir's identity against the flags and what is on disk, or
/// starts creating a new cluster; returns the cluster record.
async fn identify(
    session: &dyn Coordination,
    args: &DevArgs,
    coord_dir: &Path,
    wal_dir: &Path,
) -> anyhow::Result<ClusterRecord> {
    let asked_safekeepers = args.safekeepers.map(|n| n as usize);
    let asked_segment = args.segment_bytes.map(SegmentSize::bytes);
    let Some(record) = cluster::read_record(session).await? else {
        let found = cluster::safekeepers_on_disk(wal_dir);
        if !found.is_empty() {
            let list: Vec<String> = found
                .iter()
                .map(|(path, cluster)| format!("{path} (cluster {cluster})"))
                .collect();
            anyhow::bail!(
                "the coordination store in {} has no cluster record, but safekeepers exist: {}. The coordination store was deleted or replaced; starting would forget the cluster's committed state. Restore it, or move the whole data dir away to start a new cluster",
                coord_dir.display(),
                list.join(", ")
            );
        }
        let record = ClusterRecord {
            cluster_id: ClusterId::from_random(random_u128()),
            safekeepers: asked_safekeepers.unwrap_or(3),
            segment_bytes: asked_segment.unwrap_or(ferry_wal::segment::DEFAULT_SEGMENT_BYTES),
            state: ClusterState::Creating,
            safekeeper_addrs: None,
        };
        cluster::write_record(session, &record).await?;
        tracing::info!(cluster = %record.cluster_id, "creating a new cluster");
        return Ok(record);
    };
    if let Some(n) = asked_safekeepers.filter(|n| *n != record.safekeepers) {
        anyhow::bail!(
            "the data dir holds cluster {} with {} safekeepers; --safekeepers {n} asks for {n}. Changing the number of safekeepers is a membership change, which without consensus can lose committed WAL; ferry does not do it. Start without --safekeepers (or with --safekeepers {})",
            record.cluster_id,
            record.safekeepers,
            record.safekeepers
        );
    }
    if let Some(bytes) = asked_segment.filter(|b| *b != record.segment_bytes) {
        anyhow::bail!(
            "the data dir holds cluster {} with {}-byte WAL segments; --segment-bytes {bytes} asks for {bytes}-byte segments. The segment size of existing WAL cannot change; start without --segment-bytes (or with --segment-bytes {})",
            record.cluster_id,
            record.segment_bytes,
            record.segment_bytes
        );
    }
    Ok(record)
}

/// 128 bits from the operating system's randomness (hash keys are seeded by
/// it): a new cluster's id. Only here, at the binary's edge.
fn random_u128() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let half = || {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish()
    };
    (u128::from(half()) << 64) | u128::from(half())
}
