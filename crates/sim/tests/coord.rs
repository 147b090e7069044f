//! Simulated coordination behaves like ZooKeeper under faults, and the embedded
//! store recovers from crashes of the simulated disk that tear its writes.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_coord::embedded::{EmbeddedOptions, EmbeddedSession, EmbeddedStore};
use ferry_coord::{CoordError, Coordination, CreateMode, SessionState};
use ferry_sim::coord::{CoordFaults, FaultySession, SimCoordination};
use ferry_sim::disk::SimDisk;
use ferry_testkit::disk::{DiskHook, DiskOp, HookedDisk};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[tokio::test(start_paused = true)]
async fn failure_after_apply_reports_connection_loss_but_applies() {
    let sim = SimCoordination::new(
        1,
        CoordFaults {
            fail_after_prob: 1.0,
            ..CoordFaults::default()
        },
    )
    .await
    .expect("sim");
    let s = sim
        .session("n1", Duration::from_secs(2))
        .await
        .expect("session");
    let err = s
        .create("/x", b"", CreateMode::Persistent)
        .await
        .expect_err("answer lost");
    assert!(err.is_connection_loss());
    sim.set_faults(CoordFaults::default());
    assert!(
        s.exists("/x").await.expect("exists").is_some(),
        "applied anyway"
    );
    assert!(matches!(
        s.create("/x", b"", CreateMode::Persistent).await,
        Err(CoordError::NodeExists { .. })
    ));
}

/// Simulated coordination without faults, drawn from `seed`, with a
/// session of node `a` that holds the ephemeral `path` and a session of
/// node `b` that watches it, both with `timeout`.
async fn a_holds(
    seed: u64,
    timeout: Duration,
    path: &str,
) -> (SimCoordination, Arc<FaultySession>, Arc<FaultySession>) {
    let sim = SimCoordination::new(seed, CoordFaults::default())
        .await
        .expect("sim");
    let a = sim.session("a", timeout).await.expect("session");
    let b = sim.session("b", timeout).await.expect("session");
    a.create(path, b"", CreateMode::Ephemeral)
        .await
        .expect("ephemeral");
    (sim, a, b)
}

#[tokio::test(start_paused = true)]
async fn short_partition_keeps_the_session_long_one_expires_it() {
    let (sim, a, b) = a_holds(2, Duration::from_secs(2), "/lock").await;

    sim.partition("a");
    assert!(a
        .get("/lock")
        .await
        .expect_err("cut off")
        .is_connection_loss());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    sim.repair_all();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        b.exists("/lock").await.expect("exists").is_some(),
        "healed in time: the session lives"
    );
    assert_eq!(*a.session_state().borrow(), SessionState::Connected);

    sim.partition("a");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        b.exists("/lock").await.expect("exists"),
        None,
        "expired with its ephemeral"
    );
    assert_eq!(*a.session_state().borrow(), SessionState::Expired);
    sim.repair_all();
    assert!(matches!(a.get("/").await, Err(CoordError::SessionExpired)));
}

#[tokio::test(start_paused = true)]
async fn crashed_node_keeps_its_ephemerals_until_the_timeout() {
    let (sim, a, b) = a_holds(3, Duration::from_secs(3), "/owned").await;
    sim.crash_node("a");
    drop(a);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        b.exists("/owned").await.expect("exists").is_some(),
        "not gone before the timeout"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        b.exists("/owned").await.expect("exists"),
        None,
        "gone after it"
    );
}

/// File syncs never return once `frozen` is set, so that a crash catches
/// the store between writing a group commit and syncing it.
struct Freeze(Arc<AtomicBool>);

#[async_trait]
impl DiskHook for Freeze {
    async fn before(&self, op: DiskOp<'_>) -> io::Result<()> {
        if matches!(op, DiskOp::SyncData(_)) && self.0.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// Opens the store on `disk`, with snapshots often enough that crashes also
/// hit new logs, and a session of it; setting the flag returned freezes the
/// disk's file syncs (see [`Freeze`]).
async fn open_store(
    disk: &SimDisk,
    seed: u64,
) -> (EmbeddedStore, EmbeddedSession, Arc<AtomicBool>) {
    let frozen = Arc::new(AtomicBool::new(false));
    let disk = Arc::new(HookedDisk::new(
        Arc::new(disk.clone()),
        Arc::new(Freeze(Arc::clone(&frozen))),
    ));
    let options = EmbeddedOptions {
        snapshot_every_txns: 40,
        ..EmbeddedOptions::default()
    };
    let store = EmbeddedStore::open(disk, "coord", options)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: recovery refused a crashed store: {e}"));
    let session = store
        .session(Duration::from_secs(30))
        .await
        .expect("session");
    (store, session, frozen)
}

/// An acknowledged create survived the crashes: `path` holds `data`.
async fn assert_kept(s: &dyn Coordination, seed: u64, path: &str, data: &[u8]) {
    let (got, _) = s
        .get(path)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: acknowledged {path} lost: {e}"));
    assert_eq!(got, data, "seed {seed}: {path}");
}

/// Acknowledged creates of one writer, in order: path and data.
type Writes = Vec<(String, Vec<u8>)>;

#[tokio::test(start_paused = true)]
async fn embedded_store_recovers_from_torn_group_commits() {
    const WRITERS: usize = 6;
    for seed in 0..24 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let disk = SimDisk::new();
        // Acknowledged writes per writer of each round, in order.
        let mut acked: Vec<Writes> = Vec::new();
        for round in 0..4 {
            let (store, s, frozen) = open_store(&disk, seed).await;
            for (w, writes) in acked.iter().enumerate() {
                for (path, data) in writes {
                    assert_kept(&s, seed, path, data).await;
                }
                // At most the one write in flight at the crash may be there too.
                let beyond = format!("/r{}-w{}-{:04}", w / WRITERS, w % WRITERS, writes.len() + 1);
                assert_eq!(
                    s.exists(&beyond).await.expect("exists"),
                    None,
                    "seed {seed}"
                );
            }
            drop(s);
            let mut tasks = Vec::new();
            let results: Vec<Arc<Mutex<Writes>>> = (0..WRITERS).map(|_| Arc::default()).collect();
            for (w, result) in results.iter().enumerate() {
                let s = store
                    .session(Duration::from_secs(30))
                    .await
                    .expect("session");
                let result = Arc::clone(result);
                let mut rng = SmallRng::seed_from_u64(rng.random());
                tasks.push(tokio::spawn(async move {
                    for i in 0.. {
                        tokio::time::sleep(Duration::from_micros(rng.random_range(0..3000))).await;
                        let path = format!("/r{round}-w{w}-{i:04}");
                        let len = rng.random_range(0..1500);
                        let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                        if s.create(&path, &data, CreateMode::Persistent)
                            .await
                            .is_err()
                        {
                            return;
                        }
                        result.lock().expect("lock").push((path, data));
                    }
                }));
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(5..80))).await;
            // The next group commit is written but never synced; then the power
            // goes, keeping a random subset of its sectors.
            frozen.store(true, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(10)).await;
            disk.crash(&mut rng, true);
            for task in tasks {
                task.abort();
                let _ = task.await;
            }
            drop(store);
            for result in results {
                acked.push(std::mem::take(&mut *result.lock().expect("lock")));
            }
        }
        let (store, s, _) = open_store(&disk, seed).await;
        let total: usize = acked.iter().map(Vec::len).sum();
        assert!(total > 20, "seed {seed}: only {total} acknowledged writes");
        for (path, data) in acked.iter().flatten() {
            assert_kept(&s, seed, path, data).await;
        }
        drop(s);
        store.shutdown().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_node_recovers_from_expiry_through_its_session_factory() {
    use ferry_coord::SessionFactory;
    let sim = SimCoordination::new(3, CoordFaults::default())
        .await
        .expect("sim");
    let factory = sim.factory("n1", Duration::from_secs(2));
    let old = factory.open().await.expect("session");
    old.create("/owner", b"", CreateMode::Ephemeral)
        .await
        .expect("ephemeral");
    // A partition longer than the session timeout expires it.
    sim.partition("n1");
    tokio::time::sleep(Duration::from_secs(5)).await;
    sim.repair_all();
    assert!(old.get("/").await.is_err(), "the old session is gone");
    let new = factory.open().await.expect("a new session");
    assert_ne!(new.session_id(), old.session_id());
    assert_eq!(new.exists("/owner").await.expect("exists"), None);
    new.create("/owner", b"", CreateMode::Ephemeral)
        .await
        .expect("taken again");
}
