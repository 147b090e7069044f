//! Client commands: `ferry table ...` and `ferry insert`, over the HTTP API
//! through `ferry-client`.
//!
//! `ferry insert` reads a file of any size with bounded memory: a reader thread
//! cuts it into chunks of whole rows (NDJSON lines, CSV records with the header
//! repeated, Arrow or Parquet batches re-encoded as Arrow IPC) and hands them
//! over a queue of one, so that at most three chunks exist at once (one being
//! read, one queued, one being sent). Every chunk is one insert with its own
//! idempotency key (`<base>-<chunk number>`); a retry reuses it.
//!
//! With `--idempotency-key`, the file is cut at [`KEYED_CHUNK_BYTES`] whatever
//! the flags say (another `--chunk-bytes` is refused): a re-run with the same
//! base must send the same rows under the same key, chunk for chunk, or it
//! would insert them again under keys that hold other rows. Nothing on the
//! node has to remember the first run for that to hold (its memory of keys
//! ends with a restart; the replicas deduplicate exact retries for good).

use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal, Read};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use arrow::array::RecordBatch;
use bytes::Bytes;
use ferry_client::{Client, ClientError, RetryPolicy};
use ferry_table::Format;

#[derive(Debug, Clone, clap::Args)]
pub struct ClientArgs {
    /// The node's HTTP address.
    #[arg(long, env = "FERRY_URL", default_value = "http://127.0.0.1:7878")]
    pub url: String,
    /// Bearer token, when the node requires one.
    #[arg(long, env = "FERRY_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
}

impl ClientArgs {
    pub fn client(&self) -> anyhow::Result<Client> {
        let token = self.api_token.clone().filter(|t| !t.is_empty());
        Ok(Client::new(
            &self.url,
            token,
            Duration::from_secs(self.timeout_secs),
        )?)
    }
}

#[derive(Debug, clap::Subcommand)]
pub enum TableCommand {
    /// Creates a table from a TOML definition (a no-op if the same definition
    /// exists; another definition under the name is refused).
    Create {
        /// The TOML file with the definition (`name`, `partition_by`,
        /// `shard_by`, `[[columns]]`).
        #[arg(long)]
        file: PathBuf,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Lists the tables.
    List {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Shows one table's definition (as TOML).
    Show {
        /// The table's name.
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Sets where a table exports itself (its export policy) or its
    /// exports' default format; `--off` removes the `[export]` section.
    SetExport {
        /// The table's name.
        name: String,
        /// The destination the table exports itself to (file:// or s3://).
        #[arg(long)]
        to: Option<String>,
        /// parquet or iceberg (default parquet).
        #[arg(long)]
        format: Option<String>,
        /// How stale the lake may be (`10s`, `5m`; default 60s).
        #[arg(long)]
        freshness: Option<String>,
        /// Drops a partition from the replicas once the lake holds every
        /// row of it and its last export is this old (`7d`; default: never).
        #[arg(long)]
        retention: Option<String>,
        /// Removes the table's `[export]` section: no policy, no default format.
        #[arg(long, conflicts_with_all = ["to", "format", "freshness", "retention"])]
        off: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Drops a table nothing uses.
    Drop {
        /// The table's name.
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

pub async fn table(cmd: TableCommand) -> anyhow::Result<()> {
    match cmd {
        TableCommand::Create { file, client } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            // Checked here too, so that a mistake is named before any request.
            ferry_table::TableDef::from_toml(&text)
                .with_context(|| format!("{} is not a valid table definition", file.display()))?;
            let (table, created) = client.client()?.create_table_toml(&text).await?;
            if created {
                say!("created table {} (id {})", table.def.name, table.id);
            } else {
                say!(
                    "table {} (id {}) already exists with this definition",
                    table.def.name,
                    table.id
                );
            }
        }
        TableCommand::List { client } => {
            for t in client.client()?.tables().await? {
                say!(
                    "{}\tid {}\t{} columns\tpartition by {:?}({})\t{} shards x {} replicas",
                    t.def.name,
                    t.id,
                    t.def.columns.len(),
                    t.def.partition_by.transform,
                    t.def.partition_by.column,
                    t.def.shard_by.shards,
                    t.def.replicas
                );
            }
        }
        TableCommand::Show { name, client } => {
            let t = client.client()?.table(&name).await?;
            say!("# table id {}\n{}", t.id, t.def.to_toml());
        }
        TableCommand::SetExport {
            name,
            to,
            format,
            freshness,
            retention,
            off,
            client,
        } => {
            let export = if off {
                serde_json::Value::Null
            } else {
                let mut e = serde_json::Map::new();
                for (k, v) in [
                    ("to", to),
                    ("format", format),
                    ("freshness", freshness),
                    ("retention", retention),
                ] {
                    if let Some(v) = v {
                        e.insert(k.into(), v.into());
                    }
                }
                // Checked here too, so that a mistake is named before any request.
                let v = serde_json::Value::Object(e);
                ferry_table::def::ExportDefaults::from_json(v.to_string().as_bytes())?;
                v
            };
            let t = client.client()?.set_export(&name, &export).await?;
            match t
                .def
                .export
                .as_ref()
                .and_then(|e| e.policy.as_ref().map(|p| (e, p)))
            {
                Some((e, p)) => say!(
                    "table {} exports itself to {} as {} within {}s{}",
                    t.def.name,
                    p.to,
                    e.format,
                    p.freshness_seconds,
                    match p.retention_seconds {
                        Some(r) =>
                            format!("; partitions leave the replicas {r}s after their last export"),
                        None => String::new(),
                    }
                ),
                None => say!("table {} has no export policy", t.def.name),
            }
        }
        TableCommand::Drop { name, client } => {
            let t = client.client()?.drop_table(&name).await?;
            say!("dropped table {} (id {})", t.def.name, t.id);
        }
    }
    Ok(())
}

#[derive(Debug, clap::Subcommand)]
pub enum QueryCommand {
    /// Rows of a table (or one partition) on a replica.
    Count {
        /// The table.
        table: String,
        /// Count one partition only (its id, see `ferry query partitions`).
        #[arg(long)]
        partition: Option<String>,
        /// Which replica of the node answers.
        #[arg(long, default_value_t = 0)]
        replica: usize,
        /// Wait until the replica applied this LSN (an insert's commit_lsn).
        #[arg(long)]
        min_lsn: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// The partitions of a table on a replica, with their parts.
    Partitions {
        /// The table.
        table: String,
        /// Which replica of the node answers.
        #[arg(long, default_value_t = 0)]
        replica: usize,
        #[command(flatten)]
        client: ClientArgs,
    },
}

pub async fn query(cmd: QueryCommand) -> anyhow::Result<()> {
    match cmd {
        QueryCommand::Count {
            table,
            partition,
            replica,
            min_lsn,
            client,
        } => {
            let n = client
                .client()?
                .count(&table, partition.as_deref(), replica, min_lsn.as_deref())
                .await?;
            say!("{n}");
        }
        QueryCommand::Partitions {
            table,
            replica,
            client,
        } => {
            let v = client.client()?.partitions(&table, replica).await?;
            for p in v.as_array().into_iter().flatten() {
                say!(
                    "{}\t{} rows\t{} bytes\t{} parts",
                    p["partition_id"].as_str().unwrap_or("?"),
                    p["rows"],
                    p["bytes"],
                    p["parts"].as_array().map_or(0, Vec::len)
                );
                for part in p["parts"].as_array().into_iter().flatten() {
                    let n = &part["name"];
                    say!(
                        "  {}_{}_{}_{}\t{} rows\t{} bytes\tchecksum {:08x}",
                        n["partition_id"].as_str().unwrap_or("?"),
                        n["min_block"],
                        n["max_block"],
                        n["level"],
                        part["rows"],
                        part["bytes"],
                        part["checksum"].as_u64().unwrap_or(0)
                    );
                }
            }
        }
    }
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct InsertArgs {
    /// The table.
    pub table: String,
    /// The file: NDJSON, CSV with a header row, Arrow IPC (stream or file) or Parquet.
    pub file: PathBuf,
    /// The file's format: ndjson, csv, arrow or parquet. Default: from its
    /// extension (.ndjson/.jsonl/.json, .csv, .arrow/.arrows/.ipc, .parquet).
    #[arg(long)]
    pub format: Option<String>,
    /// Base of the idempotency keys (`<base>-<chunk>`, at most 180 characters).
    /// Run the same file again with the same base and nothing is inserted twice:
    /// with a base the file is always cut into chunks of 8 MiB (8388608 bytes,
    /// --chunk-bytes may not change that), so every chunk has the same rows
    /// under the same key as before. A base used for other rows is refused
    /// (409). Default: a new base per run (a re-run inserts again).
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// Bytes of rows per request (at most the node's --max-body-bytes). Not
    /// with --idempotency-key, unless 8388608. Default: 8388608 (8 MiB).
    #[arg(long)]
    pub chunk_bytes: Option<usize>,
    /// Attempts per chunk when the outcome is unknown or the node is busy.
    #[arg(long, default_value_t = 10)]
    pub attempts: u32,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// One request's worth of rows.
struct Chunk {
    body: Bytes,
    format: Format,
    /// Data rows in the chunk (0 when not counted: typed formats count on the
    /// server).
    rows: u64,
    /// Rows of the file before this chunk.
    first_row: u64,
    /// File bytes read up to the end of this chunk.
    read_to: u64,
}

pub async fn insert(args: InsertArgs) -> anyhow::Result<()> {
    let format = match &args.format {
        Some(f) => Format::from_name(f)
            .with_context(|| format!("unknown format {f:?} (ndjson, csv, arrow, parquet)"))?,
        None => Format::from_path(&args.file.to_string_lossy()).with_context(|| {
            format!(
                "cannot tell the format of {} from its name: give --format",
                args.file.display()
            )
        })?,
    };
    let chunk_bytes = chunk_size(args.chunk_bytes, args.idempotency_key.as_deref())?;
    let client = args.client.client()?;
    let file =
        File::open(&args.file).with_context(|| format!("opening {}", args.file.display()))?;
    let total = file.metadata().map(|m| m.len()).unwrap_or(0);
    let base = args.idempotency_key.clone().unwrap_or_else(new_key_base);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<anyhow::Result<Chunk>>(1);
    let path = args.file.clone();
    // A plain thread: reading and cutting the file is blocking work of this
    // command-line process, not of a node.
    let reader = std::thread::Builder::new()
        .name("ferry-insert-reader".into())
        .spawn(move || {
            let result = cut(file, format, chunk_bytes, &tx);
            if let Err(e) = result {
                let _ = tx.blocking_send(Err(e.context(format!("reading {}", path.display()))));
            }
        })
        .context("starting the file reader")?;

    let progress = Progress::new(total);
    let started = Instant::now();
    let mut rows = 0u64;
    let mut deduplicated = 0u64;
    let mut requests = 0u64;
    let mut row_offset = 0u64;
    // The highest commit_lsn answered: a read with `--min-lsn` at it sees
    // every row of the file.
    let mut last_commit: Option<(ferry_wal::Lsn, String)> = None;
    let policy = RetryPolicy {
        attempts: args.attempts.max(1),
        ..RetryPolicy::default()
    };
    while let Some(chunk) = rx.recv().await {
        let chunk = chunk?;
        let key = format!("{base}-{requests}");
        let progress_ref = &progress;
        let inserted = client
            .insert_with_retry(
                &args.table,
                chunk.format,
                chunk.body,
                Some(&key),
                &policy,
                |attempt, e| {
                    progress_ref.note(&format!(
                        "retrying chunk {requests} (attempt {attempt} failed: {e})"
                    ))
                },
            )
            .await;
        let inserted = match inserted {
            Ok(i) => i,
            Err(ClientError::Api { status, body }) if body.row.is_some() => {
                let first = if chunk.rows > 0 {
                    chunk.first_row
                } else {
                    row_offset
                };
                anyhow::bail!(
                    "{}: row {}{}: {} ({status}; nothing of this chunk was written, {rows} rows before it were)",
                    args.file.display(),
                    first + body.row.unwrap_or(0),
                    body.column.as_ref().map(|c| format!(", column {c:?}")).unwrap_or_default(),
                    body.reason.clone().unwrap_or(body.error.clone())
                );
            }
            Err(e) if e.key_reused() => anyhow::bail!(
                "{}: chunk {requests}: idempotency key {key:?} was used before for other rows \
                 (another file, a changed file, or one cut by another version of ferry); \
                 nothing of this chunk was written, {rows} rows before it were. \
                 Use a new --idempotency-key for other rows",
                args.file.display()
            ),
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "inserting chunk {requests} of {} ({rows} rows before it were committed)",
                    args.file.display()
                )))
            }
        };
        if inserted.deduplicated {
            deduplicated += inserted.rows;
        }
        if let Ok(lsn) = inserted.commit_lsn.parse::<ferry_wal::Lsn>() {
            if last_commit.as_ref().is_none_or(|(l, _)| lsn > *l) {
                last_commit = Some((lsn, inserted.commit_lsn.clone()));
            }
        }
        rows += inserted.rows;
        row_offset += inserted.rows;
        requests += 1;
        progress.update(chunk.read_to, rows, started.elapsed());
    }
    let _ = reader.join();
    progress.finish();
    let secs = started.elapsed().as_secs_f64();
    if deduplicated > 0 {
        say!("{deduplicated} of these rows were inserted before under the same keys and were not written again");
    }
    say!(
        "inserted {rows} rows into {} in {requests} requests from {} ({:.1} MiB in {secs:.1} s, {:.1} MB/s, {:.0} rows/s; peak memory {} MiB; idempotency key base {base})",
        args.table,
        args.file.display(),
        total as f64 / (1 << 20) as f64,
        total as f64 / 1e6 / secs.max(1e-9),
        rows as f64 / secs.max(1e-9),
        peak_rss_mib().map_or("?".into(), |m| m.to_string()),
    );
    if let Some((_, lsn)) = last_commit {
        say!("last commit_lsn {lsn} (read with --min-lsn {lsn} to see every row)");
    }
    Ok(())
}

/// The chunk size of a run with the default chunking.
pub const DEFAULT_CHUNK_BYTES: usize = 8 << 20;
/// The chunk size of every run with `--idempotency-key`: fixed, so that a
/// re-run with the same base cuts the file exactly as the first run did.
pub const KEYED_CHUNK_BYTES: usize = DEFAULT_CHUNK_BYTES;
/// Longest `--idempotency-key`: `-<chunk number>` is added, within the node's
/// 200 bytes.
const MAX_KEY_BASE: usize = 180;

/// The chunk size a run uses, or why the flags are refused.
fn chunk_size(flag: Option<usize>, base: Option<&str>) -> anyhow::Result<usize> {
    if let Some(base) = base {
        anyhow::ensure!(
            !base.is_empty()
                && base.len() <= MAX_KEY_BASE
                && base.bytes().all(|b| b.is_ascii_graphic()),
            "--idempotency-key must be 1 to {MAX_KEY_BASE} printable ASCII characters without spaces (a chunk number is added)"
        );
        match flag {
            None => return Ok(KEYED_CHUNK_BYTES),
            Some(n) if n == KEYED_CHUNK_BYTES => return Ok(n),
            Some(n) => anyhow::bail!(
                "--chunk-bytes {n} with --idempotency-key: with a key base the file is always cut into \
                 chunks of {KEYED_CHUNK_BYTES} bytes, so that running it again with the same base sends \
                 the same rows under the same keys (other chunks would insert rows again under keys \
                 that held other rows); leave --chunk-bytes out"
            ),
        }
    }
    let n = flag.unwrap_or(DEFAULT_CHUNK_BYTES);
    anyhow::ensure!(n >= 1024, "--chunk-bytes must be at least 1024");
    Ok(n)
}

fn new_key_base() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("ins-{:x}-{:x}", nanos, std::process::id())
}

/// Peak resident memory of this process (Linux `VmHWM`).
pub fn peak_rss_mib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

type Sender = tokio::sync::mpsc::Sender<anyhow::Result<Chunk>>;

/// Cuts `file` into chunks of about `chunk_bytes` and sends them in order.
fn cut(file: File, format: Format, chunk_bytes: usize, tx: &Sender) -> anyhow::Result<()> {
    let mut reader = CountingReader {
        inner: BufReader::with_capacity(1 << 20, file),
        read: 0,
    };
    match format {
        Format::Ndjson => cut_lines(&mut reader, None, chunk_bytes, tx),
        Format::Csv => {
            let mut header = Vec::new();
            anyhow::ensure!(
                read_csv_record(&mut reader, &mut header)?,
                "the CSV file is empty: it needs a header row"
            );
            cut_lines(&mut reader, Some(header), chunk_bytes, tx)
        }
        Format::Arrow => {
            let mut magic = [0u8; 6];
            let mut head = reader.inner.fill_buf()?.to_vec();
            head.truncate(6);
            magic[..head.len()].copy_from_slice(&head);
            let batches: Box<dyn Iterator<Item = Result<RecordBatch, arrow::error::ArrowError>>> =
                if &magic == b"ARROW1" {
                    // The random-access file form needs Seek: read it from the path's handle.
                    let file = reader.inner.into_inner();
                    Box::new(arrow::ipc::reader::FileReader::try_new(file, None)?)
                } else {
                    Box::new(arrow::ipc::reader::StreamReader::try_new(
                        reader.inner,
                        None,
                    )?)
                };
            cut_batches(batches, chunk_bytes, tx)
        }
        Format::Parquet => {
            let file = reader.inner.into_inner();
            let batches =
                parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)?
                    .with_batch_size(8192)
                    .build()?;
            cut_batches(Box::new(batches), chunk_bytes, tx)
        }
    }
}

struct CountingReader<R> {
    inner: BufReader<R>,
    read: u64,
}

impl<R: Read> CountingReader<R> {
    fn read_until(&mut self, out: &mut Vec<u8>) -> std::io::Result<usize> {
        let n = self.inner.read_until(b'\n', out)?;
        self.read += n as u64;
        Ok(n)
    }
}

/// Appends one CSV record (quoted fields may hold newlines) to `out`; false at
/// the end of the file.
fn read_csv_record<R: Read>(r: &mut CountingReader<R>, out: &mut Vec<u8>) -> std::io::Result<bool> {
    let start = out.len();
    let mut quotes = 0usize;
    loop {
        let before = out.len();
        if r.read_until(out)? == 0 {
            return Ok(out.len() > start);
        }
        quotes += out[before..].iter().filter(|&&b| b == b'"').count();
        // An even number of quotes: every quoted field is closed ("" inside a
        // field counts twice), so the newline ends the record.
        if quotes.is_multiple_of(2) {
            return Ok(true);
        }
    }
}

fn blank(line: &[u8]) -> bool {
    line.iter().all(|b| b.is_ascii_whitespace())
}

/// NDJSON lines, or CSV records after `header`, in chunks.
fn cut_lines<R: Read>(
    r: &mut CountingReader<R>,
    header: Option<Vec<u8>>,
    chunk_bytes: usize,
    tx: &Sender,
) -> anyhow::Result<()> {
    let format = if header.is_some() {
        Format::Csv
    } else {
        Format::Ndjson
    };
    let mut buf = Vec::with_capacity(chunk_bytes + (64 << 10));
    let mut rows = 0u64;
    let mut first_row = 0u64;
    let reset = |buf: &mut Vec<u8>| {
        buf.clear();
        if let Some(h) = &header {
            buf.extend_from_slice(h);
            if !h.ends_with(b"\n") {
                buf.push(b'\n');
            }
        }
    };
    reset(&mut buf);
    loop {
        let before = buf.len();
        let more = match format {
            Format::Csv => read_csv_record(r, &mut buf)?,
            _ => r.read_until(&mut buf)? > 0,
        };
        if more && !blank(&buf[before..]) {
            rows += 1;
        }
        if rows > 0 && (!more || buf.len() >= chunk_bytes) {
            let body = Bytes::from(std::mem::replace(
                &mut buf,
                Vec::with_capacity(chunk_bytes + (64 << 10)),
            ));
            let chunk = Chunk {
                body,
                format,
                rows,
                first_row,
                read_to: r.read,
            };
            if tx.blocking_send(Ok(chunk)).is_err() {
                return Ok(()); // the sender gave up
            }
            first_row += rows;
            rows = 0;
            reset(&mut buf);
        }
        if !more {
            return Ok(());
        }
    }
}

/// Batches regrouped into Arrow IPC chunks of about `chunk_bytes`.
fn cut_batches(
    batches: Box<dyn Iterator<Item = Result<RecordBatch, arrow::error::ArrowError>>>,
    chunk_bytes: usize,
    tx: &Sender,
) -> anyhow::Result<()> {
    let mut pending: Vec<RecordBatch> = Vec::new();
    let mut pending_bytes = 0usize;
    let mut first_row = 0u64;
    let flush = |pending: &mut Vec<RecordBatch>, first_row: &mut u64| -> anyhow::Result<bool> {
        if pending.is_empty() {
            return Ok(true);
        }
        let all = match pending.as_slice() {
            [one] => one.clone(),
            many => arrow::compute::concat_batches(&many[0].schema(), many)?,
        };
        pending.clear();
        let rows = all.num_rows() as u64;
        let body = ferry_table::rows::to_ipc(&all)?;
        let chunk = Chunk {
            body,
            format: Format::Arrow,
            rows,
            first_row: *first_row,
            read_to: 0,
        };
        *first_row += rows;
        Ok(tx.blocking_send(Ok(chunk)).is_ok())
    };
    for b in batches {
        let b = b?;
        // Not the batch's own bytes: for batches read from an IPC stream
        // this counts the shared message buffer once per column, so such a
        // file goes a batch per chunk. The rule stays: with a base key, a
        // re-run (by any version) must cut the file into the same chunks.
        pending_bytes += b.get_array_memory_size();
        pending.push(b);
        if pending_bytes >= chunk_bytes {
            pending_bytes = 0;
            if !flush(&mut pending, &mut first_row)? {
                return Ok(());
            }
        }
    }
    flush(&mut pending, &mut first_row)?;
    Ok(())
}

/// A progress bar on a terminal, a line every few seconds otherwise.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    last_line: std::sync::Mutex<Instant>,
    total: u64,
}

impl Progress {
    fn new(total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {bytes}/{total_bytes} {msg} ({elapsed}, eta {eta})",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar
        });
        Progress {
            bar,
            last_line: std::sync::Mutex::new(Instant::now()),
            total,
        }
    }

    fn update(&self, read_to: u64, rows: u64, elapsed: Duration) {
        let rate = read_to as f64 / 1e6 / elapsed.as_secs_f64().max(1e-9);
        let message = format!("{rows} rows, {rate:.1} MB/s");
        match &self.bar {
            Some(bar) => {
                if read_to > 0 {
                    bar.set_position(read_to);
                }
                bar.set_message(message);
            }
            None => {
                let Ok(mut last) = self.last_line.lock() else {
                    return;
                };
                if last.elapsed() >= Duration::from_secs(5) {
                    *last = Instant::now();
                    eprintln!(
                        "inserted {rows} rows, {:.1} of {:.1} MiB, {rate:.1} MB/s",
                        read_to as f64 / (1 << 20) as f64,
                        self.total as f64 / (1 << 20) as f64
                    );
                }
            }
        }
    }

    fn note(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_base_fixes_the_chunk_size() {
        assert_eq!(
            chunk_size(None, None).expect("default"),
            DEFAULT_CHUNK_BYTES
        );
        assert_eq!(chunk_size(Some(4096), None).expect("any"), 4096);
        assert!(chunk_size(Some(100), None).is_err());
        assert_eq!(
            chunk_size(None, Some("b")).expect("keyed"),
            KEYED_CHUNK_BYTES
        );
        assert_eq!(
            chunk_size(Some(KEYED_CHUNK_BYTES), Some("b")).expect("the same size"),
            KEYED_CHUNK_BYTES
        );
        let e = chunk_size(Some(4096), Some("b")).expect_err("another size");
        assert!(e.to_string().contains("always cut"), "{e}");
        assert!(chunk_size(None, Some(&"k".repeat(181))).is_err());
        assert!(chunk_size(None, Some("a b")).is_err());
    }
}
