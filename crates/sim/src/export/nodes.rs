//! The export workload's nodes: each a replica of every shard with its
//! merge task and exporter, as the product assembles it
//! (`ferry_node::ReplicaNode`), fed the WAL at its own pace; crashes (most
//! right after a write) that lose unsynced data and abandon sessions.

use std::sync::Arc;
use std::time::Duration;

use ferry_coord::Session;
use ferry_env::{Clock, Cpu, Disk};
use ferry_export::{ExporterConfig, ReplicaSet};
use ferry_replica::ALL_SHARDS;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{node_name, Failure, Sim, SESSION_TIMEOUT};
use crate::world::{AfterAWrite, Stop};

/// Half of the crashes wait for a write, so they land before its fsync.
const CRASH: AfterAWrite = AfterAWrite {
    prob: 0.5,
    within: Duration::from_millis(500),
};

/// A running node: the replica node as the product assembles it (its WAL
/// fed by the simulation), the simulation's feeder, and a session for
/// requests and kills (the exporter has sessions of its own).
pub(super) struct Node {
    pub(super) node: ferry_node::ReplicaNode,
    pub(super) parts: Arc<ReplicaSet>,
    pub(super) session: Session,
    pub(super) feeder: tokio::task::JoinHandle<()>,
    /// The export policy's runner, in policy runs.
    pub(super) policy: Option<super::policy::PolicyTask>,
}

impl Stop for Node {
    /// A crash: every task ends at once.
    async fn stop(self) {
        if let Some(policy) = self.policy {
            policy.abort().await;
        }
        self.feeder.abort();
        let _ = self.feeder.await;
        self.node.stop().await;
    }
}

impl Sim {
    pub(super) async fn start_node(&mut self, i: usize) -> Result<(), Failure> {
        let name = node_name(i);
        let disk: Arc<dyn Disk> = Arc::new(self.world.disk(&name).for_process());
        let mut config = ExporterConfig::new(name.clone());
        config.tick = Duration::from_millis(100);
        config.cleanup_interval = Duration::from_millis(500);
        config.safety_poll = Duration::from_secs(5);
        config.creating_grace = Duration::from_secs(30);
        config.upload_budget = ferry_storage::UploadBudget {
            part_bytes: 8 << 10,
            max_in_flight: 2,
        };
        let clock: Arc<dyn Clock> = Arc::new(self.world.clock.clone());
        let node = ferry_node::ReplicaNode::start(
            ferry_node::ReplicaNodeConfig {
                dir: "replica".into(),
                shard: ALL_SHARDS,
                replica: i as u32,
                // The node applies the WAL at its own pace (the feeder below).
                wal: ferry_node::WalSource::Fed,
                merges: Some(Duration::from_secs(1)),
                export: Some(ferry_node::ExportSeams {
                    config,
                    sessions: Arc::new(self.world.coord.factory(&name, SESSION_TIMEOUT)),
                    destinations: Arc::new(self.lake()),
                }),
            },
            ferry_node::ReplicaSeams {
                disk,
                clock,
                cpu: Cpu::Inline,
                tables: Arc::new(ferry_testkit::table::FixedTables::new([
                    self.catalog_table()
                ])),
            },
        )
        .await
        .map_err(|e| self.fail(format!("{name} cannot reopen its replica: {e}")))?;
        let replica = Arc::clone(&node.replica);
        let parts = Arc::clone(&node.parts);
        let feeder = tokio::spawn({
            let mut fed = self.fed.subscribe();
            let mut rng = SmallRng::seed_from_u64(self.world.rng.random());
            async move {
                loop {
                    let bytes = fed.borrow_and_update().clone();
                    let end = bytes.len();
                    let at = replica.lock().await.receive_from();
                    if (at.0 as usize) < end {
                        tokio::time::sleep(Duration::from_millis(rng.random_range(1..200))).await;
                        let mut r = replica.lock().await;
                        let at = r.receive_from();
                        if let Err(e) = r.receive(at, &bytes[at.0 as usize..end]).await {
                            tracing::debug!(error = %e, "feeding the replica failed");
                            return;
                        }
                        continue;
                    }
                    if fed.changed().await.is_err() {
                        return;
                    }
                }
            }
        });
        let session: Session = self
            .world
            .coord
            .session(&name, SESSION_TIMEOUT)
            .await
            .map_err(|e| self.fail(format!("{name}: no session: {e}")))?;
        let policy = match (&self.policy, &node.exports) {
            (Some(run), Some(view)) => {
                let sessions: Arc<dyn ferry_coord::SessionFactory> =
                    Arc::new(self.world.coord.factory(&name, SESSION_TIMEOUT));
                Some(run.start(super::policy::RunnerSeams {
                    session: ferry_coord::RenewingSession::with(
                        Arc::clone(&sessions),
                        session.clone(),
                    ),
                    sessions,
                    parts: Arc::clone(&parts) as Arc<dyn ferry_export::LocalParts>,
                    destinations: Arc::new(self.lake()),
                    replica_name: name.clone(),
                    clock: Arc::new(self.world.clock.clone()),
                    view: view.clone(),
                    seed: self.world.rng.random(),
                }))
            }
            _ => None,
        };
        self.nodes[i] = Some(Node {
            node,
            parts,
            session,
            feeder,
            policy,
        });
        self.log(format!("{name} started"));
        Ok(())
    }

    pub(super) async fn crash(&mut self, i: usize) -> Result<(), Failure> {
        let name = node_name(i);
        if let Some(node) = self.nodes[i].take() {
            // Its sessions are abandoned with its disk.
            self.world.crash(&name, node, Some(CRASH)).await;
            self.crashes += 1;
        }
        self.start_node(i).await
    }
}
