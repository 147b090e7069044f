//! The insert API over HTTP with `ferry-client`, its records written to an
//! in-memory WAL and applied by a real replica: idempotency keys bound to the
//! rows they carried, and every record of an insert applied.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // a real temp dir

use ferry_testkit::table::FixedTables;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use ferry_client::{Client, ClientError};
use ferry_coord::embedded::EmbeddedStore;
use ferry_coord::EmbeddedSessions;
use ferry_env::{Cpu, Disk, RealDisk};
use ferry_ingest::{Api, ApiLimits, Catalog, IngestMetrics, InsertSink};
use ferry_replica::Replica;
use ferry_table::{Format, TableDef};
use ferry_wal::record::{self, Record};
use ferry_wal::Lsn;
use ferry_writer::driver::{Insert, Inserted, WriterError};

fn def() -> TableDef {
    ferry_testkit::table::id_d_toml(3).column("s", "Utf8").def()
}

/// Rows `ids` as NDJSON.
fn body(ids: std::ops::Range<i64>) -> Bytes {
    Bytes::from(
        ids.map(|i| {
            format!("{{\"id\":{i},\"d\":\"2024-01-02\",\"s\":\"row {i} padded to some length\"}}\n")
        })
        .collect::<String>(),
    )
}

/// A WAL in memory: every insert is a record at the end, committed at once.
#[derive(Default)]
struct MemWal(Mutex<BytesMut>);

impl MemWal {
    fn bytes(&self) -> Bytes {
        self.0.lock().expect("wal").clone().freeze()
    }

    fn inserts(&self) -> Vec<(u32, Bytes)> {
        ferry_testkit::wal::records(&self.bytes())
            .into_iter()
            .filter_map(|(_, rec)| match rec {
                Record::Insert {
                    shard,
                    idempotency_key,
                    ..
                }
                | Record::InsertParts {
                    shard,
                    idempotency_key,
                    ..
                } => Some((shard, idempotency_key)),
                _ => None,
            })
            .collect()
    }
}

#[async_trait]
impl InsertSink for MemWal {
    async fn insert(&self, inserts: Vec<Insert>) -> Result<Inserted, WriterError> {
        let mut wal = self.0.lock().expect("wal");
        let mut block_numbers = Vec::new();
        for i in inserts {
            let at = wal.len() as u64;
            i.into_record(at).encode(&mut wal);
            block_numbers.push(at);
        }
        Ok(Inserted {
            block_numbers,
            commit_lsn: Lsn(wal.len() as u64),
        })
    }
    async fn maintain(&self, record: ferry_wal::record::Maintenance) -> Result<Lsn, WriterError> {
        let mut wal = self.0.lock().expect("wal");
        record.into_record().encode(&mut wal);
        Ok(Lsn(wal.len() as u64))
    }
}

struct Node {
    client: Client,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// An API on `wal` (a new one, with an empty index of keys, is what a
/// restarted node has).
async fn node(catalog: &Catalog, wal: &Arc<MemWal>, limits: ApiLimits) -> Node {
    let mut registry = prometheus_client::registry::Registry::default();
    let api = Api::new(
        catalog.clone(),
        Arc::clone(wal) as Arc<dyn InsertSink>,
        Cpu::Inline,
        limits,
        IngestMetrics::register(&mut registry),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, ferry_ingest::api::router(api)).await;
    });
    let client =
        Client::new(&format!("http://{addr}"), None, Duration::from_secs(30)).expect("client");
    Node { client, server }
}

async fn catalog(dir: &std::path::Path) -> Catalog {
    let disk = Arc::new(RealDisk::open_root(dir).expect("disk"));
    let store = EmbeddedStore::open(disk, "coord", Default::default())
        .await
        .expect("store");
    let sessions = Arc::new(EmbeddedSessions {
        store,
        timeout: Duration::from_secs(10),
        metrics: Default::default(),
    });
    let catalog = Catalog::open(sessions).await.expect("catalog");
    catalog.create(&def()).await.expect("create table");
    catalog
}

/// Rows a fresh replica holds after applying all of `wal`.
/// A catalog in a new temporary directory (returned first, as it holds
/// the catalog's store) and an empty WAL.
async fn empty_cluster() -> (tempfile::TempDir, Catalog, Arc<MemWal>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let catalog = catalog(dir.path()).await;
    (dir, catalog, Arc::new(MemWal::default()))
}

async fn applied_rows(dir: &std::path::Path, catalog: &Catalog, wal: &MemWal) -> u64 {
    let table = catalog.get("t").await.expect("get").expect("table");
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir).expect("disk"));
    let name = format!("replica-{}", wal.bytes().len());
    let mut replica = Replica::open(
        disk,
        &name,
        ferry_replica::ALL_SHARDS,
        0,
        Cpu::Inline,
        Arc::new(FixedTables::new([table.clone()])),
    )
    .await
    .expect("replica");
    let wal = wal.bytes();
    replica.receive(Lsn(0), &wal).await.expect("apply");
    replica.parts(table.id).iter().map(|p| p.rows).sum()
}

fn api_error(result: Result<ferry_client::Inserted, ClientError>) -> (u16, String) {
    match result {
        Err(ClientError::Api { status, body }) => (status, body.kind),
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// A shard's rows over the record size are cut into several records; with a
/// key, each must carry its own record key, or a replica takes the second for
/// a retry of the first and skips it.
#[tokio::test]
async fn every_record_of_a_keyed_insert_cut_into_slices_is_applied() {
    let (dir, catalog, wal) = empty_cluster().await;
    let limits = ApiLimits {
        record_rows_bytes: 2048,
        ..ApiLimits::default()
    };
    let n = node(&catalog, &wal, limits).await;
    let inserted = n
        .client
        .insert_body("t", Format::Ndjson, body(0..600), Some("slices"))
        .await
        .expect("insert");
    assert_eq!((inserted.rows, inserted.deduplicated), (600, false));
    let records = wal.inserts();
    let mut per_shard: BTreeMap<u32, usize> = BTreeMap::new();
    for (shard, _) in &records {
        *per_shard.entry(*shard).or_default() += 1;
    }
    assert!(
        per_shard.values().all(|n| *n > 1),
        "each shard's rows were cut into several records: {per_shard:?}"
    );
    let keys: BTreeSet<&Bytes> = records.iter().map(|(_, k)| k).collect();
    assert_eq!(keys.len(), records.len(), "one key per record: {keys:?}");
    assert!(keys.iter().all(|k| k.starts_with(b"slices~")), "{keys:?}");
    assert_eq!(applied_rows(dir.path(), &catalog, &wal).await, 600);
}

/// A key reused with other rows is refused while the node remembers it, and
/// applied whole as new rows once it does not (a restart); a retry of the
/// same rows is answered from memory, or deduplicated by the replica.
#[tokio::test]
async fn a_key_is_bound_to_its_rows_and_never_half_applied() {
    let (dir, catalog, wal) = empty_cluster().await;
    let n = node(&catalog, &wal, ApiLimits::default()).await;
    let c = &n.client;
    let first = c
        .insert_body("t", Format::Ndjson, body(0..10), Some("k"))
        .await
        .expect("insert");
    assert!(!first.deduplicated);
    let end = wal.bytes().len();

    // The same rows again: the first answer, nothing written.
    let again = c
        .insert_body("t", Format::Ndjson, body(0..10), Some("k"))
        .await
        .expect("retry");
    assert!(again.deduplicated, "{again:?}");
    assert_eq!(
        (again.rows, &again.blocks, &again.commit_lsn),
        (10, &first.blocks, &first.commit_lsn)
    );
    assert_eq!(
        wal.bytes().len(),
        end,
        "a deduplicated retry writes nothing"
    );

    // Other rows under the same key: 409, nothing written.
    let (status, kind) = api_error(
        c.insert_body("t", Format::Ndjson, body(0..30), Some("k"))
            .await,
    );
    assert_eq!((status, kind.as_str()), (409, "idempotency_key_reused"));
    let reused = c
        .insert_body("t", Format::Ndjson, body(5..7), Some("k"))
        .await;
    assert!(
        reused.as_ref().err().is_some_and(ClientError::key_reused),
        "{reused:?}"
    );
    assert_eq!(wal.bytes().len(), end, "a refused reuse writes nothing");
    // The same key in another table would be another key; here, a new key works.
    c.insert_body("t", Format::Ndjson, body(100..103), Some("k2"))
        .await
        .expect("a new key");
    assert_eq!(applied_rows(dir.path(), &catalog, &wal).await, 13);

    // A restarted node has forgotten the keys: the retry is written again and
    // the replica skips it; the reuse with other rows (touching the shards of
    // the first and more) is applied whole, not in part.
    drop(n);
    let n = node(&catalog, &wal, ApiLimits::default()).await;
    let retry = n
        .client
        .insert_body("t", Format::Ndjson, body(0..10), Some("k"))
        .await
        .expect("retry after a restart");
    assert!(!retry.deduplicated);
    assert!(wal.bytes().len() > end, "written again");
    assert_eq!(
        applied_rows(dir.path(), &catalog, &wal).await,
        13,
        "applied once"
    );
    // That retry is remembered again: the reuse is refused until the next restart.
    let reused = n
        .client
        .insert_body("t", Format::Ndjson, body(0..30), Some("k"))
        .await;
    assert!(
        reused.as_ref().err().is_some_and(ClientError::key_reused),
        "{reused:?}"
    );
    drop(n);
    let n = node(&catalog, &wal, ApiLimits::default()).await;
    n.client
        .insert_body("t", Format::Ndjson, body(0..30), Some("k"))
        .await
        .expect("a reuse the node does not remember");
    assert_eq!(
        applied_rows(dir.path(), &catalog, &wal).await,
        43,
        "the reuse is applied whole as new rows"
    );
}

#[tokio::test]
async fn idempotency_keys_longer_than_200_bytes_are_refused() {
    let (_dir, catalog, wal) = empty_cluster().await;
    let n = node(&catalog, &wal, ApiLimits::default()).await;
    let long = "k".repeat(201);
    let (status, kind) = api_error(
        n.client
            .insert_body("t", Format::Ndjson, body(0..3), Some(&long))
            .await,
    );
    assert_eq!((status, kind.as_str()), (400, "invalid_idempotency_key"));
    assert!(wal.bytes().is_empty());
    n.client
        .insert_body("t", Format::Ndjson, body(0..3), Some(&long[..200]))
        .await
        .expect("200 bytes fit");
    for (_, key) in wal.inserts() {
        assert!(key.len() <= record::MAX_IDEMPOTENCY_KEY_BYTES);
    }
}

/// The writer's upkeep endpoint (what an export policy asks for): a record
/// of another table id, a malformed body or a zero target is refused and
/// writes nothing; a well-formed compaction and retirement are appended.
#[tokio::test]
async fn upkeep_records_are_checked_before_they_reach_the_wal() {
    use ferry_wal::record::{Compaction, Maintenance, Retirement};
    let (_dir, catalog, wal) = empty_cluster().await;
    let n = node(&catalog, &wal, ApiLimits::default()).await;
    let id = catalog.get("t").await.expect("get").expect("table t").id;
    let status_of = |e: ferry_client::ClientError| match e {
        ferry_client::ClientError::Api { status, body } => (status, body.kind),
        other => panic!("{other}"),
    };
    let compact = |table_id, target_rows| {
        Maintenance::Compact(Compaction {
            table_id,
            partition_id: "a".into(),
            target_rows,
        })
    };
    let post = |m: serde_json::Value| {
        let client = n.client.clone();
        async move {
            client
                .post_json::<_, serde_json::Value>("/tables/t/maintenance", &m)
                .await
        }
    };
    let refused = [
        (serde_json::json!({"compact": {"table_id": id}}), 400),
        (
            serde_json::to_value(compact(id + 1, 10)).expect("json"),
            409,
        ),
        (serde_json::to_value(compact(id, 0)).expect("json"), 400),
    ];
    for (body, want) in refused {
        let (status, _) = status_of(post(body.clone()).await.expect_err("refused"));
        assert_eq!(status, want, "{body}");
    }
    assert!(wal.bytes().is_empty(), "nothing refused reached the WAL");
    let gone = n
        .client
        .post_json::<_, serde_json::Value>("/tables/nope/maintenance", &compact(id, 10))
        .await
        .expect_err("no table");
    assert_eq!(status_of(gone).0, 404);

    let retire = Maintenance::Retire(Retirement {
        table_id: id,
        partition_id: "a".into(),
        destination: "s3://lake/t".into(),
        format: "parquet".into(),
        commit: "p=a/commit_a_x.json".into(),
        files: Vec::new(),
    });
    for m in [compact(id, 10), retire] {
        let answer = post(serde_json::to_value(&m).expect("json"))
            .await
            .expect("appended");
        assert!(answer["commit_lsn"].is_string(), "{answer}");
    }
    let records: Vec<Record> = ferry_testkit::wal::records(&wal.bytes())
        .into_iter()
        .map(|(_, r)| r)
        .collect();
    assert!(
        matches!(&records[..], [Record::Compact(c), Record::Retire(r)] if c.target_rows == 10 && r.table_id == id),
        "{records:?}"
    );
}

/// A disk whose free space the test sets.
struct FreeSpace(std::sync::atomic::AtomicU64);

#[async_trait]
impl ferry_testkit::disk::DiskHook for FreeSpace {
    async fn before(&self, _: ferry_testkit::disk::DiskOp<'_>) -> std::io::Result<()> {
        Ok(())
    }
    fn free_bytes(&self) -> Option<u64> {
        Some(self.0.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// A table change the coordination store refuses for lack of disk space is
/// answered 503 `disk_full` and changes nothing; inserts (which only read
/// the catalog) go on; once space returns the change is taken.
#[tokio::test]
async fn a_table_change_refused_by_a_store_short_of_disk_answers_disk_full() {
    use std::sync::atomic::Ordering;
    const MIN_FREE: u64 = 100 << 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let free = Arc::new(FreeSpace(std::sync::atomic::AtomicU64::new(10 * MIN_FREE)));
    let disk = Arc::new(ferry_testkit::disk::HookedDisk::new(
        Arc::new(RealDisk::open_root(dir.path()).expect("disk")),
        Arc::clone(&free) as Arc<dyn ferry_testkit::disk::DiskHook>,
    ));
    let options = ferry_coord::embedded::EmbeddedOptions {
        min_free_disk: MIN_FREE,
        ..Default::default()
    };
    let store = EmbeddedStore::open(disk, "coord", options)
        .await
        .expect("store");
    let breaker = store.space().expect("a breaker").clone();
    let catalog = Catalog::open(Arc::new(EmbeddedSessions {
        store,
        timeout: Duration::from_secs(10),
        metrics: Default::default(),
    }))
    .await
    .expect("catalog");
    catalog.create(&def()).await.expect("create table");
    let wal = Arc::new(MemWal::default());
    let n = node(&catalog, &wal, ApiLimits::default()).await;
    let mut other = def();
    other.name = "u".into();

    free.0.store(MIN_FREE - 1, Ordering::SeqCst);
    let mut state = breaker.subscribe();
    tokio::time::timeout(Duration::from_secs(10), state.wait_for(Option::is_some))
        .await
        .expect("the breaker opens")
        .expect("breaker");
    for refused in [
        n.client.create_table(&other).await.map(|_| ()),
        n.client.drop_table("t").await.map(|_| ()),
    ] {
        match refused {
            Err(ClientError::Api { status, body }) => {
                assert_eq!((status, body.kind.as_str()), (503, "disk_full"), "{body:?}");
                assert!(
                    body.error.starts_with("disk_full: coordination store has "),
                    "{}",
                    body.error
                );
            }
            other => panic!("expected 503 disk_full, got {other:?}"),
        }
    }
    let tables: Vec<String> = n
        .client
        .tables()
        .await
        .expect("tables")
        .into_iter()
        .map(|t| t.def.name)
        .collect();
    assert_eq!(tables, ["t"], "nothing changed");
    let inserted = n
        .client
        .insert_body("t", Format::Ndjson, body(0..10), Some("while-full"))
        .await
        .expect("an insert reads the catalog only");
    assert_eq!(inserted.rows, 10);

    free.0.store(10 * MIN_FREE, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(10), state.wait_for(Option::is_none))
        .await
        .expect("the breaker closes")
        .expect("breaker");
    let (_, created) = n.client.create_table(&other).await.expect("taken again");
    assert!(created);
}
