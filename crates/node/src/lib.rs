//! ferry's nodes, assembled once from the seams.
//!
//! A node is the set of tasks one role runs around its state: a replica node
//! is the [`Replica`](ferry_replica::Replica), its walreceiver, its merges and
//! its exporter, with the export API and policies ([`exports`]) beside it; a
//! writer node is a started writer with its catalog, its table and insert
//! API and its commit record in coordination; a safekeeper node is the
//! acceptor opened from its disk and served on its listener. Every place
//! that runs a node (the `ferry` binary's
//! roles and dev mode, the benchmarks, the deterministic simulator) builds it
//! here, from seams it passes in (disk, network, clock, CPU, coordination,
//! object storage), so that the wiring the simulator runs is the wiring the
//! product runs.
//!
//! This crate reaches the outside world only through those seams (the root
//! `clippy.toml` rule holds here): what opens real files, sockets and clocks
//! is the caller's.

pub mod bootstrap;
pub mod commit_record;
pub mod exports;
pub mod http;
pub mod membership;
pub mod replica;
pub mod safekeeper;
pub mod writer;

pub use replica::{
    ExportSeams, ReplicaNode, ReplicaNodeConfig, ReplicaNodeStopped, ReplicaSeams, WalSource,
};
pub use safekeeper::{start_safekeeper, SafekeeperNodeError, SafekeeperOpen};
pub use writer::{CatalogTables, WriterNode};
