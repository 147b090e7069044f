//! What the replica's tests share: a table, its rows, a WAL of insert
//! records, and opening and merging replicas.

#![allow(dead_code)] // each test file uses a part

use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use bytes::{Bytes, BytesMut};
use ferry_env::{Cpu, Disk};
use ferry_replica::{Replica, Tables};
use ferry_table::Table;
use ferry_testkit::table::{id_p_table, FixedTables};
use ferry_wal::record::Record;
use ferry_wal::Lsn;

pub fn table() -> Table {
    id_p_table(1, "t", 2, &[])
}

pub fn tables() -> Arc<dyn Tables> {
    Arc::new(FixedTables::new([table()]).with_dropped(2))
}

/// Rows `ids` with partitions from `parts` (cycled).
pub fn rows(ids: std::ops::Range<i64>, parts: &[&str]) -> Bytes {
    let n = ids.clone().count();
    let batch = RecordBatch::try_new(
        table().def.arrow_schema(),
        vec![
            Arc::new(Int64Array::from_iter_values(ids)),
            Arc::new(StringArray::from_iter_values(
                (0..n).map(|i| parts[i % parts.len()]),
            )),
        ],
    )
    .expect("batch");
    ferry_table::rows::to_ipc(&batch).expect("ipc")
}

/// WAL: records appended with block number = start LSN.
#[derive(Default)]
pub struct Wal {
    pub bytes: BytesMut,
}

impl Wal {
    pub fn insert(&mut self, table_id: u64, shard: u32, key: &str, arrow_ipc: Bytes) -> Lsn {
        let at = self.bytes.len() as u64;
        Record::Insert {
            table_id,
            shard,
            block_number: at,
            idempotency_key: Bytes::from(key.as_bytes().to_vec()),
            arrow_ipc,
        }
        .encode(&mut self.bytes);
        Lsn(at)
    }

    /// An insert carrying its rows as the parts the ingest node encodes.
    pub fn insert_parts(&mut self, table_id: u64, shard: u32, key: &str, arrow_ipc: &Bytes) -> Lsn {
        let batch = ferry_table::rows::from_ipc(arrow_ipc)
            .expect("ipc")
            .pop()
            .expect("a batch");
        let parts = ferry_replica::part::carry(&table().def, table_id, &batch).expect("parts");
        self.insert_carried(table_id, shard, key, parts)
    }

    /// An insert carrying `parts` as they are.
    pub fn insert_carried(
        &mut self,
        table_id: u64,
        shard: u32,
        key: &str,
        parts: Vec<ferry_wal::record::CarriedPart>,
    ) -> Lsn {
        let at = self.bytes.len() as u64;
        Record::InsertParts {
            table_id,
            shard,
            block_number: at,
            idempotency_key: Bytes::from(key.as_bytes().to_vec()),
            parts,
        }
        .encode(&mut self.bytes);
        Lsn(at)
    }

    pub fn end(&self) -> Lsn {
        Lsn(self.bytes.len() as u64)
    }
}

pub async fn open(disk: &Arc<dyn Disk>, dir: &str, shard: u32) -> Replica {
    Replica::open(Arc::clone(disk), dir, shard, 0, Cpu::Inline, tables())
        .await
        .expect("open replica")
}

pub fn names(r: &Replica) -> Vec<(String, u64, u32)> {
    r.parts(1)
        .into_iter()
        .map(|p| (p.name.to_string(), p.rows, p.checksum))
        .collect()
}

/// Runs every decided merge of `r` to the end, as the merge task does.
pub async fn merge_all(r: &mut Replica) -> Vec<(u64, ferry_replica::PartName)> {
    let mut replaced = Vec::new();
    while let Some(job) = r.next_merge() {
        let merge = job.merge.clone();
        let meta = job.run().await.expect("merge");
        replaced.extend(r.finish_merge(&merge, meta).await.expect("finish"));
    }
    replaced
}

/// Replica `replica` of shard 0 under `dir`.
pub async fn open_as(disk: &Arc<dyn Disk>, dir: &str, replica: u32) -> Replica {
    Replica::open(Arc::clone(disk), dir, 0, replica, Cpu::Inline, tables())
        .await
        .expect("open replica")
}

/// Applies what `wal` holds past the replica's position.
pub async fn apply_rest(r: &mut Replica, wal: &Wal) {
    let at = r.receive_from();
    let all = wal.bytes.clone().freeze();
    r.receive(at, &all[at.0 as usize..]).await.expect("apply");
}
