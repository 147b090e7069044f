//! The safekeeper's connection handling: the writer's connection (batched into
//! group commits) and walsenders (committed WAL streamed to replicas).
//!
//! It reaches the network only through the [`Network`] seam. Invariant: if the
//! disk fails, the safekeeper stops serving at once (fail-stop) and reports why;
//! it never answers from a state it could not persist.

use std::sync::Arc;

use ferry_env::{BoxConnection, Listener, Network};
use ferry_wal::proto::{self, FrameReader, FromSafekeeper, ToSafekeeper, MAX_SEND_BYTES};
use ferry_wal::{Lsn, Term};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::sync::{watch, Mutex};
use tokio::task::JoinSet;

use crate::acceptor::{Acceptor, AcceptorError, AcceptorStatus, WriterSession};
use crate::backup::{self, BackupConfig, BackupPlanner, RemoteWal};
use crate::partial::{self, PartialBackupConfig};
use crate::wal_storage::WalStorageError;

/// Most messages handled as one batch (one fsync).
pub const MAX_BATCH_MESSAGES: usize = 256;
/// A writer connection on which nothing arrived for this long is closed.
pub const WRITER_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// How often a caught-up walsender reminds its replica of the commit position.
pub const WALSENDER_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(1);
/// A walsender whose replica sent no feedback for this long is closed
/// (Postgres's `wal_sender_timeout`). A replica answers every frame, and a
/// keepalive comes every [`WALSENDER_KEEPALIVE`], so silence means the way
/// back is cut while WAL still flows out: without the close, the replica
/// would apply everything while its positions never reach the writer (no
/// back-pressure, no WAL removal, a clean stop that waits for it forever).
/// The replica then reconnects, on a connection whose both ways work.
pub const WALSENDER_REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Default time between two looks at what WAL can be removed (Neon's 5 s).
pub const DEFAULT_REMOVAL_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);
/// Most walsenders served at once; more are refused (each is a task and a
/// buffer).
pub const MAX_WALSENDERS: usize = 1024;
/// Most pulls (peers rebuilding themselves from this safekeeper) served at
/// once; more are refused: each reads the WAL above the removal horizon.
pub const MAX_PULLS: usize = 4;

/// How a safekeeper serves besides the protocol: backup and WAL removal.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Whole segments go to this backup (`None`: no backup; removal then
    /// waits for replicas and peers only).
    pub backup: Option<BackupConfig>,
    /// Keep the WAL the slowest active walsender has not received yet, so a
    /// lagging replica reads it here rather than from the backup.
    pub walsenders_keep_horizon: bool,
    /// How often removal runs.
    pub removal_interval: std::time::Duration,
    /// Whether WAL is removed at all (off: every segment stays).
    pub remove_wal: bool,
    /// Partial segment backup (needs `backup`: its objects go there too).
    pub partial_backup: Option<PartialBackupConfig>,
    /// How long a safekeeper restored from the backup waits after it starts
    /// before a writer may bring it back. It must outlast every writer's
    /// election timeout: an election still holding a vote the lost data gave
    /// is over by then (`ferry_wal::proto::Restored`).
    pub restore_quarantine: std::time::Duration,
    /// A registered replica whose feedback has not changed for this long is
    /// forgotten: it stops holding WAL removal (and, through the writer,
    /// back-pressure). It must outlast any stop a replica is expected to come
    /// back from; one that comes back later reads removed WAL from the backup.
    pub replica_expiry: std::time::Duration,
    /// Appends are refused while less than this many bytes are free on the
    /// data dir's file system (`ferry_env::space`; 0: never).
    pub min_free_disk: u64,
    /// Catch up from a peer of the same term while no writer runs
    /// (`crate::recovery`; `None`: only writers catch it up).
    pub peer_recovery: Option<crate::recovery::PeerRecovery>,
}

/// Default [`ServerConfig::min_free_disk`]: room for a few segments and the
/// control file's rewrites, far more than a batch in flight.
pub const DEFAULT_MIN_FREE_DISK: u64 = 1 << 30;

pub use ferry_wal::liveness::DEFAULT_REPLICA_EXPIRY;

/// How often replicas are checked for expiry.
const REPLICA_EXPIRY_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// Default [`ServerConfig::restore_quarantine`]: well above the writer's
/// default election timeout (3 s).
pub const DEFAULT_RESTORE_QUARANTINE: std::time::Duration = std::time::Duration::from_secs(10);

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            backup: None,
            walsenders_keep_horizon: false,
            removal_interval: DEFAULT_REMOVAL_INTERVAL,
            remove_wal: true,
            partial_backup: None,
            restore_quarantine: DEFAULT_RESTORE_QUARANTINE,
            replica_expiry: DEFAULT_REPLICA_EXPIRY,
            min_free_disk: DEFAULT_MIN_FREE_DISK,
            peer_recovery: None,
        }
    }
}

struct Shared {
    acceptor: Mutex<Acceptor>,
    /// Set once, with the reason, when the safekeeper must stop.
    fatal: watch::Sender<Option<String>>,
    config: ServerConfig,
    /// Active walsenders: id → the position their replica received.
    walsenders: std::sync::Mutex<WalsenderSlots>,
    /// Open while the disk is nearly full: appends are refused.
    space: Option<ferry_env::space::SpaceBreaker>,
    /// When a writer's vote request, election or append last arrived
    /// (peer recovery waits while a writer runs).
    last_writer_message: std::sync::Mutex<Option<tokio::time::Instant>>,
}

#[derive(Default)]
struct WalsenderSlots {
    next_id: u64,
    positions: std::collections::BTreeMap<u64, Lsn>,
    /// Pulls in progress: id → the start of the WAL they copy, which
    /// removal must keep until they end.
    pulls: std::collections::BTreeMap<u64, Lsn>,
}

impl Shared {
    fn walsenders(&self) -> std::sync::MutexGuard<'_, WalsenderSlots> {
        self.walsenders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The slowest active walsender's position, when it holds back removal.
    fn walsender_horizon(&self) -> Option<Lsn> {
        if !self.config.walsenders_keep_horizon {
            return None;
        }
        self.walsenders().positions.values().copied().min()
    }

    /// The lowest start of the pulls in progress: WAL removal holds there.
    fn pull_horizon(&self) -> Option<Lsn> {
        self.walsenders().pulls.values().copied().min()
    }

    fn fail(&self, reason: String) {
        tracing::error!(error = %reason, "safekeeper storage failed; stopping");
        self.fatal.send_if_modified(|f| {
            if f.is_none() {
                *f = Some(reason);
                true
            } else {
                false
            }
        });
    }
}

/// A walsender's slot: its position holds back removal while it runs.
struct WalsenderSlot<'a> {
    shared: &'a Shared,
    id: u64,
}

impl WalsenderSlot<'_> {
    fn set(&self, lsn: Lsn) {
        self.shared.walsenders().positions.insert(self.id, lsn);
    }
}

impl Drop for WalsenderSlot<'_> {
    fn drop(&mut self) {
        self.shared.walsenders().positions.remove(&self.id);
    }
}

/// A pull's hold on WAL removal, from its snapshot to its end (dropped with
/// the connection, however it ends).
struct PullHold<'a> {
    shared: &'a Shared,
    id: u64,
}

impl<'a> PullHold<'a> {
    /// Holds removal at `start`; `None` when [`MAX_PULLS`] are running. The
    /// caller holds the acceptor's lock, which removal takes before it reads
    /// the holds: no removal decided without this hold can run after it.
    fn new(shared: &'a Shared, start: Lsn) -> Option<PullHold<'a>> {
        let mut slots = shared.walsenders();
        if slots.pulls.len() >= MAX_PULLS {
            return None;
        }
        slots.next_id += 1;
        let id = slots.next_id;
        slots.pulls.insert(id, start);
        Some(PullHold { shared, id })
    }
}

impl Drop for PullHold<'_> {
    fn drop(&mut self) {
        self.shared.walsenders().pulls.remove(&self.id);
    }
}

/// A running safekeeper.
pub struct SafekeeperServer {
    shared: Arc<Shared>,
    addr: String,
    stop: watch::Sender<bool>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl SafekeeperServer {
    /// Listens on `listen` and serves `acceptor` (no backup; removal on).
    pub async fn start(
        network: Arc<dyn Network>,
        listen: &str,
        acceptor: Acceptor,
    ) -> std::io::Result<SafekeeperServer> {
        let listener = network.bind(listen).await?;
        SafekeeperServer::serve(listener, acceptor)
    }

    /// Serves `acceptor` on a listener bound earlier (a process binds its
    /// addresses before it touches its data dir, so that a busy address fails
    /// before anything else happened).
    pub fn serve(
        listener: Box<dyn Listener>,
        acceptor: Acceptor,
    ) -> std::io::Result<SafekeeperServer> {
        SafekeeperServer::serve_with(listener, acceptor, ServerConfig::default())
    }

    /// Like [`SafekeeperServer::serve`], with backup and removal as `config` says.
    pub fn serve_with(
        listener: Box<dyn Listener>,
        acceptor: Acceptor,
        config: ServerConfig,
    ) -> std::io::Result<SafekeeperServer> {
        let addr = listener.local_addr()?;
        let mut acceptor = acceptor;
        let mut config = config;
        if let Some(backup) = &mut config.backup {
            // From here on, the backup is this cluster's folder of it.
            backup.location =
                crate::backup::cluster_folder(&backup.location, acceptor.cluster_id())
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        }
        if let Some(backup) = &config.backup {
            acceptor.set_remote(crate::backup::RemoteWal {
                location: backup.location.clone(),
                seg: acceptor.segment_size(),
            });
        }
        let (fatal, _) = watch::channel(None);
        let space = (config.min_free_disk > 0).then(|| {
            ferry_env::space::SpaceBreaker::new(
                format!("safekeeper {}", acceptor.status().node_id),
                config.min_free_disk,
            )
        });
        let shared = Arc::new(Shared {
            acceptor: Mutex::new(acceptor),
            fatal,
            config,
            walsenders: std::sync::Mutex::new(WalsenderSlots::default()),
            space,
            last_writer_message: std::sync::Mutex::new(None),
        });
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&shared), stop_rx));
        Ok(SafekeeperServer {
            shared,
            addr,
            stop,
            task: std::sync::Mutex::new(Some(task)),
        })
    }

    /// The address writers and replicas connect to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub async fn status(&self) -> AcceptorStatus {
        let mut status = self.shared.acceptor.lock().await.status();
        status.disk_full = self
            .shared
            .space
            .as_ref()
            .and_then(|s| s.check().err())
            .map(|e| e.to_string());
        status
    }

    /// Its disk-full breaker (`None`: `min_free_disk` is 0).
    pub fn space(&self) -> Option<&ferry_env::space::SpaceBreaker> {
        self.shared.space.as_ref()
    }

    /// The remote partial segments its control file lists (for checkers).
    pub async fn partial_segments(&self) -> Vec<crate::control::PartialRemoteSegment> {
        self.shared
            .acceptor
            .lock()
            .await
            .partial_segments()
            .to_vec()
    }

    /// (term, flush_lsn, commit_lsn) as the acceptor has them now: for checks
    /// made at every step (the simulator's), without the status's formatting.
    pub async fn positions(&self) -> (Term, Lsn, Lsn) {
        let a = self.shared.acceptor.lock().await;
        (a.term(), a.flush_lsn(), a.commit_lsn())
    }

    /// Follows the fail-stop reason (`Some` once the safekeeper gave up).
    pub fn failure(&self) -> watch::Receiver<Option<String>> {
        self.shared.fatal.subscribe()
    }

    /// Stops at once, like a killed process: connections are dropped and nothing
    /// more is persisted (what is on disk is what a crash would leave).
    pub async fn kill(&self) {
        self.stop.send_replace(true);
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task {
            task.abort();
            // Wait until the task is really gone: its listener and connections
            // are closed, as the kernel closes a dead process's sockets.
            let _ = task.await;
        }
        self.shared.acceptor.lock().await.stop_background();
    }

    /// Stops accepting, drops every connection and persists the positions.
    pub async fn shutdown(&self) {
        self.stop.send_replace(true);
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task {
            let _ = task.await;
        }
        if self.shared.fatal.borrow().is_none() {
            if let Err(e) = self.shared.acceptor.lock().await.persist_now().await {
                tracing::error!(error = %e, "could not persist the control file at shutdown");
            }
        }
    }
}

async fn accept_loop(
    mut listener: Box<dyn Listener>,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    let mut fatal = shared.fatal.subscribe();
    // Background duties live and die with the connections: a kill aborts
    // them with everything else.
    if let Some(space) = shared.space.clone() {
        let disk = shared.acceptor.lock().await.disk();
        connections.spawn(ferry_env::space::watch_free_space(disk, space));
    }
    if let Some(config) = shared.config.backup.clone() {
        let shared = Arc::clone(&shared);
        connections.spawn(async move { run_backup(&shared, config).await });
    }
    if shared.config.remove_wal {
        let shared = Arc::clone(&shared);
        connections.spawn(async move { run_removal(&shared).await });
    }
    {
        let shared = Arc::clone(&shared);
        connections.spawn(async move { run_replica_expiry(&shared).await });
    }
    if shared.acceptor.lock().await.restored_up_to().is_some() {
        // Measured from this start: the process that lost the data is gone
        // by now, so every election that used its votes ends in the wait.
        let shared = Arc::clone(&shared);
        connections.spawn(async move {
            tokio::time::sleep(shared.config.restore_quarantine).await;
            shared.acceptor.lock().await.end_quarantine();
            tracing::info!("restored safekeeper: quarantine over, a writer may bring it back");
        });
    }
    if let Some(recovery) = shared.config.peer_recovery.clone() {
        let shared = Arc::clone(&shared);
        connections.spawn(async move { run_peer_recovery(&shared, recovery).await });
    }
    if let (Some(backup), Some(config)) = (&shared.config.backup, shared.config.partial_backup) {
        let location = backup.location.clone();
        let shared = Arc::clone(&shared);
        connections.spawn(async move { run_partial_backup(&shared, location, config).await });
    }
    loop {
        tokio::select! {
            biased;
            () = async { let _ = stop.wait_for(|s| *s).await; } => break,
            () = async { let _ = fatal.wait_for(|f| f.is_some()).await; } => break,
            accepted = listener.accept() => match accepted {
                Ok((conn, peer)) => {
                    let shared = Arc::clone(&shared);
                    connections.spawn(async move {
                        if let Err(e) = serve_connection(conn, &shared).await {
                            tracing::debug!(%peer, error = %e, "connection ended");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
}

async fn serve_connection(conn: BoxConnection, shared: &Shared) -> Result<(), proto::FrameError> {
    let (read, write) = tokio::io::split(conn);
    let mut reader = FrameReader::new(read);
    let mut writer = BufWriter::with_capacity(1 << 20, write);
    let Some(first) = reader.next::<ToSafekeeper>().await? else {
        return Ok(());
    };
    if let ToSafekeeper::StartReplication {
        shard_number,
        start_lsn,
    } = first
    {
        return walsender(reader, writer, shared, shard_number, start_lsn).await;
    }
    if let ToSafekeeper::Pull(req) = first {
        return serve_pull(writer, shared, req).await;
    }
    let mut batch = vec![first];
    let mut session = WriterSession::default();
    loop {
        // Everything that already arrived joins the batch: one fsync for all.
        while batch.len() < MAX_BATCH_MESSAGES {
            match reader.next_buffered::<ToSafekeeper>() {
                Some(msg) => batch.push(msg?),
                None => break,
            }
        }
        if shared.fatal.borrow().is_some() {
            return Ok(());
        }
        if batch.iter().any(|m| {
            matches!(
                m,
                ToSafekeeper::Append(_)
                    | ToSafekeeper::Elected(_)
                    | ToSafekeeper::VoteRequest { .. }
            )
        }) {
            if let Ok(mut last) = shared.last_writer_message.lock() {
                *last = Some(tokio::time::Instant::now());
            }
        }
        // With the disk nearly full, appends are refused (nothing of them
        // written); the rest of the batch (greetings, votes, elections,
        // reads) is served: it writes at most a control file.
        let full = shared.space.as_ref().and_then(|s| s.check().err());
        let mut refused_appends = false;
        if full.is_some() {
            let before = batch.len();
            batch.retain(|m| !matches!(m, ToSafekeeper::Append(_)));
            refused_appends = batch.len() < before;
        }
        let replies = {
            let mut acceptor = shared.acceptor.lock().await;
            let term = acceptor.term();
            let mut replies = match acceptor
                .handle_batch(std::mem::take(&mut batch), &mut session)
                .await
            {
                Ok(replies) => replies,
                Err(e) => {
                    shared.fail(e.to_string());
                    vec![e.to_message(term)]
                }
            };
            if let (true, Some(full)) = (refused_appends, &full) {
                replies.push(FromSafekeeper::Refused {
                    term,
                    reason: full.to_string(),
                });
            }
            replies
        };
        for reply in &replies {
            proto::write_frame(&mut writer, reply).await?;
        }
        writer.flush().await?;
        if shared.fatal.borrow().is_some() {
            return Ok(());
        }
        match tokio::time::timeout(WRITER_IDLE_TIMEOUT, reader.next::<ToSafekeeper>()).await {
            Ok(frame) => match frame? {
                Some(msg) => batch.push(msg),
                None => return Ok(()),
            },
            // A writer sends heartbeats; a silent connection is dead (a partition
            // sends no reset) and must not pin a task forever.
            Err(_) => return Ok(()),
        }
    }
}

/// Serves a pull: the snapshot, the committed WAL from the removal horizon
/// to the snapshot's commit_lsn, and the donor's term and commit_lsn at the
/// end (see `crate::pull`). Removal holds at the snapshot's start until the
/// connection ends.
async fn serve_pull<W>(
    mut writer: BufWriter<W>,
    shared: &Shared,
    req: proto::PullRequest,
) -> Result<(), proto::FrameError>
where
    W: tokio::io::AsyncWrite + Unpin,
{
    let started = {
        let acceptor = shared.acceptor.lock().await;
        let term = acceptor.term();
        match acceptor.pull_snapshot(&req) {
            Ok(snapshot) => match PullHold::new(shared, snapshot.start_lsn) {
                Some(hold) => Ok((snapshot, acceptor.committed_wal(), hold)),
                None => Err(FromSafekeeper::Refused {
                    term,
                    reason: format!("too many pulls (at most {MAX_PULLS}): try again later"),
                }),
            },
            Err(e) => Err(e.to_message(term)),
        }
    };
    let (snapshot, committed, _hold) = match started {
        Ok(started) => started,
        Err(refusal) => return send_last(&mut writer, &refusal).await,
    };
    tracing::info!(
        peer = req.node_id,
        start = %snapshot.start_lsn,
        commit = %snapshot.commit_lsn,
        "a peer pulls this safekeeper's WAL"
    );
    let (start, end) = (snapshot.start_lsn, snapshot.commit_lsn);
    proto::write_frame(&mut writer, &FromSafekeeper::PullStart(snapshot)).await?;
    let mut pos = start;
    while pos < end {
        let read = committed.read(pos, end, MAX_SEND_BYTES).await;
        let wal = match read {
            Ok(wal) if !wal.is_empty() => wal,
            failed => {
                // Committed WAL is never truncated: an empty read below the
                // commit point is as much a failure as an error.
                let term = shared.acceptor.lock().await.term();
                let refusal = match failed {
                    Err(e) => e.to_message(term),
                    Ok(_) => FromSafekeeper::Refused {
                        term,
                        reason: format!("committed WAL at {pos} read as empty below {end}"),
                    },
                };
                return send_last(&mut writer, &refusal).await;
            }
        };
        let begin = pos;
        pos = Lsn(pos.0 + wal.len() as u64);
        proto::write_frame(
            &mut writer,
            &FromSafekeeper::Wal {
                begin_lsn: begin,
                commit_lsn: end,
                wal,
            },
        )
        .await?;
    }
    let (term, commit_lsn) = {
        let a = shared.acceptor.lock().await;
        (a.term(), a.commit_lsn())
    };
    send_last(&mut writer, &FromSafekeeper::PullEnd { term, commit_lsn }).await
}

/// Sends the last message of a connection and flushes it.
async fn send_last<W: tokio::io::AsyncWrite + Unpin>(
    writer: &mut BufWriter<W>,
    msg: &FromSafekeeper,
) -> Result<(), proto::FrameError> {
    proto::write_frame(writer, msg).await?;
    writer.flush().await?;
    Ok(())
}

/// Streams committed WAL from `start` to a replica and records its feedback.
async fn walsender<R, W>(
    mut reader: FrameReader<R>,
    mut writer: BufWriter<W>,
    shared: &Shared,
    shard_number: u32,
    start: Lsn,
) -> Result<(), proto::FrameError>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    // Committed WAL is never truncated, so it is read without the acceptor:
    // walsenders never hold up appends and their fsyncs.
    let (mut committed, seg) = {
        let acceptor = shared.acceptor.lock().await;
        (acceptor.committed_wal(), acceptor.segment_size())
    };
    if let Some(backup) = &shared.config.backup {
        committed = committed.with_remote(RemoteWal {
            location: backup.location.clone(),
            seg,
        });
    }
    let slot = {
        let mut slots = shared.walsenders();
        if slots.positions.len() >= MAX_WALSENDERS {
            None
        } else {
            slots.next_id += 1;
            let id = slots.next_id;
            slots.positions.insert(id, start);
            Some(WalsenderSlot { shared, id })
        }
    };
    let Some(slot) = slot else {
        let term = shared.acceptor.lock().await.term();
        let refusal = FromSafekeeper::Refused {
            term,
            reason: format!("too many walsenders (at most {MAX_WALSENDERS})"),
        };
        return send_last(&mut writer, &refusal).await;
    };
    let mut pos = start;
    let mut announced = Lsn(0);
    let reply_deadline = tokio::time::sleep(WALSENDER_REPLY_TIMEOUT);
    tokio::pin!(reply_deadline);
    // Debug: walreceivers open short walsenders to probe for lag every few
    // seconds; the replica logs its real streams at info.
    tracing::debug!(shard_number, %start, "walsender started");
    loop {
        let commit = *committed.commit.borrow_and_update();
        while pos < commit {
            let wal = match committed.read(pos, commit, MAX_SEND_BYTES).await {
                Ok(wal) => wal,
                Err(e) => {
                    let acceptor = shared.acceptor.lock().await;
                    let answer = match e {
                        AcceptorError::Storage(WalStorageError::Removed { .. }) => {
                            FromSafekeeper::WalRemoved {
                                start_lsn: pos,
                                kept_from: acceptor.wal_kept_from(),
                            }
                        }
                        e => e.to_message(acceptor.term()),
                    };
                    drop(acceptor);
                    return send_last(&mut writer, &answer).await;
                }
            };
            if wal.is_empty() {
                break;
            }
            let begin = pos;
            pos = Lsn(pos.0 + wal.len() as u64);
            proto::write_frame(
                &mut writer,
                &FromSafekeeper::Wal {
                    begin_lsn: begin,
                    commit_lsn: commit,
                    wal,
                },
            )
            .await?;
            announced = commit;
        }
        if announced < commit {
            proto::write_frame(
                &mut writer,
                &FromSafekeeper::Keepalive { commit_lsn: commit },
            )
            .await?;
            announced = commit;
        }
        writer.flush().await?;
        // `biased`: the simulator needs the same choice for the same inputs.
        tokio::select! {
            biased;
            () = &mut reply_deadline => {
                tracing::warn!(shard_number, at = %pos, timeout = ?WALSENDER_REPLY_TIMEOUT, "walsender closed: no feedback from its replica");
                return Ok(());
            }
            changed = committed.commit.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
            }
            frame = reader.next::<ToSafekeeper>() => match frame? {
                Some(ToSafekeeper::Feedback(fb)) => {
                    reply_deadline
                        .as_mut()
                        .reset(tokio::time::Instant::now() + WALSENDER_REPLY_TIMEOUT);
                    // The replica's own position: what it received, never
                    // more than what was sent.
                    slot.set(fb.last_received_lsn.min(pos));
                    committed.feedback.record(fb);
                }
                Some(_) => {
                    let term = shared.acceptor.lock().await.term();
                    proto::write_frame(&mut writer, &FromSafekeeper::Refused { term, reason: "only feedback is expected on a walsender".into() }).await?;
                    writer.flush().await?;
                    return Ok(());
                }
                None => return Ok(()),
            },
            () = tokio::time::sleep(WALSENDER_KEEPALIVE) => {
                proto::write_frame(&mut writer, &FromSafekeeper::Keepalive { commit_lsn: commit }).await?;
            }
        }
    }
}

/// Uploads whole segments behind commit_lsn while this safekeeper has the
/// duty (see [`crate::backup`]); a failed upload is tried again after a
/// back-off.
/// Peer recovery (see `crate::recovery`): every
/// [`crate::recovery::PEER_RECOVERY_INTERVAL`] while no writer runs, asks
/// the peers where they stand and copies the WAL of its term from the one
/// furthest ahead.
async fn run_peer_recovery(shared: &Shared, recovery: crate::recovery::PeerRecovery) {
    use crate::recovery::{
        copy_from, is_donor, peers_of, position, JOINING_FOLLOW_INTERVAL,
        JOINING_RECOVERY_INTERVAL, PEER_RECOVERY_INTERVAL, WRITER_SILENCE,
    };
    let writer_silent = |shared: &Shared| {
        shared
            .last_writer_message
            .lock()
            .map(|last| last.is_none_or(|t| t.elapsed() >= WRITER_SILENCE))
            .unwrap_or(false)
    };
    // The first look comes soon: a joining safekeeper just pulled is as
    // near the end as it will ever be.
    let mut interval = JOINING_RECOVERY_INTERVAL;
    // A round cut by a fault (a connection refused or broken) is tried
    // again sooner.
    let mut retry = crate::recovery::Retry::new();
    loop {
        tokio::time::sleep(interval).await;
        if shared.fatal.borrow().is_some() {
            return;
        }
        interval = PEER_RECOVERY_INTERVAL;
        if shared.space.as_ref().is_some_and(|s| s.check().is_err()) {
            continue;
        }
        let standing = shared.acceptor.lock().await.recovery_standing();
        // A joining safekeeper has no writer to wait for (none streams to
        // it); any other waits until writers are silent, and a rebuilt
        // member until a writer brings it back.
        let joining = standing.joining();
        if joining {
            interval = JOINING_RECOVERY_INTERVAL;
        } else if standing.restored || !writer_silent(shared) {
            continue;
        }
        if standing.term == 0 || standing.history_term != standing.term {
            continue;
        }
        let mut donor: Option<(String, Lsn)> = None;
        let mut unanswered = false;
        for addr in peers_of(&standing, &recovery) {
            let answer = position(recovery.network.as_ref(), &addr, &standing.cluster_id).await;
            unanswered |= answer.is_none();
            if let Some(c) = answer {
                let limit = standing.copy_limit(&c);
                if is_donor(&standing, &c) && donor.as_ref().is_none_or(|(_, f)| limit > *f) {
                    donor = Some((addr, limit));
                }
            }
        }
        let Some((addr, to)) = donor else {
            if unanswered {
                interval = interval.min(retry.failed());
            } else {
                retry.reset();
            }
            continue;
        };
        if joining {
            tracing::debug!(donor = %addr, from = %standing.flush_lsn, to = %to, term = standing.term, "joining safekeeper: catching up committed WAL from a peer");
        } else {
            tracing::info!(
                donor = %addr,
                from = %standing.flush_lsn,
                to = %to,
                term = standing.term,
                "no writer runs and a peer of this term is ahead: catching up from it"
            );
        }
        let term = standing.term;
        let result = copy_from(
            recovery.network.as_ref(),
            &addr,
            &standing,
            standing.flush_lsn,
            to,
            joining.then_some(JOINING_FOLLOW_INTERVAL),
            |begin, wal, commit| async move {
                if !joining && !writer_silent(shared) {
                    return None;
                }
                let mut acceptor = shared.acceptor.lock().await;
                // A follow ends once a writer brought it back (it streams
                // to it then); `recovery_append` ends it once its
                // configuration names it.
                if joining && !acceptor.recovery_standing().joining() {
                    return None;
                }
                match acceptor.recovery_append(term, begin, wal, commit).await {
                    Ok(flushed) => flushed,
                    Err(e) => {
                        drop(acceptor);
                        tracing::error!(error = %e, "peer recovery: storage failed");
                        shared.fail(e.to_string());
                        None
                    }
                }
            },
        )
        .await;
        match result {
            Ok(at) if joining => {
                tracing::debug!(donor = %addr, at = %at, "joining safekeeper: recovery round ended")
            }
            Ok(at) => tracing::info!(donor = %addr, at = %at, "peer recovery round ended"),
            Err(e) => {
                tracing::debug!(donor = %addr, error = %e, "peer recovery round failed");
                interval = interval.min(retry.failed());
                continue;
            }
        }
        retry.reset();
    }
}

async fn run_backup(shared: &Shared, config: BackupConfig) {
    let (mut view, reader, seg, backup_lsn) = {
        let a = shared.acceptor.lock().await;
        (
            a.subscribe_backup(),
            a.wal_reader(),
            a.segment_size(),
            a.state().backup_lsn,
        )
    };
    let mut planner = BackupPlanner::new(seg, config.parallel_jobs, backup_lsn);
    let mut uploads: JoinSet<(u64, Result<u64, backup::BackupError>)> = JoinSet::new();
    loop {
        let now = tokio::time::Instant::now();
        let current = *view.borrow_and_update();
        for segno in planner.poll(&current, now) {
            let reader = reader.clone();
            let location = config.location.clone();
            uploads.spawn(async move {
                let result = backup::upload_segment(&reader, &location, seg, segno).await;
                (segno, result)
            });
        }
        let retry = planner.next_retry();
        tokio::select! {
            biased;
            Some(done) = uploads.join_next(), if !uploads.is_empty() => {
                let Ok((segno, result)) = done else { continue };
                match result {
                    Ok(bytes) => {
                        tracing::debug!(segno, bytes, "segment backed up");
                        let mut a = shared.acceptor.lock().await;
                        a.note_backup_upload(true);
                        if let Some(lsn) = planner.on_uploaded(segno) {
                            a.set_backup_lsn(lsn);
                        }
                    }
                    Err(e) => {
                        let delay = planner.on_failed(segno, tokio::time::Instant::now());
                        tracing::warn!(segno, error = %e, ?delay, "segment backup failed; trying again");
                        shared.acceptor.lock().await.note_backup_upload(false);
                    }
                }
            }
            changed = view.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = async {
                match retry {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}

/// Forgets replicas whose feedback has not changed for the replica expiry
/// (see [`ferry_wal::liveness`]); a control-file error stops the safekeeper.
async fn run_replica_expiry(shared: &Shared) {
    let mut liveness = ferry_wal::liveness::ReplicaLiveness::default();
    loop {
        tokio::time::sleep(REPLICA_EXPIRY_CHECK).await;
        if shared.fatal.borrow().is_some() {
            return;
        }
        let mut a = shared.acceptor.lock().await;
        let known = a.replica_feedback();
        let expired = liveness.expired(
            known.iter(),
            tokio::time::Instant::now(),
            shared.config.replica_expiry,
        );
        for fb in expired {
            tracing::warn!(
                shard = fb.shard_number,
                replica = fb.replica_number,
                remote_consistent_lsn = %fb.remote_consistent_lsn,
                expiry = ?shared.config.replica_expiry,
                "replica silent past the replica expiry: it no longer holds WAL removal"
            );
            let forget = ferry_wal::proto::ForgottenReplica {
                shard_number: fb.shard_number,
                replica_number: fb.replica_number,
                reply_time_micros: fb.reply_time_micros,
            };
            if let Err(e) = a.forget_replica(forget).await {
                drop(a);
                shared.fail(e.to_string());
                return;
            }
        }
    }
}

/// Removes, every `removal_interval`, the segments nobody needs any more
/// (see [`Acceptor::removal_horizon`]); a disk error stops the safekeeper.
async fn run_removal(shared: &Shared) {
    let backup_enabled = shared.config.backup.is_some();
    loop {
        tokio::time::sleep(shared.config.removal_interval).await;
        if shared.fatal.borrow().is_some() {
            return;
        }
        let mut a = shared.acceptor.lock().await;
        // Read under the acceptor's lock: a pull registers its hold under
        // it, so a removal never misses a pull that started before it.
        let walsenders = shared.walsender_horizon();
        let mut horizon = a.removal_horizon(backup_enabled, walsenders);
        horizon.pulls = shared.pull_horizon();
        match a.remove_old_wal(&horizon).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(segments = n, horizon = %horizon.lsn(), "old WAL removed"),
            Err(e) => {
                drop(a);
                shared.fail(e.to_string());
                return;
            }
        }
    }
}

/// Uploads the flushed prefix of the current segment once flush_lsn stayed
/// in it for the timeout (see [`crate::partial`]); gc first, for what a
/// crash left. A control-file failure stops the safekeeper; any other
/// failure is counted and tried again.
async fn run_partial_backup(
    shared: &Shared,
    location: ferry_storage::Location,
    config: PartialBackupConfig,
) {
    let (mut view, reader, seg, node_id) = {
        let a = shared.acceptor.lock().await;
        (
            a.subscribe_backup(),
            a.wal_reader(),
            a.segment_size(),
            a.status().node_id,
        )
    };
    loop {
        if let Err(e) = partial::gc(&shared.acceptor, &location).await {
            if e.is_fatal() {
                shared.fail(e.to_string());
                return;
            }
            tracing::warn!(error = %e, "partial backup gc failed; trying again");
            tokio::time::sleep(partial::RETRY_DELAY).await;
            continue;
        }
        break;
    }
    loop {
        if !partial::wait_for_stable_segment(&mut view, seg, config.timeout).await {
            return;
        }
        match partial::upload_once(&shared.acceptor, &reader, &location, node_id).await {
            Ok(partial::Attempt::Uploaded(name)) => {
                tracing::debug!(%name, "partial segment uploaded");
                shared.acceptor.lock().await.note_partial_upload(true);
            }
            Ok(partial::Attempt::Skipped) => {
                // Nothing new: wait for the WAL to move.
                if view.changed().await.is_err() {
                    return;
                }
            }
            Err(e) if e.is_fatal() => {
                shared.fail(e.to_string());
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "partial segment upload failed; trying again");
                shared.acceptor.lock().await.note_partial_upload(false);
                // The failed attempt's entry goes now, so that failures never
                // grow the list.
                match partial::gc(&shared.acceptor, &location).await {
                    Err(e) if e.is_fatal() => {
                        shared.fail(e.to_string());
                        return;
                    }
                    Err(e) => tracing::warn!(error = %e, "partial backup gc failed"),
                    Ok(()) => {}
                }
                tokio::time::sleep(partial::RETRY_DELAY).await;
            }
        }
    }
}
