//! Export against the real services: ZooKeeper (`FERRY_TEST_ZK`) for
//! coordination and the S3 server (`FERRY_TEST_S3_ENDPOINT`, moto) as the
//! destination. Three nodes share two exports of one partition to two
//! destinations while one node's exporter is killed mid-export and started
//! again; both end with exactly one commit file, verified. Skipped (and said
//! so) without the services, unless `FERRY_TEST_REQUIRE_SERVICES=1`.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use ferry_coord::zk::ZkOptions;
use ferry_coord::{CoordMetrics, Coordination, CreateMode, SessionFactory, ZkSessions};
use ferry_env::{Cpu, Disk, RealDisk, SystemClock};
use ferry_export::model::ExportSettings;
use ferry_export::{
    Destinations, ExportRequest, Exporter, ExporterConfig, ExportsView, ReplicaSet, Requester,
    StorageDestinations, TaskStatus,
};
use ferry_replica::{Replica, SharedReplica, TableRef, Tables, ALL_SHARDS};
use ferry_storage::S3Settings;
use ferry_table::{Table, TableDef};
use ferry_wal::record::Record;
use ferry_wal::Lsn;

fn service(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var("FERRY_TEST_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "{var} is not set but services are required"
            );
            use std::io::Write as _;
            let test = std::thread::current()
                .name()
                .unwrap_or("a test")
                .to_string();
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: {var} is not set: this test did not run (scripts/test.sh runs it)"
            );
            None
        }
    }
}

fn table() -> Table {
    Table {
        id: 1,
        def: TableDef::from_toml(
            r#"name = "t"
partition_by = { column = "p", transform = "identity" }
shard_by = { column = "id", shards = 2 }
[[columns]]
name = "id"
type = "Int64"
[[columns]]
name = "p"
type = "Utf8"
"#,
        )
        .expect("table"),
    }
}

struct OneTable;

#[async_trait]
impl Tables for OneTable {
    async fn by_id(&self, id: u64) -> Result<TableRef, String> {
        Ok(if id == 1 {
            TableRef::Known(table())
        } else {
            TableRef::Unknown
        })
    }
}

/// Creates a bucket with a plain unsigned request, which moto accepts.
async fn create_bucket(endpoint: &str, bucket: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(host)
        .await
        .expect("connect to S3");
    let request = format!(
        "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    conn.read_to_string(&mut response).await.expect("read");
    assert!(
        response.starts_with("HTTP/1.1 200"),
        "create bucket: {response}"
    );
}

async fn wait_terminal(
    view: &mut tokio::sync::watch::Receiver<ExportsView>,
    tx: &str,
) -> ferry_export::TaskView {
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(t) = view
                .borrow_and_update()
                .tasks
                .iter()
                .find(|t| t.transaction_id == tx && t.status.is_terminal())
            {
                return t.clone();
            }
            view.changed().await.expect("exporter running");
        }
    })
    .await
    .expect("the export ends in time")
}

#[tokio::test]
async fn three_nodes_share_exports_on_zookeeper_to_s3_through_a_killed_exporter() {
    let (Some(zk), Some(s3)) = (service("FERRY_TEST_ZK"), service("FERRY_TEST_S3_ENDPOINT")) else {
        return;
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    // Coordination in a fresh chroot.
    let root = ferry_coord::zk::ZkSession::connect(&ZkOptions::new(zk.clone()))
        .await
        .expect("zookeeper");
    let chroot = format!("/export-test-{}-{nanos}", std::process::id());
    ferry_coord::create_all(&root, &chroot)
        .await
        .expect("chroot");
    root.close().await;
    let sessions: Arc<dyn SessionFactory> = Arc::new(ZkSessions {
        options: ZkOptions::new(format!("{zk}{chroot}")),
        metrics: Arc::new(CoordMetrics::default()),
    });
    let session = sessions.open().await.expect("session");
    ferry_coord::create_all(session.as_ref(), "/ferry/tables")
        .await
        .expect("root");
    session
        .create(
            "/ferry/tables/t",
            &serde_json::to_vec(&table()).expect("json"),
            CreateMode::Persistent,
        )
        .await
        .expect("table");
    // The destination bucket.
    let bucket = format!("ferry-export-{nanos}");
    create_bucket(&s3, &bucket).await;
    let settings = S3Settings {
        endpoint: Some(s3.clone()),
        region: Some("us-east-1".into()),
        access_key_id: Some("test".into()),
        secret_access_key: Some("test".into()),
        session_token: None,
    };
    let destinations: Arc<dyn Destinations> = Arc::new(StorageDestinations::new(settings.clone()));

    // Three nodes with the same parts: 30 inserts, partitions a and b.
    let mut wal = BytesMut::new();
    for i in 0..30i64 {
        let ids = i * 100..(i + 1) * 100;
        let batch = RecordBatch::try_new(
            table().def.arrow_schema(),
            vec![
                Arc::new(Int64Array::from_iter_values(ids.clone())),
                Arc::new(StringArray::from_iter_values(ids.map(|x| {
                    if x % 2 == 0 {
                        "a"
                    } else {
                        "b"
                    }
                }))),
            ],
        )
        .expect("batch");
        let at = wal.len() as u64;
        Record::Insert {
            table_id: 1,
            shard: (i % 2) as u32,
            block_number: at,
            idempotency_key: Bytes::new(),
            arrow_ipc: ferry_table::rows::to_ipc(&batch).expect("ipc"),
        }
        .encode(&mut wal);
    }
    let end = Lsn(wal.len() as u64);
    let dir = tempfile::tempdir().expect("tempdir");
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
    let mut parts = Vec::new();
    for n in 0..3 {
        let mut r = Replica::open(
            Arc::clone(&disk),
            &format!("r{n}"),
            ALL_SHARDS,
            n,
            Cpu::Inline,
            Arc::new(OneTable),
        )
        .await
        .expect("replica");
        r.receive(Lsn(0), &wal).await.expect("apply");
        let shared: SharedReplica = Arc::new(tokio::sync::Mutex::new(r));
        parts.push(Arc::new(ReplicaSet::new(vec![shared])));
    }
    let start = |n: usize| {
        let mut config = ExporterConfig::new(format!("node{n}"));
        config.tick = Duration::from_millis(50);
        config.cleanup_interval = Duration::from_millis(300);
        let exporter = Exporter::new(
            config,
            Arc::clone(&sessions),
            Arc::new(SystemClock),
            Cpu::Inline,
            Arc::clone(&parts[n]) as _,
            Arc::clone(&destinations),
        );
        let view = exporter.subscribe();
        (view, tokio::spawn(exporter.run()))
    };
    let mut nodes: Vec<_> = (0..3).map(start).collect();

    // Two destinations for one partition: two tasks.
    let urls = [format!("s3://{bucket}/one"), format!("s3://{bucket}/two")];
    let mut txs = Vec::new();
    for url in &urls {
        let created = Requester {
            session: &session,
            sessions: sessions.as_ref(),
            parts: parts[0].as_ref(),
            destinations: destinations.as_ref(),
            replica_name: "node0",
            now_unix_millis: ferry_env::Clock::unix_micros(&SystemClock) / 1000,
            random: nanos as u64 ^ txs.len() as u64,
            commit_lsn: end,
            wait: Duration::from_secs(10),
        }
        .export(&ExportRequest {
            table: "t".into(),
            partition_id: "a".into(),
            destination: url.clone(),
            force: false,
            settings: ExportSettings {
                parallelism: 1,
                retry_initial_backoff_ms: 100,
                retry_max_backoff_ms: 500,
                ..ExportSettings::default()
            },
        })
        .await
        .expect("export created");
        txs.push(created);
    }
    // Node 1's exporter dies at once (its session with it) and comes back.
    nodes[1].1.abort();
    let _ = (&mut nodes[1].1).await;
    nodes[1] = start(1);
    for (url, created) in urls.iter().zip(&txs) {
        let done = wait_terminal(&mut nodes[0].0, &created.transaction_id).await;
        assert_eq!(done.status, TaskStatus::Completed, "{done:?}");
        let loc = ferry_storage::open(url, &settings).expect("location");
        let report = ferry_export::verify::verify(&loc, true)
            .await
            .expect("verify");
        assert!(report.ok(), "{report:?}");
        assert!(report.orphans.is_empty(), "{report:?}");
        assert_eq!(report.commits.len(), 1, "{report:?}");
        assert_eq!(report.files_checked as u64, created.parts_count);
        assert_eq!(report.rows, created.rows);
    }
    for (_, task) in nodes {
        task.abort();
    }
    session.close().await;
}
