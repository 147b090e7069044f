//! Test support shared by ferry's test suites (a dev-dependency only; no
//! product crate depends on it).
//!
//! * [`services`]: the real services a test needs (ZooKeeper, an S3 server),
//!   found in the environment or reported as skipped, and S3 buckets on the
//!   test server.
//! * [`seeds`]: the seed-window harness of the simulator's random tests.
//! * [`disk`]: one disk wrapper whose every operation passes a hook (to
//!   count, log, stall or fail it).
//! * [`table`]: the test table most suites use, and a fixed catalog.
//! * [`objstore`]: object storage with injected errors, latency and
//!   failures after a successful write (the simulator's, and in-process
//!   tests').
//! * [`tcp_proxy`]: a TCP forwarder that can be cut, for tests against real
//!   ZooKeeper (its sessions expired surely and at once).
//! * [`wal`]: WAL of placeholder inserts, of known sizes.
//! * [`walsender`]: a replica's end of a walsender connection, to read what
//!   a safekeeper streams and to report as a replica.
//! * [`writer`]: waiting on the writer's published status.

pub mod disk;
pub mod objstore;
pub mod seeds;
pub mod services;
pub mod table;
pub mod tcp_proxy;
pub mod wal;
pub mod walsender;
pub mod writer;
