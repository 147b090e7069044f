//! `ferry bench copy`: a replica built from a peer's copy over HTTP on
//! loopback (manifest, every part's bytes with their crc32c, each part's
//! rows checked against its footer, fsyncs, the state last), next to the
//! same run's raw copy of the same files on the same disk (read, write,
//! fdatasync each, sync the folder): the floor a copy cannot beat.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use ferry_env::{Cpu, Disk, RealDisk};
use ferry_replica::replica::bootstrap::{copy_from_peer, CopyCheck, LocalDonor};
use ferry_replica::{Replica, SharedReplica};

use crate::export::{apply_insert, batch, OneTable};

#[derive(Debug, clap::Args)]
pub struct CopyBenchArgs {
    /// Directory for the data. Default: a temporary directory inside the
    /// working folder (so the figures are for this disk).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Size of the donor's parts, MiB (about).
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    /// How many parts (one insert each).
    #[arg(long, default_value_t = 64)]
    parts: usize,
}

pub async fn copy(args: CopyBenchArgs) -> anyhow::Result<()> {
    let dir = crate::wal::scratch_dir(args.dir.as_deref(), "ferry-bench-copy-")?;
    let disk: Arc<dyn Disk> = Arc::new(RealDisk::open_root(dir.path())?);
    // zstd Parquet of these rows takes about 30 bytes per row.
    let rows_per_part = ((args.mib << 20) / args.parts.max(1) / 30).max(1);
    say!(
        "bench copy: writing a donor replica of {} parts x {rows_per_part} rows ...",
        args.parts
    );
    let donor = Replica::open(
        Arc::clone(&disk),
        "donor",
        0,
        0,
        Cpu::BlockingPool,
        Arc::new(OneTable),
    )
    .await?;
    let donor: SharedReplica = Arc::new(tokio::sync::Mutex::new(donor));
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut wal = BytesMut::new();
    for i in 0..args.parts {
        let b = batch((i * rows_per_part) as i64, rows_per_part, &mut state)?;
        let ipc = ferry_table::rows::to_ipc(&b)?;
        apply_insert(&mut *donor.lock().await, &mut wal, ipc).await?;
    }
    let files: Vec<(std::path::PathBuf, u64)> = {
        let r = donor.lock().await;
        r.parts(1)
            .iter()
            .map(|p| (dir.path().join(r.part_path(1, &p.name)), p.bytes))
            .collect()
    };
    let total: u64 = files.iter().map(|(_, b)| b).sum();
    let mib = total as f64 / 1048576.0;
    say!("bench copy: {} parts, {mib:.1} MiB in all", files.len());

    // The floor: the same files copied on the same disk, each synced.
    let raw_dir = dir.path().join("raw");
    std::fs::create_dir_all(&raw_dir)?;
    let started = Instant::now();
    let copied = files.clone();
    let raw_to = raw_dir.clone();
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        for (i, (path, _)) in copied.iter().enumerate() {
            let to = raw_to.join(format!("{i}.parquet"));
            std::fs::copy(path, &to)?;
            std::fs::File::open(&to)?.sync_data()?;
        }
        std::fs::File::open(&raw_to)?.sync_all()
    })
    .await??;
    let raw = started.elapsed();
    // A second floor: the same copy through a buffer in user space, as any
    // copy that carries bytes over a network must (`std::fs::copy` copies
    // inside the kernel).
    let user_dir = dir.path().join("raw-user");
    std::fs::create_dir_all(&user_dir)?;
    let started = Instant::now();
    let copied = files.clone();
    let user_to = user_dir.clone();
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        use std::io::{Read, Write};
        let mut buf = vec![0u8; ferry_replica::replica::bootstrap::COPY_CHUNK_BYTES];
        for (i, (path, _)) in copied.iter().enumerate() {
            let mut from = std::fs::File::open(path)?;
            let mut to = std::fs::File::create(user_to.join(format!("{i}.parquet")))?;
            loop {
                let n = from.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                to.write_all(&buf[..n])?;
            }
            to.sync_data()?;
        }
        std::fs::File::open(&user_to)?.sync_all()
    })
    .await??;
    let user = started.elapsed();

    // The copy over HTTP, as `ferry replica --bootstrap-from` makes it.
    let listener = ferry_host::http::bind("127.0.0.1:0").await?;
    let local = Arc::new(LocalDonor {
        replica: Arc::clone(&donor),
        clock: Arc::new(ferry_env::SystemClock),
        name: "donor".into(),
    });
    let server = ferry_host::http::serve(listener, ferry_node::bootstrap::router(local), None)?;
    let source = ferry_node::bootstrap::HttpDonor {
        peers: ferry_node::http::HttpPeers::new(Arc::new(ferry_env::TcpNetwork), None),
        addr: server.addr.clone(),
    };
    let mut timed = Vec::new();
    for (check, dir) in [
        (CopyCheck::Rows, "copy"),
        (CopyCheck::Footers, "copy-footers"),
    ] {
        let started = Instant::now();
        let built = copy_from_peer(&disk, dir, 0, 1, Cpu::BlockingPool, check, &source).await?;
        timed.push(started.elapsed());
        anyhow::ensure!(
            built.bytes_copied == total && built.parts == files.len(),
            "the copy holds {} bytes in {} parts, the donor {total} in {}",
            built.bytes_copied,
            built.parts,
            files.len()
        );
        // The copy opens as a replica with the donor's parts.
        let copy = Replica::open(
            Arc::clone(&disk),
            dir,
            0,
            1,
            Cpu::BlockingPool,
            Arc::new(OneTable),
        )
        .await?;
        anyhow::ensure!(
            copy.parts(1) == donor.lock().await.parts(1),
            "the copy's parts differ from the donor's"
        );
    }
    server.stop().await;
    let rate = |d: std::time::Duration| mib / d.as_secs_f64().max(1e-9);
    say!(
        "raw copy of the files (read, write, fdatasync each): {:.2} s, {:.0} MiB/s",
        raw.as_secs_f64(),
        rate(raw)
    );
    say!(
        "raw copy through a user-space buffer: {:.2} s, {:.0} MiB/s",
        user.as_secs_f64(),
        rate(user)
    );
    for (what, took) in [
        ("rows of every part checked", timed[0]),
        ("footers checked (--bootstrap-check footers)", timed[1]),
    ] {
        say!(
            "replica built from a peer over HTTP (crc32c of the bytes, {what}, fsyncs): {:.2} s, {:.0} MiB/s: {:.0}% of the raw copy's rate, {:.0}% of the user-space copy's",
            took.as_secs_f64(),
            rate(took),
            100.0 * raw.as_secs_f64() / took.as_secs_f64().max(1e-9),
            100.0 * user.as_secs_f64() / took.as_secs_f64().max(1e-9)
        );
    }
    Ok(())
}
