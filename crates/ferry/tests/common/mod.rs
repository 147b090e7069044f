//! Running `ferry dev` as an operator does, shared by the process tests.
#![allow(dead_code)]

#[allow(unused_imports)] // each test binary uses some of them
pub use ferry_testkit::services::{skipped, zookeeper as zk_address};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
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

/// Where a `ferry dev` run on `data_dir` writes its log (beside the data dir).
pub fn dev_log(data_dir: &std::path::Path) -> std::path::PathBuf {
    data_dir.with_extension("log")
}

/// Starts `ferry dev` on `data_dir` and returns it once it reported ready,
/// with the lines it printed.
pub fn start_dev(data_dir: &std::path::Path) -> (Proc, Vec<String>) {
    start_dev_with(data_dir, &[])
}

/// Waits for `ferry dev` to exit and asserts it exited cleanly, showing its log
/// if not.
pub fn assert_clean_exit(child: &mut std::process::Child, data_dir: &std::path::Path) {
    let status = child.wait().expect("wait");
    assert!(
        status.success(),
        "clean exit on Ctrl-C: {status:?}; log:\n{}",
        std::fs::read_to_string(dev_log(data_dir)).unwrap_or_default()
    );
}

pub fn interrupt(child: &std::process::Child) {
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill -INT");
    assert!(status.success());
}

/// GET on a `http://host:port/path` URL, returning the body.
pub fn http_get(url: &str) -> String {
    String::from_utf8(http_get_bytes(url)).expect("a UTF-8 body")
}

/// GET over HTTP/1.0, so that a streamed body arrives as it is (no chunked
/// framing), ended by the server closing the connection.
pub fn http_get_bytes(url: &str) -> Vec<u8> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http URL");
    let (host, path) = rest.split_once('/').expect("path");
    let mut conn = std::net::TcpStream::connect(host).expect("connect");
    write!(conn, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").expect("send");
    let mut response = Vec::new();
    conn.read_to_end(&mut response).expect("read");
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

pub fn ready_line(lines: &[String]) -> &str {
    lines
        .iter()
        .find(|l| l.contains("ferry dev ready"))
        .expect("ready line")
}

/// Starts `ferry dev` with extra arguments; see [`start_dev`].
pub fn start_dev_with(data_dir: &std::path::Path, extra: &[&str]) -> (Proc, Vec<String>) {
    let log = std::fs::File::create(dev_log(data_dir)).expect("log file");
    let mut child = Proc::spawn(
        Command::new(FERRY)
            .args(["dev", "--http", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(log),
    );
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = Vec::new();
    let mut reader = BufReader::new(stdout);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).expect("read stdout");
        assert!(
            n > 0,
            "ferry dev exited before it was ready: {lines:?}; log:\n{}",
            std::fs::read_to_string(dev_log(data_dir)).unwrap_or_default()
        );
        lines.push(line.trim_end().to_string());
        if line.contains("ferry dev ready") {
            break;
        }
        assert!(Instant::now() < deadline, "not ready in time: {lines:?}");
    }
    std::thread::spawn(move || for _ in reader.lines().map_while(Result::ok) {});
    (child, lines)
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
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().expect("poll") {
            let mut stderr = String::new();
            use std::io::Read as _;
            child
                .stderr
                .take()
                .expect("stderr")
                .read_to_string(&mut stderr)
                .expect("read stderr");
            assert!(!status.success(), "ferry {args:?} succeeded: {stderr}");
            return stderr;
        }
        if Instant::now() > deadline {
            panic!("ferry {args:?} did not fail within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
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

/// Starts `ferry safekeeper` (`--create` for a new one) and returns it with the
/// address it listens on.
pub fn start_safekeeper(
    id: u64,
    data: &std::path::Path,
    listen: &str,
    create: bool,
    cluster: &str,
    segment_bytes: u64,
) -> (Proc, String) {
    let extra: &[&str] = if create { &["--create"] } else { &[] };
    let (child, addr, _) = start_safekeeper_with(id, data, listen, extra, cluster, segment_bytes);
    (child, addr)
}

/// Starts `ferry safekeeper` with `extra` flags; returns it, the address it
/// listens on and the lines it printed before saying so.
pub fn start_safekeeper_with(
    id: u64,
    data: &std::path::Path,
    listen: &str,
    extra: &[&str],
    cluster: &str,
    segment_bytes: u64,
) -> (Proc, String, Vec<String>) {
    start_safekeeper_watching(id, data, listen, extra, cluster, segment_bytes, |_| {})
}

/// [`start_safekeeper_with`], handing each line it prints before it listens
/// to `on_line` as it comes (to act on what a starting safekeeper reports).
pub fn start_safekeeper_watching(
    id: u64,
    data: &std::path::Path,
    listen: &str,
    extra: &[&str],
    cluster: &str,
    segment_bytes: u64,
    mut on_line: impl FnMut(&str),
) -> (Proc, String, Vec<String>) {
    let mut child = Proc::spawn(
        Command::new(FERRY)
            .args([
                "safekeeper",
                "--id",
                &id.to_string(),
                "--cluster-id",
                cluster,
                "--listen",
                listen,
                "--http",
                "127.0.0.1:0",
            ])
            .args(extra)
            .args(["--segment-bytes", &segment_bytes.to_string(), "--data-dir"])
            .arg(data)
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
    let mut before = Vec::new();
    let addr = loop {
        let mut line = String::new();
        let read = reader.read_line(&mut line).expect("read");
        assert!(
            read > 0,
            "safekeeper {id} exited before listening: {before:?}"
        );
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split(',').next().unwrap_or_default().to_string();
        }
        on_line(line.trim_end());
        before.push(line.trim_end().to_string());
    };
    std::thread::spawn(move || for _ in reader.lines().map_while(Result::ok) {});
    (child, addr, before)
}

/// Safekeepers 0, 1 and 2 under `dir`, on free ports: the processes and their
/// addresses.
pub fn start_three_safekeepers(
    dir: &std::path::Path,
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
    use ferry_env::Network as _;
    use ferry_wal::proto::{self, FromSafekeeper, ToSafekeeper};
    use ferry_wal::Lsn;
    let mut conn = ferry_env::TcpNetwork
        .connect(addr)
        .await
        .expect("connect to a safekeeper");
    proto::write_frame(
        &mut conn,
        &ToSafekeeper::StartReplication {
            shard_number: 0,
            start_lsn: Lsn(0),
        },
    )
    .await
    .expect("start replication");
    let mut wal = Vec::new();
    while (wal.len() as u64) < end.0 {
        let msg: FromSafekeeper =
            tokio::time::timeout(Duration::from_secs(20), proto::read_frame(&mut conn))
                .await
                .expect("WAL in time")
                .expect("frame")
                .expect("open");
        if let FromSafekeeper::Wal {
            begin_lsn,
            commit_lsn,
            wal: chunk,
        } = msg
        {
            assert_eq!(
                begin_lsn,
                Lsn(wal.len() as u64),
                "frames continue the stream"
            );
            assert!(
                begin_lsn.0 + chunk.len() as u64 <= commit_lsn.0,
                "only committed WAL"
            );
            wal.extend_from_slice(&chunk);
        }
    }
    bytes::Bytes::from(wal)
}

/// Every record of `wal` (which starts at LSN 0), with the LSN it starts at.
pub fn records_of(wal: &bytes::Bytes) -> Vec<(u64, ferry_wal::record::Record)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < wal.len() {
        let (rec, len) = ferry_wal::record::decode(&wal.slice(at..)).expect("whole records");
        out.push((at as u64, rec));
        at += len;
    }
    out
}

/// Every insert block number in the committed WAL of the safekeeper at `addr`.
pub async fn committed_blocks(addr: &str, end: ferry_wal::Lsn) -> Vec<u64> {
    let wal = read_committed_wal(addr, end).await;
    records_of(&wal)
        .into_iter()
        .filter_map(|(_, rec)| match rec {
            ferry_wal::record::Record::Insert { block_number, .. } => Some(block_number),
            _ => None,
        })
        .collect()
}
