//! The status listing (SPEC.md section 5) and the exporter's counters, as
//! the run loop publishes them from the mirror.

use serde::Serialize;
use tokio::time::Instant;

use super::Run;
use crate::model::TaskStatus;

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
    /// Asked by the table's export policy.
    #[serde(default)]
    pub by_policy: bool,
    /// Files of the partition's previous commit the task carries.
    #[serde(default)]
    pub carried: u64,
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

impl Run<'_> {
    pub(super) fn publish(&self, now: Instant) {
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
                    by_policy: t.metadata.by_policy,
                    carried: t.metadata.carried,
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
                    backoff: t.queue.backoff_view(now),
                    running: t.queue.running().cloned().collect(),
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
