//! Object storage locations: a URL (`file:///dir` or `s3://bucket/prefix`) opened as
//! an `object_store` store plus a key prefix.
//!
//! This is the only way ferry reaches object storage (export destinations, WAL
//! backup). A [`Location`] hands out no store and no prefix: every operation
//! takes a key relative to the location, checked so that it can never escape
//! it. Writes are create-only when asked ([`Location::put_create`]: first
//! write wins, a second one is [`StorageError::AlreadyExists`]), and large
//! objects are streamed ([`Location::upload`]) within a fixed memory budget.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart};
use url::Url;

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

    fn about(e: object_store::Error, key: &ObjectPath) -> StorageError {
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

/// S3 connection settings. Anything left `None` comes from the AWS
/// variables in `aws_env` (`AWS_ENDPOINT_URL`, `AWS_REGION`,
/// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, the
/// web-identity and container credential variables, ...): the binary reads
/// the process environment once, at its edge ([`S3Settings::with_aws_env`]),
/// so this library never does and a test states all it uses.
#[derive(Clone, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct S3Settings {
    /// Endpoint of an S3-compatible server, e.g. `http://127.0.0.1:9000`; path-style
    /// requests are used when it is set.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    /// `AWS_*` variables (name, value), applied as `object_store` reads them.
    #[serde(skip)]
    pub aws_env: Vec<(String, String)>,
}

impl S3Settings {
    /// Adds the `AWS_*` variables among `vars` (the process environment,
    /// read by the binary).
    pub fn with_aws_env(mut self, vars: impl IntoIterator<Item = (String, String)>) -> Self {
        self.aws_env
            .extend(vars.into_iter().filter(|(k, _)| k.starts_with("AWS_")));
        self
    }

    fn aws_var(&self, name: &str) -> Option<&str> {
        self.aws_env
            .iter()
            .find(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.as_str())
    }
}

/// Secrets stay out of logs and error messages.
impl std::fmt::Debug for S3Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redact = |v: &Option<String>| v.as_ref().map(|_| "<set>");
        f.debug_struct("S3Settings")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &redact(&self.access_key_id))
            .field("secret_access_key", &redact(&self.secret_access_key))
            .field("session_token", &redact(&self.session_token))
            .field(
                "aws_env",
                &self.aws_env.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// An opened location. Its store and prefix are private: a key outside the
/// location cannot even be named.
#[derive(Debug, Clone)]
pub struct Location {
    url: String,
    store: Arc<dyn ObjectStore>,
    /// The key prefix inside the store ("" for the whole store).
    prefix: ObjectPath,
    /// A local folder's root directory (the store's root, so a key's file
    /// is at `<prefix>/<key>` in it), through the disk seam: where the files
    /// `object_store` stages a write in (`<key>#<n>`, renamed or linked into
    /// place when the write completes) can be found and removed.
    local: Option<LocalDir>,
}

#[derive(Clone)]
struct LocalDir {
    disk: Arc<dyn ferry_env::Disk>,
    /// Whether files can be created in the folder, found by the first write
    /// (a read never touches it). A folder that refuses them (a pseudo file
    /// system such as `/proc`, read-only media) would send `object_store`'s
    /// local writer into an endless create-and-retry loop: writes are
    /// refused up front instead.
    writable: Arc<tokio::sync::OnceCell<Result<(), String>>>,
}

impl LocalDir {
    fn new(disk: Arc<dyn ferry_env::Disk>) -> LocalDir {
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

/// How a streamed upload uses memory: at most `part_bytes × (max_in_flight +
/// 1)` bytes are held at once, whatever the size of the object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadBudget {
    /// Size of each part (S3 needs at least 5 MiB but for the last one).
    pub part_bytes: usize,
    /// Parts being uploaded at once.
    pub max_in_flight: usize,
}

impl Default for UploadBudget {
    fn default() -> Self {
        UploadBudget {
            part_bytes: 8 << 20,
            max_in_flight: 2,
        }
    }
}

impl UploadBudget {
    /// The most memory an upload with this budget holds.
    pub fn max_bytes(&self) -> usize {
        self.part_bytes * (self.max_in_flight + 1)
    }
}

/// A streamed multipart upload to one key: nothing is visible at the key
/// until [`Upload::finish`]; dropped or [`Upload::abort`]ed, it leaves no
/// object. (Multipart uploads have no create-only mode on S3: a key written by
/// an upload must be one whose contents are determined by its name.)
pub struct Upload {
    key: ObjectPath,
    writer: WriteMultipart,
    budget: UploadBudget,
    written: u64,
}

impl Upload {
    /// Adds `bytes` to the object, a part at a time, waiting while the budget
    /// is spent (the caller's buffer itself is the caller's to bound).
    pub async fn write(&mut self, mut bytes: Bytes) -> Result<(), StorageError> {
        while !bytes.is_empty() {
            self.writer
                .wait_for_capacity(self.budget.max_in_flight)
                .await
                .map_err(|e| StorageError::about(e, &self.key))?;
            let piece = bytes.split_to(bytes.len().min(self.budget.part_bytes.max(1)));
            self.written += piece.len() as u64;
            self.writer.put(piece);
        }
        Ok(())
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Completes the upload: the object appears whole, or not at all.
    pub async fn finish(self) -> Result<(), StorageError> {
        let key = self.key;
        self.writer
            .finish()
            .await
            .map(drop)
            .map_err(|e| StorageError::about(e, &key))
    }

    /// Gives up: the parts already sent are discarded.
    pub async fn abort(self) -> Result<(), StorageError> {
        let key = self.key;
        self.writer
            .abort()
            .await
            .map_err(|e| StorageError::about(e, &key))
    }
}

fn invalid(url: &str, reason: impl Into<String>) -> StorageError {
    StorageError::InvalidUrl {
        url: url.to_string(),
        reason: reason.into(),
    }
}

/// Checks one key component: non-empty, not `.`/`..`, no control characters and
/// no characters that object_store would encode away or that mean something to a
/// file system.
fn check_segment(segment: &str) -> Result<(), &'static str> {
    if segment.is_empty() {
        return Err("empty path segment");
    }
    if segment == "." || segment == ".." {
        return Err("relative path segment");
    }
    if segment.chars().any(|c| c.is_control() || c == '\\') {
        return Err("control character or backslash");
    }
    Ok(())
}

fn parse_prefix(url: &str, raw: &str) -> Result<ObjectPath, StorageError> {
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
            // Every upload carries its SHA-256 (`x-amz-checksum-sha256`, per
            // part for multipart uploads): S3 refuses bytes that changed on
            // the way, and stores the checksum with the object.
            let mut builder = AmazonS3Builder::new();
            for (name, value) in &s3.aws_env {
                if let Ok(key) = name.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                    builder = builder.with_config(key, value);
                }
            }
            let mut builder = builder
                .with_bucket_name(bucket)
                .with_checksum_algorithm(object_store::aws::Checksum::SHA256);
            if let Some(endpoint) = &s3.endpoint {
                builder = builder
                    .with_endpoint(endpoint)
                    .with_allow_http(endpoint.starts_with("http://"));
            } else if let Some(endpoint) = ["AWS_ENDPOINT_URL", "AWS_ENDPOINT"]
                .iter()
                .find_map(|k| s3.aws_var(k))
            {
                // Both names set the endpoint (object_store reads them);
                // plain HTTP is allowed only for an endpoint that says so.
                builder = builder
                    .with_endpoint(endpoint)
                    .with_allow_http(endpoint.starts_with("http://"));
            }
            if let Some(region) = &s3.region {
                builder = builder.with_region(region);
            }
            if let Some(key) = &s3.access_key_id {
                builder = builder.with_access_key_id(key);
            }
            if let Some(secret) = &s3.secret_access_key {
                builder = builder.with_secret_access_key(secret);
            }
            if let Some(token) = &s3.session_token {
                builder = builder.with_token(token);
            }
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

impl Location {
    /// A location over a store made elsewhere (the simulator's faulty
    /// in-memory store), under `prefix` (checked like a URL's path).
    pub fn from_store(
        url: &str,
        store: Arc<dyn ObjectStore>,
        prefix: &str,
    ) -> Result<Location, StorageError> {
        Ok(Location {
            url: url.to_string(),
            prefix: parse_prefix(url, prefix)?,
            store,
            local: None,
        })
    }

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

    /// The location of the folder `name` inside this one (one key segment,
    /// checked like any): one owner's share of a location that several
    /// share, which cannot name the others' keys.
    pub fn child(&self, name: &str) -> Result<Location, StorageError> {
        let not_a_folder = || {
            invalid(
                &self.url,
                format!("{name:?} is not a folder name (one key segment)"),
            )
        };
        if name.contains('/') {
            return Err(not_a_folder());
        }
        let prefix = self.key(name).map_err(|_| not_a_folder())?;
        Ok(Location {
            url: format!("{}/{name}", self.url.trim_end_matches('/')),
            store: Arc::clone(&self.store),
            prefix,
            local: self.local.clone(),
        })
    }

    /// Refuses writes to a local folder that takes no files.
    async fn check_writable(&self) -> Result<(), StorageError> {
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

    /// The URL the location was opened from.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Writes `data` at `key` unless something is there already: the first
    /// write wins, later ones get [`StorageError::AlreadyExists`] and change
    /// nothing (S3 `If-None-Match: *`; an atomic link on a local directory).
    pub async fn put_create(&self, key: &str, data: Bytes) -> Result<(), StorageError> {
        let key = self.key(key)?;
        self.check_writable().await?;
        self.store
            .put_opts(
                &key,
                PutPayload::from(data),
                PutOptions::from(PutMode::Create),
            )
            .await
            .map(drop)
            .map_err(|e| StorageError::about(e, &key))
    }

    /// Writes `data` at `key`, replacing what is there.
    pub async fn put(&self, key: &str, data: Bytes) -> Result<(), StorageError> {
        let key = self.key(key)?;
        self.check_writable().await?;
        self.store
            .put(&key, PutPayload::from(data))
            .await
            .map(drop)
            .map_err(|e| StorageError::about(e, &key))
    }

    /// Starts a streamed upload to `key` within `budget`.
    pub async fn upload(&self, key: &str, budget: UploadBudget) -> Result<Upload, StorageError> {
        let key = self.key(key)?;
        self.check_writable().await?;
        let upload = self
            .store
            .put_multipart(&key)
            .await
            .map_err(|e| StorageError::about(e, &key))?;
        Ok(Upload {
            writer: WriteMultipart::new_with_chunk_size(upload, budget.part_bytes.max(1)),
            key,
            budget,
            written: 0,
        })
    }

    /// The whole object at `key`.
    pub async fn get(&self, key: &str) -> Result<Bytes, StorageError> {
        let key = self.key(key)?;
        let result = self
            .store
            .get(&key)
            .await
            .map_err(|e| StorageError::about(e, &key))?;
        result
            .bytes()
            .await
            .map_err(|e| StorageError::about(e, &key))
    }

    /// Bytes `range` of the object at `key`.
    pub async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, StorageError> {
        let key = self.key(key)?;
        self.store
            .get_range(&key, range)
            .await
            .map_err(|e| StorageError::about(e, &key))
    }

    /// The size of the object at `key`, or `None` if there is none.
    pub async fn size(&self, key: &str) -> Result<Option<u64>, StorageError> {
        let key = self.key(key)?;
        match self.store.head(&key).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(StorageError::about(e, &key)),
        }
    }

    /// Deletes the object at `key` (no error if there is none).
    pub async fn delete(&self, key: &str) -> Result<(), StorageError> {
        let key = self.key(key)?;
        match self.store.delete(&key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(StorageError::about(e, &key)),
        }
    }

    /// Keys under `dir` (relative to the location, "" for all of it) with their
    /// sizes, sorted.
    pub async fn list(&self, dir: &str) -> Result<Vec<(String, u64)>, StorageError> {
        let base = if dir.is_empty() {
            self.prefix.clone()
        } else {
            self.key(dir)?
        };
        let mut out: Vec<(String, u64)> = self
            .store
            .list(Some(&base))
            .map_ok(|meta| self.entry(&meta))
            .try_collect()
            .await
            .map_err(|e| StorageError::about(e, &base))?;
        out.sort();
        Ok(out)
    }

    /// The objects directly in the location's top folder (not in its
    /// subfolders), with their sizes, sorted: a commit listing that does
    /// not walk every data file.
    pub async fn list_top(&self) -> Result<Vec<(String, u64)>, StorageError> {
        let listed = self
            .store
            .list_with_delimiter(Some(&self.prefix))
            .await
            .map_err(|e| StorageError::about(e, &self.prefix))?;
        let mut out: Vec<(String, u64)> =
            listed.objects.iter().map(|meta| self.entry(meta)).collect();
        out.sort();
        Ok(out)
    }

    /// A listed object as its key relative to the location, and its size.
    fn entry(&self, meta: &object_store::ObjectMeta) -> (String, u64) {
        let rel: Vec<String> = meta
            .location
            .parts()
            .skip(self.prefix.parts().count())
            .map(|p| p.as_ref().to_string())
            .collect();
        (rel.join("/"), meta.size)
    }

    /// The full key of `relative` (segments separated by `/`) under the prefix.
    /// Empty, `.` and `..` segments, backslashes and control characters are refused,
    /// so a key can never leave the location.
    pub fn key(&self, relative: &str) -> Result<ObjectPath, StorageError> {
        let bad = |reason| StorageError::InvalidKey {
            key: relative.to_string(),
            reason,
        };
        if relative.is_empty() {
            return Err(bad("empty key"));
        }
        let mut key = self.prefix.clone();
        for segment in relative.split('/') {
            check_segment(segment).map_err(bad)?;
            key = key.join(segment);
        }
        Ok(key)
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

    #[test]
    fn s3_settings_take_aws_variables_as_data_and_hide_secrets() {
        let s3 = S3Settings::default().with_aws_env([
            (
                "AWS_ENDPOINT_URL".to_string(),
                "http://127.0.0.1:1".to_string(),
            ),
            ("AWS_SECRET_ACCESS_KEY".to_string(), "hunter2".to_string()),
            ("AWS_ACCESS_KEY_ID".to_string(), "key".to_string()),
            ("HOME".to_string(), "/root".to_string()),
        ]);
        assert_eq!(s3.aws_env.len(), 3, "only AWS_ variables: {s3:?}");
        assert_eq!(s3.aws_var("AWS_ENDPOINT_URL"), Some("http://127.0.0.1:1"));
        let shown = format!("{s3:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        let with_key = S3Settings {
            secret_access_key: Some("hunter3".into()),
            ..S3Settings::default()
        };
        assert!(!format!("{with_key:?}").contains("hunter3"));
        // The credentials come from the variables (without them the store
        // refuses to open: MissingAccessKeyId).
        open("s3://bucket/p", &s3).expect("open with credentials from the variables");
        assert!(open("s3://bucket/p", &with_key).is_err());
    }

    #[test]
    fn s3_prefix_and_keys() {
        let s3 = S3Settings {
            endpoint: Some("http://127.0.0.1:1".into()),
            region: Some("us-east-1".into()),
            access_key_id: Some("k".into()),
            secret_access_key: Some("s".into()),
            ..S3Settings::default()
        };
        let loc = open("s3://lake-bucket/exports/2026/", &s3).expect("open");
        assert_eq!(loc.prefix.as_ref(), "exports/2026");
        assert_eq!(loc.url(), "s3://lake-bucket/exports/2026/");
        let key = loc.key("date=2026-01-01/p_1_1_0.parquet").expect("key");
        assert_eq!(key.as_ref(), "exports/2026/date=2026-01-01/p_1_1_0.parquet");
        for bad in ["", "../x", "a//b", "a/./b", "a\\b", "/abs"] {
            assert!(
                matches!(loc.key(bad), Err(StorageError::InvalidKey { .. })),
                "{bad:?}"
            );
        }
    }
}
