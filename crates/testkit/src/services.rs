//! Real services from the environment: `scripts/test.sh` starts ZooKeeper
//! and an S3 server and sets `FERRY_TEST_ZK` and `FERRY_TEST_S3_ENDPOINT`.
//! A plain `cargo test` without them skips what needs them, and says so;
//! `FERRY_TEST_REQUIRE_SERVICES=1` (also set by the script) turns a missing
//! service into a failure, so CI can never skip these tests silently.
//! Tests on those servers share them with other tests: each takes a chroot
//! or a bucket of its own, named uniquely.

/// The ZooKeeper address (`host:port`) tests run against.
pub const ZOOKEEPER: &str = "FERRY_TEST_ZK";
/// The S3 endpoint (`http://host:port`) tests run against.
pub const S3_ENDPOINT: &str = "FERRY_TEST_S3_ENDPOINT";
/// A Python with the lake readers (pyiceberg, DuckDB with its Iceberg and
/// Avro extensions) that tests read exported tables with, and chDB, which
/// the ClickHouse comparison benchmark loads files into.
pub const LAKE_PYTHON: &str = "FERRY_TEST_PYTHON";
const REQUIRE: &str = "FERRY_TEST_REQUIRE_SERVICES";

/// The service named by the environment variable `var`, or `None` (with a
/// SKIPPED note naming the current test) when it is not set.
///
/// # Panics
/// When the variable is not set but services are required.
pub fn service(var: &str) -> Option<String> {
    let found = optional_service(var);
    if found.is_none() {
        skipped(&format!(
            "{var} is not set: this part did not run (scripts/test.sh runs it)"
        ));
    }
    found
}

/// [`service`] without the note, for a test that says itself what it skips.
///
/// # Panics
/// When the variable is not set but services are required.
pub fn optional_service(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var(REQUIRE).as_deref() != Ok("1"),
                "{var} is not set but services are required"
            );
            None
        }
    }
}

/// The test ZooKeeper's address, or `None` (noted) without one.
pub fn zookeeper() -> Option<String> {
    service(ZOOKEEPER)
}

/// The Python with the lake readers, or `None` (noted) without one.
pub fn lake_python() -> Option<String> {
    service(LAKE_PYTHON)
}

/// The test S3 endpoint, or `None` (noted) without one.
pub fn s3_endpoint() -> Option<String> {
    service(S3_ENDPOINT)
}

/// Says on the test binary's stderr, past libtest's output capture (which
/// only catches `eprintln!`), that (part of) the current test did not run,
/// so a plain `cargo test` shows it in its normal output.
pub fn skipped(why: &str) {
    use std::io::Write as _;
    let test = std::thread::current()
        .name()
        .unwrap_or("a test")
        .to_string();
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// A name no other test (in this or a concurrent run) uses: `prefix`, the
/// wall-clock nanoseconds and a process-wide counter.
pub fn unique_name(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    #[allow(clippy::disallowed_methods)] // a name, not a clock any node reads
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "{prefix}-{nanos}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Creates `bucket` on the test S3 server with a plain unsigned request,
/// which moto accepts (`object_store` cannot create buckets).
///
/// # Panics
/// When the server cannot be reached or refuses.
#[allow(clippy::disallowed_types)] // the test S3 server is a real socket
pub async fn create_bucket(endpoint: &str, bucket: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(host)
        .await
        .unwrap_or_else(|e| panic!("connect to the S3 server {host}: {e}"));
    let request = format!(
        "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("send to the S3 server: {e}"));
    let mut response = String::new();
    conn.read_to_string(&mut response)
        .await
        .unwrap_or_else(|e| panic!("read from the S3 server: {e}"));
    assert!(
        response.starts_with("HTTP/1.1 200"),
        "create bucket {bucket}: {response}"
    );
}

/// A new, empty chroot on the ZooKeeper at `zk`, named after `prefix`: its
/// connect string. Tests sharing one server never see each other's nodes.
///
/// # Panics
/// When the server cannot be reached or the chroot not created.
pub async fn zookeeper_chroot(zk: &str, prefix: &str) -> String {
    use ferry_coord::Coordination as _;
    let chroot = format!("/{}", unique_name(prefix));
    let root =
        ferry_coord::zk::ZkSession::connect(&ferry_coord::zk::ZkOptions::new(zk.to_string()))
            .await
            .unwrap_or_else(|e| panic!("connect to the test ZooKeeper {zk}: {e}"));
    ferry_coord::create_all(&root, &chroot)
        .await
        .unwrap_or_else(|e| panic!("create the chroot {chroot}: {e}"));
    root.close().await;
    format!("{zk}{chroot}")
}

/// The settings that reach the test S3 server at `endpoint`: moto takes any
/// credentials, and the client needs some and a region.
pub fn s3_settings(endpoint: &str) -> ferry_storage::S3Settings {
    ferry_storage::S3Settings {
        endpoint: Some(endpoint.to_string()),
        region: Some("us-east-1".into()),
        access_key_id: Some("test".into()),
        secret_access_key: Some("test".into()),
        ..ferry_storage::S3Settings::default()
    }
}

/// Rows per value of `column` as the lake readers installed by
/// `scripts/test.sh` read the Iceberg table whose metadata file is
/// `metadata` (a path, or an `s3://` URL on `s3_endpoint`, the test S3
/// server: DuckDB through its httpfs extension): `{"pyiceberg": {value:
/// rows}, "duckdb": {...}, "pyiceberg_table": {...}}`, the last read by
/// pyiceberg from the table's folder (it follows `version-hint.text` to
/// the newest version). `None` (noted) without the readers.
pub fn iceberg_row_counts(
    metadata: &str,
    column: &str,
    s3_endpoint: Option<&str>,
) -> Option<serde_json::Value> {
    let python = lake_python()?;
    let script = r#"
import json, sys
from pyiceberg.table import StaticTable
meta, column, endpoint = sys.argv[1], sys.argv[2], sys.argv[3]
props = {}
if endpoint:
    props = {"s3.endpoint": endpoint, "s3.access-key-id": "test",
             "s3.secret-access-key": "test", "s3.region": "us-east-1"}
def counts(location):
    t = StaticTable.from_metadata(location, properties=props)
    out = {}
    for v in t.scan().to_arrow()[column].to_pylist():
        out[str(v)] = out.get(str(v), 0) + 1
    return out
out = {"pyiceberg": counts(meta), "pyiceberg_table": counts(meta.rsplit("/metadata/", 1)[0])}
import duckdb, duckdb_ext
con = duckdb.connect()
con.execute("SET enable_progress_bar = false")
con.execute(f"SET extension_directory = '{duckdb_ext.get_extension_dir()}'")
con.execute("SET autoinstall_known_extensions = false")
con.execute("LOAD avro")
con.execute("LOAD iceberg")
if endpoint:
    con.execute("LOAD httpfs")
    host = endpoint.split("://", 1)[-1].rstrip("/")
    con.execute(f"CREATE SECRET s3 (TYPE s3, KEY_ID 'test', SECRET 'test', REGION 'us-east-1', ENDPOINT '{host}', URL_STYLE 'path', USE_SSL false)")
rows = con.execute(f"SELECT CAST({column} AS VARCHAR), count(*) FROM iceberg_scan('{meta}') GROUP BY 1").fetchall()
out["duckdb"] = {v: int(n) for v, n in rows}
print(json.dumps(out))
"#;
    let out = std::process::Command::new(&python)
        .args(["-c", script, metadata, column, s3_endpoint.unwrap_or("")])
        .output()
        .expect("run the lake readers");
    assert!(
        out.status.success(),
        "lake readers failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The answer is the last line: a reader may print notes of its own
    // before it.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let answer = stdout.lines().rev().find(|l| !l.trim().is_empty());
    Some(
        answer
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("no answer from the lake readers: {stdout}")),
    )
}
