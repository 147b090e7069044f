//! The safekeeper nodes of the `wal` and `replicas` workloads, started as the
//! product starts them (`ferry_node::start_safekeeper`) and crashed the same
//! way, so that both workloads exercise one wiring and a fix to it reaches
//! both.
//!
//! Each workload draws the settings of a start from a generator of its own
//! and in an order of its own (the WAL workload from the world's generator,
//! between other draws; the replica workload from one kept for them): the
//! caller passes its generator to [`draw_backup_settings`] and the settings
//! to [`Safekeepers::start`], so that sharing this code changes no seed's
//! run.

use std::sync::Arc;
use std::time::Duration;

use ferry_env::Disk;
use ferry_node::{SafekeeperNodeError, SafekeeperOpen};
use ferry_safekeeper::acceptor::AcceptorConfig;
use ferry_safekeeper::backup::BackupConfig;
use ferry_safekeeper::server::{SafekeeperServer, ServerConfig};
use ferry_storage::Location;
use rand::rngs::SmallRng;
use rand::Rng;

use crate::world::disk::SimDisk;
use crate::world::{AfterAWrite, Failure, Stop, World};

/// The world's name of safekeeper `i`: its node, its address and its data
/// directory.
pub fn name(i: usize) -> String {
    format!("sk{i}")
}

/// WAL backup to the world's lake and removal behind every replica, drawn
/// from `rng` in this order: parallel upload jobs (1 to 4), whether
/// walsenders keep the WAL their replica has not received (half of the
/// starts), and how often removal runs (100 ms to 2 s). Every other setting
/// is the default; a workload changes those it draws or fixes.
pub fn draw_backup_settings(rng: &mut SmallRng, lake: &Location) -> ServerConfig {
    ServerConfig {
        backup: Some(BackupConfig {
            location: lake.clone(),
            parallel_jobs: rng.random_range(1..=4),
        }),
        walsenders_keep_horizon: rng.random_bool(0.5),
        removal_interval: Duration::from_millis(rng.random_range(100..=2000)),
        ..ServerConfig::default()
    }
}

impl Stop for Arc<SafekeeperServer> {
    async fn stop(self) {
        self.kill().await;
    }
}

/// A workload's safekeepers: their disks, which outlive crashes, and the
/// nodes running on them.
pub struct Safekeepers {
    /// Safekeeper `i`'s disk (the world's disk of node [`name`]`(i)`).
    pub disks: Vec<SimDisk>,
    /// Safekeeper `i`'s running node (`None`: down).
    pub servers: Vec<Option<Arc<SafekeeperServer>>>,
}

impl Safekeepers {
    /// `count` safekeepers, none running, with their disks made in the
    /// world now (in index order: making a disk draws from the world's
    /// generator).
    pub fn new(world: &mut World, count: usize) -> Safekeepers {
        Safekeepers {
            disks: (0..count).map(|i| world.disk(&name(i))).collect(),
            servers: (0..count).map(|_| None).collect(),
        }
    }

    /// Starts safekeeper `i` on its disk, listening on its name, with the
    /// `acceptor` and `config` the workload drew, and logs
    /// `sk<i> started (<described>)`. A state that cannot be opened (or
    /// created) fails the run as `sk<i> <cannot_open>: <error>`.
    #[allow(clippy::too_many_arguments)] // each is a choice of the workload
    pub async fn start(
        &mut self,
        world: &mut World,
        i: usize,
        open: SafekeeperOpen,
        acceptor: AcceptorConfig,
        config: ServerConfig,
        cannot_open: &str,
        described: &str,
    ) -> Result<(), Failure> {
        let node = name(i);
        let listener = world
            .net
            .node(&node)
            .bind(&node)
            .await
            .map_err(|e| world.fail(format!("{node} cannot listen: {e}")))?;
        let disk: Arc<dyn Disk> = Arc::new(self.disks[i].for_process());
        let server = ferry_node::start_safekeeper(disk, &node, open, acceptor, listener, config)
            .await
            .map_err(|e| match e {
                SafekeeperNodeError::State(e) => world.fail(format!("{node} {cannot_open}: {e}")),
                SafekeeperNodeError::Serve(e) => world.fail(format!("{node} cannot listen: {e}")),
            })?;
        self.servers[i] = Some(Arc::new(server));
        world.log(format!("{node} started ({described})"));
        Ok(())
    }

    /// Crashes safekeeper `i` if it runs: its process is killed (perhaps
    /// right after a write, see `World::crash`) and its disk power-cut.
    pub async fn crash(&mut self, world: &mut World, i: usize, after_a_write: Option<AfterAWrite>) {
        if let Some(server) = self.servers[i].take() {
            world.crash(&name(i), server, after_a_write).await;
        }
    }

    /// Kills every running safekeeper without touching its disk (the end of
    /// a run, before its disks are read).
    pub async fn stop_all(&mut self) {
        crate::world::stop_all(&mut self.servers).await;
    }
}
