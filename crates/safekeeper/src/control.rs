//! The control file: everything a safekeeper must remember besides the WAL bytes.
//!
//! Layout (format 7): a header block `magic: u32 LE | format version: u32 LE |
//! slot size: u64 LE | crc32c: u32 LE`, then two slots of that size, each
//! `sequence: u64 LE | body length: u32 LE | postcard(state) | crc32c: u32 LE`.
//! The state in force is the valid slot with the highest sequence. A write
//! goes in place into the other slot with one data sync ([`ControlFile::persist`]);
//! the header is written only with the whole file, by an atomic replace
//! (temp file, fsync, rename, directory fsync) through the disk seam. Files
//! of formats 3 to 6 (one state, replaced whole) are read and become slotted
//! files at their first write. The control file is persisted *before* any
//! message that depends on it is answered (a vote, a term change, an adopted
//! term history, a configuration). A damaged file is refused, never reset: a
//! safekeeper that forgot its term could vote twice.

use std::sync::Arc;

use ferry_env::{Disk, DiskFile};
use ferry_wal::membership::Configuration;
use ferry_wal::{ClusterId, Lsn, Term, TermHistory};
use serde::{Deserialize, Serialize};

/// File name inside the safekeeper's data dir.
pub const CONTROL_FILE: &str = "safekeeper.control";
/// The magic of formats 3 to 6.
const LEGACY_MAGIC: u32 = 0xFE55_AFE0;
/// Bumped on every incompatible change of the file or of [`SafekeeperState`]
/// (2: the cluster id; 3: the durable flush point; 4: registered replicas; 5:
/// restored from the backup; 6: the membership configuration; 7: two slots
/// written in place). Versions 3 to 6 are read and upgraded on the next write.
pub const FORMAT_VERSION: u32 = 7;

/// Most replicas a control file registers (as many as the feedback board keeps).
pub const MAX_REGISTERED_REPLICAS: usize = 4096;

/// A replica that streamed from this safekeeper, and the WAL it has durably
/// applied: the removal horizon keeps the WAL above it until the replica
/// moves on. Persisted, so that a restart does not forget a replica that is
/// down at the time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisteredReplica {
    pub shard_number: u32,
    pub replica_number: u32,
    pub remote_consistent_lsn: Lsn,
}

/// Status of an object uploaded by partial segment backup (room for that feature:
/// the list is kept and persisted, nothing fills it yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UploadStatus {
    InProgress,
    Uploaded,
    Deleting,
}

/// A remote partial segment this safekeeper may have created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartialRemoteSegment {
    pub status: UploadStatus,
    pub name: String,
    pub flush_lsn: Lsn,
    pub commit_lsn: Lsn,
    pub term: Term,
}

/// The persistent state of a safekeeper.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SafekeeperState {
    /// The cluster this safekeeper was created for; it never changes.
    pub cluster_id: ClusterId,
    pub node_id: u64,
    pub timeline_id: u64,
    pub segment_bytes: u64,
    /// The highest term this safekeeper has voted in or accepted.
    pub term: Term,
    /// History of the terms that wrote this safekeeper's WAL.
    pub term_history: TermHistory,
    /// Id of the writer that last got elected here, for logs.
    pub proposer_id: u128,
    pub timeline_start_lsn: Lsn,
    /// Committed position as last persisted (the live value runs ahead of it).
    pub commit_lsn: Lsn,
    /// WAL known durable up to here when the control file was last written (a
    /// lower bound of the real flush_lsn, lowered before any truncation): at
    /// start, WAL below it that is missing or damaged is refused, like WAL
    /// below commit_lsn (a safekeeper may hold more than it knows committed).
    pub durable_lsn: Lsn,
    /// WAL below this is in the remote backup.
    pub backup_lsn: Lsn,
    /// WAL below this is on every safekeeper (the writer's truncate_lsn).
    pub peer_horizon_lsn: Lsn,
    /// The lowest LSN every registered replica has durably applied.
    pub remote_consistent_lsn: Lsn,
    /// Segments below this one were removed locally (0: none).
    pub last_removed_segno: u64,
    /// Remote partial segments that may exist.
    pub partial_backup: Vec<PartialRemoteSegment>,
    /// Replicas that streamed from here, in (shard, replica) order.
    pub registered_replicas: Vec<RegisteredReplica>,
    /// Rebuilt from the WAL backup up to this LSN and not brought back by a
    /// writer yet: the votes this safekeeper gave before its data was lost
    /// are forgotten, so it must not vote or acknowledge WAL until a writer
    /// proven current brings it back (`ferry_wal::proto::Restored`). A
    /// format 4 body plus one `None` byte is a format 5 body.
    pub restored_up_to: Option<Lsn>,
    /// The highest membership configuration seen (`None`: generation 0,
    /// never recorded). Persisted before any answer that depends on it.
    /// Last field: a format 5 body plus one `None` byte is a format 6 body.
    pub configuration: Option<Configuration>,
}

/// Format version 3, read to upgrade it.
#[derive(Deserialize)]
struct StateV3 {
    cluster_id: ClusterId,
    node_id: u64,
    timeline_id: u64,
    segment_bytes: u64,
    term: Term,
    term_history: TermHistory,
    proposer_id: u128,
    timeline_start_lsn: Lsn,
    commit_lsn: Lsn,
    durable_lsn: Lsn,
    backup_lsn: Lsn,
    peer_horizon_lsn: Lsn,
    remote_consistent_lsn: Lsn,
    last_removed_segno: u64,
    partial_backup: Vec<PartialRemoteSegment>,
}

impl From<StateV3> for SafekeeperState {
    fn from(v: StateV3) -> SafekeeperState {
        SafekeeperState {
            cluster_id: v.cluster_id,
            node_id: v.node_id,
            timeline_id: v.timeline_id,
            segment_bytes: v.segment_bytes,
            term: v.term,
            term_history: v.term_history,
            proposer_id: v.proposer_id,
            timeline_start_lsn: v.timeline_start_lsn,
            commit_lsn: v.commit_lsn,
            durable_lsn: v.durable_lsn,
            backup_lsn: v.backup_lsn,
            peer_horizon_lsn: v.peer_horizon_lsn,
            remote_consistent_lsn: v.remote_consistent_lsn,
            // Version 3 never removed a segment.
            last_removed_segno: v.last_removed_segno,
            partial_backup: v.partial_backup,
            registered_replicas: Vec::new(),
            restored_up_to: None,
            configuration: None,
        }
    }
}

impl SafekeeperState {
    /// The state of a brand-new safekeeper.
    pub fn new(
        cluster_id: ClusterId,
        node_id: u64,
        timeline_id: u64,
        segment_bytes: u64,
    ) -> SafekeeperState {
        SafekeeperState {
            cluster_id,
            node_id,
            timeline_id,
            segment_bytes,
            term: 0,
            term_history: TermHistory::default(),
            proposer_id: 0,
            timeline_start_lsn: Lsn(0),
            commit_lsn: Lsn(0),
            durable_lsn: Lsn(0),
            backup_lsn: Lsn(0),
            peer_horizon_lsn: Lsn(0),
            remote_consistent_lsn: Lsn(0),
            last_removed_segno: 0,
            partial_backup: Vec::new(),
            registered_replicas: Vec::new(),
            restored_up_to: None,
            configuration: None,
        }
    }
}

/// Why the control file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum ControlFileError {
    #[error("control file I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("control file is corrupt: {0}")]
    Corrupt(String),
    #[error("control file format version {0} is not supported (expected {FORMAT_VERSION})")]
    UnsupportedVersion(u32),
    /// There is no control file where one must be: the safekeeper was never
    /// created here, or its data dir was lost. Never recreated implicitly: an
    /// empty safekeeper that votes could make the quorum forget committed WAL.
    #[error("{0}: no control file; this safekeeper was never created here, or its data was lost (an empty safekeeper is created only explicitly)")]
    Missing(String),
}

impl ControlFileError {
    /// The same error with the control file's path in its message.
    fn at(self, path: &str) -> ControlFileError {
        match self {
            ControlFileError::Corrupt(detail) => {
                ControlFileError::Corrupt(format!("{path}: {detail}"))
            }
            other => other,
        }
    }
}

/// The slotted file's magic (format 7 on); [`LEGACY_MAGIC`] files are read
/// and replaced by a slotted file at their first write.
const MAGIC: u32 = 0xFE55_AFE7;
/// Header and slots are whole 4 KiB blocks, so that a torn write of one slot
/// never reaches the header or the other slot.
const BLOCK: u64 = 4096;
/// Largest slot a header may name (a safekeeper's state is a few KiB; the
/// most registered replicas take about 100 KiB).
const MAX_SLOT_BYTES: u64 = 16 << 20;
/// Bytes of a slot before its body: sequence (u64) and body length (u32).
const SLOT_HEAD: usize = 12;

/// Encodes a state into the bytes of a new control file: the header, the
/// state in slot 0 (sequence 1) and an empty slot 1.
pub fn encode(state: &SafekeeperState) -> Result<Vec<u8>, ControlFileError> {
    let slot = encode_slot(state, 1)?;
    Ok(new_file(&slot))
}

/// One slot's bytes: `sequence: u64 LE | body length: u32 LE | postcard(state) | crc32c: u32 LE`,
/// the checksum over everything before it.
fn encode_slot(state: &SafekeeperState, sequence: u64) -> Result<Vec<u8>, ControlFileError> {
    let body =
        postcard::to_allocvec(state).map_err(|e| ControlFileError::Corrupt(e.to_string()))?;
    // Never write a file `decode_slotted` would refuse.
    if (SLOT_HEAD + body.len() + 4) as u64 > MAX_SLOT_BYTES {
        return Err(ControlFileError::Corrupt(format!(
            "a state of {} bytes does not fit a slot of at most {MAX_SLOT_BYTES}",
            body.len()
        )));
    }
    let len = u32::try_from(body.len())
        .map_err(|_| ControlFileError::Corrupt(format!("{} bytes of state", body.len())))?;
    let mut out = Vec::with_capacity(SLOT_HEAD + body.len() + 4);
    out.extend_from_slice(&sequence.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// The smallest slot size (whole blocks, a power of two) that holds `bytes`.
fn slot_size_for(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(BLOCK).next_power_of_two() * BLOCK
}

/// A whole file: the header block naming the slot size, `slot` in slot 0 and
/// slot 1 zeroed (an empty slot).
fn new_file(slot: &[u8]) -> Vec<u8> {
    let slot_size = slot_size_for(slot.len());
    let mut out = Vec::with_capacity((BLOCK + 2 * slot_size) as usize);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&slot_size.to_le_bytes());
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out.resize(BLOCK as usize, 0);
    out.extend_from_slice(slot);
    out.resize((BLOCK + 2 * slot_size) as usize, 0);
    out
}

fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn dword(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Where the state of a decoded file came from, so that the next write goes
/// to the right place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// A file of format 3 to 6 (one state, replaced whole): the next write
    /// replaces it with a slotted file.
    Legacy,
    /// The state is in slot `latest` with `sequence`; the next write goes to
    /// the other slot with `sequence + 1`.
    Slotted {
        slot_size: u64,
        latest: usize,
        sequence: u64,
    },
}

/// Decodes a whole control file, checking magic, version and checksums.
pub fn decode(bytes: &[u8]) -> Result<SafekeeperState, ControlFileError> {
    decode_file(bytes).map(|(state, _)| state)
}

fn decode_file(bytes: &[u8]) -> Result<(SafekeeperState, Layout), ControlFileError> {
    if bytes.len() < 12 {
        return Err(ControlFileError::Corrupt(format!(
            "{} bytes is too short",
            bytes.len()
        )));
    }
    match word(bytes, 0) {
        LEGACY_MAGIC => decode_legacy(bytes).map(|s| (s, Layout::Legacy)),
        MAGIC => decode_slotted(bytes),
        _ => Err(ControlFileError::Corrupt("bad magic".into())),
    }
}

/// A slotted file: the header (written once, by an atomic replace) and the
/// valid slot with the highest sequence. A slot that fails its checksum is
/// a write torn by a crash before its fsync returned, so a state nothing was
/// answered on; the other slot holds the state before it.
fn decode_slotted(bytes: &[u8]) -> Result<(SafekeeperState, Layout), ControlFileError> {
    if bytes.len() < 20 || crc32c::crc32c(&bytes[..16]) != word(bytes, 16) {
        return Err(ControlFileError::Corrupt("header checksum mismatch".into()));
    }
    let version = word(bytes, 4);
    if version != FORMAT_VERSION {
        return Err(ControlFileError::UnsupportedVersion(version));
    }
    let slot_size = dword(bytes, 8);
    if slot_size < BLOCK || !slot_size.is_multiple_of(BLOCK) || slot_size > MAX_SLOT_BYTES {
        return Err(ControlFileError::Corrupt(format!(
            "slot size {slot_size} (whole {BLOCK}-byte blocks, at most {MAX_SLOT_BYTES})"
        )));
    }
    let want = BLOCK + 2 * slot_size;
    if (bytes.len() as u64) < want {
        return Err(ControlFileError::Corrupt(format!(
            "{} bytes, a file of {slot_size}-byte slots has {want}",
            bytes.len()
        )));
    }
    let mut best: Option<(u64, usize, SafekeeperState)> = None;
    let mut damaged = Vec::new();
    for index in 0..2 {
        let at = (BLOCK + index as u64 * slot_size) as usize;
        let slot = &bytes[at..at + slot_size as usize];
        match decode_slot(slot) {
            Ok(Some((sequence, state))) => {
                if best.as_ref().is_none_or(|(s, _, _)| sequence > *s) {
                    best = Some((sequence, index, state));
                }
            }
            Ok(None) => {}
            Err(detail) => damaged.push(format!("slot {index}: {detail}")),
        }
    }
    let Some((sequence, latest, state)) = best else {
        return Err(ControlFileError::Corrupt(if damaged.is_empty() {
            "both slots are empty".into()
        } else {
            damaged.join("; ")
        }));
    };
    check_state(&state)?;
    Ok((
        state,
        Layout::Slotted {
            slot_size,
            latest,
            sequence,
        },
    ))
}

/// `None`: an empty slot (never written); an error: what is wrong with a
/// damaged one.
fn decode_slot(slot: &[u8]) -> Result<Option<(u64, SafekeeperState)>, String> {
    let sequence = dword(slot, 0);
    let len = word(slot, 8) as usize;
    if sequence == 0 {
        return Ok(None);
    }
    if SLOT_HEAD + len + 4 > slot.len() {
        return Err(format!("a {len}-byte state in a {}-byte slot", slot.len()));
    }
    let end = SLOT_HEAD + len;
    if crc32c::crc32c(&slot[..end]) != word(slot, end) {
        return Err("checksum mismatch".into());
    }
    let state = postcard::from_bytes(&slot[SLOT_HEAD..end]).map_err(|e| e.to_string())?;
    Ok(Some((sequence, state)))
}

/// The checks every decoded state passes, whatever its format.
fn check_state(state: &SafekeeperState) -> Result<(), ControlFileError> {
    if state.registered_replicas.len() > MAX_REGISTERED_REPLICAS {
        return Err(ControlFileError::Corrupt(format!(
            "{} registered replicas (at most {MAX_REGISTERED_REPLICAS})",
            state.registered_replicas.len()
        )));
    }
    if !state.term_history.is_well_formed() {
        return Err(ControlFileError::Corrupt(
            "term history out of order".into(),
        ));
    }
    Ok(())
}

/// Formats 3 to 6: `magic: u32 LE | format version: u32 LE | postcard(state) | crc32c: u32 LE`.
fn decode_legacy(bytes: &[u8]) -> Result<SafekeeperState, ControlFileError> {
    let crc_at = bytes.len() - 4;
    if crc32c::crc32c(&bytes[..crc_at]) != word(bytes, crc_at) {
        return Err(ControlFileError::Corrupt("checksum mismatch".into()));
    }
    let version = word(bytes, 4);
    let body = &bytes[8..crc_at];
    let corrupt = |e: postcard::Error| ControlFileError::Corrupt(e.to_string());
    let state: SafekeeperState = match version {
        // The state of format 6 is the body of every slot since.
        6 => postcard::from_bytes(body).map_err(corrupt)?,
        // Formats 5 and 6 appended `restored_up_to` and `configuration`;
        // postcard writes `None` as one zero byte, so a format 4 body with
        // two such bytes (format 5 with one) is a format 6 body.
        4 | 5 => {
            let missing = (6 - version) as usize;
            let mut upgraded = Vec::with_capacity(body.len() + missing);
            upgraded.extend_from_slice(body);
            upgraded.extend(std::iter::repeat_n(0u8, missing));
            postcard::from_bytes(&upgraded).map_err(corrupt)?
        }
        3 => postcard::from_bytes::<StateV3>(body)
            .map_err(corrupt)?
            .into(),
        other => return Err(ControlFileError::UnsupportedVersion(other)),
    };
    check_state(&state)?;
    Ok(state)
}

/// The control file of one safekeeper, and the last state made durable.
#[derive(Debug)]
pub struct ControlFile {
    disk: Arc<dyn Disk>,
    path: String,
    persisted: SafekeeperState,
    layout: Layout,
    /// The file, open for in-place slot writes (opened at the first one).
    file: Option<Box<dyn DiskFile>>,
}

impl ControlFile {
    /// Loads the control file in `dir`; a missing or damaged one is an error.
    pub async fn open(disk: Arc<dyn Disk>, dir: &str) -> Result<ControlFile, ControlFileError> {
        let path = format!("{dir}/{CONTROL_FILE}");
        let (persisted, layout) = match disk.read(&path).await {
            Ok(bytes) => decode_file(&bytes).map_err(|e| e.at(&path))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ControlFileError::Missing(path))
            }
            Err(e) => return Err(e.into()),
        };
        Ok(ControlFile {
            disk,
            path,
            persisted,
            layout,
            file: None,
        })
    }

    /// Creates the control file of a new safekeeper in `dir` with `fresh`, or
    /// loads the one already there (creation is idempotent: a crash in the
    /// middle of creating a cluster is finished by running it again; the caller
    /// checks that an existing file is the safekeeper it meant to create).
    pub async fn create(
        disk: Arc<dyn Disk>,
        dir: &str,
        fresh: SafekeeperState,
    ) -> Result<ControlFile, ControlFileError> {
        disk.create_dir_all(dir).await?;
        match ControlFile::open(Arc::clone(&disk), dir).await {
            Err(ControlFileError::Missing(path)) => {
                let slot = encode_slot(&fresh, 1)?;
                disk.write_atomic(&path, new_file(&slot)).await?;
                Ok(ControlFile {
                    disk,
                    path,
                    persisted: fresh,
                    layout: Layout::Slotted {
                        slot_size: slot_size_for(slot.len()),
                        latest: 0,
                        sequence: 1,
                    },
                    file: None,
                })
            }
            other => other,
        }
    }

    /// The state as last persisted.
    pub fn state(&self) -> &SafekeeperState {
        &self.persisted
    }

    /// Makes `state` durable; on return it survives any crash.
    ///
    /// The state goes into the slot that does not hold the last persisted
    /// one, in place, with one data sync (no new file, rename or directory
    /// sync: this write sits between a vote or a configuration and its
    /// answer, and during a membership change between the writer's appends).
    /// A crash before the sync returns leaves that slot old, new or torn;
    /// the other slot still holds the state before, the one last answered on.
    /// A state that outgrew its slot, or a file of an older format, is
    /// replaced whole by a file with larger slots (an atomic replace).
    pub async fn persist(&mut self, state: &SafekeeperState) -> Result<(), ControlFileError> {
        if *state == self.persisted {
            return Ok(());
        }
        // What a safekeeper promised survives every write of its control
        // file: its term (a vote given), its commit_lsn and its
        // configuration's generation never go back, and its backup never
        // passes what it knows committed. A violation stops the safekeeper
        // before the file says otherwise.
        assert!(
            state.term >= self.persisted.term,
            "term would go back from {} to {}",
            self.persisted.term,
            state.term
        );
        assert!(
            state.commit_lsn >= self.persisted.commit_lsn,
            "commit_lsn would go back from {} to {}",
            self.persisted.commit_lsn,
            state.commit_lsn
        );
        let generation = |s: &SafekeeperState| s.configuration.as_ref().map_or(0, |c| c.generation);
        assert!(
            generation(state) >= generation(&self.persisted),
            "the configuration would go back from generation {} to {}",
            generation(&self.persisted),
            generation(state)
        );
        assert!(
            state.backup_lsn <= state.commit_lsn,
            "backup_lsn {} beyond commit_lsn {}",
            state.backup_lsn,
            state.commit_lsn
        );
        let sequence = match self.layout {
            Layout::Legacy => 0,
            Layout::Slotted { sequence, .. } => sequence,
        } + 1;
        let slot = encode_slot(state, sequence)?;
        match self.layout {
            Layout::Slotted {
                slot_size, latest, ..
            } if slot.len() as u64 <= slot_size => {
                let file = match &mut self.file {
                    Some(file) => file,
                    file => file.insert(self.disk.open(&self.path).await?),
                };
                let target = 1 - latest;
                let mut block = slot;
                block.resize(slot_size as usize, 0);
                file.write_at(BLOCK + target as u64 * slot_size, block.into())
                    .await?;
                file.sync_data().await?;
                self.layout = Layout::Slotted {
                    slot_size,
                    latest: target,
                    sequence,
                };
            }
            _ => {
                // The open handle would reach the replaced file.
                self.file = None;
                let bytes = new_file(&slot);
                self.disk.write_atomic(&self.path, bytes).await?;
                self.layout = Layout::Slotted {
                    slot_size: slot_size_for(slot.len()),
                    latest: 0,
                    sequence,
                };
            }
        }
        self.persisted = state.clone();
        Ok(())
    }
}

#[cfg(test)]
// Tests set up and damage real files directly; node code may not.
#[allow(clippy::disallowed_methods, clippy::disallowed_types)]
mod tests {
    use super::*;
    use ferry_env::RealDisk;
    use ferry_wal::TermLsn;

    fn cluster() -> ClusterId {
        ClusterId::new("c1").expect("id")
    }

    fn sample() -> SafekeeperState {
        let mut s = SafekeeperState::new(cluster(), 2, 1, 16 << 20);
        s.term = 5;
        s.term_history = TermHistory(vec![
            TermLsn {
                term: 1,
                lsn: Lsn(0),
            },
            TermLsn {
                term: 5,
                lsn: Lsn(900),
            },
        ]);
        s.commit_lsn = Lsn(800);
        s
    }

    #[test]
    fn round_trip_and_damage() {
        let bytes = encode(&sample()).expect("encode");
        assert_eq!(
            bytes.len() as u64,
            3 * BLOCK,
            "a header and two one-block slots"
        );
        assert_eq!(decode(&bytes).expect("decode"), sample());
        // The magic, the version, the slot size, the header checksum, the
        // only written slot's sequence, length, body and checksum.
        let body_end = (BLOCK as usize)
            + SLOT_HEAD
            + postcard::to_allocvec(&sample()).expect("postcard").len();
        for at in [0, 5, 9, 17, 4096, 4104, 4100 + 20, body_end, body_end + 3] {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            assert!(decode(&bad).is_err(), "flip at {at} accepted");
        }
        assert!(matches!(
            decode(&bytes[..bytes.len() - 3]),
            Err(ControlFileError::Corrupt(_))
        ));
        assert!(matches!(decode(&[]), Err(ControlFileError::Corrupt(_))));
        // A future format version is named as such.
        let mut future = bytes.clone();
        future[4] = 9;
        let crc = crc32c::crc32c(&future[..16]);
        future[16..20].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            decode(&future),
            Err(ControlFileError::UnsupportedVersion(9))
        ));
    }

    /// The two slots of a file whose slot 0 holds `first` (sequence 1) and
    /// slot 1 `second` (sequence 2).
    fn two_slots(first: &SafekeeperState, second: &SafekeeperState) -> Vec<u8> {
        let mut bytes = new_file(&encode_slot(first, 1).expect("slot"));
        let slot = encode_slot(second, 2).expect("slot");
        let at = (2 * BLOCK) as usize;
        bytes[at..at + slot.len()].copy_from_slice(&slot);
        bytes
    }

    #[test]
    fn the_newest_valid_slot_is_the_state_and_a_torn_one_is_passed_over() {
        let older = sample();
        let mut newer = sample();
        newer.term = 6;
        let bytes = two_slots(&older, &newer);
        assert_eq!(decode(&bytes).expect("decode"), newer);
        // The newer slot torn (a crash before its sync returned): the older
        // one is the state, whichever sector of it the crash cut.
        for at in [2 * BLOCK as usize, 2 * BLOCK as usize + 30] {
            let mut torn = bytes.clone();
            torn[at] ^= 0x01;
            assert_eq!(decode(&torn).expect("older"), older, "torn at {at}");
        }
        // The older slot torn: the newer one stands.
        let mut torn = bytes.clone();
        torn[BLOCK as usize + 20] ^= 0x01;
        assert_eq!(decode(&torn).expect("newer"), newer);
        // Both torn: refused, naming both.
        torn[2 * BLOCK as usize + 20] ^= 0x01;
        let err = decode(&torn).expect_err("both damaged");
        assert!(
            matches!(&err, ControlFileError::Corrupt(m) if m.contains("slot 0") && m.contains("slot 1")),
            "{err}"
        );
    }

    /// A file of format `version` (3 to 6: one state, replaced whole) for
    /// `state`, its body cut by `drop` trailing bytes (older formats lack
    /// the last fields).
    fn older_format(state: &SafekeeperState, version: u8, drop: usize) -> Vec<u8> {
        let body = postcard::to_allocvec(state).expect("postcard");
        let mut old = Vec::new();
        old.extend_from_slice(&LEGACY_MAGIC.to_le_bytes());
        old.extend_from_slice(&u32::from(version).to_le_bytes());
        old.extend_from_slice(&body[..body.len() - drop]);
        let crc = crc32c::crc32c(&old);
        old.extend_from_slice(&crc.to_le_bytes());
        old
    }

    #[test]
    fn versions_3_to_6_are_upgraded_and_new_fields_round_trip() {
        assert_eq!(
            decode(&older_format(&sample(), 6, 0)).expect("v6"),
            sample()
        );
        // Format 5 is format 6 without `configuration` (`None`: one byte);
        // format 4 also lacks `restored_up_to` (one byte), format 3 the
        // registered replicas (empty: one byte).
        assert_eq!(
            decode(&older_format(&sample(), 5, 1)).expect("v5"),
            sample()
        );
        assert_eq!(
            decode(&older_format(&sample(), 4, 2)).expect("v4"),
            sample()
        );
        assert_eq!(
            decode(&older_format(&sample(), 3, 3)).expect("v3"),
            sample()
        );

        let mut with = sample();
        with.registered_replicas = vec![RegisteredReplica {
            shard_number: 1,
            replica_number: 2,
            remote_consistent_lsn: Lsn(700),
        }];
        with.last_removed_segno = 3;
        with.restored_up_to = Some(Lsn(12345));
        with.configuration = Some(
            Configuration::initial(vec![ferry_wal::membership::Member {
                id: 2,
                addr: "sk2:7000".into(),
            }])
            .expect("configuration"),
        );
        let bytes = encode(&with).expect("encode");
        assert_eq!(decode(&bytes).expect("decode"), with);
    }

    #[tokio::test]
    async fn persisted_state_survives_reopen_and_damage_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
        let fresh = SafekeeperState::new(cluster(), 2, 1, 16 << 20);
        let err = ControlFile::open(Arc::clone(&disk), "sk")
            .await
            .expect_err("nothing to open");
        assert!(
            matches!(&err, ControlFileError::Missing(p) if p == "sk/safekeeper.control"),
            "{err}"
        );
        let mut cf = ControlFile::create(Arc::clone(&disk), "sk", fresh.clone())
            .await
            .expect("create");
        assert_eq!(cf.state(), &fresh);
        cf.persist(&sample()).await.expect("persist");
        let cf = ControlFile::open(Arc::clone(&disk), "sk")
            .await
            .expect("reopen");
        assert_eq!(cf.state(), &sample());
        // Creating again loads what is there; it never resets a safekeeper.
        let cf = ControlFile::create(Arc::clone(&disk), "sk", fresh.clone())
            .await
            .expect("create again");
        assert_eq!(cf.state(), &sample());
        std::fs::write(
            dir.path().join("sk").join(CONTROL_FILE),
            b"garbage!garbage!",
        )
        .expect("damage");
        let err = ControlFile::create(disk, "sk", fresh)
            .await
            .expect_err("refused");
        assert!(
            matches!(&err, ControlFileError::Corrupt(m) if m.starts_with("sk/safekeeper.control: ")),
            "{err}"
        );
        assert_eq!(
            std::fs::read(dir.path().join("sk").join(CONTROL_FILE)).expect("read"),
            b"garbage!garbage!"
        );
    }

    /// Writes alternate between the slots across reopens, a state too large
    /// for its slot gets a file with larger slots, and a file of format 6
    /// becomes a slotted one at its first write.
    #[tokio::test]
    async fn writes_alternate_slots_grow_and_older_files_are_upgraded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
        let path = dir.path().join("sk").join(CONTROL_FILE);
        std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        std::fs::write(&path, older_format(&sample(), 6, 0)).expect("format 6 file");
        let mut cf = ControlFile::open(Arc::clone(&disk), "sk")
            .await
            .expect("open format 6");
        assert_eq!(cf.state(), &sample());
        let mut state = sample();
        let mut slots_written = std::collections::BTreeSet::new();
        for round in 0..6u64 {
            state.term += 1;
            state.commit_lsn = Lsn(state.commit_lsn.0 + 100);
            cf.persist(&state).await.expect("persist");
            let bytes = std::fs::read(&path).expect("read");
            assert_eq!(word(&bytes, 0), MAGIC, "slotted after the first write");
            let (got, layout) = decode_file(&bytes).expect("decode");
            assert_eq!(got, state);
            let Layout::Slotted {
                latest, sequence, ..
            } = layout
            else {
                panic!("slotted")
            };
            assert_eq!(sequence, round + 1);
            slots_written.insert(latest);
            // The slot written last, damaged as a torn write would: the
            // state before comes back (from round 1 on, the other slot holds it).
            if round >= 1 {
                let mut torn = bytes.clone();
                torn[(BLOCK + latest as u64 * BLOCK) as usize + 3] ^= 1;
                let before = decode(&torn).expect("the other slot");
                assert_eq!(before.term, state.term - 1, "round {round}");
            }
            if round % 2 == 1 {
                cf = ControlFile::open(Arc::clone(&disk), "sk")
                    .await
                    .expect("reopen");
            }
        }
        assert_eq!(slots_written.len(), 2, "both slots take writes");
        assert_eq!(std::fs::metadata(&path).expect("size").len(), 3 * BLOCK);

        // Grown: every registered replica a control file may hold.
        state.registered_replicas = (0..MAX_REGISTERED_REPLICAS as u32)
            .map(|i| RegisteredReplica {
                shard_number: i,
                replica_number: u32::MAX - i,
                remote_consistent_lsn: Lsn(u64::MAX - u64::from(i)),
            })
            .collect();
        cf.persist(&state).await.expect("grow");
        let size = std::fs::metadata(&path).expect("size").len();
        assert!(size > 3 * BLOCK, "{size} bytes");
        let mut cf = ControlFile::open(Arc::clone(&disk), "sk")
            .await
            .expect("reopen");
        assert_eq!(cf.state(), &state);
        state.registered_replicas.truncate(1);
        state.term += 1;
        cf.persist(&state).await.expect("smaller");
        assert_eq!(
            std::fs::metadata(&path).expect("size").len(),
            size,
            "in place"
        );
        let cf = ControlFile::open(disk, "sk").await.expect("reopen");
        assert_eq!(cf.state(), &state);
    }

    /// A control file that would forget a vote or a commit is never written:
    /// the safekeeper stops first, and the file keeps what it promised.
    #[tokio::test]
    async fn a_term_or_commit_going_back_stops_before_the_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
        let fresh = SafekeeperState::new(cluster(), 2, 1, 16 << 20);
        let mut cf = ControlFile::create(Arc::clone(&disk), "sk", fresh)
            .await
            .expect("create");
        let promised = sample();
        cf.persist(&promised).await.expect("persist");
        for (what, regress) in [
            ("term", {
                let mut s = promised.clone();
                s.term -= 1;
                s
            }),
            ("commit_lsn", {
                let mut s = promised.clone();
                s.commit_lsn = Lsn(promised.commit_lsn.0 - 1);
                s.backup_lsn = Lsn(0);
                s
            }),
            ("backup_lsn", {
                let mut s = promised.clone();
                s.backup_lsn = Lsn(promised.commit_lsn.0 + 1);
                s
            }),
        ] {
            let persisted = cf.persisted.clone();
            let write = std::panic::AssertUnwindSafe(cf.persist(&regress));
            let outcome = futures::FutureExt::catch_unwind(write).await;
            assert!(outcome.is_err(), "a {what} going back is refused");
            assert_eq!(cf.persisted, persisted, "{what}: nothing changed");
        }
        let reopened = ControlFile::open(disk, "sk").await.expect("reopen");
        assert_eq!(
            reopened.state(),
            &promised,
            "the file keeps what it promised"
        );
    }
}
