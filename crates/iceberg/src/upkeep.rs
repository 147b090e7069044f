//! Lake upkeep: expiring old snapshots. A new metadata version (created
//! create-only, like a commit's) keeps the current snapshot and every
//! snapshot newer than a cut-off; the table's properties, and with them
//! each partition's current export (the commit identity), are carried over
//! untouched, so a retried commit of an export still finds it after its
//! snapshot expired. Files only expired snapshots referenced become
//! orphans (`ferry verify` names them); nothing is deleted here.

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
}
