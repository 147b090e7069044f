//! Test tables as TOML, the test table most suites use, and a catalog of
//! fixed tables.

use std::collections::BTreeMap;

use async_trait::async_trait;
use ferry_replica::{TableRef, Tables};
use ferry_table::{Table, TableDef};

/// A table definition as TOML text, put together column by column: suites
/// that hand a definition to the binary or the client, or edit it, need the
/// text, and the tables several suites share are built in one place.
#[derive(Debug, Clone)]
pub struct TableToml {
    head: String,
    columns: String,
}

impl TableToml {
    /// Table `name`, partitioned by `partition` (column, transform) and
    /// sharded by `shard_by` (column, shards); columns follow.
    pub fn new(name: &str, partition: (&str, &str), shard_by: (&str, u32)) -> TableToml {
        let ((partition, transform), (shard_key, shards)) = (partition, shard_by);
        TableToml {
            head: format!(
                "name = \"{name}\"\n\
                 partition_by = {{ column = \"{partition}\", transform = \"{transform}\" }}\n\
                 shard_by = {{ column = \"{shard_key}\", shards = {shards} }}\n"
            ),
            columns: String::new(),
        }
    }

    /// Sets the replicas per shard (written with the table's own keys,
    /// before every column, wherever it is called).
    pub fn replicas(mut self, replicas: u32) -> TableToml {
        self.head.push_str(&format!("replicas = {replicas}\n"));
        self
    }

    /// Adds a column that may not be null.
    pub fn column(self, name: &str, ty: &str) -> TableToml {
        self.add(name, ty, false)
    }

    /// Adds a column that may be null.
    pub fn nullable(self, name: &str, ty: &str) -> TableToml {
        self.add(name, ty, true)
    }

    /// Adds `f` (Float64, nullable), `b` (Boolean), `s` (Utf8, nullable),
    /// `d` (Date) and `ts` (Timestamp): with an Int32 and an Int64 column,
    /// every column type, and nulls in two of them.
    pub fn mixed_columns(self) -> TableToml {
        self.nullable("f", "Float64")
            .column("b", "Boolean")
            .nullable("s", "Utf8")
            .column("d", "Date")
            .column("ts", "Timestamp")
    }

    fn add(mut self, name: &str, ty: &str, nullable: bool) -> TableToml {
        self.columns.push_str(&format!(
            "[[columns]]\nname = \"{name}\"\ntype = \"{ty}\"\n"
        ));
        if nullable {
            self.columns.push_str("nullable = true\n");
        }
        self
    }

    /// The definition's text.
    pub fn toml(&self) -> String {
        format!("{}{}", self.head, self.columns)
    }

    /// The definition.
    ///
    /// # Panics
    /// When it is invalid.
    pub fn def(&self) -> TableDef {
        TableDef::from_toml(&self.toml())
            .unwrap_or_else(|e| panic!("test table:\n{}\n{e}", self.toml()))
    }
}

/// Table `name`: `id` Int64 (the shard key, `shards` shards), `p` Utf8 (the
/// partition, identity transform); more columns may follow.
pub fn id_p_toml(name: &str, shards: u32) -> TableToml {
    TableToml::new(name, ("p", "identity"), ("id", shards))
        .column("id", "Int64")
        .column("p", "Utf8")
}

/// Table `t`: `id` Int64 (the shard key, `shards` shards), `d` Date (the
/// partition, by month); more columns may follow.
pub fn id_d_toml(shards: u32) -> TableToml {
    TableToml::new("t", ("d", "month"), ("id", shards))
        .column("id", "Int64")
        .column("d", "Date")
}

/// Table `id`: [`id_p_toml`], then each of `utf8_columns` (Utf8, not
/// nullable).
///
/// # Panics
/// When the definition is invalid (a bad name among `utf8_columns`).
pub fn id_p_table(id: u64, name: &str, shards: u32, utf8_columns: &[&str]) -> Table {
    let toml = utf8_columns
        .iter()
        .fold(id_p_toml(name, shards), |t, column| {
            t.column(column, "Utf8")
        });
    Table {
        id,
        def: toml.def(),
    }
}

/// A catalog that never changes: these tables (and what was said of other
/// ids), every other id unknown.
#[derive(Debug, Clone, Default)]
pub struct FixedTables(BTreeMap<u64, TableRef>);

impl FixedTables {
    /// A catalog of `tables`.
    pub fn new(tables: impl IntoIterator<Item = Table>) -> FixedTables {
        FixedTables(
            tables
                .into_iter()
                .map(|t| (t.id, TableRef::Known(t)))
                .collect(),
        )
    }

    /// Says `id` was dropped.
    pub fn with_dropped(mut self, id: u64) -> FixedTables {
        self.0.insert(id, TableRef::Dropped);
        self
    }
}

#[async_trait]
impl Tables for FixedTables {
    async fn by_id(&self, id: u64) -> Result<TableRef, String> {
        Ok(self.0.get(&id).cloned().unwrap_or(TableRef::Unknown))
    }
}
