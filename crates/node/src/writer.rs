//! The writer node: a started [`Writer`] with what a writer serves around
//! it, assembled once for `ferry writer` and `ferry dev`: the table catalog,
//! the table and insert API over the writer, the commit record kept in
//! coordination ([`record_commits`]), and, for a distributed deployment, the
//! registration through which replicas find the writer's commit position.
//! The writer itself is started by the caller on its network seam (alone,
//! or inside an in-process quorum); its HTTP endpoint is the caller's too.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use ferry_coord::{RenewingSession, SessionFactory};
use ferry_env::Cpu;
use ferry_ingest::catalog::TableById;
use ferry_ingest::{Api, ApiLimits, Catalog, CatalogError, IngestMetrics, InsertSink};
use ferry_replica::{TableRef, Tables};
use ferry_writer::driver::Writer;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::commit_record::{record_commits, WalStateRecording};

/// The writer node; see the module doc.
pub struct WriterNode {
    writer: Arc<Writer>,
    catalog: Catalog,
    api: Arc<Api>,
    session: RenewingSession,
    recording: watch::Receiver<WalStateRecording>,
    recorder: JoinHandle<()>,
    registration: Option<JoinHandle<()>>,
}

impl WriterNode {
    /// Opens the catalog and starts the commit record on `session`; inserts
    /// decode on `cpu` within `limits`.
    pub async fn start(
        writer: Arc<Writer>,
        sessions: Arc<dyn SessionFactory>,
        session: RenewingSession,
        cpu: Cpu,
        limits: ApiLimits,
        metrics: Arc<IngestMetrics>,
    ) -> Result<WriterNode, CatalogError> {
        let catalog = Catalog::open(sessions).await?;
        let api = Api::new(
            catalog.clone(),
            Arc::clone(&writer) as Arc<dyn InsertSink>,
            cpu,
            limits,
            metrics,
        );
        let (recording_tx, recording) = watch::channel(WalStateRecording::default());
        let recorder = tokio::spawn(record_commits(
            session.clone(),
            writer.subscribe(),
            recording_tx,
        ));
        Ok(WriterNode {
            writer,
            catalog,
            api,
            session,
            recording,
            recorder,
            registration: None,
        })
    }

    /// The table and insert API, to merge into the node's HTTP routes.
    pub fn router(&self) -> axum::Router {
        ferry_ingest::api::router(Arc::clone(&self.api))
    }

    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    pub fn writer(&self) -> &Arc<Writer> {
        &self.writer
    }

    /// How the commit record fares (for `/status` and metrics).
    pub fn recording(&self) -> watch::Receiver<WalStateRecording> {
        self.recording.clone()
    }

    /// Registers this writer under its HTTP address, so that export requests
    /// on replicas can ask its commit position (`ferry_export::peers`).
    pub fn register_for_peers(&mut self, http_addr: &str) {
        let http = http_addr.to_string();
        let task = tokio::spawn(ferry_export::peers::register(
            self.catalog.renewing_session(),
            ferry_export::peers::writer_node(http_addr),
            self.writer.subscribe(),
            move |_| ferry_export::peers::Registration {
                http: http.clone(),
                disk_consistent_lsn: None,
            },
        ));
        if let Some(old) = self.registration.replace(task) {
            old.abort();
        }
    }

    /// Stops the commit record and the registration (the writer goes on:
    /// its clean stop is the caller's); returns the session the record was
    /// kept on, for the record of the shutdown checkpoint.
    pub async fn stop(self) -> RenewingSession {
        self.recorder.abort();
        let _ = self.recorder.await;
        if let Some(r) = self.registration {
            r.abort();
            let _ = r.await;
        }
        self.session
    }
}

/// The catalog as replicas look tables up. Ids unknown to a possibly lagging
/// coordination server are asked again a few times before they count as
/// never created.
pub struct CatalogTables(pub Catalog);

#[async_trait]
impl Tables for CatalogTables {
    async fn by_id(&self, id: u64) -> Result<TableRef, String> {
        for attempt in 0..5 {
            match self.0.by_id(id).await.map_err(|e| e.to_string())? {
                TableById::Known(t) => return Ok(TableRef::Known(t)),
                TableById::Dropped => return Ok(TableRef::Dropped),
                TableById::Unknown if attempt < 4 => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                TableById::Unknown => return Ok(TableRef::Unknown),
            }
        }
        Ok(TableRef::Unknown)
    }
}
