//! Export end to end on the embedded coordination store and a local folder:
//! replicas sharing one export, kill, force, and a destination that fails.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use ferry_coord::embedded::EmbeddedStore;
use ferry_coord::{CoordMetrics, CreateMode, EmbeddedSessions, Session, SessionFactory};
use ferry_env::{Cpu, Disk, RealDisk, SystemClock};
use ferry_export::model::{CommitFile, ExportSettings};
use ferry_export::{
    Destinations, ExportRequest, Exporter, ExporterConfig, ExportsView, ReplicaSet, Requester,
    StorageDestinations, TaskStatus,
};
use ferry_replica::{Replica, SharedReplica, TableRef, Tables, ALL_SHARDS};
use ferry_table::{Table, TableDef};
use ferry_wal::record::Record;
use ferry_wal::Lsn;
use tokio::sync::watch;

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

struct FixedTables;

#[async_trait]
impl Tables for FixedTables {
    async fn by_id(&self, id: u64) -> Result<TableRef, String> {
        Ok(if id == 1 {
            TableRef::Known(table())
        } else {
            TableRef::Unknown
        })
    }
}

/// WAL of `inserts` records of `rows` rows each, partitions "a" and "b".
fn wal(inserts: i64, rows: i64) -> (Bytes, Lsn) {
    let mut bytes = BytesMut::new();
    for i in 0..inserts {
        let ids = i * rows..(i + 1) * rows;
        let batch = RecordBatch::try_new(
            table().def.arrow_schema(),
            vec![
                Arc::new(Int64Array::from_iter_values(ids.clone())),
                Arc::new(StringArray::from_iter_values(ids.map(|x| {
                    if x % 3 == 0 {
                        "b"
                    } else {
                        "a"
                    }
                }))),
            ],
        )
        .expect("batch");
        let at = bytes.len() as u64;
        Record::Insert {
            table_id: 1,
            shard: (i % 2) as u32,
            block_number: at,
            idempotency_key: Bytes::new(),
            arrow_ipc: ferry_table::rows::to_ipc(&batch).expect("ipc"),
        }
        .encode(&mut bytes);
    }
    let end = Lsn(bytes.len() as u64);
    (bytes.freeze(), end)
}

struct Node {
    parts: Arc<ReplicaSet>,
    replica: SharedReplica,
    view: watch::Receiver<ExportsView>,
    task: tokio::task::JoinHandle<()>,
}

struct World {
    _dir: tempfile::TempDir,
    disk: Arc<dyn Disk>,
    sessions: Arc<EmbeddedSessions>,
    session: Session,
    lake: std::path::PathBuf,
    end: Lsn,
    wal: Bytes,
}

async fn world(inserts: i64, rows: i64) -> World {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
    let store = EmbeddedStore::open(Arc::clone(&disk), "coord", Default::default())
        .await
        .expect("store");
    let sessions = Arc::new(EmbeddedSessions {
        store,
        timeout: Duration::from_secs(5),
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
        .expect("table node");
    let lake = dir.path().join("lake");
    std::fs::create_dir_all(&lake).expect("lake");
    let (wal, end) = wal(inserts, rows);
    World {
        _dir: dir,
        disk,
        sessions,
        session,
        lake,
        end,
        wal,
    }
}

impl World {
    fn url(&self) -> String {
        format!("file://{}", self.lake.display())
    }

    async fn node(&self, name: &str, destinations: Arc<dyn Destinations>) -> Node {
        let mut r = Replica::open(
            Arc::clone(&self.disk),
            &format!("replicas/{name}"),
            ALL_SHARDS,
            0,
            Cpu::Inline,
            Arc::new(FixedTables),
        )
        .await
        .expect("replica");
        if r.disk_consistent_lsn() < self.end {
            r.receive(Lsn(0), &self.wal).await.expect("apply");
        }
        let replica: SharedReplica = Arc::new(tokio::sync::Mutex::new(r));
        let parts = Arc::new(ReplicaSet::new(vec![Arc::clone(&replica)]));
        let mut config = ExporterConfig::new(name);
        config.tick = Duration::from_millis(50);
        config.cleanup_interval = Duration::from_millis(200);
        let exporter = Exporter::new(
            config,
            Arc::clone(&self.sessions) as Arc<dyn SessionFactory>,
            Arc::new(SystemClock),
            Cpu::Inline,
            Arc::clone(&parts) as _,
            destinations,
        );
        let view = exporter.subscribe();
        Node {
            parts,
            replica,
            view,
            task: tokio::spawn(exporter.run()),
        }
    }

    async fn export(
        &self,
        node: &Node,
        req: &ExportRequest,
    ) -> Result<ferry_export::Created, ferry_export::RequestError> {
        let destinations = StorageDestinations::new(Default::default());
        Requester {
            session: &self.session,
            sessions: self.sessions.as_ref(),
            parts: node.parts.as_ref(),
            destinations: &destinations,
            replica_name: "r0",
            now_unix_millis: ferry_env::Clock::unix_micros(&SystemClock) / 1000,
            random: rand_suffix(),
            commit_lsn: self.end,
            wait: Duration::from_secs(5),
        }
        .export(req)
        .await
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(1);
    N.fetch_add(1, Ordering::Relaxed)
}

fn request(url: &str, partition: &str) -> ExportRequest {
    ExportRequest {
        table: "t".into(),
        partition_id: partition.into(),
        destination: url.into(),
        force: false,
        settings: ExportSettings {
            retry_initial_backoff_ms: 50,
            retry_max_backoff_ms: 200,
            ..ExportSettings::default()
        },
    }
}

/// Waits until some node's view shows the transaction terminal.
async fn wait_terminal(
    view: &mut watch::Receiver<ExportsView>,
    tx: &str,
) -> ferry_export::TaskView {
    tokio::time::timeout(Duration::from_secs(30), async {
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

fn commit_files(lake: &std::path::Path) -> Vec<CommitFile> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(lake).expect("lake") {
        let e = e.expect("entry");
        if e.file_name().to_string_lossy().starts_with("commit_") {
            out.push(
                serde_json::from_slice(&std::fs::read(e.path()).expect("read")).expect("json"),
            );
        }
    }
    out
}

#[tokio::test]
async fn two_replicas_share_an_export_and_the_lake_holds_each_part_once() {
    let w = world(40, 500).await;
    let dest: Arc<dyn Destinations> = Arc::new(StorageDestinations::new(Default::default()));
    let mut a = w.node("r0", Arc::clone(&dest)).await;
    let b = w.node("r1", Arc::clone(&dest)).await;
    let snapshot = a.replica.lock().await.parts(1);
    let in_a: Vec<_> = snapshot
        .iter()
        .filter(|p| p.name.partition_id == "a")
        .collect();
    let rows_a: u64 = in_a.iter().map(|p| p.rows).sum();
    let created = w
        .export(&a, &request(&w.url(), "a"))
        .await
        .expect("export created");
    assert_eq!(created.parts_count as usize, in_a.len());
    assert_eq!(created.rows, rows_a);
    let done = wait_terminal(&mut a.view, &created.transaction_id).await;
    assert_eq!(done.status, TaskStatus::Completed, "{done:?}");
    assert_eq!(done.parts_to_do, 0);

    let commits = commit_files(&w.lake);
    assert_eq!(commits.len(), 1, "exactly one commit file");
    let c = &commits[0];
    assert_eq!(c.transaction_id, created.transaction_id);
    assert_eq!(c.files.len(), in_a.len(), "one file per snapshot part");
    assert_eq!(c.rows, rows_a);
    // Both replicas worked (the work is shared) and the lake holds nothing else.
    let counters = (
        a.view.borrow().counters.clone(),
        b.view.borrow().counters.clone(),
    );
    assert_eq!(
        counters.0.parts_exported + counters.1.parts_exported,
        in_a.len() as u64
    );
    let loc = ferry_storage::open(&w.url(), &Default::default()).expect("lake");
    let report = ferry_export::verify::verify(&loc, true)
        .await
        .expect("verify");
    assert!(report.ok(), "{report:?}");
    assert!(report.orphans.is_empty(), "{report:?}");
    assert_eq!(report.rows, rows_a);

    // The same partition again: refused while the task lives.
    let again = w.export(&a, &request(&w.url(), "a")).await;
    assert!(
        matches!(again, Err(ferry_export::RequestError::AlreadyExists { .. })),
        "{again:?}"
    );
    // Forced: a new transaction, a second commit file naming the same files.
    let mut forced = request(&w.url(), "a");
    forced.force = true;
    let second = w.export(&a, &forced).await.expect("forced export");
    let done = wait_terminal(&mut a.view, &second.transaction_id).await;
    assert_eq!(done.status, TaskStatus::Completed);
    let commits = commit_files(&w.lake);
    assert_eq!(commits.len(), 2);
    assert_eq!(
        commits[0].files, commits[1].files,
        "same deterministic file names"
    );
    a.task.abort();
    b.task.abort();
}

#[tokio::test]
async fn malformed_requests_are_refused_and_change_nothing() {
    let w = world(4, 50).await;
    let dest: Arc<dyn Destinations> = Arc::new(StorageDestinations::new(Default::default()));
    let a = w.node("r0", dest).await;
    let url = w.url();
    let cases: Vec<(ExportRequest, &str)> = vec![
        (request(&url, "../x"), "partition id"),
        (request(&url, "a/b"), "partition id"),
        (request(&url, ""), "partition id"),
        (request(&url, "zz"), "no rows"),
        (
            ExportRequest {
                table: "nope".into(),
                ..request(&url, "a")
            },
            "no table",
        ),
        (
            ExportRequest {
                table: "../t".into(),
                ..request(&url, "a")
            },
            "table name",
        ),
        (request("file:///tmp/../etc", "a"), "invalid storage URL"),
        (request("ftp://x/y", "a"), "unsupported"),
        (
            ExportRequest {
                settings: ExportSettings {
                    parallelism: 0,
                    ..ExportSettings::default()
                },
                ..request(&url, "a")
            },
            "parallelism",
        ),
    ];
    for (req, expect) in cases {
        let e = w.export(&a, &req).await.expect_err("refused");
        assert!(e.to_string().contains(expect), "{req:?}: {e}");
    }
    let (tasks, _) = w
        .session
        .children("/ferry/tables/t")
        .await
        .expect("children");
    assert!(
        !tasks.contains(&"exports".to_string())
            || w.session
                .children("/ferry/tables/t/exports")
                .await
                .expect("c")
                .0
                .is_empty()
    );
    assert!(
        ferry_export::LocalParts::pinned(a.parts.as_ref())
            .await
            .is_empty(),
        "no pins left"
    );
    a.task.abort();
}

/// Every URL opens one in-memory store behind a fault injector.
struct Faulty(ferry_sim::objstore::FaultyObjectStore);

impl Destinations for Faulty {
    fn open(&self, url: &str) -> Result<ferry_storage::Location, ferry_storage::StorageError> {
        ferry_storage::Location::from_store(url, Arc::new(self.0.clone()), "")
    }
}

const MEM: &str = "s3://lake/x";

impl World {
    async fn export_to(
        &self,
        node: &Node,
        dest: &dyn Destinations,
        req: &ExportRequest,
    ) -> ferry_export::Created {
        Requester {
            session: &self.session,
            sessions: self.sessions.as_ref(),
            parts: node.parts.as_ref(),
            destinations: dest,
            replica_name: "r0",
            now_unix_millis: ferry_env::Clock::unix_micros(&SystemClock) / 1000,
            random: rand_suffix(),
            commit_lsn: self.end,
            wait: Duration::from_secs(5),
        }
        .export(req)
        .await
        .expect("export created")
    }
}

async fn keys(store: &ferry_sim::objstore::FaultyObjectStore) -> Vec<String> {
    use futures::TryStreamExt;
    use object_store::ObjectStore;
    let mut keys: Vec<String> = store
        .truth()
        .list(None)
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .expect("list");
    keys.sort();
    keys
}

#[tokio::test]
async fn storage_failures_that_heal_end_with_one_commit_file_and_no_duplicates() {
    use ferry_sim::objstore::{FaultyObjectStore, ObjectFaults};
    let w = world(30, 200).await;
    let store = FaultyObjectStore::new(7, ObjectFaults::default());
    let dest = Arc::new(Faulty(store.clone()));
    let mut a = w.node("r0", dest.clone()).await;
    let b = w.node("r1", dest.clone()).await;
    let created = w.export_to(&a, dest.as_ref(), &request(MEM, "a")).await;
    // Requests fail, and writes fail after they were applied.
    store.set_faults(ObjectFaults {
        fail_prob: 0.3,
        fail_after_write_prob: 0.3,
        ..ObjectFaults::default()
    });
    let done = wait_terminal(&mut a.view, &created.transaction_id).await;
    assert_eq!(done.status, TaskStatus::Completed, "{done:?}");
    assert!(store.injected_faults() > 0);
    store.set_faults(ObjectFaults::default());
    let loc = dest.open(MEM).expect("location");
    let report = ferry_export::verify::verify(&loc, true)
        .await
        .expect("verify");
    assert!(report.ok(), "{report:?}");
    assert!(
        report.orphans.is_empty(),
        "no data file under another name: {report:?}"
    );
    assert_eq!(report.commits.len(), 1);
    assert_eq!(report.files_checked as u64, created.parts_count);
    let all = keys(&store).await;
    assert_eq!(all.len() as u64, created.parts_count + 1, "{all:?}");
    a.task.abort();
    b.task.abort();
}

#[tokio::test]
async fn storage_failures_that_do_not_heal_fail_the_task_without_a_commit_file() {
    use ferry_sim::objstore::{FaultyObjectStore, ObjectFaults};
    let w = world(10, 100).await;
    let store = FaultyObjectStore::new(8, ObjectFaults::default());
    let dest = Arc::new(Faulty(store.clone()));
    let mut a = w.node("r0", dest.clone()).await;
    let mut req = request(MEM, "a");
    req.settings.max_retries = 3;
    let created = w.export_to(&a, dest.as_ref(), &req).await;
    store.set_faults(ObjectFaults {
        fail_prob: 1.0,
        ..ObjectFaults::default()
    });
    let done = wait_terminal(&mut a.view, &created.transaction_id).await;
    assert_eq!(done.status, TaskStatus::Failed, "{done:?}");
    let e = done
        .last_exception
        .clone()
        .unwrap_or_else(|| panic!("the exception is recorded: {done:?}"));
    assert!(e.message.contains("injected"), "{e:?}");
    assert!(done.exception_count >= 3, "{done:?}");
    store.set_faults(ObjectFaults::default());
    assert!(
        !keys(&store).await.iter().any(|k| k.contains("commit_")),
        "a FAILED task has no commit file"
    );
    a.task.abort();
}

#[tokio::test]
async fn a_killed_export_stops_and_never_gets_a_commit_file() {
    use ferry_sim::objstore::{FaultyObjectStore, ObjectFaults};
    let w = world(20, 100).await;
    let store = FaultyObjectStore::new(9, ObjectFaults::default());
    let dest = Arc::new(Faulty(store.clone()));
    let mut a = w.node("r0", dest.clone()).await;
    let created = w.export_to(&a, dest.as_ref(), &request(MEM, "a")).await;
    // Uploads hang (slow storage) while the kill comes.
    store.set_faults(ObjectFaults {
        min_latency: Duration::from_secs(3600),
        max_latency: Duration::from_secs(3600),
        ..ObjectFaults::default()
    });
    let key = ferry_export::TaskKey::new("t", "a", MEM);
    // The killer sees the storage without the faults.
    let destination = ferry_export::Destination::new(
        ferry_storage::Location::from_store(MEM, store.truth(), "").expect("open"),
    );
    let status = loop {
        match ferry_export::task::kill(
            &w.session,
            &key,
            Some(&created.transaction_id),
            &destination,
            "test",
        )
        .await
        {
            Ok(s) => break s,
            Err(ferry_export::task::KillError::Busy(_)) => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("kill: {e}"),
        }
    };
    assert_eq!(status, TaskStatus::Killed);
    let done = wait_terminal(&mut a.view, &created.transaction_id).await;
    assert_eq!(done.status, TaskStatus::Killed);
    assert!(done.running.is_empty(), "uploads cancelled: {done:?}");
    store.set_faults(ObjectFaults::default());
    assert!(!keys(&store).await.iter().any(|k| k.contains("commit_")));
    // A second kill changes nothing.
    let again = ferry_export::task::kill(&w.session, &key, None, &destination, "again")
        .await
        .expect("kill");
    assert_eq!(again, TaskStatus::Killed);
    a.task.abort();
}
