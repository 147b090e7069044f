//! Partition ids and shard numbers of rows: pure functions of a row's values, so
//! that every node (the writer routing an insert, every replica of a shard naming
//! its parts) computes the same answer.
//!
//! **Partition ids** (they appear in part names and in the lake's Hive paths):
//! * `identity` of an Int32/Int64: the decimal value (`-5`, `2024`);
//!   of a Boolean: `true` / `false`; of a Date: `YYYYMMDD`; of a Utf8: the string
//!   itself, which must be 1 to 64 characters of `[A-Za-z0-9_.-]` starting with a
//!   letter or digit (anything else is refused at insert);
//! * `day`, `month`, `year` of a Date or Timestamp (UTC): `YYYYMMDD`, `YYYYMM`,
//!   `YYYY`, for years 0001 to 9999 (anything else is refused at insert).
//!
//! **Shard numbers**: `crc32c(bytes) % shards`, where `bytes` is the shard
//! column's value as: Int32, Int64, Date (days) and Timestamp (microseconds)
//! widened to a little-endian i64; Float64 as its IEEE bits little-endian (with
//! -0.0 taken as 0.0); Boolean one byte 0 or 1; Utf8 its UTF-8 bytes. The same
//! integer value lands on the same shard whatever its integer type.

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Date32Array, Float64Array, Int32Array, Int64Array,
    StringArray, TimestampMicrosecondArray,
};
use arrow::datatypes::{DataType, Date32Type, Int32Type, Int64Type, TimeUnit};
use chrono::{DateTime, Datelike, NaiveDate};

use crate::def::{PartitionTransform, TableDef};

const MICROS_PER_DAY: i64 = 86_400_000_000;

/// A value that cannot be a partition id: the reason, for the row's error.
pub type KeyError = String;

fn date_of_days(days: i64) -> Result<NaiveDate, KeyError> {
    let epoch = NaiveDate::from_ymd_opt(1970, 1, 1).expect("valid date");
    let date = i32::try_from(days)
        .ok()
        .and_then(|d| epoch.checked_add_signed(chrono::TimeDelta::try_days(i64::from(d))?))
        .ok_or_else(|| format!("date {days} days from 1970-01-01 is out of range"))?;
    if !(1..=9999).contains(&date.year()) {
        return Err(format!(
            "year {} is out of range 0001..=9999 for a partition",
            date.year()
        ));
    }
    Ok(date)
}

fn format_date(date: NaiveDate, transform: PartitionTransform) -> String {
    match transform {
        PartitionTransform::Year => format!("{:04}", date.year()),
        PartitionTransform::Month => format!("{:04}{:02}", date.year(), date.month()),
        PartitionTransform::Day | PartitionTransform::Identity => {
            format!("{:04}{:02}{:02}", date.year(), date.month(), date.day())
        }
    }
}

/// Whether a string can be a partition id as it is.
pub fn valid_partition_string(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

/// Computes partition ids of a column; `f` gets each row's id in order. Stops at
/// the first row whose value cannot be a partition id: `(row index, reason)`.
/// The column is the table's partition column, in the table's Arrow type, with
/// no nulls (checked before).
pub fn for_each_partition_id(
    def: &TableDef,
    column: &ArrayRef,
    mut f: impl FnMut(usize, &str),
) -> Result<(), (usize, KeyError)> {
    let transform = def.partition_by.transform;
    let mut text = String::new();
    match column.data_type() {
        DataType::Int32 | DataType::Int64 => {
            let values: Box<dyn Iterator<Item = i64>> = match column.data_type() {
                DataType::Int32 => Box::new(
                    column
                        .as_primitive::<Int32Type>()
                        .values()
                        .iter()
                        .map(|&v| i64::from(v)),
                ),
                _ => Box::new(column.as_primitive::<Int64Type>().values().iter().copied()),
            };
            for (i, v) in values.enumerate() {
                text.clear();
                text += &v.to_string();
                f(i, &text);
            }
        }
        DataType::Boolean => {
            let a = column.as_boolean();
            for i in 0..a.len() {
                f(i, if a.value(i) { "true" } else { "false" });
            }
        }
        DataType::Utf8 => {
            let a = column.as_string::<i32>();
            for i in 0..a.len() {
                let v = a.value(i);
                if !valid_partition_string(v) {
                    return Err((
                        i,
                        format!(
                            "partition value {v:?} is out of range: 1 to 64 characters of \
                             [A-Za-z0-9_.-] starting with a letter or digit"
                        ),
                    ));
                }
                f(i, v);
            }
        }
        DataType::Date32 => {
            let a = column.as_primitive::<Date32Type>();
            let mut last: Option<(i32, String)> = None;
            for (i, &d) in a.values().iter().enumerate() {
                if last.as_ref().map(|(day, _)| *day) != Some(d) {
                    let date = date_of_days(i64::from(d)).map_err(|e| (i, e))?;
                    last = Some((d, format_date(date, transform)));
                }
                f(i, &last.as_ref().expect("set above").1);
            }
        }
        DataType::Timestamp(TimeUnit::Microsecond, _) => {
            let a = column
                .as_any()
                .downcast_ref::<TimestampMicrosecondArray>()
                .expect("timestamp column");
            let mut last: Option<(i64, String)> = None;
            for (i, &us) in a.values().iter().enumerate() {
                let day = us.div_euclid(MICROS_PER_DAY);
                if last.as_ref().map(|(d, _)| *d) != Some(day) {
                    let date = date_of_days(day).map_err(|e| (i, e))?;
                    last = Some((day, format_date(date, transform)));
                }
                f(i, &last.as_ref().expect("set above").1);
            }
        }
        other => {
            return Err((0, format!("a {other} column cannot partition")));
        }
    }
    Ok(())
}

/// The partition id of every row (one `String` per row: for replicas grouping
/// rows, where the ids are needed anyway).
pub fn partition_ids(def: &TableDef, column: &ArrayRef) -> Result<Vec<String>, (usize, KeyError)> {
    let mut out = Vec::with_capacity(column.len());
    for_each_partition_id(def, column, |_, id| out.push(id.to_string()))?;
    Ok(out)
}

/// The shard of every row (see the module documentation for the hash).
pub fn shard_numbers(shards: u32, column: &ArrayRef) -> Vec<u32> {
    assert!(shards >= 1, "a table has at least one shard");
    let n = column.len();
    if shards == 1 {
        return vec![0; n];
    }
    let of = |bytes: &[u8]| crc32c::crc32c(bytes) % shards;
    let as_i64 = |v: i64| of(&v.to_le_bytes());
    let any = column.as_any();
    if let Some(a) = any.downcast_ref::<Int32Array>() {
        a.values().iter().map(|&v| as_i64(i64::from(v))).collect()
    } else if let Some(a) = any.downcast_ref::<Int64Array>() {
        a.values().iter().map(|&v| as_i64(v)).collect()
    } else if let Some(a) = any.downcast_ref::<Date32Array>() {
        a.values().iter().map(|&v| as_i64(i64::from(v))).collect()
    } else if let Some(a) = any.downcast_ref::<TimestampMicrosecondArray>() {
        a.values().iter().map(|&v| as_i64(v)).collect()
    } else if let Some(a) = any.downcast_ref::<Float64Array>() {
        a.values()
            .iter()
            .map(|&v| {
                let v = if v == 0.0 { 0.0f64 } else { v };
                of(&v.to_bits().to_le_bytes())
            })
            .collect()
    } else if let Some(a) = any.downcast_ref::<BooleanArray>() {
        (0..n).map(|i| of(&[u8::from(a.value(i))])).collect()
    } else if let Some(a) = any.downcast_ref::<StringArray>() {
        (0..n).map(|i| of(a.value(i).as_bytes())).collect()
    } else {
        unreachable!("shard column of a type the table cannot hold")
    }
}

/// Parses a timestamp given as text the way the insert API documents it, for
/// callers that build rows by hand (tests, tools): RFC 3339.
pub fn parse_timestamp_micros(text: &str) -> Option<i64> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.timestamp_micros())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::def::TableDef;
    use std::sync::Arc;

    fn def(ptype: &str, transform: &str, shards: u32) -> TableDef {
        TableDef::from_toml(&format!(
            r#"name = "t"
partition_by = {{ column = "p", transform = "{transform}" }}
shard_by = {{ column = "p", shards = {shards} }}
[[columns]]
name = "p"
type = "{ptype}"
"#
        ))
        .expect("valid")
    }

    #[test]
    fn partition_ids_follow_the_documented_forms() {
        let ts: ArrayRef = Arc::new(
            TimestampMicrosecondArray::from(vec![
                parse_timestamp_micros("2024-03-05T23:59:59.999999Z").expect("ts"),
                parse_timestamp_micros("1969-12-31T23:00:00Z").expect("ts"),
            ])
            .with_timezone("+00:00"),
        );
        for (t, want) in [
            ("day", ["20240305", "19691231"]),
            ("month", ["202403", "196912"]),
            ("year", ["2024", "1969"]),
        ] {
            assert_eq!(
                partition_ids(&def("Timestamp", t, 1), &ts).expect("ids"),
                want
            );
        }
        let dates: ArrayRef = Arc::new(Date32Array::from(vec![0, 19_787]));
        assert_eq!(
            partition_ids(&def("Date", "identity", 1), &dates).expect("ids"),
            ["19700101", "20240305"]
        );
        let ints: ArrayRef = Arc::new(Int64Array::from(vec![-5, 2024]));
        assert_eq!(
            partition_ids(&def("Int64", "identity", 1), &ints).expect("ids"),
            ["-5", "2024"]
        );
        let strings: ArrayRef = Arc::new(StringArray::from(vec!["eu-west.1", "../etc"]));
        let err = partition_ids(&def("Utf8", "identity", 1), &strings).expect_err("traversal");
        assert_eq!(err.0, 1);
        let far: ArrayRef =
            Arc::new(TimestampMicrosecondArray::from(vec![0, i64::MAX]).with_timezone("+00:00"));
        let err = partition_ids(&def("Timestamp", "day", 1), &far).expect_err("out of range");
        assert_eq!(err.0, 1, "{}", err.1);
    }

    #[test]
    fn shard_numbers_are_stable_and_type_independent() {
        let a: ArrayRef = Arc::new(Int32Array::from(vec![1, 2, 3, 4, 5, 6, 7, 8]));
        let b: ArrayRef = Arc::new(Int64Array::from(vec![1, 2, 3, 4, 5, 6, 7, 8]));
        let sa = shard_numbers(4, &a);
        assert_eq!(sa, shard_numbers(4, &b));
        assert!(sa.iter().all(|&s| s < 4));
        // Pinned: changing the hash would move rows of existing tables.
        assert_eq!(sa[0], crc32c::crc32c(&1i64.to_le_bytes()) % 4);
        let s: ArrayRef = Arc::new(StringArray::from(vec!["x"]));
        assert_eq!(shard_numbers(7, &s), [crc32c::crc32c(b"x") % 7]);
        let z: ArrayRef = Arc::new(Float64Array::from(vec![0.0, -0.0]));
        let zs = shard_numbers(5, &z);
        assert_eq!(zs[0], zs[1]);
    }
}
