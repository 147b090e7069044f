//! Deterministic simulation of ferry's nodes.
//!
//! Everything runs on one current-thread tokio runtime whose clock is paused:
//! when every task waits, time jumps to the next timer, so a simulated minute
//! costs only the work done in it. Nodes are the production crates, unchanged;
//! they reach the world only through the seams of `ferry-env`, which the simulator
//! fills with [`disk::SimDisk`] (loses unsynced writes on a crash) and
//! [`net::SimNet`] (delays, broken connections, partitions). All choices come from
//! one seed, so a seed replays the same run and the same event log; that
//! includes tokio's own random choices (the order a watch channel wakes its
//! receivers in), seeded through [`run_seeded`].
//!
//! * [`world`]: nodes' disks, the network, coordination, object storage, the
//!   clock and the event log of one run, drawn from its seed;
//! * [`faults`]: the faults any workload's schedule can hold;
//! * [`clock`]: virtual Unix time from a seeded start;
//! * [`coord`]: coordination with ZooKeeper's failure behaviour (latency, loss
//!   before or after apply, partitions that expire sessions, abandoned sessions);
//! * [`objstore`]: object storage with errors, latency and failures after a
//!   successful write (from `ferry-testkit`, which tests outside the
//!   simulator use too);
//! * [`rogue`]: a misbehaving proposer whose messages must all be refused;
//! * [`wal`]: the WAL random test (safekeepers, writers, faults, invariants);
//! * [`walreceiver`]: a replica's side of START_REPLICATION that checks every
//!   walsender frame;

pub mod clock;
pub mod coord;
pub mod disk;
pub mod export;
pub mod faults;
pub mod net;
pub use ferry_testkit::objstore;
pub mod replicas;
pub mod rogue;
pub mod wal;
pub mod walreceiver;
pub mod world;

/// Runs one simulated run to its end on its own runtime: current-thread, clock
/// paused, and tokio's internal random numbers drawn from `seed`. Without the
/// seed, tokio picks, for instance, which of its shards a watch receiver waits
/// in, so receivers woken by one change (walsenders of a safekeeper) would run
/// in an order that changes from run to run.
pub fn run_seeded<T>(
    seed: u64,
    run: impl std::future::Future<Output = Result<T, world::Failure>>,
) -> Result<T, world::Failure> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()))
        .build()
        .map_err(|e| world::Failure {
            seed,
            reason: format!("cannot build the runtime: {e}"),
            log: Vec::new(),
        })?;
    runtime.block_on(run)
}
