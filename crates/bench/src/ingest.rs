//! `ferry bench ingest`: rows through HTTP into committed WAL, for NDJSON and
//! for Arrow IPC, next to what bounds them, measured in the same run on the
//! same bytes: arrow-json's decode rate alone, arrow-ipc's decode rate alone,
//! and the WAL quorum's own throughput for records of the same size.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use arrow::array::{
    BooleanArray, Date32Array, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use bytes::Bytes;
use ferry_table::{Format, TableDef};

#[derive(Debug, clap::Args)]
pub struct IngestBenchArgs {
    /// Directory for the data (WAL, coordination). Default: a temporary
    /// directory inside the working folder (so the figures are for this disk).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Rows of each run.
    #[arg(long, default_value_t = 1_000_000)]
    rows: usize,
    /// Rows per insert request.
    #[arg(long, default_value_t = 50_000)]
    rows_per_request: usize,
    /// Insert requests in flight.
    #[arg(long, default_value_t = 4)]
    in_flight: usize,
    /// Shards of the table (rows are split by the shard key).
    #[arg(long, default_value_t = 1)]
    shards: u32,
    /// Instead: the rows as NDJSON, CSV, Arrow IPC and Parquet files,
    /// loaded into ClickHouse (chDB) and with `ferry insert` into `ferry
    /// dev` (2 replicas, then 1), side by side; prints rows/s, rows per
    /// CPU-second (process CPU from the OS) and peak memory, and the ratios.
    #[arg(long)]
    vs_clickhouse: bool,
    /// With --vs-clickhouse: the Python that has chDB. Default: the
    /// checkout's .venv (scripts/test.sh installs it there), else python3.
    #[arg(long, requires = "vs_clickhouse")]
    python: Option<std::path::PathBuf>,
    /// With --vs-clickhouse: the formats, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ndjson,csv,arrow,parquet",
        requires = "vs_clickhouse"
    )]
    formats: Vec<String>,
}

const TABLE: &str = r#"
name = "bench"
partition_by = { column = "ts", transform = "day" }
shard_by = { column = "id", shards = SHARDS }
[[columns]]
name = "id"
type = "Int64"
[[columns]]
name = "user_id"
type = "Int64"
[[columns]]
name = "amount"
type = "Float64"
[[columns]]
name = "ok"
type = "Boolean"
[[columns]]
name = "name"
type = "Utf8"
[[columns]]
name = "day"
type = "Date"
[[columns]]
name = "ts"
type = "Timestamp"
[[columns]]
name = "code"
type = "Int32"
[[columns]]
name = "note"
type = "Utf8"
nullable = true
[[columns]]
name = "score"
type = "Float64"
nullable = true
"#;

/// Rows `start..start + n` of the benchmark table (10 columns).
fn batch(def: &TableDef, start: usize, n: usize) -> anyhow::Result<RecordBatch> {
    let ids: Vec<i64> = (start..start + n).map(|i| i as i64).collect();
    let ts0 = 1_717_200_000_000_000i64; // 2024-06-01
    Ok(RecordBatch::try_new(
        def.arrow_schema(),
        vec![
            Arc::new(Int64Array::from(ids.clone())),
            Arc::new(Int64Array::from_iter_values(ids.iter().map(|i| i % 10_007))),
            Arc::new(Float64Array::from_iter_values(
                ids.iter().map(|i| *i as f64 * 0.25),
            )),
            Arc::new(BooleanArray::from_iter(
                ids.iter().map(|i| Some(i % 3 == 0)),
            )),
            Arc::new(StringArray::from_iter_values(
                ids.iter().map(|i| format!("user-{}", i % 5000)),
            )),
            Arc::new(Date32Array::from_iter_values(
                ids.iter().map(|i| 19_875 + (i % 30) as i32),
            )),
            Arc::new(
                TimestampMicrosecondArray::from_iter_values(
                    ids.iter().map(|i| ts0 + i * 1_000_003),
                )
                .with_timezone(ferry_table::def::UTC),
            ),
            Arc::new(Int32Array::from_iter_values(
                ids.iter().map(|i| (i % 1000) as i32),
            )),
            Arc::new(StringArray::from_iter(
                ids.iter()
                    .map(|i| (i % 4 != 0).then(|| format!("note number {i}"))),
            )),
            Arc::new(Float64Array::from_iter(
                ids.iter().map(|i| (i % 5 != 0).then_some(*i as f64 / 7.0)),
            )),
        ],
    )?)
}

fn to_ndjson(batch: &RecordBatch) -> anyhow::Result<Bytes> {
    let mut out = Vec::new();
    {
        let mut w = arrow::json::LineDelimitedWriter::new(&mut out);
        w.write(batch)?;
        w.finish()?;
    }
    Ok(Bytes::from(out))
}

/// CPU time this process used so far (user + system), from /proc (Linux);
/// `None` where it cannot be read.
fn process_cpu_seconds() -> Option<f64> {
    crate::dev_process::cpu_seconds(std::process::id())
}

fn mb_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / 1e6 / d.as_secs_f64().max(1e-9)
}

fn rows_s(rows: usize, d: Duration) -> f64 {
    rows as f64 / d.as_secs_f64().max(1e-9)
}

/// Decodes every body with the plain Arrow reader (one thread), as the bound of
/// the insert path's decoding.
fn decode_alone(
    schema: &arrow::datatypes::SchemaRef,
    format: Format,
    bodies: &[Bytes],
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let mut rows = 0;
    for b in bodies {
        match format {
            Format::Ndjson => {
                let reader = arrow::json::ReaderBuilder::new(Arc::clone(schema))
                    .with_batch_size(64 * 1024)
                    .build(std::io::Cursor::new(b))?;
                for batch in reader {
                    rows += batch?.num_rows();
                }
            }
            _ => {
                for batch in
                    arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(b), None)?
                {
                    rows += batch?.num_rows();
                }
            }
        }
    }
    anyhow::ensure!(rows > 0, "decoded nothing");
    Ok(start.elapsed())
}

/// Sends every body as an insert, `in_flight` at a time; returns the wall time.
async fn insert_all(
    client: &ferry_client::Client,
    format: Format,
    bodies: &[Bytes],
    in_flight: usize,
    run: &'static str,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let bodies = Arc::new(bodies.to_vec());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..in_flight.max(1) {
        let (client, next, bodies) = (client.clone(), Arc::clone(&next), Arc::clone(&bodies));
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(body) = bodies.get(i) else {
                    return Ok(());
                };
                client
                    .insert_body("bench", format, body.clone(), Some(&format!("{run}-{i}")))
                    .await?;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.context("insert task")?
            .map_err(|e: ferry_client::ClientError| anyhow::anyhow!(e))?;
    }
    Ok(start.elapsed())
}

/// Appends raw insert records carrying `payloads`, `in_flight` at a time: the
/// WAL quorum's throughput for the same bytes, without HTTP or decoding.
async fn wal_alone(
    writer: &Arc<ferry_writer::driver::Writer>,
    payloads: &[Bytes],
    in_flight: usize,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let payloads = Arc::new(payloads.to_vec());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..in_flight.max(1) {
        let (w, next, payloads) = (Arc::clone(writer), Arc::clone(&next), Arc::clone(&payloads));
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(p) = payloads.get(i) else {
                    return Ok(());
                };
                w.insert(vec![ferry_writer::driver::Insert {
                    table_id: 99,
                    shard: 0,
                    idempotency_key: Bytes::new(),
                    rows: ferry_writer::driver::InsertRows::ArrowIpc(p.clone()),
                }])
                .await?;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.context("append task")?
            .map_err(|e: ferry_writer::driver::WriterError| anyhow::anyhow!(e))?;
    }
    Ok(start.elapsed())
}

/// The floor for applying: the same rows written as a replica writes them (one
/// zstd Parquet file per insert and partition, fsynced), in one thread, with
/// nothing else: no WAL, no network.
fn raw_parquet_write(
    def: &TableDef,
    ipc: &[Bytes],
    dir: &std::path::Path,
) -> anyhow::Result<Duration> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir)?;
    let schema = def.arrow_schema();
    let pidx = def
        .column_index(&def.partition_by.column)
        .context("partition column")?;
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::ZSTD(
            parquet::basic::ZstdLevel::try_new(1)?,
        ))
        .build();
    let started = Instant::now();
    for (i, body) in ipc.iter().enumerate() {
        for batch in ferry_table::rows::from_ipc(body)? {
            let ids = ferry_table::keys::partition_ids(def, batch.column(pidx))
                .map_err(|(row, e)| anyhow::anyhow!("row {row}: {e}"))?;
            let mut groups: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
            for (row, id) in ids.iter().enumerate() {
                groups.entry(id.as_str()).or_default().push(row as u32);
            }
            for (id, rows) in groups {
                let part = arrow::compute::take_record_batch(
                    &batch,
                    &arrow::array::UInt32Array::from(rows),
                )?;
                let mut out = Vec::new();
                let mut w = parquet::arrow::ArrowWriter::try_new(
                    &mut out,
                    Arc::clone(&schema),
                    Some(props.clone()),
                )?;
                w.write(&part)?;
                w.close()?;
                let mut f = std::fs::File::create(dir.join(format!("{id}_{i}.parquet")))?;
                f.write_all(&out)?;
                f.sync_data()?;
            }
        }
    }
    Ok(started.elapsed())
}

pub async fn ingest(args: IngestBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rows > 0 && args.rows_per_request > 0,
        "--rows and --rows-per-request must be positive"
    );
    let def = TableDef::from_toml(&TABLE.replace("SHARDS", &args.shards.to_string()))?;
    if args.vs_clickhouse {
        let formats = args
            .formats
            .iter()
            .map(|f| Format::from_name(f).with_context(|| format!("unknown format {f:?}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        return crate::vs_clickhouse::run(
            &def,
            args.rows,
            args.dir.as_deref(),
            args.python.as_deref(),
            &formats,
            batch,
        )
        .await;
    }
    let schema = def.arrow_schema();
    say!("generating {} rows of 10 columns...", args.rows);
    let mut ndjson = Vec::new();
    let mut ipc = Vec::new();
    let mut start = 0;
    while start < args.rows {
        let n = args.rows_per_request.min(args.rows - start);
        let b = batch(&def, start, n)?;
        ndjson.push(to_ndjson(&b)?);
        ipc.push(ferry_table::rows::to_ipc(&b)?);
        start += n;
    }
    let ndjson_bytes: usize = ndjson.iter().map(Bytes::len).sum();
    let ipc_bytes: usize = ipc.iter().map(Bytes::len).sum();

    // The bounds, alone, on the same bytes.
    let json_alone = decode_alone(&schema, Format::Ndjson, &ndjson)?;
    let ipc_alone = decode_alone(&schema, Format::Arrow, &ipc)?;

    // A fresh node: embedded coordination, three safekeepers, the API on loopback.
    let root = crate::wal::scratch_dir(args.dir.as_deref(), "ferry-bench-ingest-")?;
    let disk = Arc::new(ferry_env::RealDisk::open_root(root.path())?);
    let store =
        ferry_coord::embedded::EmbeddedStore::open(disk, "coord", Default::default()).await?;
    let sessions = Arc::new(ferry_coord::EmbeddedSessions {
        store: store.clone(),
        timeout: Duration::from_secs(10),
        metrics: Default::default(),
    });
    // With a WAL backup, as in production: the third replica below starts
    // after the first two let the safekeepers remove old segments, and reads
    // them back from the backup.
    let backup = ferry_host::paths::absolute(&root.path().join("wal-backup"))?;
    std::fs::create_dir_all(&backup)?;
    let quorum = crate::wal::fresh_quorum(
        root.path(),
        "wal",
        3,
        true,
        &crate::wal::QuorumOptions {
            backup: Some(backup),
            ..Default::default()
        },
    )
    .await?;
    let catalog = ferry_ingest::Catalog::open(sessions).await?;
    let mut registry = prometheus_client::registry::Registry::default();
    let api = ferry_ingest::Api::new(
        catalog,
        Arc::clone(&quorum.writer) as Arc<dyn ferry_ingest::InsertSink>,
        ferry_env::Cpu::BlockingPool,
        ferry_ingest::ApiLimits {
            max_body_bytes: 1 << 30,
            max_rows: usize::MAX,
            ..Default::default()
        },
        ferry_ingest::IngestMetrics::register(&mut registry),
    );
    let listener = ferry_host::http::bind("127.0.0.1:0").await?;
    let server = ferry_host::http::serve(listener, ferry_ingest::api::router(api), None)?;
    let client = ferry_client::Client::new(
        &format!("http://{}", server.addr),
        None,
        Duration::from_secs(300),
    )?;
    client.create_table(&def).await?;

    // Warm up (page cache, connections), then measure.
    insert_all(
        &client,
        Format::Arrow,
        &ipc[..1.min(ipc.len())],
        1,
        "warm-up",
    )
    .await?;
    let json_e2e = insert_all(&client, Format::Ndjson, &ndjson, args.in_flight, "json").await?;
    let ipc_e2e = insert_all(&client, Format::Arrow, &ipc, args.in_flight, "ipc").await?;
    let after_json: ferry_wal::Lsn = quorum
        .writer
        .status()
        .commit_lsn
        .parse()
        .map_err(|e: String| anyhow::anyhow!(e))?;

    // Replica 0 starts now, alone, without its merge task: applying the WAL
    // of both runs (2 x rows) is the apply rate. Then its merges start,
    // replica 1 catches up, and the third run goes from HTTP to parts on both.
    // The merge rate comes last, from a third replica.
    let safekeepers: Vec<String> = quorum.addrs.clone();
    let replica_disk: Arc<dyn ferry_env::Disk> =
        Arc::new(ferry_env::RealDisk::open_root(root.path())?);
    let tables: Arc<dyn ferry_replica::Tables> = Arc::new(ferry_host::reads::CatalogTables(
        ferry_ingest::Catalog::open(Arc::new(ferry_coord::EmbeddedSessions {
            store: store.clone(),
            timeout: Duration::from_secs(10),
            metrics: Default::default(),
        }))
        .await?,
    ));
    let mut replicas = Vec::new();
    let mut tasks = Vec::new();
    let start_replica = |r: u32| {
        let disk = Arc::clone(&replica_disk);
        let tables = Arc::clone(&tables);
        let config = ferry_replica::StreamConfig::new(safekeepers.clone());
        async move {
            let replica = ferry_replica::Replica::open(
                disk,
                &format!("replica{r}"),
                ferry_replica::ALL_SHARDS,
                r,
                ferry_env::Cpu::BlockingPool,
                tables,
            )
            .await?;
            let shared: ferry_replica::SharedReplica = Arc::new(tokio::sync::Mutex::new(replica));
            let task = tokio::spawn({
                let shared = Arc::clone(&shared);
                async move {
                    let e = ferry_replica::stream::run(
                        shared,
                        Arc::new(ferry_env::TcpNetwork),
                        Arc::new(ferry_env::SystemClock),
                        config,
                    )
                    .await;
                    tracing::error!(error = %e, "bench replica stopped");
                }
            });
            Ok::<_, anyhow::Error>((shared, task))
        }
    };
    let start_merges = |shared: &ferry_replica::SharedReplica| {
        let shared = Arc::clone(shared);
        tokio::spawn(async move {
            let e = ferry_replica::run_merges(shared, Duration::from_secs(60)).await;
            tracing::error!(error = %e, "bench replica merges stopped");
        })
    };
    let wait_applied = |replicas: Vec<ferry_replica::SharedReplica>,
                        lsn: ferry_wal::Lsn,
                        settled: bool| async move {
        for r in &replicas {
            let mut status = r.lock().await.subscribe();
            status
                .wait_for(|s| {
                    s.error.is_some()
                        || (s.disk_consistent_lsn >= lsn && (!settled || s.pending_merges == 0))
                })
                .await?;
            let error = status.borrow().error.clone();
            if let Some(e) = error {
                anyhow::bail!("a replica stopped: {e}");
            }
        }
        Ok::<_, anyhow::Error>(())
    };

    let apply_started = Instant::now();
    let (first, task) = start_replica(0).await?;
    tasks.push(task);
    replicas.push(Arc::clone(&first));
    wait_applied(vec![Arc::clone(&first)], after_json, false).await?;
    let apply_alone = apply_started.elapsed();
    tasks.push(start_merges(&first));
    let (second, task) = start_replica(1).await?;
    tasks.push(task);
    tasks.push(start_merges(&second));
    replicas.push(second);
    wait_applied(replicas.clone(), after_json, true).await?;

    // Arrow IPC through HTTP (the same rows again, new keys) until both
    // replicas applied it.
    let e2e_started = Instant::now();
    let e2e_cpu_started = process_cpu_seconds();
    insert_all(&client, Format::Arrow, &ipc, args.in_flight, "parts").await?;
    let after_ipc: ferry_wal::Lsn = quorum
        .writer
        .status()
        .commit_lsn
        .parse()
        .map_err(|e: String| anyhow::anyhow!(e))?;
    wait_applied(replicas.clone(), after_ipc, false).await?;
    let to_parts = e2e_started.elapsed();
    let e2e_cpu = e2e_cpu_started
        .zip(process_cpu_seconds())
        .map(|(a, b)| b - a);
    let settle_started = Instant::now();
    wait_applied(replicas.clone(), after_ipc, true).await?;
    let merge_settle = settle_started.elapsed();
    let mut merges_done = 0;
    for r in &replicas {
        merges_done += r.lock().await.subscribe().borrow().merges_done;
    }
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
    drop(replicas);
    drop(first);

    // Merges alone: a third replica applies the WAL of all three runs without
    // merging, then its merges run with nothing else running.
    let (third, task) = start_replica(2).await?;
    wait_applied(vec![Arc::clone(&third)], after_ipc, false).await?;
    task.abort();
    let _ = task.await;
    let merges_started = Instant::now();
    let merges = start_merges(&third);
    wait_applied(vec![Arc::clone(&third)], after_ipc, true).await?;
    let merges_alone = merges_started.elapsed();
    merges.abort();
    let _ = merges.await;
    let (merged_rows, merged_bytes, merges_alone_done) = {
        let status = third.lock().await.subscribe().borrow().clone();
        (status.merged_rows, status.merged_bytes, status.merges_done)
    };
    drop(third);
    let raw_parquet = raw_parquet_write(&def, &ipc, &root.path().join("raw"))?;
    let wal = wal_alone(&quorum.writer, &ipc, args.in_flight).await?;
    server.stop().await;
    crate::wal::stop_quorum(quorum).await?;
    store.shutdown().await;

    let rows = args.rows;
    say!(
        "ingest, {rows} rows x 10 columns, {} rows per request, {} in flight, {} shard(s); NDJSON {:.1} MB, Arrow IPC {:.1} MB",
        args.rows_per_request,
        args.in_flight,
        args.shards,
        ndjson_bytes as f64 / 1e6,
        ipc_bytes as f64 / 1e6
    );
    say!("| path | time | rows/s | MB/s of its body |");
    say!("|---|---|---|---|");
    for (name, d, bytes) in [
        (
            "NDJSON through HTTP into committed WAL",
            json_e2e,
            ndjson_bytes,
        ),
        (
            "arrow-json decode alone (1 thread)",
            json_alone,
            ndjson_bytes,
        ),
        (
            "Arrow IPC through HTTP into committed WAL",
            ipc_e2e,
            ipc_bytes,
        ),
        ("arrow-ipc decode alone (1 thread)", ipc_alone, ipc_bytes),
        (
            "WAL quorum alone, same IPC bytes as records",
            wal,
            ipc_bytes,
        ),
    ] {
        say!(
            "| {name} | {:.3} s | {:.0} | {:.1} |",
            d.as_secs_f64(),
            rows_s(rows, d),
            mb_s(bytes, d)
        );
    }
    say!(
        "| Arrow IPC through HTTP until both replicas applied it as parts | {:.3} s | {:.0} | {:.1} |",
        to_parts.as_secs_f64(),
        rows_s(rows, to_parts),
        mb_s(ipc_bytes, to_parts)
    );
    say!(
        "| 1 replica applying both runs' {} rows from the WAL, alone (no merges, nothing else running) | {:.3} s | {:.0} | - |",
        2 * rows,
        apply_alone.as_secs_f64(),
        rows_s(2 * rows, apply_alone)
    );
    say!(
        "| merges alone (a replica that applied all three runs without merging): {merges_alone_done} merges, {merged_rows} rows into {:.1} MB of parts | {:.3} s | {:.0} | {:.1} (written) |",
        merged_bytes as f64 / 1e6,
        merges_alone.as_secs_f64(),
        rows_s(merged_rows as usize, merges_alone),
        mb_s(merged_bytes as usize, merges_alone)
    );
    say!(
        "| raw Parquet write of the same rows (zstd, one file per insert and partition, fsync; 1 thread) | {:.3} s | {:.0} | {:.1} |",
        raw_parquet.as_secs_f64(),
        rows_s(rows, raw_parquet),
        mb_s(ipc_bytes, raw_parquet)
    );
    say!(
        "merges during the third run: {merges_done} done by the 2 replicas in all, settled {:.3} s after the last insert was applied",
        merge_settle.as_secs_f64()
    );
    let raw_rate = rows_s(rows, raw_parquet);
    say!(
        "insert to applied parts on 2 replicas = {:.0}% of the raw Parquet write rate (goal at least 50%)",
        100.0 * rows_s(rows, to_parts) / raw_rate
    );
    if let Some(cpu) = e2e_cpu {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        say!(
            "  (that run kept {:.2} of this machine's {cores} cores busy: {cpu:.2} CPU-seconds in {:.2} s for the writer, 3 safekeepers and 2 replicas; the raw write used 1 core)",
            cpu / to_parts.as_secs_f64(),
            to_parts.as_secs_f64()
        );
    }
    say!(
        "replica apply = {:.0}% of the raw Parquet write rate (goal at least 80%)",
        100.0 * rows_s(2 * rows, apply_alone) / raw_rate
    );
    say!(
        "merges = {:.0}% of the raw Parquet write rate (rows read, merged and written per second)",
        100.0 * rows_s(merged_rows as usize, merges_alone) / raw_rate
    );
    let json_ratio = json_alone.as_secs_f64() / json_e2e.as_secs_f64();
    let ipc_ratio = wal.as_secs_f64() / ipc_e2e.as_secs_f64();
    say!(
        "NDJSON end to end = {:.0}% of arrow-json's decode rate (goal at least 60%)",
        json_ratio * 100.0
    );
    say!(
        "Arrow IPC end to end = {:.0}% of the WAL quorum's throughput for the same bytes (goal at least 70%)",
        ipc_ratio * 100.0
    );
    Ok(())
}
