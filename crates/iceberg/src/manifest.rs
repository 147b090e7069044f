//! Manifests and manifest lists: the Avro files of the Iceberg v2 spec, with
//! its field ids, written and read back (ferry reads only the ones it wrote:
//! a partition's manifest when the partition is exported again).

use apache_avro::types::Value;
use apache_avro::{Reader, Schema as AvroSchema, Writer};
use serde_json::json;

use crate::table::PartitionValue;
use crate::IcebergError;

/// One data file as a manifest entry records it.
#[derive(Debug, Clone, PartialEq)]
pub struct DataFileEntry {
    /// The file's full URL (readers open it as it is).
    pub path: String,
    pub record_count: i64,
    pub file_size_in_bytes: i64,
    pub partition: PartitionValue,
    /// Per column field id: bytes on disk, values, nulls, and the lower
    /// and upper bounds in Iceberg's single-value serialisation.
    pub column_sizes: Vec<(i32, i64)>,
    pub value_counts: Vec<(i32, i64)>,
    pub null_value_counts: Vec<(i32, i64)>,
    pub lower_bounds: Vec<(i32, Vec<u8>)>,
    pub upper_bounds: Vec<(i32, Vec<u8>)>,
}

/// What a manifest records of a data file apart from its path and
/// partition: an exporter keeps it with the file's record in coordination,
/// so that a commit is made from records alone, never from the source rows.
#[derive(
    Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct FileStats {
    pub record_count: i64,
    pub file_size_in_bytes: i64,
    pub column_sizes: Vec<(i32, i64)>,
    pub value_counts: Vec<(i32, i64)>,
    pub null_value_counts: Vec<(i32, i64)>,
    pub lower_bounds: Vec<(i32, Vec<u8>)>,
    pub upper_bounds: Vec<(i32, Vec<u8>)>,
}

impl DataFileEntry {
    pub fn stats(&self) -> FileStats {
        FileStats {
            record_count: self.record_count,
            file_size_in_bytes: self.file_size_in_bytes,
            column_sizes: self.column_sizes.clone(),
            value_counts: self.value_counts.clone(),
            null_value_counts: self.null_value_counts.clone(),
            lower_bounds: self.lower_bounds.clone(),
            upper_bounds: self.upper_bounds.clone(),
        }
    }

    pub fn with_stats(path: String, partition: PartitionValue, stats: FileStats) -> DataFileEntry {
        DataFileEntry {
            path,
            record_count: stats.record_count,
            file_size_in_bytes: stats.file_size_in_bytes,
            partition,
            column_sizes: stats.column_sizes,
            value_counts: stats.value_counts,
            null_value_counts: stats.null_value_counts,
            lower_bounds: stats.lower_bounds,
            upper_bounds: stats.upper_bounds,
        }
    }
}

/// A manifest entry's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryStatus {
    Existing = 0,
    Added = 1,
    Deleted = 2,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ManifestEntry {
    pub status: EntryStatus,
    /// `None` for an added file: inherited from the manifest list.
    pub snapshot_id: Option<i64>,
    pub sequence_number: Option<i64>,
    pub file_sequence_number: Option<i64>,
    pub file: DataFileEntry,
}

/// One manifest as a manifest list records it.
#[derive(Debug, Clone, PartialEq)]
pub struct ManifestFile {
    pub manifest_path: String,
    pub manifest_length: i64,
    pub sequence_number: i64,
    pub min_sequence_number: i64,
    pub added_snapshot_id: i64,
    pub added_files_count: i32,
    pub existing_files_count: i32,
    pub deleted_files_count: i32,
    pub added_rows_count: i64,
    pub existing_rows_count: i64,
    pub deleted_rows_count: i64,
    /// The partition value every entry of the manifest has (ferry writes
    /// one manifest per partition) in Iceberg's single-value serialisation:
    /// the summary's lower and upper bound.
    pub partition_bound: Vec<u8>,
}

fn map_schema(field_id: i32, key_id: i32, value_id: i32, value_type: &str) -> serde_json::Value {
    json!({
        "name": field_name(field_id),
        "type": ["null", {
            "type": "array",
            "logicalType": "map",
            "items": {
                "type": "record",
                "name": format!("k{key_id}_v{value_id}"),
                "fields": [
                    {"name": "key", "type": "int", "field-id": key_id},
                    {"name": "value", "type": value_type, "field-id": value_id}
                ]
            }
        }],
        "default": null,
        "field-id": field_id
    })
}

fn field_name(field_id: i32) -> &'static str {
    match field_id {
        108 => "column_sizes",
        109 => "value_counts",
        110 => "null_value_counts",
        137 => "nan_value_counts",
        125 => "lower_bounds",
        128 => "upper_bounds",
        _ => "unknown",
    }
}

/// The manifest entry's Avro schema for a table whose partition field is
/// `partition_name` of Avro type `partition_type`.
pub(crate) fn manifest_schema(partition_name: &str, partition_type: serde_json::Value) -> String {
    json!({
        "type": "record",
        "name": "manifest_entry",
        "fields": [
            {"name": "status", "type": "int", "field-id": 0},
            {"name": "snapshot_id", "type": ["null", "long"], "default": null, "field-id": 1},
            {"name": "sequence_number", "type": ["null", "long"], "default": null, "field-id": 3},
            {"name": "file_sequence_number", "type": ["null", "long"], "default": null, "field-id": 4},
            {"name": "data_file", "field-id": 2, "type": {
                "type": "record",
                "name": "r2",
                "fields": [
                    {"name": "content", "type": "int", "field-id": 134},
                    {"name": "file_path", "type": "string", "field-id": 100},
                    {"name": "file_format", "type": "string", "field-id": 101},
                    {"name": "partition", "field-id": 102, "type": {
                        "type": "record",
                        "name": "r102",
                        "fields": [
                            {"name": partition_name, "type": ["null", partition_type], "default": null, "field-id": crate::table::PARTITION_FIELD_ID}
                        ]
                    }},
                    {"name": "record_count", "type": "long", "field-id": 103},
                    {"name": "file_size_in_bytes", "type": "long", "field-id": 104},
                    map_schema(108, 117, 118, "long"),
                    map_schema(109, 119, 120, "long"),
                    map_schema(110, 121, 122, "long"),
                    map_schema(137, 138, 139, "long"),
                    map_schema(125, 126, 127, "bytes"),
                    map_schema(128, 129, 130, "bytes"),
                    {"name": "key_metadata", "type": ["null", "bytes"], "default": null, "field-id": 131},
                    {"name": "split_offsets", "type": ["null", {"type": "array", "items": "long", "element-id": 133}], "default": null, "field-id": 132},
                    {"name": "equality_ids", "type": ["null", {"type": "array", "items": "int", "element-id": 136}], "default": null, "field-id": 135},
                    {"name": "sort_order_id", "type": ["null", "int"], "default": null, "field-id": 140}
                ]
            }}
        ]
    })
    .to_string()
}

fn manifest_list_schema() -> String {
    json!({
        "type": "record",
        "name": "manifest_file",
        "fields": [
            {"name": "manifest_path", "type": "string", "field-id": 500},
            {"name": "manifest_length", "type": "long", "field-id": 501},
            {"name": "partition_spec_id", "type": "int", "field-id": 502},
            {"name": "content", "type": "int", "field-id": 517},
            {"name": "sequence_number", "type": "long", "field-id": 515},
            {"name": "min_sequence_number", "type": "long", "field-id": 516},
            {"name": "added_snapshot_id", "type": "long", "field-id": 503},
            {"name": "added_files_count", "type": "int", "field-id": 504},
            {"name": "existing_files_count", "type": "int", "field-id": 505},
            {"name": "deleted_files_count", "type": "int", "field-id": 506},
            {"name": "added_rows_count", "type": "long", "field-id": 512},
            {"name": "existing_rows_count", "type": "long", "field-id": 513},
            {"name": "deleted_rows_count", "type": "long", "field-id": 514},
            {"name": "partitions", "type": ["null", {"type": "array", "element-id": 508, "items": {
                "type": "record",
                "name": "r508",
                "fields": [
                    {"name": "contains_null", "type": "boolean", "field-id": 509},
                    {"name": "contains_nan", "type": ["null", "boolean"], "default": null, "field-id": 518},
                    {"name": "lower_bound", "type": ["null", "bytes"], "default": null, "field-id": 510},
                    {"name": "upper_bound", "type": ["null", "bytes"], "default": null, "field-id": 511}
                ]
            }}], "default": null, "field-id": 507},
            {"name": "key_metadata", "type": ["null", "bytes"], "default": null, "field-id": 519}
        ]
    })
    .to_string()
}

fn avro_error(what: &'static str) -> impl Fn(apache_avro::Error) -> IcebergError {
    move |e| IcebergError::Avro(format!("{what}: {e}"))
}

fn optional(v: Option<Value>) -> Value {
    match v {
        None => Value::Union(0, Box::new(Value::Null)),
        Some(v) => Value::Union(1, Box::new(v)),
    }
}

fn pairs(items: &[(i32, Value)]) -> Value {
    optional(Some(Value::Array(
        items
            .iter()
            .map(|(k, v)| {
                Value::Record(vec![
                    ("key".into(), Value::Int(*k)),
                    ("value".into(), v.clone()),
                ])
            })
            .collect(),
    )))
}

fn longs(items: &[(i32, i64)]) -> Value {
    pairs(
        &items
            .iter()
            .map(|(k, v)| (*k, Value::Long(*v)))
            .collect::<Vec<_>>(),
    )
}

fn bytes(items: &[(i32, Vec<u8>)]) -> Value {
    pairs(
        &items
            .iter()
            .map(|(k, v)| (*k, Value::Bytes(v.clone())))
            .collect::<Vec<_>>(),
    )
}

/// What a manifest file's header says about the table (readers take the
/// schema and the partition spec from it).
pub struct ManifestHeader {
    pub schema_json: String,
    pub partition_spec_json: String,
    pub partition_name: String,
    pub partition_type: serde_json::Value,
}

/// An Avro object container: our own header (the schema exactly as written
/// here, with the `logicalType: map` and field-id attributes Iceberg readers
/// need, which the Avro library would drop; the codec; `metadata` in the
/// order given), then the library's deflate blocks. The sync marker is
/// given: the library would draw one at random, and ferry's files are a
/// function of what they hold (a retried commit writes the same bytes; the
/// simulator replays them).
fn container(
    schema_json: &str,
    metadata: &[(&str, String)],
    values: Vec<Value>,
    marker: [u8; 16],
) -> Result<Vec<u8>, IcebergError> {
    let schema = AvroSchema::parse_str(schema_json).map_err(avro_error("schema"))?;
    let mut writer = Writer::builder()
        .schema(&schema)
        .writer(Vec::new())
        .codec(apache_avro::Codec::Deflate(Default::default()))
        .marker(marker)
        .has_header(true)
        .build()
        .map_err(avro_error("writer"))?;
    for v in values {
        writer.append_value(v).map_err(avro_error("value"))?;
    }
    let blocks = writer.into_inner().map_err(avro_error("blocks"))?;
    let mut out = b"Obj\x01".to_vec();
    let mut entries: Vec<(&str, &[u8])> = vec![
        ("avro.schema", schema_json.as_bytes()),
        ("avro.codec", b"deflate"),
    ];
    entries.extend(metadata.iter().map(|(k, v)| (*k, v.as_bytes())));
    put_long(&mut out, entries.len() as i64);
    for (k, v) in entries {
        put_long(&mut out, k.len() as i64);
        out.extend_from_slice(k.as_bytes());
        put_long(&mut out, v.len() as i64);
        out.extend_from_slice(v);
    }
    put_long(&mut out, 0);
    out.extend_from_slice(&marker);
    out.extend_from_slice(&blocks);
    Ok(out)
}

/// Avro's long: zig-zag, then base-128 little-endian.
fn put_long(out: &mut Vec<u8>, n: i64) {
    let mut z = ((n << 1) ^ (n >> 63)) as u64;
    loop {
        if z < 0x80 {
            out.push(z as u8);
            return;
        }
        out.push((z as u8 & 0x7f) | 0x80);
        z >>= 7;
    }
}

/// Encodes a manifest of data files; `marker` is the Avro sync marker.
pub fn write_manifest(
    header: &ManifestHeader,
    entries: &[ManifestEntry],
    marker: [u8; 16],
) -> Result<Vec<u8>, IcebergError> {
    let schema_json = manifest_schema(&header.partition_name, header.partition_type.clone());
    let metadata = [
        ("schema", header.schema_json.clone()),
        ("schema-id", "0".to_string()),
        ("partition-spec", header.partition_spec_json.clone()),
        ("partition-spec-id", "0".to_string()),
        ("format-version", "2".to_string()),
        ("content", "data".to_string()),
    ];
    let mut values = Vec::with_capacity(entries.len());
    for e in entries {
        let f = &e.file;
        let data_file = Value::Record(vec![
            ("content".into(), Value::Int(0)),
            ("file_path".into(), Value::String(f.path.clone())),
            ("file_format".into(), Value::String("PARQUET".into())),
            (
                "partition".into(),
                Value::Record(vec![(
                    header.partition_name.clone(),
                    optional(Some(f.partition.to_avro())),
                )]),
            ),
            ("record_count".into(), Value::Long(f.record_count)),
            (
                "file_size_in_bytes".into(),
                Value::Long(f.file_size_in_bytes),
            ),
            ("column_sizes".into(), longs(&f.column_sizes)),
            ("value_counts".into(), longs(&f.value_counts)),
            ("null_value_counts".into(), longs(&f.null_value_counts)),
            ("nan_value_counts".into(), optional(None)),
            ("lower_bounds".into(), bytes(&f.lower_bounds)),
            ("upper_bounds".into(), bytes(&f.upper_bounds)),
            ("key_metadata".into(), optional(None)),
            ("split_offsets".into(), optional(None)),
            ("equality_ids".into(), optional(None)),
            ("sort_order_id".into(), optional(None)),
        ]);
        let entry = Value::Record(vec![
            ("status".into(), Value::Int(e.status as i32)),
            (
                "snapshot_id".into(),
                optional(e.snapshot_id.map(Value::Long)),
            ),
            (
                "sequence_number".into(),
                optional(e.sequence_number.map(Value::Long)),
            ),
            (
                "file_sequence_number".into(),
                optional(e.file_sequence_number.map(Value::Long)),
            ),
            ("data_file".into(), data_file),
        ]);
        values.push(entry);
    }
    container(&schema_json, &metadata, values, marker)
}

/// Encodes a manifest list; `marker` is the Avro sync marker.
pub fn write_manifest_list(
    snapshot_id: i64,
    parent_snapshot_id: Option<i64>,
    sequence_number: i64,
    manifests: &[ManifestFile],
    marker: [u8; 16],
) -> Result<Vec<u8>, IcebergError> {
    let parent = parent_snapshot_id.map_or_else(|| "null".to_string(), |p| p.to_string());
    let metadata = [
        ("snapshot-id", snapshot_id.to_string()),
        ("parent-snapshot-id", parent),
        ("sequence-number", sequence_number.to_string()),
        ("format-version", "2".to_string()),
    ];
    let mut values = Vec::with_capacity(manifests.len());
    for m in manifests {
        let bound = m.partition_bound.clone();
        let summary = Value::Record(vec![
            ("contains_null".into(), Value::Boolean(false)),
            ("contains_nan".into(), optional(None)),
            (
                "lower_bound".into(),
                optional(Some(Value::Bytes(bound.clone()))),
            ),
            ("upper_bound".into(), optional(Some(Value::Bytes(bound)))),
        ]);
        let record = Value::Record(vec![
            (
                "manifest_path".into(),
                Value::String(m.manifest_path.clone()),
            ),
            ("manifest_length".into(), Value::Long(m.manifest_length)),
            ("partition_spec_id".into(), Value::Int(0)),
            ("content".into(), Value::Int(0)),
            ("sequence_number".into(), Value::Long(m.sequence_number)),
            (
                "min_sequence_number".into(),
                Value::Long(m.min_sequence_number),
            ),
            ("added_snapshot_id".into(), Value::Long(m.added_snapshot_id)),
            ("added_files_count".into(), Value::Int(m.added_files_count)),
            (
                "existing_files_count".into(),
                Value::Int(m.existing_files_count),
            ),
            (
                "deleted_files_count".into(),
                Value::Int(m.deleted_files_count),
            ),
            ("added_rows_count".into(), Value::Long(m.added_rows_count)),
            (
                "existing_rows_count".into(),
                Value::Long(m.existing_rows_count),
            ),
            (
                "deleted_rows_count".into(),
                Value::Long(m.deleted_rows_count),
            ),
            (
                "partitions".into(),
                optional(Some(Value::Array(vec![summary]))),
            ),
            ("key_metadata".into(), optional(None)),
        ]);
        values.push(record);
    }
    container(&manifest_list_schema(), &metadata, values, marker)
}

fn field<'a>(fields: &'a [(String, Value)], name: &str) -> Result<&'a Value, IcebergError> {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
        .ok_or_else(|| IcebergError::Avro(format!("no field {name}")))
}

fn unwrap_union(v: &Value) -> &Value {
    match v {
        Value::Union(_, inner) => inner,
        other => other,
    }
}

fn as_long(v: &Value) -> Result<i64, IcebergError> {
    match unwrap_union(v) {
        Value::Long(x) => Ok(*x),
        Value::Int(x) => Ok(i64::from(*x)),
        other => Err(IcebergError::Avro(format!(
            "expected a long, found {other:?}"
        ))),
    }
}

fn as_int(v: &Value) -> Result<i32, IcebergError> {
    match unwrap_union(v) {
        Value::Int(x) => Ok(*x),
        other => Err(IcebergError::Avro(format!(
            "expected an int, found {other:?}"
        ))),
    }
}

fn as_opt_long(v: &Value) -> Result<Option<i64>, IcebergError> {
    match unwrap_union(v) {
        Value::Null => Ok(None),
        other => as_long(other).map(Some),
    }
}

fn as_string(v: &Value) -> Result<String, IcebergError> {
    match unwrap_union(v) {
        Value::String(s) => Ok(s.clone()),
        other => Err(IcebergError::Avro(format!(
            "expected a string, found {other:?}"
        ))),
    }
}

fn as_pairs<T>(
    v: &Value,
    value: impl Fn(&Value) -> Result<T, IcebergError>,
) -> Result<Vec<(i32, T)>, IcebergError> {
    match unwrap_union(v) {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::Record(kv) => Ok((as_int(field(kv, "key")?)?, value(field(kv, "value")?)?)),
                other => Err(IcebergError::Avro(format!(
                    "expected a pair, found {other:?}"
                ))),
            })
            .collect(),
        other => Err(IcebergError::Avro(format!(
            "expected pairs, found {other:?}"
        ))),
    }
}

fn as_bytes(v: &Value) -> Result<Vec<u8>, IcebergError> {
    match unwrap_union(v) {
        Value::Bytes(b) => Ok(b.clone()),
        other => Err(IcebergError::Avro(format!(
            "expected bytes, found {other:?}"
        ))),
    }
}

fn as_partition(v: &Value) -> Result<PartitionValue, IcebergError> {
    Ok(match unwrap_union(v) {
        Value::Int(x) => PartitionValue::Int(*x),
        Value::Date(x) => PartitionValue::Date(*x),
        Value::Long(x) => PartitionValue::Long(*x),
        Value::Boolean(b) => PartitionValue::Boolean(*b),
        Value::String(s) => PartitionValue::String(s.clone()),
        other => {
            return Err(IcebergError::Avro(format!(
                "expected a partition value, found {other:?}"
            )))
        }
    })
}

/// Decodes a manifest ferry wrote.
pub fn read_manifest(bytes: &[u8]) -> Result<Vec<ManifestEntry>, IcebergError> {
    let reader = Reader::new(bytes).map_err(avro_error("manifest"))?;
    let mut out = Vec::new();
    for value in reader {
        let Value::Record(e) = value.map_err(avro_error("manifest entry"))? else {
            return Err(IcebergError::Avro(
                "a manifest entry is not a record".into(),
            ));
        };
        let status = match as_int(field(&e, "status")?)? {
            0 => EntryStatus::Existing,
            1 => EntryStatus::Added,
            2 => EntryStatus::Deleted,
            other => return Err(IcebergError::Avro(format!("entry status {other}"))),
        };
        let Value::Record(f) = unwrap_union(field(&e, "data_file")?) else {
            return Err(IcebergError::Avro("data_file is not a record".into()));
        };
        let Value::Record(p) = unwrap_union(field(f, "partition")?) else {
            return Err(IcebergError::Avro("partition is not a record".into()));
        };
        let partition = p
            .first()
            .map(|(_, v)| as_partition(v))
            .ok_or_else(|| IcebergError::Avro("no partition value".into()))??;
        out.push(ManifestEntry {
            status,
            snapshot_id: as_opt_long(field(&e, "snapshot_id")?)?,
            sequence_number: as_opt_long(field(&e, "sequence_number")?)?,
            file_sequence_number: as_opt_long(field(&e, "file_sequence_number")?)?,
            file: DataFileEntry {
                path: as_string(field(f, "file_path")?)?,
                record_count: as_long(field(f, "record_count")?)?,
                file_size_in_bytes: as_long(field(f, "file_size_in_bytes")?)?,
                partition,
                column_sizes: as_pairs(field(f, "column_sizes")?, as_long)?,
                value_counts: as_pairs(field(f, "value_counts")?, as_long)?,
                null_value_counts: as_pairs(field(f, "null_value_counts")?, as_long)?,
                lower_bounds: as_pairs(field(f, "lower_bounds")?, as_bytes)?,
                upper_bounds: as_pairs(field(f, "upper_bounds")?, as_bytes)?,
            },
        });
    }
    Ok(out)
}

/// Decodes a manifest list ferry wrote.
pub fn read_manifest_list(bytes: &[u8]) -> Result<Vec<ManifestFile>, IcebergError> {
    let reader = Reader::new(bytes).map_err(avro_error("manifest list"))?;
    let mut out = Vec::new();
    for value in reader {
        let Value::Record(m) = value.map_err(avro_error("manifest list entry"))? else {
            return Err(IcebergError::Avro(
                "a manifest list entry is not a record".into(),
            ));
        };
        let partition = match unwrap_union(field(&m, "partitions")?) {
            Value::Array(summaries) => match summaries.first() {
                Some(Value::Record(s)) => as_bytes(field(s, "lower_bound")?)?,
                _ => return Err(IcebergError::Avro("no partition summary".into())),
            },
            _ => return Err(IcebergError::Avro("no partition summary".into())),
        };
        let int = |name: &str| -> Result<i32, IcebergError> { as_int(field(&m, name)?) };
        let long = |name: &str| -> Result<i64, IcebergError> { as_long(field(&m, name)?) };
        out.push(ManifestFile {
            manifest_path: as_string(field(&m, "manifest_path")?)?,
            manifest_length: long("manifest_length")?,
            sequence_number: long("sequence_number")?,
            min_sequence_number: long("min_sequence_number")?,
            added_snapshot_id: long("added_snapshot_id")?,
            added_files_count: int("added_files_count")?,
            existing_files_count: int("existing_files_count")?,
            deleted_files_count: int("deleted_files_count")?,
            added_rows_count: long("added_rows_count")?,
            existing_rows_count: long("existing_rows_count")?,
            deleted_rows_count: long("deleted_rows_count")?,
            partition_bound: partition,
        });
    }
    Ok(out)
}
