//! A WAL quorum inside one process: safekeepers on loopback TCP with their data
//! under one directory, and a writer connected to them. Used by `ferry dev` and by
//! `ferry bench wal`.
//!
//! A safekeeper whose data is missing or damaged is not started: it is reported
//! down (with the reason) and the others go on, as long as they are a quorum.
//! Nothing here ever recreates a safekeeper that existed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use ferry_env::{Disk, Listener, Network, RealDisk, TcpNetwork};
use ferry_node::{SafekeeperNodeError, SafekeeperOpen};
use ferry_safekeeper::acceptor::AcceptorConfig;
use ferry_safekeeper::backup::BackupConfig;
use ferry_safekeeper::server::{SafekeeperServer, ServerConfig};
use ferry_safekeeper::wal_storage::Preallocation;
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn, Term};
use ferry_writer::driver::{BackPressure, Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;
use serde::Serialize;

use crate::lockfile::DirLock;

/// The timeline every local deployment writes.
pub const TIMELINE_ID: u64 = 1;

/// How to open (or create) safekeeper `id` in `<root>/sk<id>`.
#[derive(Debug, Clone)]
pub struct SafekeeperSpec {
    pub cluster_id: ClusterId,
    pub segment: SegmentSize,
    pub preallocation: Preallocation,
    /// Create it if it has no control file (a new cluster or member only).
    pub create: bool,
    /// Rebuild it from the WAL backup if it has no control file (its data
    /// was lost); it votes again only once a writer brought it back.
    pub restore: bool,
    /// Rebuild it from one of these peers (safekeeper addresses, tried in
    /// order) if it has no control file: only the WAL above the peer's
    /// removal horizon is copied; with `restore` too, the backup is the
    /// fallback when no peer can be pulled from. It votes again only once a
    /// writer brought it back.
    pub pull_from: Vec<String>,
    /// Backup and WAL removal.
    pub server: ServerConfig,
}

/// The WAL backup and removal flags of every command that runs safekeepers.
#[derive(Debug, Clone, clap::Args)]
pub struct WalServiceArgs {
    /// Where whole WAL segments are backed up: `file:///dir` or
    /// `s3://bucket/prefix` (S3 settings from the usual AWS_* variables).
    /// One safekeeper, chosen by the writer, uploads each segment once it is
    /// committed; with a backup, WAL is removed locally only once it is
    /// backed up. `ferry dev` backs up to `<data dir>/wal-backup` unless
    /// this is given.
    #[arg(long, env = "FERRY_WAL_BACKUP")]
    pub wal_backup: Option<String>,
    /// Segment uploads in flight.
    #[arg(long, default_value_t = ferry_safekeeper::backup::DEFAULT_PARALLEL_JOBS as u64,
          value_parser = clap::value_parser!(u64).range(1..=ferry_safekeeper::backup::MAX_PARALLEL_JOBS as u64))]
    pub wal_backup_parallel_jobs: u64,
    /// Keep the WAL that the slowest active walsender has not sent yet: a
    /// lagging replica reads it from the safekeeper, not from the backup.
    #[arg(long)]
    pub walsenders_keep_horizon: bool,
    /// How often segments behind every consumer are removed (e.g. `5s`).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub wal_removal_interval: std::time::Duration,
    /// Never remove WAL segments locally.
    #[arg(long)]
    pub keep_all_wal: bool,
    /// Also back up the flushed prefix of the segment being written, once
    /// flush_lsn stayed in it for --partial-backup-timeout (needs a backup).
    #[arg(long)]
    pub partial_backup_enabled: bool,
    /// How long flush_lsn must stay in one segment before its prefix is
    /// uploaded (e.g. `15m`, `2s`).
    #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
    pub partial_backup_timeout: std::time::Duration,
    /// How long a safekeeper restored from the backup waits after starting
    /// before a writer may bring it back; must exceed every writer's
    /// election timeout (3 s), so that no election still holds a vote the
    /// lost data gave.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub restore_quarantine: std::time::Duration,
    /// Appends are refused (the API answers 503 `disk_full`, nothing
    /// written) while less than this is free on the file system of a
    /// safekeeper's data dir, and taken again by themselves once an eighth
    /// more is free: `512MiB`, `2GiB`, a number of bytes, or `0` (never).
    #[arg(long, default_value = "1GiB", value_parser = crate::paths::parse_byte_size)]
    pub min_free_disk: u64,
    /// A registered replica whose feedback has not changed for this long
    /// (e.g. `1day`, `6h`) is forgotten, with a warning: it stops holding WAL
    /// removal and back-pressure. If it comes back later it reads the removed
    /// WAL from the backup (without one it stops, naming the LSN it needs).
    /// `ferry replica unregister` forgets one at once.
    #[arg(long, default_value = "1day", value_parser = humantime::parse_duration)]
    pub replica_expiry: std::time::Duration,
}

impl WalServiceArgs {
    /// The server configuration these flags ask for; `default_backup` is
    /// used when no backup is given (`ferry dev`'s folder in its data dir).
    pub fn server_config(&self, default_backup: Option<&Path>) -> anyhow::Result<ServerConfig> {
        let url = match (&self.wal_backup, default_backup) {
            (Some(url), _) => Some(url.clone()),
            (None, Some(dir)) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating the WAL backup folder {}", dir.display()))?;
                let dir = dir
                    .canonicalize()
                    .with_context(|| format!("resolving {}", dir.display()))?;
                Some(format!("file://{}", dir.display()))
            }
            (None, None) => None,
        };
        let backup = match url {
            Some(url) => Some(BackupConfig {
                location: ferry_storage::open(&url, &crate::s3_settings_from_env())
                    .with_context(|| format!("the WAL backup location {url}"))?,
                parallel_jobs: self.wal_backup_parallel_jobs as usize,
            }),
            None => None,
        };
        anyhow::ensure!(
            !self.wal_removal_interval.is_zero(),
            "--wal-removal-interval must be more than zero"
        );
        anyhow::ensure!(
            !self.partial_backup_enabled || backup.is_some(),
            "--partial-backup-enabled needs a WAL backup (--wal-backup)"
        );
        anyhow::ensure!(
            !self.replica_expiry.is_zero(),
            "--replica-expiry must be more than zero"
        );
        anyhow::ensure!(
            !self.partial_backup_timeout.is_zero(),
            "--partial-backup-timeout must be more than zero"
        );
        Ok(ServerConfig {
            backup,
            walsenders_keep_horizon: self.walsenders_keep_horizon,
            removal_interval: self.wal_removal_interval,
            remove_wal: !self.keep_all_wal,
            restore_quarantine: self.restore_quarantine,
            replica_expiry: self.replica_expiry,
            min_free_disk: self.min_free_disk,
            peer_recovery: None,
            partial_backup: self.partial_backup_enabled.then_some(
                ferry_safekeeper::partial::PartialBackupConfig {
                    timeout: self.partial_backup_timeout,
                },
            ),
        })
    }
}

/// A running safekeeper and the lock on its directory.
pub struct LocalSafekeeper {
    pub server: Arc<SafekeeperServer>,
    _lock: DirLock,
}

/// Opens safekeeper `id` from `<root>/sk<id>` (taking the lock on that
/// directory: one process per safekeeper) and serves it on `listener`.
pub async fn start_safekeeper(
    root: &Path,
    id: u64,
    listener: Box<dyn Listener>,
    spec: &SafekeeperSpec,
) -> anyhow::Result<LocalSafekeeper> {
    let node_dir = root.join(format!("sk{id}"));
    if spec.restore || !spec.pull_from.is_empty() {
        std::fs::create_dir_all(&node_dir)
            .with_context(|| format!("creating {}", node_dir.display()))?;
    }
    if !spec.create && !node_dir.is_dir() {
        anyhow::bail!(
            "{}: no such safekeeper directory; this safekeeper was never created here, or its data was lost (an empty safekeeper is created only explicitly)",
            node_dir.display()
        );
    }
    let lock = crate::lockfile::lock_dir(&node_dir)?;
    let disk: Arc<dyn Disk> =
        Arc::new(RealDisk::open_root(root).with_context(|| format!("opening {}", root.display()))?);
    let config = AcceptorConfig {
        cluster_id: spec.cluster_id.clone(),
        node_id: id,
        timeline_id: TIMELINE_ID,
        segment_size: spec.segment,
        preallocation: spec.preallocation,
    };
    let dir = format!("sk{id}");
    let lost = !node_dir
        .join(ferry_safekeeper::control::CONTROL_FILE)
        .exists();
    let pulled = if lost && !spec.pull_from.is_empty() {
        pull_if_lost(&disk, &dir, &node_dir, &config, spec).await?
    } else {
        false
    };
    if spec.restore && !pulled {
        restore_if_lost(&disk, &dir, &node_dir, &config, spec).await?;
    }
    let open = if spec.create {
        SafekeeperOpen::Create
    } else {
        SafekeeperOpen::Open
    };
    let server =
        ferry_node::start_safekeeper(disk, &dir, open, config, listener, spec.server.clone())
            .await
            .map_err(|e| match e {
                SafekeeperNodeError::State(e) => anyhow::Error::new(e)
                    .context(format!("safekeeper {id} in {}", node_dir.display())),
                SafekeeperNodeError::Serve(e) => {
                    anyhow::Error::new(e).context(format!("serving safekeeper {id}"))
                }
            })?;
    Ok(LocalSafekeeper {
        server: Arc::new(server),
        _lock: lock,
    })
}

/// How long a restore is retried while the backup is incomplete or the
/// object store fails, before the safekeeper gives up starting.
const RESTORE_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(300);

/// Rebuilds each down member whose folder holds no control file (lost, not
/// damaged: a damaged one is left as it is, for its operator) from the
/// members that started, and starts it.
async fn pull_lost_members(spec: &QuorumSpec, members: &mut [Member]) -> anyhow::Result<()> {
    let peers: Vec<String> = members
        .iter()
        .filter_map(|m| m.server().map(|s| s.addr().to_string()))
        .collect();
    if peers.is_empty() {
        return Ok(());
    }
    for member in members.iter_mut() {
        let Member::Down { id, reason } = member else {
            continue;
        };
        let id = *id;
        let node_dir = spec.dir.join(format!("sk{id}"));
        if node_dir
            .join(ferry_safekeeper::control::CONTROL_FILE)
            .exists()
        {
            continue;
        }
        let mut sk = spec.safekeeper.clone();
        sk.pull_from = peers.clone();
        let listener = TcpNetwork
            .bind("127.0.0.1:0")
            .await
            .context("binding a loopback port for a safekeeper")?;
        match start_safekeeper(&spec.dir, id, listener, &sk).await {
            Ok(started) => *member = Member::Up(started),
            Err(e) => *reason = format!("{e:#}"),
        }
    }
    Ok(())
}

/// How long a pull is retried (every peer in turn) before the safekeeper
/// gives up starting, or falls back to the backup.
const PULL_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(120);

/// Rebuilds lost safekeeper `dir` (no control file) from one of the peers
/// `spec.pull_from` names (see `ferry_safekeeper::pull`). Returns whether it
/// did; `false` when every peer failed for [`PULL_RETRY_FOR`] and the
/// backup is the fallback (`spec.restore`), an error otherwise.
async fn pull_if_lost(
    disk: &Arc<dyn Disk>,
    dir: &str,
    node_dir: &Path,
    config: &AcceptorConfig,
    spec: &SafekeeperSpec,
) -> anyhow::Result<bool> {
    let backup = spec.server.backup.as_ref().map(|b| &b.location);
    let mut waited = std::time::Duration::ZERO;
    let mut pause = std::time::Duration::from_secs(1);
    let mut errors = Vec::new();
    loop {
        for peer in &spec.pull_from {
            say!(
                "safekeeper {}: {} holds no control file; pulling from peer {peer}",
                config.node_id,
                node_dir.display()
            );
            match ferry_safekeeper::pull::pull_from_peer(
                Arc::clone(disk),
                dir,
                config,
                &TcpNetwork,
                peer,
                backup,
            )
            .await
            {
                Ok(report) => {
                    say!(
                        "safekeeper {}: pulled from {}: WAL {}..{} ({} bytes; below it, the backup), term {}; it votes again once a writer brings it back (after {})",
                        config.node_id,
                        report.donor,
                        report.start_lsn,
                        report.commit_lsn,
                        report.bytes,
                        report.term,
                        humantime::format_duration(spec.server.restore_quarantine)
                    );
                    return Ok(true);
                }
                Err(e @ ferry_safekeeper::pull::PullError::Exists(_)) => {
                    return Err(anyhow::Error::new(e))
                }
                Err(e) => {
                    say!(
                        "safekeeper {}: pull from {peer} failed: {e}",
                        config.node_id
                    );
                    errors.push(format!("{peer}: {e}"));
                }
            }
        }
        if waited >= PULL_RETRY_FOR {
            break;
        }
        tokio::time::sleep(pause).await;
        waited += pause;
        pause = (pause * 2).min(std::time::Duration::from_secs(15));
    }
    if spec.restore {
        say!(
            "safekeeper {}: no peer could be pulled from; restoring from the backup instead",
            config.node_id
        );
        return Ok(false);
    }
    anyhow::bail!(
        "safekeeper {}: no peer could be pulled from for {}: {}",
        config.node_id,
        humantime::format_duration(PULL_RETRY_FOR),
        errors.last().cloned().unwrap_or_default()
    )
}

/// Rebuilds safekeeper `dir` from the backup when it has no control file;
/// one that has its control file starts as it is (the flag can stay on).
async fn restore_if_lost(
    disk: &Arc<dyn Disk>,
    dir: &str,
    node_dir: &Path,
    config: &AcceptorConfig,
    spec: &SafekeeperSpec,
) -> anyhow::Result<()> {
    let Some(backup) = &spec.server.backup else {
        anyhow::bail!("--restore-from-backup needs the WAL backup (--wal-backup)");
    };
    if node_dir
        .join(ferry_safekeeper::control::CONTROL_FILE)
        .exists()
    {
        say!(
            "safekeeper {}: {} holds its control file; starting it as it is (nothing to restore)",
            config.node_id,
            node_dir.display()
        );
        return Ok(());
    }
    say!(
        "safekeeper {}: restoring from {} into {}",
        config.node_id,
        backup.location.url(),
        node_dir.display()
    );
    // The backup may be briefly incomplete (the running safekeepers upload
    // segments in parallel) or the object store briefly unreachable: the
    // restore is retried with back-off for a while. A restore cleans up
    // after an attempt that stopped midway, so an attempt starts afresh.
    let mut waited = std::time::Duration::ZERO;
    let mut pause = std::time::Duration::from_secs(1);
    let report = loop {
        use ferry_safekeeper::restore::RestoreError;
        match ferry_safekeeper::restore::restore_from_backup(
            Arc::clone(disk),
            dir,
            config,
            &backup.location,
        )
        .await
        {
            Ok(report) => break report,
            Err(e @ (RestoreError::Incomplete { .. } | RestoreError::Storage(_)))
                if waited < RESTORE_RETRY_FOR =>
            {
                say!(
                    "safekeeper {}: restore attempt failed ({e}); retrying in {}",
                    config.node_id,
                    humantime::format_duration(pause)
                );
                tokio::time::sleep(pause).await;
                waited += pause;
                pause = (pause * 2).min(std::time::Duration::from_secs(30));
            }
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "restoring safekeeper {} from the backup",
                    config.node_id
                )))
            }
        }
    };
    say!(
        "safekeeper {}: restored {} whole segments{} ({} bytes), WAL up to {}; it votes again once a writer brings it back (after {})",
        config.node_id,
        report.whole_segments,
        report
            .partial
            .as_deref()
            .map(|p| format!(" and partial {p}"))
            .unwrap_or_default(),
        report.bytes,
        report.restored_lsn,
        humantime::format_duration(spec.server.restore_quarantine)
    );
    Ok(())
}

/// One member of a local quorum.
pub enum Member {
    Up(LocalSafekeeper),
    /// Not started: its data is missing or damaged (the reason says how).
    Down {
        id: u64,
        reason: String,
    },
}

impl Member {
    /// The running server, if the member is up.
    pub fn server(&self) -> Option<&Arc<SafekeeperServer>> {
        match self {
            Member::Up(sk) => Some(&sk.server),
            Member::Down { .. } => None,
        }
    }
}

/// What `/status` shows of a member.
#[derive(Debug, Serialize)]
pub struct MemberStatus {
    pub node_id: u64,
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(flatten)]
    pub status: Option<ferry_safekeeper::acceptor::AcceptorStatus>,
}

/// Everything that shapes a local quorum.
#[derive(Debug, Clone)]
pub struct QuorumSpec {
    pub dir: PathBuf,
    pub safekeepers: usize,
    pub safekeeper: SafekeeperSpec,
    /// Elect above this term (the last one the cluster is known to have used).
    pub min_term: Term,
    /// WAL known committed (see `ProposerConfig::known_commit_lsn`).
    pub known_commit_lsn: Lsn,
    /// The writer's lag limits.
    pub back_pressure: BackPressure,
    /// A member whose folder was lost (no control file) is rebuilt from a
    /// member that started (`ferry_safekeeper::pull`) instead of left down.
    pub pull_lost: bool,
}

/// The writer's back-pressure flags (Neon's `max_replication_*_lag`).
#[derive(Debug, Clone, clap::Args)]
pub struct BackPressureArgs {
    /// Inserts wait while the end of WAL is more than this many bytes ahead
    /// of what the slowest replica received (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub max_replication_write_lag: u64,
    /// Inserts wait while the end of WAL is more than this many bytes ahead
    /// of what the slowest replica made durable in its parts (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub max_replication_flush_lag: u64,
    /// Inserts wait while the end of WAL is more than this many bytes ahead
    /// of the slowest replica's remote_consistent_lsn (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub max_replication_apply_lag: u64,
}

impl BackPressureArgs {
    pub fn limits(&self) -> BackPressure {
        BackPressure {
            max_write_lag: self.max_replication_write_lag,
            max_flush_lag: self.max_replication_flush_lag,
            max_apply_lag: self.max_replication_apply_lag,
        }
    }
}

pub struct LocalQuorum {
    pub members: Vec<Member>,
    /// Shared with the insert API while it runs; stopping needs it back.
    pub writer: Arc<Writer>,
}

impl LocalQuorum {
    /// Starts the safekeepers under `spec.dir` on free loopback ports and a
    /// writer. A safekeeper that cannot open is left down; fewer than a quorum
    /// up is an error (and then nothing keeps running).
    pub async fn start(spec: &QuorumSpec) -> anyhow::Result<LocalQuorum> {
        let n = spec.safekeepers;
        let mut members = Vec::with_capacity(n);
        for id in 0..n as u64 {
            let listener = TcpNetwork
                .bind("127.0.0.1:0")
                .await
                .context("binding a loopback port for a safekeeper")?;
            match start_safekeeper(&spec.dir, id, listener, &spec.safekeeper).await {
                Ok(sk) => members.push(Member::Up(sk)),
                Err(e) if !spec.safekeeper.create => {
                    tracing::error!(
                        safekeeper = id,
                        error = format!("{e:#}"),
                        "safekeeper is down"
                    );
                    members.push(Member::Down {
                        id,
                        reason: format!("{e:#}"),
                    });
                }
                Err(e) => return Err(e),
            }
        }
        if spec.pull_lost {
            pull_lost_members(spec, &mut members).await?;
        }
        let up = members
            .iter()
            .filter(|m| matches!(m, Member::Up(_)))
            .count();
        let quorum = n / 2 + 1;
        if up < quorum {
            let reasons: Vec<String> = members
                .iter()
                .filter_map(|m| match m {
                    Member::Down { id, reason } => Some(format!("safekeeper {id}: {reason}")),
                    Member::Up(_) => None,
                })
                .collect();
            for m in &members {
                if let Member::Up(sk) = m {
                    sk.server.shutdown().await;
                }
            }
            anyhow::bail!(
                "only {up} of {n} safekeepers can start and a quorum needs {quorum}; refusing to run on less (committed WAL could be lost):\n  {}",
                reasons.join("\n  ")
            );
        }
        let addrs = members
            .iter()
            .map(|m| match m {
                Member::Up(sk) => sk.server.addr().to_string(),
                Member::Down { .. } => String::new(),
            })
            .collect();
        let proposer_id = u128::from(std::process::id()) << 64 | u128::from(n as u64);
        let mut proposer = ProposerConfig::new(
            spec.safekeeper.cluster_id.clone(),
            n,
            TIMELINE_ID,
            spec.safekeeper.segment.bytes(),
            proposer_id,
        );
        proposer.min_term = spec.min_term;
        proposer.known_commit_lsn = spec.known_commit_lsn;
        let mut config = WriterConfig::new(addrs, proposer);
        // These safekeepers are this process's own: any higher term is one left
        // by an earlier run, never a live rival.
        config.reelect_when_superseded = true;
        config.back_pressure = spec.back_pressure;
        config.replica_expiry = spec.safekeeper.server.replica_expiry;
        let writer = Writer::start(Arc::new(TcpNetwork), config);
        Ok(LocalQuorum {
            members,
            writer: Arc::new(writer),
        })
    }

    /// The running safekeepers.
    pub fn servers(&self) -> impl Iterator<Item = &Arc<SafekeeperServer>> {
        self.members.iter().filter_map(Member::server)
    }

    pub async fn member_status(&self) -> Vec<MemberStatus> {
        let mut out = Vec::new();
        for m in &self.members {
            out.push(match m {
                Member::Up(sk) => {
                    let status = sk.server.status().await;
                    let stopped = sk.server.failure().borrow().clone();
                    MemberStatus {
                        node_id: status.node_id,
                        state: if stopped.is_some() { "down" } else { "up" },
                        reason: stopped,
                        status: Some(status),
                    }
                }
                Member::Down { id, reason } => MemberStatus {
                    node_id: *id,
                    state: "down",
                    reason: Some(reason.clone()),
                    status: None,
                },
            });
        }
        out
    }

    /// Stops without a checkpoint (the writer was never elected).
    pub async fn stop(self) {
        match Arc::into_inner(self.writer) {
            Some(w) => w.stop().await,
            None => tracing::warn!("writer still shared at stop; it stops with the process"),
        }
        for s in self.members.iter().filter_map(Member::server) {
            s.shutdown().await;
        }
    }

    /// Clean shutdown: the writer's checkpoint is committed, then the safekeepers
    /// persist their positions and stop.
    /// The clean stop that also waits, at most `timeout`, until the
    /// `replicas` (shard, replica) applied the shutdown checkpoint durably;
    /// a replica still behind then is reported, not an error (it catches up
    /// from the safekeepers at its next start).
    pub async fn shutdown_waiting_for(
        self,
        replicas: &[(u32, u32)],
        timeout: std::time::Duration,
    ) -> anyhow::Result<Lsn> {
        let writer = Arc::into_inner(self.writer)
            .context("the writer is still in use (an insert still running?)")?;
        let end = if replicas.is_empty() {
            writer.shutdown().await
        } else {
            match writer
                .shutdown_and_wait_for_replicas(replicas, timeout)
                .await
            {
                Err(ferry_writer::driver::WriterError::ReplicasBehind { end, behind }) => {
                    tracing::warn!(?behind, %end, "replicas had not applied the shutdown checkpoint");
                    say!(
                        "replicas {behind:?} had not applied everything up to {end} after {}; they catch up at the next start",
                        humantime::format_duration(timeout)
                    );
                    Ok(end)
                }
                other => other,
            }
        };
        for s in self.members.iter().filter_map(Member::server) {
            s.shutdown().await;
        }
        end.context("writer shutdown checkpoint")
    }
}
