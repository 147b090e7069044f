//! The replica's walreceiver: streams committed WAL of its shard from one
//! safekeeper after another, hands it to the [`Replica`], and sends feedback.
//!
//! It starts every stream at the replica's applied position
//! (`disk_consistent_lsn`), so WAL received but not applied before a
//! disconnect is simply received again. A connection that breaks or stays
//! silent past [`StreamConfig::silence_timeout`] (a partition sends no reset)
//! is dropped and the next safekeeper tried. It only moves bytes and timers:
//! every decision about WAL is the replica's.

use std::sync::Arc;
use std::time::Duration;

use ferry_env::{Clock, Network};
use ferry_wal::proto::{self, FrameReader, FromSafekeeper, ShardFeedback, ToSafekeeper};
use ferry_wal::Lsn;
use tokio::io::AsyncWriteExt;

use crate::replica::{ReplicaError, SharedReplica};

#[derive(Debug, Clone)]
pub struct StreamConfig {
    pub safekeepers: Vec<String>,
    /// Walsenders send keepalives every second; silence this long means the
    /// connection is dead.
    pub silence_timeout: Duration,
    pub reconnect_delay: Duration,
}

impl StreamConfig {
    pub fn new(safekeepers: Vec<String>) -> StreamConfig {
        StreamConfig {
            safekeepers,
            silence_timeout: Duration::from_secs(3),
            reconnect_delay: Duration::from_millis(200),
        }
    }
}

/// Streams until the replica fails (hostile WAL, a disk error): returns why.
pub async fn run(
    replica: SharedReplica,
    network: Arc<dyn Network>,
    clock: Arc<dyn Clock>,
    config: StreamConfig,
) -> ReplicaError {
    let mut next = 0usize;
    loop {
        if config.safekeepers.is_empty() {
            tokio::time::sleep(config.reconnect_delay).await;
            continue;
        }
        let addr = config.safekeepers[next % config.safekeepers.len()].clone();
        next += 1;
        match stream_from(&replica, network.as_ref(), clock.as_ref(), &addr, &config).await {
            Ok(()) => {}
            Err(StreamError::Replica(e)) => {
                tracing::error!(error = %e, "replica stopped");
                return e;
            }
            Err(StreamError::Connection(e)) => {
                tracing::debug!(%addr, error = %e, "walreceiver connection ended");
            }
        }
        tokio::time::sleep(config.reconnect_delay).await;
    }
}

enum StreamError {
    Replica(ReplicaError),
    Connection(String),
}

impl From<proto::FrameError> for StreamError {
    fn from(e: proto::FrameError) -> StreamError {
        StreamError::Connection(e.to_string())
    }
}

impl From<std::io::Error> for StreamError {
    fn from(e: std::io::Error) -> StreamError {
        StreamError::Connection(e.to_string())
    }
}

async fn stream_from(
    replica: &SharedReplica,
    network: &dyn Network,
    clock: &dyn Clock,
    addr: &str,
    config: &StreamConfig,
) -> Result<(), StreamError> {
    let conn = network.connect(addr).await?;
    let (read, mut write) = tokio::io::split(conn);
    let mut reader = FrameReader::new(read);
    let (shard, replica_number, start) = {
        let mut r = replica.lock().await;
        r.reset_stream();
        let s = r.subscribe().borrow().clone();
        (s.shard, s.replica, r.receive_from())
    };
    tracing::info!(%addr, %start, "streaming WAL");
    proto::write_frame(
        &mut write,
        &ToSafekeeper::StartReplication {
            shard_number: shard,
            start_lsn: start,
        },
    )
    .await?;
    write.flush().await?;
    loop {
        let msg =
            match tokio::time::timeout(config.silence_timeout, reader.next::<FromSafekeeper>())
                .await
            {
                Ok(msg) => msg?,
                Err(_) => return Err(StreamError::Connection("silent walsender".into())),
            };
        let Some(msg) = msg else { return Ok(()) };
        let (received, applied) = match msg {
            FromSafekeeper::Wal {
                begin_lsn,
                commit_lsn,
                wal,
            } => {
                let end = Lsn(begin_lsn.0 + wal.len() as u64);
                if end > commit_lsn {
                    return Err(StreamError::Connection(format!(
                        "{addr} sent WAL up to {end}, past its commit_lsn {commit_lsn}"
                    )));
                }
                let mut r = replica.lock().await;
                let applied = r
                    .receive(begin_lsn, &wal)
                    .await
                    .map_err(StreamError::Replica)?;
                (end, applied)
            }
            FromSafekeeper::Keepalive { .. } => {
                let r = replica.lock().await;
                (r.receive_from(), r.disk_consistent_lsn())
            }
            FromSafekeeper::Refused { reason, .. } => {
                return Err(StreamError::Connection(format!("{addr} refused: {reason}")))
            }
            _ => continue,
        };
        let feedback = ShardFeedback {
            shard_number: shard,
            replica_number,
            last_received_lsn: received,
            disk_consistent_lsn: applied,
            // Parts are kept on this replica's disk only.
            remote_consistent_lsn: applied,
            reply_time_micros: clock.unix_micros(),
        };
        proto::write_frame(&mut write, &ToSafekeeper::Feedback(feedback)).await?;
        write.flush().await?;
    }
}
