//! A safekeeper: one WAL server of the quorum.
//!
//! * [`control`]: the control file (the state that must survive crashes);
//! * [`wal_storage`]: WAL bytes in segment files, with crash recovery;
//! * [`acceptor`]: the protocol logic that ties them together;
//! * [`server`]: connections (the writer's, batched into group commits, and
//!   walsenders to replicas) over the network seam.

pub mod acceptor;
pub mod control;
pub mod server;
pub mod wal_storage;
