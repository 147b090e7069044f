//! Retention: rows of a partition that are in the lake, dropped from the
//! replica when a `Retire` WAL record says so.
//!
//! The record names the lake files of the partition's current commit (as
//! the export policy read them). A replica applies it at its position like
//! a merge decision: against the partition's logical parts (active parts
//! with every decided merge counted as done), so every replica of a shard
//! drops the same parts, whichever merges each already ran. A part is
//! dropped only when its blocks lie inside one file of its shard: a row
//! that no lake file holds is never dropped (the retention gate, enforced
//! where the rows leave). A partition's retired rows live in one
//! destination: a retirement naming another drops nothing. What was
//! dropped stays in the state as the
//! partition's retired files: snapshots list them (so an export carries
//! them and never takes them out of the lake), reads of the partition are
//! sent to the lake, and a copy of the replica carries them.
//!
//! Durability: dropped parts leave the active set at once, but their files
//! are handed to the merge task for removal only after a state recording
//! the retirement was written (`Replica::persist`); a replica restarted
//! from an older state finds its parts and applies the record again.

use ferry_wal::record::{RetiredFile, Retirement};
use ferry_wal::Lsn;
use serde::{Deserialize, Serialize};

use super::{decide, Replica, ReplicaError, TableRef, ALL_SHARDS};
use crate::part::{PartMeta, PartName};

/// A partition's rows retired from this replica: where they are in the lake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredPartition {
    pub table_id: u64,
    pub partition_id: String,
    /// The destination (URL and format) and the commit the last retirement
    /// checked.
    pub destination: String,
    pub format: String,
    pub commit: String,
    /// Position of the last retirement applied.
    pub lsn: Lsn,
    /// The lake files holding the rows retired here (this replica's shard),
    /// disjoint, in block order.
    pub files: Vec<RetiredFile>,
}

impl RetiredPartition {
    /// Rows retired from this replica.
    pub fn rows(&self) -> u64 {
        self.files.iter().map(|f| f.rows).sum()
    }

    /// Whether the retired files hold every block of `name`.
    pub fn holds(&self, name: &PartName) -> bool {
        name.partition_id == self.partition_id
            && self
                .files
                .iter()
                .filter_map(|f| PartName::parse(&f.part))
                .any(|f| inside(name, &f))
    }

    /// The retired files as snapshot entries (`retired` set): what an
    /// export must find in the lake's current commit and carry.
    pub fn as_parts(&self, shard: Option<u32>) -> Vec<PartMeta> {
        self.files
            .iter()
            .filter_map(|f| {
                let name = PartName::parse(&f.part)?;
                Some(PartMeta {
                    table_id: self.table_id,
                    rows: f.rows,
                    min_lsn: Lsn(name.min_block),
                    max_lsn: Lsn(name.max_block),
                    checksum: f.checksum,
                    bytes: f.bytes,
                    shard,
                    retired: true,
                    name,
                })
            })
            .collect()
    }
}

/// Whether `a`'s blocks lie inside `b`'s (same partition).
pub(super) fn inside(a: &PartName, b: &PartName) -> bool {
    a.partition_id == b.partition_id && b.min_block <= a.min_block && a.max_block <= b.max_block
}

impl Replica {
    /// The partitions of a table with rows retired from this replica.
    pub fn retired(&self, table_id: u64) -> Vec<RetiredPartition> {
        self.state
            .retired
            .iter()
            .filter(|r| r.table_id == table_id)
            .cloned()
            .collect()
    }

    /// Applies a retirement at `lsn` (see the module docs).
    pub(super) async fn apply_retirement(
        &mut self,
        lsn: Lsn,
        r: Retirement,
    ) -> Result<(), ReplicaError> {
        let bad = |detail: String| ReplicaError::BadRecord { lsn, detail };
        match self.table(r.table_id, lsn).await? {
            TableRef::Known(_) => {}
            TableRef::Dropped => return Ok(()),
            TableRef::Unknown => {
                return Err(bad(format!(
                    "table id {} was never created in this cluster's catalog",
                    r.table_id
                )))
            }
        }
        let mine = (self.state.shard != ALL_SHARDS).then_some(self.state.shard);
        let mut files = Vec::new();
        for f in &r.files {
            // A file naming no part holds no part of ours: it drops nothing
            // (every replica decides the same).
            let Some(name) = PartName::parse(&f.part) else {
                tracing::warn!(%lsn, path = %f.path, part = %f.part, "a retired file that names no part is ignored");
                continue;
            };
            if f.shard == mine && name.partition_id == r.partition_id {
                files.push((name, f.clone()));
            }
        }
        // Parts of records applied before it become active first: the
        // decision counts them like any other.
        self.sync_parts().await?;
        let logical = self.logical_parts(r.table_id, &r.partition_id);
        let at = self
            .state
            .retired
            .iter()
            .position(|p| p.table_id == r.table_id && p.partition_id == r.partition_id);
        // A partition's retired rows live in one destination: the files of
        // another do not hold them (an export there cannot carry them), so
        // a retirement from another destination drops nothing.
        if let Some(i) = at {
            if self.state.retired[i].destination != r.destination {
                tracing::warn!(%lsn, partition = %r.partition_id, retired_to = %self.state.retired[i].destination, destination = %r.destination, "a retirement from another destination than the partition's is ignored");
                return Ok(());
            }
        }
        let prior: Vec<RetiredFile> = at
            .map(|i| self.state.retired[i].files.clone())
            .unwrap_or_default();
        let prior_names: Vec<PartName> = prior
            .iter()
            .filter_map(|f| PartName::parse(&f.part))
            .collect();
        let names: Vec<PartName> = files.iter().map(|(n, _)| n.clone()).collect();
        let decision = decide::retire(&logical, &prior_names, &names);
        if decision.dropped.is_empty() && decision.adopted.is_empty() {
            return Ok(());
        }
        let table_id = r.table_id;
        // Decided merges inside a dropped part are void; the parts inside
        // it (a pending merge's sources, or the part itself) leave.
        self.state.merges.retain(|m| {
            m.table_id != table_id || !decision.dropped.iter().any(|d| inside(&m.result, d))
        });
        let mut dropped_rows = 0;
        if let Some(active) = self.parts.get_mut(&table_id) {
            let gone: Vec<PartName> = active
                .keys()
                .filter(|n| decision.dropped.iter().any(|d| inside(n, d)))
                .cloned()
                .collect();
            for name in gone {
                if let Some(meta) = active.remove(&name) {
                    dropped_rows += meta.rows;
                    self.kept
                        .entry(table_id)
                        .or_default()
                        .insert(name.clone(), meta);
                    self.retiring.push((table_id, name));
                }
            }
        }
        let mut kept_files: Vec<RetiredFile> = prior
            .into_iter()
            .zip(prior_names)
            .filter(|(_, n)| !decision.absorbed.contains(n))
            .map(|(f, _)| f)
            .collect();
        kept_files.extend(decision.adopted.iter().map(|i| files[*i].1.clone()));
        kept_files.sort_by_key(|f| PartName::parse(&f.part).map(|n| n.min_block));
        let entry = RetiredPartition {
            table_id,
            partition_id: r.partition_id.clone(),
            destination: r.destination,
            format: r.format,
            commit: r.commit,
            lsn,
            files: kept_files,
        };
        match at {
            Some(i) => self.state.retired[i] = entry,
            None => self.state.retired.push(entry),
        }
        let n = decision.dropped.len() as u64;
        self.status.send_modify(|s| {
            s.retirements_applied += 1;
            s.rows_retired += dropped_rows;
            s.parts_retired += n;
        });
        Ok(())
    }

    /// Hands parts retired before the state written now to the merge task
    /// (removed after its grace period unless pinned or held).
    pub(super) fn release_retiring(&mut self) {
        if self.retiring.is_empty() {
            return;
        }
        for (t, n) in std::mem::take(&mut self.retiring) {
            if !self.unpinned.contains(&(t, n.clone())) {
                self.unpinned.push((t, n));
            }
        }
        self.status.send_modify(|_| {});
    }
}
