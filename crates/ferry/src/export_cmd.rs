//! `ferry export`, `ferry exports` and `ferry verify`: the export client
//! commands (the first two talk to a node over HTTP; verify reads the
//! destination itself).

use std::time::Duration;

use anyhow::Context;
use ferry_export::model::{Compression, ExportSettings, FileExistsPolicy, LakeFormat};
use ferry_export::{ExportsView, TaskStatus, TaskView};
use serde_json::json;

use crate::client_cmd::ClientArgs;

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ExportArgs {
    #[command(subcommand)]
    pub command: Option<ExportCommand>,
    /// The table. One named like a subcommand (`kill`, `help`) goes after
    /// `--`, as any word there is a table and partition: `ferry export --to
    /// URL -- kill P`.
    pub table: Option<String>,
    /// The partition id (see `ferry query partitions`).
    pub partition: Option<String>,
    /// Every partition with rows, one task each.
    #[arg(long)]
    pub all_partitions: bool,
    /// The destination: file:///dir or s3://bucket/prefix.
    #[arg(long)]
    pub to: Option<String>,
    /// Replace a live or unexpired task for the same partition and destination.
    #[arg(long)]
    pub force: bool,
    /// Wait until every export created ends, with a progress bar; exit
    /// non-zero unless all are COMPLETED (with --all-partitions, also when a
    /// partition was refused; partitions skipped for a live or unexpired
    /// export are reported and do not count).
    #[arg(long)]
    pub wait: bool,
    #[command(flatten)]
    pub settings: SettingsArgs,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, clap::Subcommand)]
pub enum ExportCommand {
    /// Kills a PENDING export (by transaction id, or by table, partition and
    /// destination): every replica stops its uploads, no commit file appears.
    Kill {
        /// The export's transaction id (as `ferry export` and `ferry
        /// exports` print it); or name it by the three below.
        #[arg(long)]
        transaction_id: Option<String>,
        /// The exported table (with --partition and --to).
        #[arg(long)]
        table: Option<String>,
        /// The exported partition.
        #[arg(long)]
        partition: Option<String>,
        /// The export's destination URL.
        #[arg(long)]
        to: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// Settings captured in the task's metadata.json.
#[derive(Debug, clap::Args)]
pub struct SettingsArgs {
    /// Seconds from creation after which a PENDING task is KILLED; 0 never. Default: 3600.
    #[arg(long)]
    pub task_timeout_secs: Option<u64>,
    /// Seconds from creation after which a finished task is removed. Default: 180.
    #[arg(long)]
    pub ttl_secs: Option<u64>,
    /// First back-off of a part after a retryable error, ms. Default: 5000.
    #[arg(long)]
    pub retry_initial_backoff_ms: Option<u64>,
    /// Largest back-off, ms. Default: 300000.
    #[arg(long)]
    pub retry_max_backoff_ms: Option<u64>,
    /// Retryable failures of a part before the task FAILS; 0 unlimited. Default: 0.
    #[arg(long)]
    pub max_retries: Option<u32>,
    /// Parts one replica exports at once. Default: 2.
    #[arg(long)]
    pub parallelism: Option<u32>,
    /// zstd (parts copied as they are), snappy, lz4 or none. Default: zstd.
    #[arg(long)]
    pub compression: Option<Compression>,
    /// Rows per row group. Default: 131072.
    #[arg(long)]
    pub row_group_rows: Option<u64>,
    /// skip, error or overwrite a data file already there. Default: skip.
    #[arg(long)]
    pub file_exists: Option<FileExistsPolicy>,
    /// parquet (Hive-layout files and ferry commit files) or iceberg (an
    /// Apache Iceberg v2 table). A destination keeps the format of its
    /// first export. Default: the table's `[export] format`, else parquet.
    #[arg(long)]
    pub format: Option<LakeFormat>,
}

impl SettingsArgs {
    fn settings(&self) -> ExportSettings {
        let d = ExportSettings::default();
        ExportSettings {
            task_timeout_seconds: self.task_timeout_secs.unwrap_or(d.task_timeout_seconds),
            ttl_seconds: self.ttl_secs.unwrap_or(d.ttl_seconds),
            retry_initial_backoff_ms: self
                .retry_initial_backoff_ms
                .unwrap_or(d.retry_initial_backoff_ms),
            retry_max_backoff_ms: self.retry_max_backoff_ms.unwrap_or(d.retry_max_backoff_ms),
            max_retries: self.max_retries.unwrap_or(d.max_retries),
            parallelism: self.parallelism.unwrap_or(d.parallelism),
            compression: self.compression.unwrap_or(d.compression),
            row_group_rows: self.row_group_rows.unwrap_or(d.row_group_rows),
            file_exists: self.file_exists.unwrap_or(d.file_exists),
            format: self.format,
        }
    }
}

pub async fn export(args: ExportArgs) -> anyhow::Result<()> {
    if let Some(ExportCommand::Kill {
        transaction_id,
        table,
        partition,
        to,
        client,
    }) = args.command
    {
        let body = json!({
            "transaction_id": transaction_id,
            "table": table,
            "partition_id": partition,
            "destination": to,
        });
        let result: serde_json::Value = client.client()?.post_json("/exports/kill", &body).await?;
        println!(
            "export {} (transaction {}): {}",
            result["key"].as_str().unwrap_or("?"),
            result["transaction_id"].as_str().unwrap_or("?"),
            result["status"].as_str().unwrap_or("?")
        );
        return Ok(());
    }
    let table = args
        .table
        .context("give the table (and a partition, or --all-partitions)")?;
    let to = args.to.context("give the destination with --to")?;
    if args.partition.is_some() == args.all_partitions {
        anyhow::bail!("give either a partition or --all-partitions");
    }
    let client = args.client.client()?;
    let body = json!({
        "table": table,
        "partition_id": args.partition,
        "all_partitions": args.all_partitions,
        "destination": to,
        "force": args.force,
        "settings": args.settings.settings(),
    });
    let created: ferry_node::exports::CreatedBody = client.post_json("/exports", &body).await?;
    for c in &created.created {
        if let Some(commit) = &c.unchanged {
            println!(
                "export {} unchanged: the current commit {commit} already holds these {} parts, {} rows",
                c.key, c.parts_count, c.rows
            );
            continue;
        }
        println!(
            "export {} created: transaction {}, {} parts, {} rows (snapshot at {})",
            c.key,
            c.transaction_id,
            c.parts_count,
            c.rows,
            ferry_wal::Lsn(c.snapshot_lsn)
        );
    }
    for n in &created.skipped {
        println!(
            "export of partition {} skipped: {}",
            n.partition_id, n.error
        );
    }
    for n in &created.failed {
        println!(
            "export of partition {} refused ({}): {}",
            n.partition_id, n.kind, n.error
        );
    }
    let mut failed: Vec<String> = created
        .failed
        .iter()
        .map(|n| format!("{} refused", n.partition_id))
        .collect();
    if !args.wait {
        if !failed.is_empty() {
            anyhow::bail!("exports not created: {}", failed.join(", "));
        }
        return Ok(());
    }
    for c in created.created.iter().filter(|c| c.unchanged.is_none()) {
        let view = wait(&client, &c.transaction_id, c.parts_count).await?;
        println!("{}", table_of(std::slice::from_ref(&view)));
        if view.status != TaskStatus::Completed {
            failed.push(format!("{} {}", c.key, view.status));
        }
    }
    if !failed.is_empty() {
        anyhow::bail!("exports not completed: {}", failed.join(", "));
    }
    Ok(())
}

async fn wait(client: &ferry_client::Client, tx: &str, parts: u64) -> anyhow::Result<TaskView> {
    let bar = indicatif::ProgressBar::new(parts);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{bar:40}] {pos}/{len} parts")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(tx.to_string());
    loop {
        let view: ExportsView = client.get_typed("/exports").await?;
        if let Some(t) = view.tasks.iter().find(|t| t.transaction_id == tx) {
            bar.set_position(t.parts_count.saturating_sub(t.parts_to_do));
            if t.status.is_terminal() {
                bar.finish_and_clear();
                return Ok(t.clone());
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The status listing as a text table.
pub fn table_of(tasks: &[TaskView]) -> String {
    let mut out = String::from(
        "TABLE       PARTITION   STATUS     PARTS  TO_DO  ROWS        EXCEPTIONS  TRANSACTION                     DESTINATION\n",
    );
    for t in tasks {
        out += &format!(
            "{:<11} {:<11} {:<10} {:<6} {:<6} {:<11} {:<11} {:<31} {}\n",
            t.table,
            t.partition_id,
            t.status.as_str(),
            t.parts_count,
            t.parts_to_do,
            t.rows,
            t.exception_count,
            t.transaction_id,
            t.destination
        );
        if t.by_policy || t.carried > 0 {
            out += &format!(
                "    {}{} files carried from the partition's previous commit\n",
                if t.by_policy {
                    "asked by the table's export policy; "
                } else {
                    ""
                },
                t.carried
            );
        }
        if let Some(e) = &t.last_exception {
            out += &format!(
                "    last exception on {} (part {}): {}\n",
                e.replica, e.part, e.message
            );
        }
        for b in &t.backoff {
            out += &format!(
                "    back-off here: {} after {} attempts, retry in {} ms\n",
                b.part, b.attempts, b.retry_in_ms
            );
        }
        if let Some(c) = &t.commit_file {
            out += &format!("    commit file: {c}\n");
        }
    }
    out
}

#[derive(Debug, clap::Args)]
pub struct ExportsArgs {
    /// Print the listing as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

pub async fn exports(args: ExportsArgs) -> anyhow::Result<()> {
    let view: ExportsView = args.client.client()?.get_typed("/exports").await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&view)?);
    } else {
        print!("{}", table_of(&view.tasks));
    }
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// The destination: file:///dir or s3://bucket/prefix (S3 settings from
    /// the AWS_* environment).
    pub url: String,
    /// Also decode every current file's rows and check their checksum.
    #[arg(long, conflicts_with = "quick")]
    pub deep: bool,
    /// Check sizes and footers only, without reading every byte against the
    /// whole-file crc32c the commit file records (the default).
    #[arg(long)]
    pub quick: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `ferry verify`'s report of an Iceberg table: the current snapshot's
/// files, their sizes, footers (rows and rows checksum) and blocks, and with
/// `--deep` their rows.
fn print_iceberg_report(
    args: &VerifyArgs,
    report: &ferry_iceberg::verify::IcebergReport,
) -> anyhow::Result<()> {
    if args.json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        println!(
            "{}: Iceberg table, metadata version {}, snapshot {}: {} data files checked, {} rows",
            args.url, report.version, report.snapshot_id, report.files_checked, report.rows
        );
        for p in &report.problems {
            println!("MISMATCH {p}");
        }
        for o in &report.orphans {
            println!("orphan (no snapshot references it; readers never see it): {o}");
        }
    }
    if !report.ok() {
        anyhow::bail!("{} mismatches in {}", report.problems.len(), args.url);
    }
    Ok(())
}

/// Opens a destination to read: a local folder that does not exist is an
/// error here (opening a location to write creates it).
fn open_to_read(url: &str) -> anyhow::Result<ferry_storage::Location> {
    if let Some(rest) = url.strip_prefix("file://") {
        let dir = std::path::Path::new(rest);
        anyhow::ensure!(
            dir.is_dir(),
            "{url}: no such directory (nothing was exported there)"
        );
    }
    Ok(ferry_storage::open(
        url,
        &ferry_host::s3_settings_from_env(),
    )?)
}

pub async fn verify(args: VerifyArgs) -> anyhow::Result<()> {
    let location = open_to_read(&args.url)?;
    let depth = match (args.quick, args.deep) {
        (true, _) => ferry_export::verify::Depth::Quick,
        (_, true) => ferry_export::verify::Depth::Rows,
        _ => ferry_export::verify::Depth::Bytes,
    };
    let iceberg = ferry_iceberg::IcebergTable::new(location.clone());
    if let Some(mut report) = ferry_iceberg::verify::verify(&iceberg)
        .await
        .with_context(|| format!("reading {}", args.url))?
    {
        if report.ok() {
            report.problems = ferry_export::verify::check_iceberg_files(&iceberg, depth)
                .await
                .with_context(|| format!("reading {}", args.url))?;
        }
        return print_iceberg_report(&args, &report);
    }
    let report = ferry_export::verify::verify(&location, depth)
        .await
        .with_context(|| format!("reading {}", args.url))?;
    anyhow::ensure!(
        !report.commits.is_empty() || !report.orphans.is_empty() || !report.problems.is_empty(),
        "{}: no commit file and no data file: nothing was exported there",
        args.url
    );
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{}: {} commit files, {} data files checked, {} rows",
            args.url,
            report.commits.len(),
            report.files_checked,
            report.rows
        );
        for c in &report.superseded {
            println!("superseded (a later commit of its partition replaced it): {c}");
        }
        for p in &report.problems {
            println!("MISMATCH {p}");
        }
        for o in &report.orphans {
            println!("orphan (no commit file lists it; readers must ignore it): {o}");
        }
    }
    if !report.ok() {
        anyhow::bail!("{} mismatches in {}", report.problems.len(), args.url);
    }
    Ok(())
}

#[derive(Debug, clap::Subcommand)]
pub enum LakeCommand {
    /// Prints exactly the data files a reader should read now, one per line:
    /// of every partition, the files of its current commit (never the union
    /// of all commit files: a re-export lists files holding the same rows as
    /// the commit it supersedes); of an Iceberg table, the live files of its
    /// current snapshot. Reads the destination itself (S3 settings from the
    /// AWS_* environment).
    Files(LakeFilesArgs),
    /// Expires the snapshots of an Iceberg table taken more than
    /// `--older-than` ago (never the current one), in a new metadata
    /// version; each partition's commit identity is kept, so a retried
    /// export still finds its commit. Of a Parquet destination, deletes the
    /// commit files superseded more than `--older-than` ago (never a
    /// partition's current one). Files only they held become orphans
    /// (`ferry verify` names them); no data file is deleted.
    ExpireSnapshots(ExpireArgs),
    /// Deletes the data files (of an Iceberg table or a Parquet destination)
    /// that nothing kept lists and that were last modified more than
    /// `--older-than` ago (choose it longer than the longest export: an
    /// export's files are orphans until its commit lands).
    RemoveOrphans(ExpireArgs),
}

#[derive(Debug, clap::Args)]
pub struct ExpireArgs {
    /// The destination (an Iceberg table or a Parquet destination):
    /// file:///dir or s3://bucket/prefix.
    pub url: String,
    /// Age past which a snapshot expires, e.g. 7d or 12h.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub older_than: std::time::Duration,
}

#[derive(Debug, clap::Args)]
pub struct LakeFilesArgs {
    /// The destination: file:///dir or s3://bucket/prefix.
    pub url: String,
    /// Only this partition.
    #[arg(long)]
    pub partition: Option<String>,
    /// Full names instead of paths relative to the destination: absolute
    /// local paths for file:// and s3://bucket/key for S3 (what DuckDB and
    /// pandas open directly).
    #[arg(long)]
    pub full: bool,
    /// JSON: every partition with its current commit, its files (path, rows,
    /// bytes, checksum) and the commits it superseded.
    #[arg(long)]
    pub json: bool,
}

pub async fn lake(cmd: LakeCommand) -> anyhow::Result<()> {
    let args = match cmd {
        LakeCommand::Files(args) => args,
        LakeCommand::ExpireSnapshots(args) => return expire_snapshots(args).await,
        LakeCommand::RemoveOrphans(args) => return remove_orphans(args).await,
    };
    if let Some(p) = &args.partition {
        ferry_export::model::check_name("partition id", p)?;
    }
    let location = open_to_read(&args.url)?;
    let iceberg = ferry_iceberg::IcebergTable::new(location.clone());
    if let Some((version, meta)) = iceberg
        .current()
        .await
        .with_context(|| format!("reading {}", args.url))?
    {
        return iceberg_files(&args, &iceberg, version, &meta).await;
    }
    let view = ferry_export::lake::read(&location, args.partition.as_deref())
        .await
        .with_context(|| format!("reading {}", args.url))?;
    if let Some((key, e)) = view.unreadable.first() {
        anyhow::bail!(
            "{key} in {} is not a commit file ({e}): no reader can tell what is current",
            args.url
        );
    }
    let name = |path: &str| {
        if args.full {
            format!("{}/{path}", full_base(&args.url))
        } else {
            path.to_string()
        }
    };
    if args.json {
        let partitions: Vec<serde_json::Value> = view
            .partitions
            .iter()
            .map(|p| {
                json!({
                    "partition_id": p.partition_id,
                    "commit": p.current.key,
                    "transaction_id": p.current.file.transaction_id,
                    "rows": p.current.file.rows,
                    "files": p.current.file.files.iter().map(|f| json!({
                        "path": name(&f.path),
                        "rows": f.rows,
                        "bytes": f.bytes,
                        "checksum": format!("{:08x}", f.checksum),
                    })).collect::<Vec<_>>(),
                    "superseded": p.superseded.iter().map(|c| c.key.clone()).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({ "destination": args.url, "partitions": partitions })
            )?
        );
    } else {
        for (_, f) in view.current_files() {
            println!("{}", name(&f.path));
        }
    }
    Ok(())
}

/// Now and `now - older_than`, in milliseconds since the Unix epoch.
fn cut_off(older_than: std::time::Duration) -> (i64, i64) {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let age = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
    (now_ms, now_ms.saturating_sub(age))
}

async fn remove_orphans(args: ExpireArgs) -> anyhow::Result<()> {
    let location = open_to_read(&args.url)?;
    let table = ferry_iceberg::IcebergTable::new(location.clone());
    let (_, cut) = cut_off(args.older_than);
    let (removed, recent) = if table.current().await?.is_some() {
        let out = table
            .remove_orphans(cut)
            .await
            .with_context(|| format!("removing orphans of {}", args.url))?;
        (out.removed, out.recent)
    } else {
        let out = ferry_export::upkeep::remove_orphans(&location, cut)
            .await
            .with_context(|| format!("removing orphans of {}", args.url))?;
        (out.removed, out.recent)
    };
    let out = Orphans { removed, recent };
    for key in &out.removed {
        println!("removed {key}");
    }
    println!(
        "{}: {} orphan data files removed, {} newer than the cut-off kept",
        args.url,
        out.removed.len(),
        out.recent
    );
    Ok(())
}

/// What `ferry lake remove-orphans` removed, of either format.
struct Orphans {
    removed: Vec<String>,
    recent: usize,
}

async fn expire_snapshots(args: ExpireArgs) -> anyhow::Result<()> {
    let location = open_to_read(&args.url)?;
    let table = ferry_iceberg::IcebergTable::new(location.clone());
    let (now_ms, cut) = cut_off(args.older_than);
    if table.current().await?.is_none() {
        // A Parquet destination: its superseded commit files.
        let cut_seconds = u64::try_from(cut / 1000).unwrap_or(0);
        let out = ferry_export::upkeep::expire_commits(&location, cut_seconds)
            .await
            .with_context(|| format!("expiring superseded commits of {}", args.url))?;
        for key in &out.removed {
            println!("removed {key}");
        }
        println!(
            "{}: {} superseded commit files expired, {} superseded later kept",
            args.url,
            out.removed.len(),
            out.kept
        );
        return Ok(());
    }
    match table
        .expire_snapshots(cut, now_ms)
        .await
        .with_context(|| format!("expiring snapshots of {}", args.url))?
    {
        ferry_iceberg::ExpireOutcome::NoTable => {
            anyhow::bail!(
                "{}: no Iceberg table (no metadata/vN.metadata.json)",
                args.url
            )
        }
        ferry_iceberg::ExpireOutcome::Nothing { version } => {
            println!(
                "{}: no snapshot to expire (metadata version {version})",
                args.url
            )
        }
        ferry_iceberg::ExpireOutcome::Expired { version, expired } => println!(
            "{}: {expired} snapshots expired, metadata version {version}",
            args.url
        ),
    }
    Ok(())
}

/// `ferry lake files` of an Iceberg table: the live data files of its
/// current snapshot.
async fn iceberg_files(
    args: &LakeFilesArgs,
    table: &ferry_iceberg::IcebergTable,
    version: u64,
    meta: &ferry_iceberg::spec::TableMetadata,
) -> anyhow::Result<()> {
    let mut files = table
        .files()
        .await
        .with_context(|| format!("reading {}", args.url))?;
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let base = table.location().url().trim_end_matches('/').to_string();
    if let Some(partition) = &args.partition {
        // ferry writes a partition's files under `data/<column>[_<transform>]=<id>/`.
        files.retain(|f| {
            table
                .key_of(&f.path)
                .strip_prefix("data/")
                .and_then(|rest| rest.split('/').next())
                .and_then(|folder| folder.split_once('='))
                .is_some_and(|(_, id)| id == partition)
        });
    }
    let name = |url: &str| -> String {
        if args.full {
            url.strip_prefix("file://").unwrap_or(url).to_string()
        } else {
            url.strip_prefix(&base)
                .map_or(url, |rest| rest.trim_start_matches('/'))
                .to_string()
        }
    };
    if args.json {
        let files: Vec<serde_json::Value> = files
            .iter()
            .map(|f| {
                json!({
                    "path": name(&f.path),
                    "rows": f.record_count,
                    "bytes": f.file_size_in_bytes,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "destination": args.url,
                "format": "iceberg",
                "metadata_version": version,
                "snapshot_id": meta.current_snapshot_id,
                "files": files,
            }))?
        );
    } else {
        for f in &files {
            println!("{}", name(&f.path));
        }
    }
    Ok(())
}

/// What a relative path is appended to for a full name.
fn full_base(url: &str) -> String {
    match url.strip_prefix("file://") {
        Some(dir) => dir.trim_end_matches('/').to_string(),
        None => url.trim_end_matches('/').to_string(),
    }
}
