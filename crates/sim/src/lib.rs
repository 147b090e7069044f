//! Deterministic simulation of ferry's nodes.
//!
//! Everything runs on one current-thread tokio runtime whose clock is paused:
//! when every task waits, time jumps to the next timer, so a simulated minute
//! costs only the work done in it. Nodes are the production crates, unchanged,
//! assembled as the product assembles them (`ferry-node`); they reach the
//! world only through the seams of `ferry-env`, which the simulator fills with
//! [`disk::SimDisk`] (loses unsynced writes on a crash) and [`net::SimNet`]
//! (delays, broken connections, partitions). All choices come from one seed,
//! so a seed replays the same run and the same event log; that includes
//! tokio's own random choices (the order a watch channel wakes its receivers
//! in), seeded through [`run_seeded`].
//!
//! The world and the workloads are separate modules:
//!
//! * [`world`]: nodes' disks, the network, coordination, object storage, the
//!   clock, the faults a schedule can hold, and the event log of one run, all
//!   drawn from its seed (its parts are at the crate root too: [`disk`],
//!   [`net`], [`clock`], [`coord`], [`objstore`], [`faults`]);
//! * [`wal`]: the WAL random test (safekeepers, writers, a simulated replica,
//!   a misbehaving proposer, disk losses, faults, invariants);
//! * [`replicas`]: the replica random test (inserts through the writer,
//!   production replicas streaming from safekeepers, crashes, partitions,
//!   retried inserts);
//! * [`export`]: the export random test (three nodes sharing exports under
//!   crashes, session expiries and object-store faults);
//! * [`safekeepers`]: the safekeeper nodes the `wal` and `replicas`
//!   workloads start and crash alike;
//! * [`seeds`]: runs a workload's seeds as the command line and the random
//!   tests do (a window, regression seeds, replays, summaries).
//!
//! Each workload is a directory module of the same shape, so that the same
//! question finds its answer in the same file of every workload: `schedule`
//! (its events and how a seed draws them), `nodes` (starting, crashing and
//! restarting its nodes), `checks` (the checks at every step and the final
//! ones) and `driver` (the run loop, `run_seed`), with modules of its own
//! beside them where it has more (the WAL workload's writers, misbehaving
//! proposer and simulated replica).

pub mod e2e;
pub mod export;
pub mod membership;
pub mod replicas;
pub mod safekeepers;
pub mod seeds;
pub mod wal;
pub mod world;

pub use wal::{rogue, walreceiver};
pub use world::{clock, coord, disk, faults, net, objstore};

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
