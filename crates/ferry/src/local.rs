//! A WAL quorum inside one process: safekeepers on loopback TCP with their data
//! under one directory, and a writer connected to them. Used by `ferry dev` and by
//! `ferry bench wal`.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use ferry_env::{Disk, RealDisk, TcpNetwork};
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig, AcceptorStatus};
use ferry_safekeeper::server::SafekeeperServer;
use ferry_safekeeper::wal_storage::Preallocation;
use ferry_wal::segment::SegmentSize;
use ferry_writer::driver::{Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;

/// The timeline every local deployment writes.
pub const TIMELINE_ID: u64 = 1;

/// Opens safekeeper `id` from `dir/sk<id>` and serves it on `listen`.
pub async fn start_safekeeper(
    disk: Arc<dyn Disk>,
    id: u64,
    listen: &str,
    segment: SegmentSize,
    preallocation: Preallocation,
) -> anyhow::Result<Arc<SafekeeperServer>> {
    let acceptor = Acceptor::open(
        disk,
        &format!("sk{id}"),
        AcceptorConfig {
            node_id: id,
            timeline_id: TIMELINE_ID,
            segment_size: segment,
            preallocation,
        },
    )
    .await
    .with_context(|| format!("opening safekeeper {id}"))?;
    let server = SafekeeperServer::start(Arc::new(TcpNetwork), listen, acceptor)
        .await
        .with_context(|| format!("listening on {listen}"))?;
    Ok(Arc::new(server))
}

pub struct LocalQuorum {
    pub safekeepers: Vec<Arc<SafekeeperServer>>,
    pub writer: Writer,
}

impl LocalQuorum {
    /// Starts `n` safekeepers under `dir` on free loopback ports and a writer.
    pub async fn start(
        dir: &Path,
        n: usize,
        segment: SegmentSize,
        preallocation: Preallocation,
    ) -> anyhow::Result<LocalQuorum> {
        let disk: Arc<dyn Disk> =
            Arc::new(RealDisk::open_root(dir).context("opening the WAL directory")?);
        let mut safekeepers = Vec::new();
        for id in 0..n as u64 {
            safekeepers.push(
                start_safekeeper(Arc::clone(&disk), id, "127.0.0.1:0", segment, preallocation)
                    .await?,
            );
        }
        let addrs = safekeepers.iter().map(|s| s.addr().to_string()).collect();
        let proposer_id = u128::from(std::process::id()) << 64 | u128::from(n as u64);
        let mut config = WriterConfig::new(
            addrs,
            ProposerConfig::new(n, TIMELINE_ID, segment.bytes(), proposer_id),
        );
        // These safekeepers are this process's own: any higher term is one left
        // by an earlier run, never a live rival.
        config.reelect_when_superseded = true;
        let writer = Writer::start(Arc::new(TcpNetwork), config);
        Ok(LocalQuorum {
            safekeepers,
            writer,
        })
    }

    pub async fn safekeeper_status(&self) -> Vec<AcceptorStatus> {
        let mut out = Vec::new();
        for s in &self.safekeepers {
            out.push(s.status().await);
        }
        out
    }

    /// Clean shutdown: the writer's checkpoint is committed, then the safekeepers
    /// persist their positions and stop.
    pub async fn shutdown(self) -> anyhow::Result<ferry_wal::Lsn> {
        let end = self.writer.shutdown().await;
        for s in &self.safekeepers {
            s.shutdown().await;
        }
        end.context("writer shutdown checkpoint")
    }
}
