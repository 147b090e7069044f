//! The disk-full breaker: a node stops taking new work before its disk
//! fills, and takes it again by itself once space returns.
//!
//! A full disk fails writes in the middle (a WAL segment half written, a
//! part without its footer) and leaves no room for the writes that clean
//! up. So each node watches the free space of its data dir's file system
//! ([`Disk::free_bytes`]) and refuses new work (appends on a safekeeper,
//! WAL to apply on a replica, inserts at the API) while less than its
//! `min_free` is left, with a clear error naming the node and the figures.
//! Work in progress finishes: the margin is there for it. The breaker
//! closes again once the free space is `min_free` plus a hysteresis
//! ([`SpaceBreaker::resume_at`]), so it does not flap at the threshold.
//!
//! [`SpaceBreaker`] holds the rule (time and the disk are inputs:
//! [`SpaceBreaker::observe`]); [`watch_free_space`] is the driver that feeds
//! it, on tokio's clock (the simulator's paused one in simulation).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::Disk;

/// How often [`watch_free_space`] looks at the free space.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// Why a node refuses new work: too little free space.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("disk_full: {node} has {free} bytes free on its data dir's file system, below its minimum of {min_free}; new work is refused until {resume_at} bytes are free")]
pub struct DiskFull {
    pub node: String,
    pub free: u64,
    pub min_free: u64,
    pub resume_at: u64,
}

/// The breaker of one node (see the module documentation). Cheap to
/// clone; clones share the state.
#[derive(Debug, Clone)]
pub struct SpaceBreaker {
    node: Arc<str>,
    min_free: u64,
    state: Arc<watch::Sender<Option<DiskFull>>>,
}

impl SpaceBreaker {
    /// A breaker for `node` (named in errors) that opens below `min_free`
    /// bytes free. It starts closed.
    pub fn new(node: impl Into<String>, min_free: u64) -> SpaceBreaker {
        SpaceBreaker {
            node: Arc::from(node.into()),
            min_free,
            state: Arc::new(watch::Sender::new(None)),
        }
    }

    pub fn min_free(&self) -> u64 {
        self.min_free
    }

    /// The free space at which an open breaker closes again: `min_free`
    /// and an eighth more (at least 1 MiB more).
    pub fn resume_at(&self) -> u64 {
        self.min_free
            .saturating_add((self.min_free / 8).max(1 << 20))
    }

    /// Takes one look at the free space (`None`: unknown, which changes
    /// nothing). Returns whether the breaker changed.
    pub fn observe(&self, free: Option<u64>) -> bool {
        let Some(free) = free else {
            return false;
        };
        let open = self.state.borrow().is_some();
        let next = if free < self.min_free || (open && free < self.resume_at()) {
            Some(DiskFull {
                node: self.node.to_string(),
                free,
                min_free: self.min_free,
                resume_at: self.resume_at(),
            })
        } else {
            None
        };
        let changed = next.is_some() != open;
        if changed {
            match &next {
                Some(full) => tracing::error!(error = %full, "disk nearly full: refusing new work"),
                None => tracing::info!(
                    node = %self.node,
                    free,
                    "disk space is back: taking new work again"
                ),
            }
        }
        self.state.send_replace(next);
        changed
    }

    /// `Err` while the breaker is open: the work must be refused.
    pub fn check(&self) -> Result<(), DiskFull> {
        match &*self.state.borrow() {
            Some(full) => Err(full.clone()),
            None => Ok(()),
        }
    }

    /// Follows the breaker (`Some` while open).
    pub fn subscribe(&self) -> watch::Receiver<Option<DiskFull>> {
        self.state.subscribe()
    }

    /// Waits until the breaker is closed.
    pub async fn wait_closed(&self) {
        let mut rx = self.subscribe();
        // The sender lives in `self`: the wait ends only when it closes.
        let _ = rx.wait_for(Option::is_none).await;
    }
}

/// Feeds `breaker` from `disk` every [`PROBE_INTERVAL`], forever (abort the
/// task to stop it). A failed look changes nothing and is logged.
pub async fn watch_free_space(disk: Arc<dyn Disk>, breaker: SpaceBreaker) {
    loop {
        match disk.free_bytes().await {
            Ok(free) => {
                breaker.observe(free);
            }
            Err(e) => tracing::warn!(error = %e, "could not read the free disk space"),
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_below_the_minimum_and_closes_past_the_hysteresis() {
        let b = SpaceBreaker::new("sk0", 100 << 20);
        assert!(b.check().is_ok(), "closed at first");
        assert!(!b.observe(None), "unknown changes nothing");
        assert!(!b.observe(Some(200 << 20)));
        assert!(b.observe(Some(99 << 20)));
        let e = b.check().expect_err("open");
        assert!(e.to_string().starts_with("disk_full: sk0 has"), "{e}");
        assert_eq!(e.min_free, 100 << 20);
        // Between the minimum and the resume point it stays open.
        assert!(!b.observe(Some(101 << 20)));
        assert!(b.check().is_err());
        assert_eq!(b.resume_at(), (100 << 20) + (100 << 20) / 8);
        assert!(b.observe(Some(b.resume_at())));
        assert!(b.check().is_ok());
        // Closed, a look above the minimum keeps it closed.
        assert!(!b.observe(Some(101 << 20)));
    }

    #[test]
    fn a_zero_minimum_never_opens() {
        let b = SpaceBreaker::new("n", 0);
        assert!(!b.observe(Some(0)));
        assert!(b.check().is_ok());
    }
}
