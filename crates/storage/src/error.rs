//! Why a location could not be opened, a key built or an operation done, and
//! which of those failures are permanent.

use object_store::path::Path as ObjectPath;

/// Why a location could not be opened or a key built.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("invalid storage URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("unsupported storage scheme {scheme:?} in {url:?} (expected file:// or s3://)")]
    UnsupportedScheme { url: String, scheme: String },
    #[error("invalid object key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },
    #[error("local storage directory {dir}: {source}")]
    Io {
        dir: String,
        #[source]
        source: std::io::Error,
    },
    /// A create-only write found the key taken: another writer got there
    /// first (its object stays as it was).
    #[error("object {key} already exists")]
    AlreadyExists { key: String },
    #[error("object {key} not found")]
    NotFound { key: String },
    /// A local folder that does not take files: nothing is written.
    #[error("{url} is not a writable folder: {reason}")]
    NotWritable { url: String, reason: String },
    #[error(transparent)]
    ObjectStore(#[from] object_store::Error),
}

impl StorageError {
    /// Whether retrying the same request can never succeed (a bad URL or
    /// key, an operation the store does not offer), as opposed to a failure
    /// of the moment (network, throttling, a server error). Callers decide
    /// retries on this, never on `object_store`'s variants.
    pub fn is_permanent(&self) -> bool {
        match self {
            StorageError::InvalidUrl { .. }
            | StorageError::UnsupportedScheme { .. }
            | StorageError::InvalidKey { .. } => true,
            StorageError::ObjectStore(e) => matches!(
                e,
                object_store::Error::NotImplemented { .. }
                    | object_store::Error::NotSupported { .. }
                    | object_store::Error::InvalidPath { .. }
            ),
            StorageError::Io { .. }
            | StorageError::AlreadyExists { .. }
            | StorageError::NotFound { .. }
            | StorageError::NotWritable { .. } => false,
        }
    }

    pub(crate) fn about(e: object_store::Error, key: &ObjectPath) -> StorageError {
        match e {
            object_store::Error::AlreadyExists { .. } => StorageError::AlreadyExists {
                key: key.to_string(),
            },
            object_store::Error::NotFound { .. } => StorageError::NotFound {
                key: key.to_string(),
            },
            other => StorageError::ObjectStore(other),
        }
    }
}

pub(crate) fn invalid(url: &str, reason: impl Into<String>) -> StorageError {
    StorageError::InvalidUrl {
        url: url.to_string(),
        reason: reason.into(),
    }
}
