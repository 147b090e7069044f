//! Applying received WAL: gathering it into records, applying each insert
//! record as level-0 parts (the idempotency window, the catalog lookup, the
//! split by partition), and persisting what was applied: the parts synced and
//! renamed first, then the state written, then the read view and the status
//! published. Also the durable part file that merges write through.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use bytes::Bytes;
use ferry_env::Disk;
use ferry_wal::record::{self, CarriedPart, Record};
use ferry_wal::Lsn;

use super::decide::{self, Fate};
use super::{io, Replica, ReplicaError, TableRef, ALL_SHARDS};
use crate::part::{self, PartMeta, PartName};
use crate::view::ReadView;

impl Replica {
    /// Where the stream must resume: the end of the WAL received and kept.
    pub fn receive_from(&self) -> Lsn {
        Lsn(self.pending_start.0 + self.pending.len() as u64)
    }

    /// Forgets received WAL that was not applied (a new stream starts at the
    /// applied position).
    pub fn reset_stream(&mut self) {
        self.pending.clear();
        self.pending_start = self.state.disk_consistent_lsn;
    }

    /// Takes WAL received from a walsender (it must continue the stream),
    /// applies every complete record in it and persists the position; returns
    /// the new `disk_consistent_lsn`.
    pub async fn receive(&mut self, begin: Lsn, wal: &[u8]) -> Result<Lsn, ReplicaError> {
        self.receive_until(begin, wal, Lsn(0)).await
    }

    /// Like [`receive`](Self::receive), for a stream whose safekeeper
    /// announced `commit_lsn`: while the replica is behind it, parts are
    /// synced and the position persisted only every
    /// [`PERSIST_EVERY_BYTES`](decide::PERSIST_EVERY_BYTES) of applied WAL, so that syncing overlaps
    /// applying; once it has received everything committed, at once.
    pub async fn receive_until(
        &mut self,
        begin: Lsn,
        wal: &[u8],
        commit_lsn: Lsn,
    ) -> Result<Lsn, ReplicaError> {
        let at = self.receive_from();
        if begin != at {
            return Err(ReplicaError::BadRecord {
                lsn: begin,
                detail: format!("WAL arrived from {begin}, the stream is at {at}"),
            });
        }
        // Until a record is complete, its pieces are only gathered: nothing
        // is parsed or copied again per piece. A declared length out of
        // bounds goes on to decoding, which refuses it.
        let plausible =
            |len: usize| (record::HEADER_BYTES..=record::MAX_RECORD_BYTES).contains(&len);
        if self.pending.is_empty() {
            if let Some(len) = record::declared_len(wal).filter(|l| plausible(*l)) {
                self.pending.reserve(len.max(wal.len()));
            }
        }
        self.pending.extend_from_slice(wal);
        self.status
            .send_modify(|s| s.last_received_lsn = self.receive_from());
        match record::declared_len(&self.pending) {
            None => return Ok(self.persisted_lsn),
            Some(len) if plausible(len) && self.pending.len() < len => {
                return Ok(self.persisted_lsn)
            }
            Some(_) => {}
        }
        let buf = Bytes::from(std::mem::take(&mut self.pending));
        let mut used = 0usize;
        let mut applied_any = false;
        let result = loop {
            let rest = buf.slice(used..);
            match record::decode(&rest) {
                Ok((rec, len)) => {
                    let lsn = Lsn(self.pending_start.0 + used as u64);
                    let end = Lsn(lsn.0 + len as u64);
                    if let Err(e) = self.apply(lsn, rec).await {
                        break Err(e);
                    }
                    self.state.disk_consistent_lsn = end;
                    self.unpersisted_bytes += len as u64;
                    used += len;
                    applied_any = true;
                }
                Err(record::RecordError::Incomplete { .. }) => break Ok(()),
                Err(e) => {
                    break Err(ReplicaError::BadRecord {
                        lsn: Lsn(self.pending_start.0 + used as u64),
                        detail: e.to_string(),
                    })
                }
            }
        };
        self.pending = buf[used..].to_vec();
        self.pending_start = Lsn(self.pending_start.0 + used as u64);
        let caught_up = self.receive_from() >= commit_lsn;
        if decide::persist_due(
            applied_any,
            caught_up,
            result.is_err(),
            self.unpersisted_bytes,
        ) {
            self.persist().await?;
        }
        match &result {
            // The catalog out of reach stops nothing: the record stays
            // pending, applied when its table can be looked up.
            Err(ReplicaError::Catalog { .. }) => {}
            Err(e) => self.status.send_modify(|s| s.error = Some(e.to_string())),
            Ok(()) => {}
        }
        result?;
        Ok(self.persisted_lsn)
    }

    /// Persists what was applied and not yet persisted (a stream that went
    /// quiet); returns `disk_consistent_lsn`.
    pub async fn flush(&mut self) -> Result<Lsn, ReplicaError> {
        if self.persisted_lsn < self.state.disk_consistent_lsn || !self.unsynced.is_empty() {
            self.persist().await?;
        }
        Ok(self.persisted_lsn)
    }

    /// Makes the applied records durable: their parts synced, renamed and
    /// their directories synced first, then the state written atomically.
    pub(super) async fn persist(&mut self) -> Result<(), ReplicaError> {
        self.sync_parts().await?;
        // The applied position written never goes back: what a replica
        // reported durable stays durable (its walreceiver's feedback lets
        // the safekeepers remove WAL below it).
        assert!(
            self.state.disk_consistent_lsn >= self.persisted_lsn,
            "disk_consistent_lsn would go back from {} to {}",
            self.persisted_lsn,
            self.state.disk_consistent_lsn
        );
        let path = format!("{}/state", self.dir);
        let data = serde_json::to_vec(&self.state).expect("state serialises");
        self.disk
            .write_atomic(&path, data)
            .await
            .map_err(io(&path))?;
        let lsn = self.state.disk_consistent_lsn;
        self.persisted_lsn = lsn;
        self.unpersisted_bytes = 0;
        self.release_retiring();
        let n = self.parts.values().map(BTreeMap::len).sum();
        let pending = self.state.merges.len();
        // The view first: a reader that saw the status reach `lsn` finds a
        // view at least as far.
        let dir = self.view.borrow().dir_shared();
        self.view.send_replace(ReadView::new(
            lsn,
            self.parts.clone(),
            self.state.retired.clone(),
            dir,
            Arc::clone(&self.disk),
        ));
        assert!(self.view.borrow().disk_consistent_lsn >= self.status.borrow().disk_consistent_lsn);
        self.status.send_modify(|s| {
            s.disk_consistent_lsn = lsn;
            s.parts = n;
            s.pending_merges = pending;
        });
        Ok(())
    }

    /// Syncs and renames every unsynced part, then syncs their directories
    /// once each; the parts become active.
    ///
    /// Cancel-safe: callers reach it through `persist` from tasks that may be
    /// dropped half-way (an HTTP request pinning parts whose client went
    /// away, an exporter stopped while the replica runs on). A part leaves
    /// `unsynced` only once synced and renamed, and a renamed part's
    /// directory stays in `unsynced_dirs` until synced, so a call cut short
    /// leaves the rest to the next one and the state is never written over a
    /// part that is not durable.
    pub(super) async fn sync_parts(&mut self) -> Result<(), ReplicaError> {
        while let Some(part) = self.unsynced.first() {
            self.unsynced_dirs.insert(part.file.dir.clone());
            part.file.sync_and_rename_again(self.disk.as_ref()).await?;
            let part = self.unsynced.remove(0);
            self.parts
                .entry(part.table_id)
                .or_default()
                .insert(part.meta.name.clone(), part.meta);
        }
        while let Some(dir) = self.unsynced_dirs.first().cloned() {
            self.disk.sync_dir(&dir).await.map_err(io(&dir))?;
            self.unsynced_dirs.remove(&dir);
        }
        Ok(())
    }

    pub(super) async fn table(
        &mut self,
        table_id: u64,
        lsn: Lsn,
    ) -> Result<TableRef, ReplicaError> {
        if let Some(t) = self.table_cache.get(&table_id) {
            return Ok(t.clone());
        }
        let found = self
            .tables
            .by_id(table_id)
            .await
            .map_err(|detail| ReplicaError::Catalog {
                table_id,
                lsn,
                detail,
            })?;
        if found != TableRef::Unknown {
            self.table_cache.insert(table_id, found.clone());
        }
        Ok(found)
    }

    async fn apply(&mut self, lsn: Lsn, rec: Record) -> Result<(), ReplicaError> {
        let (table_id, shard, block_number, idempotency_key, rows) = match rec {
            Record::Insert {
                table_id,
                shard,
                block_number,
                idempotency_key,
                arrow_ipc,
            } => (
                table_id,
                shard,
                block_number,
                idempotency_key,
                Rows::ArrowIpc(arrow_ipc),
            ),
            Record::InsertParts {
                table_id,
                shard,
                block_number,
                idempotency_key,
                parts,
            } => (
                table_id,
                shard,
                block_number,
                idempotency_key,
                Rows::Parts(parts),
            ),
            Record::Retire(r) => return self.apply_retirement(lsn, r).await,
            Record::Compact(c) => {
                return self
                    .apply_compaction(lsn, c.table_id, &c.partition_id, c.target_rows)
                    .await
            }
            Record::ShutdownCheckpoint { .. } => return Ok(()),
        };
        if !decide::is_ours(self.state.shard, ALL_SHARDS, shard) {
            return Ok(());
        }
        let bad = |detail: String| ReplicaError::BadRecord { lsn, detail };
        let table = match self.table(table_id, lsn).await? {
            TableRef::Known(t) => t,
            TableRef::Dropped => return Ok(()),
            TableRef::Unknown => {
                return Err(bad(format!(
                    "table id {table_id} was never created in this cluster's catalog"
                )))
            }
        };
        if block_number != lsn.0 {
            return Err(bad(format!(
                "block number {block_number} is not the record's LSN"
            )));
        }
        let key = (!idempotency_key.is_empty())
            .then(|| String::from_utf8_lossy(&idempotency_key).into_owned());
        // A crash after the parts but before the state: already applied.
        let covered = self
            .parts
            .get(&table_id)
            .is_some_and(|p| p.keys().any(|n| n.covers(block_number)))
            || self
                .unsynced
                .iter()
                .any(|u| u.table_id == table_id && u.meta.name.covers(block_number));
        match decide::fate(
            &self.state.window,
            table_id,
            shard,
            key.as_deref(),
            lsn,
            covered,
        ) {
            Fate::Duplicate => {
                self.status
                    .send_modify(|s| s.records_skipped_duplicate += 1);
                return Ok(());
            }
            Fate::AlreadyApplied => {}
            Fate::Write => {
                let name = |partition_id: String| PartName {
                    partition_id,
                    min_block: block_number,
                    max_block: block_number,
                    level: 0,
                };
                let schema = table.def.arrow_schema();
                match rows {
                    Rows::ArrowIpc(arrow_ipc) => {
                        let def = table.def.clone();
                        let grouped = self
                            .cpu
                            .run(move || group_by_partition(&def, &arrow_ipc))
                            .await
                            .map_err(bad)?;
                        for (partition_id, batch) in grouped {
                            let name = name(partition_id);
                            let part = self
                                .write_part(table_id, &schema, &name, batch, (lsn, lsn))
                                .await?;
                            self.unsynced.push(part);
                            self.decide_merges(table_id, &name.partition_id);
                        }
                    }
                    Rows::Parts(parts) => {
                        // Every part is checked before any is written: a
                        // record is applied whole or stops the replica.
                        let checked = check_carried(&table.def, table_id, &schema, parts, name)
                            .map_err(bad)?;
                        for (meta, file) in checked {
                            let part = self.write_file(table_id, meta, file).await?;
                            let partition_id = part.meta.name.partition_id.clone();
                            self.unsynced.push(part);
                            self.decide_merges(table_id, &partition_id);
                        }
                    }
                }
            }
        }
        if let Some(key) = key {
            decide::remember(&mut self.state.window, table_id, shard, key, lsn);
        }
        self.status.send_modify(|s| s.records_applied += 1);
        Ok(())
    }

    /// Writes a part's file (one an insert record carried, as it came, or
    /// one just encoded) under its temporary name, not synced
    /// ([`sync_parts`](Self::sync_parts) finishes it).
    async fn write_file(
        &self,
        table_id: u64,
        meta: PartMeta,
        file: Bytes,
    ) -> Result<UnsyncedPart, ReplicaError> {
        let tdir = format!("{}/parts/{table_id}", self.dir);
        self.disk.create_dir_all(&tdir).await.map_err(io(&tdir))?;
        let path = self.part_path(table_id, &meta.name);
        let mut out = DurableFile::create(self.disk.as_ref(), &tdir, &path).await?;
        out.append(file).await?;
        Ok(UnsyncedPart {
            table_id,
            file: out,
            meta,
        })
    }

    /// Encodes one part and writes it under its temporary name, not synced
    /// ([`sync_parts`](Self::sync_parts) finishes it).
    async fn write_part(
        &self,
        table_id: u64,
        schema: &arrow::datatypes::SchemaRef,
        name: &PartName,
        batch: RecordBatch,
        lsns: (Lsn, Lsn),
    ) -> Result<UnsyncedPart, ReplicaError> {
        let (bytes, meta) = self
            .cpu
            .run({
                let schema = Arc::clone(schema);
                let name = name.clone();
                move || part::encode(&schema, &name, table_id, &[batch], lsns)
            })
            .await?;
        self.write_file(table_id, meta, bytes).await
    }
}

/// A part written under its temporary name, waiting for its sync.
pub(super) struct UnsyncedPart {
    pub(super) table_id: u64,
    pub(super) file: DurableFile,
    pub(super) meta: PartMeta,
}

/// A part file being written: appended under `<path>.tmp`, then made durable
/// under its name by [`commit`](Self::commit).
pub(super) struct DurableFile {
    file: Box<dyn ferry_env::DiskFile>,
    pub(super) dir: String,
    path: String,
    tmp: String,
    len: u64,
}

impl DurableFile {
    pub(super) async fn create(
        disk: &dyn Disk,
        dir: &str,
        path: &str,
    ) -> Result<DurableFile, ReplicaError> {
        let tmp = format!("{path}.tmp");
        match disk.remove_file(&tmp).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&tmp)(e)),
        }
        let file = disk.create_new(&tmp).await.map_err(io(&tmp))?;
        Ok(DurableFile {
            file,
            dir: dir.to_string(),
            path: path.to_string(),
            tmp,
            len: 0,
        })
    }

    pub(super) async fn append(&mut self, bytes: impl Into<Bytes>) -> Result<(), ReplicaError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Ok(());
        }
        let n = bytes.len() as u64;
        self.file
            .write_at(self.len, bytes)
            .await
            .map_err(io(&self.tmp))?;
        self.len += n;
        Ok(())
    }

    /// fsync, rename to the part's name (durable once the directory is
    /// synced).
    async fn sync_and_rename(self, disk: &dyn Disk) -> Result<(), ReplicaError> {
        self.file.sync_data().await.map_err(io(&self.tmp))?;
        drop(self.file);
        disk.rename(&self.tmp, &self.path)
            .await
            .map_err(io(&self.path))?;
        Ok(())
    }

    /// fsync, rename to the part's name, keeping the file: may be called
    /// again after a call cut short (a part already renamed is done).
    pub(super) async fn sync_and_rename_again(&self, disk: &dyn Disk) -> Result<(), ReplicaError> {
        self.file.sync_data().await.map_err(io(&self.tmp))?;
        match disk.rename(&self.tmp, &self.path).await {
            Ok(()) => Ok(()),
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && disk.metadata(&self.path).await.is_ok() =>
            {
                Ok(())
            }
            Err(e) => Err(io(&self.path)(e)),
        }
    }

    /// fsync, rename to the part's name, fsync the directory.
    pub(super) async fn commit(self, disk: &dyn Disk) -> Result<(), ReplicaError> {
        let dir = self.dir.clone();
        self.sync_and_rename(disk).await?;
        disk.sync_dir(&dir).await.map_err(io(&dir))?;
        Ok(())
    }
}

/// An insert record's rows, as the record carries them.
enum Rows {
    ArrowIpc(Bytes),
    Parts(Vec<CarriedPart>),
}

/// Decodes an insert record's rows, checks them against the table, and groups
/// them by partition (partitions in id order, rows in record order).
fn group_by_partition(
    def: &ferry_table::TableDef,
    arrow_ipc: &[u8],
) -> Result<Vec<(String, RecordBatch)>, String> {
    let batches = ferry_table::rows::from_ipc(arrow_ipc)
        .map_err(|e| format!("rows do not decode as Arrow IPC: {e}"))?;
    let schema = def.arrow_schema();
    for b in &batches {
        if b.schema().fields() != schema.fields() {
            return Err(format!(
                "rows of schema {:?} do not match table {:?}",
                b.schema().fields(),
                def.name
            ));
        }
    }
    let all = match batches.as_slice() {
        [one] => one.clone(),
        _ => arrow::compute::concat_batches(&schema, &batches).map_err(|e| e.to_string())?,
    };
    ferry_table::rows::split_by_partition(def, &all)
}

/// Checks the parts an insert record carries (see [`part::check_carried`]):
/// partition ids strictly increasing, as the ingest node splits rows, and
/// each file a part of this table holding rows of its partition only (so a
/// partition id is one the table makes, safe in a file name); returns each part's metadata
/// under its name (`name` of its partition id) and its file.
fn check_carried(
    def: &ferry_table::TableDef,
    table_id: u64,
    schema: &arrow::datatypes::SchemaRef,
    parts: Vec<CarriedPart>,
    name: impl Fn(String) -> PartName,
) -> Result<Vec<(PartMeta, Bytes)>, String> {
    if parts.is_empty() {
        return Err("an insert record carries no part".into());
    }
    let mut out: Vec<(PartMeta, Bytes)> = Vec::with_capacity(parts.len());
    for p in parts {
        if let Some((last, _)) = out.last() {
            if last.name.partition_id >= p.partition_id {
                return Err(format!(
                    "carried parts out of order: {:?} after {:?}",
                    p.partition_id, last.name.partition_id
                ));
            }
        }
        let meta = part::check_carried(def, &name(p.partition_id), table_id, schema, &p.file)
            .map_err(|e| e.to_string())?;
        out.push((meta, p.file));
    }
    Ok(out)
}
