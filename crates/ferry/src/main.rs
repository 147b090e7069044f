//! The `ferry` binary: wires the library crates into runnable roles.

/// Prints a line to stdout, ignoring a closed stdout (a supervisor that stopped
/// reading must not turn a clean shutdown into a panic).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

mod bench;
mod cluster;
mod dev;
mod http;
mod local;
mod lockfile;
mod paths;
mod roles;
mod sim;

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "ferry",
    version,
    about = "Replicated ingest store that exports partitions to a data lake"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs everything in one process on embedded defaults (coordination store,
    /// object storage and a WAL quorum under the data dir) until Ctrl-C.
    Dev(dev::DevArgs),
    /// Runs one safekeeper (WAL server) of a distributed deployment.
    Safekeeper(roles::SafekeeperArgs),
    /// Runs the writer (the proposer of the WAL quorum) of a distributed deployment.
    Writer(roles::WriterArgs),
    /// Deterministic simulation: random schedules of faults, checked invariants.
    Sim {
        #[command(subcommand)]
        which: SimCommand,
    },
    /// Prints performance figures.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Debug, Subcommand)]
enum SimCommand {
    /// The WAL random test: 3 safekeepers and a writer under crashes, restarts,
    /// partitions, broken connections and disk stalls.
    Wal(sim::WalSimArgs),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Coordination: embedded store ops/s, and ZooKeeper round trips of separate
    /// creates against one multi.
    Coord(bench::CoordBenchArgs),
    /// WAL quorum: throughput and commit latency of 3 safekeepers on loopback,
    /// next to the disk's own fdatasync latency and sequential write rate.
    Wal(bench::WalBenchArgs),
}

/// Where `ferry dev` keeps its data unless told otherwise: under the working folder.
pub fn default_data_dir() -> PathBuf {
    PathBuf::from("ferry-data")
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::Sim {
        which: SimCommand::Wal(args),
    } = cli.command
    {
        // Node logs would drown the event log; RUST_LOG turns them on.
        if std::env::var_os("RUST_LOG").is_some() {
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .init();
        }
        // The simulator builds its own single-threaded runtime per seed.
        return sim::wal(args);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("info,zookeeper_client=warn")
            }),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal, never in a log file or a pipe.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // One thread runs every task of the process, as in the simulator: a node's
    // many small steps (frames, acknowledgements, wake-ups) never cross threads.
    // Blocking disk calls go to tokio's blocking pool.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        match cli.command {
            Command::Dev(args) => dev::run(args).await,
            Command::Safekeeper(args) => roles::safekeeper(args).await,
            Command::Writer(args) => roles::writer(args).await,
            Command::Sim { .. } => unreachable!("handled before the runtime starts"),
            Command::Bench { which } => match which {
                BenchCommand::Coord(args) => bench::coord(args).await,
                BenchCommand::Wal(args) => bench::wal(args).await,
            },
        }
    })
}
