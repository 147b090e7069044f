//! WAL backup: whole segments behind commit_lsn, uploaded to object storage by
//! the one safekeeper the writer gives the duty to.
//!
//! [`BackupPlanner`] is the sans-IO part: it decides which segments to upload
//! now (in order, at most `parallel_jobs` at once, failed ones again after a
//! back-off) and how far backup_lsn may move when uploads finish. Time is an
//! input. The server's `run_backup` is the driver: it reads segments through the
//! [`WalReader`], writes them through a [`Location`] and reports backup_lsn to
//! the acceptor.
//!
//! Invariants:
//! * backup_lsn only moves to the end of a segment whose every lower segment
//!   is uploaded too (in segment order), and only after its own upload
//!   completed: WAL below backup_lsn is in the backup;
//! * only segments wholly below commit_lsn are uploaded: their bytes are
//!   committed WAL, the same on every safekeeper, so two safekeepers writing
//!   the same object (a duty that moved) write the same bytes;
//! * the number of uploads in flight never exceeds `parallel_jobs`, and a
//!   segment is read into memory only while its upload runs.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use ferry_storage::Location;
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn, Term};
use tokio::time::Instant;

use crate::wal_storage::{WalReader, WalStorageError};

/// Default number of segment uploads in flight (Neon's wal_backup_parallel_jobs).
pub const DEFAULT_PARALLEL_JOBS: usize = 5;
/// Most segment uploads in flight, whatever is configured: each holds a
/// segment in memory.
pub const MAX_PARALLEL_JOBS: usize = 64;
/// First retry delay of a failed upload; doubled per attempt.
pub const RETRY_BASE: Duration = Duration::from_millis(10);
/// Longest delay between two attempts of one upload.
pub const RETRY_MAX: Duration = Duration::from_secs(5);
/// Folder of the whole segments inside the backup location.
pub const SEGMENTS_DIR: &str = "wal";

/// Where and how a safekeeper backs up its WAL.
#[derive(Debug, Clone)]
pub struct BackupConfig {
    pub location: Location,
    /// Segment uploads in flight (1..=[`MAX_PARALLEL_JOBS`]).
    pub parallel_jobs: usize,
}

/// The folder of one cluster's backup inside a backup location (named by
/// the cluster id): clusters that share a location (one bucket for many)
/// never overwrite each other's segments, and a restore reads only its own
/// cluster's WAL. Every key below is relative to it.
pub fn cluster_folder(
    location: &Location,
    cluster: &ClusterId,
) -> Result<Location, ferry_storage::StorageError> {
    location.child(cluster.as_str())
}

/// The key of a whole segment inside a cluster's backup folder.
pub fn segment_key(seg: SegmentSize, segno: u64) -> String {
    format!("{SEGMENTS_DIR}/{}", seg.file_name(segno))
}

/// What the backup follows, published by the acceptor as it changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BackupView {
    pub term: Term,
    /// The term that wrote the tail of the WAL (partial backup names it).
    pub last_log_term: Term,
    pub flush_lsn: Lsn,
    pub commit_lsn: Lsn,
    /// backup_lsn as the acceptor has it (its own uploads and its peers').
    pub backup_lsn: Lsn,
    /// Whether the writer gave this safekeeper the upload duty.
    pub duty: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegmentState {
    Uploading,
    /// Uploaded, waiting for a lower segment before backup_lsn can pass it.
    Uploaded,
    /// Failed `attempts` times; next try not before `at`.
    Waiting {
        attempts: u32,
        at: Instant,
    },
}

/// Which segments to upload and how far backup_lsn has come (sans-IO).
#[derive(Debug)]
pub struct BackupPlanner {
    seg: SegmentSize,
    parallel_jobs: usize,
    backup_lsn: Lsn,
    segments: BTreeMap<u64, SegmentState>,
    /// Failures per segment that is uploading again.
    attempts: BTreeMap<u64, u32>,
    /// Whether the last poll had the duty.
    duty: bool,
}

impl BackupPlanner {
    pub fn new(seg: SegmentSize, parallel_jobs: usize, backup_lsn: Lsn) -> BackupPlanner {
        BackupPlanner {
            seg,
            parallel_jobs: parallel_jobs.clamp(1, MAX_PARALLEL_JOBS),
            backup_lsn,
            segments: BTreeMap::new(),
            attempts: BTreeMap::new(),
            duty: false,
        }
    }

    pub fn backup_lsn(&self) -> Lsn {
        self.backup_lsn
    }

    pub fn in_flight(&self) -> usize {
        self.segments
            .values()
            .filter(|s| **s == SegmentState::Uploading)
            .count()
    }

    /// Segments to start uploading now. Nothing new starts without the duty;
    /// a backup_lsn that peers moved further is adopted (their uploads are in
    /// the same backup).
    pub fn poll(&mut self, view: &BackupView, now: Instant) -> Vec<u64> {
        if view.backup_lsn > self.backup_lsn {
            self.backup_lsn = view.backup_lsn;
            let first = self.seg.segno(self.backup_lsn);
            self.segments
                .retain(|&s, state| s >= first || *state == SegmentState::Uploading);
        }
        self.duty = view.duty;
        if !view.duty {
            return Vec::new();
        }
        // Whole segments below commit_lsn.
        let first = self.seg.segno(self.backup_lsn);
        let end = self.seg.segno(view.commit_lsn);
        let mut start = Vec::new();
        let mut in_flight = self.in_flight();
        for segno in first..end {
            if in_flight >= self.parallel_jobs {
                break;
            }
            let ready = match self.segments.get(&segno) {
                None => true,
                Some(SegmentState::Waiting { at, .. }) => *at <= now,
                Some(_) => false,
            };
            if ready {
                self.segments.insert(segno, SegmentState::Uploading);
                start.push(segno);
                in_flight += 1;
            }
        }
        start
    }

    /// The upload of `segno` completed; returns the new backup_lsn if it moved.
    pub fn on_uploaded(&mut self, segno: u64) -> Option<Lsn> {
        if self.segments.get(&segno) != Some(&SegmentState::Uploading) {
            return None;
        }
        self.segments.insert(segno, SegmentState::Uploaded);
        self.attempts.remove(&segno);
        let before = self.backup_lsn;
        loop {
            let next = self.seg.segno(self.backup_lsn);
            if self.segments.get(&next) != Some(&SegmentState::Uploaded) {
                break;
            }
            self.segments.remove(&next);
            self.backup_lsn = Lsn((next + 1) * self.seg.bytes());
        }
        // Segments a peer's backup_lsn passed while they uploaded.
        let first = self.seg.segno(self.backup_lsn);
        self.segments
            .retain(|&s, state| s >= first || *state == SegmentState::Uploading);
        (self.backup_lsn > before).then_some(self.backup_lsn)
    }

    /// The upload of `segno` failed; it is tried again after a back-off
    /// ([`RETRY_BASE`] doubled per failure, at most [`RETRY_MAX`]).
    pub fn on_failed(&mut self, segno: u64, now: Instant) -> Duration {
        let attempts = self.attempts.entry(segno).or_insert(0);
        *attempts += 1;
        let delay = RETRY_BASE
            .saturating_mul(1u32 << (*attempts - 1).min(20))
            .min(RETRY_MAX);
        let first = self.seg.segno(self.backup_lsn);
        if segno >= first {
            self.segments.insert(
                segno,
                SegmentState::Waiting {
                    attempts: *attempts,
                    at: now + delay,
                },
            );
        } else {
            self.segments.remove(&segno);
        }
        delay
    }

    /// When a failed upload is due again; `None` while none could start
    /// anyway (no duty, or every job busy: a completion wakes the driver).
    pub fn next_retry(&self) -> Option<Instant> {
        if !self.duty || self.in_flight() >= self.parallel_jobs {
            return None;
        }
        self.segments
            .values()
            .filter_map(|s| match s {
                SegmentState::Waiting { at, .. } => Some(*at),
                _ => None,
            })
            .min()
    }

    /// Failures so far of the segment that failed most.
    pub fn max_attempts(&self) -> u32 {
        self.segments
            .values()
            .filter_map(|s| match s {
                SegmentState::Waiting { attempts, .. } => Some(*attempts),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }
}

/// Why a segment could not be backed up or read back.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error(transparent)]
    Wal(#[from] WalStorageError),
    #[error(transparent)]
    Storage(#[from] ferry_storage::StorageError),
    #[error("backup object {key} holds {got} bytes, not a whole segment of {expected}")]
    Short {
        key: String,
        got: u64,
        expected: u64,
    },
}

/// Reads segment `segno` whole (committed WAL, so it cannot change) and
/// writes it to the backup.
pub async fn upload_segment(
    reader: &WalReader,
    location: &Location,
    seg: SegmentSize,
    segno: u64,
) -> Result<u64, BackupError> {
    let begin = Lsn(segno * seg.bytes());
    let data = reader.read_all(begin, Lsn(begin.0 + seg.bytes())).await?;
    let bytes = data.len() as u64;
    location.put(&segment_key(seg, segno), data).await?;
    Ok(bytes)
}

/// WAL in the backup, for walsenders whose replica asks for WAL this
/// safekeeper removed already.
#[derive(Debug, Clone)]
pub struct RemoteWal {
    pub location: Location,
    pub seg: SegmentSize,
}

impl RemoteWal {
    /// Backed-up WAL from `begin`, at most `max` bytes, never past `end` nor
    /// past the end of `begin`'s segment. The caller checks that `begin` is
    /// below backup_lsn.
    pub async fn read(&self, begin: Lsn, end: Lsn, max: usize) -> Result<Bytes, BackupError> {
        let segno = self.seg.segno(begin);
        let offset = self.seg.offset(begin);
        let len = end
            .distance_from(begin)
            .min(max as u64)
            .min(self.seg.bytes() - offset);
        if len == 0 {
            return Ok(Bytes::new());
        }
        let key = segment_key(self.seg, segno);
        let bytes = self.location.get_range(&key, offset..offset + len).await?;
        if (bytes.len() as u64) < len {
            return Err(BackupError::Short {
                key,
                got: offset + bytes.len() as u64,
                expected: self.seg.bytes(),
            });
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEG: u64 = 1 << 16;

    fn planner(jobs: usize) -> BackupPlanner {
        BackupPlanner::new(SegmentSize::new(SEG).expect("seg"), jobs, Lsn(0))
    }

    fn view(commit: u64, duty: bool) -> BackupView {
        BackupView {
            term: 1,
            last_log_term: 1,
            flush_lsn: Lsn(commit),
            commit_lsn: Lsn(commit),
            backup_lsn: Lsn(0),
            duty,
        }
    }

    #[test]
    fn only_whole_segments_below_commit_with_the_duty() {
        let now = Instant::now();
        let mut p = planner(5);
        assert!(p.poll(&view(3 * SEG + 10, false), now).is_empty());
        assert_eq!(p.poll(&view(3 * SEG + 10, true), now), vec![0, 1, 2]);
        // Nothing twice.
        assert!(p.poll(&view(3 * SEG + 10, true), now).is_empty());
        assert_eq!(p.poll(&view(4 * SEG, true), now), vec![3]);
    }

    #[test]
    fn parallelism_is_bounded() {
        let now = Instant::now();
        let mut p = planner(2);
        assert_eq!(p.poll(&view(10 * SEG, true), now), vec![0, 1]);
        assert_eq!(p.in_flight(), 2);
        assert_eq!(p.on_uploaded(1), None, "segment 0 is not uploaded yet");
        assert_eq!(p.poll(&view(10 * SEG, true), now), vec![2]);
        assert_eq!(p.on_uploaded(0), Some(Lsn(2 * SEG)), "0 and 1, in order");
        assert_eq!(p.on_uploaded(2), Some(Lsn(3 * SEG)));
    }

    #[test]
    fn failures_back_off_and_retry() {
        let now = Instant::now();
        let mut p = planner(1);
        assert_eq!(p.poll(&view(SEG + 10, true), now), vec![0]);
        assert_eq!(p.on_failed(0, now), RETRY_BASE);
        assert!(p.poll(&view(SEG + 10, true), now).is_empty(), "backing off");
        assert_eq!(p.next_retry(), Some(now + RETRY_BASE));
        assert!(
            p.poll(&view(SEG + 10, false), now).is_empty(),
            "no duty, no retry"
        );
        assert_eq!(
            p.next_retry(),
            None,
            "nothing to wake up for without the duty"
        );
        let later = now + RETRY_BASE;
        assert_eq!(p.poll(&view(SEG + 10, true), later), vec![0]);
        assert_eq!(p.on_failed(0, later), RETRY_BASE * 2);
        for _ in 0..20 {
            let _ = p.on_failed(0, later);
        }
        assert_eq!(p.on_failed(0, later), RETRY_MAX, "capped");
        assert_eq!(p.backup_lsn(), Lsn(0), "a failure never moves backup_lsn");
    }

    #[test]
    fn a_peers_backup_lsn_is_adopted() {
        let now = Instant::now();
        let mut p = planner(5);
        let mut v = view(5 * SEG, false);
        v.backup_lsn = Lsn(3 * SEG);
        assert!(p.poll(&v, now).is_empty());
        assert_eq!(p.backup_lsn(), Lsn(3 * SEG));
        v.duty = true;
        assert_eq!(p.poll(&v, now), vec![3, 4], "from the shared position on");
    }
}
