//! Upkeep of a Parquet destination: superseded commit files expire, and
//! data files no commit lists (orphans) are removed once old.
//!
//! A reader reads each partition's current commit only; superseded commits
//! stay for readers that picked one just before it was superseded. A table
//! that exports itself adds a commit per increment, and every request reads
//! all of a partition's commit files, so they must not pile up forever.
//!
//! Neither step ever touches what a reader is told to read: the current
//! commit is never expired, and a file any commit lists (read again after
//! the listing, so a commit landing meanwhile counts) is never removed.
//!
//! An Iceberg destination keeps, beside its metadata, the shards of each
//! export's files (`metadata/ferry-shards-<transaction>.json`, read by the
//! next increment); [`remove_superseded_shards`] deletes those of exports no
//! partition holds any more.

use std::collections::BTreeSet;

use ferry_storage::{Location, StorageError};

use crate::lake;
use crate::model::SCHEMA_KEY;

/// What [`expire_commits`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Expired {
    /// Commit files deleted.
    pub removed: Vec<String>,
    /// Superseded commit files kept (superseded after the cut-off).
    pub kept: usize,
}

/// Deletes the commit files superseded by `cut_unix_seconds`: those whose
/// successor (the partition's next commit by rank) was created by then. A partition's current commit is never deleted. The files only
/// they listed become orphans ([`remove_orphans`]).
pub async fn expire_commits(
    location: &Location,
    cut_unix_seconds: u64,
) -> Result<Expired, StorageError> {
    let view = lake::read(location, None).await?;
    let mut out = Expired::default();
    for p in &view.partitions {
        // Newest first: each one's successor is the one before it.
        let mut successor = &p.current;
        for c in &p.superseded {
            if successor.file.create_time <= cut_unix_seconds {
                location.delete(&c.key).await?;
                out.removed.push(c.key.clone());
            } else {
                out.kept += 1;
            }
            successor = c;
        }
    }
    if !out.removed.is_empty() {
        tracing::info!(destination = %location.url(), removed = out.removed.len(), kept = out.kept, "superseded commit files expired");
    }
    Ok(out)
}

/// What [`remove_orphans`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Removed {
    pub removed: Vec<String>,
    /// Orphans modified after the cut-off, kept (an export's files are
    /// orphans until its commit lands).
    pub recent: usize,
}

/// Deletes the data files no commit file lists that were last modified
/// before `cut_ms` (Unix milliseconds). Choose the cut-off older than the
/// longest export: an export's files are orphans until its commit lands.
pub async fn remove_orphans(location: &Location, cut_ms: i64) -> Result<Removed, StorageError> {
    let listed_before = referenced(location).await?;
    let files: Vec<(String, u64, i64)> = location
        .list_modified("")
        .await?
        .into_iter()
        .filter(|(key, _, _)| key.contains('/') && key.ends_with(".parquet") && key != SCHEMA_KEY)
        .filter(|(key, _, _)| !listed_before.contains(key))
        .collect();
    if files.is_empty() {
        return Ok(Removed::default());
    }
    // A commit that landed since the first read may list some of them.
    let listed = referenced(location).await?;
    let mut out = Removed::default();
    for (key, _, modified) in files {
        if listed.contains(&key) {
            continue;
        }
        if modified >= cut_ms {
            out.recent += 1;
            continue;
        }
        location.delete(&key).await?;
        out.removed.push(key);
    }
    Ok(out)
}

/// Every data file any commit file lists.
async fn referenced(location: &Location) -> Result<BTreeSet<String>, StorageError> {
    let view = lake::read(location, None).await?;
    Ok(view
        .partitions
        .iter()
        .flat_map(|p| std::iter::once(&p.current).chain(&p.superseded))
        .flat_map(|c| c.file.files.iter().map(|f| f.path.clone()))
        .collect())
}

/// Deletes the shards files (`metadata/ferry-shards-<transaction>.json`) of
/// an Iceberg destination whose export is no partition's current one and
/// which were last modified before `cut_ms` (Unix milliseconds): an export
/// writes its file before its commit lands, and the cut-off leaves those in
/// flight alone. Returns how many went. A file removed too eagerly costs
/// only efficiency: the next export of its partition is a whole one.
pub async fn remove_superseded_shards(location: &Location, cut_ms: i64) -> Result<usize, String> {
    let table = ferry_iceberg::IcebergTable::new(location.clone());
    let Some((_, meta)) = table.current().await.map_err(|e| e.to_string())? else {
        return Ok(0);
    };
    let current: BTreeSet<String> = meta
        .properties
        .iter()
        .filter(|(k, _)| k.starts_with("ferry.partition.") && k.ends_with(".transaction-id"))
        .filter_map(|(_, v)| serde_json::from_str::<ferry_iceberg::CurrentExport>(v).ok())
        .map(|e| lake::iceberg_shards_key(&e.transaction_id))
        .collect();
    let mut removed = 0;
    for (key, _, modified) in location
        .list_modified("metadata")
        .await
        .map_err(|e| e.to_string())?
    {
        let is_shards = key.starts_with("metadata/ferry-shards-") && key.ends_with(".json");
        if !is_shards || current.contains(&key) || modified >= cut_ms {
            continue;
        }
        match location.delete(&key).await {
            Ok(()) => removed += 1,
            Err(StorageError::NotFound { .. }) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(removed)
}
