//! Export end to end, every scenario on every back-end pair: the embedded
//! coordination store with a local folder, and real ZooKeeper
//! (`FERRY_TEST_ZK`) with the S3 server (`FERRY_TEST_S3_ENDPOINT`, moto).
//! The real pair is skipped (and said so) without the services, unless
//! `FERRY_TEST_REQUIRE_SERVICES=1`, as scripts/test.sh sets.
//!
//! Scenarios: two and three replicas sharing exports (a refused re-export,
//! force, two destinations, an exporter killed and restarted), malformed
//! requests, storage failures that heal and that do not, kill, TTL expiry,
//! merges during an export, the session expiry of an exporting node, and a
//! destination of another schema.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use ferry_testkit::services::{self, create_bucket, optional_service};
use ferry_testkit::table::{id_p_table, FixedTables};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use ferry_coord::embedded::EmbeddedStore;
use ferry_coord::zk::ZkOptions;
use ferry_coord::{CoordMetrics, CreateMode, EmbeddedSessions, Session, SessionFactory};
use ferry_env::{Cpu, Disk, SystemClock};
use ferry_export::model::{CommitFile, ExportSettings};
use ferry_export::{
    Destinations, ExportRequest, Exporter, ExporterConfig, ExportsView, LocalParts, ReplicaSet,
    Requester, StorageDestinations, TaskStatus,
};
use ferry_replica::{PartName, Replica, SharedReplica, ALL_SHARDS};
use ferry_storage::{Location, S3Settings};
use ferry_table::Table;
use ferry_testkit::objstore::{FaultyObjectStore, ObjectFaults};
use ferry_testkit::tcp_proxy::Proxy;
use ferry_wal::record::Record;
use ferry_wal::Lsn;
use futures::TryStreamExt;
use object_store::ObjectStore;
use tokio::sync::watch;

fn table() -> Table {
    id_p_table(1, "t", 2, &[])
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

/// The back-end pairs a scenario runs on.
#[derive(Debug, Clone)]
enum Backend {
    /// The embedded store and a local folder.
    Embedded,
    /// ZooKeeper and an S3 server.
    Real { zk: String, s3: String },
}

fn backends() -> Vec<Backend> {
    let mut out = vec![Backend::Embedded];
    match (
        optional_service(services::ZOOKEEPER),
        optional_service(services::S3_ENDPOINT),
    ) {
        (Some(zk), Some(s3)) => out.push(Backend::Real { zk, s3 }),
        _ => services::skipped(
            "the ZooKeeper + S3 half did not run: FERRY_TEST_ZK or FERRY_TEST_S3_ENDPOINT \
             is not set (scripts/test.sh sets them)",
        ),
    }
    out
}

/// The wall clock in nanoseconds (truncated): a request's random part that
/// no earlier request of the test had.
fn wall_clock_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default()
}

/// How a test ends a node's coordination session as if it expired.
#[derive(Clone)]
enum Expirer {
    Embedded(EmbeddedStore),
    Zk(ZkOptions),
}

/// A node's sessions, remembered so that a test can expire the current one.
struct NodeSessions {
    backend: Arc<dyn SessionFactory>,
    expirer: Expirer,
    /// Each session opened: its id, ZooKeeper's id and password, and its
    /// state (not the session itself, which would keep it open).
    opened: Mutex<Vec<OpenedSession>>,
    /// How many were opened, to wait on.
    opens: watch::Sender<usize>,
}

type OpenedSession = (
    i64,
    Option<(zookeeper_client::SessionInfo, Arc<Proxy>)>,
    watch::Receiver<ferry_coord::SessionState>,
);

#[async_trait]
impl SessionFactory for NodeSessions {
    async fn open(&self) -> ferry_coord::Result<Session> {
        let (session, info) = match &self.expirer {
            Expirer::Embedded(_) => (self.backend.open().await?, None),
            Expirer::Zk(options) => {
                // Through a proxy of its own, so that a test can partition
                // this session's owner while it expires the session.
                let (s, proxy) = ferry_testkit::tcp_proxy::connect_proxied(options).await?;
                let info = s.session_info();
                (Arc::new(s) as Session, Some((info, Arc::new(proxy))))
            }
        };
        let n = {
            let mut opened = self.opened.lock().expect("lock");
            opened.push((session.session_id(), info, session.session_state()));
            opened.len()
        };
        self.opens.send_replace(n);
        Ok(session)
    }
}

impl NodeSessions {
    fn opened(&self) -> usize {
        self.opened.lock().expect("lock").len()
    }

    /// Waits until more than `n` sessions were opened.
    async fn wait_opened_more_than(&self, n: usize) {
        let mut opens = self.opens.subscribe();
        tokio::time::timeout(Duration::from_secs(60), opens.wait_for(|&o| o > n))
            .await
            .expect("a new session in time")
            .expect("sessions");
    }

    /// Partitions the newest session's owner from ZooKeeper, so that it can
    /// neither make progress nor save its session (a no-op on the embedded
    /// store, whose expiry is immediate).
    fn partition_current(&self) {
        let opened = self.opened.lock().expect("lock");
        if let Some((_, Some((_, proxy)), _)) = opened.last() {
            proxy.set_cut(true);
        }
    }

    /// Expires the newest session: its ephemerals go, its owner sees it.
    async fn expire_current(&self) {
        let (id, info, mut state) = self
            .opened
            .lock()
            .expect("lock")
            .last()
            .cloned()
            .expect("a session was opened");
        match (&self.expirer, info) {
            (Expirer::Embedded(store), _) => {
                assert!(store.expire_session(id).await.expect("expire"));
            }
            (Expirer::Zk(options), Some((info, proxy))) => {
                ferry_testkit::tcp_proxy::expire_proxied(options, info, &proxy)
                    .await
                    .unwrap_or_else(|e| panic!("could not attach to session {id:#x}: {e}"));
            }
            (Expirer::Zk(_), None) => unreachable!("ZooKeeper sessions carry their info"),
        }
        tokio::time::timeout(Duration::from_secs(30), async {
            while !state.borrow_and_update().is_terminal() {
                state.changed().await.expect("state");
            }
        })
        .await
        .expect("the session is seen to end");
    }
}

struct Node {
    parts: Arc<ReplicaSet>,
    replica: SharedReplica,
    sessions: Arc<NodeSessions>,
    view: watch::Receiver<ExportsView>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct World {
    backend: Backend,
    _dir: tempfile::TempDir,
    disk: Arc<dyn Disk>,
    sessions: Arc<dyn SessionFactory>,
    expirer: Expirer,
    session: Session,
    /// The destination's base URL (`file://…` or `s3://bucket/base`).
    base: String,
    s3: S3Settings,
    /// The store behind `base` (a folder, or the bucket) and the prefix of
    /// `base` in it.
    store: Arc<dyn ObjectStore>,
    store_prefix: String,
    end: Lsn,
    wal: Bytes,
}

async fn world(backend: &Backend, inserts: i64, rows: i64) -> World {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let (sessions, expirer): (Arc<dyn SessionFactory>, Expirer) = match backend {
        Backend::Embedded => {
            let store = EmbeddedStore::open(Arc::clone(&disk), "coord", Default::default())
                .await
                .expect("store");
            (
                Arc::new(EmbeddedSessions {
                    store: store.clone(),
                    timeout: Duration::from_secs(5),
                    metrics: Arc::new(CoordMetrics::default()),
                }),
                Expirer::Embedded(store),
            )
        }
        Backend::Real { zk, .. } => {
            let chroot = services::zookeeper_chroot(zk, "export-test").await;
            let mut options = ZkOptions::new(chroot);
            options.session_timeout = Duration::from_secs(4);
            (
                Arc::new(ferry_coord::ZkSessions {
                    options: options.clone(),
                    metrics: Arc::new(CoordMetrics::default()),
                }),
                Expirer::Zk(options),
            )
        }
    };
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
    let (base, s3, store, store_prefix): (String, S3Settings, Arc<dyn ObjectStore>, String) =
        match backend {
            Backend::Embedded => {
                let lake = dir.path().join("lake");
                std::fs::create_dir_all(&lake).expect("lake");
                let store = object_store::local::LocalFileSystem::new_with_prefix(&lake)
                    .expect("local store");
                (
                    format!("file://{}", lake.display()),
                    S3Settings::default(),
                    Arc::new(store),
                    String::new(),
                )
            }
            Backend::Real { s3, .. } => {
                let bucket = services::unique_name("ferry-export");
                create_bucket(s3, &bucket).await;
                let store = object_store::aws::AmazonS3Builder::new()
                    .with_endpoint(s3)
                    .with_allow_http(true)
                    .with_region("us-east-1")
                    .with_bucket_name(&bucket)
                    .with_access_key_id("test")
                    .with_secret_access_key("test")
                    .with_conditional_put(object_store::aws::S3ConditionalPut::ETagMatch)
                    .build()
                    .expect("S3 store");
                (
                    format!("s3://{bucket}/base"),
                    services::s3_settings(s3),
                    Arc::new(store),
                    "base".to_string(),
                )
            }
        };
    let (wal, end) = wal(inserts, rows);
    World {
        backend: backend.clone(),
        _dir: dir,
        disk,
        sessions,
        expirer,
        session,
        base,
        s3,
        store,
        store_prefix,
        end,
        wal,
    }
}

/// Every destination URL under the world's base, through a fault injector
/// in front of the real store.
struct Faulty {
    store: FaultyObjectStore,
    base: String,
    prefix: String,
}

impl Destinations for Faulty {
    fn open(&self, url: &str) -> Result<Location, ferry_storage::StorageError> {
        let rest = url.strip_prefix(&self.base).unwrap_or("");
        let prefix = format!("{}{rest}", self.prefix);
        Location::from_store(url, Arc::new(self.store.clone()), prefix.trim_matches('/'))
    }
}

impl World {
    /// A destination under the base.
    fn url(&self, name: &str) -> String {
        format!("{}/{name}", self.base)
    }

    fn destinations(&self) -> Arc<dyn Destinations> {
        // The base is the only local folder a request may name.
        let roots = self
            .base
            .strip_prefix("file://")
            .map(std::path::PathBuf::from);
        Arc::new(StorageDestinations::new(
            self.s3.clone(),
            ferry_storage::LocalRoots::new(roots).expect("roots"),
        ))
    }

    /// The real store behind a fault injector (multipart uploads included).
    fn faulty(&self, seed: u64) -> (FaultyObjectStore, Arc<Faulty>) {
        let store = FaultyObjectStore::wrap(
            seed,
            ObjectFaults {
                multipart: true,
                deletes: false,
                ..ObjectFaults::default()
            },
            Arc::clone(&self.store),
        );
        let dest = Arc::new(Faulty {
            store: store.clone(),
            base: self.base.clone(),
            prefix: self.store_prefix.clone(),
        });
        (store, dest)
    }

    /// The destination without faults.
    fn location(&self, url: &str) -> Location {
        ferry_storage::open(url, &self.s3).expect("location")
    }

    async fn node(&self, name: &str, destinations: Arc<dyn Destinations>) -> Node {
        let mut r = Replica::open(
            Arc::clone(&self.disk),
            &format!("replicas/{name}"),
            ALL_SHARDS,
            0,
            Cpu::Inline,
            Arc::new(FixedTables::new([table()])),
        )
        .await
        .expect("replica");
        if r.disk_consistent_lsn() < self.end {
            r.receive(Lsn(0), &self.wal).await.expect("apply");
        }
        let replica: SharedReplica = Arc::new(tokio::sync::Mutex::new(r));
        let parts = Arc::new(ReplicaSet::new(vec![Arc::clone(&replica)]));
        let sessions = Arc::new(NodeSessions {
            backend: Arc::clone(&self.sessions),
            expirer: self.expirer.clone(),
            opened: Mutex::new(Vec::new()),
            opens: watch::channel(0).0,
        });
        let mut config = ExporterConfig::new(name);
        config.tick = Duration::from_millis(50);
        config.cleanup_interval = Duration::from_millis(200);
        config.safety_poll = Duration::from_millis(300);
        config.lost_part_grace = Duration::ZERO;
        let exporter = Exporter::new(
            config,
            Arc::clone(&sessions) as Arc<dyn SessionFactory>,
            Arc::new(SystemClock),
            Cpu::Inline,
            Arc::clone(&parts) as _,
            destinations,
        );
        let view = exporter.subscribe();
        Node {
            parts,
            replica,
            sessions,
            view,
            task: tokio::spawn(exporter.run()),
        }
    }

    /// Stops a node's exporter (its session with it) and starts it again on
    /// the same replica.
    async fn restart(&self, node: &mut Node, name: &str, destinations: Arc<dyn Destinations>) {
        node.task.abort();
        let _ = (&mut node.task).await;
        let mut config = ExporterConfig::new(name);
        config.tick = Duration::from_millis(50);
        config.cleanup_interval = Duration::from_millis(200);
        config.safety_poll = Duration::from_millis(300);
        config.lost_part_grace = Duration::ZERO;
        let exporter = Exporter::new(
            config,
            Arc::clone(&node.sessions) as Arc<dyn SessionFactory>,
            Arc::new(SystemClock),
            Cpu::Inline,
            Arc::clone(&node.parts) as _,
            destinations,
        );
        node.view = exporter.subscribe();
        node.task = tokio::spawn(exporter.run());
    }

    async fn export_to(
        &self,
        node: &Node,
        dest: &dyn Destinations,
        req: &ExportRequest,
    ) -> Result<ferry_export::Created, ferry_export::RequestError> {
        Requester {
            session: &self.session,
            sessions: self.sessions.as_ref(),
            parts: node.parts.as_ref(),
            destinations: dest,
            replica_name: "r0",
            now_unix_millis: ferry_env::Clock::unix_micros(&SystemClock) / 1000,
            random: wall_clock_nanos(),
            commit_lsn: self.end,
            wait: Duration::from_secs(5),
        }
        .export(req)
        .await
    }

    async fn export(
        &self,
        node: &Node,
        req: &ExportRequest,
    ) -> Result<ferry_export::Created, ferry_export::RequestError> {
        self.export_to(node, self.destinations().as_ref(), req)
            .await
    }

    /// Every key under a destination, from the store itself.
    async fn keys(&self, url: &str) -> Vec<String> {
        let rest = url.strip_prefix(&self.base).unwrap_or("");
        let prefix = format!("{}{rest}", self.store_prefix);
        let prefix = object_store::path::Path::from(prefix.trim_matches('/'));
        let mut keys: Vec<String> = self
            .store
            .list(Some(&prefix))
            .map_ok(|m| m.location.to_string())
            .try_collect()
            .await
            .expect("list");
        keys.sort();
        keys
    }

    async fn commit_files(&self, url: &str) -> Vec<CommitFile> {
        let loc = self.location(url);
        let mut out = Vec::new();
        for (key, _) in loc.list("").await.expect("list") {
            if key.starts_with("commit_") {
                out.push(serde_json::from_slice(&loc.get(&key).await.expect("get")).expect("json"));
            }
        }
        out
    }

    /// The destination verified, deeply: consistent, no orphans, one
    /// commit file of `parts` files and `rows` rows.
    async fn verified(&self, url: &str, parts: u64, rows: u64) {
        let report =
            ferry_export::verify::verify(&self.location(url), ferry_export::verify::Depth::Rows)
                .await
                .expect("verify");
        assert!(report.ok(), "{:?}: {report:?}", self.backend);
        assert!(report.orphans.is_empty(), "{report:?}");
        assert_eq!(report.commits.len(), 1, "{report:?}");
        assert_eq!(report.files_checked as u64, parts, "{report:?}");
        assert_eq!(report.rows, rows, "{report:?}");
    }
}

fn request(url: &str, partition: &str) -> ExportRequest {
    ExportRequest {
        table: "t".into(),
        partition_id: partition.into(),
        destination: url.into(),
        force: false,
        replace_finished: false,
        by_policy: false,
        settings: ExportSettings {
            retry_initial_backoff_ms: 50,
            retry_max_backoff_ms: 200,
            ..ExportSettings::default()
        },
    }
}

/// Waits until the node's view shows the transaction terminal.
async fn wait_terminal(
    view: &mut watch::Receiver<ExportsView>,
    tx: &str,
) -> ferry_export::TaskView {
    wait_view(view, |v| {
        v.tasks
            .iter()
            .find(|t| t.transaction_id == tx && t.status.is_terminal())
            .cloned()
    })
    .await
}

/// Waits until `f` finds something in the node's view.
async fn wait_view<T>(
    view: &mut watch::Receiver<ExportsView>,
    mut f: impl FnMut(&ExportsView) -> Option<T>,
) -> T {
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(t) = f(&view.borrow_and_update()) {
                return t;
            }
            view.changed().await.expect("exporter running");
        }
    })
    .await
    .expect("the export gets there in time")
}

fn active_rows(replica: &Replica, partition: &str) -> (usize, u64) {
    let parts: Vec<_> = replica
        .parts(1)
        .into_iter()
        .filter(|p| p.name.partition_id == partition)
        .collect();
    (parts.len(), parts.iter().map(|p| p.rows).sum())
}

/// Runs the merges of `nodes` until partition `partition` of the first no
/// longer has `parts` parts; returns the merge tasks, still running.
async fn merge_away(
    nodes: &[&Node],
    partition: &str,
    parts: usize,
) -> Vec<tokio::task::JoinHandle<ferry_replica::ReplicaError>> {
    let mergers = nodes
        .iter()
        .map(|n| {
            tokio::spawn(ferry_replica::replica::run_merges(
                Arc::clone(&n.replica),
                Duration::ZERO,
            ))
        })
        .collect();
    let first = &nodes[0].replica;
    let mut status = first.lock().await.subscribe();
    tokio::time::timeout(Duration::from_secs(30), async {
        while active_rows(&*first.lock().await, partition).0 == parts {
            status.changed().await.expect("replica");
        }
    })
    .await
    .expect("merges ran");
    mergers
}

#[tokio::test]
async fn two_replicas_share_an_export_and_the_lake_holds_each_part_once() {
    for backend in backends() {
        let w = world(&backend, 40, 500).await;
        let url = w.url("lake");
        let mut a = w.node("r0", w.destinations()).await;
        let b = w.node("r1", w.destinations()).await;
        let (parts, rows) = active_rows(&*a.replica.lock().await, "a");
        let created = w
            .export(&a, &request(&url, "a"))
            .await
            .expect("export created");
        assert_eq!(created.parts_count as usize, parts);
        assert_eq!(created.rows, rows);
        let done = wait_terminal(&mut a.view, &created.transaction_id).await;
        assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
        assert_eq!(done.parts_to_do, 0);
        // What the task cost this node in coordination is shown, and is
        // part of the exporter's total.
        assert!(done.coordination_ops > 0, "{done:?}");
        assert!(a.view.borrow().counters.coordination_ops >= done.coordination_ops);
        let commits = w.commit_files(&url).await;
        assert_eq!(commits.len(), 1, "exactly one commit file");
        assert_eq!(commits[0].transaction_id, created.transaction_id);
        assert_eq!(
            commits[0].columns,
            table().def.columns,
            "the schema is listed"
        );
        w.verified(&url, parts as u64, rows).await;
        // Both replicas worked (the work is shared).
        let exported =
            a.view.borrow().counters.parts_exported + b.view.borrow().counters.parts_exported;
        assert_eq!(exported, parts as u64, "{backend:?}");

        // The same partition again: refused while the task lives.
        let again = w.export(&a, &request(&url, "a")).await;
        assert!(
            matches!(again, Err(ferry_export::RequestError::AlreadyExists { .. })),
            "{again:?}"
        );
        // Forced, with the same parts: the current commit holds them
        // already, so nothing is created and nothing written.
        let mut forced = request(&url, "a");
        forced.force = true;
        let second = w.export(&a, &forced).await.expect("forced export");
        let commit_key = ferry_export::model::commit_key("a", &created.transaction_id);
        assert_eq!(second.unchanged.as_deref(), Some(commit_key.as_str()));
        assert_eq!(second.transaction_id, created.transaction_id);
        assert!(a.parts.pinned().await.is_empty(), "no pins left behind");
        let commits = w.commit_files(&url).await;
        assert_eq!(commits.len(), 1);
        assert_eq!(commits[0].sequence, 1);
        let report =
            ferry_export::verify::verify(&w.location(&url), ferry_export::verify::Depth::Rows)
                .await
                .expect("verify");
        assert!(report.ok() && report.orphans.is_empty(), "{report:?}");
        assert_eq!(report.rows, rows, "every file counted once");
        w.session.close().await;
    }
}

#[tokio::test]
async fn three_nodes_share_two_destinations_through_a_restarted_exporter() {
    for backend in backends() {
        let w = world(&backend, 30, 100).await;
        let mut nodes = Vec::new();
        for n in 0..3 {
            nodes.push(w.node(&format!("node{n}"), w.destinations()).await);
        }
        let (parts, rows) = active_rows(&*nodes[0].replica.lock().await, "a");
        let urls = [w.url("one"), w.url("two")];
        let mut txs = Vec::new();
        for url in &urls {
            let mut req = request(url, "a");
            req.settings.parallelism = 1;
            txs.push(w.export(&nodes[0], &req).await.expect("export created"));
        }
        // Node 1's exporter dies at once (its session with it) and comes back.
        let mut n1 = nodes.remove(1);
        w.restart(&mut n1, "node1", w.destinations()).await;
        for (url, created) in urls.iter().zip(&txs) {
            let done = wait_terminal(&mut nodes[0].view, &created.transaction_id).await;
            assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
            w.verified(url, parts as u64, rows).await;
        }
        drop(n1);
        w.session.close().await;
    }
}

#[tokio::test]
async fn malformed_requests_are_refused_and_change_nothing() {
    for backend in backends() {
        let w = world(&backend, 4, 50).await;
        let a = w.node("r0", w.destinations()).await;
        let url = w.url("lake");
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
            (request(&format!("{url}/../x"), "a"), "invalid storage URL"),
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
            assert!(e.to_string().contains(expect), "{backend:?} {req:?}: {e}");
        }
        let (tasks, _) = w
            .session
            .children("/ferry/tables/t")
            .await
            .expect("children");
        if tasks.contains(&"exports".to_string()) {
            let (exports, _) = w
                .session
                .children("/ferry/tables/t/exports")
                .await
                .expect("exports");
            assert!(exports.is_empty(), "{exports:?}");
        }
        assert!(a.parts.pinned().await.is_empty(), "no pins left");
        assert!(w.keys(&url).await.is_empty(), "nothing written");
        w.session.close().await;
    }
}

#[tokio::test]
async fn storage_failures_that_heal_end_with_one_commit_file_and_no_duplicates() {
    for backend in backends() {
        let w = world(&backend, 30, 200).await;
        let (store, dest) = w.faulty(7);
        let url = w.url("lake");
        let mut a = w.node("r0", dest.clone()).await;
        let b = w.node("r1", dest.clone()).await;
        let created = w
            .export_to(&a, dest.as_ref(), &request(&url, "a"))
            .await
            .expect("created");
        // Requests fail, and writes fail after they were applied.
        store.set_faults(ObjectFaults {
            fail_prob: 0.3,
            fail_after_write_prob: 0.3,
            multipart: true,
            deletes: false,
            ..ObjectFaults::default()
        });
        let done = wait_terminal(&mut a.view, &created.transaction_id).await;
        assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
        assert!(store.injected_faults() > 0);
        store.set_faults(ObjectFaults::default());
        w.verified(&url, created.parts_count, created.rows).await;
        // The data files, the commit file and the schema marker: nothing
        // under a second name.
        let all = w.keys(&url).await;
        assert_eq!(all.len() as u64, created.parts_count + 2, "{all:?}");
        drop((a, b));
        w.session.close().await;
    }
}

/// Storage that fails every request from the start of the export: the task
/// ends in the status the settings lead to, with no commit file.
async fn storage_that_stays_down(
    backend: &Backend,
    seed: u64,
    settings: impl FnOnce(&mut ExportSettings),
) -> ferry_export::TaskView {
    let w = world(backend, 10, 100).await;
    let (store, dest) = w.faulty(seed);
    let url = w.url("lake");
    let mut a = w.node("r0", dest.clone()).await;
    let mut req = request(&url, "a");
    settings(&mut req.settings);
    let created = w.export_to(&a, dest.as_ref(), &req).await.expect("created");
    store.set_faults(ObjectFaults {
        fail_prob: 1.0,
        multipart: true,
        deletes: false,
        ..ObjectFaults::default()
    });
    let done = wait_terminal(&mut a.view, &created.transaction_id).await;
    store.set_faults(ObjectFaults::default());
    assert!(
        !w.keys(&url).await.iter().any(|k| k.contains("commit_")),
        "{backend:?}: a task ended {} has no commit file",
        done.status
    );
    w.session.close().await;
    done
}

#[tokio::test]
async fn storage_failures_that_do_not_heal_fail_the_task_without_a_commit_file() {
    for backend in backends() {
        let done = storage_that_stays_down(&backend, 8, |s| s.max_retries = 3).await;
        assert_eq!(done.status, TaskStatus::Failed, "{backend:?}: {done:?}");
        let e = done
            .last_exception
            .clone()
            .unwrap_or_else(|| panic!("the exception is recorded: {done:?}"));
        assert!(e.message.contains("injected"), "{e:?}");
        assert!(done.exception_count >= 3, "{done:?}");
    }
}

#[tokio::test]
async fn storage_that_stays_down_past_the_task_timeout_kills_the_task() {
    for backend in backends() {
        // Unlimited retries: only the timeout ends it, and the kill needs
        // no request to the storage that is down.
        let done = storage_that_stays_down(&backend, 10, |s| {
            s.max_retries = 0;
            s.task_timeout_seconds = 1;
        })
        .await;
        assert_eq!(done.status, TaskStatus::Killed, "{backend:?}: {done:?}");
    }
}

#[tokio::test]
async fn a_killed_export_stops_and_never_gets_a_commit_file() {
    for backend in backends() {
        let w = world(&backend, 20, 100).await;
        let (store, dest) = w.faulty(9);
        let url = w.url("lake");
        let mut a = w.node("r0", dest.clone()).await;
        let created = w
            .export_to(&a, dest.as_ref(), &request(&url, "a"))
            .await
            .expect("created");
        // Uploads hang (slow storage) while the kill comes.
        store.set_faults(ObjectFaults {
            min_latency: Duration::from_secs(3600),
            max_latency: Duration::from_secs(3600),
            multipart: true,
            deletes: false,
            ..ObjectFaults::default()
        });
        let key = ferry_export::TaskKey::new("t", "a", &url);
        // The killer sees the storage without the faults.
        let destination = ferry_export::Destination::new(w.location(&url));
        let status = loop {
            match ferry_export::task::kill(
                &w.session,
                &key,
                Some(&created.transaction_id),
                &destination,
                "test",
                0,
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
        assert!(!w.keys(&url).await.iter().any(|k| k.contains("commit_")));
        // A second kill changes nothing.
        let again = ferry_export::task::kill(&w.session, &key, None, &destination, "again", 0)
            .await
            .expect("kill");
        assert_eq!(again, TaskStatus::Killed);
        w.session.close().await;
    }
}

#[tokio::test]
async fn a_finished_task_goes_at_its_ttl_and_the_partition_can_be_exported_again() {
    for backend in backends() {
        let w = world(&backend, 6, 50).await;
        let url = w.url("lake");
        let mut a = w.node("r0", w.destinations()).await;
        let mut req = request(&url, "a");
        req.settings.ttl_seconds = 1;
        let first = w.export(&a, &req).await.expect("created");
        let done = wait_terminal(&mut a.view, &first.transaction_id).await;
        assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
        // The cleanup holder removes it once its TTL passed.
        wait_view(&mut a.view, |v| {
            (!v.tasks
                .iter()
                .any(|t| t.transaction_id == first.transaction_id))
            .then_some(())
        })
        .await;
        let key = ferry_export::TaskKey::new("t", "a", &url);
        assert!(
            w.session
                .exists(&key.path())
                .await
                .expect("exists")
                .is_none(),
            "the task is gone from coordination"
        );
        assert!(a.parts.pinned().await.is_empty(), "its pins went with it");
        // Not forced, and accepted: the same parts are what the current
        // commit holds, so it answers with that commit and writes nothing.
        let second = w.export(&a, &request(&url, "a")).await.expect("again");
        assert!(second.unchanged.is_some(), "{second:?}");
        assert_eq!(second.transaction_id, first.transaction_id);
        assert_eq!(w.commit_files(&url).await.len(), 1);
        w.session.close().await;
    }
}

#[tokio::test]
async fn merges_during_an_export_keep_the_snapshot_parts_until_it_ends() {
    for backend in backends() {
        // 48 inserts: every level-0 part of partition "a" is merged away
        // while the export runs (merges of 8).
        let w = world(&backend, 48, 50).await;
        let url = w.url("lake");
        let (store, dest) = w.faulty(11);
        let mut a = w.node("r0", dest.clone()).await;
        let b = w.node("r1", dest.clone()).await;
        let (parts, rows) = active_rows(&*a.replica.lock().await, "a");
        assert!(parts >= 16, "{parts} parts");
        // Slow uploads, so that the merges finish first.
        store.set_faults(ObjectFaults {
            min_latency: Duration::from_millis(30),
            max_latency: Duration::from_millis(60),
            multipart: true,
            deletes: false,
            ..ObjectFaults::default()
        });
        let mut req = request(&url, "a");
        req.settings.parallelism = 1;
        let created = w.export_to(&a, dest.as_ref(), &req).await.expect("created");
        // The merges replace the snapshot's parts while the export runs.
        let mergers = merge_away(&[&a, &b], "a", parts).await;
        let done = wait_terminal(&mut a.view, &created.transaction_id).await;
        assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
        store.set_faults(ObjectFaults::default());
        let (after, rows_after) = active_rows(&*a.replica.lock().await, "a");
        assert!(after < parts, "merged: {after} parts of {parts}");
        assert_eq!(rows_after, rows);
        // One file per snapshot part (level 0), none of the merged ones.
        let commits = w.commit_files(&url).await;
        assert_eq!(commits.len(), 1);
        assert_eq!(commits[0].files.len(), parts);
        assert!(
            commits[0]
                .files
                .iter()
                .all(|f| f.path.ends_with(&format!("_0_{:08x}.parquet", f.checksum))),
            "{:?}",
            commits[0].files
        );
        w.verified(&url, parts as u64, rows).await;
        for m in mergers {
            m.abort();
        }
        w.session.close().await;
    }
}

/// While a node removes orphan files from a destination (its marker is
/// present), no task for that destination is created: the task could reuse
/// a file already there (an earlier attempt's) that the removal deletes
/// before the task's commit lists it. Once the marker goes, the export is
/// created as usual.
#[tokio::test]
async fn no_export_is_created_while_orphans_are_removed_from_its_destination() {
    for backend in backends() {
        let w = world(&backend, 4, 10).await;
        let url = w.url("lake");
        let a = w.node("r0", w.destinations()).await;
        let location = w.location(&url);
        let marker = ferry_export::model::lake_upkeep_path("t", location.url());
        w.session
            .create(&marker, &[], CreateMode::Ephemeral)
            .await
            .expect("marker");
        let refused = w.export(&a, &request(&url, "a")).await;
        assert!(
            matches!(refused, Err(ferry_export::RequestError::LakeUpkeep(_))),
            "{backend:?}: {refused:?}"
        );
        assert!(
            w.session
                .children(&ferry_export::model::exports_path("t"))
                .await
                .map(|(c, _)| c.is_empty())
                .unwrap_or(true),
            "nothing of the task was made"
        );
        w.session.delete(&marker, None).await.expect("marker gone");
        let created = w.export(&a, &request(&url, "a")).await.expect("created");
        let mut view = a.view.clone();
        let done = wait_terminal(&mut view, &created.transaction_id).await;
        assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
        w.session.close().await;
    }
}

/// A part lost with a replica's data: the task's snapshot pinned it on one
/// node only, that node lost its pins (as a replica rebuilt from a peer
/// does) and both nodes merged it away. No node can upload it; the task
/// fails with nothing committed instead of waiting for its timeout, and the
/// partition exports again from the parts the replicas hold now.
#[tokio::test]
async fn a_part_no_replica_holds_any_more_fails_the_task_and_the_partition_exports_again() {
    for backend in backends() {
        let w = world(&backend, 48, 50).await;
        let url = w.url("lake");
        let mut a = w.node("r0", w.destinations()).await;
        let mut b = w.node("r1", w.destinations()).await;
        // Neither exporter runs while the task is made and its parts go.
        // (`restart` reaps them.)
        a.task.abort();
        b.task.abort();
        let (parts, rows) = active_rows(&*a.replica.lock().await, "a");
        // The snapshot's parts: every active part of the partition.
        let snapshot: Vec<PartName> = a
            .replica
            .lock()
            .await
            .parts(1)
            .into_iter()
            .filter(|p| p.name.partition_id == "a")
            .map(|p| p.name)
            .collect();
        let created = w.export(&a, &request(&url, "a")).await.expect("created");
        assert_eq!(created.parts_count as usize, parts);
        let tx = created.transaction_id.clone();
        a.parts.unpin(&tx).await.expect("the pins are lost");
        let mergers = merge_away(&[&a, &b], "a", parts).await;
        // Until some part of the snapshot is on neither node.
        tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let mut gone = false;
                for name in &snapshot {
                    if a.parts.find(1, name).await.is_none()
                        && b.parts.find(1, name).await.is_none()
                    {
                        gone = true;
                    }
                }
                if gone {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("a part of the snapshot is removed from both nodes");
        w.restart(&mut a, "r0", w.destinations()).await;
        w.restart(&mut b, "r1", w.destinations()).await;
        let done = wait_terminal(&mut a.view, &tx).await;
        assert_eq!(done.status, TaskStatus::Failed, "{backend:?}: {done:?}");
        // The node that failed it recorded why.
        let other = wait_terminal(&mut b.view, &tx).await;
        let why = done
            .last_exception
            .or(other.last_exception)
            .expect("recorded")
            .message;
        assert!(why.contains("on no replica"), "{why}");
        assert!(w.commit_files(&url).await.is_empty(), "nothing committed");
        for m in mergers {
            m.abort();
        }
        // Exported again from what the replicas hold now.
        let (now_parts, now_rows) = active_rows(&*a.replica.lock().await, "a");
        assert_eq!(now_rows, rows);
        let mut again = request(&url, "a");
        again.force = true;
        let second = w.export(&a, &again).await.expect("exported again");
        let done = wait_terminal(&mut a.view, &second.transaction_id).await;
        assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
        let commits = w.commit_files(&url).await;
        assert_eq!(commits.len(), 1);
        assert_eq!(commits[0].transaction_id, second.transaction_id);
        assert_eq!(commits[0].files.len(), now_parts);
        let report =
            ferry_export::verify::verify(&w.location(&url), ferry_export::verify::Depth::Rows)
                .await
                .expect("verify");
        assert!(report.ok(), "{report:?}");
        assert_eq!(report.rows, rows, "every row once");
        w.session.close().await;
    }
}

#[tokio::test]
async fn the_exporting_node_whose_session_expires_carries_on_with_a_new_one() {
    for backend in backends() {
        // The expiry must find parts left. The node is partitioned from
        // coordination first (on ZooKeeper), so it cannot finish meanwhile;
        // its uploads were seen running, so some parts are left unless the
        // last ones were running. Then the scenario runs again.
        let mut landed = false;
        for attempt in 0..3u64 {
            let w = world(&backend, 24, 100).await;
            let url = w.url("lake");
            let (store, dest) = w.faulty(12 + attempt);
            let mut a = w.node("r0", dest.clone()).await;
            let mut req = request(&url, "a");
            req.settings.parallelism = 2;
            let created = w.export_to(&a, dest.as_ref(), &req).await.expect("created");
            // Slow uploads: the expiry finds the node in the middle of some.
            store.set_faults(ObjectFaults {
                min_latency: Duration::from_millis(200),
                max_latency: Duration::from_millis(400),
                multipart: true,
                deletes: false,
                ..ObjectFaults::default()
            });
            wait_view(&mut a.view, |v| {
                v.tasks
                    .iter()
                    .any(|t| t.transaction_id == created.transaction_id && !t.running.is_empty())
                    .then_some(())
            })
            .await;
            let sessions_before = a.sessions.opened();
            a.sessions.partition_current();
            let key = ferry_export::TaskKey::new("t", "a", &url);
            let (left, _) = w
                .session
                .children(&format!("{}/processing", key.path()))
                .await
                .expect("processing");
            a.sessions.expire_current().await;
            // A new session, and with it the parts left.
            a.sessions.wait_opened_more_than(sessions_before).await;
            let done = wait_terminal(&mut a.view, &created.transaction_id).await;
            assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
            // The expired session's locks went with it; the new one's were
            // released part by part.
            let (locks, _) = w
                .session
                .children(&format!("{}/locks", key.path()))
                .await
                .expect("locks");
            assert!(locks.is_empty(), "{locks:?}");
            store.set_faults(ObjectFaults::default());
            w.verified(&url, created.parts_count, created.rows).await;
            w.session.close().await;
            eprintln!(
                "{backend:?} attempt {attempt}: {} parts left at the expiry",
                left.len()
            );
            if !left.is_empty() {
                landed = true;
                break;
            }
        }
        assert!(landed, "{backend:?}: the expiry never found parts left");
    }
}

#[tokio::test]
async fn a_destination_of_another_schema_is_refused_and_fails_a_task_at_once() {
    for backend in backends() {
        let w = world(&backend, 6, 50).await;
        let url = w.url("lake");
        let a = w.node("r0", w.destinations()).await;
        let foreign = ferry_export::model::DestinationSchema {
            format: ferry_export::model::SCHEMA_FORMAT,
            table: "other".into(),
            columns: vec![ferry_table::def::ColumnDef {
                name: "id".into(),
                column_type: ferry_table::def::ColumnType::Utf8,
                nullable: false,
            }],
            lake_format: ferry_export::model::LakeFormat::Parquet,
        };
        let marker = Bytes::from(serde_json::to_vec(&foreign).expect("json"));
        // At request time: refused, nothing created.
        let loc = w.location(&url);
        loc.put_create(ferry_export::model::SCHEMA_KEY, marker.clone())
            .await
            .expect("marker");
        let e = w
            .export(&a, &request(&url, "a"))
            .await
            .expect_err("refused");
        assert!(
            matches!(e, ferry_export::RequestError::SchemaMismatch { .. }),
            "{backend:?}: {e}"
        );
        assert!(e.to_string().contains("column 0 is id Utf8"), "{e}");
        assert!(a.parts.pinned().await.is_empty());
        drop(a);

        // Between request and upload (another export wrote first): the
        // task is FAILED at once, with the reason recorded.
        let url2 = w.url("lake2");
        let idle = w.node("r1", w.destinations()).await;
        idle.task.abort();
        let created = w
            .export(&idle, &request(&url2, "a"))
            .await
            .expect("created");
        w.location(&url2)
            .put_create(ferry_export::model::SCHEMA_KEY, marker)
            .await
            .expect("marker");
        let mut b = w.node("r2", w.destinations()).await;
        let done = wait_terminal(&mut b.view, &created.transaction_id).await;
        assert_eq!(done.status, TaskStatus::Failed, "{done:?}");
        let ex = done.last_exception.clone().expect("recorded");
        assert!(ex.message.contains("schema mismatch"), "{ex:?}");
        // Not retried: at most one failure per upload slot.
        assert!(
            done.exception_count <= u64::from(ExportSettings::default().parallelism),
            "{done:?}"
        );
        assert!(!w.keys(&url2).await.iter().any(|k| k.contains("commit_")));
        assert!(!w.keys(&url2).await.iter().any(|k| k.ends_with(".parquet")));
        w.session.close().await;
    }
}

/// `format = iceberg`, on a local folder and on S3: two replicas share each
/// export; pyiceberg and DuckDB (when `scripts/test.sh` installed them) read
/// every partition's rows once; after merges replace partition "a"'s parts,
/// a forced export of it replaces its files in one snapshot (made from the
/// processed entries: the merged-away parts are not needed) and the readers
/// still read every row once. The exports run one after the other: moto does
/// not make racing create-only puts atomic (see the Iceberg crate's tests).
#[tokio::test]
async fn an_iceberg_export_is_read_once_before_and_after_a_re_export_over_merged_parts() {
    for backend in backends() {
        let w = world(&backend, 48, 50).await;
        let url = w.url("iceberg");
        let mut a = w.node("r0", w.destinations()).await;
        let b = w.node("r1", w.destinations()).await;
        let iceberg = |partition: &str, force: bool| {
            let mut req = request(&url, partition);
            req.settings.format = Some(ferry_export::model::LakeFormat::Iceberg);
            req.force = force;
            req
        };
        let (parts_a, rows_a) = active_rows(&*a.replica.lock().await, "a");
        let (_, rows_b) = active_rows(&*a.replica.lock().await, "b");
        for p in ["a", "b"] {
            let created = w.export(&a, &iceberg(p, false)).await.expect("created");
            let done = wait_terminal(&mut a.view, &created.transaction_id).await;
            assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
        }
        let s3 = match &backend {
            Backend::Real { s3, .. } => Some(s3.clone()),
            Backend::Embedded => None,
        };
        let table = ferry_iceberg::IcebergTable::new(w.location(&url));
        // The readers run off the runtime, which keeps the sessions alive.
        let read = |version: u64| {
            let meta = format!("{url}/metadata/v{version}.metadata.json");
            let meta = meta.strip_prefix("file://").unwrap_or(&meta).to_string();
            let s3 = s3.clone();
            async move {
                tokio::task::spawn_blocking(move || {
                    ferry_testkit::services::iceberg_row_counts(&meta, "p", s3.as_deref())
                })
                .await
                .expect("the lake readers")
            }
        };
        let expected = serde_json::json!({"a": rows_a, "b": rows_b});
        let (version, _) = table.current().await.expect("read").expect("a table");
        assert_eq!(version, 2);
        if let Some(got) = read(version).await {
            assert_eq!(got["pyiceberg"], expected, "{backend:?}: {got}");
            assert_eq!(got["duckdb"], expected, "{backend:?}: {got}");
            assert_eq!(got["pyiceberg_table"], expected, "{backend:?}: {got}");
        }
        let files = |t: &ferry_iceberg::IcebergTable| {
            let t = t.clone();
            async move {
                t.files()
                    .await
                    .expect("files")
                    .into_iter()
                    .filter(|f| f.path.contains("/data/p=a/"))
                    .count()
            }
        };
        assert_eq!(files(&table).await, parts_a);

        // Merges replace partition "a"'s parts; exported again, forced.
        let mergers = merge_away(&[&a, &b], "a", parts_a).await;
        for m in mergers {
            m.abort();
        }
        let (merged, rows_after) = active_rows(&*a.replica.lock().await, "a");
        assert_eq!(rows_after, rows_a);
        // Not forced, as an export policy asks (replacing the finished
        // task): the merged parts hold the rows the table holds already, so
        // nothing is written.
        let mut unforced = iceberg("a", false);
        unforced.replace_finished = true;
        let same = w.export(&a, &unforced).await.expect("unforced");
        assert!(same.unchanged.is_some(), "{same:?}");
        assert_eq!(table.current().await.expect("read").expect("a table").0, 2);
        let created = w.export(&a, &iceberg("a", true)).await.expect("forced");
        assert!(created.unchanged.is_none(), "{created:?}");
        let done = wait_terminal(&mut a.view, &created.transaction_id).await;
        assert_eq!(done.status, TaskStatus::Completed, "{backend:?}: {done:?}");
        let (version, meta) = table.current().await.expect("read").expect("a table");
        assert_eq!(version, 3);
        assert_eq!(
            meta.current_snapshot()
                .map(|s| s.summary["operation"].clone()),
            Some("overwrite".to_string())
        );
        assert_eq!(files(&table).await, merged);
        if let Some(got) = read(version).await {
            assert_eq!(got["pyiceberg"], expected, "{backend:?}: {got}");
            assert_eq!(got["duckdb"], expected, "{backend:?}: {got}");
            assert_eq!(got["pyiceberg_table"], expected, "{backend:?}: {got}");
        }
        let report = ferry_iceberg::verify::verify(&table)
            .await
            .expect("verify")
            .expect("a table");
        assert!(report.ok(), "{report:?}");
        assert_eq!(report.rows, rows_a + rows_b);
        w.session.close().await;
    }
}
