//! An export through `ferry dev` (the embedded defaults: coordination store,
//! local lake, replicas in one process) survives a SIGKILL of the whole
//! process in the middle: restarted on its data dir, it finishes the same
//! task, with one commit file listing every part once and nothing else in
//! the partition's folder (no staging file of a write the kill cut).

mod common;

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use ferry_client::Client;
use ferry_table::Format;

const TABLE: &str = r#"
name = "t"
partition_by = { column = "p", transform = "identity" }
shard_by = { column = "id", shards = 2 }
replicas = 1

[[columns]]
name = "id"
type = "Int64"
[[columns]]
name = "p"
type = "Utf8"
"#;

fn base_url(lines: &[String]) -> String {
    status_url(lines).trim_end_matches("/status").to_string()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The task of `partition` in the node's status listing.
fn task(rt: &tokio::runtime::Runtime, c: &Client, partition: &str) -> Option<serde_json::Value> {
    let view = rt.block_on(c.get_json("/exports")).expect("exports");
    view["tasks"]
        .as_array()
        .expect("tasks")
        .iter()
        .find(|t| t["partition_id"] == partition)
        .cloned()
}

#[test]
fn an_export_survives_kill_9_of_ferry_dev_in_the_middle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let lake = dir.path().join("lake");
    let lake_url = format!("file://{}", lake.display());
    let rt = runtime();
    let (mut child, lines) = start_dev(&data);
    let mut url = base_url(&lines);
    rt.block_on(async {
        let c = Client::new(&url, None, Duration::from_secs(30)).expect("client");
        c.create_table_toml(TABLE).await.expect("create table");
    });

    // Each try: a partition of many parts exported one part at a time, and
    // the process killed as soon as some but not all are exported.
    let mut landed = false;
    for attempt in 0..4i64 {
        let partition = format!("x{attempt}");
        let c = Client::new(&url, None, Duration::from_secs(30)).expect("client");
        for batch in 0..40i64 {
            let first = 10_000 * attempt + batch * 10;
            let body: String = (first..first + 10)
                .map(|id| format!("{{\"id\":{id},\"p\":\"{partition}\"}}\n"))
                .collect();
            rt.block_on(c.insert_body(
                "t",
                Format::Ndjson,
                Bytes::from(body),
                Some(&format!("k-{attempt}-{batch}")),
            ))
            .expect("insert");
        }
        let out = Command::new(FERRY)
            .args([
                "export",
                "t",
                &partition,
                "--to",
                &lake_url,
                "--parallelism",
                "1",
            ])
            .env("FERRY_URL", &url)
            .stdin(Stdio::null())
            .output()
            .expect("ferry export");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        let before = loop {
            if let Some(t) = task(&rt, &c, &partition) {
                let (count, left) = (
                    t["parts_count"].as_u64().expect("count"),
                    t["parts_to_do"].as_u64().expect("to do"),
                );
                if left < count || t["status"] != "PENDING" {
                    break t;
                }
            }
            assert!(Instant::now() < deadline, "no part exported in time");
        };
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        let tx = before["transaction_id"]
            .as_str()
            .expect("transaction")
            .to_string();
        eprintln!(
            "attempt {attempt}: SIGKILL with the task {} and {} of {} parts left",
            before["status"], before["parts_to_do"], before["parts_count"]
        );

        let (restarted, lines) = start_dev(&data);
        child = restarted;
        url = base_url(&lines);
        let c = Client::new(&url, None, Duration::from_secs(30)).expect("client");
        let deadline = Instant::now() + Duration::from_secs(60);
        let done = loop {
            if let Some(t) = task(&rt, &c, &partition) {
                if t["status"] != "PENDING" {
                    break t;
                }
            }
            assert!(Instant::now() < deadline, "the export did not end");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(done["status"], "COMPLETED", "{done}");
        assert_eq!(done["transaction_id"], tx.as_str(), "the same task");

        // One commit file, each part once, nothing else: not even the
        // staging file of a write the kill cut (the commit removed it).
        let commits: Vec<serde_json::Value> = std::fs::read_dir(&lake)
            .expect("lake")
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("commit_{partition}_"))
            })
            .map(|e| serde_json::from_slice(&std::fs::read(e.path()).expect("read")).expect("json"))
            .collect();
        assert_eq!(commits.len(), 1, "{commits:?}");
        assert_eq!(commits[0]["rows"], 400, "{}", commits[0]);
        let listed: BTreeSet<String> = commits[0]["files"]
            .as_array()
            .expect("files")
            .iter()
            .map(|f| f["path"].as_str().expect("path").to_string())
            .collect();
        let on_disk: BTreeSet<String> = std::fs::read_dir(lake.join(format!("p={partition}")))
            .expect("partition folder")
            .filter_map(Result::ok)
            .map(|e| format!("p={partition}/{}", e.file_name().to_string_lossy()))
            .collect();
        assert_eq!(on_disk, listed, "each part once, nothing else");
        // In the middle: the restarted process exported parts of the task.
        let view = rt.block_on(c.get_json("/exports")).expect("exports");
        let after_restart = view["counters"]["parts_exported"]
            .as_u64()
            .expect("counter");
        eprintln!("attempt {attempt}: the restarted process exported {after_restart} parts");
        if after_restart > 0 {
            landed = true;
            break;
        }
    }
    assert!(
        landed,
        "the SIGKILL never landed in the middle of an export"
    );
    let out = Command::new(FERRY)
        .args(["verify", &lake_url, "--deep"])
        .env("FERRY_URL", &url)
        .output()
        .expect("verify");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    interrupt(&child);
    assert_clean_exit(&mut child, &data);
}
