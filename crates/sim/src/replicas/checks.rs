//! The replica workload's checks: at every step, the writer's back-pressure
//! and every replica's reported position ([`Sim::check_steps`]); once
//! everything settled, the rows and parts of every replica against the
//! acknowledged inserts ([`Sim::check_replicas`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow::array::{AsArray, Int64Array};
use arrow::datatypes::Int64Type;
use bytes::Bytes;
use ferry_wal::Lsn;

use super::{
    replica_name, replicas, table, BackPressureSample, Failure, Sim, MAX_INSERT_WAL,
    REPLICAS_PER_SHARD, SHARDS, TABLE_ID,
};

impl Sim {
    pub(super) fn check_steps(&mut self) -> Result<(), Failure> {
        // Back-pressure: the writer releases no append while the end of WAL
        // is past the limit (plus the one insert released last) ahead of the
        // slowest replica it heard of. The slowest position it knows can drop
        // (a replica first heard late, through a safekeeper cut off from the
        // writer until then, or heard again after the writer forgot it past
        // the replica expiry): the end may be past the limit then, through no
        // fault of the writer, but must not move until the lag is back in it.
        // Samples are taken between events, so the writer may have known a
        // higher minimum in between (a replica forgotten and heard again):
        // only two samples of the same writer knowing the same replicas,
        // having forgotten none since and heard none go back (a replica
        // rebuilt at a lower LSN: its feedback can raise the minimum and
        // lower it again between two samples), the slowest no slower, are
        // compared.
        if let (Some(writer), true) = (&self.writer, self.flush_lag > 0) {
            let s = writer.status();
            let end: Lsn = s.end_lsn.parse().unwrap_or(Lsn(0));
            let known: BTreeSet<(u32, u32)> = s
                .replicas
                .iter()
                .map(|f| (f.shard_number, f.replica_number))
                .collect();
            let now = s.overall_minimum.map(|min| BackPressureSample {
                term: s.term,
                end,
                min: min.disk_consistent_lsn,
                known,
                forgotten: s.replicas_forgotten,
                setbacks: s.replica_setbacks,
            });
            let previous = std::mem::replace(&mut self.back_pressure_seen, now.clone());
            if let (Some(now), Some(prev)) = (now, previous) {
                let lag = now.end.distance_from(now.min);
                if now.term == prev.term
                    && now.known == prev.known
                    && now.forgotten == prev.forgotten
                    && now.setbacks == prev.setbacks
                    && now.min >= prev.min
                    && now.end > prev.end
                    && lag > self.flush_lag + MAX_INSERT_WAL
                {
                    return Err(self.fail(format!(
                        "the end of WAL {} ran {lag} bytes ahead of the slowest replica's {} (limit {} and one insert)",
                        now.end, now.min, self.flush_lag
                    )));
                }
            }
        }
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

    /// The rows of every replica against the acknowledged inserts.
    pub(super) async fn check_replicas(&mut self) -> Result<(usize, u64), Failure> {
        let mut expected: BTreeMap<u32, Vec<i64>> = BTreeMap::new();
        let def = table().def;
        for req in self.acked.values() {
            let ids = Int64Array::from(req.ids.clone());
            let shards = ferry_table::keys::shard_numbers(
                SHARDS,
                &(Arc::new(ids) as arrow::array::ArrayRef),
            );
            for (id, shard) in req.ids.iter().zip(shards) {
                expected.entry(shard).or_default().push(*id);
            }
        }
        let _ = def;
        let mut per_shard_parts: BTreeMap<u32, Vec<(String, u64, u32)>> = BTreeMap::new();
        let mut rows_total = 0;
        let mut merges = 0;
        for i in 0..replicas() {
            let name = replica_name(i);
            let shard = i as u32 / REPLICAS_PER_SHARD;
            let Some(node) = &self.replicas[i] else {
                continue;
            };
            let r = node.shared().lock().await;
            merges += r.subscribe().borrow().merges_done;
            let mut ids = Vec::new();
            let mut parts = Vec::new();
            for p in r.parts(TABLE_ID) {
                let bytes = r
                    .disk()
                    .read(&r.part_path(TABLE_ID, &p.name))
                    .await
                    .map_err(|e| self.fail(format!("{name}: reading part {}: {e}", p.name)))?;
                let batches = ferry_replica::part::read_rows(&p.name, Bytes::from(bytes))
                    .map_err(|e| self.fail(format!("{name}: {e}")))?;
                for b in &batches {
                    let col = b.column(0).as_primitive::<Int64Type>();
                    ids.extend((0..col.len()).map(|j| col.value(j)));
                }
                parts.push((p.name.to_string(), p.rows, p.checksum));
            }
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            let unique: BTreeSet<i64> = sorted.iter().copied().collect();
            if unique.len() != sorted.len() {
                return Err(self.fail(format!(
                    "{name} holds {} rows more than once",
                    sorted.len() - unique.len()
                )));
            }
            let mut want = expected.get(&shard).cloned().unwrap_or_default();
            want.sort_unstable();
            if sorted != want {
                let missing: Vec<i64> = want
                    .iter()
                    .filter(|x| !unique.contains(x))
                    .copied()
                    .take(5)
                    .collect();
                return Err(self.fail(format!(
                    "{name} holds {} rows of shard {shard}, the acknowledged inserts {} (missing e.g. {missing:?})",
                    sorted.len(),
                    want.len()
                )));
            }
            rows_total += sorted.len();
            match per_shard_parts.get(&shard) {
                Some(other) if *other != parts => {
                    return Err(self.fail(format!(
                        "{name}'s parts differ from its shard's other replica: {} against {} parts",
                        parts.len(),
                        other.len()
                    )))
                }
                Some(_) => {}
                None => {
                    per_shard_parts.insert(shard, parts);
                }
            }
        }
        Ok((rows_total, merges))
    }
}
