//! `ferry dev`: the whole system in one process on embedded defaults.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry_coord::embedded::{EmbeddedOptions, EmbeddedStore};
use ferry_coord::Coordination;
use ferry_env::RealDisk;

#[derive(Debug, clap::Args)]
pub struct DevArgs {
    /// Data directory (coordination store, object storage); created if missing.
    #[arg(long, env = "FERRY_DATA_DIR", default_value_os_t = crate::default_data_dir())]
    data_dir: PathBuf,
}

/// Coordination path under which ferry keeps its state.
pub const ROOT: &str = "/ferry";

async fn shutdown_signal() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => { r.context("waiting for Ctrl-C")?; Ok("interrupt") }
        _ = term.recv() => Ok("terminate"),
    }
}

fn absolute(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    dir.canonicalize()
        .with_context(|| format!("resolving {}", dir.display()))
}

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let data_dir = absolute(&args.data_dir)?;
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

    println!(
        "ferry dev ready: data dir {}, coordination store {}, object storage {}",
        data_dir.display(),
        data_dir.join("coord").display(),
        lake.url
    );
    println!("WAL quorum, replicas and export are not implemented yet; press Ctrl-C to stop");

    let why = shutdown_signal().await?;
    tracing::info!(signal = why, "stopping");
    session.close().await;
    store.shutdown().await;
    println!("ferry dev stopped cleanly");
    Ok(())
}
