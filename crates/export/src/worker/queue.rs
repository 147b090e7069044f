//! A task's parts as this node schedules them: the core of the exporter's
//! scheduling, apart from its I/O.
//!
//! A [`PartQueue`] holds what a node knows of a task's parts (those it holds
//! and has not seen exported, in its order; those it uploads now; those
//! another node held at the last try; its own back-off per part) and takes
//! events with the time as an input: a claim's answer, an upload's start and
//! end, a part exported, a retryable failure. It answers which parts to try
//! next and whether a commit is due. It reads no clock and sends no request:
//! the run loop asks coordination, starts uploads and passes the answers in,
//! so every scheduling rule sits here and is tested without a session.
//!
//! Invariants (asserted where they are decided):
//! * a part runs at most once here at a time, and only while it is to do;
//! * a part in back-off or held elsewhere is not offered until its time;
//! * once nothing is left to do, a commit is due (and stays due until the
//!   run loop tries it).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use tokio::time::Instant;

use super::order::{Rank, Todo};
use super::ViewBackoff;
use crate::model::ExportSettings;

/// A claim's answer from coordination, as the queue needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claim {
    /// This node holds the part's lock now.
    Ours,
    /// Another node holds it.
    Busy,
    /// Exported already (its processing entry is gone).
    Done,
    /// The task left PENDING.
    NotPending,
    /// The task was removed or replaced.
    Gone,
}

/// What the run loop does after a claim's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterClaim {
    /// Start the part's upload.
    Upload,
    /// Go on with the next candidate.
    Next,
    /// Stop scheduling this task (no longer PENDING).
    StopTask,
    /// Forget the task (removed or replaced).
    ForgetTask,
}

#[derive(Debug, Clone, Copy)]
struct Backoff {
    attempts: u32,
    until: Instant,
}

/// See the module doc.
#[derive(Default)]
pub(super) struct PartQueue {
    todo: Todo,
    running: BTreeSet<String>,
    backoff: BTreeMap<String, Backoff>,
    /// Parts another node held a lock on at the last try, until when they
    /// are passed over.
    busy: BTreeMap<String, Instant>,
    /// When `todo` was last pruned of parts others finished.
    pruned: Option<Instant>,
    commit_due: bool,
}

impl PartQueue {
    /// Adds a part this node holds and has not seen exported.
    pub(super) fn hold(&mut self, part: String) {
        self.todo.insert(part);
    }

    /// Orders the parts for `me` among the task's `workers`.
    pub(super) fn rank(&mut self, me: &str, workers: &[String]) {
        self.todo.rank(me, workers);
    }

    pub(super) fn todo_len(&self) -> usize {
        self.todo.len()
    }

    pub(super) fn has_todo(&self) -> bool {
        !self.todo.is_empty()
    }

    pub(super) fn running(&self) -> impl Iterator<Item = &String> {
        self.running.iter()
    }

    pub(super) fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Whether a commit should be tried: due, and no upload of this node's
    /// is still running.
    pub(super) fn commit_due(&self) -> bool {
        self.commit_due && self.running.is_empty()
    }

    /// Marks a commit due (nothing left, as coordination said), or not due
    /// (the run loop is trying it now).
    pub(super) fn set_commit_due(&mut self, due: bool) {
        self.commit_due = due;
    }

    /// The task left PENDING: nothing more is tried here.
    pub(super) fn settle(&mut self) -> BTreeSet<String> {
        self.todo.clear();
        self.backoff.clear();
        std::mem::take(&mut self.running)
    }

    /// The parts after `after` in this node's order that may be claimed at
    /// `now` (not running here, not held elsewhere, not backing off), at
    /// most `take`.
    pub(super) fn candidates(
        &mut self,
        now: Instant,
        after: Option<&(Rank, String)>,
        take: usize,
    ) -> Vec<(Rank, String)> {
        self.busy.retain(|_, until| *until > now);
        self.todo
            .after(after)
            .filter(|(_, p)| {
                !self.running.contains(p)
                    && !self.busy.contains_key(p)
                    && self.backoff.get(p).is_none_or(|b| b.until <= now)
            })
            .take(take)
            .cloned()
            .collect()
    }

    /// Whether, before taking others' parts, `todo` should be pruned of the
    /// parts `processing/` no longer lists (at most once per `every`).
    pub(super) fn prune_due(&self, now: Instant, every: Duration) -> bool {
        self.pruned.is_none_or(|at| at + every <= now)
    }

    /// Keeps only the parts still left to export (`left`, as
    /// `processing/` lists them at `now`).
    pub(super) fn prune(&mut self, left: &HashSet<String>, now: Instant) {
        self.todo.retain(|p| left.contains(p));
        self.pruned = Some(now);
        if self.todo.is_empty() {
            self.commit_due = true;
        }
    }

    /// A claim of `part` was answered at `now`: what the run loop does
    /// next. A part held elsewhere is passed over for `busy_for`.
    pub(super) fn on_claim(
        &mut self,
        part: &str,
        claim: Claim,
        now: Instant,
        busy_for: Duration,
    ) -> AfterClaim {
        match claim {
            Claim::Ours => AfterClaim::Upload,
            Claim::Done => {
                self.exported(part);
                AfterClaim::Next
            }
            Claim::Busy => {
                self.busy.insert(part.to_string(), now + busy_for);
                AfterClaim::Next
            }
            Claim::NotPending => {
                self.todo.clear();
                AfterClaim::StopTask
            }
            Claim::Gone => AfterClaim::ForgetTask,
        }
    }

    /// The upload of a claimed part started.
    pub(super) fn started(&mut self, part: &str) {
        let fresh = self.running.insert(part.to_string());
        assert!(fresh, "part {part} started twice on one node");
    }

    /// The upload of `part` ended: true if it was running here (an upload
    /// of a task settled meanwhile was not).
    pub(super) fn ended(&mut self, part: &str) -> bool {
        self.running.remove(part)
    }

    /// `part` is exported (by this node, or by another as a claim found):
    /// nothing more to do for it here; with nothing left, a commit is due.
    pub(super) fn exported(&mut self, part: &str) {
        assert!(
            !self.running.contains(part),
            "part {part} exported while its upload still runs here"
        );
        self.todo.remove(part);
        self.backoff.remove(part);
        if self.todo.is_empty() {
            self.commit_due = true;
        }
    }

    /// A retryable failure of `part` at `now`: it backs off here only
    /// (never holding a lock, so another node may take it meanwhile), for
    /// the task's back-off of one attempt more.
    pub(super) fn backed_off(&mut self, part: &str, settings: &ExportSettings, now: Instant) {
        let attempts = self.backoff.get(part).map_or(0, |b| b.attempts) + 1;
        let until = now + settings.backoff(attempts);
        self.backoff
            .insert(part.to_string(), Backoff { attempts, until });
    }

    /// This node's back-off per part, as the status listing shows it at
    /// `now`.
    pub(super) fn backoff_view(&self, now: Instant) -> Vec<ViewBackoff> {
        self.backoff
            .iter()
            .map(|(p, b)| ViewBackoff {
                part: p.clone(),
                attempts: b.attempts,
                retry_in_ms: b.until.saturating_duration_since(now).as_millis() as u64,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(parts: &[&str]) -> PartQueue {
        let mut q = PartQueue::default();
        for p in parts {
            q.hold(p.to_string());
        }
        q.rank("r0", &[]);
        q
    }

    fn names(c: &[(Rank, String)]) -> Vec<&str> {
        let mut v: Vec<&str> = c.iter().map(|(_, p)| p.as_str()).collect();
        v.sort();
        v
    }

    #[test]
    fn a_part_held_elsewhere_is_passed_over_until_its_time() {
        let mut q = queue(&["a", "b"]);
        let now = Instant::now();
        let tick = Duration::from_millis(500);
        assert_eq!(
            q.on_claim("a", Claim::Busy, now, tick * 4),
            AfterClaim::Next
        );
        assert_eq!(names(&q.candidates(now, None, 10)), ["b"]);
        assert_eq!(names(&q.candidates(now + tick * 4, None, 10)), ["a", "b"]);
    }

    #[test]
    fn a_failed_part_backs_off_longer_each_time_and_only_here() {
        let mut q = queue(&["a"]);
        let settings = ExportSettings::default();
        let now = Instant::now();
        q.started("a");
        assert!(q.candidates(now, None, 10).is_empty(), "running");
        assert!(q.ended("a"));
        q.backed_off("a", &settings, now);
        let first = settings.backoff(1);
        assert!(q.candidates(now, None, 10).is_empty());
        assert_eq!(q.candidates(now + first, None, 10).len(), 1);
        q.backed_off("a", &settings, now);
        let view = q.backoff_view(now);
        assert_eq!(view[0].attempts, 2);
        assert_eq!(view[0].retry_in_ms, settings.backoff(2).as_millis() as u64);
        // Exported by another node meanwhile: the back-off goes with it.
        q.exported("a");
        assert!(q.backoff_view(now).is_empty());
    }

    #[test]
    fn nothing_left_makes_a_commit_due_once_uploads_end() {
        let mut q = queue(&["a", "b"]);
        let now = Instant::now();
        q.started("a");
        assert_eq!(
            q.on_claim("b", Claim::Done, now, Duration::ZERO),
            AfterClaim::Next
        );
        assert!(!q.commit_due(), "a still to do");
        assert!(q.ended("a"));
        q.exported("a");
        assert!(q.commit_due());
        q.set_commit_due(false);
        assert!(!q.commit_due());
        let mut p = queue(&["x", "y"]);
        assert!(p.prune_due(now, Duration::from_secs(1)));
        p.prune(&HashSet::from(["y".to_string()]), now);
        assert!(!p.prune_due(now, Duration::from_secs(1)));
        assert_eq!(p.todo_len(), 1);
        p.prune(&HashSet::new(), now);
        assert!(p.commit_due());
    }

    #[test]
    fn a_task_no_longer_pending_offers_nothing() {
        let mut q = queue(&["a", "b"]);
        let now = Instant::now();
        assert_eq!(
            q.on_claim("a", Claim::NotPending, now, Duration::ZERO),
            AfterClaim::StopTask
        );
        assert!(q.candidates(now, None, 10).is_empty());
        assert_eq!(
            q.on_claim("b", Claim::Gone, now, Duration::ZERO),
            AfterClaim::ForgetTask
        );
        let mut r = queue(&["c"]);
        r.started("c");
        assert_eq!(r.settle().len(), 1);
        assert!(!r.ended("c"), "a settled task's upload no longer counts");
    }

    #[test]
    #[should_panic(expected = "started twice")]
    fn a_part_never_runs_twice_on_one_node() {
        let mut q = queue(&["a"]);
        q.started("a");
        q.started("a");
    }
}
