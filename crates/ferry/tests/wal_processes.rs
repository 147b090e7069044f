//! Safekeepers as real processes: one is killed with SIGKILL in the middle of a
//! stream of appends and restarted from its data dir while the appends go on; no
//! acknowledged record is lost, the restarted safekeeper catches up, and `ferry
//! writer --sync` finds the committed end every safekeeper agrees on.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_env::{Network, TcpNetwork};
use ferry_wal::proto::{self, FromSafekeeper, ToSafekeeper};
use ferry_wal::record::Record;
use ferry_wal::Lsn;
use ferry_writer::driver::{encode_records, Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;

mod common;

use common::{Proc, FERRY};
const SEG: u64 = 1 << 20;
const CLUSTER: &str = "processes-test";

fn cluster_id() -> ferry_wal::ClusterId {
    ferry_wal::ClusterId::new(CLUSTER).expect("id")
}

fn insert(block: u64) -> Bytes {
    encode_records(&[Record::Insert {
        shard: 0,
        idempotency_key: bytes::Bytes::new(),
        table_id: 3,
        block_number: block,
        arrow_ipc: Bytes::from(vec![(block % 256) as u8; 2000]),
    }])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_safekeeper_mid_stream_loses_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut children, addrs) = common::start_three_safekeepers(dir.path(), CLUSTER, SEG);
    let mut config = WriterConfig::new(
        addrs.clone(),
        ProposerConfig::new(cluster_id(), 3, 1, SEG, 77),
    );
    config.reconnect_delay = Duration::from_millis(50);
    let writer = Arc::new(Writer::start(Arc::new(TcpNetwork), config));

    // Appends stream, one after the other, until the test says stop.
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let appends = {
        let writer = Arc::clone(&writer);
        tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut block = 0u64;
            while !*stop_rx.borrow() {
                let end = writer.append(insert(block)).await.expect("acknowledged");
                acked.push((block, end));
                block += 1;
            }
            acked
        })
    };
    let mut status = writer.subscribe();
    let flush_of = |s: &ferry_writer::driver::WriterStatus, peer: usize| -> Lsn {
        s.peers[peer]
            .flush_lsn
            .as_deref()
            .and_then(|f| f.parse().ok())
            .unwrap_or(Lsn(0))
    };
    // SIGKILL safekeeper 0 once it holds some WAL, while appends stream.
    tokio::time::timeout(
        Duration::from_secs(30),
        status.wait_for(|s| flush_of(s, 0) >= Lsn(100_000)),
    )
    .await
    .expect("safekeeper 0 receives WAL")
    .expect("writer runs");
    children[0].kill().expect("kill -9");
    children[0].wait().expect("reap");
    // The quorum of the other two goes on committing without it.
    let before_restart: Lsn = writer.status().commit_lsn.parse().expect("lsn");
    tokio::time::timeout(
        Duration::from_secs(30),
        status.wait_for(|s| {
            s.commit_lsn
                .parse::<Lsn>()
                .is_ok_and(|c| c.0 >= before_restart.0 + 200_000)
        }),
    )
    .await
    .expect("two safekeepers commit")
    .expect("writer runs");
    let (child, _) =
        common::start_safekeeper(0, &dir.path().join("sk0"), &addrs[0], false, CLUSTER, SEG);
    children[0] = child;
    // The restarted safekeeper rejoins and catches up while appends go on:
    // it reaches WAL written after it came back.
    let after_restart: Lsn = writer.status().end_lsn.parse().expect("lsn");
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(|s| flush_of(s, 0) >= after_restart),
    )
    .await
    .expect("the restarted safekeeper catches up")
    .expect("writer runs");
    stop.send_replace(true);

    let acked = tokio::time::timeout(Duration::from_secs(60), appends)
        .await
        .expect("in time")
        .expect("task");
    let writer = Arc::into_inner(writer).expect("sole owner");
    let end = writer.shutdown().await.expect("clean shutdown");

    // The clean shutdown waits for every streaming safekeeper to confirm the
    // final commit_lsn: all three hold every acknowledged insert once, in order.
    let blocks: Vec<u64> = acked.iter().map(|(b, _)| *b).collect();
    assert!(blocks.len() > 100, "appends streamed: {}", blocks.len());
    for addr in &addrs {
        let held =
            tokio::time::timeout(Duration::from_secs(30), common::committed_blocks(addr, end))
                .await
                .unwrap_or_else(|_| panic!("safekeeper {addr} reaches {end}"));
        assert_eq!(
            held, blocks,
            "safekeeper {addr} has every acknowledged insert once, in order"
        );
    }

    // Sync mode: a new writer finds the common committed end.
    let out = Command::new(FERRY)
        .args([
            "writer",
            "--cluster-id",
            CLUSTER,
            "--sync",
            "--http",
            "127.0.0.1:0",
            "--segment-bytes",
            &SEG.to_string(),
            "--safekeepers",
        ])
        .arg(addrs.join(","))
        .output()
        .expect("run writer --sync");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!("committed end {end} ")),
        "expected end {end}: {stdout}"
    );

    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Starts `ferry writer` on `addrs`; returns it once it reports that it started.
fn start_writer_process(addrs: &[String]) -> Proc {
    start_writer_of(CLUSTER, addrs)
}

/// Starts `ferry writer` of `cluster` on `addrs`, once it reports that it started.
fn start_writer_of(cluster: &str, addrs: &[String]) -> Proc {
    let mut child = Proc::spawn(
        Command::new(FERRY)
            .args([
                "writer",
                "--cluster-id",
                cluster,
                "--http",
                "127.0.0.1:0",
                "--segment-bytes",
            ])
            .arg(SEG.to_string())
            .arg("--safekeepers")
            .arg(addrs.join(","))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    reader.read_line(&mut line).expect("read");
    assert!(
        line.contains(&format!("writer for {} safekeepers started", addrs.len())),
        "{line:?}"
    );
    std::thread::spawn(move || for _ in reader.lines().map_while(Result::ok) {});
    child
}

/// The term of the safekeeper at `addr`, as its greeting tells.
async fn safekeeper_term(addr: &str) -> u64 {
    let mut conn = TcpNetwork.connect(addr).await.expect("connect");
    proto::write_frame(
        &mut conn,
        &ToSafekeeper::Greeting(ferry_wal::proto::Greeting {
            cluster_id: cluster_id(),
            proposer_id: 1,
            timeline_id: 1,
            segment_bytes: SEG,
        }),
    )
    .await
    .expect("greet");
    match proto::read_frame::<_, FromSafekeeper>(&mut conn).await {
        Ok(Some(FromSafekeeper::Greeting(g))) => g.term,
        other => panic!("unexpected answer {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_process_takes_over_and_the_first_exits_with_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (children, addrs) = common::start_three_safekeepers(dir.path(), CLUSTER, SEG);
    let wait_for_term = |term: u64| {
        let addrs = addrs.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            loop {
                let mut at_term = 0;
                for addr in &addrs {
                    if safekeeper_term(addr).await >= term {
                        at_term += 1;
                    }
                }
                if at_term >= 2 {
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "no quorum at term {term}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let mut first = start_writer_process(&addrs);
    wait_for_term(1).await;
    let mut second = start_writer_process(&addrs);
    wait_for_term(2).await;
    // The first writer learns of term 2 from its heartbeats and exits.
    let status = tokio::task::spawn_blocking(move || {
        let status = first.wait().expect("wait");
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut first.stderr.take().expect("stderr"), &mut stderr)
            .expect("stderr");
        (status, stderr)
    });
    let (status, stderr) = tokio::time::timeout(Duration::from_secs(20), status)
        .await
        .expect("the first writer exits")
        .expect("task");
    assert!(!status.success(), "superseded is an error exit");
    assert!(stderr.contains("superseded by term 2"), "{stderr}");
    // The second one goes on.
    assert!(
        second.try_wait().expect("poll").is_none(),
        "second writer runs"
    );
    let _ = second.kill();
    let _ = second.wait();
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Waits (at most 30 s) for `child` to exit: its success and its stderr.
async fn exit_of(mut child: Proc) -> (bool, String) {
    let waited = tokio::task::spawn_blocking(move || {
        let status = child.wait().expect("wait");
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr)
            .expect("stderr");
        (status.success(), stderr)
    });
    tokio::time::timeout(Duration::from_secs(30), waited)
        .await
        .expect("the writer exits in time")
        .expect("task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_every_safekeeper_refuses_exits_naming_the_refusal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (children, addrs) = common::start_three_safekeepers(dir.path(), CLUSTER, SEG);
    let writer = start_writer_of("another-cluster", &addrs);
    let (success, stderr) = exit_of(writer).await;
    assert!(!success, "a refused writer exits with an error: {stderr}");
    assert!(
        stderr.contains("every safekeeper refused this writer")
            && stderr.contains(&format!(
                "cluster another-cluster is not served here (this safekeeper belongs to cluster {CLUSTER})"
            )),
        "the refusal is named: {stderr}"
    );
    assert!(
        !stderr.contains("higher term"),
        "a refusal is not a lost election: {stderr}"
    );
    // One refusal per safekeeper, not a retry loop.
    let refusals = stderr.matches("refused this writer's greeting").count();
    assert!(refusals <= addrs.len(), "{refusals} refusals: {stderr}");
    // The safekeepers never voted for it.
    for addr in &addrs {
        assert_eq!(safekeeper_term(addr).await, 0, "{addr}");
    }
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_was_never_elected_stops_on_a_signal() {
    // Addresses where nothing listens: the writer can never be elected.
    let addrs: Vec<String> = (0..3)
        .map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").to_string()
        })
        .collect();
    for signal in ["-TERM", "-INT"] {
        let writer = start_writer_of(CLUSTER, &addrs);
        let sent = Command::new("kill")
            .args([signal, &writer.id().to_string()])
            .status()
            .expect("kill");
        assert!(sent.success());
        let (success, stderr) = exit_of(writer).await;
        assert!(success, "a stop before election is clean: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ferry_replica_unregister_reaches_every_safekeeper_and_names_the_ones_it_did_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (children, addrs) = common::start_three_safekeepers(dir.path(), CLUSTER, SEG);
    let unregister = |addrs: &[String]| {
        Command::new(FERRY)
            .args(["replica", "unregister", "--shard", "1", "--replica", "0"])
            .args(["--safekeepers", &addrs.join(",")])
            .output()
            .expect("run ferry replica unregister")
    };
    let out = unregister(&addrs);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert_eq!(
        stdout.matches("was not registered there").count(),
        3,
        "{stdout}"
    );
    // A safekeeper that cannot be reached is named, and the exit is an error.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .to_string();
    let mut with_gone = addrs.clone();
    with_gone.push(nobody.clone());
    let out = unregister(&with_gone);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains(&format!("({nobody} did not)")), "{stderr}");
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
}
