//! An Iceberg table checked as a reader reads it: every live data file of
//! the current snapshot must be there with the size its manifest records,
//! its Parquet footer must hold the rows recorded, and no file may be live
//! twice. Data files under `data/` live in no snapshot the metadata keeps
//! are orphans, which readers never see (an upload whose commit never
//! happened, or files only expired snapshots held).

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::manifest::EntryStatus;
use crate::{IcebergError, IcebergTable};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct IcebergReport {
    /// The metadata version and snapshot checked.
    pub version: u64,
    pub snapshot_id: i64,
    /// Live files checked, and the rows a reader reads.
    pub files_checked: usize,
    pub rows: u64,
    /// Every mismatch found; empty means the table is consistent.
    pub problems: Vec<String>,
    /// Data files no snapshot references.
    pub orphans: Vec<String>,
}

impl IcebergReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks the table's current snapshot (`None`: no table there).
pub async fn verify(table: &IcebergTable) -> Result<Option<IcebergReport>, IcebergError> {
    let Some((version, meta)) = table.current().await? else {
        return Ok(None);
    };
    let loc = table.location();
    let listing: BTreeMap<String, u64> = loc.list("data").await?.into_iter().collect();
    let mut report = IcebergReport {
        version,
        snapshot_id: meta.current_snapshot_id,
        ..IcebergReport::default()
    };
    let referenced = live_in_any_snapshot(table, &meta).await?;
    let mut live = BTreeSet::new();
    if let Some(current) = meta.current_snapshot() {
        for m in table.manifests(current).await? {
            for e in table.entries(&m).await? {
                if e.status == EntryStatus::Deleted {
                    continue;
                }
                let key = table.key_of(&e.file.path).to_string();
                if !live.insert(key.clone()) {
                    report.problems.push(format!("{key}: live twice"));
                    continue;
                }
                let Some(&size) = listing.get(&key) else {
                    report.problems.push(format!("{key}: missing"));
                    continue;
                };
                if i64::try_from(size) != Ok(e.file.file_size_in_bytes) {
                    report.problems.push(format!(
                        "{key}: {size} bytes, the manifest {}",
                        e.file.file_size_in_bytes
                    ));
                    continue;
                }
                match footer_rows(table, &key, size).await? {
                    Ok(rows) if rows == e.file.record_count => {
                        report.files_checked += 1;
                        report.rows += u64::try_from(rows).unwrap_or(0);
                    }
                    Ok(rows) => report.problems.push(format!(
                        "{key}: footer says {rows} rows, the manifest {}",
                        e.file.record_count
                    )),
                    Err(why) => report.problems.push(format!("{key}: {why}")),
                }
            }
        }
    }
    report.orphans = listing
        .keys()
        .filter(|k| k.ends_with(".parquet") && !referenced.contains(*k))
        .cloned()
        .collect();
    Ok(Some(report))
}

/// The keys of the data files live in some snapshot `meta` keeps: what is
/// not among them is an orphan.
pub(crate) async fn live_in_any_snapshot(
    table: &IcebergTable,
    meta: &crate::spec::TableMetadata,
) -> Result<BTreeSet<String>, IcebergError> {
    let mut referenced = BTreeSet::new();
    for snapshot in &meta.snapshots {
        for m in table.manifests(snapshot).await? {
            for e in table.entries(&m).await? {
                if e.status != EntryStatus::Deleted {
                    referenced.insert(table.key_of(&e.file.path).to_string());
                }
            }
        }
    }
    Ok(referenced)
}

/// The rows a Parquet file's footer records (`Err`: why it has none).
async fn footer_rows(
    table: &IcebergTable,
    key: &str,
    size: u64,
) -> Result<Result<i64, String>, IcebergError> {
    Ok(crate::data_file::read_footer(table.location(), key, size)
        .await?
        .map(|m| m.file_metadata().num_rows()))
}
