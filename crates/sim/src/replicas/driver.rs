//! The replica workload's run loop: a seed's events applied one by one
//! (inserts sent through the writer, retries, crashes, partitions), then
//! the faults stop, unknown outcomes are retried, the writer shuts down
//! once every replica applied its checkpoint, and the final checks run.

use std::sync::Arc;
use std::time::Duration;

use ferry_wal::Lsn;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::schedule::{generate, request, Event, Request};
use super::{
    replica_name, replicas, sk_name, Failure, Outcome, Sim, REPLICAS_PER_SHARD, SAFEKEEPERS,
};
use crate::world::stop_all;

impl Sim {
    pub(super) fn send(&mut self, req: Request) {
        let Some(writer) = self.writer.clone() else {
            return;
        };
        let tx = self.results.0.clone();
        self.in_flight += 1;
        tokio::spawn(async move {
            let ok = writer.insert(req.inserts.clone()).await.is_ok();
            let _ = tx.send((req, ok));
        });
    }

    pub(super) fn collect_results(&mut self) {
        while let Ok((req, ok)) = self.results.1.try_recv() {
            self.in_flight -= 1;
            if ok {
                self.acked.insert(req.key.clone(), req);
            } else {
                // Outcome unknown: the client will retry with the same key.
                self.unknown.push(req);
            }
        }
    }

    pub(super) async fn apply(&mut self, event: &Event) -> Result<(), Failure> {
        match event {
            Event::Insert(rows) => {
                let req = request(self.next_request, self.next_id, *rows);
                self.next_request += 1;
                self.next_id += *rows as i64;
                self.send(req);
            }
            Event::Retry => {
                let n = self.acked.len();
                if n > 0 {
                    let pick = self.world.rng.random_range(0..n);
                    if let Some(req) = self.acked.values().nth(pick).cloned() {
                        self.log(format!("retry of {}", req.key));
                        self.send(req);
                    }
                }
            }
            // A quarter of the replica crashes lose the data dir too.
            Event::CrashReplica(i) if self.rebuild_rng.random_bool(0.25) => {
                self.rebuild_replica(*i).await?
            }
            Event::CrashReplica(i) => self.crash_replica(*i).await?,
            Event::CrashSafekeeper(i) => {
                // At most one safekeeper down at a time: a quorum stays.
                let down = self
                    .safekeepers
                    .servers
                    .iter()
                    .filter(|s| s.is_none())
                    .count();
                if down == 0 {
                    self.crash_safekeeper(*i).await;
                } else if self.safekeepers.servers[*i].is_none() {
                    self.start_safekeeper(*i, false).await?;
                }
            }
            Event::PartitionReplica(r, s) => {
                let (a, b) = (replica_name(*r), sk_name(*s));
                self.world.partition(&a, &b);
            }
            Event::PartitionWriter(s) => self.world.partition("writer", &sk_name(*s)),
            Event::Repair => self.world.repair_all(),
        }
        self.collect_results();
        self.check_steps()
    }

    /// Retries inserts of unknown outcome until every insert sent is
    /// acknowledged (by `deadline`, or the run fails saying `when`); returns
    /// the writer's commit_lsn then.
    pub(super) async fn complete_inserts(
        &mut self,
        deadline: Instant,
        when: &str,
    ) -> Result<Lsn, Failure> {
        loop {
            self.collect_results();
            for req in std::mem::take(&mut self.unknown) {
                self.send(req);
            }
            if self.in_flight == 0 && self.unknown.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                return Err(self.fail(format!("inserts did not complete {when}")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let Some(writer) = &self.writer else {
            return Err(self.fail("the writer was shut down"));
        };
        writer
            .status()
            .commit_lsn
            .parse()
            .map_err(|e| self.fail(format!("writer commit_lsn: {e}")))
    }

    /// Faults stop: every safekeeper up, partitions repaired, unknown outcomes
    /// retried until acknowledged, every replica caught up and merges settled.
    pub(super) async fn settle(&mut self) -> Result<Lsn, Failure> {
        self.world.repair_all();
        if let Some(latest) = self.down_until.iter().flatten().max().copied() {
            tokio::time::sleep_until(latest).await;
        }
        self.restart_kept_down(true).await?;
        for i in 0..SAFEKEEPERS {
            if self.safekeepers.servers[i].is_none() {
                self.start_safekeeper(i, false).await?;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        self.complete_inserts(deadline, "after faults stopped")
            .await?;
        // Neon's stop_and_wait: the writer commits its shutdown checkpoint
        // and waits until every running replica applied it durably, as it
        // learns from their feedback relayed by the safekeepers.
        let Some(mut writer) = self.writer.take() else {
            return Err(self.fail("the writer was shut down already"));
        };
        let writer = loop {
            match Arc::try_unwrap(writer) {
                Ok(w) => break w,
                Err(shared) if Instant::now() < deadline => {
                    // An insert task still drops its handle.
                    writer = shared;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(_) => return Err(self.fail("the writer is still shared after the inserts")),
            }
        };
        let running: Vec<(u32, u32)> = (0..replicas())
            .filter(|&i| self.replicas[i].is_some())
            .map(|i| (i as u32 / REPLICAS_PER_SHARD, i as u32 % REPLICAS_PER_SHARD))
            .collect();
        let heard = writer.subscribe();
        let end = writer
            .shutdown_and_wait_for_replicas(
                &running,
                deadline.saturating_duration_since(Instant::now()),
            )
            .await;
        let end = match end {
            Ok(end) => end,
            Err(e) => {
                // Where each replica really is, next to what the writer heard.
                let mut at = Vec::new();
                for i in 0..replicas() {
                    if let Some(node) = &self.replicas[i] {
                        let s = node.shared().lock().await.subscribe().borrow().clone();
                        at.push(format!(
                            "{} applied {} received {}",
                            replica_name(i),
                            s.disk_consistent_lsn,
                            s.last_received_lsn
                        ));
                    }
                }
                let heard: Vec<String> = heard
                    .borrow()
                    .replicas
                    .iter()
                    .map(|f| {
                        format!(
                            "r{}{} applied {} at {}",
                            f.shard_number,
                            f.replica_number,
                            f.disk_consistent_lsn,
                            f.reply_time_micros
                        )
                    })
                    .collect();
                return Err(self.fail(format!(
                    "clean shutdown with every replica applied: {e} (replicas: {}; the writer heard: {})",
                    at.join(", "),
                    heard.join(", ")
                )));
            }
        };
        self.log(format!(
            "writer stopped; every replica applied its checkpoint at {end}"
        ));
        for i in 0..replicas() {
            let Some(node) = &self.replicas[i] else {
                continue;
            };
            let mut status = node.shared().lock().await.subscribe();
            let reached = tokio::time::timeout_at(
                deadline,
                status.wait_for(|s| {
                    (s.disk_consistent_lsn >= end && s.pending_merges == 0) || s.error.is_some()
                }),
            )
            .await
            .is_ok();
            let s = status.borrow().clone();
            if let Some(e) = s.error {
                return Err(self.fail(format!("{} stopped: {e}", replica_name(i))));
            }
            if !reached {
                return Err(self.fail(format!(
                    "{} reached {} of {end} ({} merges pending) after faults stopped",
                    replica_name(i),
                    s.disk_consistent_lsn,
                    s.pending_merges
                )));
            }
        }
        self.check_steps()?;
        Ok(end)
    }
}

/// A safekeeper cut off from the writer falls behind while its walsenders
/// still send keepalives: the replicas streaming from it must move to a
/// safekeeper that is ahead and apply every acknowledged insert while the
/// partition lasts. Returns how long (simulated) the last replica took to
/// apply them once they were acknowledged.
pub fn run_lagging_safekeeper(seed: u64) -> Result<Duration, Failure> {
    crate::run_seeded(seed, async move {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x6c61_6767_696e_6721);
        let mut sim = Sim::start(seed, &mut rng, false).await?;
        // Replicas start on safekeeper i % 3: r00 and r11 stream from sk0.
        sim.world.partition("writer", &sk_name(0));
        for _ in 0..40 {
            sim.apply(&Event::Insert(30)).await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let end = sim
            .complete_inserts(Instant::now() + Duration::from_secs(60), "with sk0 cut off")
            .await?;
        let acknowledged = Instant::now();
        // The partition still holds: sk0 stays behind.
        for i in 0..replicas() {
            let Some(node) = &sim.replicas[i] else {
                continue;
            };
            let mut status = node.shared().lock().await.subscribe();
            let reached = tokio::time::timeout(
                Duration::from_secs(30),
                status.wait_for(|s| s.disk_consistent_lsn >= end || s.error.is_some()),
            )
            .await
            .is_ok();
            let s = status.borrow().clone();
            if !reached || s.error.is_some() {
                return Err(sim.fail(format!(
                    "{} applied up to {} of {end} within 30 s while sk0 lagged ({:?})",
                    replica_name(i),
                    s.disk_consistent_lsn,
                    s.error
                )));
            }
        }
        let took = acknowledged.elapsed();
        sim.settle().await?;
        sim.check_replicas().await?;
        stop_all(&mut sim.replicas).await;
        Ok(took)
    })
}

pub fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    crate::run_seeded(seed, run_seed_async(seed, verbose))
}

async fn run_seed_async(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x7265_706c_6963_6173);
    let events = generate(&mut rng);
    let mut sim = Sim::start(seed, &mut rng, verbose).await?;
    sim.log(format!("seed {seed}: {} events", events.len()));
    for (at, event) in &events {
        tokio::time::sleep_until(sim.world.start + *at).await;
        sim.restart_kept_down(false).await?;
        sim.log(format!("{event:?}"));
        sim.apply(event).await?;
    }
    let end = sim.settle().await?;
    let (rows, merges) = sim.check_replicas().await?;
    let (mut removed, mut uploads, mut forgotten) = (0, 0, 0);
    for server in sim.safekeepers.servers.iter().flatten() {
        let status = server.status().await;
        removed += status.segments_removed;
        uploads += status.backup_uploads;
        forgotten += status.replicas_forgotten;
    }
    let writer_forgot = sim
        .writer
        .as_ref()
        .map_or(0, |w| w.status().replicas_forgotten);
    sim.log(format!(
        "settled at {end}: {rows} rows on all replicas, {merges} merges; since their last start the safekeepers uploaded {uploads} segments, removed {removed} and forgot {forgotten} replicas (the writer {writer_forgot})"
    ));
    stop_all(&mut sim.replicas).await;
    Ok(Outcome {
        run: sim.world.finish(events.len()),
        acknowledged: sim.acked.len(),
        rows,
        replica_crashes: sim.replica_crashes,
        rebuilds: sim.rebuilds,
        merges,
    })
}
