//! HTTP over the network seam on loopback TCP: a served router answers
//! typed calls; refusals, silence and oversized answers are errors of their
//! own kind, never a hang.

use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use axum::{Json, Router};
use ferry_env::{Network, TcpNetwork};
use ferry_export::peers::{PeerCalls, UnpinBody};
use ferry_node::http::{serve, CallError, HttpPeers, MAX_PEER_ANSWER_BYTES};
use ferry_wal::Lsn;

async fn served(router: Router) -> ferry_node::http::HttpServer {
    let listener = TcpNetwork.bind("127.0.0.1:0").await.expect("bind");
    serve(listener, router).expect("serve")
}

#[tokio::test]
async fn typed_calls_reach_the_routes_and_refusals_and_silence_are_errors() {
    let router = Router::new()
        .route(
            "/status",
            get(|| async { Json(serde_json::json!({"commit_lsn": "0/2A"})) }),
        )
        .route(
            "/exports/unpin",
            post(|Json(body): Json<serde_json::Value>| async move {
                if body["transaction_id"] == "known" {
                    Ok(Json(serde_json::json!({})))
                } else {
                    Err((axum::http::StatusCode::BAD_REQUEST, "no such export"))
                }
            }),
        )
        .route(
            "/silent",
            get(|| async {
                std::future::pending::<()>().await;
                "never"
            }),
        )
        .route(
            "/huge",
            get(|| async { vec![b'x'; MAX_PEER_ANSWER_BYTES + 1] }),
        );
    let server = served(router).await;
    let peers = HttpPeers::new(Arc::new(TcpNetwork), None);
    let addr = server.addr.clone();

    let lsn = peers
        .writer_commit_lsn(&addr, Duration::from_secs(5))
        .await
        .expect("commit_lsn");
    assert_eq!(lsn, Lsn(0x2A));

    let known = UnpinBody {
        transaction_id: "known".into(),
    };
    peers
        .unpin(&addr, &known, Duration::from_secs(5))
        .await
        .expect("unpin");
    let unknown = UnpinBody {
        transaction_id: "other".into(),
    };
    let refused = peers
        .unpin(&addr, &unknown, Duration::from_secs(5))
        .await
        .expect_err("refused");
    assert!(
        refused.contains("400") && refused.contains("no such export"),
        "{refused}"
    );

    let silent = peers
        .get::<serde_json::Value>(&addr, "/silent", Duration::from_millis(200))
        .await
        .expect_err("silence");
    assert!(matches!(silent, CallError::Timeout { .. }), "{silent}");

    let huge = peers
        .get::<serde_json::Value>(&addr, "/huge", Duration::from_secs(30))
        .await
        .expect_err("too large");
    assert!(matches!(huge, CallError::Http { .. }), "{huge}");

    let not_json = peers
        .get::<Lsn>(&addr, "/status", Duration::from_secs(5))
        .await
        .expect_err("not the expected JSON");
    assert!(matches!(not_json, CallError::Decode { .. }), "{not_json}");

    server.stop().await;
    let gone = peers
        .get::<serde_json::Value>(&addr, "/status", Duration::from_secs(5))
        .await
        .expect_err("stopped");
    assert!(matches!(gone, CallError::Connect { .. }), "{gone}");
}

#[tokio::test]
async fn the_token_is_sent_to_every_peer() {
    let router = Router::new().route(
        "/status",
        get(|headers: axum::http::HeaderMap| async move {
            Json(serde_json::json!({
                "commit_lsn": "0/1",
                "auth": headers.get("authorization").and_then(|v| v.to_str().ok()),
            }))
        }),
    );
    let server = served(router).await;
    let peers = HttpPeers::new(Arc::new(TcpNetwork), Some("s3cret".into()));
    let status: serde_json::Value = peers
        .get(&server.addr, "/status", Duration::from_secs(5))
        .await
        .expect("status");
    assert_eq!(status["auth"], "Bearer s3cret");
    let without = HttpPeers::new(Arc::new(TcpNetwork), Some(String::new()));
    let status: serde_json::Value = without
        .get(&server.addr, "/status", Duration::from_secs(5))
        .await
        .expect("status");
    assert!(status["auth"].is_null(), "an empty token is no token");
    server.stop().await;
}

/// Drops its sender when the request's handler is dropped (finished or
/// ended half-way).
struct HandlerAlive(#[allow(dead_code)] tokio::sync::oneshot::Sender<()>);

/// A router whose `/slow` handler tells when it started, waits for `go`,
/// and answers "done".
fn slow_router(
    started: tokio::sync::mpsc::Sender<tokio::sync::oneshot::Receiver<()>>,
    go: Arc<tokio::sync::Notify>,
) -> Router {
    Router::new().route(
        "/slow",
        get(move || {
            let started = started.clone();
            let go = Arc::clone(&go);
            async move {
                let (alive, gone) = tokio::sync::oneshot::channel();
                let _alive = HandlerAlive(alive);
                let _ = started.send(gone).await;
                go.notified().await;
                Json(serde_json::json!({"done": true}))
            }
        }),
    )
}

type SlowCall = (
    ferry_node::http::HttpServer,
    tokio::task::JoinHandle<Result<serde_json::Value, CallError>>,
    tokio::sync::mpsc::Receiver<tokio::sync::oneshot::Receiver<()>>,
);

/// An endpoint serving [`slow_router`] and a call of `/slow` to it in
/// flight; the receiver hears when the handler started.
async fn slow_call(go: Arc<tokio::sync::Notify>) -> SlowCall {
    let (started, handlers) = tokio::sync::mpsc::channel(1);
    let server = served(slow_router(started, go)).await;
    let addr = server.addr.clone();
    let call = tokio::spawn(async move {
        HttpPeers::new(Arc::new(TcpNetwork), None)
            .get::<serde_json::Value>(&addr, "/slow", Duration::from_secs(30))
            .await
    });
    (server, call, handlers)
}

#[tokio::test]
async fn an_aborted_endpoint_ends_the_requests_it_serves_as_a_crash_would() {
    let go = Arc::new(tokio::sync::Notify::new());
    let (server, call, mut handlers) = slow_call(Arc::clone(&go)).await;
    let gone = handlers.recv().await.expect("the handler started");
    server.abort().await;
    // The handler was dropped with the endpoint, not left running (a
    // handler left running would hold its sender until `go`).
    let ended = tokio::time::timeout(Duration::from_secs(10), gone).await;
    assert!(matches!(ended, Ok(Err(_))), "the handler ended: {ended:?}");
    go.notify_waiters();
    let answer = call.await.expect("call task");
    assert!(answer.is_err(), "no answer after the crash: {answer:?}");
}

#[tokio::test]
async fn a_stopped_endpoint_answers_the_requests_in_progress_first() {
    let go = Arc::new(tokio::sync::Notify::new());
    let (server, call, mut handlers) = slow_call(Arc::clone(&go)).await;
    let _gone = handlers.recv().await.expect("the handler started");
    let stopping = tokio::spawn(server.stop());
    // The stop waits for the request, which finishes once let go.
    tokio::task::yield_now().await;
    assert!(!stopping.is_finished(), "stop waits for the request");
    go.notify_one();
    stopping.await.expect("stopped");
    let answer = call.await.expect("call task").expect("answered");
    assert_eq!(answer["done"], true);
}
