//! Which safekeepers make up the WAL quorum, and how that set changes
//! without losing committed WAL (after Neon's RFC 035 and its TLA+ spec
//! `ProposerAcceptorReconfig`).
//!
//! A [`Configuration`] is numbered by its [`Generation`]; the coordination
//! store keeps the current one and only a compare-and-swap on its version
//! replaces it, so generations are unique and ordered. A change goes through
//! a *joint* configuration (`new_members` set) in which every election and
//! every commit needs a majority of the old members **and** a majority of the
//! new ones; it switches to the new set only once a majority of the new set
//! holds everything a majority of the old one could have committed
//! ([`Position`], the sync position). An abort before the switch is one more
//! generation with the old set alone.
//!
//! A safekeeper keeps the highest configuration it has seen in its control
//! file, adopts a higher one from anyone (a writer's greeting, the change
//! driver), and refuses votes, elections and appends from a writer of an
//! older generation; a writer that hears of a higher generation starts over
//! with it. The invariant and its proof sketch: `docs/protocols/membership.md`.
//!
//! Pure types and rules: no I/O.

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{Lsn, Term};

/// The number of a configuration: higher is newer. 0 is the configuration
/// of a cluster that never recorded one (every safekeeper the writer was
/// started with is a member); recorded ones start at 1.
pub type Generation = u32;

/// Most members of a set (old or new).
pub const MAX_MEMBERS: usize = 16;
/// Longest member address.
pub const MAX_ADDR_BYTES: usize = 256;

/// One safekeeper of a configuration: its node id (the control file's) and
/// where writers reach it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Member {
    pub id: u64,
    pub addr: String,
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.id, self.addr)
    }
}

/// The safekeepers of the WAL quorum in one generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Configuration {
    pub generation: Generation,
    pub members: Vec<Member>,
    /// Set while a change is under way: the set being moved to.
    pub new_members: Option<Vec<Member>>,
}

/// Why a configuration or a change of it is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    #[error("invalid configuration: {0}")]
    Invalid(String),
    #[error("a change is already under way (generation {generation}: {members} -> {new_members}); finish or abort it first")]
    ChangeUnderWay {
        generation: Generation,
        members: String,
        new_members: String,
    },
    #[error("no change is under way (generation {0})")]
    NoChange(Generation),
    #[error("{0}")]
    Refused(String),
}

/// A safekeeper's place in the WAL: the term that wrote its last record and
/// its flush_lsn. WAL at a higher position (term first) holds everything
/// committed that WAL at a lower one holds (the election's donor rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Position {
    pub last_log_term: Term,
    pub flush_lsn: Lsn,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} in term {}", self.flush_lsn, self.last_log_term)
    }
}

fn list(set: &[Member]) -> String {
    let ids: Vec<String> = set.iter().map(|m| m.to_string()).collect();
    format!("[{}]", ids.join(", "))
}

fn majority(set_len: usize) -> usize {
    set_len / 2 + 1
}

impl Configuration {
    /// The first recorded configuration of a cluster.
    pub fn initial(members: Vec<Member>) -> Result<Configuration, MembershipError> {
        let conf = Configuration {
            generation: 1,
            members,
            new_members: None,
        };
        conf.validate()?;
        Ok(conf)
    }

    /// Checks what a configuration read from the network, a disk or the
    /// coordination store must be: sets of 1 to [`MAX_MEMBERS`] members,
    /// unique ids within each set, the same address for an id in both sets,
    /// non-empty addresses of at most [`MAX_ADDR_BYTES`].
    pub fn validate(&self) -> Result<(), MembershipError> {
        let bad = |why: String| Err(MembershipError::Invalid(why));
        if self.generation == 0 {
            return bad("generation 0 is never recorded".into());
        }
        let mut sets = vec![("members", &self.members)];
        if let Some(new) = &self.new_members {
            sets.push(("new members", new));
        }
        for (name, set) in &sets {
            if set.is_empty() || set.len() > MAX_MEMBERS {
                return bad(format!("{} {name} (1 to {MAX_MEMBERS})", set.len()));
            }
            let ids: BTreeSet<u64> = set.iter().map(|m| m.id).collect();
            if ids.len() != set.len() {
                return bad(format!("a safekeeper id appears twice in the {name}"));
            }
            for m in set.iter() {
                if m.addr.trim().is_empty() || m.addr.len() > MAX_ADDR_BYTES {
                    return bad(format!(
                        "safekeeper {}: the address must be 1 to {MAX_ADDR_BYTES} bytes",
                        m.id
                    ));
                }
            }
        }
        if let Some(new) = &self.new_members {
            for m in new {
                if let Some(old) = self.members.iter().find(|o| o.id == m.id) {
                    if old.addr != m.addr {
                        return bad(format!(
                            "safekeeper {} has two addresses ({} and {})",
                            m.id, old.addr, m.addr
                        ));
                    }
                }
            }
            if same_ids(&self.members, new) {
                return bad("the new set is the current set".into());
            }
        }
        Ok(())
    }

    pub fn is_joint(&self) -> bool {
        self.new_members.is_some()
    }

    /// Every safekeeper a writer of this configuration talks to: the
    /// members, then the new members not among them. A writer's slots are
    /// in this order (its first slot has the backup duty first).
    pub fn all_members(&self) -> Vec<Member> {
        let mut all = self.members.clone();
        for m in self.new_members.iter().flatten() {
            if !all.iter().any(|o| o.id == m.id) {
                all.push(m.clone());
            }
        }
        all
    }

    /// Whether safekeeper `id` is in this configuration (old or new set).
    pub fn contains(&self, id: u64) -> bool {
        self.members.iter().any(|m| m.id == id)
            || self.new_members.iter().flatten().any(|m| m.id == id)
    }

    /// Whether the safekeepers for which `has` holds make a quorum: a
    /// majority of the members, and during a change a majority of the new
    /// members as well.
    pub fn is_quorum(&self, has: impl Fn(u64) -> bool) -> bool {
        let enough =
            |set: &[Member]| set.iter().filter(|m| has(m.id)).count() >= majority(set.len());
        enough(&self.members) && self.new_members.as_deref().is_none_or(enough)
    }

    /// The highest value a quorum has reached, given each safekeeper's value
    /// (`None` for one without): per set, the value of its majority-th
    /// highest member; the lowest of the sets. The commit rule, with flush
    /// positions as values.
    pub fn quorum_value<T: Ord + Copy>(&self, value: impl Fn(u64) -> Option<T>) -> Option<T> {
        let of_set = |set: &[Member]| {
            let mut values: Vec<T> = set.iter().filter_map(|m| value(m.id)).collect();
            values.sort_unstable_by(|a, b| b.cmp(a));
            values.get(majority(set.len()) - 1).copied()
        };
        let old = of_set(&self.members)?;
        match self.new_members.as_deref() {
            None => Some(old),
            Some(new) => Some(old.min(of_set(new)?)),
        }
    }

    /// The joint configuration moving this one to `new_members`.
    pub fn joint(&self, new_members: Vec<Member>) -> Result<Configuration, MembershipError> {
        if let Some(under_way) = &self.new_members {
            return Err(MembershipError::ChangeUnderWay {
                generation: self.generation,
                members: list(&self.members),
                new_members: list(under_way),
            });
        }
        let joint = Configuration {
            generation: self.next_generation()?,
            members: self.members.clone(),
            new_members: Some(new_members),
        };
        joint.validate()?;
        Ok(joint)
    }

    /// The configuration a finished change switches to: the new set alone.
    pub fn switched(&self) -> Result<Configuration, MembershipError> {
        let Some(new) = &self.new_members else {
            return Err(MembershipError::NoChange(self.generation));
        };
        Ok(Configuration {
            generation: self.next_generation()?,
            members: new.clone(),
            new_members: None,
        })
    }

    /// The configuration an aborted change goes back to: the old set alone,
    /// in a generation above the joint one (so writers and safekeepers that
    /// saw the joint one move on from it).
    pub fn aborted(&self) -> Result<Configuration, MembershipError> {
        if self.new_members.is_none() {
            return Err(MembershipError::NoChange(self.generation));
        }
        Ok(Configuration {
            generation: self.next_generation()?,
            members: self.members.clone(),
            new_members: None,
        })
    }

    fn next_generation(&self) -> Result<Generation, MembershipError> {
        self.generation
            .checked_add(1)
            .ok_or_else(|| MembershipError::Invalid("generation overflow".into()))
    }

    /// A short description for logs and the command line.
    pub fn describe(&self) -> String {
        match &self.new_members {
            None => format!("generation {}: {}", self.generation, list(&self.members)),
            Some(new) => format!(
                "generation {}: {} -> {} (joint)",
                self.generation,
                list(&self.members),
                list(new)
            ),
        }
    }
}

fn same_ids(a: &[Member], b: &[Member]) -> bool {
    let ids = |s: &[Member]| s.iter().map(|m| m.id).collect::<BTreeSet<u64>>();
    ids(a) == ids(b)
}

/// The highest position among a majority of the old set that adopted the
/// joint configuration: everything any generation before it could have
/// committed is at or below it, so the switch waits until a majority of the
/// new set has reached it ([`caught_up`]).
pub fn sync_position(positions: impl IntoIterator<Item = Position>) -> Option<Position> {
    positions.into_iter().max()
}

/// Whether a majority of the new set of `joint` reached `sync` (each
/// member's position from `position`; `None`: unknown).
pub fn caught_up(
    joint: &Configuration,
    sync: Position,
    position: impl Fn(u64) -> Option<Position>,
) -> bool {
    let Some(new) = &joint.new_members else {
        return true;
    };
    let reached = new
        .iter()
        .filter(|m| position(m.id).is_some_and(|p| p >= sync))
        .count();
    reached >= majority(new.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(id: u64) -> Member {
        Member {
            id,
            addr: format!("sk{id}:7000"),
        }
    }

    fn set(ids: &[u64]) -> Vec<Member> {
        ids.iter().map(|&i| m(i)).collect()
    }

    #[test]
    fn a_joint_configuration_needs_both_majorities() {
        let c = Configuration::initial(set(&[0, 1, 2])).expect("valid");
        let j = c.joint(set(&[0, 1, 3])).expect("valid");
        assert_eq!(j.generation, 2);
        assert_eq!(
            j.all_members().iter().map(|m| m.id).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        // {2, 3}: a majority of neither alone.
        assert!(!j.is_quorum(|id| id == 2 || id == 3));
        // {0, 2}: old majority, new minority (0 only).
        assert!(!j.is_quorum(|id| id == 0 || id == 2));
        assert!(j.is_quorum(|id| id == 0 || id == 1));
        assert!(j.is_quorum(|id| id == 1 || id == 2 || id == 3));
        assert!(c.is_quorum(|id| id == 0 || id == 2));
    }

    #[test]
    fn the_commit_value_is_the_lowest_of_both_majorities() {
        let j = Configuration::initial(set(&[0, 1, 2]))
            .expect("valid")
            .joint(set(&[0, 1, 3]))
            .expect("valid");
        let flush = |id: u64| Some([10u64, 5, 9, 1][id as usize]);
        // Old set: 10, 9, 5 -> 9; new set: 10, 5, 1 -> 5.
        assert_eq!(j.quorum_value(flush), Some(5));
        assert_eq!(j.quorum_value(|id| (id == 0).then_some(1u64)), None);
    }

    #[test]
    fn changes_go_joint_then_switch_or_abort_in_higher_generations() {
        let c = Configuration::initial(set(&[0, 1, 2])).expect("valid");
        let j = c.joint(set(&[0, 1, 3])).expect("valid");
        assert!(matches!(
            j.joint(set(&[0, 1, 4])),
            Err(MembershipError::ChangeUnderWay { .. })
        ));
        let s = j.switched().expect("valid");
        assert_eq!(
            (s.generation, s.members.clone(), s.new_members.clone()),
            (3, set(&[0, 1, 3]), None)
        );
        let a = j.aborted().expect("valid");
        assert_eq!((a.generation, a.members.clone()), (3, set(&[0, 1, 2])));
        assert!(c.switched().is_err());
        assert!(c.aborted().is_err());
    }

    #[test]
    fn bad_configurations_are_refused() {
        let c = Configuration::initial(set(&[0, 1, 2])).expect("valid");
        assert!(c.joint(set(&[2, 1, 0])).is_err(), "same set");
        assert!(c.joint(Vec::new()).is_err());
        assert!(c.joint(set(&[0, 0, 3])).is_err());
        let mut moved = set(&[0, 1, 3]);
        moved[0].addr = "elsewhere:1".into();
        assert!(c.joint(moved).is_err(), "two addresses for one id");
        assert!(Configuration::initial(Vec::new()).is_err());
        assert!(Configuration::initial(vec![Member {
            id: 1,
            addr: " ".into()
        }])
        .is_err());
        assert!(Configuration::initial(set(&(0..17).collect::<Vec<_>>())).is_err());
        let zero = Configuration { generation: 0, ..c };
        assert!(zero.validate().is_err());
    }

    #[test]
    fn the_switch_waits_for_a_new_majority_at_the_sync_position() {
        let j = Configuration::initial(set(&[0, 1, 2]))
            .expect("valid")
            .joint(set(&[0, 1, 3]))
            .expect("valid");
        let p = |t, l| Position {
            last_log_term: t,
            flush_lsn: Lsn(l),
        };
        let sync = sync_position([p(2, 100), p(3, 50), p(2, 200)]).expect("valid");
        assert_eq!(sync, p(3, 50));
        // Only 0 is there; 1 is behind in an older term with more bytes.
        let at = |id: u64| match id {
            0 => Some(p(3, 60)),
            1 => Some(p(2, 500)),
            _ => None,
        };
        assert!(!caught_up(&j, sync, at));
        let at = |id: u64| match id {
            0 => Some(p(3, 60)),
            3 => Some(p(3, 50)),
            _ => None,
        };
        assert!(caught_up(&j, sync, at));
    }
}
