//! Durability of the embedded store: an append-only transaction log plus periodic
//! snapshots, both reached only through the [`Disk`] seam.
//!
//! Files in the store's directory:
//! * `log.<zxid>`: transactions with ids from `<zxid>` on. The file starts with a
//!   header, `magic "FERRYCL\x01" | format version: u32 LE` (version 2; the
//!   unframed records of version 1 had no header and are refused as an
//!   unsupported format), followed by **batches**, one per group commit (one
//!   `write_at` and one `sync_data`):
//!   `header crc32c: u32 | body length: u32 | transactions: u32 | first zxid: i64
//!   | offset: u64 | body crc32c: u32 | body`, all little-endian, where the
//!   header crc covers the 28 header bytes after it, `offset` is the batch's own
//!   position in the file and the body holds the transactions as
//!   `length: u32 LE | postcard`, with consecutive zxids;
//! * `snapshot.<zxid>`: the whole tree as of `<zxid>`, with a magic, a format
//!   version and a crc32c.
//!
//! Invariants:
//! * a transaction is acknowledged only after the batch holding it was synced;
//! * a snapshot is written atomically (temp file, sync, rename, directory sync),
//!   and only then are the logs and snapshots it covers removed; a new log's
//!   header is synced before its directory entry;
//! * recovery replays the newest snapshot and every later transaction. A batch
//!   is the unit of damage: the only batch a crash can leave torn (a partial
//!   write, zeros, or any subset of its sectors) is the one being written, which
//!   was never acknowledged, and nothing valid follows it. So a damaged batch at
//!   the end of the last log, with no valid batch after it, is a torn tail and is
//!   cut off. A damaged batch followed by any valid batch (found by checking
//!   every later position for a batch header whose checksum matches, which
//!   names that very position and is followed by a body with a matching
//!   checksum and a zxid above everything read so far), or damage in a log
//!   that is not the last, is refused with [`EmbeddedError::Corrupt`] naming the
//!   file and the byte offset of the damaged batch, never silently skipped;
//! * damage confined to the last batch of the last log cannot be told apart from
//!   a torn write: that batch is cut like one (it holds the newest transactions
//!   only, as in any write-ahead log without replicas).

use std::io;
use std::sync::Arc;

use ferry_env::{Disk, DiskFile};

use super::tree::{Tree, TreeImage, Txn};
use super::EmbeddedError;

const SNAPSHOT_MAGIC: &[u8; 8] = b"FERRYCS\x01";
/// 2: the root's data is in the snapshot (version 1 lost it).
const SNAPSHOT_FORMAT_VERSION: u32 = 2;
const SNAPSHOT_HEADER_BYTES: usize = 8 + 4 + 4 + 8;
const LOG_MAGIC: &[u8; 8] = b"FERRYCL\x01";
/// Version 1 was a headerless sequence of individually checksummed records.
const LOG_FORMAT_VERSION: u32 = 2;
const LOG_HEADER_BYTES: usize = 8 + 4;
const BATCH_HEADER_BYTES: usize = 4 + 4 + 4 + 8 + 8 + 4;
/// Offset of the `offset` field inside a batch header.
const BATCH_OFFSET_FIELD: usize = 20;

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

fn log_header() -> Vec<u8> {
    let mut out = Vec::with_capacity(LOG_HEADER_BYTES);
    out.extend_from_slice(LOG_MAGIC);
    out.extend_from_slice(&LOG_FORMAT_VERSION.to_le_bytes());
    out
}

fn u32_at(data: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&data[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(data: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&data[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Frames the transactions of one group commit as a batch that will be written
/// at `offset` of its log.
fn encode_batch(txns: &[Txn], offset: u64, out: &mut Vec<u8>) -> io::Result<()> {
    let first_zxid = txns
        .first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty batch"))?
        .zxid;
    let start = out.len();
    out.resize(start + BATCH_HEADER_BYTES, 0);
    for txn in txns {
        let payload = postcard::to_allocvec(txn).map_err(io::Error::other)?;
        let len = u32::try_from(payload.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "transaction too large"))?;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&payload);
    }
    let body = &out[start + BATCH_HEADER_BYTES..];
    let body_len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "batch too large"))?;
    let count = u32::try_from(txns.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "batch too large"))?;
    let body_crc = crc32c::crc32c(body);
    let header = &mut out[start..start + BATCH_HEADER_BYTES];
    header[4..8].copy_from_slice(&body_len.to_le_bytes());
    header[8..12].copy_from_slice(&count.to_le_bytes());
    header[12..20].copy_from_slice(&first_zxid.to_le_bytes());
    header[20..28].copy_from_slice(&offset.to_le_bytes());
    header[28..32].copy_from_slice(&body_crc.to_le_bytes());
    let header_crc = crc32c::crc32c(&header[4..]);
    header[0..4].copy_from_slice(&header_crc.to_le_bytes());
    Ok(())
}

/// A batch header that passed its checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BatchHeader {
    body_len: usize,
    count: u32,
    first_zxid: i64,
}

/// Reads the batch at `at`: its header and body, or why it is not valid.
fn read_batch(data: &[u8], at: usize) -> Result<(BatchHeader, &[u8]), &'static str> {
    if data.len() - at < BATCH_HEADER_BYTES {
        return Err("incomplete batch header");
    }
    let header = &data[at..at + BATCH_HEADER_BYTES];
    // Cheap test first: a batch names its own position (zeros never do, as no
    // batch starts at 0).
    if u64_at(header, BATCH_OFFSET_FIELD) != at as u64
        || crc32c::crc32c(&header[4..]) != u32_at(header, 0)
    {
        return Err("bad batch header");
    }
    let body_len = u32_at(header, 4) as usize;
    let start = at + BATCH_HEADER_BYTES;
    if data.len() - start < body_len {
        return Err("batch runs past the end of the file");
    }
    let body = &data[start..start + body_len];
    if crc32c::crc32c(body) != u32_at(header, 28) {
        return Err("batch checksum mismatch");
    }
    let mut zxid = [0u8; 8];
    zxid.copy_from_slice(&header[12..20]);
    Ok((
        BatchHeader {
            body_len,
            count: u32_at(header, 8),
            first_zxid: i64::from_le_bytes(zxid),
        },
        body,
    ))
}

/// The transactions of a batch whose checksums matched.
fn decode_body(header: &BatchHeader, body: &[u8]) -> Result<Vec<Txn>, String> {
    let mut txns = Vec::new();
    let mut at = 0;
    while at < body.len() {
        if body.len() - at < 4 {
            return Err("truncated transaction length".into());
        }
        let len = u32_at(body, at) as usize;
        at += 4;
        if body.len() - at < len {
            return Err("transaction runs past the end of its batch".into());
        }
        let txn: Txn = postcard::from_bytes(&body[at..at + len]).map_err(|e| e.to_string())?;
        let expected = header.first_zxid + txns.len() as i64;
        if txn.zxid != expected {
            return Err(format!(
                "transaction has zxid {}, expected {expected}",
                txn.zxid
            ));
        }
        txns.push(txn);
        at += len;
    }
    if txns.len() != header.count as usize {
        return Err(format!(
            "batch holds {} transactions, its header says {}",
            txns.len(),
            header.count
        ));
    }
    Ok(txns)
}

/// First position after `from` holding a valid batch with a first zxid above
/// `above_zxid`, and that zxid. Bounded by the size of `data`; the test of a
/// position is a comparison of its offset field, then a header checksum, and
/// only a candidate that passes both has its body checksummed.
fn find_valid_batch(data: &[u8], from: usize, above_zxid: i64) -> Option<(usize, i64)> {
    let last = data.len().checked_sub(BATCH_HEADER_BYTES)?;
    (from..=last).find_map(|at| match read_batch(data, at) {
        Ok((header, _)) if header.first_zxid > above_zxid => Some((at, header.first_zxid)),
        _ => None,
    })
}

/// What a log holds.
#[derive(Debug)]
struct LogContents {
    txns: Vec<Txn>,
    /// End of the last valid batch; 0 if the file header itself is missing.
    end: usize,
    /// Why the bytes from `end` on are not a valid batch, if there are any.
    tail: Option<&'static str>,
}

/// Damage that is not a torn tail: where, and what.
#[derive(Debug)]
struct LogDamage {
    at: usize,
    detail: String,
}

/// Decodes a log. `floor_zxid` is the highest zxid recovered before it. Bytes
/// after the last valid batch are reported in `tail` if no valid batch with a
/// higher zxid follows them; otherwise the log is damaged in the middle.
fn decode_log(data: &[u8], floor_zxid: i64) -> Result<LogContents, LogDamage> {
    if data.len() < LOG_HEADER_BYTES {
        // A log whose header never reached the disk (a crash right after its
        // creation).
        let header = log_header();
        if data.iter().all(|&b| b == 0) || header.starts_with(data) {
            return Ok(LogContents {
                txns: Vec::new(),
                end: 0,
                tail: (!data.is_empty()).then_some("incomplete log header"),
            });
        }
    }
    if data.len() < LOG_HEADER_BYTES || &data[..8] != LOG_MAGIC {
        return Err(LogDamage {
            at: 0,
            detail: format!(
                "unsupported log format: no log header (a log of an older ferry, which \
                 wrote unframed records, or not a log); this version reads log format \
                 {LOG_FORMAT_VERSION} only"
            ),
        });
    }
    let version = u32_at(data, 8);
    if version != LOG_FORMAT_VERSION {
        return Err(LogDamage {
            at: 8,
            detail: format!(
                "unsupported log format {version}; this version reads log format \
                 {LOG_FORMAT_VERSION} only"
            ),
        });
    }
    let mut txns = Vec::new();
    let mut last_zxid = floor_zxid;
    let mut at = LOG_HEADER_BYTES;
    while at < data.len() {
        match read_batch(data, at) {
            Ok((header, body)) => {
                let batch = decode_body(&header, body).map_err(|e| LogDamage {
                    at,
                    detail: format!("batch with matching checksums does not decode: {e}"),
                })?;
                last_zxid = last_zxid.max(header.first_zxid + batch.len() as i64 - 1);
                txns.extend(batch);
                at += BATCH_HEADER_BYTES + header.body_len;
            }
            Err(reason) => {
                if let Some((next, zxid)) = find_valid_batch(data, at + 1, last_zxid) {
                    return Err(LogDamage {
                        at,
                        detail: format!(
                            "damaged batch ({reason}) followed by a valid batch at byte \
                             {next} (zxid {zxid}): the log is damaged in the middle, not \
                             torn at its end"
                        ),
                    });
                }
                let zeros = data[at..].iter().all(|&b| b == 0);
                return Ok(LogContents {
                    txns,
                    end: at,
                    tail: Some(if zeros { "zeros" } else { reason }),
                });
            }
        }
    }
    Ok(LogContents {
        txns,
        end: at,
        tail: None,
    })
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
    let version = u32_at(data, 8);
    if version != SNAPSHOT_FORMAT_VERSION {
        return Err(corrupt(
            name,
            format!("unsupported snapshot format {version}"),
        ));
    }
    let crc = u32_at(data, 12);
    let len = u64_at(data, 16);
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

/// Creates a log holding only its header, synced before its directory entry.
async fn create_log(disk: &dyn Disk, dir: &str, name: &str) -> io::Result<Box<dyn DiskFile>> {
    let file = disk.create_new(&format!("{dir}/{name}")).await?;
    file.write_at(0, log_header().into()).await?;
    file.sync_data().await?;
    disk.sync_dir(dir).await?;
    Ok(file)
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
                let path = format!("{dir}/{}", snapshot_name(zxid));
                let data = disk.read(&path).await?;
                let image = decode_snapshot(&path, &data)?;
                if image.zxid != zxid {
                    return Err(corrupt(&path, "snapshot zxid does not match its name"));
                }
                Tree::from_image(image).map_err(|e| corrupt(&path, e))?
            }
            None => Tree::new(),
        };

        let mut tail: Option<(Box<dyn DiskFile>, u64)> = None;
        for (i, &first) in logs.iter().enumerate() {
            let path = format!("{dir}/{}", log_name(first));
            let data = disk.read(&path).await?;
            let contents = decode_log(&data, tree.zxid())
                .map_err(|d| corrupt(&path, format!("at byte {}: {}", d.at, d.detail)))?;
            for txn in &contents.txns {
                if txn.zxid <= tree.zxid() {
                    continue;
                }
                tree.replay(txn).map_err(|e| corrupt(&path, e))?;
            }
            let is_last = i + 1 == logs.len();
            if !is_last {
                if contents.end == 0 {
                    return Err(corrupt(
                        &path,
                        "at byte 0: log header missing in a log that is not the last",
                    ));
                }
                if let Some(reason) = contents.tail {
                    return Err(corrupt(
                        &path,
                        format!(
                            "at byte {}: damaged batch ({reason}) in a log that is not the last",
                            contents.end
                        ),
                    ));
                }
                continue;
            }
            let file = disk.open(&path).await?;
            let mut end = contents.end;
            if let Some(reason) = contents.tail {
                tracing::warn!(
                    file = %path,
                    kept = end,
                    discarded = data.len() - end,
                    reason,
                    "cutting off a torn tail of the coordination log"
                );
            }
            if end == 0 {
                // The header never reached the disk: write it now.
                file.set_len(0).await?;
                file.write_at(0, log_header().into()).await?;
                file.sync_data().await?;
                end = LOG_HEADER_BYTES;
            } else if end < data.len() {
                file.set_len(end as u64).await?;
                file.sync_data().await?;
            }
            tail = Some((file, end as u64));
        }
        let (log, log_len) = match tail {
            Some(t) => t,
            None => {
                let file = create_log(&*disk, dir, &log_name(tree.zxid() + 1)).await?;
                (file, LOG_HEADER_BYTES as u64)
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

    /// Appends transactions as one batch and syncs: after `Ok` they survive any
    /// crash. One batch is one write, so a crash can tear only this batch.
    pub async fn append(&mut self, txns: &[Txn]) -> io::Result<()> {
        if txns.is_empty() {
            return Ok(());
        }
        self.buf.clear();
        encode_batch(txns, self.log_len, &mut self.buf)?;
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
        let file = create_log(&*self.disk, &self.dir, &new_log).await?;
        self.log = file;
        self.log_len = LOG_HEADER_BYTES as u64;
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
    use crate::embedded::tree::{TxnBody, TxnOp};

    fn txn(zxid: i64, data_bytes: usize) -> Txn {
        Txn {
            zxid,
            body: TxnBody::Ops(vec![TxnOp::Create {
                path: format!("/n{zxid}"),
                data: vec![(zxid % 251) as u8 + 1; data_bytes],
                ephemeral_owner: 0,
            }]),
        }
    }

    /// A log holding batches of the given sizes (transactions of `data_bytes`
    /// each, zxids from 1 on); returns it, the transactions and where each batch
    /// starts.
    fn log_of(sizes: &[usize], data_bytes: usize) -> (Vec<u8>, Vec<Txn>, Vec<usize>) {
        let mut log = log_header();
        let mut all = Vec::new();
        let mut starts = Vec::new();
        for &n in sizes {
            let batch: Vec<Txn> = (0..n)
                .map(|i| txn(all.len() as i64 + i as i64 + 1, data_bytes))
                .collect();
            starts.push(log.len());
            let offset = log.len() as u64;
            encode_batch(&batch, offset, &mut log).expect("encode");
            all.extend(batch);
        }
        (log, all, starts)
    }

    /// What a crash may leave of `current` whose first `synced` bytes were
    /// synced: the sectors of `keep` (bit i for sector i past the synced
    /// ones), with zeros in the holes, as `SimDisk::crash` tears a write.
    fn tear(current: &[u8], synced: usize, keep: u64) -> Vec<u8> {
        const SECTOR: usize = 512;
        let mut out = current[..synced].to_vec();
        for (i, start) in (synced / SECTOR * SECTOR..current.len())
            .step_by(SECTOR)
            .enumerate()
        {
            let end = (start + SECTOR).min(current.len());
            if keep & (1 << i) != 0 {
                if out.len() < end {
                    out.resize(end, 0);
                }
                out[start..end].copy_from_slice(&current[start..end]);
            }
        }
        out
    }

    #[test]
    fn batches_round_trip() {
        let (log, all, _) = log_of(&[1, 5, 2], 10);
        let contents = decode_log(&log, 0).expect("decode");
        assert_eq!(contents.txns, all);
        assert_eq!((contents.end, contents.tail), (log.len(), None));
        // Transactions a snapshot already covers still decode (recovery skips them).
        let contents = decode_log(&log, 7).expect("decode");
        assert_eq!(contents.txns.len(), 8);
    }

    #[test]
    fn torn_last_batch_is_cut_whatever_survives_of_it() {
        // The last batch holds many transactions over several sectors, so a
        // torn write can keep whole, valid-looking transactions of it after a
        // damaged part.
        let (log, all, starts) = log_of(&[1, 3, 12], 300);
        let last = starts[2];
        assert!(log.len() - last > 6 * 512, "the last batch spans sectors");
        let sectors = (log.len() - last / 512 * 512).div_ceil(512);
        for keep in 0..(1u64 << sectors) - 1 {
            let torn = tear(&log, last, keep);
            let contents = decode_log(&torn, 0)
                .unwrap_or_else(|d| panic!("sectors {keep:b}: refused a torn write: {d:?}"));
            assert_eq!(contents.txns, all[..4], "sectors {keep:b}");
            assert_eq!(contents.end, last);
            assert_eq!(contents.tail.is_some(), torn.len() > last);
        }
        // A write cut short anywhere.
        for len in last..log.len() {
            let contents = decode_log(&log[..len], 0).expect("cut short");
            assert_eq!((contents.txns.len(), contents.end), (4, last));
        }
    }

    #[test]
    fn zeros_or_garbage_after_the_last_batch_are_a_tail() {
        let (log, all, _) = log_of(&[1, 3], 20);
        let mut zeros = log.clone();
        zeros.resize(log.len() + 4096, 0);
        let contents = decode_log(&zeros, 0).expect("zeros");
        assert_eq!(contents.txns, all);
        assert_eq!((contents.end, contents.tail), (log.len(), Some("zeros")));
        let mut garbage = log.clone();
        let mut x = 0x9e37_79b9_u32;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            garbage.push(x as u8);
        }
        let contents = decode_log(&garbage, 0).expect("garbage");
        assert_eq!(contents.txns, all);
        assert_eq!(contents.end, log.len());
    }

    #[test]
    fn damage_before_a_valid_batch_is_refused_wherever_it_hits() {
        let (log, _, starts) = log_of(&[1, 3, 2], 40);
        for at in starts[1]..starts[2] {
            for flip in [0x01, 0x80] {
                let mut bad = log.clone();
                bad[at] ^= flip;
                let damage = decode_log(&bad, 0).expect_err("mid-log damage");
                assert_eq!(damage.at, starts[1], "byte {at}: {}", damage.detail);
                assert!(
                    damage
                        .detail
                        .contains(&format!("valid batch at byte {}", starts[2])),
                    "{}",
                    damage.detail
                );
            }
        }
    }

    #[test]
    fn a_damaged_length_does_not_hide_later_batches() {
        let (log, _, starts) = log_of(&[1, 3, 2, 4], 40);
        for len in [u32::MAX, 0, 1, 12, (starts[3] - starts[1]) as u32] {
            let mut bad = log.clone();
            bad[starts[1] + 4..starts[1] + 8].copy_from_slice(&len.to_le_bytes());
            let damage = decode_log(&bad, 0).expect_err("length damage");
            assert_eq!(damage.at, starts[1], "length {len}");
        }
        // Even with a header checksum that matches the damaged length (a batch
        // that claims everything up to the end), the next batch is found.
        let mut bad = log.clone();
        let body_len = (log.len() - starts[1] - BATCH_HEADER_BYTES) as u32;
        bad[starts[1] + 4..starts[1] + 8].copy_from_slice(&body_len.to_le_bytes());
        let crc = crc32c::crc32c(&bad[starts[1] + 4..starts[1] + BATCH_HEADER_BYTES]);
        bad[starts[1]..starts[1] + 4].copy_from_slice(&crc.to_le_bytes());
        let damage = decode_log(&bad, 0).expect_err("length damage");
        assert_eq!(damage.at, starts[1]);
    }

    #[test]
    fn only_a_later_batch_with_newer_transactions_counts() {
        // A valid batch of transactions already recovered, placed after damage,
        // loses nothing when cut.
        let (mut log, all, starts) = log_of(&[1, 3], 20);
        log[starts[1] + BATCH_HEADER_BYTES] ^= 1;
        let offset = log.len() as u64;
        encode_batch(&all[..1], offset, &mut log).expect("encode");
        let contents = decode_log(&log, 0).expect("old transactions only");
        assert_eq!((contents.txns.len(), contents.end), (1, starts[1]));
    }

    #[test]
    fn a_batch_with_matching_checksums_must_decode() {
        let mut log = log_header();
        let offset = log.len() as u64;
        encode_batch(&[txn(1, 3), txn(3, 3)], offset, &mut log).expect("encode");
        let damage = decode_log(&log, 0).expect_err("zxid gap");
        assert_eq!(damage.at, LOG_HEADER_BYTES);
        assert!(damage.detail.contains("expected 2"), "{}", damage.detail);
    }

    #[test]
    fn log_header_is_checked() {
        // A log of format 1: records `len | crc | payload`, no header.
        let payload = postcard::to_allocvec(&txn(1, 3)).expect("encode");
        let mut old = (payload.len() as u32).to_le_bytes().to_vec();
        old.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
        old.extend_from_slice(&payload);
        let damage = decode_log(&old, 0).expect_err("old format");
        assert_eq!(damage.at, 0);
        assert!(
            damage.detail.contains("unsupported log format"),
            "{}",
            damage.detail
        );
        let mut newer = log_header();
        newer[8..12].copy_from_slice(&3u32.to_le_bytes());
        let damage = decode_log(&newer, 0).expect_err("newer format");
        assert!(
            damage.detail.contains("unsupported log format 3"),
            "{}",
            damage.detail
        );
        // A header that never reached the disk: a log created just before a
        // crash, holding nothing.
        for torn in [&[][..], &[0, 0, 0][..], &log_header()[..5]] {
            let contents = decode_log(torn, 0).expect("torn creation");
            assert_eq!((contents.txns.len(), contents.end), (0, 0));
        }
        assert!(decode_log(b"garbage", 0).is_err());
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
