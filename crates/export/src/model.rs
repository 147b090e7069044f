//! What an export task is in coordination: its layout, its immutable
//! metadata, its status and the entries replicas write while they work.
//!
//! Layout under a table's node (`/ferry/tables/<table>`):
//!
//! ```text
//! exports_cleanup_lock              ephemeral: the replica that commits leftovers, kills
//!                                   timed-out tasks and removes expired ones
//! exports/<partition>_<dest id>/    one task per (partition, destination); data = transaction id
//!     metadata.json                 immutable: identity, parts summary, every setting
//!     tx-<transaction id>           empty; every transaction of a worker checks it, so a
//!                                   worker acting on a task that a forced export replaced
//!                                   (same key, new transaction) changes nothing
//!     parts/<nnnnnn>                the snapshot's parts, in chunks of at most PARTS_CHUNK_BYTES
//!     status                        PENDING | COMPLETED | FAILED | KILLED, version 0 while PENDING
//!     processing                    data bumped by every finished part (progress watches)
//!     processing/<part>             a part not yet exported (empty; a claim sets it, so a
//!                                   claim of a part already exported fails at once)
//!     retries/<part>                {retry_count}: retryable failures of the part, all replicas
//!     processed/<part>              an exported part: {path, rows, bytes, checksum, finished_by}
//!     locks/<part>                  ephemeral claim, data = replica name
//!     commit_lock                   ephemeral: serialises commit, kill and timeout
//!     decision                      commit | kill | fail: how the task ends, created once,
//!                                   by a committer before its commit file, by a kill or a
//!                                   failure in the multi that sets status (task.rs)
//!     commit_info                   written with COMPLETED: the commit file's key
//!     exceptions                    data bumped by every exception recorded
//!     exceptions/<replica>          {part, message, time, count}
//! ```
//!
//! `status` is created at version 0 holding PENDING and is set exactly once,
//! to a terminal state, with a version check on 0: whoever sets it first
//! decides, and terminal states never change.
//!
//! In the destination (Hive layout): `<column>=<partition>/<part>_<checksum>.parquet`
//! data files, `commit_<partition>_<transaction>` commit files, and
//! `_ferry_schema.json`, the columns every file there has ([`SCHEMA_KEY`]).

use std::time::Duration;

use ferry_table::def::ColumnDef;
use serde::{Deserialize, Serialize};

/// Where tables live in coordination (the catalog's root).
pub const TABLES: &str = "/ferry/tables";

/// Largest `parts/<n>` chunk of the snapshot (ZooKeeper's default node limit
/// is 1 MiB; a chunk leaves room for the rest of a multi).
pub const PARTS_CHUNK_BYTES: usize = 256 << 10;

/// Most parts one export may name (a bound on every per-task structure).
pub const MAX_PARTS: usize = 1_000_000;

/// A request's fields that name places: refused unless they are plain.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{what} {value:?} is not allowed: {reason}")]
    Bad {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
}

/// Partition ids, table names and replica names reach coordination paths
/// and object keys: 1 to 128 characters of `[A-Za-z0-9_.-]`, not `.` or
/// `..` (partition ids as tables produce them are a subset).
pub fn check_name(what: &'static str, value: &str) -> Result<(), IdError> {
    let bad = |reason| IdError::Bad {
        what,
        value: value.chars().take(200).collect(),
        reason,
    };
    if value.is_empty() || value.len() > 128 {
        return Err(bad("must be 1 to 128 characters"));
    }
    if value == "." || value == ".." {
        return Err(bad("a relative path segment"));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err(bad("only letters, digits, '_', '.' and '-'"));
    }
    Ok(())
}

/// A transaction id: 13 digits of Unix milliseconds, '-', 16 hex digits of
/// randomness (sortable by time, unique without coordination).
pub fn transaction_id(unix_millis: u64, random: u64) -> String {
    format!("{unix_millis:013}-{random:016x}")
}

/// When a transaction was made (Unix milliseconds), if the id is well formed.
pub fn transaction_millis(id: &str) -> Option<u64> {
    check_transaction_id(id).ok()?;
    id[..13].parse().ok()
}

pub fn check_transaction_id(id: &str) -> Result<(), IdError> {
    let ok = id.len() == 30
        && id.as_bytes()[13] == b'-'
        && id[..13].bytes().all(|b| b.is_ascii_digit())
        && id[14..].bytes().all(|b| b.is_ascii_hexdigit());
    if ok {
        Ok(())
    } else {
        Err(IdError::Bad {
            what: "transaction id",
            value: id.chars().take(200).collect(),
            reason: "expected 13 digits, '-', 16 hex digits",
        })
    }
}

/// A destination's id in task keys: 16 hex digits derived from its URL, so
/// one partition exported to two destinations gives two tasks.
pub fn destination_id(url: &str) -> String {
    let a = crc32c::crc32c(url.as_bytes());
    let b = crc32c::crc32c_append(a ^ 0x9e37_79b9, url.as_bytes());
    format!("{a:08x}{b:08x}")
}

/// The task of a (table, partition, destination).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TaskKey {
    pub table: String,
    /// `<partition_id>_<destination id>`.
    pub key: String,
}

impl TaskKey {
    pub fn new(table: &str, partition_id: &str, destination_url: &str) -> TaskKey {
        TaskKey {
            table: table.to_string(),
            key: format!("{partition_id}_{}", destination_id(destination_url)),
        }
    }

    pub fn path(&self) -> String {
        format!("{}/{}", exports_path(&self.table), self.key)
    }
}

impl std::fmt::Display for TaskKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.table, self.key)
    }
}

/// The node that fences a task's transaction (see the layout).
pub fn fence_path(task_path: &str, transaction_id: &str) -> String {
    format!("{task_path}/tx-{transaction_id}")
}

pub fn table_path(table: &str) -> String {
    format!("{TABLES}/{table}")
}

/// Present (ephemeral) while a node removes orphan files from the
/// destination `destination_url`: no task for it may be created meanwhile
/// (a task may reuse a file already there, which the removal could delete
/// before the task's commit lists it). See `policy::remove_orphans`.
pub fn lake_upkeep_path(table: &str, destination_url: &str) -> String {
    format!(
        "{TABLES}/{table}/lake-upkeep-{}",
        destination_id(destination_url)
    )
}

pub fn exports_path(table: &str) -> String {
    format!("{TABLES}/{table}/exports")
}

pub fn cleanup_lock_path(table: &str) -> String {
    format!("{TABLES}/{table}/exports_cleanup_lock")
}

/// What a data file already at its key means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileExistsPolicy {
    /// Keep it: its name holds the rows checksum, so it holds the same rows.
    #[default]
    Skip,
    /// Fail the task (non-retryable).
    Error,
    /// Write the file again.
    Overwrite,
}

impl std::str::FromStr for FileExistsPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "skip" => Ok(FileExistsPolicy::Skip),
            "error" => Ok(FileExistsPolicy::Error),
            "overwrite" => Ok(FileExistsPolicy::Overwrite),
            other => Err(format!(
                "file-exists policy {other:?}: expected skip, error or overwrite"
            )),
        }
    }
}

pub use ferry_table::def::LakeFormat;

/// Parquet compression of exported files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// zstd level 1, as parts are written: parts are copied byte for byte.
    #[default]
    Zstd,
    Snappy,
    Lz4,
    None,
}

impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "zstd" => Ok(Compression::Zstd),
            "snappy" => Ok(Compression::Snappy),
            "lz4" => Ok(Compression::Lz4),
            "none" => Ok(Compression::None),
            other => Err(format!(
                "compression {other:?}: expected zstd, snappy, lz4 or none"
            )),
        }
    }
}

/// Every setting that shapes an export, captured at request time in
/// metadata.json and used by every replica that works on the task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportSettings {
    /// From create_time; past it the cleanup holder KILLs the task (0: never).
    pub task_timeout_seconds: u64,
    /// A terminal task is removed this long after create_time.
    pub ttl_seconds: u64,
    /// Per-replica back-off of a part after a retryable error.
    pub retry_initial_backoff_ms: u64,
    pub retry_max_backoff_ms: u64,
    /// Retryable failures of one part (over all replicas) before the task is
    /// FAILED; 0: unlimited (the task timeout is then the bound).
    pub max_retries: u32,
    /// Parts one replica exports at once for this task.
    pub parallelism: u32,
    pub compression: Compression,
    /// Rows per row group of exported files.
    pub row_group_rows: u64,
    pub file_exists: FileExistsPolicy,
    /// The destination's format: in a request, `None` takes the table's
    /// (`[export] format`, else Parquet); a task's metadata holds the one
    /// chosen (tasks created before it existed: none, Parquet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<LakeFormat>,
}

impl Default for ExportSettings {
    fn default() -> Self {
        ExportSettings {
            task_timeout_seconds: 3600,
            ttl_seconds: 180,
            retry_initial_backoff_ms: 5_000,
            retry_max_backoff_ms: 300_000,
            max_retries: 0,
            parallelism: 2,
            compression: Compression::Zstd,
            row_group_rows: ferry_replica::part::ROW_GROUP_ROWS as u64,
            file_exists: FileExistsPolicy::Skip,
            format: None,
        }
    }
}

/// Settings out of their bounds, refused before anything is created.
pub const MAX_PARALLELISM: u32 = 64;

impl ExportSettings {
    pub fn check(&self) -> Result<(), String> {
        if self.parallelism == 0 || self.parallelism > MAX_PARALLELISM {
            return Err(format!("parallelism must be 1 to {MAX_PARALLELISM}"));
        }
        if self.retry_initial_backoff_ms == 0
            || self.retry_max_backoff_ms < self.retry_initial_backoff_ms
        {
            return Err("back-off bounds: 0 < initial <= max".into());
        }
        if !(1024..=(1 << 24)).contains(&self.row_group_rows) {
            return Err("row_group_rows must be 1024 to 16777216".into());
        }
        if self.ttl_seconds == 0 {
            return Err("ttl_seconds must be positive".into());
        }
        Ok(())
    }

    /// The destination's format ([`ExportSettings::format`]).
    pub fn format(&self) -> LakeFormat {
        self.format.unwrap_or_default()
    }

    /// Whether exported files are the parts' own bytes (for an Iceberg
    /// table, up to the footer, which is written again with field ids).
    pub fn copies_parts(&self) -> bool {
        self.compression == Compression::Zstd
            && self.row_group_rows == ferry_replica::part::ROW_GROUP_ROWS as u64
    }

    pub fn backoff(&self, attempts: u32) -> Duration {
        let ms = self
            .retry_initial_backoff_ms
            .saturating_mul(1u64 << attempts.saturating_sub(1).min(30))
            .min(self.retry_max_backoff_ms);
        Duration::from_millis(ms)
    }
}

/// A part of the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SnapshotPart {
    pub name: String,
    pub rows: u64,
    pub checksum: u32,
    /// The shard of the replica that listed it (`None`: a replica of every
    /// shard): which block ranges it nests with ([`crate::increment`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
}

/// metadata.json: immutable once the task exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metadata {
    pub format: u32,
    pub transaction_id: String,
    pub table: String,
    pub table_id: u64,
    pub partition_id: String,
    /// The Hive directory of the partition: `<column>=<id>`.
    pub partition_dir: String,
    pub destination: String,
    pub source_replica: String,
    /// Unix seconds.
    pub create_time: u64,
    /// The commit position every acknowledged insert was below when the
    /// request arrived; the snapshot includes all of it.
    pub snapshot_lsn: u64,
    pub parts_count: u64,
    pub rows: u64,
    /// `parts/<n>` chunks holding the snapshot.
    pub parts_chunks: u32,
    pub settings: ExportSettings,
    /// The table's columns at request time: the schema every data file of
    /// the export has, checked against the destination's schema marker.
    #[serde(default)]
    pub columns: Vec<ColumnDef>,
    /// The position of this export among the partition's commits in the
    /// destination: one more than the current commit's when the task was
    /// created (see [`crate::lake`]); 0 for tasks created before it existed.
    #[serde(default)]
    pub sequence: u64,
    /// [`content_id`] of the snapshot.
    #[serde(default)]
    pub content_id: String,
    /// The table's definition at request time: an Iceberg destination's
    /// schema and partition spec come from it (absent in tasks created
    /// before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub definition: Option<ferry_table::TableDef>,
    /// Of `parts_count`, the current commit's files this export carries
    /// into its commit (an increment, [`crate::increment`]): processed at
    /// creation, never exported again.
    #[serde(default)]
    pub carried: u64,
    /// Asked by the table's export policy, not by a request.
    #[serde(default)]
    pub by_policy: bool,
}

pub const METADATA_FORMAT: u32 = 1;

/// What an export holds, as an id: a digest of the table, the partition
/// and every snapshot part's name and rows checksum (in name order). Two
/// exports with the same id write the same files, so a request whose
/// content the partition's current commit already has is a no-op.
pub fn content_id(table: &str, partition_id: &str, parts: &[SnapshotPart]) -> String {
    use sha2::Digest;
    let mut sorted: Vec<&SnapshotPart> = parts.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut h = sha2::Sha256::new();
    for field in [table, partition_id] {
        h.update((field.len() as u64).to_le_bytes());
        h.update(field.as_bytes());
    }
    for p in sorted {
        h.update((p.name.len() as u64).to_le_bytes());
        h.update(p.name.as_bytes());
        h.update(p.checksum.to_le_bytes());
        h.update(p.rows.to_le_bytes());
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A task's state; terminal ones never change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum TaskStatus {
    Pending,
    Completed,
    Failed,
    Killed,
}

impl TaskStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskStatus::Pending => "PENDING",
            TaskStatus::Completed => "COMPLETED",
            TaskStatus::Failed => "FAILED",
            TaskStatus::Killed => "KILLED",
        }
    }

    pub fn parse(s: &[u8]) -> Option<TaskStatus> {
        match s {
            b"PENDING" => Some(TaskStatus::Pending),
            b"COMPLETED" => Some(TaskStatus::Completed),
            b"FAILED" => Some(TaskStatus::Failed),
            b"KILLED" => Some(TaskStatus::Killed),
            _ => None,
        }
    }

    pub fn is_terminal(self) -> bool {
        self != TaskStatus::Pending
    }
}

impl std::fmt::Display for TaskStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `retries/<part>`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retries {
    pub retry_count: u32,
}

/// A data file in the destination, as `processed/<part>` and the commit file
/// list it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DataFile {
    /// Key relative to the destination.
    pub path: String,
    pub rows: u64,
    pub bytes: u64,
    /// The rows checksum (ferry_replica::checksum), as in the file's footer.
    pub checksum: u32,
    /// The shard whose replica wrote the part (absent in files exported
    /// before it was recorded): block ranges of one shard's files never
    /// overlap, those of different shards may.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    /// crc32c of the whole file as written (absent in files exported before
    /// it was recorded): `ferry verify` reads every byte against it, so a
    /// file changed anywhere (not only in its footer) is found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
    /// For an Iceberg destination: what its manifest entry records (rows,
    /// size, column statistics), so that the commit needs only these
    /// records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iceberg: Option<ferry_iceberg::FileStats>,
}

/// `processed/<part>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Processed {
    pub file: DataFile,
    pub finished_by: String,
}

/// `exceptions/<replica>`: the last one and how many.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExceptionRecord {
    pub part: String,
    pub message: String,
    /// Unix seconds.
    pub time: u64,
    pub count: u64,
}

/// The commit file `commit_<partition>_<transaction>`: every data file of
/// the export. A reader reads the files of the partition's current commit
/// (the highest `sequence`) and nothing else: older commits of the
/// partition are superseded, their files kept for readers still on them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitFile {
    pub format: u32,
    pub transaction_id: String,
    pub table: String,
    pub partition_id: String,
    pub create_time: u64,
    pub rows: u64,
    /// Sorted by path.
    pub files: Vec<DataFile>,
    /// The columns of every listed file (the task's `columns`).
    #[serde(default)]
    pub columns: Vec<ColumnDef>,
    /// The export's place among the partition's commits: the commit with
    /// the highest sequence is the partition's current one, the only one a
    /// reader reads ([`crate::lake`]). 0 in commit files of format 1.
    #[serde(default)]
    pub sequence: u64,
    /// The commit position the snapshot included everything below.
    #[serde(default)]
    pub snapshot_lsn: u64,
    /// [`content_id`] of the export's parts.
    #[serde(default)]
    pub content_id: String,
}

/// Format 2 adds `sequence`, `snapshot_lsn` and `content_id`.
pub const COMMIT_FORMAT: u32 = 2;

/// The destination's schema marker, `_ferry_schema.json` under its prefix:
/// written create-only by the first export into the destination, so every
/// later export (of any partition, from any table) must have the same
/// columns; a different schema fails the export instead of mixing files a
/// reader could not read as one dataset.
pub const SCHEMA_KEY: &str = "_ferry_schema.json";

/// The body of [`SCHEMA_KEY`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DestinationSchema {
    pub format: u32,
    /// The table of the export that wrote the marker (for the operator).
    pub table: String,
    pub columns: Vec<ColumnDef>,
    /// What the destination is (markers written before it was recorded:
    /// Parquet): exports of another format are refused.
    #[serde(default)]
    pub lake_format: LakeFormat,
}

pub const SCHEMA_FORMAT: u32 = 1;

/// Why `found` (the destination's columns) differs from `wanted`, or `None`
/// when they are the same.
pub fn schema_difference(wanted: &[ColumnDef], found: &[ColumnDef]) -> Option<String> {
    let show = |c: &ColumnDef| {
        format!(
            "{} {}{}",
            c.name,
            c.column_type.name(),
            if c.nullable { " (nullable)" } else { "" }
        )
    };
    for (i, (w, f)) in wanted.iter().zip(found).enumerate() {
        if w != f {
            return Some(format!(
                "column {i} is {} in the destination, {} in the export",
                show(f),
                show(w)
            ));
        }
    }
    match wanted.len().cmp(&found.len()) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Less => Some(format!(
            "the destination has {} columns, the export {} (first missing: {})",
            found.len(),
            wanted.len(),
            show(&found[wanted.len()])
        )),
        std::cmp::Ordering::Greater => Some(format!(
            "the destination has {} columns, the export {} (first extra: {})",
            found.len(),
            wanted.len(),
            show(&wanted[found.len()])
        )),
    }
}

pub fn commit_key(partition_id: &str, transaction_id: &str) -> String {
    format!("commit_{partition_id}_{transaction_id}")
}

/// Splits the snapshot into `parts/<n>` chunks of at most
/// [`PARTS_CHUNK_BYTES`] of JSON each.
pub fn chunk_parts(parts: &[SnapshotPart]) -> Vec<Vec<u8>> {
    let mut chunks = Vec::new();
    let mut current: Vec<&SnapshotPart> = Vec::new();
    let mut bytes = 2usize;
    for p in parts {
        // name, rows and checksum in JSON, with room for the quoting.
        let size = p.name.len() + 64;
        if !current.is_empty() && bytes + size > PARTS_CHUNK_BYTES {
            chunks.push(serde_json::to_vec(&current).expect("parts serialise"));
            current.clear();
            bytes = 2;
        }
        current.push(p);
        bytes += size;
    }
    if !current.is_empty() || chunks.is_empty() {
        chunks.push(serde_json::to_vec(&current).expect("parts serialise"));
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_could_escape_are_refused() {
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "a\\b",
            "a b",
            "x\0",
            "é",
            &"a".repeat(129),
        ] {
            assert!(check_name("partition id", bad).is_err(), "{bad:?}");
        }
        for good in ["2024", "x", "-5", "a.b_c-d", "20240105"] {
            check_name("partition id", good).expect(good);
        }
        let tx = transaction_id(1_700_000_000_000, 0xdead_beef);
        check_transaction_id(&tx).expect("well formed");
        for bad in [
            "",
            "../x",
            "1700000000000_00000000deadbeef",
            &format!("{tx}0"),
        ] {
            assert!(check_transaction_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn destination_ids_differ_by_url() {
        assert_ne!(destination_id("s3://a/x"), destination_id("s3://a/y"));
        assert_eq!(destination_id("s3://a/x").len(), 16);
    }

    #[test]
    fn snapshot_chunks_stay_under_the_bound() {
        let parts: Vec<SnapshotPart> = (0..20_000)
            .map(|i| SnapshotPart {
                name: format!("2024_{i}_{i}_0"),
                rows: 1,
                checksum: i,
                shard: Some(i % 4),
            })
            .collect();
        let chunks = chunk_parts(&parts);
        assert!(chunks.len() > 1);
        let mut back = Vec::new();
        for c in &chunks {
            assert!(c.len() <= PARTS_CHUNK_BYTES, "{}", c.len());
            back.extend(serde_json::from_slice::<Vec<SnapshotPart>>(c).expect("json"));
        }
        assert_eq!(back, parts);
    }

    #[test]
    fn backoff_doubles_within_bounds() {
        let s = ExportSettings {
            retry_initial_backoff_ms: 100,
            retry_max_backoff_ms: 1000,
            ..ExportSettings::default()
        };
        let b: Vec<u64> = (1..7).map(|a| s.backoff(a).as_millis() as u64).collect();
        assert_eq!(b, vec![100, 200, 400, 800, 1000, 1000]);
    }
}
