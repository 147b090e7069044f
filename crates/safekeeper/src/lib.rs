//! A safekeeper: one WAL server of the quorum.
//!
//! * [`control`]: the control file (the state that must survive crashes);
//! * [`wal_storage`]: WAL bytes in segment files, with crash recovery;
//! * [`acceptor`]: the protocol logic that ties them together, and the WAL
//!   removal horizon;
//! * [`backup`]: whole segments uploaded to object storage, and read back for
//!   replicas that need WAL removed locally;
//! * [`partial`]: the flushed prefix of the segment being written, uploaded
//!   under a protocol that leaves no orphan object after any crash;
//! * [`restore`]: a lost safekeeper rebuilt from the backup, which votes
//!   again only once a writer proven current brought it back;
//! * [`pull`]: a lost safekeeper rebuilt from a peer's WAL above its removal
//!   horizon, under the same rule;
//! * [`server`]: connections (the writer's, batched into group commits, and
//!   walsenders to replicas) over the network seam.

pub mod acceptor;
pub mod backup;
pub mod control;
pub mod partial;
pub mod pull;
pub mod recovery;
pub mod restore;
pub mod server;
pub mod wal_storage;
