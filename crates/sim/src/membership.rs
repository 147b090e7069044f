//! The membership random test: five safekeepers of which three start as
//! the quorum (generation 1), writers, and the product's change driver
//! (`ferry_node::membership`, as `ferry safekeeper-set` runs it) replacing,
//! adding and removing members under safekeeper crashes and restarts,
//! partitions, writer restarts and takeovers (some started from the first
//! configuration, as a writer restarted with old flags would be), driver
//! runs killed at any step, aborts and finishes, lost coordination answers,
//! and writers of an older generation knocking at every safekeeper.
//!
//! Checked: at every step, one writer per term, and no safekeeper gives an
//! older generation's writer a vote; at the end, once the faults stop, a
//! change under way is finished (or aborted), a writer of the recorded
//! configuration commits a last write, and the WAL of the member holding
//! the most (the donor a next election would pick) holds every
//! acknowledged write exactly where it was acknowledged, once, while every
//! member's committed WAL agrees with it: no committed record was lost
//! across changes.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_coord::SessionFactory;
use ferry_env::Disk;
use ferry_node::membership::{self, ChangeError, ChangeOptions, ChangeRequest};
use ferry_node::SafekeeperOpen;
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig};
use ferry_safekeeper::server::ServerConfig;
use ferry_wal::membership::{Configuration, Member};
use ferry_wal::proto::{self, FromSafekeeper, Greeting, ToSafekeeper};
use ferry_wal::record::{self, Record};
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn};
use ferry_writer::driver::{encode_records, Writer, WriterConfig, WriterError, WriterStatus};
use ferry_writer::proposer::ProposerConfig;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::safekeepers::{name, Safekeepers};
use crate::world::coord::{CoordFaults, SimSessions};
use crate::world::faults::draw_events;
use crate::world::net::NetOptions;
use crate::world::objstore::ObjectFaults;
use crate::world::{AfterAWrite, Failure, Run, World};

const NODES: usize = 5;
const SEGMENT_BYTES: u64 = 64 << 10;
const TIMELINE: u64 = 1;
/// After the faults stop, a write must commit within this (virtual) time.
const LIVENESS_BOUND: Duration = Duration::from_secs(120);
const CRASH: AfterAWrite = AfterAWrite {
    prob: 0.7,
    within: Duration::from_secs(1),
};

fn cluster_id() -> ClusterId {
    ClusterId::new("sim-membership").unwrap_or_else(|_| unreachable!("a valid cluster id"))
}

fn member(i: usize) -> Member {
    Member {
        id: i as u64,
        addr: name(i),
    }
}

fn writer_node(incarnation: u64) -> String {
    format!("writer{incarnation}")
}

/// What a change event asks the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    Replace,
    Add,
    Remove,
    Abort,
    Finish,
}

/// One scheduled fault or action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Write {
        records: u32,
        bytes: usize,
    },
    Crash(usize),
    Restart(usize),
    /// Cut `a` from `b`: `< NODES` a safekeeper, `NODES` the current writer,
    /// `NODES + 1` the operator running the change driver.
    Partition(usize, usize),
    Repair,
    RestartWriter,
    /// A second writer starts while the first runs; `stale`: with the
    /// first configuration (a writer restarted from old flags).
    TakeOver {
        stale: bool,
    },
    /// Starts the change driver (a second one may run beside it).
    Change(ChangeKind),
    /// Kills the running change driver wherever it is.
    KillDriver,
    /// A writer of generation 0 asks safekeeper `i` for a vote.
    OlderGeneration(usize),
}

/// Draws a schedule: 1 to 79 events, 0 to 400 ms apart.
pub fn generate_schedule(rng: &mut SmallRng) -> (Vec<(Duration, Event)>, NetOptions) {
    let max_delay = rng.random_range(1..=30u64);
    let net = NetOptions {
        min_delay: Duration::ZERO,
        max_delay: Duration::from_millis(max_delay),
        break_prob: if rng.random_bool(0.5) { 0.01 } else { 0.0 },
        connect_fail_prob: 0.02,
        connect_timeout: Duration::from_millis(500),
    };
    let count = rng.random_range(1..80usize);
    let events = draw_events(rng, count, 0..400, |rng| match rng.random_range(0..20u32) {
        0..=5 => Event::Write {
            records: rng.random_range(1..8),
            bytes: rng.random_range(16..3000),
        },
        6 | 7 => Event::Crash(rng.random_range(0..NODES)),
        8 | 9 => Event::Restart(rng.random_range(0..NODES)),
        10 => {
            let a = rng.random_range(0..NODES + 2);
            let b = (a + rng.random_range(1..NODES + 2)) % (NODES + 2);
            Event::Partition(a, b)
        }
        11 => Event::Repair,
        12 => Event::RestartWriter,
        13 => Event::TakeOver {
            stale: rng.random_bool(0.5),
        },
        14..=16 => Event::Change(match rng.random_range(0..10u32) {
            0..=3 => ChangeKind::Replace,
            4 | 5 => ChangeKind::Add,
            6 | 7 => ChangeKind::Remove,
            8 => ChangeKind::Abort,
            _ => ChangeKind::Finish,
        }),
        17 => Event::KillDriver,
        18 => Event::OlderGeneration(rng.random_range(0..NODES)),
        _ => Event::Write {
            records: 1,
            bytes: rng.random_range(10_000..70_000),
        },
    });
    (events, net)
}

/// What one seed did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub run: Run,
    pub acknowledged: usize,
    /// Changes the driver finished, and aborts it recorded.
    pub switched: usize,
    pub aborted: usize,
    /// Driver runs killed half way.
    pub killed: usize,
    /// The generation at the end.
    pub generation: u32,
    /// Writers that started over with a newer configuration.
    pub reconfigured: usize,
    /// Joining safekeepers pulled from a member before their change.
    pub pulled: usize,
}

/// The membership workload, as the seed harness runs it.
pub struct MembershipChanges;

impl crate::seeds::Workload for MembershipChanges {
    type Outcome = Outcome;
    const NAME: &'static str = "membership";

    fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
        crate::run_seeded(seed, run_seed(seed, verbose))
    }

    fn run(outcome: &Outcome) -> &Run {
        &outcome.run
    }

    fn counters(o: &Outcome) -> Vec<String> {
        vec![
            format!("{} acknowledged writes", o.acknowledged),
            format!("{} changes switched", o.switched),
            format!("{} aborted", o.aborted),
            format!("{} driver runs killed", o.killed),
            format!("{} writers reconfigured", o.reconfigured),
            format!("{} joining safekeepers pulled", o.pulled),
            format!("generation {} at the end", o.generation),
        ]
    }

    fn totals(outcomes: &[Outcome], wall_secs: f64) -> Vec<String> {
        let simulated: Duration = outcomes.iter().map(|o| o.run.simulated).sum();
        vec![format!(
            "{:.0} simulated s per wall s",
            simulated.as_secs_f64() / wall_secs.max(1e-9)
        )]
    }
}

/// A running writer incarnation.
struct Running {
    incarnation: u64,
    writer: Arc<Writer>,
    status: watch::Receiver<WriterStatus>,
}

type AppendResult = (u64, Result<Lsn, WriterError>);

struct Sim {
    world: World,
    safekeepers: Safekeepers,
    writer: Option<Running>,
    old_writers: Vec<Running>,
    writers_started: u64,
    pending_writes: Vec<JoinHandle<()>>,
    next_block: u64,
    acked: BTreeMap<u64, Lsn>,
    /// Blocks whose append failed (outcome unknown).
    unknown: std::collections::BTreeSet<u64>,
    results: (
        mpsc::UnboundedSender<AppendResult>,
        mpsc::UnboundedReceiver<AppendResult>,
    ),
    /// Which incarnation was elected in each term.
    term_owner: BTreeMap<u64, u64>,
    /// Generation each incarnation last reported.
    generations: BTreeMap<u64, u32>,
    reconfigured: usize,
    operator: SimSessions,
    control: Option<ferry_coord::Session>,
    drivers: Vec<(bool, JoinHandle<Result<Configuration, ChangeError>>)>,
    initial: Configuration,
    switched: usize,
    aborted: usize,
    killed: usize,
    /// Draws whether a joining safekeeper is pulled first: a generator of
    /// its own, so the schedules of seeds stay what they were.
    pull_rng: SmallRng,
    pulled: usize,
}

async fn run_seed(seed: u64, verbose: bool) -> Result<Outcome, Failure> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (events, net) = generate_schedule(&mut rng);
    let mut world = World::new(
        seed,
        &mut rng,
        net,
        CoordFaults {
            fail_before_prob: 0.05,
            fail_after_prob: 0.05,
            ..CoordFaults::default()
        },
        ObjectFaults::default(),
        verbose,
    )
    .await?;
    let safekeepers = Safekeepers::new(&mut world, NODES);
    let operator = world.coord.factory("operator", Duration::from_secs(2));
    let initial = Configuration::initial((0..3).map(member).collect())
        .map_err(|e| world.fail(format!("the first configuration: {e}")))?;
    let mut sim = Sim {
        world,
        safekeepers,
        writer: None,
        old_writers: Vec::new(),
        writers_started: 0,
        pending_writes: Vec::new(),
        next_block: 0,
        acked: BTreeMap::new(),
        unknown: Default::default(),
        results: mpsc::unbounded_channel(),
        term_owner: BTreeMap::new(),
        generations: BTreeMap::new(),
        reconfigured: 0,
        operator,
        control: None,
        drivers: Vec::new(),
        initial,
        switched: 0,
        aborted: 0,
        killed: 0,
        pull_rng: SmallRng::seed_from_u64(seed ^ 0x5055_4C4C),
        pulled: 0,
    };
    let mut header = String::new();
    let _ = write!(
        header,
        "seed {seed}: {} events, network {net:?}",
        events.len()
    );
    sim.world.log(header);
    for i in 0..NODES {
        let disk: Arc<dyn Disk> = Arc::new(sim.safekeepers.disks[i].for_process());
        Acceptor::create(disk, &name(i), acceptor_config(i))
            .await
            .map_err(|e| sim.world.fail(format!("sk{i} cannot be created: {e}")))?;
    }
    for i in 0..NODES {
        sim.start_safekeeper(i).await?;
    }
    sim.init().await?;
    sim.start_writer(false).await?;
    for (at, event) in &events {
        sim.run_until(sim.world.start + *at).await?;
        sim.world.log(format!("{event:?}"));
        sim.apply(event).await?;
    }
    sim.settle().await?;
    let generation = sim.recorded().await?.generation;
    Ok(Outcome {
        acknowledged: sim.acked.len(),
        switched: sim.switched,
        aborted: sim.aborted,
        killed: sim.killed,
        generation,
        reconfigured: sim.reconfigured,
        pulled: sim.pulled,
        run: sim.world.finish(events.len()),
    })
}

fn acceptor_config(i: usize) -> AcceptorConfig {
    AcceptorConfig {
        cluster_id: cluster_id(),
        node_id: i as u64,
        timeline_id: TIMELINE,
        segment_size: SegmentSize::new(SEGMENT_BYTES)
            .unwrap_or_else(|_| unreachable!("64 KiB is a valid segment size")),
        preallocation: Default::default(),
    }
}

fn insert_record(block: u64, bytes: usize) -> Record {
    Record::Insert {
        shard: 0,
        idempotency_key: Bytes::new(),
        table_id: 1,
        block_number: block,
        arrow_ipc: Bytes::from(vec![(block % 251) as u8; bytes]),
    }
}

fn options() -> ChangeOptions {
    let mut options = ChangeOptions::new(cluster_id());
    options.timeout = Duration::from_secs(20);
    options.retry = Duration::from_millis(200);
    options.call_timeout = Duration::from_secs(1);
    options
}

impl Sim {
    async fn start_safekeeper(&mut self, i: usize) -> Result<(), Failure> {
        self.safekeepers.disks[i].set_failing(false);
        // No backup and no removal: every safekeeper keeps its whole WAL,
        // so a member joining empty is caught up from a peer's.
        let config = ServerConfig {
            remove_wal: false,
            min_free_disk: 0,
            peer_recovery: Some(ferry_safekeeper::recovery::PeerRecovery {
                network: self.world.net.node(&name(i)),
                peers: (0..NODES).filter(|&p| p != i).map(name).collect(),
            }),
            ..ServerConfig::default()
        };
        self.safekeepers
            .start(
                &mut self.world,
                i,
                SafekeeperOpen::Open,
                acceptor_config(i),
                config,
                "cannot recover from its disk",
                "no backup",
            )
            .await
    }

    async fn session(&mut self) -> Option<ferry_coord::Session> {
        if let Some(s) = &self.control {
            return Some(Arc::clone(s));
        }
        match self.operator.open().await {
            Ok(s) => {
                self.control = Some(Arc::clone(&s));
                Some(s)
            }
            Err(_) => None,
        }
    }

    /// The recorded configuration, read again until coordination answers.
    async fn recorded(&mut self) -> Result<Configuration, Failure> {
        for _ in 0..100 {
            if let Some(session) = self.session().await {
                match membership::read_configuration(&*session).await {
                    Ok(Some(r)) => return Ok(r.configuration),
                    Ok(None) => return Err(self.world.fail("no configuration recorded")),
                    Err(ChangeError::Invalid(e)) => {
                        return Err(self.world.fail(format!("recorded configuration: {e}")))
                    }
                    Err(_) => self.control = None,
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(self.world.fail("coordination did not answer in 100 tries"))
    }

    /// Records generation 1, {0, 1, 2}, as an operator deploying the
    /// cluster does (retried over lost coordination answers).
    async fn init(&mut self) -> Result<(), Failure> {
        let network = self.world.net.node("operator");
        for _ in 0..100 {
            let Some(session) = self.session().await else {
                continue;
            };
            match membership::init(
                &*session,
                network.as_ref(),
                &cluster_id(),
                self.initial.members.clone(),
                Duration::from_secs(1),
            )
            .await
            {
                Ok(_) => return Ok(()),
                Err(ChangeError::AlreadyRecorded(_)) => return Ok(()),
                Err(e) => {
                    self.world.log(format!("init: {e}"));
                    self.control = None;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        Err(self
            .world
            .fail("the first configuration could not be recorded"))
    }

    /// Starts a writer with the recorded configuration (`stale`: with the
    /// first one).
    async fn start_writer(&mut self, stale: bool) -> Result<(), Failure> {
        let conf = if stale {
            self.initial.clone()
        } else {
            self.recorded().await?
        };
        self.writers_started += 1;
        let members = conf.all_members();
        let mut proposer = ProposerConfig::new(
            cluster_id(),
            members.len(),
            TIMELINE,
            SEGMENT_BYTES,
            u128::from(self.writers_started),
        );
        proposer.configuration = Some(conf.clone());
        proposer.max_append_bytes = 16 << 10;
        let mut config =
            WriterConfig::new(members.iter().map(|m| m.addr.clone()).collect(), proposer);
        config.reconnect_delay = Duration::from_millis(50);
        config.peer_timeout = Duration::from_secs(1);
        config.election_timeout = Duration::from_secs(2);
        let writer = Writer::start(
            self.world.net.node(&writer_node(self.writers_started)),
            config,
        );
        let status = writer.subscribe();
        self.world.log(format!(
            "writer {} started with {}",
            self.writers_started,
            conf.describe()
        ));
        self.writer = Some(Running {
            incarnation: self.writers_started,
            writer: Arc::new(writer),
            status,
        });
        Ok(())
    }

    fn kill_writers(&mut self) {
        for r in self
            .writer
            .take()
            .into_iter()
            .chain(self.old_writers.drain(..))
        {
            r.writer.abort();
            self.world.log(format!("writer {} killed", r.incarnation));
        }
    }

    /// Checks a writer's status: one incarnation per term.
    fn observe(&mut self, incarnation: u64, s: &WriterStatus) -> Result<(), Failure> {
        if s.elected {
            let owner = *self.term_owner.entry(s.term).or_insert(incarnation);
            if owner != incarnation {
                return Err(self.world.fail(format!(
                    "writers {owner} and {incarnation} were both elected in term {}",
                    s.term
                )));
            }
        }
        let before = self.generations.insert(incarnation, s.generation);
        if before.is_some_and(|g| g < s.generation) {
            self.reconfigured += 1;
            self.world.log(format!(
                "writer {incarnation} runs with generation {} now",
                s.generation
            ));
        }
        Ok(())
    }

    fn observe_all(&mut self) -> Result<(), Failure> {
        let mut seen = Vec::new();
        for r in self.writer.iter_mut().chain(self.old_writers.iter_mut()) {
            if r.status.has_changed().unwrap_or(true) {
                seen.push((r.incarnation, r.status.borrow_and_update().clone()));
            }
        }
        for (i, s) in seen {
            self.observe(i, &s)?;
        }
        // A stopped current writer is restarted by its supervisor.
        let stopped = self
            .writer
            .as_ref()
            .is_some_and(|r| r.status.has_changed().is_err());
        if stopped {
            if let Some(r) = self.writer.take() {
                self.world.log(format!(
                    "writer {} stopped; a new one starts",
                    r.incarnation
                ));
            }
        }
        self.old_writers.retain(|r| r.status.has_changed().is_ok());
        Ok(())
    }

    async fn run_until(&mut self, deadline: Instant) -> Result<(), Failure> {
        loop {
            self.observe_all()?;
            if self.writer.is_none() {
                self.start_writer(false).await?;
            }
            self.reap_drivers().await;
            let status_changed = async {
                match self.writer.as_mut() {
                    Some(r) => {
                        let _ = r.status.changed().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = status_changed => {}
                Some((block, result)) = self.results.1.recv() => {
                    match result {
                        Ok(end) => {
                            self.acked.insert(block, end);
                        }
                        Err(_) => {
                            self.unknown.insert(block);
                        }
                    }
                }
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
            if Instant::now() >= deadline {
                return Ok(());
            }
        }
    }

    /// Counts what finished drivers did.
    async fn reap_drivers(&mut self) {
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.drivers)
            .into_iter()
            .partition(|(_, d)| d.is_finished());
        self.drivers = running;
        for (abort, d) in done {
            // Finished: resolves at once.
            let Ok(result) = d.await else {
                continue;
            };
            match result {
                Ok(conf) if abort => {
                    self.aborted += 1;
                    self.world
                        .log(format!("change aborted: {}", conf.describe()));
                }
                Ok(conf) => {
                    self.switched += 1;
                    self.world.log(format!("change ended: {}", conf.describe()));
                }
                Err(e) => self.world.log(format!("change failed: {e}")),
            }
        }
    }

    fn write(&mut self, records: u32, bytes: usize) {
        let Some(r) = &self.writer else {
            return;
        };
        let writer = Arc::clone(&r.writer);
        let first = self.next_block;
        self.next_block += u64::from(records);
        let tx = self.results.0.clone();
        self.world.log(format!(
            "write blocks {first}..{}",
            first + u64::from(records)
        ));
        self.pending_writes.push(tokio::spawn(async move {
            for block in first..first + u64::from(records) {
                let result = writer
                    .append(encode_records(&[insert_record(block, bytes)]))
                    .await;
                let failed = result.is_err();
                if tx.send((block, result)).is_err() || failed {
                    return;
                }
            }
        }));
    }

    /// Starts the change driver for `kind` against the configuration
    /// recorded now (a request that does not apply is skipped).
    async fn start_change(&mut self, kind: ChangeKind) -> Result<(), Failure> {
        let conf = self.recorded().await?;
        let members: Vec<usize> = conf.members.iter().map(|m| m.id as usize).collect();
        let others: Vec<usize> = (0..NODES).filter(|i| !members.contains(i)).collect();
        let request = match kind {
            ChangeKind::Abort => ChangeRequest::Abort,
            ChangeKind::Finish => ChangeRequest::Finish,
            _ if conf.is_joint() => ChangeRequest::Finish,
            ChangeKind::Add if members.len() < NODES => {
                ChangeRequest::Add(member(others[self.world.rng.random_range(0..others.len())]))
            }
            ChangeKind::Remove if members.len() > 3 => {
                ChangeRequest::Remove(members[self.world.rng.random_range(0..members.len())] as u64)
            }
            _ if !others.is_empty() => ChangeRequest::Replace {
                old: members[self.world.rng.random_range(0..members.len())] as u64,
                new: member(others[self.world.rng.random_range(0..others.len())]),
            },
            _ => return Ok(()),
        };
        // Half of the changes that bring in a safekeeper, with no other
        // driver running, first rebuild it by a pull from a member (as an
        // operator starting it with --pull-from-peers does) and give it a
        // while to keep up by itself, committed WAL only, while writes go
        // on (`ferry_safekeeper::recovery`, a joining safekeeper).
        let joining = match &request {
            ChangeRequest::Add(m) | ChangeRequest::Replace { new: m, .. } => Some(m.id as usize),
            _ => None,
        };
        self.reap_drivers().await;
        let mut delay = Duration::ZERO;
        if let Some(j) = joining.filter(|_| self.drivers.is_empty()) {
            if self.pull_rng.random_bool(0.5) {
                self.pull_joining(j, &members).await?;
                delay = Duration::from_millis(self.pull_rng.random_range(0..1500));
            }
        }
        self.world.log(format!(
            "change driver starts: {request:?} from {} in {delay:?}",
            conf.describe()
        ));
        let sessions = self.operator.clone();
        let network = self.world.net.node("operator");
        let abort = request == ChangeRequest::Abort;
        self.drivers.push((
            abort,
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let session =
                    sessions
                        .open()
                        .await
                        .map_err(|source| ChangeError::Coordination {
                            what: "opening a session",
                            source,
                        })?;
                let result =
                    membership::change(&*session, network.as_ref(), request, &options(), &|_| {})
                        .await;
                session.close().await;
                result
            }),
        ));
        Ok(())
    }

    /// Rebuilds safekeeper `j` (named by no configuration) by a pull from a
    /// running member of `members`; a pull that fails (the donor crashed,
    /// the network cut it) leaves it empty, as a new safekeeper.
    async fn pull_joining(&mut self, j: usize, members: &[usize]) -> Result<(), Failure> {
        let donors: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&m| self.safekeepers.servers[m].is_some())
            .collect();
        if donors.is_empty() {
            return Ok(());
        }
        let donor = donors[self.pull_rng.random_range(0..donors.len())];
        self.safekeepers.crash(&mut self.world, j, None).await;
        self.safekeepers.disks[j].lose(&name(j));
        self.safekeepers.disks[j].set_failing(false);
        let disk: Arc<dyn Disk> = Arc::new(self.safekeepers.disks[j].for_process());
        let net = self.world.net.node(&name(j));
        let pulled = ferry_safekeeper::pull::pull_from_peer(
            Arc::clone(&disk),
            &name(j),
            &acceptor_config(j),
            net.as_ref(),
            &name(donor),
            None,
        )
        .await;
        match pulled {
            Ok(r) => {
                self.pulled += 1;
                self.world.log(format!(
                    "sk{j} pulled from sk{donor}: WAL {}..{}, term {}",
                    r.start_lsn, r.commit_lsn, r.term
                ));
            }
            Err(e) => {
                self.world.log(format!(
                    "pulling sk{j} from sk{donor} failed: {e}; it joins empty"
                ));
                self.safekeepers.disks[j].lose(&name(j));
                Acceptor::create(disk, &name(j), acceptor_config(j))
                    .await
                    .map_err(|e| self.world.fail(format!("sk{j} cannot be created: {e}")))?;
            }
        }
        self.start_safekeeper(j).await
    }

    /// A writer of generation 0 asks safekeeper `i` for a vote in a high
    /// term: a safekeeper holding a configuration must refuse it.
    async fn older_generation(&mut self, i: usize) -> Result<(), Failure> {
        let Some(server) = self.safekeepers.servers[i].clone() else {
            return Ok(());
        };
        let generation = server.status().await.generation;
        if generation == 0 {
            return Ok(());
        }
        let network = self.world.net.node("rogue");
        let Ok(mut conn) = network.connect(&name(i)).await else {
            return Ok(());
        };
        let greeting = ToSafekeeper::Greeting(Greeting {
            cluster_id: cluster_id(),
            proposer_id: 0xBAD,
            timeline_id: TIMELINE,
            segment_bytes: SEGMENT_BYTES,
            configuration: None,
        });
        let vote = ToSafekeeper::VoteRequest { term: 1 << 40 };
        let asked = async {
            proto::write_frame(&mut conn, &greeting).await.ok()?;
            proto::write_frame(&mut conn, &vote).await.ok()?;
            conn.flush().await.ok()?;
            let _greeting = proto::read_frame::<_, FromSafekeeper>(&mut conn)
                .await
                .ok()??;
            proto::read_frame::<_, FromSafekeeper>(&mut conn)
                .await
                .ok()?
        };
        let answer = tokio::time::timeout(Duration::from_secs(2), asked)
            .await
            .ok()
            .flatten();
        match answer {
            Some(FromSafekeeper::Vote(v)) if v.vote_given => Err(self.world.fail(format!(
                "sk{i} of generation {generation} gave its vote to a writer of generation 0"
            ))),
            Some(FromSafekeeper::Vote(_)) => Err(self.world.fail(format!(
                "sk{i} of generation {generation} answered a vote request of generation 0"
            ))),
            other => {
                self.world
                    .log(format!("generation 0 writer at sk{i}: {other:?}"));
                Ok(())
            }
        }
    }

    async fn apply(&mut self, event: &Event) -> Result<(), Failure> {
        match *event {
            Event::Write { records, bytes } => self.write(records, bytes),
            Event::Crash(i) => {
                self.safekeepers
                    .crash(&mut self.world, i, Some(CRASH))
                    .await
            }
            Event::Restart(i) => {
                self.safekeepers
                    .crash(&mut self.world, i, Some(CRASH))
                    .await;
                self.start_safekeeper(i).await?;
            }
            Event::Partition(a, b) => {
                let node = |i: usize| match i {
                    _ if i < NODES => name(i),
                    NODES => writer_node(self.writers_started),
                    _ => "operator".to_string(),
                };
                let (a, b) = (node(a), node(b));
                self.world.partition(&a, &b);
            }
            Event::Repair => self.world.repair_all(),
            Event::RestartWriter => {
                self.kill_writers();
                self.start_writer(false).await?;
            }
            Event::TakeOver { stale } => {
                if let Some(r) = self.writer.take() {
                    self.old_writers.push(r);
                }
                self.start_writer(stale).await?;
            }
            Event::Change(kind) => self.start_change(kind).await?,
            Event::KillDriver => {
                for (_, d) in self.drivers.drain(..) {
                    if !d.is_finished() {
                        d.abort();
                        self.killed += 1;
                        self.world.log("change driver killed");
                    }
                }
            }
            Event::OlderGeneration(i) => self.older_generation(i).await?,
        }
        Ok(())
    }

    /// The faults stop: everything heals, a change under way is finished
    /// (or aborted when it cannot finish), a writer of the recorded
    /// configuration commits a last write, and the WAL is checked.
    async fn settle(&mut self) -> Result<(), Failure> {
        self.world.repair_all();
        for (_, d) in self.drivers.drain(..) {
            d.abort();
        }
        for i in 0..NODES {
            if self.safekeepers.servers[i].is_none() {
                self.start_safekeeper(i).await?;
            }
        }
        for r in self.old_writers.drain(..) {
            r.writer.abort();
        }
        self.world.log("faults stop");
        let deadline = Instant::now() + LIVENESS_BOUND;
        loop {
            let conf = self.recorded().await?;
            if !conf.is_joint() {
                break;
            }
            let Some(session) = self.session().await else {
                continue;
            };
            let network = self.world.net.node("operator");
            let result = membership::change(
                &*session,
                network.as_ref(),
                ChangeRequest::Finish,
                &options(),
                &|_| {},
            )
            .await;
            self.world.log(format!("finishing the change: {result:?}"));
            if let Err(ChangeError::Coordination { .. }) = result {
                self.control = None;
            }
            self.observe_all()?;
            if self.writer.is_none() {
                self.start_writer(false).await?;
            }
            if Instant::now() > deadline {
                return Err(self
                    .world
                    .fail("the change under way did not finish once faults stopped"));
            }
        }
        // A writer of the recorded configuration (a stopped one restarts).
        let conf = self.recorded().await?;
        let current = self.writer.as_ref().map(|r| r.status.borrow().generation);
        if current != Some(conf.generation) {
            self.kill_writers();
            self.start_writer(false).await?;
        }
        let mut final_block = self.next_block;
        self.write(1, 100);
        while !self.acked.contains_key(&final_block) {
            if self.unknown.contains(&final_block) || self.writer.is_none() {
                // Failed (its writer started over or stopped): another one.
                if self.writer.is_none() {
                    self.start_writer(false).await?;
                }
                final_block = self.next_block;
                self.write(1, 100);
            }
            if Instant::now() > deadline {
                return Err(self.world.fail(format!(
                    "no write committed within {LIVENESS_BOUND:?} after the faults stopped ({})",
                    conf.describe()
                )));
            }
            self.run_until(Instant::now() + Duration::from_millis(500))
                .await?;
            if self
                .writer
                .as_ref()
                .is_some_and(|r| r.status.borrow().generation != conf.generation)
            {
                // Not expected: the recorded configuration is the newest.
                self.world
                    .log("the writer runs another generation than the recorded one");
            }
        }
        for w in std::mem::take(&mut self.pending_writes) {
            let _ = tokio::time::timeout(Duration::from_secs(30), w).await;
        }
        while let Ok((block, result)) = self.results.1.try_recv() {
            if let Ok(end) = result {
                self.acked.insert(block, end);
            }
        }
        self.kill_writers();
        self.safekeepers.stop_all().await;
        self.check_wal(&conf).await
    }

    /// The WAL of the final configuration's members, read from their disks.
    async fn check_wal(&mut self, conf: &Configuration) -> Result<(), Failure> {
        let end = self.acked.values().copied().max().unwrap_or(Lsn(0));
        let mut wals = Vec::new();
        for m in &conf.members {
            let i = m.id as usize;
            let disk: Arc<dyn Disk> = Arc::new(self.safekeepers.disks[i].for_process());
            let acceptor = Acceptor::open(disk, &name(i), acceptor_config(i))
                .await
                .map_err(|e| self.world.fail(format!("sk{i} cannot recover: {e}")))?;
            let position = (acceptor.last_log_term(), acceptor.flush_lsn());
            let upto = acceptor.flush_lsn();
            let mut wal = Vec::with_capacity(upto.0 as usize);
            while (wal.len() as u64) < upto.0 {
                let chunk = acceptor
                    .read_for_recovery(
                        acceptor.term(),
                        Lsn(wal.len() as u64),
                        (upto.0 - wal.len() as u64) as usize,
                    )
                    .await
                    .map_err(|e| self.world.fail(format!("sk{i} cannot read its WAL: {e}")))?;
                if chunk.is_empty() {
                    return Err(self
                        .world
                        .fail(format!("sk{i} WAL ends early at {}", wal.len())));
                }
                wal.extend_from_slice(&chunk);
            }
            wals.push((i, position, acceptor.commit_lsn(), Bytes::from(wal)));
        }
        // The donor a next election would pick holds every committed record.
        let Some((donor, _, _, donor_wal)) = wals
            .iter()
            .max_by_key(|(i, p, _, _)| (*p, std::cmp::Reverse(*i)))
            .cloned()
        else {
            return Err(self.world.fail("a configuration without members"));
        };
        if (donor_wal.len() as u64) < end.0 {
            return Err(self.world.fail(format!(
                "sk{donor}, the most advanced member of {}, ends at {} below the acknowledged {end}",
                conf.describe(),
                donor_wal.len()
            )));
        }
        let mut at = 0usize;
        let mut blocks: BTreeMap<u64, Lsn> = BTreeMap::new();
        while at < donor_wal.len() {
            let (rec, len) = record::decode(&donor_wal.slice(at..)).map_err(|e| {
                self.world
                    .fail(format!("sk{donor}: a damaged record at {at}: {e}"))
            })?;
            at += len;
            if let Record::Insert { block_number, .. } = rec {
                if blocks.insert(block_number, Lsn(at as u64)).is_some() {
                    return Err(self
                        .world
                        .fail(format!("sk{donor}: block {block_number} twice")));
                }
            }
        }
        for (block, lsn) in &self.acked {
            match blocks.get(block) {
                Some(found) if found == lsn => {}
                found => {
                    return Err(self.world.fail(format!(
                        "acknowledged block {block} (ending at {lsn}) is {} in the WAL of sk{donor} ({}): committed WAL was lost across changes",
                        found.map_or("missing".to_string(), |f| format!("at {f}")),
                        conf.describe()
                    )))
                }
            }
        }
        for (i, _, commit, wal) in &wals {
            let common = (commit.0 as usize).min(wal.len()).min(donor_wal.len());
            if wal[..common] != donor_wal[..common] {
                return Err(self.world.fail(format!(
                    "sk{i}'s committed WAL (to {commit}) differs from sk{donor}'s"
                )));
            }
        }
        self.world.log(format!(
            "{} acknowledged blocks in the WAL of {} (donor sk{donor})",
            self.acked.len(),
            conf.describe()
        ));
        Ok(())
    }
}
