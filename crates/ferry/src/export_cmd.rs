//! `ferry export`, `ferry exports` and `ferry verify`: the export client
//! commands (the first two talk to a node over HTTP; verify reads the
//! destination itself).

use std::time::Duration;

use anyhow::Context;
use ferry_export::model::{Compression, ExportSettings, FileExistsPolicy};
use ferry_export::{ExportsView, TaskStatus, TaskView};
use serde_json::json;

use crate::client_cmd::ClientArgs;

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ExportArgs {
    #[command(subcommand)]
    pub command: Option<ExportCommand>,
    /// The table.
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
    /// Wait until the export ends, with a progress bar; exit non-zero unless COMPLETED.
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
        #[arg(long)]
        transaction_id: Option<String>,
        #[arg(long)]
        table: Option<String>,
        #[arg(long)]
        partition: Option<String>,
        #[arg(long)]
        to: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// Settings captured in the task's metadata.json (defaults in brackets).
#[derive(Debug, clap::Args)]
pub struct SettingsArgs {
    /// Seconds from creation after which a PENDING task is KILLED; 0 never [3600].
    #[arg(long)]
    pub task_timeout_secs: Option<u64>,
    /// Seconds from creation after which a finished task is removed [180].
    #[arg(long)]
    pub ttl_secs: Option<u64>,
    /// First back-off of a part after a retryable error, ms [5000].
    #[arg(long)]
    pub retry_initial_backoff_ms: Option<u64>,
    /// Largest back-off, ms [300000].
    #[arg(long)]
    pub retry_max_backoff_ms: Option<u64>,
    /// Retryable failures of a part before the task FAILS; 0 unlimited [0].
    #[arg(long)]
    pub max_retries: Option<u32>,
    /// Parts one replica exports at once [2].
    #[arg(long)]
    pub parallelism: Option<u32>,
    /// zstd (parts copied as they are), snappy, lz4 or none [zstd].
    #[arg(long)]
    pub compression: Option<Compression>,
    /// Rows per row group [131072].
    #[arg(long)]
    pub row_group_rows: Option<u64>,
    /// skip, error or overwrite a data file already there [skip].
    #[arg(long)]
    pub file_exists: Option<FileExistsPolicy>,
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
    let created: crate::exports::CreatedBody = client.post_json("/exports", &body).await?;
    for c in &created.created {
        println!(
            "export {} created: transaction {}, {} parts, {} rows (snapshot at {})",
            c.key,
            c.transaction_id,
            c.parts_count,
            c.rows,
            ferry_wal::Lsn(c.snapshot_lsn)
        );
    }
    if !args.wait {
        return Ok(());
    }
    let mut failed = Vec::new();
    for c in &created.created {
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
    /// Also read every listed file's rows and check their checksum.
    #[arg(long)]
    pub deep: bool,
    #[arg(long)]
    pub json: bool,
}

pub async fn verify(args: VerifyArgs) -> anyhow::Result<()> {
    let location = ferry_storage::open(&args.url, &Default::default())?;
    let report = ferry_export::verify::verify(&location, args.deep)
        .await
        .with_context(|| format!("reading {}", args.url))?;
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
