//! One replica of one shard: applies committed insert records, in LSN order,
//! as parts on its disk, and keeps `disk_consistent_lsn`.
//!
//! Layout under the replica's directory:
//!
//! ```text
//! state                          JSON: disk_consistent_lsn, the idempotency window
//! parts/<table_id>/<part>.parquet
//! parts/<table_id>/<part>.parquet.tmp    a part being written (removed at start)
//! ```
//!
//! Invariants:
//! * **Parts first, then the position.** A part is written to a temporary
//!   name, fsynced, renamed and its directory fsynced before the state file
//!   (written atomically) moves `disk_consistent_lsn` past its record. A crash
//!   at any instant leaves every part of a record below `disk_consistent_lsn`
//!   in place, and at most the parts of records after it, which re-applying
//!   finds already there (a part of the same name, or a part covering the
//!   block) and does not write again: nothing lost, nothing twice. The syncs
//!   are batched: while the replica is behind its safekeeper's `commit_lsn`,
//!   parts wait under their temporary names (not active, not counted by
//!   reads) and are synced, renamed and their directory synced once per
//!   [`PERSIST_EVERY_BYTES`] of applied WAL, just before the state is
//!   written; once it has everything committed, at once. The kernel writes
//!   them back meanwhile, so the syncs overlap applying.
//! * **A function of the WAL alone.** Which records are applied (own shard,
//!   known table, key not in the window), the parts they become (one per
//!   partition, rows in record order) and their names depend only on the
//!   committed WAL, so every replica of a shard holds the same parts.
//! * **Idempotency window.** A record whose (table, shard, key) is among the
//!   last [`DEDUP_WINDOW`] keyed records of the shard applied before it is
//!   skipped. The ingest API gives each record of a keyed insert a key of its
//!   own (the request's key, a digest of the insert's rows, the record's
//!   place in it), so only an exact retry of a record is skipped: never
//!   another record of the same insert, nor a key reused for other rows.
//! * **Hostile WAL stops the replica.** A record of a table id never handed
//!   out, rows that do not decode or do not match the table's schema, or a
//!   malformed record stop the replica with an error naming the LSN; it never
//!   writes a part it cannot vouch for.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use arrow::array::RecordBatch;
use async_trait::async_trait;
use bytes::Bytes;
use ferry_env::{Cpu, Disk};
use ferry_table::Table;
use ferry_wal::record::{self, Record};
use ferry_wal::Lsn;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::part::{self, PartMeta, PartName};

/// The shard number of a replica that applies every shard's records (`ferry
/// dev`, whose replicas hold whole tables).
pub const ALL_SHARDS: u32 = u32::MAX;

/// Parts of one level in a partition that are merged into one part of the next.
pub const MERGE_FANIN: usize = 8;
/// Parts of this level are not merged further.
pub const MAX_MERGE_LEVEL: u32 = 4;

/// Applied WAL after which parts are synced and the position persisted even
/// while the replica is behind.
pub const PERSIST_EVERY_BYTES: u64 = 16 << 20;

/// Keyed inserts of a shard remembered for deduplication.
pub const DEDUP_WINDOW: usize = 4096;

/// What a table id in a WAL record names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableRef {
    Known(Table),
    /// Handed out, but the table was dropped: its records are skipped.
    Dropped,
    /// Never handed out: the WAL is not ferry's, or the catalog is not this
    /// cluster's.
    Unknown,
}

/// Where a replica learns what a table id is (the catalog in coordination).
#[async_trait]
pub trait Tables: Send + Sync {
    async fn by_id(&self, id: u64) -> Result<TableRef, String>;
}

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("replica storage {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("replica state {path} is damaged: {detail}")]
    Damaged { path: String, detail: String },
    #[error("WAL record at {lsn}: {detail}; the replica stopped rather than write a wrong part")]
    BadRecord { lsn: Lsn, detail: String },
    #[error("looking up table {table_id} for the record at {lsn}: {detail}")]
    Catalog {
        table_id: u64,
        lsn: Lsn,
        detail: String,
    },
    #[error(transparent)]
    Part(#[from] part::PartError),
    /// Every safekeeper removed the WAL this replica needs next, and no backup
    /// holds it: the replica cannot be built from the WAL service (it needs
    /// the WAL backup configured on the safekeepers, or a copy of a peer
    /// replica's data).
    #[error("the WAL this replica needs from {needed} was removed on every safekeeper and is in no backup ({horizons})")]
    WalRemoved { needed: Lsn, horizons: String },
}

fn io(path: &str) -> impl FnOnce(std::io::Error) -> ReplicaError + '_ {
    move |source| ReplicaError::Io {
        path: path.to_string(),
        source,
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct State {
    format: u32,
    shard: u32,
    replica: u32,
    disk_consistent_lsn: Lsn,
    /// (table id, shard, key, LSN of the record that applied it), oldest first.
    window: VecDeque<(u64, u32, String, Lsn)>,
    /// Merges decided and not yet done, in the order decided.
    #[serde(default)]
    merges: Vec<Merge>,
    /// Parts that pending exports still need, by the export's transaction
    /// id: a merge that replaces one keeps its file (see [`Replica::pin`]).
    #[serde(default)]
    pins: BTreeMap<String, Vec<(u64, PartName)>>,
}

/// A merge: `sources` (consecutive parts of one partition, same level, in block
/// order) become `result`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Merge {
    pub table_id: u64,
    pub result: PartName,
    pub sources: Vec<PartName>,
}

const STATE_FORMAT: u32 = 1;

/// What others see of a replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaStatus {
    pub shard: u32,
    pub replica: u32,
    pub disk_consistent_lsn: Lsn,
    pub last_received_lsn: Lsn,
    pub records_applied: u64,
    pub records_skipped_duplicate: u64,
    pub parts: usize,
    /// Merges decided and not yet done.
    pub pending_merges: usize,
    pub merges_done: u64,
    /// Rows and bytes of the parts merges wrote.
    pub merged_rows: u64,
    pub merged_bytes: u64,
    /// Why the replica stopped, if it did.
    pub error: Option<String>,
}

/// A replica's data: its parts and its position, on its disk.
pub struct Replica {
    disk: Arc<dyn Disk>,
    dir: String,
    cpu: Cpu,
    tables: Arc<dyn Tables>,
    state: State,
    /// Active parts by table.
    parts: BTreeMap<u64, BTreeMap<PartName, PartMeta>>,
    /// Parts a merge replaced that a pin keeps on disk (readable by the
    /// export that pinned them, never listed as active).
    kept: BTreeMap<u64, BTreeMap<PartName, PartMeta>>,
    /// Kept parts no pin names any more (replaced parts found at open, or
    /// unpinned), for the merge task to remove after the grace period unless
    /// pinned again by then: an export this replica learns of after a
    /// restart may still need them.
    unpinned: Vec<(u64, PartName)>,
    table_cache: BTreeMap<u64, TableRef>,
    /// Parts of applied records written under their temporary names and not
    /// yet synced: made durable, renamed and listed by the next
    /// [`persist`](Self::persist), which must precede any state written.
    unsynced: Vec<UnsyncedPart>,
    /// WAL bytes applied since the state was last written.
    unpersisted_bytes: u64,
    /// `disk_consistent_lsn` as the state file holds it; the state in memory
    /// is ahead of it by the records applied since.
    persisted_lsn: Lsn,
    status: watch::Sender<ReplicaStatus>,
    /// Received WAL not yet applied (an incomplete record at its end).
    pending: Vec<u8>,
    pending_start: Lsn,
}

impl Replica {
    /// Opens (or creates) the replica under `dir` of `disk`: removes parts left
    /// half-written by a crash and checks every part and the state.
    pub async fn open(
        disk: Arc<dyn Disk>,
        dir: &str,
        shard: u32,
        replica: u32,
        cpu: Cpu,
        tables: Arc<dyn Tables>,
    ) -> Result<Replica, ReplicaError> {
        let state_path = format!("{dir}/state");
        disk.create_dir_all(&format!("{dir}/parts"))
            .await
            .map_err(io(dir))?;
        let state = match disk.read(&state_path).await {
            Ok(bytes) => {
                let s: State =
                    serde_json::from_slice(&bytes).map_err(|e| ReplicaError::Damaged {
                        path: state_path.clone(),
                        detail: e.to_string(),
                    })?;
                if s.format != STATE_FORMAT || s.shard != shard || s.replica != replica {
                    return Err(ReplicaError::Damaged {
                        path: state_path,
                        detail: format!(
                            "format {} of shard {} replica {}, expected format {STATE_FORMAT} of shard {shard} replica {replica}",
                            s.format, s.shard, s.replica
                        ),
                    });
                }
                s
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State {
                format: STATE_FORMAT,
                shard,
                replica,
                ..State::default()
            },
            Err(e) => return Err(io(&state_path)(e)),
        };
        let mut parts: BTreeMap<u64, BTreeMap<PartName, PartMeta>> = BTreeMap::new();
        let mut kept: BTreeMap<u64, BTreeMap<PartName, PartMeta>> = BTreeMap::new();
        let mut unpinned = Vec::new();
        let parts_dir = format!("{dir}/parts");
        for table in disk.list_dir(&parts_dir).await.map_err(io(&parts_dir))? {
            let Ok(table_id) = table.parse::<u64>() else {
                continue;
            };
            let tdir = format!("{parts_dir}/{table}");
            for file in disk.list_dir(&tdir).await.map_err(io(&tdir))? {
                let path = format!("{tdir}/{file}");
                if file.ends_with(".tmp") {
                    tracing::info!(%path, "removing a part left half-written by a crash");
                    disk.remove_file(&path).await.map_err(io(&path))?;
                    continue;
                }
                let Some(name) = file.strip_suffix(".parquet").and_then(PartName::parse) else {
                    continue;
                };
                let meta = part::PartReader::open(disk.as_ref(), &path, &name)
                    .await?
                    .meta()
                    .clone();
                if meta.min_lsn >= state.disk_consistent_lsn && name.level == 0 {
                    // Written for a record past the recorded position: it is
                    // written again, identically, when the record is applied
                    // again, and until then no merge decision may count it.
                    tracing::info!(%path, "removing a part of a record not yet recorded as applied");
                    disk.remove_file(&path).await.map_err(io(&path))?;
                    continue;
                }
                parts.entry(table_id).or_default().insert(name, meta);
            }
            // A part covered by another (a merge's result) was replaced: the
            // merge finished but the sources were not all removed yet.
            let covered: Vec<PartName> = parts
                .get(&table_id)
                .map(|p| {
                    p.keys()
                        .filter(|n| p.keys().any(|o| replaces(o, n)))
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            for name in covered {
                // Not removed here: a pin may name it, or an export this
                // replica has not yet seen since the restart may need it.
                if let Some(meta) = parts.get_mut(&table_id).and_then(|p| p.remove(&name)) {
                    let pinned = state
                        .pins
                        .values()
                        .flatten()
                        .any(|(t, n)| *t == table_id && *n == name);
                    if !pinned {
                        unpinned.push((table_id, name.clone()));
                    }
                    kept.entry(table_id).or_default().insert(name, meta);
                }
            }
            disk.sync_dir(&tdir).await.map_err(io(&tdir))?;
        }
        let mut state = state;
        // Merges whose result is there are done.
        state.merges.retain(|m| {
            !parts
                .get(&m.table_id)
                .is_some_and(|p| p.contains_key(&m.result))
        });
        let status = ReplicaStatus {
            shard,
            replica,
            disk_consistent_lsn: state.disk_consistent_lsn,
            last_received_lsn: state.disk_consistent_lsn,
            records_applied: 0,
            records_skipped_duplicate: 0,
            parts: parts.values().map(BTreeMap::len).sum(),
            pending_merges: state.merges.len(),
            merges_done: 0,
            merged_rows: 0,
            merged_bytes: 0,
            error: None,
        };
        let (status, _) = watch::channel(status);
        let pending_start = state.disk_consistent_lsn;
        Ok(Replica {
            disk,
            dir: dir.to_string(),
            cpu,
            tables,
            pending_start,
            state,
            parts,
            kept,
            unpinned,
            table_cache: BTreeMap::new(),
            unsynced: Vec::new(),
            unpersisted_bytes: 0,
            persisted_lsn: pending_start,
            status,
            pending: Vec::new(),
        })
    }

    /// The position the state file holds: every record below it is applied
    /// and its parts are durable, across any crash.
    pub fn disk_consistent_lsn(&self) -> Lsn {
        self.persisted_lsn
    }

    /// Where the stream must resume: the end of the WAL received and kept.
    pub fn receive_from(&self) -> Lsn {
        Lsn(self.pending_start.0 + self.pending.len() as u64)
    }

    /// Forgets received WAL that was not applied (a new stream starts at the
    /// applied position).
    pub fn reset_stream(&mut self) {
        self.pending.clear();
        self.pending_start = self.state.disk_consistent_lsn;
    }

    pub fn subscribe(&self) -> watch::Receiver<ReplicaStatus> {
        self.status.subscribe()
    }

    /// Active parts of a table.
    pub fn parts(&self, table_id: u64) -> Vec<PartMeta> {
        self.parts
            .get(&table_id)
            .map(|p| p.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Pins parts for an export (its transaction id): while pinned, a part
    /// a merge replaces stays on disk and readable through
    /// [`export_part`](Self::export_part), across restarts. Persisted before
    /// it returns. Pinning again under the same id replaces the list.
    pub async fn pin(
        &mut self,
        export: &str,
        table_id: u64,
        names: &[PartName],
    ) -> Result<(), ReplicaError> {
        let list: Vec<(u64, PartName)> = names.iter().map(|n| (table_id, n.clone())).collect();
        if self.state.pins.get(export) == Some(&list) {
            return Ok(());
        }
        self.state.pins.insert(export.to_string(), list);
        self.persist().await
    }

    /// Releases an export's pins; kept parts no other pin names go to the
    /// merge task for removal after the grace period.
    pub async fn unpin(&mut self, export: &str) -> Result<(), ReplicaError> {
        if self.state.pins.remove(export).is_none() {
            return Ok(());
        }
        self.persist().await?;
        let freed: Vec<(u64, PartName)> = self
            .kept
            .iter()
            .flat_map(|(t, p)| p.keys().map(move |n| (*t, n.clone())))
            .filter(|(t, n)| !self.is_pinned(*t, n) && !self.unpinned.contains(&(*t, n.clone())))
            .collect();
        if !freed.is_empty() {
            self.unpinned.extend(freed);
            // Wakes the merge task.
            self.status.send_modify(|_| {});
        }
        Ok(())
    }

    /// Transaction ids of the exports holding pins.
    pub fn pinned_exports(&self) -> Vec<String> {
        self.state.pins.keys().cloned().collect()
    }

    fn is_pinned(&self, table_id: u64, name: &PartName) -> bool {
        self.state
            .pins
            .values()
            .flatten()
            .any(|(t, n)| *t == table_id && n == name)
    }

    /// A part to export: active, or replaced and kept by a pin. Its path
    /// and metadata.
    pub fn export_part(&self, table_id: u64, name: &PartName) -> Option<(String, PartMeta)> {
        let meta = self
            .parts
            .get(&table_id)
            .and_then(|p| p.get(name))
            .or_else(|| self.kept.get(&table_id).and_then(|p| p.get(name)))?;
        Some((self.part_path(table_id, name), meta.clone()))
    }

    /// Replaced parts waiting for removal (the merge task's to take).
    pub fn take_replaced(&mut self) -> Vec<(u64, PartName)> {
        std::mem::take(&mut self.unpinned)
    }

    /// Forgets replaced parts whose grace period is over, except those a pin
    /// names now; returns the paths of the files to remove.
    pub fn release_replaced(&mut self, parts: &[(u64, PartName)]) -> Vec<String> {
        let mut paths = Vec::new();
        for (t, n) in parts {
            if self.is_pinned(*t, n) {
                continue;
            }
            if let Some(kept) = self.kept.get_mut(t) {
                if kept.remove(n).is_some() {
                    paths.push(self.part_path(*t, n));
                }
            }
        }
        paths
    }

    /// Path of a part's file under the disk root.
    pub fn part_path(&self, table_id: u64, name: &PartName) -> String {
        format!("{}/parts/{table_id}/{name}.parquet", self.dir)
    }

    /// The shard this replica applies ([`ALL_SHARDS`] for every one).
    pub fn shard(&self) -> u32 {
        self.state.shard
    }

    pub fn disk(&self) -> &Arc<dyn Disk> {
        &self.disk
    }

    /// Takes WAL received from a walsender (it must continue the stream),
    /// applies every complete record in it and persists the position; returns
    /// the new `disk_consistent_lsn`.
    pub async fn receive(&mut self, begin: Lsn, wal: &[u8]) -> Result<Lsn, ReplicaError> {
        self.receive_until(begin, wal, Lsn(0)).await
    }

    /// Like [`receive`](Self::receive), for a stream whose safekeeper
    /// announced `commit_lsn`: while the replica is behind it, parts are
    /// synced and the position persisted only every
    /// [`PERSIST_EVERY_BYTES`] of applied WAL, so that syncing overlaps
    /// applying; once it has received everything committed, at once.
    pub async fn receive_until(
        &mut self,
        begin: Lsn,
        wal: &[u8],
        commit_lsn: Lsn,
    ) -> Result<Lsn, ReplicaError> {
        let at = self.receive_from();
        if begin != at {
            return Err(ReplicaError::BadRecord {
                lsn: begin,
                detail: format!("WAL arrived from {begin}, the stream is at {at}"),
            });
        }
        // Until a record is complete, its pieces are only gathered: nothing
        // is parsed or copied again per piece. A declared length out of
        // bounds goes on to decoding, which refuses it.
        let plausible =
            |len: usize| (record::HEADER_BYTES..=record::MAX_RECORD_BYTES).contains(&len);
        if self.pending.is_empty() {
            if let Some(len) = record::declared_len(wal).filter(|l| plausible(*l)) {
                self.pending.reserve(len.max(wal.len()));
            }
        }
        self.pending.extend_from_slice(wal);
        self.status
            .send_modify(|s| s.last_received_lsn = self.receive_from());
        match record::declared_len(&self.pending) {
            None => return Ok(self.persisted_lsn),
            Some(len) if plausible(len) && self.pending.len() < len => {
                return Ok(self.persisted_lsn)
            }
            Some(_) => {}
        }
        let buf = Bytes::from(std::mem::take(&mut self.pending));
        let mut used = 0usize;
        let mut applied_any = false;
        let result = loop {
            let rest = buf.slice(used..);
            match record::decode(&rest) {
                Ok((rec, len)) => {
                    let lsn = Lsn(self.pending_start.0 + used as u64);
                    let end = Lsn(lsn.0 + len as u64);
                    if let Err(e) = self.apply(lsn, rec).await {
                        break Err(e);
                    }
                    self.state.disk_consistent_lsn = end;
                    self.unpersisted_bytes += len as u64;
                    used += len;
                    applied_any = true;
                }
                Err(record::RecordError::Incomplete { .. }) => break Ok(()),
                Err(e) => {
                    break Err(ReplicaError::BadRecord {
                        lsn: Lsn(self.pending_start.0 + used as u64),
                        detail: e.to_string(),
                    })
                }
            }
        };
        self.pending = buf[used..].to_vec();
        self.pending_start = Lsn(self.pending_start.0 + used as u64);
        let caught_up = self.receive_from() >= commit_lsn;
        if applied_any
            && (caught_up || result.is_err() || self.unpersisted_bytes >= PERSIST_EVERY_BYTES)
        {
            self.persist().await?;
        }
        if let Err(e) = &result {
            self.status.send_modify(|s| s.error = Some(e.to_string()));
        }
        result?;
        Ok(self.persisted_lsn)
    }

    /// Persists what was applied and not yet persisted (a stream that went
    /// quiet); returns `disk_consistent_lsn`.
    pub async fn flush(&mut self) -> Result<Lsn, ReplicaError> {
        if self.persisted_lsn < self.state.disk_consistent_lsn || !self.unsynced.is_empty() {
            self.persist().await?;
        }
        Ok(self.persisted_lsn)
    }

    /// Makes the applied records durable: their parts synced, renamed and
    /// their directories synced first, then the state written atomically.
    async fn persist(&mut self) -> Result<(), ReplicaError> {
        self.sync_parts().await?;
        let path = format!("{}/state", self.dir);
        let data = serde_json::to_vec(&self.state).expect("state serialises");
        self.disk
            .write_atomic(&path, data)
            .await
            .map_err(io(&path))?;
        let lsn = self.state.disk_consistent_lsn;
        self.persisted_lsn = lsn;
        self.unpersisted_bytes = 0;
        let n = self.parts.values().map(BTreeMap::len).sum();
        let pending = self.state.merges.len();
        self.status.send_modify(|s| {
            s.disk_consistent_lsn = lsn;
            s.parts = n;
            s.pending_merges = pending;
        });
        Ok(())
    }

    /// Syncs and renames every unsynced part, then syncs their directories
    /// once each; the parts become active.
    async fn sync_parts(&mut self) -> Result<(), ReplicaError> {
        let mut dirs = std::collections::BTreeSet::new();
        for part in std::mem::take(&mut self.unsynced) {
            dirs.insert(part.file.dir.clone());
            part.file.sync_and_rename(self.disk.as_ref()).await?;
            self.parts
                .entry(part.table_id)
                .or_default()
                .insert(part.meta.name.clone(), part.meta);
        }
        for dir in dirs {
            self.disk.sync_dir(&dir).await.map_err(io(&dir))?;
        }
        Ok(())
    }

    async fn table(&mut self, table_id: u64, lsn: Lsn) -> Result<TableRef, ReplicaError> {
        if let Some(t) = self.table_cache.get(&table_id) {
            return Ok(t.clone());
        }
        let found = self
            .tables
            .by_id(table_id)
            .await
            .map_err(|detail| ReplicaError::Catalog {
                table_id,
                lsn,
                detail,
            })?;
        if found != TableRef::Unknown {
            self.table_cache.insert(table_id, found.clone());
        }
        Ok(found)
    }

    async fn apply(&mut self, lsn: Lsn, rec: Record) -> Result<(), ReplicaError> {
        let Record::Insert {
            table_id,
            shard,
            block_number,
            idempotency_key,
            arrow_ipc,
        } = rec
        else {
            return Ok(());
        };
        if self.state.shard != ALL_SHARDS && shard != self.state.shard {
            return Ok(());
        }
        let bad = |detail: String| ReplicaError::BadRecord { lsn, detail };
        let table = match self.table(table_id, lsn).await? {
            TableRef::Known(t) => t,
            TableRef::Dropped => return Ok(()),
            TableRef::Unknown => {
                return Err(bad(format!(
                    "table id {table_id} was never created in this cluster's catalog"
                )))
            }
        };
        if block_number != lsn.0 {
            return Err(bad(format!(
                "block number {block_number} is not the record's LSN"
            )));
        }
        // Idempotency: the same key applied before, by another record.
        let key = (!idempotency_key.is_empty())
            .then(|| String::from_utf8_lossy(&idempotency_key).into_owned());
        if let Some(key) = &key {
            let seen = self
                .state
                .window
                .iter()
                .any(|(t, s, k, at)| *t == table_id && *s == shard && k == key && *at != lsn);
            if seen {
                self.status
                    .send_modify(|s| s.records_skipped_duplicate += 1);
                return Ok(());
            }
        }
        // A crash after the parts but before the state: already applied.
        let covered = self
            .parts
            .get(&table_id)
            .is_some_and(|p| p.keys().any(|n| n.covers(block_number)))
            || self
                .unsynced
                .iter()
                .any(|u| u.table_id == table_id && u.meta.name.covers(block_number));
        if !covered {
            let def = table.def.clone();
            let grouped = self
                .cpu
                .run(move || group_by_partition(&def, &arrow_ipc))
                .await
                .map_err(bad)?;
            let schema = table.def.arrow_schema();
            for (partition_id, batch) in grouped {
                let name = PartName {
                    partition_id,
                    min_block: block_number,
                    max_block: block_number,
                    level: 0,
                };
                let part = self
                    .write_part(table_id, &schema, &name, batch, (lsn, lsn))
                    .await?;
                self.unsynced.push(part);
                self.decide_merges(table_id, &name.partition_id);
            }
        }
        if let Some(key) = key {
            if !self.state.window.iter().any(|(_, _, _, at)| *at == lsn) {
                self.state.window.push_back((table_id, shard, key, lsn));
                while self.state.window.len() > DEDUP_WINDOW {
                    self.state.window.pop_front();
                }
            }
        }
        self.status.send_modify(|s| s.records_applied += 1);
        Ok(())
    }

    /// The parts of a partition as the WAL applied so far defines them: the
    /// active parts with every decided merge counted as done.
    fn logical_parts(&self, table_id: u64, partition: &str) -> Vec<PartName> {
        let mut names: std::collections::BTreeSet<PartName> = self
            .parts
            .get(&table_id)
            .into_iter()
            .flat_map(|p| p.keys())
            .chain(
                self.unsynced
                    .iter()
                    .filter(|u| u.table_id == table_id)
                    .map(|u| &u.meta.name),
            )
            .filter(|n| n.partition_id == partition)
            .cloned()
            .collect();
        for m in self.state.merges.iter().filter(|m| m.table_id == table_id) {
            if m.result.partition_id == partition {
                for s in &m.sources {
                    names.remove(s);
                }
                names.insert(m.result.clone());
            }
        }
        names.into_iter().collect()
    }

    /// The merge policy, a function of the applied WAL alone: whenever a
    /// partition holds [`MERGE_FANIN`] parts of one level (below
    /// [`MAX_MERGE_LEVEL`]), the oldest of them (lowest blocks) become one part
    /// of the next level; repeated while it applies. Called after every part a
    /// record adds, so every replica decides the same merges at the same LSN.
    fn decide_merges(&mut self, table_id: u64, partition: &str) {
        loop {
            let logical = self.logical_parts(table_id, partition);
            let mut decided = false;
            for level in 0..MAX_MERGE_LEVEL {
                let mut same: Vec<&PartName> =
                    logical.iter().filter(|n| n.level == level).collect();
                if same.len() < MERGE_FANIN {
                    continue;
                }
                same.sort_by_key(|n| n.min_block);
                let sources: Vec<PartName> =
                    same[..MERGE_FANIN].iter().map(|n| (*n).clone()).collect();
                let result = PartName {
                    partition_id: partition.to_string(),
                    min_block: sources[0].min_block,
                    max_block: sources[MERGE_FANIN - 1].max_block,
                    level: level + 1,
                };
                self.state.merges.push(Merge {
                    table_id,
                    result,
                    sources,
                });
                decided = true;
                break;
            }
            if !decided {
                return;
            }
        }
    }

    /// The first decided merge whose sources are all written (merges run in
    /// the order decided), with what a merger needs to do it without holding
    /// the replica.
    pub fn next_merge(&self) -> Option<MergeJob> {
        let m = self.state.merges.first()?;
        let have = self.parts.get(&m.table_id)?;
        let mut sources = Vec::with_capacity(m.sources.len());
        for s in &m.sources {
            let meta = have.get(s)?;
            sources.push((self.part_path(m.table_id, s), meta.clone()));
        }
        Some(MergeJob {
            merge: m.clone(),
            sources,
            disk: Arc::clone(&self.disk),
            cpu: self.cpu,
            path: self.part_path(m.table_id, &m.result),
            dir: format!("{}/parts/{}", self.dir, m.table_id),
        })
    }

    /// Records a merge done by [`MergeJob::run`]: the result becomes active,
    /// the sources replaced and kept until the caller, after readers had
    /// time to finish, hands them to
    /// [`release_replaced`](Self::release_replaced) (which keeps pinned
    /// ones); persisted before it returns.
    pub async fn finish_merge(
        &mut self,
        merge: &Merge,
        meta: PartMeta,
    ) -> Result<Vec<(u64, PartName)>, ReplicaError> {
        if self.state.merges.first() != Some(merge) {
            return Ok(Vec::new());
        }
        self.state.merges.remove(0);
        let parts = self.parts.entry(merge.table_id).or_default();
        let kept = self.kept.entry(merge.table_id).or_default();
        let mut replaced = Vec::new();
        for s in &merge.sources {
            if let Some(m) = parts.remove(s) {
                kept.insert(s.clone(), m);
            }
            replaced.push((merge.table_id, s.clone()));
        }
        let (rows, bytes) = (meta.rows, meta.bytes);
        parts.insert(merge.result.clone(), meta);
        self.persist().await?;
        self.status.send_modify(|s| {
            s.merges_done += 1;
            s.merged_rows += rows;
            s.merged_bytes += bytes;
        });
        Ok(replaced)
    }

    /// Encodes one part and writes it under its temporary name, not synced
    /// ([`sync_parts`](Self::sync_parts) finishes it).
    async fn write_part(
        &self,
        table_id: u64,
        schema: &arrow::datatypes::SchemaRef,
        name: &PartName,
        batch: RecordBatch,
        lsns: (Lsn, Lsn),
    ) -> Result<UnsyncedPart, ReplicaError> {
        let (bytes, meta) = self
            .cpu
            .run({
                let schema = Arc::clone(schema);
                let name = name.clone();
                move || part::encode(&schema, &name, table_id, &[batch], lsns)
            })
            .await?;
        let tdir = format!("{}/parts/{table_id}", self.dir);
        self.disk.create_dir_all(&tdir).await.map_err(io(&tdir))?;
        let path = self.part_path(table_id, name);
        let mut file = DurableFile::create(self.disk.as_ref(), &tdir, &path).await?;
        file.append(bytes).await?;
        Ok(UnsyncedPart {
            table_id,
            file,
            meta,
        })
    }
}

/// A part written under its temporary name, waiting for its sync.
struct UnsyncedPart {
    table_id: u64,
    file: DurableFile,
    meta: PartMeta,
}

/// A part file being written: appended under `<path>.tmp`, then made durable
/// under its name by [`commit`](Self::commit).
struct DurableFile {
    file: Box<dyn ferry_env::DiskFile>,
    dir: String,
    path: String,
    tmp: String,
    len: u64,
}

impl DurableFile {
    async fn create(disk: &dyn Disk, dir: &str, path: &str) -> Result<DurableFile, ReplicaError> {
        let tmp = format!("{path}.tmp");
        match disk.remove_file(&tmp).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&tmp)(e)),
        }
        let file = disk.create_new(&tmp).await.map_err(io(&tmp))?;
        Ok(DurableFile {
            file,
            dir: dir.to_string(),
            path: path.to_string(),
            tmp,
            len: 0,
        })
    }

    async fn append(&mut self, bytes: impl Into<Bytes>) -> Result<(), ReplicaError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Ok(());
        }
        let n = bytes.len() as u64;
        self.file
            .write_at(self.len, bytes)
            .await
            .map_err(io(&self.tmp))?;
        self.len += n;
        Ok(())
    }

    /// fsync, rename to the part's name (durable once the directory is
    /// synced).
    async fn sync_and_rename(self, disk: &dyn Disk) -> Result<(), ReplicaError> {
        self.file.sync_data().await.map_err(io(&self.tmp))?;
        drop(self.file);
        disk.rename(&self.tmp, &self.path)
            .await
            .map_err(io(&self.path))?;
        Ok(())
    }

    /// fsync, rename to the part's name, fsync the directory.
    async fn commit(self, disk: &dyn Disk) -> Result<(), ReplicaError> {
        let dir = self.dir.clone();
        self.sync_and_rename(disk).await?;
        disk.sync_dir(&dir).await.map_err(io(&dir))?;
        Ok(())
    }
}

/// Whether part `a` replaced part `b`: same partition, a higher level, and
/// `b`'s blocks inside `a`'s.
fn replaces(a: &PartName, b: &PartName) -> bool {
    a != b
        && a.partition_id == b.partition_id
        && a.level > b.level
        && a.min_block <= b.min_block
        && b.max_block <= a.max_block
}

/// A merge to run outside the replica's lock.
pub struct MergeJob {
    pub merge: Merge,
    sources: Vec<(String, PartMeta)>,
    disk: Arc<dyn Disk>,
    cpu: Cpu,
    path: String,
    dir: String,
}

impl MergeJob {
    /// Reads the sources in block order a row group at a time and writes
    /// the merged part as it goes, durably (temporary name, fsync, rename,
    /// directory fsync); returns its metadata. Holds at most one source row
    /// group and the result's row group in progress, whatever the parts'
    /// sizes. The rows are the sources' rows in block order, read and written
    /// in the same batches everywhere, so every replica writes the same bytes;
    /// each source's rows are checked against its footer's checksum, so a
    /// damaged source stops the merge instead of passing into the result.
    pub async fn run(self) -> Result<PartMeta, ReplicaError> {
        let disk = self.disk.as_ref();
        let damaged = |path: &str, detail: String| ReplicaError::Damaged {
            path: path.to_string(),
            detail,
        };
        // Every source's footer first (the footers only): each must be the
        // part the replica listed.
        let mut readers = Vec::with_capacity(self.sources.len());
        for (path, meta) in &self.sources {
            let reader = part::PartReader::open(disk, path, &meta.name).await?;
            if reader.meta() != meta {
                return Err(damaged(
                    path,
                    format!(
                        "the part's footer {:?} is not what the replica listed {meta:?}",
                        reader.meta()
                    ),
                ));
            }
            readers.push(reader);
        }
        let Some(first) = readers.first() else {
            return Err(damaged(&self.path, "a merge of no parts".into()));
        };
        let schema = Arc::clone(first.schema());
        let lsns = (
            readers
                .iter()
                .map(|r| r.meta().min_lsn)
                .min()
                .unwrap_or_default(),
            readers
                .iter()
                .map(|r| r.meta().max_lsn)
                .max()
                .unwrap_or_default(),
        );
        let (table_id, result) = (self.merge.table_id, self.merge.result.clone());
        let mut encoder = self
            .cpu
            .run(move || part::PartEncoder::new(&schema, &result, table_id, lsns))
            .await?;
        let mut out = DurableFile::create(disk, &self.dir, &self.path).await?;
        for mut reader in readers {
            // Each source's rows are checked against its footer as they pass.
            let mut check = part::PartCheck::new(&reader)?;
            while let Some(group) = reader.next_row_group().await? {
                let name = reader.meta().name.clone();
                let (e, c, bytes) = self
                    .cpu
                    .run(move || {
                        let mut bytes = Vec::new();
                        for batch in group {
                            let batch = batch.map_err(|e| part::PartError::Invalid {
                                name: name.to_string(),
                                detail: e.to_string(),
                            })?;
                            check.push(&name, &batch)?;
                            bytes.extend(encoder.write(&batch)?);
                        }
                        Ok::<_, part::PartError>((encoder, check, bytes))
                    })
                    .await?;
                (encoder, check) = (e, c);
                out.append(bytes).await?;
            }
            check.finish(reader.meta())?;
        }
        let (tail, meta) = self.cpu.run(move || encoder.finish()).await?;
        let expected: u64 = self.sources.iter().map(|(_, m)| m.rows).sum();
        if meta.rows != expected {
            return Err(damaged(
                &self.path,
                format!(
                    "the sources hold {} rows, their footers say {expected}",
                    meta.rows
                ),
            ));
        }
        out.append(tail).await?;
        out.commit(disk).await?;
        Ok(meta)
    }
}

/// Runs a replica's merges as they are decided, one at a time, without
/// holding the replica while a merge reads and writes; removes the parts a
/// merge replaced after `grace` (readers that listed them may still read
/// them), unless an export pinned them by then. Returns only if a merge
/// fails.
pub async fn run_merges(replica: SharedReplica, grace: std::time::Duration) -> ReplicaError {
    let mut status = replica.lock().await.subscribe();
    let mut doomed: VecDeque<(tokio::time::Instant, Vec<(u64, PartName)>)> = VecDeque::new();
    loop {
        let job = replica.lock().await.next_merge();
        if let Some(job) = job {
            let merge = job.merge.clone();
            let meta = match job.run().await {
                Ok(m) => m,
                Err(e) => return e,
            };
            let replaced = match replica.lock().await.finish_merge(&merge, meta).await {
                Ok(r) => r,
                Err(e) => return e,
            };
            doomed.push_back((tokio::time::Instant::now() + grace, replaced));
            continue;
        }
        let (disk, freed) = {
            let mut r = replica.lock().await;
            (Arc::clone(r.disk()), r.take_replaced())
        };
        if !freed.is_empty() {
            doomed.push_back((tokio::time::Instant::now() + grace, freed));
        }
        while doomed
            .front()
            .is_some_and(|(at, _)| *at <= tokio::time::Instant::now())
        {
            if let Some((_, parts)) = doomed.pop_front() {
                let paths = replica.lock().await.release_replaced(&parts);
                for p in paths {
                    if let Err(e) = disk.remove_file(&p).await {
                        if e.kind() != std::io::ErrorKind::NotFound {
                            tracing::warn!(path = %p, error = %e, "could not remove a replaced part");
                        }
                    }
                }
            }
        }
        let wake = doomed.front().map(|(at, _)| *at);
        tokio::select! {
            biased;
            changed = status.changed() => {
                if changed.is_err() {
                    return ReplicaError::Damaged { path: String::new(), detail: "replica closed".into() };
                }
            }
            _ = async {
                match wake {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending::<()>().await,
                }
            } => {}
        }
    }
}

/// Decodes an insert record's rows, checks them against the table, and groups
/// them by partition (partitions in id order, rows in record order).
fn group_by_partition(
    def: &ferry_table::TableDef,
    arrow_ipc: &[u8],
) -> Result<Vec<(String, RecordBatch)>, String> {
    let batches = ferry_table::rows::from_ipc(arrow_ipc)
        .map_err(|e| format!("rows do not decode as Arrow IPC: {e}"))?;
    let schema = def.arrow_schema();
    for b in &batches {
        if b.schema().fields() != schema.fields() {
            return Err(format!(
                "rows of schema {:?} do not match table {:?}",
                b.schema().fields(),
                def.name
            ));
        }
    }
    let all = match batches.as_slice() {
        [one] => one.clone(),
        _ => arrow::compute::concat_batches(&schema, &batches).map_err(|e| e.to_string())?,
    };
    let pidx = def
        .column_index(&def.partition_by.column)
        .ok_or("no partition column")?;
    if all.column(pidx).null_count() > 0 {
        return Err("a null partition value".into());
    }
    // Rows by partition id, in row order; consecutive rows mostly share a
    // partition, so the last group is tried first.
    let mut groups: Vec<(String, Vec<u32>)> = Vec::new();
    let mut index: std::collections::HashMap<String, usize> = Default::default();
    let mut last = usize::MAX;
    ferry_table::keys::for_each_partition_id(def, all.column(pidx), |row, id| {
        if groups.get(last).is_none_or(|(g, _)| g != id) {
            last = match index.get(id) {
                Some(i) => *i,
                None => {
                    index.insert(id.to_string(), groups.len());
                    groups.push((id.to_string(), Vec::new()));
                    groups.len() - 1
                }
            };
        }
        groups[last].1.push(row as u32);
    })
    .map_err(|(row, e)| format!("row {}: {e}", row + 1))?;
    groups.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::with_capacity(groups.len());
    for (id, idx) in groups {
        let batch = if idx.len() == all.num_rows() {
            all.clone()
        } else {
            arrow::compute::take_record_batch(&all, &arrow::array::UInt32Array::from(idx))
                .map_err(|e| e.to_string())?
        };
        out.push((id, batch));
    }
    Ok(out)
}

/// A replica shared between its stream task and readers.
pub type SharedReplica = Arc<tokio::sync::Mutex<Replica>>;
