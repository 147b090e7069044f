//! A data dir's identity, as the coordination store records it.
//!
//! `/ferry/cluster` holds what the cluster *is* (its id, its safekeepers, its
//! WAL geometry), `/ferry/wal` the last commit state known (term and
//! commit_lsn, recorded after every election, about once a second while
//! commit_lsn moves, and at a clean stop). Every safekeeper's control file
//! records the same cluster id. At start, the three are checked against each
//! other, so that a lost or replaced part is refused instead of silently
//! starting over:
//!
//! * no cluster record, but safekeepers exist: the coordination store was lost;
//! * a safekeeper without a control file, of another cluster, or with WAL
//!   missing or damaged below its recorded commit point: that safekeeper is
//!   down (the others run if they are a quorum);
//! * every safekeeper holds less WAL than `/ferry/wal` says was committed: the
//!   WAL quorum is younger than the cluster (the writer refuses to be elected);
//! * different flags than the data dir was made with (`--safekeepers`,
//!   `--segment-bytes`): a membership or geometry change, refused.
//!
//! Creation is resumable: the record is written first in state `creating`, the
//! safekeepers are created, then the record becomes `ready`. Only a data dir
//! whose record says `creating` (or that has nothing at all) creates safekeepers.

use std::path::Path;

use anyhow::Context;
use ferry_coord::{CoordError, Coordination, CreateMode};
use ferry_wal::{ClusterId, Lsn, Term};
use serde::{Deserialize, Serialize};

/// Coordination path under which ferry keeps its state.
pub const ROOT: &str = "/ferry";
const CLUSTER: &str = "/ferry/cluster";
const WAL_STATE: &str = "/ferry/wal";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterState {
    /// Safekeepers are being created (a crash here is finished on restart).
    Creating,
    Ready,
}

/// What a cluster is; written once (state aside), never changed by flags.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterRecord {
    pub cluster_id: ClusterId,
    pub safekeepers: usize,
    pub segment_bytes: u64,
    pub state: ClusterState,
    /// The safekeepers' addresses in the writers' order (the order decides
    /// which one has the backup duty), recorded by the first distributed
    /// writer; `None` for `ferry dev`, whose safekeepers live in its process,
    /// and for records written before addresses were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safekeeper_addrs: Option<Vec<String>>,
}

/// The last commit state the cluster is known to have reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WalState {
    pub term: Term,
    pub commit_lsn: Lsn,
}

/// Reads the cluster record, if there is one.
pub async fn read_record(session: &dyn Coordination) -> anyhow::Result<Option<ClusterRecord>> {
    match session.get(CLUSTER).await {
        Ok((data, _)) => Ok(Some(serde_json::from_slice(&data).with_context(|| {
            format!("the cluster record {CLUSTER} in the coordination store is not valid")
        })?)),
        Err(CoordError::NoNode { .. }) => Ok(None),
        Err(e) => Err(e).context("reading the cluster record"),
    }
}

/// Writes the cluster record (created if missing).
pub async fn write_record(
    session: &dyn Coordination,
    record: &ClusterRecord,
) -> anyhow::Result<()> {
    put(session, CLUSTER, &serde_json::to_vec(record)?).await
}

/// The last known commit state (zero for a new cluster).
pub async fn read_wal_state(session: &dyn Coordination) -> anyhow::Result<WalState> {
    match session.get(WAL_STATE).await {
        Ok((data, _)) => serde_json::from_slice(&data).with_context(|| {
            format!("the WAL state {WAL_STATE} in the coordination store is not valid")
        }),
        Err(CoordError::NoNode { .. }) => Ok(WalState::default()),
        Err(e) => Err(e).context("reading the last known WAL state"),
    }
}

/// Records a commit state; never moves the recorded one back.
pub async fn record_wal_state(session: &dyn Coordination, state: WalState) -> anyhow::Result<()> {
    let known = read_wal_state(session).await?;
    if (state.term, state.commit_lsn) <= (known.term, known.commit_lsn)
        || state.commit_lsn < known.commit_lsn
    {
        return Ok(());
    }
    put(session, WAL_STATE, &serde_json::to_vec(&state)?).await
}

async fn put(session: &dyn Coordination, path: &str, data: &[u8]) -> anyhow::Result<()> {
    ferry_coord::create_all(session, ROOT).await?;
    let written: Result<(), CoordError> =
        match session.create(path, data, CreateMode::Persistent).await {
            Ok(_) => Ok(()),
            Err(CoordError::NodeExists { .. }) => session.set(path, data, None).await.map(drop),
            Err(e) => Err(e),
        };
    written.with_context(|| format!("writing {path} in the coordination store"))
}

/// Cluster ids found in the safekeeper control files under `wal_dir`
/// (`sk<N>/safekeeper.control`), for the message that refuses a data dir
/// whose coordination store was lost. A damaged control file counts too.
pub fn safekeepers_on_disk(wal_dir: &Path) -> Vec<(String, String)> {
    let Ok(entries) = std::fs::read_dir(wal_dir) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let control = entry.path().join(ferry_safekeeper::control::CONTROL_FILE);
        if let Ok(bytes) = std::fs::read(&control) {
            let cluster = match ferry_safekeeper::control::decode(&bytes) {
                Ok(state) => state.cluster_id.to_string(),
                Err(e) => format!("unreadable: {e}"),
            };
            found.push((control.display().to_string(), cluster));
        }
    }
    found.sort();
    found
}

/// How often, at most, the last known commit state is written to coordination.
pub const RECORD_WAL_STATE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// How the writer's commit record in coordination fares, for `/status` and
/// metrics: a writer that cannot record its commit still serves, but the guard
/// against electing a writer on a lagging WAL quorum then checks a stale
/// value, so an operator must see it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WalStateRecording {
    /// The state this writer last wrote to `/ferry/wal`.
    pub recorded: Option<WalState>,
    /// The last error, while recording fails.
    pub failing: Option<String>,
    /// Failed attempts in a row (0 when the last one succeeded).
    pub failures_in_a_row: u64,
    pub failures_total: u64,
    /// New coordination sessions opened after one ended (expired or closed).
    pub session_renewals: u64,
}

/// One failure in how many is logged while recording keeps failing (at one
/// attempt per [`RECORD_WAL_STATE_EVERY`]: once a minute).
const LOG_EVERY_NTH_FAILURE: u64 = 60;

/// Keeps `/ferry/wal` near the writer's commit state: after the election and
/// then at most every [`RECORD_WAL_STATE_EVERY`] while commit_lsn moves. A
/// failed write is retried at that pace until it succeeds; a session that
/// ended (expired) is replaced by a new one. `report` tells how it fares.
pub async fn record_commits(
    session: ferry_coord::RenewingSession,
    mut status: tokio::sync::watch::Receiver<ferry_writer::driver::WriterStatus>,
    report: tokio::sync::watch::Sender<WalStateRecording>,
) {
    let mut recorded: Option<WalState> = None;
    loop {
        let now = {
            let s = status.borrow_and_update();
            s.synced
                .then(|| s.commit_lsn.parse::<ferry_wal::Lsn>().ok())
                .flatten()
                .map(|commit_lsn| WalState {
                    term: s.term,
                    commit_lsn,
                })
        };
        if let Some(state) = now.filter(|n| Some(*n) != recorded) {
            let written = async {
                let live = session.session().await?;
                record_wal_state(&*live, state).await
            }
            .await;
            let renewals = session.renewals();
            match written {
                Ok(()) => {
                    recorded = Some(state);
                    report.send_modify(|r| {
                        if r.failures_in_a_row > 0 {
                            tracing::info!(
                                failures = r.failures_in_a_row,
                                "the commit state is recorded again"
                            );
                        }
                        r.recorded = Some(state);
                        r.failing = None;
                        r.failures_in_a_row = 0;
                        r.session_renewals = renewals;
                    });
                }
                Err(e) => {
                    let error = format!("{e:#}");
                    report.send_modify(|r| {
                        if r.failures_in_a_row % LOG_EVERY_NTH_FAILURE == 0 {
                            tracing::error!(
                                %error,
                                failures_in_a_row = r.failures_in_a_row + 1,
                                "could not record the commit state; retrying"
                            );
                        }
                        r.failing = Some(error);
                        r.failures_in_a_row += 1;
                        r.failures_total += 1;
                        r.session_renewals = renewals;
                    });
                    // Retried without waiting for the commit to move.
                    tokio::time::sleep(RECORD_WAL_STATE_EVERY).await;
                    continue;
                }
            }
            tokio::time::sleep(RECORD_WAL_STATE_EVERY).await;
        }
        if status.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use ferry_coord::{EmbeddedSessions, RenewingSession, SessionFactory};
    use ferry_writer::driver::WriterStatus;

    use super::*;

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
        let recorded = |lsn: u64| {
            move |r: &WalStateRecording| r.recorded.map(|s| s.commit_lsn) == Some(Lsn(lsn))
        };
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
}
