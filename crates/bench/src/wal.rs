//! `ferry bench wal`: the WAL quorum's throughput and commit latency on
//! loopback (in process and as separate processes), with replicas streaming
//! and with WAL backup, next to the disk's own fdatasync latency and
//! sequential write rate and the loopback's rate. It holds the quorum set-up
//! the ingest benchmark shares (`fresh_quorum`, `stop_quorum`,
//! `scratch_dir`); over 800 lines because each measurement sits next to the
//! floor it is compared with.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct WalBenchArgs {
    /// Directory for the safekeepers' data. Default: a temporary directory
    /// inside the working folder (so the figures are for this disk).
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
    /// Run the safekeepers as `ferry safekeeper` processes (a deployment's
    /// topology) instead of inside this process.
    #[arg(long)]
    processes: bool,
    /// Walsenders streaming from each safekeeper during the second 64-writer
    /// latency run (replicas reading WAL must not slow commits down).
    #[arg(long, default_value_t = 8)]
    walsenders: usize,
    /// Only measure rebuilding a lost safekeeper from a peer, for each
    /// timeline size of --rebuild-timelines-mib.
    #[arg(long)]
    rebuild: bool,
    /// Timeline sizes of the rebuild measurement, MiB.
    #[arg(long, value_delimiter = ',', default_value = "1024,8192")]
    rebuild_timelines_mib: Vec<u64>,
    /// WAL the donor keeps above its removal horizon (what a pull copies), MiB.
    #[arg(long, default_value_t = 256)]
    rebuild_kept_mib: u64,
    /// Seconds of 64-writer load without, then around, a membership change
    /// (the second part of --rebuild).
    #[arg(long, default_value_t = 5.0)]
    membership_secs: f64,
    /// Put the joining safekeeper's data on this directory (another disk,
    /// as in a deployment) instead of beside the others: its catch-up
    /// writes then do not compete with the commits' fsyncs.
    #[arg(long)]
    membership_new_member_dir: Option<std::path::PathBuf>,
}

/// Replicas streaming from every safekeeper, on a thread of their own.
struct ReplicaLoad {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ReplicaLoad {
    fn start(
        addrs: Vec<String>,
        per_safekeeper: usize,
        streamed: Arc<std::sync::atomic::AtomicU64>,
    ) -> anyhow::Result<ReplicaLoad> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("replica-load".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let mut tasks = tokio::task::JoinSet::new();
                    for addr in &addrs {
                        for shard in 0..per_safekeeper as u32 {
                            tasks.spawn(walsender_load(addr.clone(), shard, Arc::clone(&streamed)));
                        }
                    }
                    let _ = stopped.await;
                    tasks.shutdown().await;
                });
            })?;
        Ok(ReplicaLoad {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A replica's side of START_REPLICATION, for load: reads every frame and
/// sends feedback now and then, until aborted; counts the WAL bytes received.
async fn walsender_load(addr: String, shard: u32, received: Arc<std::sync::atomic::AtomicU64>) {
    use ferry_env::Network as _;
    use ferry_wal::proto::{self, FromSafekeeper, ShardFeedback, ToSafekeeper};
    use tokio::io::AsyncWriteExt as _;
    let Ok(conn) = ferry_env::TcpNetwork.connect(&addr).await else {
        return;
    };
    let (read, mut write) = tokio::io::split(conn);
    let mut reader = proto::FrameReader::new(read);
    let start = ToSafekeeper::StartReplication {
        shard_number: shard,
        start_lsn: ferry_wal::Lsn(0),
    };
    if proto::write_frame(&mut write, &start).await.is_err() || write.flush().await.is_err() {
        return;
    }
    let mut frames = 0u64;
    while let Ok(Some(msg)) = reader.next::<FromSafekeeper>().await {
        if let FromSafekeeper::Wal { begin_lsn, wal, .. } = msg {
            received.fetch_add(wal.len() as u64, std::sync::atomic::Ordering::Relaxed);
            frames += 1;
            if frames.is_multiple_of(16) {
                let end = ferry_wal::Lsn(begin_lsn.0 + wal.len() as u64);
                let fb = ToSafekeeper::Feedback(ShardFeedback {
                    shard_number: shard,
                    replica_number: 0,
                    last_received_lsn: end,
                    disk_consistent_lsn: end,
                    remote_consistent_lsn: end,
                    reply_time_micros: frames,
                });
                if proto::write_frame(&mut write, &fb).await.is_err()
                    || write.flush().await.is_err()
                {
                    return;
                }
            }
        }
    }
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The disk's own limits, measured with plain system calls.
struct DiskLimits {
    /// One 4 KiB write + fdatasync at the end of a growing file (the fdatasync
    /// also commits the new file size to the file-system journal).
    append_fsync: Duration,
    /// One 4 KiB write + fdatasync inside a file already written (data only).
    in_place_fsync: Duration,
    /// A 4 KiB and a 64 KiB write + fdatasync in place, done at once on one file
    /// per safekeeper: the floor of a commit round of 1 and of 64 one-KiB
    /// appends when every safekeeper shares this disk.
    concurrent_fsync_4k: Duration,
    concurrent_fsync_64k: Duration,
    /// Sequential write rate, MB/s (1 MiB writes, then fsync).
    sequential_mb_s: f64,
}

/// The machine's loopback TCP rate in MB/s: one thread writes `mib` MiB in
/// 64 KiB pieces, another reads them (what a walsender's bytes cost to move,
/// with no protocol at all).
fn loopback_mb_s(mib: usize) -> anyhow::Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let total = mib << 20;
    let reader = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut conn, _) = listener.accept()?;
        let mut buf = vec![0u8; 64 << 10];
        let mut got = 0;
        while got < total {
            let n = conn.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        Ok(got)
    });
    let mut conn = std::net::TcpStream::connect(addr)?;
    conn.set_nodelay(true)?;
    let chunk = vec![1u8; 64 << 10];
    let started = Instant::now();
    for _ in 0..total / chunk.len() {
        conn.write_all(&chunk)?;
    }
    conn.flush()?;
    let got = reader
        .join()
        .map_err(|_| anyhow::anyhow!("loopback reader panicked"))??;
    let secs = started.elapsed().as_secs_f64();
    Ok(got as f64 / (1 << 20) as f64 / secs.max(1e-9))
}

/// Latencies of 300 writes of `block` bytes, each followed by fdatasync; with
/// `preallocated`, the file is written and synced first, and the measured loop
/// starts once every thread sharing `start` is ready.
fn fsync_latencies(
    f: &std::fs::File,
    preallocated: bool,
    block: usize,
    start: Option<&std::sync::Barrier>,
) -> anyhow::Result<Vec<Duration>> {
    use std::os::unix::fs::FileExt;
    const N: usize = 300;
    let data = vec![0x5au8; block];
    if preallocated {
        f.write_all_at(&vec![0u8; N * block], 0)?;
        f.sync_all()?;
    }
    if let Some(start) = start {
        start.wait();
    }
    let mut lat = Vec::with_capacity(N);
    for i in 0..N {
        let t = Instant::now();
        f.write_all_at(&data, (i * block) as u64)?;
        f.sync_data()?;
        lat.push(t.elapsed());
    }
    Ok(lat)
}

fn p50_of(mut lat: Vec<Duration>) -> Duration {
    lat.sort();
    percentile(&lat, 0.5)
}

/// p50 of in-place write+fdatasync of `block` bytes run at once on `files` files.
fn concurrent_fsyncs(
    dir: &std::path::Path,
    files: usize,
    block: usize,
) -> anyhow::Result<Duration> {
    let start = std::sync::Barrier::new(files);
    let all = std::thread::scope(|scope| {
        let probes: Vec<_> = (0..files)
            .map(|i| {
                let path = dir.join(format!("disk-probe-{i}"));
                let start = &start;
                scope.spawn(move || -> anyhow::Result<Vec<Duration>> {
                    // A failure before the barrier would leave the others
                    // waiting forever: create the file first, then always meet.
                    let file = std::fs::File::create(&path);
                    let lat = match file {
                        Ok(f) => fsync_latencies(&f, true, block, Some(start)),
                        Err(e) => {
                            start.wait();
                            Err(e.into())
                        }
                    }?;
                    std::fs::remove_file(&path)?;
                    Ok(lat)
                })
            })
            .collect();
        let mut all = Vec::new();
        for probe in probes {
            all.extend(
                probe
                    .join()
                    .map_err(|_| anyhow::anyhow!("disk probe thread failed"))??,
            );
        }
        Ok::<_, anyhow::Error>(all)
    })?;
    Ok(p50_of(all))
}

fn disk_limits(dir: &std::path::Path, files: usize, probe_mib: u64) -> anyhow::Result<DiskLimits> {
    use std::io::Write;
    let path = dir.join("disk-probe");
    let append_fsync = p50_of(fsync_latencies(
        &std::fs::File::create(&path)?,
        false,
        4096,
        None,
    )?);
    let in_place_fsync = p50_of(fsync_latencies(
        &std::fs::File::create(&path)?,
        true,
        4096,
        None,
    )?);
    let concurrent_fsync_4k = concurrent_fsyncs(dir, files, 4096)?;
    let concurrent_fsync_64k = concurrent_fsyncs(dir, files, 64 << 10)?;
    // The best of two runs: the rate of this disk varies from one second to the
    // next, and the best run is the closest to what it can do.
    let chunk = vec![0xa5u8; 1 << 20];
    let mut sequential_mb_s = 0f64;
    for _ in 0..2 {
        let mut f = std::fs::File::create(&path)?;
        let t = Instant::now();
        for _ in 0..probe_mib {
            f.write_all(&chunk)?;
        }
        f.sync_all()?;
        sequential_mb_s = sequential_mb_s.max(probe_mib as f64 / t.elapsed().as_secs_f64());
    }
    std::fs::remove_file(&path)?;
    Ok(DiskLimits {
        append_fsync,
        in_place_fsync,
        concurrent_fsync_4k,
        concurrent_fsync_64k,
        sequential_mb_s,
    })
}

pub(crate) fn insert_of(total_bytes: usize, block: u64) -> bytes::Bytes {
    let payload = total_bytes.saturating_sub(ferry_wal::record::Record::insert_len(0, 0));
    ferry_wal::record::Record::Insert {
        shard: 0,
        idempotency_key: bytes::Bytes::new(),
        table_id: 1,
        block_number: block,
        arrow_ipc: bytes::Bytes::from(vec![(block % 251) as u8; payload]),
    }
    .to_bytes()
}

/// The safekeepers of one measurement.
enum Safekeepers {
    InProcess(Vec<ferry_host::local::Member>),
    /// `ferry safekeeper` children and their status endpoints (`host:port`).
    Processes(Vec<(std::process::Child, String)>),
}

impl Drop for Safekeepers {
    fn drop(&mut self) {
        if let Safekeepers::Processes(children) = self {
            for (child, _) in children.iter_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// Counters of one safekeeper that the benchmark reports.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    append_messages: u64,
    wal_fsyncs: u64,
    segments_preallocated: u64,
    backup_uploads: u64,
    backup_lsn: u64,
}

/// GET `/status` of a safekeeper process (a plain HTTP/1.1 request: the status
/// server is ours and answers with one JSON body).
fn status_over_http(host: &str) -> anyhow::Result<serde_json::Value> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(host)?;
    write!(
        conn,
        "GET /status HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    conn.read_to_string(&mut response)?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .context("status response without a body")?;
    Ok(serde_json::from_str(body)?)
}

impl Safekeepers {
    async fn counters(&self) -> anyhow::Result<Vec<Counters>> {
        let mut out = Vec::new();
        match self {
            Safekeepers::InProcess(members) => {
                for s in members.iter().filter_map(ferry_host::local::Member::server) {
                    let status = s.status().await;
                    out.push(Counters {
                        append_messages: status.appends_received,
                        wal_fsyncs: status.wal_fsyncs,
                        segments_preallocated: status.wal_segments_preallocated,
                        backup_uploads: status.backup_uploads,
                        backup_lsn: status
                            .backup_lsn
                            .parse::<ferry_wal::Lsn>()
                            .map_or(0, |l| l.0),
                    });
                }
            }
            Safekeepers::Processes(children) => {
                for (_, host) in children {
                    let host = host.clone();
                    let status =
                        tokio::task::spawn_blocking(move || status_over_http(&host)).await??;
                    let field = |name: &str| status[name].as_u64().unwrap_or(0);
                    out.push(Counters {
                        append_messages: field("appends_received"),
                        wal_fsyncs: field("wal_fsyncs"),
                        segments_preallocated: field("wal_segments_preallocated"),
                        backup_uploads: field("backup_uploads"),
                        backup_lsn: status["backup_lsn"]
                            .as_str()
                            .and_then(|s| s.parse::<ferry_wal::Lsn>().ok())
                            .map_or(0, |l| l.0),
                    });
                }
            }
        }
        Ok(out)
    }
}

/// Starts `ferry safekeeper` on a free loopback port; returns it with its WAL
/// address and status endpoint.
fn spawn_safekeeper(
    id: u64,
    data: &std::path::Path,
    options: &QuorumOptions,
) -> anyhow::Result<(std::process::Child, String, String)> {
    use std::io::BufRead;
    let backup = options
        .backup
        .as_ref()
        .map(|dir| format!("file://{}", dir.display()));
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["safekeeper", "--create", "--id", &id.to_string()])
        .args(["--cluster-id", bench_cluster().as_str()])
        .args(["--segment-bytes", &options.segment_bytes.to_string()])
        .args(backup.iter().flat_map(|url| ["--wal-backup", url.as_str()]))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(data)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting a safekeeper process")?;
    let mut reader = std::io::BufReader::new(child.stdout.take().context("safekeeper stdout")?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let parse = || -> Option<(String, String)> {
        let rest = line.split("listening on ").nth(1)?;
        let (addr, rest) = rest.split_once(',')?;
        let status = rest.split("http://").nth(1)?.split('/').next()?;
        Some((addr.trim().to_string(), status.to_string()))
    };
    let Some((addr, status)) = parse() else {
        let _ = child.kill();
        anyhow::bail!("unexpected first line from a safekeeper process: {line:?}");
    };
    // Keep draining its output so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in reader.lines().map_while(Result::ok) {});
    Ok((child, addr, status))
}

/// Every quorum of the benchmark is a cluster of its own, made for it.
pub(crate) fn bench_cluster() -> ferry_wal::ClusterId {
    ferry_wal::ClusterId::new("bench").unwrap_or_else(|_| unreachable!("a valid cluster id"))
}

/// A quorum of one measurement.
pub struct BenchQuorum {
    pub writer: Arc<ferry_writer::driver::Writer>,
    safekeepers: Safekeepers,
    /// The safekeepers' WAL addresses (walsenders connect to them).
    pub addrs: Vec<String>,
}

/// How a benchmark quorum is set up.
#[derive(Debug, Clone)]
pub struct QuorumOptions {
    pub segment_bytes: u64,
    /// Back whole segments up to this folder (it must exist).
    pub backup: Option<std::path::PathBuf>,
}

impl Default for QuorumOptions {
    fn default() -> Self {
        QuorumOptions {
            segment_bytes: ferry_wal::segment::DEFAULT_SEGMENT_BYTES,
            backup: None,
        }
    }
}

/// A fresh quorum in its own directory, elected and ready.
pub async fn fresh_quorum(
    root: &std::path::Path,
    name: &str,
    n: usize,
    in_process: bool,
    options: &QuorumOptions,
) -> anyhow::Result<BenchQuorum> {
    let segment = ferry_wal::segment::SegmentSize::new(options.segment_bytes)?;
    let dir = root.join(name);
    let server = match &options.backup {
        Some(dir) => ferry_safekeeper::server::ServerConfig {
            backup: Some(ferry_safekeeper::backup::BackupConfig {
                location: ferry_storage::open(
                    &format!("file://{}", dir.display()),
                    &ferry_host::s3_settings_from_env(),
                )?,
                parallel_jobs: ferry_safekeeper::backup::DEFAULT_PARALLEL_JOBS,
            }),
            ..Default::default()
        },
        None => Default::default(),
    };
    let (writer, safekeepers, addrs) = if in_process {
        let spec = ferry_host::local::QuorumSpec {
            dir: dir.clone(),
            safekeepers: n,
            safekeeper: ferry_host::local::SafekeeperSpec {
                cluster_id: bench_cluster(),
                segment,
                preallocation: Default::default(),
                create: true,
                restore: false,
                pull_from: Vec::new(),
                server,
            },
            min_term: 0,
            known_commit_lsn: ferry_wal::Lsn(0),
            back_pressure: Default::default(),
            pull_lost: false,
        };
        let quorum = ferry_host::local::LocalQuorum::start(&spec).await?;
        let addrs = quorum.servers().map(|s| s.addr().to_string()).collect();
        (quorum.writer, Safekeepers::InProcess(quorum.members), addrs)
    } else {
        let mut children = Vec::new();
        let mut addrs = Vec::new();
        for id in 0..n as u64 {
            let (child, addr, status) =
                spawn_safekeeper(id, &dir.join(format!("sk{id}")), options)?;
            children.push((child, status));
            addrs.push(addr);
        }
        let proposer_id = u128::from(std::process::id()) << 64 | u128::from(n as u64);
        let config = ferry_writer::driver::WriterConfig::new(
            addrs.clone(),
            ferry_writer::proposer::ProposerConfig::new(
                bench_cluster(),
                n,
                ferry_host::local::TIMELINE_ID,
                segment.bytes(),
                proposer_id,
            ),
        );
        let writer = ferry_writer::driver::Writer::start(Arc::new(ferry_env::TcpNetwork), config);
        (Arc::new(writer), Safekeepers::Processes(children), addrs)
    };
    let mut status = writer.subscribe();
    tokio::time::timeout(Duration::from_secs(30), status.wait_for(|s| s.elected))
        .await
        .context("writer not elected")??;
    Ok(BenchQuorum {
        writer,
        safekeepers,
        addrs,
    })
}

/// Appends `per_writer` 1 KiB records from each of `writers` concurrent
/// writers; returns every commit latency.
async fn closed_loop(
    writer: &Arc<ferry_writer::driver::Writer>,
    writers: usize,
    per_writer: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut tasks = Vec::new();
    for wi in 0..writers {
        let w = Arc::clone(writer);
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(per_writer);
            for i in 0..per_writer {
                let r = insert_of(1024, (wi * per_writer + i) as u64);
                let t = Instant::now();
                w.append(r).await?;
                lat.push(t.elapsed());
            }
            Ok::<_, ferry_writer::driver::WriterError>(lat)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    all.sort();
    Ok(all)
}

pub async fn stop_quorum(quorum: BenchQuorum) -> anyhow::Result<()> {
    let writer = Arc::into_inner(quorum.writer).context("writer still shared")?;
    writer.shutdown().await?;
    match &quorum.safekeepers {
        Safekeepers::InProcess(members) => {
            for s in members.iter().filter_map(ferry_host::local::Member::server) {
                s.shutdown().await;
            }
        }
        // Killed when dropped.
        Safekeepers::Processes(_) => {}
    }
    Ok(())
}

/// A fresh temporary directory for one benchmark run inside `dir` (created
/// if missing), or inside the working folder, so that the figures are for
/// that disk; removed when dropped.
pub fn scratch_dir(
    dir: Option<&std::path::Path>,
    prefix: &str,
) -> anyhow::Result<tempfile::TempDir> {
    let dir = dir.unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(dir)
        .with_context(|| format!("creating a temporary directory in {}", dir.display()))
}

pub async fn wal(args: WalBenchArgs) -> anyhow::Result<()> {
    let tmp = scratch_dir(args.dir.as_deref(), "ferry-bench-wal-")?;
    if args.rebuild {
        return crate::rebuild::rebuild_runs(
            tmp.path(),
            &args.rebuild_timelines_mib,
            args.rebuild_kept_mib,
            args.membership_secs,
            args.membership_new_member_dir.as_deref(),
        )
        .await;
    }
    let n = args.safekeepers.max(1);
    let disk = disk_limits(tmp.path(), n, args.mib.clamp(64, 256))?;
    say!(
        "disk: 4 KiB write+fdatasync p50 {:.3} ms appending to a file, {:.3} ms in place; in place on {n} files at once: {:.3} ms for 4 KiB, {:.3} ms for 64 KiB; sequential write {:.0} MB/s",
        ms(disk.append_fsync),
        ms(disk.in_place_fsync),
        ms(disk.concurrent_fsync_4k),
        ms(disk.concurrent_fsync_64k),
        disk.sequential_mb_s
    );
    say!(
        "WAL quorum: {n} safekeepers {} on loopback TCP, all on this disk, fsync on, 16 MiB segments; a fresh quorum for each measurement",
        if args.processes { "as separate processes" } else { "in this process" }
    );

    for size in [64usize << 10, 1 << 20] {
        let quorum = fresh_quorum(
            tmp.path(),
            &format!("throughput-{size}"),
            n,
            !args.processes,
            &QuorumOptions::default(),
        )
        .await?;
        let writer = Arc::clone(&quorum.writer);
        let count = ((args.mib << 20) as usize / size).max(1);
        let records: Vec<bytes::Bytes> = (0..count).map(|b| insert_of(size, b as u64)).collect();
        let sem = Arc::new(tokio::sync::Semaphore::new(args.in_flight.max(1)));
        let before = quorum.safekeepers.counters().await?;
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
        let elapsed = started.elapsed().as_secs_f64();
        let wal_bytes = (count * size) as f64;
        let rate = wal_bytes / (1 << 20) as f64 / elapsed;
        // Every safekeeper writes the WAL to this one disk, plus the segments it
        // zero-filled ahead of time.
        drop(writer);
        let after = quorum.safekeepers.counters().await?;
        let zeroed: u64 = before
            .iter()
            .zip(&after)
            .map(|(b, a)| a.segments_preallocated - b.segments_preallocated)
            .sum();
        let zero_bytes = (zeroed * ferry_wal::segment::DEFAULT_SEGMENT_BYTES) as f64;
        let disk_rate = (n as f64 * wal_bytes + zero_bytes) / (1 << 20) as f64 / elapsed;
        say!(
            "  throughput, {:>4} KiB appends: {rate:>6.1} MB/s of WAL = {:.0}% of the disk's sequential rate (at most {:.0}% with {n} copies on one disk); the disk absorbs {disk_rate:.0} MB/s ({n} copies + {zeroed} zero-filled segments) = {:.0}%",
            size >> 10,
            100.0 * rate / disk.sequential_mb_s,
            100.0 / n as f64,
            100.0 * disk_rate / disk.sequential_mb_s
        );
        stop_quorum(quorum).await?;
    }

    let mut without_walsenders = None;
    for (writers, walsenders) in [(1usize, 0usize), (64, 0), (64, args.walsenders)] {
        if writers == 64 && walsenders == 0 && args.walsenders == 0 {
            // Measured once below.
            continue;
        }
        let quorum = fresh_quorum(
            tmp.path(),
            &format!("latency-{writers}-{walsenders}"),
            n,
            !args.processes,
            &QuorumOptions::default(),
        )
        .await?;
        let streamed = Arc::new(std::sync::atomic::AtomicU64::new(0));
        // The replicas are other processes in a deployment: their side runs on
        // a thread and runtime of its own, not on the one measured.
        let load = (walsenders > 0)
            .then(|| {
                let addrs = quorum.addrs.clone();
                let streamed = Arc::clone(&streamed);
                ReplicaLoad::start(addrs, walsenders, streamed)
            })
            .transpose()?;
        // Warm-up, not measured: connections, buffers and the first segment.
        closed_loop(&quorum.writer, writers, (200 / writers).max(2)).await?;
        let before = quorum.safekeepers.counters().await?;
        let all = closed_loop(&quorum.writer, writers, (args.appends / writers).max(1)).await?;
        let p50 = percentile(&all, 0.5);
        // The disk's floor for one commit of this run: every safekeeper syncing
        // the batch of all writers (1 KiB each) at once.
        let (floor, batch) = if writers >= 64 {
            (disk.concurrent_fsync_64k, "64 KiB")
        } else {
            (disk.concurrent_fsync_4k, "4 KiB")
        };
        say!(
            "  commit latency, 1 KiB appends, {writers:>2} writers: p50 {:.3} ms, p99 {:.3} ms = {:.1}x an appending fdatasync, {:.1}x an in-place one; the disk's floor for this commit ({n} {batch} fdatasyncs at once) is {:.3} ms = {:.1}x an appending fdatasync, and the commit takes {:.1}x that floor",
            ms(p50),
            ms(percentile(&all, 0.99)),
            p50.as_secs_f64() / disk.append_fsync.as_secs_f64().max(1e-9),
            p50.as_secs_f64() / disk.in_place_fsync.as_secs_f64().max(1e-9),
            ms(floor),
            floor.as_secs_f64() / disk.append_fsync.as_secs_f64().max(1e-9),
            p50.as_secs_f64() / floor.as_secs_f64().max(1e-9)
        );
        let after = quorum.safekeepers.counters().await?;
        let factors: Vec<String> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| {
                let fsyncs = (a.wal_fsyncs - b.wal_fsyncs).max(1) as f64;
                format!(
                    "{:.1} ({:.1} messages)",
                    all.len() as f64 / fsyncs,
                    (a.append_messages - b.append_messages) as f64 / fsyncs
                )
            })
            .collect();
        say!(
            "    appends per WAL fsync on each safekeeper (group commit): {}",
            factors.join(", ")
        );
        if let Some(load) = load {
            load.stop();
        }
        if walsenders > 0 {
            let streamed_bytes = streamed.load(std::sync::atomic::Ordering::Relaxed) as f64;
            // Every commit round (one fsync per safekeeper) hands its WAL to
            // every walsender: moving those bytes through loopback is the
            // floor of what walsenders add to a commit on this machine.
            let rounds = after
                .iter()
                .zip(&before)
                .map(|(a, b)| a.wal_fsyncs - b.wal_fsyncs)
                .max()
                .unwrap_or(1)
                .max(1) as f64;
            let per_round_kib = streamed_bytes / rounds / 1024.0;
            let loopback = loopback_mb_s(256)?;
            let floor_ms = per_round_kib / 1024.0 / loopback * 1e3;
            match without_walsenders {
                Some(base) => {
                    let added = ms(p50) - ms(base);
                    say!(
                        "    with {walsenders} walsenders streaming from each safekeeper ({:.1} MiB sent to them): p50 {:.3} ms = {:.2}x the p50 without walsenders ({:.3} ms); they add {added:.3} ms to a commit, while moving the {per_round_kib:.0} KiB they receive per commit through loopback (this machine: {loopback:.0} MB/s) takes {floor_ms:.3} ms: {:.2}x that floor",
                        streamed_bytes / (1 << 20) as f64,
                        ms(p50),
                        p50.as_secs_f64() / Duration::as_secs_f64(&base).max(1e-9),
                        ms(base),
                        added / floor_ms.max(1e-9)
                    )
                }
                None => say!("    with {walsenders} walsenders streaming from each safekeeper"),
            }
        } else if writers == 64 {
            without_walsenders = Some(p50);
        }
        stop_quorum(quorum).await?;
    }
    backup_runs(&args, tmp.path(), n).await
}

/// Commit latency with WAL backup off and on (to a folder on this disk), in
/// one run, and whether the backup keeps up with the WAL throughput.
async fn backup_runs(args: &WalBenchArgs, root: &std::path::Path, n: usize) -> anyhow::Result<()> {
    // 1 MiB segments, so that uploads run during the latency measurement.
    const SEGMENT: u64 = 1 << 20;
    let appends = (args.appends * 8).max(64);
    say!(
        "WAL backup to a local folder on this disk (1 MiB segments, {} parallel uploads):",
        ferry_safekeeper::backup::DEFAULT_PARALLEL_JOBS
    );
    // Off and on alternate, six rounds each, in the order off-on, on-off,
    // off-on, ..., so that neither a slow moment of the machine nor the
    // write-back the previous run left behind lands on one side only; the
    // medians are compared.
    const ROUNDS: usize = 6;
    let mut p50s: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for round in 0..ROUNDS {
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for backup in order {
            let name = format!("backup-{}-{round}", if backup { "on" } else { "off" });
            let folder = root.join(format!("{name}-objects"));
            std::fs::create_dir_all(&folder)?;
            let folder = folder.canonicalize()?;
            let options = QuorumOptions {
                segment_bytes: SEGMENT,
                backup: backup.then(|| folder.clone()),
            };
            let quorum = fresh_quorum(root, &name, n, !args.processes, &options).await?;
            closed_loop(&quorum.writer, 64, 4).await?;
            let before = quorum.safekeepers.counters().await?;
            let all = closed_loop(&quorum.writer, 64, (appends / 64).max(1)).await?;
            let after = quorum.safekeepers.counters().await?;
            let uploads: u64 = after
                .iter()
                .zip(&before)
                .map(|(a, b)| a.backup_uploads - b.backup_uploads)
                .sum();
            let p50 = percentile(&all, 0.5);
            say!(
                "  commit latency, 1 KiB appends, 64 writers, backup {}: p50 {:.3} ms, p99 {:.3} ms ({} appends; {uploads} segments uploaded meanwhile)",
                if backup { "on " } else { "off" },
                ms(p50),
                ms(percentile(&all, 0.99)),
                all.len()
            );
            p50s[usize::from(backup)].push(p50);
            stop_quorum(quorum).await?;
        }
    }
    let off = p50_of(p50s[0].clone());
    let on = p50_of(p50s[1].clone());
    say!(
        "  median p50 over {ROUNDS} runs each: backup off {:.3} ms, backup on {:.3} ms: with backup on, commit latency is {:.2}x the figure with backup off ({:+.1}%)",
        ms(off),
        ms(on),
        on.as_secs_f64() / off.as_secs_f64().max(1e-9),
        100.0 * (on.as_secs_f64() / off.as_secs_f64().max(1e-9) - 1.0)
    );

    // Throughput with backup on: 64 KiB appends, 16 MiB segments.
    let folder = root.join("backup-throughput-objects");
    std::fs::create_dir_all(&folder)?;
    let folder = folder.canonicalize()?;
    let options = QuorumOptions {
        segment_bytes: ferry_wal::segment::DEFAULT_SEGMENT_BYTES,
        backup: Some(folder),
    };
    let quorum = fresh_quorum(root, "backup-throughput", n, !args.processes, &options).await?;
    let size = 64usize << 10;
    let count = ((args.mib << 20) as usize / size).max(1);
    let sem = Arc::new(tokio::sync::Semaphore::new(args.in_flight.max(1)));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for b in 0..count {
        let permit = Arc::clone(&sem).acquire_owned().await?;
        let w = Arc::clone(&quorum.writer);
        let record = insert_of(size, b as u64);
        tasks.push(tokio::spawn(async move {
            let result = w.append(record).await;
            drop(permit);
            result
        }));
    }
    let mut end = ferry_wal::Lsn(0);
    for t in tasks {
        end = end.max(t.await??);
    }
    let wal_secs = started.elapsed().as_secs_f64();
    // The backup is caught up once backup_lsn reaches the last whole segment.
    let target = end.0 / ferry_wal::segment::DEFAULT_SEGMENT_BYTES
        * ferry_wal::segment::DEFAULT_SEGMENT_BYTES;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let backed = quorum
            .safekeepers
            .counters()
            .await?
            .iter()
            .map(|c| c.backup_lsn)
            .max()
            .unwrap_or(0);
        if backed >= target {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the backup did not reach {target} within 120 s of the last commit (at {backed})"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let backup_secs = started.elapsed().as_secs_f64();
    let mb = end.0 as f64 / (1 << 20) as f64;
    say!(
        "  throughput with backup on, 64 KiB appends: {:.1} MB/s of WAL; every whole segment ({:.0} MiB) was in the backup {:.0} ms after the last commit: the backup moved {:.1} MB/s = {:.0}% of the WAL rate",
        mb / wal_secs,
        target as f64 / (1 << 20) as f64,
        (backup_secs - wal_secs) * 1e3,
        target as f64 / (1 << 20) as f64 / backup_secs,
        100.0 * (target as f64 / backup_secs) / (end.0 as f64 / wal_secs).max(1e-9)
    );
    stop_quorum(quorum).await
}
