//! Faults any workload can schedule against its nodes, named by their index
//! in the workload's list of nodes (the workload maps an index to a node of
//! the world). A workload's schedule mixes these with actions of its own.

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
