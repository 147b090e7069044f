//! Policy runs: the table exports itself to the first destination. Every
//! node runs the product's [`PolicyRunner`] on its replica, sessions and
//! the simulated lake; the upkeep records it asks for (retirements,
//! compactions) reach the WAL through a simulated writer that appends them
//! between the schedule's steps and answers, except that some answers are
//! lost after the append and some asks refused: a policy must live with
//! both (a retirement appended twice, a compaction never written).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_export::policy::{CommitPosition, MaintenanceSink, PolicyRunner};
use ferry_table::def::{ExportDefaults, ExportPolicy};
use ferry_table::Table;
use ferry_wal::record::Maintenance;
use ferry_wal::Lsn;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::{partition_of, table, Asked, Failure, Sim, DESTINATIONS, NODES, PARTITIONS};

/// Upkeep records the simulated writer holds unanswered at most.
const ASKS_IN_FLIGHT: usize = 16;
const FRESHNESS_SECONDS: u64 = 1;
/// The size compaction aims at: small, so that a compacted partition of
/// the run keeps several files.
const TARGET_FILE_BYTES: u64 = 16 << 10;
/// Of the upkeep records asked for: appended but the answer lost, and
/// refused (not appended).
const LOST_ANSWER: f64 = 0.1;
const REFUSED: f64 = 0.05;
/// The policy's upkeep of its destination (expiring superseded commits,
/// removing orphan data files), short enough to run many times a run.
const UPKEEP: ferry_export::policy::UpkeepTiming = ferry_export::policy::UpkeepTiming {
    interval: Duration::from_millis(500),
    superseded_grace: Duration::from_millis(500),
};
/// Once faults stop, every inserted row is in its partition's current
/// commit within this.
const CAUGHT_UP_WITHIN: Duration = Duration::from_secs(120);

type Ask = (Maintenance, oneshot::Sender<Result<Lsn, String>>);

/// A policy run's policy and its simulated writer.
pub(super) struct PolicyRun {
    policy: ExportPolicy,
    sink: MaintenanceSink,
    asks: mpsc::Receiver<Ask>,
    /// The WAL's end, as the writer's commit position.
    wal_end: Arc<AtomicU64>,
    rng: SmallRng,
    pub(super) records: usize,
    /// Orphan data files the runners removed (as their status says when
    /// they stop; a crashed runner's count is lost).
    pub(super) orphans_removed: u64,
}

/// A node's policy runner.
pub(super) struct PolicyTask {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    status: watch::Receiver<ferry_export::policy::PolicyStatus>,
}

impl PolicyTask {
    /// A crash: the rounds end at once.
    pub(super) async fn abort(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

impl PolicyRun {
    /// Half of the runs, drawn from `seed` alone (runs without a policy
    /// draw what they drew before policies existed).
    pub(super) fn draw(seed: u64) -> Option<PolicyRun> {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x706f_6c69_6379_2121);
        if !rng.random_bool(0.5) {
            return None;
        }
        let retention_seconds = rng.random_bool(0.5).then(|| rng.random_range(1..6));
        let (tx, asks) = mpsc::channel::<Ask>(ASKS_IN_FLIGHT);
        let sink: MaintenanceSink = Arc::new(move |_table, m| {
            let tx = tx.clone();
            Box::pin(async move {
                let (reply, answer) = oneshot::channel();
                tx.send((m, reply))
                    .await
                    .map_err(|_| "the writer is gone".to_string())?;
                answer
                    .await
                    .map_err(|_| "the writer's answer was lost".to_string())?
            })
        });
        Some(PolicyRun {
            policy: ExportPolicy {
                to: DESTINATIONS[0].to_string(),
                freshness_seconds: FRESHNESS_SECONDS,
                retention_seconds,
            },
            sink,
            asks,
            wal_end: Arc::default(),
            rng,
            records: 0,
            orphans_removed: 0,
        })
    }

    pub(super) fn describe(&self) -> String {
        format!(
            "the table exports itself to {} (freshness {} s, retention {:?} s)",
            self.policy.to, self.policy.freshness_seconds, self.policy.retention_seconds
        )
    }

    /// The table as the catalog holds it: with its policy.
    pub(super) fn table(&self) -> Table {
        let mut t = table();
        t.def.export = Some(ExportDefaults {
            format: ferry_export::model::LakeFormat::Parquet,
            policy: Some(self.policy.clone()),
        });
        t
    }

    /// Starts a node's policy runner on the node's seams.
    pub(super) fn start(&self, mut runner: RunnerSeams) -> PolicyTask {
        let wal_end = Arc::clone(&self.wal_end);
        let commit_lsn: CommitPosition = Arc::new(move || {
            let end = Lsn(wal_end.load(Ordering::SeqCst));
            Box::pin(async move { Ok(end) })
        });
        let runner = PolicyRunner {
            session: runner.session,
            sessions: runner.sessions,
            parts: runner.parts,
            destinations: runner.destinations,
            replica_name: std::mem::take(&mut runner.replica_name),
            clock: runner.clock,
            commit_lsn,
            maintain: Arc::clone(&self.sink),
            target_file_bytes: TARGET_FILE_BYTES,
            upkeep: UPKEEP,
            view: runner.view,
            seed: runner.seed,
        };
        let (status_tx, status) = watch::channel(Default::default());
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(runner.run(status_tx, stop_rx));
        PolicyTask { stop, task, status }
    }
}

/// What a policy runner takes from its node.
pub(super) struct RunnerSeams {
    pub(super) session: ferry_coord::RenewingSession,
    pub(super) sessions: Arc<dyn ferry_coord::SessionFactory>,
    pub(super) parts: Arc<dyn ferry_export::LocalParts>,
    pub(super) destinations: Arc<dyn ferry_export::Destinations>,
    pub(super) replica_name: String,
    pub(super) clock: Arc<dyn ferry_env::Clock>,
    pub(super) view: watch::Receiver<ferry_export::ExportsView>,
    pub(super) seed: u64,
}

impl Sim {
    /// The table as the catalog and the replicas know it.
    pub(super) fn catalog_table(&self) -> Table {
        self.policy.as_ref().map_or_else(table, PolicyRun::table)
    }

    /// The WAL as appended so far reaches the replicas, and its end the
    /// policies' commit position.
    pub(super) fn publish_wal(&mut self) {
        self.fed
            .send_replace(bytes::Bytes::copy_from_slice(&self.wal));
        if let Some(run) = &self.policy {
            run.wal_end.store(self.wal.len() as u64, Ordering::SeqCst);
        }
    }

    /// The simulated writer: appends the upkeep records asked for since the
    /// last step, answering their end (or losing the answer, or refusing).
    pub(super) fn write_upkeep(&mut self) {
        let Some(run) = &mut self.policy else {
            return;
        };
        let mut asks = Vec::new();
        while let Ok(ask) = run.asks.try_recv() {
            asks.push((ask, run.rng.random::<f64>()));
        }
        for ((m, reply), roll) in asks {
            if roll < REFUSED {
                self.log(format!("upkeep record refused: {m:?}"));
                let _ = reply.send(Err("refused by the simulated writer".into()));
                continue;
            }
            self.log(format!("upkeep record at {}: {m:?}", self.wal.len()));
            match &m {
                Maintenance::Retire(_) => self.retirements += 1,
                Maintenance::Compact(_) => self.compactions += 1,
            }
            m.into_record().encode(&mut self.wal);
            if let Some(run) = &mut self.policy {
                run.records += 1;
            }
            self.publish_wal();
            if roll < REFUSED + LOST_ANSWER {
                self.log("its answer lost");
            } else {
                let _ = reply.send(Ok(Lsn(self.wal.len() as u64)));
            }
        }
    }

    /// The schedule's view of a commit file of the policy (in its
    /// destination, not asked by the schedule): the rows of the partition
    /// as of the snapshot position it names, at least (a replica may have
    /// applied more by the snapshot).
    pub(super) fn policy_commit(
        &self,
        prefix: &str,
        partition: &str,
        snapshot_lsn: u64,
    ) -> Option<Asked> {
        let run = self.policy.as_ref()?;
        if Some(prefix) != run.policy.to.strip_prefix("sim://lake/") {
            return None;
        }
        let ids: BTreeSet<i64> = self
            .rows
            .iter()
            .filter(|(at, id)| at.0 <= snapshot_lsn && partition_of(*id) == partition)
            .map(|(_, id)| *id)
            .collect();
        Some(Asked {
            partition: partition.to_string(),
            destination: run.policy.to.clone(),
            refused: false,
            ids,
            maybe_killed: self
                .forced
                .contains(&(partition.to_string(), run.policy.to.clone())),
            killed: false,
            at_least: true,
        })
    }

    /// Whether a policy task of `partition` to `destination` (one the
    /// schedule never asked for) may have been replaced, so KILLED, by a
    /// forced export of the schedule.
    pub(super) fn policy_task_killable(&self, partition: &str, destination: &str) -> bool {
        self.policy
            .as_ref()
            .is_some_and(|run| run.policy.to == destination)
            && self
                .forced
                .contains(&(partition.to_string(), destination.to_string()))
    }

    /// Once faults stopped: every inserted row reaches the current commit
    /// of its partition in the policy's destination, with nobody asking.
    pub(super) async fn policy_caught_up(&mut self) -> Result<(), Failure> {
        let Some(run) = &self.policy else {
            return Ok(());
        };
        let to = run.policy.to.clone();
        let run_retention = run.policy.retention_seconds;
        let prefix = to
            .strip_prefix("sim://lake/")
            .unwrap_or_default()
            .to_string();
        let lake = ferry_storage::Location::from_store(&to, self.world.lake_store.truth(), &prefix)
            .map_err(|e| self.fail(format!("the lake: {e}")))?;
        let deadline = Instant::now() + CAUGHT_UP_WITHIN;
        loop {
            self.write_upkeep();
            let mut behind = Vec::new();
            for partition in PARTITIONS {
                let want = self
                    .rows
                    .iter()
                    .filter(|(_, id)| partition_of(*id) == partition)
                    .count() as u64;
                let have = ferry_export::lake::current_commit(
                    &lake,
                    ferry_export::model::LakeFormat::Parquet,
                    &table().def,
                    partition,
                )
                .await
                .map_err(|e| self.fail(format!("reading {to}: {e}")))?
                .map_or(0, |c| c.rows);
                if have != want {
                    behind.push(format!("{partition}: {have} of {want} rows"));
                }
            }
            if behind.is_empty() && run_retention.is_none() {
                self.log(format!("the policy caught up: {to} holds every row"));
                return Ok(());
            }
            if behind.is_empty() {
                // With retention, the idle partitions leave every replica.
                for (i, node) in self.nodes.iter().enumerate() {
                    let Some(node) = node else { continue };
                    let r = node.node.replica.lock().await;
                    let kept: BTreeSet<String> = r
                        .parts(super::TABLE_ID)
                        .into_iter()
                        .map(|p| p.name.partition_id)
                        .collect();
                    if !kept.is_empty() {
                        behind.push(format!("n{i} keeps partitions {kept:?}"));
                    }
                }
                if behind.is_empty() {
                    self.log(format!(
                        "the policy caught up: {to} holds every row, and every partition left the replicas"
                    ));
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                let statuses: Vec<String> = self
                    .nodes
                    .iter()
                    .flatten()
                    .filter_map(|n| n.policy.as_ref())
                    .map(|p| format!("{:?}", p.status.borrow().tables))
                    .collect();
                // What each node's exporter mirrors as still in flight (a
                // policy waits for the tasks it asked for to end there).
                let pending: Vec<Vec<String>> = self
                    .nodes
                    .iter()
                    .flatten()
                    .filter_map(|n| n.node.exports.as_ref())
                    .map(|v| {
                        v.borrow()
                            .tasks
                            .iter()
                            .filter(|t| !t.status.is_terminal())
                            .map(|t| format!("{} {}", t.key, t.transaction_id))
                            .collect()
                    })
                    .collect();
                return Err(self.fail(format!(
                    "{} s after faults stopped, the policy's lake does not hold each row once: {behind:?}; the runners: {statuses:?}; mirrored in flight: {pending:?}",
                    CAUGHT_UP_WITHIN.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops every node's policy runner (a round in flight finishes, its
    /// upkeep asks answered meanwhile), so that the final checks see the
    /// tasks settle.
    pub(super) async fn stop_policies(&mut self) -> Result<(), Failure> {
        let mut tasks = Vec::new();
        for i in 0..NODES {
            if let Some(t) = self.nodes[i].as_mut().and_then(|n| n.policy.take()) {
                let removed: u64 = t
                    .status
                    .borrow()
                    .tables
                    .values()
                    .map(|s| s.orphans_removed)
                    .sum();
                if let Some(run) = &mut self.policy {
                    run.orphans_removed += removed;
                }
                let _ = t.stop.send(true);
                tasks.push(t.task);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while !tasks.iter().all(|t| t.is_finished()) {
            if Instant::now() > deadline {
                return Err(self.fail("a policy runner did not stop within 120 s"));
            }
            self.write_upkeep();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for t in tasks {
            let _ = t.await;
        }
        Ok(())
    }
}
