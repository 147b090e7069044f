//! Test support shared by ferry's test suites (a dev-dependency only; no
//! product crate depends on it).
//!
//! * [`services`]: the real services a test needs (ZooKeeper, an S3 server),
//!   found in the environment or reported as skipped, and S3 buckets on the
//!   test server.
//! * [`seeds`]: the seed-window harness of the simulator's random tests.

pub mod seeds;
pub mod services;
