//! The HTTP endpoints of a node. Today: `GET /status`, the node's state as JSON.

use std::future::Future;

use anyhow::Context;
use axum::routing::get;
use axum::{Json, Router};
use tokio::task::JoinHandle;

/// Binds the HTTP endpoint's address. Done first thing, before a data dir is
/// touched, so that an unparseable or busy address fails with nothing changed.
pub async fn bind(listen: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the HTTP endpoint {listen}"))
}

/// Serves `GET /status` on `listener`; returns the bound address and the
/// server task.
pub fn serve_status<F, Fut>(
    listener: tokio::net::TcpListener,
    status: F,
) -> anyhow::Result<(String, JoinHandle<()>)>
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = serde_json::Value> + Send + 'static,
{
    let addr = listener.local_addr()?.to_string();
    let app = Router::new().route(
        "/status",
        get(move || {
            let status = status.clone();
            async move { Json(status().await) }
        }),
    );
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "HTTP endpoint failed");
        }
    });
    Ok((addr, task))
}
