//! Tables and inserts against a running `ferry dev`, as a user drives them: the
//! `ferry table` commands, inserts in every format through `ferry-client`, every
//! class of bad input (status, message, nothing committed), limits and the
//! token, a writer takeover in the middle of inserts, and `ferry insert` of a
//! large file with bounded memory. What was committed is read back from a
//! safekeeper's walsender and compared row by row.

mod common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{
    AsArray, BooleanArray, Date32Array, Float64Array, Int32Array, Int64Array, RecordBatch,
    StringArray, TimestampMicrosecondArray,
};
use arrow::datatypes::Int64Type;
use bytes::Bytes;
use common::*;
use ferry_client::{Client, ClientError};
use ferry_table::{Format, TableDef};
use ferry_testkit::table::TableToml;
use ferry_wal::record::Record;
use ferry_wal::Lsn;

/// The events table: an Int64 shard key, an Int32, then
/// [`TableToml::mixed_columns`].
fn table_toml() -> String {
    TableToml::new("events", ("ts", "month"), ("id", 3))
        .replicas(2)
        .column("id", "Int64")
        .column("small", "Int32")
        .mixed_columns()
        .toml()
}

fn def() -> TableDef {
    TableDef::from_toml(&table_toml()).expect("table")
}

fn client(url: &str, token: Option<&str>) -> Client {
    Client::new(url, token.map(str::to_string), Duration::from_secs(60)).expect("client")
}

/// The URL of the ready `ferry dev` that printed `lines`, a runtime, and a
/// client (with `token`) that created the events table there.
fn with_events(lines: &[String], token: Option<&str>) -> (String, tokio::runtime::Runtime, Client) {
    let url = base_url(lines);
    let rt = runtime();
    let c = client(&url, token);
    rt.block_on(c.create_table(&def())).expect("create table");
    (url, rt, c)
}

/// The rows each good body below holds: ids `base` and `base + 1`.
fn expected(base: i64) -> RecordBatch {
    RecordBatch::try_new(
        def().arrow_schema(),
        vec![
            Arc::new(Int64Array::from(vec![base, base + 1])),
            Arc::new(Int32Array::from(vec![1, -2])),
            Arc::new(Float64Array::from(vec![Some(1.5), None])),
            Arc::new(BooleanArray::from(vec![true, false])),
            Arc::new(StringArray::from(vec![Some("x, \"y\""), None])),
            Arc::new(Date32Array::from(vec![19_724, 0])),
            Arc::new(
                TimestampMicrosecondArray::from(vec![1_704_164_645_000_006, 1_709_251_200_000_000])
                    .with_timezone("+00:00"),
            ),
        ],
    )
    .expect("batch")
}

fn body(format: Format, base: i64) -> Bytes {
    match format {
        Format::Ndjson => Bytes::from(format!(
            "{{\"id\":{},\"small\":1,\"f\":1.5,\"b\":true,\"s\":\"x, \\\"y\\\"\",\"d\":\"2024-01-02\",\"ts\":\"2024-01-02T03:04:05.000006Z\"}}\n\
             {{\"id\":{},\"small\":-2,\"f\":null,\"b\":false,\"d\":\"1970-01-01\",\"ts\":\"2024-03-01T00:00:00Z\"}}\n",
            base,
            base + 1
        )),
        Format::Csv => Bytes::from(format!(
            "ts,id,small,f,b,s,d\n\
             2024-01-02T03:04:05.000006Z,{},1,1.5,true,\"x, \"\"y\"\"\",2024-01-02\n\
             2024-03-01T00:00:00Z,{},-2,,false,,1970-01-01\n",
            base,
            base + 1
        )),
        Format::Arrow => ferry_table::rows::to_ipc(&expected(base)).expect("ipc"),
        Format::Parquet => {
            let mut out = Vec::new();
            let mut w = parquet::arrow::ArrowWriter::try_new(&mut out, def().arrow_schema(), None)
                .expect("parquet writer");
            w.write(&expected(base)).expect("write");
            w.close().expect("close");
            Bytes::from(out)
        }
    }
}

/// An insert record as committed.
#[derive(Debug)]
struct Committed {
    lsn: u64,
    table_id: u64,
    shard: u32,
    block_number: u64,
    key: Bytes,
    rows: RecordBatch,
}

/// Every insert record of the committed WAL up to `end`, read through a
/// safekeeper's walsender.
async fn committed_inserts(safekeeper: &str, end: Lsn) -> Vec<Committed> {
    let wal = read_committed_wal(safekeeper, end).await;
    ferry_testkit::wal::records(&wal)
        .into_iter()
        .filter_map(|(lsn, rec)| {
            let (table_id, shard, block_number, key, rows) = match rec {
                Record::Insert {
                    table_id,
                    shard,
                    block_number,
                    idempotency_key,
                    arrow_ipc,
                } => {
                    let mut batches =
                        ferry_table::rows::from_ipc(&arrow_ipc).expect("Arrow IPC rows");
                    assert_eq!(batches.len(), 1, "one batch per record");
                    let rows = batches.remove(0);
                    (table_id, shard, block_number, idempotency_key, rows)
                }
                Record::InsertParts {
                    table_id,
                    shard,
                    block_number,
                    idempotency_key,
                    parts,
                } => {
                    // The parts as a replica names them; their rows in partition order.
                    let mut batches = Vec::new();
                    for p in parts {
                        let name = ferry_replica::PartName {
                            partition_id: p.partition_id,
                            min_block: block_number,
                            max_block: block_number,
                            level: 0,
                        };
                        let meta =
                            ferry_replica::part::read_meta(&name, p.file.clone()).expect("footer");
                        assert_eq!(
                            meta.min_lsn,
                            Lsn(block_number),
                            "a carried part's LSN is its block"
                        );
                        batches
                            .extend(ferry_replica::part::read_rows(&name, p.file).expect("a part"));
                    }
                    let rows = arrow::compute::concat_batches(&def().arrow_schema(), &batches)
                        .expect("concat");
                    (table_id, shard, block_number, idempotency_key, rows)
                }
                _ => return None,
            };
            Some(Committed {
                lsn,
                table_id,
                shard,
                block_number,
                key,
                rows,
            })
        })
        .collect()
}

fn commit_lsn(url: &str) -> Lsn {
    status_json(&format!("{url}/status"))["writer"]["commit_lsn"]
        .as_str()
        .expect("commit_lsn")
        .parse()
        .expect("an LSN")
}

/// The rows of all records with `key`, ordered by id.
fn rows_of(records: &[&Committed]) -> RecordBatch {
    let schema = def().arrow_schema();
    let all =
        arrow::compute::concat_batches(&schema, records.iter().map(|c| &c.rows)).expect("concat");
    let ids = all.column(0).as_primitive::<Int64Type>();
    let mut order: Vec<u32> = (0..all.num_rows() as u32).collect();
    order.sort_by_key(|&i| ids.value(i as usize));
    arrow::compute::take_record_batch(&all, &arrow::array::UInt32Array::from(order)).expect("take")
}

#[test]
fn tables_and_inserts_in_every_format_are_committed_row_for_row() {
    let (dir, data, mut child, lines) = start_fresh_dev();
    let url = base_url(&lines);

    // Tables through the command line.
    let file = dir.path().join("events.toml");
    std::fs::write(&file, table_toml()).expect("write definition");
    let file = file.to_str().expect("path");
    let (ok, out, err) = ferry(&["table", "create", "--file", file], &url);
    assert!(
        ok && out.contains("created table events (id 1)"),
        "{out}{err}"
    );
    let (ok, out, err) = ferry(&["table", "create", "--file", file], &url);
    assert!(
        ok && out.contains("already exists with this definition"),
        "{out}{err}"
    );
    let other = dir.path().join("other.toml");
    std::fs::write(&other, table_toml().replace("shards = 3", "shards = 4")).expect("write");
    let (ok, _, err) = ferry(
        &["table", "create", "--file", other.to_str().expect("path")],
        &url,
    );
    assert!(
        !ok && err.contains("exists with a different definition"),
        "{err}"
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        table_toml().replace("type = \"Int32\"", "type = \"Int8\""),
    )
    .expect("write");
    let (ok, _, err) = ferry(
        &["table", "create", "--file", bad.to_str().expect("path")],
        &url,
    );
    assert!(
        !ok && err.contains("columns[1].type") && err.contains("Int8"),
        "{err}"
    );
    let (ok, out, _) = ferry(&["table", "list"], &url);
    assert!(ok && out.contains("events\tid 1\t7 columns"), "{out}");
    let (ok, out, _) = ferry(&["table", "show", "events"], &url);
    assert!(ok, "{out}");
    let shown = out.split_once('\n').expect("two parts").1;
    assert_eq!(
        TableDef::from_toml(shown).expect("shown TOML reads back"),
        def()
    );

    // Inserts in every format, each with its own key.
    let rt = runtime();
    let c = client(&url, None);
    let mut answers = Vec::new();
    for (i, format) in Format::ALL.into_iter().enumerate() {
        let base = 100 * (i as i64 + 1);
        let key = format!("key-{format:?}");
        let inserted = rt
            .block_on(c.insert_body("events", format, body(format, base), Some(&key)))
            .unwrap_or_else(|e| panic!("{format:?}: {e}"));
        assert_eq!(inserted.rows, 2, "{format:?}");
        assert!(!inserted.blocks.is_empty());
        answers.push((format, base, key, inserted));
    }
    let end: Lsn = answers
        .last()
        .expect("answers")
        .3
        .commit_lsn
        .parse()
        .expect("lsn");
    assert!(commit_lsn(&url) >= end);
    let records = rt.block_on(committed_inserts(&safekeeper_addrs(&lines)[0], end));
    for (format, base, key, inserted) in &answers {
        let mine: Vec<&Committed> = records
            .iter()
            .filter(|r| r.key.starts_with(format!("{key}~").as_bytes()))
            .collect();
        assert_eq!(
            mine.iter().map(|r| r.block_number).collect::<Vec<_>>(),
            inserted.blocks,
            "{format:?}: one record per shard touched, numbered as answered"
        );
        for r in &mine {
            assert_eq!(r.table_id, 1);
            assert_eq!(r.block_number, r.lsn, "block number is the record's LSN");
            let shards = ferry_table::keys::shard_numbers(3, r.rows.column(0));
            assert!(
                shards.iter().all(|s| *s == r.shard),
                "rows routed to their shard"
            );
        }
        assert_eq!(rows_of(&mine), expected(*base), "{format:?}: rows as sent");
    }

    // Both replicas applied every insert once, partitioned by month.
    for replica in 0..2 {
        let count: serde_json::Value = serde_json::from_str(&http_get(&format!(
            "{url}/tables/events/count?replica={replica}&min_lsn={end}"
        )))
        .expect("count JSON");
        assert_eq!(count["rows"], 8, "replica {replica}: {count}");
        let partitions: serde_json::Value = serde_json::from_str(&http_get(&format!(
            "{url}/tables/events/partitions?replica={replica}&min_lsn={end}"
        )))
        .expect("partitions JSON");
        let ids: Vec<&str> = partitions
            .as_array()
            .expect("array")
            .iter()
            .map(|p| p["partition_id"].as_str().expect("id"))
            .collect();
        assert_eq!(ids, ["202401", "202403"], "{partitions}");
    }
    let p0 = http_get(&format!("{url}/tables/events/partitions?replica=0"));
    let p1 = http_get(&format!("{url}/tables/events/partitions?replica=1"));
    assert_eq!(
        p0, p1,
        "both replicas hold the same parts, names and checksums"
    );
    let march = http_get(&format!("{url}/tables/events/rows?partition=202403"));
    assert_eq!(
        march.lines().count(),
        4,
        "one March row per insert: {march}"
    );
    // The same rows as an Arrow IPC stream, and an empty partition as a valid
    // empty stream of the table's schema.
    let read_ipc = |partition: &str| -> Vec<arrow::array::RecordBatch> {
        let body = http_get_bytes(&format!(
            "{url}/tables/events/rows?partition={partition}&format=arrow&replica=1"
        ));
        arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(body), None)
            .expect("an Arrow IPC stream")
            .collect::<Result<Vec<_>, _>>()
            .expect("batches")
    };
    let march_ipc = read_ipc("202403");
    assert_eq!(march_ipc.iter().map(|b| b.num_rows()).sum::<usize>(), 4);
    assert!(read_ipc("209912").is_empty());

    // The metrics count what happened.
    let metrics = http_get(&format!("{url}/metrics"));
    for line in [
        "ferry_inserts_total{format=\"ndjson\",outcome=\"ok\"} 1",
        "ferry_inserts_total{format=\"parquet\",outcome=\"ok\"} 1",
        "ferry_insert_rows_total 8",
        "ferry_elections_total 1",
        "ferry_insert_duration_seconds_count 4",
        "ferry_wal_commit_duration_seconds_count 4",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    for prefix in [
        "ferry_safekeeper_wal_fsyncs_total{safekeeper=\"0\"}",
        "ferry_coordination_requests_total{type=\"multi\"}",
        "ferry_wal_commit_lsn",
        "ferry_safekeeper_partial_uploads_total{safekeeper=\"0\",result=\"error\"} 0.0",
        "ferry_writer_waiting_appends{} 0.0",
    ] {
        assert!(metrics.contains(prefix), "{prefix} in\n{metrics}");
    }
    // The replicas' lag as the writer sees it, once their feedback arrived
    // (both hold every shard: shard u32::MAX).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = http_get(&format!("{url}/metrics"));
        let lags = [
            "ferry_writer_replica_lag_bytes{shard=\"4294967295\",replica=\"1\",kind=\"flush\"}",
            "ferry_writer_shard_lag_bytes{shard=\"4294967295\",kind=\"write\"}",
        ];
        if lags.iter().all(|l| metrics.contains(l)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "replica lag metrics in\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let (ok, out, err) = ferry(
        &["query", "count", "events", "--min-lsn", &end.to_string()],
        &url,
    );
    assert!(ok && out.trim() == "8", "{out}{err}");
    let (ok, out, err) = ferry(
        &[
            "query",
            "count",
            "events",
            "--partition",
            "202403",
            "--replica",
            "1",
        ],
        &url,
    );
    assert!(ok && out.trim() == "4", "{out}{err}");
    let (ok, out, _) = ferry(&["query", "partitions", "events"], &url);
    assert!(ok && out.starts_with("202401\t4 rows"), "{out}");

    // Export through the command line: created, waited for, listed, verified.
    let lake = format!("file://{}", data.join("lake").display());
    let (ok, out, err) = ferry(
        &["export", "events", "202403", "--to", &lake, "--wait"],
        &url,
    );
    assert!(
        ok && out.contains("COMPLETED") && out.contains("commit file: commit_202403_"),
        "{out}{err}"
    );
    let (ok, out, err) = ferry(&["export", "events", "202403", "--to", &lake], &url);
    assert!(!ok && err.contains("already has an export"), "{out}{err}");
    let (ok, out, err) = ferry(&["export", "events", "../x", "--to", &lake], &url);
    assert!(!ok && err.contains("partition id"), "{out}{err}");
    let (ok, out, err) = ferry(&["exports"], &url);
    assert!(
        ok && out.contains("202403") && out.contains("COMPLETED"),
        "{out}{err}"
    );
    let (ok, out, err) = ferry(&["verify", &lake, "--deep"], &url);
    assert!(
        ok && out.contains("1 commit files") && out.contains("4 rows"),
        "{out}{err}"
    );
    // A stray file is an orphan (reported, not a mismatch); a changed file is
    // a mismatch.
    std::fs::write(data.join("lake/stray.parquet"), b"x").expect("stray");
    let (ok, out, err) = ferry(&["verify", &lake], &url);
    assert!(
        ok && out.contains("orphan") && out.contains("stray.parquet"),
        "{out}{err}"
    );
    let data_file = std::fs::read_dir(data.join("lake/ts_month=202403"))
        .expect("partition dir")
        .next()
        .expect("a file")
        .expect("entry")
        .path();
    let mut bytes = std::fs::read(&data_file).expect("data file");
    bytes.push(0);
    std::fs::write(&data_file, bytes).expect("damage");
    let (ok, out, err) = ferry(&["verify", &lake], &url);
    assert!(!ok && out.contains("MISMATCH"), "{out}{err}");
    let metrics = http_get(&format!("{url}/metrics"));
    assert!(
        metrics.contains("ferry_export_tasks{exporter=\"dev-r0\",status=\"COMPLETED\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ferry_export_parts_exported_total"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ferry_export_coordination_ops_total{exporter=\"dev-r0\"}"),
        "{metrics}"
    );

    // A restart: the replicas resume from their parts and position.
    stop_dev(&mut child, &data);
    let (restarted, lines) = start_dev(&data);
    child = restarted;
    let url = base_url(&lines);
    assert_eq!(
        http_get(&format!("{url}/tables/events/partitions?replica=0")),
        p0
    );
    assert_eq!(
        http_get(&format!("{url}/tables/events/partitions?replica=1")),
        p1
    );

    // A table with nothing holding it is dropped; then it is gone.
    let (ok, out, err) = ferry(&["table", "drop", "events"], &url);
    assert!(ok && out.contains("dropped table events"), "{out}{err}");
    let (ok, _, err) = ferry(&["table", "show", "events"], &url);
    assert!(!ok && err.contains("no table named"), "{err}");
    stop_dev(&mut child, &data);
}

fn api_error(
    result: Result<ferry_client::Inserted, ClientError>,
) -> (u16, ferry_client::ApiErrorBody) {
    match result {
        Err(ClientError::Api { status, body }) => (status, *body),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[test]
fn bad_inserts_are_refused_with_their_row_and_change_nothing() {
    let (_dir, data) = fresh_data_dir();
    let token = "a-token-of-sufficient-length";
    let (mut child, lines) = start_dev_with(
        &data,
        &[
            "--max-body-bytes",
            "4096",
            "--max-rows",
            "10",
            "--api-token",
            token,
        ],
    );
    let (url, rt, c) = with_events(&lines, Some(token));
    let before = rt
        .block_on(c.insert_body("events", Format::Ndjson, body(Format::Ndjson, 1), None))
        .expect("a good insert");
    let end: Lsn = before.commit_lsn.parse().expect("lsn");

    let good = r#"{"id":1,"small":1,"b":true,"d":"2024-01-02","ts":"2024-01-02T00:00:00Z"}"#;
    let cases: Vec<(&str, String, Option<u64>, Option<&str>)> = vec![
        (
            "type mismatch",
            format!(
                "{good}\n{}\n",
                good.replace("\"small\":1", "\"small\":\"abc\"")
            ),
            Some(2),
            Some("small"),
        ),
        (
            "missing non-nullable",
            format!("{good}\n{good}\n{}\n", good.replace("\"b\":true,", "")),
            Some(3),
            Some("b"),
        ),
        (
            "unknown column",
            format!("{}\n", good.replace("\"id\":1", "\"id\":1,\"zz\":2")),
            Some(1),
            Some("zz"),
        ),
        (
            "unparseable",
            format!("{good}\n{{\"id\": 1,,}}\n"),
            Some(2),
            None,
        ),
        (
            "partition out of range",
            format!(
                "{}\n",
                good.replace("\"2024-01-02T00:00:00Z\"", "300000000000000000")
            ),
            Some(1),
            Some("ts"),
        ),
    ];
    for (what, text, row, column) in cases {
        let (status, e) = api_error(rt.block_on(c.insert_body(
            "events",
            Format::Ndjson,
            Bytes::from(text),
            Some("k"),
        )));
        assert_eq!((status, e.kind.as_str()), (400, "bad_row"), "{what}: {e:?}");
        assert_eq!(e.row, row, "{what}: {e:?}");
        if column.is_some() {
            assert_eq!(e.column.as_deref(), column, "{what}: {e:?}");
        }
        assert!(!e.error.is_empty() && e.reason.is_some(), "{what}: {e:?}");
    }
    let csv = "id,small,b,d,ts\n1,1,true,notadate,2024-01-02T00:00:00Z\n";
    let (status, e) =
        api_error(rt.block_on(c.insert_body("events", Format::Csv, Bytes::from(csv), None)));
    assert_eq!(
        (status, e.row, e.column.as_deref()),
        (400, Some(1), Some("d")),
        "{e:?}"
    );

    // Limits, formats and tables.
    let big = format!("{good}\n").repeat(100);
    let (status, e) =
        api_error(rt.block_on(c.insert_body("events", Format::Ndjson, Bytes::from(big), None)));
    assert_eq!((status, e.kind.as_str()), (413, "body_too_large"), "{e:?}");
    let many = format!("{good}\n").repeat(11);
    let (status, e) =
        api_error(rt.block_on(c.insert_body("events", Format::Ndjson, Bytes::from(many), None)));
    assert_eq!((status, e.kind.as_str()), (413, "too_many_rows"), "{e:?}");
    let (status, e) =
        api_error(rt.block_on(c.insert_body("nosuch", Format::Ndjson, Bytes::from(good), None)));
    assert_eq!((status, e.kind.as_str()), (404, "no_such_table"), "{e:?}");
    let raw = reqwest_like_post(
        &url,
        "/tables/events/insert",
        "text/plain",
        good,
        Some(token),
    );
    assert!(raw.starts_with("HTTP/1.1 415"), "{raw}");
    // Without the token, or with a wrong one: 401, and nothing happens.
    let anonymous = client(&url, None);
    let (status, e) = api_error(rt.block_on(anonymous.insert_body(
        "events",
        Format::Ndjson,
        Bytes::from(good),
        None,
    )));
    assert_eq!((status, e.kind.as_str()), (401, "unauthorized"), "{e:?}");
    let wrong = client(&url, Some("a-token-of-sufficient-lengtH"));
    let (status, _) = api_error(rt.block_on(wrong.insert_body(
        "events",
        Format::Ndjson,
        Bytes::from(good),
        None,
    )));
    assert_eq!(status, 401);
    match rt.block_on(anonymous.tables()) {
        Err(ClientError::Api { status: 401, .. }) => {}
        other => panic!("listing tables without the token: {other:?}"),
    }
    let log = std::fs::read_to_string(dev_log(&data)).unwrap_or_default();
    assert!(!log.contains(token), "the token is never logged");

    // Nothing of the refused requests was committed.
    let status_raw = reqwest_like_get(&url, "/status", Some(token));
    let status: serde_json::Value =
        serde_json::from_str(status_raw.split_once("\r\n\r\n").expect("body").1).expect("JSON");
    let now: Lsn = status["writer"]["commit_lsn"]
        .as_str()
        .expect("lsn")
        .parse()
        .expect("lsn");
    assert_eq!(now, end, "refused inserts committed nothing");
    let records = rt.block_on(committed_inserts(&safekeeper_addrs(&lines)[0], end));
    assert_eq!(records.iter().map(|r| r.rows.num_rows()).sum::<usize>(), 2);
    stop_dev(&mut child, &data);
}

/// A plain HTTP/1.1 request; returns the whole response.
fn raw_request(url: &str, request: String) -> String {
    String::from_utf8(http_request(url, &request)).expect("a UTF-8 response")
}

fn auth(token: Option<&str>) -> String {
    token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default()
}

fn reqwest_like_post(
    url: &str,
    path: &str,
    content_type: &str,
    body: &str,
    token: Option<&str>,
) -> String {
    let host = url.strip_prefix("http://").expect("http URL");
    raw_request(
        url,
        format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n{body}",
            body.len(),
            auth(token)
        ),
    )
}

fn reqwest_like_get(url: &str, path: &str, token: Option<&str>) -> String {
    let host = url.strip_prefix("http://").expect("http URL");
    raw_request(
        url,
        format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\n{}Connection: close\r\n\r\n",
            auth(token)
        ),
    )
}

/// Writers taking over while inserts run: every insert answered 200 is in the
/// committed WAL with its key; an insert answered 503 is retried with the same
/// key until it is answered 200.
#[test]
fn a_writer_takeover_never_answers_success_for_an_uncommitted_insert() {
    let (_dir, data, mut child, lines) = start_fresh_dev();
    let (url, rt, c) = with_events(&lines, None);
    let addrs = safekeeper_addrs(&lines);

    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let results = rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..8i64 {
            let c = c.clone();
            let answered = Arc::clone(&answered);
            tasks.spawn(async move {
                let mut acked = Vec::new();
                let mut unknown = 0usize;
                for i in 0..25i64 {
                    let key = format!("t{task}-{i}");
                    let body = body(Format::Ndjson, 1000 * task + 10 * i);
                    loop {
                        match c
                            .insert_body("events", Format::Ndjson, body.clone(), Some(&key))
                            .await
                        {
                            Ok(inserted) => {
                                acked.push((key.clone(), inserted));
                                answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                break;
                            }
                            Err(e) if e.retryable() => {
                                unknown += 1;
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            Err(e) => panic!("{key}: {e}"),
                        }
                    }
                }
                (acked, unknown)
            });
        }
        // Takeovers while inserts run (after 50, 100 and 150 of the 200 were
        // answered): a higher term on one safekeeper after another ends the
        // writer's term; ferry dev elects it again above.
        for (round, term) in [(0usize, 1_000u64), (1, 2_000), (2, 3_000)] {
            let after = 50 * (round + 1);
            while answered.load(std::sync::atomic::Ordering::SeqCst) < after {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            send_vote_request(&addrs[round % addrs.len()], term);
        }
        let mut all = Vec::new();
        let mut unknown = 0;
        while let Some(r) = tasks.join_next().await {
            let (acked, u) = r.expect("task");
            all.extend(acked);
            unknown += u;
        }
        (all, unknown)
    });
    let (acked, unknown) = results;
    assert_eq!(acked.len(), 200, "every insert was answered 200 in the end");
    let end = acked
        .iter()
        .map(|(_, i)| i.commit_lsn.parse::<Lsn>().expect("lsn"))
        .max()
        .expect("answers");
    let records = rt.block_on(committed_inserts(&addrs[0], end));
    let by_lsn: BTreeMap<u64, &Committed> = records.iter().map(|r| (r.lsn, r)).collect();
    for (key, inserted) in &acked {
        for block in &inserted.blocks {
            let r = by_lsn
                .get(block)
                .unwrap_or_else(|| panic!("{key}: block {block} answered but not committed"));
            assert!(
                r.key.starts_with(format!("{key}~").as_bytes()),
                "block {block} holds {key}'s rows"
            );
        }
        let mine: Vec<&Committed> = inserted.blocks.iter().map(|b| by_lsn[b]).collect();
        assert_eq!(
            mine.iter().map(|r| r.rows.num_rows()).sum::<usize>(),
            2,
            "{key}"
        );
    }
    // The last takeover happened while inserts still ran; the writer is
    // elected again above it (at the latest a few election rounds later).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = status_json(&format!("{url}/status"));
        if status["writer"]["term"].as_u64().expect("term") > 3_000
            && status["writer"]["elected"] == true
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not elected again: {status}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut per_key: BTreeMap<(&[u8], u32), usize> = BTreeMap::new();
    for r in &records {
        *per_key.entry((&r.key[..], r.shard)).or_default() += 1;
    }
    let twice = per_key.values().filter(|n| **n > 1).count();
    eprintln!("{twice} (key, shard) records are in the committed WAL more than once");
    // Retried inserts were applied once: every replica holds 200 x 2 rows.
    for replica in 0..2 {
        let count: serde_json::Value = serde_json::from_str(&http_get(&format!(
            "{url}/tables/events/count?replica={replica}&min_lsn={end}"
        )))
        .expect("count JSON");
        assert_eq!(count["rows"], 400, "replica {replica}: {count}");
    }
    eprintln!("{unknown} answers were 503 (outcome unknown) and retried with their key");
    stop_dev(&mut child, &data);
}

/// `ferry insert` of a large NDJSON file: memory stays bounded whatever the
/// file's size (FERRY_TEST_BIG_INSERT_MIB, default 1024), every row arrives.
#[test]
fn ferry_insert_streams_a_large_file_with_bounded_memory() {
    let mib: u64 = std::env::var("FERRY_TEST_BIG_INSERT_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let (dir, data, mut child, lines) = start_fresh_dev();
    let (url, _, _) = with_events(&lines, None);
    // Write the file: lines of about 200 bytes.
    let path = dir.path().join("big.ndjson");
    let pad = "p".repeat(60);
    let rows = write_rows(&path, mib << 20, |row| {
        format!(
            "{{\"id\":{row},\"small\":{},\"f\":{}.5,\"b\":true,\"s\":\"{pad}\",\"d\":\"2024-01-02\",\"ts\":\"2024-01-02T03:04:05Z\"}}\n",
            row % 1000,
            row % 7
        )
    });
    let out = Command::new(FERRY)
        .args(["insert", "events"])
        .arg(&path)
        .args(["--url", &url, "--idempotency-key", "big"])
        .stdin(Stdio::null())
        .output()
        .expect("ferry insert");
    let stdout = succeeded(&out);
    assert!(
        stdout.contains(&format!("inserted {rows} rows into events")),
        "{stdout}"
    );
    // The last commit_lsn, in the LSN form, reads every row back.
    let last = stdout
        .split("last commit_lsn ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap_or_else(|| panic!("no last commit_lsn in {stdout}"))
        .to_string();
    assert!(last.parse::<ferry_wal::Lsn>().is_ok(), "{last}");
    let counted = Command::new(FERRY)
        .args([
            "query",
            "count",
            "events",
            "--min-lsn",
            &last,
            "--url",
            &url,
        ])
        .output()
        .expect("ferry query count");
    assert_eq!(
        succeeded(&counted).trim(),
        rows.to_string(),
        "every row, read at the last commit_lsn"
    );
    let peak = number_after(&stdout, "peak memory ");
    assert!(
        peak < 200,
        "ferry insert peaked at {peak} MiB for a {mib} MiB file"
    );
    let server_peak = proc_peak_mib(child.id());
    assert!(server_peak < 1024, "ferry dev peaked at {server_peak} MiB");
    let metrics = http_get(&format!("{url}/metrics"));
    assert!(
        metrics.contains(&format!("ferry_insert_rows_total {rows}")),
        "every row counted: {}",
        metrics
            .lines()
            .filter(|l| l.contains("rows"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    eprintln!(
        "{mib} MiB, {rows} rows: ferry insert peaked at {peak} MiB, ferry dev at {server_peak} MiB"
    );
    stop_dev(&mut child, &data);
}

/// Writes the lines `line(0)`, `line(1)`... to a new file at `path` until
/// they reach `bytes`; returns how many it wrote.
fn write_rows(path: &std::path::Path, bytes: u64, line: impl Fn(u64) -> String) -> u64 {
    use std::io::Write as _;
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).expect("create"));
    let (mut written, mut rows) = (0u64, 0u64);
    while written < bytes {
        let line = line(rows);
        w.write_all(line.as_bytes()).expect("write");
        written += line.len() as u64;
        rows += 1;
    }
    w.flush().expect("flush");
    rows
}

fn proc_peak_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM");
    line.split_whitespace()
        .nth(1)
        .and_then(|k| k.parse::<u64>().ok())
        .expect("kB")
        / 1024
}

/// `--config`: the file's settings apply, flags win over it, unknown keys are
/// refused before anything starts, and `ferry config example` is a valid file.
#[test]
fn a_configuration_file_applies_under_the_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    let example = Command::new(FERRY)
        .args(["config", "example"])
        .output()
        .expect("ferry config example");
    assert!(example.status.success());
    let example_file = dir.path().join("example.toml");
    std::fs::write(&example_file, &example.stdout).expect("write");
    let (ok, out, err) = ferry(
        &["config", "check", example_file.to_str().expect("path")],
        "",
    );
    assert!(ok, "the example is valid: {out}{err}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[api]\nmax_rowz = 3\n").expect("write");
    let data = dir.path().join("data");
    let err = expect_failure(
        &[
            "dev".as_ref(),
            "--config".as_ref(),
            bad.as_os_str(),
            "--data-dir".as_ref(),
            data.as_os_str(),
        ],
        &[],
    );
    assert!(err.contains("max_rowz"), "{err}");
    assert!(!data.exists(), "nothing was created");
    let err = expect_failure(
        &[
            "dev".as_ref(),
            "--api-token".as_ref(),
            "short".as_ref(),
            "--http".as_ref(),
            "127.0.0.1:0".as_ref(),
            "--data-dir".as_ref(),
            data.as_os_str(),
        ],
        &[],
    );
    assert!(err.contains("at least 16"), "{err}");
    assert!(!data.exists(), "nothing was created");

    // The file says one row per insert and an HTTP address that is not free;
    // the flag's address wins, the file's limit applies.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let file = dir.path().join("ferry.toml");
    std::fs::write(
        &file,
        format!(
            "[dev]\nhttp = \"{}\"\n[api]\nmax_rows = 1\n",
            busy.local_addr().expect("addr")
        ),
    )
    .expect("write");
    let (mut child, lines) = start_dev_with(&data, &["--config", file.to_str().expect("path")]);
    let (_, rt, c) = with_events(&lines, None);
    let (status, e) = api_error(rt.block_on(c.insert_body(
        "events",
        Format::Ndjson,
        body(Format::Ndjson, 1),
        None,
    )));
    assert_eq!((status, e.kind.as_str()), (413, "too_many_rows"), "{e:?}");
    stop_dev(&mut child, &data);
}

/// `ferry dev --demo`: inserts, both replicas apply, identical parts, one
/// partition exported and committed once, exit 0.
#[test]
fn the_demo_runs_and_exits_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(FERRY)
        .args([
            "dev",
            "--demo",
            "--demo-rows",
            "250000",
            "--http",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .stdin(Stdio::null())
        .output()
        .expect("ferry dev --demo");
    let stdout = succeeded(&out);
    assert!(stdout.contains("inserted 250000 rows"), "{stdout}");
    assert!(stdout.contains("replica 1 applied up to"), "{stdout}");
    assert!(stdout.contains("250000 rows in the table"), "{stdout}");
    assert_eq!(
        stdout.matches("  2025").count(),
        12,
        "12 monthly partitions: {stdout}"
    );
    assert!(stdout.contains("both replicas hold the same"), "{stdout}");
    // One partition exported to the lake folder, committed once, verified.
    assert!(stdout.contains("COMPLETED"), "{stdout}");
    assert!(stdout.contains("0 mismatches, 0 orphans"), "{stdout}");
    assert!(stdout.contains("duckdb -c"), "{stdout}");
    assert!(stdout.contains("pd.read_parquet"), "{stdout}");
    let lake = dir.path().join("data/lake");
    let commits: Vec<std::path::PathBuf> = std::fs::read_dir(&lake)
        .expect("lake")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("commit_"))
        })
        .collect();
    assert_eq!(commits.len(), 1, "{commits:?}");
    let commit: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&commits[0]).expect("commit file")).expect("json");
    let files = commit["files"].as_array().expect("files");
    assert!(!files.is_empty());
    let mut rows = 0;
    for f in files {
        let path = lake.join(f["path"].as_str().expect("path"));
        assert_eq!(
            std::fs::metadata(&path).expect("listed file").len(),
            f["bytes"].as_u64().expect("bytes")
        );
        rows += f["rows"].as_u64().expect("rows");
    }
    assert_eq!(rows, commit["rows"].as_u64().expect("rows"));
    assert!(
        stdout.contains(&format!("{rows} rows of partition")),
        "{stdout}"
    );
    assert!(stdout.contains("stopped cleanly"), "{stdout}");
}

/// A replica opened from its data dir after `ferry dev` stopped: what it made
/// durable (opening reads its state file; no table is looked up).
struct NoTables;

#[async_trait::async_trait]
impl ferry_replica::Tables for NoTables {
    async fn by_id(&self, id: u64) -> Result<ferry_replica::TableRef, String> {
        Err(format!("table {id} is not looked up here"))
    }
}

#[test]
fn a_clean_stop_waits_until_both_replicas_applied_the_checkpoint() {
    let (dir, data, child, lines) = start_fresh_dev();
    let url = base_url(&lines);
    let file = dir.path().join("events.toml");
    std::fs::write(&file, table_toml()).expect("write definition");
    let (ok, out, err) = ferry(
        &["table", "create", "--file", file.to_str().expect("path")],
        &url,
    );
    assert!(ok, "{out}{err}");
    let rt = runtime();
    let c = client(&url, None);
    for i in 0..20 {
        rt.block_on(c.insert_body("events", Format::Ndjson, body(Format::Ndjson, 10 * i), None))
            .expect("insert");
    }
    // Stop right after the last acknowledgement: the replicas have not
    // necessarily applied it, and the shutdown checkpoint comes after it.
    interrupt(&child);
    let mut child = child;
    assert_clean_exit(&mut child, &data);
    let log = std::fs::read_to_string(common::dev_log(&data)).expect("log");
    assert!(!log.contains("had not applied"), "{log}");
    let end: Lsn = log
        .split("stopped cleanly checkpoint=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("the checkpoint in the log: {log}"));
    let disk: Arc<dyn ferry_env::Disk> =
        Arc::new(ferry_env::RealDisk::open_root(&data).expect("data dir"));
    for r in 0..2 {
        let replica = rt
            .block_on(ferry_replica::Replica::open(
                Arc::clone(&disk),
                &format!("replicas/r{r}"),
                ferry_replica::ALL_SHARDS,
                r,
                ferry_env::Cpu::Inline,
                Arc::new(NoTables),
            ))
            .expect("open the replica");
        assert!(
            replica.disk_consistent_lsn() >= end,
            "replica {r} made {} durable, not the checkpoint at {end}",
            replica.disk_consistent_lsn()
        );
    }
}

/// Values that used to be changed on the way in or out: a JSON float for an
/// integer or timestamp column (truncated), a CSV quote never closed (the lines
/// after it swallowed) are refused naming the row and column, nothing
/// committed; NaN inserted in every format reads back as NaN, not null.
#[test]
fn floats_for_integers_and_open_quotes_are_refused_and_nan_stays_nan() {
    let (_dir, data, mut child, lines) = start_fresh_dev();
    let (url, rt, c) = with_events(&lines, None);
    let good = r#"{"id":1,"small":1,"b":true,"d":"2024-01-02","ts":"2024-01-02T00:00:00Z"}"#;
    let start = commit_lsn(&url);
    for (what, format, text, row, column) in [
        (
            "2.5 for Int64",
            Format::Ndjson,
            format!("{good}\n{}\n", good.replace("\"id\":1", "\"id\":2.5")),
            2,
            "id",
        ),
        (
            "-0.9 for Int32",
            Format::Ndjson,
            format!("{}\n{good}\n", good.replace("\"small\":1", "\"small\":-0.9")),
            1,
            "small",
        ),
        (
            "a float for a Timestamp",
            Format::Ndjson,
            format!(
                "{good}\n{good}\n{}\n",
                good.replace("\"2024-01-02T00:00:00Z\"", "1704153600000000.5")
            ),
            3,
            "ts",
        ),
        (
            "a CSV quote never closed",
            Format::Csv,
            "id,small,b,d,ts,s\n1,1,true,2024-01-02,2024-01-02T00:00:00Z,\"open\n2,1,true,2024-01-02,2024-01-02T00:00:00Z,x\n".to_string(),
            1,
            "s",
        ),
    ] {
        let (status, e) = api_error(rt.block_on(c.insert_body(
            "events",
            format,
            Bytes::from(text),
            Some("k"),
        )));
        assert_eq!((status, e.kind.as_str()), (400, "bad_row"), "{what}: {e:?}");
        assert_eq!((e.row, e.column.as_deref()), (Some(row), Some(column)), "{what}: {e:?}");
    }
    assert_eq!(commit_lsn(&url), start, "refused inserts committed nothing");

    // NaN in every format, read back from a replica as NDJSON and as Arrow.
    let mut nan = expected(0);
    let mut columns = nan.columns().to_vec();
    columns[2] = Arc::new(Float64Array::from(vec![Some(f64::NAN), Some(f64::NAN)]));
    nan = RecordBatch::try_new(nan.schema(), columns).expect("batch");
    let ndjson = String::from_utf8(body(Format::Ndjson, 10).to_vec())
        .expect("utf-8")
        .replace("\"f\":1.5", "\"f\":\"NaN\"")
        .replace("\"f\":null", "\"f\":\"NaN\"");
    let csv = "ts,id,small,f,b,s,d\n\
               2024-01-02T03:04:05.000006Z,20,1,NaN,true,,2024-01-02\n\
               2024-03-01T00:00:00Z,21,-2,NaN,false,,1970-01-01\n";
    let mut parquet = Vec::new();
    {
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut parquet, def().arrow_schema(), None)
            .expect("parquet writer");
        w.write(&nan).expect("write");
        w.close().expect("close");
    }
    let mut end = String::new();
    for (format, body) in [
        (Format::Ndjson, Bytes::from(ndjson)),
        (Format::Csv, Bytes::from(csv)),
        (Format::Arrow, ferry_table::rows::to_ipc(&nan).expect("ipc")),
        (Format::Parquet, Bytes::from(parquet)),
    ] {
        end = rt
            .block_on(c.insert_body("events", format, body, None))
            .unwrap_or_else(|e| panic!("{format:?}: {e}"))
            .commit_lsn;
    }
    let rows = http_get(&format!(
        "{url}/tables/events/rows?partition=202401&min_lsn={end}"
    ));
    assert_eq!(rows.lines().count(), 4, "{rows}");
    assert_eq!(
        rows.matches(r#""f":"NaN""#).count(),
        4,
        "NaN, not null: {rows}"
    );
    let ipc = http_get_bytes(&format!(
        "{url}/tables/events/rows?partition=202403&format=arrow&min_lsn={end}"
    ));
    let batches: Vec<RecordBatch> =
        arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(ipc), None)
            .expect("an Arrow IPC stream")
            .collect::<Result<_, _>>()
            .expect("batches");
    let floats: Vec<Option<f64>> = batches
        .iter()
        .flat_map(|b| {
            b.column(2)
                .as_primitive::<arrow::datatypes::Float64Type>()
                .iter()
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(floats.len(), 4);
    assert!(
        floats.iter().all(|f| f.is_some_and(f64::is_nan)),
        "{floats:?}"
    );
    stop_dev(&mut child, &data);
}

/// `ferry insert FILE --idempotency-key BASE` run again, with other chunking
/// flags, after a node restart, or as it was: never a row twice. Another
/// `--chunk-bytes` with a base is refused before anything is sent.
#[test]
fn ferry_insert_run_again_with_the_same_base_never_duplicates() {
    let (dir, data, child, lines) = start_fresh_dev();
    let (url, _, _) = with_events(&lines, None);
    // About 10 MiB: two chunks of the fixed 8 MiB.
    let path = dir.path().join("rows.ndjson");
    let pad = "p".repeat(100);
    let rows = write_rows(&path, 10 << 20, |row| {
        format!(
            "{{\"id\":{row},\"small\":1,\"b\":true,\"s\":\"{pad}\",\"d\":\"2024-01-02\",\"ts\":\"2024-01-02T03:04:05Z\"}}\n"
        )
    });
    let file = path.to_str().expect("path");
    let insert = |url: &str, extra: &[&str]| {
        let mut args = vec!["insert", "events", file, "--idempotency-key", "load-1"];
        args.extend_from_slice(extra);
        ferry(&args, url)
    };
    let count_everywhere = |url: &str| -> Vec<u64> {
        let end = commit_lsn(url);
        (0..2)
            .map(|replica| {
                let count: serde_json::Value = serde_json::from_str(&http_get(&format!(
                    "{url}/tables/events/count?replica={replica}&min_lsn={end}"
                )))
                .expect("count JSON");
                count["rows"].as_u64().expect("rows")
            })
            .collect()
    };

    let (ok, out, err) = insert(&url, &[]);
    assert!(
        ok && out.contains(&format!("inserted {rows} rows")),
        "{out}{err}"
    );
    assert_eq!(count_everywhere(&url), [rows, rows]);
    // Other chunks under the same base would hold other rows: refused.
    for flag in ["1000000", "4096"] {
        let (ok, out, err) = insert(&url, &["--chunk-bytes", flag]);
        assert!(!ok && err.contains("always cut into chunks"), "{out}{err}");
    }
    // The same run again: answered from the node's memory, nothing written.
    let before = commit_lsn(&url);
    let (ok, out, err) = insert(&url, &["--chunk-bytes", "8388608"]);
    assert!(
        ok && out.contains(&format!("{rows} of these rows were inserted before")),
        "{out}{err}"
    );
    assert_eq!(
        commit_lsn(&url),
        before,
        "a deduplicated re-run writes nothing"
    );
    assert_eq!(count_everywhere(&url), [rows, rows]);

    // After a restart the node remembers no key: the re-run is written again
    // and the replicas skip every record of it.
    let mut child = child;
    stop_dev(&mut child, &data);
    let (mut child, lines) = start_dev(&data);
    let url = base_url(&lines);
    let (ok, out, err) = insert(&url, &["--chunk-bytes", "1000000"]);
    assert!(!ok && err.contains("always cut into chunks"), "{out}{err}");
    let (ok, out, err) = insert(&url, &[]);
    assert!(
        ok && out.contains(&format!("inserted {rows} rows")),
        "{out}{err}"
    );
    assert_eq!(count_everywhere(&url), [rows, rows], "nothing twice");
    // Another file under the same base: refused while the node remembers it.
    let other = dir.path().join("other.ndjson");
    std::fs::write(
        &other,
        r#"{"id":-1,"small":1,"b":true,"d":"2024-01-02","ts":"2024-01-02T03:04:05Z"}"#,
    )
    .expect("write");
    let (ok, out, err) = ferry(
        &[
            "insert",
            "events",
            other.to_str().expect("path"),
            "--idempotency-key",
            "load-1",
        ],
        &url,
    );
    assert!(
        !ok && err.contains("was used before for other rows"),
        "{out}{err}"
    );
    assert_eq!(count_everywhere(&url), [rows, rows]);
    stop_dev(&mut child, &data);
}
