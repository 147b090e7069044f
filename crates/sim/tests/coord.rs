//! Simulated coordination behaves like ZooKeeper under faults.

use std::time::Duration;

use ferry_coord::{CoordError, Coordination, CreateMode, SessionState};
use ferry_sim::coord::{CoordFaults, SimCoordination};

#[tokio::test(start_paused = true)]
async fn failure_after_apply_reports_connection_loss_but_applies() {
    let sim = SimCoordination::new(
        1,
        CoordFaults {
            fail_after_prob: 1.0,
            ..CoordFaults::default()
        },
    )
    .await
    .expect("sim");
    let s = sim
        .session("n1", Duration::from_secs(2))
        .await
        .expect("session");
    let err = s
        .create("/x", b"", CreateMode::Persistent)
        .await
        .expect_err("answer lost");
    assert!(err.is_connection_loss());
    sim.set_faults(CoordFaults::default());
    assert!(
        s.exists("/x").await.expect("exists").is_some(),
        "applied anyway"
    );
    assert!(matches!(
        s.create("/x", b"", CreateMode::Persistent).await,
        Err(CoordError::NodeExists { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn short_partition_keeps_the_session_long_one_expires_it() {
    let sim = SimCoordination::new(2, CoordFaults::default())
        .await
        .expect("sim");
    let a = sim
        .session("a", Duration::from_secs(2))
        .await
        .expect("session");
    let b = sim
        .session("b", Duration::from_secs(2))
        .await
        .expect("session");
    a.create("/lock", b"", CreateMode::Ephemeral)
        .await
        .expect("ephemeral");

    sim.partition("a");
    assert!(a
        .get("/lock")
        .await
        .expect_err("cut off")
        .is_connection_loss());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    sim.repair_all();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        b.exists("/lock").await.expect("exists").is_some(),
        "healed in time: the session lives"
    );
    assert_eq!(*a.session_state().borrow(), SessionState::Connected);

    sim.partition("a");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        b.exists("/lock").await.expect("exists"),
        None,
        "expired with its ephemeral"
    );
    assert_eq!(*a.session_state().borrow(), SessionState::Expired);
    sim.repair_all();
    assert!(matches!(a.get("/").await, Err(CoordError::SessionExpired)));
}

#[tokio::test(start_paused = true)]
async fn crashed_node_keeps_its_ephemerals_until_the_timeout() {
    let sim = SimCoordination::new(3, CoordFaults::default())
        .await
        .expect("sim");
    let a = sim
        .session("a", Duration::from_secs(3))
        .await
        .expect("session");
    let b = sim
        .session("b", Duration::from_secs(3))
        .await
        .expect("session");
    a.create("/owned", b"", CreateMode::Ephemeral)
        .await
        .expect("ephemeral");
    sim.crash_node("a");
    drop(a);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        b.exists("/owned").await.expect("exists").is_some(),
        "not gone before the timeout"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        b.exists("/owned").await.expect("exists"),
        None,
        "gone after it"
    );
}
