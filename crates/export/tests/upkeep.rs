//! Upkeep of a Parquet destination on a local folder: superseded commits
//! expire by when they were superseded, never a current one; orphans go
//! once old, never a file some commit lists (an increment's carried file
//! included). Of an Iceberg destination: the shards files of exports no
//! partition holds any more go once old, never a current export's.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // a real temp dir

use bytes::Bytes;
use ferry_export::model::{commit_key, CommitFile, DataFile, COMMIT_FORMAT};
use ferry_export::upkeep::{expire_commits, remove_orphans};
use ferry_storage::Location;

fn data_file(path: &str) -> DataFile {
    DataFile {
        path: path.into(),
        rows: 1,
        bytes: 3,
        checksum: 0,
        shard: None,
        crc32c: None,
        iceberg: None,
    }
}

async fn commit(
    loc: &Location,
    partition: &str,
    tx: &str,
    sequence: u64,
    created: u64,
    files: &[&str],
) {
    let file = CommitFile {
        format: COMMIT_FORMAT,
        transaction_id: tx.into(),
        table: "t".into(),
        partition_id: partition.into(),
        create_time: created,
        rows: files.len() as u64,
        files: files.iter().map(|f| data_file(f)).collect(),
        columns: Vec::new(),
        sequence,
        snapshot_lsn: 0,
        content_id: String::new(),
    };
    loc.put(
        &commit_key(partition, tx),
        Bytes::from(serde_json::to_vec(&file).expect("json")),
    )
    .await
    .expect("put commit");
}

async fn keys(loc: &Location) -> Vec<String> {
    loc.list("")
        .await
        .expect("list")
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

#[tokio::test]
async fn superseded_commits_expire_by_their_successor_and_orphans_only_when_old() {
    let dir = tempfile::tempdir().expect("tempdir");
    let loc = ferry_storage::open(
        &format!("file://{}", dir.path().display()),
        &ferry_storage::S3Settings::default(),
    )
    .expect("location");
    for f in [
        "p=a/a_1_1_0_00000001.parquet",
        "p=a/a_2_2_0_00000002.parquet",
        "p=a/a_1_2_1_00000003.parquet",
        "p=b/b_5_5_0_00000004.parquet",
    ] {
        loc.put(f, Bytes::from_static(b"PAR")).await.expect("put");
    }
    // Partition a: three commits, superseded at 200 and at 300; b: one.
    commit(
        &loc,
        "a",
        "0000000000100-0000000000000001",
        1,
        100,
        &["p=a/a_1_1_0_00000001.parquet"],
    )
    .await;
    commit(
        &loc,
        "a",
        "0000000000200-0000000000000002",
        2,
        200,
        &[
            "p=a/a_1_1_0_00000001.parquet",
            "p=a/a_2_2_0_00000002.parquet",
        ],
    )
    .await;
    commit(
        &loc,
        "a",
        "0000000000300-0000000000000003",
        3,
        300,
        &["p=a/a_1_2_1_00000003.parquet"],
    )
    .await;
    commit(
        &loc,
        "b",
        "0000000000100-0000000000000004",
        1,
        100,
        &["p=b/b_5_5_0_00000004.parquet"],
    )
    .await;

    // At 250 only the first commit of a was superseded (at 200).
    let out = expire_commits(&loc, 250).await.expect("expire");
    assert_eq!(
        out.removed,
        vec![commit_key("a", "0000000000100-0000000000000001")]
    );
    assert_eq!(out.kept, 1);
    // Far later: every superseded commit, never a current one.
    let out = expire_commits(&loc, u64::MAX).await.expect("expire");
    assert_eq!(
        out.removed,
        vec![commit_key("a", "0000000000200-0000000000000002")]
    );
    let left: Vec<String> = keys(&loc)
        .await
        .into_iter()
        .filter(|k| k.starts_with("commit_"))
        .collect();
    assert_eq!(
        left,
        vec![
            commit_key("a", "0000000000300-0000000000000003"),
            commit_key("b", "0000000000100-0000000000000004")
        ]
    );
    let view = ferry_export::lake::read(&loc, None).await.expect("read");
    assert_eq!(
        view.partitions.len(),
        2,
        "each partition keeps its current commit"
    );

    // Orphans: the two level-0 files of a. Too recent: kept.
    let out = remove_orphans(&loc, 0).await.expect("orphans");
    assert!(out.removed.is_empty());
    assert_eq!(out.recent, 2);
    // A commit lands listing one of them again (an increment carrying it):
    // it stays; the other goes.
    commit(
        &loc,
        "a",
        "0000000000400-0000000000000005",
        4,
        400,
        &[
            "p=a/a_1_2_1_00000003.parquet",
            "p=a/a_1_1_0_00000001.parquet",
        ],
    )
    .await;
    let out = remove_orphans(&loc, i64::MAX).await.expect("orphans");
    assert_eq!(
        out.removed,
        vec!["p=a/a_2_2_0_00000002.parquet".to_string()]
    );
    let files: Vec<String> = keys(&loc)
        .await
        .into_iter()
        .filter(|k| k.ends_with(".parquet"))
        .collect();
    assert_eq!(
        files,
        vec![
            "p=a/a_1_1_0_00000001.parquet",
            "p=a/a_1_2_1_00000003.parquet",
            "p=b/b_5_5_0_00000004.parquet"
        ]
    );
    let view = ferry_export::lake::read(&loc, Some("a"))
        .await
        .expect("read");
    assert_eq!(view.partitions[0].current.file.sequence, 4);
}

#[tokio::test]
async fn an_iceberg_destination_keeps_the_shards_of_current_exports_only() {
    use ferry_export::lake::iceberg_shards_key;
    use ferry_export::upkeep::remove_superseded_shards;
    let dir = tempfile::tempdir().expect("tempdir");
    let loc = ferry_storage::open(
        &format!("file://{}/t", dir.path().display()),
        &Default::default(),
    )
    .expect("location");
    let def = ferry_testkit::table::TableToml::new("t", ("p", "identity"), ("id", 1))
        .column("id", "Int64")
        .column("p", "Utf8")
        .def();
    let table = ferry_iceberg::IcebergTable::new(loc.clone());
    // Partition a: export 1 then 2 (1 superseded); partition b: export 3.
    for (tx, sequence, partition) in [
        ("1000-one", 1, "a"),
        ("1001-two", 2, "a"),
        ("1002-three", 1, "b"),
    ] {
        let commit = ferry_iceberg::Commit {
            transaction_id: tx.into(),
            sequence,
            create_time: 1000,
            content_id: format!("content-{tx}"),
            snapshot_lsn: 0,
            partition_id: partition.into(),
            files: Vec::new(),
            timestamp_ms: 1_700_000_000_000,
        };
        table.commit(&def, &commit).await.expect("commit");
        loc.put(&iceberg_shards_key(tx), Bytes::from_static(b"{}"))
            .await
            .expect("shards");
    }
    // An export in flight: its shards are written before its commit.
    loc.put(&iceberg_shards_key("1003-four"), Bytes::from_static(b"{}"))
        .await
        .expect("shards");
    let shards = |keys: Vec<String>| -> Vec<String> {
        keys.into_iter()
            .filter(|k| k.contains("ferry-shards-"))
            .collect()
    };
    let all = shards(keys(&loc).await);
    assert_eq!(all.len(), 4);
    // Nothing is old enough yet.
    assert_eq!(remove_superseded_shards(&loc, 0).await.expect("upkeep"), 0);
    assert_eq!(shards(keys(&loc).await), all);
    // Once old: the superseded export's and the one that never landed go.
    assert_eq!(
        remove_superseded_shards(&loc, i64::MAX)
            .await
            .expect("upkeep"),
        2
    );
    assert_eq!(
        shards(keys(&loc).await),
        vec![
            iceberg_shards_key("1001-two"),
            iceberg_shards_key("1002-three")
        ]
    );
}
