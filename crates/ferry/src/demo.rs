//! `ferry dev --demo`: what ferry does, shown on a running `ferry dev` through
//! its own HTTP API: a table partitioned by month, generated rows over 12
//! months inserted in batches, both replicas applying them, their
//! partitions and parts compared, and one partition exported to the lake
//! folder, with the status table and one-liners that read exactly the
//! committed files.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use ferry_client::Client;
use ferry_table::TableDef;

const TABLE: &str = r#"
name = "demo_events"
partition_by = { column = "ts", transform = "month" }
shard_by = { column = "user_id", shards = 2 }
replicas = 2
[[columns]]
name = "ts"
type = "Timestamp"
[[columns]]
name = "user_id"
type = "Int64"
[[columns]]
name = "amount"
type = "Float64"
[[columns]]
name = "country"
type = "Utf8"
[[columns]]
name = "note"
type = "Utf8"
nullable = true
"#;

const BATCH_ROWS: usize = 100_000;
const COUNTRIES: [&str; 6] = ["DE", "FR", "JP", "US", "BR", "IN"];

fn batch(def: &TableDef, start: usize, n: usize) -> anyhow::Result<RecordBatch> {
    // 2025-01-01T00:00:00Z; rows spread evenly over 12 months of 2025.
    let t0 = 1_735_689_600_000_000i64;
    let year = 365 * 86_400_000_000i64;
    let ids = start..start + n;
    Ok(RecordBatch::try_new(
        def.arrow_schema(),
        vec![
            Arc::new(
                TimestampMicrosecondArray::from_iter_values(
                    ids.clone().map(|i| t0 + (i as i64 * 7_919_993_177) % year),
                )
                .with_timezone(ferry_table::def::UTC),
            ),
            Arc::new(Int64Array::from_iter_values(
                ids.clone().map(|i| (i % 100_003) as i64),
            )),
            Arc::new(Float64Array::from_iter_values(
                ids.clone().map(|i| (i % 10_000) as f64 / 100.0),
            )),
            Arc::new(StringArray::from_iter_values(
                ids.clone().map(|i| COUNTRIES[i % COUNTRIES.len()]),
            )),
            Arc::new(StringArray::from_iter(
                ids.map(|i| (i % 3 == 0).then(|| format!("order {i}"))),
            )),
        ],
    )?)
}

pub async fn run(url: &str, rows: usize, lake_url: &str) -> anyhow::Result<()> {
    let client = Client::new(url, None, Duration::from_secs(120))?;
    let def = TableDef::from_toml(TABLE)?;
    let (table, created) = client.create_table(&def).await?;
    say!(
        "demo: table {} (id {}) {}, partitioned by month of ts, 2 shards",
        table.def.name,
        table.id,
        if created { "created" } else { "already there" }
    );
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(rows as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {pos}/{len} rows ({per_sec}, {elapsed})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let started = Instant::now();
    let mut last = None;
    let mut sent = 0;
    // Every run of the demo inserts new rows: its keys are unique to the run.
    let run_id = format!(
        "{:x}",
        started.elapsed().as_nanos() ^ u128::from(std::process::id())
    );
    while sent < rows {
        let n = BATCH_ROWS.min(rows - sent);
        let b = batch(&def, sent, n)?;
        let key = format!("demo-{run_id}-{sent}");
        let inserted = client
            .insert_batch(&def.name, &b, Some(&key))
            .await
            .with_context(|| format!("inserting rows {sent}..{}", sent + n))?;
        last = Some(inserted.commit_lsn);
        sent += n;
        match &bar {
            Some(bar) => bar.set_position(sent as u64),
            None => say!("demo: inserted {sent} of {rows} rows"),
        }
    }
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let inserted_in = started.elapsed();
    let commit = last.context("no rows to insert")?;
    say!(
        "demo: inserted {rows} rows in {:.1} s ({:.0} rows/s), committed up to {commit}",
        inserted_in.as_secs_f64(),
        rows as f64 / inserted_in.as_secs_f64().max(1e-9)
    );
    // Both replicas apply everything committed.
    let mut listings = Vec::new();
    for replica in 0..2 {
        let n = client
            .count(&def.name, None, replica, Some(&commit))
            .await
            .with_context(|| format!("waiting for replica {replica}"))?;
        say!(
            "demo: replica {replica} applied up to {commit} after {:.1} s: {n} rows in the table",
            started.elapsed().as_secs_f64()
        );
    }
    // Merges run in the background; they settle on the same parts everywhere.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pending = client.pending_merges().await?;
        if pending == 0 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "merges did not settle in 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for replica in 0..2 {
        listings.push(client.partitions(&def.name, replica).await?);
    }
    say!("demo: partitions on replica 0 (parts, rows):");
    for p in listings[0].as_array().into_iter().flatten() {
        say!(
            "  {}  {:>4} parts  {:>9} rows  {:>10} bytes",
            p["partition_id"].as_str().unwrap_or("?"),
            p["parts"].as_array().map_or(0, Vec::len),
            p["rows"].as_u64().unwrap_or(0),
            p["bytes"].as_u64().unwrap_or(0)
        );
    }
    let summary = |v: &serde_json::Value| -> Vec<(String, u64)> {
        v.as_array()
            .into_iter()
            .flatten()
            .flat_map(|p| p["parts"].as_array().cloned().unwrap_or_default())
            .map(|part| {
                let n = &part["name"];
                (
                    format!(
                        "{}_{}_{}_{}",
                        n["partition_id"].as_str().unwrap_or("?"),
                        n["min_block"],
                        n["max_block"],
                        n["level"]
                    ),
                    part["checksum"].as_u64().unwrap_or(0),
                )
            })
            .collect()
    };
    let (a, b) = (summary(&listings[0]), summary(&listings[1]));
    anyhow::ensure!(
        a == b,
        "the replicas differ: {} parts on replica 0, {} on replica 1",
        a.len(),
        b.len()
    );
    say!(
        "demo: merges settled; both replicas hold the same {} parts, name for name and checksum for checksum",
        a.len()
    );
    // One partition to the lake, exactly once, shared by both replicas.
    let partition = listings[0]
        .as_array()
        .and_then(|ps| ps.first())
        .and_then(|p| p["partition_id"].as_str())
        .context("no partition to export")?
        .to_string();
    let created: ferry_node::exports::CreatedBody = client
        .post_json(
            "/exports",
            &serde_json::json!({
                "table": def.name,
                "partition_id": partition,
                "destination": lake_url,
                "force": true,
            }),
        )
        .await
        .context("exporting a partition")?;
    let first = created.created.first().context("no export created")?;
    let tx = first.transaction_id.clone();
    if let Some(commit) = &first.unchanged {
        say!("demo: partition {partition} in {lake_url} unchanged: {commit} holds its parts");
    } else {
        wait_for_export(&client, &partition, lake_url, &tx).await?;
    }
    show_lake(lake_url, &partition).await?;
    say!(
        "demo: done in {:.1} s. Next: `ferry dev` (without --demo), `ferry query partitions demo_events`, `ferry export demo_events <partition> --to {lake_url} --wait`",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Waits (at most 120 s) until the demo's export ends, and prints it.
async fn wait_for_export(
    client: &ferry_client::Client,
    partition: &str,
    lake_url: &str,
    tx: &str,
) -> anyhow::Result<()> {
    say!("demo: export of partition {partition} to {lake_url} created (transaction {tx})");
    let deadline = Instant::now() + Duration::from_secs(120);
    let task = loop {
        let view: ferry_export::ExportsView = client.get_typed("/exports").await?;
        if let Some(t) = view
            .tasks
            .iter()
            .find(|t| t.transaction_id == tx && t.status.is_terminal())
        {
            break t.clone();
        }
        anyhow::ensure!(Instant::now() < deadline, "the export did not end in 120 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for line in crate::export_cmd::table_of(std::slice::from_ref(&task)).lines() {
        say!("{line}");
    }
    anyhow::ensure!(
        task.status == ferry_export::TaskStatus::Completed,
        "the export ended {}",
        task.status
    );
    Ok(())
}

/// The lake as a reader sees it, and the recipes that read it.
async fn show_lake(lake_url: &str, partition: &str) -> anyhow::Result<()> {
    let lake = ferry_storage::open(lake_url, &ferry_host::s3_settings_from_env())?;
    let view = ferry_export::lake::read(&lake, Some(partition)).await?;
    let current = view
        .partitions
        .first()
        .context("no commit of the partition in the lake")?;
    let report = ferry_export::verify::verify(&lake, ferry_export::verify::Depth::Bytes).await?;
    say!(
        "demo: the lake holds {} current commits; verify: {} files checked, {} mismatches, {} orphans",
        report.commits.len(),
        report.files_checked,
        report.problems.len(),
        report.orphans.len()
    );
    say!(
        "demo: {} rows of partition {partition} in {} files listed by {}; read exactly what `ferry lake files` prints:",
        current.current.file.rows,
        current.current.file.files.len(),
        current.current.key
    );
    say!(
        "  files=$(ferry lake files {lake_url} --full | sed \"s/.*/'&'/\" | paste -sd, -); duckdb -c \"SELECT count(*) FROM read_parquet([$files], hive_partitioning = false)\""
    );
    say!(
        "  ferry lake files {lake_url} --full | python3 -c \"import sys, pandas as pd; print(len(pd.concat(pd.read_parquet(l.strip()) for l in sys.stdin)))\""
    );
    Ok(())
}
