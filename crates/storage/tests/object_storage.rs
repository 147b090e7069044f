//! Create-only writes and multipart uploads through both kinds of location: a
//! local directory, and the S3 server named by `FERRY_TEST_S3_ENDPOINT` (moto).

// Tests set up and damage real files and sockets directly; node code may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use bytes::Bytes;
use ferry_storage::{open, Location, S3Settings, StorageError, UploadBudget};
use ferry_testkit::services::{create_bucket, s3_endpoint, s3_settings};

async fn s3_location() -> Option<Location> {
    let endpoint = s3_endpoint()?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let bucket = format!("ferry-test-{nanos}");
    create_bucket(&endpoint, &bucket).await;
    let settings = s3_settings(&endpoint);
    Some(open(&format!("s3://{bucket}/lake/prefix"), &settings).expect("open s3 location"))
}

/// `racing`: also race eight create-only writers of one key (exactly one
/// wins). Not on moto: it does not make concurrent conditional puts atomic
/// (two racing `If-None-Match: *` puts of one key both succeed now and then,
/// which S3 itself never lets happen).
async fn create_only_refuses_existing_key(loc: &Location, racing: bool) {
    let key = "part=1/data_abc.parquet";
    loc.put_create(key, Bytes::from_static(b"first"))
        .await
        .expect("first create");
    let err = loc
        .put_create(key, Bytes::from_static(b"second"))
        .await
        .expect_err("second create must be refused");
    assert!(
        matches!(&err, StorageError::AlreadyExists { key: k } if k.ends_with(key)),
        "{err:?}"
    );
    let got = loc.get(key).await.expect("get");
    assert_eq!(got, Bytes::from_static(b"first"), "the first write wins");
    assert_eq!(loc.size(key).await.expect("size"), Some(5));
    assert_eq!(loc.size("part=1/none").await.expect("size"), None);
    assert!(matches!(
        loc.get("part=1/none").await,
        Err(StorageError::NotFound { .. })
    ));
    assert_eq!(
        loc.get_range(key, 1..4).await.expect("range"),
        Bytes::from_static(b"irs")
    );
    if racing {
        // Racing create-only writers: exactly one wins.
        let racers: Vec<_> = (0..8)
            .map(|i| {
                let loc = loc.clone();
                tokio::spawn(async move {
                    loc.put_create("race/one", Bytes::from(format!("writer {i}")))
                        .await
                })
            })
            .collect();
        let mut won = 0;
        for r in racers {
            match r.await.expect("task") {
                Ok(()) => won += 1,
                Err(StorageError::AlreadyExists { .. }) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(won, 1, "first write wins, once");
    } else {
        loc.put_create("race/one", Bytes::from_static(b"writer 0"))
            .await
            .expect("create");
    }
    loc.delete("race/one").await.expect("delete");
    loc.delete("race/one")
        .await
        .expect("deleting nothing is fine");
}

async fn streamed_upload_over_10_mib(loc: &Location) {
    let key = "big/object.bin";
    let size = 12 * 1024 * 1024 + 12345;
    let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
    let budget = UploadBudget {
        part_bytes: 5 * 1024 * 1024,
        max_in_flight: 1,
    };
    assert_eq!(budget.max_bytes(), 10 * 1024 * 1024);
    let mut upload = loc.upload(key, budget).await.expect("start upload");
    for chunk in data.chunks(1024 * 1024) {
        upload
            .write(Bytes::copy_from_slice(chunk))
            .await
            .expect("write");
    }
    assert_eq!(upload.written(), size as u64);
    assert_eq!(
        loc.size(key).await.expect("size"),
        None,
        "nothing visible before the upload is finished"
    );
    upload.finish().await.expect("complete upload");
    assert_eq!(loc.size(key).await.expect("size"), Some(size as u64));
    let got = loc.get(key).await.expect("get");
    assert!(got == data, "uploaded object differs");
    // An aborted upload leaves nothing.
    let mut upload = loc.upload("big/aborted.bin", budget).await.expect("start");
    upload
        .write(Bytes::from(vec![1u8; 6 << 20]))
        .await
        .expect("write");
    upload.abort().await.expect("abort");
    assert_eq!(loc.size("big/aborted.bin").await.expect("size"), None);
}

/// Two owners' folders of one location: each sees its own keys only, under
/// the same names, and the parent sees both.
async fn children_share_a_location(loc: &Location) {
    let a = loc.child("cluster-a").expect("child");
    let b = loc.child("cluster-b").expect("child");
    assert_eq!(a.url(), format!("{}/cluster-a", loc.url()));
    a.put("wal/seg", Bytes::from_static(b"of a"))
        .await
        .expect("put a");
    b.put("wal/seg", Bytes::from_static(b"of b"))
        .await
        .expect("put b");
    assert_eq!(a.get("wal/seg").await.expect("get"), "of a");
    assert_eq!(b.get("wal/seg").await.expect("get"), "of b");
    let listed = a.list("wal").await.expect("list");
    assert_eq!(listed, [("wal/seg".to_string(), 4)]);
    assert_eq!(
        loc.get("cluster-b/wal/seg")
            .await
            .expect("get from the parent"),
        "of b"
    );
    for bad in ["", "..", ".", "a/b", "a\\b"] {
        assert!(
            matches!(loc.child(bad), Err(StorageError::InvalidUrl { .. })),
            "{bad:?}"
        );
    }
    a.delete("wal/seg").await.expect("delete");
    b.delete("wal/seg").await.expect("delete");
}

#[test]
fn keys_cannot_leave_the_location() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}/lake", dir.path().display());
    let loc = open(&url, &S3Settings::default()).expect("open file location");
    for bad in ["", "../x", "a/../../x", "a//b", "/abs", "a\\b"] {
        assert!(
            matches!(loc.key(bad), Err(StorageError::InvalidKey { .. })),
            "{bad:?}"
        );
    }
}

#[tokio::test]
async fn local_directory_location() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}/lake", dir.path().display());
    let loc = open(&url, &S3Settings::default()).expect("open file location");
    create_only_refuses_existing_key(&loc, true).await;
    streamed_upload_over_10_mib(&loc).await;
    children_share_a_location(&loc).await;
    assert!(dir.path().join("lake/part=1/data_abc.parquet").is_file());
    let listed = loc.list("").await.expect("list");
    let keys: Vec<&str> = listed.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["big/object.bin", "part=1/data_abc.parquet"]);
}

#[tokio::test]
async fn s3_location_on_the_test_server() {
    let Some(loc) = s3_location().await else {
        return;
    };
    create_only_refuses_existing_key(&loc, false).await;
    streamed_upload_over_10_mib(&loc).await;
    children_share_a_location(&loc).await;
    let listed = loc.list("").await.expect("list");
    let keys: Vec<&str> = listed.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        ["big/object.bin", "part=1/data_abc.parquet"],
        "exactly the two objects, relative to the location"
    );
    assert_eq!(loc.list("part=1").await.expect("list").len(), 1);
    // The multipart upload carried its checksum: the server verified and
    // stored it (the listing names the algorithm).
    let listing = list_raw(&s3_endpoint().expect("endpoint"), &loc).await;
    let big = listing
        .split("<Contents>")
        .find(|c| c.contains("big/object.bin"))
        .unwrap_or_default();
    assert!(
        big.contains("<ChecksumAlgorithm>SHA256</ChecksumAlgorithm>"),
        "{listing}"
    );
}

/// The raw ListObjectsV2 answer for the location's bucket (plain unsigned
/// HTTP, which the test server accepts).
async fn list_raw(endpoint: &str, loc: &Location) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let bucket = loc
        .url()
        .trim_start_matches("s3://")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();
    let mut conn = tokio::net::TcpStream::connect(host)
        .await
        .expect("connect to S3 server");
    let request =
        format!("GET /{bucket}?list-type=2 HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    conn.read_to_string(&mut response).await.expect("read");
    assert!(response.starts_with("HTTP/1.1 200"), "list: {response}");
    response
}

/// An upload to S3 carries the SHA-256 of its bytes, so that S3 refuses
/// bytes changed on the way: checked on the request itself, received by a
/// stand-in server.
#[tokio::test]
async fn an_s3_upload_carries_the_sha256_of_its_bytes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    let server = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.expect("accept");
        let mut request = Vec::new();
        let mut buf = [0u8; 4096];
        // Headers, then the body of the length they give.
        let (head, body_len) = loop {
            let n = conn.read(&mut buf).await.expect("read");
            assert!(n > 0, "request cut short");
            request.extend_from_slice(&buf[..n]);
            if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&request[..end]).to_string();
                let len = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                    })
                    .unwrap_or(0);
                break (head, end + 4 + len);
            }
        };
        while request.len() < body_len {
            let n = conn.read(&mut buf).await.expect("read");
            assert!(n > 0, "body cut short");
            request.extend_from_slice(&buf[..n]);
        }
        conn.write_all(
            b"HTTP/1.1 200 OK\r\nETag: \"e\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await
        .expect("answer");
        head
    });
    let settings = s3_settings(&endpoint);
    let loc = open("s3://bucket/prefix", &settings).expect("open");
    loc.put("k", bytes::Bytes::from_static(b"hello"))
        .await
        .expect("put");
    let head = server.await.expect("server");
    let checksum = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .starts_with("x-amz-checksum-sha256:")
                .then(|| l.split_once(':').map(|(_, v)| v.trim().to_string()))
                .flatten()
        })
        .unwrap_or_else(|| panic!("no checksum header in {head}"));
    // SHA-256 of "hello", base64.
    assert_eq!(checksum, "LPJNul+wow4m6DsqxbninhsWHlwfp0JecwQzYpOLmCQ=");
}

#[tokio::test]
async fn staging_files_of_cut_short_writes_are_removed_for_final_keys_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}", dir.path().display());
    let loc = ferry_storage::open(&url, &Default::default()).expect("open");
    std::fs::create_dir_all(dir.path().join("p=a")).expect("dir");
    for name in [
        "p=a/x.parquet",
        "p=a/x.parquet#12",
        "p=a/x.parquet#7",
        "p=a/x.parquet#ab",
        "p=a/y.parquet#3",
        "top#5",
    ] {
        std::fs::write(dir.path().join(name), b"bytes").expect("write");
    }
    let removed = loc
        .remove_staging_of(&["p=a/x.parquet".to_string(), "top".to_string()])
        .await
        .expect("remove");
    assert_eq!(removed, 3);
    let mut left: Vec<String> = std::fs::read_dir(dir.path().join("p=a"))
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["x.parquet", "x.parquet#ab", "y.parquet#3"]);
    assert!(!dir.path().join("top#5").exists());
    // A key that would leave the location is refused; a missing folder is
    // nothing to do; a store without a local folder has no staging files.
    assert!(loc.remove_staging_of(&["../x".to_string()]).await.is_err());
    assert_eq!(
        loc.remove_staging_of(&["nowhere/x".to_string()])
            .await
            .expect("missing folder"),
        0
    );
    // In a child location: its files are in its folder.
    let child = loc.child("c").expect("child");
    std::fs::create_dir_all(dir.path().join("c/p=a")).expect("dir");
    for name in ["c/p=a/x.parquet#1", "c/p=a/z.parquet#2", "p=a/x.parquet#4"] {
        std::fs::write(dir.path().join(name), b"bytes").expect("write");
    }
    assert_eq!(
        child
            .remove_staging_of(&["p=a/x.parquet".to_string()])
            .await
            .expect("remove"),
        1
    );
    assert!(!dir.path().join("c/p=a/x.parquet#1").exists());
    assert!(dir.path().join("c/p=a/z.parquet#2").exists());
    assert!(
        dir.path().join("p=a/x.parquet#4").exists(),
        "the parent's file is not the child's"
    );
    let mem = Location::from_store(
        "s3://b/x",
        std::sync::Arc::new(object_store::memory::InMemory::new()),
        "x",
    )
    .expect("mem");
    assert_eq!(
        mem.remove_staging_of(&["p=a/x.parquet".to_string()])
            .await
            .expect("no local folder"),
        0
    );
}

#[test]
fn local_roots_take_only_folders_inside_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("lake");
    let roots = ferry_storage::LocalRoots::new([root.clone()]).expect("roots");
    assert!(root.is_dir(), "a root is created");
    let url = |p: &std::path::Path| format!("file://{}", p.display());
    // Inside, existing or not yet.
    roots.check(&url(&root)).expect("the root itself");
    roots
        .check(&url(&root.join("a/b")))
        .expect("a folder to be");
    // Other schemes are not local.
    roots.check("s3://bucket/prefix").expect("s3");
    // Outside: beside it, above it, a name that only starts like it.
    for outside in [
        dir.path().join("other"),
        dir.path().to_path_buf(),
        dir.path().join("lake2"),
    ] {
        let e = roots.check(&url(&outside)).expect_err("outside");
        assert!(e.to_string().contains("export root"), "{e}");
    }
    roots.check("file:///etc").expect_err("/etc");
    roots
        .check(&format!("{}/../x", url(&root)))
        .expect_err("..");
    // A link inside that leads out.
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).expect("mkdir");
    std::os::unix::fs::symlink(&elsewhere, root.join("link")).expect("symlink");
    roots.check(&url(&root.join("link"))).expect_err("link");
    roots
        .check(&url(&root.join("link/deeper")))
        .expect_err("below the link");
    // No roots: no local folder at all.
    let none = ferry_storage::LocalRoots::new([]).expect("roots");
    none.check(&url(&root)).expect_err("no roots");
}

/// A folder that takes no files (here a pseudo file system) refuses writes
/// at once: `object_store`'s local writer would retry creating the file for
/// ever, holding a thread that a stopping process then waits for.
#[tokio::test]
async fn a_folder_that_takes_no_files_refuses_writes_at_once() {
    if !std::path::Path::new("/proc/self/status").exists() {
        return;
    }
    let loc = open("file:///proc/self", &Default::default()).expect("open");
    let refused = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        (
            loc.put("b.parquet", bytes::Bytes::from_static(b"x")).await,
            loc.put_create("c.parquet", bytes::Bytes::from_static(b"x"))
                .await,
            loc.upload("d.parquet", Default::default()).await.map(drop),
        )
    })
    .await
    .expect("answered in time, not a retry loop");
    for r in [refused.0, refused.1, refused.2] {
        assert!(matches!(r, Err(StorageError::NotWritable { .. })), "{r:?}");
    }
    // Reads still work.
    assert!(loc.get("status").await.is_ok());
}
