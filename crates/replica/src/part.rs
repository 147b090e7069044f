//! Parts: immutable Parquet files of one partition of one table, named
//! `<partition_id>_<min_block>_<max_block>_<level>` (ClickHouse's convention).
//!
//! A part's bytes are a function of its rows alone (the same writer settings
//! everywhere, no timestamps), and so is its checksum (see [`crate::checksum`]).
//! Two replicas that applied the same WAL hold
//! parts with the same names, rows, checksums and bytes.
//!
//! ferry's own metadata travels in the Parquet footer's key-value metadata
//! (`ferry.rows`, `ferry.min_lsn`, `ferry.max_lsn`, `ferry.checksum`,
//! `ferry.table_id`), so a part file describes itself. A level-0 part the
//! ingest node encoded for the WAL ([`encode_carried`]) has no LSN keys:
//! its LSN was not known yet, and it is its name's block number.

use std::fmt;
use std::sync::Arc;

use arrow::array::{Array, RecordBatch};
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
/// Rows per row group of parts.
pub const ROW_GROUP_ROWS: usize = 128 * 1024;

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
    /// The shard whose rows it holds, set where a snapshot lists the part
    /// (`None`: a replica of every shard, whose parts mix them). Block
    /// ranges of one shard's parts nest or are disjoint; those of two
    /// shards may interleave.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    /// Set where a snapshot lists a lake file holding rows retention
    /// dropped from the replicas: no replica holds it; an export carries it
    /// from the lake's current commit.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retired: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum PartError {
    #[error("encoding part {name}: {detail}")]
    Encode { name: String, detail: String },
    #[error("part file {name} is not a valid ferry part: {detail}")]
    Invalid { name: String, detail: String },
    #[error("reading part file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub use crate::checksum::{rows_checksum, RowsChecksum};

/// How a file's rows are laid out: parts use [`FileLayout::default`];
/// exports may ask for another compression or row-group size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileLayout {
    pub compression: Compression,
    pub row_group_rows: usize,
}

impl Default for FileLayout {
    fn default() -> Self {
        FileLayout {
            compression: Compression::ZSTD(ZstdLevel::try_new(1).expect("valid level")),
            row_group_rows: ROW_GROUP_ROWS,
        }
    }
}

/// Dictionary encoding for string and binary columns only: it is what
/// shrinks their repeated values, while for numbers and timestamps zstd
/// does as well on plain values and the dictionary only costs a hash of
/// every value (the largest share of a part's encoding after zstd).
///
/// `repetitive`, when given, names the string columns worth a dictionary
/// (see [`repetitive_strings`]); otherwise every string column gets one.
fn properties(
    schema: &SchemaRef,
    kv: Vec<KeyValue>,
    layout: FileLayout,
    repetitive: Option<&[bool]>,
) -> WriterProperties {
    use arrow::datatypes::DataType;
    let mut b = WriterProperties::builder()
        .set_compression(layout.compression)
        .set_max_row_group_row_count(Some(layout.row_group_rows.max(1)))
        .set_created_by("ferry".into())
        .set_key_value_metadata(Some(kv))
        .set_dictionary_enabled(false);
    for (i, field) in schema.fields().iter().enumerate() {
        if repetitive.is_some_and(|r| !r.get(i).copied().unwrap_or(true)) {
            continue;
        }
        if matches!(
            field.data_type(),
            DataType::Utf8
                | DataType::LargeUtf8
                | DataType::Utf8View
                | DataType::Binary
                | DataType::LargeBinary
                | DataType::BinaryView
        ) {
            b = b.set_column_dictionary_enabled(
                parquet::schema::types::ColumnPath::from(field.name().as_str()),
                true,
            );
        }
    }
    b.build()
}

/// zstd level of carried parts (see [`encode_carried`]): encoded on the
/// insert path, where zstd is the largest share of the CPU. On the
/// benchmark's rows (`ferry bench ingest`, 1 M rows of 10 columns) level -1
/// encodes in 0.248 s to 10.2 MB, level 1 in 0.262 s to 10.8 MB, level -3
/// in 0.244 s to 18.9 MB (more bytes through every WAL copy), LZ4 in 0.181 s
/// to 27.4 MB. Readers read every level alike.
pub const CARRIED_ZSTD_LEVEL: i32 = -1;

/// Values sampled per string column to judge its repetition.
const DICTIONARY_SAMPLE_ROWS: usize = 1024;

/// Per column, whether a dictionary pays for it: false for a string column
/// whose values, sampled evenly, are mostly distinct (ids, free text), where
/// the dictionary only hashes every value before Parquet gives it up at its
/// size limit; true otherwise. A function of the rows alone.
pub fn repetitive_strings(batch: &RecordBatch) -> Vec<bool> {
    use arrow::array::AsArray;
    use arrow::datatypes::DataType;
    let n = batch.num_rows();
    let step = n.div_ceil(DICTIONARY_SAMPLE_ROWS).max(1);
    batch
        .columns()
        .iter()
        .map(|column| {
            let mut seen = std::collections::HashSet::new();
            let mut sampled = 0usize;
            let mut sample = |value: Option<&[u8]>| {
                if let Some(v) = value {
                    sampled += 1;
                    seen.insert(v.to_vec());
                }
            };
            match column.data_type() {
                DataType::Utf8 => {
                    let a = column.as_string::<i32>();
                    (0..n)
                        .step_by(step)
                        .for_each(|i| sample(a.is_valid(i).then(|| a.value(i).as_bytes())));
                }
                DataType::LargeUtf8 => {
                    let a = column.as_string::<i64>();
                    (0..n)
                        .step_by(step)
                        .for_each(|i| sample(a.is_valid(i).then(|| a.value(i).as_bytes())));
                }
                DataType::Binary => {
                    let a = column.as_binary::<i32>();
                    (0..n)
                        .step_by(step)
                        .for_each(|i| sample(a.is_valid(i).then(|| a.value(i))));
                }
                _ => return true,
            }
            seen.len() * 2 <= sampled
        })
        .collect()
}

/// Encodes a part from rows fed a batch at a time, handing out the file's
/// bytes as they are encoded, so a part of any size is written holding at most
/// one row group. Pure CPU work: run each call on the CPU seam.
///
/// The bytes are a function of the rows and of how they are batched: callers
/// that must agree (replicas of a shard) feed the same batches.
pub struct PartEncoder {
    name: PartName,
    table_id: u64,
    /// `None`: a part encoded before its record had an LSN ([`encode_carried`]).
    lsns: Option<(Lsn, Lsn)>,
    writer: ArrowWriter<Vec<u8>>,
    checksum: RowsChecksum,
    rows: u64,
    bytes: u64,
}

impl PartEncoder {
    pub fn new(
        schema: &SchemaRef,
        name: &PartName,
        table_id: u64,
        lsns: (Lsn, Lsn),
    ) -> Result<PartEncoder, PartError> {
        PartEncoder::with_layout(schema, name, table_id, lsns, FileLayout::default())
    }

    /// An encoder of the same rows and footer in another layout (an export
    /// that asked for other compression or row groups).
    pub fn with_layout(
        schema: &SchemaRef,
        name: &PartName,
        table_id: u64,
        lsns: (Lsn, Lsn),
        layout: FileLayout,
    ) -> Result<PartEncoder, PartError> {
        PartEncoder::build(schema, name, table_id, Some(lsns), layout, None)
    }

    fn build(
        schema: &SchemaRef,
        name: &PartName,
        table_id: u64,
        lsns: Option<(Lsn, Lsn)>,
        layout: FileLayout,
        repetitive: Option<&[bool]>,
    ) -> Result<PartEncoder, PartError> {
        let err = |e: &dyn fmt::Display| encode_error(name, e);
        let mut kv = vec![KeyValue::new("ferry.table_id".into(), table_id.to_string())];
        if let Some((min, max)) = lsns {
            kv.push(KeyValue::new("ferry.min_lsn".into(), min.0.to_string()));
            kv.push(KeyValue::new("ferry.max_lsn".into(), max.0.to_string()));
        }
        Ok(PartEncoder {
            name: name.clone(),
            table_id,
            lsns,
            writer: ArrowWriter::try_new(
                Vec::new(),
                Arc::clone(schema),
                Some(properties(schema, kv, layout, repetitive)),
            )
            .map_err(|e| err(&e))?,
            checksum: RowsChecksum::new(schema).map_err(|e| err(&e))?,
            rows: 0,
            bytes: 0,
        })
    }

    /// Encodes `batch`; returns the file's bytes that follow those returned
    /// before (often none: a row group is written when full).
    pub fn write(&mut self, batch: &RecordBatch) -> Result<Vec<u8>, PartError> {
        let name = &self.name;
        self.checksum
            .push(batch)
            .map_err(|e| encode_error(name, e))?;
        self.writer
            .write(batch)
            .map_err(|e| encode_error(name, e))?;
        self.rows += batch.num_rows() as u64;
        Ok(self.take_output())
    }

    fn take_output(&mut self) -> Vec<u8> {
        take_output(&mut self.writer, &mut self.bytes)
    }

    /// Writes the footer (with the rows and checksum); returns the file's last
    /// bytes and the part's metadata.
    pub fn finish(self) -> Result<(Vec<u8>, PartMeta), PartError> {
        self.finish_with_footer().map(|(out, meta, _)| (out, meta))
    }

    /// [`PartEncoder::finish`], with the footer's metadata as written (the
    /// column statistics a table format's manifests record, without
    /// reading the file back).
    pub fn finish_with_footer(
        self,
    ) -> Result<(Vec<u8>, PartMeta, parquet::file::metadata::ParquetMetaData), PartError> {
        let PartEncoder {
            name,
            table_id,
            lsns,
            mut writer,
            checksum,
            rows,
            mut bytes,
        } = self;
        let checksum = checksum.finish().map_err(|e| encode_error(&name, e))?;
        writer.append_key_value_metadata(KeyValue::new("ferry.rows".into(), rows.to_string()));
        writer.append_key_value_metadata(KeyValue::new(
            "ferry.checksum".into(),
            checksum.to_string(),
        ));
        let footer = writer.finish().map_err(|e| encode_error(&name, e))?;
        let out = take_output(&mut writer, &mut bytes);
        let lsns = lsns.unwrap_or((Lsn(name.min_block), Lsn(name.max_block)));
        Ok((
            out,
            PartMeta {
                name,
                table_id,
                rows,
                min_lsn: lsns.0,
                max_lsn: lsns.1,
                checksum,
                bytes,
                shard: None,
                retired: false,
            },
            footer,
        ))
    }
}

fn take_output(writer: &mut ArrowWriter<Vec<u8>>, written: &mut u64) -> Vec<u8> {
    let out = std::mem::take(writer.inner_mut());
    *written += out.len() as u64;
    out
}

fn encode_error(name: &PartName, e: impl fmt::Display) -> PartError {
    PartError::Encode {
        name: name.to_string(),
        detail: e.to_string(),
    }
}

/// Encodes a part held in memory whole: the Parquet bytes and the part's
/// metadata. CPU-heavy: run it on the CPU seam.
pub fn encode(
    schema: &SchemaRef,
    name: &PartName,
    table_id: u64,
    batches: &[RecordBatch],
    lsns: (Lsn, Lsn),
) -> Result<(Bytes, PartMeta), PartError> {
    let mut enc = PartEncoder::new(schema, name, table_id, lsns)?;
    let mut out = Vec::new();
    for b in batches {
        out.extend(enc.write(b)?);
    }
    let (tail, meta) = enc.finish()?;
    if out.is_empty() {
        out = tail;
    } else {
        out.extend(tail);
    }
    Ok((Bytes::from(out), meta))
}

/// Encodes the rows of one partition of one insert as the part file every
/// replica will write under the insert record's block number: the ingest node
/// encodes it once, before the record has an LSN, so its footer has none (see
/// [`meta_from_footer`]). Returns the file and its rows checksum. CPU-heavy:
/// run it on the CPU seam.
pub fn encode_carried(
    schema: &SchemaRef,
    partition_id: &str,
    table_id: u64,
    batch: &RecordBatch,
) -> Result<(Bytes, u32), PartError> {
    let name = PartName {
        partition_id: partition_id.to_string(),
        min_block: 0,
        max_block: 0,
        level: 0,
    };
    let repetitive = repetitive_strings(batch);
    let mut enc = PartEncoder::build(
        schema,
        &name,
        table_id,
        None,
        FileLayout {
            compression: Compression::ZSTD(
                ZstdLevel::try_new(CARRIED_ZSTD_LEVEL).expect("a valid level"),
            ),
            ..FileLayout::default()
        },
        Some(&repetitive),
    )?;
    let mut out = enc.write(batch)?;
    let (tail, meta) = enc.finish()?;
    out.extend(tail);
    Ok((Bytes::from(out), meta.checksum))
}

/// The rows of one insert record as the part files every replica writes:
/// split by partition (ids in order) and encoded once (see
/// [`encode_carried`]).
pub fn carry(
    def: &ferry_table::TableDef,
    table_id: u64,
    rows: &RecordBatch,
) -> Result<Vec<ferry_wal::record::CarriedPart>, PartError> {
    let schema = def.arrow_schema();
    ferry_table::rows::split_by_partition(def, rows)
        .map_err(|detail| PartError::Encode {
            name: format!("rows of table {table_id}"),
            detail,
        })?
        .into_iter()
        .map(|(partition_id, batch)| {
            let (file, _checksum) = encode_carried(&schema, &partition_id, table_id, &batch)?;
            Ok(ferry_wal::record::CarriedPart { partition_id, file })
        })
        .collect()
}

/// Checks a part file an insert record carries against the table it is
/// applied to, and names it: a Parquet footer that decodes, the table's
/// columns, the table's id, at least one row, a rows checksum, no LSN of
/// its own (the record's LSN is its block), and every row group's smallest
/// and largest partition value (its statistics) in the part's partition,
/// no null among them: the partition transforms keep order, so every row
/// is. The rows themselves are not decoded again (the record's checksum
/// covers the bytes the ingest node encoded): the footer only.
pub fn check_carried(
    def: &ferry_table::TableDef,
    name: &PartName,
    table_id: u64,
    schema: &SchemaRef,
    file: &Bytes,
) -> Result<PartMeta, PartError> {
    let invalid = |detail: String| PartError::Invalid {
        name: name.to_string(),
        detail,
    };
    let metadata = parquet::file::metadata::ParquetMetaDataReader::new()
        .parse_and_finish(file)
        .map_err(|e| invalid(e.to_string()))?;
    let meta = meta_from_footer(name, file.len() as u64, &metadata)?;
    let kv = metadata.file_metadata().key_value_metadata();
    if kv.is_some_and(|kv| {
        kv.iter()
            .any(|k| k.key == "ferry.min_lsn" || k.key == "ferry.max_lsn")
    }) {
        return Err(invalid("a carried part names LSNs of its own".into()));
    }
    if meta.table_id != table_id {
        return Err(invalid(format!(
            "the footer names table {}, the record table {table_id}",
            meta.table_id
        )));
    }
    if meta.rows == 0 {
        return Err(invalid("no rows".into()));
    }
    let columns =
        parquet::arrow::parquet_to_arrow_schema(metadata.file_metadata().schema_descr(), kv)
            .map_err(|e| invalid(e.to_string()))?;
    if columns.fields() != schema.fields() {
        return Err(invalid(format!(
            "columns {:?} are not the table's {:?}",
            columns.fields(),
            schema.fields()
        )));
    }
    let stats = parquet::arrow::arrow_reader::statistics::StatisticsConverter::try_new(
        &def.partition_by.column,
        schema,
        metadata.file_metadata().schema_descr(),
    )
    .map_err(|e| invalid(e.to_string()))?;
    let groups = metadata.row_groups();
    let nulls = stats
        .row_group_null_counts(groups.iter())
        .map_err(|e| invalid(e.to_string()))?;
    if nulls.null_count() > 0 || nulls.values().iter().any(|&n| n > 0) {
        return Err(invalid(
            "partition values null or without statistics".into(),
        ));
    }
    let ends = [
        stats.row_group_mins(groups.iter()),
        stats.row_group_maxes(groups.iter()),
    ];
    for end in ends {
        let end = end.map_err(|e| invalid(e.to_string()))?;
        if end.null_count() > 0 {
            return Err(invalid("partition values without statistics".into()));
        }
        let mut outside = None;
        ferry_table::keys::for_each_partition_id(def, &end, |_, id| {
            if id != name.partition_id && outside.is_none() {
                outside = Some(id.to_string());
            }
        })
        .map_err(|(_, e)| invalid(e))?;
        if let Some(id) = outside {
            return Err(invalid(format!(
                "holds rows of partition {id}, not of {}",
                name.partition_id
            )));
        }
    }
    Ok(meta)
}

/// Reads a part file's metadata from its footer (and checks it names itself
/// consistently).
pub fn read_meta(name: &PartName, file: Bytes) -> Result<PartMeta, PartError> {
    let bytes = file.len() as u64;
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| PartError::Invalid {
            name: name.to_string(),
            detail: e.to_string(),
        })?;
    meta_from_footer(name, bytes, builder.metadata())
}

pub fn meta_from_footer(
    name: &PartName,
    bytes: u64,
    metadata: &parquet::file::metadata::ParquetMetaData,
) -> Result<PartMeta, PartError> {
    let invalid = |detail: String| PartError::Invalid {
        name: name.to_string(),
        detail,
    };
    let meta = metadata.file_metadata();
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
    // A carried part (see `encode_carried`) has no LSN keys: a level-0 part's
    // LSN is its block number.
    let has = |key: &str| kv.iter().any(|k| k.key == key);
    let (min_lsn, max_lsn) = if !has("ferry.min_lsn") && !has("ferry.max_lsn") && name.level == 0 {
        (Lsn(name.min_block), Lsn(name.max_block))
    } else {
        (Lsn(get("ferry.min_lsn")?), Lsn(get("ferry.max_lsn")?))
    };
    Ok(PartMeta {
        name: name.clone(),
        table_id: get("ferry.table_id")?,
        rows,
        min_lsn,
        max_lsn,
        checksum: u32::try_from(get("ferry.checksum")?).map_err(|e| invalid(e.to_string()))?,
        bytes,
        shard: None,
        retired: false,
    })
}

/// Rows read back per batch.
const READ_BATCH_ROWS: usize = 8192;

/// Reads a part file a row group at a time through the disk seam: the footer
/// on open, then the column chunks of one row group per
/// [`next_row_group`](Self::next_row_group), so reading a part of any size
/// holds at most one row group.
pub struct PartReader {
    name: PartName,
    path: String,
    file: Box<dyn ferry_env::DiskFile>,
    meta: PartMeta,
    schema: SchemaRef,
    decoder: parquet::arrow::push_decoder::ParquetPushDecoder,
}

impl PartReader {
    /// Opens a part and reads its footer (checked as [`read_meta`] does).
    pub async fn open(
        disk: &dyn ferry_env::Disk,
        path: &str,
        name: &PartName,
    ) -> Result<PartReader, PartError> {
        let io = |source| PartError::Io {
            path: path.to_string(),
            source,
        };
        let invalid = |detail: String| PartError::Invalid {
            name: name.to_string(),
            detail,
        };
        let file = disk.open(path).await.map_err(io)?;
        let len = file.size().await.map_err(io)?;
        let mut footer = parquet::file::metadata::ParquetMetaDataPushDecoder::try_new(len)
            .map_err(|e| invalid(e.to_string()))?;
        let metadata = loop {
            match footer.try_decode().map_err(|e| invalid(e.to_string()))? {
                parquet::DecodeResult::NeedsData(ranges) => {
                    let (ranges, data) = fetch(file.as_ref(), len, ranges).await.map_err(io)?;
                    footer
                        .push_ranges(ranges, data)
                        .map_err(|e| invalid(e.to_string()))?;
                }
                parquet::DecodeResult::Data(m) => break Arc::new(m),
                parquet::DecodeResult::Finished => {
                    return Err(invalid("the file has no footer".into()))
                }
            }
        };
        let meta = meta_from_footer(name, len, &metadata)?;
        let arrow = parquet::arrow::arrow_reader::ArrowReaderMetadata::try_new(
            Arc::clone(&metadata),
            Default::default(),
        )
        .map_err(|e| invalid(e.to_string()))?;
        let schema = Arc::clone(arrow.schema());
        let decoder =
            parquet::arrow::push_decoder::ParquetPushDecoderBuilder::new_with_metadata(arrow)
                .with_batch_size(READ_BATCH_ROWS)
                .build()
                .map_err(|e| invalid(e.to_string()))?;
        Ok(PartReader {
            name: name.clone(),
            path: path.to_string(),
            file,
            meta,
            schema,
            decoder,
        })
    }

    /// The part's metadata, from its footer.
    pub fn meta(&self) -> &PartMeta {
        &self.meta
    }

    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Reads the next row group's bytes; the returned reader decodes them
    /// (CPU work: iterate it on the CPU seam). `None` after the last one.
    pub async fn next_row_group(
        &mut self,
    ) -> Result<Option<parquet::arrow::arrow_reader::ParquetRecordBatchReader>, PartError> {
        loop {
            let step = self
                .decoder
                .try_next_reader()
                .map_err(|e| self.invalid(e.to_string()))?;
            match step {
                parquet::DecodeResult::NeedsData(ranges) => {
                    let (ranges, data) = fetch(self.file.as_ref(), self.meta.bytes, ranges)
                        .await
                        .map_err(|source| PartError::Io {
                        path: self.path.clone(),
                        source,
                    })?;
                    self.decoder
                        .push_ranges(ranges, data)
                        .map_err(|e| self.invalid(e.to_string()))?;
                }
                parquet::DecodeResult::Data(reader) => return Ok(Some(reader)),
                parquet::DecodeResult::Finished => return Ok(None),
            }
        }
    }

    fn invalid(&self, detail: String) -> PartError {
        PartError::Invalid {
            name: self.name.to_string(),
            detail,
        }
    }
}

/// Checks the rows read from a part against its footer: Parquet as ferry
/// writes it has no checksum of its own, and a damaged byte can change values
/// without making the file unreadable. Feed it every batch read, in order;
/// [`finish`](Self::finish) compares the row count and the rows checksum.
pub struct PartCheck {
    sum: RowsChecksum,
    rows: u64,
}

impl PartCheck {
    pub fn new(reader: &PartReader) -> Result<PartCheck, PartError> {
        Ok(PartCheck {
            sum: RowsChecksum::new(reader.schema()).map_err(|e| reader.invalid(e.to_string()))?,
            rows: 0,
        })
    }

    pub fn push(&mut self, name: &PartName, batch: &RecordBatch) -> Result<(), PartError> {
        self.rows += batch.num_rows() as u64;
        self.sum.push(batch).map_err(|e| PartError::Invalid {
            name: name.to_string(),
            detail: e.to_string(),
        })
    }

    /// Whether the rows read are the rows the footer describes.
    pub fn finish(self, meta: &PartMeta) -> Result<(), PartError> {
        let invalid = |detail: String| PartError::Invalid {
            name: meta.name.to_string(),
            detail,
        };
        let sum = self.sum.finish().map_err(|e| invalid(e.to_string()))?;
        if self.rows != meta.rows || sum != meta.checksum {
            return Err(invalid(format!(
                "the rows read ({} rows, checksum {sum}) are not the rows its footer describes ({} rows, checksum {}): the file is damaged",
                self.rows, meta.rows, meta.checksum
            )));
        }
        Ok(())
    }
}

/// Reads the byte ranges a decoder asks for, in file order, adjacent or
/// overlapping ones in one read (a row group's column chunks are one read).
/// Returns them sorted, as pairs for `push_ranges`: the order a decoder lists
/// ranges in is not specified, and reads in a varying order would make a run
/// under the simulator depend on more than its seed.
///
/// A range past the end of the file (`file_len` bytes), which only a damaged
/// footer can name, is an error before anything is allocated for it.
async fn fetch(
    file: &dyn ferry_env::DiskFile,
    file_len: u64,
    ranges: Vec<std::ops::Range<u64>>,
) -> std::io::Result<(Vec<std::ops::Range<u64>>, Vec<Bytes>)> {
    let mut ranges = ranges;
    if let Some(bad) = ranges.iter().find(|r| r.start > r.end || r.end > file_len) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the footer names bytes {bad:?} of a {file_len}-byte file"),
        ));
    }
    ranges.sort_by_key(|r| (r.start, r.end));
    let mut data = Vec::with_capacity(ranges.len());
    let mut i = 0;
    while i < ranges.len() {
        let start = ranges[i].start;
        let mut end = ranges[i].end;
        let mut j = i + 1;
        while j < ranges.len() && ranges[j].start <= end {
            end = end.max(ranges[j].end);
            j += 1;
        }
        let len = usize::try_from(end.saturating_sub(start))
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let read = Bytes::from(file.read_at(start, len).await?);
        for r in &ranges[i..j] {
            data.push(read.slice((r.start - start) as usize..(r.end - start) as usize));
        }
        i = j;
    }
    Ok((ranges, data))
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

/// Checks a part file's footer describes the part `expected` describes
/// (its rows are not read).
pub async fn check_footer(
    disk: &dyn ferry_env::Disk,
    path: &str,
    expected: &PartMeta,
) -> Result<(), PartError> {
    footer_is(disk, path, expected).await.map(drop)
}

async fn footer_is(
    disk: &dyn ferry_env::Disk,
    path: &str,
    expected: &PartMeta,
) -> Result<PartReader, PartError> {
    let reader = PartReader::open(disk, path, &expected.name).await?;
    let mut footer = reader.meta().clone();
    footer.shard = expected.shard;
    if &footer != expected {
        return Err(reader.invalid(format!(
            "its footer describes {footer:?}, expected {expected:?}"
        )));
    }
    Ok(reader)
}

/// Reads a whole part file and checks it is the part `expected` describes:
/// its footer the same metadata, and its rows (decoded on `cpu`) the rows
/// that footer's checksum and count describe. A copy of a part checked this
/// way is the part, whatever carried its bytes.
pub async fn check_file(
    disk: &dyn ferry_env::Disk,
    path: &str,
    expected: &PartMeta,
    cpu: ferry_env::Cpu,
) -> Result<(), PartError> {
    let mut reader = footer_is(disk, path, expected).await?;
    let mut check = PartCheck::new(&reader)?;
    while let Some(group) = reader.next_row_group().await? {
        let name = expected.name.clone();
        check = cpu
            .run(move || {
                for batch in group {
                    let batch = batch.map_err(|e| PartError::Invalid {
                        name: name.to_string(),
                        detail: e.to_string(),
                    })?;
                    check.push(&name, &batch)?;
                }
                Ok::<_, PartError>(check)
            })
            .await?;
    }
    check.finish(expected)
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

    /// Strings carry a dictionary, numbers are plain: the choice is part of
    /// the file format replicas agree on byte for byte.
    #[test]
    fn only_string_columns_are_dictionary_encoded() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
        ]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values((0..1000).map(|i| i % 7))),
                Arc::new(arrow::array::StringArray::from_iter_values(
                    (0..1000).map(|i| format!("v{}", i % 7)),
                )),
            ],
        )
        .expect("batch");
        let name = PartName::parse("p_1_1_0").expect("name");
        let (file, _) = encode(
            &schema,
            &name,
            7,
            std::slice::from_ref(&batch),
            (Lsn(1), Lsn(1)),
        )
        .expect("encode");
        let dict = dictionary_columns(&file);
        assert!(!dict[0], "numbers plain");
        assert!(dict[1], "strings with a dictionary");
        assert_eq!(read_rows(&name, file).expect("rows"), vec![batch]);
    }

    /// Per column of the file's first row group, whether it is dictionary encoded.
    fn dictionary_columns(file: &Bytes) -> Vec<bool> {
        use parquet::basic::Encoding;
        let reader = ParquetRecordBatchReaderBuilder::try_new(file.clone()).expect("reader");
        reader
            .metadata()
            .row_group(0)
            .columns()
            .iter()
            .map(|c| {
                c.encodings()
                    .any(|e| matches!(e, Encoding::RLE_DICTIONARY | Encoding::PLAIN_DICTIONARY))
            })
            .collect()
    }

    #[test]
    fn a_carried_part_gives_a_dictionary_to_repetitive_strings_only() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, false),
            Field::new("few", DataType::Utf8, false),
            Field::new("unique", DataType::Utf8, true),
        ]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values(0..5000)),
                Arc::new(arrow::array::StringArray::from_iter_values(
                    (0..5000).map(|i| format!("v{}", i % 40)),
                )),
                Arc::new(arrow::array::StringArray::from_iter(
                    (0..5000).map(|i| (i % 3 != 0).then(|| format!("note {i}"))),
                )),
            ],
        )
        .expect("batch");
        assert_eq!(repetitive_strings(&batch), vec![true, true, false]);
        let (file, checksum) = encode_carried(&schema, "p", 7, &batch).expect("encode");
        let dict = dictionary_columns(&file);
        assert_eq!(dict, vec![false, true, false]);
        let name = PartName::parse("p_9_9_0").expect("name");
        let meta = read_meta(&name, file.clone()).expect("meta");
        assert_eq!(
            (meta.min_lsn, meta.max_lsn, meta.checksum),
            (Lsn(9), Lsn(9), checksum)
        );
        let back = read_rows(&name, file).expect("rows");
        let back = arrow::compute::concat_batches(&schema, &back).expect("concat");
        assert_eq!(back, batch);
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

    /// A damaged part file (any byte of its footer changed) read and checked
    /// as merges and reads do is an error or, where the change lands on a byte
    /// that does not matter, still the same rows; never other rows, never a
    /// panic, never a read past the file. (Without the check, some changes
    /// give other values silently.)
    #[tokio::test]
    #[allow(clippy::disallowed_methods, clippy::disallowed_types)] // a real temp dir
    async fn a_damaged_footer_is_an_error_not_a_panic() {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from_iter_values(0..2000))],
        )
        .expect("batch");
        let name = PartName::parse("p_1_1_0").expect("name");
        let (good, _) = encode(
            &schema,
            &name,
            7,
            std::slice::from_ref(&batch),
            (Lsn(1), Lsn(1)),
        )
        .expect("encode");
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = ferry_env::RealDisk::open_root(dir.path()).expect("disk");
        let footer_start = good.len().saturating_sub(600);
        let (mut errors, mut same) = (0, 0);
        for at in footer_start..good.len() {
            let mut bad = good.to_vec();
            bad[at] ^= 0xFF;
            std::fs::write(dir.path().join("part"), &bad).expect("write");
            let read = async {
                let mut reader = PartReader::open(&disk, "part", &name).await?;
                let mut check = PartCheck::new(&reader)?;
                let mut rows = Vec::new();
                while let Some(group) = reader.next_row_group().await? {
                    for b in group {
                        let b = b.map_err(|e| PartError::Invalid {
                            name: name.to_string(),
                            detail: e.to_string(),
                        })?;
                        check.push(&name, &b)?;
                        rows.push(b);
                    }
                }
                check.finish(reader.meta())?;
                Ok::<_, PartError>(rows)
            };
            match read.await {
                Err(_) => errors += 1,
                Ok(rows) => {
                    assert_eq!(
                        rows,
                        vec![batch.clone()],
                        "byte {at} changed the rows unnoticed"
                    );
                    same += 1;
                }
            }
        }
        assert!(
            errors > 0,
            "damage was noticed ({errors} errors, {same} harmless)"
        );
    }
}
