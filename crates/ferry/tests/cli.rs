//! The binary as an operator runs it: `ferry dev` starts, reports ready, stops
//! cleanly on Ctrl-C (SIGINT) and finds its state again on the next start; the
//! coordination benchmark runs and prints its figures.

use std::process::Command;
use std::time::{Duration, Instant};

mod common;

use common::{
    failed, fresh_data_dir, number_after, ready_line, runtime, safekeeper_addrs, send_vote_request,
    skipped, start_dev, start_fresh_dev, status_json, status_url, stop_dev, succeeded, FERRY,
};
use ferry_testkit::services::{create_bucket, optional_service, S3_ENDPOINT, ZOOKEEPER};

/// A test that panics while its `ferry dev` runs leaves no process behind
/// (one would hold its ports and CPU, and slow every test and benchmark
/// after it).
#[test]
fn a_test_that_fails_half_way_leaves_no_ferry_process_behind() {
    let (_dir, data) = fresh_data_dir();
    let (pid_tx, pid_rx) = std::sync::mpsc::channel();
    let failed = std::thread::spawn(move || {
        let (child, _) = start_dev(&data);
        pid_tx.send(child.id()).expect("send");
        panic!("a failing test, on purpose");
    })
    .join();
    assert!(failed.is_err());
    let pid = pid_rx.recv().expect("the process was started");
    // Killed and reaped by the time the panic unwound: no zombie either.
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "ferry dev {pid} outlived its test"
    );
}

#[test]
fn dev_starts_reports_ready_and_stops_cleanly_on_ctrl_c() {
    let (_dir, data, mut child, lines) = start_fresh_dev();
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
    let stderr = failed(&second);
    assert!(
        stderr.contains("in use by another ferry process"),
        "{stderr}"
    );
    let status = common::http_get(&status_url(&lines));
    assert!(status.contains("\"elected\":true"), "{status}");
    assert_eq!(status.matches("\"node_id\"").count(), 3, "{status}");
    stop_dev(&mut child, &data);

    // A second start recovers what the first left behind: the safekeepers
    // remember term 1, so the new writer is elected in term 2.
    let (mut child, lines) = start_dev(&data);
    assert!(ready_line(&lines).contains("writer term 2,"), "{lines:?}");
    stop_dev(&mut child, &data);
}

#[test]
fn dev_elects_its_writer_again_above_a_term_left_behind() {
    let (_dir, data, mut child, lines) = start_fresh_dev();
    // A term left on one safekeeper by a writer long gone: a vote request.
    send_vote_request(&safekeeper_addrs(&lines)[0], 99);
    // The writer learns of term 99 from that safekeeper, is superseded, and is
    // elected again above it; ferry dev goes on.
    let url = status_url(&lines);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = status_json(&url);
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
    stop_dev(&mut child, &data);
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
    let stderr = failed(&out);
    assert!(stderr.contains("corrupt"), "{stderr}");
    assert!(
        std::fs::read(coord.join("snapshot.00000000000000000001")).expect("read")
            == b"not a snapshot",
        "nothing was changed"
    );
}

/// The demonstration compares two replicas: with one it is refused before
/// the data dir is touched, and a replica count out of range too.
#[test]
fn dev_refuses_a_demo_with_one_replica_and_too_many_replicas() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    for (args, says) in [
        (
            &["--demo", "--replicas", "1"][..],
            "--demo compares 2 replicas",
        ),
        (&["--replicas", "3"][..], "--replicas"),
    ] {
        let out = Command::new(FERRY)
            .args(["dev", "--http", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .args(args)
            .output()
            .expect("run");
        let stderr = failed(&out);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!data.exists(), "{args:?}: the data dir was made");
    }
}

#[test]
fn coordination_benchmark_prints_figures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(FERRY);
    cmd.args(["bench", "coord", "--ops", "300", "--writers", "4", "--dir"])
        .arg(dir.path());
    match optional_service(ZOOKEEPER) {
        Some(zk) => {
            cmd.args(["--zk", &zk]);
        }
        None => {
            skipped("FERRY_TEST_ZK is not set: the ZooKeeper half of this benchmark did not run (scripts/test.sh runs it)");
        }
    }
    let stdout = succeeded(&cmd.output().expect("run bench"));
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
            .env_remove("RUST_LOG")
            .output()
            .expect("run bench");
        let stdout = succeeded(&out);
        for needle in [
            "fdatasync p50",
            "sequential write",
            "64 KiB appends",
            "1024 KiB appends",
            " 1 writers: p50",
            "64 writers: p50",
            "appends per WAL fsync",
            "walsenders streaming from each safekeeper",
            "through loopback",
            "64 writers, backup off: p50",
            "64 writers, backup on : p50",
            "median p50 over 6 runs each",
            "of the WAL rate",
        ] {
            assert!(stdout.contains(needle), "no {needle:?} in:\n{stdout}");
        }
        // The figures are the output: no node's routine log lines around them.
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains(" INFO "), "{stderr}");
        let topology = if extra.is_some() {
            "as separate processes"
        } else {
            "in this process"
        };
        assert!(stdout.contains(topology), "{stdout}");
    }
}

#[test]
fn wal_rebuild_benchmark_prints_figures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(FERRY)
        .args([
            "bench",
            "wal",
            "--rebuild",
            "--rebuild-timelines-mib",
            "24,64",
        ])
        .args(["--rebuild-kept-mib", "8", "--membership-secs", "1", "--dir"])
        .arg(dir.path())
        .env_remove("RUST_LOG")
        .output()
        .expect("run bench");
    let stdout = succeeded(&out);
    for needle in [
        "timeline 24 MiB: pulled",
        "timeline 64 MiB: pulled",
        "the floor",
        "the 64 MiB timeline's pull took",
        "without a change p50",
        "during the replace of safekeeper 2 by 3",
        "during a change / without",
    ] {
        assert!(stdout.contains(needle), "no {needle:?} in:\n{stdout}");
    }
}

/// `ferry sim ...` runs the separate simulator binary beside `ferry` with its
/// arguments, and says how to get it when there is none.
#[test]
fn ferry_sim_runs_the_simulator_binary_beside_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let ferry = dir.path().join("ferry");
    std::fs::copy(FERRY, &ferry).expect("copy ferry");
    let out = Command::new(&ferry)
        .args(["sim", "wal", "--seeds", "3"])
        .output()
        .expect("run");
    let stderr = failed(&out);
    assert!(
        stderr.contains("cargo run --release -p ferry-sim -- wal --seeds 3"),
        "{stderr}"
    );
    // A stand-in simulator that prints its arguments.
    let sim = dir.path().join("ferry-sim");
    std::fs::write(&sim, "#!/bin/sh\necho \"simulator got: $*\"\n").expect("write");
    std::fs::set_permissions(&sim, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = Command::new(&ferry)
        .args(["sim", "wal", "--seed", "7", "--log"])
        .output()
        .expect("run");
    let stdout = succeeded(&out);
    assert_eq!(stdout.trim(), "simulator got: wal --seed 7 --log");
}

#[test]
fn export_scale_benchmark_prints_figures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(FERRY);
    cmd.args([
        "bench",
        "export-scale",
        "--parts",
        "3000",
        "--nodes",
        "4",
        "--dir",
    ])
    .arg(dir.path())
    .env_remove("FERRY_TEST_ZK");
    if let Ok(zk) = std::env::var("FERRY_TEST_ZK") {
        if !zk.is_empty() {
            cmd.args(["--zookeeper", &zk]);
        }
    }
    let stdout = succeeded(&cmd.output().expect("run bench"));
    assert!(stdout.contains("3000 parts by 4 nodes"), "{stdout}");
    assert!(
        stdout.contains("0 coordination round trips for 1000 listings"),
        "the listing reads no coordination: {stdout}"
    );
    let largest = number_after(&stdout, "largest node ");
    assert!(largest > 0 && largest < 1 << 20, "{stdout}");
}

/// The S3 endpoint from `AWS_ENDPOINT_URL` (the name AWS's own tools use)
/// is taken like `AWS_ENDPOINT`, plain HTTP included when it says so.
#[test]
fn aws_endpoint_url_names_the_s3_endpoint() {
    let Some(endpoint) = optional_service(S3_ENDPOINT) else {
        skipped("FERRY_TEST_S3_ENDPOINT is not set (scripts/test.sh sets it)");
        return;
    };
    // A bucket of its own.
    let bucket = format!("endpoint-url-{}", std::process::id());
    runtime().block_on(create_bucket(&endpoint, &bucket));
    let out = Command::new(FERRY)
        .args(["verify", &format!("s3://{bucket}/nothing")])
        .env_remove("AWS_ENDPOINT")
        .env("AWS_ENDPOINT_URL", &endpoint)
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .output()
        .expect("ferry verify");
    // It reached the bucket and found it empty.
    let err = failed(&out);
    assert!(err.contains("nothing was exported there"), "{err}");
}

/// Runs `ferry bench` with `args` and `--dir` a folder that does not exist
/// yet (it is created); asserts it succeeds and prints each of `needles`.
fn bench_smoke(args: &[&str], needles: &[&str]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(FERRY)
        .arg("bench")
        .args(args)
        .arg("--dir")
        .arg(dir.path().join("not-yet"))
        .env_remove("RUST_LOG")
        .env_remove("FERRY_TEST_S3_ENDPOINT")
        .output()
        .expect("run bench");
    let stdout = succeeded(&out);
    for needle in needles {
        assert!(stdout.contains(needle), "no {needle:?} in:\n{stdout}");
    }
}

/// A smoke run at a tiny size: a hang (its third replica once waited for
/// ever for removed WAL) or a crash fails the suite; no figure is judged.
#[test]
fn ingest_benchmark_runs_at_a_tiny_size() {
    bench_smoke(
        &["ingest", "--rows", "20000", "--rows-per-request", "5000"],
        &[
            "NDJSON through HTTP into committed WAL",
            "until both replicas applied it as parts",
            "merges alone",
        ],
    );
}

/// The ClickHouse comparison at a tiny size: every format's file loaded
/// into chDB and into `ferry dev` with 2 replicas and with 1, each load
/// checked for every row (the benchmark fails otherwise); a hang or a
/// crash fails the suite, no figure is judged.
#[test]
fn ingest_against_clickhouse_runs_at_a_tiny_size() {
    let Some(python) = ferry_testkit::services::lake_python() else {
        return;
    };
    bench_smoke(
        &[
            "ingest",
            "--vs-clickhouse",
            "--rows",
            "3000",
            "--python",
            &python,
        ],
        &[
            "NDJSON (",
            "CSV (",
            "Arrow IPC (",
            "Parquet (",
            "ferry, 2 replica(s)",
            "ferry, 1 replica(s)",
            "summary, ferry with 2 replicas against ClickHouse",
        ],
    );
}

/// A smoke run at a tiny size (the local half; the S3 half needs moto).
#[test]
fn export_benchmark_runs_at_a_tiny_size() {
    bench_smoke(
        &[
            "export",
            "--mib",
            "4",
            "--parts",
            "8",
            "--format",
            "iceberg",
            "--commit-partitions",
            "1,10",
        ],
        &[
            "local folder, parquet, 1 node(s)",
            "local folder, parquet, 2 node(s)",
            "local folder, iceberg, 1 node(s)",
            "local folder, iceberg, 2 node(s)",
            "of the Parquet destination's rate",
            "Iceberg commits of 10 partition(s) at once, racing",
            "Iceberg commits of 10 partition(s) at once, queued",
        ],
    );
}

/// `ferry config check` names the file, the line and what is wrong, as one
/// readable error: no debug dump, even with backtraces asked for.
#[test]
fn config_check_errors_are_readable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("ferry.toml");
    std::fs::write(&file, "[dev]\nhttp = \"127.0.0.1:1\"\nbogus = \"x\"\n").expect("write");
    let out = Command::new(FERRY)
        .args(["config", "check"])
        .arg(&file)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run ferry config check");
    let stderr = failed(&out);
    assert!(
        stderr.starts_with("error: configuration file ")
            && stderr.contains("line 3")
            && stderr.contains("unknown field `bogus`"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("backtrace") && !stderr.contains("Caused by"),
        "{stderr}"
    );
}

/// `ferry bench lake` at a tiny size: `ferry dev` started and stopped by
/// the benchmark, both throughput runs and the latency stream printed,
/// every acknowledged batch readable in the lake by the end, the idle
/// partition compacted and then retired.
#[test]
fn lake_benchmark_prints_figures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(FERRY)
        .args([
            "bench",
            "lake",
            "--seconds",
            "2",
            "--freshness-secs",
            "1",
            "--throughput-seconds",
            "1",
            "--rate",
            "1000",
            "--rows-per-request",
            "500",
            "--dir",
        ])
        .arg(dir.path())
        .env_remove("RUST_LOG")
        .output()
        .expect("run bench");
    let stdout = succeeded(&out);
    for needle in [
        "policy off",
        "rows/s, on",
        "acknowledged -> readable in the lake",
        "p99",
        "files in the partition's current commit",
        "after compaction",
        "retention: partition a left replica 0",
        "MiB behind",
    ] {
        assert!(stdout.contains(needle), "no {needle:?} in:\n{stdout}");
    }
    for failure in [
        "not readable within the drain",
        "not compacted",
        "nothing to compact",
    ] {
        assert!(!stdout.contains(failure), "{stdout}");
    }
}

/// `ferry bench copy` at a tiny size: it runs to its end and prints its
/// figures (a hang or a failed copy fails the test).
#[test]
fn copy_benchmark_prints_figures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(FERRY)
        .args(["bench", "copy", "--mib", "4", "--parts", "4", "--dir"])
        .arg(dir.path())
        .env_remove("RUST_LOG")
        .output()
        .expect("run bench");
    let stdout = succeeded(&out);
    for needle in [
        "raw copy of the files",
        "rows of every part checked",
        "footers checked",
        "of the raw copy's rate",
    ] {
        assert!(stdout.contains(needle), "no {needle:?} in:\n{stdout}");
    }
}
