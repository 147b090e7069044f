//! A safekeeper: one WAL server of the quorum.

pub mod control;
pub mod wal_storage;
