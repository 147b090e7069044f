//! Partition export: a partition's parts written exactly once to an object
//! store as Parquet, shared by every replica that holds them, coordinated
//! only through the ZooKeeper data model (SPEC.md section 5).
//!
//! * `model`: the task's layout in coordination, metadata, statuses, ids;
//! * `request`: EXPORT PARTITION (checks, snapshot, the task's creation);
//! * `task`: commit, kill and removal, which any replica may run;
//! * `worker`: a node's exporter (mirror, scheduling, uploads, cleanup);
//! * `dest`: the Hive-layout destination and its commit file;
//! * `lake`: what a reader reads (each partition's current commit);
//! * `verify`: a destination checked as a reader reads it;
//! * `local`: what a node holds (its replicas' parts) and how it opens
//!   destinations.
//!
//! Must never: write a commit file for a task that is not PENDING under its
//! commit lock, move a part to processed without holding its lock, or hold
//! a whole part in memory.

pub mod dest;
pub mod increment;
pub mod lake;
pub mod local;
pub mod model;
pub mod peers;
pub mod policy;
pub mod request;
pub mod task;
pub mod upkeep;
pub mod verify;
pub mod worker;

pub use dest::{Destination, PartFailure};
pub use local::{
    Destinations, LocalParts, RemoteShards, ReplicaSet, SnapshotError, SnapshotRequest,
    StorageDestinations,
};
pub use model::{ExportSettings, FileExistsPolicy, TaskKey, TaskStatus};
pub use request::{
    request_table, Created, ExportRequest, Partitions, RequestError, Requested, Requester,
    TableRequest,
};
pub use worker::{Exporter, ExporterConfig, ExportsView, TaskView};
