//! One disk wrapper for tests: every operation, on the disk and on its open
//! files, passes a hook first, which may record it, delay it, stall it for
//! ever or fail it. Fault-injecting and instrumented disks are hooks, not
//! wrappers of their own (each wrapper used to forward twenty operations
//! around the two it changed).
//!
//! Most tests need no hook, only a real disk in a folder of their own:
//! [`temp_disk`].
//!
//! `write_atomic` and `read_range` are not forwarded: the trait builds them
//! from the other operations, so the hook sees each of their steps (a crash
//! can land between the temporary file's sync and its rename).

use std::fmt;
use std::io;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use ferry_env::{Disk, DiskFile, Metadata};

/// An operation about to run, with what it concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskOp<'a> {
    CreateDirAll(&'a str),
    RemoveDir(&'a str),
    Metadata(&'a str),
    HardLink {
        from: &'a str,
        to: &'a str,
    },
    Open(&'a str),
    CreateNew(&'a str),
    Read(&'a str),
    Rename {
        from: &'a str,
        to: &'a str,
    },
    RemoveFile(&'a str),
    ListDir(&'a str),
    SyncDir(&'a str),
    /// Operations on the open file at `path`.
    ReadAt {
        path: &'a str,
        offset: u64,
        len: usize,
    },
    WriteAt {
        path: &'a str,
        offset: u64,
        len: usize,
    },
    SetLen {
        path: &'a str,
        len: u64,
    },
    SyncData(&'a str),
    Size(&'a str),
}

impl DiskOp<'_> {
    /// Whether the operation changes what is on the disk (or makes it durable).
    pub fn is_write(&self) -> bool {
        !matches!(
            self,
            DiskOp::Metadata(_)
                | DiskOp::Open(_)
                | DiskOp::Read(_)
                | DiskOp::ListDir(_)
                | DiskOp::ReadAt { .. }
                | DiskOp::Size(_)
        )
    }

    /// Whether the operation is a sync (of a file's data or a directory).
    pub fn is_sync(&self) -> bool {
        matches!(self, DiskOp::SyncData(_) | DiskOp::SyncDir(_))
    }
}

/// What a test does before each operation: `Err` fails it (nothing is done),
/// a future that never ends stalls it.
#[async_trait]
pub trait DiskHook: Send + Sync + 'static {
    async fn before(&self, op: DiskOp<'_>) -> io::Result<()>;
    /// The free space the disk reports (`None`: the inner disk's): a test
    /// fills and empties a disk without writing.
    fn free_bytes(&self) -> Option<u64> {
        None
    }
}

/// A disk whose every operation passes `hook` first.
pub struct HookedDisk {
    inner: Arc<dyn Disk>,
    hook: Arc<dyn DiskHook>,
}

impl HookedDisk {
    pub fn new(inner: Arc<dyn Disk>, hook: Arc<dyn DiskHook>) -> HookedDisk {
        HookedDisk { inner, hook }
    }

    fn file(&self, path: &str, inner: Box<dyn DiskFile>) -> Box<dyn DiskFile> {
        Box::new(HookedFile {
            path: path.to_string(),
            inner,
            hook: Arc::clone(&self.hook),
        })
    }
}

impl fmt::Debug for HookedDisk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HookedDisk({:?})", self.inner)
    }
}

struct HookedFile {
    path: String,
    inner: Box<dyn DiskFile>,
    hook: Arc<dyn DiskHook>,
}

impl fmt::Debug for HookedFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HookedFile({})", self.path)
    }
}

#[async_trait]
impl Disk for HookedDisk {
    async fn create_dir_all(&self, path: &str) -> io::Result<()> {
        self.hook.before(DiskOp::CreateDirAll(path)).await?;
        self.inner.create_dir_all(path).await
    }
    async fn remove_dir(&self, path: &str) -> io::Result<()> {
        self.hook.before(DiskOp::RemoveDir(path)).await?;
        self.inner.remove_dir(path).await
    }
    async fn metadata(&self, path: &str) -> io::Result<Metadata> {
        self.hook.before(DiskOp::Metadata(path)).await?;
        self.inner.metadata(path).await
    }
    async fn hard_link(&self, from: &str, to: &str) -> io::Result<()> {
        self.hook.before(DiskOp::HardLink { from, to }).await?;
        self.inner.hard_link(from, to).await
    }
    async fn open(&self, path: &str) -> io::Result<Box<dyn DiskFile>> {
        self.hook.before(DiskOp::Open(path)).await?;
        Ok(self.file(path, self.inner.open(path).await?))
    }
    async fn create_new(&self, path: &str) -> io::Result<Box<dyn DiskFile>> {
        self.hook.before(DiskOp::CreateNew(path)).await?;
        Ok(self.file(path, self.inner.create_new(path).await?))
    }
    async fn read(&self, path: &str) -> io::Result<Vec<u8>> {
        self.hook.before(DiskOp::Read(path)).await?;
        self.inner.read(path).await
    }
    async fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.hook.before(DiskOp::Rename { from, to }).await?;
        self.inner.rename(from, to).await
    }
    async fn remove_file(&self, path: &str) -> io::Result<()> {
        self.hook.before(DiskOp::RemoveFile(path)).await?;
        self.inner.remove_file(path).await
    }
    async fn list_dir(&self, path: &str) -> io::Result<Vec<String>> {
        self.hook.before(DiskOp::ListDir(path)).await?;
        self.inner.list_dir(path).await
    }
    async fn sync_dir(&self, path: &str) -> io::Result<()> {
        self.hook.before(DiskOp::SyncDir(path)).await?;
        self.inner.sync_dir(path).await
    }
    async fn free_bytes(&self) -> io::Result<Option<u64>> {
        match self.hook.free_bytes() {
            Some(free) => Ok(Some(free)),
            None => self.inner.free_bytes().await,
        }
    }
}

#[async_trait]
impl DiskFile for HookedFile {
    async fn read_at(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let path = &self.path;
        self.hook
            .before(DiskOp::ReadAt { path, offset, len })
            .await?;
        self.inner.read_at(offset, len).await
    }
    async fn write_at(&self, offset: u64, data: Bytes) -> io::Result<()> {
        let (path, len) = (&self.path, data.len());
        self.hook
            .before(DiskOp::WriteAt { path, offset, len })
            .await?;
        self.inner.write_at(offset, data).await
    }
    async fn set_len(&self, len: u64) -> io::Result<()> {
        let path = &self.path;
        self.hook.before(DiskOp::SetLen { path, len }).await?;
        self.inner.set_len(len).await
    }
    async fn sync_data(&self) -> io::Result<()> {
        self.hook.before(DiskOp::SyncData(&self.path)).await?;
        self.inner.sync_data().await
    }
    async fn size(&self) -> io::Result<u64> {
        self.hook.before(DiskOp::Size(&self.path)).await?;
        self.inner.size().await
    }
    async fn drop_cache(&self) -> io::Result<()> {
        self.inner.drop_cache().await
    }
}

/// A real disk rooted in a new temporary directory, which is removed when
/// the handle returned with the disk is dropped (so a test keeps it as long
/// as it uses the disk).
///
/// # Panics
/// When the directory cannot be made.
pub fn temp_disk() -> (tempfile::TempDir, Arc<dyn Disk>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk: Arc<dyn Disk> =
        Arc::new(ferry_env::RealDisk::open_root(dir.path()).expect("a real disk"));
    (dir, disk)
}
