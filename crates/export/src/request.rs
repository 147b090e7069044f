//! EXPORT PARTITION: checks, the snapshot and the task's creation. No data
//! moves here; replicas pick the task up from coordination.

use std::time::Duration;

use ferry_coord::{CoordError, CreateMode, Op, Session};
use ferry_table::Table;
use ferry_wal::Lsn;
use serde::{Deserialize, Serialize};

use crate::dest::Destination;
use crate::lake;
use crate::local::{Destinations, LocalParts, SnapshotError, SnapshotRequest};
use crate::model::{
    check_name, check_transaction_id, chunk_parts, exports_path, schema_difference, table_path,
    ExportSettings, Metadata, SnapshotPart, TaskKey, TaskStatus, MAX_PARTS, METADATA_FORMAT,
};
use crate::task;

/// An export as asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportRequest {
    pub table: String,
    pub partition_id: String,
    pub destination: String,
    #[serde(default)]
    pub force: bool,
    /// Replace a finished task of the key (COMPLETED, FAILED or KILLED) even
    /// before its TTL, but never a PENDING one (an export policy's request:
    /// it must not kill a manual export in flight).
    #[serde(default)]
    pub replace_finished: bool,
    /// Asked by the table's export policy (shown in the status listing).
    #[serde(default)]
    pub by_policy: bool,
    #[serde(default)]
    pub settings: ExportSettings,
}

/// A task created, or (with `unchanged`) the commit that already holds
/// exactly the parts asked for, or (unless forced) exactly their rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Created {
    pub transaction_id: String,
    pub key: TaskKey,
    pub parts_count: u64,
    pub rows: u64,
    pub snapshot_lsn: u64,
    /// Set when no task was created: the partition's current commit in the
    /// destination (this key) has the same content, so exporting again
    /// would change nothing a reader sees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unchanged: Option<String>,
    /// Of `parts_count`, files of the current commit the task carries (an
    /// increment: only the rest are written).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub carried: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What `AlreadyExists` names when the task's node appeared while this
/// request created it (another request, or this one's own create whose
/// answer was lost).
const CREATED_CONCURRENTLY: &str = "(created concurrently)";

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("no table {0:?}")]
    NoSuchTable(String),
    #[error("partition {partition:?} of table {table:?} has no rows: nothing to export")]
    EmptyPartition { table: String, partition: String },
    #[error("destination {url} is not usable: {detail}")]
    Destination { url: String, detail: String },
    #[error(
        "destination {url} holds files of another schema (written by an export of table \
         {table:?}): {detail}; export to another destination"
    )]
    SchemaMismatch {
        url: String,
        table: String,
        detail: String,
    },
    #[error(
        "partition {partition:?} of {table:?} already has an export to {destination} \
         (transaction {transaction_id}, {status}) that has not expired; use force to replace it"
    )]
    AlreadyExists {
        table: String,
        partition: String,
        destination: String,
        transaction_id: String,
        status: String,
    },
    #[error(
        "this node's replicas reached {reached} but inserts acknowledged before the request \
         reach {needed}; they did not catch up within {waited:?} (retry, or ask another node)"
    )]
    Behind {
        reached: Lsn,
        needed: Lsn,
        waited: Duration,
    },
    #[error(
        "the partition's current export in {url} ({commit}) holds rows this node's snapshot \
         lacks ({detail}); its replicas are behind: retry, or ask another node"
    )]
    StaleSnapshot {
        url: String,
        commit: String,
        detail: String,
    },
    /// Retention dropped some of the partition's rows from the replicas:
    /// only the lake holds them, so an export that would not carry them
    /// from the destination's current commit is refused.
    #[error(
        "partition {partition:?} of {table:?} has rows that retention dropped from the replicas \
         (they live only in the lake): {detail}"
    )]
    Retired {
        table: String,
        partition: String,
        detail: String,
    },
    #[error("{0}")]
    NotHeld(String),
    #[error("table {0} has no active partitions")]
    NoPartitions(String),
    /// Orphan files are being removed from the destination: a task
    /// created now could list a file the removal deletes. Retry shortly.
    #[error("orphan files are being removed from {0} right now; retry shortly")]
    LakeUpkeep(String),
    #[error("coordination: {0}")]
    Coordination(#[from] CoordError),
}

/// Which partitions of a table a request asks to export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Partitions {
    One(String),
    /// Every partition with active parts at the request's commit position.
    All,
}

/// A request for one partition or for every partition of a table.
#[derive(Debug, Clone)]
pub struct TableRequest {
    pub table: String,
    pub partitions: Partitions,
    pub destination: String,
    pub force: bool,
    pub settings: ExportSettings,
}

/// The answer to a [`TableRequest`]. For one partition, `created` holds its
/// task (a refusal is the request's error). For every partition, each one is
/// requested on its own, with its own transaction id: those with a live or
/// unexpired export are `skipped`, those refused for another reason are
/// `failed`, and neither hides or stops the rest.
#[derive(Debug, Default)]
pub struct Requested {
    pub created: Vec<Created>,
    pub skipped: Vec<(String, RequestError)>,
    pub failed: Vec<(String, RequestError)>,
}

/// Expands a [`TableRequest`] into one export per partition.
/// `requester(random)` is this node's [`Requester`] with `random` for the
/// transaction id; `random()` draws one per partition.
pub async fn request_table<'a>(
    requester: impl Fn(u64) -> Requester<'a>,
    random: &mut (dyn FnMut() -> u64 + Send),
    req: &TableRequest,
) -> Result<Requested, RequestError> {
    let partitions = match &req.partitions {
        Partitions::One(p) => vec![p.clone()],
        Partitions::All => {
            let lister = requester(0);
            let table = lister.table(&req.table).await?;
            let ids = lister
                .parts
                .partitions(&table, lister.commit_lsn, lister.wait)
                .await
                .map_err(|e| lister.snapshot_error(e))?;
            if ids.is_empty() {
                return Err(RequestError::NoPartitions(req.table.clone()));
            }
            ids
        }
    };
    let all = req.partitions == Partitions::All;
    let mut answer = Requested::default();
    for partition_id in partitions {
        let one = ExportRequest {
            table: req.table.clone(),
            partition_id: partition_id.clone(),
            destination: req.destination.clone(),
            force: req.force,
            replace_finished: false,
            by_policy: false,
            settings: req.settings.clone(),
        };
        match requester(random()).export(&one).await {
            Ok(created) => answer.created.push(created),
            Err(e) if !all => return Err(e),
            Err(e @ RequestError::AlreadyExists { .. }) => answer.skipped.push((partition_id, e)),
            Err(e) => answer.failed.push((partition_id, e)),
        }
    }
    Ok(answer)
}

/// What a node needs to create tasks.
pub struct Requester<'a> {
    pub session: &'a Session,
    /// For the kill of a task a forced export replaces (in a session of its
    /// own, see `task::kill_in_own_session`).
    pub sessions: &'a dyn ferry_coord::SessionFactory,
    pub parts: &'a dyn LocalParts,
    pub destinations: &'a dyn Destinations,
    /// This node's name (source_replica).
    pub replica_name: &'a str,
    /// Unix seconds and a random number for the transaction id.
    pub now_unix_millis: u64,
    pub random: u64,
    /// The commit position when the request arrived.
    pub commit_lsn: Lsn,
    /// How long to wait for the replicas to apply it.
    pub wait: Duration,
}

impl Requester<'_> {
    /// Reads a table from the catalog.
    pub async fn table(&self, name: &str) -> Result<Table, RequestError> {
        check_name("table name", name).map_err(|e| RequestError::BadRequest(e.to_string()))?;
        match self.session.get(&table_path(name)).await {
            Ok((data, _)) => serde_json::from_slice(&data).map_err(|e| {
                RequestError::Coordination(CoordError::Backend(format!(
                    "table {name}: damaged definition: {e}"
                )))
            }),
            Err(CoordError::NoNode { .. }) => Err(RequestError::NoSuchTable(name.to_string())),
            Err(e) => Err(e.into()),
        }
    }

    /// Checks, waits, snapshots and creates the task.
    pub async fn export(&self, req: &ExportRequest) -> Result<Created, RequestError> {
        let bad = |e: String| RequestError::BadRequest(e);
        check_name("partition id", &req.partition_id).map_err(|e| bad(e.to_string()))?;
        req.settings.check().map_err(bad)?;
        check_name("replica name", self.replica_name).map_err(|e| bad(e.to_string()))?;
        let location = self
            .destinations
            .open(&req.destination)
            .map_err(|e| bad(e.to_string()))?;
        let destination = Destination::new(location);
        let table = self.table(&req.table).await?;
        let key = TaskKey::new(&req.table, &req.partition_id, destination.url());

        // Everything acknowledged before the request is applied by the
        // replicas the snapshot reads, which pin the parts they list.
        let transaction_id = crate::model::transaction_id(self.now_unix_millis, self.random);
        check_transaction_id(&transaction_id).map_err(|e| bad(e.to_string()))?;
        let snapshot = self
            .parts
            .snapshot(&SnapshotRequest {
                table: table.clone(),
                partition_id: Some(req.partition_id.clone()),
                at: self.commit_lsn,
                wait_ms: self.wait.as_millis() as u64,
                pin: Some(transaction_id.clone()),
            })
            .await
            .map_err(|e| self.snapshot_error(e))?;
        match self
            .create_task(req, &table, &destination, key, &transaction_id, &snapshot)
            .await
        {
            Ok(created) => {
                if created.unchanged.is_some() {
                    // No task will use the snapshot's pins.
                    if let Err(u) = self.parts.release_snapshot(&transaction_id).await {
                        tracing::warn!(%transaction_id, error = %u, "could not release the snapshot's pins");
                    }
                }
                Ok(created)
            }
            Err(e) => {
                // A create whose answer was lost may have made the task (or
                // its first nodes, found again as existing): its parts stay
                // pinned, or a merge could take them from under it; the
                // workers' sweep releases pins no PENDING task holds once
                // they are old. Otherwise no task uses these pins.
                let maybe_created = match &e {
                    RequestError::Coordination(c) => c.is_connection_loss(),
                    RequestError::AlreadyExists { transaction_id, .. } => {
                        transaction_id == CREATED_CONCURRENTLY
                    }
                    _ => false,
                };
                if maybe_created {
                    tracing::warn!(%transaction_id, error = %e, "the task may exist: its pins stay");
                } else if let Err(u) = self.parts.release_snapshot(&transaction_id).await {
                    tracing::warn!(%transaction_id, error = %u, "could not release the snapshot's pins");
                }
                Err(e)
            }
        }
    }

    fn snapshot_error(&self, e: SnapshotError) -> RequestError {
        match e {
            SnapshotError::Behind { reached } => RequestError::Behind {
                reached,
                needed: self.commit_lsn,
                waited: self.wait,
            },
            SnapshotError::NotHeld(m) => RequestError::NotHeld(m),
        }
    }

    async fn create_task(
        &self,
        req: &ExportRequest,
        table: &Table,
        destination: &Destination,
        key: TaskKey,
        transaction_id: &str,
        snapshot: &[ferry_replica::PartMeta],
    ) -> Result<Created, RequestError> {
        let bad = |e: String| RequestError::BadRequest(e);
        let rows: u64 = snapshot.iter().map(|p| p.rows).sum();
        if rows == 0 {
            return Err(RequestError::EmptyPartition {
                table: req.table.clone(),
                partition: req.partition_id.clone(),
            });
        }
        if snapshot.len() > MAX_PARTS {
            return Err(bad(format!(
                "the partition has {} parts, more than an export takes ({MAX_PARTS})",
                snapshot.len()
            )));
        }

        // The destination's format: the request's, else the table's.
        let format = req
            .settings
            .format
            .or(table.def.export.as_ref().map(|e| e.format))
            .unwrap_or_default();
        let mut settings = req.settings.clone();
        settings.format = Some(format);
        // The destination is checked before an existing task is replaced.
        destination
            .probe(transaction_id)
            .await
            .map_err(|e| RequestError::Destination {
                url: destination.url().to_string(),
                detail: e.to_string(),
            })?;
        // Files of another schema in the destination: refused before the
        // task exists (a worker checks again before its first upload).
        match destination.schema().await {
            Ok(Some(found)) if found.lake_format != format => {
                return Err(RequestError::SchemaMismatch {
                    url: destination.url().to_string(),
                    detail: format!(
                        "its format is {}, this export's {format}",
                        found.lake_format
                    ),
                    table: found.table,
                });
            }
            Ok(Some(found)) => {
                // One table per destination: two tables' partitions of one
                // id would otherwise supersede each other's commits.
                let other_table = (found.table != req.table).then(|| {
                    format!(
                        "it holds table {:?}; a destination holds one table",
                        found.table
                    )
                });
                if let Some(detail) =
                    schema_difference(&table.def.columns, &found.columns).or(other_table)
                {
                    return Err(RequestError::SchemaMismatch {
                        url: destination.url().to_string(),
                        table: found.table,
                        detail,
                    });
                }
            }
            Ok(None) => {}
            Err(e) => {
                return Err(RequestError::Destination {
                    url: destination.url().to_string(),
                    detail: e.to_string(),
                })
            }
        }

        let parts: Vec<SnapshotPart> = snapshot
            .iter()
            .map(|p| SnapshotPart {
                name: p.name.to_string(),
                rows: p.rows,
                checksum: p.checksum,
                shard: p.shard,
            })
            .collect();
        let retired: std::collections::BTreeSet<(Option<u32>, String)> = snapshot
            .iter()
            .filter(|p| p.retired)
            .map(|p| (p.shard, p.name.to_string()))
            .collect();
        let retired_error = |detail: String| RequestError::Retired {
            table: req.table.clone(),
            partition: req.partition_id.clone(),
            detail,
        };
        if req.force && !retired.is_empty() {
            return Err(retired_error(
                "a forced export writes every row from the replicas; export it without force \
                 (an export carries the lake files holding the retired rows)"
                    .into(),
            ));
        }
        // An existing task for the key.
        let existing = task::read_head(self.session, &key).await?;
        if let Some(existing) = &existing {
            let expired = existing.metadata.as_ref().is_some_and(|m| {
                m.create_time + m.settings.ttl_seconds < self.now_unix_millis / 1000
            }) || (req.replace_finished
                && existing.status.is_some_and(|s| s != TaskStatus::Pending));
            if !req.force && !expired && existing.metadata.is_some() {
                return Err(RequestError::AlreadyExists {
                    table: req.table.clone(),
                    partition: req.partition_id.clone(),
                    destination: destination.url().to_string(),
                    transaction_id: existing.transaction_id.clone(),
                    status: existing
                        .status
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| "being created".into()),
                });
            }
        }
        let content_id = crate::model::content_id(&req.table, &req.partition_id, &parts);
        let read_current = || async {
            lake::current_commit(
                destination.location(),
                format,
                &table.def,
                &req.partition_id,
            )
            .await
            .map_err(|detail| RequestError::Destination {
                url: destination.url().to_string(),
                detail,
            })
        };
        let mut current = read_current().await?;
        // The same content committed again would be committed once: what
        // the reader sees is already this. Unless forced (which writes the
        // parts as the replicas hold them now, merged), so are the same rows
        // in other parts: a partition's rows at any position are a prefix,
        // by LSN, of one sequence of records, so two snapshots of it are one
        // inside the other, and the current commit, whose every block the
        // snapshot covers (the same table's records), holds exactly the
        // snapshot's rows when it holds as many. A policy's export follows
        // the replicas' merges, though: the same rows in fewer parts are
        // written as those parts (an increment replacing the files they
        // hold), so that the lake is compacted as the replicas are.
        if let Some(c) = &current {
            let follows_merges = req.by_policy && snapshot.len() < c.data_files.len();
            let same_rows =
                !req.force && !follows_merges && c.rows == rows && lacks(c, snapshot).is_none();
            if c.content_id == content_id || same_rows {
                tracing::info!(task = %key, commit = %c.key, "export unchanged: the current commit holds these parts");
                return Ok(unchanged(c, key, parts.len(), rows));
            }
        }

        if let Some(existing) = existing {
            // Replaced: a pending one is killed first (under its commit
            // lock, so no commit file appears for it afterwards), then the
            // task is removed.
            if existing.status == Some(TaskStatus::Pending) {
                task::kill_in_own_session(
                    self.sessions,
                    &key,
                    Some(&existing.transaction_id),
                    destination,
                    "replaced by a forced export",
                    self.now_unix_millis,
                )
                .await
                .map_err(|e| match e {
                    task::KillError::Coordination(c) => RequestError::Coordination(c),
                    other => bad(other.to_string()),
                })?;
            }
            task::remove(self.session, &key, &existing.transaction_id).await?;
            // The task replaced may have committed on its way out.
            current = read_current().await?;
        }
        // The new commit supersedes the current one: it must hold every row
        // the current one holds (a node whose replicas lag would otherwise
        // take rows away from readers).
        let sequence = match &current {
            Some(c) => {
                if let Some(detail) = lacks(c, snapshot) {
                    return Err(RequestError::StaleSnapshot {
                        url: destination.url().to_string(),
                        commit: c.key.clone(),
                        detail,
                    });
                }
                c.sequence + 1
            }
            None => 1,
        };

        // Unforced, an export writes only what the current commit lacks and
        // carries the rest of its files (forced, it writes every part as the
        // replicas hold it now).
        let increment = match (&current, req.force) {
            (Some(c), false) => crate::increment::plan(&c.data_files, &parts),
            _ => None,
        };
        let (to_export, carried) = match increment {
            Some(i) => (i.new_parts, i.carried),
            None => (parts.clone(), Vec::new()),
        };
        // A retired file is never exported from a replica (none holds it):
        // the current commit must hold it, to be carried.
        if let Some(p) = to_export
            .iter()
            .find(|p| retired.contains(&(p.shard, p.name.clone())))
        {
            return Err(retired_error(format!(
                "{} holds no file with the rows of {} (the export would take them out of the \
                 lake); export to the destination the partition was retired from",
                destination.url(),
                p.name
            )));
        }
        if to_export.is_empty() {
            if let Some(c) = &current {
                tracing::info!(task = %key, commit = %c.key, "export unchanged: the current commit holds every row");
                return Ok(unchanged(c, key, parts.len(), rows));
            }
        }
        let mut listed = to_export.clone();
        listed.extend(carried.iter().map(|f| {
            SnapshotPart {
                name: lake::part_of(&f.path)
                    .map(|n| n.to_string())
                    .unwrap_or_default(),
                rows: f.rows,
                checksum: f.checksum,
                shard: f.shard,
            }
        }));
        let chunks = chunk_parts(&listed);
        let partition_dir = partition_dir(table, &req.partition_id);
        let metadata = Metadata {
            format: METADATA_FORMAT,
            transaction_id: transaction_id.to_string(),
            table: req.table.clone(),
            table_id: table.id,
            partition_id: req.partition_id.clone(),
            partition_dir,
            destination: destination.url().to_string(),
            source_replica: self.replica_name.to_string(),
            create_time: self.now_unix_millis / 1000,
            snapshot_lsn: self.commit_lsn.0,
            parts_count: listed.len() as u64,
            rows,
            parts_chunks: chunks.len() as u32,
            settings,
            columns: table.def.columns.clone(),
            sequence,
            content_id,
            definition: Some(table.def.clone()),
            carried: carried.len() as u64,
            by_policy: req.by_policy,
        };
        ferry_coord::create_all(self.session.as_ref(), &exports_path(&req.table)).await?;
        match create(self.session, &key, &metadata, &to_export, &carried, chunks).await {
            Ok(()) => {}
            Err(e) => {
                return Err(match e {
                    CoordError::MultiFailed { index: 0, source }
                        if matches!(*source, CoordError::NodeExists { .. }) =>
                    {
                        RequestError::LakeUpkeep(destination.url().to_string())
                    }
                    CoordError::NodeExists { .. } => RequestError::AlreadyExists {
                        table: req.table.clone(),
                        partition: req.partition_id.clone(),
                        destination: destination.url().to_string(),
                        transaction_id: CREATED_CONCURRENTLY.into(),
                        status: "PENDING".into(),
                    },
                    other => other.into(),
                });
            }
        }
        tracing::info!(task = %key, %transaction_id, parts = to_export.len(), carried = carried.len(), rows, "export created");
        Ok(Created {
            transaction_id: transaction_id.to_string(),
            key,
            parts_count: listed.len() as u64,
            rows,
            snapshot_lsn: self.commit_lsn.0,
            unchanged: None,
            carried: carried.len() as u64,
        })
    }
}

/// The answer to a request the current commit `c` holds already: no task.
fn unchanged(c: &lake::CurrentCommit, key: TaskKey, parts: usize, rows: u64) -> Created {
    Created {
        transaction_id: c.transaction_id.clone(),
        key,
        parts_count: parts as u64,
        rows,
        snapshot_lsn: c.snapshot_lsn,
        unchanged: Some(c.key.clone()),
        carried: 0,
    }
}

/// What of `commit` the snapshot does not hold, if anything: fewer rows, or
/// a block (a part's first or last) that no snapshot part covers.
pub(crate) fn lacks(
    commit: &lake::CurrentCommit,
    snapshot: &[ferry_replica::PartMeta],
) -> Option<String> {
    let rows: u64 = snapshot.iter().map(|p| p.rows).sum();
    if rows < commit.rows {
        return Some(format!("{} rows, the snapshot {rows}", commit.rows));
    }
    for path in &commit.files {
        let Some(name) = lake::part_of(path) else {
            continue;
        };
        for block in [name.min_block, name.max_block] {
            if !snapshot.iter().any(|p| p.name.covers(block)) {
                return Some(format!("block {block} of {path}"));
            }
        }
    }
    None
}

/// The Hive directory of a partition: `<column>=<id>`, or
/// `<column>_<year|month|day>=<id>` for a partition by date part.
pub fn partition_dir(table: &Table, partition_id: &str) -> String {
    use ferry_table::def::PartitionTransform;
    let column = &table.def.partition_by.column;
    match table.def.partition_by.transform {
        PartitionTransform::Identity => format!("{column}={partition_id}"),
        PartitionTransform::Year => format!("{column}_year={partition_id}"),
        PartitionTransform::Month => format!("{column}_month={partition_id}"),
        PartitionTransform::Day => format!("{column}_day={partition_id}"),
    }
}

/// Creates the task: in one multi when it fits the request limit; else the
/// task's node and metadata first, the snapshot and processing entries in
/// chunks, and `status` last, which is what makes the task visible to
/// workers (a task without status is one being created; cleanup removes it
/// if its creator died).
async fn create(
    session: &Session,
    key: &TaskKey,
    metadata: &Metadata,
    parts: &[SnapshotPart],
    carried: &[crate::model::DataFile],
    chunks: Vec<Vec<u8>>,
) -> Result<(), CoordError> {
    let base = key.path();
    let p = |s: &str| format!("{base}/{s}");
    let persistent = CreateMode::Persistent;
    // First, atomically with the task's first nodes: no orphan removal
    // runs on the destination (its marker is absent: created and deleted
    // here). A removal that starts later sees this task in flight.
    let upkeep = crate::model::lake_upkeep_path(&key.table, &metadata.destination);
    let mut head = vec![
        Op::create(upkeep.clone(), Vec::new(), persistent),
        Op::delete(upkeep, None),
        Op::create(base.clone(), metadata.transaction_id.as_bytes(), persistent),
        Op::create(
            p("metadata.json"),
            serde_json::to_vec(metadata).expect("metadata serialises"),
            persistent,
        ),
        Op::create(p("parts"), Vec::new(), persistent),
        Op::create(p("processing"), Vec::new(), persistent),
        Op::create(p("processed"), Vec::new(), persistent),
        Op::create(p("locks"), Vec::new(), persistent),
        Op::create(p("exceptions"), Vec::new(), persistent),
        Op::create(p("retries"), Vec::new(), persistent),
        Op::create(p("workers"), Vec::new(), persistent),
        Op::create(
            crate::model::fence_path(&base, &metadata.transaction_id),
            Vec::new(),
            persistent,
        ),
    ];
    let mut body: Vec<Op> = chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| Op::create(p(&format!("parts/{i:06}")), c, persistent))
        .collect();
    body.extend(parts.iter().map(|part| {
        Op::create(
            p(&format!("processing/{}", part.name)),
            Vec::new(),
            persistent,
        )
    }));
    // Carried files are processed from the start: the commit lists them
    // as the current commit did.
    for file in carried {
        let name = lake::part_of(&file.path)
            .map(|n| n.to_string())
            .unwrap_or_default();
        let entry = crate::model::Processed {
            file: file.clone(),
            finished_by: format!("carried by {}", metadata.transaction_id),
        };
        body.push(Op::create(
            p(&format!("processed/{name}")),
            serde_json::to_vec(&entry).expect("a processed entry serialises"),
            persistent,
        ));
    }
    let status = Op::create(p("status"), TaskStatus::Pending.as_str(), persistent);
    let limit = ferry_coord::path::MAX_REQUEST_BYTES;
    let prefix = session.path_prefix_bytes();
    let mut all = head.clone();
    all.extend(body.iter().cloned());
    all.push(status.clone());
    if ferry_coord::multi_request_bytes(&all, prefix) <= limit {
        session.multi(all).await?;
        return Ok(());
    }
    session.multi(std::mem::take(&mut head)).await?;
    let mut batch: Vec<Op> = Vec::new();
    for op in body {
        batch.push(op);
        if ferry_coord::multi_request_bytes(&batch, prefix) > limit {
            let last = batch.pop().expect("just pushed");
            if let Err(e) = session.multi(std::mem::take(&mut batch)).await {
                let _ = task::remove(session, key, &metadata.transaction_id).await;
                return Err(e);
            }
            batch.push(last);
        }
    }
    let mut last = batch.clone();
    last.push(status.clone());
    if ferry_coord::multi_request_bytes(&last, prefix) > limit {
        if let Err(e) = session.multi(std::mem::take(&mut batch)).await {
            let _ = task::remove(session, key, &metadata.transaction_id).await;
            return Err(e);
        }
    }
    batch.push(status);
    if let Err(e) = session.multi(batch).await {
        let _ = task::remove(session, key, &metadata.transaction_id).await;
        return Err(e);
    }
    Ok(())
}
