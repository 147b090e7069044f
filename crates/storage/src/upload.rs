//! Streamed multipart uploads: an object written a part at a time within a
//! fixed memory budget, visible only once finished.

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, WriteMultipart};

use crate::{Location, StorageError};

/// How a streamed upload uses memory: at most `part_bytes × (max_in_flight +
/// 1)` bytes are held at once, whatever the size of the object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadBudget {
    /// Size of each part (S3 needs at least 5 MiB but for the last one).
    pub part_bytes: usize,
    /// Parts being uploaded at once.
    pub max_in_flight: usize,
}

impl Default for UploadBudget {
    fn default() -> Self {
        UploadBudget {
            part_bytes: 8 << 20,
            max_in_flight: 2,
        }
    }
}

impl UploadBudget {
    /// The most memory an upload with this budget holds.
    pub fn max_bytes(&self) -> usize {
        self.part_bytes * (self.max_in_flight + 1)
    }
}

/// A streamed multipart upload to one key: nothing is visible at the key
/// until [`Upload::finish`]; dropped or [`Upload::abort`]ed, it leaves no
/// object. (Multipart uploads have no create-only mode on S3: a key written by
/// an upload must be one whose contents are determined by its name.)
pub struct Upload {
    key: ObjectPath,
    writer: WriteMultipart,
    budget: UploadBudget,
    written: u64,
}

impl Upload {
    /// Adds `bytes` to the object, a part at a time, waiting while the budget
    /// is spent (the caller's buffer itself is the caller's to bound).
    pub async fn write(&mut self, mut bytes: Bytes) -> Result<(), StorageError> {
        while !bytes.is_empty() {
            self.writer
                .wait_for_capacity(self.budget.max_in_flight)
                .await
                .map_err(|e| StorageError::about(e, &self.key))?;
            let piece = bytes.split_to(bytes.len().min(self.budget.part_bytes.max(1)));
            self.written += piece.len() as u64;
            self.writer.put(piece);
        }
        Ok(())
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Completes the upload: the object appears whole, or not at all.
    pub async fn finish(self) -> Result<(), StorageError> {
        let key = self.key;
        self.writer
            .finish()
            .await
            .map(drop)
            .map_err(|e| StorageError::about(e, &key))
    }

    /// Gives up: the parts already sent are discarded.
    pub async fn abort(self) -> Result<(), StorageError> {
        let key = self.key;
        self.writer
            .abort()
            .await
            .map_err(|e| StorageError::about(e, &key))
    }
}

impl Location {
    /// Starts a streamed upload to `key` within `budget`.
    pub async fn upload(&self, key: &str, budget: UploadBudget) -> Result<Upload, StorageError> {
        let key = self.key(key)?;
        self.check_writable().await?;
        let upload = self
            .store
            .put_multipart(&key)
            .await
            .map_err(|e| StorageError::about(e, &key))?;
        Ok(Upload {
            writer: WriteMultipart::new_with_chunk_size(upload, budget.part_bytes.max(1)),
            key,
            budget,
            written: 0,
        })
    }
}
