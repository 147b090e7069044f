//! Runs a [`Proposer`] against real connections: one task per safekeeper that
//! keeps a connection up (reconnecting with a delay), and one driver task that owns
//! the proposer and turns its actions into frames, acknowledgements and status.
//!
//! Invariant: an append is acknowledged (its future resolves `Ok`) only once the
//! proposer reported `commit_lsn` at or past its end. If the writer loses its
//! leadership first, the append fails with [`WriterError::Superseded`], whose
//! outcome is unknown: a newer writer may or may not have kept the record.

//!
//! Here: the [`Writer`] handle, what it sends the driver task, the errors
//! appends end with, and the driver's state; in the submodules:
//! * `config`: how to run a writer, and back-pressure's limits;
//! * `connection`: the per-safekeeper connection task (reconnecting,
//!   framing, the peer timeout);
//! * `run`: the driver task's loop, connection events, the heartbeat tick
//!   (election timeouts, replica expiry) and the proposer's actions carried out;
//! * `appends`: appends and the shutdown checkpoint taken from the handle,
//!   queued behind the election or back-pressure and released in order;
//! * `status`: what an operator sees of the writer, and its publication.

mod appends;
mod config;
mod connection;
mod run;
mod status;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use ferry_env::Network;
use ferry_wal::proto::ToSafekeeper;
use ferry_wal::record::Record;
use ferry_wal::{Lsn, Term};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::proposer::Proposer;

pub use config::{BackPressure, WriterConfig};
pub use status::{PeerStatus, ShardMinimum, WriterStatus};

use connection::ConnectionSet;

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
    /// Too few safekeepers take appends: the others refuse them for lack of
    /// disk space. Nothing of this append was written.
    #[error("disk_full: safekeepers {safekeepers:?} refuse appends for lack of disk space and the others are too few to commit; nothing was written")]
    DiskFull { safekeepers: Vec<usize> },
    #[error("invalid records: {0}")]
    InvalidRecords(String),
    /// The safekeeper set changed (generation `generation`): the writer
    /// starts over with it, and whether this append survived is unknown.
    #[error("the safekeeper configuration changed to generation {generation}; the outcome of this append is unknown")]
    Reconfigured { generation: u32 },
    /// A clean shutdown committed its checkpoint, but these replicas had not
    /// applied the WAL up to it in time.
    #[error("replicas {behind:?} (shard, replica) did not apply the WAL up to {end} in time")]
    ReplicasBehind { end: Lsn, behind: Vec<(u32, u32)> },
}

/// The rows of one shard of one table, to become one insert record.
#[derive(Debug, Clone)]
pub struct Insert {
    pub table_id: u64,
    pub shard: u32,
    /// At most [`ferry_wal::record::MAX_IDEMPOTENCY_KEY_BYTES`]; empty for none.
    pub idempotency_key: Bytes,
    pub rows: InsertRows,
}

/// How an insert record carries its rows.
#[derive(Debug, Clone)]
pub enum InsertRows {
    /// An Arrow IPC stream ([`Record::Insert`]): every replica encodes its parts.
    ArrowIpc(Bytes),
    /// Finished part files, one per partition ([`Record::InsertParts`]).
    Parts(Vec<ferry_wal::record::CarriedPart>),
}

impl Insert {
    /// The record it becomes, starting at `block_number`.
    pub fn into_record(self, block_number: u64) -> Record {
        match self.rows {
            InsertRows::ArrowIpc(arrow_ipc) => Record::Insert {
                table_id: self.table_id,
                shard: self.shard,
                block_number,
                idempotency_key: self.idempotency_key,
                arrow_ipc,
            },
            InsertRows::Parts(parts) => Record::InsertParts {
                table_id: self.table_id,
                shard: self.shard,
                block_number,
                idempotency_key: self.idempotency_key,
                parts,
            },
        }
    }

    /// The length of the record it becomes.
    pub fn record_len(&self) -> usize {
        match &self.rows {
            InsertRows::ArrowIpc(ipc) => Record::insert_len(self.idempotency_key.len(), ipc.len()),
            InsertRows::Parts(parts) => Record::insert_parts_len(self.idempotency_key.len(), parts),
        }
    }
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

/// Handle of a running writer.
pub struct Writer {
    commands: mpsc::Sender<Command>,
    status: watch::Receiver<WriterStatus>,
    task: JoinHandle<()>,
    connections: ConnectionSet,
}

impl Writer {
    /// Starts connecting and electing on the current tokio runtime.
    pub fn start(network: Arc<dyn Network>, config: WriterConfig) -> Writer {
        let n = config.safekeepers.len();
        let (events_tx, events_rx) = mpsc::channel(1024);
        let (commands, commands_rx) = mpsc::channel(1024);
        let connections = ConnectionSet::new(
            network,
            events_tx,
            config.reconnect_delay,
            config.peer_timeout,
        );
        let conn_epoch = connections.start(&config.safekeepers);
        let status0 = WriterStatus {
            generation: config
                .proposer
                .configuration
                .as_ref()
                .map_or(0, |c| c.generation),
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
            replica_setbacks: 0,
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
            config,
            connections: connections.clone(),
            conn_epoch,
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
            if let InsertRows::Parts(parts) = &i.rows {
                let partition_too_long = parts
                    .iter()
                    .any(|p| p.partition_id.len() > ferry_wal::record::MAX_CARRIED_PARTITION_BYTES);
                if parts.len() > ferry_wal::record::MAX_CARRIED_PARTS || partition_too_long {
                    return Err(WriterError::InvalidRecords(format!(
                        "an insert of {} parts (at most {}) or a partition id over {} bytes",
                        parts.len(),
                        ferry_wal::record::MAX_CARRIED_PARTS,
                        ferry_wal::record::MAX_CARRIED_PARTITION_BYTES
                    )));
                }
            }
            let len = i.record_len();
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
        self.connections.abort_all();
    }

    /// Stops at once, without a checkpoint (pending appends fail).
    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
        for c in self.connections.abort_all() {
            let _ = c.await;
        }
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
    /// The connection tasks, replaced when the configuration changes.
    connections: ConnectionSet,
    /// The epoch of the current connection set: events of older ones are
    /// ignored.
    conn_epoch: u64,
}

/// Encodes insert records into one buffer (a convenience for callers and tests).
pub fn encode_records(records: &[Record]) -> Bytes {
    let mut buf = BytesMut::new();
    for r in records {
        r.encode(&mut buf);
    }
    buf.freeze()
}
