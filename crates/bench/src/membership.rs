//! `ferry bench wal --rebuild`, second part: commit latency at 64 writers
//! while the safekeeper set changes (`ferry_node::membership`, safekeeper
//! 2 replaced by 3, pulled from a peer first as an operator does), next to
//! the same load without a change.
//!
//! Four safekeepers on loopback TCP in this process, on this disk; the
//! configuration in an in-memory coordination store. Each writer appends
//! 1 KiB records one after another; an append cut by the writer starting
//! over with a new configuration (outcome unknown) is sent again and its
//! latency runs from the first attempt, as a client retrying with its
//! idempotency key sees it. The goal: within 2x of the latency without a
//! change.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use ferry_coord::embedded::{EmbeddedOptions, EmbeddedStore};
use ferry_env::{Disk, Network, RealDisk, TcpNetwork};
use ferry_node::membership::{self, ChangeOptions, ChangeRequest};
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig};
use ferry_safekeeper::server::{SafekeeperServer, ServerConfig};
use ferry_wal::membership::{Configuration, Member};
use ferry_wal::segment::SegmentSize;
use ferry_writer::driver::{Writer, WriterConfig, WriterError};
use ferry_writer::proposer::ProposerConfig;

use crate::wal::bench_cluster;

fn config(node: u64) -> anyhow::Result<AcceptorConfig> {
    Ok(AcceptorConfig {
        cluster_id: bench_cluster(),
        node_id: node,
        timeline_id: 1,
        segment_size: SegmentSize::new(ferry_wal::segment::DEFAULT_SEGMENT_BYTES)?,
        preallocation: Default::default(),
    })
}

fn server_config(peers: Vec<String>) -> ServerConfig {
    ServerConfig {
        min_free_disk: 0,
        peer_recovery: Some(ferry_safekeeper::recovery::PeerRecovery {
            network: Arc::new(TcpNetwork),
            peers,
        }),
        ..ServerConfig::default()
    }
}

/// Latencies of the appends that started in `[from, to)`.
#[derive(Default)]
struct Latencies(Vec<(Instant, Duration)>);

impl Latencies {
    fn between(&self, from: Instant, to: Instant) -> Vec<Duration> {
        let mut v: Vec<Duration> = self
            .0
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, d)| *d)
            .collect();
        v.sort_unstable();
        v
    }
}

/// `writers` tasks appending until `stop`; every append's start and latency.
fn load(
    writer: &Arc<Writer>,
    writers: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<Latencies>>> {
    (0..writers)
        .map(|w| {
            let writer = Arc::clone(writer);
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut out = Latencies::default();
                let mut block = (w as u64) << 40;
                while !*stop.borrow() {
                    let started = Instant::now();
                    loop {
                        match writer.append(crate::wal::insert_of(1024, block)).await {
                            Ok(_) => break,
                            // Started over with the new configuration:
                            // sent again, as a client retries.
                            Err(WriterError::Reconfigured { .. }) => continue,
                            Err(e) => return Err(anyhow::anyhow!("append: {e}")),
                        }
                    }
                    out.0.push((started, started.elapsed()));
                    block += 1;
                }
                Ok(out)
            })
        })
        .collect()
}

async fn collect(
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<Latencies>>>,
) -> anyhow::Result<Latencies> {
    let mut all = Latencies::default();
    for t in tasks {
        all.0.extend(t.await.context("load task")??.0);
    }
    Ok(all)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    crate::wal::ms(crate::wal::percentile(sorted, p))
}

/// Runs the measurement in `root`: `secs` of load without a change, then
/// the same load around a replace.
pub async fn membership_run(
    root: &std::path::Path,
    secs: f64,
    writers: usize,
    new_member_dir: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let dir = root.join("membership");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(&dir)?);
    let new_member_scratch = match new_member_dir {
        Some(d) => Some(crate::wal::scratch_dir(Some(d), "ferry-bench-new-member-")?),
        None => None,
    };
    let new_disk: Arc<dyn Disk> = match &new_member_scratch {
        Some(d) => Arc::new(RealDisk::open_root(d.path())?),
        None => Arc::clone(&disk),
    };
    let mut listeners = Vec::new();
    for _ in 0..4 {
        listeners.push(TcpNetwork.bind("127.0.0.1:0").await?);
    }
    let addrs: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<Result<_, _>>()?;
    let peers = |i: usize| -> Vec<String> {
        (0..4)
            .filter(|&p| p != i)
            .map(|p| addrs[p].clone())
            .collect()
    };
    let mut servers = Vec::new();
    let mut listeners = listeners.into_iter();
    for i in 0..3usize {
        let acceptor =
            Acceptor::create(Arc::clone(&disk), &format!("sk{i}"), config(i as u64)?).await?;
        let listener = listeners.next().context("listener")?;
        servers.push(SafekeeperServer::serve_with(
            listener,
            acceptor,
            server_config(peers(i)),
        )?);
    }
    let spare = listeners.next().context("listener")?;
    let store = EmbeddedStore::in_memory(EmbeddedOptions::default()).await?;
    let session = store.session(Duration::from_secs(10)).await?;
    let member = |i: usize| Member {
        id: i as u64,
        addr: addrs[i].clone(),
    };
    let initial = membership::init(
        &session,
        &TcpNetwork,
        &bench_cluster(),
        (0..3).map(member).collect(),
        Duration::from_secs(5),
    )
    .await?;
    let writer = start_writer(&initial);
    // Elected and warm.
    writer
        .append(crate::wal::insert_of(1024, u64::MAX))
        .await
        .map_err(|e| anyhow::anyhow!("first append: {e}"))?;

    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let tasks = load(&writer, writers, stop.clone());
    let from = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let to = Instant::now();
    stop_tx.send_replace(true);
    let quiet = collect(tasks).await?;
    let (quiet_from, quiet_to) = (from, to);
    let baseline = quiet.between(from, to);

    // The new member is pulled from a peer, then the change runs under load.
    let report = ferry_safekeeper::pull::pull_from_peer(
        Arc::clone(&new_disk),
        "sk3",
        &config(3)?,
        &TcpNetwork,
        &addrs[0],
        None,
    )
    .await?;
    let acceptor = Acceptor::open(Arc::clone(&new_disk), "sk3", config(3)?).await?;
    let mut server_config3 = server_config(peers(3));
    server_config3.restore_quarantine = Duration::from_millis(500);
    servers.push(SafekeeperServer::serve_with(
        spare,
        acceptor,
        server_config3,
    )?);
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let tasks = load(&writer, writers, stop.clone());
    // The new member keeps up by itself (committed WAL from its peers)
    // until the change names it.
    let joined = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(secs / 4.0)).await;
    let from = Instant::now();
    let mut options = ChangeOptions::new(bench_cluster());
    options.timeout = Duration::from_secs(120);
    options.retry = Duration::from_millis(20);
    let switched = membership::change(
        &session,
        &TcpNetwork,
        ChangeRequest::Replace {
            old: 2,
            new: member(3),
        },
        &options,
        &|_| {},
    )
    .await?;
    let to = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(secs / 4.0)).await;
    stop_tx.send_replace(true);
    let all = collect(tasks).await?;
    let during = all.between(from, to);
    let around = all.between(joined, to);
    // The change lasts tens of milliseconds, and one pause that every
    // writer waits out (a control file written) makes a short window's
    // p99: the load without a change, cut into windows of the same length,
    // shows what such a window's p99 is without one.
    let windows = same_length_windows(&quiet, quiet_from, quiet_to, to.duration_since(from));
    if let Some(w) = Arc::into_inner(writer) {
        w.stop().await;
    }
    for s in servers {
        s.kill().await;
    }
    store.shutdown().await;

    say!(
        "  commit latency at {writers} writers (1 KiB appends, 4 safekeepers on this disk): without a change p50 {:.2} ms, p99 {:.2} ms ({} appends in {secs:.1} s)",
        pct(&baseline, 0.5),
        pct(&baseline, 0.99),
        baseline.len()
    );
    say!(
        "  during the replace of safekeeper 2 by 3 ({}; {} pulled first, {:.0} ms for the change, ending at {}): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} appends)",
        match new_member_dir {
            Some(d) => format!("its data on {}", d.display()),
            None => "its data on the same disk".to_string(),
        },
        humanize_bytes(report.bytes),
        to.duration_since(from).as_secs_f64() * 1e3,
        switched.describe(),
        pct(&during, 0.5),
        pct(&during, 0.99),
        pct(&during, 1.0),
        during.len()
    );
    let (p50s, p99s) = windows;
    if let (Some(mid50), Some(high50), Some(mid), Some(high)) = (
        p50s.get(p50s.len() / 2),
        p50s.get(p50s.len() * 9 / 10),
        p99s.get(p99s.len() / 2),
        p99s.get(p99s.len() * 9 / 10),
    ) {
        say!(
            "  without a change, in {} windows as long as the change: p50 median {:.2} ms, 90th percentile {:.2} ms ({:.2}x the whole run's); p99 median {:.2} ms, 90th percentile {:.2} ms; the change's p99 / that median: {:.2}x",
            p99s.len(),
            mid50,
            high50,
            high50 / pct(&baseline, 0.5).max(1e-9),
            mid,
            high,
            pct(&during, 0.99) / mid.max(1e-9)
        );
    }
    say!(
        "  from the new member's start (it keeps up from its peers meanwhile) to the change's end, {:.0} ms: p50 {:.2} ms, p99 {:.2} ms ({} appends)",
        to.duration_since(joined).as_secs_f64() * 1e3,
        pct(&around, 0.5),
        pct(&around, 0.99),
        around.len()
    );
    say!(
        "  during a change / without: p50 {:.2}x, p99 {:.2}x (goal: within 2x); from the new member's start: p50 {:.2}x, p99 {:.2}x",
        pct(&during, 0.5) / pct(&baseline, 0.5).max(1e-9),
        pct(&during, 0.99) / pct(&baseline, 0.99).max(1e-9),
        pct(&around, 0.5) / pct(&baseline, 0.5).max(1e-9),
        pct(&around, 0.99) / pct(&baseline, 0.99).max(1e-9)
    );
    Ok(())
}

/// The p50s and p99s (ms) of the windows of length `len` in `[from, to)`,
/// each sorted: how much a window as short as a change varies without one.
fn same_length_windows(
    l: &Latencies,
    from: Instant,
    to: Instant,
    len: Duration,
) -> (Vec<f64>, Vec<f64>) {
    let (mut p50s, mut p99s) = (Vec::new(), Vec::new());
    if len.is_zero() {
        return (p50s, p99s);
    }
    let mut at = from;
    while at + len <= to {
        let window = l.between(at, at + len);
        if !window.is_empty() {
            p50s.push(pct(&window, 0.5));
            p99s.push(pct(&window, 0.99));
        }
        at += len;
    }
    p50s.sort_by(f64::total_cmp);
    p99s.sort_by(f64::total_cmp);
    (p50s, p99s)
}

fn humanize_bytes(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

fn start_writer(conf: &Configuration) -> Arc<Writer> {
    let members = conf.all_members();
    let mut proposer = ProposerConfig::new(
        bench_cluster(),
        members.len(),
        1,
        ferry_wal::segment::DEFAULT_SEGMENT_BYTES,
        7,
    );
    proposer.configuration = Some(conf.clone());
    let mut config = WriterConfig::new(members.iter().map(|m| m.addr.clone()).collect(), proposer);
    config.reconnect_delay = Duration::from_millis(20);
    Arc::new(Writer::start(Arc::new(TcpNetwork), config))
}
