//! The seams through which node code reaches the outside world.
//!
//! Protocol and storage code in ferry never opens files, sockets or clocks itself:
//! it is handed an implementation of the traits in this crate. Production wires the
//! real implementations ([`RealDisk`]); the deterministic simulator wires its own
//! (a disk that forgets un-synced writes on a crash, for example) and runs the very
//! same node code on one current-thread tokio runtime with a paused clock.
//!
//! Time is the one seam that is not a trait: node code uses `tokio::time`, which the
//! simulator pauses and advances. Wall-clock timestamps and randomness get their
//! own traits here when the first code that needs them arrives.

mod disk;
mod net;

pub use disk::{Disk, DiskFile, RealDisk};
pub use net::{BoxConnection, Connection, Listener, Network, TcpNetwork};
