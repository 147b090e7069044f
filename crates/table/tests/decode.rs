//! Insert bodies in every format, with every column type and nulls, and every
//! class of bad input: the error names the row and column, and no rows come out.

use std::sync::Arc;

use arrow::array::{
    Array, AsArray, BooleanArray, Date32Array, Float64Array, Int32Array, Int64Array, RecordBatch,
    StringArray, TimestampMicrosecondArray,
};
use arrow::datatypes::{DataType, Field, Schema};
use bytes::Bytes;
use ferry_table::rows::{self, decode, split_by_shard, to_ipc};
use ferry_table::{DecodeError, Format, RowError, TableDef};
use ferry_testkit::table::TableToml;

fn table() -> TableDef {
    TableToml::new("events", ("ts", "month"), ("i64", 3))
        .column("i32", "Int32")
        .column("i64", "Int64")
        .mixed_columns()
        .def()
}

const TS1: i64 = 1_704_164_645_000_006; // 2024-01-02T03:04:05.000006Z
const TS2: i64 = 1_709_251_200_000_000; // 2024-03-01T00:00:00Z

/// The rows every good body below holds.
fn expected(def: &TableDef) -> RecordBatch {
    RecordBatch::try_new(
        def.arrow_schema(),
        vec![
            Arc::new(Int32Array::from(vec![1, -2])),
            Arc::new(Int64Array::from(vec![10, 20])),
            Arc::new(Float64Array::from(vec![Some(1.5), None])),
            Arc::new(BooleanArray::from(vec![true, false])),
            Arc::new(StringArray::from(vec![Some("x, \"y\""), None])),
            Arc::new(Date32Array::from(vec![19_724, 0])),
            Arc::new(TimestampMicrosecondArray::from(vec![TS1, TS2]).with_timezone("+00:00")),
        ],
    )
    .expect("batch")
}

fn one_batch(rows: &ferry_table::Rows) -> RecordBatch {
    arrow::compute::concat_batches(&rows.batches[0].schema(), &rows.batches).expect("concat")
}

fn good(format: Format, body: impl Into<Bytes>) {
    let def = table();
    let rows =
        decode(&def, format, body.into(), 1000).unwrap_or_else(|e| panic!("{format:?}: {e}"));
    assert_eq!(rows.rows, 2);
    assert_eq!(one_batch(&rows), expected(&def), "{format:?}");
}

fn bad(format: Format, body: impl Into<Bytes>) -> RowError {
    match decode(&table(), format, body.into(), 1000) {
        Err(DecodeError::Row(e)) => e,
        other => panic!("{format:?}: expected a row error, got {other:?}"),
    }
}

const NDJSON: &str = r#"{"i32":1,"i64":10,"f":1.5,"b":true,"s":"x, \"y\"","d":"2024-01-02","ts":"2024-01-02T03:04:05.000006Z"}

{"i32":-2,"i64":20,"f":null,"b":false,"d":"1970-01-01","ts":"2024-03-01T00:00:00Z"}
"#;

const CSV: &str = "ts,i64,i32,f,b,s,d\n\
2024-01-02T03:04:05.000006Z,10,1,1.5,true,\"x, \"\"y\"\"\",2024-01-02\n\
2024-03-01T00:00:00Z,20,-2,,false,,1970-01-01\n";

#[test]
fn every_format_decodes_every_type_and_null() {
    good(Format::Ndjson, NDJSON);
    good(Format::Csv, CSV);
    let def = table();
    good(Format::Arrow, to_ipc(&expected(&def)).expect("ipc"));
    let mut parquet = Vec::new();
    {
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut parquet, def.arrow_schema(), None)
            .expect("writer");
        w.write(&expected(&def)).expect("write");
        w.close().expect("close");
    }
    good(Format::Parquet, parquet);
}

#[test]
fn typed_formats_convert_compatible_types_and_fill_missing_nullable_columns() {
    // Int64 given as Int32, timestamps in milliseconds without a zone, no "f"/"s".
    let schema = Arc::new(Schema::new(vec![
        Field::new("i32", DataType::Int32, false),
        Field::new("i64", DataType::Int32, false),
        Field::new("b", DataType::Boolean, false),
        Field::new("d", DataType::Date32, false),
        Field::new(
            "ts",
            DataType::Timestamp(arrow::datatypes::TimeUnit::Millisecond, None),
            false,
        ),
    ]));
    let batch = RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int32Array::from(vec![7])),
            Arc::new(Int32Array::from(vec![8])),
            Arc::new(BooleanArray::from(vec![true])),
            Arc::new(Date32Array::from(vec![3])),
            Arc::new(arrow::array::TimestampMillisecondArray::from(vec![1_000])),
        ],
    )
    .expect("batch");
    let rows = decode(&table(), Format::Arrow, to_ipc(&batch).expect("ipc"), 10).expect("decode");
    let got = one_batch(&rows);
    assert_eq!(
        got.column(1)
            .as_primitive::<arrow::datatypes::Int64Type>()
            .value(0),
        8
    );
    assert!(got.column(2).is_null(0) && got.column(4).is_null(0));
    assert_eq!(
        got.column(6)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>()
            .value(0),
        1_000_000
    );
}

#[test]
fn bad_rows_are_named_by_row_column_and_reason() {
    let line = |i32: &str, extra: &str| {
        format!(
            r#"{{"i32":{i32},"i64":1,"b":true,"d":"2024-01-02","ts":"2024-01-02T00:00:00Z"{extra}}}"#
        )
    };
    let ok = line("1", "");
    // Type mismatch in row 3.
    let e = bad(
        Format::Ndjson,
        format!("{ok}\n{ok}\n{}\n", line("\"abc\"", "")),
    );
    assert_eq!((e.row, e.column.as_deref()), (Some(3), Some("i32")), "{e}");
    // Missing non-nullable column in row 2.
    let e = bad(
        Format::Ndjson,
        format!(
            "{ok}\n{}\n",
            r#"{"i32":1,"i64":1,"d":"2024-01-02","ts":"2024-01-02T00:00:00Z"}"#
        ),
    );
    assert_eq!((e.row, e.column.as_deref()), (Some(2), Some("b")), "{e}");
    assert!(e.reason.contains("non-nullable"), "{e}");
    // Unknown column in row 2.
    let e = bad(
        Format::Ndjson,
        format!("{ok}\n{}\n", line("1", r#","zz":5"#)),
    );
    assert_eq!((e.row, e.column.as_deref()), (Some(2), Some("zz")), "{e}");
    // Unparseable JSON in row 2.
    let e = bad(Format::Ndjson, format!("{ok}\n{{\"i32\": 1,,}}\n"));
    assert_eq!(e.row, Some(2), "{e}");
    // Partition value out of range (year 11,476) in row 2.
    let far = r#"{"i32":1,"i64":1,"b":true,"d":"2024-01-02","ts":300000000000000000}"#;
    let e = bad(Format::Ndjson, format!("{ok}\n{far}\n"));
    assert_eq!((e.row, e.column.as_deref()), (Some(2), Some("ts")), "{e}");
    assert!(e.reason.contains("out of range"), "{e}");

    // CSV: unparseable date in data row 2, named by its header.
    let e = bad(
        Format::Csv,
        "i32,i64,b,d,ts\n1,1,true,2024-01-02,2024-01-02T00:00:00Z\n1,1,true,notadate,2024-01-02T00:00:00Z\n",
    );
    assert_eq!((e.row, e.column.as_deref()), (Some(2), Some("d")), "{e}");
    // CSV: a column the table lacks, and a non-nullable one left empty.
    let e = bad(
        Format::Csv,
        "i32,i64,b,d,ts,zz\n1,1,true,2024-01-02,2024-01-02T00:00:00Z,1\n",
    );
    assert_eq!(e.column.as_deref(), Some("zz"), "{e}");
    let e = bad(Format::Csv, "i32,i64,b,d,ts\n1,1,true,2024-01-02,2024-01-02T00:00:00Z\n1,,true,2024-01-02,2024-01-02T00:00:00Z\n");
    assert_eq!((e.row, e.column.as_deref()), (Some(2), Some("i64")), "{e}");
    // CSV with a short row.
    let e = bad(Format::Csv, "i32,i64,b,d,ts\n1,1,true\n");
    assert_eq!(e.row, Some(1), "{e}");

    // Arrow: a column of the wrong type.
    let schema = Arc::new(Schema::new(vec![Field::new("i32", DataType::Utf8, false)]));
    let batch =
        RecordBatch::try_new(schema, vec![Arc::new(StringArray::from(vec!["1"]))]).expect("batch");
    let e = bad(Format::Arrow, to_ipc(&batch).expect("ipc"));
    assert_eq!(e.column.as_deref(), Some("i32"), "{e}");
    assert!(e.reason.contains("type mismatch"), "{e}");
    // Garbage in binary formats.
    assert!(bad(Format::Arrow, &b"not arrow"[..])
        .reason
        .contains("Arrow"));
    assert!(bad(Format::Parquet, &b"not parquet"[..])
        .reason
        .contains("Parquet"));
}

#[test]
fn row_limit_and_sharding() {
    let def = table();
    let body: String = (0..50)
        .map(|i| {
            format!(
                r#"{{"i32":{i},"i64":{i},"b":true,"d":"2024-01-02","ts":"2024-01-02T00:00:00Z"}}"#
            ) + "\n"
        })
        .collect();
    assert_eq!(
        decode(&def, Format::Ndjson, Bytes::from(body.clone()), 49).expect_err("limit"),
        DecodeError::TooManyRows { limit: 49 }
    );
    let rows = decode(&def, Format::Ndjson, Bytes::from(body), 50).expect("decode");
    let shards = split_by_shard(&def, &rows).expect("split");
    assert_eq!(shards.iter().map(|(_, b)| b.num_rows()).sum::<usize>(), 50);
    assert!(
        shards.len() > 1,
        "50 keys over 3 shards touch more than one"
    );
    for (s, b) in &shards {
        let back = rows::from_ipc(&to_ipc(b).expect("ipc")).expect("decode ipc");
        assert_eq!(&back[0], b);
        let keys = ferry_table::keys::shard_numbers(3, b.column(1));
        assert!(
            keys.iter().all(|k| k == s),
            "every row of shard {s} hashes to it"
        );
    }
}

#[test]
fn formats_from_headers_and_names() {
    assert_eq!(
        Format::from_content_type("application/x-ndjson; charset=utf-8"),
        Some(Format::Ndjson)
    );
    assert_eq!(Format::from_content_type("text/csv"), Some(Format::Csv));
    assert_eq!(
        Format::from_content_type("application/vnd.apache.arrow.stream"),
        Some(Format::Arrow)
    );
    assert_eq!(
        Format::from_content_type("application/vnd.apache.parquet"),
        Some(Format::Parquet)
    );
    assert_eq!(Format::from_content_type("text/plain"), None);
    assert_eq!(Format::from_path("x/y.jsonl"), Some(Format::Ndjson));
    for f in Format::ALL {
        assert_eq!(Format::from_content_type(f.content_type()), Some(f));
    }
}

/// A JSON number with a fraction or an exponent for an integer or timestamp
/// column would be truncated by the reader (`2.5` as 2, `-0.9` as 0): it is
/// refused naming its row and column, in the fast path and row by row.
#[test]
fn a_float_for_an_integer_or_timestamp_column_is_refused_not_truncated() {
    let row = |i32: &str, i64: &str, ts: &str| {
        format!(r#"{{"i32":{i32},"i64":{i64},"b":true,"d":"2024-01-02","ts":{ts}}}"#) + "\n"
    };
    let ok = row("1", "1", "1704164645000006");
    for (what, bad_row, column) in [
        ("Int64 2.5", row("1", "2.5", "1704164645000006"), "i64"),
        ("Int64 -0.9", row("1", "-0.9", "1704164645000006"), "i64"),
        ("Int32 2.5", row("2.5", "1", "1704164645000006"), "i32"),
        ("Int32 2.0", row("2.0", "1", "1704164645000006"), "i32"),
        ("Int64 1e3", row("1", "1e3", "1704164645000006"), "i64"),
        ("Timestamp 1.5", row("1", "1", "1704164645000006.5"), "ts"),
        ("Timestamp 1.7E15", row("1", "1", "1.7E15"), "ts"),
    ] {
        let e = bad(Format::Ndjson, format!("{ok}{ok}{bad_row}{ok}"));
        assert_eq!(
            (e.row, e.column.as_deref()),
            (Some(3), Some(column)),
            "{what}: {e}"
        );
        assert!(e.reason.contains("not a whole number"), "{what}: {e}");
    }
    // Integer literals (and integer text) are still taken as they are.
    let rows = decode(
        &table(),
        Format::Ndjson,
        Bytes::from(ok + &row("-7", "\"9007199254740993\"", "0")),
        10,
    )
    .expect("integers");
    let b = one_batch(&rows);
    assert_eq!(
        b.column(0)
            .as_primitive::<arrow::datatypes::Int32Type>()
            .value(1),
        -7
    );
    assert_eq!(
        b.column(1)
            .as_primitive::<arrow::datatypes::Int64Type>()
            .value(1),
        9_007_199_254_740_993
    );
}

/// NaN and infinities in a Float64 column stay themselves in every format,
/// and NDJSON written by `write_ndjson` (what the read API answers) reads back
/// to the same values: arrow-json's own writer would turn them into null.
#[test]
fn nan_and_infinities_stay_themselves_in_every_format_and_through_ndjson_out() {
    let def = table();
    let line = |f: &str| {
        format!(
            r#"{{"i32":1,"i64":1,"f":{f},"b":true,"d":"2024-01-02","ts":"2024-01-02T00:00:00Z"}}"#
        ) + "\n"
    };
    let ndjson = [r#""NaN""#, r#""Infinity""#, r#""-Infinity""#, "2.5", "null"]
        .map(line)
        .concat();
    let csv = "i32,i64,b,d,ts,f\n".to_string()
        + &["NaN", "inf", "-inf", "2.5", ""]
            .map(|f| format!("1,1,true,2024-01-02,2024-01-02T00:00:00Z,{f}\n"))
            .concat();
    let from_ndjson =
        one_batch(&decode(&def, Format::Ndjson, Bytes::from(ndjson), 10).expect("ndjson"));
    let from_csv = one_batch(&decode(&def, Format::Csv, Bytes::from(csv), 10).expect("csv"));
    let check = |what: &str, b: &RecordBatch| {
        let f = b.column(2).as_primitive::<arrow::datatypes::Float64Type>();
        assert!(
            f.is_valid(0) && f.value(0).is_nan(),
            "{what}: NaN, not null: {f:?}"
        );
        assert_eq!(f.value(1), f64::INFINITY, "{what}");
        assert_eq!(f.value(2), f64::NEG_INFINITY, "{what}");
        assert_eq!(f.value(3), 2.5, "{what}");
        assert!(f.is_null(4), "{what}: null stays null");
    };
    check("ndjson", &from_ndjson);
    check("csv", &from_csv);
    check(
        "arrow",
        &one_batch(
            &decode(&def, Format::Arrow, to_ipc(&from_ndjson).expect("ipc"), 10).expect("arrow"),
        ),
    );
    let mut parquet = Vec::new();
    {
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut parquet, def.arrow_schema(), None)
            .expect("writer");
        w.write(&from_ndjson).expect("write");
        w.close().expect("close");
    }
    check(
        "parquet",
        &one_batch(&decode(&def, Format::Parquet, Bytes::from(parquet), 10).expect("parquet")),
    );
    let mut out = Vec::new();
    rows::write_ndjson(&from_ndjson, &mut out).expect("write ndjson");
    let text = String::from_utf8(out.clone()).expect("utf-8");
    assert!(text.contains(r#""f":"NaN""#), "{text}");
    check(
        "ndjson written and read again",
        &one_batch(&decode(&def, Format::Ndjson, Bytes::from(out), 10).expect("read back")),
    );
    // Finite values are written so that they read back exactly.
    let mut out = Vec::new();
    rows::write_ndjson(&expected(&def), &mut out).expect("write ndjson");
    assert_eq!(
        one_batch(&decode(&def, Format::Ndjson, Bytes::from(out), 10).expect("read back")),
        expected(&def)
    );
}

/// A CSV quote that is never closed would make the reader take every line
/// after it as part of one value: the body is refused naming where it opens.
#[test]
fn a_csv_quote_never_closed_is_refused_not_swallowing_the_lines_after_it() {
    let head = "i32,i64,b,d,ts,s\n";
    let good = "1,1,true,2024-01-02,2024-01-02T00:00:00Z,x\n";
    let open = "2,2,true,2024-01-02,2024-01-02T00:00:00Z,\"abc\n";
    let e = bad(Format::Csv, format!("{head}{good}{open}{good}{good}"));
    assert_eq!((e.row, e.column.as_deref()), (Some(2), Some("s")), "{e}");
    assert!(e.reason.contains("unterminated quote"), "{e}");
    // CRLF line ends and a blank line before it count the same rows.
    let e = bad(
        Format::Csv,
        format!("{head}{good}\r\n{open}{good}").replace('\n', "\r\n"),
    );
    assert_eq!((e.row, e.column.as_deref()), (Some(2), Some("s")), "{e}");
    // Quotes that are closed, doubled inside a value, or in the middle of an
    // unquoted value are fine.
    let rows = decode(
        &table(),
        Format::Csv,
        Bytes::from(format!(
            "{head}{good}3,3,true,2024-01-02,2024-01-02T00:00:00Z,\"a \"\"b\"\"\nc\"\n4,4,true,2024-01-02,2024-01-02T00:00:00Z,5\"\n"
        )),
        10,
    )
    .expect("closed quotes");
    let b = one_batch(&rows);
    let s = b.column(4).as_string::<i32>();
    assert_eq!((s.value(1), s.value(2)), ("a \"b\"\nc", "5\""));
}
