//! `ferry-sim`: the deterministic simulator's command line (random seeds,
//! speed, failures, and the replay of one seed with its event log).
//!
//! A binary of its own so that the product binary `ferry` never carries the
//! paused clock the simulator needs (tokio's `test-util`); `ferry sim ...`
//! runs this one when it is installed beside `ferry`.

// The wall clock measures the runs (seeds per second), outside the simulated
// world; no simulated node reads it.
#![allow(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

/// Prints a line to stdout, ignoring a closed stdout.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

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
}

fn wal(args: WalSimArgs) -> anyhow::Result<()> {
    if let Some(seed) = args.seed {
        return match ferry_sim::wal::run_seed(seed, args.log) {
            Ok(o) => {
                say!(
                    "seed {seed}: ok, {} events, {:.1} simulated s, {} acknowledged writes, {} elections, commit_lsn {}, log hash {:08x}",
                    o.events,
                    o.simulated.as_secs_f64(),
                    o.acknowledged,
                    o.elections,
                    o.commit_lsn,
                    o.log_hash
                );
                Ok(())
            }
            Err(f) => {
                if !args.log {
                    for line in &f.log {
                        say!("{line}");
                    }
                }
                anyhow::bail!("{f}")
            }
        };
    }
    let started = Instant::now();
    let mut simulated = Duration::ZERO;
    let mut failures = Vec::new();
    let mut crashes = ferry_sim::disk::CrashStats::default();
    for seed in args.start_seed..args.start_seed + args.seeds {
        match ferry_sim::wal::run_seed(seed, false) {
            Ok(o) => {
                simulated += o.simulated;
                crashes.crashes += o.crash_stats.crashes;
                crashes.found_unsynced += o.crash_stats.found_unsynced;
                crashes.bytes_lost += o.crash_stats.bytes_lost;
                crashes.torn += o.crash_stats.torn;
            }
            Err(f) => {
                say!("FAILED {f}");
                say!("  replay: ferry-sim wal --seed {} --log", f.seed);
                failures.push(f.seed);
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    say!(
        "{} seeds in {wall:.2} s: {:.1} seeds/s, {:.0} simulated s per wall s, {} failed",
        args.seeds,
        args.seeds as f64 / wall.max(1e-9),
        simulated.as_secs_f64() / wall.max(1e-9),
        failures.len()
    );
    say!(
        "safekeeper crashes: {}, of which {} ({:.0}%) found unsynced data or directory entries; they dropped {} unsynced bytes and tore {} files' last writes",
        crashes.crashes,
        crashes.found_unsynced,
        100.0 * crashes.found_unsynced as f64 / crashes.crashes.max(1) as f64,
        crashes.bytes_lost,
        crashes.torn
    );
    anyhow::ensure!(failures.is_empty(), "failing seeds: {failures:?}");
    Ok(())
}

fn replicas(args: WalSimArgs) -> anyhow::Result<()> {
    let show = |o: &ferry_sim::replicas::Outcome| {
        format!(
            "{} events, {:.1} simulated s, {} acknowledged inserts, {} rows per shard copy, {} replica crashes, {} merges, log hash {:08x}",
            o.events,
            o.simulated.as_secs_f64(),
            o.acknowledged,
            o.rows,
            o.replica_crashes,
            o.merges,
            o.log_hash
        )
    };
    if let Some(seed) = args.seed {
        return match ferry_sim::replicas::run_seed(seed, args.log) {
            Ok(o) => {
                say!("seed {seed}: ok, {}", show(&o));
                Ok(())
            }
            Err(f) => {
                if !args.log {
                    for line in &f.log {
                        say!("{line}");
                    }
                }
                anyhow::bail!("{f}")
            }
        };
    }
    let started = Instant::now();
    let mut failures = Vec::new();
    let (mut crashes, mut merges) = (0, 0);
    for seed in args.start_seed..args.start_seed + args.seeds {
        match ferry_sim::replicas::run_seed(seed, false) {
            Ok(o) => {
                crashes += o.replica_crashes;
                merges += o.merges;
            }
            Err(f) => {
                say!("FAILED {f}");
                say!("  replay: ferry-sim replicas --seed {} --log", f.seed);
                failures.push(f.seed);
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    say!(
        "{} seeds in {wall:.2} s: {:.1} seeds/s, {crashes} replica crashes, {merges} merges, {} failed",
        args.seeds,
        args.seeds as f64 / wall.max(1e-9),
        failures.len()
    );
    anyhow::ensure!(failures.is_empty(), "failing seeds: {failures:?}");
    Ok(())
}

fn export(args: WalSimArgs) -> anyhow::Result<()> {
    let show = |o: &ferry_sim::export::Outcome| {
        format!(
            "{} events, {:.1} simulated s, {} exports asked, {} commit files checked, {} killed, {} crashes, {} object faults, log hash {:08x}",
            o.events,
            o.simulated.as_secs_f64(),
            o.exports,
            o.completed,
            o.killed,
            o.crashes,
            o.injected_object_faults,
            o.log_hash
        )
    };
    if let Some(seed) = args.seed {
        return match ferry_sim::export::run_seed(seed, args.log) {
            Ok(o) => {
                say!("seed {seed}: ok, {}", show(&o));
                Ok(())
            }
            Err(f) => {
                if !args.log {
                    for line in &f.log {
                        say!("{line}");
                    }
                }
                anyhow::bail!("{f}")
            }
        };
    }
    let started = Instant::now();
    let mut failures = Vec::new();
    let (mut exports, mut completed, mut killed, mut crashes) = (0, 0, 0, 0);
    for seed in args.start_seed..args.start_seed + args.seeds {
        match ferry_sim::export::run_seed(seed, false) {
            Ok(o) => {
                exports += o.exports;
                completed += o.completed;
                killed += o.killed;
                crashes += o.crashes;
            }
            Err(f) => {
                say!("FAILED {f}");
                say!("  replay: ferry-sim export --seed {} --log", f.seed);
                failures.push(f.seed);
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    say!(
        "{} seeds in {wall:.2} s: {:.1} seeds/s, {exports} exports asked, {completed} commit files checked, {killed} killed, {crashes} crashes, {} failed",
        args.seeds,
        args.seeds as f64 / wall.max(1e-9),
        failures.len()
    );
    anyhow::ensure!(failures.is_empty(), "failing seeds: {failures:?}");
    Ok(())
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
        SimCommand::Wal(args) => wal(args),
        SimCommand::Replicas(args) => replicas(args),
        SimCommand::Export(args) => export(args),
    }
}
