//! The acceptor: a safekeeper's side of the WAL protocol, over the control file
//! and the WAL storage.
//!
//! The acceptor is driven by a connection handler (TCP in production, in-memory
//! pipes in the simulator) and reaches the disk only through the [`Disk`] seam, so
//! the very same code runs in both.
//!
//! Invariants (each checked where it is enforced):
//! * `term` never decreases, and it is persisted before a vote is answered: a
//!   safekeeper votes at most once per term, even across crashes;
//! * WAL below `commit_lsn` is never truncated; an election that asks for it is
//!   refused (it would mean the writer lost committed WAL);
//! * appends are accepted only from the writer elected in the current term and
//!   only contiguously; `flush_lsn` is reported only after the fsync;
//! * `commit_lsn` never decreases and never exceeds `flush_lsn`.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use ferry_env::Disk;
use ferry_wal::liveness::Tombstones;
use ferry_wal::proto::{
    AppendRequest, AppendResponse, ForgottenReplica, FromSafekeeper, Greeting, GreetingResponse,
    ProposerElected, Restored, ShardFeedback, ToSafekeeper, VoteResponse, MAX_READ_WAL_BYTES,
    MAX_SEND_BYTES,
};
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn, Term};
use serde::Serialize;
use tokio::sync::watch;

use crate::backup::{BackupError, BackupView, RemoteWal};
use crate::control::{
    ControlFile, ControlFileError, RegisteredReplica, SafekeeperState, MAX_REGISTERED_REPLICAS,
};
use crate::wal_storage::{Preallocation, WalReader, WalStorage, WalStorageError};

/// Most WAL gathered from a batch of appends before it is written out.
const MAX_PENDING_WAL_BYTES: usize = 8 << 20;
/// Appends smaller than this are copied together into one write.
const JOIN_BELOW_BYTES: usize = 32 << 10;

/// Most replicas whose feedback a safekeeper keeps; feedback of more is
/// dropped (with a warning) rather than growing without bound.
pub const MAX_FEEDBACK_REPLICAS: usize = 4096;

/// The latest feedback of every replica streaming from this safekeeper, by
/// (shard, replica): replicas of one shard never overwrite each other. Shared
/// by the acceptor (which relays it to the writer) and its walsenders (which
/// record it) without the acceptor's lock. A forgotten replica (unregistered,
/// or silent past the replica expiry) leaves a tombstone: its feedback up to
/// the tombstone's reply time is ignored, so a stale copy relayed again does
/// not bring it back; a newer reply (the replica came back) does.
#[derive(Debug, Clone, Default)]
pub struct FeedbackBoard(Arc<std::sync::Mutex<Board>>);

#[derive(Debug, Default)]
struct Board {
    latest: BTreeMap<(u32, u32), ShardFeedback>,
    forgotten: Tombstones,
}

impl FeedbackBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Board> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `feedback` if it is the replica's newest (by its reply time).
    pub fn record(&self, feedback: ShardFeedback) {
        let key = (feedback.shard_number, feedback.replica_number);
        let mut board = self.lock();
        if board.forgotten.hides(&feedback) {
            return;
        }
        if !board.latest.contains_key(&key) && board.latest.len() >= MAX_FEEDBACK_REPLICAS {
            tracing::warn!(
                shard = key.0,
                replica = key.1,
                "feedback of too many replicas; this one is dropped"
            );
            return;
        }
        let newer = board
            .latest
            .get(&key)
            .is_none_or(|old| old.reply_time_micros <= feedback.reply_time_micros);
        if newer {
            board.latest.insert(key, feedback);
        }
    }

    /// Forgets a replica's feedback up to `forget.reply_time_micros`; returns
    /// whether it was registered (and is forgotten now). Feedback newer than
    /// that stays: the replica is alive.
    pub fn forget(&self, forget: ForgottenReplica) -> bool {
        let key = (forget.shard_number, forget.replica_number);
        let mut board = self.lock();
        let registered = board
            .latest
            .get(&key)
            .is_some_and(|f| f.reply_time_micros <= forget.reply_time_micros);
        if registered {
            board.latest.remove(&key);
        }
        board.forgotten.add(forget);
        registered
    }

    /// The tombstones, for the writer (which forgets the same replicas).
    pub fn forgotten(&self) -> Vec<ForgottenReplica> {
        self.lock().forgotten.list()
    }

    /// Every replica's latest feedback, in (shard, replica) order.
    pub fn all(&self) -> Vec<ShardFeedback> {
        self.lock().latest.values().copied().collect()
    }

    pub fn len(&self) -> usize {
        self.lock().latest.len()
    }

    /// Every replica's durably applied position, for the control file.
    pub fn registered(&self) -> Vec<RegisteredReplica> {
        self.lock()
            .latest
            .values()
            .take(MAX_REGISTERED_REPLICAS)
            .map(|f| RegisteredReplica {
                shard_number: f.shard_number,
                replica_number: f.replica_number,
                remote_consistent_lsn: f.remote_consistent_lsn,
            })
            .collect()
    }

    /// The lowest durably applied position of any replica (`None`: none known).
    pub fn min_remote_consistent(&self) -> Option<Lsn> {
        self.lock()
            .latest
            .values()
            .map(|f| f.remote_consistent_lsn)
            .min()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Committed WAL, readable without the acceptor (walsenders), and where their
/// replicas' feedback goes.
#[derive(Debug, Clone)]
pub struct CommittedWal {
    /// commit_lsn as it moves; it never goes back.
    pub commit: watch::Receiver<Lsn>,
    pub feedback: FeedbackBoard,
    reader: WalReader,
    /// The backup, where WAL removed locally is read from.
    remote: Option<RemoteWal>,
    backup: watch::Receiver<BackupView>,
}

impl CommittedWal {
    /// Committed WAL in `[begin, end)`, at most `max` bytes. `end` is the
    /// commit_lsn the caller announces with these bytes (taken from
    /// [`CommittedWal::commit`]): a walsender frame never carries WAL past the
    /// commit_lsn it states. WAL removed locally comes from the backup (more
    /// slowly) when the backup holds it.
    pub async fn read(&self, begin: Lsn, end: Lsn, max: usize) -> Result<Bytes, AcceptorError> {
        let end = end.min(*self.commit.borrow());
        if begin >= end {
            return Ok(Bytes::new());
        }
        match self.reader.read(begin, end, max).await {
            Err(WalStorageError::Removed { lsn }) => {
                let backup_lsn = self.backup.borrow().backup_lsn;
                match &self.remote {
                    Some(remote) if lsn < backup_lsn => {
                        Ok(remote.read(begin, end.min(backup_lsn), max).await?)
                    }
                    _ => Err(WalStorageError::Removed { lsn }.into()),
                }
            }
            other => Ok(other?),
        }
    }

    /// A reader of the same WAL that also reads from `remote` what was removed.
    pub fn with_remote(mut self, remote: RemoteWal) -> CommittedWal {
        self.remote = Some(remote);
        self
    }
}

/// Identity and geometry of a safekeeper.
#[derive(Debug, Clone)]
pub struct AcceptorConfig {
    /// The cluster this safekeeper belongs to: recorded at creation, checked at
    /// every open and in every writer's greeting.
    pub cluster_id: ClusterId,
    pub node_id: u64,
    pub timeline_id: u64,
    pub segment_size: SegmentSize,
    /// When WAL segments are zero-filled ahead of time.
    pub preallocation: Preallocation,
}

/// Why a message was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum AcceptorError {
    /// A protocol-level refusal: answered to the peer, the safekeeper goes on.
    #[error("refused (term {term}): {reason}")]
    Refused { term: Term, reason: String },
    /// The WAL could not be read or written: the safekeeper must stop.
    #[error(transparent)]
    Storage(#[from] WalStorageError),
    /// The control file could not be written: the safekeeper must stop.
    #[error(transparent)]
    Control(#[from] ControlFileError),
    /// The data dir holds another safekeeper than the one asked for (another
    /// cluster, node, timeline or segment size): it is left untouched.
    #[error("{0}")]
    Identity(String),
    /// WAL removed here could not be read from the backup.
    #[error("WAL backup: {0}")]
    Backup(#[from] BackupError),
}

impl AcceptorError {
    /// True for refusals, which end a request but not the safekeeper.
    pub fn is_refusal(&self) -> bool {
        matches!(self, AcceptorError::Refused { .. })
    }

    /// The message that tells the peer about a refusal.
    pub fn to_message(&self, term: Term) -> FromSafekeeper {
        match self {
            AcceptorError::Refused { term, reason } => FromSafekeeper::Refused {
                term: *term,
                reason: reason.clone(),
            },
            other => FromSafekeeper::Refused {
                term,
                reason: other.to_string(),
            },
        }
    }
}

/// What an operator sees of a safekeeper.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AcceptorStatus {
    pub node_id: u64,
    pub term: Term,
    pub last_log_term: Term,
    pub flush_lsn: String,
    pub commit_lsn: String,
    pub peer_horizon_lsn: String,
    pub backup_lsn: String,
    /// Whether the writer gave this safekeeper the backup duty.
    pub backup_duty: bool,
    /// Whole segments uploaded since start, and uploads that failed.
    pub backup_uploads: u64,
    pub backup_upload_failures: u64,
    /// Partial segment uploads since start: completed, failed (the term
    /// changed, or storage failed).
    pub partial_uploads: u64,
    pub partial_upload_failures: u64,
    /// The uploaded partial object, if any.
    pub partial_uploaded: Option<String>,
    /// The lowest remote_consistent_lsn of the replicas registered here or
    /// known to the writer.
    pub remote_consistent_lsn: String,
    /// The lowest remote_consistent_lsn the writer relayed (over every
    /// replica it heard of through any safekeeper), if it relayed one.
    pub writer_remote_consistent_lsn: Option<String>,
    /// WAL below this may be removed (the last removal's horizon).
    pub removal_horizon_lsn: String,
    /// Segments below this one are removed locally.
    pub last_removed_segno: u64,
    /// Segments removed since start.
    pub segments_removed: u64,
    /// Replicas forgotten since start (unregistered, or silent past the
    /// replica expiry): they no longer hold WAL removal.
    pub replicas_forgotten: u64,
    /// Replicas whose feedback this safekeeper relays.
    pub replicas: usize,
    /// Appends carrying WAL received since start.
    pub appends_received: u64,
    /// WAL fsyncs since start: appends / fsyncs is the group-commit factor.
    pub wal_fsyncs: u64,
    /// Whether new WAL segments are preallocated now (small commits).
    pub wal_preallocates: bool,
    /// WAL segments zero-filled since start.
    pub wal_segments_preallocated: u64,
    /// Rebuilt from the backup up to this LSN and not brought back yet: it
    /// does not vote.
    pub restored_up_to: Option<String>,
    /// Whether a restored safekeeper's quarantine is over (writers may start
    /// bringing it back).
    pub restore_quarantine_over: bool,
}

/// The acceptor of one safekeeper.
pub struct Acceptor {
    config: AcceptorConfig,
    control: ControlFile,
    /// Working copy of the persistent state; fields that must be durable before a
    /// reply are persisted right where they change.
    state: SafekeeperState,
    wal: WalStorage,
    commit_lsn: Lsn,
    /// Highest commit_lsn announced by appends not yet flushed.
    pending_commit_lsn: Lsn,
    /// WAL of the current batch, not yet written.
    /// WAL of the current batch, not yet written: slices of the received frames.
    pending_wal: Vec<Bytes>,
    pending_wal_bytes: usize,
    peer_horizon_lsn: Lsn,
    feedback: FeedbackBoard,
    commit_watch: watch::Sender<Lsn>,
    /// What the backup task follows.
    backup_view: watch::Sender<BackupView>,
    /// The writer's lowest remote_consistent_lsn over every replica it knows.
    writer_replica_horizon: Option<Lsn>,
    /// The highest backup_lsn the writer relayed; taken as ours up to our
    /// commit_lsn (so backup_lsn never passes commit_lsn).
    peer_backup_lsn: Lsn,
    removal_horizon: Lsn,
    appends_received: u64,
    wal_fsyncs: u64,
    backup_uploads: u64,
    backup_upload_failures: u64,
    partial_uploads: u64,
    partial_upload_failures: u64,
    segments_removed: u64,
    replicas_forgotten: u64,
    /// A restored safekeeper may be brought back only once this is set (by
    /// the server, after its quarantine; see `ferry_wal::proto::Restored`).
    quarantine_over: bool,
    /// The highest probe received in an append (echoed in answers).
    probe_seen: u64,
    /// The backup, where a recovery read finds WAL removed here.
    remote: Option<crate::backup::RemoteWal>,
}

/// What limits WAL removal, each part separately (for status and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemovalHorizon {
    /// The lowest remote_consistent_lsn of every registered replica (0 while
    /// none is known: nothing is removed before a replica reported).
    pub replicas: Lsn,
    /// WAL below this is on every safekeeper.
    pub peers: Lsn,
    /// WAL below this is backed up (`None`: backup is off).
    pub backup: Option<Lsn>,
    /// The slowest active walsender (`None`: not kept, or none active).
    pub walsenders: Option<Lsn>,
}

impl RemovalHorizon {
    /// WAL below this is needed by nobody.
    pub fn lsn(&self) -> Lsn {
        let mut h = self.replicas.min(self.peers);
        if let Some(b) = self.backup {
            h = h.min(b);
        }
        if let Some(w) = self.walsenders {
            h = h.min(w);
        }
        h
    }
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acceptor")
            .field("status", &self.status())
            .finish()
    }
}

fn refused(term: Term, reason: impl Into<String>) -> AcceptorError {
    AcceptorError::Refused {
        term,
        reason: reason.into(),
    }
}

impl Acceptor {
    /// Opens the existing safekeeper in `dir`: the control file first (it must
    /// exist and describe the safekeeper `config` asks for), then the WAL, whose
    /// every record below the persisted commit_lsn and durable point must be
    /// present and intact
    /// (an error names the file otherwise), walked on to its real end.
    pub async fn open(
        disk: Arc<dyn Disk>,
        dir: &str,
        config: AcceptorConfig,
    ) -> Result<Acceptor, AcceptorError> {
        let control = ControlFile::open(Arc::clone(&disk), dir).await?;
        Acceptor::open_with(disk, dir, config, control).await
    }

    /// Creates a new, empty safekeeper in `dir` (or opens it if it was created
    /// already, with the same identity). Only for a new cluster or a new member:
    /// never to replace a safekeeper whose data was lost, which must not vote
    /// as if it had never promised anything.
    pub async fn create(
        disk: Arc<dyn Disk>,
        dir: &str,
        config: AcceptorConfig,
    ) -> Result<Acceptor, AcceptorError> {
        let fresh = SafekeeperState::new(
            config.cluster_id.clone(),
            config.node_id,
            config.timeline_id,
            config.segment_size.bytes(),
        );
        let control = ControlFile::create(Arc::clone(&disk), dir, fresh).await?;
        Acceptor::open_with(disk, dir, config, control).await
    }

    async fn open_with(
        disk: Arc<dyn Disk>,
        dir: &str,
        config: AcceptorConfig,
        control: ControlFile,
    ) -> Result<Acceptor, AcceptorError> {
        let state = control.state().clone();
        if state.cluster_id != config.cluster_id
            || state.node_id != config.node_id
            || state.timeline_id != config.timeline_id
            || state.segment_bytes != config.segment_size.bytes()
        {
            return Err(AcceptorError::Identity(format!(
                "{dir} holds safekeeper {} of cluster {} (timeline {}, {}-byte WAL segments), not safekeeper {} of cluster {} (timeline {}, {}-byte WAL segments) as asked",
                state.node_id,
                state.cluster_id,
                state.timeline_id,
                state.segment_bytes,
                config.node_id,
                config.cluster_id,
                config.timeline_id,
                config.segment_size.bytes()
            )));
        }
        // Every record from the start of the timeline is checked while nothing
        // was removed; once segments are removed, from the persisted commit_lsn.
        let durable = state.commit_lsn.max(state.durable_lsn);
        let verify_from = if state.last_removed_segno == 0 {
            // A timeline start past the durable point (sent by a writer) must
            // not turn a start-up into a refusal: walk from the durable point.
            state.timeline_start_lsn.min(durable)
        } else {
            state.commit_lsn
        };
        let wal = WalStorage::open(
            disk,
            &format!("{dir}/wal"),
            config.segment_size,
            config.preallocation,
            verify_from,
            durable,
        )
        .await?;
        let commit_lsn = state.commit_lsn;
        let (commit_watch, _) = watch::channel(commit_lsn);
        let (backup_view, _) = watch::channel(BackupView {
            term: state.term,
            last_log_term: state.term_history.term_at(wal.flush_lsn()),
            flush_lsn: wal.flush_lsn(),
            commit_lsn,
            backup_lsn: state.backup_lsn,
            duty: false,
        });
        // Registered replicas are remembered across restarts: one that is
        // down now still holds back removal.
        let feedback = FeedbackBoard::default();
        for r in &state.registered_replicas {
            feedback.record(ShardFeedback {
                shard_number: r.shard_number,
                replica_number: r.replica_number,
                last_received_lsn: r.remote_consistent_lsn,
                disk_consistent_lsn: r.remote_consistent_lsn,
                remote_consistent_lsn: r.remote_consistent_lsn,
                reply_time_micros: 0,
            });
        }
        Ok(Acceptor {
            peer_horizon_lsn: state.peer_horizon_lsn,
            removal_horizon: Lsn(state.last_removed_segno * config.segment_size.bytes()),
            config,
            control,
            state,
            wal,
            commit_lsn,
            pending_commit_lsn: commit_lsn,
            pending_wal: Vec::new(),
            pending_wal_bytes: 0,
            feedback,
            commit_watch,
            backup_view,
            writer_replica_horizon: None,
            peer_backup_lsn: Lsn(0),
            appends_received: 0,
            wal_fsyncs: 0,
            backup_uploads: 0,
            backup_upload_failures: 0,
            partial_uploads: 0,
            partial_upload_failures: 0,
            segments_removed: 0,
            replicas_forgotten: 0,
            quarantine_over: false,
            probe_seen: 0,
            remote: None,
        })
    }

    pub fn term(&self) -> Term {
        self.state.term
    }

    /// The term that wrote the tail of this safekeeper's WAL.
    pub fn last_log_term(&self) -> Term {
        self.state.term_history.term_at(self.wal.flush_lsn())
    }

    pub fn flush_lsn(&self) -> Lsn {
        self.wal.flush_lsn()
    }

    pub fn commit_lsn(&self) -> Lsn {
        self.commit_lsn
    }

    pub fn state(&self) -> &SafekeeperState {
        &self.state
    }

    /// Follows commit_lsn (walsenders wait on it).
    pub fn subscribe_commit(&self) -> watch::Receiver<Lsn> {
        self.commit_watch.subscribe()
    }

    /// What a walsender needs to stream without this acceptor: commit_lsn to
    /// follow and a reader of the WAL below it (which is never truncated).
    pub fn committed_wal(&self) -> CommittedWal {
        CommittedWal {
            commit: self.commit_watch.subscribe(),
            feedback: self.feedback.clone(),
            reader: self.wal.reader(),
            remote: None,
            backup: self.backup_view.subscribe(),
        }
    }

    /// Follows what the backup needs: commit_lsn, backup_lsn, term and duty.
    pub fn subscribe_backup(&self) -> watch::Receiver<BackupView> {
        self.backup_view.subscribe()
    }

    /// A reader of committed WAL for the backup (whole segments below
    /// commit_lsn, which never change).
    pub fn wal_reader(&self) -> WalReader {
        self.wal.reader()
    }

    pub fn cluster_id(&self) -> &ClusterId {
        &self.config.cluster_id
    }

    pub fn segment_size(&self) -> SegmentSize {
        self.config.segment_size
    }

    /// The backup holds every segment below `lsn` (the backup task's uploads,
    /// in order, each complete: object storage has it durably). Not
    /// persisted here, which would put a control-file write under the
    /// acceptor's lock for every segment: a crash forgets at most the latest
    /// uploads (they are made again, with the same bytes). It is persisted
    /// with the next control-file write, and [`Acceptor::remove_old_wal`]
    /// persists it before any removal that relies on it.
    pub fn set_backup_lsn(&mut self, lsn: Lsn) {
        assert!(
            lsn <= self.commit_lsn,
            "backup_lsn {lsn} beyond commit_lsn {}",
            self.commit_lsn
        );
        if lsn > self.state.backup_lsn {
            self.state.backup_lsn = lsn;
            self.publish_backup();
        }
    }

    /// The remote partial segments this safekeeper may have created.
    pub fn partial_segments(&self) -> &[crate::control::PartialRemoteSegment] {
        &self.state.partial_backup
    }

    /// Replaces the list of remote partial segments and persists it before
    /// returning: the partial backup's every step relies on the list being
    /// on disk (see [`crate::partial`]).
    pub async fn set_partial_segments(
        &mut self,
        segments: Vec<crate::control::PartialRemoteSegment>,
    ) -> Result<(), AcceptorError> {
        self.state.partial_backup = segments;
        self.persist_now().await
    }

    /// Counts a finished partial upload.
    pub fn note_partial_upload(&mut self, ok: bool) {
        if ok {
            self.partial_uploads += 1;
        } else {
            self.partial_upload_failures += 1;
        }
    }

    /// Counts a finished segment upload.
    pub fn note_backup_upload(&mut self, ok: bool) {
        if ok {
            self.backup_uploads += 1;
        } else {
            self.backup_upload_failures += 1;
        }
    }

    fn publish_backup(&self) {
        let view = BackupView {
            term: self.state.term,
            last_log_term: self.last_log_term(),
            flush_lsn: self.flush_lsn(),
            commit_lsn: self.commit_lsn,
            backup_lsn: self.state.backup_lsn,
            duty: self.backup_view.borrow().duty,
        };
        self.backup_view.send_if_modified(|v| {
            let changed = *v != view;
            *v = view;
            changed
        });
    }

    /// What limits removal now. `backup_enabled`: whether removal waits for
    /// the backup; `walsenders`: the slowest active walsender, when kept.
    pub fn removal_horizon(&self, backup_enabled: bool, walsenders: Option<Lsn>) -> RemovalHorizon {
        let replicas = match (
            self.feedback.min_remote_consistent(),
            self.writer_replica_horizon,
        ) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => Lsn(0),
        };
        RemovalHorizon {
            replicas: replicas.min(self.commit_lsn),
            peers: self.peer_horizon_lsn.min(self.commit_lsn),
            backup: backup_enabled.then_some(self.state.backup_lsn),
            walsenders,
        }
    }

    /// Removes the whole segments below `horizon`. The control file records
    /// the removal first: a crash in between leaves extra files (removed next
    /// time), never a control file that expects WAL which is gone. Returns
    /// how many segments went.
    pub async fn remove_old_wal(
        &mut self,
        horizon: &RemovalHorizon,
    ) -> Result<usize, AcceptorError> {
        let lsn = horizon.lsn();
        let segno = self.config.segment_size.segno(lsn);
        self.removal_horizon = self.removal_horizon.max(lsn);
        if segno <= self.state.last_removed_segno {
            return Ok(0);
        }
        assert!(
            lsn <= self.commit_lsn && lsn <= self.peer_horizon_lsn,
            "removal horizon {lsn} beyond commit_lsn {} or the peer horizon {}",
            self.commit_lsn,
            self.peer_horizon_lsn
        );
        self.state.last_removed_segno = segno;
        self.state.remote_consistent_lsn = self.state.remote_consistent_lsn.max(horizon.replicas);
        self.persist_now().await?;
        let removed = self.wal.remove_below(segno).await?;
        self.segments_removed += removed as u64;
        Ok(removed)
    }

    /// The lowest LSN whose WAL this safekeeper still holds locally (below
    /// it, whole segments were removed).
    pub fn wal_kept_from(&self) -> Lsn {
        Lsn(self.state.last_removed_segno * self.config.segment_size.bytes())
    }

    pub fn status(&self) -> AcceptorStatus {
        AcceptorStatus {
            node_id: self.config.node_id,
            term: self.state.term,
            last_log_term: self.last_log_term(),
            flush_lsn: self.flush_lsn().to_string(),
            commit_lsn: self.commit_lsn.to_string(),
            peer_horizon_lsn: self.peer_horizon_lsn.to_string(),
            backup_lsn: self.state.backup_lsn.to_string(),
            backup_duty: self.backup_view.borrow().duty,
            backup_uploads: self.backup_uploads,
            backup_upload_failures: self.backup_upload_failures,
            partial_uploads: self.partial_uploads,
            partial_upload_failures: self.partial_upload_failures,
            partial_uploaded: self
                .state
                .partial_backup
                .iter()
                .find(|e| e.status == crate::control::UploadStatus::Uploaded)
                .map(|e| e.name.clone()),
            remote_consistent_lsn: self.removal_horizon(false, None).replicas.to_string(),
            writer_remote_consistent_lsn: self.writer_replica_horizon.map(|l| l.to_string()),
            removal_horizon_lsn: self.removal_horizon.to_string(),
            last_removed_segno: self.state.last_removed_segno,
            segments_removed: self.segments_removed,
            replicas_forgotten: self.replicas_forgotten,
            replicas: self.feedback.len(),
            appends_received: self.appends_received,
            wal_fsyncs: self.wal_fsyncs,
            wal_preallocates: self.wal.preallocates(),
            wal_segments_preallocated: self.wal.segments_preallocated(),
            restored_up_to: self.state.restored_up_to.map(|l| l.to_string()),
            restore_quarantine_over: self.quarantine_over,
        }
    }

    /// Greeting: checks that the writer writes our cluster's timeline with our
    /// geometry.
    pub fn handle_greeting(&self, greeting: &Greeting) -> Result<FromSafekeeper, AcceptorError> {
        if greeting.cluster_id != self.config.cluster_id {
            return Err(refused(
                self.state.term,
                format!(
                    "cluster {} is not served here (this safekeeper belongs to cluster {})",
                    greeting.cluster_id, self.config.cluster_id
                ),
            ));
        }
        if greeting.timeline_id != self.config.timeline_id {
            return Err(refused(
                self.state.term,
                format!(
                    "timeline {} is not served here (this is timeline {})",
                    greeting.timeline_id, self.config.timeline_id
                ),
            ));
        }
        if greeting.segment_bytes != self.config.segment_size.bytes() {
            return Err(refused(
                self.state.term,
                format!(
                    "segment size {} differs from this safekeeper's {}",
                    greeting.segment_bytes,
                    self.config.segment_size.bytes()
                ),
            ));
        }
        Ok(FromSafekeeper::Greeting(GreetingResponse {
            term: self.state.term,
            node_id: self.config.node_id,
            restored: self.state.restored_up_to.map(|_| Restored {
                flush_lsn: self.flush_lsn(),
                ready: self.quarantine_over,
            }),
        }))
    }

    /// Rebuilt from the backup up to this LSN and not brought back yet.
    pub fn restored_up_to(&self) -> Option<Lsn> {
        self.state.restored_up_to
    }

    /// The quarantine of a restored safekeeper is over: every election that
    /// could still hold one of its lost votes has ended, so a writer that
    /// greets it from now on may bring it back.
    pub fn end_quarantine(&mut self) {
        self.quarantine_over = true;
    }

    /// Where recovery reads find WAL removed here (below backup_lsn).
    pub fn set_remote(&mut self, remote: crate::backup::RemoteWal) {
        self.remote = Some(remote);
    }

    /// Vote request: grants the vote iff `term` is above every term seen here,
    /// persisting the new term before answering.
    pub async fn handle_vote(&mut self, term: Term) -> Result<FromSafekeeper, AcceptorError> {
        if self.state.restored_up_to.is_some() {
            // It forgot the terms it voted in: a vote now could be a second
            // vote in one of them.
            return Err(refused(
                self.state.term,
                "restored from the backup: it votes again only once a writer brought it back",
            ));
        }
        self.flush().await?;
        let vote_given = self.state.term < term;
        if vote_given {
            self.state.term = term;
            // Persisted positions stay consistent: backup_lsn (which may have
            // moved in memory) never passes the persisted commit_lsn.
            self.state.commit_lsn = self.commit_lsn;
            self.control.persist(&self.state).await?;
        }
        let flush_lsn = self.flush_lsn();
        Ok(FromSafekeeper::Vote(VoteResponse {
            term: self.state.term,
            vote_given,
            flush_lsn,
            truncate_lsn: self.peer_horizon_lsn,
            term_history: self.state.term_history.up_to(flush_lsn),
            timeline_start_lsn: self.state.timeline_start_lsn,
        }))
    }

    /// The elected writer tells where our WAL stops agreeing with its own: cut the
    /// divergent tail, adopt its term history, and persist before answering.
    pub async fn handle_elected(
        &mut self,
        msg: &ProposerElected,
    ) -> Result<FromSafekeeper, AcceptorError> {
        if msg.term < self.state.term {
            return Err(refused(
                self.state.term,
                format!("term {} is stale", msg.term),
            ));
        }
        if !msg.term_history.is_well_formed() || msg.term_history.last_term() != msg.term {
            return Err(refused(self.state.term, "malformed term history"));
        }
        self.flush().await?;
        let flush_lsn = self.flush_lsn();
        match (self.state.restored_up_to.is_some(), msg.rejoin) {
            (false, false) => {}
            (false, true) => {
                return Err(refused(
                    self.state.term,
                    "not a restored safekeeper (it rejoined already)",
                ))
            }
            (true, false) => {
                return Err(refused(
                    self.state.term,
                    "restored from the backup: only a writer that proved it is current may bring it back",
                ))
            }
            (true, true) => {
                // The writer greeted us after the quarantine and then heard
                // a quorum of the others in its term; our WAL is committed
                // WAL, so it is the writer's up to our end.
                if !self.quarantine_over {
                    return Err(refused(
                        self.state.term,
                        "restored from the backup: still in quarantine",
                    ));
                }
                if msg.start_streaming_at != flush_lsn {
                    return Err(refused(
                        self.state.term,
                        format!(
                            "a restored safekeeper rejoins at its end {flush_lsn}, not at {}",
                            msg.start_streaming_at
                        ),
                    ));
                }
            }
        }
        if self.last_log_term() == msg.term && flush_lsn > msg.start_streaming_at {
            return Err(refused(
                self.state.term,
                format!(
                    "already holds WAL of term {} up to {flush_lsn}, beyond {}",
                    msg.term, msg.start_streaming_at
                ),
            ));
        }
        if msg.start_streaming_at < self.commit_lsn {
            // The writer would lose committed WAL: never do it.
            tracing::error!(
                node = self.config.node_id,
                start = %msg.start_streaming_at,
                commit = %self.commit_lsn,
                "election asks to truncate committed WAL"
            );
            return Err(refused(
                self.state.term,
                format!(
                    "start_streaming_at {} is below commit_lsn {}: refusing to truncate committed WAL",
                    msg.start_streaming_at, self.commit_lsn
                ),
            ));
        }
        if msg.start_streaming_at > flush_lsn {
            return Err(refused(
                self.state.term,
                format!(
                    "start_streaming_at {} is beyond flush_lsn {flush_lsn}",
                    msg.start_streaming_at
                ),
            ));
        }
        if self.state.durable_lsn > msg.start_streaming_at {
            // The recorded durable point goes down before the WAL does, so that
            // a crash in between never finds less WAL than recorded.
            self.state.durable_lsn = msg.start_streaming_at;
            self.state.commit_lsn = self.commit_lsn;
            self.control.persist(&self.state).await?;
        }
        self.wal.truncate(msg.start_streaming_at).await?;
        // Commit announcements of an older writer say nothing about this term's WAL.
        self.pending_commit_lsn = self.commit_lsn;
        // Probes count within one writer's term only.
        self.probe_seen = 0;
        self.state.term = msg.term;
        self.state.term_history = msg.term_history.clone();
        self.state.timeline_start_lsn = msg.timeline_start_lsn;
        self.state.commit_lsn = self.commit_lsn;
        self.state.peer_horizon_lsn = self.peer_horizon_lsn;
        if self.state.restored_up_to.take().is_some() {
            tracing::info!(
                node = self.config.node_id,
                term = msg.term,
                at = %flush_lsn,
                "restored safekeeper brought back by a writer"
            );
        }
        self.control.persist(&self.state).await?;
        self.publish_backup();
        Ok(self.append_response())
    }

    /// Writes an append without flushing; [`Acceptor::flush_appends`] makes a
    /// batch durable with one fsync and produces the answer.
    pub async fn append_no_flush(&mut self, req: &AppendRequest) -> Result<(), AcceptorError> {
        if req.term < self.state.term {
            return Err(refused(
                self.state.term,
                format!("term {} is stale", req.term),
            ));
        }
        if req.term > self.state.term || self.state.term_history.last_term() != req.term {
            return Err(refused(
                self.state.term,
                format!("append of term {} before its election", req.term),
            ));
        }
        if !req.is_consistent() {
            return Err(refused(
                self.state.term,
                "append bounds do not match its payload",
            ));
        }
        if !req.wal.is_empty() {
            // Appends of one batch are gathered and written with one call at the
            // flush: one system call and one fsync for the whole batch.
            let expected = Lsn(self.wal.write_lsn().0 + self.pending_wal_bytes as u64);
            if req.begin_lsn != expected {
                return Err(refused(
                    self.state.term,
                    format!(
                        "WAL write at {} but the WAL ends at {expected}",
                        req.begin_lsn
                    ),
                ));
            }
            if self.pending_wal_bytes + req.wal.len() > MAX_PENDING_WAL_BYTES {
                self.write_pending().await?;
            }
            self.pending_wal_bytes += req.wal.len();
            self.pending_wal.push(req.wal.clone());
        }
        if !req.wal.is_empty() {
            self.appends_received += 1;
        }
        self.probe_seen = self.probe_seen.max(req.probe);
        self.pending_commit_lsn = self.pending_commit_lsn.max(req.commit_lsn);
        self.peer_horizon_lsn = self
            .peer_horizon_lsn
            .max(req.truncate_lsn.min(req.commit_lsn));
        if let Some(h) = req.remote_consistent_lsn {
            self.writer_replica_horizon = Some(h);
        }
        // A peer's uploads are in the same backup: its backup_lsn is ours to
        // rely on up to our own commit_lsn (adopted at the flush).
        if req.backup_lsn <= req.commit_lsn {
            self.peer_backup_lsn = self.peer_backup_lsn.max(req.backup_lsn);
        }
        self.backup_view.send_if_modified(|v| {
            let changed = v.duty != req.backup_duty;
            v.duty = req.backup_duty;
            changed
        });
        Ok(())
    }

    /// Flushes the WAL written so far (one fsync for the whole batch), advances
    /// commit_lsn and answers with the new positions.
    pub async fn flush_appends(&mut self) -> Result<FromSafekeeper, AcceptorError> {
        self.flush().await?;
        Ok(self.append_response())
    }

    async fn write_pending(&mut self) -> Result<(), AcceptorError> {
        // Small appends are joined into one write (one system call); a large one
        // is written from the frame it arrived in, without a copy.
        let mut small = BytesMut::new();
        for chunk in std::mem::take(&mut self.pending_wal) {
            if chunk.len() < JOIN_BELOW_BYTES {
                small.extend_from_slice(&chunk);
                continue;
            }
            if !small.is_empty() {
                let begin = self.wal.write_lsn();
                self.wal.write(begin, small.split().freeze()).await?;
            }
            let begin = self.wal.write_lsn();
            self.wal.write(begin, chunk).await?;
        }
        if !small.is_empty() {
            let begin = self.wal.write_lsn();
            self.wal.write(begin, small.freeze()).await?;
        }
        self.pending_wal_bytes = 0;
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), AcceptorError> {
        self.write_pending().await?;
        if self.wal.write_lsn() > self.wal.flush_lsn() {
            self.wal_fsyncs += 1;
        }
        let flush_lsn = self.wal.flush().await?;
        let commit = self.commit_lsn.max(self.pending_commit_lsn.min(flush_lsn));
        assert!(commit >= self.commit_lsn, "commit_lsn went back");
        if commit > self.commit_lsn {
            self.commit_lsn = commit;
            self.commit_watch.send_replace(commit);
            self.maybe_persist().await?;
        }
        let shared = self.peer_backup_lsn.min(self.commit_lsn);
        if shared > self.state.backup_lsn {
            self.state.backup_lsn = shared;
        }
        self.publish_backup();
        Ok(())
    }

    /// Persists commit_lsn and the horizons when they moved far enough (a segment)
    /// or commit reached the start of the current term; cheap to call often.
    pub async fn maybe_persist(&mut self) -> Result<(), AcceptorError> {
        let seg = self.config.segment_size.bytes();
        let epoch_start = self.state.term_history.0.last().map_or(Lsn(0), |e| e.lsn);
        let far = self.commit_lsn.distance_from(self.state.commit_lsn) >= seg
            || self
                .peer_horizon_lsn
                .distance_from(self.state.peer_horizon_lsn)
                >= seg;
        let reached_epoch = self.state.commit_lsn < epoch_start && self.commit_lsn >= epoch_start;
        if far || reached_epoch {
            self.persist_now().await?;
        }
        Ok(())
    }

    /// Persists the in-memory positions now (clean shutdown, periodic save).
    pub async fn persist_now(&mut self) -> Result<(), AcceptorError> {
        self.state.commit_lsn = self.commit_lsn;
        self.state.durable_lsn = self.wal.flush_lsn();
        self.state.peer_horizon_lsn = self.peer_horizon_lsn;
        self.state.registered_replicas = self.feedback.registered();
        self.control.persist(&self.state).await?;
        Ok(())
    }

    fn append_response(&self) -> FromSafekeeper {
        FromSafekeeper::Append(AppendResponse {
            term: self.state.term,
            flush_lsn: self.flush_lsn(),
            commit_lsn: self.commit_lsn,
            backup_lsn: self.state.backup_lsn,
            probe: self.probe_seen,
            shard_feedback: self.feedback.all(),
            forgotten_replicas: self.feedback.forgotten(),
        })
    }

    /// Stops background disk work (a killed safekeeper must leave its disk as a
    /// crash would).
    pub fn stop_background(&mut self) {
        self.wal.stop_background();
    }

    /// Records a replica's feedback (relayed to the writer in append responses).
    pub fn record_feedback(&mut self, feedback: ShardFeedback) {
        self.feedback.record(feedback);
    }

    /// Committed WAL in `[begin, end)`, at most `max` bytes (walsenders). `end`
    /// is the commit_lsn the caller announces with these bytes: a walsender frame
    /// must never carry WAL past the commit_lsn it states, even when commit_lsn
    /// moved on since the caller read it.
    pub async fn read_committed(
        &self,
        begin: Lsn,
        end: Lsn,
        max: usize,
    ) -> Result<Bytes, AcceptorError> {
        let end = end.min(self.commit_lsn);
        if begin >= end {
            return Ok(Bytes::new());
        }
        let max = max.min(end.distance_from(begin) as usize);
        Ok(self.wal.read(begin, max).await?)
    }

    /// Flushed WAL from `begin`, committed or not, at most `max` bytes: for the
    /// writer elected in `term`, which recovers the WAL of the donor safekeeper.
    pub async fn read_for_recovery(
        &self,
        term: Term,
        begin: Lsn,
        max: usize,
    ) -> Result<Bytes, AcceptorError> {
        if term != self.state.term {
            return Err(refused(
                self.state.term,
                format!("recovery read for term {term}"),
            ));
        }
        match self.wal.read(begin, max).await {
            Ok(bytes) => Ok(bytes),
            // A restored safekeeper may rejoin below what the others removed
            // (its end is the last whole record of the backup): the backup
            // holds it.
            Err(WalStorageError::Removed { lsn }) if lsn < self.state.backup_lsn => {
                match &self.remote {
                    // A failed read of the backup ends this request only:
                    // the writer asks again.
                    Some(remote) => remote
                        .read(begin, self.state.backup_lsn, max)
                        .await
                        .map_err(|e| refused(self.state.term, format!("WAL backup: {e}"))),
                    None => Err(refused(
                        self.state.term,
                        WalStorageError::Removed { lsn }.to_string(),
                    )),
                }
            }
            Err(e @ (WalStorageError::Removed { .. } | WalStorageError::BeyondFlush { .. })) => {
                Err(refused(self.state.term, e.to_string()))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Every registered replica's latest feedback.
    pub fn replica_feedback(&self) -> Vec<ShardFeedback> {
        self.feedback.all()
    }

    /// Forgets a replica (an operator unregistered it, or it was silent past
    /// the replica expiry): it stops holding WAL removal here, and the writer
    /// learns it with the next answer. The control file stops listing it.
    pub async fn forget_replica(
        &mut self,
        forget: ForgottenReplica,
    ) -> Result<FromSafekeeper, AcceptorError> {
        let was_registered = self.feedback.forget(forget);
        if was_registered {
            self.replicas_forgotten += 1;
            self.state.registered_replicas = self.feedback.registered();
            self.persist_now().await?;
        }
        Ok(FromSafekeeper::Forgotten { was_registered })
    }

    /// Handles a batch of messages from the writer that arrived together: appends
    /// in a row share one fsync and one answer (group commit). Refusals become
    /// `Refused` answers; an `Err` is a storage failure and the safekeeper must stop.
    pub async fn handle_batch(
        &mut self,
        msgs: Vec<ToSafekeeper>,
    ) -> Result<Vec<FromSafekeeper>, AcceptorError> {
        let mut out = Vec::new();
        let mut appended = false;
        for msg in msgs {
            if appended && !matches!(msg, ToSafekeeper::Append(_)) {
                out.push(self.flush_appends().await?);
                appended = false;
            }
            let result = match msg {
                ToSafekeeper::Greeting(g) => self.handle_greeting(&g).map(Some),
                ToSafekeeper::VoteRequest { term } => self.handle_vote(term).await.map(Some),
                ToSafekeeper::Elected(e) => self.handle_elected(&e).await.map(Some),
                ToSafekeeper::Append(a) => match self.append_no_flush(&a).await {
                    Ok(()) => {
                        appended = true;
                        Ok(None)
                    }
                    Err(e) => Err(e),
                },
                ToSafekeeper::ReadWal {
                    term,
                    begin_lsn,
                    end_lsn,
                } => match self.read_range(term, begin_lsn, end_lsn, &mut out).await {
                    Ok(()) => Ok(None),
                    Err(e) => Err(e),
                },
                ToSafekeeper::Feedback(fb) => {
                    self.record_feedback(fb);
                    Ok(None)
                }
                ToSafekeeper::ForgetReplica(forget) => self.forget_replica(forget).await.map(Some),
                ToSafekeeper::StartReplication { .. } => Err(refused(
                    self.state.term,
                    "START_REPLICATION opens its own connection",
                )),
            };
            match result {
                Ok(Some(reply)) => out.push(reply),
                Ok(None) => {}
                Err(e) if e.is_refusal() => out.push(e.to_message(self.state.term)),
                Err(e) => return Err(e),
            }
        }
        if appended {
            out.push(self.flush_appends().await?);
        }
        Ok(out)
    }

    async fn read_range(
        &mut self,
        term: Term,
        begin: Lsn,
        end: Lsn,
        out: &mut Vec<FromSafekeeper>,
    ) -> Result<(), AcceptorError> {
        if end.distance_from(begin) > MAX_READ_WAL_BYTES {
            return Err(refused(
                self.state.term,
                format!(
                    "a recovery read of {begin}..{end} asks for more than {MAX_READ_WAL_BYTES} bytes"
                ),
            ));
        }
        if end < begin || end > self.flush_lsn() {
            return Err(refused(
                self.state.term,
                format!("cannot read WAL {begin}..{end}"),
            ));
        }
        let mut pos = begin;
        while pos < end {
            let max = (end.distance_from(pos) as usize).min(MAX_SEND_BYTES);
            let wal = self.read_for_recovery(term, pos, max).await?;
            if wal.is_empty() {
                return Err(refused(self.state.term, format!("no WAL at {pos}")));
            }
            let len = wal.len() as u64;
            out.push(FromSafekeeper::Wal {
                begin_lsn: pos,
                commit_lsn: self.commit_lsn,
                wal,
            });
            pos = Lsn(pos.0 + len);
        }
        Ok(())
    }
}
