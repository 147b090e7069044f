//! Replicas: the committed WAL of a shard applied, in LSN order, into
//! immutable partitioned Parquet parts (`replica`), the parts themselves
//! (`part`), and the walreceiver that feeds a replica from the safekeepers and
//! reports its position back (`stream`).
//!
//! Must never: write a part it cannot vouch for (hostile WAL stops it), move
//! `disk_consistent_lsn` before the parts below it are durable, or decide
//! anything from time or from which safekeeper it streams from.

pub mod checksum;
pub mod part;
pub mod replica;
pub mod stream;
pub mod view;

pub use part::{PartMeta, PartName};
pub use replica::{
    plan_compaction, run_merges, HoldError, Merge, MergeJob, Replica, ReplicaError, ReplicaStatus,
    RetiredPartition, SharedReplica, TableRef, Tables, ALL_SHARDS, MERGE_FANIN,
};
pub use stream::StreamConfig;
pub use view::{ReadView, ReplicaReader};
