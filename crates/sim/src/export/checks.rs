//! The export workload's final checks, once faults stopped and every task
//! settled: every task, every commit file and the rows it lists, what a
//! reader of the lake reads, and every lock of the export protocol.

use std::collections::{BTreeMap, BTreeSet};

use arrow::array::AsArray;
use arrow::datatypes::Int64Type;
use ferry_coord::Session;
use ferry_export::model::{CommitFile, LakeFormat, TaskKey, TaskStatus};
use ferry_storage::Location;

use super::{Failure, Sim};

impl Sim {
    /// Every task in coordination, by transaction id, with its status.
    pub(super) async fn tasks(
        &self,
        session: &Session,
    ) -> Result<
        BTreeMap<
            String,
            (
                TaskKey,
                Option<TaskStatus>,
                Option<ferry_export::model::Metadata>,
            ),
        >,
        String,
    > {
        let mut out = BTreeMap::new();
        let keys = match session.children("/ferry/tables/t/exports").await {
            Ok((k, _)) => k,
            Err(ferry_coord::CoordError::NoNode { .. }) => Vec::new(),
            Err(e) => return Err(e.to_string()),
        };
        for k in keys {
            let key = TaskKey {
                table: "t".into(),
                key: k,
            };
            if let Some(head) = ferry_export::task::read_head(session, &key)
                .await
                .map_err(|e| e.to_string())?
            {
                out.insert(
                    head.transaction_id.clone(),
                    (key, head.status, head.metadata),
                );
            }
        }
        Ok(out)
    }

    /// Commit files checked, tasks killed, Iceberg snapshots checked.
    pub(super) async fn check(
        &mut self,
        checker: &Session,
    ) -> Result<(usize, usize, usize), Failure> {
        let tasks = self.tasks(checker).await.map_err(|e| self.fail(e))?;
        let store = Location::from_store("sim://lake", self.world.lake_store.truth(), "")
            .map_err(|e| self.fail(format!("the lake: {e}")))?;
        let objects: Vec<(String, u64)> = store
            .list("")
            .await
            .map_err(|e| self.fail(format!("listing the lake: {e}")))?;
        let sizes: BTreeMap<String, u64> = objects.iter().cloned().collect();
        // One checksum per part name.
        let mut by_part: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (k, _) in &objects {
            if let Some(file) = k
                .rsplit('/')
                .next()
                .and_then(|f| f.strip_suffix(".parquet"))
            {
                if let Some((part, sum)) = file.rsplit_once('_') {
                    by_part
                        .entry(part.to_string())
                        .or_default()
                        .insert(sum.to_string());
                }
            }
        }
        if let Some((part, sums)) = by_part.iter().find(|(_, s)| s.len() > 1) {
            return Err(self.fail(format!("part {part} written under several names: {sums:?}")));
        }
        let mut completed = 0;
        let mut killed = 0;
        // (destination folder, partition) -> every commit file with its rows.
        type Commits = Vec<(String, BTreeSet<i64>)>;
        let mut by_partition: BTreeMap<(String, String), Commits> = BTreeMap::new();
        // Every commit file.
        let is_commit = |k: &str| {
            k.rsplit('/')
                .next()
                .is_some_and(|f| f.starts_with("commit_"))
        };
        for (k, _) in objects.iter().filter(|(k, _)| is_commit(k)) {
            let prefix = k.split('/').next().unwrap_or_default().to_string();
            let data = store
                .get(k)
                .await
                .map_err(|e| self.fail(format!("{k}: {e}")))?;
            let commit: CommitFile = serde_json::from_slice(&data)
                .map_err(|e| self.fail(format!("{k} is not a commit file: {e}")))?;
            let tx = commit.transaction_id.clone();
            let Some(asked) =
                self.asked.get(&tx).cloned().or_else(|| {
                    self.policy_commit(&prefix, &commit.partition_id, commit.snapshot_lsn)
                })
            else {
                return Err(self.fail(format!("{k}: a commit file of an export never asked for")));
            };
            if asked.killed {
                return Err(self.fail(format!(
                    "{k}: a commit file of an export killed (KILLED answered)"
                )));
            }
            if let Some((_, status, metadata)) = tasks.get(&tx) {
                if *status != Some(TaskStatus::Completed) {
                    return Err(
                        self.fail(format!("{k}: a commit file of a task that is {status:?}"))
                    );
                }
                if let Some(m) = metadata {
                    let key = TaskKey::new("t", &m.partition_id, &m.destination);
                    let parts = ferry_export::task::read_parts(checker, &key, m)
                        .await
                        .map_err(|e| self.fail(format!("{key}: parts: {e}")))?;
                    let listed: BTreeSet<String> = commit
                        .files
                        .iter()
                        .filter_map(|f| {
                            let file = f.path.rsplit('/').next()?.strip_suffix(".parquet")?;
                            Some(file.rsplit_once('_')?.0.to_string())
                        })
                        .collect();
                    let snapshot: BTreeSet<String> = parts.iter().map(|p| p.name.clone()).collect();
                    if listed != snapshot || commit.files.len() != parts.len() {
                        return Err(self.fail(format!(
                            "{k} lists {} files ({} parts) for a snapshot of {} parts",
                            commit.files.len(),
                            listed.len(),
                            parts.len()
                        )));
                    }
                }
            }
            let mut ids = Vec::new();
            for f in &commit.files {
                let path = format!("{prefix}/{}", f.path);
                match sizes.get(&path) {
                    Some(s) if *s == f.bytes => {}
                    other => {
                        return Err(self.fail(format!(
                            "{k} lists {} of {} bytes; the lake has {other:?}",
                            f.path, f.bytes
                        )))
                    }
                }
                let bytes = store
                    .get(&path)
                    .await
                    .map_err(|e| self.fail(format!("{}: {e}", f.path)))?;
                let name = f
                    .path
                    .rsplit('/')
                    .next()
                    .and_then(|f| f.strip_suffix(".parquet"))
                    .and_then(|f| f.rsplit_once('_'))
                    .and_then(|(p, _)| ferry_replica::PartName::parse(p))
                    .ok_or_else(|| self.fail(format!("{}: not a data file name", f.path)))?;
                let batches = ferry_replica::part::read_rows(&name, bytes)
                    .map_err(|e| self.fail(format!("{}: {e}", f.path)))?;
                for b in &batches {
                    let col = b.column(0).as_primitive::<Int64Type>();
                    ids.extend((0..col.len()).map(|j| col.value(j)));
                }
            }
            let unique: BTreeSet<i64> = ids.iter().copied().collect();
            if unique.len() != ids.len() {
                return Err(self.fail(format!(
                    "{k}: {} rows more than once",
                    ids.len() - unique.len()
                )));
            }
            let expected = if asked.at_least {
                // At least the rows as of the position, and none that is not
                // the partition's.
                let all: BTreeSet<i64> = self
                    .rows
                    .iter()
                    .filter(|(_, id)| super::partition_of(*id) == commit.partition_id)
                    .map(|(_, id)| *id)
                    .collect();
                if asked.ids.is_subset(&unique) && unique.is_subset(&all) {
                    unique.clone()
                } else {
                    asked.ids.clone()
                }
            } else {
                asked.ids.clone()
            };
            if unique != expected {
                let missing: Vec<&i64> = asked.ids.difference(&unique).take(5).collect();
                let extra: Vec<&i64> = unique.difference(&asked.ids).take(5).collect();
                return Err(self.fail(format!(
                    "{k} holds {} rows, the partition had {} at the request (missing e.g. {missing:?}, extra e.g. {extra:?})",
                    unique.len(),
                    asked.ids.len()
                )));
            }
            by_partition
                .entry((prefix, commit.partition_id.clone()))
                .or_default()
                .push((k.clone(), unique));
            completed += 1;
        }
        // What a reader reads: of every partition, the current commit (and
        // nothing else), which holds every row any commit of it holds.
        for ((prefix, partition), commits) in &by_partition {
            let dest = Location::from_store("sim://lake", self.world.lake_store.truth(), prefix)
                .map_err(|e| self.fail(format!("the lake: {e}")))?;
            let view = ferry_export::lake::read(&dest, Some(partition))
                .await
                .map_err(|e| self.fail(format!("reading {prefix}: {e}")))?;
            let Some(current) = view.partitions.first() else {
                return Err(self.fail(format!("{prefix}: no current commit of {partition}")));
            };
            let key = format!("{prefix}/{}", current.current.key);
            let Some((_, rows)) = commits.iter().find(|(k, _)| *k == key) else {
                return Err(self.fail(format!("{key}: current but not found")));
            };
            for (other, ids) in commits {
                if let Some(id) = ids.difference(rows).next() {
                    return Err(self.fail(format!(
                        "a reader of {prefix} partition {partition} reads {key}, which lacks row {id} of {other}"
                    )));
                }
            }
        }
        let snapshots = self.check_iceberg(&tasks).await?.snapshots;
        // Every task: terminal, and COMPLETED unless the schedule killed it
        // (with a commit file in a Parquet destination; an Iceberg one's
        // are checked above).
        for (tx, (key, status, metadata)) in &tasks {
            let iceberg = metadata
                .as_ref()
                .is_some_and(|m| m.settings.format() == LakeFormat::Iceberg);
            let asked = self.asked.get(tx);
            let committed = objects
                .iter()
                .any(|(k, _)| is_commit(k) && k.ends_with(tx.as_str()));
            match status {
                Some(TaskStatus::Completed) if !committed && !iceberg => {
                    return Err(self.fail(format!("{key} {tx} is COMPLETED without a commit file")))
                }
                Some(TaskStatus::Completed) => {}
                Some(TaskStatus::Killed) => {
                    killed += 1;
                    let by_policy = metadata.as_ref().is_some_and(|m| {
                        m.by_policy && self.policy_task_killable(&m.partition_id, &m.destination)
                    });
                    if !asked.is_some_and(|a| a.maybe_killed) && !by_policy {
                        return Err(
                            self.fail(format!("{key} {tx} is KILLED though nobody killed it"))
                        );
                    }
                }
                other => {
                    return Err(self.fail(format!("{key} {tx} ended {other:?}")));
                }
            }
        }
        self.check_ephemerals(checker).await?;
        Ok((completed, killed, snapshots))
    }

    /// See [`check_export_locks`].
    pub(super) async fn check_ephemerals(&self, checker: &Session) -> Result<(), Failure> {
        check_export_locks(&self.world, checker, "t").await
    }
}

/// No lock outlives its owner's session: every ephemeral node of the
/// export protocol of table `table` (the cleanup lock, commit locks, part
/// locks, worker registrations) belongs to a session the store holds
/// alive.
pub(crate) async fn check_export_locks(
    world: &crate::world::World,
    checker: &Session,
    table: &str,
) -> Result<(), Failure> {
    let live: BTreeSet<i64> = world
        .coord
        .live_sessions()
        .await
        .map_err(|e| world.fail(format!("live sessions: {e}")))?
        .into_iter()
        .collect();
    let table = format!("/ferry/tables/{table}");
    let mut paths = vec![format!("{table}/exports_cleanup_lock")];
    let keys = match checker.children(&format!("{table}/exports")).await {
        Ok((k, _)) => k,
        Err(ferry_coord::CoordError::NoNode { .. }) => Vec::new(),
        Err(e) => return Err(world.fail(format!("exports: {e}"))),
    };
    for k in keys {
        let base = format!("{table}/exports/{k}");
        paths.push(format!("{base}/commit_lock"));
        for dir in ["locks", "workers"] {
            match checker.children(&format!("{base}/{dir}")).await {
                Ok((names, _)) => paths.extend(names.iter().map(|n| format!("{base}/{dir}/{n}"))),
                Err(ferry_coord::CoordError::NoNode { .. }) => {}
                Err(e) => return Err(world.fail(format!("{base}/{dir}: {e}"))),
            }
        }
    }
    for path in paths {
        let stat = checker
            .exists(&path)
            .await
            .map_err(|e| world.fail(format!("{path}: {e}")))?;
        if let Some(stat) = stat {
            if stat.ephemeral_owner == 0 {
                return Err(world.fail(format!("{path} is not ephemeral")));
            }
            if !live.contains(&stat.ephemeral_owner) {
                return Err(world.fail(format!(
                    "{path} outlived its session {:#x}",
                    stat.ephemeral_owner
                )));
            }
        }
    }
    Ok(())
}
