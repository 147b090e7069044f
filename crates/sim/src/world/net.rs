//! A simulated network of byte streams between named nodes.
//!
//! Every direction of a connection is a link with its own delay range (drawn
//! inside the network's): writes are delivered in order after a delay drawn from
//! it (never overtaking earlier bytes). A link
//! may break on a write (with the configured probability), closing the stream as a
//! reset would. A partition between two nodes silently swallows everything sent
//! between them (no reset, as with a real network cut) and makes new connections
//! time out; repairing it lets new connections through, while swallowed streams
//! stay dead until their owners give up on them.
//!
//! A link holds at most [`SEND_WINDOW`] bytes on their way and the reader's
//! buffer 1 MiB: a writer whose reader does not read waits once both are
//! full, as a TCP sender does (without that, a donor would hand a slow peer
//! its whole WAL at once and never read a byte of it late).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use ferry_env::{BoxConnection, Listener, Network};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Bytes a link accepts beyond what its reader's buffer took (a socket's
/// send buffer).
pub const SEND_WINDOW: usize = 256 << 10;

/// The bytes of one link on their way, shared by its writer and its relay.
#[derive(Debug, Default)]
struct Window {
    state: Mutex<WindowState>,
}

#[derive(Debug, Default)]
struct WindowState {
    in_flight: usize,
    /// The relay stopped (the link broke): writes fail.
    closed: bool,
    waiting: Option<Waker>,
}

impl Window {
    fn lock(&self) -> std::sync::MutexGuard<'_, WindowState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn release(&self, bytes: usize) {
        let mut w = self.lock();
        w.in_flight = w.in_flight.saturating_sub(bytes);
        if let Some(waker) = w.waiting.take() {
            waker.wake();
        }
    }

    fn close(&self) {
        let mut w = self.lock();
        w.closed = true;
        if let Some(waker) = w.waiting.take() {
            waker.wake();
        }
    }
}

/// Closes the window when the relay task ends, however it ends.
struct CloseOnDrop(Arc<Window>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Fault and delay settings of the network.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetOptions {
    pub min_delay: Duration,
    pub max_delay: Duration,
    /// Chance that a write breaks its link.
    pub break_prob: f64,
    /// Chance that a connection attempt fails.
    pub connect_fail_prob: f64,
    /// How long a connection attempt across a partition hangs before failing.
    pub connect_timeout: Duration,
}

impl Default for NetOptions {
    fn default() -> Self {
        NetOptions {
            min_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(5),
            break_prob: 0.0,
            connect_fail_prob: 0.0,
            connect_timeout: Duration::from_millis(500),
        }
    }
}

type Accepted = (BoxConnection, String);

struct State {
    options: NetOptions,
    rng: SmallRng,
    listeners: BTreeMap<String, (String, u64, mpsc::UnboundedSender<Accepted>)>,
    next_listener: u64,
    partitions: BTreeSet<(String, String)>,
}

/// The network of one simulated world.
#[derive(Clone)]
pub struct SimNet {
    state: Arc<Mutex<State>>,
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

fn pair(a: &str, b: &str) -> (String, String) {
    if a <= b {
        (a.to_string(), b.to_string())
    } else {
        (b.to_string(), a.to_string())
    }
}

impl SimNet {
    pub fn new(seed: u64, options: NetOptions) -> SimNet {
        SimNet {
            state: Arc::new(Mutex::new(State {
                options,
                rng: SmallRng::seed_from_u64(seed),
                listeners: BTreeMap::new(),
                next_listener: 0,
                partitions: BTreeSet::new(),
            })),
        }
    }

    /// The network as node `node` sees it.
    pub fn node(&self, node: &str) -> Arc<dyn Network> {
        Arc::new(NodeNet {
            net: self.clone(),
            node: node.to_string(),
        })
    }

    pub fn set_options(&self, options: NetOptions) {
        lock(&self.state).options = options;
    }

    pub fn partition(&self, a: &str, b: &str) {
        lock(&self.state).partitions.insert(pair(a, b));
    }

    pub fn repair_all(&self) {
        lock(&self.state).partitions.clear();
    }

    /// Repairs the cut between `a` and `b` only.
    pub fn heal(&self, a: &str, b: &str) {
        lock(&self.state).partitions.remove(&pair(a, b));
    }

    /// Whether any pair of nodes is cut off from each other now.
    pub fn any_partition(&self) -> bool {
        !lock(&self.state).partitions.is_empty()
    }

    fn partitioned(&self, a: &str, b: &str) -> bool {
        lock(&self.state).partitions.contains(&pair(a, b))
    }

    fn delay(&self) -> Duration {
        let range = {
            let s = lock(&self.state);
            (s.options.min_delay, s.options.max_delay)
        };
        self.delay_in(range)
    }

    fn delay_in(&self, (lo, hi): (Duration, Duration)) -> Duration {
        let mut s = lock(&self.state);
        let lo_us = lo.as_micros() as u64;
        let hi_us = (hi.as_micros() as u64).max(lo_us);
        Duration::from_micros(s.rng.random_range(lo_us..=hi_us))
    }

    /// A connection's own delay range, inside the network's: some connections are
    /// steadily slower than others.
    fn link_range(&self) -> (Duration, Duration) {
        let network = {
            let s = lock(&self.state);
            (s.options.min_delay, s.options.max_delay)
        };
        let a = self.delay_in(network);
        let b = self.delay_in(network);
        (a.min(b), a.max(b))
    }

    fn chance(&self, pick: impl Fn(&NetOptions) -> f64) -> bool {
        let mut s = lock(&self.state);
        let p = pick(&s.options).clamp(0.0, 1.0);
        p > 0.0 && s.rng.random_bool(p)
    }

    /// One direction of a connection, from `from` to `to`: returns the sending end
    /// and the stream the receiver reads.
    fn link(&self, from: &str, to: &str) -> (Sender, DuplexStream) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
        let (mut write_end, read_end) = tokio::io::duplex(1 << 20);
        let window = Arc::new(Window::default());
        let net = self.clone();
        let (from, to) = (from.to_string(), to.to_string());
        let range = self.link_range();
        let relay_window = CloseOnDrop(Arc::clone(&window));
        tokio::spawn(async move {
            let window = relay_window;
            let mut last = Instant::now();
            let mut swallowing = false;
            while let Some(chunk) = rx.recv().await {
                let at = (Instant::now() + net.delay_in(range)).max(last);
                last = at;
                tokio::time::sleep_until(at).await;
                if swallowing || net.partitioned(&from, &to) {
                    swallowing = true;
                    window.0.release(chunk.len());
                    continue;
                }
                if net.chance(|o| o.break_prob) {
                    // The reader sees the stream end.
                    return;
                }
                // Waits while the reader's buffer is full.
                if write_end.write_all(&chunk).await.is_err() {
                    return;
                }
                window.0.release(chunk.len());
            }
        });
        (Sender { tx, window }, read_end)
    }
}

struct NodeNet {
    net: SimNet,
    node: String,
}

impl std::fmt::Debug for NodeNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimNetwork({})", self.node)
    }
}

/// The writing end of a link.
struct Sender {
    tx: mpsc::UnboundedSender<Bytes>,
    window: Arc<Window>,
}

/// A stream end: writes go into a link, reads come from the other link.
struct SimStream {
    tx: Option<Sender>,
    rx: DuplexStream,
}

impl AsyncRead for SimStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.rx).poll_read(cx, buf)
    }
}

impl AsyncWrite for SimStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let closed = || {
            Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "connection closed",
            )))
        };
        let Some(sender) = &self.tx else {
            return closed();
        };
        let accepted = {
            let mut w = sender.window.lock();
            if w.closed {
                return closed();
            }
            if w.in_flight >= SEND_WINDOW {
                w.waiting = Some(cx.waker().clone());
                return Poll::Pending;
            }
            let n = buf.len().min(SEND_WINDOW - w.in_flight);
            w.in_flight += n;
            n
        };
        match sender.tx.send(Bytes::copy_from_slice(&buf[..accepted])) {
            Ok(()) => Poll::Ready(Ok(accepted)),
            Err(_) => closed(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.tx = None;
        Poll::Ready(Ok(()))
    }
}

struct SimListener {
    net: SimNet,
    addr: String,
    id: u64,
    rx: mpsc::UnboundedReceiver<Accepted>,
}

impl Drop for SimListener {
    fn drop(&mut self) {
        let mut s = lock(&self.net.state);
        if s.listeners
            .get(&self.addr)
            .is_some_and(|(_, id, _)| *id == self.id)
        {
            s.listeners.remove(&self.addr);
        }
    }
}

#[async_trait]
impl Listener for SimListener {
    async fn accept(&mut self) -> io::Result<(BoxConnection, String)> {
        self.rx
            .recv()
            .await
            .ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "listener closed"))
    }

    fn local_addr(&self) -> io::Result<String> {
        Ok(self.addr.clone())
    }
}

#[async_trait]
impl Network for NodeNet {
    async fn connect(&self, addr: &str) -> io::Result<BoxConnection> {
        let target = lock(&self.net.state)
            .listeners
            .get(addr)
            .map(|(node, _, tx)| (node.clone(), tx.clone()));
        let Some((server, accept_tx)) = target else {
            tokio::time::sleep(self.net.delay()).await;
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("nothing listens on {addr}"),
            ));
        };
        if self.net.partitioned(&self.node, &server) {
            let timeout = lock(&self.net.state).options.connect_timeout;
            tokio::time::sleep(timeout).await;
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{addr} unreachable"),
            ));
        }
        tokio::time::sleep(self.net.delay()).await;
        if self.net.chance(|o| o.connect_fail_prob) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "connection attempt failed",
            ));
        }
        let (to_server, server_reads) = self.net.link(&self.node, &server);
        let (to_client, client_reads) = self.net.link(&server, &self.node);
        let server_end = SimStream {
            tx: Some(to_client),
            rx: server_reads,
        };
        accept_tx
            .send((Box::new(server_end), self.node.clone()))
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    format!("{addr} stopped listening"),
                )
            })?;
        Ok(Box::new(SimStream {
            tx: Some(to_server),
            rx: client_reads,
        }))
    }

    async fn bind(&self, addr: &str) -> io::Result<Box<dyn Listener>> {
        let mut s = lock(&self.net.state);
        if s.listeners.contains_key(addr) {
            return Err(io::Error::new(io::ErrorKind::AddrInUse, addr.to_string()));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let id = s.next_listener;
        s.next_listener += 1;
        s.listeners
            .insert(addr.to_string(), (self.node.clone(), id, tx));
        Ok(Box::new(SimListener {
            net: self.clone_net(),
            addr: addr.to_string(),
            id,
            rx,
        }))
    }
}

impl NodeNet {
    fn clone_net(&self) -> SimNet {
        self.net.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test(start_paused = true)]
    async fn delivers_in_order_with_delay_and_partitions_swallow() {
        let net = SimNet::new(
            7,
            NetOptions {
                min_delay: Duration::from_millis(10),
                max_delay: Duration::from_millis(30),
                ..NetOptions::default()
            },
        );
        let mut listener = net.node("server").bind("server:1").await.expect("bind");
        let client = net.node("client");
        let started = Instant::now();
        let mut conn = client.connect("server:1").await.expect("connect");
        let (mut server_conn, peer) = listener.accept().await.expect("accept");
        assert_eq!(peer, "client");
        for i in 0..50u8 {
            conn.write_all(&[i]).await.expect("write");
        }
        let mut got = [0u8; 50];
        server_conn.read_exact(&mut got).await.expect("read");
        assert_eq!(got.to_vec(), (0..50).collect::<Vec<u8>>(), "in order");
        assert!(started.elapsed() >= Duration::from_millis(20), "delayed");

        net.partition("client", "server");
        conn.write_all(b"lost").await.expect("write is accepted");
        let read = tokio::time::timeout(Duration::from_secs(5), server_conn.read_u8()).await;
        assert!(read.is_err(), "nothing crosses a partition");
        assert!(
            client.connect("server:1").await.is_err(),
            "no new connection either"
        );
        net.repair_all();
        assert!(client.connect("server:1").await.is_ok());
        drop(listener);
        assert!(
            client.connect("server:1").await.is_err(),
            "nobody listens any more"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_writer_whose_reader_does_not_read_waits_and_a_partition_never_blocks() {
        let net = SimNet::new(
            7,
            NetOptions {
                min_delay: Duration::from_millis(1),
                max_delay: Duration::from_millis(5),
                ..NetOptions::default()
            },
        );
        let mut listener = net.node("server").bind("server:1").await.expect("bind");
        let mut conn = net
            .node("client")
            .connect("server:1")
            .await
            .expect("connect");
        let (mut server_conn, _) = listener.accept().await.expect("accept");
        // The reader's buffer and the window take this much, then no more.
        let fits = (1 << 20) + SEND_WINDOW;
        let chunk = vec![7u8; 64 << 10];
        let mut sent = 0usize;
        while tokio::time::timeout(Duration::from_secs(1), conn.write_all(&chunk))
            .await
            .is_ok()
        {
            sent += chunk.len();
            assert!(sent <= fits + chunk.len(), "{sent} bytes accepted unread");
        }
        assert!(sent >= fits - chunk.len(), "only {sent} bytes accepted");
        // Reading frees room: the writer goes on, every byte arrives.
        let writer = tokio::spawn(async move {
            conn.write_all(&[9u8; 100])
                .await
                .expect("write after a read");
            conn
        });
        let mut got = vec![0u8; sent + 100];
        server_conn.read_exact(&mut got).await.expect("read");
        assert!(got[..sent].iter().all(|&b| b == 7) && got[sent..].iter().all(|&b| b == 9));
        let mut conn = writer.await.expect("writer");
        // Across a partition, writes are swallowed and never wait.
        net.partition("client", "server");
        for _ in 0..64 {
            tokio::time::timeout(Duration::from_secs(1), conn.write_all(&chunk))
                .await
                .expect("a write into a partition does not wait")
                .expect("accepted");
        }
    }
}
