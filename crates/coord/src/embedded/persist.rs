//! Durability of the embedded store: an append-only transaction log plus periodic
//! snapshots, both reached only through the [`Disk`] seam.
//!
//! Files in the store's directory:
//! * `log.<zxid>`: records of transactions with ids from `<zxid>` on, each framed
//!   as `len: u32 LE | crc32c(payload): u32 LE | payload (postcard)`;
//! * `snapshot.<zxid>`: the whole tree as of `<zxid>`, with a magic, a format
//!   version and a crc32c.
//!
//! Invariants:
//! * a transaction is acknowledged only after the log holding it was synced;
//! * a snapshot is written atomically (temp file, sync, rename, directory sync),
//!   and only then are the logs and snapshots it covers removed;
//! * recovery replays the newest snapshot and every later record; a torn record
//!   at the tail of the last log (a crash in the middle of an append, which was
//!   therefore never acknowledged) is cut off; damage anywhere else is refused
//!   with [`EmbeddedError::Corrupt`], never silently skipped.

use std::io;
use std::sync::Arc;

use ferry_env::{Disk, DiskFile};

use super::tree::{Tree, TreeImage, Txn};
use super::EmbeddedError;

const SNAPSHOT_MAGIC: &[u8; 8] = b"FERRYCS\x01";
const SNAPSHOT_FORMAT_VERSION: u32 = 1;
const SNAPSHOT_HEADER_BYTES: usize = 8 + 4 + 4 + 8;
const RECORD_HEADER_BYTES: usize = 8;
/// No legal record comes near this (a request is at most about 1 MiB); a length
/// above it can only be garbage.
const MAX_RECORD_BYTES: usize = 64 << 20;

fn corrupt(file: &str, detail: impl std::fmt::Display) -> EmbeddedError {
    EmbeddedError::Corrupt(format!("{file}: {detail}"))
}

fn file_zxid(name: &str, prefix: &str) -> Option<i64> {
    let digits = name.strip_prefix(prefix)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn log_name(first_zxid: i64) -> String {
    format!("log.{first_zxid:020}")
}

fn snapshot_name(zxid: i64) -> String {
    format!("snapshot.{zxid:020}")
}

/// Frames one transaction for the log.
pub(crate) fn encode_record(txn: &Txn, out: &mut Vec<u8>) -> io::Result<()> {
    let payload = postcard::to_allocvec(txn).map_err(io::Error::other)?;
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(())
}

/// Decodes records from a log; returns them and the length of the valid prefix.
/// Stops at the first incomplete or damaged record.
fn decode_records(data: &[u8]) -> (Vec<Txn>, usize) {
    let mut txns = Vec::new();
    let mut at = 0;
    while data.len() - at >= RECORD_HEADER_BYTES {
        let len = u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]) as usize;
        let crc = u32::from_le_bytes([data[at + 4], data[at + 5], data[at + 6], data[at + 7]]);
        let start = at + RECORD_HEADER_BYTES;
        if len > MAX_RECORD_BYTES || data.len() - start < len {
            break;
        }
        let payload = &data[start..start + len];
        if crc32c::crc32c(payload) != crc {
            break;
        }
        match postcard::from_bytes::<Txn>(payload) {
            Ok(txn) => txns.push(txn),
            Err(_) => break,
        }
        at = start + len;
    }
    (txns, at)
}

fn encode_snapshot(image: &TreeImage) -> io::Result<Vec<u8>> {
    let payload = postcard::to_allocvec(image).map_err(io::Error::other)?;
    let mut out = Vec::with_capacity(SNAPSHOT_HEADER_BYTES + payload.len());
    out.extend_from_slice(SNAPSHOT_MAGIC);
    out.extend_from_slice(&SNAPSHOT_FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

fn decode_snapshot(name: &str, data: &[u8]) -> Result<TreeImage, EmbeddedError> {
    if data.len() < SNAPSHOT_HEADER_BYTES || &data[..8] != SNAPSHOT_MAGIC {
        return Err(corrupt(name, "not a snapshot (bad magic or too short)"));
    }
    let word = |at: usize| u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
    let version = word(8);
    if version != SNAPSHOT_FORMAT_VERSION {
        return Err(corrupt(
            name,
            format!("unsupported snapshot format {version}"),
        ));
    }
    let crc = word(12);
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&data[16..24]);
    let len = u64::from_le_bytes(len_bytes);
    let payload = &data[SNAPSHOT_HEADER_BYTES..];
    if payload.len() as u64 != len {
        return Err(corrupt(name, "snapshot length does not match its header"));
    }
    if crc32c::crc32c(payload) != crc {
        return Err(corrupt(name, "snapshot checksum mismatch"));
    }
    postcard::from_bytes(payload).map_err(|e| corrupt(name, e))
}

/// When to write a snapshot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SnapshotPolicy {
    pub every_txns: u64,
    pub log_bytes: u64,
}

pub(crate) struct Persister {
    disk: Arc<dyn Disk>,
    dir: String,
    log: Box<dyn DiskFile>,
    log_len: u64,
    txns_since_snapshot: u64,
    policy: SnapshotPolicy,
    buf: Vec<u8>,
}

impl Persister {
    fn path(&self, name: &str) -> String {
        format!("{}/{name}", self.dir)
    }

    /// Recovers the tree from `dir` (creating the directory if new) and opens the
    /// log for appending.
    pub async fn open(
        disk: Arc<dyn Disk>,
        dir: &str,
        policy: SnapshotPolicy,
    ) -> Result<(Persister, Tree), EmbeddedError> {
        disk.create_dir_all(dir).await?;
        let names = disk.list_dir(dir).await?;
        for name in names.iter().filter(|n| n.ends_with(".tmp")) {
            disk.remove_file(&format!("{dir}/{name}")).await?;
        }
        let mut snapshots: Vec<i64> = names
            .iter()
            .filter_map(|n| file_zxid(n, "snapshot."))
            .collect();
        let mut logs: Vec<i64> = names.iter().filter_map(|n| file_zxid(n, "log.")).collect();
        snapshots.sort_unstable();
        logs.sort_unstable();

        let mut tree = match snapshots.last() {
            Some(&zxid) => {
                let name = snapshot_name(zxid);
                let data = disk.read(&format!("{dir}/{name}")).await?;
                let image = decode_snapshot(&name, &data)?;
                if image.zxid != zxid {
                    return Err(corrupt(&name, "snapshot zxid does not match its name"));
                }
                Tree::from_image(image).map_err(|e| corrupt(&name, e))?
            }
            None => Tree::new(),
        };

        let mut tail: Option<(Box<dyn DiskFile>, u64)> = None;
        for (i, &first) in logs.iter().enumerate() {
            let name = log_name(first);
            let path = format!("{dir}/{name}");
            let data = disk.read(&path).await?;
            let (txns, valid) = decode_records(&data);
            for txn in &txns {
                if txn.zxid <= tree.zxid() {
                    continue;
                }
                tree.replay(txn).map_err(|e| corrupt(&name, e))?;
            }
            let is_last = i + 1 == logs.len();
            if valid < data.len() {
                if !is_last {
                    return Err(corrupt(
                        &name,
                        format!("damaged record at byte {valid} in a log that is not the last"),
                    ));
                }
                tracing::warn!(
                    file = %path,
                    kept = valid,
                    discarded = data.len() - valid,
                    "cutting off a torn tail of the coordination log"
                );
            }
            if is_last {
                let file = disk.open(&path).await?;
                if valid < data.len() {
                    file.set_len(valid as u64).await?;
                    file.sync_data().await?;
                }
                tail = Some((file, valid as u64));
            }
        }
        let (log, log_len) = match tail {
            Some(t) => t,
            None => {
                let file = disk
                    .create_new(&format!("{dir}/{}", log_name(tree.zxid() + 1)))
                    .await?;
                disk.sync_dir(dir).await?;
                (file, 0)
            }
        };
        let persister = Persister {
            disk,
            dir: dir.to_string(),
            log,
            log_len,
            txns_since_snapshot: 0,
            policy,
            buf: Vec::new(),
        };
        Ok((persister, tree))
    }

    /// Appends transactions and syncs: after `Ok` they survive any crash.
    pub async fn append(&mut self, txns: &[Txn]) -> io::Result<()> {
        if txns.is_empty() {
            return Ok(());
        }
        self.buf.clear();
        for txn in txns {
            encode_record(txn, &mut self.buf)?;
        }
        let bytes = std::mem::take(&mut self.buf);
        let len = bytes.len() as u64;
        self.log.write_at(self.log_len, bytes.into()).await?;
        self.log.sync_data().await?;
        self.log_len += len;
        self.txns_since_snapshot += txns.len() as u64;
        Ok(())
    }

    pub fn wants_snapshot(&self) -> bool {
        self.txns_since_snapshot > 0
            && (self.txns_since_snapshot >= self.policy.every_txns
                || self.log_len >= self.policy.log_bytes)
    }

    /// Writes a snapshot of `tree`, starts a new log after it and removes the files
    /// the snapshot made redundant.
    pub async fn snapshot(&mut self, tree: &Tree) -> io::Result<()> {
        let zxid = tree.zxid();
        let bytes = encode_snapshot(&tree.image())?;
        let snap = snapshot_name(zxid);
        self.disk.write_atomic(&self.path(&snap), bytes).await?;
        let new_log = log_name(zxid + 1);
        let file = self.disk.create_new(&self.path(&new_log)).await?;
        self.disk.sync_dir(&self.dir).await?;
        self.log = file;
        self.log_len = 0;
        self.txns_since_snapshot = 0;
        for name in self.disk.list_dir(&self.dir).await? {
            let old_log = file_zxid(&name, "log.").is_some() && name != new_log;
            let old_snapshot = file_zxid(&name, "snapshot.").is_some() && name != snap;
            if old_log || old_snapshot {
                self.disk.remove_file(&self.path(&name)).await?;
            }
        }
        self.disk.sync_dir(&self.dir).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::tree::TxnBody;

    #[test]
    fn records_stop_at_damage() {
        let mut buf = Vec::new();
        for zxid in 1..=3 {
            encode_record(
                &Txn {
                    zxid,
                    body: TxnBody::Boot,
                },
                &mut buf,
            )
            .expect("encode");
        }
        let (txns, valid) = decode_records(&buf);
        assert_eq!((txns.len(), valid), (3, buf.len()));
        let (txns, valid) = decode_records(&buf[..buf.len() - 1]);
        assert_eq!(txns.len(), 2);
        let mut flipped = buf.clone();
        flipped[valid + RECORD_HEADER_BYTES] ^= 1;
        let (txns, at) = decode_records(&flipped);
        assert_eq!((txns.len(), at), (2, valid));
    }

    #[test]
    fn snapshot_checks_magic_and_crc() {
        let tree = Tree::new();
        let bytes = encode_snapshot(&tree.image()).expect("encode");
        assert_eq!(decode_snapshot("s", &bytes).expect("decode"), tree.image());
        let mut bad = bytes.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        assert!(matches!(
            decode_snapshot("s", &bad),
            Err(EmbeddedError::Corrupt(_))
        ));
        assert!(matches!(
            decode_snapshot("s", &bytes[..10]),
            Err(EmbeddedError::Corrupt(_))
        ));
    }
}
