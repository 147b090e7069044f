//! The export random test: three nodes, each a production `Replica` (every
//! shard) with its merge task and its production `Exporter`, share exports
//! of partitions to simulated object storage, coordinated through simulated
//! coordination. Inserts reach the replicas as WAL, each node applying at
//! its own pace, so a request must wait for its replica. The schedule mixes
//! inserts, exports (some forced), kills, node crashes (disk losing unsynced
//! data, sessions abandoned), session expiries and partitions from
//! coordination, with coordination requests lost before or after they were
//! applied and object-store requests failing before or after a write.
//! Between events it looks for new commit files every 50 ms and kills half
//! of those exports at once: the window between a commit file and COMPLETED
//! (a committer whose status write failed or who crashed) is reached.
//!
//! Checked once faults stop and every task settled (SPEC.md section 6):
//! * every task reaches a terminal state, and a task the schedule did not
//!   (or may not have) killed is COMPLETED;
//! * a commit file lists exactly one file per part of its task's snapshot,
//!   each present with the listed size, and together the files hold exactly
//!   the partition's rows as of the request (each row once);
//! * a FAILED or KILLED task, and a kill the schedule saw succeed, has no
//!   commit file;
//! * no data file is written twice under different names (one checksum per
//!   part name).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{AsArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::Int64Type;
use bytes::{Bytes, BytesMut};
use ferry_coord::{Session, SessionFactory};
use ferry_env::{Clock, Cpu, Disk};
use ferry_export::model::{CommitFile, ExportSettings, TaskKey, TaskStatus};
use ferry_export::{
    Destination, Destinations, ExportRequest, ExporterConfig, ReplicaSet, Requester,
};
use ferry_replica::ALL_SHARDS;
use ferry_storage::{Location, StorageError};
use ferry_table::Table;
use ferry_wal::record::Record;
use ferry_wal::Lsn;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::coord::CoordFaults;
use crate::net::NetOptions;
use crate::objstore::ObjectFaults;
use crate::world::{Failure, World};

const NODES: usize = 3;
const TABLE_ID: u64 = 1;
const PARTITIONS: [&str; 3] = ["p0", "p1", "p2"];
/// Destinations: two prefixes of the simulated lake.
const DESTINATIONS: [&str; 2] = ["sim://lake/d0", "sim://lake/d1"];
const SESSION_TIMEOUT: Duration = Duration::from_secs(2);
/// How often, between events, the schedule looks for new commit files.
const COMMIT_WATCH_STEP: Duration = Duration::from_millis(50);

fn table() -> Table {
    ferry_testkit::table::id_p_table(TABLE_ID, "t", 2, &[])
}

fn partition_of(id: i64) -> &'static str {
    PARTITIONS[(id as usize / 5) % PARTITIONS.len()]
}

fn node_name(i: usize) -> String {
    format!("n{i}")
}

/// The simulated lake: `sim://lake/<prefix>`.
struct Lake(Arc<dyn object_store::ObjectStore>);

impl Destinations for Lake {
    fn open(&self, url: &str) -> Result<Location, StorageError> {
        let prefix = url
            .strip_prefix("sim://lake/")
            .ok_or_else(|| StorageError::InvalidUrl {
                url: url.to_string(),
                reason: "not a simulated lake".into(),
            })?;
        Location::from_store(url, Arc::clone(&self.0), prefix)
    }
}

#[derive(Debug, Clone)]
enum Event {
    Insert(usize),
    Export {
        node: usize,
        partition: usize,
        destination: usize,
        force: bool,
    },
    Kill {
        node: usize,
        pick: usize,
    },
    Crash(usize),
    ExpireSession(usize),
    PartitionCoord(usize),
    Repair,
}

fn generate(rng: &mut SmallRng) -> Vec<(Duration, Event)> {
    let n = rng.random_range(30..70);
    let mut at = Duration::ZERO;
    let mut events = Vec::with_capacity(n);
    for _ in 0..n {
        at += Duration::from_millis(rng.random_range(5..400));
        let event = match rng.random_range(0..100) {
            0..=39 => Event::Insert(rng.random_range(1..30)),
            40..=61 => Event::Export {
                node: rng.random_range(0..NODES),
                partition: rng.random_range(0..PARTITIONS.len()),
                destination: rng.random_range(0..DESTINATIONS.len()),
                force: rng.random_bool(0.4),
            },
            62..=69 => Event::Kill {
                node: rng.random_range(0..NODES),
                pick: rng.random_range(0..1000),
            },
            70..=81 => Event::Crash(rng.random_range(0..NODES)),
            82..=89 => Event::ExpireSession(rng.random_range(0..NODES)),
            90..=95 => Event::PartitionCoord(rng.random_range(0..NODES)),
            _ => Event::Repair,
        };
        events.push((at, event));
    }
    events
}

/// A running node: the replica node as the product assembles it (its WAL
/// fed by the simulation), the simulation's feeder, and a session for
/// requests and kills (the exporter has sessions of its own).
struct Node {
    node: ferry_node::ReplicaNode,
    parts: Arc<ReplicaSet>,
    session: Session,
    feeder: tokio::task::JoinHandle<()>,
}

impl Node {
    /// A crash: every task ends at once.
    async fn stop(self) {
        self.feeder.abort();
        let _ = self.feeder.await;
        self.node.stop().await;
    }
}

/// What the schedule knows of an export it asked for.
#[derive(Debug, Clone)]
struct Asked {
    partition: String,
    destination: String,
    /// The request was refused (the task may still exist if the refusal was
    /// a lost answer).
    refused: bool,
    /// Ids of the partition's rows the snapshot must hold.
    ids: BTreeSet<i64>,
    /// The schedule killed it, or may have (a lost answer, a forced
    /// replacement).
    maybe_killed: bool,
    /// A kill answered KILLED.
    killed: bool,
}

/// What one seed did.
#[derive(Debug)]
pub struct Outcome {
    pub seed: u64,
    pub events: usize,
    pub simulated: Duration,
    pub exports: usize,
    pub completed: usize,
    pub killed: usize,
    pub crashes: usize,
    pub injected_object_faults: u64,
    pub log_hash: u32,
    pub log: Vec<String>,
}

struct Sim {
    world: World,
    nodes: Vec<Option<Node>>,
    /// The WAL as inserted so far, and its end (the "commit position").
    wal: BytesMut,
    /// The WAL as the replicas may read it (a copy of `wal`).
    fed: watch::Sender<Bytes>,
    /// Rows by partition with the LSN of their record's end.
    rows: Vec<(Lsn, i64)>,
    next_id: i64,
    asked: BTreeMap<String, Asked>,
    /// Exports whose commit file the schedule saw (and maybe killed).
    killed_on_commit: BTreeSet<String>,
    crashes: usize,
}

impl Sim {
    fn log(&mut self, line: impl AsRef<str>) {
        self.world.log(line);
    }

    fn fail(&self, reason: impl Into<String>) -> Failure {
        self.world.fail(reason)
    }

    fn insert(&mut self, rows: usize) {
        let ids: Vec<i64> = (self.next_id..self.next_id + rows as i64).collect();
        self.next_id += rows as i64;
        let batch = RecordBatch::try_new(
            table().def.arrow_schema(),
            vec![
                Arc::new(Int64Array::from(ids.clone())),
                Arc::new(StringArray::from_iter_values(
                    ids.iter().map(|i| partition_of(*i)),
                )),
            ],
        )
        .expect("batch");
        let at = self.wal.len() as u64;
        Record::Insert {
            table_id: TABLE_ID,
            shard: (at % 2) as u32,
            block_number: at,
            idempotency_key: Bytes::new(),
            arrow_ipc: ferry_table::rows::to_ipc(&batch).expect("ipc"),
        }
        .encode(&mut self.wal);
        let end = Lsn(self.wal.len() as u64);
        self.rows.extend(ids.into_iter().map(|id| (end, id)));
        self.fed.send_replace(Bytes::copy_from_slice(&self.wal));
    }

    async fn start_node(&mut self, i: usize) -> Result<(), Failure> {
        let name = node_name(i);
        let disk: Arc<dyn Disk> = Arc::new(self.world.disk(&name));
        let mut config = ExporterConfig::new(name.clone());
        config.tick = Duration::from_millis(100);
        config.cleanup_interval = Duration::from_millis(500);
        config.safety_poll = Duration::from_secs(5);
        config.creating_grace = Duration::from_secs(30);
        config.upload_budget = ferry_storage::UploadBudget {
            part_bytes: 8 << 10,
            max_in_flight: 2,
        };
        let clock: Arc<dyn Clock> = Arc::new(self.world.clock.clone());
        let node = ferry_node::ReplicaNode::start(
            ferry_node::ReplicaNodeConfig {
                dir: "replica".into(),
                shard: ALL_SHARDS,
                replica: i as u32,
                // The node applies the WAL at its own pace (the feeder below).
                wal: ferry_node::WalSource::Fed,
                merges: Some(Duration::from_secs(1)),
                export: Some(ferry_node::ExportSeams {
                    config,
                    sessions: Arc::new(self.world.coord.factory(&name, SESSION_TIMEOUT)),
                    destinations: Arc::new(self.lake()),
                }),
            },
            ferry_node::ReplicaSeams {
                disk,
                clock,
                cpu: Cpu::Inline,
                tables: Arc::new(ferry_testkit::table::FixedTables::new([table()])),
            },
        )
        .await
        .map_err(|e| self.fail(format!("{name} cannot reopen its replica: {e}")))?;
        let replica = Arc::clone(&node.replica);
        let parts = Arc::clone(&node.parts);
        let feeder = tokio::spawn({
            let mut fed = self.fed.subscribe();
            let mut rng = SmallRng::seed_from_u64(self.world.rng.random());
            async move {
                loop {
                    let bytes = fed.borrow_and_update().clone();
                    let end = bytes.len();
                    let at = replica.lock().await.receive_from();
                    if (at.0 as usize) < end {
                        tokio::time::sleep(Duration::from_millis(rng.random_range(1..200))).await;
                        let mut r = replica.lock().await;
                        let at = r.receive_from();
                        if let Err(e) = r.receive(at, &bytes[at.0 as usize..end]).await {
                            tracing::debug!(error = %e, "feeding the replica failed");
                            return;
                        }
                        continue;
                    }
                    if fed.changed().await.is_err() {
                        return;
                    }
                }
            }
        });
        let session: Session = self
            .world
            .coord
            .session(&name, SESSION_TIMEOUT)
            .await
            .map_err(|e| self.fail(format!("{name}: no session: {e}")))?;
        self.nodes[i] = Some(Node {
            node,
            parts,
            session,
            feeder,
        });
        self.log(format!("{name} started"));
        Ok(())
    }

    async fn crash(&mut self, i: usize) -> Result<(), Failure> {
        let name = node_name(i);
        if let Some(node) = self.nodes[i].take() {
            let disk = self.world.disk(&name);
            if self.world.rng.random_bool(0.5)
                && disk
                    .wait_for_unsynced_write(Duration::from_millis(500))
                    .await
            {
                self.log(format!("{name} crashes right after a write"));
            }
            node.stop().await;
            self.world.coord.crash_node(&name);
            self.world.crash_disk(&name);
            self.crashes += 1;
            self.log(format!("{name} crashed"));
        }
        self.start_node(i).await
    }

    /// Kills, half of the time, an export whose commit file just appeared
    /// (each once). Most are COMPLETED already and stay so; one whose
    /// committer failed between the commit file and COMPLETED must be
    /// completed by the kill, never KILLED.
    async fn kill_on_commit_file(&mut self) {
        let Ok(store) = Location::from_store("sim://lake", self.world.lake_store.truth(), "")
        else {
            return;
        };
        let Ok(objects) = store.list("").await else {
            return;
        };
        let txs: Vec<String> = objects
            .iter()
            .filter_map(|(k, _)| {
                let file = k.rsplit('/').next()?;
                let tx = file.strip_prefix("commit_")?;
                tx.get(tx.len().checked_sub(30)?..).map(str::to_string)
            })
            .filter(|tx| self.asked.contains_key(tx) && !self.killed_on_commit.contains(tx))
            .collect();
        for tx in txs {
            self.killed_on_commit.insert(tx.clone());
            if !self.world.rng.random_bool(0.5) {
                continue;
            }
            let live: Vec<usize> = (0..NODES).filter(|i| self.nodes[*i].is_some()).collect();
            if live.is_empty() {
                return;
            }
            let i = live[self.world.rng.random_range(0..live.len())];
            self.log(format!("kill on the commit file of {tx}"));
            self.kill_tx(i, &tx).await;
        }
    }

    fn lake(&self) -> Lake {
        Lake(Arc::new(self.world.lake_store.clone()))
    }

    async fn export(&mut self, i: usize, partition: usize, destination: usize, force: bool) {
        let Some(node) = &self.nodes[i] else {
            return;
        };
        let partition = PARTITIONS[partition].to_string();
        let destination = DESTINATIONS[destination].to_string();
        let end = Lsn(self.wal.len() as u64);
        let random: u64 = self.world.rng.random();
        let now_ms = self.world.clock.unix_micros() / 1000;
        let tx = ferry_export::model::transaction_id(now_ms, random);
        let ids: BTreeSet<i64> = self
            .rows
            .iter()
            .filter(|(at, id)| *at <= end && partition_of(*id) == partition)
            .map(|(_, id)| *id)
            .collect();
        // A forced export replaces (kills) the one it finds.
        if force {
            for a in self.asked.values_mut() {
                if a.partition == partition && a.destination == destination {
                    a.maybe_killed = true;
                }
            }
        }
        self.asked.insert(
            tx.clone(),
            Asked {
                partition: partition.clone(),
                destination: destination.clone(),
                refused: false,
                ids,
                maybe_killed: false,
                killed: false,
            },
        );
        let lake = self.lake();
        let sessions = self.world.coord.factory(&node_name(i), SESSION_TIMEOUT);
        let result = Requester {
            session: &node.session,
            sessions: &sessions,
            parts: node.parts.as_ref(),
            destinations: &lake,
            replica_name: &node_name(i),
            now_unix_millis: now_ms,
            random,
            commit_lsn: end,
            wait: Duration::from_secs(10),
        }
        .export(&ExportRequest {
            table: "t".into(),
            partition_id: partition.clone(),
            destination: destination.clone(),
            force,
            settings: ExportSettings {
                retry_initial_backoff_ms: 100,
                retry_max_backoff_ms: 1000,
                ttl_seconds: 86_400,
                task_timeout_seconds: 86_400,
                ..ExportSettings::default()
            },
        })
        .await;
        match result {
            Ok(c) if c.unchanged.is_some() => self.log(format!(
                "export {tx} of {partition} to {destination} from n{i}: unchanged, {} holds its {} parts",
                c.unchanged.as_deref().unwrap_or_default(),
                c.parts_count
            )),
            Ok(c) => self.log(format!(
                "export {tx} of {partition} to {destination} from n{i}: {} parts, {} rows",
                c.parts_count, c.rows
            )),
            Err(e) => {
                if let Some(a) = self.asked.get_mut(&tx) {
                    a.refused = true;
                }
                self.log(format!(
                    "export {tx} of {partition} to {destination} from n{i} refused: {e}"
                ))
            }
        }
    }

    async fn kill(&mut self, i: usize, pick: usize) {
        if self.nodes[i].is_none() {
            return;
        }
        if self.asked.is_empty() {
            return;
        }
        // Mostly exports that exist (or may).
        let live: Vec<(&String, &Asked)> = self
            .asked
            .iter()
            .filter(|(_, a)| !a.refused || pick.is_multiple_of(4))
            .collect();
        if live.is_empty() {
            return;
        }
        let tx = live[pick % live.len()].0.clone();
        self.kill_tx(i, &tx).await;
    }

    /// Kills the export `tx` from node `i` (in a session of its own, as
    /// `ferry export kill` does).
    async fn kill_tx(&mut self, i: usize, tx: &str) {
        let Some(a) = self.asked.get(tx) else {
            return;
        };
        let (tx, partition, dest) = (tx.to_string(), a.partition.clone(), a.destination.clone());
        let key = TaskKey::new("t", &partition, &dest);
        let Ok(location) = self.lake().open(&dest) else {
            return;
        };
        let destination = Destination::new(location);
        let sessions = self.world.coord.factory(&node_name(i), SESSION_TIMEOUT);
        let result = ferry_export::task::kill_in_own_session(
            &sessions,
            &key,
            Some(&tx),
            &destination,
            "schedule",
        )
        .await;
        let line = match &result {
            Ok(s) => format!("kill {tx} from n{i}: {s}"),
            Err(e) => format!("kill {tx} from n{i}: {e}"),
        };
        if let Some(a) = self.asked.get_mut(&tx) {
            match result {
                Ok(TaskStatus::Killed) => {
                    a.maybe_killed = true;
                    a.killed = true;
                }
                Ok(_) | Err(ferry_export::task::KillError::NotFound(_)) => {}
                Err(ferry_export::task::KillError::OtherTransaction { .. }) => {}
                Err(_) => a.maybe_killed = true,
            }
        }
        self.log(line);
    }

    async fn apply(&mut self, event: &Event) -> Result<(), Failure> {
        match event {
            Event::Insert(rows) => self.insert(*rows),
            Event::Export {
                node,
                partition,
                destination,
                force,
            } => self.export(*node, *partition, *destination, *force).await,
            Event::Kill { node, pick } => self.kill(*node, *pick).await,
            Event::Crash(i) => self.crash(*i).await?,
            Event::ExpireSession(i) => {
                let n = self
                    .world
                    .coord
                    .expire_node(&node_name(*i))
                    .await
                    .unwrap_or(0);
                self.log(format!("{} sessions of n{i} expired", n));
                // The request session is replaced.
                if let Some(node) = &mut self.nodes[*i] {
                    if let Ok(s) = self
                        .world
                        .coord
                        .session(&node_name(*i), SESSION_TIMEOUT)
                        .await
                    {
                        node.session = s;
                    }
                }
            }
            Event::PartitionCoord(i) => self.world.coord.partition(&node_name(*i)),
            Event::Repair => self.world.coord.repair_all(),
        }
        Ok(())
    }

    /// Every task in coordination, by transaction id, with its status.
    async fn tasks(
        &self,
        session: &Session,
    ) -> Result<
        BTreeMap<
            String,
            (
                TaskKey,
                Option<TaskStatus>,
                Option<ferry_export::model::Metadata>,
            ),
        >,
        String,
    > {
        let mut out = BTreeMap::new();
        let keys = match session.children("/ferry/tables/t/exports").await {
            Ok((k, _)) => k,
            Err(ferry_coord::CoordError::NoNode { .. }) => Vec::new(),
            Err(e) => return Err(e.to_string()),
        };
        for k in keys {
            let key = TaskKey {
                table: "t".into(),
                key: k,
            };
            if let Some(head) = ferry_export::task::read_head(session, &key)
                .await
                .map_err(|e| e.to_string())?
            {
                out.insert(
                    head.transaction_id.clone(),
                    (key, head.status, head.metadata),
                );
            }
        }
        Ok(out)
    }

    /// Faults stop; every node runs; every task must become terminal.
    async fn settle(&mut self) -> Result<Session, Failure> {
        self.world.coord.set_faults(CoordFaults::default());
        self.world.lake_store.set_faults(ObjectFaults::default());
        self.world.coord.repair_all();
        for i in 0..NODES {
            if self.nodes[i].is_none() {
                self.start_node(i).await?;
            }
        }
        let checker = self
            .world
            .coord
            .factory("checker", Duration::from_secs(600))
            .open()
            .await
            .map_err(|e| self.fail(format!("checker session: {e}")))?;
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let tasks = self.tasks(&checker).await.map_err(|e| self.fail(e))?;
            let pending: Vec<String> = tasks
                .iter()
                .filter(|(_, (_, s, _))| !s.is_some_and(|s| s.is_terminal()))
                .map(|(tx, (k, s, _))| format!("{k} {tx} {s:?}"))
                .collect();
            if pending.is_empty() {
                return Ok(checker);
            }
            if Instant::now() > deadline {
                return Err(self.fail(format!(
                    "tasks not terminal 300 s after faults stopped: {pending:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn check(&mut self, checker: &Session) -> Result<(usize, usize), Failure> {
        let tasks = self.tasks(checker).await.map_err(|e| self.fail(e))?;
        let store = Location::from_store("sim://lake", self.world.lake_store.truth(), "")
            .map_err(|e| self.fail(format!("the lake: {e}")))?;
        let objects: Vec<(String, u64)> = store
            .list("")
            .await
            .map_err(|e| self.fail(format!("listing the lake: {e}")))?;
        let sizes: BTreeMap<String, u64> = objects.iter().cloned().collect();
        // One checksum per part name.
        let mut by_part: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (k, _) in &objects {
            if let Some(file) = k
                .rsplit('/')
                .next()
                .and_then(|f| f.strip_suffix(".parquet"))
            {
                if let Some((part, sum)) = file.rsplit_once('_') {
                    by_part
                        .entry(part.to_string())
                        .or_default()
                        .insert(sum.to_string());
                }
            }
        }
        if let Some((part, sums)) = by_part.iter().find(|(_, s)| s.len() > 1) {
            return Err(self.fail(format!("part {part} written under several names: {sums:?}")));
        }
        let mut completed = 0;
        let mut killed = 0;
        // (destination folder, partition) -> every commit file with its rows.
        type Commits = Vec<(String, BTreeSet<i64>)>;
        let mut by_partition: BTreeMap<(String, String), Commits> = BTreeMap::new();
        // Every commit file.
        let is_commit = |k: &str| {
            k.rsplit('/')
                .next()
                .is_some_and(|f| f.starts_with("commit_"))
        };
        for (k, _) in objects.iter().filter(|(k, _)| is_commit(k)) {
            let prefix = k.split('/').next().unwrap_or_default().to_string();
            let data = store
                .get(k)
                .await
                .map_err(|e| self.fail(format!("{k}: {e}")))?;
            let commit: CommitFile = serde_json::from_slice(&data)
                .map_err(|e| self.fail(format!("{k} is not a commit file: {e}")))?;
            let tx = commit.transaction_id.clone();
            let Some(asked) = self.asked.get(&tx).cloned() else {
                return Err(self.fail(format!("{k}: a commit file of an export never asked for")));
            };
            if asked.killed {
                return Err(self.fail(format!(
                    "{k}: a commit file of an export killed (KILLED answered)"
                )));
            }
            if let Some((_, status, metadata)) = tasks.get(&tx) {
                if *status != Some(TaskStatus::Completed) {
                    return Err(
                        self.fail(format!("{k}: a commit file of a task that is {status:?}"))
                    );
                }
                if let Some(m) = metadata {
                    let key = TaskKey::new("t", &m.partition_id, &m.destination);
                    let parts = ferry_export::task::read_parts(checker, &key, m)
                        .await
                        .map_err(|e| self.fail(format!("{key}: parts: {e}")))?;
                    let listed: BTreeSet<String> = commit
                        .files
                        .iter()
                        .filter_map(|f| {
                            let file = f.path.rsplit('/').next()?.strip_suffix(".parquet")?;
                            Some(file.rsplit_once('_')?.0.to_string())
                        })
                        .collect();
                    let snapshot: BTreeSet<String> = parts.iter().map(|p| p.name.clone()).collect();
                    if listed != snapshot || commit.files.len() != parts.len() {
                        return Err(self.fail(format!(
                            "{k} lists {} files ({} parts) for a snapshot of {} parts",
                            commit.files.len(),
                            listed.len(),
                            parts.len()
                        )));
                    }
                }
            }
            let mut ids = Vec::new();
            for f in &commit.files {
                let path = format!("{prefix}/{}", f.path);
                match sizes.get(&path) {
                    Some(s) if *s == f.bytes => {}
                    other => {
                        return Err(self.fail(format!(
                            "{k} lists {} of {} bytes; the lake has {other:?}",
                            f.path, f.bytes
                        )))
                    }
                }
                let bytes = store
                    .get(&path)
                    .await
                    .map_err(|e| self.fail(format!("{}: {e}", f.path)))?;
                let name = f
                    .path
                    .rsplit('/')
                    .next()
                    .and_then(|f| f.strip_suffix(".parquet"))
                    .and_then(|f| f.rsplit_once('_'))
                    .and_then(|(p, _)| ferry_replica::PartName::parse(p))
                    .ok_or_else(|| self.fail(format!("{}: not a data file name", f.path)))?;
                let batches = ferry_replica::part::read_rows(&name, bytes)
                    .map_err(|e| self.fail(format!("{}: {e}", f.path)))?;
                for b in &batches {
                    let col = b.column(0).as_primitive::<Int64Type>();
                    ids.extend((0..col.len()).map(|j| col.value(j)));
                }
            }
            let unique: BTreeSet<i64> = ids.iter().copied().collect();
            if unique.len() != ids.len() {
                return Err(self.fail(format!(
                    "{k}: {} rows more than once",
                    ids.len() - unique.len()
                )));
            }
            if unique != asked.ids {
                let missing: Vec<&i64> = asked.ids.difference(&unique).take(5).collect();
                let extra: Vec<&i64> = unique.difference(&asked.ids).take(5).collect();
                return Err(self.fail(format!(
                    "{k} holds {} rows, the partition had {} at the request (missing e.g. {missing:?}, extra e.g. {extra:?})",
                    unique.len(),
                    asked.ids.len()
                )));
            }
            by_partition
                .entry((prefix, commit.partition_id.clone()))
                .or_default()
                .push((k.clone(), unique));
            completed += 1;
        }
        // What a reader reads: of every partition, the current commit (and
        // nothing else), which holds every row any commit of it holds.
        for ((prefix, partition), commits) in &by_partition {
            let dest = Location::from_store("sim://lake", self.world.lake_store.truth(), prefix)
                .map_err(|e| self.fail(format!("the lake: {e}")))?;
            let view = ferry_export::lake::read(&dest, Some(partition))
                .await
                .map_err(|e| self.fail(format!("reading {prefix}: {e}")))?;
            let Some(current) = view.partitions.first() else {
                return Err(self.fail(format!("{prefix}: no current commit of {partition}")));
            };
            let key = format!("{prefix}/{}", current.current.key);
            let Some((_, rows)) = commits.iter().find(|(k, _)| *k == key) else {
                return Err(self.fail(format!("{key}: current but not found")));
            };
            for (other, ids) in commits {
                if let Some(id) = ids.difference(rows).next() {
                    return Err(self.fail(format!(
                        "a reader of {prefix} partition {partition} reads {key}, which lacks row {id} of {other}"
                    )));
                }
            }
        }
        // Every task: terminal, and COMPLETED unless the schedule killed it.
        for (tx, (key, status, _)) in &tasks {
            let asked = self.asked.get(tx);
            let committed = objects
                .iter()
                .any(|(k, _)| is_commit(k) && k.ends_with(tx.as_str()));
            match status {
                Some(TaskStatus::Completed) if !committed => {
                    return Err(self.fail(format!("{key} {tx} is COMPLETED without a commit file")))
                }
                Some(TaskStatus::Completed) => {}
                Some(TaskStatus::Killed) => {
                    killed += 1;
                    if !asked.is_some_and(|a| a.maybe_killed) {
                        return Err(
                            self.fail(format!("{key} {tx} is KILLED though nobody killed it"))
                        );
                    }
                }
                other => {
                    return Err(self.fail(format!("{key} {tx} ended {other:?}")));
                }
            }
        }
        self.check_ephemerals(checker).await?;
        Ok((completed, killed))
    }

    /// No lock outlives its owner's session: every ephemeral node of the
    /// export protocol (the cleanup lock, commit locks, part locks, worker
    /// registrations) belongs to a session the store holds alive.
    async fn check_ephemerals(&self, checker: &Session) -> Result<(), Failure> {
        let live: BTreeSet<i64> = self
            .world
            .coord
            .live_sessions()
            .await
            .map_err(|e| self.fail(format!("live sessions: {e}")))?
            .into_iter()
            .collect();
        let table = "/ferry/tables/t";
        let mut paths = vec![format!("{table}/exports_cleanup_lock")];
        let keys = match checker.children(&format!("{table}/exports")).await {
            Ok((k, _)) => k,
            Err(ferry_coord::CoordError::NoNode { .. }) => Vec::new(),
            Err(e) => return Err(self.fail(format!("exports: {e}"))),
        };
        for k in keys {
            let base = format!("{table}/exports/{k}");
            paths.push(format!("{base}/commit_lock"));
            for dir in ["locks", "workers"] {
                match checker.children(&format!("{base}/{dir}")).await {
                    Ok((names, _)) => {
                        paths.extend(names.iter().map(|n| format!("{base}/{dir}/{n}")))
                    }
                    Err(ferry_coord::CoordError::NoNode { .. }) => {}
                    Err(e) => return Err(self.fail(format!("{base}/{dir}: {e}"))),
                }
            }
        }
        for path in paths {
            let stat = checker
                .exists(&path)
                .await
                .map_err(|e| self.fail(format!("{path}: {e}")))?;
            if let Some(stat) = stat {
                if stat.ephemeral_owner == 0 {
                    return Err(self.fail(format!("{path} is not ephemeral")));
                }
                if !live.contains(&stat.ephemeral_owner) {
                    return Err(self.fail(format!(
                        "{path} outlived its session {:#x}",
                        stat.ephemeral_owner
                    )));
                }
            }
        }
        Ok(())
    }
}

pub fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    crate::run_seeded(seed, run_seed_async(seed, verbose))
}

async fn run_seed_async(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x6578_706f_7274_2121);
    let events = generate(&mut rng);
    let world = World::new(
        seed,
        &mut rng,
        NetOptions::default(),
        CoordFaults {
            fail_before_prob: 0.02,
            fail_after_prob: 0.02,
            ..CoordFaults::default()
        },
        ObjectFaults {
            min_latency: Duration::from_millis(2),
            max_latency: Duration::from_millis(150),
            fail_prob: 0.05,
            fail_after_write_prob: 0.05,
            multipart: false,
            deletes: false,
        },
        verbose,
    )
    .await?;
    let (fed, _) = watch::channel(Bytes::new());
    let mut sim = Sim {
        world,
        nodes: (0..NODES).map(|_| None).collect(),
        wal: BytesMut::new(),
        fed,
        rows: Vec::new(),
        next_id: 0,
        asked: BTreeMap::new(),
        killed_on_commit: BTreeSet::new(),
        crashes: 0,
    };
    sim.log(format!("seed {seed}: {} events", events.len()));
    let setup = sim
        .world
        .coord
        .factory("setup", Duration::from_secs(600))
        .open()
        .await
        .map_err(|e| sim.fail(format!("setup session: {e}")))?;
    // The table exists before anything runs (set up without faults).
    let mut attempts = 0;
    loop {
        let r = async {
            ferry_coord::create_all(setup.as_ref(), "/ferry/tables").await?;
            match setup
                .create(
                    "/ferry/tables/t",
                    &serde_json::to_vec(&table()).expect("json"),
                    ferry_coord::CreateMode::Persistent,
                )
                .await
            {
                Ok(_) | Err(ferry_coord::CoordError::NodeExists { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        }
        .await;
        match r {
            Ok(()) => break,
            Err(e) if attempts < 20 => {
                attempts += 1;
                tracing::debug!(error = %e, "setup retried");
            }
            Err(e) => return Err(sim.fail(format!("setting up the table: {e}"))),
        }
    }
    for i in 0..NODES {
        sim.start_node(i).await?;
    }
    for (at, event) in &events {
        // Between events, an export whose commit file is written while its
        // status is not COMPLETED yet (the committer failed or crashed in
        // between) is killed half of the time: the kill must complete it.
        let due = sim.world.start + *at;
        while tokio::time::Instant::now() + COMMIT_WATCH_STEP < due {
            tokio::time::sleep(COMMIT_WATCH_STEP).await;
            sim.kill_on_commit_file().await;
        }
        tokio::time::sleep_until(due).await;
        sim.log(format!("{event:?}"));
        sim.apply(event).await?;
    }
    let checker = sim.settle().await?;
    let (completed, killed) = sim.check(&checker).await?;
    sim.log(format!(
        "settled: {} exports asked, {completed} commit files checked, {killed} killed",
        sim.asked.len()
    ));
    for node in sim.nodes.iter_mut().filter_map(Option::take) {
        node.stop().await;
    }
    let log_hash = sim
        .world
        .log_lines()
        .iter()
        .fold(0u32, |h, line| crc32c::crc32c_append(h, line.as_bytes()));
    Ok(Outcome {
        seed,
        events: events.len(),
        simulated: sim.world.start.elapsed(),
        exports: sim.asked.len(),
        completed,
        killed,
        crashes: sim.crashes,
        injected_object_faults: sim.world.lake_store.injected_faults(),
        log_hash,
        log: sim.world.into_log(),
    })
}
