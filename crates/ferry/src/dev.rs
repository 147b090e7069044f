//! `ferry dev`: the whole system in one process on embedded defaults.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry_coord::embedded::{EmbeddedOptions, EmbeddedStore};
use ferry_coord::Coordination;
use ferry_env::RealDisk;
use ferry_safekeeper::wal_storage::Preallocation;

#[derive(Debug, clap::Args)]
pub struct DevArgs {
    /// Data directory (coordination store, WAL, object storage); created if missing.
    #[arg(long, env = "FERRY_DATA_DIR", default_value_os_t = crate::default_data_dir())]
    data_dir: PathBuf,
    /// HTTP status endpoint (`GET /status`).
    #[arg(long, default_value = "127.0.0.1:7878")]
    http: String,
    /// Number of safekeepers.
    #[arg(long, default_value_t = 3)]
    safekeepers: usize,
    /// WAL segment size in bytes (a power of two, 64 KiB to 1 GiB).
    #[arg(long, default_value_t = ferry_wal::segment::DEFAULT_SEGMENT_BYTES)]
    segment_bytes: u64,
    /// When WAL segments are zero-filled ahead of time: auto (while commits are
    /// small), always or never.
    #[arg(long, default_value_t = Preallocation::Auto)]
    wal_preallocation: Preallocation,
}

/// Coordination path under which ferry keeps its state.
pub const ROOT: &str = "/ferry";

/// Waits for Ctrl-C (SIGINT) or SIGTERM.
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

fn absolute(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    dir.canonicalize()
        .with_context(|| format!("resolving {}", dir.display()))
}

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let mut shutdown = ShutdownSignal::install()?;
    let data_dir = absolute(&args.data_dir)?;
    let _lock = crate::lockfile::lock_data_dir(&data_dir)?;
    let disk = Arc::new(RealDisk::open_root(&data_dir).context("opening the data dir")?);
    let store = EmbeddedStore::open(disk, "coord", EmbeddedOptions::default())
        .await
        .context("opening the embedded coordination store")?;
    let session = store
        .session(Duration::from_secs(10))
        .await
        .context("opening a coordination session")?;
    ferry_coord::create_all(&session, ROOT)
        .await
        .context("creating the coordination root")?;

    let lake_url = format!("file://{}", data_dir.join("lake").display());
    let lake = ferry_storage::open(&lake_url, &ferry_storage::S3Settings::default())
        .context("opening the object storage")?;

    anyhow::ensure!(args.safekeepers >= 1, "at least one safekeeper is needed");
    let segment = ferry_wal::segment::SegmentSize::new(args.segment_bytes)?;
    let quorum = Arc::new(
        crate::local::LocalQuorum::start(
            &data_dir.join("wal"),
            args.safekeepers,
            segment,
            args.wal_preallocation,
        )
        .await
        .context("starting the WAL quorum")?,
    );
    let mut writer_status = quorum.writer.subscribe();
    tokio::time::timeout(
        Duration::from_secs(30),
        writer_status.wait_for(|s| s.elected),
    )
    .await
    .context("the writer was not elected in 30 s")?
    .context("writer stopped")?;
    let status_quorum = Arc::clone(&quorum);
    let (http, http_task) = crate::http::serve_status(&args.http, move || {
        let q = Arc::clone(&status_quorum);
        async move {
            serde_json::json!({
                "writer": q.writer.status(),
                "safekeepers": q.safekeeper_status().await,
            })
        }
    })
    .await?;

    say!(
        "ferry dev ready: data dir {}, coordination store {}, object storage {}, {} safekeepers ({}), writer term {}, status on http://{http}/status",
        data_dir.display(),
        data_dir.join("coord").display(),
        lake.url,
        args.safekeepers,
        quorum.safekeepers.iter().map(|s| s.addr().to_string()).collect::<Vec<_>>().join(", "),
        quorum.writer.status().term,
    );
    say!("replicas, partition export and the insert API are not implemented yet; press Ctrl-C to stop");

    let why = shutdown.recv().await;
    tracing::info!(signal = why, "stopping");
    http_task.abort();
    let _ = http_task.await;
    let quorum = Arc::into_inner(quorum).context("status endpoint still holds the quorum")?;
    let end = quorum.shutdown().await?;
    session.close().await;
    store.shutdown().await;
    say!("ferry dev stopped cleanly; shutdown checkpoint committed at {end}");
    Ok(())
}
