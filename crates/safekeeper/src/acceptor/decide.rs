//! The acceptor's decisions, apart from its I/O.
//!
//! Each function takes the acceptor's positions as they stand ([`Positions`])
//! and one message, and says what to do: refuse (with the reason the writer
//! is told), or which writes to make and in which order. Nothing here reads
//! or writes the disk; `protocol` performs what these decide and asserts,
//! after the write, the invariant the decision relied on. So every rule of
//! the proposer-acceptor protocol sits in one place and is tested without a
//! disk (the tests below), and the simulator tests the same functions with
//! I/O and faults around them.

use ferry_wal::membership::{Configuration, Generation};
use ferry_wal::proto::{AppendRequest, ProposerElected, GENERATION};
use ferry_wal::{Lsn, Term};

use super::{refused, AcceptorError};

/// What the decisions read of an acceptor: its persisted term and term
/// history, its WAL's ends and its commit point, and whether it was restored
/// from the backup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Positions {
    /// The highest term this safekeeper voted in or accepted.
    pub(super) term: Term,
    /// The last term of the term history (the elected writer's, once it
    /// was accepted).
    pub(super) history_term: Term,
    /// The term that wrote the WAL up to `flush_lsn`.
    pub(super) last_log_term: Term,
    pub(super) flush_lsn: Lsn,
    pub(super) commit_lsn: Lsn,
    /// The durable point recorded in the control file.
    pub(super) durable_lsn: Lsn,
    /// Rebuilt from the backup and not brought back by a writer yet.
    pub(super) restored: bool,
    /// The quarantine of a restored safekeeper is over.
    pub(super) quarantine_over: bool,
}

/// The generation of a configuration (`None`: 0, never recorded).
pub(super) fn generation_of(conf: Option<&Configuration>) -> Generation {
    conf.map_or(0, |c| c.generation)
}

/// Whether a writer that greeted with generation `writer` may vote, elect
/// or append here: not if this safekeeper has seen a higher generation (its
/// quorums are no longer the writer's), nor if the configuration it holds
/// does not name it (it was removed), nor if it holds none while the
/// writer has one. Every member of a recorded configuration got it from
/// the change driver (`ferry safekeeper-set init` hands it to all before
/// recording it; a change to the new members with its term floor), so a
/// safekeeper without one in a configured cluster was created empty since:
/// a new member not handed its first configuration yet, or an id that
/// lost its data and forgot the votes it gave, which must not vote again
/// in a term it may have voted in.
pub(super) fn generation_allows(
    term: Term,
    own: Option<&Configuration>,
    node_id: u64,
    writer: Generation,
) -> Result<(), AcceptorError> {
    let Some(own) = own else {
        if writer > 0 {
            // Not a `GENERATION` refusal: no newer configuration to greet
            // again for; the writer reconnects later, after the driver.
            return Err(refused(
                term,
                format!(
                    "safekeeper {node_id} holds no configuration while the writer holds generation {writer}: it takes its first one from the change driver (`ferry safekeeper-set`), never from a writer"
                ),
            ));
        }
        return Ok(());
    };
    if writer < own.generation {
        return Err(refused(
            term,
            format!(
                "{GENERATION} the writer's generation {writer} is older than this safekeeper's {}",
                own.generation
            ),
        ));
    }
    if !own.contains(node_id) {
        return Err(refused(
            term,
            format!(
                "{GENERATION} safekeeper {node_id} is not a member of generation {}",
                own.generation
            ),
        ));
    }
    Ok(())
}

/// Whether to adopt `offered` (from a writer's greeting or the change
/// driver): only a valid configuration of a higher generation; the same
/// generation must be the same configuration (generations are unique, by
/// the coordination store's compare-and-swap).
pub(super) fn adopt_configuration(
    term: Term,
    own: Option<&Configuration>,
    offered: &Configuration,
) -> Result<bool, AcceptorError> {
    if let Err(e) = offered.validate() {
        return Err(refused(term, e.to_string()));
    }
    match own {
        Some(own) if own.generation == offered.generation && own != offered => Err(refused(
            term,
            format!(
                "{GENERATION} two configurations claim generation {}: {} here, {} offered",
                own.generation,
                own.describe(),
                offered.describe()
            ),
        )),
        Some(own) => Ok(offered.generation > own.generation),
        None => Ok(true),
    }
}

/// A vote request: whether to grant it (the new term is persisted first).
pub(super) fn vote(p: &Positions, term: Term) -> Result<bool, AcceptorError> {
    if p.restored {
        // It forgot the terms it voted in: a vote now could be a second
        // vote in one of them.
        return Err(refused(
            p.term,
            "restored from the backup: it votes again only once a writer brought it back",
        ));
    }
    Ok(p.term < term)
}

/// The checks of an election message that need no WAL position (made
/// before the pending WAL is flushed).
pub(super) fn elected_message(p: &Positions, msg: &ProposerElected) -> Result<(), AcceptorError> {
    if msg.term < p.term {
        return Err(refused(p.term, format!("term {} is stale", msg.term)));
    }
    if !msg.term_history.is_well_formed() || msg.term_history.last_term() != msg.term {
        return Err(refused(p.term, "malformed term history"));
    }
    Ok(())
}

/// The writes an accepted election makes, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ElectedPlan {
    /// Record this lower durable point before the truncation, so that a
    /// crash in between never finds less WAL than recorded.
    pub(super) lower_durable_to: Option<Lsn>,
    /// Cut the WAL here (never below commit_lsn), then persist the new term
    /// and term history.
    pub(super) truncate_at: Lsn,
}

/// Whether this safekeeper takes the elected writer's word, from its
/// positions after the flush: a restored safekeeper only rejoins, at its end
/// and after its quarantine; WAL of the writer's own term is never cut;
/// committed WAL is never cut; the writer cannot start past our end.
pub(super) fn elected(p: &Positions, msg: &ProposerElected) -> Result<ElectedPlan, AcceptorError> {
    match (p.restored, msg.rejoin) {
        (false, false) => {}
        (false, true) => {
            return Err(refused(
                p.term,
                "not a restored safekeeper (it rejoined already)",
            ))
        }
        (true, false) => return Err(refused(
            p.term,
            "restored from the backup: only a writer that proved it is current may bring it back",
        )),
        (true, true) => {
            // The writer greeted us after the quarantine and then heard a
            // quorum of the others in its term; our WAL is committed WAL,
            // so it is the writer's up to our end.
            if !p.quarantine_over {
                return Err(refused(
                    p.term,
                    "restored from the backup: still in quarantine",
                ));
            }
            if msg.start_streaming_at != p.flush_lsn {
                return Err(refused(
                    p.term,
                    format!(
                        "a restored safekeeper rejoins at its end {}, not at {}",
                        p.flush_lsn, msg.start_streaming_at
                    ),
                ));
            }
        }
    }
    if p.last_log_term == msg.term && p.flush_lsn > msg.start_streaming_at {
        return Err(refused(
            p.term,
            format!(
                "already holds WAL of term {} up to {}, beyond {}",
                msg.term, p.flush_lsn, msg.start_streaming_at
            ),
        ));
    }
    if msg.start_streaming_at < p.commit_lsn {
        // The writer would lose committed WAL: never do it.
        tracing::error!(
            start = %msg.start_streaming_at,
            commit = %p.commit_lsn,
            "election asks to truncate committed WAL"
        );
        return Err(refused(
            p.term,
            format!(
                "start_streaming_at {} is below commit_lsn {}: refusing to truncate committed WAL",
                msg.start_streaming_at, p.commit_lsn
            ),
        ));
    }
    if msg.start_streaming_at > p.flush_lsn {
        return Err(refused(
            p.term,
            format!(
                "start_streaming_at {} is beyond flush_lsn {}",
                msg.start_streaming_at, p.flush_lsn
            ),
        ));
    }
    Ok(ElectedPlan {
        lower_durable_to: (p.durable_lsn > msg.start_streaming_at)
            .then_some(msg.start_streaming_at),
        truncate_at: msg.start_streaming_at,
    })
}

/// Whether an append is taken: only from the writer elected in the current
/// term, with bounds that match its payload, and (when it carries WAL)
/// exactly at `wal_end`, the end of the WAL written and gathered so far.
pub(super) fn append(
    p: &Positions,
    req: &AppendRequest,
    wal_end: Lsn,
) -> Result<(), AcceptorError> {
    if req.term < p.term {
        return Err(refused(p.term, format!("term {} is stale", req.term)));
    }
    if req.term > p.term || p.history_term != req.term {
        return Err(refused(
            p.term,
            format!("append of term {} before its election", req.term),
        ));
    }
    if !req.is_consistent() {
        return Err(refused(p.term, "append bounds do not match its payload"));
    }
    if !req.wal.is_empty() && req.begin_lsn != wal_end {
        return Err(refused(
            p.term,
            format!(
                "WAL write at {} but the WAL ends at {wal_end}",
                req.begin_lsn
            ),
        ));
    }
    Ok(())
}

/// commit_lsn after a flush: the highest announced by the writer, capped by
/// what is flushed here, and never lower than before.
pub(super) fn commit_after_flush(commit: Lsn, announced: Lsn, flush_lsn: Lsn) -> Lsn {
    commit.max(announced.min(flush_lsn))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use ferry_wal::{TermHistory, TermLsn};

    fn positions() -> Positions {
        Positions {
            term: 3,
            history_term: 3,
            last_log_term: 2,
            flush_lsn: Lsn(1000),
            commit_lsn: Lsn(600),
            durable_lsn: Lsn(1000),
            restored: false,
            quarantine_over: false,
        }
    }

    fn history(terms: &[(u64, u64)]) -> TermHistory {
        TermHistory(
            terms
                .iter()
                .map(|&(t, l)| TermLsn {
                    term: t,
                    lsn: Lsn(l),
                })
                .collect(),
        )
    }

    fn elected_at(term: u64, start: u64) -> ProposerElected {
        ProposerElected {
            term,
            start_streaming_at: Lsn(start),
            term_history: history(&[(1, 0), (term, start)]),
            timeline_start_lsn: Lsn(0),
            rejoin: false,
        }
    }

    fn reason(e: AcceptorError) -> String {
        match e {
            AcceptorError::Refused { reason, .. } => reason,
            other => panic!("not a refusal: {other}"),
        }
    }

    #[test]
    fn a_vote_is_granted_only_above_every_term_seen() {
        let p = positions();
        assert!(!vote(&p, 2).expect("taken"));
        assert!(!vote(&p, 3).expect("taken"));
        assert!(vote(&p, 4).expect("taken"));
        let restored = Positions {
            restored: true,
            ..p
        };
        assert!(reason(vote(&restored, 9).expect_err("refused")).contains("restored"));
    }

    #[test]
    fn an_election_never_cuts_committed_wal_nor_starts_past_the_end() {
        let p = positions();
        let below = elected(&p, &elected_at(4, 599)).expect_err("refused");
        assert!(reason(below).contains("refusing to truncate committed WAL"));
        let beyond = elected(&p, &elected_at(4, 1001)).expect_err("refused");
        assert!(reason(beyond).contains("beyond flush_lsn"));
        // At commit_lsn exactly: the uncommitted tail goes, the durable
        // point is lowered first.
        assert_eq!(
            elected(&p, &elected_at(4, 600)).expect("taken"),
            ElectedPlan {
                lower_durable_to: Some(Lsn(600)),
                truncate_at: Lsn(600),
            }
        );
        assert_eq!(
            elected(&p, &elected_at(4, 1000)).expect("taken"),
            ElectedPlan {
                lower_durable_to: None,
                truncate_at: Lsn(1000),
            }
        );
    }

    #[test]
    fn wal_of_the_writers_own_term_is_never_cut() {
        let p = Positions {
            last_log_term: 4,
            term: 4,
            ..positions()
        };
        let e = elected(&p, &elected_at(4, 800)).expect_err("refused");
        assert!(reason(e).contains("already holds WAL of term 4"));
    }

    #[test]
    fn a_restored_safekeeper_rejoins_only_after_quarantine_at_its_end() {
        let p = Positions {
            restored: true,
            ..positions()
        };
        let rejoin = |start| ProposerElected {
            rejoin: true,
            ..elected_at(4, start)
        };
        assert!(reason(elected(&p, &elected_at(4, 1000)).expect_err("refused")).contains("proved"));
        assert!(reason(elected(&p, &rejoin(1000)).expect_err("refused")).contains("quarantine"));
        let over = Positions {
            quarantine_over: true,
            ..p
        };
        assert!(reason(elected(&over, &rejoin(900)).expect_err("refused"))
            .contains("rejoins at its end"));
        assert!(elected(&over, &rejoin(1000)).is_ok());
        assert!(
            reason(elected(&positions(), &rejoin(1000)).expect_err("refused")).contains("rejoined")
        );
    }

    #[test]
    fn an_election_message_of_an_older_term_or_bad_history_is_refused() {
        let p = positions();
        assert!(
            reason(elected_message(&p, &elected_at(2, 600)).expect_err("refused"))
                .contains("stale")
        );
        let mut bad = elected_at(4, 600);
        bad.term_history = history(&[(1, 0), (5, 600)]);
        assert!(reason(elected_message(&p, &bad).expect_err("refused")).contains("malformed"));
        assert!(elected_message(&p, &elected_at(3, 600)).is_ok());
    }

    #[test]
    fn appends_come_only_from_the_elected_writer_and_contiguously() {
        let p = positions();
        let req = |term: u64, begin: u64, wal: &'static [u8]| AppendRequest {
            term,
            begin_lsn: Lsn(begin),
            end_lsn: Lsn(begin + wal.len() as u64),
            wal: Bytes::from_static(wal),
            ..AppendRequest::default()
        };
        assert!(
            reason(append(&p, &req(2, 1000, b"ab"), Lsn(1000)).expect_err("refused"))
                .contains("stale")
        );
        assert!(
            reason(append(&p, &req(4, 1000, b"ab"), Lsn(1000)).expect_err("refused"))
                .contains("before its election")
        );
        let unelected = Positions {
            history_term: 2,
            ..p
        };
        assert!(append(&unelected, &req(3, 1000, b"ab"), Lsn(1000)).is_err());
        assert!(
            reason(append(&p, &req(3, 999, b"ab"), Lsn(1000)).expect_err("refused"))
                .contains("the WAL ends at")
        );
        assert!(append(&p, &req(3, 1000, b"ab"), Lsn(1000)).is_ok());
        // An append without WAL (commit and horizons only) may lag behind.
        assert!(append(&p, &req(3, 10, b""), Lsn(1000)).is_ok());
    }

    #[test]
    fn commit_lsn_never_goes_back_nor_past_the_flush() {
        assert_eq!(commit_after_flush(Lsn(5), Lsn(9), Lsn(7)), Lsn(7));
        assert_eq!(commit_after_flush(Lsn(5), Lsn(3), Lsn(7)), Lsn(5));
        assert_eq!(commit_after_flush(Lsn(5), Lsn(9), Lsn(4)), Lsn(5));
        assert_eq!(commit_after_flush(Lsn(5), Lsn(6), Lsn(9)), Lsn(6));
    }

    fn conf(generation: Generation, ids: &[u64], new: Option<&[u64]>) -> Configuration {
        let set = |ids: &[u64]| {
            ids.iter()
                .map(|&id| ferry_wal::membership::Member {
                    id,
                    addr: format!("sk{id}:1"),
                })
                .collect::<Vec<_>>()
        };
        Configuration {
            generation,
            members: set(ids),
            new_members: new.map(set),
        }
    }

    #[test]
    fn an_older_generation_or_a_removed_safekeeper_refuses_the_writer() {
        let own = conf(3, &[0, 1, 2], None);
        assert!(generation_allows(1, None, 0, 0).is_ok());
        let none = generation_allows(1, None, 0, 1).expect_err("no configuration here");
        assert!(none.to_string().contains("change driver"), "{none}");
        assert!(generation_allows(1, Some(&own), 0, 3).is_ok());
        assert!(generation_allows(1, Some(&own), 0, 4).is_ok());
        let older = generation_allows(1, Some(&own), 0, 2).expect_err("older generation");
        assert!(reason(older).starts_with(GENERATION));
        assert!(generation_allows(1, Some(&own), 0, 0).is_err());
        let removed = generation_allows(1, Some(&own), 7, 3).expect_err("not a member");
        assert!(reason(removed).contains("not a member"));
        let joint = conf(4, &[0, 1, 2], Some(&[0, 1, 7]));
        assert!(generation_allows(1, Some(&joint), 7, 4).is_ok());
    }

    #[test]
    fn only_higher_generations_are_adopted_and_a_generation_is_one_configuration() {
        let own = conf(3, &[0, 1, 2], None);
        assert!(adopt_configuration(1, None, &own).expect("first"));
        assert!(!adopt_configuration(1, Some(&own), &own).expect("same"));
        assert!(!adopt_configuration(1, Some(&own), &conf(2, &[0, 1], None)).expect("older"));
        assert!(
            adopt_configuration(1, Some(&own), &conf(4, &[0, 1, 2], Some(&[0, 1, 3])))
                .expect("newer")
        );
        assert!(adopt_configuration(1, Some(&own), &conf(3, &[0, 1, 3], None)).is_err());
        assert!(adopt_configuration(1, Some(&own), &conf(5, &[], None)).is_err());
    }
}
