//! The replica's walreceiver: streams committed WAL of its shard from one
//! safekeeper after another, hands it to the [`Replica`](crate::Replica), and sends feedback.
//!
//! It starts every stream at the replica's applied position
//! (`disk_consistent_lsn`), so WAL received but not applied before a
//! disconnect is simply received again. A connection that breaks or stays
//! silent past [`StreamConfig::silence_timeout`] (a partition sends no reset)
//! is dropped and the next safekeeper tried. A safekeeper can also fall
//! behind while it still talks (one cut off from the writer keeps sending
//! keepalives with the commit position it last learned): every
//! [`StreamConfig::lag_probe_interval`] the walreceiver asks the other
//! safekeepers for their `commit_lsn` (a `START_REPLICATION` at its own
//! position, whose first frame announces it) and moves to the one furthest
//! ahead when that is more than [`StreamConfig::max_lag_bytes`] past what its
//! own safekeeper announced. It only moves bytes and timers: every decision
//! about WAL is the replica's.

use std::sync::Arc;
use std::time::Duration;

use ferry_env::{Clock, Network};
use ferry_wal::proto::{self, FrameReader, FromSafekeeper, ShardFeedback, ToSafekeeper};
use ferry_wal::Lsn;
use tokio::io::AsyncWriteExt;

use crate::replica::{ReplicaError, SharedReplica};

#[derive(Debug, Clone)]
pub struct StreamConfig {
    pub safekeepers: Vec<String>,
    /// Walsenders send keepalives every second; silence this long means the
    /// connection is dead.
    pub silence_timeout: Duration,
    pub reconnect_delay: Duration,
    /// How often the other safekeepers' `commit_lsn` is probed.
    pub lag_probe_interval: Duration,
    /// How long one probe may take (connect and first frame).
    pub probe_timeout: Duration,
    /// A safekeeper announcing a `commit_lsn` more than this many bytes past
    /// the current one's makes the walreceiver move to it. Large enough that
    /// frames waiting in the connection (which announce the commit position
    /// of when they were sent) never look like lag.
    pub max_lag_bytes: u64,
    /// While open (the disk nearly full), no WAL is applied: the connection
    /// is dropped and streaming resumes once the breaker closes. The WAL
    /// waits on the safekeepers; the writer's lag limits hold inserts back.
    pub space: Option<ferry_env::space::SpaceBreaker>,
    /// The safekeepers of the recorded configuration, followed as a
    /// membership change moves them (`ferry safekeeper-set`): its latest
    /// non-empty value replaces `safekeepers`, and a stream from a
    /// safekeeper that left the set ends. `None`: `safekeepers` for good.
    pub members: Option<tokio::sync::watch::Receiver<Vec<String>>>,
}

impl StreamConfig {
    pub fn new(safekeepers: Vec<String>) -> StreamConfig {
        StreamConfig {
            safekeepers,
            silence_timeout: Duration::from_secs(3),
            reconnect_delay: Duration::from_millis(200),
            lag_probe_interval: Duration::from_secs(5),
            probe_timeout: Duration::from_secs(1),
            max_lag_bytes: 16 << 20,
            space: None,
            members: None,
        }
    }
}

/// Streams until the replica fails (hostile WAL, a disk error): returns why.
/// The pause before streaming again after the catalog was out of reach.
const CATALOG_RETRY: Duration = Duration::from_secs(1);

pub async fn run(
    replica: SharedReplica,
    network: Arc<dyn Network>,
    clock: Arc<dyn Clock>,
    config: StreamConfig,
) -> ReplicaError {
    let mut next = 0usize;
    // Safekeepers that answered that they removed the WAL at `removed_at`
    // (the replica's position then), with where their WAL starts. Once every
    // one did, the WAL is gone: retrying would loop for ever.
    let mut removed: std::collections::BTreeMap<usize, Lsn> = Default::default();
    let mut removed_at = Lsn(0);
    let mut config = config;
    if let Some(members) = config.members.as_mut() {
        members.mark_changed();
    }
    loop {
        let moved = config.members.as_mut().and_then(|m| {
            let changed = m.has_changed().unwrap_or(false);
            let list = m.borrow_and_update().clone();
            (changed && !list.is_empty()).then_some(list)
        });
        if let Some(list) = moved.filter(|l| *l != config.safekeepers) {
            tracing::info!(safekeepers = %list.join(","), "the replica streams from the recorded safekeeper set");
            config.safekeepers = list;
            removed.clear();
            next = 0;
        }
        if config.safekeepers.is_empty() {
            tokio::time::sleep(config.reconnect_delay).await;
            continue;
        }
        if let Some(space) = &config.space {
            if let Err(full) = space.check() {
                tracing::warn!(error = %full, "the replica applies no WAL until disk space returns");
                space.wait_closed().await;
                tracing::info!("disk space is back: the replica streams WAL again");
            }
        }
        let index = next % config.safekeepers.len();
        let addr = config.safekeepers[index].clone();
        next += 1;
        match stream_from(&replica, network.as_ref(), clock.as_ref(), &addr, &config).await {
            Ok(()) => {}
            Err(StreamError::Replica(e @ ReplicaError::Catalog { .. })) => {
                // The catalog was out of reach (a coordination connection
                // lost, a session expiring): nothing of the record was
                // applied, so stream it again once coordination answers,
                // rather than stop the replica on a passing fault.
                tracing::warn!(error = %e, "table lookup failed; streaming again shortly");
                tokio::time::sleep(CATALOG_RETRY.max(config.reconnect_delay)).await;
            }
            Err(StreamError::Replica(e)) => {
                tracing::error!(error = %e, "replica stopped");
                return e;
            }
            Err(StreamError::WalRemoved {
                start_lsn,
                kept_from,
            }) => {
                if start_lsn != removed_at {
                    removed.clear();
                    removed_at = start_lsn;
                }
                removed.insert(index, kept_from);
                tracing::warn!(
                    %addr,
                    needed = %start_lsn,
                    %kept_from,
                    "the safekeeper removed the WAL this replica needs, and no backup holds it"
                );
                if removed.len() == config.safekeepers.len() {
                    let horizons = removed
                        .iter()
                        .map(|(i, kept)| {
                            format!("{} holds WAL from {kept}", config.safekeepers[*i])
                        })
                        .collect::<Vec<_>>()
                        .join(", ");
                    let e = ReplicaError::WalRemoved {
                        needed: start_lsn,
                        horizons,
                    };
                    tracing::error!(error = %e, "replica stopped");
                    return e;
                }
            }
            Err(StreamError::Connection(e)) => {
                tracing::debug!(%addr, error = %e, "walreceiver connection ended");
            }
            Err(StreamError::Lagging { ahead, commit_lsn }) => {
                tracing::info!(
                    %addr,
                    to = %config.safekeepers[ahead],
                    %commit_lsn,
                    "walreceiver leaves a lagging safekeeper"
                );
                next = ahead;
                continue;
            }
        }
        tokio::time::sleep(config.reconnect_delay).await;
    }
}

enum StreamError {
    Replica(ReplicaError),
    /// The safekeeper removed the WAL from `start_lsn` on; it holds WAL from
    /// `kept_from`.
    WalRemoved {
        start_lsn: Lsn,
        kept_from: Lsn,
    },
    Connection(String),
    /// Safekeeper `ahead` (an index into the configured list) announced
    /// `commit_lsn`, further than the lag allowed past the current one.
    Lagging {
        ahead: usize,
        commit_lsn: Lsn,
    },
}

impl From<proto::FrameError> for StreamError {
    fn from(e: proto::FrameError) -> StreamError {
        StreamError::Connection(e.to_string())
    }
}

impl From<std::io::Error> for StreamError {
    fn from(e: std::io::Error) -> StreamError {
        StreamError::Connection(e.to_string())
    }
}

async fn stream_from(
    replica: &SharedReplica,
    network: &dyn Network,
    clock: &dyn Clock,
    addr: &str,
    config: &StreamConfig,
) -> Result<(), StreamError> {
    let conn = network.connect(addr).await?;
    let (read, mut write) = tokio::io::split(conn);
    let mut reader = FrameReader::new(read);
    let (shard, replica_number, start) = {
        let mut r = replica.lock().await;
        r.reset_stream();
        let s = r.subscribe().borrow().clone();
        (s.shard, s.replica, r.receive_from())
    };
    tracing::info!(%addr, %start, "streaming WAL");
    proto::write_frame(
        &mut write,
        &ToSafekeeper::StartReplication {
            shard_number: shard,
            start_lsn: start,
        },
    )
    .await?;
    write.flush().await?;
    let mut probes = tokio::time::interval(config.lag_probe_interval);
    probes.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    probes.tick().await; // the first tick is immediate
                         // The newest commit_lsn this safekeeper announced.
    let mut announced = Lsn(0);
    // Silence is measured from the last frame, whatever else the loop did
    // meanwhile (a probe must not restart it).
    let silence = tokio::time::sleep(config.silence_timeout);
    tokio::pin!(silence);
    let mut members = config.members.clone();
    loop {
        // `biased`, and `FrameReader::next` is cancel-safe: a probe tick
        // between two frames loses nothing.
        let msg = tokio::select! {
            biased;
            msg = reader.next::<FromSafekeeper>() => {
                silence
                    .as_mut()
                    .reset(tokio::time::Instant::now() + config.silence_timeout);
                msg?
            }
            () = &mut silence => return Err(StreamError::Connection("silent walsender".into())),
            changed = async {
                match members.as_mut() {
                    Some(m) => m.changed().await,
                    None => std::future::pending().await,
                }
            } => {
                if changed.is_err() {
                    // Nobody follows the set any more: the list stays.
                    members = None;
                    continue;
                }
                let left = members.as_mut().is_some_and(|m| {
                    let list = m.borrow_and_update();
                    !list.is_empty() && !list.iter().any(|a| a == addr)
                });
                if left {
                    return Err(StreamError::Connection(format!(
                        "{addr} left the safekeeper set"
                    )));
                }
                continue;
            }
            _ = probes.tick(), if config.safekeepers.len() > 1 => {
                let at = replica.lock().await.receive_from();
                if let Some((ahead, commit_lsn)) =
                    furthest_ahead(network, addr, shard, at, announced, config).await
                {
                    return Err(StreamError::Lagging { ahead, commit_lsn });
                }
                continue;
            }
        };
        let Some(msg) = msg else { return Ok(()) };
        if let FromSafekeeper::Wal { commit_lsn, .. } | FromSafekeeper::Keepalive { commit_lsn } =
            &msg
        {
            announced = announced.max(*commit_lsn);
        }
        let (received, applied) = match msg {
            FromSafekeeper::Wal {
                begin_lsn,
                commit_lsn,
                wal,
            } => {
                let end = Lsn(begin_lsn.0 + wal.len() as u64);
                if end > commit_lsn {
                    return Err(StreamError::Connection(format!(
                        "{addr} sent WAL up to {end}, past its commit_lsn {commit_lsn}"
                    )));
                }
                if let Some(full) = config.space.as_ref().and_then(|s| s.check().err()) {
                    // Not applied: streamed again from the replica's
                    // position once space returns.
                    return Err(StreamError::Connection(full.to_string()));
                }
                let mut r = replica.lock().await;
                let applied = r
                    .receive_until(begin_lsn, &wal, commit_lsn)
                    .await
                    .map_err(StreamError::Replica)?;
                (end, applied)
            }
            FromSafekeeper::Keepalive { .. } => {
                // Nothing more is coming for now: what was applied is
                // persisted.
                let mut r = replica.lock().await;
                let applied = r.flush().await.map_err(StreamError::Replica)?;
                (r.receive_from(), applied)
            }
            FromSafekeeper::Refused { reason, .. } => {
                return Err(StreamError::Connection(format!("{addr} refused: {reason}")))
            }
            FromSafekeeper::WalRemoved {
                start_lsn,
                kept_from,
            } => {
                return Err(StreamError::WalRemoved {
                    start_lsn,
                    kept_from,
                })
            }
            _ => continue,
        };
        let feedback = ShardFeedback {
            shard_number: shard,
            replica_number,
            last_received_lsn: received,
            disk_consistent_lsn: applied,
            // Parts are kept on this replica's disk only.
            remote_consistent_lsn: applied,
            reply_time_micros: clock.unix_micros(),
        };
        proto::write_frame(&mut write, &ToSafekeeper::Feedback(feedback)).await?;
        write.flush().await?;
    }
}

/// The safekeeper (other than `current`) whose `commit_lsn` is furthest past
/// `announced`, if one is more than [`StreamConfig::max_lag_bytes`] past it.
/// Safekeepers that do not answer within the probe timeout are skipped.
async fn furthest_ahead(
    network: &dyn Network,
    current: &str,
    shard: u32,
    at: Lsn,
    announced: Lsn,
    config: &StreamConfig,
) -> Option<(usize, Lsn)> {
    let mut best: Option<(usize, Lsn)> = None;
    for (i, addr) in config.safekeepers.iter().enumerate() {
        if addr == current {
            continue;
        }
        let probed =
            tokio::time::timeout(config.probe_timeout, probe_commit(network, addr, shard, at))
                .await;
        let Ok(Some(commit_lsn)) = probed else {
            continue;
        };
        let ahead = commit_lsn.0.saturating_sub(announced.0) > config.max_lag_bytes;
        if ahead && best.is_none_or(|(_, b)| commit_lsn > b) {
            best = Some((i, commit_lsn));
        }
    }
    best
}

/// The `commit_lsn` a safekeeper announces in the first frame of a stream
/// opened at `at` (a walsender announces it at once: with WAL, or in a
/// keepalive when it has none past `at`).
async fn probe_commit(network: &dyn Network, addr: &str, shard: u32, at: Lsn) -> Option<Lsn> {
    let conn = network.connect(addr).await.ok()?;
    let (read, mut write) = tokio::io::split(conn);
    let mut reader = FrameReader::new(read);
    proto::write_frame(
        &mut write,
        &ToSafekeeper::StartReplication {
            shard_number: shard,
            start_lsn: at,
        },
    )
    .await
    .ok()?;
    write.flush().await.ok()?;
    match reader.next::<FromSafekeeper>().await.ok()?? {
        FromSafekeeper::Wal { commit_lsn, .. } | FromSafekeeper::Keepalive { commit_lsn } => {
            Some(commit_lsn)
        }
        _ => None,
    }
}
