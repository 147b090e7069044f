//! The seams through which node code reaches the outside world.
//!
//! Protocol and storage code in ferry never opens files, sockets or clocks itself:
//! it is handed an implementation of the traits in this crate. Production wires the
//! real implementations ([`RealDisk`]); the deterministic simulator wires its own
//! (a disk that forgets un-synced writes on a crash, for example) and runs the very
//! same node code on one current-thread tokio runtime with a paused clock.
//!
//! Durations and timeouts are not a trait: node code uses `tokio::time`, which the
//! simulator pauses and advances. Absolute (Unix) time that other nodes see comes
//! from [`Clock`]; CPU-heavy work runs through [`Cpu`]; randomness is a seeded
//! generator passed in.

mod clock;
mod cpu;
mod disk;
mod net;
mod ops;
pub mod space;

pub use clock::{Clock, SharedClock, SystemClock};
pub use cpu::Cpu;
pub use disk::{parent_dir, Disk, DiskFile, Metadata, RealDisk};
pub use net::{BoxConnection, Connection, Listener, Network, TcpNetwork};
pub use ops::{is_being_removed, remove_tree, SequentialWriter, REMOVING_MARKER};
