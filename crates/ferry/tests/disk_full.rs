//! A `ferry dev` whose data dir is a small real file system (a tmpfs) that
//! fills up: its safekeepers refuse appends and its coordination store
//! refuses writes, inserts and table changes answer 503 `disk_full`,
//! nothing acknowledged is lost, and once the space is freed everything
//! goes on by itself.
//!
//! Mounting needs root (or `CAP_SYS_ADMIN`): without it the test says
//! SKIPPED and returns.

mod common;

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use ferry_client::{Client, ClientError, Inserted};
use ferry_env::Disk as _;
use ferry_table::{Format, TableDef};
use ferry_wal::Lsn;

/// Size of the file system.
const FS_BYTES: u64 = 64 << 20;
/// `--min-free-disk`: the breakers open below it and close at 17 MiB.
const MIN_FREE: u64 = 16 << 20;
/// Bound of every wait on a condition.
const WAIT: Duration = Duration::from_secs(60);
/// Rows per insert.
const ROWS: i64 = 50;

/// A tmpfs mounted on a folder, unmounted when dropped, also when the test
/// fails half-way (the processes using it are dropped, killed, first).
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `bytes` on `dir`, or says why it could not.
    fn mount(dir: &Path, bytes: u64) -> Result<Tmpfs, String> {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
        }
        Ok(Tmpfs {
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = Command::new("umount")
            .arg(&self.dir)
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            // Still busy: detach it now, the kernel frees it once unused.
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

fn def() -> TableDef {
    TableDef::from_toml(&ferry_testkit::table::id_d_toml(3).replicas(2).toml()).expect("table")
}

/// Rows `ids` as NDJSON, all in partition 202401.
fn rows(ids: &[i64]) -> bytes::Bytes {
    ids.iter()
        .map(|i| format!("{{\"id\":{i},\"d\":\"2024-01-02\"}}\n"))
        .collect::<String>()
        .into()
}

/// The ids of insert number `n`.
fn ids_of(n: i64) -> Vec<i64> {
    (n * ROWS..(n + 1) * ROWS).collect()
}

fn lsn(done: &Inserted) -> Lsn {
    done.commit_lsn.parse().expect("a commit LSN")
}

async fn insert(client: &Client, n: i64) -> Result<Inserted, ClientError> {
    client
        .insert_body(
            "t",
            Format::Ndjson,
            rows(&ids_of(n)),
            Some(&format!("insert-{n}")),
        )
        .await
}

/// The status and kind of an API error, or `None` for any other error.
fn kind_of(e: &ClientError) -> Option<(u16, &str)> {
    match e {
        ClientError::Api { status, body } => Some((*status, body.kind.as_str())),
        _ => None,
    }
}

/// [`kind_of`] the error of `r`, `None` for a success.
fn api_kind<T>(r: &Result<T, ClientError>) -> Option<(u16, &str)> {
    r.as_ref().err().and_then(kind_of)
}

/// Polls the status of `ferry dev` until `holds` (at most [`WAIT`]);
/// panics naming `what` with the last status otherwise.
fn wait_for_status(url: &str, what: &str, holds: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        let status = status_json(url);
        if holds(&status) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not in {WAIT:?}: {status:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether every safekeeper and the coordination store report a full disk
/// (`full`), or none does.
fn all_report(status: &serde_json::Value, full: bool) -> bool {
    let safekeepers = status["safekeepers"].as_array().expect("safekeepers");
    let reports = |v: &serde_json::Value| v.as_str().is_some_and(|s| s.starts_with("disk_full:"));
    !safekeepers.is_empty()
        && safekeepers.iter().all(|s| reports(&s["disk_full"]) == full)
        && reports(&status["coordination"]["disk_full"]) == full
}

/// The free space of the file system of `dir`, as the nodes see it.
async fn free_bytes(dir: &Path) -> u64 {
    ferry_env::RealDisk::open_root(dir)
        .expect("disk")
        .free_bytes()
        .await
        .expect("statvfs")
        .expect("a free space")
}

/// Writes `bytes` of zeros to a new file at `path`, synced.
fn fill(path: &Path, bytes: u64) {
    let mut file = std::fs::File::create(path).expect("create the filler");
    let chunk = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n]).expect("fill the file system");
        left -= n as u64;
    }
    file.sync_all().expect("sync the filler");
}

/// The ids a replica of `ferry dev` holds in partition 202401, once it
/// applied `lsn`.
fn ids_on_replica(url: &str, replica: usize, lsn: Lsn) -> Vec<i64> {
    let body = http_get(&format!(
        "{url}/tables/t/rows?partition=202401&replica={replica}&min_lsn={lsn}&wait_ms=60000"
    ));
    body.lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).expect("a row");
            row["id"].as_i64().expect("an id")
        })
        .collect()
}

#[test]
fn a_full_file_system_refuses_inserts_and_table_changes_and_goes_on_once_freed() {
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    std::fs::create_dir(&data).expect("mount point");
    // Mounting is a capability of the machine (root or CAP_SYS_ADMIN), not
    // a service scripts/test.sh starts: FERRY_TEST_REQUIRE_SERVICES does not
    // make its absence a failure, or the suite could not run unprivileged.
    let _fs = match Tmpfs::mount(&data, FS_BYTES) {
        Ok(fs) => fs,
        Err(why) => {
            skipped(&format!("no tmpfs to fill: {why}"));
            return;
        }
    };
    // Small segments: three safekeepers' WAL fits in the file system. The
    // log is beside the data dir, not in it.
    let (mut child, lines) = start_dev_with(
        &data,
        &[
            "--min-free-disk",
            &MIN_FREE.to_string(),
            "--segment-bytes",
            "1048576",
        ],
    );
    let url = base_url(&lines);
    let status = status_url(&lines);
    let rt = runtime();
    let client = node_client(&url);
    // A probe gives up early: an insert sent before the writer heard of
    // the refusals waits (its outcome unknown) until space returns.
    let probe = Client::new(&url, None, Duration::from_secs(3)).expect("client");
    let mut acked: BTreeSet<i64> = BTreeSet::new();
    let mut refused: Vec<i64> = Vec::new();
    let mut unknown: Vec<i64> = Vec::new();
    let mut last_lsn = Lsn(0);

    rt.block_on(async {
        client.create_table(&def()).await.expect("create table");
        let mut n = 0;
        for _ in 0..5 {
            let done = insert(&client, n).await.expect("insert with room");
            last_lsn = lsn(&done);
            acked.extend(ids_of(n));
            n += 1;
        }
        assert!(all_report(&status_json(&status), false), "room at first");

        // Fill the file system to half the minimum free.
        let free = free_bytes(&data).await;
        assert!(free > 2 * MIN_FREE, "only {free} bytes free at first");
        fill(&data.join("filler"), free - MIN_FREE / 2);
        wait_for_status(&status, "every breaker open", |s| all_report(s, true));
        let st = status_json(&status);
        let coord = st["coordination"]["disk_full"]
            .as_str()
            .expect("coordination");
        assert!(
            coord.starts_with("disk_full: coordination store has "),
            "{coord}"
        );

        // Inserts: refused at once with disk_full once the writer heard
        // of the refusals; before that, they wait (outcome unknown).
        let deadline = Instant::now() + WAIT;
        loop {
            let r = insert(&probe, n).await;
            match api_kind(&r) {
                Some((503, "disk_full")) => {
                    refused.extend(ids_of(n));
                    n += 1;
                    break;
                }
                Some((503, "outcome_unknown")) | None if r.is_err() => unknown.push(n),
                _ => panic!("an insert with every safekeeper full: {r:?}"),
            }
            n += 1;
            assert!(
                Instant::now() < deadline,
                "no insert was refused for lack of space"
            );
        }
        let started = Instant::now();
        let r = insert(&client, n).await;
        assert_eq!(api_kind(&r), Some((503, "disk_full")), "{r:?}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "refused at once, not held until space returns"
        );
        if let Err(ClientError::Api { body, .. }) = &r {
            assert!(body.error.starts_with("disk_full:"), "{}", body.error);
        }
        refused.extend(ids_of(n));
        n += 1;
        // A table change: the coordination store refuses it, nothing made.
        let mut other = def();
        other.name = "u".into();
        let r = client.create_table(&other).await;
        assert_eq!(api_kind(&r), Some((503, "disk_full")), "{r:?}");
        if let Err(ClientError::Api { body, .. }) = &r {
            assert!(
                body.error.starts_with("disk_full: coordination store has "),
                "{}",
                body.error
            );
        }
        let tables = client.tables().await.expect("reads are served");
        assert_eq!(tables.len(), 1, "{tables:?}");

        // Space returns: everything goes on by itself.
        std::fs::remove_file(data.join("filler")).expect("free the space");
        wait_for_status(&status, "every breaker closed", |s| all_report(s, false));
        let deadline = Instant::now() + WAIT;
        for _ in 0..5 {
            let done = loop {
                match insert(&client, n).await {
                    Ok(done) => break done,
                    // The writer may not have heard yet that space is back.
                    Err(e) if kind_of(&e) == Some((503, "disk_full")) => {
                        assert!(Instant::now() < deadline, "inserts stay refused: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("an insert once space is back: {e}"),
                }
            };
            last_lsn = last_lsn.max(lsn(&done));
            acked.extend(ids_of(n));
            n += 1;
        }
        // An insert of unknown outcome, retried with its key, is answered
        // once: committed then (or now, the first time).
        for u in &unknown {
            let deadline = Instant::now() + WAIT;
            let done = loop {
                match insert(&client, *u).await {
                    Ok(done) => break done,
                    Err(e) if kind_of(&e) == Some((409, "idempotency_key_in_flight")) => {
                        assert!(Instant::now() < deadline, "still in flight: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("a retry of an insert of unknown outcome: {e}"),
                }
            };
            last_lsn = last_lsn.max(lsn(&done));
            acked.extend(ids_of(*u));
        }
        let (_, created) = client
            .create_table(&other)
            .await
            .expect("table change taken again");
        assert!(created);
    });

    println!(
        "{} rows acknowledged ({} inserts of unknown outcome retried), {} refused",
        acked.len(),
        unknown.len(),
        refused.len()
    );
    // Every acknowledged row is there, once, on both replicas; no refused
    // one is.
    for replica in 0..2 {
        let ids = ids_on_replica(&url, replica, last_lsn);
        let held: BTreeSet<i64> = ids.iter().copied().collect();
        assert_eq!(held.len(), ids.len(), "replica {replica}: a row twice");
        assert_eq!(held, acked, "replica {replica}: the acknowledged rows");
        assert!(refused.iter().all(|i| !held.contains(i)), "a refused row");
    }
    stop_dev(&mut child, &data);
}
