//! Durability and failure behaviour of the embedded back-end: restart recovery,
//! torn tails, damage in the middle of the log, unsupported formats, corruption,
//! group commit, idle expiry, fail-stop, a disk short of space and `kill -9`.

// Tests set up and damage real files and sockets directly; node code may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferry_coord::embedded::{EmbeddedError, EmbeddedOptions, EmbeddedSession, EmbeddedStore};
use ferry_coord::{CoordError, Coordination, CreateMode, Op, SessionState};
use ferry_env::RealDisk;
use ferry_testkit::disk::{DiskHook, DiskOp, HookedDisk};

mod common;
use common::{create, ephemeral};

const DIR: &str = "coord";

fn small_snapshots() -> EmbeddedOptions {
    EmbeddedOptions {
        snapshot_every_txns: 25,
        ..EmbeddedOptions::default()
    }
}

async fn open(root: &Path, options: EmbeddedOptions) -> Result<EmbeddedStore, EmbeddedError> {
    let disk = Arc::new(RealDisk::open_root(root).expect("disk"));
    EmbeddedStore::open(disk, DIR, options).await
}

async fn session(store: &EmbeddedStore) -> EmbeddedSession {
    session_expiring(store, Duration::from_secs(5)).await
}

async fn session_expiring(store: &EmbeddedStore, timeout: Duration) -> EmbeddedSession {
    store.session(timeout).await.expect("session")
}

/// The store under `root` with the default options, opened (`what` says
/// which opening failed) with a session.
async fn open_session(root: &Path, what: &str) -> (EmbeddedStore, EmbeddedSession) {
    let store = open(root, EmbeddedOptions::default()).await.expect(what);
    let s = session(&store).await;
    (store, s)
}

/// The files in the store's directory.
fn files(root: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(root.join(DIR))
        .expect("ls")
        .map(|e| e.expect("entry").path())
        .collect()
}

/// The files in the store's directory whose name starts with `prefix`.
fn files_named(root: &Path, prefix: &str) -> Vec<std::path::PathBuf> {
    let mut named: Vec<_> = files(root)
        .into_iter()
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
        })
        .collect();
    named.sort();
    named
}

/// Rewrites the file at `path` as `damage` changes it.
fn rewrite(path: &Path, damage: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).expect("read");
    damage(&mut bytes);
    std::fs::write(path, &bytes).expect("write");
}

/// Reads every node under `/` as (path, data, version) in path order.
async fn dump(s: &dyn Coordination) -> Vec<(String, Vec<u8>, i32)> {
    dump_stats(s)
        .await
        .into_iter()
        .map(|(path, data, stat)| (path, data, stat.version))
        .collect()
}

/// A store under `root` with small snapshots, and a session that wrote
/// [`populate`]'s nodes.
async fn populated(root: &Path) -> (EmbeddedStore, EmbeddedSession) {
    let store = open(root, small_snapshots()).await.expect("open");
    let s = session(&store).await;
    populate(&s).await;
    (store, s)
}

async fn populate(s: &dyn Coordination) {
    create(s, "/data", b"root").await;
    for i in 0..60 {
        create(s, &format!("/data/n{i:03}"), format!("v{i}").as_bytes()).await;
    }
    for i in (0..60).step_by(3) {
        s.set(&format!("/data/n{i:03}"), b"changed", Some(0))
            .await
            .expect("set");
    }
    for i in (1..60).step_by(5) {
        s.delete(&format!("/data/n{i:03}"), None)
            .await
            .expect("delete");
    }
    s.multi(vec![
        Op::create(
            "/data/seq-",
            b"s".to_vec(),
            CreateMode::PersistentSequential,
        ),
        Op::set("/data", b"after multi".to_vec(), None),
    ])
    .await
    .expect("multi");
    ephemeral(s, "/data/eph").await;
}

#[tokio::test]
async fn restart_recovers_every_write_and_no_ephemeral() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, s) = populated(dir.path()).await;
    let mut before = dump(&s).await;
    let old_id = s.session_id();
    // Stop without closing the session: its ephemeral is still in the log.
    store.shutdown().await;
    drop(s);
    let files = files(dir.path()).len();
    assert!(files >= 2, "a snapshot and a log");

    let store = open(dir.path(), small_snapshots()).await.expect("reopen");
    let s = session(&store).await;
    assert_ne!(s.session_id(), old_id, "session ids are never reused");
    before.retain(|(p, _, _)| p != "/data/eph");
    assert_eq!(dump(&s).await, before);
    assert_eq!(s.exists("/data/eph").await.expect("exists"), None);
    // Sequence numbering goes on where it was.
    let (p, _) = s
        .create("/data/seq-", b"", CreateMode::PersistentSequential)
        .await
        .expect("seq");
    assert_eq!(p, "/data/seq-0000000062");
    store.shutdown().await;
}

/// Every node's data and stat, the root's included, as (path, data, stat).
async fn dump_stats(s: &dyn Coordination) -> Vec<(String, Vec<u8>, ferry_coord::Stat)> {
    let mut out = Vec::new();
    let mut stack = vec!["/".to_string()];
    while let Some(path) = stack.pop() {
        let (data, stat) = s.get(&path).await.expect("get");
        out.push((path.clone(), data, stat));
        let (children, _) = s.children(&path).await.expect("children");
        for c in children {
            stack.push(ferry_coord::path::join(&path, &c));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Data and stats of every node, the root's included, survive a restart from
/// the log alone, from a snapshot alone, and from a snapshot plus a log.
#[tokio::test]
async fn every_node_survives_every_snapshot_and_log_combination() {
    // (snapshot every n transactions, transactions after the writes below)
    for (every, tail) in [(1_000_000, 0), (4, 0), (4, 3), (1, 0)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = EmbeddedOptions {
            snapshot_every_txns: every,
            ..EmbeddedOptions::default()
        };
        let store = open(dir.path(), options.clone()).await.expect("open");
        let s = session(&store).await;
        s.set("/", b"root data", None).await.expect("set root");
        create(&s, "/a", b"a").await;
        s.set("/", b"root data, again", Some(1))
            .await
            .expect("set root");
        create(&s, "/a/b", b"bb").await;
        s.set("/a", b"a2", None).await.expect("set");
        for i in 0..tail {
            create(&s, &format!("/t{i}"), b"").await;
        }
        let before = dump_stats(&s).await;
        assert_eq!(before[0].1, b"root data, again");
        s.close().await;
        store.shutdown().await;
        let names: Vec<String> = files(dir.path())
            .iter()
            .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
            .collect();
        if every < 1_000_000 {
            assert!(
                names.iter().any(|n| n.starts_with("snapshot.")),
                "a snapshot was written: {names:?}"
            );
        }
        let store = open(dir.path(), options).await.expect("reopen");
        let s = session(&store).await;
        let after = dump_stats(&s).await;
        assert_eq!(after, before, "snapshot every {every}, {tail} after");
        store.shutdown().await;
    }
}

fn last_log(root: &Path) -> std::path::PathBuf {
    files_named(root, "log.").pop().expect("a log")
}

#[tokio::test]
async fn torn_tail_is_cut_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, s) = open_session(dir.path(), "open").await;
    create(&s, "/kept", b"1").await;
    create(&s, "/torn", b"2").await;
    s.close().await;
    store.shutdown().await;

    // A crash in the middle of an append: the last record is cut short, and
    // garbage follows.
    let log = last_log(dir.path());
    let len = std::fs::metadata(&log).expect("stat").len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&log)
        .expect("open log");
    file.set_len(len - 3).expect("truncate");
    drop(file);
    let (store, s) = open_session(dir.path(), "reopen").await;
    assert_eq!(s.get("/kept").await.expect("kept").0, b"1");
    // The torn record was the last transaction: it is dropped, the rest stays.
    assert_eq!(s.exists("/torn").await.expect("exists"), None);
    s.create("/after", b"3", CreateMode::Persistent)
        .await
        .expect("writes go on");
    store.shutdown().await;
    drop(s);

    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(last_log(dir.path()))
        .expect("open");
    io::Write::write_all(
        &mut file,
        &[0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    )
    .expect("garbage");
    drop(file);
    let (store, s) = open_session(dir.path(), "reopen after garbage").await;
    assert_eq!(s.get("/after").await.expect("after").0, b"3");
    store.shutdown().await;
}

#[tokio::test]
async fn damaged_snapshot_or_inner_log_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, s) = populated(dir.path()).await;
    store.shutdown().await;
    drop(s);
    let snapshot = files_named(dir.path(), "snapshot.")
        .into_iter()
        .next()
        .expect("a snapshot");
    rewrite(&snapshot, |bytes| {
        let at = bytes.len() / 2;
        bytes[at] ^= 0x40;
    });
    let err = open(dir.path(), small_snapshots())
        .await
        .expect_err("must refuse");
    assert!(matches!(err, EmbeddedError::Corrupt(_)), "{err}");
    assert!(err.to_string().contains("checksum"), "{err}");

    // A damaged record followed by more logs is not a torn tail.
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, s) = open_session(dir.path(), "open").await;
    create(&s, "/a", b"1").await;
    store.shutdown().await;
    drop(s);
    let first = last_log(dir.path());
    rewrite(&first, |bytes| {
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
    });
    std::fs::write(dir.path().join(DIR).join("log.00000000000000099999"), b"").expect("later log");
    let err = open(dir.path(), EmbeddedOptions::default())
        .await
        .expect_err("must refuse");
    assert!(matches!(err, EmbeddedError::Corrupt(_)), "{err}");
}

/// Everything in the store's directory, to set it back between cases.
fn save_dir(root: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    std::fs::read_dir(root.join(DIR))
        .expect("ls")
        .map(|e| {
            let p = e.expect("entry").path();
            let bytes = std::fs::read(&p).expect("read");
            (p, bytes)
        })
        .collect()
}

fn restore_dir(root: &Path, saved: &[(std::path::PathBuf, Vec<u8>)]) {
    std::fs::remove_dir_all(root.join(DIR)).expect("rm");
    std::fs::create_dir_all(root.join(DIR)).expect("mkdir");
    for (p, bytes) in saved {
        std::fs::write(p, bytes).expect("write");
    }
}

fn log_len(root: &Path) -> u64 {
    std::fs::metadata(last_log(root)).expect("stat").len()
}

/// Creates `/n000`.. one by one and returns the end of the log after each
/// acknowledgement: the create of `/n{i}` is the batch ending at `ends[i]`.
async fn sequential_writes(root: &Path, count: usize) -> Vec<u64> {
    let (store, s) = open_session(root, "open").await;
    let mut ends = vec![log_len(root)];
    for i in 0..count {
        create(&s, &format!("/n{i:03}"), format!("v{i}").as_bytes()).await;
        ends.push(log_len(root));
    }
    store.shutdown().await;
    drop(s);
    ends.remove(0);
    ends
}

async fn assert_refused_at(root: &Path, log: &Path, offset: u64) {
    let before = std::fs::read(log).expect("read");
    let err = open(root, EmbeddedOptions::default())
        .await
        .expect_err("mid-log damage must be refused");
    assert!(matches!(err, EmbeddedError::Corrupt(_)), "{err}");
    let msg = err.to_string();
    let name = log.file_name().expect("name").to_string_lossy();
    assert!(
        msg.contains(&format!("{DIR}/{name}")),
        "names the file: {msg}"
    );
    assert!(
        msg.contains(&format!("at byte {offset}:")),
        "names the offset {offset}: {msg}"
    );
    assert_eq!(std::fs::read(log).expect("read"), before, "nothing was cut");
}

#[tokio::test]
async fn damage_in_the_middle_of_the_log_is_refused_not_cut() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ends = sequential_writes(dir.path(), 100).await;
    let log = last_log(dir.path());
    let saved = save_dir(dir.path());

    // One flipped byte in the middle of the 50th write, 50 acknowledged
    // writes after it.
    let (start, end) = (ends[49], ends[50]);
    rewrite(&log, |bytes| bytes[((start + end) / 2) as usize] ^= 0x10);
    assert_refused_at(dir.path(), &log, start).await;

    // A damaged length field (bytes 4..8 of a batch header), whether it runs
    // past the end of the file or not.
    for len in [u32::MAX, 3] {
        restore_dir(dir.path(), &saved);
        rewrite(&log, |bytes| {
            bytes[start as usize + 4..start as usize + 8].copy_from_slice(&len.to_le_bytes())
        });
        assert_refused_at(dir.path(), &log, start).await;
    }

    // A write zeroed out, later writes intact.
    restore_dir(dir.path(), &saved);
    rewrite(&log, |bytes| bytes[start as usize..end as usize].fill(0));
    assert_refused_at(dir.path(), &log, start).await;

    // Undamaged, everything is there.
    restore_dir(dir.path(), &saved);
    let (store, s) = open_session(dir.path(), "reopen").await;
    assert_eq!(s.children("/").await.expect("children").0.len(), 100);
    store.shutdown().await;
}

#[tokio::test]
async fn torn_last_write_is_cut_whatever_survives_of_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ends = sequential_writes(dir.path(), 30).await;
    // The last write spans several 512-byte sectors.
    let (store, s) = open_session(dir.path(), "open").await;
    let start = log_len(dir.path());
    s.create("/torn", &[7u8; 4000], CreateMode::Persistent)
        .await
        .expect("create");
    let end = log_len(dir.path());
    store.shutdown().await;
    drop(s);
    assert!(end - start > 4000 && start > *ends.last().expect("writes"));
    let log = last_log(dir.path());
    let saved = save_dir(dir.path());
    let sector = |at: u64| (at / 512 * 512) as usize;

    type Tear = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Tear, bool)> = vec![
        (
            "cut short",
            Box::new(move |b| b.truncate(((start + end) / 2) as usize)),
            false,
        ),
        (
            "zeros after it",
            Box::new(|b| b.resize(b.len() + 8192, 0)),
            true,
        ),
        (
            "first sectors lost, later ones kept",
            Box::new(move |b| b[start as usize..sector(start) + 1024].fill(0)),
            false,
        ),
        (
            "a middle sector lost",
            Box::new(move |b| {
                let at = sector(start) + 2048;
                b[at..at + 512].fill(0);
            }),
            false,
        ),
        (
            "only the last sector kept",
            Box::new(move |b| b[start as usize..sector(end - 1)].fill(0)),
            false,
        ),
    ];
    for (case, tear, kept) in cases {
        restore_dir(dir.path(), &saved);
        rewrite(&log, tear);
        let (store, s) = open_session(dir.path(), case).await;
        for i in 0..30 {
            let (data, _) = s.get(&format!("/n{i:03}")).await.expect(case);
            assert_eq!(data, format!("v{i}").as_bytes(), "{case}");
        }
        assert_eq!(
            s.exists("/torn").await.expect("exists").is_some(),
            kept,
            "{case}"
        );
        s.create("/after", b"", CreateMode::Persistent)
            .await
            .expect("writes go on");
        store.shutdown().await;
        drop(s);
        let (store, s) = open_session(dir.path(), &format!("{case}, second restart")).await;
        assert!(
            s.exists("/after").await.expect("exists").is_some(),
            "{case}"
        );
        store.shutdown().await;
    }
}

#[tokio::test]
async fn log_of_an_unsupported_format_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join(DIR)).expect("mkdir");
    // A log as the first format wrote it: `len | crc32c | payload` records, no
    // file header.
    let log = dir.path().join(DIR).join("log.00000000000000000001");
    std::fs::write(&log, [3, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3]).expect("write");
    let err = open(dir.path(), EmbeddedOptions::default())
        .await
        .expect_err("must refuse");
    assert!(matches!(err, EmbeddedError::Corrupt(_)), "{err}");
    assert!(err.to_string().contains("unsupported log format"), "{err}");
    assert!(
        err.to_string().contains("coord/log.00000000000000000001"),
        "{err}"
    );
}

/// Counts file syncs and can be made to fail them.
struct SyncCounter {
    syncs: Arc<AtomicU64>,
    fail: Arc<AtomicBool>,
}

#[async_trait]
impl DiskHook for SyncCounter {
    async fn before(&self, op: DiskOp<'_>) -> io::Result<()> {
        if let DiskOp::SyncData(_) = op {
            if self.fail.load(Ordering::SeqCst) {
                return Err(io::Error::other("injected fsync failure"));
            }
            self.syncs.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// A store under `root` on a disk that counts syncs (the counter) and fails
/// them while the flag is set.
async fn instrumented(root: &Path) -> (EmbeddedStore, Arc<AtomicU64>, Arc<AtomicBool>) {
    let syncs = Arc::new(AtomicU64::new(0));
    let fail = Arc::new(AtomicBool::new(false));
    let disk = Arc::new(HookedDisk::new(
        Arc::new(RealDisk::open_root(root).expect("disk")),
        Arc::new(SyncCounter {
            syncs: Arc::clone(&syncs),
            fail: Arc::clone(&fail),
        }),
    ));
    let store = EmbeddedStore::open(disk, DIR, EmbeddedOptions::default())
        .await
        .expect("open");
    (store, syncs, fail)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_share_fsyncs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, syncs, _) = instrumented(dir.path()).await;
    let writers = 32;
    let per_writer = 20;
    let mut sessions = Vec::new();
    for _ in 0..writers {
        sessions.push(Arc::new(session(&store).await));
    }
    let before = syncs.load(Ordering::SeqCst);
    let mut tasks = Vec::new();
    for (w, s) in sessions.iter().enumerate() {
        let s = Arc::clone(s);
        tasks.push(tokio::spawn(async move {
            for i in 0..per_writer {
                create(&*s, &format!("/w{w}-{i}"), b"x").await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let used = syncs.load(Ordering::SeqCst) - before;
    let creates = (writers * per_writer) as u64;
    println!("{creates} acknowledged creates used {used} fsyncs");
    assert!(used > 0);
    assert!(
        used * 4 <= creates,
        "{creates} creates from {writers} writers used {used} fsyncs"
    );
    store.shutdown().await;
}

#[tokio::test]
async fn failed_fsync_stops_the_store_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _, fail) = instrumented(dir.path()).await;
    let s = session(&store).await;
    create(&s, "/acked", b"").await;
    fail.store(true, Ordering::SeqCst);
    let err = s
        .create("/unknown", b"", CreateMode::Persistent)
        .await
        .expect_err("fsync fails");
    assert!(err.is_connection_loss(), "outcome unknown: {err:?}");
    fail.store(false, Ordering::SeqCst);
    let err = s.get("/acked").await.expect_err("store stopped serving");
    assert!(err.is_connection_loss(), "{err:?}");
    store.shutdown().await;
    drop(s);
    let (store, s) = open_session(dir.path(), "reopen").await;
    assert!(s.exists("/acked").await.expect("exists").is_some());
    store.shutdown().await;
}

/// A disk whose free space the test sets, counting the writes that reach it.
struct Space {
    free: AtomicU64,
    writes: AtomicU64,
}

#[async_trait]
impl DiskHook for Space {
    async fn before(&self, op: DiskOp<'_>) -> io::Result<()> {
        if op.is_write() {
            self.writes.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
    fn free_bytes(&self) -> Option<u64> {
        Some(self.free.load(Ordering::SeqCst))
    }
}

const MIN_FREE: u64 = 100 << 20;

/// Waits (at most [`common::SOON`]) until the store's disk-full breaker is
/// open (`full`) or closed.
async fn breaker_is(store: &EmbeddedStore, full: bool) {
    let mut state = store.space().expect("a breaker").subscribe();
    tokio::time::timeout(common::SOON, state.wait_for(|s| s.is_some() == full))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the breaker did not become {}",
                if full { "open" } else { "closed" }
            )
        })
        .expect("breaker");
}

fn assert_disk_full(what: &str, r: Result<impl std::fmt::Debug, CoordError>) {
    let err = r.expect_err(what);
    assert!(
        matches!(err, CoordError::DiskFull(_)),
        "{what}: refused as disk full, not {err:?}"
    );
    assert!(
        err.is_disk_full() && !err.is_connection_loss(),
        "{what}: definite"
    );
    assert!(
        err.to_string()
            .starts_with("disk_full: coordination store has "),
        "{what}: {err}"
    );
}

#[tokio::test]
async fn a_store_short_of_disk_refuses_writes_changes_nothing_and_takes_them_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let space = Arc::new(Space {
        free: AtomicU64::new(10 * MIN_FREE),
        writes: AtomicU64::new(0),
    });
    let disk = Arc::new(HookedDisk::new(
        Arc::new(RealDisk::open_root(dir.path()).expect("disk")),
        Arc::clone(&space) as Arc<dyn DiskHook>,
    ));
    let options = EmbeddedOptions {
        min_free_disk: MIN_FREE,
        ..small_snapshots()
    };
    let store = EmbeddedStore::open(disk, DIR, options).await.expect("open");
    let s = session(&store).await;
    populate(&s).await;
    let closing = session(&store).await;
    ephemeral(&closing, "/data/closing").await;
    let acked = dump_stats(&s).await;

    // The free space drops below the minimum.
    space.free.store(MIN_FREE - 1, Ordering::SeqCst);
    breaker_is(&store, true).await;
    let writes = space.writes.load(Ordering::SeqCst);
    // Every kind of write is refused, a sequential create, an ephemeral
    // and a multi that would fail anyway included.
    assert_disk_full(
        "create",
        s.create("/new", b"x", CreateMode::Persistent).await,
    );
    assert_disk_full(
        "sequential create",
        s.create("/data/seq-", b"", CreateMode::PersistentSequential)
            .await,
    );
    assert_disk_full(
        "ephemeral",
        s.create("/eph", b"", CreateMode::Ephemeral).await,
    );
    assert_disk_full("set", s.set("/data", b"lost", None).await);
    assert_disk_full("delete", s.delete("/data/n000", None).await);
    assert_disk_full(
        "multi",
        s.multi(vec![
            Op::create("/m", b"".to_vec(), CreateMode::Persistent),
            Op::set("/data", b"lost".to_vec(), None),
        ])
        .await,
    );
    assert_disk_full(
        "failing multi",
        s.multi(vec![Op::check("/data", 99), Op::delete("/data/n002", None)])
            .await,
    );
    // Reads are served, and watches set with them.
    let (data, _, data_watch) = s.get_watch("/data").await.expect("get while full");
    assert_eq!(data, b"after multi");
    let (children, _, child_watch) = s.children_watch("/data").await.expect("children");
    assert!(children.contains(&"n000".to_string()), "{children:?}");
    assert!(s.exists("/new").await.expect("exists").is_none());
    // A new session opens and reads.
    let reader = session_expiring(&store, Duration::from_millis(500)).await;
    assert_eq!(dump_stats(&reader).await, acked, "nothing changed");
    assert_eq!(
        space.writes.load(Ordering::SeqCst),
        writes,
        "no refused write reached the disk"
    );
    // Keep-alives are served: a session with a short timeout outlives it
    // several times over while full.
    let mut reader_state = reader.session_state();
    let expired = tokio::time::timeout(
        Duration::from_secs(2),
        reader_state.wait_for(|s| s.is_terminal()),
    )
    .await;
    assert!(
        expired.is_err(),
        "the session expired: keep-alives were refused"
    );
    assert!(reader.get("/data").await.is_ok());
    // A close is served: it deletes its session's ephemeral.
    closing.close().await;
    assert!(s.exists("/data/closing").await.expect("exists").is_none());

    // Space returns: writes are taken again by themselves.
    space.free.store(10 * MIN_FREE, Ordering::SeqCst);
    breaker_is(&store, false).await;
    create(&s, "/after", b"back").await;
    let (seq, _) = s
        .create("/data/seq-", b"", CreateMode::PersistentSequential)
        .await
        .expect("sequential create");
    // The refused sequential create spent no number: populate's creates
    // under /data numbered 62, /data/closing one more.
    assert_eq!(seq, "/data/seq-0000000063");
    s.set("/data", b"changed after", None).await.expect("set");
    assert_eq!(
        tokio::time::timeout(common::SOON, data_watch.changed())
            .await
            .expect("the data watch set while full fires")
            .kind,
        ferry_coord::WatchEventKind::NodeDataChanged
    );
    assert_eq!(
        tokio::time::timeout(common::SOON, child_watch.changed())
            .await
            .expect("the child watch set while full fires")
            .kind,
        ferry_coord::WatchEventKind::NodeChildrenChanged
    );
    let mut expected = dump(&s).await;
    store.shutdown().await;
    drop((s, reader, closing));

    // Everything acknowledged, before and after, is there after a reopen;
    // nothing refused is.
    let (store, s) = open_session(dir.path(), "reopen").await;
    expected.retain(|(p, _, _)| p != "/data/eph");
    assert_eq!(dump(&s).await, expected);
    for refused in ["/new", "/eph", "/m"] {
        assert!(
            s.exists(refused).await.expect("exists").is_none(),
            "{refused}"
        );
    }
    assert!(s.exists("/data/n000").await.expect("exists").is_some());
    assert!(s.exists("/after").await.expect("exists").is_some());
    store.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn silent_session_expires_after_its_timeout() {
    let store = EmbeddedStore::in_memory(EmbeddedOptions::default())
        .await
        .expect("store");
    let quiet = session_expiring(&store, Duration::from_secs(2)).await;
    let other = session_expiring(&store, Duration::from_secs(2)).await;
    ephemeral(&quiet, "/e").await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(
        *quiet.session_state().borrow(),
        SessionState::Connected,
        "heartbeats keep it"
    );
    quiet.set_heartbeats_paused(true);
    let mut state = quiet.session_state();
    let started = tokio::time::Instant::now();
    state
        .wait_for(|s| *s == SessionState::Expired)
        .await
        .expect("expires");
    let waited = started.elapsed();
    // Expiry counts from the last heartbeat (at most a third of the timeout before
    // the suspension) and is noticed within the check interval (100 ms).
    assert!(
        waited >= Duration::from_millis(1300) && waited <= Duration::from_millis(2200),
        "{waited:?}"
    );
    assert_eq!(other.exists("/e").await.expect("exists"), None);
    assert!(matches!(
        quiet.get("/").await,
        Err(CoordError::SessionExpired)
    ));
}

/// Helper process for the kill -9 test: writes acknowledged nodes forever and
/// prints each acknowledged path. Run only by `kill_9_loses_no_acknowledged_write`.
#[tokio::test]
#[ignore = "helper process of kill_9_loses_no_acknowledged_write"]
async fn kill_9_helper() {
    let Ok(root) = std::env::var("FERRY_KILL9_DIR") else {
        return;
    };
    let store = open(Path::new(&root), small_snapshots())
        .await
        .expect("open");
    let s = session_expiring(&store, Duration::from_secs(30)).await;
    create(&s, "/acked", b"").await;
    ephemeral(&s, "/ephemeral").await;
    let mut i = 0u64;
    loop {
        let path = format!("/acked/{i:08}");
        create(&s, &path, &i.to_le_bytes()).await;
        println!("ACK {path}");
        i += 1;
    }
}

#[tokio::test]
async fn kill_9_loses_no_acknowledged_write() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("test binary");
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "kill_9_helper",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FERRY_KILL9_DIR", dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn helper");
    let stdout = child.stdout.take().expect("stdout");
    let mut acked = Vec::new();
    for line in io::BufReader::new(stdout).lines() {
        let line = line.expect("line");
        // The test harness may print on the same line before the first ACK.
        if let Some(at) = line.find("ACK ") {
            acked.push(line[at + 4..].to_string());
            if acked.len() == 400 {
                break;
            }
        }
    }
    // SIGKILL: no destructor, no flush, no session close.
    child.kill().expect("kill -9");
    child.wait().expect("reap");
    assert_eq!(acked.len(), 400, "helper acknowledged writes");

    let store = open(dir.path(), small_snapshots()).await.expect("recover");
    let s = session(&store).await;
    for (i, path) in acked.iter().enumerate() {
        assert_eq!(*path, format!("/acked/{i:08}"), "acknowledged in order");
        let (data, _) = s
            .get(path)
            .await
            .unwrap_or_else(|e| panic!("{path} lost: {e}"));
        assert_eq!(data, (i as u64).to_le_bytes());
    }
    assert_eq!(
        s.exists("/ephemeral").await.expect("exists"),
        None,
        "ephemeral of a dead session"
    );
    store.shutdown().await;
}
