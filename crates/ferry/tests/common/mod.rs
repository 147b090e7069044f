//! Running `ferry dev`, the WAL roles and the client commands as an operator
//! does, shared by the process tests.
#![allow(dead_code)]

#[allow(unused_imports)] // each test binary uses some of them
pub use ferry_testkit::services::{skipped, zookeeper as zk_address};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// A `ferry` process that is killed (and reaped) when dropped, so a test that
/// fails half-way leaves no server behind to hold ports, disks and CPU for the
/// tests after it. Derefs to the [`Child`].
pub struct Proc(Child);

impl Proc {
    pub fn spawn(cmd: &mut Command) -> Proc {
        Proc(cmd.spawn().expect("spawn ferry"))
    }
}

impl std::ops::Deref for Proc {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Already exited and reaped: both fail, harmlessly.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `cmd` with its stdout piped and reads the lines it prints until
/// `done` holds for one: the process, and the lines read (that one
/// included), or `Err` with them when stdout ended first. What it prints
/// later is drained on a thread, so that a full pipe never stalls it.
pub fn spawn_until(
    cmd: &mut Command,
    mut done: impl FnMut(&str) -> bool,
) -> (Proc, Result<Vec<String>, Vec<String>>) {
    let mut child = Proc::spawn(cmd.stdout(Stdio::piped()));
    let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
    let mut lines = Vec::new();
    let read = loop {
        let mut line = String::new();
        if reader.read_line(&mut line).expect("read stdout") == 0 {
            break Err(lines);
        }
        let line = line.trim_end().to_string();
        let last = done(&line);
        lines.push(line);
        if last {
            break Ok(lines);
        }
    };
    std::thread::spawn(move || for _ in reader.lines().map_while(Result::ok) {});
    (child, read)
}

/// A new temporary folder and the data dir `ferry dev` is to make in it
/// (absent until then).
pub fn fresh_data_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    (dir, data)
}

/// Where a `ferry dev` run on `data_dir` writes its log (beside the data dir).
pub fn dev_log(data_dir: &Path) -> PathBuf {
    data_dir.with_extension("log")
}

/// Starts `ferry dev` on `data_dir` and returns it once it reported ready,
/// with the lines it printed.
pub fn start_dev(data_dir: &Path) -> (Proc, Vec<String>) {
    start_dev_with(data_dir, &[])
}

/// Starts `ferry dev` with extra arguments; see [`start_dev`].
pub fn start_dev_with(data_dir: &Path, extra: &[&str]) -> (Proc, Vec<String>) {
    let log = std::fs::File::create(dev_log(data_dir)).expect("log file");
    let deadline = Instant::now() + Duration::from_secs(30);
    let (child, lines) = spawn_until(
        Command::new(FERRY)
            .args(["dev", "--http", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .stderr(log),
        |line| {
            let ready = line.contains("ferry dev ready");
            assert!(
                ready || Instant::now() < deadline,
                "not ready in time: {line}"
            );
            ready
        },
    );
    let lines = lines.unwrap_or_else(|lines| {
        panic!(
            "ferry dev exited before it was ready: {lines:?}; log:\n{}",
            std::fs::read_to_string(dev_log(data_dir)).unwrap_or_default()
        )
    });
    (child, lines)
}

/// [`start_dev`] on a new data dir (in a new temporary folder, returned
/// first).
pub fn start_fresh_dev() -> (tempfile::TempDir, PathBuf, Proc, Vec<String>) {
    let (dir, data) = fresh_data_dir();
    let (child, lines) = start_dev(&data);
    (dir, data, child, lines)
}

/// Waits for `ferry dev` to exit and asserts it exited cleanly, showing its log
/// if not.
pub fn assert_clean_exit(child: &mut Child, data_dir: &Path) {
    let status = child.wait().expect("wait");
    assert!(
        status.success(),
        "clean exit on Ctrl-C: {status:?}; log:\n{}",
        std::fs::read_to_string(dev_log(data_dir)).unwrap_or_default()
    );
}

/// Ctrl-C to the `ferry dev` on `data_dir`, which must exit cleanly.
pub fn stop_dev(child: &mut Child, data_dir: &Path) {
    interrupt(child);
    assert_clean_exit(child, data_dir);
}

pub fn interrupt(child: &Child) {
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill -INT");
    assert!(status.success());
}

/// Waits (at most `within`) for `child` to exit: its success and its stderr.
pub fn wait_exit(child: &mut Child, within: Duration) -> (bool, String) {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("poll") {
            let mut err = String::new();
            use std::io::Read as _;
            let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut err));
            return (status.success(), err);
        }
        assert!(Instant::now() < deadline, "did not exit in time");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn ready_line(lines: &[String]) -> &str {
    lines
        .iter()
        .find(|l| l.contains("ferry dev ready"))
        .expect("ready line")
}

/// The status URL of a ready `ferry dev`.
pub fn status_url(lines: &[String]) -> String {
    ready_line(lines)
        .rsplit("status on ")
        .next()
        .expect("status url")
        .trim()
        .to_string()
}

/// The HTTP base URL of a ready `ferry dev`.
pub fn base_url(lines: &[String]) -> String {
    status_url(lines).trim_end_matches("/status").to_string()
}

/// The addresses of a ready `ferry dev`'s safekeepers, in order.
pub fn safekeeper_addrs(lines: &[String]) -> Vec<String> {
    ready_line(lines)
        .split("safekeepers (")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .expect("addresses")
        .split(", ")
        .map(str::to_string)
        .collect()
}

/// The status a node at `status_url` serves, as JSON.
pub fn status_json(status_url: &str) -> serde_json::Value {
    serde_json::from_str(&http_get(status_url)).expect("status JSON")
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A client of the node at `url`, without a token.
pub fn node_client(url: &str) -> ferry_client::Client {
    ferry_client::Client::new(url, None, Duration::from_secs(30)).expect("client")
}

/// Runs a `ferry` client command against the node at `url` (without the
/// token the environment may hold): its success, stdout and stderr.
pub fn ferry(args: &[&str], url: &str) -> (bool, String, String) {
    let out = Command::new(FERRY)
        .args(args)
        .env("FERRY_URL", url)
        .env_remove("FERRY_API_TOKEN")
        .stdin(Stdio::null())
        .output()
        .expect("run ferry");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// [`ferry`] that must succeed: its stdout.
pub fn ferry_ok(args: &[&str], url: &str) -> String {
    let (ok, out, err) = ferry(args, url);
    assert!(ok, "ferry {args:?}: {out}{err}");
    out
}

/// Exports `partition` of `table` to `to` one part at a time, so that a
/// process killed meanwhile is killed in the middle: [`ferry`]'s answer.
pub fn export_part_by_part(
    url: &str,
    table: &str,
    partition: &str,
    to: &str,
) -> (bool, String, String) {
    ferry(
        &["export", table, partition, "--to", to, "--parallelism", "1"],
        url,
    )
}

/// The stdout of a finished run that must have succeeded (shown with its
/// stderr if not).
pub fn succeeded(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The stderr of a finished run that must have failed.
pub fn failed(out: &Output) -> String {
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The number `text` gives after `label` (up to the next space).
pub fn number_after(text: &str, label: &str) -> u64 {
    text.split(label)
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after {label:?} in {text}"))
}

/// How many parts the node's exporter exported, as its `/exports` view
/// counts them.
pub fn parts_exported(view: &serde_json::Value) -> u64 {
    view["counters"]["parts_exported"]
        .as_u64()
        .expect("counter")
}

/// Runs `ferry` with `args`, which must fail within 60 s; returns its stderr.
pub fn expect_failure(args: &[&std::ffi::OsStr], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(FERRY);
    cmd.args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = Proc::spawn(&mut cmd);
    let (ok, stderr) = wait_exit(&mut child, Duration::from_secs(60));
    assert!(!ok, "ferry {args:?} succeeded: {stderr}");
    stderr
}

/// A plain HTTP/1.1 request to the node at `url` (`http://host:port`);
/// returns the whole response, status line and headers included.
pub fn http_request(url: &str, request: &str) -> Vec<u8> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http URL");
    let host = rest.split('/').next().expect("host");
    let mut conn = std::net::TcpStream::connect(host).expect("connect");
    conn.write_all(request.as_bytes()).expect("send");
    let mut response = Vec::new();
    conn.read_to_end(&mut response).expect("read");
    response
}

/// GET on a `http://host:port/path` URL, returning the body.
pub fn http_get(url: &str) -> String {
    String::from_utf8(http_get_bytes(url)).expect("a UTF-8 body")
}

/// GET over HTTP/1.0, so that a streamed body arrives as it is (no chunked
/// framing), ended by the server closing the connection.
pub fn http_get_bytes(url: &str) -> Vec<u8> {
    let rest = url.strip_prefix("http://").expect("http URL");
    let (host, path) = rest.split_once('/').expect("path");
    let mut response = http_request(
        url,
        &format!("GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n"),
    );
    let head_end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(response.len(), |i| i + 4);
    let head = String::from_utf8_lossy(&response[..head_end]).to_string();
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&response)
    );
    response.split_off(head_end)
}

/// Sends the safekeeper at `addr` a vote request in `term`, as a writer long
/// gone might have: the term stays behind on it.
pub fn send_vote_request(addr: &str, term: u64) {
    use std::io::Write as _;
    let frame =
        ferry_wal::proto::encode_frame(&ferry_wal::proto::ToSafekeeper::VoteRequest { term })
            .expect("encode");
    let mut conn = std::net::TcpStream::connect(addr).expect("connect");
    conn.write_all(&frame).expect("vote request");
}

/// `ferry writer` of `cluster` on the safekeepers at `addrs`, with an HTTP
/// endpoint on a free port; the caller adds the rest.
pub fn writer_command(cluster: &str, addrs: &[String], segment_bytes: u64) -> Command {
    let mut cmd = Command::new(FERRY);
    cmd.args(["writer", "--cluster-id", cluster, "--safekeepers"])
        .arg(addrs.join(","))
        .args(["--segment-bytes", &segment_bytes.to_string()])
        .args(["--http", "127.0.0.1:0"]);
    cmd
}

/// Starts `ferry safekeeper` (`--create` for a new one) and returns it with the
/// address it listens on.
pub fn start_safekeeper(
    id: u64,
    data: &Path,
    listen: &str,
    create: bool,
    cluster: &str,
    segment_bytes: u64,
) -> (Proc, String) {
    let extra: &[&str] = if create { &["--create"] } else { &[] };
    let (child, addr, _) =
        start_safekeeper_watching(id, data, listen, extra, cluster, segment_bytes, |_| {});
    (child, addr)
}

/// Starts `ferry safekeeper` with `extra` flags, handing each line it prints
/// before it listens to `on_line` as it comes (to act on what a starting
/// safekeeper reports); returns it, the address it listens on and those
/// lines.
pub fn start_safekeeper_watching(
    id: u64,
    data: &Path,
    listen: &str,
    extra: &[&str],
    cluster: &str,
    segment_bytes: u64,
    mut on_line: impl FnMut(&str),
) -> (Proc, String, Vec<String>) {
    let (child, lines) = spawn_until(
        Command::new(FERRY)
            .args([
                "safekeeper",
                "--id",
                &id.to_string(),
                "--cluster-id",
                cluster,
            ])
            .args(["--listen", listen, "--http", "127.0.0.1:0"])
            .args(extra)
            .args(["--segment-bytes", &segment_bytes.to_string(), "--data-dir"])
            .arg(data)
            .stderr(Stdio::null()),
        |line| {
            let listening = line.contains("listening on ");
            if !listening {
                on_line(line);
            }
            listening
        },
    );
    let mut before =
        lines.unwrap_or_else(|lines| panic!("safekeeper {id} exited before listening: {lines:?}"));
    let listening = before.pop().expect("the line saying where it listens");
    let addr = listening
        .split("listening on ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_default()
        .to_string();
    (child, addr, before)
}

/// Safekeepers 0, 1 and 2 under `dir`, on free ports: the processes and their
/// addresses.
pub fn start_three_safekeepers(
    dir: &Path,
    cluster: &str,
    segment_bytes: u64,
) -> (Vec<Proc>, Vec<String>) {
    (0..3)
        .map(|id| {
            start_safekeeper(
                id,
                &dir.join(format!("sk{id}")),
                "127.0.0.1:0",
                true,
                cluster,
                segment_bytes,
            )
        })
        .unzip()
}

/// The committed WAL from LSN 0 up to `end`, as the walsender of the safekeeper
/// at `addr` streams it: every frame must continue the stream and stay within
/// the commit_lsn it announces.
pub async fn read_committed_wal(addr: &str, end: ferry_wal::Lsn) -> bytes::Bytes {
    let received = ferry_testkit::walsender::read_committed(
        &ferry_env::TcpNetwork,
        addr,
        end,
        Duration::from_secs(20),
    )
    .await;
    assert!(received.all_committed, "only committed WAL");
    received.wal
}

/// Every insert block number in the committed WAL of the safekeeper at `addr`.
pub async fn committed_blocks(addr: &str, end: ferry_wal::Lsn) -> Vec<u64> {
    let wal = read_committed_wal(addr, end).await;
    ferry_testkit::wal::records(&wal)
        .into_iter()
        .filter_map(|(_, rec)| match rec {
            ferry_wal::record::Record::Insert { block_number, .. }
            | ferry_wal::record::Record::InsertParts { block_number, .. } => Some(block_number),
            _ => None,
        })
        .collect()
}

/// Whether [`spawn_appends`] appends, waits, or ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Run,
    Pause,
    Stop,
}

/// Appends the inserts of blocks 0, 1... (2000 bytes each, into table 3)
/// one after the other while `flow` says Run, waits while it says Pause,
/// and ends at Stop: the task returns each acknowledged block with its end.
pub fn spawn_appends(
    writer: &std::sync::Arc<ferry_writer::driver::Writer>,
    mut flow: tokio::sync::watch::Receiver<Flow>,
) -> tokio::task::JoinHandle<Vec<(u64, ferry_wal::Lsn)>> {
    let writer = std::sync::Arc::clone(writer);
    tokio::spawn(async move {
        let mut acked = Vec::new();
        for block in 0u64.. {
            let now = *flow
                .wait_for(|f| *f != Flow::Pause)
                .await
                .expect("test runs");
            if now == Flow::Stop {
                break;
            }
            let insert = ferry_testkit::wal::insert(3, block, 2000);
            let end = writer.append(insert).await.expect("acknowledged");
            acked.push((block, end));
        }
        acked
    })
}

/// How far the writer's status says safekeeper `peer` flushed.
pub fn flush_of(s: &ferry_writer::driver::WriterStatus, peer: usize) -> ferry_wal::Lsn {
    s.peers[peer]
        .flush_lsn
        .as_deref()
        .and_then(|f| f.parse().ok())
        .unwrap_or(ferry_wal::Lsn(0))
}

/// Waits (60 s at most) for the task of `appends`, which returns the
/// blocks it appended with their ends, then shuts `writer` down cleanly
/// (once every streaming safekeeper confirmed the final commit): the
/// acknowledged blocks in order, and the end of the WAL.
pub async fn stop_appending(
    writer: std::sync::Arc<ferry_writer::driver::Writer>,
    appends: tokio::task::JoinHandle<Vec<(u64, ferry_wal::Lsn)>>,
) -> (Vec<u64>, ferry_wal::Lsn) {
    let acked = tokio::time::timeout(Duration::from_secs(60), appends)
        .await
        .expect("in time")
        .expect("task");
    let writer = std::sync::Arc::into_inner(writer).expect("sole owner");
    let end = writer.shutdown().await.expect("clean shutdown");
    (acked.into_iter().map(|(b, _)| b).collect(), end)
}

/// Asserts that each safekeeper at `addrs` holds, up to `end`, every block
/// of `blocks` once, in order (and no other insert).
pub async fn assert_every_safekeeper_holds(addrs: &[String], blocks: &[u64], end: ferry_wal::Lsn) {
    for addr in addrs {
        let held = tokio::time::timeout(Duration::from_secs(30), committed_blocks(addr, end))
            .await
            .unwrap_or_else(|_| panic!("safekeeper {addr} reaches {end}"));
        assert_eq!(
            held, blocks,
            "safekeeper {addr} has every acknowledged insert once, in order"
        );
    }
}

/// The commit files in the lake folder `lake` whose name starts with
/// `prefix` (`commit_` for all of them), read as JSON.
pub fn commit_files(lake: &Path, prefix: &str) -> Vec<serde_json::Value> {
    std::fs::read_dir(lake)
        .expect("lake")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| serde_json::from_slice(&std::fs::read(e.path()).expect("read")).expect("JSON"))
        .collect()
}

/// The files `commit` lists, and the files in the lake's `folder` (both as
/// `folder/name`), to show that a commit lists every file once and
/// nothing else lies there.
pub fn listed_and_on_disk(
    lake: &Path,
    folder: &str,
    commit: &serde_json::Value,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let listed = commit["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| f["path"].as_str().expect("path").to_string())
        .collect();
    let on_disk = std::fs::read_dir(lake.join(folder))
        .expect("partition folder")
        .filter_map(Result::ok)
        .map(|e| format!("{folder}/{}", e.file_name().to_string_lossy()))
        .collect();
    (listed, on_disk)
}

/// The active parts of table `t` on replica `replica` of the node at `url`
/// once it applied `min_lsn`, as `name:checksum`, sorted: what two replicas
/// of a shard must agree on.
pub fn part_names(
    rt: &tokio::runtime::Runtime,
    url: &str,
    replica: usize,
    min_lsn: &str,
) -> Vec<String> {
    let listed = rt
        .block_on(node_client(url).get_json(&format!(
            "/tables/t/partitions?replica={replica}&min_lsn={min_lsn}"
        )))
        .expect("partitions");
    let mut names: Vec<String> = listed
        .as_array()
        .expect("partitions")
        .iter()
        .flat_map(|p| p["parts"].as_array().cloned().unwrap_or_default())
        .map(|p| format!("{}:{}", p["name"], p["checksum"]))
        .collect();
    names.sort();
    names
}
