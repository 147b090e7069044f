//! WAL backup and removal with the writer and three safekeepers over loopback
//! TCP: one safekeeper uploads every whole committed segment to a local
//! folder, backup_lsn reaches every safekeeper, nothing is removed before a
//! replica reported, then segments go behind every consumer; a replica
//! asking for removed WAL is served from the backup, and with
//! `walsenders_keep_horizon` a lagging walsender keeps its WAL locally.
//! A clean shutdown can wait until every replica applied the committed WAL,
//! and with a lag limit one slow shard holds the writer back, losing nothing.
//! Safekeepers short of disk space refuse appends, the writer refuses new
//! ones at once while too few are left, and both go on by themselves once
//! space returns, losing nothing.

// The test sets up its backup folder directly; node code may not.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_env::{Disk, Network, RealDisk, TcpNetwork};
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig, AcceptorStatus};
use ferry_safekeeper::backup::{segment_key, BackupConfig};
use ferry_safekeeper::server::{SafekeeperServer, ServerConfig};
use ferry_testkit::walsender::{Streamed, Walsender};
use ferry_testkit::writer::status_reaches;
use ferry_wal::proto::{self, FromSafekeeper, ShardFeedback, ToSafekeeper};
use ferry_wal::record::Record;
use ferry_wal::segment::SegmentSize;
use ferry_wal::Lsn;
use ferry_writer::driver::{encode_records, Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;

/// The smallest segment size: many segments from little WAL.
const SEG: u64 = 64 << 10;
const SOON: Duration = Duration::from_secs(30);

fn cluster_id() -> ferry_wal::ClusterId {
    ferry_wal::ClusterId::new("backup-test").expect("id")
}

fn seg() -> SegmentSize {
    SegmentSize::new(SEG).expect("segment size")
}

struct Cluster {
    _dir: tempfile::TempDir,
    /// The cluster's folder of the backup location.
    backup: ferry_storage::Location,
    servers: Vec<SafekeeperServer>,
}

async fn cluster(keep_horizon: bool) -> Cluster {
    cluster_with(keep_horizon, None).await
}

async fn cluster_with(
    keep_horizon: bool,
    partial_backup: Option<ferry_safekeeper::partial::PartialBackupConfig>,
) -> Cluster {
    cluster_of(keep_horizon, partial_backup, true).await
}

async fn cluster_of(
    keep_horizon: bool,
    partial_backup: Option<ferry_safekeeper::partial::PartialBackupConfig>,
    with_backup: bool,
) -> Cluster {
    cluster_expiring(
        keep_horizon,
        partial_backup,
        with_backup,
        Default::default(),
    )
    .await
}

async fn cluster_expiring(
    keep_horizon: bool,
    partial_backup: Option<ferry_safekeeper::partial::PartialBackupConfig>,
    with_backup: bool,
    defaults: ServerConfig,
) -> Cluster {
    let dir = tempfile::tempdir().expect("tempdir");
    let backup_dir = dir.path().join("backup");
    std::fs::create_dir_all(&backup_dir).expect("backup dir");
    let backup = ferry_storage::open(
        &format!("file://{}", backup_dir.display()),
        &Default::default(),
    )
    .expect("backup location");
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
    let mut servers = Vec::new();
    for id in 0..3 {
        let acceptor = Acceptor::create(
            Arc::clone(&disk),
            &format!("sk{id}"),
            AcceptorConfig {
                cluster_id: cluster_id(),
                node_id: id,
                timeline_id: 1,
                segment_size: seg(),
                preallocation: Default::default(),
            },
        )
        .await
        .expect("create");
        let listener = TcpNetwork.bind("127.0.0.1:0").await.expect("bind");
        let config = ServerConfig {
            backup: with_backup.then(|| BackupConfig {
                location: backup.clone(),
                parallel_jobs: 3,
            }),
            walsenders_keep_horizon: keep_horizon,
            removal_interval: Duration::from_millis(20),
            remove_wal: true,
            partial_backup,
            ..defaults.clone()
        };
        servers.push(SafekeeperServer::serve_with(listener, acceptor, config).expect("serve"));
    }
    Cluster {
        _dir: dir,
        // What the safekeepers write: the cluster's folder of the location.
        backup: ferry_safekeeper::backup::cluster_folder(&backup, &cluster_id())
            .expect("cluster folder"),
        servers,
    }
}

impl Cluster {
    fn writer(&self) -> Writer {
        self.writer_with(Default::default())
    }

    fn writer_with(&self, back_pressure: ferry_writer::driver::BackPressure) -> Writer {
        let mut config = WriterConfig::new(
            self.servers.iter().map(|s| s.addr().to_string()).collect(),
            ProposerConfig::new(cluster_id(), 3, 1, SEG, 5),
        );
        config.reconnect_delay = Duration::from_millis(50);
        config.heartbeat = Duration::from_millis(20);
        config.back_pressure = back_pressure;
        Writer::start(Arc::new(TcpNetwork), config)
    }

    async fn statuses(&self) -> Vec<AcceptorStatus> {
        let mut out = Vec::new();
        for s in &self.servers {
            out.push(s.status().await);
        }
        out
    }

    /// Waits until every safekeeper's status satisfies `ok` (each status is
    /// re-read every few milliseconds: the condition is the safekeepers' own
    /// progress, which no event of the test marks).
    async fn wait_all(&self, what: &str, ok: impl Fn(&AcceptorStatus) -> bool) {
        let deadline = tokio::time::Instant::now() + SOON;
        loop {
            let statuses = self.statuses().await;
            if statuses.iter().all(&ok) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: {statuses:#?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn lsn(s: &str) -> Lsn {
    s.parse().expect("lsn")
}

/// Appends inserts until `bytes` of WAL are committed; returns the WAL
/// (which starts where the writer's term started: 0 for the first writer).
async fn write_wal(writer: &Writer, bytes: u64) -> Vec<u8> {
    let mut wal = Vec::new();
    let mut block = 0;
    let mut start = None;
    while (wal.len() as u64) < bytes {
        let records = ferry_testkit::wal::insert(4, block, 3000);
        wal.extend_from_slice(&records);
        let len = records.len() as u64;
        let end = writer.append(records).await.expect("append");
        let start = *start.get_or_insert(end.0 - len);
        assert_eq!(end, Lsn(start + wal.len() as u64));
        block += 1;
    }
    wal
}

/// A replica of `shard` streaming from `start` on the safekeeper at `addr`,
/// which reported once that it applied everything below `applied`.
async fn reporting(addr: &str, shard: u32, start: Lsn, applied: Lsn) -> Walsender {
    let mut conn = Walsender::start(&TcpNetwork, addr, shard, start).await;
    conn.report_applied(applied, 1).await.expect("feedback");
    conn
}

/// WAL streamed on `conn` from `start` up to `end`.
async fn receive(conn: &mut Walsender, start: Lsn, end: Lsn) -> Bytes {
    let received = conn.read_until(start, end, SOON).await.wal;
    received.slice(..end.distance_from(start) as usize)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_are_backed_up_removed_behind_every_consumer_and_read_back() {
    let c = cluster(false).await;
    let writer = c.writer();
    let wal = write_wal(&writer, 10 * SEG + 100).await;

    // Every whole committed segment is in the backup, and every safekeeper
    // learns it through the writer.
    c.wait_all("backup_lsn reaches 10 segments everywhere", |s| {
        lsn(&s.backup_lsn) >= Lsn(10 * SEG)
    })
    .await;
    for segno in 0..10 {
        let object = c
            .backup
            .get(&segment_key(seg(), segno))
            .await
            .expect("segment object");
        let at = (segno * SEG) as usize;
        assert!(
            object[..] == wal[at..at + SEG as usize],
            "segment {segno} in the backup is the committed WAL"
        );
    }
    let statuses = c.statuses().await;
    let on_duty: Vec<u64> = statuses
        .iter()
        .filter(|s| s.backup_duty)
        .map(|s| s.node_id)
        .collect();
    assert_eq!(
        on_duty.len(),
        1,
        "one safekeeper has the duty: {statuses:#?}"
    );
    let uploads: u64 = statuses.iter().map(|s| s.backup_uploads).sum();
    assert_eq!(uploads, 10, "each segment uploaded once: {statuses:#?}");
    assert!(
        statuses.iter().all(|s| s.last_removed_segno == 0),
        "no replica reported: nothing is removed"
    );

    // A replica of shard 0 applied 6 segments: the writer relays it, and
    // every safekeeper removes the segments below.
    let replica = reporting(c.servers[0].addr(), 0, Lsn(6 * SEG), Lsn(6 * SEG + 10)).await;
    c.wait_all("segments below 6 removed everywhere", |s| {
        s.last_removed_segno == 6 && s.segments_removed == 6
    })
    .await;

    // A replica that lost its parts starts again from the beginning: the
    // removed WAL comes from the backup, the rest from the safekeeper.
    let end = Lsn(wal.len() as u64);
    for server in &c.servers {
        let mut fresh = Walsender::start(&TcpNetwork, server.addr(), 1, Lsn(0)).await;
        let got = receive(&mut fresh, Lsn(0), end).await;
        assert!(got == wal, "the whole WAL, partly from the backup");
    }
    drop(replica);
    writer.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_walsender_keeps_its_wal_with_keep_horizon() {
    let c = cluster(true).await;
    let writer = c.writer();
    // A slow replica of shard 1 streams from safekeeper 0 and has received
    // nothing yet.
    let mut slow = Walsender::start(&TcpNetwork, c.servers[0].addr(), 1, Lsn(0)).await;
    let wal = write_wal(&writer, 8 * SEG).await;
    // The slow one reports what it received, so it is registered, at 0, and
    // the writer relays that to every safekeeper.
    slow.report_applied(Lsn(0), 1).await.expect("feedback");
    c.wait_all("the writer relays the slow replica", |s| {
        s.writer_remote_consistent_lsn.as_deref() == Some("0/0")
    })
    .await;
    // A fast replica of shard 0 applied everything, through safekeeper 1.
    let fast = reporting(c.servers[1].addr(), 0, Lsn(7 * SEG), Lsn(7 * SEG)).await;
    c.wait_all("backed up", |s| lsn(&s.backup_lsn) >= Lsn(7 * SEG))
        .await;
    // The fast replica alone would let safekeepers 1 and 2 remove up to 7
    // segments; the slow replica's registration holds all of them back.
    let statuses = c.statuses().await;
    assert!(
        statuses.iter().all(|s| s.last_removed_segno == 0),
        "a registered replica at 0 keeps every segment: {statuses:#?}"
    );
    // The slow replica moves its applied position on (its parts reached
    // object storage) but has not received more: keep-horizon still keeps
    // WAL on the safekeeper its walsender reads from, while the others
    // remove.
    slow.send_feedback(ShardFeedback {
        shard_number: 1,
        replica_number: 0,
        last_received_lsn: Lsn(0),
        disk_consistent_lsn: Lsn(0),
        remote_consistent_lsn: Lsn(7 * SEG),
        reply_time_micros: 2,
    })
    .await
    .expect("feedback");
    c.wait_all("safekeepers without the walsender remove", |s| {
        s.node_id == 0 || s.last_removed_segno == 7
    })
    .await;
    assert_eq!(
        c.statuses().await[0].last_removed_segno,
        0,
        "the slow walsender's WAL stays on safekeeper 0"
    );
    let got = receive(&mut slow, Lsn(0), Lsn(wal.len() as u64)).await;
    assert!(got == wal, "the slow replica reads it all locally");
    drop((slow, fast));
    writer.shutdown().await.expect("clean shutdown");
}

/// A replica of `shard` that applies (here: receives) every committed byte
/// from `addr` and reports it after each frame.
async fn follow(addr: String, shard: u32) {
    let mut conn = Walsender::start(&TcpNetwork, &addr, shard, Lsn(0)).await;
    let mut at = Lsn(0);
    let mut reply_time = 0;
    while let Ok(Some(frame)) = conn.next().await {
        if let Streamed::Wal { begin_lsn, wal, .. } = frame {
            assert_eq!(begin_lsn, at, "contiguous");
            at = Lsn(at.0 + wal.len() as u64);
            reply_time += 1;
            conn.report_applied(at, reply_time).await.expect("feedback");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_waits_until_every_replica_applied_the_committed_wal() {
    let c = cluster(false).await;
    let writer = c.writer();
    let replica = tokio::spawn(follow(c.servers[2].addr().to_string(), 0));
    let wal = write_wal(&writer, 3 * SEG).await;
    let end = writer
        .shutdown_and_wait_for_replicas(&[(0, 0)], SOON)
        .await
        .expect("the replica applies everything");
    assert!(end > Lsn(wal.len() as u64), "past the checkpoint");
    replica.abort();

    // A replica that never reports makes the wait fail, naming it.
    let writer = c.writer();
    write_wal(&writer, SEG).await;
    let err = writer
        .shutdown_and_wait_for_replicas(&[(0, 0), (5, 1)], Duration::from_millis(300))
        .await
        .expect_err("replica (5, 1) never reports");
    match err {
        ferry_writer::driver::WriterError::ReplicasBehind { behind, .. } => {
            assert_eq!(
                behind,
                vec![(0, 0), (5, 1)],
                "nobody follows after the first writer: both are behind"
            );
        }
        other => panic!("unexpected {other}"),
    }
}

/// A replica of `shard` that receives everything from `addr` but applies at
/// most `pace` bytes every 10 ms, reporting what it applied.
async fn slow_follow(addr: String, shard: u32, pace: u64) {
    let mut conn = Walsender::start(&TcpNetwork, &addr, shard, Lsn(0)).await;
    let mut streaming = true;
    let mut received = 0u64;
    let mut applied = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut reply_time = 0;
    loop {
        tokio::select! {
            frame = conn.next(), if streaming => match frame {
                Ok(Some(Streamed::Wal { wal, .. })) => received += wal.len() as u64,
                Ok(Some(Streamed::Keepalive { .. })) => {}
                Ok(None) | Err(_) => streaming = false,
            },
            _ = tick.tick() => {
                reply_time += 1;
                applied = received.min(applied + pace);
                if conn.report_applied(Lsn(applied), reply_time).await.is_err() {
                    return;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_shard_holds_the_writer_back_within_the_limit_and_loses_nothing() {
    const LIMIT: u64 = 256 << 10;
    let c = cluster(false).await;
    let writer = Arc::new(c.writer_with(ferry_writer::driver::BackPressure {
        max_flush_lag: LIMIT,
        ..Default::default()
    }));
    let fast = tokio::spawn(follow(c.servers[0].addr().to_string(), 0));
    // 64 KiB per 10 ms: about 6 MB/s, far below what the quorum commits.
    let slow = tokio::spawn(slow_follow(c.servers[1].addr().to_string(), 1, 64 << 10));
    let mut status = writer.subscribe();
    // The slow replica reports from the start (the fast one once WAL flows).
    status_reaches(&mut status, SOON, "the slow replica reports", |s| {
        s.elected && s.replicas.iter().any(|f| f.shard_number == 1)
    })
    .await;

    // Watch every status the writer publishes while the appends run.
    let (done, mut done_rx) = tokio::sync::watch::channel(false);
    let monitor = {
        let mut status = writer.subscribe();
        tokio::spawn(async move {
            let mut worst = 0u64;
            let mut throttled = 0u64;
            loop {
                {
                    let s = status.borrow_and_update();
                    if let Some(min) = s.overall_minimum {
                        let end: Lsn = s.end_lsn.parse().expect("lsn");
                        worst = worst.max(end.distance_from(min.disk_consistent_lsn));
                    }
                    if s.back_pressure.is_some() {
                        throttled += 1;
                    }
                }
                tokio::select! {
                    biased;
                    _ = done_rx.changed() => return (worst, throttled),
                    changed = status.changed() => if changed.is_err() { return (worst, throttled) },
                }
            }
        })
    };
    let record = encode_records(&[Record::Insert {
        shard: 0,
        idempotency_key: Bytes::new(),
        table_id: 4,
        block_number: 0,
        arrow_ipc: Bytes::from(vec![7u8; 16 << 10]),
    }]);
    let record_len = record.len() as u64;
    let mut appenders = Vec::new();
    for _ in 0..8 {
        let writer = Arc::clone(&writer);
        let record = record.clone();
        appenders.push(tokio::spawn(async move {
            let mut acked = 0u64;
            for _ in 0..40 {
                writer.append(record.clone()).await.expect("acknowledged");
                acked += 1;
            }
            acked
        }));
    }
    let mut acked = 0;
    for a in appenders {
        acked += tokio::time::timeout(SOON * 2, a)
            .await
            .expect("in time")
            .expect("task");
    }
    done.send_replace(true);
    let (worst, throttled) = monitor.await.expect("monitor");
    assert_eq!(acked, 320, "every append is acknowledged");
    assert!(throttled > 0, "the slow shard held appends back");
    assert!(
        worst <= LIMIT + record_len,
        "the slowest replica stays within the limit plus one append: {worst} > {LIMIT} + {record_len}"
    );
    // Nothing is lost: the slow replica applies everything in the end.
    let writer = Arc::into_inner(writer).expect("sole owner");
    writer
        .shutdown_and_wait_for_replicas(&[(0, 0), (1, 0)], SOON * 2)
        .await
        .expect("both replicas apply all of it");
    fast.abort();
    slow.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_segments_are_backed_up_and_older_ones_removed() {
    let c = cluster_with(
        false,
        Some(ferry_safekeeper::partial::PartialBackupConfig {
            timeout: Duration::from_millis(200),
        }),
    )
    .await;
    let writer = c.writer();
    let mut wal = write_wal(&writer, SEG + SEG / 3).await;
    let partials = |end: Lsn| {
        move |s: &AcceptorStatus| {
            s.partial_uploaded.as_deref().is_some_and(|name| {
                name.contains(&format!("_{:016X}_", end.0))
                    && name.ends_with(&format!("_sk{}.partial", s.node_id))
            })
        }
    };
    let end = Lsn(wal.len() as u64);
    c.wait_all(
        "every safekeeper uploads its partial segment",
        partials(end),
    )
    .await;
    // More WAL in the same segment: a newer partial object replaces the old.
    wal.extend(write_wal(&writer, SEG / 3).await);
    let end = Lsn(wal.len() as u64);
    assert_eq!(end.0 / SEG, 1, "still in segment 1");
    c.wait_all("every safekeeper uploads the newer prefix", partials(end))
        .await;
    // Uploaded is recorded before gc deletes the older objects: wait until
    // every list holds the uploaded entry alone.
    let deadline = tokio::time::Instant::now() + SOON;
    for server in &c.servers {
        while server.partial_segments().await.len() != 1 {
            assert!(tokio::time::Instant::now() < deadline, "gc finishes");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let objects = c
        .backup
        .list(ferry_safekeeper::partial::PARTIAL_DIR)
        .await
        .expect("list");
    assert_eq!(
        objects.len(),
        3,
        "one object per safekeeper, the old ones gone: {objects:?}"
    );
    for status in c.statuses().await {
        let name = status.partial_uploaded.expect("uploaded");
        assert!(
            name.starts_with(&seg().file_name(1)),
            "named after its segment: {name}"
        );
        let object = c
            .backup
            .get(&ferry_safekeeper::partial::partial_key(&name))
            .await
            .expect("object");
        assert!(
            object[..] == wal[SEG as usize..],
            "the partial object is the flushed prefix of segment 1"
        );
        assert_eq!(status.partial_upload_failures, 0);
    }
    writer.shutdown().await.expect("clean shutdown");
}

struct NoTables;

#[async_trait::async_trait]
impl ferry_replica::Tables for NoTables {
    async fn by_id(&self, id: u64) -> Result<ferry_replica::TableRef, String> {
        Err(format!("no table {id} in this test"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_needing_wal_removed_everywhere_stops_naming_the_lsn_and_horizons() {
    let c = cluster_of(false, None, false).await;
    let writer = c.writer();
    write_wal(&writer, 6 * SEG + 100).await;
    // A replica of shard 0 applied 4 segments: without a backup the
    // safekeepers remove the segments below it.
    let shard0 = reporting(c.servers[0].addr(), 0, Lsn(4 * SEG), Lsn(4 * SEG + 10)).await;
    c.wait_all("segments below 4 removed everywhere", |s| {
        s.last_removed_segno == 4
    })
    .await;
    // A new replica of shard 1 needs the WAL from 0/0: no safekeeper has it.
    let (_dir, disk) = ferry_testkit::disk::temp_disk();
    let replica = ferry_replica::Replica::open(
        disk,
        "s1r0",
        1,
        0,
        ferry_env::Cpu::Inline,
        Arc::new(NoTables),
    )
    .await
    .expect("replica");
    let mut config =
        ferry_replica::StreamConfig::new(c.servers.iter().map(|s| s.addr().to_string()).collect());
    config.reconnect_delay = Duration::from_millis(10);
    let stopped = tokio::time::timeout(
        SOON,
        ferry_replica::stream::run(
            Arc::new(tokio::sync::Mutex::new(replica)),
            Arc::new(TcpNetwork),
            Arc::new(ferry_env::SystemClock),
            config,
        ),
    )
    .await
    .expect("the replica stops instead of looping");
    match &stopped {
        ferry_replica::ReplicaError::WalRemoved { needed, horizons } => {
            assert_eq!(*needed, Lsn(0));
            assert_eq!(
                horizons
                    .matches(&format!("holds WAL from {}", Lsn(4 * SEG)))
                    .count(),
                3,
                "{horizons}"
            );
        }
        other => panic!("unexpected {other}"),
    }
    let message = stopped.to_string();
    assert!(
        message.contains("from 0/0") && message.contains("removed on every safekeeper"),
        "{message}"
    );
    drop(shard0);
    writer.shutdown().await.expect("clean shutdown");
}

/// Reports replica 0 of `conn`'s shard at `lsn` every 200 ms, each time with
/// a newer reply time, until dropped: a live replica.
fn keep_reporting(mut conn: Walsender, lsn: Lsn) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        for at in 1.. {
            conn.report_applied(lsn, at).await.expect("feedback");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_silent_past_the_expiry_stops_holding_removal_and_back_pressure() {
    let expiry = Duration::from_secs(5);
    let c = cluster_expiring(
        false,
        None,
        true,
        ServerConfig {
            replica_expiry: expiry,
            ..Default::default()
        },
    )
    .await;
    let mut config = WriterConfig::new(
        c.servers.iter().map(|s| s.addr().to_string()).collect(),
        ProposerConfig::new(cluster_id(), 3, 1, SEG, 5),
    );
    config.heartbeat = Duration::from_millis(20);
    config.replica_expiry = expiry;
    let writer = Writer::start(Arc::new(TcpNetwork), config);
    write_wal(&writer, 6 * SEG + 100).await;
    // Shard 1's replica applied 2 segments and went away for good; shard 0's
    // applied everything and keeps reporting.
    let gone = reporting(c.servers[0].addr(), 1, Lsn(2 * SEG), Lsn(2 * SEG + 10)).await;
    c.wait_all("the gone replica registered everywhere", |s| {
        s.last_removed_segno == 2
    })
    .await;
    drop(gone);
    let alive = keep_reporting(
        Walsender::start(&TcpNetwork, c.servers[1].addr(), 0, Lsn(6 * SEG)).await,
        Lsn(6 * SEG + 10),
    );
    // Past the expiry, every safekeeper forgets it and removes behind the
    // live replica; the writer forgets it too.
    c.wait_all("removal past the gone replica everywhere", |s| {
        s.last_removed_segno == 6
    })
    .await;
    let statuses = c.statuses().await;
    assert_eq!(
        statuses.iter().map(|s| s.replicas).collect::<Vec<_>>(),
        [0, 1, 0],
        "only the live replica is registered, where it streams: {statuses:#?}"
    );
    assert_eq!(
        statuses
            .iter()
            .map(|s| s.replicas_forgotten)
            .collect::<Vec<_>>(),
        [1, 0, 0],
        "the safekeeper it streamed from forgot it, once: {statuses:#?}"
    );
    let mut status = writer.subscribe();
    status_reaches(&mut status, SOON, "the writer forgets it in time", |s| {
        s.replicas.iter().all(|r| r.shard_number == 0)
    })
    .await;
    alive.abort();
    writer.shutdown().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unregistered_replica_stops_holding_removal_at_once() {
    let c = cluster(false).await;
    let writer = c.writer();
    write_wal(&writer, 6 * SEG + 100).await;
    let gone = reporting(c.servers[0].addr(), 1, Lsn(2 * SEG), Lsn(2 * SEG + 10)).await;
    c.wait_all("held by the gone replica", |s| s.last_removed_segno == 2)
        .await;
    drop(gone);
    let alive = keep_reporting(
        Walsender::start(&TcpNetwork, c.servers[1].addr(), 0, Lsn(6 * SEG)).await,
        Lsn(6 * SEG + 10),
    );
    // An operator unregisters it (what `ferry replica unregister` sends).
    let forget = ferry_wal::proto::ForgottenReplica {
        shard_number: 1,
        replica_number: 0,
        reply_time_micros: 1_000,
    };
    let mut registered = 0;
    for server in &c.servers {
        let mut conn = TcpNetwork.connect(server.addr()).await.expect("connect");
        proto::write_frame(&mut conn, &ToSafekeeper::ForgetReplica(forget))
            .await
            .expect("send");
        match proto::read_frame::<_, FromSafekeeper>(&mut conn).await {
            Ok(Some(FromSafekeeper::Forgotten { was_registered })) => {
                registered += u32::from(was_registered)
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(registered >= 1, "known where it streamed");
    c.wait_all("removal past the unregistered replica", |s| {
        s.last_removed_segno == 6
    })
    .await;
    let mut status = writer.subscribe();
    status_reaches(&mut status, SOON, "the writer forgets it in time", |s| {
        s.replicas.iter().all(|r| r.shard_number == 0)
    })
    .await;
    // Its old feedback relayed again does not bring it back; a newer one does.
    let mut back = Walsender::start(&TcpNetwork, c.servers[2].addr(), 1, Lsn(2 * SEG)).await;
    back.report_applied(Lsn(2 * SEG + 10), 999)
        .await
        .expect("feedback");
    back.report_applied(Lsn(6 * SEG + 10), 2_000)
        .await
        .expect("feedback");
    status_reaches(&mut status, SOON, "registered anew", |s| {
        s.replicas.iter().any(|r| r.shard_number == 1)
    })
    .await;
    alive.abort();
    writer.shutdown().await.expect("clean shutdown");
}

/// A disk whose free space the test sets.
struct FreeSpace(std::sync::atomic::AtomicU64);

#[async_trait::async_trait]
impl ferry_testkit::disk::DiskHook for FreeSpace {
    async fn before(&self, _: ferry_testkit::disk::DiskOp<'_>) -> std::io::Result<()> {
        Ok(())
    }
    fn free_bytes(&self) -> Option<u64> {
        Some(self.0.load(std::sync::atomic::Ordering::SeqCst))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safekeepers_short_of_disk_refuse_appends_and_go_on_when_space_returns() {
    const MIN_FREE: u64 = 100 << 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let real: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
    let spaces: Vec<Arc<FreeSpace>> = (0..3)
        .map(|_| Arc::new(FreeSpace(std::sync::atomic::AtomicU64::new(10 * MIN_FREE))))
        .collect();
    let mut servers = Vec::new();
    for (id, space) in spaces.iter().enumerate() {
        let disk: Arc<dyn Disk> = Arc::new(ferry_testkit::disk::HookedDisk::new(
            Arc::clone(&real),
            Arc::clone(space) as Arc<dyn ferry_testkit::disk::DiskHook>,
        ));
        let acceptor = Acceptor::create(
            disk,
            &format!("sk{id}"),
            AcceptorConfig {
                cluster_id: cluster_id(),
                node_id: id as u64,
                timeline_id: 1,
                segment_size: seg(),
                preallocation: Default::default(),
            },
        )
        .await
        .expect("create");
        let listener = TcpNetwork.bind("127.0.0.1:0").await.expect("bind");
        let config = ServerConfig {
            min_free_disk: MIN_FREE,
            ..ServerConfig::default()
        };
        servers.push(SafekeeperServer::serve_with(listener, acceptor, config).expect("serve"));
    }
    let cluster = Cluster {
        _dir: dir,
        backup: ferry_storage::open("file:///nonexistent-unused", &Default::default())
            .expect("unused location"),
        servers,
    };
    let writer = Arc::new(cluster.writer());
    let before = write_wal(&writer, 20_000).await;

    // Two of three short of space: they refuse appends (nothing written)
    // and say why; the writer refuses new appends before writing anything.
    for space in &spaces[..2] {
        space
            .0
            .store(MIN_FREE / 2, std::sync::atomic::Ordering::SeqCst);
    }
    for s in &cluster.servers[..2] {
        let mut open = s.space().expect("a breaker").subscribe();
        tokio::time::timeout(SOON, open.wait_for(Option::is_some))
            .await
            .expect("the breaker opens within its probe interval")
            .expect("breaker");
    }
    let statuses = cluster.statuses().await;
    for st in &statuses[..2] {
        let why = st.disk_full.as_deref().expect("disk_full in the status");
        assert!(why.starts_with("disk_full: safekeeper"), "{why}");
    }
    assert!(statuses[2].disk_full.is_none());
    // An append sent now is refused at once, or, sent before the writer
    // heard of the refusals, waits (its outcome unknown) until space
    // returns; once the heartbeats were refused, new ones are refused at
    // once.
    let early = {
        let w = Arc::clone(&writer);
        tokio::spawn(async move { w.append(ferry_testkit::wal::insert(4, 1000, 3000)).await })
    };
    let deadline = tokio::time::Instant::now() + SOON;
    let refused = loop {
        let probe = ferry_testkit::wal::insert(4, 2000, 10);
        match tokio::time::timeout(Duration::from_millis(200), writer.append(probe)).await {
            Ok(Err(e @ ferry_writer::driver::WriterError::DiskFull { .. })) => break e,
            Ok(other) => panic!("an append with two of three safekeepers full: {other:?}"),
            // Waiting: its outcome is unknown until space returns.
            Err(_) => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the writer never refused an append for lack of space"
        );
    };
    assert!(refused.to_string().starts_with("disk_full:"), "{refused}");

    // Space returns: the breakers close by themselves, the writer takes
    // appends again, the early append ended as refused (nothing written)
    // or committed, and nothing acknowledged is lost.
    for space in &spaces[..2] {
        space
            .0
            .store(10 * MIN_FREE, std::sync::atomic::Ordering::SeqCst);
    }
    let deadline = tokio::time::Instant::now() + SOON;
    let last = loop {
        match writer.append(ferry_testkit::wal::insert(4, 3000, 10)).await {
            Ok(end) => break end,
            Err(ferry_writer::driver::WriterError::DiskFull { .. }) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "appends still refused after space returned"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("after space returned: {e}"),
        }
    };
    match tokio::time::timeout(SOON, early)
        .await
        .expect("ends")
        .expect("task")
    {
        Ok(end) => assert!(end <= last),
        Err(ferry_writer::driver::WriterError::DiskFull { .. }) => {}
        Err(e) => panic!("the early append: {e}"),
    }
    cluster
        .wait_all("everything committed everywhere", |st| {
            lsn(&st.commit_lsn) >= last
        })
        .await;
    assert!(last > Lsn(before.len() as u64));
    for s in &cluster.servers {
        assert!(s.status().await.disk_full.is_none());
    }
}

/// A cluster and its writer with `bytes` of committed WAL and one insert
/// more; its end.
async fn cluster_with_wal(bytes: u64) -> (Cluster, Writer, Lsn) {
    let c = cluster_of(false, None, false).await;
    let writer = c.writer();
    let wal = write_wal(&writer, bytes).await;
    let end = writer
        .append(ferry_testkit::wal::insert(4, 9999, 10))
        .await
        .expect("append");
    assert!(end.0 > wal.len() as u64);
    (c, writer, end)
}

/// Waits until `replica` applied the WAL up to `end` (fails with `what`
/// after [`SOON`]).
async fn applied_by(replica: &ferry_replica::SharedReplica, end: Lsn, what: &str) {
    let deadline = tokio::time::Instant::now() + SOON;
    while replica.lock().await.disk_consistent_lsn() < end {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: at {} of {end}",
            replica.lock().await.receive_from()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Replica 0 of shard 0 on a fresh disk; the test's records are of a
/// dropped table, applied as skipped.
async fn skipping_replica() -> (tempfile::TempDir, ferry_replica::SharedReplica) {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let replica = ferry_replica::Replica::open(
        disk,
        "s0r0",
        0,
        0,
        ferry_env::Cpu::Inline,
        Arc::new(ferry_testkit::table::FixedTables::new([]).with_dropped(4)),
    )
    .await
    .expect("replica");
    (dir, Arc::new(tokio::sync::Mutex::new(replica)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_short_of_disk_applies_no_wal_until_space_returns() {
    let (c, writer, end) = cluster_with_wal(3 * SEG).await;
    let (_dir, replica) = skipping_replica().await;
    let space = ferry_env::space::SpaceBreaker::new("replica 0 of shard 0", 100 << 20);
    space.observe(Some(1 << 20));
    let mut config =
        ferry_replica::StreamConfig::new(c.servers.iter().map(|s| s.addr().to_string()).collect());
    config.reconnect_delay = Duration::from_millis(10);
    config.space = Some(space.clone());
    let stream = tokio::spawn(ferry_replica::stream::run(
        Arc::clone(&replica),
        Arc::new(TcpNetwork),
        Arc::new(ferry_env::SystemClock),
        config,
    ));
    // While the breaker is open nothing is applied (a bounded look: a
    // replica that ignored it would have applied the 3 segments by then).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(replica.lock().await.receive_from(), Lsn(0));
    // Space returns: it streams and applies everything committed.
    space.observe(Some(1 << 30));
    applied_by(
        &replica,
        end,
        "the replica never applied the WAL once space returned",
    )
    .await;
    stream.abort();
    writer.shutdown().await.expect("clean shutdown");
}

/// A replica follows the recorded safekeeper set (`StreamConfig::members`,
/// which `ferry replica` feeds from coordination): started with a list
/// naming only a safekeeper that is gone, it streams from the members the
/// set names once it moves, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_streams_from_the_safekeeper_set_as_it_moves() {
    let (c, writer, end) = cluster_with_wal(2 * SEG).await;
    let gone = {
        let l = TcpNetwork.bind("127.0.0.1:0").await.expect("bind");
        l.local_addr().expect("addr")
    };
    let (_dir, replica) = skipping_replica().await;
    let (set, members) = tokio::sync::watch::channel(vec![gone.clone()]);
    let mut config = ferry_replica::StreamConfig::new(vec![gone]);
    config.reconnect_delay = Duration::from_millis(10);
    config.members = Some(members);
    let stream = tokio::spawn(ferry_replica::stream::run(
        Arc::clone(&replica),
        Arc::new(TcpNetwork),
        Arc::new(ferry_env::SystemClock),
        config,
    ));
    set.send_replace(c.servers.iter().map(|s| s.addr().to_string()).collect());
    applied_by(
        &replica,
        end,
        "the replica never streamed from the set it was given",
    )
    .await;
    stream.abort();
    writer.shutdown().await.expect("clean shutdown");
}

/// `n` listeners on loopback and their addresses, for safekeepers that
/// recover from each other.
async fn recovery_listeners(n: usize) -> (Vec<Box<dyn ferry_env::Listener>>, Vec<String>) {
    let mut listeners = Vec::new();
    for _ in 0..n {
        listeners.push(TcpNetwork.bind("127.0.0.1:0").await.expect("bind"));
    }
    let addrs = listeners
        .iter()
        .map(|l| l.local_addr().expect("addr"))
        .collect();
    (listeners, addrs)
}

fn recovery_acceptor_config(id: u64) -> AcceptorConfig {
    AcceptorConfig {
        cluster_id: cluster_id(),
        node_id: id,
        timeline_id: 1,
        segment_size: seg(),
        preallocation: Default::default(),
    }
}

/// Safekeeper `id` of `addrs`, keeping its WAL, with peer recovery from the
/// others.
/// Safekeepers 0.. created and served on `listeners` (each handed
/// `configuration` first, as `ferry safekeeper-set init` does).
async fn serve_recovery_safekeepers(
    disk: &Arc<dyn Disk>,
    listeners: impl IntoIterator<Item = Box<dyn ferry_env::Listener>>,
    addrs: &[String],
    configuration: Option<&ferry_wal::membership::Configuration>,
) -> Vec<SafekeeperServer> {
    let mut servers = Vec::new();
    for (id, listener) in listeners.into_iter().enumerate() {
        let mut acceptor = Acceptor::create(
            Arc::clone(disk),
            &format!("sk{id}"),
            recovery_acceptor_config(id as u64),
        )
        .await
        .expect("create");
        if let Some(conf) = configuration {
            acceptor
                .handle_configure(&cluster_id(), conf, 0)
                .await
                .expect("configure");
        }
        servers.push(
            SafekeeperServer::serve_with(listener, acceptor, recovery_server_config(addrs, id))
                .expect("serve"),
        );
    }
    servers
}

fn recovery_server_config(addrs: &[String], id: usize) -> ServerConfig {
    ServerConfig {
        remove_wal: false,
        min_free_disk: 0,
        peer_recovery: Some(ferry_safekeeper::recovery::PeerRecovery {
            network: Arc::new(TcpNetwork),
            peers: (0..addrs.len())
                .filter(|&p| p != id)
                .map(|p| addrs[p].clone())
                .collect(),
        }),
        ..ServerConfig::default()
    }
}

/// Self-healing lag: a safekeeper that was down while the writer wrote
/// catches up from a peer of its term once it is back, with no writer
/// running, and then streams the same committed WAL as the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_safekeeper_catches_up_from_a_peer_while_no_writer_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
    let (listeners, addrs) = recovery_listeners(3).await;
    let acceptor_config = recovery_acceptor_config;
    let config = |id: usize| recovery_server_config(&addrs, id);
    let mut servers = serve_recovery_safekeepers(&disk, listeners, &addrs, None).await;
    let mut writer_config = WriterConfig::new(
        addrs.clone(),
        ProposerConfig::new(cluster_id(), 3, 1, SEG, 5),
    );
    writer_config.reconnect_delay = Duration::from_millis(50);
    let writer = Writer::start(Arc::new(TcpNetwork), writer_config);
    let mut wal = write_wal(&writer, 3 * SEG).await;
    // Safekeeper 2 goes down; the others take four more segments.
    servers[2].kill().await;
    wal.extend(write_wal(&writer, 4 * SEG).await);
    let end = Lsn(wal.len() as u64);
    writer.stop().await;
    let behind = {
        let acceptor = Acceptor::open(Arc::clone(&disk), "sk2", acceptor_config(2))
            .await
            .expect("reopen");
        acceptor.flush_lsn()
    };
    assert!(behind < Lsn(4 * SEG), "safekeeper 2 missed the last writes");
    // Back without a writer: it catches up from a peer by itself.
    let acceptor = Acceptor::open(Arc::clone(&disk), "sk2", acceptor_config(2))
        .await
        .expect("reopen");
    let listener = TcpNetwork.bind(&addrs[2]).await.expect("bind again");
    servers[2] = SafekeeperServer::serve_with(listener, acceptor, config(2)).expect("serve");
    // The peers know what the writer announced (the last commit reaches
    // them with the next append, which never came): safekeeper 2 ends
    // where they do.
    let peer = servers[0].status().await;
    assert!(lsn(&peer.flush_lsn) >= end);
    let deadline = tokio::time::Instant::now() + SOON;
    let caught_up = loop {
        let s = servers[2].status().await;
        if s.flush_lsn == peer.flush_lsn && s.commit_lsn == peer.commit_lsn {
            break lsn(&s.commit_lsn);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "safekeeper 2 did not catch up from its peers: {s:#?} (peer: {peer:#?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(caught_up > behind);
    let mut conn = Walsender::start(&TcpNetwork, &addrs[2], 0, Lsn(0)).await;
    let streamed = receive(&mut conn, Lsn(0), caught_up).await;
    assert!(
        streamed[..] == wal[..caught_up.0 as usize],
        "safekeeper 2 streams exactly the committed WAL"
    );
    for s in servers {
        s.kill().await;
    }
}

/// A joining safekeeper (pulled from a member, named by no configuration
/// yet) keeps up by itself while the writer runs, which no other safekeeper
/// does: it copies committed WAL only (a writer brings a rebuilt
/// safekeeper back at its end, trusting that it holds nothing else), stays
/// rebuilt (no vote) until then, and takes no such copy once a
/// configuration names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_safekeeper_keeps_up_with_committed_wal_while_the_writer_runs() {
    use ferry_wal::membership::{Configuration, Member};
    let dir = tempfile::tempdir().expect("tempdir");
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path()).expect("disk"));
    let (listeners, addrs) = recovery_listeners(4).await;
    let acceptor_config = recovery_acceptor_config;
    let config = |id: usize| recovery_server_config(&addrs, id);
    let mut listeners = listeners.into_iter();
    let member = |id: usize| Member {
        id: id as u64,
        addr: addrs[id].clone(),
    };
    let first = Configuration::initial((0..3).map(member).collect()).expect("configuration");
    let mut servers =
        serve_recovery_safekeepers(&disk, listeners.by_ref().take(3), &addrs, Some(&first)).await;
    let mut proposer = ProposerConfig::new(cluster_id(), 3, 1, SEG, 5);
    proposer.configuration = Some(first.clone());
    let mut writer_config = WriterConfig::new(addrs[..3].to_vec(), proposer);
    writer_config.reconnect_delay = Duration::from_millis(50);
    let writer = Writer::start(Arc::new(TcpNetwork), writer_config);
    let mut wal = write_wal(&writer, 2 * SEG).await;

    // Safekeeper 3 is pulled from safekeeper 0 and started: generation 1
    // does not name it.
    ferry_safekeeper::pull::pull_from_peer(
        Arc::clone(&disk),
        "sk3",
        &acceptor_config(3),
        &TcpNetwork,
        &addrs[0],
        None,
    )
    .await
    .expect("pull");
    let acceptor = Acceptor::open(Arc::clone(&disk), "sk3", acceptor_config(3))
        .await
        .expect("open the pulled safekeeper");
    let pulled_at = acceptor.flush_lsn();
    let listener = listeners.next().expect("listener");
    servers.push(SafekeeperServer::serve_with(listener, acceptor, config(3)).expect("serve"));

    // The writer goes on (its heartbeats never let a member's own
    // recovery start); safekeeper 3 follows, never past the commit.
    for b in 0..40u64 {
        let records = ferry_testkit::wal::insert(4, (1 << 30) + b, 3000);
        wal.extend_from_slice(&records);
        writer.append(records).await.expect("append");
    }
    let end = Lsn(wal.len() as u64);
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        let s = servers[3].status().await;
        let committed = lsn(&writer.status().commit_lsn);
        assert!(
            lsn(&s.flush_lsn) <= committed,
            "the joining safekeeper holds WAL past the commit: {s:#?} (commit_lsn {committed})"
        );
        assert!(s.restored_up_to.is_some(), "still rebuilt: {s:#?}");
        if lsn(&s.flush_lsn) >= end {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the joining safekeeper did not keep up: {s:#?} (pulled at {pulled_at}, end {end})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut conn = Walsender::start(&TcpNetwork, &addrs[3], 0, Lsn(0)).await;
    let streamed = receive(&mut conn, Lsn(0), end).await;
    assert!(
        streamed[..] == wal[..],
        "the joining safekeeper holds exactly the committed WAL"
    );
    drop(conn);
    writer.stop().await;
    let donor_term = servers[0].status().await.term;
    for s in servers {
        s.kill().await;
    }

    // The acceptor's own rules: nothing past the commit it is told, and
    // nothing once a configuration names it.
    let mut acceptor = Acceptor::open(Arc::clone(&disk), "sk3", acceptor_config(3))
        .await
        .expect("reopen");
    let flush = acceptor.flush_lsn();
    let next = ferry_testkit::wal::insert(1, 1 << 40, 100);
    let past = acceptor
        .recovery_append(donor_term, flush, next.clone(), flush)
        .await
        .expect("recovery append");
    assert_eq!(past, None, "WAL past the commit refused");
    let named = Configuration {
        generation: 2,
        members: vec![member(0), member(1), member(3)],
        new_members: None,
    };
    acceptor
        .handle_configure(&cluster_id(), &named, 0)
        .await
        .expect("configure");
    let commit = Lsn(flush.0 + next.len() as u64);
    let after = acceptor
        .recovery_append(donor_term, flush, next, commit)
        .await
        .expect("recovery append");
    assert_eq!(after, None, "named by its configuration: no copy");
    assert_eq!(acceptor.flush_lsn(), flush, "nothing written");
}
