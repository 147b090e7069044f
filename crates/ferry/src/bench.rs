//! `ferry bench ...`: figures printed for humans, never asserted in tests.

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
    /// Directory for the embedded store's files (a temporary one by default).
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

#[derive(Debug, clap::Args)]
pub struct WalBenchArgs {
    /// Directory for the safekeepers' data; a temporary directory inside the
    /// working folder by default (so the figures are for this disk).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// MiB written per throughput run.
    #[arg(long, default_value_t = 256)]
    mib: u64,
    /// 1 KiB appends per latency run.
    #[arg(long, default_value_t = 2000)]
    appends: usize,
    /// Appends in flight during throughput runs.
    #[arg(long, default_value_t = 32)]
    in_flight: usize,
    /// Safekeepers in the quorum (all on this disk).
    #[arg(long, default_value_t = 3)]
    safekeepers: usize,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The disk's own limits, measured with plain system calls: the latency of one
/// 4 KiB write + fdatasync, and the sequential write rate (1 MiB writes, fsync).
fn disk_limits(dir: &std::path::Path) -> anyhow::Result<(Duration, f64)> {
    use std::io::Write;
    let path = dir.join("disk-probe");
    let mut f = std::fs::File::create(&path)?;
    let block = vec![0x5au8; 4096];
    let mut lat = Vec::new();
    for _ in 0..300 {
        let t = Instant::now();
        f.write_all(&block)?;
        f.sync_data()?;
        lat.push(t.elapsed());
    }
    lat.sort();
    drop(f);
    let chunk = vec![0xa5u8; 1 << 20];
    let mut f = std::fs::File::create(&path)?;
    let total = 256u64;
    let t = Instant::now();
    for _ in 0..total {
        f.write_all(&chunk)?;
    }
    f.sync_all()?;
    let rate = total as f64 / t.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok((percentile(&lat, 0.5), rate))
}

fn insert_of(total_bytes: usize, block: u64) -> bytes::Bytes {
    let payload = total_bytes.saturating_sub(ferry_wal::record::Record::insert_len(0));
    ferry_wal::record::Record::Insert {
        table_id: 1,
        block_number: block,
        arrow_ipc: bytes::Bytes::from(vec![(block % 251) as u8; payload]),
    }
    .to_bytes()
}

/// (appends received, WAL fsyncs) of each safekeeper.
async fn quorum_counters(
    safekeepers: &[Arc<ferry_safekeeper::server::SafekeeperServer>],
) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for s in safekeepers {
        let status = s.status().await;
        out.push((status.appends_received, status.wal_fsyncs));
    }
    out
}

pub async fn wal(args: WalBenchArgs) -> anyhow::Result<()> {
    let tmp = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            tempfile::Builder::new()
                .prefix("ferry-bench-wal-")
                .tempdir_in(d)?
        }
        None => tempfile::Builder::new()
            .prefix("ferry-bench-wal-")
            .tempdir_in(".")?,
    };
    let (fsync_p50, disk_mb_s) = disk_limits(tmp.path())?;
    say!(
        "disk: one 4 KiB write+fdatasync p50 {:.3} ms; sequential write {disk_mb_s:.0} MB/s",
        ms(fsync_p50)
    );

    let segment = ferry_wal::segment::SegmentSize::new(ferry_wal::segment::DEFAULT_SEGMENT_BYTES)?;
    let n = args.safekeepers.max(1);
    let quorum = crate::local::LocalQuorum::start(&tmp.path().join("wal"), n, segment).await?;
    let writer = Arc::new(quorum.writer);
    let mut status = writer.subscribe();
    tokio::time::timeout(Duration::from_secs(30), status.wait_for(|s| s.elected))
        .await
        .context("writer not elected")??;
    say!("WAL quorum: {n} safekeepers on loopback TCP, fsync on, 16 MiB segments");

    let mut block = 0u64;
    for size in [64usize << 10, 1 << 20] {
        let count = ((args.mib << 20) as usize / size).max(1);
        let records: Vec<bytes::Bytes> = (0..count)
            .map(|_| {
                block += 1;
                insert_of(size, block)
            })
            .collect();
        let sem = Arc::new(tokio::sync::Semaphore::new(args.in_flight.max(1)));
        let started = Instant::now();
        let mut tasks = Vec::new();
        for r in records {
            let permit = Arc::clone(&sem).acquire_owned().await?;
            let w = Arc::clone(&writer);
            tasks.push(tokio::spawn(async move {
                let result = w.append(r).await;
                drop(permit);
                result
            }));
        }
        for t in tasks {
            t.await??;
        }
        let rate = (count * size) as f64 / (1 << 20) as f64 / started.elapsed().as_secs_f64();
        // Every safekeeper writes to this one disk, so it absorbs n times the WAL
        // rate.
        say!(
            "  throughput, {:>4} KiB appends: {rate:>7.1} MB/s of WAL = {:.0}% of the disk's sequential rate; x{n} safekeepers on this disk = {:.0}%",
            size >> 10,
            100.0 * rate / disk_mb_s,
            100.0 * n as f64 * rate / disk_mb_s
        );
    }

    for writers in [1usize, 64] {
        let before = quorum_counters(&quorum.safekeepers).await;
        let per = (args.appends / writers).max(1);
        let mut tasks = Vec::new();
        for wi in 0..writers {
            let w = Arc::clone(&writer);
            let base = block + 1 + (wi * per) as u64;
            tasks.push(tokio::spawn(async move {
                let mut lat = Vec::with_capacity(per);
                for i in 0..per {
                    let r = insert_of(1024, base + i as u64);
                    let t = Instant::now();
                    w.append(r).await?;
                    lat.push(t.elapsed());
                }
                Ok::<_, ferry_writer::driver::WriterError>(lat)
            }));
        }
        block += (writers * per) as u64 + 1;
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await??);
        }
        all.sort();
        let p50 = percentile(&all, 0.5);
        say!(
            "  commit latency, 1 KiB appends, {writers:>2} writers: p50 {:.3} ms, p99 {:.3} ms ({:.1}x one fdatasync)",
            ms(p50),
            ms(percentile(&all, 0.99)),
            p50.as_secs_f64() / fsync_p50.as_secs_f64().max(1e-9)
        );
        let after = quorum_counters(&quorum.safekeepers).await;
        let factors: Vec<String> = before
            .iter()
            .zip(&after)
            .map(|((a0, f0), (a1, f1))| {
                format!("{:.1}", (a1 - a0) as f64 / ((f1 - f0).max(1)) as f64)
            })
            .collect();
        say!(
            "    appends per WAL fsync on each safekeeper (group commit): {}",
            factors.join(", ")
        );
    }
    let writer = Arc::into_inner(writer).context("writer still shared")?;
    writer.shutdown().await?;
    for s in &quorum.safekeepers {
        s.shutdown().await;
    }
    Ok(())
}
