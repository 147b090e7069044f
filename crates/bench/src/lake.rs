//! `ferry bench lake`: a table that exports itself, end to end through a
//! `ferry dev` process: a steady insert stream and how long each
//! acknowledged batch takes to be readable in the lake (in the partition's
//! current commit), next to the freshness target; then insert throughput
//! with the export policy off and on (the same work, the policy's the only
//! difference); then the idle partition's compaction (files before and
//! after) and its retention (how long until it leaves the replicas).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferry_client::Client;
use ferry_table::Format;

use crate::dev_process::Dev;

#[derive(Debug, clap::Args)]
pub struct LakeBenchArgs {
    /// Directory for `ferry dev`'s data dir. Default: a temporary directory
    /// inside the working folder.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Seconds of the steady insert stream whose lake latency is measured.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// The tables' freshness target, in seconds.
    #[arg(long, default_value_t = 10)]
    freshness_secs: u64,
    /// Rows per second of the steady stream.
    #[arg(long, default_value_t = 20_000)]
    rate: u64,
    /// Seconds flat out into each table (policy off and on), in two runs
    /// each, in the order off, on, on, off, each after the replicas' merges
    /// settled: neither table pays for the other's background merges more.
    #[arg(long, default_value_t = 20)]
    throughput_seconds: u64,
    /// Rows per insert request of the flat-out runs.
    #[arg(long, default_value_t = 5_000)]
    rows_per_request: u64,
    /// Insert requests in flight in the flat-out runs.
    #[arg(long, default_value_t = 4)]
    in_flight: usize,
    /// `ferry dev --lake-target-file-mib`: the size compaction aims at.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=16384))]
    lake_target_file_mib: u64,
    /// `ferry dev --max-replication-flush-lag` in MiB (0: none): inserts
    /// wait while a replica's durable parts are this far behind the WAL, so
    /// the flat-out runs measure what the replicas (and so the policy) keep
    /// up with, not acknowledgements minutes ahead of them.
    #[arg(long, default_value_t = 64)]
    max_replication_flush_lag_mib: u64,
}

/// Tables `name`: `id` Int64 sharded 2 ways, partitioned by `p` (Utf8).
fn table_toml(name: &str, export: Option<(&str, u64)>) -> String {
    let mut t = format!(
        "name = \"{name}\"\npartition_by = {{ column = \"p\", transform = \"identity\" }}\n\
         shard_by = {{ column = \"id\", shards = 2 }}\n\
         [[columns]]\nname = \"id\"\ntype = \"Int64\"\n\
         [[columns]]\nname = \"p\"\ntype = \"Utf8\"\n\
         [[columns]]\nname = \"note\"\ntype = \"Utf8\"\n"
    );
    if let Some((to, freshness)) = export {
        t += &format!("\n[export]\nto = \"{to}\"\nfreshness = \"{freshness}s\"\n");
    }
    t
}

/// NDJSON rows `first..first + n` of partition `p`.
fn rows(first: u64, n: u64, partition: &str) -> Bytes {
    let mut out = String::with_capacity(n as usize * 64);
    for id in first..first + n {
        out += &format!(
            "{{\"id\":{id},\"p\":\"{partition}\",\"note\":\"row {id} of the lake benchmark\"}}\n"
        );
    }
    Bytes::from(out)
}

/// Rows per second acknowledged by `in_flight` concurrent inserters into
/// `table` for `seconds`, over `partitions` partitions.
async fn flat_out(
    c: &Client,
    table: &str,
    args: &LakeBenchArgs,
    seconds: f64,
    first_id: u64,
) -> anyhow::Result<(u64, f64)> {
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let next = Arc::new(std::sync::atomic::AtomicU64::new(first_id));
    let mut tasks = Vec::new();
    for _ in 0..args.in_flight.max(1) {
        let (c, next, table) = (c.clone(), Arc::clone(&next), table.to_string());
        let n = args.rows_per_request.max(1);
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            while Instant::now() < until {
                let first = next.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                let partition = format!("p{}", (first / n) % 4);
                c.insert_body(&table, Format::Ndjson, rows(first, n, &partition), None)
                    .await?;
                done += n;
            }
            anyhow::Ok(done)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok((total, started.elapsed().as_secs_f64()))
}

/// Waits (up to 120 s) until no replica has a merge pending, twice in a row
/// 200 ms apart; says so if they never settle.
async fn merges_settled(c: &Client) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut quiet = 0;
    while quiet < 2 {
        let pending = c.pending_merges().await?;
        quiet = if pending == 0 { quiet + 1 } else { 0 };
        if Instant::now() > deadline {
            say!("merges: {pending} still pending after 120 s; the run starts anyway");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub async fn lake(args: LakeBenchArgs) -> anyhow::Result<()> {
    let dir = crate::wal::scratch_dir(args.dir.as_deref(), "ferry-bench-lake-")?;
    // Absolute: the lake's file:// URLs are made from it.
    let data = std::path::absolute(dir.path())?.join("dev");
    let dev = Dev::start(
        &data,
        &[
            "--lake-target-file-mib".to_string(),
            args.lake_target_file_mib.to_string(),
            "--max-replication-flush-lag".to_string(),
            (args.max_replication_flush_lag_mib << 20).to_string(),
        ],
    )?;
    let c = Client::new(&dev.url, None, Duration::from_secs(120))?;
    let lake_url = |t: &str| format!("file://{}", data.join("lake").join(t).display());
    let freshness = args.freshness_secs.max(1);
    say!(
        "bench lake: ferry dev at {}; freshness target {freshness}s; inserts wait while a replica is more than {} MiB behind{}",
        dev.url,
        args.max_replication_flush_lag_mib,
        if args.max_replication_flush_lag_mib == 0 { " (no limit)" } else { "" }
    );

    // Latency: a steady stream into one partition; the lake holds a prefix
    // (by LSN) of its rows, so the current commit's row count tells which
    // acknowledged batches are readable.
    c.create_table_toml(&table_toml("lat", Some((&lake_url("lat"), freshness))))
        .await?;
    let location = ferry_storage::open(&lake_url("lat"), &ferry_storage::S3Settings::default())?;
    let per_tick = (args.rate / 10).max(1);
    let mut acked: Vec<(u64, Instant)> = Vec::new();
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut inserted = 0u64;
    let mut visible: Vec<Option<Instant>> = Vec::new();
    let mut lake_rows = 0u64;
    let mut polled = Instant::now();
    while started.elapsed() < Duration::from_secs(args.seconds) {
        tick.tick().await;
        c.insert_body("lat", Format::Ndjson, rows(inserted, per_tick, "a"), None)
            .await?;
        inserted += per_tick;
        acked.push((inserted, Instant::now()));
        visible.push(None);
        if polled.elapsed() >= Duration::from_millis(100) {
            lake_rows = current_rows(&location).await?;
            polled = Instant::now();
            mark(&acked, &mut visible, lake_rows);
        }
    }
    let drain = Instant::now() + Duration::from_secs(4 * freshness + 30);
    while lake_rows < inserted && Instant::now() < drain {
        tokio::time::sleep(Duration::from_millis(50)).await;
        lake_rows = current_rows(&location).await?;
        mark(&acked, &mut visible, lake_rows);
    }
    let mut latencies: Vec<f64> = acked
        .iter()
        .zip(&visible)
        .filter_map(|((_, at), seen)| seen.map(|s| s.duration_since(*at).as_secs_f64()))
        .collect();
    latencies.sort_by(f64::total_cmp);
    let missing = acked.len() - latencies.len();
    let (p50, p99, max) = (
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or(0.0),
    );
    say!(
        "acknowledged -> readable in the lake, {} batches at {} rows/s for {} s: p50 {p50:.2} s, p99 {p99:.2} s, max {max:.2} s; p99 is {:.2}x the {freshness}s target (goal <= 2x){}",
        acked.len(),
        args.rate,
        args.seconds,
        p99 / freshness as f64,
        if missing > 0 {
            format!("; {missing} batches not readable within the drain")
        } else {
            String::new()
        }
    );
    let last_insert = Instant::now();
    let before = files_of(&location).await?;

    // Throughput: the same inserts, without and with a policy exporting
    // the table as they come.
    c.create_table_toml(&table_toml("off", None)).await?;
    c.create_table_toml(&table_toml("on", Some((&lake_url("on"), freshness))))
        .await?;
    let mut totals = std::collections::BTreeMap::<&str, (u64, f64)>::new();
    let half = args.throughput_seconds as f64 / 2.0;
    for (i, table) in ["off", "on", "on", "off"].into_iter().enumerate() {
        merges_settled(&c).await?;
        let (rows, secs) = flat_out(&c, table, &args, half, i as u64 * 1_000_000_000).await?;
        let t = totals.entry(table).or_default();
        t.0 += rows;
        t.1 += secs;
    }
    let rate = |t: &str| totals.get(t).map_or(0.0, |(r, s)| *r as f64 / s.max(1e-9));
    let (off, on) = (rate("off"), rate("on"));
    say!(
        "inserts, {} s flat out per table (off, on, on, off), {} in flight x {} rows: policy off {off:.0} rows/s, on {on:.0} rows/s: {:.0}% (goal >= 90%)",
        args.throughput_seconds,
        args.in_flight,
        args.rows_per_request,
        100.0 * on / off.max(1.0)
    );

    compaction(&location, &args, freshness, before, last_insert).await?;
    retention(&c, &lake_url("lat"), freshness).await?;
    drop(dev);
    Ok(())
}

/// Files of partition `a`'s current commit, and what they weigh per shard.
struct CurrentFiles {
    files: usize,
    bytes_per_shard: std::collections::BTreeMap<Option<u32>, u64>,
}

impl CurrentFiles {
    /// Files the partition holds once compacted: each shard's bytes in
    /// files of at most the target (a shard's rows are never merged with
    /// another's).
    fn compacted(&self, target_bytes: u64) -> usize {
        self.bytes_per_shard
            .values()
            .map(|b| b.div_ceil(target_bytes.max(1)).max(1) as usize)
            .sum()
    }
}

async fn files_of(location: &ferry_storage::Location) -> anyhow::Result<CurrentFiles> {
    let view = ferry_export::lake::read(location, Some("a")).await?;
    let mut bytes_per_shard = std::collections::BTreeMap::new();
    let mut files = 0;
    if let Some(p) = view.partitions.first() {
        files = p.current.file.files.len();
        for f in &p.current.file.files {
            *bytes_per_shard.entry(f.shard).or_insert(0) += f.bytes;
        }
    }
    Ok(CurrentFiles {
        files,
        bytes_per_shard,
    })
}

/// Waits for the latency stream's partition, idle since `last_insert`, to
/// be compacted in the lake, and prints its files before and after.
async fn compaction(
    location: &ferry_storage::Location,
    args: &LakeBenchArgs,
    freshness: u64,
    before: CurrentFiles,
    last_insert: Instant,
) -> anyhow::Result<()> {
    let target = args.lake_target_file_mib << 20;
    let idle = ferry_export::policy::compaction_idle(freshness);
    let want = before.compacted(target);
    let deadline = last_insert + idle + Duration::from_secs(4 * freshness + 60);
    let mut after = files_of(location).await?;
    while after.files > want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after = files_of(location).await?;
    }
    let took = last_insert.elapsed().as_secs_f64();
    say!(
        "files in the partition's current commit: {} as inserts end, {} after compaction ({} expected at {} MiB per file; the partition goes idle after {} s){}",
        before.files,
        after.files,
        want,
        args.lake_target_file_mib,
        idle.as_secs(),
        if before.files <= want {
            "; nothing to compact".to_string()
        } else if after.files > want {
            format!("; not compacted {took:.0} s after the last insert")
        } else {
            format!("; compacted {took:.1} s after the last insert")
        }
    );
    Ok(())
}

/// Sets a retention of a second on the latency stream's table, whose rows
/// the lake holds, and prints how long its partition takes to leave the
/// replicas and what they held of it.
async fn retention(c: &Client, lake_url: &str, freshness: u64) -> anyhow::Result<()> {
    let local = c.partitions("lat", 0).await?;
    let bytes: u64 = local
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["partition_id"] == "a")
        .filter_map(|p| p["bytes"].as_u64())
        .sum();
    let set = Instant::now();
    c.set_export(
        "lat",
        &serde_json::json!({"to": lake_url, "freshness": freshness, "retention": 1}),
    )
    .await?;
    let deadline = set + Duration::from_secs(4 * freshness + 60);
    loop {
        match c.count("lat", Some("a"), 0, None).await {
            Err(ferry_client::ClientError::Api { status: 410, .. }) => break,
            Ok(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Ok(rows) => {
                say!("retention: partition a still holds {rows} rows on replica 0 {} s after a retention of 1 s was set", deadline.duration_since(set).as_secs());
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
    }
    say!(
        "retention: partition a left replica 0 {:.1} s after a retention of 1 s was set (its {:.1} MiB of parts there; reads answer 410 naming the lake's files)",
        set.elapsed().as_secs_f64(),
        bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}

/// Rows of partition `a` in the lake's current commit.
async fn current_rows(location: &ferry_storage::Location) -> anyhow::Result<u64> {
    let view = ferry_export::lake::read(location, Some("a")).await?;
    Ok(view.partitions.first().map_or(0, |p| p.current.file.rows))
}

/// Marks the batches whose rows the lake holds now.
fn mark(acked: &[(u64, Instant)], visible: &mut [Option<Instant>], lake_rows: u64) {
    let now = Instant::now();
    for ((upto, _), seen) in acked.iter().zip(visible.iter_mut()) {
        if seen.is_none() && *upto <= lake_rows {
            *seen = Some(now);
        }
    }
}
