//! The binary as an operator runs it: `ferry dev` starts, reports ready, stops
//! cleanly on Ctrl-C (SIGINT) and finds its state again on the next start; the
//! coordination benchmark runs and prints its figures.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// Where a `ferry dev` run on `data_dir` writes its log (beside the data dir).
fn dev_log(data_dir: &std::path::Path) -> std::path::PathBuf {
    data_dir.with_extension("log")
}

fn start_dev(data_dir: &std::path::Path) -> (std::process::Child, Vec<String>) {
    let log = std::fs::File::create(dev_log(data_dir)).expect("log file");
    let mut child = Command::new(FERRY)
        .args(["dev", "--http", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("spawn ferry dev");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = Vec::new();
    let mut reader = BufReader::new(stdout);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).expect("read stdout");
        assert!(n > 0, "ferry dev exited before it was ready: {lines:?}");
        lines.push(line.trim_end().to_string());
        if line.contains("ferry dev ready") {
            break;
        }
        assert!(Instant::now() < deadline, "not ready in time: {lines:?}");
    }
    // Keep draining stdout so the child never blocks writing to it.
    std::thread::spawn(move || for _ in reader.lines().map_while(Result::ok) {});
    (child, lines)
}

/// Waits for `ferry dev` to exit and asserts it exited cleanly, showing its log
/// if not.
fn assert_clean_exit(child: &mut std::process::Child, data_dir: &std::path::Path) {
    let status = child.wait().expect("wait");
    assert!(
        status.success(),
        "clean exit on Ctrl-C: {status:?}; log:\n{}",
        std::fs::read_to_string(dev_log(data_dir)).unwrap_or_default()
    );
}

fn interrupt(child: &std::process::Child) {
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill -INT");
    assert!(status.success());
}

/// GET on a `http://host:port/path` URL, returning the body.
fn http_get(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http URL");
    let (host, path) = rest.split_once('/').expect("path");
    let mut conn = std::net::TcpStream::connect(host).expect("connect");
    write!(
        conn,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = String::new();
    conn.read_to_string(&mut response).expect("read");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

fn ready_line(lines: &[String]) -> &str {
    lines
        .iter()
        .find(|l| l.contains("ferry dev ready"))
        .expect("ready line")
}

#[test]
fn dev_starts_reports_ready_and_stops_cleanly_on_ctrl_c() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let (mut child, lines) = start_dev(&data);
    let ready = ready_line(&lines);
    assert!(ready.contains("object storage file://"), "{ready}");
    assert!(ready.contains("3 safekeepers"), "{ready}");
    assert!(ready.contains("writer term 1,"), "{ready}");
    assert!(
        data.join("coord").is_dir(),
        "coordination store under the data dir"
    );
    assert!(
        data.join("lake").is_dir(),
        "object storage under the data dir"
    );
    for sk in 0..3 {
        assert!(
            data.join(format!("wal/sk{sk}/safekeeper.control"))
                .is_file(),
            "safekeeper {sk}"
        );
    }
    // A second process on the same data dir is refused while the first runs.
    let second = Command::new(FERRY)
        .args(["dev", "--http", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .output()
        .expect("run a second dev");
    assert!(!second.status.success());
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains("in use by another ferry process"),
        "{stderr}"
    );
    let url = ready
        .rsplit("status on ")
        .next()
        .expect("status url")
        .trim();
    let status = http_get(url);
    assert!(status.contains("\"elected\":true"), "{status}");
    assert_eq!(status.matches("\"node_id\"").count(), 3, "{status}");
    interrupt(&child);
    assert_clean_exit(&mut child, &data);

    // A second start recovers what the first left behind: the safekeepers
    // remember term 1, so the new writer is elected in term 2.
    let (mut child, lines) = start_dev(&data);
    assert!(ready_line(&lines).contains("writer term 2,"), "{lines:?}");
    interrupt(&child);
    assert_clean_exit(&mut child, &data);
}

#[test]
fn dev_elects_its_writer_again_above_a_term_left_behind() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let (mut child, lines) = start_dev(&data);
    let ready = ready_line(&lines);
    // A term left on one safekeeper by a writer long gone: a vote request.
    let addr = ready
        .split("safekeepers (")
        .nth(1)
        .and_then(|rest| rest.split([',', ')']).next())
        .expect("a safekeeper address")
        .to_string();
    let frame =
        ferry_wal::proto::encode_frame(&ferry_wal::proto::ToSafekeeper::VoteRequest { term: 99 })
            .expect("encode");
    let mut conn = std::net::TcpStream::connect(&addr).expect("connect");
    conn.write_all(&frame).expect("vote request");
    // The writer learns of term 99 from that safekeeper, is superseded, and is
    // elected again above it; ferry dev goes on.
    let url = ready
        .rsplit("status on ")
        .next()
        .expect("status url")
        .trim()
        .to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status: serde_json::Value = serde_json::from_str(&http_get(&url)).expect("JSON");
        let writer = &status["writer"];
        if writer["term"] == 100 && writer["elected"] == true {
            assert_eq!(writer["superseded_by"], 99, "{status}");
            break;
        }
        assert!(Instant::now() < deadline, "not elected again: {status}");
        assert!(
            child.try_wait().expect("poll").is_none(),
            "ferry dev stopped"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    interrupt(&child);
    assert_clean_exit(&mut child, &data);
}

#[test]
fn dev_refuses_a_corrupt_store_with_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let coord = dir.path().join("coord");
    std::fs::create_dir_all(&coord).expect("mkdir");
    std::fs::write(
        coord.join("snapshot.00000000000000000001"),
        b"not a snapshot",
    )
    .expect("write");
    let out = Command::new(FERRY)
        .args(["dev", "--data-dir"])
        .arg(dir.path())
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("corrupt"), "{stderr}");
    assert!(
        std::fs::read(coord.join("snapshot.00000000000000000001")).expect("read")
            == b"not a snapshot",
        "nothing was changed"
    );
}

#[test]
fn coordination_benchmark_prints_figures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(FERRY);
    cmd.args(["bench", "coord", "--ops", "300", "--writers", "4", "--dir"])
        .arg(dir.path());
    if let Ok(zk) = std::env::var("FERRY_TEST_ZK") {
        cmd.args(["--zk", &zk]);
    }
    let out = cmd.output().expect("run bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for label in ["create", "set", "get", "10-op multi"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.trim_start().starts_with(label) && l.contains("/s")),
            "no {label} figure in:\n{stdout}"
        );
    }
    if std::env::var("FERRY_TEST_ZK").is_ok() {
        assert!(stdout.contains("100 round trips"), "{stdout}");
        assert!(stdout.contains("1 round trip,"), "{stdout}");
    }
}

#[test]
fn wal_benchmark_prints_figures() {
    // Safekeepers in this process (the default) and as `ferry safekeeper`
    // processes.
    for extra in [None, Some("--processes")] {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = Command::new(FERRY)
            .args(["bench", "wal", "--mib", "2", "--appends", "64", "--dir"])
            .arg(dir.path())
            .args(extra)
            .output()
            .expect("run bench");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for needle in [
            "fdatasync p50",
            "sequential write",
            "64 KiB appends",
            "1024 KiB appends",
            " 1 writers: p50",
            "64 writers: p50",
            "appends per WAL fsync",
        ] {
            assert!(stdout.contains(needle), "no {needle:?} in:\n{stdout}");
        }
        let topology = if extra.is_some() {
            "as separate processes"
        } else {
            "in this process"
        };
        assert!(stdout.contains(topology), "{stdout}");
    }
}

#[test]
fn simulation_runs_seeds_and_replays_one_identically() {
    let out = Command::new(FERRY)
        .args(["sim", "wal", "--seeds", "5", "--start-seed", "100"])
        .output()
        .expect("run sim");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("5 seeds in") && stdout.contains("seeds/s") && stdout.contains("0 failed"),
        "{stdout}"
    );

    let replay = || {
        let out = Command::new(FERRY)
            .args(["sim", "wal", "--seed", "103", "--log"])
            .output()
            .expect("replay");
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = replay();
    assert!(first.contains("elected in term"), "{first}");
    assert!(first.contains("seed 103: ok"), "{first}");
    assert_eq!(first, replay(), "one seed, one event log");
}
