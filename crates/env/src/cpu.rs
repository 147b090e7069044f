//! The CPU seam: where CPU-heavy work runs (Arrow decoding, Parquet encoding,
//! merges, checksums of large files). In production it goes to tokio's blocking
//! pool, so that it never stalls the node's event loop; under the simulator it
//! runs inline, so that it takes no real time and the run stays deterministic.

/// Where CPU-heavy closures run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Cpu {
    /// tokio's blocking pool (production).
    #[default]
    BlockingPool,
    /// On the calling task, at once (the simulator: deterministic).
    Inline,
}

impl Cpu {
    /// Runs `work` and returns its result. A panic in `work` is passed on to
    /// the caller, as if the work had run in place.
    pub async fn run<R, F>(&self, work: F) -> R
    where
        R: Send + 'static,
        F: FnOnce() -> R + Send + 'static,
    {
        match self {
            Cpu::Inline => work(),
            Cpu::BlockingPool => match tokio::task::spawn_blocking(work).await {
                Ok(result) => result,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                // The runtime is shutting down: the work never ran and its
                // caller is being torn down with it.
                Err(e) => panic!("CPU work cancelled by runtime shutdown: {e}"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn both_modes_run_the_work() {
        for cpu in [Cpu::BlockingPool, Cpu::Inline] {
            assert_eq!(cpu.run(|| (1..=10u64).sum::<u64>()).await, 55);
        }
    }

    #[tokio::test]
    async fn inline_work_runs_on_the_calling_thread() {
        let me = std::thread::current().id();
        assert_eq!(
            Cpu::Inline.run(move || std::thread::current().id()).await,
            me
        );
    }

    #[tokio::test]
    #[should_panic(expected = "boom")]
    async fn a_panic_reaches_the_caller() {
        Cpu::BlockingPool.run(|| panic!("boom")).await
    }
}
