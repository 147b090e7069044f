//! The export API of a node that holds replicas:
//!
//! ```text
//! POST /exports        {table, partition_id | all_partitions, destination, force, settings}
//!                      → 201 {created: [{transaction_id, key, parts_count, rows, snapshot_lsn,
//!                              unchanged?}], skipped?: [{partition_id, kind, error}], failed?: [...]}
//! GET  /exports        the status listing, from the node's mirror (no coordination read)
//! POST /exports/kill   {transaction_id} or {table, partition_id, destination}
//!                      → {status}
//! ```
//!
//! and, between nodes of the distributed deployment (`ferry_export::peers`):
//!
//! ```text
//! POST /exports/shard-snapshot  {shard, request}  → {parts: [...]} | {failed: ...}
//! POST /exports/unpin           {transaction_id}  → {}
//! ```

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use ferry_coord::Session;
use ferry_env::Clock;
use ferry_export::model::{check_name, check_transaction_id, ExportSettings, TaskKey};
use ferry_export::{Destination, Destinations, ExportsView, LocalParts, RequestError, Requester};
use ferry_ingest::api::ApiError;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// How long a request waits for its replicas to apply what was committed
/// when it arrived.
pub const APPLY_WAIT: Duration = Duration::from_secs(30);

pub struct ExportApi {
    /// Renewed after an expiry, so that requests go on without a restart.
    pub session: ferry_coord::RenewingSession,
    /// Kills run in sessions of their own.
    pub sessions: Arc<dyn ferry_coord::SessionFactory>,
    pub parts: Arc<dyn LocalParts>,
    /// This node's own replicas, for other nodes' shard snapshots.
    pub local: Arc<ferry_export::ReplicaSet>,
    pub destinations: Arc<dyn Destinations>,
    pub replica_name: String,
    pub clock: Arc<dyn Clock>,
    /// The commit position now (everything acknowledged is below it).
    pub commit_lsn: CommitPosition,
    /// Where the policies' upkeep records go (retention, compaction).
    pub maintain: ferry_export::policy::MaintenanceSink,
    /// What compaction aims a policy table's lake files at (bytes).
    pub target_file_bytes: u64,
    pub view: watch::Receiver<ExportsView>,
    /// Where this node's transaction ids come from (they only need to
    /// differ): drawn at the edge, fixed by the simulator's seed.
    pub ids: TransactionIds,
}

/// Draws of 64-bit numbers from a seed (splitmix64), shared by a node's
/// requests: the seed is the only randomness, so a simulated node replays.
#[derive(Debug, Default)]
pub struct TransactionIds {
    seed: u64,
    draws: std::sync::atomic::AtomicU64,
}

impl TransactionIds {
    pub fn new(seed: u64) -> TransactionIds {
        TransactionIds {
            seed,
            draws: Default::default(),
        }
    }

    pub fn next(&self) -> u64 {
        let n = self
            .draws
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .wrapping_add(1);
        let mut z = self
            .seed
            .wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportBody {
    pub table: String,
    #[serde(default)]
    pub partition_id: Option<String>,
    #[serde(default)]
    pub all_partitions: bool,
    pub destination: String,
    #[serde(default)]
    pub force: bool,
    #[serde(default)]
    pub settings: ExportSettings,
}

/// The answer to an export request. One partition: `created` holds its
/// task (any refusal is an error answer). Every partition
/// (`all_partitions`): each partition is requested on its own, with its own
/// transaction id; those with a live or unexpired export are `skipped`, those
/// refused for another reason are `failed`, and neither hides or stops the
/// rest.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct CreatedBody {
    pub created: Vec<ferry_export::Created>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<NotCreated>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<NotCreated>,
}

/// A partition of an `all_partitions` request that got no task.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NotCreated {
    pub partition_id: String,
    /// The error kind an answer for this partition alone would carry.
    pub kind: String,
    pub error: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KillBody {
    #[serde(default)]
    pub transaction_id: Option<String>,
    #[serde(default)]
    pub table: Option<String>,
    #[serde(default)]
    pub partition_id: Option<String>,
    #[serde(default)]
    pub destination: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct KillResult {
    pub key: String,
    pub transaction_id: String,
    pub status: String,
}

/// Where a node learns the commit position when a request arrives.
pub use ferry_export::policy::CommitPosition;

/// The export policies a node runs, and how they stop.
pub struct Policies {
    pub status: watch::Receiver<ferry_export::policy::PolicyStatus>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Policies {
    /// Starts the rounds of every table's export policy on this node's
    /// replicas (one node at a time runs a table's, under its policy lock).
    pub fn start(api: &ExportApi) -> Policies {
        let runner = ferry_export::policy::PolicyRunner {
            session: api.session.clone(),
            sessions: Arc::clone(&api.sessions),
            parts: Arc::clone(&api.parts),
            destinations: Arc::clone(&api.destinations),
            replica_name: api.replica_name.clone(),
            clock: Arc::clone(&api.clock),
            commit_lsn: Arc::clone(&api.commit_lsn),
            maintain: Arc::clone(&api.maintain),
            target_file_bytes: api.target_file_bytes,
            upkeep: Default::default(),
            view: api.view.clone(),
            seed: api.ids.next(),
        };
        let (status_tx, status) = watch::channel(Default::default());
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(runner.run(status_tx, stop_rx));
        Policies { status, stop, task }
    }

    /// Stops the rounds (a round in flight finishes) and releases the locks.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    /// Ends the rounds at once, as a crash does (the locks go with the
    /// node's sessions).
    pub async fn abort(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

pub fn router(api: Arc<ExportApi>) -> Router {
    Router::new()
        .route("/exports", get(list).post(create))
        .route("/exports/kill", post(kill))
        .route("/exports/shard-snapshot", post(shard_snapshot))
        .route("/exports/unpin", post(unpin))
        .with_state(api)
}

/// Another node's snapshot of a shard held here (it waits for the
/// request's position and pins the parts it lists).
async fn shard_snapshot(
    State(api): State<Arc<ExportApi>>,
    body: Result<
        Json<ferry_export::peers::ShardSnapshotBody>,
        axum::extract::rejection::JsonRejection,
    >,
) -> Result<Json<ferry_export::peers::ShardSnapshotAnswer>, ApiError> {
    let Json(body) =
        body.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
    if let Some(tx) = &body.request.pin {
        check_transaction_id(tx)
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.to_string()))?;
    }
    let wait = Duration::from_millis(body.request.wait_ms).min(APPLY_WAIT);
    let request = ferry_export::SnapshotRequest {
        wait_ms: wait.as_millis() as u64,
        ..body.request
    };
    Ok(Json(
        match api.local.snapshot_local(&request, &[body.shard]).await {
            Ok(parts) => ferry_export::peers::ShardSnapshotAnswer::Parts(parts),
            Err(e) => ferry_export::peers::ShardSnapshotAnswer::Failed(e),
        },
    ))
}

/// Releases the pins of a request whose task was not created.
async fn unpin(
    State(api): State<Arc<ExportApi>>,
    body: Result<Json<ferry_export::peers::UnpinBody>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", m);
    let Json(body) = body.map_err(|e| bad(e.body_text()))?;
    check_transaction_id(&body.transaction_id).map_err(|e| bad(e.to_string()))?;
    api.local
        .unpin(&body.transaction_id)
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unpin", e))?;
    Ok(Json(serde_json::json!({})))
}

async fn list(State(api): State<Arc<ExportApi>>) -> Json<ExportsView> {
    Json(api.view.borrow().clone())
}

fn request_error(e: RequestError) -> ApiError {
    let (status, kind) = match &e {
        RequestError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
        RequestError::NoSuchTable(_) => (StatusCode::NOT_FOUND, "no_such_table"),
        RequestError::EmptyPartition { .. } => (StatusCode::BAD_REQUEST, "empty_partition"),
        RequestError::Destination { .. } => (StatusCode::BAD_GATEWAY, "destination"),
        RequestError::AlreadyExists { .. } => (StatusCode::CONFLICT, "export_exists"),
        RequestError::SchemaMismatch { .. } => (StatusCode::CONFLICT, "schema_mismatch"),
        RequestError::Behind { .. } => (StatusCode::SERVICE_UNAVAILABLE, "replica_behind"),
        RequestError::StaleSnapshot { .. } => (StatusCode::SERVICE_UNAVAILABLE, "replica_behind"),
        RequestError::Retired { .. } => (StatusCode::CONFLICT, "partition_retired"),
        RequestError::NotHeld(_) => (StatusCode::NOT_IMPLEMENTED, "shards_not_held"),
        RequestError::NoPartitions(_) => (StatusCode::BAD_REQUEST, "empty_partition"),
        RequestError::LakeUpkeep(_) => (StatusCode::SERVICE_UNAVAILABLE, "lake_upkeep"),
        RequestError::Coordination(c) if c.is_disk_full() => {
            (StatusCode::SERVICE_UNAVAILABLE, "disk_full")
        }
        RequestError::Coordination(_) => (StatusCode::SERVICE_UNAVAILABLE, "coordination"),
    };
    ApiError::new(status, kind, e.to_string())
}

async fn create(
    State(api): State<Arc<ExportApi>>,
    body: Result<Json<ExportBody>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<CreatedBody>), ApiError> {
    let Json(body) =
        body.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
    let commit_lsn = (api.commit_lsn)().await.map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "commit_position",
            format!("cannot learn the commit position: {e}"),
        )
    })?;
    let session = live_session(&api.session).await?;
    // Each task gets a transaction id of its own.
    let requester = |random: u64| Requester {
        session: &session,
        sessions: api.sessions.as_ref(),
        parts: api.parts.as_ref(),
        destinations: api.destinations.as_ref(),
        replica_name: &api.replica_name,
        now_unix_millis: api.clock.unix_micros() / 1000,
        random,
        commit_lsn,
        wait: APPLY_WAIT,
    };
    let partitions = match (&body.partition_id, body.all_partitions) {
        (Some(p), false) => ferry_export::Partitions::One(p.clone()),
        (None, true) => ferry_export::Partitions::All,
        _ => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "give either partition_id or all_partitions",
            ))
        }
    };
    let request = ferry_export::TableRequest {
        table: body.table,
        partitions,
        destination: body.destination,
        force: body.force,
        settings: body.settings,
    };
    let requested = ferry_export::request_table(requester, &mut || api.ids.next(), &request)
        .await
        .map_err(request_error)?;
    let not_created = |(partition_id, e): (String, RequestError)| {
        let e = request_error(e);
        NotCreated {
            partition_id,
            kind: e.kind.to_string(),
            error: e.error,
        }
    };
    let answer = CreatedBody {
        created: requested.created,
        skipped: requested.skipped.into_iter().map(not_created).collect(),
        failed: requested.failed.into_iter().map(not_created).collect(),
    };
    Ok((StatusCode::CREATED, Json(answer)))
}

async fn kill(
    State(api): State<Arc<ExportApi>>,
    body: Result<Json<KillBody>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<KillResult>, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", m);
    let Json(body) = body.map_err(|e| bad(e.body_text()))?;
    let (key, destination_url, expect) = match (
        &body.transaction_id,
        &body.table,
        &body.partition_id,
        &body.destination,
    ) {
        (Some(tx), None, None, None) => {
            check_transaction_id(tx).map_err(|e| bad(e.to_string()))?;
            let found = api
                .view
                .borrow()
                .tasks
                .iter()
                .find(|t| &t.transaction_id == tx)
                .map(|t| {
                    (
                        TaskKey {
                            table: t.table.clone(),
                            key: t.key.clone(),
                        },
                        t.destination.clone(),
                    )
                });
            let Some((key, dest)) = found else {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "no_such_export",
                    format!("no export with transaction id {tx}"),
                ));
            };
            (key, dest, Some(tx.clone()))
        }
        (None, Some(table), Some(partition), Some(dest)) => {
            check_name("table name", table).map_err(|e| bad(e.to_string()))?;
            check_name("partition id", partition).map_err(|e| bad(e.to_string()))?;
            let location = api
                .destinations
                .open(dest)
                .map_err(|e| bad(e.to_string()))?;
            (
                TaskKey::new(table, partition, location.url()),
                location.url().to_string(),
                None,
            )
        }
        _ => {
            return Err(bad(
                "give transaction_id, or table, partition_id and destination".into(),
            ))
        }
    };
    let location = api
        .destinations
        .open(&destination_url)
        .map_err(|e| bad(e.to_string()))?;
    let destination = Destination::new(location);
    // The commit lock may be held for a moment by a committer.
    let mut attempt = 0;
    let status = loop {
        match ferry_export::task::kill_in_own_session(
            api.sessions.as_ref(),
            &key,
            expect.as_deref(),
            &destination,
            "killed by request",
            api.clock.unix_micros() / 1000,
        )
        .await
        {
            Ok(s) => break s,
            Err(ferry_export::task::KillError::Busy(_)) if attempt < 50 => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e @ ferry_export::task::KillError::NotFound(_)) => {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "no_such_export",
                    e.to_string(),
                ))
            }
            Err(e @ ferry_export::task::KillError::OtherTransaction { .. }) => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "other_transaction",
                    e.to_string(),
                ))
            }
            Err(e) => {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "coordination",
                    e.to_string(),
                ))
            }
        }
    };
    let tx = match expect {
        Some(tx) => tx,
        None => ferry_export::task::read_head(&live_session(&api.session).await?, &key)
            .await
            .ok()
            .flatten()
            .map(|h| h.transaction_id)
            .unwrap_or_default(),
    };
    Ok(Json(KillResult {
        key: key.to_string(),
        transaction_id: tx,
        status: status.to_string(),
    }))
}

/// The export requests' coordination session, a new one after an expiry.
async fn live_session(session: &ferry_coord::RenewingSession) -> Result<Session, ApiError> {
    session.session().await.map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "coordination",
            format!("no coordination session: {e}"),
        )
    })
}
