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

use crate::acceptor::{Acceptor, AcceptorStatus};

/// Most messages handled as one batch (one fsync).
pub const MAX_BATCH_MESSAGES: usize = 256;
/// A writer connection on which nothing arrived for this long is closed.
pub const WRITER_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// How often a caught-up walsender reminds its replica of the commit position.
pub const WALSENDER_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(1);

struct Shared {
    acceptor: Mutex<Acceptor>,
    /// Set once, with the reason, when the safekeeper must stop.
    fatal: watch::Sender<Option<String>>,
}

/// A running safekeeper.
pub struct SafekeeperServer {
    shared: Arc<Shared>,
    addr: String,
    stop: watch::Sender<bool>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl SafekeeperServer {
    /// Listens on `listen` and serves `acceptor`.
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
        let addr = listener.local_addr()?;
        let (fatal, _) = watch::channel(None);
        let shared = Arc::new(Shared {
            acceptor: Mutex::new(acceptor),
            fatal,
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
        self.shared.acceptor.lock().await.status()
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
    let mut batch = vec![first];
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
        let replies = {
            let mut acceptor = shared.acceptor.lock().await;
            let term = acceptor.term();
            match acceptor.handle_batch(std::mem::take(&mut batch)).await {
                Ok(replies) => replies,
                Err(e) => {
                    tracing::error!(error = %e, "safekeeper storage failed; stopping");
                    shared.fatal.send_replace(Some(e.to_string()));
                    vec![e.to_message(term)]
                }
            }
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
    let mut committed = shared.acceptor.lock().await.committed_wal();
    let mut pos = start;
    let mut announced = Lsn(0);
    // Debug: walreceivers open short walsenders to probe for lag every few
    // seconds; the replica logs its real streams at info.
    tracing::debug!(shard_number, %start, "walsender started");
    loop {
        let commit = *committed.commit.borrow_and_update();
        while pos < commit {
            let wal = match committed.read(pos, commit, MAX_SEND_BYTES).await {
                Ok(wal) => wal,
                Err(e) => {
                    let term = shared.acceptor.lock().await.term();
                    proto::write_frame(&mut writer, &e.to_message(term)).await?;
                    writer.flush().await?;
                    return Ok(());
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
            changed = committed.commit.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
            }
            frame = reader.next::<ToSafekeeper>() => match frame? {
                Some(ToSafekeeper::Feedback(fb)) => committed.feedback.record(fb),
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
