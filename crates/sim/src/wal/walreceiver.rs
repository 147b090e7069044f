//! A replica's side of START_REPLICATION, reduced to what the WAL random test
//! checks: it streams from one safekeeper after another (moving on when a
//! connection breaks or goes silent), sends feedback, and records every frame
//! that breaks a walsender invariant:
//!
//! * a `Wal` frame starts exactly where the previous one ended;
//! * a `Wal` frame never carries WAL past the commit_lsn it announces (only
//!   committed WAL reaches replicas);
//!
//! and, checked by the caller once the run is over, everything received is a
//! prefix of the committed WAL, byte for byte.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ferry_env::{Clock, Network, SharedClock};
use ferry_wal::proto::{self, FrameReader, FromSafekeeper, ShardFeedback, ToSafekeeper};
use ferry_wal::Lsn;
use tokio::io::AsyncWriteExt;

/// A walsender sends a keepalive every second; silence this long means the
/// connection is dead (a partition sends no reset).
const SILENCE_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause before trying the next safekeeper.
const RECONNECT_DELAY: Duration = Duration::from_millis(100);
/// Feedback is sent after this many WAL frames.
const FEEDBACK_EVERY_FRAMES: u64 = 4;

/// What the simulated replica received and saw wrong.
#[derive(Debug, Default)]
pub struct Received {
    /// WAL received so far, from LSN 0.
    pub wal: Vec<u8>,
    /// Highest commit_lsn any walsender announced.
    pub announced: Lsn,
    pub frames: u64,
    pub connections: u64,
    /// Broken walsender invariants, in the order seen.
    pub violations: Vec<String>,
}

/// Shared between the receiving task and the checker.
pub type SharedReceived = Arc<Mutex<Received>>;

pub fn lock(shared: &SharedReceived) -> MutexGuard<'_, Received> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Streams WAL of `shard` from `safekeepers`, in turn, forever.
pub async fn run(
    network: Arc<dyn Network>,
    clock: SharedClock,
    safekeepers: Vec<String>,
    shard: u32,
    received: SharedReceived,
) {
    let mut next = 0usize;
    loop {
        let addr = &safekeepers[next % safekeepers.len()];
        next += 1;
        if let Err(e) = stream_from(network.as_ref(), clock.as_ref(), addr, shard, &received).await
        {
            tracing::debug!(%addr, error = %e, "walreceiver connection ended");
        }
        tokio::time::sleep(RECONNECT_DELAY).await;
    }
}

async fn stream_from(
    network: &dyn Network,
    clock: &dyn Clock,
    addr: &str,
    shard: u32,
    received: &SharedReceived,
) -> Result<(), proto::FrameError> {
    let conn = network.connect(addr).await?;
    let (read, mut write) = tokio::io::split(conn);
    let mut reader = FrameReader::new(read);
    let start = Lsn(lock(received).wal.len() as u64);
    lock(received).connections += 1;
    proto::write_frame(
        &mut write,
        &ToSafekeeper::StartReplication {
            shard_number: shard,
            start_lsn: start,
        },
    )
    .await?;
    write.flush().await?;
    let mut frames = 0u64;
    loop {
        let msg = match tokio::time::timeout(SILENCE_TIMEOUT, reader.next::<FromSafekeeper>()).await
        {
            Ok(msg) => msg?,
            Err(_) => return Ok(()),
        };
        let Some(msg) = msg else { return Ok(()) };
        let feedback = {
            let mut r = lock(received);
            match msg {
                FromSafekeeper::Wal {
                    begin_lsn,
                    commit_lsn,
                    wal,
                } => {
                    let at = Lsn(r.wal.len() as u64);
                    let end = Lsn(begin_lsn.0 + wal.len() as u64);
                    if begin_lsn != at {
                        r.violations.push(format!(
                            "{addr}: walsender frame begins at {begin_lsn}, but the stream is at {at}"
                        ));
                        return Ok(());
                    }
                    if end > commit_lsn {
                        r.violations.push(format!(
                            "{addr}: walsender frame carries WAL up to {end}, past the commit_lsn {commit_lsn} it announces"
                        ));
                    }
                    r.announced = r.announced.max(commit_lsn);
                    r.wal.extend_from_slice(&wal);
                    r.frames += 1;
                    frames += 1;
                    frames.is_multiple_of(FEEDBACK_EVERY_FRAMES).then_some(end)
                }
                FromSafekeeper::Keepalive { commit_lsn } => {
                    r.announced = r.announced.max(commit_lsn);
                    None
                }
                // A refusal (storage failure) ends the stream; try the next one.
                _ => return Ok(()),
            }
        };
        if let Some(end) = feedback {
            proto::write_frame(
                &mut write,
                &ToSafekeeper::Feedback(ShardFeedback {
                    shard_number: shard,
                    replica_number: 0,
                    last_received_lsn: end,
                    disk_consistent_lsn: end,
                    remote_consistent_lsn: end,
                    reply_time_micros: clock.unix_micros(),
                }),
            )
            .await?;
            write.flush().await?;
        }
    }
}
