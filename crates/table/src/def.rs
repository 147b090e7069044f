//! Table definitions: what an operator writes (TOML or JSON), checked field by
//! field, and the typed [`TableDef`] every other part of ferry uses.
//!
//! A definition is immutable once created: replicas name parts by its partition
//! key and route rows by its shard key, so changing either would split one
//! partition's rows over two schemes. The table id is assigned by the catalog
//! when the table is created and is what WAL records carry.

use std::collections::BTreeSet;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde::{Deserialize, Serialize};

/// The zone of every Timestamp column.
pub const UTC: &str = "+00:00";

/// Most columns in one table.
pub const MAX_COLUMNS: usize = 1024;
/// Most shards of one table.
pub const MAX_SHARDS: u32 = 1024;
/// Most replicas per shard.
pub const MAX_REPLICAS: u32 = 16;

/// Why a definition is refused; `field` names where, as the operator wrote it
/// (`columns[2].type`, `partition_by.column`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct DefError {
    pub field: String,
    pub reason: String,
}

impl DefError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> DefError {
        DefError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// The column types a table can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ColumnType {
    Int32,
    Int64,
    Float64,
    Boolean,
    Utf8,
    /// Days since 1970-01-01 (Arrow `Date32`).
    Date,
    /// Microseconds since 1970-01-01T00:00:00 UTC (Arrow `Timestamp(µs, "+00:00")`:
    /// an offset, which every Arrow and Parquet reader takes as UTC without a
    /// time-zone database).
    Timestamp,
}

impl ColumnType {
    pub const ALL: [ColumnType; 7] = [
        ColumnType::Int32,
        ColumnType::Int64,
        ColumnType::Float64,
        ColumnType::Boolean,
        ColumnType::Utf8,
        ColumnType::Date,
        ColumnType::Timestamp,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ColumnType::Int32 => "Int32",
            ColumnType::Int64 => "Int64",
            ColumnType::Float64 => "Float64",
            ColumnType::Boolean => "Boolean",
            ColumnType::Utf8 => "Utf8",
            ColumnType::Date => "Date",
            ColumnType::Timestamp => "Timestamp",
        }
    }

    fn parse(name: &str) -> Option<ColumnType> {
        ColumnType::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The Arrow type rows of this column have inside ferry.
    pub fn arrow(self) -> DataType {
        match self {
            ColumnType::Int32 => DataType::Int32,
            ColumnType::Int64 => DataType::Int64,
            ColumnType::Float64 => DataType::Float64,
            ColumnType::Boolean => DataType::Boolean,
            ColumnType::Utf8 => DataType::Utf8,
            ColumnType::Date => DataType::Date32,
            ColumnType::Timestamp => DataType::Timestamp(TimeUnit::Microsecond, Some(UTC.into())),
        }
    }
}

/// One column.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnDef {
    pub name: String,
    #[serde(rename = "type")]
    pub column_type: ColumnType,
    pub nullable: bool,
}

/// How a row's partition is derived from one column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionTransform {
    /// The column's value itself (integers, booleans, dates, path-safe strings).
    Identity,
    /// `YYYYMMDD` of a Date or Timestamp.
    Day,
    /// `YYYYMM` of a Date or Timestamp (ClickHouse's `toYYYYMM`).
    Month,
    /// `YYYY` of a Date or Timestamp.
    Year,
}

impl PartitionTransform {
    fn parse(name: &str) -> Option<PartitionTransform> {
        match name {
            "identity" => Some(PartitionTransform::Identity),
            "day" => Some(PartitionTransform::Day),
            "month" => Some(PartitionTransform::Month),
            "year" => Some(PartitionTransform::Year),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionBy {
    pub column: String,
    pub transform: PartitionTransform,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardBy {
    pub column: String,
    pub shards: u32,
}

/// What a lake destination is, for readers (here because a table's
/// definition may name the one its exports use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LakeFormat {
    /// Hive-layout Parquet files with ferry's commit files: readers read
    /// each partition's current commit.
    #[default]
    Parquet,
    /// An Apache Iceberg v2 table: data files under `data/`, and a snapshot
    /// per commit that any Iceberg reader reads.
    Iceberg,
}

impl LakeFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            LakeFormat::Parquet => "parquet",
            LakeFormat::Iceberg => "iceberg",
        }
    }
}

impl std::fmt::Display for LakeFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LakeFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "parquet" => Ok(LakeFormat::Parquet),
            "iceberg" => Ok(LakeFormat::Iceberg),
            other => Err(format!(
                "destination format {other:?}: expected parquet or iceberg"
            )),
        }
    }
}

/// How the table's exports are made when a request does not say
/// (`[export]` in the definition), and where the table exports itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportDefaults {
    /// The destination format of an export that names none.
    pub format: LakeFormat,
    /// The export policy: with it, the table's partitions are exported to
    /// this destination whenever they change, with nobody asking. Flat in
    /// JSON (`to`, `freshness_seconds`), as `[export]` is written.
    #[serde(flatten)]
    pub policy: Option<ExportPolicy>,
}

/// Where a table exports itself, and how stale the lake may be.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportPolicy {
    /// The destination URL (`file://` or `s3://`), opened by the exporting
    /// node under its own export roots.
    pub to: String,
    /// Every acknowledged row is in the lake within this many seconds.
    pub freshness_seconds: u64,
    /// Retention: a partition whose every row the lake holds, and whose
    /// last export is older than this, leaves the replicas (its reads go to
    /// the lake). `None`: replicas keep every partition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_seconds: Option<u64>,
}

/// The shortest retention: a second (what leaves the replicas is in the
/// lake whatever the setting; a short one suits tests and lake-first tables).
pub const MIN_RETENTION_SECONDS: u64 = 1;
/// The longest: ten years.
pub const MAX_RETENTION_SECONDS: u64 = 10 * 366 * 86_400;

/// The freshness target when `[export] to` names none: a minute, as the
/// streaming lakes peers default to.
pub const DEFAULT_FRESHNESS_SECONDS: u64 = 60;
/// The freshness range a policy accepts: a second to a day.
pub const MIN_FRESHNESS_SECONDS: u64 = 1;
pub const MAX_FRESHNESS_SECONDS: u64 = 86_400;
/// A destination URL is at most this long (it becomes part of coordination
/// paths and commit files).
pub const MAX_DESTINATION_URL_BYTES: usize = 1024;

impl ExportDefaults {
    /// Checks an `[export]` section (TOML or JSON, also the body of
    /// `PATCH /tables/<t>`); field names in errors are `export.<field>`.
    pub fn from_raw(raw: RawExport) -> Result<ExportDefaults, DefError> {
        let format = match raw.format {
            Some(f) => f
                .parse::<LakeFormat>()
                .map_err(|reason| DefError::new("export.format", reason))?,
            None if raw.to.is_none() => {
                return Err(DefError::new(
                    "export",
                    "give a format, or a destination (to) to export to",
                ))
            }
            None => LakeFormat::default(),
        };
        let freshness = raw
            .freshness
            .map(|d| d.seconds("export.freshness"))
            .transpose()?;
        let retention = raw
            .retention
            .map(|d| d.seconds("export.retention"))
            .transpose()?;
        if let Some(r) = retention {
            if !(MIN_RETENTION_SECONDS..=MAX_RETENTION_SECONDS).contains(&r) {
                return Err(DefError::new(
                    "export.retention",
                    format!(
                        "{r}s is out of range {MIN_RETENTION_SECONDS}s..={MAX_RETENTION_SECONDS}s"
                    ),
                ));
            }
            if raw.to.is_none() {
                return Err(DefError::new(
                    "export.retention",
                    "retention needs a destination (to): only rows in the lake leave the replicas",
                ));
            }
        }
        let policy = match (raw.to, freshness) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(DefError::new(
                    "export.freshness",
                    "a freshness target needs a destination (to) to export to",
                ))
            }
            (Some(to), freshness) => {
                check_destination_url(&to)?;
                let freshness_seconds = freshness.unwrap_or(DEFAULT_FRESHNESS_SECONDS);
                if !(MIN_FRESHNESS_SECONDS..=MAX_FRESHNESS_SECONDS).contains(&freshness_seconds) {
                    return Err(DefError::new(
                        "export.freshness",
                        format!(
                            "{freshness_seconds}s is out of range \
                             {MIN_FRESHNESS_SECONDS}s..={MAX_FRESHNESS_SECONDS}s"
                        ),
                    ));
                }
                Some(ExportPolicy {
                    to,
                    freshness_seconds,
                    retention_seconds: retention,
                })
            }
        };
        Ok(ExportDefaults { format, policy })
    }

    /// Parses and checks an `[export]` section given as JSON.
    pub fn from_json(text: &[u8]) -> Result<ExportDefaults, DefError> {
        let raw: RawExport =
            serde_json::from_slice(text).map_err(|e| DefError::new("export", e.to_string()))?;
        ExportDefaults::from_raw(raw)
    }

    /// The section as TOML lines (without its `[export]` header).
    fn to_toml_lines(&self) -> String {
        let mut out = format!("format = {:?}\n", self.format.as_str());
        if let Some(p) = &self.policy {
            out += &format!(
                "to = {:?}\nfreshness = \"{}s\"\n",
                p.to, p.freshness_seconds
            );
            if let Some(r) = p.retention_seconds {
                out += &format!("retention = \"{r}s\"\n");
            }
        }
        out
    }
}

/// `10s`, `5m`, `1h 30m`, `2days` (humantime's forms), or a number of
/// seconds: whole seconds.
fn parse_duration_seconds(text: &str) -> Result<u64, String> {
    if let Ok(s) = text.trim().parse::<u64>() {
        return Ok(s);
    }
    let d = humantime::parse_duration(text.trim())
        .map_err(|e| format!("{text:?} is not a duration like 10s, 5m or 1h: {e}"))?;
    if d.subsec_nanos() != 0 {
        return Err(format!("{text:?} is not a whole number of seconds"));
    }
    Ok(d.as_secs())
}

/// A destination URL as a table may name it: `file://` or `s3://`, short
/// and printable. Whether this node may open it is the exporting node's
/// check (its export roots).
fn check_destination_url(url: &str) -> Result<(), DefError> {
    let field = "export.to";
    if url.len() > MAX_DESTINATION_URL_BYTES {
        return Err(DefError::new(
            field,
            format!("longer than {MAX_DESTINATION_URL_BYTES} bytes"),
        ));
    }
    if url.chars().any(|c| c.is_control()) {
        return Err(DefError::new(field, "holds a control character"));
    }
    let rest = url
        .strip_prefix("file://")
        .or_else(|| url.strip_prefix("s3://"))
        .ok_or_else(|| DefError::new(field, format!("{url:?} is not a file:// or s3:// URL")))?;
    if rest.trim_matches('/').is_empty() {
        return Err(DefError::new(
            field,
            format!("{url:?} names no folder or bucket"),
        ));
    }
    Ok(())
}

/// A checked table definition (the id is not part of it: see [`Table`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableDef {
    pub name: String,
    pub columns: Vec<ColumnDef>,
    pub partition_by: PartitionBy,
    pub shard_by: ShardBy,
    pub replicas: u32,
    /// Absent in definitions without `[export]` (and in catalogs written
    /// before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<ExportDefaults>,
}

/// A created table: its definition and the id the catalog gave it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Table {
    pub id: u64,
    #[serde(flatten)]
    pub def: TableDef,
}

/// The definition as written, before checking: every field optional and typed
/// loosely, so that an error can name the field instead of failing to parse.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDef {
    name: Option<String>,
    columns: Option<Vec<RawColumn>>,
    partition_by: Option<RawPartition>,
    shard_by: Option<RawShard>,
    replicas: Option<i64>,
    export: Option<RawExport>,
}

/// An `[export]` section as written, before checking.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawExport {
    format: Option<String>,
    to: Option<String>,
    #[serde(alias = "freshness_seconds")]
    freshness: Option<RawDuration>,
    #[serde(alias = "retention_seconds")]
    retention: Option<RawDuration>,
}

/// A duration as written: `"10s"` or a number of seconds.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawDuration {
    Seconds(i64),
    Text(String),
}

impl RawDuration {
    /// Whole seconds, or an error naming `field`.
    fn seconds(self, field: &str) -> Result<u64, DefError> {
        match self {
            RawDuration::Seconds(s) => {
                u64::try_from(s).map_err(|_| DefError::new(field, format!("{s} is negative")))
            }
            RawDuration::Text(t) => {
                parse_duration_seconds(&t).map_err(|reason| DefError::new(field, reason))
            }
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawColumn {
    name: Option<String>,
    #[serde(rename = "type")]
    column_type: Option<String>,
    nullable: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPartition {
    column: Option<String>,
    transform: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShard {
    column: Option<String>,
    shards: Option<i64>,
}

/// Whether `name` is a valid table or column name: `[A-Za-z_][A-Za-z0-9_]{0,63}`.
/// Names end up in coordination paths, file names and SQL of lake readers.
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

fn check_name(field: &str, name: &str) -> Result<(), DefError> {
    if valid_name(name) {
        Ok(())
    } else {
        Err(DefError::new(
            field,
            format!("{name:?} is not a valid name ([A-Za-z_][A-Za-z0-9_]{{0,63}})"),
        ))
    }
}

fn required<T>(field: &str, v: Option<T>) -> Result<T, DefError> {
    v.ok_or_else(|| DefError::new(field, "missing"))
}

impl TableDef {
    /// Parses and checks a TOML definition.
    pub fn from_toml(text: &str) -> Result<TableDef, DefError> {
        let raw: RawDef = toml::from_str(text).map_err(|e| {
            DefError::new(
                "definition",
                e.message().to_string() + &span_note(text, e.span()),
            )
        })?;
        TableDef::check(raw)
    }

    /// Parses and checks a JSON definition (the HTTP API's form).
    pub fn from_json(text: &[u8]) -> Result<TableDef, DefError> {
        let raw: RawDef =
            serde_json::from_slice(text).map_err(|e| DefError::new("definition", e.to_string()))?;
        TableDef::check(raw)
    }

    fn check(raw: RawDef) -> Result<TableDef, DefError> {
        let name = required("name", raw.name)?;
        check_name("name", &name)?;
        let raw_columns = required("columns", raw.columns)?;
        if raw_columns.is_empty() {
            return Err(DefError::new(
                "columns",
                "a table needs at least one column",
            ));
        }
        if raw_columns.len() > MAX_COLUMNS {
            return Err(DefError::new(
                "columns",
                format!("{} columns, at most {MAX_COLUMNS}", raw_columns.len()),
            ));
        }
        let mut columns = Vec::with_capacity(raw_columns.len());
        let mut seen = BTreeSet::new();
        for (i, c) in raw_columns.into_iter().enumerate() {
            let name = required(&format!("columns[{i}].name"), c.name)?;
            check_name(&format!("columns[{i}].name"), &name)?;
            if !seen.insert(name.clone()) {
                return Err(DefError::new(
                    format!("columns[{i}].name"),
                    format!("duplicate column {name:?}"),
                ));
            }
            let type_name = required(&format!("columns[{i}].type"), c.column_type)?;
            let column_type = ColumnType::parse(&type_name).ok_or_else(|| {
                DefError::new(
                    format!("columns[{i}].type"),
                    format!(
                        "unknown type {type_name:?} (one of {})",
                        ColumnType::ALL.map(|t| t.name()).join(", ")
                    ),
                )
            })?;
            columns.push(ColumnDef {
                name,
                column_type,
                nullable: c.nullable.unwrap_or(false),
            });
        }

        let raw_partition = required("partition_by", raw.partition_by)?;
        let pcol = required("partition_by.column", raw_partition.column)?;
        let ptrans = required("partition_by.transform", raw_partition.transform)?;
        let transform = PartitionTransform::parse(&ptrans).ok_or_else(|| {
            DefError::new(
                "partition_by.transform",
                format!("unknown transform {ptrans:?} (one of identity, day, month, year)"),
            )
        })?;
        let pdef = columns.iter().find(|c| c.name == pcol).ok_or_else(|| {
            DefError::new("partition_by.column", format!("no column named {pcol:?}"))
        })?;
        if pdef.nullable {
            return Err(DefError::new(
                "partition_by.column",
                format!("column {pcol:?} is nullable; a partition column must not be"),
            ));
        }
        let allowed = match transform {
            PartitionTransform::Identity => matches!(
                pdef.column_type,
                ColumnType::Int32
                    | ColumnType::Int64
                    | ColumnType::Boolean
                    | ColumnType::Utf8
                    | ColumnType::Date
            ),
            _ => matches!(pdef.column_type, ColumnType::Date | ColumnType::Timestamp),
        };
        if !allowed {
            return Err(DefError::new(
                "partition_by.column",
                format!(
                    "column {pcol:?} of type {} cannot be partitioned by {ptrans} \
                     (identity: Int32, Int64, Boolean, Utf8, Date; day, month, year: Date, Timestamp)",
                    pdef.column_type.name()
                ),
            ));
        }

        let raw_shard = required("shard_by", raw.shard_by)?;
        let scol = required("shard_by.column", raw_shard.column)?;
        let sdef = columns
            .iter()
            .find(|c| c.name == scol)
            .ok_or_else(|| DefError::new("shard_by.column", format!("no column named {scol:?}")))?;
        if sdef.nullable {
            return Err(DefError::new(
                "shard_by.column",
                format!("column {scol:?} is nullable; a shard column must not be"),
            ));
        }
        let shards = required("shard_by.shards", raw_shard.shards)?;
        if !(1..=i64::from(MAX_SHARDS)).contains(&shards) {
            return Err(DefError::new(
                "shard_by.shards",
                format!("{shards} is out of range 1..={MAX_SHARDS}"),
            ));
        }
        let replicas = raw.replicas.unwrap_or(1);
        if !(1..=i64::from(MAX_REPLICAS)).contains(&replicas) {
            return Err(DefError::new(
                "replicas",
                format!("{replicas} is out of range 1..={MAX_REPLICAS}"),
            ));
        }
        let export = raw.export.map(ExportDefaults::from_raw).transpose()?;
        Ok(TableDef {
            name,
            columns,
            partition_by: PartitionBy {
                column: pcol,
                transform,
            },
            shard_by: ShardBy {
                column: scol,
                shards: shards as u32,
            },
            replicas: replicas as u32,
            export,
        })
    }

    /// The Arrow schema of rows in WAL records and parts, in column order.
    pub fn arrow_schema(&self) -> SchemaRef {
        Arc::new(Schema::new(
            self.columns
                .iter()
                .map(|c| Field::new(&c.name, c.column_type.arrow(), c.nullable))
                .collect::<Vec<_>>(),
        ))
    }

    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }

    /// The definition as TOML, in the form [`TableDef::from_toml`] reads.
    pub fn to_toml(&self) -> String {
        let mut out = format!("name = {:?}\nreplicas = {}\n", self.name, self.replicas);
        let transform = match self.partition_by.transform {
            PartitionTransform::Identity => "identity",
            PartitionTransform::Day => "day",
            PartitionTransform::Month => "month",
            PartitionTransform::Year => "year",
        };
        out += &format!(
            "partition_by = {{ column = {:?}, transform = {:?} }}\n",
            self.partition_by.column, transform
        );
        out += &format!(
            "shard_by = {{ column = {:?}, shards = {} }}\n",
            self.shard_by.column, self.shard_by.shards
        );
        for c in &self.columns {
            out += &format!(
                "\n[[columns]]\nname = {:?}\ntype = {:?}\nnullable = {}\n",
                c.name,
                c.column_type.name(),
                c.nullable
            );
        }
        if let Some(e) = &self.export {
            out += &format!("\n[export]\n{}", e.to_toml_lines());
        }
        out
    }
}

fn span_note(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    match span {
        Some(r) => {
            let line = text[..r.start.min(text.len())].matches('\n').count() + 1;
            format!(" (line {line})")
        }
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "events"
replicas = 2
partition_by = { column = "ts", transform = "month" }
shard_by = { column = "user", shards = 4 }

[[columns]]
name = "ts"
type = "Timestamp"

[[columns]]
name = "user"
type = "Int64"

[[columns]]
name = "note"
type = "Utf8"
nullable = true
"#;

    #[test]
    fn a_good_definition_round_trips_through_toml_and_json() {
        let def = TableDef::from_toml(GOOD).expect("valid");
        assert_eq!(def.columns.len(), 3);
        assert_eq!(def.shard_by.shards, 4);
        assert_eq!(def.partition_by.transform, PartitionTransform::Month);
        assert!(!def.columns[0].nullable, "nullable defaults to false");
        assert_eq!(TableDef::from_toml(&def.to_toml()).expect("again"), def);
        let json = serde_json::to_vec(&def).expect("json");
        assert_eq!(TableDef::from_json(&json).expect("json back"), def);
    }

    fn err(text: &str) -> DefError {
        TableDef::from_toml(text).expect_err("must be refused")
    }

    #[test]
    fn every_invalid_definition_names_its_field() {
        let cases: &[(&str, &str, &str)] = &[
            ("\"Timestamp\"", "\"Int8\"", "columns[0].type"),
            ("name = \"events\"", "name = \"9events\"", "name"),
            ("name = \"events\"", "name = \"ev/../x\"", "name"),
            ("name = \"note\"", "name = \"user\"", "columns[2].name"),
            (
                "column = \"ts\", transform",
                "column = \"nope\", transform",
                "partition_by.column",
            ),
            (
                "transform = \"month\"",
                "transform = \"week\"",
                "partition_by.transform",
            ),
            ("shards = 4", "shards = 0", "shard_by.shards"),
            ("replicas = 2", "replicas = 99", "replicas"),
            (
                "column = \"user\", shards",
                "column = \"note\", shards",
                "shard_by.column",
            ),
        ];
        for (from, to, field) in cases {
            let text = GOOD.replacen(from, to, 1);
            assert_ne!(text, GOOD, "case {from} applies");
            let e = err(&text);
            assert_eq!(&e.field, field, "{from} -> {to}: {e}");
        }
        // A partition column of a type that cannot partition.
        let e = err(&GOOD.replacen("transform = \"month\"", "transform = \"identity\"", 1));
        assert_eq!(e.field, "partition_by.column");
        assert!(e.reason.contains("cannot be partitioned"), "{e}");
        let e = err(&GOOD
            .replacen("type = \"Int64\"", "type = \"Float64\"", 1)
            .replacen(
                "column = \"ts\", transform = \"month\"",
                "column = \"user\", transform = \"identity\"",
                1,
            ));
        assert_eq!(e.field, "partition_by.column");
        // Unknown keys are refused, not ignored.
        let e = err(&format!("{GOOD}\n[extra]\nx = 1\n"));
        assert!(e.reason.contains("unknown field"), "{e}");
        let e = err(&GOOD.replacen("nullable = true", "nullable = true\ndefault = 3", 1));
        assert!(e.reason.contains("unknown field"), "{e}");
        // A missing field.
        let e = err(&GOOD.replacen("shard_by = { column = \"user\", shards = 4 }", "", 1));
        assert_eq!(e.field, "shard_by");
    }

    #[test]
    fn names() {
        for ok in ["a", "_", "A_9", &"x".repeat(64)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "9a", "a-b", "a b", "é", &"x".repeat(65), "a/b", ".."] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn an_export_policy_is_checked_and_round_trips() {
        let def = TableDef::from_toml(&format!(
            "{GOOD}\n[export]\nto = \"s3://lake/events\"\nfreshness = \"10s\"\n"
        ))
        .expect("valid");
        let export = def.export.clone().expect("export");
        assert_eq!(export.format, LakeFormat::Parquet, "the format defaults");
        assert_eq!(
            export.policy,
            Some(ExportPolicy {
                to: "s3://lake/events".into(),
                freshness_seconds: 10,
                retention_seconds: None,
            })
        );
        assert_eq!(TableDef::from_toml(&def.to_toml()).expect("again"), def);
        let json = serde_json::to_vec(&def).expect("json");
        assert_eq!(TableDef::from_json(&json).expect("json back"), def);
        // A destination alone takes the default freshness; seconds as a number.
        let e = ExportDefaults::from_json(br#"{"to": "file:///lake", "format": "iceberg"}"#)
            .expect("valid");
        assert_eq!(e.format, LakeFormat::Iceberg);
        assert_eq!(
            e.policy.map(|p| p.freshness_seconds),
            Some(DEFAULT_FRESHNESS_SECONDS)
        );
        let e = ExportDefaults::from_json(br#"{"to": "file:///lake", "freshness": 90}"#)
            .expect("valid");
        assert_eq!(e.policy.map(|p| p.freshness_seconds), Some(90));
        let e = ExportDefaults::from_json(br#"{"to": "file:///lake", "freshness": "1h 30m"}"#)
            .expect("valid");
        assert_eq!(e.policy.map(|p| p.freshness_seconds), Some(5400));
        let e = ExportDefaults::from_json(br#"{"to": "file:///lake", "retention": "7d"}"#)
            .expect("valid");
        assert_eq!(e.policy.and_then(|p| p.retention_seconds), Some(7 * 86_400));
        let def = TableDef::from_toml(&format!(
            "{GOOD}\n[export]\nto = \"s3://lake/events\"\nretention = \"2h\"\n"
        ))
        .expect("valid");
        assert_eq!(TableDef::from_toml(&def.to_toml()).expect("again"), def);
        // Definitions of the earlier form still read.
        let e = ExportDefaults::from_json(br#"{"format": "parquet"}"#).expect("valid");
        assert_eq!(e.policy, None);
    }

    #[test]
    fn every_invalid_export_policy_names_its_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{}"#, "export"),
            (r#"{"format": "orc"}"#, "export.format"),
            (
                r#"{"freshness": "10s", "format": "parquet"}"#,
                "export.freshness",
            ),
            (r#"{"to": "http://x/y"}"#, "export.to"),
            (
                r#"{"format": "parquet", "retention": "7d"}"#,
                "export.retention",
            ),
            (
                r#"{"to": "file:///lake", "retention": "0s"}"#,
                "export.retention",
            ),
            (
                r#"{"to": "file:///lake", "retention": -1}"#,
                "export.retention",
            ),
            (
                r#"{"to": "file:///lake", "retention": "soon"}"#,
                "export.retention",
            ),
            (r#"{"to": "/tmp/lake"}"#, "export.to"),
            (r#"{"to": "s3://"}"#, "export.to"),
            (r#"{"to": "file:///a\u0007b"}"#, "export.to"),
            (
                r#"{"to": "file:///lake", "freshness": "0s"}"#,
                "export.freshness",
            ),
            (
                r#"{"to": "file:///lake", "freshness": "2days"}"#,
                "export.freshness",
            ),
            (
                r#"{"to": "file:///lake", "freshness": -5}"#,
                "export.freshness",
            ),
            (
                r#"{"to": "file:///lake", "freshness": "1500ms"}"#,
                "export.freshness",
            ),
            (
                r#"{"to": "file:///lake", "freshness": "soon"}"#,
                "export.freshness",
            ),
            (r#"{"to": "file:///lake", "retain": "7d"}"#, "export"),
        ];
        for (json, field) in cases {
            let e = ExportDefaults::from_json(json.as_bytes()).expect_err(json);
            assert_eq!(&e.field, field, "{json}: {e}");
        }
        let long = format!(
            r#"{{"to": "s3://b/{}"}}"#,
            "x".repeat(MAX_DESTINATION_URL_BYTES)
        );
        assert_eq!(
            ExportDefaults::from_json(long.as_bytes())
                .expect_err("long")
                .field,
            "export.to"
        );
    }
}
