//! The end-to-end run loop: a seed's events applied one by one, with the
//! client's answers taken in, the writers supervised and the step checks
//! run between them; then the faults stop, every unknown outcome is retried
//! until answered, the replicas and the lake catch up, and the final checks
//! run.

use std::time::Duration;

use bytes::Bytes;
use ferry_coord::SessionFactory;
use ferry_node::http::{HttpPeers, Method};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use tokio::time::Instant;

use super::nodes::{replica_http, writer_name};
use super::schedule::{generate, generate_losses, Event};
use super::{
    replica_name, replicas, Failure, Outcome, Sim, CAUGHT_UP_WITHIN, DESTINATION, SAFEKEEPERS,
    TABLE,
};
use crate::safekeepers::name as sk_name;
use crate::world::coord::CoordFaults;
use crate::world::objstore::ObjectFaults;
use crate::world::{stop_all, Stop};

/// How often, between events, answers are taken in and checks run.
const STEP: Duration = Duration::from_millis(100);
/// How long settling may take at most (inserts answered, replicas caught
/// up).
const SETTLE_WITHIN: Duration = Duration::from_secs(180);

impl Sim {
    /// Runs until `deadline`, taking in answers (sending unknown outcomes
    /// again), supervising writers and checking every step.
    async fn run_until(&mut self, deadline: Instant, retry_all: bool) -> Result<(), Failure> {
        loop {
            self.supervise_writers().await?;
            for sent in self.collect_answers(retry_all) {
                self.send(sent);
            }
            self.check_steps()?;
            let now = Instant::now();
            if now >= deadline {
                return Ok(());
            }
            tokio::time::sleep_until((now + STEP).min(deadline)).await;
        }
    }

    /// The name of node `i` of the events that name a replica or the
    /// writer (`replicas()`).
    fn replica_or_writer(&self, i: usize) -> Option<String> {
        if i < replicas() {
            Some(replica_name(i))
        } else {
            self.writers.last().map(|w| writer_name(w.number))
        }
    }

    async fn apply(&mut self, event: &Event) -> Result<(), Failure> {
        match event {
            Event::Insert(rows) => self.insert(*rows),
            Event::Retry => self.retry_acked(),
            Event::ReuseKey(rows) => self.reuse_key(*rows),
            Event::CrashReplica(i) => self.crash_replica(*i).await?,
            Event::CrashSafekeeper(i) => {
                // At most one safekeeper down at a time: a quorum stays.
                if self.safekeepers_down() == 0 {
                    self.crash_safekeeper(*i).await;
                } else if self.safekeepers.servers[*i].is_none() {
                    self.start_safekeeper(*i, false).await?;
                }
            }
            Event::LoseSafekeeper(i) => self.lose_safekeeper(*i).await?,
            Event::RebuildReplica(i) => self.rebuild_replica(*i).await?,
            Event::KillWriter => {
                if let Some(n) = self.writers.last().map(|w| w.number) {
                    self.stop_writer(n, "killed").await;
                }
            }
            Event::TakeOver => self.start_writer().await?,
            Event::PartitionReplica(r, s) => {
                self.world.partition(&replica_name(*r), &sk_name(*s));
            }
            Event::PartitionWriter(s) => {
                if let Some(w) = self.replica_or_writer(replicas()) {
                    self.world.partition(&w, &sk_name(*s));
                }
            }
            Event::PartitionPeers(a, b) if a != b => {
                self.world.partition(&replica_name(*a), &replica_name(*b));
            }
            Event::PartitionPeers(..) => {}
            Event::PartitionCoord(i) => {
                if let Some(node) = self.replica_or_writer(*i) {
                    self.world.partition(&node, "coord");
                }
            }
            Event::ExpireSessions(i) => {
                if let Some(node) = self.replica_or_writer(*i) {
                    let expired = self.world.coord.expire_node(&node).await.unwrap_or(0);
                    self.log(format!("{expired} sessions of {node} expired"));
                }
            }
            Event::Export {
                replica,
                partition,
                force,
            } => {
                let body = serde_json::json!({
                    "table": TABLE,
                    "partition_id": partition,
                    "destination": DESTINATION,
                    "force": force,
                });
                self.exports_asked += 1;
                self.ask_replica(*replica, "/exports", body);
            }
            Event::Kill { replica, partition } => {
                let body = serde_json::json!({
                    "table": TABLE,
                    "partition_id": partition,
                    "destination": DESTINATION,
                });
                self.ask_replica(*replica, "/exports/kill", body);
            }
            Event::Repair => self.world.repair_all(),
        }
        self.restart_exited_replicas().await
    }

    /// A request of an operator to a replica's export API: its answer
    /// changes nothing the checks expect (the lake must hold each row once
    /// whatever exports and kills ran).
    fn ask_replica(&mut self, replica: usize, path: &'static str, body: serde_json::Value) {
        let peers = HttpPeers::new(self.world.net.node("operator"), None);
        let addr = replica_http(replica);
        tokio::spawn(async move {
            let answer = peers
                .request(
                    &addr,
                    Method::POST,
                    path,
                    "application/json",
                    &[],
                    Bytes::from(body.to_string()),
                    Duration::from_secs(60),
                )
                .await;
            tracing::debug!(?answer, path, "an operator's export request");
        });
    }

    /// Faults stop: everything is repaired and running, every unknown
    /// outcome is sent again until answered, and every replica applies
    /// what the writer committed.
    async fn settle(&mut self) -> Result<(), Failure> {
        self.world.repair_all();
        self.world.coord.set_faults(CoordFaults::default());
        self.world.lake_store.set_faults(ObjectFaults::default());
        self.log("faults stop");
        for i in 0..SAFEKEEPERS {
            if self.safekeepers.servers[i].is_none() {
                self.start_safekeeper(i, false).await?;
            }
        }
        self.restart_exited_replicas().await?;
        let deadline = Instant::now() + SETTLE_WITHIN;
        while self.writers.is_empty() || self.in_flight > 0 {
            if self.writers.is_empty() && self.restart_writer_at.is_none() {
                self.start_writer().await?;
            }
            if Instant::now() > deadline {
                return Err(self.fail(format!(
                    "{} inserts still unanswered {} s after faults stopped (writers running: {})",
                    self.in_flight,
                    SETTLE_WITHIN.as_secs(),
                    self.writers.len()
                )));
            }
            let until = Instant::now() + STEP;
            self.run_until(until, true).await?;
            self.restart_exited_replicas().await?;
        }
        // The replicas must reach the current writer's commit_lsn once it
        // committed its epoch start, which covers every acknowledged insert
        // (a writer elected a moment ago reports 0/0 until then).
        let commit = loop {
            match self.writers.last().map(|w| w.writer.status()) {
                Some(s) if s.elected && s.synced && s.superseded_by.is_none() => {
                    break s.commit_lsn.parse::<ferry_wal::Lsn>().map_err(|e| {
                        self.fail(format!("the writer's commit_lsn {}: {e}", s.commit_lsn))
                    })?;
                }
                Some(_) => {}
                None if self.restart_writer_at.is_none() => self.start_writer().await?,
                None => {}
            }
            if Instant::now() > deadline {
                return Err(self.fail(format!(
                    "no writer committed its epoch start {} s after faults stopped",
                    SETTLE_WITHIN.as_secs()
                )));
            }
            let until = Instant::now() + STEP;
            self.run_until(until, true).await?;
            self.restart_exited_replicas().await?;
        };
        self.log(format!(
            "every insert answered; {} acknowledged; the writer's commit_lsn {commit}",
            self.acked.len()
        ));
        for i in 0..replicas() {
            let Some(node) = &self.replicas[i] else {
                return Err(self.fail(format!("{} is not running", replica_name(i))));
            };
            let mut status = node.node.reader.status.clone();
            let reached = tokio::time::timeout_at(
                deadline,
                status.wait_for(|s| s.disk_consistent_lsn >= commit || s.error.is_some()),
            )
            .await
            .is_ok();
            let s = status.borrow().clone();
            if let Some(e) = s.error {
                return Err(self.fail(format!("{} stopped: {e}", replica_name(i))));
            }
            if !reached {
                return Err(self.fail(format!(
                    "{} applied {} of {commit} after faults stopped",
                    replica_name(i),
                    s.disk_consistent_lsn
                )));
            }
        }
        self.check_steps()
    }

    /// Waits until a reader of the lake reads every acknowledged row (the
    /// freshness promise once faults stopped), then checks what it reads.
    async fn lake_caught_up(&mut self) -> Result<usize, Failure> {
        let deadline = Instant::now() + CAUGHT_UP_WITHIN;
        let acked = self.acked_ids();
        loop {
            let read = self.read_lake().await;
            match &read {
                Ok(lake) if acked.iter().all(|id| lake.contains_key(id)) => {
                    let rows = self.check_lake(lake)?;
                    self.log(format!("the lake's reader reads {rows} rows"));
                    return Ok(rows);
                }
                _ if Instant::now() > deadline => {
                    // A replica that lacks rows explains a lake that lacks
                    // them better than the lake does: it is checked first.
                    self.check_replicas().await?;
                    let lake = read.map_err(|e| self.fail(format!("reading the lake: {e}")))?;
                    return self.check_lake(&lake).and_then(|_| {
                        Err(self.fail("the lake did not catch up (unreachable: check_lake fails)"))
                    });
                }
                _ => {}
            }
            let until = Instant::now() + Duration::from_millis(500);
            self.run_until(until, true).await?;
        }
    }

    async fn stop_everything(&mut self) {
        stop_all(&mut self.replicas).await;
        for w in std::mem::take(&mut self.writers) {
            w.stop().await;
        }
        self.safekeepers.stop_all().await;
    }
}

pub fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    crate::run_seeded(seed, run_seed_async(seed, verbose))
}

async fn run_seed_async(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x6532_6520_656e_6421);
    let mut events = generate(&mut rng);
    let span = events.last().map_or(Duration::ZERO, |(at, _)| *at);
    events.extend(generate_losses(seed, span));
    // Stable: the drawn schedule keeps its order, a loss comes after the
    // events of its instant.
    events.sort_by_key(|(at, _)| *at);
    let mut sim = Sim::start(seed, &mut rng, verbose).await?;
    sim.log(format!("seed {seed}: {} events", events.len()));
    for (at, event) in &events {
        let at = sim.world.start + *at;
        sim.run_until(at, false).await?;
        sim.log(format!("{event:?}"));
        sim.apply(event).await?;
    }
    sim.settle().await?;
    let rows = sim.lake_caught_up().await?;
    sim.check_replicas().await?;
    let checker = sim
        .world
        .coord
        .factory("checker", Duration::from_secs(600))
        .open()
        .await
        .map_err(|e| sim.fail(format!("checker session: {e}")))?;
    crate::export::check_export_locks(&sim.world, &checker, TABLE).await?;
    let commit_files_checked = sim.check_commits_decided(&checker).await?;
    sim.stop_everything().await;
    let acked = sim.acked_ids();
    Ok(Outcome {
        acknowledged: sim.acked.len(),
        given_up: sim.given_up.iter().filter(|id| !acked.contains(id)).count(),
        refused: sim.refused.len(),
        rows_in_lake: rows,
        format: sim.format,
        retention: sim.retention.is_some(),
        writers: sim.writers_started,
        replica_crashes: sim.replica_crashes,
        exports_asked: sim.exports_asked,
        safekeepers_restored: sim.safekeepers_restored,
        replicas_rebuilt: sim.replicas_rebuilt,
        unfinished_copies_refused: sim.unfinished_copies_refused,
        commit_files_checked,
        fenced_disk_ops: sim.world.crash_stats().fenced_ops,
        run: sim.world.finish(events.len()),
    })
}
