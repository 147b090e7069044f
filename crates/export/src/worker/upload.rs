//! The upload of one part (outside the run loop, under the part's lock),
//! and the transaction that ends it: the part moved to processed, or the
//! failure recorded with its retry count and back-off.

use std::sync::Arc;

use ferry_coord::{CoordError, CreateMode, Op, OpResult};
use ferry_replica::PartName;
use tokio::time::Instant;

use super::{rules, Run};
use crate::dest::PartFailure;
use crate::model::{DataFile, ExceptionRecord, Processed, Retries, TaskKey, TaskStatus};

pub(super) struct Done {
    key: TaskKey,
    part: String,
    result: Result<DataFile, PartFailure>,
}

impl Run<'_> {
    pub(super) async fn start_upload(&mut self, key: &TaskKey, part: &str) {
        let Some(t) = self.tasks.get(key) else {
            return;
        };
        let Some(destination) = t.destination.clone() else {
            return;
        };
        let (task, table_id) = (t.metadata.clone(), t.metadata.table_id);
        let (table, columns, schema_checked) = (
            t.metadata.table.clone(),
            t.metadata.columns.clone(),
            Arc::clone(&t.schema_checked),
        );
        let parts = Arc::clone(&self.ex.parts);
        let cpu = self.ex.cpu;
        let budget = self.ex.config.upload_budget;
        let (key2, part2) = (key.clone(), part.to_string());
        let handle = self.uploads.spawn(async move {
            let result = async {
                let name = PartName::parse(&part2)
                    .ok_or_else(|| PartFailure::Fatal(format!("{part2} is not a part name")))?;
                let source = parts.find(table_id, &name).await.ok_or_else(|| {
                    PartFailure::Retryable(format!("part {part2} is no longer on this node"))
                })?;
                schema_checked
                    .get_or_try_init(|| {
                        destination.claim_schema(&table, &columns, task.settings.format())
                    })
                    .await?;
                destination.write_part(&task, &source, cpu, budget).await
            }
            .await;
            Done {
                key: key2,
                part: part2,
                result,
            }
        });
        if let Some(t) = self.tasks.get_mut(key) {
            t.queue.started(part);
            t.uploads.insert(part.to_string(), handle);
        }
    }

    /// An upload ended.
    pub(super) async fn finish(&mut self, done: Done) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get_mut(&done.key) else {
            return Ok(());
        };
        t.uploads.remove(&done.part);
        if !t.queue.ended(&done.part) {
            return Ok(());
        }
        let since = self.trips();
        let r = async {
            match done.result {
                Ok(file) => self.succeed(&done.key, &done.part, file).await?,
                Err(failure) => self.fail_part(&done.key, &done.part, failure).await?,
            }
            self.commit_if_due(&done.key).await
        }
        .await;
        self.charge(&done.key, since);
        r?;
        self.schedule(Instant::now()).await
    }

    async fn succeed(
        &mut self,
        key: &TaskKey,
        part: &str,
        file: DataFile,
    ) -> Result<(), CoordError> {
        let base = key.path();
        let processed = Processed {
            file: file.clone(),
            finished_by: self.name().to_string(),
        };
        let Some(fence) = self.fence(key) else {
            return Ok(());
        };
        let ops = vec![
            Op::check(format!("{base}/status"), 0),
            Op::check(fence, 0),
            Op::delete(format!("{base}/processing/{part}"), None),
            Op::create(
                format!("{base}/processed/{part}"),
                serde_json::to_vec(&processed).expect("json"),
                CreateMode::Persistent,
            ),
            Op::delete(format!("{base}/locks/{part}"), Some(0)),
            // Progress watchers see the processing node change.
            Op::set(format!("{base}/processing"), Vec::new(), None),
        ];
        let mut outcome = self.session.multi(ops.clone()).await;
        if let Err(CoordError::ConnectionLoss { .. }) = outcome {
            // Read back: done if the processed entry is there; else the
            // lock is still ours (same session) and the multi is repeated.
            outcome = match self
                .session
                .exists(&format!("{base}/processed/{part}"))
                .await?
            {
                Some(_) => Ok(Vec::new()),
                None => self.session.multi(ops).await,
            };
        }
        let t = self.tasks.get_mut(key);
        match outcome {
            Ok(results) => {
                self.counters.parts_exported += 1;
                self.counters.bytes_exported += file.bytes;
                // The bump of `processing` answers with its stat: no child
                // left means every part is exported (by whichever node), so
                // this node commits now rather than when its progress watch
                // is next read.
                let nothing_left = matches!(
                    results.last(),
                    Some(OpResult::Set { stat }) if stat.num_children == 0
                );
                if let Some(t) = t {
                    t.queue.exported(part);
                    t.parts_to_do = t.parts_to_do.saturating_sub(1);
                    if nothing_left {
                        t.queue.set_commit_due(true);
                    }
                }
                tracing::debug!(task = %key, part, bytes = file.bytes, "part exported");
                Ok(())
            }
            Err(CoordError::MultiFailed { index, .. }) => {
                // 0, 1: no longer PENDING, or replaced (the status watch
                // settles it); 2..: someone else's claim or a lost lock; the
                // part is not ours to finish.
                if index <= 1 {
                    if let Some(t) = t {
                        t.status = TaskStatus::Killed;
                        t.progress_due = true;
                    }
                }
                let _ = self
                    .session
                    .delete(&format!("{base}/locks/{part}"), Some(0))
                    .await;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    pub(super) async fn fail_part(
        &mut self,
        key: &TaskKey,
        part: &str,
        failure: PartFailure,
    ) -> Result<(), CoordError> {
        let base = key.path();
        let name = self.name().to_string();
        let now_s = self.ex.clock.unix_seconds();
        let Some(t) = self.tasks.get_mut(key) else {
            return Ok(());
        };
        match &failure {
            PartFailure::Retryable(_) => self.counters.failures_retryable += 1,
            PartFailure::Fatal(_) => self.counters.failures_fatal += 1,
        }
        tracing::warn!(task = %key, part, class = failure.class(), error = %failure, "part export failed");
        let count = t.exceptions.get(&name).map_or(0, |e| e.count) + 1;
        let record = ExceptionRecord {
            part: part.to_string(),
            message: failure.to_string(),
            time: now_s,
            count,
        };
        let mut ops = vec![Op::check(
            crate::model::fence_path(&base, &t.metadata.transaction_id),
            0,
        )];
        let exception_path = format!("{base}/exceptions/{name}");
        let exists = self.session.exists(&exception_path).await?.is_some();
        let data = serde_json::to_vec(&record).expect("json");
        ops.push(if exists {
            Op::set(exception_path, data, None)
        } else {
            Op::create(exception_path, data, CreateMode::Persistent)
        });
        ops.push(Op::set(format!("{base}/exceptions"), Vec::new(), None));
        let mut fail_task = matches!(failure, PartFailure::Fatal(_));
        if let PartFailure::Retryable(_) = failure {
            let retries_path = format!("{base}/retries/{part}");
            let (retries, version) = match self.session.get(&retries_path).await {
                Ok((d, stat)) => (
                    serde_json::from_slice::<Retries>(&d).unwrap_or_default(),
                    Some(stat.version),
                ),
                Err(CoordError::NoNode { .. }) => (Retries::default(), None),
                Err(e) => return Err(e),
            };
            let next = Retries {
                retry_count: retries.retry_count + 1,
            };
            let data = serde_json::to_vec(&next).expect("json");
            ops.push(match version {
                Some(v) => Op::set(retries_path, data, Some(v)),
                None => Op::create(retries_path, data, CreateMode::Persistent),
            });
            fail_task = rules::fails_task(false, next.retry_count, t.metadata.settings.max_retries);
            t.queue
                .backed_off(part, &t.metadata.settings, Instant::now());
        }
        if fail_task {
            ops.push(crate::task::decide_op(&base, crate::task::Decision::Fail));
            ops.push(Op::set(
                format!("{base}/status"),
                TaskStatus::Failed.as_str(),
                Some(0),
            ));
        }
        ops.push(Op::delete(format!("{base}/locks/{part}"), Some(0)));
        t.exceptions.insert(name, record);
        match self.session.multi(ops).await {
            Ok(_) => {
                if fail_task {
                    tracing::warn!(task = %key, part, "export failed");
                }
                Ok(())
            }
            Err(CoordError::MultiFailed { .. }) => {
                // Lost a race (retry counter, status); the lock goes anyway.
                let _ = self
                    .session
                    .delete(&format!("{base}/locks/{part}"), Some(0))
                    .await;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}
