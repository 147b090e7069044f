//! WAL as tests write and read it: placeholder inserts (records of a known
//! size in shard 0, whose payload bytes name the block, so a misplaced byte
//! shows; never read as rows), the records of a stretch of WAL, and a WAL
//! backup made by hand.

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use ferry_wal::record::{self, Record};
use ferry_wal::segment::SegmentSize;
use ferry_wal::ClusterId;

/// The insert of block `block` into table `table_id`, with `size` bytes of
/// payload: one append of a known size.
pub fn insert(table_id: u64, block: u64, size: usize) -> Bytes {
    inserts(table_id, block..block + 1, size)
}

/// The inserts of `blocks` into table `table_id`, one after the other, each
/// with `size` bytes of payload: WAL of a known length and content, to
/// compare with what safekeepers hold.
pub fn inserts(table_id: u64, blocks: Range<u64>, size: usize) -> Bytes {
    let mut wal = BytesMut::new();
    for block_number in blocks {
        let payload = Bytes::from(vec![block_number as u8; size]);
        Record::Insert {
            table_id,
            block_number,
            shard: 0,
            idempotency_key: Bytes::new(),
            arrow_ipc: payload,
        }
        .encode(&mut wal);
    }
    wal.freeze()
}

/// Every record of `wal` (whole records, starting at LSN 0), with the LSN
/// it starts at: what a test reads back from a safekeeper or a sink is
/// compared record by record.
///
/// # Panics
/// When `wal` is not whole records.
pub fn records(wal: &Bytes) -> Vec<(u64, Record)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < wal.len() {
        let (rec, len) = record::decode(&wal.slice(at..)).expect("whole records");
        out.push((at as u64, rec));
        at += len;
    }
    out
}

/// A WAL backup in the folder `root` (created) holding the whole segments
/// `segnos` of `wal` (which starts at LSN 0) for `cluster`, where the
/// safekeepers' uploads put them: the backup's location. A test can so
/// restore from a backup it chose, gaps included.
///
/// # Panics
/// When the folder cannot be written.
pub async fn file_backup(
    root: &std::path::Path,
    cluster: &ClusterId,
    seg: SegmentSize,
    wal: &[u8],
    segnos: impl IntoIterator<Item = u64>,
) -> ferry_storage::Location {
    #[allow(clippy::disallowed_methods)] // the folder the test's backup lives in
    std::fs::create_dir_all(root).expect("backup dir");
    let location = ferry_storage::open(&format!("file://{}", root.display()), &Default::default())
        .expect("backup location");
    let folder =
        ferry_safekeeper::backup::cluster_folder(&location, cluster).expect("cluster folder");
    for segno in segnos {
        let range = seg.start(segno).0 as usize..seg.start(segno + 1).0 as usize;
        folder
            .put(
                &ferry_safekeeper::backup::segment_key(seg, segno),
                Bytes::copy_from_slice(&wal[range]),
            )
            .await
            .expect("put a segment");
    }
    location
}
