//! A data dir's identity, as the coordination store records it.
//!
//! `/ferry/cluster` holds what the cluster *is* (its id, its safekeepers, its
//! WAL geometry), `/ferry/wal` the last commit state known (term and
//! commit_lsn, kept by the writer node: `ferry_node::commit_record`). Every safekeeper's control file
//! records the same cluster id. At start, the three are checked against each
//! other, so that a lost or replaced part is refused instead of silently
//! starting over:
//!
//! * no cluster record, but safekeepers exist: the coordination store was lost;
//! * a safekeeper without a control file, of another cluster, or with WAL
//!   missing or damaged below its recorded commit point: that safekeeper is
//!   down (the others run if they are a quorum);
//! * every safekeeper holds less WAL than `/ferry/wal` says was committed: the
//!   WAL quorum is younger than the cluster (the writer refuses to be elected);
//! * different flags than the data dir was made with (`--safekeepers`,
//!   `--segment-bytes`): a membership or geometry change, refused.
//!
//! Creation is resumable: the record is written first in state `creating`, the
//! safekeepers are created, then the record becomes `ready`. Only a data dir
//! whose record says `creating` (or that has nothing at all) creates safekeepers.

use std::path::Path;

use anyhow::Context;
use ferry_coord::{CoordError, Coordination, CreateMode};
use ferry_wal::ClusterId;

use serde::{Deserialize, Serialize};

pub use ferry_node::commit_record::ROOT;
const CLUSTER: &str = "/ferry/cluster";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterState {
    /// Safekeepers are being created (a crash here is finished on restart).
    Creating,
    Ready,
}

/// What a cluster is; written once (state aside), never changed by flags.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterRecord {
    pub cluster_id: ClusterId,
    pub safekeepers: usize,
    pub segment_bytes: u64,
    pub state: ClusterState,
    /// The safekeepers' addresses in the writers' order (the order decides
    /// which one has the backup duty), recorded by the first distributed
    /// writer; `None` for `ferry dev`, whose safekeepers live in its process,
    /// and for records written before addresses were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safekeeper_addrs: Option<Vec<String>>,
}

/// Reads the cluster record, if there is one.
pub async fn read_record(session: &dyn Coordination) -> anyhow::Result<Option<ClusterRecord>> {
    match session.get(CLUSTER).await {
        Ok((data, _)) => Ok(Some(serde_json::from_slice(&data).with_context(|| {
            format!("the cluster record {CLUSTER} in the coordination store is not valid")
        })?)),
        Err(CoordError::NoNode { .. }) => Ok(None),
        Err(e) => Err(e).context("reading the cluster record"),
    }
}

/// Writes the cluster record (created if missing).
pub async fn write_record(
    session: &dyn Coordination,
    record: &ClusterRecord,
) -> anyhow::Result<()> {
    put(session, CLUSTER, &serde_json::to_vec(record)?).await
}

async fn put(session: &dyn Coordination, path: &str, data: &[u8]) -> anyhow::Result<()> {
    ferry_coord::create_all(session, ROOT).await?;
    let written: Result<(), CoordError> =
        match session.create(path, data, CreateMode::Persistent).await {
            Ok(_) => Ok(()),
            Err(CoordError::NodeExists { .. }) => session.set(path, data, None).await.map(drop),
            Err(e) => Err(e),
        };
    written.with_context(|| format!("writing {path} in the coordination store"))
}

/// Cluster ids found in the safekeeper control files under `wal_dir`
/// (`sk<N>/safekeeper.control`), for the message that refuses a data dir
/// whose coordination store was lost. A damaged control file counts too.
pub fn safekeepers_on_disk(wal_dir: &Path) -> Vec<(String, String)> {
    let Ok(entries) = std::fs::read_dir(wal_dir) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let control = entry.path().join(ferry_safekeeper::control::CONTROL_FILE);
        if let Ok(bytes) = std::fs::read(&control) {
            let cluster = match ferry_safekeeper::control::decode(&bytes) {
                Ok(state) => state.cluster_id.to_string(),
                Err(e) => format!("unreadable: {e}"),
            };
            found.push((control.display().to_string(), cluster));
        }
    }
    found.sort();
    found
}
