//! Differential test of the two coordination back-ends: for each seed, a random
//! sequence of operations (every create mode, reads with and without watches,
//! conditional sets and deletes, multis that partly fail, dead session handles,
//! session close, expiry and reopening, restarts of the embedded store) is applied
//! to the embedded store (in a temporary directory) and to a real ZooKeeper (in a
//! fresh chroot), one operation at a time, from 2-3 sessions on each.
//!
//! After every operation both back-ends must agree on: the result or the error
//! (variant, path, and for a multi the failing index and inner error), created
//! paths, data, children, the comparable stat fields (versions, counts, lengths,
//! which session owns an ephemeral, and the *order* of zxids: every zxid seen on
//! one back-end is paired with the one seen in the same place on the other, and
//! the pairing must be one-to-one and monotonic), the watch events fired, and what
//! a caller reads right after its watch fired.
//!
//! The embedded store fires a watch before the operation that triggered it
//! returns; ZooKeeper delivers events asynchronously but before the response to
//! any later request of the same session, so after every operation each live
//! ZooKeeper session makes one cheap read, and an event the embedded store fired
//! is awaited on ZooKeeper for up to two seconds.
//!
//! Needs `FERRY_TEST_ZK` (says it was skipped otherwise, or fails when
//! `FERRY_TEST_REQUIRE_SERVICES=1`). Knobs: `FERRY_DIFF_SEEDS` (how many seeds,
//! 200), `FERRY_DIFF_BASE_SEED` (the first, 0), `FERRY_DIFF_SEED` (just this one,
//! printing every operation), `FERRY_DIFF_AVOID` (comma-separated generator
//! features not to use, to look past a known difference: `minus1` explicit version
//! -1, `multi-create` creates inside multis, `astral` names above U+FFFF,
//! `big-multi` multis near the request size limit, `root-set` sets on "/",
//! `restart`, `close`, `expire`, `seq-under-ephemeral` sequential creates under
//! ephemeral nodes, `invalid-path` malformed paths, `race` a set racing a read
//! with a watch from another session, `watch` every watch).

// The test measures its own wall time and reaches real ZooKeeper; node code may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

mod common;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use common::{Backend, Embedded, ZooKeeper, SOON};
use ferry_coord::embedded::EmbeddedOptions;
use ferry_coord::multi_request_bytes;
use ferry_coord::path::{MAX_DATA_BYTES, MAX_REQUEST_BYTES};
use ferry_coord::{
    CoordError, Coordination, CreateMode, Op, OpResult, Session, Stat, Watch, WatchEvent,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Operations per seed.
const OPS_PER_SEED: usize = 100;
/// How long an event the embedded store fired is awaited on ZooKeeper.
const ZK_EVENT_WAIT: Duration = Duration::from_secs(2);
/// Operations shown before the failing one.
const LOG_TAIL: usize = 12;

const NAMES: [&str; 5] = ["a", "b", "c", "d", "e"];
/// A name outside the Basic Multilingual Plane (U+1D4B3).
const ASTRAL: &str = "\u{1d4b3}";

#[tokio::test]
async fn backends_agree_on_random_operations() {
    if common::zk_address().is_none() {
        return;
    }
    let env = |name: &str| {
        std::env::var(name).ok().map(|v| {
            v.parse::<u64>()
                .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
        })
    };
    let (seeds, verbose) = match env("FERRY_DIFF_SEED") {
        Some(seed) => (seed..seed + 1, true),
        None => {
            let base = env("FERRY_DIFF_BASE_SEED").unwrap_or(0);
            (base..base + env("FERRY_DIFF_SEEDS").unwrap_or(200), false)
        }
    };
    let avoid: BTreeSet<String> = std::env::var("FERRY_DIFF_AVOID")
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    let started = std::time::Instant::now();
    let count = seeds.end - seeds.start;
    let mut failures = Vec::new();
    for seed in seeds {
        if let Err(failure) = run_seed(seed, verbose, &avoid).await {
            eprintln!("{}", failure.summary());
            failures.push(failure);
        }
    }
    eprintln!(
        "differential: {count} seeds of {OPS_PER_SEED} operations in {:.1?}, {} with differences",
        started.elapsed(),
        failures.len()
    );
    if let Some(first) = failures.first() {
        let summary: Vec<String> = failures.iter().map(Failure::summary).collect();
        panic!(
            "the back-ends differ on {} of {count} seeds:\n{}\n\nthe first in full:\n{first}",
            failures.len(),
            summary.join("\n")
        );
    }
}

// ---------------------------------------------------------------------------
// Operations

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadKind {
    Get,
    Exists,
    Children,
}

/// One step of a run, applied to both back-ends. `s` is the session slot.
#[derive(Clone)]
enum Step {
    Create {
        s: usize,
        path: String,
        data: Vec<u8>,
        mode: CreateMode,
    },
    Read {
        s: usize,
        kind: ReadKind,
        path: String,
        watch: bool,
    },
    Set {
        s: usize,
        path: String,
        data: Vec<u8>,
        version: Option<i32>,
    },
    Delete {
        s: usize,
        path: String,
        version: Option<i32>,
    },
    Multi {
        s: usize,
        ops: Vec<Op>,
    },
    /// Closes the slot's session; the dead handle stays until `Reopen`.
    Close {
        s: usize,
    },
    /// Expires the slot's session from the server side.
    Expire {
        s: usize,
    },
    /// Opens a new session in a slot whose session is closed or expired.
    Reopen {
        s: usize,
    },
    /// An unconditional set by session `w` sent together with a `get_watch` of the
    /// same node by session `r`: on the embedded store both land in one batch,
    /// on ZooKeeper either may come first. Only the set's result is compared;
    /// on each back-end the watch must fire exactly when the read did not see
    /// the set (a watch never fires for a change its read already saw).
    Race {
        w: usize,
        r: usize,
        path: String,
        data: Vec<u8>,
    },
    /// Restarts the embedded store from its directory (every session was closed
    /// first); nothing happens to ZooKeeper.
    Restart,
}

/// Shows data by length, and the bytes themselves when short and printable.
struct Bytes<'a>(&'a [u8]);

impl fmt::Display for Bytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.len() <= 24 && d.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
            write!(f, "{:?}", String::from_utf8_lossy(d))
        } else {
            // FNV-1a, to tell different long values apart in a report.
            let hash = d.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
            });
            write!(f, "<{} bytes #{:06x}>", d.len(), hash & 0xff_ffff)
        }
    }
}

fn show_op(op: &Op) -> String {
    match op {
        Op::Check { path, version } => format!("check {path} v{version}"),
        Op::Create { path, data, mode } => format!("create {path} {} {mode:?}", Bytes(data)),
        Op::Set {
            path,
            data,
            version,
        } => format!("set {path} {} {version:?}", Bytes(data)),
        Op::Delete { path, version } => format!("delete {path} {version:?}"),
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Create {
                s,
                path,
                data,
                mode,
            } => write!(f, "s{s} create {path} {} {mode:?}", Bytes(data)),
            Step::Read {
                s,
                kind,
                path,
                watch,
            } => {
                let name = match kind {
                    ReadKind::Get => "get",
                    ReadKind::Exists => "exists",
                    ReadKind::Children => "children",
                };
                let suffix = if *watch { "_watch" } else { "" };
                write!(f, "s{s} {name}{suffix} {path}")
            }
            Step::Set {
                s,
                path,
                data,
                version,
            } => write!(f, "s{s} set {path} {} {version:?}", Bytes(data)),
            Step::Delete { s, path, version } => write!(f, "s{s} delete {path} {version:?}"),
            Step::Multi { s, ops } if ops.len() > 6 => {
                let bytes = multi_request_bytes(ops, 0);
                write!(
                    f,
                    "s{s} multi of {} ops ({bytes} request bytes without a chroot), each like [{}]",
                    ops.len(),
                    show_op(&ops[0])
                )
            }
            Step::Multi { s, ops } => {
                let ops: Vec<String> = ops.iter().map(show_op).collect();
                write!(f, "s{s} multi [{}]", ops.join(", "))
            }
            Step::Close { s } => write!(f, "s{s} close"),
            Step::Expire { s } => write!(f, "s{s} expire"),
            Step::Reopen { s } => write!(f, "s{s} reopen"),
            Step::Race { w, r, path, data } => write!(
                f,
                "s{w} set {path} {} None racing s{r} get_watch {path}",
                Bytes(data)
            ),
            Step::Restart => write!(f, "restart the embedded store"),
        }
    }
}

// ---------------------------------------------------------------------------
// Results, as each back-end gave them and normalised for comparison

/// An answer of a back-end, with its stats, multi results and errors as the
/// back-end gave them ([`Reply`]) or normalised for comparison ([`Norm`]).
#[derive(Clone, PartialEq, Eq)]
enum Answer<S, R, E> {
    Created(String, S),
    Data(Vec<u8>, S),
    Exists(Option<S>),
    Set(S),
    Children(Vec<String>, S),
    Deleted,
    Multi(Vec<R>),
    Done,
    Failed(E),
}

/// What a back-end answered.
type Reply = Answer<Stat, OpResult, CoordError>;

fn reply<T>(result: Result<T, CoordError>, ok: impl FnOnce(T) -> Reply) -> Reply {
    match result {
        Ok(v) => ok(v),
        Err(e) => Reply::Failed(e),
    }
}

/// Who owns an ephemeral node, by the test's numbering of sessions (the n-th
/// session opened in the run), not by back-end session id.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Owner {
    Nobody,
    Session(usize),
    Unknown(i64),
}

/// The stat fields both back-ends must agree on; zxids are compared by order.
#[derive(Clone, Copy, PartialEq, Eq)]
struct NStat {
    zxids: [i64; 3],
    version: i32,
    cversion: i32,
    num_children: i32,
    data_length: i32,
    owner: Owner,
}

impl fmt::Debug for NStat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let owner = match self.owner {
            Owner::Nobody => String::new(),
            Owner::Session(n) => format!(" owner=#{n}"),
            Owner::Unknown(id) => format!(" owner=?{id:#x}"),
        };
        let [c, m, p] = self.zxids;
        write!(
            f,
            "{{v{} cv{} children={} len={}{owner} zxid c{c} m{m} p{p}}}",
            self.version, self.cversion, self.num_children, self.data_length
        )
    }
}

/// An error reduced to what must match: variant, path, multi index.
#[derive(Clone, PartialEq, Eq)]
struct NErr {
    kind: &'static str,
    path: Option<String>,
    multi: Option<(usize, Box<NErr>)>,
}

impl fmt::Debug for NErr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.multi, &self.path) {
            (Some((index, inner)), _) => write!(f, "MultiFailed(op {index}: {inner:?})"),
            (None, Some(path)) => write!(f, "{}({path})", self.kind),
            (None, None) => f.write_str(self.kind),
        }
    }
}

#[derive(Clone, PartialEq, Eq, Debug)]
enum NOp {
    Check,
    Create(String),
    Set(NStat),
    Delete,
}

/// A [`Reply`] normalised for comparison.
type Norm = Answer<NStat, NOp, NErr>;

impl fmt::Debug for Norm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Norm::Created(path, st) => write!(f, "created {path} {st:?}"),
            Norm::Data(data, st) => write!(f, "data {} {st:?}", Bytes(data)),
            Norm::Exists(Some(st)) => write!(f, "exists {st:?}"),
            Norm::Exists(None) => write!(f, "does not exist"),
            Norm::Set(st) => write!(f, "set {st:?}"),
            Norm::Children(names, st) => write!(f, "children {names:?} {st:?}"),
            Norm::Deleted => write!(f, "deleted"),
            Norm::Multi(results) if results.len() > 6 => {
                write!(
                    f,
                    "multi ok, {} results: {:?} ...",
                    results.len(),
                    results[0]
                )
            }
            Norm::Multi(results) => write!(f, "multi ok {results:?}"),
            Norm::Done => write!(f, "done"),
            Norm::Failed(e) => write!(f, "error {e:?}"),
        }
    }
}

impl Norm {
    fn stats_mut(&mut self) -> Vec<&mut NStat> {
        match self {
            Norm::Created(_, st)
            | Norm::Data(_, st)
            | Norm::Exists(Some(st))
            | Norm::Set(st)
            | Norm::Children(_, st) => vec![st],
            Norm::Multi(results) => results
                .iter_mut()
                .filter_map(|r| match r {
                    NOp::Set(st) => Some(st),
                    NOp::Create(_) | NOp::Check | NOp::Delete => None,
                })
                .collect(),
            Norm::Exists(None) | Norm::Deleted | Norm::Done | Norm::Failed(_) => Vec::new(),
        }
    }

    /// The zxids in order of appearance, and a copy with them zeroed.
    fn split_zxids(&self) -> (Norm, Vec<i64>) {
        let mut copy = self.clone();
        let mut zxids = Vec::new();
        for st in copy.stats_mut() {
            zxids.extend(st.zxids);
            st.zxids = [0; 3];
        }
        (copy, zxids)
    }
}

fn norm_err(e: &CoordError) -> NErr {
    let (kind, path) = match e {
        CoordError::NoNode { path } => ("NoNode", Some(path)),
        CoordError::NodeExists { path } => ("NodeExists", Some(path)),
        CoordError::BadVersion { path } => ("BadVersion", Some(path)),
        CoordError::NotEmpty { path } => ("NotEmpty", Some(path)),
        CoordError::NoChildrenForEphemerals { path } => ("NoChildrenForEphemerals", Some(path)),
        CoordError::InvalidPath { path, .. } => ("InvalidPath", Some(path)),
        CoordError::InvalidVersion { path, .. } => ("InvalidVersion", Some(path)),
        CoordError::TooLarge { .. } => ("TooLarge", None),
        CoordError::SessionExpired => ("SessionExpired", None),
        CoordError::SessionClosed => ("SessionClosed", None),
        CoordError::ConnectionLoss { .. } => ("ConnectionLoss", None),
        CoordError::Backend(_) => ("Backend", None),
        CoordError::DiskFull(_) => ("DiskFull", None),
        CoordError::MultiFailed { index, source } => {
            return NErr {
                kind: "MultiFailed",
                path: None,
                multi: Some((*index, Box::new(norm_err(source)))),
            }
        }
    };
    NErr {
        kind,
        path: path.cloned(),
        multi: None,
    }
}

/// Normalises a reply; `owners` maps this back-end's session ids to the test's
/// session numbers.
fn norm(reply: &Reply, owners: &BTreeMap<i64, usize>) -> Norm {
    let st = |s: &Stat| NStat {
        zxids: [s.czxid, s.mzxid, s.pzxid],
        version: s.version,
        cversion: s.cversion,
        num_children: s.num_children,
        data_length: s.data_length,
        owner: match s.ephemeral_owner {
            0 => Owner::Nobody,
            id => owners
                .get(&id)
                .map_or(Owner::Unknown(id), |n| Owner::Session(*n)),
        },
    };
    match reply {
        Reply::Created(path, s) => Norm::Created(path.clone(), st(s)),
        Reply::Data(data, s) => Norm::Data(data.clone(), st(s)),
        Reply::Exists(s) => Norm::Exists(s.as_ref().map(st)),
        Reply::Set(s) => Norm::Set(st(s)),
        Reply::Children(names, s) => Norm::Children(names.clone(), st(s)),
        Reply::Deleted => Norm::Deleted,
        Reply::Multi(results) => Norm::Multi(
            results
                .iter()
                .map(|r| match r {
                    OpResult::Check => NOp::Check,
                    OpResult::Create { path } => NOp::Create(path.clone()),
                    OpResult::Set { stat } => NOp::Set(st(stat)),
                    OpResult::Delete => NOp::Delete,
                })
                .collect(),
        ),
        Reply::Done => Norm::Done,
        Reply::Failed(e) => Norm::Failed(norm_err(e)),
    }
}

/// Pairs every zxid seen on the embedded store with the one seen in the same
/// place on ZooKeeper. The pairing must be a bijection that keeps order: equal
/// zxids stay equal, and earlier transactions stay earlier (ZooKeeper's zxids also
/// count transactions nobody here observes, so only the order can match).
#[derive(Default)]
struct ZxidOrder {
    e2z: BTreeMap<i64, i64>,
    z2e: BTreeMap<i64, i64>,
}

impl ZxidOrder {
    fn relate(&mut self, e: i64, z: i64) -> Result<(), String> {
        match (self.e2z.get(&e), self.z2e.get(&z)) {
            (Some(&z0), _) if z0 == z => return Ok(()),
            (Some(&z0), _) => {
                return Err(format!(
                    "embedded zxid {e} was seen where zookeeper had {z0}, now where it has {z}"
                ))
            }
            (None, Some(&e0)) => {
                return Err(format!(
                    "zookeeper zxid {z} was seen where the embedded store had {e0}, now where it has {e}"
                ))
            }
            (None, None) => {}
        }
        if let Some((&pe, &pz)) = self.e2z.range(..e).next_back() {
            if pz >= z {
                return Err(format!(
                    "zxid order: embedded {pe} < {e}, but zookeeper {pz} >= {z}"
                ));
            }
        }
        if let Some((&ne, &nz)) = self.e2z.range(e + 1..).next() {
            if nz <= z {
                return Err(format!(
                    "zxid order: embedded {e} < {ne}, but zookeeper {z} >= {nz}"
                ));
            }
        }
        self.e2z.insert(e, z);
        self.z2e.insert(z, e);
        Ok(())
    }

    /// Compares two normalised results, zxids by order.
    fn compare(&mut self, e: &Norm, z: &Norm) -> Result<(), String> {
        let (e0, ez) = e.split_zxids();
        let (z0, zz) = z.split_zxids();
        if e0 != z0 {
            return Err(explain(e0, z0));
        }
        ez.into_iter()
            .zip(zz)
            .try_for_each(|(e, z)| self.relate(e, z))
    }
}

/// Says briefly how two normalised results (zxids zeroed) differ.
fn explain(mut e: Norm, mut z: Norm) -> String {
    let (es, zs) = (e.stats_mut(), z.stats_mut());
    if es.len() == zs.len() {
        if let Some((a, b)) = es.into_iter().zip(zs).find(|(a, b)| a != b) {
            return format!("stats differ: embedded {a:?}, zookeeper {b:?}");
        }
    }
    match (&e, &z) {
        (Norm::Failed(_), Norm::Failed(_)) => "errors differ".to_string(),
        (Norm::Failed(_), _) => "only the embedded store failed".to_string(),
        (_, Norm::Failed(_)) => "only zookeeper failed".to_string(),
        _ => "results differ".to_string(),
    }
}

// ---------------------------------------------------------------------------
// One back-end, with its sessions and the watches it has set

enum Store {
    Embedded(Embedded),
    ZooKeeper(ZooKeeper),
}

/// What a watch follower reports: the event, then what a caller read right after.
enum Note {
    Fired(u64, WatchEvent),
    Read(u64, Option<Reply>),
}

/// A fired watch: the event and the read that followed it.
type Fired = BTreeMap<u64, (WatchEvent, Option<Reply>)>;

struct World {
    store: Store,
    slots: Vec<Session>,
    /// Back-end session id → the test's session number.
    owners: BTreeMap<i64, usize>,
    next_watch: u64,
    /// Watches not fired yet: id → slot.
    unfired: BTreeMap<u64, usize>,
    /// Watches set by racing reads, whose firing depends on the order the
    /// back-end chose: checked by `check_race`, never compared.
    racy: BTreeSet<u64>,
    /// The watch of the last race's read and the mzxid that read returned.
    race: Option<(u64, i64)>,
    notes_tx: mpsc::UnboundedSender<Note>,
    notes: mpsc::UnboundedReceiver<Note>,
    followers: Vec<JoinHandle<()>>,
}

async fn read(
    session: &dyn Coordination,
    kind: ReadKind,
    path: &str,
    watch: bool,
) -> (Reply, Option<Watch>) {
    match (kind, watch) {
        (ReadKind::Get, false) => (
            reply(session.get(path).await, |(d, s)| Reply::Data(d, s)),
            None,
        ),
        (ReadKind::Get, true) => match session.get_watch(path).await {
            Ok((d, s, w)) => (Reply::Data(d, s), Some(w)),
            Err(e) => (Reply::Failed(e), None),
        },
        (ReadKind::Exists, false) => (reply(session.exists(path).await, Reply::Exists), None),
        (ReadKind::Exists, true) => match session.exists_watch(path).await {
            Ok((s, w)) => (Reply::Exists(s), Some(w)),
            Err(e) => (Reply::Failed(e), None),
        },
        (ReadKind::Children, false) => (
            reply(session.children(path).await, |(c, s)| Reply::Children(c, s)),
            None,
        ),
        (ReadKind::Children, true) => match session.children_watch(path).await {
            Ok((c, s, w)) => (Reply::Children(c, s), Some(w)),
            Err(e) => (Reply::Failed(e), None),
        },
    }
}

impl World {
    fn new(store: Store) -> World {
        let (notes_tx, notes) = mpsc::unbounded_channel();
        World {
            store,
            slots: Vec::new(),
            owners: BTreeMap::new(),
            next_watch: 0,
            unfired: BTreeMap::new(),
            racy: BTreeSet::new(),
            race: None,
            notes_tx,
            notes,
            followers: Vec::new(),
        }
    }

    fn backend(&self) -> &dyn Backend {
        match &self.store {
            Store::Embedded(e) => e,
            Store::ZooKeeper(z) => z,
        }
    }

    async fn open(&mut self, s: usize, number: usize) {
        let session = self.backend().session().await;
        self.owners.insert(session.session_id(), number);
        if s < self.slots.len() {
            self.slots[s] = session;
        } else {
            self.slots.push(session);
        }
    }

    /// Follows a watch like a caller does: waits for it, then reads again what it
    /// announced (nothing for session events).
    fn follow(&mut self, s: usize, kind: ReadKind, path: &str, watch: Watch) -> u64 {
        let id = self.next_watch;
        self.next_watch += 1;
        self.unfired.insert(id, s);
        let session = Arc::clone(&self.slots[s]);
        let tx = self.notes_tx.clone();
        let path = path.to_string();
        self.followers.push(tokio::spawn(async move {
            let event = watch.changed().await;
            let session_event = event.path.is_empty();
            let _ = tx.send(Note::Fired(id, event));
            let after = if session_event {
                None
            } else {
                Some(read(&*session, kind, &path, false).await.0)
            };
            let _ = tx.send(Note::Read(id, after));
        }));
        id
    }

    async fn apply(&mut self, step: &Step, numbers: &[usize]) -> Reply {
        match step {
            Step::Create {
                s,
                path,
                data,
                mode,
            } => reply(self.slots[*s].create(path, data, *mode).await, |(p, st)| {
                Reply::Created(p, st)
            }),
            Step::Read {
                s,
                kind,
                path,
                watch,
            } => {
                let session = Arc::clone(&self.slots[*s]);
                let (result, w) = read(&*session, *kind, path, *watch).await;
                if let Some(w) = w {
                    self.follow(*s, *kind, path, w);
                }
                result
            }
            Step::Set {
                s,
                path,
                data,
                version,
            } => reply(self.slots[*s].set(path, data, *version).await, Reply::Set),
            Step::Delete { s, path, version } => {
                reply(self.slots[*s].delete(path, *version).await, |()| {
                    Reply::Deleted
                })
            }
            Step::Multi { s, ops } => reply(self.slots[*s].multi(ops.clone()).await, Reply::Multi),
            Step::Close { s } => {
                self.slots[*s].close().await;
                Reply::Done
            }
            Step::Expire { s } => {
                let session = Arc::clone(&self.slots[*s]);
                self.backend().expire(&session).await;
                Reply::Done
            }
            Step::Reopen { s } => {
                self.open(*s, numbers[*s]).await;
                Reply::Done
            }
            Step::Race { w, r, path, data } => {
                let (ws, rs) = (Arc::clone(&self.slots[*w]), Arc::clone(&self.slots[*r]));
                let (set, read) = tokio::join!(ws.set(path, data, None), rs.get_watch(path));
                self.race = None;
                if let Ok((_, stat, watch)) = read {
                    let id = self.follow(*r, ReadKind::Get, path, watch);
                    self.racy.insert(id);
                    self.race = Some((id, stat.mzxid));
                }
                reply(set, Reply::Set)
            }
            Step::Restart => {
                if let Store::Embedded(e) = &mut self.store {
                    e.restart().await;
                }
                Reply::Done
            }
        }
    }

    fn take_notes(&mut self, fired: &mut Fired, pending: &mut BTreeMap<u64, WatchEvent>) {
        while let Ok(note) = self.notes.try_recv() {
            self.record(note, fired, pending);
        }
    }

    fn record(&mut self, note: Note, fired: &mut Fired, pending: &mut BTreeMap<u64, WatchEvent>) {
        match note {
            Note::Fired(id, event) => {
                self.unfired.remove(&id);
                pending.insert(id, event);
            }
            Note::Read(id, after) => {
                if let Some(event) = pending.remove(&id) {
                    fired.insert(id, (event, after));
                }
            }
        }
    }

    async fn finish(self) {
        for follower in &self.followers {
            follower.abort();
        }
        for session in &self.slots {
            session.close().await;
        }
        if let Store::Embedded(e) = &self.store {
            e.store.shutdown().await;
        }
    }
}

/// Lets tasks woken by the last answer run (the test runs on one thread).
async fn let_others_run() {
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
}

/// The watches each back-end fired because of the last step.
async fn collect_events(emb: &mut World, zk: &mut World, live: &[bool]) -> (Fired, Fired) {
    let (mut e_fired, mut e_pending) = (Fired::new(), BTreeMap::new());
    let (mut z_fired, mut z_pending) = (Fired::new(), BTreeMap::new());
    // The embedded store fires before it answers.
    let_others_run().await;
    emb.take_notes(&mut e_fired, &mut e_pending);
    // ZooKeeper delivers a session's events before its answer to a later request:
    // one read on every live session that has watches set.
    let watching: BTreeSet<usize> = zk.unfired.values().copied().collect();
    for s in watching {
        if live[s] {
            let _ = zk.slots[s].exists("/").await;
        }
    }
    let_others_run().await;
    zk.take_notes(&mut z_fired, &mut z_pending);
    // Events the embedded store fired may still be on their way from ZooKeeper.
    let deadline = Instant::now() + ZK_EVENT_WAIT;
    while e_pending
        .keys()
        .chain(e_fired.keys())
        .any(|id| !z_fired.contains_key(id) && !z_pending.contains_key(id))
    {
        match tokio::time::timeout_at(deadline, zk.notes.recv()).await {
            Ok(Some(note)) => zk.record(note, &mut z_fired, &mut z_pending),
            _ => break,
        }
    }
    // The reads that follow fired watches.
    let deadline = Instant::now() + SOON;
    for (world, fired, pending) in [
        (emb, &mut e_fired, &mut e_pending),
        (zk, &mut z_fired, &mut z_pending),
    ] {
        while !pending.is_empty() {
            match tokio::time::timeout_at(deadline, world.notes.recv()).await {
                Ok(Some(note)) => world.record(note, fired, pending),
                _ => break,
            }
        }
        for (id, event) in std::mem::take(pending) {
            fired.insert(id, (event, None));
        }
    }
    (e_fired, z_fired)
}

// ---------------------------------------------------------------------------
// The generator: what a caller knows, and random steps from it

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Life {
    Live,
    Closed,
    Expired,
}

struct Model {
    lives: Vec<Life>,
    /// The test's number of the session in each slot.
    numbers: Vec<usize>,
    next_number: usize,
    /// Every path ever created or named in a successful read.
    known: BTreeSet<String>,
    /// Paths last seen as ephemeral.
    ephemeral: BTreeSet<String>,
    /// The last version seen of each node, as a caller would remember it.
    versions: BTreeMap<String, i32>,
    avoid: BTreeSet<String>,
    queued: VecDeque<Step>,
    /// Bytes ZooKeeper's chroot adds to every path of a request (the embedded
    /// store adds none): multis near the size limit are sized with it, so that
    /// both back-ends accept them or both refuse them.
    zk_prefix: usize,
}

impl Model {
    fn avoids(&self, feature: &str) -> bool {
        self.avoid.contains(feature)
    }

    fn name(&self, rng: &mut SmallRng) -> &'static str {
        if !self.avoids("astral") && rng.random_ratio(1, 300) {
            ASTRAL
        } else {
            NAMES[rng.random_range(0..NAMES.len())]
        }
    }

    fn random_path(&self, rng: &mut SmallRng, max_depth: usize) -> String {
        if rng.random_bool(0.5) {
            // A child of a node that exists or existed.
            if let Some(parent) = self.known_path(rng) {
                if parent.matches('/').count() < max_depth {
                    return join(&parent, self.name(rng));
                }
            }
        }
        let depth = match rng.random_range(0..10) {
            0..=4 => 1,
            5..=8 => 2,
            _ => 3,
        }
        .min(max_depth);
        (0..depth).map(|_| format!("/{}", self.name(rng))).collect()
    }

    fn known_path(&self, rng: &mut SmallRng) -> Option<String> {
        if self.known.is_empty() {
            return None;
        }
        self.known
            .iter()
            .nth(rng.random_range(0..self.known.len()))
            .cloned()
    }

    fn pick_path(&self, rng: &mut SmallRng) -> String {
        match rng.random_range(0..40) {
            0..=1 => "/".to_string(),
            2 if !self.avoids("invalid-path") => {
                let bad = ["//d", "/a/", "/a/../b", "d", "/a\u{1}"];
                bad[rng.random_range(0..bad.len())].to_string()
            }
            3..=19 => self
                .known_path(rng)
                .unwrap_or_else(|| self.random_path(rng, 3)),
            _ => self.random_path(rng, 3),
        }
    }

    fn sequential_prefix(&self, rng: &mut SmallRng) -> String {
        let mut parent = match rng.random_range(0..10) {
            0..=1 => "/".to_string(),
            2..=5 => self
                .known_path(rng)
                .unwrap_or_else(|| self.random_path(rng, 2)),
            _ => self.random_path(rng, 2),
        };
        if self.avoids("seq-under-ephemeral") && self.ephemeral.contains(&parent) {
            parent = "/".to_string();
        }
        let name = if rng.random_ratio(1, 10) { "" } else { "q-" };
        join(&parent, name)
    }

    fn data(rng: &mut SmallRng) -> Vec<u8> {
        match rng.random_range(0..20) {
            0..=12 => {
                let len = rng.random_range(0..=6);
                (0..len).map(|_| rng.random_range(b'a'..=b'z')).collect()
            }
            13..=18 => {
                let len = rng.random_range(0..=64);
                (0..len).map(|_| rng.random()).collect()
            }
            _ => {
                let len = rng.random_range(200..=3000);
                (0..len).map(|_| rng.random()).collect()
            }
        }
    }

    fn mode(rng: &mut SmallRng) -> CreateMode {
        match rng.random_range(0..20) {
            0..=7 => CreateMode::Persistent,
            8..=11 => CreateMode::Ephemeral,
            12..=16 => CreateMode::PersistentSequential,
            _ => CreateMode::EphemeralSequential,
        }
    }

    fn create_op(&self, rng: &mut SmallRng) -> (String, Vec<u8>, CreateMode) {
        let mode = Self::mode(rng);
        let path = if mode.is_sequential() {
            self.sequential_prefix(rng)
        } else {
            self.pick_path(rng)
        };
        (path, Self::data(rng), mode)
    }

    fn wrong_version(rng: &mut SmallRng, right: i32) -> i32 {
        if right > 0 && rng.random_bool(0.5) {
            right - 1
        } else {
            right + rng.random_range(1..=3)
        }
    }

    /// None, the version last seen (as a caller would pass it), a wrong one, or
    /// now and then an explicit -1.
    fn version(&self, rng: &mut SmallRng, path: &str) -> Option<i32> {
        let right = self.versions.get(path).copied().unwrap_or(0);
        match rng.random_range(0..100) {
            0..=34 => None,
            35..=74 => Some(right),
            75..=96 => Some(Self::wrong_version(rng, right)),
            _ if self.avoids("minus1") => None,
            _ => Some(-1),
        }
    }

    fn check_version(&self, rng: &mut SmallRng, path: &str) -> i32 {
        let right = self.versions.get(path).copied().unwrap_or(0);
        match rng.random_range(0..100) {
            0..=59 => right,
            60..=96 => Self::wrong_version(rng, right),
            _ if self.avoids("minus1") => right,
            _ => -1,
        }
    }

    fn set_path(&self, rng: &mut SmallRng) -> String {
        let path = if !self.avoids("root-set") && rng.random_ratio(1, 10) {
            "/".to_string()
        } else {
            self.pick_path(rng)
        };
        if path == "/" && self.avoids("root-set") {
            "/a".to_string()
        } else {
            path
        }
    }

    /// 1-5 mixed operations, later ones often naming nodes created by earlier ones.
    fn multi(&self, rng: &mut SmallRng) -> Vec<Op> {
        let n = rng.random_range(1..=5);
        let mut created: Vec<String> = Vec::new();
        let mut ops = Vec::with_capacity(n);
        let path = |rng: &mut SmallRng, created: &[String]| {
            if !created.is_empty() && rng.random_bool(0.4) {
                created[rng.random_range(0..created.len())].clone()
            } else {
                self.pick_path(rng)
            }
        };
        for _ in 0..n {
            let roll = rng.random_range(0..20);
            let op = match roll {
                0..=3 => {
                    let p = path(rng, &created);
                    Op::check(p.clone(), self.check_version(rng, &p))
                }
                4..=10 if !self.avoids("multi-create") => {
                    let (mut p, data, mode) = self.create_op(rng);
                    if !mode.is_sequential() && !created.is_empty() && rng.random_bool(0.4) {
                        // A child of a node created earlier in this multi.
                        let parent = &created[rng.random_range(0..created.len())];
                        p = join(parent, self.name(rng));
                    }
                    created.push(p.clone());
                    Op::create(p, data, mode)
                }
                4..=15 => {
                    let p = if roll <= 10 {
                        self.set_path(rng)
                    } else {
                        path(rng, &created)
                    };
                    let version = self.version(rng, &p);
                    Op::set(p, Self::data(rng), version)
                }
                _ => {
                    let p = path(rng, &created);
                    let version = self.version(rng, &p);
                    Op::delete(p, version)
                }
            };
            ops.push(op);
        }
        ops
    }

    /// A multi whose size, as ZooKeeper receives it, is just under
    /// `MAX_REQUEST_BYTES` (both back-ends accept it), or just over it without
    /// the chroot (both refuse it): many sequential creates (or sets) sharing
    /// the bytes.
    fn big_multi(&self, rng: &mut SmallRng) -> Vec<Op> {
        let n = rng.random_range(1..=120);
        let over = rng.random_bool(0.3);
        let (prefix, target) = if over {
            (0, MAX_REQUEST_BYTES + 1 + rng.random_range(0..512))
        } else {
            (self.zk_prefix, MAX_REQUEST_BYTES - rng.random_range(0..512))
        };
        let creates = !self.avoids("multi-create") && rng.random_bool(0.7);
        let path = if creates {
            self.sequential_prefix(rng)
        } else {
            self.known_path(rng).unwrap_or_else(|| "/a".to_string())
        };
        let build = |len: usize| -> Vec<Op> {
            let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            (0..n)
                .map(|_| {
                    if creates {
                        Op::create(path.clone(), data.clone(), CreateMode::PersistentSequential)
                    } else {
                        Op::set(path.clone(), data.clone(), None)
                    }
                })
                .collect()
        };
        let base = multi_request_bytes(&build(0), prefix);
        let room = target.saturating_sub(base);
        // Over: round up, so the total passes the target; under: round down.
        let len = if over { room.div_ceil(n) } else { room / n };
        build(len.min(MAX_DATA_BYTES))
    }

    fn next_step(&mut self, rng: &mut SmallRng) -> Step {
        if let Some(step) = self.queued.pop_front() {
            return step;
        }
        let s = rng.random_range(0..self.lives.len());
        if self.lives[s] != Life::Live {
            match rng.random_range(0..10) {
                0..=4 => return Step::Reopen { s },
                5..=6 if !self.avoids("close") => return Step::Close { s },
                _ => {}
            }
        }
        let live = self.lives[s] == Life::Live;
        let watches = !self.avoids("watch");
        let read = |kind, path, rng: &mut SmallRng| Step::Read {
            s,
            kind,
            path,
            watch: watches && rng.random_bool(0.5),
        };
        match rng.random_range(0..1000) {
            0..=179 => {
                let (path, data, mode) = self.create_op(rng);
                Step::Create {
                    s,
                    path,
                    data,
                    mode,
                }
            }
            180..=279 => read(ReadKind::Get, self.pick_path(rng), rng),
            280..=369 => read(ReadKind::Exists, self.pick_path(rng), rng),
            370..=449 => read(ReadKind::Children, self.pick_path(rng), rng),
            450..=599 => {
                let path = self.set_path(rng);
                let version = self.version(rng, &path);
                Step::Set {
                    s,
                    path,
                    data: Self::data(rng),
                    version,
                }
            }
            600..=719 => {
                let path = self.pick_path(rng);
                let version = self.version(rng, &path);
                Step::Delete { s, path, version }
            }
            720..=924 => Step::Multi {
                s,
                ops: self.multi(rng),
            },
            925..=927 if !self.avoids("big-multi") => Step::Multi {
                s,
                ops: self.big_multi(rng),
            },
            // Closing a dead handle too (a caller cleaning up after expiry).
            935..=959 if !self.avoids("close") => Step::Close { s },
            960..=966 if live && !self.avoids("expire") => Step::Expire { s },
            967..=981 if !self.avoids("restart") => {
                // Every session ends, the store restarts, new sessions start.
                for (s, life) in self.lives.iter().enumerate() {
                    if *life == Life::Live {
                        self.queued.push_back(Step::Close { s });
                    }
                }
                self.queued.push_back(Step::Restart);
                for s in 0..self.lives.len() {
                    self.queued.push_back(Step::Reopen { s });
                }
                self.queued.pop_front().unwrap_or(Step::Restart)
            }
            982..=996 if live && !self.avoids("race") => {
                let others: Vec<usize> = (0..self.lives.len())
                    .filter(|o| *o != s && self.lives[*o] == Life::Live)
                    .collect();
                if others.is_empty() {
                    return read(ReadKind::Get, "/".to_string(), rng);
                }
                Step::Race {
                    w: s,
                    r: others[rng.random_range(0..others.len())],
                    path: self.pick_path(rng),
                    data: Self::data(rng),
                }
            }
            _ => read(ReadKind::Get, "/".to_string(), rng),
        }
    }

    /// Gives the slot of a reopened session its new number.
    fn before(&mut self, step: &Step) {
        if let Step::Reopen { s } = step {
            self.numbers[*s] = self.next_number;
            self.next_number += 1;
        }
    }

    fn saw(&mut self, path: &str, stat: &Stat) {
        self.known.insert(path.to_string());
        self.versions.insert(path.to_string(), stat.version);
        if stat.ephemeral_owner != 0 {
            self.ephemeral.insert(path.to_string());
        } else {
            self.ephemeral.remove(path);
        }
    }

    fn saw_created(&mut self, path: &str, ephemeral: bool) {
        self.known.insert(path.to_string());
        self.versions.insert(path.to_string(), 0);
        if ephemeral {
            self.ephemeral.insert(path.to_string());
        } else {
            self.ephemeral.remove(path);
        }
    }

    fn gone(&mut self, path: &str) {
        self.versions.remove(path);
        self.ephemeral.remove(path);
    }

    /// Learns from the (agreed) reply what a caller would learn.
    fn after(&mut self, step: &Step, reply: &Reply) {
        match (step, reply) {
            (Step::Close { s }, _) if self.lives[*s] == Life::Live => self.lives[*s] = Life::Closed,
            (Step::Expire { s }, _) => self.lives[*s] = Life::Expired,
            (Step::Reopen { s }, _) => self.lives[*s] = Life::Live,
            (_, Reply::Created(path, stat)) => self.saw(path, stat),
            (
                Step::Read { path, .. } | Step::Set { path, .. } | Step::Race { path, .. },
                Reply::Data(_, stat)
                | Reply::Exists(Some(stat))
                | Reply::Set(stat)
                | Reply::Children(_, stat),
            ) => self.saw(path, stat),
            (Step::Read { path, .. }, Reply::Exists(None)) => self.gone(path),
            (Step::Delete { path, .. }, Reply::Deleted) => self.gone(path),
            (_, Reply::Failed(CoordError::NoNode { path })) => self.gone(path),
            (Step::Multi { ops, .. }, Reply::Multi(results)) => {
                for (op, result) in ops.iter().zip(results) {
                    match result {
                        // A created node has version 0: all a caller may assume.
                        OpResult::Create { path } => {
                            let ephemeral =
                                matches!(op, Op::Create { mode, .. } if mode.is_ephemeral());
                            self.saw_created(path, ephemeral)
                        }
                        OpResult::Set { stat } => self.saw(op.path(), stat),
                        OpResult::Delete => self.gone(op.path()),
                        OpResult::Check => {}
                    }
                }
            }
            _ => {}
        }
    }
}

fn join(parent: &str, name: &str) -> String {
    if parent == "/" {
        format!("/{name}")
    } else {
        format!("{parent}/{name}")
    }
}

// ---------------------------------------------------------------------------
// A run

struct Failure {
    seed: u64,
    /// `FERRY_DIFF_AVOID` of the run, needed to replay it.
    avoid: String,
    op: usize,
    step: String,
    what: String,
    embedded: String,
    zookeeper: String,
    log: Vec<String>,
}

impl Failure {
    fn summary(&self) -> String {
        let mut step = self.step.clone();
        if step.len() > 110 {
            let mut cut = 107;
            while !step.is_char_boundary(cut) {
                cut -= 1;
            }
            step.truncate(cut);
            step.push_str("...");
        }
        format!("  seed {} op {}: {step}: {}", self.seed, self.op, self.what)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seed {}, op {}: the back-ends differ: {}",
            self.seed, self.op, self.what
        )?;
        writeln!(f, "  op:        {}", self.step)?;
        writeln!(f, "  embedded:  {}", self.embedded)?;
        writeln!(f, "  zookeeper: {}", self.zookeeper)?;
        let avoid = if self.avoid.is_empty() {
            String::new()
        } else {
            format!("FERRY_DIFF_AVOID={} ", self.avoid)
        };
        writeln!(
            f,
            "  replay:    {avoid}FERRY_DIFF_SEED={} cargo test -p ferry-coord --test differential -- --nocapture",
            self.seed
        )?;
        writeln!(f, "  the operations before it (embedded results):")?;
        for line in &self.log {
            writeln!(f, "    {line}")?;
        }
        Ok(())
    }
}

fn show_events(fired: &Fired, owners: &BTreeMap<i64, usize>) -> String {
    let events: Vec<String> = fired
        .iter()
        .map(|(id, (event, after))| {
            let after = after.as_ref().map_or(String::new(), |r| {
                format!(", then read {:?}", norm(r, owners))
            });
            format!("watch {id}: {:?} {:?}{after}", event.kind, event.path)
        })
        .collect();
    if events.is_empty() {
        "no watch fired".to_string()
    } else {
        events.join("; ")
    }
}

/// After a race: the racing read's watch fired if and only if the read did not
/// see the set.
fn check_race(world: &World, reply: &Reply, fired: &Fired) -> Result<(), String> {
    let (Some((id, read_mzxid)), Reply::Set(stat)) = (world.race, reply) else {
        return Ok(());
    };
    match (read_mzxid >= stat.mzxid, fired.get(&id)) {
        (true, Some((event, _))) => Err(format!(
            "the racing read saw the set, yet its watch {id} fired {:?} for it",
            event.kind
        )),
        (false, None) => Err(format!(
            "the racing read did not see the set, yet its watch {id} did not fire"
        )),
        _ => Ok(()),
    }
}

/// Compares the watches fired on both back-ends and what was read after them.
fn compare_events(
    order: &mut ZxidOrder,
    e: &Fired,
    z: &Fired,
    e_owners: &BTreeMap<i64, usize>,
    z_owners: &BTreeMap<i64, usize>,
) -> Result<(), String> {
    let ids: BTreeSet<u64> = e.keys().chain(z.keys()).copied().collect();
    for id in ids {
        match (e.get(&id), z.get(&id)) {
            (Some(_), None) => return Err(format!("watch {id} fired on the embedded store only")),
            (None, Some(_)) => return Err(format!("watch {id} fired on zookeeper only")),
            (Some((ee, ea)), Some((ze, za))) => {
                if (ee.kind, &ee.path) != (ze.kind, &ze.path) {
                    return Err(format!("watch {id} fired differently"));
                }
                match (ea, za) {
                    (Some(ea), Some(za)) => order
                        .compare(&norm(ea, e_owners), &norm(za, z_owners))
                        .map_err(|what| {
                            format!("the read after watch {id} fired differs: {what}")
                        })?,
                    (None, None) => {}
                    _ => return Err(format!("the read after watch {id} did not finish")),
                }
            }
            (None, None) => {}
        }
    }
    Ok(())
}

async fn run_seed(seed: u64, verbose: bool, avoid: &BTreeSet<String>) -> Result<(), Failure> {
    let mut rng = SmallRng::seed_from_u64(seed);
    // Small snapshot thresholds, so that restarts recover from snapshots too.
    let options = EmbeddedOptions {
        snapshot_every_txns: rng.random_range(2..=40),
        snapshot_log_bytes: rng.random_range(1024..=64 * 1024),
        ..EmbeddedOptions::default()
    };
    let sessions = rng.random_range(2..=3);
    let mut emb = World::new(Store::Embedded(
        Embedded::with_options(options.clone()).await,
    ));
    let Some(zk) = ZooKeeper::new().await else {
        return Ok(());
    };
    let connect = &zk.options().connect;
    let zk_prefix = connect.find('/').map_or(0, |i| connect.len() - i);
    let mut zk = World::new(Store::ZooKeeper(zk));
    let mut model = Model {
        lives: vec![Life::Live; sessions],
        numbers: (0..sessions).collect(),
        next_number: sessions,
        known: BTreeSet::new(),
        ephemeral: BTreeSet::new(),
        versions: BTreeMap::new(),
        avoid: avoid.clone(),
        queued: VecDeque::new(),
        zk_prefix,
    };
    for s in 0..sessions {
        emb.open(s, s).await;
        zk.open(s, s).await;
    }
    if verbose {
        eprintln!(
            "seed {seed}: {sessions} sessions, embedded snapshots every {} txns or {} log bytes",
            options.snapshot_every_txns, options.snapshot_log_bytes
        );
    }
    let mut order = ZxidOrder::default();
    let mut log: VecDeque<String> = VecDeque::new();
    let mut result = Ok(());
    for op in 0..OPS_PER_SEED {
        let step = model.next_step(&mut rng);
        model.before(&step);
        let e = emb.apply(&step, &model.numbers).await;
        let z = zk.apply(&step, &model.numbers).await;
        let live: Vec<bool> = step_lives(&step, &model.lives)
            .iter()
            .map(|l| *l == Life::Live)
            .collect();
        let (mut e_fired, mut z_fired) = collect_events(&mut emb, &mut zk, &live).await;
        let race = if matches!(step, Step::Race { .. }) {
            check_race(&emb, &e, &e_fired)
                .map_err(|what| format!("embedded store: {what}"))
                .and_then(|()| {
                    check_race(&zk, &z, &z_fired).map_err(|what| format!("zookeeper: {what}"))
                })
        } else {
            Ok(())
        };
        let racy: BTreeSet<u64> = emb.racy.union(&zk.racy).copied().collect();
        let (en, zn) = (norm(&e, &emb.owners), norm(&z, &zk.owners));
        let line = format!(
            "#{op} {step} => {en:?}; {}",
            show_events(&e_fired, &emb.owners)
        );
        if verbose {
            eprintln!("{line}");
        }
        let verdict = race
            .and_then(|()| order.compare(&en, &zn))
            .map_err(|what| (what, format!("{en:?}"), format!("{zn:?}")))
            .and_then(|()| {
                e_fired.retain(|id, _| !racy.contains(id));
                z_fired.retain(|id, _| !racy.contains(id));
                compare_events(&mut order, &e_fired, &z_fired, &emb.owners, &zk.owners).map_err(
                    |what| {
                        (
                            what,
                            format!("{en:?}; {}", show_events(&e_fired, &emb.owners)),
                            format!("{zn:?}; {}", show_events(&z_fired, &zk.owners)),
                        )
                    },
                )
            });
        if let Err((what, embedded, zookeeper)) = verdict {
            result = Err(Failure {
                seed,
                avoid: avoid.iter().cloned().collect::<Vec<_>>().join(","),
                op,
                step: step.to_string(),
                what,
                embedded,
                zookeeper,
                log: log.into_iter().collect(),
            });
            break;
        }
        model.after(&step, &e);
        log.push_back(line);
        if log.len() > LOG_TAIL {
            log.pop_front();
        }
    }
    emb.finish().await;
    zk.finish().await;
    result
}

/// The life of every slot once `step` is done (for the sessions to sync).
fn step_lives(step: &Step, lives: &[Life]) -> Vec<Life> {
    let mut lives = lives.to_vec();
    match step {
        Step::Close { s } => lives[*s] = Life::Closed,
        Step::Expire { s } => lives[*s] = Life::Expired,
        Step::Reopen { s } => lives[*s] = Life::Live,
        _ => {}
    }
    lives
}
