//! The export workload's events and how a seed draws them.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::Rng;

use super::{DESTINATIONS, NODES, PARTITIONS};
use crate::world::faults::draw_events;

#[derive(Debug, Clone)]
pub(super) enum Event {
    Insert(usize),
    Export {
        node: usize,
        partition: usize,
        destination: usize,
        force: bool,
    },
    Kill {
        node: usize,
        pick: usize,
    },
    Crash(usize),
    ExpireSession(usize),
    PartitionCoord(usize),
    Repair,
}

pub(super) fn generate(rng: &mut SmallRng) -> Vec<(Duration, Event)> {
    let n = rng.random_range(30..70);
    draw_events(rng, n, 5..400, |rng| match rng.random_range(0..100) {
        0..=39 => Event::Insert(rng.random_range(1..30)),
        40..=61 => Event::Export {
            node: rng.random_range(0..NODES),
            partition: rng.random_range(0..PARTITIONS.len()),
            destination: rng.random_range(0..DESTINATIONS.len()),
            force: rng.random_bool(0.4),
        },
        62..=69 => Event::Kill {
            node: rng.random_range(0..NODES),
            pick: rng.random_range(0..1000),
        },
        70..=81 => Event::Crash(rng.random_range(0..NODES)),
        82..=89 => Event::ExpireSession(rng.random_range(0..NODES)),
        90..=95 => Event::PartitionCoord(rng.random_range(0..NODES)),
        _ => Event::Repair,
    })
}
