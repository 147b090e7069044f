//! The commit a node tries once a task has no part left (see
//! [`crate::task::commit`]), and what the mirror learns from its outcome.

use ferry_coord::CoordError;

use super::Run;
use crate::model::{TaskKey, TaskStatus};
use crate::task::{self, CommitOutcome};

impl Run<'_> {
    pub(super) async fn commit_if_due(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get_mut(key) else {
            return Ok(());
        };
        if !t.queue.commit_due() || t.status != TaskStatus::Pending {
            return Ok(());
        }
        t.queue.set_commit_due(false);
        self.try_commit(key).await
    }

    pub(super) async fn try_commit(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get(key) else {
            return Ok(());
        };
        let Some(destination) = t.destination.clone() else {
            return Ok(());
        };
        let metadata = t.metadata.clone();
        let now_ms = self.ex.clock.unix_micros() / 1000;
        match task::commit(
            &self.session,
            key,
            &metadata,
            &destination,
            self.name(),
            now_ms,
        )
        .await
        {
            Ok(CommitOutcome::Completed(file)) => {
                self.counters.commits += 1;
                if let Some(t) = self.tasks.get_mut(key) {
                    t.status = TaskStatus::Completed;
                    t.commit_file = Some(file);
                    t.parts_to_do = 0;
                }
                if let Err(e) = self.ex.parts.unpin(&metadata.transaction_id).await {
                    tracing::warn!(task = %key, error = %e, "could not release an export's pins");
                }
                Ok(())
            }
            Ok(CommitOutcome::NotNow) => Ok(()),
            Ok(CommitOutcome::Terminal(_)) | Ok(CommitOutcome::Failed(_)) => {
                if let Some(t) = self.tasks.get_mut(key) {
                    t.progress_due = true;
                }
                Ok(())
            }
            Err(task::CommitError::Coordination(e)) => {
                // Tried again at the next tick (this session may still hold
                // the commit lock, which only it can use).
                if let Some(t) = self.tasks.get_mut(key) {
                    t.queue.set_commit_due(true);
                }
                Err(e)
            }
            Err(task::CommitError::Destination(e)) => {
                tracing::warn!(task = %key, error = %e, "commit file not written; retried");
                if let Some(t) = self.tasks.get_mut(key) {
                    t.queue.set_commit_due(true);
                }
                Ok(())
            }
        }
    }
}
