//! Rows from the outside world: an insert body in NDJSON, CSV, Arrow IPC or
//! Parquet decoded with the Arrow readers against the table's schema, checked
//! row by row, and split by shard into Arrow IPC payloads for WAL records.
//!
//! Either every row of a body is good, or the body is refused with the first bad
//! row: its number (1-based, counting data rows: CSV's header is not a row, nor
//! is a blank NDJSON line), its column and why. Decoding takes the readers' fast
//! path; only when it fails is the body decoded again one row at a time to find
//! which row it was.

use std::io::Cursor;
use std::sync::Arc;

use arrow::array::{
    new_null_array, Array, ArrayRef, AsArray, RecordBatch, TimestampMicrosecondArray, UInt32Array,
};
use arrow::compute::kernels::cast::{cast_with_options, CastOptions};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef, TimeUnit};
use arrow::error::ArrowError;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use bytes::Bytes;
use serde::Serialize;

use crate::def::TableDef;
use crate::keys;

/// Rows decoded per Arrow batch.
const BATCH_ROWS: usize = 64 * 1024;

/// The formats an insert body may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Ndjson,
    Csv,
    Arrow,
    Parquet,
}

impl Format {
    pub const ALL: [Format; 4] = [Format::Ndjson, Format::Csv, Format::Arrow, Format::Parquet];

    /// From a `?format=` value or a command-line flag.
    pub fn from_name(name: &str) -> Option<Format> {
        match name.to_ascii_lowercase().as_str() {
            "ndjson" | "jsonl" | "json" => Some(Format::Ndjson),
            "csv" => Some(Format::Csv),
            "arrow" | "ipc" | "arrow-ipc" | "arrows" => Some(Format::Arrow),
            "parquet" => Some(Format::Parquet),
            _ => None,
        }
    }

    /// From a `Content-Type` header (parameters such as `charset` ignored).
    pub fn from_content_type(value: &str) -> Option<Format> {
        let mime = value
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match mime.as_str() {
            "application/x-ndjson"
            | "application/ndjson"
            | "application/jsonl"
            | "application/json"
            | "application/x-jsonlines" => Some(Format::Ndjson),
            "text/csv" | "application/csv" => Some(Format::Csv),
            "application/vnd.apache.arrow.stream" | "application/vnd.apache.arrow.file" => {
                Some(Format::Arrow)
            }
            "application/vnd.apache.parquet" | "application/x-parquet" | "application/parquet" => {
                Some(Format::Parquet)
            }
            _ => None,
        }
    }

    /// The `Content-Type` ferry's client sends for this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Ndjson => "application/x-ndjson",
            Format::Csv => "text/csv",
            Format::Arrow => "application/vnd.apache.arrow.stream",
            Format::Parquet => "application/vnd.apache.parquet",
        }
    }

    /// From a file name's extension (`ferry insert` without `--format`).
    pub fn from_path(path: &str) -> Option<Format> {
        let ext = path.rsplit('.').next()?;
        Format::from_name(ext)
    }
}

/// Why a body was refused. `row` is 1-based among the body's data rows; it is
/// absent when the body as a whole is wrong (unreadable, a column of the wrong
/// type in a typed format).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{}{}{reason}", row.map(|r| format!("row {r}: ")).unwrap_or_default(), column.as_ref().map(|c| format!("column {c:?}: ")).unwrap_or_default())]
pub struct RowError {
    pub row: Option<u64>,
    pub column: Option<String>,
    pub reason: String,
}

impl RowError {
    fn body(reason: impl Into<String>) -> RowError {
        RowError {
            row: None,
            column: None,
            reason: reason.into(),
        }
    }
}

/// Why a body could not be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("{0}")]
    Row(RowError),
    #[error("more than {limit} rows in one request")]
    TooManyRows { limit: usize },
}

impl From<RowError> for DecodeError {
    fn from(e: RowError) -> DecodeError {
        DecodeError::Row(e)
    }
}

/// Rows decoded and checked against a table: every column in the table's
/// order and type, no null in a non-nullable column, every partition value valid.
#[derive(Debug, Clone)]
pub struct Rows {
    pub batches: Vec<RecordBatch>,
    pub rows: usize,
}

/// Decodes a whole body. `max_rows` bounds what one request may hold.
pub fn decode(
    def: &TableDef,
    format: Format,
    body: Bytes,
    max_rows: usize,
) -> Result<Rows, DecodeError> {
    let schema = def.arrow_schema();
    let batches = match format {
        Format::Ndjson => decode_ndjson(&schema, &body, max_rows)?,
        Format::Csv => decode_csv(&schema, &body, max_rows)?,
        Format::Arrow => decode_ipc(&body, max_rows)?,
        Format::Parquet => decode_parquet(body, max_rows)?,
    };
    let mut out = Vec::with_capacity(batches.len());
    let mut offset = 0usize;
    for b in batches {
        let n = b.num_rows();
        out.push(conform(def, &schema, b, offset)?);
        offset += n;
    }
    Ok(Rows {
        batches: out,
        rows: offset,
    })
}

fn check_rows(total: usize, max_rows: usize) -> Result<(), DecodeError> {
    if total > max_rows {
        Err(DecodeError::TooManyRows { limit: max_rows })
    } else {
        Ok(())
    }
}

/// The table's schema with every column nullable: readers then accept a missing
/// value, and the null check names the row and column itself.
fn relaxed(schema: &SchemaRef) -> SchemaRef {
    Arc::new(Schema::new(
        schema
            .fields()
            .iter()
            .map(|f| Field::new(f.name(), f.data_type().clone(), true))
            .collect::<Vec<_>>(),
    ))
}

/// The column a reader's message names, if it names one.
fn column_in(message: &str) -> Option<String> {
    for marker in ["field '", "column '", "Column '", "field \"", "column \""] {
        if let Some(start) = message.find(marker) {
            let rest = &message[start + marker.len()..];
            let quote = marker.chars().last()?;
            if let Some(end) = rest.find(quote) {
                return Some(rest[..end].to_string());
            }
        }
    }
    None
}

fn reader_error(row: Option<u64>, e: &ArrowError) -> RowError {
    let message = e.to_string();
    RowError {
        row,
        column: column_in(&message),
        reason: message,
    }
}

fn decode_ndjson(
    schema: &SchemaRef,
    body: &[u8],
    max_rows: usize,
) -> Result<Vec<RecordBatch>, DecodeError> {
    let fast = (|| -> Result<Vec<RecordBatch>, ArrowError> {
        let reader = json_reader(schema, BATCH_ROWS, body)?;
        let mut out = Vec::new();
        let mut total = 0;
        for b in reader {
            let b = b?;
            total += b.num_rows();
            if total > max_rows {
                // Not an error of the body: stop decoding early.
                return Err(ArrowError::ComputeError(TOO_MANY.into()));
            }
            out.push(b);
        }
        Ok(out)
    })();
    match fast {
        Ok(batches) => Ok(batches),
        Err(ArrowError::ComputeError(m)) if m == TOO_MANY => {
            Err(DecodeError::TooManyRows { limit: max_rows })
        }
        Err(e) => Err(locate(e, |batch_rows| {
            json_reader(schema, batch_rows, body).map(|r| Box::new(r) as BatchIter<'_>)
        })
        .into()),
    }
}

fn json_reader<'a>(
    schema: &SchemaRef,
    batch_rows: usize,
    body: &'a [u8],
) -> Result<arrow::json::Reader<Cursor<&'a [u8]>>, ArrowError> {
    arrow::json::ReaderBuilder::new(relaxed(schema))
        .with_strict_mode(true)
        .with_batch_size(batch_rows)
        .with_decoder_factory(Arc::new(WholeNumbers))
        .build(Cursor::new(body))
}

/// Makes the JSON reader refuse a number with a fraction or an exponent for an
/// integer or timestamp column. arrow-json would read `2.5` as 2 and `-0.9` as
/// 0 (it falls back to parsing a float and truncating it): a value silently
/// changed. Only integer literals are taken (and strings, which the reader
/// parses strictly); `2.0` and `1e3` are refused too, so that the rule is one a
/// user can state, and no float beyond 2^53 is ever rounded into an integer.
#[derive(Debug)]
struct WholeNumbers;

impl arrow::json::reader::DecoderFactory for WholeNumbers {
    fn make_default_decoder(
        &self,
        ctx: &arrow::json::reader::DecoderContext,
        field: &arrow::datatypes::FieldRef,
        is_nullable: bool,
    ) -> Result<Option<Box<dyn arrow::json::reader::ArrayDecoder>>, ArrowError> {
        match field.data_type() {
            DataType::Int32 | DataType::Int64 | DataType::Timestamp(..) => {
                let inner = ctx.make_builtin_decoder(field, is_nullable)?;
                Ok(Some(Box::new(WholeNumberDecoder {
                    inner,
                    data_type: field.data_type().clone(),
                })))
            }
            _ => Ok(None),
        }
    }
}

struct WholeNumberDecoder {
    inner: Box<dyn arrow::json::reader::ArrayDecoder>,
    data_type: DataType,
}

impl arrow::json::reader::ArrayDecoder for WholeNumberDecoder {
    fn decode(
        &mut self,
        tape: &arrow::json::reader::Tape<'_>,
        pos: &[u32],
    ) -> Result<ArrayRef, ArrowError> {
        use arrow::json::reader::TapeElement;
        for p in pos {
            let text = match tape.get(*p) {
                TapeElement::Number(idx) => {
                    let s = tape.get_string(idx);
                    if !s.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
                        continue;
                    }
                    s.to_string()
                }
                // Only values serialized from Rust floats, never JSON text.
                TapeElement::F32(_) | TapeElement::F64(_) => "a float".to_string(),
                _ => continue,
            };
            return Err(ArrowError::JsonError(format!(
                "{text} is not a whole number: a {} column takes integer literals only (no fraction or exponent), never a value truncated",
                self.data_type
            )));
        }
        self.inner.decode(tape, pos)
    }
}

const TOO_MANY: &str = "\u{1}too many rows";

/// Finds the first failing row by decoding again one row per batch.
type BatchIter<'a> = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>> + 'a>;

fn locate<'a>(
    first: ArrowError,
    reader: impl Fn(usize) -> Result<BatchIter<'a>, ArrowError>,
) -> RowError {
    let Ok(rows) = reader(1) else {
        return reader_error(None, &first);
    };
    let mut row = 0u64;
    for b in rows {
        match b {
            Ok(b) => row += b.num_rows() as u64,
            Err(e) => return reader_error(Some(row + 1), &e),
        }
    }
    reader_error(None, &first)
}

fn decode_csv(
    schema: &SchemaRef,
    body: &[u8],
    max_rows: usize,
) -> Result<Vec<RecordBatch>, DecodeError> {
    // The header names the columns; arrow-csv would take them by position.
    let mut header_reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_reader(Cursor::new(body));
    let header = header_reader
        .headers()
        .map_err(|e| RowError::body(format!("CSV header: {e}")))?
        .clone();
    if header.is_empty() || (header.len() == 1 && header.get(0) == Some("")) {
        return Err(RowError::body("CSV body has no header row").into());
    }
    let mut fields = Vec::with_capacity(header.len());
    for name in header.iter() {
        let name = name.trim();
        let Some(f) = schema.fields().iter().find(|f| f.name() == name) else {
            return Err(RowError {
                row: None,
                column: Some(name.to_string()),
                reason: "unknown column (not in the table)".into(),
            }
            .into());
        };
        if fields.iter().any(|g: &Field| g.name() == name) {
            return Err(RowError {
                row: None,
                column: Some(name.to_string()),
                reason: "column named twice in the CSV header".into(),
            }
            .into());
        }
        fields.push(Field::new(name, f.data_type().clone(), true));
    }
    let csv_schema = Arc::new(Schema::new(fields));
    if let Some((row, field)) = unterminated_quote(body) {
        return Err(RowError {
            row: Some(row),
            column: csv_schema.fields().get(field).map(|f| f.name().clone()),
            reason: "unterminated quote: a quoted value starts here and is never closed, so every line after it would be read into this one value".into(),
        }
        .into());
    }
    let build = |batch_rows: usize| {
        arrow::csv::ReaderBuilder::new(Arc::clone(&csv_schema))
            .with_header(true)
            .with_batch_size(batch_rows)
            .build(Cursor::new(body))
    };
    let mut out = Vec::new();
    let mut total = 0;
    let result = (|| -> Result<(), ArrowError> {
        for b in build(BATCH_ROWS)? {
            let b = b?;
            total += b.num_rows();
            if total > max_rows {
                return Err(ArrowError::ComputeError(TOO_MANY.into()));
            }
            out.push(b);
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(out),
        Err(ArrowError::ComputeError(m)) if m == TOO_MANY => {
            Err(DecodeError::TooManyRows { limit: max_rows })
        }
        Err(e) => {
            let mut located = locate(e, |n| build(n).map(|r| Box::new(r) as BatchIter<'_>));
            // arrow-csv names a column by its position in the file.
            if located.column.is_none() {
                located.column = csv_column(&located.reason)
                    .and_then(|i| csv_schema.fields().get(i))
                    .map(|f| f.name().clone());
            }
            Err(located.into())
        }
    }
}

/// Where a quoted CSV value is opened and never closed: (data row, 1-based
/// among the rows after the header; field index in the record). The CSV
/// readers take such a value to run to the end of the body, swallowing every
/// line after it into one field. The states follow the csv crate's
/// (RFC 4180: a quote opens a quoted value only at the start of a field; `""`
/// inside one is a quote; a record with no bytes is skipped).
fn unterminated_quote(body: &[u8]) -> Option<(u64, usize)> {
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum State {
        FieldStart,
        Unquoted,
        Quoted,
        QuoteInQuoted,
    }
    if !body.contains(&b'"') {
        return None;
    }
    let mut state = State::FieldStart;
    // Records ended before this one (the header is record 0), the field in
    // the current record, and whether the current record has any byte.
    let (mut record, mut field, mut empty) = (0u64, 0usize, true);
    let mut opened = (0u64, 0usize);
    for &b in body {
        match (state, b) {
            (State::Quoted, b'"') => state = State::QuoteInQuoted,
            (State::Quoted, _) => {}
            (State::QuoteInQuoted, b'"') => state = State::Quoted,
            (_, b',') => {
                state = State::FieldStart;
                field += 1;
                empty = false;
            }
            (_, b'\n' | b'\r') => {
                if !empty {
                    record += 1;
                }
                state = State::FieldStart;
                field = 0;
                empty = true;
            }
            (State::FieldStart, b'"') => {
                opened = (record, field);
                state = State::Quoted;
                empty = false;
            }
            _ => {
                state = State::Unquoted;
                empty = false;
            }
        }
    }
    (state == State::Quoted).then_some(opened)
}

/// The column position in an arrow-csv message ("... for column 3 at line 2").
fn csv_column(message: &str) -> Option<usize> {
    let rest = &message[message.find("for column ")? + "for column ".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn decode_ipc(body: &[u8], max_rows: usize) -> Result<Vec<RecordBatch>, DecodeError> {
    let reader = StreamReader::try_new(Cursor::new(body), None)
        .map_err(|e| RowError::body(format!("not an Arrow IPC stream: {e}")))?;
    let mut out = Vec::new();
    let mut total = 0;
    for b in reader {
        let b = b.map_err(|e| RowError::body(format!("Arrow IPC stream: {e}")))?;
        total += b.num_rows();
        check_rows(total, max_rows)?;
        out.push(b);
    }
    Ok(out)
}

fn decode_parquet(body: Bytes, max_rows: usize) -> Result<Vec<RecordBatch>, DecodeError> {
    let builder = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(body)
        .map_err(|e| RowError::body(format!("not a Parquet file: {e}")))?;
    let rows = builder.metadata().file_metadata().num_rows();
    check_rows(usize::try_from(rows).unwrap_or(usize::MAX), max_rows)?;
    let reader = builder
        .with_batch_size(BATCH_ROWS)
        .build()
        .map_err(|e| RowError::body(format!("Parquet: {e}")))?;
    let mut out = Vec::new();
    for b in reader {
        out.push(b.map_err(|e| RowError::body(format!("Parquet: {e}")))?);
    }
    Ok(out)
}

/// Whether a column of type `from` may be taken as the table's `to`: the same
/// type, or one that converts without losing a value's meaning (wider integers,
/// other string encodings, timestamps in another unit or without a zone, read
/// as UTC).
fn convertible(from: &DataType, to: &DataType) -> bool {
    if from == to {
        return true;
    }
    match (from, to) {
        (
            DataType::Int8 | DataType::Int16 | DataType::UInt8 | DataType::UInt16,
            DataType::Int32,
        ) => true,
        (
            DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::UInt8
            | DataType::UInt16
            | DataType::UInt32,
            DataType::Int64,
        ) => true,
        (DataType::Float32, DataType::Float64) => true,
        (DataType::LargeUtf8 | DataType::Utf8View, DataType::Utf8) => true,
        (DataType::Date64, DataType::Date32) => true,
        (DataType::Timestamp(_, tz), DataType::Timestamp(TimeUnit::Microsecond, _)) => {
            matches!(
                tz.as_deref(),
                None | Some("UTC") | Some("+00:00") | Some("Z") | Some("Etc/UTC")
            )
        }
        _ => false,
    }
}

/// A timestamp column in another unit (or zone-less, read as UTC) as the table's
/// microseconds; a value that overflows is refused.
fn to_utc_micros(c: &ArrayRef) -> Result<ArrayRef, String> {
    let DataType::Timestamp(unit, _) = c.data_type() else {
        return Err(format!("{} is not a timestamp", c.data_type()));
    };
    let raw = cast_with_options(c, &DataType::Int64, &CastOptions::default())
        .map_err(|e| e.to_string())?;
    let raw = raw.as_primitive::<Int64Type>();
    let values: Result<Vec<Option<i64>>, String> = raw
        .iter()
        .map(|v| {
            v.map(|v| {
                match unit {
                    TimeUnit::Second => v.checked_mul(1_000_000),
                    TimeUnit::Millisecond => v.checked_mul(1_000),
                    TimeUnit::Microsecond => Some(v),
                    TimeUnit::Nanosecond => Some(v.div_euclid(1_000)),
                }
                .ok_or_else(|| format!("timestamp {v} {unit:?} overflows microseconds"))
            })
            .transpose()
        })
        .collect();
    Ok(Arc::new(
        TimestampMicrosecondArray::from(values?).with_timezone(crate::def::UTC),
    ))
}

/// Puts a decoded batch into the table's shape and checks it; `offset` is the
/// number of rows before it in the body.
fn conform(
    def: &TableDef,
    schema: &SchemaRef,
    batch: RecordBatch,
    offset: usize,
) -> Result<RecordBatch, RowError> {
    let first_row = Some(offset as u64 + 1);
    let n = batch.num_rows();
    for f in batch.schema().fields() {
        if schema.index_of(f.name()).is_err() {
            return Err(RowError {
                row: first_row,
                column: Some(f.name().clone()),
                reason: "unknown column (not in the table)".into(),
            });
        }
    }
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(schema.fields().len());
    for (field, col) in schema.fields().iter().zip(&def.columns) {
        let column = match batch.column_by_name(field.name()) {
            None if col.nullable => new_null_array(field.data_type(), n),
            None => {
                return Err(RowError {
                    row: first_row,
                    column: Some(col.name.clone()),
                    reason: "missing value for a non-nullable column".into(),
                })
            }
            Some(c) if c.data_type() == field.data_type() => Arc::clone(c),
            Some(c)
                if matches!(c.data_type(), DataType::Timestamp(..))
                    && convertible(c.data_type(), field.data_type()) =>
            {
                to_utc_micros(c).map_err(|reason| RowError {
                    row: first_row,
                    column: Some(col.name.clone()),
                    reason,
                })?
            }
            Some(c) if convertible(c.data_type(), field.data_type()) => {
                let options = CastOptions {
                    safe: false,
                    ..CastOptions::default()
                };
                cast_with_options(c, field.data_type(), &options).map_err(|e| RowError {
                    row: first_row,
                    column: Some(col.name.clone()),
                    reason: format!(
                        "cannot convert {} to {}: {e}",
                        c.data_type(),
                        col.column_type.name()
                    ),
                })?
            }
            Some(c) => {
                return Err(RowError {
                    row: first_row,
                    column: Some(col.name.clone()),
                    reason: format!(
                        "type mismatch: {} given, the table has {}",
                        c.data_type(),
                        col.column_type.name()
                    ),
                })
            }
        };
        if !col.nullable && column.null_count() > 0 {
            let at = (0..n).find(|&i| column.is_null(i)).unwrap_or(0);
            return Err(RowError {
                row: Some((offset + at) as u64 + 1),
                column: Some(col.name.clone()),
                reason: "missing value for a non-nullable column".into(),
            });
        }
        columns.push(column);
    }
    let batch = RecordBatch::try_new(Arc::clone(schema), columns)
        .map_err(|e| RowError::body(format!("rows do not fit the table: {e}")))?;
    let pidx = def
        .column_index(&def.partition_by.column)
        .expect("checked definition");
    keys::for_each_partition_id(def, batch.column(pidx), |_, _| {}).map_err(|(row, reason)| {
        RowError {
            row: Some((offset + row) as u64 + 1),
            column: Some(def.partition_by.column.clone()),
            reason,
        }
    })?;
    Ok(batch)
}

/// The rows of each shard touched, in shard order, as one batch per shard.
pub fn split_by_shard(def: &TableDef, rows: &Rows) -> Result<Vec<(u32, RecordBatch)>, ArrowError> {
    let schema = def.arrow_schema();
    // One batch (an Arrow or small body) needs no copy.
    let all = match rows.batches.as_slice() {
        [one] => one.clone(),
        many => arrow::compute::concat_batches(&schema, many)?,
    };
    if all.num_rows() == 0 {
        return Ok(Vec::new());
    }
    let shards = def.shard_by.shards;
    if shards == 1 {
        return Ok(vec![(0, all)]);
    }
    let sidx = def
        .column_index(&def.shard_by.column)
        .expect("checked definition");
    let numbers = keys::shard_numbers(shards, all.column(sidx));
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); shards as usize];
    for (i, s) in numbers.iter().enumerate() {
        members[*s as usize].push(i as u32);
    }
    let mut out = Vec::new();
    for (s, idx) in members.into_iter().enumerate() {
        if idx.is_empty() {
            continue;
        }
        let indices = UInt32Array::from(idx);
        out.push((s as u32, arrow::compute::take_record_batch(&all, &indices)?));
    }
    Ok(out)
}

/// Encodes a batch as an Arrow IPC stream (schema and one batch), the form WAL
/// insert records carry.
pub fn to_ipc(batch: &RecordBatch) -> Result<Bytes, ArrowError> {
    let mut out = Vec::with_capacity(batch.get_array_memory_size() + 1024);
    write_ipc(batch, &mut out)?;
    Ok(Bytes::from(out))
}

/// Writes the bytes [`to_ipc`] returns into `out`.
pub fn write_ipc(batch: &RecordBatch, out: &mut impl std::io::Write) -> Result<(), ArrowError> {
    let mut w = StreamWriter::try_new(out, &batch.schema())?;
    w.write(batch)?;
    w.finish()
}

/// Decodes the rows of a WAL insert record.
pub fn from_ipc(bytes: &[u8]) -> Result<Vec<RecordBatch>, ArrowError> {
    StreamReader::try_new(Cursor::new(bytes), None)?.collect()
}

/// Splits a batch into slices of about `max_bytes` of Arrow memory each, so that
/// no WAL record exceeds its limit.
pub fn slices(batch: &RecordBatch, max_bytes: usize) -> Vec<RecordBatch> {
    let bytes = batch.get_array_memory_size().max(1);
    let n = batch.num_rows();
    if bytes <= max_bytes || n <= 1 {
        return vec![batch.clone()];
    }
    let parts = bytes.div_ceil(max_bytes);
    let per = n.div_ceil(parts).max(1);
    (0..n)
        .step_by(per)
        .map(|start| batch.slice(start, per.min(n - start)))
        .collect()
}

/// Writes rows as NDJSON that the insert path reads back to the same values.
/// JSON has no NaN or infinity, and arrow-json's writer puts `null` in their
/// place, which reads back as a missing value: here they are the strings
/// `"NaN"`, `"Infinity"` and `"-Infinity"`, which a Float64 column takes.
pub fn write_ndjson(batch: &RecordBatch, out: &mut Vec<u8>) -> Result<(), ArrowError> {
    let mut w = arrow::json::WriterBuilder::new()
        .with_encoder_factory(Arc::new(FloatsAsRead))
        .build::<_, arrow::json::writer::LineDelimited>(out);
    w.write(batch)?;
    w.finish()
}

#[derive(Debug)]
struct FloatsAsRead;

impl arrow::json::EncoderFactory for FloatsAsRead {
    fn make_default_encoder<'a>(
        &self,
        _field: &'a arrow::datatypes::FieldRef,
        array: &'a dyn Array,
        _options: &'a arrow::json::EncoderOptions,
    ) -> Result<Option<arrow::json::writer::NullableEncoder<'a>>, ArrowError> {
        if array.data_type() != &DataType::Float64 {
            return Ok(None);
        }
        let values = array.as_primitive::<arrow::datatypes::Float64Type>();
        Ok(Some(arrow::json::writer::NullableEncoder::new(
            Box::new(FloatEncoder(values)),
            array.nulls().cloned(),
        )))
    }
}

struct FloatEncoder<'a>(&'a arrow::array::Float64Array);

impl arrow::json::Encoder for FloatEncoder<'_> {
    fn encode(&mut self, idx: usize, out: &mut Vec<u8>) {
        use std::io::Write as _;
        let v = self.0.value(idx);
        if v.is_nan() {
            out.extend_from_slice(b"\"NaN\"");
        } else if v == f64::INFINITY {
            out.extend_from_slice(b"\"Infinity\"");
        } else if v == f64::NEG_INFINITY {
            out.extend_from_slice(b"\"-Infinity\"");
        } else {
            // Debug prints the shortest text that reads back to the same f64,
            // always with a fraction or an exponent: valid JSON.
            let _ = write!(out, "{v:?}");
        }
    }
}

/// Splits rows by partition: partitions in id order, rows in their order
/// within each (a function of the rows alone, so every node that splits the
/// same rows gets the same groups). A null partition value is refused.
pub fn split_by_partition(
    def: &TableDef,
    all: &RecordBatch,
) -> Result<Vec<(String, RecordBatch)>, String> {
    let pidx = def
        .column_index(&def.partition_by.column)
        .ok_or("no partition column")?;
    if all.column(pidx).null_count() > 0 {
        return Err("a null partition value".into());
    }
    // Rows by partition id, in row order; consecutive rows mostly share a
    // partition, so the last group is tried first.
    let mut groups: Vec<(String, Vec<u32>)> = Vec::new();
    let mut index: std::collections::HashMap<String, usize> = Default::default();
    let mut last = usize::MAX;
    crate::keys::for_each_partition_id(def, all.column(pidx), |row, id| {
        if groups.get(last).is_none_or(|(g, _)| g != id) {
            last = match index.get(id) {
                Some(i) => *i,
                None => {
                    index.insert(id.to_string(), groups.len());
                    groups.push((id.to_string(), Vec::new()));
                    groups.len() - 1
                }
            };
        }
        groups[last].1.push(row as u32);
    })
    .map_err(|(row, e)| format!("row {}: {e}", row + 1))?;
    groups.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::with_capacity(groups.len());
    for (id, idx) in groups {
        let batch = if idx.len() == all.num_rows() {
            all.clone()
        } else {
            arrow::compute::take_record_batch(all, &arrow::array::UInt32Array::from(idx))
                .map_err(|e| e.to_string())?
        };
        out.push((id, batch));
    }
    Ok(out)
}
