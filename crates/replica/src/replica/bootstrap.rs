//! Building a replica from a peer: a new replica of a shard, or one whose
//! data dir was lost, copies a peer replica's parts and state taken at one
//! position ([`BootstrapManifest`], made by the donor under its lock), checks
//! every part it copied, writes the state last, and then streams WAL from
//! that position like any replica after a restart. It never needs the WAL
//! below the position, which the safekeepers may have removed.
//!
//! Invariants:
//! * **One position.** The manifest's parts, window and decided merges are
//!   the donor's at its `disk_consistent_lsn`, taken in one critical section
//!   after a persist ([`Replica::bootstrap_manifest`]); every listed part
//!   lies below the position and every decided merge's sources are listed
//!   or results of earlier decided merges ([`check_manifest`]). The copy is
//!   then what this replica would hold had it applied the WAL up to there.
//! * **The state last.** Parts are written under temporary names, synced,
//!   checked (footer and rows: [`crate::part::check_file`]) and renamed;
//!   directories are synced; only then is the state file written. A crash
//!   before leaves a replica without a state file, which is built again (the
//!   parts already checked under their names are kept when the new manifest
//!   lists them). A replica with a state file is never overwritten.
//! * **An unfinished copy is never a new replica.** A copy writes its marker
//!   ([`copy_unfinished`]) before its first part and removes it after the
//!   state file; [`Replica::open`] refuses a replica with the marker and no
//!   state file. Opened as a new replica it would stream the WAL from 0/0
//!   over the copy's merged parts (which records it applies again) or fail
//!   on WAL the safekeepers removed: only another copy may finish it.
//! * **How bytes travel is the source's.** [`BootstrapSource`] is HTTP
//!   between nodes (`ferry_node::bootstrap`) and the donor [`Replica`] itself in
//!   one process ([`LocalDonor`]: `ferry dev`, the simulator).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use ferry_env::{Cpu, Disk, SharedClock};
use ferry_wal::Lsn;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::merges::Merge;
use super::retire::RetiredPartition;
use super::state::State;
use super::{io, HoldError, Replica, ReplicaError, SharedReplica};
use crate::part::{self, PartMeta, PartName};
use crate::view::part_path;

/// A donor's state at one position and the parts it holds there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapManifest {
    /// The donor's hold on the listed parts, named when fetching them.
    pub hold: String,
    pub shard: u32,
    pub donor_replica: u32,
    /// The position: every record below it is in `parts`, none above.
    pub disk_consistent_lsn: Lsn,
    /// The idempotency window at the position, oldest first.
    pub window: Vec<(u64, u32, String, Lsn)>,
    /// Merges decided and not yet done, in the order decided.
    pub merges: Vec<Merge>,
    /// Partitions with rows retired (retention), at the position.
    #[serde(default)]
    pub retired: Vec<RetiredPartition>,
    /// The active parts.
    pub parts: Vec<PartMeta>,
}

/// The bytes of one part, in order, a chunk at a time, followed by the
/// crc32c of those bytes as the donor read them (4 bytes, little-endian):
/// the rows check catches a change of values, this one a change of any byte
/// on the way (page headers and statistics included).
#[async_trait]
pub trait PartBytes: Send {
    /// The next chunk; `None` at the end.
    async fn next_chunk(&mut self) -> Result<Option<Bytes>, String>;
}

/// Where a copy comes from.
#[async_trait]
pub trait BootstrapSource: Send + Sync {
    /// Names the donor in errors and logs.
    fn donor(&self) -> String;
    /// The donor's manifest for replica `replica` of `shard` (a hold on its
    /// parts comes with it).
    async fn manifest(&self, shard: u32, replica: u32) -> Result<BootstrapManifest, String>;
    /// The bytes of a part the manifest of `hold` lists.
    async fn part(
        &self,
        hold: &str,
        table_id: u64,
        name: &PartName,
    ) -> Result<Box<dyn PartBytes>, String>;
    /// Ends the hold (best effort: it expires anyway).
    async fn release(&self, hold: &str) -> Result<(), String>;
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("replica {path} has a state file: it is built already, and a copy never overwrites a replica")]
    HasState { path: String },
    #[error("copying from {donor}: {detail}")]
    Source { donor: String, detail: String },
    #[error("the copy {donor} offered is not one consistent replica: {detail}")]
    Inconsistent { donor: String, detail: String },
    #[error("part {part} copied from {donor} is not the part its manifest describes: {detail}")]
    Damaged {
        donor: String,
        part: String,
        detail: String,
    },
    #[error(transparent)]
    Replica(#[from] ReplicaError),
}

/// How much of a copied part is checked beyond the crc32c of its bytes
/// (which every copy checks: nothing changed on the way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyCheck {
    /// Every row decoded and checked against the footer's checksum: a part
    /// the donor's disk damaged is refused too. CPU-bound (a Parquet
    /// decode of every part).
    #[default]
    Rows,
    /// The footer only (it must describe the manifest's part): the copy is
    /// the donor's bytes, whose rows are checked whenever they are read,
    /// merged or exported, on the donor and on the copy alike.
    Footers,
}

/// What a copy did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bootstrapped {
    pub donor: String,
    pub disk_consistent_lsn: Lsn,
    /// Parts the replica holds now; of them, `copied` came over this time
    /// (the others were left checked by an interrupted copy).
    pub parts: usize,
    pub copied: usize,
    pub bytes_copied: u64,
}

/// Whether the replica under `dir` has no state file yet (new, or lost):
/// the only replica a copy may build.
pub async fn needs_copy(disk: &dyn Disk, dir: &str) -> Result<bool, ReplicaError> {
    let path = format!("{dir}/state");
    match disk.metadata(&path).await {
        Ok(_) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(io(&path)(e)),
    }
}

/// The marker of a copy under way under `dir` (see the module docs).
pub(super) fn copy_marker(dir: &str) -> String {
    format!("{dir}/copy-unfinished")
}

/// Whether the replica under `dir` holds a copy from a peer that has not
/// finished: no state file, and a copy began. Only another copy may build
/// it; [`Replica::open`] refuses it.
pub async fn copy_unfinished(disk: &dyn Disk, dir: &str) -> Result<bool, ReplicaError> {
    if !needs_copy(disk, dir).await? {
        return Ok(false);
    }
    let marker = copy_marker(dir);
    match disk.metadata(&marker).await {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(&marker)(e)),
    }
}

/// Checks a manifest is one replica at one position (see the module docs).
pub fn check_manifest(m: &BootstrapManifest, shard: u32) -> Result<(), String> {
    if m.shard != shard {
        return Err(format!(
            "it is a replica of shard {}, this one is of shard {shard}",
            m.shard
        ));
    }
    // Names become paths: each must be one a part can have (a donor's
    // manifest is input from the network).
    let names_ok = m.parts.iter().map(|p| &p.name).chain(
        m.merges
            .iter()
            .flat_map(|x| std::iter::once(&x.result).chain(&x.sources)),
    );
    for n in names_ok {
        if PartName::parse(&n.to_string()).as_ref() != Some(n) {
            return Err(format!("{n:?} is not a part name"));
        }
    }
    let mut names: BTreeMap<u64, BTreeSet<&PartName>> = BTreeMap::new();
    for p in &m.parts {
        if p.max_lsn >= m.disk_consistent_lsn || p.min_lsn > p.max_lsn {
            return Err(format!(
                "part {} holds records {}..={}, not below the position {}",
                p.name, p.min_lsn, p.max_lsn, m.disk_consistent_lsn
            ));
        }
        if !names.entry(p.table_id).or_default().insert(&p.name) {
            return Err(format!("part {} is listed twice", p.name));
        }
    }
    for parts in names.values() {
        for a in parts {
            if let Some(b) = parts.iter().find(|b| super::merges::replaces(b, a)) {
                return Err(format!("part {a} is listed beside {b}, which replaced it"));
            }
        }
    }
    let mut results: BTreeMap<u64, BTreeSet<&PartName>> = BTreeMap::new();
    for merge in &m.merges {
        let listed = names.get(&merge.table_id);
        if listed.is_some_and(|n| n.contains(&merge.result)) {
            return Err(format!(
                "merge into {} is listed as pending, and its result as a part",
                merge.result
            ));
        }
        for s in &merge.sources {
            let known = listed.is_some_and(|n| n.contains(s))
                || results.get(&merge.table_id).is_some_and(|r| r.contains(s));
            if !known {
                return Err(format!(
                    "merge into {} needs part {s}, which is neither listed nor the result of an earlier merge",
                    merge.result
                ));
            }
        }
        results
            .entry(merge.table_id)
            .or_default()
            .insert(&merge.result);
    }
    if let Some((_, _, key, lsn)) = m.window.iter().find(|(.., l)| *l >= m.disk_consistent_lsn) {
        return Err(format!(
            "the idempotency window holds key {key:?} applied at {lsn}, not below the position {}",
            m.disk_consistent_lsn
        ));
    }
    Ok(())
}

/// Builds replica `replica` of `shard` under `dir` from `source` (see the
/// module docs). The replica must have no state file; open it with
/// [`Replica::open`] afterwards.
pub async fn copy_from_peer(
    disk: &Arc<dyn Disk>,
    dir: &str,
    shard: u32,
    replica: u32,
    cpu: Cpu,
    check: CopyCheck,
    source: &dyn BootstrapSource,
) -> Result<Bootstrapped, BootstrapError> {
    let state_path = format!("{dir}/state");
    if !needs_copy(disk.as_ref(), dir).await? {
        return Err(BootstrapError::HasState { path: state_path });
    }
    let donor = source.donor();
    let src = |detail: String| BootstrapError::Source {
        donor: donor.clone(),
        detail,
    };
    let manifest = source.manifest(shard, replica).await.map_err(src)?;
    check_manifest(&manifest, shard).map_err(|detail| BootstrapError::Inconsistent {
        donor: donor.clone(),
        detail,
    })?;
    // The marker goes first: from here on, the dir holds a copy.
    disk.create_dir_all(dir).await.map_err(io(dir))?;
    let marker = copy_marker(dir);
    let donor_line = format!("{donor} at {}\n", manifest.disk_consistent_lsn).into_bytes();
    disk.write_atomic(&marker, donor_line)
        .await
        .map_err(io(&marker))?;
    let outcome = copy_parts(disk, dir, cpu, check, source, &manifest).await;
    if outcome.is_err() {
        // The hold expires anyway; releasing it now frees the donor sooner.
        let _ = source.release(&manifest.hold).await;
    }
    let (copied, bytes_copied) = outcome?;
    let state = State::copied(
        shard,
        replica,
        manifest.disk_consistent_lsn,
        manifest.window.iter().cloned().collect::<VecDeque<_>>(),
        manifest.merges.clone(),
        manifest.retired.clone(),
    );
    let data = serde_json::to_vec(&state).expect("state serialises");
    disk.write_atomic(&state_path, data)
        .await
        .map_err(io(&state_path))?;
    // Built: the marker is history (a crash before it goes leaves it beside
    // the state file, where it means nothing and the next open removes it).
    remove_copy_marker(disk.as_ref(), dir).await?;
    if let Err(e) = source.release(&manifest.hold).await {
        tracing::info!(%donor, error = %e, "could not release the copy's hold (it expires)");
    }
    Ok(Bootstrapped {
        donor,
        disk_consistent_lsn: manifest.disk_consistent_lsn,
        parts: manifest.parts.len(),
        copied,
        bytes_copied,
    })
}

/// Removes the marker of a finished copy (durably; none: nothing to do).
pub(super) async fn remove_copy_marker(disk: &dyn Disk, dir: &str) -> Result<(), ReplicaError> {
    let marker = copy_marker(dir);
    match disk.remove_file(&marker).await {
        Ok(()) => disk.sync_dir(dir).await.map_err(io(dir)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(&marker)(e)),
    }
}

/// Makes the parts under `dir` exactly the manifest's: files it does not
/// list go, listed ones already there (checked by an interrupted copy) stay,
/// the others are copied and checked. Returns how many parts and bytes were
/// copied.
async fn copy_parts(
    disk: &Arc<dyn Disk>,
    dir: &str,
    cpu: Cpu,
    check: CopyCheck,
    source: &dyn BootstrapSource,
    manifest: &BootstrapManifest,
) -> Result<(usize, u64), BootstrapError> {
    let parts_dir = format!("{dir}/parts");
    disk.create_dir_all(&parts_dir)
        .await
        .map_err(io(&parts_dir))?;
    let listed: BTreeMap<(u64, String), &PartMeta> = manifest
        .parts
        .iter()
        .map(|p| ((p.table_id, format!("{}.parquet", p.name)), p))
        .collect();
    let mut present: BTreeSet<(u64, String)> = BTreeSet::new();
    for table in disk.list_dir(&parts_dir).await.map_err(io(&parts_dir))? {
        let tdir = format!("{parts_dir}/{table}");
        for file in disk.list_dir(&tdir).await.map_err(io(&tdir))? {
            let path = format!("{tdir}/{file}");
            let key = table.parse::<u64>().ok().map(|t| (t, file.clone()));
            let kept = match key.as_ref().and_then(|k| listed.get(k)) {
                Some(meta) => part::PartReader::open(disk.as_ref(), &path, &meta.name)
                    .await
                    .is_ok_and(|r| {
                        let mut m = r.meta().clone();
                        m.shard = meta.shard;
                        &&m == meta
                    }),
                None => false,
            };
            if kept {
                present.extend(key);
            } else {
                disk.remove_file(&path).await.map_err(io(&path))?;
            }
        }
    }
    let missing: Vec<&PartMeta> = manifest
        .parts
        .iter()
        .filter(|p| !present.contains(&(p.table_id, format!("{}.parquet", p.name))))
        .collect();
    for t in missing.iter().map(|p| p.table_id).collect::<BTreeSet<_>>() {
        let tdir = format!("{parts_dir}/{t}");
        disk.create_dir_all(&tdir).await.map_err(io(&tdir))?;
    }
    // Several parts travel at once, each fetched, synced and checked: the
    // fetches overlap each other's syncs and the checks' CPU.
    let mut copies = futures::stream::iter(missing.iter().map(|meta| async move {
        let tmp = format!("{}.tmp", part_path(dir, meta.table_id, &meta.name));
        let n = fetch_part(disk.as_ref(), source, &manifest.hold, meta, &tmp).await?;
        finish_part(disk.as_ref(), dir, cpu, check, source, meta, tmp).await?;
        Ok::<u64, BootstrapError>(n)
    }))
    .buffer_unordered(COPY_PARTS_IN_FLIGHT);
    let mut bytes = 0u64;
    while let Some(copied) = copies.next().await {
        bytes += copied?;
    }
    drop(copies);
    for t in manifest
        .parts
        .iter()
        .map(|p| p.table_id)
        .collect::<BTreeSet<_>>()
    {
        let tdir = format!("{parts_dir}/{t}");
        disk.sync_dir(&tdir).await.map_err(io(&tdir))?;
    }
    disk.sync_dir(&parts_dir).await.map_err(io(&parts_dir))?;
    Ok((missing.len(), bytes))
}

/// Copies a part's bytes into `tmp` and syncs it; returns their count.
async fn fetch_part(
    disk: &dyn Disk,
    source: &dyn BootstrapSource,
    hold: &str,
    meta: &PartMeta,
    tmp: &str,
) -> Result<u64, BootstrapError> {
    let src = |detail: String| BootstrapError::Source {
        donor: source.donor(),
        detail: format!("part {}: {detail}", meta.name),
    };
    match disk.remove_file(tmp).await {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(tmp)(e).into()),
    }
    let mut bytes = source
        .part(hold, meta.table_id, &meta.name)
        .await
        .map_err(src)?;
    let file = disk.create_new(tmp).await.map_err(io(tmp))?;
    let damaged = |detail: String| BootstrapError::Damaged {
        donor: source.donor(),
        part: meta.name.to_string(),
        detail,
    };
    let (mut len, mut crc) = (0u64, 0u32);
    let mut trailer: Vec<u8> = Vec::with_capacity(CRC_TRAILER_BYTES);
    while let Some(mut chunk) = bytes.next_chunk().await.map_err(src)? {
        let file_bytes = (meta.bytes - len).min(chunk.len() as u64) as usize;
        let rest = chunk.split_off(file_bytes);
        if !chunk.is_empty() {
            crc = crc32c::crc32c_append(crc, &chunk);
            let n = chunk.len() as u64;
            file.write_at(len, chunk).await.map_err(io(tmp))?;
            len += n;
        }
        trailer.extend_from_slice(&rest);
        if trailer.len() > CRC_TRAILER_BYTES {
            return Err(damaged(format!("more than its {} bytes came", meta.bytes)));
        }
    }
    if len != meta.bytes || trailer.len() != CRC_TRAILER_BYTES {
        return Err(damaged(format!(
            "{} bytes came of its {} and the 4 of their crc32c",
            len + trailer.len() as u64,
            meta.bytes
        )));
    }
    let sent = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
    if sent != crc {
        return Err(damaged(format!(
            "its bytes' crc32c is {crc:08x}, the donor read {sent:08x}: damaged on the way"
        )));
    }
    file.sync_data().await.map_err(io(tmp))?;
    Ok(len)
}

/// Checks a fetched part (its footer, and its rows with [`CopyCheck::Rows`])
/// and gives it its name.
async fn finish_part(
    disk: &dyn Disk,
    dir: &str,
    cpu: Cpu,
    check: CopyCheck,
    source: &dyn BootstrapSource,
    meta: &PartMeta,
    tmp: String,
) -> Result<(), BootstrapError> {
    let checked = match check {
        CopyCheck::Rows => part::check_file(disk, &tmp, meta, cpu).await,
        CopyCheck::Footers => part::check_footer(disk, &tmp, meta).await,
    };
    if let Err(e) = checked {
        let _ = disk.remove_file(&tmp).await;
        return Err(BootstrapError::Damaged {
            donor: source.donor(),
            part: meta.name.to_string(),
            detail: e.to_string(),
        });
    }
    let path = part_path(dir, meta.table_id, &meta.name);
    disk.rename(&tmp, &path).await.map_err(io(&path))?;
    Ok(())
}

/// A donor in this process: its [`Replica`] itself (`ferry dev`, the
/// simulator, and the node's HTTP endpoint, which serves this).
pub struct LocalDonor {
    pub replica: SharedReplica,
    pub clock: SharedClock,
    /// Names the donor.
    pub name: String,
}

/// Parts copied at once.
pub const COPY_PARTS_IN_FLIGHT: usize = 4;

/// Bytes of a part file read in chunks of this size.
pub const COPY_CHUNK_BYTES: usize = 4 << 20;
/// The crc32c after a part's bytes ([`PartBytes`]).
pub const CRC_TRAILER_BYTES: usize = 4;

struct FileBytes {
    file: Box<dyn ferry_env::DiskFile>,
    offset: u64,
    len: u64,
    crc: Option<u32>,
}

#[async_trait]
impl PartBytes for FileBytes {
    async fn next_chunk(&mut self) -> Result<Option<Bytes>, String> {
        if self.offset >= self.len {
            return Ok(self
                .crc
                .take()
                .map(|crc| Bytes::copy_from_slice(&crc.to_le_bytes())));
        }
        let n = (self.len - self.offset).min(COPY_CHUNK_BYTES as u64) as usize;
        let chunk = self
            .file
            .read_at(self.offset, n)
            .await
            .map_err(|e| e.to_string())?;
        if chunk.len() != n {
            return Err(format!(
                "read {} bytes at {} of a part of {}",
                chunk.len(),
                self.offset,
                self.len
            ));
        }
        self.offset += n as u64;
        self.crc = self.crc.map(|c| crc32c::crc32c_append(c, &chunk));
        Ok(Some(Bytes::from(chunk)))
    }
}

impl LocalDonor {
    /// A part's bytes as the donor holds them (its size from the manifest's
    /// metadata).
    pub async fn open_part(
        &self,
        hold: &str,
        table_id: u64,
        name: &PartName,
    ) -> Result<Box<dyn PartBytes>, HoldError> {
        let (path, meta, disk) = {
            let mut r = self.replica.lock().await;
            let now = self.clock.unix_micros();
            let (path, meta) = r.bootstrap_part(hold, table_id, name, now)?;
            (path, meta, Arc::clone(r.disk()))
        };
        let file = disk
            .open(&path)
            .await
            .map_err(|e| HoldError::Replica(io(&path)(e)))?;
        Ok(Box::new(FileBytes {
            file,
            offset: 0,
            len: meta.bytes,
            crc: Some(0),
        }))
    }

    /// The donor's manifest for replica `replica` of `shard`. Taken on a
    /// task of its own: it persists the donor, which must not stop half-way
    /// when the copier goes away (a dropped HTTP request, a cut copy).
    pub async fn take_manifest(
        &self,
        shard: u32,
        replica: u32,
    ) -> Result<BootstrapManifest, ReplicaError> {
        let replica_lock = Arc::clone(&self.replica);
        let clock = Arc::clone(&self.clock);
        let task = tokio::spawn(async move {
            let mut r = replica_lock.lock().await;
            let now = clock.unix_micros();
            r.bootstrap_manifest(&Replica::bootstrap_hold_id(shard, replica), now)
                .await
        });
        match task.await {
            Ok(manifest) => manifest,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(ReplicaError::Damaged {
                path: String::new(),
                detail: format!("the manifest task ended: {e}"),
            }),
        }
    }
}

#[async_trait]
impl BootstrapSource for LocalDonor {
    fn donor(&self) -> String {
        self.name.clone()
    }

    async fn manifest(&self, shard: u32, replica: u32) -> Result<BootstrapManifest, String> {
        self.take_manifest(shard, replica)
            .await
            .map_err(|e| e.to_string())
    }

    async fn part(
        &self,
        hold: &str,
        table_id: u64,
        name: &PartName,
    ) -> Result<Box<dyn PartBytes>, String> {
        self.open_part(hold, table_id, name)
            .await
            .map_err(|e| e.to_string())
    }

    async fn release(&self, hold: &str) -> Result<(), String> {
        self.replica.lock().await.release_bootstrap(hold);
        Ok(())
    }
}
