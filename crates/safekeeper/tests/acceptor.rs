//! The acceptor's answers to each message, including every refusal, and its state
//! across restarts.

// Tests damage real files directly; node code may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use ferry_env::{Disk, RealDisk};
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig, AcceptorError, WriterSession};
use ferry_safekeeper::restore::{RestoreError, RestoreReport};
use ferry_testkit::disk::temp_disk;
use ferry_wal::membership::{Configuration, Member};
use ferry_wal::proto::{
    AppendRequest, FromSafekeeper, Greeting, ProposerElected, ShardFeedback, ToSafekeeper,
};
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn, TermHistory, TermLsn};

fn cluster() -> ClusterId {
    ClusterId::new("test-cluster").expect("id")
}

fn config() -> AcceptorConfig {
    AcceptorConfig {
        cluster_id: cluster(),
        node_id: 7,
        timeline_id: 1,
        segment_size: SegmentSize::new(64 << 10).expect("seg"),
        preallocation: Default::default(),
    }
}

/// Opens the safekeeper, creating it on first use.
async fn open(disk: &Arc<dyn Disk>) -> Acceptor {
    Acceptor::create(Arc::clone(disk), "sk", config())
        .await
        .expect("open")
}

/// `n` inserts of 100 bytes each (and their headers).
fn records(n: u64) -> Bytes {
    ferry_testkit::wal::inserts(1, 0..n, 100)
}

/// Batches of [`records`] until they reach past `len` bytes.
fn records_past(len: u64) -> Bytes {
    let mut wal = BytesMut::new();
    while (wal.len() as u64) < len {
        wal.extend_from_slice(&records(7));
    }
    wal.freeze()
}

fn elected(term: u64, start: u64, history: &[(u64, u64)]) -> ProposerElected {
    ProposerElected {
        term,
        start_streaming_at: Lsn(start),
        term_history: TermHistory(
            history
                .iter()
                .map(|&(term, lsn)| TermLsn {
                    term,
                    lsn: Lsn(lsn),
                })
                .collect(),
        ),
        timeline_start_lsn: Lsn(0),
        rejoin: false,
    }
}

fn append(term: u64, begin: u64, wal: &Bytes, commit: u64) -> AppendRequest {
    AppendRequest {
        term,
        begin_lsn: Lsn(begin),
        end_lsn: Lsn(begin + wal.len() as u64),
        commit_lsn: Lsn(commit),
        wal: wal.clone(),
        ..AppendRequest::default()
    }
}

/// Opens the safekeeper and elects writer 1 in term 1, from the start.
async fn elected_in_term_1(disk: &Arc<dyn Disk>) -> Acceptor {
    let mut a = open(disk).await;
    a.handle_vote(1).await.expect("vote");
    a.handle_elected(&elected(1, 0, &[(1, 0)]))
        .await
        .expect("elected");
    a
}

fn refusal(e: AcceptorError) -> String {
    match e {
        AcceptorError::Refused { reason, .. } => reason,
        other => panic!("expected a refusal, got {other}"),
    }
}

#[tokio::test]
async fn greeting_checks_timeline_and_geometry() {
    let (_dir, disk) = temp_disk();
    let mut a = open(&disk).await;
    let ok = Greeting {
        cluster_id: cluster(),
        proposer_id: 1,
        timeline_id: 1,
        segment_bytes: 64 << 10,
        configuration: None,
    };
    let s = &mut WriterSession::default();
    assert!(
        matches!(a.handle_greeting(&ok, s).await, Ok(FromSafekeeper::Greeting(g)) if g.node_id == 7 && g.term == 0)
    );
    let wrong_timeline = Greeting {
        timeline_id: 2,
        ..ok.clone()
    };
    assert!(refusal(
        a.handle_greeting(&wrong_timeline, s)
            .await
            .expect_err("refused")
    )
    .contains("timeline"));
    let wrong_segments = Greeting {
        segment_bytes: 16 << 20,
        ..ok.clone()
    };
    assert!(refusal(
        a.handle_greeting(&wrong_segments, s)
            .await
            .expect_err("refused")
    )
    .contains("segment"));
    let wrong_cluster = Greeting {
        cluster_id: ClusterId::new("other").expect("id"),
        ..ok
    };
    assert!(refusal(
        a.handle_greeting(&wrong_cluster, s)
            .await
            .expect_err("refused")
    )
    .contains("cluster"));
}

#[tokio::test]
async fn a_safekeeper_is_created_only_explicitly_and_keeps_its_identity() {
    let (dir, disk) = temp_disk();
    let err = Acceptor::open(Arc::clone(&disk), "sk", config())
        .await
        .expect_err("nothing to open");
    assert!(err.to_string().contains("no control file"), "{err}");
    assert!(
        !dir.path().join("sk").exists(),
        "a refused open creates nothing"
    );
    drop(open(&disk).await);
    let others = [
        AcceptorConfig {
            cluster_id: ClusterId::new("other").expect("id"),
            ..config()
        },
        AcceptorConfig {
            node_id: 8,
            ..config()
        },
        AcceptorConfig {
            segment_size: SegmentSize::new(1 << 20).expect("seg"),
            ..config()
        },
    ];
    for other in others {
        for create in [false, true] {
            let result = if create {
                Acceptor::create(Arc::clone(&disk), "sk", other.clone()).await
            } else {
                Acceptor::open(Arc::clone(&disk), "sk", other.clone()).await
            };
            let err = result.expect_err("another identity is refused");
            let msg = err.to_string();
            assert!(matches!(err, AcceptorError::Identity(_)), "{msg}");
            assert!(
                msg.contains("holds safekeeper 7 of cluster test-cluster (timeline 1, 65536-byte WAL segments)"),
                "says what the data dir holds: {msg}"
            );
        }
    }
    Acceptor::open(Arc::clone(&disk), "sk", config())
        .await
        .expect("still opens as itself");
}

#[tokio::test]
async fn votes_once_per_term_even_across_restarts() {
    let (_dir, disk) = temp_disk();
    let mut a = open(&disk).await;
    let FromSafekeeper::Vote(v) = a.handle_vote(3).await.expect("vote") else {
        panic!("not a vote")
    };
    assert!(v.vote_given);
    assert_eq!(v.term, 3);
    drop(a);
    let mut a = open(&disk).await;
    assert_eq!(a.term(), 3, "the term was persisted before the answer");
    let FromSafekeeper::Vote(v) = a.handle_vote(3).await.expect("vote") else {
        panic!("not a vote")
    };
    assert!(!v.vote_given, "no second vote in term 3");
    let FromSafekeeper::Vote(v) = a.handle_vote(2).await.expect("vote") else {
        panic!("not a vote")
    };
    assert!(!v.vote_given);
    assert_eq!(v.term, 3, "a stale candidate learns the current term");
}

#[tokio::test]
async fn appends_are_refused_unless_from_the_elected_writer_and_contiguous() {
    let (_dir, disk) = temp_disk();
    let mut a = open(&disk).await;
    let wal = records(3);
    a.handle_vote(1).await.expect("vote");
    let e = refusal(
        a.append_no_flush(&append(1, 0, &wal, 0))
            .await
            .expect_err("before elected"),
    );
    assert!(e.contains("before its election"), "{e}");
    a.handle_elected(&elected(1, 0, &[(1, 0)]))
        .await
        .expect("elected");
    a.append_no_flush(&append(1, 0, &wal, 0))
        .await
        .expect("append");
    let e = refusal(
        a.append_no_flush(&append(1, 5, &wal, 0))
            .await
            .expect_err("gap"),
    );
    assert!(e.contains("ends at"), "{e}");
    let mut inconsistent = append(1, wal.len() as u64, &wal, 0);
    inconsistent.end_lsn = Lsn(1);
    assert!(a.append_no_flush(&inconsistent).await.is_err());
    let FromSafekeeper::Append(r) = a.flush_appends().await.expect("flush") else {
        panic!("not an append response")
    };
    assert_eq!(r.flush_lsn, Lsn(wal.len() as u64));
    assert_eq!(r.commit_lsn, Lsn(0), "nothing committed yet");

    // A newer writer is elected; the old one's appends are refused with the term.
    a.handle_vote(2).await.expect("vote");
    match a
        .append_no_flush(&append(1, wal.len() as u64, &wal, 0))
        .await
    {
        Err(AcceptorError::Refused { term, .. }) => assert_eq!(term, 2),
        other => panic!("stale append accepted: {other:?}"),
    }
}

#[tokio::test]
async fn commit_follows_flush_and_truncation_never_cuts_committed_wal() {
    let (_dir, disk) = temp_disk();
    let mut a = elected_in_term_1(&disk).await;
    let wal = records(4);
    let len = wal.len() as u64;
    a.append_no_flush(&append(1, 0, &wal, 0))
        .await
        .expect("append");
    a.flush_appends().await.expect("flush");
    assert_eq!(a.commit_lsn(), Lsn(0));
    a.append_no_flush(&append(1, len, &wal, len))
        .await
        .expect("append");
    a.flush_appends().await.expect("flush");
    assert_eq!((a.commit_lsn(), a.flush_lsn()), (Lsn(len), Lsn(2 * len)));

    a.handle_vote(2).await.expect("vote");
    let e = refusal(
        a.handle_elected(&elected(2, len / 2, &[(1, 0), (2, len / 2)]))
            .await
            .expect_err("below commit"),
    );
    assert!(e.contains("committed"), "{e}");
    let e = refusal(
        a.handle_elected(&elected(2, 3 * len, &[(1, 0), (2, 3 * len)]))
            .await
            .expect_err("gap"),
    );
    assert!(e.contains("beyond"), "{e}");
    let e = refusal(
        a.handle_elected(&elected(2, len, &[(1, 0), (3, len)]))
            .await
            .expect_err("history"),
    );
    assert!(e.contains("history"), "{e}");
    // Cutting the uncommitted second half is fine.
    a.handle_elected(&elected(2, len, &[(1, 0), (2, len)]))
        .await
        .expect("elected");
    assert_eq!(a.flush_lsn(), Lsn(len));
    assert_eq!(a.last_log_term(), 2);
    drop(a);
    let mut a = open(&disk).await;
    assert_eq!(
        (a.flush_lsn(), a.term(), a.last_log_term()),
        (Lsn(len), 2, 2),
        "all of it durable"
    );
    // A commit announced beyond this safekeeper's WAL is capped at its flush.
    a.append_no_flush(&append(2, len, &wal, 10 * len))
        .await
        .expect("append");
    a.flush_appends().await.expect("flush");
    assert_eq!(a.commit_lsn(), Lsn(2 * len));
}

/// A writer greeting again in its own term (as it does when it takes a
/// newer configuration in place) is answered without a control-file write;
/// a new term is written before its answer.
#[tokio::test]
async fn an_elected_writer_greeting_again_in_its_term_costs_no_control_file_write() {
    let (dir, disk) = temp_disk();
    let mut a = elected_in_term_1(&disk).await;
    let wal = records(4);
    let len = wal.len() as u64;
    a.append_no_flush(&append(1, 0, &wal, len))
        .await
        .expect("append");
    a.flush_appends().await.expect("flush");
    let control = dir.path().join("sk/safekeeper.control");
    let before = std::fs::read(&control).expect("read");
    a.handle_elected(&elected(1, len, &[(1, 0)]))
        .await
        .expect("elected again");
    assert_eq!(std::fs::read(&control).expect("read"), before, "no write");
    a.append_no_flush(&append(1, len, &wal, 2 * len))
        .await
        .expect("appends go on");
    a.flush_appends().await.expect("flush");
    drop(a);
    let mut a = open(&disk).await;
    assert_eq!(
        (a.term(), a.last_log_term(), a.flush_lsn()),
        (1, 1, Lsn(2 * len))
    );
    a.handle_vote(2).await.expect("vote");
    a.handle_elected(&elected(2, 2 * len, &[(1, 0), (2, 2 * len)]))
        .await
        .expect("elected in term 2");
    drop(a);
    let a = open(&disk).await;
    assert_eq!(
        (a.term(), a.last_log_term()),
        (2, 2),
        "the new term's history is durable"
    );
}

#[tokio::test]
async fn batch_shares_one_answer_and_relays_feedback() {
    let (_dir, disk) = temp_disk();
    let mut a = elected_in_term_1(&disk).await;
    let wal = records(2);
    let len = wal.len() as u64;
    let feedback = ShardFeedback {
        shard_number: 3,
        replica_number: 0,
        last_received_lsn: Lsn(1),
        disk_consistent_lsn: Lsn(1),
        remote_consistent_lsn: Lsn(0),
        reply_time_micros: 5,
    };
    let msgs = vec![
        ToSafekeeper::Feedback(feedback),
        ToSafekeeper::Append(append(1, 0, &wal, 0)),
        ToSafekeeper::Append(append(1, len, &wal, len)),
        ToSafekeeper::Append(append(1, 2 * len, &wal, 2 * len)),
        ToSafekeeper::ReadWal {
            term: 1,
            begin_lsn: Lsn(0),
            end_lsn: Lsn(len),
        },
        ToSafekeeper::StartReplication {
            shard_number: 0,
            start_lsn: Lsn(0),
        },
    ];
    let out = a
        .handle_batch(msgs, &mut WriterSession::default())
        .await
        .expect("batch");
    assert_eq!(out.len(), 3, "{out:?}");
    match &out[0] {
        FromSafekeeper::Append(r) => {
            assert_eq!(
                r.flush_lsn,
                Lsn(3 * len),
                "one answer after one flush for three appends"
            );
            assert_eq!(r.commit_lsn, Lsn(2 * len));
            assert_eq!(r.shard_feedback, vec![feedback]);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(&out[1], FromSafekeeper::Wal { begin_lsn: Lsn(0), wal: w, .. } if *w == wal));
    assert!(matches!(&out[2], FromSafekeeper::Refused { .. }));
    assert_eq!(
        a.read_committed(Lsn(0), Lsn(u64::MAX), 1 << 20)
            .await
            .expect("read")
            .len() as u64,
        2 * len,
        "only committed WAL for walsenders"
    );
    // A walsender that announces an older commit_lsn gets no byte past it,
    // although the acceptor's commit_lsn moved on.
    assert_eq!(
        a.read_committed(Lsn(0), Lsn(len), 1 << 20)
            .await
            .expect("read")
            .len() as u64,
        len,
        "never past the commit_lsn the frame announces"
    );
    assert!(a
        .read_committed(Lsn(len), Lsn(len), 1 << 20)
        .await
        .expect("read")
        .is_empty());
    // The same for a walsender reading without the acceptor.
    let committed = a.committed_wal();
    assert_eq!(*committed.commit.borrow(), Lsn(2 * len));
    let got = committed
        .read(Lsn(0), Lsn(len), 1 << 20)
        .await
        .expect("read");
    assert_eq!(got.len() as u64, len, "never past the announced commit_lsn");
    let got = committed
        .read(Lsn(0), Lsn(u64::MAX), 1 << 20)
        .await
        .expect("read");
    assert_eq!(got.len() as u64, 2 * len, "never past commit_lsn");
}

/// WAL a safekeeper flushed but never learned was committed is still WAL it
/// promised (the writer may have counted it toward a commit): after a clean
/// stop, losing it is refused at start, like losing committed WAL.
#[tokio::test]
async fn flushed_wal_recorded_at_a_clean_stop_must_be_there() {
    let (dir, disk) = temp_disk();
    let mut a = elected_in_term_1(&disk).await;
    let wal = records(20);
    let out = a
        .handle_batch(
            vec![ToSafekeeper::Append(append(1, 0, &wal, 0))],
            &mut WriterSession::default(),
        )
        .await
        .expect("append");
    assert!(
        matches!(&out[0], FromSafekeeper::Append(r) if r.flush_lsn == Lsn(wal.len() as u64) && r.commit_lsn == Lsn(0))
    );
    a.persist_now().await.expect("clean stop");
    drop(a);
    std::fs::remove_file(dir.path().join("sk/wal/000000010000000000000000.partial"))
        .expect("lose the segment");
    let err = Acceptor::open(Arc::clone(&disk), "sk", config())
        .await
        .expect_err("lost flushed WAL is refused");
    assert!(
        err.to_string().contains("000000010000000000000000"),
        "{err}"
    );
}

async fn restore(
    disk: &Arc<dyn Disk>,
    dir: &str,
    config: &AcceptorConfig,
    backup: &ferry_storage::Location,
) -> Result<RestoreReport, RestoreError> {
    ferry_safekeeper::restore::restore_from_backup(Arc::clone(disk), dir, config, backup).await
}

/// A backup in `dir/backup` holding segments `whole` of `wal` and, for
/// `partial = Some((segno, commit))`, a partial object of that segment with
/// the flushed prefix up to the end of `wal` and that commit_lsn.
async fn backup_of(
    dir: &std::path::Path,
    wal: &[u8],
    whole: &[u64],
    partial: Option<(u64, u64)>,
) -> ferry_storage::Location {
    let seg = config().segment_size;
    let location = ferry_testkit::wal::file_backup(
        &dir.join("backup"),
        &cluster(),
        seg,
        wal,
        whole.iter().copied(),
    )
    .await;
    if let Some((segno, commit)) = partial {
        let backup = ferry_safekeeper::backup::cluster_folder(&location, &cluster())
            .expect("cluster folder");
        let name = ferry_safekeeper::partial::partial_name(
            seg,
            segno,
            1,
            Lsn(wal.len() as u64),
            Lsn(commit),
            3,
        );
        backup
            .put(
                &ferry_safekeeper::partial::partial_key(&name),
                Bytes::copy_from_slice(&wal[seg.start(segno).0 as usize..]),
            )
            .await
            .expect("put");
    }
    location
}

/// Record boundaries of `wal` (which is whole records).
fn boundaries(wal: &[u8]) -> Vec<u64> {
    let mut at = 0;
    let mut out = vec![0];
    while at < wal.len() {
        let len = ferry_wal::record::check(&wal[at..]).expect("record");
        at += len;
        out.push(at as u64);
    }
    out
}

#[tokio::test]
async fn a_restored_safekeeper_holds_committed_wal_and_votes_only_after_rejoining() {
    let (dir, disk) = temp_disk();
    let seg = config().segment_size.bytes();
    // 3.5 segments of records of 100 bytes and more: segment ends split records.
    let wal = records_past(3 * seg + seg / 2);
    let ends = boundaries(&wal);
    // The uploader knew a commit inside segment 3, at a record boundary.
    let commit = *ends
        .iter()
        .find(|&&e| e > 3 * seg + seg / 4)
        .expect("a boundary");
    let backup = backup_of(dir.path(), &wal, &[0, 1, 2], Some((3, commit))).await;

    let report = restore(&disk, "restored", &config(), &backup)
        .await
        .expect("restore");
    assert_eq!(report.whole_segments, 3);
    assert_eq!(
        report.restored_lsn,
        Lsn(commit),
        "up to the partial's commit_lsn"
    );
    assert!(report.partial.is_some());

    let mut a = Acceptor::open(Arc::clone(&disk), "restored", config())
        .await
        .expect("open restored");
    assert_eq!(a.flush_lsn(), Lsn(commit));
    assert_eq!(a.commit_lsn(), Lsn(commit), "all of it is committed");
    assert_eq!(a.restored_up_to(), Some(Lsn(commit)));
    let read = a
        .wal_reader()
        .read_all(Lsn(0), Lsn(commit))
        .await
        .expect("read");
    assert!(
        read[..] == wal[..commit as usize],
        "exactly the committed prefix"
    );

    let greeting = Greeting {
        cluster_id: cluster(),
        proposer_id: 1,
        timeline_id: 1,
        segment_bytes: seg,
        configuration: None,
    };
    let FromSafekeeper::Greeting(g) = a
        .handle_greeting(&greeting, &mut WriterSession::default())
        .await
        .expect("greeting")
    else {
        panic!("not a greeting")
    };
    let restored = g.restored.expect("says it is restored");
    assert_eq!(restored.flush_lsn, Lsn(commit));
    assert!(!restored.ready, "in quarantine");
    let e = refusal(a.handle_vote(5).await.expect_err("no vote"));
    assert!(e.contains("restored"), "{e}");
    assert_eq!(a.term(), 0, "a refused vote raises no term");
    let e = refusal(
        a.handle_elected(&elected(5, commit, &[(5, 0)]))
            .await
            .expect_err("a plain election cannot bring it back"),
    );
    assert!(e.contains("proved"), "{e}");
    let mut rejoin = elected(5, commit, &[(1, 0), (5, commit + 100)]);
    rejoin.rejoin = true;
    let e = refusal(a.handle_elected(&rejoin).await.expect_err("quarantine"));
    assert!(e.contains("quarantine"), "{e}");

    a.end_quarantine();
    let FromSafekeeper::Greeting(g) = a
        .handle_greeting(&greeting, &mut WriterSession::default())
        .await
        .expect("greeting")
    else {
        panic!("not a greeting")
    };
    assert!(g.restored.expect("still restored").ready);
    let mut elsewhere = rejoin.clone();
    elsewhere.start_streaming_at = Lsn(commit - 1);
    let e = refusal(
        a.handle_elected(&elsewhere)
            .await
            .expect_err("not at its end"),
    );
    assert!(e.contains("rejoins at its end"), "{e}");
    a.handle_elected(&rejoin).await.expect("brought back");
    assert_eq!(a.restored_up_to(), None);
    assert_eq!(a.term(), 5);
    drop(a);
    // Brought back for good: after a restart it votes like any safekeeper.
    let mut a = Acceptor::open(Arc::clone(&disk), "restored", config())
        .await
        .expect("reopen");
    assert_eq!(a.restored_up_to(), None);
    let FromSafekeeper::Vote(v) = a.handle_vote(6).await.expect("vote") else {
        panic!("not a vote")
    };
    assert!(v.vote_given);
    drop(a);

    // A data dir with a control file is never overwritten.
    let before = std::fs::read(dir.path().join("restored/safekeeper.control")).expect("read");
    let err = restore(&disk, "restored", &config(), &backup)
        .await
        .expect_err("refused");
    assert!(
        matches!(err, ferry_safekeeper::restore::RestoreError::Exists(_)),
        "{err}"
    );
    assert_eq!(
        std::fs::read(dir.path().join("restored/safekeeper.control")).expect("read"),
        before
    );
}

#[tokio::test]
async fn a_restore_stops_at_the_first_gap_cuts_split_records_and_starts_over_after_a_crash() {
    let (dir, disk) = temp_disk();
    let seg = config().segment_size.bytes();
    let wal = records_past(4 * seg + 10);
    let ends = boundaries(&wal);
    // Segment 2 is missing (its upload still in flight); the partial of
    // segment 3 is past the gap and of no use.
    let backup = backup_of(dir.path(), &wal, &[0, 1, 3], Some((3, 3 * seg + 50))).await;
    // A restore that crashed before its control file left WAL behind.
    std::fs::create_dir_all(dir.path().join("sk/wal")).expect("dir");
    std::fs::write(
        dir.path()
            .join("sk/wal")
            .join(config().segment_size.file_name(0)),
        vec![0xAB; seg as usize],
    )
    .expect("leftover");
    let report = restore(&disk, "sk", &config(), &backup)
        .await
        .expect("restore");
    assert_eq!(report.whole_segments, 2);
    assert_eq!(report.partial, None);
    let last_whole = *ends
        .iter()
        .rev()
        .find(|&&e| e <= 2 * seg)
        .expect("boundary");
    assert_eq!(
        report.restored_lsn,
        Lsn(last_whole),
        "the record split by the end of segment 1 is cut"
    );
    let a = Acceptor::open(Arc::clone(&disk), "sk", config())
        .await
        .expect("open");
    let read = a
        .wal_reader()
        .read_all(Lsn(0), Lsn(last_whole))
        .await
        .expect("read");
    assert!(read[..] == wal[..last_whole as usize]);

    // The same location seen by another cluster: its folder holds nothing
    // of this cluster's WAL, so a restore of it takes none.
    let mut stranger = config();
    stranger.cluster_id = ClusterId::new("stranger").expect("id");
    let report = restore(&disk, "stranger", &stranger, &backup)
        .await
        .expect("restore");
    assert_eq!(
        (
            report.whole_segments,
            report.partial.clone(),
            report.restored_lsn
        ),
        (0, None, Lsn(0)),
        "{report:?}"
    );

    // A backup that does not start at the first segment is refused.
    let other = tempfile::tempdir().expect("tempdir");
    let backup = backup_of(other.path(), &wal, &[1, 2], None).await;
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(other.path()).expect("disk"));
    let err = restore(&disk, "sk", &config(), &backup)
        .await
        .expect_err("refused");
    assert!(
        matches!(
            err,
            ferry_safekeeper::restore::RestoreError::Incomplete { .. }
        ) && err
            .to_string()
            .contains("does not hold the timeline's first segment"),
        "{err}"
    );
    assert!(!other.path().join("sk/safekeeper.control").exists());
}

fn members(ids: &[u64]) -> Vec<Member> {
    ids.iter()
        .map(|&id| Member {
            id,
            addr: format!("sk{id}:7000"),
        })
        .collect()
}

/// Generations: the higher configuration is adopted from a greeting or the
/// change driver and persisted before the answer; a writer of an older
/// generation learns the newer one and is refused votes, elections and
/// appends; a safekeeper no configuration names refuses every writer.
#[tokio::test]
async fn generations_are_adopted_persisted_and_older_writers_refused() {
    let (_dir, disk) = temp_disk();
    let mut a = open(&disk).await;
    let initial = Configuration::initial(members(&[5, 6, 7])).expect("initial");
    let greeting = |conf: Option<&Configuration>| Greeting {
        cluster_id: cluster(),
        proposer_id: 1,
        timeline_id: 1,
        segment_bytes: 64 << 10,
        configuration: conf.cloned(),
    };
    // A safekeeper holding no configuration (created empty: a new member,
    // or an id that lost its data and forgot its votes) takes none from a
    // writer of generation 1 and refuses it everything that writes.
    let new_writer = &mut WriterSession::default();
    let FromSafekeeper::Greeting(g) = a
        .handle_greeting(&greeting(Some(&initial)), new_writer)
        .await
        .expect("greeting")
    else {
        panic!("not a greeting")
    };
    assert_eq!(g.configuration, None, "not taken from a writer");
    let replies = a
        .handle_batch(vec![ToSafekeeper::VoteRequest { term: 1 }], new_writer)
        .await
        .expect("batch");
    assert!(
        matches!(&replies[..], [FromSafekeeper::Refused { reason, .. }] if reason.contains("change driver")),
        "{replies:?}"
    );
    assert_eq!(a.term(), 0, "no vote given");
    // The change driver hands it its first configuration.
    a.handle_configure(&cluster(), &initial, 0)
        .await
        .expect("configure");
    drop(a);
    let mut a = open(&disk).await;
    assert_eq!(a.configuration(), Some(&initial), "persisted");

    // A writer started before any configuration (generation 0) is told
    // generation 1 and refused everything that writes.
    let old_writer = &mut WriterSession::default();
    let FromSafekeeper::Greeting(g) = a
        .handle_greeting(&greeting(None), old_writer)
        .await
        .expect("greeting")
    else {
        panic!("not a greeting")
    };
    assert_eq!(
        g.configuration.as_ref(),
        Some(&initial),
        "told the newer one"
    );
    let replies = a
        .handle_batch(vec![ToSafekeeper::VoteRequest { term: 1 }], old_writer)
        .await
        .expect("batch");
    assert!(
        matches!(&replies[..], [FromSafekeeper::Refused { reason, .. }] if reason.starts_with(ferry_wal::proto::GENERATION)),
        "{replies:?}"
    );
    assert_eq!(a.term(), 0, "no vote given");
    let replies = a
        .handle_batch(vec![ToSafekeeper::VoteRequest { term: 1 }], new_writer)
        .await
        .expect("batch");
    assert!(
        matches!(&replies[..], [FromSafekeeper::Vote(v)] if v.vote_given),
        "{replies:?}"
    );

    // The change driver: a joint configuration and a term raised to 4.
    let joint = initial.joint(members(&[5, 6, 8])).expect("joint");
    let replies = a
        .handle_batch(
            vec![ToSafekeeper::Configure {
                cluster_id: cluster(),
                configuration: joint.clone(),
                min_term: 4,
            }],
            &mut WriterSession::default(),
        )
        .await
        .expect("batch");
    let [FromSafekeeper::Configured(c)] = &replies[..] else {
        panic!("{replies:?}")
    };
    assert_eq!((c.configuration.as_ref(), c.term), (Some(&joint), 4));
    // The writer of generation 1 is refused now.
    let replies = a
        .handle_batch(vec![ToSafekeeper::VoteRequest { term: 5 }], new_writer)
        .await
        .expect("batch");
    assert!(
        matches!(&replies[..], [FromSafekeeper::Refused { .. }]),
        "{replies:?}"
    );
    // An older configuration handed over changes nothing; a different one
    // claiming the same generation is refused.
    let replies = a
        .handle_batch(
            vec![
                ToSafekeeper::Configure {
                    cluster_id: cluster(),
                    configuration: initial.clone(),
                    min_term: 0,
                },
                ToSafekeeper::Configure {
                    cluster_id: cluster(),
                    configuration: initial.joint(members(&[5, 6, 9])).expect("other"),
                    min_term: 0,
                },
            ],
            &mut WriterSession::default(),
        )
        .await
        .expect("batch");
    assert!(
        matches!(&replies[..], [FromSafekeeper::Configured(c), FromSafekeeper::Refused { .. }] if c.configuration.as_ref() == Some(&joint)),
        "{replies:?}"
    );
    // Switched to a set without node 7: it refuses every writer, even one
    // of its own generation.
    let switched = joint.switched().expect("switched");
    let writer = &mut WriterSession::default();
    a.handle_greeting(&greeting(Some(&switched)), writer)
        .await
        .expect("greeting");
    let replies = a
        .handle_batch(vec![ToSafekeeper::VoteRequest { term: 9 }], writer)
        .await
        .expect("batch");
    assert!(
        matches!(&replies[..], [FromSafekeeper::Refused { reason, .. }] if reason.contains("not a member")),
        "{replies:?}"
    );
    drop(a);
    let a = open(&disk).await;
    assert_eq!(a.configuration(), Some(&switched));
    assert_eq!(a.term(), 4);
}
