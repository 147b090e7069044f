//! Reads of flushed WAL: the most recently written WAL kept in memory, and
//! the readers that walsenders and the backup use beside appends.

use std::io;
use std::sync::Arc;

use bytes::Bytes;
use ferry_env::Disk;
use ferry_wal::segment::{SegmentSize, PARTIAL_SUFFIX};
use ferry_wal::Lsn;

use super::{WalStorage, WalStorageError};

impl WalStorage {
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

    /// The disk the WAL is on (what the disk-full breaker watches).
    pub fn disk(&self) -> Arc<dyn ferry_env::Disk> {
        Arc::clone(&self.disk)
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
}

/// Most bytes of recently written WAL kept in memory for walsenders: one
/// segment, at most this much (a segment at the default size).
pub const TAIL_BYTES: usize = 16 << 20;

/// The most recently written WAL, as the very buffers that were written (no
/// copy), so that walsenders following the end of WAL read memory, not disk.
/// Cut with the WAL on truncation, so it never holds bytes the WAL lost.
///
/// It holds one segment's worth (at most [`TAIL_BYTES`]): what a walsender
/// reads from disk instead then is what the disk's cache holds anyway, and
/// memory grows with the segment size an operator chose, not beyond. WAL
/// older than the tail is read from its segment files, which removal may
/// have taken: a reader below the tail meets removal as it would in
/// production, whatever the segment size (the simulator's are 64 KiB).
#[derive(Debug, Clone)]
pub(super) struct WalTail(Arc<std::sync::Mutex<TailChunks>>);

#[derive(Debug)]
struct TailChunks {
    chunks: std::collections::VecDeque<(Lsn, Bytes)>,
    bytes: usize,
    limit: usize,
}

impl WalTail {
    /// A tail for segments of `seg` bytes.
    pub(super) fn for_segment(seg: SegmentSize) -> WalTail {
        let limit = usize::try_from(seg.bytes()).map_or(TAIL_BYTES, |b| b.min(TAIL_BYTES));
        WalTail(Arc::new(std::sync::Mutex::new(TailChunks {
            chunks: Default::default(),
            bytes: 0,
            limit,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TailChunks> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records `data`, written at `begin` (right after the previous chunk).
    pub(super) fn push(&self, begin: Lsn, data: Bytes) {
        let mut t = self.lock();
        t.bytes += data.len();
        t.chunks.push_back((begin, data));
        while t.bytes > t.limit {
            match t.chunks.pop_front() {
                Some((_, old)) => t.bytes -= old.len(),
                None => break,
            }
        }
    }

    /// Forgets everything at or after `lsn` (the WAL was cut there).
    pub(super) fn truncate(&self, lsn: Lsn) {
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
    pub(super) fn forget_below(&self, lsn: Lsn) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_wal::segment::DEFAULT_SEGMENT_BYTES;

    #[test]
    fn the_tail_serves_recent_wal_and_forgets_what_was_cut() {
        let tail = WalTail::for_segment(SegmentSize::new(DEFAULT_SEGMENT_BYTES).expect("size"));
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
        // One segment's worth when segments are smaller.
        let small = WalTail::for_segment(SegmentSize::new(64 << 10).expect("size"));
        for i in 0..4u64 {
            small.push(Lsn(i * 40_000), Bytes::from(vec![1u8; 40_000]));
        }
        assert!(small.lock().bytes <= 64 << 10);
        assert_eq!(small.read(Lsn(0), Lsn(10), 10), None, "evicted");
        assert!(small.read(Lsn(120_000), Lsn(120_010), 10).is_some());
    }
}
