//! The WAL workload's run loop: a seed's schedule applied event by event
//! while writer statuses and acknowledgements are watched and checked, then
//! the faults stop, everything settles and the final checks run.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use ferry_safekeeper::wal_storage::Preallocation;
use ferry_wal::Lsn;
use ferry_writer::driver::encode_records;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::rogue::RogueOutcome;
use super::schedule::{
    add_disk_full, add_disk_loss, add_idle_periods, add_partial_crashes, add_pull_during_catch_up,
    generate_schedule, Event,
};
use super::walreceiver::{self, SharedReceived};
use super::{
    cluster_id, insert_record, node_name, writer_node, Failure, Outcome, PullPlan, Sim,
    LIVENESS_BOUND, SAFEKEEPERS, SEGMENT_BYTES,
};
use crate::safekeepers::Safekeepers;
use crate::world::coord::CoordFaults;
use crate::world::faults::Fault;
use crate::world::net::NetOptions;
use crate::world::objstore::ObjectFaults;
use crate::world::World;

impl Sim {
    /// Runs until `deadline`, watching writer status and acknowledgements.
    pub(super) async fn run_until(&mut self, deadline: Instant) -> Result<(), Failure> {
        loop {
            self.observe_old_writers()?;
            self.check_walsenders()?;
            self.check_safekeepers().await?;
            let status_changed = async {
                match self.status.as_mut() {
                    Some(rx) => rx.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                changed = status_changed => {
                    // Also when the writer stopped: its last status counts.
                    let s = self.status.as_ref().map(|rx| rx.borrow().clone());
                    if let Some(s) = s {
                        self.observe(self.writers_started, &s)?;
                    }
                    if !changed {
                        self.status = None;
                        self.restart_stopped_writer().await?;
                    }
                }
                Some((writer, block, result)) = self.results.1.recv() => self.on_result(writer, block, result)?,
                () = tokio::time::sleep_until(deadline) => return Ok(()),
            }
        }
    }

    pub(super) async fn apply(&mut self, event: &Event) -> Result<(), Failure> {
        match *event {
            Event::Write { records, bytes } => self.write(records, bytes),
            Event::Fault(Fault::Crash(i)) => self.crash_safekeeper(i).await,
            Event::Fault(Fault::Restart(i)) => {
                self.crash_safekeeper(i).await;
                self.start_safekeeper(i).await?;
            }
            Event::RestartWriter => {
                self.kill_writer();
                self.kill_old_writers()?;
                self.start_writer().await?;
            }
            Event::TakeOver => self.take_over().await?,
            Event::LoseDisk(i) => self.lose_disk(i).await?,
            Event::SplitLoss { lost, a, b } => self.split_loss(lost, a, b).await?,
            Event::PullDuringCatchUp {
                lost,
                writes,
                stall_ms,
                heal_ms,
            } => {
                self.pull_during_catch_up(
                    lost,
                    writes,
                    PullPlan {
                        stall: Duration::from_millis(stall_ms),
                        heal: Duration::from_millis(heal_ms),
                    },
                )
                .await?
            }
            Event::CrashInPartialUpload {
                safekeeper,
                applied,
            } => self.crash_in_partial_upload(safekeeper, applied).await?,
            Event::DiskNearlyFull { safekeeper, secs } => {
                self.safekeepers.disks[safekeeper].set_free_bytes(Some(0));
                self.log(format!("sk{safekeeper} disk nearly full for {secs} s"));
            }
            Event::Idle { secs } => self.idle(secs).await?,
            Event::DiskSpaceBack(i) => {
                self.safekeepers.disks[i].set_free_bytes(Some(1 << 40));
                self.log(format!("sk{i} disk has room again"));
            }
            Event::Fault(Fault::Partition(a, b)) => {
                // Index SAFEKEEPERS is the current writer.
                let name = |i: usize| {
                    if i == SAFEKEEPERS {
                        writer_node(self.writers_started)
                    } else {
                        node_name(i)
                    }
                };
                let (a, b) = (name(a), name(b));
                self.world.partition(&a, &b);
            }
            Event::Fault(Fault::RepairPartitions) => self.world.repair_all(),
            Event::Fault(Fault::DiskFailure(i)) => {
                self.safekeepers.disks[i].set_failing(true);
                self.log(format!("sk{i} disk fails every sync"));
            }
            Event::Rogue { safekeeper, kind } => {
                let Some(server) = self.safekeepers.servers[safekeeper].clone() else {
                    return Ok(());
                };
                let positions = server.positions().await;
                let outcome = crate::rogue::attempt(
                    self.world.net.node("rogue").as_ref(),
                    &node_name(safekeeper),
                    &cluster_id(),
                    SEGMENT_BYTES,
                    kind,
                    positions,
                )
                .await;
                self.log(format!("rogue {kind:?} on sk{safekeeper}: {outcome:?}"));
                if let RogueOutcome::Accepted(what) = outcome {
                    return Err(
                        self.fail(format!("sk{safekeeper} accepted a rogue message: {what}"))
                    );
                }
            }
            Event::Fault(Fault::DiskStall {
                node: safekeeper,
                millis,
            }) => {
                self.safekeepers.disks[safekeeper]
                    .stall_until(Instant::now() + Duration::from_millis(millis));
                self.log(format!("sk{safekeeper} disk stalls {millis} ms"));
            }
        }
        Ok(())
    }

    /// See [`Event::SplitLoss`].
    pub(super) async fn split_loss(
        &mut self,
        lost: usize,
        a: usize,
        b: usize,
    ) -> Result<(), Failure> {
        if self.restored.is_some() || self.restoring.is_some() {
            return Ok(());
        }
        let old = writer_node(self.writers_started);
        self.world.partition(&old, &node_name(b));
        self.world.partition(&old, &node_name(lost));
        self.take_over().await?;
        let new = writer_node(self.writers_started);
        self.world.partition(&new, &node_name(a));
        let incarnation = self.writers_started;
        let deadline = Instant::now() + Duration::from_secs(3);
        while !self.elected.contains_key(&incarnation) && Instant::now() < deadline {
            self.run_until((Instant::now() + Duration::from_millis(50)).min(deadline))
                .await?;
        }
        // The new writer commits on `b` and `lost` alone.
        self.write(5, 100);
        let until = Instant::now() + Duration::from_secs(1);
        self.run_until(until).await?;
        self.lose_disk(lost).await?;
        self.world.heal(&old, &node_name(lost));
        // A third writer, which knows no commit (a deployment without
        // coordination), cannot reach `b`: it must not be elected by `a` and
        // the restored safekeeper, which hold none of what the new writer
        // committed.
        if let (Some(writer), Some(status)) = (self.writer.take(), self.status.take()) {
            self.old_writers
                .insert(self.writers_started, (writer, status));
        }
        self.start_writer_knowing(None);
        let third = writer_node(self.writers_started);
        self.world.partition(&third, &node_name(b));
        // The split holds past the quarantine while the old writer tries to
        // write: it must not commit anything.
        if let Some((writer, _)) = self.old_writers.get(&(incarnation - 1)) {
            let writer = Arc::clone(writer);
            self.write_through(writer, incarnation - 1, 5, 100);
        }
        let until = Instant::now() + Duration::from_secs(8);
        self.run_until(until).await
    }

    /// Faults stop: everything is repaired and restarted, and a write must commit.
    pub(super) async fn settle(&mut self, net: NetOptions) -> Result<Lsn, Failure> {
        self.world.repair_all();
        self.world.net.set_options(NetOptions {
            break_prob: 0.0,
            connect_fail_prob: 0.0,
            ..net
        });
        self.log("faults stop");
        for i in 0..SAFEKEEPERS {
            let stopped = self.safekeepers.servers[i]
                .as_ref()
                .and_then(|server| server.failure().borrow().clone());
            if let Some(reason) = stopped {
                // It stopped on a disk error, as it must: restart it.
                self.log(format!("sk{i} had stopped: {reason}"));
                self.crash_safekeeper(i).await;
            } else if self.safekeepers.disks[i].failing() {
                // A failing disk not noticed yet: repaired by a restart too.
                self.crash_safekeeper(i).await;
            }
            if self.safekeepers.servers[i].is_none() {
                self.start_safekeeper(i).await?;
            }
        }
        // After a takeover either writer may be the one left standing (the other
        // stopped, superseded): one fresh writer carries on.
        if !self.old_writers.is_empty() {
            self.kill_old_writers()?;
            self.kill_writer();
        }
        if self.writer.is_none() {
            self.start_writer().await?;
        }
        // A lost safekeeper is restored once the backup holds what it needs.
        let deadline = Instant::now() + LIVENESS_BOUND;
        while let Some(i) = self.restoring {
            if Instant::now() >= deadline {
                return Err(self.fail(format!(
                    "sk{i} could not be restored within {LIVENESS_BOUND:?} after the faults stopped"
                )));
            }
            self.try_restore().await?;
            if self.restoring.is_some() {
                self.run_until((Instant::now() + Duration::from_millis(500)).min(deadline))
                    .await?;
            }
        }
        // A write must commit; one that fails (its writer superseded by a stale
        // term and restarted by its supervisor) is tried again.
        let deadline = Instant::now() + LIVENESS_BOUND;
        let block = loop {
            let Some(writer) = self.writer.clone() else {
                return Err(self.fail("no writer"));
            };
            let block = self.next_block;
            self.next_block += 1;
            let data = encode_records(&[insert_record(block, 100)]);
            let tx = self.results.0.clone();
            let incarnation = self.writers_started;
            tokio::spawn(async move {
                let _ = tx.send((incarnation, block, writer.append(data).await));
            });
            while !self.acked.contains_key(&block) && !self.not_acked.contains(&block) {
                if Instant::now() >= deadline {
                    return Err(self.fail(format!(
                        "after the faults stopped, a write did not commit within {LIVENESS_BOUND:?}"
                    )));
                }
                self.run_until((Instant::now() + Duration::from_millis(100)).min(deadline))
                    .await?;
            }
            if self.acked.contains_key(&block) {
                break block;
            }
        };
        self.log(format!("final write committed at {}", self.acked[&block]));
        // Every write still running completes too.
        while self.pending_writes.iter().any(|t| !t.is_finished()) {
            if Instant::now() >= deadline {
                return Err(self.fail(format!(
                    "after the faults stopped, writes did not complete within {LIVENESS_BOUND:?}"
                )));
            }
            self.run_until((Instant::now() + Duration::from_millis(100)).min(deadline))
                .await?;
        }
        while let Ok((writer, block, result)) = self.results.1.try_recv() {
            self.on_result(writer, block, result)?;
        }
        let end = self.acked.values().copied().max().unwrap_or(Lsn(0));
        // Every safekeeper catches up and learns the commit (heartbeats carry it).
        loop {
            let mut behind = Vec::new();
            for (i, server) in self.safekeepers.servers.iter().enumerate() {
                if let Some(server) = server {
                    let status = server.status().await;
                    let commit: Lsn = status
                        .commit_lsn
                        .parse()
                        .map_err(|e: String| self.fail(e))?;
                    if commit < end {
                        behind.push(i);
                    }
                }
            }
            if behind.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(self.fail(format!(
                    "after the faults stopped, safekeepers {behind:?} did not catch up to {end} within {LIVENESS_BOUND:?}"
                )));
            }
            self.run_until((Instant::now() + Duration::from_millis(100)).min(deadline))
                .await?;
        }
        self.log("every safekeeper caught up");
        // The replica receives all of it through a walsender.
        while (walreceiver::lock(&self.received).wal.len() as u64) < end.0 {
            if Instant::now() >= deadline {
                let got = walreceiver::lock(&self.received).wal.len();
                return Err(self.fail(format!(
                    "after the faults stopped, the replica received WAL only up to {got}, not {end}, within {LIVENESS_BOUND:?}"
                )));
            }
            self.run_until((Instant::now() + Duration::from_millis(100)).min(deadline))
                .await?;
        }
        self.check_walsenders()?;
        self.log("the replica received every committed byte");
        Ok(end)
    }
}

/// Runs one seed of the WAL random test; `verbose` prints the event log as it
/// happens.
pub fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    crate::run_seeded(seed, run_seed_async(seed, verbose))
}

async fn run_seed_async(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut schedule = generate_schedule(&mut rng);
    add_disk_loss(&mut schedule, seed);
    add_pull_during_catch_up(&mut schedule, seed);
    add_partial_crashes(&mut schedule, seed);
    add_disk_full(&mut schedule, seed);
    add_idle_periods(&mut schedule, seed);
    let mut world = World::new(
        seed,
        &mut rng,
        schedule.net,
        // Requests of the recorder and of writers reading the known commit
        // are sometimes lost, before or after they apply.
        CoordFaults {
            fail_before_prob: 0.05,
            fail_after_prob: 0.05,
            ..CoordFaults::default()
        },
        // Backup uploads fail now and then, before or after they land.
        ObjectFaults {
            min_latency: Duration::from_millis(1),
            max_latency: Duration::from_millis(80),
            fail_prob: 0.1,
            fail_after_write_prob: 0.05,
            multipart: false,
            deletes: true,
        },
        verbose,
    )
    .await?;
    let safekeepers = Safekeepers::new(&mut world, SAFEKEEPERS);
    let control_sessions = world.coord.factory("control", Duration::from_secs(2));
    let recorder_sessions = world.coord.factory("recorder", Duration::from_secs(2));
    let mut sim = Sim {
        world,
        safekeepers,
        preallocation: vec![Preallocation::Auto; SAFEKEEPERS],
        writer: None,
        status: None,
        old_writers: BTreeMap::new(),
        writers_started: 0,
        pending_writes: Vec::new(),
        next_block: 0,
        acked: BTreeMap::new(),
        not_acked: BTreeSet::new(),
        refused_unwritten: BTreeSet::new(),
        results: mpsc::unbounded_channel(),
        committed: Lsn(0),
        committed_by: BTreeMap::new(),
        elected: BTreeMap::new(),
        term_owner: BTreeMap::new(),
        produced: Lsn(0),
        elections: 0,
        received: SharedReceived::default(),
        seen_terms: vec![0; SAFEKEEPERS],
        seen_commits: vec![Lsn(0); SAFEKEEPERS],
        control_sessions,
        control: None,
        recorder_sessions,
        recorders: BTreeMap::new(),
        restored: None,
        pull_rng: rand::SeedableRng::seed_from_u64(seed ^ 0x7075_6c6c),
        pulled: 0,
        restoring: None,
        pull_plan: None,
    };
    let mut header = String::new();
    let _ = write!(
        header,
        "seed {seed}: {} events, network {:?}",
        schedule.events.len(),
        schedule.net
    );
    sim.log(header);
    for i in 0..SAFEKEEPERS {
        sim.create_acceptor(i).await?;
    }
    for i in 0..SAFEKEEPERS {
        sim.start_safekeeper(i).await?;
    }
    sim.start_writer().await?;
    let clock: ferry_env::SharedClock = Arc::new(sim.world.clock.clone());
    let receiver = tokio::spawn(walreceiver::run(
        sim.world.net.node("replica"),
        clock,
        (0..SAFEKEEPERS).map(node_name).collect(),
        0,
        Arc::clone(&sim.received),
    ));
    for (at, event) in &schedule.events {
        sim.run_until(sim.world.start + *at).await?;
        sim.try_restore().await?;
        sim.log(format!("{event:?}"));
        sim.apply(event).await?;
    }
    let committed = sim.settle(schedule.net).await?;
    receiver.abort();
    for (_, recorder) in std::mem::take(&mut sim.recorders) {
        recorder.abort();
    }
    sim.check_disks(committed).await?;
    let crash_stats = sim.world.crash_stats();
    Ok(Outcome {
        run: sim.world.finish(schedule.events.len()),
        acknowledged: sim.acked.len(),
        elections: sim.elections,
        commit_lsn: committed,
        pulled: sim.pulled,
        crash_stats,
    })
}
