//! A replica applying WAL on a real disk: parts per partition, identical on two
//! replicas, restart and crash leftovers, the idempotency window, and hostile
//! WAL stopping the replica.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // a real temp dir

use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use ferry_env::{Disk, RealDisk};
use ferry_replica::ReplicaError;
use ferry_testkit::disk::{DiskHook, DiskOp, HookedDisk};
use ferry_wal::record::Record;
use ferry_wal::Lsn;

mod common;
use common::{merge_all, names, open, rows, table, Wal};

#[tokio::test]
async fn records_become_parts_identical_on_two_replicas_and_survive_restarts() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let mut wal = Wal::default();
    let a = wal.insert(1, 0, "k1", rows(0..10, &["x", "y"]));
    wal.insert(1, 1, "", rows(10..20, &["x"])); // another shard
    wal.insert(2, 0, "", rows(20..30, &["x"])); // a dropped table
    let b = wal.insert(1, 0, "k2", rows(30..33, &["y"]));
    wal.insert(1, 0, "k1", rows(0..10, &["x", "y"])); // a retry of k1
    let all = wal.bytes.clone().freeze();

    // Replica 0 gets the WAL in one piece, replica 1 in small pieces.
    let mut r0 = open(&disk, "r0", 0).await;
    assert_eq!(r0.receive(Lsn(0), &all).await.expect("apply"), wal.end());
    let mut r1 = open(&disk, "r1", 0).await;
    for (i, chunk) in all.chunks(37).enumerate() {
        r1.receive(Lsn(i as u64 * 37), chunk)
            .await
            .expect("apply piece");
    }
    assert_eq!(r1.disk_consistent_lsn(), wal.end());
    let mut r2 = open(&disk, "r2", 0).await;
    for (i, byte) in all.chunks(1).enumerate() {
        let applied = r2.receive(Lsn(i as u64), byte).await.expect("apply byte");
        assert!(applied <= Lsn(i as u64 + 1));
    }
    assert_eq!(r2.disk_consistent_lsn(), wal.end());
    let expected = [
        (format!("x_{}_{}_0", a.0, a.0), 5, 0),
        (format!("y_{}_{}_0", a.0, a.0), 5, 0),
        (format!("y_{}_{}_0", b.0, b.0), 3, 0),
    ];
    let got0 = names(&r0);
    assert_eq!(
        got0.iter().map(|(n, r, _)| (n.clone(), *r)).collect::<Vec<_>>(),
        expected.iter().map(|(n, r, _)| (n.clone(), *r)).collect::<Vec<_>>(),
        "one part per partition per applied insert; other shards, dropped tables and the retry skipped"
    );
    assert_eq!(
        got0,
        names(&r1),
        "replicas agree on names, rows and checksums"
    );
    assert_eq!(got0, names(&r2), "however the WAL was cut");
    let file = |r: &str, n: &str| {
        std::fs::read(dir.path().join(format!("{r}/parts/1/{n}.parquet"))).expect("part")
    };
    assert_eq!(
        file("r0", &expected[0].0),
        file("r1", &expected[0].0),
        "same bytes"
    );
    assert_eq!(r0.subscribe().borrow().records_skipped_duplicate, 1);

    // Restart: the same parts, and it resumes at its position.
    drop(r0);
    let r0 = open(&disk, "r0", 0).await;
    assert_eq!(r0.disk_consistent_lsn(), wal.end());
    assert_eq!(names(&r0), got0);

    // A replica of every shard holds shard 1's rows too.
    let mut all_shards = open(&disk, "all", ferry_replica::ALL_SHARDS).await;
    all_shards.receive(Lsn(0), &all).await.expect("apply");
    assert_eq!(all_shards.parts(1).iter().map(|p| p.rows).sum::<u64>(), 23);
}

#[tokio::test]
async fn a_crash_between_parts_and_position_neither_loses_nor_duplicates() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let mut wal = Wal::default();
    wal.insert(1, 0, "k", rows(0..4, &["x", "y"]));
    let all = wal.bytes.clone().freeze();
    let mut r = open(&disk, "r", 0).await;
    r.receive(Lsn(0), &all).await.expect("apply");
    let parts = names(&r);
    drop(r);
    // As if the crash came after the parts but before the state: the state
    // is the one from before, and a part was being written too.
    std::fs::remove_file(dir.path().join("r/state")).expect("remove state");
    std::fs::write(dir.path().join("r/parts/1/z_99_99_0.parquet.tmp"), b"torn").expect("tmp");
    let mut r = open(&disk, "r", 0).await;
    assert_eq!(r.disk_consistent_lsn(), Lsn(0));
    assert!(
        !dir.path().join("r/parts/1/z_99_99_0.parquet.tmp").exists(),
        "leftover removed"
    );
    r.receive(Lsn(0), &all).await.expect("apply again");
    assert_eq!(names(&r), parts, "the same parts, once");
    assert_eq!(r.disk_consistent_lsn(), wal.end());
}

#[tokio::test]
async fn hostile_wal_stops_the_replica_without_writing_a_part() {
    let (_dir, disk) = ferry_testkit::disk::temp_disk();
    // A table id never handed out.
    let mut wal = Wal::default();
    wal.insert(7, 0, "", rows(0..2, &["x"]));
    let mut r = open(&disk, "a", 0).await;
    let e = r
        .receive(Lsn(0), &wal.bytes)
        .await
        .expect_err("unknown table");
    assert!(
        matches!(e, ReplicaError::BadRecord { .. }) && e.to_string().contains("never created"),
        "{e}"
    );
    assert!(r.parts(7).is_empty() && r.disk_consistent_lsn() == Lsn(0));
    assert!(r.subscribe().borrow().error.is_some());

    // Rows of another schema.
    let other = RecordBatch::try_new(
        Arc::new(arrow::datatypes::Schema::new(vec![
            arrow::datatypes::Field::new("id", arrow::datatypes::DataType::Int64, false),
        ])),
        vec![Arc::new(Int64Array::from(vec![1]))],
    )
    .expect("batch");
    let mut wal = Wal::default();
    wal.insert(1, 0, "", ferry_table::rows::to_ipc(&other).expect("ipc"));
    let mut r = open(&disk, "b", 0).await;
    let e = r
        .receive(Lsn(0), &wal.bytes)
        .await
        .expect_err("schema mismatch");
    assert!(e.to_string().contains("do not match"), "{e}");
    assert!(r.parts(1).is_empty());

    // Bytes that are not Arrow, and a block number that is not the LSN.
    let mut wal = Wal::default();
    wal.insert(1, 0, "", Bytes::from_static(b"garbage"));
    let mut r = open(&disk, "c", 0).await;
    assert!(r.receive(Lsn(0), &wal.bytes).await.is_err());
    let mut bytes = BytesMut::new();
    Record::Insert {
        table_id: 1,
        shard: 0,
        block_number: 5,
        idempotency_key: Bytes::new(),
        arrow_ipc: rows(0..1, &["x"]),
    }
    .encode(&mut bytes);
    let mut r = open(&disk, "d", 0).await;
    let e = r.receive(Lsn(0), &bytes).await.expect_err("block number");
    assert!(e.to_string().contains("block number"), "{e}");
    // A header declaring a record longer than any record is refused at once,
    // not waited for.
    let mut r = open(&disk, "f", 0).await;
    let mut huge = vec![0xff, 0xff, 0xff, 0x7f];
    huge.extend([0u8; 12]);
    let e = r.receive(Lsn(0), &huge).await.expect_err("a huge record");
    assert!(matches!(e, ReplicaError::BadRecord { .. }), "{e}");
    // WAL that does not continue the stream.
    let mut r = open(&disk, "e", 0).await;
    assert!(r.receive(Lsn(10), &bytes).await.is_err());
}

#[tokio::test]
async fn merges_are_decided_by_the_wal_and_agree_across_replicas_and_crashes() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let mut wal = Wal::default();
    let mut blocks = Vec::new();
    for i in 0..20i64 {
        blocks.push(wal.insert(1, 0, "", rows(i * 10..i * 10 + 10, &["x"])).0);
    }
    let all = wal.bytes.clone().freeze();

    // Replica a: everything at once, merges after.
    let mut a = open(&disk, "a", 0).await;
    a.receive(Lsn(0), &all).await.expect("apply");
    assert_eq!(
        a.subscribe().borrow().pending_merges,
        2,
        "20 parts: two merges of 8"
    );
    let replaced = merge_all(&mut a).await;
    assert_eq!(replaced.len(), 16);
    let merged: Vec<String> = a.parts(1).iter().map(|p| p.name.to_string()).collect();
    assert_eq!(merged[0], format!("x_{}_{}_1", blocks[0], blocks[7]));
    assert_eq!(merged[1], format!("x_{}_{}_1", blocks[8], blocks[15]));
    assert_eq!(
        merged.len(),
        2 + 4,
        "two level-1 parts and the 4 newest level-0 parts"
    );
    assert_eq!(a.parts(1).iter().map(|p| p.rows).sum::<u64>(), 200);

    // Replica b: merges interleaved with applying, a crash (reopen) mid-way
    // with a merge decided but not done, and one done but whose sources are
    // still on disk.
    let mut b = open(&disk, "b", 0).await;
    let cut = all.len() / 2;
    b.receive(Lsn(0), &all[..cut]).await.expect("first half");
    let job = b.next_merge().expect("a merge decided");
    let merge = job.merge.clone();
    let meta = job.run().await.expect("merge runs");
    let _ = b.finish_merge(&merge, meta).await.expect("finish");
    // Sources of that merge are not removed: a crash before the removal.
    drop(b);
    let mut b = open(&disk, "b", 0).await;
    let at = b.receive_from();
    b.receive(at, &all[at.0 as usize..])
        .await
        .expect("second half");
    merge_all(&mut b).await;
    assert_eq!(names(&a), names(&b), "same parts, names and checksums");
    for p in a.parts(1) {
        let file = |r: &str| {
            std::fs::read(dir.path().join(format!("{r}/parts/1/{}.parquet", p.name))).expect("part")
        };
        assert_eq!(file("a"), file("b"), "{}: same bytes", p.name);
    }
    // Replaced parts are not active after a restart; the merge task removes
    // them after the grace period.
    drop(b);
    let mut b = open(&disk, "b", 0).await;
    assert_eq!(names(&b), names(&a));
    let replaced = b.take_replaced();
    for p in b.release_replaced(&replaced) {
        std::fs::remove_file(dir.path().join(p)).expect("remove");
    }
    let on_disk = std::fs::read_dir(dir.path().join("b/parts/1"))
        .expect("dir")
        .count();
    assert_eq!(on_disk, 6, "only the active parts are left");
}

#[tokio::test]
async fn partitions_take_turns_so_a_merge_backlog_holds_back_no_other_partition() {
    let (_dir, disk) = ferry_testkit::disk::temp_disk();
    let mut wal = Wal::default();
    // Partition "x": 32 parts, four merges decided first; then partition
    // "y": 8 parts, one merge decided after them.
    for i in 0..32i64 {
        wal.insert(1, 0, "", rows(i * 10..i * 10 + 10, &["x"]));
    }
    for i in 32..40i64 {
        wal.insert(1, 0, "", rows(i * 10..i * 10 + 10, &["y"]));
    }
    let mut r = open(&disk, "r", 0).await;
    common::apply_rest(&mut r, &wal).await;
    assert_eq!(r.subscribe().borrow().pending_merges, 5);
    let mut order = Vec::new();
    while let Some(job) = r.next_merge() {
        let merge = job.merge.clone();
        order.push(merge.result.to_string());
        let meta = job.run().await.expect("merge");
        r.finish_merge(&merge, meta).await.expect("finish");
    }
    let partitions: Vec<&str> = order.iter().map(|n| &n[..1]).collect();
    assert_eq!(
        partitions,
        ["x", "y", "x", "x", "x"],
        "y's merge waits for one of x's, not all four: {order:?}"
    );
    // x's own merges ran in the order decided (block order).
    let x: Vec<&String> = order.iter().filter(|n| n.starts_with('x')).collect();
    let mut sorted = x.clone();
    sorted.sort_by_key(|n| n.split('_').nth(1).and_then(|b| b.parse::<u64>().ok()));
    assert_eq!(x, sorted);
    assert_eq!(r.parts(1).iter().map(|p| p.rows).sum::<u64>(), 400);
}

#[tokio::test]
async fn a_pinned_part_outlives_its_merge_and_a_restart_until_unpinned() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let mut wal = Wal::default();
    for i in 0..8i64 {
        wal.insert(1, 0, "", rows(i * 10..i * 10 + 10, &["x"]));
    }
    let all = wal.bytes.clone().freeze();
    let mut r = open(&disk, "p", 0).await;
    r.receive(Lsn(0), &all).await.expect("apply");
    let snapshot: Vec<ferry_replica::PartName> =
        r.parts(1).iter().map(|p| p.name.clone()).collect();
    assert_eq!(snapshot.len(), 8);
    r.pin("tx1", 1, &snapshot[..3]).await.expect("pin");
    let replaced = merge_all(&mut r).await;
    assert_eq!(replaced.len(), 8);
    assert_eq!(r.parts(1).len(), 1, "the merged part alone is active");
    // The grace period is over: unpinned sources go, pinned ones stay.
    let removed = r.release_replaced(&replaced);
    assert_eq!(removed.len(), 5);
    for p in removed {
        std::fs::remove_file(dir.path().join(p)).expect("remove");
    }
    for name in &snapshot[..3] {
        let (path, meta) = r.export_part(1, name).expect("kept for the export");
        assert_eq!(&meta.name, name);
        assert!(dir.path().join(path).exists());
    }
    assert!(r.export_part(1, &snapshot[5]).is_none());
    // A restart keeps pins and the parts they name.
    drop(r);
    let mut r = open(&disk, "p", 0).await;
    assert_eq!(r.pinned_exports(), vec!["tx1".to_string()]);
    assert!(
        r.take_replaced().is_empty(),
        "pinned parts are not for removal"
    );
    assert!(r.export_part(1, &snapshot[0]).is_some());
    assert_eq!(r.parts(1).len(), 1);
    // Unpinned: handed to the merge task for removal.
    r.unpin("tx1").await.expect("unpin");
    let freed = r.take_replaced();
    assert_eq!(freed.len(), 3);
    assert_eq!(r.release_replaced(&freed).len(), 3);
    assert!(r.export_part(1, &snapshot[0]).is_none());
    assert!(r.pinned_exports().is_empty());
}

/// Logs the reads and writes of files.
struct IoLog(Arc<std::sync::Mutex<Vec<Io>>>);

#[derive(Debug, Clone, PartialEq)]
enum Io {
    ReadWhole(String),
    ReadAt(String, usize),
    WriteAt(String, usize),
}

#[async_trait]
impl DiskHook for IoLog {
    async fn before(&self, op: DiskOp<'_>) -> std::io::Result<()> {
        let io = match op {
            DiskOp::Read(path) => Io::ReadWhole(path.to_string()),
            DiskOp::ReadAt { path, len, .. } => Io::ReadAt(path.to_string(), len),
            DiskOp::WriteAt { path, len, .. } => Io::WriteAt(path.to_string(), len),
            _ => return Ok(()),
        };
        self.0.lock().expect("log").push(io);
        Ok(())
    }
}

#[tokio::test]
async fn a_merge_streams_its_sources_a_row_group_at_a_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let disk: Arc<dyn Disk> = Arc::new(HookedDisk::new(
        Arc::new(RealDisk::open_root(dir.path()).expect("disk")),
        Arc::new(IoLog(Arc::clone(&log))),
    ));
    // Eight inserts of 40,000 rows: one merge of 320,000 rows, more than two
    // row groups of the result.
    let mut wal = Wal::default();
    let per_insert = 40_000i64;
    for i in 0..ferry_replica::MERGE_FANIN as i64 {
        wal.insert(1, 0, "", rows(i * per_insert..(i + 1) * per_insert, &["x"]));
    }
    let mut r = open(&disk, "r", 0).await;
    r.receive(Lsn(0), &wal.bytes).await.expect("apply");
    let sources = r.parts(1);
    let source_bytes: Vec<u64> = sources.iter().map(|p| p.bytes).collect();
    let expected_rows: Vec<RecordBatch> = {
        let mut all = Vec::new();
        for p in &sources {
            let file = std::fs::read(dir.path().join(format!("r/parts/1/{}.parquet", p.name)))
                .expect("source");
            all.extend(ferry_replica::part::read_rows(&p.name, Bytes::from(file)).expect("rows"));
        }
        all
    };
    log.lock().expect("log").clear();

    let job = r.next_merge().expect("a merge decided");
    let merge = job.merge.clone();
    let meta = job.run().await.expect("merge runs");
    let ops = log.lock().expect("log").clone();

    // The result: every row of the sources, in block order, and its checksum
    // the checksum of those rows.
    assert_eq!(meta.rows, 8 * per_insert as u64);
    let schema = table().def.arrow_schema();
    assert_eq!(
        meta.checksum,
        ferry_replica::part::rows_checksum(&schema, &expected_rows).expect("checksum")
    );
    let merged_file = dir
        .path()
        .join(format!("r/parts/1/{}.parquet", merge.result));
    let merged = ferry_replica::part::read_rows(
        &merge.result,
        Bytes::from(std::fs::read(&merged_file).expect("merged part")),
    )
    .expect("merged rows");
    assert_eq!(
        arrow::compute::concat_batches(&schema, &merged).expect("concat"),
        arrow::compute::concat_batches(&schema, &expected_rows).expect("concat")
    );

    // Streamed: no source read whole, no read larger than a source, and the
    // result written in pieces, the first before the last source's rows were
    // read.
    assert!(
        !ops.iter().any(|o| matches!(o, Io::ReadWhole(_))),
        "a part was read whole: {ops:?}"
    );
    let biggest = *source_bytes.iter().max().expect("sources") as usize;
    for o in &ops {
        if let Io::ReadAt(path, len) = o {
            assert!(*len <= biggest, "{path}: a read of {len} bytes");
        }
    }
    let writes: Vec<usize> = ops
        .iter()
        .enumerate()
        .filter(|(_, o)| matches!(o, Io::WriteAt(p, _) if p.ends_with(".parquet.tmp")))
        .map(|(i, _)| i)
        .collect();
    assert!(
        writes.len() >= 3,
        "the result in at least 3 writes: {ops:?}"
    );
    let last_source = sources.last().expect("sources").name.to_string();
    // Footers are read first; the last read of the last source is its rows.
    let last_source_rows_read = ops
        .iter()
        .rposition(|o| matches!(o, Io::ReadAt(p, _) if p.contains(&last_source)))
        .expect("the last source was read");
    assert!(
        writes[0] < last_source_rows_read,
        "the result's first row group was written before the last source's rows were read"
    );
    let replaced = r.finish_merge(&merge, meta).await.expect("finish");
    assert_eq!(replaced.len(), ferry_replica::MERGE_FANIN);
}

#[tokio::test]
async fn a_replica_behind_syncs_in_batches_and_a_crash_in_between_loses_nothing() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let mut wal = Wal::default();
    for i in 0..3i64 {
        wal.insert(
            1,
            0,
            &format!("k{i}"),
            rows(i * 10..i * 10 + 10, &["x", "y"]),
        );
    }
    let all = wal.bytes.clone().freeze();
    // The reference: everything applied and persisted at once.
    let mut reference = open(&disk, "ref", 0).await;
    reference.receive(Lsn(0), &all).await.expect("apply");

    // Behind its safekeeper's commit_lsn, a replica applies without syncing:
    // nothing is active and the position stays until it syncs.
    let far = Lsn(1 << 40);
    let mut r = open(&disk, "r", 0).await;
    let at = r.receive_until(Lsn(0), &all, far).await.expect("apply");
    assert_eq!(at, Lsn(0), "the position waits for the sync");
    assert_eq!(r.disk_consistent_lsn(), Lsn(0));
    assert!(r.parts(1).is_empty(), "unsynced parts are not active");
    assert_eq!(r.receive_from(), wal.end(), "but the WAL was taken");
    // A crash now: the next start removes the half-done parts and applies
    // the records again.
    drop(r);
    let tmp = std::fs::read_dir(dir.path().join("r/parts/1"))
        .expect("dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .count();
    assert_eq!(
        tmp, 6,
        "three records of two partitions left as temporary files"
    );
    let mut r = open(&disk, "r", 0).await;
    assert_eq!(r.disk_consistent_lsn(), Lsn(0));
    let at = r
        .receive_until(Lsn(0), &all, far)
        .await
        .expect("apply again");
    assert_eq!(at, Lsn(0));
    // Once the stream goes quiet, everything is synced and persisted.
    assert_eq!(r.flush().await.expect("flush"), wal.end());
    assert_eq!(names(&r), names(&reference), "the same parts, once");
    drop(r);
    let r = open(&disk, "r", 0).await;
    assert_eq!(r.disk_consistent_lsn(), wal.end());
    assert_eq!(names(&r), names(&reference));
    // Caught up with the commit_lsn, it persists at once.
    let mut c = open(&disk, "c", 0).await;
    assert_eq!(
        c.receive_until(Lsn(0), &all, wal.end())
            .await
            .expect("apply"),
        wal.end()
    );
}

/// Stalls a sync until released, and says when it is stalled: armed with
/// `arm(n)`, the `n`-th sync from then on (1: the next one).
#[derive(Default)]
struct SyncGate {
    countdown: std::sync::atomic::AtomicUsize,
    stalled: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

impl SyncGate {
    fn arm(&self, nth: usize) {
        self.countdown
            .store(nth, std::sync::atomic::Ordering::SeqCst);
    }
}

#[async_trait]
impl DiskHook for SyncGate {
    async fn before(&self, op: DiskOp<'_>) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        let due = op.is_sync()
            && self
                .countdown
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                == Ok(1);
        if due {
            self.stalled.notify_one();
            self.release.notified().await;
        }
        Ok(())
    }
}

#[tokio::test]
async fn reads_see_the_last_durable_view_while_the_applier_holds_the_replica_in_an_fsync() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = Arc::new(SyncGate::default());
    let disk: Arc<dyn Disk> = Arc::new(HookedDisk::new(
        Arc::new(RealDisk::open_root(dir.path()).expect("disk")),
        Arc::clone(&gate) as Arc<dyn DiskHook>,
    ));
    let mut wal = Wal::default();
    wal.insert(1, 0, "a", rows(0..10, &["x"]));
    let first = wal.end();
    wal.insert(1, 0, "b", rows(10..30, &["x", "y"]));
    let all = wal.bytes.clone().freeze();

    let mut replica = open(&disk, "r", 0).await;
    let reader = replica.reader();
    replica
        .receive(Lsn(0), &all[..first.0 as usize])
        .await
        .expect("receive");
    replica.flush().await.expect("flush");
    let before = reader.view();
    assert_eq!(before.disk_consistent_lsn, first);
    assert_eq!(before.parts(1).iter().map(|p| p.rows).sum::<u64>(), 10);

    // The applier takes the replica and stalls in the fsync of its next part.
    let shared = Arc::new(tokio::sync::Mutex::new(replica));
    gate.arm(1);
    let applier = tokio::spawn({
        let shared = Arc::clone(&shared);
        let rest = all.slice(first.0 as usize..);
        async move {
            let mut r = shared.lock().await;
            r.receive(first, &rest).await.expect("receive");
            r.flush().await.expect("flush")
        }
    });
    gate.stalled.notified().await;
    assert!(
        shared.try_lock().is_err(),
        "the applier holds the replica while it syncs"
    );
    // A read does not wait: it sees the last durable view, and a status
    // that announces no more than it.
    let during = reader.view();
    assert_eq!(during.disk_consistent_lsn, first);
    assert_eq!(during.parts(1), before.parts(1));
    assert!(reader.status().disk_consistent_lsn <= during.disk_consistent_lsn);
    for p in during.parts(1) {
        let path = during.part_path(1, &p.name);
        assert!(dir.path().join(&path).is_file(), "{path} is on disk");
    }

    gate.release.notify_one();
    let end = applier.await.expect("applier");
    assert_eq!(end, wal.end());
    let after = reader.view();
    assert_eq!(after.disk_consistent_lsn, wal.end());
    assert_eq!(after.parts(1).iter().map(|p| p.rows).sum::<u64>(), 30);
    assert_eq!(
        reader.status().disk_consistent_lsn,
        after.disk_consistent_lsn
    );
    assert_eq!(
        after.parts(1),
        shared.lock().await.parts(1),
        "the view is what the replica holds"
    );
}

/// A persist whose caller goes away half-way (an HTTP request pinning parts
/// whose client disconnected, an exporter stopped while the replica runs
/// on) leaves the parts it had not made durable for the next persist: none
/// is lost, and no state is written over a part that is not durable.
#[tokio::test]
async fn a_persist_cut_short_by_its_caller_loses_no_part() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut wal = Wal::default();
    for i in 0..3i64 {
        wal.insert(
            1,
            0,
            &format!("k{i}"),
            rows(i * 10..i * 10 + 10, &["x", "y"]),
        );
    }
    let all = wal.bytes.clone().freeze();
    let (_ref_dir, ref_disk) = ferry_testkit::disk::temp_disk();
    let mut reference = open(&ref_disk, "ref", 0).await;
    reference.receive(Lsn(0), &all).await.expect("apply");
    for cut_at_sync in 1..=4 {
        let gate = Arc::new(SyncGate::default());
        let disk: Arc<dyn Disk> = Arc::new(HookedDisk::new(
            Arc::new(RealDisk::open_root(dir.path()).expect("disk")),
            Arc::clone(&gate) as Arc<dyn DiskHook>,
        ));
        let name = format!("cut{cut_at_sync}");
        let mut r = open(&disk, &name, 0).await;
        // Applied, six parts waiting for their sync.
        r.receive_until(Lsn(0), &all, Lsn(1 << 40))
            .await
            .expect("apply");
        gate.arm(cut_at_sync);
        {
            let pin = r.pin("an-export", 1, &[]);
            tokio::pin!(pin);
            tokio::select! {
                biased;
                _ = gate.stalled.notified() => {}
                done = &mut pin => panic!("the persist ended before sync {cut_at_sync}: {done:?}"),
            }
            // The caller goes away in the middle of the persist.
        }
        gate.release.notify_one();
        assert_eq!(r.flush().await.expect("flush"), wal.end());
        assert_eq!(names(&r), names(&reference), "cut at sync {cut_at_sync}");
        drop(r);
        let r = open(&disk, &name, 0).await;
        assert_eq!(r.disk_consistent_lsn(), wal.end());
        assert_eq!(
            names(&r),
            names(&reference),
            "cut at sync {cut_at_sync}, reopened"
        );
    }
}
