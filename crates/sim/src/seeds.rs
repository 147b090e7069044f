//! Running a workload's seeds, as `ferry-sim` and the random tests do: one
//! seed replayed with its log, a range of seeds with a summary, regression
//! seeds, today's window ([`ferry_testkit::seeds::SeedWindow`]) and the
//! determinism check. Every workload runs through the same code, so a
//! failure reads the same whichever found it, and always says how to replay
//! it.

use std::ops::Range;

use ferry_testkit::seeds::{run_seeds, SeedWindow};

use crate::world::{Failure, Run};

/// A workload as the seed harness runs it.
pub trait Workload {
    /// What one seed did.
    type Outcome: Send;
    /// The workload's subcommand of `ferry-sim` (and its name in the random
    /// tests' window variables).
    const NAME: &'static str;

    /// Runs one seed; `verbose` prints the event log as it happens.
    fn run_seed(seed: u64, verbose: bool) -> Result<Self::Outcome, Failure>;

    /// What the run of `outcome` reports as any run does.
    fn run(outcome: &Self::Outcome) -> &Run;

    /// The workload's own counters of one seed, as `ferry-sim <name> --seed
    /// <seed>` prints them between the run's duration and its log hash.
    fn counters(outcome: &Self::Outcome) -> Vec<String>;

    /// The workload's counters over the seeds of a range that passed, each
    /// printed between the speed and the failure count of the summary line
    /// (`wall_secs`: how long the range took).
    fn totals(outcomes: &[Self::Outcome], wall_secs: f64) -> Vec<String>;

    /// Lines printed after the summary line.
    fn notes(_outcomes: &[Self::Outcome]) -> Vec<String> {
        Vec::new()
    }
}

/// Prints a line to stdout, ignoring a closed stdout (a pager that quit).
fn say(line: impl std::fmt::Display) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stdout(), "{line}");
}

/// A failure as the tests report it: the seed, the reason, the command that
/// replays it and the last 40 events.
pub fn explain<W: Workload>(f: &Failure) -> String {
    let tail: Vec<&str> = f
        .log
        .iter()
        .rev()
        .take(40)
        .rev()
        .map(String::as_str)
        .collect();
    format!(
        "{f}\nreplay with: cargo run --release -p ferry-sim -- {} --seed {} --log\nlast events:\n{}",
        W::NAME,
        f.seed,
        tail.join("\n")
    )
}

/// Runs one seed and says how it went (`ferry-sim <name> --seed <seed>`); a
/// failure prints its log (unless `log` printed it as it happened).
pub fn replay<W: Workload>(seed: u64, log: bool) -> anyhow::Result<()> {
    match W::run_seed(seed, log) {
        Ok(o) => {
            let run = W::run(&o);
            say(format_args!(
                "seed {seed}: ok, {} events, {:.1} simulated s, {}, log hash {:08x}",
                run.events,
                run.simulated.as_secs_f64(),
                W::counters(&o).join(", "),
                run.log_hash
            ));
            Ok(())
        }
        Err(f) => {
            if !log {
                for line in &f.log {
                    say(line);
                }
            }
            anyhow::bail!("{f}")
        }
    }
}

/// What one thread of [`window`] ran: outcomes by seed, failing seeds.
type Ran<O> = (Vec<(u64, O)>, Vec<u64>);

/// Runs every seed of `seeds` (`ferry-sim <name> --seeds N --start-seed S
/// --jobs J`) on `jobs` threads, each seed alone on its thread's runtime (a
/// seed's run depends on its seed only, not on the thread or the seeds
/// beside it): each failure is printed with its replay command as it
/// happens, then one summary line (speed, the workload's totals, failures)
/// and the workload's notes. Fails naming the failing seeds, if any.
pub fn window<W: Workload>(seeds: Range<u64>, jobs: usize) -> anyhow::Result<()> {
    // The wall clock measures the runs (seeds per second), outside the
    // simulated world; no simulated node reads it.
    #[allow(clippy::disallowed_methods)]
    let started = std::time::Instant::now();
    let count = seeds.end - seeds.start;
    let jobs = jobs.clamp(1, count.max(1) as usize);
    let next = std::sync::atomic::AtomicU64::new(seeds.start);
    let run_some = || {
        let mut outcomes = Vec::new();
        let mut failures = Vec::new();
        loop {
            let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if seed >= seeds.end {
                break;
            }
            match W::run_seed(seed, false) {
                Ok(o) => outcomes.push((seed, o)),
                Err(f) => {
                    say(format_args!(
                        "FAILED {f}\n  replay: ferry-sim {} --seed {} --log",
                        W::NAME,
                        f.seed
                    ));
                    failures.push(f.seed);
                }
            }
        }
        (outcomes, failures)
    };
    let results: Vec<Ran<W::Outcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (1..jobs).map(|_| scope.spawn(run_some)).collect();
        let mut results = vec![run_some()];
        for handle in handles {
            match handle.join() {
                Ok(r) => results.push(r),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        results
    });
    let mut outcomes = Vec::new();
    let mut failures = Vec::new();
    for (o, f) in results {
        outcomes.extend(o);
        failures.extend(f);
    }
    outcomes.sort_by_key(|(seed, _)| *seed);
    failures.sort_unstable();
    let outcomes: Vec<W::Outcome> = outcomes.into_iter().map(|(_, o)| o).collect();
    let wall = started.elapsed().as_secs_f64();
    let mut totals = W::totals(&outcomes, wall);
    totals.push(format!("{} failed", failures.len()));
    say(format_args!(
        "{count} seeds in {wall:.2} s on {jobs} threads: {:.1} seeds/s, {}",
        count as f64 / wall.max(1e-9),
        totals.join(", ")
    ));
    for note in W::notes(&outcomes) {
        say(note);
    }
    anyhow::ensure!(failures.is_empty(), "failing seeds: {failures:?}");
    Ok(())
}

/// Runs regression seeds: seeds that once failed must stay green. The first
/// failure panics with its [`explain`]ing.
pub fn regression<W: Workload>(seeds: &[u64]) -> Vec<W::Outcome> {
    run_seeds(
        seeds.iter().copied(),
        |s| W::run_seed(s, false),
        explain::<W>,
    )
}

/// Runs today's window of `default_count` seeds from `base_of_day(day)` (see
/// [`SeedWindow::today`]); the first failure panics with its [`explain`]ing.
/// The workload's totals go to stderr, past libtest's capture, so that every
/// run says what its schedules reached.
pub fn today<W: Workload>(default_count: u64, base_of_day: impl Fn(u64) -> u64) -> Vec<W::Outcome> {
    let window = SeedWindow::today(W::NAME, default_count, base_of_day);
    // As in `window`: the wall clock measures the runs only.
    #[allow(clippy::disallowed_methods)]
    let started = std::time::Instant::now();
    let outcomes = window.run(|s| W::run_seed(s, false), explain::<W>);
    let totals = W::totals(&outcomes, started.elapsed().as_secs_f64());
    {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "{} seeds: {}",
            outcomes.len(),
            totals.join(", ")
        );
    }
    outcomes
}

/// Runs each of `seeds` twice: both runs must log the same events (one seed,
/// one execution).
pub fn same_seed_same_log<W: Workload>(seeds: &[u64]) {
    for &seed in seeds {
        let run = || W::run_seed(seed, false).unwrap_or_else(|f| panic!("{}", explain::<W>(&f)));
        let (a, b) = (run(), run());
        let (a, b) = (W::run(&a), W::run(&b));
        assert_eq!(a.log, b.log, "seed {seed} ran differently twice");
        assert_eq!(a.log_hash, b.log_hash);
        assert!(a.log.len() > 3, "seed {seed} logged its events");
    }
}
