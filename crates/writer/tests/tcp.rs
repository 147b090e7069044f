//! The writer and three safekeepers over real loopback TCP with fsync: appends
//! commit, one safekeeper down is tolerated, two down makes writes wait (and lose
//! nothing), a walsender streams committed WAL and relays feedback, a second writer
//! takes over, and a clean shutdown ends with a committed checkpoint.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_env::{Disk, TcpNetwork};
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig};
use ferry_safekeeper::server::SafekeeperServer;
use ferry_testkit::wal::records;
use ferry_testkit::walsender::{read_committed, Walsender};
use ferry_wal::proto::ShardFeedback;
use ferry_wal::record::{self, Record};
use ferry_wal::segment::SegmentSize;
use ferry_wal::Lsn;
use ferry_writer::driver::{Writer, WriterConfig, WriterError};
use ferry_writer::proposer::ProposerConfig;

const SEG: u64 = 1 << 20;

fn cluster_id() -> ferry_wal::ClusterId {
    ferry_wal::ClusterId::new("tcp-test").expect("id")
}
const SOON: Duration = Duration::from_secs(20);

struct Node {
    disk: Arc<dyn Disk>,
    addr: String,
    server: Option<SafekeeperServer>,
    id: u64,
}

impl Node {
    async fn start(&mut self) {
        let acceptor = Acceptor::create(
            Arc::clone(&self.disk),
            &format!("sk{}", self.id),
            AcceptorConfig {
                cluster_id: cluster_id(),
                node_id: self.id,
                timeline_id: 1,
                segment_size: SegmentSize::new(SEG).expect("seg"),
                preallocation: Default::default(),
            },
        )
        .await
        .expect("open acceptor");
        let server = SafekeeperServer::start(Arc::new(TcpNetwork), &self.addr, acceptor)
            .await
            .expect("listen");
        self.addr = server.addr().to_string();
        self.server = Some(server);
    }

    async fn stop(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
    }
}

/// Three running safekeepers on one disk in a new temporary directory (which
/// lives as long as the handle returned with them).
async fn cluster() -> (tempfile::TempDir, Vec<Node>) {
    let (dir, disk) = ferry_testkit::disk::temp_disk();
    let mut nodes = Vec::new();
    for id in 0..3 {
        let mut node = Node {
            disk: Arc::clone(&disk),
            addr: "127.0.0.1:0".into(),
            server: None,
            id,
        };
        node.start().await;
        nodes.push(node);
    }
    (dir, nodes)
}

async fn stop_all(nodes: &mut [Node]) {
    for node in nodes {
        node.stop().await;
    }
}

fn writer(nodes: &[Node], id: u128) -> Writer {
    let mut config = WriterConfig::new(
        nodes.iter().map(|n| n.addr.clone()).collect(),
        ProposerConfig::new(cluster_id(), 3, 1, SEG, id),
    );
    config.reconnect_delay = Duration::from_millis(50);
    Writer::start(Arc::new(TcpNetwork), config)
}

fn insert(block: u64, size: usize) -> Bytes {
    ferry_testkit::wal::insert(9, block, size)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_commit_survive_failures_and_stream_to_replicas() {
    let (_dir, mut nodes) = cluster().await;
    let w = Arc::new(writer(&nodes, 1));

    // Concurrent appends: each resolves once committed, at increasing LSNs.
    let mut tasks = Vec::new();
    for block in 0..50u64 {
        let w = Arc::clone(&w);
        tasks.push(tokio::spawn(
            async move { w.append(insert(block, 1000)).await },
        ));
    }
    let mut ends = Vec::new();
    for t in tasks {
        ends.push(
            tokio::time::timeout(SOON, t)
                .await
                .expect("in time")
                .expect("task")
                .expect("committed"),
        );
    }
    ends.sort();
    ends.dedup();
    assert_eq!(ends.len(), 50);
    let size = record::Record::insert_len(0, 1000) as u64;
    assert_eq!(*ends.last().expect("end"), Lsn(50 * size));

    // One safekeeper down: writes go on.
    nodes[2].stop().await;
    let end = tokio::time::timeout(SOON, w.append(insert(50, 1000)))
        .await
        .expect("in time")
        .expect("committed");
    assert_eq!(end, Lsn(51 * size));

    // Two down: the append waits...
    nodes[1].stop().await;
    let waiting = {
        let w = Arc::clone(&w);
        tokio::spawn(async move { w.append(insert(51, 1000)).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "one of three safekeepers cannot commit"
    );
    // ...and completes once a second safekeeper is back.
    nodes[1].start().await;
    let end = tokio::time::timeout(SOON, waiting)
        .await
        .expect("in time")
        .expect("task")
        .expect("committed");
    assert_eq!(end, Lsn(52 * size));
    nodes[2].start().await;

    // A walsender streams committed WAL from the start; its feedback reaches the writer.
    let mut conn = Walsender::start(&TcpNetwork, &nodes[2].addr, 4, Lsn(0)).await;
    let received = conn.read_until(Lsn(0), end, SOON).await;
    assert!(received.all_committed, "only committed WAL");
    let mut blocks: Vec<u64> = records(&received.wal)
        .into_iter()
        .filter_map(|(_, rec)| match rec {
            Record::Insert { block_number, .. } => Some(block_number),
            _ => None,
        })
        .collect();
    blocks.sort();
    assert_eq!(
        blocks,
        (0..52).collect::<Vec<_>>(),
        "every acknowledged insert, once"
    );
    let feedback = ShardFeedback {
        shard_number: 4,
        replica_number: 0,
        last_received_lsn: end,
        disk_consistent_lsn: end,
        remote_consistent_lsn: Lsn(0),
        reply_time_micros: 1,
    };
    conn.send_feedback(feedback).await.expect("feedback");
    // A second replica of the same shard, behind the first, reports too (on
    // its own walsender): it does not overwrite the first one's feedback.
    let slower = ShardFeedback {
        replica_number: 1,
        disk_consistent_lsn: Lsn(100),
        ..feedback
    };
    let mut conn2 = Walsender::start(&TcpNetwork, &nodes[2].addr, 4, end).await;
    conn2.send_feedback(slower).await.expect("feedback");
    let mut status = w.subscribe();
    let relayed = tokio::time::timeout(
        SOON,
        status.wait_for(|s| s.replicas.contains(&feedback) && s.replicas.contains(&slower)),
    )
    .await
    .expect("feedback of both replicas relayed to the writer in time")
    .expect("status")
    .clone();
    assert_eq!(relayed.shard_minimums.len(), 1);
    assert_eq!(relayed.shard_minimums[0].shard_number, 4);
    let min = relayed.shard_minimums[0].positions;
    assert_eq!(
        (min.last_received_lsn, min.disk_consistent_lsn),
        (end, Lsn(100)),
        "the shard is as far as its slowest replica"
    );
    assert_eq!(relayed.overall_minimum, Some(min));

    // Clean shutdown: the checkpoint is committed before the writer exits.
    let w = Arc::into_inner(w).expect("sole owner");
    let after = tokio::time::timeout(SOON, w.shutdown())
        .await
        .expect("in time")
        .expect("shutdown");
    assert!(after > end);
    let mut holding = 0;
    for node in &nodes {
        let status = node.server.as_ref().expect("running").status().await;
        if status.flush_lsn == after.to_string() {
            holding += 1;
        }
    }
    assert!(holding >= 2, "a quorum holds the checkpoint");
    stop_all(&mut nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_takes_over() {
    let (_dir, mut nodes) = cluster().await;
    let first = writer(&nodes, 1);
    let end = tokio::time::timeout(SOON, first.append(insert(0, 100)))
        .await
        .expect("in time")
        .expect("committed");

    let second = writer(&nodes, 2);
    let end2 = tokio::time::timeout(SOON, second.append(insert(1, 100)))
        .await
        .expect("in time")
        .expect("committed");
    assert!(
        end2 > end,
        "the new writer continues after all committed WAL"
    );
    assert!(second.status().term > first.status().term);

    let refused = tokio::time::timeout(SOON, first.append(insert(2, 100)))
        .await
        .expect("in time");
    assert!(
        matches!(
            refused,
            Err(WriterError::Superseded { .. }) | Err(WriterError::Stopped)
        ),
        "the old writer gets no acknowledgement: {refused:?}"
    );
    second.stop().await;
    first.stop().await;
    stop_all(&mut nodes).await;
}

/// `Writer::insert` numbers each record's block by the LSN where the record
/// starts: unique, growing with the WAL, and carried in the committed record
/// with its shard and idempotency key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_are_numbered_by_their_start_lsn() {
    use ferry_writer::driver::{Insert, InsertRows};
    let (_dir, mut nodes) = cluster().await;
    let w = writer(&nodes, 1);
    let one = |shard: u32, key: &'static [u8], rows: usize| Insert {
        table_id: 5,
        shard,
        idempotency_key: Bytes::from_static(key),
        rows: InsertRows::ArrowIpc(Bytes::from(vec![shard as u8; rows])),
    };
    let first = tokio::time::timeout(SOON, w.insert(vec![one(0, b"k1", 100), one(2, b"k1", 50)]))
        .await
        .expect("in time")
        .expect("committed");
    let second = tokio::time::timeout(SOON, w.insert(vec![one(1, b"", 10)]))
        .await
        .expect("in time")
        .expect("committed");
    let len = |key: usize, rows: usize| Record::insert_len(key, rows) as u64;
    assert_eq!(first.block_numbers, [0, len(2, 100)]);
    assert_eq!(first.commit_lsn, Lsn(len(2, 100) + len(2, 50)));
    assert_eq!(second.block_numbers, [first.commit_lsn.0]);
    assert_eq!(second.commit_lsn, Lsn(first.commit_lsn.0 + len(0, 10)));
    // A key longer than a record may carry is refused before anything is sent.
    let long = Insert {
        idempotency_key: Bytes::from(vec![b'k'; record::MAX_IDEMPOTENCY_KEY_BYTES + 1]),
        ..one(0, b"", 1)
    };
    assert!(matches!(
        w.insert(vec![long]).await,
        Err(WriterError::InvalidRecords(_))
    ));

    // What a walsender streams decodes to the same numbers, shards and keys.
    let wal = read_committed(&TcpNetwork, &nodes[0].addr, second.commit_lsn, SOON).await;
    assert!(wal.all_committed, "only committed WAL");
    let mut got = Vec::new();
    for (at, rec) in records(&wal.wal) {
        if let Record::Insert {
            block_number,
            shard,
            idempotency_key,
            ..
        } = rec
        {
            assert_eq!(block_number, at, "block number is the start LSN");
            got.push((shard, idempotency_key));
        }
    }
    assert_eq!(
        got,
        [
            (0, Bytes::from_static(b"k1")),
            (2, Bytes::from_static(b"k1")),
            (1, Bytes::new())
        ]
    );
    w.stop().await;
    stop_all(&mut nodes).await;
}
