//! The commit record: `/ferry/wal` in coordination holds the last commit
//! state the cluster is known to have reached (term and commit_lsn). A writer
//! node keeps it near its own commit state ([`record_commits`]: after the
//! election, about once a second while commit_lsn moves, and at a clean
//! stop), and a starting writer reads it ([`read_wal_state`]) so that it
//! refuses to be elected on a WAL quorum younger than the cluster (every
//! safekeeper holding less WAL than was committed).
//!
//! Invariant: the recorded state never goes back ([`record_wal_state`]
//! writes only a state above the recorded one), so it is a lower bound of
//! what was committed, never more: committed WAL is on every quorum, so the
//! bound never blocks an election that keeps it.

use std::time::Duration;

use ferry_coord::{CoordError, Coordination, CreateMode, RenewingSession};
use ferry_wal::{Lsn, Term};
use ferry_writer::driver::WriterStatus;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// Coordination path under which ferry keeps its state.
pub const ROOT: &str = "/ferry";
/// The commit record's path.
pub const WAL_STATE: &str = "/ferry/wal";

/// How often, at most, the last known commit state is written to coordination.
pub const RECORD_WAL_STATE_EVERY: Duration = Duration::from_secs(1);

/// One failure in how many is logged while recording keeps failing (at one
/// attempt per [`RECORD_WAL_STATE_EVERY`]: once a minute).
const LOG_EVERY_NTH_FAILURE: u64 = 60;

/// The last commit state the cluster is known to have reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WalState {
    pub term: Term,
    pub commit_lsn: Lsn,
}

/// Why the commit record could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CommitRecordError {
    #[error("the WAL state {WAL_STATE} in the coordination store is not valid: {0}")]
    Invalid(String),
    #[error("{what} in the coordination store: {source}")]
    Coordination {
        what: &'static str,
        #[source]
        source: CoordError,
    },
}

fn coordination(what: &'static str) -> impl FnOnce(CoordError) -> CommitRecordError {
    move |source| CommitRecordError::Coordination { what, source }
}

/// The last known commit state (zero for a new cluster).
pub async fn read_wal_state(session: &dyn Coordination) -> Result<WalState, CommitRecordError> {
    match session.get(WAL_STATE).await {
        Ok((data, _)) => {
            serde_json::from_slice(&data).map_err(|e| CommitRecordError::Invalid(e.to_string()))
        }
        Err(CoordError::NoNode { .. }) => Ok(WalState::default()),
        Err(e) => Err(coordination("reading the last known WAL state")(e)),
    }
}

/// Records a commit state; never moves the recorded one back.
pub async fn record_wal_state(
    session: &dyn Coordination,
    state: WalState,
) -> Result<(), CommitRecordError> {
    let known = read_wal_state(session).await?;
    if (state.term, state.commit_lsn) <= (known.term, known.commit_lsn)
        || state.commit_lsn < known.commit_lsn
    {
        return Ok(());
    }
    let data = serde_json::to_vec(&state).map_err(|e| CommitRecordError::Invalid(e.to_string()))?;
    ferry_coord::create_all(session, ROOT)
        .await
        .map_err(coordination("creating /ferry"))?;
    let written = match session
        .create(WAL_STATE, &data, CreateMode::Persistent)
        .await
    {
        Ok(_) => Ok(()),
        Err(CoordError::NodeExists { .. }) => session.set(WAL_STATE, &data, None).await.map(drop),
        Err(e) => Err(e),
    };
    written.map_err(coordination("writing /ferry/wal"))
}

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

/// The commit state a writer's status shows, once it is synced (its
/// commit_lsn is then one a quorum holds in its term).
fn synced_state(s: &WriterStatus) -> Option<WalState> {
    if !s.synced {
        return None;
    }
    let commit_lsn = s.commit_lsn.parse::<Lsn>().ok()?;
    Some(WalState {
        term: s.term,
        commit_lsn,
    })
}

/// Keeps `/ferry/wal` near the writer's commit state: after the election and
/// then at most every [`RECORD_WAL_STATE_EVERY`] while commit_lsn moves. A
/// failed write is retried at that pace until it succeeds; a session that
/// ended (expired) is replaced by a new one. `report` tells how it fares.
pub async fn record_commits(
    session: RenewingSession,
    mut status: watch::Receiver<WriterStatus>,
    report: watch::Sender<WalStateRecording>,
) {
    let mut recorded: Option<WalState> = None;
    loop {
        let now = synced_state(&status.borrow_and_update());
        if let Some(state) = now.filter(|n| Some(*n) != recorded) {
            let written = match session.session().await {
                Ok(live) => record_wal_state(&*live, state).await,
                Err(e) => Err(coordination("opening a session")(e)),
            };
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
                    let error = e.to_string();
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
