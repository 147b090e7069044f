//! The network seam: byte-stream connections between nodes.

use std::fmt;
use std::io;

use async_trait::async_trait;
use tokio::io::{AsyncRead, AsyncWrite};

/// A bidirectional byte stream to another node.
pub trait Connection: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Connection for T {}

/// A connection as node code holds it.
pub type BoxConnection = Box<dyn Connection>;

/// Accepts connections on one address.
#[async_trait]
pub trait Listener: Send + 'static {
    /// The next connection and the peer's address.
    async fn accept(&mut self) -> io::Result<(BoxConnection, String)>;
    /// The address others connect to (with the real port when bound to port 0).
    fn local_addr(&self) -> io::Result<String>;
}

/// How a node reaches other nodes. Production uses [`TcpNetwork`]; the simulator
/// supplies in-memory connections with delays, loss and partitions.
#[async_trait]
pub trait Network: Send + Sync + fmt::Debug + 'static {
    async fn connect(&self, addr: &str) -> io::Result<BoxConnection>;
    async fn bind(&self, addr: &str) -> io::Result<Box<dyn Listener>>;
}

/// Real TCP through tokio, with Nagle's algorithm off (the protocols are
/// request/response and latency-bound).
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpNetwork;

struct TcpListener(tokio::net::TcpListener);

#[async_trait]
impl Listener for TcpListener {
    async fn accept(&mut self) -> io::Result<(BoxConnection, String)> {
        let (stream, peer) = self.0.accept().await?;
        stream.set_nodelay(true)?;
        Ok((Box::new(stream), peer.to_string()))
    }

    fn local_addr(&self) -> io::Result<String> {
        Ok(self.0.local_addr()?.to_string())
    }
}

#[async_trait]
impl Network for TcpNetwork {
    async fn connect(&self, addr: &str) -> io::Result<BoxConnection> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Box::new(stream))
    }

    async fn bind(&self, addr: &str) -> io::Result<Box<dyn Listener>> {
        Ok(Box::new(TcpListener(
            tokio::net::TcpListener::bind(addr).await?,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn tcp_round_trip() {
        let net = TcpNetwork;
        let mut listener = net.bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 5];
            conn.read_exact(&mut buf).await.expect("read");
            conn.write_all(&buf).await.expect("echo");
        });
        let mut conn = net.connect(&addr).await.expect("connect");
        conn.write_all(b"hello").await.expect("write");
        let mut buf = [0u8; 5];
        conn.read_exact(&mut buf).await.expect("read");
        assert_eq!(&buf, b"hello");
        server.await.expect("server");
    }
}
