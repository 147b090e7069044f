//! The replica's persisted state: the file `state` under its directory
//! (`disk_consistent_lsn`, the idempotency window, decided merges and export
//! pins), its format, and loading and checking it when the replica opens.
//! `Replica::persist` writes it atomically, after the parts it counts.

use std::collections::{BTreeMap, VecDeque};

use ferry_env::Disk;
use ferry_wal::Lsn;
use serde::{Deserialize, Serialize};

use super::merges::Merge;
use super::retire::RetiredPartition;
use super::{io, ReplicaError};
use crate::part::PartName;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct State {
    pub(super) format: u32,
    pub(super) shard: u32,
    pub(super) replica: u32,
    pub(super) disk_consistent_lsn: Lsn,
    /// (table id, shard, key, LSN of the record that applied it), oldest first.
    pub(super) window: VecDeque<(u64, u32, String, Lsn)>,
    /// Merges decided and not yet done, in the order decided.
    #[serde(default)]
    pub(super) merges: Vec<Merge>,
    /// Parts that pending exports still need, by the export's transaction
    /// id: a merge that replaces one keeps its file (see [`Replica::pin`](super::Replica::pin)).
    #[serde(default)]
    pub(super) pins: BTreeMap<String, Vec<(u64, PartName)>>,
    /// Partitions with rows retired from this replica (retention): where
    /// those rows are in the lake.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) retired: Vec<RetiredPartition>,
}

const STATE_FORMAT: u32 = 1;

impl State {
    /// Reads the state file under `dir` and checks it is this replica's, in
    /// this format; a replica with no state file yet starts from nothing.
    pub(super) async fn load(
        disk: &dyn Disk,
        dir: &str,
        shard: u32,
        replica: u32,
    ) -> Result<State, ReplicaError> {
        let state_path = format!("{dir}/state");
        let state = match disk.read(&state_path).await {
            Ok(bytes) => {
                let s: State =
                    serde_json::from_slice(&bytes).map_err(|e| ReplicaError::Damaged {
                        path: state_path.clone(),
                        detail: e.to_string(),
                    })?;
                if s.format != STATE_FORMAT || s.shard != shard || s.replica != replica {
                    return Err(ReplicaError::Damaged {
                        path: state_path,
                        detail: format!(
                            "format {} of shard {} replica {}, expected format {STATE_FORMAT} of shard {shard} replica {replica}",
                            s.format, s.shard, s.replica
                        ),
                    });
                }
                s
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State {
                format: STATE_FORMAT,
                shard,
                replica,
                ..State::default()
            },
            Err(e) => return Err(io(&state_path)(e)),
        };
        Ok(state)
    }
}

impl State {
    /// The state of a replica built from a peer's copy: the donor's position,
    /// window and decided merges, under this replica's own number, with no
    /// pins (the donor's exports pinned the donor's files).
    pub(super) fn copied(
        shard: u32,
        replica: u32,
        disk_consistent_lsn: Lsn,
        window: VecDeque<(u64, u32, String, Lsn)>,
        merges: Vec<Merge>,
        retired: Vec<RetiredPartition>,
    ) -> State {
        State {
            format: STATE_FORMAT,
            shard,
            replica,
            disk_consistent_lsn,
            window,
            merges,
            pins: BTreeMap::new(),
            retired,
        }
    }
}
