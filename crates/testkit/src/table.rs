//! The test table most suites use, and a catalog of fixed tables.

use std::collections::BTreeMap;

use async_trait::async_trait;
use ferry_replica::{TableRef, Tables};
use ferry_table::{Table, TableDef};

/// Table `id` named `name`: `id` Int64 (the shard key, `shards` shards),
/// `p` Utf8 (the partition, identity transform), then each of
/// `utf8_columns` (Utf8, not nullable).
///
/// # Panics
/// When the definition is invalid (a bad name among `utf8_columns`).
pub fn id_p_table(id: u64, name: &str, shards: u32, utf8_columns: &[&str]) -> Table {
    let mut toml = format!(
        "name = \"{name}\"\npartition_by = {{ column = \"p\", transform = \"identity\" }}\n\
         shard_by = {{ column = \"id\", shards = {shards} }}\n\
         [[columns]]\nname = \"id\"\ntype = \"Int64\"\n[[columns]]\nname = \"p\"\ntype = \"Utf8\"\n"
    );
    for column in utf8_columns {
        toml.push_str(&format!(
            "[[columns]]\nname = \"{column}\"\ntype = \"Utf8\"\n"
        ));
    }
    Table {
        id,
        def: TableDef::from_toml(&toml).unwrap_or_else(|e| panic!("test table {name}: {e}")),
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
