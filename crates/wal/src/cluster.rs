//! The identity of a cluster: every safekeeper's control file and the
//! coordination store record it, so that parts of two clusters (or a part
//! that was wiped and recreated) are never mistaken for each other.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Longest cluster id accepted.
pub const MAX_CLUSTER_ID_BYTES: usize = 64;

/// A cluster's name: 1 to 64 ASCII letters, digits, `-` and `_`, so that it is
/// safe in file names, coordination paths and logs. `ferry dev` draws a random
/// one when it creates a data dir; a distributed deployment names its own.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ClusterId(String);

/// Why a string is not a cluster id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a cluster id (1 to 64 of A-Z, a-z, 0-9, '-' and '_')")]
pub struct InvalidClusterId(pub String);

impl ClusterId {
    pub fn new(id: impl Into<String>) -> Result<ClusterId, InvalidClusterId> {
        let id = id.into();
        let valid = !id.is_empty()
            && id.len() <= MAX_CLUSTER_ID_BYTES
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if valid {
            Ok(ClusterId(id))
        } else {
            Err(InvalidClusterId(id))
        }
    }

    /// A cluster id made of 128 random bits (hex).
    pub fn from_random(bits: u128) -> ClusterId {
        ClusterId(format!("{bits:032x}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for ClusterId {
    type Err = InvalidClusterId;

    fn from_str(s: &str) -> Result<ClusterId, InvalidClusterId> {
        ClusterId::new(s)
    }
}

impl TryFrom<String> for ClusterId {
    type Error = InvalidClusterId;

    fn try_from(s: String) -> Result<ClusterId, InvalidClusterId> {
        ClusterId::new(s)
    }
}

impl From<ClusterId> for String {
    fn from(id: ClusterId) -> String {
        id.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_safe_names() {
        assert!(ClusterId::new("prod-eu_1").is_ok());
        assert_eq!(ClusterId::from_random(255).as_str().len(), 32);
        for bad in ["", "a/b", "..", "a b", "é", &"x".repeat(65)] {
            assert!(ClusterId::new(bad).is_err(), "{bad:?}");
        }
        // Decoding checks too: a damaged id never gets in through serde.
        let bytes = postcard::to_allocvec(&"a/b".to_string()).expect("encode");
        assert!(postcard::from_bytes::<ClusterId>(&bytes).is_err());
    }
}
