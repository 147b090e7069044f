//! Exports through `ferry dev` (the embedded defaults: coordination store,
//! local lake, replicas in one process): a manual export and a policy's
//! increment survive a SIGKILL of the whole process in the middle
//! (restarted on its data dir, it finishes the same task, each row once and
//! no staging file of a write the kill cut); re-exports, Iceberg readers,
//! export policies, compaction and retention.

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use ferry_client::Client;
use ferry_table::Format;
use ferry_testkit::table::id_p_toml;

/// Table `name`: `id` Int64 (`shards` shards), partitioned by `p` (Utf8),
/// one replica per shard.
fn table_toml(name: &str, shards: u32) -> String {
    id_p_toml(name, shards).replicas(1).toml()
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
    let (_dir, data) = fresh_data_dir();
    let lake = data.join("lake");
    let lake_url = format!("file://{}", lake.display());
    let rt = runtime();
    let (mut child, lines) = start_dev(&data);
    let mut url = base_url(&lines);
    rt.block_on(node_client(&url).create_table_toml(&table_toml("t", 2)))
        .expect("create table");

    // Each try: a partition of many parts exported one part at a time, and
    // the process killed as soon as some but not all are exported.
    let mut landed = false;
    for attempt in 0..4i64 {
        let partition = format!("x{attempt}");
        let c = node_client(&url);
        for batch in 0..40i64 {
            let first = 10_000 * attempt + batch * 10;
            insert_ids(
                &rt,
                &c,
                first..first + 10,
                &partition,
                &format!("k-{attempt}-{batch}"),
            );
        }
        let (ok, out, err) = export_part_by_part(&url, "t", &partition, &lake_url);
        assert!(ok, "{out}{err}");
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
        let c = node_client(&url);
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
        let commits = commit_files(&lake, &format!("commit_{partition}_"));
        assert_eq!(commits.len(), 1, "{commits:?}");
        assert_eq!(commits[0]["rows"], 400, "{}", commits[0]);
        let (listed, on_disk) = listed_and_on_disk(&lake, &format!("p={partition}"), &commits[0]);
        assert_eq!(on_disk, listed, "each part once, nothing else");
        // In the middle: the restarted process exported parts of the task.
        let view = rt.block_on(c.get_json("/exports")).expect("exports");
        let after_restart = parts_exported(&view);
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
    ferry_ok(&["verify", &lake_url, "--deep"], &url);
    stop_dev(&mut child, &data);
}

/// The policy's PENDING task of `partition` in the node's status listing.
fn pending_policy_task(
    rt: &tokio::runtime::Runtime,
    c: &Client,
    partition: &str,
) -> Option<serde_json::Value> {
    let view = rt.block_on(c.get_json("/exports")).ok()?;
    view["tasks"]
        .as_array()?
        .iter()
        .find(|t| {
            t["partition_id"] == partition && t["by_policy"] == true && t["status"] == "PENDING"
        })
        .cloned()
}

/// A table that exports itself survives kill -9 of `ferry dev` in the
/// middle of an increment (the policy's task created, its commit not yet
/// written): restarted on its data dir, the same task ends, the rows
/// inserted since follow in later increments, and the lake holds every
/// acknowledged row once as `ferry lake files` lists it all along;
/// `ferry verify --deep` is clean.
#[test]
fn a_policy_increment_survives_kill_9_of_ferry_dev_in_the_middle() {
    let (_dir, data) = fresh_data_dir();
    let lake_url = format!("file://{}", data.join("lake/auto").display());
    let rt = runtime();
    let (mut child, lines) = start_dev(&data);
    let mut url = base_url(&lines);
    rt.block_on(node_client(&url).create_table_toml(&table_toml("t", 2)))
        .expect("create table");
    ferry_ok(
        &[
            "table",
            "set-export",
            "t",
            "--to",
            &lake_url,
            "--freshness",
            "1s",
        ],
        &url,
    );
    let mut expected: Vec<i64> = Vec::new();
    let mut next = 0i64;
    let mut insert = |c: &Client, expected: &mut Vec<i64>| {
        insert_ids(&rt, c, next..next + 10, "y", &format!("y{next}"));
        expected.extend(next..next + 10);
        next += 10;
    };
    let mut landed = None;
    for attempt in 0..5 {
        let c = node_client(&url);
        // Commits to increment over: the next one carries their files.
        for _ in 0..3 {
            insert(&c, &mut expected);
        }
        wait_for_lake(&lake_url, &url, &expected);
        // More rows, one batch at a time, until the policy's task for them
        // is seen in flight: then SIGKILL.
        let mut seen = None;
        for _ in 0..30 {
            insert(&c, &mut expected);
            let deadline = Instant::now() + Duration::from_millis(1500);
            while seen.is_none() && Instant::now() < deadline {
                seen = pending_policy_task(&rt, &c, "y");
            }
            if seen.is_some() {
                break;
            }
        }
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        let (restarted, lines) = start_dev(&data);
        child = restarted;
        url = base_url(&lines);
        let c = node_client(&url);
        // Rows while the interrupted task finishes.
        insert(&c, &mut expected);
        wait_for_lake(&lake_url, &url, &expected);
        let Some(task) = seen else {
            eprintln!("attempt {attempt}: no policy task seen in flight");
            continue;
        };
        // The interrupted task committed (its listing may be replaced by a
        // later increment's by now; its commit file stays a while).
        let committed = commit_files(&data.join("lake/auto"), "commit_y_")
            .into_iter()
            .any(|commit| commit["transaction_id"] == task["transaction_id"]);
        eprintln!(
            "attempt {attempt}: SIGKILL with policy task {} ({} of {} parts left, {} carried); committed after the restart: {committed}",
            task["transaction_id"], task["parts_to_do"], task["parts_count"], task["carried"]
        );
        assert!(
            committed,
            "the interrupted increment {task} never committed"
        );
        landed = Some(task);
        break;
    }
    assert!(
        landed.is_some(),
        "no SIGKILL landed while an increment was in flight"
    );
    ferry_ok(&["verify", &lake_url, "--deep"], &url);
    stop_dev(&mut child, &data);
}

/// `ferry dev` on a fresh data dir with table `t` created from `toml`.
struct Dev {
    dir: tempfile::TempDir,
    data: std::path::PathBuf,
    rt: tokio::runtime::Runtime,
    child: Proc,
    url: String,
    client: Client,
}

impl Dev {
    fn start(toml: &str) -> Dev {
        let (dir, data) = fresh_data_dir();
        let rt = runtime();
        let (child, lines) = start_dev(&data);
        let url = base_url(&lines);
        let client = node_client(&url);
        rt.block_on(client.create_table_toml(toml))
            .expect("create table");
        Dev {
            dir,
            data,
            rt,
            child,
            url,
            client,
        }
    }

    /// Ctrl-C, and a clean exit.
    fn stop(mut self) {
        stop_dev(&mut self.child, &self.data);
    }
}

/// The ids in the Parquet files at `paths` (absolute), with repeats.
fn ids_in(paths: &[String]) -> Vec<i64> {
    use arrow::array::AsArray;
    let mut ids = Vec::new();
    for path in paths {
        let file = std::fs::File::open(path).expect("data file");
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
            .expect("parquet")
            .build()
            .expect("reader");
        for batch in reader {
            let batch = batch.expect("batch");
            let col = batch.column_by_name("id").expect("id column");
            ids.extend(
                col.as_primitive::<arrow::datatypes::Int64Type>()
                    .values()
                    .iter(),
            );
        }
    }
    ids
}

/// Inserts the rows of `ids` into `partition` of table `t` under `key`.
fn insert_ids(
    rt: &tokio::runtime::Runtime,
    c: &Client,
    ids: std::ops::Range<i64>,
    partition: &str,
    key: &str,
) {
    let body: String = ids
        .map(|id| format!("{{\"id\":{id},\"p\":\"{partition}\"}}\n"))
        .collect();
    rt.block_on(c.insert_body("t", Format::Ndjson, Bytes::from(body), Some(key)))
        .expect("insert");
}

/// The reader's side of a re-export: export a partition, insert until the
/// exported parts are merged, export it again. Two commit files now list
/// files holding the same rows (the level-0 parts, then the level-1 part
/// merged from them); what `ferry lake files` lists, what `ferry verify`
/// counts and what a reader of those files reads hold every row once. An
/// export of unchanged parts then changes nothing.
#[test]
fn a_re_export_after_merges_supersedes_and_readers_count_every_row_once() {
    let dev = Dev::start(&table_toml("t", 1));
    let (dir, rt, c, url) = (&dev.dir, &dev.rt, &dev.client, dev.url.clone());
    let lake = dev.data.join("lake");
    let lake_url = format!("file://{}", lake.display());
    let insert = |batch: i64| {
        insert_ids(
            rt,
            c,
            batch * 10..batch * 10 + 10,
            "a",
            &format!("b{batch}"),
        )
    };
    for batch in 0..3 {
        insert(batch);
    }
    ferry_ok(&["export", "t", "a", "--to", &lake_url, "--wait"], &url);
    // Eight level-0 parts merge into one level-1 part.
    for batch in 3..8 {
        insert(batch);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let parts = rt.block_on(c.partitions("t", 0)).expect("partitions");
        let levels: Vec<u64> = parts[0]["parts"]
            .as_array()
            .expect("parts")
            .iter()
            .map(|p| p["name"]["level"].as_u64().expect("level"))
            .collect();
        if levels == [1] {
            break;
        }
        assert!(Instant::now() < deadline, "no merge: {parts}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let forced = ferry_ok(
        &["export", "t", "a", "--to", &lake_url, "--force", "--wait"],
        &url,
    );
    assert!(forced.contains("COMPLETED"), "{forced}");

    // Two commit files: their union holds the first 30 rows twice.
    let commits = commit_files(&lake, "commit_a_");
    assert_eq!(commits.len(), 2, "{commits:?}");
    let union: Vec<String> = commits
        .iter()
        .flat_map(|c| c["files"].as_array().expect("files").clone())
        .map(|f| format!("{}/{}", lake.display(), f["path"].as_str().expect("path")))
        .collect();
    assert_eq!(ids_in(&union).len(), 110, "the union double-counts");

    // What a reader is told to read: every row once.
    let listed = ferry_ok(&["lake", "files", &lake_url, "--full"], &url);
    let files: Vec<String> = listed.lines().map(str::to_string).collect();
    assert_eq!(files.len(), 1, "{listed}");
    assert!(files[0].contains("/p=a/a_"), "{listed}");
    let mut ids = ids_in(&files);
    ids.sort_unstable();
    assert_eq!(ids, (0..80).collect::<Vec<i64>>());
    let relative = ferry_ok(&["lake", "files", &lake_url, "--partition", "a"], &url);
    assert_eq!(
        relative.trim(),
        files[0]
            .strip_prefix(&format!("{}/", lake.display()))
            .expect("under the lake")
    );
    let json: serde_json::Value =
        serde_json::from_str(&ferry_ok(&["lake", "files", &lake_url, "--json"], &url))
            .expect("json");
    let p = &json["partitions"][0];
    assert_eq!(p["rows"], 80, "{json}");
    assert_eq!(
        p["superseded"].as_array().expect("superseded").len(),
        1,
        "{json}"
    );

    let verified = ferry_ok(&["verify", &lake_url, "--deep"], &url);
    assert!(
        verified.contains("1 data files checked, 80 rows"),
        "{verified}"
    );
    assert!(verified.contains("superseded"), "{verified}");

    // The same parts again: nothing to do, nothing written.
    let again = ferry_ok(
        &["export", "t", "a", "--to", &lake_url, "--force", "--wait"],
        &url,
    );
    assert!(again.contains("unchanged"), "{again}");
    let commits_after = commit_files(&lake, "commit_a_").len();
    assert_eq!(commits_after, 2);

    // One byte flipped in the middle of the current file's data (before its
    // footer): the footer still agrees, the whole-file checksum does not.
    let mut bytes = std::fs::read(&files[0]).expect("read");
    let n = bytes.len();
    let footer = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().expect("4 bytes")) as usize;
    let middle = (4 + (n - 8 - footer)) / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&files[0], &bytes).expect("write");
    for (args, fails) in [
        (vec!["verify", &lake_url], true),
        (vec!["verify", &lake_url, "--deep"], true),
        (vec!["verify", &lake_url, "--quick"], false),
    ] {
        let out = Command::new(FERRY).args(&args).output().expect("verify");
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(!out.status.success(), fails, "{args:?}: {text}");
        if fails {
            assert!(text.contains("whole-file crc32c"), "{args:?}: {text}");
        }
    }

    // A location nothing was exported to is an error, not an empty lake.
    let missing = format!("file://{}", dir.path().join("nowhere").display());
    let out = Command::new(FERRY)
        .args(["verify", &missing])
        .output()
        .expect("verify");
    assert!(failed(&out).contains("no such directory"));
    assert!(!dir.path().join("nowhere").exists(), "verify created it");
    dev.stop();
}

/// A request names any URL and the node may run as root: a local
/// destination outside the export roots (`<data dir>/lake` by default) is
/// refused before anything is created, a link inside a root that leads out
/// of it too, and a refusal leaves the node as responsive as before.
#[test]
fn local_destinations_outside_the_export_roots_are_refused_and_nothing_is_written() {
    let dev = Dev::start(&table_toml("t", 2));
    let (dir, data, rt, c, url) = (&dev.dir, &dev.data, &dev.rt, &dev.client, &dev.url);
    rt.block_on(c.insert_body(
        "t",
        Format::Ndjson,
        Bytes::from_static(b"{\"id\":1,\"p\":\"a\"}\n"),
        None,
    ))
    .expect("insert");
    let outside = dir.path().join("outside");
    let escape_target = dir.path().join("elsewhere");
    std::fs::create_dir_all(&escape_target).expect("mkdir");
    std::fs::create_dir_all(data.join("lake")).expect("mkdir");
    std::os::unix::fs::symlink(&escape_target, data.join("lake/escape")).expect("symlink");
    let etc_before: BTreeSet<String> = std::fs::read_dir("/etc")
        .expect("/etc")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    for to in [
        format!("file://{}", outside.display()),
        format!("file://{}/x", data.join("lake/escape").display()),
        "file:///etc".to_string(),
        "file:///".to_string(),
        "file:///proc/self".to_string(),
    ] {
        let (ok, _, err) = ferry(&["export", "t", "a", "--to", &to], url);
        assert!(!ok, "{to} accepted");
        assert!(err.contains("export root"), "{to}: {err}");
    }
    assert!(!outside.exists(), "a refused destination was created");
    assert_eq!(
        std::fs::read_dir(&escape_target).expect("dir").count(),
        0,
        "written through the link"
    );
    let etc_after: BTreeSet<String> = std::fs::read_dir("/etc")
        .expect("/etc")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(etc_before, etc_after);
    let view = rt.block_on(c.get_json("/exports")).expect("exports");
    assert_eq!(view["tasks"].as_array().expect("tasks").len(), 0, "{view}");
    // Inside the root: exported.
    let inside = format!("file://{}", data.join("lake/events").display());
    let done = ferry_ok(&["export", "t", "a", "--to", &inside, "--wait"], url);
    assert!(done.contains("COMPLETED"), "{done}");
    dev.stop();
}

/// `--all-partitions`: one task, with its own transaction id, per
/// partition; a partition whose export is still unexpired is skipped and
/// said so, not a refusal of the whole request; `--wait` waits for every
/// task.
#[test]
fn every_partition_gets_its_own_task_and_an_unexpired_one_is_skipped() {
    let dev = Dev::start(&table_toml("t", 2));
    let (rt, c, url) = (&dev.rt, &dev.client, dev.url.clone());
    let lake_url = format!("file://{}", dev.data.join("lake/all").display());
    let body: String = ["a", "b", "c"]
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            (0..5).map(move |j| format!("{{\"id\":{},\"p\":\"{p}\"}}\n", i * 10 + j))
        })
        .collect();
    rt.block_on(c.insert_body("t", Format::Ndjson, Bytes::from(body), None))
        .expect("insert");
    ferry_ok(&["export", "t", "a", "--to", &lake_url, "--wait"], &url);
    let out = ferry_ok(
        &[
            "export",
            "t",
            "--all-partitions",
            "--to",
            &lake_url,
            "--wait",
        ],
        &url,
    );
    assert!(out.contains("export of partition a skipped"), "{out}");
    let created: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(" created: transaction "))
        .collect();
    assert_eq!(created.len(), 2, "{out}");
    let view = rt.block_on(c.get_json("/exports")).expect("exports");
    let tasks = view["tasks"].as_array().expect("tasks");
    assert_eq!(tasks.len(), 3, "{view}");
    let ids: BTreeSet<&str> = tasks
        .iter()
        .map(|t| t["transaction_id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids.len(), 3, "one transaction id per task: {view}");
    assert!(tasks.iter().all(|t| t["status"] == "COMPLETED"), "{view}");
    let files = ferry_ok(&["lake", "files", &lake_url], &url);
    let folders: BTreeSet<&str> = files.lines().filter_map(|l| l.split('/').next()).collect();
    assert_eq!(folders, BTreeSet::from(["p=a", "p=b", "p=c"]), "{files}");

    // Tables named like a subcommand of `ferry export` (`kill`, `help`) are
    // exported too: after `--`, every word is the table and partition.
    for name in ["kill", "help"] {
        rt.block_on(c.create_table_toml(&table_toml(name, 2)))
            .expect("create table");
        rt.block_on(c.insert_body(
            name,
            Format::Ndjson,
            Bytes::from("{\"id\":1,\"p\":\"a\"}\n"),
            None,
        ))
        .expect("insert");
        let to = format!("file://{}", dev.data.join(format!("lake/{name}")).display());
        let out = ferry_ok(&["export", "--to", &to, "--wait", "--", name, "a"], &url);
        assert!(out.contains("COMPLETED"), "{out}");
    }
    dev.stop();
}

/// `--format iceberg`: partitions exported into an Iceberg table that
/// pyiceberg and DuckDB read (when `scripts/test.sh` installed them) with
/// every row once, before and after a partition is exported again over
/// merged parts; the same parts again change nothing; `ferry lake files`
/// and `ferry verify` read the table; a Parquet export into it is refused.
#[test]
fn an_iceberg_export_is_read_once_by_lake_readers_before_and_after_a_re_export() {
    let dev = Dev::start(&table_toml("t", 1));
    let (rt, c, url) = (&dev.rt, &dev.client, dev.url.clone());
    let root = dev.data.join("lake/ice");
    let lake_url = format!("file://{}", root.display());
    let insert = |batch: i64| {
        insert_ids(
            rt,
            c,
            batch * 10..batch * 10 + 10,
            "a",
            &format!("a{batch}"),
        )
    };
    (0..3).for_each(insert);
    insert_ids(rt, c, 1000..1005, "b", "b0");
    let out = ferry_ok(
        &[
            "export",
            "t",
            "--all-partitions",
            "--to",
            &lake_url,
            "--format",
            "iceberg",
            "--wait",
        ],
        &url,
    );
    assert_eq!(out.matches("COMPLETED").count(), 2, "{out}");
    let metadata = |version: u64| {
        root.join(format!("metadata/v{version}.metadata.json"))
            .display()
            .to_string()
    };
    let hint = || {
        std::fs::read_to_string(root.join("metadata/version-hint.text"))
            .expect("version hint")
            .trim()
            .parse::<u64>()
            .expect("a version")
    };
    assert_eq!(hint(), 2, "one snapshot per partition");
    let read = |version: u64, expected: serde_json::Value| {
        if let Some(got) =
            ferry_testkit::services::iceberg_row_counts(&metadata(version), "p", None)
        {
            assert_eq!(got["pyiceberg"], expected, "{got}");
            assert_eq!(got["duckdb"], expected, "{got}");
        }
    };
    read(2, serde_json::json!({"a": 30, "b": 5}));
    let files = ferry_ok(&["lake", "files", &lake_url], &url);
    assert_eq!(
        files.lines().filter(|l| l.starts_with("data/p=a/")).count(),
        3,
        "{files}"
    );
    assert_eq!(
        files.lines().filter(|l| l.starts_with("data/p=b/")).count(),
        1,
        "{files}"
    );
    let mut ids = ids_in(
        &files
            .lines()
            .map(|l| root.join(l).display().to_string())
            .collect::<Vec<_>>(),
    );
    ids.sort_unstable();
    assert_eq!(ids.len(), 35);

    // More rows; the parts merge; partition a is exported again: one
    // snapshot replaces its files.
    (3..8).for_each(insert);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let parts = rt.block_on(c.partitions("t", 0)).expect("partitions");
        let a = parts
            .as_array()
            .expect("partitions")
            .iter()
            .find(|p| p["partition_id"] == "a")
            .expect("partition a")
            .clone();
        if a["parts"].as_array().map(Vec::len) == Some(1) {
            break;
        }
        assert!(Instant::now() < deadline, "no merge: {parts}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let iceberg_a = [
        "export", "t", "a", "--to", &lake_url, "--format", "iceberg", "--force", "--wait",
    ];
    let forced = ferry_ok(&iceberg_a, &url);
    assert!(forced.contains("COMPLETED"), "{forced}");
    assert_eq!(hint(), 3);
    read(3, serde_json::json!({"a": 80, "b": 5}));
    // The snapshot before is still readable as it was (time travel).
    read(2, serde_json::json!({"a": 30, "b": 5}));
    let files = ferry_ok(&["lake", "files", &lake_url], &url);
    assert_eq!(
        files.lines().filter(|l| l.starts_with("data/p=a/")).count(),
        1,
        "{files}"
    );
    let verified = ferry_ok(&["verify", &lake_url], &url);
    assert!(
        verified.contains("2 data files checked, 85 rows"),
        "{verified}"
    );

    // The same parts again: nothing to do, no new version.
    let again = ferry_ok(&iceberg_a, &url);
    assert!(again.contains("unchanged"), "{again}");
    assert_eq!(hint(), 3);
    assert!(!root.join("metadata/v4.metadata.json").exists());

    // Re-encoded (another compression) rather than copied: the same rows.
    let root2 = dev.data.join("lake/ice-snappy");
    let url2 = format!("file://{}", root2.display());
    ferry_ok(
        &[
            "export",
            "t",
            "a",
            "--to",
            &url2,
            "--format",
            "iceberg",
            "--compression",
            "snappy",
            "--wait",
        ],
        &url,
    );
    let meta2 = root2
        .join("metadata/v1.metadata.json")
        .display()
        .to_string();
    if let Some(got) = ferry_testkit::services::iceberg_row_counts(&meta2, "p", None) {
        assert_eq!(got["pyiceberg"], serde_json::json!({"a": 80}), "{got}");
        assert_eq!(got["duckdb"], serde_json::json!({"a": 80}), "{got}");
    }
    let verified = ferry_ok(&["verify", &url2], &url);
    assert!(
        verified.contains("1 data files checked, 80 rows"),
        "{verified}"
    );

    // A byte of a data file's pages changed under the table: the sizes and
    // footers still agree, the rows do not (`--deep`).
    let files = ferry_ok(&["lake", "files", &lake_url, "--full"], &url);
    let b_file = files
        .lines()
        .find(|l| l.contains("/data/p=b/"))
        .expect("partition b's file")
        .to_string();
    let mut bytes = std::fs::read(&b_file).expect("read");
    let n = bytes.len();
    let footer = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().expect("4 bytes")) as usize;
    let middle = (4 + (n - 8 - footer)) / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&b_file, &bytes).expect("write");
    ferry_ok(&["verify", &lake_url], &url);
    let (ok, out, _) = ferry(&["verify", &lake_url, "--deep"], &url);
    assert!(
        !ok && out.contains("MISMATCH") && out.contains("data/p=b/"),
        "{out}"
    );
    bytes[middle] ^= 0x01;
    std::fs::write(&b_file, &bytes).expect("write");
    ferry_ok(&["verify", &lake_url, "--deep"], &url);

    // A Parquet export into the Iceberg table's folder is refused.
    let (ok, out, err) = ferry(&["export", "t", "b", "--to", &lake_url, "--force"], &url);
    assert!(!ok, "{out}");
    assert!(
        err.contains("its format is iceberg, this export's parquet"),
        "{err}"
    );

    // A table whose definition names the format: its exports need no flag.
    let toml = format!("{}\n[export]\nformat = \"iceberg\"\n", table_toml("u", 1));
    rt.block_on(c.create_table_toml(&toml))
        .expect("create table u");
    rt.block_on(c.insert_body(
        "u",
        Format::Ndjson,
        Bytes::from("{\"id\":1,\"p\":\"a\"}\n"),
        None,
    ))
    .expect("insert");
    let root_u = dev.data.join("lake/u");
    let url_u = format!("file://{}", root_u.display());
    let out = ferry_ok(&["export", "u", "a", "--to", &url_u, "--wait"], &url);
    assert!(out.contains("COMPLETED"), "{out}");
    assert!(root_u.join("metadata/v1.metadata.json").exists(), "{out}");
    // A bad format in a definition is refused, naming the field.
    let bad = format!("{}\n[export]\nformat = \"orc\"\n", table_toml("v", 1));
    let refused = rt.block_on(c.create_table_toml(&bad)).expect_err("refused");
    assert!(refused.to_string().contains("export.format"), "{refused}");
    dev.stop();
}

/// Every id in what `ferry lake files --full` lists for `lake_url`, with
/// repeats (empty while nothing is committed).
fn lake_ids(lake_url: &str, url: &str) -> Vec<i64> {
    let (ok, listed, _) = ferry(&["lake", "files", lake_url, "--full"], url);
    if !ok {
        return Vec::new();
    }
    let files: Vec<String> = listed.lines().map(str::to_string).collect();
    let mut ids = ids_in(&files);
    ids.sort_unstable();
    ids
}

/// Waits (up to a minute) until the lake at `lake_url`, as `ferry lake
/// files` lists it, holds exactly the ids `expected` (sorted); a row twice
/// in it at any time fails at once.
fn wait_for_lake(lake_url: &str, url: &str, expected: &[i64]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ids = lake_ids(lake_url, url);
        if ids == expected {
            return;
        }
        assert!(
            ids.windows(2).all(|w| w[0] != w[1]),
            "a row twice in the lake: {ids:?}"
        );
        assert!(Instant::now() < deadline, "the lake holds {ids:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A table with an export policy exports itself: inserts into two
/// partitions, with merges in between, reach the lake with nobody asking,
/// each row once as a reader reads it; idle partitions are compacted to one
/// file each; `/metrics` and `/status` show the
/// policy; a manual export to the same destination composes with it; a
/// table switched to Iceberg exports itself there and pyiceberg and DuckDB
/// read each row once.
#[test]
fn a_table_with_an_export_policy_exports_itself_and_readers_read_each_row_once() {
    let dev = Dev::start(&table_toml("t", 1));
    let (rt, c, url) = (&dev.rt, &dev.client, dev.url.clone());
    let lake = dev.data.join("lake/auto");
    let lake_url = format!("file://{}", lake.display());
    let set = ferry_ok(
        &[
            "table",
            "set-export",
            "t",
            "--to",
            &lake_url,
            "--freshness",
            "1s",
        ],
        &url,
    );
    assert!(set.contains("exports itself to"), "{set}");
    let shown = ferry_ok(&["table", "show", "t"], &url);
    assert!(shown.contains("freshness = \"1s\""), "{shown}");
    // Bad policies are refused, naming the field, and change nothing.
    let (ok, _, err) = ferry(&["table", "set-export", "t", "--to", "http://x/y"], &url);
    assert!(!ok && err.contains("export.to"), "{err}");
    let refused = rt
        .block_on(c.set_export(
            "t",
            &serde_json::json!({"to": &lake_url, "freshness": "0s"}),
        ))
        .expect_err("refused");
    assert!(
        refused.to_string().contains("export.freshness"),
        "{refused}"
    );
    assert_eq!(ferry_ok(&["table", "show", "t"], &url), shown);

    // Batches into two partitions; eight level-0 parts of `a` merge on the
    // way, combining exported and new rows.
    let mut expected = Vec::new();
    for batch in 0..11i64 {
        let partition = if batch % 4 == 3 { "b" } else { "a" };
        insert_ids(
            rt,
            c,
            batch * 10..batch * 10 + 10,
            partition,
            &format!("k{batch}"),
        );
        expected.extend(batch * 10..batch * 10 + 10);
        if batch % 3 == 2 {
            expected.sort_unstable();
            wait_for_lake(&lake_url, &url, &expected);
        }
    }
    expected.sort_unstable();
    wait_for_lake(&lake_url, &url, &expected);
    // Idle, the partitions are compacted: their parts merge on the replicas
    // up to the target (128 MiB: all of them) and the next increments
    // replace the lake's small files, each partition ending as one file,
    // every row once all along.
    let files_per_partition = || -> Vec<usize> {
        let (_, listed, _) = ferry(&["lake", "files", &lake_url, "--json"], &url);
        serde_json::from_str::<serde_json::Value>(&listed)
            .ok()
            .and_then(|v| {
                v["partitions"].as_array().map(|ps| {
                    ps.iter()
                        .map(|p| p["files"].as_array().map_or(0, Vec::len))
                        .collect()
                })
            })
            .unwrap_or_default()
    };
    let before = files_per_partition();
    assert!(
        before.iter().any(|n| *n > 1),
        "{before:?} files per partition"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while files_per_partition() != [1, 1] {
        assert_eq!(lake_ids(&lake_url, &url), expected);
        assert!(
            Instant::now() < deadline,
            "files per partition {:?}; status {}",
            files_per_partition(),
            http_get(&format!("{url}/status"))
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(lake_ids(&lake_url, &url), expected);
    let status: serde_json::Value =
        serde_json::from_str(&http_get(&format!("{url}/status"))).expect("status");
    assert!(
        status["replicas"][0]["merges_done"].as_u64() > Some(0),
        "no merge: {status}"
    );
    assert!(
        status["export_policies"]["t"]["compactions"].as_u64() >= Some(1),
        "{status}"
    );
    // Increments: a later commit of `a` lists files an earlier one wrote
    // (carried, not written again), and no data file was written twice.
    let mut commits = commit_files(&lake, "commit_a_");
    commits.sort_by_key(|c| c["sequence"].as_u64());
    let paths = |c: &serde_json::Value| -> BTreeSet<String> {
        c["files"]
            .as_array()
            .expect("files")
            .iter()
            .map(|f| f["path"].as_str().expect("path").to_string())
            .collect()
    };
    assert!(
        commits
            .windows(2)
            .any(|w| !paths(&w[0]).is_disjoint(&paths(&w[1]))),
        "no commit carried a file: {commits:?}"
    );
    ferry_ok(&["verify", &lake_url, "--deep"], &url);

    let metrics = http_get(&format!("{url}/metrics"));
    assert!(
        metrics.contains("ferry_export_lag_seconds{table=\"t\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ferry_export_policy_exports_total{table=\"t\"}"),
        "{metrics}"
    );
    let status: serde_json::Value =
        serde_json::from_str(&http_get(&format!("{url}/status"))).expect("status");
    let policy = &status["export_policies"]["t"];
    assert_eq!(policy["running_here"], true, "{status}");
    assert_eq!(policy["to"], lake_url.as_str(), "{status}");

    let listing = ferry_ok(&["exports"], &url);
    assert!(
        listing.contains("asked by the table's export policy"),
        "{listing}"
    );
    // A manual export of a partition the policy keeps current: unchanged
    // with --force, nothing written twice.
    let manual = ferry_ok(
        &["export", "t", "a", "--to", &lake_url, "--force", "--wait"],
        &url,
    );
    assert!(manual.contains("unchanged"), "{manual}");
    assert_eq!(lake_ids(&lake_url, &url), expected);

    // Upkeep: superseded commits expire (never a current one), the files
    // only they listed become orphans and go; readers read the same rows.
    let before = commit_files(&lake, "commit_").len();
    let expired = ferry_ok(
        &["lake", "expire-snapshots", &lake_url, "--older-than", "0s"],
        &url,
    );
    assert!(
        expired.contains("superseded commit files expired"),
        "{expired}"
    );
    assert_eq!(
        commit_files(&lake, "commit_").len(),
        2,
        "one per partition: {expired}"
    );
    assert!(before > 2, "{before} commit files before");
    assert_eq!(lake_ids(&lake_url, &url), expected);
    let removed = ferry_ok(
        &["lake", "remove-orphans", &lake_url, "--older-than", "0s"],
        &url,
    );
    assert!(removed.contains("orphan data files removed"), "{removed}");
    assert_eq!(lake_ids(&lake_url, &url), expected);
    let verified = ferry_ok(&["verify", &lake_url, "--deep"], &url);
    assert!(!verified.contains("orphan"), "{verified}");

    // The same table switched to an Iceberg destination.
    let ice = dev.data.join("lake/ice");
    let ice_url = format!("file://{}", ice.display());
    ferry_ok(
        &[
            "table",
            "set-export",
            "t",
            "--to",
            &ice_url,
            "--format",
            "iceberg",
            "--freshness",
            "1s",
        ],
        &url,
    );
    insert_ids(rt, c, 500..510, "b", "k-ice");
    let deadline = Instant::now() + Duration::from_secs(60);
    let metadata = loop {
        let listed = ferry(&["lake", "files", &ice_url, "--json"], &url);
        let rows: u64 = serde_json::from_str::<serde_json::Value>(&listed.1)
            .ok()
            .and_then(|v| {
                v["files"]
                    .as_array()
                    .map(|fs| fs.iter().map(|f| f["rows"].as_u64().unwrap_or(0)).sum())
            })
            .unwrap_or(0);
        if rows == 120 {
            let hint = std::fs::read_to_string(ice.join("metadata/version-hint.text"))
                .expect("version hint");
            break ice
                .join(format!("metadata/v{}.metadata.json", hint.trim()))
                .display()
                .to_string();
        }
        assert!(
            Instant::now() < deadline,
            "the Iceberg table: {}\nstatus: {}\nexports: {}",
            listed.1,
            http_get(&format!("{url}/status")),
            http_get(&format!("{url}/exports"))
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    if let Some(got) = ferry_testkit::services::iceberg_row_counts(&metadata, "p", None) {
        let expected = serde_json::json!({"a": 90, "b": 30});
        assert_eq!(got["pyiceberg"], expected, "{got}");
        assert_eq!(got["duckdb"], expected, "{got}");
    }
    // Off: the table stops exporting itself.
    let off = ferry_ok(&["table", "set-export", "t", "--off"], &url);
    assert!(off.contains("no export policy"), "{off}");
    dev.stop();
}

/// `GET path` on the node: (status code, body).
fn get_status(url: &str, path: &str) -> (u16, String) {
    let host = url.strip_prefix("http://").expect("http URL");
    let response = http_request(url, &format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n"));
    let text = String::from_utf8_lossy(&response).to_string();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// Retention: a partition whose rows the lake holds and which saw no rows
/// for the retention leaves the replicas; one receiving rows all along
/// stays. Reads of the retired partition answer 410 naming the lake files,
/// which hold its rows once; rows inserted into it later reach the lake
/// beside them (each row once), and it is retired again; a forced export of
/// it is refused. The policy's upkeep removes an old orphan data file.
#[test]
fn retention_drops_only_partitions_the_lake_holds_and_sends_their_reads_to_the_lake() {
    let dev = Dev::start(&table_toml("t", 1));
    let (rt, c, url) = (&dev.rt, &dev.client, dev.url.clone());
    let lake = dev.data.join("lake/kept");
    let lake_url = format!("file://{}", lake.display());
    // A data file no commit lists, last modified an hour ago (an upload of
    // an export that never committed): the policy's upkeep removes it.
    let orphan = lake.join("p=old/old_1_1_0_00000000.parquet");
    std::fs::create_dir_all(orphan.parent().expect("dir")).expect("mkdir");
    std::fs::write(&orphan, b"PAR1 not a real file").expect("orphan");
    let touched = Command::new("touch")
        .args(["-d", "1 hour ago"])
        .arg(&orphan)
        .status()
        .expect("touch");
    assert!(touched.success());
    let set = ferry_ok(
        &[
            "table",
            "set-export",
            "t",
            "--to",
            &lake_url,
            "--freshness",
            "1s",
            "--retention",
            "3s",
        ],
        &url,
    );
    assert!(set.contains("leave the replicas 3s after"), "{set}");
    for batch in 0..5i64 {
        insert_ids(
            rt,
            c,
            batch * 10..batch * 10 + 10,
            "old",
            &format!("o{batch}"),
        );
    }
    // `hot` gets rows every 300 ms: always newer than its last export.
    let mut hot = 0i64;
    let insert_hot = |n: &mut i64| {
        insert_ids(
            rt,
            c,
            10_000 + *n * 5..10_000 + *n * 5 + 5,
            "hot",
            &format!("h{n}"),
        );
        *n += 1;
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut most = 0;
    let gone = loop {
        insert_hot(&mut hot);
        let (code, body) = get_status(&url, "/tables/t/count?partition=old");
        if code == 410 {
            break body;
        }
        assert_eq!(code, 200, "{body}");
        // Until it leaves, every row applied stays readable on the
        // replicas (never a partly dropped partition read as whole).
        let count: serde_json::Value = serde_json::from_str(&body).expect("count");
        let rows = count["rows"].as_u64().expect("rows");
        assert!(rows >= most && rows <= 50, "{body} after {most} rows");
        most = rows;
        assert!(
            Instant::now() < deadline,
            "never retired: {}",
            http_get(&format!("{url}/status"))
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    let gone: serde_json::Value = serde_json::from_str(&gone).expect("410 body");
    assert_eq!(gone["kind"], "partition_retired", "{gone}");
    assert_eq!(gone["lake"]["rows"], 50, "{gone}");
    assert_eq!(gone["lake"]["destination"], lake_url.as_str(), "{gone}");
    let files: Vec<String> = gone["lake"]["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| {
            f.as_str()
                .and_then(|f| f.strip_prefix("file://"))
                .expect("a file URL")
                .to_string()
        })
        .collect();
    let mut old: Vec<i64> = ids_in(&files);
    old.sort_unstable();
    assert_eq!(
        old,
        (0..50).collect::<Vec<_>>(),
        "the named files hold its rows once"
    );
    let (code, body) = get_status(&url, "/tables/t/rows?partition=old");
    assert_eq!(code, 410, "{body}");
    // The partition receiving rows all along is still on the replicas.
    let (code, body) = get_status(&url, "/tables/t/count?partition=hot");
    assert_eq!(code, 200, "{body}");
    let table: serde_json::Value =
        serde_json::from_str(&get_status(&url, "/tables/t/count").1).expect("count");
    assert_eq!(table["rows_retired"], 50, "{table}");
    assert_eq!(table["partitions_retired"], 1, "{table}");
    let status: serde_json::Value =
        serde_json::from_str(&http_get(&format!("{url}/status"))).expect("status");
    for r in status["replicas"].as_array().expect("replicas") {
        assert!(r["rows_retired"].as_u64() >= Some(50), "{status}");
    }
    assert!(
        status["export_policies"]["t"]["retirements"].as_u64() >= Some(1),
        "{status}"
    );
    assert!(!orphan.exists(), "the old orphan is still there");
    assert!(
        status["export_policies"]["t"]["orphans_removed"].as_u64() >= Some(1),
        "{status}"
    );
    let metrics = http_get(&format!("{url}/metrics"));
    assert!(
        metrics.contains("ferry_export_policy_retirements_total{table=\"t\"}"),
        "{metrics}"
    );

    // A forced export would rewrite the partition from replicas that no
    // longer hold its rows: refused.
    let (ok, _, err) = ferry(
        &["export", "t", "old", "--to", &lake_url, "--force", "--wait"],
        &url,
    );
    assert!(!ok && err.contains("retention"), "{err}");

    // Late rows into the retired partition reach the lake beside the
    // retired files (each row once), and it is retired again.
    insert_ids(rt, c, 50..60, "old", "o-late");
    let mut expected: Vec<i64> = (0..60).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, body) = get_status(&url, "/tables/t/count?partition=old");
        assert_eq!(
            code, 410,
            "a partition with retired rows never reads as whole: {body}"
        );
        let gone: serde_json::Value = serde_json::from_str(&body).expect("410 body");
        let mut ids: Vec<i64> = lake_ids(&lake_url, &url)
            .into_iter()
            .filter(|id| *id < 10_000)
            .collect();
        ids.sort_unstable();
        assert!(
            ids.windows(2).all(|w| w[0] != w[1]),
            "a row twice in the lake: {ids:?}"
        );
        if ids == expected && gone["lake"]["rows"] == 60 {
            break;
        }
        assert!(Instant::now() < deadline, "the lake holds {ids:?}, {gone}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Every hot row is in the lake or on the replicas, none lost.
    let hot_total = hot;
    expected.extend((0..hot_total * 5).map(|i| 10_000 + i));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ids = lake_ids(&lake_url, &url);
        if ids == expected {
            break;
        }
        assert!(Instant::now() < deadline, "the lake holds {ids:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    ferry_ok(&["verify", &lake_url, "--deep"], &url);
    dev.stop();
}
