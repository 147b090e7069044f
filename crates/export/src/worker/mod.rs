//! The exporter of one node: a mirror of every export task kept current by
//! watches, the scheduling of the parts this node holds, uploads, the
//! success and failure transactions, commits, and cleanup.
//!
//! Here: the configuration, the exporter and its session loop, and the
//! dispatch of watch events. The loop reads the time (the runtime's clock,
//! which the simulator drives) just before each decision and passes it in:
//! the cores below read no clock. In the submodules:
//! * `mirror`: the tasks as coordination holds them, and their refreshes;
//! * `order`: the order in which a node tries the parts it holds;
//! * `queue`: the scheduling core of a task's parts (claims' answers,
//!   back-off, parts held elsewhere, when a commit is due), taking the time
//!   as an input and doing no I/O;
//! * `rules`: when a failure ends a task, the cleanup duty for a task, and
//!   when an unfinished creation may go (stateless, no I/O);
//! * `schedule`: the tick, claims, and the upload slots they fill;
//! * `upload`: one part's upload and its success or failure transaction;
//! * `commit`: the commit a node tries once no part is left;
//! * `cleanup`: the cleanup holder's duties (TTL, timeouts, commits nobody
//!   made, creations that never finished);
//! * `view`: the status listing and the counters.
//!
//! Invariants (each one relied on by the exactly-once argument in
//! docs/protocols/export.md):
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

mod cleanup;
mod commit;
mod lost;
mod mirror;
mod order;
mod queue;
mod rules;
mod schedule;
mod upload;
mod view;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_coord::{CoordError, CountedSession, Session, SessionFactory, Watch};
use ferry_env::{Clock, Cpu};
use ferry_storage::UploadBudget;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::dest::Destination;
use crate::local::{Destinations, LocalParts};
use crate::model::{ExceptionRecord, Metadata, TaskKey, TaskStatus};
use crate::task::HeldLock;

pub use mirror::ORPHAN_PIN_AGE;
use queue::PartQueue;
use upload::Done;
pub use view::{ExporterCounters, ExportsView, TaskView, ViewBackoff, ViewException, VIEW_PARTS};

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
    /// How long a part must have been said missing by every replica of its
    /// shard before its task fails for it (see `lost`): a node that holds
    /// it but is away (restarting, its session expired) is back by then.
    pub lost_part_grace: Duration,
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
            lost_part_grace: Duration::from_secs(60),
        }
    }
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

struct Task {
    key: TaskKey,
    metadata: Metadata,
    status: TaskStatus,
    destination: Option<Destination>,
    /// The parts to try here and their scheduling (no I/O).
    queue: PartQueue,
    snapshot_names: Vec<String>,
    /// The uploads running here, as `queue` counts them.
    uploads: BTreeMap<String, tokio::task::AbortHandle>,
    parts_to_do: u64,
    exceptions: BTreeMap<String, ExceptionRecord>,
    commit_file: Option<String>,
    progress_due: bool,
    exceptions_due: bool,
    /// Watches set and not yet fired (one of each per task and session).
    progress_armed: bool,
    exceptions_armed: bool,
    /// Set once this node found the destination's schema marker to match
    /// the task's columns (or wrote it): checked before the first upload
    /// here, not before every one.
    schema_checked: Arc<tokio::sync::OnceCell<()>>,
    /// Coordination requests this node sent for the task.
    coordination_ops: u64,
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
    /// This node's Iceberg commits, gathered per table.
    iceberg_commits: Arc<ferry_iceberg::CommitQueue>,
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
            iceberg_commits: Arc::new(ferry_iceberg::CommitQueue::new()),
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

fn forward(tx: &mpsc::Sender<Event>, watch: Watch, event: Event) {
    let tx = tx.clone();
    tokio::spawn(async move {
        let _ = watch.changed().await;
        let _ = tx.send(event).await;
    });
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
        let started = Instant::now();
        let mut next_cleanup = started;
        let mut next_poll = started + self.ex.config.safety_poll;
        loop {
            self.publish(Instant::now());
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
                        Ok(()) => self.schedule(Instant::now()).await,
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
                        if r.is_ok() {
                            r = self.check_lost_parts().await;
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
}
