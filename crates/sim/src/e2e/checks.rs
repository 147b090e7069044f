//! The end-to-end checks: at every step, the replicas' reported positions;
//! once everything settled, the lake as a reader reads it and every
//! replica's rows, against what the client was answered.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow::array::{AsArray, Int64Array};
use arrow::datatypes::Int64Type;
use bytes::Bytes;
use ferry_export::model::LakeFormat;
use ferry_storage::Location;

use super::{
    replica_name, replicas, Failure, Sim, DESTINATION, PARTITIONS, REPLICAS_PER_SHARD, SHARDS,
};

/// The ids in a data file (a replica part or a lake file: both are the
/// product's Parquet with the id first).
fn ids_in(path: &str, bytes: Bytes) -> Result<Vec<i64>, String> {
    let name =
        ferry_export::lake::part_of(path).ok_or_else(|| format!("{path}: not a data file name"))?;
    ids_of(&name, bytes).map_err(|e| format!("{path}: {e}"))
}

fn ids_of(name: &ferry_replica::PartName, bytes: Bytes) -> Result<Vec<i64>, String> {
    let batches = ferry_replica::part::read_rows(name, bytes).map_err(|e| e.to_string())?;
    let mut ids = Vec::new();
    for b in &batches {
        let col = b.column(0).as_primitive::<Int64Type>();
        ids.extend((0..col.len()).map(|j| col.value(j)));
    }
    Ok(ids)
}

impl Sim {
    pub(super) fn check_steps(&self) -> Result<(), Failure> {
        let v = self
            .violations
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default();
        match v.first() {
            Some(first) => Err(self.fail(first.clone())),
            None => Ok(()),
        }
    }

    /// The lake as a reader reads it, as it really is stored: the data files
    /// of each partition's current commit (Parquet, as `ferry lake files`
    /// lists them), or of the Iceberg table's current snapshot; each id with
    /// how many times it is read.
    pub(super) async fn read_lake(&self) -> Result<BTreeMap<i64, usize>, String> {
        let prefix = DESTINATION
            .strip_prefix(crate::world::LAKE_BUCKET)
            .unwrap_or_default();
        let location = Location::from_store(DESTINATION, self.world.lake_store.truth(), prefix)
            .map_err(|e| e.to_string())?;
        let mut files = Vec::new();
        match self.format {
            LakeFormat::Parquet => {
                let def = self.table_def();
                for p in PARTITIONS {
                    let current =
                        ferry_export::lake::current_commit(&location, LakeFormat::Parquet, &def, p)
                            .await?;
                    files.extend(current.into_iter().flat_map(|c| c.files));
                }
            }
            LakeFormat::Iceberg => {
                let table = ferry_iceberg::IcebergTable::new(location.clone());
                for f in table.files().await.map_err(|e| e.to_string())? {
                    files.push(table.key_of(&f.path).to_string());
                }
            }
        }
        let mut counts = BTreeMap::new();
        for key in files {
            let bytes = location
                .get(&key)
                .await
                .map_err(|e| format!("{key}: {e}"))?;
            for id in ids_in(&key, bytes)? {
                *counts.entry(id).or_insert(0) += 1;
            }
        }
        Ok(counts)
    }

    pub(super) fn table_def(&self) -> ferry_table::TableDef {
        ferry_testkit::table::id_p_toml(super::TABLE, SHARDS)
            .column("pad", "Utf8")
            .def()
    }

    /// Ids the client was answered 200 for.
    pub(super) fn acked_ids(&self) -> BTreeSet<i64> {
        self.acked.values().flatten().copied().collect()
    }

    /// What the lake must hold, against what it holds: every acknowledged
    /// id exactly once, a given-up id at most once, nothing else. Returns
    /// the rows read.
    pub(super) fn check_lake(&self, lake: &BTreeMap<i64, usize>) -> Result<usize, Failure> {
        let acked = self.acked_ids();
        if let Some((id, n)) = lake.iter().find(|(_, n)| **n > 1) {
            return Err(self.fail(format!("the lake's reader reads id {id} {n} times")));
        }
        let missing: Vec<i64> = acked
            .iter()
            .filter(|id| !lake.contains_key(id))
            .copied()
            .collect();
        if !missing.is_empty() {
            return Err(self.fail(format!(
                "{} acknowledged ids are not in the lake, e.g. {:?}",
                missing.len(),
                &missing[..missing.len().min(8)]
            )));
        }
        let foreign: Vec<i64> = lake
            .keys()
            .filter(|id| !acked.contains(id) && !self.given_up.contains(id))
            .copied()
            .collect();
        if !foreign.is_empty() {
            let refused = foreign
                .iter()
                .filter(|id| self.refused.contains(id))
                .count();
            return Err(self.fail(format!(
                "the lake holds {} ids never acknowledged ({refused} of them of refused inserts), e.g. {:?}",
                foreign.len(),
                &foreign[..foreign.len().min(8)]
            )));
        }
        Ok(lake.len())
    }

    /// Every replica, caught up: of its shard, each row at most once, only
    /// acknowledged or given-up rows, and every acknowledged row unless its
    /// partition was retired (then the lake holds it, checked above).
    pub(super) async fn check_replicas(&self) -> Result<(), Failure> {
        let mut want: BTreeMap<u32, BTreeSet<i64>> = BTreeMap::new();
        let acked = self.acked_ids();
        let ids: Vec<i64> = acked.iter().copied().collect();
        let shards = ferry_table::keys::shard_numbers(
            SHARDS,
            &(Arc::new(Int64Array::from(ids.clone())) as arrow::array::ArrayRef),
        );
        for (id, shard) in ids.iter().zip(shards) {
            want.entry(shard).or_default().insert(*id);
        }
        for i in 0..replicas() {
            let name = replica_name(i);
            let shard = i as u32 / REPLICAS_PER_SHARD;
            let Some(node) = &self.replicas[i] else {
                return Err(self.fail(format!("{name} is not running at the end")));
            };
            let r = node.node.replica.lock().await;
            let mut held: BTreeMap<i64, usize> = BTreeMap::new();
            let mut retired: BTreeSet<String> = BTreeSet::new();
            for p in r.retired(self.table_id) {
                retired.insert(p.partition_id.clone());
            }
            for p in r.parts(self.table_id) {
                let path = r.part_path(self.table_id, &p.name);
                let bytes = r
                    .disk()
                    .read(&path)
                    .await
                    .map_err(|e| self.fail(format!("{name}: reading {path}: {e}")))?;
                let found = ids_of(&p.name, Bytes::from(bytes))
                    .map_err(|e| self.fail(format!("{name}: part {}: {e}", p.name)))?;
                for id in found {
                    *held.entry(id).or_insert(0) += 1;
                }
            }
            if let Some((id, n)) = held.iter().find(|(_, n)| **n > 1) {
                return Err(self.fail(format!("{name} holds id {id} {n} times")));
            }
            if let Some(id) = held
                .keys()
                .find(|id| !acked.contains(id) && !self.given_up.contains(id))
            {
                return Err(self.fail(format!("{name} holds id {id}, never acknowledged")));
            }
            let lacking: Vec<i64> = want
                .get(&shard)
                .into_iter()
                .flatten()
                .filter(|id| !held.contains_key(id))
                .filter(|id| !retired.contains(super::partition_of(**id)))
                .copied()
                .collect();
            if !lacking.is_empty() {
                return Err(self.fail(format!(
                    "{name} lacks {} acknowledged rows of shard {shard} in partitions it did not retire, e.g. {:?}",
                    lacking.len(),
                    &lacking[..lacking.len().min(8)]
                )));
            }
        }
        Ok(())
    }
}

impl Sim {
    /// A commit file in the lake belongs to a task decided `commit`: of
    /// every task whose head still names its transaction (a replaced
    /// transaction's head is gone) and that is not being removed, a commit
    /// file of that transaction means the decision is `commit`. A commit file written before its
    /// decision could belong to a task a kill ended. Parquet destinations
    /// (an Iceberg snapshot is the commit; its checks are the reader's).
    /// Returns how many commit files were matched with their task.
    pub(super) async fn check_commits_decided(
        &self,
        checker: &ferry_coord::Session,
    ) -> Result<usize, Failure> {
        use ferry_export::model::{CommitFile, TaskKey};
        use ferry_export::task::{read_decision, read_head, Decision};
        if self.format != LakeFormat::Parquet {
            return Ok(0);
        }
        let keys = match checker
            .children(&ferry_export::model::exports_path(super::TABLE))
            .await
        {
            Ok((k, _)) => k,
            Err(ferry_coord::CoordError::NoNode { .. }) => Vec::new(),
            Err(e) => return Err(self.fail(format!("listing export tasks: {e}"))),
        };
        let mut heads = BTreeMap::new();
        for k in keys {
            let key = TaskKey {
                table: super::TABLE.into(),
                key: k,
            };
            let head = read_head(checker, &key)
                .await
                .map_err(|e| self.fail(format!("{}: {e}", key.path())))?;
            // A task without status is being removed (status goes first).
            if let Some(head) = head.filter(|h| h.status.is_some()) {
                heads.insert(head.transaction_id, key);
            }
        }
        let prefix = DESTINATION
            .strip_prefix(crate::world::LAKE_BUCKET)
            .unwrap_or_default();
        let location = Location::from_store(DESTINATION, self.world.lake_store.truth(), prefix)
            .map_err(|e| self.fail(e.to_string()))?;
        let objects = location
            .list("")
            .await
            .map_err(|e| self.fail(format!("listing the lake: {e}")))?;
        let mut matched = 0;
        for (k, _) in objects {
            if !k
                .rsplit('/')
                .next()
                .is_some_and(|f| f.starts_with("commit_"))
            {
                continue;
            }
            let data = location
                .get(&k)
                .await
                .map_err(|e| self.fail(format!("{k}: {e}")))?;
            let commit: CommitFile = serde_json::from_slice(&data)
                .map_err(|e| self.fail(format!("{k} is not a commit file: {e}")))?;
            let Some(key) = heads.get(&commit.transaction_id) else {
                continue;
            };
            let decision = read_decision(checker, key)
                .await
                .map_err(|e| self.fail(format!("{}: {e}", key.path())))?;
            if decision != Some(Decision::Commit) {
                return Err(self.fail(format!(
                    "{k}: a commit file of task {} {}, decided {decision:?}",
                    key.path(),
                    commit.transaction_id
                )));
            }
            matched += 1;
        }
        Ok(matched)
    }
}
