//! Finding a table's current version and committing a partition's files
//! to it (see the crate doc for the rules).
//!
//! Invariant: `metadata/vN.metadata.json` is only ever created, never
//! overwritten (`Location::put_create`), so the table's history is the
//! sequence of versions, each the one before plus one snapshot, and two
//! committers never both win version N. Manifests and manifest lists are
//! written before the version that references them, under names of their
//! own; a commit that loses its race leaves them unreferenced (orphans that
//! upkeep may remove), never half a snapshot.

use std::collections::BTreeMap;

use bytes::Bytes;
use ferry_storage::{Location, StorageError};
use ferry_table::TableDef;

use crate::manifest::{
    read_manifest, read_manifest_list, write_manifest, write_manifest_list, DataFileEntry,
    EntryStatus, ManifestEntry, ManifestFile, ManifestHeader,
};
use crate::spec::{
    MetadataLogEntry, Snapshot, SnapshotLogEntry, SnapshotRef, SortOrder, TableMetadata,
    FORMAT_VERSION,
};
use crate::table::{
    partition_avro_type, partition_field_name, partition_spec, schema, PartitionValue,
};
use crate::{partition_property, IcebergError, CONTENT_PROPERTY, TRANSACTION_PROPERTY};

/// Where the metadata lives, relative to the table's location.
pub const METADATA_DIR: &str = "metadata";
/// The hint some readers look for: the current version's number.
pub const VERSION_HINT: &str = "metadata/version-hint.text";
/// The highest metadata version a table may hold.
pub const MAX_VERSION: u64 = 1 << 62;
/// Races a commit may lose in a row before it gives up (retryable).
pub const MAX_COMMIT_ATTEMPTS: u32 = 64;

/// One partition's files, committed as the export `transaction_id`.
#[derive(Debug, Clone)]
pub struct Commit {
    pub transaction_id: String,
    /// The export's place among the partition's exports (one more than the
    /// partition's current commit when the export was asked, as for commit
    /// files), then its create time: together with the transaction id, the
    /// order in which exports of a partition supersede each other.
    pub sequence: u64,
    pub create_time: u64,
    /// What the export holds, as an id derived from the table, the
    /// partition and its parts' checksums: a commit of content already
    /// current (a forced export of unchanged rows) is a no-op.
    pub content_id: String,
    /// The commit position the export's snapshot includes.
    pub snapshot_lsn: u64,
    pub partition_id: String,
    /// Every data file of the partition (paths relative to the table's
    /// location), replacing the partition's current ones.
    pub files: Vec<DataFileEntry>,
    /// The commit's time (milliseconds since the Unix epoch), from the
    /// caller's clock.
    pub timestamp_ms: i64,
}

/// What a commit did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitOutcome {
    /// A new snapshot, in a new metadata version.
    Committed { version: u64, snapshot_id: i64 },
    /// This export's files are current already: nothing written.
    AlreadyCurrent { version: u64 },
    /// A later export of the partition is current: nothing written (the
    /// reader never goes back to older content).
    Superseded { version: u64, current: String },
}

/// An Iceberg table at a location.
#[derive(Clone)]
pub struct IcebergTable {
    location: Location,
}

/// The key of metadata version `version` under the table.
pub fn metadata_key(version: u64) -> String {
    format!("{METADATA_DIR}/v{version}.metadata.json")
}

fn version_of(key: &str) -> Option<u64> {
    key.strip_prefix("metadata/v")?
        .strip_suffix(".metadata.json")?
        .parse()
        .ok()
}

/// The export whose files are current for a partition, as the table's
/// properties record it ([`partition_property`]).
#[derive(
    Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct CurrentExport {
    pub sequence: u64,
    pub create_time: u64,
    pub transaction_id: String,
    #[serde(default)]
    pub content_id: String,
    #[serde(default)]
    pub snapshot_lsn: u64,
    /// Rows of the partition's files.
    #[serde(default)]
    pub rows: u64,
}

impl CurrentExport {
    fn of(commit: &Commit) -> CurrentExport {
        CurrentExport {
            sequence: commit.sequence,
            create_time: commit.create_time,
            transaction_id: commit.transaction_id.clone(),
            content_id: commit.content_id.clone(),
            snapshot_lsn: commit.snapshot_lsn,
            rows: commit
                .files
                .iter()
                .map(|f| u64::try_from(f.record_count).unwrap_or(0))
                .sum(),
        }
    }

    /// Whether committing `commit` would change nothing: the same export,
    /// or the same content under another transaction (a forced export of
    /// unchanged rows).
    fn holds(&self, commit: &Commit) -> bool {
        self.transaction_id == commit.transaction_id
            || (!commit.content_id.is_empty() && self.content_id == commit.content_id)
    }
}

/// The export `meta` records as current for a partition.
fn current_export(
    meta: &TableMetadata,
    version: u64,
    partition_id: &str,
) -> Result<Option<CurrentExport>, IcebergError> {
    let key = partition_property(partition_id);
    let Some(done) = meta.properties.get(&key) else {
        return Ok(None);
    };
    serde_json::from_str(done)
        .map(Some)
        .map_err(|e| IcebergError::Metadata {
            file: metadata_key(version),
            reason: format!("property {key}: {e}"),
        })
}

/// A 63-bit id from a name (FNV-1a): snapshot ids and the table's uuid are
/// derived, not drawn, so a retried commit makes the same names.
fn derived_id(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain(std::iter::once(0)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h & (i64::MAX as u64)
}

impl IcebergTable {
    pub fn new(location: Location) -> IcebergTable {
        IcebergTable { location }
    }

    pub fn location(&self) -> &Location {
        &self.location
    }

    /// The full URL of a key under the table.
    pub fn url_of(&self, key: &str) -> String {
        format!("{}/{key}", self.location.url().trim_end_matches('/'))
    }

    /// The current version and its metadata (`None`: no table yet).
    pub async fn current(&self) -> Result<Option<(u64, TableMetadata)>, IcebergError> {
        let Some(version) = self.newest_version().await? else {
            return Ok(None);
        };
        // Every caller writes `version + 1`: a file named past any version a
        // table can reach is refused, never wrapped around.
        if version >= MAX_VERSION {
            return Err(IcebergError::Metadata {
                file: metadata_key(version),
                reason: format!("version number above {MAX_VERSION}"),
            });
        }
        Ok(Some((version, self.read_version(version).await?)))
    }

    /// The newest version: from the hint forward when there is one (a hint
    /// is written after its version was created, and versions are never
    /// removed, so the newest is the hint or after it; racing writers may
    /// leave an older hint, which costs a few more steps), else from a
    /// listing of the metadata (which grows with the table's history).
    async fn newest_version(&self) -> Result<Option<u64>, IcebergError> {
        let hinted = match self.location.get(VERSION_HINT).await {
            Ok(body) => std::str::from_utf8(&body)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok()),
            Err(StorageError::NotFound { .. }) => None,
            Err(e) => return Err(e.into()),
        };
        if let Some(mut version) = hinted.filter(|v| (1..MAX_VERSION).contains(v)) {
            if self.location.size(&metadata_key(version)).await?.is_some() {
                while version < MAX_VERSION
                    && self
                        .location
                        .size(&metadata_key(version + 1))
                        .await?
                        .is_some()
                {
                    version += 1;
                }
                return Ok(Some(version));
            }
        }
        let listed = self.location.list(METADATA_DIR).await?;
        Ok(listed.iter().filter_map(|(k, _)| version_of(k)).max())
    }

    async fn read_version(&self, version: u64) -> Result<TableMetadata, IcebergError> {
        let key = metadata_key(version);
        let body = self.location.get(&key).await?;
        serde_json::from_slice(&body).map_err(|e| IcebergError::Metadata {
            file: key,
            reason: e.to_string(),
        })
    }

    /// The export whose files are current for a partition, with the
    /// current version (`None`: no table, or the partition has no export).
    pub async fn current_export(
        &self,
        partition_id: &str,
    ) -> Result<Option<(u64, CurrentExport)>, IcebergError> {
        let Some((version, meta)) = self.current().await? else {
            return Ok(None);
        };
        Ok(current_export(&meta, version, partition_id)?.map(|e| (version, e)))
    }

    /// The live data files of the current snapshot, with their partitions.
    pub async fn files(&self) -> Result<Vec<DataFileEntry>, IcebergError> {
        let Some((_, meta)) = self.current().await? else {
            return Ok(Vec::new());
        };
        let Some(snapshot) = meta.current_snapshot() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for m in self.manifests(snapshot).await? {
            for e in self.entries(&m).await? {
                if e.status != EntryStatus::Deleted {
                    out.push(e.file);
                }
            }
        }
        Ok(out)
    }

    /// The key under the table of a URL the metadata records.
    pub fn key_of<'a>(&self, url: &'a str) -> &'a str {
        let base = self.location.url().trim_end_matches('/');
        url.strip_prefix(base)
            .map_or(url, |rest| rest.trim_start_matches('/'))
    }

    /// The manifests of a snapshot, from its manifest list.
    pub async fn manifests(&self, snapshot: &Snapshot) -> Result<Vec<ManifestFile>, IcebergError> {
        let body = self
            .location
            .get(self.key_of(&snapshot.manifest_list))
            .await?;
        read_manifest_list(&body)
    }

    /// The entries of a manifest.
    pub async fn entries(
        &self,
        manifest: &ManifestFile,
    ) -> Result<Vec<ManifestEntry>, IcebergError> {
        let body = self
            .location
            .get(self.key_of(&manifest.manifest_path))
            .await?;
        read_manifest(&body)
    }

    /// Commits `commit` as the partition's files: on top of the current
    /// version, trying again on top of the next one while it loses races.
    pub async fn commit(
        &self,
        def: &TableDef,
        commit: &Commit,
    ) -> Result<CommitOutcome, IcebergError> {
        self.commit_all(def, std::slice::from_ref(commit))
            .await?
            .pop()
            .unwrap_or(Err(IcebergError::Contended(0)))
    }

    /// Commits `commits` in one new metadata version, one snapshot each in
    /// their order (each judged against the table as the ones before it
    /// left it: already current, superseded, or committed), trying again on
    /// top of the next version while it loses races. One outcome per
    /// commit; `Err` for the whole when the table cannot be read or written.
    pub async fn commit_all(
        &self,
        def: &TableDef,
        commits: &[Commit],
    ) -> Result<Vec<Result<CommitOutcome, IcebergError>>, IcebergError> {
        for _ in 0..MAX_COMMIT_ATTEMPTS {
            let current = self.current().await?;
            let version = current.as_ref().map_or(0, |(v, _)| *v);
            let mut meta = current.map(|(_, m)| m);
            // The manifests of `meta`'s current snapshot once a commit of
            // this version wrote them (read from the store before).
            let mut manifests: Option<Vec<ManifestFile>> = None;
            let mut outcomes = Vec::with_capacity(commits.len());
            let mut added = 0usize;
            for commit in commits {
                let partition = match PartitionValue::of(def, &commit.partition_id) {
                    Ok(p) => p,
                    Err(e) => {
                        outcomes.push(Err(e));
                        continue;
                    }
                };
                if let Some(m) = &meta {
                    if let Some(done) = current_export(m, version, &commit.partition_id)? {
                        if done.holds(commit) {
                            outcomes.push(Ok(CommitOutcome::AlreadyCurrent { version }));
                            continue;
                        }
                        if done > CurrentExport::of(commit) {
                            outcomes.push(Ok(CommitOutcome::Superseded {
                                version,
                                current: done.transaction_id,
                            }));
                            continue;
                        }
                    }
                }
                let (next, next_manifests) = self
                    .next_snapshot(
                        def,
                        meta.take(),
                        manifests.take(),
                        commit,
                        &partition,
                        version,
                    )
                    .await?;
                outcomes.push(Ok(CommitOutcome::Committed {
                    version: version + 1,
                    snapshot_id: next.current_snapshot_id,
                }));
                meta = Some(next);
                manifests = Some(next_manifests);
                added += 1;
            }
            let Some(next) = meta.filter(|_| added > 0) else {
                return Ok(outcomes);
            };
            let body = serde_json::to_vec_pretty(&next).map_err(|e| IcebergError::Metadata {
                file: metadata_key(version + 1),
                reason: e.to_string(),
            })?;
            match self
                .location
                .put_create(&metadata_key(version + 1), Bytes::from(body))
                .await
            {
                Ok(()) => {
                    // A hint only: readers that list or are given the
                    // metadata file do not need it, so a failure here
                    // changes nothing committed.
                    let hint = Bytes::from((version + 1).to_string());
                    if let Err(e) = self.location.put(VERSION_HINT, hint).await {
                        tracing::warn!(error = %e, "version hint not written");
                    }
                    return Ok(outcomes);
                }
                Err(StorageError::AlreadyExists { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(IcebergError::Contended(MAX_COMMIT_ATTEMPTS))
    }

    /// `previous` (or a new table) with one snapshot more, for version
    /// `version + 1`: its manifests are the previous snapshot's
    /// (`previous_manifests` when known, else read) except the partition's,
    /// replaced by one manifest of its new files added and its old files
    /// deleted. Returns the metadata and the new snapshot's manifests.
    async fn next_snapshot(
        &self,
        def: &TableDef,
        previous: Option<TableMetadata>,
        previous_manifests: Option<Vec<ManifestFile>>,
        commit: &Commit,
        partition: &PartitionValue,
        version: u64,
    ) -> Result<(TableMetadata, Vec<ManifestFile>), IcebergError> {
        let table_schema = schema(def);
        let spec = partition_spec(def)?;
        let mut meta = match previous {
            Some(m) => m,
            None => TableMetadata {
                format_version: FORMAT_VERSION,
                table_uuid: uuid_of(self.location.url()),
                location: self.location.url().trim_end_matches('/').to_string(),
                last_sequence_number: 0,
                last_updated_ms: commit.timestamp_ms,
                last_column_id: table_schema.fields.iter().map(|f| f.id).max().unwrap_or(0),
                schemas: vec![table_schema.clone()],
                current_schema_id: 0,
                partition_specs: vec![spec.clone()],
                default_spec_id: 0,
                last_partition_id: crate::table::PARTITION_FIELD_ID,
                properties: BTreeMap::from([(
                    "write.format.default".to_string(),
                    "parquet".to_string(),
                )]),
                current_snapshot_id: -1,
                snapshots: Vec::new(),
                snapshot_log: Vec::new(),
                metadata_log: Vec::new(),
                sort_orders: vec![SortOrder {
                    order_id: 0,
                    fields: Vec::new(),
                }],
                default_sort_order_id: 0,
                refs: BTreeMap::new(),
            },
        };
        if meta.schema() != Some(&table_schema) {
            return Err(IcebergError::Table(format!(
                "the Iceberg table at {} has another schema than table {}",
                self.location.url(),
                def.name
            )));
        }
        let sequence = meta.last_sequence_number + 1;
        let snapshot_id = i64::try_from(derived_id(&[
            self.location.url(),
            &commit.transaction_id,
            &(version + 1).to_string(),
        ]))
        .unwrap_or(i64::MAX);
        let parent = meta.current_snapshot().cloned();
        let bound = partition.to_bytes();
        // Files of the commit the partition holds already (an increment
        // carries them): they stay, as existing entries with their first
        // snapshot and sequence numbers, instead of leaving and coming back.
        let listed: std::collections::BTreeSet<String> =
            commit.files.iter().map(|f| self.url_of(&f.path)).collect();
        let mut kept = Vec::new();
        let mut removed: Vec<ManifestEntry> = Vec::new();
        let mut existing: Vec<ManifestEntry> = Vec::new();
        if let Some(parent) = &parent {
            let parent_manifests = match previous_manifests {
                Some(known) => known,
                None => self.manifests(parent).await?,
            };
            for m in parent_manifests {
                if m.partition_bound != bound {
                    kept.push(m);
                    continue;
                }
                for e in self.entries(&m).await? {
                    if e.status == EntryStatus::Deleted {
                        continue;
                    }
                    let data_sequence = e.sequence_number.unwrap_or(m.sequence_number);
                    if listed.contains(&e.file.path) {
                        existing.push(ManifestEntry {
                            status: EntryStatus::Existing,
                            snapshot_id: e.snapshot_id.or(Some(m.added_snapshot_id)),
                            sequence_number: Some(data_sequence),
                            file_sequence_number: Some(
                                e.file_sequence_number.unwrap_or(data_sequence),
                            ),
                            file: e.file,
                        });
                        continue;
                    }
                    removed.push(ManifestEntry {
                        status: EntryStatus::Deleted,
                        snapshot_id: Some(snapshot_id),
                        sequence_number: Some(data_sequence),
                        file_sequence_number: Some(e.file_sequence_number.unwrap_or(data_sequence)),
                        file: e.file,
                    });
                }
            }
        }
        let stay: std::collections::BTreeSet<&str> =
            existing.iter().map(|e| e.file.path.as_str()).collect();
        let added: Vec<ManifestEntry> = commit
            .files
            .iter()
            .filter(|f| !stay.contains(self.url_of(&f.path).as_str()))
            .map(|f| ManifestEntry {
                status: EntryStatus::Added,
                snapshot_id: Some(snapshot_id),
                sequence_number: None,
                file_sequence_number: None,
                file: DataFileEntry {
                    path: self.url_of(&f.path),
                    partition: partition.clone(),
                    ..f.clone()
                },
            })
            .collect();
        let header = ManifestHeader {
            schema_json: serde_json::to_string(&table_schema).unwrap_or_default(),
            partition_spec_json: serde_json::to_string(&spec.fields).unwrap_or_default(),
            partition_name: partition_field_name(def),
            partition_type: partition_avro_type(def)?,
        };
        let entries: Vec<ManifestEntry> = added
            .iter()
            .chain(existing.iter())
            .chain(removed.iter())
            .cloned()
            .collect();
        let manifest = write_manifest(&header, &entries, marker(snapshot_id, 0))?;
        let manifest_key = format!(
            "{METADATA_DIR}/{}-{}-m0.avro",
            commit.transaction_id,
            version + 1
        );
        let manifest_length = manifest.len() as i64;
        self.location
            .put(&manifest_key, Bytes::from(manifest))
            .await?;
        let rows = |es: &[ManifestEntry]| es.iter().map(|e| e.file.record_count).sum::<i64>();
        let count = |es: &[ManifestEntry]| i32::try_from(es.len()).unwrap_or(i32::MAX);
        let mut manifests = kept;
        manifests.push(ManifestFile {
            manifest_path: self.url_of(&manifest_key),
            manifest_length,
            sequence_number: sequence,
            min_sequence_number: removed
                .iter()
                .chain(existing.iter())
                .filter_map(|e| e.sequence_number)
                .chain(std::iter::once(sequence))
                .min()
                .unwrap_or(sequence),
            added_snapshot_id: snapshot_id,
            added_files_count: count(&added),
            existing_files_count: count(&existing),
            deleted_files_count: count(&removed),
            added_rows_count: rows(&added),
            existing_rows_count: rows(&existing),
            deleted_rows_count: rows(&removed),
            partition_bound: bound,
        });
        let list = write_manifest_list(
            snapshot_id,
            parent.as_ref().map(|p| p.snapshot_id),
            sequence,
            &manifests,
            marker(snapshot_id, 1),
        )?;
        let list_key = format!(
            "{METADATA_DIR}/snap-{snapshot_id}-{}.avro",
            commit.transaction_id
        );
        self.location.put(&list_key, Bytes::from(list)).await?;
        let total_files: i64 = manifests
            .iter()
            .map(|m| i64::from(m.added_files_count) + i64::from(m.existing_files_count))
            .sum();
        let summary = BTreeMap::from([
            (
                "operation".to_string(),
                if removed.is_empty() {
                    "append"
                } else {
                    "overwrite"
                }
                .to_string(),
            ),
            (
                TRANSACTION_PROPERTY.to_string(),
                commit.transaction_id.clone(),
            ),
            (
                "ferry.partition-id".to_string(),
                commit.partition_id.clone(),
            ),
            (CONTENT_PROPERTY.to_string(), commit.content_id.clone()),
            ("added-data-files".to_string(), added.len().to_string()),
            ("deleted-data-files".to_string(), removed.len().to_string()),
            ("added-records".to_string(), rows(&added).to_string()),
            ("deleted-records".to_string(), rows(&removed).to_string()),
            ("total-data-files".to_string(), total_files.to_string()),
        ]);
        // The version this one follows, logged once (a version may add
        // several snapshots).
        let previous_file = self.url_of(&metadata_key(version));
        if version > 0 && meta.metadata_log.last().map(|e| &e.metadata_file) != Some(&previous_file)
        {
            meta.metadata_log.push(MetadataLogEntry {
                metadata_file: previous_file,
                timestamp_ms: meta.last_updated_ms,
            });
        }
        // Snapshot times never go back, whatever the committers' clocks.
        let timestamp_ms = commit.timestamp_ms.max(meta.last_updated_ms);
        meta.snapshots.push(Snapshot {
            snapshot_id,
            parent_snapshot_id: parent.as_ref().map(|p| p.snapshot_id),
            sequence_number: sequence,
            timestamp_ms,
            manifest_list: self.url_of(&list_key),
            summary,
            schema_id: 0,
        });
        meta.snapshot_log.push(SnapshotLogEntry {
            snapshot_id,
            timestamp_ms,
        });
        meta.current_snapshot_id = snapshot_id;
        meta.last_sequence_number = sequence;
        meta.last_updated_ms = timestamp_ms;
        meta.refs.insert(
            "main".into(),
            SnapshotRef {
                snapshot_id,
                kind: "branch".into(),
            },
        );
        meta.properties.insert(
            partition_property(&commit.partition_id),
            serde_json::to_string(&CurrentExport::of(commit)).unwrap_or_default(),
        );
        Ok((meta, manifests))
    }
}

/// The Avro sync marker of a snapshot's `n`th file.
fn marker(snapshot_id: i64, n: u8) -> [u8; 16] {
    let a = derived_id(&["marker", &snapshot_id.to_string(), &n.to_string()]);
    let b = derived_id(&["marker2", &snapshot_id.to_string(), &n.to_string()]);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&a.to_le_bytes());
    out[8..].copy_from_slice(&b.to_le_bytes());
    out
}

/// A UUID-shaped id derived from the table's URL.
fn uuid_of(url: &str) -> String {
    let a = derived_id(&["table", url]);
    let b = derived_id(&["uuid", url]);
    let hex = format!("{a:016x}{b:016x}");
    format!(
        "{}-{}-4{}-8{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[13..16],
        &hex[17..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_supersede_by_sequence_then_create_time_then_id() {
        let e = |sequence, create_time, id: &str| CurrentExport {
            sequence,
            create_time,
            transaction_id: id.into(),
            ..CurrentExport::default()
        };
        assert!(e(2, 1, "a") > e(1, 9, "z"));
        assert!(e(1, 2, "a") > e(1, 1, "z"));
        assert!(e(1, 1, "b") > e(1, 1, "a"));
        assert_eq!(version_of("metadata/v12.metadata.json"), Some(12));
        assert_eq!(version_of("metadata/v12.metadata.json.tmp"), None);
        assert_eq!(uuid_of("file:///x").len(), 36);
        assert_eq!(
            version_of("metadata/v18446744073709551615.metadata.json"),
            Some(u64::MAX)
        );
    }
}

/// Commits of one node to Iceberg tables, gathered per table: commits that
/// arrive while one is being written wait, and the next writer puts them all
/// into one metadata version (one snapshot each, in the order they came).
/// N exports of a table finishing at once then cost a few versions, not N
/// committers racing for each version (N² attempts). Commits of other nodes
/// still race as before: the queue only spares a node from racing itself.
#[derive(Default)]
pub struct CommitQueue {
    tables: std::sync::Mutex<BTreeMap<String, std::sync::Arc<TableQueue>>>,
}

#[derive(Default)]
struct TableQueue {
    waiting: std::sync::Mutex<Vec<Waiting>>,
    /// Held by the one committer writing a version of the table.
    writer: tokio::sync::Mutex<()>,
}

struct Waiting {
    commit: Commit,
    answer: tokio::sync::oneshot::Sender<Result<CommitOutcome, IcebergError>>,
}

/// Commits a queue gathers into one version at most (a bound on a version's
/// size and on the work one loss of a race throws away).
pub const MAX_COMMITS_PER_VERSION: usize = 256;

impl CommitQueue {
    pub fn new() -> CommitQueue {
        CommitQueue::default()
    }

    /// Commits `commit` to `table`, with whatever other commits of the same
    /// table (and definition) are waiting.
    pub async fn commit(
        &self,
        table: &IcebergTable,
        def: &TableDef,
        commit: Commit,
    ) -> Result<CommitOutcome, IcebergError> {
        let key = format!(
            "{}\n{}",
            table.location().url(),
            serde_json::to_string(def).unwrap_or_default()
        );
        let queue = {
            let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
            std::sync::Arc::clone(tables.entry(key).or_default())
        };
        let (answer, mut answered) = tokio::sync::oneshot::channel();
        queue
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Waiting { commit, answer });
        let _writer = queue.writer.lock().await;
        // A writer before this one may have taken this commit along.
        if let Ok(result) = answered.try_recv() {
            return result;
        }
        let batch: Vec<Waiting> = {
            let mut waiting = queue.waiting.lock().unwrap_or_else(|p| p.into_inner());
            let n = waiting.len().min(MAX_COMMITS_PER_VERSION);
            waiting.drain(..n).collect()
        };
        let commits: Vec<Commit> = batch.iter().map(|w| w.commit.clone()).collect();
        match table.commit_all(def, &commits).await {
            Ok(outcomes) => {
                for (w, outcome) in batch.into_iter().zip(outcomes) {
                    let _ = w.answer.send(outcome);
                }
            }
            Err(e) => {
                // One error for all: each waiter gets it in its own words.
                let retryable = e.is_retryable();
                let detail = e.to_string();
                for w in batch {
                    let _ = w.answer.send(Err(IcebergError::Batch {
                        detail: detail.clone(),
                        retryable,
                    }));
                }
            }
        }
        drop(_writer);
        answered.await.unwrap_or_else(|_| {
            Err(IcebergError::Batch {
                detail: "the commit was not written (its batch was abandoned)".into(),
                retryable: true,
            })
        })
    }
}
