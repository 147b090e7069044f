//! The way rows come in: the table catalog in coordination ([`catalog`]), the
//! HTTP API of tables and inserts ([`api`]) that turns a request body into
//! committed WAL insert records, and the metrics of both ([`metrics`]).
//!
//! Must never: decode on the event loop (decoding goes through the CPU seam),
//! answer success for an insert that is not committed, or log a token.

pub mod api;
pub mod catalog;
pub mod idempotency;
pub mod metrics;

pub use api::{Api, ApiLimits, ApiToken, InsertResponse, InsertSink};
pub use catalog::{Catalog, CatalogError, TableById};
pub use metrics::IngestMetrics;
