//! The HTTP endpoint of a node: `GET /status` (the node's state as JSON),
//! `GET /metrics` (Prometheus text format) and, on nodes that take inserts, the
//! table and insert API of `ferry-ingest`. A configured bearer token protects
//! every route.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::metrics::NodeMetrics;
use anyhow::Context;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use ferry_ingest::ApiToken;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long a stopping endpoint waits for requests in progress (inserts
/// waiting for their commit) before it drops them.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds the HTTP endpoint's address. Done first thing, before a data dir is
/// touched, so that an unparseable or busy address fails with nothing changed.
pub async fn bind(listen: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(listen)
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
pub struct Server {
    pub addr: String,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Server {
    /// Stops taking requests, lets those in progress finish (at most
    /// [`DRAIN_TIMEOUT`]), and returns once every route (and what it holds) is
    /// dropped.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(DRAIN_TIMEOUT, &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!("HTTP requests still running after {DRAIN_TIMEOUT:?}; dropping them");
            self.task.abort();
            let _ = self.task.await;
        }
    }
}

/// Serves `router` on `listener`, behind `token` when one is configured.
pub fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    token: Option<ApiToken>,
) -> anyhow::Result<Server> {
    let addr = listener.local_addr()?.to_string();
    let app = ferry_ingest::api::protect(router, token);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "HTTP endpoint failed");
        }
    });
    Ok(Server {
        addr,
        stop: Some(stop),
        task,
    })
}
