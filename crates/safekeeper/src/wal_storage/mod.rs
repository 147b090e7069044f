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
//!
//! Here: the storage's errors, its preallocation policy and its state; in
//! the submodules:
//! * `segments`: segment file names, preallocation in the background, and
//!   the removal of old segments;
//! * `recovery`: the walk of records at open, damage refused, the torn tail cut;
//! * `write`: contiguous writes across segments, fsync, truncation;
//! * `read`: the in-memory tail and the readers walsenders use.

mod read;
mod recovery;
mod segments;
mod write;

use std::io;
use std::sync::Arc;

use ferry_env::Disk;
use ferry_wal::segment::SegmentSize;
use ferry_wal::Lsn;

use read::WalTail;
pub use read::{WalReader, TAIL_BYTES};
use segments::Spare;
use write::OpenSegment;

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
}

#[cfg(test)]
// Tests set up and damage real files directly; node code may not.
#[allow(clippy::disallowed_methods, clippy::disallowed_types)]
mod tests;
