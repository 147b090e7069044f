//! The writer: the proposer side of the WAL quorum.
//!
//! [`proposer::Proposer`] is a pure state machine (sans-IO): it is fed connection
//! events and safekeeper messages and answers with [`proposer::Action`]s (messages
//! to send, commit progress, loss of leadership). Drivers (TCP in production, the
//! simulator's network in tests) move the bytes; the protocol is the same.

pub mod buffer;
pub mod driver;
pub mod proposer;
