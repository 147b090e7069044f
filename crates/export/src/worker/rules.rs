//! The exporter's rules that need no state of their own: when a failure
//! ends a task, what the cleanup holder does with a task, and when a task
//! whose creation never finished may go. Each takes what coordination holds
//! and the time, and answers; the run loop sends the requests.

use crate::model::{ExportSettings, TaskStatus};

/// Whether a part's failure fails the whole task: a non-retryable failure
/// at once, a retryable one once its retries reach `max_retries` (0: no
/// limit).
pub(super) fn fails_task(fatal: bool, retry_count: u32, max_retries: u32) -> bool {
    fatal || (max_retries > 0 && retry_count >= max_retries)
}

/// What the holder of a table's cleanup lock does with one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Duty {
    /// A terminal task past its TTL: removed.
    Remove,
    /// A PENDING task past its timeout: killed.
    Kill,
    /// A PENDING task within its time: committed if no part is left
    /// (its last exporter died between the last part and the commit).
    CommitIfNothingLeft,
    /// A terminal task within its TTL: kept.
    Keep,
}

/// The cleanup duty for a task of `status` created at `create_time`, at
/// `now_s` (seconds since the Unix epoch).
pub(super) fn cleanup_duty(
    status: TaskStatus,
    create_time: u64,
    settings: &ExportSettings,
    now_s: u64,
) -> Duty {
    if status.is_terminal() {
        if create_time.saturating_add(settings.ttl_seconds) < now_s {
            return Duty::Remove;
        }
        return Duty::Keep;
    }
    if settings.task_timeout_seconds > 0
        && create_time.saturating_add(settings.task_timeout_seconds) < now_s
    {
        return Duty::Kill;
    }
    Duty::CommitIfNothingLeft
}

/// Whether a task without `status` (its creator died between the
/// metadata and the status) may be removed: once its creation is older
/// than `grace_s`, or when even its metadata is missing.
pub(super) fn creation_abandoned(
    has_status: bool,
    create_time: Option<u64>,
    grace_s: u64,
    now_s: u64,
) -> bool {
    !has_status && create_time.is_none_or(|c| c.saturating_add(grace_s) < now_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fatal_failure_fails_at_once_a_retryable_one_at_its_limit() {
        assert!(fails_task(true, 0, 0));
        assert!(!fails_task(false, 1_000, 0), "0 retries: no limit");
        assert!(!fails_task(false, 2, 3));
        assert!(fails_task(false, 3, 3));
    }

    #[test]
    fn cleanup_removes_after_the_ttl_kills_after_the_timeout_and_never_before() {
        let s = ExportSettings {
            ttl_seconds: 100,
            task_timeout_seconds: 50,
            ..ExportSettings::default()
        };
        for status in [
            TaskStatus::Completed,
            TaskStatus::Failed,
            TaskStatus::Killed,
        ] {
            assert_eq!(cleanup_duty(status, 1_000, &s, 1_100), Duty::Keep);
            assert_eq!(cleanup_duty(status, 1_000, &s, 1_101), Duty::Remove);
        }
        assert_eq!(
            cleanup_duty(TaskStatus::Pending, 1_000, &s, 1_050),
            Duty::CommitIfNothingLeft
        );
        assert_eq!(
            cleanup_duty(TaskStatus::Pending, 1_000, &s, 1_051),
            Duty::Kill
        );
        let no_timeout = ExportSettings {
            task_timeout_seconds: 0,
            ..s
        };
        assert_eq!(
            cleanup_duty(TaskStatus::Pending, 0, &no_timeout, u64::MAX),
            Duty::CommitIfNothingLeft
        );
        // A create_time from the far future never overflows into a removal.
        assert_eq!(
            cleanup_duty(TaskStatus::Completed, u64::MAX, &s, 5),
            Duty::Keep
        );
    }

    #[test]
    fn an_unfinished_creation_goes_only_after_its_grace() {
        assert!(!creation_abandoned(true, None, 600, 10_000));
        assert!(creation_abandoned(false, None, 600, 0));
        assert!(!creation_abandoned(false, Some(1_000), 600, 1_600));
        assert!(creation_abandoned(false, Some(1_000), 600, 1_601));
    }
}
