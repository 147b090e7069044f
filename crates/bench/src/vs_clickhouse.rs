//! `ferry bench ingest --vs-clickhouse`: the same rows, as NDJSON, CSV,
//! Arrow IPC and Parquet files, loaded into ClickHouse (chDB: ClickHouse in
//! a Python process, `INSERT ... FROM INFILE` into a MergeTree table
//! partitioned by day) and into ferry (`ferry insert` into a `ferry dev`
//! child process: HTTP, committed on three safekeepers, applied as parts on
//! every replica), in the same run, one after the other on an idle machine.
//!
//! CPU is process CPU from the OS: chDB's whole process around its insert;
//! for ferry, the server from the insert's start until every replica
//! applied it, plus the `ferry insert` client. Memory is the peak resident
//! set during the load (ferry: the server's, its peak reset first; chDB:
//! the process's, which includes ClickHouse loaded), next to the resident
//! set before it. ferry runs twice per format, with 2 replicas and with 1,
//! so the second replica's cost shows.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use arrow::array::RecordBatch;
use ferry_table::{Format, TableDef};

use crate::dev_process::{self, Dev};

/// The chDB side, run by the Python that has chDB.
const LOADER: &str = include_str!("../py/clickhouse_load.py");
/// The chDB version the figures were taken with (`scripts/test.sh`
/// installs it).
const CHDB: &str = "chdb==4.4.0";
/// Rows per batch when the files are written.
const FILE_BATCH_ROWS: usize = 65_536;
/// Longest wait for the replicas to apply what was acknowledged.
const APPLY_WAIT: Duration = Duration::from_secs(600);

/// ClickHouse's figures for one file, as the loader prints them.
#[derive(Debug, serde::Deserialize)]
struct ChLoad {
    rows: u64,
    wall_s: f64,
    cpu_s: f64,
    peak_rss_kib: u64,
    rss_before_kib: u64,
    version: String,
}

/// ferry's figures for one file.
#[derive(Debug)]
struct FerryLoad {
    rows: u64,
    acknowledged: Duration,
    applied: Duration,
    server_cpu_s: f64,
    client_cpu_s: f64,
    peak_rss_kib: Option<u64>,
    rss_before_kib: Option<u64>,
}

fn format_name(f: Format) -> &'static str {
    match f {
        Format::Ndjson => "ndjson",
        Format::Csv => "csv",
        Format::Arrow => "arrow",
        Format::Parquet => "parquet",
    }
}

fn title(f: Format) -> &'static str {
    match f {
        Format::Ndjson => "NDJSON",
        Format::Csv => "CSV",
        Format::Arrow => "Arrow IPC",
        Format::Parquet => "Parquet",
    }
}

/// The goal for ferry's rows per CPU-second against ClickHouse's.
fn goal(f: Format) -> f64 {
    match f {
        Format::Ndjson | Format::Arrow => 0.6,
        Format::Csv | Format::Parquet => 0.5,
    }
}

/// The Python that runs the loader: `--python`, else the checkout's venv
/// (where `scripts/test.sh` installs chDB) found from the working folder
/// up, else `python3`; it must import chdb.
fn find_python(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = given.map(Path::to_path_buf).into_iter().collect();
    if given.is_none() {
        let mut dir = std::env::current_dir().ok();
        while let Some(d) = dir {
            candidates.push(d.join(".venv/bin/python"));
            dir = d.parent().map(Path::to_path_buf);
        }
        candidates.push(PathBuf::from("python3"));
    }
    for python in &candidates {
        let ok = Command::new(python)
            .args(["-c", "import chdb"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Ok(python.clone());
        }
    }
    bail!(
        "no Python with chDB found (tried {}): scripts/test.sh installs it into the checkout's .venv, \
         or run `python3 -m venv .venv && .venv/bin/pip install {CHDB}`, or pass --python",
        candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Writes `rows` rows of the benchmark table into one file per format.
fn write_files(
    def: &TableDef,
    rows: usize,
    dir: &Path,
    formats: &[Format],
    make: impl Fn(&TableDef, usize, usize) -> anyhow::Result<RecordBatch>,
) -> anyhow::Result<Vec<(Format, PathBuf, u64)>> {
    use std::io::Write as _;
    let schema = def.arrow_schema();
    let path = |f: Format| {
        dir.join(format!(
            "rows.{}",
            match f {
                Format::Ndjson => "ndjson",
                Format::Csv => "csv",
                Format::Arrow => "arrows",
                Format::Parquet => "parquet",
            }
        ))
    };
    let open = |f: Format| -> anyhow::Result<std::io::BufWriter<std::fs::File>> {
        Ok(std::io::BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(path(f))
                .with_context(|| format!("creating {}", path(f).display()))?,
        ))
    };
    let mut ndjson = formats
        .contains(&Format::Ndjson)
        .then(|| open(Format::Ndjson))
        .transpose()?
        .map(arrow::json::LineDelimitedWriter::new);
    let mut csv = formats
        .contains(&Format::Csv)
        .then(|| open(Format::Csv))
        .transpose()?
        .map(|w| arrow::csv::WriterBuilder::new().with_header(true).build(w));
    let mut ipc = match formats.contains(&Format::Arrow) {
        true => Some(arrow::ipc::writer::StreamWriter::try_new(
            open(Format::Arrow)?,
            &schema,
        )?),
        false => None,
    };
    let mut parquet = match formats.contains(&Format::Parquet) {
        true => Some(parquet::arrow::ArrowWriter::try_new(
            open(Format::Parquet)?,
            Arc::clone(&schema),
            Some(
                parquet::file::properties::WriterProperties::builder()
                    .set_compression(parquet::basic::Compression::SNAPPY)
                    .build(),
            ),
        )?),
        false => None,
    };
    let mut start = 0;
    while start < rows {
        let n = FILE_BATCH_ROWS.min(rows - start);
        let batch = make(def, start, n)?;
        if let Some(w) = ndjson.as_mut() {
            w.write(&batch)?;
        }
        if let Some(w) = csv.as_mut() {
            w.write(&batch)?;
        }
        if let Some(w) = ipc.as_mut() {
            w.write(&batch)?;
        }
        if let Some(w) = parquet.as_mut() {
            w.write(&batch)?;
        }
        start += n;
    }
    if let Some(mut w) = ndjson {
        w.finish()?;
        w.into_inner().flush()?;
    }
    if let Some(w) = csv {
        w.into_inner().flush()?;
    }
    if let Some(mut w) = ipc {
        w.finish()?;
        w.into_inner()?.flush()?;
    }
    if let Some(w) = parquet {
        w.close()?;
    }
    formats
        .iter()
        .map(|&f| {
            let p = path(f);
            let len = std::fs::metadata(&p)?.len();
            Ok((f, p, len))
        })
        .collect()
}

/// Loads `file` into a fresh chDB table.
fn clickhouse_load(
    python: &Path,
    loader: &Path,
    format: Format,
    file: &Path,
    work: &Path,
) -> anyhow::Result<ChLoad> {
    let out = Command::new(python)
        .arg(loader)
        .arg(format_name(format))
        .arg(file)
        .arg(work)
        .output()
        .context("running the chDB loader")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "the chDB load of {} failed: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("the chDB loader printed {line:?}"))
}

/// Inserts `file` with `ferry insert` into a fresh `ferry dev` with
/// `replicas` replicas, and waits until every replica applied it.
async fn ferry_load(
    def: &TableDef,
    format: Format,
    file: &Path,
    data: &Path,
    replicas: u32,
) -> anyhow::Result<FerryLoad> {
    let dev = Dev::start(data, &["--replicas".to_string(), replicas.to_string()])?;
    let client = ferry_client::Client::new(&dev.url, None, Duration::from_secs(900))?;
    client.create_table(def).await?;
    let pid = dev.pid();
    let exe = std::env::current_exe().context("the ferry binary")?;
    let rss_before_kib = dev_process::memory_kib(pid, "VmRSS");
    let peak_reset = dev_process::reset_peak_memory(pid);
    let server_cpu0 = dev_process::cpu_seconds(pid).context("the server's CPU time")?;
    let client_cpu0 = dev_process::waited_children_cpu_seconds().context("children's CPU time")?;
    let started = Instant::now();
    let out = tokio::process::Command::new(exe)
        .args(["insert", "bench"])
        .arg(file)
        .args(["--format", format_name(format), "--url", &dev.url])
        .output()
        .await
        .context("running ferry insert")?;
    let acknowledged = started.elapsed();
    let client_cpu_s =
        dev_process::waited_children_cpu_seconds().context("children's CPU time")? - client_cpu0;
    if !out.status.success() {
        bail!(
            "ferry insert of {} failed: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let status = client.get_json("/status").await?;
    let commit = status["writer"]["commit_lsn"]
        .as_str()
        .context("no writer commit_lsn in /status")?
        .to_string();
    let mut rows = Vec::new();
    for r in 0..replicas {
        let deadline = Instant::now() + APPLY_WAIT;
        let v = loop {
            let q = format!("/tables/bench/count?replica={r}&min_lsn={commit}&wait_ms=60000");
            match client.get_json(&q).await {
                Ok(v) => break v,
                Err(e) if Instant::now() < deadline => {
                    // A read that waited its whole wait_ms, or a node not
                    // answering: ask again after a pause, never in a loop.
                    tracing::debug!(error = %e, replica = r, "not applied yet");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e).context(format!("replica {r} applying up to {commit}")),
            }
        };
        rows.push(v["rows"].as_u64().context("no row count")?);
    }
    let applied = started.elapsed();
    let server_cpu_s =
        dev_process::cpu_seconds(pid).context("the server's CPU time")? - server_cpu0;
    let peak_rss_kib = peak_reset
        .then(|| dev_process::memory_kib(pid, "VmHWM"))
        .flatten();
    let first = rows.first().copied().unwrap_or(0);
    anyhow::ensure!(
        rows.iter().all(|&r| r == first),
        "the replicas hold different row counts: {rows:?}"
    );
    drop(dev);
    Ok(FerryLoad {
        rows: first,
        acknowledged,
        applied,
        server_cpu_s,
        client_cpu_s,
        peak_rss_kib,
        rss_before_kib,
    })
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn kilo(x: f64) -> String {
    format!("{:.0}k", x / 1000.0)
}

/// The comparison; `make` draws the benchmark's rows.
pub async fn run(
    def: &TableDef,
    rows: usize,
    dir: Option<&Path>,
    python: Option<&Path>,
    formats: &[Format],
    make: impl Fn(&TableDef, usize, usize) -> anyhow::Result<RecordBatch>,
) -> anyhow::Result<()> {
    let python = find_python(python)?;
    let root = crate::wal::scratch_dir(dir, "ferry-bench-vs-clickhouse-")?;
    let loader = root.path().join("clickhouse_load.py");
    std::fs::write(&loader, LOADER)?;
    say!(
        "writing {rows} rows of 10 columns as {} file(s)...",
        formats.len()
    );
    let files = write_files(def, rows, root.path(), formats, make)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut summary = Vec::new();
    for (format, file, bytes) in &files {
        let (format, bytes) = (*format, *bytes);
        let ch = clickhouse_load(
            &python,
            &loader,
            format,
            file,
            &root.path().join(format!("chdb-{}", format_name(format))),
        )?;
        anyhow::ensure!(
            ch.rows == rows as u64,
            "ClickHouse loaded {} rows of {rows}",
            ch.rows
        );
        let mut ferry = Vec::new();
        for replicas in [2u32, 1] {
            let data = root
                .path()
                .join(format!("ferry-{}-r{replicas}", format_name(format)));
            let load = ferry_load(def, format, file, &data, replicas).await?;
            anyhow::ensure!(
                load.rows == rows as u64,
                "ferry holds {} rows of {rows} on its replicas",
                load.rows
            );
            ferry.push((replicas, load));
        }
        let ch_rows_cpu = rows as f64 / ch.cpu_s.max(1e-9);
        say!(
            "{} ({:.1} MB, {rows} rows, {cores} cores; ClickHouse {} via chDB):",
            title(format),
            bytes as f64 / 1e6,
            ch.version
        );
        say!(
            "  ClickHouse          loaded in {:.2} s: {} rows/s, {:.2} CPU-s, {} rows per CPU-second, peak memory {:.0} MiB ({:.0} MiB before the insert)",
            ch.wall_s,
            kilo(rows as f64 / ch.wall_s.max(1e-9)),
            ch.cpu_s,
            kilo(ch_rows_cpu),
            mib(ch.peak_rss_kib),
            mib(ch.rss_before_kib),
        );
        for (replicas, f) in &ferry {
            let cpu = f.server_cpu_s + f.client_cpu_s;
            say!(
                "  ferry, {replicas} replica(s)   acknowledged in {:.2} s, applied on every replica in {:.2} s: {} rows/s, {:.2} CPU-s (server {:.2} + client {:.2}), {} rows per CPU-second ({:.0}% of ClickHouse), server peak memory {} ({} before the insert)",
                f.acknowledged.as_secs_f64(),
                f.applied.as_secs_f64(),
                kilo(rows as f64 / f.applied.as_secs_f64().max(1e-9)),
                cpu,
                f.server_cpu_s,
                f.client_cpu_s,
                kilo(rows as f64 / cpu.max(1e-9)),
                100.0 * (rows as f64 / cpu.max(1e-9)) / ch_rows_cpu,
                f.peak_rss_kib
                    .map_or("unknown".to_string(), |k| format!("{:.0} MiB", mib(k))),
                f.rss_before_kib
                    .map_or("unknown".to_string(), |k| format!("{:.0} MiB", mib(k))),
            );
        }
        if let Some((_, f)) = ferry.iter().find(|(r, _)| *r == 2) {
            let ratio = (rows as f64 / (f.server_cpu_s + f.client_cpu_s).max(1e-9)) / ch_rows_cpu;
            let memory = f
                .peak_rss_kib
                .map(|k| k as f64 / ch.peak_rss_kib.max(1) as f64);
            say!(
                "  ratio (ferry with 2 replicas / ClickHouse): rows per CPU-second {:.0}% (goal {:.0}%: {}), peak memory {} (goal at most 1.5x)",
                ratio * 100.0,
                goal(format) * 100.0,
                if ratio >= goal(format) { "met" } else { "not met" },
                memory.map_or("unknown".to_string(), |m| format!("{m:.2}x")),
            );
            summary.push((format, ratio, memory));
        }
    }
    say!("summary, ferry with 2 replicas against ClickHouse (rows per CPU-second; peak memory):");
    for (format, ratio, memory) in summary {
        say!(
            "  {:<10} {:>4.0}% (goal {:.0}%)   {}",
            title(format),
            ratio * 100.0,
            goal(format) * 100.0,
            memory.map_or("unknown".to_string(), |m| format!("{m:.2}x")),
        );
    }
    Ok(())
}
