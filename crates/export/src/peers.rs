//! How the nodes of the distributed deployment find each other: each
//! registers an ephemeral node in coordination holding its HTTP address
//! (replicas at `/ferry/replicas/s<shard>r<replica>`, writers at
//! `/ferry/writers/<address>`). An export request on a replica uses them to
//! learn the commit position (from the writers) and to snapshot the shards
//! it holds no replica of (from a replica of each).
//!
//! What is asked and answered is typed here ([`ShardSnapshotBody`],
//! [`ShardSnapshotAnswer`], [`UnpinBody`]); how it travels is a
//! [`PeerCalls`], which the node crate implements as HTTP over the network
//! seam, so that the simulator can carry it like any other protocol.

use std::time::Duration;

use std::sync::Arc;

use async_trait::async_trait;
use ferry_coord::RenewingSession;
use ferry_replica::PartMeta;
use ferry_wal::Lsn;
use serde::{Deserialize, Serialize};

use crate::local::{RemoteShards, SnapshotError, SnapshotRequest};

pub const REPLICAS: &str = "/ferry/replicas";
pub const WRITERS: &str = "/ferry/writers";

/// Coordination node of a live replica.
pub fn replica_node(shard: u32, replica: u32) -> String {
    format!("{REPLICAS}/s{shard}r{replica}")
}

/// Coordination node of a live writer (its HTTP address names it: two
/// writers of a takeover never share one).
pub fn writer_node(http: &str) -> String {
    let name: String = http
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{WRITERS}/{name}")
}

/// What a registered node publishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// `host:port` of its HTTP endpoint.
    pub http: String,
    /// A replica's applied position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_consistent_lsn: Option<String>,
}

/// Keeps a node's ephemeral registration in coordination: written again when
/// `data` changes (at most every second), and made again on a new session
/// after an expiry. Runs until `changes` closes.
pub async fn register<T: Send + Sync + 'static>(
    coordination: RenewingSession,
    node: String,
    mut changes: tokio::sync::watch::Receiver<T>,
    data: impl Fn(&T) -> Registration + Send + 'static,
) {
    let mut written: Option<(i64, Registration)> = None;
    loop {
        let now = data(&changes.borrow_and_update());
        let result = async {
            let session = coordination.session().await.map_err(|e| e.to_string())?;
            let bytes = serde_json::to_vec(&now).map_err(|e| e.to_string())?;
            let id = session.session_id();
            if written.as_ref().map(|(s, _)| *s) != Some(id) {
                let parent = node.rsplit_once('/').map(|(p, _)| p).unwrap_or("/");
                ferry_coord::create_all(&*session, parent)
                    .await
                    .map_err(|e| e.to_string())?;
                match session
                    .create(&node, &bytes, ferry_coord::CreateMode::Ephemeral)
                    .await
                {
                    Ok(_) => {}
                    Err(ferry_coord::CoordError::NodeExists { .. }) => {
                        // Left by this node's previous session until it expires.
                        return Err(format!("{node} is still held by an earlier session"));
                    }
                    Err(e) => return Err(e.to_string()),
                }
            } else if written.as_ref().map(|(_, d)| d) != Some(&now) {
                session
                    .set(&node, &bytes, None)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(id)
        }
        .await;
        match result {
            Ok(id) => written = Some((id, now)),
            Err(e) => tracing::warn!(node = %node, error = %e, "could not register the node"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Look again when the data changes, and every few seconds anyway (a
        // session may have expired meanwhile).
        if written.is_some() {
            if let Ok(Err(_)) =
                tokio::time::timeout(Duration::from_secs(5), changes.changed()).await
            {
                return;
            }
        }
    }
}

/// How a node calls another node's endpoint, given its registered address.
/// Each call is bounded by `timeout` (a peer that does not answer in time
/// is an error, never a wait for ever).
#[async_trait]
pub trait PeerCalls: Send + Sync {
    /// A replica's snapshot of one shard it holds (`POST /exports/shard-snapshot`).
    async fn shard_snapshot(
        &self,
        addr: &str,
        body: &ShardSnapshotBody,
        timeout: Duration,
    ) -> Result<ShardSnapshotAnswer, String>;
    /// Releases an export's pins on a replica (`POST /exports/unpin`).
    async fn unpin(&self, addr: &str, body: &UnpinBody, timeout: Duration) -> Result<(), String>;
    /// A writer's `commit_lsn` now (from its `GET /status`).
    async fn writer_commit_lsn(&self, addr: &str, timeout: Duration) -> Result<Lsn, String>;
    /// Has a writer append an upkeep record of `table` (`POST
    /// /tables/<t>/maintenance`); its end once committed.
    async fn writer_maintain(
        &self,
        addr: &str,
        table: &str,
        record: &ferry_wal::record::Maintenance,
        timeout: Duration,
    ) -> Result<Lsn, String>;
}

/// The other nodes, as registered.
pub struct Peers {
    coordination: RenewingSession,
    /// This node's own registration, never asked.
    own_node: String,
    calls: Arc<dyn PeerCalls>,
}

/// How long a peer may take beyond the wait a request allows it.
const PEER_MARGIN: Duration = Duration::from_secs(10);
/// How long a writer may take to tell its commit position.
const WRITER_STATUS_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a writer may take to commit an upkeep record.
const MAINTAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a replica may take to release an export's pins.
const UNPIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A replica's answer to a shard snapshot.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardSnapshotAnswer {
    Parts(Vec<PartMeta>),
    Failed(SnapshotError),
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ShardSnapshotBody {
    pub shard: u32,
    pub request: SnapshotRequest,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct UnpinBody {
    pub transaction_id: String,
}

impl Peers {
    pub fn new(
        coordination: RenewingSession,
        own_node: String,
        calls: Arc<dyn PeerCalls>,
    ) -> Peers {
        Peers {
            coordination,
            own_node,
            calls,
        }
    }

    /// Registered nodes under `dir` whose name starts with `prefix`, other
    /// than this one.
    async fn registered(
        &self,
        dir: &str,
        prefix: &str,
    ) -> Result<Vec<(String, Registration)>, String> {
        let session = self
            .coordination
            .session()
            .await
            .map_err(|e| e.to_string())?;
        let names = match session.children(dir).await {
            Ok((n, _)) => n,
            Err(ferry_coord::CoordError::NoNode { .. }) => Vec::new(),
            Err(e) => return Err(e.to_string()),
        };
        let mut out = Vec::new();
        for name in names.into_iter().filter(|n| n.starts_with(prefix)) {
            let path = format!("{dir}/{name}");
            if path == self.own_node {
                continue;
            }
            match session.get(&path).await {
                Ok((data, _)) => match serde_json::from_slice::<Registration>(&data) {
                    Ok(r) => out.push((path, r)),
                    Err(e) => tracing::warn!(node = %path, error = %e, "unreadable registration"),
                },
                Err(ferry_coord::CoordError::NoNode { .. }) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(out)
    }

    /// The live replicas of `shard` other than this node, the furthest
    /// ahead first (snapshot sources, donors of a copy).
    pub async fn replicas_of(&self, shard: u32) -> Result<Vec<(String, Registration)>, String> {
        let mut replicas = self.registered(REPLICAS, &format!("s{shard}r")).await?;
        replicas.sort_by_key(|(_, r)| {
            std::cmp::Reverse(
                r.disk_consistent_lsn
                    .as_deref()
                    .and_then(|l| l.parse::<Lsn>().ok())
                    .unwrap_or_default(),
            )
        });
        Ok(replicas)
    }

    /// The commit position now: the highest a live writer reports. Every
    /// insert acknowledged before this call is below it (a writer
    /// acknowledges an insert only once its commit_lsn passed it).
    pub async fn commit_lsn(&self) -> Result<Lsn, String> {
        let writers = self.registered(WRITERS, "").await?;
        let mut best: Option<Lsn> = None;
        let mut errors = Vec::new();
        for (node, w) in writers {
            let answer = self
                .calls
                .writer_commit_lsn(&w.http, WRITER_STATUS_TIMEOUT)
                .await;
            match answer {
                Ok(lsn) => best = Some(best.map_or(lsn, |b: Lsn| b.max(lsn))),
                Err(e) => errors.push(format!("{node}: {e}")),
            }
        }
        best.ok_or_else(|| {
            if errors.is_empty() {
                "no writer is registered, so the commit position is unknown; retry when a writer runs"
                    .to_string()
            } else {
                format!("no writer answered ({})", errors.join("; "))
            }
        })
    }
}

impl Peers {
    /// Has the live writer append an upkeep record (the writers registered
    /// are asked in turn: during a takeover the superseded one refuses).
    pub async fn maintain(
        &self,
        table: &str,
        record: &ferry_wal::record::Maintenance,
    ) -> Result<Lsn, String> {
        let writers = self.registered(WRITERS, "").await?;
        let mut errors = Vec::new();
        for (node, w) in writers {
            match self
                .calls
                .writer_maintain(&w.http, table, record, MAINTAIN_TIMEOUT)
                .await
            {
                Ok(lsn) => return Ok(lsn),
                Err(e) => errors.push(format!("{node}: {e}")),
            }
        }
        Err(if errors.is_empty() {
            "no writer is registered; table upkeep waits for one".to_string()
        } else {
            format!("no writer committed it ({})", errors.join("; "))
        })
    }
}

#[async_trait]
impl RemoteShards for Peers {
    async fn snapshot(
        &self,
        shard: u32,
        req: &SnapshotRequest,
    ) -> Result<Vec<PartMeta>, SnapshotError> {
        // The one furthest ahead first: it is the likeliest not to wait.
        let replicas = self
            .replicas_of(shard)
            .await
            .map_err(SnapshotError::NotHeld)?;
        let mut last = SnapshotError::NotHeld(format!(
            "no replica of shard {shard} is registered in {REPLICAS}"
        ));
        let body = ShardSnapshotBody {
            shard,
            request: req.clone(),
        };
        for (node, r) in replicas {
            let answer = self
                .calls
                .shard_snapshot(&r.http, &body, req.wait() + PEER_MARGIN)
                .await;
            match answer {
                Ok(ShardSnapshotAnswer::Parts(parts)) => return Ok(parts),
                Ok(ShardSnapshotAnswer::Failed(e)) => last = e,
                Err(e) => {
                    last = SnapshotError::NotHeld(format!(
                        "the replica of shard {shard} at {node} did not answer: {e}"
                    ))
                }
            }
        }
        Err(last)
    }

    async fn unpin(&self, transaction_id: &str) -> Result<(), String> {
        let replicas = self.registered(REPLICAS, "").await?;
        let body = UnpinBody {
            transaction_id: transaction_id.to_string(),
        };
        let mut errors = Vec::new();
        for (node, r) in replicas {
            let answer = self.calls.unpin(&r.http, &body, UNPIN_TIMEOUT).await;
            if let Err(e) = answer {
                errors.push(format!("{node}: {e}"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}
