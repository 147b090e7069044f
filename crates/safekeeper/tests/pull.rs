//! A lost safekeeper rebuilt from a peer: it holds exactly the donor's
//! committed WAL from the donor's removal horizon, marked committed and
//! restored (no vote until a writer brings it back), with the segments
//! below recorded as removed; refusals (another cluster, itself, a data dir
//! that holds a safekeeper) change nothing.

// Tests look at real files directly; node code may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use ferry_env::{Disk, Network, TcpNetwork};
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig, RemovalHorizon};
use ferry_safekeeper::pull::{pull_from_peer, PullError};
use ferry_safekeeper::server::SafekeeperServer;
use ferry_safekeeper::wal_storage::WalStorageError;
use ferry_testkit::disk::temp_disk;
use ferry_wal::proto::{AppendRequest, ProposerElected};
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn, TermHistory, TermLsn};

const SEG: u64 = 64 << 10;

fn config(cluster: &str, node: u64) -> AcceptorConfig {
    AcceptorConfig {
        cluster_id: ClusterId::new(cluster).expect("id"),
        node_id: node,
        timeline_id: 1,
        segment_size: SegmentSize::new(SEG).expect("seg"),
        preallocation: Default::default(),
    }
}

/// Batches of inserts until they reach past `len` bytes.
fn records_past(len: u64) -> Bytes {
    let mut wal = BytesMut::new();
    while (wal.len() as u64) < len {
        wal.extend_from_slice(&ferry_testkit::wal::inserts(1, 0..7, 100));
    }
    wal.freeze()
}

/// A donor elected in term 3 holding `wal` committed, with the segments
/// below the third removed.
async fn donor(disk: &Arc<dyn Disk>, wal: &Bytes) -> Acceptor {
    let mut a = Acceptor::create(Arc::clone(disk), "donor", config("c", 0))
        .await
        .expect("create");
    a.handle_vote(3).await.expect("vote");
    a.handle_elected(&ProposerElected {
        term: 3,
        start_streaming_at: Lsn(0),
        term_history: TermHistory(vec![TermLsn {
            term: 3,
            lsn: Lsn(0),
        }]),
        timeline_start_lsn: Lsn(0),
        rejoin: false,
    })
    .await
    .expect("elected");
    let end = Lsn(wal.len() as u64);
    a.append_no_flush(&AppendRequest {
        term: 3,
        begin_lsn: Lsn(0),
        end_lsn: end,
        commit_lsn: end,
        truncate_lsn: end,
        wal: wal.clone(),
        ..AppendRequest::default()
    })
    .await
    .expect("append");
    a.flush_appends().await.expect("flush");
    // The commit announced with the append applies at the next message.
    a.append_no_flush(&AppendRequest {
        term: 3,
        begin_lsn: end,
        end_lsn: end,
        commit_lsn: end,
        truncate_lsn: end,
        ..AppendRequest::default()
    })
    .await
    .expect("heartbeat");
    a.flush_appends().await.expect("flush");
    assert_eq!(a.commit_lsn(), end);
    let horizon = Lsn(2 * SEG + 10);
    let removed = a
        .remove_old_wal(&RemovalHorizon {
            replicas: horizon,
            peers: horizon,
            backup: None,
            walsenders: None,
            pulls: None,
        })
        .await
        .expect("remove");
    assert_eq!(removed, 2);
    assert_eq!(a.wal_kept_from(), Lsn(2 * SEG));
    a
}

#[tokio::test]
async fn a_pulled_safekeeper_holds_the_donors_committed_wal_from_its_horizon() {
    let (dir, disk) = temp_disk();
    let wal = records_past(4 * SEG + SEG / 3);
    let end = Lsn(wal.len() as u64);
    let network: Arc<dyn Network> = Arc::new(TcpNetwork);
    let server = SafekeeperServer::start(
        Arc::clone(&network),
        "127.0.0.1:0",
        donor(&disk, &wal).await,
    )
    .await
    .expect("serve");
    let addr = server.addr().to_string();

    let report = pull_from_peer(
        Arc::clone(&disk),
        "pulled",
        &config("c", 2),
        network.as_ref(),
        &addr,
        None,
    )
    .await
    .expect("pull");
    assert_eq!(report.start_lsn, Lsn(2 * SEG), "from the donor's horizon");
    assert_eq!(report.commit_lsn, end);
    assert_eq!(report.term, 3);
    assert_eq!(
        report.bytes,
        end.0 - 2 * SEG,
        "only the WAL above the horizon"
    );
    assert!(!dir
        .path()
        .join("pulled/wal")
        .join(config("c", 2).segment_size.file_name(0))
        .exists());

    let a = Acceptor::open(Arc::clone(&disk), "pulled", config("c", 2))
        .await
        .expect("open pulled");
    assert_eq!(a.flush_lsn(), end);
    assert_eq!(a.commit_lsn(), end, "all of it committed");
    assert_eq!(
        a.restored_up_to(),
        Some(end),
        "votes only once brought back"
    );
    assert_eq!(a.term(), 3);
    assert_eq!(a.wal_kept_from(), Lsn(2 * SEG));
    let copied = a
        .wal_reader()
        .read_all(Lsn(2 * SEG), end)
        .await
        .expect("read");
    assert!(copied[..] == wal[2 * SEG as usize..], "the donor's bytes");
    assert!(matches!(
        a.wal_reader().read_all(Lsn(SEG), Lsn(SEG + 10)).await,
        Err(WalStorageError::Removed { .. })
    ));
    drop(a);

    // A data dir that holds a safekeeper is never overwritten.
    let control = dir.path().join("pulled/safekeeper.control");
    let before = std::fs::read(&control).expect("read");
    let e = pull_from_peer(
        Arc::clone(&disk),
        "pulled",
        &config("c", 2),
        network.as_ref(),
        &addr,
        None,
    )
    .await
    .expect_err("exists");
    assert!(matches!(e, PullError::Exists(_)), "{e}");
    assert_eq!(std::fs::read(&control).expect("read"), before);

    // Another cluster's safekeeper, and the donor itself, are refused; no
    // data dir is left behind.
    for (cfg, what) in [(config("other", 2), "cluster"), (config("c", 0), "itself")] {
        let e = pull_from_peer(
            Arc::clone(&disk),
            "refused",
            &cfg,
            network.as_ref(),
            &addr,
            None,
        )
        .await
        .expect_err("refused");
        assert!(matches!(e, PullError::Refused { .. }), "{what}: {e}");
        assert!(
            !dir.path().join("refused/safekeeper.control").exists(),
            "{what}"
        );
    }
    server.shutdown().await;
}

#[test]
fn a_pull_in_progress_holds_removal_at_its_start() {
    let h = RemovalHorizon {
        replicas: Lsn(9 * SEG),
        peers: Lsn(9 * SEG),
        backup: Some(Lsn(8 * SEG)),
        walsenders: None,
        pulls: None,
    };
    assert_eq!(h.lsn(), Lsn(8 * SEG));
    let held = RemovalHorizon {
        pulls: Some(Lsn(2 * SEG)),
        ..h
    };
    assert_eq!(held.lsn(), Lsn(2 * SEG));
}
