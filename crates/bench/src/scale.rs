//! `ferry bench export-scale`: one partition of `--parts` tiny parts (one
//! row each, 100,000 by default) exported by `--nodes` exporters (16) in one
//! process through one coordination store (ZooKeeper with `--zookeeper`, the
//! embedded store otherwise). It shows what the task costs coordination at
//! that scale: the largest node the task holds, the multis that create it,
//! the round trips per part, the status listing's size and coordination
//! reads (none), and the wall time of each phase.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use arrow::array::{Int64Array, RecordBatch, StringArray};
use async_trait::async_trait;
use ferry_coord::{CoordMetrics, Coordination, CreateMode, EmbeddedSessions, SessionFactory};
use ferry_env::{Cpu, Disk, RealDisk, SystemClock};
use ferry_export::dest::SourcePart;
use ferry_export::model::ExportSettings;
use ferry_export::{
    Destinations, ExportRequest, Exporter, ExporterConfig, LocalParts, Requester,
    StorageDestinations, TaskStatus,
};
use ferry_export::{SnapshotError, SnapshotRequest};
use ferry_replica::part::PartEncoder;
use ferry_replica::{PartMeta, PartName};
use ferry_storage::S3Settings;
use ferry_table::{Table, TableDef};
use ferry_wal::Lsn;

#[derive(Debug, clap::Args)]
pub struct ScaleBenchArgs {
    /// Directory for the data. Default: a temporary directory inside the
    /// working folder.
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Parts of the partition (one row each).
    #[arg(long, default_value_t = 100_000)]
    parts: usize,
    /// Exporting nodes sharing the task (each holds every part, as the
    /// replicas of a shard do).
    #[arg(long, default_value_t = 16)]
    nodes: usize,
    /// Parts each node exports at once.
    #[arg(long, default_value_t = 2)]
    parallelism: u32,
    /// ZooKeeper (`host:port`); a fresh chroot is used. The embedded store
    /// when absent.
    #[arg(long, env = "FERRY_TEST_ZK")]
    zookeeper: Option<String>,
}

fn table() -> Table {
    Table {
        id: 1,
        def: TableDef::from_toml(
            r#"name = "scale"
partition_by = { column = "p", transform = "identity" }
shard_by = { column = "id", shards = 1 }
[[columns]]
name = "id"
type = "Int64"
[[columns]]
name = "p"
type = "Utf8"
"#,
        )
        .expect("the bench table is valid"),
    }
}

/// Parts of one row each, in files of their own, held by every node.
struct ScaleParts {
    disk: Arc<dyn Disk>,
    metas: BTreeMap<PartName, PartMeta>,
}

impl ScaleParts {
    async fn write(disk: Arc<dyn Disk>, count: usize) -> anyhow::Result<ScaleParts> {
        let schema = table().def.arrow_schema();
        disk.create_dir_all("parts").await?;
        let mut metas = BTreeMap::new();
        for i in 0..count as u64 {
            let name = PartName {
                partition_id: "x".into(),
                min_block: i + 1,
                max_block: i + 1,
                level: 0,
            };
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(Int64Array::from_iter_values([i as i64])),
                    Arc::new(StringArray::from_iter_values(["x"])),
                ],
            )?;
            let mut encoder = PartEncoder::new(&schema, &name, 1, (Lsn(i + 1), Lsn(i + 1)))?;
            let mut bytes = encoder.write(&batch)?;
            let (tail, meta) = encoder.finish()?;
            bytes.extend_from_slice(&tail);
            // Not synced: a bench's parts need not survive a crash.
            let file = disk.create_new(&Self::path(&name)).await?;
            file.write_at(0, bytes::Bytes::from(bytes)).await?;
            metas.insert(name, meta);
        }
        Ok(ScaleParts { disk, metas })
    }

    fn path(name: &PartName) -> String {
        format!("parts/{name}.parquet")
    }
}

#[async_trait]
impl LocalParts for ScaleParts {
    async fn snapshot(&self, req: &SnapshotRequest) -> Result<Vec<PartMeta>, SnapshotError> {
        Ok(self
            .metas
            .values()
            .filter(|m| {
                req.partition_id
                    .as_deref()
                    .is_none_or(|p| m.name.partition_id == p)
            })
            .cloned()
            .collect())
    }

    async fn find(&self, _table_id: u64, name: &PartName) -> Option<SourcePart> {
        self.metas.get(name).map(|meta| SourcePart {
            disk: Arc::clone(&self.disk),
            path: Self::path(name),
            meta: meta.clone(),
            shard: None,
        })
    }

    // Nothing merges here: no part needs keeping alive.
    async fn pin(&self, _: &str, _: u64, _: &[PartName]) -> Result<(), String> {
        Ok(())
    }

    async fn unpin(&self, _: &str) -> Result<(), String> {
        Ok(())
    }

    async fn pinned(&self) -> Vec<String> {
        Vec::new()
    }
}

pub async fn export_scale(args: ScaleBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.parts >= 1 && args.nodes >= 1,
        "--parts and --nodes must be at least 1"
    );
    let dir = crate::wal::scratch_dir(args.dir.as_deref(), "ferry-bench-scale-")?;
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path())?);

    // The parts: one row each, encoded as a replica encodes parts and
    // written straight to disk. No replica applies them: a replica keeps a
    // partition's parts few by merging, and this bench is about the
    // coordination of one task of that many parts, not about applying WAL.
    let started = Instant::now();
    let parts = Arc::new(ScaleParts::write(Arc::clone(&disk), args.parts).await?);
    say!(
        "bench export-scale: {} parts of one row written in {:.1} s",
        args.parts,
        started.elapsed().as_secs_f64()
    );

    // Coordination.
    let metrics = Arc::new(CoordMetrics::default());
    let mut embedded = None;
    let sessions: Arc<dyn SessionFactory> = match &args.zookeeper {
        Some(zk) => {
            let chroot = format!(
                "/ferry-bench-scale-{}",
                ferry_env::Clock::unix_micros(&SystemClock)
            );
            let root =
                ferry_coord::zk::ZkSession::connect(&ferry_coord::zk::ZkOptions::new(zk.clone()))
                    .await
                    .with_context(|| format!("connecting to ZooKeeper at {zk}"))?;
            ferry_coord::create_all(&root, &chroot).await?;
            root.close().await;
            say!("bench export-scale: ZooKeeper {zk}, chroot {chroot}");
            Arc::new(ferry_coord::ZkSessions {
                options: ferry_coord::zk::ZkOptions::new(format!("{zk}{chroot}")),
                metrics: Arc::clone(&metrics),
            })
        }
        None => {
            let store = ferry_coord::embedded::EmbeddedStore::open(
                Arc::clone(&disk),
                "coord",
                Default::default(),
            )
            .await?;
            embedded = Some(store.clone());
            say!("bench export-scale: the embedded store (no --zookeeper or FERRY_TEST_ZK)");
            Arc::new(EmbeddedSessions {
                store,
                timeout: Duration::from_secs(30),
                metrics: Arc::clone(&metrics),
            })
        }
    };
    let session = sessions.open().await?;
    ferry_coord::create_all(session.as_ref(), "/ferry/tables").await?;
    session
        .create(
            "/ferry/tables/scale",
            &serde_json::to_vec(&table())?,
            CreateMode::Persistent,
        )
        .await?;

    // The nodes: each an exporter over the same replica's parts.
    let url = format!(
        "file://{}",
        std::path::absolute(dir.path())?.join("lake").display()
    );
    let dests: Arc<dyn Destinations> = Arc::new(StorageDestinations::new(
        S3Settings::default(),
        ferry_storage::LocalRoots::new([dir.path().join("lake")])?,
    ));
    let mut views = Vec::new();
    let mut tasks = Vec::new();
    for n in 0..args.nodes {
        let exporter = Exporter::new(
            ExporterConfig::new(format!("node{n}")),
            Arc::clone(&sessions),
            Arc::new(SystemClock),
            Cpu::BlockingPool,
            Arc::clone(&parts) as Arc<dyn LocalParts>,
            Arc::clone(&dests),
        );
        views.push(exporter.subscribe());
        tasks.push(tokio::spawn(exporter.run()));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The request: snapshot, pins, the task's creation.
    let before = metrics.snapshot().total_round_trips();
    let started = Instant::now();
    let created = Requester {
        session: &session,
        sessions: sessions.as_ref(),
        parts: parts.as_ref(),
        destinations: dests.as_ref(),
        replica_name: "node0",
        now_unix_millis: ferry_env::Clock::unix_micros(&SystemClock) / 1000,
        random: 1,
        commit_lsn: Lsn(0),
        wait: Duration::from_secs(30),
    }
    .export(&ExportRequest {
        table: "scale".into(),
        partition_id: "x".into(),
        destination: url.clone(),
        force: false,
        replace_finished: false,
        by_policy: false,
        settings: ExportSettings {
            parallelism: args.parallelism,
            task_timeout_seconds: 24 * 3600,
            ..ExportSettings::default()
        },
    })
    .await
    .context("the export request")?;
    let request_secs = started.elapsed().as_secs_f64();
    let request_trips = metrics.snapshot().total_round_trips() - before;

    // The largest node the task holds.
    let base = created.key.path();
    let mut largest = (0u64, String::new());
    let mut consider = |path: String, len: u64| {
        if len > largest.0 {
            largest = (len, path);
        }
    };
    let (children, _) = session.children(&base).await?;
    for c in children {
        let path = format!("{base}/{c}");
        if let Some(stat) = session.exists(&path).await? {
            consider(path.clone(), stat.data_length.max(0) as u64);
        }
    }
    let (chunks, _) = session.children(&format!("{base}/parts")).await?;
    for c in &chunks {
        let path = format!("{base}/parts/{c}");
        if let Some(stat) = session.exists(&path).await? {
            consider(path, stat.data_length.max(0) as u64);
        }
    }
    say!(
        "bench export-scale: request (snapshot, pins, task of {} parts in {} snapshot chunks) {:.1} s, {} coordination round trips; largest node {} bytes ({})",
        created.parts_count,
        chunks.len(),
        request_secs,
        request_trips,
        largest.0,
        largest.1
    );

    // The export.
    let started = Instant::now();
    let view = &mut views[0];
    let mut last_report = Instant::now();
    let done = loop {
        let current = view.borrow_and_update().clone();
        if let Some(t) = current
            .tasks
            .iter()
            .find(|t| t.transaction_id == created.transaction_id && t.status.is_terminal())
        {
            break t.clone();
        }
        if last_report.elapsed() > Duration::from_secs(10) {
            last_report = Instant::now();
            if let Some(t) = current
                .tasks
                .iter()
                .find(|t| t.transaction_id == created.transaction_id)
            {
                say!(
                    "bench export-scale: {} of {} parts left after {:.0} s",
                    t.parts_to_do,
                    t.parts_count,
                    started.elapsed().as_secs_f64()
                );
            }
        }
        tokio::time::timeout(Duration::from_secs(3600), view.changed())
            .await
            .context("the export took over an hour")??;
    };
    let export_secs = started.elapsed().as_secs_f64();
    let after = metrics.snapshot();
    let trips = after.total_round_trips() - before - request_trips;
    let by_kind: Vec<String> = after
        .round_trips
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    anyhow::ensure!(
        done.status == TaskStatus::Completed,
        "the export ended {}",
        done.status
    );
    let shares: Vec<u64> = views
        .iter()
        .map(|v| v.borrow().counters.parts_exported)
        .collect();
    let claims_lost: u64 = views.iter().map(|v| v.borrow().counters.claims_lost).sum();
    let sessions: Vec<u64> = views.iter().map(|v| v.borrow().counters.sessions).collect();

    // The status listing: served from a node's mirror.
    let before_listing = metrics.snapshot().total_round_trips();
    let started = Instant::now();
    let mut listing_bytes = 0;
    const LISTINGS: u32 = 1000;
    for _ in 0..LISTINGS {
        let v = views[0].borrow().clone();
        listing_bytes = serde_json::to_vec(&v)?.len();
    }
    let listing_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(LISTINGS);
    let listing_trips = metrics.snapshot().total_round_trips() - before_listing;
    for t in tasks {
        t.abort();
    }
    say!(
        "bench export-scale: {} parts by {} nodes x {} at once: COMPLETED in {:.1} s ({:.0} parts/s), {:.2} coordination round trips per part (all nodes, commit included), parts per node {shares:?}, claims lost to another node {claims_lost}, coordination sessions per node {sessions:?}",
        created.parts_count,
        args.nodes,
        args.parallelism,
        export_secs,
        created.parts_count as f64 / export_secs,
        trips as f64 / created.parts_count as f64
    );
    say!(
        "bench export-scale: coordination round trips by kind (whole run): {}",
        by_kind.join(", ")
    );
    say!(
        "bench export-scale: status listing {listing_bytes} bytes, {listing_us:.0} µs each, {listing_trips} coordination round trips for {LISTINGS} listings"
    );
    session.close().await;
    if let Some(store) = embedded {
        store.shutdown().await;
    }
    Ok(())
}
