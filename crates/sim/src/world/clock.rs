//! Virtual wall-clock time: a seeded Unix time at the start of the run plus the
//! paused tokio clock's progress, so timestamps are the same in every replay
//! of a seed, and never go back.

use ferry_env::Clock;
use tokio::time::Instant;

/// The simulator's [`Clock`].
#[derive(Debug, Clone)]
pub struct SimClock {
    base_micros: u64,
    start: Instant,
}

impl SimClock {
    /// A clock that reads `base_micros` now (on the current runtime's clock).
    pub fn new(base_micros: u64) -> SimClock {
        SimClock {
            base_micros,
            start: Instant::now(),
        }
    }

    /// A plausible start time drawn from a seed: some moment in 2020-2035.
    pub fn seeded(rng: &mut impl rand::Rng) -> SimClock {
        const Y2020: u64 = 1_577_836_800_000_000;
        const FIFTEEN_YEARS: u64 = 15 * 365 * 86_400 * 1_000_000;
        SimClock::new(Y2020 + rng.random_range(0..FIFTEEN_YEARS))
    }
}

impl Clock for SimClock {
    fn unix_micros(&self) -> u64 {
        let elapsed = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.base_micros.saturating_add(elapsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[tokio::test(start_paused = true)]
    async fn follows_virtual_time_from_a_seeded_start() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let a = SimClock::seeded(&mut rng);
        let b = SimClock::seeded(&mut rand::rngs::SmallRng::seed_from_u64(7));
        assert_eq!(a.unix_micros(), b.unix_micros(), "same seed, same time");
        let t0 = a.unix_micros();
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
        assert_eq!(a.unix_micros() - t0, 3_000_000);
    }
}
