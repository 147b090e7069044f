//! `ferry bench wal --rebuild`: how long a lost safekeeper takes to be
//! rebuilt from a peer (`ferry_safekeeper::pull`) as its timeline grows.
//!
//! For each timeline size, a donor safekeeper gets that much committed WAL
//! through its acceptor (real segments on this disk, fsynced), removes
//! everything below the last `--rebuild-kept-mib` (as a removal horizon
//! behind every consumer does), and serves it on loopback TCP; the pull of
//! a new safekeeper from it is timed. A pull copies only the WAL above the
//! horizon, so its time should not grow with the timeline: the goal is the
//! same time, within 20%, for every size. The floor is the same bytes
//! written and fsynced by this process into one file. The file system is
//! synced before each pull, so that no write-back of the timeline's
//! building or removal lands on it.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use ferry_env::{Disk, Network, RealDisk, TcpNetwork};
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig, RemovalHorizon};
use ferry_safekeeper::server::SafekeeperServer;
use ferry_wal::proto::{AppendRequest, ProposerElected};
use ferry_wal::segment::SegmentSize;
use ferry_wal::{Lsn, TermHistory, TermLsn};

use crate::wal::{bench_cluster, insert_of};

/// WAL appended at once while a timeline is built.
const APPEND_BYTES: usize = 8 << 20;

/// Builds, serves and pulls one timeline of `timeline` bytes keeping the
/// last `kept`: the pull's seconds and the bytes it copied.
async fn one(root: &std::path::Path, timeline: u64, kept: u64) -> anyhow::Result<(f64, u64)> {
    let seg = SegmentSize::new(ferry_wal::segment::DEFAULT_SEGMENT_BYTES)?;
    let dir = root.join(format!("rebuild-{}", timeline >> 20));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(&dir)?);
    let config = |node| AcceptorConfig {
        cluster_id: bench_cluster(),
        node_id: node,
        timeline_id: 1,
        segment_size: seg,
        preallocation: Default::default(),
    };
    let mut donor = Acceptor::create(Arc::clone(&disk), "donor", config(0)).await?;
    donor.handle_vote(1).await?;
    donor
        .handle_elected(&ProposerElected {
            term: 1,
            start_streaming_at: Lsn(0),
            term_history: TermHistory(vec![TermLsn {
                term: 1,
                lsn: Lsn(0),
            }]),
            timeline_start_lsn: Lsn(0),
            rejoin: false,
        })
        .await?;
    // Whole records up to the size; each append carries the commit of the
    // one before (a safekeeper learns commit_lsn from the next message).
    let mut end = Lsn(0);
    let mut block = 0u64;
    while end.0 < timeline {
        let wal = insert_of(APPEND_BYTES, block);
        let next = Lsn(end.0 + wal.len() as u64);
        donor
            .append_no_flush(&AppendRequest {
                term: 1,
                begin_lsn: end,
                end_lsn: next,
                commit_lsn: end,
                truncate_lsn: end,
                wal,
                ..AppendRequest::default()
            })
            .await?;
        donor.flush_appends().await?;
        end = next;
        block += 1;
    }
    donor
        .append_no_flush(&AppendRequest {
            term: 1,
            begin_lsn: end,
            end_lsn: end,
            commit_lsn: end,
            truncate_lsn: end,
            ..AppendRequest::default()
        })
        .await?;
    donor.flush_appends().await?;
    let horizon = Lsn(end.0.saturating_sub(kept));
    donor
        .remove_old_wal(&RemovalHorizon {
            replicas: horizon,
            peers: horizon,
            backup: None,
            walsenders: None,
            pulls: None,
        })
        .await?;
    // The removals' and appends' write-back done, so that it lands on no
    // pull (it would on the larger timeline only).
    tokio::task::spawn_blocking(rustix::fs::sync).await?;
    let network: Arc<dyn Network> = Arc::new(TcpNetwork);
    let server = SafekeeperServer::start(Arc::clone(&network), "127.0.0.1:0", donor).await?;
    // The median of a few pulls, each into an empty data dir.
    let mut runs = Vec::new();
    let mut bytes = 0;
    for run in 0..PULLS {
        let target = format!("pulled-{run}");
        let started = Instant::now();
        let report = ferry_safekeeper::pull::pull_from_peer(
            Arc::clone(&disk),
            &target,
            &config(1),
            network.as_ref(),
            server.addr(),
            None,
        )
        .await?;
        runs.push(started.elapsed().as_secs_f64());
        anyhow::ensure!(
            report.commit_lsn == end,
            "the pull ended at {}, not at the donor's commit {end}",
            report.commit_lsn
        );
        bytes = report.bytes;
        let target = dir.join(&target);
        std::fs::remove_dir_all(&target)
            .with_context(|| format!("removing {}", target.display()))?;
        tokio::task::spawn_blocking(rustix::fs::sync).await?;
    }
    server.shutdown().await;
    std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    runs.sort_by(f64::total_cmp);
    Ok((runs[runs.len() / 2], bytes))
}

/// Pulls timed per timeline; the median is reported.
const PULLS: usize = 3;

/// The floor: `bytes` written in 8 MiB pieces into one file and fsynced,
/// by this process on this disk: seconds.
fn floor(root: &std::path::Path, bytes: u64) -> anyhow::Result<f64> {
    use std::io::Write;
    let path = root.join("rebuild-floor");
    let chunk = vec![7u8; APPEND_BYTES];
    let started = Instant::now();
    let mut f = std::fs::File::create(&path)?;
    let mut written = 0u64;
    while written < bytes {
        let n = (bytes - written).min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])?;
        written += n as u64;
    }
    f.sync_data()?;
    let secs = started.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(secs)
}

/// Runs the rebuild measurement for each of `timelines_mib`, keeping the
/// last `kept_mib` of each.
pub async fn rebuild_runs(
    root: &std::path::Path,
    timelines_mib: &[u64],
    kept_mib: u64,
    membership_secs: f64,
    new_member_dir: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let kept = kept_mib << 20;
    say!(
        "rebuilding a lost safekeeper from a peer (pull over loopback TCP, 16 MiB segments), the peer keeping the last {kept_mib} MiB of its timeline:"
    );
    let floor_secs = floor(root, kept)?;
    let mut times = Vec::new();
    for &mib in timelines_mib {
        let (secs, bytes) = one(root, mib << 20, kept).await?;
        say!(
            "  timeline {mib} MiB: pulled {} MiB in {secs:.3} s (median of {PULLS}) ({:.0} MB/s); {:.2}x the floor ({floor_secs:.3} s to write and fsync those bytes here)",
            bytes >> 20,
            bytes as f64 / secs.max(1e-9) / 1e6,
            secs / floor_secs.max(1e-9)
        );
        times.push((mib, secs));
    }
    if let (Some(&(small, a)), Some(&(large, b))) = (times.first(), times.last()) {
        say!(
            "  the {large} MiB timeline's pull took {:.2}x the {small} MiB one's (goal: within 1.20x)",
            b / a.max(1e-9)
        );
    }
    crate::membership::membership_run(root, membership_secs, 64, new_member_dir).await
}
