//! `ferry bench coord`: the embedded store's operations per second, and
//! ZooKeeper's round trips of separate creates against one multi.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use ferry_coord::embedded::{EmbeddedOptions, EmbeddedStore};
use ferry_coord::zk::{ZkOptions, ZkSession};
use ferry_coord::{Coordination, CreateMode, Op, RequestKind, Session};
use ferry_env::RealDisk;

#[derive(Debug, clap::Args)]
pub struct CoordBenchArgs {
    /// Operations per measured kind for the embedded store.
    #[arg(long, default_value_t = 20_000)]
    ops: usize,
    /// Concurrent sessions issuing the embedded writes.
    #[arg(long, default_value_t = 32)]
    writers: usize,
    /// ZooKeeper connection string; the ZooKeeper part is skipped without it.
    #[arg(long, env = "FERRY_BENCH_ZK")]
    zk: Option<String>,
    /// Directory for the embedded store's files. Default: a temporary one.
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

fn rate(n: usize, elapsed: Duration) -> f64 {
    n as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// Runs `n` operations split over `sessions`, each session issuing its share in
/// sequence; returns the wall time.
async fn run_parallel<F, Fut>(sessions: &[Session], n: usize, op: F) -> anyhow::Result<Duration>
where
    F: Fn(Session, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ferry_coord::Result<()>> + Send,
{
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (w, s) in sessions.iter().enumerate() {
        let s = Arc::clone(s);
        let op = op.clone();
        let count = sessions.len();
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while i < n {
                op(Arc::clone(&s), i).await?;
                i += count;
            }
            Ok::<_, ferry_coord::CoordError>(())
        }));
    }
    for t in tasks {
        t.await.context("bench task")??;
    }
    Ok(started.elapsed())
}

async fn embedded(args: &CoordBenchArgs) -> anyhow::Result<()> {
    let tmp;
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile_dir()?;
            tmp.path().to_path_buf()
        }
    };
    let disk = Arc::new(RealDisk::open_root(&dir)?);
    let store = EmbeddedStore::open(disk, "coord", EmbeddedOptions::default()).await?;
    let mut sessions: Vec<Session> = Vec::new();
    for _ in 0..args.writers.max(1) {
        sessions.push(Arc::new(store.session(Duration::from_secs(30)).await?));
    }
    let setup = &sessions[0];
    setup.create("/bench", b"", CreateMode::Persistent).await?;
    let n = args.ops.max(1);
    let payload = vec![7u8; 100];

    say!(
        "embedded coordination store, fsync on, {} sessions, {n} ops per kind, 100-byte data:",
        sessions.len()
    );
    let p = payload.clone();
    let t = run_parallel(&sessions, n, move |s, i| {
        let p = p.clone();
        async move {
            s.create(&format!("/bench/n{i}"), &p, CreateMode::Persistent)
                .await
                .map(|_| ())
        }
    })
    .await?;
    say!("  create      {:>10.0} ops/s", rate(n, t));
    let p = payload.clone();
    let t = run_parallel(&sessions, n, move |s, i| {
        let p = p.clone();
        async move { s.set(&format!("/bench/n{i}"), &p, None).await.map(|_| ()) }
    })
    .await?;
    say!("  set         {:>10.0} ops/s", rate(n, t));
    let t = run_parallel(&sessions, n, move |s, i| async move {
        s.get(&format!("/bench/n{i}")).await.map(|_| ())
    })
    .await?;
    say!("  get         {:>10.0} ops/s", rate(n, t));
    let multis = (n / 10).max(1);
    let p = payload.clone();
    let t = run_parallel(&sessions, multis, move |s, i| {
        let p = p.clone();
        async move {
            let ops = (0..10)
                .map(|k| Op::set(format!("/bench/n{}", (i * 10 + k) % n), p.clone(), None))
                .collect();
            s.multi(ops).await.map(|_| ())
        }
    })
    .await?;
    say!(
        "  10-op multi {:>10.0} multis/s ({:.0} ops/s)",
        rate(multis, t),
        rate(multis * 10, t)
    );

    // The same writes one session at a time: what group commit buys.
    let single = [Arc::clone(setup)];
    let serial = (n / 10).max(1);
    let p = payload.clone();
    let t = run_parallel(&single, serial, move |s, i| {
        let p = p.clone();
        async move { s.set(&format!("/bench/n{i}"), &p, None).await.map(|_| ()) }
    })
    .await?;
    let serial_rate = rate(serial, t);
    say!("  set, 1 session (one fsync each) {serial_rate:>10.0} ops/s");
    for s in &sessions {
        s.close().await;
    }
    store.shutdown().await;
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("ferry-bench-")
        .tempdir()
        .context("creating a temporary directory")
}

async fn zookeeper(addr: &str) -> anyhow::Result<()> {
    let session = ZkSession::connect(&ZkOptions::new(addr)).await?;
    let root = format!("/ferry-bench-{}", session.session_id());
    session.create(&root, b"", CreateMode::Persistent).await?;
    let n = 100;
    let metrics = session.metrics();

    let before = metrics.snapshot();
    let started = Instant::now();
    for i in 0..n {
        session
            .create(
                &format!("{root}/separate-{i}"),
                b"x",
                CreateMode::Persistent,
            )
            .await?;
    }
    let separate = started.elapsed();
    let separate_trips = metrics.snapshot().total_round_trips() - before.total_round_trips();

    let before = metrics.snapshot();
    let ops = (0..n)
        .map(|i| {
            Op::create(
                format!("{root}/multi-{i}"),
                b"x".to_vec(),
                CreateMode::Persistent,
            )
        })
        .collect();
    let started = Instant::now();
    session.multi(ops).await?;
    let multi = started.elapsed();
    let after = metrics.snapshot();
    let multi_trips = after.total_round_trips() - before.total_round_trips();
    anyhow::ensure!(
        after.round_trips_of(RequestKind::Multi) - before.round_trips_of(RequestKind::Multi) == 1,
        "a multi must be one request"
    );

    say!("ZooKeeper at {addr}, {n} creates:");
    say!(
        "  separate creates: {separate_trips:>3} round trips, {:>8.2} ms",
        separate.as_secs_f64() * 1e3
    );
    say!(
        "  one {n}-op multi: {multi_trips:>3} round trip,  {:>8.2} ms",
        multi.as_secs_f64() * 1e3
    );
    say!(
        "  multi is {:.1}x faster with {}x fewer round trips",
        separate.as_secs_f64() / multi.as_secs_f64().max(1e-9),
        separate_trips / multi_trips.max(1)
    );
    let mut cleanup = Vec::new();
    for prefix in ["separate", "multi"] {
        for i in 0..n {
            cleanup.push(Op::delete(format!("{root}/{prefix}-{i}"), None));
        }
    }
    cleanup.push(Op::delete(root.clone(), None));
    session.multi(cleanup).await?;
    session.close().await;
    Ok(())
}

pub async fn coord(args: CoordBenchArgs) -> anyhow::Result<()> {
    embedded(&args).await?;
    match &args.zk {
        Some(addr) => zookeeper(addr).await?,
        None => say!("ZooKeeper part skipped: pass --zk host:port"),
    }
    Ok(())
}
