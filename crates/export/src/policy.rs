//! Export policies: tables that export themselves (`[export] to = URL,
//! freshness = "10s"` in a definition, or `PATCH /tables/<t>`).
//!
//! One node at a time runs a table's policy: the holder of the table's
//! ephemeral policy lock (`/ferry/export_policy/<table>`); when its session
//! ends, another node takes over. Every round it lists the table's active
//! parts at the commit position, and asks for an export (an ordinary
//! EXPORT PARTITION task, [`ExportRequest::replace_finished`]) of each
//! partition whose content is not the lake's. The export protocol does the
//! rest, so a policy's export is exactly as safe as a manual one.
//!
//! Invariants (ARCHITECTURE.md):
//! * a policy never replaces a PENDING task of its key: a manual export in
//!   flight finishes first, and the next round exports what it missed;
//! * a partition's rows are "in the lake" only when a COMPLETED task (or
//!   the destination's current commit, answered `unchanged`) holds exactly
//!   the partition's current content; until then the partition counts in
//!   the table's lag.
//!
//! [`TablePolicy`] is the decision, apart from I/O: it takes the parts'
//! contents, the tasks' statuses and the time, and names the partitions to
//! request. [`PolicyRunner`] performs it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_coord::{CoordError, CreateMode, RenewingSession, Session, SessionFactory};
use ferry_env::Clock;
use ferry_table::def::{ExportPolicy, LakeFormat};
use ferry_table::Table;
use ferry_wal::record::{Compaction, Maintenance, RetiredFile, Retirement, MAX_RETIRED_FILES};
use ferry_wal::Lsn;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::local::{Destinations, LocalParts, SnapshotRequest};
use crate::model::{content_id, SnapshotPart, TaskStatus, TABLES};
use crate::request::{ExportRequest, RequestError, Requester};
use crate::worker::ExportsView;

/// Where the policy locks live (outside the table's node, so a drop is
/// never blocked by a running policy).
pub const POLICY_LOCKS: &str = "/ferry/export_policy";

/// A round runs every quarter of the freshness target, within these bounds.
pub const MIN_ROUND: Duration = Duration::from_millis(250);
pub const MAX_ROUND: Duration = Duration::from_secs(15);
/// How often a node reads the catalog for policies that came or went
/// (and how long a table whose lock another node holds waits to look again).
pub const IDLE_ROUND: Duration = Duration::from_secs(2);
/// Tables with a policy one node runs tasks for at most (a bound on its
/// tasks; the rest wait, with a warning).
pub const MAX_POLICY_TABLES: usize = 10_000;
/// A table's replicas must apply the commit position within this long of a
/// round (at most the freshness target).
pub const MAX_APPLY_WAIT: Duration = Duration::from_secs(30);
/// Partitions one round requests per table: a bound on a round's work
/// (the rest wait for the next round).
pub const MAX_REQUESTS_PER_ROUND: usize = 64;
/// A policy expires its Parquet destination's commit files superseded more
/// than this long ago (readers that picked one just before finish first)...
pub const SUPERSEDED_COMMIT_GRACE: Duration = Duration::from_secs(600);
/// ...at most this often per table.
pub const UPKEEP_INTERVAL: Duration = Duration::from_secs(60);

/// When a policy tends its destination: how often, and how long a
/// superseded commit (and an unlisted data file) is kept for readers and
/// uploads in flight. The product runs the defaults; the simulator
/// shortens both so that its runs reach the upkeep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpkeepTiming {
    pub interval: Duration,
    pub superseded_grace: Duration,
}

impl Default for UpkeepTiming {
    fn default() -> Self {
        UpkeepTiming {
            interval: UPKEEP_INTERVAL,
            superseded_grace: SUPERSEDED_COMMIT_GRACE,
        }
    }
}

/// Where a node learns the commit position now.
pub type CommitPosition =
    Arc<dyn Fn() -> futures::future::BoxFuture<'static, Result<Lsn, String>> + Send + Sync>;

/// How a policy has an upkeep record (a retirement, a compaction) written
/// to the WAL (by a writer, for table `name`); resolves with the record's
/// end once it is committed.
pub type MaintenanceSink = Arc<
    dyn Fn(String, Maintenance) -> futures::future::BoxFuture<'static, Result<Lsn, String>>
        + Send
        + Sync,
>;

/// Retirements one round asks for per table at most.
pub const MAX_RETIREMENTS_PER_ROUND: usize = 8;
/// A partition is checked for retention at most this often (the check
/// reads the lake).
pub const MAX_RETIRE_CHECK_INTERVAL: Duration = Duration::from_secs(60);

/// What a policy knows of one partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PartitionState {
    /// The content the lake holds, as far as this node saw.
    in_lake: Option<String>,
    /// The export this node asked for and has not seen end.
    requested: Option<Asked>,
    /// When this node first saw the partition's content differ from the
    /// lake's (unix ms); `None` while they agree.
    behind_since_ms: Option<u64>,
    /// When this node last asked for an export of it (unix ms).
    last_asked_ms: Option<u64>,
    /// When this node last checked it for retention (unix ms).
    retire_checked_ms: Option<u64>,
    /// The content this node saw last, and since when (unix ms).
    seen: Option<(String, u64)>,
    /// The content a compaction was considered for.
    compaction_considered: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Asked {
    content_id: String,
    transaction_id: String,
    at_ms: u64,
}

/// One table's policy decisions, apart from I/O.
#[derive(Debug, Clone, Default)]
pub struct TablePolicy {
    /// The destination (URL and format) what follows is about.
    destination: String,
    partitions: BTreeMap<String, PartitionState>,
    /// When this node last expired the destination's superseded commits.
    last_upkeep_ms: u64,
}

impl TablePolicy {
    /// Forgets everything known when the policy names another destination
    /// or format: what one lake holds says nothing of another.
    pub fn destination(&mut self, destination: &str) {
        if self.destination != destination {
            self.destination = destination.to_string();
            self.partitions.clear();
        }
    }

    /// The partitions to request now, given each partition's current
    /// content (`contents`: partition → content id, partitions with rows
    /// only) and the status of a task by transaction id (`None`: not
    /// known here). `forget_after_ms`: how long a requested task may stay
    /// unknown before it is asked again; `spacing_ms`: the least time
    /// between two requests of a partition (each export is a commit: a
    /// commit file or a snapshot, so a partition is committed at most once
    /// per spacing, however fast exports finish).
    pub fn plan(
        &mut self,
        now_ms: u64,
        contents: &BTreeMap<String, String>,
        status_of: impl Fn(&str) -> Option<TaskStatus>,
        forget_after_ms: u64,
        spacing_ms: u64,
    ) -> Vec<String> {
        self.partitions.retain(|p, _| contents.contains_key(p));
        let mut out = Vec::new();
        for (partition, content) in contents {
            let st = self.partitions.entry(partition.clone()).or_default();
            if st.seen.as_ref().is_none_or(|(c, _)| c != content) {
                st.seen = Some((content.clone(), now_ms));
            }
            if let Some(asked) = &st.requested {
                match status_of(&asked.transaction_id) {
                    Some(TaskStatus::Completed) => {
                        // Everything acknowledged before the request is in
                        // the lake now: what is not came after it.
                        st.in_lake = Some(asked.content_id.clone());
                        st.behind_since_ms = Some(asked.at_ms);
                        st.requested = None;
                    }
                    Some(TaskStatus::Failed | TaskStatus::Killed) => st.requested = None,
                    Some(TaskStatus::Pending) => {}
                    None if now_ms.saturating_sub(asked.at_ms) > forget_after_ms => {
                        st.requested = None
                    }
                    None => {}
                }
            }
            if st.in_lake.as_ref() == Some(content) {
                st.behind_since_ms = None;
                continue;
            }
            st.behind_since_ms.get_or_insert(now_ms);
            let spaced = st
                .last_asked_ms
                .is_none_or(|t| now_ms.saturating_sub(t) >= spacing_ms);
            if st.requested.is_none() && spaced {
                out.push(partition.clone());
            }
        }
        out
    }

    /// Whether an export this policy asked for has ended (a round would
    /// ask for the partition's next increment).
    pub fn asked_ended(&self, status_of: impl Fn(&str) -> Option<TaskStatus>) -> bool {
        self.partitions.values().any(|st| {
            st.requested.as_ref().is_some_and(|a| {
                status_of(&a.transaction_id).is_some_and(|s| s != TaskStatus::Pending)
            })
        })
    }

    /// A task was created for `content_id`.
    pub fn requested(
        &mut self,
        partition: &str,
        content_id: &str,
        transaction_id: &str,
        now_ms: u64,
    ) {
        let st = self.partitions.entry(partition.to_string()).or_default();
        st.requested = Some(Asked {
            content_id: content_id.to_string(),
            transaction_id: transaction_id.to_string(),
            at_ms: now_ms,
        });
        st.last_asked_ms = Some(now_ms);
    }

    /// The destination's current commit holds `content_id` already.
    pub fn in_lake(&mut self, partition: &str, content_id: &str) {
        let st = self.partitions.entry(partition.to_string()).or_default();
        st.in_lake = Some(content_id.to_string());
        st.requested = None;
        st.behind_since_ms = None;
    }

    /// Partitions to check for retention now: the lake holds their content
    /// as far as this node saw, the replicas still hold some of their rows
    /// (`held`), and they were not checked within `every_ms`. The check
    /// itself reads the destination's current commit (see
    /// `PolicyRunner::retire_round`).
    pub fn retirement_candidates(
        &mut self,
        now_ms: u64,
        contents: &BTreeMap<String, String>,
        held: &BTreeSet<String>,
        every_ms: u64,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for (partition, content) in contents {
            let Some(st) = self.partitions.get_mut(partition) else {
                continue;
            };
            let due = st
                .retire_checked_ms
                .is_none_or(|t| now_ms.saturating_sub(t) >= every_ms);
            if st.in_lake.as_ref() == Some(content)
                && st.requested.is_none()
                && held.contains(partition)
                && due
            {
                st.retire_checked_ms = Some(now_ms);
                out.push(partition.clone());
            }
        }
        out
    }

    /// Partitions to consider for compaction now: the lake holds their
    /// content, which has not changed for `idle_ms` (the partition stopped
    /// receiving rows, and its parts their merges), and which was not
    /// considered before.
    pub fn compaction_candidates(
        &mut self,
        now_ms: u64,
        contents: &BTreeMap<String, String>,
        idle_ms: u64,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for (partition, content) in contents {
            let Some(st) = self.partitions.get_mut(partition) else {
                continue;
            };
            let idle = st
                .seen
                .as_ref()
                .is_some_and(|(c, t)| c == content && now_ms.saturating_sub(*t) >= idle_ms);
            if idle
                && st.in_lake.as_ref() == Some(content)
                && st.requested.is_none()
                && st.compaction_considered.as_ref() != Some(content)
            {
                st.compaction_considered = Some(content.clone());
                out.push(partition.clone());
            }
        }
        out
    }

    /// A compaction of `partition` could not be written (the writer
    /// refused it, or its answer was lost before it was appended): the
    /// partition is a candidate again once idle, not forgotten until its
    /// content changes (which, idle, it may never do).
    pub fn compaction_failed(&mut self, partition: &str) {
        if let Some(st) = self.partitions.get_mut(partition) {
            st.compaction_considered = None;
        }
    }

    /// Age of the oldest change not yet in the lake (0 when none), and how
    /// many partitions are behind.
    pub fn lag(&self, now_ms: u64) -> (u64, usize) {
        let behind: Vec<u64> = self
            .partitions
            .values()
            .filter_map(|s| s.behind_since_ms)
            .collect();
        let oldest = behind.iter().min().map_or(0, |t| now_ms.saturating_sub(*t));
        (oldest, behind.len())
    }
}

/// The contents of a table's partitions with rows, from a snapshot of its
/// active parts.
pub fn partition_contents(
    table: &str,
    parts: &[ferry_replica::PartMeta],
) -> BTreeMap<String, String> {
    let mut by_partition: BTreeMap<String, Vec<SnapshotPart>> = BTreeMap::new();
    for p in parts.iter().filter(|p| p.rows > 0) {
        by_partition
            .entry(p.name.partition_id.clone())
            .or_default()
            .push(SnapshotPart {
                name: p.name.to_string(),
                rows: p.rows,
                checksum: p.checksum,
                shard: p.shard,
            });
    }
    by_partition
        .into_iter()
        .map(|(partition, parts)| {
            let id = content_id(table, &partition, &parts);
            (partition, id)
        })
        .collect()
}

/// What `/status` and `/metrics` show of a table's policy on this node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TablePolicyStatus {
    pub to: String,
    pub format: String,
    pub freshness_seconds: u64,
    /// This node holds the table's policy lock (runs its rounds).
    pub running_here: bool,
    /// Age of the oldest change this node saw that is not in the lake yet.
    pub lag_seconds: f64,
    pub partitions_behind: u64,
    pub partitions: u64,
    /// Tasks this node's rounds created (since it started).
    pub exports_requested: u64,
    /// The retention, if the policy has one, and the retirements this
    /// node's rounds had written (since it started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_seconds: Option<u64>,
    #[serde(default)]
    pub retirements: u64,
    /// Orphan data files this node's upkeep removed (since it started).
    #[serde(default)]
    pub orphans_removed: u64,
    /// Compactions this node's rounds had written (since it started).
    #[serde(default)]
    pub compactions: u64,
    pub last_round_unix_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// Every policy table this node knows, by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyStatus {
    pub tables: BTreeMap<String, TablePolicyStatus>,
}

/// Tries to delete an orphan removal's marker before leaving it to the
/// session's end.
const MARKER_DELETE_ATTEMPTS: u32 = 50;

/// What a node needs to run export policies.
pub struct PolicyRunner {
    pub session: RenewingSession,
    pub sessions: Arc<dyn SessionFactory>,
    pub parts: Arc<dyn LocalParts>,
    pub destinations: Arc<dyn Destinations>,
    pub replica_name: String,
    pub clock: Arc<dyn Clock>,
    pub commit_lsn: CommitPosition,
    /// Where upkeep records go (retention, compaction).
    pub maintain: MaintenanceSink,
    /// The size compaction makes a partition's files near to.
    pub target_file_bytes: u64,
    pub upkeep: UpkeepTiming,
    pub view: watch::Receiver<ExportsView>,
    /// Seeds the transaction ids' random part.
    pub seed: u64,
}

/// A table's policy as the catalog holds it now.
#[derive(Debug, Clone, PartialEq)]
struct PolicyTable {
    table: Table,
    policy: ExportPolicy,
    format: LakeFormat,
}

impl PolicyRunner {
    /// Runs every policy table's rounds until `stop` turns true; publishes
    /// what it knows in `status`.
    ///
    /// Each table runs in its own task, on its own timer: a table whose
    /// round is slow (a backlog to request, replicas slow to apply) never
    /// delays another table's increments, compactions or retention. This
    /// loop only reads the catalog, starting a table's task when its policy
    /// appears and ending it when the policy goes. Dropping the future (a
    /// crash) drops every table's task with it.
    pub async fn run(self, status: watch::Sender<PolicyStatus>, mut stop: watch::Receiver<bool>) {
        let runner = Arc::new(self);
        let status = Arc::new(status);
        let mut loops: BTreeMap<String, watch::Sender<PolicyTable>> = BTreeMap::new();
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            match runner.policy_tables().await {
                Ok(tables) => {
                    let names: BTreeSet<&str> =
                        tables.iter().map(|t| t.table.def.name.as_str()).collect();
                    // A table's task ends once its sender is gone.
                    loops.retain(|name, _| names.contains(name.as_str()));
                    for table in tables {
                        let name = table.table.def.name.clone();
                        if let Some(spec) = loops.get(&name) {
                            spec.send_if_modified(|held| {
                                let changed = *held != table;
                                if changed {
                                    *held = table;
                                }
                                changed
                            });
                            continue;
                        }
                        if loops.len() >= MAX_POLICY_TABLES {
                            tracing::warn!(table = %name, "export policies: more than {MAX_POLICY_TABLES} tables with a policy; this one waits");
                            continue;
                        }
                        let (spec, spec_rx) = watch::channel(table);
                        loops.insert(name.clone(), spec);
                        let seed = runner.seed ^ table_seed(&name);
                        tasks.spawn(Arc::clone(&runner).table_loop(
                            name,
                            spec_rx,
                            Arc::clone(&status),
                            stop.clone(),
                            seed,
                        ));
                    }
                }
                Err(e) => tracing::warn!(error = %e, "export policies: cannot read the catalog"),
            }
            // Ended tasks (their table went) are reaped here.
            while tasks.try_join_next().is_some() {}
            tokio::select! {
                biased;
                _ = stop.changed() => {}
                _ = tokio::time::sleep(IDLE_ROUND) => {}
            }
            if stopping(&stop) {
                break;
            }
        }
        drop(loops);
        // Each table's round in flight finishes and its lock is released.
        while tasks.join_next().await.is_some() {}
    }

    /// Tables with an export policy, or an error when the catalog cannot be
    /// read (the running tables' tasks go on meanwhile).
    async fn policy_tables(&self) -> Result<Vec<PolicyTable>, String> {
        let session = self.session.session().await.map_err(|e| e.to_string())?;
        policy_tables(&session).await.map_err(|e| e.to_string())
    }

    /// One table's rounds, until its policy goes from the catalog (`spec`'s
    /// sender is dropped) or `stop` turns true.
    async fn table_loop(
        self: Arc<Self>,
        name: String,
        mut spec: watch::Receiver<PolicyTable>,
        status: Arc<watch::Sender<PolicyStatus>>,
        mut stop: watch::Receiver<bool>,
        seed: u64,
    ) {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mut state = TablePolicy::default();
        let mut counters = TablePolicyStatus::default();
        let mut view = self.view.clone();
        let mut gone = false;
        while !gone && !stopping(&stop) {
            let started = tokio::time::Instant::now();
            let table = spec.borrow_and_update().clone();
            let round = self
                .table_turn(&table, &mut state, &mut rng, &mut counters)
                .await;
            status.send_modify(|s| {
                s.tables.insert(name.clone(), counters.clone());
            });
            let next = started + round;
            // The next round comes at its time, or sooner (but not before
            // MIN_ROUND) once an export this table's policy asked for
            // ended: the partition's next increment then waits for no timer.
            loop {
                tokio::select! {
                    biased;
                    _ = stop.changed() => break,
                    changed = spec.changed() => {
                        if changed.is_err() {
                            gone = true;
                            break;
                        }
                    }
                    _ = tokio::time::sleep_until(next) => break,
                    changed = view.changed() => {
                        if changed.is_err() {
                            tokio::time::sleep_until(next).await;
                            break;
                        }
                        let ended = {
                            let v = view.borrow_and_update();
                            state.asked_ended(|tx: &str| {
                                v.tasks.iter().find(|t| t.transaction_id == tx).map(|t| t.status)
                            })
                        };
                        if ended {
                            tokio::time::sleep_until(next.min(started + MIN_ROUND)).await;
                            break;
                        }
                    }
                }
            }
        }
        if let Ok(session) = self.session.session().await {
            release_lock(&session, &name).await;
        }
        if gone {
            status.send_modify(|s| {
                s.tables.remove(&name);
            });
        }
    }

    /// One round of a table's policy, under its lock; answers how long to
    /// wait for the next. `st` carries the table's status from round to
    /// round.
    async fn table_turn(
        &self,
        spec: &PolicyTable,
        state: &mut TablePolicy,
        rng: &mut rand::rngs::SmallRng,
        st: &mut TablePolicyStatus,
    ) -> Duration {
        let PolicyTable {
            table,
            policy,
            format,
        } = spec;
        let name = &table.def.name;
        let freshness = Duration::from_secs(policy.freshness_seconds);
        let next = (freshness / 4).clamp(MIN_ROUND, MAX_ROUND);
        *st = TablePolicyStatus {
            to: policy.to.clone(),
            format: format.to_string(),
            freshness_seconds: policy.freshness_seconds,
            exports_requested: st.exports_requested,
            retention_seconds: policy.retention_seconds,
            retirements: st.retirements,
            orphans_removed: st.orphans_removed,
            compactions: st.compactions,
            last_round_unix_ms: st.last_round_unix_ms,
            ..TablePolicyStatus::default()
        };
        let session = match self.session.session().await {
            Ok(s) => s,
            Err(e) => {
                st.last_error = Some(format!("no coordination session: {e}"));
                return next.max(IDLE_ROUND);
            }
        };
        match take_lock(&session, name, &self.replica_name).await {
            Ok(true) => {}
            Ok(false) => {
                // Another node runs it: what this node knew goes stale.
                *state = TablePolicy::default();
                return next.max(IDLE_ROUND);
            }
            Err(e) => {
                st.last_error = Some(format!("policy lock: {e}"));
                return next.max(IDLE_ROUND);
            }
        }
        st.running_here = true;
        state.destination(&format!("{format} {}", policy.to));
        if let Err(e) = self
            .table_round(&session, table, policy, state, rng, st)
            .await
        {
            tracing::warn!(table = %name, error = %e, "export policy round");
            st.last_error = Some(e);
        }
        let now_ms = self.clock.unix_micros() / 1000;
        let (lag_ms, behind) = state.lag(now_ms);
        st.lag_seconds = lag_ms as f64 / 1000.0;
        st.partitions_behind = behind as u64;
        st.partitions = state.partitions.len() as u64;
        st.last_round_unix_ms = now_ms;
        next
    }

    async fn table_round(
        &self,
        session: &Session,
        table: &Table,
        policy: &ExportPolicy,
        state: &mut TablePolicy,
        rng: &mut rand::rngs::SmallRng,
        st: &mut TablePolicyStatus,
    ) -> Result<(), String> {
        let name = &table.def.name;
        let commit_lsn = (self.commit_lsn)()
            .await
            .map_err(|e| format!("cannot learn the commit position: {e}"))?;
        let wait = Duration::from_secs(policy.freshness_seconds).min(MAX_APPLY_WAIT);
        let parts = self
            .parts
            .snapshot(&SnapshotRequest {
                table: table.clone(),
                partition_id: None,
                at: commit_lsn,
                wait_ms: wait.as_millis() as u64,
                pin: None,
            })
            .await
            .map_err(|e| format!("listing the table's parts: {e}"))?;
        let contents = partition_contents(name, &parts);
        let view = self.view.borrow().clone();
        let status_of = |tx: &str| {
            view.tasks
                .iter()
                .find(|t| t.transaction_id == tx)
                .map(|t| t.status)
        };
        let now_ms = self.clock.unix_micros() / 1000;
        let forget_after_ms = (policy.freshness_seconds * 1000).max(10_000);
        // Half the target between two commits of a partition: a row waits
        // at most that, a round (a quarter) and its export, within the
        // target; each commit costs the replicas a pin and an unpin (a state
        // write each), so fewer commits leave more to inserts.
        let spacing_ms = (policy.freshness_seconds * 1000 / 2).max(MIN_ROUND.as_millis() as u64);
        let wanted = state.plan(now_ms, &contents, status_of, forget_after_ms, spacing_ms);
        let mut errors = Vec::new();
        // Each increment adds a commit file or a snapshot: those superseded
        // long enough ago expire.
        if now_ms.saturating_sub(state.last_upkeep_ms) >= self.upkeep.interval.as_millis() as u64 {
            state.last_upkeep_ms = now_ms;
            let cut_ms = now_ms.saturating_sub(self.upkeep.superseded_grace.as_millis() as u64);
            let format = format_of(table);
            match self.destinations.open(&policy.to) {
                Ok(location) => {
                    let expired = match format {
                        LakeFormat::Parquet => {
                            crate::upkeep::expire_commits(&location, cut_ms / 1000)
                                .await
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        }
                        LakeFormat::Iceberg => {
                            let cut = i64::try_from(cut_ms).unwrap_or(i64::MAX);
                            let expired = ferry_iceberg::IcebergTable::new(location.clone())
                                .expire_snapshots(cut, i64::try_from(now_ms).unwrap_or(i64::MAX))
                                .await
                                .map(|_| ())
                                .map_err(|e| e.to_string());
                            match expired {
                                Ok(()) => crate::upkeep::remove_superseded_shards(&location, cut)
                                    .await
                                    .map(|_| ()),
                                Err(e) => Err(e),
                            }
                        }
                    };
                    if let Err(e) = expired {
                        errors.push(format!("expiring superseded commits: {e}"));
                    }
                    match self
                        .remove_orphans(session, name, policy, format, &location, cut_ms)
                        .await
                    {
                        Ok(n) => st.orphans_removed += n,
                        Err(e) => errors.push(format!("removing orphan data files: {e}")),
                    }
                }
                Err(e) => errors.push(format!("opening {}: {e}", policy.to)),
            }
        }
        for partition in wanted.into_iter().take(MAX_REQUESTS_PER_ROUND) {
            let requester = Requester {
                session,
                sessions: self.sessions.as_ref(),
                parts: self.parts.as_ref(),
                destinations: self.destinations.as_ref(),
                replica_name: &self.replica_name,
                now_unix_millis: self.clock.unix_micros() / 1000,
                random: rng.random(),
                commit_lsn,
                wait,
            };
            let request = ExportRequest {
                table: name.clone(),
                partition_id: partition.clone(),
                destination: policy.to.clone(),
                force: false,
                replace_finished: true,
                by_policy: true,
                settings: Default::default(),
            };
            match requester.export(&request).await {
                Ok(created) => {
                    // The content the task holds is the one snapshotted now,
                    // which may be newer than the round's listing.
                    let content = contents.get(&partition).cloned().unwrap_or_default();
                    if created.unchanged.is_some() {
                        state.in_lake(&partition, &content);
                    } else {
                        st.exports_requested += 1;
                        state.requested(&partition, &content, &created.transaction_id, now_ms);
                        tracing::info!(table = %name, partition = %partition, transaction_id = %created.transaction_id, rows = created.rows, "export policy: export requested");
                    }
                }
                // A task of the key is in flight (a manual export, or this
                // policy's own before this node saw it): the next round looks
                // again.
                Err(RequestError::AlreadyExists { .. }) => {}
                Err(e) => errors.push(format!("partition {partition}: {e}")),
            }
        }
        if let Err(e) = self
            .compact_round(table, policy, state, &parts, &contents, st)
            .await
        {
            errors.push(e);
        }
        if let Some(retention) = policy.retention_seconds {
            if let Err(e) = self
                .retire_round(table, policy, retention, state, &parts, &contents, st)
                .await
            {
                errors.push(e);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// Removes the destination's data files no commit (or snapshot) lists
    /// that were last modified before `cut_ms` (those only expired commits
    /// listed, uploads of exports killed or failed), but only in a round
    /// when no export of the table to it is in flight: an export's uploads
    /// are orphans until its commit lands, and one in flight may have
    /// uploaded before the cut. An export created after the check uploads
    /// after it, past the cut. Answers how many went.
    async fn remove_orphans(
        &self,
        session: &Session,
        table: &str,
        policy: &ExportPolicy,
        format: LakeFormat,
        location: &ferry_storage::Location,
        cut_ms: u64,
    ) -> Result<u64, String> {
        // The marker first, then the check: a task created after the
        // marker is refused (`request::create`), one created before it is
        // seen in flight below. Ephemeral: a remover that dies leaves none.
        let marker = crate::model::lake_upkeep_path(table, location.url());
        match session.create(&marker, &[], CreateMode::Ephemeral).await {
            Ok(_) => {}
            Err(CoordError::NodeExists { .. }) => {
                // This session's own (an answer lost), or another remover's.
                match session.exists(&marker).await {
                    Ok(Some(stat)) if stat.ephemeral_owner == session.session_id() => {}
                    Ok(_) => return Ok(0),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Err(e) => return Err(e.to_string()),
        }
        let removed = self
            .remove_orphans_marked(session, table, policy, format, location, cut_ms)
            .await;
        // A marker left behind would hold back every export to the
        // destination while this session lives: its delete is tried until
        // it is gone (or the session, and the marker with it).
        for attempt in 0..MARKER_DELETE_ATTEMPTS {
            match session.delete(&marker, None).await {
                Ok(()) | Err(CoordError::NoNode { .. }) => break,
                Err(e) if e.is_session_end() => break,
                Err(e) => {
                    tracing::warn!(%table, attempt, error = %e, "could not remove the orphan removal's marker; trying again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        removed
    }

    async fn remove_orphans_marked(
        &self,
        session: &Session,
        table: &str,
        policy: &ExportPolicy,
        format: LakeFormat,
        location: &ferry_storage::Location,
        cut_ms: u64,
    ) -> Result<u64, String> {
        let keys = match session.children(&crate::model::exports_path(table)).await {
            Ok((keys, _)) => keys,
            Err(CoordError::NoNode { .. }) => Vec::new(),
            Err(e) => return Err(e.to_string()),
        };
        for key in keys {
            let key = crate::model::TaskKey {
                table: table.to_string(),
                key,
            };
            let head = crate::task::read_head(session, &key)
                .await
                .map_err(|e| e.to_string())?;
            let Some(head) = head else { continue };
            // A task being created (no metadata yet) may be of any
            // destination: it counts as in flight.
            let ours = head
                .metadata
                .as_ref()
                .is_none_or(|m| m.destination == policy.to);
            if ours && !head.status.is_some_and(|s| s.is_terminal()) {
                return Ok(0);
            }
        }
        let cut = i64::try_from(cut_ms).unwrap_or(i64::MAX);
        let removed = match format {
            LakeFormat::Parquet => crate::upkeep::remove_orphans(location, cut)
                .await
                .map_err(|e| e.to_string())?
                .removed
                .len(),
            LakeFormat::Iceberg => ferry_iceberg::IcebergTable::new(location.clone())
                .remove_orphans(cut)
                .await
                .map_err(|e| e.to_string())?
                .removed
                .len(),
        };
        if removed > 0 {
            tracing::info!(%table, destination = %policy.to, removed, "export policy: orphan data files removed");
        }
        Ok(removed as u64)
    }

    /// Compaction: a partition whose rows the lake holds and which stopped
    /// changing (no rows, no merges for [`compaction_idle`]) is compacted
    /// when its parts would merge into fewer near the target size: a
    /// `Compact` record has every replica merge runs of its consecutive
    /// parts up to the target (in rows, from the partition's bytes per
    /// row), and the next increment replaces the lake's small files by the
    /// merged ones (a merged part holds the files it meets: they leave the
    /// commit, as in any increment).
    async fn compact_round(
        &self,
        table: &Table,
        policy: &ExportPolicy,
        state: &mut TablePolicy,
        parts: &[ferry_replica::PartMeta],
        contents: &BTreeMap<String, String>,
        st: &mut TablePolicyStatus,
    ) -> Result<(), String> {
        let now_ms = self.clock.unix_micros() / 1000;
        let idle = compaction_idle(policy.freshness_seconds);
        let candidates = state.compaction_candidates(now_ms, contents, idle.as_millis() as u64);
        let mut errors = Vec::new();
        for partition in candidates.into_iter().take(MAX_REQUESTS_PER_ROUND) {
            let local: Vec<&ferry_replica::PartMeta> = parts
                .iter()
                .filter(|p| p.name.partition_id == partition && !p.retired)
                .collect();
            let (rows, bytes) = local
                .iter()
                .fold((0u64, 0u64), |(r, b), p| (r + p.rows, b + p.bytes));
            if rows == 0 || local.len() < 2 {
                continue;
            }
            let target_rows = (self.target_file_bytes as u128 * rows as u128 / bytes.max(1) as u128)
                .clamp(1, u64::MAX as u128) as u64;
            let named = local.iter().map(|p| (p.name.clone(), p.rows)).collect();
            if ferry_replica::plan_compaction(table.id, &partition, named, target_rows).is_empty() {
                continue;
            }
            let record = Maintenance::Compact(Compaction {
                table_id: table.id,
                partition_id: partition.clone(),
                target_rows,
            });
            match (self.maintain)(table.def.name.clone(), record).await {
                Ok(lsn) => {
                    st.compactions += 1;
                    tracing::info!(table = %table.def.name, partition = %partition, target_rows, parts = local.len(), %lsn, destination = %policy.to, "export policy: partition compacted");
                }
                Err(e) => {
                    // Asked again at a later round (a record appended
                    // after all is harmless: the merges it decides are
                    // decided once, a second one finds nothing to merge).
                    state.compaction_failed(&partition);
                    errors.push(format!("partition {partition}: compacting: {e}"))
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// Retention: a partition leaves the replicas when the destination's
    /// current commit holds every row the replicas list for it (`parts`,
    /// a snapshot at the commit position) and was made over `retention`
    /// seconds ago (no rows came since: they would have made a newer
    /// commit). The retirement names that commit's files; each replica
    /// drops only parts one of them holds whole, so a row the lake lacks
    /// stays whatever happens between this check and the record.
    #[allow(clippy::too_many_arguments)]
    async fn retire_round(
        &self,
        table: &Table,
        policy: &ExportPolicy,
        retention: u64,
        state: &mut TablePolicy,
        parts: &[ferry_replica::PartMeta],
        contents: &BTreeMap<String, String>,
        st: &mut TablePolicyStatus,
    ) -> Result<(), String> {
        let name = &table.def.name;
        let now_ms = self.clock.unix_micros() / 1000;
        let held: BTreeSet<String> = parts
            .iter()
            .filter(|p| !p.retired && p.rows > 0)
            .map(|p| p.name.partition_id.clone())
            .collect();
        let every = Duration::from_secs(retention / 10)
            .clamp(Duration::from_secs(1), MAX_RETIRE_CHECK_INTERVAL);
        let candidates =
            state.retirement_candidates(now_ms, contents, &held, every.as_millis() as u64);
        if candidates.is_empty() {
            return Ok(());
        }
        let format = format_of(table);
        let location = self
            .destinations
            .open(&policy.to)
            .map_err(|e| format!("opening {}: {e}", policy.to))?;
        let mut errors = Vec::new();
        for partition in candidates.into_iter().take(MAX_RETIREMENTS_PER_ROUND) {
            let current = match crate::lake::current_commit(
                &location, format, &table.def, &partition,
            )
            .await
            {
                Ok(Some(c)) => c,
                Ok(None) => continue,
                Err(e) => {
                    errors.push(format!("partition {partition}: reading the lake: {e}"));
                    continue;
                }
            };
            if current.create_time.saturating_add(retention) > now_ms / 1000 {
                continue;
            }
            let snapshot: Vec<ferry_replica::PartMeta> = parts
                .iter()
                .filter(|p| p.name.partition_id == partition)
                .cloned()
                .collect();
            let rows: u64 = snapshot.iter().map(|p| p.rows).sum();
            if rows != current.rows || crate::request::lacks(&current, &snapshot).is_some() {
                continue;
            }
            let retirement = retirement_of(table.id, &partition, &policy.to, format, &current);
            match (self.maintain)(name.clone(), Maintenance::Retire(retirement)).await {
                Ok(lsn) => {
                    st.retirements += 1;
                    tracing::info!(table = %name, partition = %partition, commit = %current.key, %lsn, "retention: partition retired from the replicas");
                }
                Err(e) => errors.push(format!("partition {partition}: retiring: {e}")),
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

/// How long a partition's content must stay the same before it is
/// compacted: four freshness targets, within 5 s and 10 min.
pub fn compaction_idle(freshness_seconds: u64) -> Duration {
    Duration::from_secs(freshness_seconds.saturating_mul(4))
        .clamp(Duration::from_secs(5), Duration::from_secs(600))
}

/// The size compaction aims partitions' files at by default.
pub const DEFAULT_TARGET_FILE_BYTES: u64 = 128 << 20;

/// The format a table's exports take.
fn format_of(table: &Table) -> LakeFormat {
    table
        .def
        .export
        .as_ref()
        .map(|e| e.format)
        .unwrap_or_default()
}

/// The retirement of `partition` by the files of `current`, its current
/// commit in `destination`: what each replica drops only parts of (files
/// that name no part are left out: they hold no part a replica has).
pub fn retirement_of(
    table_id: u64,
    partition: &str,
    destination: &str,
    format: LakeFormat,
    current: &crate::lake::CurrentCommit,
) -> Retirement {
    let files: Vec<RetiredFile> = current
        .data_files
        .iter()
        .filter_map(|f| {
            Some(RetiredFile {
                part: crate::lake::part_of(&f.path)?.to_string(),
                path: f.path.clone(),
                shard: f.shard,
                rows: f.rows,
                bytes: f.bytes,
                checksum: f.checksum,
            })
        })
        .take(MAX_RETIRED_FILES)
        .collect();
    Retirement {
        table_id,
        partition_id: partition.to_string(),
        destination: destination.to_string(),
        format: format.to_string(),
        commit: current.key.clone(),
        files,
    }
}

/// Tables with an export policy, from the catalog.
async fn policy_tables(session: &Session) -> Result<Vec<PolicyTable>, CoordError> {
    let names = match session.children(TABLES).await {
        Ok((names, _)) => names,
        Err(CoordError::NoNode { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for name in names {
        let data = match session.get(&format!("{TABLES}/{name}")).await {
            Ok((data, _)) => data,
            Err(CoordError::NoNode { .. }) => continue,
            Err(e) => return Err(e),
        };
        let Ok(table) = serde_json::from_slice::<Table>(&data) else {
            tracing::warn!(table = %name, "export policies: a damaged table definition is skipped");
            continue;
        };
        if let Some(export) = &table.def.export {
            if let Some(policy) = &export.policy {
                let (policy, format) = (policy.clone(), export.format);
                out.push(PolicyTable {
                    table,
                    policy,
                    format,
                });
            }
        }
    }
    Ok(out)
}

/// Whether the runner is to stop: told so, or its owner is gone (a closed
/// channel would otherwise wake every wait at once, for ever).
fn stopping(stop: &watch::Receiver<bool>) -> bool {
    *stop.borrow() || stop.has_changed().is_err()
}

/// A table's part of its policy task's seed: tables' transaction ids draw
/// apart, the same way in every run of a seed (FNV-1a).
fn table_seed(table: &str) -> u64 {
    table.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn lock_path(table: &str) -> String {
    format!("{POLICY_LOCKS}/{table}")
}

/// Takes (or confirms this session holds) the table's policy lock.
async fn take_lock(session: &Session, table: &str, holder: &str) -> Result<bool, CoordError> {
    let path = lock_path(table);
    match session
        .create(&path, holder.as_bytes(), CreateMode::Ephemeral)
        .await
    {
        Ok(_) => {
            tracing::info!(%table, %holder, "export policy: running here");
            return Ok(true);
        }
        Err(CoordError::NoNode { .. }) => {
            ferry_coord::create_all(session.as_ref(), POLICY_LOCKS).await?;
            return Box::pin(take_lock(session, table, holder)).await;
        }
        Err(CoordError::NodeExists { .. }) => {}
        Err(e) => return Err(e),
    }
    match session.exists(&path).await? {
        Some(stat) => Ok(stat.ephemeral_owner == session.session_id()),
        // Released meanwhile: the next round takes it.
        None => Ok(false),
    }
}

async fn release_lock(session: &Session, table: &str) {
    let path = lock_path(table);
    if let Ok(Some(stat)) = session.exists(&path).await {
        if stat.ephemeral_owner == session.session_id() {
            let _ = session.delete(&path, Some(stat.version)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(p, c)| (p.to_string(), c.to_string()))
            .collect()
    }

    #[test]
    fn an_idle_partition_is_compacted_once_unless_the_record_failed() {
        let mut policy = TablePolicy::default();
        let c = contents(&[("a", "c1")]);
        assert_eq!(policy.plan(0, &c, |_| None, 10_000, 0), vec!["a"]);
        policy.in_lake("a", "c1");
        // Not idle yet, then idle: a candidate once.
        assert!(policy.compaction_candidates(1_000, &c, 5_000).is_empty());
        assert_eq!(policy.compaction_candidates(6_000, &c, 5_000), vec!["a"]);
        assert!(policy.compaction_candidates(7_000, &c, 5_000).is_empty());
        // Its record not written: a candidate again.
        policy.compaction_failed("a");
        assert_eq!(policy.compaction_candidates(8_000, &c, 5_000), vec!["a"]);
    }

    #[test]
    fn a_changed_partition_is_requested_once_until_its_task_ends() {
        let mut policy = TablePolicy::default();
        let none = |_: &str| None;
        assert_eq!(
            policy.plan(1000, &contents(&[("a", "c1")]), none, 10_000, 0),
            vec!["a"]
        );
        policy.requested("a", "c1", "tx1", 1000);
        // Pending (or not seen yet): not asked again.
        let pending = |_: &str| Some(TaskStatus::Pending);
        assert!(policy
            .plan(2000, &contents(&[("a", "c1")]), pending, 10_000, 0)
            .is_empty());
        assert!(policy
            .plan(2500, &contents(&[("a", "c2")]), none, 10_000, 0)
            .is_empty());
        assert_eq!(policy.lag(3000), (2000, 1));
        // Completed with c1 while the partition moved on to c2: asked again.
        let done = |_: &str| Some(TaskStatus::Completed);
        assert_eq!(
            policy.plan(4000, &contents(&[("a", "c2")]), done, 10_000, 0),
            vec!["a"]
        );
        policy.requested("a", "c2", "tx2", 4000);
        assert!(
            policy.asked_ended(done),
            "tx2 seen COMPLETED: a round is due"
        );
        assert!(!policy.asked_ended(pending));
        assert_eq!(
            policy.plan(5000, &contents(&[("a", "c2")]), done, 10_000, 0),
            Vec::<String>::new()
        );
        assert_eq!(policy.lag(5000), (0, 0));
        assert!(!policy.asked_ended(done), "nothing asked any more");
    }

    #[test]
    fn only_partitions_the_lake_holds_and_replicas_still_hold_are_checked_for_retention() {
        let mut policy = TablePolicy::default();
        let c = contents(&[("a", "c1"), ("b", "c2"), ("c", "c3")]);
        policy.plan(0, &c, |_| None, 10_000, 0);
        policy.in_lake("a", "c1");
        policy.in_lake("b", "c-older");
        policy.in_lake("c", "c3");
        let held: BTreeSet<String> = ["a", "b"].iter().map(|s| s.to_string()).collect();
        // b's rows are not all in the lake; c holds nothing locally any more.
        assert_eq!(
            policy.retirement_candidates(1000, &c, &held, 5000),
            vec!["a"]
        );
        assert!(
            policy
                .retirement_candidates(3000, &c, &held, 5000)
                .is_empty(),
            "checked within the interval"
        );
        assert_eq!(
            policy.retirement_candidates(6000, &c, &held, 5000),
            vec!["a"]
        );
        // An export in flight: not now.
        policy.requested("a", "c1", "tx", 7000);
        assert!(policy
            .retirement_candidates(20_000, &c, &held, 5000)
            .is_empty());
    }

    #[test]
    fn a_partition_is_asked_at_most_once_per_spacing() {
        let mut policy = TablePolicy::default();
        let done = |_: &str| Some(TaskStatus::Completed);
        assert_eq!(
            policy.plan(0, &contents(&[("a", "c1")]), done, 10_000, 2500),
            vec!["a"]
        );
        policy.requested("a", "c1", "tx1", 0);
        // Its export ended at once and the partition changed again: not
        // before the spacing passed, and counted behind meanwhile.
        assert!(policy
            .plan(1000, &contents(&[("a", "c2")]), done, 10_000, 2500)
            .is_empty());
        // Behind since the request whose export landed: the rows the lake
        // lacks came after it.
        assert_eq!(policy.lag(2000), (2000, 1));
        assert_eq!(
            policy.plan(2500, &contents(&[("a", "c2")]), done, 10_000, 2500),
            vec!["a"]
        );
    }

    #[test]
    fn a_failed_or_forgotten_task_is_asked_again_and_unchanged_content_is_in_the_lake() {
        let mut policy = TablePolicy::default();
        let c = contents(&[("a", "c1"), ("b", "c9")]);
        assert_eq!(policy.plan(0, &c, |_| None, 10_000, 0), vec!["a", "b"]);
        policy.requested("a", "c1", "tx1", 0);
        policy.in_lake("b", "c9");
        let failed = |_: &str| Some(TaskStatus::Failed);
        assert_eq!(policy.plan(1000, &c, failed, 10_000, 0), vec!["a"]);
        policy.requested("a", "c1", "tx2", 1000);
        assert!(policy.plan(5000, &c, |_| None, 10_000, 0).is_empty());
        assert_eq!(policy.plan(11_001, &c, |_| None, 10_000, 0), vec!["a"]);
        assert_eq!(policy.lag(11_001), (11_001, 1));
        // A partition gone (dropped, or empty) is forgotten.
        assert!(policy
            .plan(12_000, &BTreeMap::new(), |_| None, 10_000, 0)
            .is_empty());
        assert_eq!(policy.lag(12_000), (0, 0));
    }
}
