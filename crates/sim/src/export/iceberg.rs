//! The Iceberg destination of the export workload: the exports its
//! snapshots commit (for the kills on fresh commits), snapshot expiry
//! between events, and the final checks of its whole history, read as a
//! reader reads it (metadata versions, manifest lists, manifests, data
//! files).

use std::collections::{BTreeMap, BTreeSet};

use arrow::array::AsArray;
use arrow::datatypes::Int64Type;
use ferry_env::Clock;
use ferry_export::model::{LakeFormat, Metadata, TaskKey, TaskStatus};
use ferry_export::Destinations;
use ferry_iceberg::commit::metadata_key;
use ferry_iceberg::manifest::EntryStatus;
use ferry_iceberg::spec::{Snapshot, TableMetadata};
use ferry_iceberg::{CurrentExport, IcebergTable, PartitionValue};
use ferry_storage::Location;
use rand::Rng;

use super::{Failure, Sim, DESTINATIONS, ICEBERG_DESTINATION, PARTITIONS};

/// How often, per look between events, snapshots are expired.
const EXPIRE_PROBABILITY: f64 = 0.03;
/// Snapshots older than this are expired.
const EXPIRE_OLDER_THAN_MS: u64 = 500;

/// What the final check learnt of the Iceberg destination.
pub(super) struct IcebergChecked {
    /// Snapshots checked (one per commit).
    pub snapshots: usize,
}

/// The table's prefix in the simulated lake.
fn prefix() -> &'static str {
    DESTINATIONS[ICEBERG_DESTINATION]
        .strip_prefix("sim://lake/")
        .unwrap_or_default()
}

impl Sim {
    /// The table as it really is stored (no faults), or `None` in a
    /// Parquet-only run.
    fn iceberg_truth(&self) -> Option<IcebergTable> {
        if !self.iceberg {
            return None;
        }
        let location = Location::from_store(
            DESTINATIONS[ICEBERG_DESTINATION],
            self.world.lake_store.truth(),
            prefix(),
        )
        .ok()?;
        Some(IcebergTable::new(location))
    }

    /// The exports the table's newest metadata version names (its
    /// snapshots' and its partitions' current exports).
    pub(super) async fn iceberg_committed_now(&self) -> Vec<String> {
        let Some(table) = self.iceberg_truth() else {
            return Vec::new();
        };
        let Ok(Some((_, meta))) = table.current().await else {
            return Vec::new();
        };
        let mut txs: BTreeSet<String> = meta
            .snapshots
            .iter()
            .filter_map(|s| s.summary.get(ferry_iceberg::TRANSACTION_PROPERTY).cloned())
            .collect();
        for p in PARTITIONS {
            if let Some(Ok(e)) = meta
                .properties
                .get(&ferry_iceberg::partition_property(p))
                .map(|v| serde_json::from_str::<CurrentExport>(v))
            {
                txs.insert(e.transaction_id);
            }
        }
        txs.into_iter().collect()
    }

    /// Now and then, expires the table's older snapshots through the
    /// faulty store, racing the exporters' commits (`ferry lake
    /// expire-snapshots` run by an operator).
    pub(super) async fn maybe_expire_snapshots(&mut self) {
        if !self.iceberg || !self.upkeep_rng.random_bool(EXPIRE_PROBABILITY) {
            return;
        }
        let Ok(location) = self.lake().open(DESTINATIONS[ICEBERG_DESTINATION]) else {
            return;
        };
        let now_ms = self.world.clock.unix_micros() / 1000;
        let older_than = now_ms.saturating_sub(EXPIRE_OLDER_THAN_MS);
        let result = IcebergTable::new(location)
            .expire_snapshots(older_than as i64, now_ms as i64)
            .await;
        self.log(format!(
            "expire snapshots older than {older_than}: {result:?}"
        ));
    }

    /// Every metadata version of the table, in order: the versions must be
    /// 1, 2, ... with none missing (each created once, none overwritten:
    /// an overwrite shows as a version whose snapshots lost ones the
    /// version before had added, checked by the caller).
    async fn iceberg_versions(
        &self,
        table: &IcebergTable,
    ) -> Result<Vec<(u64, TableMetadata)>, Failure> {
        let listed = table
            .location()
            .list("metadata")
            .await
            .map_err(|e| self.fail(format!("listing the Iceberg metadata: {e}")))?;
        let mut versions: Vec<u64> = listed
            .iter()
            .filter_map(|(k, _)| {
                k.strip_prefix("metadata/v")?
                    .strip_suffix(".metadata.json")?
                    .parse()
                    .ok()
            })
            .collect();
        versions.sort_unstable();
        let mut out = Vec::new();
        for (i, v) in versions.into_iter().enumerate() {
            if v != i as u64 + 1 {
                return Err(self.fail(format!("Iceberg metadata version {v} follows {i}")));
            }
            let key = metadata_key(v);
            let body = table
                .location()
                .get(&key)
                .await
                .map_err(|e| self.fail(format!("{key}: {e}")))?;
            let meta: TableMetadata = serde_json::from_slice(&body)
                .map_err(|e| self.fail(format!("{key} does not parse: {e}")))?;
            out.push((v, meta));
        }
        Ok(out)
    }

    /// The ids of partition `partition`'s rows in snapshot `snapshot`, with
    /// repeats, and how many live files hold them.
    async fn iceberg_rows(
        &self,
        table: &IcebergTable,
        snapshot: &Snapshot,
        partition: &str,
    ) -> Result<(Vec<i64>, usize), Failure> {
        let what = format!("snapshot {}", snapshot.snapshot_id);
        let manifests = table
            .manifests(snapshot)
            .await
            .map_err(|e| self.fail(format!("{what}: manifest list: {e}")))?;
        let value = PartitionValue::String(partition.to_string());
        let mut ids = Vec::new();
        let mut files = 0;
        for m in manifests {
            let entries = table
                .entries(&m)
                .await
                .map_err(|e| self.fail(format!("{what}: {}: {e}", m.manifest_path)))?;
            for e in entries {
                if e.status == EntryStatus::Deleted || e.file.partition != value {
                    continue;
                }
                files += 1;
                let key = table.key_of(&e.file.path).to_string();
                let bytes = table
                    .location()
                    .get(&key)
                    .await
                    .map_err(|err| self.fail(format!("{what}: {key}: {err}")))?;
                let name = ferry_export::lake::part_of(&key)
                    .ok_or_else(|| self.fail(format!("{key}: not a data file name")))?;
                let batches = ferry_replica::part::read_rows(&name, bytes)
                    .map_err(|err| self.fail(format!("{key}: {err}")))?;
                for b in &batches {
                    let col = b.column(0).as_primitive::<Int64Type>();
                    ids.extend((0..col.len()).map(|j| col.value(j)));
                }
            }
        }
        Ok((ids, files))
    }

    /// The Iceberg destination checked over its whole history. `tasks`: every
    /// task in coordination by transaction id.
    pub(super) async fn check_iceberg(
        &self,
        tasks: &BTreeMap<String, (TaskKey, Option<TaskStatus>, Option<Metadata>)>,
    ) -> Result<IcebergChecked, Failure> {
        let Some(table) = self.iceberg_truth() else {
            return Ok(IcebergChecked { snapshots: 0 });
        };
        let versions = self.iceberg_versions(&table).await?;
        // Every snapshot a version added, with the export it commits.
        let mut seen: BTreeSet<i64> = BTreeSet::new();
        let mut committed: BTreeMap<String, (u64, Snapshot)> = BTreeMap::new();
        // Every partition's current export as any version recorded it.
        let mut records: BTreeMap<String, BTreeSet<CurrentExport>> = BTreeMap::new();
        let mut previous: Option<&TableMetadata> = None;
        for (v, meta) in &versions {
            if let Some(before) = previous {
                // A version keeps every snapshot the one before added,
                // except those an expiry drops (never the current one).
                if let Some(lost) = before.current_snapshot().filter(|s| {
                    !meta
                        .snapshots
                        .iter()
                        .any(|n| n.snapshot_id == s.snapshot_id)
                }) {
                    return Err(self.fail(format!(
                        "Iceberg version {v} lost snapshot {} current in the version before",
                        lost.snapshot_id
                    )));
                }
            }
            for s in &meta.snapshots {
                if !seen.insert(s.snapshot_id) {
                    continue;
                }
                let Some(tx) = s.summary.get(ferry_iceberg::TRANSACTION_PROPERTY) else {
                    return Err(self.fail(format!(
                        "Iceberg version {v}: snapshot {} names no export",
                        s.snapshot_id
                    )));
                };
                if let Some((first, _)) = committed.get(tx) {
                    return Err(self.fail(format!(
                        "export {tx} committed twice: in Iceberg versions {first} and {v}"
                    )));
                }
                committed.insert(tx.clone(), (*v, s.clone()));
            }
            for p in PARTITIONS {
                if let Some(raw) = meta.properties.get(&ferry_iceberg::partition_property(p)) {
                    let e: CurrentExport = serde_json::from_str(raw).map_err(|e| {
                        self.fail(format!("Iceberg version {v}: property of {p}: {e}"))
                    })?;
                    records.entry(p.to_string()).or_default().insert(e);
                }
            }
            previous = Some(meta);
        }
        // Every committed export: asked, not killed, its snapshot holding
        // the partition's rows as of the request, each once.
        let mut rows_of: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
        for (tx, (v, snapshot)) in &committed {
            let Some(asked) = self.asked.get(tx) else {
                return Err(self.fail(format!(
                    "Iceberg version {v}: a snapshot of an export never asked for ({tx})"
                )));
            };
            if asked.killed {
                return Err(self.fail(format!(
                    "Iceberg version {v}: a snapshot of export {tx}, killed (KILLED answered)"
                )));
            }
            if let Some((_, status, _)) = tasks.get(tx) {
                if *status != Some(TaskStatus::Completed) {
                    return Err(self.fail(format!(
                        "Iceberg version {v}: a snapshot of export {tx}, a task that is {status:?}"
                    )));
                }
            }
            let (ids, _) = self
                .iceberg_rows(&table, snapshot, &asked.partition)
                .await?;
            let unique: BTreeSet<i64> = ids.iter().copied().collect();
            if unique.len() != ids.len() {
                return Err(self.fail(format!(
                    "Iceberg version {v}: export {tx}'s snapshot holds {} rows of {} more than once",
                    ids.len() - unique.len(),
                    asked.partition
                )));
            }
            if unique != asked.ids {
                let missing: Vec<&i64> = asked.ids.difference(&unique).take(5).collect();
                let extra: Vec<&i64> = unique.difference(&asked.ids).take(5).collect();
                return Err(self.fail(format!(
                    "Iceberg version {v}: export {tx}'s snapshot holds {} rows of {}, the partition had {} at the request (missing e.g. {missing:?}, extra e.g. {extra:?})",
                    unique.len(),
                    asked.partition,
                    asked.ids.len()
                )));
            }
            rows_of.insert(tx.clone(), unique);
        }
        // What a reader reads: of every partition, its current export's
        // rows, each once, which hold every row any commit of it held.
        if let Some((v, meta)) = versions.last() {
            let current = meta.current_snapshot();
            for p in PARTITIONS {
                let key = ferry_iceberg::partition_property(p);
                let Some(raw) = meta.properties.get(&key) else {
                    if committed.values().any(|(_, s)| {
                        s.summary.get("ferry.partition-id").map(String::as_str) == Some(p)
                    }) {
                        return Err(self.fail(format!(
                            "Iceberg version {v}: partition {p} was committed but has no current export"
                        )));
                    }
                    continue;
                };
                let e: CurrentExport = serde_json::from_str(raw)
                    .map_err(|err| self.fail(format!("Iceberg version {v}: {key}: {err}")))?;
                let Some(want) = rows_of.get(&e.transaction_id) else {
                    return Err(self.fail(format!(
                        "Iceberg version {v}: the current export {} of {p} has no snapshot",
                        e.transaction_id
                    )));
                };
                let Some(current) = current else {
                    return Err(self.fail(format!("Iceberg version {v}: no current snapshot")));
                };
                let (ids, _) = self.iceberg_rows(&table, current, p).await?;
                let unique: BTreeSet<i64> = ids.iter().copied().collect();
                if unique.len() != ids.len() || &unique != want {
                    return Err(self.fail(format!(
                        "a reader of the Iceberg table reads {} rows of {p} ({} distinct); its current export {} holds {}",
                        ids.len(),
                        unique.len(),
                        e.transaction_id,
                        want.len()
                    )));
                }
                for (tx, (_, s)) in &committed {
                    if s.summary.get("ferry.partition-id").map(String::as_str) != Some(p) {
                        continue;
                    }
                    if let Some(id) = rows_of.get(tx).and_then(|r| r.difference(want).next()) {
                        return Err(self.fail(format!(
                            "a reader of the Iceberg table reads {p} at export {}, which lacks row {id} of export {tx}",
                            e.transaction_id
                        )));
                    }
                }
            }
        }
        // Every COMPLETED task of the table: committed, or its content or
        // a later export of its partition was.
        for (tx, (key, status, metadata)) in tasks {
            let Some(m) = metadata else { continue };
            if m.settings.format() != LakeFormat::Iceberg || *status != Some(TaskStatus::Completed)
            {
                continue;
            }
            if committed.contains_key(tx) {
                continue;
            }
            let rank = (m.sequence, m.create_time, tx.as_str());
            let covered = records.get(&m.partition_id).is_some_and(|rs| {
                rs.iter().any(|r| {
                    r.content_id == m.content_id
                        || (r.sequence, r.create_time, r.transaction_id.as_str()) > rank
                })
            });
            if !covered {
                return Err(self.fail(format!(
                    "{key} {tx} is COMPLETED but no Iceberg snapshot holds it, its content or a later export"
                )));
            }
        }
        match ferry_iceberg::verify::verify(&table).await {
            Ok(Some(report)) if !report.ok() => {
                return Err(self.fail(format!(
                    "ferry verify of the Iceberg table: {:?}",
                    report.problems
                )))
            }
            Ok(_) => {}
            Err(e) => return Err(self.fail(format!("ferry verify of the Iceberg table: {e}"))),
        }
        Ok(IcebergChecked {
            snapshots: committed.len(),
        })
    }
}
