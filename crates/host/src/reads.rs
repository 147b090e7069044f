//! Replicas on a node: the catalog as the replicas' table source, and the read
//! API over the replicas' parts:
//!
//! ```text
//! GET /replicas                                      every replica's status
//! GET /tables/{name}/partitions[?replica=R][&min_lsn=L][&wait_ms=W]
//!                                                    partitions with their active parts
//! GET /tables/{name}/count[?partition=P][&replica=R][&min_lsn=L][&wait_ms=W]
//! GET /tables/{name}/rows?partition=P[&format=ndjson|arrow][&replica=R][&min_lsn=L]
//! ```
//!
//! A partition retention retired (its rows are in the lake and no longer on
//! the replicas, in whole or in part) answers `count` and `rows` with 410
//! `partition_retired`, naming the destination and the files that hold its
//! rows: never a silently short result. `partitions` lists it with
//! `retired`, and a table's `count` tells the rows only the lake holds.
//!
//! `min_lsn` makes a read wait (at most `wait_ms`, default 10 s; 504 past it)
//! until the replica applied everything up to that LSN, e.g. an insert's
//! `commit_lsn`: the read then sees that insert.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use ferry_ingest::api::ApiError;
use ferry_ingest::Catalog;
use ferry_replica::{PartMeta, ReadView, ReplicaReader, RetiredPartition};
use ferry_wal::Lsn;
use serde::{Deserialize, Serialize};

pub use ferry_node::CatalogTables;

pub struct Reads {
    pub catalog: Catalog,
    /// The replicas as readers reach them: a read never takes a replica's
    /// lock, so it never waits behind the applier's encoding and fsyncs.
    pub replicas: Vec<ReplicaReader>,
}

#[derive(Debug, Deserialize)]
struct ReadQuery {
    replica: Option<usize>,
    partition: Option<String>,
    min_lsn: Option<String>,
    wait_ms: Option<u64>,
    format: Option<String>,
}

#[derive(Debug, Serialize)]
struct Partition {
    partition_id: String,
    rows: u64,
    bytes: u64,
    parts: Vec<PartMeta>,
    /// Rows of the partition retention dropped: where the lake holds them.
    #[serde(skip_serializing_if = "Option::is_none")]
    retired: Option<InLake>,
}

/// Where a retired partition's rows are.
#[derive(Debug, Serialize)]
struct InLake {
    destination: String,
    format: String,
    /// The commit the retirement checked (a commit file's key, or an
    /// Iceberg metadata version's).
    commit: String,
    rows: u64,
    /// The data files holding the retired rows, as URLs.
    files: Vec<String>,
}

impl InLake {
    fn of(r: &RetiredPartition) -> InLake {
        let base = r.destination.trim_end_matches('/');
        InLake {
            destination: r.destination.clone(),
            format: r.format.clone(),
            commit: r.commit.clone(),
            rows: r.rows(),
            files: r
                .files
                .iter()
                .map(|f| format!("{base}/{}", f.path))
                .collect(),
        }
    }
}

/// 410: the partition's rows (some or all) are in the lake only.
fn retired_answer(table: &str, r: &RetiredPartition) -> Response {
    let lake = InLake::of(r);
    let body = serde_json::json!({
        "kind": "partition_retired",
        "error": format!(
            "partition {:?} of table {table:?} was retired by the table's retention: {} of its rows \
             are in the lake only ({} at {}); read them there (ferry lake files, or an Iceberg \
             reader), rows inserted since are exported within the freshness target",
            r.partition_id, lake.rows, lake.format, lake.destination
        ),
        "partition_id": r.partition_id,
        "lake": lake,
    });
    (StatusCode::GONE, Json(body)).into_response()
}

fn retired_of<'a>(
    retired: &'a [RetiredPartition],
    partition: &str,
) -> Option<&'a RetiredPartition> {
    retired.iter().find(|r| r.partition_id == partition)
}

pub fn router(reads: Arc<Reads>) -> Router {
    Router::new()
        .route("/replicas", get(replicas))
        .route("/tables/{name}/partitions", get(partitions))
        .route("/tables/{name}/count", get(count))
        .route("/tables/{name}/rows", get(rows))
        .with_state(reads)
}

async fn replicas(State(reads): State<Arc<Reads>>) -> Json<Vec<ferry_replica::ReplicaStatus>> {
    let mut out = Vec::new();
    for r in &reads.replicas {
        out.push(r.status());
    }
    Json(out)
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
}

/// The replica asked for, once it applied `min_lsn`.
async fn replica_at(reads: &Reads, q: &ReadQuery) -> Result<ReadView, ApiError> {
    let i = q.replica.unwrap_or(0);
    let replica = reads.replicas.get(i).cloned().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "no_such_replica",
            format!(
                "no replica {i} on this node ({} replicas)",
                reads.replicas.len()
            ),
        )
    })?;
    if let Some(min) = &q.min_lsn {
        let min: Lsn = min
            .parse()
            .map_err(|e| bad(format!("min_lsn {min:?}: {e}")))?;
        let wait = Duration::from_millis(q.wait_ms.unwrap_or(10_000).min(600_000));
        let mut status = replica.status.clone();
        let reached = tokio::time::timeout(
            wait,
            status.wait_for(|s| s.disk_consistent_lsn >= min || s.error.is_some()),
        )
        .await
        .map(|r| r.map(|s| s.error.clone()));
        match reached {
            Ok(Ok(None)) => {}
            Ok(Ok(Some(error))) => {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "replica_stopped",
                    format!("replica {i} stopped: {error}"),
                ))
            }
            _ => {
                let at = status.borrow().disk_consistent_lsn;
                return Err(ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "not_applied_yet",
                    format!("replica {i} applied up to {at}, not {min}, within {wait:?}"),
                ));
            }
        }
    }
    // Published before the status that announced its position (see
    // ferry_replica::view): at least `min_lsn`.
    Ok(replica.view())
}

async fn table(reads: &Reads, name: &str) -> Result<ferry_table::Table, ApiError> {
    match reads.catalog.get(name).await? {
        Some(t) => Ok(t),
        None => Err(ferry_ingest::CatalogError::NoSuchTable(name.to_string()).into()),
    }
}

fn by_partition(parts: Vec<PartMeta>, retired: &[RetiredPartition]) -> Vec<Partition> {
    let mut map: BTreeMap<String, Partition> = BTreeMap::new();
    for p in parts {
        let e = map
            .entry(p.name.partition_id.clone())
            .or_insert_with(|| Partition {
                partition_id: p.name.partition_id.clone(),
                rows: 0,
                bytes: 0,
                parts: Vec::new(),
                retired: None,
            });
        e.rows += p.rows;
        e.bytes += p.bytes;
        e.parts.push(p);
    }
    for r in retired {
        map.entry(r.partition_id.clone())
            .or_insert_with(|| Partition {
                partition_id: r.partition_id.clone(),
                rows: 0,
                bytes: 0,
                parts: Vec::new(),
                retired: None,
            })
            .retired = Some(InLake::of(r));
    }
    map.into_values().collect()
}

async fn partitions(
    State(reads): State<Arc<Reads>>,
    Path(name): Path<String>,
    Query(q): Query<ReadQuery>,
) -> Result<Json<Vec<Partition>>, ApiError> {
    let id = table(&reads, &name).await?.id;
    let view = replica_at(&reads, &q).await?;
    let parts = view.parts(id);
    Ok(Json(by_partition(parts, &view.retired(id))))
}

async fn count(
    State(reads): State<Arc<Reads>>,
    Path(name): Path<String>,
    Query(q): Query<ReadQuery>,
) -> Result<Response, ApiError> {
    let id = table(&reads, &name).await?.id;
    let view = replica_at(&reads, &q).await?;
    let retired = view.retired(id);
    if let Some(r) = q.partition.as_ref().and_then(|p| retired_of(&retired, p)) {
        return Ok(retired_answer(&name, r));
    }
    let rows: u64 = view
        .parts(id)
        .iter()
        .filter(|p| {
            q.partition
                .as_ref()
                .is_none_or(|want| &p.name.partition_id == want)
        })
        .map(|p| p.rows)
        .sum();
    Ok(Json(serde_json::json!({
        "table": name,
        "partition": q.partition,
        "rows": rows,
        "disk_consistent_lsn": view.disk_consistent_lsn.to_string(),
        // Rows retention left in the lake only (not in `rows`).
        "rows_retired": retired.iter().map(RetiredPartition::rows).sum::<u64>(),
        "partitions_retired": retired.len(),
    }))
    .into_response())
}

#[derive(Debug, Clone, Copy)]
enum RowsFormat {
    Ndjson,
    Arrow,
}

/// Chunks of a rows response in flight between the part reader and the
/// connection.
const ROWS_CHUNKS_IN_FLIGHT: usize = 4;

/// Streams a partition's rows, part by part and row group by row group: the
/// response holds about one row group whatever the partition's size.
async fn rows(
    State(reads): State<Arc<Reads>>,
    Path(name): Path<String>,
    Query(q): Query<ReadQuery>,
) -> Result<Response, ApiError> {
    let partition = q
        .partition
        .clone()
        .ok_or_else(|| bad("?partition= is required"))?;
    let format = match q.format.as_deref().unwrap_or("ndjson") {
        "ndjson" | "json" => RowsFormat::Ndjson,
        "arrow" => RowsFormat::Arrow,
        other => return Err(bad(format!("unknown format {other:?} (ndjson, arrow)"))),
    };
    let table = table(&reads, &name).await?;
    let view = replica_at(&reads, &q).await?;
    if let Some(r) = retired_of(&view.retired(table.id), &partition) {
        return Ok(retired_answer(&name, r));
    }
    let listed: Vec<(ferry_replica::PartName, String)> = view
        .parts(table.id)
        .into_iter()
        .filter(|p| p.name.partition_id == partition)
        .map(|p| {
            let path = view.part_path(table.id, &p.name);
            (p.name, path)
        })
        .collect();
    let disk = Arc::clone(view.disk());
    // Every part is opened before the first byte goes out: an open part stays
    // readable after a merge that replaced it removes its name.
    let mut parts = Vec::with_capacity(listed.len());
    for (name, path) in listed {
        parts.push(
            ferry_replica::part::PartReader::open(disk.as_ref(), &path, &name)
                .await
                .map_err(|e| {
                    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "part", e.to_string())
                })?,
        );
    }
    let (tx, rx) = tokio::sync::mpsc::channel(ROWS_CHUNKS_IN_FLIGHT);
    tokio::spawn(stream_rows(parts, table.def.arrow_schema(), format, tx));
    let body = axum::body::Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    }));
    let content_type = match format {
        RowsFormat::Ndjson => "application/x-ndjson",
        RowsFormat::Arrow => "application/vnd.apache.arrow.stream",
    };
    Ok(([(header::CONTENT_TYPE, content_type)], body).into_response())
}

/// Feeds `tx` with the encoded rows of `parts`; an error ends the response
/// early (the client sees it cut, never a wrong row).
async fn stream_rows(
    parts: Vec<ferry_replica::part::PartReader>,
    schema: arrow::datatypes::SchemaRef,
    format: RowsFormat,
    tx: tokio::sync::mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
) {
    let cpu = ferry_env::Cpu::BlockingPool;
    let fail = |e: &dyn std::fmt::Display| std::io::Error::other(e.to_string());
    let mut ipc = match format {
        RowsFormat::Arrow => match arrow::ipc::writer::StreamWriter::try_new(Vec::new(), &schema) {
            Ok(w) => Some(w),
            Err(e) => {
                let _ = tx.send(Err(fail(&e))).await;
                return;
            }
        },
        RowsFormat::Ndjson => None,
    };
    for mut part in parts {
        // Rows that are not what the part's footer describes cut the
        // response at the part's end.
        let mut check = match ferry_replica::part::PartCheck::new(&part) {
            Ok(c) => c,
            Err(e) => {
                let _ = tx.send(Err(fail(&e))).await;
                return;
            }
        };
        loop {
            let group = match part.next_row_group().await {
                Ok(Some(g)) => g,
                Ok(None) => break,
                Err(e) => {
                    let _ = tx.send(Err(fail(&e))).await;
                    return;
                }
            };
            let schema = Arc::clone(&schema);
            let writer = ipc.take();
            let name = part.meta().name.clone();
            let encoded = cpu
                .run(move || encode_row_group(&name, group, &schema, writer, check))
                .await;
            match encoded {
                Ok((chunk, writer, c)) => {
                    (ipc, check) = (writer, c);
                    if !chunk.is_empty() && tx.send(Ok(chunk.into())).await.is_err() {
                        return; // the client went away
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(fail(&e))).await;
                    return;
                }
            }
        }
        if let Err(e) = check.finish(part.meta()) {
            let _ = tx.send(Err(fail(&e))).await;
            return;
        }
    }
    if let Some(mut w) = ipc {
        let end = w.finish().map(|()| std::mem::take(w.get_mut()));
        let _ = tx.send(end.map(Into::into).map_err(|e| fail(&e))).await;
    }
}

type IpcWriter = arrow::ipc::writer::StreamWriter<Vec<u8>>;

/// Decodes one row group and encodes its rows, as NDJSON or (with `ipc`) as
/// the next messages of an Arrow IPC stream, under the table's schema.
fn encode_row_group(
    name: &ferry_replica::PartName,
    group: parquet::arrow::arrow_reader::ParquetRecordBatchReader,
    schema: &arrow::datatypes::SchemaRef,
    mut ipc: Option<IpcWriter>,
    mut check: ferry_replica::part::PartCheck,
) -> Result<(Vec<u8>, Option<IpcWriter>, ferry_replica::part::PartCheck), String> {
    let mut out = Vec::new();
    for batch in group {
        let batch = batch.map_err(|e| e.to_string())?;
        check.push(name, &batch).map_err(|e| e.to_string())?;
        let batch =
            arrow::array::RecordBatch::try_new(Arc::clone(schema), batch.columns().to_vec())
                .map_err(|e| e.to_string())?;
        match &mut ipc {
            Some(w) => {
                w.write(&batch).map_err(|e| e.to_string())?;
                out.extend(std::mem::take(w.get_mut()));
            }
            None => {
                ferry_table::rows::write_ndjson(&batch, &mut out).map_err(|e| e.to_string())?;
            }
        }
    }
    Ok((out, ipc, check))
}
