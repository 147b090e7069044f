//! Parts: immutable Parquet files of one partition of one table, named
//! `<partition_id>_<min_block>_<max_block>_<level>` (ClickHouse's convention).
//!
//! A part's bytes are a function of its rows alone (the same writer settings
//! everywhere, no timestamps), and so is its checksum: crc32c of the rows
//! encoded as an Arrow IPC stream. Two replicas that applied the same WAL hold
//! parts with the same names, rows, checksums and bytes.
//!
//! ferry's own metadata travels in the Parquet footer's key-value metadata
//! (`ferry.rows`, `ferry.min_lsn`, `ferry.max_lsn`, `ferry.checksum`,
//! `ferry.table_id`), so a part file describes itself.

use std::fmt;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use bytes::Bytes;
use ferry_wal::Lsn;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};

/// Rows per Parquet row group.
const ROW_GROUP_ROWS: usize = 128 * 1024;

/// A part's name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PartName {
    pub partition_id: String,
    pub min_block: u64,
    pub max_block: u64,
    pub level: u32,
}

impl fmt::Display for PartName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}_{}_{}_{}",
            self.partition_id, self.min_block, self.max_block, self.level
        )
    }
}

impl PartName {
    /// Parses a name; the partition id may itself hold underscores.
    pub fn parse(name: &str) -> Option<PartName> {
        let mut it = name.rsplitn(4, '_');
        let level = it.next()?.parse().ok()?;
        let max_block = it.next()?.parse().ok()?;
        let min_block = it.next()?.parse().ok()?;
        let partition_id = it.next()?.to_string();
        if partition_id.is_empty()
            || min_block > max_block
            || !ferry_table::keys::valid_partition_string(&partition_id)
                && !partition_id.starts_with('-')
        {
            return None;
        }
        Some(PartName {
            partition_id,
            min_block,
            max_block,
            level,
        })
    }

    /// Whether this part holds the rows of block `block`.
    pub fn covers(&self, block: u64) -> bool {
        (self.min_block..=self.max_block).contains(&block)
    }
}

/// What a part is, as its footer records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartMeta {
    pub name: PartName,
    pub table_id: u64,
    pub rows: u64,
    /// LSNs of the first and last insert records whose rows it holds.
    pub min_lsn: Lsn,
    pub max_lsn: Lsn,
    /// crc32c of the rows as an Arrow IPC stream.
    pub checksum: u32,
    /// Size of the Parquet file.
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PartError {
    #[error("encoding part {name}: {detail}")]
    Encode { name: String, detail: String },
    #[error("part file {name} is not a valid ferry part: {detail}")]
    Invalid { name: String, detail: String },
}

/// A `std::io::Write` that only computes crc32c of what passes through.
struct CrcWriter(u32);

impl std::io::Write for CrcWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 = crc32c::crc32c_append(self.0, buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Rows per batch of the checksum's canonical encoding.
const CHECKSUM_CHUNK_ROWS: usize = 8192;

/// The checksum of rows: crc32c of their Arrow IPC stream encoding in fresh
/// batches of [`CHECKSUM_CHUNK_ROWS`] rows, so it depends on the rows alone,
/// not on how they happen to be batched or sliced.
pub fn rows_checksum(
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<u32, arrow::error::ArrowError> {
    let mut w = arrow::ipc::writer::StreamWriter::try_new(CrcWriter(0), schema)?;
    let mut pending: Vec<RecordBatch> = Vec::new();
    let mut pending_rows = 0;
    let flush = |pending: &mut Vec<RecordBatch>,
                 w: &mut arrow::ipc::writer::StreamWriter<CrcWriter>| {
        let chunk = arrow::compute::concat_batches(schema, pending.iter())?;
        pending.clear();
        w.write(&chunk)
    };
    for b in batches {
        let mut at = 0;
        while at < b.num_rows() {
            let take = (CHECKSUM_CHUNK_ROWS - pending_rows).min(b.num_rows() - at);
            pending.push(b.slice(at, take));
            pending_rows += take;
            at += take;
            if pending_rows == CHECKSUM_CHUNK_ROWS {
                flush(&mut pending, &mut w)?;
                pending_rows = 0;
            }
        }
    }
    if pending_rows > 0 {
        flush(&mut pending, &mut w)?;
    }
    w.finish()?;
    Ok(w.into_inner()?.0)
}

fn properties(kv: Vec<KeyValue>) -> WriterProperties {
    WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(1).expect("valid level"),
        ))
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .set_created_by("ferry".into())
        .set_key_value_metadata(Some(kv))
        .build()
}

/// Encodes a part: the Parquet bytes and the part's metadata. CPU-heavy: run it
/// on the CPU seam.
pub fn encode(
    schema: &SchemaRef,
    name: &PartName,
    table_id: u64,
    batches: &[RecordBatch],
    lsns: (Lsn, Lsn),
) -> Result<(Bytes, PartMeta), PartError> {
    let err = |e: &dyn fmt::Display| PartError::Encode {
        name: name.to_string(),
        detail: e.to_string(),
    };
    let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
    let checksum = rows_checksum(schema, batches).map_err(|e| err(&e))?;
    let kv = vec![
        KeyValue::new("ferry.table_id".into(), table_id.to_string()),
        KeyValue::new("ferry.rows".into(), rows.to_string()),
        KeyValue::new("ferry.min_lsn".into(), lsns.0 .0.to_string()),
        KeyValue::new("ferry.max_lsn".into(), lsns.1 .0.to_string()),
        KeyValue::new("ferry.checksum".into(), checksum.to_string()),
    ];
    let mut out = Vec::new();
    let mut w = ArrowWriter::try_new(&mut out, Arc::clone(schema), Some(properties(kv)))
        .map_err(|e| err(&e))?;
    for b in batches {
        w.write(b).map_err(|e| err(&e))?;
    }
    w.close().map_err(|e| err(&e))?;
    let bytes = out.len() as u64;
    Ok((
        Bytes::from(out),
        PartMeta {
            name: name.clone(),
            table_id,
            rows,
            min_lsn: lsns.0,
            max_lsn: lsns.1,
            checksum,
            bytes,
        },
    ))
}

/// Reads a part file's metadata from its footer (and checks it names itself
/// consistently).
pub fn read_meta(name: &PartName, file: Bytes) -> Result<PartMeta, PartError> {
    let invalid = |detail: String| PartError::Invalid {
        name: name.to_string(),
        detail,
    };
    let bytes = file.len() as u64;
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| invalid(e.to_string()))?;
    let meta = builder.metadata().file_metadata();
    let kv = meta.key_value_metadata().cloned().unwrap_or_default();
    let get = |key: &str| -> Result<u64, PartError> {
        kv.iter()
            .find(|k| k.key == key)
            .and_then(|k| k.value.as_deref())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| invalid(format!("no {key} in the footer")))
    };
    let rows = get("ferry.rows")?;
    if rows != meta.num_rows() as u64 {
        return Err(invalid(format!(
            "footer says {rows} rows, the file holds {}",
            meta.num_rows()
        )));
    }
    Ok(PartMeta {
        name: name.clone(),
        table_id: get("ferry.table_id")?,
        rows,
        min_lsn: Lsn(get("ferry.min_lsn")?),
        max_lsn: Lsn(get("ferry.max_lsn")?),
        checksum: u32::try_from(get("ferry.checksum")?).map_err(|e| invalid(e.to_string()))?,
        bytes,
    })
}

/// Reads a part's rows.
pub fn read_rows(name: &PartName, file: Bytes) -> Result<Vec<RecordBatch>, PartError> {
    let invalid = |detail: String| PartError::Invalid {
        name: name.to_string(),
        detail,
    };
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| invalid(e.to_string()))?
        .build()
        .map_err(|e| invalid(e.to_string()))?;
    reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};

    #[test]
    fn names_round_trip_and_cover_their_blocks() {
        for name in ["202401_5_5_0", "a_b_10_20_1", "-5_0_7_2"] {
            let p = PartName::parse(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(p.to_string(), name);
        }
        let p = PartName::parse("x_10_20_1").expect("name");
        assert!(p.covers(10) && p.covers(20) && !p.covers(21));
        for bad in ["", "x_1_2", "x_3_2_0", "x_a_2_0", "../x_1_1_0", "_1_1_0"] {
            assert!(PartName::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn parts_are_a_function_of_their_rows() {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from_iter_values(0..1000))],
        )
        .expect("batch");
        let name = PartName::parse("p_1_1_0").expect("name");
        let (a, meta) = encode(
            &schema,
            &name,
            7,
            std::slice::from_ref(&batch),
            (Lsn(1), Lsn(1)),
        )
        .expect("encode");
        let (b, _) = encode(
            &schema,
            &name,
            7,
            std::slice::from_ref(&batch),
            (Lsn(1), Lsn(1)),
        )
        .expect("encode");
        assert_eq!(a, b, "same rows, same bytes");
        assert_eq!(read_meta(&name, a.clone()).expect("meta"), meta);
        assert_eq!(
            read_rows(&name, a.clone()).expect("rows"),
            vec![batch.clone()]
        );
        // Split differently, the same rows have the same checksum.
        let halves = [batch.slice(0, 500), batch.slice(500, 500)];
        let (_, meta2) = encode(&schema, &name, 7, &halves, (Lsn(1), Lsn(1))).expect("encode");
        assert_eq!(meta2.checksum, meta.checksum);
        let torn = a.slice(..a.len() - 10);
        assert!(read_meta(&name, torn).is_err(), "a torn file is not a part");
    }
}
