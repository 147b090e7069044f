//! The WAL a writer holds in memory for the safekeepers, kept as the chunks it
//! was handed, so that one append reaches every safekeeper without being copied.
//!
//! Invariants:
//! * the chunks are contiguous from [`WalBuffer::start`] and each one holds whole
//!   records, so every chunk end is a record boundary;
//! * `boundaries` lists every record end in `(start, end]`, ascending;
//! * a piece handed out by [`WalBuffer::next_piece`] is a slice of one chunk and
//!   ends at a record boundary.
//!
//! Small appends are gathered in an open tail (one copy) and frozen into a chunk
//! when they are sent: many small appends leave as one message per safekeeper.
//! An append of at least [`OWN_CHUNK_BYTES`] becomes a chunk as it is.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use ferry_wal::Lsn;

/// Appends of at least this size keep their own chunk instead of being copied
/// into the open tail.
pub const OWN_CHUNK_BYTES: usize = 256 << 10;

#[derive(Debug, Default)]
pub struct WalBuffer {
    start: Lsn,
    /// Frozen chunks and where each starts.
    chunks: VecDeque<(Lsn, Bytes)>,
    /// Small appends not yet frozen; they follow the last chunk.
    tail: BytesMut,
    frozen_bytes: u64,
    boundaries: VecDeque<Lsn>,
}

impl WalBuffer {
    /// An empty buffer starting at `start`.
    pub fn new(start: Lsn) -> WalBuffer {
        WalBuffer {
            start,
            ..WalBuffer::default()
        }
    }

    pub fn start(&self) -> Lsn {
        self.start
    }

    pub fn end(&self) -> Lsn {
        Lsn(self.start.0 + self.len())
    }

    pub fn len(&self) -> u64 {
        self.frozen_bytes + self.tail.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds whole records at the end; `ends` are their end positions (relative
    /// to the start of `records`), validated by the caller.
    pub fn push_back(&mut self, records: &Bytes, ends: &[usize]) {
        assert_eq!(
            ends.last().copied().unwrap_or(0),
            records.len(),
            "records end with a record"
        );
        let base = self.end();
        self.boundaries
            .extend(ends.iter().map(|&e| Lsn(base.0 + e as u64)));
        if records.len() >= OWN_CHUNK_BYTES {
            self.freeze_tail();
            self.push_chunk(records.clone());
        } else {
            self.tail.extend_from_slice(records);
        }
    }

    /// Puts whole records recovered from a safekeeper in front of the buffer;
    /// they must end exactly where the buffer starts.
    pub fn push_front(&mut self, begin: Lsn, records: Bytes, ends: &[usize]) {
        assert_eq!(
            Lsn(begin.0 + records.len() as u64),
            self.start,
            "recovered WAL ends where the buffer starts"
        );
        assert_eq!(ends.last().copied().unwrap_or(0), records.len());
        for &e in ends.iter().rev() {
            self.boundaries.push_front(Lsn(begin.0 + e as u64));
        }
        if !records.is_empty() {
            self.frozen_bytes += records.len() as u64;
            self.chunks.push_front((begin, records));
        }
        self.start = begin;
    }

    fn push_chunk(&mut self, chunk: Bytes) {
        if chunk.is_empty() {
            return;
        }
        let at = Lsn(self.start.0 + self.frozen_bytes);
        self.frozen_bytes += chunk.len() as u64;
        self.chunks.push_back((at, chunk));
    }

    /// Makes the open tail a chunk, so that it can be sent.
    pub fn freeze_tail(&mut self) {
        if !self.tail.is_empty() {
            let chunk = self.tail.split().freeze();
            self.push_chunk(chunk);
        }
    }

    /// The next piece to send from `from` (a record boundary inside the frozen
    /// part): whole records, at most `max_bytes` unless one record is larger,
    /// never crossing a chunk. `None` when nothing frozen lies at or after `from`.
    pub fn next_piece(&self, from: Lsn, max_bytes: usize) -> Option<Bytes> {
        let frozen_end = Lsn(self.start.0 + self.frozen_bytes);
        if from < self.start || from >= frozen_end {
            return None;
        }
        let idx = self
            .chunks
            .partition_point(|(at, _)| *at <= from)
            .checked_sub(1)?;
        let (chunk_start, chunk) = &self.chunks[idx];
        let chunk_end = Lsn(chunk_start.0 + chunk.len() as u64);
        let cap = Lsn(from.0 + max_bytes as u64).min(chunk_end);
        let first_after = self.boundaries.partition_point(|b| *b <= from);
        let within = self.boundaries.partition_point(|b| *b <= cap);
        let end = if within > first_after {
            self.boundaries[within - 1]
        } else {
            // One record larger than `max_bytes`: it goes alone.
            *self.boundaries.get(first_after)?
        };
        debug_assert!(end <= chunk_end, "chunks hold whole records");
        let lo = from.distance_from(*chunk_start) as usize;
        let hi = end.distance_from(*chunk_start) as usize;
        Some(chunk.slice(lo..hi))
    }

    /// Drops the records that end at or before `target` (whole records only).
    pub fn trim_to(&mut self, target: Lsn) {
        let mut new_start = self.start;
        while let Some(&end) = self.boundaries.front() {
            if end > target {
                break;
            }
            new_start = end;
            self.boundaries.pop_front();
        }
        if new_start <= self.start {
            return;
        }
        if new_start > Lsn(self.start.0 + self.frozen_bytes) {
            self.freeze_tail();
        }
        while let Some((at, chunk)) = self.chunks.front_mut() {
            let chunk_end = Lsn(at.0 + chunk.len() as u64);
            if chunk_end <= new_start {
                self.frozen_bytes -= chunk.len() as u64;
                self.chunks.pop_front();
                continue;
            }
            if *at < new_start {
                let cut = new_start.distance_from(*at) as usize;
                let _ = chunk.split_to(cut);
                self.frozen_bytes -= cut as u64;
                *at = new_start;
            }
            break;
        }
        self.start = new_start;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` fake records of `size` bytes (the buffer trusts its caller's ends).
    fn records(n: usize, size: usize, fill: u8) -> (Bytes, Vec<usize>) {
        let data = Bytes::from(vec![fill; n * size]);
        let ends = (1..=n).map(|i| i * size).collect();
        (data, ends)
    }

    #[test]
    fn small_appends_leave_together_large_ones_uncopied() {
        let mut buf = WalBuffer::new(Lsn(100));
        for fill in 1..=3 {
            let (r, ends) = records(2, 10, fill);
            buf.push_back(&r, &ends);
        }
        assert_eq!(buf.end(), Lsn(160));
        assert!(
            buf.next_piece(Lsn(100), 1 << 20).is_none(),
            "tail not frozen"
        );
        buf.freeze_tail();
        let piece = buf.next_piece(Lsn(100), 1 << 20).expect("piece");
        assert_eq!(piece.len(), 60, "three appends, one piece");
        // Limited to whole records.
        assert_eq!(buf.next_piece(Lsn(100), 25).expect("piece").len(), 20);
        assert_eq!(buf.next_piece(Lsn(110), 5).expect("big record").len(), 10);

        let (big, ends) = records(1, OWN_CHUNK_BYTES, 9);
        buf.push_back(&big, &ends);
        let piece = buf.next_piece(Lsn(160), 1 << 20).expect("piece");
        assert_eq!(
            piece.as_ptr(),
            big.as_ptr(),
            "the caller's bytes, not a copy"
        );
        assert!(buf.next_piece(buf.end(), 1 << 20).is_none());
    }

    #[test]
    fn pieces_never_cross_chunks_and_trim_keeps_whole_records() {
        let mut buf = WalBuffer::new(Lsn(0));
        let (a, ends) = records(4, 10, 1);
        buf.push_back(&a, &ends);
        buf.freeze_tail();
        let (b, ends) = records(4, 10, 2);
        buf.push_back(&b, &ends);
        buf.freeze_tail();
        assert_eq!(buf.next_piece(Lsn(20), 1 << 20).expect("piece").len(), 20);
        assert_eq!(buf.next_piece(Lsn(40), 1 << 20).expect("piece")[0], 2);
        buf.trim_to(Lsn(25));
        assert_eq!(buf.start(), Lsn(20), "only whole records are dropped");
        assert_eq!(buf.len(), 60);
        assert_eq!(buf.next_piece(Lsn(20), 1 << 20).expect("piece").len(), 20);
        assert!(
            buf.next_piece(Lsn(10), 1 << 20).is_none(),
            "below the start"
        );
        buf.trim_to(Lsn(80));
        assert!(buf.is_empty());
        assert_eq!(buf.start(), Lsn(80));
        let (c, ends) = records(2, 10, 3);
        buf.push_front(Lsn(60), c, &ends);
        assert_eq!((buf.start(), buf.end()), (Lsn(60), Lsn(80)));
        assert_eq!(buf.next_piece(Lsn(60), 15).expect("piece").len(), 10);
    }

    #[test]
    fn trimming_into_the_open_tail() {
        let mut buf = WalBuffer::new(Lsn(0));
        let (a, ends) = records(3, 10, 1);
        buf.push_back(&a, &ends);
        buf.trim_to(Lsn(10));
        assert_eq!((buf.start(), buf.end()), (Lsn(10), Lsn(30)));
        assert_eq!(buf.next_piece(Lsn(10), 100).expect("piece").len(), 20);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Append `n` records of `size` bytes.
        Push {
            n: usize,
            size: usize,
        },
        Freeze,
        /// Trim to a position `permille`/1000 of the way through the buffer.
        Trim {
            permille: u64,
        },
        /// Read a piece from the `k`-th record boundary, at most `max` bytes.
        Piece {
            k: usize,
            max: usize,
        },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (1usize..5, prop_oneof![1usize..200, 30_000usize..300_000])
                .prop_map(|(n, size)| Op::Push { n, size }),
            Just(Op::Freeze),
            (0u64..=1000).prop_map(|permille| Op::Trim { permille }),
            (0usize..20, 1usize..100_000).prop_map(|(k, max)| Op::Piece { k, max }),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Against a model (one flat byte vector and its record ends): the
        /// buffer holds exactly the model's bytes, trims whole records only,
        /// and every piece is whole records, within the limit unless a single
        /// record, equal to the model's bytes, and never crosses a chunk.
        #[test]
        fn behaves_like_a_flat_buffer(ops in proptest::collection::vec(op(), 1..60)) {
            let mut buf = WalBuffer::new(Lsn(1000));
            let mut model: Vec<u8> = Vec::new();
            let mut model_start = 1000u64;
            let mut ends: Vec<u64> = Vec::new();
            let mut fill = 0u8;
            for op in ops {
                match op {
                    Op::Push { n, size } => {
                        fill = fill.wrapping_add(1);
                        let data: Vec<u8> =
                            (0..n * size).map(|i| fill.wrapping_add((i / size) as u8)).collect();
                        let rel: Vec<usize> = (1..=n).map(|i| i * size).collect();
                        let base = model_start + model.len() as u64;
                        ends.extend(rel.iter().map(|&e| base + e as u64));
                        model.extend_from_slice(&data);
                        buf.push_back(&Bytes::from(data), &rel);
                    }
                    Op::Freeze => buf.freeze_tail(),
                    Op::Trim { permille } => {
                        let target = model_start + model.len() as u64 * permille / 1000;
                        buf.trim_to(Lsn(target));
                        let new_start = ends
                            .iter()
                            .copied()
                            .filter(|&e| e <= target)
                            .max()
                            .unwrap_or(model_start)
                            .max(model_start);
                        model.drain(..(new_start - model_start) as usize);
                        model_start = new_start;
                        ends.retain(|&e| e > new_start);
                    }
                    Op::Piece { k, max } => {
                        let from = if k == 0 {
                            model_start
                        } else {
                            match ends.get(k - 1) {
                                Some(&e) => e,
                                None => continue,
                            }
                        };
                        if let Some(piece) = buf.next_piece(Lsn(from), max) {
                            let end = from + piece.len() as u64;
                            proptest::prop_assert!(ends.contains(&end), "ends at a record end");
                            let records = ends.iter().filter(|&&e| e > from && e <= end).count();
                            proptest::prop_assert!(
                                piece.len() <= max || records == 1,
                                "over the limit only for one big record"
                            );
                            let at = (from - model_start) as usize;
                            proptest::prop_assert_eq!(&piece[..], &model[at..at + piece.len()]);
                        }
                    }
                }
                proptest::prop_assert_eq!(buf.start(), Lsn(model_start));
                proptest::prop_assert_eq!(buf.len(), model.len() as u64);
            }
            // Everything frozen can be read back, piece by piece, as the model.
            buf.freeze_tail();
            let mut at = model_start;
            let mut got = Vec::new();
            while let Some(piece) = buf.next_piece(Lsn(at), 1 << 20) {
                at += piece.len() as u64;
                got.extend_from_slice(&piece);
            }
            proptest::prop_assert!(got == model);
        }
    }
}
