//! Merges: the policy that decides them from the applied WAL alone, handing
//! the next one to a merger ([`MergeJob`]) and recording its result, and the
//! task that runs them and removes the parts they replaced after the grace
//! period ([`run_merges`]).

use std::collections::VecDeque;
use std::sync::Arc;

use ferry_env::{Cpu, Disk};
use serde::{Deserialize, Serialize};

use super::apply::DurableFile;
use super::decide;
use super::{Replica, ReplicaError, SharedReplica};
use crate::part::{self, PartMeta, PartName};

/// Parts of one level in a partition that are merged into one part of the next.
pub const MERGE_FANIN: usize = 8;
/// Parts of this level are not merged further.
pub const MAX_MERGE_LEVEL: u32 = 4;

/// A merge: `sources` (consecutive parts of one partition, same level, in block
/// order) become `result`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Merge {
    pub table_id: u64,
    pub result: PartName,
    pub sources: Vec<PartName>,
}

impl Replica {
    /// The parts of a partition as the WAL applied so far defines them: the
    /// active parts with every decided merge counted as done.
    pub(super) fn logical_parts(
        &self,
        table_id: u64,
        partition: &str,
    ) -> std::collections::BTreeSet<PartName> {
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
        names
    }

    /// Applies a compaction record at `lsn` ([`decide::compaction`]):
    /// merges decided like the policy's, in the same order on every
    /// replica. Unknown or dropped tables change nothing but stop nothing
    /// either (a compaction is advice, not data).
    pub(super) async fn apply_compaction(
        &mut self,
        lsn: ferry_wal::Lsn,
        table_id: u64,
        partition: &str,
        target_rows: u64,
    ) -> Result<(), ReplicaError> {
        if !matches!(self.table(table_id, lsn).await?, super::TableRef::Known(_)) {
            return Ok(());
        }
        // Parts of records applied before it count like any other.
        self.sync_parts().await?;
        let mut rows: std::collections::BTreeMap<PartName, u64> = self
            .parts
            .get(&table_id)
            .into_iter()
            .flat_map(|p| p.iter())
            .filter(|(n, _)| n.partition_id == partition)
            .map(|(n, m)| (n.clone(), m.rows))
            .collect();
        for m in self
            .state
            .merges
            .iter()
            .filter(|m| m.table_id == table_id && m.result.partition_id == partition)
        {
            let total = m
                .sources
                .iter()
                .map(|s| rows.get(s).copied().unwrap_or(0))
                .sum();
            rows.insert(m.result.clone(), total);
        }
        let logical: Vec<(PartName, u64)> = self
            .logical_parts(table_id, partition)
            .into_iter()
            .map(|n| {
                let r = rows.get(&n).copied().unwrap_or(0);
                (n, r)
            })
            .collect();
        let decided = decide::compaction(table_id, partition, logical, target_rows.max(1));
        if !decided.is_empty() {
            let n = decided.len() as u64;
            self.state.merges.extend(decided);
            self.assert_laminar(table_id, partition);
            self.status.send_modify(|s| s.compactions_decided += n);
        }
        Ok(())
    }

    /// Decides the merges the part just added to `partition` makes due
    /// ([`decide::merges`], the policy), in the order decided. Called after
    /// every part a record adds, so every replica decides the same merges at
    /// the same LSN.
    pub(super) fn decide_merges(&mut self, table_id: u64, partition: &str) {
        let logical = self.logical_parts(table_id, partition);
        let decided = decide::merges(table_id, partition, logical);
        if !decided.is_empty() {
            self.state.merges.extend(decided);
            self.assert_laminar(table_id, partition);
        }
    }

    /// A partition's logical parts are disjoint (what exported block ranges
    /// and retention rely on): every merge takes consecutive whole parts.
    fn assert_laminar(&self, table_id: u64, partition: &str) {
        let mut names: Vec<PartName> = self
            .logical_parts(table_id, partition)
            .into_iter()
            .collect();
        names.sort_by_key(|n| n.min_block);
        for w in names.windows(2) {
            assert!(
                w[0].max_block < w[1].min_block,
                "logical parts {} and {} overlap",
                w[0],
                w[1]
            );
        }
    }

    /// The next merge to run, with what a merger needs to do it without
    /// holding the replica.
    ///
    /// A partition's merges run in the order decided (a later one may take
    /// an earlier one's result); partitions take turns, in key order after
    /// the one served last, so a table with a long backlog of merges never
    /// holds back another's (a compaction the export policy asked for waits
    /// for at most one merge of each other partition). Each partition's
    /// first decided merge runs once its sources are all written. Which
    /// replica runs which merge when differs; what each merge makes does
    /// not (decided by the WAL).
    pub fn next_merge(&self) -> Option<MergeJob> {
        // Each partition's first decided merge, by partition.
        let mut heads: std::collections::BTreeMap<(u64, &str), &Merge> =
            std::collections::BTreeMap::new();
        for m in &self.state.merges {
            heads
                .entry((m.table_id, m.result.partition_id.as_str()))
                .or_insert(m);
        }
        let after = self.merge_turn.as_ref().map(|(t, p)| (*t, p.as_str()));
        let (later, earlier): (Vec<_>, Vec<_>) = heads
            .into_iter()
            .partition(|(k, _)| after.is_some_and(|a| *k > a));
        later
            .into_iter()
            .chain(earlier)
            .find_map(|(_, m)| self.merge_job(m))
    }

    /// The job of merge `m` if its sources are all written.
    fn merge_job(&self, m: &Merge) -> Option<MergeJob> {
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
        // A merge voided meanwhile (a retirement dropped its sources, a
        // copy replaced the state) changes nothing.
        let Some(at) = self.state.merges.iter().position(|m| m == merge) else {
            return Ok(Vec::new());
        };
        self.state.merges.remove(at);
        self.merge_turn = Some((merge.table_id, merge.result.partition_id.clone()));
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
}

/// Whether part `a` replaced part `b`: same partition, a higher level, and
/// `b`'s blocks inside `a`'s.
pub(super) fn replaces(a: &PartName, b: &PartName) -> bool {
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
    run_merges_with_space(replica, grace, None).await
}

/// [`run_merges`], starting no merge while `space` is open (the disk nearly
/// full: a merge writes its result before the parts it replaces go); the
/// replaced parts' removal goes on, since it frees space.
pub async fn run_merges_with_space(
    replica: SharedReplica,
    grace: std::time::Duration,
    space: Option<ferry_env::space::SpaceBreaker>,
) -> ReplicaError {
    let mut status = replica.lock().await.subscribe();
    let mut doomed: VecDeque<(tokio::time::Instant, Vec<(u64, PartName)>)> = VecDeque::new();
    loop {
        let full = space.as_ref().is_some_and(|s| s.check().is_err());
        let job = if full {
            None
        } else {
            replica.lock().await.next_merge()
        };
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
            // Space is back: the merges decided meanwhile run.
            () = async {
                match &space {
                    Some(s) if full => s.wait_closed().await,
                    _ => std::future::pending::<()>().await,
                }
            } => {}
        }
    }
}
