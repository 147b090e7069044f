//! Retention and compaction in the export workload (compaction: now and
//! then a `Compact` record with a random target, merging runs of a
//! partition's parts on every node). Retention: now and then the schedule plays an
//! export policy whose retention came due, reads a partition's current
//! commit in a destination (through the faulty store, as a policy does) and
//! appends a `Retire` record naming its files to the WAL, whatever the
//! replicas hold meanwhile (rows inserted since, parts merged across the
//! exported blocks): the replicas' own rule (drop only parts a named file
//! holds whole) is what keeps unexported rows.
//!
//! Checked once everything settled, on every node: a partition's rows are
//! exactly its parts' rows and its retired files' rows, none in both, none
//! missing (no row dropped that the lake lacks); every retired file is in
//! the current commit of the destination it was retired to (readers find
//! it there); and every node retired the same files.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use arrow::array::AsArray;
use arrow::datatypes::Int64Type;
use bytes::Bytes;
use ferry_export::Destinations;
use ferry_storage::Location;
use ferry_wal::record::Record;
use ferry_wal::Lsn;
use rand::Rng;
use tokio::time::Instant;

use super::{partition_of, table, Failure, Sim, DESTINATIONS, NODES, PARTITIONS, TABLE_ID};

/// The chance that a retirement comes before an event.
pub(super) const RETIRE_PROBABILITY: f64 = 0.15;
/// The chance that a compaction comes before an event.
pub(super) const COMPACT_PROBABILITY: f64 = 0.1;

impl Sim {
    /// Before an event, now and then: a retirement of a random partition
    /// from a random destination's current commit.
    pub(super) async fn maybe_retire(&mut self) {
        if !self.retire_rng.random_bool(RETIRE_PROBABILITY) {
            return;
        }
        let partition = PARTITIONS[self.retire_rng.random_range(0..PARTITIONS.len())];
        let d = self.retire_rng.random_range(0..DESTINATIONS.len());
        if self.policy.is_some() {
            // With a policy, retirements are its own, behind its gate (as
            // in the product, where nothing else retires).
            return;
        }
        let Ok(location) = self.lake().open(DESTINATIONS[d]) else {
            return;
        };
        let current = ferry_export::lake::current_commit(
            &location,
            self.format_of(d),
            &table().def,
            partition,
        )
        .await;
        let current = match current {
            Ok(Some(c)) => c,
            Ok(None) => return,
            Err(e) => {
                self.log(format!("retire {partition} from {}: {e}", DESTINATIONS[d]));
                return;
            }
        };
        let retirement = ferry_export::policy::retirement_of(
            TABLE_ID,
            partition,
            DESTINATIONS[d],
            self.format_of(d),
            &current,
        );
        self.log(format!(
            "retire {partition} from {} at {}: {} files, {} rows",
            DESTINATIONS[d],
            self.wal.len(),
            retirement.files.len(),
            current.rows
        ));
        Record::Retire(retirement).encode(&mut self.wal);
        self.retirements += 1;
        self.publish_wal();
    }

    /// Before an event, now and then: a compaction of a random partition
    /// to a random target (in rows), which the replicas decide like any
    /// merge; the policy-like unforced exports then replace the lake's
    /// files by the merged parts.
    pub(super) async fn maybe_compact(&mut self) {
        if !self.retire_rng.random_bool(COMPACT_PROBABILITY) {
            return;
        }
        let partition = PARTITIONS[self.retire_rng.random_range(0..PARTITIONS.len())];
        let target_rows = self.retire_rng.random_range(5..300);
        self.log(format!(
            "compact {partition} to {target_rows} rows at {}",
            self.wal.len()
        ));
        Record::Compact(ferry_wal::record::Compaction {
            table_id: TABLE_ID,
            partition_id: partition.to_string(),
            target_rows,
        })
        .encode(&mut self.wal);
        self.compactions += 1;
        self.publish_wal();
    }

    /// The checks of the module docs; answers the rows retired on the
    /// first node.
    pub(super) async fn check_retention(&self) -> Result<u64, Failure> {
        let end = Lsn(self.wal.len() as u64);
        let mut seen: Option<Vec<ferry_replica::RetiredPartition>> = None;
        let mut retired_rows = 0;
        for i in 0..NODES {
            let Some(node) = &self.nodes[i] else {
                return Err(self.fail(format!("n{i} is not running at the end")));
            };
            let replica = std::sync::Arc::clone(&node.node.replica);
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let at = {
                    let mut r = replica.lock().await;
                    r.flush()
                        .await
                        .map_err(|e| self.fail(format!("n{i}: {e}")))?
                };
                if at >= end {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(self.fail(format!("n{i} applied {at} of {end}")));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let r = replica.lock().await;
            let retired = r.retired(TABLE_ID);
            let mut by_partition: BTreeMap<String, Vec<i64>> = BTreeMap::new();
            for p in r.parts(TABLE_ID) {
                let path = r.part_path(TABLE_ID, &p.name);
                let bytes = r
                    .disk()
                    .read(&path)
                    .await
                    .map_err(|e| self.fail(format!("n{i} {path}: {e}")))?;
                by_partition
                    .entry(p.name.partition_id.clone())
                    .or_default()
                    .extend(self.ids_in(&p.name, Bytes::from(bytes), &path)?);
            }
            drop(r);
            for rp in &retired {
                let prefix = rp
                    .destination
                    .strip_prefix("sim://lake/")
                    .ok_or_else(|| self.fail(format!("retired to {}", rp.destination)))?;
                let truth =
                    Location::from_store(&rp.destination, self.world.lake_store.truth(), prefix)
                        .map_err(|e| self.fail(format!("the lake: {e}")))?;
                let d = DESTINATIONS
                    .iter()
                    .position(|u| *u == rp.destination)
                    .ok_or_else(|| self.fail(format!("retired to {}", rp.destination)))?;
                let current = ferry_export::lake::current_commit(
                    &truth,
                    self.format_of(d),
                    &table().def,
                    &rp.partition_id,
                )
                .await
                .map_err(|e| self.fail(format!("reading {}: {e}", rp.destination)))?;
                let listed: BTreeSet<String> = current
                    .map(|c| c.data_files.into_iter().map(|f| f.path).collect())
                    .unwrap_or_default();
                for f in &rp.files {
                    if !listed.contains(&f.path) {
                        return Err(self.fail(format!(
                            "n{i}: retired file {} of {} is not in {}'s current commit: readers miss its rows",
                            f.path, rp.partition_id, rp.destination
                        )));
                    }
                    let name = ferry_replica::PartName::parse(&f.part)
                        .ok_or_else(|| self.fail(format!("retired part {}", f.part)))?;
                    let bytes = truth
                        .get(&f.path)
                        .await
                        .map_err(|e| self.fail(format!("{}: {e}", f.path)))?;
                    let ids = self.ids_in(&name, bytes, &f.path)?;
                    if i == 0 {
                        retired_rows += ids.len() as u64;
                    }
                    by_partition
                        .entry(rp.partition_id.clone())
                        .or_default()
                        .extend(ids);
                }
            }
            match &seen {
                None => seen = Some(retired),
                Some(first) if *first != retired => {
                    return Err(self.fail(format!(
                        "n{i} retired {retired:?}, n0 {first:?}: replicas decided differently"
                    )))
                }
                Some(_) => {}
            }
            for partition in PARTITIONS {
                let mut got = by_partition.remove(partition).unwrap_or_default();
                got.sort_unstable();
                let expected: Vec<i64> = self
                    .rows
                    .iter()
                    .filter(|(_, id)| partition_of(*id) == partition)
                    .map(|(_, id)| *id)
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect();
                if got != expected {
                    let have: BTreeSet<i64> = got.iter().copied().collect();
                    let missing: Vec<&i64> = expected
                        .iter()
                        .filter(|id| !have.contains(id))
                        .take(5)
                        .collect();
                    return Err(self.fail(format!(
                        "n{i} partition {partition}: {} rows in its parts and retired files, {} inserted \
                         ({} twice; missing e.g. {missing:?}): a row dropped that the lake lacks, or kept twice",
                        got.len(),
                        expected.len(),
                        got.len() - have.len()
                    )));
                }
            }
        }
        Ok(retired_rows)
    }

    fn ids_in(
        &self,
        name: &ferry_replica::PartName,
        bytes: Bytes,
        path: &str,
    ) -> Result<Vec<i64>, Failure> {
        let batches = ferry_replica::part::read_rows(name, bytes)
            .map_err(|e| self.fail(format!("{path}: {e}")))?;
        let mut ids = Vec::new();
        for b in &batches {
            let col = b.column(0).as_primitive::<Int64Type>();
            ids.extend((0..col.len()).map(|j| col.value(j)));
        }
        Ok(ids)
    }
}
