//! Log sequence numbers, terms and term histories.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A position in the WAL: the byte offset from the start of the timeline.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The invalid / unset position.
    pub const INVALID: Lsn = Lsn(0);

    /// The position `bytes` further on, or `None` on overflow.
    pub fn checked_add(self, bytes: u64) -> Option<Lsn> {
        self.0.checked_add(bytes).map(Lsn)
    }

    /// Bytes from `earlier` to `self` (0 if `earlier` is later).
    pub fn distance_from(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

/// Printed the PostgreSQL way, `high/low` in hex, which is what operators know.
impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

/// Parses the `high/low` hex form that [`Lsn`]'s `Display` prints.
impl std::str::FromStr for Lsn {
    type Err = String;

    fn from_str(s: &str) -> Result<Lsn, String> {
        let (hi, lo) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not an LSN (expected X/Y)"))?;
        let hi = u32::from_str_radix(hi, 16).map_err(|e| format!("{s:?}: {e}"))?;
        let lo = u32::from_str_radix(lo, 16).map_err(|e| format!("{s:?}: {e}"))?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

/// A leadership epoch: at most one writer is elected per term.
pub type Term = u64;

/// The WAL written in `term` starts at `lsn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TermLsn {
    pub term: Term,
    pub lsn: Lsn,
}

/// Which term wrote which part of the WAL: entries with strictly increasing terms
/// and non-decreasing start LSNs. Two safekeepers hold the same WAL up to the
/// point where their histories diverge.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TermHistory(pub Vec<TermLsn>);

impl TermHistory {
    /// Entries are ordered as required.
    pub fn is_well_formed(&self) -> bool {
        self.0
            .windows(2)
            .all(|w| w[0].term < w[1].term && w[0].lsn <= w[1].lsn)
    }

    /// The term of the last entry (0 when empty): the safekeeper's "epoch", the
    /// term that wrote its WAL tail.
    pub fn last_term(&self) -> Term {
        self.0.last().map_or(0, |e| e.term)
    }

    /// The term that wrote the WAL ending at `lsn`: `up_to(lsn).last_term()`
    /// without building the history (called for every flushed batch).
    pub fn term_at(&self, lsn: Lsn) -> Term {
        self.0
            .iter()
            .rev()
            .find(|e| e.lsn <= lsn)
            .map_or(0, |e| e.term)
    }

    /// The history as it applies to WAL ending at `lsn`: entries of terms that
    /// switched in after `lsn` are dropped. A term starting exactly at `lsn` is
    /// kept: the node accepted that leader and its WAL agrees with it so far.
    pub fn up_to(&self, lsn: Lsn) -> TermHistory {
        TermHistory(self.0.iter().copied().filter(|e| e.lsn <= lsn).collect())
    }

    /// Appends the entry for a newly elected term starting at `lsn`.
    pub fn push(&mut self, term: Term, lsn: Lsn) {
        debug_assert!(self.last_term() < term);
        self.0.push(TermLsn { term, lsn });
    }

    /// The point up to which WAL written according to `self` (and flushed up to
    /// `self_end`) is identical to WAL written according to `other` (flushed up to
    /// `other_end`): the end of the last common term, bounded by both ends.
    /// Returns `None` when they share no term at all.
    pub fn common_prefix_end(
        &self,
        self_end: Lsn,
        other: &TermHistory,
        other_end: Lsn,
    ) -> Option<Lsn> {
        // Find the last index i where both histories have the same (term, lsn).
        let mut last_common = None;
        for (i, (a, b)) in self.0.iter().zip(other.0.iter()).enumerate() {
            if a == b {
                last_common = Some(i);
            } else {
                break;
            }
        }
        let i = last_common?;
        // The common term ends where either history moves to a next term, or at
        // either node's end of WAL.
        let next_self = self.0.get(i + 1).map_or(self_end, |e| e.lsn);
        let next_other = other.0.get(i + 1).map_or(other_end, |e| e.lsn);
        Some(next_self.min(next_other).min(self_end).min(other_end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(entries: &[(Term, u64)]) -> TermHistory {
        TermHistory(
            entries
                .iter()
                .map(|&(term, lsn)| TermLsn {
                    term,
                    lsn: Lsn(lsn),
                })
                .collect(),
        )
    }

    #[test]
    fn display_is_postgres_style() {
        assert_eq!(Lsn(0x1_0000_00A0).to_string(), "1/A0");
        assert_eq!(Lsn(0x16B3740).to_string(), "0/16B3740");
        for lsn in [0u64, 1, 0x1_0000_00A0, u64::MAX] {
            assert_eq!(Lsn(lsn).to_string().parse::<Lsn>(), Ok(Lsn(lsn)));
        }
        assert!("12".parse::<Lsn>().is_err());
        assert!("x/1".parse::<Lsn>().is_err());
    }

    #[test]
    fn common_prefix() {
        let a = h(&[(1, 0), (2, 100), (4, 300)]);
        let b = h(&[(1, 0), (2, 100), (3, 200)]);
        assert_eq!(a.common_prefix_end(Lsn(400), &b, Lsn(250)), Some(Lsn(200)));
        assert_eq!(a.common_prefix_end(Lsn(400), &a, Lsn(400)), Some(Lsn(400)));
        // Same history, one node behind.
        assert_eq!(a.common_prefix_end(Lsn(400), &a, Lsn(350)), Some(Lsn(350)));
        assert_eq!(a.common_prefix_end(Lsn(400), &h(&[(5, 0)]), Lsn(10)), None);
        assert_eq!(h(&[]).common_prefix_end(Lsn(0), &a, Lsn(400)), None);
    }

    #[test]
    fn up_to_and_last_term() {
        let a = h(&[(1, 0), (2, 100), (4, 300)]);
        assert_eq!(a.up_to(Lsn(299)), h(&[(1, 0), (2, 100)]));
        assert_eq!(a.up_to(Lsn(300)).last_term(), 4);
        for lsn in [0, 50, 100, 299, 300, 1000] {
            assert_eq!(
                a.term_at(Lsn(lsn)),
                a.up_to(Lsn(lsn)).last_term(),
                "at {lsn}"
            );
        }
        assert_eq!(TermHistory::default().term_at(Lsn(5)), 0);
        assert!(a.is_well_formed());
        assert!(!h(&[(2, 0), (2, 5)]).is_well_formed());
        assert!(!h(&[(1, 50), (2, 5)]).is_well_formed());
    }
}
