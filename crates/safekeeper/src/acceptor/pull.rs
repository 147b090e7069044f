//! The donor's side of a pull (a lost safekeeper rebuilt from a peer): the
//! snapshot of what it copies. The connection handler holds WAL removal at
//! the snapshot's `start_lsn` from before the acceptor's lock is released
//! until the pull ends, and streams `[start_lsn, commit_lsn)`, WAL that is
//! committed and therefore never truncated.

use ferry_wal::proto::{PullRequest, PullSnapshot};

use super::{refused, Acceptor, AcceptorError};

impl Acceptor {
    /// What a pull by `req` copies: this safekeeper's committed WAL from its
    /// first segment kept, and the positions that describe it. Refuses a
    /// safekeeper of another cluster, timeline or geometry, and itself.
    pub fn pull_snapshot(&self, req: &PullRequest) -> Result<PullSnapshot, AcceptorError> {
        let term = self.state.term;
        if req.cluster_id != self.config.cluster_id || req.timeline_id != self.config.timeline_id {
            return Err(refused(
                term,
                format!(
                    "a pull for cluster {} timeline {}: this safekeeper serves cluster {} timeline {}",
                    req.cluster_id,
                    req.timeline_id,
                    self.config.cluster_id,
                    self.config.timeline_id
                ),
            ));
        }
        if req.segment_bytes != self.config.segment_size.bytes() {
            return Err(refused(
                term,
                format!(
                    "a pull with segments of {} bytes: this safekeeper's are {}",
                    req.segment_bytes,
                    self.config.segment_size.bytes()
                ),
            ));
        }
        if req.node_id == self.config.node_id {
            return Err(refused(
                term,
                format!(
                    "safekeeper {} asked itself for a pull: name a peer",
                    req.node_id
                ),
            ));
        }
        let commit_lsn = self.commit_lsn;
        // The first segment kept starts at or below commit_lsn: removal never
        // passes commit_lsn (`remove_old_wal`).
        let start_lsn = self.wal_kept_from().min(commit_lsn);
        debug_assert!(commit_lsn <= self.flush_lsn());
        Ok(PullSnapshot {
            term,
            term_history: self.state.term_history.up_to(commit_lsn),
            timeline_start_lsn: self.state.timeline_start_lsn,
            start_lsn,
            commit_lsn,
            backup_lsn: self.state.backup_lsn.min(commit_lsn),
            peer_horizon_lsn: self.peer_horizon_lsn.min(commit_lsn),
            remote_consistent_lsn: self.state.remote_consistent_lsn.min(commit_lsn),
            configuration: self.state.configuration.clone(),
        })
    }
}
