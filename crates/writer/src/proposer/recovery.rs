//! Recovery reads: WAL below the buffer's start, which lagging safekeepers
//! need, read from the donor or a safekeeper already streaming in this
//! term, paused and resumed across sources, and put in front of the buffer.

use bytes::{Bytes, BytesMut};
use ferry_wal::proto::{ToSafekeeper, MAX_READ_WAL_BYTES};
use ferry_wal::Lsn;

use super::{record_ends, Action, Peer, Phase, Proposer};

/// A read of WAL the writer does not hold, from an up-to-date safekeeper.
#[derive(Debug, Clone)]
pub(super) struct Fetch {
    /// The safekeeper read from; `None` while paused: the source went away and
    /// no other can serve yet. What was received is kept, so a long read (from
    /// a peer's WAL backup, where a transient failure is common) resumes from
    /// where it stopped instead of starting over.
    pub(super) source: Option<usize>,
    begin: Lsn,
    end: Lsn,
    /// The end of the reads asked for so far: one read at a time, each at
    /// most `max_read_wal_bytes`.
    requested: Lsn,
    received: BytesMut,
}

impl Proposer {
    /// A read from `peer` stops (it went away or refused): kept with what it
    /// received and resumed from another safekeeper, or from this one when it
    /// is back.
    pub(super) fn pause_fetch_from(&mut self, peer: usize, actions: &mut Vec<Action>) {
        if let Some(fetch) = self.fetch.as_mut().filter(|f| f.source == Some(peer)) {
            fetch.source = None;
            self.start_fetch_if_needed(actions);
        }
    }

    /// Starts (or resumes) reading WAL below the buffer that a safekeeper needs,
    /// from the donor or from a safekeeper that already streams in this term.
    /// Below the buffer's start every such safekeeper holds the same WAL (each
    /// was truncated to its common point with the donor), so a read may change
    /// source midway.
    pub(super) fn start_fetch_if_needed(&mut self, actions: &mut Vec<Action>) {
        if self.phase != Phase::Elected || self.fetch.as_ref().is_some_and(|f| f.source.is_some()) {
            return;
        }
        let needed = self
            .peers
            .iter()
            .filter_map(|p| match p {
                Peer::Streaming { next_send, .. } => Some(*next_send),
                _ => None,
            })
            .filter(|lsn| *lsn < self.buffer.start())
            .min();
        let Some(needed) = needed else {
            self.fetch = None;
            return;
        };
        let end = self.buffer.start();
        // A paused read resumes when it still covers what is needed.
        let (begin, received) = match self.fetch.take() {
            Some(paused) if paused.begin <= needed => (paused.begin, paused.received),
            _ => (needed, BytesMut::new()),
        };
        let have = Lsn(begin.0 + received.len() as u64);
        // The donor holds the WAL up to the epoch start unless it lost it:
        // a donor restored from the backup since is a safekeeper like any.
        let donor_ok = self.donor.filter(|&d| match self.peers[d] {
            Peer::Streaming { flush_lsn, .. } => flush_lsn >= end,
            Peer::Offline
            | Peer::Greeting
            | Peer::Refused { .. }
            | Peer::Restored { .. }
            | Peer::Rejoining { .. } => false,
            _ => true,
        });
        let can_serve = |p: usize| matches!(self.peers[p], Peer::Streaming { flush_lsn, .. } if flush_lsn >= end);
        // During a change, a member leaving the set serves first: its
        // connection carries the reads' answers, which delay its
        // acknowledgements, and the new set's quorum never waits for it.
        let leaving = (0..self.peers.len()).find(|&p| self.is_leaving(p) && can_serve(p));
        let source = leaving
            .or(donor_ok)
            .or_else(|| (0..self.peers.len()).find(|&p| can_serve(p)));
        let Some(source) = source else {
            if self.donor.is_none() && self.commit_lsn < self.epoch_start_lsn {
                // The donor lost its disk before anyone else got the WAL this
                // term starts from: nobody holds it (so it was never
                // committed), and this term can never commit. Nothing of it
                // was acknowledged: give it up for a new election.
                self.phase = Phase::Stopped;
                actions.push(Action::Superseded {
                    term: self.term,
                    reason: format!(
                        "the WAL up to this term's start {end} was lost with its donor's data; electing again"
                    ),
                });
                return;
            }
            tracing::warn!(%begin, %have, %end, "no safekeeper can provide the WAL a lagging safekeeper needs yet");
            self.fetch = Some(Fetch {
                source: None,
                begin,
                end,
                requested: have,
                received,
            });
            return;
        };
        if have > begin {
            tracing::info!(source, %begin, %have, %end, "resuming a recovery read");
        }
        let requested = self.read_wal_end(have, end);
        self.fetch = Some(Fetch {
            source: Some(source),
            begin,
            end,
            requested,
            received,
        });
        if have >= end {
            // Paused right at its end (a read returned more than asked).
            self.finish_fetch(source, actions);
            return;
        }
        actions.push(Action::Send {
            to: source,
            msg: ToSafekeeper::ReadWal {
                term: self.term,
                begin_lsn: have,
                end_lsn: requested,
            },
        });
    }

    /// The end of one recovery read from `begin` towards `end`.
    fn read_wal_end(&self, begin: Lsn, end: Lsn) -> Lsn {
        let most = self.config.max_read_wal_bytes.clamp(1, MAX_READ_WAL_BYTES);
        Lsn(end.0.min(begin.0.saturating_add(most)))
    }

    pub(super) fn on_fetched(
        &mut self,
        peer: usize,
        begin: Lsn,
        wal: Bytes,
        actions: &mut Vec<Action>,
    ) {
        let Some(fetch) = self.fetch.as_mut() else {
            return;
        };
        if fetch.source != Some(peer) || begin != Lsn(fetch.begin.0 + fetch.received.len() as u64) {
            return;
        }
        fetch.received.extend_from_slice(&wal);
        let have = Lsn(fetch.begin.0 + fetch.received.len() as u64);
        if have >= fetch.end {
            self.finish_fetch(peer, actions);
            return;
        }
        if have >= fetch.requested {
            // This read is done: the next one, from the same safekeeper.
            let end = fetch.end;
            let next = self.read_wal_end(have, end);
            if let Some(fetch) = self.fetch.as_mut() {
                fetch.requested = next;
            }
            tracing::debug!(source = peer, %have, %next, "next recovery read");
            actions.push(Action::Send {
                to: peer,
                msg: ToSafekeeper::ReadWal {
                    term: self.term,
                    begin_lsn: have,
                    end_lsn: next,
                },
            });
        }
    }

    /// The read reached the buffer's start: its WAL goes in front of the
    /// buffer and the lagging safekeepers are sent what they miss.
    fn finish_fetch(&mut self, last_source: usize, actions: &mut Vec<Action>) {
        let Some(fetch) = self.fetch.take() else {
            return;
        };
        let mut received = fetch.received;
        if received.len() as u64 > fetch.end.distance_from(fetch.begin) {
            tracing::warn!(last_source, "recovery read returned more than asked");
        }
        received.truncate(fetch.end.distance_from(fetch.begin) as usize);
        let data = received.freeze();
        let ends = match record_ends(&data) {
            Ok(ends) => ends,
            Err(e) => {
                tracing::error!(last_source, error = %e, "recovered WAL is not whole records");
                self.peers[last_source] = Peer::Offline;
                actions.push(Action::Reconnect { peer: last_source });
                return;
            }
        };
        self.buffer.push_front(fetch.begin, data, &ends);
        self.pump_all(actions);
        self.start_fetch_if_needed(actions);
    }
}
