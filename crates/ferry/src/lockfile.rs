//! One process per data dir: an exclusive lock on `<data dir>/ferry.lock`, held
//! for the life of the process (the kernel releases it when the process dies, even
//! by `kill -9`). Two processes writing one WAL or one coordination log would
//! corrupt both.

use std::fs::{File, OpenOptions};
use std::path::Path;

use anyhow::Context;

/// Holds the lock until dropped.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
}

pub fn lock_data_dir(dir: &Path) -> anyhow::Result<DataDirLock> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("ferry.lock");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(DataDirLock { _file: file }),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "data dir {} is in use by another ferry process (lock {})",
            dir.display(),
            path.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
}
