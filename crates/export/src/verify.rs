//! `ferry verify`: a destination checked as a reader reads it. Of every
//! partition, the current commit ([`crate::lake`]) is checked whole: every
//! file it lists must be there with its size, its footer must hold the rows
//! and rows checksum listed, every byte must match the whole-file crc32c
//! recorded (unless [`Depth::Quick`]; with [`Depth::Rows`] the rows
//! themselves are read and checksummed too), and no two of its files may
//! hold the same blocks. Commits
//! a later one superseded are named; data files no commit file lists are
//! orphans, which readers must not read (an upload whose export never
//! committed).

use std::collections::{BTreeMap, BTreeSet};

use ferry_storage::{Location, StorageError};
use serde::Serialize;

use crate::lake::{self, part_of};
use crate::model::{schema_difference, DataFile, DestinationSchema, SCHEMA_KEY};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// The current commit file of every partition, with the number of
    /// files it lists.
    pub commits: Vec<(String, usize)>,
    /// Commit files a later commit of their partition superseded.
    pub superseded: Vec<String>,
    /// Data files checked (listed by a current commit and found).
    pub files_checked: usize,
    /// Rows in the current files: what a reader reads.
    pub rows: u64,
    /// Every mismatch found; empty means the destination is consistent.
    pub problems: Vec<String>,
    /// Data files no commit file lists.
    pub orphans: Vec<String>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// How much of each current file `verify` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// Sizes and footers (rows and rows checksum) only.
    Quick,
    /// Also every byte, against the whole-file crc32c the commit recorded.
    Bytes,
    /// Also the rows, decoded and checksummed.
    Rows,
}

pub async fn verify(location: &Location, depth: Depth) -> Result<VerifyReport, StorageError> {
    let listing: BTreeMap<String, u64> = location.list("").await?.into_iter().collect();
    let mut report = VerifyReport::default();
    let marker = match listing.contains_key(SCHEMA_KEY) {
        true => match serde_json::from_slice::<DestinationSchema>(&location.get(SCHEMA_KEY).await?)
        {
            Ok(m) => Some(m),
            Err(e) => {
                report
                    .problems
                    .push(format!("{SCHEMA_KEY}: not a schema marker: {e}"));
                None
            }
        },
        false => None,
    };
    let view = lake::read(location, None).await?;
    for (key, e) in &view.unreadable {
        report
            .problems
            .push(format!("{key}: not a commit file: {e}"));
    }
    // Every file some commit lists, current or not: the rest are orphans.
    let mut listed: BTreeSet<&str> = BTreeSet::new();
    // Files the current commits list: a file in two of them is listed twice
    // to readers (a superseded commit and the current one of a partition
    // may share files: parts exported again unchanged keep their name).
    let mut current: BTreeSet<&str> = BTreeSet::new();
    for p in &view.partitions {
        for c in &p.superseded {
            report.superseded.push(c.key.clone());
            listed.extend(c.file.files.iter().map(|f| f.path.as_str()));
        }
        let (key, commit) = (&p.current.key, &p.current.file);
        report.commits.push((key.clone(), commit.files.len()));
        let rows: u64 = commit.files.iter().map(|f| f.rows).sum();
        if rows != commit.rows {
            report.problems.push(format!(
                "{key}: lists {rows} rows in its files but says {}",
                commit.rows
            ));
        }
        if let (Some(m), false) = (&marker, commit.columns.is_empty()) {
            if let Some(d) = schema_difference(&commit.columns, &m.columns) {
                report.problems.push(format!(
                    "{key}: its files' schema differs from {SCHEMA_KEY}: {d}"
                ));
            }
        }
        for o in lake::overlaps(&commit.files) {
            report
                .problems
                .push(format!("{key}: current files overlap: {o}"));
        }
        for f in &commit.files {
            listed.insert(f.path.as_str());
            if !current.insert(f.path.as_str()) {
                report.problems.push(format!(
                    "{}: listed by the current commits of two partitions",
                    f.path
                ));
                continue;
            }
            match listing.get(&f.path) {
                None => report
                    .problems
                    .push(format!("{}: listed by {key} but missing", f.path)),
                Some(&size) if size != f.bytes => report
                    .problems
                    .push(format!("{}: {size} bytes, {key} says {}", f.path, f.bytes)),
                Some(&size) => {
                    if let Err(p) = check_file(location, f, size, depth).await? {
                        report.problems.push(format!("{}: {p}", f.path));
                    } else {
                        report.files_checked += 1;
                        report.rows += f.rows;
                    }
                }
            }
        }
    }
    report.orphans = listing
        .keys()
        .filter(|k| k.ends_with(".parquet") && !listed.contains(k.as_str()))
        .cloned()
        .collect();
    Ok(report)
}

async fn check_file(
    location: &Location,
    f: &DataFile,
    size: u64,
    depth: Depth,
) -> Result<Result<(), String>, StorageError> {
    let Some(name) = part_of(&f.path) else {
        return Ok(Err("not a ferry data file name".into()));
    };
    let metadata = match ferry_iceberg::read_footer(location, &f.path, size).await? {
        Ok(m) => m,
        Err(why) => return Ok(Err(why)),
    };
    let meta = match ferry_replica::part::meta_from_footer(&name, size, &metadata) {
        Ok(m) => m,
        Err(e) => return Ok(Err(e.to_string())),
    };
    if meta.rows != f.rows || meta.checksum != f.checksum {
        return Ok(Err(format!(
            "footer says {} rows, checksum {:08x}; the commit file {} rows, {:08x}",
            meta.rows, meta.checksum, f.rows, f.checksum
        )));
    }
    if let (Some(want), Depth::Bytes) = (f.crc32c, depth) {
        let got = crate::dest::file_crc32c(location, &f.path, size).await?;
        if got != want {
            return Ok(Err(format!(
                "whole-file crc32c {got:08x}, the commit file {want:08x}: changed after it was written"
            )));
        }
    }
    if depth == Depth::Rows {
        let data = location.get(&f.path).await?;
        if let Some(want) = f.crc32c {
            let got = crc32c::crc32c(&data);
            if got != want {
                return Ok(Err(format!(
                    "whole-file crc32c {got:08x}, the commit file {want:08x}: changed after it was written"
                )));
            }
        }
        let rows = match ferry_replica::part::read_rows(&name, data) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e.to_string())),
        };
        let Some(first) = rows.first() else {
            return Ok(Err("no rows".into()));
        };
        let schema = first.schema();
        match ferry_replica::part::rows_checksum(&schema, &rows) {
            Ok(sum) if sum == f.checksum => {}
            Ok(sum) => {
                return Ok(Err(format!(
                    "rows checksum {sum:08x}, expected {:08x}",
                    f.checksum
                )))
            }
            Err(e) => return Ok(Err(e.to_string())),
        }
    }
    Ok(Ok(()))
}

/// The live data files of an Iceberg table's current snapshot that ferry
/// wrote, checked as it wrote them (what `ferry_iceberg::verify` cannot
/// know): each file's
/// footer holds the rows its manifest records and the rows checksum its
/// name carries (with [`Depth::Rows`], the rows themselves are decoded and
/// checksummed), and no two files of one partition hold the same blocks.
/// Returns the mismatches.
pub async fn check_iceberg_files(
    table: &ferry_iceberg::IcebergTable,
    depth: Depth,
) -> Result<Vec<String>, ferry_iceberg::IcebergError> {
    let mut problems = Vec::new();
    // Per partition (as the manifests record it), its files.
    let mut by_partition: BTreeMap<Vec<u8>, Vec<DataFile>> = BTreeMap::new();
    for entry in table.files().await? {
        let key = table.key_of(&entry.path).to_string();
        let checksum = key
            .rsplit('/')
            .next()
            .and_then(|f| f.strip_suffix(".parquet"))
            .and_then(|f| f.rsplit_once('_'))
            .and_then(|(_, sum)| u32::from_str_radix(sum, 16).ok());
        // A file another writer added (not named as ferry names them) has
        // its size and footer rows checked by `ferry_iceberg::verify` only.
        let (Some(checksum), Some(_)) = (checksum, part_of(&key)) else {
            continue;
        };
        let file = DataFile {
            path: key.clone(),
            rows: u64::try_from(entry.record_count).unwrap_or(0),
            bytes: u64::try_from(entry.file_size_in_bytes).unwrap_or(0),
            checksum,
            shard: None,
            crc32c: None,
            iceberg: None,
        };
        // Sizes were checked against the listing by `ferry_iceberg::verify`.
        if let Err(why) = check_file(table.location(), &file, file.bytes, depth).await? {
            problems.push(format!("{key}: {why}"));
        }
        by_partition
            .entry(entry.partition.to_bytes())
            .or_default()
            .push(file);
    }
    for files in by_partition.values() {
        problems.extend(lake::overlaps(files));
    }
    Ok(problems)
}
