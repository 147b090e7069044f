//! Request and response types of the coordination API.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use serde::{Deserialize, Serialize};

use crate::error::{CoordError, Result};
use crate::path;

/// How long a node lives and whether a sequence counter is appended to its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CreateMode {
    /// Lives until deleted.
    Persistent,
    /// Deleted when the creating session ends (closed or expired).
    Ephemeral,
    /// Persistent, with a 10-digit counter of the parent appended to the name.
    PersistentSequential,
    /// Ephemeral, with a 10-digit counter of the parent appended to the name.
    EphemeralSequential,
}

impl CreateMode {
    /// True for the two ephemeral modes.
    pub fn is_ephemeral(self) -> bool {
        matches!(
            self,
            CreateMode::Ephemeral | CreateMode::EphemeralSequential
        )
    }

    /// True for the two sequential modes.
    pub fn is_sequential(self) -> bool {
        matches!(
            self,
            CreateMode::PersistentSequential | CreateMode::EphemeralSequential
        )
    }
}

/// Metadata of a node, with ZooKeeper's meaning for every field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Stat {
    /// Transaction id that created the node.
    pub czxid: i64,
    /// Transaction id that last changed the node's data.
    pub mzxid: i64,
    /// Transaction id that last added or removed a child.
    pub pzxid: i64,
    /// Number of data changes; the version a conditional set or delete names.
    pub version: i32,
    /// Number of child additions and removals; also the next sequence number.
    pub cversion: i32,
    /// Session that owns an ephemeral node, 0 for persistent nodes.
    pub ephemeral_owner: i64,
    /// Length of the data in bytes.
    pub data_length: i32,
    /// Number of children.
    pub num_children: i32,
}

/// One operation of a multi-op transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Succeeds only if the node exists with exactly this version.
    Check { path: String, version: i32 },
    /// Creates a node.
    Create {
        path: String,
        data: Vec<u8>,
        mode: CreateMode,
    },
    /// Replaces a node's data, if its version matches (`None`: any version).
    Set {
        path: String,
        data: Vec<u8>,
        version: Option<i32>,
    },
    /// Deletes a childless node, if its version matches (`None`: any version).
    Delete { path: String, version: Option<i32> },
}

impl Op {
    /// Shorthand for [`Op::Check`].
    pub fn check(path: impl Into<String>, version: i32) -> Op {
        Op::Check {
            path: path.into(),
            version,
        }
    }

    /// Shorthand for [`Op::Create`].
    pub fn create(path: impl Into<String>, data: impl Into<Vec<u8>>, mode: CreateMode) -> Op {
        Op::Create {
            path: path.into(),
            data: data.into(),
            mode,
        }
    }

    /// Shorthand for [`Op::Set`].
    pub fn set(path: impl Into<String>, data: impl Into<Vec<u8>>, version: Option<i32>) -> Op {
        Op::Set {
            path: path.into(),
            data: data.into(),
            version,
        }
    }

    /// Shorthand for [`Op::Delete`].
    pub fn delete(path: impl Into<String>, version: Option<i32>) -> Op {
        Op::Delete {
            path: path.into(),
            version,
        }
    }

    /// The node the operation names.
    pub fn path(&self) -> &str {
        match self {
            Op::Check { path, .. }
            | Op::Create { path, .. }
            | Op::Set { path, .. }
            | Op::Delete { path, .. } => path,
        }
    }

    /// Validates the path, data and version the same way for every back-end.
    pub fn validate(&self) -> Result<()> {
        match self {
            Op::Check { path, version } => {
                path::validate_path(path)?;
                path::validate_version(path, Some(*version))
            }
            Op::Create { path, data, mode } => {
                path::validate_create_path(path, mode.is_sequential())?;
                path::validate_data(data)
            }
            Op::Set {
                path,
                data,
                version,
            } => {
                path::validate_path(path)?;
                path::validate_data(data)?;
                path::validate_version(path, *version)
            }
            Op::Delete { path, version } => {
                path::validate_delete_path(path)?;
                path::validate_version(path, *version)
            }
        }
    }

    /// Bytes this operation takes in a ZooKeeper multi request (jute encoding:
    /// a 9-byte multi header, then the request record), with every path
    /// prefixed by `chroot_bytes` of chroot.
    fn multi_bytes(&self, chroot_bytes: usize) -> usize {
        const MULTI_HEADER: usize = 4 + 1 + 4;
        const STRING_PREFIX: usize = 4;
        // One ACL: perms, then scheme "world" and id "anyone" as strings.
        const OPEN_ACL: usize = 4 + 4 + (4 + 5) + (4 + 6);
        let path = |p: &str| STRING_PREFIX + chroot_bytes + p.len();
        MULTI_HEADER
            + match self {
                // path, data, ACL vector, flags
                Op::Create { path: p, data, .. } => path(p) + 4 + data.len() + OPEN_ACL + 4,
                // path, data, version
                Op::Set { path: p, data, .. } => path(p) + 4 + data.len() + 4,
                // path, version
                Op::Check { path: p, .. } | Op::Delete { path: p, .. } => path(p) + 4,
            }
    }
}

/// The size of a multi request as ZooKeeper receives it (the request header,
/// every operation and the closing multi header; without the 4-byte length
/// prefix, as ZooKeeper counts against `jute.maxbuffer`), when the session's
/// chroot is `chroot_bytes` long. Callers that must split a large transaction
/// (an export snapshot) size their chunks with it.
pub fn multi_request_bytes(ops: &[Op], chroot_bytes: usize) -> usize {
    const REQUEST_HEADER: usize = 4 + 4;
    const END_HEADER: usize = 4 + 1 + 4;
    REQUEST_HEADER
        + ops
            .iter()
            .map(|op| op.multi_bytes(chroot_bytes))
            .sum::<usize>()
        + END_HEADER
}

/// Validates every operation of a multi and its total size as ZooKeeper would
/// receive it under a chroot of `chroot_bytes` (0 for the embedded store); on
/// failure the error names the index of the offending operation. Runs before
/// any I/O, so a too-large multi is a typed error, never a dropped connection.
pub fn validate_multi(ops: &[Op], chroot_bytes: usize) -> Result<()> {
    for (index, op) in ops.iter().enumerate() {
        op.validate().map_err(|e| CoordError::MultiFailed {
            index,
            source: Box::new(e),
        })?;
    }
    let total = multi_request_bytes(ops, chroot_bytes);
    if total > path::MAX_REQUEST_BYTES {
        return Err(CoordError::TooLarge {
            what: "multi request",
            len: total,
            max: path::MAX_REQUEST_BYTES,
        });
    }
    Ok(())
}

/// The result of one operation of a successful multi, in the order of the ops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpResult {
    Check,
    /// The created path (with the sequence suffix, if any). No stat: ZooKeeper
    /// 3.8 answers a create inside a multi with a meaningless one (version and
    /// zxids -1, ZOOKEEPER-4026), and a -1 version passed on to a conditional
    /// write would make it unconditional. A node created by a multi has version
    /// 0 and cversion 0; read it for its zxids.
    Create {
        path: String,
    },
    Set {
        stat: Stat,
    },
    Delete,
}

/// State of a session, observable by its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SessionState {
    /// Requests are served.
    Connected,
    /// The connection is down; the session may still be alive on the server and
    /// may come back, requests meanwhile fail with connection loss.
    Disconnected,
    /// Terminal: the server ended the session and deleted its ephemerals.
    Expired,
    /// Terminal: the owner closed the session.
    Closed,
}

impl SessionState {
    /// True for the states a session never leaves.
    pub fn is_terminal(self) -> bool {
        matches!(self, SessionState::Expired | SessionState::Closed)
    }
}

/// What fired a watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WatchEventKind {
    NodeCreated,
    NodeDeleted,
    NodeDataChanged,
    NodeChildrenChanged,
    /// The connection dropped: changes may have been missed, so re-read and re-watch.
    Disconnected,
    /// The session expired: the watch will never fire again.
    SessionExpired,
    /// The session was closed: the watch will never fire again.
    SessionClosed,
}

/// A fired watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    pub kind: WatchEventKind,
    /// The watched node; empty for session events.
    pub path: String,
}

/// A one-shot watch: resolves once, on the first change after it was set (set
/// atomically with the read that returned it, so no change can slip in between),
/// or on a session event. Re-read and set a new watch to keep following a node.
pub struct Watch {
    fired: Pin<Box<dyn Future<Output = WatchEvent> + Send>>,
}

impl Watch {
    /// Wraps a back-end's notification future.
    pub fn new(fired: impl Future<Output = WatchEvent> + Send + 'static) -> Watch {
        Watch {
            fired: Box::pin(fired),
        }
    }

    /// Waits until the watch fires.
    pub async fn changed(self) -> WatchEvent {
        self.fired.await
    }
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Watch")
    }
}
