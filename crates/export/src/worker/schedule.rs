//! Scheduling: the tick (due refreshes, commits, then claims), and the
//! claims that fill this node's upload slots, going down its order of each
//! task's parts.

use ferry_coord::{CoordError, CreateMode, Op};
use tokio::time::Instant;

use super::order::Rank;
use super::queue::{AfterClaim, Claim};
use super::Run;
use crate::model::{TaskKey, TaskStatus};

/// Candidates a schedule takes from the order beyond the slots it fills.
const SCAN_BATCH: usize = 16;

impl Run<'_> {
    /// Scheduling and the refreshes that are due.
    /// Tasks in create_time order (the order they are served in).
    fn ordered_keys(&self) -> Vec<TaskKey> {
        let mut v: Vec<(&TaskKey, u64)> = self
            .tasks
            .iter()
            .map(|(k, t)| (k, t.metadata.create_time))
            .collect();
        v.sort_by_key(|(k, c)| (*c, (*k).clone()));
        v.into_iter().map(|(k, _)| k.clone()).collect()
    }

    pub(super) async fn tick(&mut self) -> Result<(), CoordError> {
        let keys = self.ordered_keys();
        for key in &keys {
            let since = self.trips();
            let r = self.refresh_progress(key).await;
            self.charge(key, since);
            if let Err(e) = r {
                if let Some(t) = self.tasks.get_mut(key) {
                    t.progress_due = true;
                }
                return Err(e);
            }
        }
        for key in &keys {
            let since = self.trips();
            let r = self.commit_if_due(key).await;
            self.charge(key, since);
            r?;
        }
        self.schedule(Instant::now()).await
    }

    /// Claims and starts parts within the slots: at every tick, and as soon
    /// as an upload ends (so a slot never waits for the tick). Which parts
    /// to try, and what a claim's answer means, is the task's
    /// [`PartQueue`](super::queue::PartQueue)'s to say; this sends the
    /// claims and starts the uploads.
    pub(super) async fn schedule(&mut self, now: Instant) -> Result<(), CoordError> {
        let keys = self.ordered_keys();
        let max = self.ex.config.max_uploads;
        let mut running: usize = self.tasks.values().map(|t| t.queue.running_len()).sum();
        assert!(
            running <= max,
            "{running} uploads running, above the {max} slots"
        );
        for key in keys {
            if running >= max {
                break;
            }
            let since = self.trips();
            let Some(t) = self.tasks.get(&key) else {
                continue;
            };
            if t.status != TaskStatus::Pending || t.destination.is_none() {
                continue;
            }
            let slots =
                (t.metadata.settings.parallelism as usize).saturating_sub(t.queue.running_len());
            // Claims go down this node's order until the slots are full: a
            // part another node holds or finished is passed over at once.
            // Candidates are taken a few at a time (a task may hold 100,000
            // parts; a scan of them all per upload would cost more than the
            // upload).
            let mut want = slots.min(max - running);
            let mut after: Option<(Rank, String)> = None;
            let mut candidates: Vec<(Rank, String)> = Vec::new();
            let mut pruned_now = false;
            loop {
                if want == 0 {
                    break;
                }
                if candidates.is_empty() {
                    let Some(t) = self.tasks.get_mut(&key) else {
                        break;
                    };
                    candidates = t.queue.candidates(now, after.as_ref(), want + SCAN_BATCH);
                    candidates.reverse();
                }
                let Some((r, part)) = candidates.pop() else {
                    break;
                };
                // Past its own share, a node takes others' parts; most are
                // done or under way by then, so it first drops what
                // `processing/` no longer lists (once per tick at most)
                // instead of finding that out one claim at a time.
                if r.0 == 1 && !pruned_now {
                    pruned_now = true;
                    let due = self
                        .tasks
                        .get(&key)
                        .is_some_and(|t| t.queue.prune_due(now, self.ex.config.tick));
                    if due {
                        self.prune(&key, now).await?;
                        candidates.clear();
                        after = None;
                        continue;
                    }
                }
                after = Some((r, part.clone()));
                let claim = self.claim(&key, &part).await?;
                if claim == Claim::Busy {
                    self.counters.claims_lost += 1;
                }
                let busy_for = self.ex.config.tick * 4;
                let next = match self.tasks.get_mut(&key) {
                    Some(t) => t.queue.on_claim(&part, claim, now, busy_for),
                    None => AfterClaim::StopTask,
                };
                match next {
                    AfterClaim::Upload => {
                        self.start_upload(&key, &part).await;
                        running += 1;
                        want -= 1;
                    }
                    AfterClaim::Next => {}
                    AfterClaim::StopTask => break,
                    AfterClaim::ForgetTask => {
                        self.forget(&key).await;
                        break;
                    }
                }
            }
            self.charge(&key, since);
        }
        Ok(())
    }

    /// Drops from the task's todo the parts `processing/` no longer lists
    /// (exported by other nodes).
    async fn prune(&mut self, key: &TaskKey, now: Instant) -> Result<(), CoordError> {
        let left = match self
            .session
            .children(&format!("{}/processing", key.path()))
            .await
        {
            Ok((left, _)) => left,
            Err(CoordError::NoNode { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let left: std::collections::HashSet<String> = left.into_iter().collect();
        if let Some(t) = self.tasks.get_mut(key) {
            t.queue.prune(&left, now);
        }
        Ok(())
    }

    /// Claims a part: its lock, created together with a set of its
    /// processing entry (which fails if the part was exported already).
    pub(super) async fn claim(&self, key: &TaskKey, part: &str) -> Result<Claim, CoordError> {
        let base = key.path();
        let lock = format!("{base}/locks/{part}");
        let Some(fence) = self.fence(key) else {
            return Ok(Claim::Gone);
        };
        let ops = vec![
            Op::create(lock.clone(), self.name().as_bytes(), CreateMode::Ephemeral),
            Op::set(format!("{base}/processing/{part}"), Vec::new(), None),
            Op::check(format!("{base}/status"), 0),
            Op::check(fence, 0),
        ];
        match self.session.multi(ops).await {
            Ok(_) => Ok(Claim::Ours),
            Err(CoordError::MultiFailed { index, source }) => match (index, *source) {
                (0, CoordError::NodeExists { .. }) => {
                    // Ours already (a release or a move whose answer was
                    // lost)? Then this session holds it and goes on.
                    match self.session.exists(&lock).await? {
                        Some(stat) if stat.ephemeral_owner == self.session.session_id() => {
                            Ok(Claim::Ours)
                        }
                        _ => Ok(Claim::Busy),
                    }
                }
                (0, CoordError::NoNode { .. }) => Ok(Claim::Gone),
                (1, CoordError::NoNode { .. }) => Ok(Claim::Done),
                // No longer PENDING: the status watch settles it.
                (2, _) => Ok(Claim::NotPending),
                (3, _) => Ok(Claim::Gone),
                (_, e) => Err(e),
            },
            Err(CoordError::ConnectionLoss { .. }) => {
                // Outcome unknown: the lock's owner says.
                match self.session.exists(&lock).await? {
                    Some(stat) if stat.ephemeral_owner == self.session.session_id() => {
                        Ok(Claim::Ours)
                    }
                    Some(_) => Ok(Claim::Busy),
                    None => Ok(Claim::Busy),
                }
            }
            Err(e) => Err(e),
        }
    }
}
