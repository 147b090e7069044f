//! `ferry bench export`: one partition of `--parts` parts (about `--mib`
//! MiB in all) exported by 1 and by 2 nodes to a local folder, and to an S3
//! server when `--s3-endpoint` is given, each time next to the same run's raw
//! object_store writes of the same bytes at the same concurrency; with the
//! coordination round trips per part.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use arrow::array::{Int64Array, RecordBatch, StringArray};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use ferry_coord::{CoordMetrics, CreateMode, EmbeddedSessions, SessionFactory};
use ferry_env::{Cpu, Disk, RealDisk, SystemClock};
use ferry_export::model::{ExportSettings, LakeFormat};
use ferry_export::{
    Destinations, ExportRequest, Exporter, ExporterConfig, LocalParts, ReplicaSet, Requester,
    StorageDestinations, TaskStatus,
};
use ferry_replica::{Replica, SharedReplica, TableRef, Tables, ALL_SHARDS};
use ferry_storage::S3Settings;
use ferry_table::{Table, TableDef};
use ferry_wal::record::Record;

#[derive(Debug, clap::Args)]
pub struct ExportBenchArgs {
    /// Directory for the data. Default: a temporary directory inside the
    /// working folder (so the figures are for this disk).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Size of the partition, MiB (about).
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    /// Parts of the partition.
    #[arg(long, default_value_t = 100)]
    parts: usize,
    /// Parts each node exports at once.
    #[arg(long, default_value_t = 2)]
    parallelism: u32,
    /// An S3 endpoint (moto) for the S3 half: a bucket is created there.
    #[arg(long, env = "FERRY_TEST_S3_ENDPOINT")]
    s3_endpoint: Option<String>,
    /// iceberg: also export into an Iceberg table, next to the Parquet
    /// destination of the same run, and time Iceberg commits of 1, 10 and
    /// 100 partitions at once.
    #[arg(long, default_value = "parquet")]
    format: LakeFormat,
    /// With --format iceberg: how many partitions commit at once, per
    /// round of the commit-latency figures.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    commit_partitions: Vec<usize>,
}

pub(crate) fn table() -> Table {
    Table {
        id: 1,
        def: TableDef::from_toml(
            r#"name = "bench"
partition_by = { column = "p", transform = "identity" }
shard_by = { column = "id", shards = 1 }
[[columns]]
name = "id"
type = "Int64"
[[columns]]
name = "p"
type = "Utf8"
[[columns]]
name = "payload"
type = "Utf8"
"#,
        )
        .expect("the bench table is valid"),
    }
}

pub(crate) struct OneTable;

#[async_trait]
impl Tables for OneTable {
    async fn by_id(&self, id: u64) -> Result<TableRef, String> {
        Ok(if id == 1 {
            TableRef::Known(table())
        } else {
            TableRef::Unknown
        })
    }
}

/// Rows that compress about as well as real data: 48 hex characters from a
/// xorshift per row.
pub(crate) fn batch(first: i64, rows: usize, state: &mut u64) -> anyhow::Result<RecordBatch> {
    let mut payload = Vec::with_capacity(rows);
    for _ in 0..rows {
        let mut s = String::with_capacity(48);
        for _ in 0..3 {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            s.push_str(&format!("{:016x}", *state));
        }
        payload.push(s);
    }
    Ok(RecordBatch::try_new(
        table().def.arrow_schema(),
        vec![
            Arc::new(Int64Array::from_iter_values(first..first + rows as i64)),
            Arc::new(StringArray::from_iter_values((0..rows).map(|_| "x"))),
            Arc::new(StringArray::from(payload)),
        ],
    )?)
}

/// Applies one insert record of the bench table's rows `ipc` (shard 0,
/// unkeyed) at the replica's position; `wal` is scratch space.
pub(crate) async fn apply_insert(
    r: &mut Replica,
    wal: &mut BytesMut,
    ipc: Bytes,
) -> anyhow::Result<()> {
    let at = r.receive_from();
    wal.clear();
    Record::Insert {
        table_id: 1,
        shard: 0,
        block_number: at.0,
        idempotency_key: Bytes::new(),
        arrow_ipc: ipc,
    }
    .encode(wal);
    r.receive(at, wal).await?;
    Ok(())
}

/// Creates a bucket with a plain unsigned request (moto accepts it).
async fn create_bucket(endpoint: &str, bucket: &str) -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(host).await?;
    let request = format!(
        "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    conn.read_to_string(&mut response).await?;
    anyhow::ensure!(
        response.starts_with("HTTP/1.1 200"),
        "create bucket: {response}"
    );
    Ok(())
}

pub async fn export(args: ExportBenchArgs) -> anyhow::Result<()> {
    let dir = crate::wal::scratch_dir(args.dir.as_deref(), "ferry-bench-export-")?;
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path())?);
    // The partition: one insert per part, written once and copied to the
    // second node's replica (the same parts, as replicas of a shard hold).
    // zstd Parquet of these rows takes about 30 bytes per row.
    let bytes_per_row = 30;
    let rows_per_part = (args.mib << 20) / args.parts.max(1) / bytes_per_row;
    say!(
        "bench export: writing a partition of {} parts x {rows_per_part} rows ...",
        args.parts
    );
    let mut wal = BytesMut::new();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut replicas: Vec<SharedReplica> = Vec::new();
    for n in 0..2u32 {
        let r = Replica::open(
            Arc::clone(&disk),
            &format!("replica{n}"),
            ALL_SHARDS,
            n,
            Cpu::BlockingPool,
            Arc::new(OneTable),
        )
        .await?;
        replicas.push(Arc::new(tokio::sync::Mutex::new(r)));
    }
    for i in 0..args.parts {
        wal.clear();
        let b = batch((i * rows_per_part) as i64, rows_per_part, &mut state)?;
        let ipc = ferry_table::rows::to_ipc(&b)?;
        for r in &replicas {
            apply_insert(&mut *r.lock().await, &mut wal, ipc.clone()).await?;
        }
    }
    let end = replicas[0].lock().await.disk_consistent_lsn();
    let part_files: Vec<(String, u64)> = {
        let r = replicas[0].lock().await;
        r.parts(1)
            .iter()
            .map(|p| (r.part_path(1, &p.name), p.bytes))
            .collect()
    };
    let total: u64 = part_files.iter().map(|(_, b)| b).sum();
    say!(
        "bench export: {} parts, {:.1} MiB in all",
        part_files.len(),
        total as f64 / 1048576.0
    );

    let mut destinations: Vec<(String, String, S3Settings)> = vec![(
        "local folder".into(),
        format!(
            "file://{}",
            std::path::absolute(dir.path())?.join("lake").display()
        ),
        S3Settings::default(),
    )];
    if let Some(endpoint) = &args.s3_endpoint {
        let bucket = format!(
            "ferry-bench-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or_default()
        );
        create_bucket(endpoint, &bucket).await?;
        destinations.push((
            "S3 (moto)".into(),
            format!("s3://{bucket}/lake"),
            S3Settings {
                endpoint: Some(endpoint.clone()),
                region: Some("us-east-1".into()),
                access_key_id: Some("test".into()),
                secret_access_key: Some("test".into()),
                ..S3Settings::default()
            },
        ));
    } else {
        say!(
            "bench export: no --s3-endpoint (or FERRY_TEST_S3_ENDPOINT): the S3 half does not run"
        );
    }

    let store =
        ferry_coord::embedded::EmbeddedStore::open(Arc::clone(&disk), "coord", Default::default())
            .await?;
    let metrics = Arc::new(CoordMetrics::default());
    let sessions: Arc<dyn SessionFactory> = Arc::new(EmbeddedSessions {
        store: store.clone(),
        timeout: Duration::from_secs(10),
        metrics: Arc::clone(&metrics),
    });
    let session = sessions.open().await?;
    ferry_coord::create_all(session.as_ref(), "/ferry/tables").await?;
    session
        .create(
            "/ferry/tables/bench",
            &serde_json::to_vec(&table())?,
            CreateMode::Persistent,
        )
        .await?;

    let formats: Vec<LakeFormat> = match args.format {
        LakeFormat::Parquet => vec![LakeFormat::Parquet],
        LakeFormat::Iceberg => vec![LakeFormat::Parquet, LakeFormat::Iceberg],
    };
    for (what, base_url, s3) in &destinations {
        for nodes in [1usize, 2] {
            let concurrency = nodes * args.parallelism as usize;
            // Raw: the same files read and written through object_store at
            // the same concurrency.
            let raw_url = format!("{base_url}/raw{nodes}");
            let raw = ferry_storage::open(&raw_url, s3)?;
            // Each timed phase starts with no dirty pages of the one before
            // (the kernel's write-back would slow whichever runs later).
            rustix::fs::sync();
            let started = Instant::now();
            let queue = Arc::new(std::sync::Mutex::new(part_files.clone()));
            let mut workers = Vec::new();
            for _ in 0..concurrency {
                let (queue, raw, disk) = (Arc::clone(&queue), raw.clone(), Arc::clone(&disk));
                workers.push(tokio::spawn(async move {
                    loop {
                        let next = queue.lock().ok().and_then(|mut q| q.pop());
                        let Some((path, len)) = next else {
                            return Ok::<_, anyhow::Error>(());
                        };
                        let key = path.rsplit('/').next().unwrap_or("part").to_string();
                        let mut upload = raw.upload(&key, Default::default()).await?;
                        let mut at = 0u64;
                        while at < len {
                            let n = (len - at).min(8 << 20) as usize;
                            let chunk = disk.read_range(&path, at, n).await?;
                            upload.write(Bytes::from(chunk)).await?;
                            at += n as u64;
                        }
                        upload.finish().await?;
                    }
                }));
            }
            for w in workers {
                w.await??;
            }
            let raw_secs = started.elapsed().as_secs_f64();

            // The export, to a Parquet destination and (with --format
            // iceberg) to an Iceberg table.
            let mut parquet_secs = None;
            for format in formats.iter().copied() {
                let url = format!("{base_url}/export{nodes}-{format}");
                let dests: Arc<dyn Destinations> = Arc::new(StorageDestinations::new(
                    s3.clone(),
                    ferry_storage::LocalRoots::new([dir.path().join("lake")])?,
                ));
                let mut views = Vec::new();
                let mut tasks = Vec::new();
                for (n, replica) in replicas.iter().take(nodes).enumerate() {
                    let parts: Arc<dyn LocalParts> =
                        Arc::new(ReplicaSet::new(vec![Arc::clone(replica)]));
                    let config = ExporterConfig::new(format!("bench{n}"));
                    let exporter = Exporter::new(
                        config,
                        Arc::clone(&sessions),
                        Arc::new(SystemClock),
                        Cpu::BlockingPool,
                        parts,
                        Arc::clone(&dests),
                    );
                    views.push(exporter.subscribe());
                    tasks.push(tokio::spawn(exporter.run()));
                }
                // Mirrors loaded before the clock starts.
                tokio::time::sleep(Duration::from_millis(200)).await;
                let requester_parts = ReplicaSet::new(vec![Arc::clone(&replicas[0])]);
                let before = metrics.snapshot().total_round_trips();
                rustix::fs::sync();
                let started = Instant::now();
                let created = Requester {
                    session: &session,
                    sessions: sessions.as_ref(),
                    parts: &requester_parts,
                    destinations: dests.as_ref(),
                    replica_name: "bench0",
                    now_unix_millis: ferry_env::Clock::unix_micros(&SystemClock) / 1000,
                    random: nodes as u64,
                    commit_lsn: end,
                    wait: Duration::from_secs(30),
                }
                .export(&ExportRequest {
                    table: "bench".into(),
                    partition_id: "x".into(),
                    destination: url.clone(),
                    force: true,
                    replace_finished: false,
                    by_policy: false,
                    settings: ExportSettings {
                        parallelism: args.parallelism,
                        format: Some(format),
                        ..ExportSettings::default()
                    },
                })
                .await
                .with_context(|| format!("exporting to {url}"))?;
                let request_secs = started.elapsed().as_secs_f64();
                let view = &mut views[0];
                let done = loop {
                    if let Some(t) = view.borrow_and_update().tasks.iter().find(|t| {
                        t.transaction_id == created.transaction_id && t.status.is_terminal()
                    }) {
                        break t.clone();
                    }
                    tokio::time::timeout(Duration::from_secs(600), view.changed())
                        .await
                        .context("the export took over 10 minutes")??;
                };
                let secs = started.elapsed().as_secs_f64();
                let trips = metrics.snapshot().total_round_trips() - before;
                anyhow::ensure!(
                    done.status == TaskStatus::Completed,
                    "the export ended {}",
                    done.status
                );
                let shares: Vec<u64> = views
                    .iter()
                    .map(|v| v.borrow().counters.parts_exported)
                    .collect();
                for t in tasks {
                    t.abort();
                }
                let mb = total as f64 / 1e6;
                let versus_parquet = match parquet_secs {
                    None => {
                        parquet_secs = Some(secs);
                        String::new()
                    }
                    Some(p) => format!(
                        "; {:.0}% of the Parquet destination's rate",
                        100.0 * p / secs
                    ),
                };
                say!(
                "bench export: {what}, {format}, {nodes} node(s) x {} parts at once: export {:.2} s (the request {:.0} ms of it) = {:.0} MB/s; raw object_store writes of the same files {:.2} s = {:.0} MB/s; ratio {:.0}%; {:.2} coordination round trips per part (all nodes, request and commit included); parts per node {shares:?}{versus_parquet}",
                args.parallelism,
                secs,
                request_secs * 1000.0,
                mb / secs,
                raw_secs,
                mb / raw_secs,
                100.0 * raw_secs / secs,
                trips as f64 / created.parts_count as f64
            );
                // The counters are per exporter run: restart them per row.
                let _ = shares;
            }
        }
    }
    session.close().await;
    store.shutdown().await;
    if args.format == LakeFormat::Iceberg {
        for (what, base_url, s3) in &destinations {
            commit_latency(what, base_url, s3, &args.commit_partitions).await?;
        }
    }
    Ok(())
}

/// Iceberg commits of `n` partitions at once (one data file each), for each
/// n of `rounds`: the time until all are committed, per snapshot, and what
/// each committer waited. Twice: as `n` committers of as many nodes, every
/// one racing the others for the next metadata version (a loser tries again
/// on top of the winner), and as one node's commits through its
/// `CommitQueue` (those waiting share the next version).
async fn commit_latency(
    what: &str,
    base_url: &str,
    s3: &S3Settings,
    rounds: &[usize],
) -> anyhow::Result<()> {
    let def = table().def;
    for n in rounds.iter().copied().filter(|n| *n > 0) {
        for queued in [false, true] {
            let how = if queued { "queued" } else { "racing" };
            let url = format!("{base_url}/commits{n}-{how}");
            let iceberg = ferry_iceberg::IcebergTable::new(ferry_storage::open(&url, s3)?);
            let queue = Arc::new(ferry_iceberg::CommitQueue::new());
            let started = Instant::now();
            let mut committers = Vec::new();
            for i in 0..n {
                let (iceberg, def, queue) = (iceberg.clone(), def.clone(), Arc::clone(&queue));
                committers.push(tokio::spawn(async move {
                    let partition_id = format!("p{i}");
                    let partition = ferry_iceberg::PartitionValue::of(&def, &partition_id)?;
                    let commit = ferry_iceberg::Commit {
                        transaction_id: format!("1700000000000-{i:016x}"),
                        sequence: 1,
                        create_time: 1_700_000_000,
                        content_id: format!("content-{i}"),
                        snapshot_lsn: 0,
                        partition_id: partition_id.clone(),
                        files: vec![ferry_iceberg::DataFileEntry::with_stats(
                            format!("data/p={partition_id}/part.parquet"),
                            partition,
                            ferry_iceberg::FileStats {
                                record_count: 1000,
                                file_size_in_bytes: 30_000,
                                ..Default::default()
                            },
                        )],
                        timestamp_ms: 1_700_000_000_000,
                    };
                    loop {
                        let result = if queued {
                            queue.commit(&iceberg, &def, commit.clone()).await
                        } else {
                            iceberg.commit(&def, &commit).await
                        };
                        match result {
                            Ok(_) => return Ok::<_, anyhow::Error>(started.elapsed()),
                            Err(e) if e.is_retryable() => continue,
                            Err(e) => return Err(e.into()),
                        }
                    }
                }));
            }
            let mut latencies = Vec::new();
            for c in committers {
                latencies.push(c.await??);
            }
            let secs = started.elapsed().as_secs_f64();
            latencies.sort();
            let median = latencies[latencies.len() / 2].as_secs_f64();
            let max = latencies.last().map_or(0.0, |l| l.as_secs_f64());
            let versions = iceberg.current().await?.map_or(0, |(v, _)| v);
            say!(
                "bench export: {what}, Iceberg commits of {n} partition(s) at once, {how}: all in {:.3} s = {:.1} ms per snapshot, {versions} metadata versions; each committer waited {:.1} ms (median), {:.1} ms (longest)",
                secs,
                1000.0 * secs / n as f64,
                1000.0 * median,
                1000.0 * max
            );
        }
    }
    Ok(())
}
