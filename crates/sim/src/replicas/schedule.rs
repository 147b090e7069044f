//! The replica workload's events, the inserts they send, and how a seed
//! draws them.

use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use bytes::Bytes;
use ferry_writer::driver::{Insert, InsertRows};
use rand::rngs::SmallRng;
use rand::Rng;

use super::{replicas, table, PARTITIONS, SAFEKEEPERS, TABLE_ID};
use crate::world::faults::draw_events;

#[derive(Debug, Clone)]
pub(super) enum Event {
    /// A new insert of this many rows.
    Insert(usize),
    /// An acknowledged insert sent again with its key (a client retry).
    Retry,
    CrashReplica(usize),
    CrashSafekeeper(usize),
    PartitionReplica(usize, usize),
    /// The writer cut off from a safekeeper, which falls behind while its
    /// walsenders still talk.
    PartitionWriter(usize),
    Repair,
}

/// One insert as a client sends it: its key and its records.
#[derive(Debug, Clone)]
pub(super) struct Request {
    pub(super) key: String,
    pub(super) ids: Vec<i64>,
    pub(super) inserts: Vec<Insert>,
}

pub(super) fn request(n: u64, first_id: i64, rows: usize) -> Request {
    let def = table().def;
    let ids: Vec<i64> = (first_id..first_id + rows as i64).collect();
    let batch = RecordBatch::try_new(
        def.arrow_schema(),
        vec![
            Arc::new(Int64Array::from(ids.clone())),
            Arc::new(StringArray::from_iter_values(
                ids.iter()
                    .map(|i| PARTITIONS[(*i as usize / 3) % PARTITIONS.len()]),
            )),
            // Bulk, so that the WAL spans many segments: backed up, removed
            // and read back from the backup by replicas that were down.
            Arc::new(StringArray::from_iter_values(
                ids.iter().map(|i| format!("{i:0>300}")),
            )),
        ],
    )
    .expect("batch");
    let rows_in = ferry_table::Rows {
        rows: batch.num_rows(),
        batches: vec![batch],
    };
    let key = format!("req-{n}");
    let inserts = ferry_table::rows::split_by_shard(&def, &rows_in)
        .expect("split")
        .into_iter()
        .map(|(shard, b)| Insert {
            table_id: TABLE_ID,
            shard,
            idempotency_key: Bytes::from(key.clone().into_bytes()),
            // Both record kinds: rows replicas encode (as WAL written before
            // parts were carried holds) and parts the ingest node encoded.
            rows: if n.is_multiple_of(2) {
                InsertRows::ArrowIpc(ferry_table::rows::to_ipc(&b).expect("ipc"))
            } else {
                InsertRows::Parts(ferry_replica::part::carry(&def, TABLE_ID, &b).expect("parts"))
            },
        })
        .collect();
    Request { key, ids, inserts }
}

pub(super) fn generate(rng: &mut SmallRng) -> Vec<(Duration, Event)> {
    let n = rng.random_range(30..80);
    draw_events(rng, n, 5..300, |rng| match rng.random_range(0..100) {
        0..=59 => Event::Insert(rng.random_range(1..40)),
        60..=69 => Event::Retry,
        70..=81 => Event::CrashReplica(rng.random_range(0..replicas())),
        82..=89 => Event::CrashSafekeeper(rng.random_range(0..SAFEKEEPERS)),
        90..=93 => Event::PartitionReplica(
            rng.random_range(0..replicas()),
            rng.random_range(0..SAFEKEEPERS),
        ),
        94..=96 => Event::PartitionWriter(rng.random_range(0..SAFEKEEPERS)),
        _ => Event::Repair,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The back-pressure check allows one insert past the limit: no insert
    /// of the schedule (at most 39 rows, either record kind) may be larger.
    #[test]
    fn the_largest_insert_fits_the_back_pressure_allowance() {
        for n in [0, 1] {
            let wal: usize = request(n, 1_000_000, 39)
                .inserts
                .iter()
                .map(Insert::record_len)
                .sum();
            assert!(
                wal as u64 <= super::super::MAX_INSERT_WAL,
                "request {n}: {wal} bytes of WAL"
            );
        }
    }
}
