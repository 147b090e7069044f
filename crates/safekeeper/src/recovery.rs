//! Peer recovery (Neon's `recovery.rs`): a safekeeper that is behind
//! catches up from a peer of its term while no writer runs, so that a
//! cluster left idle converges (every member then holds the whole WAL of
//! the last term, and a next election finds it anywhere).
//!
//! The rule that makes copying uncommitted WAL safe: both this safekeeper
//! and the donor accepted the election of the current term `T` (their last
//! term is `T`), and the donor is still in `T` when it answers each read
//! (`Acceptor::read_for_recovery` refuses another term). Then both hold a
//! prefix of what `T`'s one writer sent, so the donor's WAL past our end
//! extends ours exactly as that writer would have. Each chunk is appended
//! through the writer's own rules (`Acceptor::recovery_append`: only in the
//! term whose election we accepted, only at our end); a writer that comes
//! back moves the term, and the next chunk is refused.
//!
//! A *joining* safekeeper (rebuilt by a pull or a restore, not brought
//! back yet, and not named by the configuration it holds: a new member
//! waiting for `ferry safekeeper-set` to add it) keeps up the same way
//! while writers run, since none streams to it: it copies committed WAL
//! only (up to the donor's commit_lsn), so that it still holds nothing
//! but committed WAL when a writer brings it back at its end (the
//! restored safekeeper's rule, `Proposer::start_rejoin`). It *follows* a
//! donor: one connection, on which it asks every
//! [`JOINING_FOLLOW_INTERVAL`] how far the donor's commit moved and copies
//! up to it, until a configuration naming it (the donor's or its own) ends
//! the follow. A change then starts with the new member a few milliseconds
//! of WAL behind instead of a whole pull-to-change gap (or a polling
//! interval's worth), which the writer would otherwise carry while commits
//! need both majorities. The acceptor enforces both limits
//! under its lock (`Acceptor::recovery_append`), so a configuration that
//! names it, adopted meanwhile, stops the copy at the next chunk.
//!
//! [`PeerRecovery`] says where the peers are; the server runs the loop
//! (time on tokio's clock, the network through the seam).

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use ferry_env::Network;
use ferry_wal::membership::Configuration;
use ferry_wal::proto::{
    self, Configured, FrameReader, FromSafekeeper, Greeting, ToSafekeeper, MAX_READ_WAL_BYTES,
};
use ferry_wal::{ClusterId, Lsn, Term};
use tokio::io::AsyncWriteExt;

/// How often a safekeeper looks for a peer ahead of it.
pub const PEER_RECOVERY_INTERVAL: Duration = Duration::from_secs(1);
/// How often a joining safekeeper looks for a donor when it has none.
pub const JOINING_RECOVERY_INTERVAL: Duration = Duration::from_millis(100);
/// How often a joining safekeeper following a donor asks it, on the same
/// connection, how far its commit moved (writers run meanwhile: the
/// shorter, the nearer the end a membership change finds it; one small
/// request on an open connection, not a new round).
pub const JOINING_FOLLOW_INTERVAL: Duration = Duration::from_millis(10);
/// Longest wait for a donor's answer to a position request.
const POSITION_TIMEOUT: Duration = Duration::from_secs(2);
/// A writer counts as running while one of its messages arrived within
/// this (writers send a heartbeat every 100 ms); recovery waits meanwhile.
pub const WRITER_SILENCE: Duration = Duration::from_secs(3);
/// The pause before the next round after one cut by a network fault: from
/// [`JOINING_RECOVERY_INTERVAL`], doubling up to [`PEER_RECOVERY_INTERVAL`],
/// so one passing fault does not cost a whole interval of lag and a peer
/// that stays away is not asked more often than usual.
#[derive(Debug)]
pub(crate) struct Retry(Duration);

impl Retry {
    pub fn new() -> Retry {
        Retry(JOINING_RECOVERY_INTERVAL)
    }

    /// A round failed: the pause before the next one.
    pub fn failed(&mut self) -> Duration {
        let pause = self.0;
        self.0 = (self.0 * 2).min(PEER_RECOVERY_INTERVAL);
        pause
    }

    /// A round ended without a fault.
    pub fn reset(&mut self) {
        self.0 = JOINING_RECOVERY_INTERVAL;
    }
}

/// Most WAL asked for in one read: the donor reads it under its acceptor
/// lock, ahead of its writer's appends, so a read stays as small as an
/// append.
const READ_BYTES: u64 = 1 << 20;
/// Longest one recovery round may take.
const ROUND_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest a joining safekeeper follows one donor before it looks again
/// for the one furthest ahead.
const FOLLOW_ROUND_TIMEOUT: Duration = Duration::from_secs(600);

/// Where a safekeeper's peers are, and the network to reach them.
#[derive(Clone)]
pub struct PeerRecovery {
    pub network: Arc<dyn Network>,
    /// Peer addresses used while no configuration is recorded (the
    /// configuration's other members otherwise).
    pub peers: Vec<String>,
}

impl std::fmt::Debug for PeerRecovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerRecovery")
            .field("peers", &self.peers)
            .finish_non_exhaustive()
    }
}

/// What a round needs to know of this safekeeper.
#[derive(Debug, Clone)]
pub(crate) struct Standing {
    pub node_id: u64,
    pub cluster_id: ClusterId,
    pub timeline_id: u64,
    pub segment_bytes: u64,
    pub term: Term,
    /// The last term of its history: the term whose election it accepted.
    pub history_term: Term,
    pub flush_lsn: Lsn,
    pub restored: bool,
    pub configuration: Option<Configuration>,
}

impl Standing {
    /// Rebuilt, not brought back, and not named by its configuration: no
    /// writer streams to it, so it keeps up by itself (committed WAL only).
    pub fn joining(&self) -> bool {
        self.restored
            && self
                .configuration
                .as_ref()
                .is_some_and(|c| !c.contains(self.node_id))
    }

    /// How far a round may copy from a donor that answered `peer`: its
    /// flush_lsn, or its commit_lsn for a rebuilt safekeeper, which must
    /// hold committed WAL only.
    pub fn copy_limit(&self, peer: &Configured) -> Lsn {
        if self.restored {
            peer.commit_lsn.min(peer.position.flush_lsn)
        } else {
            peer.position.flush_lsn
        }
    }
}

/// The peers to ask: the configuration's other members, else the static
/// list.
pub(crate) fn peers_of(standing: &Standing, recovery: &PeerRecovery) -> Vec<String> {
    match &standing.configuration {
        Some(conf) => conf
            .all_members()
            .into_iter()
            .filter(|m| m.id != standing.node_id)
            .map(|m| m.addr)
            .collect(),
        None => recovery.peers.clone(),
    }
}

/// Whether a peer's answer makes it a donor for `standing`: same term, its
/// WAL written in that term, and ahead (by what `standing` may copy).
pub(crate) fn is_donor(standing: &Standing, peer: &Configured) -> bool {
    peer.term == standing.term
        && peer.position.last_log_term == standing.term
        && standing.copy_limit(peer) > standing.flush_lsn
        && !peer.restored
}

/// The length of the whole records at the start of `wal` (a record cut at
/// its end is left out; a damaged one is an error).
fn whole_records(wal: &[u8]) -> Result<usize, String> {
    let mut at = 0;
    while at < wal.len() {
        match ferry_wal::record::check(&wal[at..]) {
            Ok(len) => at += len,
            Err(ferry_wal::record::RecordError::Incomplete { .. }) => break,
            Err(e) => return Err(format!("a damaged record from the donor: {e}")),
        }
    }
    Ok(at)
}

/// Asks `addr` where it stands.
pub(crate) async fn position(
    network: &dyn Network,
    addr: &str,
    cluster_id: &ClusterId,
) -> Option<Configured> {
    let ask = async {
        let mut conn = network.connect(addr).await.ok()?;
        proto::write_frame(
            &mut conn,
            &ToSafekeeper::Position {
                cluster_id: cluster_id.clone(),
            },
        )
        .await
        .ok()?;
        conn.flush().await.ok()?;
        match proto::read_frame::<_, FromSafekeeper>(&mut conn).await {
            Ok(Some(FromSafekeeper::Configured(c))) => Some(c),
            _ => None,
        }
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
}

/// One connection to a donor, reading its WAL of `term` from `from` up to
/// `to`; each chunk goes to `append`, which says whether to go on. With
/// `follow`, a round that reached `to` asks the donor on the same
/// connection, that often, where it stands and copies on to its new limit
/// (a joining safekeeper follows the cluster's commit this way); it ends
/// when `append` stops it, the donor is no longer one, or a fault cuts it.
pub(crate) async fn copy_from<F, Fut>(
    network: &dyn Network,
    addr: &str,
    standing: &Standing,
    from: Lsn,
    mut to: Lsn,
    follow: Option<Duration>,
    mut append: F,
) -> Result<Lsn, String>
where
    F: FnMut(Lsn, bytes::Bytes, Lsn) -> Fut,
    Fut: std::future::Future<Output = Option<Lsn>>,
{
    let round = async {
        let conn = network
            .connect(addr)
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        let (read, mut write) = tokio::io::split(conn);
        let mut reader = FrameReader::new(read);
        // Greeted like a writer of our configuration, so the donor serves
        // its reads (and refuses them if it holds a newer generation).
        proto::write_frame(
            &mut write,
            &ToSafekeeper::Greeting(Greeting {
                cluster_id: standing.cluster_id.clone(),
                proposer_id: 0,
                timeline_id: standing.timeline_id,
                segment_bytes: standing.segment_bytes,
                configuration: standing.configuration.clone(),
            }),
        )
        .await
        .map_err(|e| e.to_string())?;
        write.flush().await.map_err(|e| e.to_string())?;
        match reader.next::<FromSafekeeper>().await {
            Ok(Some(FromSafekeeper::Greeting(_))) => {}
            other => return Err(format!("greeting answered {other:?}")),
        }
        // Appends carry whole records only (as a writer's do): what was
        // read past the last whole record waits for the next read.
        let mut appended = from;
        let mut pending = BytesMut::new();
        loop {
            if appended >= to {
                let Some(pause) = follow else { break };
                tokio::time::sleep(pause).await;
                let asked = async {
                    proto::write_frame(
                        &mut write,
                        &ToSafekeeper::Position {
                            cluster_id: standing.cluster_id.clone(),
                        },
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                    write.flush().await.map_err(|e| e.to_string())?;
                    match reader.next::<FromSafekeeper>().await {
                        Ok(Some(FromSafekeeper::Configured(c))) => Ok(c),
                        other => Err(format!("a position request answered {other:?}")),
                    }
                };
                let peer = tokio::time::timeout(POSITION_TIMEOUT, asked)
                    .await
                    .map_err(|_| format!("no position within {POSITION_TIMEOUT:?}"))??;
                // The donor left the term, or holds a configuration that
                // names this safekeeper (its change started: the writer
                // streams to it next): the follow ends.
                let named = peer
                    .configuration
                    .as_ref()
                    .is_some_and(|c| c.contains(standing.node_id));
                if peer.term != standing.term
                    || peer.position.last_log_term != standing.term
                    || peer.restored
                    || named
                {
                    break;
                }
                to = to.max(standing.copy_limit(&peer));
                continue;
            }
            let begin = Lsn(appended.0 + pending.len() as u64);
            if begin >= to {
                return Err(format!(
                    "the donor's WAL ends inside a record at {to} (from {appended})"
                ));
            }
            let end = Lsn(begin.0 + (to.0 - begin.0).min(READ_BYTES.min(MAX_READ_WAL_BYTES)));
            proto::write_frame(
                &mut write,
                &ToSafekeeper::ReadWal {
                    term: standing.term,
                    begin_lsn: begin,
                    end_lsn: end,
                },
            )
            .await
            .map_err(|e| e.to_string())?;
            write.flush().await.map_err(|e| e.to_string())?;
            let mut at = begin;
            let mut commit = Lsn(0);
            while at < end {
                match reader.next::<FromSafekeeper>().await {
                    Ok(Some(FromSafekeeper::Wal {
                        begin_lsn,
                        commit_lsn,
                        wal,
                    })) if begin_lsn == at && !wal.is_empty() => {
                        at = Lsn(at.0 + wal.len() as u64);
                        commit = commit_lsn;
                        pending.extend_from_slice(&wal);
                    }
                    other => return Err(format!("a read of {begin}..{end} answered {other:?}")),
                }
            }
            let whole = whole_records(&pending)?;
            if whole == 0 {
                continue;
            }
            let chunk = pending.split_to(whole).freeze();
            match append(appended, chunk, commit).await {
                Some(flushed) if flushed == Lsn(appended.0 + whole as u64) => appended = flushed,
                _ => return Ok(appended),
            }
        }
        Ok(appended)
    };
    let limit = if follow.is_some() {
        FOLLOW_ROUND_TIMEOUT
    } else {
        ROUND_TIMEOUT
    };
    tokio::time::timeout(limit, round)
        .await
        .unwrap_or_else(|_| Err(format!("no end within {limit:?}")))
}

#[cfg(test)]
mod retry_tests {
    use super::*;

    #[test]
    fn a_failed_round_is_tried_again_sooner_backing_off_to_the_interval() {
        let mut retry = Retry::new();
        let pauses: Vec<u64> = (0..6).map(|_| retry.failed().as_millis() as u64).collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1000, 1000]);
        retry.reset();
        assert_eq!(retry.failed(), JOINING_RECOVERY_INTERVAL);
    }
}
