//! The policy runner's tables are independent: a table whose round hangs
//! (its replicas never apply the commit position) does not hold back
//! another table's rounds; a policy removed from the catalog ends its
//! table's rounds and frees its lock; stopping the runner frees them all.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferry_coord::embedded::EmbeddedStore;
use ferry_coord::{CoordMetrics, CreateMode, EmbeddedSessions, RenewingSession, SessionFactory};
use ferry_env::SystemClock;
use ferry_export::dest::SourcePart;
use ferry_export::local::{SnapshotError, SnapshotRequest};
use ferry_export::model::TABLES;
use ferry_export::policy::{
    CommitPosition, MaintenanceSink, PolicyRunner, PolicyStatus, POLICY_LOCKS,
};
use ferry_export::{ExportsView, LocalParts, StorageDestinations};
use ferry_replica::{PartMeta, PartName};
use ferry_table::def::{ExportDefaults, ExportPolicy, LakeFormat};
use ferry_table::Table;
use ferry_testkit::table::id_p_table;
use ferry_wal::Lsn;
use tokio::sync::watch;

/// The slow table's snapshots wait until released; every other table has
/// no parts.
struct Parts {
    slow: String,
    released: watch::Sender<bool>,
    slow_snapshots: AtomicUsize,
}

#[async_trait]
impl LocalParts for Parts {
    async fn snapshot(&self, req: &SnapshotRequest) -> Result<Vec<PartMeta>, SnapshotError> {
        if req.table.def.name == self.slow {
            self.slow_snapshots.fetch_add(1, Ordering::SeqCst);
            let mut released = self.released.subscribe();
            let _ = released.wait_for(|r| *r).await;
        }
        Ok(Vec::new())
    }
    async fn find(&self, _table_id: u64, _name: &PartName) -> Option<SourcePart> {
        None
    }
    async fn pin(&self, _tx: &str, _table_id: u64, _names: &[PartName]) -> Result<(), String> {
        Ok(())
    }
    async fn unpin(&self, _tx: &str) -> Result<(), String> {
        Ok(())
    }
    async fn pinned(&self) -> Vec<String> {
        Vec::new()
    }
}

fn policy_table(id: u64, name: &str, lake: &std::path::Path) -> Table {
    let mut t = id_p_table(id, name, 1, &[]);
    t.def.export = Some(ExportDefaults {
        format: LakeFormat::Parquet,
        policy: Some(ExportPolicy {
            to: format!("file://{}", lake.join(name).display()),
            freshness_seconds: 1,
            retention_seconds: None,
        }),
    });
    t
}

/// Waits (up to 30 s) until the published status satisfies `ok`.
async fn wait_status(
    status: &mut watch::Receiver<PolicyStatus>,
    ok: impl Fn(&PolicyStatus) -> bool,
) {
    tokio::time::timeout(Duration::from_secs(30), status.wait_for(|s| ok(s)))
        .await
        .expect("the policy status in time")
        .expect("the runner publishes");
}

#[tokio::test]
async fn a_table_whose_round_hangs_holds_back_no_other_table() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let lake = dir.path().join("lake");
    let store = EmbeddedStore::open(Arc::clone(&disk), "coord", Default::default())
        .await
        .expect("store");
    let sessions: Arc<dyn SessionFactory> = Arc::new(EmbeddedSessions {
        store,
        timeout: Duration::from_secs(5),
        metrics: Arc::new(CoordMetrics::default()),
    });
    let admin = sessions.open().await.expect("session");
    ferry_coord::create_all(admin.as_ref(), TABLES)
        .await
        .expect("catalog");
    // Tables are taken in name order: the slow one comes first.
    for (id, name) in [(1, "a_slow"), (2, "b_fast")] {
        let t = policy_table(id, name, &lake);
        admin
            .create(
                &format!("{TABLES}/{name}"),
                &serde_json::to_vec(&t).expect("json"),
                CreateMode::Persistent,
            )
            .await
            .expect("table");
    }
    let parts = Arc::new(Parts {
        slow: "a_slow".into(),
        released: watch::channel(false).0,
        slow_snapshots: AtomicUsize::new(0),
    });
    let commit_lsn: CommitPosition = Arc::new(|| Box::pin(async { Ok(Lsn(0)) }));
    let maintain: MaintenanceSink =
        Arc::new(|_, _| Box::pin(async { Err("no writer in this test".to_string()) }));
    let roots = ferry_storage::LocalRoots::new([lake.clone()]).expect("roots");
    let (_view_tx, view) = watch::channel(ExportsView::default());
    let runner = PolicyRunner {
        session: RenewingSession::open(Arc::clone(&sessions))
            .await
            .expect("session"),
        sessions: Arc::clone(&sessions),
        parts: Arc::clone(&parts) as Arc<dyn LocalParts>,
        destinations: Arc::new(StorageDestinations::new(Default::default(), roots)),
        replica_name: "r0".into(),
        clock: Arc::new(SystemClock),
        commit_lsn,
        maintain,
        target_file_bytes: 1 << 20,
        upkeep: Default::default(),
        view,
        seed: 7,
    };
    let (status_tx, mut status) = watch::channel(PolicyStatus::default());
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(runner.run(status_tx, stop_rx));

    // The fast table completes rounds (two, so not just one that raced
    // ahead) while the slow table's first round still waits.
    wait_status(&mut status, |s| {
        s.tables
            .get("b_fast")
            .is_some_and(|t| t.running_here && t.last_round_unix_ms > 0)
    })
    .await;
    let first = status.borrow().tables["b_fast"].last_round_unix_ms;
    wait_status(&mut status, |s| {
        s.tables
            .get("b_fast")
            .is_some_and(|t| t.last_round_unix_ms > first)
    })
    .await;
    assert_eq!(parts.slow_snapshots.load(Ordering::SeqCst), 1);
    assert!(
        !status.borrow().tables.contains_key("a_slow"),
        "the slow table's round has not ended"
    );

    // Released, the slow table's round ends and publishes.
    parts.released.send_replace(true);
    wait_status(&mut status, |s| {
        s.tables
            .get("a_slow")
            .is_some_and(|t| t.running_here && t.last_round_unix_ms > 0)
    })
    .await;

    // The fast table's policy goes: its status and its lock go with it.
    let mut fast = policy_table(2, "b_fast", &lake);
    fast.def.export = None;
    admin
        .set(
            &format!("{TABLES}/b_fast"),
            &serde_json::to_vec(&fast).expect("json"),
            None,
        )
        .await
        .expect("update");
    wait_status(&mut status, |s| !s.tables.contains_key("b_fast")).await;
    let locks = |admin: ferry_coord::Session| async move {
        admin
            .children(POLICY_LOCKS)
            .await
            .map(|(c, _)| c)
            .unwrap_or_default()
    };
    assert_eq!(locks(admin.clone()).await, vec!["a_slow".to_string()]);

    // Its owner gone (the stop channel closed), the runner stops and frees
    // every lock (`Policies::stop` sends true; the sim and ferry dev test that).
    drop(stop);
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the runner stops")
        .expect("no panic");
    assert!(locks(admin).await.is_empty());
}
