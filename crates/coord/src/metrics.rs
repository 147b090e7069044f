//! Counters of coordination traffic, so that protocols built on top can measure
//! (and benchmarks can report) how many round trips and operations they cost.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// The kinds of request a session sends; each is one round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    Create,
    Get,
    Exists,
    Set,
    Delete,
    Children,
    Multi,
}

impl RequestKind {
    /// Every kind, in a fixed order.
    pub const ALL: [RequestKind; 7] = [
        RequestKind::Create,
        RequestKind::Get,
        RequestKind::Exists,
        RequestKind::Set,
        RequestKind::Delete,
        RequestKind::Children,
        RequestKind::Multi,
    ];

    /// A lowercase name for metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            RequestKind::Create => "create",
            RequestKind::Get => "get",
            RequestKind::Exists => "exists",
            RequestKind::Set => "set",
            RequestKind::Delete => "delete",
            RequestKind::Children => "children",
            RequestKind::Multi => "multi",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Live counters of one session (or several sessions sharing them).
#[derive(Debug, Default)]
pub struct CoordMetrics {
    round_trips: [AtomicU64; 7],
    errors: [AtomicU64; 7],
    multi_ops: AtomicU64,
    watches_fired: AtomicU64,
}

impl CoordMetrics {
    /// Counts one request of `kind` carrying `ops` operations (1 unless a multi).
    pub fn record(&self, kind: RequestKind, ops: usize, failed: bool) {
        self.round_trips[kind.index()].fetch_add(1, Ordering::Relaxed);
        if failed {
            self.errors[kind.index()].fetch_add(1, Ordering::Relaxed);
        }
        if kind == RequestKind::Multi {
            self.multi_ops.fetch_add(ops as u64, Ordering::Relaxed);
        }
    }

    /// Counts a fired watch.
    pub fn record_watch_fired(&self) {
        self.watches_fired.fetch_add(1, Ordering::Relaxed);
    }

    /// A consistent-enough copy of the counters for reporting.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            round_trips: RequestKind::ALL
                .iter()
                .map(|k| (k.name(), load(&self.round_trips[k.index()])))
                .collect(),
            errors: RequestKind::ALL
                .iter()
                .map(|k| (k.name(), load(&self.errors[k.index()])))
                .collect(),
            multi_ops: load(&self.multi_ops),
            watches_fired: load(&self.watches_fired),
        }
    }
}

/// A copy of [`CoordMetrics`] at one instant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MetricsSnapshot {
    /// Requests sent per kind (each one round trip).
    pub round_trips: Vec<(&'static str, u64)>,
    /// Requests per kind that returned an error.
    pub errors: Vec<(&'static str, u64)>,
    /// Operations carried inside multi requests.
    pub multi_ops: u64,
    /// Watches that fired.
    pub watches_fired: u64,
}

impl MetricsSnapshot {
    /// Round trips of all kinds.
    pub fn total_round_trips(&self) -> u64 {
        self.round_trips.iter().map(|(_, n)| n).sum()
    }

    /// Round trips of one kind.
    pub fn round_trips_of(&self, kind: RequestKind) -> u64 {
        self.round_trips
            .iter()
            .find(|(name, _)| *name == kind.name())
            .map_or(0, |(_, n)| *n)
    }
}
