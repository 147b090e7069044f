//! What `ferry dev` does with a damaged, incomplete or mismatched data dir:
//! every kind of damage is refused (or, for one safekeeper, run around on the
//! healthy majority and shown), never silently started over; bad flags fail
//! before anything is touched; messages name what to fix.

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{
    expect_failure, fresh_data_dir, interrupt, ready_line, spawn_until, start_dev, start_dev_with,
    start_fresh_dev, status_json, status_url, stop_dev, FERRY,
};

const SMALL_SEGMENTS: &str = "65536";

/// A data dir that ran twice (so its WAL holds two shutdown checkpoints and
/// its safekeepers recorded a commit point above zero), in a new temporary
/// folder.
fn data_dir_that_ran() -> (tempfile::TempDir, PathBuf) {
    let (root, data) = fresh_data_dir();
    for _ in 0..2 {
        let (mut child, _) = start_dev_with(&data, &["--segment-bytes", SMALL_SEGMENTS]);
        stop_dev(&mut child, &data);
    }
    (root, data)
}

fn dev_args(data: &Path) -> Vec<&OsStr> {
    vec![
        OsStr::new("dev"),
        OsStr::new("--http"),
        OsStr::new("127.0.0.1:0"),
        OsStr::new("--data-dir"),
        data.as_os_str(),
    ]
}

/// Every file under `dir` with its length and a hash of its contents, to show
/// that a refusal changed nothing.
fn snapshot(dir: &Path) -> Vec<(PathBuf, usize, u64)> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name() != Some(OsStr::new("ferry.lock")) {
                let bytes = std::fs::read(&path).unwrap_or_default();
                let mut h = DefaultHasher::new();
                bytes.hash(&mut h);
                out.push((path.clone(), bytes.len(), h.finish()));
            }
        }
    }
    out.sort();
    out
}

fn first_segment(data: &Path, sk: u32) -> PathBuf {
    data.join(format!("wal/sk{sk}/wal/000000010000000000000000.partial"))
}

#[test]
fn a_lost_coordination_store_is_refused() {
    for what in ["log", "dir"] {
        let (_root, data) = data_dir_that_ran();
        let coord = data.join("coord");
        if what == "dir" {
            std::fs::remove_dir_all(&coord).expect("rm coord");
        } else {
            for e in std::fs::read_dir(&coord).expect("ls").flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("log.") || name.starts_with("snapshot.") {
                    std::fs::remove_file(e.path()).expect("rm");
                }
            }
        }
        let wal_before = snapshot(&data.join("wal"));
        let stderr = expect_failure(&dev_args(&data), &[]);
        assert!(
            stderr.contains("has no cluster record, but safekeepers exist"),
            "{what}: {stderr}"
        );
        assert!(stderr.contains("sk0/safekeeper.control"), "{stderr}");
        assert_eq!(snapshot(&data.join("wal")), wal_before, "WAL untouched");
    }
}

#[test]
fn a_lost_wal_directory_is_refused() {
    let (_root, data) = data_dir_that_ran();
    std::fs::remove_dir_all(data.join("wal")).expect("rm wal");
    let stderr = expect_failure(&dev_args(&data), &[]);
    assert!(
        stderr.contains("only 0 of 3 safekeepers can start"),
        "{stderr}"
    );
    for sk in 0..3 {
        assert!(
            stderr.contains(&format!("safekeeper {sk}:")),
            "names each: {stderr}"
        );
    }
    assert!(
        !data.join("wal/sk0/safekeeper.control").exists(),
        "no safekeeper was recreated empty"
    );
}

#[test]
fn a_wal_quorum_younger_than_coordination_is_refused() {
    let (root, data) = fresh_data_dir();
    let (mut child, _) = start_dev_with(&data, &["--segment-bytes", SMALL_SEGMENTS]);
    stop_dev(&mut child, &data);
    // An old copy of the WAL...
    let old = root.path().join("old-wal");
    copy_dir(&data.join("wal"), &old);
    // ...while the cluster goes on and commits more...
    let (mut child, _) = start_dev(&data);
    stop_dev(&mut child, &data);
    // ...is put back: every safekeeper is consistent on its own, but the
    // quorum holds less than the coordination store knows was committed.
    std::fs::remove_dir_all(data.join("wal")).expect("rm");
    copy_dir(&old, &data.join("wal"));
    let stderr = expect_failure(&dev_args(&data), &[]);
    assert!(
        stderr.contains("the WAL quorum is younger than the cluster"),
        "{stderr}"
    );
    assert!(stderr.contains("every safekeeper answered"), "{stderr}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("ls").flatten() {
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else if e.file_name() != OsStr::new("ferry.lock") {
            std::fs::copy(e.path(), &target).expect("copy");
        }
    }
}

/// One safekeeper's WAL is damaged: ferry dev runs on the other two and shows
/// the damaged one down, with the file at fault; the damage stays as it is.
#[test]
fn a_damaged_safekeeper_is_down_and_the_majority_runs() {
    type Damage = fn(&Path);
    let damages: [(&str, Damage, &str); 3] = [
        (
            "deleted segment",
            |seg| std::fs::remove_file(seg).expect("rm"),
            "segment file missing",
        ),
        (
            "truncated segment",
            |seg| {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(seg)
                    .expect("open");
                f.set_len(10).expect("truncate");
            },
            "segment file too short",
        ),
        (
            "flipped byte",
            |seg| {
                let mut bytes = std::fs::read(seg).expect("read");
                bytes[20] ^= 0x40;
                std::fs::write(seg, bytes).expect("write");
            },
            "fails its checksum",
        ),
    ];
    for (what, damage, expected) in damages {
        let (_root, data) = data_dir_that_ran();
        let segment = first_segment(&data, 1);
        damage(&segment);
        let damaged = snapshot(&data.join("wal/sk1"));
        let (mut child, lines) = start_dev(&data);
        assert!(
            lines.iter().any(|l| l.contains("sk1 down")),
            "{what}: {lines:?}"
        );
        let status = status_json(&status_url(&lines));
        let sk1 = &status["safekeepers"][1];
        assert_eq!(sk1["state"], "down", "{what}: {status}");
        let reason = sk1["reason"].as_str().expect("reason");
        assert!(reason.contains(expected), "{what}: {reason}");
        assert!(
            reason.contains("000000010000000000000000"),
            "names the file: {reason}"
        );
        assert_eq!(status["safekeepers"][0]["state"], "up");
        assert_eq!(status["safekeepers"][2]["state"], "up");
        assert_eq!(status["writer"]["elected"], true, "{status}");
        stop_dev(&mut child, &data);
        assert_eq!(
            snapshot(&data.join("wal/sk1")),
            damaged,
            "{what}: the damaged safekeeper was left as it was"
        );
    }
}

/// A safekeeper folder lost while `ferry dev` was stopped is rebuilt from a
/// running peer at the next start (a damaged one is left down, above): it
/// holds the committed WAL, votes again once the writer brought it back,
/// and starts as any member afterwards.
#[test]
fn a_lost_safekeeper_folder_is_pulled_from_a_peer() {
    let (_root, data) = data_dir_that_ran();
    std::fs::remove_dir_all(data.join("wal/sk1")).expect("rm sk1");
    let (mut child, lines) = start_dev(&data);
    assert!(
        lines
            .iter()
            .any(|l| l.contains("safekeeper 1: pulled from")),
        "{lines:?}"
    );
    let url = status_url(&lines);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let status = status_json(&url);
        let sk = &status["safekeepers"];
        let brought_back = sk[1]["state"] == "up"
            && sk[1]["restored_up_to"].is_null()
            && sk[1]["flush_lsn"] == sk[0]["flush_lsn"];
        if brought_back {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "safekeeper 1 was never brought back: {status}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    stop_dev(&mut child, &data);
    let (mut child, lines) = start_dev(&data);
    let status = status_json(&status_url(&lines));
    for i in 0..3 {
        assert_eq!(status["safekeepers"][i]["state"], "up", "{status}");
    }
    stop_dev(&mut child, &data);
}

#[test]
fn membership_and_segment_size_changes_are_refused() {
    let (_root, data) = data_dir_that_ran();
    // Opening the coordination store logs a new boot; the WAL stays as it is.
    let before = snapshot(&data.join("wal"));
    let mut args = dev_args(&data);
    args.extend([OsStr::new("--safekeepers"), OsStr::new("1")]);
    let stderr = expect_failure(&args, &[]);
    assert!(stderr.contains("with 3 safekeepers"), "{stderr}");
    assert!(stderr.contains("--safekeepers 1 asks for 1"), "{stderr}");
    let mut args = dev_args(&data);
    args.extend([OsStr::new("--segment-bytes"), OsStr::new("1048576")]);
    let stderr = expect_failure(&args, &[]);
    assert!(stderr.contains("with 65536-byte WAL segments"), "{stderr}");
    assert!(stderr.contains("1048576-byte segments"), "{stderr}");
    assert!(!stderr.contains("corrupt"), "{stderr}");
    assert_eq!(snapshot(&data.join("wal")), before, "nothing changed");
    // Restarting without the flags uses what the data dir holds.
    let (mut child, lines) = start_dev(&data);
    assert!(ready_line(&lines).contains("3 safekeepers"), "{lines:?}");
    stop_dev(&mut child, &data);
}

#[test]
fn each_safekeeper_of_a_running_dev_is_locked() {
    let (_root, data, mut child, lines) = start_fresh_dev();
    let cluster = ready_line(&lines)
        .split("cluster ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .expect("cluster id")
        .to_string();
    let wal = data.join("wal");
    let stderr = expect_failure(
        &[
            OsStr::new("safekeeper"),
            OsStr::new("--id"),
            OsStr::new("0"),
            OsStr::new("--cluster-id"),
            OsStr::new(&cluster),
            OsStr::new("--listen"),
            OsStr::new("127.0.0.1:0"),
            OsStr::new("--http"),
            OsStr::new("127.0.0.1:0"),
            OsStr::new("--data-dir"),
            wal.as_os_str(),
        ],
        &[],
    );
    assert!(
        stderr.contains("in use by another ferry process"),
        "{stderr}"
    );
    assert!(stderr.contains("sk0"), "{stderr}");
    stop_dev(&mut child, &data);
}

#[test]
fn bad_flags_fail_before_the_data_dir_is_touched() {
    let (_root, data) = fresh_data_dir();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let busy_addr = busy.local_addr().expect("addr").to_string();
    let cases: [(&[&str], &str); 5] = [
        (&["--safekeepers", "0"], "--safekeepers"),
        (&["--segment-bytes", "1000"], "--segment-bytes"),
        (&["--segment-bytes", "lots"], "not a number"),
        (&["--http", "no-such-address"], "binding the HTTP endpoint"),
        (&["--http", &busy_addr], "binding the HTTP endpoint"),
    ];
    for (extra, expected) in cases {
        let mut args: Vec<&OsStr> = vec![OsStr::new("dev"), OsStr::new("--data-dir")];
        args.push(data.as_os_str());
        args.extend(extra.iter().map(OsStr::new));
        let stderr = expect_failure(&args, &[]);
        assert!(stderr.contains(expected), "{extra:?}: {stderr}");
        assert!(!data.exists(), "{extra:?} created the data dir");
    }
}

#[test]
fn messages_name_what_to_fix() {
    let root = tempfile::tempdir().expect("tempdir");
    // An empty FERRY_DATA_DIR names the variable.
    let stderr = expect_failure(
        &[
            OsStr::new("dev"),
            OsStr::new("--http"),
            OsStr::new("127.0.0.1:0"),
        ],
        &[("FERRY_DATA_DIR", "")],
    );
    assert!(stderr.contains("FERRY_DATA_DIR"), "{stderr}");
    // A file where the data dir should be says so.
    let file = root.path().join("a-file");
    std::fs::write(&file, b"x").expect("write");
    let stderr = expect_failure(&dev_args(&file), &[]);
    assert!(stderr.contains("is not a directory"), "{stderr}");
    assert!(stderr.contains("a-file"), "{stderr}");
    // A file where the coordination store's directory should be.
    let data = root.path().join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    std::fs::write(data.join("coord"), b"x").expect("write");
    let stderr = expect_failure(&dev_args(&data), &[]);
    assert!(
        stderr.contains("coord exists and is not a directory"),
        "{stderr}"
    );
}

#[test]
fn logs_carry_no_colour_codes_when_not_on_a_terminal() {
    let (_root, data, mut child, _) = start_fresh_dev();
    stop_dev(&mut child, &data);
    let log = std::fs::read_to_string(common::dev_log(&data)).expect("log");
    assert!(log.contains("INFO"), "the log has lines: {log}");
    assert!(!log.contains('\u{1b}'), "no ANSI escape codes: {log:?}");
}

#[test]
fn the_distributed_safekeeper_is_created_only_explicitly() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("sk");
    let args = |create: bool| {
        let mut a: Vec<&OsStr> = [
            "safekeeper",
            "--id",
            "3",
            "--cluster-id",
            "c1",
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--data-dir",
        ]
        .iter()
        .map(OsStr::new)
        .collect();
        a.push(dir.as_os_str());
        if create {
            a.push(OsStr::new("--create"));
        }
        a
    };
    let stderr = expect_failure(&args(false), &[]);
    assert!(stderr.contains("never created here"), "{stderr}");
    assert!(!dir.join("sk3").exists(), "nothing created");
    // --create makes it; a second start finds it without the flag.
    let (mut child, first) = spawn_until(
        Command::new(FERRY)
            .args(args(true))
            .stderr(std::process::Stdio::null()),
        |_| true,
    );
    let line = first.unwrap_or_default().concat();
    assert!(line.contains("listening on"), "{line}");
    interrupt(&child);
    assert!(child.wait().expect("wait").success());
    assert!(dir.join("sk3/safekeeper.control").is_file());
    // Another cluster's id is refused, saying what the dir holds.
    let mut other = args(false);
    other[4] = OsStr::new("c2");
    let stderr = expect_failure(&other, &[]);
    assert!(
        stderr.contains("holds safekeeper 3 of cluster c1"),
        "{stderr}"
    );
}

/// A replica folder lost while `ferry dev` was stopped is built again from
/// the other replica's copy at start (not from the WAL), and then holds
/// every row and part the other holds, also of inserts after.
#[test]
fn a_lost_replica_folder_is_built_from_the_other_replica() {
    let (_root, data, mut child, lines) = start_fresh_dev();
    let url = common::base_url(&lines);
    let rt = common::runtime();
    let c = common::node_client(&url);
    let toml = ferry_testkit::table::TableToml::new("t", ("day", "identity"), ("id", 2))
        .column("id", "Int64")
        .column("day", "Date")
        .toml();
    let insert = |batch: i64| {
        let body: String = (0..50)
            .map(|i| {
                format!(
                    "{{\"id\":{},\"day\":\"2024-05-0{}\"}}\n",
                    batch * 100 + i,
                    1 + i % 2
                )
            })
            .collect();
        rt.block_on(c.insert_body(
            "t",
            ferry_table::Format::Ndjson,
            bytes::Bytes::from(body),
            Some(&format!("b{batch}")),
        ))
        .expect("insert")
        .commit_lsn
    };
    rt.block_on(c.create_table_toml(&toml))
        .expect("create table");
    for batch in 0..10 {
        insert(batch);
    }
    stop_dev(&mut child, &data);
    std::fs::remove_dir_all(data.join("replicas/r1")).expect("lose replica 1");

    let (mut child, lines) = start_dev(&data);
    let built = lines
        .iter()
        .find(|l| l.contains("replica 1 had no state"))
        .unwrap_or_else(|| panic!("replica 1 not built from a copy: {lines:?}"));
    assert!(built.contains("built from replica 0"), "{built}");
    let url = common::base_url(&lines);
    let c = common::node_client(&url);
    let last = {
        let body = bytes::Bytes::from_static(b"{\"id\":99999,\"day\":\"2024-05-03\"}\n");
        rt.block_on(c.insert_body("t", ferry_table::Format::Ndjson, body, Some("after")))
            .expect("insert")
            .commit_lsn
    };
    for replica in 0..2 {
        let rows = rt
            .block_on(c.count("t", None, replica, Some(&last)))
            .expect("count");
        assert_eq!(rows, 501, "replica {replica}");
    }
    assert_eq!(
        common::part_names(&rt, &url, 1, &last),
        common::part_names(&rt, &url, 0, &last),
        "the same parts on both"
    );
    stop_dev(&mut child, &data);
}
