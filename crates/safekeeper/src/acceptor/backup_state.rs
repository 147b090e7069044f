//! The acceptor's side of the WAL backup: the view the backup tasks follow
//! (positions and duty), the backup_lsn they report, the list of remote
//! partial segments, and their upload counters.

use ferry_wal::Lsn;
use tokio::sync::watch;

use super::{Acceptor, AcceptorError};
use crate::backup::BackupView;
use crate::wal_storage::WalReader;

impl Acceptor {
    /// Follows what the backup needs: commit_lsn, backup_lsn, term and duty.
    pub fn subscribe_backup(&self) -> watch::Receiver<BackupView> {
        self.backup_view.subscribe()
    }

    /// A reader of committed WAL for the backup (whole segments below
    /// commit_lsn, which never change).
    pub fn wal_reader(&self) -> WalReader {
        self.wal.reader()
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

    pub(super) fn publish_backup(&self) {
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
}
