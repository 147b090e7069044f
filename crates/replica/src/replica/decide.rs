//! The replica's decisions, apart from its I/O: what an insert record does
//! to this replica, which keys the idempotency window remembers, when what
//! was applied is made durable, and which merges the applied WAL decides.
//!
//! Each function takes what the replica knows (its shard, its window, the
//! part names it holds) and one record or position, and answers; `apply`
//! and `merges` decode, encode, write and sync what these decide. Every
//! replica of a shard must decide the same from the same WAL (part names
//! and merges are compared across replicas), so nothing here reads a clock,
//! a random number or the disk.

use std::collections::{BTreeSet, VecDeque};

use ferry_wal::Lsn;

use super::merges::{Merge, MAX_MERGE_LEVEL, MERGE_FANIN};
use crate::part::PartName;

/// Keyed inserts of a shard remembered for deduplication.
pub const DEDUP_WINDOW: usize = 4096;

/// Applied WAL after which parts are synced and the position persisted even
/// while the replica is behind.
pub const PERSIST_EVERY_BYTES: u64 = 16 << 20;

/// The window of keyed inserts: (table id, shard, key, LSN of the record
/// that applied it), oldest first.
pub(super) type Window = VecDeque<(u64, u32, String, Lsn)>;

/// What an insert record of a known table does to this replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Fate {
    /// Another record applied the same key of the same table and shard:
    /// the rows are in already; nothing is written.
    Duplicate,
    /// A part holding this block exists (a crash came after the parts and
    /// before the state): the rows are in; only the key is remembered.
    AlreadyApplied,
    /// Write its rows as level-0 parts, one per partition.
    Write,
}

/// Whether a record of `shard` is for a replica of `replica_shard`
/// (`all_shards` serves every shard).
pub(super) fn is_ours(replica_shard: u32, all_shards: u32, shard: u32) -> bool {
    replica_shard == all_shards || shard == replica_shard
}

/// The fate of an insert record at `lsn` of `table_id` and `shard`, with
/// its idempotency `key` (if any) and its first block; `covered` says
/// whether a part this replica holds or writes holds that block.
pub(super) fn fate(
    window: &Window,
    table_id: u64,
    shard: u32,
    key: Option<&str>,
    lsn: Lsn,
    covered: bool,
) -> Fate {
    if let Some(key) = key {
        let seen = window
            .iter()
            .any(|(t, s, k, at)| *t == table_id && *s == shard && k == key && *at != lsn);
        if seen {
            return Fate::Duplicate;
        }
    }
    if covered {
        Fate::AlreadyApplied
    } else {
        Fate::Write
    }
}

/// Remembers that the record at `lsn` applied `key` (once: a record seen
/// again after a crash is not counted twice), dropping the oldest keys
/// beyond [`DEDUP_WINDOW`].
pub(super) fn remember(window: &mut Window, table_id: u64, shard: u32, key: String, lsn: Lsn) {
    if !window.iter().any(|(_, _, _, at)| *at == lsn) {
        window.push_back((table_id, shard, key, lsn));
        while window.len() > DEDUP_WINDOW {
            window.pop_front();
        }
    }
    assert!(
        window.len() <= DEDUP_WINDOW,
        "the idempotency window is bounded"
    );
}

/// Whether what was applied is made durable now: when the replica caught
/// up with what its safekeeper committed, when applying failed (what was
/// applied before the failure stays applied), or every
/// [`PERSIST_EVERY_BYTES`] of WAL while it is behind (so syncing overlaps
/// applying).
pub(super) fn persist_due(
    applied_any: bool,
    caught_up: bool,
    failed: bool,
    unpersisted_bytes: u64,
) -> bool {
    applied_any && (caught_up || failed || unpersisted_bytes >= PERSIST_EVERY_BYTES)
}

/// The merge policy, a function of the applied WAL alone: whenever a
/// partition holds [`MERGE_FANIN`] parts of one level (below
/// [`MAX_MERGE_LEVEL`]), the oldest of them (lowest blocks) become one part
/// of the next level; repeated while it applies. `logical` is the
/// partition's parts with every merge decided before counted as done.
pub(super) fn merges(table_id: u64, partition: &str, logical: BTreeSet<PartName>) -> Vec<Merge> {
    let mut names = logical;
    let mut decided = Vec::new();
    'again: loop {
        // In block order: a merge takes consecutive parts only, so that
        // parts stay disjoint and nested (laminar) whatever made them. Merges
        // alone keep the levels falling with the blocks, each level one
        // run; a compaction may leave a part of one level between parts of
        // a lower one, which then merge on either side of it.
        let mut ordered: Vec<&PartName> = names.iter().collect();
        ordered.sort_by_key(|n| n.min_block);
        for level in 0..MAX_MERGE_LEVEL {
            let Some(start) = ordered
                .windows(MERGE_FANIN)
                .position(|w| w.iter().all(|n| n.level == level))
            else {
                continue;
            };
            let sources: Vec<PartName> = ordered[start..start + MERGE_FANIN]
                .iter()
                .map(|n| (*n).clone())
                .collect();
            let result = PartName {
                partition_id: partition.to_string(),
                min_block: sources[0].min_block,
                max_block: sources[MERGE_FANIN - 1].max_block,
                level: level + 1,
            };
            for s in &sources {
                names.remove(s);
            }
            names.insert(result.clone());
            decided.push(Merge {
                table_id,
                result,
                sources,
            });
            continue 'again;
        }
        return decided;
    }
}

/// A compaction, a function of the applied WAL alone: the partition's
/// logical parts (`parts`: name and rows, any order) in block order, cut
/// into runs of consecutive parts of at most `target_rows` rows together;
/// each run of two or more becomes one part a level above its highest.
/// Parts already at the target stay alone, so compacting again decides
/// nothing.
pub(super) fn compaction(
    table_id: u64,
    partition: &str,
    mut parts: Vec<(PartName, u64)>,
    target_rows: u64,
) -> Vec<Merge> {
    parts.sort_by_key(|(n, _)| n.min_block);
    let mut decided = Vec::new();
    let mut run: Vec<(PartName, u64)> = Vec::new();
    let close = |run: &mut Vec<(PartName, u64)>, decided: &mut Vec<Merge>| {
        if run.len() >= 2 {
            let sources: Vec<PartName> = run.iter().map(|(n, _)| n.clone()).collect();
            decided.push(Merge {
                table_id,
                result: PartName {
                    partition_id: partition.to_string(),
                    min_block: sources[0].min_block,
                    max_block: sources[sources.len() - 1].max_block,
                    level: sources.iter().map(|n| n.level).max().unwrap_or(0) + 1,
                },
                sources,
            });
        }
        run.clear();
    };
    for (name, rows) in parts {
        let total: u64 = run.iter().map(|(_, r)| r).sum();
        if !run.is_empty() && total.saturating_add(rows) > target_rows {
            close(&mut run, &mut decided);
        }
        run.push((name, rows));
    }
    close(&mut run, &mut decided);
    decided
}

/// What a retirement does to a partition, a function of the applied WAL
/// alone (see `retire`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Retire {
    /// Logical parts whose blocks lie inside a retired file: they leave.
    pub(super) dropped: Vec<PartName>,
    /// Indices of the record's files the partition's retired files become:
    /// each holds a dropped part or an earlier retired file.
    pub(super) adopted: Vec<usize>,
    /// Earlier retired files inside an adopted one (named again, or held
    /// by a later commit in a bigger file): replaced by it.
    pub(super) absorbed: Vec<PartName>,
}

/// The retirement of `files` (this shard's files of the record, as part
/// names) from a partition whose logical parts are `logical` and whose
/// earlier retired files are `prior`. A part leaves only if one file holds
/// all its blocks; a part holding more (a merge of exported and unexported
/// blocks) stays whole until a later commit holds it.
pub(super) fn retire(
    logical: &BTreeSet<PartName>,
    prior: &[PartName],
    files: &[PartName],
) -> Retire {
    let inside = super::retire::inside;
    let dropped: Vec<PartName> = logical
        .iter()
        .filter(|p| files.iter().any(|f| inside(p, f)))
        .cloned()
        .collect();
    let adopted: Vec<usize> = files
        .iter()
        .enumerate()
        .filter(|(_, f)| dropped.iter().any(|d| inside(d, f)) || prior.iter().any(|p| inside(p, f)))
        .map(|(i, _)| i)
        .collect();
    let absorbed = prior
        .iter()
        .filter(|p| adopted.iter().any(|i| inside(p, &files[*i])))
        .cloned()
        .collect();
    Retire {
        dropped,
        adopted,
        absorbed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(min: u64, max: u64, level: u32) -> PartName {
        PartName {
            partition_id: "202406".into(),
            min_block: min,
            max_block: max,
            level,
        }
    }

    #[test]
    fn a_key_applied_by_another_record_is_a_duplicate_and_by_the_same_one_is_not() {
        let mut w = Window::new();
        remember(&mut w, 1, 0, "k".into(), Lsn(100));
        assert_eq!(fate(&w, 1, 0, Some("k"), Lsn(200), false), Fate::Duplicate);
        // The same record read again after a crash: its parts decide.
        assert_eq!(fate(&w, 1, 0, Some("k"), Lsn(100), false), Fate::Write);
        assert_eq!(
            fate(&w, 1, 0, Some("k"), Lsn(100), true),
            Fate::AlreadyApplied
        );
        // Keys are per table and shard.
        assert_eq!(fate(&w, 2, 0, Some("k"), Lsn(200), false), Fate::Write);
        assert_eq!(fate(&w, 1, 1, Some("k"), Lsn(200), false), Fate::Write);
        assert_eq!(fate(&w, 1, 0, None, Lsn(200), false), Fate::Write);
        remember(&mut w, 1, 0, "k".into(), Lsn(100));
        assert_eq!(w.len(), 1, "a record is remembered once");
    }

    #[test]
    fn the_window_keeps_the_newest_keys_up_to_its_bound() {
        let mut w = Window::new();
        for i in 0..(DEDUP_WINDOW as u64 + 10) {
            remember(&mut w, 1, 0, format!("k{i}"), Lsn(i + 1));
        }
        assert_eq!(w.len(), DEDUP_WINDOW);
        assert_eq!(
            fate(&w, 1, 0, Some("k0"), Lsn(u64::MAX), false),
            Fate::Write
        );
        let newest = format!("k{}", DEDUP_WINDOW as u64 + 9);
        assert_eq!(
            fate(&w, 1, 0, Some(&newest), Lsn(u64::MAX), false),
            Fate::Duplicate
        );
    }

    #[test]
    fn what_was_applied_is_made_durable_when_caught_up_on_failure_or_every_16_mib() {
        assert!(!persist_due(false, true, true, u64::MAX), "nothing applied");
        assert!(persist_due(true, true, false, 0));
        assert!(persist_due(true, false, true, 0));
        assert!(!persist_due(true, false, false, PERSIST_EVERY_BYTES - 1));
        assert!(persist_due(true, false, false, PERSIST_EVERY_BYTES));
        assert!(is_ours(3, u32::MAX, 3));
        assert!(!is_ours(3, u32::MAX, 2));
        assert!(is_ours(u32::MAX, u32::MAX, 2));
    }

    #[test]
    fn merges_take_consecutive_parts_only_around_a_part_of_another_level() {
        // A compaction left a level-1 part between level-0 parts.
        let mut parts: BTreeSet<PartName> = [part(1, 1, 0), part(2, 3, 1)].into_iter().collect();
        parts.extend((4..11).map(|b| part(b, b, 0)));
        assert!(
            merges(7, "202406", parts.clone()).is_empty(),
            "eight level-0 parts, never eight in a row"
        );
        parts.insert(part(11, 11, 0));
        let m = merges(7, "202406", parts);
        assert_eq!(m.len(), 1);
        assert_eq!(
            m[0].result,
            part(4, 11, 1),
            "the run after the level-1 part"
        );
    }

    #[test]
    fn a_compaction_merges_runs_of_consecutive_parts_up_to_the_target() {
        let parts = vec![
            (part(1, 8, 1), 80),
            (part(9, 9, 0), 10),
            (part(10, 10, 0), 10),
            (part(11, 18, 1), 200),
            (part(19, 19, 0), 10),
            (part(20, 20, 0), 10),
        ];
        let m = compaction(7, "202406", parts, 100);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].result, part(1, 10, 2));
        assert_eq!(m[0].sources.len(), 3);
        // A part over the target stays alone; the run after it merges.
        assert_eq!(m[1].result, part(19, 20, 1));
        // Compacting the result again decides nothing.
        let again = vec![
            (part(1, 10, 2), 100),
            (part(11, 18, 1), 200),
            (part(19, 20, 1), 20),
        ];
        assert!(compaction(7, "202406", again, 100).is_empty());
    }

    #[test]
    fn a_retirement_drops_only_parts_one_file_holds_whole() {
        let logical: BTreeSet<PartName> = [
            part(1, 8, 1),
            part(9, 9, 0),
            part(10, 17, 1),
            part(18, 18, 0),
        ]
        .into_iter()
        .collect();
        // The lake holds 1..=8 and 9 as one file, 10..=12 (a file older than
        // the merge 10..=17, which mixes exported and unexported blocks).
        let files = [part(1, 9, 2), part(10, 12, 1)];
        let r = retire(&logical, &[], &files);
        assert_eq!(r.dropped, vec![part(1, 8, 1), part(9, 9, 0)]);
        assert_eq!(
            r.adopted,
            vec![0],
            "a file no dropped part lies in is not retired"
        );
        assert!(r.absorbed.is_empty());
        // Nothing of ours in the lake: nothing leaves.
        assert_eq!(retire(&logical, &[], &[part(30, 40, 1)]), Retire::default());
        // A later commit holding an earlier retired file in a bigger one.
        let later: BTreeSet<PartName> = [part(18, 18, 0)].into_iter().collect();
        let r = retire(&later, &[part(1, 9, 2)], &[part(1, 18, 3)]);
        assert_eq!(r.dropped, vec![part(18, 18, 0)]);
        assert_eq!(r.adopted, vec![0]);
        assert_eq!(r.absorbed, vec![part(1, 9, 2)]);
        // The same file named again replaces itself.
        let r = retire(&BTreeSet::new(), &[part(1, 9, 2)], &[part(1, 9, 2)]);
        assert_eq!((r.adopted, r.absorbed), (vec![0], vec![part(1, 9, 2)]));
    }

    #[test]
    fn merges_take_the_oldest_fanin_of_a_level_and_cascade() {
        let fanin = MERGE_FANIN as u64;
        let level0: BTreeSet<PartName> = (1..fanin).map(|b| part(b, b, 0)).collect();
        assert!(merges(7, "202406", level0.clone()).is_empty(), "one short");
        let mut full = level0;
        full.insert(part(fanin, fanin, 0));
        full.insert(part(fanin + 1, fanin + 1, 0));
        let m = merges(7, "202406", full);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].result, part(1, fanin, 1));
        assert_eq!(m[0].sources.len(), MERGE_FANIN);
        assert!(!m[0].sources.contains(&part(fanin + 1, fanin + 1, 0)));
        // The last level-0 part completes the fan-in of level 1 as well.
        let mut cascade: BTreeSet<PartName> = (0..fanin - 1)
            .map(|i| part(i * fanin + 1, (i + 1) * fanin, 1))
            .collect();
        let base = (fanin - 1) * fanin;
        cascade.extend((1..=fanin).map(|b| part(base + b, base + b, 0)));
        let m = merges(7, "202406", cascade);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].result.level, 1);
        assert_eq!(m[1].result, part(1, fanin * fanin, 2));
        // Nothing merges past the last level.
        let top: BTreeSet<PartName> = (0..fanin)
            .map(|i| part(i * 10 + 1, i * 10 + 10, MAX_MERGE_LEVEL))
            .collect();
        assert!(merges(7, "202406", top).is_empty());
    }
}
