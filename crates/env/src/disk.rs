//! The disk seam: files addressed by relative paths inside one node's data dir.

use std::fmt;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

/// A node's view of its local disk.
///
/// Paths are relative to the node's data dir and use `/` as separator; a path that
/// is absolute or climbs out of the data dir is refused with `InvalidInput`. Nothing
/// written is durable until [`DiskFile::sync_data`] (for file contents) or
/// [`Disk::sync_dir`] (for creations, renames and removals in a directory) returned:
/// a simulated disk loses exactly that on a crash, so code must call them wherever
/// durability is promised.
#[async_trait]
pub trait Disk: Send + Sync + fmt::Debug + 'static {
    /// Creates a directory and its missing parents, durably: on return every
    /// directory created survives a crash (their parents were synced).
    async fn create_dir_all(&self, path: &str) -> io::Result<()>;
    /// Removes an empty directory, durably (its parent is synced).
    async fn remove_dir(&self, path: &str) -> io::Result<()>;
    /// Size and kind of the entry at `path` (`NotFound` if there is none).
    async fn metadata(&self, path: &str) -> io::Result<Metadata>;
    /// A second name for the file at `from` (a hard link): both names reach
    /// the same contents, and the file lives on until both are removed. Keeps
    /// a part alive after the name it had is removed. Durable after `sync_dir`
    /// of `to`'s directory.
    async fn hard_link(&self, from: &str, to: &str) -> io::Result<()>;
    /// Opens an existing file for reading and writing.
    async fn open(&self, path: &str) -> io::Result<Box<dyn DiskFile>>;
    /// Creates a new empty file, failing with `AlreadyExists` if there is one.
    async fn create_new(&self, path: &str) -> io::Result<Box<dyn DiskFile>>;
    /// Reads a whole file.
    async fn read(&self, path: &str) -> io::Result<Vec<u8>>;
    /// Replaces `path` atomically and durably: writes `<path>.tmp`, syncs it,
    /// renames it over `path` and syncs the directory. After a crash the file holds
    /// either the old or the new contents, never a mix. Built from the other
    /// operations for every disk, so the simulator crash-tests this very sequence.
    async fn write_atomic(&self, path: &str, data: Vec<u8>) -> io::Result<()> {
        let tmp = format!("{path}.tmp");
        match self.remove_file(&tmp).await {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let file = self.create_new(&tmp).await?;
        file.write_at(0, Bytes::from(data)).await?;
        file.sync_data().await?;
        drop(file);
        self.rename(&tmp, path).await?;
        self.sync_dir(parent_dir(path)).await
    }
    /// Reads `len` bytes at `offset` of the file at `path`, without reading the
    /// rest of it.
    async fn read_range(&self, path: &str, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        self.open(path).await?.read_at(offset, len).await
    }
    /// Renames a file (durable after `sync_dir`).
    async fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    /// Removes a file (durable after `sync_dir`).
    async fn remove_file(&self, path: &str) -> io::Result<()>;
    /// Lists the names of the entries of a directory, sorted.
    async fn list_dir(&self, path: &str) -> io::Result<Vec<String>>;
    /// Makes creations, renames and removals in a directory durable.
    async fn sync_dir(&self, path: &str) -> io::Result<()>;
    /// Bytes an unprivileged writer can still write on the file system of
    /// the data dir (`None`: not known, as on a disk with no limit). What
    /// the disk-full breaker ([`crate::space`]) watches.
    async fn free_bytes(&self) -> io::Result<Option<u64>> {
        Ok(None)
    }
}

/// What [`Disk::metadata`] tells of an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metadata {
    /// Length in bytes (0 for a directory).
    pub len: u64,
    pub is_dir: bool,
}

/// The directory holding `path` (`.` for a top-level entry).
pub fn parent_dir(path: &str) -> &str {
    match path.rfind('/') {
        Some(i) => &path[..i],
        None => ".",
    }
}

/// An open file of a [`Disk`].
#[async_trait]
pub trait DiskFile: Send + Sync + fmt::Debug {
    /// Reads exactly `len` bytes at `offset` (`UnexpectedEof` if the file is shorter).
    async fn read_at(&self, offset: u64, len: usize) -> io::Result<Vec<u8>>;
    /// Writes all of `data` at `offset`, growing the file if needed. `Bytes`, so
    /// that WAL received from the network reaches the page cache without a copy.
    async fn write_at(&self, offset: u64, data: Bytes) -> io::Result<()>;
    /// Truncates or extends the file.
    async fn set_len(&self, len: u64) -> io::Result<()>;
    /// Makes every write so far durable.
    async fn sync_data(&self) -> io::Result<()>;
    /// Current length in bytes.
    async fn size(&self) -> io::Result<u64>;
    /// Tells the operating system that the file's synced contents will not be
    /// read soon: their page-cache memory goes back to other uses (WAL that every
    /// reader has passed must not push useful data out of the cache). Only a
    /// hint: later reads still see the data, from the disk.
    async fn drop_cache(&self) -> io::Result<()> {
        Ok(())
    }
}

/// The production disk: a directory of the real file system.
///
/// Blocking system calls run on tokio's blocking pool so that a slow `fsync` never
/// stalls the tasks of other nodes sharing the runtime. Every error names the full
/// path it concerns (the root joined with the relative path) and keeps the
/// [`io::ErrorKind`] of the system call, which callers match on.
#[derive(Debug, Clone)]
pub struct RealDisk {
    root: Arc<PathBuf>,
}

impl RealDisk {
    /// A disk rooted at `root`, which is created if missing.
    pub fn open_root(root: impl Into<PathBuf>) -> io::Result<Self> {
        let root = root.into();
        std::fs::create_dir_all(&root).map_err(|e| dir_error(&root, e))?;
        Ok(RealDisk {
            root: Arc::new(root),
        })
    }

    /// The directory this disk lives in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn resolve(&self, path: &str) -> io::Result<PathBuf> {
        let rel = Path::new(path);
        let valid = !path.is_empty()
            && rel
                .components()
                .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
        if !valid && path != "." {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("disk path {path:?} must be relative and stay inside the data dir"),
            ));
        }
        Ok(self.root.join(rel))
    }
}

/// `e` with `path` in front of its message, keeping its kind.
fn path_error(path: &Path, e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::NotADirectory {
        if let Some(bad) = non_directory_ancestor(path) {
            return not_a_directory(path, &bad, e.kind());
        }
    }
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// Like [`path_error`], for a path that must be a directory: one that exists as
/// something else is said to be so.
fn dir_error(dir: &Path, e: io::Error) -> io::Error {
    if matches!(
        e.kind(),
        io::ErrorKind::AlreadyExists | io::ErrorKind::NotADirectory
    ) {
        if let Some(bad) = non_directory_ancestor(dir) {
            return not_a_directory(dir, &bad, e.kind());
        }
    }
    path_error(dir, e)
}

fn not_a_directory(path: &Path, bad: &Path, kind: io::ErrorKind) -> io::Error {
    let message = if bad == path {
        format!("{}: exists and is not a directory", path.display())
    } else {
        format!(
            "{}: {} exists and is not a directory",
            path.display(),
            bad.display()
        )
    };
    io::Error::new(kind, message)
}

/// The deepest existing one of `path` and its ancestors, if it is not a
/// directory. Only called on error paths.
fn non_directory_ancestor(path: &Path) -> Option<PathBuf> {
    path.ancestors()
        .find_map(|p| std::fs::metadata(p).ok().map(|m| (p, m)))
        .and_then(|(p, m)| (!m.is_dir()).then(|| p.to_path_buf()))
}

async fn blocking<T, F>(f: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> io::Result<T> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(join) => Err(io::Error::other(format!("disk task failed: {join}"))),
    }
}

fn sync_dir_path(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| dir_error(dir, e))
}

#[async_trait]
impl Disk for RealDisk {
    async fn free_bytes(&self) -> io::Result<Option<u64>> {
        let root = Arc::clone(&self.root);
        blocking(move || {
            let st = rustix::fs::statvfs(root.as_path()).map_err(|e| dir_error(&root, e.into()))?;
            Ok(Some(st.f_bavail.saturating_mul(st.f_frsize)))
        })
        .await
    }

    async fn create_dir_all(&self, path: &str) -> io::Result<()> {
        let full = self.resolve(path)?;
        let root = Arc::clone(&self.root);
        blocking(move || {
            // The missing directories, outermost first, each synced into its
            // parent once made.
            let mut missing = Vec::new();
            let mut at = full.as_path();
            while !at.exists() {
                missing.push(at.to_path_buf());
                match at.parent() {
                    Some(parent)
                        if parent.starts_with(root.as_path()) || parent == root.as_path() =>
                    {
                        at = parent
                    }
                    _ => break,
                }
            }
            std::fs::create_dir_all(&full).map_err(|e| dir_error(&full, e))?;
            for dir in missing.iter().rev() {
                if let Some(parent) = dir.parent() {
                    sync_dir_path(parent)?;
                }
            }
            Ok(())
        })
        .await
    }

    async fn remove_dir(&self, path: &str) -> io::Result<()> {
        let full = self.resolve(path)?;
        blocking(move || {
            std::fs::remove_dir(&full).map_err(|e| dir_error(&full, e))?;
            match full.parent() {
                Some(parent) => sync_dir_path(parent),
                None => Ok(()),
            }
        })
        .await
    }

    async fn metadata(&self, path: &str) -> io::Result<Metadata> {
        let full = self.resolve(path)?;
        blocking(move || {
            let meta = std::fs::metadata(&full).map_err(|e| path_error(&full, e))?;
            Ok(Metadata {
                len: if meta.is_dir() { 0 } else { meta.len() },
                is_dir: meta.is_dir(),
            })
        })
        .await
    }

    async fn hard_link(&self, from: &str, to: &str) -> io::Result<()> {
        let from = self.resolve(from)?;
        let to = self.resolve(to)?;
        blocking(move || std::fs::hard_link(&from, &to).map_err(|e| rename_error(&from, &to, e)))
            .await
    }

    async fn open(&self, path: &str) -> io::Result<Box<dyn DiskFile>> {
        let full = self.resolve(path)?;
        let (file, full) = blocking(move || {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&full)
                .map_err(|e| path_error(&full, e))?;
            Ok((file, full))
        })
        .await?;
        Ok(Box::new(RealFile {
            file: Arc::new(file),
            path: Arc::new(full),
        }))
    }

    async fn create_new(&self, path: &str) -> io::Result<Box<dyn DiskFile>> {
        let full = self.resolve(path)?;
        let (file, full) = blocking(move || {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&full)
                .map_err(|e| path_error(&full, e))?;
            Ok((file, full))
        })
        .await?;
        Ok(Box::new(RealFile {
            file: Arc::new(file),
            path: Arc::new(full),
        }))
    }

    async fn read(&self, path: &str) -> io::Result<Vec<u8>> {
        let full = self.resolve(path)?;
        blocking(move || std::fs::read(&full).map_err(|e| path_error(&full, e))).await
    }

    async fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let from = self.resolve(from)?;
        let to = self.resolve(to)?;
        blocking(move || std::fs::rename(&from, &to).map_err(|e| rename_error(&from, &to, e))).await
    }

    async fn remove_file(&self, path: &str) -> io::Result<()> {
        let full = self.resolve(path)?;
        blocking(move || std::fs::remove_file(&full).map_err(|e| path_error(&full, e))).await
    }

    async fn list_dir(&self, path: &str) -> io::Result<Vec<String>> {
        let full = self.resolve(path)?;
        blocking(move || {
            let mut names = Vec::new();
            for entry in std::fs::read_dir(&full).map_err(|e| dir_error(&full, e))? {
                let entry = entry.map_err(|e| dir_error(&full, e))?;
                names.push(entry.file_name().to_string_lossy().into_owned());
            }
            names.sort();
            Ok(names)
        })
        .await
    }

    async fn sync_dir(&self, path: &str) -> io::Result<()> {
        let full = self.resolve(path)?;
        blocking(move || sync_dir_path(&full)).await
    }
}

/// A failed rename names both paths; a path that is not a directory where one is
/// needed is named plainly.
fn rename_error(from: &Path, to: &Path, e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::NotADirectory {
        for path in [from, to] {
            if let Some(bad) = path.parent().and_then(non_directory_ancestor) {
                return not_a_directory(path, &bad, e.kind());
            }
        }
    }
    io::Error::new(
        e.kind(),
        format!("renaming {} to {}: {e}", from.display(), to.display()),
    )
}

/// Writes up to this size run on the calling thread (see `RealFile::write_at`).
const INLINE_WRITE_BYTES: usize = 256 << 10;

#[derive(Debug)]
struct RealFile {
    file: Arc<std::fs::File>,
    /// Full path, for error messages.
    path: Arc<PathBuf>,
}

impl RealFile {
    fn error(path: &Path, what: impl fmt::Display, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display()))
    }
}

#[async_trait]
impl DiskFile for RealFile {
    async fn read_at(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let file = Arc::clone(&self.file);
        let path = Arc::clone(&self.path);
        blocking(move || {
            let mut buf = vec![0; len];
            file.read_exact_at(&mut buf, offset).map_err(|e| {
                RealFile::error(&path, format_args!("reading {len} bytes at {offset}"), e)
            })?;
            Ok(buf)
        })
        .await
    }

    async fn write_at(&self, offset: u64, data: Bytes) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let len = data.len();
        let error = move |path: &Path, e| {
            RealFile::error(path, format_args!("writing {len} bytes at {offset}"), e)
        };
        if len <= INLINE_WRITE_BYTES {
            // A small write only copies into the page cache: cheaper than a hop
            // to the blocking pool and back, which costs two thread wake-ups.
            return self
                .file
                .write_all_at(&data, offset)
                .map_err(|e| error(&self.path, e));
        }
        let file = Arc::clone(&self.file);
        let path = Arc::clone(&self.path);
        blocking(move || {
            file.write_all_at(&data, offset)
                .map_err(|e| error(&path, e))
        })
        .await
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        let file = Arc::clone(&self.file);
        let path = Arc::clone(&self.path);
        blocking(move || {
            file.set_len(len)
                .map_err(|e| RealFile::error(&path, format_args!("setting length {len}"), e))
        })
        .await
    }

    async fn sync_data(&self) -> io::Result<()> {
        let file = Arc::clone(&self.file);
        let path = Arc::clone(&self.path);
        blocking(move || {
            file.sync_data()
                .map_err(|e| RealFile::error(&path, "fsync", e))
        })
        .await
    }

    async fn size(&self) -> io::Result<u64> {
        let file = Arc::clone(&self.file);
        let path = Arc::clone(&self.path);
        blocking(move || {
            file.metadata()
                .map(|m| m.len())
                .map_err(|e| RealFile::error(&path, "stat", e))
        })
        .await
    }

    async fn drop_cache(&self) -> io::Result<()> {
        // Only clean pages are dropped; the caller syncs first.
        rustix::fs::fadvise(&*self.file, 0, None, rustix::fs::Advice::DontNeed)
            .map_err(|e| RealFile::error(&self.path, "dropping the page cache", e.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_free_space_of_the_file_system_is_known() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = RealDisk::open_root(dir.path()).expect("disk");
        let free = disk.free_bytes().await.expect("statvfs");
        assert!(free.is_some_and(|f| f > 0), "{free:?}");
    }

    #[tokio::test]
    async fn paths_must_stay_inside_the_root() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = RealDisk::open_root(dir.path()).expect("root");
        for bad in ["/etc/passwd", "../x", "a/../../x", ""] {
            let err = disk.read(bad).await.expect_err(bad);
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{bad}");
        }
    }

    /// Asserts `err` has the kind std gives for the same call and names `path`.
    fn assert_names(err: &io::Error, kind: io::ErrorKind, path: &Path, what: &str) {
        assert_eq!(err.kind(), kind, "{what}: {err}");
        let path = path.display().to_string();
        assert!(
            err.to_string().contains(&path),
            "{what}: {err} must name {path}"
        );
    }

    #[tokio::test]
    async fn errors_name_the_full_path_and_keep_their_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = RealDisk::open_root(dir.path()).expect("root");
        let missing = dir.path().join("a/missing");
        let not_found = io::ErrorKind::NotFound;
        let err = disk.read("a/missing").await.expect_err("read");
        assert_names(&err, not_found, &missing, "read");
        let err = disk.open("a/missing").await.expect_err("open");
        assert_names(&err, not_found, &missing, "open");
        let err = disk.remove_file("a/missing").await.expect_err("remove");
        assert_names(&err, not_found, &missing, "remove");
        let err = disk.list_dir("a/missing").await.expect_err("ls");
        assert_names(&err, not_found, &missing, "ls");
        let err = disk.sync_dir("a/missing").await.expect_err("sync dir");
        assert_names(&err, not_found, &missing, "sync dir");
        let err = disk.create_new("a/missing/f").await.expect_err("create");
        assert_names(
            &err,
            not_found,
            &missing.join("f"),
            "create in a missing dir",
        );
        let err = disk
            .write_atomic("a/missing/f", b"x".to_vec())
            .await
            .expect_err("atomic");
        assert_names(&err, not_found, &missing, "atomic write in a missing dir");

        disk.create_dir_all("a").await.expect("mkdir");
        let err = disk.rename("a/missing", "a/new").await.expect_err("rename");
        assert_names(&err, not_found, &missing, "rename");
        assert_names(&err, not_found, &dir.path().join("a/new"), "rename");

        let f = disk.create_new("a/f").await.expect("create");
        let err = disk.create_new("a/f").await.expect_err("exists");
        assert_names(
            &err,
            io::ErrorKind::AlreadyExists,
            &dir.path().join("a/f"),
            "create existing",
        );
        let err = f.read_at(0, 10).await.expect_err("read past the end");
        assert_names(
            &err,
            io::ErrorKind::UnexpectedEof,
            &dir.path().join("a/f"),
            "read past the end",
        );
    }

    #[tokio::test]
    async fn a_file_where_a_directory_is_expected_is_named_plainly() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").expect("write");
        let plain = "exists and is not a directory";
        // The kinds std reports for the same calls.
        let mkdir_kind = std::fs::create_dir_all(&file).expect_err("mkdir").kind();
        let enotdir = std::fs::read(file.join("x")).expect_err("read").kind();

        // The root itself.
        let err = RealDisk::open_root(&file).expect_err("a file as root");
        assert_names(&err, mkdir_kind, &file, "root");
        assert!(err.to_string().contains(plain), "{err}");
        let err = RealDisk::open_root(file.join("sub")).expect_err("a file in the root's path");
        assert_names(&err, enotdir, &file.join("sub"), "root below a file");
        assert!(
            err.to_string()
                .contains(&format!("{} {plain}", file.display())),
            "{err}"
        );

        // Paths inside the root.
        let disk = RealDisk::open_root(dir.path()).expect("root");
        let err = disk.create_dir_all("f").await.expect_err("mkdir");
        assert_names(&err, mkdir_kind, &file, "mkdir");
        assert!(err.to_string().contains(plain), "{err}");
        let err = disk.create_dir_all("f/sub").await.expect_err("mkdir below");
        assert_names(&err, enotdir, &file.join("sub"), "mkdir below");
        assert!(
            err.to_string()
                .contains(&format!("{} {plain}", file.display())),
            "{err}"
        );
        let err = disk.list_dir("f").await.expect_err("ls");
        assert_names(&err, enotdir, &file, "ls");
        assert!(err.to_string().contains(plain), "{err}");
        for (what, err) in [
            ("read", disk.read("f/x").await.expect_err("read")),
            ("open", disk.open("f/x").await.expect_err("open")),
            ("create", disk.create_new("f/x").await.expect_err("create")),
            (
                "atomic",
                disk.write_atomic("f/x", b"y".to_vec())
                    .await
                    .expect_err("atomic"),
            ),
            ("rename", disk.rename("f/x", "y").await.expect_err("rename")),
        ] {
            assert_eq!(err.kind(), enotdir, "{what}: {err}");
            assert!(
                err.to_string()
                    .contains(&format!("{} {plain}", file.display())),
                "{what}: {err}"
            );
        }
    }

    #[tokio::test]
    async fn directories_links_and_metadata() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = RealDisk::open_root(dir.path()).expect("disk");
        disk.create_dir_all("a/b/c").await.expect("mkdir");
        assert!(disk.metadata("a/b").await.expect("meta").is_dir);
        disk.write_atomic("a/b/f", b"12345".to_vec())
            .await
            .expect("write");
        assert_eq!(
            disk.metadata("a/b/f").await.expect("meta"),
            Metadata {
                len: 5,
                is_dir: false
            }
        );
        assert!(!dir.path().join("a/b/f.tmp").exists(), "no temporary left");
        disk.hard_link("a/b/f", "a/g").await.expect("link");
        disk.remove_file("a/b/f").await.expect("rm");
        assert_eq!(disk.read("a/g").await.expect("read"), b"12345");
        assert_eq!(disk.read_range("a/g", 1, 3).await.expect("range"), b"234");
        let err = disk.remove_dir("a/b").await.expect_err("not empty");
        assert!(err.to_string().contains("a/b"), "{err}");
        disk.remove_dir("a/b/c").await.expect("rmdir");
        disk.remove_dir("a/b").await.expect("rmdir");
        assert_eq!(
            disk.metadata("a/b").await.expect_err("gone").kind(),
            io::ErrorKind::NotFound
        );
        // A top-level file: its directory is the root itself.
        disk.write_atomic("top", b"x".to_vec()).await.expect("top");
        assert_eq!(disk.read("top").await.expect("read"), b"x");
    }

    #[tokio::test]
    async fn files_round_trip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = RealDisk::open_root(dir.path()).expect("root");
        disk.create_dir_all("a/b").await.expect("mkdir");
        let f = disk.create_new("a/b/f").await.expect("create");
        assert!(disk.create_new("a/b/f").await.is_err());
        f.write_at(0, Bytes::from_static(b"hello world"))
            .await
            .expect("write");
        f.sync_data().await.expect("sync");
        assert_eq!(f.read_at(6, 5).await.expect("read"), b"world");
        assert!(f.read_at(6, 50).await.is_err());
        // Dropping the cache is a hint: the data is still there.
        f.drop_cache().await.expect("drop cache");
        assert_eq!(f.read_at(0, 11).await.expect("read"), b"hello world");
        f.set_len(5).await.expect("truncate");
        assert_eq!(f.size().await.expect("size"), 5);
        disk.write_atomic("a/b/g", b"x".to_vec())
            .await
            .expect("atomic");
        assert_eq!(disk.list_dir("a/b").await.expect("ls"), vec!["f", "g"]);
        disk.rename("a/b/g", "a/b/h").await.expect("rename");
        disk.remove_file("a/b/f").await.expect("rm");
        disk.sync_dir("a/b").await.expect("sync dir");
        assert_eq!(disk.list_dir("a/b").await.expect("ls"), vec!["h"]);
        assert_eq!(disk.read("a/b/h").await.expect("read"), b"x");
    }
}
