//! Compaction on a replica: a `Compact` record merges runs of a partition's
//! consecutive parts up to its target, decided at its position like any
//! merge, so two replicas (one having run its merges, one not) end with the
//! same parts and bytes; compacting again decides nothing; inserts after it
//! merge as before.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // a real temp dir

use ferry_replica::Replica;
use ferry_wal::record::{Compaction, Record};

mod common;
use common::{apply_rest, merge_all, names, open_as, rows, Wal};

fn compact(wal: &mut Wal, partition: &str, target_rows: u64) {
    Record::Compact(Compaction {
        table_id: 1,
        partition_id: partition.into(),
        target_rows,
    })
    .encode(&mut wal.bytes);
}

fn parts_of(r: &Replica, partition: &str) -> Vec<(String, u64)> {
    r.parts(1)
        .into_iter()
        .filter(|p| p.name.partition_id == partition)
        .map(|p| (p.name.to_string(), p.rows))
        .collect()
}

#[tokio::test]
async fn a_compaction_merges_consecutive_parts_up_to_the_target_alike_on_every_replica() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let mut wal = Wal::default();
    // 12 inserts of 10 rows over x and y: x holds one level-1 part (8
    // inserts) and 4 level-0 parts.
    for i in 0..12i64 {
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
    assert_eq!(parts_of(&a, "x").len(), 5);
    // A target of 45 rows: the level-1 part (40 rows) and the first
    // level-0 part (5) make one; the other three another.
    compact(&mut wal, "x", 45);
    for r in [&mut a, &mut b] {
        apply_rest(r, &wal).await;
        merge_all(r).await;
    }
    assert_eq!(names(&a), names(&b), "both replicas decided the same");
    let x = parts_of(&a, "x");
    assert_eq!(
        x.iter().map(|(_, r)| r).collect::<Vec<_>>(),
        [&45, &15],
        "{x:?}"
    );
    assert_eq!(parts_of(&a, "y").len(), 5, "another partition is untouched");
    assert_eq!(a.subscribe().borrow().compactions_decided, 2);
    for p in a.parts(1) {
        let file = |r: &str| {
            std::fs::read(dir.path().join(format!("{r}/parts/1/{}.parquet", p.name))).expect("part")
        };
        assert_eq!(file("a"), file("b"), "{}: same bytes", p.name);
    }
    // Again: nothing to do. A big target takes the whole partition.
    compact(&mut wal, "x", 45);
    compact(&mut wal, "y", 1_000_000);
    for r in [&mut a, &mut b] {
        apply_rest(r, &wal).await;
        merge_all(r).await;
    }
    assert_eq!(parts_of(&a, "x").len(), 2);
    assert_eq!(parts_of(&a, "y").len(), 1);
    assert_eq!(a.subscribe().borrow().compactions_decided, 3);
    // Inserts after it merge as before, and every row is there once.
    for i in 12..30i64 {
        wal.insert(
            1,
            0,
            &format!("k{i}"),
            rows(i * 10..i * 10 + 10, &["x", "y"]),
        );
    }
    for r in [&mut a, &mut b] {
        apply_rest(r, &wal).await;
        merge_all(r).await;
    }
    assert_eq!(names(&a), names(&b));
    assert_eq!(a.parts(1).iter().map(|p| p.rows).sum::<u64>(), 300);
    // A restart keeps what was decided and done.
    let before = names(&a);
    drop(a);
    assert_eq!(names(&open_as(&disk, "a", 0).await), before);
}
