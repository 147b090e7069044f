//! Messages between the writer (proposer), safekeepers and replicas, and their
//! framing on a byte stream.
//!
//! A frame is `len: u32 LE | version: u8 | header | payload`, where `len` counts
//! everything after itself, `header` is the postcard encoding of a message enum and
//! `payload` is the bulk WAL of the messages that carry some ([`Message`]). The WAL
//! travels outside postcard so that it is neither copied into the encoding on the
//! way out nor copied out of the frame on the way in: a received append's WAL is a
//! slice of the frame buffer all the way to the disk write. A frame longer than
//! [`MAX_FRAME_BYTES`] or of another protocol version is refused before anything
//! is allocated or decoded; a header that does not decode is a typed error, never a
//! panic.

use std::io;

use bytes::{Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::membership::{Configuration, Position};
use crate::record::MAX_RECORD_BYTES;
use crate::{ClusterId, Lsn, Term, TermHistory};

/// Version byte of every frame; bumped on any incompatible message change.
pub const PROTOCOL_VERSION: u8 = 7;
/// Largest frame accepted: one maximal record plus headroom for the header fields.
pub const MAX_FRAME_BYTES: usize = MAX_RECORD_BYTES + (64 << 10);
/// Most WAL bytes a walsender puts in one message (Neon's MAX_SEND_SIZE).
pub const MAX_SEND_BYTES: usize = 128 << 10;
/// Most WAL bytes one recovery read ([`ToSafekeeper::ReadWal`]) may ask for. A
/// safekeeper answers it whole while it holds its acceptor, so one read must
/// neither stall its appends for long nor put a whole lag into one reply; a
/// writer reads a longer range as several reads, one after the other.
pub const MAX_READ_WAL_BYTES: u64 = 16 << 20;

/// The first message of a writer: who it is and what WAL it writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Greeting {
    /// The cluster the writer writes for; a safekeeper of another cluster (a
    /// wrong address, or a data dir of another deployment) refuses it.
    pub cluster_id: ClusterId,
    /// Random id of this writer incarnation, for logs.
    pub proposer_id: u128,
    /// The WAL timeline; a safekeeper serves exactly one and refuses others.
    pub timeline_id: u64,
    /// Segment size the writer expects; must match the safekeeper's.
    pub segment_bytes: u64,
    /// The writer's configuration (`None`: generation 0, the safekeepers it
    /// was started with). A safekeeper adopts a higher one; it refuses
    /// votes, elections and appends of a lower one.
    pub configuration: Option<Configuration>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GreetingResponse {
    /// The safekeeper's current term, so the writer can pick a higher one.
    pub term: Term,
    pub node_id: u64,
    /// Set by a safekeeper rebuilt from the backup that has not rejoined yet:
    /// it lost the promises of its votes, so it neither votes nor counts in an
    /// election, and only a writer that proves it is current may bring it
    /// back (see [`Restored`]).
    pub restored: Option<Restored>,
    /// The safekeeper's configuration after the greeting (`None`: generation
    /// 0). A writer of a lower generation starts over with it.
    pub configuration: Option<Configuration>,
}

/// A safekeeper rebuilt from the WAL backup, waiting to rejoin.
///
/// Its WAL is committed WAL up to `flush_lsn` and nothing else. What it forgot
/// is which terms it voted in: a writer still holding one of those votes, or
/// an older writer, must never get its acknowledgements. So it rejoins only a
/// writer that (1) greeted it after its quarantine ended (`ready`; the
/// quarantine outlasts every election that could still use a lost vote), then
/// (2) had a quorum of the other safekeepers acknowledge an append in its
/// term, sent after that greeting (no later term can have been elected by
/// them), and then sends a [`ProposerElected`] with `rejoin` set and
/// `start_streaming_at == flush_lsn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restored {
    pub flush_lsn: Lsn,
    /// The quarantine is over: a writer may start bringing it back.
    pub ready: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VoteResponse {
    pub term: Term,
    pub vote_given: bool,
    pub flush_lsn: Lsn,
    /// The safekeeper's peer horizon: WAL below it is on every safekeeper.
    pub truncate_lsn: Lsn,
    /// History cut at `flush_lsn`.
    pub term_history: TermHistory,
    pub timeline_start_lsn: Lsn,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProposerElected {
    pub term: Term,
    /// Where this safekeeper's WAL stops agreeing with the writer's: it truncates
    /// to here (never below its commit_lsn) and receives WAL from here on.
    pub start_streaming_at: Lsn,
    /// The writer's history, ending with `(term, epoch start)`.
    pub term_history: TermHistory,
    pub timeline_start_lsn: Lsn,
    /// Brings back a safekeeper restored from the backup (see [`Restored`]):
    /// `start_streaming_at` is its flush_lsn, and its WAL below is committed
    /// WAL, hence the writer's.
    pub rejoin: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppendRequest {
    pub term: Term,
    pub begin_lsn: Lsn,
    pub end_lsn: Lsn,
    pub commit_lsn: Lsn,
    pub truncate_lsn: Lsn,
    /// The highest backup_lsn any safekeeper reported to the writer: WAL below
    /// it is in the remote backup (shared so that every safekeeper knows what
    /// it may remove).
    pub backup_lsn: Lsn,
    /// Whether this safekeeper is the one that uploads whole segments now (the
    /// writer picks one among the caught-up ones; a new term or a change of
    /// who is caught up moves the duty).
    pub backup_duty: bool,
    /// The lowest remote_consistent_lsn over every replica the writer heard of
    /// through any safekeeper (`None`: it heard of none yet).
    pub remote_consistent_lsn: Option<Lsn>,
    /// The writer's probe counter; answers echo the highest one received, so
    /// the writer knows an answer was made after a given append (it proves
    /// the safekeeper was still in this term then).
    pub probe: u64,
    /// Whole records, `end_lsn - begin_lsn` bytes (empty for a heartbeat); the
    /// frame's payload, not part of the postcard header.
    #[serde(skip)]
    pub wal: Bytes,
}

impl AppendRequest {
    /// The bounds agree with the payload.
    pub fn is_consistent(&self) -> bool {
        self.begin_lsn <= self.end_lsn
            && self.end_lsn.distance_from(self.begin_lsn) == self.wal.len() as u64
    }
}

/// What a replica (storage shard) tells about its progress; relayed by
/// safekeepers to the writer for back-pressure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardFeedback {
    pub shard_number: u32,
    /// Which replica of the shard: replicas of one shard report separately.
    pub replica_number: u32,
    pub last_received_lsn: Lsn,
    pub disk_consistent_lsn: Lsn,
    pub remote_consistent_lsn: Lsn,
    /// Microseconds since the Unix epoch at the replica when sent.
    pub reply_time_micros: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppendResponse {
    pub term: Term,
    pub flush_lsn: Lsn,
    pub commit_lsn: Lsn,
    /// WAL below this is in the remote backup, as far as this safekeeper knows.
    pub backup_lsn: Lsn,
    /// The highest [`AppendRequest::probe`] this safekeeper received.
    pub probe: u64,
    /// Latest feedback of each shard streaming from this safekeeper.
    pub shard_feedback: Vec<ShardFeedback>,
    /// Replicas this safekeeper forgot (unregistered, or silent past the
    /// replica expiry), each with the newest reply time forgotten: the writer
    /// forgets them too, so that they hold neither removal nor back-pressure.
    pub forgotten_replicas: Vec<ForgottenReplica>,
}

/// A replica whose feedback up to `reply_time_micros` no longer counts; a
/// newer reply (the replica came back) registers it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgottenReplica {
    pub shard_number: u32,
    pub replica_number: u32,
    pub reply_time_micros: u64,
}

/// How a refusal for lack of disk space begins ([`FromSafekeeper::Refused`]'s
/// reason): the safekeeper wrote nothing of the refused appends, and takes
/// them again once space returns.
pub const DISK_FULL: &str = "disk_full:";

/// Whether a refusal's reason is [`DISK_FULL`]'s.
pub fn is_disk_full(reason: &str) -> bool {
    reason.starts_with(DISK_FULL)
}

/// Everything a safekeeper receives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToSafekeeper {
    Greeting(Greeting),
    VoteRequest {
        term: Term,
    },
    Elected(ProposerElected),
    Append(AppendRequest),
    /// The writer elected in `term` reads flushed WAL `[begin_lsn, end_lsn)` of
    /// this safekeeper (committed or not) to bring other safekeepers up to it;
    /// at most [`MAX_READ_WAL_BYTES`] at once.
    ReadWal {
        term: Term,
        begin_lsn: Lsn,
        end_lsn: Lsn,
    },
    /// Opens a walsender: stream committed WAL from `start_lsn`.
    StartReplication {
        shard_number: u32,
        start_lsn: Lsn,
    },
    Feedback(ShardFeedback),
    /// An operator unregisters a replica that is gone for good: its feedback
    /// up to `reply_time_micros` (the operator's clock) stops holding WAL
    /// removal and back-pressure. Answered with [`FromSafekeeper::Forgotten`].
    ForgetReplica(ForgottenReplica),
    /// A safekeeper that lost its data dir asks a peer for a copy of its
    /// committed WAL from the peer's removal horizon on (see [`PullSnapshot`]);
    /// answered with [`FromSafekeeper::PullStart`], the WAL in
    /// [`FromSafekeeper::Wal`] frames, and [`FromSafekeeper::PullEnd`]. The
    /// donor holds its WAL removal at the horizon until the connection ends.
    Pull(PullRequest),
    /// The membership change driver hands a configuration over (adopted if
    /// its generation is higher) and raises the term to at least `min_term`
    /// (a new member never lets a writer be elected in a term an older one
    /// already used); answered with [`FromSafekeeper::Configured`].
    Configure {
        cluster_id: ClusterId,
        configuration: Configuration,
        min_term: Term,
    },
    /// Where this safekeeper's WAL stands, changing nothing: asked by a
    /// peer that looks for a donor to catch up from while no writer runs;
    /// answered with [`FromSafekeeper::Configured`].
    Position {
        cluster_id: ClusterId,
    },
}

/// Prefix of a refusal's reason when the writer's generation is older than
/// the safekeeper's (or the safekeeper is not in its configuration): the
/// writer greets it again to learn the newer configuration.
pub const GENERATION: &str = "generation:";

/// Who asks for a pull: the donor refuses a safekeeper of another cluster,
/// timeline or segment size, and itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullRequest {
    pub cluster_id: ClusterId,
    pub timeline_id: u64,
    pub segment_bytes: u64,
    pub node_id: u64,
}

/// A donor's state at the start of a pull: its committed WAL
/// `[start_lsn, commit_lsn)` follows. `start_lsn` is the start of the
/// donor's first segment kept (its removal horizon, held while the pull
/// runs); the WAL below is in the backup (`backup_lsn`), not copied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullSnapshot {
    pub term: Term,
    /// History cut at `commit_lsn`.
    pub term_history: TermHistory,
    pub timeline_start_lsn: Lsn,
    pub start_lsn: Lsn,
    pub commit_lsn: Lsn,
    pub backup_lsn: Lsn,
    pub peer_horizon_lsn: Lsn,
    pub remote_consistent_lsn: Lsn,
    /// The donor's configuration, adopted by the copy.
    pub configuration: Option<Configuration>,
}

/// The answer to [`ToSafekeeper::Configure`]: the safekeeper's state after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Configured {
    pub node_id: u64,
    pub configuration: Option<Configuration>,
    pub term: Term,
    pub position: Position,
    pub commit_lsn: Lsn,
    /// Rebuilt (restored or pulled) and not brought back by a writer yet.
    pub restored: bool,
}

/// Everything a safekeeper sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FromSafekeeper {
    Greeting(GreetingResponse),
    Vote(VoteResponse),
    Append(AppendResponse),
    /// Committed WAL for a replica, starting at `begin_lsn`.
    Wal {
        begin_lsn: Lsn,
        commit_lsn: Lsn,
        /// The frame's payload, not part of the postcard header.
        #[serde(skip)]
        wal: Bytes,
    },
    /// Sent to a replica that is caught up, so it learns of commit progress.
    Keepalive {
        commit_lsn: Lsn,
    },
    /// The request was refused; `term` is the safekeeper's current term (a writer
    /// with a lower term has been superseded).
    Refused {
        term: Term,
        reason: String,
    },
    /// A walsender cannot stream from `start_lsn`: this safekeeper removed
    /// its WAL below `kept_from` and its backup does not hold it (or it has
    /// none). A replica every safekeeper answers this way cannot be built
    /// from the WAL service.
    WalRemoved {
        start_lsn: Lsn,
        kept_from: Lsn,
    },
    /// The answer to [`ToSafekeeper::ForgetReplica`]: whether the replica was
    /// registered here.
    Forgotten {
        was_registered: bool,
    },
    /// The answer to [`ToSafekeeper::Pull`].
    PullStart(PullSnapshot),
    /// The pull's WAL was all sent; `term` and `commit_lsn` are the donor's
    /// now (never below the snapshot's: a donor that went back, restarted
    /// from less, is not copied).
    PullEnd {
        term: Term,
        commit_lsn: Lsn,
    },
    Configured(Configured),
}

/// A message of the protocol: a postcard header, and for some messages a bulk
/// payload carried after it in the same frame (see the module documentation).
pub trait Message: Serialize + DeserializeOwned {
    /// The payload sent after the header, if this message carries one.
    fn payload(&self) -> Option<&Bytes>;
    /// Where a received payload goes; `None` for messages that carry none.
    fn payload_mut(&mut self) -> Option<&mut Bytes>;
}

impl Message for ToSafekeeper {
    fn payload(&self) -> Option<&Bytes> {
        match self {
            ToSafekeeper::Append(a) => Some(&a.wal),
            _ => None,
        }
    }

    fn payload_mut(&mut self) -> Option<&mut Bytes> {
        match self {
            ToSafekeeper::Append(a) => Some(&mut a.wal),
            _ => None,
        }
    }
}

impl Message for FromSafekeeper {
    fn payload(&self) -> Option<&Bytes> {
        match self {
            FromSafekeeper::Wal { wal, .. } => Some(wal),
            _ => None,
        }
    }

    fn payload_mut(&mut self) -> Option<&mut Bytes> {
        match self {
            FromSafekeeper::Wal { wal, .. } => Some(wal),
            _ => None,
        }
    }
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection I/O: {0}")]
    Io(#[from] io::Error),
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("empty frame")]
    Empty,
    #[error("protocol version {got}, expected {expected}")]
    Version { got: u8, expected: u8 },
    #[error("undecodable message: {0}")]
    Decode(String),
    #[error("unencodable message: {0}")]
    Encode(String),
}

/// Encodes the length prefix, version and header of a frame; the payload, if any,
/// follows them on the stream as it is.
fn encode_head<T: Message>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let head = postcard::to_extend(msg, vec![0u8, 0, 0, 0, PROTOCOL_VERSION])
        .map_err(|e| FrameError::Encode(e.to_string()))?;
    let len = head.len() - 4 + msg.payload().map_or(0, Bytes::len);
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    let mut head = head;
    head[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(head)
}

/// Encodes a whole frame into a new buffer (tests and cold paths; streams use
/// [`write_frame`], which does not copy the payload).
pub fn encode_frame<T: Message>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = encode_head(msg)?;
    if let Some(payload) = msg.payload() {
        out.extend_from_slice(payload);
    }
    Ok(out)
}

/// Decodes the part of a frame after its length prefix; the payload of the
/// message is a slice of `frame`, not a copy.
pub fn decode_frame_body<T: Message>(frame: Bytes) -> Result<T, FrameError> {
    let (&version, body) = frame.split_first().ok_or(FrameError::Empty)?;
    if version != PROTOCOL_VERSION {
        return Err(FrameError::Version {
            got: version,
            expected: PROTOCOL_VERSION,
        });
    }
    let (mut msg, rest) =
        postcard::take_from_bytes::<T>(body).map_err(|e| FrameError::Decode(e.to_string()))?;
    let payload_start = frame.len() - rest.len();
    match msg.payload_mut() {
        Some(slot) => *slot = frame.slice(payload_start..),
        None if rest.is_empty() => {}
        None => {
            return Err(FrameError::Decode(format!(
                "{} bytes after a message that carries no payload",
                rest.len()
            )))
        }
    }
    Ok(msg)
}

/// Reads frames from a stream, keeping partial frames in its own buffer so that
/// [`FrameReader::next`] is cancel-safe: it can sit in a `select!` next to other
/// branches without losing bytes when another branch wins.
pub struct FrameReader<R> {
    reader: R,
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(reader: R) -> FrameReader<R> {
        FrameReader {
            reader,
            buf: BytesMut::with_capacity(64 << 10),
        }
    }

    /// Decodes the next frame if it is already buffered, without reading.
    pub fn next_buffered<T: Message>(&mut self) -> Option<Result<T, FrameError>> {
        if self.buf.len() < 4 {
            return None;
        }
        let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > MAX_FRAME_BYTES {
            return Some(Err(FrameError::TooLarge {
                len,
                max: MAX_FRAME_BYTES,
            }));
        }
        if self.buf.len() < 4 + len {
            return None;
        }
        let mut frame = self.buf.split_to(4 + len);
        let _prefix = frame.split_to(4);
        Some(decode_frame_body(frame.freeze()))
    }

    /// The next message; `Ok(None)` at a clean end of stream (between frames).
    /// Cancel-safe.
    pub async fn next<T: Message>(&mut self) -> Result<Option<T>, FrameError> {
        loop {
            if let Some(frame) = self.next_buffered() {
                return frame.map(Some);
            }
            if self.buf.len() >= 4 {
                // Make room for the rest of the frame in one allocation.
                let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                    as usize;
                self.buf.reserve((4 + len).saturating_sub(self.buf.len()));
            } else {
                self.buf.reserve(64 << 10);
            }
            // `read_buf` is cancel-safe: if this future is dropped, no byte is lost.
            if self.reader.read_buf(&mut self.buf).await? == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(FrameError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "stream ended inside a frame",
                )));
            }
        }
    }
}

/// Reads one message; `Ok(None)` at a clean end of stream (between frames).
/// Not cancel-safe (use [`FrameReader`] inside `select!`).
pub async fn read_frame<R, T>(reader: &mut R) -> Result<Option<T>, FrameError>
where
    R: AsyncRead + Unpin,
    T: Message,
{
    let mut len_bytes = [0u8; 4];
    match reader.read_exact(&mut len_bytes).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len_bytes) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    let mut frame = vec![0u8; len];
    reader.read_exact(&mut frame).await?;
    decode_frame_body(Bytes::from(frame)).map(Some)
}

/// Writes one message (without flushing buffered writers); the payload goes to
/// the stream from where it lies, without being copied into a frame first.
pub async fn write_frame<W, T>(writer: &mut W, msg: &T) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
    T: Message,
{
    writer.write_all(&encode_head(msg)?).await?;
    if let Some(payload) = msg.payload() {
        writer.write_all(payload).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    fn configuration() -> Configuration {
        Configuration::initial(vec![crate::membership::Member {
            id: 1,
            addr: "sk1:7000".into(),
        }])
        .expect("configuration")
        .joint(vec![crate::membership::Member {
            id: 2,
            addr: "sk2:7000".into(),
        }])
        .expect("joint")
    }

    use super::*;
    use crate::TermLsn;
    use proptest::prelude::*;

    fn history() -> TermHistory {
        TermHistory(vec![
            TermLsn {
                term: 1,
                lsn: Lsn(0),
            },
            TermLsn {
                term: 3,
                lsn: Lsn(4096),
            },
        ])
    }

    fn every_message() -> (Vec<ToSafekeeper>, Vec<FromSafekeeper>) {
        let feedback = ShardFeedback {
            shard_number: 2,
            replica_number: 1,
            last_received_lsn: Lsn(10),
            disk_consistent_lsn: Lsn(9),
            remote_consistent_lsn: Lsn(8),
            reply_time_micros: 1_700_000_000_000_000,
        };
        let to = vec![
            ToSafekeeper::Greeting(Greeting {
                cluster_id: ClusterId::new("c1").expect("id"),
                proposer_id: u128::MAX - 5,
                timeline_id: 1,
                segment_bytes: 16 << 20,
                configuration: Some(configuration()),
            }),
            ToSafekeeper::VoteRequest { term: 4 },
            ToSafekeeper::Elected(ProposerElected {
                term: 4,
                start_streaming_at: Lsn(4096),
                term_history: history(),
                timeline_start_lsn: Lsn(0),
                rejoin: true,
            }),
            ToSafekeeper::Append(AppendRequest {
                term: 4,
                begin_lsn: Lsn(4096),
                end_lsn: Lsn(4101),
                commit_lsn: Lsn(4000),
                truncate_lsn: Lsn(100),
                backup_lsn: Lsn(0),
                backup_duty: false,
                remote_consistent_lsn: None,
                probe: 3,
                wal: Bytes::from_static(b"hello"),
            }),
            ToSafekeeper::ReadWal {
                term: 4,
                begin_lsn: Lsn(0),
                end_lsn: Lsn(4096),
            },
            ToSafekeeper::StartReplication {
                shard_number: 2,
                start_lsn: Lsn(77),
            },
            ToSafekeeper::Feedback(feedback),
            ToSafekeeper::ForgetReplica(ForgottenReplica {
                shard_number: 1,
                replica_number: 2,
                reply_time_micros: 3,
            }),
            ToSafekeeper::Configure {
                cluster_id: ClusterId::new("c1").expect("id"),
                configuration: configuration(),
                min_term: 9,
            },
            ToSafekeeper::Position {
                cluster_id: ClusterId::new("c1").expect("id"),
            },
        ];
        let from = vec![
            FromSafekeeper::Greeting(GreetingResponse {
                term: 3,
                node_id: 1,
                restored: Some(Restored {
                    flush_lsn: Lsn(7),
                    ready: false,
                }),
                configuration: None,
            }),
            FromSafekeeper::Configured(Configured {
                node_id: 3,
                configuration: Some(configuration()),
                term: 9,
                position: Position {
                    last_log_term: 8,
                    flush_lsn: Lsn(77),
                },
                commit_lsn: Lsn(70),
                restored: true,
            }),
            FromSafekeeper::Vote(VoteResponse {
                term: 4,
                vote_given: true,
                flush_lsn: Lsn(5000),
                truncate_lsn: Lsn(100),
                term_history: history(),
                timeline_start_lsn: Lsn(0),
            }),
            FromSafekeeper::Append(AppendResponse {
                term: 4,
                flush_lsn: Lsn(4101),
                commit_lsn: Lsn(4000),
                backup_lsn: Lsn(0),
                probe: 3,
                shard_feedback: vec![feedback],
                forgotten_replicas: vec![ForgottenReplica {
                    shard_number: 4,
                    replica_number: 5,
                    reply_time_micros: 6,
                }],
            }),
            FromSafekeeper::Wal {
                begin_lsn: Lsn(77),
                commit_lsn: Lsn(90),
                wal: Bytes::from_static(&[1, 2, 3]),
            },
            FromSafekeeper::Keepalive {
                commit_lsn: Lsn(90),
            },
            FromSafekeeper::Refused {
                term: 9,
                reason: "stale term".into(),
            },
            FromSafekeeper::WalRemoved {
                start_lsn: Lsn(0),
                kept_from: Lsn(1 << 20),
            },
            FromSafekeeper::Forgotten {
                was_registered: true,
            },
        ];
        (to, from)
    }

    #[tokio::test]
    async fn every_message_round_trips_through_a_stream() {
        let (to, from) = every_message();
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        for msg in &to {
            write_frame(&mut a, msg).await.expect("write");
        }
        for msg in &from {
            write_frame(&mut a, msg).await.expect("write");
        }
        drop(a);
        for msg in &to {
            let got: ToSafekeeper = read_frame(&mut b).await.expect("read").expect("frame");
            assert_eq!(&got, msg);
        }
        for msg in &from {
            let got: FromSafekeeper = read_frame(&mut b).await.expect("read").expect("frame");
            assert_eq!(&got, msg);
        }
        let end: Option<ToSafekeeper> = read_frame(&mut b).await.expect("clean end");
        assert!(end.is_none());
    }

    #[tokio::test]
    async fn bad_frames_are_typed_errors() {
        let (to, _) = every_message();
        let mut frame = encode_frame(&to[0]).expect("encode");
        frame[4] = 99;
        assert!(matches!(
            decode_frame_body::<ToSafekeeper>(Bytes::copy_from_slice(&frame[4..])),
            Err(FrameError::Version { got: 99, .. })
        ));
        let (mut a, mut b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, &u32::MAX.to_le_bytes())
            .await
            .expect("write");
        assert!(matches!(
            read_frame::<_, ToSafekeeper>(&mut b).await,
            Err(FrameError::TooLarge { .. })
        ));
        // A frame cut in the middle is an I/O error, not a clean end.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let frame = encode_frame(&to[3]).expect("encode");
        tokio::io::AsyncWriteExt::write_all(&mut a, &frame[..frame.len() - 2])
            .await
            .expect("write");
        drop(a);
        assert!(matches!(
            read_frame::<_, ToSafekeeper>(&mut b).await,
            Err(FrameError::Io(_))
        ));
        // Bytes after a message that carries no payload are refused, and so is a
        // payload that disagrees with the append's bounds (checked by the
        // safekeeper with `is_consistent`).
        let mut frame = encode_frame(&to[1]).expect("encode");
        frame.extend_from_slice(b"junk");
        assert!(matches!(
            decode_frame_body::<ToSafekeeper>(Bytes::copy_from_slice(&frame[4..])),
            Err(FrameError::Decode(_))
        ));
        assert!(!AppendRequest {
            term: 1,
            begin_lsn: Lsn(10),
            end_lsn: Lsn(12),
            wal: Bytes::from_static(b"x"),
            ..AppendRequest::default()
        }
        .is_consistent());
    }

    #[tokio::test]
    async fn frame_reader_survives_cancellation_mid_frame() {
        let (to, _) = every_message();
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut reader = FrameReader::new(b);
        let frame = encode_frame(&to[3]).expect("encode");
        // Half a frame arrives; a read is started and abandoned.
        tokio::io::AsyncWriteExt::write_all(&mut a, &frame[..frame.len() / 2])
            .await
            .expect("write");
        let abandoned = tokio::time::timeout(
            std::time::Duration::from_millis(20),
            reader.next::<ToSafekeeper>(),
        )
        .await;
        assert!(abandoned.is_err(), "no whole frame yet");
        tokio::io::AsyncWriteExt::write_all(&mut a, &frame[frame.len() / 2..])
            .await
            .expect("write");
        write_frame(&mut a, &to[1]).await.expect("write");
        assert_eq!(
            reader.next::<ToSafekeeper>().await.expect("read"),
            Some(to[3].clone())
        );
        assert_eq!(
            reader
                .next_buffered::<ToSafekeeper>()
                .transpose()
                .expect("buffered"),
            Some(to[1].clone())
        );
        drop(a);
        assert_eq!(reader.next::<ToSafekeeper>().await.expect("end"), None);
    }

    #[test]
    fn a_received_payload_is_a_slice_of_the_frame() {
        let (to, _) = every_message();
        let frame = Bytes::from(encode_frame(&to[3]).expect("encode")).slice(4..);
        let ToSafekeeper::Append(append) =
            decode_frame_body::<ToSafekeeper>(frame.clone()).expect("decode")
        else {
            panic!("not an append");
        };
        assert_eq!(append.wal, Bytes::from_static(b"hello"));
        let frame_range = frame.as_ptr() as usize..frame.as_ptr() as usize + frame.len();
        assert!(frame_range.contains(&(append.wal.as_ptr() as usize)));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Messages with payloads of any size, written back to back and read
        /// through a pipe that delivers them in pieces, come out unchanged.
        #[test]
        fn payload_frames_round_trip_in_pieces(
            sizes in proptest::collection::vec(0usize..150_000, 1..8),
            pipe in 1usize..70_000,
        ) {
            let msgs: Vec<ToSafekeeper> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let wal = Bytes::from(vec![i as u8; n]);
                    ToSafekeeper::Append(AppendRequest {
                        term: 7,
                        begin_lsn: Lsn(i as u64 * 1_000_000),
                        end_lsn: Lsn(i as u64 * 1_000_000 + n as u64),
                        commit_lsn: Lsn(5),
                        truncate_lsn: Lsn(1),
                        backup_lsn: Lsn(0),
                        backup_duty: false,
                        remote_consistent_lsn: None,
                        probe: 0,
                        wal,
                    })
                })
                .collect();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime");
            let got = runtime.block_on(async {
                let (mut a, b) = tokio::io::duplex(pipe);
                let expected = msgs.len();
                let reader = tokio::spawn(async move {
                    let mut reader = FrameReader::new(b);
                    let mut got = Vec::new();
                    while let Some(msg) = reader.next::<ToSafekeeper>().await.expect("read") {
                        got.push(msg);
                    }
                    got
                });
                for msg in &msgs {
                    write_frame(&mut a, msg).await.expect("write");
                }
                drop(a);
                let got = reader.await.expect("reader");
                assert_eq!(got.len(), expected);
                got
            });
            prop_assert_eq!(got, msgs);
        }
    }

    proptest! {
        #[test]
        fn garbage_never_panics(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut frame = vec![PROTOCOL_VERSION];
            frame.extend(body);
            let frame = Bytes::from(frame);
            let _ = decode_frame_body::<ToSafekeeper>(frame.clone());
            let _ = decode_frame_body::<FromSafekeeper>(frame);
        }
    }
}
