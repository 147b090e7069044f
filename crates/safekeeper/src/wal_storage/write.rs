//! The write path: contiguous writes across segment files, the decision to
//! preallocate the next segment, a full segment's sync and rename, the
//! fsync that reports flush_lsn, and truncation of divergent WAL.

use std::io;

use bytes::Bytes;
use ferry_env::DiskFile;
use ferry_wal::Lsn;

use super::{Preallocation, WalStorage, WalStorageError, PREALLOCATE_BELOW_BYTES_PER_FSYNC};

pub(super) struct OpenSegment {
    segno: u64,
    file: Box<dyn DiskFile>,
    /// Offset of the first write into it since it was opened.
    first_write_offset: u64,
    /// fsyncs of this segment since it was opened.
    fsyncs: u64,
    /// Whether to preallocate the next segment was decided.
    next_decided: bool,
}

impl WalStorage {
    /// Writes WAL at `begin` (which must be the current end); not durable until
    /// [`WalStorage::flush`].
    pub async fn write(&mut self, begin: Lsn, data: Bytes) -> Result<(), WalStorageError> {
        if begin != self.write_lsn {
            return Err(WalStorageError::NonContiguous {
                expected: self.write_lsn,
                got: begin,
            });
        }
        let mut pos = begin;
        let mut rest = data;
        while !rest.is_empty() {
            let segno = self.seg.segno(pos);
            let offset = self.seg.offset(pos);
            if self.open.as_ref().is_none_or(|o| o.segno != segno) {
                self.open_segment(segno).await?;
            }
            let n = rest.len().min((self.seg.bytes() - offset) as usize);
            let file = &self
                .open
                .as_ref()
                .ok_or_else(|| io::Error::other("no open segment"))?
                .file;
            let piece = rest.split_to(n);
            file.write_at(offset, piece.clone()).await?;
            self.tail.push(pos, piece);
            pos = Lsn(pos.0 + n as u64);
            self.decide_next_segment(offset + n as u64);
            if self.seg.offset(pos) == 0 {
                self.finish_segment().await?;
            }
        }
        self.write_lsn = pos;
        Ok(())
    }

    pub(super) async fn open_segment(&mut self, segno: u64) -> Result<(), WalStorageError> {
        let path = self.path(segno, true);
        let file = match self.disk.open(&path).await {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let spare_ready = self.spare.as_ref().is_some_and(|s| s.segno == segno);
                self.dir_dirty = true;
                if spare_ready || self.preallocate {
                    self.take_prepared(segno).await?;
                    self.segments_preallocated += 1;
                    self.disk.rename(&self.preparing_path(segno), &path).await?;
                    self.disk.open(&path).await?
                } else {
                    self.settle_spare().await;
                    self.disk.create_new(&path).await?
                }
            }
            Err(e) => return Err(e.into()),
        };
        self.open = Some(OpenSegment {
            segno,
            file,
            first_write_offset: self.seg.offset(self.write_lsn),
            fsyncs: 0,
            next_decided: false,
        });
        Ok(())
    }

    /// Half way through a segment, decides from its fsyncs so far whether the
    /// next one is preallocated, and if so starts preparing it.
    fn decide_next_segment(&mut self, offset: u64) {
        let Some(open) = self.open.as_mut() else {
            return;
        };
        if open.next_decided || offset < self.seg.bytes() / 2 {
            return;
        }
        open.next_decided = true;
        let written = offset.saturating_sub(open.first_write_offset);
        let segno = open.segno;
        self.preallocate = match self.policy {
            Preallocation::Auto => open.fsyncs * PREALLOCATE_BELOW_BYTES_PER_FSYNC > written,
            Preallocation::Always => true,
            Preallocation::Never => false,
        };
        if self.preallocate {
            self.start_spare(segno + 1);
        }
    }

    /// Syncs the full open segment and gives it its final name.
    async fn finish_segment(&mut self) -> Result<(), WalStorageError> {
        if let Some(open) = self.open.take() {
            open.file.sync_data().await?;
            self.disk
                .rename(&self.path(open.segno, true), &self.path(open.segno, false))
                .await?;
            self.dir_dirty = true;
            // A full segment is read again only by a lagging reader: its pages
            // go back to the page cache's free memory, where the next segment's
            // writes find them (a hint; failing it changes nothing).
            if let Err(e) = open.file.drop_cache().await {
                tracing::debug!(error = %e, "could not drop a full segment from the page cache");
            }
        }
        Ok(())
    }

    /// Makes everything written durable; returns the new flush_lsn.
    pub async fn flush(&mut self) -> Result<Lsn, WalStorageError> {
        if self.flush_lsn == self.write_lsn && !self.dir_dirty {
            return Ok(self.flush_lsn);
        }
        if let Some(open) = self.open.as_mut() {
            open.file.sync_data().await?;
            open.fsyncs += 1;
        }
        if self.dir_dirty {
            self.disk.sync_dir(&self.dir).await?;
            self.dir_dirty = false;
        }
        self.flush_lsn = self.write_lsn;
        Ok(self.flush_lsn)
    }

    /// Cuts the WAL back to `lsn` (divergent WAL of an older term), durably.
    pub async fn truncate(&mut self, lsn: Lsn) -> Result<(), WalStorageError> {
        self.flush().await?;
        if lsn > self.flush_lsn {
            return Err(WalStorageError::BeyondFlush {
                lsn,
                flush_lsn: self.flush_lsn,
            });
        }
        if lsn == self.flush_lsn {
            return Ok(());
        }
        self.tail.truncate(lsn);
        self.cut_after(lsn).await?;
        self.write_lsn = lsn;
        self.flush_lsn = lsn;
        Ok(())
    }
}
