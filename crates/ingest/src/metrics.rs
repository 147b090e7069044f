//! Prometheus metrics: the insert path's own counters and histograms, and
//! [`Sampled`] values read from a node's status at each scrape (fsyncs,
//! elections, coordination operations), encoded by `prometheus-client`.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InsertLabels {
    pub format: String,
    /// `ok`, or the error kind.
    pub outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub kind: String,
}

/// The insert path's metrics.
#[derive(Debug)]
pub struct IngestMetrics {
    pub inserts: Family<InsertLabels, Counter>,
    pub rows: Counter,
    pub bytes: Counter,
    pub insert_seconds: Histogram,
    pub commit_seconds: Histogram,
    pub errors: Family<ErrorLabels, Counter>,
}

impl IngestMetrics {
    pub fn register(registry: &mut Registry) -> Arc<IngestMetrics> {
        let m = IngestMetrics {
            inserts: Family::default(),
            rows: Counter::default(),
            bytes: Counter::default(),
            // 100 µs to about 100 s.
            insert_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 20)),
            commit_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 20)),
            errors: Family::default(),
        };
        registry.register(
            "ferry_inserts",
            "Insert requests by format and outcome",
            m.inserts.clone(),
        );
        registry.register(
            "ferry_insert_rows",
            "Rows committed by inserts",
            m.rows.clone(),
        );
        registry.register(
            "ferry_insert_bytes",
            "Request body bytes of committed inserts",
            m.bytes.clone(),
        );
        registry.register(
            "ferry_insert_duration_seconds",
            "Insert requests from body received to answer",
            m.insert_seconds.clone(),
        );
        registry.register(
            "ferry_wal_commit_duration_seconds",
            "From an insert's records handed to the writer until they are committed",
            m.commit_seconds.clone(),
        );
        registry.register("ferry_errors", "Errors answered by kind", m.errors.clone());
        Arc::new(m)
    }

    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&ErrorLabels { kind: kind.into() })
            .inc();
    }
}

/// One value read at scrape time.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: &'static str,
    pub help: &'static str,
    pub counter: bool,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

type SampleFn = dyn Fn() -> Vec<Sample> + Send + Sync;

/// Values a node already keeps in its status (fsyncs, terms, coordination
/// traffic), read when Prometheus scrapes instead of being copied eagerly.
pub struct Sampled(Box<SampleFn>);

impl Sampled {
    pub fn new(f: impl Fn() -> Vec<Sample> + Send + Sync + 'static) -> Sampled {
        Sampled(Box::new(f))
    }
}

impl std::fmt::Debug for Sampled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sampled")
    }
}

impl Collector for Sampled {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut samples = (self.0)();
        samples.sort_by(|a, b| a.name.cmp(b.name));
        let mut i = 0;
        while i < samples.len() {
            let first = &samples[i];
            let same = samples[i..]
                .iter()
                .take_while(|s| s.name == first.name)
                .count();
            let kind = if first.counter {
                prometheus_client::metrics::MetricType::Counter
            } else {
                prometheus_client::metrics::MetricType::Gauge
            };
            let mut family = encoder.encode_descriptor(first.name, first.help, None, kind)?;
            for s in &samples[i..i + same] {
                let metric = family.encode_family(&s.labels)?;
                if s.counter {
                    ConstCounter::new(s.value).encode(metric)?;
                } else {
                    ConstGauge::new(s.value).encode(metric)?;
                }
            }
            i += same;
        }
        Ok(())
    }
}

/// The text exposition of a registry.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}
