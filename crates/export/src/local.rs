//! What an exporting node has locally: its replicas' parts, and how it
//! opens destinations. Shards this node holds no replica of are asked of
//! a replica of that shard elsewhere, through [`RemoteShards`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_replica::{PartMeta, PartName, SharedReplica, ALL_SHARDS};
use ferry_storage::{Location, S3Settings, StorageError};
use ferry_table::Table;
use ferry_wal::Lsn;
use serde::{Deserialize, Serialize};

use crate::dest::SourcePart;

/// What a snapshot reads, and the pin it takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    pub table: Table,
    /// One partition's active parts, or every active part of the table.
    pub partition_id: Option<String>,
    /// Every record below this position is applied before the parts are listed.
    pub at: Lsn,
    /// How long the wait for `at` may take.
    pub wait_ms: u64,
    /// The export whose pin keeps the listed parts alive across merges.
    pub pin: Option<String>,
}

impl SnapshotRequest {
    pub fn wait(&self) -> Duration {
        Duration::from_millis(self.wait_ms)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum SnapshotError {
    /// The replicas did not apply `at` in time; the position one reached.
    #[error("a replica reached {reached} only")]
    Behind { reached: Lsn },
    /// No replica of some shard could answer.
    #[error("{0}")]
    NotHeld(String),
}

/// The parts a node holds, through its replicas.
#[async_trait]
pub trait LocalParts: Send + Sync {
    /// Waits until replicas of every shard of the table have applied
    /// `req.at`, then lists the active parts (across all shards) and pins
    /// them under `req.pin` where they are held.
    async fn snapshot(&self, req: &SnapshotRequest) -> Result<Vec<PartMeta>, SnapshotError>;

    /// The table's partitions with rows, across its shards, as of `at`.
    async fn partitions(
        &self,
        table: &Table,
        at: Lsn,
        wait: Duration,
    ) -> Result<Vec<String>, SnapshotError> {
        let parts = self
            .snapshot(&SnapshotRequest {
                table: table.clone(),
                partition_id: None,
                at,
                wait_ms: wait.as_millis() as u64,
                pin: None,
            })
            .await?;
        let ids: std::collections::BTreeSet<String> = parts
            .into_iter()
            .filter(|p| p.rows > 0)
            .map(|p| p.name.partition_id)
            .collect();
        Ok(ids.into_iter().collect())
    }

    /// A part to export, active or kept by a pin, if a replica here holds it.
    async fn find(&self, table_id: u64, name: &PartName) -> Option<SourcePart>;

    /// Keeps parts alive for an export (persisted) on every replica here.
    async fn pin(
        &self,
        transaction_id: &str,
        table_id: u64,
        names: &[PartName],
    ) -> Result<(), String>;

    /// Releases an export's pins on the replicas here.
    async fn unpin(&self, transaction_id: &str) -> Result<(), String>;

    /// Releases the pins a snapshot took, here and on the nodes it asked
    /// (a request whose task was not created).
    async fn release_snapshot(&self, transaction_id: &str) -> Result<(), String> {
        self.unpin(transaction_id).await
    }

    /// Exports holding pins on some replica here.
    async fn pinned(&self) -> Vec<String>;

    /// How many replicas here hold `shard` of the table (`None`: every
    /// shard in common parts), if each of them has applied `at`; `None`
    /// while one of them is behind (it may still make a part of that
    /// snapshot). What a node says of a part it does not hold counts
    /// towards declaring it lost only when this answers (see the
    /// exporter's `lost` check); by default it never does.
    async fn replicas_caught_up(&self, table_id: u64, shard: Option<u32>, at: Lsn) -> Option<u32> {
        let _ = (table_id, shard, at);
        None
    }
}

/// Replicas of shards a node does not hold, elsewhere in the cluster.
#[async_trait]
pub trait RemoteShards: Send + Sync {
    /// A snapshot of one shard taken by a live replica of it.
    async fn snapshot(
        &self,
        shard: u32,
        req: &SnapshotRequest,
    ) -> Result<Vec<PartMeta>, SnapshotError>;

    /// Releases an export's pins on every replica of the cluster that answers.
    async fn unpin(&self, transaction_id: &str) -> Result<(), String>;
}

/// The replicas of a node, and where the shards it lacks are asked.
pub struct ReplicaSet {
    replicas: Vec<SharedReplica>,
    remote: Option<Arc<dyn RemoteShards>>,
}

impl ReplicaSet {
    pub fn new(replicas: Vec<SharedReplica>) -> ReplicaSet {
        ReplicaSet {
            replicas,
            remote: None,
        }
    }

    /// Shards held by no replica here are snapshotted through `remote`.
    pub fn with_remote(mut self, remote: Arc<dyn RemoteShards>) -> ReplicaSet {
        self.remote = Some(remote);
        self
    }

    /// The replicas here by shard of a table with `shards` shards.
    async fn held(&self, shards: u32) -> Held {
        let mut by_shard: BTreeMap<u32, SharedReplica> = BTreeMap::new();
        for r in &self.replicas {
            let shard = r.lock().await.subscribe().borrow().shard;
            if shard == ALL_SHARDS {
                return Held::All(Arc::clone(r));
            }
            if shard < shards {
                by_shard.entry(shard).or_insert_with(|| Arc::clone(r));
            }
        }
        Held::Shards(by_shard)
    }

    /// A snapshot of the given shards from the replicas here only (what a
    /// node answers for another node's request).
    pub async fn snapshot_local(
        &self,
        req: &SnapshotRequest,
        shards: &[u32],
    ) -> Result<Vec<PartMeta>, SnapshotError> {
        let all = req.table.def.shard_by.shards;
        let replicas: Vec<SharedReplica> = match self.held(all).await {
            // A replica of every shard mixes their rows in its parts: it
            // answers for the whole table only.
            Held::All(r) if (0..all).all(|s| shards.contains(&s)) => vec![r],
            Held::All(_) => {
                return Err(SnapshotError::NotHeld(format!(
                    "this node's replica holds every shard of table {} in common parts; \
                     it cannot list some shards alone",
                    req.table.def.name
                )))
            }
            Held::Shards(held) => {
                let mut out = Vec::new();
                for s in shards {
                    let Some(r) = held.get(s) else {
                        return Err(SnapshotError::NotHeld(format!(
                            "this node holds no replica of shard {s} of table {}",
                            req.table.def.name
                        )));
                    };
                    out.push(Arc::clone(r));
                }
                out
            }
        };
        let deadline = tokio::time::Instant::now() + req.wait();
        for r in &replicas {
            let mut status = r.lock().await.subscribe();
            loop {
                let at = status.borrow_and_update().disk_consistent_lsn;
                if at >= req.at {
                    break;
                }
                match tokio::time::timeout_at(deadline, status.changed()).await {
                    Ok(Ok(())) => {}
                    _ => return Err(SnapshotError::Behind { reached: at }),
                }
            }
        }
        let mut parts = Vec::new();
        let wanted = |partition: &str| req.partition_id.as_deref().is_none_or(|id| partition == id);
        for r in &replicas {
            let r = r.lock().await;
            let shard = (r.shard() != ALL_SHARDS).then(|| r.shard());
            parts.extend(
                r.parts(req.table.id)
                    .into_iter()
                    .filter(|p| wanted(&p.name.partition_id))
                    .map(|p| PartMeta { shard, ..p }),
            );
            // Rows retention dropped: listed as the lake files holding
            // them, which an export carries (see ferry_replica's `retire`).
            for retired in r.retired(req.table.id) {
                if wanted(&retired.partition_id) {
                    parts.extend(retired.as_parts(shard));
                }
            }
        }
        parts.sort_by(|a, b| a.name.cmp(&b.name));
        parts.dedup_by(|a, b| a.name == b.name);
        if let Some(tx) = &req.pin {
            let names: Vec<PartName> = parts
                .iter()
                .filter(|p| !p.retired)
                .map(|p| p.name.clone())
                .collect();
            self.pin(tx, req.table.id, &names).await.map_err(|e| {
                SnapshotError::NotHeld(format!("pinning the snapshot's parts: {e}"))
            })?;
        }
        Ok(parts)
    }
}

enum Held {
    /// A replica of every shard (`ferry dev`).
    All(SharedReplica),
    /// One replica per shard held.
    Shards(BTreeMap<u32, SharedReplica>),
}

#[async_trait]
impl LocalParts for ReplicaSet {
    async fn snapshot(&self, req: &SnapshotRequest) -> Result<Vec<PartMeta>, SnapshotError> {
        let all = req.table.def.shard_by.shards;
        let held: Vec<u32> = match self.held(all).await {
            Held::All(_) => (0..all).collect(),
            Held::Shards(h) => h.keys().copied().collect(),
        };
        let missing: Vec<u32> = (0..all).filter(|s| !held.contains(s)).collect();
        if !missing.is_empty() && self.remote.is_none() {
            return Err(SnapshotError::NotHeld(format!(
                "table {} has {all} shards and this node holds no replica of shard {}; \
                 send the export to a node that holds every shard",
                req.table.def.name, missing[0]
            )));
        }
        let mut parts = if held.is_empty() {
            Vec::new()
        } else {
            self.snapshot_local(req, &held).await?
        };
        if let Some(remote) = &self.remote {
            for s in missing {
                match remote.snapshot(s, req).await {
                    Ok(p) => parts.extend(p),
                    Err(e) => {
                        if let Some(tx) = &req.pin {
                            if let Err(u) = self.release_snapshot(tx).await {
                                tracing::warn!(transaction_id = %tx, error = %u, "could not release a failed snapshot's pins");
                            }
                        }
                        return Err(e);
                    }
                }
            }
        }
        parts.sort_by(|a, b| a.name.cmp(&b.name));
        parts.dedup_by(|a, b| a.name == b.name);
        Ok(parts)
    }

    async fn release_snapshot(&self, transaction_id: &str) -> Result<(), String> {
        self.unpin(transaction_id).await?;
        match &self.remote {
            Some(remote) => remote.unpin(transaction_id).await,
            None => Ok(()),
        }
    }

    async fn replicas_caught_up(&self, _table_id: u64, shard: Option<u32>, at: Lsn) -> Option<u32> {
        let mut n = 0;
        for r in &self.replicas {
            let r = r.lock().await;
            let holds = match shard {
                Some(s) => r.shard() == s || r.shard() == ALL_SHARDS,
                None => r.shard() == ALL_SHARDS,
            };
            if !holds {
                continue;
            }
            if r.subscribe().borrow().disk_consistent_lsn < at {
                return None;
            }
            n += 1;
        }
        Some(n)
    }

    async fn find(&self, table_id: u64, name: &PartName) -> Option<SourcePart> {
        for r in &self.replicas {
            let r = r.lock().await;
            if let Some((path, meta)) = r.export_part(table_id, name) {
                return Some(SourcePart {
                    disk: Arc::clone(r.disk()),
                    path,
                    meta,
                    shard: (r.shard() != ferry_replica::replica::ALL_SHARDS).then(|| r.shard()),
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

/// `file://` and `s3://` through `ferry_storage`, each location opened once;
/// a `file://` location only under one of the node's export roots (checked
/// before anything is created, by the request and again by every worker).
pub struct StorageDestinations {
    s3: S3Settings,
    roots: ferry_storage::LocalRoots,
    opened: Mutex<BTreeMap<String, Location>>,
}

/// Opened locations kept at once (each holds an HTTP client).
const MAX_OPEN_LOCATIONS: usize = 64;

impl StorageDestinations {
    pub fn new(s3: S3Settings, roots: ferry_storage::LocalRoots) -> StorageDestinations {
        StorageDestinations {
            s3,
            roots,
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
        self.roots.check(url)?;
        let location = ferry_storage::open(url, &self.s3)?;
        if opened.len() >= MAX_OPEN_LOCATIONS {
            opened.clear();
        }
        opened.insert(url.to_string(), location.clone());
        Ok(location)
    }
}
