//! Runs a [`Proposer`] against real connections: one task per safekeeper that
//! keeps a connection up (reconnecting with a delay), and one driver task that owns
//! the proposer and turns its actions into frames, acknowledgements and status.
//!
//! Invariant: an append is acknowledged (its future resolves `Ok`) only once the
//! proposer reported `commit_lsn` at or past its end. If the writer loses its
//! leadership first, the append fails with [`WriterError::Superseded`], whose
//! outcome is unknown: a newer writer may or may not have kept the record.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use ferry_env::Network;
use ferry_wal::proto::{
    self, ForgottenReplica, FrameReader, FromSafekeeper, ShardFeedback, ToSafekeeper,
};
use ferry_wal::record::Record;
use ferry_wal::{Lsn, Term};
use serde::Serialize;
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::proposer::{Action, Proposer, ProposerConfig, ProposerError, ReplicaPositions};

/// How long a clean shutdown waits for the safekeepers to learn the final
/// commit_lsn once the checkpoint is committed.
const SHUTDOWN_ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(5);

/// Most queued commands taken together into one send.
const MAX_COMMANDS_PER_BATCH: usize = 1024;
/// Buffer of a safekeeper connection: small messages are gathered into one
/// system call, while a WAL payload at least this large goes to the socket
/// straight from the writer's buffer.
const WRITE_BUFFER_BYTES: usize = 64 << 10;

/// How to run a writer.
#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// Addresses of the safekeepers, in a fixed order (their index is their id
    /// for the proposer). An empty address is a member known to be down: it
    /// counts in the quorum size, but nothing connects to it.
    pub safekeepers: Vec<String>,
    pub proposer: ProposerConfig,
    /// Pause between connection attempts to one safekeeper.
    pub reconnect_delay: Duration,
    /// Period of empty appends that carry commit_lsn to the safekeepers.
    pub heartbeat: Duration,
    /// A connection on which nothing arrived for this long is dropped and made
    /// again (a silent partition sends no reset).
    pub peer_timeout: Duration,
    /// Give up an election that has not succeeded in this time and try again
    /// with a higher term (split votes).
    pub election_timeout: Duration,
    /// Appends waiting for election or commit, at most; more are refused.
    pub max_pending_appends: usize,
    /// When superseded, fail what was in flight and start a new election above
    /// the higher term instead of stopping. For a process that is the only
    /// writer of its safekeepers (`ferry dev`), where a higher term can only be
    /// one left by an earlier run; where writers may really compete, stopping
    /// lets the newest one win.
    pub reelect_when_superseded: bool,
    /// Inserts wait while the slowest replica lags this far behind.
    pub back_pressure: BackPressure,
    /// A replica whose feedback has not changed for this long is forgotten:
    /// it no longer holds back-pressure or the removal horizon relayed to
    /// the safekeepers (which forget it after the same time).
    pub replica_expiry: Duration,
}

/// Neon's `max_replication_{write,flush,apply}_lag`: the most WAL bytes the
/// end of WAL may run ahead of the lowest position any replica reported
/// (received, durably applied, and applied remotely); 0 disables a limit.
/// Appends past a limit wait, in order, until the slowest replica catches up:
/// one slow shard slows the writer and loses nothing. A clean shutdown's
/// checkpoint (and what waits before it) is never held back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BackPressure {
    pub max_write_lag: u64,
    pub max_flush_lag: u64,
    pub max_apply_lag: u64,
}

impl BackPressure {
    /// Which limit `end` exceeds over the lowest replica positions `min`, if any.
    pub fn exceeded(&self, end: Lsn, min: &ReplicaPositions) -> Option<(&'static str, u64)> {
        let checks = [
            ("write", self.max_write_lag, min.last_received_lsn),
            ("flush", self.max_flush_lag, min.disk_consistent_lsn),
            ("apply", self.max_apply_lag, min.remote_consistent_lsn),
        ];
        checks.into_iter().find_map(|(name, limit, lsn)| {
            let lag = end.distance_from(lsn);
            (limit > 0 && lag > limit).then_some((name, lag))
        })
    }
}

impl WriterConfig {
    pub fn new(safekeepers: Vec<String>, proposer: ProposerConfig) -> WriterConfig {
        WriterConfig {
            safekeepers,
            proposer,
            reconnect_delay: Duration::from_millis(200),
            heartbeat: Duration::from_millis(100),
            peer_timeout: Duration::from_secs(2),
            election_timeout: Duration::from_secs(3),
            max_pending_appends: 100_000,
            reelect_when_superseded: false,
            back_pressure: BackPressure::default(),
            replica_expiry: ferry_wal::liveness::DEFAULT_REPLICA_EXPIRY,
        }
    }
}

/// Why an append was not acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriterError {
    /// A newer writer took over; whether the record survived is unknown.
    #[error("writer superseded by term {term}; the outcome of this append is unknown")]
    Superseded { term: Term },
    #[error("writer stopped")]
    Stopped,
    #[error("too many appends waiting")]
    Overloaded,
    #[error("invalid records: {0}")]
    InvalidRecords(String),
    /// A clean shutdown committed its checkpoint, but these replicas had not
    /// applied the WAL up to it in time.
    #[error("replicas {behind:?} (shard, replica) did not apply the WAL up to {end} in time")]
    ReplicasBehind { end: Lsn, behind: Vec<(u32, u32)> },
}

/// One safekeeper as the writer sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerStatus {
    pub addr: String,
    pub connected: bool,
    pub flush_lsn: Option<String>,
    /// Whether this safekeeper has the backup duty now.
    pub backup_duty: bool,
}

/// What an operator sees of a writer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WriterStatus {
    pub term: Term,
    pub elected: bool,
    /// Where this term's WAL starts (the donor's end of WAL at the election).
    pub epoch_start_lsn: String,
    /// True once a quorum has committed everything up to the epoch start: the
    /// safekeepers agree on a common committed end (sync mode waits for this).
    pub synced: bool,
    pub commit_lsn: String,
    pub end_lsn: String,
    /// Set when a higher term ended this writer's leadership (of `term`, which
    /// started at `epoch_start_lsn`); the writer has stopped.
    pub superseded_by: Option<Term>,
    /// Why the election cannot complete: no voter holds the WAL known to be
    /// committed. Once every safekeeper voted, the writer stops with this.
    pub election_blocked: Option<String>,
    /// Set when the writer stopped because electing would lose committed WAL.
    pub refused: Option<String>,
    pub peers: Vec<PeerStatus>,
    /// The highest backup_lsn a safekeeper reported.
    pub backup_lsn: String,
    /// Set while appends wait for a lagging replica: which lag, how many bytes.
    pub back_pressure: Option<String>,
    /// Appends waiting (for the election or for back-pressure).
    pub waiting_appends: usize,
    /// The latest feedback of every replica.
    pub replicas: Vec<ShardFeedback>,
    /// Per shard, the lowest positions over its replicas.
    pub shard_minimums: Vec<ShardMinimum>,
    /// The lowest positions over all replicas of all shards.
    pub overall_minimum: Option<ReplicaPositions>,
    /// Replicas this writer forgot since it started (silent past the
    /// replica expiry: they no longer hold back-pressure).
    pub replicas_forgotten: u64,
}

/// The slowest replica positions of one shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShardMinimum {
    pub shard_number: u32,
    pub positions: ReplicaPositions,
}

/// The rows of one shard of one table, to become one insert record.
#[derive(Debug, Clone)]
pub struct Insert {
    pub table_id: u64,
    pub shard: u32,
    /// At most [`ferry_wal::record::MAX_IDEMPOTENCY_KEY_BYTES`]; empty for none.
    pub idempotency_key: Bytes,
    pub arrow_ipc: Bytes,
}

/// Inserts committed together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inserted {
    /// The block number of each insert, in order: the LSN where its record starts.
    pub block_numbers: Vec<u64>,
    /// The end of the last record; commit_lsn is at or past it.
    pub commit_lsn: Lsn,
}

/// What waits to be appended: records encoded by the caller, or inserts whose
/// records the driver encodes once it knows where they start (their block
/// numbers), and reports those numbers on `blocks` as soon as it does.
enum Pending {
    Records(Bytes),
    Inserts {
        inserts: Vec<Insert>,
        blocks: oneshot::Sender<Vec<u64>>,
    },
}

enum Command {
    Append {
        records: Pending,
        reply: oneshot::Sender<Result<Lsn, WriterError>>,
    },
    Shutdown {
        reply: oneshot::Sender<Result<Lsn, WriterError>>,
        /// Keep running after the checkpoint is confirmed (connections,
        /// heartbeats, feedback and status) until stopped.
        linger: bool,
    },
}

enum Event {
    Connected(usize, u64, mpsc::Sender<ToSafekeeper>),
    Message(usize, u64, FromSafekeeper),
    Disconnected(usize, u64),
}

/// Handle of a running writer.
pub struct Writer {
    commands: mpsc::Sender<Command>,
    status: watch::Receiver<WriterStatus>,
    task: JoinHandle<()>,
    connections: Vec<JoinHandle<()>>,
}

impl Writer {
    /// Starts connecting and electing on the current tokio runtime.
    pub fn start(network: Arc<dyn Network>, config: WriterConfig) -> Writer {
        let n = config.safekeepers.len();
        let (events_tx, events_rx) = mpsc::channel(1024);
        let (commands, commands_rx) = mpsc::channel(1024);
        let mut connections = Vec::new();
        for (i, addr) in config.safekeepers.iter().enumerate() {
            if addr.is_empty() {
                // A member known to be down (its data is damaged): counted in
                // the quorum size, never connected to.
                continue;
            }
            connections.push(tokio::spawn(connection_task(
                Arc::clone(&network),
                i,
                addr.clone(),
                config.reconnect_delay,
                config.peer_timeout,
                events_tx.clone(),
            )));
        }
        let status0 = WriterStatus {
            term: 0,
            elected: false,
            epoch_start_lsn: Lsn(0).to_string(),
            synced: false,
            commit_lsn: Lsn(0).to_string(),
            end_lsn: Lsn(0).to_string(),
            superseded_by: None,
            election_blocked: None,
            refused: None,
            peers: config
                .safekeepers
                .iter()
                .map(|a| PeerStatus {
                    addr: a.clone(),
                    connected: false,
                    flush_lsn: None,
                    backup_duty: false,
                })
                .collect(),
            backup_lsn: Lsn(0).to_string(),
            back_pressure: None,
            waiting_appends: 0,
            replicas: Vec::new(),
            shard_minimums: Vec::new(),
            overall_minimum: None,
            replicas_forgotten: 0,
        };
        let (status_tx, status) = watch::channel(status0);
        let driver = Driver {
            proposer: Proposer::new(config.proposer.clone()),
            conns: vec![None; n],
            waiters: VecDeque::new(),
            queued: VecDeque::new(),
            shutdown: None,
            linger_after_shutdown: false,
            status: status_tx,
            attempt_started: tokio::time::Instant::now(),
            batching: false,
            announcing: None,
            superseded_by: None,
            election_blocked: None,
            refused: None,
            liveness: Default::default(),
            replicas_forgotten: 0,
            config,
        };
        let task = tokio::spawn(driver.run(events_rx, commands_rx));
        Writer {
            commands,
            status,
            task,
            connections,
        }
    }

    /// Appends whole records; resolves with their end LSN once they are committed.
    pub async fn append(&self, records: Bytes) -> Result<Lsn, WriterError> {
        let (reply, rx) = oneshot::channel();
        self.commands
            .send(Command::Append {
                records: Pending::Records(records),
                reply,
            })
            .await
            .map_err(|_| WriterError::Stopped)?;
        rx.await.map_err(|_| WriterError::Stopped)?
    }

    /// Appends one insert record per element, contiguous in the WAL, each with
    /// the block number the writer assigns (the LSN where its record starts);
    /// resolves once all of them are committed. An error means the outcome is
    /// unknown: some or all of them may be committed by a later writer.
    pub async fn insert(&self, inserts: Vec<Insert>) -> Result<Inserted, WriterError> {
        for i in &inserts {
            if i.idempotency_key.len() > ferry_wal::record::MAX_IDEMPOTENCY_KEY_BYTES {
                return Err(WriterError::InvalidRecords(format!(
                    "idempotency key of {} bytes, at most {}",
                    i.idempotency_key.len(),
                    ferry_wal::record::MAX_IDEMPOTENCY_KEY_BYTES
                )));
            }
            let len = Record::insert_len(i.idempotency_key.len(), i.arrow_ipc.len());
            if len > ferry_wal::record::MAX_RECORD_BYTES {
                return Err(WriterError::InvalidRecords(format!(
                    "an insert record of {len} bytes, at most {}",
                    ferry_wal::record::MAX_RECORD_BYTES
                )));
            }
        }
        let (reply, rx) = oneshot::channel();
        let (blocks, blocks_rx) = oneshot::channel();
        self.commands
            .send(Command::Append {
                records: Pending::Inserts { inserts, blocks },
                reply,
            })
            .await
            .map_err(|_| WriterError::Stopped)?;
        let commit_lsn = rx.await.map_err(|_| WriterError::Stopped)??;
        // Sent before the records were appended, hence before the commit.
        let block_numbers = blocks_rx.await.map_err(|_| WriterError::Stopped)?;
        Ok(Inserted {
            block_numbers,
            commit_lsn,
        })
    }

    pub fn status(&self) -> WriterStatus {
        self.status.borrow().clone()
    }

    /// Follows the writer's status.
    pub fn subscribe(&self) -> watch::Receiver<WriterStatus> {
        self.status.clone()
    }

    /// Sync mode (Neon's sync-safekeepers): waits until this writer is elected and
    /// a quorum committed everything up to the epoch start, and returns that common
    /// committed end. Writes nothing itself.
    pub async fn wait_synced(&self) -> Result<(Term, String), WriterError> {
        let mut status = self.status.clone();
        let synced = status
            .wait_for(|s| s.synced)
            .await
            .map_err(|_| WriterError::Stopped)?;
        Ok((synced.term, synced.epoch_start_lsn.clone()))
    }

    /// Clean shutdown: appends a shutdown checkpoint, waits until it is committed
    /// (so a quorum has it and everything acknowledged before it), then until every
    /// streaming safekeeper confirmed the final commit_lsn (at most 5 s), so their
    /// walsenders hand the whole WAL to the replicas; then stops. Returns the LSN
    /// after the checkpoint.
    pub async fn shutdown(self) -> Result<Lsn, WriterError> {
        let result = self.commit_checkpoint(false).await;
        self.stop().await;
        result
    }

    /// Asks the driver for the shutdown checkpoint and waits until it is
    /// committed and confirmed; with `linger` the driver goes on running.
    async fn commit_checkpoint(&self, linger: bool) -> Result<Lsn, WriterError> {
        let (reply, rx) = oneshot::channel();
        match self
            .commands
            .send(Command::Shutdown { reply, linger })
            .await
        {
            Ok(()) => rx.await.unwrap_or(Err(WriterError::Stopped)),
            Err(_) => Err(WriterError::Stopped),
        }
    }

    /// Clean shutdown that also waits for the replicas (Neon's
    /// `stop_and_wait`): the checkpoint is committed as by
    /// [`Writer::shutdown`], then the writer keeps its connections (and
    /// heartbeats, which bring feedback back) until every replica in
    /// `replicas` reported `disk_consistent_lsn` at or past the end of the
    /// checkpoint, so all committed WAL reached them; at most `timeout`.
    /// Tests and orderly stops use it; the replicas are named because the
    /// writer only knows those that reported.
    pub async fn shutdown_and_wait_for_replicas(
        self,
        replicas: &[(u32, u32)],
        timeout: Duration,
    ) -> Result<Lsn, WriterError> {
        let end = match self.commit_checkpoint(true).await {
            Ok(end) => end,
            Err(e) => {
                self.stop().await;
                return Err(e);
            }
        };
        let behind = |s: &WriterStatus| -> Vec<(u32, u32)> {
            replicas
                .iter()
                .copied()
                .filter(|&(shard, replica)| {
                    !s.replicas.iter().any(|f| {
                        f.shard_number == shard
                            && f.replica_number == replica
                            && f.disk_consistent_lsn >= end
                    })
                })
                .collect()
        };
        let mut status = self.status.clone();
        let waited = tokio::time::timeout(timeout, status.wait_for(|s| behind(s).is_empty()))
            .await
            .map(|r| r.map(drop));
        let result = match waited {
            Ok(Ok(())) => Ok(end),
            Ok(Err(_)) => Err(WriterError::Stopped),
            Err(_) => Err(WriterError::ReplicasBehind {
                end,
                behind: behind(&status.borrow()),
            }),
        };
        self.stop().await;
        result
    }

    /// Kills the writer at once, like a crashed process: no checkpoint, pending
    /// appends fail with [`WriterError::Stopped`] (outcome unknown).
    pub fn abort(&self) {
        self.task.abort();
        for c in &self.connections {
            c.abort();
        }
    }

    /// Stops at once, without a checkpoint (pending appends fail).
    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
        for c in self.connections {
            c.abort();
            let _ = c.await;
        }
    }
}

async fn connection_task(
    network: Arc<dyn Network>,
    peer: usize,
    addr: String,
    reconnect_delay: Duration,
    peer_timeout: Duration,
    events: mpsc::Sender<Event>,
) {
    let mut generation = 0u64;
    loop {
        generation += 1;
        match network.connect(&addr).await {
            Ok(conn) => {
                let (out_tx, mut out_rx) = mpsc::channel::<ToSafekeeper>(4096);
                if events
                    .send(Event::Connected(peer, generation, out_tx))
                    .await
                    .is_err()
                {
                    return;
                }
                let (read, write) = tokio::io::split(conn);
                let mut reader = FrameReader::new(read);
                let mut writer = BufWriter::with_capacity(WRITE_BUFFER_BYTES, write);
                let result: Result<(), proto::FrameError> = async {
                    let mut last_heard = tokio::time::Instant::now();
                    loop {
                        tokio::select! {
                            biased;
                            frame = reader.next::<FromSafekeeper>() => match frame? {
                                Some(msg) => {
                                    last_heard = tokio::time::Instant::now();
                                    if events.send(Event::Message(peer, generation, msg)).await.is_err() {
                                        return Ok(());
                                    }
                                }
                                None => return Ok(()),
                            },
                            out = out_rx.recv() => match out {
                                Some(msg) => {
                                    proto::write_frame(&mut writer, &msg).await?;
                                    while let Ok(more) = out_rx.try_recv() {
                                        proto::write_frame(&mut writer, &more).await?;
                                    }
                                    writer.flush().await?;
                                }
                                // The driver dropped this connection.
                                None => return Ok(()),
                            },
                            () = tokio::time::sleep_until(last_heard + peer_timeout) => {
                                // Heartbeats are answered within a few hundred ms;
                                // silence means a dead peer or a partition.
                                tracing::debug!(peer, %addr, "safekeeper silent; reconnecting");
                                return Ok(());
                            }
                        }
                    }
                }
                .await;
                if let Err(e) = result {
                    tracing::debug!(peer, %addr, error = %e, "safekeeper connection lost");
                }
                if events
                    .send(Event::Disconnected(peer, generation))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Err(e) => tracing::debug!(peer, %addr, error = %e, "cannot connect to safekeeper"),
        }
        tokio::time::sleep(reconnect_delay).await;
    }
}

struct Driver {
    config: WriterConfig,
    proposer: Proposer,
    conns: Vec<Option<(u64, mpsc::Sender<ToSafekeeper>)>>,
    /// Appends sent to the proposer, in LSN order, waiting for commit.
    waiters: VecDeque<(Lsn, oneshot::Sender<Result<Lsn, WriterError>>)>,
    /// Appends received before the election.
    queued: VecDeque<(Pending, oneshot::Sender<Result<Lsn, WriterError>>)>,
    shutdown: Option<oneshot::Sender<Result<Lsn, WriterError>>>,
    /// After a clean shutdown's checkpoint, keep running until stopped.
    linger_after_shutdown: bool,
    status: watch::Sender<WriterStatus>,
    attempt_started: tokio::time::Instant,
    /// Inside a run of commands whose appends are sent together at its end.
    batching: bool,
    /// Shutting down: the checkpoint ending at this LSN is committed; waiting (until
    /// the deadline) for the safekeepers to confirm they know it.
    announcing: Option<(Lsn, tokio::time::Instant)>,
    /// The term that ended this writer's leadership.
    superseded_by: Option<Term>,
    election_blocked: Option<String>,
    refused: Option<String>,
    /// When each replica's feedback last changed (for the replica expiry).
    liveness: ferry_wal::liveness::ReplicaLiveness,
    replicas_forgotten: u64,
}

impl Driver {
    async fn run(
        mut self,
        mut events: mpsc::Receiver<Event>,
        mut commands: mpsc::Receiver<Command>,
    ) {
        let mut heartbeat = tokio::time::interval(self.config.heartbeat);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let actions = tokio::select! {
                biased;
                Some(event) = events.recv() => self.on_event(event),
                Some(cmd) = commands.recv() => {
                    // Take every append already waiting, so that they leave in one
                    // message per safekeeper (the writer's half of group commit).
                    self.batching = true;
                    let mut actions = self.on_command(cmd);
                    // Let the other tasks that are ready run first: callers woken
                    // by the same commit queue their next appends meanwhile.
                    tokio::task::yield_now().await;
                    for _ in 0..MAX_COMMANDS_PER_BATCH {
                        match commands.try_recv() {
                            Ok(cmd) => actions.extend(self.on_command(cmd)),
                            Err(_) => break,
                        }
                    }
                    self.batching = false;
                    actions.extend(self.proposer.send_pending());
                    actions
                }
                _ = heartbeat.tick() => self.on_tick(),
                else => return,
            };
            if !self.apply(actions) {
                return;
            }
            // Feedback may have moved the slowest replica: what waited for it
            // goes now.
            if !self.queued.is_empty() {
                let released = self.release_queued();
                if !released.is_empty() && !self.apply(released) {
                    return;
                }
            }
            if let Some((target, deadline)) = self.announcing {
                let (knowing, streaming) = self.proposer.peers_knowing_commit(target);
                let quorum = self.config.safekeepers.len() / 2 + 1;
                let everyone = knowing == streaming && knowing >= quorum;
                if everyone || tokio::time::Instant::now() >= deadline {
                    if !everyone {
                        tracing::warn!(
                            knowing,
                            streaming,
                            "shutdown: not every safekeeper confirmed the final commit_lsn in time"
                        );
                    }
                    if let Some(reply) = self.shutdown.take() {
                        let _ = reply.send(Ok(target));
                    }
                    self.publish_status();
                    if !self.linger_after_shutdown {
                        return;
                    }
                    self.announcing = None;
                }
            }
            self.publish_status();
        }
    }

    fn on_event(&mut self, event: Event) -> Vec<Action> {
        match event {
            Event::Connected(peer, generation, tx) => {
                self.conns[peer] = Some((generation, tx));
                self.proposer.on_connected(peer)
            }
            Event::Message(peer, generation, msg) => {
                if self.conns[peer]
                    .as_ref()
                    .is_some_and(|(g, _)| *g == generation)
                {
                    self.proposer.on_message(peer, msg)
                } else {
                    Vec::new()
                }
            }
            Event::Disconnected(peer, generation) => {
                if self.conns[peer]
                    .as_ref()
                    .is_some_and(|(g, _)| *g == generation)
                {
                    self.conns[peer] = None;
                    self.proposer.on_disconnected(peer)
                } else {
                    Vec::new()
                }
            }
        }
    }

    fn on_command(&mut self, cmd: Command) -> Vec<Action> {
        match cmd {
            Command::Append { records, reply } => {
                if self.waiters.len() + self.queued.len() >= self.config.max_pending_appends {
                    let _ = reply.send(Err(WriterError::Overloaded));
                    return Vec::new();
                }
                // Behind waiting appends, or while a replica lags too far,
                // an append waits its turn.
                if self.proposer.is_elected() && self.queued.is_empty() && self.throttle().is_none()
                {
                    self.append_now(records, reply)
                } else {
                    self.queued.push_back((records, reply));
                    Vec::new()
                }
            }
            Command::Shutdown { reply, linger } => {
                self.linger_after_shutdown = linger;
                let checkpoint = Record::ShutdownCheckpoint {
                    term: self.proposer.term(),
                }
                .to_bytes();
                let (tx, rx) = oneshot::channel();
                self.shutdown = Some(reply);
                // The checkpoint's own waiter is not needed: completion is seen
                // through `shutdown` when commit reaches its end.
                drop(rx);
                // Behind everything that waits, which back-pressure no longer
                // holds back (`release_queued`).
                self.queued.push_back((Pending::Records(checkpoint), tx));
                self.release_queued()
            }
        }
    }

    /// The lag that holds appends back now, if any (never during a clean
    /// shutdown, nor while no replica reported).
    fn throttle(&self) -> Option<(&'static str, u64)> {
        if self.shutdown.is_some() {
            return None;
        }
        let min = self.proposer.overall_minimum()?;
        self.config
            .back_pressure
            .exceeded(self.proposer.end_lsn(), &min)
    }

    /// Appends what waits, in order, while the writer is elected and no lag
    /// holds it back; each append moves the end of WAL, so the lag is checked
    /// again before the next.
    fn release_queued(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        // Released together, they leave in one message per safekeeper.
        let batching = std::mem::replace(&mut self.batching, true);
        while self.proposer.is_elected() && self.throttle().is_none() {
            let Some((records, reply)) = self.queued.pop_front() else {
                break;
            };
            actions.extend(self.append_now(records, reply));
        }
        self.batching = batching;
        if !batching {
            actions.extend(self.proposer.send_pending());
        }
        actions
    }

    fn append_now(
        &mut self,
        pending: Pending,
        reply: oneshot::Sender<Result<Lsn, WriterError>>,
    ) -> Vec<Action> {
        if !self.proposer.is_elected() {
            self.queued.push_back((pending, reply));
            return Vec::new();
        }
        let records = match pending {
            Pending::Records(records) => records,
            Pending::Inserts { inserts, blocks } => {
                // Block numbers are the LSNs the records start at: known only now.
                let mut at = self.proposer.end_lsn().0;
                let mut numbers = Vec::with_capacity(inserts.len());
                let mut ends = Vec::with_capacity(inserts.len());
                let mut out = BytesMut::with_capacity(
                    inserts
                        .iter()
                        .map(|i| Record::insert_len(i.idempotency_key.len(), i.arrow_ipc.len()))
                        .sum(),
                );
                for i in inserts {
                    numbers.push(at);
                    at += Record::Insert {
                        table_id: i.table_id,
                        shard: i.shard,
                        block_number: at,
                        idempotency_key: i.idempotency_key,
                        arrow_ipc: i.arrow_ipc,
                    }
                    .encode(&mut out) as u64;
                    ends.push(out.len());
                }
                let _ = blocks.send(numbers);
                let records = out.freeze();
                let appended = self.proposer.append_encoded_unsent(&records, &ends);
                return self.appended(appended, reply);
            }
        };
        let appended = self.proposer.append_unsent(&records);
        self.appended(appended, reply)
    }

    /// Queues the reply of an append the proposer took (or answers why not).
    fn appended(
        &mut self,
        appended: Result<Lsn, ProposerError>,
        reply: oneshot::Sender<Result<Lsn, WriterError>>,
    ) -> Vec<Action> {
        match appended {
            Ok(end) => {
                self.waiters.push_back((end, reply));
                if self.batching {
                    Vec::new()
                } else {
                    self.proposer.send_pending()
                }
            }
            Err(ProposerError::InvalidRecords(e)) => {
                let _ = reply.send(Err(WriterError::InvalidRecords(e)));
                Vec::new()
            }
            Err(ProposerError::Superseded(term)) => {
                let _ = reply.send(Err(WriterError::Superseded { term }));
                Vec::new()
            }
            Err(ProposerError::NotElected) => {
                unreachable!("checked above that the proposer is elected")
            }
        }
    }

    fn on_tick(&mut self) -> Vec<Action> {
        let timed_out = !self.proposer.is_elected()
            && self.attempt_started.elapsed() > self.config.election_timeout;
        if timed_out || self.proposer.lost_election() {
            // Split vote, lost quorum, or a higher term left by another writer
            // (perhaps long gone): start over above every term seen.
            let mut config = self.config.proposer.clone();
            config.min_term = self.proposer.term();
            tracing::info!(
                term = config.min_term,
                "starting a new election above this term"
            );
            self.proposer = Proposer::new(config);
            self.attempt_started = tokio::time::Instant::now();
            // Dropping the senders makes the connection tasks reconnect, which
            // restarts the greeting on a clean stream.
            for conn in self.conns.iter_mut() {
                *conn = None;
            }
            return Vec::new();
        }
        self.expire_replicas();
        self.proposer.heartbeat()
    }

    /// Forgets replicas silent past the replica expiry (see
    /// [`ferry_wal::liveness`]).
    fn expire_replicas(&mut self) {
        let now = tokio::time::Instant::now();
        let known: Vec<_> = self.proposer.replica_feedback().copied().collect();
        for fb in self
            .liveness
            .expired(known.iter(), now, self.config.replica_expiry)
        {
            tracing::warn!(
                shard = fb.shard_number,
                replica = fb.replica_number,
                disk_consistent_lsn = %fb.disk_consistent_lsn,
                expiry = ?self.config.replica_expiry,
                "replica silent past the replica expiry: it no longer holds back-pressure"
            );
            let forgotten = self.proposer.forget_replica(ForgottenReplica {
                shard_number: fb.shard_number,
                replica_number: fb.replica_number,
                reply_time_micros: fb.reply_time_micros,
            });
            if forgotten {
                self.replicas_forgotten += 1;
            }
        }
    }

    /// Carries out actions; returns false when the writer must stop.
    fn apply(&mut self, actions: Vec<Action>) -> bool {
        let mut queue: VecDeque<Action> = actions.into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Send { to, msg } => {
                    let sent = match &self.conns[to] {
                        Some((_, tx)) => tx.try_send(msg).is_ok(),
                        None => true,
                    };
                    if !sent {
                        // The connection cannot keep up: start it over.
                        self.conns[to] = None;
                        queue.extend(self.proposer.on_disconnected(to));
                    }
                }
                Action::Elected {
                    term,
                    epoch_start_lsn,
                } => {
                    tracing::info!(term, %epoch_start_lsn, "writer elected");
                    self.election_blocked = None;
                    queue.extend(self.release_queued());
                }
                Action::Committed { commit_lsn } => {
                    while self
                        .waiters
                        .front()
                        .is_some_and(|(end, _)| *end <= commit_lsn)
                    {
                        if let Some((end, reply)) = self.waiters.pop_front() {
                            let _ = reply.send(Ok(end));
                        }
                    }
                    if self.waiters.is_empty()
                        && self.queued.is_empty()
                        && self.shutdown.is_some()
                        && self.announcing.is_none()
                    {
                        // The checkpoint is committed. Tell the safekeepers, so
                        // that their walsenders can hand it to the replicas.
                        self.announcing = Some((
                            commit_lsn,
                            tokio::time::Instant::now() + SHUTDOWN_ANNOUNCE_TIMEOUT,
                        ));
                        queue.extend(self.proposer.heartbeat());
                    }
                }
                Action::Superseded { term, reason } => {
                    self.superseded_by = Some(term);
                    // Sent but not known committed: the outcome is unknown.
                    for (_, reply) in self.waiters.drain(..) {
                        let _ = reply.send(Err(WriterError::Superseded { term }));
                    }
                    if let Some(reply) = self.shutdown.take() {
                        let _ = reply.send(Err(WriterError::Superseded { term }));
                    }
                    if self.config.reelect_when_superseded {
                        // Appends not yet sent wait for the new election.
                        tracing::warn!(term, %reason, "writer superseded; electing again above that term");
                        let mut config = self.config.proposer.clone();
                        config.min_term = term;
                        self.proposer = Proposer::new(config);
                        self.attempt_started = tokio::time::Instant::now();
                        for conn in self.conns.iter_mut() {
                            *conn = None;
                        }
                        // What the old proposer asked for no longer applies.
                        queue.clear();
                        continue;
                    }
                    tracing::warn!(term, %reason, "writer superseded; stopping");
                    for (_, reply) in self.queued.drain(..) {
                        let _ = reply.send(Err(WriterError::Superseded { term }));
                    }
                    self.publish_status();
                    return false;
                }
                Action::Reconnect { peer } => {
                    self.conns[peer] = None;
                }
                Action::BehindKnownCommit {
                    best_flush_lsn,
                    known_commit_lsn,
                    all_voted,
                } => {
                    let reason = format!(
                        "the WAL quorum is younger than the cluster: WAL up to {known_commit_lsn} is known committed, but the safekeepers that voted hold WAL only up to {best_flush_lsn}"
                    );
                    if all_voted {
                        tracing::error!(%reason, "every safekeeper voted; the writer stops");
                        self.fail_pending();
                        self.refused = Some(format!("{reason} (every safekeeper answered)"));
                        self.publish_status();
                        return false;
                    }
                    self.election_blocked =
                        Some(format!("{reason}; waiting for the other safekeepers"));
                }
                Action::RefusedByAll { reasons } => {
                    let reason = format!(
                        "every safekeeper refused this writer: {}",
                        reasons.join("; ")
                    );
                    tracing::error!(%reason, "the writer stops");
                    self.fail_pending();
                    self.refused = Some(reason);
                    self.publish_status();
                    return false;
                }
                Action::ElectionLost { term, reason } => {
                    // Queued appends wait for the next attempt (started by the
                    // next tick, above `term`).
                    tracing::info!(term, %reason, "election lost to a higher term; trying again");
                }
            }
        }
        true
    }

    /// Fails everything waiting for an election that will not come: nothing
    /// was sent in this attempt, so it simply did not happen.
    fn fail_pending(&mut self) {
        for (_, reply) in self.queued.drain(..) {
            let _ = reply.send(Err(WriterError::Stopped));
        }
        if let Some(reply) = self.shutdown.take() {
            let _ = reply.send(Err(WriterError::Stopped));
        }
    }

    fn publish_status(&self) {
        let flushes = self.proposer.peer_flush_lsns();
        let offloader = self.proposer.offloader();
        let status = WriterStatus {
            term: self.proposer.term(),
            elected: self.proposer.is_elected(),
            epoch_start_lsn: self.proposer.epoch_start_lsn().to_string(),
            synced: self.proposer.is_elected()
                && self.proposer.commit_lsn() >= self.proposer.epoch_start_lsn(),
            commit_lsn: self.proposer.commit_lsn().to_string(),
            end_lsn: self.proposer.end_lsn().to_string(),
            superseded_by: self.superseded_by,
            election_blocked: self.election_blocked.clone(),
            refused: self.refused.clone(),
            peers: self
                .config
                .safekeepers
                .iter()
                .enumerate()
                .map(|(i, addr)| PeerStatus {
                    addr: addr.clone(),
                    connected: self.conns[i].is_some(),
                    flush_lsn: flushes[i].map(|l| l.to_string()),
                    backup_duty: offloader == Some(i),
                })
                .collect(),
            backup_lsn: self.proposer.backup_lsn().to_string(),
            back_pressure: self
                .throttle()
                .map(|(name, lag)| format!("{name} lag {lag} bytes")),
            waiting_appends: self.queued.len(),
            replicas: self.proposer.replica_feedback().copied().collect(),
            shard_minimums: self
                .proposer
                .shard_minimums()
                .into_iter()
                .map(|(shard_number, positions)| ShardMinimum {
                    shard_number,
                    positions,
                })
                .collect(),
            overall_minimum: self.proposer.overall_minimum(),
            replicas_forgotten: self.replicas_forgotten,
        };
        self.status.send_if_modified(|old| {
            if *old == status {
                false
            } else {
                *old = status;
                true
            }
        });
    }
}

/// Encodes insert records into one buffer (a convenience for callers and tests).
pub fn encode_records(records: &[Record]) -> Bytes {
    let mut buf = BytesMut::new();
    for r in records {
        r.encode(&mut buf);
    }
    buf.freeze()
}
