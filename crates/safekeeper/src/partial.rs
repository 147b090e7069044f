//! Partial segment backup: the flushed prefix of the segment being written,
//! uploaded once flush_lsn has stayed in that segment for a timeout, so that
//! the backup holds recent WAL even when segments fill slowly.
//!
//! Every safekeeper uploads its own partial object, named
//! `partial/<segment>_<term>_<flush:016X>_<commit:016X>_sk<id>.partial`
//! in its cluster's folder of the backup (term: the last log term). The control file lists every remote partial
//! object that may exist, and the steps are ordered so that a crash at any
//! point leaves no object the list does not name:
//!
//! 1. the new entry is persisted as `InProgress`;
//! 2. the object is uploaded;
//! 3. if the term and the last log term did not change meanwhile (a new term
//!    may have truncated the WAL that was read), the entry becomes
//!    `Uploaded` and every older one `Deleting`, persisted;
//! 4. gc: every entry not `Uploaded` is deleted from storage (never an
//!    object of the `Uploaded` entry's name), and only then dropped from the
//!    persisted list.
//!
//! A failure at any step leaves the entries as they are; gc (after the next
//! upload, and at start) removes what they name. Invariant: every object
//! under `partial/` ending in `_sk<id>.partial` is named by an entry of that
//! safekeeper's persisted list, and at most one entry is `Uploaded`.

use std::time::Duration;

use ferry_storage::Location;
use ferry_wal::segment::SegmentSize;
use ferry_wal::{Lsn, Term};
use tokio::sync::{watch, Mutex};

use crate::acceptor::{Acceptor, AcceptorError};
use crate::backup::BackupView;
use crate::control::{PartialRemoteSegment, UploadStatus};
use crate::wal_storage::{WalReader, WalStorageError};

/// Default `--partial-backup-timeout` (Neon's).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15 * 60);
/// Folder of the partial objects inside the backup location.
pub const PARTIAL_DIR: &str = "partial";
/// Pause after a failed upload before the next attempt.
pub const RETRY_DELAY: Duration = Duration::from_secs(1);

/// Partial segment backup settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialBackupConfig {
    /// How long flush_lsn must stay in one segment before its prefix is
    /// uploaded.
    pub timeout: Duration,
}

/// The object name of a partial upload.
pub fn partial_name(
    seg: SegmentSize,
    segno: u64,
    term: Term,
    flush_lsn: Lsn,
    commit_lsn: Lsn,
    node_id: u64,
) -> String {
    format!(
        "{}_{term}_{:016X}_{:016X}_sk{node_id}.partial",
        seg.file_name(segno),
        flush_lsn.0,
        commit_lsn.0
    )
}

/// What a partial object's name says (see [`partial_name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialName {
    pub segno: u64,
    /// The last log term of the WAL it holds.
    pub term: Term,
    pub flush_lsn: Lsn,
    /// The uploader's commit_lsn: the object's bytes below it are committed.
    pub commit_lsn: Lsn,
    pub node_id: u64,
}

/// Parses a name made by [`partial_name`]; `None` for anything else.
pub fn parse_partial_name(seg: SegmentSize, name: &str) -> Option<PartialName> {
    let base = name.strip_suffix(".partial")?;
    let mut parts = base.split('_');
    let (segno, partial) = seg.parse_file_name(parts.next()?)?;
    let term = parts.next()?.parse().ok()?;
    let flush = parts.next()?;
    let commit = parts.next()?;
    let node_id = parts.next()?.strip_prefix("sk")?.parse().ok()?;
    if partial || parts.next().is_some() || flush.len() != 16 || commit.len() != 16 {
        return None;
    }
    let parsed = PartialName {
        segno,
        term,
        flush_lsn: Lsn(u64::from_str_radix(flush, 16).ok()?),
        commit_lsn: Lsn(u64::from_str_radix(commit, 16).ok()?),
        node_id,
    };
    // Only what `partial_name` makes: the same text back.
    (partial_name(
        seg,
        segno,
        term,
        parsed.flush_lsn,
        parsed.commit_lsn,
        node_id,
    ) == name)
        .then_some(parsed)
}

/// The key of a partial object inside the backup location.
pub fn partial_key(name: &str) -> String {
    format!("{PARTIAL_DIR}/{name}")
}

/// Why a partial upload did not complete.
#[derive(Debug, thiserror::Error)]
pub enum PartialError {
    /// The control file could not be written: the safekeeper must stop.
    #[error(transparent)]
    Acceptor(#[from] AcceptorError),
    #[error(transparent)]
    Wal(#[from] WalStorageError),
    #[error(transparent)]
    Storage(#[from] ferry_storage::StorageError),
    #[error("term changed during upload (term {before} to {after}, last log term {log_before} to {log_after})")]
    TermChanged {
        before: Term,
        after: Term,
        log_before: Term,
        log_after: Term,
    },
}

impl PartialError {
    /// Whether the safekeeper must stop (its control file failed).
    pub fn is_fatal(&self) -> bool {
        matches!(self, PartialError::Acceptor(_))
    }
}

/// What one attempt did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// Nothing new to upload (an empty segment, or the uploaded object is
    /// current).
    Skipped,
    Uploaded(String),
}

fn uploaded(list: &[PartialRemoteSegment]) -> Option<&PartialRemoteSegment> {
    list.iter().find(|e| e.status == UploadStatus::Uploaded)
}

/// Whether `entry` already holds what the WAL is now.
fn is_current(entry: &PartialRemoteSegment, flush: Lsn, commit: Lsn, term: Term) -> bool {
    entry.flush_lsn == flush && entry.commit_lsn == commit && entry.term == term
}

/// Steps 1 to 4 of one upload of the current segment's flushed prefix.
pub async fn upload_once(
    acceptor: &Mutex<Acceptor>,
    reader: &WalReader,
    location: &Location,
    node_id: u64,
) -> Result<Attempt, PartialError> {
    // 1. The entry, persisted before the object can exist.
    let (entry, seg, term, log_term) = {
        let mut a = acceptor.lock().await;
        let seg = a.segment_size();
        let flush = a.flush_lsn();
        let commit = a.commit_lsn();
        let log_term = a.last_log_term();
        // A restored safekeeper's WAL is all in the backup already.
        if seg.offset(flush) == 0 || a.restored_up_to().is_some() {
            return Ok(Attempt::Skipped);
        }
        let mut list = a.partial_segments().to_vec();
        if uploaded(&list).is_some_and(|e| is_current(e, flush, commit, log_term)) {
            return Ok(Attempt::Skipped);
        }
        let entry = PartialRemoteSegment {
            status: UploadStatus::InProgress,
            name: partial_name(seg, seg.segno(flush), log_term, flush, commit, node_id),
            flush_lsn: flush,
            commit_lsn: commit,
            term: log_term,
        };
        // An entry of the same name (an attempt that failed) names the same
        // object: the new entry takes its place, so a name is listed once.
        list.retain(|e| e.name != entry.name);
        list.push(entry.clone());
        a.set_partial_segments(list).await?;
        (entry, seg, a.term(), log_term)
    };
    // 2. The flushed prefix of the segment.
    let begin = Lsn(seg.segno(entry.flush_lsn) * seg.bytes());
    let data = reader.read_all(begin, entry.flush_lsn).await?;
    location.put(&partial_key(&entry.name), data).await?;
    // 3. Uploaded, unless a new term may have changed what was read.
    {
        let mut a = acceptor.lock().await;
        if a.term() != term || a.last_log_term() != log_term {
            return Err(PartialError::TermChanged {
                before: term,
                after: a.term(),
                log_before: log_term,
                log_after: a.last_log_term(),
            });
        }
        assert!(
            entry.flush_lsn <= a.flush_lsn() && entry.commit_lsn <= a.commit_lsn(),
            "flush_lsn or commit_lsn went back within term {term}"
        );
        let list: Vec<PartialRemoteSegment> = a
            .partial_segments()
            .iter()
            .map(|e| {
                let mut e = e.clone();
                e.status = if e.name == entry.name {
                    UploadStatus::Uploaded
                } else {
                    UploadStatus::Deleting
                };
                e
            })
            .collect();
        a.set_partial_segments(list).await?;
    }
    // 4. The older objects go.
    gc(acceptor, location).await?;
    Ok(Attempt::Uploaded(entry.name))
}

/// Deletes every object whose entry is not `Uploaded` (but never one named
/// like the `Uploaded` entry), then drops those entries from the persisted
/// list.
pub async fn gc(acceptor: &Mutex<Acceptor>, location: &Location) -> Result<(), PartialError> {
    let list = acceptor.lock().await.partial_segments().to_vec();
    let keep = uploaded(&list).map(|e| e.name.clone());
    let mut deleted = Vec::new();
    for e in list.iter().filter(|e| e.status != UploadStatus::Uploaded) {
        if keep.as_deref() != Some(e.name.as_str()) {
            location.delete(&partial_key(&e.name)).await?;
        }
        deleted.push(e.name.clone());
    }
    if deleted.is_empty() {
        return Ok(());
    }
    let mut a = acceptor.lock().await;
    // Only the entries just handled go: the list may have grown meanwhile.
    let remaining: Vec<PartialRemoteSegment> = a
        .partial_segments()
        .iter()
        .filter(|e| e.status == UploadStatus::Uploaded || !deleted.contains(&e.name))
        .cloned()
        .collect();
    a.set_partial_segments(remaining).await?;
    Ok(())
}

/// Waits until flush_lsn has stayed in one segment (not at its start) for
/// `timeout` and what is uploaded is not current; returns `false` when the
/// view is gone. The timer is not reset by writes inside the segment.
pub async fn wait_for_stable_segment(
    view: &mut watch::Receiver<BackupView>,
    seg: SegmentSize,
    timeout: Duration,
) -> bool {
    'outer: loop {
        let current = *view.borrow_and_update();
        if seg.offset(current.flush_lsn) == 0 {
            if view.changed().await.is_err() {
                return false;
            }
            continue;
        }
        let segno = seg.segno(current.flush_lsn);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            tokio::select! {
                biased;
                () = tokio::time::sleep_until(deadline) => return true,
                changed = view.changed() => {
                    if changed.is_err() {
                        return false;
                    }
                    if seg.segno(view.borrow_and_update().flush_lsn) != segno {
                        continue 'outer;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_documented_form() {
        let seg = SegmentSize::new(16 << 20).expect("seg");
        assert_eq!(
            partial_name(seg, 2, 2, Lsn(0x2534868), Lsn(0x2534410), 1),
            "000000010000000000000002_2_0000000002534868_0000000002534410_sk1.partial"
        );
    }
}
