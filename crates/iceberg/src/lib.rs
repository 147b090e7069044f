//! Apache Iceberg v2 tables written without a catalog, on any
//! `ferry_storage::Location` (a local folder or S3).
//!
//! The table's state is its newest `metadata/vN.metadata.json`; a commit
//! creates `v(N+1).metadata.json` create-only, so of two racing commits one
//! wins and the other re-reads the new version and tries again on top of it
//! (nothing is ever overwritten). A commit replaces one partition's files
//! (an overwrite of the partition: its previous files are recorded as
//! deleted in the same snapshot), so a reader of the current snapshot never
//! sees a partition's rows twice.
//!
//! Commit identity: every snapshot's summary names the export it commits
//! ([`TRANSACTION_PROPERTY`]), and the table's properties name, per
//! partition, the export whose files are current
//! ([`partition_property`]). Properties are carried into every new metadata
//! version, so expiring snapshots cannot erase them. A commit of the export
//! already current, or of the same content under another transaction (a
//! forced export of unchanged rows), is a no-op; a commit of an export that an export already
//! current supersedes (lower sequence, then create time, then transaction
//! id: the order of ferry's commit files) is a no-op too, so a reader never
//! goes back to older content.
//!
//! Here: the errors and the identity's names; in the modules: `spec` (the
//! metadata JSON), `table` (a ferry table's schema, partition spec and
//! partition values), `manifest` (the Avro manifests and manifest lists),
//! `data_file` (Parquet files with field ids and their statistics),
//! `commit` (finding the current version and committing), `verify` (the
//! current snapshot checked as a reader reads it), `upkeep` (expiring old
//! snapshots, keeping the commit identities).

pub mod commit;
pub mod data_file;
pub mod manifest;
pub mod spec;
pub mod table;
pub mod upkeep;
pub mod verify;

pub use commit::{Commit, CommitOutcome, CommitQueue, CurrentExport, IcebergTable};
pub use data_file::{
    encode_data_file, entry_from_footer, footer_with_field_ids, read_footer, EncodedDataFile,
};
pub use manifest::{DataFileEntry, FileStats};
pub use table::PartitionValue;
pub use upkeep::{ExpireOutcome, RemovedOrphans};

/// The snapshot summary key that names the export a snapshot commits.
pub const TRANSACTION_PROPERTY: &str = "ferry.transaction-id";

/// The snapshot summary key that names the content (table, partition and
/// part checksums) a snapshot commits.
pub const CONTENT_PROPERTY: &str = "ferry.content-id";

/// The table property that names the export whose files are current for a
/// partition (JSON: `commit::CurrentExport`).
pub fn partition_property(partition_id: &str) -> String {
    format!("ferry.partition.{partition_id}.transaction-id")
}

/// Why a table could not be read or committed to.
#[derive(Debug, thiserror::Error)]
pub enum IcebergError {
    /// The ferry table cannot be expressed as this Iceberg table (or a
    /// partition id is not one of the table's).
    #[error("{0}")]
    Table(String),
    #[error("object storage: {0}")]
    Storage(#[from] ferry_storage::StorageError),
    /// A metadata file that does not parse: the table is damaged or not
    /// one ferry wrote.
    #[error("table metadata {file}: {reason}")]
    Metadata { file: String, reason: String },
    #[error("Avro: {0}")]
    Avro(String),
    #[error("Parquet: {0}")]
    Parquet(String),
    /// Commits kept losing races to other committers.
    #[error("the commit lost {0} races to other commits in a row")]
    Contended(u32),
    /// The commit of a batch ([`commit::CommitQueue`]) that failed as a
    /// whole.
    #[error("{detail}")]
    Batch { detail: String, retryable: bool },
}

impl IcebergError {
    /// Whether trying again later may succeed (storage outages, races).
    pub fn is_retryable(&self) -> bool {
        match self {
            IcebergError::Storage(e) => !e.is_permanent(),
            IcebergError::Contended(_) => true,
            IcebergError::Batch { retryable, .. } => *retryable,
            _ => false,
        }
    }
}
