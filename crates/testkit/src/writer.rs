//! Waiting on the writer's published status, which is how tests against a
//! running writer learn that elections, commits, backups and feedback took
//! effect.

use std::time::Duration;

use ferry_writer::driver::WriterStatus;
use tokio::sync::watch;

/// Waits (at most `within`) until the writer publishes a status where `ok`
/// holds.
///
/// # Panics
/// When it does not in time (`what` says what did not happen), or the
/// writer stopped.
pub async fn status_reaches(
    status: &mut watch::Receiver<WriterStatus>,
    within: Duration,
    what: &str,
    ok: impl FnMut(&WriterStatus) -> bool,
) {
    tokio::time::timeout(within, status.wait_for(ok))
        .await
        .expect(what)
        .expect("writer runs");
}
