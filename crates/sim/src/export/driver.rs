//! The export workload's run loop and the requests of its schedule: inserts
//! fed to the replicas as WAL, exports (some forced) and kills asked of a
//! node, kills on freshly written commit files between events; then the
//! faults stop, every task settles and the final checks run.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use bytes::{Bytes, BytesMut};
use ferry_coord::Session;
use ferry_env::Clock;
use ferry_export::model::{ExportSettings, LakeFormat, TaskKey, TaskStatus};
use ferry_export::{Destination, Destinations, ExportRequest, Requester};
use ferry_storage::Location;
use ferry_wal::record::Record;
use ferry_wal::Lsn;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;

use super::schedule::{generate, Event};
use super::{
    node_name, partition_of, table, Asked, Failure, Outcome, Sim, COMMIT_WATCH_STEP, DESTINATIONS,
    NODES, PARTITIONS, SESSION_TIMEOUT, TABLE_ID,
};
use crate::world::coord::CoordFaults;
use crate::world::net::NetOptions;
use crate::world::objstore::ObjectFaults;
use crate::world::{stop_all, World};

impl Sim {
    pub(super) fn insert(&mut self, rows: usize) {
        let ids: Vec<i64> = (self.next_id..self.next_id + rows as i64).collect();
        self.next_id += rows as i64;
        let batch = RecordBatch::try_new(
            table().def.arrow_schema(),
            vec![
                Arc::new(Int64Array::from(ids.clone())),
                Arc::new(StringArray::from_iter_values(
                    ids.iter().map(|i| partition_of(*i)),
                )),
            ],
        )
        .expect("batch");
        let at = self.wal.len() as u64;
        Record::Insert {
            table_id: TABLE_ID,
            shard: (at % 2) as u32,
            block_number: at,
            idempotency_key: Bytes::new(),
            arrow_ipc: ferry_table::rows::to_ipc(&batch).expect("ipc"),
        }
        .encode(&mut self.wal);
        let end = Lsn(self.wal.len() as u64);
        self.rows.extend(ids.into_iter().map(|id| (end, id)));
        self.publish_wal();
    }

    /// Kills, half of the time, an export whose commit file just appeared
    /// (each once). Most are COMPLETED already and stay so; one whose
    /// committer failed between the commit file and COMPLETED must be
    /// completed by the kill, never KILLED.
    pub(super) async fn kill_on_commit_file(&mut self) {
        let Ok(store) = Location::from_store("sim://lake", self.world.lake_store.truth(), "")
        else {
            return;
        };
        let Ok(objects) = store.list("").await else {
            return;
        };
        let mut txs: Vec<String> = objects
            .iter()
            .filter_map(|(k, _)| {
                let file = k.rsplit('/').next()?;
                let tx = file.strip_prefix("commit_")?;
                tx.get(tx.len().checked_sub(30)?..).map(str::to_string)
            })
            .collect();
        txs.extend(self.iceberg_committed_now().await);
        txs.retain(|tx| self.asked.contains_key(tx) && !self.killed_on_commit.contains(tx));
        for tx in txs {
            self.killed_on_commit.insert(tx.clone());
            if !self.world.rng.random_bool(0.5) {
                continue;
            }
            let live: Vec<usize> = (0..NODES).filter(|i| self.nodes[*i].is_some()).collect();
            if live.is_empty() {
                return;
            }
            let i = live[self.world.rng.random_range(0..live.len())];
            self.log(format!("kill on the commit file of {tx}"));
            self.kill_tx(i, &tx).await;
        }
    }

    pub(super) async fn export(
        &mut self,
        i: usize,
        partition: usize,
        destination: usize,
        force: bool,
    ) {
        let Some(node) = &self.nodes[i] else {
            return;
        };
        let partition = PARTITIONS[partition].to_string();
        let destination_index = destination;
        let destination = DESTINATIONS[destination].to_string();
        let end = Lsn(self.wal.len() as u64);
        let random: u64 = self.world.rng.random();
        let now_ms = self.world.clock.unix_micros() / 1000;
        let tx = ferry_export::model::transaction_id(now_ms, random);
        let ids: BTreeSet<i64> = self
            .rows
            .iter()
            .filter(|(at, id)| *at <= end && partition_of(*id) == partition)
            .map(|(_, id)| *id)
            .collect();
        // A forced export replaces (kills) the one it finds.
        if force {
            self.forced.insert((partition.clone(), destination.clone()));
            for a in self.asked.values_mut() {
                if a.partition == partition && a.destination == destination {
                    a.maybe_killed = true;
                }
            }
        }
        self.asked.insert(
            tx.clone(),
            Asked {
                partition: partition.clone(),
                destination: destination.clone(),
                refused: false,
                ids,
                maybe_killed: false,
                killed: false,
                at_least: false,
            },
        );
        let lake = self.lake();
        let sessions = self.world.coord.factory(&node_name(i), SESSION_TIMEOUT);
        let result = Requester {
            session: &node.session,
            sessions: &sessions,
            parts: node.parts.as_ref(),
            destinations: &lake,
            replica_name: &node_name(i),
            now_unix_millis: now_ms,
            random,
            commit_lsn: end,
            wait: Duration::from_secs(10),
        }
        .export(&ExportRequest {
            table: "t".into(),
            partition_id: partition.clone(),
            destination: destination.clone(),
            force,
            // Unforced requests replace a finished task, as an export
            // policy's do: an increment over the partition's current commit.
            replace_finished: !force,
            // And follow the replicas' merges, as a policy's do.
            by_policy: !force,
            settings: ExportSettings {
                format: Some(self.format_of(destination_index)),
                retry_initial_backoff_ms: 100,
                retry_max_backoff_ms: 1000,
                ttl_seconds: 86_400,
                task_timeout_seconds: 86_400,
                ..ExportSettings::default()
            },
        })
        .await;
        match result {
            Ok(c) if c.unchanged.is_some() => self.log(format!(
                "export {tx} of {partition} to {destination} from n{i}: unchanged, {} holds its {} parts",
                c.unchanged.as_deref().unwrap_or_default(),
                c.parts_count
            )),
            Ok(c) => self.log(format!(
                "export {tx} of {partition} to {destination} from n{i}: {} parts ({} carried), {} rows",
                c.parts_count, c.carried, c.rows
            )),
            Err(e) => {
                if let Some(a) = self.asked.get_mut(&tx) {
                    a.refused = true;
                }
                self.log(format!(
                    "export {tx} of {partition} to {destination} from n{i} refused: {e}"
                ))
            }
        }
    }

    pub(super) async fn kill(&mut self, i: usize, pick: usize) {
        if self.nodes[i].is_none() {
            return;
        }
        if self.asked.is_empty() {
            return;
        }
        // Mostly exports that exist (or may).
        let live: Vec<(&String, &Asked)> = self
            .asked
            .iter()
            .filter(|(_, a)| !a.refused || pick.is_multiple_of(4))
            .collect();
        if live.is_empty() {
            return;
        }
        let tx = live[pick % live.len()].0.clone();
        self.kill_tx(i, &tx).await;
    }

    /// Kills the export `tx` from node `i` (in a session of its own, as
    /// `ferry export kill` does).
    pub(super) async fn kill_tx(&mut self, i: usize, tx: &str) {
        let Some(a) = self.asked.get(tx) else {
            return;
        };
        let (tx, partition, dest) = (tx.to_string(), a.partition.clone(), a.destination.clone());
        let key = TaskKey::new("t", &partition, &dest);
        let Ok(location) = self.lake().open(&dest) else {
            return;
        };
        let destination = Destination::new(location);
        let sessions = self.world.coord.factory(&node_name(i), SESSION_TIMEOUT);
        let result = ferry_export::task::kill_in_own_session(
            &sessions,
            &key,
            Some(&tx),
            &destination,
            "schedule",
            self.world.clock.unix_micros() / 1000,
        )
        .await;
        let line = match &result {
            Ok(s) => format!("kill {tx} from n{i}: {s}"),
            Err(e) => format!("kill {tx} from n{i}: {e}"),
        };
        if let Some(a) = self.asked.get_mut(&tx) {
            match result {
                Ok(TaskStatus::Killed) => {
                    a.maybe_killed = true;
                    a.killed = true;
                }
                Ok(_) | Err(ferry_export::task::KillError::NotFound(_)) => {}
                Err(ferry_export::task::KillError::OtherTransaction { .. }) => {}
                Err(_) => a.maybe_killed = true,
            }
        }
        self.log(line);
    }

    pub(super) async fn apply(&mut self, event: &Event) -> Result<(), Failure> {
        match event {
            Event::Insert(rows) => self.insert(*rows),
            Event::Export {
                node,
                partition,
                destination,
                force,
            } => {
                self.export(*node, *partition, *destination, *force).await;
                // An Iceberg table's commits race for its versions: half of
                // its exports come with the other partitions' from the
                // other nodes, so that their commits land together.
                if self.format_of(*destination) == LakeFormat::Iceberg
                    && self.upkeep_rng.random_bool(0.5)
                {
                    for k in 1..PARTITIONS.len() {
                        let (n, p) = ((node + k) % NODES, (partition + k) % PARTITIONS.len());
                        self.export(n, p, *destination, *force).await;
                    }
                }
            }
            Event::Kill { node, pick } => self.kill(*node, *pick).await,
            Event::Crash(i) => self.crash(*i).await?,
            Event::ExpireSession(i) => {
                let n = self
                    .world
                    .coord
                    .expire_node(&node_name(*i))
                    .await
                    .unwrap_or(0);
                self.log(format!("{} sessions of n{i} expired", n));
                // The request session is replaced.
                if let Some(node) = &mut self.nodes[*i] {
                    if let Ok(s) = self
                        .world
                        .coord
                        .session(&node_name(*i), SESSION_TIMEOUT)
                        .await
                    {
                        node.session = s;
                    }
                }
            }
            Event::PartitionCoord(i) => self.world.coord.partition(&node_name(*i)),
            Event::Repair => self.world.coord.repair_all(),
        }
        Ok(())
    }

    /// Faults stop; every node runs; every task must become terminal.
    pub(super) async fn settle(&mut self) -> Result<Session, Failure> {
        self.world.coord.set_faults(CoordFaults::default());
        self.world.lake_store.set_faults(ObjectFaults::default());
        self.world.coord.repair_all();
        for i in 0..NODES {
            if self.nodes[i].is_none() {
                self.start_node(i).await?;
            }
        }
        let checker = self.own_session("checker").await?;
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let tasks = self.tasks(&checker).await.map_err(|e| self.fail(e))?;
            let pending: Vec<String> = tasks
                .iter()
                .filter(|(_, (_, s, _))| !s.is_some_and(|s| s.is_terminal()))
                .map(|(tx, (k, s, _))| format!("{k} {tx} {s:?}"))
                .collect();
            if pending.is_empty() {
                return Ok(checker);
            }
            if Instant::now() > deadline {
                return Err(self.fail(format!(
                    "tasks not terminal 300 s after faults stopped: {pending:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

pub fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    crate::run_seeded(seed, run_seed_async(seed, verbose))
}

async fn run_seed_async(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x6578_706f_7274_2121);
    let mut upkeep_rng = SmallRng::seed_from_u64(seed ^ 0x6963_6562_6572_6721);
    let iceberg = upkeep_rng.random_bool(0.5);
    let events = generate(&mut rng);
    let world = World::new(
        seed,
        &mut rng,
        NetOptions::default(),
        CoordFaults {
            fail_before_prob: 0.02,
            fail_after_prob: 0.02,
            ..CoordFaults::default()
        },
        ObjectFaults {
            min_latency: Duration::from_millis(2),
            max_latency: Duration::from_millis(150),
            fail_prob: 0.05,
            fail_after_write_prob: 0.05,
            multipart: false,
            deletes: false,
        },
        verbose,
    )
    .await?;
    // The lake's objects age by the simulated clock (orphan removal
    // compares their age with it).
    world.lake_store.stamp_with({
        let clock = world.clock.clone();
        Arc::new(move || {
            chrono::DateTime::from_timestamp_micros(clock.unix_micros() as i64).unwrap_or_default()
        })
    });
    let (fed, _) = watch::channel(Bytes::new());
    let mut sim = Sim {
        world,
        nodes: (0..NODES).map(|_| None).collect(),
        wal: BytesMut::new(),
        fed,
        rows: Vec::new(),
        next_id: 0,
        asked: BTreeMap::new(),
        killed_on_commit: BTreeSet::new(),
        crashes: 0,
        iceberg,
        upkeep_rng,
        retire_rng: SmallRng::seed_from_u64(seed ^ 0x7265_7469_7265_2121),
        retirements: 0,
        compactions: 0,
        policy: super::policy::PolicyRun::draw(seed),
        forced: BTreeSet::new(),
    };
    if let Some(run) = &sim.policy {
        let line = run.describe();
        sim.log(line);
    }
    sim.log(format!("seed {seed}: {} events", events.len()));
    if iceberg {
        sim.log(format!(
            "{} is an Iceberg table",
            DESTINATIONS[super::ICEBERG_DESTINATION]
        ));
    }
    let setup = sim.own_session("setup").await?;
    // The table exists before anything runs (set up without faults).
    let mut attempts = 0;
    loop {
        let r = async {
            ferry_coord::create_all(setup.as_ref(), "/ferry/tables").await?;
            match setup
                .create(
                    "/ferry/tables/t",
                    &serde_json::to_vec(&sim.catalog_table()).expect("json"),
                    ferry_coord::CreateMode::Persistent,
                )
                .await
            {
                Ok(_) | Err(ferry_coord::CoordError::NodeExists { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        }
        .await;
        match r {
            Ok(()) => break,
            Err(e) if attempts < 20 => {
                attempts += 1;
                tracing::debug!(error = %e, "setup retried");
            }
            Err(e) => return Err(sim.fail(format!("setting up the table: {e}"))),
        }
    }
    for i in 0..NODES {
        sim.start_node(i).await?;
    }
    for (at, event) in &events {
        // Between events, an export whose commit file is written while its
        // status is not COMPLETED yet (the committer failed or crashed in
        // between) is killed half of the time: the kill must complete it.
        let due = sim.world.start + *at;
        while tokio::time::Instant::now() + COMMIT_WATCH_STEP < due {
            tokio::time::sleep(COMMIT_WATCH_STEP).await;
            sim.write_upkeep();
            sim.kill_on_commit_file().await;
            sim.maybe_expire_snapshots().await;
        }
        tokio::time::sleep_until(due).await;
        sim.write_upkeep();
        sim.maybe_retire().await;
        sim.maybe_compact().await;
        sim.log(format!("{event:?}"));
        sim.apply(event).await?;
    }
    let mut checker = sim.settle().await?;
    if sim.policy.is_some() {
        // With nobody asking, the lake catches up; then the runners stop
        // and their last tasks settle before the checks.
        sim.policy_caught_up().await?;
        sim.stop_policies().await?;
        checker = sim.settle().await?;
    }
    let (completed, killed, snapshots) = sim.check(&checker).await?;
    let retired_rows = sim.check_retention().await?;
    sim.log(format!(
        "settled: {} exports asked, {completed} commit files checked, {snapshots} Iceberg snapshots checked, {killed} killed",
        sim.asked.len()
    ));
    stop_all(&mut sim.nodes).await;
    let injected_object_faults = sim.world.lake_store.injected_faults();
    Ok(Outcome {
        run: sim.world.finish(events.len()),
        exports: sim.asked.len(),
        completed,
        snapshots,
        killed,
        crashes: sim.crashes,
        injected_object_faults,
        retirements: sim.retirements,
        retired_rows,
        compactions: sim.compactions,
        policy: sim.policy.is_some(),
        policy_records: sim.policy.as_ref().map_or(0, |p| p.records),
        orphans_removed: sim.policy.as_ref().map_or(0, |p| p.orphans_removed),
    })
}
