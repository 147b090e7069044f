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

// Real sockets are this module's purpose: it stands between real processes.
#![allow(clippy::disallowed_types)]

use ferry_coord::zk::{ZkOptions, ZkSession};
use ferry_coord::Coordination as _;
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

/// Connects a ZooKeeper session as `options` say, but through a proxy of its
/// own (`options.connect` is `host:port[/chroot]`), so that a test can
/// partition this session's owner; see [`expire_proxied`].
pub async fn connect_proxied(options: &ZkOptions) -> ferry_coord::Result<(ZkSession, Proxy)> {
    let split = options.connect.find('/').unwrap_or(options.connect.len());
    let (server, chroot) = options.connect.split_at(split);
    let proxy = Proxy::start(server.to_string()).await.map_err(|e| {
        ferry_coord::CoordError::ConnectionLoss {
            detail: format!("proxy: {e}"),
        }
    })?;
    let mut proxied = options.clone();
    proxied.connect = format!("{}{chroot}", proxy.addr);
    Ok((ZkSession::connect(&proxied).await?, proxy))
}

/// Expires, from outside, the session `info` whose owner connects through
/// `owner`: ZooKeeper's way (attach a second client to the session and close
/// it, through `direct` options) while the owner is partitioned, so it
/// cannot re-attach first. Healed, the owner reconnects and is told that its
/// session expired.
pub async fn expire_proxied(
    direct: &ZkOptions,
    info: zookeeper_client::SessionInfo,
    owner: &Proxy,
) -> ferry_coord::Result<()> {
    owner.set_cut(true);
    let mut attached = Err(ferry_coord::CoordError::ConnectionLoss {
        detail: "not attached".into(),
    });
    // A busy machine can time an attachment out: a few tries.
    for _ in 0..5 {
        attached = ZkSession::attach(direct, info.clone()).await;
        if attached.is_ok() {
            break;
        }
    }
    if let Ok(thief) = &attached {
        thief.close().await;
    }
    owner.set_cut(false);
    attached.map(|_| ())
}
