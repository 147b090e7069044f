//! Simulated object storage: `object_store`'s in-memory store (or, in tests
//! against a real S3 server or folder, that store) behind a fault injector. Requests take a random latency, may fail outright, and writes may
//! fail *after* they took effect (the object exists but the caller saw an error),
//! which is what makes exactly-once uploads hard.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::{BoxStream, StreamExt};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Fault settings of simulated object storage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ObjectFaults {
    pub min_latency: Duration,
    pub max_latency: Duration,
    /// Chance a request fails without effect.
    pub fail_prob: f64,
    /// Chance a successful write is reported as failed.
    pub fail_after_write_prob: f64,
    /// Whether the pieces of multipart uploads (each part and the
    /// completion) fail too, at `fail_prob` (completion also at
    /// `fail_after_write_prob`); off by default, so the simulator's draws
    /// stay as they were.
    pub multipart: bool,
    /// Whether deletes take latency and fail too (before, or after they
    /// applied); off by default, so the other workloads' draws stay as they
    /// were.
    pub deletes: bool,
}

impl Default for ObjectFaults {
    fn default() -> Self {
        ObjectFaults {
            min_latency: Duration::from_millis(1),
            max_latency: Duration::from_millis(20),
            fail_prob: 0.0,
            fail_after_write_prob: 0.0,
            multipart: false,
            deletes: false,
        }
    }
}

struct State {
    rng: SmallRng,
    faults: ObjectFaults,
    injected: u64,
}

/// An object store with injected faults.
#[derive(Clone)]
pub struct FaultyObjectStore {
    inner: Arc<dyn ObjectStore>,
    state: Arc<Mutex<State>>,
    /// Every put or delete as it starts and once it applied, for checkers
    /// that crash a node at a chosen step of an upload protocol.
    events: Arc<tokio::sync::watch::Sender<StoreEvent>>,
    /// With a clock ([`FaultyObjectStore::stamp_with`]): when each object
    /// was last written by that clock, which listings report instead of
    /// the inner store's wall-clock times.
    stamps: Arc<Mutex<Option<Stamps>>>,
}

/// A clock for objects' modification times.
pub type StampClock = Arc<dyn Fn() -> chrono::DateTime<chrono::Utc> + Send + Sync>;

struct Stamps {
    now: StampClock,
    modified: std::collections::HashMap<String, chrono::DateTime<chrono::Utc>>,
}

/// A put or delete seen by the store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreEvent {
    /// Counts every event, so that equal events in a row are told apart.
    pub seq: u64,
    pub key: String,
    pub delete: bool,
    /// False when the request arrived, true once it took effect.
    pub applied: bool,
}

impl fmt::Debug for FaultyObjectStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FaultyObjectStore")
    }
}

impl fmt::Display for FaultyObjectStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultyObjectStore({})", self.inner)
    }
}

fn injected(what: &str) -> object_store::Error {
    object_store::Error::Generic {
        store: "simulated",
        source: Box::new(std::io::Error::other(format!("injected fault: {what}"))),
    }
}

impl FaultyObjectStore {
    pub fn new(seed: u64, faults: ObjectFaults) -> FaultyObjectStore {
        Self::wrap(seed, faults, Arc::new(InMemory::new()))
    }

    /// Faults in front of another store (a local folder, an S3 bucket).
    pub fn wrap(seed: u64, faults: ObjectFaults, inner: Arc<dyn ObjectStore>) -> FaultyObjectStore {
        FaultyObjectStore {
            inner,
            state: Arc::new(Mutex::new(State {
                rng: SmallRng::seed_from_u64(seed),
                faults,
                injected: 0,
            })),
            events: Arc::new(tokio::sync::watch::channel(StoreEvent::default()).0),
            stamps: Arc::default(),
        }
    }

    /// Objects written from now on are stamped by `now` (a simulated
    /// clock), so that what compares their age with that clock (orphan
    /// removal) sees the times the simulation lived, not the machine's.
    pub fn stamp_with(&self, now: StampClock) {
        *self.stamps.lock().unwrap_or_else(|p| p.into_inner()) = Some(Stamps {
            now,
            modified: Default::default(),
        });
    }

    fn stamp(&self, location: &Path) {
        if let Some(s) = self
            .stamps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            let at = (s.now)();
            s.modified.insert(location.to_string(), at);
        }
    }

    fn stamping(&self) -> bool {
        self.stamps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Follows every put and delete (see [`StoreEvent`]).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<StoreEvent> {
        self.events.subscribe()
    }

    fn announce(&self, location: &Path, delete: bool, applied: bool) {
        self.events.send_modify(|e| {
            e.seq += 1;
            e.key = location.to_string();
            e.delete = delete;
            e.applied = applied;
        });
    }

    pub fn set_faults(&self, faults: ObjectFaults) {
        self.lock().faults = faults;
    }

    /// Faults injected so far.
    pub fn injected_faults(&self) -> u64 {
        self.lock().injected
    }

    /// The store without faults, for checking what really is stored.
    pub fn truth(&self) -> Arc<dyn ObjectStore> {
        Arc::clone(&self.inner)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Draws latency, failure before and failure after.
    fn draw(&self) -> (Duration, bool, bool) {
        let mut s = self.lock();
        let f = s.faults;
        let lo = f.min_latency.as_micros() as u64;
        let hi = (f.max_latency.as_micros() as u64).max(lo);
        let latency = Duration::from_micros(s.rng.random_range(lo..=hi));
        let before = f.fail_prob > 0.0 && s.rng.random_bool(f.fail_prob.min(1.0));
        let after =
            f.fail_after_write_prob > 0.0 && s.rng.random_bool(f.fail_after_write_prob.min(1.0));
        if before || after {
            s.injected += 1;
        }
        (latency, before, after)
    }

    async fn enter(&self, what: &str) -> Result<bool> {
        let (latency, before, after) = self.draw();
        tokio::time::sleep(latency).await;
        if before {
            return Err(injected(what));
        }
        Ok(after)
    }
}

#[async_trait]
impl ObjectStore for FaultyObjectStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.announce(location, false, false);
        let fail_after = self.enter("put").await?;
        let result = self.inner.put_opts(location, payload, opts).await?;
        self.stamp(location);
        self.announce(location, false, true);
        if fail_after {
            return Err(injected("put applied, answer lost"));
        }
        Ok(result)
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.enter("put_multipart").await?;
        let upload = self.inner.put_multipart_opts(location, opts).await?;
        let faults = self.lock().faults.multipart;
        if !faults && !self.stamping() {
            return Ok(upload);
        }
        Ok(Box::new(FaultyUpload {
            store: self.clone(),
            inner: upload,
            location: location.clone(),
            faults,
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.enter("get").await?;
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        if !self.lock().faults.deletes {
            return self.inner.delete_stream(locations);
        }
        let store = self.clone();
        locations
            .then(move |location| {
                let store = store.clone();
                async move {
                    let location = location?;
                    store.announce(&location, true, false);
                    let fail_after = store.enter("delete").await?;
                    let one = futures::stream::once(std::future::ready(Ok(location.clone())));
                    let mut deleted = store.inner.delete_stream(one.boxed());
                    if let Some(result) = deleted.next().await {
                        result?;
                    }
                    store.announce(&location, true, true);
                    if fail_after {
                        return Err(injected("delete applied, answer lost"));
                    }
                    Ok(location)
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        if !self.stamping() {
            return self.inner.list(prefix);
        }
        let stamps = Arc::clone(&self.stamps);
        self.inner
            .list(prefix)
            .map(move |meta| {
                let mut meta = meta?;
                if let Some(s) = stamps.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                    if let Some(at) = s.modified.get(meta.location.as_ref()) {
                        meta.last_modified = *at;
                    }
                }
                Ok(meta)
            })
            .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.enter("list").await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        let fail_after = self.enter("copy").await?;
        self.inner.copy_opts(from, to, options).await?;
        self.stamp(to);
        if fail_after {
            return Err(injected("copy applied, answer lost"));
        }
        Ok(())
    }
}

/// A multipart upload whose parts and completion fail at the store's rates.
struct FaultyUpload {
    store: FaultyObjectStore,
    inner: Box<dyn MultipartUpload>,
    location: Path,
    /// Whether the upload's requests fail (else it only stamps).
    faults: bool,
}

impl fmt::Debug for FaultyUpload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FaultyUpload")
    }
}

#[async_trait]
impl MultipartUpload for FaultyUpload {
    fn put_part(&mut self, data: PutPayload) -> object_store::UploadPart {
        if !self.faults {
            return self.inner.put_part(data);
        }
        let (latency, before, _) = self.store.draw();
        let part = self.inner.put_part(data);
        Box::pin(async move {
            tokio::time::sleep(latency).await;
            if before {
                return Err(injected("upload part"));
            }
            part.await
        })
    }

    async fn complete(&mut self) -> Result<PutResult> {
        let fail_after = self.faults && self.store.enter("complete multipart").await?;
        let result = self.inner.complete().await?;
        self.store.stamp(&self.location);
        if fail_after {
            return Err(injected("multipart completed, answer lost"));
        }
        Ok(result)
    }

    async fn abort(&mut self) -> Result<()> {
        self.inner.abort().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;

    #[tokio::test(start_paused = true)]
    async fn failures_before_and_after_writes() {
        let store = FaultyObjectStore::new(
            3,
            ObjectFaults {
                fail_after_write_prob: 1.0,
                ..ObjectFaults::default()
            },
        );
        let key = Path::from("a/b");
        let err = store
            .put_opts(&key, PutPayload::from_static(b"x"), PutMode::Create.into())
            .await
            .expect_err("answer lost");
        assert!(err.to_string().contains("injected"), "{err}");
        assert!(
            store.truth().head(&key).await.is_ok(),
            "the write took effect"
        );
        // A retry of a create-only write now finds the object: exactly once.
        store.set_faults(ObjectFaults::default());
        let again = store
            .put_opts(&key, PutPayload::from_static(b"x"), PutMode::Create.into())
            .await;
        assert!(
            matches!(again, Err(object_store::Error::AlreadyExists { .. })),
            "{again:?}"
        );

        store.set_faults(ObjectFaults {
            fail_prob: 1.0,
            ..ObjectFaults::default()
        });
        let key2 = Path::from("a/c");
        assert!(store
            .put(&key2, PutPayload::from_static(b"y"))
            .await
            .is_err());
        assert!(
            store.truth().head(&key2).await.is_err(),
            "a failed-before write has no effect"
        );
        assert_eq!(store.injected_faults(), 2);
    }

    use object_store::PutMode;
}
