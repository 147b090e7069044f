//! Building a replica from a peer over HTTP: the donor's endpoint (served by
//! every replica node) and the source a new replica copies through.
//!
//! ```text
//! POST /replica/copy                         {"shard": S, "replica": R} -> the manifest
//! GET  /replica/copy/{hold}/parts/{table}/{part}   the part's bytes, then their crc32c
//! POST /replica/copy/{hold}/release          ends the hold
//! ```
//!
//! What a copy is and why it is consistent is `ferry_replica::replica::bootstrap`'s;
//! this module only carries its bytes.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use ferry_ingest::api::ApiError;
use ferry_replica::replica::bootstrap::{
    BootstrapManifest, BootstrapSource, LocalDonor, PartBytes,
};
use ferry_replica::{HoldError, PartName};
use serde::{Deserialize, Serialize};

use crate::http::{HttpBody, HttpPeers};

/// How long a donor may take to make its position durable and list it.
pub const MANIFEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a part's transfer may stall between two chunks.
pub const CHUNK_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Who asks for a copy.
#[derive(Debug, Serialize, Deserialize)]
pub struct CopyRequest {
    pub shard: u32,
    pub replica: u32,
}

/// The donor's endpoint over its replica.
pub fn router(donor: Arc<LocalDonor>) -> Router {
    Router::new()
        .route("/replica/copy", post(manifest))
        .route("/replica/copy/{hold}/parts/{table}/{part}", get(part))
        .route("/replica/copy/{hold}/release", post(release))
        .with_state(donor)
}

async fn manifest(
    State(donor): State<Arc<LocalDonor>>,
    Json(req): Json<CopyRequest>,
) -> Result<Json<BootstrapManifest>, ApiError> {
    let shard = donor.replica.lock().await.shard();
    if req.shard != shard {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "wrong_shard",
            format!(
                "this is a replica of shard {shard}; a replica of shard {} copies a replica of its own shard",
                req.shard
            ),
        ));
    }
    donor
        .take_manifest(req.shard, req.replica)
        .await
        .map(Json)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "replica", e.to_string()))
}

async fn part(
    State(donor): State<Arc<LocalDonor>>,
    Path((hold, table, part)): Path<(String, String, String)>,
) -> Result<Response, ApiError> {
    let bad = |what: &str| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", what.to_string());
    let table_id: u64 = table.parse().map_err(|_| bad("the table id is a number"))?;
    let name = PartName::parse(&part).ok_or_else(|| bad("not a part name"))?;
    let bytes = donor
        .open_part(&hold, table_id, &name)
        .await
        .map_err(|e| match e {
            HoldError::UnknownHold(_) | HoldError::NotListed { .. } => {
                ApiError::new(StatusCode::NOT_FOUND, "not_held", e.to_string())
            }
            HoldError::Replica(_) => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "replica", e.to_string())
            }
        })?;
    // An error while reading cuts the body: the copier sees too few bytes.
    let body =
        axum::body::Body::from_stream(futures::stream::unfold(Some(bytes), |bytes| async move {
            let mut bytes = bytes?;
            match bytes.next_chunk().await {
                Ok(Some(chunk)) => Some((Ok::<_, std::io::Error>(chunk), Some(bytes))),
                Ok(None) => None,
                Err(e) => Some((Err(std::io::Error::other(e)), None)),
            }
        }));
    Ok(body.into_response())
}

async fn release(
    State(donor): State<Arc<LocalDonor>>,
    Path(hold): Path<String>,
) -> Json<serde_json::Value> {
    donor.replica.lock().await.release_bootstrap(&hold);
    Json(serde_json::json!({}))
}

/// A donor node reached over HTTP.
pub struct HttpDonor {
    pub peers: HttpPeers,
    /// Its `host:port`.
    pub addr: String,
}

struct HttpPartBytes(HttpBody);

#[async_trait]
impl PartBytes for HttpPartBytes {
    async fn next_chunk(&mut self) -> Result<Option<Bytes>, String> {
        self.0.next_chunk().await.map_err(|e| e.to_string())
    }
}

#[async_trait]
impl BootstrapSource for HttpDonor {
    fn donor(&self) -> String {
        self.addr.clone()
    }

    async fn manifest(&self, shard: u32, replica: u32) -> Result<BootstrapManifest, String> {
        self.peers
            .post(
                &self.addr,
                "/replica/copy",
                &CopyRequest { shard, replica },
                MANIFEST_TIMEOUT,
            )
            .await
            .map_err(|e| e.to_string())
    }

    async fn part(
        &self,
        hold: &str,
        table_id: u64,
        name: &PartName,
    ) -> Result<Box<dyn PartBytes>, String> {
        let path = format!("/replica/copy/{hold}/parts/{table_id}/{name}");
        let body = self
            .peers
            .get_stream(&self.addr, &path, CHUNK_IDLE_TIMEOUT, CHUNK_IDLE_TIMEOUT)
            .await
            .map_err(|e| e.to_string())?;
        Ok(Box::new(HttpPartBytes(body)))
    }

    async fn release(&self, hold: &str) -> Result<(), String> {
        self.peers
            .post::<_, serde_json::Value>(
                &self.addr,
                &format!("/replica/copy/{hold}/release"),
                &serde_json::json!({}),
                Duration::from_secs(10),
            )
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }
}
