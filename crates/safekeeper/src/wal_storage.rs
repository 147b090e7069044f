//! WAL bytes on the local disk, in segment files.
//!
//! Invariants:
//! * bytes are written contiguously: a write starts exactly at `write_lsn`;
//! * `flush_lsn` is reported only after the data and every directory change
//!   needed to reach it (a new segment file, a rename) were synced;
//! * a segment is renamed from `<name>.partial` to `<name>` only when it is full
//!   and synced;
//! * every byte of a `<name>.partial` file past `write_lsn` is zero (or absent);
//! * segments are preallocated while commits are small: a new segment is filled
//!   with zeros and synced under a temporary name (`<name>.prep`, by a background
//!   task started half a segment ahead) and then renamed into place. Writes into
//!   it never change the file's size, so an `fdatasync` flushes data blocks
//!   without a file-system journal commit (about half the latency on ext4, and
//!   safekeepers sharing a disk no longer queue behind one journal). Zeroing costs
//!   a segment's worth of disk writes, which pays only when there are many
//!   fsyncs per segment; when the first half of a segment averaged at least
//!   [`PREALLOCATE_BELOW_BYTES_PER_FSYNC`] per fsync (bulk loads), the next
//!   segment is not zeroed but grows with its writes instead;
//! * after a crash, [`WalStorage::open`] walks records from a known record boundary
//!   (the start of the timeline while no segment was removed) and cuts everything
//!   after the last valid record, so a torn tail never becomes WAL; committed WAL
//!   is never cut because it lies below every safekeeper's durable flush point;
//! * WAL below the persisted commit_lsn was synced before it was recorded, so it
//!   cannot be torn: a segment missing or too short below it, or a record there
//!   failing its checksum, is damage. [`WalStorage::open`] refuses it with
//!   [`WalStorageError::Damaged`] naming the file, never cuts it as a torn tail.
//!   (WAL past the persisted commit_lsn, at most a segment after an unclean stop,
//!   cannot be told from a torn tail and is cut like one.)

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;

use bytes::Bytes;
use ferry_env::{Disk, DiskFile};
use ferry_wal::record::{self, RecordError};
use ferry_wal::segment::{SegmentSize, PARTIAL_SUFFIX};
use ferry_wal::Lsn;

/// Why a WAL operation failed.
#[derive(Debug, thiserror::Error)]
pub enum WalStorageError {
    #[error("WAL I/O: {0}")]
    Io(#[from] io::Error),
    #[error("WAL write at {got} but the WAL ends at {expected}")]
    NonContiguous { expected: Lsn, got: Lsn },
    #[error("WAL position {lsn} is beyond the flushed end {flush_lsn}")]
    BeyondFlush { lsn: Lsn, flush_lsn: Lsn },
    #[error("WAL at {lsn} was removed locally")]
    Removed { lsn: Lsn },
    #[error("WAL is damaged: {0}")]
    Corrupt(String),
    /// WAL below the recorded commit point is missing or fails its checksums:
    /// this safekeeper must not serve (it may be rebuilt from its peers by an
    /// explicit operator action, never implicitly).
    #[error("{path}: {detail}")]
    Damaged { path: String, detail: String },
}

struct OpenSegment {
    segno: u64,
    file: Box<dyn DiskFile>,
    /// Offset of the first write into it since it was opened.
    first_write_offset: u64,
    /// fsyncs of this segment since it was opened.
    fsyncs: u64,
    /// Whether to preallocate the next segment was decided.
    next_decided: bool,
}

/// Preallocate the next segment when the current one averaged fewer WAL bytes
/// than this per fsync: about what the disk writes sequentially in the time of
/// the journal commit that an fsync of a growing file adds.
pub const PREALLOCATE_BELOW_BYTES_PER_FSYNC: u64 = 64 << 10;

/// When new segments are zero-filled ahead of time (see the module invariants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preallocation {
    /// While commits are small (fewer than
    /// [`PREALLOCATE_BELOW_BYTES_PER_FSYNC`] per fsync).
    #[default]
    Auto,
    /// Always: every fsync is a data-only flush, at the price of writing every
    /// segment twice.
    Always,
    /// Never: segments grow with their writes (on copy-on-write file systems,
    /// where zero-filling does not avoid metadata updates, this is the right one).
    Never,
}

impl std::str::FromStr for Preallocation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Preallocation::Auto),
            "always" => Ok(Preallocation::Always),
            "never" => Ok(Preallocation::Never),
            other => Err(format!(
                "WAL preallocation {other:?} is not one of auto, always, never"
            )),
        }
    }
}

impl std::fmt::Display for Preallocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Preallocation::Auto => "auto",
            Preallocation::Always => "always",
            Preallocation::Never => "never",
        })
    }
}

/// Name suffix of a segment being preallocated.
const PREPARING_SUFFIX: &str = ".prep";
/// Zeros are written in pieces of this size.
const ZERO_CHUNK_BYTES: usize = 1 << 20;
static ZEROS: [u8; ZERO_CHUNK_BYTES] = [0; ZERO_CHUNK_BYTES];

/// Writes zeros over `[from, to)` of `file`.
async fn write_zeros(file: &dyn DiskFile, from: u64, to: u64) -> io::Result<()> {
    let mut at = from;
    while at < to {
        let n = ((to - at) as usize).min(ZERO_CHUNK_BYTES);
        file.write_at(at, Bytes::from_static(&ZEROS[..n])).await?;
        at += n as u64;
    }
    Ok(())
}

/// Creates `path` (replacing a leftover) as `len` zero bytes, synced.
async fn prepare_segment_file(disk: Arc<dyn Disk>, path: String, len: u64) -> io::Result<()> {
    match disk.remove_file(&path).await {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let file = disk.create_new(&path).await?;
    write_zeros(file.as_ref(), 0, len).await?;
    file.sync_data().await
}

/// Where a walk of records stopped, and why.
struct WalEnd {
    lsn: Lsn,
    why: &'static str,
}

/// The next segment, being preallocated in the background.
struct Spare {
    segno: u64,
    task: tokio::task::JoinHandle<io::Result<()>>,
}

/// The WAL of one safekeeper.
pub struct WalStorage {
    disk: Arc<dyn Disk>,
    dir: String,
    seg: SegmentSize,
    write_lsn: Lsn,
    flush_lsn: Lsn,
    open: Option<OpenSegment>,
    spare: Option<Spare>,
    policy: Preallocation,
    /// New segments are preallocated now (see the module invariants).
    preallocate: bool,
    /// Segments zero-filled since start (each one a segment of extra writes).
    segments_preallocated: u64,
    dir_dirty: bool,
    /// Recently written WAL, for walsenders.
    tail: WalTail,
}

impl Drop for WalStorage {
    fn drop(&mut self) {
        self.stop_background();
    }
}

impl std::fmt::Debug for WalStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalStorage")
            .field("dir", &self.dir)
            .field("write_lsn", &self.write_lsn)
            .field("flush_lsn", &self.flush_lsn)
            .finish()
    }
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
            tail: WalTail::default(),
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

    pub fn write_lsn(&self) -> Lsn {
        self.write_lsn
    }

    pub fn flush_lsn(&self) -> Lsn {
        self.flush_lsn
    }

    pub fn segment_size(&self) -> SegmentSize {
        self.seg
    }

    /// Whether new segments are preallocated now.
    pub fn preallocates(&self) -> bool {
        self.preallocate
    }

    /// Segments zero-filled since start.
    pub fn segments_preallocated(&self) -> u64 {
        self.segments_preallocated
    }

    fn path(&self, segno: u64, partial: bool) -> String {
        let suffix = if partial { PARTIAL_SUFFIX } else { "" };
        format!("{}/{}{suffix}", self.dir, self.seg.file_name(segno))
    }

    fn preparing_path(&self, segno: u64) -> String {
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
    fn start_spare(&mut self, segno: u64) {
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
    async fn settle_spare(&mut self) {
        if let Some(spare) = self.spare.take() {
            spare.task.abort();
            let _ = spare.task.await;
        }
    }

    /// A preallocated, synced `<segno>.prep` file: the spare if it is for
    /// `segno`, else made now.
    async fn take_prepared(&mut self, segno: u64) -> Result<(), WalStorageError> {
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
    async fn cut_after(&mut self, end: Lsn) -> Result<(), WalStorageError> {
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

    async fn open_segment(&mut self, segno: u64) -> Result<(), WalStorageError> {
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

    /// Reads flushed WAL from `begin`: at most `max` bytes, and never across a
    /// segment boundary (call again for the rest).
    pub async fn read(&self, begin: Lsn, max: usize) -> Result<Bytes, WalStorageError> {
        if begin > self.flush_lsn {
            return Err(WalStorageError::BeyondFlush {
                lsn: begin,
                flush_lsn: self.flush_lsn,
            });
        }
        self.reader().read(begin, self.flush_lsn, max).await
    }

    /// A reader of this WAL that needs no access to the storage itself, so that
    /// walsenders read committed WAL while appends and fsyncs go on.
    pub fn reader(&self) -> WalReader {
        WalReader {
            disk: Arc::clone(&self.disk),
            dir: self.dir.clone(),
            seg: self.seg,
            tail: self.tail.clone(),
        }
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

/// Most bytes of recently written WAL kept in memory for walsenders.
pub const TAIL_BYTES: usize = 16 << 20;

/// The most recently written WAL, as the very buffers that were written (no
/// copy), so that walsenders following the end of WAL read memory, not disk.
/// Cut with the WAL on truncation, so it never holds bytes the WAL lost.
#[derive(Debug, Clone, Default)]
struct WalTail(Arc<std::sync::Mutex<TailChunks>>);

#[derive(Debug, Default)]
struct TailChunks {
    chunks: std::collections::VecDeque<(Lsn, Bytes)>,
    bytes: usize,
}

impl WalTail {
    fn lock(&self) -> std::sync::MutexGuard<'_, TailChunks> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records `data`, written at `begin` (right after the previous chunk).
    fn push(&self, begin: Lsn, data: Bytes) {
        let mut t = self.lock();
        t.bytes += data.len();
        t.chunks.push_back((begin, data));
        while t.bytes > TAIL_BYTES {
            match t.chunks.pop_front() {
                Some((_, old)) => t.bytes -= old.len(),
                None => break,
            }
        }
    }

    /// Forgets everything at or after `lsn` (the WAL was cut there).
    fn truncate(&self, lsn: Lsn) {
        let mut t = self.lock();
        while let Some((begin, data)) = t.chunks.back() {
            let end = Lsn(begin.0 + data.len() as u64);
            if end <= lsn {
                break;
            }
            if *begin >= lsn {
                let len = data.len();
                t.chunks.pop_back();
                t.bytes -= len;
            } else {
                let keep = lsn.distance_from(*begin) as usize;
                let cut = data.len() - keep;
                if let Some((_, last)) = t.chunks.back_mut() {
                    last.truncate(keep);
                }
                t.bytes -= cut;
                break;
            }
        }
    }

    /// Forgets every chunk that starts below `lsn` (that WAL was removed).
    fn forget_below(&self, lsn: Lsn) {
        let mut t = self.lock();
        while t.chunks.front().is_some_and(|(begin, _)| *begin < lsn) {
            if let Some((_, old)) = t.chunks.pop_front() {
                t.bytes -= old.len();
            }
        }
    }

    /// The bytes from `begin` up to `end` (at most `max`) if they are in memory.
    fn read(&self, begin: Lsn, end: Lsn, max: usize) -> Option<Bytes> {
        let t = self.lock();
        let first = t.chunks.front()?.0;
        if begin < first {
            return None;
        }
        // Chunks are contiguous: find the one holding `begin`.
        let i = t
            .chunks
            .partition_point(|(b, d)| b.0 + d.len() as u64 <= begin.0);
        let (b, data) = t.chunks.get(i)?;
        let from = begin.distance_from(*b) as usize;
        let len = (data.len() - from)
            .min(max)
            .min(end.distance_from(begin) as usize);
        Some(data.slice(from..from + len))
    }
}

/// Reads WAL that can no longer change: below a commit_lsn (never truncated)
/// or a flush_lsn known to the caller. Needs nothing from [`WalStorage`] but
/// the file names, so it runs beside appends. A segment being renamed from
/// `.partial` to whole is found under either name.
#[derive(Debug, Clone)]
pub struct WalReader {
    disk: Arc<dyn Disk>,
    dir: String,
    seg: SegmentSize,
    tail: WalTail,
}

impl WalReader {
    fn path(&self, segno: u64, partial: bool) -> String {
        let suffix = if partial { PARTIAL_SUFFIX } else { "" };
        format!("{}/{}{suffix}", self.dir, self.seg.file_name(segno))
    }

    /// All of `[begin, end)` in one buffer, within one segment (the backup's
    /// whole and partial segment uploads); the caller vouches for it as for
    /// [`WalReader::read`].
    pub async fn read_all(&self, begin: Lsn, end: Lsn) -> Result<Bytes, WalStorageError> {
        let mut data = bytes::BytesMut::with_capacity(end.distance_from(begin) as usize);
        let mut pos = begin;
        while pos < end {
            let chunk = self.read(pos, end, end.distance_from(pos) as usize).await?;
            if chunk.is_empty() {
                return Err(WalStorageError::BeyondFlush {
                    lsn: pos,
                    flush_lsn: pos,
                });
            }
            pos = Lsn(pos.0 + chunk.len() as u64);
            data.extend_from_slice(&chunk);
        }
        Ok(data.freeze())
    }

    /// WAL from `begin`, at most `max` bytes, never past `end` nor past the
    /// end of `begin`'s segment. The caller vouches that `[begin, end)` is
    /// durable and will not be truncated (committed WAL).
    pub async fn read(&self, begin: Lsn, end: Lsn, max: usize) -> Result<Bytes, WalStorageError> {
        let segno = self.seg.segno(begin);
        let offset = self.seg.offset(begin);
        let len = (end.distance_from(begin))
            .min(max as u64)
            .min(self.seg.bytes() - offset) as usize;
        if len == 0 {
            return Ok(Bytes::new());
        }
        if let Some(bytes) = self.tail.read(begin, Lsn(begin.0 + len as u64), len) {
            return Ok(bytes);
        }
        // Whole, then partial, then whole again: a rename between the first
        // two looks makes the segment appear under the third.
        let mut found = None;
        for partial in [false, true, false] {
            match self.disk.open(&self.path(segno, partial)).await {
                Ok(f) => {
                    found = Some(f);
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
        let Some(file) = found else {
            return Err(WalStorageError::Removed { lsn: begin });
        };
        Ok(Bytes::from(file.read_at(offset, len).await?))
    }
}

/// Segment files in `dir`: segno → is it `.partial`. Two files for one segment is
/// damage (a rename is atomic, so it cannot happen by crashing).
async fn list_segments(
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

#[cfg(test)]
// Tests set up and damage real files directly; node code may not.
#[allow(clippy::disallowed_methods, clippy::disallowed_types)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use ferry_env::RealDisk;
    use ferry_wal::record::Record;

    const SEG: u64 = 64 << 10;

    fn records(n: usize, size: usize) -> Vec<u8> {
        let mut buf = BytesMut::new();
        for i in 0..n {
            Record::Insert {
                shard: 0,
                idempotency_key: bytes::Bytes::new(),
                table_id: 1,
                block_number: i as u64,
                arrow_ipc: Bytes::from(vec![i as u8; size]),
            }
            .encode(&mut buf);
        }
        buf.to_vec()
    }

    async fn open(root: &std::path::Path, boundary: Lsn) -> WalStorage {
        open_with(root, boundary, Preallocation::Auto).await
    }

    async fn open_with(root: &std::path::Path, boundary: Lsn, policy: Preallocation) -> WalStorage {
        try_open(root, boundary, boundary, policy)
            .await
            .expect("open")
    }

    async fn try_open(
        root: &std::path::Path,
        boundary: Lsn,
        durable: Lsn,
        policy: Preallocation,
    ) -> Result<WalStorage, WalStorageError> {
        let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(root).expect("disk"));
        WalStorage::open(
            disk,
            "wal",
            SegmentSize::new(SEG).expect("seg"),
            policy,
            boundary,
            durable,
        )
        .await
    }

    /// Writes ~300 KiB of records (five segments) with one fsync per 7000
    /// bytes; returns the end of WAL.
    async fn write_five_segments(root: &std::path::Path, policy: Preallocation) -> Lsn {
        let mut wal = open_with(root, Lsn(0), policy).await;
        let data = records(100, 3000);
        for chunk in data.chunks(7000) {
            let at = wal.write_lsn();
            wal.write(at, Bytes::copy_from_slice(chunk))
                .await
                .expect("write");
            wal.flush().await.expect("flush");
        }
        Lsn(data.len() as u64)
    }

    fn segment_path(root: &std::path::Path, segno: u64, partial: bool) -> std::path::PathBuf {
        let name = SegmentSize::new(SEG).expect("seg").file_name(segno);
        let suffix = if partial { ".partial" } else { "" };
        root.join("wal").join(format!("{name}{suffix}"))
    }

    /// Damage below the durable point is refused, naming the file, and
    /// changes nothing on disk.
    async fn damage_is_refused(
        policy: Preallocation,
        damage: impl FnOnce(&std::path::Path, Lsn),
        file: &str,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let end = write_five_segments(dir.path(), policy).await;
        damage(dir.path(), end);
        // A preallocation cut short by the drop may still land; it is not WAL.
        let wal_files = |root: &std::path::Path| {
            names(root)
                .into_iter()
                .filter(|n| !n.ends_with(PREPARING_SUFFIX))
                .collect::<Vec<_>>()
        };
        let before = wal_files(dir.path());
        let err = try_open(dir.path(), Lsn(0), end, policy)
            .await
            .expect_err("damage below the durable point is refused");
        match &err {
            WalStorageError::Damaged { path, .. } => {
                assert!(path.ends_with(file), "{err} names {file}")
            }
            other => panic!("not a damage error: {other}"),
        }
        assert!(err.to_string().contains(&end.to_string()), "{err}");
        assert_eq!(
            wal_files(dir.path()),
            before,
            "nothing was cut or recreated"
        );
    }

    #[tokio::test]
    async fn a_missing_segment_below_the_durable_point_is_refused() {
        let name = SegmentSize::new(SEG).expect("seg").file_name(1);
        damage_is_refused(
            Preallocation::Auto,
            |root, _| std::fs::remove_file(segment_path(root, 1, false)).expect("rm"),
            &name,
        )
        .await;
    }

    #[tokio::test]
    async fn a_deleted_current_segment_is_refused() {
        // A missing file is named without a suffix: either name would do.
        let name = SegmentSize::new(SEG).expect("seg").file_name(4);
        damage_is_refused(
            Preallocation::Never,
            |root, end| {
                assert_eq!(end.0 / SEG, 4);
                std::fs::remove_file(segment_path(root, 4, true)).expect("rm")
            },
            &name,
        )
        .await;
    }

    #[tokio::test]
    async fn a_truncated_segment_is_refused() {
        for policy in [Preallocation::Always, Preallocation::Never] {
            let name = format!(
                "{}.partial",
                SegmentSize::new(SEG).expect("seg").file_name(4)
            );
            damage_is_refused(
                policy,
                |root, end| {
                    let path = segment_path(root, 4, true);
                    let f = std::fs::OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .expect("open");
                    f.set_len(end.0 % SEG / 2).expect("truncate");
                },
                &name,
            )
            .await;
            // A whole segment cut short too.
            let name = SegmentSize::new(SEG).expect("seg").file_name(2);
            damage_is_refused(
                policy,
                |root, _| {
                    let f = std::fs::OpenOptions::new()
                        .write(true)
                        .open(segment_path(root, 2, false))
                        .expect("open");
                    f.set_len(SEG - 1000).expect("truncate");
                },
                &name,
            )
            .await;
        }
    }

    #[tokio::test]
    async fn a_flipped_byte_below_the_durable_point_is_refused() {
        let name = SegmentSize::new(SEG).expect("seg").file_name(1);
        damage_is_refused(
            Preallocation::Auto,
            |root, _| {
                let path = segment_path(root, 1, false);
                let mut bytes = std::fs::read(&path).expect("read");
                bytes[SEG as usize / 2] ^= 0x01;
                std::fs::write(&path, bytes).expect("write");
            },
            &name,
        )
        .await;
    }

    fn names(root: &std::path::Path) -> Vec<String> {
        let mut v: Vec<_> = std::fs::read_dir(root.join("wal"))
            .expect("ls")
            .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn segment_len(root: &std::path::Path, segno: u64) -> u64 {
        let name = SegmentSize::new(SEG).expect("seg").file_name(segno);
        std::fs::metadata(root.join("wal").join(format!("{name}.partial")))
            .expect("meta")
            .len()
    }

    #[test]
    fn the_tail_serves_recent_wal_and_forgets_what_was_cut() {
        let tail = WalTail::default();
        tail.push(Lsn(100), Bytes::from_static(b"abcdef"));
        tail.push(Lsn(106), Bytes::from_static(b"ghij"));
        assert_eq!(
            tail.read(Lsn(99), Lsn(110), 10),
            None,
            "older than the tail"
        );
        assert_eq!(
            tail.read(Lsn(102), Lsn(110), 10).as_deref(),
            Some(&b"cdef"[..])
        );
        assert_eq!(
            tail.read(Lsn(106), Lsn(108), 10).as_deref(),
            Some(&b"gh"[..])
        );
        assert_eq!(
            tail.read(Lsn(101), Lsn(110), 2).as_deref(),
            Some(&b"bc"[..])
        );
        assert_eq!(tail.read(Lsn(110), Lsn(120), 10), None, "past the tail");
        tail.truncate(Lsn(104));
        assert_eq!(
            tail.read(Lsn(102), Lsn(110), 10).as_deref(),
            Some(&b"cd"[..])
        );
        assert_eq!(tail.read(Lsn(104), Lsn(110), 10), None, "cut");
        tail.push(Lsn(104), Bytes::from_static(b"XY"));
        assert_eq!(
            tail.read(Lsn(103), Lsn(110), 10).as_deref(),
            Some(&b"d"[..])
        );
        assert_eq!(
            tail.read(Lsn(104), Lsn(110), 10).as_deref(),
            Some(&b"XY"[..])
        );
        // Bounded: old chunks leave as new ones come.
        let big = Bytes::from(vec![7u8; TAIL_BYTES / 2 + 1]);
        tail.push(Lsn(106), big.clone());
        tail.push(Lsn(106 + big.len() as u64), big);
        assert_eq!(tail.read(Lsn(106), Lsn(107), 1), None, "evicted");
        assert!(tail.lock().bytes <= TAIL_BYTES);
    }

    #[tokio::test]
    async fn a_reader_never_sees_wal_that_was_cut() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut wal = open(dir.path(), Lsn(0)).await;
        let first = records(10, 100);
        wal.write(Lsn(0), Bytes::from(first.clone()))
            .await
            .expect("write");
        wal.flush().await.expect("flush");
        let reader = wal.reader();
        let cut = Lsn(first.len() as u64 / 2);
        wal.truncate(cut).await.expect("truncate");
        let second = vec![0xEE; 300];
        wal.write(cut, Bytes::from(second.clone()))
            .await
            .expect("write");
        let end = wal.flush().await.expect("flush");
        let got = reader.read(cut, end, 1 << 20).await.expect("read");
        assert_eq!(&got[..], &second[..], "the new WAL, not the cut one");
        let got = reader.read(Lsn(0), cut, 1 << 20).await.expect("read");
        assert_eq!(&got[..], &first[..cut.0 as usize]);
    }

    #[tokio::test]
    async fn segments_are_preallocated_while_commits_are_small() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut wal = open(dir.path(), Lsn(0)).await;
        assert!(wal.preallocates(), "a fresh safekeeper preallocates");
        assert_eq!(
            segment_len(dir.path(), 0),
            SEG,
            "ready before the first write"
        );
        // Small commits (one ~1 KiB record per fsync) through the first segment:
        // the second one is preallocated.
        let small = records(1, 1000);
        while wal.write_lsn() < Lsn(SEG + 10) {
            let at = wal.write_lsn();
            wal.write(at, Bytes::copy_from_slice(&small))
                .await
                .expect("write");
            wal.flush().await.expect("flush");
        }
        assert!(wal.preallocates());
        assert_eq!(segment_len(dir.path(), 1), SEG);
        // Bulk writes (several segments per fsync): the next segment grows with
        // its writes instead of being zeroed first.
        let bulk = records(3, SEG as usize);
        let at = wal.write_lsn();
        wal.write(at, Bytes::copy_from_slice(&bulk))
            .await
            .expect("write");
        wal.flush().await.expect("flush");
        assert!(!wal.preallocates());
        let growing = SegmentSize::new(SEG).expect("seg").segno(wal.write_lsn());
        let len = segment_len(dir.path(), growing);
        assert_eq!(
            len,
            SegmentSize::new(SEG).expect("seg").offset(wal.write_lsn())
        );
        // Either kind of segment reopens to the same end.
        let end = wal.flush_lsn();
        drop(wal);
        let wal = open(dir.path(), Lsn(0)).await;
        assert_eq!(wal.flush_lsn(), end);
    }

    #[tokio::test]
    async fn the_policy_can_force_preallocation_on_or_off() {
        let bulk = records(3, SEG as usize);
        for (policy, zeroed) in [(Preallocation::Always, true), (Preallocation::Never, false)] {
            let dir = tempfile::tempdir().expect("tempdir");
            let mut wal = open_with(dir.path(), Lsn(0), policy).await;
            wal.write(Lsn(0), Bytes::copy_from_slice(&bulk))
                .await
                .expect("write");
            wal.flush().await.expect("flush");
            assert_eq!(wal.preallocates(), zeroed, "{policy}");
            let seg = SegmentSize::new(SEG).expect("seg");
            let len = segment_len(dir.path(), seg.segno(wal.write_lsn()));
            let expected = if zeroed {
                SEG
            } else {
                seg.offset(wal.write_lsn())
            };
            assert_eq!(len, expected, "{policy}");
            // A restart under the other policy reads the same WAL.
            let end = wal.flush_lsn();
            drop(wal);
            let other = if zeroed {
                Preallocation::Never
            } else {
                Preallocation::Always
            };
            let wal = open_with(dir.path(), Lsn(0), other).await;
            assert_eq!(wal.flush_lsn(), end, "{policy} then {other}");
        }
        assert_eq!("never".parse::<Preallocation>(), Ok(Preallocation::Never));
        assert!("sometimes".parse::<Preallocation>().is_err());
    }

    #[tokio::test]
    async fn writes_span_segments_and_survive_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut wal = open(dir.path(), Lsn(0)).await;
        let data = records(100, 3000); // ~300 KiB: several 64 KiB segments
        for chunk in data.chunks(7000) {
            let at = wal.write_lsn();
            wal.write(at, Bytes::copy_from_slice(chunk))
                .await
                .expect("write");
        }
        assert_eq!(wal.flush().await.expect("flush"), Lsn(data.len() as u64));
        // The next segment may be in preparation (`.prep`); it is not WAL.
        let segs: Vec<String> = names(dir.path())
            .into_iter()
            .filter(|n| !n.ends_with(PREPARING_SUFFIX))
            .collect();
        assert_eq!(
            segs.iter().filter(|n| n.ends_with(".partial")).count(),
            1,
            "{segs:?}"
        );
        assert_eq!(segs.len() as u64, data.len() as u64 / SEG + 1);
        for name in segs.iter().filter(|n| !n.ends_with(".partial")) {
            let len = std::fs::metadata(dir.path().join("wal").join(name))
                .expect("meta")
                .len();
            assert_eq!(len, SEG, "{name} is whole");
        }
        drop(wal);
        let wal = open(dir.path(), Lsn(0)).await;
        assert_eq!(wal.flush_lsn(), Lsn(data.len() as u64));
        // Reading back, segment by segment.
        let mut got = Vec::new();
        while (got.len() as u64) < wal.flush_lsn().0 {
            got.extend_from_slice(&wal.read(Lsn(got.len() as u64), 50_000).await.expect("read"));
        }
        assert!(got == data);
        assert!(matches!(
            wal.read(Lsn(data.len() as u64 + 1), 10).await,
            Err(WalStorageError::BeyondFlush { .. })
        ));
    }

    /// Writes 30 records (one fsync each with `small_commits`, so that the
    /// second segment is preallocated; one fsync for all otherwise, so that it
    /// grows), tears the last one and reopens.
    async fn torn_tail_is_cut_on_open(small_commits: bool) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut wal = open(dir.path(), Lsn(0)).await;
        let data = records(30, 3000);
        let one = data.len() / 30;
        for chunk in data.chunks(if small_commits { one } else { data.len() }) {
            let at = wal.write_lsn();
            wal.write(at, Bytes::copy_from_slice(chunk))
                .await
                .expect("write");
            if small_commits {
                wal.flush().await.expect("flush");
            }
        }
        wal.flush().await.expect("flush");
        let end = data.len() as u64;
        drop(wal);
        // Tear the last record: zero its last 100 bytes (a page that did not reach
        // the disk), and leave garbage after it (a later page that did).
        let path = dir.path().join("wal").join(format!(
            "{}.partial",
            SegmentSize::new(SEG).expect("seg").file_name(end / SEG)
        ));
        let mut bytes = std::fs::read(&path).expect("read");
        let in_segment = (end % SEG) as usize;
        if small_commits {
            assert_eq!(bytes.len() as u64, SEG, "preallocated");
        } else {
            assert_eq!(bytes.len(), in_segment, "grown with its writes");
            bytes.resize(in_segment + 400, 0);
        }
        bytes[in_segment - 100..in_segment].fill(0);
        bytes[in_segment + 50..in_segment + 350].fill(0xAB);
        std::fs::write(&path, &bytes).expect("tear");

        let last_record = Record::insert_len(0, 3000) as u64;
        let wal = open(dir.path(), Lsn(0)).await;
        assert_eq!(
            wal.flush_lsn(),
            Lsn(end - last_record),
            "exactly the torn record is gone"
        );
        drop(wal);
        let reopened = open(dir.path(), Lsn(0)).await;
        assert_eq!(
            reopened.flush_lsn(),
            Lsn(end - last_record),
            "the cut was durable"
        );
        let bytes = std::fs::read(&path).expect("read");
        assert_eq!(bytes.len() as u64, SEG, "full length after the cut");
        let cut = ((end - last_record) % SEG) as usize;
        assert!(
            bytes[cut..].iter().all(|&b| b == 0),
            "everything past the end is zero, so no stale record can come back"
        );
    }

    #[tokio::test]
    async fn torn_tail_is_cut_on_open_in_a_preallocated_segment() {
        torn_tail_is_cut_on_open(true).await;
    }

    #[tokio::test]
    async fn torn_tail_is_cut_on_open_in_a_growing_segment() {
        torn_tail_is_cut_on_open(false).await;
    }

    #[tokio::test]
    async fn truncate_removes_divergent_wal_across_segments() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut wal = open(dir.path(), Lsn(0)).await;
        let data = records(60, 3000);
        wal.write(Lsn(0), Bytes::copy_from_slice(&data))
            .await
            .expect("write");
        wal.flush().await.expect("flush");
        let keep = Lsn(Record::insert_len(0, 3000) as u64 * 10); // inside the first segment
        wal.truncate(keep).await.expect("truncate");
        assert_eq!((wal.write_lsn(), wal.flush_lsn()), (keep, keep));
        assert_eq!(names(dir.path()), vec!["000000010000000000000000.partial"]);
        let more = records(5, 100);
        wal.write(keep, Bytes::copy_from_slice(&more))
            .await
            .expect("write after truncate");
        wal.flush().await.expect("flush");
        drop(wal);
        let wal = open(dir.path(), Lsn(0)).await;
        assert_eq!(wal.flush_lsn(), Lsn(keep.0 + more.len() as u64));
        let mut wal = wal;
        assert!(matches!(
            wal.truncate(Lsn(u64::MAX / 2)).await,
            Err(WalStorageError::BeyondFlush { .. })
        ));
        assert!(matches!(
            wal.write(Lsn(1), Bytes::from_static(b"x")).await,
            Err(WalStorageError::NonContiguous { .. })
        ));
    }

    #[tokio::test]
    async fn old_segments_are_removed_but_never_the_current_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut wal = open(dir.path(), Lsn(0)).await;
        let data = records(100, 3000);
        wal.write(Lsn(0), Bytes::copy_from_slice(&data))
            .await
            .expect("write");
        wal.flush().await.expect("flush");
        let current = SegmentSize::new(SEG).expect("seg").segno(wal.flush_lsn());
        let removed = wal.remove_below(u64::MAX).await.expect("remove");
        assert_eq!(removed as u64, current);
        assert!(matches!(
            wal.read(Lsn(0), 10).await,
            Err(WalStorageError::Removed { .. })
        ));
        // Recovery starts from a boundary in a kept segment.
        drop(wal);
        let boundary = Lsn(data.len() as u64);
        let wal = open(dir.path(), boundary).await;
        assert_eq!(wal.flush_lsn(), boundary);
    }
}
