//! Rebuilding a lost safekeeper from the WAL backup.
//!
//! The cluster's folder of the backup (only its own: another cluster's WAL
//! is never read) holds whole segments (`wal/<segment>`, each uploaded only once
//! committed) and partial objects (`partial/<segment>_<term>_<flush>_<commit>_sk<id>.partial`,
//! whose bytes below `commit` are committed). A restore writes, into an empty
//! data dir:
//!
//! 1. every whole segment from the first one on, up to the first missing one;
//! 2. from the partial objects of that missing segment, the one with the
//!    highest commit_lsn, cut at that commit_lsn;
//! 3. walks the records from the start of the timeline and cuts after the
//!    last whole one (a segment boundary may split a record);
//! 4. only then writes the control file, with everything restored marked
//!    committed and `restored_up_to` set, and the lost safekeeper's own
//!    partial objects listed as `Deleting` (its gc removes them: no object
//!    is left that no control file names).
//!
//! So the restored WAL is exactly a prefix of the committed WAL, and a crash
//! before step 4 leaves no control file: the restore starts over. What the
//! backup cannot give back is the terms the lost safekeeper voted in; the
//! control file's `restored_up_to` keeps it from voting until a writer proven
//! current brings it back (`ferry_wal::proto::Restored`).

use std::sync::Arc;

use ferry_env::Disk;
use ferry_storage::Location;
use ferry_wal::record::MAX_RECORD_BYTES;
use ferry_wal::segment::SegmentSize;
use ferry_wal::Lsn;

use crate::acceptor::AcceptorConfig;
use crate::backup::{segment_key, SEGMENTS_DIR};
use crate::control::{
    ControlFile, ControlFileError, PartialRemoteSegment, SafekeeperState, UploadStatus,
    CONTROL_FILE,
};
use crate::partial::{parse_partial_name, partial_key, PARTIAL_DIR};
use crate::wal_storage::{Preallocation, WalStorage, WalStorageError};

/// Why a restore did not happen.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The data dir holds a safekeeper: a restore never overwrites one.
    #[error("{0} exists: this data dir holds a safekeeper; a restore only fills an empty one")]
    Exists(String),
    #[error("the WAL backup: {0}")]
    Storage(#[from] ferry_storage::StorageError),
    #[error(transparent)]
    Wal(#[from] WalStorageError),
    #[error(transparent)]
    Control(#[from] ControlFileError),
    #[error("local disk: {0}")]
    Io(#[from] std::io::Error),
    /// The backup is not what a backup of this timeline can be.
    #[error("the WAL backup is damaged: {0}")]
    Damaged(String),
    /// The backup lacks the timeline's first segment while it holds later
    /// ones: segments are uploaded in parallel, so the first may still be on
    /// its way (retry once the other safekeepers have uploaded it), or it
    /// was deleted.
    #[error("the WAL backup does not hold the timeline's first segment {first_missing} (its first is {first_held}): retry once the running safekeepers have uploaded it")]
    Incomplete {
        first_missing: String,
        first_held: String,
    },
}

/// What a restore put back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreReport {
    /// Whole segments copied (`0..whole_segments`).
    pub whole_segments: u64,
    /// The partial object the tail came from.
    pub partial: Option<String>,
    /// The restored safekeeper's WAL ends here; all of it is committed.
    pub restored_lsn: Lsn,
    /// WAL bytes downloaded.
    pub bytes: u64,
}

/// Restores safekeeper `config` into `dir` (which must hold no control
/// file) from `backup`; see the module documentation.
pub async fn restore_from_backup(
    disk: Arc<dyn Disk>,
    dir: &str,
    config: &AcceptorConfig,
    backup: &Location,
) -> Result<RestoreReport, RestoreError> {
    let seg = config.segment_size;
    let backup = &crate::backup::cluster_folder(backup, &config.cluster_id)?;
    if let Some(control_path) = control_file_of(disk.as_ref(), dir).await? {
        return Err(RestoreError::Exists(control_path));
    }
    let whole = whole_run(seg, backup).await?;
    let run_end = seg.start(whole);
    // The tail: the partial object of the first missing segment that knows
    // the most committed WAL.
    let mut tail: Option<(String, Lsn)> = None;
    // The lost safekeeper's own partial objects: no control file names them
    // any more, so the restored one adopts them for its gc to delete.
    let own_partials = own_partial_objects(backup, seg, config.node_id).await?;
    for (key, _) in backup.list(PARTIAL_DIR).await? {
        let name = key.strip_prefix(&format!("{PARTIAL_DIR}/")).unwrap_or(&key);
        let Some(p) = parse_partial_name(seg, name) else {
            continue;
        };
        if p.segno == whole
            && p.commit_lsn > run_end
            && p.commit_lsn <= p.flush_lsn
            && tail.as_ref().is_none_or(|(_, c)| p.commit_lsn > *c)
        {
            tail = Some((name.to_string(), p.commit_lsn));
        }
    }

    let wal_dir = empty_wal_dir(disk.as_ref(), dir).await?;

    // Opened from the start of the timeline with nothing known durable:
    // empty at first, then walked to its last whole record.
    let open_wal = || {
        WalStorage::open(
            Arc::clone(&disk),
            &wal_dir,
            seg,
            Preallocation::Never,
            Lsn(0),
            Lsn(0),
        )
    };
    let mut wal = open_wal().await?;
    let mut bytes = 0u64;
    for segno in 0..whole {
        let data = backup.get(&segment_key(seg, segno)).await?;
        if data.len() as u64 != seg.bytes() {
            return Err(RestoreError::Damaged(format!(
                "{} holds {} bytes, not a whole segment of {}",
                segment_key(seg, segno),
                data.len(),
                seg.bytes()
            )));
        }
        bytes += data.len() as u64;
        wal.write(seg.start(segno), data).await?;
        wal.flush().await?;
    }
    let mut downloaded_end = run_end;
    if let Some((name, commit)) = &tail {
        let len = commit.distance_from(run_end);
        let data = backup.get_range(&partial_key(name), 0..len).await?;
        if data.len() as u64 != len {
            return Err(RestoreError::Damaged(format!(
                "{} holds {} bytes, less than its commit_lsn {commit} says",
                partial_key(name),
                data.len()
            )));
        }
        bytes += len;
        wal.write(run_end, data).await?;
        wal.flush().await?;
        downloaded_end = *commit;
    }
    drop(wal);

    // The walk finds the last whole record; a partial's commit_lsn is a
    // record boundary, a segment end need not be.
    let wal = open_wal().await?;
    let restored_lsn = wal.flush_lsn();
    drop(wal);
    let expected = if tail.is_some() {
        downloaded_end
    } else {
        Lsn(downloaded_end.0.saturating_sub(MAX_RECORD_BYTES as u64))
    };
    if restored_lsn < expected {
        return Err(RestoreError::Damaged(format!(
            "its records end at {restored_lsn}, but it holds WAL up to {downloaded_end}"
        )));
    }

    let mut state = SafekeeperState::new(
        config.cluster_id.clone(),
        config.node_id,
        config.timeline_id,
        seg.bytes(),
    );
    state.commit_lsn = restored_lsn;
    state.durable_lsn = restored_lsn;
    state.backup_lsn = run_end.min(restored_lsn);
    state.restored_up_to = Some(restored_lsn);
    state.partial_backup = own_partials;
    ControlFile::create(disk, dir, state).await?;
    Ok(RestoreReport {
        whole_segments: whole,
        partial: tail.map(|(name, _)| name),
        restored_lsn,
        bytes,
    })
}

/// The path of the control file under `dir`, if there is one: a data dir
/// with one holds a safekeeper, which a rebuild never overwrites.
pub(crate) async fn control_file_of(disk: &dyn Disk, dir: &str) -> std::io::Result<Option<String>> {
    let control_path = format!("{dir}/{CONTROL_FILE}");
    match disk.metadata(&control_path).await {
        Ok(_) => Ok(Some(control_path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Makes `<dir>/wal` an empty directory and returns its path: the leftovers
/// of a rebuild (a restore or a pull) that crashed before its control file
/// go first.
pub(crate) async fn empty_wal_dir(disk: &dyn Disk, dir: &str) -> std::io::Result<String> {
    let wal_dir = format!("{dir}/wal");
    disk.create_dir_all(&wal_dir).await?;
    for name in disk.list_dir(&wal_dir).await? {
        disk.remove_file(&format!("{wal_dir}/{name}")).await?;
    }
    disk.sync_dir(&wal_dir).await?;
    Ok(wal_dir)
}

/// The partial objects safekeeper `node_id` uploaded before it lost its
/// data dir, as `Deleting` entries: no control file names them any more,
/// so a rebuilt safekeeper adopts them for its gc to delete (no object is
/// left that no control file names). `backup` is the cluster's folder.
pub(crate) async fn own_partial_objects(
    backup: &Location,
    seg: SegmentSize,
    node_id: u64,
) -> Result<Vec<PartialRemoteSegment>, RestoreError> {
    let mut own = Vec::new();
    for (key, _) in backup.list(PARTIAL_DIR).await? {
        let name = key.strip_prefix(&format!("{PARTIAL_DIR}/")).unwrap_or(&key);
        let Some(p) = parse_partial_name(seg, name) else {
            continue;
        };
        if p.node_id == node_id {
            own.push(PartialRemoteSegment {
                status: UploadStatus::Deleting,
                name: name.to_string(),
                flush_lsn: p.flush_lsn,
                commit_lsn: p.commit_lsn,
                term: p.term,
            });
        }
    }
    Ok(own)
}

/// The number of whole segments in the backup from segment 0 on without a
/// gap (segments past a gap are committed too, but the WAL before them is
/// not there).
async fn whole_run(seg: SegmentSize, backup: &Location) -> Result<u64, RestoreError> {
    let mut segnos: Vec<u64> = backup
        .list(SEGMENTS_DIR)
        .await?
        .into_iter()
        .filter_map(|(key, _)| {
            let name = key.strip_prefix(&format!("{SEGMENTS_DIR}/"))?;
            match seg.parse_file_name(name) {
                Some((segno, false)) => Some(segno),
                _ => None,
            }
        })
        .collect();
    segnos.sort_unstable();
    if segnos.first().is_some_and(|&first| first != 0) {
        return Err(RestoreError::Incomplete {
            first_missing: seg.file_name(0),
            first_held: seg.file_name(segnos[0]),
        });
    }
    let mut run = 0;
    for segno in segnos {
        if segno != run {
            break;
        }
        run += 1;
    }
    Ok(run)
}
