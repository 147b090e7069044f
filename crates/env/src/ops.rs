//! Composite disk operations, built once from the [`Disk`] primitives so that
//! the simulator crash-tests the very sequences production runs.

use std::io;

use bytes::{Bytes, BytesMut};

use crate::disk::{Disk, DiskFile};

/// Name of the marker that says a directory is being removed.
pub const REMOVING_MARKER: &str = ".removing";

/// Removes the directory `dir` and everything in it so that a crash at any
/// point leaves the whole tree, or a tree marked as being removed, or an empty
/// directory ([`is_being_removed`] says yes to both), which a restart finishes
/// removing: never a half-deleted tree that looks whole. Durable on return.
pub async fn remove_tree(disk: &dyn Disk, dir: &str) -> io::Result<()> {
    let marker = format!("{dir}/{REMOVING_MARKER}");
    match disk.create_new(&marker).await {
        Ok(file) => {
            file.sync_data().await?;
            disk.sync_dir(dir).await?;
        }
        // A removal interrupted earlier: the marker is there already.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    remove_contents(disk, dir, Some(REMOVING_MARKER)).await?;
    disk.remove_file(&marker).await?;
    disk.sync_dir(dir).await?;
    disk.remove_dir(dir).await
}

/// Whether `dir` is left over from an unfinished [`remove_tree`]: it holds the
/// marker, or nothing at all.
pub async fn is_being_removed(disk: &dyn Disk, dir: &str) -> io::Result<bool> {
    match disk.metadata(&format!("{dir}/{REMOVING_MARKER}")).await {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(disk.list_dir(dir).await?.is_empty()),
        Err(e) => Err(e),
    }
}

/// Removes everything in `dir` but the entry named `keep`, depth first.
async fn remove_contents(disk: &dyn Disk, dir: &str, keep: Option<&str>) -> io::Result<()> {
    // Depth-first without recursion (async recursion needs boxing): a stack of
    // directories to empty, each removed once its contents are gone.
    let mut stack: Vec<(String, bool)> = vec![(dir.to_string(), false)];
    while let Some((d, emptied)) = stack.pop() {
        if emptied {
            if d != dir {
                disk.remove_dir(&d).await?;
            }
            continue;
        }
        stack.push((d.clone(), true));
        let mut removed_files = false;
        for name in disk.list_dir(&d).await? {
            if d == dir && Some(name.as_str()) == keep {
                continue;
            }
            let path = format!("{d}/{name}");
            if disk.metadata(&path).await?.is_dir {
                stack.push((path, false));
            } else {
                disk.remove_file(&path).await?;
                removed_files = true;
            }
        }
        if removed_files {
            disk.sync_dir(&d).await?;
        }
    }
    Ok(())
}

/// Writes a file from its start in order, holding at most `buffer_bytes` in
/// memory: a large file (a Parquet part) never sits whole in one buffer.
pub struct SequentialWriter {
    file: Box<dyn DiskFile>,
    buf: BytesMut,
    buffer_bytes: usize,
    offset: u64,
}

impl SequentialWriter {
    pub fn new(file: Box<dyn DiskFile>, buffer_bytes: usize) -> SequentialWriter {
        SequentialWriter {
            file,
            buf: BytesMut::with_capacity(buffer_bytes.max(1)),
            buffer_bytes: buffer_bytes.max(1),
            offset: 0,
        }
    }

    /// Appends `data`, writing out each full buffer.
    pub async fn write(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let room = self.buffer_bytes - self.buf.len();
            let n = room.min(data.len());
            self.buf.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.buf.len() == self.buffer_bytes {
                self.write_out().await?;
            }
        }
        Ok(())
    }

    /// Appends `data` without copying it when it fills a buffer by itself.
    pub async fn write_bytes(&mut self, data: Bytes) -> io::Result<()> {
        if data.len() >= self.buffer_bytes {
            self.write_out().await?;
            let len = data.len() as u64;
            self.file.write_at(self.offset, data).await?;
            self.offset += len;
            return Ok(());
        }
        self.write(&data).await
    }

    async fn write_out(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = self.buf.split().freeze();
        let len = chunk.len() as u64;
        self.file.write_at(self.offset, chunk).await?;
        self.offset += len;
        Ok(())
    }

    /// Bytes written so far (buffered ones included).
    pub fn len(&self) -> u64 {
        self.offset + self.buf.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes out the rest and syncs: on return the whole file is durable
    /// (its directory entry is the caller's to sync). Returns the length.
    pub async fn finish(mut self) -> io::Result<u64> {
        self.write_out().await?;
        self.file.sync_data().await?;
        Ok(self.offset)
    }
}
