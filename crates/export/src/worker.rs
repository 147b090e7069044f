//! The exporter of one node: a mirror of every export task kept current by
//! watches, the scheduling of the parts this node holds, uploads, the
//! success and failure transactions, commits, and cleanup.
//!
//! Invariants (each one relied on by the exactly-once argument in
//! ARCHITECTURE.md):
//! * A part is uploaded only under its `locks/<part>` ephemeral, taken by a
//!   multi that also sets `processing/<part>`: a part already exported (its
//!   processing entry gone) cannot be claimed, so the claim alone tells a
//!   replica that another finished it.
//! * The success multi deletes `processing/<part>`, creates
//!   `processed/<part>`, deletes the lock (checked at version 0) and checks
//!   `status` at version 0 (still PENDING): after a kill no part moves.
//! * Uploads of a task stop when it leaves PENDING, when it disappears, and
//!   when the session that held their locks ends.
//! * Back-off is per replica and in memory; it never holds a lock, so
//!   another replica may take the part meanwhile.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_coord::{
    CoordError, CountedSession, CreateMode, Op, OpResult, Session, SessionFactory, Watch,
};
use ferry_env::{Clock, Cpu};
use ferry_replica::PartName;
use ferry_storage::UploadBudget;
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::dest::{Destination, PartFailure};
use crate::local::{Destinations, LocalParts};
use crate::model::{
    cleanup_lock_path, exports_path, DataFile, ExceptionRecord, Metadata, Processed, Retries,
    TaskKey, TaskStatus, TABLES,
};
use crate::task::{self, CommitOutcome, HeldLock};

/// How an exporter behaves; the defaults suit production.
#[derive(Debug, Clone)]
pub struct ExporterConfig {
    /// This node's name: lock owner, `finished_by`, exception records.
    pub replica_name: String,
    /// How often parts are scheduled and due refreshes run.
    pub tick: Duration,
    /// How often the cleanup lock is tried and its duties done.
    pub cleanup_interval: Duration,
    /// A full re-read of every table's task list, in case a watch was lost.
    pub safety_poll: Duration,
    /// Uploads this node runs at once over all tasks.
    pub max_uploads: usize,
    pub upload_budget: UploadBudget,
    /// A task without `status` (its creator died mid-way) older than this is
    /// removed by cleanup.
    pub creating_grace: Duration,
    /// Most tasks mirrored (further ones are seen once others are removed).
    pub max_tasks: usize,
}

impl ExporterConfig {
    pub fn new(replica_name: impl Into<String>) -> ExporterConfig {
        ExporterConfig {
            replica_name: replica_name.into(),
            tick: Duration::from_millis(500),
            cleanup_interval: Duration::from_secs(5),
            safety_poll: Duration::from_secs(30),
            max_uploads: 8,
            upload_budget: UploadBudget::default(),
            creating_grace: Duration::from_secs(600),
            max_tasks: 10_000,
        }
    }
}

/// One row of the status listing (SPEC.md section 5), served from the
/// mirror.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct TaskView {
    pub table: String,
    pub key: String,
    pub partition_id: String,
    pub destination: String,
    pub transaction_id: String,
    pub create_time: u64,
    pub source_replica: String,
    /// The first parts of the snapshot (at most [`VIEW_PARTS`]).
    pub parts: Vec<String>,
    pub parts_count: u64,
    pub parts_to_do: u64,
    pub rows: u64,
    pub status: TaskStatus,
    pub last_exception: Option<ViewException>,
    pub exception_count: u64,
    /// This node's back-off per part.
    pub backoff: Vec<ViewBackoff>,
    /// Parts this node is exporting now.
    pub running: Vec<String>,
    /// The commit file, once COMPLETED.
    pub commit_file: Option<String>,
    /// Coordination requests this node sent for the task (mirroring,
    /// claims, moves, failures, progress, commit).
    pub coordination_ops: u64,
}

pub const VIEW_PARTS: usize = 100;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ViewException {
    pub replica: String,
    pub part: String,
    pub message: String,
    pub time: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ViewBackoff {
    pub part: String,
    pub attempts: u32,
    pub retry_in_ms: u64,
}

/// Counters of a node's exporter.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ExporterCounters {
    pub parts_exported: u64,
    pub bytes_exported: u64,
    pub failures_retryable: u64,
    pub failures_fatal: u64,
    pub commits: u64,
    pub claims_lost: u64,
    pub sessions: u64,
    /// Coordination requests this exporter sent, all tasks and duties.
    pub coordination_ops: u64,
}

/// What the exporter shows: every task it mirrors, ordered by create_time.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ExportsView {
    pub tasks: Vec<TaskView>,
    pub counters: ExporterCounters,
}

#[derive(Clone)]
enum Event {
    Tables,
    /// The status of a task being created appeared (or the task went).
    Created(TaskKey),
    Exports(String),
    Status(TaskKey),
    /// The task's `processing` node changed (a part finished).
    Progress(TaskKey),
    /// An exception was recorded.
    Exceptions(TaskKey),
    /// The task's `workers/` changed (an exporter joined or left).
    Workers(TaskKey),
}

struct Backoff {
    attempts: u32,
    until: Instant,
}

struct Task {
    key: TaskKey,
    metadata: Metadata,
    status: TaskStatus,
    destination: Option<Destination>,
    /// Parts to try here, in this node's order.
    todo: Todo,
    /// When `todo` was last pruned of parts others finished.
    pruned: Option<Instant>,
    snapshot_names: Vec<String>,
    running: BTreeMap<String, tokio::task::AbortHandle>,
    backoff: BTreeMap<String, Backoff>,
    /// Parts another replica held a lock on at the last try.
    busy: BTreeMap<String, Instant>,
    parts_to_do: u64,
    exceptions: BTreeMap<String, ExceptionRecord>,
    commit_file: Option<String>,
    progress_due: bool,
    exceptions_due: bool,
    /// Watches set and not yet fired (one of each per task and session).
    progress_armed: bool,
    exceptions_armed: bool,
    /// Commit to try at the next tick (this node finished its parts).
    commit_due: bool,
    /// Set once this node found the destination's schema marker to match
    /// the task's columns (or wrote it): checked before the first upload
    /// here, not before every one.
    schema_checked: Arc<tokio::sync::OnceCell<()>>,
    /// Coordination requests this node sent for the task.
    coordination_ops: u64,
}

struct Done {
    key: TaskKey,
    part: String,
    result: Result<DataFile, PartFailure>,
}

/// The exporter of a node.
pub struct Exporter {
    config: ExporterConfig,
    sessions: Arc<dyn SessionFactory>,
    clock: Arc<dyn Clock>,
    cpu: Cpu,
    parts: Arc<dyn LocalParts>,
    destinations: Arc<dyn Destinations>,
    view: watch::Sender<ExportsView>,
}

impl Exporter {
    pub fn new(
        config: ExporterConfig,
        sessions: Arc<dyn SessionFactory>,
        clock: Arc<dyn Clock>,
        cpu: Cpu,
        parts: Arc<dyn LocalParts>,
        destinations: Arc<dyn Destinations>,
    ) -> Exporter {
        Exporter {
            config,
            sessions,
            clock,
            cpu,
            parts,
            destinations,
            view: watch::channel(ExportsView::default()).0,
        }
    }

    /// The status listing, kept current by [`run`](Self::run).
    pub fn subscribe(&self) -> watch::Receiver<ExportsView> {
        self.view.subscribe()
    }

    /// Runs until the task is dropped: a session at a time, each one
    /// rebuilding the mirror from coordination.
    pub async fn run(self) {
        let mut counters = ExporterCounters::default();
        loop {
            let session = match self.sessions.open().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "exporter: no coordination session; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            counters.sessions += 1;
            let counted = CountedSession::new(Arc::clone(&session));
            let (events_tx, events_rx) = mpsc::channel::<Event>(EVENT_QUEUE);
            let mut run = Run {
                ex: &self,
                session: Arc::clone(&counted) as Session,
                counted,
                tasks: BTreeMap::new(),
                tables: BTreeSet::new(),
                uploads: JoinSet::new(),
                cleanup_locks: BTreeMap::new(),
                counters: std::mem::take(&mut counters),
                creating: BTreeSet::new(),
                retry_events: Vec::new(),
                mirror_complete: false,
                events: events_tx,
                events_rx: Some(events_rx),
            };
            let reason = run.serve().await;
            tracing::info!(reason = %reason, "exporter session ended; starting again with a new one");
            run.uploads.abort_all();
            counters = std::mem::take(&mut run.counters);
            counters.coordination_ops += run.counted.round_trips();
            drop(run);
            session.close().await;
        }
    }
}

struct Run<'a> {
    ex: &'a Exporter,
    /// `counted`, as node code uses it.
    session: Session,
    /// Counts this session's requests, charged to the task they were for.
    counted: Arc<CountedSession>,
    tasks: BTreeMap<TaskKey, Task>,
    tables: BTreeSet<String>,
    uploads: JoinSet<Done>,
    cleanup_locks: BTreeMap<String, HeldLock>,
    counters: ExporterCounters,
    /// Tasks without status yet whose status creation is watched.
    creating: BTreeSet<TaskKey>,
    /// Events whose handling failed, handled again at the next tick.
    retry_events: Vec<Event>,
    /// The last load saw every task (pins are released only then).
    mirror_complete: bool,
    events: mpsc::Sender<Event>,
    events_rx: Option<mpsc::Receiver<Event>>,
}

/// Events waiting at once (watches fire at most once each; this bounds the
/// forwarding tasks' sends, not their number).
const EVENT_QUEUE: usize = 4096;

/// Age past which a pin without a PENDING task is released (see
/// `load_tables`).
pub const ORPHAN_PIN_AGE: Duration = Duration::from_secs(600);

fn forward(tx: &mpsc::Sender<Event>, watch: Watch, event: Event) {
    let tx = tx.clone();
    tokio::spawn(async move {
        let _ = watch.changed().await;
        let _ = tx.send(event).await;
    });
}

/// A node's hash of a part: its place in the node's order, and its weight
/// in the rendezvous that draws shares. The two CRCs are mixed (splitmix64's
/// finaliser): CRC alone is affine, which would favour some node names.
fn order(replica: &str, part: &str) -> u64 {
    let mut x = (u64::from(crc32c::crc32c(replica.as_bytes())) << 32)
        | u64::from(crc32c::crc32c(part.as_bytes()));
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Where a part stands in a node's order: its share first (0), then the
/// other workers' shares (1), each by the node's own hash, so that nodes
/// done with their shares spread over the others' parts instead of all
/// meeting at the same ones.
type Rank = (u8, u64);

/// Candidates a schedule takes from the order beyond the slots it fills.
const SCAN_BATCH: usize = 16;

/// The part's owner among `workers` (rendezvous hashing: each part goes
/// to the worker whose hash with it is highest, so a worker joining or
/// leaving moves only its own share).
fn owner<'w>(workers: &'w [String], part: &str) -> Option<&'w str> {
    workers
        .iter()
        .max_by_key(|w| order(w, part))
        .map(String::as_str)
}

fn rank(me: &str, workers: &[String], part: &str) -> Rank {
    match owner(workers, part) {
        Some(o) if o != me && workers.iter().any(|w| w == me) => (1, order(me, part)),
        _ => (0, order(me, part)),
    }
}

/// The parts a node holds and has not seen exported, in its order (see
/// [`Rank`]; the name breaks ties), with removal by name in O(log n).
#[derive(Default)]
struct Todo {
    by_rank: BTreeSet<(Rank, String)>,
    ranks: std::collections::HashMap<String, Rank>,
}

impl Todo {
    /// Adds a part at its own-share rank until `rank` knows the workers.
    fn insert(&mut self, part: String) {
        let r = (0, order("", &part));
        self.remove(&part);
        self.ranks.insert(part.clone(), r);
        self.by_rank.insert((r, part));
    }

    fn remove(&mut self, part: &str) -> bool {
        match self.ranks.remove(part) {
            Some(r) => self.by_rank.remove(&(r, part.to_string())),
            None => false,
        }
    }

    fn len(&self) -> usize {
        self.by_rank.len()
    }

    fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.by_rank.retain(|(_, p)| keep(p));
        self.ranks.retain(|p, _| keep(p));
    }

    fn is_empty(&self) -> bool {
        self.by_rank.is_empty()
    }

    fn clear(&mut self) {
        self.by_rank.clear();
        self.ranks.clear();
    }

    /// Orders the parts for `me` among `workers`.
    fn rank(&mut self, me: &str, workers: &[String]) {
        let parts = std::mem::take(&mut self.by_rank);
        self.ranks.clear();
        for (_, p) in parts {
            let r = rank(me, workers, &p);
            self.ranks.insert(p.clone(), r);
            self.by_rank.insert((r, p));
        }
        assert_eq!(self.ranks.len(), self.by_rank.len(), "one rank per part");
    }

    /// The parts past `after`, in order.
    fn after<'a>(
        &'a self,
        after: Option<&(Rank, String)>,
    ) -> impl Iterator<Item = &'a (Rank, String)> + 'a {
        use std::ops::Bound;
        let from = match after {
            Some(c) => Bound::Excluded(c.clone()),
            None => Bound::Unbounded,
        };
        self.by_rank.range((from, Bound::Unbounded))
    }
}

fn is_session_end(e: &CoordError) -> bool {
    matches!(
        e.root(),
        CoordError::SessionExpired | CoordError::SessionClosed
    )
}

impl Run<'_> {
    fn name(&self) -> &str {
        &self.ex.config.replica_name
    }

    async fn serve(&mut self) -> String {
        let mut rx = match self.events_rx.take() {
            Some(rx) => rx,
            None => return "no event queue".into(),
        };
        let mut state = self.session.session_state();
        let mut loaded = match self.load_tables().await {
            Ok(()) => true,
            Err(e) if is_session_end(&e) => return format!("loading export tasks: {e}"),
            Err(e) => {
                tracing::debug!(error = %e, "loading export tasks failed; retried at the next tick");
                false
            }
        };
        let mut tick = tokio::time::interval(self.ex.config.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next_cleanup = Instant::now();
        let mut next_poll = Instant::now() + self.ex.config.safety_poll;
        loop {
            self.publish();
            let result: Result<(), CoordError> = tokio::select! {
                biased;
                changed = state.changed() => {
                    let now = *state.borrow_and_update();
                    if changed.is_err() || now.is_terminal() {
                        return format!("session {now:?}");
                    }
                    Ok(())
                }
                Some(done) = self.uploads.join_next(), if !self.uploads.is_empty() => {
                    match done {
                        Ok(done) => self.finish(done).await,
                        Err(e) if e.is_cancelled() => Ok(()),
                        Err(e) => {
                            tracing::error!(error = %e, "an export upload panicked");
                            Ok(())
                        }
                    }
                }
                Some(event) = rx.recv() => {
                    // A watch fires once: an event whose reads failed is
                    // handled again at the next tick, or the mirror would
                    // keep a task that changed or went.
                    let r = self.handle(event.clone()).await;
                    if r.is_err() && self.retry_events.len() < EVENT_QUEUE {
                        self.retry_events.push(event);
                    }
                    // A task just mirrored, or parts freed by a worker that
                    // left, start now rather than at the next tick.
                    match r {
                        Ok(()) => self.schedule().await,
                        e => e,
                    }
                }
                _ = tick.tick() => {
                    let now = Instant::now();
                    let mut r = Ok(());
                    for event in std::mem::take(&mut self.retry_events) {
                        if r.is_ok() {
                            r = self.handle(event).await;
                        } else {
                            self.retry_events.push(event);
                        }
                    }
                    if r.is_ok() {
                        r = self.tick().await;
                    }
                    if r.is_ok() && now >= next_cleanup {
                        next_cleanup = now + self.ex.config.cleanup_interval;
                        r = self.cleanup().await;
                    }
                    if r.is_ok() && (now >= next_poll || !loaded) {
                        next_poll = now + self.ex.config.safety_poll;
                        r = self.load_tables().await;
                        if r.is_ok() {
                            r = self.verify_mirror().await;
                        }
                        loaded = r.is_ok();
                    }
                    r
                }
            };
            if let Err(e) = result {
                if is_session_end(&e) {
                    return e.to_string();
                }
                tracing::debug!(error = %e, "exporter step failed; retried at the next tick");
            }
        }
    }

    async fn handle(&mut self, event: Event) -> Result<(), CoordError> {
        match event {
            Event::Tables => self.load_tables().await,
            Event::Exports(table) => self.load_exports(&table).await,
            Event::Created(key) => {
                self.creating.remove(&key);
                self.load_exports(&key.table).await
            }
            Event::Status(key) => {
                let since = self.trips();
                let r = self.refresh_status(&key).await;
                self.charge(&key, since);
                r
            }
            Event::Progress(key) => {
                if let Some(t) = self.tasks.get_mut(&key) {
                    t.progress_due = true;
                    t.progress_armed = false;
                }
                Ok(())
            }
            Event::Workers(key) => {
                let since = self.trips();
                let r = self.refresh_workers(&key).await;
                self.charge(&key, since);
                r
            }
            Event::Exceptions(key) => {
                if let Some(t) = self.tasks.get_mut(&key) {
                    t.exceptions_due = true;
                    t.exceptions_armed = false;
                }
                Ok(())
            }
        }
    }

    async fn load_tables(&mut self) -> Result<(), CoordError> {
        let tx = &self.events.clone();
        let (tables, _, watch) = match self.session.children_watch(TABLES).await {
            Ok(r) => r,
            Err(CoordError::NoNode { .. }) => {
                let (_, w) = self.session.exists_watch(TABLES).await?;
                forward(tx, w, Event::Tables);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        forward(tx, watch, Event::Tables);
        self.tables = tables.iter().cloned().collect();
        self.mirror_complete = true;
        for t in tables {
            self.load_exports(&t).await?;
        }
        // Tasks of dropped tables.
        let gone: Vec<TaskKey> = self
            .tasks
            .keys()
            .filter(|k| !self.tables.contains(&k.table))
            .cloned()
            .collect();
        for k in gone {
            self.forget(&k).await;
        }
        // Pins of exports that do not exist: removed while this node was
        // down, or taken by a request whose task was never created (the
        // requester died before releasing them). A request creates its task
        // within seconds of its transaction id's time, so a pin older than
        // ORPHAN_PIN_AGE without a PENDING task in the complete mirror is
        // an orphan.
        let live: BTreeSet<String> = self
            .tasks
            .values()
            .filter(|t| t.status == TaskStatus::Pending)
            .map(|t| t.metadata.transaction_id.clone())
            .collect();
        if !self.mirror_complete {
            return Ok(());
        }
        let now_ms = self.ex.clock.unix_micros() / 1000;
        for tx_id in self.ex.parts.pinned().await {
            let old = crate::model::transaction_millis(&tx_id)
                .is_none_or(|ms| ms + ORPHAN_PIN_AGE.as_millis() as u64 <= now_ms);
            if !live.contains(&tx_id) && old {
                if let Err(e) = self.ex.parts.unpin(&tx_id).await {
                    tracing::warn!(transaction_id = %tx_id, error = %e, "could not release pins");
                }
            }
        }
        Ok(())
    }

    /// The safety poll's check of every mirrored task: one whose fence is
    /// gone (removed or replaced while a watch event was lost) is forgotten
    /// and its key read again.
    async fn verify_mirror(&mut self) -> Result<(), CoordError> {
        let keys: Vec<(TaskKey, String)> = self
            .tasks
            .iter()
            .map(|(k, t)| {
                (
                    k.clone(),
                    crate::model::fence_path(&k.path(), &t.metadata.transaction_id),
                )
            })
            .collect();
        for (key, fence) in keys {
            if self.session.exists(&fence).await?.is_none() {
                self.forget(&key).await;
                self.load_exports(&key.table).await?;
            }
        }
        Ok(())
    }

    async fn load_exports(&mut self, table: &str) -> Result<(), CoordError> {
        let tx = &self.events.clone();
        let path = exports_path(table);
        let keys = match self.session.children_watch(&path).await {
            Ok((keys, _, watch)) => {
                forward(tx, watch, Event::Exports(table.to_string()));
                keys
            }
            Err(CoordError::NoNode { .. }) => {
                // No export yet: watch for the first.
                match self.session.exists_watch(&path).await {
                    Ok((None, w)) => forward(tx, w, Event::Exports(table.to_string())),
                    Ok((Some(_), w)) => {
                        drop(w);
                        let _ = tx.try_send(Event::Exports(table.to_string()));
                    }
                    Err(CoordError::NoNode { .. }) => {}
                    Err(e) => return Err(e),
                }
                Vec::new()
            }
            Err(e) => return Err(e),
        };
        let present: BTreeSet<&String> = keys.iter().collect();
        let gone: Vec<TaskKey> = self
            .tasks
            .keys()
            .filter(|k| k.table == table && !present.contains(&k.key))
            .cloned()
            .collect();
        for k in gone {
            self.forget(&k).await;
        }
        for key in keys {
            let key = TaskKey {
                table: table.to_string(),
                key,
            };
            // A task replaced by a forced export is forgotten when its status
            // node goes (its watch fires), and then read again here.
            if self.tasks.contains_key(&key) || self.creating.contains(&key) {
                continue;
            }
            if self.tasks.len() >= self.ex.config.max_tasks {
                self.mirror_complete = false;
                break;
            }
            // One task that cannot be read (being removed, damaged) does not
            // keep the others from loading.
            match self.add(key.clone()).await {
                Ok(()) => {}
                Err(e) if is_session_end(&e) || matches!(e, CoordError::ConnectionLoss { .. }) => {
                    return Err(e)
                }
                Err(e) => {
                    self.mirror_complete = false;
                    tracing::debug!(task = %key, error = %e, "export task not loaded");
                }
            }
        }
        Ok(())
    }

    /// Loads a task into the mirror (a task still being created is left for
    /// its status watch... or cleanup).
    async fn add(&mut self, key: TaskKey) -> Result<(), CoordError> {
        let since = self.trips();
        let tx = self.events.clone();
        let tx = &tx;
        let status_path = format!("{}/status", key.path());
        let (status, watch) = match self.session.get_watch(&status_path).await {
            Ok((data, _, w)) => (TaskStatus::parse(&data), w),
            Err(CoordError::NoNode { .. }) => {
                // Being created: the status's creation fires this.
                if let Ok((_, w)) = self.session.exists_watch(&status_path).await {
                    forward(tx, w, Event::Created(key.clone()));
                    self.creating.insert(key);
                }
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let Some(status) = status else {
            tracing::warn!(task = %key, "export task with an unknown status; ignored");
            return Ok(());
        };
        let Some(head) = task::read_head(&self.session, &key).await? else {
            return Ok(());
        };
        let Some(metadata) = head.metadata else {
            return Ok(());
        };
        forward(tx, watch, Event::Status(key.clone()));
        let mut t = Task {
            key: key.clone(),
            status,
            destination: None,
            todo: Todo::default(),
            pruned: None,
            snapshot_names: Vec::new(),
            running: BTreeMap::new(),
            backoff: BTreeMap::new(),
            busy: BTreeMap::new(),
            parts_to_do: metadata.parts_count,
            exceptions: BTreeMap::new(),
            commit_file: None,
            progress_due: true,
            exceptions_due: true,
            progress_armed: false,
            exceptions_armed: false,
            commit_due: false,
            schema_checked: Arc::new(tokio::sync::OnceCell::new()),
            coordination_ops: 0,
            metadata,
        };
        let parts = task::read_parts(&self.session, &key, &t.metadata).await?;
        t.snapshot_names = parts.iter().map(|p| p.name.clone()).collect();
        if status == TaskStatus::Pending {
            match self.ex.destinations.open(&t.metadata.destination) {
                Ok(l) => t.destination = Some(Destination::new(l)),
                Err(e) => {
                    tracing::warn!(task = %key, error = %e, "export destination cannot be opened here");
                }
            }
            // Parts held here and not yet exported.
            let (left, _) = self
                .session
                .children(&format!("{}/processing", key.path()))
                .await?;
            let left: BTreeSet<String> = left.into_iter().collect();
            let mut held = Vec::new();
            for p in &parts {
                if !left.contains(&p.name) {
                    continue;
                }
                let Some(name) = PartName::parse(&p.name) else {
                    continue;
                };
                if self
                    .ex
                    .parts
                    .find(t.metadata.table_id, &name)
                    .await
                    .is_some()
                {
                    t.todo.insert(p.name.clone());
                    held.push(name);
                }
            }
            if !held.is_empty() {
                if let Err(e) = self
                    .ex
                    .parts
                    .pin(&t.metadata.transaction_id, t.metadata.table_id, &held)
                    .await
                {
                    tracing::warn!(task = %key, error = %e, "could not pin an export's parts");
                }
            }
            t.commit_due = left.is_empty();
            if !t.todo.is_empty() {
                let workers = self.join(&key).await?;
                t.todo.rank(self.name(), &workers);
            }
        } else {
            self.settle(&mut t).await;
        }
        tracing::debug!(task = %key, status = %t.status, todo = t.todo.len(), "export task mirrored");
        t.coordination_ops = self.trips() - since;
        self.tasks.insert(key, t);
        Ok(())
    }

    /// Joins the task's workers (an ephemeral `workers/<name>`, created only
    /// while the task is PENDING, so that a removal, which deletes `status`
    /// first, lists every worker it must delete) and lists them, watching
    /// for changes. Without `workers/` (a task created before it existed),
    /// or when the task is no longer PENDING, none are known and the parts
    /// go in this node's own order.
    async fn join(&self, key: &TaskKey) -> Result<Vec<String>, CoordError> {
        let dir = format!("{}/workers", key.path());
        let ops = vec![
            Op::create(
                format!("{dir}/{}", self.name()),
                Vec::new(),
                CreateMode::Ephemeral,
            ),
            Op::check(format!("{}/status", key.path()), 0),
        ];
        match self.session.multi(ops).await {
            Ok(_) => {}
            // Already there: this session's lost answer, or an earlier
            // session of this node that has not expired yet.
            Err(CoordError::MultiFailed { index: 0, .. })
                if matches!(
                    self.session.exists(&format!("{dir}/{}", self.name())).await,
                    Ok(Some(_))
                ) => {}
            Err(CoordError::MultiFailed { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        }
        match self.session.children_watch(&dir).await {
            Ok((mut names, _, w)) => {
                forward(&self.events, w, Event::Workers(key.clone()));
                names.sort();
                Ok(names)
            }
            Err(CoordError::NoNode { .. }) => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    /// The task's workers changed: the shares are drawn again.
    async fn refresh_workers(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get(key) else {
            return Ok(());
        };
        if t.status != TaskStatus::Pending || t.todo.is_empty() {
            return Ok(());
        }
        let dir = format!("{}/workers", key.path());
        let names = match self.session.children_watch(&dir).await {
            Ok((mut names, _, w)) => {
                forward(&self.events, w, Event::Workers(key.clone()));
                names.sort();
                names
            }
            Err(CoordError::NoNode { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let me = self.name().to_string();
        if let Some(t) = self.tasks.get_mut(key) {
            t.todo.rank(&me, &names);
        }
        Ok(())
    }

    /// A task left PENDING: its uploads stop and its pins go.
    async fn settle(&self, t: &mut Task) {
        for (_, h) in std::mem::take(&mut t.running) {
            h.abort();
        }
        t.todo.clear();
        t.backoff.clear();
        if t.status == TaskStatus::Completed && t.commit_file.is_none() {
            if let Ok((data, _)) = self
                .session
                .get(&format!("{}/commit_info", t.key.path()))
                .await
            {
                t.commit_file = Some(String::from_utf8_lossy(&data).into_owned());
            }
        }
        if let Err(e) = self.ex.parts.unpin(&t.metadata.transaction_id).await {
            tracing::warn!(task = %t.key, error = %e, "could not release an export's pins");
        }
    }

    async fn forget(&mut self, key: &TaskKey) {
        if let Some(mut t) = self.tasks.remove(key) {
            t.status = if t.status == TaskStatus::Pending {
                TaskStatus::Killed
            } else {
                t.status
            };
            self.settle(&mut t).await;
            tracing::debug!(task = %key, "export task removed");
        }
    }

    async fn refresh_status(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let tx = &self.events.clone();
        let path = format!("{}/status", key.path());
        let status = match self.session.get_watch(&path).await {
            Ok((data, _, w)) => {
                forward(tx, w, Event::Status(key.clone()));
                TaskStatus::parse(&data)
            }
            Err(CoordError::NoNode { .. }) => {
                // Removed (TTL, or replaced by a forced export).
                self.forget(key).await;
                return self.load_exports(&key.table).await;
            }
            Err(e) => return Err(e),
        };
        let Some(mut t) = self.tasks.remove(key) else {
            return Ok(());
        };
        match status {
            Some(s) if s != t.status => {
                t.status = s;
                if s.is_terminal() {
                    self.settle(&mut t).await;
                    t.progress_due = true;
                }
                tracing::info!(task = %key, status = %s, "export task status");
            }
            _ => {}
        }
        self.tasks.insert(key.clone(), t);
        Ok(())
    }

    /// Scheduling and the refreshes that are due.
    /// Tasks in create_time order (the order they are served in).
    fn ordered_keys(&self) -> Vec<TaskKey> {
        let mut v: Vec<(&TaskKey, u64)> = self
            .tasks
            .iter()
            .map(|(k, t)| (k, t.metadata.create_time))
            .collect();
        v.sort_by_key(|(k, c)| (*c, (*k).clone()));
        v.into_iter().map(|(k, _)| k.clone()).collect()
    }

    async fn tick(&mut self) -> Result<(), CoordError> {
        let keys = self.ordered_keys();
        for key in &keys {
            let since = self.trips();
            let r = self.refresh_progress(key).await;
            self.charge(key, since);
            if let Err(e) = r {
                if let Some(t) = self.tasks.get_mut(key) {
                    t.progress_due = true;
                }
                return Err(e);
            }
        }
        for key in &keys {
            let since = self.trips();
            let r = self.commit_if_due(key).await;
            self.charge(key, since);
            r?;
        }
        self.schedule().await
    }

    /// Claims and starts parts within the slots: at every tick, and as soon
    /// as an upload ends (so a slot never waits for the tick).
    async fn schedule(&mut self) -> Result<(), CoordError> {
        let keys = self.ordered_keys();
        let mut running: usize = self.tasks.values().map(|t| t.running.len()).sum();
        let now = Instant::now();
        for key in keys {
            if running >= self.ex.config.max_uploads {
                break;
            }
            let since = self.trips();
            let Some(t) = self.tasks.get_mut(&key) else {
                continue;
            };
            if t.status != TaskStatus::Pending || t.destination.is_none() {
                continue;
            }
            t.busy.retain(|_, until| *until > now);
            let slots = (t.metadata.settings.parallelism as usize).saturating_sub(t.running.len());
            // Claims go down this node's order until the slots are full: a
            // part another node holds or finished is passed over at once.
            // Candidates are taken a few at a time (a task may hold 100,000
            // parts; a scan of them all per upload would cost more than the
            // upload).
            let mut want = slots.min(self.ex.config.max_uploads - running);
            let mut after: Option<(Rank, String)> = None;
            let mut candidates: Vec<(Rank, String)> = Vec::new();
            let mut pruned_now = false;
            loop {
                if want == 0 {
                    break;
                }
                if candidates.is_empty() {
                    let Some(t) = self.tasks.get(&key) else {
                        break;
                    };
                    candidates = t
                        .todo
                        .after(after.as_ref())
                        .filter(|(_, p)| {
                            !t.running.contains_key(p)
                                && !t.busy.contains_key(p)
                                && t.backoff.get(p).is_none_or(|b| b.until <= now)
                        })
                        .take(want + SCAN_BATCH)
                        .cloned()
                        .collect();
                    candidates.reverse();
                }
                let Some((r, part)) = candidates.pop() else {
                    break;
                };
                // Past its own share, a node takes others' parts; most are
                // done or under way by then, so it first drops what
                // `processing/` no longer lists (once per tick at most)
                // instead of finding that out one claim at a time.
                if r.0 == 1 && !pruned_now {
                    pruned_now = true;
                    let due = self
                        .tasks
                        .get(&key)
                        .is_some_and(|t| t.pruned.is_none_or(|at| at + self.ex.config.tick <= now));
                    if due {
                        self.prune(&key, now).await?;
                        candidates.clear();
                        after = None;
                        continue;
                    }
                }
                after = Some((r, part.clone()));
                match self.claim(&key, &part).await? {
                    Claim::Ours => {
                        self.start_upload(&key, &part).await;
                        running += 1;
                        want -= 1;
                    }
                    Claim::Done => {
                        if let Some(t) = self.tasks.get_mut(&key) {
                            t.todo.remove(&part);
                            t.backoff.remove(&part);
                            if t.todo.is_empty() {
                                t.commit_due = true;
                            }
                        }
                    }
                    Claim::Busy => {
                        self.counters.claims_lost += 1;
                        if let Some(t) = self.tasks.get_mut(&key) {
                            t.busy.insert(part, now + self.ex.config.tick * 4);
                        }
                    }
                    Claim::NotPending => {
                        if let Some(t) = self.tasks.get_mut(&key) {
                            t.todo.clear();
                        }
                        break;
                    }
                    Claim::Gone => {
                        self.forget(&key).await;
                        break;
                    }
                }
            }
            self.charge(&key, since);
        }
        Ok(())
    }

    /// Drops from the task's todo the parts `processing/` no longer lists
    /// (exported by other nodes).
    async fn prune(&mut self, key: &TaskKey, now: Instant) -> Result<(), CoordError> {
        let left = match self
            .session
            .children(&format!("{}/processing", key.path()))
            .await
        {
            Ok((left, _)) => left,
            Err(CoordError::NoNode { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let left: std::collections::HashSet<String> = left.into_iter().collect();
        if let Some(t) = self.tasks.get_mut(key) {
            t.todo.retain(|p| left.contains(p));
            t.pruned = Some(now);
            if t.todo.is_empty() {
                t.commit_due = true;
            }
        }
        Ok(())
    }

    /// Claims a part: its lock, created together with a set of its
    /// processing entry (which fails if the part was exported already).
    async fn claim(&self, key: &TaskKey, part: &str) -> Result<Claim, CoordError> {
        let base = key.path();
        let lock = format!("{base}/locks/{part}");
        let Some(fence) = self.fence(key) else {
            return Ok(Claim::Gone);
        };
        let ops = vec![
            Op::create(lock.clone(), self.name().as_bytes(), CreateMode::Ephemeral),
            Op::set(format!("{base}/processing/{part}"), Vec::new(), None),
            Op::check(format!("{base}/status"), 0),
            Op::check(fence, 0),
        ];
        match self.session.multi(ops).await {
            Ok(_) => Ok(Claim::Ours),
            Err(CoordError::MultiFailed { index, source }) => match (index, *source) {
                (0, CoordError::NodeExists { .. }) => {
                    // Ours already (a release or a move whose answer was
                    // lost)? Then this session holds it and goes on.
                    match self.session.exists(&lock).await? {
                        Some(stat) if stat.ephemeral_owner == self.session.session_id() => {
                            Ok(Claim::Ours)
                        }
                        _ => Ok(Claim::Busy),
                    }
                }
                (0, CoordError::NoNode { .. }) => Ok(Claim::Gone),
                (1, CoordError::NoNode { .. }) => Ok(Claim::Done),
                // No longer PENDING: the status watch settles it.
                (2, _) => Ok(Claim::NotPending),
                (3, _) => Ok(Claim::Gone),
                (_, e) => Err(e),
            },
            Err(CoordError::ConnectionLoss { .. }) => {
                // Outcome unknown: the lock's owner says.
                match self.session.exists(&lock).await? {
                    Some(stat) if stat.ephemeral_owner == self.session.session_id() => {
                        Ok(Claim::Ours)
                    }
                    Some(_) => Ok(Claim::Busy),
                    None => Ok(Claim::Busy),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Charges the requests sent since `since` (a [`Self::trips`] reading)
    /// to the task.
    fn charge(&mut self, key: &TaskKey, since: u64) {
        let n = self.trips() - since;
        if let Some(t) = self.tasks.get_mut(key) {
            t.coordination_ops += n;
        }
    }

    fn trips(&self) -> u64 {
        self.counted.round_trips()
    }

    /// The fence node of the task as this node mirrors it.
    fn fence(&self, key: &TaskKey) -> Option<String> {
        self.tasks
            .get(key)
            .map(|t| crate::model::fence_path(&key.path(), &t.metadata.transaction_id))
    }

    async fn start_upload(&mut self, key: &TaskKey, part: &str) {
        let Some(t) = self.tasks.get(key) else {
            return;
        };
        let Some(destination) = t.destination.clone() else {
            return;
        };
        let (settings, dir, table_id) = (
            t.metadata.settings.clone(),
            t.metadata.partition_dir.clone(),
            t.metadata.table_id,
        );
        let (table, columns, schema_checked) = (
            t.metadata.table.clone(),
            t.metadata.columns.clone(),
            Arc::clone(&t.schema_checked),
        );
        let parts = Arc::clone(&self.ex.parts);
        let cpu = self.ex.cpu;
        let budget = self.ex.config.upload_budget;
        let (key2, part2) = (key.clone(), part.to_string());
        let handle = self.uploads.spawn(async move {
            let result = async {
                let name = PartName::parse(&part2)
                    .ok_or_else(|| PartFailure::Fatal(format!("{part2} is not a part name")))?;
                let source = parts.find(table_id, &name).await.ok_or_else(|| {
                    PartFailure::Retryable(format!("part {part2} is no longer on this node"))
                })?;
                schema_checked
                    .get_or_try_init(|| destination.claim_schema(&table, &columns))
                    .await?;
                destination
                    .write_part(&dir, &source, &settings, cpu, budget)
                    .await
            }
            .await;
            Done {
                key: key2,
                part: part2,
                result,
            }
        });
        if let Some(t) = self.tasks.get_mut(key) {
            t.running.insert(part.to_string(), handle);
        }
    }

    /// An upload ended.
    async fn finish(&mut self, done: Done) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get_mut(&done.key) else {
            return Ok(());
        };
        if t.running.remove(&done.part).is_none() {
            return Ok(());
        }
        let since = self.trips();
        let r = async {
            match done.result {
                Ok(file) => self.succeed(&done.key, &done.part, file).await?,
                Err(failure) => self.fail_part(&done.key, &done.part, failure).await?,
            }
            self.commit_if_due(&done.key).await
        }
        .await;
        self.charge(&done.key, since);
        r?;
        self.schedule().await
    }

    async fn succeed(
        &mut self,
        key: &TaskKey,
        part: &str,
        file: DataFile,
    ) -> Result<(), CoordError> {
        let base = key.path();
        let processed = Processed {
            file: file.clone(),
            finished_by: self.name().to_string(),
        };
        let Some(fence) = self.fence(key) else {
            return Ok(());
        };
        let ops = vec![
            Op::check(format!("{base}/status"), 0),
            Op::check(fence, 0),
            Op::delete(format!("{base}/processing/{part}"), None),
            Op::create(
                format!("{base}/processed/{part}"),
                serde_json::to_vec(&processed).expect("json"),
                CreateMode::Persistent,
            ),
            Op::delete(format!("{base}/locks/{part}"), Some(0)),
            // Progress watchers see the processing node change.
            Op::set(format!("{base}/processing"), Vec::new(), None),
        ];
        let mut outcome = self.session.multi(ops.clone()).await;
        if let Err(CoordError::ConnectionLoss { .. }) = outcome {
            // Read back: done if the processed entry is there; else the
            // lock is still ours (same session) and the multi is repeated.
            outcome = match self
                .session
                .exists(&format!("{base}/processed/{part}"))
                .await?
            {
                Some(_) => Ok(Vec::new()),
                None => self.session.multi(ops).await,
            };
        }
        let t = self.tasks.get_mut(key);
        match outcome {
            Ok(results) => {
                self.counters.parts_exported += 1;
                self.counters.bytes_exported += file.bytes;
                // The bump of `processing` answers with its stat: no child
                // left means every part is exported (by whichever node), so
                // this node commits now rather than when its progress watch
                // is next read.
                let nothing_left = matches!(
                    results.last(),
                    Some(OpResult::Set { stat }) if stat.num_children == 0
                );
                if let Some(t) = t {
                    t.todo.remove(part);
                    t.backoff.remove(part);
                    t.parts_to_do = t.parts_to_do.saturating_sub(1);
                    if t.todo.is_empty() || nothing_left {
                        t.commit_due = true;
                    }
                }
                tracing::debug!(task = %key, part, bytes = file.bytes, "part exported");
                Ok(())
            }
            Err(CoordError::MultiFailed { index, .. }) => {
                // 0, 1: no longer PENDING, or replaced (the status watch
                // settles it); 2..: someone else's claim or a lost lock; the
                // part is not ours to finish.
                if index <= 1 {
                    if let Some(t) = t {
                        t.status = TaskStatus::Killed;
                        t.progress_due = true;
                    }
                }
                let _ = self
                    .session
                    .delete(&format!("{base}/locks/{part}"), Some(0))
                    .await;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn fail_part(
        &mut self,
        key: &TaskKey,
        part: &str,
        failure: PartFailure,
    ) -> Result<(), CoordError> {
        let base = key.path();
        let name = self.name().to_string();
        let now_s = self.ex.clock.unix_seconds();
        let Some(t) = self.tasks.get_mut(key) else {
            return Ok(());
        };
        match &failure {
            PartFailure::Retryable(_) => self.counters.failures_retryable += 1,
            PartFailure::Fatal(_) => self.counters.failures_fatal += 1,
        }
        tracing::warn!(task = %key, part, class = failure.class(), error = %failure, "part export failed");
        let count = t.exceptions.get(&name).map_or(0, |e| e.count) + 1;
        let record = ExceptionRecord {
            part: part.to_string(),
            message: failure.to_string(),
            time: now_s,
            count,
        };
        let mut ops = vec![Op::check(
            crate::model::fence_path(&base, &t.metadata.transaction_id),
            0,
        )];
        let exception_path = format!("{base}/exceptions/{name}");
        let exists = self.session.exists(&exception_path).await?.is_some();
        let data = serde_json::to_vec(&record).expect("json");
        ops.push(if exists {
            Op::set(exception_path, data, None)
        } else {
            Op::create(exception_path, data, CreateMode::Persistent)
        });
        ops.push(Op::set(format!("{base}/exceptions"), Vec::new(), None));
        let mut fail_task = matches!(failure, PartFailure::Fatal(_));
        if let PartFailure::Retryable(_) = failure {
            let retries_path = format!("{base}/retries/{part}");
            let (retries, version) = match self.session.get(&retries_path).await {
                Ok((d, stat)) => (
                    serde_json::from_slice::<Retries>(&d).unwrap_or_default(),
                    Some(stat.version),
                ),
                Err(CoordError::NoNode { .. }) => (Retries::default(), None),
                Err(e) => return Err(e),
            };
            let next = Retries {
                retry_count: retries.retry_count + 1,
            };
            let data = serde_json::to_vec(&next).expect("json");
            ops.push(match version {
                Some(v) => Op::set(retries_path, data, Some(v)),
                None => Op::create(retries_path, data, CreateMode::Persistent),
            });
            let max = t.metadata.settings.max_retries;
            if max > 0 && next.retry_count >= max {
                fail_task = true;
            }
            let attempts = t.backoff.get(part).map_or(0, |b| b.attempts) + 1;
            let wait = t.metadata.settings.backoff(attempts);
            t.backoff.insert(
                part.to_string(),
                Backoff {
                    attempts,
                    until: Instant::now() + wait,
                },
            );
        }
        if fail_task {
            ops.push(crate::task::decide_op(&base, crate::task::Decision::Fail));
            ops.push(Op::set(
                format!("{base}/status"),
                TaskStatus::Failed.as_str(),
                Some(0),
            ));
        }
        ops.push(Op::delete(format!("{base}/locks/{part}"), Some(0)));
        t.exceptions.insert(name, record);
        match self.session.multi(ops).await {
            Ok(_) => {
                if fail_task {
                    tracing::warn!(task = %key, part, "export failed");
                }
                Ok(())
            }
            Err(CoordError::MultiFailed { .. }) => {
                // Lost a race (retry counter, status); the lock goes anyway.
                let _ = self
                    .session
                    .delete(&format!("{base}/locks/{part}"), Some(0))
                    .await;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// parts_to_do and exceptions of a task whose progress watch fired, at
    /// most once per tick.
    async fn refresh_progress(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get_mut(key) else {
            return Ok(());
        };
        let (progress, exceptions) = (t.progress_due, t.exceptions_due);
        let (progress_armed, exceptions_armed) = (t.progress_armed, t.exceptions_armed);
        let base = key.path();
        if progress {
            // A watch is set only when none is armed: each one fires once,
            // and one per node is enough.
            let path = format!("{base}/processing");
            let stat = if progress_armed {
                self.session.exists(&path).await?
            } else {
                let (stat, watch) = self.session.exists_watch(&path).await?;
                forward(&self.events, watch, Event::Progress(key.clone()));
                if let Some(t) = self.tasks.get_mut(key) {
                    t.progress_armed = true;
                }
                stat
            };
            let Some(stat) = stat else {
                self.forget(key).await;
                return Ok(());
            };
            if let Some(t) = self.tasks.get_mut(key) {
                t.progress_due = false;
                t.parts_to_do = stat.num_children as u64;
                if t.parts_to_do == 0 && t.status == TaskStatus::Pending {
                    t.commit_due = true;
                }
            }
        }
        if exceptions {
            let path = format!("{base}/exceptions");
            let replicas = if exceptions_armed {
                self.session.children(&path).await.map(|(c, _)| c)
            } else {
                self.session
                    .children_watch(&path)
                    .await
                    .map(|(c, _, watch)| {
                        forward(&self.events, watch, Event::Exceptions(key.clone()));
                        c
                    })
            };
            let replicas = match replicas {
                Ok(r) => r,
                Err(CoordError::NoNode { .. }) => return Ok(()),
                Err(e) => return Err(e),
            };
            if !exceptions_armed {
                if let Some(t) = self.tasks.get_mut(key) {
                    t.exceptions_armed = true;
                }
            }
            let mut found = BTreeMap::new();
            for r in replicas {
                if let Ok((d, _)) = self.session.get(&format!("{base}/exceptions/{r}")).await {
                    if let Ok(rec) = serde_json::from_slice::<ExceptionRecord>(&d) {
                        found.insert(r, rec);
                    }
                }
            }
            if let Some(t) = self.tasks.get_mut(key) {
                t.exceptions_due = false;
                t.exceptions = found;
            }
        }
        Ok(())
    }

    async fn commit_if_due(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get_mut(key) else {
            return Ok(());
        };
        if !t.commit_due || t.status != TaskStatus::Pending || !t.running.is_empty() {
            return Ok(());
        }
        t.commit_due = false;
        self.try_commit(key).await
    }

    async fn try_commit(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get(key) else {
            return Ok(());
        };
        let Some(destination) = t.destination.clone() else {
            return Ok(());
        };
        let metadata = t.metadata.clone();
        match task::commit(&self.session, key, &metadata, &destination, self.name()).await {
            Ok(CommitOutcome::Completed(file)) => {
                self.counters.commits += 1;
                if let Some(t) = self.tasks.get_mut(key) {
                    t.status = TaskStatus::Completed;
                    t.commit_file = Some(file);
                    t.parts_to_do = 0;
                }
                if let Err(e) = self.ex.parts.unpin(&metadata.transaction_id).await {
                    tracing::warn!(task = %key, error = %e, "could not release an export's pins");
                }
                Ok(())
            }
            Ok(CommitOutcome::NotNow) => Ok(()),
            Ok(CommitOutcome::Terminal(_)) | Ok(CommitOutcome::Failed(_)) => {
                if let Some(t) = self.tasks.get_mut(key) {
                    t.progress_due = true;
                }
                Ok(())
            }
            Err(task::CommitError::Coordination(e)) => {
                // Tried again at the next tick (this session may still hold
                // the commit lock, which only it can use).
                if let Some(t) = self.tasks.get_mut(key) {
                    t.commit_due = true;
                }
                Err(e)
            }
            Err(task::CommitError::Destination(e)) => {
                tracing::warn!(task = %key, error = %e, "commit file not written; retried");
                if let Some(t) = self.tasks.get_mut(key) {
                    t.commit_due = true;
                }
                Ok(())
            }
        }
    }

    /// The cleanup holder's duties, per table.
    async fn cleanup(&mut self) -> Result<(), CoordError> {
        let now_s = self.ex.clock.unix_seconds();
        let tables: Vec<String> = self.tables.iter().cloned().collect();
        for table in tables {
            // The holder does its duties whatever its own mirror shows.
            if !self.tasks.keys().any(|k| k.table == table)
                && !self.creating.iter().any(|k| k.table == table)
                && !self.cleanup_locks.contains_key(&table)
            {
                continue;
            }
            if !self.cleanup_locks.contains_key(&table) {
                match task::try_lock(&self.session, &cleanup_lock_path(&table), self.name()).await {
                    Ok(Some(lock)) => {
                        self.cleanup_locks.insert(table.clone(), lock);
                    }
                    Ok(None) => continue,
                    Err(CoordError::NoNode { .. }) => continue,
                    Err(e) => return Err(e),
                }
            }
            let keys: Vec<TaskKey> = self
                .tasks
                .keys()
                .filter(|k| k.table == table)
                .cloned()
                .collect();
            for key in keys {
                let Some(t) = self.tasks.get(&key) else {
                    continue;
                };
                let (status, create_time) = (t.status, t.metadata.create_time);
                let settings = t.metadata.settings.clone();
                if status.is_terminal() {
                    if create_time + settings.ttl_seconds < now_s {
                        tracing::info!(task = %key, "removing an export task past its TTL");
                        task::remove(&self.session, &key).await?;
                        self.forget(&key).await;
                    }
                    continue;
                }
                if settings.task_timeout_seconds > 0
                    && create_time + settings.task_timeout_seconds < now_s
                {
                    if let Some(d) = t.destination.clone() {
                        match task::kill(&self.session, &key, None, &d, "task timeout").await {
                            Ok(_)
                            | Err(task::KillError::Busy(_))
                            | Err(task::KillError::NotFound(_)) => {}
                            Err(task::KillError::Coordination(e)) => return Err(e),
                            Err(e) => {
                                tracing::warn!(task = %key, error = %e, "timeout kill failed")
                            }
                        }
                        if let Some(t) = self.tasks.get_mut(&key) {
                            t.progress_due = true;
                        }
                    }
                    continue;
                }
                // Parts all processed but nobody committed (its replica
                // died in between).
                let left = self
                    .session
                    .exists(&format!("{}/processing", key.path()))
                    .await?
                    .map(|s| s.num_children);
                if left == Some(0) {
                    self.try_commit(&key).await?;
                }
            }
            // Tasks whose creator died before `status`.
            let (keys, _) = match self.session.children(&exports_path(&table)).await {
                Ok(r) => r,
                Err(CoordError::NoNode { .. }) => continue,
                Err(e) => return Err(e),
            };
            for k in keys {
                let key = TaskKey {
                    table: table.clone(),
                    key: k,
                };
                if self.tasks.contains_key(&key) {
                    continue;
                }
                if let Some(head) = task::read_head(&self.session, &key).await? {
                    let old = head.metadata.as_ref().is_none_or(|m| {
                        m.create_time + self.ex.config.creating_grace.as_secs() < now_s
                    });
                    if head.status.is_none() && old {
                        tracing::info!(task = %key, "removing an export task whose creation never finished");
                        task::remove(&self.session, &key).await?;
                    }
                }
            }
        }
        Ok(())
    }

    fn publish(&self) {
        let now = Instant::now();
        let mut tasks: Vec<TaskView> = self
            .tasks
            .values()
            .map(|t| {
                let last = t
                    .exceptions
                    .iter()
                    .max_by_key(|(_, e)| e.time)
                    .map(|(r, e)| ViewException {
                        replica: r.clone(),
                        part: e.part.clone(),
                        message: e.message.clone(),
                        time: e.time,
                    });
                TaskView {
                    table: t.key.table.clone(),
                    key: t.key.key.clone(),
                    partition_id: t.metadata.partition_id.clone(),
                    destination: t.metadata.destination.clone(),
                    transaction_id: t.metadata.transaction_id.clone(),
                    create_time: t.metadata.create_time,
                    source_replica: t.metadata.source_replica.clone(),
                    parts: t.snapshot_names.iter().take(VIEW_PARTS).cloned().collect(),
                    parts_count: t.metadata.parts_count,
                    parts_to_do: if t.status == TaskStatus::Completed {
                        0
                    } else {
                        t.parts_to_do
                    },
                    rows: t.metadata.rows,
                    status: t.status,
                    last_exception: last,
                    exception_count: t.exceptions.values().map(|e| e.count).sum(),
                    backoff: t
                        .backoff
                        .iter()
                        .map(|(p, b)| ViewBackoff {
                            part: p.clone(),
                            attempts: b.attempts,
                            retry_in_ms: b.until.saturating_duration_since(now).as_millis() as u64,
                        })
                        .collect(),
                    running: t.running.keys().cloned().collect(),
                    commit_file: t.commit_file.clone(),
                    coordination_ops: t.coordination_ops,
                }
            })
            .collect();
        tasks.sort_by(|a, b| {
            (a.create_time, &a.table, &a.key).cmp(&(b.create_time, &b.table, &b.key))
        });
        let view = ExportsView {
            tasks,
            counters: ExporterCounters {
                coordination_ops: self.counters.coordination_ops + self.trips(),
                ..self.counters.clone()
            },
        };
        self.ex.view.send_if_modified(|v| {
            if *v == view {
                false
            } else {
                *v = view;
                true
            }
        });
    }
}

enum Claim {
    Ours,
    Busy,
    Done,
    /// The task left PENDING.
    NotPending,
    /// The task was removed or replaced.
    Gone,
}
