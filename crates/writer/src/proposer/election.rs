//! The election: greetings, a term above every term heard, votes, the
//! donor whose WAL the new term builds on, each safekeeper told where to
//! truncate, and restored safekeepers brought back once proved current.

use bytes::Bytes;
use ferry_wal::proto::{GreetingResponse, ProposerElected, ToSafekeeper, VoteResponse};
use ferry_wal::{Lsn, Term};

use super::{Action, Peer, Phase, Proposer};
use crate::buffer::WalBuffer;

impl Proposer {
    pub(super) fn on_greeting_refused(
        &mut self,
        peer: usize,
        reason: String,
        actions: &mut Vec<Action>,
    ) {
        // A new connection greets again (the safekeeper may have been
        // repaired or restarted meanwhile); the same refusal is logged once.
        if self.refusals_logged[peer].as_deref() != Some(reason.as_str()) {
            tracing::warn!(peer, %reason, "safekeeper refused this writer's greeting");
            self.refusals_logged[peer] = Some(reason.clone());
        }
        self.peers[peer] = Peer::Refused { reason };
        let reasons: Vec<String> = self
            .peers
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p {
                Peer::Refused { reason } => Some(format!("safekeeper {i}: {reason}")),
                _ => None,
            })
            .collect();
        if reasons.len() == self.member_count() {
            self.phase = Phase::Lost;
            actions.push(Action::RefusedByAll { reasons });
        }
    }

    /// A higher term was seen: an elected writer is superseded and stops; one
    /// still electing has lost this attempt only.
    pub(super) fn stop(&mut self, term: Term, reason: &str, actions: &mut Vec<Action>) {
        if self.phase == Phase::Elected {
            self.phase = Phase::Stopped;
            actions.push(Action::Superseded {
                term,
                reason: reason.to_string(),
            });
        } else {
            self.phase = Phase::Lost;
            self.term = self.term.max(term);
            actions.push(Action::ElectionLost {
                term,
                reason: reason.to_string(),
            });
        }
    }

    /// This attempt lost its election to a higher term; [`Proposer::term`] is
    /// that term, which the next attempt must exceed.
    pub fn lost_election(&self) -> bool {
        self.phase == Phase::Lost
    }

    pub(super) fn on_greeting(
        &mut self,
        peer: usize,
        g: &GreetingResponse,
        actions: &mut Vec<Action>,
    ) {
        if self.peers[peer] != Peer::Greeting {
            return;
        }
        if let Some(conf) = &g.configuration {
            if conf.generation > self.generation() && conf.validate().is_ok() {
                // Its quorums are the cluster's now, not this proposer's.
                if self.phase == Phase::Elected {
                    // Every member, this one too, is greeted again.
                    self.adopt_in_place(conf.clone(), actions);
                    return;
                }
                tracing::info!(
                    peer,
                    configuration = %conf.describe(),
                    "a safekeeper holds a newer configuration; starting over with it"
                );
                self.phase = Phase::Stopped;
                actions.push(Action::Reconfigure {
                    configuration: conf.clone(),
                });
                return;
            }
        }
        if self.config.configuration.is_some() && self.slot_ids[peer] != g.node_id {
            let reason = format!(
                "the safekeeper at this address is node {}, the configuration names node {} here",
                g.node_id, self.slot_ids[peer]
            );
            self.on_greeting_refused(peer, reason, actions);
            return;
        }
        let term = g.term;
        if let Some(restored) = g.restored {
            if self.donor == Some(peer) {
                // The donor lost the WAL it gave this election: a term whose
                // start nobody else holds gives itself up (see
                // `start_fetch_if_needed`) rather than wait for it forever.
                self.donor = None;
                self.start_fetch_if_needed(actions);
                if self.phase == Phase::Stopped {
                    return;
                }
            }
            // A safekeeper rebuilt from the backup: never a voter. In its
            // quarantine, greet it again later.
            if !restored.ready {
                tracing::debug!(peer, "restored safekeeper in quarantine; greeting it later");
                self.peers[peer] = Peer::Offline;
                actions.push(Action::Reconnect { peer });
                return;
            }
            tracing::info!(peer, flush_lsn = %restored.flush_lsn, "restored safekeeper greeted");
            self.peers[peer] = Peer::Restored {
                flush_lsn: restored.flush_lsn,
            };
            if self.phase == Phase::Elected {
                self.start_rejoin(peer, actions);
            }
            return;
        }
        match self.phase {
            Phase::Greeting => {
                self.peers[peer] = Peer::Greeted { term };
                let greeted: Vec<Term> = self
                    .peers
                    .iter()
                    .filter_map(|p| match p {
                        Peer::Greeted { term } => Some(*term),
                        _ => None,
                    })
                    .collect();
                if self.is_quorum(|p| matches!(self.peers[p], Peer::Greeted { .. })) {
                    let highest = greeted.iter().copied().max().unwrap_or(0);
                    self.term = self.term.max(highest) + 1;
                    self.phase = Phase::Voting;
                    for p in 0..self.peers.len() {
                        if matches!(self.peers[p], Peer::Greeted { .. }) {
                            self.peers[p] = Peer::Voting;
                            actions.push(Action::Send {
                                to: p,
                                msg: ToSafekeeper::VoteRequest { term: self.term },
                            });
                        }
                    }
                }
            }
            Phase::Voting | Phase::Elected => {
                if term > self.term {
                    self.stop(term, "a safekeeper greeted with a higher term", actions);
                    return;
                }
                // Late safekeeper: its vote response tells us where its WAL is.
                self.peers[peer] = Peer::Voting;
                actions.push(Action::Send {
                    to: peer,
                    msg: ToSafekeeper::VoteRequest { term: self.term },
                });
            }
            Phase::Lost | Phase::Stopped => {}
        }
    }

    pub(super) fn on_vote(&mut self, peer: usize, vote: VoteResponse, actions: &mut Vec<Action>) {
        if self.peers[peer] != Peer::Voting {
            return;
        }
        if vote.term > self.term {
            self.stop(vote.term, "a safekeeper voted in a higher term", actions);
            return;
        }
        if !vote.term_history.is_well_formed() {
            tracing::warn!(peer, "malformed term history in a vote response");
            self.peers[peer] = Peer::Offline;
            return;
        }
        match self.phase {
            Phase::Voting => {
                if !vote.vote_given {
                    // Voted for a rival with the same term: it cannot count.
                    self.peers[peer] = Peer::Offline;
                    return;
                }
                self.peers[peer] = Peer::Voted(vote);
                if self.is_quorum(|p| matches!(self.peers[p], Peer::Voted(_))) {
                    self.become_elected(actions);
                }
            }
            Phase::Elected => {
                // A late safekeeper: same term at most, so it may stream from us.
                self.send_elected(peer, &vote, actions);
            }
            _ => {}
        }
    }

    fn become_elected(&mut self, actions: &mut Vec<Action>) {
        let voters: Vec<(usize, VoteResponse)> = self
            .peers
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p {
                Peer::Voted(v) => Some((i, v.clone())),
                _ => None,
            })
            .collect();
        let Some((donor, donor_vote)) = voters
            .iter()
            .max_by_key(|(i, v)| {
                (
                    v.term_history.last_term(),
                    v.flush_lsn,
                    std::cmp::Reverse(*i),
                )
            })
            .cloned()
        else {
            return;
        };
        // The donor holds every committed record a quorum could have: if even it
        // lacks what is known committed, this quorum lost data. Waiting for the
        // others may find a voter that has it.
        let best_flush_lsn = donor_vote.flush_lsn;
        if best_flush_lsn < self.config.known_commit_lsn {
            let all_voted = voters.len() == self.member_count();
            tracing::warn!(
                best = %best_flush_lsn,
                known = %self.config.known_commit_lsn,
                voters = voters.len(),
                "no voter holds the WAL known to be committed; not electing"
            );
            if all_voted {
                self.phase = Phase::Stopped;
            }
            actions.push(Action::BehindKnownCommit {
                best_flush_lsn,
                known_commit_lsn: self.config.known_commit_lsn,
                all_voted,
            });
            return;
        }
        self.phase = Phase::Elected;
        self.epoch_start_lsn = donor_vote.flush_lsn;
        self.truncate_lsn = voters
            .iter()
            .map(|(_, v)| v.truncate_lsn)
            .max()
            .unwrap_or(Lsn(0));
        self.history = donor_vote.term_history.clone();
        self.history.push(self.term, self.epoch_start_lsn);
        // The writer holds no WAL yet; what safekeepers miss below the epoch start
        // is fetched from the donor.
        self.buffer = WalBuffer::new(self.epoch_start_lsn);
        tracing::info!(
            term = self.term,
            donor,
            epoch_start = %self.epoch_start_lsn,
            "elected"
        );
        actions.push(Action::Elected {
            term: self.term,
            epoch_start_lsn: self.epoch_start_lsn,
        });
        for (peer, vote) in voters {
            self.send_elected(peer, &vote, actions);
        }
        self.donor = Some(donor);
        self.start_fetch_if_needed(actions);
        for peer in 0..self.peers.len() {
            if matches!(self.peers[peer], Peer::Restored { .. }) {
                self.start_rejoin(peer, actions);
            }
        }
    }

    /// Starts bringing back restored safekeeper `peer`, greeted after its
    /// quarantine: a new probe goes to every streaming safekeeper.
    fn start_rejoin(&mut self, peer: usize, actions: &mut Vec<Action>) {
        let Peer::Restored { flush_lsn } = self.peers[peer] else {
            return;
        };
        if flush_lsn > self.end_lsn() {
            // Its WAL is committed WAL, which this writer's holds: a restored
            // end past ours means the backup is not this timeline's.
            tracing::error!(peer, %flush_lsn, end = %self.end_lsn(), "restored safekeeper holds WAL past this writer's end; leaving it out");
            self.peers[peer] = Peer::Offline;
            return;
        }
        self.probe += 1;
        self.peers[peer] = Peer::Rejoining {
            flush_lsn,
            probe: self.probe,
        };
        for p in 0..self.peers.len() {
            if let Peer::Streaming { next_send, .. } = self.peers[p] {
                actions.push(self.append_to(p, next_send, Bytes::new()));
            }
        }
        self.bring_back_restored(actions);
    }

    /// Brings back every rejoining safekeeper whose probe a quorum of the
    /// others answered in this term: no writer of a higher term was elected
    /// by them before that answer, and none holding the restored
    /// safekeeper's lost votes can be elected after it (its quarantine
    /// outlasted those elections), so its acknowledgements are safe to count.
    pub(super) fn bring_back_restored(&mut self, actions: &mut Vec<Action>) {
        // Only once a quorum of the others holds this term's epoch start:
        // then every quorum the restored one can join holds a member with all
        // WAL committed before this term. Brought back earlier (its donor's
        // WAL lost, say), it would lower quorums that held committed WAL it
        // acknowledged before its loss (wal soak seed 89417877: a later
        // election of it and a lagging peer started at 0/0).
        if self.phase != Phase::Elected || self.commit_lsn < self.epoch_start_lsn {
            return;
        }
        for peer in 0..self.peers.len() {
            let Peer::Rejoining { flush_lsn, probe } = self.peers[peer] else {
                continue;
            };
            let confirmed = self.is_quorum(|p| {
                p != peer
                    && matches!(self.peers[p], Peer::Streaming { flush_lsn, .. } if flush_lsn >= self.epoch_start_lsn)
                    && self.peer_probe[p] >= probe
            });
            if !confirmed {
                continue;
            }
            tracing::info!(peer, start = %flush_lsn, "bringing back a restored safekeeper");
            // A restored donor gave up its role when it greeted.
            debug_assert_ne!(self.donor, Some(peer));
            self.send_elected_at(peer, flush_lsn, true, actions);
        }
    }

    fn send_elected(&mut self, peer: usize, vote: &VoteResponse, actions: &mut Vec<Action>) {
        // Our WAL is the donor's up to the epoch start, then this term's up to
        // end_lsn; a safekeeper already streaming in this term agrees with it up
        // to its own flush_lsn.
        let start = self
            .history
            .common_prefix_end(self.end_lsn(), &vote.term_history, vote.flush_lsn)
            .unwrap_or_else(|| self.history.0.first().map_or(Lsn(0), |e| e.lsn));
        self.send_elected_at(peer, start, false, actions);
    }

    /// Tells `peer` this writer is elected and that it streams from `start`
    /// (`rejoin`: a restored safekeeper brought back at its end).
    fn send_elected_at(
        &mut self,
        peer: usize,
        start: Lsn,
        rejoin: bool,
        actions: &mut Vec<Action>,
    ) {
        self.peers[peer] = Peer::Electing { start };
        actions.push(Action::Send {
            to: peer,
            msg: ToSafekeeper::Elected(ProposerElected {
                term: self.term,
                start_streaming_at: start,
                term_history: self.history.clone(),
                timeline_start_lsn: Lsn(0),
                rejoin,
            }),
        });
    }
}
