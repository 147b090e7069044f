//! A replica's end of a walsender connection, for tests that check what a
//! safekeeper streams, or that stand in for a replica whose feedback holds
//! WAL removal and back-pressure.

use std::time::Duration;

use bytes::Bytes;
use ferry_env::{BoxConnection, Network};
use ferry_wal::proto::{
    self, FrameError, FrameReader, FromSafekeeper, ShardFeedback, ToSafekeeper,
};
use ferry_wal::Lsn;
use tokio::io::{AsyncWriteExt as _, ReadHalf, WriteHalf};

/// What a walsender sends on an open stream. Anything else it could send
/// (a refusal, removed WAL) ends the test's expectations, so
/// [`Walsender::next`] panics on it, naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Streamed {
    /// Committed WAL from `begin_lsn`, as far as the safekeeper knows.
    Wal {
        begin_lsn: Lsn,
        commit_lsn: Lsn,
        wal: Bytes,
    },
    /// The commit position, for a replica that is caught up.
    Keepalive { commit_lsn: Lsn },
}

/// WAL read off a walsender by [`Walsender::read_until`], with what a test
/// of the walsender itself asserts on (a test that only needs the bytes
/// ignores it).
#[derive(Debug, Clone)]
pub struct Received {
    /// Every byte streamed, from the start LSN on; it may reach past the end
    /// asked for, as far as the last frame did.
    pub wal: Bytes,
    /// Whether no frame carried WAL past the commit_lsn it announced.
    pub all_committed: bool,
}

/// A connection that sent `StartReplication`: reads frames through the
/// protocol's own cancel-safe [`FrameReader`] (so it can wait in a
/// `select!`), and writes feedback as the replica of its shard.
pub struct Walsender {
    frames: FrameReader<ReadHalf<BoxConnection>>,
    write: WriteHalf<BoxConnection>,
    shard: u32,
}

impl Walsender {
    /// Opens a walsender of the safekeeper at `addr` for `shard`, streaming
    /// from `start_lsn`, as a replica starting or resuming there does.
    ///
    /// # Panics
    /// When the safekeeper cannot be reached or the request not sent.
    pub async fn start(net: &dyn Network, addr: &str, shard: u32, start_lsn: Lsn) -> Walsender {
        let mut conn = net
            .connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connect to the safekeeper at {addr}: {e}"));
        proto::write_frame(
            &mut conn,
            &ToSafekeeper::StartReplication {
                shard_number: shard,
                start_lsn,
            },
        )
        .await
        .expect("start replication");
        let (read, write) = tokio::io::split(conn);
        Walsender {
            frames: FrameReader::new(read),
            write,
            shard,
        }
    }

    /// The next frame; `Ok(None)` once the safekeeper closed the stream.
    /// Cancel-safe, so that a replica can wait for WAL and for its next
    /// report at once.
    ///
    /// # Panics
    /// On a message a walsender does not send while streaming.
    pub async fn next(&mut self) -> Result<Option<Streamed>, FrameError> {
        Ok(match self.frames.next::<FromSafekeeper>().await? {
            None => None,
            Some(FromSafekeeper::Wal {
                begin_lsn,
                commit_lsn,
                wal,
            }) => Some(Streamed::Wal {
                begin_lsn,
                commit_lsn,
                wal,
            }),
            Some(FromSafekeeper::Keepalive { commit_lsn }) => {
                Some(Streamed::Keepalive { commit_lsn })
            }
            Some(other) => panic!("unexpected {other:?}"),
        })
    }

    /// The WAL streamed from `start` until it reaches `end`, with the checks
    /// every reader of a walsender makes: each frame arrives `within` the
    /// given time and continues the stream (keepalives are skipped).
    ///
    /// # Panics
    /// When a frame is late, unreadable, or does not continue the stream, or
    /// the stream ends first.
    pub async fn read_until(&mut self, start: Lsn, end: Lsn, within: Duration) -> Received {
        let mut received = Vec::new();
        let mut all_committed = true;
        while start.0 + (received.len() as u64) < end.0 {
            let frame = tokio::time::timeout(within, self.next())
                .await
                .expect("WAL in time")
                .expect("frame")
                .expect("open");
            if let Streamed::Wal {
                begin_lsn,
                commit_lsn,
                wal,
            } = frame
            {
                assert_eq!(
                    begin_lsn,
                    Lsn(start.0 + received.len() as u64),
                    "frames continue the stream"
                );
                all_committed &= begin_lsn.0 + wal.len() as u64 <= commit_lsn.0;
                received.extend_from_slice(&wal);
            }
        }
        Received {
            wal: Bytes::from(received),
            all_committed,
        }
    }

    /// Sends `feedback` (of any shard and replica, as a test may relay
    /// others' on this connection).
    pub async fn send_feedback(&mut self, feedback: ShardFeedback) -> Result<(), FrameError> {
        proto::write_frame(&mut self.write, &ToSafekeeper::Feedback(feedback)).await?;
        self.write.flush().await?;
        Ok(())
    }

    /// Reports that replica 0 of this walsender's shard received, made
    /// durable and uploaded everything below `lsn`, as of `reply_time_micros`
    /// (newer reports replace older ones): what a replica says once it
    /// applied WAL, and what lets WAL removal and back-pressure move on.
    pub async fn report_applied(
        &mut self,
        lsn: Lsn,
        reply_time_micros: u64,
    ) -> Result<(), FrameError> {
        self.send_feedback(ShardFeedback {
            shard_number: self.shard,
            replica_number: 0,
            last_received_lsn: lsn,
            disk_consistent_lsn: lsn,
            remote_consistent_lsn: lsn,
            reply_time_micros,
        })
        .await
    }
}

/// The committed WAL of the safekeeper at `addr` from LSN 0 until it reaches
/// `end`, read over a walsender of shard 0 with each frame `within` the
/// given time: what a test compares with what the writer acknowledged.
pub async fn read_committed(net: &dyn Network, addr: &str, end: Lsn, within: Duration) -> Received {
    Walsender::start(net, addr, 0, Lsn(0))
        .await
        .read_until(Lsn(0), end, within)
        .await
}
