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
    /// Creates a directory and its missing parents (not durable until `sync_dir` of
    /// the parent).
    async fn create_dir_all(&self, path: &str) -> io::Result<()>;
    /// Opens an existing file for reading and writing.
    async fn open(&self, path: &str) -> io::Result<Box<dyn DiskFile>>;
    /// Creates a new empty file, failing with `AlreadyExists` if there is one.
    async fn create_new(&self, path: &str) -> io::Result<Box<dyn DiskFile>>;
    /// Reads a whole file.
    async fn read(&self, path: &str) -> io::Result<Vec<u8>>;
    /// Replaces `path` atomically and durably: writes a temporary file, syncs it,
    /// renames it over `path` and syncs the directory. After a crash the file holds
    /// either the old or the new contents, never a mix.
    async fn write_atomic(&self, path: &str, data: Vec<u8>) -> io::Result<()>;
    /// Renames a file (durable after `sync_dir`).
    async fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    /// Removes a file (durable after `sync_dir`).
    async fn remove_file(&self, path: &str) -> io::Result<()>;
    /// Lists the names of the entries of a directory, sorted.
    async fn list_dir(&self, path: &str) -> io::Result<Vec<String>>;
    /// Makes creations, renames and removals in a directory durable.
    async fn sync_dir(&self, path: &str) -> io::Result<()>;
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
/// stalls the tasks of other nodes sharing the runtime.
#[derive(Debug, Clone)]
pub struct RealDisk {
    root: Arc<PathBuf>,
}

impl RealDisk {
    /// A disk rooted at `root`, which is created if missing.
    pub fn open_root(root: impl Into<PathBuf>) -> io::Result<Self> {
        let root = root.into();
        std::fs::create_dir_all(&root)?;
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
    std::fs::File::open(dir)?.sync_all()
}

#[async_trait]
impl Disk for RealDisk {
    async fn create_dir_all(&self, path: &str) -> io::Result<()> {
        let full = self.resolve(path)?;
        blocking(move || std::fs::create_dir_all(full)).await
    }

    async fn open(&self, path: &str) -> io::Result<Box<dyn DiskFile>> {
        let full = self.resolve(path)?;
        let file = blocking(move || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(full)
        })
        .await?;
        Ok(Box::new(RealFile {
            file: Arc::new(file),
        }))
    }

    async fn create_new(&self, path: &str) -> io::Result<Box<dyn DiskFile>> {
        let full = self.resolve(path)?;
        let file = blocking(move || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(full)
        })
        .await?;
        Ok(Box::new(RealFile {
            file: Arc::new(file),
        }))
    }

    async fn read(&self, path: &str) -> io::Result<Vec<u8>> {
        let full = self.resolve(path)?;
        blocking(move || std::fs::read(full)).await
    }

    async fn write_atomic(&self, path: &str, data: Vec<u8>) -> io::Result<()> {
        let full = self.resolve(path)?;
        blocking(move || {
            let mut tmp_name = full.file_name().unwrap_or_default().to_os_string();
            tmp_name.push(".tmp");
            let tmp = full.with_file_name(tmp_name);
            {
                use std::io::Write;
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(&data)?;
                f.sync_all()?;
            }
            std::fs::rename(&tmp, &full)?;
            match full.parent() {
                Some(dir) => sync_dir_path(dir),
                None => Ok(()),
            }
        })
        .await
    }

    async fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let from = self.resolve(from)?;
        let to = self.resolve(to)?;
        blocking(move || std::fs::rename(from, to)).await
    }

    async fn remove_file(&self, path: &str) -> io::Result<()> {
        let full = self.resolve(path)?;
        blocking(move || std::fs::remove_file(full)).await
    }

    async fn list_dir(&self, path: &str) -> io::Result<Vec<String>> {
        let full = self.resolve(path)?;
        blocking(move || {
            let mut names = Vec::new();
            for entry in std::fs::read_dir(full)? {
                names.push(entry?.file_name().to_string_lossy().into_owned());
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

/// Writes up to this size run on the calling thread (see `RealFile::write_at`).
const INLINE_WRITE_BYTES: usize = 256 << 10;

#[derive(Debug)]
struct RealFile {
    file: Arc<std::fs::File>,
}

#[async_trait]
impl DiskFile for RealFile {
    async fn read_at(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let file = Arc::clone(&self.file);
        blocking(move || {
            let mut buf = vec![0; len];
            file.read_exact_at(&mut buf, offset)?;
            Ok(buf)
        })
        .await
    }

    async fn write_at(&self, offset: u64, data: Bytes) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        if data.len() <= INLINE_WRITE_BYTES {
            // A small write only copies into the page cache: cheaper than a hop
            // to the blocking pool and back, which costs two thread wake-ups.
            return self.file.write_all_at(&data, offset);
        }
        let file = Arc::clone(&self.file);
        blocking(move || file.write_all_at(&data, offset)).await
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        let file = Arc::clone(&self.file);
        blocking(move || file.set_len(len)).await
    }

    async fn sync_data(&self) -> io::Result<()> {
        let file = Arc::clone(&self.file);
        blocking(move || file.sync_data()).await
    }

    async fn size(&self) -> io::Result<u64> {
        let file = Arc::clone(&self.file);
        blocking(move || Ok(file.metadata()?.len())).await
    }

    async fn drop_cache(&self) -> io::Result<()> {
        // Only clean pages are dropped; the caller syncs first.
        rustix::fs::fadvise(&*self.file, 0, None, rustix::fs::Advice::DontNeed)
            .map_err(io::Error::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn paths_must_stay_inside_the_root() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = RealDisk::open_root(dir.path()).expect("root");
        for bad in ["/etc/passwd", "../x", "a/../../x", ""] {
            let err = disk.read(bad).await.expect_err(bad);
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{bad}");
        }
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
