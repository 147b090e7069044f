//! Real processes under real faults, one after another and then at once.
//!
//! The test starts its own ZooKeeper and S3 server (moto), three `ferry
//! safekeeper` with a WAL backup, a `ferry writer` under a supervisor that
//! restarts it a second after it exits, and four `ferry replica` (2 shards x
//! 2) exporting the table to an Iceberg table on S3, all on loopback. A
//! client inserts unique ids with idempotency keys and sends every insert
//! whose outcome it did not learn again, with the same key, until it is
//! answered. Meanwhile the schedule kills each role with SIGKILL, stops
//! ZooKeeper for 10 s (sessions expire), pauses the S3 server
//! (SIGSTOP/SIGCONT), loses a safekeeper's data dir and restores it from the
//! backup, takes the writer over, rebuilds a replica from its peer, and then
//! does several of these at once.
//!
//! At the end: every acknowledged id is once on each replica of one shard
//! and nowhere else; the Iceberg table, as pyiceberg and DuckDB read it,
//! holds every acknowledged id once and nothing else; `ferry verify --deep`
//! is clean; no process is left. A table of the faults and what the client
//! saw during each is printed. `scripts/faults.sh` runs it alone.
//!
//! Needs `FERRY_TEST_ZK_CLASSPATH` (how to run ZooKeeper's server),
//! `FERRY_TEST_MOTO` (moto's server) and `FERRY_TEST_PYTHON` (the lake
//! readers), which `scripts/test.sh` sets; without them it says it skipped.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{node_client, Proc, FERRY};
use ferry_table::Format;
use ferry_testkit::table::TableToml;
use ferry_wal::Lsn;

const CLUSTER: &str = "faults";
const SEG: u64 = 1 << 20;
/// Rows per insert.
const ROWS: i64 = 100;
/// How long one wait for the system (a process ready, an insert after a
/// fault, replicas or the lake caught up) may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(120);
/// A SIGKILLed role comes back after this long (its supervisor's delay).
const RESTART_DELAY: Duration = Duration::from_secs(1);

/// A free loopback port (bound and released: the processes started on it
/// bind it with SO_REUSEADDR).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Sends `signal` (`KILL`, `STOP`, `CONT`, `INT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// One process of the test: how to start it, the running child, the HTTP
/// base URL it printed, and its log (stdout and stderr of every run, in
/// the test's folder, shown when the test fails).
struct Node {
    name: String,
    log: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    child: Option<Proc>,
    url: Arc<Mutex<Option<String>>>,
    /// When it exited without the schedule killing it, with its status.
    exits: Vec<String>,
    /// The extra arguments of its last start, which its supervisor starts
    /// it with again (a unit's command line does not change when it exits).
    last_extra: Vec<String>,
}

impl Node {
    fn new(name: &str, dir: &Path, args: Vec<String>, env: Vec<(String, String)>) -> Node {
        Node {
            name: name.to_string(),
            log: dir.join(format!("{name}.log")),
            args,
            env,
            child: None,
            url: Arc::new(Mutex::new(None)),
            exits: Vec::new(),
            last_extra: Vec::new(),
        }
    }

    /// Starts it with `extra` arguments; its URL is known once it printed
    /// "status on http://.../status" (see [`Node::wait_url`]).
    fn start(&mut self, extra: &[&str]) {
        assert!(self.child.is_none(), "{} is running", self.name);
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log");
        let _ = writeln!(log, "---- start {} {extra:?}", self.name);
        self.last_extra = extra.iter().map(|a| a.to_string()).collect();
        let mut child = Proc::spawn(
            Command::new(FERRY)
                .args(&self.args)
                .args(extra)
                .envs(self.env.iter().map(|(k, v)| (k, v)))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(log.try_clone().expect("log")),
        );
        let stdout = child.stdout.take().expect("stdout");
        *self.url.lock().expect("url") = None;
        let url = Arc::clone(&self.url);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = writeln!(log, "{line}");
                if let Some(u) = line
                    .split("status on ")
                    .nth(1)
                    .and_then(|r| r.split("/status").next())
                {
                    *url.lock().expect("url") = Some(u.to_string());
                }
            }
        });
        self.child = Some(child);
    }

    /// Its HTTP base URL once it printed it (within [`PATIENCE`]).
    fn wait_url(&self) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(u) = self.url.lock().expect("url").clone() {
                return u;
            }
            assert!(
                Instant::now() < deadline,
                "{} never said where it serves; log:\n{}",
                self.name,
                tail(&self.log)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, and the child reaped.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether it is running; an exit nobody asked for is recorded.
    fn poll(&mut self) -> bool {
        let Some(child) = self.child.as_mut() else {
            return false;
        };
        match child.try_wait().expect("poll") {
            None => true,
            Some(status) => {
                self.exits.push(format!("{}: {status}", self.name));
                self.child = None;
                false
            }
        }
    }

    /// Ctrl-C, and its end (within [`PATIENCE`]): whether it exited cleanly.
    fn stop(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        if child.try_wait().expect("poll").is_some() {
            return false;
        }
        signal(child.id(), "INT");
        common::wait_exit(&mut child, PATIENCE).0
    }
}

/// The last lines of a log.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// A server the test owns (ZooKeeper or moto), SIGKILLed when dropped.
struct Server {
    name: &'static str,
    cmd: Vec<String>,
    log: PathBuf,
    child: Option<Proc>,
    port: u16,
}

impl Server {
    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log");
        let child = Proc::spawn(
            Command::new(&self.cmd[0])
                .args(&self.cmd[1..])
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log"))
                .stderr(log),
        );
        self.child = Some(child);
        let deadline = Instant::now() + PATIENCE;
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "{} did not start; log:\n{}",
                self.name,
                tail(&self.log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }
}

/// What the client learned: every acknowledged insert and when, every
/// failed attempt and when, and inserts refused for good.
#[derive(Default)]
struct ClientLog {
    acked: Vec<(Instant, std::ops::Range<i64>)>,
    errors: Vec<(Instant, String)>,
    refused: Vec<String>,
    /// The newest commit_lsn an acknowledgement named.
    commit_lsn: Lsn,
    /// When an insert's first attempt went out, for the slowest insert.
    slowest: Duration,
}

/// The client: inserts ids `ROWS` at a time, partitioned over three days,
/// each insert under its own idempotency key, sent to whichever writer
/// serves now, and sent again with the same key after every answer that
/// leaves its outcome unknown, until it is answered; stops after the insert
/// in flight once `stop` is set.
fn run_client(
    writer_url: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<ClientLog>>,
) {
    let rt = common::runtime();
    for batch in 0i64.. {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let ids = batch * ROWS..(batch + 1) * ROWS;
        let body: String = ids
            .clone()
            .map(|id| format!("{{\"id\":{id},\"day\":\"2024-05-0{}\"}}\n", 1 + id % 3))
            .collect();
        let body = Bytes::from(body);
        let key = format!("insert-{batch}");
        let first = Instant::now();
        loop {
            assert!(
                first.elapsed() < PATIENCE * 2,
                "insert {key} unanswered for {:?}",
                first.elapsed()
            );
            let url = writer_url.lock().expect("url").clone();
            let Some(url) = url else {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            };
            let client =
                ferry_client::Client::new(&url, None, Duration::from_secs(10)).expect("client");
            match rt.block_on(client.insert_body("t", Format::Ndjson, body.clone(), Some(&key))) {
                Ok(done) => {
                    let mut log = log.lock().expect("log");
                    log.acked.push((Instant::now(), ids.clone()));
                    if let Ok(lsn) = done.commit_lsn.parse::<Lsn>() {
                        log.commit_lsn = log.commit_lsn.max(lsn);
                    }
                    log.slowest = log.slowest.max(first.elapsed());
                    break;
                }
                Err(e) if e.retryable() => {
                    log.lock()
                        .expect("log")
                        .errors
                        .push((Instant::now(), e.to_string()));
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => {
                    log.lock().expect("log").refused.push(format!("{key}: {e}"));
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The processes of the cluster, the writer's supervisor, and the servers.
struct Cluster {
    dir: PathBuf,
    zk: Server,
    s3: Server,
    safekeepers: Vec<Node>,
    /// Writers started so far; the last one is the current one.
    writers: Vec<Node>,
    /// When the current writer was found gone (its supervisor restarts it
    /// [`RESTART_DELAY`] later).
    writer_gone: Option<Instant>,
    writer_url: Arc<Mutex<Option<String>>>,
    writer_args: Vec<String>,
    /// Shard `i / 2`, replica `i % 2`.
    replicas: Vec<Node>,
    env: Vec<(String, String)>,
    lake: String,
}

impl Cluster {
    fn safekeeper_args(dir: &Path, id: usize, port: u16, bucket: &str) -> Vec<String> {
        [
            "safekeeper",
            "--id",
            &id.to_string(),
            "--cluster-id",
            CLUSTER,
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--http",
            "127.0.0.1:0",
            "--segment-bytes",
            &SEG.to_string(),
            "--data-dir",
            &dir.join(format!("sk{id}")).to_string_lossy(),
            "--wal-backup",
            &format!("s3://{bucket}/wal"),
            "--partial-backup-enabled",
            "--partial-backup-timeout",
            "2s",
            "--wal-removal-interval",
            "1s",
            "--restore-quarantine",
            "3s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// The writer the supervisor runs now, its URL published to the client
    /// once it serves.
    fn start_writer(&mut self) {
        let n = self.writers.len();
        let mut writer = Node::new(
            &format!("writer{n}"),
            &self.dir,
            self.writer_args.clone(),
            self.env.clone(),
        );
        writer.start(&[]);
        let published = Arc::clone(&self.writer_url);
        let url = Arc::clone(&writer.url);
        // The client learns the new writer's address as soon as it serves.
        std::thread::spawn(move || {
            let deadline = Instant::now() + PATIENCE;
            while Instant::now() < deadline {
                if let Some(u) = url.lock().expect("url").clone() {
                    *published.lock().expect("url") = Some(u);
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        self.writers.push(writer);
        self.writer_gone = None;
    }

    fn writer(&mut self) -> &mut Node {
        self.writers.last_mut().expect("a writer")
    }

    /// One step of the supervisors: the writer restarted a second after it
    /// exited (whoever ended it), and any safekeeper or replica that exited
    /// without the schedule killing it restarted (recorded in its exits).
    fn supervise(&mut self) {
        let current = self.writers.len() - 1;
        // A superseded writer exits: not restarted, not recorded.
        for w in &mut self.writers[..current] {
            if let Some(child) = w.child.as_mut() {
                if child.try_wait().expect("poll").is_some() {
                    w.child = None;
                }
            }
        }
        let running = {
            let w = self.writer();
            w.child
                .as_mut()
                .map(|c| c.try_wait().expect("poll").is_none())
                .unwrap_or(false)
        };
        if !running {
            self.writer().child = None;
            let gone = *self.writer_gone.get_or_insert_with(Instant::now);
            if gone.elapsed() >= RESTART_DELAY {
                self.start_writer();
            }
        }
        for node in self.safekeepers.iter_mut() {
            if node.child.is_some() && !node.poll() {
                node.start(&["--restore-from-backup"]);
            }
        }
        for node in self.replicas.iter_mut() {
            if node.child.is_some() && !node.poll() {
                // With its last arguments: a replica that exited during a
                // copy from a peer must finish it (it refuses to start
                // without `--bootstrap-from` over an unfinished copy).
                let extra = node.last_extra.clone();
                node.start(&extra.iter().map(String::as_str).collect::<Vec<_>>());
            }
        }
    }

    /// The schedule's own wait: `how_long` of the system running as it is,
    /// the supervisors acting.
    fn run_for(&mut self, how_long: Duration) {
        let until = Instant::now() + how_long;
        while Instant::now() < until {
            self.supervise();
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn s3_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.s3.port)
    }
}

/// One fault of the schedule and what the client saw from its start until
/// the first acknowledgement after it ended.
struct Outcome {
    fault: String,
    held: Duration,
    acked_during: usize,
    errors_during: usize,
    /// From the end of the fault to the next acknowledged insert.
    recovered_in: Duration,
}

/// Waits for an insert acknowledged after `since` (within [`PATIENCE`]),
/// supervising meanwhile: how long it took.
fn wait_for_ack(
    cluster: &mut Cluster,
    log: &Mutex<ClientLog>,
    since: Instant,
    what: &str,
) -> Duration {
    let deadline = since + PATIENCE;
    loop {
        let acked = log
            .lock()
            .expect("log")
            .acked
            .iter()
            .rev()
            .any(|(at, _)| *at > since);
        if acked {
            return since.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "no insert acknowledged within {PATIENCE:?} after {what}; writer log:\n{}",
            tail(&cluster.writer().log)
        );
        cluster.run_for(Duration::from_millis(50));
    }
}

/// Runs one fault: `inject` at once, the system left as it is for `hold`,
/// `heal`, then waits for the next acknowledged insert.
fn fault(
    cluster: &mut Cluster,
    log: &Mutex<ClientLog>,
    outcomes: &mut Vec<Outcome>,
    name: &str,
    hold: Duration,
    inject: impl FnOnce(&mut Cluster),
    heal: impl FnOnce(&mut Cluster),
) {
    eprintln!("[faults] {name}");
    let start = Instant::now();
    inject(cluster);
    cluster.run_for(hold);
    heal(cluster);
    let healed = Instant::now();
    let recovered_in = wait_for_ack(cluster, log, healed, name);
    // A calm moment before the next fault: the client inserts freely.
    cluster.run_for(Duration::from_secs(2));
    let log = log.lock().expect("log");
    outcomes.push(Outcome {
        fault: name.to_string(),
        held: healed - start,
        acked_during: log
            .acked
            .iter()
            .filter(|(at, _)| *at >= start && *at <= healed)
            .count(),
        errors_during: log
            .errors
            .iter()
            .filter(|(at, _)| *at >= start && *at <= healed)
            .count(),
        recovered_in,
    });
}

/// The ids a replica at `url` holds, every partition's rows read once it
/// applied `min_lsn`.
fn replica_ids(rt: &tokio::runtime::Runtime, url: &str, min_lsn: Lsn) -> Vec<i64> {
    let client = node_client(url);
    let deadline = Instant::now() + PATIENCE;
    let partitions = loop {
        let got = rt.block_on(
            client.get_json(&format!("/tables/t/partitions?replica=0&min_lsn={min_lsn}")),
        );
        match got {
            Ok(p) => break p,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "{url} never reached {min_lsn}: {e}"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    };
    let mut ids = Vec::new();
    for p in partitions.as_array().expect("partitions") {
        let partition = p["partition_id"].as_str().expect("partition id");
        let rows = common::http_get(&format!(
            "{url}/tables/t/rows?partition={partition}&replica=0&min_lsn={min_lsn}"
        ));
        for line in rows.lines().filter(|l| !l.is_empty()) {
            let row: serde_json::Value = serde_json::from_str(line).expect("an NDJSON row");
            ids.push(row["id"].as_i64().expect("an id"));
        }
    }
    ids.sort_unstable();
    ids
}

/// Rows in the lake as `ferry lake files --json` counts them (0 while it
/// cannot be read).
fn lake_rows(cluster: &Cluster) -> u64 {
    lake_listing(cluster)["files"]
        .as_array()
        .map(|fs| fs.iter().map(|f| f["rows"].as_u64().unwrap_or(0)).sum())
        .unwrap_or(0)
}

fn lake_listing(cluster: &Cluster) -> serde_json::Value {
    let out = Command::new(FERRY)
        .args(["lake", "files", &cluster.lake, "--json"])
        .envs(cluster.env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("ferry lake files");
    serde_json::from_slice(&out.stdout).unwrap_or_default()
}

/// Each replica's export policy status and its newest export tasks, to say
/// why the lake is behind.
fn export_state(rt: &tokio::runtime::Runtime, cluster: &Cluster) -> String {
    let mut out = String::new();
    for node in &cluster.replicas {
        let Some(url) = node.url.lock().expect("url").clone() else {
            continue;
        };
        let client = node_client(&url);
        let status = rt.block_on(client.get_json("/status")).unwrap_or_default();
        let tasks = rt.block_on(client.get_json("/exports")).unwrap_or_default();
        let newest: Vec<&serde_json::Value> = tasks["tasks"]
            .as_array()
            .map(|t| t.iter().rev().take(6).collect())
            .unwrap_or_default();
        out.push_str(&format!(
            "{}: {}\n  tasks: {}\n",
            node.name,
            status["export_policies"],
            serde_json::to_string(&newest).unwrap_or_default()
        ));
    }
    out
}

/// Every process on this machine whose command line names `dir`.
fn processes_under(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_string_lossy().parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            // A zombie's command line is empty; a live one naming the folder
            // is left behind.
            (cmdline.contains(&needle) && pid != std::process::id())
                .then(|| format!("{pid}: {cmdline}"))
        })
        .collect()
}

#[test]
fn every_acknowledged_insert_is_in_the_lake_once_under_process_faults() {
    use ferry_testkit::services::{service, LAKE_PYTHON};
    let (Some(zk_classpath), Some(moto), Some(_python)) = (
        service("FERRY_TEST_ZK_CLASSPATH"),
        service("FERRY_TEST_MOTO"),
        service(LAKE_PYTHON),
    ) else {
        return;
    };
    // Kept when the test fails (the logs of every process are there);
    // removed at the end otherwise.
    let dir = tempfile::Builder::new()
        .prefix("ferry-faults-")
        .tempdir()
        .expect("tempdir")
        .keep();
    eprintln!("[faults] processes' data and logs in {}", dir.display());
    let rt = common::runtime();

    // ZooKeeper, with its data kept across its own restarts.
    let zk_port = free_port();
    let zk_dir = dir.join("zookeeper");
    std::fs::create_dir_all(zk_dir.join("data")).expect("zk dir");
    std::fs::write(
        zk_dir.join("zoo.cfg"),
        format!(
            "tickTime=200\ninitLimit=10\nsyncLimit=5\ndataDir={}\nclientPortAddress=127.0.0.1\n\
             clientPort={zk_port}\nadmin.enableServer=false\nmaxClientCnxns=0\n",
            zk_dir.join("data").display()
        ),
    )
    .expect("zoo.cfg");
    let zk = Server {
        name: "ZooKeeper",
        cmd: vec![
            "java".into(),
            "-Xmx256m".into(),
            "-cp".into(),
            zk_classpath,
            "org.apache.zookeeper.server.ZooKeeperServerMain".into(),
            zk_dir.join("zoo.cfg").to_string_lossy().to_string(),
        ],
        log: dir.join("zookeeper.log"),
        child: None,
        port: zk_port,
    };
    let s3_port = free_port();
    let s3 = Server {
        name: "moto",
        cmd: vec![
            moto,
            "-H".into(),
            "127.0.0.1".into(),
            "-p".into(),
            s3_port.to_string(),
        ],
        log: dir.join("moto.log"),
        child: None,
        port: s3_port,
    };
    let bucket = "faults";
    let env: Vec<(String, String)> = [
        ("AWS_ENDPOINT", format!("http://127.0.0.1:{s3_port}")),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ALLOW_HTTP", "true".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let sk_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let sk_addrs: Vec<String> = sk_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let zk_connect = format!("127.0.0.1:{zk_port}");
    let writer_args: Vec<String> = [
        "writer",
        "--cluster-id",
        CLUSTER,
        "--safekeepers",
        &sk_addrs.join(","),
        "--segment-bytes",
        &SEG.to_string(),
        "--http",
        "127.0.0.1:0",
        "--zookeeper",
        &zk_connect,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut cluster = Cluster {
        dir: dir.clone(),
        zk,
        s3,
        safekeepers: Vec::new(),
        writers: Vec::new(),
        writer_gone: None,
        writer_url: Arc::new(Mutex::new(None)),
        writer_args,
        replicas: Vec::new(),
        env: env.clone(),
        lake: format!("s3://{bucket}/lake"),
    };
    cluster.zk.start();
    cluster.s3.start();
    rt.block_on(ferry_testkit::services::create_bucket(
        &cluster.s3_endpoint(),
        bucket,
    ));
    for (id, port) in sk_ports.iter().enumerate() {
        let mut sk = Node::new(
            &format!("sk{id}"),
            &dir,
            Cluster::safekeeper_args(&dir, id, *port, bucket),
            env.clone(),
        );
        sk.start(&["--create"]);
        sk.wait_url();
        cluster.safekeepers.push(sk);
    }
    cluster.start_writer();
    let writer_url = cluster.writer().wait_url();
    let table = format!(
        "{}\n[export]\nto = {:?}\nformat = \"iceberg\"\nfreshness = \"1s\"\n",
        TableToml::new("t", ("day", "identity"), ("id", 2))
            .replicas(2)
            .column("id", "Int64")
            .column("day", "Date")
            .toml(),
        cluster.lake
    );
    let deadline = Instant::now() + PATIENCE;
    while let Err(e) = rt.block_on(node_client(&writer_url).create_table_toml(&table)) {
        assert!(
            e.retryable() && Instant::now() < deadline,
            "create table: {e}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for i in 0..4 {
        let (shard, replica) = (i / 2, i % 2);
        let args: Vec<String> = [
            "replica",
            "--cluster-id",
            CLUSTER,
            "--shard",
            &shard.to_string(),
            "--replica",
            &replica.to_string(),
            "--safekeepers",
            &sk_addrs.join(","),
            "--zookeeper",
            &zk_connect,
            "--http",
            "127.0.0.1:0",
            "--data-dir",
            &dir.join(format!("replica{shard}{replica}"))
                .to_string_lossy(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut node = Node::new(&format!("replica{shard}{replica}"), &dir, args, env.clone());
        node.start(&[]);
        cluster.replicas.push(node);
    }

    let log = Arc::new(Mutex::new(ClientLog::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let client = std::thread::spawn({
        let (url, stop, log) = (
            Arc::clone(&cluster.writer_url),
            Arc::clone(&stop),
            Arc::clone(&log),
        );
        move || run_client(url, stop, log)
    });
    let begun = Instant::now();
    wait_for_ack(&mut cluster, &log, begun, "the start");
    cluster.run_for(Duration::from_secs(3));

    let mut outcomes = Vec::new();
    let secs = Duration::from_secs;
    // One after another.
    for id in 0..3 {
        fault(
            &mut cluster,
            &log,
            &mut outcomes,
            &format!("kill -9 safekeeper {id}"),
            secs(2),
            |c| c.safekeepers[id].kill(),
            |c| c.safekeepers[id].start(&["--restore-from-backup"]),
        );
    }
    fault(
        &mut cluster,
        &log,
        &mut outcomes,
        "kill -9 writer (supervisor restarts it)",
        secs(2),
        |c| c.writer().kill(),
        |_| {},
    );
    for i in 0..4 {
        fault(
            &mut cluster,
            &log,
            &mut outcomes,
            &format!("kill -9 replica {} of shard {}", i % 2, i / 2),
            secs(2),
            |c| c.replicas[i].kill(),
            |c| c.replicas[i].start(&[]),
        );
    }
    fault(
        &mut cluster,
        &log,
        &mut outcomes,
        "ZooKeeper down 10 s",
        secs(10),
        |c| c.zk.kill(),
        |c| c.zk.start(),
    );
    fault(
        &mut cluster,
        &log,
        &mut outcomes,
        "S3 paused 10 s (SIGSTOP)",
        secs(10),
        |c| signal(c.s3.pid(), "STOP"),
        |c| signal(c.s3.pid(), "CONT"),
    );
    fault(
        &mut cluster,
        &log,
        &mut outcomes,
        "safekeeper 2 data dir lost, restored from the backup",
        secs(1),
        |c| {
            c.safekeepers[2].kill();
            std::fs::remove_dir_all(c.dir.join("sk2")).expect("lose sk2's data dir");
        },
        |c| c.safekeepers[2].start(&["--restore-from-backup"]),
    );
    fault(
        &mut cluster,
        &log,
        &mut outcomes,
        "writer takeover (a second writer starts)",
        secs(3),
        |c| c.start_writer(),
        |_| {},
    );
    fault(
        &mut cluster,
        &log,
        &mut outcomes,
        "replica 1 of shard 1 data dir lost, rebuilt from its peer",
        secs(1),
        |c| {
            c.replicas[3].kill();
            std::fs::remove_dir_all(c.dir.join("replica11")).expect("lose replica11's data dir");
        },
        |c| c.replicas[3].start(&["--bootstrap-from", "auto"]),
    );
    // Then several at once.
    fault(
        &mut cluster,
        &log,
        &mut outcomes,
        "kill -9 writer + safekeeper 1 + replica 1 of shard 0, S3 paused 5 s",
        secs(5),
        |c| {
            c.writer().kill();
            c.safekeepers[1].kill();
            c.replicas[1].kill();
            signal(c.s3.pid(), "STOP");
        },
        |c| {
            signal(c.s3.pid(), "CONT");
            c.safekeepers[1].start(&["--restore-from-backup"]);
            c.replicas[1].start(&[]);
        },
    );
    fault(
        &mut cluster,
        &log,
        &mut outcomes,
        "ZooKeeper down 10 s + kill -9 safekeeper 0 + replica 0 of shard 1 + writer takeover",
        secs(10),
        |c| {
            c.zk.kill();
            c.safekeepers[0].kill();
            c.replicas[2].kill();
            c.start_writer();
        },
        |c| {
            c.safekeepers[0].start(&["--restore-from-backup"]);
            c.replicas[2].start(&[]);
            c.zk.start();
        },
    );
    fault(
        &mut cluster,
        &log,
        &mut outcomes,
        "safekeeper 0 data dir lost + replica 0 of shard 0 rebuilt + S3 paused 5 s",
        secs(5),
        |c| {
            c.safekeepers[0].kill();
            std::fs::remove_dir_all(c.dir.join("sk0")).expect("lose sk0's data dir");
            c.replicas[0].kill();
            std::fs::remove_dir_all(c.dir.join("replica00")).expect("lose replica00's data dir");
            signal(c.s3.pid(), "STOP");
        },
        |c| {
            signal(c.s3.pid(), "CONT");
            c.safekeepers[0].start(&["--restore-from-backup"]);
            c.replicas[0].start(&["--bootstrap-from", "auto"]);
        },
    );

    // The client ends with the insert in flight answered.
    stop.store(true, Ordering::SeqCst);
    while !client.is_finished() {
        cluster.run_for(Duration::from_millis(100));
    }
    client.join().expect("the client");
    let log = std::mem::take(&mut *log.lock().expect("log"));
    assert!(log.refused.is_empty(), "inserts refused: {:?}", log.refused);
    let acked: Vec<i64> = log.acked.iter().flat_map(|(_, ids)| ids.clone()).collect();
    let acked_set: BTreeSet<i64> = acked.iter().copied().collect();
    assert_eq!(acked.len(), acked_set.len(), "each id acknowledged once");

    // Every replica: its shard's rows, each once; both replicas of a shard
    // the same; the shards together every acknowledged id and nothing else.
    let mut shards: Vec<BTreeSet<i64>> = Vec::new();
    for shard in 0..2 {
        let mut held = Vec::new();
        for replica in 0..2 {
            let node = &cluster.replicas[shard * 2 + replica];
            let ids = replica_ids(&rt, &node.wait_url(), log.commit_lsn);
            let set: BTreeSet<i64> = ids.iter().copied().collect();
            assert_eq!(ids.len(), set.len(), "{}: a row twice", node.name);
            held.push(set);
        }
        assert_eq!(
            held[0], held[1],
            "both replicas of shard {shard} hold the same rows"
        );
        shards.push(held.remove(0));
    }
    assert!(shards[0].is_disjoint(&shards[1]), "a row on both shards");
    let on_replicas: BTreeSet<i64> = shards.iter().flatten().copied().collect();
    let missing: Vec<&i64> = acked_set.difference(&on_replicas).take(10).collect();
    let extra: Vec<&i64> = on_replicas.difference(&acked_set).take(10).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "replicas hold every acknowledged id and nothing else: missing {missing:?}, extra {extra:?}"
    );

    // The lake, read as readers read it. A task that lost a part with a
    // replica's data fails only after the exporter's grace (a minute) and
    // its safety polls, and its partition is exported again: more time.
    let deadline = Instant::now() + PATIENCE * 3;
    loop {
        let rows = lake_rows(&cluster);
        assert!(
            rows <= acked.len() as u64,
            "{rows} rows in the lake, {} acknowledged",
            acked.len()
        );
        if rows == acked.len() as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lake holds {rows} of {} rows; the replicas' export policies and newest tasks:\n{}",
            acked.len(),
            export_state(&rt, &cluster)
        );
        cluster.run_for(Duration::from_millis(500));
    }
    let version = lake_listing(&cluster)["metadata_version"]
        .as_u64()
        .expect("a metadata version");
    let metadata = format!("{}/metadata/v{version}.metadata.json", cluster.lake);
    let read =
        ferry_testkit::services::iceberg_row_counts(&metadata, "id", Some(&cluster.s3_endpoint()))
            .expect("the lake readers");
    let expected: BTreeMap<String, u64> = acked_set.iter().map(|id| (id.to_string(), 1)).collect();
    for reader in ["pyiceberg", "pyiceberg_table", "duckdb"] {
        let got: BTreeMap<String, u64> = read[reader]
            .as_object()
            .expect("counts")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
            .collect();
        let wrong: Vec<_> = got
            .iter()
            .filter(|(id, n)| expected.get(*id) != Some(n))
            .take(10)
            .collect();
        assert!(
            got.len() == expected.len() && wrong.is_empty(),
            "{reader} reads {} ids of {}; wrong: {wrong:?}",
            got.len(),
            expected.len()
        );
    }
    let verified = Command::new(FERRY)
        .args(["verify", "--deep", &cluster.lake])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("ferry verify");
    assert!(verified.status.success(), "{}", common::failed(&verified));

    // Everything stops; nothing is left.
    let mut unclean = Vec::new();
    for node in cluster
        .replicas
        .iter_mut()
        .chain(cluster.writers.iter_mut())
        .chain(cluster.safekeepers.iter_mut())
    {
        if !node.stop() {
            unclean.push(node.name.clone());
        }
    }
    cluster.zk.kill();
    cluster.s3.kill();
    let left = processes_under(&dir);
    assert!(left.is_empty(), "processes left: {left:?}");
    assert!(
        unclean.is_empty(),
        "not stopped cleanly by Ctrl-C: {unclean:?}"
    );

    let exits: Vec<String> = cluster
        .replicas
        .iter()
        .chain(cluster.writers.iter())
        .chain(cluster.safekeepers.iter())
        .flat_map(|n| n.exits.clone())
        .collect();
    eprintln!(
        "[faults] {} inserts ({} rows) acknowledged in {:?}, {} attempts failed and were sent again, slowest insert {:?}",
        log.acked.len(),
        acked.len(),
        begun.elapsed(),
        log.errors.len(),
        log.slowest
    );
    eprintln!(
        "[faults] {:<84} {:>6} {:>6} {:>7} {:>9}",
        "fault", "held", "acked", "errors", "recovery"
    );
    for o in &outcomes {
        eprintln!(
            "[faults] {:<84} {:>5.1}s {:>6} {:>7} {:>8.1}s",
            o.fault,
            o.held.as_secs_f64(),
            o.acked_during,
            o.errors_during,
            o.recovered_in.as_secs_f64()
        );
    }
    eprintln!("[faults] exits nobody asked for (restarted by their supervisor): {exits:?}");
    eprintln!("[faults] not stopped cleanly by Ctrl-C: {unclean:?}");
    // Export tasks a lost part failed (their partitions exported again).
    let lost_parts = cluster
        .replicas
        .iter()
        .map(|n| {
            std::fs::read_to_string(&n.log)
                .unwrap_or_default()
                .matches("is on no replica of")
                .count()
        })
        .sum::<usize>();
    eprintln!(
        "[faults] export tasks failed for a part lost with a replica's data (exported again): {lost_parts}"
    );
    std::fs::remove_dir_all(&dir).expect("remove the test's folder");
    eprintln!("[faults] replicas: every acknowledged id once; lake (pyiceberg, DuckDB): every acknowledged id once; ferry verify --deep clean; no process left");
}
