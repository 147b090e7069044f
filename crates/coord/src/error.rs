//! Typed coordination errors, identical for every back-end.

/// Why a coordination request failed.
///
/// Every back-end maps its failures onto these variants, so code above the
/// coordination layer (and the conformance suite) can tell them apart without
/// knowing which back-end it talks to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoordError {
    /// The node (or, for a create, its parent) does not exist.
    #[error("no node {path}")]
    NoNode { path: String },
    /// A create found a node already at that path.
    #[error("node {path} already exists")]
    NodeExists { path: String },
    /// The expected version did not match the node's version.
    #[error("version mismatch on {path}")]
    BadVersion { path: String },
    /// A delete found children under the node.
    #[error("node {path} has children")]
    NotEmpty { path: String },
    /// A create tried to put a child under an ephemeral node.
    #[error("ephemeral node {path} cannot have children")]
    NoChildrenForEphemerals { path: String },
    /// The path is not a valid absolute coordination path.
    #[error("invalid path {path:?}: {reason}")]
    InvalidPath { path: String, reason: &'static str },
    /// A negative version was given. ZooKeeper reads version -1 as "any
    /// version", which would silently turn a conditional write into an
    /// unconditional one (a garbage stat's -1 passed on, say); the API says
    /// "any" with `None` only, so negative versions are refused everywhere.
    #[error("invalid version {version} for {path}: versions are never negative (use no version for \"any\")")]
    InvalidVersion { path: String, version: i32 },
    /// The node data (or the whole request) is larger than the limit.
    #[error("{what} of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        what: &'static str,
        len: usize,
        max: usize,
    },
    /// The session expired: its ephemerals are gone and it can do nothing more.
    #[error("session expired")]
    SessionExpired,
    /// The session was closed by its owner.
    #[error("session closed")]
    SessionClosed,
    /// The request may or may not have been applied: the caller must find out by
    /// reading back before it retries anything that is not idempotent.
    #[error("connection lost, outcome unknown: {detail}")]
    ConnectionLoss { detail: String },
    /// The store is short of disk space and refused this write before
    /// applying anything of it: nothing changed (a definite answer, unlike
    /// [`CoordError::ConnectionLoss`]), and the same write may succeed once
    /// space returns. Reads, watches, keep-alives and closes are still
    /// served. Its message starts with `disk_full:`. Only the embedded store
    /// refuses this way (ZooKeeper stops on a full disk: its clients see
    /// connection loss).
    #[error(transparent)]
    DiskFull(#[from] ferry_env::space::DiskFull),
    /// One operation of a multi failed, so none of them was applied.
    #[error("operation {index} of the multi failed: {source}")]
    MultiFailed {
        index: usize,
        #[source]
        source: Box<CoordError>,
    },
    /// A failure the other variants do not describe (back-end specific).
    #[error("coordination back-end error: {0}")]
    Backend(String),
}

impl CoordError {
    /// The same error about `path` instead (for the errors that name a node).
    pub(crate) fn with_path(self, path: &str) -> CoordError {
        let path = path.to_string();
        match self {
            CoordError::NoNode { .. } => CoordError::NoNode { path },
            CoordError::NodeExists { .. } => CoordError::NodeExists { path },
            CoordError::BadVersion { .. } => CoordError::BadVersion { path },
            CoordError::NotEmpty { .. } => CoordError::NotEmpty { path },
            CoordError::NoChildrenForEphemerals { .. } => {
                CoordError::NoChildrenForEphemerals { path }
            }
            other => other,
        }
    }

    /// The error of the failed operation, looking through [`CoordError::MultiFailed`].
    pub fn root(&self) -> &CoordError {
        match self {
            CoordError::MultiFailed { source, .. } => source.root(),
            other => other,
        }
    }

    /// True when retrying later may succeed and the outcome of this attempt is
    /// unknown or nothing happened (connection loss).
    pub fn is_connection_loss(&self) -> bool {
        matches!(self.root(), CoordError::ConnectionLoss { .. })
    }

    /// True when the store refused a write for lack of disk space: nothing
    /// was applied, and the write may succeed later.
    pub fn is_disk_full(&self) -> bool {
        matches!(self.root(), CoordError::DiskFull(_))
    }

    /// True when the session is over (expired or closed): a new one is needed.
    pub fn is_session_end(&self) -> bool {
        matches!(
            self.root(),
            CoordError::SessionExpired | CoordError::SessionClosed
        )
    }
}

/// Result of a coordination request.
pub type Result<T, E = CoordError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disk_full_refusal_is_definite_and_says_disk_full() {
        let full = ferry_env::space::SpaceBreaker::new("coordination store", 100 << 20);
        full.observe(Some(1 << 20));
        let e = CoordError::from(full.check().expect_err("open"));
        assert!(e.is_disk_full());
        assert!(!e.is_connection_loss(), "not applied, not unknown");
        assert!(!e.is_session_end());
        assert!(
            e.to_string()
                .starts_with("disk_full: coordination store has 1048576 bytes free"),
            "{e}"
        );
    }
}
