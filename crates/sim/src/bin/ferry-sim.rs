//! `ferry-sim`: the deterministic simulator's command line (random seeds,
//! speed, failures, and the replay of one seed with its event log).
//!
//! A binary of its own so that the product binary `ferry` never carries the
//! paused clock the simulator needs (tokio's `test-util`); `ferry sim ...`
//! runs this one when it is installed beside `ferry`.

use clap::{Parser, Subcommand};
use ferry_sim::seeds::{self, Workload};

#[derive(Debug, Parser)]
#[command(
    name = "ferry-sim",
    version,
    about = "Deterministic simulation of ferry: random schedules of faults, checked invariants"
)]
struct Cli {
    #[command(subcommand)]
    command: SimCommand,
}

#[derive(Debug, Subcommand)]
enum SimCommand {
    /// The WAL random test: 3 safekeepers, writers and a replica under crashes,
    /// restarts, partitions, broken connections and disk faults.
    Wal(WalSimArgs),
    /// The replica random test: inserts through the writer, 2 shards x 2
    /// replicas streaming from 3 safekeepers, under replica and safekeeper
    /// crashes, partitions and retried inserts.
    Replicas(WalSimArgs),
    /// The export random test: three nodes share exports under crashes,
    /// session expiries, lost coordination answers and object-store faults.
    Export(WalSimArgs),
    /// The end-to-end random test: a client inserting over the HTTP API,
    /// writers, safekeepers, replicas exporting themselves to the lake,
    /// every fault at once; judged by what the lake's reader reads.
    E2e(WalSimArgs),
    /// The membership random test: the safekeeper set replaced, grown and
    /// shrunk by the change driver (killed at any step, aborted, raced)
    /// under crashes, partitions, writer takeovers and stale writers.
    Membership(WalSimArgs),
}

#[derive(Debug, clap::Args)]
struct WalSimArgs {
    /// Run exactly this seed (with `--log`, print its event log).
    #[arg(long, conflicts_with_all = ["seeds", "start_seed"])]
    seed: Option<u64>,
    /// Print the time-stamped event log of the run.
    #[arg(long)]
    log: bool,
    /// How many seeds to run.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// First seed of the range.
    #[arg(long, default_value_t = 0)]
    start_seed: u64,
    /// Threads running seeds of the range side by side (each seed runs
    /// alone on its own thread, so every seed runs as it would alone);
    /// default: one per core.
    #[arg(long, conflicts_with = "seed", value_parser = clap::value_parser!(u32).range(1..=256))]
    jobs: Option<u32>,
}

/// One seed replayed, or a range of seeds with a summary.
fn run<W: Workload>(args: WalSimArgs) -> anyhow::Result<()> {
    match args.seed {
        Some(seed) => seeds::replay::<W>(seed, args.log),
        None => {
            let jobs = args.jobs.map_or_else(
                || std::thread::available_parallelism().map_or(1, usize::from),
                |j| j as usize,
            );
            seeds::window::<W>(args.start_seed..args.start_seed + args.seeds, jobs)
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Node logs would drown the event log; RUST_LOG turns them on.
    if std::env::var_os("RUST_LOG").is_some() {
        use std::io::IsTerminal;
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .init();
    }
    // The simulator builds its own single-threaded runtime per seed.
    match cli.command {
        SimCommand::Wal(args) => run::<ferry_sim::wal::Wal>(args),
        SimCommand::Replicas(args) => run::<ferry_sim::replicas::Replicas>(args),
        SimCommand::Export(args) => run::<ferry_sim::export::Export>(args),
        SimCommand::E2e(args) => run::<ferry_sim::e2e::EndToEnd>(args),
        SimCommand::Membership(args) => run::<ferry_sim::membership::MembershipChanges>(args),
    }
}
