//! The TOML configuration file (`--config FILE`, every role).
//!
//! A file has one table per role (`[dev]`, `[safekeeper]`, `[writer]`) and an
//! `[api]` table shared by the roles that serve the insert API. Every key is a
//! command-line flag of that role with `_` for `-`; the file is checked against
//! typed tables, so an unknown key or a value of the wrong type is an error
//! naming the key. Precedence: a flag on the command line, then its
//! environment variable, then the file, then the built-in default. It is
//! applied by turning the file's settings into flags placed before the
//! command line's own, for those flags the command line and the environment do
//! not set, so that clap checks every value the same way whatever its source.

use std::ffi::OsString;
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// Every setting, as a file holds it.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub dev: Option<DevSection>,
    pub safekeeper: Option<SafekeeperSection>,
    pub writer: Option<WriterSection>,
    pub replica: Option<ReplicaSection>,
    pub api: Option<ApiSection>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSection {
    pub cluster_id: Option<String>,
    pub shard: Option<u32>,
    pub replica: Option<u32>,
    pub safekeepers: Option<Vec<String>>,
    pub zookeeper: Option<String>,
    pub data_dir: Option<String>,
    pub http: Option<String>,
    pub api_token: Option<String>,
    pub export_roots: Option<Vec<String>>,
    pub lake_target_file_mib: Option<u64>,
    pub bootstrap_from: Option<String>,
    pub bootstrap_check: Option<String>,
    pub min_free_disk: Option<String>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DevSection {
    pub data_dir: Option<String>,
    pub http: Option<String>,
    pub safekeepers: Option<u64>,
    pub segment_bytes: Option<u64>,
    pub wal_preallocation: Option<String>,
    pub export_roots: Option<Vec<String>>,
    pub lake_target_file_mib: Option<u64>,
    pub replicas: Option<u32>,
    pub wal_backup: Option<String>,
    pub wal_backup_parallel_jobs: Option<u64>,
    pub walsenders_keep_horizon: Option<bool>,
    pub wal_removal_interval: Option<String>,
    pub keep_all_wal: Option<bool>,
    pub partial_backup_enabled: Option<bool>,
    pub partial_backup_timeout: Option<String>,
    pub restore_quarantine: Option<String>,
    pub replica_expiry: Option<String>,
    pub min_free_disk: Option<String>,
    pub max_replication_write_lag: Option<u64>,
    pub max_replication_flush_lag: Option<u64>,
    pub max_replication_apply_lag: Option<u64>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SafekeeperSection {
    pub id: Option<u64>,
    pub cluster_id: Option<String>,
    pub create: Option<bool>,
    pub listen: Option<String>,
    pub data_dir: Option<String>,
    pub segment_bytes: Option<u64>,
    pub wal_preallocation: Option<String>,
    pub http: Option<String>,
    pub restore_from_backup: Option<bool>,
    pub pull_from_peers: Option<Vec<String>>,
    pub zookeeper: Option<String>,
    pub wal_backup: Option<String>,
    pub wal_backup_parallel_jobs: Option<u64>,
    pub walsenders_keep_horizon: Option<bool>,
    pub wal_removal_interval: Option<String>,
    pub keep_all_wal: Option<bool>,
    pub partial_backup_enabled: Option<bool>,
    pub partial_backup_timeout: Option<String>,
    pub restore_quarantine: Option<String>,
    pub replica_expiry: Option<String>,
    pub min_free_disk: Option<String>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WriterSection {
    pub cluster_id: Option<String>,
    pub safekeepers: Option<Vec<String>>,
    pub segment_bytes: Option<u64>,
    pub http: Option<String>,
    pub zookeeper: Option<String>,
    pub max_replication_write_lag: Option<u64>,
    pub max_replication_flush_lag: Option<u64>,
    pub max_replication_apply_lag: Option<u64>,
    pub replica_expiry: Option<String>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApiSection {
    pub api_token: Option<String>,
    pub max_body_bytes: Option<u64>,
    pub max_rows: Option<u64>,
    pub max_concurrent_inserts: Option<u64>,
    pub commit_timeout_secs: Option<u64>,
}

/// A file with every setting, its default and what it does.
pub const EXAMPLE: &str = r#"# ferry configuration file: `ferry <role> --config ferry.toml`.
# Every setting is optional. A flag on the command line wins over its
# environment variable, which wins over this file, which wins over the default
# shown here. Unknown keys are an error.

[dev]
# Data directory (coordination store, WAL, object storage). Env: FERRY_DATA_DIR.
data_dir = "ferry-data"
# HTTP endpoint: /status, /metrics, /tables and inserts.
http = "127.0.0.1:7878"
# Safekeepers of a new data dir; an existing one keeps its own number.
safekeepers = 3
# WAL segment size in bytes of a new data dir (a power of two, 64 KiB to 1 GiB).
segment_bytes = 16777216
# When WAL segments are zero-filled ahead of time: "auto", "always" or "never".
wal_preallocation = "auto"
# Folders a file:// export destination must lie in (default: <data_dir>/lake).
# Env: FERRY_EXPORT_ROOTS.
# export_roots = ["/srv/lake"]
# The size (MiB) a table that exports itself makes its lake files near to:
# idle partitions' small parts are merged up to it, and the lake follows.
lake_target_file_mib = 128
# Replicas, each holding every shard: 2, or 1 (not with --demo).
replicas = 2
# Where whole WAL segments are backed up: "file:///dir" or "s3://bucket/prefix"
# (S3 settings from the AWS_* variables). Env: FERRY_WAL_BACKUP.
# wal_backup = "s3://backups/ferry"
# Segment uploads in flight.
wal_backup_parallel_jobs = 5
# Keep the WAL the slowest active walsender has not sent yet.
walsenders_keep_horizon = false
# How often segments behind every consumer are removed.
wal_removal_interval = "5s"
# Never remove WAL segments locally.
keep_all_wal = false
# Also back up the flushed prefix of the segment being written (needs wal_backup).
partial_backup_enabled = false
# How long flush_lsn must stay in one segment before its prefix is uploaded.
partial_backup_timeout = "15m"
# How long a safekeeper restored from the backup waits before a writer may
# bring it back (above every writer's election timeout, 3 s).
restore_quarantine = "10s"
# A replica whose feedback has not changed for this long no longer holds WAL
# removal or back-pressure (it reads removed WAL from the backup if it comes back).
replica_expiry = "1day"
# Appends are refused (inserts answer 503 disk_full) while less than this is
# free on the data dir's file system; taken again once an eighth more is free.
min_free_disk = "1GiB"
# Inserts wait while the end of WAL is this many bytes ahead of what the
# slowest replica received / made durable / applied remotely (0: no limit).
max_replication_write_lag = 0
max_replication_flush_lag = 0
max_replication_apply_lag = 0

[safekeeper]
# Id of this safekeeper, unique in its quorum (required).
# id = 0
# The cluster it belongs to (required). Env: FERRY_CLUSTER_ID.
# cluster_id = "prod"
# Create the safekeeper if its data dir holds none: for a new member only.
create = false
# Address writers and replicas connect to.
listen = "127.0.0.1:5454"
# Data directory (the safekeeper lives in <data_dir>/sk<id>). Env: FERRY_DATA_DIR.
# data_dir = "/var/lib/ferry"
# WAL segment size in bytes; the same on every safekeeper and the writer.
segment_bytes = 16777216
wal_preallocation = "auto"
# HTTP endpoint: /status and /metrics.
http = "127.0.0.1:7676"
# Rebuild the safekeeper from wal_backup if its data dir holds no control
# file (its data was lost); with one present it starts as it is.
restore_from_backup = false
# Rebuild the safekeeper from one of these peers if its data dir holds no
# control file: only the WAL above their removal horizon is copied.
# pull_from_peers = ["10.0.0.2:5454", "10.0.0.3:5454"]
# ZooKeeper holding the safekeeper configuration (ferry safekeeper-set): a
# safekeeper with no control file that it names is pulled from the other
# members by itself. Env: FERRY_ZOOKEEPER.
# zookeeper = "10.0.0.9:2181/ferry"
# Where whole WAL segments are backed up: "file:///dir" or "s3://bucket/prefix"
# (S3 settings from the AWS_* variables). Env: FERRY_WAL_BACKUP.
# wal_backup = "s3://backups/ferry"
# Segment uploads in flight.
wal_backup_parallel_jobs = 5
# Keep the WAL the slowest active walsender has not sent yet.
walsenders_keep_horizon = false
# How often segments behind every consumer are removed.
wal_removal_interval = "5s"
# Never remove WAL segments locally.
keep_all_wal = false
# Also back up the flushed prefix of the segment being written (needs wal_backup).
partial_backup_enabled = false
# How long flush_lsn must stay in one segment before its prefix is uploaded.
partial_backup_timeout = "15m"
# How long a safekeeper restored from the backup waits before a writer may
# bring it back (above every writer's election timeout, 3 s).
restore_quarantine = "10s"
# A replica whose feedback has not changed for this long no longer holds WAL
# removal or back-pressure (it reads removed WAL from the backup if it comes back).
replica_expiry = "1day"
# Appends are refused (inserts answer 503 disk_full) while less than this is
# free on the data dir's file system; taken again once an eighth more is free.
min_free_disk = "1GiB"

[writer]
# The cluster whose safekeepers it writes to (required). Env: FERRY_CLUSTER_ID.
# cluster_id = "prod"
# Safekeeper addresses, in the same order for every writer (required).
# safekeepers = ["10.0.0.1:5454", "10.0.0.2:5454", "10.0.0.3:5454"]
segment_bytes = 16777216
# HTTP endpoint: /status, /metrics, and with zookeeper set, /tables and inserts.
http = "127.0.0.1:7677"
# ZooKeeper ensemble host:port[,host:port...][/chroot] holding the cluster
# record, the last known commit and the table catalog. Env: FERRY_ZOOKEEPER.
# zookeeper = "10.0.0.9:2181/ferry"
# Inserts wait while the end of WAL is this many bytes ahead of what the
# slowest replica received / made durable / applied remotely (0: no limit).
max_replication_write_lag = 0
max_replication_flush_lag = 0
max_replication_apply_lag = 0
# A replica whose feedback has not changed for this long no longer holds
# back-pressure (as the safekeepers' replica_expiry).
replica_expiry = "1day"

[replica]
# The cluster it belongs to, checked against the cluster record (required).
# Env: FERRY_CLUSTER_ID.
# cluster_id = "prod"
# The shard it holds and which replica of the shard it is (required).
# shard = 0
# replica = 0
# Safekeepers to stream WAL from (required).
# safekeepers = ["10.0.0.1:5454", "10.0.0.2:5454", "10.0.0.3:5454"]
# ZooKeeper with the table catalog (required). Env: FERRY_ZOOKEEPER.
# zookeeper = "10.0.0.9:2181/ferry"
# Data directory (the replica lives in <data_dir>/s<shard>r<replica>). Env: FERRY_DATA_DIR.
# data_dir = "/var/lib/ferry"
# HTTP endpoint: /status, /metrics and reads.
http = "127.0.0.1:7678"
# Bearer token for its HTTP endpoint. Env: FERRY_API_TOKEN.
# api_token = "..."
# Folders a file:// export destination must lie in (default: <data_dir>/lake).
# Env: FERRY_EXPORT_ROOTS.
# export_roots = ["/srv/lake"]
# The size (MiB) a table that exports itself makes its lake files near to:
# idle partitions' small parts are merged up to it, and the lake follows.
lake_target_file_mib = 128
# A replica without a state file (new, or its data dir lost) is first built
# from a copy of a live peer replica of its shard: "auto" (the one furthest
# ahead in ZooKeeper; none: it starts empty) or its "host:port". Ignored by a
# replica with a state file.
# bootstrap_from = "auto"
# What a copy checks beyond the crc32c of every part's bytes: "rows" (every
# row against its part's footer) or "footers".
bootstrap_check = "rows"
# No WAL is applied while less than this is free on the data dir's file
# system; applying resumes once an eighth more is free.
min_free_disk = "1GiB"

[api]
# Bearer token every HTTP request must carry; at least 16 characters. Unset:
# no authentication. Env: FERRY_API_TOKEN (preferred: a file or the
# environment keeps it out of the process list).
# api_token = "..."
# Largest insert body in bytes (413 past it).
max_body_bytes = 67108864
# Most rows in one insert (413 past it).
max_rows = 1000000
# Inserts running at once (429 past it).
max_concurrent_inserts = 64
# Seconds an insert waits for its commit before answering 503 (outcome unknown).
commit_timeout_secs = 30
"#;

/// Parses a configuration file's text.
pub fn parse(text: &str) -> anyhow::Result<FileConfig> {
    toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", e.to_string().trim_end()))
}

/// The flag and environment variable of each key of a section.
fn env_of(key: &str) -> Option<&'static str> {
    match key {
        "data_dir" => Some("FERRY_DATA_DIR"),
        "cluster_id" => Some("FERRY_CLUSTER_ID"),
        "zookeeper" => Some("FERRY_ZOOKEEPER"),
        "api_token" => Some("FERRY_API_TOKEN"),
        "export_roots" => Some("FERRY_EXPORT_ROOTS"),
        "wal_backup" => Some("FERRY_WAL_BACKUP"),
        _ => None,
    }
}

/// The flags a section stands for, skipping those `given` (flags on the command
/// line) or set in the environment.
fn section_flags<T: Serialize>(section: &T, given: &[String]) -> anyhow::Result<Vec<OsString>> {
    let value = toml::Value::try_from(section).context("reading the configuration")?;
    let mut out = Vec::new();
    let Some(table) = value.as_table() else {
        return Ok(out);
    };
    for (key, v) in table {
        let flag = format!("--{}", key.replace('_', "-"));
        if given
            .iter()
            .any(|g| g == &flag || g.starts_with(&format!("{flag}=")))
        {
            continue;
        }
        if env_of(key).is_some_and(|e| std::env::var_os(e).is_some_and(|v| !v.is_empty())) {
            continue;
        }
        match v {
            toml::Value::Boolean(true) => out.push(flag.into()),
            toml::Value::Boolean(false) => {}
            toml::Value::Array(items) => {
                let items: Vec<String> = items
                    .iter()
                    .map(|i| {
                        i.as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| i.to_string())
                    })
                    .collect();
                out.push(format!("{flag}={}", items.join(",")).into());
            }
            toml::Value::String(s) => out.push(format!("{flag}={s}").into()),
            other => out.push(format!("{flag}={other}").into()),
        }
    }
    Ok(out)
}

/// The command line with the settings of `--config FILE` (if given) added for
/// the subcommand's role, before the command line's own flags.
pub fn apply(args: Vec<OsString>) -> anyhow::Result<Vec<OsString>> {
    let strings: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mut path = None;
    for (i, a) in strings.iter().enumerate() {
        if a == "--config" {
            path = strings.get(i + 1).cloned();
        } else if let Some(p) = a.strip_prefix("--config=") {
            path = Some(p.to_string());
        }
    }
    let (Some(path), Some(role)) = (path, strings.get(1).cloned()) else {
        return Ok(args);
    };
    let text = std::fs::read_to_string(Path::new(&path))
        .with_context(|| format!("reading the configuration file {path}"))?;
    let config = parse(&text).with_context(|| format!("configuration file {path}"))?;
    let mut injected = Vec::new();
    let serves_api = matches!(role.as_str(), "dev" | "writer");
    match role.as_str() {
        "dev" => {
            if let Some(s) = &config.dev {
                injected.extend(section_flags(s, &strings)?);
            }
        }
        "safekeeper" => {
            if let Some(s) = &config.safekeeper {
                injected.extend(section_flags(s, &strings)?);
            }
        }
        "writer" => {
            if let Some(s) = &config.writer {
                injected.extend(section_flags(s, &strings)?);
            }
        }
        "replica" => {
            if let Some(s) = &config.replica {
                injected.extend(section_flags(s, &strings)?);
            }
        }
        _ => {}
    }
    if serves_api {
        if let Some(s) = &config.api {
            injected.extend(section_flags(s, &strings)?);
        }
    }
    let mut out = Vec::with_capacity(args.len() + injected.len());
    out.extend(args.iter().take(2).cloned());
    out.extend(injected);
    out.extend(args.into_iter().skip(2));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_holds_every_setting_and_parses() {
        let config = parse(EXAMPLE).expect("the example parses");
        let dev = config.dev.expect("dev");
        assert_eq!(dev.http.as_deref(), Some("127.0.0.1:7878"));
        assert_eq!(config.api.expect("api").max_rows, Some(1_000_000));
        // Every key of every section appears in the example (set or commented).
        for key in [
            "data_dir",
            "http",
            "safekeepers",
            "segment_bytes",
            "wal_preallocation",
            "id",
            "cluster_id",
            "create",
            "listen",
            "zookeeper",
            "api_token",
            "max_body_bytes",
            "max_rows",
            "max_concurrent_inserts",
            "commit_timeout_secs",
        ] {
            assert!(EXAMPLE.contains(&format!("{key} = ")), "{key} documented");
        }
    }

    #[test]
    fn unknown_keys_and_wrong_types_are_errors() {
        let e = parse("[dev]\nhttp_port = 1\n").expect_err("unknown key");
        assert!(e.to_string().contains("http_port"), "{e}");
        let e = parse("[devv]\n").expect_err("unknown table");
        assert!(e.to_string().contains("devv"), "{e}");
        let e = parse("[api]\nmax_rows = \"many\"\n").expect_err("wrong type");
        assert!(e.to_string().contains("max_rows"), "{e}");
    }

    #[test]
    fn flags_win_over_the_file() {
        let dir = std::env::temp_dir().join(format!("ferry-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("f.toml");
        std::fs::write(
            &file,
            "[writer]\nsafekeepers = [\"a:1\", \"b:2\"]\nhttp = \"h:1\"\n[api]\nmax_rows = 5\n[dev]\nhttp = \"d:1\"\n",
        )
        .expect("write");
        let args: Vec<OsString> = [
            "ferry",
            "writer",
            "--config",
            file.to_str().expect("path"),
            "--http",
            "x:9",
        ]
        .into_iter()
        .map(OsString::from)
        .collect();
        let out: Vec<String> = apply(args)
            .expect("apply")
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(
            out.contains(&"--safekeepers=a:1,b:2".to_string()),
            "{out:?}"
        );
        assert!(out.contains(&"--max-rows=5".to_string()), "{out:?}");
        assert!(
            !out.iter().any(|a| a == "--http=h:1" || a == "--http=d:1"),
            "{out:?}"
        );
        assert_eq!(&out[out.len() - 2..], ["--http", "x:9"]);
        let _ = std::fs::remove_dir_all(dir);
    }
}
