//! Safekeepers as real processes: one is killed with SIGKILL in the middle of a
//! stream of appends and restarted from its data dir while the appends go on; no
//! acknowledged record is lost, the restarted safekeeper catches up, and `ferry
//! writer --sync` finds the committed end every safekeeper agrees on.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ferry_env::{Network, TcpNetwork};
use ferry_wal::proto::{self, FromSafekeeper, ToSafekeeper};
use ferry_wal::Lsn;
use ferry_writer::driver::{Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;

mod common;

use ferry_testkit::writer::status_reaches;

use common::{
    assert_every_safekeeper_holds, failed, flush_of, spawn_appends, spawn_until, stop_appending,
    succeeded, writer_command, Flow, Proc, FERRY,
};
const SEG: u64 = 1 << 20;
const CLUSTER: &str = "processes-test";

fn cluster_id() -> ferry_wal::ClusterId {
    ferry_wal::ClusterId::new(CLUSTER).expect("id")
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
    let (flow, flow_rx) = tokio::sync::watch::channel(Flow::Run);
    let appends = spawn_appends(&writer, flow_rx);
    let mut status = writer.subscribe();
    // SIGKILL safekeeper 0 once it holds some WAL, while appends stream.
    status_reaches(
        &mut status,
        Duration::from_secs(30),
        "safekeeper 0 receives WAL",
        |s| flush_of(s, 0) >= Lsn(100_000),
    )
    .await;
    children[0].kill().expect("kill -9");
    children[0].wait().expect("reap");
    // The quorum of the other two goes on committing without it.
    let before_restart: Lsn = writer.status().commit_lsn.parse().expect("lsn");
    status_reaches(
        &mut status,
        Duration::from_secs(30),
        "two safekeepers commit",
        |s| {
            s.commit_lsn
                .parse::<Lsn>()
                .is_ok_and(|c| c.0 >= before_restart.0 + 200_000)
        },
    )
    .await;
    let (child, _) =
        common::start_safekeeper(0, &dir.path().join("sk0"), &addrs[0], false, CLUSTER, SEG);
    children[0] = child;
    // The restarted safekeeper rejoins and catches up while appends go on:
    // it reaches WAL written after it came back.
    let after_restart: Lsn = writer.status().end_lsn.parse().expect("lsn");
    status_reaches(
        &mut status,
        Duration::from_secs(60),
        "the restarted safekeeper catches up",
        |s| flush_of(s, 0) >= after_restart,
    )
    .await;
    flow.send_replace(Flow::Stop);

    let (blocks, end) = stop_appending(writer, appends).await;

    // The clean shutdown waits for every streaming safekeeper to confirm the
    // final commit_lsn: all three hold every acknowledged insert once, in order.
    assert!(blocks.len() > 100, "appends streamed: {}", blocks.len());
    assert_every_safekeeper_holds(&addrs, &blocks, end).await;

    // Sync mode: a new writer finds the common committed end.
    let out = writer_command(CLUSTER, &addrs, SEG)
        .arg("--sync")
        .output()
        .expect("run writer --sync");
    let stdout = succeeded(&out);
    assert!(
        stdout.contains(&format!("committed end {end} ")),
        "expected end {end}: {stdout}"
    );

    drop(children);
}

/// Starts `ferry writer` on `addrs`; returns it once it reports that it started.
fn start_writer_process(addrs: &[String]) -> Proc {
    start_writer_of(CLUSTER, addrs)
}

/// Starts `ferry writer` of `cluster` on `addrs`, once it reports that it started.
fn start_writer_of(cluster: &str, addrs: &[String]) -> Proc {
    let (child, first) = spawn_until(
        writer_command(cluster, addrs, SEG).stderr(Stdio::piped()),
        |_| true,
    );
    let line = first.unwrap_or_default().concat();
    assert!(
        line.contains(&format!("writer for {} safekeepers started", addrs.len())),
        "{line:?}"
    );
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
            configuration: None,
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
    let first = start_writer_process(&addrs);
    wait_for_term(1).await;
    let mut second = start_writer_process(&addrs);
    wait_for_term(2).await;
    // The first writer learns of term 2 from its heartbeats and exits.
    let (success, stderr) = exit_of(first, Duration::from_secs(20)).await;
    assert!(!success, "superseded is an error exit");
    assert!(stderr.contains("superseded by term 2"), "{stderr}");
    // The second one goes on.
    assert!(
        second.try_wait().expect("poll").is_none(),
        "second writer runs"
    );
    let _ = second.kill();
    let _ = second.wait();
    drop(children);
}

/// Waits (at most `within`) for `child` to exit, off the runtime: its
/// success and its stderr.
async fn exit_of(mut child: Proc, within: Duration) -> (bool, String) {
    tokio::task::spawn_blocking(move || common::wait_exit(&mut child, within))
        .await
        .expect("task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_every_safekeeper_refuses_exits_naming_the_refusal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (children, addrs) = common::start_three_safekeepers(dir.path(), CLUSTER, SEG);
    let writer = start_writer_of("another-cluster", &addrs);
    let (success, stderr) = exit_of(writer, Duration::from_secs(30)).await;
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
    drop(children);
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
        let (success, stderr) = exit_of(writer, Duration::from_secs(30)).await;
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
    let stdout = succeeded(&out);
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
    let stderr = failed(&out);
    assert!(stderr.contains(&format!("({nobody} did not)")), "{stderr}");
    drop(children);
}
