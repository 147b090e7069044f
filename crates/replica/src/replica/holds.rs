//! The donor side of building a replica from a peer: a consistent copy of
//! this replica's state (one position: the parts, the idempotency window and
//! the decided merges as of `disk_consistent_lsn`) and a hold on the parts it
//! lists, so that merges finishing meanwhile do not remove a file the new
//! replica has yet to copy.
//!
//! Holds live in memory only: a donor that restarts forgets them (the
//! replaced parts it finds at open go the usual way), and the new replica
//! starts its copy again from a fresh manifest. They are bounded in number
//! ([`MAX_BOOTSTRAP_HOLDS`]) and in idle time ([`BOOTSTRAP_HOLD_IDLE`]), so a
//! copier that went away keeps replaced parts for a while at most.

use std::time::Duration;

use ferry_wal::Lsn;

use super::bootstrap::BootstrapManifest;
use super::{Replica, ReplicaError};
use crate::part::{PartMeta, PartName};

/// Copies in flight from one donor at most; a new one beyond drops the
/// least recently used hold (its copier gets `UnknownHold` and starts over).
pub const MAX_BOOTSTRAP_HOLDS: usize = 4;
/// A hold nobody fetched a part of for this long is released.
pub const BOOTSTRAP_HOLD_IDLE: Duration = Duration::from_secs(300);

/// One copy in flight: the parts its manifest listed.
#[derive(Debug)]
pub(super) struct Hold {
    parts: Vec<(u64, PartName)>,
    touched_micros: u64,
}

/// Why a donor will not hand out a part.
#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    #[error("no copy {0} is held here (it expired, or the replica restarted): start again from a new manifest")]
    UnknownHold(String),
    #[error("part {part} of table {table_id} is not in copy {id}'s manifest")]
    NotListed {
        id: String,
        table_id: u64,
        part: String,
    },
    #[error(transparent)]
    Replica(#[from] ReplicaError),
}

impl Replica {
    /// The hold id of a copy made for replica `replica` of `shard`: one
    /// copy per receiving replica, a retried copy replaces its hold.
    pub fn bootstrap_hold_id(shard: u32, replica: u32) -> String {
        format!("bootstrap-s{shard}r{replica}")
    }

    /// Makes what this replica applied durable, then describes it at that
    /// one position and holds the parts it lists (see the module docs).
    /// `now_micros` (the caller's clock) times the hold.
    pub async fn bootstrap_manifest(
        &mut self,
        id: &str,
        now_micros: u64,
    ) -> Result<BootstrapManifest, ReplicaError> {
        self.expire_bootstrap_holds(now_micros);
        self.flush().await?;
        // The consistent position: every active part is durable and below
        // it, and the window and merges are those of the same records.
        assert!(
            self.unsynced.is_empty() && self.persisted_lsn == self.state.disk_consistent_lsn,
            "a manifest taken with applied records not yet persisted"
        );
        let parts: Vec<PartMeta> = self
            .parts
            .values()
            .flat_map(|p| p.values().cloned())
            .collect();
        let position: Lsn = self.state.disk_consistent_lsn;
        for p in &parts {
            assert!(
                p.max_lsn < position,
                "active part {} holds a record at {} past the persisted position {position}",
                p.name,
                p.max_lsn
            );
        }
        if !self.holds.contains_key(id) && self.holds.len() >= MAX_BOOTSTRAP_HOLDS {
            let oldest = self
                .holds
                .iter()
                .min_by_key(|(_, h)| h.touched_micros)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                tracing::warn!(hold = %oldest, "dropping the least recently used copy: too many copies in flight");
                self.release_bootstrap(&oldest);
            }
        }
        let replaced = self.holds.insert(
            id.to_string(),
            Hold {
                parts: parts.iter().map(|p| (p.table_id, p.name.clone())).collect(),
                touched_micros: now_micros,
            },
        );
        if replaced.is_some() {
            // A copy started again: what only its earlier manifest held goes.
            self.free_unpinned();
        }
        Ok(BootstrapManifest {
            hold: id.to_string(),
            shard: self.state.shard,
            donor_replica: self.state.replica,
            disk_consistent_lsn: position,
            window: self.state.window.iter().cloned().collect(),
            merges: self.state.merges.clone(),
            retired: self.state.retired.clone(),
            parts,
        })
    }

    /// The path and metadata of a part copy `id` lists (active, or replaced
    /// since and kept by the hold); renews the hold.
    pub fn bootstrap_part(
        &mut self,
        id: &str,
        table_id: u64,
        name: &PartName,
        now_micros: u64,
    ) -> Result<(String, PartMeta), HoldError> {
        self.expire_bootstrap_holds(now_micros);
        let hold = self
            .holds
            .get_mut(id)
            .ok_or_else(|| HoldError::UnknownHold(id.to_string()))?;
        let not_listed = || HoldError::NotListed {
            id: id.to_string(),
            table_id,
            part: name.to_string(),
        };
        if !hold.parts.iter().any(|(t, n)| *t == table_id && n == name) {
            return Err(not_listed());
        }
        hold.touched_micros = now_micros;
        self.export_part(table_id, name).ok_or_else(not_listed)
    }

    /// Ends copy `id`'s hold (its copier is done, or gone).
    pub fn release_bootstrap(&mut self, id: &str) {
        if self.holds.remove(id).is_some() {
            self.free_unpinned();
        }
    }

    /// Releases holds idle for [`BOOTSTRAP_HOLD_IDLE`].
    pub fn expire_bootstrap_holds(&mut self, now_micros: u64) {
        let idle = BOOTSTRAP_HOLD_IDLE.as_micros() as u64;
        let expired: Vec<String> = self
            .holds
            .iter()
            .filter(|(_, h)| now_micros.saturating_sub(h.touched_micros) >= idle)
            .map(|(k, _)| k.clone())
            .collect();
        for id in expired {
            tracing::info!(hold = %id, "a copy's hold expired");
            self.release_bootstrap(&id);
        }
    }

    /// Copies in flight from this replica.
    pub fn bootstrap_holds(&self) -> Vec<String> {
        self.holds.keys().cloned().collect()
    }

    pub(super) fn is_held(&self, table_id: u64, name: &PartName) -> bool {
        self.holds
            .values()
            .flat_map(|h| &h.parts)
            .any(|(t, n)| *t == table_id && n == name)
    }
}
