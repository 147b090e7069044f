//! Opening a location from its URL: relative segments, queries, fragments
//! and credentials refused before anything else, then a `file://` folder
//! created and opened, or an `s3://` bucket and prefix checked (the network
//! is not touched until the first request).

use std::sync::Arc;

use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use url::Url;

use crate::error::invalid;
use crate::local::LocalDir;
use crate::{check_segment, Location, S3Settings, StorageError};

pub(crate) fn parse_prefix(url: &str, raw: &str) -> Result<ObjectPath, StorageError> {
    let trimmed = raw.trim_matches('/');
    if trimmed.is_empty() {
        return Ok(ObjectPath::default());
    }
    for segment in trimmed.split('/') {
        check_segment(segment).map_err(|reason| invalid(url, format!("prefix: {reason}")))?;
    }
    ObjectPath::parse(trimmed).map_err(|e| invalid(url, e.to_string()))
}

/// S3 bucket naming rules (the subset that matters for safety and for servers
/// that enforce them): 3 to 63 characters of lowercase letters, digits, `.` and
/// `-`, starting and ending with a letter or digit.
fn check_bucket(url: &str, bucket: &str) -> Result<(), StorageError> {
    let ok_len = (3..=63).contains(&bucket.len());
    let ok_chars = bucket
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    let ok_ends = bucket
        .bytes()
        .next()
        .zip(bucket.bytes().last())
        .is_some_and(|(a, z)| a.is_ascii_alphanumeric() && z.is_ascii_alphanumeric());
    if ok_len && ok_chars && ok_ends {
        Ok(())
    } else {
        Err(invalid(
            url,
            format!("bucket {bucket:?} must be 3-63 lowercase letters, digits, '.' or '-'"),
        ))
    }
}

/// Opens a location. `file:///dir` creates the directory if missing; `s3://` does
/// not touch the network until the first request.
pub fn open(url: &str, s3: &S3Settings) -> Result<Location, StorageError> {
    // The URL parser would quietly resolve `a/../b`; a location must say exactly
    // where it is, so relative segments are refused before parsing.
    let raw_path = url.split_once("://").map_or(url, |(_, rest)| rest);
    if raw_path.split('/').any(|seg| {
        let seg = seg.to_ascii_lowercase().replace("%2e", ".");
        seg == "." || seg == ".."
    }) {
        return Err(invalid(url, "relative path segment"));
    }
    let parsed = Url::parse(url).map_err(|e| invalid(url, e.to_string()))?;
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(invalid(url, "query strings and fragments are not allowed"));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(invalid(url, "credentials do not belong in the URL"));
    }
    match parsed.scheme() {
        "file" => {
            if parsed
                .host_str()
                .is_some_and(|h| !h.is_empty() && h != "localhost")
            {
                return Err(invalid(
                    url,
                    "file URLs name a local directory: file:///dir",
                ));
            }
            let dir = parsed
                .to_file_path()
                .map_err(|()| invalid(url, "not an absolute directory"))?;
            for segment in parsed
                .path()
                .trim_matches('/')
                .split('/')
                .filter(|s| !s.is_empty())
            {
                check_segment(segment).map_err(|reason| invalid(url, reason))?;
            }
            // Opening a location is configuration, done once before node code
            // runs (the simulator uses in-memory stores instead). The disk
            // creates the directory, which `LocalFileSystem` needs.
            let disk = ferry_env::RealDisk::open_root(&dir).map_err(|source| StorageError::Io {
                dir: dir.display().to_string(),
                source,
            })?;
            let store = LocalFileSystem::new_with_prefix(&dir)?;
            Ok(Location {
                url: url.to_string(),
                store: Arc::new(store),
                prefix: ObjectPath::default(),
                local: Some(LocalDir::new(Arc::new(disk))),
            })
        }
        "s3" => {
            let bucket = parsed.host_str().unwrap_or_default();
            check_bucket(url, bucket)?;
            let prefix = parse_prefix(url, parsed.path())?;
            let builder = s3.builder(bucket);
            Ok(Location {
                url: url.to_string(),
                store: Arc::new(builder.build()?),
                prefix,
                local: None,
            })
        }
        scheme => Err(StorageError::UnsupportedScheme {
            url: url.to_string(),
            scheme: scheme.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_urls() {
        let s3 = S3Settings::default();
        for url in [
            "relative/dir",
            "http://host/x",
            "gs://bucket/x",
            "s3://ab/x",
            "s3://Bad_Bucket/x",
            "s3://bucket/a/../b",
            "s3://bucket/a/%2E%2E/b",
            "file:///tmp/a/../b",
            "s3://bucket/a//b",
            "s3://bucket/x?versionId=1",
            "s3://user:pw@bucket/x",
            "file://otherhost/dir",
        ] {
            assert!(open(url, &s3).is_err(), "{url} accepted");
        }
        assert!(matches!(
            open("gs://bucket/x", &s3),
            Err(StorageError::UnsupportedScheme { .. })
        ));
    }
}
