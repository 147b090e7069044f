//! The WAL vocabulary every WAL participant shares.
//!
//! * [`Lsn`], [`Term`], [`TermHistory`]: positions in the WAL and the leadership
//!   epochs that wrote them;
//! * [`ClusterId`]: which cluster a safekeeper and a writer belong to;
//! * [`record`]: the self-checking record format, so a safekeeper can find the
//!   real end of its WAL after a crash;
//! * [`membership`]: which safekeepers form the quorum in a generation, and
//!   how a change of them goes through a joint configuration;
//! * [`segment`]: how WAL is cut into segment files and how they are named;
//! * [`proto`]: the messages between writer, safekeepers and replicas and their
//!   versioned, length-prefixed binary framing.
//!
//! Nothing here does I/O except the frame reader and writer, which work on any
//! `AsyncRead`/`AsyncWrite` (a TCP stream in production, an in-memory pipe in the
//! simulator).

mod cluster;
pub mod liveness;
mod lsn;
pub mod membership;
pub mod proto;
pub mod record;
pub mod segment;

pub use cluster::{ClusterId, InvalidClusterId};
pub use lsn::{Lsn, Term, TermHistory, TermLsn};
