//! Operations on one task in coordination that any replica may run: reading
//! it, the commit, kill, and removal.
//!
//! How a PENDING task ends is decided once, by whoever creates its
//! persistent `decision` node first (data `commit`, `kill` or `fail`):
//! a kill and a failure create it in the same multi that sets `status`
//! (version-checked on 0); a committer creates it (status checked PENDING)
//! *before* it writes the commit file, and sets COMPLETED after. So a
//! commit file exists only for a task decided `commit`, which no kill or
//! failure can then end otherwise: a kill that finds `commit` decided
//! completes the commit itself (the commit file is computed from the
//! immutable processed entries, so every writer writes the same bytes,
//! create-only). This holds without the commit lock too, for a committer
//! whose session expired while its commit file was in flight; and a kill
//! of an undecided task needs no object-storage request, so a task can be
//! killed (and timed out) while its destination is down. Commit, kill and
//! the timeout kill still run under the task's ephemeral `commit_lock`, so
//! that they rarely race at all.

use ferry_coord::{CoordError, CreateMode, Op, Session};

use crate::dest::{Destination, PartFailure};
use crate::model::{
    CommitFile, DataFile, LakeFormat, Metadata, Processed, SnapshotPart, TaskKey, TaskStatus,
    COMMIT_FORMAT,
};

/// A task's identity and state.
#[derive(Debug, Clone)]
pub struct Head {
    pub transaction_id: String,
    /// None while the task is being created (or its creator died).
    pub metadata: Option<Metadata>,
    pub status: Option<TaskStatus>,
}

/// How a PENDING task ends: the data of its `decision` node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Commit,
    Kill,
    Fail,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Commit => "commit",
            Decision::Kill => "kill",
            Decision::Fail => "fail",
        }
    }

    pub fn parse(data: &[u8]) -> Option<Decision> {
        match data {
            b"commit" => Some(Decision::Commit),
            b"kill" => Some(Decision::Kill),
            b"fail" => Some(Decision::Fail),
            _ => None,
        }
    }
}

pub fn decision_path(base: &str) -> String {
    format!("{base}/decision")
}

/// The op that decides a task's end; only the first of them succeeds.
pub fn decide_op(base: &str, decision: Decision) -> Op {
    Op::create(
        decision_path(base),
        decision.as_str(),
        CreateMode::Persistent,
    )
}

/// The task's decision, if one was made.
pub async fn read_decision(
    session: &Session,
    key: &TaskKey,
) -> Result<Option<Decision>, CoordError> {
    read_word(session, &decision_path(&key.path()), Decision::parse).await
}

/// A node holding one word (a status, a decision), parsed; None if there is
/// no node.
async fn read_word<T>(
    session: &Session,
    path: &str,
    parse: fn(&[u8]) -> Option<T>,
) -> Result<Option<T>, CoordError> {
    match session.get(path).await {
        Ok((data, _)) => parse(&data).map(Some).ok_or_else(|| {
            damaged(
                path,
                format!("unknown value {:?}", String::from_utf8_lossy(&data)),
            )
        }),
        Err(CoordError::NoNode { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

fn damaged(path: &str, detail: impl std::fmt::Display) -> CoordError {
    CoordError::Backend(format!("export task node {path} is damaged: {detail}"))
}

/// Reads a task's node, metadata and status; None if there is no task.
pub async fn read_head(session: &Session, key: &TaskKey) -> Result<Option<Head>, CoordError> {
    let base = key.path();
    let transaction_id = match session.get(&base).await {
        Ok((data, _)) => String::from_utf8_lossy(&data).into_owned(),
        Err(CoordError::NoNode { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let metadata = match session.get(&format!("{base}/metadata.json")).await {
        Ok((data, _)) => Some(
            serde_json::from_slice::<Metadata>(&data)
                .map_err(|e| damaged(&format!("{base}/metadata.json"), e))?,
        ),
        Err(CoordError::NoNode { .. }) => None,
        Err(e) => return Err(e),
    };
    let status = read_status(session, key).await?;
    Ok(Some(Head {
        transaction_id,
        metadata,
        status,
    }))
}

pub async fn read_status(
    session: &Session,
    key: &TaskKey,
) -> Result<Option<TaskStatus>, CoordError> {
    read_word(
        session,
        &format!("{}/status", key.path()),
        TaskStatus::parse,
    )
    .await
}

/// The snapshot's parts, from the `parts/` chunks.
pub async fn read_parts(
    session: &Session,
    key: &TaskKey,
    metadata: &Metadata,
) -> Result<Vec<SnapshotPart>, CoordError> {
    let mut parts = Vec::with_capacity(metadata.parts_count as usize);
    for i in 0..metadata.parts_chunks {
        let path = format!("{}/parts/{i:06}", key.path());
        let (data, _) = session.get(&path).await?;
        parts.extend(
            serde_json::from_slice::<Vec<SnapshotPart>>(&data).map_err(|e| damaged(&path, e))?,
        );
    }
    if parts.len() as u64 != metadata.parts_count {
        return Err(damaged(
            &key.path(),
            format!(
                "{} parts listed, metadata says {}",
                parts.len(),
                metadata.parts_count
            ),
        ));
    }
    Ok(parts)
}

/// Times [`remove`] starts again after another remover of the same task
/// moved its mark.
const MAX_REMOVE_ATTEMPTS: usize = 8;

/// Removes the task of transaction `transaction_id` and everything under
/// it (chunked deletes; nodes already gone are fine), and nothing of
/// another: a task of the key created since (its node holds another
/// transaction id) is left alone.
///
/// Removers race: two requests replacing the same finished task, cleanup
/// and a request, a creator undoing its half-made task. Deleting by path
/// alone, a slow remover could delete the status and parts of a task
/// created after another remover finished, leaving it PENDING with parts
/// missing for good. So the first step marks the task's node (a set that
/// bumps its version, in the multi that deletes `status` and the fence:
/// the task is then invisible to workers and its transaction fenced), and
/// every later delete is a multi checking that version: once the node is
/// gone, or re-created, or marked again by another remover, this one
/// stops (and looks again).
pub async fn remove(
    session: &Session,
    key: &TaskKey,
    transaction_id: &str,
) -> Result<(), CoordError> {
    for _ in 0..MAX_REMOVE_ATTEMPTS {
        if remove_once(session, key, transaction_id).await? {
            return Ok(());
        }
    }
    Err(CoordError::BadVersion { path: key.path() })
}

/// One attempt of [`remove`]: `Ok(true)` once the task is gone (or was
/// never this transaction's), `Ok(false)` when another remover moved the
/// mark.
async fn remove_once(
    session: &Session,
    key: &TaskKey,
    transaction_id: &str,
) -> Result<bool, CoordError> {
    let base = key.path();
    let (data, stat) = match session.get(&base).await {
        Ok(r) => r,
        Err(CoordError::NoNode { .. }) => return Ok(true),
        Err(e) => return Err(e),
    };
    if data != transaction_id.as_bytes() {
        return Ok(true);
    }
    let subs = match session.children(&base).await {
        Ok((c, _)) => c,
        Err(CoordError::NoNode { .. }) => return Ok(true),
        Err(e) => return Err(e),
    };
    // First what makes the task visible and what fences its transaction:
    // a half-removed task is then one without status (ignored by workers,
    // removed by cleanup), never one with a status and missing parts.
    let (first, subs): (Vec<String>, Vec<String>) = subs
        .into_iter()
        .partition(|s| s == "status" || s.starts_with("tx-"));
    let mut mark = vec![Op::set(base.clone(), data, Some(stat.version))];
    mark.extend(
        first
            .iter()
            .map(|s| Op::delete(format!("{base}/{s}"), None)),
    );
    match session.multi(mark).await {
        Ok(_) => {}
        // Moved, re-created, or its status/fence already deleted by
        // another remover: look again.
        Err(CoordError::MultiFailed { .. }) => return Ok(false),
        Err(e) => return Err(e),
    }
    let marked = stat.version.saturating_add(1);
    let mut deletes = Vec::new();
    for sub in &subs {
        let path = format!("{base}/{sub}");
        match session.children(&path).await {
            Ok((children, _)) => {
                deletes.extend(children.iter().map(|c| format!("{path}/{c}")));
            }
            Err(CoordError::NoNode { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    deletes.extend(subs.iter().map(|s| format!("{base}/{s}")));
    delete_all_marked(session, &base, marked, deletes).await
}

/// Deletes the nodes under the task's node `base` in order, in multis
/// within the request limit, each checking that `base` still has version
/// `marked` (a node already gone is skipped: the batch it failed is retried
/// one by one), then `base` itself at that version. `Ok(false)` when the
/// check failed (another remover took over).
async fn delete_all_marked(
    session: &Session,
    base: &str,
    marked: i32,
    paths: Vec<String>,
) -> Result<bool, CoordError> {
    let limit = ferry_coord::path::MAX_REQUEST_BYTES;
    let prefix = session.path_prefix_bytes();
    let check = || Op::check(base.to_string(), marked);
    let flush = |batch: Vec<Op>| async move {
        if batch.len() <= 1 {
            return Ok(true);
        }
        match session.multi(batch.clone()).await {
            Ok(_) => Ok(true),
            Err(CoordError::MultiFailed { index: 0, .. }) => Ok(false),
            Err(CoordError::MultiFailed { .. }) => {
                for op in batch.into_iter().skip(1) {
                    match session.multi(vec![check(), op]).await {
                        Ok(_) => {}
                        Err(CoordError::MultiFailed { index: 0, .. }) => return Ok(false),
                        Err(CoordError::MultiFailed { index: 1, source })
                            if matches!(*source, CoordError::NoNode { .. }) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(true)
            }
            Err(e) => Err(e),
        }
    };
    let mut batch: Vec<Op> = vec![check()];
    for p in paths {
        batch.push(Op::delete(p, None));
        if ferry_coord::multi_request_bytes(&batch, prefix) > limit / 2
            && !flush(std::mem::replace(&mut batch, vec![check()])).await?
        {
            return Ok(false);
        }
    }
    if !flush(batch).await? {
        return Ok(false);
    }
    // The node itself last, at the version marked.
    match session.delete(base, Some(marked)).await {
        Ok(()) => Ok(true),
        Err(CoordError::NoNode { .. }) | Err(CoordError::BadVersion { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// An ephemeral lock node held by this session.
pub struct HeldLock {
    path: String,
}

/// Takes an ephemeral lock (data = `owner`). A create whose outcome is
/// unknown is read back: the node's ephemeral owner says whether it is ours,
/// so a lost answer never leaves a lock nobody knows it holds.
pub async fn try_lock(
    session: &Session,
    path: &str,
    owner: &str,
) -> Result<Option<HeldLock>, CoordError> {
    match session
        .create(path, owner.as_bytes(), CreateMode::Ephemeral)
        .await
    {
        Ok(_) => Ok(Some(HeldLock {
            path: path.to_string(),
        })),
        // Ours already: a release whose answer was lost left it.
        Err(CoordError::NodeExists { .. } | CoordError::ConnectionLoss { .. }) => {
            match session.exists(path).await? {
                Some(stat) if stat.ephemeral_owner == session.session_id() => Ok(Some(HeldLock {
                    path: path.to_string(),
                })),
                _ => Ok(None),
            }
        }
        Err(e) => Err(e),
    }
}

impl HeldLock {
    /// Deletes the lock, retrying lost answers a few times; a lock left
    /// behind is still this session's, and [`try_lock`] takes it again.
    pub async fn release(self, session: &Session) {
        for _ in 0..3 {
            match session.delete(&self.path, None).await {
                Ok(()) | Err(CoordError::NoNode { .. }) => return,
                Err(CoordError::ConnectionLoss { .. }) => continue,
                Err(e) => {
                    tracing::debug!(path = %self.path, error = %e, "could not release a lock");
                    return;
                }
            }
        }
        tracing::debug!(path = %self.path, "lock release unanswered; the lock stays this session's");
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KillError {
    #[error("no export task {0}")]
    NotFound(String),
    #[error("export {key} is for transaction {found}, not {expected}")]
    OtherTransaction {
        key: String,
        found: String,
        expected: String,
    },
    #[error("export {0} is being committed or killed by another replica right now; try again")]
    Busy(String),
    #[error("finishing the commit decided before the kill: {0}")]
    Destination(String),
    #[error(transparent)]
    Coordination(#[from] CoordError),
}

/// [`kill`] in a session of its own, closed when it returns: for callers
/// that are not exporters (requests, the HTTP API), so that a commit lock
/// whose release was lost cannot outlive the kill (an exporter takes its own
/// lock again at its next try; a one-off caller never would).
pub async fn kill_in_own_session(
    sessions: &dyn ferry_coord::SessionFactory,
    key: &TaskKey,
    expect_transaction: Option<&str>,
    destination: &Destination,
    reason: &str,
    now_ms: u64,
) -> Result<TaskStatus, KillError> {
    let session = sessions.open().await?;
    let result = kill(
        &session,
        key,
        expect_transaction,
        destination,
        reason,
        now_ms,
    )
    .await;
    session.close().await;
    result
}

/// Sets a PENDING task KILLED, under its commit lock; returns the status it
/// ends in (already terminal: unchanged; its commit file already written:
/// COMPLETED). `now_ms` (Unix milliseconds) is the time of a commit it
/// finishes.
pub async fn kill(
    session: &Session,
    key: &TaskKey,
    expect_transaction: Option<&str>,
    destination: &Destination,
    reason: &str,
    now_ms: u64,
) -> Result<TaskStatus, KillError> {
    let Some(head) = read_head(session, key).await? else {
        return Err(KillError::NotFound(key.to_string()));
    };
    if let Some(tx) = expect_transaction {
        if head.transaction_id != tx {
            return Err(KillError::OtherTransaction {
                key: key.to_string(),
                found: head.transaction_id,
                expected: tx.to_string(),
            });
        }
    }
    let Some(metadata) = head.metadata else {
        return Err(KillError::NotFound(key.to_string()));
    };
    let Some(lock) = try_lock(session, &format!("{}/commit_lock", key.path()), "kill").await?
    else {
        return Err(KillError::Busy(key.to_string()));
    };
    let result = kill_locked(session, key, &metadata, destination, reason, now_ms).await;
    lock.release(session).await;
    result
}

async fn kill_locked(
    session: &Session,
    key: &TaskKey,
    metadata: &Metadata,
    destination: &Destination,
    reason: &str,
    now_ms: u64,
) -> Result<TaskStatus, KillError> {
    match read_status(session, key).await? {
        Some(TaskStatus::Pending) => {}
        Some(done) => return Ok(done),
        None => return Err(KillError::NotFound(key.to_string())),
    }
    let base = key.path();
    let ops = vec![
        Op::check(crate::model::fence_path(&base, &metadata.transaction_id), 0),
        decide_op(&base, Decision::Kill),
        Op::set(
            format!("{base}/status"),
            TaskStatus::Killed.as_str(),
            Some(0),
        ),
    ];
    // What the multi did: Some(index) of the op that failed.
    let failed_at = match session.multi(ops).await {
        Ok(_) => None,
        Err(CoordError::MultiFailed { index, .. }) => Some(index),
        Err(CoordError::ConnectionLoss { detail }) => {
            // Read back: ours if the decision is a kill (a kill by anyone
            // is the same kill).
            match read_decision(session, key).await? {
                Some(Decision::Kill) => None,
                Some(_) => Some(1),
                None => return Err(CoordError::ConnectionLoss { detail }.into()),
            }
        }
        Err(e) => return Err(e.into()),
    };
    match failed_at {
        None => {
            tracing::info!(task = %key, transaction_id = %metadata.transaction_id, reason, "export killed");
            Ok(TaskStatus::Killed)
        }
        Some(0) => Err(KillError::NotFound(key.to_string())),
        Some(1) => match read_decision(session, key).await? {
            // Too late to kill: the commit file may be written. The commit
            // is finished here (the same bytes as the committer's).
            Some(Decision::Commit) => {
                match commit_decided(session, key, metadata, destination, None, now_ms).await {
                    Ok(CommitOutcome::Completed(_)) => Ok(TaskStatus::Completed),
                    Ok(CommitOutcome::Terminal(s)) => Ok(s),
                    Ok(CommitOutcome::Failed(_)) => Ok(TaskStatus::Failed),
                    Ok(CommitOutcome::NotNow) => Err(KillError::Busy(key.to_string())),
                    Err(CommitError::Coordination(c)) => Err(c.into()),
                    Err(CommitError::Destination(d)) => Err(KillError::Destination(d)),
                }
            }
            _ => Ok(read_status(session, key)
                .await?
                .unwrap_or(TaskStatus::Killed)),
        },
        Some(_) => Ok(read_status(session, key)
            .await?
            .unwrap_or(TaskStatus::Killed)),
    }
}

async fn set_completed(
    session: &Session,
    key: &TaskKey,
    metadata: &Metadata,
    info: &str,
) -> Result<(), CoordError> {
    let base = key.path();
    let ops = vec![
        Op::check(crate::model::fence_path(&base, &metadata.transaction_id), 0),
        // Decided (a task whose status is still version 0 can only have
        // been decided `commit`).
        Op::check(decision_path(&base), 0),
        Op::set(
            format!("{base}/status"),
            TaskStatus::Completed.as_str(),
            Some(0),
        ),
        Op::create(format!("{base}/commit_info"), info, CreateMode::Persistent),
    ];
    match session.multi(ops).await {
        Ok(_) => Ok(()),
        Err(e @ CoordError::ConnectionLoss { .. }) => {
            // Read back.
            if read_status(session, key).await? == Some(TaskStatus::Completed) {
                Ok(())
            } else {
                Err(e)
            }
        }
        Err(e) => Err(e),
    }
}

/// What a commit attempt did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitOutcome {
    /// The commit file is written and the task COMPLETED (by this call or
    /// an earlier one).
    Completed(String),
    /// Parts are left, or another replica holds the commit lock.
    NotNow,
    /// The task is terminal already.
    Terminal(TaskStatus),
    /// The commit failed for good: the task is FAILED.
    Failed(String),
}

/// Commits a task whose parts are all processed: writes the commit file
/// (or the Iceberg snapshot, timed `now_ms`, Unix milliseconds), then sets
/// COMPLETED, under the commit lock.
pub async fn commit(
    session: &Session,
    key: &TaskKey,
    metadata: &Metadata,
    destination: &Destination,
    replica: &str,
    now_ms: u64,
) -> Result<CommitOutcome, CommitError> {
    let Some(lock) = try_lock(session, &format!("{}/commit_lock", key.path()), replica).await?
    else {
        return Ok(CommitOutcome::NotNow);
    };
    let result = commit_locked(session, key, metadata, destination, now_ms).await;
    lock.release(session).await;
    result
}

#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error(transparent)]
    Coordination(#[from] CoordError),
    #[error("writing the commit file: {0}")]
    Destination(String),
}

async fn commit_locked(
    session: &Session,
    key: &TaskKey,
    metadata: &Metadata,
    destination: &Destination,
    now_ms: u64,
) -> Result<CommitOutcome, CommitError> {
    let base = key.path();
    // The task this node knows may have been replaced by a forced export.
    if session
        .exists(&crate::model::fence_path(&base, &metadata.transaction_id))
        .await?
        .is_none()
    {
        return Ok(CommitOutcome::Terminal(TaskStatus::Killed));
    }
    match read_status(session, key).await? {
        Some(TaskStatus::Pending) => {}
        Some(done) => return Ok(CommitOutcome::Terminal(done)),
        None => return Ok(CommitOutcome::Terminal(TaskStatus::Killed)),
    }
    let Some(stat) = session.exists(&format!("{base}/processing")).await? else {
        return Ok(CommitOutcome::Terminal(TaskStatus::Killed));
    };
    if stat.num_children > 0 {
        return Ok(CommitOutcome::NotNow);
    }
    let (names, _) = session.children(&format!("{base}/processed")).await?;
    if names.len() as u64 != metadata.parts_count {
        let msg = format!(
            "{} parts processed, the snapshot has {}",
            names.len(),
            metadata.parts_count
        );
        fail(session, key, &metadata.transaction_id, &msg).await?;
        return Ok(CommitOutcome::Failed(msg));
    }
    // Decided before the commit file exists: from here on no kill or
    // failure can end the task otherwise.
    let ops = vec![
        Op::check(crate::model::fence_path(&base, &metadata.transaction_id), 0),
        Op::check(format!("{base}/status"), 0),
        decide_op(&base, Decision::Commit),
    ];
    let decided = match session.multi(ops).await {
        Ok(_) => Some(Decision::Commit),
        Err(CoordError::MultiFailed { index: 0, .. }) => {
            return Ok(CommitOutcome::Terminal(TaskStatus::Killed))
        }
        Err(CoordError::MultiFailed { .. } | CoordError::ConnectionLoss { .. }) => {
            read_decision(session, key).await?
        }
        Err(e) => return Err(e.into()),
    };
    match decided {
        Some(Decision::Commit) => {
            commit_decided(session, key, metadata, destination, Some(names), now_ms).await
        }
        Some(_) => Ok(CommitOutcome::Terminal(
            read_status(session, key)
                .await?
                .unwrap_or(TaskStatus::Killed),
        )),
        None => Err(CoordError::ConnectionLoss {
            detail: "the commit decision's outcome is unknown".into(),
        }
        .into()),
    }
}

/// Finishes a commit decided `commit`: the commit file (computed from the
/// processed entries, the same bytes whoever writes it), then COMPLETED.
/// `processed` is the listing of `processed/` when the caller just read it
/// (a decided task's entries no longer change).
async fn commit_decided(
    session: &Session,
    key: &TaskKey,
    metadata: &Metadata,
    destination: &Destination,
    processed: Option<Vec<String>>,
    now_ms: u64,
) -> Result<CommitOutcome, CommitError> {
    let base = key.path();
    let names = match processed {
        Some(names) => names,
        None => session.children(&format!("{base}/processed")).await?.0,
    };
    // The processed entries, read a bounded number at a time.
    let mut files: Vec<DataFile> = Vec::with_capacity(names.len());
    for chunk in names.chunks(64) {
        let reads = chunk.iter().map(|n| {
            let path = format!("{base}/processed/{n}");
            async move {
                let (data, _) = session.get(&path).await?;
                serde_json::from_slice::<Processed>(&data).map_err(|e| damaged(&path, e))
            }
        });
        for p in futures::future::try_join_all(reads).await? {
            files.push(p.file);
        }
    }
    files.sort();
    let commit = CommitFile {
        format: COMMIT_FORMAT,
        transaction_id: metadata.transaction_id.clone(),
        table: metadata.table.clone(),
        partition_id: metadata.partition_id.clone(),
        create_time: metadata.create_time,
        rows: files.iter().map(|f| f.rows).sum(),
        files,
        columns: metadata.columns.clone(),
        sequence: metadata.sequence,
        snapshot_lsn: metadata.snapshot_lsn,
        content_id: metadata.content_id.clone(),
    };
    let written = match metadata.settings.format() {
        LakeFormat::Parquet => destination.commit(&commit).await,
        LakeFormat::Iceberg => destination.commit_iceberg(metadata, &commit, now_ms).await,
    };
    let key_written = match written {
        Ok(k) => k,
        Err(PartFailure::Retryable(e)) => return Err(CommitError::Destination(e)),
        Err(PartFailure::Fatal(e)) => {
            // A commit file of this transaction with other contents: not
            // ours, and nothing this task can write fixes it.
            let ops = vec![
                Op::check(crate::model::fence_path(&base, &metadata.transaction_id), 0),
                Op::set(
                    format!("{base}/status"),
                    TaskStatus::Failed.as_str(),
                    Some(0),
                ),
            ];
            match session.multi(ops).await {
                Ok(_) | Err(CoordError::MultiFailed { .. }) => {}
                Err(c) => return Err(c.into()),
            }
            tracing::warn!(task = %key, reason = %e, "export failed");
            return Ok(CommitOutcome::Failed(e));
        }
    };
    // Every listed file is final now: what writes of them cut short left
    // (a node killed while writing) goes before COMPLETED, so that a task
    // seen COMPLETED left none (a committer that dies here leaves the
    // removal to the next one).
    let paths: Vec<String> = commit.files.iter().map(|f| f.path.clone()).collect();
    match destination.location().remove_staging_of(&paths).await {
        Ok(0) => {}
        Ok(n) => {
            tracing::info!(task = %key, files = n, "removed staging files of cut-short writes")
        }
        Err(e) => {
            tracing::warn!(task = %key, error = %e, "could not remove staging files of cut-short writes")
        }
    }
    set_completed(session, key, metadata, &key_written).await?;
    tracing::info!(task = %key, transaction_id = %metadata.transaction_id, commit_file = %key_written, "export committed");
    Ok(CommitOutcome::Completed(key_written))
}

/// Sets a PENDING task FAILED (version-checked, fenced by its transaction).
pub async fn fail(
    session: &Session,
    key: &TaskKey,
    transaction_id: &str,
    reason: &str,
) -> Result<bool, CoordError> {
    let ops = vec![
        Op::check(crate::model::fence_path(&key.path(), transaction_id), 0),
        decide_op(&key.path(), Decision::Fail),
        Op::set(
            format!("{}/status", key.path()),
            TaskStatus::Failed.as_str(),
            Some(0),
        ),
    ];
    match session.multi(ops).await {
        Ok(_) => {
            tracing::warn!(task = %key, reason, "export failed");
            Ok(true)
        }
        Err(CoordError::MultiFailed { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_coord::embedded::EmbeddedStore;
    use ferry_coord::{CoordMetrics, EmbeddedSessions, SessionFactory};
    use std::sync::Arc;

    async fn session() -> (tempfile::TempDir, Session) {
        let (dir, disk) = ferry_testkit::disk::temp_disk();
        let store = EmbeddedStore::open(disk, "coord", Default::default())
            .await
            .expect("store");
        let sessions = EmbeddedSessions {
            store,
            timeout: std::time::Duration::from_secs(5),
            metrics: Arc::new(CoordMetrics::default()),
        };
        (dir, sessions.open().await.expect("session"))
    }

    /// A task of transaction `tx` as a request makes one.
    async fn make(session: &Session, key: &TaskKey, tx: &str) {
        let base = key.path();
        ferry_coord::create_all(session.as_ref(), &base)
            .await
            .expect("parents");
        session.delete(&base, None).await.expect("bare node");
        let persistent = CreateMode::Persistent;
        let mut ops = vec![Op::create(base.clone(), tx.as_bytes(), persistent)];
        for sub in ["metadata.json", "parts", "processing", "status"] {
            ops.push(Op::create(format!("{base}/{sub}"), Vec::new(), persistent));
        }
        ops.push(Op::create(
            crate::model::fence_path(&base, tx),
            Vec::new(),
            persistent,
        ));
        ops.push(Op::create(
            format!("{base}/parts/000000"),
            Vec::new(),
            persistent,
        ));
        ops.push(Op::create(
            format!("{base}/processing/p_1_1_0"),
            Vec::new(),
            persistent,
        ));
        session.multi(ops).await.expect("task");
    }

    async fn nodes(session: &Session, key: &TaskKey) -> Vec<String> {
        let base = key.path();
        let mut out = Vec::new();
        if let Ok((subs, _)) = session.children(&base).await {
            for s in subs {
                out.push(s.clone());
                if let Ok((c, _)) = session.children(&format!("{base}/{s}")).await {
                    out.extend(c.into_iter().map(|c| format!("{s}/{c}")));
                }
            }
        }
        out.sort();
        out
    }

    fn key() -> TaskKey {
        TaskKey {
            table: "t".into(),
            key: "p_abc".into(),
        }
    }

    #[tokio::test]
    async fn a_remover_of_an_older_transaction_leaves_the_task_made_since() {
        let (_dir, s) = session().await;
        make(&s, &key(), "tx1").await;
        remove(&s, &key(), "tx1").await.expect("remove");
        assert!(nodes(&s, &key()).await.is_empty());
        assert!(s.exists(&key().path()).await.expect("exists").is_none());
        make(&s, &key(), "tx2").await;
        let made = nodes(&s, &key()).await;
        assert_eq!(made.len(), 7, "{made:?}");
        // A second remover of tx1, late: nothing of tx2's goes.
        remove(&s, &key(), "tx1").await.expect("remove");
        assert_eq!(nodes(&s, &key()).await, made);
    }

    #[tokio::test]
    async fn a_remover_whose_mark_another_took_over_deletes_nothing_more() {
        let (_dir, s) = session().await;
        make(&s, &key(), "tx1").await;
        let base = key().path();
        let (_, stat) = s.get(&base).await.expect("task node");
        // Another remover marked the task after this one did.
        s.set(&base, b"tx1", Some(stat.version))
            .await
            .expect("mark");
        let before = nodes(&s, &key()).await;
        let stale = stat.version;
        let done = delete_all_marked(&s, &base, stale, vec![format!("{base}/parts/000000")])
            .await
            .expect("no error");
        assert!(!done);
        assert_eq!(nodes(&s, &key()).await, before);
        // Removing it again with the transaction finishes the work.
        remove(&s, &key(), "tx1").await.expect("remove");
        assert!(s.exists(&base).await.expect("exists").is_none());
    }
}
