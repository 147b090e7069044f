//! The commit record a writer node keeps in coordination.

use std::sync::Arc;
use std::time::Duration;

use ferry_coord::{EmbeddedSessions, RenewingSession, SessionFactory};
use ferry_writer::driver::WriterStatus;

use ferry_node::commit_record::{read_wal_state, record_commits, WalState, WalStateRecording};
use ferry_wal::{Lsn, Term};

fn synced_at(term: Term, commit_lsn: Lsn) -> WriterStatus {
    WriterStatus {
        term,
        elected: true,
        synced: true,
        commit_lsn: commit_lsn.to_string(),
        ..WriterStatus::default()
    }
}

/// A session expiry does not stop the commit record: a new session is
/// taken and the record goes on moving.
#[tokio::test]
async fn the_commit_record_goes_on_after_a_session_expiry() {
    let store = ferry_coord::embedded::EmbeddedStore::in_memory(Default::default())
        .await
        .expect("store");
    let sessions: Arc<dyn SessionFactory> = Arc::new(EmbeddedSessions {
        store: store.clone(),
        timeout: Duration::from_secs(10),
        metrics: Default::default(),
    });
    let session = RenewingSession::open(Arc::clone(&sessions))
        .await
        .expect("session");
    let (status_tx, status) = tokio::sync::watch::channel(synced_at(1, Lsn(100)));
    let (report_tx, mut report) = tokio::sync::watch::channel(WalStateRecording::default());
    let recorder = tokio::spawn(record_commits(session.clone(), status, report_tx));
    let recorded =
        |lsn: u64| move |r: &WalStateRecording| r.recorded.map(|s| s.commit_lsn) == Some(Lsn(lsn));
    let within = Duration::from_secs(30);
    tokio::time::timeout(within, report.wait_for(recorded(100)))
        .await
        .expect("recorded in time")
        .expect("recorder runs");
    // Expire the recorder's session.
    let first = session.session().await.expect("live").session_id();
    assert!(store.expire_session(first).await.expect("expire"));
    status_tx.send_replace(synced_at(1, Lsn(200)));
    let r = tokio::time::timeout(within, report.wait_for(recorded(200)))
        .await
        .expect("recorded after the expiry in time")
        .expect("recorder runs")
        .clone();
    assert_eq!(r.failing, None);
    assert_eq!(r.session_renewals, 1, "{r:?}");
    let reader = sessions.open().await.expect("session");
    assert_eq!(
        read_wal_state(&*reader).await.expect("read"),
        WalState {
            term: 1,
            commit_lsn: Lsn(200)
        }
    );
    assert_ne!(session.session().await.expect("live").session_id(), first);
    reader.close().await;
    recorder.abort();
}

/// The record is a lower bound of what was committed: neither an older term
/// nor a lower commit_lsn moves it back.
#[tokio::test]
async fn the_recorded_state_never_goes_back() {
    use ferry_node::commit_record::record_wal_state;
    let store = ferry_coord::embedded::EmbeddedStore::in_memory(Default::default())
        .await
        .expect("store");
    let sessions = EmbeddedSessions {
        store,
        timeout: Duration::from_secs(10),
        metrics: Default::default(),
    };
    let s = sessions.open().await.expect("session");
    let state = |term, lsn| WalState {
        term,
        commit_lsn: Lsn(lsn),
    };
    assert_eq!(
        read_wal_state(&*s).await.expect("read"),
        WalState::default()
    );
    record_wal_state(&*s, state(2, 100)).await.expect("record");
    for older in [state(1, 200), state(3, 50), state(2, 99)] {
        record_wal_state(&*s, older).await.expect("record");
        assert_eq!(read_wal_state(&*s).await.expect("read"), state(2, 100));
    }
    record_wal_state(&*s, state(3, 150)).await.expect("record");
    assert_eq!(read_wal_state(&*s).await.expect("read"), state(3, 150));
    // A record that is not one is a clear error, not a zero.
    s.set("/ferry/wal", b"not json", None).await.expect("set");
    let e = read_wal_state(&*s).await.expect_err("invalid");
    assert!(e.to_string().contains("/ferry/wal"), "{e}");
    s.close().await;
}
