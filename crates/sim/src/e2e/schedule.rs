//! The end-to-end workload's events and how a seed draws them.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{replicas, PARTITIONS, SAFEKEEPERS};
use crate::world::faults::draw_events;

#[derive(Debug, Clone)]
pub(super) enum Event {
    /// A new insert of this many rows, with a key of its own.
    Insert(usize),
    /// An acknowledged insert sent again with its key (a client retry).
    Retry,
    /// An acknowledged insert's key sent with other rows.
    ReuseKey(usize),
    CrashReplica(usize),
    /// Power-cut a safekeeper, or start it again if it is down.
    CrashSafekeeper(usize),
    /// The current writer process dies; its supervisor starts another.
    KillWriter,
    /// A new writer takes over while the current one still runs.
    TakeOver,
    /// Cut a replica from a safekeeper, or the writer from one.
    PartitionReplica(usize, usize),
    PartitionWriter(usize),
    /// Cut a replica from the other replica of another shard (its peer for
    /// shard snapshots).
    PartitionPeers(usize, usize),
    /// Cut a replica (`< replicas()`) or the writer from coordination.
    PartitionCoord(usize),
    /// Expire every coordination session of a replica (or the writer).
    ExpireSessions(usize),
    /// An export of a partition through a replica's export API.
    Export {
        replica: usize,
        partition: &'static str,
        force: bool,
    },
    /// A kill of a partition's export through a replica's export API.
    Kill {
        replica: usize,
        partition: &'static str,
    },
    Repair,
    /// A safekeeper loses its data dir and is restored from the backup
    /// (`ferry safekeeper --restore-from-backup`).
    LoseSafekeeper(usize),
    /// A replica loses its data dir and is built from a copy of its
    /// shard's other replica (`ferry replica --bootstrap-from`).
    RebuildReplica(usize),
}

pub(super) fn generate(rng: &mut SmallRng) -> Vec<(Duration, Event)> {
    let n = rng.random_range(30..70);
    let r = replicas();
    draw_events(rng, n, 5..400, |rng| match rng.random_range(0..100) {
        0..=44 => Event::Insert(rng.random_range(1..30)),
        45..=49 => Event::Retry,
        50..=52 => Event::ReuseKey(rng.random_range(1..10)),
        53..=60 => Event::CrashReplica(rng.random_range(0..r)),
        61..=66 => Event::CrashSafekeeper(rng.random_range(0..SAFEKEEPERS)),
        67..=68 => Event::KillWriter,
        69..=70 => Event::TakeOver,
        71..=73 => {
            Event::PartitionReplica(rng.random_range(0..r), rng.random_range(0..SAFEKEEPERS))
        }
        74..=75 => Event::PartitionWriter(rng.random_range(0..SAFEKEEPERS)),
        76..=77 => Event::PartitionPeers(rng.random_range(0..r), rng.random_range(0..r)),
        78..=79 => Event::PartitionCoord(rng.random_range(0..=r)),
        80..=82 => Event::ExpireSessions(rng.random_range(0..=r)),
        83..=89 => Event::Export {
            replica: rng.random_range(0..r),
            partition: PARTITIONS[rng.random_range(0..PARTITIONS.len())],
            force: rng.random_bool(0.5),
        },
        90..=92 => Event::Kill {
            replica: rng.random_range(0..r),
            partition: PARTITIONS[rng.random_range(0..PARTITIONS.len())],
        },
        _ => Event::Repair,
    })
}

/// Data dirs lost during the run, drawn from the seed alone (apart from
/// [`generate`], so that the seeds drawn before losses existed keep their
/// schedules): a safekeeper restored from the backup in a third of the
/// runs, a replica rebuilt from its peer in a third, each at a time within
/// `span`.
pub(super) fn generate_losses(seed: u64, span: Duration) -> Vec<(Duration, Event)> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x4c05_7d15_c0de_0001);
    let mut losses = Vec::new();
    let span_ms = span.as_millis().max(1) as u64;
    if rng.random_bool(1.0 / 3.0) {
        let at = Duration::from_millis(rng.random_range(0..span_ms));
        losses.push((at, Event::LoseSafekeeper(rng.random_range(0..SAFEKEEPERS))));
    }
    if rng.random_bool(1.0 / 3.0) {
        let at = Duration::from_millis(rng.random_range(0..span_ms));
        losses.push((at, Event::RebuildReplica(rng.random_range(0..replicas()))));
    }
    losses
}
