//! The seed-window harness of the simulator's random tests: regression
//! seeds prove old bugs stay fixed; a window that moves with the date keeps
//! finding new schedules, while any run is reproducible from the window it
//! prints (`FERRY_SIM_BASE_SEED`, `FERRY_SIM_SEEDS`).

use std::ops::Range;

/// A range of seeds to run, with the command-line variables that repeat it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedWindow {
    pub seeds: Range<u64>,
}

impl SeedWindow {
    /// Today's window: `base_of_day(day)` (days since 1970, by the wall
    /// clock) for `default_count` seeds, unless `FERRY_SIM_BASE_SEED` or
    /// `FERRY_SIM_SEEDS` say otherwise. Printed to stderr, past libtest's
    /// capture, so every run says what it explored.
    pub fn today(workload: &str, default_count: u64, base_of_day: impl Fn(u64) -> u64) -> Self {
        #[allow(clippy::disallowed_methods)] // picks the window; no node reads it
        let day = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() / 86_400);
        let base = env_u64("FERRY_SIM_BASE_SEED").unwrap_or_else(|| base_of_day(day));
        let count = env_u64("FERRY_SIM_SEEDS").unwrap_or(default_count);
        let window = SeedWindow {
            seeds: base..base + count,
        };
        {
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "{workload} random seeds {base}..{} (FERRY_SIM_BASE_SEED={base} FERRY_SIM_SEEDS={count} repeats this window)",
                base + count
            );
        }
        window
    }

    /// Runs every seed of the window, on as many threads as the machine
    /// has cores (seeds are independent: each run is its own world), and
    /// answers the outcomes in seed order; the failure of the lowest seed
    /// that failed panics with `explain`'s account of it (which says how to
    /// replay it). Once a seed failed, threads start no new seed.
    pub fn run<T: Send, F: Send>(
        &self,
        run: impl Fn(u64) -> Result<T, F> + Sync,
        explain: impl Fn(&F) -> String,
    ) -> Vec<T> {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 16);
        let next = AtomicU64::new(self.seeds.start);
        let failed = AtomicBool::new(false);
        let end = self.seeds.end;
        let mut results: Vec<(u64, Result<T, F>)> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut mine = Vec::new();
                        while !failed.load(Ordering::Relaxed) {
                            let seed = next.fetch_add(1, Ordering::Relaxed);
                            if seed >= end {
                                break;
                            }
                            let r = run(seed);
                            if r.is_err() {
                                failed.store(true, Ordering::Relaxed);
                            }
                            mine.push((seed, r));
                        }
                        mine
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        results.sort_by_key(|(seed, _)| *seed);
        results
            .into_iter()
            .map(|(_, r)| r.unwrap_or_else(|f| panic!("{}", explain(&f))))
            .collect()
    }
}

/// Runs each of `seeds` (regression seeds); the first failure panics with
/// `explain`'s account of it.
pub fn run_seeds<T, F>(
    seeds: impl IntoIterator<Item = u64>,
    mut run: impl FnMut(u64) -> Result<T, F>,
    explain: impl Fn(&F) -> String,
) -> Vec<T> {
    seeds
        .into_iter()
        .map(|seed| run(seed).unwrap_or_else(|f| panic!("{}", explain(&f))))
        .collect()
}

/// A numeric environment variable, if set and a number.
pub fn env_u64(var: &str) -> Option<u64> {
    std::env::var(var).ok().and_then(|s| s.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_failure_panics_with_its_explanation() {
        let ok = run_seeds([1, 2, 3], |s| Ok::<u64, String>(s * 2), |e| e.clone());
        assert_eq!(ok, vec![2, 4, 6]);
        let failed = std::panic::catch_unwind(|| {
            run_seeds(
                [1, 2, 3],
                |s| {
                    if s == 2 {
                        Err(format!("seed {s} failed"))
                    } else {
                        Ok(s)
                    }
                },
                |e| e.clone(),
            )
        });
        let message = failed.expect_err("seed 2 fails");
        assert_eq!(
            message.downcast_ref::<String>().map(String::as_str),
            Some("seed 2 failed")
        );
    }

    #[test]
    fn a_window_runs_on_threads_answers_in_seed_order_and_explains_its_lowest_failure() {
        let window = SeedWindow { seeds: 10..200 };
        let ok = window.run(Ok::<u64, String>, |e| e.clone());
        assert_eq!(ok, (10..200).collect::<Vec<_>>());
        let failed = std::panic::catch_unwind(|| {
            window.run(
                |s| {
                    if s == 40 || s == 41 {
                        Err(format!("seed {s} failed"))
                    } else {
                        Ok(s)
                    }
                },
                |e| e.clone(),
            )
        });
        let message = failed.expect_err("seeds 40 and 41 fail");
        assert_eq!(
            message.downcast_ref::<String>().map(String::as_str),
            Some("seed 40 failed")
        );
    }
}
