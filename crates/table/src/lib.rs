//! Tables: their definitions ([`def`]), the partition and shard of a row
//! ([`keys`]), and insert bodies decoded and checked against a table ([`rows`]).
//!
//! Pure functions only: no I/O, no clock. Decoding is CPU-heavy, so node code
//! calls it through the CPU seam.

pub mod def;
pub mod keys;
pub mod rows;

pub use def::{
    ColumnDef, ColumnType, DefError, PartitionBy, PartitionTransform, ShardBy, Table, TableDef,
};
pub use rows::{DecodeError, Format, RowError, Rows};
