//! A safekeeper process whose data dir is lost is rebuilt with `ferry
//! safekeeper --restore-from-backup` while appends go on (retrying while the
//! backup lacks its first segment): it restores the
//! backed-up whole segments and the newest partial segment, does not vote,
//! is brought back by the writer after its quarantine, catches up, and then
//! holds every acknowledged insert like the others. One rebuilt with
//! `--pull-from-peers` instead does the same from a running peer.

use std::sync::Arc;
use std::time::Duration;

use common::{flush_of, Flow};
use ferry_env::TcpNetwork;
use ferry_wal::Lsn;
use ferry_writer::driver::{Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;

mod common;

use ferry_testkit::writer::status_reaches;

const SEG: u64 = 256 << 10;
const CLUSTER: &str = "restore-test";

fn lsn(s: &str) -> Lsn {
    s.parse().unwrap_or(Lsn(0))
}

/// A writer on the safekeepers at `addrs`, electing quickly.
fn start_writer(addrs: &[String], proposer_id: u128) -> Arc<Writer> {
    let mut config = WriterConfig::new(
        addrs.to_vec(),
        ProposerConfig::new(
            ferry_wal::ClusterId::new(CLUSTER).expect("id"),
            3,
            1,
            SEG,
            proposer_id,
        ),
    );
    config.reconnect_delay = Duration::from_millis(50);
    config.election_timeout = Duration::from_secs(1);
    Arc::new(Writer::start(Arc::new(TcpNetwork), config))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_safekeeper_is_restored_from_the_backup_while_writes_go_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let backup_dir = dir.path().join("backup");
    std::fs::create_dir_all(&backup_dir).expect("backup dir");
    let backup_url = format!("file://{}", backup_dir.display());
    let service = |extra: &'static [&'static str]| -> Vec<String> {
        let mut args: Vec<String> = [
            "--wal-backup",
            &backup_url,
            "--partial-backup-enabled",
            "--partial-backup-timeout",
            "300ms",
            "--wal-removal-interval",
            "200ms",
            // Above the writer's election timeout below.
            "--restore-quarantine",
            "2s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let start = |id: u64, listen: &str, extra: &'static [&'static str]| {
        let args = service(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::start_safekeeper_watching(
            id,
            &dir.path().join(format!("sk{id}")),
            listen,
            &args,
            CLUSTER,
            SEG,
            |_| {},
        )
    };
    let mut children = Vec::new();
    let mut addrs = Vec::new();
    for id in 0..3 {
        let (child, addr, _) = start(id, "127.0.0.1:0", &["--create"]);
        children.push(child);
        addrs.push(addr);
    }
    let writer = start_writer(&addrs, 78);

    // Appends stream one after the other while the flow is Run.
    let (flow, flow_rx) = tokio::sync::watch::channel(Flow::Run);
    let appends = common::spawn_appends(&writer, flow_rx);
    let mut status = writer.subscribe();
    // Some whole segments in the backup first.
    status_reaches(
        &mut status,
        Duration::from_secs(60),
        "segments are backed up",
        |s| lsn(&s.backup_lsn) >= Lsn(4 * SEG),
    )
    .await;
    // A pause longer than the partial backup timeout: every safekeeper
    // uploads the flushed prefix of the segment being written.
    flow.send_replace(Flow::Pause);
    let paused_end = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let s = writer.status();
            if s.commit_lsn == s.end_lsn && s.waiting_appends == 0 {
                let end = lsn(&s.end_lsn);
                tokio::time::sleep(Duration::from_millis(100)).await;
                if lsn(&writer.status().end_lsn) == end {
                    return end;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("appends pause");
    let partial_of = |end: Lsn| format!("_{:016X}_{:016X}_sk", end.0, end.0);
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            // The cluster's folder of the backup.
            let uploaded = std::fs::read_dir(backup_dir.join(CLUSTER).join("partial"))
                .map(|d| {
                    d.filter_map(Result::ok).any(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .contains(&partial_of(paused_end))
                    })
                })
                .unwrap_or(false);
            if uploaded {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a partial segment holds the WAL up to the pause");

    // Safekeeper 2 dies and its data dir is lost.
    children[2].kill().expect("kill -9");
    children[2].wait().expect("reap");
    std::fs::remove_dir_all(dir.path().join("sk2")).expect("lose the data dir");
    // Without the flag it refuses to come back empty.
    let refused = std::process::Command::new(common::FERRY)
        .args(["safekeeper", "--id", "2", "--cluster-id", CLUSTER])
        .args(["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"])
        .args(["--segment-bytes", &SEG.to_string(), "--data-dir"])
        .arg(dir.path().join("sk2"))
        .output()
        .expect("run");
    let refusal = common::failed(&refused);
    assert!(refusal.contains("data was lost"), "{refusal}");
    let before_restore = lsn(&writer.status().commit_lsn);
    // The backup is briefly incomplete (segment 0 away, as while the first
    // segment's upload is still running): the restore is retried, and ends
    // once segment 0 is back.
    let segments = backup_dir.join(CLUSTER).join("wal");
    let first_segment = std::fs::read_dir(&segments)
        .expect("segments")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .min()
        .expect("a whole segment in the backup");
    let aside = dir.path().join("segment-0-aside");
    std::fs::rename(&first_segment, &aside).expect("move segment 0 away");
    let mut retried = 0;
    let (child, _, printed) = {
        let args = service(&["--restore-from-backup"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::start_safekeeper_watching(
            2,
            &dir.path().join("sk2"),
            &addrs[2],
            &args,
            CLUSTER,
            SEG,
            |line| {
                if line.contains("restore attempt failed") {
                    assert!(
                        line.contains("does not hold the timeline's first segment"),
                        "{line}"
                    );
                    retried += 1;
                    if retried == 1 {
                        std::fs::rename(&aside, &first_segment).expect("segment 0 back");
                    }
                }
            },
        )
    };
    assert!(
        retried >= 1,
        "the incomplete backup was retried: {printed:?}"
    );
    children[2] = child;
    // Writes go on while it is in quarantine and while it is brought back
    // (resumed only now so that the segment of the pause stays partial).
    flow.send_replace(Flow::Run);
    let restored = printed
        .iter()
        .find(|l| l.contains("whole segments"))
        .unwrap_or_else(|| panic!("a restore report: {printed:?}"));
    let whole = common::number_after(restored, "restored ");
    assert!(whole >= 4, "{restored}");
    assert!(
        restored.contains(" and partial ") && restored.contains(&format!("WAL up to {paused_end}")),
        "whole segments and the partial one, up to the pause: {restored}"
    );

    // The writer brings it back after its quarantine, and it catches up
    // with WAL written after it came back.
    let after_restore = lsn(&writer.status().end_lsn);
    assert!(after_restore >= before_restore);
    status_reaches(
        &mut status,
        Duration::from_secs(60),
        "the restored safekeeper is brought back and catches up",
        |s| flush_of(s, 2) >= after_restore,
    )
    .await;
    flow.send_replace(Flow::Stop);
    let (blocks, end) = common::stop_appending(writer, appends).await;
    common::assert_every_safekeeper_holds(&addrs, &blocks, end).await;
    drop(children);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_safekeeper_is_pulled_from_a_peer_while_writes_go_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Above the writer's election timeout below.
    let service: &[&str] = &[
        "--restore-quarantine",
        "2s",
        "--wal-removal-interval",
        "200ms",
    ];
    let mut children = Vec::new();
    let mut addrs = Vec::new();
    for id in 0..3u64 {
        let mut args = service.to_vec();
        args.push("--create");
        let (child, addr, _) = common::start_safekeeper_watching(
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
    let writer = start_writer(&addrs, 79);
    let (flow, flow_rx) = tokio::sync::watch::channel(Flow::Run);
    let appends = common::spawn_appends(&writer, flow_rx);
    let mut status = writer.subscribe();
    status_reaches(
        &mut status,
        Duration::from_secs(60),
        "a few segments are committed",
        |s| lsn(&s.commit_lsn) >= Lsn(3 * SEG),
    )
    .await;

    // Safekeeper 2 dies and its data dir is lost while appends go on; it is
    // pulled from the two others.
    children[2].kill().expect("kill -9");
    children[2].wait().expect("reap");
    std::fs::remove_dir_all(dir.path().join("sk2")).expect("lose the data dir");
    let before_pull = lsn(&writer.status().commit_lsn);
    let peers = format!("{},{}", addrs[0], addrs[1]);
    let mut args = service.to_vec();
    args.extend(["--pull-from-peers", peers.as_str()]);
    let (child, _, printed) = common::start_safekeeper_watching(
        2,
        &dir.path().join("sk2"),
        &addrs[2],
        &args,
        CLUSTER,
        SEG,
        |_| {},
    );
    children[2] = child;
    let pulled = printed
        .iter()
        .find(|l| l.contains("safekeeper 2: pulled from"))
        .unwrap_or_else(|| panic!("a pull report: {printed:?}"));
    assert!(
        pulled.contains("votes again once a writer brings it back"),
        "{pulled}"
    );
    let after_pull = lsn(&writer.status().end_lsn);
    assert!(after_pull >= before_pull);
    // Brought back after its quarantine, it catches up with the WAL written
    // meanwhile, and holds every acknowledged insert like the others.
    status_reaches(
        &mut status,
        Duration::from_secs(60),
        "the pulled safekeeper is brought back and catches up",
        |s| flush_of(s, 2) >= after_pull,
    )
    .await;
    flow.send_replace(Flow::Stop);
    let (blocks, end) = common::stop_appending(writer, appends).await;
    common::assert_every_safekeeper_holds(&addrs, &blocks, end).await;
    drop(children);
}
