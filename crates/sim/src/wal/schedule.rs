//! The WAL workload's events and how a seed draws them: the main schedule
//! from the seed's generator, then disk losses and crashes inside partial
//! uploads, each from a generator of its own, so that adding them left the
//! rest of every seed's schedule as it was (regression seeds keep their
//! meaning).

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::rogue::RogueKind;
use super::SAFEKEEPERS;
use crate::world::faults::{draw_events, Fault};
use crate::world::net::NetOptions;

/// One scheduled fault or action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A fault of the world: node `i < 3` is safekeeper `i`; in a partition,
    /// node 3 is the current writer (whose node a writer started later does
    /// not share).
    Fault(Fault),
    /// Append `records` inserts of about `bytes` bytes each, one after another.
    Write { records: u32, bytes: usize },
    /// Kill the writer and start a new one (which must win a new term).
    RestartWriter,
    /// Start a new writer while the old one keeps running (a failover that did
    /// not kill it): one of them ends up elected, a writer superseded after its
    /// election stops, and nothing acknowledged by either is lost.
    TakeOver,
    /// A misbehaving proposer sends a safekeeper what it must refuse.
    Rogue { safekeeper: usize, kind: RogueKind },
    /// Safekeeper `i`'s data dir is lost (it is killed first if it runs); it
    /// is rebuilt from the backup, perhaps after restores that crash half
    /// way, and started. At most one per run: a second loss before the
    /// first one's WAL is everywhere again could lose committed WAL in any
    /// quorum system of three.
    LoseDisk(usize),
    /// A loss inside a split, the case a restored safekeeper's lost votes
    /// matter in: the current writer is cut off from `b` and `lost`, a
    /// takeover's writer from `a` (so it is elected by `b` and `lost`, and
    /// commits on them), then `lost` loses its data dir and is restored, the
    /// old writer can reach it again, and a third writer that knows no
    /// commit starts, cut off from `b`. Neither may get a quorum with the
    /// restored safekeeper: the old one still reaches `a`, which never heard
    /// of the new term, and the third one would be elected by `a` and the
    /// restored one, which lack what the new writer committed.
    SplitLoss { lost: usize, a: usize, b: usize },
    /// A pull while a lagging replica catches up, the case a donor's
    /// removal hold exists for: the replica is cut from every safekeeper,
    /// `writes` inserts of [`PULL_WRITE_BYTES`] commit (more WAL than a
    /// connection buffers, so the donor reads what it copies as the puller
    /// takes it), safekeeper `lost` loses its data dir and is pulled from a
    /// peer with its disk stalled for `stall_ms` once the copy began, and the
    /// replica comes back `heal_ms` into the pull. Its feedback then lifts
    /// the peers' removal horizon over WAL the copy has not read yet: only
    /// the donor's hold at the copy's start keeps it (a pull that finds WAL
    /// it copies removed fails the run).
    PullDuringCatchUp {
        lost: usize,
        writes: u32,
        stall_ms: u64,
        heal_ms: u64,
    },
    /// Safekeeper `i` crashes at its next put or delete of one of its partial
    /// objects (within a few seconds): as the request starts (`applied`
    /// false) or right after it took effect, so that crashes land in every
    /// gap of the partial upload protocol; it restarts at once.
    CrashInPartialUpload { safekeeper: usize, applied: bool },
    /// Safekeeper `i`'s disk reports less free space than its minimum for
    /// `secs` seconds (its breaker refuses appends), then enough again.
    DiskNearlyFull { safekeeper: usize, secs: u64 },
    /// The end of a [`Event::DiskNearlyFull`].
    DiskSpaceBack(usize),
    /// Every writer is killed and none runs for `secs` seconds: safekeepers
    /// behind a peer of their term catch up from it (peer recovery); when
    /// nothing stands in the way (all up, no partition, no disk fault), the
    /// ones whose WAL is of the last term must end equal.
    Idle { secs: u64 },
}

/// A schedule: events at virtual times, plus the network settings.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub events: Vec<(Duration, Event)>,
    pub net: NetOptions,
}

/// Draws a schedule from a seed: 1 to 99 events, 0 to 500 ms apart, actions
/// chosen uniformly; delays up to 50 ms, and up to 2% of writes breaking a link.
pub fn generate_schedule(rng: &mut SmallRng) -> Schedule {
    let max_delay = rng.random_range(1..=50u64);
    let min_delay = rng.random_range(0..=max_delay);
    let break_prob = if rng.random_bool(0.5) {
        rng.random_range(0.0..0.02)
    } else {
        0.0
    };
    let net = NetOptions {
        min_delay: Duration::from_millis(min_delay),
        max_delay: Duration::from_millis(max_delay),
        break_prob,
        connect_fail_prob: break_prob * 5.0,
        connect_timeout: Duration::from_millis(500),
    };
    let count = rng.random_range(1..100usize);
    let events = draw_events(rng, count, 0..500, |rng| {
        match rng.random_range(0..8u32) {
            // Mostly small records; sometimes one larger than a segment
            // (64 KiB), which spans segments and makes a bulk fsync.
            0 | 1 if rng.random_bool(0.1) => Event::Write {
                records: 1,
                bytes: rng.random_range(20_000..200_000),
            },
            0 | 1 => Event::Write {
                records: rng.random_range(1..10),
                bytes: rng.random_range(16..4000),
            },
            2 => Event::Fault(Fault::Crash(rng.random_range(0..SAFEKEEPERS))),
            3 => Event::Fault(Fault::Restart(rng.random_range(0..SAFEKEEPERS))),
            4 if rng.random_bool(0.3) => Event::TakeOver,
            4 => Event::RestartWriter,
            5 => {
                if rng.random_bool(0.5) {
                    let a = rng.random_range(0..=SAFEKEEPERS);
                    let b = (a + rng.random_range(1..=SAFEKEEPERS)) % (SAFEKEEPERS + 1);
                    Event::Fault(Fault::Partition(a, b))
                } else {
                    Event::Fault(Fault::RepairPartitions)
                }
            }
            6 if rng.random_bool(0.2) => {
                Event::Fault(Fault::DiskFailure(rng.random_range(0..SAFEKEEPERS)))
            }
            7 => Event::Rogue {
                safekeeper: rng.random_range(0..SAFEKEEPERS),
                kind: RogueKind::ALL[rng.random_range(0..RogueKind::ALL.len())],
            },
            _ => Event::Fault(Fault::DiskStall {
                node: rng.random_range(0..SAFEKEEPERS),
                millis: rng.random_range(1..2000),
            }),
        }
    });
    Schedule { events, net }
}

/// The size of each insert of an [`Event::PullDuringCatchUp`].
pub const PULL_WRITE_BYTES: usize = 200_000;

/// Adds one [`Event::LoseDisk`] to half of the schedules, drawn from its own
/// generator so that the rest of every schedule stays what the seed made
/// before disk losses existed (regression seeds keep their meaning).
pub fn add_disk_loss(schedule: &mut Schedule, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x1055_D15C_0000_0000);
    let Some(&(last, _)) = schedule.events.last() else {
        return;
    };
    if !rng.random_bool(0.5) {
        return;
    }
    let at = Duration::from_millis(rng.random_range(0..=last.as_millis() as u64));
    let lost = rng.random_range(0..SAFEKEEPERS);
    let mut added = vec![(at, Event::LoseDisk(lost))];
    if rng.random_bool(0.4) {
        let a = (lost + rng.random_range(1..SAFEKEEPERS)) % SAFEKEEPERS;
        let b = (0..SAFEKEEPERS).find(|&k| k != lost && k != a).unwrap_or(a);
        added = vec![(at, Event::SplitLoss { lost, a, b })];
    }
    for (at, event) in added {
        let index = schedule.events.partition_point(|(t, _)| *t <= at);
        schedule.events.insert(index, (at, event));
    }
}

/// Adds up to three [`Event::CrashInPartialUpload`] to a schedule, drawn from
/// a generator of their own (as [`add_disk_loss`]).
pub fn add_partial_crashes(schedule: &mut Schedule, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x9A27_1A1C_0000_0000);
    let Some(&(last, _)) = schedule.events.last() else {
        return;
    };
    for _ in 0..rng.random_range(0..=3) {
        let at = Duration::from_millis(rng.random_range(0..=last.as_millis() as u64));
        let event = Event::CrashInPartialUpload {
            safekeeper: rng.random_range(0..SAFEKEEPERS),
            applied: rng.random_bool(0.5),
        };
        let index = schedule.events.partition_point(|(t, _)| *t <= at);
        schedule.events.insert(index, (at, event));
    }
}

/// Adds to a third of the schedules one or two periods of a safekeeper's
/// disk nearly full ([`Event::DiskNearlyFull`]), drawn from a generator of
/// their own (as [`add_disk_loss`]).
pub fn add_disk_full(schedule: &mut Schedule, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0xD15C_F011_0000_0000);
    let Some(&(last, _)) = schedule.events.last() else {
        return;
    };
    if !rng.random_bool(1.0 / 3.0) {
        return;
    }
    for _ in 0..rng.random_range(1..=2) {
        let at = Duration::from_millis(rng.random_range(0..=last.as_millis() as u64));
        let safekeeper = rng.random_range(0..SAFEKEEPERS);
        let secs = rng.random_range(1..=8);
        for (at, event) in [
            (at, Event::DiskNearlyFull { safekeeper, secs }),
            (
                at + Duration::from_secs(secs),
                Event::DiskSpaceBack(safekeeper),
            ),
        ] {
            let index = schedule.events.partition_point(|(t, _)| *t <= at);
            schedule.events.insert(index, (at, event));
        }
    }
}

/// Adds to a third of the schedules one period without a writer
/// ([`Event::Idle`]), drawn from a generator of its own (as
/// [`add_disk_loss`]).
pub fn add_idle_periods(schedule: &mut Schedule, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x1D1E_0000_0000_0000);
    let Some(&(last, _)) = schedule.events.last() else {
        return;
    };
    if !rng.random_bool(1.0 / 3.0) {
        return;
    }
    let at = Duration::from_millis(rng.random_range(0..=last.as_millis() as u64));
    let event = Event::Idle {
        secs: rng.random_range(6..=12),
    };
    let index = schedule.events.partition_point(|(t, _)| *t <= at);
    schedule.events.insert(index, (at, event));
}

/// Adds one [`Event::PullDuringCatchUp`] to a third of the schedules that
/// lose no disk otherwise (one loss per run), from a generator of its own.
/// Not in runs whose writers read in reads of a few KiB: catching a
/// safekeeper up over its megabytes then takes longer than the liveness
/// bound allows (hundreds of round trips), which is no fault of anyone's.
pub fn add_pull_during_catch_up(schedule: &mut Schedule, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x9011_CA7C_0000_0000);
    let Some(&(last, _)) = schedule.events.last() else {
        return;
    };
    if super::small_recovery_reads(seed) {
        return;
    }
    let loses = schedule
        .events
        .iter()
        .any(|(_, e)| matches!(e, Event::LoseDisk(_) | Event::SplitLoss { .. }));
    if loses || !rng.random_bool(1.0 / 3.0) {
        return;
    }
    let at = Duration::from_millis(rng.random_range(0..=last.as_millis() as u64));
    let event = Event::PullDuringCatchUp {
        lost: rng.random_range(0..SAFEKEEPERS),
        writes: rng.random_range(8..=16),
        stall_ms: rng.random_range(3000..=8000),
        heal_ms: rng.random_range(100..=2500),
    };
    let index = schedule.events.partition_point(|(t, _)| *t <= at);
    schedule.events.insert(index, (at, event));
}
