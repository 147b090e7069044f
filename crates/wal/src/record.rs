//! The WAL record format.
//!
//! Every record checks itself, so that a safekeeper restarting after a crash can
//! walk its WAL from a known record boundary and stop exactly at the end of the
//! last complete record: a torn or never-written tail fails the length or checksum
//! test. Layout (little-endian):
//!
//! ```text
//! 0      4        8     9         16
//! | len | crc32c | kind | reserved | payload ...
//! ```
//!
//! `len` counts the whole record (header included); `crc32c` covers bytes 8..len.
//! Records are packed back to back and may span segment boundaries.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::Lsn;

/// Size of the record header.
pub const HEADER_BYTES: usize = 16;
/// The longest idempotency key a record carries.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 256;

/// The largest record accepted (header included). An insert batch larger than
/// this must be split by the writer.
pub const MAX_RECORD_BYTES: usize = 64 << 20;

const KIND_INSERT: u8 = 1;
/// table_id, block_number, shard, key length, reserved.
const INSERT_FIXED_BYTES: usize = 8 + 8 + 4 + 2 + 2;
const KIND_SHUTDOWN_CHECKPOINT: u8 = 2;
const KIND_RETIRE: u8 = 3;
const KIND_COMPACT: u8 = 4;
const KIND_INSERT_PARTS: u8 = 5;
/// Per carried part: partition id length, reserved, file length.
const CARRIED_PART_FIXED_BYTES: usize = 2 + 2 + 4;

/// Parts one [`Record::InsertParts`] carries at most (partitions of one insert).
pub const MAX_CARRIED_PARTS: usize = 4096;
/// The longest partition id a carried part names.
pub const MAX_CARRIED_PARTITION_BYTES: usize = 1024;

/// A decoded record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// Rows of one shard of one table: an Arrow IPC stream holding one record
    /// batch, the block number the writer assigned to this insert (part names
    /// derive from it; it is the LSN where the record starts, so it is unique
    /// among committed records and grows with the WAL), and the record's
    /// idempotency key (empty when the request had none; the ingest API makes
    /// it unique to the record within its insert and bound to the insert's
    /// rows): replicas apply a record whose (table, shard, key) they already
    /// applied only once.
    Insert {
        table_id: u64,
        shard: u32,
        block_number: u64,
        idempotency_key: Bytes,
        arrow_ipc: Bytes,
    },
    /// Rows of one shard of one table as finished part files, one per
    /// partition (partition ids strictly increasing), encoded once by the
    /// ingest node: every replica writes the same bytes as its level-0 parts
    /// instead of encoding the rows again, and the WAL carries the rows
    /// compressed. Block number and key as for [`Record::Insert`]; a part's
    /// footer holds no LSN (not known when it was encoded): its name does.
    InsertParts {
        table_id: u64,
        shard: u32,
        block_number: u64,
        idempotency_key: Bytes,
        parts: Vec<CarriedPart>,
    },
    /// Written by a writer that shuts down cleanly; it exits once this record is
    /// committed, so every replica eventually sees where the writer stopped.
    ShutdownCheckpoint { term: u64 },
    /// Rows of one partition that are in the lake, retired from every
    /// replica (a table's retention). Replicas apply it at its position, like
    /// a merge decision, so every replica of a shard drops the same parts.
    Retire(Retirement),
    /// Compaction of a partition whose rows stopped changing: replicas
    /// merge runs of its consecutive parts up to `target_rows` rows each,
    /// decided at this position like any merge, so the lake (which mirrors
    /// the parts by increments) ends with files near its target size.
    Compact(Compaction),
}

/// One partition's part file in a [`Record::InsertParts`]: the WAL does not
/// look inside `file` (the replica checks it against the table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CarriedPart {
    pub partition_id: String,
    pub file: Bytes,
}

/// A compaction of one partition (see [`Record::Compact`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Compaction {
    pub table_id: u64,
    pub partition_id: String,
    pub target_rows: u64,
}

/// The records a table's export policy asks a writer to append (table
/// upkeep, never rows): what travels from the policy's node to the writer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Maintenance {
    Retire(Retirement),
    Compact(Compaction),
}

impl Maintenance {
    pub fn table_id(&self) -> u64 {
        match self {
            Maintenance::Retire(r) => r.table_id,
            Maintenance::Compact(c) => c.table_id,
        }
    }

    pub fn partition_id(&self) -> &str {
        match self {
            Maintenance::Retire(r) => &r.partition_id,
            Maintenance::Compact(c) => &c.partition_id,
        }
    }

    pub fn into_record(self) -> Record {
        match self {
            Maintenance::Retire(r) => Record::Retire(r),
            Maintenance::Compact(c) => Record::Compact(c),
        }
    }
}

/// What a retirement names: the lake files of a partition's current commit,
/// as the export policy read them just before it asked for the record.
/// A replica drops only parts whose blocks lie inside one of these files
/// (same shard, same partition), so a row no file holds is never dropped,
/// whatever else happened in between (the retention gate, enforced where the
/// rows are dropped).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Retirement {
    pub table_id: u64,
    pub partition_id: String,
    /// Where the rows are: the destination's URL and format
    /// (`parquet` | `iceberg`), and the commit (its key) listing the files.
    pub destination: String,
    pub format: String,
    pub commit: String,
    pub files: Vec<RetiredFile>,
}

/// One lake data file of a retirement.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RetiredFile {
    /// Its key relative to the destination.
    pub path: String,
    /// The part it holds (a part name: partition, blocks, level).
    pub part: String,
    /// The shard of the replica that wrote it (`None`: a replica of every shard).
    pub shard: Option<u32>,
    pub rows: u64,
    pub bytes: u64,
    /// Checksum of its rows, as in the part's footer.
    pub checksum: u32,
}

/// The longest partition id a compaction names.
pub const MAX_COMPACT_PARTITION_BYTES: usize = 1024;

/// Files a retirement names at most (a partition's files in one commit).
pub const MAX_RETIRED_FILES: usize = 100_000;

/// Why bytes are not a valid record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record header or body incomplete ({have} of {need} bytes)")]
    Incomplete { have: usize, need: usize },
    #[error("record length {0} out of range")]
    BadLength(usize),
    #[error("record checksum mismatch")]
    BadChecksum,
    #[error("unknown record kind {0}")]
    UnknownKind(u8),
    #[error("malformed {0} record")]
    Malformed(&'static str),
}

impl Record {
    /// Appends the encoded record to `out`; returns its length.
    pub fn encode(&self, out: &mut BytesMut) -> usize {
        let start = out.len();
        out.put_u32_le(0);
        out.put_u32_le(0);
        match self {
            Record::Insert {
                table_id,
                shard,
                block_number,
                idempotency_key,
                arrow_ipc,
            } => {
                put_insert_head(
                    out,
                    KIND_INSERT,
                    *table_id,
                    *block_number,
                    *shard,
                    idempotency_key,
                    0,
                );
                out.put_slice(arrow_ipc);
            }
            Record::InsertParts {
                table_id,
                shard,
                block_number,
                idempotency_key,
                parts,
            } => {
                assert!(
                    parts.len() <= MAX_CARRIED_PARTS,
                    "parts per record are bounded before they reach a record"
                );
                let count = parts.len() as u16;
                put_insert_head(
                    out,
                    KIND_INSERT_PARTS,
                    *table_id,
                    *block_number,
                    *shard,
                    idempotency_key,
                    count,
                );
                for p in parts {
                    assert!(
                        p.partition_id.len() <= MAX_CARRIED_PARTITION_BYTES,
                        "partition ids are bounded before they reach a record"
                    );
                    let file_len = u32::try_from(p.file.len()).expect("a record is at most 64 MiB");
                    out.put_u16_le(p.partition_id.len() as u16);
                    out.put_u16_le(0);
                    out.put_u32_le(file_len);
                    out.put_slice(p.partition_id.as_bytes());
                    out.put_slice(&p.file);
                }
            }
            Record::ShutdownCheckpoint { term } => {
                out.put_u8(KIND_SHUTDOWN_CHECKPOINT);
                out.put_bytes(0, 7);
                out.put_u64_le(*term);
            }
            Record::Compact(Compaction {
                table_id,
                partition_id,
                target_rows,
            }) => {
                assert!(
                    partition_id.len() <= MAX_COMPACT_PARTITION_BYTES,
                    "partition ids are bounded before they reach a record"
                );
                out.put_u8(KIND_COMPACT);
                out.put_bytes(0, 7);
                out.put_u64_le(*table_id);
                out.put_u64_le(*target_rows);
                out.put_slice(partition_id.as_bytes());
            }
            Record::Retire(r) => {
                assert!(
                    r.files.len() <= MAX_RETIRED_FILES,
                    "retirements are bounded before they reach a record"
                );
                out.put_u8(KIND_RETIRE);
                out.put_bytes(0, 7);
                let body = postcard::to_allocvec(r).expect("a retirement serialises");
                out.put_slice(&body);
            }
        }
        let len = out.len() - start;
        let crc = crc32c::crc32c(&out[start + 8..]);
        out[start..start + 4].copy_from_slice(&(len as u32).to_le_bytes());
        out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
        len
    }

    /// Encodes into a fresh buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::new();
        self.encode(&mut out);
        out.freeze()
    }

    /// Encoded length of an insert with `arrow_ipc_len` bytes of rows and a key
    /// of `key_len` bytes.
    pub fn insert_len(key_len: usize, arrow_ipc_len: usize) -> usize {
        HEADER_BYTES + INSERT_FIXED_BYTES + key_len + arrow_ipc_len
    }

    /// Encoded length of an insert carrying `parts` with a key of `key_len`
    /// bytes.
    pub fn insert_parts_len(key_len: usize, parts: &[CarriedPart]) -> usize {
        HEADER_BYTES
            + INSERT_FIXED_BYTES
            + key_len
            + parts
                .iter()
                .map(|p| CARRIED_PART_FIXED_BYTES + p.partition_id.len() + p.file.len())
                .sum::<usize>()
    }
}

/// The kind byte, reserved bytes and fixed fields of an insert record, then
/// its key: what both insert kinds start with (`extra` is the insert's
/// reserved field, the part count of an insert carrying parts).
fn put_insert_head(
    out: &mut BytesMut,
    kind: u8,
    table_id: u64,
    block_number: u64,
    shard: u32,
    idempotency_key: &[u8],
    extra: u16,
) {
    assert!(
        idempotency_key.len() <= MAX_IDEMPOTENCY_KEY_BYTES,
        "idempotency keys are bounded before they reach a record"
    );
    out.put_u8(kind);
    out.put_bytes(0, 7);
    out.put_u64_le(table_id);
    out.put_u64_le(block_number);
    out.put_u32_le(shard);
    out.put_u16_le(idempotency_key.len() as u16);
    out.put_u16_le(extra);
    out.put_slice(idempotency_key);
}

/// Reads what [`put_insert_head`] wrote: table id, block number, shard, key
/// and the reserved field; `None` when the body is too short or the key too
/// long.
fn get_insert_head(body: &mut Bytes) -> Option<(u64, u64, u32, Bytes, u16)> {
    if body.len() < INSERT_FIXED_BYTES {
        return None;
    }
    let table_id = body.get_u64_le();
    let block_number = body.get_u64_le();
    let shard = body.get_u32_le();
    let key_len = usize::from(body.get_u16_le());
    let extra = body.get_u16_le();
    if key_len > MAX_IDEMPOTENCY_KEY_BYTES || body.len() < key_len {
        return None;
    }
    Some((table_id, block_number, shard, body.split_to(key_len), extra))
}

/// The length of the record starting `buf`, as its header declares it, once
/// the header is there (nothing verified: [`check`] does that). Lets a reader
/// that receives a record in pieces wait for all of it without re-reading.
pub fn declared_len(buf: &[u8]) -> Option<usize> {
    let header = buf.get(..4)?;
    Some(u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize)
}

/// Checks the record at the start of `buf` and returns its length, without
/// decoding the payload.
pub fn check(buf: &[u8]) -> Result<usize, RecordError> {
    if buf.len() < HEADER_BYTES {
        return Err(RecordError::Incomplete {
            have: buf.len(),
            need: HEADER_BYTES,
        });
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if !(HEADER_BYTES..=MAX_RECORD_BYTES).contains(&len) {
        return Err(RecordError::BadLength(len));
    }
    if buf.len() < len {
        return Err(RecordError::Incomplete {
            have: buf.len(),
            need: len,
        });
    }
    let crc = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    if crc32c::crc32c(&buf[8..len]) != crc {
        return Err(RecordError::BadChecksum);
    }
    Ok(len)
}

/// Decodes the record at the start of `buf`; returns it and its length.
pub fn decode(buf: &Bytes) -> Result<(Record, usize), RecordError> {
    let len = check(buf)?;
    let kind = buf[8];
    let mut body = buf.slice(HEADER_BYTES..len);
    let record = match kind {
        KIND_INSERT => {
            let (table_id, block_number, shard, idempotency_key, _reserved) =
                get_insert_head(&mut body).ok_or(RecordError::Malformed("insert"))?;
            Record::Insert {
                table_id,
                shard,
                block_number,
                idempotency_key,
                arrow_ipc: body,
            }
        }
        KIND_INSERT_PARTS => {
            let malformed = RecordError::Malformed("insert parts");
            let (table_id, block_number, shard, idempotency_key, count) =
                get_insert_head(&mut body).ok_or(malformed.clone())?;
            let count = usize::from(count);
            if count > MAX_CARRIED_PARTS {
                return Err(malformed);
            }
            let mut parts = Vec::with_capacity(count);
            for _ in 0..count {
                if body.len() < CARRIED_PART_FIXED_BYTES {
                    return Err(malformed);
                }
                let id_len = usize::from(body.get_u16_le());
                let _reserved = body.get_u16_le();
                let file_len = body.get_u32_le() as usize;
                if id_len > MAX_CARRIED_PARTITION_BYTES || body.len() < id_len + file_len {
                    return Err(malformed);
                }
                let partition_id = String::from_utf8(body.split_to(id_len).to_vec())
                    .map_err(|_| RecordError::Malformed("insert parts"))?;
                parts.push(CarriedPart {
                    partition_id,
                    file: body.split_to(file_len),
                });
            }
            if !body.is_empty() {
                return Err(malformed);
            }
            Record::InsertParts {
                table_id,
                shard,
                block_number,
                idempotency_key,
                parts,
            }
        }
        KIND_SHUTDOWN_CHECKPOINT => {
            if body.len() != 8 {
                return Err(RecordError::Malformed("shutdown checkpoint"));
            }
            Record::ShutdownCheckpoint {
                term: body.get_u64_le(),
            }
        }
        KIND_COMPACT => {
            if body.len() < 16 || body.len() > 16 + MAX_COMPACT_PARTITION_BYTES {
                return Err(RecordError::Malformed("compact"));
            }
            let table_id = body.get_u64_le();
            let target_rows = body.get_u64_le();
            let partition_id =
                String::from_utf8(body.to_vec()).map_err(|_| RecordError::Malformed("compact"))?;
            Record::Compact(Compaction {
                table_id,
                partition_id,
                target_rows,
            })
        }
        KIND_RETIRE => {
            let r: Retirement =
                postcard::from_bytes(&body).map_err(|_| RecordError::Malformed("retire"))?;
            if r.files.len() > MAX_RETIRED_FILES {
                return Err(RecordError::Malformed("retire"));
            }
            Record::Retire(r)
        }
        other => return Err(RecordError::UnknownKind(other)),
    };
    Ok((record, len))
}

/// Walks whole, valid records in `buf`, which starts at a record boundary at
/// `start`; returns the LSN just past the last valid record. Used after a crash to
/// find the real end of the WAL: whatever follows is torn or garbage.
pub fn end_of_valid_records(buf: &[u8], start: Lsn) -> Lsn {
    let mut at = 0;
    while let Ok(len) = check(&buf[at..]) {
        at += len;
    }
    Lsn(start.0 + at as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_tail_detection() {
        let mut buf = BytesMut::new();
        let a = Record::Insert {
            table_id: 7,
            shard: 3,
            block_number: 42,
            idempotency_key: Bytes::from_static(b"key-1"),
            arrow_ipc: Bytes::from_static(b"arrow bytes"),
        };
        let b = Record::ShutdownCheckpoint { term: 3 };
        let la = a.encode(&mut buf);
        let lb = b.encode(&mut buf);
        let c = Record::Retire(Retirement {
            table_id: 7,
            partition_id: "202406".into(),
            destination: "s3://lake/t".into(),
            format: "iceberg".into(),
            commit: "metadata/v3.metadata.json".into(),
            files: vec![RetiredFile {
                path: "data/x.parquet".into(),
                part: "202406_1_8_1".into(),
                shard: Some(1),
                rows: 10,
                bytes: 900,
                checksum: 77,
            }],
        });
        let mut one = BytesMut::new();
        let lc = c.encode(&mut one);
        assert_eq!(decode(&one.freeze()).expect("c"), (c, lc));
        let d = Record::Compact(Compaction {
            table_id: 7,
            partition_id: "2024-06-01".into(),
            target_rows: 1 << 20,
        });
        let bytes = d.to_bytes();
        assert_eq!(decode(&bytes).expect("d"), (d, bytes.len()));
        assert_eq!(la, Record::insert_len(5, 11));
        let all = buf.freeze();
        assert_eq!(decode(&all).expect("a"), (a, la));
        assert_eq!(decode(&all.slice(la..)).expect("b"), (b, lb));
        assert_eq!(
            end_of_valid_records(&all, Lsn(100)),
            Lsn(100 + (la + lb) as u64)
        );
        // Torn second record: the end is after the first.
        assert_eq!(
            end_of_valid_records(&all[..la + lb - 1], Lsn(0)),
            Lsn(la as u64)
        );
        // A flipped bit in the second record.
        let mut bad = all.to_vec();
        bad[la + 10] ^= 4;
        assert_eq!(end_of_valid_records(&bad, Lsn(0)), Lsn(la as u64));
        // Zeroes (a pre-allocated or never-written tail) are not a record.
        assert_eq!(end_of_valid_records(&[0u8; 64], Lsn(5)), Lsn(5));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            let bytes = Bytes::from(data);
            let _ = decode(&bytes);
            let end = end_of_valid_records(&bytes, Lsn(0));
            prop_assert!(end.0 as usize <= bytes.len());
        }

        #[test]
        fn inserts_round_trip(table in any::<u64>(), shard in any::<u32>(), block in any::<u64>(), key in proptest::collection::vec(any::<u8>(), 0..=MAX_IDEMPOTENCY_KEY_BYTES), rows in proptest::collection::vec(any::<u8>(), 0..300)) {
            let record = Record::Insert { table_id: table, shard, block_number: block, idempotency_key: Bytes::from(key), arrow_ipc: Bytes::from(rows) };
            let bytes = record.to_bytes();
            let (decoded, len) = decode(&bytes).expect("decode");
            prop_assert_eq!(len, bytes.len());
            prop_assert_eq!(decoded, record);
        }

        #[test]
        fn carried_parts_round_trip_and_every_cut_is_refused(
            block in any::<u64>(),
            key in proptest::collection::vec(any::<u8>(), 0..=40),
            parts in proptest::collection::vec(("[a-z0-9-]{1,12}", proptest::collection::vec(any::<u8>(), 0..60)), 0..5),
        ) {
            let parts: Vec<CarriedPart> = parts
                .into_iter()
                .map(|(id, file)| CarriedPart { partition_id: id, file: Bytes::from(file) })
                .collect();
            let record = Record::InsertParts { table_id: 9, shard: 2, block_number: block, idempotency_key: Bytes::from(key.clone()), parts: parts.clone() };
            let bytes = record.to_bytes();
            prop_assert_eq!(bytes.len(), Record::insert_parts_len(key.len(), &parts));
            let (decoded, len) = decode(&bytes).expect("decode");
            prop_assert_eq!(len, bytes.len());
            prop_assert_eq!(decoded, record);
        }
    }

    /// A body whose part lengths do not add up to the record is refused,
    /// whatever the checksum says (the record is re-sealed after each edit).
    #[test]
    fn carried_parts_that_do_not_fill_the_record_exactly_are_malformed() {
        let record = Record::InsertParts {
            table_id: 1,
            shard: 0,
            block_number: 7,
            idempotency_key: Bytes::new(),
            parts: vec![CarriedPart {
                partition_id: "2024-06-01".into(),
                file: Bytes::from_static(b"PAR1....PAR1"),
            }],
        };
        let good = record.to_bytes().to_vec();
        let reseal = |mut b: Vec<u8>| {
            let len = b.len() as u32;
            b[..4].copy_from_slice(&len.to_le_bytes());
            let crc = crc32c::crc32c(&b[8..]);
            b[4..8].copy_from_slice(&crc.to_le_bytes());
            Bytes::from(b)
        };
        // A file length one byte longer than what follows.
        let at = HEADER_BYTES + INSERT_FIXED_BYTES + 4;
        let mut long = good.clone();
        let n = u32::from_le_bytes(long[at..at + 4].try_into().expect("4")) + 1;
        long[at..at + 4].copy_from_slice(&n.to_le_bytes());
        assert_eq!(
            decode(&reseal(long)),
            Err(RecordError::Malformed("insert parts"))
        );
        // A trailing byte after the last part.
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(
            decode(&reseal(trailing)),
            Err(RecordError::Malformed("insert parts"))
        );
        // More parts announced than there are.
        let mut count = good.clone();
        count[HEADER_BYTES + 22] = 2;
        assert_eq!(
            decode(&reseal(count)),
            Err(RecordError::Malformed("insert parts"))
        );
        assert_eq!(decode(&reseal(good)).map(|(r, _)| r), Ok(record));
    }
}
