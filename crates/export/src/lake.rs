//! What a lake reader reads: of every partition in a destination, the files
//! of its current commit and nothing else.
//!
//! Every export of a partition writes its own commit file
//! (`commit_<partition>_<transaction>`), and a re-export lists files that
//! cover the same rows as the commit before it (level-1 parts then, the
//! merged level-2 part now). So a reader must never take the union of
//! commit files: it takes, per partition, the commit with the highest
//! `sequence` and reads exactly the files that commit lists.
//!
//! Why one commit per partition is enough and never misses a row
//! (enforced in `request.rs`): a task's sequence is one more than the
//! partition's current commit when the task is created, and only one task
//! per (table, partition, destination) lives at a time (a forced export
//! ends the old one, under its commit lock, before it reads the current
//! commit), so sequences grow with time; and a request whose snapshot does
//! not hold every block of the current commit is refused, so each commit
//! holds at least the rows of the one it supersedes. Ties (commit files of
//! format 1, sequence 0) fall back to create time, then transaction id, so
//! every reader picks the same commit.

use std::collections::BTreeMap;

use ferry_replica::PartName;
use ferry_storage::{Location, StorageError};
use serde::Serialize;

use crate::model::{CommitFile, DataFile, LakeFormat};
use ferry_table::TableDef;

/// A commit file read from the destination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Commit {
    /// Its key in the destination.
    pub key: String,
    pub file: CommitFile,
}

impl Commit {
    /// The order in which commits of one partition supersede each other.
    fn rank(&self) -> (u64, u64, &str) {
        (
            self.file.sequence,
            self.file.create_time,
            &self.file.transaction_id,
        )
    }
}

/// One partition of a destination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PartitionCommits {
    pub partition_id: String,
    /// The commit a reader reads.
    pub current: Commit,
    /// Older commits, newest first: their files are no longer current.
    pub superseded: Vec<Commit>,
}

/// The commits of a destination, by partition; commit files that do not
/// parse are named in `unreadable` (a reader cannot tell what they hold).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LakeView {
    pub partitions: Vec<PartitionCommits>,
    pub unreadable: Vec<(String, String)>,
}

impl LakeView {
    /// The files a reader reads now, with the partition each belongs to.
    pub fn current_files(&self) -> impl Iterator<Item = (&str, &DataFile)> {
        self.partitions.iter().flat_map(|p| {
            p.current
                .file
                .files
                .iter()
                .map(move |f| (p.partition_id.as_str(), f))
        })
    }
}

/// Whether a top-level key is a commit file's.
pub fn is_commit_key(key: &str) -> bool {
    key.starts_with("commit_") && !key.contains('/')
}

/// Reads every commit file of `location` (of one partition with
/// `partition`) and picks each partition's current one.
pub async fn read(location: &Location, partition: Option<&str>) -> Result<LakeView, StorageError> {
    let mut by_partition: BTreeMap<String, Vec<Commit>> = BTreeMap::new();
    let mut view = LakeView::default();
    for (key, _) in location.list_top().await? {
        if !is_commit_key(&key) {
            continue;
        }
        // The name starts with the partition id; the body says it exactly.
        if let Some(p) = partition {
            if !key.starts_with(&format!("commit_{p}_")) {
                continue;
            }
        }
        let body = match location.get(&key).await {
            Ok(body) => body,
            // Expired since the listing (upkeep): a superseded commit.
            Err(StorageError::NotFound { .. }) => continue,
            Err(e) => return Err(e),
        };
        match serde_json::from_slice::<CommitFile>(&body) {
            Ok(file) => {
                if partition.is_some_and(|p| p != file.partition_id) {
                    continue;
                }
                by_partition
                    .entry(file.partition_id.clone())
                    .or_default()
                    .push(Commit { key, file });
            }
            Err(e) => view.unreadable.push((key, e.to_string())),
        }
    }
    for (partition_id, mut commits) in by_partition {
        commits.sort_by(|a, b| b.rank().cmp(&a.rank()));
        let mut commits = commits.into_iter();
        let Some(current) = commits.next() else {
            continue;
        };
        view.partitions.push(PartitionCommits {
            partition_id,
            current,
            superseded: commits.collect(),
        });
    }
    Ok(view)
}

/// A partition's current export in a destination of either format: what a
/// new export of the partition must supersede.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentCommit {
    /// The commit file's key, or the Iceberg metadata version's.
    pub key: String,
    pub transaction_id: String,
    pub content_id: String,
    pub sequence: u64,
    pub snapshot_lsn: u64,
    pub rows: u64,
    /// When the export that made it was created (unix seconds).
    pub create_time: u64,
    /// The paths of its data files (keys, or an Iceberg table's URLs).
    pub files: Vec<String>,
    /// Its data files as a commit of it would list them again (keys
    /// relative to the destination; an Iceberg file's manifest statistics,
    /// its shard unknown).
    pub data_files: Vec<DataFile>,
}

/// The partition's current export in `location`, a destination of
/// `format` holding table `def`.
pub async fn current_commit(
    location: &Location,
    format: LakeFormat,
    def: &TableDef,
    partition_id: &str,
) -> Result<Option<CurrentCommit>, String> {
    match format {
        LakeFormat::Parquet => {
            let view = read(location, Some(partition_id))
                .await
                .map_err(|e| e.to_string())?;
            Ok(view.partitions.into_iter().next().map(|p| {
                let c = p.current;
                CurrentCommit {
                    files: c.file.files.iter().map(|f| f.path.clone()).collect(),
                    data_files: c.file.files.clone(),
                    key: c.key,
                    transaction_id: c.file.transaction_id,
                    content_id: c.file.content_id,
                    sequence: c.file.sequence,
                    snapshot_lsn: c.file.snapshot_lsn,
                    rows: c.file.rows,
                    create_time: c.file.create_time,
                }
            }))
        }
        LakeFormat::Iceberg => {
            let table = ferry_iceberg::IcebergTable::new(location.clone());
            let Some((version, export)) = table
                .current_export(partition_id)
                .await
                .map_err(|e| e.to_string())?
            else {
                return Ok(None);
            };
            let value =
                ferry_iceberg::PartitionValue::of(def, partition_id).map_err(|e| e.to_string())?;
            let files = table
                .files()
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .filter(|f| f.partition == value)
                .collect::<Vec<_>>();
            // The shards the export recorded beside the metadata (absent for
            // tables written before they were: unknown, so a sharded
            // snapshot gets a whole export).
            let shards: BTreeMap<String, Option<u32>> = match location
                .get(&iceberg_shards_key(&export.transaction_id))
                .await
            {
                Ok(body) => serde_json::from_slice::<IcebergShards>(&body)
                    .map(|s| s.files.into_iter().collect())
                    .unwrap_or_default(),
                Err(StorageError::NotFound { .. }) => BTreeMap::new(),
                Err(e) => return Err(e.to_string()),
            };
            let data_files = files
                .iter()
                .map(|f| DataFile {
                    path: table.key_of(&f.path).to_string(),
                    rows: u64::try_from(f.record_count).unwrap_or(0),
                    bytes: u64::try_from(f.file_size_in_bytes).unwrap_or(0),
                    checksum: checksum_of(&f.path).unwrap_or(0),
                    shard: shards.get(table.key_of(&f.path)).copied().flatten(),
                    crc32c: None,
                    iceberg: Some(f.stats()),
                })
                .collect();
            let files = files.into_iter().map(|f| f.path).collect();
            Ok(Some(CurrentCommit {
                data_files,
                key: ferry_iceberg::commit::metadata_key(version),
                transaction_id: export.transaction_id,
                content_id: export.content_id,
                sequence: export.sequence,
                snapshot_lsn: export.snapshot_lsn,
                rows: export.rows,
                create_time: export.create_time,
                files,
            }))
        }
    }
}

/// The part a data file holds, from its name `<part>_<checksum>.parquet`.
/// An Iceberg export's data files with the shard of the replica that wrote
/// each, which Iceberg manifests do not record: `metadata/ferry-shards-<transaction>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct IcebergShards {
    pub transaction_id: String,
    /// Data file keys (relative to the table) and their shards.
    pub files: Vec<(String, Option<u32>)>,
}

pub fn iceberg_shards_key(transaction_id: &str) -> String {
    format!("metadata/ferry-shards-{transaction_id}.json")
}

/// The rows checksum in a data file's name (`<part>_<checksum:08x>.parquet`).
pub fn checksum_of(path: &str) -> Option<u32> {
    let file = path.rsplit('/').next()?.strip_suffix(".parquet")?;
    let (_, checksum) = file.rsplit_once('_')?;
    u32::from_str_radix(checksum, 16).ok()
}

pub fn part_of(path: &str) -> Option<PartName> {
    let file = path.rsplit('/').next()?.strip_suffix(".parquet")?;
    let (part, _) = file.rsplit_once('_')?;
    PartName::parse(part)
}

/// Pairs of files of one commit that hold the same blocks: a block is in
/// exactly one part, so its first and last block (which a part always
/// holds) may appear in no other file, and the block ranges of two files
/// of one shard may not intersect. Names the pairs, with the reason.
pub fn overlaps(files: &[DataFile]) -> Vec<String> {
    let mut named: Vec<(&DataFile, PartName)> = Vec::with_capacity(files.len());
    let mut out = Vec::new();
    for f in files {
        match part_of(&f.path) {
            Some(n) => named.push((f, n)),
            None => out.push(format!("{}: not a ferry data file name", f.path)),
        }
    }
    // The endpoints: sorted, so that a shared one is found next to itself.
    let mut ends: Vec<(u64, usize)> = named
        .iter()
        .enumerate()
        .flat_map(|(i, (_, n))| {
            let both = [(n.min_block, i), (n.max_block, i)];
            let one = usize::from(n.min_block == n.max_block);
            both.into_iter().skip(one)
        })
        .collect();
    ends.sort();
    for w in ends.windows(2) {
        let ((a, i), (b, j)) = (w[0], w[1]);
        if a == b && i != j {
            out.push(format!(
                "{} and {} both hold block {a}",
                named[i].0.path, named[j].0.path
            ));
        }
    }
    // Ranges within one shard, sorted by their first block.
    let mut by_shard: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, (f, _)) in named.iter().enumerate() {
        if let Some(s) = f.shard {
            by_shard.entry(s).or_default().push(i);
        }
    }
    for (shard, mut idx) in by_shard {
        idx.sort_by_key(|&i| named[i].1.min_block);
        for w in idx.windows(2) {
            let (a, b) = (&named[w[0]], &named[w[1]]);
            if b.1.min_block < a.1.max_block {
                out.push(format!(
                    "{} and {} of shard {shard} cover overlapping blocks ({}..={} and {}..={})",
                    a.0.path, b.0.path, a.1.min_block, a.1.max_block, b.1.min_block, b.1.max_block
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, shard: Option<u32>) -> DataFile {
        DataFile {
            path: path.into(),
            rows: 1,
            bytes: 1,
            checksum: 0,
            shard,
            crc32c: None,
            iceberg: None,
        }
    }

    #[test]
    fn files_of_one_commit_never_share_a_block() {
        // Two shards interleave their block numbers: fine.
        let ok = [
            file("p=1/1_10_50_1_00000000.parquet", Some(0)),
            file("p=1/1_20_30_1_00000000.parquet", Some(1)),
            file("p=1/1_60_60_0_00000000.parquet", Some(0)),
        ];
        assert_eq!(overlaps(&ok), Vec::<String>::new());
        // The level-1 parts and the level-2 part merged from them.
        let merged = [
            file("p=1/1_10_10_0_00000000.parquet", Some(0)),
            file("p=1/1_20_20_0_00000000.parquet", Some(0)),
            file("p=1/1_10_20_1_00000000.parquet", Some(0)),
        ];
        let found = overlaps(&merged);
        assert!(
            found.iter().any(|m| m.contains("both hold block 10")),
            "{found:?}"
        );
        assert!(
            found.iter().any(|m| m.contains("both hold block 20")),
            "{found:?}"
        );
        // Without shards, shared endpoints are still found.
        let old = [
            file("p=1/1_10_40_1_00000000.parquet", None),
            file("p=1/1_40_40_0_00000000.parquet", None),
        ];
        assert_eq!(overlaps(&old).len(), 1);
        // One shard, ranges that cross without sharing an endpoint.
        let crossing = [
            file("p=1/1_10_40_1_00000000.parquet", Some(2)),
            file("p=1/1_30_50_1_00000000.parquet", Some(2)),
        ];
        let found = overlaps(&crossing);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("of shard 2"), "{found:?}");
    }
}
