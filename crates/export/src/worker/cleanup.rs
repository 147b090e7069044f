//! The duties of the node holding a table's cleanup lock: tasks past their
//! TTL removed, PENDING tasks past their timeout killed, tasks whose parts
//! are all exported committed when nobody did, and tasks whose creation
//! never finished removed.

use ferry_coord::CoordError;

use super::rules::{self, Duty};
use super::Run;
use crate::model::{cleanup_lock_path, exports_path, TaskKey};
use crate::task;

impl Run<'_> {
    /// The cleanup holder's duties, per table.
    pub(super) async fn cleanup(&mut self) -> Result<(), CoordError> {
        let now_s = self.ex.clock.unix_seconds();
        let tables: Vec<String> = self.tables.iter().cloned().collect();
        for table in tables {
            // The holder does its duties whatever its own mirror shows.
            if !self.tasks.keys().any(|k| k.table == table)
                && !self.creating.iter().any(|k| k.table == table)
                && !self.cleanup_locks.contains_key(&table)
            {
                continue;
            }
            if !self.cleanup_locks.contains_key(&table) {
                match task::try_lock(&self.session, &cleanup_lock_path(&table), self.name()).await {
                    Ok(Some(lock)) => {
                        self.cleanup_locks.insert(table.clone(), lock);
                    }
                    Ok(None) => continue,
                    Err(CoordError::NoNode { .. }) => continue,
                    Err(e) => return Err(e),
                }
            }
            let keys: Vec<TaskKey> = self
                .tasks
                .keys()
                .filter(|k| k.table == table)
                .cloned()
                .collect();
            for key in keys {
                let Some(t) = self.tasks.get(&key) else {
                    continue;
                };
                let duty = rules::cleanup_duty(
                    t.status,
                    t.metadata.create_time,
                    &t.metadata.settings,
                    now_s,
                );
                match duty {
                    Duty::Keep => continue,
                    Duty::Remove => {
                        tracing::info!(task = %key, "removing an export task past its TTL");
                        task::remove(&self.session, &key, &t.metadata.transaction_id).await?;
                        self.forget(&key).await;
                        continue;
                    }
                    Duty::Kill | Duty::CommitIfNothingLeft => {}
                }
                if duty == Duty::Kill {
                    if let Some(d) = t.destination.clone() {
                        let now_ms = self.ex.clock.unix_micros() / 1000;
                        match task::kill(&self.session, &key, None, &d, "task timeout", now_ms)
                            .await
                        {
                            Ok(_)
                            | Err(task::KillError::Busy(_))
                            | Err(task::KillError::NotFound(_)) => {}
                            Err(task::KillError::Coordination(e)) => return Err(e),
                            Err(e) => {
                                tracing::warn!(task = %key, error = %e, "timeout kill failed")
                            }
                        }
                        if let Some(t) = self.tasks.get_mut(&key) {
                            t.progress_due = true;
                        }
                    }
                    continue;
                }
                // Parts all processed but nobody committed (its replica
                // died in between).
                let left = self
                    .session
                    .exists(&format!("{}/processing", key.path()))
                    .await?
                    .map(|s| s.num_children);
                if left == Some(0) {
                    self.try_commit(&key).await?;
                }
            }
            // Tasks whose creator died before `status`.
            let (keys, _) = match self.session.children(&exports_path(&table)).await {
                Ok(r) => r,
                Err(CoordError::NoNode { .. }) => continue,
                Err(e) => return Err(e),
            };
            for k in keys {
                let key = TaskKey {
                    table: table.clone(),
                    key: k,
                };
                if self.tasks.contains_key(&key) {
                    continue;
                }
                if let Some(head) = task::read_head(&self.session, &key).await? {
                    let abandoned = rules::creation_abandoned(
                        head.status.is_some(),
                        head.metadata.as_ref().map(|m| m.create_time),
                        self.ex.config.creating_grace.as_secs(),
                        now_s,
                    );
                    if abandoned {
                        tracing::info!(task = %key, "removing an export task whose creation never finished");
                        task::remove(&self.session, &key, &head.transaction_id).await?;
                    }
                }
            }
        }
        Ok(())
    }
}
