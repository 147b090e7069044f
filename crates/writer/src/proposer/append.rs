//! Appends and commit tracking: WAL sent to streaming safekeepers within
//! the in-flight limit, commit_lsn as a quorum of this term's flushes,
//! the truncate horizon, the buffer trimmed behind them, and the backup
//! duty every append carries.

use bytes::Bytes;
use ferry_wal::proto::{AppendRequest, ToSafekeeper};
use ferry_wal::Lsn;

use super::{record_ends, Action, Peer, Phase, Proposer, ProposerError};

impl Proposer {
    /// Flush positions of the safekeepers that stream in this term.
    pub fn peer_flush_lsns(&self) -> Vec<Option<Lsn>> {
        self.peers
            .iter()
            .map(|p| match p {
                Peer::Streaming { flush_lsn, .. } => Some(*flush_lsn),
                _ => None,
            })
            .collect()
    }

    /// How many streaming safekeepers reported a commit_lsn at or past `lsn`, and
    /// how many stream at all.
    pub fn peers_knowing_commit(&self, lsn: Lsn) -> (usize, usize) {
        let mut knowing = 0;
        let mut streaming = 0;
        for (peer, state) in self.peers.iter().enumerate() {
            if matches!(state, Peer::Streaming { .. }) {
                streaming += 1;
                if self.peer_commit[peer] >= lsn {
                    knowing += 1;
                }
            }
        }
        (knowing, streaming)
    }

    /// Sends an empty append to every streaming safekeeper, carrying the current
    /// commit_lsn (call periodically).
    pub fn heartbeat(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.phase != Phase::Elected {
            return actions;
        }
        for peer in 0..self.peers.len() {
            if let Peer::Streaming { next_send, .. } = self.peers[peer] {
                actions.push(self.append_to(peer, next_send, Bytes::new()));
            }
        }
        actions
    }

    /// An append of `wal` starting at `begin` for `peer`, carrying the current
    /// commit and truncate positions, the backup position and duty and the
    /// slowest replica (empty `wal`: a heartbeat).
    pub(super) fn append_to(&self, peer: usize, begin: Lsn, wal: Bytes) -> Action {
        Action::Send {
            to: peer,
            msg: ToSafekeeper::Append(AppendRequest {
                term: self.term,
                begin_lsn: begin,
                end_lsn: Lsn(begin.0 + wal.len() as u64),
                commit_lsn: self.commit_lsn,
                truncate_lsn: self.truncate_lsn,
                backup_lsn: self.backup_lsn,
                backup_duty: self.offloader() == Some(peer),
                remote_consistent_lsn: self
                    .feedback
                    .values()
                    .map(|f| f.remote_consistent_lsn)
                    .min(),
                probe: self.probe,
                wal,
            }),
        }
    }

    /// The safekeeper that uploads whole segments now: among the streaming
    /// ones less than `max_offloader_lag_bytes` behind commit_lsn, in index
    /// order, the one at `term % count`. Deterministic, so every writer of a
    /// term picks the same one from the same facts; a new term, or a
    /// safekeeper falling behind or coming back, moves the duty. Two
    /// safekeepers uploading the same segment for a moment (an old duty
    /// not yet withdrawn) is harmless: a whole segment's bytes are committed
    /// WAL, the same on every safekeeper.
    pub fn offloader(&self) -> Option<usize> {
        if self.phase != Phase::Elected {
            return None;
        }
        // Asked for every append: counted, then picked, without a list.
        let candidate = |p: &Peer| match p {
            Peer::Streaming { flush_lsn, .. } => {
                flush_lsn.0 + self.config.max_offloader_lag_bytes > self.commit_lsn.0
            }
            _ => false,
        };
        let count = self.peers.iter().filter(|p| candidate(p)).count();
        if count == 0 {
            return None;
        }
        let pick = (self.term % count as u64) as usize;
        self.peers
            .iter()
            .enumerate()
            .filter(|(_, p)| candidate(p))
            .nth(pick)
            .map(|(i, _)| i)
    }

    /// The highest backup_lsn a safekeeper reported.
    pub fn backup_lsn(&self) -> Lsn {
        self.backup_lsn
    }

    /// Appends whole, valid records; returns the LSN just past them: they are
    /// durable once [`Action::Committed`] reaches it.
    pub fn append(&mut self, records: &Bytes) -> Result<(Lsn, Vec<Action>), ProposerError> {
        let end = self.append_unsent(records)?;
        let mut actions = Vec::new();
        self.pump_all(&mut actions);
        Ok((end, actions))
    }

    /// Like [`Proposer::append`] without sending anything yet: a driver that has
    /// several appends at hand adds them all, then calls [`Proposer::send_pending`]
    /// once, so they travel in one message per safekeeper.
    pub fn append_unsent(&mut self, records: &Bytes) -> Result<Lsn, ProposerError> {
        match self.phase {
            Phase::Elected => {}
            Phase::Stopped => return Err(ProposerError::Superseded(self.term)),
            _ => return Err(ProposerError::NotElected),
        }
        let ends =
            record_ends(records).map_err(|e| ProposerError::InvalidRecords(e.to_string()))?;
        self.buffer.push_back(records, &ends);
        Ok(self.end_lsn())
    }

    /// Like [`Proposer::append_unsent`] for records this writer encoded itself,
    /// whose record ends the encoder already knows: they are not checked again
    /// (a second checksum pass over every byte of an insert), except in debug
    /// builds.
    pub fn append_encoded_unsent(
        &mut self,
        records: &Bytes,
        ends: &[usize],
    ) -> Result<Lsn, ProposerError> {
        match self.phase {
            Phase::Elected => {}
            Phase::Stopped => return Err(ProposerError::Superseded(self.term)),
            _ => return Err(ProposerError::NotElected),
        }
        debug_assert_eq!(
            record_ends(records).ok().as_deref(),
            Some(ends),
            "the encoder's record ends"
        );
        self.buffer.push_back(records, ends);
        Ok(self.end_lsn())
    }

    /// Sends what [`Proposer::append_unsent`] added.
    pub fn send_pending(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.phase == Phase::Elected {
            self.pump_all(&mut actions);
        }
        actions
    }

    pub(super) fn on_append_response(
        &mut self,
        peer: usize,
        flush: Lsn,
        actions: &mut Vec<Action>,
    ) {
        match self.peers[peer].clone() {
            Peer::Electing { start } => {
                if flush != start {
                    tracing::warn!(peer, %flush, %start, "safekeeper did not truncate where told");
                    self.peers[peer] = Peer::Offline;
                    actions.push(Action::Reconnect { peer });
                    return;
                }
                self.peers[peer] = Peer::Streaming {
                    flush_lsn: flush,
                    next_send: start,
                };
                // A quorum already at the epoch start commits it right away (what
                // sync mode waits for).
                self.advance_commit(actions);
                self.start_fetch_if_needed(actions);
            }
            Peer::Streaming {
                flush_lsn,
                next_send,
            } => {
                if flush > next_send {
                    tracing::warn!(peer, %flush, %next_send, "safekeeper flushed more than was sent");
                    self.peers[peer] = Peer::Offline;
                    actions.push(Action::Reconnect { peer });
                    return;
                }
                self.peers[peer] = Peer::Streaming {
                    flush_lsn: flush_lsn.max(flush),
                    next_send,
                };
                self.advance_commit(actions);
                self.trim_buffer();
            }
            _ => return,
        }
        self.pump(peer, actions);
    }

    fn advance_commit(&mut self, actions: &mut Vec<Action>) {
        // No commit from a previous term: positions below the epoch start
        // prove nothing about this term's WAL.
        let Some(candidate) = self.quorum_value(|p| match self.peers[p] {
            Peer::Streaming { flush_lsn, .. } if flush_lsn >= self.epoch_start_lsn => {
                Some(flush_lsn)
            }
            _ => None,
        }) else {
            return;
        };
        if candidate > self.commit_lsn {
            self.commit_lsn = candidate;
            actions.push(Action::Committed {
                commit_lsn: candidate,
            });
        }
        let all = self.streaming_flushes();
        if all.len() == self.member_count() {
            let horizon = all
                .iter()
                .copied()
                .min()
                .unwrap_or(Lsn(0))
                .min(self.commit_lsn);
            self.truncate_lsn = self.truncate_lsn.max(horizon);
        }
    }

    /// Flush positions of the safekeepers streaming in this term.
    fn streaming_flushes(&self) -> Vec<Lsn> {
        self.peer_flush_lsns().into_iter().flatten().collect()
    }

    /// Drops WAL no safekeeper can need from the buffer: below every streaming
    /// safekeeper's flush when all stream, else below the commit once the buffer
    /// is over its limit (a returning safekeeper then reads from a peer).
    fn trim_buffer(&mut self) {
        // A running read ends at the buffer's start: the buffer stays put
        // until it lands. A paused one reads on to the new start on resuming.
        if self.fetch.as_ref().is_some_and(|f| f.source.is_some()) {
            return;
        }
        let streaming = self.streaming_flushes();
        let target = if streaming.len() == self.member_count() {
            streaming
                .iter()
                .copied()
                .min()
                .unwrap_or(self.buffer.start())
        } else if self.buffer.len() > self.config.max_buffered_bytes {
            self.commit_lsn
                .min(streaming.iter().copied().min().unwrap_or(self.commit_lsn))
        } else {
            return;
        };
        self.buffer.trim_to(target);
    }

    pub(super) fn pump_all(&mut self, actions: &mut Vec<Action>) {
        // What was appended leaves now, as one piece for every safekeeper.
        self.buffer.freeze_tail();
        for peer in 0..self.peers.len() {
            self.pump(peer, actions);
        }
    }

    /// Sends WAL to a streaming safekeeper, whole records only, up to the in-flight
    /// limit.
    fn pump(&mut self, peer: usize, actions: &mut Vec<Action>) {
        let Peer::Streaming {
            flush_lsn,
            mut next_send,
        } = self.peers[peer]
        else {
            return;
        };
        while next_send.distance_from(flush_lsn) < self.config.max_in_flight_bytes {
            let Some(wal) = self
                .buffer
                .next_piece(next_send, self.config.max_append_bytes)
            else {
                break;
            };
            let begin = next_send;
            next_send = Lsn(next_send.0 + wal.len() as u64);
            actions.push(self.append_to(peer, begin, wal));
        }
        self.peers[peer] = Peer::Streaming {
            flush_lsn,
            next_send,
        };
        if next_send < self.buffer.start() {
            self.start_fetch_if_needed(actions);
        }
    }
}
