//! Faults any workload can schedule against its nodes, named by their index
//! in the workload's list of nodes (the workload maps an index to a node of
//! the world), and the timeline every schedule draws its events on. A
//! workload's schedule mixes these faults with actions of its own.

use std::ops::Range;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::Rng;

/// A fault of the world, against a workload's nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Power-cut a node (unsynced writes lost, the last ones maybe torn); it
    /// stays down until restarted.
    Crash(usize),
    /// Power-cut a node and start it again from its disk.
    Restart(usize),
    /// Cut the network between two nodes.
    Partition(usize, usize),
    RepairPartitions,
    /// Every sync of a node's disk fails from now on, and a failed fsync loses
    /// the unsynced writes: the node must stop without answering from what it
    /// could not persist. The disk is repaired when the node restarts.
    DiskFailure(usize),
    /// A node's disk stops answering for this many milliseconds.
    DiskStall {
        node: usize,
        millis: u64,
    },
}

/// A schedule of `count` events, one after another, as every workload draws
/// it from its seed's generator `rng`: for each event, first the gap since
/// the one before (`gap_millis`), then the event itself (`event`). The order
/// of the draws is what a seed's schedule is made of: changing it changes
/// every seed's run.
pub fn draw_events<E>(
    rng: &mut SmallRng,
    count: usize,
    gap_millis: Range<u64>,
    mut event: impl FnMut(&mut SmallRng) -> E,
) -> Vec<(Duration, E)> {
    let mut at = Duration::ZERO;
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        at += Duration::from_millis(rng.random_range(gap_millis.clone()));
        events.push((at, event(rng)));
    }
    events
}
