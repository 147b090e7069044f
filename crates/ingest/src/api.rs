//! The HTTP API of tables and inserts (SPEC sections 4 and 7):
//!
//! ```text
//! POST   /tables                 create (TOML or JSON body); 201 created, 200 same
//!                                definition already there, 409 another definition
//! GET    /tables                 list
//! GET    /tables/{name}          show
//! DELETE /tables/{name}          drop (409 while something holds the table)
//! POST   /tables/{name}/insert   rows in NDJSON, CSV, Arrow IPC or Parquet
//! ```
//!
//! An insert is answered `200 {rows, blocks, commit_lsn, deduplicated}` only
//! once every record it became is committed. Every error is JSON `{error, kind,
//! row, column}`: 400 bad rows (nothing written), 401 missing or wrong token,
//! 404 no such table, 409 an idempotency key used before with other content
//! (`idempotency_key_reused`) or being written now by another request
//! (`idempotency_key_in_flight`; nothing written either way), 413 body or row
//! count over the limit, 415 unknown format, 429 too many inserts at once, 503
//! when the outcome is unknown (the writer lost its term or did not commit in
//! time: retry with the same idempotency key) or when nothing was written
//! (`"kind": "overloaded"`). How a key is bound to its content: see
//! [`crate::idempotency`].

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use ferry_env::Cpu;
use ferry_table::{DecodeError, Format, Table, TableDef};
use ferry_wal::record::{CarriedPart, Maintenance, MAX_COMPACT_PARTITION_BYTES, MAX_RETIRED_FILES};
use ferry_wal::Lsn;
use ferry_writer::driver::{Insert, InsertRows, Inserted, WriterError};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::catalog::{Catalog, CatalogError};
use crate::idempotency::{self, Claim, KeyIndex, Refusal, MAX_KEY_BYTES};
use crate::metrics::IngestMetrics;

/// Where committed inserts go: the node's writer.
#[async_trait]
pub trait InsertSink: Send + Sync {
    async fn insert(&self, inserts: Vec<Insert>) -> Result<Inserted, WriterError>;

    /// Appends a table's upkeep record (a retirement, a compaction);
    /// resolves with its end once committed.
    async fn maintain(&self, record: Maintenance) -> Result<Lsn, WriterError>;
}

#[async_trait]
impl InsertSink for ferry_writer::driver::Writer {
    async fn insert(&self, inserts: Vec<Insert>) -> Result<Inserted, WriterError> {
        ferry_writer::driver::Writer::insert(self, inserts).await
    }

    async fn maintain(&self, record: Maintenance) -> Result<Lsn, WriterError> {
        self.append(record.into_record().to_bytes()).await
    }
}

/// A bearer token. Its `Debug` never shows it, and it is compared in constant
/// time.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken(String);

impl ApiToken {
    /// A token must be at least 16 printable ASCII characters without spaces.
    pub fn new(token: &str) -> Result<ApiToken, String> {
        if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(
                "an API token must be at least 16 printable ASCII characters without spaces".into(),
            );
        }
        Ok(ApiToken(token.to_string()))
    }

    pub fn secret(&self) -> &str {
        &self.0
    }

    fn matches(&self, header: Option<&header::HeaderValue>) -> bool {
        use subtle::ConstantTimeEq;
        let Some(given) = header
            .and_then(|h| h.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "))
        else {
            return false;
        };
        // Lengths may differ; `ct_eq` on slices of unequal length is false
        // without looking at the bytes, which reveals only the length.
        bool::from(given.as_bytes().ct_eq(self.0.as_bytes()))
    }
}

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(<redacted>)")
    }
}

/// Limits of the insert API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiLimits {
    /// Largest request body (413 past it).
    pub max_body_bytes: usize,
    /// Most rows in one insert (413 past it).
    pub max_rows: usize,
    /// Inserts decoding or waiting for commit at once (429 past it).
    pub max_concurrent_inserts: usize,
    /// How long an insert waits for its commit before answering 503 (outcome
    /// unknown).
    pub commit_timeout: Duration,
    /// Most Arrow bytes of rows in one WAL record; a shard's rows past it are
    /// cut into several records.
    pub record_rows_bytes: usize,
    /// Keyed inserts remembered to answer retries and refuse reused keys.
    pub idempotency_keys: usize,
}

impl Default for ApiLimits {
    fn default() -> ApiLimits {
        ApiLimits {
            max_body_bytes: 64 << 20,
            max_rows: 1_000_000,
            max_concurrent_inserts: 64,
            commit_timeout: Duration::from_secs(30),
            record_rows_bytes: RECORD_ROWS_BYTES,
            idempotency_keys: idempotency::INDEX_KEYS,
        }
    }
}

/// The API's shared state.
pub struct Api {
    pub catalog: Catalog,
    pub sink: Arc<dyn InsertSink>,
    pub cpu: Cpu,
    pub limits: ApiLimits,
    pub metrics: Arc<IngestMetrics>,
    slots: Semaphore,
    keys: Arc<KeyIndex>,
}

impl Api {
    pub fn new(
        catalog: Catalog,
        sink: Arc<dyn InsertSink>,
        cpu: Cpu,
        limits: ApiLimits,
        metrics: Arc<IngestMetrics>,
    ) -> Arc<Api> {
        Arc::new(Api {
            slots: Semaphore::new(limits.max_concurrent_inserts.max(1)),
            keys: KeyIndex::new(limits.idempotency_keys),
            catalog,
            sink,
            cpu,
            limits,
            metrics,
        })
    }
}

/// An error answer.
#[derive(Debug, Clone, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    pub status: StatusCode,
    pub kind: &'static str,
    pub error: String,
    /// Where the error is, for bad rows and bad definitions.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub at: Option<Box<ErrorAt>>,
}

/// Where in a request an error lies.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ErrorAt {
    /// What is wrong, without the row and column (which have their own fields).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// 1-based data row of the body.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub row: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub column: Option<String>,
    /// The field of a table definition.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, error: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            error: error.into(),
            at: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(&self)).into_response()
    }
}

impl From<CatalogError> for ApiError {
    fn from(e: CatalogError) -> ApiError {
        let (status, kind) = match &e {
            CatalogError::NoSuchTable(_) => (StatusCode::NOT_FOUND, "no_such_table"),
            CatalogError::InvalidName(_) => (StatusCode::BAD_REQUEST, "invalid_name"),
            CatalogError::Conflict { .. } => (StatusCode::CONFLICT, "table_conflict"),
            CatalogError::InUse { .. } => (StatusCode::CONFLICT, "table_in_use"),
            CatalogError::Damaged { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "catalog_damaged"),
            // Refused by a store short of disk space: nothing was written.
            CatalogError::Coord(c) if c.is_disk_full() => {
                (StatusCode::SERVICE_UNAVAILABLE, "disk_full")
            }
            CatalogError::Coord(_) => (StatusCode::SERVICE_UNAVAILABLE, "coordination"),
        };
        ApiError::new(status, kind, e.to_string())
    }
}

/// What a committed insert answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InsertResponse {
    pub rows: u64,
    /// Block numbers of the records, one per shard touched (more when a
    /// shard's rows exceed one record).
    pub blocks: Vec<u64>,
    pub commit_lsn: String,
    /// True when this answers a retry of a keyed insert that had committed:
    /// nothing was written this time, and the rest is the first answer.
    pub deduplicated: bool,
}

#[derive(Debug, Deserialize)]
struct InsertQuery {
    format: Option<String>,
}

/// The routes of tables and inserts.
pub fn router(api: Arc<Api>) -> Router {
    Router::new()
        .route("/tables", post(create_table).get(list_tables))
        .route(
            "/tables/{name}",
            get(show_table).delete(drop_table).patch(set_export),
        )
        .route("/tables/{name}/insert", post(insert))
        .route("/tables/{name}/maintenance", post(maintain))
        .with_state(api)
}

/// Refuses every request of `router` without the bearer token (when one is
/// configured) with 401, before any handler runs.
pub fn protect(router: Router, token: Option<ApiToken>) -> Router {
    let Some(token) = token else {
        return router;
    };
    let token = Arc::new(token);
    router.layer(axum::middleware::from_fn(
        move |req: Request, next: Next| {
            let token = Arc::clone(&token);
            async move {
                if token.matches(req.headers().get(header::AUTHORIZATION)) {
                    next.run(req).await
                } else {
                    let mut r = ApiError::new(
                        StatusCode::UNAUTHORIZED,
                        "unauthorized",
                        "missing or wrong bearer token (Authorization: Bearer <token>)",
                    )
                    .into_response();
                    r.headers_mut().insert(
                        header::WWW_AUTHENTICATE,
                        header::HeaderValue::from_static("Bearer"),
                    );
                    r
                }
            }
        },
    ))
}

async fn read_body(api: &Api, body: Body) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, api.limits.max_body_bytes)
        .await
        .map_err(|e| {
            // The only error before the limit is a broken connection.
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!(
                    "request body over {} bytes or unreadable: {e}",
                    api.limits.max_body_bytes
                ),
            )
        })
}

async fn create_table(
    State(api): State<Arc<Api>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_body(&api, body).await?;
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"));
    let def = if json {
        TableDef::from_json(&body)
    } else {
        match std::str::from_utf8(&body) {
            Ok(text) => TableDef::from_toml(text),
            Err(_) => Err(ferry_table::DefError {
                field: "definition".into(),
                reason: "not UTF-8 text".into(),
            }),
        }
    }
    .map_err(|e| ApiError {
        at: Some(Box::new(ErrorAt {
            field: Some(e.field.clone()),
            reason: Some(e.reason.clone()),
            ..ErrorAt::default()
        })),
        ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_definition", e.to_string())
    })?;
    let (table, created) = api.catalog.create(&def).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(table)).into_response())
}

async fn list_tables(State(api): State<Arc<Api>>) -> Result<Json<Vec<Table>>, ApiError> {
    Ok(Json(api.catalog.list().await?))
}

async fn show_table(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
) -> Result<Json<Table>, ApiError> {
    match api.catalog.get(&name).await? {
        Some(t) => Ok(Json(t)),
        None => Err(CatalogError::NoSuchTable(name).into()),
    }
}

/// `PATCH /tables/<name>` `{"export": {...} | null}`: the one part of a
/// definition that changes after creation (its export defaults and policy).
async fn set_export(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    body: Body,
) -> Result<Json<Table>, ApiError> {
    let body = read_body(&api, body).await?;
    let invalid = |e: ferry_table::DefError| ApiError {
        at: Some(Box::new(ErrorAt {
            field: Some(e.field.clone()),
            reason: Some(e.reason.clone()),
            ..ErrorAt::default()
        })),
        ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_definition", e.to_string())
    };
    let patch: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&body).map_err(|e| {
            invalid(ferry_table::DefError {
                field: "definition".into(),
                reason: format!("not a JSON object: {e}"),
            })
        })?;
    let export = match (patch.len(), patch.get("export")) {
        (1, Some(serde_json::Value::Null)) => None,
        (1, Some(v)) => Some(
            ferry_table::def::ExportDefaults::from_json(v.to_string().as_bytes())
                .map_err(invalid)?,
        ),
        _ => {
            return Err(invalid(ferry_table::DefError {
                field: "definition".into(),
                reason: "only export changes after creation: give {\"export\": {...}} or \
                         {\"export\": null}"
                    .into(),
            }))
        }
    };
    Ok(Json(api.catalog.set_export(&name, export).await?))
}

/// What an upkeep record answers: where it ends in the WAL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaintenanceResponse {
    pub commit_lsn: String,
}

/// Writes a table's upkeep record (a retirement for its retention, a
/// compaction), asked for by the node running its export policy, to the
/// WAL. Checked here so that what reaches the replicas is well formed: the
/// table exists under that id, and the partition and files are bounded.
/// What it changes is the replicas' decision (a retirement drops only
/// parts a named lake file holds whole).
async fn maintain(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    body: Body,
) -> Result<Json<MaintenanceResponse>, ApiError> {
    let body = read_body(&api, body).await?;
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", m);
    let record: Maintenance = serde_json::from_slice(&body)
        .map_err(|e| bad(format!("not a retirement or compaction: {e}")))?;
    let table = api
        .catalog
        .get(&name)
        .await?
        .ok_or_else(|| CatalogError::NoSuchTable(name.clone()))?;
    if table.id != record.table_id() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "table_conflict",
            format!(
                "table {name:?} has id {}, the record names {}",
                table.id,
                record.table_id()
            ),
        ));
    }
    let text_ok =
        |t: &str| t.len() <= MAX_COMPACT_PARTITION_BYTES && !t.chars().any(char::is_control);
    let well_formed = text_ok(record.partition_id())
        && match &record {
            Maintenance::Retire(r) => {
                r.files.len() <= MAX_RETIRED_FILES
                    && text_ok(&r.destination)
                    && text_ok(&r.commit)
                    && text_ok(&r.format)
                    && r.files.iter().all(|f| text_ok(&f.path) && text_ok(&f.part))
            }
            Maintenance::Compact(c) => c.target_rows > 0,
        };
    if !well_formed {
        return Err(bad(format!(
            "a retirement names at most {MAX_RETIRED_FILES} files, with printable names of at \
             most {MAX_COMPACT_PARTITION_BYTES} bytes; a compaction a target of at least a row"
        )));
    }
    match tokio::time::timeout(api.limits.commit_timeout, api.sink.maintain(record)).await {
        Ok(Ok(lsn)) => Ok(Json(MaintenanceResponse {
            commit_lsn: lsn.to_string(),
        })),
        Ok(Err(e)) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "outcome_unknown",
            format!("the record's outcome is unknown (applying it twice is harmless): {e}"),
        )),
        Err(_) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "outcome_unknown",
            format!(
                "the record was not committed within {:?}",
                api.limits.commit_timeout
            ),
        )),
    }
}

async fn drop_table(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
) -> Result<Json<Table>, ApiError> {
    Ok(Json(api.catalog.drop_table(&name).await?))
}

fn format_of(query: &InsertQuery, headers: &HeaderMap) -> Result<Format, ApiError> {
    if let Some(name) = &query.format {
        return Format::from_name(name).ok_or_else(|| {
            ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unknown_format",
                format!("unknown format {name:?} (ndjson, csv, arrow, parquet)"),
            )
        });
    }
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    Format::from_content_type(ct).ok_or_else(|| {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unknown_format",
            format!(
                "Content-Type {ct:?} is not an insert format ({}), and no ?format= was given",
                Format::ALL.map(Format::content_type).join(", ")
            ),
        )
    })
}

fn idempotency_key(headers: &HeaderMap) -> Result<Bytes, ApiError> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(Bytes::new());
    };
    let bytes = v.as_bytes();
    if bytes.is_empty()
        || bytes.len() > MAX_KEY_BYTES
        || !bytes.iter().all(|b| b.is_ascii_graphic())
    {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
            format!("Idempotency-Key must be 1 to {MAX_KEY_BYTES} printable ASCII characters without spaces ({} given)", bytes.len()),
        ));
    }
    Ok(Bytes::copy_from_slice(bytes))
}

/// Most Arrow bytes of rows in one WAL record by default (well under the
/// record limit: IPC framing adds a little to the in-memory size).
pub const RECORD_ROWS_BYTES: usize = 32 << 20;

async fn insert(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    Query(query): Query<InsertQuery>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = tokio::time::Instant::now();
    let format = format_of(&query, &headers);
    let label = format
        .as_ref()
        .map(|f| format!("{f:?}").to_lowercase())
        .unwrap_or_else(|_| "unknown".into());
    let result = match format {
        Ok(format) => insert_rows(&api, &name, format, &headers, body).await,
        Err(e) => Err(e),
    };
    let outcome = match &result {
        Ok(_) => "ok",
        Err(e) => e.kind,
    };
    api.metrics
        .inserts
        .get_or_create(&crate::metrics::InsertLabels {
            format: label,
            outcome: outcome.into(),
        })
        .inc();
    api.metrics
        .insert_seconds
        .observe(started.elapsed().as_secs_f64());
    match result {
        Ok(r) => Json(r).into_response(),
        Err(e) => {
            api.metrics.error(e.kind);
            e.into_response()
        }
    }
}

async fn insert_rows(
    api: &Arc<Api>,
    name: &str,
    format: Format,
    headers: &HeaderMap,
    body: Body,
) -> Result<InsertResponse, ApiError> {
    let key = idempotency_key(headers)?;
    let _slot = api.slots.try_acquire().map_err(|_| {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_inserts",
            format!(
                "{} inserts are already running; retry later",
                api.limits.max_concurrent_inserts
            ),
        )
    })?;
    let table = api
        .catalog
        .get(name)
        .await?
        .ok_or_else(|| ApiError::from(CatalogError::NoSuchTable(name.to_string())))?;
    let body = read_body(api, body).await?;
    let body_len = body.len() as u64;
    let max_rows = api.limits.max_rows;
    let record_rows_bytes = api.limits.record_rows_bytes.max(1);
    let keyed = !key.is_empty();
    let def = table.def.clone();
    let table_id = table.id;
    let decoded = api
        .cpu
        .run(move || -> Result<Decoded, ApiError> {
            let rows =
                ferry_table::rows::decode(&def, format, body, max_rows).map_err(|e| match e {
                    DecodeError::Row(r) => ApiError {
                        at: Some(Box::new(ErrorAt {
                            reason: Some(r.reason.clone()),
                            row: r.row,
                            column: r.column.clone(),
                            field: None,
                        })),
                        ..ApiError::new(StatusCode::BAD_REQUEST, "bad_row", r.to_string())
                    },
                    DecodeError::TooManyRows { limit } => ApiError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "too_many_rows",
                        format!("more than {limit} rows in one insert"),
                    ),
                })?;
            let internal = |e: arrow::error::ArrowError| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            };
            let mut payloads = Vec::new();
            let mut keyed_rows = Vec::new();
            for (shard, batch) in
                ferry_table::rows::split_by_shard(&def, &rows).map_err(internal)?
            {
                for slice in ferry_table::rows::slices(&batch, record_rows_bytes) {
                    // The digest is of the rows as Arrow IPC, as it always was:
                    // a retry after an upgrade that encodes parts differently
                    // still finds its records' keys.
                    if keyed {
                        keyed_rows.push((shard, slice.clone()));
                    }
                    payloads.push((shard, carried_parts(&def, table_id, &slice)?));
                }
            }
            let digest = match keyed {
                true => Some(idempotency::digest_rows(&keyed_rows).map_err(internal)?),
                false => None,
            };
            Ok((rows.rows as u64, payloads, digest))
        })
        .await?;
    let (rows, payloads, digest) = decoded;
    if payloads.is_empty() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "empty",
            "the body holds no rows",
        ));
    }
    // A keyed insert: answered from the index when it committed before,
    // refused when its key was used with other content or is being written.
    let ticket = match digest {
        None => None,
        Some(digest) => match api.keys.claim(table.id, key.clone(), digest) {
            Ok(Claim::Write(ticket)) => Some(ticket),
            Ok(Claim::Done(first)) => {
                return Ok(InsertResponse {
                    deduplicated: true,
                    ..first
                })
            }
            Err(Refusal::Reused) => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "idempotency_key_reused",
                    "this Idempotency-Key was used with other rows; nothing was written (use a new key for new rows)",
                ))
            }
            Err(Refusal::InFlight) => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "idempotency_key_in_flight",
                    "another request with this Idempotency-Key and these rows is being written now; nothing was written by this one: retry later for its answer",
                ))
            }
        },
    };
    let count = payloads.len();
    let inserts = payloads
        .into_iter()
        .enumerate()
        .map(|(i, (shard, parts))| Insert {
            table_id: table.id,
            shard,
            idempotency_key: match &digest {
                Some(d) => idempotency::record_key(&key, d, i, count),
                None => Bytes::new(),
            },
            rows: InsertRows::Parts(parts),
        })
        .collect();
    let commit_started = tokio::time::Instant::now();
    let unknown = |why: String| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "outcome_unknown",
            format!("outcome unknown, retry with the same idempotency key: {why}"),
        )
    };
    let inserted =
        match tokio::time::timeout(api.limits.commit_timeout, api.sink.insert(inserts)).await {
            Ok(Ok(inserted)) => inserted,
            Ok(Err(WriterError::Overloaded)) => {
                if let Some(t) = ticket {
                    t.nothing_written();
                }
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    "the writer has too many appends waiting; nothing was written, retry later",
                ));
            }
            Ok(Err(e @ WriterError::DiskFull { .. })) => {
                if let Some(t) = ticket {
                    t.nothing_written();
                }
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "disk_full",
                    e.to_string(),
                ));
            }
            Ok(Err(WriterError::InvalidRecords(e))) => {
                if let Some(t) = ticket {
                    t.nothing_written();
                }
                return Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_records", e));
            }
            Ok(Err(e)) => return Err(unknown(e.to_string())),
            Err(_) => {
                return Err(unknown(format!(
                    "not committed within {:?}",
                    api.limits.commit_timeout
                )))
            }
        };
    api.metrics
        .commit_seconds
        .observe(commit_started.elapsed().as_secs_f64());
    api.metrics.rows.inc_by(rows);
    api.metrics.bytes.inc_by(body_len);
    let answer = InsertResponse {
        rows,
        blocks: inserted.block_numbers,
        commit_lsn: inserted.commit_lsn.to_string(),
        deduplicated: false,
    };
    if let Some(t) = ticket {
        t.committed(answer.clone());
    }
    Ok(answer)
}

/// Rows, each record's shard and parts, and the digest of them all (for a
/// keyed insert).
type Decoded = (
    u64,
    Vec<(u32, Vec<CarriedPart>)>,
    Option<idempotency::Digest>,
);

/// The rows of one record as the part files every replica writes (see
/// `Record::InsertParts`).
fn carried_parts(
    def: &ferry_table::TableDef,
    table_id: u64,
    rows: &arrow::array::RecordBatch,
) -> Result<Vec<CarriedPart>, ApiError> {
    let parts = ferry_replica::part::carry(def, table_id, rows)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    if parts.len() > ferry_wal::record::MAX_CARRIED_PARTS {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "too_many_partitions",
            format!(
                "the rows of one insert span {} partitions, at most {}",
                parts.len(),
                ferry_wal::record::MAX_CARRIED_PARTS
            ),
        ));
    }
    Ok(parts)
}
