//! The composite disk operations (atomic replacement, tree removal, sequential
//! writing) and the newer primitives (metadata, hard links, directory
//! removal), run on the simulated disk with a crash at every step.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use ferry_env::{is_being_removed, remove_tree, Disk, Metadata, SequentialWriter};
use ferry_sim::disk::SimDisk;
use ferry_testkit::disk::{DiskHook, DiskOp, HookedDisk};
use rand::rngs::SmallRng;
use rand::SeedableRng;

/// The process dies at the disk's `limit`-th operation: that operation and
/// every later one fail, as if the node had crashed right there.
struct DieAt {
    ops: AtomicUsize,
    limit: usize,
}

#[async_trait]
impl DiskHook for DieAt {
    async fn before(&self, _: DiskOp<'_>) -> io::Result<()> {
        if self.ops.fetch_add(1, Ordering::SeqCst) >= self.limit {
            return Err(io::Error::other("crashed"));
        }
        Ok(())
    }
}

fn dying(disk: &SimDisk, limit: usize) -> HookedDisk {
    HookedDisk::new(
        Arc::new(disk.clone()),
        Arc::new(DieAt {
            ops: AtomicUsize::new(0),
            limit,
        }),
    )
}

#[tokio::test]
async fn atomic_replacement_is_old_or_new_after_a_crash_at_any_step() {
    let mut outcomes = std::collections::BTreeSet::new();
    for limit in 0..12 {
        for tear in [false, true] {
            let disk = SimDisk::new();
            disk.create_dir_all("d").await.expect("mkdir");
            disk.write_atomic("d/f", b"old contents".to_vec())
                .await
                .expect("first version");
            let d = dying(&disk, limit);
            let done = d.write_atomic("d/f", b"new".to_vec()).await.is_ok();
            disk.crash(&mut SmallRng::seed_from_u64(limit as u64), tear);
            let got = disk.read("d/f").await.expect("the file is always there");
            assert!(
                got == b"old contents" || got == b"new",
                "crash at step {limit}: {got:?}"
            );
            if done {
                assert_eq!(got, b"new", "a completed replacement survives");
            }
            outcomes.insert(got);
            // A leftover temporary file does not stop the next replacement.
            disk.write_atomic("d/f", b"again".to_vec())
                .await
                .expect("after a crash");
            assert_eq!(disk.read("d/f").await.expect("read"), b"again");
        }
    }
    assert_eq!(outcomes.len(), 2, "both outcomes reached: {outcomes:?}");
}

async fn make_tree(disk: &SimDisk) {
    disk.create_dir_all("parts/p1/sub").await.expect("mkdir");
    for path in ["parts/p1/a", "parts/p1/b", "parts/p1/sub/c"] {
        let f = disk.create_new(path).await.expect("create");
        f.write_at(0, Bytes::from_static(b"data"))
            .await
            .expect("write");
        f.sync_data().await.expect("sync");
    }
    disk.sync_dir("parts/p1").await.expect("sync");
    disk.sync_dir("parts/p1/sub").await.expect("sync");
}

#[tokio::test]
async fn tree_removal_is_whole_or_marked_after_a_crash_at_any_step() {
    let mut finished_at = None;
    for limit in 0..40 {
        let disk = SimDisk::new();
        make_tree(&disk).await;
        let d = dying(&disk, limit);
        let done = remove_tree(&d, "parts/p1").await.is_ok();
        disk.crash(&mut SmallRng::seed_from_u64(limit as u64), true);
        let exists = disk.metadata("parts/p1").await.is_ok();
        if done {
            assert!(!exists, "a completed removal survives");
            finished_at.get_or_insert(limit);
            continue;
        }
        if exists && !is_being_removed(&disk, "parts/p1").await.expect("marker") {
            // Not marked: then it must be whole.
            let mut names = disk.list_dir("parts/p1").await.expect("ls");
            names.sort();
            assert_eq!(names, ["a", "b", "sub"], "crash at step {limit}");
            assert_eq!(disk.list_dir("parts/p1/sub").await.expect("ls"), ["c"]);
        } else if exists {
            // Marked: finishing the removal works from any state.
            remove_tree(&disk, "parts/p1").await.expect("finish");
            assert!(disk.metadata("parts/p1").await.is_err());
        }
    }
    assert!(
        finished_at.is_some(),
        "the removal completes given the steps"
    );
}

#[tokio::test]
async fn hard_links_keep_a_file_after_its_first_name_is_gone() {
    let disk = SimDisk::new();
    disk.create_dir_all("parts").await.expect("mkdir");
    disk.create_dir_all("keep").await.expect("mkdir");
    disk.write_atomic("parts/p", b"part data".to_vec())
        .await
        .expect("write");
    disk.hard_link("parts/p", "keep/p").await.expect("link");
    disk.sync_dir("keep").await.expect("sync");
    disk.remove_file("parts/p").await.expect("remove");
    disk.sync_dir("parts").await.expect("sync");
    disk.crash(&mut SmallRng::seed_from_u64(1), false);
    assert_eq!(disk.read("keep/p").await.expect("read"), b"part data");
    assert!(disk.metadata("parts/p").await.is_err());
    assert_eq!(
        disk.metadata("keep/p").await.expect("meta"),
        Metadata {
            len: 9,
            is_dir: false
        }
    );
    // An unsynced link is lost with a crash.
    disk.hard_link("keep/p", "parts/again").await.expect("link");
    disk.crash(&mut SmallRng::seed_from_u64(2), false);
    assert!(disk.metadata("parts/again").await.is_err());
    let err = disk.remove_dir("keep").await.expect_err("not empty");
    assert_eq!(err.kind(), io::ErrorKind::DirectoryNotEmpty);
}

#[tokio::test]
async fn a_sequential_writer_holds_at_most_its_buffer() {
    let disk = SimDisk::new();
    disk.create_dir_all("d").await.expect("mkdir");
    let file = disk.create_new("d/big").await.expect("create");
    let mut w = SequentialWriter::new(file, 1000);
    let data: Vec<u8> = (0..25_000u32).map(|i| (i % 251) as u8).collect();
    for chunk in data.chunks(333) {
        w.write(chunk).await.expect("write");
    }
    w.write_bytes(Bytes::from(vec![9u8; 5000]))
        .await
        .expect("write");
    assert_eq!(w.len(), 30_000);
    assert_eq!(w.finish().await.expect("finish"), 30_000);
    disk.sync_dir("d").await.expect("sync");
    disk.crash(&mut SmallRng::seed_from_u64(3), true);
    let got = disk.read("d/big").await.expect("read");
    assert_eq!(&got[..25_000], &data[..]);
    assert!(got[25_000..].iter().all(|&b| b == 9));
    assert_eq!(
        disk.read_range("d/big", 24_990, 20).await.expect("range"),
        [&data[24_990..], &[9u8; 10][..]].concat()
    );
}

/// The control file after a crash at any step of a run of writes (in place
/// into a slot, and one that outgrows its slots and replaces the file), the
/// unsynced sectors kept or not at random: it holds the last state whose
/// write returned, or the one being written, never anything else, and it
/// takes writes again.
#[tokio::test]
async fn the_control_file_is_the_last_written_state_or_the_next_after_a_crash_at_any_step() {
    use ferry_safekeeper::control::{ControlFile, RegisteredReplica, SafekeeperState};
    use ferry_wal::{ClusterId, Lsn};

    let fresh = SafekeeperState::new(ClusterId::new("c").expect("id"), 1, 1, 16 << 20);
    let states: Vec<SafekeeperState> = (1..=8u64)
        .map(|i| {
            let mut s = fresh.clone();
            s.term = i;
            s.commit_lsn = Lsn(i * 100);
            if i >= 5 {
                // Outgrows a one-block slot: the file is replaced whole.
                s.registered_replicas = (0..600)
                    .map(|r| RegisteredReplica {
                        shard_number: r,
                        replica_number: r,
                        remote_consistent_lsn: Lsn(u64::MAX - u64::from(r)),
                    })
                    .collect();
            }
            s
        })
        .collect();
    let (mut torn, mut in_flight_kept, mut in_flight_lost) = (0, 0, 0);
    for limit in 0..40 {
        for seed in 0..12u64 {
            let disk = SimDisk::new();
            ControlFile::create(Arc::new(disk.clone()), "sk", fresh.clone())
                .await
                .expect("create");
            let d: Arc<dyn Disk> = Arc::new(dying(&disk, limit));
            let mut acknowledged = fresh.clone();
            let mut in_flight = None;
            if let Ok(mut cf) = ControlFile::open(d, "sk").await {
                for state in &states {
                    if cf.persist(state).await.is_err() {
                        in_flight = Some(state.clone());
                        break;
                    }
                    acknowledged = state.clone();
                }
            }
            disk.crash(
                &mut SmallRng::seed_from_u64(limit as u64 * 1000 + seed),
                seed % 4 != 0,
            );
            let mut cf = ControlFile::open(Arc::new(disk.clone()), "sk")
                .await
                .unwrap_or_else(|e| panic!("step {limit} seed {seed}: {e}"));
            let got = cf.state().clone();
            if Some(&got) == in_flight.as_ref() {
                in_flight_kept += 1;
            } else {
                assert_eq!(got, acknowledged, "step {limit} seed {seed}");
                in_flight_lost += usize::from(in_flight.is_some());
            }
            let mut next = got.clone();
            next.term += 100;
            cf.persist(&next).await.expect("a write after the crash");
            let reopened = ControlFile::open(Arc::new(disk.clone()), "sk")
                .await
                .expect("reopen");
            assert_eq!(reopened.state(), &next);
            torn += disk.crash_stats().torn;
        }
    }
    assert!(torn > 0, "some crashes tore a slot");
    assert!(
        in_flight_kept > 0 && in_flight_lost > 0,
        "{in_flight_kept} {in_flight_lost}"
    );
}
