//! The distributed writer with ZooKeeper: `ferry writer --zookeeper` serves the
//! table and insert API, records the last known commit, and refuses a WAL
//! quorum that holds less than that (safekeepers restored from nothing) and a
//! coordination store of another cluster.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use ferry_client::Client;
use ferry_coord::zk::{ZkOptions, ZkSession};
use ferry_coord::Coordination;
use ferry_table::Format;
use ferry_testkit::table::TableToml;

const SEG: u64 = 1 << 20;
const CLUSTER: &str = "writer-zk-test";

/// Table `t`: `id` Int64 (2 shards), partitioned by `day` (Date).
fn table_toml() -> String {
    TableToml::new("t", ("day", "identity"), ("id", 2))
        .column("id", "Int64")
        .column("day", "Date")
        .toml()
}

/// Spawns `cmd` (its stderr set by the caller) and returns it with its HTTP
/// base URL, read from the "status on http://.../status" of its first line.
fn spawn_node(mut cmd: Command) -> (Proc, String) {
    let (mut child, lines) = spawn_until(&mut cmd, |l| l.contains("status on "));
    let line = lines
        .map(|l| l.last().cloned().unwrap_or_default())
        .unwrap_or_else(|l| l.concat());
    let url = line
        .split("status on ")
        .nth(1)
        .and_then(|r| r.split("/status").next())
        .map(str::to_string)
        .unwrap_or_else(|| {
            let mut err = String::new();
            use std::io::Read as _;
            let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut err));
            panic!("unexpected first line {line:?}; stderr: {err}")
        });
    (child, url)
}

/// `ferry writer` of `cluster` with ZooKeeper at `zk`.
fn writer_with_zookeeper(addrs: &[String], zk: &str, cluster: &str) -> Command {
    let mut cmd = writer_command(cluster, addrs, SEG);
    cmd.args(["--zookeeper", zk]);
    cmd
}

/// Starts `ferry writer`; returns it and its HTTP base URL.
fn start_writer(addrs: &[String], zk: &str, cluster: &str) -> (Proc, String) {
    let mut cmd = writer_with_zookeeper(addrs, zk, cluster);
    // Read at exit: a refusal is asserted on.
    cmd.stderr(Stdio::piped());
    spawn_node(cmd)
}

/// Starts `ferry writer` expected to exit at start (its stderr is read).
fn start_writer_or_exit(addrs: &[String], zk: &str) -> (Proc, ()) {
    let child = Proc::spawn(
        writer_with_zookeeper(addrs, zk, CLUSTER)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    (child, ())
}

/// Starts `ferry replica` of `shard`; returns it and its HTTP base URL.
fn start_replica(addrs: &[String], zk: &str, shard: u32, dir: &std::path::Path) -> (Proc, String) {
    spawn_node(replica_command(addrs, zk, shard, 0, dir))
}

/// `ferry replica` of `shard`, replica `replica`, on data dir `dir`.
fn replica_command(
    addrs: &[String],
    zk: &str,
    shard: u32,
    replica: u32,
    dir: &std::path::Path,
) -> Command {
    let mut cmd = Command::new(FERRY);
    cmd.args(["replica", "--cluster-id", CLUSTER])
        .args([
            "--shard",
            &shard.to_string(),
            "--replica",
            &replica.to_string(),
        ])
        .args([
            "--safekeepers",
            &addrs.join(","),
            "--zookeeper",
            zk,
            "--http",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(dir)
        .envs(s3_env())
        // The tests' lakes are beside the replicas' data dirs.
        .arg("--export-roots")
        .arg(
            dir.parent()
                .expect("a data dir in the test's folder")
                .join("lake"),
        )
        .stderr(Stdio::null());
    cmd
}

/// Runs `ferry replica` of `shard` (replica 0) in cluster `cluster_id` on
/// `safekeepers`, with ZooKeeper at `zk`, to its end; it must fail without
/// touching its data dir `dir`: returns its stderr.
fn replica_refusal(
    zk: &str,
    dir: &std::path::Path,
    cluster_id: &str,
    shard: &str,
    safekeepers: &str,
) -> String {
    let out = Command::new(FERRY)
        .args(["replica", "--cluster-id", cluster_id, "--shard", shard])
        .args(["--replica", "0", "--safekeepers", safekeepers])
        .args(["--zookeeper", zk, "--http", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run replica");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "refused: {err}");
    assert!(!dir.exists(), "a refused replica touches nothing: {err}");
    err
}

/// Waits (at most 60 s) for `child` to exit; returns its success and stderr.
fn wait_exit(child: &mut Child) -> (bool, String) {
    common::wait_exit(child, Duration::from_secs(60))
}

/// Ctrl-C to each safekeeper, and its end.
fn stop_all(safekeepers: &mut [Proc]) {
    for s in safekeepers {
        interrupt(s);
        let _ = s.wait();
    }
}

/// Ctrl-C to each replica, which must stop cleanly.
fn stop_replicas(replicas: &mut [Proc]) {
    for r in replicas {
        interrupt(r);
        let (ok, err) = wait_exit(r);
        assert!(ok, "replica stops cleanly: {err}");
    }
}

/// What a test of the distributed roles starts with: a runtime, a fresh
/// chroot (its connect string), the test's folder, three safekeepers with
/// their addresses, and a first writer with its URL.
struct ZkCluster {
    rt: tokio::runtime::Runtime,
    connect: String,
    dir: tempfile::TempDir,
    safekeepers: Vec<Proc>,
    addrs: Vec<String>,
    writer: Proc,
    url: String,
}

/// A [`ZkCluster`] on ZooKeeper `zk`, its chroot named after `name`, its
/// safekeepers under `wal_dir` of the test's folder.
fn start_cluster(zk: &str, name: &str, wal_dir: &str) -> ZkCluster {
    start_cluster_with(zk, name, wal_dir, &[])
}

/// The same, its safekeepers started with `extra` flags.
fn start_cluster_with(zk: &str, name: &str, wal_dir: &str, extra: &[&str]) -> ZkCluster {
    let rt = runtime();
    let connect = rt.block_on(ferry_testkit::services::zookeeper_chroot(zk, name));
    let dir = tempfile::tempdir().expect("tempdir");
    let mut flags = vec!["--create"];
    flags.extend_from_slice(extra);
    let (safekeepers, addrs): (Vec<Proc>, Vec<String>) = (0..3)
        .map(|id| {
            let (child, addr, _) = start_safekeeper_watching(
                id,
                &dir.path().join(wal_dir).join(format!("sk{id}")),
                "127.0.0.1:0",
                &flags,
                CLUSTER,
                SEG,
                |_| {},
            );
            (child, addr)
        })
        .unzip();
    let (writer, url) = start_writer(&addrs, &connect, CLUSTER);
    ZkCluster {
        rt,
        connect,
        dir,
        safekeepers,
        addrs,
        writer,
        url,
    }
}

impl ZkCluster {
    /// Starts the replica of `shard` on its data dir in the test's folder.
    fn replica(&self, shard: u32) -> (Proc, String) {
        let dir = self.dir.path().join(format!("replica{shard}"));
        start_replica(&self.addrs, &self.connect, shard, &dir)
    }

    /// Starts the replicas of shards `0..shards`: the processes and their
    /// HTTP base URLs.
    fn replicas(&self, shards: u32) -> (Vec<Proc>, Vec<String>) {
        (0..shards).map(|shard| self.replica(shard)).unzip()
    }
}

/// A session of the ZooKeeper at `connect` (a chroot included).
async fn zk_session(connect: &str) -> ZkSession {
    ZkSession::connect(&ZkOptions::new(connect.to_string()))
        .await
        .expect("ZooKeeper")
}

/// Runs a `ferry` client command against the node at `node`: its success
/// and its stdout and stderr together.
fn ferry_cli(node: &str, args: &[&str]) -> (bool, String) {
    let (ok, out, err) = ferry(args, node);
    (ok, out + &err)
}

/// The one commit file of `partition` in the local lake (asserted to be one).
fn only_commit_file(lake: &std::path::Path, partition: &str) -> serde_json::Value {
    let mut commits = commit_files(lake, &format!("commit_{partition}_"));
    assert_eq!(commits.len(), 1, "one commit file for {partition}");
    commits.remove(0)
}

async fn insert_until_elected(c: &Client, base: i64) -> ferry_client::Inserted {
    let body = Bytes::from(format!(
        "{{\"id\":{base},\"day\":\"2024-05-01\"}}\n{{\"id\":{},\"day\":\"2024-05-02\"}}\n",
        base + 1
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c
            .insert_body("t", Format::Ndjson, body.clone(), Some(&format!("k{base}")))
            .await
        {
            Ok(i) => return i,
            Err(e) if e.retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("insert: {e}"),
        }
    }
}

#[test]
fn the_distributed_writer_serves_inserts_and_refuses_a_younger_quorum() {
    let Some(zk) = zk_address() else { return };
    // First writer: creates the cluster record, takes a table and inserts.
    let mut cluster = start_cluster(&zk, "writer-test", "a");
    let c = node_client(&cluster.url);
    let first = cluster.rt.block_on(async {
        c.create_table_toml(&table_toml())
            .await
            .expect("create table");
        insert_until_elected(&c, 0).await
    });
    assert_eq!(first.rows, 2);
    interrupt(&cluster.writer);
    let (ok, err) = wait_exit(&mut cluster.writer);
    assert!(ok, "clean stop: {err}");

    // The safekeepers' order is part of the cluster record: another order
    // would move the backup duty.
    let mut reordered = cluster.addrs.clone();
    reordered.reverse();
    let (mut misordered, _) = start_writer_or_exit(&reordered, &cluster.connect);
    let (ok, err) = wait_exit(&mut misordered);
    assert!(
        !ok && err.contains("same safekeepers, another order"),
        "{err}"
    );

    // A replica is checked against the cluster before it registers: its
    // cluster, its safekeepers, and a shard some table has.
    let refused = cluster.dir.path().join("refused-replica");
    let all = cluster.addrs.join(",");
    let err = replica_refusal(&cluster.connect, &refused, "another", "0", &all);
    assert!(err.contains("belongs to cluster writer-zk-test"), "{err}");
    let err = replica_refusal(&cluster.connect, &refused, CLUSTER, "5", &all);
    assert!(
        err.contains("--shard 5 does not exist") && err.contains("t has 2"),
        "{err}"
    );
    let err = replica_refusal(&cluster.connect, &refused, CLUSTER, "0", "127.0.0.1:1");
    assert!(
        err.contains("which the cluster record does not list"),
        "{err}"
    );

    // The last known commit is in ZooKeeper, past the insert.
    let known: serde_json::Value = cluster.rt.block_on(async {
        let s = zk_session(&cluster.connect).await;
        let (data, _) = s.get("/ferry/wal").await.expect("/ferry/wal");
        s.close().await;
        serde_json::from_slice(&data).expect("JSON")
    });
    let recorded: ferry_wal::Lsn =
        serde_json::from_value(known["commit_lsn"].clone()).expect("lsn");
    assert!(
        recorded >= first.commit_lsn.parse().expect("lsn"),
        "{known}"
    );

    // A second writer takes over: the table is there, inserts go on.
    let (mut writer, url) = start_writer(&cluster.addrs, &cluster.connect, CLUSTER);
    let c = node_client(&url);
    let second = cluster.rt.block_on(async {
        assert_eq!(c.tables().await.expect("tables").len(), 1);
        insert_until_elected(&c, 10).await
    });

    // A replica per shard applies its shard's rows; together they hold all 4.
    let mut replicas = Vec::new();
    let mut replica_urls = Vec::new();
    let mut total = 0;
    for shard in 0..2 {
        let (child, rurl) = cluster.replica(shard);
        replicas.push(child);
        replica_urls.push(rurl.clone());
        let rc = node_client(&rurl);
        total += cluster
            .rt
            .block_on(rc.count("t", None, 0, Some(&second.commit_lsn)))
            .expect("count once applied");
    }
    assert_eq!(total, 4, "each row on the replica of its shard, once");
    let registered = cluster.rt.block_on(async {
        let s = zk_session(&cluster.connect).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        let children = loop {
            let (children, _) = s.children("/ferry/replicas").await.unwrap_or_default();
            if children.len() == 2 || Instant::now() > deadline {
                break children;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        s.close().await;
        let mut children = children;
        children.sort();
        children
    });
    assert_eq!(registered, ["s0r0", "s1r0"], "replicas register themselves");

    // An export sent to the replica of shard 0 snapshots shard 1 through its
    // replica; each replica exports its shard's parts, one commit file
    // lists them all.
    let third = cluster.rt.block_on(async {
        let body: String = (100..120)
            .map(|id| format!("{{\"id\":{id},\"day\":\"2024-05-03\"}}\n"))
            .collect();
        c.insert_body("t", Format::Ndjson, Bytes::from(body), Some("k100"))
            .await
            .expect("insert")
    });
    for (shard, rurl) in replica_urls.iter().enumerate() {
        let rc = node_client(rurl);
        let n = cluster
            .rt
            .block_on(rc.count("t", Some("20240503"), 0, Some(&third.commit_lsn)))
            .expect("count");
        assert!(
            n > 0 && n < 20,
            "shard {shard} holds some of the partition: {n}"
        );
    }
    let lake = cluster.dir.path().join("lake");
    let lake_url = format!("file://{}", lake.display());
    let cli = |args: &[&str]| ferry_cli(&replica_urls[0], args);
    let (ok, out) = cli(&["export", "t", "20240503", "--to", &lake_url, "--wait"]);
    assert!(ok && out.contains("COMPLETED"), "{out}");
    let commit = only_commit_file(&lake, "20240503");
    assert_eq!(commit["rows"], 20, "{commit}");
    let files = commit["files"].as_array().expect("files");
    assert!(files.len() >= 2, "parts of both shards: {commit}");
    let (ok, out) = cli(&["verify", &lake_url, "--deep"]);
    assert!(ok, "{out}");
    // Each replica exported the parts of its own shard (none holds the other's).
    let mut exported = 0;
    for rurl in &replica_urls {
        let rc = node_client(rurl);
        let view = cluster
            .rt
            .block_on(rc.get_json("/exports"))
            .expect("exports");
        let n = parts_exported(&view);
        assert!(n > 0, "{rurl} exported parts of its shard: {view}");
        exported += n;
    }
    assert_eq!(exported, files.len() as u64, "each part exported once");
    let writers = cluster.rt.block_on(async {
        let s = zk_session(&cluster.connect).await;
        let (children, _) = s.children("/ferry/writers").await.expect("writers");
        s.close().await;
        children
    });
    assert_eq!(writers.len(), 1, "the writer registers itself: {writers:?}");
    stop_replicas(&mut replicas);
    assert!(second.blocks[0] >= first.commit_lsn.parse::<ferry_wal::Lsn>().expect("lsn").0);
    interrupt(&writer);
    assert!(wait_exit(&mut writer).0);
    stop_all(&mut cluster.safekeepers);

    // Safekeepers made anew (their WAL lost) at the same addresses cannot
    // hold what was committed: a writer knowing the commit refuses to get
    // elected on them.
    let (mut fresh, fresh_addrs): (Vec<_>, Vec<_>) = cluster
        .addrs
        .iter()
        .enumerate()
        .map(|(id, addr)| {
            start_safekeeper(
                id as u64,
                &cluster.dir.path().join(format!("b/sk{id}")),
                addr,
                true,
                CLUSTER,
                SEG,
            )
        })
        .unzip();
    assert_eq!(fresh_addrs, cluster.addrs);
    let (mut writer, _) = start_writer(&fresh_addrs, &cluster.connect, CLUSTER);
    let (ok, err) = wait_exit(&mut writer);
    assert!(!ok && err.contains("refused"), "{err}");

    // A coordination store of another cluster is refused at start.
    let out = writer_with_zookeeper(&fresh_addrs, &cluster.connect, "another")
        .output()
        .expect("run writer");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("belongs to cluster writer-zk-test"),
        "{err}"
    );
    stop_all(&mut fresh);
}

/// The status of the export of `partition` as ZooKeeper holds it, and how
/// many parts are left in its `processing/`.
async fn task_state(connect: &str, partition: &str) -> (String, usize) {
    let s = zk_session(connect).await;
    let (keys, _) = s
        .children("/ferry/tables/t/exports")
        .await
        .expect("exports");
    let key = keys
        .iter()
        .find(|k| k.starts_with(&format!("{partition}_")))
        .expect("the task");
    let base = format!("/ferry/tables/t/exports/{key}");
    let (status, _) = s.get(&format!("{base}/status")).await.expect("status");
    let (left, _) = s
        .children(&format!("{base}/processing"))
        .await
        .expect("processing");
    s.close().await;
    (String::from_utf8_lossy(&status).into_owned(), left.len())
}

#[test]
fn an_export_survives_kill_9_of_a_replica_in_the_middle() {
    let Some(zk) = zk_address() else { return };
    let mut cluster = start_cluster(&zk, "export-kill-test", "wal");
    let c = node_client(&cluster.url);
    cluster.rt.block_on(async {
        c.create_table_toml(&table_toml())
            .await
            .expect("create table");
        insert_until_elected(&c, 0).await
    });
    let (mut replicas, mut urls) = cluster.replicas(2);
    let lake = cluster.dir.path().join("lake");
    let lake_url = format!("file://{}", lake.display());

    // Each try: a partition of many parts on both shards, exported one part
    // at a time per node, and the replica of shard 1 killed with SIGKILL as
    // soon as it exported one part. The kill landed in the middle when the
    // restarted replica finds parts of its shard left (no other node holds
    // them).
    let mut landed = 0;
    for attempt in 0..4u32 {
        let day = format!("2024-06-{:02}", attempt + 1);
        let partition = format!("202406{:02}", attempt + 1);
        let mut last = None;
        for batch in 0..30i64 {
            let first = 1000 * (i64::from(attempt) + 1) + batch * 10;
            let body: String = (first..first + 10)
                .map(|id| format!("{{\"id\":{id},\"day\":\"{day}\"}}\n"))
                .collect();
            last = Some(
                cluster
                    .rt
                    .block_on(c.insert_body(
                        "t",
                        Format::Ndjson,
                        Bytes::from(body),
                        Some(&format!("kill-{attempt}-{batch}")),
                    ))
                    .expect("insert"),
            );
        }
        let last = last.expect("inserted");
        // Both replicas applied it (the request waits too, but the kill
        // must not find the replica still applying).
        for u in &urls {
            let rc = node_client(u);
            cluster
                .rt
                .block_on(rc.count("t", None, 0, Some(&last.commit_lsn)))
                .expect("applied");
        }
        // A restarted replica registers again once its old session expired:
        // until then a request cannot reach shard 1 and says so.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (ok, out, err) = export_part_by_part(&urls[0], "t", &partition, &lake_url);
            let out = out + &err;
            if ok {
                break;
            }
            assert!(
                out.contains("shard 1") && Instant::now() < deadline,
                "{out}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        // SIGKILL once the replica of shard 1 exported a part of it.
        let rc = node_client(&urls[1]);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let view = cluster
                .rt
                .block_on(rc.get_json("/exports"))
                .expect("exports");
            if view["counters"]["parts_exported"].as_u64().unwrap_or(0) > 0 {
                break;
            }
        }
        replicas[1].kill().expect("SIGKILL");
        let _ = replicas[1].wait();
        let (status, left) = cluster
            .rt
            .block_on(task_state(&cluster.connect, &partition));
        eprintln!("attempt {attempt}: after SIGKILL the task is {status} with {left} parts left");
        // The replica comes back on its data dir; its old session's locks
        // go when the session expires, and it finishes its shard's parts.
        let (child, rurl) = cluster.replica(1);
        replicas[1] = child;
        urls[1] = rurl;
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let (status, _) = cluster
                .rt
                .block_on(task_state(&cluster.connect, &partition));
            if status == "COMPLETED" {
                break;
            }
            assert_eq!(status, "PENDING", "the export ends COMPLETED");
            assert!(Instant::now() < deadline, "the export did not complete");
            std::thread::sleep(Duration::from_millis(100));
        }
        let commit = only_commit_file(&lake, &partition);
        assert_eq!(commit["rows"], 300, "{commit}");
        // No data file written twice: the partition's folder holds exactly
        // the files the commit lists.
        let (listed, on_disk) = listed_and_on_disk(&lake, &format!("day={partition}"), &commit);
        // Nothing else, not even the staging file `<key>#<n>` of a write
        // the kill cut short: the commit removes those.
        assert_eq!(on_disk, listed, "each part once, nothing else");
        // The kill landed in the middle if the restarted replica had parts
        // of its shard left to export.
        let rc = node_client(&urls[1]);
        let view = cluster
            .rt
            .block_on(rc.get_json("/exports"))
            .expect("exports");
        let after_restart = parts_exported(&view);
        eprintln!("attempt {attempt}: the restarted replica exported {after_restart} parts");
        if after_restart > 0 {
            landed += 1;
            break;
        }
    }
    assert!(
        landed > 0,
        "the SIGKILL never landed in the middle of an export"
    );
    let (ok, out) = ferry_cli(&urls[0], &["verify", &lake_url, "--deep"]);
    assert!(ok, "{out}");
    stop_replicas(&mut replicas);
    interrupt(&cluster.writer);
    assert!(wait_exit(&mut cluster.writer).0);
    stop_all(&mut cluster.safekeepers);
}

/// The environment that points a process at the test S3 server (empty
/// without one).
fn s3_env() -> Vec<(&'static str, String)> {
    match std::env::var(ferry_testkit::services::S3_ENDPOINT) {
        Ok(endpoint) => vec![
            ("AWS_ENDPOINT", endpoint),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ],
        Err(_) => Vec::new(),
    }
}

/// Rows in the lake at `lake_url` as `ferry lake files --json` counts them
/// (0 while nothing is committed or the lake cannot be read).
fn lake_rows(lake_url: &str) -> u64 {
    let out = Command::new(FERRY)
        .args(["lake", "files", lake_url, "--json"])
        .envs(s3_env())
        .output()
        .expect("ferry lake files");
    // A Parquet destination lists partitions, an Iceberg table files.
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .ok()
        .and_then(|v| {
            v["partitions"]
                .as_array()
                .or(v["files"].as_array())
                .map(|ps| ps.iter().map(|p| p["rows"].as_u64().unwrap_or(0)).sum())
        })
        .unwrap_or(0)
}

/// A table that exports itself, on two replica processes (one per shard)
/// over ZooKeeper, to a lake on the test S3 server (a local folder without
/// one): exactly one node runs the policy; rows of both shards reach the
/// lake with nobody asking, in increments that carry files; after kill -9
/// of that node and inserts while it is down, the policy goes on (on the
/// other node, or on the same one restarted, once the dead session's lock
/// is gone) and the lake ends with every row once, `ferry verify` clean.
#[test]
fn a_table_exports_itself_across_replica_processes_and_a_kill_9_of_the_policy_node() {
    table_exports_itself_across_processes("parquet");
}

/// The same into an Iceberg table: its increments carry files too (the
/// shards Iceberg does not record are kept beside its metadata).
#[test]
fn an_iceberg_table_exports_itself_in_increments_across_replica_processes() {
    table_exports_itself_across_processes("iceberg");
}

fn table_exports_itself_across_processes(format: &str) {
    let Some(zk) = zk_address() else { return };
    let mut cluster = start_cluster(&zk, &format!("export-policy-{format}"), "wal");
    let lake_url = match std::env::var(ferry_testkit::services::S3_ENDPOINT) {
        Ok(endpoint) => {
            let bucket = ferry_testkit::services::unique_name("policy")
                .to_lowercase()
                .replace('_', "-");
            let bucket: String = bucket.chars().take(60).collect();
            cluster
                .rt
                .block_on(ferry_testkit::services::create_bucket(&endpoint, &bucket));
            format!("s3://{bucket}/t")
        }
        Err(_) => format!("file://{}", cluster.dir.path().join("lake/t").display()),
    };
    let c = node_client(&cluster.url);
    let toml = format!(
        "{}\n[export]\nto = {lake_url:?}\nformat = {format:?}\nfreshness = \"1s\"\n",
        table_toml()
    );
    cluster.rt.block_on(async {
        c.create_table_toml(&toml).await.expect("create table");
        insert_until_elected(&c, 0).await
    });
    let (mut replicas, mut urls) = cluster.replicas(2);
    let mut rows = 2u64;
    let insert = |batch: i64| {
        let body: String = (0..10)
            .map(|i| {
                let day = if i % 2 == 0 {
                    "2024-05-01"
                } else {
                    "2024-05-02"
                };
                format!("{{\"id\":{},\"day\":\"{day}\"}}\n", 1000 + batch * 10 + i)
            })
            .collect();
        cluster
            .rt
            .block_on(c.insert_body(
                "t",
                Format::Ndjson,
                Bytes::from(body),
                Some(&format!("policy-{batch}")),
            ))
            .expect("insert");
    };
    let wait_rows = |rows: u64, urls: &[String]| {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let got = lake_rows(&lake_url);
            assert!(got <= rows, "{got} rows in the lake, {rows} inserted");
            if got == rows {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the lake holds {got} of {rows} rows; {:?}",
                urls.iter()
                    .map(|u| {
                        cluster
                            .rt
                            .block_on(node_client(u).get_json("/status"))
                            .map(|s| s["export_policies"].clone())
                            .unwrap_or_default()
                    })
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    // Two waves, each waited for in the lake: the second wave's exports
    // are increments over the first's commits (six level-0 parts per shard
    // and partition: no merge yet).
    for wave in [0..3, 3..6] {
        for batch in wave {
            insert(batch);
            rows += 10;
        }
        wait_rows(rows, &urls);
    }
    let running: Vec<usize> = (0..2)
        .filter(|&i| {
            let status = cluster
                .rt
                .block_on(node_client(&urls[i]).get_json("/status"))
                .expect("status");
            status["export_policies"]["t"]["running_here"] == true
        })
        .collect();
    assert_eq!(running.len(), 1, "one node runs the policy: {running:?}");
    // Increments: some export carried files of the partition's previous
    // commit instead of writing them again.
    let carried: u64 = cluster
        .rt
        .block_on(node_client(&urls[0]).get_json("/exports"))
        .expect("exports")["tasks"]
        .as_array()
        .expect("tasks")
        .iter()
        .map(|t| t["carried"].as_u64().unwrap_or(0))
        .sum();
    assert!(carried > 0, "no export carried a file");
    let victim = running[0];

    // kill -9 of the node running the policy, inserts while it is down,
    // and the node back on its data dir (its shard's parts are only there).
    replicas[victim].kill().expect("SIGKILL");
    let _ = replicas[victim].wait();
    for batch in 6..10 {
        insert(batch);
        rows += 10;
    }
    let (child, rurl) = cluster.replica(victim as u32);
    replicas[victim] = child;
    urls[victim] = rurl;
    wait_rows(rows, &urls);

    // Retention: with every row in the lake and no rows since, both
    // partitions leave both replicas (the policy node has the writer
    // append the retirement over HTTP); each node's count names the rows
    // only the lake holds now.
    let (ok, out) = ferry_cli(
        &cluster.url,
        &[
            "table",
            "set-export",
            "t",
            "--to",
            &lake_url,
            "--format",
            format,
            "--freshness",
            "1s",
            "--retention",
            "2s",
        ],
    );
    assert!(ok, "{out}");
    let retired = |urls: &[String]| -> (u64, u64) {
        urls.iter()
            .map(|u| {
                let count = cluster
                    .rt
                    .block_on(node_client(u).get_json("/tables/t/count"))
                    .unwrap_or_default();
                (
                    count["rows_retired"].as_u64().unwrap_or(0),
                    count["rows"].as_u64().unwrap_or(u64::MAX),
                )
            })
            .fold((0, 0), |(a, b), (r, l)| (a + r, b.saturating_add(l)))
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while retired(&urls) != (rows, 0) {
        assert!(
            Instant::now() < deadline,
            "retired and local rows {:?} of {rows}",
            retired(&urls)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Rows after the retirement reach the lake beside the retired files.
    insert(10);
    rows += 10;
    wait_rows(rows, &urls);
    let verified = Command::new(FERRY)
        .args(["verify", &lake_url])
        .envs(s3_env())
        .output()
        .expect("ferry verify");
    assert!(verified.status.success(), "{}", succeeded(&verified));
    stop_replicas(&mut replicas);
    interrupt(&cluster.writer);
    assert!(wait_exit(&mut cluster.writer).0);
    stop_all(&mut cluster.safekeepers);
}

/// A replica added after the safekeepers removed the WAL it would need
/// cannot be built from the WAL (it stops, naming the LSN); with
/// `--bootstrap-from auto` it copies the live replica of its shard at one
/// position, streams the WAL from there, and holds exactly its shard's rows,
/// the same parts as its donor, also after more inserts. A copy killed
/// part-way is refused by a start without the flag and finished by one with
/// it. `ferry replica` with a state file ignores the flag.
#[test]
fn a_replica_added_after_wal_removal_is_built_from_a_peer() {
    let Some(zk) = zk_address() else { return };
    let mut cluster = start_cluster_with(
        &zk,
        "replica-copy",
        "wal",
        &["--wal-removal-interval", "200ms"],
    );
    let c = node_client(&cluster.url);
    cluster.rt.block_on(async {
        c.create_table_toml(&table_toml())
            .await
            .expect("create table");
        insert_until_elected(&c, 0).await
    });
    let (mut replicas, urls) = cluster.replicas(2);
    // About 3 segments of WAL in inserts of 20,000 rows, both shards. The
    // ids are scrambled (a bijection of the row number), so that the parts
    // the records carry do not compress them away.
    let mut inserted = 2u64;
    let mut last_commit = String::new();
    let insert = |batch: i64, rows: i64| -> String {
        let body: String = (0..rows)
            .map(|i| {
                format!(
                    "{{\"id\":{},\"day\":\"2024-05-0{}\"}}\n",
                    (1_000_000 * (batch + 1) + i).wrapping_mul(0x9E37_79B9_7F4A_7C15_u64 as i64),
                    1 + i % 3
                )
            })
            .collect();
        let done = cluster
            .rt
            .block_on(c.insert_body(
                "t",
                Format::Ndjson,
                Bytes::from(body),
                Some(&format!("copy-{batch}")),
            ))
            .expect("insert");
        done.commit_lsn
    };
    for batch in 0..20 {
        last_commit = insert(batch, 20_000);
        inserted += 20_000;
    }
    // Both replicas applied it all and the safekeepers removed the segments
    // below: a new replica of shard 0 cannot stream from the start.
    let count = |url: &str, min_lsn: &str| {
        cluster
            .rt
            .block_on(node_client(url).count("t", None, 0, Some(min_lsn)))
            .expect("count")
    };
    let shard_rows: Vec<u64> = urls.iter().map(|u| count(u, &last_commit)).collect();
    assert_eq!(shard_rows.iter().sum::<u64>(), inserted);
    let first_segment = ferry_wal::segment::SegmentSize::new(SEG)
        .expect("segment size")
        .file_name(0);
    // Each safekeeper's files, wherever under its data dir they are; a
    // segment counts under any suffix (the one being written is partial).
    fn holds_file(dir: &std::path::Path, name: &str) -> bool {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                e.file_name().to_string_lossy().starts_with(name)
                    || (e.path().is_dir() && holds_file(&e.path(), name))
            })
    }
    let removed_everywhere = || {
        (0..3).all(|id| {
            let sk = cluster.dir.path().join(format!("wal/sk{id}"));
            holds_file(&sk, "safekeeper.control") && !holds_file(&sk, &first_segment)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !removed_everywhere() {
        assert!(
            Instant::now() < deadline,
            "the first segment was never removed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let new_dir = cluster.dir.path().join("replica0-copy");
    let mut fresh = Proc::spawn(
        replica_command(&cluster.addrs, &cluster.connect, 0, 1, &new_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while fresh.try_wait().expect("poll").is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = fresh.kill();
    let (ok, err) = wait_exit(&mut fresh);
    assert!(
        !ok && err.contains("was removed on every safekeeper")
            && err.contains("start it with --bootstrap-from auto"),
        "a new replica cannot stream WAL that is gone: {err}"
    );

    // A copy killed part-way (kill -9 once it checked a first part, before
    // its state file) and started again without `--bootstrap-from`, as a
    // supervisor that lost the flag would: refused, nothing changed; it
    // would otherwise open as a new replica and stream from 0/0 over the
    // copied parts.
    let replica_dir = new_dir.join("s0r1");
    fn walk(dir: &std::path::Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|e| {
                if e.path().is_dir() {
                    walk(&e.path())
                } else {
                    vec![e.path().display().to_string()]
                }
            })
            .collect()
    }
    let mut interrupted = false;
    for _ in 0..5 {
        let _ = std::fs::remove_dir_all(&new_dir);
        let mut cmd = replica_command(&cluster.addrs, &cluster.connect, 0, 1, &new_dir);
        cmd.args(["--bootstrap-from", "auto"]).stdout(Stdio::null());
        let mut copier = Proc::spawn(&mut cmd);
        let deadline = Instant::now() + Duration::from_secs(60);
        let copied_a_part = || {
            walk(&replica_dir.join("parts"))
                .iter()
                .any(|f| f.ends_with(".parquet"))
        };
        while !copied_a_part() {
            assert!(Instant::now() < deadline, "the copy never began");
            assert!(
                copier.try_wait().expect("poll").is_none(),
                "the copier exited"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = copier.kill();
        let _ = copier.wait();
        if !replica_dir.join("state").exists() {
            assert!(replica_dir.join("copy-unfinished").exists(), "marked");
            interrupted = true;
            break;
        }
    }
    assert!(interrupted, "every copy finished before the kill landed");
    let listing = || -> Vec<String> {
        let mut v: Vec<String> = walk(&replica_dir);
        v.sort();
        v
    };
    let before = listing();
    let mut plain = Proc::spawn(
        replica_command(&cluster.addrs, &cluster.connect, 0, 1, &new_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let (ok, err) = wait_exit(&mut plain);
    assert!(
        !ok && err.contains("holds a copy from a peer replica that did not finish")
            && err.contains("start with --bootstrap-from auto"),
        "an unfinished copy is refused: {err}"
    );
    assert_eq!(listing(), before, "refusing changed nothing");

    // Built from a peer instead (the copy goes on over what it left).
    let mut cmd = replica_command(&cluster.addrs, &cluster.connect, 0, 1, &new_dir);
    cmd.args(["--bootstrap-from", "auto"]);
    let (mut copy, lines) = spawn_until(&mut cmd, |l| l.contains("status on "));
    let lines = lines.expect("the copy starts");
    let built = lines
        .iter()
        .find(|l| l.contains("built from"))
        .unwrap_or_else(|| panic!("no copy reported: {lines:?}"));
    assert!(built.contains("replica 1 of shard 0 built from"), "{built}");
    let copy_url = lines
        .last()
        .and_then(|l| l.split("status on ").nth(1))
        .and_then(|r| r.split("/status").next())
        .map(str::to_string)
        .expect("copy url");
    assert_eq!(
        count(&copy_url, &last_commit),
        shard_rows[0],
        "exactly shard 0's rows"
    );
    // More inserts: the copy streams them from its position like its donor.
    for batch in 20..22 {
        last_commit = insert(batch, 1_000);
        inserted += 1_000;
    }
    let parts = |url: &str| part_names(&cluster.rt, url, 0, &last_commit);
    assert_eq!(
        count(&copy_url, &last_commit),
        count(&urls[0], &last_commit)
    );
    assert_eq!(
        count(&copy_url, &last_commit) + count(&urls[1], &last_commit),
        inserted
    );
    let donor_parts = parts(&urls[0]);
    assert!(!donor_parts.is_empty());
    assert_eq!(parts(&copy_url), donor_parts, "the same parts as its donor");

    // A replica with a state file ignores the flag: restarted, it goes on
    // from its own position (nothing copied).
    stop_replicas(std::slice::from_mut(&mut copy));
    let mut cmd = replica_command(&cluster.addrs, &cluster.connect, 0, 1, &new_dir);
    cmd.args(["--bootstrap-from", "auto"]);
    let (mut again, lines) = spawn_until(&mut cmd, |l| l.contains("status on "));
    let lines = lines.expect("restarts");
    assert!(!lines.iter().any(|l| l.contains("built from")), "{lines:?}");
    stop_replicas(std::slice::from_mut(&mut again));
    stop_replicas(&mut replicas);
    interrupt(&cluster.writer);
    let _ = wait_exit(&mut cluster.writer);
    stop_all(&mut cluster.safekeepers);
}
