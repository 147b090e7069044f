//! The roles of a distributed deployment: one process per safekeeper, one writer.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use ferry_env::{Network, TcpNetwork};
use ferry_safekeeper::wal_storage::Preallocation;
use ferry_wal::segment::{SegmentSize, DEFAULT_SEGMENT_BYTES};
use ferry_wal::ClusterId;
use ferry_writer::driver::{Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;

use crate::local::{start_safekeeper, SafekeeperSpec, TIMELINE_ID};

#[derive(Debug, clap::Args)]
pub struct SafekeeperArgs {
    /// Id of this safekeeper (unique in the quorum).
    #[arg(long)]
    id: u64,
    /// The cluster this safekeeper belongs to (1 to 64 of A-Z, a-z, 0-9, '-',
    /// '_'); recorded when it is created and checked at every start.
    #[arg(long, env = "FERRY_CLUSTER_ID")]
    cluster_id: ClusterId,
    /// Create the safekeeper if its data dir holds none. Only for a new cluster
    /// or member: a safekeeper whose data was lost must not come back empty
    /// (it could make the quorum forget committed WAL), so without this flag a
    /// missing safekeeper is an error.
    #[arg(long)]
    create: bool,
    /// Address writers and replicas connect to.
    #[arg(long, default_value = "127.0.0.1:5454")]
    listen: String,
    /// Data directory (the safekeeper lives in `<data dir>/sk<id>`). Default:
    /// $FERRY_DATA_DIR.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// WAL segment size in bytes (a power of two, 64 KiB to 1 GiB); must be the
    /// same on every safekeeper and the writer.
    #[arg(long, default_value_t = DEFAULT_SEGMENT_BYTES)]
    segment_bytes: u64,
    /// When WAL segments are zero-filled ahead of time: auto (while commits are
    /// small, so that an fsync flushes data only), always or never (for
    /// copy-on-write file systems, where it does not help).
    #[arg(long, default_value_t = Preallocation::Auto)]
    wal_preallocation: Preallocation,
    /// HTTP status endpoint.
    #[arg(long, default_value = "127.0.0.1:7676")]
    http: String,
}

#[derive(Debug, clap::Args)]
pub struct WriterArgs {
    /// The cluster whose safekeepers this writer writes to (they refuse others).
    #[arg(long, env = "FERRY_CLUSTER_ID")]
    cluster_id: ClusterId,
    /// Safekeeper addresses, comma-separated, in the same order for every writer.
    #[arg(long, value_delimiter = ',', required = true)]
    safekeepers: Vec<String>,
    /// WAL segment size in bytes; must match the safekeepers'.
    #[arg(long, default_value_t = DEFAULT_SEGMENT_BYTES)]
    segment_bytes: u64,
    /// HTTP status endpoint.
    #[arg(long, default_value = "127.0.0.1:7677")]
    http: String,
    /// Sync mode: get elected, wait until a quorum of safekeepers agrees on a
    /// common committed end of WAL, print it and exit (writes nothing).
    #[arg(long)]
    sync: bool,
}

pub async fn safekeeper(args: SafekeeperArgs) -> anyhow::Result<()> {
    let mut shutdown = crate::dev::ShutdownSignal::install()?;
    // Flags and addresses first: nothing is touched if one of them is wrong.
    let segment = SegmentSize::new(args.segment_bytes)?;
    let data_dir = crate::paths::data_dir(args.data_dir.as_deref(), "FERRY_DATA_DIR", None)?;
    let listener = TcpNetwork
        .bind(&args.listen)
        .await
        .with_context(|| format!("binding the safekeeper address {}", args.listen))?;
    let http_listener = crate::http::bind(&args.http).await?;
    crate::paths::create_dir(&data_dir)?;
    let _lock = crate::lockfile::lock_dir(&data_dir)?;
    let spec = SafekeeperSpec {
        cluster_id: args.cluster_id.clone(),
        segment,
        preallocation: args.wal_preallocation,
        create: args.create,
    };
    let sk = start_safekeeper(&data_dir, args.id, listener, &spec).await?;
    let server = Arc::clone(&sk.server);
    let status_server = Arc::clone(&server);
    let http = crate::http::serve_status(http_listener, move || {
        let s = Arc::clone(&status_server);
        async move { serde_json::to_value(s.status().await).unwrap_or_default() }
    })?;
    say!(
        "safekeeper {} listening on {}, status on http://{}/status",
        args.id,
        server.addr(),
        http.addr
    );
    let mut failure = server.failure();
    tokio::select! {
        _ = shutdown.recv() => {}
        reason = async { failure.wait_for(|f| f.is_some()).await.map(|f| f.clone().unwrap_or_default()) } => {
            anyhow::bail!("safekeeper stopped after a storage failure: {}", reason.unwrap_or_default());
        }
    }
    server.shutdown().await;
    say!("safekeeper {} stopped cleanly", args.id);
    Ok(())
}

pub async fn writer(args: WriterArgs) -> anyhow::Result<()> {
    let mut shutdown = crate::dev::ShutdownSignal::install()?;
    let segment = SegmentSize::new(args.segment_bytes)?;
    let n = args.safekeepers.len();
    anyhow::ensure!(n >= 1, "at least one safekeeper is needed");
    anyhow::ensure!(
        args.safekeepers.iter().all(|a| !a.trim().is_empty()),
        "--safekeepers has an empty address"
    );
    let http_listener = if args.sync {
        None
    } else {
        Some(crate::http::bind(&args.http).await?)
    };
    let proposer_id = u128::from(std::process::id());
    let writer = Writer::start(
        Arc::new(TcpNetwork),
        WriterConfig::new(
            args.safekeepers.clone(),
            ProposerConfig::new(
                args.cluster_id.clone(),
                n,
                TIMELINE_ID,
                segment.bytes(),
                proposer_id,
            ),
        ),
    );
    let Some(http_listener) = http_listener else {
        let (term, end) = writer.wait_synced().await?;
        say!("synced: safekeepers agree on committed end {end} (term {term})");
        writer.stop().await;
        return Ok(());
    };
    let status = writer.subscribe();
    let http = crate::http::serve_status(http_listener, move || {
        let s = status.borrow().clone();
        async move { serde_json::to_value(s).unwrap_or_default() }
    })?;
    say!(
        "writer for {n} safekeepers started, status on http://{}/status",
        http.addr
    );
    let mut superseded = writer.subscribe();
    tokio::select! {
        _ = shutdown.recv() => {}
        s = superseded.wait_for(|s| s.superseded_by.is_some()) => {
            // Another writer took over, or a term left by one long gone ended
            // this leadership: exit, so that a supervisor starts a new election.
            match s.ok().and_then(|s| s.superseded_by) {
                Some(term) => anyhow::bail!("writer superseded by term {term}; exiting"),
                None => anyhow::bail!("writer stopped unexpectedly"),
            }
        }
    }
    let end = writer.shutdown().await?;
    say!("writer stopped cleanly; shutdown checkpoint committed, WAL ends at {end}");
    Ok(())
}
