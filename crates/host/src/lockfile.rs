//! One process per node: an exclusive lock on `<dir>/ferry.lock`, held for the
//! life of the process (the kernel releases it when the process dies, even by
//! `kill -9`). Every node takes one on its own directory (`ferry dev` on its data
//! dir, its coordination store and each safekeeper; `ferry safekeeper` on its
//! data dir and its safekeeper): two processes writing one WAL or one
//! coordination log would corrupt both.

use std::fs::{File, OpenOptions};
use std::path::Path;

use anyhow::Context;

/// Holds the lock until dropped.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// Locks `dir` (created if missing) for this process.
pub fn lock_dir(dir: &Path) -> anyhow::Result<DirLock> {
    crate::paths::create_dir(dir)?;
    let path = dir.join("ferry.lock");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(DirLock { _file: file }),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "{} is in use by another ferry process (lock {})",
            dir.display(),
            path.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
}
