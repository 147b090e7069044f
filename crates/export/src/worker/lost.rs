//! Parts no replica holds any more.
//!
//! A task's snapshot pins its parts on the replica that listed them, and
//! every replica that mirrors the task pins the ones it holds. A replica
//! whose data dir is lost (rebuilt from a peer, which copies active parts
//! only) loses its pins with it; a part its peers merged away before they
//! mirrored the task is then on no replica. No worker can upload it, and
//! without this check the task would wait for its timeout (an hour by
//! default) while its partition's export policy waits on it.
//!
//! So at each safety poll, a node whose replicas of a part's shard have all
//! applied the task's snapshot (or that holds none of that shard), and that
//! does not hold the part, records so under `lost/<part>@<node>` with how
//! many of the shard's replicas it holds and when). The part is lost once
//! (1) the records count every replica the table has per shard, (2) every
//! node now working on the task (`workers/`) recorded it, and (3) the first
//! record is older than `lost_part_grace` (a node holding the part but away,
//! restarting or between sessions, is not among the workers: it is back
//! and working on the task again by then); then the node claims
//! the part and fails the task with a fatal part failure (a failed task
//! commits nothing: its decision is Fail, so no commit can follow, and its
//! partition is exported again).
//!
//! Invariant: a node that holds the part never records it, and while it
//! works on the task (it joined `workers/` when it mirrored the task,
//! holding the part) the task does not fail for it. A record that went
//! stale can only fail a task that could have finished: that costs an
//! export, never a row.

use std::collections::{BTreeMap, BTreeSet};

use ferry_coord::{CoordError, CreateMode, Op};
use ferry_replica::PartName;
use ferry_wal::Lsn;

use super::queue::Claim;
use super::Run;
use crate::dest::PartFailure;
use crate::model::{TaskKey, TaskStatus};

impl Run<'_> {
    /// Checks every task mirrored as PENDING for parts no replica holds.
    pub(super) async fn check_lost_parts(&mut self) -> Result<(), CoordError> {
        let pending: Vec<TaskKey> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.status == TaskStatus::Pending)
            .map(|(k, _)| k.clone())
            .collect();
        for key in pending {
            self.check_task_lost(&key).await?;
        }
        Ok(())
    }

    async fn check_task_lost(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get(key) else {
            return Ok(());
        };
        let metadata = t.metadata.clone();
        let Some(replicas) = metadata.definition.as_ref().map(|d| d.replicas.max(1)) else {
            return Ok(());
        };
        let base = key.path();
        let left = match self.session.children(&format!("{base}/processing")).await {
            Ok((left, _)) => left,
            Err(CoordError::NoNode { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut absent = Vec::new();
        for part in left {
            let Some(name) = PartName::parse(&part) else {
                continue;
            };
            if self.ex.parts.find(metadata.table_id, &name).await.is_none() {
                absent.push(part);
            }
        }
        if absent.is_empty() {
            return Ok(());
        }
        let shards: BTreeMap<String, Option<u32>> =
            crate::task::read_parts(&self.session, key, &metadata)
                .await?
                .into_iter()
                .map(|p| (p.name, p.shard))
                .collect();
        let fence = crate::model::fence_path(&base, &metadata.transaction_id);
        let lost_dir = format!("{base}/lost");
        let me = self.name().to_string();
        for part in absent {
            let Some(shard) = shards.get(&part).copied() else {
                continue;
            };
            let Some(here) = self
                .ex
                .parts
                .replicas_caught_up(metadata.table_id, shard, Lsn(metadata.snapshot_lsn))
                .await
            else {
                continue;
            };
            let record = format!("{lost_dir}/{part}@{me}");
            if self.session.exists(&record).await?.is_none() {
                let mut ops = vec![Op::check(fence.clone(), 0)];
                if self.session.exists(&lost_dir).await?.is_none() {
                    ops.push(Op::create(
                        lost_dir.clone(),
                        Vec::new(),
                        CreateMode::Persistent,
                    ));
                }
                let said = format!("{here} {}", self.ex.clock.unix_seconds());
                ops.push(Op::create(
                    record,
                    said.into_bytes(),
                    CreateMode::Persistent,
                ));
                match self.session.multi(ops).await {
                    Ok(_) if here > 0 => {
                        tracing::info!(task = %key, part, "a part of the task is on none of this node's replicas of its shard");
                    }
                    Ok(_) => {}
                    // The task went, or another node made `lost` first: the
                    // next poll looks again.
                    Err(CoordError::MultiFailed { .. }) => continue,
                    Err(e) => return Err(e),
                }
            }
            let (records, _) = self.session.children(&lost_dir).await?;
            let prefix = format!("{part}@");
            let reporters: BTreeSet<&str> = records
                .iter()
                .filter_map(|r| r.strip_prefix(&prefix))
                .collect();
            let workers = match self.session.children(&format!("{base}/workers")).await {
                Ok((w, _)) => w,
                Err(CoordError::NoNode { .. }) => Vec::new(),
                Err(e) => return Err(e),
            };
            if !workers.iter().all(|w| reporters.contains(w.as_str())) {
                continue;
            }
            let mut said = 0u32;
            let mut first = u64::MAX;
            for r in records.iter().filter(|r| r.starts_with(&prefix)) {
                match self.session.get(&format!("{lost_dir}/{r}")).await {
                    Ok((data, _)) => {
                        let (n, at) = parse_record(&data);
                        said += n;
                        first = first.min(at);
                    }
                    Err(CoordError::NoNode { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            let now = self.ex.clock.unix_seconds();
            if said < replicas
                || first.saturating_add(self.ex.config.lost_part_grace.as_secs()) > now
            {
                continue;
            }
            if self.claim(key, &part).await? == Claim::Ours {
                let of = shard.map_or(String::new(), |s| format!(" of shard {s}"));
                self.fail_part(
                    key,
                    &part,
                    PartFailure::Fatal(format!(
                        "part {part} is on no replica{of} any more (lost with a replica's \
                         data before its peers pinned it); the partition is exported again"
                    )),
                )
                .await?;
            }
            return Ok(());
        }
        Ok(())
    }
}

/// A `lost/` record: how many replicas of the shard its node holds, and when
/// it said so (unix seconds). A damaged one counts no replica, said now.
fn parse_record(data: &[u8]) -> (u32, u64) {
    let text = std::str::from_utf8(data).unwrap_or("");
    let mut words = text.split_whitespace();
    let n = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
    let at = words
        .next()
        .and_then(|w| w.parse().ok())
        .unwrap_or(u64::MAX);
    (n, at)
}

#[cfg(test)]
mod tests {
    use super::parse_record;

    #[test]
    fn a_record_says_how_many_replicas_and_when_and_a_damaged_one_nothing() {
        assert_eq!(parse_record(b"2 1700000000"), (2, 1_700_000_000));
        assert_eq!(parse_record(b"1"), (1, u64::MAX));
        assert_eq!(parse_record(b"x y"), (0, u64::MAX));
        assert_eq!(parse_record(&[0xff, 0xfe]), (0, u64::MAX));
    }
}
