//! Rebuilding a lost safekeeper from a peer (Neon's `pull_timeline`).
//!
//! The donor sends a snapshot of its positions and its committed WAL from
//! its first segment kept (its removal horizon) to its commit_lsn, holding
//! its WAL removal there until the pull ends, then its term and commit_lsn
//! as they are at the end (`ToSafekeeper::Pull`, served by
//! `crate::server`). Into an empty data dir the pull writes:
//!
//! 1. the WAL `[start_lsn, commit_lsn)`, in segment files from the start's
//!    segment on (the segments below are recorded as removed: walsenders
//!    and recovery reads find them in the backup, like a safekeeper's own
//!    removed WAL);
//! 2. only then the control file: everything copied committed, the term and
//!    term history the donor had (the history cut at the copy's end), and
//!    `restored_up_to` set, so the rebuilt safekeeper obeys the rule of one
//!    restored from the backup: it lost the terms it voted in, so it neither
//!    votes nor acknowledges until a writer proven current brings it back
//!    (`ferry_wal::proto::Restored`).
//!
//! A crash before step 2 leaves no control file: the pull starts over. Its
//! time grows with the WAL above the donor's horizon, not with the timeline
//! (a restore from the backup reads every segment from the first).
//!
//! The copy is checked where it can be: the frames must tile
//! `[start_lsn, commit_lsn)` exactly, the donor's term and commit_lsn at
//! the end must not be below the snapshot's (a donor that restarted from
//! less is not copied), and a copy from the timeline's first segment is
//! walked record by record when the rebuilt safekeeper opens.

use std::sync::Arc;

use ferry_env::{Disk, Network};
use ferry_storage::Location;
use ferry_wal::proto::{
    self, FrameReader, FromSafekeeper, PullRequest, PullSnapshot, ToSafekeeper,
};
use ferry_wal::{Lsn, Term};
use tokio::io::AsyncWriteExt;

use crate::acceptor::AcceptorConfig;
use crate::control::{ControlFile, ControlFileError, SafekeeperState};
use crate::restore::{control_file_of, empty_wal_dir, own_partial_objects, RestoreError};
use crate::wal_storage::{Preallocation, WalStorage, WalStorageError};

/// WAL written between two flushes of a pull (the flushes bound what a
/// crash makes the next pull copy again; the control file comes last
/// anyway).
const FLUSH_EVERY_BYTES: u64 = 16 << 20;

/// Why a pull did not happen.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The data dir holds a safekeeper: a pull never overwrites one.
    #[error("{0} exists: this data dir holds a safekeeper; a pull only fills an empty one")]
    Exists(String),
    #[error("pulling from {donor}: {detail}")]
    Donor { donor: String, detail: String },
    #[error("{donor} refused the pull: {reason}")]
    Refused { donor: String, reason: String },
    /// The donor's state went back during the pull (it restarted from
    /// less, or was itself rebuilt): the copy is not used.
    #[error("{donor} went back during the pull: {detail}")]
    DonorWentBack { donor: String, detail: String },
    #[error(transparent)]
    Wal(#[from] WalStorageError),
    #[error(transparent)]
    Control(#[from] ControlFileError),
    #[error("local disk: {0}")]
    Io(#[from] std::io::Error),
    #[error("the WAL backup: {0}")]
    Backup(#[from] RestoreError),
}

/// What a pull copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullReport {
    pub donor: String,
    /// The donor's removal horizon: the copy starts here.
    pub start_lsn: Lsn,
    /// The copy ends here; all of it is committed.
    pub commit_lsn: Lsn,
    /// The donor's term at the end of the pull (the rebuilt safekeeper's).
    pub term: Term,
    /// WAL bytes copied.
    pub bytes: u64,
}

/// Rebuilds safekeeper `config` into `dir` (which must hold no control
/// file) from the peer at `donor`, reached over `network`; see the module
/// documentation. With `backup` (the cluster's WAL backup), the lost
/// safekeeper's own partial objects are adopted for deletion, as a restore
/// does.
pub async fn pull_from_peer(
    disk: Arc<dyn Disk>,
    dir: &str,
    config: &AcceptorConfig,
    network: &dyn Network,
    donor: &str,
    backup: Option<&Location>,
) -> Result<PullReport, PullError> {
    let seg = config.segment_size;
    if let Some(control_path) = control_file_of(disk.as_ref(), dir).await? {
        return Err(PullError::Exists(control_path));
    }
    let own_partials = match backup {
        Some(b) => {
            let folder =
                crate::backup::cluster_folder(b, &config.cluster_id).map_err(RestoreError::from)?;
            own_partial_objects(&folder, seg, config.node_id).await?
        }
        None => Vec::new(),
    };
    let fail = |detail: String| PullError::Donor {
        donor: donor.to_string(),
        detail,
    };
    let conn = network
        .connect(donor)
        .await
        .map_err(|e| fail(format!("connecting: {e}")))?;
    let (read, mut write) = tokio::io::split(conn);
    let mut reader = FrameReader::new(read);
    let request = ToSafekeeper::Pull(PullRequest {
        cluster_id: config.cluster_id.clone(),
        timeline_id: config.timeline_id,
        segment_bytes: seg.bytes(),
        node_id: config.node_id,
    });
    proto::write_frame(&mut write, &request)
        .await
        .map_err(|e| fail(e.to_string()))?;
    write.flush().await.map_err(|e| fail(e.to_string()))?;
    let snapshot: PullSnapshot = match next(&mut reader, donor).await? {
        FromSafekeeper::PullStart(s) => s,
        other => {
            return Err(fail(format!(
                "expected the pull's snapshot, got {}",
                kind(&other)
            )))
        }
    };
    if snapshot.start_lsn > snapshot.commit_lsn || seg.offset(snapshot.start_lsn) != 0 {
        return Err(fail(format!(
            "its snapshot starts at {}, not at a segment start at or below its commit_lsn {}",
            snapshot.start_lsn, snapshot.commit_lsn
        )));
    }
    // What goes into the control file is input from the network.
    if !snapshot.term_history.is_well_formed() || snapshot.term_history.last_term() > snapshot.term
    {
        return Err(fail(format!(
            "its snapshot's term history is not one of term {}",
            snapshot.term
        )));
    }

    let wal_dir = empty_wal_dir(disk.as_ref(), dir).await?;
    let mut wal = WalStorage::open(
        Arc::clone(&disk),
        &wal_dir,
        seg,
        Preallocation::Never,
        snapshot.start_lsn,
        snapshot.start_lsn,
    )
    .await?;
    let mut pos = snapshot.start_lsn;
    let mut unflushed = 0u64;
    let (term, end_commit) = loop {
        match next(&mut reader, donor).await? {
            FromSafekeeper::Wal {
                begin_lsn,
                wal: bytes,
                ..
            } => {
                let end = Lsn(begin_lsn.0 + bytes.len() as u64);
                if begin_lsn != pos || end > snapshot.commit_lsn {
                    return Err(fail(format!(
                        "it sent WAL [{begin_lsn}, {end}) where [{pos}, {}) was due",
                        snapshot.commit_lsn
                    )));
                }
                unflushed += bytes.len() as u64;
                wal.write(begin_lsn, bytes).await?;
                pos = end;
                if unflushed >= FLUSH_EVERY_BYTES {
                    wal.flush().await?;
                    unflushed = 0;
                }
            }
            FromSafekeeper::PullEnd { term, commit_lsn } => break (term, commit_lsn),
            other => return Err(fail(format!("expected WAL, got {}", kind(&other)))),
        }
    };
    if pos != snapshot.commit_lsn {
        return Err(fail(format!(
            "the pull ended at {pos}, below the snapshot's commit_lsn {}",
            snapshot.commit_lsn
        )));
    }
    if term < snapshot.term || end_commit < snapshot.commit_lsn {
        return Err(PullError::DonorWentBack {
            donor: donor.to_string(),
            detail: format!(
                "term {} and commit_lsn {} at the start, term {term} and commit_lsn {end_commit} at the end",
                snapshot.term, snapshot.commit_lsn
            ),
        });
    }
    wal.flush().await?;
    drop(wal);

    let mut state = SafekeeperState::new(
        config.cluster_id.clone(),
        config.node_id,
        config.timeline_id,
        seg.bytes(),
    );
    state.term = term;
    state.term_history = snapshot.term_history;
    state.timeline_start_lsn = snapshot.timeline_start_lsn;
    state.commit_lsn = snapshot.commit_lsn;
    state.durable_lsn = snapshot.commit_lsn;
    state.backup_lsn = snapshot.backup_lsn;
    state.peer_horizon_lsn = snapshot.peer_horizon_lsn;
    state.remote_consistent_lsn = snapshot.remote_consistent_lsn;
    state.last_removed_segno = seg.segno(snapshot.start_lsn);
    state.partial_backup = own_partials;
    state.restored_up_to = Some(snapshot.commit_lsn);
    // A configuration that does not validate is left out: the next writer
    // or change driver hands over the current one.
    state.configuration = snapshot
        .configuration
        .clone()
        .filter(|c| c.validate().is_ok());
    ControlFile::create(disk, dir, state).await?;
    Ok(PullReport {
        donor: donor.to_string(),
        start_lsn: snapshot.start_lsn,
        commit_lsn: snapshot.commit_lsn,
        term,
        bytes: snapshot.commit_lsn.distance_from(snapshot.start_lsn),
    })
}

/// The donor's next message; a refusal, a closed connection or a bad frame
/// ends the pull.
async fn next<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
    donor: &str,
) -> Result<FromSafekeeper, PullError> {
    let fail = |detail: String| PullError::Donor {
        donor: donor.to_string(),
        detail,
    };
    match reader.next::<FromSafekeeper>().await {
        Ok(Some(FromSafekeeper::Refused { reason, .. })) => Err(PullError::Refused {
            donor: donor.to_string(),
            reason,
        }),
        Ok(Some(msg)) => Ok(msg),
        Ok(None) => Err(fail("the connection closed before the pull ended".into())),
        Err(e) => Err(fail(e.to_string())),
    }
}

/// A message's kind, for errors (its payload may be large).
fn kind(msg: &FromSafekeeper) -> String {
    match msg {
        FromSafekeeper::Wal { begin_lsn, wal, .. } => {
            format!("{} bytes of WAL at {begin_lsn}", wal.len())
        }
        other => format!("{other:?}"),
    }
}
