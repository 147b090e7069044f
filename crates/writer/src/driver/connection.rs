//! One task per safekeeper that keeps a connection up: connects (again after
//! a delay), forwards the frames it reads to the driver as [`Event`]s, writes
//! what the driver sends, and drops a connection silent past the peer
//! timeout.

use std::sync::Arc;
use std::time::Duration;

use ferry_env::Network;
use ferry_wal::proto::{self, FrameReader, FromSafekeeper, ToSafekeeper};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Buffer of a safekeeper connection: small messages are gathered into one
/// system call, while a WAL payload at least this large goes to the socket
/// straight from the writer's buffer.
const WRITE_BUFFER_BYTES: usize = 64 << 10;

pub(super) enum Event {
    Connected(usize, u64, mpsc::Sender<ToSafekeeper>),
    Message(usize, u64, FromSafekeeper),
    Disconnected(usize, u64),
}

/// The connection tasks of the writer's current configuration: replaced
/// as a whole when the configuration changes. Each set has an epoch, the
/// high half of its connections' generations, so that events of a replaced
/// set still in the channel are told apart and ignored.
#[derive(Clone)]
pub(super) struct ConnectionSet {
    network: Arc<dyn Network>,
    events: mpsc::Sender<Event>,
    reconnect_delay: Duration,
    peer_timeout: Duration,
    /// The epoch, and each slot's task with the address it connects to.
    tasks: Arc<std::sync::Mutex<(u64, Vec<SlotTask>)>>,
}

/// A slot's connection task and the address it connects to.
type SlotTask = Option<(String, JoinHandle<()>)>;

impl ConnectionSet {
    pub(super) fn new(
        network: Arc<dyn Network>,
        events: mpsc::Sender<Event>,
        reconnect_delay: Duration,
        peer_timeout: Duration,
    ) -> ConnectionSet {
        ConnectionSet {
            network,
            events,
            reconnect_delay,
            peer_timeout,
            tasks: Arc::new(std::sync::Mutex::new((0, Vec::new()))),
        }
    }

    fn spawn(&self, slot: usize, addr: &str, epoch: u64) -> JoinHandle<()> {
        tokio::spawn(connection_task(
            Arc::clone(&self.network),
            slot,
            addr.to_string(),
            self.reconnect_delay,
            self.peer_timeout,
            self.events.clone(),
            epoch,
        ))
    }

    /// Stops the current connections and starts one per address (an empty
    /// address is a member known to be down: counted in the quorum size,
    /// never connected to) in a new epoch; returns the epoch.
    pub(super) fn start(&self, addrs: &[String]) -> u64 {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        for (_, t) in tasks.1.drain(..).flatten() {
            t.abort();
        }
        tasks.0 += 1;
        let epoch = tasks.0;
        tasks.1 = addrs
            .iter()
            .enumerate()
            .map(|(slot, addr)| {
                (!addr.is_empty()).then(|| (addr.clone(), self.spawn(slot, addr, epoch)))
            })
            .collect();
        epoch
    }

    /// Keeps the connections of slots whose address is unchanged, starts
    /// those of new slots and stops those of slots with an empty address,
    /// in the current epoch.
    pub(super) fn set_slots(&self, addrs: &[String]) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        let epoch = tasks.0;
        tasks.1.resize_with(addrs.len(), || None);
        for (slot, addr) in addrs.iter().enumerate() {
            let keep = tasks.1[slot].as_ref().is_some_and(|(a, _)| a == addr);
            if keep {
                continue;
            }
            if let Some((_, t)) = tasks.1[slot].take() {
                t.abort();
            }
            if !addr.is_empty() {
                tasks.1[slot] = Some((addr.clone(), self.spawn(slot, addr, epoch)));
            }
        }
    }

    /// Aborts every connection task; returns them to be awaited.
    pub(super) fn abort_all(&self) -> Vec<JoinHandle<()>> {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        let all: Vec<JoinHandle<()>> = tasks.1.drain(..).flatten().map(|(_, t)| t).collect();
        for t in &all {
            t.abort();
        }
        all
    }
}

/// The epoch of the connection set a connection generation belongs to.
pub(super) fn epoch_of(generation: u64) -> u64 {
    generation >> 32
}

async fn connection_task(
    network: Arc<dyn Network>,
    peer: usize,
    addr: String,
    reconnect_delay: Duration,
    peer_timeout: Duration,
    events: mpsc::Sender<Event>,
    epoch: u64,
) {
    let mut generation = epoch << 32;
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
