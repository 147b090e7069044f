//! Data files: a partition's rows as one Parquet file whose columns carry
//! the table's Iceberg field ids, and the statistics a manifest records of
//! it (rows, size, per column: bytes, values, nulls, lower and upper bounds
//! in Iceberg's single-value serialisation), taken from the footer metadata the writer wrote.

use arrow::array::RecordBatch;
use bytes::Bytes;
use ferry_storage::{Location, StorageError};
use ferry_table::def::ColumnType;
use ferry_table::TableDef;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use parquet::file::properties::WriterProperties;
use parquet::file::statistics::Statistics;

use crate::manifest::DataFileEntry;
use crate::table::{data_file_schema, PartitionValue};
use crate::IcebergError;

/// Rows per row group of a data file.
pub const ROW_GROUP_ROWS: usize = 1 << 20;

/// A data file, encoded, with its manifest entry (its path still to be set).
pub struct EncodedDataFile {
    pub bytes: Vec<u8>,
    pub entry: DataFileEntry,
}

fn parquet_error(e: parquet::errors::ParquetError) -> IcebergError {
    IcebergError::Parquet(e.to_string())
}

/// Encodes `batches` (rows of one partition, in the table's schema) as one
/// zstd Parquet file with field ids.
pub fn encode_data_file(
    def: &TableDef,
    partition: PartitionValue,
    batches: &[RecordBatch],
) -> Result<EncodedDataFile, IcebergError> {
    let schema = data_file_schema(def);
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .build();
    let mut writer =
        ArrowWriter::try_new(Vec::new(), schema.clone(), Some(props)).map_err(parquet_error)?;
    for b in batches {
        let b = b
            .clone()
            .with_schema(schema.clone())
            .map_err(|e| IcebergError::Table(format!("rows do not match the table: {e}")))?;
        writer.write(&b).map_err(parquet_error)?;
    }
    // The footer's metadata as the writer wrote it: the file is not read
    // back to find it.
    let metadata = writer.finish().map_err(parquet_error)?;
    let bytes = std::mem::take(writer.inner_mut());
    let entry = entry_from_footer(def, partition, &metadata, bytes.len())?;
    Ok(EncodedDataFile { bytes, entry })
}

/// Bytes fetched from the end of a file to find its footer at once.
const TAIL_BYTES: u64 = 64 << 10;

/// The footer metadata of the Parquet file `key` of `size` bytes (`Err`:
/// why it has none: too short, no footer, one that does not decode).
pub async fn read_footer(
    location: &Location,
    key: &str,
    size: u64,
) -> Result<Result<ParquetMetaData, String>, StorageError> {
    if size < 12 {
        return Ok(Err("too short for Parquet".into()));
    }
    let tail = location
        .get_range(key, size.saturating_sub(TAIL_BYTES)..size)
        .await?;
    let n = tail.len();
    // The object may have changed since its size was read.
    if n < 12 {
        return Ok(Err(format!(
            "{n} bytes read from the end of a {size}-byte file"
        )));
    }
    if &tail[n - 4..] != b"PAR1" {
        return Ok(Err("no Parquet footer".into()));
    }
    let footer_len = u64::from(u32::from_le_bytes([
        tail[n - 8],
        tail[n - 7],
        tail[n - 6],
        tail[n - 5],
    ]));
    if footer_len + 8 > size {
        return Ok(Err("footer longer than the file".into()));
    }
    let footer: Bytes = if footer_len + 8 <= n as u64 {
        tail.slice(n - 8 - footer_len as usize..n - 8)
    } else {
        location
            .get_range(key, size - 8 - footer_len..size - 8)
            .await?
    };
    Ok(ParquetMetaDataReader::decode_metadata(&footer)
        .map_err(|e| format!("footer does not decode: {e}")))
}

/// The manifest entry of a data file of `file_size` bytes (its path still
/// to be set), from its footer's metadata: as the writer returned it, or
/// as [`read_footer`] read it.
pub fn entry_from_footer(
    def: &TableDef,
    partition: PartitionValue,
    meta: &ParquetMetaData,
    file_size: usize,
) -> Result<DataFileEntry, IcebergError> {
    let n = def.columns.len();
    let mut sizes = vec![0i64; n];
    let mut values = vec![0i64; n];
    let mut nulls = vec![0i64; n];
    let mut lower: Vec<Option<Vec<u8>>> = vec![None; n];
    let mut upper: Vec<Option<Vec<u8>>> = vec![None; n];
    for rg in meta.row_groups() {
        for (i, col) in rg.columns().iter().enumerate().take(n) {
            sizes[i] += col.compressed_size();
            values[i] += col.num_values();
            let Some(st) = col.statistics() else { continue };
            nulls[i] += st.null_count_opt().map_or(0, |c| c as i64);
            let ty = def.columns[i].column_type;
            if let (Some(lo), Some(hi)) = (bound(ty, st, true), bound(ty, st, false)) {
                lower[i] = Some(match lower[i].take() {
                    Some(old) if less(ty, &old, &lo) => old,
                    _ => lo,
                });
                upper[i] = Some(match upper[i].take() {
                    Some(old) if less(ty, &hi, &old) => old,
                    _ => hi,
                });
            }
        }
    }
    let id = |i: usize| i32::try_from(i + 1).unwrap_or(i32::MAX);
    Ok(DataFileEntry {
        path: String::new(),
        record_count: meta.file_metadata().num_rows(),
        file_size_in_bytes: file_size as i64,
        partition,
        column_sizes: sizes.iter().enumerate().map(|(i, v)| (id(i), *v)).collect(),
        value_counts: values
            .iter()
            .enumerate()
            .map(|(i, v)| (id(i), *v))
            .collect(),
        null_value_counts: nulls.iter().enumerate().map(|(i, v)| (id(i), *v)).collect(),
        lower_bounds: lower
            .into_iter()
            .enumerate()
            .filter_map(|(i, b)| b.map(|b| (id(i), b)))
            .collect(),
        upper_bounds: upper
            .into_iter()
            .enumerate()
            .filter_map(|(i, b)| b.map(|b| (id(i), b)))
            .collect(),
    })
}

/// A column chunk's lower (`min`) or upper bound, serialised as Iceberg
/// does: little-endian ints and longs (dates as days, timestamps as
/// microseconds), IEEE doubles, one byte for booleans, UTF-8 for strings.
/// Doubles with a NaN bound are left out (Iceberg keeps NaN apart).
fn bound(ty: ColumnType, st: &Statistics, min: bool) -> Option<Vec<u8>> {
    match (ty, st) {
        (ColumnType::Int32 | ColumnType::Date, Statistics::Int32(s)) => {
            let v = if min { s.min_opt()? } else { s.max_opt()? };
            Some(v.to_le_bytes().to_vec())
        }
        (ColumnType::Int64 | ColumnType::Timestamp, Statistics::Int64(s)) => {
            let v = if min { s.min_opt()? } else { s.max_opt()? };
            Some(v.to_le_bytes().to_vec())
        }
        (ColumnType::Float64, Statistics::Double(s)) => {
            let v = if min { s.min_opt()? } else { s.max_opt()? };
            (!v.is_nan()).then(|| v.to_le_bytes().to_vec())
        }
        (ColumnType::Boolean, Statistics::Boolean(s)) => {
            let v = if min { s.min_opt()? } else { s.max_opt()? };
            Some(vec![u8::from(*v)])
        }
        (ColumnType::Utf8, Statistics::ByteArray(s)) => {
            let v = if min { s.min_opt()? } else { s.max_opt()? };
            // Truncated statistics are not exact bounds: left out.
            let exact = if min {
                s.min_is_exact()
            } else {
                s.max_is_exact()
            };
            exact.then(|| v.data().to_vec())
        }
        _ => None,
    }
}

/// Whether bound `a` is below bound `b` for a column of type `ty`.
fn less(ty: ColumnType, a: &[u8], b: &[u8]) -> bool {
    fn arr<const N: usize>(x: &[u8]) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&x[..N.min(x.len())]);
        out
    }
    match ty {
        ColumnType::Int32 | ColumnType::Date => {
            i32::from_le_bytes(arr::<4>(a)) < i32::from_le_bytes(arr::<4>(b))
        }
        ColumnType::Int64 | ColumnType::Timestamp => {
            i64::from_le_bytes(arr::<8>(a)) < i64::from_le_bytes(arr::<8>(b))
        }
        ColumnType::Float64 => f64::from_le_bytes(arr::<8>(a)) < f64::from_le_bytes(arr::<8>(b)),
        ColumnType::Boolean | ColumnType::Utf8 => a < b,
    }
}

/// The footer (metadata, its length and the magic) of a Parquet file of the
/// table whose data pages are `metadata`'s file's, with each column's
/// Iceberg field id set: a part written by a replica becomes a data file of
/// the table by copying its bytes up to its footer and appending this one
/// (the pages, their offsets and the statistics are unchanged).
pub fn footer_with_field_ids(
    def: &TableDef,
    metadata: &ParquetMetaData,
) -> Result<Vec<u8>, IcebergError> {
    use parquet::file::metadata::{FileMetaData, ParquetMetaDataWriter};
    use parquet::schema::types::{SchemaDescriptor, Type};
    use std::sync::Arc;

    let file = metadata.file_metadata();
    let root = file.schema();
    let fields = root.get_fields();
    let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
    let want: Vec<&str> = def.columns.iter().map(|c| c.name.as_str()).collect();
    if names != want {
        return Err(IcebergError::Table(format!(
            "a file with columns {names:?} is not of table {}'s {want:?}",
            def.name
        )));
    }
    let mut with_ids = Vec::with_capacity(fields.len());
    for (i, field) in fields.iter().enumerate() {
        let Type::PrimitiveType {
            basic_info,
            physical_type,
            type_length,
            scale,
            precision,
        } = field.as_ref()
        else {
            return Err(IcebergError::Table(format!(
                "column {} is not a primitive column",
                field.name()
            )));
        };
        let id = i32::try_from(i + 1).unwrap_or(i32::MAX);
        let typed = Type::primitive_type_builder(basic_info.name(), *physical_type)
            .with_repetition(basic_info.repetition())
            .with_converted_type(basic_info.converted_type())
            .with_logical_type(basic_info.logical_type_ref().cloned())
            .with_length(*type_length)
            .with_precision(*precision)
            .with_scale(*scale)
            .with_id(Some(id))
            .build()
            .map_err(parquet_error)?;
        with_ids.push(Arc::new(typed));
    }
    let root = Type::group_type_builder(root.name())
        .with_fields(with_ids)
        .build()
        .map_err(parquet_error)?;
    let file_metadata = FileMetaData::new(
        file.version(),
        file.num_rows(),
        file.created_by().map(str::to_string),
        file.key_value_metadata().cloned(),
        Arc::new(SchemaDescriptor::new(Arc::new(root))),
        file.column_orders().cloned(),
    );
    let rewritten = ParquetMetaData::new(file_metadata, metadata.row_groups().to_vec());
    let mut out = Vec::new();
    ParquetMetaDataWriter::new(&mut out, &rewritten)
        .finish()
        .map_err(parquet_error)?;
    Ok(out)
}
