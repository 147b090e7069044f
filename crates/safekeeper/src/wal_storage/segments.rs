//! Segment files: their names (whole, `.partial`, and `.prep` while being
//! preallocated), the zero-filled spare prepared in the background, the
//! listing of a WAL directory, and the removal of old segments.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;

use bytes::Bytes;
use ferry_env::{Disk, DiskFile};
use ferry_wal::segment::{SegmentSize, PARTIAL_SUFFIX};
use ferry_wal::Lsn;

use super::{WalStorage, WalStorageError};

/// Name suffix of a segment being preallocated.
pub(super) const PREPARING_SUFFIX: &str = ".prep";
/// Zeros are written in pieces of this size.
const ZERO_CHUNK_BYTES: usize = 1 << 20;
static ZEROS: [u8; ZERO_CHUNK_BYTES] = [0; ZERO_CHUNK_BYTES];

/// Writes zeros over `[from, to)` of `file`.
pub(super) async fn write_zeros(file: &dyn DiskFile, from: u64, to: u64) -> io::Result<()> {
    let mut at = from;
    while at < to {
        let n = ((to - at) as usize).min(ZERO_CHUNK_BYTES);
        file.write_at(at, Bytes::from_static(&ZEROS[..n])).await?;
        at += n as u64;
    }
    Ok(())
}

/// Creates `path` (replacing a leftover) as `len` zero bytes, synced.
/// Each piece is synced as it is written: 16 MiB of zeros written back at
/// once held every WAL fsync on the disk for ~24 ms at each segment (four
/// safekeepers on one disk, `docs/benchmarks.md`); in pieces they pass
/// between them.
async fn prepare_segment_file(disk: Arc<dyn Disk>, path: String, len: u64) -> io::Result<()> {
    match disk.remove_file(&path).await {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let file = disk.create_new(&path).await?;
    let mut at = 0;
    while at < len {
        let to = (at + ZERO_CHUNK_BYTES as u64).min(len);
        write_zeros(file.as_ref(), at, to).await?;
        file.sync_data().await?;
        at = to;
    }
    if len == 0 {
        file.sync_data().await?;
    }
    Ok(())
}

/// The next segment, being preallocated in the background.
pub(super) struct Spare {
    pub(super) segno: u64,
    task: tokio::task::JoinHandle<io::Result<()>>,
}

impl WalStorage {
    pub(super) fn path(&self, segno: u64, partial: bool) -> String {
        let suffix = if partial { PARTIAL_SUFFIX } else { "" };
        format!("{}/{}{suffix}", self.dir, self.seg.file_name(segno))
    }

    pub(super) fn preparing_path(&self, segno: u64) -> String {
        format!(
            "{}/{}{PREPARING_SUFFIX}",
            self.dir,
            self.seg.file_name(segno)
        )
    }

    /// Stops preallocating (a killed node must not touch its disk any more).
    pub fn stop_background(&mut self) {
        if let Some(spare) = self.spare.take() {
            spare.task.abort();
        }
    }

    /// Starts preallocating segment `segno` in the background, unless it is.
    pub(super) fn start_spare(&mut self, segno: u64) {
        if self.spare.as_ref().is_some_and(|s| s.segno == segno) {
            return;
        }
        self.stop_background();
        let task = tokio::spawn(prepare_segment_file(
            Arc::clone(&self.disk),
            self.preparing_path(segno),
            self.seg.bytes(),
        ));
        self.spare = Some(Spare { segno, task });
    }

    /// Waits for the background preallocation to end (so that it cannot race
    /// with a change of the directory).
    pub(super) async fn settle_spare(&mut self) {
        if let Some(spare) = self.spare.take() {
            spare.task.abort();
            let _ = spare.task.await;
        }
    }

    /// A preallocated, synced `<segno>.prep` file: the spare if it is for
    /// `segno`, else made now.
    pub(super) async fn take_prepared(&mut self, segno: u64) -> Result<(), WalStorageError> {
        if let Some(spare) = self.spare.take() {
            if spare.segno == segno {
                // A cancelled task (`Err`) leaves the work to be done here.
                if let Ok(result) = spare.task.await {
                    return result.map_err(Into::into);
                }
            } else {
                spare.task.abort();
                let _ = spare.task.await;
            }
        }
        prepare_segment_file(
            Arc::clone(&self.disk),
            self.preparing_path(segno),
            self.seg.bytes(),
        )
        .await?;
        Ok(())
    }

    /// Removes every whole segment below `segno` (they must be behind every
    /// consumer; the caller decides that). Returns how many were removed.
    pub async fn remove_below(&mut self, segno: u64) -> Result<usize, WalStorageError> {
        let limit = segno.min(self.seg.segno(self.flush_lsn));
        // Removed means gone, from memory too.
        self.tail.forget_below(Lsn(limit * self.seg.bytes()));
        let segments = list_segments(self.disk.as_ref(), &self.dir, self.seg).await?;
        let mut removed = 0;
        for (&s, &partial) in segments.range(..limit) {
            self.disk.remove_file(&self.path(s, partial)).await?;
            removed += 1;
        }
        if removed > 0 {
            self.disk.sync_dir(&self.dir).await?;
        }
        Ok(removed)
    }
}

/// Segment files in `dir`: segno → is it `.partial`. Two files for one segment is
/// damage (a rename is atomic, so it cannot happen by crashing).
pub(super) async fn list_segments(
    disk: &dyn Disk,
    dir: &str,
    seg: SegmentSize,
) -> Result<BTreeMap<u64, bool>, WalStorageError> {
    let mut segments = BTreeMap::new();
    for name in disk.list_dir(dir).await? {
        if let Some((segno, partial)) = seg.parse_file_name(&name) {
            if segments.insert(segno, partial).is_some() {
                return Err(WalStorageError::Corrupt(format!(
                    "segment {} exists both whole and partial",
                    seg.file_name(segno)
                )));
            }
        }
    }
    Ok(segments)
}
