//! The checksum of a part's rows: a function of the rows alone (their values,
//! nulls and order), not of how they are batched, sliced or encoded, so a part
//! and its merged or exported copies can be compared by it.
//!
//! Definition: every column keeps two crc32c streams, fed row by row in order:
//! its *validity* stream gets one byte per row (1 valid, 0 null), its *values*
//! stream gets the canonical bytes of each valid value: Int32 and Date32 as 4
//! bytes little-endian, Int64 and Timestamp as 8, Float64 as the 8 bytes of its
//! bit pattern, Boolean as one byte 0 or 1, Utf8 as its byte length (4 bytes
//! little-endian) then its bytes. The checksum is crc32c of the row count (8
//! bytes little-endian) followed by each column's validity crc and values crc
//! (4 bytes little-endian each), in column order.
//!
//! Numeric columns without nulls are fed as they lie in memory (one crc32c call
//! per column and batch); strings, booleans and columns with nulls go through a
//! scratch buffer of at most 64 KiB. The checksum costs one pass over the data
//! and never a copy of a whole batch.

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{
    DataType, Date32Type, Float64Type, Int32Type, Int64Type, SchemaRef, TimeUnit,
    TimestampMicrosecondType,
};
use arrow::error::ArrowError;

/// A running checksum of rows fed in any batching (see the module docs).
#[derive(Debug, Clone)]
pub struct RowsChecksum {
    types: Vec<DataType>,
    validity: Vec<u32>,
    values: Vec<u32>,
    rows: u64,
    scratch: Vec<u8>,
}

/// Validity bytes of valid rows, fed in runs.
static ONES: [u8; 4096] = [1; 4096];

impl RowsChecksum {
    pub fn new(schema: &SchemaRef) -> Result<RowsChecksum, ArrowError> {
        let types: Vec<DataType> = schema
            .fields()
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        for t in &types {
            if !supported(t) {
                return Err(ArrowError::SchemaError(format!(
                    "a column of type {t} has no checksum encoding"
                )));
            }
        }
        Ok(RowsChecksum {
            validity: vec![0; types.len()],
            values: vec![0; types.len()],
            types,
            rows: 0,
            scratch: Vec::new(),
        })
    }

    pub fn push(&mut self, batch: &RecordBatch) -> Result<(), ArrowError> {
        if batch.num_columns() != self.types.len() {
            return Err(ArrowError::SchemaError(format!(
                "rows of {} columns for a schema of {}",
                batch.num_columns(),
                self.types.len()
            )));
        }
        for (i, column) in batch.columns().iter().enumerate() {
            if column.data_type() != &self.types[i] {
                return Err(ArrowError::SchemaError(format!(
                    "column {i} is {}, the schema says {}",
                    column.data_type(),
                    self.types[i]
                )));
            }
            self.validity[i] = self.validity(self.validity[i], column.as_ref());
            self.values[i] = self.column_values(self.values[i], column.as_ref());
        }
        self.rows += batch.num_rows() as u64;
        Ok(())
    }

    fn column_values(&mut self, crc: u32, column: &dyn Array) -> u32 {
        fn primitive<T: arrow::datatypes::ArrowPrimitiveType>(
            mut feed: Feed<'_>,
            column: &dyn Array,
            bytes: impl Fn(T::Native, &mut Feed<'_>),
        ) -> u32 {
            let a = column.as_primitive::<T>();
            if a.null_count() == 0 && cfg!(target_endian = "little") {
                // Native order is the canonical order: the values as they lie.
                feed.push(a.values().inner().as_slice());
                return feed.finish();
            }
            for (i, v) in a.values().iter().enumerate() {
                if a.is_valid(i) {
                    bytes(*v, &mut feed);
                }
            }
            feed.finish()
        }
        let feed = Feed::new(crc, &mut self.scratch);
        match column.data_type() {
            DataType::Int32 => {
                primitive::<Int32Type>(feed, column, |v, f| f.push(&v.to_le_bytes()))
            }
            DataType::Date32 => {
                primitive::<Date32Type>(feed, column, |v, f| f.push(&v.to_le_bytes()))
            }
            DataType::Int64 => {
                primitive::<Int64Type>(feed, column, |v, f| f.push(&v.to_le_bytes()))
            }
            DataType::Timestamp(TimeUnit::Microsecond, _) => {
                primitive::<TimestampMicrosecondType>(feed, column, |v, f| f.push(&v.to_le_bytes()))
            }
            DataType::Float64 => {
                primitive::<Float64Type>(feed, column, |v, f| f.push(&v.to_bits().to_le_bytes()))
            }
            DataType::Boolean => {
                let a = column.as_boolean();
                let mut feed = feed;
                for i in (0..a.len()).filter(|&i| a.is_valid(i)) {
                    feed.push(&[u8::from(a.value(i))]);
                }
                feed.finish()
            }
            DataType::Utf8 => {
                let a = column.as_string::<i32>();
                let mut feed = feed;
                for i in (0..a.len()).filter(|&i| a.is_valid(i)) {
                    let v = a.value(i).as_bytes();
                    let len = u32::try_from(v.len()).expect("an Arrow Utf8 value is under 2 GiB");
                    feed.push(&len.to_le_bytes());
                    feed.push(v);
                }
                feed.finish()
            }
            other => unreachable!("type {other} was refused by RowsChecksum::new"),
        }
    }

    /// Feeds a column's validity bytes: runs of ones where there are no nulls.
    fn validity(&mut self, crc: u32, column: &dyn Array) -> u32 {
        let mut feed = Feed::new(crc, &mut self.scratch);
        match column.logical_nulls() {
            None => {
                let mut left = column.len();
                while left > 0 {
                    let n = left.min(ONES.len());
                    feed.push(&ONES[..n]);
                    left -= n;
                }
            }
            Some(nulls) => {
                for valid in nulls.iter() {
                    feed.push(&[u8::from(valid)]);
                }
            }
        }
        feed.finish()
    }

    pub fn finish(self) -> Result<u32, ArrowError> {
        let mut crc = crc32c::crc32c(&self.rows.to_le_bytes());
        for (v, d) in self.validity.iter().zip(&self.values) {
            crc = crc32c::crc32c_append(crc, &v.to_le_bytes());
            crc = crc32c::crc32c_append(crc, &d.to_le_bytes());
        }
        Ok(crc)
    }
}

fn supported(t: &DataType) -> bool {
    matches!(
        t,
        DataType::Int32
            | DataType::Int64
            | DataType::Float64
            | DataType::Boolean
            | DataType::Utf8
            | DataType::Date32
            | DataType::Timestamp(TimeUnit::Microsecond, _)
    )
}

/// Bytes up to which a [`Feed`] gathers small pieces before a crc32c call.
const FEED_BUFFER_BYTES: usize = 64 << 10;

/// A crc32c stream fed in pieces: small ones are gathered in a bounded buffer
/// (a crc32c call per value would cost more than the values), large ones go
/// straight in.
struct Feed<'a> {
    crc: u32,
    buffer: &'a mut Vec<u8>,
}

impl<'a> Feed<'a> {
    fn new(crc: u32, buffer: &'a mut Vec<u8>) -> Feed<'a> {
        buffer.clear();
        Feed { crc, buffer }
    }

    fn push(&mut self, bytes: &[u8]) {
        if self.buffer.len() + bytes.len() > FEED_BUFFER_BYTES {
            self.crc = crc32c::crc32c_append(self.crc, self.buffer);
            self.buffer.clear();
        }
        if bytes.len() >= FEED_BUFFER_BYTES {
            self.crc = crc32c::crc32c_append(self.crc, bytes);
        } else {
            self.buffer.extend_from_slice(bytes);
        }
    }

    fn finish(self) -> u32 {
        crc32c::crc32c_append(self.crc, self.buffer)
    }
}

/// The checksum of rows (see the module docs).
pub fn rows_checksum(schema: &SchemaRef, batches: &[RecordBatch]) -> Result<u32, ArrowError> {
    let mut sum = RowsChecksum::new(schema)?;
    for b in batches {
        sum.push(b)?;
    }
    sum.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        BooleanArray, Date32Array, Float64Array, Int32Array, Int64Array, StringArray,
        TimestampMicrosecondArray,
    };
    use arrow::datatypes::{Field, Schema};
    use std::sync::Arc;

    fn sample(n: usize) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int32, true),
            Field::new("b", DataType::Int64, false),
            Field::new("c", DataType::Float64, true),
            Field::new("d", DataType::Boolean, true),
            Field::new("e", DataType::Utf8, true),
            Field::new("f", DataType::Date32, false),
            Field::new(
                "g",
                DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into())),
                true,
            ),
        ]));
        let i = 0..n as i64;
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int32Array::from_iter(
                    i.clone().map(|v| (v % 3 != 0).then_some(v as i32)),
                )),
                Arc::new(Int64Array::from_iter_values(i.clone())),
                Arc::new(Float64Array::from_iter(
                    i.clone().map(|v| (v % 5 != 0).then_some(v as f64 / 3.0)),
                )),
                Arc::new(BooleanArray::from_iter(
                    i.clone().map(|v| (v % 7 != 0).then_some(v % 2 == 0)),
                )),
                Arc::new(StringArray::from_iter(
                    i.clone().map(|v| (v % 4 != 0).then(|| format!("s{v}"))),
                )),
                Arc::new(Date32Array::from_iter_values(i.clone().map(|v| v as i32))),
                Arc::new(
                    TimestampMicrosecondArray::from_iter(i.map(|v| (v % 6 != 0).then_some(v)))
                        .with_timezone("+00:00"),
                ),
            ],
        )
        .expect("batch")
    }

    #[test]
    fn the_checksum_depends_on_the_rows_not_their_batching() {
        let batch = sample(10_000);
        let schema = batch.schema();
        let whole = rows_checksum(&schema, std::slice::from_ref(&batch)).expect("sum");
        let cuts = [
            vec![batch.slice(0, 1), batch.slice(1, 9_999)],
            vec![batch.slice(0, 4_097), batch.slice(4_097, 5_903)],
            (0..10_000)
                .step_by(333)
                .map(|at| batch.slice(at, 333.min(10_000 - at)))
                .collect(),
        ];
        for cut in &cuts {
            assert_eq!(rows_checksum(&schema, cut).expect("sum"), whole);
        }
        // A concatenated copy (fresh buffers, no offsets) too.
        let copy = arrow::compute::concat_batches(&schema, &cuts[2]).expect("concat");
        assert_eq!(rows_checksum(&schema, &[copy]).expect("sum"), whole);
    }

    #[test]
    fn any_change_of_a_value_a_null_or_the_order_changes_it() {
        let batch = sample(100);
        let schema = batch.schema();
        let sum = |b: &RecordBatch| rows_checksum(&schema, std::slice::from_ref(b)).expect("sum");
        let whole = sum(&batch);
        // Rows in another order.
        let reversed = arrow::compute::take_record_batch(
            &batch,
            &arrow::array::UInt32Array::from_iter_values((0..100).rev()),
        )
        .expect("take");
        assert_ne!(sum(&reversed), whole);
        // One row fewer.
        assert_ne!(sum(&batch.slice(0, 99)), whole);
        // One value changed, one null made a value, in each column.
        for c in 0..batch.num_columns() {
            let mut columns = batch.columns().to_vec();
            let other = sample(101).slice(1, 100);
            columns[c] = other.column(c).clone();
            let changed = RecordBatch::try_new(Arc::clone(&schema), columns).expect("batch");
            assert_ne!(sum(&changed), whole, "column {c}");
        }
        // Null vs empty string.
        let s = Arc::new(Schema::new(vec![Field::new("e", DataType::Utf8, true)]));
        let nulls = RecordBatch::try_new(
            Arc::clone(&s),
            vec![Arc::new(StringArray::from(vec![None::<&str>, Some("")]))],
        )
        .expect("batch");
        let empties = RecordBatch::try_new(
            Arc::clone(&s),
            vec![Arc::new(StringArray::from(vec![Some(""), None::<&str>]))],
        )
        .expect("batch");
        assert_ne!(
            rows_checksum(&s, &[nulls]).expect("sum"),
            rows_checksum(&s, &[empties]).expect("sum")
        );
    }
}
