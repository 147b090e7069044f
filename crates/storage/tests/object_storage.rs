//! Create-only writes and multipart uploads through both kinds of location: a
//! local directory, and the S3 server named by `FERRY_TEST_S3_ENDPOINT` (moto).

// Tests set up and damage real files and sockets directly; node code may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use bytes::Bytes;
use ferry_storage::{open, Location, S3Settings};
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart};

fn s3_endpoint() -> Option<String> {
    match std::env::var("FERRY_TEST_S3_ENDPOINT") {
        Ok(e) if !e.is_empty() => Some(e),
        _ => {
            assert!(
                std::env::var("FERRY_TEST_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "FERRY_TEST_S3_ENDPOINT is not set but services are required"
            );
            // Straight to stderr, past libtest's capture of `eprintln!`, so a
            // plain `cargo test` shows which test did not run.
            use std::io::Write as _;
            let test = std::thread::current()
                .name()
                .unwrap_or("a test")
                .to_string();
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: FERRY_TEST_S3_ENDPOINT is not set: this S3 test did not run (scripts/test.sh runs it)"
            );
            None
        }
    }
}

/// Creates a bucket on the test server (object_store cannot) with a plain,
/// unsigned HTTP request, which moto accepts.
async fn create_bucket(endpoint: &str, bucket: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(host)
        .await
        .expect("connect to S3 server");
    let request = format!(
        "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    conn.read_to_string(&mut response).await.expect("read");
    assert!(
        response.starts_with("HTTP/1.1 200"),
        "create bucket: {response}"
    );
}

async fn s3_location() -> Option<Location> {
    let endpoint = s3_endpoint()?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let bucket = format!("ferry-test-{nanos}");
    create_bucket(&endpoint, &bucket).await;
    let settings = S3Settings {
        endpoint: Some(endpoint),
        region: Some("us-east-1".into()),
        access_key_id: Some("test".into()),
        secret_access_key: Some("test".into()),
        session_token: None,
    };
    Some(open(&format!("s3://{bucket}/lake/prefix"), &settings).expect("open s3 location"))
}

async fn create_only_refuses_existing_key(loc: &Location) {
    let key = loc.key("part=1/data_abc.parquet").expect("key");
    let create = PutOptions::from(PutMode::Create);
    loc.store
        .put_opts(&key, PutPayload::from_static(b"first"), create.clone())
        .await
        .expect("first create");
    let err = loc
        .store
        .put_opts(&key, PutPayload::from_static(b"second"), create)
        .await
        .expect_err("second create must be refused");
    assert!(
        matches!(err, object_store::Error::AlreadyExists { .. }),
        "{err:?}"
    );
    let got = loc
        .store
        .get(&key)
        .await
        .expect("get")
        .bytes()
        .await
        .expect("bytes");
    assert_eq!(got, Bytes::from_static(b"first"), "the first write wins");
}

async fn multipart_upload_over_10_mib(loc: &Location) {
    let key = loc.key("big/object.bin").expect("key");
    let size = 12 * 1024 * 1024 + 12345;
    let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
    let upload = loc
        .store
        .put_multipart(&key)
        .await
        .expect("start multipart");
    let mut writer = WriteMultipart::new_with_chunk_size(upload, 5 * 1024 * 1024);
    for chunk in data.chunks(1024 * 1024) {
        writer.write(chunk);
    }
    writer.finish().await.expect("complete multipart");
    let meta = loc.store.head(&key).await.expect("head");
    assert_eq!(meta.size as usize, size);
    let got = loc
        .store
        .get(&key)
        .await
        .expect("get")
        .bytes()
        .await
        .expect("bytes");
    assert!(got == data, "multipart object differs");
}

#[tokio::test]
async fn local_directory_location() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}/lake", dir.path().display());
    let loc = open(&url, &S3Settings::default()).expect("open file location");
    create_only_refuses_existing_key(&loc).await;
    multipart_upload_over_10_mib(&loc).await;
    assert!(dir.path().join("lake/part=1/data_abc.parquet").is_file());
}

#[tokio::test]
async fn s3_location_on_the_test_server() {
    let Some(loc) = s3_location().await else {
        return;
    };
    create_only_refuses_existing_key(&loc).await;
    multipart_upload_over_10_mib(&loc).await;
    use futures::TryStreamExt;
    let listed: Vec<_> = loc
        .store
        .list(Some(&loc.prefix))
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .expect("list");
    assert_eq!(
        listed.len(),
        2,
        "exactly the two objects, under the prefix: {listed:?}"
    );
    assert!(
        listed.iter().all(|k| k.starts_with("lake/prefix/")),
        "{listed:?}"
    );
}
