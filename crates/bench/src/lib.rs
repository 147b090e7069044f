//! ferry's benchmarks, run as `ferry bench <which>`: each prints its figures
//! next to the machine's own floor for the same work (the disk's fdatasync,
//! raw object_store writes, arrow's own decode), so the ratio says what
//! ferry adds. Figures are printed for people and never asserted; the test
//! suite runs every benchmark at a tiny size so that a hang fails it.

#[macro_use]
extern crate ferry_host;

mod coord;
mod copy;
mod dev_process;
mod export;
mod ingest;
mod lake;
mod membership;
mod rebuild;
mod scale;
mod vs_clickhouse;
mod wal;

pub use coord::CoordBenchArgs;
pub use copy::CopyBenchArgs;
pub use export::ExportBenchArgs;
pub use ingest::IngestBenchArgs;
pub use lake::LakeBenchArgs;
pub use scale::ScaleBenchArgs;
pub use wal::WalBenchArgs;

/// `ferry bench <which>`.
#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Coordination: embedded store ops/s, and ZooKeeper round trips of separate
    /// creates against one multi.
    Coord(CoordBenchArgs),
    /// WAL quorum: throughput and commit latency of 3 safekeepers on loopback,
    /// next to the disk's own fdatasync latency and sequential write rate.
    Wal(WalBenchArgs),
    /// Inserts: rows/s and MB/s through HTTP into committed WAL (NDJSON and
    /// Arrow IPC), next to arrow-json's and arrow-ipc's own decode rates and
    /// the WAL's throughput for the same bytes; with --vs-clickhouse, files
    /// of every format loaded into ClickHouse (chDB) and into `ferry dev`
    /// side by side: rows per CPU-second and peak memory.
    Ingest(IngestBenchArgs),
    /// Partition export: MB/s to a local folder (and S3 with --s3-endpoint)
    /// by 1 and 2 nodes next to raw object_store writes of the same files,
    /// and coordination round trips per part.
    Export(ExportBenchArgs),
    /// Partition export at scale: 100,000 one-row parts shared by 16
    /// exporters on ZooKeeper (--zookeeper) or the embedded store; the
    /// largest node, round trips per part, the status listing's cost, the
    /// wall time.
    ExportScale(ScaleBenchArgs),
    /// A table that exports itself (`ferry dev` as a child process): insert
    /// throughput with the export policy off and on, and acknowledged ->
    /// readable in the lake (p50, p99, max) next to the freshness target.
    Lake(LakeBenchArgs),
    /// A replica built from a peer's copy over HTTP (1 GiB of parts by
    /// default), next to a raw copy of the same files on the same disk.
    Copy(CopyBenchArgs),
}

/// Runs one benchmark to its end.
pub async fn run(which: BenchCommand) -> anyhow::Result<()> {
    match which {
        BenchCommand::Coord(args) => coord::coord(args).await,
        BenchCommand::Wal(args) => wal::wal(args).await,
        BenchCommand::Ingest(args) => ingest::ingest(args).await,
        BenchCommand::Export(args) => export::export(args).await,
        BenchCommand::ExportScale(args) => scale::export_scale(args).await,
        BenchCommand::Lake(args) => lake::lake(args).await,
        BenchCommand::Copy(args) => copy::copy(args).await,
    }
}
