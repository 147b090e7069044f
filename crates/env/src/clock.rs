//! The wall clock: Unix time for every value that is stored or compared across
//! nodes (feedback reply times, part and task create times, TTLs, exception
//! times). Durations and timeouts use `tokio::time`, which the simulator pauses;
//! this seam is for the absolute time that other nodes see.

use std::fmt;
use std::sync::Arc;

/// A source of Unix time.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Microseconds since the Unix epoch.
    fn unix_micros(&self) -> u64;

    /// Whole seconds since the Unix epoch.
    fn unix_seconds(&self) -> u64 {
        self.unix_micros() / 1_000_000
    }
}

/// A shared clock, as node code holds it.
pub type SharedClock = Arc<dyn Clock>;

/// The operating system's clock. A clock set before 1970 reads as 0.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn unix_micros(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_is_after_2020_and_moves_forward() {
        let c = SystemClock;
        let a = c.unix_micros();
        assert!(a > 1_577_836_800_000_000, "{a}");
        assert!(c.unix_micros() >= a);
        assert_eq!(c.unix_seconds(), c.unix_micros() / 1_000_000);
    }
}
