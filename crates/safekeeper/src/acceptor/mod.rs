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
//!
//! Here: the acceptor's identity, errors and status, its opening, and the
//! persistence of its state; in the submodules:
//! * `decide`: the protocol's rules as functions of the acceptor's
//!   positions and one message, which say what to refuse or which writes to
//!   make and in which order (no I/O);
//! * `protocol`: greetings, votes, elections and appends (the
//!   proposer-acceptor protocol, with group commit), performing what
//!   `decide` says;
//! * `removal`: the WAL removal horizon and the removal of old segments;
//! * `backup_state`: what the backup and the partial backup follow and report;
//! * `feedback`: the feedback board of the replicas streaming from here;
//! * `reads`: committed WAL for walsenders, and recovery reads for writers;
//! * `pull`: what a peer rebuilding itself from this safekeeper copies.

mod backup_state;
mod decide;
mod feedback;
mod protocol;
mod pull;
mod reads;
mod removal;

use std::sync::Arc;

use bytes::Bytes;
use ferry_env::Disk;
use ferry_wal::proto::{FromSafekeeper, ShardFeedback};
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn, Term};
use serde::Serialize;
use tokio::sync::watch;

use crate::backup::{BackupError, BackupView};
use crate::control::{ControlFile, ControlFileError, SafekeeperState};
use crate::wal_storage::{Preallocation, WalStorage, WalStorageError};

pub use feedback::{FeedbackBoard, MAX_FEEDBACK_REPLICAS};
pub use protocol::WriterSession;
pub use reads::CommittedWal;
pub use removal::RemovalHorizon;

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
    /// The generation of the configuration held (0: none recorded), and
    /// the configuration itself (`None`: none recorded).
    pub generation: u32,
    pub configuration: Option<ferry_wal::membership::Configuration>,
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
    /// Why appends are refused for lack of disk space (the server's
    /// disk-full breaker; `None`: they are taken).
    pub disk_full: Option<String>,
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

    pub fn cluster_id(&self) -> &ClusterId {
        &self.config.cluster_id
    }

    pub fn segment_size(&self) -> SegmentSize {
        self.config.segment_size
    }

    /// What peer recovery needs to know of this safekeeper.
    pub(crate) fn recovery_standing(&self) -> crate::recovery::Standing {
        crate::recovery::Standing {
            node_id: self.config.node_id,
            cluster_id: self.config.cluster_id.clone(),
            timeline_id: self.config.timeline_id,
            segment_bytes: self.config.segment_size.bytes(),
            term: self.state.term,
            history_term: self.state.term_history.last_term(),
            flush_lsn: self.flush_lsn(),
            restored: self.state.restored_up_to.is_some(),
            configuration: self.state.configuration.clone(),
        }
    }

    pub fn status(&self) -> AcceptorStatus {
        AcceptorStatus {
            node_id: self.config.node_id,
            generation: decide::generation_of(self.state.configuration.as_ref()),
            configuration: self.state.configuration.clone(),
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
            disk_full: None,
        }
    }

    /// The disk its WAL and control file are on.
    pub fn disk(&self) -> Arc<dyn Disk> {
        self.wal.disk()
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

    /// Stops background disk work (a killed safekeeper must leave its disk as a
    /// crash would).
    pub fn stop_background(&mut self) {
        self.wal.stop_background();
    }
}
