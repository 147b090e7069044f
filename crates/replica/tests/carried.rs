//! Insert records that carry their parts (encoded once by the ingest node):
//! every replica writes the bytes as they came, names and describes them as
//! it would parts it encoded, merges them alike, and refuses a carried part
//! that is not one of the table's without writing anything.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // a real temp dir

use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use bytes::Bytes;
use ferry_replica::{PartName, ReplicaError};
use ferry_wal::record::CarriedPart;
use ferry_wal::Lsn;

mod common;
use common::{merge_all, names, open, rows, table, Wal};

#[tokio::test]
async fn carried_parts_are_written_as_they_came_and_agree_with_parts_replicas_encode() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    // The same inserts twice: as rows replicas encode, and as carried parts.
    let mut inserts = vec![
        ("k1".to_string(), rows(0..10, &["x", "y"])),
        ("k2".to_string(), rows(10..13, &["y"])),
        ("k3".to_string(), rows(13..40, &["x", "y", "z"])),
    ];
    // Enough parts of partition x for merges.
    for i in 0..ferry_replica::MERGE_FANIN as i64 {
        inserts.push((format!("m{i}"), rows(100 + i * 5..105 + i * 5, &["x"])));
    }
    let (mut encoded, mut carried) = (Wal::default(), Wal::default());
    let mut blocks = Vec::new();
    for (key, ipc) in &inserts {
        // The same LSNs in both: records of the same length would be needed,
        // so each WAL is its own; blocks are compared by position.
        encoded.insert(1, 0, key, ipc.clone());
        blocks.push(carried.insert_parts(1, 0, key, ipc));
    }
    carried.insert_parts(1, 0, "k2", &inserts[1].1); // a retry: skipped
    let all = carried.bytes.clone().freeze();
    let mut r0 = open(&disk, "r0", 0).await;
    assert_eq!(
        r0.receive(Lsn(0), &all).await.expect("apply"),
        carried.end()
    );
    let mut r1 = open(&disk, "r1", 0).await;
    for (i, chunk) in all.chunks(101).enumerate() {
        r1.receive(Lsn(i as u64 * 101), chunk)
            .await
            .expect("apply piece");
    }
    let mut e = open(&disk, "e", 0).await;
    e.receive(Lsn(0), &encoded.bytes)
        .await
        .expect("apply encoded");

    let got = names(&r0);
    assert_eq!(
        got.len(),
        2 + 1 + 3 + ferry_replica::MERGE_FANIN,
        "one part per partition per insert"
    );
    assert_eq!(got, names(&r1), "replicas agree");
    assert_eq!(
        r0.subscribe().borrow().records_skipped_duplicate,
        1,
        "the retry skipped"
    );
    // Rows and checksums as a replica encoding the rows itself has them.
    let strip = |v: Vec<(String, u64, u32)>| -> Vec<(String, u64, u32)> {
        v.into_iter()
            .map(|(n, rows, sum)| {
                (
                    n.split('_').next().expect("partition").to_string(),
                    rows,
                    sum,
                )
            })
            .collect()
    };
    let mut a = strip(got.clone());
    let mut b = strip(names(&e));
    a.sort();
    b.sort();
    assert_eq!(a, b, "the same rows and checksums per partition");
    // The bytes on disk are the carried files, and the metadata names the
    // record's LSN (the footer has none).
    let ferry_wal::record::Record::InsertParts { parts, .. } =
        ferry_wal::record::decode(&all).expect("decode").0
    else {
        panic!("an insert carrying parts")
    };
    for p in &parts {
        let name = format!("{}_{}_{}_0", p.partition_id, blocks[0].0, blocks[0].0);
        let on_disk =
            std::fs::read(dir.path().join(format!("r0/parts/1/{name}.parquet"))).expect("part");
        assert_eq!(on_disk, p.file.as_ref(), "{name}: written as it came");
    }
    for meta in r0.parts(1) {
        assert_eq!(
            (meta.min_lsn, meta.max_lsn),
            (Lsn(meta.name.min_block), Lsn(meta.name.max_block))
        );
    }

    // A restart reads the same metadata back from the footers.
    drop(r0);
    let mut r0 = open(&disk, "r0", 0).await;
    assert_eq!(names(&r0), got);
    assert_eq!(r0.parts(1), r1.parts(1));

    // Merges of carried parts: what merges of encoded parts give.
    merge_all(&mut r0).await;
    merge_all(&mut e).await;
    r0.flush().await.expect("flush");
    e.flush().await.expect("flush");
    let mut a = strip(names(&r0));
    let mut b = strip(names(&e));
    a.sort();
    b.sort();
    assert_eq!(a, b, "merged alike");
    assert!(
        r0.parts(1).iter().any(|p| p.name.level > 0),
        "something merged"
    );
}

/// A record whose carried parts are not the table's stops the replica before
/// it writes any of them.
#[tokio::test]
async fn carried_parts_that_are_not_the_tables_stop_the_replica_without_writing_a_part() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let def = table().def;
    let batch = |ids: std::ops::Range<i64>, p: &str| {
        RecordBatch::try_new(
            def.arrow_schema(),
            vec![
                Arc::new(Int64Array::from_iter_values(ids.clone())),
                Arc::new(StringArray::from_iter_values(ids.map(|_| p))),
            ],
        )
        .expect("batch")
    };
    let part = |table_id: u64, p: &str, rows: &RecordBatch| {
        let (file, _) = ferry_replica::part::encode_carried(&def.arrow_schema(), p, table_id, rows)
            .expect("encode");
        CarriedPart {
            partition_id: p.to_string(),
            file,
        }
    };
    let good = part(1, "a", &batch(0..3, "a"));
    let other_schema = {
        let b = RecordBatch::try_new(
            Arc::new(arrow::datatypes::Schema::new(vec![
                arrow::datatypes::Field::new("id", arrow::datatypes::DataType::Int64, false),
            ])),
            vec![Arc::new(Int64Array::from(vec![1]))],
        )
        .expect("batch");
        let (file, _) =
            ferry_replica::part::encode_carried(&b.schema(), "b", 1, &b).expect("encode");
        CarriedPart {
            partition_id: "b".into(),
            file,
        }
    };
    let with_lsns = {
        let name = PartName {
            partition_id: "b".into(),
            min_block: 0,
            max_block: 0,
            level: 0,
        };
        let (file, _) = ferry_replica::part::encode(
            &def.arrow_schema(),
            &name,
            1,
            &[batch(0..2, "b")],
            (Lsn(0), Lsn(0)),
        )
        .expect("encode");
        CarriedPart {
            partition_id: "b".into(),
            file,
        }
    };
    let cases: Vec<(&str, Vec<CarriedPart>, &str)> = vec![
        (
            "another table's part",
            vec![good.clone(), part(5, "b", &batch(0..2, "b"))],
            "names table 5",
        ),
        (
            "rows of another partition",
            vec![
                good.clone(),
                CarriedPart {
                    partition_id: "b".into(),
                    ..part(1, "c", &batch(0..2, "c"))
                },
            ],
            "rows of partition c",
        ),
        (
            "rows of two partitions in one part",
            vec![
                good.clone(),
                part(
                    1,
                    "b",
                    &arrow::compute::concat_batches(
                        &def.arrow_schema(),
                        &[batch(0..2, "b"), batch(2..4, "c")],
                    )
                    .expect("concat"),
                ),
            ],
            "rows of partition c",
        ),
        (
            "bytes that are not Parquet",
            vec![
                good.clone(),
                CarriedPart {
                    partition_id: "b".into(),
                    file: Bytes::from_static(b"not a part"),
                },
            ],
            "not a valid ferry part",
        ),
        (
            "parts out of order",
            vec![part(1, "b", &batch(0..2, "b")), good.clone()],
            "out of order",
        ),
        (
            "the same partition twice",
            vec![good.clone(), good.clone()],
            "out of order",
        ),
        (
            "other columns",
            vec![good.clone(), other_schema],
            "not the table's",
        ),
        (
            "LSNs of its own",
            vec![good.clone(), with_lsns],
            "LSNs of its own",
        ),
        ("no part at all", vec![], "no part"),
        (
            "a path for a partition id",
            vec![CarriedPart {
                partition_id: "../../x".into(),
                ..good.clone()
            }],
            "rows of partition a",
        ),
    ];
    for (i, (what, parts, says)) in cases.into_iter().enumerate() {
        let mut wal = Wal::default();
        wal.insert_carried(1, 0, "", parts);
        let dir_name = format!("r{i}");
        let mut r = open(&disk, &dir_name, 0).await;
        let e = r.receive(Lsn(0), &wal.bytes).await.expect_err(what);
        assert!(matches!(e, ReplicaError::BadRecord { .. }), "{what}: {e}");
        assert!(e.to_string().contains(says), "{what}: {e}");
        assert!(
            r.parts(1).is_empty() && r.disk_consistent_lsn() == Lsn(0),
            "{what}"
        );
        let written: Vec<_> = std::fs::read_dir(dir.path().join(&dir_name))
            .expect("dir")
            .flatten()
            .filter(|e| e.file_name() == "parts")
            .flat_map(|p| walk(&p.path()))
            .collect();
        assert!(written.is_empty(), "{what}: wrote {written:?}");
    }
    assert!(!dir.path().join("x").exists() && !dir.path().join("r9/x").exists());
}

fn walk(p: &std::path::Path) -> Vec<std::path::PathBuf> {
    if p.is_dir() {
        std::fs::read_dir(p)
            .expect("dir")
            .flatten()
            .flat_map(|e| walk(&e.path()))
            .collect()
    } else {
        vec![p.to_path_buf()]
    }
}
