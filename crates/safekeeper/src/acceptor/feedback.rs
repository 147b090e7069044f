//! Replica feedback: the board of every replica's latest positions (what
//! the walsenders record and the writer is relayed), and the forgetting of
//! replicas that no longer hold WAL removal.

use std::collections::BTreeMap;
use std::sync::Arc;

use ferry_wal::liveness::Tombstones;
use ferry_wal::proto::{ForgottenReplica, FromSafekeeper, ShardFeedback};
use ferry_wal::Lsn;

use super::{Acceptor, AcceptorError};
use crate::control::{RegisteredReplica, MAX_REGISTERED_REPLICAS};

/// Most replicas whose feedback a safekeeper keeps; feedback of more is
/// dropped (with a warning) rather than growing without bound.
pub const MAX_FEEDBACK_REPLICAS: usize = 4096;

/// The latest feedback of every replica streaming from this safekeeper, by
/// (shard, replica): replicas of one shard never overwrite each other. Shared
/// by the acceptor (which relays it to the writer) and its walsenders (which
/// record it) without the acceptor's lock. A forgotten replica (unregistered,
/// or silent past the replica expiry) leaves a tombstone: its feedback up to
/// the tombstone's reply time is ignored, so a stale copy relayed again does
/// not bring it back; a newer reply (the replica came back) does.
#[derive(Debug, Clone, Default)]
pub struct FeedbackBoard(Arc<std::sync::Mutex<Board>>);

#[derive(Debug, Default)]
struct Board {
    latest: BTreeMap<(u32, u32), ShardFeedback>,
    forgotten: Tombstones,
}

impl FeedbackBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Board> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `feedback` if it is the replica's newest (by its reply time).
    pub fn record(&self, feedback: ShardFeedback) {
        let key = (feedback.shard_number, feedback.replica_number);
        let mut board = self.lock();
        if board.forgotten.hides(&feedback) {
            return;
        }
        if !board.latest.contains_key(&key) && board.latest.len() >= MAX_FEEDBACK_REPLICAS {
            tracing::warn!(
                shard = key.0,
                replica = key.1,
                "feedback of too many replicas; this one is dropped"
            );
            return;
        }
        let newer = board
            .latest
            .get(&key)
            .is_none_or(|old| old.reply_time_micros <= feedback.reply_time_micros);
        if newer {
            board.latest.insert(key, feedback);
        }
    }

    /// Forgets a replica's feedback up to `forget.reply_time_micros`; returns
    /// whether it was registered (and is forgotten now). Feedback newer than
    /// that stays: the replica is alive.
    pub fn forget(&self, forget: ForgottenReplica) -> bool {
        let key = (forget.shard_number, forget.replica_number);
        let mut board = self.lock();
        let registered = board
            .latest
            .get(&key)
            .is_some_and(|f| f.reply_time_micros <= forget.reply_time_micros);
        if registered {
            board.latest.remove(&key);
        }
        board.forgotten.add(forget);
        registered
    }

    /// The tombstones, for the writer (which forgets the same replicas).
    pub fn forgotten(&self) -> Vec<ForgottenReplica> {
        self.lock().forgotten.list()
    }

    /// Every replica's latest feedback, in (shard, replica) order.
    pub fn all(&self) -> Vec<ShardFeedback> {
        self.lock().latest.values().copied().collect()
    }

    pub fn len(&self) -> usize {
        self.lock().latest.len()
    }

    /// Every replica's durably applied position, for the control file.
    pub fn registered(&self) -> Vec<RegisteredReplica> {
        self.lock()
            .latest
            .values()
            .take(MAX_REGISTERED_REPLICAS)
            .map(|f| RegisteredReplica {
                shard_number: f.shard_number,
                replica_number: f.replica_number,
                remote_consistent_lsn: f.remote_consistent_lsn,
            })
            .collect()
    }

    /// The lowest durably applied position of any replica (`None`: none known).
    pub fn min_remote_consistent(&self) -> Option<Lsn> {
        self.lock()
            .latest
            .values()
            .map(|f| f.remote_consistent_lsn)
            .min()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Acceptor {
    /// Records a replica's feedback (relayed to the writer in append responses).
    pub fn record_feedback(&mut self, feedback: ShardFeedback) {
        self.feedback.record(feedback);
    }

    /// Every registered replica's latest feedback.
    pub fn replica_feedback(&self) -> Vec<ShardFeedback> {
        self.feedback.all()
    }

    /// Forgets a replica (an operator unregistered it, or it was silent past
    /// the replica expiry): it stops holding WAL removal here, and the writer
    /// learns it with the next answer. The control file stops listing it.
    pub async fn forget_replica(
        &mut self,
        forget: ForgottenReplica,
    ) -> Result<FromSafekeeper, AcceptorError> {
        let was_registered = self.feedback.forget(forget);
        if was_registered {
            self.replicas_forgotten += 1;
            self.state.registered_replicas = self.feedback.registered();
            self.persist_now().await?;
        }
        Ok(FromSafekeeper::Forgotten { was_registered })
    }
}
