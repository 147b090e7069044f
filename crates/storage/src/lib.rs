//! Object storage locations: a URL (`file:///dir` or `s3://bucket/prefix`) opened as
//! an `object_store` store plus a key prefix.
//!
//! This is the only way ferry reaches object storage (export destinations, WAL
//! backup). A [`Location`] hands out no store and no prefix: every operation
//! takes a key relative to the location, checked so that it can never escape
//! it. Writes are create-only when asked ([`Location::put_create`]: first
//! write wins, a second one is [`StorageError::AlreadyExists`]), and large
//! objects are streamed ([`Location::upload`]) within a fixed memory budget.
//!
//! Here: the [`Location`] and its operations on keys; in the modules:
//! `open` (a URL checked and opened as a location), `s3` (S3 connection
//! settings), `local` (the roots local folders must lie in, and what a
//! local folder needs besides its store), `upload` (streamed uploads within
//! a memory budget) and `error`.

mod error;
mod local;
mod open;
mod s3;
mod upload;

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

pub use error::StorageError;
pub use local::LocalRoots;
pub use open::open;
pub use s3::S3Settings;
pub use upload::{Upload, UploadBudget};

use error::invalid;
use local::LocalDir;
use open::parse_prefix;

/// An opened location. Its store and prefix are private: a key outside the
/// location cannot even be named.
#[derive(Debug, Clone)]
pub struct Location {
    url: String,
    store: Arc<dyn ObjectStore>,
    /// The key prefix inside the store ("" for the whole store).
    prefix: ObjectPath,
    /// A local folder's root directory (the store's root, so a key's file
    /// is at `<prefix>/<key>` in it), through the disk seam: where the files
    /// `object_store` stages a write in (`<key>#<n>`, renamed or linked into
    /// place when the write completes) can be found and removed.
    local: Option<LocalDir>,
}

impl Location {
    /// A location over a store made elsewhere (the simulator's faulty
    /// in-memory store), under `prefix` (checked like a URL's path).
    pub fn from_store(
        url: &str,
        store: Arc<dyn ObjectStore>,
        prefix: &str,
    ) -> Result<Location, StorageError> {
        Ok(Location {
            url: url.to_string(),
            prefix: parse_prefix(url, prefix)?,
            store,
            local: None,
        })
    }

    /// The location of the folder `name` inside this one (one key segment,
    /// checked like any): one owner's share of a location that several
    /// share, which cannot name the others' keys.
    pub fn child(&self, name: &str) -> Result<Location, StorageError> {
        let not_a_folder = || {
            invalid(
                &self.url,
                format!("{name:?} is not a folder name (one key segment)"),
            )
        };
        if name.contains('/') {
            return Err(not_a_folder());
        }
        let prefix = self.key(name).map_err(|_| not_a_folder())?;
        Ok(Location {
            url: format!("{}/{name}", self.url.trim_end_matches('/')),
            store: Arc::clone(&self.store),
            prefix,
            local: self.local.clone(),
        })
    }

    /// The URL the location was opened from.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Writes `data` at `key` unless something is there already: the first
    /// write wins, later ones get [`StorageError::AlreadyExists`] and change
    /// nothing (S3 `If-None-Match: *`; an atomic link on a local directory).
    pub async fn put_create(&self, key: &str, data: Bytes) -> Result<(), StorageError> {
        let key = self.key(key)?;
        self.check_writable().await?;
        self.store
            .put_opts(
                &key,
                PutPayload::from(data),
                PutOptions::from(PutMode::Create),
            )
            .await
            .map(drop)
            .map_err(|e| StorageError::about(e, &key))
    }

    /// Writes `data` at `key`, replacing what is there.
    pub async fn put(&self, key: &str, data: Bytes) -> Result<(), StorageError> {
        let key = self.key(key)?;
        self.check_writable().await?;
        self.store
            .put(&key, PutPayload::from(data))
            .await
            .map(drop)
            .map_err(|e| StorageError::about(e, &key))
    }

    /// The whole object at `key`.
    pub async fn get(&self, key: &str) -> Result<Bytes, StorageError> {
        let key = self.key(key)?;
        let result = self
            .store
            .get(&key)
            .await
            .map_err(|e| StorageError::about(e, &key))?;
        result
            .bytes()
            .await
            .map_err(|e| StorageError::about(e, &key))
    }

    /// Bytes `range` of the object at `key`.
    pub async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, StorageError> {
        let key = self.key(key)?;
        self.store
            .get_range(&key, range)
            .await
            .map_err(|e| StorageError::about(e, &key))
    }

    /// The size of the object at `key`, or `None` if there is none.
    pub async fn size(&self, key: &str) -> Result<Option<u64>, StorageError> {
        let key = self.key(key)?;
        match self.store.head(&key).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(StorageError::about(e, &key)),
        }
    }

    /// Deletes the object at `key` (no error if there is none).
    pub async fn delete(&self, key: &str) -> Result<(), StorageError> {
        let key = self.key(key)?;
        match self.store.delete(&key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(StorageError::about(e, &key)),
        }
    }

    /// Keys under `dir` (relative to the location, "" for all of it) with their
    /// sizes, sorted.
    pub async fn list(&self, dir: &str) -> Result<Vec<(String, u64)>, StorageError> {
        let base = if dir.is_empty() {
            self.prefix.clone()
        } else {
            self.key(dir)?
        };
        let mut out: Vec<(String, u64)> = self
            .store
            .list(Some(&base))
            .map_ok(|meta| self.entry(&meta))
            .try_collect()
            .await
            .map_err(|e| StorageError::about(e, &base))?;
        out.sort();
        Ok(out)
    }

    /// Keys under `dir` like [`list`](Self::list), with their sizes and
    /// last-modified times (milliseconds since the Unix epoch, as the store
    /// reports them): what upkeep needs to leave recent objects alone.
    pub async fn list_modified(&self, dir: &str) -> Result<Vec<(String, u64, i64)>, StorageError> {
        let base = if dir.is_empty() {
            self.prefix.clone()
        } else {
            self.key(dir)?
        };
        let mut out: Vec<(String, u64, i64)> = self
            .store
            .list(Some(&base))
            .map_ok(|meta| {
                let (key, size) = self.entry(&meta);
                (key, size, meta.last_modified.timestamp_millis())
            })
            .try_collect()
            .await
            .map_err(|e| StorageError::about(e, &base))?;
        out.sort();
        Ok(out)
    }

    /// The objects directly in the location's top folder (not in its
    /// subfolders), with their sizes, sorted: a commit listing that does
    /// not walk every data file.
    pub async fn list_top(&self) -> Result<Vec<(String, u64)>, StorageError> {
        let listed = self
            .store
            .list_with_delimiter(Some(&self.prefix))
            .await
            .map_err(|e| StorageError::about(e, &self.prefix))?;
        let mut out: Vec<(String, u64)> =
            listed.objects.iter().map(|meta| self.entry(meta)).collect();
        out.sort();
        Ok(out)
    }

    /// A listed object as its key relative to the location, and its size.
    fn entry(&self, meta: &object_store::ObjectMeta) -> (String, u64) {
        let rel: Vec<String> = meta
            .location
            .parts()
            .skip(self.prefix.parts().count())
            .map(|p| p.as_ref().to_string())
            .collect();
        (rel.join("/"), meta.size)
    }

    /// The full key of `relative` (segments separated by `/`) under the prefix.
    /// Empty, `.` and `..` segments, backslashes and control characters are refused,
    /// so a key can never leave the location.
    pub fn key(&self, relative: &str) -> Result<ObjectPath, StorageError> {
        let bad = |reason| StorageError::InvalidKey {
            key: relative.to_string(),
            reason,
        };
        if relative.is_empty() {
            return Err(bad("empty key"));
        }
        let mut key = self.prefix.clone();
        for segment in relative.split('/') {
            check_segment(segment).map_err(bad)?;
            key = key.join(segment);
        }
        Ok(key)
    }
}

/// Checks one key component: non-empty, not `.`/`..`, no control characters and
/// no characters that object_store would encode away or that mean something to a
/// file system.
pub(crate) fn check_segment(segment: &str) -> Result<(), &'static str> {
    if segment.is_empty() {
        return Err("empty path segment");
    }
    if segment == "." || segment == ".." {
        return Err("relative path segment");
    }
    if segment.chars().any(|c| c.is_control() || c == '\\') {
        return Err("control character or backslash");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_prefix_and_keys() {
        let s3 = S3Settings {
            endpoint: Some("http://127.0.0.1:1".into()),
            region: Some("us-east-1".into()),
            access_key_id: Some("k".into()),
            secret_access_key: Some("s".into()),
            ..S3Settings::default()
        };
        let loc = open("s3://lake-bucket/exports/2026/", &s3).expect("open");
        assert_eq!(loc.prefix.as_ref(), "exports/2026");
        assert_eq!(loc.url(), "s3://lake-bucket/exports/2026/");
        let key = loc.key("date=2026-01-01/p_1_1_0.parquet").expect("key");
        assert_eq!(key.as_ref(), "exports/2026/date=2026-01-01/p_1_1_0.parquet");
        for bad in ["", "../x", "a//b", "a/./b", "a\\b", "/abs"] {
            assert!(
                matches!(loc.key(bad), Err(StorageError::InvalidKey { .. })),
                "{bad:?}"
            );
        }
    }
}
