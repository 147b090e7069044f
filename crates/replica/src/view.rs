//! What readers see of a replica, without its lock.
//!
//! The applier holds the replica (`SharedReplica`) while it decodes WAL,
//! encodes Parquet parts and fsyncs them; merges hold it while they record
//! their result. A read that took the same lock would wait behind all of
//! that. Instead the replica publishes a [`ReadView`] (its active parts and
//! the position they are consistent at) after every change it made durable,
//! and readers take the latest one from a `watch` channel.
//!
//! Invariant: a view is published before the status that announces its
//! `disk_consistent_lsn`, so a reader that waited for the status to reach
//! an LSN finds a view at least that far (`Replica::persist`). A part a view
//! lists stays readable after a merge replaced it for the replaced-part
//! grace period (`run_merges`), long enough for a reader to open it.

use std::collections::BTreeMap;
use std::sync::Arc;

use ferry_env::Disk;
use ferry_wal::Lsn;
use tokio::sync::watch;

use crate::part::{PartMeta, PartName};
use crate::replica::{ReplicaStatus, RetiredPartition};

/// The active parts of a replica as of `disk_consistent_lsn`.
#[derive(Clone)]
pub struct ReadView {
    pub disk_consistent_lsn: Lsn,
    parts: Arc<BTreeMap<u64, BTreeMap<PartName, PartMeta>>>,
    retired: Arc<Vec<RetiredPartition>>,
    dir: Arc<str>,
    disk: Arc<dyn Disk>,
}

impl ReadView {
    pub(crate) fn new(
        disk_consistent_lsn: Lsn,
        parts: BTreeMap<u64, BTreeMap<PartName, PartMeta>>,
        retired: Vec<RetiredPartition>,
        dir: Arc<str>,
        disk: Arc<dyn Disk>,
    ) -> ReadView {
        ReadView {
            disk_consistent_lsn,
            parts: Arc::new(parts),
            retired: Arc::new(retired),
            dir,
            disk,
        }
    }

    /// Active parts of a table, in part order.
    pub fn parts(&self, table_id: u64) -> Vec<PartMeta> {
        active_parts(&self.parts, table_id)
    }

    /// Path of a part's file under the disk root.
    pub fn part_path(&self, table_id: u64, name: &PartName) -> String {
        part_path(&self.dir, table_id, name)
    }

    /// A table's partitions with rows retired (retention): their rows are
    /// read from the lake, never from here.
    pub fn retired(&self, table_id: u64) -> Vec<RetiredPartition> {
        self.retired
            .iter()
            .filter(|r| r.table_id == table_id)
            .cloned()
            .collect()
    }

    pub(crate) fn dir_shared(&self) -> Arc<str> {
        Arc::clone(&self.dir)
    }

    /// The disk the parts are on.
    pub fn disk(&self) -> &Arc<dyn Disk> {
        &self.disk
    }
}

/// The parts of `table_id` in `parts`, in part order.
pub(crate) fn active_parts(
    parts: &BTreeMap<u64, BTreeMap<PartName, PartMeta>>,
    table_id: u64,
) -> Vec<PartMeta> {
    parts
        .get(&table_id)
        .map(|p| p.values().cloned().collect())
        .unwrap_or_default()
}

pub(crate) fn part_path(dir: &str, table_id: u64, name: &PartName) -> String {
    format!("{dir}/parts/{table_id}/{name}.parquet")
}

/// A replica as readers reach it: its status and its read view, both
/// published by the replica, neither behind its lock.
#[derive(Clone)]
pub struct ReplicaReader {
    pub status: watch::Receiver<ReplicaStatus>,
    pub view: watch::Receiver<ReadView>,
}

impl ReplicaReader {
    /// The latest view.
    pub fn view(&self) -> ReadView {
        self.view.borrow().clone()
    }

    /// The latest status.
    pub fn status(&self) -> ReplicaStatus {
        self.status.borrow().clone()
    }
}
