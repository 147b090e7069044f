//! Changing the safekeeper set with real processes: `ferry safekeeper-set`
//! replaces safekeeper 2 by a new one (pulled from its peers) while appends
//! go on, then one of the new set is killed: the writer goes on with the
//! other two. That one then loses its data dir and, started with ZooKeeper
//! only, is pulled from the members the configuration names; at the end
//! every acknowledged append is on all three of the new set.

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use ferry_env::TcpNetwork;
use ferry_wal::Lsn;
use ferry_writer::driver::{Writer, WriterConfig, WriterError};
use ferry_writer::proposer::ProposerConfig;

const SEG: u64 = 1 << 20;
const CLUSTER: &str = "membership-test";

/// Runs `ferry safekeeper-set ARGS` against ZooKeeper `zk`: its success
/// and its output.
fn safekeeper_set(zk: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(FERRY)
        .arg("safekeeper-set")
        .args(args)
        .args([
            "--zookeeper",
            zk,
            "--cluster-id",
            CLUSTER,
            "--timeout",
            "2m",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run ferry safekeeper-set");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// What an append loop saw: blocks acknowledged, and blocks whose outcome
/// is unknown (in flight when the writer started over with a new
/// configuration).
#[derive(Debug, Default)]
struct Appended {
    acked: Vec<u64>,
    unknown: Vec<u64>,
}

fn spawn_appends(
    writer: &Arc<Writer>,
    mut flow: tokio::sync::watch::Receiver<Flow>,
) -> tokio::task::JoinHandle<Appended> {
    let writer = Arc::clone(writer);
    tokio::spawn(async move {
        let mut seen = Appended::default();
        for block in 0u64.. {
            if *flow
                .wait_for(|f| *f != Flow::Pause)
                .await
                .expect("test runs")
                == Flow::Stop
            {
                break;
            }
            match writer
                .append(ferry_testkit::wal::insert(3, block, 2000))
                .await
            {
                Ok(_) => seen.acked.push(block),
                Err(WriterError::Reconfigured { .. }) => seen.unknown.push(block),
                Err(e) => panic!("append of block {block}: {e}"),
            }
        }
        seen
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_safekeeper_is_replaced_while_appends_go_on_and_the_new_set_survives_a_kill() {
    let Some(zk) = zk_address() else { return };
    let connect = ferry_testkit::services::zookeeper_chroot(&zk, "membership").await;
    let dir = tempfile::tempdir().expect("tempdir");
    // The quarantine of a pulled safekeeper is above the writer's election
    // timeout below.
    let service: &[&str] = &["--restore-quarantine", "2s"];
    let mut children = Vec::new();
    let mut addrs = Vec::new();
    for id in 0..3u64 {
        let mut args = service.to_vec();
        args.push("--create");
        let (child, addr, _) = start_safekeeper_watching(
            id,
            &dir.path().join(format!("sk{id}")),
            "127.0.0.1:0",
            &args,
            CLUSTER,
            SEG,
            |_| {},
        );
        children.push(child);
        addrs.push(addr);
    }
    // The set is recorded as generation 1 before the writer starts, as an
    // operator would when a cluster is first deployed.
    let members = format!("0={},1={},2={}", addrs[0], addrs[1], addrs[2]);
    let (ok, out) = safekeeper_set(&connect, &["init", "--members", &members]);
    assert!(ok && out.contains("generation 1"), "{out}");
    let (ok, out) = safekeeper_set(&connect, &["init", "--members", &members]);
    assert!(!ok && out.contains("already recorded"), "init twice: {out}");

    // The writer starts with generation 0 (its flags): the safekeepers tell
    // it generation 1 and it starts over with it.
    let mut config = WriterConfig::new(
        addrs.clone(),
        ProposerConfig::new(
            ferry_wal::ClusterId::new(CLUSTER).expect("id"),
            3,
            1,
            SEG,
            91,
        ),
    );
    config.reconnect_delay = Duration::from_millis(50);
    config.election_timeout = Duration::from_secs(1);
    let writer = Arc::new(Writer::start(Arc::new(TcpNetwork), config));
    let (flow, flow_rx) = tokio::sync::watch::channel(Flow::Run);
    let appends = spawn_appends(&writer, flow_rx);
    let mut status = writer.subscribe();
    let committed =
        |s: &ferry_writer::driver::WriterStatus| s.commit_lsn.parse::<Lsn>().unwrap_or(Lsn(0));
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(|s| committed(s) >= Lsn(2 * SEG)),
    )
    .await
    .expect("two segments committed in time")
    .expect("writer runs");

    // The new safekeeper 3 is pulled from its peers, then replaces 2.
    let peers = format!("{},{}", addrs[0], addrs[1]);
    let mut args = service.to_vec();
    args.extend(["--pull-from-peers", peers.as_str()]);
    let (child, addr3, printed) = start_safekeeper_watching(
        3,
        &dir.path().join("sk3"),
        "127.0.0.1:0",
        &args,
        CLUSTER,
        SEG,
        |_| {},
    );
    assert!(
        printed.iter().any(|l| l.contains("pulled from")),
        "{printed:?}"
    );
    children.push(child);
    addrs.push(addr3.clone());
    let new = format!("3={addr3}");
    let change = tokio::task::spawn_blocking({
        let connect = connect.clone();
        move || safekeeper_set(&connect, &["replace", "--old", "2", "--new", &new])
    });
    let (ok, out) = change.await.expect("change task");
    assert!(ok, "replace: {out}");
    assert!(
        out.contains("joint") && out.contains("caught up") && out.contains("generation 3"),
        "{out}"
    );
    let (ok, out) = safekeeper_set(&connect, &["show"]);
    assert!(
        ok && out.contains("generation 3") && !out.contains("joint"),
        "{out}"
    );

    // The writer follows in place: its slots are the old set's and the new
    // member's, the removed one without an address.
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(|s| {
            s.generation == 3
                && s.elected
                && s.peers.iter().map(|p| p.addr.as_str()).collect::<Vec<_>>()
                    == [addrs[0].as_str(), addrs[1].as_str(), "", addr3.as_str()]
        }),
    )
    .await
    .expect("the writer runs on the new set in time")
    .expect("writer runs");
    let before_kill = committed(&writer.status());

    // The old safekeeper 2 is gone for good, and safekeeper 0 of the new
    // set is killed: 1 and 3 are a majority of the new set.
    children[2].kill().expect("kill -9");
    children[2].wait().expect("reap");
    children[0].kill().expect("kill -9");
    children[0].wait().expect("reap");
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(|s| committed(s) >= Lsn(before_kill.0 + 2 * SEG)),
    )
    .await
    .expect("appends commit on safekeepers 1 and 3")
    .expect("writer runs");

    // Safekeeper 0 lost its data dir: started with ZooKeeper only, it is
    // pulled from the other members the configuration names, brought back
    // by the writer, and catches up.
    std::fs::remove_dir_all(dir.path().join("sk0")).expect("lose the data dir");
    let mut args = service.to_vec();
    args.extend(["--zookeeper", connect.as_str()]);
    let (child, _, printed) = start_safekeeper_watching(
        0,
        &dir.path().join("sk0"),
        &addrs[0],
        &args,
        CLUSTER,
        SEG,
        |_| {},
    );
    children[0] = child;
    assert!(
        printed
            .iter()
            .any(|l| l.contains("safekeeper 0: pulled from")),
        "{printed:?}"
    );
    let target = committed(&writer.status());
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(|s| flush_of(s, 0) >= target),
    )
    .await
    .expect("safekeeper 0 is brought back and catches up in time")
    .expect("writer runs");

    flow.send_replace(Flow::Stop);
    let seen = tokio::time::timeout(Duration::from_secs(60), appends)
        .await
        .expect("appends stop in time")
        .expect("append task");
    let writer = Arc::into_inner(writer).expect("sole owner");
    let end = writer.shutdown().await.expect("clean shutdown on 1 and 3");
    assert!(!seen.acked.is_empty());
    for addr in [&addrs[0], &addrs[1], &addr3] {
        let held = tokio::time::timeout(Duration::from_secs(30), committed_blocks(addr, end))
            .await
            .unwrap_or_else(|_| panic!("safekeeper {addr} reaches {end}"));
        // Every acknowledged block, once, in order; nothing but blocks sent.
        let mut sorted = held.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted, held, "{addr}: each block once, in order");
        for b in &seen.acked {
            assert!(
                held.contains(b),
                "{addr}: acknowledged block {b} is missing"
            );
        }
        for b in &held {
            assert!(
                seen.acked.contains(b) || seen.unknown.contains(b),
                "{addr}: block {b} was never sent"
            );
        }
    }
    drop(children);
}
