//! The proposer and three real acceptors (on real disks) wired in-process: every
//! message is delivered by the test in a deterministic order, so each scenario of
//! the WAL quorum can be staged exactly: elections, commit, failures of one or two
//! safekeepers, restarts, writer takeover and truncation of divergent WAL.

// Tests set up and damage real files and sockets directly; node code may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use ferry_env::Disk;
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig};
use ferry_wal::proto::ToSafekeeper;
use ferry_wal::segment::SegmentSize;
use ferry_wal::{ClusterId, Lsn, Term};
use ferry_writer::proposer::{Action, Proposer, ProposerConfig, ProposerError};

const SEG: u64 = 64 << 10;
const TIMELINE: u64 = 1;

struct Cluster {
    _dir: tempfile::TempDir,
    disk: Arc<dyn Disk>,
    acceptors: Vec<Option<Acceptor>>,
}

fn cluster_id() -> ClusterId {
    ClusterId::new("quorum-test").expect("id")
}

fn config(node: u64) -> AcceptorConfig {
    AcceptorConfig {
        cluster_id: cluster_id(),
        node_id: node,
        timeline_id: TIMELINE,
        segment_size: SegmentSize::new(SEG).expect("segment size"),
        preallocation: Default::default(),
    }
}

impl Cluster {
    async fn new(n: usize) -> Cluster {
        let (dir, disk) = ferry_testkit::disk::temp_disk();
        let mut acceptors = Vec::new();
        for i in 0..n {
            acceptors.push(Some(
                Acceptor::create(Arc::clone(&disk), &format!("sk{i}"), config(i as u64))
                    .await
                    .expect("create"),
            ));
        }
        Cluster {
            _dir: dir,
            disk,
            acceptors,
        }
    }

    /// Kills safekeeper `i`: its in-memory state is gone, its disk stays.
    fn kill(&mut self, i: usize, writers: &mut [&mut Writer]) {
        self.acceptors[i] = None;
        for w in writers.iter_mut() {
            w.connected[i] = false;
            let actions = w.proposer.on_disconnected(i);
            w.absorb(actions);
        }
    }

    async fn start(&mut self, i: usize) {
        assert!(self.acceptors[i].is_none());
        self.acceptors[i] = Some(
            Acceptor::open(Arc::clone(&self.disk), &format!("sk{i}"), config(i as u64))
                .await
                .expect("reopen"),
        );
    }

    /// Replaces safekeeper `i` by an empty one, as if its data dir had been
    /// lost and the safekeeper created again (what ferry never does by itself).
    async fn wipe(&mut self, i: usize, writers: &mut [&mut Writer]) {
        self.kill(i, writers);
        std::fs::remove_dir_all(self._dir.path().join(format!("sk{i}"))).expect("wipe");
        self.acceptors[i] = Some(
            Acceptor::create(Arc::clone(&self.disk), &format!("sk{i}"), config(i as u64))
                .await
                .expect("create again"),
        );
    }

    /// Replaces safekeeper `i` by one rebuilt from a backup holding the
    /// first `segments` whole segments of `committed` (its data dir was lost).
    async fn restore(
        &mut self,
        i: usize,
        committed: &[u8],
        segments: u64,
        writers: &mut [&mut Writer],
    ) -> Lsn {
        self.kill(i, writers);
        std::fs::remove_dir_all(self._dir.path().join(format!("sk{i}"))).expect("wipe");
        let backup = ferry_testkit::wal::file_backup(
            &self._dir.path().join("backup"),
            &cluster_id(),
            SegmentSize::new(SEG).expect("segment size"),
            committed,
            0..segments,
        )
        .await;
        let report = ferry_safekeeper::restore::restore_from_backup(
            Arc::clone(&self.disk),
            &format!("sk{i}"),
            &config(i as u64),
            &backup,
        )
        .await
        .expect("restore");
        self.start(i).await;
        report.restored_lsn
    }

    /// What the change driver does: hands `conf` to safekeepers `ids`.
    async fn configure(&mut self, ids: &[usize], conf: &ferry_wal::membership::Configuration) {
        for &i in ids {
            self.acceptors[i]
                .as_mut()
                .expect("running")
                .handle_configure(&cluster_id(), conf, 0)
                .await
                .expect("configure");
        }
    }

    fn acceptor(&self, i: usize) -> &Acceptor {
        self.acceptors[i].as_ref().expect("running")
    }

    /// The whole flushed WAL of safekeeper `i`.
    async fn wal(&self, i: usize) -> Vec<u8> {
        let a = self.acceptor(i);
        let mut out = Vec::new();
        while (out.len() as u64) < a.flush_lsn().0 {
            let chunk = a
                .read_for_recovery(a.term(), Lsn(out.len() as u64), 1 << 20)
                .await
                .expect("read");
            assert!(!chunk.is_empty());
            out.extend_from_slice(&chunk);
        }
        out
    }
}

struct Writer {
    proposer: Proposer,
    connected: Vec<bool>,
    outbox: VecDeque<(usize, ToSafekeeper)>,
    pending: Vec<Action>,
    elected: Option<(Term, Lsn)>,
    commit_lsn: Lsn,
    superseded: Option<Term>,
    lost: Option<Term>,
    /// The last `BehindKnownCommit`: (best flush, known commit, all voted).
    behind: Option<(Lsn, Lsn, bool)>,
    /// Every recovery read handed to a safekeeper: `[begin, end)`.
    reads: Vec<(Lsn, Lsn)>,
    /// The refusals of `RefusedByAll`.
    refused: Option<Vec<String>>,
    /// Recovery reads (by their index in `reads`) that the safekeeper
    /// refuses instead of answering, as one whose backup read failed does.
    failing_reads: Vec<usize>,
    /// What each safekeeper remembers of its connection from this writer.
    sessions: Vec<ferry_safekeeper::acceptor::WriterSession>,
    /// The configuration of the last `Reconfigure`.
    reconfigured: Option<ferry_wal::membership::Configuration>,
}

impl Writer {
    fn new(n: usize, min_term: Term) -> Writer {
        Writer::with(n, min_term, |_| {})
    }

    fn with(n: usize, min_term: Term, adjust: impl FnOnce(&mut ProposerConfig)) -> Writer {
        let mut config = ProposerConfig::new(cluster_id(), n, TIMELINE, SEG, 42);
        config.min_term = min_term;
        config.max_append_bytes = 8 << 10;
        adjust(&mut config);
        Writer {
            proposer: Proposer::new(config),
            connected: vec![false; n],
            outbox: VecDeque::new(),
            pending: Vec::new(),
            elected: None,
            commit_lsn: Lsn(0),
            superseded: None,
            lost: None,
            behind: None,
            reads: Vec::new(),
            failing_reads: Vec::new(),
            refused: None,
            sessions: vec![Default::default(); n],
            reconfigured: None,
        }
    }

    fn absorb(&mut self, actions: Vec<Action>) {
        self.pending.extend(actions);
    }

    /// Connects to every running safekeeper and runs until quiet.
    async fn connect_all(&mut self, cluster: &mut Cluster) {
        for i in 0..cluster.acceptors.len().min(self.connected.len()) {
            if cluster.acceptors[i].is_some() && !self.connected[i] {
                self.connected[i] = true;
                self.sessions[i] = Default::default();
                let actions = self.proposer.on_connected(i);
                self.absorb(actions);
            }
        }
        self.run(cluster).await;
    }

    /// Delivers messages until nothing moves. Messages queued for one safekeeper
    /// are handed over together, as a batch read from a socket would be.
    async fn run(&mut self, cluster: &mut Cluster) {
        loop {
            for action in std::mem::take(&mut self.pending) {
                match action {
                    Action::Send { to, msg } => {
                        if self.connected[to] && cluster.acceptors[to].is_some() {
                            if let ToSafekeeper::ReadWal {
                                term,
                                begin_lsn,
                                end_lsn,
                            } = &msg
                            {
                                self.reads.push((*begin_lsn, *end_lsn));
                                if self.failing_reads.contains(&(self.reads.len() - 1)) {
                                    let refusal = ferry_wal::proto::FromSafekeeper::Refused {
                                        term: *term,
                                        reason: "WAL backup: injected get failure".into(),
                                    };
                                    let more = self.proposer.on_message(to, refusal);
                                    self.pending.extend(more);
                                    continue;
                                }
                            }
                            self.outbox.push_back((to, msg));
                        }
                    }
                    Action::Elected {
                        term,
                        epoch_start_lsn,
                    } => self.elected = Some((term, epoch_start_lsn)),
                    Action::Committed { commit_lsn } => {
                        assert!(commit_lsn > self.commit_lsn, "commit_lsn must only grow");
                        self.commit_lsn = commit_lsn;
                    }
                    Action::Superseded { term, .. } => self.superseded = Some(term),
                    Action::ElectionLost { term, .. } => self.lost = Some(term),
                    Action::BehindKnownCommit {
                        best_flush_lsn,
                        known_commit_lsn,
                        all_voted,
                    } => self.behind = Some((best_flush_lsn, known_commit_lsn, all_voted)),
                    Action::RefusedByAll { reasons } => self.refused = Some(reasons),
                    Action::Reconfigure { configuration } => {
                        self.reconfigured = Some(configuration)
                    }
                    Action::Members {
                        configuration,
                        slots,
                    } => {
                        self.connected.resize(slots.len(), false);
                        self.sessions.resize(slots.len(), Default::default());
                        for (slot, addr) in slots.iter().enumerate() {
                            if addr.is_none() {
                                self.connected[slot] = false;
                            }
                        }
                        self.reconfigured = Some(configuration);
                    }
                    Action::Reconnect { peer } => {
                        self.connected[peer] = false;
                        let more = self.proposer.on_disconnected(peer);
                        self.pending.extend(more);
                    }
                }
            }
            if self.outbox.is_empty() {
                if self.pending.is_empty() {
                    return;
                }
                continue;
            }
            let mut batches: BTreeMap<usize, Vec<ToSafekeeper>> = BTreeMap::new();
            for (to, msg) in self.outbox.drain(..) {
                batches.entry(to).or_default().push(msg);
            }
            for (to, msgs) in batches {
                let Some(acceptor) = cluster.acceptors[to].as_mut() else {
                    continue;
                };
                let replies = acceptor
                    .handle_batch(msgs, &mut self.sessions[to])
                    .await
                    .expect("safekeeper storage");
                for reply in replies {
                    let actions = self.proposer.on_message(to, reply);
                    self.pending.extend(actions);
                }
            }
        }
    }

    async fn append(
        &mut self,
        cluster: &mut Cluster,
        records: &[u8],
    ) -> Result<Lsn, ProposerError> {
        let (end, actions) = self.proposer.append(&Bytes::copy_from_slice(records))?;
        self.absorb(actions);
        self.run(cluster).await;
        Ok(end)
    }

    /// Appends `records`, which must be accepted, and adds them to `all`
    /// (the WAL the safekeepers must end with).
    async fn append_to(&mut self, cluster: &mut Cluster, all: &mut Vec<u8>, records: Bytes) -> Lsn {
        all.extend_from_slice(&records);
        self.append(cluster, &records).await.expect("append")
    }
}

/// Three safekeepers, and a first writer connected to all of them.
async fn connected() -> (Cluster, Writer) {
    let mut cluster = Cluster::new(3).await;
    let mut w = Writer::new(3, 0);
    w.connect_all(&mut cluster).await;
    (cluster, w)
}

fn batch(first_block: u64, n: u64, size: usize) -> Bytes {
    ferry_testkit::wal::inserts(1, first_block..first_block + n, size)
}

/// The bytes of `parts`, one after the other.
fn concat(parts: &[&Bytes]) -> Vec<u8> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

#[tokio::test]
async fn election_append_and_commit_on_three_safekeepers() {
    let mut cluster = Cluster::new(3).await;
    let mut w = Writer::new(3, 0);
    assert!(matches!(
        w.proposer.append(&Bytes::new()),
        Err(ProposerError::NotElected)
    ));
    w.connect_all(&mut cluster).await;
    assert_eq!(w.elected, Some((1, Lsn(0))));
    let mut expected = Vec::new();
    for i in 0..20 {
        let records = batch(i * 5, 5, 700);
        expected.extend_from_slice(&records);
        let end = w.append(&mut cluster, &records).await.expect("append");
        assert_eq!(end, Lsn(expected.len() as u64));
        assert_eq!(w.commit_lsn, end, "committed once a quorum flushed");
    }
    let heartbeat = w.proposer.heartbeat();
    w.absorb(heartbeat);
    w.run(&mut cluster).await;
    for i in 0..3 {
        assert!(
            cluster.wal(i).await == expected,
            "safekeeper {i} holds exactly the WAL"
        );
        assert_eq!(cluster.acceptor(i).commit_lsn(), w.commit_lsn);
        assert_eq!(cluster.acceptor(i).term(), 1);
    }
    // Invalid records are refused before anything is sent.
    assert!(matches!(
        w.proposer
            .append(&Bytes::from_static(b"not a record at all")),
        Err(ProposerError::InvalidRecords(_))
    ));
}

#[tokio::test]
async fn a_writer_of_another_cluster_is_refused_by_all_and_no_term_moves() {
    let mut cluster = Cluster::new(3).await;
    let mut w = Writer::with(3, 0, |c| {
        c.cluster_id = ClusterId::new("another-cluster").expect("id")
    });
    w.connect_all(&mut cluster).await;
    let reasons = w.refused.clone().expect("refused by every safekeeper");
    assert_eq!(reasons.len(), 3, "{reasons:?}");
    assert!(
        reasons
            .iter()
            .all(|r| r.contains("cluster another-cluster is not served here")),
        "{reasons:?}"
    );
    assert_eq!(w.elected, None);
    assert_eq!(w.lost, None, "a refusal is not a lost election");
    for i in 0..3 {
        assert_eq!(cluster.acceptor(i).term(), 0, "safekeeper {i} never voted");
    }
    // It stopped: nothing is greeted any more.
    let again = w.proposer.on_connected(0);
    assert!(again.is_empty(), "{again:?}");
}

#[tokio::test]
async fn one_foreign_safekeeper_of_three_does_not_stop_the_election() {
    let mut cluster = Cluster::new(3).await;
    let mut foreign = config(2);
    foreign.cluster_id = ClusterId::new("another-cluster").expect("id");
    cluster.acceptors[2] = Some(
        Acceptor::create(Arc::clone(&cluster.disk), "foreign-sk2", foreign)
            .await
            .expect("create"),
    );
    let mut w = Writer::new(3, 0);
    w.connect_all(&mut cluster).await;
    assert_eq!(w.refused, None);
    assert_eq!(w.elected, Some((1, Lsn(0))), "the two others elect it");
    let end = w
        .append(&mut cluster, &batch(0, 3, 100))
        .await
        .expect("append");
    assert_eq!(w.commit_lsn, end, "committed by the two others");
    assert_eq!(cluster.acceptor(2).term(), 0);
}

#[tokio::test]
async fn one_down_writes_go_on_two_down_writes_wait() {
    let (mut cluster, mut w) = connected().await;
    let first = batch(0, 10, 500);
    w.append(&mut cluster, &first).await.expect("append");

    cluster.kill(2, &mut [&mut w]);
    let second = batch(10, 10, 500);
    let end = w.append(&mut cluster, &second).await.expect("append");
    assert_eq!(w.commit_lsn, end, "two of three commit");

    cluster.kill(1, &mut [&mut w]);
    let third = batch(20, 10, 500);
    let end3 = w
        .append(&mut cluster, &third)
        .await
        .expect("append is accepted");
    assert!(w.commit_lsn < end3, "one of three cannot commit");
    assert_eq!(w.commit_lsn, end);

    // One comes back: the writer catches it up and the waiting records commit.
    cluster.start(1).await;
    w.connect_all(&mut cluster).await;
    assert_eq!(w.commit_lsn, end3);
    cluster.start(2).await;
    w.connect_all(&mut cluster).await;
    let all = concat(&[&first, &second, &third]);
    for i in 0..3 {
        assert!(cluster.wal(i).await == all, "safekeeper {i} caught up");
    }
}

#[tokio::test]
async fn restarted_safekeeper_rejoins_without_losing_wal() {
    let (mut cluster, mut w) = connected().await;
    let mut all = Vec::new();
    for i in 0..10 {
        w.append_to(&mut cluster, &mut all, batch(i * 4, 4, 3000))
            .await;
        if i == 4 {
            cluster.kill(0, &mut [&mut w]);
            cluster.start(0).await;
            w.connect_all(&mut cluster).await;
        }
    }
    assert_eq!(w.commit_lsn, Lsn(all.len() as u64));
    for i in 0..3 {
        assert!(cluster.wal(i).await == all, "safekeeper {i}");
    }
}

#[tokio::test]
async fn a_new_writer_takes_over_and_the_old_one_is_refused() {
    let (mut cluster, mut old) = connected().await;
    let committed = batch(0, 8, 400);
    let end = old.append(&mut cluster, &committed).await.expect("append");
    assert_eq!(old.commit_lsn, end);

    let mut new = Writer::new(3, 0);
    new.connect_all(&mut cluster).await;
    assert_eq!(
        new.elected,
        Some((2, end)),
        "the new term builds on all committed WAL"
    );

    // The old writer's next append meets the higher term: it stops, unacknowledged.
    let lost = batch(8, 2, 400);
    let _ = old
        .append(&mut cluster, &lost)
        .await
        .expect("accepted locally");
    assert_eq!(old.superseded, Some(2));
    assert_eq!(
        old.commit_lsn, end,
        "nothing of the old writer commits after the takeover"
    );
    assert!(matches!(
        old.proposer.append(&lost),
        Err(ProposerError::Superseded(_))
    ));

    let next = batch(8, 3, 400);
    let end2 = new.append(&mut cluster, &next).await.expect("append");
    assert_eq!(new.commit_lsn, end2);
    let all = concat(&[&committed, &next]);
    for i in 0..3 {
        assert!(
            cluster.wal(i).await == all,
            "safekeeper {i}: old uncommitted WAL is gone"
        );
    }
}

#[tokio::test]
async fn divergent_uncommitted_wal_is_truncated_committed_wal_never() {
    let (mut cluster, mut w1) = connected().await;
    let committed = batch(0, 6, 600);
    let end = w1.append(&mut cluster, &committed).await.expect("append");
    assert_eq!(w1.commit_lsn, end);

    // Safekeepers 1 and 2 go away; safekeeper 0 alone receives more WAL of term 1,
    // which therefore never commits.
    cluster.kill(1, &mut [&mut w1]);
    cluster.kill(2, &mut [&mut w1]);
    let divergent = batch(6, 6, 600);
    w1.append(&mut cluster, &divergent).await.expect("append");
    assert_eq!(w1.commit_lsn, end);
    assert_eq!(
        cluster.acceptor(0).flush_lsn().0,
        (committed.len() + divergent.len()) as u64
    );

    // Safekeeper 0 goes away, 1 and 2 come back and elect a new writer without it.
    cluster.kill(0, &mut [&mut w1]);
    cluster.start(1).await;
    cluster.start(2).await;
    let mut w2 = Writer::new(3, 1);
    w2.connect_all(&mut cluster).await;
    assert_eq!(w2.elected, Some((2, end)));
    let fresh = batch(100, 3, 300);
    let end2 = w2.append(&mut cluster, &fresh).await.expect("append");
    assert_eq!(w2.commit_lsn, end2);

    // Safekeeper 0 returns: its divergent tail is cut, the new term's WAL replaces it.
    cluster.start(0).await;
    w2.connect_all(&mut cluster).await;
    let all = concat(&[&committed, &fresh]);
    for i in 0..3 {
        assert!(cluster.wal(i).await == all, "safekeeper {i}");
    }
    assert!(cluster.acceptor(0).commit_lsn() >= end);
}

/// Five 800-byte records on all three safekeepers, then `missed` more while
/// safekeeper 2 is down; then safekeeper 0 goes away and 2 comes back, so 2
/// must vote in the next election and a new writer must read the WAL it
/// misses from the donor (safekeeper 1). Returns both batches and the end.
async fn leave_safekeeper_2_behind(cluster: &mut Cluster, missed: u64) -> (Bytes, Bytes, Lsn) {
    let mut w1 = Writer::new(3, 0);
    w1.connect_all(cluster).await;
    let first = batch(0, 5, 800);
    w1.append(cluster, &first).await.expect("append");
    cluster.kill(2, &mut [&mut w1]);
    let second = batch(5, missed, 800);
    let end = w1.append(cluster, &second).await.expect("append");
    assert_eq!(w1.commit_lsn, end);
    drop(w1);
    cluster.kill(0, &mut []);
    cluster.start(2).await;
    (first, second, end)
}

/// The most a recovery read of [`long_lag`]'s writer reads at once: a few
/// records, and not at record boundaries.
const READ: u64 = 3001;

/// Safekeeper 2 left 40 records behind, and the next writer (not connected
/// yet), which reads what 2 misses in reads of at most [`READ`].
async fn long_lag() -> (Cluster, Writer, Bytes, Bytes, Lsn) {
    let mut cluster = Cluster::new(3).await;
    let (first, second, end) = leave_safekeeper_2_behind(&mut cluster, 40).await;
    let w2 = Writer::with(3, 1, |c| c.max_read_wal_bytes = READ);
    (cluster, w2, first, second, end)
}

#[tokio::test]
async fn lagging_voter_is_caught_up_from_the_donor() {
    let mut cluster = Cluster::new(3).await;
    let (first, second, end) = leave_safekeeper_2_behind(&mut cluster, 20).await;
    let mut w2 = Writer::new(3, 1);
    w2.connect_all(&mut cluster).await;
    assert_eq!(w2.elected, Some((2, end)));
    let third = batch(25, 2, 800);
    let end3 = w2.append(&mut cluster, &third).await.expect("append");
    assert_eq!(w2.commit_lsn, end3, "safekeepers 1 and 2 commit together");
    let all = concat(&[&first, &second, &third]);
    assert!(cluster.wal(1).await == all);
    assert!(
        cluster.wal(2).await == all,
        "the lagging voter got the donor's WAL"
    );
}

/// A lag longer than one recovery read is read in several, each within the
/// limit and split anywhere (not at record boundaries), and the lagging
/// safekeeper ends with the donor's WAL byte for byte. A read above the
/// protocol's limit is refused.
#[tokio::test]
async fn a_long_lag_is_read_from_the_donor_in_bounded_reads() {
    let (mut cluster, mut w2, first, second, end) = long_lag().await;
    w2.connect_all(&mut cluster).await;
    let reads = w2.reads.clone();
    assert_eq!(w2.elected, Some((2, end)));
    let lag = end.distance_from(Lsn(first.len() as u64));
    assert!(reads.len() as u64 >= lag / READ, "{reads:?}");
    assert!(
        reads.iter().all(|(b, e)| e.distance_from(*b) <= READ),
        "{reads:?}"
    );
    assert!(
        reads.windows(2).all(|w| w[0].1 == w[1].0),
        "one read after the other: {reads:?}"
    );
    assert_eq!(reads.last().map(|r| r.1), Some(end));
    let all = concat(&[&first, &second]);
    assert!(
        cluster.wal(2).await == all,
        "the lagging safekeeper got the donor's WAL"
    );

    // A read above the limit: refused, nothing read.
    let acceptor = cluster.acceptors[1].as_mut().expect("running");
    let replies = acceptor
        .handle_batch(
            vec![ToSafekeeper::ReadWal {
                term: 2,
                begin_lsn: Lsn(0),
                end_lsn: Lsn(ferry_wal::proto::MAX_READ_WAL_BYTES + 1),
            }],
            &mut Default::default(),
        )
        .await
        .expect("storage");
    assert!(
        matches!(&replies[..], [ferry_wal::proto::FromSafekeeper::Refused { reason, .. }] if reason.contains("more than")),
        "{replies:?}"
    );
}

/// A recovery read that fails midway (the source's backup read failed, or
/// its connection broke) resumes where it stopped once a source is back:
/// nothing already received is read again, so a long read over a flaky
/// object store still ends.
#[tokio::test]
async fn a_failed_recovery_read_resumes_where_it_stopped() {
    let (mut cluster, mut w2, first, second, end) = long_lag().await;
    w2.failing_reads = vec![2, 5];
    w2.connect_all(&mut cluster).await;
    assert_eq!(w2.elected, Some((2, end)));
    // The donor (the only source) refused read 2: the read waits for it.
    assert_eq!(w2.reads.len(), 3, "{:?}", w2.reads);
    w2.connect_all(&mut cluster).await;
    assert_eq!(w2.reads.len(), 6, "read 5 refused too: {:?}", w2.reads);
    w2.connect_all(&mut cluster).await;
    let reads = w2.reads.clone();
    assert_eq!(reads.first().map(|r| r.0), Some(Lsn(first.len() as u64)));
    for (i, pair) in reads.windows(2).enumerate() {
        let expected_begin = if w2.failing_reads.contains(&i) {
            pair[0].0 // the refused read is asked again, from its own start
        } else {
            pair[0].1
        };
        assert_eq!(pair[1].0, expected_begin, "read {}: {reads:?}", i + 1);
    }
    assert_eq!(reads.last().map(|r| r.1), Some(end));
    let all = concat(&[&first, &second]);
    assert!(
        cluster.wal(2).await == all,
        "the lagging safekeeper got the donor's WAL"
    );
    let third = batch(45, 2, 800);
    let end3 = w2.append(&mut cluster, &third).await.expect("append");
    assert_eq!(w2.commit_lsn, end3, "safekeepers 1 and 2 commit together");
}

/// Delivers `msg` to safekeeper `to` and hands every answer to `proposer`;
/// returns the proposer's resulting actions.
async fn deliver(
    cluster: &mut Cluster,
    proposer: &mut Proposer,
    to: usize,
    msg: ToSafekeeper,
) -> Vec<Action> {
    let acceptor = cluster.acceptors[to].as_mut().expect("running");
    let replies = acceptor
        .handle_batch(vec![msg], &mut Default::default())
        .await
        .expect("storage");
    let mut actions = Vec::new();
    for reply in replies {
        actions.extend(proposer.on_message(to, reply));
    }
    actions
}

/// The messages among `actions`, in order.
fn sends(actions: Vec<Action>) -> Vec<(usize, ToSafekeeper)> {
    actions
        .into_iter()
        .filter_map(|a| match a {
            Action::Send { to, msg } => Some((to, msg)),
            _ => None,
        })
        .collect()
}

/// Delivers messages (and the answers' follow-ups) until none is left, except
/// those `keep` refuses, which are dropped.
async fn settle(
    cluster: &mut Cluster,
    proposer: &mut Proposer,
    actions: Vec<Action>,
    keep: impl Fn(usize, &ToSafekeeper) -> bool,
) {
    let mut queue: std::collections::VecDeque<(usize, ToSafekeeper)> = sends(actions).into();
    while let Some((to, msg)) = queue.pop_front() {
        if !keep(to, &msg) || cluster.acceptors[to].is_none() {
            continue;
        }
        let more = deliver(cluster, proposer, to, msg).await;
        queue.extend(sends(more));
    }
}

fn config_with_small_appends(min_term: Term) -> ProposerConfig {
    let mut config = ProposerConfig::new(cluster_id(), 3, TIMELINE, SEG, 7 + min_term as u128);
    config.min_term = min_term;
    // One 50-byte record per append, so a safekeeper can be left half-way.
    config.max_append_bytes = 50;
    config
}

/// Raft's "figure 8" on three safekeepers: WAL of an older term that a new writer
/// has brought to a quorum must not count as committed until the new term's
/// start is on a quorum too, because a later election may still replace it.
#[tokio::test]
async fn no_commit_from_a_previous_term() {
    let mut cluster = Cluster::new(3).await;
    let record = |block: u64| batch(block, 1, 10); // 50 bytes each
    assert_eq!(record(0).len(), 50);

    // Term 1: safekeeper 0 alone gets two records (X), never committed.
    let mut w1 = Writer::new(3, 0);
    w1.connect_all(&mut cluster).await;
    cluster.kill(1, &mut [&mut w1]);
    cluster.kill(2, &mut [&mut w1]);
    let mut x = record(1).to_vec();
    x.extend_from_slice(&record(2));
    w1.append(&mut cluster, &x).await.expect("append");
    assert_eq!(w1.commit_lsn, Lsn(0));
    cluster.kill(0, &mut [&mut w1]);

    // Term 2: elected by 1 and 2, but its election message to 1 is lost; only
    // safekeeper 2 receives its two records (Z).
    cluster.start(1).await;
    cluster.start(2).await;
    let mut w2 = Proposer::new(config_with_small_appends(1));
    let mut actions = w2.on_connected(1);
    actions.extend(w2.on_connected(2));
    settle(&mut cluster, &mut w2, actions, |to, msg| {
        !(to == 1 && matches!(msg, ToSafekeeper::Elected(_)))
    })
    .await;
    assert_eq!(w2.term(), 2);
    assert!(w2.is_elected());
    let mut z = record(10).to_vec();
    z.extend_from_slice(&record(11));
    let (_, actions) = w2.append(&Bytes::from(z.clone())).expect("append");
    settle(&mut cluster, &mut w2, actions, |to, _| to == 2).await;
    assert_eq!(cluster.acceptor(2).flush_lsn(), Lsn(100));
    assert_eq!(cluster.acceptor(1).flush_lsn(), Lsn(0));
    assert_eq!(w2.commit_lsn(), Lsn(0), "one safekeeper cannot commit");
    cluster.acceptors[2] = None;

    // Term 3: elected by 0 and 1. Safekeeper 0 is the donor (term 1, 100 bytes):
    // the epoch starts at 100 with X. Safekeeper 1 receives only X's first record.
    cluster.start(0).await;
    let mut w3 = Proposer::new(config_with_small_appends(2));
    let mut actions = w3.on_connected(0);
    actions.extend(w3.on_connected(1));
    let mut appends_to_1 = 0;
    let mut queue: std::collections::VecDeque<(usize, ToSafekeeper)> = sends(actions).into();
    while let Some((to, msg)) = queue.pop_front() {
        if to == 1 && matches!(msg, ToSafekeeper::Append(ref a) if !a.wal.is_empty()) {
            appends_to_1 += 1;
            if appends_to_1 > 1 {
                continue;
            }
        }
        let more = deliver(&mut cluster, &mut w3, to, msg).await;
        queue.extend(sends(more));
    }
    assert_eq!(w3.epoch_start_lsn(), Lsn(100));
    assert_eq!(
        cluster.acceptor(1).flush_lsn(),
        Lsn(50),
        "half of X reached safekeeper 1"
    );
    // Two safekeepers now hold X's first record, but it is WAL of term 1: it must
    // not be reported committed.
    assert_eq!(w3.commit_lsn(), Lsn(0), "no commit from a previous term");

    // Why: term 4 is elected by 1 and 2 without 0, and safekeeper 2's term-2 WAL
    // (Z) wins over X. Had X's first record been acknowledged, it would be lost now.
    cluster.acceptors[0] = None;
    cluster.start(2).await;
    let mut w4 = Writer::new(3, 3);
    w4.connect_all(&mut cluster).await;
    assert_eq!(w4.elected, Some((4, Lsn(100))));
    assert!(cluster.wal(1).await == z, "safekeeper 1 now holds Z, not X");
    assert!(cluster.wal(2).await == z);
}

#[tokio::test]
async fn a_stale_higher_term_loses_one_election_not_the_writer() {
    let mut cluster = Cluster::new(3).await;
    // A writer that died after asking only safekeeper 2 for a vote in term 7.
    cluster.acceptors[2]
        .as_mut()
        .expect("running")
        .handle_vote(7)
        .await
        .expect("vote");
    // The next writer greets a quorum at term 0 and asks for votes in term 1;
    // safekeeper 2's greeting then shows term 7: this attempt is lost, but the
    // writer is not superseded (it never was elected, nothing was promised).
    let mut w = Writer::new(3, 0);
    w.connect_all(&mut cluster).await;
    assert_eq!(w.lost, Some(7));
    assert_eq!(w.superseded, None);
    assert!(w.elected.is_none());
    assert!(w.proposer.lost_election());
    assert!(matches!(
        w.proposer.append(&batch(0, 1, 10)),
        Err(ProposerError::NotElected)
    ));
    // The next attempt (what the driver starts on its next tick) goes above it.
    let mut retry = Writer::new(3, w.proposer.term());
    retry.connect_all(&mut cluster).await;
    assert_eq!(retry.elected.map(|(term, _)| term), Some(8));
    let records = batch(0, 3, 100);
    let end = retry.append(&mut cluster, &records).await.expect("append");
    assert_eq!(retry.commit_lsn, end);
}

/// A writer that knows (from the coordination store) what was committed never
/// gets elected by voters that all lack it: it waits for the others, and
/// stops once every safekeeper answered without it.
#[tokio::test]
async fn an_election_never_starts_below_the_known_commit() {
    let (mut cluster, mut w1) = connected().await;
    // Committed on sk0 and sk1 only.
    cluster.kill(2, &mut [&mut w1]);
    let records = batch(0, 10, 500);
    let end = w1.append(&mut cluster, &records).await.expect("append");
    assert_eq!(w1.commit_lsn, end);
    cluster.kill(0, &mut [&mut w1]);
    cluster.kill(1, &mut [&mut w1]);
    cluster.start(2).await;
    // sk0's data is lost and it comes back empty: sk0 and sk2 are a quorum
    // of voters, neither holds the committed WAL.
    cluster.wipe(0, &mut []).await;

    let mut config = ProposerConfig::new(cluster_id(), 3, TIMELINE, SEG, 43);
    config.min_term = 1;
    config.known_commit_lsn = end;
    let mut w2 = Writer {
        proposer: Proposer::new(config.clone()),
        ..Writer::new(3, 1)
    };
    w2.connect_all(&mut cluster).await;
    assert_eq!(w2.elected, None, "not elected below the known commit");
    assert_eq!(w2.behind, Some((Lsn(0), end, false)), "waiting for sk1");
    // sk1 holds it: with its vote the election completes, keeping the WAL.
    cluster.start(1).await;
    w2.connect_all(&mut cluster).await;
    let (_, epoch_start) = w2.elected.expect("elected once sk1 voted");
    assert_eq!(epoch_start, end);

    // Every safekeeper answers and none holds the known commit (the quorum
    // was restored from an older copy): the writer stops.
    let mut cluster = Cluster::new(3).await;
    let mut w3 = Writer {
        proposer: Proposer::new(config),
        ..Writer::new(3, 1)
    };
    w3.connect_all(&mut cluster).await;
    assert_eq!(w3.elected, None);
    assert_eq!(w3.behind, Some((Lsn(0), end, true)));
    assert!(matches!(
        w3.proposer.append(&batch(0, 1, 10)),
        Err(ProposerError::Superseded(_))
    ));
}

#[tokio::test]
async fn a_restored_safekeeper_is_brought_back_by_a_current_writer_only() {
    let (mut cluster, mut old) = connected().await;
    let mut all = Vec::new();
    for i in 0..20 {
        old.append_to(&mut cluster, &mut all, batch(i * 4, 4, 3000))
            .await;
    }
    assert_eq!(old.commit_lsn, Lsn(all.len() as u64));
    let restored = cluster.restore(2, &all, 3, &mut [&mut old]).await;
    assert!(restored > Lsn(2 * SEG) && restored <= Lsn(3 * SEG));
    assert!(cluster.wal(2).await == all[..restored.0 as usize]);

    // A new writer is elected by the two others; the restored one, in its
    // quarantine, is greeted again later.
    let mut new = Writer::new(3, old.proposer.term());
    new.connect_all(&mut cluster).await;
    assert!(new.elected.is_some(), "elected by safekeepers 0 and 1");
    assert!(!new.connected[2], "quarantine: greeted again later");
    assert_eq!(cluster.acceptor(2).term(), 0, "it voted for nobody");

    // After the quarantine, the superseded writer greets it first: its probe
    // to the others meets the new term, so it stops and never brings the
    // restored safekeeper in.
    cluster.acceptors[2]
        .as_mut()
        .expect("running")
        .end_quarantine();
    old.connect_all(&mut cluster).await;
    assert_eq!(old.superseded, Some(new.proposer.term()));
    assert_eq!(cluster.acceptor(2).restored_up_to(), Some(restored));

    // The current writer brings it back and catches it up from the donor.
    new.connect_all(&mut cluster).await;
    assert_eq!(cluster.acceptor(2).restored_up_to(), None);
    assert_eq!(cluster.acceptor(2).term(), new.proposer.term());
    for i in 20..24 {
        new.append_to(&mut cluster, &mut all, batch(i * 4, 4, 3000))
            .await;
    }
    // It counts in the quorum again: with safekeeper 0 down, writes commit.
    cluster.kill(0, &mut [&mut new]);
    let end = new
        .append_to(&mut cluster, &mut all, batch(100, 4, 3000))
        .await;
    assert_eq!(new.commit_lsn, end, "committed by safekeepers 1 and 2");
    for i in 1..3 {
        assert!(
            cluster.wal(i).await == all,
            "safekeeper {i} holds every acknowledged byte"
        );
    }
}

fn members(ids: &[u64]) -> Vec<ferry_wal::membership::Member> {
    ids.iter()
        .map(|&id| ferry_wal::membership::Member {
            id,
            addr: format!("sk{id}"),
        })
        .collect()
}

/// During a change (old set {0, 1, 2}, new set {0, 1, 3}) an election and
/// every commit need a majority of both sets; a writer of the generation
/// before learns the joint one at its greeting and starts over with it.
#[tokio::test]
async fn a_joint_configuration_needs_both_majorities_and_an_older_writer_starts_over() {
    use ferry_wal::membership::Configuration;
    let mut cluster = Cluster::new(4).await;
    let initial = Configuration::initial(members(&[0, 1, 2])).expect("initial");
    let joint = initial.joint(members(&[0, 1, 3])).expect("joint");
    // The change driver handed it to all four (a safekeeper takes its
    // first configuration from the driver only).
    cluster.configure(&[0, 1, 2, 3], &joint).await;

    // Only 2 and 3 up: a majority of neither set alone... nor both.
    cluster.kill(0, &mut []);
    cluster.kill(1, &mut []);
    let mut w = Writer::with(4, 0, |c| c.configuration = Some(joint.clone()));
    w.connect_all(&mut cluster).await;
    assert_eq!(
        w.elected, None,
        "{{2, 3}} is no quorum of a joint configuration"
    );
    // With 0: {0, 2} of the old set, {0, 3} of the new one.
    cluster.start(0).await;
    w.connect_all(&mut cluster).await;
    assert!(w.elected.is_some(), "elected by both majorities");
    let records = batch(0, 5, 300);
    let end = w.append(&mut cluster, &records).await.expect("append");
    assert_eq!(w.commit_lsn, end);
    // Without 3, the new set has only 0 up: nothing commits.
    cluster.kill(3, &mut [&mut w]);
    let more = batch(5, 5, 300);
    let end2 = w.append(&mut cluster, &more).await.expect("append");
    assert_eq!(
        w.commit_lsn, end,
        "no commit without a majority of the new set"
    );
    cluster.start(1).await;
    w.connect_all(&mut cluster).await;
    let heartbeat = w.proposer.heartbeat();
    w.absorb(heartbeat);
    w.run(&mut cluster).await;
    assert_eq!(w.commit_lsn, end2, "{{0, 1}} is a majority of both sets");
    for i in [0, 1, 2] {
        assert_eq!(
            cluster.acceptor(i).configuration(),
            Some(&joint),
            "safekeeper {i} adopted the writer's configuration"
        );
    }

    // A writer of generation 1 greets a safekeeper of generation 2: it
    // stops and starts over with the joint configuration, having written
    // nothing.
    let mut old = Writer::with(3, w.proposer.term(), |c| {
        c.configuration = Some(initial.clone())
    });
    old.connect_all(&mut cluster).await;
    assert_eq!(old.reconfigured.as_ref(), Some(&joint));
    assert_eq!(old.elected, None);
    assert_eq!(
        cluster.acceptor(0).term(),
        w.proposer.term(),
        "no term moved"
    );
}

/// An elected writer whose safekeepers took a joint configuration (from
/// the change driver) keeps its term and its appends: it greets every
/// member again with the new configuration, connects to the new member,
/// and commits under both majorities from then on.
#[tokio::test]
async fn an_elected_writer_takes_a_newer_configuration_in_place() {
    use ferry_wal::membership::Configuration;
    let mut cluster = Cluster::new(4).await;
    let initial = Configuration::initial(members(&[0, 1, 2])).expect("initial");
    let joint = initial.joint(members(&[0, 1, 3])).expect("joint");
    cluster.configure(&[0, 1, 2], &initial).await;
    let mut w = Writer::with(3, 0, |c| c.configuration = Some(initial.clone()));
    w.connect_all(&mut cluster).await;
    let (term, _) = w.elected.expect("elected");
    let mut all = Vec::new();
    let first = w.append_to(&mut cluster, &mut all, batch(0, 5, 300)).await;
    assert_eq!(w.commit_lsn, first);
    // The change driver hands the joint configuration to 0 and 1, and to
    // the new member 3.
    cluster.configure(&[0, 1, 3], &joint).await;
    // The next appends are refused by 0 and 1 (an older generation); the
    // writer greets them again, learns the joint configuration, and goes on
    // in its term.
    let second = w.append_to(&mut cluster, &mut all, batch(5, 5, 300)).await;
    assert_eq!(w.reconfigured.as_ref(), Some(&joint));
    assert_eq!(w.proposer.generation(), joint.generation);
    w.connect_all(&mut cluster).await;
    let heartbeat = w.proposer.heartbeat();
    w.absorb(heartbeat);
    w.run(&mut cluster).await;
    assert_eq!(w.superseded, None);
    assert_eq!(w.proposer.term(), term, "the same term");
    assert_eq!(w.commit_lsn, second, "committed under both majorities");
    for i in 0..4 {
        assert_eq!(
            cluster.acceptor(i).configuration(),
            Some(&joint),
            "safekeeper {i} holds the joint configuration"
        );
        assert!(cluster.wal(i).await == all, "safekeeper {i} holds the WAL");
    }
}
