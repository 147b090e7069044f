//! The `ferry` binary: wires the library crates into runnable roles.

#[macro_use]
extern crate ferry_host;

mod client_cmd;
mod config;
mod demo;
mod dev;
mod export_cmd;
mod roles;
mod safekeeper_set;

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Context as _;
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
    /// TOML configuration file (`ferry config example` prints one with every
    /// setting); flags and environment variables win over it.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
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
    /// Shows or changes the safekeeper set of a distributed deployment
    /// (replace, add, remove) without losing committed WAL.
    SafekeeperSet(safekeeper_set::SafekeeperSetArgs),
    /// Runs one replica of one shard of a distributed deployment: applies the
    /// shard's committed WAL as Parquet parts and serves reads.
    Replica(roles::ReplicaCommand),
    /// Tables: create from a TOML file, list, show, drop (talks to a node over HTTP).
    Table {
        #[command(subcommand)]
        command: client_cmd::TableCommand,
    },
    /// Inserts a file (NDJSON, CSV, Arrow IPC or Parquet) into a table, in
    /// chunks with bounded memory, retrying with the same idempotency key.
    Insert(client_cmd::InsertArgs),
    /// Exports a partition (or every partition) of a table to object storage,
    /// exactly once, shared by the replicas; `ferry export kill` kills one.
    Export(Box<export_cmd::ExportArgs>),
    /// Lists export tasks with their status (from a node's mirror).
    Exports(export_cmd::ExportsArgs),
    /// Checks a destination against its commit files (exit code non-zero on
    /// any mismatch; orphan files are reported).
    Verify(export_cmd::VerifyArgs),
    /// The data lake as a reader sees it: `ferry lake files URL` prints the
    /// files to read now.
    Lake {
        #[command(subcommand)]
        command: export_cmd::LakeCommand,
    },
    /// Reads from a node's replicas: row counts, partitions and parts.
    Query {
        #[command(subcommand)]
        command: client_cmd::QueryCommand,
    },
    /// Deterministic simulation: random schedules of faults, checked invariants.
    /// Runs the separate `ferry-sim` binary installed beside this one (the
    /// product carries no simulator), e.g. `ferry sim wal --seeds 2000`.
    Sim {
        /// Everything `ferry-sim` takes: a workload and its flags.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Configuration files.
    Config {
        #[command(subcommand)]
        which: ConfigCommand,
    },
    /// Prints performance figures.
    Bench {
        #[command(subcommand)]
        which: ferry_bench::BenchCommand,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Prints a configuration file with every setting, its default and what it does.
    Example,
    /// Checks a configuration file (unknown keys, wrong types) and says what it sets.
    Check {
        /// The TOML configuration file to check.
        file: PathBuf,
    },
}

/// Runs `ferry-sim` from beside this binary with `args`, in place of this
/// process.
fn run_simulator(args: Vec<std::ffi::OsString>) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe()?;
    let sim = exe.with_file_name("ferry-sim");
    if !sim.is_file() {
        let shown: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        anyhow::bail!(
            "the simulator is the separate binary ferry-sim, and there is none beside {}: build it with `cargo build --release -p ferry-sim`, or run `cargo run --release -p ferry-sim -- {}`",
            exe.display(),
            shown.join(" ")
        );
    }
    let err = std::process::Command::new(&sim).args(args).exec();
    Err(anyhow::Error::new(err).context(format!("running {}", sim.display())))
}

/// Where `ferry dev` keeps its data unless told otherwise: under the working folder.
pub fn default_data_dir() -> PathBuf {
    PathBuf::from("ferry-data")
}

/// Errors are printed as one readable chain (`error: what: why: ...`),
/// never as a debug dump with a backtrace, whatever `RUST_BACKTRACE` says.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = config::apply(std::env::args_os().collect())?;
    let cli = Cli::parse_from(args);
    let _ = &cli.config; // applied above, before parsing
    if let Command::Sim { args } = cli.command {
        return run_simulator(args);
    }
    if let Command::Config { which } = &cli.command {
        match which {
            ConfigCommand::Example => say!("{}", config::EXAMPLE.trim_end()),
            ConfigCommand::Check { file } => {
                let text = std::fs::read_to_string(file)
                    .with_context(|| format!("reading {}", file.display()))?;
                let parsed = config::parse(&text)
                    .with_context(|| format!("configuration file {}", file.display()))?;
                let settings =
                    toml::to_string(&parsed).context("showing the configuration's settings")?;
                say!(
                    "{} is valid; it sets:\n{}",
                    file.display(),
                    settings.trim_end()
                );
            }
        }
        return Ok(());
    }
    // A benchmark's figures are its output: the nodes it runs log only what
    // went wrong, unless RUST_LOG asks for more.
    let default_filter = if matches!(cli.command, Command::Bench { .. }) {
        "warn"
    } else {
        "info,zookeeper_client=warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
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
            Command::SafekeeperSet(args) => safekeeper_set::run(args).await,
            Command::Replica(cmd) => match (cmd.action, cmd.run) {
                (Some(roles::ReplicaAction::Unregister(args)), _) => {
                    roles::unregister_replica(args).await
                }
                (None, Some(args)) => roles::replica(args).await,
                (None, None) => anyhow::bail!("ferry replica needs its flags (see --help)"),
            },
            Command::Table { command } => client_cmd::table(command).await,
            Command::Insert(args) => client_cmd::insert(args).await,
            Command::Query { command } => client_cmd::query(command).await,
            Command::Export(args) => export_cmd::export(*args).await,
            Command::Exports(args) => export_cmd::exports(args).await,
            Command::Verify(args) => export_cmd::verify(args).await,
            Command::Lake { command } => export_cmd::lake(command).await,
            Command::Sim { .. } | Command::Config { .. } => {
                unreachable!("handled before the runtime starts")
            }
            Command::Bench { which } => ferry_bench::run(which).await,
        }
    })
}

#[cfg(test)]
mod help_tests {
    use clap::CommandFactory;

    /// Every subcommand and argument says what it is for in `--help`.
    #[test]
    fn every_argument_and_subcommand_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "version") {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} --{id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                let name = format!("{path} {}", sub.get_name());
                if sub.get_name() != "help" && sub.get_about().is_none() {
                    missing.push(name.clone());
                }
                walk(sub, &name, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&super::Cli::command(), "ferry", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }

    /// The defaults `ferry export --help` states are the ones a task gets.
    #[test]
    fn export_settings_help_states_the_real_defaults() {
        let d = ferry_export::ExportSettings::default();
        let cli = super::Cli::command();
        let export = cli.find_subcommand("export").expect("export");
        let help = |long: &str| -> String {
            export
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .and_then(|a| a.get_help())
                .map(|h| h.to_string())
                .unwrap_or_else(|| panic!("--{long} has help"))
        };
        for (long, default) in [
            ("task-timeout-secs", d.task_timeout_seconds.to_string()),
            ("ttl-secs", d.ttl_seconds.to_string()),
            (
                "retry-initial-backoff-ms",
                d.retry_initial_backoff_ms.to_string(),
            ),
            ("retry-max-backoff-ms", d.retry_max_backoff_ms.to_string()),
            ("max-retries", d.max_retries.to_string()),
            ("parallelism", d.parallelism.to_string()),
            ("row-group-rows", d.row_group_rows.to_string()),
        ] {
            // clap drops a help text's final period.
            let text = help(long);
            assert!(
                text.trim_end_matches('.')
                    .ends_with(&format!("Default: {default}")),
                "--{long}: {text:?} does not state the default {default}"
            );
        }
    }
}

#[cfg(test)]
mod config_tests {
    use clap::CommandFactory;

    /// The lines of `[section]` in the example file.
    fn section(name: &str) -> String {
        let start = format!("[{name}]\n");
        let text = crate::config::EXAMPLE;
        let at = text.find(&start).unwrap_or_else(|| panic!("no [{name}]"));
        let rest = &text[at + start.len()..];
        rest[..rest.find("\n[").unwrap_or(rest.len())].to_string()
    }

    /// Every flag of every role can be set in the file, and the example
    /// lists it (set or commented out) in the role's section, or in `[api]`
    /// for the insert API's; per-invocation flags are the exceptions.
    #[test]
    fn every_flag_of_every_role_has_a_key_in_the_example() {
        let cli = super::Cli::command();
        let per_invocation = ["help", "config", "demo", "demo-rows", "sync"];
        let api = section("api");
        let mut missing = Vec::new();
        for role in ["dev", "safekeeper", "writer", "replica"] {
            let cmd = cli.find_subcommand(role).expect("role");
            let own = section(role);
            for arg in cmd.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if per_invocation.contains(&long) {
                    continue;
                }
                let key = long.replace('-', "_");
                let listed = |text: &str| {
                    text.lines().any(|l| {
                        let l = l.trim_start_matches("# ");
                        l.starts_with(&format!("{key} = "))
                    })
                };
                let in_api = matches!(role, "dev" | "writer") && listed(&api);
                if !listed(&own) && !in_api {
                    missing.push(format!("[{role}] {key}"));
                }
            }
        }
        assert!(missing.is_empty(), "not in the example: {missing:?}");
        // With every commented-out key set, the example still parses: each
        // key is one the file takes.
        let all: String = crate::config::EXAMPLE
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest)
                    if rest.split(" = ").next().is_some_and(|k| {
                        !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    }) && rest.contains(" = ") =>
                {
                    rest.to_string()
                }
                _ => l.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        crate::config::parse(&all).unwrap_or_else(|e| panic!("{e}\n{all}"));
    }
}
