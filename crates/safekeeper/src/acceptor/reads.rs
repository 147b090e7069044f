//! Reads of a safekeeper's WAL: committed WAL for walsenders (without the
//! acceptor's lock, from the backup once removed here), and the recovery
//! reads of an elected writer.

use bytes::Bytes;
use ferry_wal::proto::{FromSafekeeper, MAX_READ_WAL_BYTES, MAX_SEND_BYTES};
use ferry_wal::{Lsn, Term};
use tokio::sync::watch;

use super::{refused, Acceptor, AcceptorError, FeedbackBoard};
use crate::backup::{BackupView, RemoteWal};
use crate::wal_storage::{WalReader, WalStorageError};

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

impl Acceptor {
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

    /// Where recovery reads find WAL removed here (below backup_lsn).
    pub fn set_remote(&mut self, remote: crate::backup::RemoteWal) {
        self.remote = Some(remote);
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

    pub(super) async fn read_range(
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
