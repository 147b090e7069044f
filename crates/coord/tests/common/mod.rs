//! Test back-ends for the conformance suite: a fresh embedded store per test, or a
//! fresh chroot on the real ZooKeeper named by `FERRY_TEST_ZK`.

// Test helpers reach real ZooKeeper and the clock directly; node code may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]
#![allow(dead_code)]

#[allow(unused_imports)] // each test binary uses some of them
pub use ferry_testkit::services::{skipped, zookeeper as zk_address};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_coord::embedded::{EmbeddedOptions, EmbeddedStore};
use ferry_coord::zk::ZkOptions;
use ferry_coord::{Coordination, CreateMode, Session};
use ferry_env::RealDisk;

/// Generous bound for anything that should happen "soon" in a test.
pub const SOON: Duration = Duration::from_secs(10);

/// Creates persistent `path` holding `data`, which must succeed.
pub async fn create(s: &dyn Coordination, path: &str, data: &[u8]) {
    s.create(path, data, CreateMode::Persistent)
        .await
        .unwrap_or_else(|e| panic!("create {path}: {e}"));
}

/// Creates the empty ephemeral `path`, which must succeed.
pub async fn ephemeral(s: &dyn Coordination, path: &str) {
    s.create(path, b"", CreateMode::Ephemeral)
        .await
        .unwrap_or_else(|e| panic!("create ephemeral {path}: {e}"));
}

#[async_trait]
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    async fn session(&self) -> Session;
    /// Expires a session from the server side, as a long partition would.
    async fn expire(&self, session: &Session);
    /// Opens sessions of this back-end, as node code holds it.
    fn factory(&self) -> Arc<dyn ferry_coord::SessionFactory>;
}

pub struct Embedded {
    pub store: EmbeddedStore,
    options: EmbeddedOptions,
    dir: tempfile::TempDir,
}

impl Embedded {
    pub async fn new() -> Embedded {
        Embedded::with_options(EmbeddedOptions::default()).await
    }

    /// A store in a new temporary directory, tuned by `options`.
    pub async fn with_options(options: EmbeddedOptions) -> Embedded {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Embedded::open(&dir, &options).await;
        Embedded {
            store,
            options,
            dir,
        }
    }

    async fn open(dir: &tempfile::TempDir, options: &EmbeddedOptions) -> EmbeddedStore {
        let disk = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
        EmbeddedStore::open(disk, "coord", options.clone())
            .await
            .expect("open store")
    }

    /// Shuts the store down and opens it again from the same directory, as a
    /// process restart does: its sessions end, its data must be recovered.
    pub async fn restart(&mut self) {
        self.store.shutdown().await;
        self.store = Embedded::open(&self.dir, &self.options).await;
    }
}

#[async_trait]
impl Backend for Embedded {
    fn name(&self) -> &'static str {
        "embedded"
    }

    async fn session(&self) -> Session {
        Arc::new(
            self.store
                .session(Duration::from_secs(5))
                .await
                .expect("session"),
        )
    }

    fn factory(&self) -> Arc<dyn ferry_coord::SessionFactory> {
        Arc::new(ferry_coord::EmbeddedSessions {
            store: self.store.clone(),
            timeout: Duration::from_secs(5),
            metrics: Arc::default(),
        })
    }

    async fn expire(&self, session: &Session) {
        assert!(self
            .store
            .expire_session(session.session_id())
            .await
            .expect("expire"));
    }
}

pub use ferry_testkit::tcp_proxy::{connect_proxied, expire_proxied, Proxy};

pub struct ZooKeeper {
    options: ZkOptions,
    /// Each session's identity and its own proxy, by session id.
    sessions: Mutex<BTreeMap<i64, (zookeeper_client::SessionInfo, Arc<Proxy>)>>,
}

impl ZooKeeper {
    /// A back-end confined to a new, empty chroot. Every session connects
    /// through its own [`Proxy`], so that [`Backend::expire`] can expire it at
    /// once and surely: it partitions the owner, closes the session from a
    /// second client attached to it, and heals, so the owner learns of the
    /// expiry when it reconnects (without the partition, the owner may
    /// re-attach first and the session lives on).
    pub async fn new() -> Option<ZooKeeper> {
        let addr = zk_address()?;
        let chroot = ferry_testkit::services::zookeeper_chroot(&addr, "conformance").await;
        let mut options = ZkOptions::new(chroot);
        options.session_timeout = Duration::from_secs(4);
        Some(ZooKeeper {
            options,
            sessions: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn options(&self) -> &ZkOptions {
        &self.options
    }
}

#[async_trait]
impl Backend for ZooKeeper {
    fn name(&self) -> &'static str {
        "zookeeper"
    }

    async fn session(&self) -> Session {
        let (session, proxy) = connect_proxied(&self.options).await.expect("connect");
        self.sessions.lock().expect("lock").insert(
            session.session_id(),
            (session.session_info(), Arc::new(proxy)),
        );
        Arc::new(session)
    }

    fn factory(&self) -> Arc<dyn ferry_coord::SessionFactory> {
        Arc::new(ferry_coord::ZkSessions {
            options: self.options.clone(),
            metrics: Arc::default(),
        })
    }

    async fn expire(&self, session: &Session) {
        let (info, proxy) = self
            .sessions
            .lock()
            .expect("lock")
            .get(&session.session_id())
            .cloned()
            .expect("session made by this back-end");
        let mut state = session.session_state();
        expire_proxied(&self.options, info, &proxy)
            .await
            .expect("attach to the session");
        let expired = state.wait_for(|s| *s == ferry_coord::SessionState::Expired);
        tokio::time::timeout(SOON, expired)
            .await
            .expect("the owner learns of the expiry in time")
            .expect("state");
    }
}

/// Runs a conformance case against both back-ends (ZooKeeper only when available).
#[macro_export]
macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod embedded {
            $(
                // Several threads, as a node's tasks may run on: ordering
                // guarantees (watch events before data) must hold there too.
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let backend = $crate::common::Embedded::new().await;
                    super::$case(&backend).await;
                }
            )*
        }
        mod zookeeper {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    if let Some(backend) = $crate::common::ZooKeeper::new().await {
                        super::$case(&backend).await;
                    }
                }
            )*
        }
    };
}
