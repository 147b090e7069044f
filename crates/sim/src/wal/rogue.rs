//! A misbehaving proposer: messages a correct writer never sends, so that the
//! safekeeper's defences against them run under simulation too. Every one of
//! them must be refused, and nothing committed may change (the WAL test's
//! final checks see to the second part).

use std::time::Duration;

use bytes::Bytes;
use ferry_env::Network;
use ferry_wal::proto::{
    self, AppendRequest, FrameReader, FromSafekeeper, Greeting, ProposerElected, ToSafekeeper,
};
use ferry_wal::record::Record;
use ferry_wal::{ClusterId, Lsn, Term, TermHistory, TermLsn};
use tokio::io::AsyncWriteExt;

/// How long the rogue waits for an answer (a partition or a crash may eat it).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// What the rogue tries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RogueKind {
    /// An append in a term below the safekeeper's.
    StaleTermAppend,
    /// Wins a vote in a higher term, then asks to truncate below commit_lsn.
    TruncateBelowCommit,
    /// An election message whose history does not end with its own term.
    MalformedHistory,
    /// An election message in a term below the safekeeper's.
    StaleElection,
    /// An append that leaves a gap after the end of the WAL.
    AppendWithAGap,
}

impl RogueKind {
    pub const ALL: [RogueKind; 5] = [
        RogueKind::StaleTermAppend,
        RogueKind::TruncateBelowCommit,
        RogueKind::MalformedHistory,
        RogueKind::StaleElection,
        RogueKind::AppendWithAGap,
    ];
}

/// How far past the WAL end the caller saw a gap append begins: more than
/// any simulated run writes, so the gap is still there when it lands.
const ROGUE_GAP: u64 = 1 << 30;

/// What came of an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RogueOutcome {
    /// Every message that had to be refused was.
    Refused,
    /// The attempt could not be made (no connection, no answer, nothing to
    /// truncate): says nothing either way.
    NotTried(String),
    /// A safekeeper accepted what it must refuse.
    Accepted(String),
}

struct Conn {
    reader: FrameReader<tokio::io::ReadHalf<ferry_env::BoxConnection>>,
    writer: tokio::io::WriteHalf<ferry_env::BoxConnection>,
}

impl Conn {
    async fn ask(&mut self, msg: &ToSafekeeper) -> Option<FromSafekeeper> {
        proto::write_frame(&mut self.writer, msg).await.ok()?;
        self.writer.flush().await.ok()?;
        match tokio::time::timeout(ANSWER_TIMEOUT, self.reader.next::<FromSafekeeper>()).await {
            Ok(Ok(Some(answer))) => Some(answer),
            _ => None,
        }
    }
}

fn one_record(block: u64) -> Bytes {
    Record::Insert {
        shard: 0,
        idempotency_key: bytes::Bytes::new(),
        table_id: 99,
        block_number: block,
        arrow_ipc: Bytes::from_static(b"rogue"),
    }
    .to_bytes()
}

/// An append of `wal` at `begin` in `term` that also commits it.
fn append(term: Term, begin: Lsn, wal: &Bytes) -> ToSafekeeper {
    let end = Lsn(begin.0 + wal.len() as u64);
    ToSafekeeper::Append(AppendRequest {
        term,
        begin_lsn: begin,
        end_lsn: end,
        commit_lsn: end,
        wal: wal.clone(),
        ..AppendRequest::default()
    })
}

/// Tries `kind` on the safekeeper at `addr`, which the caller saw at `term`,
/// `flush_lsn` and `commit_lsn`.
pub async fn attempt(
    network: &dyn Network,
    addr: &str,
    cluster_id: &ClusterId,
    segment_bytes: u64,
    kind: RogueKind,
    (term, flush, commit): (Term, Lsn, Lsn),
) -> RogueOutcome {
    let Ok(conn) = network.connect(addr).await else {
        return RogueOutcome::NotTried("no connection".into());
    };
    let (read, writer) = tokio::io::split(conn);
    let mut c = Conn {
        reader: FrameReader::new(read),
        writer,
    };
    let greeting = ToSafekeeper::Greeting(Greeting {
        cluster_id: cluster_id.clone(),
        proposer_id: 0xBAD,
        timeline_id: 1,
        segment_bytes,
        configuration: None,
    });
    match c.ask(&greeting).await {
        Some(FromSafekeeper::Greeting(_)) => {}
        other => return RogueOutcome::NotTried(format!("greeting answered {other:?}")),
    }
    let wal = one_record(u64::MAX - 1);
    let must_refuse = match kind {
        RogueKind::StaleTermAppend => {
            if term == 0 {
                return RogueOutcome::NotTried("term 0 has nothing below it".into());
            }
            vec![append(term - 1, flush, &wal)]
        }
        RogueKind::TruncateBelowCommit => {
            if commit == Lsn(0) {
                return RogueOutcome::NotTried("nothing committed yet".into());
            }
            let higher = term + 1;
            match c.ask(&ToSafekeeper::VoteRequest { term: higher }).await {
                Some(FromSafekeeper::Vote(v)) if v.vote_given => {}
                other => return RogueOutcome::NotTried(format!("vote answered {other:?}")),
            }
            let start = Lsn(commit.0 - 1);
            vec![ToSafekeeper::Elected(ProposerElected {
                term: higher,
                start_streaming_at: start,
                term_history: TermHistory(vec![TermLsn {
                    term: higher,
                    lsn: start,
                }]),
                timeline_start_lsn: Lsn(0),
                rejoin: false,
            })]
        }
        RogueKind::MalformedHistory => vec![ToSafekeeper::Elected(ProposerElected {
            term: term + 1,
            start_streaming_at: flush,
            // Does not end with the message's own term.
            term_history: TermHistory(vec![TermLsn { term, lsn: Lsn(0) }]),
            timeline_start_lsn: Lsn(0),
            rejoin: false,
        })],
        RogueKind::StaleElection => {
            if term == 0 {
                return RogueOutcome::NotTried("term 0 has nothing below it".into());
            }
            vec![ToSafekeeper::Elected(ProposerElected {
                term: term - 1,
                start_streaming_at: flush,
                term_history: TermHistory(vec![TermLsn {
                    term: term - 1,
                    lsn: Lsn(0),
                }]),
                timeline_start_lsn: Lsn(0),
                rejoin: false,
            })]
        }
        RogueKind::AppendWithAGap => {
            // `flush` is what the caller saw before connecting: the writer
            // may have appended since, so a gap of a few KiB can have closed
            // by the time the message lands, making it a plain append at
            // the end of the WAL in the current term, which a safekeeper
            // rightly takes (it cannot tell a rogue from the term's writer).
            // A run writes far less than ROGUE_GAP.
            let begin = Lsn(flush.0 + ROGUE_GAP);
            vec![append(term, begin, &wal)]
        }
    };
    for msg in must_refuse {
        match c.ask(&msg).await {
            Some(FromSafekeeper::Refused { .. }) => {}
            None => return RogueOutcome::NotTried("no answer".into()),
            Some(answer) => {
                return RogueOutcome::Accepted(format!("{kind:?}: {msg:?} was answered {answer:?}"))
            }
        }
    }
    RogueOutcome::Refused
}
