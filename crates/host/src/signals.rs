//! How a process learns it should stop cleanly.

use anyhow::Context as _;

/// SIGINT (Ctrl-C) and SIGTERM, caught from the moment this is made: made at
/// start-up, before a process says it is ready, so that a signal sent right
/// after that line always means a clean stop (not the default: death).
pub struct ShutdownSignal {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    pub fn install() -> anyhow::Result<ShutdownSignal> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(ShutdownSignal {
            interrupt: signal(SignalKind::interrupt()).context("installing a SIGINT handler")?,
            terminate: signal(SignalKind::terminate()).context("installing a SIGTERM handler")?,
        })
    }

    /// Waits for either signal; says which.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "interrupt",
            _ = self.terminate.recv() => "terminate",
        }
    }
}
