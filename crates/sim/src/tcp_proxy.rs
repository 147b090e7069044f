//! A real TCP forwarder that can be cut, for tests against real services
//! (ZooKeeper): the simulator's partitions, on sockets.
//!
//! A cut behaves like a network partition, not like a crash of the peer:
//! bytes stop flowing but no connection is closed (nothing answers), so the
//! client must notice by its own timeouts, and new connections wait
//! unanswered. Connections held during a cut are dropped when it heals, so
//! the client reconnects and learns what the server decided meanwhile (for
//! ZooKeeper: that its session expired). This is how a test expires a session
//! surely and at once: without the cut, the owner's client reconnects as fast
//! as an outside client closes the session, and may win the race.

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Forwards every connection it accepts to `upstream` until cut. Dropping the
/// proxy stops accepting connections.
pub struct Proxy {
    /// `host:port` to connect to instead of the upstream.
    pub addr: String,
    cut: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1.
    pub async fn start(upstream: String) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        let (cut, cut_rx) = watch::channel(false);
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(forward(client, upstream.clone(), cut_rx.clone()));
            }
        });
        Ok(Proxy { addr, cut, accept })
    }

    /// Starts (`true`) or heals (`false`) a partition.
    pub fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

async fn forward(client: TcpStream, upstream: String, mut cut: watch::Receiver<bool>) {
    if *cut.borrow() {
        // Accepted during a cut: unanswered until healed, then closed.
        let _ = cut.wait_for(|c| !*c).await;
        return;
    }
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    tokio::select! {
        _ = tokio::io::copy(&mut cr, &mut sw) => return,
        _ = tokio::io::copy(&mut sr, &mut cw) => return,
        _ = cut.wait_for(|c| *c) => {}
    }
    // Partitioned: hold the sockets silently until healed.
    let _ = cut.wait_for(|c| !*c).await;
    drop((cr, cw, sr, sw));
}
