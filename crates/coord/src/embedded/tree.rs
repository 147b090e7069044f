//! The data tree: ZooKeeper's node semantics as a pure state machine.
//!
//! No I/O, no time, no tasks: the store feeds it requests in order and persists the
//! [`Txn`] records it returns. Replaying those records on a tree restored from a
//! snapshot rebuilds the same tree, stats included, which is what crash recovery
//! relies on.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::error::CoordError;
use crate::path::{self, SEQUENCE_DIGITS};
use crate::types::{Op, OpResult, Stat};

/// One node of the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    pub data: Vec<u8>,
    pub stat: Stat,
    pub children: BTreeSet<String>,
}

/// A committed change, as written to the log: the resolved effect of a request
/// (sequence numbers filled in, checks done), replayable without any checks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum TxnOp {
    Create {
        path: String,
        data: Vec<u8>,
        ephemeral_owner: i64,
    },
    Set {
        path: String,
        data: Vec<u8>,
    },
    Delete {
        path: String,
    },
}

/// A logged transaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum TxnBody {
    /// Atomic changes to the tree.
    Ops(Vec<TxnOp>),
    /// A store start: its zxid becomes the epoch of the session ids handed out until
    /// the next one, which keeps session ids unique across restarts.
    Boot,
}

/// A logged transaction with its id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Txn {
    pub zxid: i64,
    pub body: TxnBody,
}

/// What a change did, for firing watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    Created(String),
    Deleted(String),
    DataChanged(String),
}

/// The state needed to roll back one primitive step of a failed multi.
enum Undo {
    Created {
        path: String,
        parent_stat: Stat,
    },
    Deleted {
        node: Node,
        path: String,
        parent_stat: Stat,
    },
    Set {
        path: String,
        data: Vec<u8>,
        stat: Stat,
    },
}

/// A snapshot of the whole tree, written by the store from time to time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TreeImage {
    pub zxid: i64,
    /// Every node but the root, parents before children.
    pub nodes: Vec<(String, Vec<u8>, Stat)>,
    pub root_stat: Stat,
    /// The root's data: the root is a node like any other.
    pub root_data: Vec<u8>,
}

#[derive(Debug)]
pub(crate) struct Tree {
    nodes: BTreeMap<String, Node>,
    /// Ephemeral paths by owning session, to delete them when it ends.
    ephemerals: BTreeMap<i64, BTreeSet<String>>,
    zxid: i64,
}

fn no_node(path: &str) -> CoordError {
    CoordError::NoNode {
        path: path.to_string(),
    }
}

impl Tree {
    /// An empty tree: only the root.
    pub fn new() -> Tree {
        let mut nodes = BTreeMap::new();
        nodes.insert(
            "/".to_string(),
            Node {
                data: Vec::new(),
                stat: Stat::default(),
                children: BTreeSet::new(),
            },
        );
        Tree {
            nodes,
            ephemerals: BTreeMap::new(),
            zxid: 0,
        }
    }

    /// The id of the last committed transaction.
    pub fn zxid(&self) -> i64 {
        self.zxid
    }

    pub fn node(&self, path: &str) -> Option<&Node> {
        self.nodes.get(path)
    }

    /// Sessions that own at least one ephemeral node.
    pub fn ephemeral_owners(&self) -> Vec<i64> {
        self.ephemerals.keys().copied().collect()
    }

    /// Reserves the next zxid for a transaction without tree changes (a boot).
    pub fn next_boot(&mut self) -> Txn {
        self.zxid += 1;
        Txn {
            zxid: self.zxid,
            body: TxnBody::Boot,
        }
    }

    /// Applies a multi for `session` atomically. On success returns the results
    /// and the transaction to log (`None` for an empty or read-only multi); on
    /// failure the tree is unchanged and the error names the failing index.
    pub fn apply(
        &mut self,
        ops: &[Op],
        session: i64,
        changes: &mut Vec<Change>,
    ) -> Result<(Vec<OpResult>, Option<Txn>), CoordError> {
        let zxid = self.zxid + 1;
        let mut undo = Vec::new();
        let mut results = Vec::with_capacity(ops.len());
        let mut logged = Vec::new();
        let first_change = changes.len();
        for (index, op) in ops.iter().enumerate() {
            match self.apply_one(op, session, zxid, &mut undo, &mut logged, changes) {
                Ok(result) => results.push(result),
                Err(e) => {
                    self.roll_back(undo);
                    changes.truncate(first_change);
                    return Err(CoordError::MultiFailed {
                        index,
                        source: Box::new(e),
                    });
                }
            }
        }
        if logged.is_empty() {
            return Ok((results, None));
        }
        self.zxid = zxid;
        Ok((
            results,
            Some(Txn {
                zxid,
                body: TxnBody::Ops(logged),
            }),
        ))
    }

    /// Deletes every ephemeral node of `session` as one transaction.
    pub fn end_session(&mut self, session: i64, changes: &mut Vec<Change>) -> Option<Txn> {
        let paths = self.ephemerals.get(&session)?.clone();
        let ops: Vec<Op> = paths.into_iter().map(|p| Op::delete(p, None)).collect();
        match self.apply(&ops, session, changes) {
            Ok((_, txn)) => txn,
            Err(e) => {
                // Ephemerals have no children and are tracked exactly, so this
                // cannot fail; if it did, the tree would keep them, which is safe.
                tracing::error!(session, error = %e, "could not delete ephemerals");
                None
            }
        }
    }

    /// Replays a logged transaction (recovery). An error means the log does not
    /// match the tree: corruption, reported rather than papered over.
    pub fn replay(&mut self, txn: &Txn) -> Result<(), String> {
        if txn.zxid != self.zxid + 1 {
            return Err(format!("log jumps from zxid {} to {}", self.zxid, txn.zxid));
        }
        let ops = match &txn.body {
            TxnBody::Boot => {
                self.zxid = txn.zxid;
                return Ok(());
            }
            TxnBody::Ops(ops) => ops,
        };
        let mut undo = Vec::new();
        let mut logged = Vec::new();
        for op in ops {
            let result = match op {
                TxnOp::Create {
                    path,
                    data,
                    ephemeral_owner,
                } => self.create(
                    path,
                    data,
                    *ephemeral_owner,
                    txn.zxid,
                    &mut undo,
                    &mut logged,
                ),
                TxnOp::Set { path, data } => self
                    .set(path, data, None, txn.zxid, &mut undo, &mut logged)
                    .map(|_| ()),
                TxnOp::Delete { path } => self.delete(path, None, txn.zxid, &mut undo, &mut logged),
            };
            if let Err(e) = result {
                self.roll_back(undo);
                return Err(format!("zxid {}: {e}", txn.zxid));
            }
        }
        self.zxid = txn.zxid;
        Ok(())
    }

    fn apply_one(
        &mut self,
        op: &Op,
        session: i64,
        zxid: i64,
        undo: &mut Vec<Undo>,
        logged: &mut Vec<TxnOp>,
        changes: &mut Vec<Change>,
    ) -> Result<OpResult, CoordError> {
        op.validate()?;
        match op {
            Op::Check { path, version } => {
                let node = self.nodes.get(path).ok_or_else(|| no_node(path))?;
                if node.stat.version != *version {
                    return Err(CoordError::BadVersion { path: path.clone() });
                }
                Ok(OpResult::Check)
            }
            Op::Create {
                path: given,
                data,
                mode,
            } => {
                let path = given;
                let path = if mode.is_sequential() {
                    let parent_path =
                        path::parent(&format!("{path}{}", "0".repeat(SEQUENCE_DIGITS))).to_string();
                    let parent = self.nodes.get(&parent_path).ok_or_else(|| no_node(path))?;
                    // ZooKeeper numbers sequential children by how many children
                    // were ever created; its reported cversion counts creations and
                    // deletions, so creations = (cversion + num_children) / 2.
                    let created =
                        (i64::from(parent.stat.cversion) + i64::from(parent.stat.num_children)) / 2;
                    format!("{path}{created:010}")
                } else {
                    path.clone()
                };
                let owner = if mode.is_ephemeral() { session } else { 0 };
                // Errors name the path as the caller gave it (for a sequential
                // node, its prefix), as ZooKeeper's do.
                self.create(&path, data, owner, zxid, undo, logged)
                    .map_err(|e| e.with_path(given))?;
                changes.push(Change::Created(path.clone()));
                Ok(OpResult::Create { path })
            }
            Op::Set {
                path,
                data,
                version,
            } => {
                let stat = self.set(path, data, *version, zxid, undo, logged)?;
                changes.push(Change::DataChanged(path.clone()));
                Ok(OpResult::Set { stat })
            }
            Op::Delete { path, version } => {
                self.delete(path, *version, zxid, undo, logged)?;
                changes.push(Change::Deleted(path.clone()));
                Ok(OpResult::Delete)
            }
        }
    }

    fn create(
        &mut self,
        path: &str,
        data: &[u8],
        ephemeral_owner: i64,
        zxid: i64,
        undo: &mut Vec<Undo>,
        logged: &mut Vec<TxnOp>,
    ) -> Result<(), CoordError> {
        let parent_path = path::parent(path);
        let parent = self.nodes.get(parent_path).ok_or_else(|| no_node(path))?;
        if self.nodes.contains_key(path) {
            return Err(CoordError::NodeExists {
                path: path.to_string(),
            });
        }
        if parent.stat.ephemeral_owner != 0 {
            return Err(CoordError::NoChildrenForEphemerals {
                path: path.to_string(),
            });
        }
        let parent = self
            .nodes
            .get_mut(parent_path)
            .ok_or_else(|| no_node(path))?;
        undo.push(Undo::Created {
            path: path.to_string(),
            parent_stat: parent.stat,
        });
        parent.children.insert(path::name(path).to_string());
        parent.stat.cversion = parent.stat.cversion.wrapping_add(1);
        parent.stat.pzxid = zxid;
        parent.stat.num_children += 1;
        let stat = Stat {
            czxid: zxid,
            mzxid: zxid,
            pzxid: zxid,
            version: 0,
            cversion: 0,
            ephemeral_owner,
            data_length: data.len() as i32,
            num_children: 0,
        };
        self.nodes.insert(
            path.to_string(),
            Node {
                data: data.to_vec(),
                stat,
                children: BTreeSet::new(),
            },
        );
        if ephemeral_owner != 0 {
            self.ephemerals
                .entry(ephemeral_owner)
                .or_default()
                .insert(path.to_string());
        }
        logged.push(TxnOp::Create {
            path: path.to_string(),
            data: data.to_vec(),
            ephemeral_owner,
        });
        Ok(())
    }

    fn set(
        &mut self,
        path: &str,
        data: &[u8],
        version: Option<i32>,
        zxid: i64,
        undo: &mut Vec<Undo>,
        logged: &mut Vec<TxnOp>,
    ) -> Result<Stat, CoordError> {
        let node = self.nodes.get_mut(path).ok_or_else(|| no_node(path))?;
        if version.is_some_and(|v| v != node.stat.version) {
            return Err(CoordError::BadVersion {
                path: path.to_string(),
            });
        }
        let old = std::mem::replace(&mut node.data, data.to_vec());
        undo.push(Undo::Set {
            path: path.to_string(),
            data: old,
            stat: node.stat,
        });
        node.stat.version = node.stat.version.wrapping_add(1);
        node.stat.mzxid = zxid;
        node.stat.data_length = data.len() as i32;
        logged.push(TxnOp::Set {
            path: path.to_string(),
            data: data.to_vec(),
        });
        Ok(node.stat)
    }

    fn delete(
        &mut self,
        path: &str,
        version: Option<i32>,
        zxid: i64,
        undo: &mut Vec<Undo>,
        logged: &mut Vec<TxnOp>,
    ) -> Result<(), CoordError> {
        let node = self.nodes.get(path).ok_or_else(|| no_node(path))?;
        if version.is_some_and(|v| v != node.stat.version) {
            return Err(CoordError::BadVersion {
                path: path.to_string(),
            });
        }
        if !node.children.is_empty() {
            return Err(CoordError::NotEmpty {
                path: path.to_string(),
            });
        }
        let parent_path = path::parent(path);
        let parent = self
            .nodes
            .get_mut(parent_path)
            .ok_or_else(|| no_node(parent_path))?;
        let parent_stat = parent.stat;
        parent.children.remove(path::name(path));
        parent.stat.cversion = parent.stat.cversion.wrapping_add(1);
        parent.stat.pzxid = zxid;
        parent.stat.num_children -= 1;
        let node = self.nodes.remove(path).ok_or_else(|| no_node(path))?;
        if node.stat.ephemeral_owner != 0 {
            self.forget_ephemeral(node.stat.ephemeral_owner, path);
        }
        undo.push(Undo::Deleted {
            node,
            path: path.to_string(),
            parent_stat,
        });
        logged.push(TxnOp::Delete {
            path: path.to_string(),
        });
        Ok(())
    }

    fn forget_ephemeral(&mut self, owner: i64, path: &str) {
        if let Some(set) = self.ephemerals.get_mut(&owner) {
            set.remove(path);
            if set.is_empty() {
                self.ephemerals.remove(&owner);
            }
        }
    }

    fn roll_back(&mut self, undo: Vec<Undo>) {
        for step in undo.into_iter().rev() {
            match step {
                Undo::Created { path, parent_stat } => {
                    if let Some(node) = self.nodes.remove(&path) {
                        if node.stat.ephemeral_owner != 0 {
                            self.forget_ephemeral(node.stat.ephemeral_owner, &path);
                        }
                    }
                    if let Some(parent) = self.nodes.get_mut(path::parent(&path)) {
                        parent.children.remove(path::name(&path));
                        parent.stat = parent_stat;
                    }
                }
                Undo::Deleted {
                    node,
                    path,
                    parent_stat,
                } => {
                    if let Some(parent) = self.nodes.get_mut(path::parent(&path)) {
                        parent.children.insert(path::name(&path).to_string());
                        parent.stat = parent_stat;
                    }
                    if node.stat.ephemeral_owner != 0 {
                        self.ephemerals
                            .entry(node.stat.ephemeral_owner)
                            .or_default()
                            .insert(path.clone());
                    }
                    self.nodes.insert(path, node);
                }
                Undo::Set { path, data, stat } => {
                    if let Some(node) = self.nodes.get_mut(&path) {
                        node.data = data;
                        node.stat = stat;
                    }
                }
            }
        }
    }

    /// The whole tree as a snapshot image.
    pub fn image(&self) -> TreeImage {
        TreeImage {
            zxid: self.zxid,
            root_stat: self.nodes.get("/").map(|n| n.stat).unwrap_or_default(),
            root_data: self
                .nodes
                .get("/")
                .map(|n| n.data.clone())
                .unwrap_or_default(),
            nodes: self
                .nodes
                .iter()
                .filter(|(p, _)| p.as_str() != "/")
                .map(|(p, n)| (p.clone(), n.data.clone(), n.stat))
                .collect(),
        }
    }

    /// Rebuilds a tree from a snapshot image.
    pub fn from_image(image: TreeImage) -> Result<Tree, String> {
        let mut tree = Tree::new();
        tree.zxid = image.zxid;
        if let Some(root) = tree.nodes.get_mut("/") {
            root.stat = image.root_stat;
            root.data = image.root_data;
        }
        for (path, data, stat) in image.nodes {
            path::validate_path(&path).map_err(|e| format!("snapshot: {e}"))?;
            let parent = tree
                .nodes
                .get_mut(path::parent(&path))
                .ok_or_else(|| format!("snapshot: {path} comes before its parent"))?;
            parent.children.insert(path::name(&path).to_string());
            if stat.ephemeral_owner != 0 {
                tree.ephemerals
                    .entry(stat.ephemeral_owner)
                    .or_default()
                    .insert(path.clone());
            }
            let node = Node {
                data,
                stat,
                children: BTreeSet::new(),
            };
            if tree.nodes.insert(path.clone(), node).is_some() {
                return Err(format!("snapshot: {path} appears twice"));
            }
        }
        Ok(tree)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::CreateMode;

    fn apply(tree: &mut Tree, ops: &[Op]) -> Result<Vec<OpResult>, CoordError> {
        tree.apply(ops, 7, &mut Vec::new()).map(|(r, _)| r)
    }

    #[test]
    fn failed_multi_changes_nothing() {
        let mut tree = Tree::new();
        apply(
            &mut tree,
            &[Op::create("/a", b"1".to_vec(), CreateMode::Persistent)],
        )
        .expect("create");
        let before = tree.image();
        let err = apply(
            &mut tree,
            &[
                Op::create("/b", b"".to_vec(), CreateMode::Ephemeral),
                Op::set("/a", b"2".to_vec(), Some(0)),
                Op::delete("/a", None),
                Op::create("/a", b"".to_vec(), CreateMode::Persistent),
                Op::check("/zzz", 0),
            ],
        )
        .expect_err("must fail at index 4");
        assert!(
            matches!(err, CoordError::MultiFailed { index: 4, .. }),
            "{err}"
        );
        assert_eq!(tree.image(), before);
        assert!(tree.ephemeral_owners().is_empty());
    }

    #[test]
    fn replay_rebuilds_identical_tree() {
        let mut tree = Tree::new();
        let mut log = vec![tree.next_boot()];
        let steps: Vec<Vec<Op>> = vec![
            vec![Op::create("/q", b"".to_vec(), CreateMode::Persistent)],
            vec![Op::create(
                "/q/n-",
                b"x".to_vec(),
                CreateMode::PersistentSequential,
            )],
            vec![Op::create(
                "/q/e-",
                b"y".to_vec(),
                CreateMode::EphemeralSequential,
            )],
            vec![
                Op::set("/q", b"z".to_vec(), None),
                Op::delete("/q/n-0000000000", None),
            ],
        ];
        for ops in steps {
            let (_, txn) = tree.apply(&ops, 9, &mut Vec::new()).expect("apply");
            log.extend(txn);
        }
        log.extend(tree.end_session(9, &mut Vec::new()));
        let mut copy = Tree::new();
        for txn in &log {
            copy.replay(txn).expect("replay");
        }
        assert_eq!(copy.image(), tree.image());
        let from_image = Tree::from_image(tree.image()).expect("image");
        assert_eq!(from_image.image(), tree.image());
        assert_eq!(
            copy.node("/q").map(|n| n.stat.cversion),
            Some(4),
            "two creates and two deletes (one by the session end) under /q"
        );
    }
}
