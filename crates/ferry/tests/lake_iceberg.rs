//! `ferry lake files` and `ferry verify` on an Iceberg table: the live data
//! files of its current snapshot, after a partition was exported again (its
//! old files are no longer listed); a file changed under the table and a
//! file no snapshot references are found.

mod common;

use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch, TimestampMicrosecondArray};
use bytes::Bytes;
use ferry_iceberg::{encode_data_file, Commit, DataFileEntry, IcebergTable, PartitionValue};
use ferry_table::TableDef;
use ferry_testkit::table::TableToml;

use common::{ferry, ferry_ok, runtime};

fn def() -> TableDef {
    TableToml::new("events", ("ts", "day"), ("user_id", 1))
        .column("ts", "Timestamp")
        .column("user_id", "Int64")
        .def()
}

/// `n` rows on day `day` (days since 1970).
fn rows(def: &TableDef, day: i64, n: i64) -> RecordBatch {
    RecordBatch::try_new(
        def.arrow_schema(),
        vec![
            Arc::new(
                TimestampMicrosecondArray::from(vec![day * 86_400_000_000; n as usize])
                    .with_timezone("+00:00"),
            ) as ArrayRef,
            Arc::new(Int64Array::from((0..n).collect::<Vec<_>>())),
        ],
    )
    .expect("batch")
}

#[test]
fn lake_files_lists_the_current_snapshot_of_an_iceberg_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}/events", dir.path().display());
    let def = def();
    let rt = runtime();
    rt.block_on(async {
        let loc =
            ferry_storage::open(&url, &ferry_storage::S3Settings::default()).expect("location");
        let table = IcebergTable::new(loc.clone());
        // 20240601 is day 19875, 20240602 day 19876.
        for (seq, (day, id, name, n)) in [
            (19875, "20240601", "a", 3),
            (19876, "20240602", "b", 2),
            (19875, "20240601", "c", 4),
        ]
        .into_iter()
        .enumerate()
        {
            let encoded = encode_data_file(
                &def,
                PartitionValue::of(&def, id).expect("partition"),
                &[rows(&def, day, n)],
            )
            .expect("encode");
            let key = format!("data/ts_day={id}/{name}.parquet");
            loc.put_create(&key, Bytes::from(encoded.bytes))
                .await
                .expect("put");
            let commit = Commit {
                transaction_id: format!("{}-{name}", 1000 + seq),
                sequence: seq as u64 + 1,
                create_time: 1000 + seq as u64,
                content_id: format!("content-{name}"),
                snapshot_lsn: 0,
                partition_id: id.into(),
                files: vec![DataFileEntry {
                    path: key,
                    ..encoded.entry
                }],
                timestamp_ms: 1_700_000_000_000,
            };
            table.commit(&def, &commit).await.expect("commit");
        }
    });
    let listed = ferry_ok(&["lake", "files", &url], "http://127.0.0.1:9");
    assert_eq!(
        listed.lines().collect::<Vec<_>>(),
        [
            "data/ts_day=20240601/c.parquet",
            "data/ts_day=20240602/b.parquet"
        ]
    );
    let full = ferry_ok(&["lake", "files", &url, "--full"], "http://127.0.0.1:9");
    let base = dir.path().join("events");
    assert_eq!(
        full.lines().next(),
        Some(
            base.join("data/ts_day=20240601/c.parquet")
                .to_string_lossy()
                .as_ref()
        )
    );
    let json: serde_json::Value = serde_json::from_str(&ferry_ok(
        &["lake", "files", &url, "--json"],
        "http://127.0.0.1:9",
    ))
    .expect("json");
    assert_eq!(json["format"], "iceberg");
    assert_eq!(json["metadata_version"], 3);
    let rows: i64 = json["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| f["rows"].as_i64().expect("rows"))
        .sum();
    assert_eq!(rows, 6, "{json}");
    let one = ferry_ok(
        &["lake", "files", &url, "--partition", "20240601"],
        "http://127.0.0.1:9",
    );
    assert_eq!(one.trim(), "data/ts_day=20240601/c.parquet");

    let verified = ferry_ok(&["verify", &url], "http://127.0.0.1:9");
    assert!(
        verified.contains("metadata version 3")
            && verified.contains("2 data files checked, 6 rows"),
        "{verified}"
    );
    assert!(!verified.contains("orphan"), "{verified}");
    // Every snapshot but the current one expires: c.parquet replaced
    // a.parquet, which becomes an orphan; what a reader reads is unchanged.
    let expired = ferry_ok(
        &["lake", "expire-snapshots", &url, "--older-than", "1h"],
        "http://127.0.0.1:9",
    );
    assert!(
        expired.contains("2 snapshots expired, metadata version 4"),
        "{expired}"
    );
    assert_eq!(
        ferry_ok(&["lake", "files", &url], "http://127.0.0.1:9"),
        listed
    );
    let verified = ferry_ok(&["verify", &url], "http://127.0.0.1:9");
    assert!(
        verified.contains("orphan (no snapshot references it; readers never see it): data/ts_day=20240601/a.parquet"),
        "{verified}"
    );
    // A file no snapshot references: an orphan, not a mismatch.
    let data = base.join("data");
    std::fs::write(data.join("ts_day=20240601/stray.parquet"), b"PAR1").expect("stray");
    let verified = ferry_ok(&["verify", &url], "http://127.0.0.1:9");
    assert!(
        verified.contains("orphan (no snapshot references it; readers never see it): data/ts_day=20240601/stray.parquet"),
        "{verified}"
    );
    // A live file replaced by other bytes: a mismatch, and exit 1.
    std::fs::write(
        data.join("ts_day=20240602/b.parquet"),
        b"not a parquet file",
    )
    .expect("tamper");
    let (ok, out, _) = ferry(&["verify", &url], "http://127.0.0.1:9");
    assert!(!ok, "{out}");
    assert!(
        out.contains("MISMATCH data/ts_day=20240602/b.parquet"),
        "{out}"
    );

    // Upkeep: an orphan older than the cut-off goes (a.parquet, dated back),
    // a recent one stays (the stray file), and what a reader reads is
    // unchanged.
    let touched = std::process::Command::new("touch")
        .args(["-d", "2000-01-01"])
        .arg(data.join("ts_day=20240601/a.parquet"))
        .status()
        .expect("touch");
    assert!(touched.success());
    let removed = ferry_ok(
        &["lake", "remove-orphans", &url, "--older-than", "1h"],
        "http://127.0.0.1:9",
    );
    assert!(
        removed.contains("removed data/ts_day=20240601/a.parquet")
            && removed.contains("1 orphan data files removed, 1 newer than the cut-off kept"),
        "{removed}"
    );
    assert!(!data.join("ts_day=20240601/a.parquet").exists());
    assert!(data.join("ts_day=20240601/stray.parquet").exists());
    assert_eq!(
        ferry_ok(&["lake", "files", &url], "http://127.0.0.1:9"),
        listed
    );
}
