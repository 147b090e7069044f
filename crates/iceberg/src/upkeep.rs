//! Lake upkeep: expiring old snapshots, and removing orphan data files.
//!
//! Expiring: a new metadata version (created
//! create-only, like a commit's) keeps the current snapshot and every
//! snapshot newer than a cut-off; the table's properties, and with them
//! each partition's current export (the commit identity), are carried over
//! untouched, so a retried commit of an export still finds it after its
//! snapshot expired. Files only expired snapshots referenced become
//! orphans (`ferry verify` names them); nothing is deleted then.
//!
//! Removing orphans: data files under `data/` live in no snapshot the
//! current metadata keeps, and last modified before a cut-off, are deleted.
//! The cut-off protects uploads of a commit in progress (their files are
//! orphans until the commit lands): it must be longer than the longest
//! export. Metadata files of expired snapshots are left in place.

use bytes::Bytes;
use ferry_storage::StorageError;

use crate::commit::{metadata_key, MAX_COMMIT_ATTEMPTS, VERSION_HINT};
use crate::spec::MetadataLogEntry;
use crate::{IcebergError, IcebergTable};

/// What an expiry did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpireOutcome {
    /// No table there.
    NoTable,
    /// No snapshot was old enough: nothing written.
    Nothing { version: u64 },
    /// A new version without the expired snapshots.
    Expired { version: u64, expired: usize },
}

impl IcebergTable {
    /// Expires every snapshot taken before `older_than_ms` (milliseconds
    /// since the Unix epoch) except the current one; `now_ms` stamps the
    /// new version.
    pub async fn expire_snapshots(
        &self,
        older_than_ms: i64,
        now_ms: i64,
    ) -> Result<ExpireOutcome, IcebergError> {
        for _ in 0..MAX_COMMIT_ATTEMPTS {
            let Some((version, mut meta)) = self.current().await? else {
                return Ok(ExpireOutcome::NoTable);
            };
            let current = meta.current_snapshot_id;
            let before = meta.snapshots.len();
            meta.snapshots
                .retain(|s| s.snapshot_id == current || s.timestamp_ms >= older_than_ms);
            let expired = before - meta.snapshots.len();
            if expired == 0 {
                return Ok(ExpireOutcome::Nothing { version });
            }
            let kept: std::collections::BTreeSet<i64> =
                meta.snapshots.iter().map(|s| s.snapshot_id).collect();
            meta.snapshot_log.retain(|e| kept.contains(&e.snapshot_id));
            meta.refs.retain(|_, r| kept.contains(&r.snapshot_id));
            meta.metadata_log.push(MetadataLogEntry {
                metadata_file: self.url_of(&metadata_key(version)),
                timestamp_ms: meta.last_updated_ms,
            });
            meta.last_updated_ms = meta.last_updated_ms.max(now_ms);
            let body = serde_json::to_vec_pretty(&meta).map_err(|e| IcebergError::Metadata {
                file: metadata_key(version + 1),
                reason: e.to_string(),
            })?;
            match self
                .location()
                .put_create(&metadata_key(version + 1), Bytes::from(body))
                .await
            {
                Ok(()) => {
                    let hint = Bytes::from((version + 1).to_string());
                    if let Err(e) = self.location().put(VERSION_HINT, hint).await {
                        tracing::warn!(error = %e, "version hint not written");
                    }
                    return Ok(ExpireOutcome::Expired {
                        version: version + 1,
                        expired,
                    });
                }
                Err(StorageError::AlreadyExists { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(IcebergError::Contended(MAX_COMMIT_ATTEMPTS))
    }

    /// Deletes the orphan data files last modified before `older_than_ms`;
    /// returns the keys removed and how many orphans were too recent.
    pub async fn remove_orphans(&self, older_than_ms: i64) -> Result<RemovedOrphans, IcebergError> {
        for _ in 0..MAX_COMMIT_ATTEMPTS {
            let Some((version, meta)) = self.current().await? else {
                return Ok(RemovedOrphans::default());
            };
            let live = crate::verify::live_in_any_snapshot(self, &meta).await?;
            let mut out = RemovedOrphans::default();
            let mut doomed = Vec::new();
            for (key, _, modified_ms) in self.location().list_modified("data").await? {
                if !key.ends_with(".parquet") || live.contains(&key) {
                    continue;
                }
                if modified_ms >= older_than_ms {
                    out.recent += 1;
                } else {
                    doomed.push(key);
                }
            }
            // A commit that landed meanwhile may have made one of them
            // live: decide again on top of it.
            if self.current().await?.map(|(v, _)| v) != Some(version) {
                continue;
            }
            for key in doomed {
                self.location().delete(&key).await?;
                out.removed.push(key);
            }
            return Ok(out);
        }
        Err(IcebergError::Contended(MAX_COMMIT_ATTEMPTS))
    }
}

/// What [`IcebergTable::remove_orphans`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemovedOrphans {
    pub removed: Vec<String>,
    /// Orphans left because they changed after the cut-off.
    pub recent: usize,
}
