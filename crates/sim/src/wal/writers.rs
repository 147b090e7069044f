//! The WAL workload's writers: each incarnation on a node of its own,
//! started knowing the commit recorded in coordination and keeping that
//! record with the product's recorder (as `ferry dev` and `ferry writer` do), killed, restarted by a supervisor when it stops, or joined
//! by a takeover's writer while it keeps running; and the appends sent
//! through them.

use std::sync::Arc;
use std::time::Duration;

use ferry_coord::{RenewingSession, SessionFactory};
use ferry_node::commit_record::{self, CommitRecordError, WalState, WalStateRecording};
use ferry_writer::driver::{encode_records, Writer, WriterConfig, WriterStatus};
use ferry_writer::proposer::ProposerConfig;
use tokio::sync::watch;

use super::{
    cluster_id, insert_record, node_name, writer_node, Failure, Sim, SAFEKEEPERS, SEGMENT_BYTES,
    TIMELINE,
};
use crate::world::coord::SimSessions;

/// How long a writer waits before it asks coordination again.
const COORDINATION_RETRY: Duration = Duration::from_millis(50);

/// A writer node's commit record, as `ferry dev` and `ferry writer` run it
/// (`ferry_node::commit_record::record_commits`), on simulated coordination
/// (requests may be lost before or after they apply): its session is opened
/// at start, retried while coordination fails.
async fn record_commits(sessions: SimSessions, status: watch::Receiver<WriterStatus>) {
    let sessions: Arc<dyn SessionFactory> = Arc::new(sessions);
    let session = loop {
        match RenewingSession::open(Arc::clone(&sessions)).await {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(COORDINATION_RETRY).await,
        }
    };
    let (report, _) = watch::channel(WalStateRecording::default());
    commit_record::record_commits(session, status, report).await;
}

impl Sim {
    /// The commit the cluster is known to have reached, as `ferry dev` reads it
    /// from its coordination store before it starts a writer: here from the
    /// simulated coordination, which may lose requests (then it retries).
    pub(super) async fn known_commit(&mut self) -> Result<WalState, Failure> {
        for _ in 0..100 {
            let session = match self.control.clone() {
                Some(s) => s,
                None => match self.control_sessions.open().await {
                    Ok(s) => {
                        self.control = Some(Arc::clone(&s));
                        s
                    }
                    Err(_) => {
                        tokio::time::sleep(COORDINATION_RETRY).await;
                        continue;
                    }
                },
            };
            match commit_record::read_wal_state(&*session).await {
                Ok(known) => return Ok(known),
                Err(CommitRecordError::Coordination { source, .. }) if source.is_session_end() => {
                    self.control = None
                }
                Err(CommitRecordError::Invalid(e)) => {
                    return Err(self.fail(format!("the commit record is not valid: {e}")))
                }
                Err(_) => tokio::time::sleep(COORDINATION_RETRY).await,
            }
        }
        Err(self.fail("coordination did not answer a read in 100 tries"))
    }

    pub(super) async fn start_writer(&mut self) -> Result<(), Failure> {
        let known = self.known_commit().await?;
        self.start_writer_knowing(Some(known));
        Ok(())
    }

    /// Starts a writer that knows the commit record `known`, and keeps it
    /// (`None`: a writer without coordination, which knows and records
    /// nothing).
    pub(super) fn start_writer_knowing(&mut self, known: Option<WalState>) {
        self.writers_started += 1;
        let mut config = WriterConfig::new(
            (0..SAFEKEEPERS).map(node_name).collect(),
            ProposerConfig::new(
                cluster_id(),
                SAFEKEEPERS,
                TIMELINE,
                SEGMENT_BYTES,
                u128::from(self.writers_started),
            ),
        );
        config.reconnect_delay = Duration::from_millis(50);
        config.peer_timeout = Duration::from_secs(1);
        config.election_timeout = Duration::from_secs(2);
        config.proposer.max_append_bytes = 16 << 10;
        // In a quarter of the runs, recovery reads of a few KiB, so that
        // catching a safekeeper up takes several reads that crashes,
        // partitions and refusals can land between. Picked from the seed
        // and the incarnation, not drawn, so the world's random choices stay
        // as they were, and the other runs are unchanged.
        let run = super::small_recovery_reads(self.world.seed);
        config.proposer.max_read_wal_bytes = match (run, self.writers_started % 3) {
            (false, _) => ferry_wal::proto::MAX_READ_WAL_BYTES,
            (true, 0) => 4099,
            (true, 1) => 20_011,
            (true, _) => 65_537,
        };
        // As `ferry dev` does from its coordination store: the writer knows a
        // commit point (recorded there by the recorder). Committed WAL is on
        // every quorum, so this must never block an election.
        let record = known.unwrap_or_default();
        config.proposer.min_term = record.term;
        config.proposer.known_commit_lsn = record.commit_lsn;
        let writer = Writer::start(
            self.world.net.node(&writer_node(self.writers_started)),
            config,
        );
        self.status = Some(writer.subscribe());
        if known.is_some() {
            let recorder = tokio::spawn(record_commits(
                self.recorder_sessions.clone(),
                writer.subscribe(),
            ));
            self.recorders.insert(self.writers_started, recorder);
        }
        self.writer = Some(Arc::new(writer));
        self.log(format!(
            "writer {} started, knowing commit {} of term {} from coordination",
            self.writers_started, record.commit_lsn, record.term
        ));
    }

    /// A writer's process ended: its commit record ends with it.
    fn stop_recorder(&mut self, incarnation: u64) {
        if let Some(r) = self.recorders.remove(&incarnation) {
            r.abort();
        }
    }

    pub(super) fn kill_writer(&mut self) {
        if let Some(status) = &self.status {
            let s = status.borrow().clone();
            let _ = self.observe(self.writers_started, &s);
        }
        if let Some(writer) = self.writer.take() {
            writer.abort();
            self.stop_recorder(self.writers_started);
            self.log(format!("writer {} killed", self.writers_started));
        }
        self.status = None;
    }

    /// The current writer stopped on its own (superseded, perhaps by the term
    /// of a writer long dead): like a process supervisor, start a new one.
    /// Writers replaced by a takeover have no supervisor.
    pub(super) async fn restart_stopped_writer(&mut self) -> Result<(), Failure> {
        if self.writer.take().is_some() {
            self.stop_recorder(self.writers_started);
            self.log(format!(
                "writer {} stopped; its supervisor starts a new one",
                self.writers_started
            ));
            self.start_writer().await?;
        }
        Ok(())
    }

    /// A takeover: the current writer keeps running while a new one starts.
    pub(super) async fn take_over(&mut self) -> Result<(), Failure> {
        if let (Some(writer), Some(status)) = (self.writer.take(), self.status.take()) {
            self.old_writers
                .insert(self.writers_started, (writer, status));
        }
        self.start_writer().await
    }

    /// Kills every writer replaced by a takeover.
    pub(super) fn kill_old_writers(&mut self) -> Result<(), Failure> {
        self.observe_old_writers()?;
        for (incarnation, (writer, _)) in std::mem::take(&mut self.old_writers) {
            writer.abort();
            self.stop_recorder(incarnation);
            self.log(format!("writer {incarnation} killed"));
        }
        Ok(())
    }

    /// Checks what the writers replaced by a takeover report now; one that
    /// stopped (superseded) is checked a last time and forgotten.
    pub(super) fn observe_old_writers(&mut self) -> Result<(), Failure> {
        let mut changed = Vec::new();
        let mut stopped = Vec::new();
        for (i, (_, rx)) in self.old_writers.iter_mut() {
            match rx.has_changed() {
                Ok(true) => changed.push((*i, rx.borrow_and_update().clone())),
                Ok(false) => {}
                Err(_) => {
                    changed.push((*i, rx.borrow().clone()));
                    stopped.push(*i);
                }
            }
        }
        for (i, s) in changed {
            self.observe(i, &s)?;
        }
        for i in stopped {
            self.old_writers.remove(&i);
            self.stop_recorder(i);
            self.log(format!("writer {i} stopped"));
        }
        Ok(())
    }

    pub(super) fn write(&mut self, records: u32, bytes: usize) {
        let Some(writer) = self.writer.clone() else {
            return;
        };
        self.write_through(writer, self.writers_started, records, bytes);
    }

    /// Appends `records` inserts through writer `incarnation`.
    pub(super) fn write_through(
        &mut self,
        writer: Arc<Writer>,
        incarnation: u64,
        records: u32,
        bytes: usize,
    ) {
        let first = self.next_block;
        self.next_block += u64::from(records);
        let tx = self.results.0.clone();
        self.log(format!(
            "write blocks {first}..{}",
            first + u64::from(records)
        ));
        self.pending_writes.push(tokio::spawn(async move {
            for block in first..first + u64::from(records) {
                let data = encode_records(&[insert_record(block, bytes)]);
                let result = writer.append(data).await;
                let failed = result.is_err();
                if tx.send((incarnation, block, result)).is_err() || failed {
                    return;
                }
            }
        }));
    }

    /// A period without a writer (see [`super::Event::Idle`]): every writer
    /// is killed, the world runs on for `secs`, the safekeepers of the last
    /// term must have caught up from each other when nothing stood in the
    /// way, and a new writer starts.
    pub(super) async fn idle(&mut self, secs: u64) -> Result<(), Failure> {
        self.kill_writer();
        self.kill_old_writers()?;
        self.run_until(tokio::time::Instant::now() + Duration::from_secs(secs))
            .await?;
        let clear = !self.world.net.any_partition()
            && self.restoring.is_none()
            && (0..SAFEKEEPERS).all(|i| {
                self.safekeepers.servers[i].is_some()
                    && !self.safekeepers.disks[i].failing()
                    && self.safekeepers.disks[i]
                        .reported_free_bytes()
                        .is_none_or(|f| f > 0)
            });
        let mut standing = Vec::new();
        for server in self.safekeepers.servers.iter().flatten() {
            let s = server.status().await;
            standing.push((
                s.node_id,
                s.term,
                s.last_log_term,
                s.flush_lsn.parse::<ferry_wal::Lsn>().unwrap_or_default(),
                s.restored_up_to.is_some(),
            ));
        }
        self.log(format!(
            "idle for {secs} s; (node, term, last_log_term, flush_lsn, restored): {standing:?}"
        ));
        if clear {
            let term = standing.iter().map(|s| s.1).max().unwrap_or(0);
            let of_term: Vec<_> = standing
                .iter()
                .filter(|s| s.1 == term && s.2 == term && !s.4)
                .collect();
            let end = of_term.iter().map(|s| s.3).max().unwrap_or_default();
            if let Some(behind) = of_term.iter().find(|s| s.3 < end) {
                return Err(self.fail(format!(
                    "sk{} stayed at {} behind a peer of term {term} at {end} while no writer ran for {secs} s (peer recovery)",
                    behind.0, behind.3
                )));
            }
        }
        self.start_writer().await
    }
}
