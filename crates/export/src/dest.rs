//! The destination: a Hive-layout folder of Parquet files with commit files,
//! on any `ferry_storage::Location` (a local folder or S3).
//!
//! The commit step is behind [`Destination::commit`] so that another table
//! format (Iceberg: manifests and a new metadata version written
//! create-only) can take the Hive commit file's place; every data file's
//! rows, bytes and checksum are recorded in coordination, so a commit never
//! needs the source parts again.

use std::sync::Arc;

use bytes::Bytes;
use ferry_env::{Cpu, Disk};
use ferry_replica::part::{FileLayout, PartCheck, PartEncoder, PartReader};
use ferry_replica::{PartMeta, PartName};
use ferry_storage::{Location, StorageError, UploadBudget};

use crate::model::{
    commit_key, schema_difference, CommitFile, Compression, DataFile, DestinationSchema,
    ExportSettings, FileExistsPolicy, LakeFormat, Metadata, SCHEMA_FORMAT, SCHEMA_KEY,
};
use ferry_table::def::ColumnDef;

/// Bytes read from a part file per disk read when a part is copied as is.
pub const COPY_CHUNK_BYTES: usize = 8 << 20;

/// Why one part could not be exported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartFailure {
    /// Network, storage outage, a damaged local copy: retried after a
    /// back-off on this replica, by any replica.
    #[error("{0}")]
    Retryable(String),
    /// Cannot succeed however often tried: the task becomes FAILED.
    #[error("{0}")]
    Fatal(String),
}

impl PartFailure {
    pub fn class(&self) -> &'static str {
        match self {
            PartFailure::Retryable(_) => "retryable",
            PartFailure::Fatal(_) => "fatal",
        }
    }
}

/// Classifies a storage error of a data-file or commit write.
pub fn classify(e: &StorageError) -> PartFailure {
    if e.is_permanent() {
        PartFailure::Fatal(e.to_string())
    } else {
        PartFailure::Retryable(e.to_string())
    }
}

/// A part on a local disk to export.
pub struct SourcePart {
    pub disk: Arc<dyn Disk>,
    pub path: String,
    pub meta: PartMeta,
    /// The shard of the replica holding it, recorded in the data file's
    /// entry (`None` for a replica of every shard).
    pub shard: Option<u32>,
}

/// An export destination (Hive layout, or an Iceberg table).
#[derive(Clone)]
pub struct Destination {
    location: Location,
    /// The node's Iceberg commits, gathered per table (without one, each
    /// commit races for its own version).
    commits: Option<Arc<ferry_iceberg::CommitQueue>>,
}

impl Destination {
    pub fn new(location: Location) -> Destination {
        Destination {
            location,
            commits: None,
        }
    }

    /// Commits to an Iceberg table go through `queue`.
    pub fn with_commit_queue(self, queue: Arc<ferry_iceberg::CommitQueue>) -> Destination {
        Destination {
            commits: Some(queue),
            ..self
        }
    }

    pub fn url(&self) -> &str {
        self.location.url()
    }

    pub fn location(&self) -> &Location {
        &self.location
    }

    /// Checks that the destination is reachable and writable: a probe object
    /// written create-only and deleted.
    pub async fn probe(&self, transaction_id: &str) -> Result<(), StorageError> {
        let key = format!("_ferry_probe_{transaction_id}");
        self.location
            .put_create(&key, Bytes::from_static(b"ferry export probe"))
            .await?;
        self.location.delete(&key).await
    }

    /// The destination's schema marker, if an export wrote one; a marker
    /// that does not parse fails for good (nobody can tell what the
    /// destination's files hold).
    pub async fn schema(&self) -> Result<Option<DestinationSchema>, PartFailure> {
        match self.location.get(SCHEMA_KEY).await {
            Ok(body) => serde_json::from_slice(&body).map(Some).map_err(|e| {
                PartFailure::Fatal(format!(
                    "the schema marker {SCHEMA_KEY} of {} is damaged: {e}",
                    self.url()
                ))
            }),
            Err(StorageError::NotFound { .. }) => Ok(None),
            Err(e) => Err(classify(&e)),
        }
    }

    /// Makes sure the destination's schema is `columns`: writes the marker
    /// create-only when there is none (racing writers of one schema all
    /// succeed), and fails for good when it holds other columns. An export
    /// without columns (a task created before they were recorded) is not
    /// checked.
    pub async fn claim_schema(
        &self,
        table: &str,
        columns: &[ColumnDef],
        format: LakeFormat,
    ) -> Result<(), PartFailure> {
        if columns.is_empty() {
            return Ok(());
        }
        let found = match self.schema().await? {
            Some(found) => found,
            None => {
                let marker = DestinationSchema {
                    format: SCHEMA_FORMAT,
                    table: table.to_string(),
                    columns: columns.to_vec(),
                    lake_format: format,
                };
                let body = serde_json::to_vec_pretty(&marker).expect("schema marker serialises");
                match self
                    .location
                    .put_create(SCHEMA_KEY, Bytes::from(body))
                    .await
                {
                    Ok(()) => return Ok(()),
                    Err(StorageError::AlreadyExists { .. }) => {
                        self.schema().await?.ok_or_else(|| {
                            PartFailure::Retryable(format!("{SCHEMA_KEY} exists and then did not"))
                        })?
                    }
                    Err(e) => return Err(classify(&e)),
                }
            }
        };
        match schema_difference(columns, &found.columns) {
            None if found.lake_format != format => Err(PartFailure::Fatal(format!(
                "the destination {} is {} (an export of table {:?} made it so); an export to \
                 it cannot be {format}",
                self.url(),
                found.lake_format,
                found.table
            ))),
            None if found.table != table => Err(PartFailure::Fatal(format!(
                "the destination {} holds table {:?}, not {table:?} (a destination holds one table)",
                self.url(),
                found.table
            ))),
            None => Ok(()),
            Some(detail) => Err(PartFailure::Fatal(format!(
                "schema mismatch with the destination {} (its files were written by an export of \
                 table {:?}): {detail}",
                self.url(),
                found.table
            ))),
        }
    }

    /// `<partition_dir>/<part_name>_<checksum>.parquet`: the name says which
    /// rows the file holds, so writing it again never makes a second copy.
    pub fn data_key(partition_dir: &str, part: &PartName, checksum: u32) -> String {
        format!("{partition_dir}/{part}_{checksum:08x}.parquet")
    }

    /// The key of a part's data file in a destination of `format`: an
    /// Iceberg table keeps its data files under `data/`.
    pub fn file_key(format: LakeFormat, partition_dir: &str, meta: &PartMeta) -> String {
        match format {
            LakeFormat::Parquet => Self::data_key(partition_dir, &meta.name, meta.checksum),
            LakeFormat::Iceberg => Self::data_key(
                &format!("{ICEBERG_DATA_DIR}/{partition_dir}"),
                &meta.name,
                meta.checksum,
            ),
        }
    }

    /// Writes one part's file, streaming it with bounded memory: the part's
    /// own bytes when the settings match how parts are written, otherwise
    /// re-encoded a row group at a time (rows checked against the part's
    /// checksum as they pass; for an Iceberg table with its field ids, and
    /// the statistics its manifest records taken from the footer written).
    /// Small files are written create-only in one request; larger ones by a
    /// multipart upload, which S3 cannot make create-only, so the key is
    /// checked first (a racing writer of the same key writes the same rows).
    pub async fn write_part(
        &self,
        task: &Metadata,
        source: &SourcePart,
        cpu: Cpu,
        budget: UploadBudget,
    ) -> Result<DataFile, PartFailure> {
        let settings = &task.settings;
        let meta = &source.meta;
        let iceberg = match settings.format() {
            LakeFormat::Parquet => None,
            LakeFormat::Iceberg => Some(IcebergTarget::of(task)?),
        };
        let key = Self::file_key(settings.format(), &task.partition_dir, meta);
        let file = |bytes, crc, iceberg| DataFile {
            path: key.clone(),
            rows: meta.rows,
            bytes,
            checksum: meta.checksum,
            shard: source.shard,
            crc32c: Some(crc),
            iceberg,
        };
        if settings.file_exists != FileExistsPolicy::Overwrite {
            match self.location.size(&key).await {
                Ok(Some(size)) => {
                    let size = self.exists(settings, &key, size)?;
                    let crc = file_crc32c(&self.location, &key, size)
                        .await
                        .map_err(|e| classify(&e))?;
                    let stats = match &iceberg {
                        Some(target) => {
                            Some(target.stats_of_file(&self.location, &key, size).await?)
                        }
                        None => None,
                    };
                    return Ok(file(size, crc, stats));
                }
                Ok(None) => {}
                Err(e) => return Err(classify(&e)),
            }
        }
        let local = |e: &dyn std::fmt::Display| {
            PartFailure::Retryable(format!("reading local part {}: {e}", source.path))
        };
        if let (Some(target), true) = (&iceberg, settings.copies_parts()) {
            let (size, crc, stats) = self
                .copy_with_field_ids(&key, source, target, settings, cpu, budget)
                .await?;
            return Ok(file(size, crc, Some(stats)));
        }
        if settings.copies_parts() {
            let len = meta.bytes;
            if len <= budget.part_bytes as u64 {
                let data = source
                    .disk
                    .read_range(&source.path, 0, len as usize)
                    .await
                    .map_err(|e| local(&e))?;
                let crc = crc32c::crc32c(&data);
                if let Some(existing) = self.put_small(&key, Bytes::from(data), settings).await? {
                    // Another writer's copy, which may differ byte for byte.
                    let crc = file_crc32c(&self.location, &key, existing)
                        .await
                        .map_err(|e| classify(&e))?;
                    return Ok(file(existing, crc, None));
                }
                return Ok(file(len, crc, None));
            }
            let mut upload = self
                .location
                .upload(&key, budget)
                .await
                .map_err(|e| classify(&e))?;
            let crc = stream_part(source, len, &mut upload).await?;
            upload.finish().await.map_err(|e| classify(&e))?;
            return Ok(file(len, crc, None));
        }
        // Re-encoded: one row group of the source and one of the output at
        // a time; the output goes out in pieces as it is produced.
        let layout = FileLayout {
            compression: match settings.compression {
                Compression::Zstd => FileLayout::default().compression,
                Compression::Snappy => parquet::basic::Compression::SNAPPY,
                Compression::Lz4 => parquet::basic::Compression::LZ4_RAW,
                Compression::None => parquet::basic::Compression::UNCOMPRESSED,
            },
            row_group_rows: settings.row_group_rows as usize,
        };
        let mut reader = PartReader::open(source.disk.as_ref(), &source.path, &meta.name)
            .await
            .map_err(|e| local(&e))?;
        let schema = match &iceberg {
            Some(target) => {
                ferry_iceberg::table::data_file_schema_for(&target.def, reader.schema())
                    .map_err(|e| PartFailure::Fatal(e.to_string()))?
            }
            None => Arc::clone(reader.schema()),
        };
        let (name, table_id, lsns) = (
            meta.name.clone(),
            meta.table_id,
            (meta.min_lsn, meta.max_lsn),
        );
        let mut encoder = cpu
            .run(move || PartEncoder::with_layout(&schema, &name, table_id, lsns, layout))
            .await
            .map_err(|e| local(&e))?;
        let mut check = PartCheck::new(&reader).map_err(|e| local(&e))?;
        let mut upload = self
            .location
            .upload(&key, budget)
            .await
            .map_err(|e| classify(&e))?;
        let mut crc = 0u32;
        while let Some(group) = reader.next_row_group().await.map_err(|e| local(&e))? {
            let name = meta.name.clone();
            let (e, c, bytes) = cpu
                .run(move || {
                    let mut bytes = Vec::new();
                    for batch in group {
                        let batch = batch.map_err(|e| e.to_string())?;
                        check.push(&name, &batch).map_err(|e| e.to_string())?;
                        bytes.extend(encoder.write(&batch).map_err(|e| e.to_string())?);
                    }
                    Ok::<_, String>((encoder, check, bytes))
                })
                .await
                .map_err(|e| local(&e))?;
            (encoder, check) = (e, c);
            crc = crc32c::crc32c_append(crc, &bytes);
            if !bytes.is_empty() {
                upload
                    .write(Bytes::from(bytes))
                    .await
                    .map_err(|e| classify(&e))?;
            }
        }
        check.finish(meta).map_err(|e| local(&e))?;
        let (tail, out, footer) = cpu
            .run(move || encoder.finish_with_footer())
            .await
            .map_err(|e| local(&e))?;
        let stats = match &iceberg {
            Some(target) => Some(target.stats(&footer, out.bytes)?),
            None => None,
        };
        crc = crc32c::crc32c_append(crc, &tail);
        upload
            .write(Bytes::from(tail))
            .await
            .map_err(|e| classify(&e))?;
        upload.finish().await.map_err(|e| classify(&e))?;
        Ok(file(out.bytes, crc, stats))
    }

    /// Writes a part as a data file of an Iceberg table: its bytes up to its
    /// footer as they are, then its footer with the table's field ids
    /// ([`ferry_iceberg::footer_with_field_ids`]); the statistics come from
    /// the part's footer. Returns the file's size, crc32c and statistics.
    async fn copy_with_field_ids(
        &self,
        key: &str,
        source: &SourcePart,
        target: &IcebergTarget,
        settings: &ExportSettings,
        cpu: Cpu,
        budget: UploadBudget,
    ) -> Result<(u64, u32, ferry_iceberg::FileStats), PartFailure> {
        let local = |e: &dyn std::fmt::Display| {
            PartFailure::Retryable(format!("reading local part {}: {e}", source.path))
        };
        let len = source.meta.bytes;
        if len < 12 {
            return Err(local(&"too short for Parquet"));
        }
        let tail = source
            .disk
            .read_range(&source.path, len - 8, 8)
            .await
            .map_err(|e| local(&e))?;
        if tail.len() != 8 || &tail[4..] != b"PAR1" {
            return Err(local(&"no Parquet footer"));
        }
        let footer_len = u64::from(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]));
        let body_len = len
            .checked_sub(8 + footer_len)
            .ok_or_else(|| local(&"footer longer than the file"))?;
        let footer = source
            .disk
            .read_range(&source.path, body_len, footer_len as usize)
            .await
            .map_err(|e| local(&e))?;
        let def = target.def.clone();
        let (parquet_meta, new_footer) = cpu
            .run(move || {
                let m = parquet::file::metadata::ParquetMetaDataReader::decode_metadata(&footer)
                    .map_err(|e| PartFailure::Retryable(format!("part footer: {e}")))?;
                let f = ferry_iceberg::footer_with_field_ids(&def, &m)
                    .map_err(|e| PartFailure::Fatal(e.to_string()))?;
                Ok::<_, PartFailure>((m, f))
            })
            .await?;
        let size = body_len + new_footer.len() as u64;
        let stats = target.stats(&parquet_meta, size)?;
        if size <= budget.part_bytes as u64 {
            let mut data = source
                .disk
                .read_range(&source.path, 0, body_len as usize)
                .await
                .map_err(|e| local(&e))?;
            if data.len() as u64 != body_len {
                return Err(local(&"the file is shorter than its footer says"));
            }
            data.extend_from_slice(&new_footer);
            let crc = crc32c::crc32c(&data);
            if let Some(existing) = self.put_small(key, Bytes::from(data), settings).await? {
                // Another writer's copy, which may differ byte for byte.
                let crc = file_crc32c(&self.location, key, existing)
                    .await
                    .map_err(|e| classify(&e))?;
                let stats = target.stats_of_file(&self.location, key, existing).await?;
                return Ok((existing, crc, stats));
            }
            return Ok((size, crc, stats));
        }
        let mut upload = self
            .location
            .upload(key, budget)
            .await
            .map_err(|e| classify(&e))?;
        let crc = stream_part(source, body_len, &mut upload).await?;
        let crc = crc32c::crc32c_append(crc, &new_footer);
        upload
            .write(Bytes::from(new_footer))
            .await
            .map_err(|e| classify(&e))?;
        upload.finish().await.map_err(|e| classify(&e))?;
        Ok((size, crc, stats))
    }

    /// Writes a small file; `Some(size)` when another writer's file was
    /// there first and is kept (its bytes are not these).
    async fn put_small(
        &self,
        key: &str,
        data: Bytes,
        settings: &ExportSettings,
    ) -> Result<Option<u64>, PartFailure> {
        let result = if settings.file_exists == FileExistsPolicy::Overwrite {
            self.location.put(key, data).await
        } else {
            self.location.put_create(key, data).await
        };
        match result {
            Ok(()) => Ok(None),
            Err(StorageError::AlreadyExists { .. }) => {
                let size = self.location.size(key).await.map_err(|e| classify(&e))?;
                self.exists(settings, key, size.unwrap_or(0)).map(Some)
            }
            Err(e) => Err(classify(&e)),
        }
    }

    fn exists(&self, settings: &ExportSettings, key: &str, size: u64) -> Result<u64, PartFailure> {
        match settings.file_exists {
            FileExistsPolicy::Error => Err(PartFailure::Fatal(format!(
                "data file {key} already exists in {} (file-exists policy: error)",
                self.url()
            ))),
            _ => Ok(size),
        }
    }

    /// Writes the commit file create-only. Written already (a commit that
    /// crashed before COMPLETED, or a second committer): fine if it lists
    /// the same files, an error otherwise.
    pub async fn commit(&self, commit: &CommitFile) -> Result<String, PartFailure> {
        let key = commit_key(&commit.partition_id, &commit.transaction_id);
        let body = serde_json::to_vec_pretty(commit).expect("commit file serialises");
        match self.location.put_create(&key, Bytes::from(body)).await {
            Ok(()) => Ok(key),
            Err(StorageError::AlreadyExists { .. }) => {
                let existing = self.location.get(&key).await.map_err(|e| classify(&e))?;
                match serde_json::from_slice::<CommitFile>(&existing) {
                    Ok(c) if c == *commit => Ok(key),
                    _ => Err(PartFailure::Fatal(format!(
                        "commit file {key} exists with other contents"
                    ))),
                }
            }
            Err(e) => Err(classify(&e)),
        }
    }

    /// Commits an export's files as an Iceberg snapshot replacing the
    /// partition's files, made from the commit's records alone (the same
    /// snapshot whoever makes it); returns the key of the metadata version
    /// that holds the export's files, or one of a later export that
    /// superseded it. Committed already (a retry, a commit finished after
    /// a kill, a forced export of the same content): nothing is written.
    pub async fn commit_iceberg(
        &self,
        task: &Metadata,
        commit: &CommitFile,
        now_ms: u64,
    ) -> Result<String, PartFailure> {
        let target = IcebergTarget::of(task)?;
        let mut files = Vec::with_capacity(commit.files.len());
        for f in &commit.files {
            let stats = f.iceberg.clone().ok_or_else(|| {
                PartFailure::Fatal(format!(
                    "data file {} has no Iceberg statistics recorded",
                    f.path
                ))
            })?;
            files.push(ferry_iceberg::DataFileEntry::with_stats(
                f.path.clone(),
                target.partition.clone(),
                stats,
            ));
        }
        let iceberg = ferry_iceberg::Commit {
            transaction_id: commit.transaction_id.clone(),
            sequence: commit.sequence,
            create_time: commit.create_time,
            content_id: commit.content_id.clone(),
            snapshot_lsn: commit.snapshot_lsn,
            partition_id: commit.partition_id.clone(),
            files,
            timestamp_ms: i64::try_from(now_ms).unwrap_or(i64::MAX),
        };
        // Iceberg keeps no shard per data file: the commit's files with
        // their shards go beside its metadata, for the next increment to
        // tell which block ranges nest (the same bytes on every retry).
        let shards = crate::lake::IcebergShards {
            transaction_id: commit.transaction_id.clone(),
            files: commit
                .files
                .iter()
                .map(|f| (f.path.clone(), f.shard))
                .collect(),
        };
        self.location
            .put(
                &crate::lake::iceberg_shards_key(&commit.transaction_id),
                bytes::Bytes::from(serde_json::to_vec(&shards).expect("shards serialise")),
            )
            .await
            .map_err(|e| PartFailure::Retryable(e.to_string()))?;
        let table = ferry_iceberg::IcebergTable::new(self.location.clone());
        let outcome = match &self.commits {
            Some(queue) => queue.commit(&table, &target.def, iceberg).await,
            None => table.commit(&target.def, &iceberg).await,
        };
        let outcome = outcome.map_err(|e| {
            if e.is_retryable() {
                PartFailure::Retryable(e.to_string())
            } else {
                PartFailure::Fatal(e.to_string())
            }
        })?;
        let version = match outcome {
            ferry_iceberg::CommitOutcome::Committed { version, .. }
            | ferry_iceberg::CommitOutcome::AlreadyCurrent { version } => version,
            ferry_iceberg::CommitOutcome::Superseded { version, current } => {
                tracing::info!(transaction_id = %commit.transaction_id, %current, "a later export of the partition is current: nothing committed");
                version
            }
        };
        Ok(ferry_iceberg::commit::metadata_key(version))
    }

    /// Whether the commit file of an export exists.
    pub async fn committed(
        &self,
        partition_id: &str,
        transaction_id: &str,
    ) -> Result<bool, StorageError> {
        Ok(self
            .location
            .size(&commit_key(partition_id, transaction_id))
            .await?
            .is_some())
    }
}

/// Streams the first `end` bytes of a part's file into `upload`,
/// [`COPY_CHUNK_BYTES`] at a time; returns their crc32c.
async fn stream_part(
    source: &SourcePart,
    end: u64,
    upload: &mut ferry_storage::Upload,
) -> Result<u32, PartFailure> {
    let local = |e: &dyn std::fmt::Display| {
        PartFailure::Retryable(format!("reading local part {}: {e}", source.path))
    };
    let mut at = 0u64;
    let mut crc = 0u32;
    while at < end {
        let n = (end - at).min(COPY_CHUNK_BYTES as u64) as usize;
        let chunk = source
            .disk
            .read_range(&source.path, at, n)
            .await
            .map_err(|e| local(&e))?;
        if chunk.len() != n {
            return Err(local(&"the file is shorter than its footer says"));
        }
        crc = crc32c::crc32c_append(crc, &chunk);
        upload
            .write(Bytes::from(chunk))
            .await
            .map_err(|e| classify(&e))?;
        at += n as u64;
    }
    Ok(crc)
}

/// Where an Iceberg table keeps its data files, under its location.
pub const ICEBERG_DATA_DIR: &str = "data";

/// What an Iceberg table's data file needs besides its rows: the table (for
/// field ids and statistics) and the partition's value.
struct IcebergTarget {
    def: ferry_table::TableDef,
    partition: ferry_iceberg::PartitionValue,
}

impl IcebergTarget {
    fn of(task: &Metadata) -> Result<IcebergTarget, PartFailure> {
        let def = task.definition.clone().ok_or_else(|| {
            PartFailure::Fatal(
                "the task records no table definition, which an Iceberg destination needs".into(),
            )
        })?;
        let partition = ferry_iceberg::PartitionValue::of(&def, &task.partition_id)
            .map_err(|e| PartFailure::Fatal(e.to_string()))?;
        Ok(IcebergTarget { def, partition })
    }

    fn stats(
        &self,
        footer: &parquet::file::metadata::ParquetMetaData,
        size: u64,
    ) -> Result<ferry_iceberg::FileStats, PartFailure> {
        ferry_iceberg::entry_from_footer(&self.def, self.partition.clone(), footer, size as usize)
            .map(|e| e.stats())
            .map_err(|e| PartFailure::Fatal(e.to_string()))
    }

    /// The statistics of a data file already in the destination, from its
    /// footer (a file without one fails the export: the file-exists policy
    /// keeps it, and no manifest can describe it).
    async fn stats_of_file(
        &self,
        location: &Location,
        key: &str,
        size: u64,
    ) -> Result<ferry_iceberg::FileStats, PartFailure> {
        let footer = ferry_iceberg::read_footer(location, key, size)
            .await
            .map_err(|e| classify(&e))?
            .map_err(|why| {
                PartFailure::Fatal(format!("data file {key} in the destination: {why}"))
            })?;
        self.stats(&footer, size)
    }
}

/// crc32c of a whole object, read [`COPY_CHUNK_BYTES`] at a time.
pub async fn file_crc32c(location: &Location, key: &str, size: u64) -> Result<u32, StorageError> {
    let mut crc = 0u32;
    let mut at = 0u64;
    while at < size {
        let end = (at + COPY_CHUNK_BYTES as u64).min(size);
        let chunk = location.get_range(key, at..end).await?;
        if chunk.is_empty() {
            return Err(StorageError::NotFound {
                key: format!("{key} (shorter than {size} bytes)"),
            });
        }
        crc = crc32c::crc32c_append(crc, &chunk);
        at += chunk.len() as u64;
    }
    Ok(crc)
}
