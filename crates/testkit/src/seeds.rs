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

    /// Runs every seed of the window; the first failure panics with
    /// `explain`'s account of it (which says how to replay it).
    pub fn run<T, F>(
        &self,
        run: impl FnMut(u64) -> Result<T, F>,
        explain: impl Fn(&F) -> String,
    ) -> Vec<T> {
        run_seeds(self.seeds.clone(), run, explain)
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
}
