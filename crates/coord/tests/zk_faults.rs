//! The ZooKeeper back-end under connection faults, through a TCP proxy that the
//! test can cut: connection loss is reported as such, a short outage keeps the
//! session, and an outage longer than the session timeout expires it.

// Tests set up and damage real files and sockets directly; node code may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

mod common;

use std::time::Duration;

use common::{ephemeral, Proxy, SOON};
use ferry_coord::zk::{ZkOptions, ZkSession};
use ferry_coord::{CoordError, Coordination, SessionState};

/// The proxy, a direct session, and a session through the proxy that owns
/// the ephemeral `/faults-{name}-{session id}` (whose path comes last).
async fn setup(name: &str) -> Option<(Proxy, ZkSession, ZkSession, String)> {
    let addr = common::zk_address()?;
    let proxy = Proxy::start(addr.clone()).await.expect("proxy");
    let mut through = ZkOptions::new(proxy.addr.clone());
    through.session_timeout = Duration::from_secs(2);
    through.connect_timeout = Duration::from_secs(5);
    let direct = ZkSession::connect(&ZkOptions::new(addr))
        .await
        .expect("direct session");
    let s = ZkSession::connect(&through)
        .await
        .expect("session through proxy");
    let path = format!("/faults-{name}-{}", s.session_id());
    ephemeral(&s, &path).await;
    Some((proxy, direct, s, path))
}

#[tokio::test]
async fn connection_loss_then_recovery_keeps_the_session() {
    let Some((proxy, direct, s, name)) = setup("keep").await else {
        return;
    };

    proxy.set_cut(true);
    let err = tokio::time::timeout(SOON, s.get(&name))
        .await
        .expect("answer in time")
        .expect_err("no connection");
    assert!(err.is_connection_loss(), "{err:?}");
    let mut state = s.session_state();
    tokio::time::timeout(SOON, state.wait_for(|st| *st == SessionState::Disconnected))
        .await
        .expect("disconnect observed")
        .expect("state");

    // Back within the session timeout: same session, ephemeral still there.
    proxy.set_cut(false);
    tokio::time::timeout(SOON, state.wait_for(|st| *st == SessionState::Connected))
        .await
        .expect("reconnected in time")
        .expect("state");
    let stat = s
        .exists(&name)
        .await
        .expect("exists")
        .expect("ephemeral kept");
    assert_eq!(stat.ephemeral_owner, s.session_id());
    s.close().await;
    assert_eq!(direct.exists(&name).await.expect("exists"), None);
}

#[tokio::test]
async fn long_partition_expires_the_session() {
    let Some((proxy, direct, s, name)) = setup("expire").await else {
        return;
    };
    let (_, watch) = direct.exists_watch(&name).await.expect("watch");

    proxy.set_cut(true);
    // The server expires the session after its timeout and deletes the ephemeral,
    // while the owner is still cut off.
    let event = tokio::time::timeout(SOON, watch.changed())
        .await
        .expect("deleted in time");
    assert_eq!(event.kind, ferry_coord::WatchEventKind::NodeDeleted);
    proxy.set_cut(false);
    let mut state = s.session_state();
    tokio::time::timeout(SOON, state.wait_for(|st| *st == SessionState::Expired))
        .await
        .expect("owner learns of the expiry on reconnect")
        .expect("state");
    assert!(matches!(s.get("/").await, Err(CoordError::SessionExpired)));
}
