//! The HTTP endpoint of a node: `GET /status` (the node's state as JSON),
//! `GET /metrics` (Prometheus text format) and, on nodes that take inserts, the
//! table and insert API of `ferry-ingest`. A configured bearer token protects
//! every route.

use std::future::Future;
use std::sync::Arc;

use crate::metrics::NodeMetrics;
use anyhow::Context;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use ferry_ingest::ApiToken;

/// Binds the HTTP endpoint's address. Done first thing, before a data dir is
/// touched, so that an unparseable or busy address fails with nothing changed.
pub async fn bind(listen: &str) -> anyhow::Result<Box<dyn ferry_env::Listener>> {
    use ferry_env::Network as _;
    ferry_env::TcpNetwork
        .bind(listen)
        .await
        .with_context(|| format!("binding the HTTP endpoint {listen}"))
}

/// The routes every node has: `/status` from `status`, `/metrics` from `metrics`.
pub fn node_routes<F, Fut>(status: F, metrics: Arc<NodeMetrics>) -> Router
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = serde_json::Value> + Send + 'static,
{
    Router::new()
        .route(
            "/status",
            get(move || {
                let status = status.clone();
                async move { Json(status().await) }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let metrics = Arc::clone(&metrics);
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.render().await,
                    )
                        .into_response()
                }
            }),
        )
}

/// A running endpoint.
pub type Server = ferry_node::http::HttpServer;

/// Serves `router` on `listener`, behind `token` when one is configured.
pub fn serve(
    listener: Box<dyn ferry_env::Listener>,
    router: Router,
    token: Option<ApiToken>,
) -> anyhow::Result<Server> {
    let app = ferry_ingest::api::protect(router, token);
    Ok(ferry_node::http::serve(listener, app)?)
}
