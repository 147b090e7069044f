//! A simulated disk: what was not synced is lost on a crash.
//!
//! File contents become durable with `sync_data`, directory entries (creations,
//! renames, removals) with `sync_dir` of their directory; directories themselves
//! are durable at once (ferry creates them at start-up only). A crash reverts every
//! file to its last synced contents, optionally keeping a random prefix of the
//! unsynced bytes appended after it (a torn write), and every directory to its last
//! synced entries. Stalls delay every operation until a virtual time.
//!
//! A torn crash keeps a random subset of the unsynced 512-byte sectors of a file
//! (the page cache writes back in no particular order, a sector is atomic):
//! sectors overwritten in place come back old or new, and a file grown by
//! unsynced writes may keep a later sector but lose an earlier one (a hole of
//! zeros).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use ferry_env::{Disk, DiskFile, Metadata};
use rand::rngs::SmallRng;
use rand::Rng;
use std::time::Duration;

use rand::SeedableRng;
use tokio::time::Instant;

#[derive(Debug, Default, Clone)]
struct FileData {
    synced: Vec<u8>,
    current: Vec<u8>,
}

/// How long simulated disk operations take: each draws a duration from its
/// range (virtual time), so that a crash can land inside an operation, between
/// a write and its fsync. Off (zero) unless set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLatency {
    pub write: (Duration, Duration),
    pub sync: (Duration, Duration),
    /// Metadata operations: create, rename, remove, list, directory sync.
    pub meta: (Duration, Duration),
}

impl DiskLatency {
    /// A fast SSD: writes of tens of microseconds, fsyncs of a fraction of a
    /// millisecond to a few milliseconds.
    pub fn ssd() -> DiskLatency {
        DiskLatency {
            write: (Duration::from_micros(5), Duration::from_micros(80)),
            sync: (Duration::from_micros(150), Duration::from_millis(3)),
            meta: (Duration::from_micros(20), Duration::from_micros(500)),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum OpKind {
    Write,
    Sync,
    Meta,
}

/// What crashes found on this disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrashStats {
    pub crashes: u64,
    /// Crashes that found unsynced file data or directory entries.
    pub found_unsynced: u64,
    /// Unsynced bytes the crashes dropped (file data past what was synced).
    pub bytes_lost: u64,
    /// Crashes that tore a file (kept some unsynced sectors, not others).
    pub torn: u64,
    /// Operations a crashed process's tasks tried after its crash (they
    /// never complete; see [`SimDisk::for_process`]).
    pub fenced_ops: u64,
}

#[derive(Debug, Default)]
struct State {
    files: BTreeMap<u64, FileData>,
    next_id: u64,
    current: BTreeMap<String, u64>,
    synced: BTreeMap<String, u64>,
    dirs: BTreeSet<String>,
    stall_until: Option<Instant>,
    /// Every sync fails (a dying disk or controller).
    failing: bool,
    /// The free space it reports (`None`: unknown, as a disk without limit).
    free_bytes: Option<u64>,
    fsyncs: u64,
    latency: Option<(DiskLatency, SmallRng)>,
    crash_stats: CrashStats,
    /// Power cuts so far: the process running on the disk between two of
    /// them is one incarnation.
    incarnation: u64,
}

/// One node's simulated disk; clones share it (it outlives node crashes).
#[derive(Debug, Clone, Default)]
pub struct SimDisk {
    state: Arc<Mutex<State>>,
    /// Woken whenever a write leaves data unsynced.
    wrote: Arc<tokio::sync::Notify>,
    /// The incarnation of the process this handle was given to
    /// ([`SimDisk::for_process`]); `None`: the simulator's own handle, never
    /// fenced.
    process: Option<u64>,
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn parent(path: &str) -> &str {
    path.rfind('/').map_or("", |i| &path[..i])
}

fn not_found(path: &str) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("{path}: no such file"))
}

impl SimDisk {
    pub fn new() -> SimDisk {
        SimDisk::default()
    }

    /// The handle a process started now runs on. A crash ends a process at
    /// once, but a task of it the simulator could not abort (a connection
    /// task an HTTP server spawned, say) would run on; through this handle,
    /// from the power cut on, its disk operations never complete, as
    /// nothing of a dead process reaches its disk. Without the fence such a
    /// task writes after the crash, over state the restarted process
    /// already read: a replica's state file recorded parts the crash had
    /// lost.
    pub fn for_process(&self) -> SimDisk {
        SimDisk {
            state: Arc::clone(&self.state),
            wrote: Arc::clone(&self.wrote),
            process: Some(lock(&self.state).incarnation),
        }
    }

    /// Loses everything not synced, as a power cut would. With `tear`, a file
    /// with unsynced writes keeps a random subset of their sectors.
    pub fn crash(&self, rng: &mut SmallRng, tear: bool) {
        let mut s = lock(&self.state);
        let unsynced_entries = s.current != s.synced;
        let mut unsynced_bytes = 0u64;
        let mut unsynced_files = false;
        for (path, id) in &s.current {
            if let Some(f) = s.files.get(id) {
                if f.current != f.synced && s.synced.get(path) == Some(id) {
                    unsynced_files = true;
                    unsynced_bytes += f.current.len().abs_diff(f.synced.len()) as u64
                        + f.current
                            .iter()
                            .zip(&f.synced)
                            .filter(|(a, b)| a != b)
                            .count() as u64;
                }
            }
        }
        s.crash_stats.crashes += 1;
        if unsynced_entries || unsynced_files {
            s.crash_stats.found_unsynced += 1;
        }
        s.crash_stats.bytes_lost += unsynced_bytes;
        let mut torn_any = false;
        s.current = s.synced.clone();
        let live: BTreeSet<u64> = s.current.values().copied().collect();
        s.files.retain(|id, _| live.contains(id));
        for file in s.files.values_mut() {
            let torn = tear
                && file.current.len() >= file.synced.len()
                && file.current != file.synced
                && rng.random_bool(0.5);
            if torn {
                file.synced = tear_sectors(&file.synced, &file.current, rng);
                torn_any = true;
            }
            file.current = file.synced.clone();
        }
        if torn_any {
            s.crash_stats.torn += 1;
        }
        s.stall_until = None;
        s.incarnation += 1;
    }

    /// Loses every file and directory under `prefix` (a data dir lost with
    /// its disk, or deleted by mistake); the node must be down.
    pub fn lose(&self, prefix: &str) {
        let mut s = lock(&self.state);
        let under = |path: &String| path == prefix || path.starts_with(&format!("{prefix}/"));
        s.current.retain(|path, _| !under(path));
        s.synced.retain(|path, _| !under(path));
        s.dirs.retain(|path| !under(path));
        let live: BTreeSet<u64> = s
            .current
            .values()
            .chain(s.synced.values())
            .copied()
            .collect();
        s.files.retain(|id, _| live.contains(id));
    }

    /// Disk operations take time from now on (`None`: none), drawn with `seed`.
    pub fn set_latency(&self, latency: Option<DiskLatency>, seed: u64) {
        lock(&self.state).latency = latency.map(|l| (l, SmallRng::seed_from_u64(seed)));
    }

    /// Waits (at most `limit`) until a write leaves data unsynced, so that a
    /// crash right after lands between a write and its fsync. True if one did.
    pub async fn wait_for_unsynced_write(&self, limit: Duration) -> bool {
        tokio::time::timeout(limit, self.wrote.notified())
            .await
            .is_ok()
    }

    /// What the crashes of this disk found so far.
    pub fn crash_stats(&self) -> CrashStats {
        lock(&self.state).crash_stats
    }

    /// From now on every `sync_data` and `sync_dir` fails, and a failed
    /// `sync_data` loses the file's unsynced writes (as Linux may drop dirty
    /// pages after a failed fsync): code that carries on after such an error,
    /// or retries the fsync, loses data it may have promised. `false` stands
    /// for a repaired disk.
    pub fn set_failing(&self, failing: bool) {
        lock(&self.state).failing = failing;
    }

    /// Whether syncs fail.
    pub fn failing(&self) -> bool {
        lock(&self.state).failing
    }

    /// The free space it reports from now on (`None`: unknown): what a
    /// disk-full breaker sees. Writes still succeed: the breaker must stop
    /// them before the disk really fills.
    pub fn set_free_bytes(&self, free: Option<u64>) {
        lock(&self.state).free_bytes = free;
    }

    /// The free space it reports (`None`: unknown).
    pub fn reported_free_bytes(&self) -> Option<u64> {
        lock(&self.state).free_bytes
    }

    /// Every operation waits until `until`.
    pub fn stall_until(&self, until: Instant) {
        lock(&self.state).stall_until = Some(until);
    }

    /// fsyncs so far (`sync_data` and `sync_dir`).
    pub fn fsyncs(&self) -> u64 {
        lock(&self.state).fsyncs
    }

    async fn stall(&self) {
        self.take_time(OpKind::Meta).await;
    }

    /// Waits out a stall, then the operation's own duration.
    async fn take_time(&self, kind: OpKind) {
        let (until, took) = {
            let mut s = lock(&self.state);
            let took = s.latency.as_mut().map(|(l, rng)| {
                let (lo, hi) = match kind {
                    OpKind::Write => l.write,
                    OpKind::Sync => l.sync,
                    OpKind::Meta => l.meta,
                };
                if hi > lo {
                    rng.random_range(lo..hi)
                } else {
                    lo
                }
            });
            (s.stall_until, took)
        };
        if let Some(until) = until {
            tokio::time::sleep_until(until).await;
        }
        if let Some(took) = took.filter(|t| !t.is_zero()) {
            tokio::time::sleep(took).await;
        }
        // Checked after the op's own time, right before its effect (the
        // caller takes the lock next, with no await between): an operation
        // a crash interrupted does not land either.
        if let Some(process) = self.process {
            let fenced = {
                let mut s = lock(&self.state);
                let fenced = s.incarnation != process;
                if fenced {
                    s.crash_stats.fenced_ops += 1;
                }
                fenced
            };
            if fenced {
                std::future::pending::<()>().await;
            }
        }
    }

    fn check_path(path: &str) -> io::Result<()> {
        if path.is_empty()
            || path.starts_with('/')
            || path.split('/').any(|c| c.is_empty() || c == "..")
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad path {path:?}"),
            ));
        }
        Ok(())
    }
}

/// Sector size of the torn-write model.
pub const SECTOR_BYTES: usize = 512;

/// `synced` with a random subset of the sectors in which `current` differs from
/// it; bytes between kept sectors past the old end read as zeros.
fn tear_sectors(synced: &[u8], current: &[u8], rng: &mut SmallRng) -> Vec<u8> {
    let mut out = synced.to_vec();
    for start in (0..current.len()).step_by(SECTOR_BYTES) {
        let end = (start + SECTOR_BYTES).min(current.len());
        let old_end = end.min(synced.len());
        let changed = start >= synced.len()
            || current[start..old_end] != synced[start..old_end]
            || end > synced.len();
        if changed && rng.random_bool(0.5) {
            if out.len() < end {
                out.resize(end, 0);
            }
            out[start..end].copy_from_slice(&current[start..end]);
        }
    }
    out
}

#[async_trait]
impl Disk for SimDisk {
    async fn free_bytes(&self) -> io::Result<Option<u64>> {
        Ok(lock(&self.state).free_bytes)
    }

    async fn create_dir_all(&self, path: &str) -> io::Result<()> {
        Self::check_path(path)?;
        self.stall().await;
        let mut s = lock(&self.state);
        let mut prefix = String::new();
        for part in path.split('/') {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(part);
            s.dirs.insert(prefix.clone());
        }
        Ok(())
    }

    async fn remove_dir(&self, path: &str) -> io::Result<()> {
        Self::check_path(path)?;
        self.stall().await;
        let mut s = lock(&self.state);
        if !s.dirs.contains(path) {
            return Err(not_found(path));
        }
        let occupied = s
            .current
            .keys()
            .chain(s.dirs.iter())
            .any(|p| parent(p) == path);
        if occupied {
            return Err(io::Error::new(
                io::ErrorKind::DirectoryNotEmpty,
                format!("{path}: directory not empty"),
            ));
        }
        s.dirs.remove(path);
        Ok(())
    }

    async fn metadata(&self, path: &str) -> io::Result<Metadata> {
        Self::check_path(path)?;
        self.stall().await;
        let s = lock(&self.state);
        if s.dirs.contains(path) {
            return Ok(Metadata {
                len: 0,
                is_dir: true,
            });
        }
        let id = s.current.get(path).ok_or_else(|| not_found(path))?;
        Ok(Metadata {
            len: s.files.get(id).map_or(0, |f| f.current.len() as u64),
            is_dir: false,
        })
    }

    async fn hard_link(&self, from: &str, to: &str) -> io::Result<()> {
        Self::check_path(from)?;
        Self::check_path(to)?;
        self.stall().await;
        let mut s = lock(&self.state);
        let id = *s.current.get(from).ok_or_else(|| not_found(from))?;
        if s.current.contains_key(to) {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, to.to_string()));
        }
        if !parent(to).is_empty() && !s.dirs.contains(parent(to)) {
            return Err(not_found(parent(to)));
        }
        s.current.insert(to.to_string(), id);
        Ok(())
    }

    async fn open(&self, path: &str) -> io::Result<Box<dyn DiskFile>> {
        Self::check_path(path)?;
        self.stall().await;
        let s = lock(&self.state);
        let id = *s.current.get(path).ok_or_else(|| not_found(path))?;
        Ok(Box::new(SimFile {
            disk: self.clone(),
            id,
        }))
    }

    async fn create_new(&self, path: &str) -> io::Result<Box<dyn DiskFile>> {
        Self::check_path(path)?;
        self.stall().await;
        let mut s = lock(&self.state);
        if s.current.contains_key(path) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                path.to_string(),
            ));
        }
        if !parent(path).is_empty() && !s.dirs.contains(parent(path)) {
            return Err(not_found(parent(path)));
        }
        let id = s.next_id;
        s.next_id += 1;
        s.files.insert(id, FileData::default());
        s.current.insert(path.to_string(), id);
        Ok(Box::new(SimFile {
            disk: self.clone(),
            id,
        }))
    }

    async fn read(&self, path: &str) -> io::Result<Vec<u8>> {
        Self::check_path(path)?;
        self.stall().await;
        let s = lock(&self.state);
        let id = s.current.get(path).ok_or_else(|| not_found(path))?;
        Ok(s.files
            .get(id)
            .map(|f| f.current.clone())
            .unwrap_or_default())
    }

    async fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        Self::check_path(from)?;
        Self::check_path(to)?;
        self.stall().await;
        let mut s = lock(&self.state);
        let id = s.current.remove(from).ok_or_else(|| not_found(from))?;
        s.current.insert(to.to_string(), id);
        Ok(())
    }

    async fn remove_file(&self, path: &str) -> io::Result<()> {
        Self::check_path(path)?;
        self.stall().await;
        let mut s = lock(&self.state);
        s.current.remove(path).ok_or_else(|| not_found(path))?;
        Ok(())
    }

    async fn list_dir(&self, path: &str) -> io::Result<Vec<String>> {
        Self::check_path(path)?;
        self.stall().await;
        let s = lock(&self.state);
        if !s.dirs.contains(path) {
            return Err(not_found(path));
        }
        let mut names: BTreeSet<String> = BTreeSet::new();
        for p in s.current.keys().chain(s.dirs.iter()) {
            if parent(p) == path {
                names.insert(p[path.len() + 1..].to_string());
            }
        }
        Ok(names.into_iter().collect())
    }

    async fn sync_dir(&self, path: &str) -> io::Result<()> {
        Self::check_path(path)?;
        // "." is the disk's root, whose entries have no parent component.
        let path = if path == "." { "" } else { path };
        self.take_time(OpKind::Sync).await;
        let mut s = lock(&self.state);
        if s.failing {
            return Err(io::Error::other("injected failure of a directory sync"));
        }
        s.synced.retain(|p, _| parent(p) != path);
        let entries: Vec<(String, u64)> = s
            .current
            .iter()
            .filter(|(p, _)| parent(p) == path)
            .map(|(p, id)| (p.clone(), *id))
            .collect();
        s.synced.extend(entries);
        s.fsyncs += 1;
        Ok(())
    }
}

#[derive(Debug)]
struct SimFile {
    disk: SimDisk,
    id: u64,
}

impl SimFile {
    fn with<T>(&self, f: impl FnOnce(&mut FileData) -> io::Result<T>) -> io::Result<T> {
        let mut s = lock(&self.disk.state);
        let file = s
            .files
            .get_mut(&self.id)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "file was lost in a crash"))?;
        f(file)
    }
}

#[async_trait]
impl DiskFile for SimFile {
    async fn read_at(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        self.disk.stall().await;
        self.with(|f| {
            let start = offset as usize;
            if start + len > f.current.len() {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "read past the end",
                ));
            }
            Ok(f.current[start..start + len].to_vec())
        })
    }

    async fn write_at(&self, offset: u64, data: bytes::Bytes) -> io::Result<()> {
        self.disk.take_time(OpKind::Write).await;
        self.with(|f| {
            let start = offset as usize;
            if f.current.len() < start + data.len() {
                f.current.resize(start + data.len(), 0);
            }
            f.current[start..start + data.len()].copy_from_slice(&data);
            Ok(())
        })?;
        self.disk.wrote.notify_waiters();
        Ok(())
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        self.disk.stall().await;
        self.with(|f| {
            f.current.resize(len as usize, 0);
            Ok(())
        })
    }

    async fn sync_data(&self) -> io::Result<()> {
        self.disk.take_time(OpKind::Sync).await;
        let failing = lock(&self.disk.state).failing;
        let result = self.with(|f| {
            if failing {
                f.current.clone_from(&f.synced);
                return Err(io::Error::other(
                    "injected fsync failure: unsynced writes lost",
                ));
            }
            f.synced.clone_from(&f.current);
            Ok(())
        });
        lock(&self.disk.state).fsyncs += 1;
        result
    }

    async fn size(&self) -> io::Result<u64> {
        self.disk.stall().await;
        self.with(|f| Ok(f.current.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// Creates `d/a` holding `synced` (its data and its entry synced), then
    /// appends `unsynced` to it without a sync.
    async fn synced_then_unsynced(
        disk: &SimDisk,
        synced: &'static [u8],
        unsynced: &'static [u8],
    ) -> Box<dyn DiskFile> {
        disk.create_dir_all("d").await.expect("mkdir");
        let f = disk.create_new("d/a").await.expect("create");
        f.write_at(0, bytes::Bytes::from_static(synced))
            .await
            .expect("write");
        f.sync_data().await.expect("sync");
        disk.sync_dir("d").await.expect("sync dir");
        f.write_at(synced.len() as u64, bytes::Bytes::from_static(unsynced))
            .await
            .expect("write");
        f
    }

    #[tokio::test]
    async fn unsynced_data_and_entries_are_lost() {
        let disk = SimDisk::new();
        let mut rng = SmallRng::seed_from_u64(1);
        let _f = synced_then_unsynced(&disk, b"durable", b" lost").await;
        let g = disk.create_new("d/b").await.expect("create");
        g.write_at(0, bytes::Bytes::from_static(b"synced data, unsynced entry"))
            .await
            .expect("write");
        g.sync_data().await.expect("sync");
        disk.rename("d/a", "d/c").await.expect("rename");
        disk.crash(&mut rng, false);
        assert_eq!(disk.list_dir("d").await.expect("ls"), vec!["a"]);
        assert_eq!(disk.read("d/a").await.expect("read"), b"durable");
        disk.write_atomic("d/x", b"atomic".to_vec())
            .await
            .expect("atomic");
        disk.crash(&mut rng, false);
        assert_eq!(disk.read("d/x").await.expect("read"), b"atomic");
    }

    #[tokio::test(start_paused = true)]
    async fn a_crashed_process_never_reaches_its_disk_again() {
        let disk = SimDisk::new();
        let mut rng = SmallRng::seed_from_u64(1);
        let old = disk.for_process();
        let f = synced_then_unsynced(&old, b"durable", b" lost").await;
        disk.crash(&mut rng, false);
        let new = disk.for_process();
        // The dead process's writes, through the disk or an open file,
        // never complete and change nothing.
        let late = Duration::from_secs(3600);
        let write = old.write_atomic("d/state", b"zombie".to_vec());
        assert!(tokio::time::timeout(late, write).await.is_err());
        let append = f.write_at(7, bytes::Bytes::from_static(b" zombie"));
        assert!(tokio::time::timeout(late, append).await.is_err());
        assert_eq!(disk.crash_stats().fenced_ops, 2);
        // The restarted process and the simulator's own handle see the disk
        // as the crash left it.
        assert_eq!(new.read("d/a").await.expect("read"), b"durable");
        assert_eq!(new.list_dir("d").await.expect("ls"), vec!["a"]);
        assert_eq!(disk.read("d/a").await.expect("read"), b"durable");
        new.write_atomic("d/state", b"alive".to_vec())
            .await
            .expect("the new process writes");
        // The simulator's own handle is never fenced.
        disk.crash(&mut rng, false);
        assert_eq!(disk.read("d/state").await.expect("read"), b"alive");
    }

    #[tokio::test]
    async fn a_failed_sync_loses_the_unsynced_writes() {
        let disk = SimDisk::new();
        let f = synced_then_unsynced(&disk, b"kept", b" lost").await;
        disk.set_failing(true);
        assert!(f.sync_data().await.is_err());
        assert!(disk.sync_dir("d").await.is_err());
        disk.set_failing(false);
        // A retried fsync succeeds, but the data is gone.
        f.sync_data().await.expect("sync");
        assert_eq!(disk.read("d/a").await.expect("read"), b"kept");
    }

    #[tokio::test]
    async fn tearing_keeps_a_subset_of_unsynced_sectors() {
        const S: usize = SECTOR_BYTES;
        let disk = SimDisk::new();
        disk.create_dir_all("d").await.expect("mkdir");
        let f = disk.create_new("d/a").await.expect("create");
        let base = bytes::Bytes::from(vec![1u8; 2 * S]);
        f.write_at(0, base.clone()).await.expect("write");
        f.sync_data().await.expect("sync");
        disk.sync_dir("d").await.expect("sync dir");
        let mut seen = BTreeSet::new();
        for seed in 0..64 {
            // Overwrite the second sector in place and append two more.
            f.write_at(S as u64, bytes::Bytes::from(vec![2u8; 3 * S]))
                .await
                .expect("write");
            let mut rng = SmallRng::seed_from_u64(seed);
            let d2 = SimDisk {
                state: Arc::clone(&disk.state),
                wrote: Arc::clone(&disk.wrote),
                process: None,
            };
            d2.crash(&mut rng, true);
            let data = disk.read("d/a").await.expect("read");
            assert!(data.len() == 2 * S || data.len() == 3 * S || data.len() == 4 * S);
            assert!(data[..S].iter().all(|&b| b == 1), "synced sector kept");
            let sectors: Vec<u8> = data.chunks(S).map(|c| c[0]).collect();
            for (i, chunk) in data.chunks(S).enumerate() {
                assert!(chunk.iter().all(|&b| b == chunk[0]), "sectors are atomic");
                assert!(
                    matches!((i, chunk[0]), (0, 1) | (1, 1 | 2) | (2, 0 | 2) | (3, 2)),
                    "sector {i} is old, new or a hole: {sectors:?}"
                );
            }
            seen.insert(sectors);
            // Back to the base for the next round.
            let f2 = disk.open("d/a").await.expect("open");
            f2.set_len(0).await.expect("truncate");
            f2.write_at(0, base.clone()).await.expect("write");
            f2.sync_data().await.expect("sync");
        }
        assert!(seen.len() > 4, "torn outcomes vary: {seen:?}");
    }
}
