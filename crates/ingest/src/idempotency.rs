//! What binds an `Idempotency-Key` to the content of its insert.
//!
//! * **Per-record keys.** Every WAL record of a keyed insert carries the user's
//!   key, a digest of the insert's decoded content (the Arrow IPC payloads of
//!   all its records, in order, with their shards) and the record's place in
//!   the insert ([`record_key`]). Replicas skip a record only when that exact
//!   key was applied before: an exact retry. Records of one insert never share
//!   a key, so none is skipped as a duplicate of another; a key reused with
//!   other content makes other record keys, so that insert is applied whole
//!   as new rows, never in part.
//! * **The index.** The API remembers the digest and the committed answer of
//!   the last [`INDEX_KEYS`] keyed inserts (per table and key; the oldest
//!   forgotten first), so that a retry of a committed insert is answered
//!   without writing anything (`"deduplicated": true`) and a reuse with other
//!   content is refused (409 `idempotency_key_reused`) before anything is
//!   written. It lives in memory: after a restart a retry reaches the WAL and
//!   is deduplicated by the replicas (still applied once), and a reuse with
//!   other content is applied as a new insert.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use ferry_wal::record::MAX_IDEMPOTENCY_KEY_BYTES;
use sha2::{Digest as _, Sha256};

use crate::api::InsertResponse;

/// The longest `Idempotency-Key` accepted: a record's key adds the content
/// digest and the record's place to it, within the record's 256 bytes.
pub const MAX_KEY_BYTES: usize = 200;

/// Keyed inserts the API remembers (their key, digest and answer: a few
/// hundred bytes each, tens of MiB at most).
pub const INDEX_KEYS: usize = 100_000;

/// 128 bits of SHA-256 over an insert's records.
pub type Digest = [u8; 16];

/// `~`, 32 hex digits, `~`, and `<index>/<count>` of two u32 at most.
const RECORD_KEY_SUFFIX_BYTES: usize = 1 + 32 + 1 + 10 + 1 + 10;
const _: () = assert!(MAX_KEY_BYTES + RECORD_KEY_SUFFIX_BYTES <= MAX_IDEMPOTENCY_KEY_BYTES);

/// The digest of an insert's records: each record's shard and Arrow IPC rows,
/// in order, length-prefixed so that no two lists of records share a digest
/// by moving bytes between them.
pub fn digest(records: &[(u32, Bytes)]) -> Digest {
    let mut h = Sha256::new();
    h.update((records.len() as u64).to_le_bytes());
    for (shard, rows) in records {
        h.update(shard.to_le_bytes());
        h.update((rows.len() as u64).to_le_bytes());
        h.update(rows);
    }
    truncate(h)
}

/// [`digest`] of records given as rows: the same digest as of their Arrow IPC
/// streams ([`ferry_table::rows::to_ipc`]), computed by encoding each twice
/// into sinks (once to learn its length, once into the hash) instead of
/// into memory: records no longer travel as IPC, and a key's digest must
/// not change with that (a retry across an upgrade finds its records' keys).
pub fn digest_rows(
    records: &[(u32, arrow::array::RecordBatch)],
) -> Result<Digest, arrow::error::ArrowError> {
    let mut h = Sha256::new();
    h.update((records.len() as u64).to_le_bytes());
    for (shard, rows) in records {
        let mut len = Counter(0);
        ferry_table::rows::write_ipc(rows, &mut len)?;
        h.update(shard.to_le_bytes());
        h.update(len.0.to_le_bytes());
        let mut into = Hashing(&mut h);
        ferry_table::rows::write_ipc(rows, &mut into)?;
    }
    Ok(truncate(h))
}

fn truncate(h: Sha256) -> Digest {
    let full = h.finalize();
    let mut out = [0u8; 16];
    out.copy_from_slice(&full[..16]);
    out
}

/// A sink that counts what is written to it.
struct Counter(u64);

impl std::io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A sink that hashes what is written to it.
struct Hashing<'a>(&'a mut Sha256);

impl std::io::Write for Hashing<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The key record `index` of `count` of a keyed insert carries:
/// `<key>~<digest in hex>~<index>/<count>`. The suffix has a fixed shape, so
/// the key, digest and place are read back from the right without ambiguity
/// whatever the user's key holds.
pub fn record_key(key: &[u8], digest: &Digest, index: usize, count: usize) -> Bytes {
    let mut out = Vec::with_capacity(key.len() + RECORD_KEY_SUFFIX_BYTES);
    out.extend_from_slice(key);
    out.push(b'~');
    for b in digest {
        out.extend_from_slice(format!("{b:02x}").as_bytes());
    }
    out.extend_from_slice(format!("~{index}/{count}").as_bytes());
    Bytes::from(out)
}

#[derive(Debug, Clone)]
enum Outcome {
    /// A request with this key is being written now.
    InFlight,
    /// The last attempt may or may not have committed.
    Unknown,
    Committed(InsertResponse),
}

#[derive(Debug)]
struct Entry {
    digest: Digest,
    outcome: Outcome,
    /// Which claim set the outcome: a ticket only updates its own.
    seq: u64,
}

type IndexKey = (u64, Bytes);

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<IndexKey, Entry>,
    /// Claims oldest first; one whose seq is no longer its entry's is stale.
    order: VecDeque<(IndexKey, u64)>,
    next_seq: u64,
}

/// Keyed inserts recently seen by this API, bounded by `limit` keys.
#[derive(Debug)]
pub struct KeyIndex {
    inner: Mutex<Inner>,
    limit: usize,
}

/// What a keyed insert may do.
#[derive(Debug)]
pub enum Claim {
    /// Write it; tell the ticket how it ended.
    Write(Ticket),
    /// It committed before: this is its answer.
    Done(InsertResponse),
}

/// Why a keyed insert may not be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The key was used with other content.
    Reused,
    /// A request with this key and content is being written now.
    InFlight,
}

impl KeyIndex {
    pub fn new(limit: usize) -> Arc<KeyIndex> {
        Arc::new(KeyIndex {
            inner: Mutex::new(Inner::default()),
            limit: limit.max(1),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves the map consistent (every
        // update is a single assignment): go on with it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Claims `key` of table `table` for content `digest`.
    pub fn claim(
        self: &Arc<Self>,
        table: u64,
        key: Bytes,
        digest: Digest,
    ) -> Result<Claim, Refusal> {
        let mut inner = self.lock();
        let id = (table, key);
        inner.next_seq += 1;
        let seq = inner.next_seq;
        let previous = match inner.entries.get_mut(&id) {
            Some(e) if e.digest != digest => return Err(Refusal::Reused),
            Some(e) => match &e.outcome {
                Outcome::InFlight => return Err(Refusal::InFlight),
                Outcome::Committed(r) => return Ok(Claim::Done(r.clone())),
                Outcome::Unknown => {
                    e.outcome = Outcome::InFlight;
                    e.seq = seq;
                    true
                }
            },
            None => {
                inner.entries.insert(
                    id.clone(),
                    Entry {
                        digest,
                        outcome: Outcome::InFlight,
                        seq,
                    },
                );
                false
            }
        };
        inner.order.push_back((id.clone(), seq));
        while inner.entries.len() > self.limit {
            let Some((old, old_seq)) = inner.order.pop_front() else {
                break;
            };
            if inner.entries.get(&old).is_some_and(|e| e.seq == old_seq) {
                inner.entries.remove(&old);
            }
        }
        if inner.order.len() > 2 * self.limit {
            let Inner { entries, order, .. } = &mut *inner;
            order.retain(|(k, s)| entries.get(k).is_some_and(|e| e.seq == *s));
        }
        Ok(Claim::Write(Ticket {
            index: Arc::clone(self),
            id,
            seq,
            was_unknown: previous,
            done: false,
        }))
    }

    /// Keys remembered now.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn finish(&self, id: &IndexKey, seq: u64, outcome: Option<Outcome>) {
        let mut inner = self.lock();
        let Some(e) = inner.entries.get_mut(id) else {
            return;
        };
        if e.seq != seq {
            return;
        }
        match outcome {
            Some(o) => e.outcome = o,
            None => {
                inner.entries.remove(id);
            }
        }
    }
}

/// A keyed insert being written. Dropped without an outcome (an error, a
/// timeout, the client gone), its outcome is unknown: a retry with the same
/// content may write again, one with other content is refused.
#[derive(Debug)]
pub struct Ticket {
    index: Arc<KeyIndex>,
    id: IndexKey,
    seq: u64,
    was_unknown: bool,
    done: bool,
}

impl Ticket {
    /// It committed with this answer.
    pub fn committed(mut self, answer: InsertResponse) {
        self.done = true;
        self.index
            .finish(&self.id, self.seq, Some(Outcome::Committed(answer)));
    }

    /// Nothing of it was written: the key is as it was before this attempt.
    pub fn nothing_written(mut self) {
        self.done = true;
        let before = self.was_unknown.then_some(Outcome::Unknown);
        self.index.finish(&self.id, self.seq, before);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            self.index
                .finish(&self.id, self.seq, Some(Outcome::Unknown));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_of_rows_is_the_digest_of_their_ipc_streams() {
        use arrow::array::{Int64Array, RecordBatch, StringArray};
        let batch = |n: i64, text: &str| {
            RecordBatch::try_from_iter([
                (
                    "id",
                    std::sync::Arc::new(Int64Array::from_iter_values(0..n)) as _,
                ),
                (
                    "s",
                    std::sync::Arc::new(StringArray::from_iter_values(
                        (0..n).map(|i| format!("{text}{i}")),
                    )) as _,
                ),
            ])
            .expect("batch")
        };
        let records = vec![(0, batch(100, "a")), (3, batch(7, "bb")), (0, batch(1, ""))];
        let ipc: Vec<(u32, Bytes)> = records
            .iter()
            .map(|(s, b)| (*s, ferry_table::rows::to_ipc(b).expect("ipc")))
            .collect();
        assert_eq!(digest_rows(&records).expect("digest"), digest(&ipc));
        // A slice (shared buffers, an offset) digests as its own copy does.
        let big = batch(50, "c");
        let sliced = vec![(1, big.slice(10, 20))];
        let copied = vec![(
            1,
            ferry_table::rows::to_ipc(&big.slice(10, 20)).expect("ipc"),
        )];
        assert_eq!(digest_rows(&sliced).expect("digest"), digest(&copied));
        assert_ne!(digest_rows(&records[..2]).expect("digest"), digest(&ipc));
    }

    fn answer(rows: u64) -> InsertResponse {
        InsertResponse {
            rows,
            blocks: vec![1],
            commit_lsn: "0/1".into(),
            deduplicated: false,
        }
    }

    #[test]
    fn record_keys_fit_a_record_and_differ_by_place_and_content() {
        let key = vec![b'k'; MAX_KEY_BYTES];
        let d = digest(&[(0, Bytes::from_static(b"rows"))]);
        let long = record_key(&key, &d, u32::MAX as usize, u32::MAX as usize);
        assert!(long.len() <= MAX_IDEMPOTENCY_KEY_BYTES, "{}", long.len());
        assert_ne!(record_key(b"k", &d, 0, 2), record_key(b"k", &d, 1, 2));
        let other = digest(&[(1, Bytes::from_static(b"rows"))]);
        assert_ne!(d, other, "the shard is part of the content");
        assert_ne!(
            digest(&[
                (0, Bytes::from_static(b"ab")),
                (0, Bytes::from_static(b"c"))
            ]),
            digest(&[
                (0, Bytes::from_static(b"a")),
                (0, Bytes::from_static(b"bc"))
            ]),
        );
    }

    #[test]
    fn claims_follow_the_outcome_of_the_first() {
        let index = KeyIndex::new(2);
        let k = || Bytes::from_static(b"k");
        let Ok(Claim::Write(first)) = index.claim(1, k(), [1; 16]) else {
            panic!("a new key is written");
        };
        assert_eq!(index.claim(1, k(), [1; 16]).err(), Some(Refusal::InFlight));
        assert_eq!(index.claim(1, k(), [2; 16]).err(), Some(Refusal::Reused));
        assert!(
            matches!(index.claim(2, k(), [2; 16]), Ok(Claim::Write(_))),
            "per table"
        );
        drop(first); // outcome unknown: the same content may be written again
        let Ok(Claim::Write(second)) = index.claim(1, k(), [1; 16]) else {
            panic!("a retry after an unknown outcome is written");
        };
        second.committed(answer(5));
        match index.claim(1, k(), [1; 16]) {
            Ok(Claim::Done(r)) => assert_eq!(r, answer(5)),
            other => panic!("{other:?}"),
        }
        assert_eq!(index.claim(1, k(), [2; 16]).err(), Some(Refusal::Reused));
        // Nothing written: the key is free again.
        let Ok(Claim::Write(t)) = index.claim(1, Bytes::from_static(b"n"), [3; 16]) else {
            panic!("new key");
        };
        t.nothing_written();
        assert!(matches!(
            index.claim(1, Bytes::from_static(b"n"), [4; 16]),
            Ok(Claim::Write(_))
        ));
        // At most `limit` keys: the oldest are forgotten.
        assert!(index.len() <= 2, "{}", index.len());
    }
}
