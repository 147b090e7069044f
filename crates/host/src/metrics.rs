//! A node's Prometheus metrics: a registry of live counters (the insert path's,
//! elections) and values sampled from the node's status when scraped (WAL
//! fsyncs and positions, coordination requests by type).

use std::sync::{Arc, Mutex};

use ferry_ingest::metrics::{Sample, Sampled};
use futures::future::BoxFuture;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

type Sampler = dyn Fn() -> BoxFuture<'static, Vec<Sample>> + Send + Sync;

/// What `GET /metrics` renders.
pub struct NodeMetrics {
    registry: Registry,
    latest: Arc<Mutex<Vec<Sample>>>,
    sampler: Box<Sampler>,
}

/// Reads the samples last taken (a collector must be synchronous).
struct Latest(Arc<Mutex<Vec<Sample>>>);

impl Latest {
    fn take(&self) -> Vec<Sample> {
        self.0.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl NodeMetrics {
    /// `registry` holds the live metrics; `sampler` is called at every scrape.
    pub fn new(
        mut registry: Registry,
        sampler: impl Fn() -> BoxFuture<'static, Vec<Sample>> + Send + Sync + 'static,
    ) -> NodeMetrics {
        let latest = Arc::new(Mutex::new(Vec::new()));
        let reader = Latest(Arc::clone(&latest));
        registry.register_collector(Box::new(Sampled::new(move || reader.take())));
        NodeMetrics {
            registry,
            latest,
            sampler: Box::new(sampler),
        }
    }

    /// The text exposition, with fresh samples.
    pub async fn render(&self) -> String {
        let samples = (self.sampler)().await;
        if let Ok(mut latest) = self.latest.lock() {
            *latest = samples;
        }
        ferry_ingest::metrics::render(&self.registry)
    }
}

pub fn gauge(
    name: &'static str,
    help: &'static str,
    labels: &[(&str, &str)],
    value: f64,
) -> Sample {
    Sample {
        name,
        help,
        counter: false,
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        value,
    }
}

pub fn counter(
    name: &'static str,
    help: &'static str,
    labels: &[(&str, &str)],
    value: f64,
) -> Sample {
    Sample {
        counter: true,
        ..gauge(name, help, labels, value)
    }
}

/// Coordination requests by type, and their errors.
pub fn coordination(metrics: &ferry_coord::CoordMetrics) -> Vec<Sample> {
    let snap = metrics.snapshot();
    let mut out = Vec::new();
    for (kind, n) in &snap.round_trips {
        out.push(counter(
            "ferry_coordination_requests",
            "Coordination requests by type",
            &[("type", kind)],
            *n as f64,
        ));
    }
    for (kind, n) in &snap.errors {
        out.push(counter(
            "ferry_coordination_errors",
            "Coordination requests answered with an error, by type",
            &[("type", kind)],
            *n as f64,
        ));
    }
    out
}

/// How the writer's commit record in coordination fares.
pub fn commit_record(r: &ferry_node::commit_record::WalStateRecording) -> Vec<Sample> {
    vec![
        gauge(
            "ferry_writer_commit_record_failing",
            "1 while the writer cannot record its commit state in coordination (/ferry/wal)",
            &[],
            if r.failing.is_some() { 1.0 } else { 0.0 },
        ),
        gauge(
            "ferry_writer_commit_record_lsn",
            "The commit_lsn the writer last recorded in coordination",
            &[],
            r.recorded.map(|s| s.commit_lsn.0 as f64).unwrap_or(0.0),
        ),
        counter(
            "ferry_writer_commit_record_failures",
            "Failed attempts to record the commit state in coordination",
            &[],
            r.failures_total as f64,
        ),
        counter(
            "ferry_coordination_session_renewals",
            "New coordination sessions opened after one ended (expired or closed)",
            &[],
            r.session_renewals as f64,
        ),
    ]
}

/// The WAL figures of a writer's status.
pub fn writer(status: &ferry_writer::driver::WriterStatus) -> Vec<Sample> {
    let lsn = |s: &str| {
        s.parse::<ferry_wal::Lsn>()
            .map(|l| l.0 as f64)
            .unwrap_or(0.0)
    };
    let end = lsn(&status.end_lsn);
    let lag = |at: ferry_wal::Lsn| (end - at.0 as f64).max(0.0);
    let mut out = vec![
        gauge(
            "ferry_writer_term",
            "The writer's current term",
            &[],
            status.term as f64,
        ),
        gauge(
            "ferry_writer_elected",
            "1 while the writer is elected",
            &[],
            f64::from(u8::from(status.elected)),
        ),
        gauge(
            "ferry_wal_commit_lsn",
            "The writer's commit_lsn (bytes)",
            &[],
            lsn(&status.commit_lsn),
        ),
    ];
    // What back-pressure compares with its limits: the end of WAL minus each
    // replica's received, durably applied and remote positions.
    for fb in &status.replicas {
        let shard = fb.shard_number.to_string();
        let replica = fb.replica_number.to_string();
        for (kind, at) in [
            ("write", fb.last_received_lsn),
            ("flush", fb.disk_consistent_lsn),
            ("apply", fb.remote_consistent_lsn),
        ] {
            out.push(gauge(
                "ferry_writer_replica_lag_bytes",
                "WAL bytes between the end of WAL and a replica's position (write: received, flush: durably applied, apply: remote)",
                &[("shard", &shard), ("replica", &replica), ("kind", kind)],
                lag(at),
            ));
        }
    }
    for m in &status.shard_minimums {
        let shard = m.shard_number.to_string();
        for (kind, at) in [
            ("write", m.positions.last_received_lsn),
            ("flush", m.positions.disk_consistent_lsn),
            ("apply", m.positions.remote_consistent_lsn),
        ] {
            out.push(gauge(
                "ferry_writer_shard_lag_bytes",
                "WAL bytes between the end of WAL and the slowest replica of a shard",
                &[("shard", &shard), ("kind", kind)],
                lag(at),
            ));
        }
    }
    out.push(gauge(
        "ferry_writer_waiting_appends",
        "Appends held back by back-pressure",
        &[],
        status.waiting_appends as f64,
    ));
    out.push(counter(
        "ferry_writer_replicas_forgotten",
        "Replicas the writer forgot since it started (silent past the replica expiry, or unregistered)",
        &[],
        status.replicas_forgotten as f64,
    ));
    out.push(counter(
        "ferry_writer_replica_setbacks",
        "Times a replica reported itself behind its previous feedback (rebuilt at a lower LSN)",
        &[],
        status.replica_setbacks as f64,
    ));
    out
}

/// The figures of one safekeeper.
pub fn safekeeper(status: &ferry_safekeeper::acceptor::AcceptorStatus) -> Vec<Sample> {
    let id = status.node_id.to_string();
    let labels = [("safekeeper", id.as_str())];
    let lsn = |s: &str| {
        s.parse::<ferry_wal::Lsn>()
            .map(|l| l.0 as f64)
            .unwrap_or(0.0)
    };
    vec![
        counter(
            "ferry_safekeeper_wal_fsyncs",
            "WAL fsyncs of a safekeeper since it started",
            &labels,
            status.wal_fsyncs as f64,
        ),
        counter(
            "ferry_safekeeper_appends",
            "Append requests a safekeeper received since it started",
            &labels,
            status.appends_received as f64,
        ),
        gauge(
            "ferry_safekeeper_term",
            "A safekeeper's term",
            &labels,
            status.term as f64,
        ),
        gauge(
            "ferry_safekeeper_restored_not_rejoined",
            "1 while a safekeeper restored from the backup waits for a writer to bring it back (it does not vote)",
            &labels,
            f64::from(u8::from(status.restored_up_to.is_some())),
        ),
        gauge(
            "ferry_safekeeper_flush_lsn",
            "A safekeeper's flush_lsn (bytes)",
            &labels,
            lsn(&status.flush_lsn),
        ),
        gauge(
            "ferry_safekeeper_commit_lsn",
            "A safekeeper's commit_lsn (bytes)",
            &labels,
            lsn(&status.commit_lsn),
        ),
        gauge(
            "ferry_safekeeper_backup_lsn",
            "WAL below this is in the backup, as a safekeeper knows (bytes)",
            &labels,
            lsn(&status.backup_lsn),
        ),
        gauge(
            "ferry_safekeeper_backup_duty",
            "1 while the writer has a safekeeper upload whole segments",
            &labels,
            f64::from(u8::from(status.backup_duty)),
        ),
        counter(
            "ferry_safekeeper_backup_uploads",
            "Whole segments a safekeeper uploaded since it started",
            &[("safekeeper", id.as_str()), ("result", "ok")],
            status.backup_uploads as f64,
        ),
        counter(
            "ferry_safekeeper_backup_uploads",
            "Whole segments a safekeeper uploaded since it started",
            &[("safekeeper", id.as_str()), ("result", "error")],
            status.backup_upload_failures as f64,
        ),
        counter(
            "ferry_safekeeper_partial_uploads",
            "Partial segment uploads of a safekeeper since it started",
            &[("safekeeper", id.as_str()), ("result", "ok")],
            status.partial_uploads as f64,
        ),
        counter(
            "ferry_safekeeper_partial_uploads",
            "Partial segment uploads of a safekeeper since it started",
            &[("safekeeper", id.as_str()), ("result", "error")],
            status.partial_upload_failures as f64,
        ),
        gauge(
            "ferry_safekeeper_remote_consistent_lsn",
            "The lowest durably applied position of the replicas a safekeeper knows (bytes)",
            &labels,
            lsn(&status.remote_consistent_lsn),
        ),
        gauge(
            "ferry_safekeeper_removal_horizon_lsn",
            "WAL below this is needed by no consumer (bytes)",
            &labels,
            lsn(&status.removal_horizon_lsn),
        ),
        counter(
            "ferry_safekeeper_segments_removed",
            "WAL segments a safekeeper removed since it started",
            &labels,
            status.segments_removed as f64,
        ),
        counter(
            "ferry_safekeeper_replicas_forgotten",
            "Replicas a safekeeper forgot since it started (unregistered, or silent past the replica expiry)",
            &labels,
            status.replicas_forgotten as f64,
        ),
    ]
}

/// The position of a replica.
pub fn replica(status: &ferry_replica::ReplicaStatus) -> Vec<Sample> {
    let shard = status.shard.to_string();
    let replica = status.replica.to_string();
    let labels = [("shard", shard.as_str()), ("replica", replica.as_str())];
    vec![
        gauge(
            "ferry_replica_disk_consistent_lsn",
            "WAL a replica applied durably (bytes)",
            &labels,
            status.disk_consistent_lsn.0 as f64,
        ),
        counter(
            "ferry_replica_records_applied",
            "Insert records a replica applied since it started",
            &labels,
            status.records_applied as f64,
        ),
        counter(
            "ferry_replica_duplicates_skipped",
            "Retried inserts a replica skipped by their idempotency key",
            &labels,
            status.records_skipped_duplicate as f64,
        ),
        gauge(
            "ferry_replica_parts",
            "Active parts of a replica",
            &labels,
            status.parts as f64,
        ),
        counter(
            "ferry_replica_rows_retired",
            "Rows retention dropped from a replica (they are in the lake) since it started",
            &labels,
            status.rows_retired as f64,
        ),
    ]
}

/// A node exporter's counters and its tasks by status (from its mirror).
pub fn exporter(node: &str, view: &ferry_export::ExportsView) -> Vec<Sample> {
    let labels = [("exporter", node)];
    let c = &view.counters;
    let mut out = vec![
        counter(
            "ferry_export_parts_exported",
            "Parts this exporter wrote to a destination and moved to processed",
            &labels,
            c.parts_exported as f64,
        ),
        counter(
            "ferry_export_bytes_exported",
            "Bytes of the data files this exporter wrote",
            &labels,
            c.bytes_exported as f64,
        ),
        counter(
            "ferry_export_part_failures",
            "Part exports that failed, by class (retryable: backed off; fatal: task FAILED)",
            &[("exporter", node), ("class", "retryable")],
            c.failures_retryable as f64,
        ),
        counter(
            "ferry_export_part_failures",
            "Part exports that failed, by class (retryable: backed off; fatal: task FAILED)",
            &[("exporter", node), ("class", "fatal")],
            c.failures_fatal as f64,
        ),
        counter(
            "ferry_export_commits",
            "Commit files this exporter wrote (tasks it COMPLETED)",
            &labels,
            c.commits as f64,
        ),
        counter(
            "ferry_export_coordination_ops",
            "Coordination requests this exporter sent (every task; each task's share is its coordination_ops in GET /exports)",
            &labels,
            c.coordination_ops as f64,
        ),
        counter(
            "ferry_export_claims_lost",
            "Part claims another replica held first",
            &labels,
            c.claims_lost as f64,
        ),
    ];
    for status in [
        ferry_export::TaskStatus::Pending,
        ferry_export::TaskStatus::Completed,
        ferry_export::TaskStatus::Failed,
        ferry_export::TaskStatus::Killed,
    ] {
        let n = view.tasks.iter().filter(|t| t.status == status).count();
        out.push(gauge(
            "ferry_export_tasks",
            "Export tasks this exporter mirrors, by status",
            &[("exporter", node), ("status", status.as_str())],
            n as f64,
        ));
    }
    out
}

/// The export policies this node runs (`running_here`): lag, partitions
/// behind and exports requested, per table.
pub fn export_policies(status: &ferry_export::policy::PolicyStatus) -> Vec<Sample> {
    let mut out = Vec::new();
    for (table, t) in status.tables.iter().filter(|(_, t)| t.running_here) {
        let labels = [("table", table.as_str())];
        out.push(gauge(
            "ferry_export_lag_seconds",
            "Age of the oldest change to a policy table not yet in the lake (0: the lake holds every partition's current rows)",
            &labels,
            t.lag_seconds,
        ));
        out.push(gauge(
            "ferry_export_partitions_behind",
            "Partitions of a policy table whose current rows are not all in the lake",
            &labels,
            t.partitions_behind as f64,
        ));
        out.push(counter(
            "ferry_export_policy_exports",
            "Export tasks a table's export policy created on this node",
            &labels,
            t.exports_requested as f64,
        ));
        out.push(counter(
            "ferry_export_policy_retirements",
            "Retirements (retention) a table's export policy had written on this node",
            &labels,
            t.retirements as f64,
        ));
    }
    out
}

/// Counts elections won by a writer: a task following its status.
pub fn count_elections(
    registry: &mut Registry,
    mut status: tokio::sync::watch::Receiver<ferry_writer::driver::WriterStatus>,
) -> tokio::task::JoinHandle<()> {
    let elections = Counter::<u64>::default();
    registry.register(
        "ferry_elections",
        "Elections this node's writer won",
        elections.clone(),
    );
    tokio::spawn(async move {
        let mut last_won = None;
        loop {
            let (elected, term) = {
                let s = status.borrow_and_update();
                (s.elected, s.term)
            };
            if elected && last_won != Some(term) {
                last_won = Some(term);
                elections.inc();
            }
            if status.changed().await.is_err() {
                return;
            }
        }
    })
}
