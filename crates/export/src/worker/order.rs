//! The order in which a node tries the parts it holds: its own share of a
//! task's parts first (drawn by rendezvous hashing over the task's workers),
//! then the others' shares, each by the node's own hash.

use std::collections::BTreeSet;

/// A node's hash of a part: its place in the node's order, and its weight
/// in the rendezvous that draws shares. The two CRCs are mixed (splitmix64's
/// finaliser): CRC alone is affine, which would favour some node names.
fn order(replica: &str, part: &str) -> u64 {
    let mut x = (u64::from(crc32c::crc32c(replica.as_bytes())) << 32)
        | u64::from(crc32c::crc32c(part.as_bytes()));
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Where a part stands in a node's order: its share first (0), then the
/// other workers' shares (1), each by the node's own hash, so that nodes
/// done with their shares spread over the others' parts instead of all
/// meeting at the same ones.
pub(super) type Rank = (u8, u64);

/// The part's owner among `workers` (rendezvous hashing: each part goes
/// to the worker whose hash with it is highest, so a worker joining or
/// leaving moves only its own share).
fn owner<'w>(workers: &'w [String], part: &str) -> Option<&'w str> {
    workers
        .iter()
        .max_by_key(|w| order(w, part))
        .map(String::as_str)
}

fn rank(me: &str, workers: &[String], part: &str) -> Rank {
    match owner(workers, part) {
        Some(o) if o != me && workers.iter().any(|w| w == me) => (1, order(me, part)),
        _ => (0, order(me, part)),
    }
}

/// The parts a node holds and has not seen exported, in its order (see
/// [`Rank`]; the name breaks ties), with removal by name in O(log n).
#[derive(Default)]
pub(super) struct Todo {
    by_rank: BTreeSet<(Rank, String)>,
    ranks: std::collections::HashMap<String, Rank>,
}

impl Todo {
    /// Adds a part at its own-share rank until `rank` knows the workers.
    pub(super) fn insert(&mut self, part: String) {
        let r = (0, order("", &part));
        self.remove(&part);
        self.ranks.insert(part.clone(), r);
        self.by_rank.insert((r, part));
    }

    pub(super) fn remove(&mut self, part: &str) -> bool {
        match self.ranks.remove(part) {
            Some(r) => self.by_rank.remove(&(r, part.to_string())),
            None => false,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.by_rank.len()
    }

    pub(super) fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.by_rank.retain(|(_, p)| keep(p));
        self.ranks.retain(|p, _| keep(p));
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_rank.is_empty()
    }

    pub(super) fn clear(&mut self) {
        self.by_rank.clear();
        self.ranks.clear();
    }

    /// Orders the parts for `me` among `workers`.
    pub(super) fn rank(&mut self, me: &str, workers: &[String]) {
        let parts = std::mem::take(&mut self.by_rank);
        self.ranks.clear();
        for (_, p) in parts {
            let r = rank(me, workers, &p);
            self.ranks.insert(p.clone(), r);
            self.by_rank.insert((r, p));
        }
        assert_eq!(self.ranks.len(), self.by_rank.len(), "one rank per part");
    }

    /// The parts past `after`, in order.
    pub(super) fn after<'a>(
        &'a self,
        after: Option<&(Rank, String)>,
    ) -> impl Iterator<Item = &'a (Rank, String)> + 'a {
        use std::ops::Bound;
        let from = match after {
            Some(c) => Bound::Excluded(c.clone()),
            None => Bound::Unbounded,
        };
        self.by_rank.range((from, Bound::Unbounded))
    }
}
