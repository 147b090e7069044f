//! The replica node: a replica of one shard (or of every shard, in `ferry
//! dev`), the walreceiver that feeds it committed WAL, the merges that
//! compact its parts, and the exporter that exports its partitions.
//!
//! The tasks share the replica through [`SharedReplica`]; each one only moves
//! bytes and timers, every decision about WAL and parts is the replica's and
//! every decision about an export is the exporter's.

use std::sync::Arc;
use std::time::Duration;

use ferry_coord::SessionFactory;
use ferry_env::{Cpu, Disk, Network, SharedClock};
use ferry_export::{Destinations, Exporter, ExporterConfig, ExportsView, ReplicaSet};
use ferry_replica::{Replica, ReplicaError, ReplicaReader, SharedReplica, StreamConfig, Tables};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long a part a merge replaced stays on disk for the readers that
/// listed it (a read lists parts from a [`ferry_replica::ReadView`], then
/// opens them).
pub const REPLACED_PART_GRACE: Duration = Duration::from_secs(60);

/// How often copies' holds are checked for idleness
/// ([`ferry_replica::BOOTSTRAP_HOLD_IDLE`]).
const HOLD_EXPIRY_CHECK: Duration = Duration::from_secs(30);

/// The seams every replica node reaches the world through.
#[derive(Clone)]
pub struct ReplicaSeams {
    /// The disk holding the replica's directory.
    pub disk: Arc<dyn Disk>,
    pub clock: SharedClock,
    /// Where Parquet encoding and decoding run.
    pub cpu: Cpu,
    /// The table definitions the WAL's records name.
    pub tables: Arc<dyn Tables>,
}

/// Where the replica's WAL comes from.
pub enum WalSource {
    /// Its walreceiver streams the shard's committed WAL from these
    /// safekeepers, reached through `network`.
    Safekeepers {
        network: Arc<dyn Network>,
        config: StreamConfig,
    },
    /// The caller hands WAL to [`Replica::receive`] itself (benchmarks that
    /// measure the replica alone, and the export simulation, which feeds a
    /// WAL of its own making).
    Fed,
}

/// The exporter of a replica node and the seams only it uses.
pub struct ExportSeams {
    pub config: ExporterConfig,
    pub sessions: Arc<dyn SessionFactory>,
    pub destinations: Arc<dyn Destinations>,
}

/// What one replica node is.
pub struct ReplicaNodeConfig {
    /// The replica's directory on [`ReplicaSeams::disk`].
    pub dir: String,
    /// Its shard ([`ferry_replica::ALL_SHARDS`] for a replica of every shard).
    pub shard: u32,
    pub replica: u32,
    pub wal: WalSource,
    /// With merges: how long a part a merge replaced stays on disk for the
    /// readers that listed it. `None`: no merges run.
    pub merges: Option<Duration>,
    /// With an exporter: this node takes part in exports.
    pub export: Option<ExportSeams>,
}

/// Why a replica node stopped by itself.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaNodeStopped {
    #[error("the replica stopped: {0}")]
    Replica(ReplicaError),
    #[error("the replica's walreceiver task failed: {0}")]
    Task(String),
}

/// A running replica node. Dropping it leaves its tasks running; [`ReplicaNode::stop`]
/// ends them.
pub struct ReplicaNode {
    pub replica: SharedReplica,
    /// The replica's status and read view, as readers reach them (without
    /// its lock).
    pub reader: ReplicaReader,
    /// This node's replica as the parts an export reads.
    pub parts: Arc<ReplicaSet>,
    /// The exporter's view of the tasks it mirrors, when it has one.
    pub exports: Option<watch::Receiver<ExportsView>>,
    /// The walreceiver, whose end (a hostile WAL, a disk error) ends the node.
    stream: Option<JoinHandle<ReplicaError>>,
    merges: Option<JoinHandle<()>>,
    holds: Option<JoinHandle<()>>,
    /// Feeds the walreceiver's disk-full breaker, when it has one.
    space_watch: Option<JoinHandle<()>>,
    exporter: Option<JoinHandle<()>>,
}

impl ReplicaNode {
    /// Opens the replica from its directory (recovering what it made
    /// durable) and starts the node's tasks.
    pub async fn start(
        config: ReplicaNodeConfig,
        seams: ReplicaSeams,
    ) -> Result<ReplicaNode, ReplicaError> {
        let replica = Replica::open(
            Arc::clone(&seams.disk),
            &config.dir,
            config.shard,
            config.replica,
            seams.cpu,
            Arc::clone(&seams.tables),
        )
        .await?;
        let reader = replica.reader();
        let replica: SharedReplica = Arc::new(tokio::sync::Mutex::new(replica));
        let parts = Arc::new(ReplicaSet::new(vec![Arc::clone(&replica)]));
        let mut space_watch = None;
        let mut space = None;
        let stream = match config.wal {
            WalSource::Safekeepers { network, config } => {
                space = config.space.clone();
                space_watch = config.space.clone().map(|space| {
                    tokio::spawn(ferry_env::space::watch_free_space(
                        Arc::clone(&seams.disk),
                        space,
                    ))
                });
                Some(tokio::spawn(ferry_replica::stream::run(
                    Arc::clone(&replica),
                    network,
                    Arc::clone(&seams.clock),
                    config,
                )))
            }
            WalSource::Fed => None,
        };
        let merges = config.merges.map(|grace| {
            let replica = Arc::clone(&replica);
            let dir = config.dir.clone();
            tokio::spawn(async move {
                let e = ferry_replica::replica::run_merges_with_space(replica, grace, space).await;
                tracing::warn!(replica = %dir, error = %e, "the replica's merges stopped");
            })
        });
        // Copies of this replica to new replicas whose copier went away
        // stop keeping replaced parts after their idle time.
        let holds = {
            let replica = Arc::clone(&replica);
            let clock = Arc::clone(&seams.clock);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(HOLD_EXPIRY_CHECK).await;
                    replica
                        .lock()
                        .await
                        .expire_bootstrap_holds(clock.unix_micros());
                }
            })
        };
        let mut exporter_task = None;
        let exports = config.export.map(|export| {
            let exporter = Exporter::new(
                export.config,
                export.sessions,
                Arc::clone(&seams.clock),
                seams.cpu,
                Arc::clone(&parts) as Arc<dyn ferry_export::LocalParts>,
                export.destinations,
            );
            let view = exporter.subscribe();
            exporter_task = Some(tokio::spawn(exporter.run()));
            view
        });
        Ok(ReplicaNode {
            replica,
            reader,
            parts,
            exports,
            stream,
            merges,
            holds: Some(holds),
            space_watch,
            exporter: exporter_task,
        })
    }

    /// Resolves when the walreceiver stopped, with why; never for a node
    /// whose WAL is [`WalSource::Fed`] (nor again once it resolved).
    pub async fn stopped(&mut self) -> ReplicaNodeStopped {
        let Some(stream) = &mut self.stream else {
            return std::future::pending().await;
        };
        let outcome = stream.await;
        self.stream = None;
        match outcome {
            Ok(e) => ReplicaNodeStopped::Replica(e),
            Err(e) => ReplicaNodeStopped::Task(e.to_string()),
        }
    }

    /// Stops the exporter alone (a clean stop does this first: the uploads
    /// in flight are abandoned, which leaves nothing visible, and the
    /// exporter's locks go with its session), while the replica goes on
    /// applying WAL.
    pub async fn stop_exporter(&mut self) {
        if let Some(task) = self.exporter.take() {
            task.abort();
            let _ = task.await;
        }
    }

    /// Ends every task of the node at once, as a crash would: a replica is
    /// consistent at any instant, so what it made durable stays and nothing
    /// more is written.
    pub async fn stop(mut self) {
        if let Some(stream) = self.stream.take() {
            stream.abort();
            let _ = stream.await;
        }
        for task in [
            self.merges.take(),
            self.holds.take(),
            self.space_watch.take(),
        ]
        .into_iter()
        .flatten()
        {
            task.abort();
            let _ = task.await;
        }
        self.stop_exporter().await;
    }
}
