//! Recovery at open: the WAL's real end found by walking records from a
//! known boundary, WAL missing or damaged below the durable point refused
//! (naming the file), and everything after the last valid record cut.

use std::collections::BTreeMap;
use std::sync::Arc;

use ferry_env::Disk;
use ferry_wal::record::{self, RecordError};
use ferry_wal::segment::SegmentSize;
use ferry_wal::Lsn;

use super::read::WalTail;
use super::segments::{list_segments, write_zeros, PREPARING_SUFFIX};
use super::{Preallocation, WalStorage, WalStorageError};

/// Where a walk of records stopped, and why.
struct WalEnd {
    lsn: Lsn,
    why: &'static str,
}

impl WalStorage {
    /// Opens the WAL in `dir`, finds its real end by walking records from
    /// `record_boundary` (a position known to start a record and to be durable:
    /// the start of the timeline, or the persisted commit_lsn), checks that
    /// every record up to `durable` (the persisted commit_lsn) is there and
    /// intact, and cuts any torn tail after it.
    pub async fn open(
        disk: Arc<dyn Disk>,
        dir: &str,
        seg: SegmentSize,
        policy: Preallocation,
        record_boundary: Lsn,
        durable: Lsn,
    ) -> Result<WalStorage, WalStorageError> {
        if record_boundary > durable {
            return Err(WalStorageError::Corrupt(format!(
                "the walk of records would start at {record_boundary}, past the durable point {durable}"
            )));
        }
        disk.create_dir_all(dir).await?;
        let segments = list_segments(disk.as_ref(), dir, seg).await?;
        let mut wal = WalStorage {
            disk,
            dir: dir.to_string(),
            seg,
            write_lsn: record_boundary,
            flush_lsn: record_boundary,
            open: None,
            spare: None,
            policy,
            preallocate: policy != Preallocation::Never,
            segments_preallocated: 0,
            dir_dirty: false,
            tail: WalTail::for_segment(seg),
        };
        let end = wal.find_end(&segments, record_boundary, durable).await?;
        wal.cut_after(end).await?;
        wal.write_lsn = end;
        wal.flush_lsn = end;
        // The segment the next write goes to is ready before the first append.
        wal.open_segment(seg.segno(end)).await?;
        wal.flush().await?;
        Ok(wal)
    }

    /// The WAL at `lsn` is damaged: it lies below `durable`.
    fn damaged(
        &self,
        segments: &BTreeMap<u64, bool>,
        lsn: Lsn,
        durable: Lsn,
        what: &str,
    ) -> WalStorageError {
        let segno = self.seg.segno(lsn);
        let partial = segments.get(&segno).copied().unwrap_or(false);
        WalStorageError::Damaged {
            path: self.path(segno, partial),
            detail: format!(
                "{what} at {lsn}, below the recorded commit_lsn {durable}: WAL this safekeeper promised is missing or damaged"
            ),
        }
    }

    async fn find_end(
        &self,
        segments: &BTreeMap<u64, bool>,
        start: Lsn,
        durable: Lsn,
    ) -> Result<Lsn, WalStorageError> {
        let first = self.seg.segno(start);
        if durable > start {
            let last_needed = self.seg.segno(Lsn(durable.0 - 1));
            if let Some(missing) = (first..=last_needed).find(|s| !segments.contains_key(s)) {
                let at = Lsn(self.seg.bytes() * missing).max(start);
                return Err(self.damaged(
                    segments,
                    at,
                    durable,
                    "segment file missing (with or without .partial)",
                ));
            }
        }
        let end = self.walk_records(segments, start).await?;
        if end.lsn < durable {
            return Err(self.damaged(segments, end.lsn, durable, end.why));
        }
        Ok(end.lsn)
    }

    /// Walks records from `start` to the first position that does not begin a
    /// whole, valid record.
    async fn walk_records(
        &self,
        segments: &BTreeMap<u64, bool>,
        start: Lsn,
    ) -> Result<WalEnd, WalStorageError> {
        let first = self.seg.segno(start);
        if !segments.contains_key(&first) {
            if segments.range(first..).next().is_some() {
                return Err(WalStorageError::Corrupt(format!(
                    "segment {} holding {start} is missing but later ones exist",
                    self.seg.file_name(first)
                )));
            }
            // Nothing written at or after the boundary.
            return Ok(WalEnd {
                lsn: start,
                why: "segment file missing",
            });
        }
        let mut carry: Vec<u8> = Vec::new();
        let mut carry_start = start;
        let mut segno = first;
        let mut why = "the WAL ends";
        while let Some(&partial) = segments.get(&segno) {
            let mut data = self.disk.read(&self.path(segno, partial)).await?;
            if segno == first {
                let skip = self.seg.offset(start) as usize;
                if data.len() < skip {
                    return Ok(WalEnd {
                        lsn: start,
                        why: "segment file too short",
                    });
                }
                data.drain(..skip);
            }
            let full = data.len() as u64
                + if segno == first {
                    self.seg.offset(start)
                } else {
                    0
                }
                == self.seg.bytes();
            carry.extend_from_slice(&data);
            let mut at = 0;
            let mut stop = false;
            loop {
                match record::check(&carry[at..]) {
                    Ok(len) => at += len,
                    Err(RecordError::Incomplete { .. }) => break,
                    Err(_) => {
                        why = "record fails its checksum (or is not a record)";
                        stop = true;
                        break;
                    }
                }
            }
            carry.drain(..at);
            carry_start = Lsn(carry_start.0 + at as u64);
            if stop {
                break;
            }
            if !full {
                why = "segment file too short (the record there is incomplete)";
                break;
            }
            segno += 1;
            if !segments.contains_key(&segno) {
                why = if carry.is_empty() {
                    "segment file missing"
                } else {
                    "segment file missing (a record continues into it)"
                };
            }
        }
        Ok(WalEnd {
            lsn: carry_start,
            why,
        })
    }

    /// Removes every byte at or after `end`, durably: later segments are deleted
    /// and the rest of `end`'s segment is zeroed (keeping it full length), so no
    /// stale record past the end can ever be read as WAL again.
    pub(super) async fn cut_after(&mut self, end: Lsn) -> Result<(), WalStorageError> {
        self.open = None;
        self.settle_spare().await;
        for name in self.disk.list_dir(&self.dir).await? {
            if name.ends_with(PREPARING_SUFFIX) {
                self.disk
                    .remove_file(&format!("{}/{name}", self.dir))
                    .await?;
            }
        }
        let segments = list_segments(self.disk.as_ref(), &self.dir, self.seg).await?;
        let end_segno = self.seg.segno(end);
        for (&segno, &partial) in segments.iter() {
            if segno > end_segno {
                self.disk.remove_file(&self.path(segno, partial)).await?;
            } else if segno == end_segno {
                if !partial {
                    self.disk
                        .rename(&self.path(segno, false), &self.path(segno, true))
                        .await?;
                }
                let path = self.path(segno, true);
                let keep = self.seg.offset(end);
                let data = self.disk.read(&path).await?;
                let dirty_end = data
                    .iter()
                    .rposition(|&b| b != 0)
                    .map_or(0, |i| i as u64 + 1)
                    .min(self.seg.bytes());
                let file = self.disk.open(&path).await?;
                let size = data.len() as u64;
                let mut changed = false;
                if size > self.seg.bytes() {
                    file.set_len(self.seg.bytes()).await?;
                    changed = true;
                }
                if dirty_end > keep {
                    write_zeros(file.as_ref(), keep, dirty_end).await?;
                    changed = true;
                }
                if size < self.seg.bytes() {
                    // Written before segments were preallocated, or torn.
                    write_zeros(file.as_ref(), size.max(keep), self.seg.bytes()).await?;
                    changed = true;
                }
                if changed {
                    file.sync_data().await?;
                }
            } else if partial {
                // A full segment whose rename did not survive a crash.
                self.disk
                    .rename(&self.path(segno, true), &self.path(segno, false))
                    .await?;
            }
        }
        self.disk.sync_dir(&self.dir).await?;
        self.dir_dirty = false;
        Ok(())
    }
}
