//! What an exporting node has locally: its replicas' parts, and how it
//! opens destinations.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_replica::{PartMeta, PartName, SharedReplica, ALL_SHARDS};
use ferry_storage::{Location, S3Settings, StorageError};
use ferry_table::Table;
use ferry_wal::Lsn;

use crate::dest::SourcePart;

/// The parts a node holds, through its replicas.
#[async_trait]
pub trait LocalParts: Send + Sync {
    /// Waits until the replicas a snapshot of `table` reads have applied
    /// everything below `lsn`; on timeout, the position they reached.
    async fn wait_applied(&self, table: &Table, lsn: Lsn, timeout: Duration) -> Result<(), Lsn>;

    /// The active parts of a partition across all of the table's shards.
    async fn snapshot(&self, table: &Table, partition_id: &str) -> Result<Vec<PartMeta>, String>;

    /// The table's partitions with active parts, across its shards.
    async fn partitions(&self, table: &Table) -> Result<Vec<String>, String> {
        let mut ids = std::collections::BTreeSet::new();
        for p in self.all_parts(table).await? {
            if p.rows > 0 {
                ids.insert(p.name.partition_id);
            }
        }
        Ok(ids.into_iter().collect())
    }

    /// Every active part of a table across its shards.
    async fn all_parts(&self, table: &Table) -> Result<Vec<PartMeta>, String>;

    /// A part to export, active or kept by a pin, if a replica here holds it.
    async fn find(&self, table_id: u64, name: &PartName) -> Option<SourcePart>;

    /// Keeps parts alive for an export (persisted) on every replica here.
    async fn pin(
        &self,
        transaction_id: &str,
        table_id: u64,
        names: &[PartName],
    ) -> Result<(), String>;

    async fn unpin(&self, transaction_id: &str) -> Result<(), String>;

    /// Exports holding pins on some replica here.
    async fn pinned(&self) -> Vec<String>;
}

/// The replicas of a node.
pub struct ReplicaSet {
    replicas: Vec<SharedReplica>,
}

impl ReplicaSet {
    pub fn new(replicas: Vec<SharedReplica>) -> ReplicaSet {
        ReplicaSet { replicas }
    }

    /// One replica per shard of the table: a replica of every shard if
    /// there is one, else the first replica of each shard.
    async fn covering(&self, table: &Table) -> Result<Vec<SharedReplica>, String> {
        let mut by_shard: BTreeMap<u32, SharedReplica> = BTreeMap::new();
        for r in &self.replicas {
            let shard = r.lock().await.subscribe().borrow().shard;
            if shard == ALL_SHARDS {
                return Ok(vec![Arc::clone(r)]);
            }
            by_shard.entry(shard).or_insert_with(|| Arc::clone(r));
        }
        let shards = table.def.shard_by.shards;
        let mut out = Vec::new();
        for s in 0..shards {
            match by_shard.get(&s) {
                Some(r) => out.push(Arc::clone(r)),
                None => {
                    return Err(format!(
                        "table {} has {shards} shards and this node holds no replica of shard {s}; \
                         send the export to a node that holds every shard (exports from single-shard \
                         replicas are not implemented yet)",
                        table.def.name
                    ))
                }
            }
        }
        Ok(out)
    }
}

#[async_trait]
impl LocalParts for ReplicaSet {
    async fn wait_applied(&self, table: &Table, lsn: Lsn, timeout: Duration) -> Result<(), Lsn> {
        let Ok(replicas) = self.covering(table).await else {
            return Err(Lsn(0));
        };
        let deadline = tokio::time::Instant::now() + timeout;
        for r in replicas {
            let mut status = r.lock().await.subscribe();
            loop {
                let at = status.borrow_and_update().disk_consistent_lsn;
                if at >= lsn {
                    break;
                }
                match tokio::time::timeout_at(deadline, status.changed()).await {
                    Ok(Ok(())) => {}
                    _ => return Err(at),
                }
            }
        }
        Ok(())
    }

    async fn snapshot(&self, table: &Table, partition_id: &str) -> Result<Vec<PartMeta>, String> {
        let mut parts = self.all_parts(table).await?;
        parts.retain(|p| p.name.partition_id == partition_id);
        Ok(parts)
    }

    async fn all_parts(&self, table: &Table) -> Result<Vec<PartMeta>, String> {
        let mut parts = Vec::new();
        for r in self.covering(table).await? {
            parts.extend(r.lock().await.parts(table.id));
        }
        parts.sort_by(|a, b| a.name.cmp(&b.name));
        parts.dedup_by(|a, b| a.name == b.name);
        Ok(parts)
    }

    async fn find(&self, table_id: u64, name: &PartName) -> Option<SourcePart> {
        for r in &self.replicas {
            let r = r.lock().await;
            if let Some((path, meta)) = r.export_part(table_id, name) {
                return Some(SourcePart {
                    disk: Arc::clone(r.disk()),
                    path,
                    meta,
                });
            }
        }
        None
    }

    async fn pin(
        &self,
        transaction_id: &str,
        table_id: u64,
        names: &[PartName],
    ) -> Result<(), String> {
        for r in &self.replicas {
            let mut r = r.lock().await;
            let held: Vec<PartName> = names
                .iter()
                .filter(|n| r.export_part(table_id, n).is_some())
                .cloned()
                .collect();
            if !held.is_empty() {
                r.pin(transaction_id, table_id, &held)
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    async fn unpin(&self, transaction_id: &str) -> Result<(), String> {
        for r in &self.replicas {
            r.lock()
                .await
                .unpin(transaction_id)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    async fn pinned(&self) -> Vec<String> {
        let mut out = Vec::new();
        for r in &self.replicas {
            out.extend(r.lock().await.pinned_exports());
        }
        out.sort();
        out.dedup();
        out
    }
}

/// How a node opens destination URLs.
pub trait Destinations: Send + Sync {
    fn open(&self, url: &str) -> Result<Location, StorageError>;
}

/// `file://` and `s3://` through `ferry_storage`, each location opened once.
pub struct StorageDestinations {
    s3: S3Settings,
    opened: Mutex<BTreeMap<String, Location>>,
}

/// Opened locations kept at once (each holds an HTTP client).
const MAX_OPEN_LOCATIONS: usize = 64;

impl StorageDestinations {
    pub fn new(s3: S3Settings) -> StorageDestinations {
        StorageDestinations {
            s3,
            opened: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Destinations for StorageDestinations {
    fn open(&self, url: &str) -> Result<Location, StorageError> {
        let mut opened = self.opened.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = opened.get(url) {
            return Ok(l.clone());
        }
        let location = ferry_storage::open(url, &self.s3)?;
        if opened.len() >= MAX_OPEN_LOCATIONS {
            opened.clear();
        }
        opened.insert(url.to_string(), location.clone());
        Ok(location)
    }
}
