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
//!   committed WAL, so every replica of a shard holds the same parts. A
//!   record that carries its parts (`Record::InsertParts`, encoded once by
//!   the ingest node) is written as it came, after its footers are checked.
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
//!
//! This module holds the [`Replica`] itself (opening it, its status and
//! accessors); the decisions (a record's fate, the idempotency window, when
//! to persist, the merge policy) are in `decide`, apart from any I/O;
//! applying received WAL and persisting it is in `apply`, recording merges
//! and the merge task in `merges`, export pins and the parts
//! merges replaced in `pins`, the state file in `state`, and building a
//! replica from a peer's copy in `holds` (the donor) and `bootstrap` (the
//! new replica).

mod apply;
pub mod bootstrap;
mod decide;
mod holds;
mod merges;
mod pins;
mod retire;
mod state;

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use ferry_env::{Cpu, Disk};
use ferry_table::Table;
use ferry_wal::Lsn;
use serde::Serialize;
use tokio::sync::watch;

use crate::part::{self, PartMeta, PartName};
use crate::view::{ReadView, ReplicaReader};

pub use decide::{DEDUP_WINDOW, PERSIST_EVERY_BYTES};
pub use holds::{HoldError, BOOTSTRAP_HOLD_IDLE, MAX_BOOTSTRAP_HOLDS};
pub use merges::{
    run_merges, run_merges_with_space, Merge, MergeJob, MAX_MERGE_LEVEL, MERGE_FANIN,
};
pub use retire::RetiredPartition;

/// The merges a compaction record with `target_rows` would decide for a
/// partition holding `parts` (name and rows): what a node asking for one
/// looks at first, so that it asks only when the replicas would merge.
pub fn plan_compaction(
    table_id: u64,
    partition: &str,
    parts: Vec<(PartName, u64)>,
    target_rows: u64,
) -> Vec<Merge> {
    decide::compaction(table_id, partition, parts, target_rows.max(1))
}

use apply::UnsyncedPart;
use merges::replaces;
use state::State;

/// The shard number of a replica that applies every shard's records (`ferry
/// dev`, whose replicas hold whole tables).
pub const ALL_SHARDS: u32 = u32::MAX;

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
    /// A copy from a peer began under `dir` and did not finish: opened as a
    /// new replica it would apply the WAL from its start over the copy's
    /// merged parts. Another copy finishes it (or removing the dir starts
    /// the replica empty).
    #[error("replica {dir} holds a copy from a peer that did not finish (no state file): it is not opened as a new replica; finish the copy from a peer, or remove {dir} to start it empty")]
    CopyUnfinished { dir: String },
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
    /// Retirements (retention) applied since the replica opened, and the
    /// parts and rows they dropped.
    pub retirements_applied: u64,
    pub parts_retired: u64,
    pub rows_retired: u64,
    /// Merges compaction records decided since the replica opened.
    pub compactions_decided: u64,
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
    /// Parts a retirement dropped, handed to the merge task for removal
    /// once a state recording the retirement is written.
    retiring: Vec<(u64, PartName)>,
    /// Copies of this replica in flight to new replicas, by hold id (see
    /// `holds`): their parts stay on disk like pinned ones.
    holds: BTreeMap<String, holds::Hold>,
    table_cache: BTreeMap<u64, TableRef>,
    /// Parts of applied records written under their temporary names and not
    /// yet synced: made durable, renamed and listed by the next
    /// [`persist`](Self::persist), which must precede any state written.
    unsynced: Vec<UnsyncedPart>,
    /// Directories of parts renamed and not yet synced (see `sync_parts`).
    unsynced_dirs: std::collections::BTreeSet<String>,
    /// WAL bytes applied since the state was last written.
    unpersisted_bytes: u64,
    /// `disk_consistent_lsn` as the state file holds it; the state in memory
    /// is ahead of it by the records applied since.
    persisted_lsn: Lsn,
    status: watch::Sender<ReplicaStatus>,
    /// What readers see (see [`crate::view`]).
    view: watch::Sender<ReadView>,
    /// Received WAL not yet applied (an incomplete record at its end).
    pending: Vec<u8>,
    pending_start: Lsn,
    /// The partition whose merge ran last (`merges::next_merge` serves the
    /// partitions in turn).
    merge_turn: Option<(u64, String)>,
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
        if bootstrap::copy_unfinished(disk.as_ref(), dir).await? {
            return Err(ReplicaError::CopyUnfinished {
                dir: dir.to_string(),
            });
        }
        // A copy that wrote the state file and crashed before removing its
        // marker finished.
        bootstrap::remove_copy_marker(disk.as_ref(), dir).await?;
        disk.create_dir_all(&format!("{dir}/parts"))
            .await
            .map_err(io(dir))?;
        let state = State::load(disk.as_ref(), dir, shard, replica).await?;
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
                    match disk.remove_file(&path).await {
                        Ok(()) => {}
                        // Gone between the listing and now: what removing
                        // it was for.
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io(&path)(e)),
                    }
                    continue;
                }
                let Some(name) = file.strip_suffix(".parquet").and_then(PartName::parse) else {
                    continue;
                };
                let meta = part::PartReader::open(disk.as_ref(), &path, &name)
                    .await?
                    .meta()
                    .clone();
                if meta.max_lsn >= state.disk_consistent_lsn {
                    // Holds a record past the recorded position: written
                    // again, identically, when the record is applied again
                    // (a merge's result when the merge, decided by the WAL,
                    // is decided and done again), and until then no merge
                    // decision may count it nor a reader see it beside the
                    // parts the records write again. Its sources are all
                    // still there: a merge's sources go only after the state
                    // recording its result is written, at a position past
                    // every record the result holds.
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
            // Parts a recorded retirement dropped whose files were not yet
            // removed.
            let retired: Vec<PartName> = parts
                .get(&table_id)
                .map(|p| {
                    p.keys()
                        .filter(|n| {
                            state
                                .retired
                                .iter()
                                .any(|r| r.table_id == table_id && r.holds(n))
                        })
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            for name in retired {
                if let Some(meta) = parts.get_mut(&table_id).and_then(|p| p.remove(&name)) {
                    unpinned.push((table_id, name.clone()));
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
            retirements_applied: 0,
            parts_retired: 0,
            rows_retired: 0,
            compactions_decided: 0,
            error: None,
        };
        let (status, _) = watch::channel(status);
        let pending_start = state.disk_consistent_lsn;
        let view = watch::Sender::new(ReadView::new(
            pending_start,
            parts.clone(),
            state.retired.clone(),
            Arc::from(dir),
            Arc::clone(&disk),
        ));
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
            retiring: Vec::new(),
            holds: BTreeMap::new(),
            table_cache: BTreeMap::new(),
            unsynced: Vec::new(),
            unsynced_dirs: Default::default(),
            unpersisted_bytes: 0,
            persisted_lsn: pending_start,
            merge_turn: None,
            status,
            view,
            pending: Vec::new(),
        })
    }

    /// The position the state file holds: every record below it is applied
    /// and its parts are durable, across any crash.
    pub fn disk_consistent_lsn(&self) -> Lsn {
        self.persisted_lsn
    }

    pub fn subscribe(&self) -> watch::Receiver<ReplicaStatus> {
        self.status.subscribe()
    }

    /// The replica as readers reach it, without this lock.
    pub fn reader(&self) -> ReplicaReader {
        ReplicaReader {
            status: self.status.subscribe(),
            view: self.view.subscribe(),
        }
    }

    /// Active parts of a table.
    pub fn parts(&self, table_id: u64) -> Vec<PartMeta> {
        crate::view::active_parts(&self.parts, table_id)
    }

    /// Path of a part's file under the disk root.
    pub fn part_path(&self, table_id: u64, name: &PartName) -> String {
        crate::view::part_path(&self.dir, table_id, name)
    }

    /// The shard this replica applies ([`ALL_SHARDS`] for every one).
    pub fn shard(&self) -> u32 {
        self.state.shard
    }

    pub fn disk(&self) -> &Arc<dyn Disk> {
        &self.disk
    }
}

/// A replica shared between its stream task and readers.
pub type SharedReplica = Arc<tokio::sync::Mutex<Replica>>;
