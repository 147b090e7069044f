//! Tests of the WAL storage on a real disk: damage refused, torn tails
//! cut, preallocation, truncation, removal.

use super::segments::PREPARING_SUFFIX;
use super::*;
use bytes::{Bytes, BytesMut};
use ferry_env::RealDisk;
use ferry_wal::record::Record;

const SEG: u64 = 64 << 10;

fn records(n: usize, size: usize) -> Vec<u8> {
    let mut buf = BytesMut::new();
    for i in 0..n {
        Record::Insert {
            shard: 0,
            idempotency_key: bytes::Bytes::new(),
            table_id: 1,
            block_number: i as u64,
            arrow_ipc: Bytes::from(vec![i as u8; size]),
        }
        .encode(&mut buf);
    }
    buf.to_vec()
}

async fn open(root: &std::path::Path, boundary: Lsn) -> WalStorage {
    open_with(root, boundary, Preallocation::Auto).await
}

async fn open_with(root: &std::path::Path, boundary: Lsn, policy: Preallocation) -> WalStorage {
    try_open(root, boundary, boundary, policy)
        .await
        .expect("open")
}

async fn try_open(
    root: &std::path::Path,
    boundary: Lsn,
    durable: Lsn,
    policy: Preallocation,
) -> Result<WalStorage, WalStorageError> {
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(root).expect("disk"));
    WalStorage::open(
        disk,
        "wal",
        SegmentSize::new(SEG).expect("seg"),
        policy,
        boundary,
        durable,
    )
    .await
}

/// Writes ~300 KiB of records (five segments) with one fsync per 7000
/// bytes; returns the end of WAL.
async fn write_five_segments(root: &std::path::Path, policy: Preallocation) -> Lsn {
    let mut wal = open_with(root, Lsn(0), policy).await;
    let data = records(100, 3000);
    for chunk in data.chunks(7000) {
        let at = wal.write_lsn();
        wal.write(at, Bytes::copy_from_slice(chunk))
            .await
            .expect("write");
        wal.flush().await.expect("flush");
    }
    Lsn(data.len() as u64)
}

fn segment_path(root: &std::path::Path, segno: u64, partial: bool) -> std::path::PathBuf {
    let name = SegmentSize::new(SEG).expect("seg").file_name(segno);
    let suffix = if partial { ".partial" } else { "" };
    root.join("wal").join(format!("{name}{suffix}"))
}

/// Damage below the durable point is refused, naming the file, and
/// changes nothing on disk.
async fn damage_is_refused(
    policy: Preallocation,
    damage: impl FnOnce(&std::path::Path, Lsn),
    file: &str,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let end = write_five_segments(dir.path(), policy).await;
    damage(dir.path(), end);
    // A preallocation cut short by the drop may still land; it is not WAL.
    let wal_files = |root: &std::path::Path| {
        names(root)
            .into_iter()
            .filter(|n| !n.ends_with(PREPARING_SUFFIX))
            .collect::<Vec<_>>()
    };
    let before = wal_files(dir.path());
    let err = try_open(dir.path(), Lsn(0), end, policy)
        .await
        .expect_err("damage below the durable point is refused");
    match &err {
        WalStorageError::Damaged { path, .. } => {
            assert!(path.ends_with(file), "{err} names {file}")
        }
        other => panic!("not a damage error: {other}"),
    }
    assert!(err.to_string().contains(&end.to_string()), "{err}");
    assert_eq!(
        wal_files(dir.path()),
        before,
        "nothing was cut or recreated"
    );
}

#[tokio::test]
async fn a_missing_segment_below_the_durable_point_is_refused() {
    let name = SegmentSize::new(SEG).expect("seg").file_name(1);
    damage_is_refused(
        Preallocation::Auto,
        |root, _| std::fs::remove_file(segment_path(root, 1, false)).expect("rm"),
        &name,
    )
    .await;
}

#[tokio::test]
async fn a_deleted_current_segment_is_refused() {
    // A missing file is named without a suffix: either name would do.
    let name = SegmentSize::new(SEG).expect("seg").file_name(4);
    damage_is_refused(
        Preallocation::Never,
        |root, end| {
            assert_eq!(end.0 / SEG, 4);
            std::fs::remove_file(segment_path(root, 4, true)).expect("rm")
        },
        &name,
    )
    .await;
}

#[tokio::test]
async fn a_truncated_segment_is_refused() {
    for policy in [Preallocation::Always, Preallocation::Never] {
        let name = format!(
            "{}.partial",
            SegmentSize::new(SEG).expect("seg").file_name(4)
        );
        damage_is_refused(
            policy,
            |root, end| {
                let path = segment_path(root, 4, true);
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .expect("open");
                f.set_len(end.0 % SEG / 2).expect("truncate");
            },
            &name,
        )
        .await;
        // A whole segment cut short too.
        let name = SegmentSize::new(SEG).expect("seg").file_name(2);
        damage_is_refused(
            policy,
            |root, _| {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(segment_path(root, 2, false))
                    .expect("open");
                f.set_len(SEG - 1000).expect("truncate");
            },
            &name,
        )
        .await;
    }
}

#[tokio::test]
async fn a_flipped_byte_below_the_durable_point_is_refused() {
    let name = SegmentSize::new(SEG).expect("seg").file_name(1);
    damage_is_refused(
        Preallocation::Auto,
        |root, _| {
            let path = segment_path(root, 1, false);
            let mut bytes = std::fs::read(&path).expect("read");
            bytes[SEG as usize / 2] ^= 0x01;
            std::fs::write(&path, bytes).expect("write");
        },
        &name,
    )
    .await;
}

fn names(root: &std::path::Path) -> Vec<String> {
    let mut v: Vec<_> = std::fs::read_dir(root.join("wal"))
        .expect("ls")
        .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn segment_len(root: &std::path::Path, segno: u64) -> u64 {
    let name = SegmentSize::new(SEG).expect("seg").file_name(segno);
    std::fs::metadata(root.join("wal").join(format!("{name}.partial")))
        .expect("meta")
        .len()
}

#[tokio::test]
async fn a_reader_never_sees_wal_that_was_cut() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut wal = open(dir.path(), Lsn(0)).await;
    let first = records(10, 100);
    wal.write(Lsn(0), Bytes::from(first.clone()))
        .await
        .expect("write");
    wal.flush().await.expect("flush");
    let reader = wal.reader();
    let cut = Lsn(first.len() as u64 / 2);
    wal.truncate(cut).await.expect("truncate");
    let second = vec![0xEE; 300];
    wal.write(cut, Bytes::from(second.clone()))
        .await
        .expect("write");
    let end = wal.flush().await.expect("flush");
    let got = reader.read(cut, end, 1 << 20).await.expect("read");
    assert_eq!(&got[..], &second[..], "the new WAL, not the cut one");
    let got = reader.read(Lsn(0), cut, 1 << 20).await.expect("read");
    assert_eq!(&got[..], &first[..cut.0 as usize]);
}

#[tokio::test]
async fn segments_are_preallocated_while_commits_are_small() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut wal = open(dir.path(), Lsn(0)).await;
    assert!(wal.preallocates(), "a fresh safekeeper preallocates");
    assert_eq!(
        segment_len(dir.path(), 0),
        SEG,
        "ready before the first write"
    );
    // Small commits (one ~1 KiB record per fsync) through the first segment:
    // the second one is preallocated.
    let small = records(1, 1000);
    while wal.write_lsn() < Lsn(SEG + 10) {
        let at = wal.write_lsn();
        wal.write(at, Bytes::copy_from_slice(&small))
            .await
            .expect("write");
        wal.flush().await.expect("flush");
    }
    assert!(wal.preallocates());
    assert_eq!(segment_len(dir.path(), 1), SEG);
    // Bulk writes (several segments per fsync): the next segment grows with
    // its writes instead of being zeroed first.
    let bulk = records(3, SEG as usize);
    let at = wal.write_lsn();
    wal.write(at, Bytes::copy_from_slice(&bulk))
        .await
        .expect("write");
    wal.flush().await.expect("flush");
    assert!(!wal.preallocates());
    let growing = SegmentSize::new(SEG).expect("seg").segno(wal.write_lsn());
    let len = segment_len(dir.path(), growing);
    assert_eq!(
        len,
        SegmentSize::new(SEG).expect("seg").offset(wal.write_lsn())
    );
    // Either kind of segment reopens to the same end.
    let end = wal.flush_lsn();
    drop(wal);
    let wal = open(dir.path(), Lsn(0)).await;
    assert_eq!(wal.flush_lsn(), end);
}

#[tokio::test]
async fn the_policy_can_force_preallocation_on_or_off() {
    let bulk = records(3, SEG as usize);
    for (policy, zeroed) in [(Preallocation::Always, true), (Preallocation::Never, false)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut wal = open_with(dir.path(), Lsn(0), policy).await;
        wal.write(Lsn(0), Bytes::copy_from_slice(&bulk))
            .await
            .expect("write");
        wal.flush().await.expect("flush");
        assert_eq!(wal.preallocates(), zeroed, "{policy}");
        let seg = SegmentSize::new(SEG).expect("seg");
        let len = segment_len(dir.path(), seg.segno(wal.write_lsn()));
        let expected = if zeroed {
            SEG
        } else {
            seg.offset(wal.write_lsn())
        };
        assert_eq!(len, expected, "{policy}");
        // A restart under the other policy reads the same WAL.
        let end = wal.flush_lsn();
        drop(wal);
        let other = if zeroed {
            Preallocation::Never
        } else {
            Preallocation::Always
        };
        let wal = open_with(dir.path(), Lsn(0), other).await;
        assert_eq!(wal.flush_lsn(), end, "{policy} then {other}");
    }
    assert_eq!("never".parse::<Preallocation>(), Ok(Preallocation::Never));
    assert!("sometimes".parse::<Preallocation>().is_err());
}

#[tokio::test]
async fn writes_span_segments_and_survive_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut wal = open(dir.path(), Lsn(0)).await;
    let data = records(100, 3000); // ~300 KiB: several 64 KiB segments
    for chunk in data.chunks(7000) {
        let at = wal.write_lsn();
        wal.write(at, Bytes::copy_from_slice(chunk))
            .await
            .expect("write");
    }
    assert_eq!(wal.flush().await.expect("flush"), Lsn(data.len() as u64));
    // The next segment may be in preparation (`.prep`); it is not WAL.
    let segs: Vec<String> = names(dir.path())
        .into_iter()
        .filter(|n| !n.ends_with(PREPARING_SUFFIX))
        .collect();
    assert_eq!(
        segs.iter().filter(|n| n.ends_with(".partial")).count(),
        1,
        "{segs:?}"
    );
    assert_eq!(segs.len() as u64, data.len() as u64 / SEG + 1);
    for name in segs.iter().filter(|n| !n.ends_with(".partial")) {
        let len = std::fs::metadata(dir.path().join("wal").join(name))
            .expect("meta")
            .len();
        assert_eq!(len, SEG, "{name} is whole");
    }
    drop(wal);
    let wal = open(dir.path(), Lsn(0)).await;
    assert_eq!(wal.flush_lsn(), Lsn(data.len() as u64));
    // Reading back, segment by segment.
    let mut got = Vec::new();
    while (got.len() as u64) < wal.flush_lsn().0 {
        got.extend_from_slice(&wal.read(Lsn(got.len() as u64), 50_000).await.expect("read"));
    }
    assert!(got == data);
    assert!(matches!(
        wal.read(Lsn(data.len() as u64 + 1), 10).await,
        Err(WalStorageError::BeyondFlush { .. })
    ));
}

/// Writes 30 records (one fsync each with `small_commits`, so that the
/// second segment is preallocated; one fsync for all otherwise, so that it
/// grows), tears the last one and reopens.
async fn torn_tail_is_cut_on_open(small_commits: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut wal = open(dir.path(), Lsn(0)).await;
    let data = records(30, 3000);
    let one = data.len() / 30;
    for chunk in data.chunks(if small_commits { one } else { data.len() }) {
        let at = wal.write_lsn();
        wal.write(at, Bytes::copy_from_slice(chunk))
            .await
            .expect("write");
        if small_commits {
            wal.flush().await.expect("flush");
        }
    }
    wal.flush().await.expect("flush");
    let end = data.len() as u64;
    drop(wal);
    // Tear the last record: zero its last 100 bytes (a page that did not reach
    // the disk), and leave garbage after it (a later page that did).
    let path = dir.path().join("wal").join(format!(
        "{}.partial",
        SegmentSize::new(SEG).expect("seg").file_name(end / SEG)
    ));
    let mut bytes = std::fs::read(&path).expect("read");
    let in_segment = (end % SEG) as usize;
    if small_commits {
        assert_eq!(bytes.len() as u64, SEG, "preallocated");
    } else {
        assert_eq!(bytes.len(), in_segment, "grown with its writes");
        bytes.resize(in_segment + 400, 0);
    }
    bytes[in_segment - 100..in_segment].fill(0);
    bytes[in_segment + 50..in_segment + 350].fill(0xAB);
    std::fs::write(&path, &bytes).expect("tear");

    let last_record = Record::insert_len(0, 3000) as u64;
    let wal = open(dir.path(), Lsn(0)).await;
    assert_eq!(
        wal.flush_lsn(),
        Lsn(end - last_record),
        "exactly the torn record is gone"
    );
    drop(wal);
    let reopened = open(dir.path(), Lsn(0)).await;
    assert_eq!(
        reopened.flush_lsn(),
        Lsn(end - last_record),
        "the cut was durable"
    );
    let bytes = std::fs::read(&path).expect("read");
    assert_eq!(bytes.len() as u64, SEG, "full length after the cut");
    let cut = ((end - last_record) % SEG) as usize;
    assert!(
        bytes[cut..].iter().all(|&b| b == 0),
        "everything past the end is zero, so no stale record can come back"
    );
}

#[tokio::test]
async fn torn_tail_is_cut_on_open_in_a_preallocated_segment() {
    torn_tail_is_cut_on_open(true).await;
}

#[tokio::test]
async fn torn_tail_is_cut_on_open_in_a_growing_segment() {
    torn_tail_is_cut_on_open(false).await;
}

#[tokio::test]
async fn truncate_removes_divergent_wal_across_segments() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut wal = open(dir.path(), Lsn(0)).await;
    let data = records(60, 3000);
    wal.write(Lsn(0), Bytes::copy_from_slice(&data))
        .await
        .expect("write");
    wal.flush().await.expect("flush");
    let keep = Lsn(Record::insert_len(0, 3000) as u64 * 10); // inside the first segment
    wal.truncate(keep).await.expect("truncate");
    assert_eq!((wal.write_lsn(), wal.flush_lsn()), (keep, keep));
    assert_eq!(names(dir.path()), vec!["000000010000000000000000.partial"]);
    let more = records(5, 100);
    wal.write(keep, Bytes::copy_from_slice(&more))
        .await
        .expect("write after truncate");
    wal.flush().await.expect("flush");
    drop(wal);
    let wal = open(dir.path(), Lsn(0)).await;
    assert_eq!(wal.flush_lsn(), Lsn(keep.0 + more.len() as u64));
    let mut wal = wal;
    assert!(matches!(
        wal.truncate(Lsn(u64::MAX / 2)).await,
        Err(WalStorageError::BeyondFlush { .. })
    ));
    assert!(matches!(
        wal.write(Lsn(1), Bytes::from_static(b"x")).await,
        Err(WalStorageError::NonContiguous { .. })
    ));
}

#[tokio::test]
async fn old_segments_are_removed_but_never_the_current_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut wal = open(dir.path(), Lsn(0)).await;
    let data = records(100, 3000);
    wal.write(Lsn(0), Bytes::copy_from_slice(&data))
        .await
        .expect("write");
    wal.flush().await.expect("flush");
    let current = SegmentSize::new(SEG).expect("seg").segno(wal.flush_lsn());
    let removed = wal.remove_below(u64::MAX).await.expect("remove");
    assert_eq!(removed as u64, current);
    assert!(matches!(
        wal.read(Lsn(0), 10).await,
        Err(WalStorageError::Removed { .. })
    ));
    // Recovery starts from a boundary in a kept segment.
    drop(wal);
    let boundary = Lsn(data.len() as u64);
    let wal = open(dir.path(), boundary).await;
    assert_eq!(wal.flush_lsn(), boundary);
}
