//! WAL removal: what holds it back (replicas, peers, the backup,
//! walsenders) and the removal of the whole segments below that horizon,
//! recorded in the control file first.

use ferry_wal::Lsn;

use super::{Acceptor, AcceptorError};

/// What limits WAL removal, each part separately (for status and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemovalHorizon {
    /// The lowest remote_consistent_lsn of every registered replica (0 while
    /// none is known: nothing is removed before a replica reported).
    pub replicas: Lsn,
    /// WAL below this is on every safekeeper.
    pub peers: Lsn,
    /// WAL below this is backed up (`None`: backup is off).
    pub backup: Option<Lsn>,
    /// The slowest active walsender (`None`: not kept, or none active).
    pub walsenders: Option<Lsn>,
    /// The lowest start of the pulls in progress (`None`: none).
    pub pulls: Option<Lsn>,
}

impl RemovalHorizon {
    /// WAL below this is needed by nobody.
    pub fn lsn(&self) -> Lsn {
        let mut h = self.replicas.min(self.peers);
        if let Some(b) = self.backup {
            h = h.min(b);
        }
        for held in [self.walsenders, self.pulls].into_iter().flatten() {
            h = h.min(held);
        }
        h
    }
}

impl Acceptor {
    /// What limits removal now. `backup_enabled`: whether removal waits for
    /// the backup; `walsenders`: the slowest active walsender, when kept.
    pub fn removal_horizon(&self, backup_enabled: bool, walsenders: Option<Lsn>) -> RemovalHorizon {
        let replicas = match (
            self.feedback.min_remote_consistent(),
            self.writer_replica_horizon,
        ) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => Lsn(0),
        };
        RemovalHorizon {
            replicas: replicas.min(self.commit_lsn),
            peers: self.peer_horizon_lsn.min(self.commit_lsn),
            backup: backup_enabled.then_some(self.state.backup_lsn),
            walsenders,
            pulls: None,
        }
    }

    /// Removes the whole segments below `horizon`. The control file records
    /// the removal first: a crash in between leaves extra files (removed next
    /// time), never a control file that expects WAL which is gone. Returns
    /// how many segments went.
    pub async fn remove_old_wal(
        &mut self,
        horizon: &RemovalHorizon,
    ) -> Result<usize, AcceptorError> {
        let lsn = horizon.lsn();
        let segno = self.config.segment_size.segno(lsn);
        self.removal_horizon = self.removal_horizon.max(lsn);
        if segno <= self.state.last_removed_segno {
            return Ok(0);
        }
        assert!(
            lsn <= self.commit_lsn && lsn <= self.peer_horizon_lsn,
            "removal horizon {lsn} beyond commit_lsn {} or the peer horizon {}",
            self.commit_lsn,
            self.peer_horizon_lsn
        );
        self.state.last_removed_segno = segno;
        self.state.remote_consistent_lsn = self.state.remote_consistent_lsn.max(horizon.replicas);
        self.persist_now().await?;
        let removed = self.wal.remove_below(segno).await?;
        self.segments_removed += removed as u64;
        Ok(removed)
    }

    /// The lowest LSN whose WAL this safekeeper still holds locally (below
    /// it, whole segments were removed).
    pub fn wal_kept_from(&self) -> Lsn {
        Lsn(self.state.last_removed_segno * self.config.segment_size.bytes())
    }
}
