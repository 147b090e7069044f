//! Retention on a replica: a `Retire` record drops exactly the parts a named
//! lake file of the replica's shard holds whole, on every replica alike
//! whichever merges each already ran; parts holding rows no file holds stay;
//! the retirement survives a restart and travels with a copy; applying it
//! again changes nothing; one from another destination drops nothing.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // a real temp dir

use std::sync::Arc;

use ferry_env::{Cpu, SystemClock};
use ferry_replica::replica::bootstrap::{copy_from_peer, CopyCheck, LocalDonor};
use ferry_replica::{PartMeta, Replica, SharedReplica};
use ferry_wal::record::{Record, RetiredFile, Retirement};

mod common;
use common::{apply_rest, merge_all, names, open_as, rows, Wal};

fn file(p: &PartMeta, shard: Option<u32>) -> RetiredFile {
    RetiredFile {
        path: format!(
            "p={}/{}_{:08x}.parquet",
            p.name.partition_id, p.name, p.checksum
        ),
        part: p.name.to_string(),
        shard,
        rows: p.rows,
        bytes: p.bytes,
        checksum: p.checksum,
    }
}

fn retire(wal: &mut Wal, files: Vec<RetiredFile>) {
    Record::Retire(Retirement {
        table_id: 1,
        partition_id: "x".into(),
        destination: "s3://lake/t".into(),
        format: "parquet".into(),
        commit: "p=x/commit-000002.json".into(),
        files,
    })
    .encode(&mut wal.bytes);
}

fn rows_of(r: &Replica, partition: &str) -> u64 {
    r.parts(1)
        .iter()
        .filter(|p| p.name.partition_id == partition)
        .map(|p| p.rows)
        .sum()
}

#[tokio::test]
async fn a_retirement_drops_only_what_a_lake_file_holds_alike_on_every_replica() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let mut wal = Wal::default();
    // 20 inserts of 10 rows over partitions x and y: x gets 20 level-0
    // parts, the first 16 merged into two level-1 parts.
    for i in 0..20i64 {
        wal.insert(
            1,
            0,
            &format!("k{i}"),
            rows(i * 10..i * 10 + 10, &["x", "y"]),
        );
    }
    let mut a = open_as(&disk, "a", 0).await;
    let mut b = open_as(&disk, "b", 1).await;
    apply_rest(&mut a, &wal).await;
    apply_rest(&mut b, &wal).await;
    merge_all(&mut a).await;
    assert!(b.subscribe().borrow().pending_merges > 0, "b ran no merge");
    let level1: Vec<PartMeta> = a
        .parts(1)
        .into_iter()
        .filter(|p| p.name.partition_id == "x" && p.name.level == 1)
        .collect();
    assert_eq!(level1.len(), 2);
    let unexported = rows_of(&a, "x") - level1.iter().map(|p| p.rows).sum::<u64>();
    assert_eq!(unexported, 20, "four inserts' rows of x are in no file");

    // The lake's current commit holds the two merged parts; a file of
    // another shard covering every block and a file naming no part are
    // not this replica's business.
    let mut files: Vec<RetiredFile> = level1.iter().map(|p| file(p, Some(0))).collect();
    let mut everything = file(&level1[0], Some(1));
    everything.part = format!("x_0_{}_4", wal.end().0);
    files.push(everything);
    files.push(RetiredFile {
        part: "not-a-part".into(),
        ..file(&level1[1], Some(0))
    });
    retire(&mut wal, files.clone());
    apply_rest(&mut a, &wal).await;
    apply_rest(&mut b, &wal).await;
    merge_all(&mut b).await;
    assert_eq!(names(&a), names(&b), "both replicas dropped the same");
    assert_eq!(rows_of(&a, "x"), unexported, "rows no file holds stay");
    assert_eq!(rows_of(&a, "y"), 100, "another partition is untouched");
    let retired = a.retired(1);
    assert_eq!(retired, b.retired(1));
    assert_eq!(retired.len(), 1);
    assert_eq!(retired[0].files, files[..2].to_vec());
    assert_eq!(retired[0].rows(), 80);
    let st = a.subscribe().borrow().clone();
    assert_eq!((st.retirements_applied, st.parts_retired), (1, 2));
    // b dropped the 16 level-0 parts its undone merges would have merged.
    assert_eq!(b.subscribe().borrow().parts_retired, 2);

    // The dropped files go to the merge task only now that the state holds
    // the retirement; they are still on disk until it removes them.
    let freed = a.take_replaced();
    assert_eq!(freed.len(), 2);
    for (_, n) in &freed {
        assert!(dir.path().join(format!("a/parts/1/{n}.parquet")).exists());
    }

    // Late rows into the retired partition, and the same retirement again.
    for i in 20..28i64 {
        wal.insert(
            1,
            0,
            &format!("k{i}"),
            rows(i * 10..i * 10 + 10, &["x", "y"]),
        );
    }
    retire(&mut wal, files[..2].to_vec());
    for r in [&mut a, &mut b] {
        apply_rest(r, &wal).await;
        merge_all(r).await;
    }
    assert_eq!(names(&a), names(&b));
    assert_eq!(rows_of(&a, "x"), unexported + 40);
    assert_eq!(
        a.retired(1)[0].files,
        files[..2].to_vec(),
        "named again, kept once"
    );

    // A retirement from another destination drops nothing: the rows
    // retired so far are in the first one only.
    let late: Vec<RetiredFile> = a
        .parts(1)
        .iter()
        .filter(|p| p.name.partition_id == "x")
        .map(|p| file(p, Some(0)))
        .collect();
    Record::Retire(Retirement {
        table_id: 1,
        partition_id: "x".into(),
        destination: "s3://other/t".into(),
        format: "parquet".into(),
        commit: "p=x/commit-000001.json".into(),
        files: late,
    })
    .encode(&mut wal.bytes);
    let kept = names(&a);
    for r in [&mut a, &mut b] {
        apply_rest(r, &wal).await;
    }
    assert_eq!(names(&a), kept);
    assert_eq!(a.retired(1)[0].destination, "s3://lake/t");

    // A restart (the dropped files never removed) keeps them out.
    let before = names(&a);
    let at = a.disk_consistent_lsn();
    drop(a);
    let a = open_as(&disk, "a", 0).await;
    assert_eq!(a.disk_consistent_lsn(), at);
    assert_eq!(
        names(&a),
        before,
        "dropped parts found at open stay dropped"
    );
    assert_eq!(a.retired(1), b.retired(1));

    // A copy carries the retirement, not the dropped parts.
    let a: SharedReplica = Arc::new(tokio::sync::Mutex::new(a));
    let donor = LocalDonor {
        replica: Arc::clone(&a),
        clock: Arc::new(SystemClock),
        name: "a".into(),
    };
    let done = copy_from_peer(&disk, "n", 0, 2, Cpu::Inline, CopyCheck::Rows, &donor)
        .await
        .expect("copy");
    assert_eq!(done.disk_consistent_lsn, at);
    let n = open_as(&disk, "n", 2).await;
    assert_eq!(names(&n), before);
    assert_eq!(n.retired(1), b.retired(1));
}
