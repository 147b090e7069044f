//! Increments: an export of a partition whose current commit holds some of
//! its rows writes only the parts holding rows not in the lake yet, and
//! carries the current commit's other files into the new commit.
//!
//! Exported and unexported blocks are combined by merges on the replicas,
//! so what was exported is tracked by block ranges, never by part names. A
//! part's name holds its first and last block; one shard's parts are made
//! only by merging consecutive parts, so their ranges form a laminar family:
//! two of them (a lake file and a snapshot part of the same shard, from any
//! replica of it, since merges are decided by the WAL) are disjoint or one
//! holds the other. Hence every snapshot part is
//!
//! * inside one lake file (its rows are in the lake: the file is carried), or
//! * holding every lake file it meets (new rows and perhaps exported ones:
//!   the part is exported and the files it holds leave the commit).
//!
//! Anything else (ranges that cross, a file of unknown shard, row counts
//! that do not add up) means the history is not what this reasoning
//! assumes, and the export writes every part instead ([`plan`] answers
//! `None`): slower, never wrong.

use ferry_replica::PartName;

use crate::lake::part_of;
use crate::model::{DataFile, SnapshotPart};

/// What an increment exports and what it keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Increment {
    /// Files of the current commit the new commit lists again, as they are.
    pub carried: Vec<DataFile>,
    /// The snapshot's parts to export.
    pub new_parts: Vec<SnapshotPart>,
}

/// The increment from the partition's current commit (`current`: its data
/// files) to `snapshot` (every active part of the partition), or `None`
/// when only a whole export is safe. The caller has checked that the
/// snapshot covers every block of the current commit (`request::lacks`).
pub fn plan(current: &[DataFile], snapshot: &[SnapshotPart]) -> Option<Increment> {
    let files: Vec<(&DataFile, PartName)> = current
        .iter()
        .map(|f| Some((f, part_of(&f.path)?)))
        .collect::<Option<_>>()?;
    let parts: Vec<(&SnapshotPart, PartName)> = snapshot
        .iter()
        .map(|p| Some((p, PartName::parse(&p.name)?)))
        .collect::<Option<_>>()?;
    let mut carried = vec![false; files.len()];
    let mut dropped = vec![false; files.len()];
    let mut new_parts = Vec::new();
    for (part, pname) in &parts {
        let mut inside = None;
        let mut holds = Vec::new();
        for (i, (file, fname)) in files.iter().enumerate() {
            if file.shard != part.shard || !meet(fname, pname) {
                continue;
            }
            if within(pname, fname) {
                inside = Some(i);
            } else if within(fname, pname) {
                holds.push(i);
            } else {
                return None;
            }
        }
        match inside {
            Some(i) => carried[i] = true,
            None => {
                for i in holds {
                    dropped[i] = true;
                }
                new_parts.push((*part).clone());
            }
        }
    }
    // Every file is carried or replaced, never both; what the snapshot
    // holds is exactly what the new commit lists.
    if (0..files.len()).any(|i| carried[i] == dropped[i]) {
        return None;
    }
    let carried: Vec<DataFile> = files
        .iter()
        .zip(&carried)
        .filter(|(_, c)| **c)
        .map(|((f, _), _)| (*f).clone())
        .collect();
    let listed: u64 =
        carried.iter().map(|f| f.rows).sum::<u64>() + new_parts.iter().map(|p| p.rows).sum::<u64>();
    let rows: u64 = snapshot.iter().map(|p| p.rows).sum();
    (listed == rows).then_some(Increment { carried, new_parts })
}

fn meet(a: &PartName, b: &PartName) -> bool {
    a.min_block <= b.max_block && b.min_block <= a.max_block
}

/// `a`'s blocks lie within `b`'s range.
fn within(a: &PartName, b: &PartName) -> bool {
    b.min_block <= a.min_block && a.max_block <= b.max_block
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(part: &str, rows: u64, shard: Option<u32>) -> DataFile {
        DataFile {
            path: format!("p=a/{part}_0000abcd.parquet"),
            rows,
            bytes: 1,
            checksum: 0xabcd,
            shard,
            crc32c: None,
            iceberg: None,
        }
    }

    fn part(name: &str, rows: u64, shard: Option<u32>) -> SnapshotPart {
        SnapshotPart {
            name: name.into(),
            rows,
            checksum: 1,
            shard,
        }
    }

    fn names(i: &Increment) -> (Vec<&str>, Vec<&str>) {
        (
            i.carried.iter().map(|f| f.path.as_str()).collect(),
            i.new_parts.iter().map(|p| p.name.as_str()).collect(),
        )
    }

    #[test]
    fn new_parts_are_exported_and_exported_ones_carried() {
        let current = [file("a_1_1_0", 10, None), file("a_2_2_0", 10, None)];
        let snapshot = [
            part("a_1_1_0", 10, None),
            part("a_2_2_0", 10, None),
            part("a_3_3_0", 5, None),
        ];
        let inc = plan(&current, &snapshot).expect("an increment");
        assert_eq!(
            names(&inc),
            (
                vec![
                    "p=a/a_1_1_0_0000abcd.parquet",
                    "p=a/a_2_2_0_0000abcd.parquet"
                ],
                vec!["a_3_3_0"]
            )
        );
    }

    #[test]
    fn a_merge_of_exported_and_new_blocks_replaces_the_files_it_holds() {
        let current = [file("a_1_1_0", 10, None), file("a_2_2_0", 10, None)];
        let snapshot = [part("a_2_3_1", 15, None), part("a_1_1_0", 10, None)];
        let inc = plan(&current, &snapshot).expect("an increment");
        assert_eq!(
            names(&inc),
            (vec!["p=a/a_1_1_0_0000abcd.parquet"], vec!["a_2_3_1"])
        );
        // Merged away entirely: nothing carried, the merged part exported.
        let snapshot = [part("a_1_3_1", 25, None)];
        let inc = plan(&current, &snapshot).expect("an increment");
        assert_eq!(names(&inc), (vec![], vec!["a_1_3_1"]));
    }

    #[test]
    fn a_lake_file_merged_from_parts_not_merged_on_this_replica_is_carried() {
        // The lake holds a merged file; the snapshot (a replica not merged
        // yet, or a part inside it) holds its pieces, and one new part.
        let current = [file("a_1_2_1", 20, None)];
        let snapshot = [
            part("a_1_1_0", 10, None),
            part("a_2_2_0", 10, None),
            part("a_4_4_0", 3, None),
        ];
        let inc = plan(&current, &snapshot).expect("an increment");
        assert_eq!(
            names(&inc),
            (vec!["p=a/a_1_2_1_0000abcd.parquet"], vec!["a_4_4_0"])
        );
    }

    #[test]
    fn shards_nest_only_with_themselves() {
        // Shard 1's part lies inside shard 0's file range: it is new, not
        // carried (a planted bug keyed by ranges alone would lose it).
        let current = [file("a_1_9_1", 20, Some(0))];
        let snapshot = [part("a_1_9_1", 20, Some(0)), part("a_4_4_0", 7, Some(1))];
        let inc = plan(&current, &snapshot).expect("an increment");
        assert_eq!(
            names(&inc),
            (vec!["p=a/a_1_9_1_0000abcd.parquet"], vec!["a_4_4_0"])
        );
    }

    #[test]
    fn anything_unexpected_is_a_whole_export() {
        let current = [file("a_1_5_1", 20, None)];
        // Crossing ranges.
        assert_eq!(plan(&current, &[part("a_3_8_1", 20, None)]), None);
        // A file of another family (shard unknown against shard 0).
        assert_eq!(plan(&current, &[part("a_1_5_1", 20, Some(0))]), None);
        // Rows that do not add up.
        assert_eq!(plan(&current, &[part("a_1_5_1", 21, None)]), None);
        // A file name that is not a part's.
        let odd = [DataFile {
            path: "p=a/odd.parquet".into(),
            ..file("a_1_5_1", 20, None)
        }];
        assert_eq!(plan(&odd, &[part("a_1_5_1", 20, None)]), None);
        // Nothing in the lake: everything is new.
        let inc = plan(&[], &[part("a_1_5_1", 20, None)]).expect("an increment");
        assert_eq!(names(&inc), (vec![], vec!["a_1_5_1"]));
    }
}
