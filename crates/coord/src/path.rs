//! Path validation shared by every back-end, so bad input gets the same typed error
//! from all of them before anything is sent anywhere.

use crate::error::CoordError;

/// The largest request accepted, in bytes, as ZooKeeper encodes it on the wire
/// (see [`crate::multi_request_bytes`]).
///
/// ZooKeeper refuses any packet above `jute.maxbuffer` (1 MiB - 1 by default) by
/// dropping the connection, so the outcome of a too-large request would be
/// unknown; one KiB is kept in reserve, so every request accepted here is
/// accepted by a default ZooKeeper too.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024 - 1024;

/// What a request of one operation costs besides its path and data, at most: a
/// create sent as a one-operation multi (request header, multi headers, the
/// length prefixes of path and data, the open ACL and the flags; see
/// [`crate::multi_request_bytes`]).
pub const OP_OVERHEAD_BYTES: usize = 65;

/// The longest path accepted, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;

/// The largest node data accepted, in bytes: chosen so that a single operation
/// with the longest path and the largest data still fits in one request.
pub const MAX_DATA_BYTES: usize = MAX_REQUEST_BYTES - MAX_PATH_BYTES - OP_OVERHEAD_BYTES;

/// Width of the counter ZooKeeper appends to sequential nodes.
pub const SEQUENCE_DIGITS: usize = 10;

fn invalid(path: &str, reason: &'static str) -> CoordError {
    CoordError::InvalidPath {
        path: path.to_string(),
        reason,
    }
}

/// ZooKeeper's forbidden characters: controls, private use, specials, and every
/// character above U+FFFF (Java strings hold those as surrogate pairs, which
/// ZooKeeper refuses).
fn forbidden_char(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..)
}

/// Checks a version given to a conditional operation: never negative.
pub fn validate_version(path: &str, version: Option<i32>) -> Result<(), CoordError> {
    match version {
        Some(v) if v < 0 => Err(CoordError::InvalidVersion {
            path: path.to_string(),
            version: v,
        }),
        _ => Ok(()),
    }
}

/// Checks that `path` is an absolute node path: starts with `/`, has no empty, `.`
/// or `..` component, no trailing slash (except the root itself), no control or
/// private-use characters, and is at most [`MAX_PATH_BYTES`] long.
pub fn validate_path(path: &str) -> Result<(), CoordError> {
    if path.is_empty() {
        return Err(invalid(path, "empty path"));
    }
    if !path.starts_with('/') {
        return Err(invalid(path, "path must start with '/'"));
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(invalid(path, "path is longer than 4096 bytes"));
    }
    if path == "/" {
        return Ok(());
    }
    if path.ends_with('/') {
        return Err(invalid(path, "path must not end with '/'"));
    }
    if path.chars().any(forbidden_char) {
        return Err(invalid(
            path,
            "path contains a control or reserved character",
        ));
    }
    for component in path[1..].split('/') {
        match component {
            "" => return Err(invalid(path, "empty path component")),
            "." | ".." => return Err(invalid(path, "relative path component")),
            _ => {}
        }
    }
    Ok(())
}

/// Validates a path for a create: the path itself, or for sequential creates the
/// path with the sequence counter appended. The root cannot be created.
pub fn validate_create_path(path: &str, sequential: bool) -> Result<(), CoordError> {
    if sequential {
        validate_path(&format!("{path}{}", "0".repeat(SEQUENCE_DIGITS)))
            .map_err(|_| invalid(path, "invalid sequential node prefix"))?;
    } else {
        validate_path(path)?;
    }
    if path == "/" {
        return Err(invalid(path, "the root node cannot be created or deleted"));
    }
    Ok(())
}

/// Validates a path for a delete: the root cannot be deleted.
pub fn validate_delete_path(path: &str) -> Result<(), CoordError> {
    validate_path(path)?;
    if path == "/" {
        return Err(invalid(path, "the root node cannot be created or deleted"));
    }
    Ok(())
}

/// Checks the size of node data.
pub fn validate_data(data: &[u8]) -> Result<(), CoordError> {
    if data.len() > MAX_DATA_BYTES {
        return Err(CoordError::TooLarge {
            what: "node data",
            len: data.len(),
            max: MAX_DATA_BYTES,
        });
    }
    Ok(())
}

/// The parent of a valid non-root path.
pub fn parent(path: &str) -> &str {
    match path.rfind('/') {
        Some(0) | None => "/",
        Some(i) => &path[..i],
    }
}

/// The last component of a valid non-root path.
pub fn name(path: &str) -> &str {
    match path.rfind('/') {
        Some(i) => &path[i + 1..],
        None => path,
    }
}

/// Joins a valid parent path and a child name.
pub fn join(parent: &str, child: &str) -> String {
    if parent == "/" {
        format!("/{child}")
    } else {
        format!("{parent}/{child}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_good_paths() {
        for p in ["/", "/a", "/a/b", "/a.b/c-d_e", "/ü/日本", "/a/.b"] {
            validate_path(p).unwrap_or_else(|e| panic!("{p}: {e}"));
        }
    }

    #[test]
    fn refuses_bad_paths() {
        for p in [
            "",
            "a",
            "a/b",
            "//",
            "/a/",
            "/a//b",
            "/.",
            "/..",
            "/a/./b",
            "/a/../b",
            "/a\0b",
            "/a\u{1}",
            "/a\u{7f}",
            "/a\u{10000}",
            "/\u{1F600}",
            "/a/b\u{10FFFF}",
        ] {
            assert!(
                matches!(validate_path(p), Err(CoordError::InvalidPath { .. })),
                "{p:?} accepted"
            );
        }
        assert!(validate_path(&format!("/{}", "x".repeat(MAX_PATH_BYTES))).is_err());
    }

    #[test]
    fn create_and_delete_rules() {
        assert!(validate_create_path("/", false).is_err());
        assert!(validate_delete_path("/").is_err());
        validate_create_path("/q/", true).expect("sequential prefix may end in '/'");
        validate_create_path("/q/item-", true).expect("sequential prefix");
        assert!(validate_create_path("/q//", true).is_err());
        assert!(validate_create_path("/q/", false).is_err());
    }

    #[test]
    fn parents_and_names() {
        assert_eq!(parent("/a"), "/");
        assert_eq!(parent("/a/b/c"), "/a/b");
        assert_eq!(name("/a/b/c"), "c");
        assert_eq!(join("/", "a"), "/a");
        assert_eq!(join("/a", "b"), "/a/b");
    }

    #[test]
    fn data_limit() {
        validate_data(&vec![0; MAX_DATA_BYTES]).expect("at the limit");
        assert!(matches!(
            validate_data(&vec![0; MAX_DATA_BYTES + 1]),
            Err(CoordError::TooLarge { .. })
        ));
    }
}
