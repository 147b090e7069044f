//! The mirror of a node's exporter: every export task read from
//! coordination and kept current by watches (status, workers, progress,
//! exceptions), a task's joining of its workers, and the release of pins
//! that no PENDING task holds any more.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ferry_coord::{CoordError, CreateMode, Op};
use ferry_replica::PartName;

use super::queue::PartQueue;
use super::{forward, is_session_end, Event, Run, Task};
use crate::dest::Destination;
use crate::model::{exports_path, ExceptionRecord, TaskKey, TaskStatus, TABLES};
use crate::task;

/// Age past which a pin without a PENDING task is released (see
/// `load_tables`).
pub const ORPHAN_PIN_AGE: Duration = Duration::from_secs(600);

impl Run<'_> {
    pub(super) async fn load_tables(&mut self) -> Result<(), CoordError> {
        let tx = &self.events.clone();
        let (tables, _, watch) = match self.session.children_watch(TABLES).await {
            Ok(r) => r,
            Err(CoordError::NoNode { .. }) => {
                let (_, w) = self.session.exists_watch(TABLES).await?;
                forward(tx, w, Event::Tables);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        forward(tx, watch, Event::Tables);
        self.tables = tables.iter().cloned().collect();
        self.mirror_complete = true;
        for t in tables {
            self.load_exports(&t).await?;
        }
        // Tasks of dropped tables.
        let gone: Vec<TaskKey> = self
            .tasks
            .keys()
            .filter(|k| !self.tables.contains(&k.table))
            .cloned()
            .collect();
        for k in gone {
            self.forget(&k).await;
        }
        // Pins of exports that do not exist: removed while this node was
        // down, or taken by a request whose task was never created (the
        // requester died before releasing them). A request creates its task
        // within seconds of its transaction id's time, so a pin older than
        // ORPHAN_PIN_AGE without a PENDING task in the complete mirror is
        // an orphan.
        let live: BTreeSet<String> = self
            .tasks
            .values()
            .filter(|t| t.status == TaskStatus::Pending)
            .map(|t| t.metadata.transaction_id.clone())
            .collect();
        if !self.mirror_complete {
            return Ok(());
        }
        let now_ms = self.ex.clock.unix_micros() / 1000;
        for tx_id in self.ex.parts.pinned().await {
            let old = crate::model::transaction_millis(&tx_id)
                .is_none_or(|ms| ms + ORPHAN_PIN_AGE.as_millis() as u64 <= now_ms);
            if !live.contains(&tx_id) && old {
                if let Err(e) = self.ex.parts.unpin(&tx_id).await {
                    tracing::warn!(transaction_id = %tx_id, error = %e, "could not release pins");
                }
            }
        }
        Ok(())
    }

    /// The safety poll's check of every mirrored task: one whose fence is
    /// gone (removed or replaced while a watch event was lost) is forgotten
    /// and its key read again; one mirrored as PENDING whose status moved
    /// on (its status watch's event lost) is read again, so that nothing
    /// waiting on this mirror (an export policy's next increment) waits on
    /// a stale PENDING forever. A read without a watch: the status watch
    /// is armed again only when the status did change.
    pub(super) async fn verify_mirror(&mut self) -> Result<(), CoordError> {
        let keys: Vec<(TaskKey, String, TaskStatus)> = self
            .tasks
            .iter()
            .map(|(k, t)| {
                (
                    k.clone(),
                    crate::model::fence_path(&k.path(), &t.metadata.transaction_id),
                    t.status,
                )
            })
            .collect();
        for (key, fence, mirrored) in keys {
            if self.session.exists(&fence).await?.is_none() {
                self.forget(&key).await;
                self.load_exports(&key.table).await?;
                continue;
            }
            if mirrored.is_terminal() {
                continue;
            }
            let now = match self.session.get(&format!("{}/status", key.path())).await {
                Ok((data, _)) => TaskStatus::parse(&data),
                Err(CoordError::NoNode { .. }) => None,
                Err(e) => return Err(e),
            };
            if now != Some(mirrored) {
                tracing::info!(task = %key, "export task status changed unseen; read again");
                self.refresh_status(&key).await?;
            }
        }
        Ok(())
    }

    pub(super) async fn load_exports(&mut self, table: &str) -> Result<(), CoordError> {
        let tx = &self.events.clone();
        let path = exports_path(table);
        let keys = match self.session.children_watch(&path).await {
            Ok((keys, _, watch)) => {
                forward(tx, watch, Event::Exports(table.to_string()));
                keys
            }
            Err(CoordError::NoNode { .. }) => {
                // No export yet: watch for the first.
                match self.session.exists_watch(&path).await {
                    Ok((None, w)) => forward(tx, w, Event::Exports(table.to_string())),
                    Ok((Some(_), w)) => {
                        drop(w);
                        let _ = tx.try_send(Event::Exports(table.to_string()));
                    }
                    Err(CoordError::NoNode { .. }) => {}
                    Err(e) => return Err(e),
                }
                Vec::new()
            }
            Err(e) => return Err(e),
        };
        let present: BTreeSet<&String> = keys.iter().collect();
        let gone: Vec<TaskKey> = self
            .tasks
            .keys()
            .filter(|k| k.table == table && !present.contains(&k.key))
            .cloned()
            .collect();
        for k in gone {
            self.forget(&k).await;
        }
        for key in keys {
            let key = TaskKey {
                table: table.to_string(),
                key,
            };
            // A task replaced by a forced export is forgotten when its status
            // node goes (its watch fires), and then read again here.
            if self.tasks.contains_key(&key) || self.creating.contains(&key) {
                continue;
            }
            if self.tasks.len() >= self.ex.config.max_tasks {
                self.mirror_complete = false;
                break;
            }
            // One task that cannot be read (being removed, damaged) does not
            // keep the others from loading.
            match self.add(key.clone()).await {
                Ok(()) => {}
                Err(e) if is_session_end(&e) || matches!(e, CoordError::ConnectionLoss { .. }) => {
                    return Err(e)
                }
                Err(e) => {
                    self.mirror_complete = false;
                    tracing::debug!(task = %key, error = %e, "export task not loaded");
                }
            }
        }
        Ok(())
    }

    /// Loads a task into the mirror (a task still being created is left for
    /// its status watch... or cleanup).
    async fn add(&mut self, key: TaskKey) -> Result<(), CoordError> {
        let since = self.trips();
        let tx = self.events.clone();
        let tx = &tx;
        let status_path = format!("{}/status", key.path());
        let (status, watch) = match self.session.get_watch(&status_path).await {
            Ok((data, _, w)) => (TaskStatus::parse(&data), w),
            Err(CoordError::NoNode { .. }) => {
                // Being created: the status's creation fires this.
                if let Ok((_, w)) = self.session.exists_watch(&status_path).await {
                    forward(tx, w, Event::Created(key.clone()));
                    self.creating.insert(key);
                }
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let Some(status) = status else {
            tracing::warn!(task = %key, "export task with an unknown status; ignored");
            return Ok(());
        };
        let Some(head) = task::read_head(&self.session, &key).await? else {
            return Ok(());
        };
        let Some(metadata) = head.metadata else {
            return Ok(());
        };
        forward(tx, watch, Event::Status(key.clone()));
        let mut t = Task {
            key: key.clone(),
            status,
            destination: None,
            queue: PartQueue::default(),
            snapshot_names: Vec::new(),
            uploads: BTreeMap::new(),
            parts_to_do: metadata.parts_count,
            exceptions: BTreeMap::new(),
            commit_file: None,
            progress_due: true,
            exceptions_due: true,
            progress_armed: false,
            exceptions_armed: false,
            schema_checked: Arc::new(tokio::sync::OnceCell::new()),
            coordination_ops: 0,
            metadata,
        };
        let parts = task::read_parts(&self.session, &key, &t.metadata).await?;
        t.snapshot_names = parts.iter().map(|p| p.name.clone()).collect();
        if status == TaskStatus::Pending {
            match self.ex.destinations.open(&t.metadata.destination) {
                Ok(l) => {
                    t.destination = Some(
                        Destination::new(l).with_commit_queue(Arc::clone(&self.ex.iceberg_commits)),
                    )
                }
                Err(e) => {
                    tracing::warn!(task = %key, error = %e, "export destination cannot be opened here");
                }
            }
            // Parts held here and not yet exported.
            let (left, _) = self
                .session
                .children(&format!("{}/processing", key.path()))
                .await?;
            let left: BTreeSet<String> = left.into_iter().collect();
            let mut held = Vec::new();
            for p in &parts {
                if !left.contains(&p.name) {
                    continue;
                }
                let Some(name) = PartName::parse(&p.name) else {
                    continue;
                };
                if self
                    .ex
                    .parts
                    .find(t.metadata.table_id, &name)
                    .await
                    .is_some()
                {
                    t.queue.hold(p.name.clone());
                    held.push(name);
                }
            }
            if !held.is_empty() {
                if let Err(e) = self
                    .ex
                    .parts
                    .pin(&t.metadata.transaction_id, t.metadata.table_id, &held)
                    .await
                {
                    tracing::warn!(task = %key, error = %e, "could not pin an export's parts");
                }
            }
            t.queue.set_commit_due(left.is_empty());
            if t.queue.has_todo() {
                let workers = self.join(&key).await?;
                t.queue.rank(self.name(), &workers);
            }
        } else {
            self.settle(&mut t).await;
        }
        tracing::debug!(task = %key, status = %t.status, todo = t.queue.todo_len(), "export task mirrored");
        t.coordination_ops = self.trips() - since;
        self.tasks.insert(key, t);
        Ok(())
    }

    /// Joins the task's workers (an ephemeral `workers/<name>`, created only
    /// while the task is PENDING, so that a removal, which deletes `status`
    /// first, lists every worker it must delete) and lists them, watching
    /// for changes. Without `workers/` (a task created before it existed),
    /// or when the task is no longer PENDING, none are known and the parts
    /// go in this node's own order.
    async fn join(&self, key: &TaskKey) -> Result<Vec<String>, CoordError> {
        let dir = format!("{}/workers", key.path());
        let ops = vec![
            Op::create(
                format!("{dir}/{}", self.name()),
                Vec::new(),
                CreateMode::Ephemeral,
            ),
            Op::check(format!("{}/status", key.path()), 0),
        ];
        match self.session.multi(ops).await {
            Ok(_) => {}
            // Already there: this session's lost answer, or an earlier
            // session of this node that has not expired yet.
            Err(CoordError::MultiFailed { index: 0, .. })
                if matches!(
                    self.session.exists(&format!("{dir}/{}", self.name())).await,
                    Ok(Some(_))
                ) => {}
            Err(CoordError::MultiFailed { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        }
        match self.session.children_watch(&dir).await {
            Ok((mut names, _, w)) => {
                forward(&self.events, w, Event::Workers(key.clone()));
                names.sort();
                Ok(names)
            }
            Err(CoordError::NoNode { .. }) => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    /// The task's workers changed: the shares are drawn again.
    pub(super) async fn refresh_workers(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get(key) else {
            return Ok(());
        };
        if t.status != TaskStatus::Pending || !t.queue.has_todo() {
            return Ok(());
        }
        let dir = format!("{}/workers", key.path());
        let names = match self.session.children_watch(&dir).await {
            Ok((mut names, _, w)) => {
                forward(&self.events, w, Event::Workers(key.clone()));
                names.sort();
                names
            }
            Err(CoordError::NoNode { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let me = self.name().to_string();
        if let Some(t) = self.tasks.get_mut(key) {
            t.queue.rank(&me, &names);
        }
        Ok(())
    }

    /// A task left PENDING: its uploads stop and its pins go.
    async fn settle(&self, t: &mut Task) {
        t.queue.settle();
        for (_, h) in std::mem::take(&mut t.uploads) {
            h.abort();
        }
        if t.status == TaskStatus::Completed && t.commit_file.is_none() {
            if let Ok((data, _)) = self
                .session
                .get(&format!("{}/commit_info", t.key.path()))
                .await
            {
                t.commit_file = Some(String::from_utf8_lossy(&data).into_owned());
            }
        }
        if let Err(e) = self.ex.parts.unpin(&t.metadata.transaction_id).await {
            tracing::warn!(task = %t.key, error = %e, "could not release an export's pins");
        }
    }

    pub(super) async fn forget(&mut self, key: &TaskKey) {
        if let Some(mut t) = self.tasks.remove(key) {
            t.status = if t.status == TaskStatus::Pending {
                TaskStatus::Killed
            } else {
                t.status
            };
            self.settle(&mut t).await;
            tracing::debug!(task = %key, "export task removed");
        }
    }

    pub(super) async fn refresh_status(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let tx = &self.events.clone();
        let path = format!("{}/status", key.path());
        let status = match self.session.get_watch(&path).await {
            Ok((data, _, w)) => {
                forward(tx, w, Event::Status(key.clone()));
                TaskStatus::parse(&data)
            }
            Err(CoordError::NoNode { .. }) => {
                // Removed (TTL, or replaced by a forced export).
                self.forget(key).await;
                return self.load_exports(&key.table).await;
            }
            Err(e) => return Err(e),
        };
        let Some(mut t) = self.tasks.remove(key) else {
            return Ok(());
        };
        match status {
            Some(s) if s != t.status => {
                t.status = s;
                if s.is_terminal() {
                    self.settle(&mut t).await;
                    t.progress_due = true;
                }
                tracing::info!(task = %key, status = %s, "export task status");
            }
            _ => {}
        }
        self.tasks.insert(key.clone(), t);
        Ok(())
    }

    /// parts_to_do and exceptions of a task whose progress watch fired, at
    /// most once per tick.
    pub(super) async fn refresh_progress(&mut self, key: &TaskKey) -> Result<(), CoordError> {
        let Some(t) = self.tasks.get_mut(key) else {
            return Ok(());
        };
        let (progress, exceptions) = (t.progress_due, t.exceptions_due);
        let (progress_armed, exceptions_armed) = (t.progress_armed, t.exceptions_armed);
        let base = key.path();
        if progress {
            // A watch is set only when none is armed: each one fires once,
            // and one per node is enough.
            let path = format!("{base}/processing");
            let stat = if progress_armed {
                self.session.exists(&path).await?
            } else {
                let (stat, watch) = self.session.exists_watch(&path).await?;
                forward(&self.events, watch, Event::Progress(key.clone()));
                if let Some(t) = self.tasks.get_mut(key) {
                    t.progress_armed = true;
                }
                stat
            };
            let Some(stat) = stat else {
                self.forget(key).await;
                return Ok(());
            };
            if let Some(t) = self.tasks.get_mut(key) {
                t.progress_due = false;
                t.parts_to_do = stat.num_children as u64;
                if t.parts_to_do == 0 && t.status == TaskStatus::Pending {
                    t.queue.set_commit_due(true);
                }
            }
        }
        if exceptions {
            let path = format!("{base}/exceptions");
            let replicas = if exceptions_armed {
                self.session.children(&path).await.map(|(c, _)| c)
            } else {
                self.session
                    .children_watch(&path)
                    .await
                    .map(|(c, _, watch)| {
                        forward(&self.events, watch, Event::Exceptions(key.clone()));
                        c
                    })
            };
            let replicas = match replicas {
                Ok(r) => r,
                Err(CoordError::NoNode { .. }) => return Ok(()),
                Err(e) => return Err(e),
            };
            if !exceptions_armed {
                if let Some(t) = self.tasks.get_mut(key) {
                    t.exceptions_armed = true;
                }
            }
            let mut found = BTreeMap::new();
            for r in replicas {
                if let Ok((d, _)) = self.session.get(&format!("{base}/exceptions/{r}")).await {
                    if let Ok(rec) = serde_json::from_slice::<ExceptionRecord>(&d) {
                        found.insert(r, rec);
                    }
                }
            }
            if let Some(t) = self.tasks.get_mut(key) {
                t.exceptions_due = false;
                t.exceptions = found;
            }
        }
        Ok(())
    }
}
