//! A ferry table as an Iceberg table: its schema with field ids (columns in
//! order from 1), its partition spec (ferry's transform of one column, field
//! id 1000), and a partition's value from ferry's partition id, which is
//! invertible (`ferry_table::keys`).

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::{Field, Schema as ArrowSchema, SchemaRef};
use ferry_table::def::{ColumnType, PartitionTransform};
use ferry_table::TableDef;

use crate::spec::{NestedField, PartitionField, PartitionSpec, Schema};
use crate::IcebergError;

/// The field id of the (one) partition field.
pub const PARTITION_FIELD_ID: i32 = 1000;

/// The Parquet field-id key of an Arrow field's metadata, which the
/// `parquet` crate writes into the file schema.
pub const PARQUET_FIELD_ID: &str = "PARQUET:field_id";

/// The Iceberg type of a ferry column type.
pub fn iceberg_type(t: ColumnType) -> &'static str {
    match t {
        ColumnType::Int32 => "int",
        ColumnType::Int64 => "long",
        ColumnType::Float64 => "double",
        ColumnType::Boolean => "boolean",
        ColumnType::Utf8 => "string",
        ColumnType::Date => "date",
        ColumnType::Timestamp => "timestamptz",
    }
}

/// The table's Iceberg schema: column `i` has field id `i + 1`.
pub fn schema(def: &TableDef) -> Schema {
    Schema {
        kind: "struct".into(),
        schema_id: 0,
        fields: def
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| NestedField {
                id: field_id(i),
                name: c.name.clone(),
                required: !c.nullable,
                field_type: iceberg_type(c.column_type).into(),
            })
            .collect(),
    }
}

fn field_id(column_index: usize) -> i32 {
    i32::try_from(column_index + 1).unwrap_or(i32::MAX)
}

/// The Iceberg name of a transform.
pub fn transform_name(t: PartitionTransform) -> &'static str {
    match t {
        PartitionTransform::Identity => "identity",
        PartitionTransform::Day => "day",
        PartitionTransform::Month => "month",
        PartitionTransform::Year => "year",
    }
}

/// The partition field's name: the column's, with the transform after an
/// underscore unless it is the identity (as Iceberg's writers name them,
/// and as ferry's Hive folders are named).
pub fn partition_field_name(def: &TableDef) -> String {
    match def.partition_by.transform {
        PartitionTransform::Identity => def.partition_by.column.clone(),
        t => format!("{}_{}", def.partition_by.column, transform_name(t)),
    }
}

/// The table's partition spec (one field).
pub fn partition_spec(def: &TableDef) -> Result<PartitionSpec, IcebergError> {
    let source = def
        .columns
        .iter()
        .position(|c| c.name == def.partition_by.column)
        .ok_or_else(|| {
            IcebergError::Table(format!(
                "partition column {} is not a column",
                def.partition_by.column
            ))
        })?;
    Ok(PartitionSpec {
        spec_id: 0,
        fields: vec![PartitionField {
            source_id: field_id(source),
            field_id: PARTITION_FIELD_ID,
            name: partition_field_name(def),
            transform: transform_name(def.partition_by.transform).into(),
        }],
    })
}

/// The Avro type of the partition field in manifests.
pub(crate) fn partition_avro_type(def: &TableDef) -> Result<serde_json::Value, IcebergError> {
    Ok(match def.partition_by.transform {
        PartitionTransform::Month | PartitionTransform::Year => serde_json::json!("int"),
        PartitionTransform::Day => serde_json::json!({"type": "int", "logicalType": "date"}),
        PartitionTransform::Identity => match source_type(def)? {
            ColumnType::Int32 => serde_json::json!("int"),
            ColumnType::Int64 => serde_json::json!("long"),
            ColumnType::Boolean => serde_json::json!("boolean"),
            ColumnType::Utf8 => serde_json::json!("string"),
            ColumnType::Date => serde_json::json!({"type": "int", "logicalType": "date"}),
            other => {
                return Err(IcebergError::Table(format!(
                    "a {} column cannot be an identity partition",
                    other.name()
                )))
            }
        },
    })
}

fn source_type(def: &TableDef) -> Result<ColumnType, IcebergError> {
    def.columns
        .iter()
        .find(|c| c.name == def.partition_by.column)
        .map(|c| c.column_type)
        .ok_or_else(|| IcebergError::Table("no partition column".into()))
}

/// A partition's value, as Iceberg holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartitionValue {
    /// `int`: an Int32 identity, months or years since 1970.
    Int(i32),
    Long(i64),
    Boolean(bool),
    String(String),
    /// Days since 1970-01-01: a Date identity, or the day transform.
    Date(i32),
}

impl PartitionValue {
    /// The value of the partition ferry names `partition_id` in `def`.
    pub fn of(def: &TableDef, partition_id: &str) -> Result<PartitionValue, IcebergError> {
        let bad = || {
            IcebergError::Table(format!(
                "{partition_id:?} is not a partition id of table {}",
                def.name
            ))
        };
        let date = |id: &str| -> Option<(i32, u32, u32)> {
            if id.len() != 8 || !id.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some((
                id[..4].parse().ok()?,
                id[4..6].parse().ok()?,
                id[6..].parse().ok()?,
            ))
        };
        Ok(match def.partition_by.transform {
            PartitionTransform::Year => {
                let y: i32 = partition_id.parse().map_err(|_| bad())?;
                PartitionValue::Int(y - 1970)
            }
            PartitionTransform::Month => {
                // Digits only, so that slicing by bytes cuts no character.
                if partition_id.len() != 6 || !partition_id.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                let y: i32 = partition_id[..4].parse().map_err(|_| bad())?;
                let m: i32 = partition_id[4..].parse().map_err(|_| bad())?;
                if !(1..=12).contains(&m) {
                    return Err(bad());
                }
                PartitionValue::Int((y - 1970) * 12 + m - 1)
            }
            PartitionTransform::Day => {
                let (y, m, d) = date(partition_id).ok_or_else(bad)?;
                PartitionValue::Date(days_from_civil(y, m, d).ok_or_else(bad)?)
            }
            PartitionTransform::Identity => match source_type(def)? {
                ColumnType::Int32 => PartitionValue::Int(partition_id.parse().map_err(|_| bad())?),
                ColumnType::Int64 => PartitionValue::Long(partition_id.parse().map_err(|_| bad())?),
                ColumnType::Boolean => {
                    PartitionValue::Boolean(partition_id.parse().map_err(|_| bad())?)
                }
                ColumnType::Utf8 => PartitionValue::String(partition_id.to_string()),
                ColumnType::Date => {
                    let (y, m, d) = date(partition_id).ok_or_else(bad)?;
                    PartitionValue::Date(days_from_civil(y, m, d).ok_or_else(bad)?)
                }
                _ => return Err(bad()),
            },
        })
    }

    /// Iceberg's single-value serialisation (manifest bounds).
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            PartitionValue::Int(v) | PartitionValue::Date(v) => v.to_le_bytes().to_vec(),
            PartitionValue::Long(v) => v.to_le_bytes().to_vec(),
            PartitionValue::Boolean(b) => vec![u8::from(*b)],
            PartitionValue::String(s) => s.as_bytes().to_vec(),
        }
    }

    pub(crate) fn to_avro(&self) -> apache_avro::types::Value {
        use apache_avro::types::Value;
        match self {
            PartitionValue::Int(v) => Value::Int(*v),
            PartitionValue::Date(v) => Value::Date(*v),
            PartitionValue::Long(v) => Value::Long(*v),
            PartitionValue::Boolean(b) => Value::Boolean(*b),
            PartitionValue::String(s) => Value::String(s.clone()),
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`); `None` for a date that does not exist.
fn days_from_civil(y: i32, m: u32, d: u32) -> Option<i32> {
    let days_in_month = match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        _ => return None,
    };
    if d == 0 || d > days_in_month {
        return None;
    }
    let y = i64::from(y) - i64::from(m <= 2);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    i32::try_from(era * 146_097 + doe - 719_468).ok()
}

/// The Arrow schema of the table's data files: the table's columns, each
/// carrying its Iceberg field id, so that readers match columns by id.
pub fn data_file_schema(def: &TableDef) -> SchemaRef {
    let arrow = def.arrow_schema();
    let fields: Vec<Field> = arrow
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let mut metadata: HashMap<String, String> = f.metadata().clone().into();
            metadata.insert(PARQUET_FIELD_ID.into(), field_id(i).to_string());
            f.as_ref().clone().with_metadata(metadata)
        })
        .collect();
    Arc::new(ArrowSchema::new(fields))
}

/// The schema to encode rows of `rows` schema as the table's data files:
/// [`data_file_schema`], once the rows are checked to have the table's
/// columns in its order (a column's position is its field id).
pub fn data_file_schema_for(def: &TableDef, rows: &ArrowSchema) -> Result<SchemaRef, IcebergError> {
    let want = def.arrow_schema();
    let names = |s: &ArrowSchema| -> Vec<(String, arrow::datatypes::DataType)> {
        s.fields()
            .iter()
            .map(|f| (f.name().clone(), f.data_type().clone()))
            .collect()
    };
    if names(rows) != names(&want) {
        return Err(IcebergError::Table(format!(
            "rows with columns {:?} are not table {}'s {:?}",
            names(rows),
            def.name,
            names(&want)
        )));
    }
    Ok(data_file_schema(def))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(transform: &str, column: &str) -> TableDef {
        TableDef::from_toml(&format!(
            r#"
name = "t"
partition_by = {{ column = "{column}", transform = "{transform}" }}
shard_by = {{ column = "id", shards = 2 }}
replicas = 1
[[columns]]
name = "ts"
type = "Timestamp"
[[columns]]
name = "id"
type = "Int64"
[[columns]]
name = "day"
type = "Date"
[[columns]]
name = "region"
type = "Utf8"
[[columns]]
name = "name"
type = "Utf8"
nullable = true
"#
        ))
        .expect("definition")
    }

    #[test]
    fn columns_get_ids_in_order_and_the_partition_field_1000() {
        let d = def("month", "ts");
        let s = schema(&d);
        assert_eq!(
            s.fields
                .iter()
                .map(|f| (f.id, f.field_type.as_str(), f.required))
                .collect::<Vec<_>>(),
            [
                (1, "timestamptz", true),
                (2, "long", true),
                (3, "date", true),
                (4, "string", true),
                (5, "string", false)
            ]
        );
        let spec = partition_spec(&d).expect("spec");
        assert_eq!(spec.fields[0].source_id, 1);
        assert_eq!(spec.fields[0].field_id, PARTITION_FIELD_ID);
        assert_eq!(spec.fields[0].name, "ts_month");
        assert_eq!(partition_field_name(&def("identity", "id")), "id");
        let arrow = data_file_schema(&d);
        assert_eq!(
            arrow
                .field(3)
                .metadata()
                .get(PARQUET_FIELD_ID)
                .map(String::as_str),
            Some("4")
        );
    }

    #[test]
    fn partition_ids_become_iceberg_values() {
        let v = |t: &str, c: &str, id: &str| PartitionValue::of(&def(t, c), id);
        assert_eq!(
            v("month", "ts", "197001").expect("v"),
            PartitionValue::Int(0)
        );
        assert_eq!(
            v("month", "ts", "202406").expect("v"),
            PartitionValue::Int(653)
        );
        assert_eq!(v("year", "ts", "2024").expect("v"), PartitionValue::Int(54));
        assert_eq!(
            v("day", "ts", "19700102").expect("v"),
            PartitionValue::Date(1)
        );
        assert_eq!(
            v("day", "ts", "20240601").expect("v"),
            PartitionValue::Date(19875)
        );
        assert_eq!(
            v("day", "ts", "19691231").expect("v"),
            PartitionValue::Date(-1)
        );
        assert_eq!(
            v("identity", "id", "-7").expect("v"),
            PartitionValue::Long(-7)
        );
        assert_eq!(
            v("identity", "day", "20000229").expect("v"),
            PartitionValue::Date(11016)
        );
        assert_eq!(
            v("identity", "region", "eu-1").expect("v"),
            PartitionValue::String("eu-1".into())
        );
        for (t, c, id) in [
            ("month", "ts", "202413"),
            ("day", "ts", "20230229"),
            ("identity", "id", "x"),
            ("year", "ts", ""),
            ("month", "ts", "202é4"),
            ("day", "ts", "2024é601"),
        ] {
            assert!(v(t, c, id).is_err(), "{t} {id}");
        }
        assert_eq!(PartitionValue::Int(653).to_bytes(), 653i32.to_le_bytes());
    }
}
