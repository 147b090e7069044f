//! The safekeeper node: the acceptor opened from its disk and served on its
//! listener with its backup, removal and walsenders.
//!
//! Rebuilding a lost safekeeper from the WAL backup
//! ([`ferry_safekeeper::restore`]) comes before this and is the caller's: the
//! binary retries it with back-off, the simulator crashes it midway.

use std::sync::Arc;

use ferry_env::{Disk, Listener};
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig, AcceptorError};
use ferry_safekeeper::server::{SafekeeperServer, ServerConfig};

/// How the safekeeper's state is found on its disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SafekeeperOpen {
    /// A member of a new cluster: its directory holds no safekeeper yet.
    /// Never used to replace a safekeeper whose data was lost, which must
    /// not vote as if it had never promised anything.
    Create,
    /// A restart (or the start after a restore): its control file and its
    /// WAL below the recorded commit point must be there and intact.
    Open,
}

/// Why a safekeeper node did not start.
#[derive(Debug, thiserror::Error)]
pub enum SafekeeperNodeError {
    /// Its state could not be created or recovered from its disk.
    #[error(transparent)]
    State(#[from] AcceptorError),
    /// Its listener or its backup location could not be used.
    #[error("serving: {0}")]
    Serve(#[from] std::io::Error),
}

/// Opens (or creates) the safekeeper in `dir` on `disk` and serves it on
/// `listener`.
pub async fn start_safekeeper(
    disk: Arc<dyn Disk>,
    dir: &str,
    open: SafekeeperOpen,
    acceptor: AcceptorConfig,
    listener: Box<dyn Listener>,
    server: ServerConfig,
) -> Result<SafekeeperServer, SafekeeperNodeError> {
    let acceptor = match open {
        SafekeeperOpen::Create => Acceptor::create(disk, dir, acceptor).await?,
        SafekeeperOpen::Open => Acceptor::open(disk, dir, acceptor).await?,
    };
    Ok(SafekeeperServer::serve_with(listener, acceptor, server)?)
}
