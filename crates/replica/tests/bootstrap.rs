//! A replica built from a peer's copy: it holds what the donor held at one
//! position and then applies WAL from there exactly like the donor (the
//! idempotency window and the decided merges came with it); a merge that
//! replaces a listed part during the copy does not remove it; a damaged byte
//! is refused; an interrupted copy resumes and is never opened as a new
//! replica; a built replica is never overwritten; a manifest that is not
//! one position is refused; and (with this file's history) merges wait
//! while the disk is nearly full.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // a real temp dir

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use ferry_env::{Cpu, Disk, SystemClock};
use ferry_replica::replica::bootstrap::{
    check_manifest, copy_from_peer, copy_unfinished, needs_copy, BootstrapError, BootstrapManifest,
    BootstrapSource, CopyCheck, LocalDonor, PartBytes,
};
use ferry_replica::{PartName, Replica, ReplicaError, SharedReplica};
use ferry_wal::Lsn;

mod common;
use common::{merge_all, names, rows, tables, Wal};

async fn open_as(disk: &Arc<dyn Disk>, dir: &str, replica: u32) -> Replica {
    Replica::open(Arc::clone(disk), dir, 0, replica, Cpu::Inline, tables())
        .await
        .expect("open replica")
}

fn donor(r: &SharedReplica) -> LocalDonor {
    LocalDonor {
        replica: Arc::clone(r),
        clock: Arc::new(SystemClock),
        name: "donor".into(),
    }
}

/// 20 keyed inserts into two partitions: merges decided on the way.
fn history() -> (Wal, Bytes) {
    let mut wal = Wal::default();
    for i in 0..20i64 {
        wal.insert(
            1,
            0,
            &format!("k{i}"),
            rows(i * 10..i * 10 + 10, &["x", "y"]),
        );
    }
    let all = wal.bytes.clone().freeze();
    (wal, all)
}

/// Work run on the donor before the first part travels.
type DonorWork = Box<dyn FnOnce(SharedReplica) -> tokio::task::JoinHandle<()> + Send>;

/// A source that passes the donor on, and may damage a byte, stop after
/// some parts, or run something on the donor before the first part.
struct Faulty {
    inner: LocalDonor,
    flip_byte_of_part: Option<usize>,
    fail_after_parts: Option<usize>,
    parts_served: AtomicUsize,
    before_first_part: tokio::sync::Mutex<Option<DonorWork>>,
}

impl Faulty {
    fn new(inner: LocalDonor) -> Faulty {
        Faulty {
            inner,
            flip_byte_of_part: None,
            fail_after_parts: None,
            parts_served: AtomicUsize::new(0),
            before_first_part: tokio::sync::Mutex::new(None),
        }
    }
}

struct Flipped(Box<dyn PartBytes>, bool);

#[async_trait]
impl PartBytes for Flipped {
    async fn next_chunk(&mut self) -> Result<Option<Bytes>, String> {
        let chunk = self.0.next_chunk().await?;
        Ok(chunk.map(|c| {
            // A byte of the file (the last chunk is the donor's crc32c).
            if c.len() > 4 && std::mem::take(&mut self.1) {
                let mut v = c.to_vec();
                v[c.len() / 3] ^= 0x10;
                Bytes::from(v)
            } else {
                c
            }
        }))
    }
}

#[async_trait]
impl BootstrapSource for Faulty {
    fn donor(&self) -> String {
        self.inner.donor()
    }
    async fn manifest(&self, shard: u32, replica: u32) -> Result<BootstrapManifest, String> {
        self.inner.manifest(shard, replica).await
    }
    async fn part(
        &self,
        hold: &str,
        table_id: u64,
        name: &PartName,
    ) -> Result<Box<dyn PartBytes>, String> {
        if let Some(f) = self.before_first_part.lock().await.take() {
            f(Arc::clone(&self.inner.replica))
                .await
                .expect("donor work");
        }
        let n = self.parts_served.fetch_add(1, Ordering::SeqCst);
        if self.fail_after_parts.is_some_and(|k| n >= k) {
            return Err("the donor went away".into());
        }
        let bytes = self.inner.part(hold, table_id, name).await?;
        Ok(Box::new(Flipped(bytes, self.flip_byte_of_part == Some(n))))
    }
    async fn release(&self, hold: &str) -> Result<(), String> {
        self.inner.release(hold).await
    }
}

#[tokio::test]
async fn a_copied_replica_goes_on_from_the_donors_position_like_the_donor() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let (_, all) = history();
    let mut d = open_as(&disk, "d", 0).await;
    let cut = all.len() * 3 / 4;
    d.receive(Lsn(0), &all[..cut]).await.expect("apply");
    // One merge done, one decided and pending: both kinds travel.
    let job = d.next_merge().expect("a merge decided");
    let merge = job.merge.clone();
    let meta = job.run().await.expect("merge");
    d.finish_merge(&merge, meta).await.expect("finish");
    let pending = d.subscribe().borrow().pending_merges;
    assert!(pending >= 1, "a merge still pending");
    let position = d.disk_consistent_lsn();
    let d: SharedReplica = Arc::new(tokio::sync::Mutex::new(d));

    assert!(needs_copy(disk.as_ref(), "n").await.expect("look"));
    let done = copy_from_peer(&disk, "n", 0, 1, Cpu::Inline, CopyCheck::Rows, &donor(&d))
        .await
        .expect("copy");
    assert_eq!(done.disk_consistent_lsn, position);
    assert_eq!(done.copied, done.parts);
    assert!(d.lock().await.bootstrap_holds().is_empty(), "hold released");
    let mut n = open_as(&disk, "n", 1).await;
    assert_eq!(n.disk_consistent_lsn(), position);
    assert_eq!(names(&n), names(&*d.lock().await), "the donor's parts");
    assert_eq!(n.subscribe().borrow().pending_merges, pending);

    // The rest of the WAL and a retry of an early key (the window came
    // too): both skip it, both decide and run the same merges.
    let mut more = Wal::default();
    more.bytes.extend_from_slice(&all);
    more.insert(1, 0, "k3", rows(30..40, &["x", "y"]));
    more.insert(1, 0, "k20", rows(900..905, &["y"]));
    let rest = more.bytes.clone().freeze();
    let mut d = d.lock().await;
    for r in [&mut *d, &mut n] {
        let at = r.receive_from();
        r.receive(at, &rest[at.0 as usize..]).await.expect("rest");
        merge_all(r).await;
    }
    assert_eq!(names(&n), names(&d));
    assert_eq!(n.subscribe().borrow().records_skipped_duplicate, 1);
    assert_eq!(n.parts(1).iter().map(|p| p.rows).sum::<u64>(), 205);
    for p in d.parts(1) {
        let file = |r: &str| {
            std::fs::read(dir.path().join(format!("{r}/parts/1/{}.parquet", p.name))).expect("part")
        };
        assert_eq!(file("d"), file("n"), "{}: same bytes", p.name);
    }

    // A built replica is never overwritten.
    let e = copy_from_peer(
        &disk,
        "n",
        0,
        1,
        Cpu::Inline,
        CopyCheck::Rows,
        &donor(&Arc::new(tokio::sync::Mutex::new(
            open_as(&disk, "d2", 0).await,
        ))),
    )
    .await
    .expect_err("has state");
    assert!(matches!(e, BootstrapError::HasState { .. }), "{e}");
    assert_eq!(names(&open_as(&disk, "n", 1).await), names(&d));
}

#[tokio::test]
async fn a_merge_during_the_copy_keeps_the_listed_parts_until_the_hold_ends() {
    let (_dir, disk) = ferry_testkit::disk::temp_disk();
    let (_, all) = history();
    let mut d = open_as(&disk, "d", 0).await;
    d.receive(Lsn(0), &all).await.expect("apply");
    let d: SharedReplica = Arc::new(tokio::sync::Mutex::new(d));
    let source = Faulty::new(donor(&d));
    // Before the first part travels, the donor runs its merges and removes
    // every replaced part it may: the held ones stay.
    *source.before_first_part.lock().await = Some(Box::new(|r: SharedReplica| {
        tokio::spawn(async move {
            let mut r = r.lock().await;
            let replaced = merge_all(&mut r).await;
            assert!(!replaced.is_empty());
            let removable = r.release_replaced(&replaced);
            assert!(
                removable.is_empty(),
                "held parts are not released: {removable:?}"
            );
        })
    }));
    copy_from_peer(&disk, "n", 0, 1, Cpu::Inline, CopyCheck::Rows, &source)
        .await
        .expect("copy");
    let mut n = open_as(&disk, "n", 1).await;
    merge_all(&mut n).await;
    let mut d = d.lock().await;
    assert_eq!(
        names(&n),
        names(&d),
        "the copy catches up with the donor's merges"
    );
    // The hold is gone: the replaced parts go to the merge task.
    let freed = d.take_replaced();
    assert!(!freed.is_empty());
    assert_eq!(d.release_replaced(&freed).len(), freed.len());
}

#[tokio::test]
async fn a_damaged_byte_is_refused_and_an_interrupted_copy_resumes() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let (_, all) = history();
    let mut d = open_as(&disk, "d", 0).await;
    d.receive(Lsn(0), &all).await.expect("apply");
    let d: SharedReplica = Arc::new(tokio::sync::Mutex::new(d));

    // A byte changed on the way fails the crc32c, whatever else is checked.
    for check in [CopyCheck::Rows, CopyCheck::Footers] {
        let mut damaged = Faulty::new(donor(&d));
        damaged.flip_byte_of_part = Some(2);
        let e = copy_from_peer(&disk, "n", 0, 1, Cpu::Inline, check, &damaged)
            .await
            .expect_err("damaged");
        assert!(
            matches!(&e, BootstrapError::Damaged { detail, .. } if detail.contains("crc32c")),
            "{check:?}: {e}"
        );
    }
    assert!(
        !dir.path().join("n/state").exists(),
        "no state: not a replica"
    );
    assert!(d.lock().await.bootstrap_holds().is_empty(), "hold released");

    let mut cut = Faulty::new(donor(&d));
    cut.fail_after_parts = Some(4);
    let e = copy_from_peer(&disk, "n", 0, 1, Cpu::Inline, CopyCheck::Rows, &cut)
        .await
        .expect_err("cut");
    assert!(matches!(e, BootstrapError::Source { .. }), "{e}");
    assert!(!dir.path().join("n/state").exists());
    // The unfinished copy is not a new replica: opening it is refused and
    // changes nothing (a new replica would apply the WAL from 0/0 over the
    // copied merged parts).
    assert!(copy_unfinished(disk.as_ref(), "n").await.expect("look"));
    let listing = |d: &std::path::Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d.join("n/parts/1"))
            .expect("parts")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let before = listing(dir.path());
    assert!(!before.is_empty(), "the cut copy left parts");
    let refused = Replica::open(Arc::clone(&disk), "n", 0, 1, Cpu::Inline, tables())
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(&refused, ReplicaError::CopyUnfinished { dir } if dir == "n"),
        "{refused}"
    );
    assert_eq!(listing(dir.path()), before, "refusing changed nothing");
    // A file no manifest lists is removed by the next copy.
    std::fs::write(dir.path().join("n/parts/1/stray.parquet.tmp"), b"torn").expect("tmp");

    let done = copy_from_peer(&disk, "n", 0, 1, Cpu::Inline, CopyCheck::Rows, &donor(&d))
        .await
        .expect("copy");
    assert!(
        done.copied < done.parts && done.copied > 0,
        "the checked parts of the interrupted copy are kept: {done:?}"
    );
    assert!(!dir.path().join("n/parts/1/stray.parquet.tmp").exists());
    assert!(!copy_unfinished(disk.as_ref(), "n").await.expect("look"));
    assert!(
        !dir.path().join("n/copy-unfinished").exists(),
        "marker gone"
    );
    let n = open_as(&disk, "n", 1).await;
    assert_eq!(names(&n), names(&*d.lock().await));
}

/// Parts without a state file and without a copy's marker (a copy made
/// before copies were marked, or files put there by hand) are records not
/// recorded as applied, merged ones too: the replica applies the WAL from
/// 0/0 and holds each row once, like the replica it came from.
#[tokio::test]
async fn parts_past_the_recorded_position_are_written_again_merged_ones_too() {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let (_, all) = history();
    let mut d = open_as(&disk, "d", 0).await;
    d.receive(Lsn(0), &all).await.expect("apply");
    merge_all(&mut d).await;
    let merged = names(&d)
        .iter()
        .filter(|(n, ..)| !n.ends_with("_0"))
        .count();
    assert!(merged > 0, "a merged part: {:?}", names(&d));
    drop(d);
    let copy = |from: &std::path::Path, to: &std::path::Path| {
        std::fs::create_dir_all(to).expect("mkdir");
        for e in std::fs::read_dir(from).expect("list") {
            let e = e.expect("entry");
            std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
        }
    };
    copy(&dir.path().join("d/parts/1"), &dir.path().join("x/parts/1"));
    let mut x = open_as(&disk, "x", 0).await;
    assert!(names(&x).is_empty(), "no part opened: {:?}", names(&x));
    x.receive(Lsn(0), &all).await.expect("apply");
    merge_all(&mut x).await;
    let d = open_as(&disk, "d", 0).await;
    assert_eq!(names(&x), names(&d));
    assert_eq!(x.parts(1).iter().map(|p| p.rows).sum::<u64>(), 200);
}

#[tokio::test]
async fn a_manifest_that_is_not_one_position_is_refused() {
    let (_dir, disk) = ferry_testkit::disk::temp_disk();
    let (_, all) = history();
    let mut d = open_as(&disk, "d", 0).await;
    d.receive(Lsn(0), &all).await.expect("apply");
    let m = d.bootstrap_manifest("h", 0).await.expect("manifest");
    check_manifest(&m, 0).expect("consistent");
    assert!(check_manifest(&m, 1)
        .expect_err("shard")
        .contains("shard 0"));
    // The state of an earlier position beside the parts of this one.
    let mut earlier = m.clone();
    earlier.disk_consistent_lsn = Lsn(m.parts[3].max_lsn.0);
    assert!(check_manifest(&earlier, 0).is_err());
    // A pending merge whose sources are not there.
    let mut lost = m.clone();
    let merge = lost.merges.first().expect("a pending merge").clone();
    lost.parts.retain(|p| p.name != merge.sources[0]);
    assert!(check_manifest(&lost, 0)
        .expect_err("source")
        .contains("needs part"));
    // A window entry from after the position.
    let mut late = m.clone();
    late.window.push((1, 0, "k".into(), m.disk_consistent_lsn));
    assert!(check_manifest(&late, 0).is_err());
    // A name that is no part's (names become paths).
    let mut hostile = m.clone();
    hostile.parts[0].name.partition_id = "x/../../state".into();
    assert!(check_manifest(&hostile, 0)
        .expect_err("name")
        .contains("not a part name"));
    // A part and the part that replaced it.
    let mut both = m.clone();
    let mut merged = both.parts[0].clone();
    merged.name = PartName::parse(&format!(
        "{}_{}_{}_1",
        merged.name.partition_id, merged.name.min_block, merged.name.max_block
    ))
    .expect("name");
    both.parts.push(merged);
    assert!(check_manifest(&both, 0)
        .expect_err("replaced")
        .contains("replaced"));
}

/// With the disk nearly full no merge starts (a merge writes its result
/// before the parts it replaces go); the merges decided meanwhile run once
/// space returns.
#[tokio::test]
async fn merges_wait_while_the_disk_is_nearly_full() {
    let (_dir, disk) = ferry_testkit::disk::temp_disk();
    let (_, all) = history();
    let mut r = open_as(&disk, "m", 0).await;
    r.receive(Lsn(0), &all).await.expect("apply");
    let pending = r.subscribe().borrow().pending_merges;
    assert!(pending > 0, "merges decided");
    let mut status = r.subscribe();
    let r: SharedReplica = Arc::new(tokio::sync::Mutex::new(r));
    let space = ferry_env::space::SpaceBreaker::new("replica 0", 100 << 20);
    space.observe(Some(1 << 20));
    let merges = tokio::spawn(ferry_replica::replica::run_merges_with_space(
        Arc::clone(&r),
        std::time::Duration::from_secs(60),
        Some(space.clone()),
    ));
    // A bounded look: a merger that ignored the breaker would have done the
    // first merge by then.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(r.lock().await.subscribe().borrow().merges_done, 0);
    space.observe(Some(1 << 30));
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        status.wait_for(|s| s.pending_merges == 0 && s.merges_done > 0),
    )
    .await
    .expect("the merges run once space returned")
    .expect("status");
    merges.abort();
}
