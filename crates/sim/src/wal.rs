//! The WAL random test: three safekeepers and a writer under a random schedule of
//! writes, crashes, restarts, partitions and disk stalls, checked against the
//! invariants of the WAL quorum.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_coord::{CoordError, SessionFactory};
use ferry_env::Disk;
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig};
use ferry_safekeeper::backup::{segment_key, BackupConfig};
use ferry_safekeeper::control::{PartialRemoteSegment, UploadStatus};
use ferry_safekeeper::partial::{PartialBackupConfig, PARTIAL_DIR};
use ferry_safekeeper::server::{SafekeeperServer, ServerConfig};
use ferry_safekeeper::wal_storage::Preallocation;
use ferry_wal::record::{self, Record};
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn};
use ferry_writer::driver::{encode_records, Writer, WriterConfig, WriterError, WriterStatus};
use ferry_writer::proposer::ProposerConfig;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::coord::CoordFaults;
use crate::disk::{CrashStats, SimDisk};
use crate::faults::Fault;
use crate::net::NetOptions;
use crate::objstore::ObjectFaults;
use crate::rogue::{RogueKind, RogueOutcome};
use crate::walreceiver::{self, SharedReceived};
use crate::world::World;

const SAFEKEEPERS: usize = 3;
const SEGMENT_BYTES: u64 = 64 << 10;
const TIMELINE: u64 = 1;

fn cluster_id() -> ClusterId {
    ClusterId::new("sim").unwrap_or_else(|_| unreachable!("a valid cluster id"))
}
/// After the faults stop, a write must commit within this (virtual) time.
const LIVENESS_BOUND: Duration = Duration::from_secs(60);

/// One scheduled fault or action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A fault of the world: node `i < 3` is safekeeper `i`; in a partition,
    /// node 3 is the current writer (whose node a writer started later does
    /// not share).
    Fault(Fault),
    /// Append `records` inserts of about `bytes` bytes each, one after another.
    Write { records: u32, bytes: usize },
    /// Kill the writer and start a new one (which must win a new term).
    RestartWriter,
    /// Start a new writer while the old one keeps running (a failover that did
    /// not kill it): one of them ends up elected, a writer superseded after its
    /// election stops, and nothing acknowledged by either is lost.
    TakeOver,
    /// A misbehaving proposer sends a safekeeper what it must refuse.
    Rogue { safekeeper: usize, kind: RogueKind },
    /// Safekeeper `i`'s data dir is lost (it is killed first if it runs); it
    /// is rebuilt from the backup, perhaps after restores that crash half
    /// way, and started. At most one per run: a second loss before the
    /// first one's WAL is everywhere again could lose committed WAL in any
    /// quorum system of three.
    LoseDisk(usize),
    /// A loss inside a split, the case a restored safekeeper's lost votes
    /// matter in: the current writer is cut off from `b` and `lost`, a
    /// takeover's writer from `a` (so it is elected by `b` and `lost`, and
    /// commits on them), then `lost` loses its data dir and is restored, the
    /// old writer can reach it again, and a third writer that knows no
    /// commit starts, cut off from `b`. Neither may get a quorum with the
    /// restored safekeeper: the old one still reaches `a`, which never heard
    /// of the new term, and the third one would be elected by `a` and the
    /// restored one, which lack what the new writer committed.
    SplitLoss { lost: usize, a: usize, b: usize },
    /// Safekeeper `i` crashes at its next put or delete of one of its partial
    /// objects (within a few seconds): as the request starts (`applied`
    /// false) or right after it took effect, so that crashes land in every
    /// gap of the partial upload protocol; it restarts at once.
    CrashInPartialUpload { safekeeper: usize, applied: bool },
}

/// A schedule: events at virtual times, plus the network settings.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub events: Vec<(Duration, Event)>,
    pub net: NetOptions,
}

/// Draws a schedule from a seed: 1 to 99 events, 0 to 500 ms apart, actions
/// chosen uniformly; delays up to 50 ms, and up to 2% of writes breaking a link.
pub fn generate_schedule(rng: &mut SmallRng) -> Schedule {
    let max_delay = rng.random_range(1..=50u64);
    let min_delay = rng.random_range(0..=max_delay);
    let break_prob = if rng.random_bool(0.5) {
        rng.random_range(0.0..0.02)
    } else {
        0.0
    };
    let net = NetOptions {
        min_delay: Duration::from_millis(min_delay),
        max_delay: Duration::from_millis(max_delay),
        break_prob,
        connect_fail_prob: break_prob * 5.0,
        connect_timeout: Duration::from_millis(500),
    };
    let count = rng.random_range(1..100usize);
    let mut at = Duration::ZERO;
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        at += Duration::from_millis(rng.random_range(0..500));
        let event = match rng.random_range(0..8u32) {
            // Mostly small records; sometimes one larger than a segment
            // (64 KiB), which spans segments and makes a bulk fsync.
            0 | 1 if rng.random_bool(0.1) => Event::Write {
                records: 1,
                bytes: rng.random_range(20_000..200_000),
            },
            0 | 1 => Event::Write {
                records: rng.random_range(1..10),
                bytes: rng.random_range(16..4000),
            },
            2 => Event::Fault(Fault::Crash(rng.random_range(0..SAFEKEEPERS))),
            3 => Event::Fault(Fault::Restart(rng.random_range(0..SAFEKEEPERS))),
            4 if rng.random_bool(0.3) => Event::TakeOver,
            4 => Event::RestartWriter,
            5 => {
                if rng.random_bool(0.5) {
                    let a = rng.random_range(0..=SAFEKEEPERS);
                    let b = (a + rng.random_range(1..=SAFEKEEPERS)) % (SAFEKEEPERS + 1);
                    Event::Fault(Fault::Partition(a, b))
                } else {
                    Event::Fault(Fault::RepairPartitions)
                }
            }
            6 if rng.random_bool(0.2) => {
                Event::Fault(Fault::DiskFailure(rng.random_range(0..SAFEKEEPERS)))
            }
            7 => Event::Rogue {
                safekeeper: rng.random_range(0..SAFEKEEPERS),
                kind: RogueKind::ALL[rng.random_range(0..RogueKind::ALL.len())],
            },
            _ => Event::Fault(Fault::DiskStall {
                node: rng.random_range(0..SAFEKEEPERS),
                millis: rng.random_range(1..2000),
            }),
        };
        events.push((at, event));
    }
    Schedule { events, net }
}

/// Adds one [`Event::LoseDisk`] to half of the schedules, drawn from its own
/// generator so that the rest of every schedule stays what the seed made
/// before disk losses existed (regression seeds keep their meaning).
pub fn add_disk_loss(schedule: &mut Schedule, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x1055_D15C_0000_0000);
    let Some(&(last, _)) = schedule.events.last() else {
        return;
    };
    if !rng.random_bool(0.5) {
        return;
    }
    let at = Duration::from_millis(rng.random_range(0..=last.as_millis() as u64));
    let lost = rng.random_range(0..SAFEKEEPERS);
    let mut added = vec![(at, Event::LoseDisk(lost))];
    if rng.random_bool(0.4) {
        let a = (lost + rng.random_range(1..SAFEKEEPERS)) % SAFEKEEPERS;
        let b = (0..SAFEKEEPERS).find(|&k| k != lost && k != a).unwrap_or(a);
        added = vec![(at, Event::SplitLoss { lost, a, b })];
    }
    for (at, event) in added {
        let index = schedule.events.partition_point(|(t, _)| *t <= at);
        schedule.events.insert(index, (at, event));
    }
}

/// Adds up to three [`Event::CrashInPartialUpload`] to a schedule, drawn from
/// a generator of their own (as [`add_disk_loss`]).
pub fn add_partial_crashes(schedule: &mut Schedule, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x9A27_1A1C_0000_0000);
    let Some(&(last, _)) = schedule.events.last() else {
        return;
    };
    for _ in 0..rng.random_range(0..=3) {
        let at = Duration::from_millis(rng.random_range(0..=last.as_millis() as u64));
        let event = Event::CrashInPartialUpload {
            safekeeper: rng.random_range(0..SAFEKEEPERS),
            applied: rng.random_bool(0.5),
        };
        let index = schedule.events.partition_point(|(t, _)| *t <= at);
        schedule.events.insert(index, (at, event));
    }
}

/// What one seed did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub seed: u64,
    pub events: usize,
    pub simulated: Duration,
    pub acknowledged: usize,
    pub elections: usize,
    pub commit_lsn: Lsn,
    /// crc32c of the event log: equal for equal runs.
    pub log_hash: u32,
    /// What the safekeeper crashes found on their disks, summed.
    pub crash_stats: CrashStats,
    pub log: Vec<String>,
}

pub use crate::world::Failure;

fn node_name(i: usize) -> String {
    format!("sk{i}")
}

/// Each writer incarnation runs on a node of its own (another machine), so a
/// partition can cut an old writer off while a new one takes over.
fn writer_node(incarnation: u64) -> String {
    format!("writer{incarnation}")
}

/// The deterministic payload of insert `block`.
fn insert_record(block: u64, bytes: usize) -> Record {
    let mut payload = Vec::with_capacity(bytes + 8);
    payload.extend_from_slice(&block.to_le_bytes());
    payload.extend((0..bytes).map(|i| (block as usize * 31 + i) as u8));
    Record::Insert {
        shard: 0,
        idempotency_key: bytes::Bytes::new(),
        table_id: 1,
        block_number: block,
        arrow_ipc: Bytes::from(payload),
    }
}

fn payload_is_intact(block: u64, arrow_ipc: &Bytes) -> bool {
    arrow_ipc.len() >= 8
        && arrow_ipc[..8] == block.to_le_bytes()
        && arrow_ipc[8..]
            .iter()
            .enumerate()
            .all(|(i, b)| *b == (block as usize * 31 + i) as u8)
}

/// (writer incarnation, block, outcome) of one append.
type AppendResult = (u64, u64, Result<Lsn, WriterError>);

struct Sim {
    /// Network, disks, coordination, object storage, clock and the event log.
    world: World,
    /// Safekeeper `i`'s disk (the world's disk of node `sk<i>`).
    disks: Vec<SimDisk>,
    servers: Vec<Option<Arc<SafekeeperServer>>>,
    /// The WAL preallocation policy each safekeeper was last started with (drawn
    /// at every start: preallocated and growing segments, and switches between
    /// them across restarts, all meet crashes).
    preallocation: Vec<Preallocation>,
    writer: Option<Arc<Writer>>,
    status: Option<watch::Receiver<WriterStatus>>,
    /// Writers replaced by a takeover and still running, by incarnation.
    old_writers: BTreeMap<u64, (Arc<Writer>, watch::Receiver<WriterStatus>)>,
    writers_started: u64,
    pending_writes: Vec<tokio::task::JoinHandle<()>>,
    next_block: u64,
    acked: BTreeMap<u64, Lsn>,
    /// Blocks whose append failed (not acknowledged: outcome unknown).
    not_acked: BTreeSet<u64>,
    results: (
        mpsc::UnboundedSender<AppendResult>,
        mpsc::UnboundedReceiver<AppendResult>,
    ),
    /// Highest LSN known committed (acknowledgements and writer reports).
    committed: Lsn,
    /// Highest LSN each writer incarnation got committed.
    committed_by: BTreeMap<u64, Lsn>,
    /// The election of each writer incarnation: (term, epoch start).
    elected: BTreeMap<u64, (u64, Lsn)>,
    /// Which incarnation was elected in each term (at most one).
    term_owner: BTreeMap<u64, u64>,
    /// Highest end of WAL any writer produced.
    produced: Lsn,
    elections: usize,
    /// What the simulated replica received through walsenders.
    received: SharedReceived,
    /// Per safekeeper: the highest term seen (across restarts: it is
    /// persisted) and the commit_lsn seen in its current incarnation.
    seen_terms: Vec<u64>,
    seen_commits: Vec<Lsn>,
    /// Sessions of the "control" node that reads the known commit, and its
    /// current session.
    control_sessions: crate::coord::SimSessions,
    control: Option<ferry_coord::Session>,
    /// What the recorder writes to coordination as the known commit.
    committed_tx: watch::Sender<Lsn>,
    /// The safekeeper whose data dir was lost, and the WAL its restore put
    /// back (checked at the end against the committed WAL).
    restored: Option<(usize, Bytes)>,
    /// The safekeeper whose data dir was lost and whose restore has not
    /// succeeded yet (the backup may lack what it needs until the others
    /// upload it): it stays down, and the restore is tried again between
    /// events, as an operator would retry, while the world goes on.
    restoring: Option<usize>,
}

/// Where the known commit lives in coordination (as in `ferry dev`).
const KNOWN_COMMIT_PATH: &str = "/known_commit";

fn decode_lsn(data: &[u8]) -> Lsn {
    let mut b = [0u8; 8];
    if data.len() == 8 {
        b.copy_from_slice(data);
    }
    Lsn(u64::from_le_bytes(b))
}

/// Keeps the known commit in coordination near what the writers committed:
/// the recorder of `ferry dev`, on simulated coordination (requests may be
/// lost before or after they apply; it writes again on the next change).
async fn record_commits(sessions: crate::coord::SimSessions, mut committed: watch::Receiver<Lsn>) {
    use ferry_coord::CreateMode;
    let mut session: Option<ferry_coord::Session> = None;
    loop {
        if committed.changed().await.is_err() {
            return;
        }
        let lsn = *committed.borrow_and_update();
        let s = match session.clone() {
            Some(s) => s,
            None => match sessions.open().await {
                Ok(s) => {
                    session = Some(Arc::clone(&s));
                    s
                }
                Err(_) => continue,
            },
        };
        let data = lsn.0.to_le_bytes();
        let written = match s.set(KNOWN_COMMIT_PATH, &data, None).await {
            Err(CoordError::NoNode { .. }) => s
                .create(KNOWN_COMMIT_PATH, &data, CreateMode::Persistent)
                .await
                .map(drop),
            other => other.map(drop),
        };
        if let Err(e) = written {
            if e.is_session_end() {
                session = None;
            }
        }
    }
}

impl Sim {
    fn log(&mut self, msg: impl AsRef<str>) {
        self.world.log(msg);
    }

    /// Invariants of every running (not failed) safekeeper, checked at every step of the
    /// run (not only from a final status): commit_lsn never passes flush_lsn,
    /// the term never goes back (not even across a restart), and commit_lsn
    /// never goes back within one incarnation.
    async fn check_safekeepers(&mut self) -> Result<(), Failure> {
        for i in 0..SAFEKEEPERS {
            let Some(server) = self.servers[i].clone() else {
                continue;
            };
            let (term, flush, commit) = server.positions().await;
            if server.failure().borrow().is_some() {
                // Stopped on a disk error (perhaps while we waited for its
                // lock): its memory may be ahead of its disk, which is exactly
                // why it answers nothing any more.
                continue;
            }
            if commit > flush {
                return Err(self.fail(format!(
                    "sk{i}: commit_lsn {commit} is beyond its flush_lsn {flush}"
                )));
            }
            if term < self.seen_terms[i] {
                return Err(self.fail(format!(
                    "sk{i}: term went back from {} to {term}",
                    self.seen_terms[i]
                )));
            }
            if commit < self.seen_commits[i] {
                return Err(self.fail(format!(
                    "sk{i}: commit_lsn went back from {} to {commit}",
                    self.seen_commits[i]
                )));
            }
            self.seen_terms[i] = term;
            self.seen_commits[i] = commit;
            // One snapshot: both positions move while the checker waits.
            let status = server.status().await;
            let backup: Lsn = status
                .backup_lsn
                .parse()
                .map_err(|e: String| self.fail(e))?;
            let commit: Lsn = status
                .commit_lsn
                .parse()
                .map_err(|e: String| self.fail(e))?;
            let removed = Lsn(status.last_removed_segno * SEGMENT_BYTES);
            if backup > commit {
                return Err(self.fail(format!(
                    "sk{i}: backup_lsn {backup} is beyond its commit_lsn {commit}"
                )));
            }
            if removed > backup {
                return Err(self.fail(format!(
                    "sk{i}: removed WAL below {removed}, beyond backup_lsn {backup}"
                )));
            }
            // Partial objects: the entries before and after the listing (an
            // entry outlives its object on both sides).
            let before = server.partial_segments().await;
            let objects = self.partial_objects().await?;
            let after = server.partial_segments().await;
            self.check_one_uploaded(i, &after)?;
            let mut entries = after;
            entries.extend(before);
            self.check_partial_orphans(i, &objects, &entries)?;
            // The replica registered itself with its first feedback; it has
            // reported at most what it received so far.
            let received = walreceiver::lock(&self.received).wal.len() as u64;
            if removed.0 > received {
                return Err(self.fail(format!(
                    "sk{i}: removed WAL below {removed}, which the replica has not applied (it received {received} bytes)"
                )));
            }
        }
        Ok(())
    }

    /// A walsender broke an invariant (seen by the simulated replica).
    fn check_walsenders(&self) -> Result<(), Failure> {
        let received = walreceiver::lock(&self.received);
        match received.violations.first() {
            Some(v) => Err(self.fail(v.clone())),
            None => Ok(()),
        }
    }

    fn fail(&self, reason: impl Into<String>) -> Failure {
        self.world.fail(reason)
    }

    /// The cluster's backup as it really is (no faults): what checks read.
    fn truth(&self) -> Result<ferry_storage::Location, Failure> {
        ferry_storage::Location::from_store("sim://truth", self.world.lake_store.truth(), "")
            .and_then(|root| ferry_safekeeper::backup::cluster_folder(&root, &cluster_id()))
            .map_err(|e| self.fail(e.to_string()))
    }

    /// Names of the partial objects the backup really holds.
    async fn partial_objects(&self) -> Result<Vec<String>, Failure> {
        let truth = self.truth()?;
        let listed = truth
            .list(PARTIAL_DIR)
            .await
            .map_err(|e| self.fail(format!("listing the partial objects: {e}")))?;
        Ok(listed
            .into_iter()
            .map(|(key, _)| key.rsplit('/').next().unwrap_or_default().to_string())
            .collect())
    }

    /// Every partial object of safekeeper `i` must be named by `entries` (its
    /// control file's list).
    fn check_partial_orphans(
        &self,
        i: usize,
        objects: &[String],
        entries: &[PartialRemoteSegment],
    ) -> Result<(), Failure> {
        let suffix = format!("_sk{i}.partial");
        for object in objects.iter().filter(|o| o.ends_with(&suffix)) {
            if !entries.iter().any(|e| &e.name == object) {
                return Err(self.fail(format!(
                    "sk{i}: partial object {object} is in the backup but not in its control file (an orphan)"
                )));
            }
        }
        Ok(())
    }

    /// At most one entry of one control file's list is `Uploaded`.
    fn check_one_uploaded(
        &self,
        i: usize,
        entries: &[PartialRemoteSegment],
    ) -> Result<(), Failure> {
        let uploaded = entries
            .iter()
            .filter(|e| e.status == UploadStatus::Uploaded)
            .count();
        if uploaded > 1 {
            return Err(self.fail(format!(
                "sk{i}: {uploaded} partial entries are Uploaded (at most one may be)"
            )));
        }
        Ok(())
    }

    /// Segment `segno` as the backup really holds it (no faults), if whole.
    async fn backup_segment(&self, segno: u64) -> Option<Bytes> {
        let truth = self.truth().ok()?;
        let object = truth.get(&segment_key(Self::segment(), segno)).await.ok()?;
        (object.len() as u64 == SEGMENT_BYTES).then_some(object)
    }

    fn segment() -> SegmentSize {
        SegmentSize::new(SEGMENT_BYTES)
            .unwrap_or_else(|_| unreachable!("64 KiB is a valid segment size"))
    }

    fn acceptor_config(&self, i: usize) -> AcceptorConfig {
        AcceptorConfig {
            cluster_id: cluster_id(),
            node_id: i as u64,
            timeline_id: TIMELINE,
            segment_size: Self::segment(),
            preallocation: self.preallocation[i],
        }
    }

    /// Creates safekeeper `i` on its empty disk (once, when the cluster is made).
    async fn create_acceptor(&self, i: usize) -> Result<(), Failure> {
        let disk: Arc<dyn Disk> = Arc::new(self.disks[i].clone());
        Acceptor::create(disk, &format!("sk{i}"), self.acceptor_config(i))
            .await
            .map(drop)
            .map_err(|e| self.fail(format!("sk{i} cannot be created: {e}")))
    }

    /// Opens safekeeper `i`'s acceptor from its disk, as a restart does: it
    /// must find its control file and every WAL record below its commit point.
    async fn open_acceptor(&self, i: usize) -> Result<Acceptor, Failure> {
        let disk: Arc<dyn Disk> = Arc::new(self.disks[i].clone());
        Acceptor::open(disk, &format!("sk{i}"), self.acceptor_config(i))
            .await
            .map_err(|e| self.fail(format!("sk{i} cannot recover from its disk: {e}")))
    }

    async fn start_safekeeper(&mut self, i: usize) -> Result<(), Failure> {
        if self.restoring == Some(i) {
            self.log(format!("sk{i} waits for its restore"));
            return Ok(());
        }
        // A restart comes with a repaired disk.
        self.disks[i].set_failing(false);
        self.preallocation[i] = match self.world.rng.random_range(0..4) {
            0 => Preallocation::Always,
            1 => Preallocation::Never,
            _ => Preallocation::Auto,
        };
        // Backup and removal settings are drawn at every start too.
        let config = ServerConfig {
            backup: Some(BackupConfig {
                location: self.world.lake.clone(),
                parallel_jobs: self.world.rng.random_range(1..=4),
            }),
            walsenders_keep_horizon: self.world.rng.random_bool(0.5),
            removal_interval: Duration::from_millis(self.world.rng.random_range(100..=2000)),
            remove_wal: true,
            restore_quarantine: Duration::from_secs(5),
            replica_expiry: ferry_safekeeper::server::DEFAULT_REPLICA_EXPIRY,
            partial_backup: self
                .world
                .rng
                .random_bool(0.7)
                .then(|| PartialBackupConfig {
                    timeout: Duration::from_millis(self.world.rng.random_range(100..=3000)),
                }),
        };
        let described = format!(
            "WAL preallocation {}, {} backup jobs, keep-horizon {}, removal every {:?}, partial backup {:?}",
            self.preallocation[i],
            config.backup.as_ref().map_or(0, |b| b.parallel_jobs),
            config.walsenders_keep_horizon,
            config.removal_interval,
            config.partial_backup.map(|p| p.timeout)
        );
        let listener = self
            .world
            .net
            .node(&node_name(i))
            .bind(&node_name(i))
            .await
            .map_err(|e| self.fail(format!("sk{i} cannot listen: {e}")))?;
        let disk: Arc<dyn Disk> = Arc::new(self.disks[i].clone());
        let server = ferry_node::start_safekeeper(
            disk,
            &format!("sk{i}"),
            ferry_node::SafekeeperOpen::Open,
            self.acceptor_config(i),
            listener,
            config,
        )
        .await
        .map_err(|e| match e {
            ferry_node::SafekeeperNodeError::State(e) => {
                self.fail(format!("sk{i} cannot recover from its disk: {e}"))
            }
            ferry_node::SafekeeperNodeError::Serve(e) => {
                self.fail(format!("sk{i} cannot listen: {e}"))
            }
        })?;
        self.servers[i] = Some(Arc::new(server));
        // A new incarnation restarts from its persisted commit_lsn.
        self.seen_commits[i] = Lsn(0);
        self.log(format!("sk{i} started ({described})"));
        Ok(())
    }

    /// Loses safekeeper `i`'s data dir and rebuilds it from the backup (a
    /// restore may crash half way, or find the backup incomplete; it is
    /// tried again later, see [`Sim::try_restore`]).
    async fn lose_disk(&mut self, i: usize) -> Result<(), Failure> {
        if self.restored.is_some() || self.restoring.is_some() {
            self.log(format!(
                "sk{i} keeps its disk: one data dir is lost per run"
            ));
            return Ok(());
        }
        self.crash_safekeeper(i).await;
        self.disks[i].lose(&node_name(i));
        self.disks[i].set_failing(false);
        self.log(format!("sk{i} lost its data dir"));
        self.restoring = Some(i);
        self.try_restore().await
    }

    /// One attempt to rebuild the lost safekeeper from the backup; on
    /// success it starts. A failed or crashed attempt leaves it down for the
    /// next one.
    async fn try_restore(&mut self) -> Result<(), Failure> {
        let Some(i) = self.restoring else {
            return Ok(());
        };
        // Each attempt comes with a working disk (one that failed meanwhile
        // was replaced).
        self.disks[i].set_failing(false);
        let disk: Arc<dyn Disk> = Arc::new(self.disks[i].clone());
        let config = self.acceptor_config(i);
        let dir = node_name(i);
        let restore = ferry_safekeeper::restore::restore_from_backup(
            Arc::clone(&disk),
            &dir,
            &config,
            &self.world.lake,
        );
        let crash_after = self
            .world
            .rng
            .random_bool(0.3)
            .then(|| Duration::from_millis(self.world.rng.random_range(0..300)));
        let result = match crash_after {
            Some(after) => tokio::select! {
                r = restore => Some(r),
                () = tokio::time::sleep(after) => None,
            },
            None => Some(restore.await),
        };
        let report = match result {
            Some(Ok(report)) => report,
            Some(Err(ferry_safekeeper::restore::RestoreError::Exists(path))) => {
                return Err(self.fail(format!("sk{i}: the restore found {path} on a lost disk")));
            }
            Some(Err(e)) => {
                self.log(format!("sk{i} restore failed: {e}"));
                return Ok(());
            }
            None => {
                self.world.crash_disk(&node_name(i));
                self.log(format!("sk{i} crashed while restoring"));
                return Ok(());
            }
        };
        let acceptor = self.open_acceptor(i).await?;
        let restored = acceptor
            .wal_reader()
            .read_all(Lsn(0), report.restored_lsn)
            .await
            .map_err(|e| self.fail(format!("sk{i} cannot read its restored WAL: {e}")))?;
        drop(acceptor);
        self.log(format!(
            "sk{i} restored {} whole segments and partial {:?}: WAL up to {}",
            report.whole_segments, report.partial, report.restored_lsn
        ));
        self.restored = Some((i, restored));
        self.restoring = None;
        // It forgot its terms: the restored one starts from term 0.
        self.seen_terms[i] = 0;
        self.start_safekeeper(i).await
    }

    /// See [`Event::CrashInPartialUpload`].
    async fn crash_in_partial_upload(&mut self, i: usize, applied: bool) -> Result<(), Failure> {
        let Some(server) = self.servers[i].clone() else {
            return Ok(());
        };
        let mine = format!("_sk{i}.partial");
        let mut events = self.world.lake_store.subscribe();
        events.borrow_and_update();
        let seen = tokio::time::timeout(
            Duration::from_secs(3),
            events.wait_for(|e| e.key.ends_with(&mine) && e.applied == applied),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .map(|e| e.clone());
        let Some(event) = seen else {
            self.log(format!("sk{i} made no partial upload step in 3 s"));
            return Ok(());
        };
        // Nothing else runs in between: the safekeeper is killed before its
        // next step.
        server.kill().await;
        self.servers[i] = None;
        self.world.crash_disk(&node_name(i));
        self.log(format!(
            "sk{i} crashed {} {} of {}",
            if event.applied {
                "right after"
            } else {
                "as it sent"
            },
            if event.delete {
                "the delete"
            } else {
                "the put"
            },
            event.key
        ));
        self.start_safekeeper(i).await
    }

    /// See [`Event::SplitLoss`].
    async fn split_loss(&mut self, lost: usize, a: usize, b: usize) -> Result<(), Failure> {
        if self.restored.is_some() || self.restoring.is_some() {
            return Ok(());
        }
        let old = writer_node(self.writers_started);
        self.world.partition(&old, &node_name(b));
        self.world.partition(&old, &node_name(lost));
        self.take_over().await?;
        let new = writer_node(self.writers_started);
        self.world.partition(&new, &node_name(a));
        let incarnation = self.writers_started;
        let deadline = Instant::now() + Duration::from_secs(3);
        while !self.elected.contains_key(&incarnation) && Instant::now() < deadline {
            self.run_until((Instant::now() + Duration::from_millis(50)).min(deadline))
                .await?;
        }
        // The new writer commits on `b` and `lost` alone.
        self.write(5, 100);
        let until = Instant::now() + Duration::from_secs(1);
        self.run_until(until).await?;
        self.lose_disk(lost).await?;
        self.world.heal(&old, &node_name(lost));
        // A third writer, which knows no commit (a deployment without
        // coordination), cannot reach `b`: it must not be elected by `a` and
        // the restored safekeeper, which hold none of what the new writer
        // committed.
        if let (Some(writer), Some(status)) = (self.writer.take(), self.status.take()) {
            self.old_writers
                .insert(self.writers_started, (writer, status));
        }
        self.start_writer_knowing(Lsn(0));
        let third = writer_node(self.writers_started);
        self.world.partition(&third, &node_name(b));
        // The split holds past the quarantine while the old writer tries to
        // write: it must not commit anything.
        if let Some((writer, _)) = self.old_writers.get(&(incarnation - 1)) {
            let writer = Arc::clone(writer);
            self.write_through(writer, incarnation - 1, 5, 100);
        }
        let until = Instant::now() + Duration::from_secs(8);
        self.run_until(until).await
    }

    async fn crash_safekeeper(&mut self, i: usize) {
        if let Some(server) = self.servers[i].take() {
            // Most crashes wait for the next write, so they land between it and
            // its fsync (an idle disk holds nothing unsynced to lose).
            if self.world.rng.random_bool(0.7)
                && self.disks[i]
                    .wait_for_unsynced_write(Duration::from_secs(1))
                    .await
            {
                self.log(format!("sk{i} crashes right after a write"));
            }
            server.kill().await;
            self.world.crash_disk(&node_name(i));
            self.log(format!("sk{i} crashed"));
        }
    }

    /// The commit the cluster is known to have reached, as `ferry dev` reads it
    /// from its coordination store before it starts a writer: here from the
    /// simulated coordination, which may lose requests (then it retries).
    async fn known_commit(&mut self) -> Result<Lsn, Failure> {
        for _ in 0..100 {
            let session = match self.control.clone() {
                Some(s) => s,
                None => match self.control_sessions.open().await {
                    Ok(s) => {
                        self.control = Some(Arc::clone(&s));
                        s
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            match session.get(KNOWN_COMMIT_PATH).await {
                Ok((data, _)) => return Ok(decode_lsn(&data)),
                Err(CoordError::NoNode { .. }) => return Ok(Lsn(0)),
                Err(e) if e.is_session_end() => self.control = None,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        Err(self.fail("coordination did not answer a read in 100 tries"))
    }

    async fn start_writer(&mut self) -> Result<(), Failure> {
        let known = self.known_commit().await?;
        self.start_writer_knowing(known);
        Ok(())
    }

    fn start_writer_knowing(&mut self, known: Lsn) {
        self.writers_started += 1;
        let mut config = WriterConfig::new(
            (0..SAFEKEEPERS).map(node_name).collect(),
            ProposerConfig::new(
                cluster_id(),
                SAFEKEEPERS,
                TIMELINE,
                SEGMENT_BYTES,
                u128::from(self.writers_started),
            ),
        );
        config.reconnect_delay = Duration::from_millis(50);
        config.peer_timeout = Duration::from_secs(1);
        config.election_timeout = Duration::from_secs(2);
        config.proposer.max_append_bytes = 16 << 10;
        // In a quarter of the runs, recovery reads of a few KiB, so that
        // catching a safekeeper up takes several reads that crashes,
        // partitions and refusals can land between. Picked from the seed
        // and the incarnation, not drawn, so the world's random choices stay
        // as they were, and the other runs are unchanged.
        let run = self.world.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 62 == 0;
        config.proposer.max_read_wal_bytes = match (run, self.writers_started % 3) {
            (false, _) => ferry_wal::proto::MAX_READ_WAL_BYTES,
            (true, 0) => 4099,
            (true, 1) => 20_011,
            (true, _) => 65_537,
        };
        // As `ferry dev` does from its coordination store: the writer knows a
        // commit point (recorded there by the recorder). Committed WAL is on
        // every quorum, so this must never block an election.
        config.proposer.known_commit_lsn = known;
        let writer = Writer::start(
            self.world.net.node(&writer_node(self.writers_started)),
            config,
        );
        self.status = Some(writer.subscribe());
        self.writer = Some(Arc::new(writer));
        self.log(format!(
            "writer {} started, knowing commit {known} from coordination",
            self.writers_started
        ));
    }

    fn kill_writer(&mut self) {
        if let Some(status) = &self.status {
            let s = status.borrow().clone();
            let _ = self.observe(self.writers_started, &s);
        }
        if let Some(writer) = self.writer.take() {
            writer.abort();
            self.log(format!("writer {} killed", self.writers_started));
        }
        self.status = None;
    }

    /// The current writer stopped on its own (superseded, perhaps by the term
    /// of a writer long dead): like a process supervisor, start a new one.
    /// Writers replaced by a takeover have no supervisor.
    async fn restart_stopped_writer(&mut self) -> Result<(), Failure> {
        if self.writer.take().is_some() {
            self.log(format!(
                "writer {} stopped; its supervisor starts a new one",
                self.writers_started
            ));
            self.start_writer().await?;
        }
        Ok(())
    }

    /// A takeover: the current writer keeps running while a new one starts.
    async fn take_over(&mut self) -> Result<(), Failure> {
        if let (Some(writer), Some(status)) = (self.writer.take(), self.status.take()) {
            self.old_writers
                .insert(self.writers_started, (writer, status));
        }
        self.start_writer().await
    }

    /// Kills every writer replaced by a takeover.
    fn kill_old_writers(&mut self) -> Result<(), Failure> {
        self.observe_old_writers()?;
        for (incarnation, (writer, _)) in std::mem::take(&mut self.old_writers) {
            writer.abort();
            self.log(format!("writer {incarnation} killed"));
        }
        Ok(())
    }

    /// Checks what the writers replaced by a takeover report now; one that
    /// stopped (superseded) is checked a last time and forgotten.
    fn observe_old_writers(&mut self) -> Result<(), Failure> {
        let mut changed = Vec::new();
        let mut stopped = Vec::new();
        for (i, (_, rx)) in self.old_writers.iter_mut() {
            match rx.has_changed() {
                Ok(true) => changed.push((*i, rx.borrow_and_update().clone())),
                Ok(false) => {}
                Err(_) => {
                    changed.push((*i, rx.borrow().clone()));
                    stopped.push(*i);
                }
            }
        }
        for (i, s) in changed {
            self.observe(i, &s)?;
        }
        for i in stopped {
            self.old_writers.remove(&i);
            self.log(format!("writer {i} stopped"));
        }
        Ok(())
    }

    /// The status of incarnation `writer`, if it still runs.
    fn status_of(&self, writer: u64) -> Option<WriterStatus> {
        if writer == self.writers_started {
            return self.status.as_ref().map(|rx| rx.borrow().clone());
        }
        self.old_writers
            .get(&writer)
            .map(|(_, rx)| rx.borrow().clone())
    }

    /// Highest LSN committed by writers elected in terms below `term`.
    fn committed_below(&self, term: u64) -> Lsn {
        self.committed_by
            .iter()
            .filter(|(w, _)| self.elected.get(w).is_some_and(|(t, _)| *t < term))
            .map(|(_, l)| *l)
            .max()
            .unwrap_or(Lsn(0))
    }

    /// Records that `writer` got `lsn` committed, checking it against every
    /// election of a higher term: they must all have started at or above it
    /// (whenever they happened, as writers may run side by side).
    fn record_commit(&mut self, writer: u64, lsn: Lsn) -> Result<(), Failure> {
        let Some(&(my_term, _)) = self.elected.get(&writer) else {
            return Err(self.fail(format!(
                "writer {writer} committed {lsn} without having been seen elected"
            )));
        };
        let entry = self.committed_by.entry(writer).or_insert(Lsn(0));
        *entry = (*entry).max(lsn);
        if let Some((later, (term, epoch))) = self
            .elected
            .iter()
            .find(|(_, (t, e))| *t > my_term && *e < lsn)
        {
            return Err(self.fail(format!(
                "writer {later} was elected in term {term} at {epoch}, below {lsn} committed by writer {writer} in term {my_term}: committed WAL lost"
            )));
        }
        if lsn > self.committed {
            self.committed = lsn;
            self.committed_tx.send_replace(lsn);
        }
        self.produced = self.produced.max(lsn);
        Ok(())
    }

    /// Checks the status of writer incarnation `writer` against what is known to
    /// be committed and produced.
    fn observe(&mut self, writer: u64, s: &WriterStatus) -> Result<(), Failure> {
        let parse = |v: &str| {
            v.parse::<Lsn>()
                .map_err(|e| self.fail(format!("bad status LSN: {e}")))
        };
        let end = parse(&s.end_lsn)?;
        let commit = parse(&s.commit_lsn)?;
        let epoch = parse(&s.epoch_start_lsn)?;
        // A superseded writer was elected in its term, even if the status that
        // showed it elected was overwritten before it could be looked at.
        let was_elected = s.elected || s.superseded_by.is_some();
        if was_elected && !self.elected.contains_key(&writer) {
            if let Some(other) = self.term_owner.insert(s.term, writer) {
                return Err(self.fail(format!(
                    "writers {other} and {writer} were both elected in term {}",
                    s.term
                )));
            }
            self.elections += 1;
            self.log(format!(
                "writer {writer} elected in term {} at epoch start {epoch}",
                s.term
            ));
            let before = self.committed_below(s.term);
            if epoch < before {
                return Err(self.fail(format!(
                    "election of term {} starts at {epoch}, below the committed {before}: committed WAL lost",
                    s.term
                )));
            }
            // Writers side by side: the other one may have produced WAL since
            // its status was last looked at.
            let ends: Vec<String> = self
                .old_writers
                .values()
                .map(|(_, rx)| rx.borrow().end_lsn.clone())
                .chain(self.status.iter().map(|rx| rx.borrow().end_lsn.clone()))
                .collect();
            for end in ends {
                let end: Lsn = end
                    .parse()
                    .map_err(|e| self.fail(format!("bad status LSN: {e}")))?;
                self.produced = self.produced.max(end);
            }
            if epoch > self.produced {
                return Err(self.fail(format!(
                    "election of term {} starts at {epoch}, beyond all WAL ever produced ({}): WAL invented",
                    s.term, self.produced
                )));
            }
            self.elected.insert(writer, (s.term, epoch));
        }
        if s.synced && commit > Lsn(0) {
            let mine = self.committed_by.get(&writer).copied().unwrap_or(Lsn(0));
            let before = self.committed_below(s.term);
            if commit < mine || commit < before {
                return Err(self.fail(format!(
                    "commit_lsn went back: writer {writer} reports {commit} after {}",
                    mine.max(before)
                )));
            }
            if commit > mine {
                self.log(format!("writer {writer} commit_lsn {commit}"));
            }
            self.record_commit(writer, commit)?;
        }
        self.produced = self.produced.max(end);
        Ok(())
    }

    fn on_result(
        &mut self,
        writer: u64,
        block: u64,
        result: Result<Lsn, WriterError>,
    ) -> Result<(), Failure> {
        // The acknowledgement may overtake the status that shows the election.
        if let Some(s) = self.status_of(writer) {
            self.observe(writer, &s)?;
        }
        match result {
            Ok(end) => {
                if self.acked.insert(block, end).is_some() {
                    return Err(self.fail(format!("block {block} acknowledged twice")));
                }
                self.record_commit(writer, end)?;
            }
            Err(e) => {
                self.not_acked.insert(block);
                self.log(format!("block {block} not acknowledged: {e}"));
            }
        }
        Ok(())
    }

    fn write(&mut self, records: u32, bytes: usize) {
        let Some(writer) = self.writer.clone() else {
            return;
        };
        self.write_through(writer, self.writers_started, records, bytes);
    }

    /// Appends `records` inserts through writer `incarnation`.
    fn write_through(&mut self, writer: Arc<Writer>, incarnation: u64, records: u32, bytes: usize) {
        let first = self.next_block;
        self.next_block += u64::from(records);
        let tx = self.results.0.clone();
        self.log(format!(
            "write blocks {first}..{}",
            first + u64::from(records)
        ));
        self.pending_writes.push(tokio::spawn(async move {
            for block in first..first + u64::from(records) {
                let data = encode_records(&[insert_record(block, bytes)]);
                let result = writer.append(data).await;
                let failed = result.is_err();
                if tx.send((incarnation, block, result)).is_err() || failed {
                    return;
                }
            }
        }));
    }

    /// Runs until `deadline`, watching writer status and acknowledgements.
    async fn run_until(&mut self, deadline: Instant) -> Result<(), Failure> {
        loop {
            self.observe_old_writers()?;
            self.check_walsenders()?;
            self.check_safekeepers().await?;
            let status_changed = async {
                match self.status.as_mut() {
                    Some(rx) => rx.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                changed = status_changed => {
                    // Also when the writer stopped: its last status counts.
                    let s = self.status.as_ref().map(|rx| rx.borrow().clone());
                    if let Some(s) = s {
                        self.observe(self.writers_started, &s)?;
                    }
                    if !changed {
                        self.status = None;
                        self.restart_stopped_writer().await?;
                    }
                }
                Some((writer, block, result)) = self.results.1.recv() => self.on_result(writer, block, result)?,
                () = tokio::time::sleep_until(deadline) => return Ok(()),
            }
        }
    }

    async fn apply(&mut self, event: &Event) -> Result<(), Failure> {
        match *event {
            Event::Write { records, bytes } => self.write(records, bytes),
            Event::Fault(Fault::Crash(i)) => self.crash_safekeeper(i).await,
            Event::Fault(Fault::Restart(i)) => {
                self.crash_safekeeper(i).await;
                self.start_safekeeper(i).await?;
            }
            Event::RestartWriter => {
                self.kill_writer();
                self.kill_old_writers()?;
                self.start_writer().await?;
            }
            Event::TakeOver => self.take_over().await?,
            Event::LoseDisk(i) => self.lose_disk(i).await?,
            Event::SplitLoss { lost, a, b } => self.split_loss(lost, a, b).await?,
            Event::CrashInPartialUpload {
                safekeeper,
                applied,
            } => self.crash_in_partial_upload(safekeeper, applied).await?,
            Event::Fault(Fault::Partition(a, b)) => {
                // Index SAFEKEEPERS is the current writer.
                let name = |i: usize| {
                    if i == SAFEKEEPERS {
                        writer_node(self.writers_started)
                    } else {
                        node_name(i)
                    }
                };
                let (a, b) = (name(a), name(b));
                self.world.partition(&a, &b);
            }
            Event::Fault(Fault::RepairPartitions) => self.world.repair_all(),
            Event::Fault(Fault::DiskFailure(i)) => {
                self.disks[i].set_failing(true);
                self.log(format!("sk{i} disk fails every sync"));
            }
            Event::Rogue { safekeeper, kind } => {
                let Some(server) = self.servers[safekeeper].clone() else {
                    return Ok(());
                };
                let positions = server.positions().await;
                let outcome = crate::rogue::attempt(
                    self.world.net.node("rogue").as_ref(),
                    &node_name(safekeeper),
                    &cluster_id(),
                    SEGMENT_BYTES,
                    kind,
                    positions,
                )
                .await;
                self.log(format!("rogue {kind:?} on sk{safekeeper}: {outcome:?}"));
                if let RogueOutcome::Accepted(what) = outcome {
                    return Err(
                        self.fail(format!("sk{safekeeper} accepted a rogue message: {what}"))
                    );
                }
            }
            Event::Fault(Fault::DiskStall {
                node: safekeeper,
                millis,
            }) => {
                self.disks[safekeeper].stall_until(Instant::now() + Duration::from_millis(millis));
                self.log(format!("sk{safekeeper} disk stalls {millis} ms"));
            }
        }
        Ok(())
    }

    /// Faults stop: everything is repaired and restarted, and a write must commit.
    async fn settle(&mut self, net: NetOptions) -> Result<Lsn, Failure> {
        self.world.repair_all();
        self.world.net.set_options(NetOptions {
            break_prob: 0.0,
            connect_fail_prob: 0.0,
            ..net
        });
        self.log("faults stop");
        for i in 0..SAFEKEEPERS {
            let stopped = self.servers[i]
                .as_ref()
                .and_then(|server| server.failure().borrow().clone());
            if let Some(reason) = stopped {
                // It stopped on a disk error, as it must: restart it.
                self.log(format!("sk{i} had stopped: {reason}"));
                self.crash_safekeeper(i).await;
            } else if self.disks[i].failing() {
                // A failing disk not noticed yet: repaired by a restart too.
                self.crash_safekeeper(i).await;
            }
            if self.servers[i].is_none() {
                self.start_safekeeper(i).await?;
            }
        }
        // After a takeover either writer may be the one left standing (the other
        // stopped, superseded): one fresh writer carries on.
        if !self.old_writers.is_empty() {
            self.kill_old_writers()?;
            self.kill_writer();
        }
        if self.writer.is_none() {
            self.start_writer().await?;
        }
        // A lost safekeeper is restored once the backup holds what it needs.
        let deadline = Instant::now() + LIVENESS_BOUND;
        while let Some(i) = self.restoring {
            if Instant::now() >= deadline {
                return Err(self.fail(format!(
                    "sk{i} could not be restored within {LIVENESS_BOUND:?} after the faults stopped"
                )));
            }
            self.try_restore().await?;
            if self.restoring.is_some() {
                self.run_until((Instant::now() + Duration::from_millis(500)).min(deadline))
                    .await?;
            }
        }
        // A write must commit; one that fails (its writer superseded by a stale
        // term and restarted by its supervisor) is tried again.
        let deadline = Instant::now() + LIVENESS_BOUND;
        let block = loop {
            let Some(writer) = self.writer.clone() else {
                return Err(self.fail("no writer"));
            };
            let block = self.next_block;
            self.next_block += 1;
            let data = encode_records(&[insert_record(block, 100)]);
            let tx = self.results.0.clone();
            let incarnation = self.writers_started;
            tokio::spawn(async move {
                let _ = tx.send((incarnation, block, writer.append(data).await));
            });
            while !self.acked.contains_key(&block) && !self.not_acked.contains(&block) {
                if Instant::now() >= deadline {
                    return Err(self.fail(format!(
                        "after the faults stopped, a write did not commit within {LIVENESS_BOUND:?}"
                    )));
                }
                self.run_until((Instant::now() + Duration::from_millis(100)).min(deadline))
                    .await?;
            }
            if self.acked.contains_key(&block) {
                break block;
            }
        };
        self.log(format!("final write committed at {}", self.acked[&block]));
        // Every write still running completes too.
        while self.pending_writes.iter().any(|t| !t.is_finished()) {
            if Instant::now() >= deadline {
                return Err(self.fail(format!(
                    "after the faults stopped, writes did not complete within {LIVENESS_BOUND:?}"
                )));
            }
            self.run_until((Instant::now() + Duration::from_millis(100)).min(deadline))
                .await?;
        }
        while let Ok((writer, block, result)) = self.results.1.try_recv() {
            self.on_result(writer, block, result)?;
        }
        let end = self.acked.values().copied().max().unwrap_or(Lsn(0));
        // Every safekeeper catches up and learns the commit (heartbeats carry it).
        loop {
            let mut behind = Vec::new();
            for (i, server) in self.servers.iter().enumerate() {
                if let Some(server) = server {
                    let status = server.status().await;
                    let commit: Lsn = status
                        .commit_lsn
                        .parse()
                        .map_err(|e: String| self.fail(e))?;
                    if commit < end {
                        behind.push(i);
                    }
                }
            }
            if behind.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(self.fail(format!(
                    "after the faults stopped, safekeepers {behind:?} did not catch up to {end} within {LIVENESS_BOUND:?}"
                )));
            }
            self.run_until((Instant::now() + Duration::from_millis(100)).min(deadline))
                .await?;
        }
        self.log("every safekeeper caught up");
        // The replica receives all of it through a walsender.
        while (walreceiver::lock(&self.received).wal.len() as u64) < end.0 {
            if Instant::now() >= deadline {
                let got = walreceiver::lock(&self.received).wal.len();
                return Err(self.fail(format!(
                    "after the faults stopped, the replica received WAL only up to {got}, not {end}, within {LIVENESS_BOUND:?}"
                )));
            }
            self.run_until((Instant::now() + Duration::from_millis(100)).min(deadline))
                .await?;
        }
        self.check_walsenders()?;
        self.log("the replica received every committed byte");
        Ok(end)
    }

    /// Stops every node and checks the WAL on every disk.
    async fn check_disks(&mut self, committed: Lsn) -> Result<(), Failure> {
        self.kill_writer();
        self.kill_old_writers()?;
        for i in 0..SAFEKEEPERS {
            if let Some(server) = self.servers[i].take() {
                server.kill().await;
            }
        }
        let mut wals = Vec::new();
        let mut backup_lsns = Vec::new();
        let mut removed = Vec::new();
        let objects = self.partial_objects().await?;
        let mut uploaded_partials = Vec::new();
        for i in 0..SAFEKEEPERS {
            let acceptor = self.open_acceptor(i).await?;
            // Up to what it knows was committed: at least every acknowledged
            // write, and more when a later term committed writes whose
            // answers were lost (a replica may have received those too).
            let upto = acceptor
                .flush_lsn()
                .min(committed.max(acceptor.commit_lsn()));
            let state = acceptor.state().clone();
            self.check_partial_orphans(i, &objects, &state.partial_backup)?;
            self.check_one_uploaded(i, &state.partial_backup)?;
            uploaded_partials.extend(
                state
                    .partial_backup
                    .iter()
                    .filter(|e| e.status == UploadStatus::Uploaded)
                    .cloned(),
            );
            backup_lsns.push(state.backup_lsn);
            removed.push(state.last_removed_segno);
            let mut wal = Vec::with_capacity(upto.0 as usize);
            // What this safekeeper removed must be in the backup: WAL removed
            // locally is read from there, by replicas as here.
            for segno in 0..state.last_removed_segno {
                let object = self.backup_segment(segno).await.ok_or_else(|| {
                    self.fail(format!(
                        "sk{i} removed segment {segno} (below {}), which is not in the backup (its backup_lsn {})",
                        state.last_removed_segno, state.backup_lsn
                    ))
                })?;
                wal.extend_from_slice(&object);
            }
            while (wal.len() as u64) < upto.0 {
                let max = (upto.0 - wal.len() as u64) as usize;
                let chunk = acceptor
                    .read_for_recovery(acceptor.term(), Lsn(wal.len() as u64), max)
                    .await
                    .map_err(|e| self.fail(format!("sk{i} cannot read its WAL: {e}")))?;
                if chunk.is_empty() {
                    return Err(self.fail(format!("sk{i} WAL ends early at {}", wal.len())));
                }
                wal.extend_from_slice(&chunk);
            }
            wals.push(wal);
        }
        for i in 0..SAFEKEEPERS {
            for j in i + 1..SAFEKEEPERS {
                let common = wals[i].len().min(wals[j].len());
                if wals[i][..common] != wals[j][..common] {
                    let at = (0..common)
                        .find(|&k| wals[i][k] != wals[j][k])
                        .unwrap_or(common);
                    return Err(self.fail(format!(
                        "sk{i} and sk{j} disagree on committed WAL at byte {at}"
                    )));
                }
            }
        }
        let holders = wals
            .iter()
            .filter(|w| w.len() as u64 >= committed.0)
            .count();
        if holders != SAFEKEEPERS {
            return Err(self.fail(format!(
                "after catching up, committed WAL up to {committed} is on only {holders} safekeepers"
            )));
        }
        // The longest committed WAL (the others are prefixes of it, checked
        // above).
        let Some(full) = wals.iter().max_by_key(|w| w.len()) else {
            return Err(self.fail("no safekeeper holds the committed WAL"));
        };
        let full = Bytes::from(full.clone());
        let committed = Lsn(full.len() as u64);
        // Every segment below any safekeeper's backup_lsn is in the backup,
        // whole, with the committed bytes.
        let backed_up = backup_lsns.iter().copied().max().unwrap_or(Lsn(0));
        if backed_up > committed {
            return Err(self.fail(format!(
                "backup_lsn {backed_up} is beyond the committed end {committed}"
            )));
        }
        for segno in 0..backed_up.0 / SEGMENT_BYTES {
            let at = (segno * SEGMENT_BYTES) as usize;
            let expected = &full[at..at + SEGMENT_BYTES as usize];
            match self.backup_segment(segno).await {
                Some(object) if object[..] == *expected => {}
                Some(_) => {
                    return Err(self.fail(format!(
                        "backup segment {segno} differs from the committed WAL"
                    )))
                }
                None => {
                    return Err(self.fail(format!(
                        "segment {segno} is below backup_lsn {backed_up} but not in the backup"
                    )))
                }
            }
        }
        // An uploaded partial object holds the committed WAL below its
        // commit_lsn, byte for byte.
        for entry in &uploaded_partials {
            let truth = self.truth()?;
            let key = ferry_safekeeper::partial::partial_key(&entry.name);
            let Ok(object) = truth.get(&key).await else {
                return Err(self.fail(format!(
                    "uploaded partial {} is not in the backup",
                    entry.name
                )));
            };
            let start = entry.flush_lsn.0 / SEGMENT_BYTES * SEGMENT_BYTES;
            if object.len() as u64 != entry.flush_lsn.0 - start {
                return Err(self.fail(format!(
                    "partial {} holds {} bytes, not the flushed prefix of {}",
                    entry.name,
                    object.len(),
                    entry.flush_lsn.0 - start
                )));
            }
            // Only the part below its commit_lsn is final: WAL past it may
            // have been cut by a later term.
            let upto = entry.commit_lsn.min(committed).0;
            if upto > start
                && object[..(upto - start) as usize] != full[start as usize..upto as usize]
            {
                return Err(self.fail(format!(
                    "partial {} differs from the committed WAL below its commit_lsn",
                    entry.name
                )));
            }
        }
        // A restored safekeeper held exactly committed WAL, and was brought
        // back (it votes again).
        if let Some((i, restored)) = &self.restored {
            if restored.len() > full.len() || restored[..] != full[..restored.len()] {
                let at = (0..restored.len().min(full.len()))
                    .find(|&k| restored[k] != full[k])
                    .unwrap_or(restored.len().min(full.len()));
                return Err(self.fail(format!(
                    "sk{i} was restored with {} bytes that are not the committed WAL ({} bytes): they differ at byte {at}",
                    restored.len(),
                    full.len()
                )));
            }
            let acceptor = self.open_acceptor(*i).await?;
            if let Some(lsn) = acceptor.restored_up_to() {
                return Err(self.fail(format!(
                    "sk{i}, restored up to {lsn}, was never brought back"
                )));
            }
        }
        // No safekeeper removed WAL the replica had not applied.
        let applied = walreceiver::lock(&self.received).wal.len() as u64;
        for (i, &segno) in removed.iter().enumerate() {
            if segno * SEGMENT_BYTES > applied {
                return Err(self.fail(format!(
                    "sk{i} removed segments below {segno}, beyond what the replica applied ({applied} bytes)"
                )));
            }
        }
        self.log(format!(
            "backup_lsn per safekeeper {backup_lsns:?}, segments removed below {removed:?}, {} partial objects, uploaded {:?}",
            objects.len(),
            uploaded_partials.iter().map(|e| e.name.as_str()).collect::<Vec<_>>()
        ));
        {
            let received = walreceiver::lock(&self.received);
            let n = received.wal.len();
            if n > full.len() || received.wal[..] != full[..n] {
                let at = (0..n.min(full.len()))
                    .find(|&k| received.wal[k] != full[k])
                    .unwrap_or(n.min(full.len()));
                return Err(self.fail(format!(
                    "the replica received {n} bytes that differ from the committed WAL ({} bytes) at byte {at}",
                    full.len()
                )));
            }
        }
        let mut seen: BTreeMap<u64, Lsn> = BTreeMap::new();
        let mut at = 0usize;
        while at < full.len() {
            let (rec, len) = record::decode(&full.slice(at..))
                .map_err(|e| self.fail(format!("committed WAL damaged at {at}: {e}")))?;
            at += len;
            if let Record::Insert {
                block_number,
                arrow_ipc,
                ..
            } = rec
            {
                if !payload_is_intact(block_number, &arrow_ipc) {
                    return Err(self.fail(format!("block {block_number} changed in the WAL")));
                }
                if seen.insert(block_number, Lsn(at as u64)).is_some() {
                    return Err(self.fail(format!("block {block_number} appears twice in the WAL")));
                }
            }
        }
        for (block, end) in &self.acked {
            match seen.get(block) {
                None => {
                    return Err(self.fail(format!("acknowledged block {block} (end {end}) is lost")))
                }
                Some(found) if found != end => {
                    return Err(self.fail(format!(
                        "acknowledged block {block} ends at {found}, acknowledged at {end}"
                    )))
                }
                Some(_) => {}
            }
        }
        // Low-level counters make the log (and its hash) sensitive to any change
        // in the execution, not only to the events above.
        let fsyncs: Vec<u64> = self.disks.iter().map(SimDisk::fsyncs).collect();
        self.log(format!("fsyncs per safekeeper disk: {fsyncs:?}"));
        let (frames, connections) = {
            let r = walreceiver::lock(&self.received);
            (r.frames, r.connections)
        };
        self.log(format!(
            "checked: {} acknowledged blocks in {} bytes of committed WAL; safekeepers hold {:?} bytes of it; the replica got it in {frames} walsender frames over {connections} connections",
            self.acked.len(),
            full.len(),
            wals.iter().map(Vec::len).collect::<Vec<_>>()
        ));
        Ok(())
    }
}

/// Runs one seed of the WAL random test; `verbose` prints the event log as it
/// happens.
pub fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    crate::run_seeded(seed, run_seed_async(seed, verbose))
}

async fn run_seed_async(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut schedule = generate_schedule(&mut rng);
    add_disk_loss(&mut schedule, seed);
    add_partial_crashes(&mut schedule, seed);
    let mut world = World::new(
        seed,
        &mut rng,
        schedule.net,
        // Requests of the recorder and of writers reading the known commit
        // are sometimes lost, before or after they apply.
        CoordFaults {
            fail_before_prob: 0.05,
            fail_after_prob: 0.05,
            ..CoordFaults::default()
        },
        // Backup uploads fail now and then, before or after they land.
        ObjectFaults {
            min_latency: Duration::from_millis(1),
            max_latency: Duration::from_millis(80),
            fail_prob: 0.1,
            fail_after_write_prob: 0.05,
            multipart: false,
            deletes: true,
        },
        verbose,
    )
    .await?;
    let disks = (0..SAFEKEEPERS)
        .map(|i| world.disk(&node_name(i)))
        .collect();
    let control_sessions = world.coord.factory("control", Duration::from_secs(2));
    let (committed_tx, committed_rx) = watch::channel(Lsn(0));
    let recorder = tokio::spawn(record_commits(
        world.coord.factory("recorder", Duration::from_secs(2)),
        committed_rx,
    ));
    let mut sim = Sim {
        world,
        disks,
        servers: vec![None, None, None],
        preallocation: vec![Preallocation::Auto; SAFEKEEPERS],
        writer: None,
        status: None,
        old_writers: BTreeMap::new(),
        writers_started: 0,
        pending_writes: Vec::new(),
        next_block: 0,
        acked: BTreeMap::new(),
        not_acked: BTreeSet::new(),
        results: mpsc::unbounded_channel(),
        committed: Lsn(0),
        committed_by: BTreeMap::new(),
        elected: BTreeMap::new(),
        term_owner: BTreeMap::new(),
        produced: Lsn(0),
        elections: 0,
        received: SharedReceived::default(),
        seen_terms: vec![0; SAFEKEEPERS],
        seen_commits: vec![Lsn(0); SAFEKEEPERS],
        control_sessions,
        control: None,
        committed_tx,
        restored: None,
        restoring: None,
    };
    let mut header = String::new();
    let _ = write!(
        header,
        "seed {seed}: {} events, network {:?}",
        schedule.events.len(),
        schedule.net
    );
    sim.log(header);
    for i in 0..SAFEKEEPERS {
        sim.create_acceptor(i).await?;
    }
    for i in 0..SAFEKEEPERS {
        sim.start_safekeeper(i).await?;
    }
    sim.start_writer().await?;
    let clock: ferry_env::SharedClock = Arc::new(sim.world.clock.clone());
    let receiver = tokio::spawn(walreceiver::run(
        sim.world.net.node("replica"),
        clock,
        (0..SAFEKEEPERS).map(node_name).collect(),
        0,
        Arc::clone(&sim.received),
    ));
    for (at, event) in &schedule.events {
        sim.run_until(sim.world.start + *at).await?;
        sim.try_restore().await?;
        sim.log(format!("{event:?}"));
        sim.apply(event).await?;
    }
    let committed = sim.settle(schedule.net).await?;
    receiver.abort();
    recorder.abort();
    sim.check_disks(committed).await?;
    let log_hash = sim
        .world
        .log_lines()
        .iter()
        .fold(0u32, |h, line| crc32c::crc32c_append(h, line.as_bytes()));
    Ok(Outcome {
        seed,
        events: schedule.events.len(),
        simulated: sim.world.start.elapsed(),
        acknowledged: sim.acked.len(),
        elections: sim.elections,
        commit_lsn: committed,
        log_hash,
        crash_stats: sim.world.crash_stats(),
        log: sim.world.into_log(),
    })
}
