//! Local folders: the roots `file://` locations must lie in
//! ([`LocalRoots`]), and what an opened local folder needs besides its
//! store: the disk it is reached through, the check that it takes files at
//! all, and the removal of the staging files writes cut short left in it.

use std::sync::Arc;

use url::Url;

use crate::error::invalid;
use crate::{Location, StorageError};

/// The local folders `file://` locations that a request names may lie in:
/// a request can name any URL, and a node often runs with more rights than
/// its operator meant to hand out (as root, `file:///etc` would be written).
/// Each root is created and resolved (symbolic links followed) once, when
/// the node is configured; a location is accepted only when its folder, with
/// the links of its deepest existing ancestor followed, lies inside one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRoots(Vec<std::path::PathBuf>);

impl LocalRoots {
    /// Creates each root if missing and resolves it.
    pub fn new(
        roots: impl IntoIterator<Item = std::path::PathBuf>,
    ) -> Result<LocalRoots, StorageError> {
        let mut resolved = Vec::new();
        for root in roots {
            let io = |source| StorageError::Io {
                dir: root.display().to_string(),
                source,
            };
            // Created through the disk seam (the real disk: configuration,
            // before node code runs).
            ferry_env::RealDisk::open_root(&root).map_err(io)?;
            resolved.push(root.canonicalize().map_err(io)?);
        }
        Ok(LocalRoots(resolved))
    }

    pub fn roots(&self) -> &[std::path::PathBuf] {
        &self.0
    }

    /// Refuses a `file://` URL outside every root (other schemes pass).
    pub fn check(&self, url: &str) -> Result<(), StorageError> {
        let Some(rest) = url.strip_prefix("file://") else {
            return Ok(());
        };
        let refuse = |reason: String| invalid(url, reason);
        let parsed = Url::parse(url).map_err(|e| refuse(e.to_string()))?;
        let dir = parsed
            .to_file_path()
            .map_err(|()| refuse("not an absolute directory".into()))?;
        if rest.split('/').any(|seg| seg == "." || seg == "..") {
            return Err(refuse("relative path segment".into()));
        }
        // The deepest ancestor that exists, resolved: a link inside a root
        // that points outside it does not count as inside.
        let mut existing = dir.as_path();
        let resolved = loop {
            match existing.canonicalize() {
                Ok(r) => break r.join(dir.strip_prefix(existing).unwrap_or(existing)),
                Err(_) => match existing.parent() {
                    Some(p) => existing = p,
                    None => return Err(refuse("no existing ancestor".into())),
                },
            }
        };
        if self.0.iter().any(|root| resolved.starts_with(root)) {
            Ok(())
        } else {
            Err(refuse(format!(
                "a local destination must lie under an export root ({}); set --export-roots",
                self.0
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
    }
}

#[derive(Clone)]
pub(crate) struct LocalDir {
    disk: Arc<dyn ferry_env::Disk>,
    /// Whether files can be created in the folder, found by the first write
    /// (a read never touches it). A folder that refuses them (a pseudo file
    /// system such as `/proc`, read-only media) would send `object_store`'s
    /// local writer into an endless create-and-retry loop: writes are
    /// refused up front instead.
    writable: Arc<tokio::sync::OnceCell<Result<(), String>>>,
}

impl LocalDir {
    pub(crate) fn new(disk: Arc<dyn ferry_env::Disk>) -> LocalDir {
        LocalDir {
            disk,
            writable: Arc::default(),
        }
    }

    /// Creates and removes a probe file, once per location.
    async fn check_writable(&self) -> Result<(), String> {
        self.writable
            .get_or_init(|| async {
                let probe = format!(".ferry-write-probe-{}", std::process::id());
                match self.disk.create_new(&probe).await {
                    Ok(file) => {
                        drop(file);
                        self.disk
                            .remove_file(&probe)
                            .await
                            .map_err(|e| format!("cannot remove a file created in it: {e}"))
                    }
                    // Left by a writer of this process that was cut short.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
                    Err(e) => Err(format!("cannot create files in it: {e}")),
                }
            })
            .await
            .clone()
    }
}

impl std::fmt::Debug for LocalDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalDir")
    }
}

impl Location {
    /// Removes the staging files that writes of `keys` cut short left in a
    /// local folder (`<key>#<n>`: a process killed in the middle of a
    /// write), returning how many went. Readers never see them (listings
    /// skip them, `*.parquet` does not match them); this reclaims their
    /// space once every key is written. A write of one of the keys still
    /// under way loses its staging file and fails (to be retried), so call
    /// it only when the keys are final. Nothing to do elsewhere: an S3
    /// multipart upload cut short is removed by the bucket's
    /// `AbortIncompleteMultipartUpload` lifecycle rule.
    pub async fn remove_staging_of(&self, keys: &[String]) -> Result<usize, StorageError> {
        let Some(LocalDir { disk, .. }) = &self.local else {
            return Ok(0);
        };
        let mut by_dir: std::collections::BTreeMap<&str, std::collections::BTreeSet<&str>> =
            Default::default();
        for key in keys {
            self.key(key)?;
            let (dir, name) = key.rsplit_once('/').unwrap_or(("", key.as_str()));
            by_dir.entry(dir).or_default().insert(name);
        }
        let io = |dir: &str, source| StorageError::Io {
            dir: format!("{}/{dir}", self.url),
            source,
        };
        let mut removed = 0;
        for (dir, names) in by_dir {
            // The directory on disk: the prefix (a child location's folders)
            // and the keys' own folders.
            let dir = [self.prefix.as_ref(), dir]
                .into_iter()
                .filter(|d| !d.is_empty())
                .collect::<Vec<_>>()
                .join("/");
            let dir = dir.as_str();
            let listed = match disk.list_dir(if dir.is_empty() { "." } else { dir }).await {
                Ok(l) => l,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(dir, e)),
            };
            for entry in listed {
                let Some((name, n)) = entry.split_once('#') else {
                    continue;
                };
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || !names.contains(name) {
                    continue;
                }
                let path = if dir.is_empty() {
                    entry.clone()
                } else {
                    format!("{dir}/{entry}")
                };
                match disk.remove_file(&path).await {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io(dir, e)),
                }
            }
        }
        Ok(removed)
    }

    /// Refuses writes to a local folder that takes no files.
    pub(crate) async fn check_writable(&self) -> Result<(), StorageError> {
        match &self.local {
            Some(local) => {
                local
                    .check_writable()
                    .await
                    .map_err(|reason| StorageError::NotWritable {
                        url: self.url.clone(),
                        reason,
                    })
            }
            None => Ok(()),
        }
    }
}
