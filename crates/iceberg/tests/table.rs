//! An Iceberg table committed partition by partition on a local folder:
//! overwrites, identity, races; and read back as lake readers read it
//! (pyiceberg and DuckDB, from the test venv `scripts/test.sh` makes).

use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use bytes::Bytes;
use ferry_iceberg::{encode_data_file, Commit, CommitOutcome, IcebergTable, PartitionValue};
use ferry_storage::{open, Location, S3Settings};
use ferry_table::TableDef;
use ferry_testkit::table::TableToml;

fn def() -> TableDef {
    TableToml::new("events", ("ts", "month"), ("user_id", 2))
        .column("ts", "Timestamp")
        .column("user_id", "Int64")
        .nullable("note", "Utf8")
        .def()
}

/// Rows of one month: `n` users from `first`, at noon on the 1st + i days.
fn rows(def: &TableDef, month: &str, first: i64, n: i64) -> RecordBatch {
    let (y, m): (i64, i64) = (
        month[..4].parse().expect("year"),
        month[4..].parse().expect("month"),
    );
    // Days since 1970 of the 1st of the month (good enough for 1970..2100).
    let days = (y - 1970) * 365
        + (y - 1969) / 4
        + [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(m - 1) as usize]
        + i64::from(m > 2 && y % 4 == 0);
    let ts: Vec<i64> = (0..n)
        .map(|i| (days + i % 28) * 86_400_000_000 + 43_200_000_000)
        .collect();
    let users: Vec<i64> = (first..first + n).collect();
    let notes: Vec<Option<String>> = (0..n)
        .map(|i| (i % 3 != 0).then(|| format!("note {}", first + i)))
        .collect();
    RecordBatch::try_new(
        def.arrow_schema(),
        vec![
            Arc::new(TimestampMicrosecondArray::from(ts).with_timezone("+00:00")) as ArrayRef,
            Arc::new(Int64Array::from(users)),
            Arc::new(StringArray::from(notes)),
        ],
    )
    .expect("batch")
}

async fn put_file(
    loc: &Location,
    def: &TableDef,
    month: &str,
    name: &str,
    batch: RecordBatch,
) -> ferry_iceberg::DataFileEntry {
    let encoded = encode_data_file(
        def,
        PartitionValue::of(def, month).expect("partition"),
        &[batch],
    )
    .expect("encode");
    let key = format!("data/ts_month={month}/{name}.parquet");
    loc.put_create(&key, Bytes::from(encoded.bytes))
        .await
        .expect("data file");
    ferry_iceberg::DataFileEntry {
        path: key,
        ..encoded.entry
    }
}

/// The export `tx` (`<create time>-<name>`) of `month`, the `sequence`th
/// of the partition.
fn commit(
    tx: &str,
    sequence: u64,
    month: &str,
    files: Vec<ferry_iceberg::DataFileEntry>,
) -> Commit {
    Commit {
        transaction_id: tx.into(),
        sequence,
        create_time: tx
            .split('-')
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or(0),
        content_id: format!("content-{tx}"),
        snapshot_lsn: 0,
        partition_id: month.into(),
        files,
        timestamp_ms: 1_700_000_000_000,
    }
}

async fn local_table() -> (tempfile::TempDir, Location) {
    let dir = tempfile::tempdir().expect("tempdir");
    let loc = open(
        &format!("file://{}/events", dir.path().display()),
        &S3Settings::default(),
    )
    .expect("location");
    (dir, loc)
}

#[tokio::test]
async fn a_re_export_replaces_its_partition_and_retries_change_nothing() {
    let def = def();
    let (_dir, loc) = local_table().await;
    let table = IcebergTable::new(loc.clone());
    assert!(table.current().await.expect("read").is_none());

    let june = put_file(&loc, &def, "202406", "a", rows(&def, "202406", 0, 5)).await;
    let out = table
        .commit(&def, &commit("1000-a", 1, "202406", vec![june]))
        .await
        .expect("commit");
    assert!(
        matches!(out, CommitOutcome::Committed { version: 1, .. }),
        "{out:?}"
    );
    let july = put_file(&loc, &def, "202407", "b", rows(&def, "202407", 100, 3)).await;
    let out = table
        .commit(&def, &commit("1001-b", 1, "202407", vec![july]))
        .await
        .expect("commit");
    assert!(
        matches!(out, CommitOutcome::Committed { version: 2, .. }),
        "{out:?}"
    );

    // June exported again, as two files: its old file goes in the same
    // snapshot.
    let j1 = put_file(&loc, &def, "202406", "c1", rows(&def, "202406", 0, 4)).await;
    let j2 = put_file(&loc, &def, "202406", "c2", rows(&def, "202406", 4, 3)).await;
    let out = table
        .commit(&def, &commit("1002-c", 2, "202406", vec![j1, j2]))
        .await
        .expect("commit");
    assert!(
        matches!(out, CommitOutcome::Committed { version: 3, .. }),
        "{out:?}"
    );
    let mut files: Vec<(String, i64)> = table
        .files()
        .await
        .expect("files")
        .into_iter()
        .map(|f| {
            (
                f.path.rsplit('/').next().unwrap_or_default().to_string(),
                f.record_count,
            )
        })
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            ("b.parquet".to_string(), 3),
            ("c1.parquet".to_string(), 4),
            ("c2.parquet".to_string(), 3)
        ]
    );

    // The same export again: nothing written. An older one arriving late:
    // nothing written either, the reader keeps the newer content.
    let out = table
        .commit(&def, &commit("1002-c", 2, "202406", Vec::new()))
        .await
        .expect("retry");
    assert_eq!(out, CommitOutcome::AlreadyCurrent { version: 3 });
    let out = table
        .commit(&def, &commit("1000-a", 1, "202406", Vec::new()))
        .await
        .expect("late");
    assert_eq!(
        out,
        CommitOutcome::Superseded {
            version: 3,
            current: "1002-c".into()
        }
    );
    let (version, meta) = table.current().await.expect("read").expect("table");
    assert_eq!(version, 3);
    assert_eq!(meta.snapshots.len(), 3);
    let summary = &meta.current_snapshot().expect("snapshot").summary;
    assert_eq!(
        summary.get("operation").map(String::as_str),
        Some("overwrite")
    );
    assert_eq!(
        summary
            .get(ferry_iceberg::TRANSACTION_PROPERTY)
            .map(String::as_str),
        Some("1002-c")
    );
    assert_eq!(
        loc.get("metadata/version-hint.text").await.expect("hint"),
        Bytes::from_static(b"3")
    );
    read_with_lake_readers(&loc, &[("202406", 7), ("202407", 3)]);

    // A hint a slower writer left behind: the newest version is found from
    // it, and the next commit lands after it.
    loc.put("metadata/version-hint.text", Bytes::from_static(b"1"))
        .await
        .expect("put");
    let out = table
        .commit(&def, &commit("1003-e", 3, "202407", Vec::new()))
        .await
        .expect("commit");
    assert!(
        matches!(out, CommitOutcome::Committed { version: 4, .. }),
        "{out:?}"
    );
    // A metadata file named past any version a table reaches, found by a
    // listing (no hint to start from): a clear error, nothing written.
    loc.delete("metadata/version-hint.text")
        .await
        .expect("delete the hint");
    loc.put_create(
        "metadata/v18446744073709551615.metadata.json",
        Bytes::from_static(b"{}"),
    )
    .await
    .expect("put");
    let e = table
        .commit(&def, &commit("1003-d", 3, "202406", Vec::new()))
        .await
        .expect_err("refused");
    assert!(e.to_string().contains("version number above"), "{e}");
}

#[tokio::test]
async fn racing_commits_each_get_a_version_of_their_own() {
    let def = def();
    let (_dir, loc) = local_table().await;
    let mut commits = Vec::new();
    for (i, month) in ["202401", "202402", "202403", "202404"].iter().enumerate() {
        let f = put_file(&loc, &def, month, "x", rows(&def, month, i as i64 * 10, 2)).await;
        commits.push(commit(&format!("100{i}-r"), 1, month, vec![f]));
    }
    let table = IcebergTable::new(loc.clone());
    let versions = commit_racing(&table, &def, &commits).await;
    assert_eq!(versions, [1, 2, 3, 4]);
    assert_eq!(table.files().await.expect("files").len(), 4);
    read_with_lake_readers(
        &loc,
        &[("202401", 2), ("202402", 2), ("202403", 2), ("202404", 2)],
    );
}

/// Commits through one node's queue, all at once: every one lands, in
/// fewer versions than commits (those waiting share the next version, a
/// snapshot each), every partition's files are current once, and a commit
/// queued again (a retry) changes nothing.
#[tokio::test]
async fn queued_commits_share_versions_and_each_lands_once() {
    let def = def();
    let (_dir, loc) = local_table().await;
    let months: Vec<String> = (1..=12).map(|m| format!("2023{m:02}")).collect();
    let mut commits = Vec::new();
    for (i, month) in months.iter().enumerate() {
        let f = put_file(&loc, &def, month, "q", rows(&def, month, i as i64 * 10, 3)).await;
        commits.push(commit(&format!("200{i:02}-q"), 1, month, vec![f]));
    }
    let table = IcebergTable::new(loc.clone());
    let queue = std::sync::Arc::new(ferry_iceberg::CommitQueue::new());
    let mut running = Vec::new();
    for c in commits.clone() {
        let (queue, table, def) = (std::sync::Arc::clone(&queue), table.clone(), def.clone());
        running.push(tokio::spawn(
            async move { queue.commit(&table, &def, c).await },
        ));
    }
    for r in running {
        let out = r.await.expect("task").expect("commit");
        assert!(matches!(out, CommitOutcome::Committed { .. }), "{out:?}");
    }
    let (version, meta) = table.current().await.expect("read").expect("a table");
    assert!(version < 12, "12 commits took {version} versions");
    assert_eq!(meta.snapshots.len(), 12);
    let committed: std::collections::BTreeSet<&str> = meta
        .snapshots
        .iter()
        .filter_map(|s| s.summary.get(ferry_iceberg::TRANSACTION_PROPERTY))
        .map(String::as_str)
        .collect();
    assert_eq!(committed.len(), 12);
    assert_eq!(table.files().await.expect("files").len(), 12);
    let again = queue
        .commit(&table, &def, commits[3].clone())
        .await
        .expect("retry");
    assert_eq!(again, CommitOutcome::AlreadyCurrent { version });
    let expected: Vec<(&str, i64)> = months.iter().map(|m| (m.as_str(), 3)).collect();
    read_with_lake_readers(&loc, &expected);
}

/// On S3 (moto): commits get one version each, an overwrite replaces its
/// partition, and pyiceberg reads the table from the bucket. The commits do
/// not race here: moto does not make concurrent create-only puts atomic
/// (two racing `If-None-Match: *` puts of one key both succeed now and
/// then, which S3 itself never lets happen), so races are tested on local
/// folders, whose create-only writes are atomic.
#[tokio::test]
async fn on_s3_commits_get_a_version_each_and_pyiceberg_reads_the_table() {
    use ferry_testkit::services::{create_bucket, s3_endpoint, s3_settings};
    let Some(endpoint) = s3_endpoint() else {
        return;
    };
    let bucket = format!("ferry-iceberg-{}", std::process::id());
    create_bucket(&endpoint, &bucket).await;
    let loc = open(
        &format!("s3://{bucket}/lake/events"),
        &s3_settings(&endpoint),
    )
    .expect("s3 location");
    let def = def();
    let mut commits = Vec::new();
    for (i, month) in ["202401", "202402", "202403"].iter().enumerate() {
        let f = put_file(&loc, &def, month, "x", rows(&def, month, i as i64 * 10, 2)).await;
        commits.push(commit(&format!("100{i}-s"), 1, month, vec![f]));
    }
    let table = IcebergTable::new(loc.clone());
    let mut versions = Vec::new();
    for c in &commits {
        match table.commit(&def, c).await.expect("commit") {
            CommitOutcome::Committed { version, .. } => versions.push(version),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(versions, [1, 2, 3]);
    let again = put_file(&loc, &def, "202402", "y", rows(&def, "202402", 50, 5)).await;
    let out = table
        .commit(&def, &commit("1009-s", 2, "202402", vec![again]))
        .await
        .expect("overwrite");
    assert!(
        matches!(out, CommitOutcome::Committed { version: 4, .. }),
        "{out:?}"
    );
    assert_eq!(table.files().await.expect("files").len(), 3);
    let Some(python) = ferry_testkit::services::lake_python() else {
        return;
    };
    let script = r#"
import json, sys
from pyiceberg.table import StaticTable
import pyarrow.compute as pc
meta, endpoint = sys.argv[1], sys.argv[2]
t = StaticTable.from_metadata(meta, properties={
    "s3.endpoint": endpoint, "s3.access-key-id": "test",
    "s3.secret-access-key": "test", "s3.region": "us-east-1"})
out = {}
for m in pc.strftime(t.scan().to_arrow()["ts"], format="%Y%m").to_pylist():
    out[m] = out.get(m, 0) + 1
print(json.dumps(out))
"#;
    let meta = format!("s3://{bucket}/lake/events/metadata/v4.metadata.json");
    let out = std::process::Command::new(&python)
        .args(["-c", script, &meta, &endpoint])
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "pyiceberg failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("answer");
    assert_eq!(
        got,
        serde_json::json!({"202401": 2, "202402": 5, "202403": 2})
    );
}

/// Snapshots expire but the commit identity stays: a retried export is
/// still a no-op afterwards, an older one still superseded, and readers read
/// the same rows.
#[tokio::test]
async fn expired_snapshots_keep_the_commit_identity() {
    let def = def();
    let (_dir, loc) = local_table().await;
    let table = IcebergTable::new(loc.clone());
    for (i, (tx, seq, name, first, n)) in [
        ("1000-a", 1, "a", 0, 5),
        ("1001-b", 2, "b", 0, 6),
        ("1002-c", 3, "c", 0, 7),
    ]
    .into_iter()
    .enumerate()
    {
        let f = put_file(&loc, &def, "202406", name, rows(&def, "202406", first, n)).await;
        let mut c = commit(tx, seq, "202406", vec![f]);
        c.timestamp_ms = 1_000 * (i as i64 + 1);
        table.commit(&def, &c).await.expect("commit");
    }
    let out = table.expire_snapshots(3_000, 9_000).await.expect("expire");
    assert_eq!(
        out,
        ferry_iceberg::ExpireOutcome::Expired {
            version: 4,
            expired: 2
        }
    );
    assert_eq!(
        table.expire_snapshots(3_000, 9_000).await.expect("again"),
        ferry_iceberg::ExpireOutcome::Nothing { version: 4 }
    );
    let (_, meta) = table.current().await.expect("read").expect("table");
    assert_eq!(meta.snapshots.len(), 1);
    for (tx, seq) in [("1002-c", 3), ("1001-b", 2)] {
        let out = table
            .commit(&def, &commit(tx, seq, "202406", Vec::new()))
            .await
            .expect("retry");
        assert!(
            matches!(
                out,
                CommitOutcome::AlreadyCurrent { version: 4 }
                    | CommitOutcome::Superseded { version: 4, .. }
            ),
            "{tx}: {out:?}"
        );
    }
    let report = ferry_iceberg::verify::verify(&table)
        .await
        .expect("verify")
        .expect("table");
    assert!(report.ok(), "{report:?}");
    assert_eq!(report.rows, 7);
    assert_eq!(
        report.orphans,
        [
            "data/ts_month=202406/a.parquet",
            "data/ts_month=202406/b.parquet"
        ]
    );
    // Orphans newer than the cut-off stay; older ones go; the table reads
    // the same.
    let kept = table.remove_orphans(0).await.expect("remove");
    assert_eq!((kept.removed.len(), kept.recent), (0, 2));
    let gone = table.remove_orphans(i64::MAX).await.expect("remove");
    assert_eq!(gone.removed.len(), 2);
    let report = ferry_iceberg::verify::verify(&table)
        .await
        .expect("verify")
        .expect("table");
    assert!(report.ok() && report.orphans.is_empty(), "{report:?}");
    read_with_lake_readers(&loc, &[("202406", 7)]);
}

/// Commits all at once (interleaved on one runtime: each reads the same
/// current version, one wins it, the others retry); the versions they got,
/// sorted.
async fn commit_racing(table: &IcebergTable, def: &TableDef, commits: &[Commit]) -> Vec<u64> {
    let results = futures::future::join_all(commits.iter().map(|c| table.commit(def, c))).await;
    let mut versions: Vec<u64> = results
        .into_iter()
        .map(|r| match r.expect("commit") {
            CommitOutcome::Committed { version, .. } => version,
            other => panic!("{other:?}"),
        })
        .collect();
    versions.sort();
    versions
}

/// Reads the table's current version with pyiceberg and DuckDB when the test
/// venv has them (`FERRY_TEST_PYTHON`, set by `scripts/test.sh`), and
/// checks the rows per partition month.
fn read_with_lake_readers(loc: &Location, expected: &[(&str, i64)]) {
    let Some(python) = ferry_testkit::services::lake_python() else {
        return;
    };
    let root = loc.url().trim_start_matches("file://").to_string();
    let script = r#"
import json, os, sys
root = sys.argv[1]
hint = open(os.path.join(root, "metadata", "version-hint.text")).read().strip()
meta = os.path.join(root, "metadata", f"v{hint}.metadata.json")
from pyiceberg.table import StaticTable
t = StaticTable.from_metadata(meta)
import pyarrow.compute as pc
py = {}
for m in pc.strftime(t.scan().to_arrow()["ts"], format="%Y%m").to_pylist():
    py[m] = py.get(m, 0) + 1
import duckdb, duckdb_ext
con = duckdb.connect()
con.execute(f"SET extension_directory = '{duckdb_ext.get_extension_dir()}'")
con.execute("SET autoinstall_known_extensions = false")
con.execute("LOAD avro")
con.execute("LOAD iceberg")
rows = con.execute(f"SELECT strftime(ts, '%Y%m') AS m, count(*) FROM iceberg_scan('{meta}') GROUP BY m").fetchall()
dk = {m: int(n) for m, n in rows}
print(json.dumps({"pyiceberg": py, "duckdb": dk}))
"#;
    let out = std::process::Command::new(&python)
        .args(["-c", script, &root])
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "lake readers failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("readers' answer");
    for reader in ["pyiceberg", "duckdb"] {
        for (month, n) in expected {
            assert_eq!(got[reader][month].as_i64(), Some(*n), "{reader}: {got}");
        }
        assert_eq!(
            got[reader].as_object().map(|o| o.len()),
            Some(expected.len()),
            "{reader}: {got}"
        );
    }
}
