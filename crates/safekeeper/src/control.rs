//! The control file: everything a safekeeper must remember besides the WAL bytes.
//!
//! Layout: `magic: u32 LE | format version: u32 LE | postcard(state) | crc32c: u32 LE`
//! where the checksum covers everything before it. It is replaced atomically
//! (temp file, fsync, rename, directory fsync) through the disk seam, and it is
//! persisted *before* any message that depends on it is answered (a vote, a term
//! change, an adopted term history). A damaged file is refused, never reset: a
//! safekeeper that forgot its term could vote twice.

use std::sync::Arc;

use ferry_env::Disk;
use ferry_wal::membership::Configuration;
use ferry_wal::{ClusterId, Lsn, Term, TermHistory};
use serde::{Deserialize, Serialize};

/// File name inside the safekeeper's data dir.
pub const CONTROL_FILE: &str = "safekeeper.control";
const MAGIC: u32 = 0xFE55_AFE0;
/// Bumped on every incompatible change of [`SafekeeperState`] (2: the cluster id;
/// 3: the durable flush point; 4: registered replicas; 5: restored from the
/// backup; 6: the membership configuration). Versions 3 to 5 are read and
/// upgraded on the next write.
pub const FORMAT_VERSION: u32 = 6;

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

/// Encodes a state into control-file bytes.
pub fn encode(state: &SafekeeperState) -> Result<Vec<u8>, ControlFileError> {
    let body =
        postcard::to_allocvec(state).map_err(|e| ControlFileError::Corrupt(e.to_string()))?;
    let mut out = Vec::with_capacity(body.len() + 12);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&body);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Decodes control-file bytes, checking magic, version and checksum.
pub fn decode(bytes: &[u8]) -> Result<SafekeeperState, ControlFileError> {
    if bytes.len() < 12 {
        return Err(ControlFileError::Corrupt(format!(
            "{} bytes is too short",
            bytes.len()
        )));
    }
    let word =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    if word(0) != MAGIC {
        return Err(ControlFileError::Corrupt("bad magic".into()));
    }
    let crc_at = bytes.len() - 4;
    if crc32c::crc32c(&bytes[..crc_at]) != word(crc_at) {
        return Err(ControlFileError::Corrupt("checksum mismatch".into()));
    }
    let version = word(4);
    let body = &bytes[8..crc_at];
    let corrupt = |e: postcard::Error| ControlFileError::Corrupt(e.to_string());
    let state: SafekeeperState = match version {
        FORMAT_VERSION => postcard::from_bytes(body).map_err(corrupt)?,
        // Formats 5 and 6 appended `restored_up_to` and `configuration`;
        // postcard writes `None` as one zero byte, so a format 4 body with
        // two such bytes (format 5 with one) is a format 6 body.
        4 | 5 => {
            let missing = (FORMAT_VERSION - version) as usize;
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
    Ok(state)
}

/// The control file of one safekeeper, and the last state made durable.
#[derive(Debug)]
pub struct ControlFile {
    disk: Arc<dyn Disk>,
    path: String,
    persisted: SafekeeperState,
}

impl ControlFile {
    /// Loads the control file in `dir`; a missing or damaged one is an error.
    pub async fn open(disk: Arc<dyn Disk>, dir: &str) -> Result<ControlFile, ControlFileError> {
        let path = format!("{dir}/{CONTROL_FILE}");
        let persisted = match disk.read(&path).await {
            Ok(bytes) => decode(&bytes).map_err(|e| e.at(&path))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ControlFileError::Missing(path))
            }
            Err(e) => return Err(e.into()),
        };
        Ok(ControlFile {
            disk,
            path,
            persisted,
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
                disk.write_atomic(&path, encode(&fresh)?).await?;
                Ok(ControlFile {
                    disk,
                    path,
                    persisted: fresh,
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
    pub async fn persist(&mut self, state: &SafekeeperState) -> Result<(), ControlFileError> {
        if *state == self.persisted {
            return Ok(());
        }
        // What a safekeeper promised survives every write of its control
        // file: its term (a vote given), its commit_lsn and its
        // configuration's generation never go back, and its backup never passes what it knows committed. A violation
        // stops the safekeeper before the file says otherwise.
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
        self.disk.write_atomic(&self.path, encode(state)?).await?;
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
        assert_eq!(decode(&bytes).expect("decode"), sample());
        for at in [0, 5, bytes.len() / 2, bytes.len() - 1] {
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
        let mut future = bytes[..bytes.len() - 4].to_vec();
        future[4] = 9;
        let crc = crc32c::crc32c(&future);
        future.extend_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            decode(&future),
            Err(ControlFileError::UnsupportedVersion(9))
        ));
    }

    /// The file of `state` re-stamped as format `version` with its body
    /// cut by `drop` trailing bytes (older formats lack the last fields).
    fn older_format(state: &SafekeeperState, version: u8, drop: usize) -> Vec<u8> {
        let current = encode(state).expect("encode");
        let mut old = current[..current.len() - 4 - drop].to_vec();
        old[4] = version;
        let crc = crc32c::crc32c(&old);
        old.extend_from_slice(&crc.to_le_bytes());
        old
    }

    #[test]
    fn versions_3_to_5_are_upgraded_and_new_fields_round_trip() {
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
