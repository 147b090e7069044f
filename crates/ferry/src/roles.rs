//! The roles of a distributed deployment: one process per safekeeper, one writer.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use ferry_env::{Network, TcpNetwork};
use ferry_safekeeper::wal_storage::Preallocation;
use ferry_wal::segment::{SegmentSize, DEFAULT_SEGMENT_BYTES};
use ferry_wal::ClusterId;
use ferry_writer::driver::{Writer, WriterConfig};
use ferry_writer::proposer::ProposerConfig;

use ferry_host::local::{start_safekeeper, SafekeeperSpec, TIMELINE_ID};

#[derive(Debug, clap::Args)]
pub struct SafekeeperArgs {
    /// Id of this safekeeper (unique in the quorum).
    #[arg(long)]
    id: u64,
    /// The cluster this safekeeper belongs to (1 to 64 of A-Z, a-z, 0-9, '-',
    /// '_'); recorded when it is created and checked at every start.
    #[arg(long, env = "FERRY_CLUSTER_ID")]
    cluster_id: ClusterId,
    /// Create the safekeeper if its data dir holds none. Only for a new cluster
    /// or member: a safekeeper whose data was lost must not come back empty
    /// (it could make the quorum forget committed WAL), so without this flag a
    /// missing safekeeper is an error.
    #[arg(long)]
    create: bool,
    /// Rebuild this safekeeper from the WAL backup (--wal-backup) if its data
    /// dir holds no control file (its data was lost: remove a damaged data
    /// dir first). It restores every whole segment and the newest partial
    /// segment's committed prefix, then does not vote until a writer proven
    /// current brings it back (after --restore-quarantine). With a control
    /// file present it starts as it is, so the flag may stay on.
    #[arg(long, conflicts_with = "create")]
    restore_from_backup: bool,
    /// Rebuild this safekeeper from a peer if its data dir holds no control
    /// file: the peers' addresses, comma-separated, tried in turn for up to
    /// 2 minutes. Only the WAL above the peer's removal horizon is copied
    /// (the WAL below is read from the backup when needed), so it takes time
    /// with the WAL the peers keep, not with the timeline. With
    /// --restore-from-backup too, the backup is the fallback. Like a restore,
    /// it does not vote until a writer proven current brings it back.
    #[arg(
        long,
        value_delimiter = ',',
        conflicts_with = "create",
        value_name = "ADDR,..."
    )]
    pull_from_peers: Vec<String>,
    /// ZooKeeper ensemble holding the cluster's safekeeper configuration
    /// (`ferry safekeeper-set`): a safekeeper whose data dir holds no control
    /// file and that the configuration names is pulled from the other
    /// members by itself (as with --pull-from-peers naming them).
    #[arg(long, env = "FERRY_ZOOKEEPER", conflicts_with = "create")]
    zookeeper: Option<String>,
    /// Address writers and replicas connect to.
    #[arg(long, default_value = "127.0.0.1:5454")]
    listen: String,
    /// Data directory (the safekeeper lives in `<data dir>/sk<id>`). Default:
    /// $FERRY_DATA_DIR.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// WAL segment size in bytes (a power of two, 64 KiB to 1 GiB); must be the
    /// same on every safekeeper and the writer.
    #[arg(long, default_value_t = DEFAULT_SEGMENT_BYTES)]
    segment_bytes: u64,
    /// When WAL segments are zero-filled ahead of time: auto (while commits are
    /// small, so that an fsync flushes data only), always or never (for
    /// copy-on-write file systems, where it does not help).
    #[arg(long, default_value_t = Preallocation::Auto)]
    wal_preallocation: Preallocation,
    /// HTTP status endpoint.
    #[arg(long, default_value = "127.0.0.1:7676")]
    http: String,
    #[command(flatten)]
    wal: ferry_host::local::WalServiceArgs,
}

#[derive(Debug, clap::Args)]
pub struct WriterArgs {
    /// The cluster whose safekeepers this writer writes to (they refuse others).
    #[arg(long, env = "FERRY_CLUSTER_ID")]
    cluster_id: ClusterId,
    /// Safekeeper addresses, comma-separated, in the same order for every writer.
    #[arg(long, value_delimiter = ',', required = true)]
    safekeepers: Vec<String>,
    /// WAL segment size in bytes; must match the safekeepers'.
    #[arg(long, default_value_t = DEFAULT_SEGMENT_BYTES)]
    segment_bytes: u64,
    /// HTTP status endpoint.
    #[arg(long, default_value = "127.0.0.1:7677")]
    http: String,
    /// Sync mode: get elected, wait until a quorum of safekeepers agrees on a
    /// common committed end of WAL, print it and exit (writes nothing).
    #[arg(long)]
    sync: bool,
    /// ZooKeeper ensemble (`host:port[,host:port...][/chroot]`, the chroot must
    /// exist) holding the cluster record, the last known commit and the table
    /// catalog. With it the writer serves the table and insert API on --http and
    /// refuses a WAL quorum younger than the known commit; without it, it
    /// serves only /status and /metrics.
    #[arg(long, env = "FERRY_ZOOKEEPER")]
    zookeeper: Option<String>,
    #[command(flatten)]
    back_pressure: ferry_host::local::BackPressureArgs,
    /// A replica whose feedback has not changed for this long no longer
    /// holds back-pressure (set it like the safekeepers' --replica-expiry).
    #[arg(long, default_value = "1day", value_parser = humantime::parse_duration)]
    replica_expiry: std::time::Duration,
    #[command(flatten)]
    api: ferry_host::api::ApiArgs,
}

pub async fn safekeeper(args: SafekeeperArgs) -> anyhow::Result<()> {
    let mut shutdown = ferry_host::signals::ShutdownSignal::install()?;
    // Flags and addresses first: nothing is touched if one of them is wrong.
    let segment = SegmentSize::new(args.segment_bytes)?;
    let data_dir = ferry_host::paths::data_dir(args.data_dir.as_deref(), "FERRY_DATA_DIR", None)?;
    let listener = TcpNetwork
        .bind(&args.listen)
        .await
        .with_context(|| format!("binding the safekeeper address {}", args.listen))?;
    let http_listener = ferry_host::http::bind(&args.http).await?;
    ferry_host::paths::create_dir(&data_dir)?;
    let _lock = ferry_host::lockfile::lock_dir(&data_dir)?;
    let mut pull_from = args.pull_from_peers.clone();
    if let (Some(connect), true) = (&args.zookeeper, pull_from.is_empty()) {
        pull_from = members_to_pull_from(connect, args.id).await?;
    }
    let spec = SafekeeperSpec {
        cluster_id: args.cluster_id.clone(),
        segment,
        preallocation: args.wal_preallocation,
        create: args.create,
        restore: args.restore_from_backup,
        pull_from: pull_from.clone(),
        server: ferry_safekeeper::server::ServerConfig {
            // Catches up from its peers while no writer runs: the
            // configuration's other members, else the --pull-from-peers list.
            peer_recovery: Some(ferry_safekeeper::recovery::PeerRecovery {
                network: Arc::new(TcpNetwork),
                peers: pull_from,
            }),
            ..args.wal.server_config(None)?
        },
    };
    let sk = start_safekeeper(&data_dir, args.id, listener, &spec).await?;
    let server = Arc::clone(&sk.server);
    let status_server = Arc::clone(&server);
    let sampled = Arc::clone(&server);
    let metrics = ferry_host::metrics::NodeMetrics::new(Default::default(), move || {
        let s = Arc::clone(&sampled);
        Box::pin(async move { ferry_host::metrics::safekeeper(&s.status().await) })
    });
    let status = move || {
        let s = Arc::clone(&status_server);
        async move { serde_json::to_value(s.status().await).unwrap_or_default() }
    };
    let http = ferry_host::http::serve(
        http_listener,
        ferry_host::http::node_routes(status, Arc::new(metrics)),
        None,
    )?;
    say!(
        "safekeeper {} listening on {}, status on http://{}/status",
        args.id,
        server.addr(),
        http.addr
    );
    let mut failure = server.failure();
    tokio::select! {
        _ = shutdown.recv() => {}
        reason = async { failure.wait_for(|f| f.is_some()).await.map(|f| f.clone().unwrap_or_default()) } => {
            anyhow::bail!("safekeeper stopped after a storage failure: {}", reason.unwrap_or_default());
        }
    }
    server.shutdown().await;
    say!("safekeeper {} stopped cleanly", args.id);
    Ok(())
}

/// The other members of the recorded safekeeper configuration when it
/// names safekeeper `id` (empty otherwise): who a lost `id` is pulled from.
async fn members_to_pull_from(connect: &str, id: u64) -> anyhow::Result<Vec<String>> {
    let sessions = ferry_coord::ZkSessions {
        options: ferry_coord::zk::ZkOptions::new(connect.to_string()),
        metrics: Arc::new(ferry_coord::CoordMetrics::default()),
    };
    let session = ferry_coord::SessionFactory::open(&sessions)
        .await
        .with_context(|| format!("connecting to ZooKeeper at {connect}"))?;
    let recorded = ferry_node::membership::read_configuration(&*session).await;
    session.close().await;
    Ok(match recorded? {
        Some(r) if r.configuration.contains(id) => r
            .configuration
            .all_members()
            .into_iter()
            .filter(|m| m.id != id)
            .map(|m| m.addr)
            .collect(),
        _ => Vec::new(),
    })
}

pub async fn writer(args: WriterArgs) -> anyhow::Result<()> {
    let mut shutdown = ferry_host::signals::ShutdownSignal::install()?;
    let segment = SegmentSize::new(args.segment_bytes)?;
    let n = args.safekeepers.len();
    anyhow::ensure!(n >= 1, "at least one safekeeper is needed");
    anyhow::ensure!(
        args.safekeepers.iter().all(|a| !a.trim().is_empty()),
        "--safekeepers has an empty address"
    );
    let token = args.api.token()?;
    let http_listener = if args.sync {
        None
    } else {
        Some(ferry_host::http::bind(&args.http).await?)
    };
    // Coordination: the cluster record must match, and the writer starts knowing
    // the last recorded commit (an election below it is refused).
    let coord_metrics = Arc::new(ferry_coord::CoordMetrics::default());
    let coordination = match &args.zookeeper {
        None => None,
        Some(connect) => {
            let sessions: Arc<dyn ferry_coord::SessionFactory> =
                Arc::new(ferry_coord::ZkSessions {
                    options: ferry_coord::zk::ZkOptions::new(connect.clone()),
                    metrics: Arc::clone(&coord_metrics),
                });
            let session = sessions
                .open()
                .await
                .with_context(|| format!("connecting to ZooKeeper at {connect}"))?;
            let recorded = ferry_node::membership::read_configuration(&*session).await?;
            if recorded.is_none() {
                // Once a configuration is recorded, it names the safekeepers
                // (changed by `ferry safekeeper-set`), not the flags.
                check_cluster_record(&*session, &args, n).await?;
            }
            let known = ferry_node::commit_record::read_wal_state(&*session).await?;
            let session = ferry_coord::RenewingSession::with(Arc::clone(&sessions), session);
            Some((sessions, session, known, recorded))
        }
    };
    let proposer_id = u128::from(std::process::id());
    let mut proposer = ProposerConfig::new(
        args.cluster_id.clone(),
        n,
        TIMELINE_ID,
        segment.bytes(),
        proposer_id,
    );
    let mut safekeepers = args.safekeepers.clone();
    if let Some((_, _, known, recorded)) = &coordination {
        proposer.min_term = known.term;
        proposer.known_commit_lsn = known.commit_lsn;
        if let Some(r) = recorded {
            let members = r.configuration.all_members();
            say!(
                "safekeepers from the recorded configuration, {} (--safekeepers is not used)",
                r.configuration.describe()
            );
            safekeepers = members.iter().map(|m| m.addr.clone()).collect();
            proposer.safekeepers = members.len();
            proposer.configuration = Some(r.configuration.clone());
        }
    }
    let n = safekeepers.len();
    let mut config = WriterConfig::new(safekeepers, proposer);
    config.back_pressure = args.back_pressure.limits();
    anyhow::ensure!(
        !args.replica_expiry.is_zero(),
        "--replica-expiry must be more than zero"
    );
    config.replica_expiry = args.replica_expiry;
    let writer = Arc::new(Writer::start(Arc::new(TcpNetwork), config));
    let Some(http_listener) = http_listener else {
        let (term, end) = writer.wait_synced().await?;
        say!("synced: safekeepers agree on committed end {end} (term {term})");
        if let Some(w) = Arc::into_inner(writer) {
            w.stop().await;
        }
        return Ok(());
    };
    let mut registry = prometheus_client::registry::Registry::default();
    let elections = ferry_host::metrics::count_elections(&mut registry, writer.subscribe());
    let status = writer.subscribe();
    // With coordination, the writer node: catalog, table and insert API,
    // commit record, registration for replicas.
    let mut node = None;
    if let Some((sessions, session, _, _)) = &coordination {
        node = Some(
            ferry_node::WriterNode::start(
                Arc::clone(&writer),
                Arc::clone(sessions),
                session.clone(),
                ferry_env::Cpu::BlockingPool,
                args.api.limits(),
                ferry_ingest::IngestMetrics::register(&mut registry),
            )
            .await
            .context("opening the table catalog")?,
        );
    }
    let recording = node.as_ref().map(ferry_node::WriterNode::recording);
    let status_recording = recording.clone();
    let status_route = move || {
        let mut s = serde_json::to_value(status.borrow().clone()).unwrap_or_default();
        if let Some(r) = &status_recording {
            s["commit_record"] = serde_json::to_value(r.borrow().clone()).unwrap_or_default();
        }
        async move { s }
    };
    let router = node
        .as_ref()
        .map_or_else(axum::Router::new, ferry_node::WriterNode::router);
    let sampled_writer = writer.subscribe();
    let sampled_coord = Arc::clone(&coord_metrics);
    let metrics = ferry_host::metrics::NodeMetrics::new(registry, move || {
        let mut out = ferry_host::metrics::writer(&sampled_writer.borrow());
        out.extend(ferry_host::metrics::coordination(&sampled_coord));
        if let Some(r) = &recording {
            out.extend(ferry_host::metrics::commit_record(&r.borrow()));
        }
        Box::pin(async move { out })
    });
    let router = router.merge(ferry_host::http::node_routes(
        status_route,
        Arc::new(metrics),
    ));
    let http = ferry_host::http::serve(http_listener, router, token)?;
    if let Some(node) = &mut node {
        node.register_for_peers(&http.addr);
    }
    say!(
        "writer for {n} safekeepers started, status on http://{}/status{}",
        http.addr,
        if coordination.is_some() {
            format!(", tables and inserts on http://{}/tables", http.addr)
        } else {
            "; no --zookeeper, so no table and insert API".into()
        }
    );
    let mut superseded = writer.subscribe();
    let outcome = tokio::select! {
        _ = shutdown.recv() => Ok(()),
        s = superseded.wait_for(|s| s.superseded_by.is_some() || s.refused.is_some()) => {
            // Another writer took over, or a term left by one long gone ended
            // this leadership: exit, so that a supervisor starts a new election.
            // A refusal (electing would lose committed WAL) needs an operator.
            match s.ok().map(|s| (s.superseded_by, s.refused.clone())) {
                Some((Some(term), _)) => Err(anyhow::anyhow!("writer superseded by term {term}; exiting")),
                Some((None, Some(why))) => Err(anyhow::anyhow!("writer refused to get elected: {why}")),
                _ => Err(anyhow::anyhow!("writer stopped unexpectedly")),
            }
        }
    };
    http.stop().await;
    elections.abort();
    if let Some(node) = node {
        node.stop().await;
    }
    outcome?;
    let writer = Arc::into_inner(writer)
        .context("the writer is still shared after the HTTP endpoint stopped")?;
    let status = writer.status();
    if !status.elected {
        // Nothing of this writer's term was acknowledged: there is nothing to
        // checkpoint, and waiting for an election could wait for ever.
        writer.stop().await;
        if let Some((_, session, _, _)) = &coordination {
            session.close().await;
        }
        say!("writer stopped before it was elected; nothing to checkpoint");
        return Ok(());
    }
    let term = status.term;
    // The checkpoint needs a quorum; a second signal stops without it.
    let end = tokio::select! {
        end = writer.shutdown() => end?,
        signal = shutdown.recv() => anyhow::bail!(
            "second {signal} signal: stopped without the shutdown checkpoint (acknowledged WAL is committed; the next writer recovers the rest)"
        ),
    };
    if let Some((_, session, _, _)) = &coordination {
        ferry_node::commit_record::record_wal_state(
            &*session.session().await?,
            ferry_node::commit_record::WalState {
                term,
                commit_lsn: end,
            },
        )
        .await?;
        session.close().await;
    }
    say!("writer stopped cleanly; shutdown checkpoint committed, WAL ends at {end}");
    Ok(())
}

/// The cluster record in coordination: written by the first writer, checked by
/// every later one (another cluster id, number of safekeepers, segment size,
/// or safekeeper addresses in another order is refused).
async fn check_cluster_record(
    session: &dyn ferry_coord::Coordination,
    args: &WriterArgs,
    n: usize,
) -> anyhow::Result<()> {
    use ferry_host::cluster::{ClusterRecord, ClusterState};
    let addrs: Vec<String> = args
        .safekeepers
        .iter()
        .map(|a| a.trim().to_string())
        .collect();
    let wanted = ClusterRecord {
        cluster_id: args.cluster_id.clone(),
        safekeepers: n,
        segment_bytes: args.segment_bytes,
        state: ClusterState::Ready,
        safekeeper_addrs: Some(addrs.clone()),
    };
    let Some(found) = ferry_host::cluster::read_record(session).await? else {
        return ferry_host::cluster::write_record(session, &wanted).await;
    };
    let same_cluster = ClusterRecord {
        safekeeper_addrs: None,
        ..found.clone()
    } == ClusterRecord {
        safekeeper_addrs: None,
        ..wanted.clone()
    };
    if !same_cluster {
        anyhow::bail!(
            "the coordination store belongs to cluster {} ({} safekeepers, {}-byte segments, {:?}); this writer was started for cluster {} ({n} safekeepers, {}-byte segments)",
            found.cluster_id,
            found.safekeepers,
            found.segment_bytes,
            found.state,
            args.cluster_id,
            args.segment_bytes
        );
    }
    match &found.safekeeper_addrs {
        // Recorded before addresses were: the first writer that knows them
        // records them.
        None => ferry_host::cluster::write_record(session, &wanted).await,
        Some(recorded) if *recorded == addrs => Ok(()),
        Some(recorded) => {
            let same_set = {
                let (mut a, mut b) = (recorded.clone(), addrs.clone());
                a.sort();
                b.sort();
                a == b
            };
            anyhow::bail!(
                "--safekeepers {} differs from the cluster record's {}{}: the order decides which safekeeper backs WAL up, and a change of members is not made by flags",
                addrs.join(","),
                recorded.join(","),
                if same_set { " (same safekeepers, another order)" } else { "" }
            )
        }
    }
}

/// How often a replica reads the recorded safekeeper set.
const SAFEKEEPER_SET_POLL: std::time::Duration = std::time::Duration::from_secs(5);

/// The members of the recorded safekeeper configuration (empty until one
/// is recorded), read every [`SAFEKEEPER_SET_POLL`]: a replica streams from
/// them, so a membership change (`ferry safekeeper-set`) needs no restart
/// of the replicas. Read failures keep the last list.
fn follow_safekeeper_set(
    catalog: ferry_ingest::Catalog,
) -> tokio::sync::watch::Receiver<Vec<String>> {
    let (tx, rx) = tokio::sync::watch::channel(Vec::new());
    tokio::spawn(async move {
        let mut every = tokio::time::interval(SAFEKEEPER_SET_POLL);
        while !tx.is_closed() {
            every.tick().await;
            let Ok(session) = catalog.session().await else {
                continue;
            };
            match ferry_node::membership::read_configuration(&*session).await {
                Ok(Some(recorded)) => {
                    let addrs: Vec<String> = recorded
                        .configuration
                        .all_members()
                        .into_iter()
                        .map(|m| m.addr)
                        .collect();
                    tx.send_if_modified(|current| {
                        let moved = *current != addrs;
                        if moved {
                            *current = addrs;
                        }
                        moved
                    });
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(error = %e, "reading the recorded safekeeper set"),
            }
        }
    });
    rx
}

/// What a replica checks before it registers: the cluster record is its
/// cluster's, its safekeepers are the cluster's, and its shard exists.
async fn check_replica_against_cluster(
    catalog: &ferry_ingest::Catalog,
    args: &ReplicaArgs,
) -> anyhow::Result<()> {
    let session = catalog
        .session()
        .await
        .context("reading the cluster record")?;
    let Some(record) = ferry_host::cluster::read_record(&*session).await? else {
        anyhow::bail!(
            "the coordination store holds no cluster record: start the cluster's writer first (it records cluster {})",
            args.cluster_id
        );
    };
    anyhow::ensure!(
        record.cluster_id == args.cluster_id,
        "the coordination store belongs to cluster {}; this replica was started for cluster {}",
        record.cluster_id,
        args.cluster_id
    );
    if let Some(mut recorded) = record.safekeeper_addrs.clone() {
        // Safekeepers a change added since are the cluster's too.
        if let Some(r) = ferry_node::membership::read_configuration(&*session).await? {
            recorded.extend(r.configuration.all_members().into_iter().map(|m| m.addr));
        }
        let strangers: Vec<&String> = args
            .safekeepers
            .iter()
            .filter(|a| !recorded.contains(&a.trim().to_string()))
            .collect();
        anyhow::ensure!(
            strangers.is_empty(),
            "--safekeepers names {} which the cluster record does not list (its safekeepers: {})",
            strangers
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(","),
            recorded.join(",")
        );
    }
    let tables = catalog.list().await.context("reading the table catalog")?;
    let shards = tables.iter().map(|t| t.def.shard_by.shards).max();
    if let Some(shards) = shards {
        anyhow::ensure!(
            args.shard < shards,
            "--shard {} does not exist: the tables have shards 0 to {} ({}); a replica of a shard no table has would hold WAL removal back for nothing",
            args.shard,
            shards - 1,
            tables
                .iter()
                .map(|t| format!("{} has {}", t.def.name, t.def.shard_by.shards))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// `ferry replica [FLAGS]` runs a replica; `ferry replica unregister`
/// forgets one that is gone for good.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ReplicaCommand {
    #[command(subcommand)]
    pub action: Option<ReplicaAction>,
    #[command(flatten)]
    pub run: Option<ReplicaArgs>,
}

#[derive(Debug, clap::Subcommand)]
pub enum ReplicaAction {
    /// Forgets a replica that is gone for good on every safekeeper (and,
    /// through them, the writer), so that it stops holding WAL removal and
    /// back-pressure at once instead of after --replica-expiry. A replica
    /// started again later with this shard and number registers anew (and
    /// reads removed WAL from the backup).
    Unregister(UnregisterArgs),
}

#[derive(Debug, clap::Args)]
pub struct UnregisterArgs {
    /// The shard of the replica to forget.
    #[arg(long)]
    shard: u32,
    /// Its number within the shard.
    #[arg(long)]
    replica: u32,
    /// Every safekeeper's address, comma-separated: each one forgets it.
    #[arg(long, value_delimiter = ',', required = true)]
    safekeepers: Vec<String>,
}

/// How long one safekeeper may take to answer an unregistration.
const UNREGISTER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub async fn unregister_replica(args: UnregisterArgs) -> anyhow::Result<()> {
    use ferry_env::Clock as _;
    use ferry_wal::proto::{self, ForgottenReplica, FromSafekeeper, ToSafekeeper};
    let forget = ForgottenReplica {
        shard_number: args.shard,
        replica_number: args.replica,
        // Feedback it sent up to now no longer counts; a newer one (the
        // replica started again) registers it anew.
        reply_time_micros: ferry_env::SystemClock.unix_micros(),
    };
    let mut failed = Vec::new();
    for addr in &args.safekeepers {
        let answer = tokio::time::timeout(UNREGISTER_TIMEOUT, async {
            let mut conn = TcpNetwork.connect(addr).await?;
            proto::write_frame(&mut conn, &ToSafekeeper::ForgetReplica(forget)).await?;
            tokio::io::AsyncWriteExt::flush(&mut conn).await?;
            match proto::read_frame::<_, FromSafekeeper>(&mut conn).await {
                Ok(Some(FromSafekeeper::Forgotten { was_registered })) => Ok(was_registered),
                Ok(Some(FromSafekeeper::Refused { reason, .. })) => {
                    Err(anyhow::anyhow!("refused: {reason}"))
                }
                Ok(other) => Err(anyhow::anyhow!("unexpected answer {other:?}")),
                Err(e) => Err(e.into()),
            }
        })
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer in {UNREGISTER_TIMEOUT:?}")));
        match answer {
            Ok(true) => say!(
                "{addr}: replica {} of shard {} forgotten",
                args.replica,
                args.shard
            ),
            Ok(false) => say!(
                "{addr}: replica {} of shard {} was not registered there",
                args.replica,
                args.shard
            ),
            Err(e) => {
                say!("{addr}: {e:#}");
                failed.push(addr.clone());
            }
        }
    }
    anyhow::ensure!(
        failed.is_empty(),
        "not every safekeeper forgot the replica ({} did not); it still holds WAL removal there: run the command again once they are reachable",
        failed.join(", ")
    );
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct ReplicaArgs {
    /// The cluster this replica belongs to; checked against the cluster
    /// record in coordination before the replica registers.
    #[arg(long, env = "FERRY_CLUSTER_ID")]
    cluster_id: ClusterId,
    /// The shard this replica holds (of every table; it must be below the
    /// largest table's shard count).
    #[arg(long)]
    shard: u32,
    /// Which replica of the shard (unique per shard).
    #[arg(long)]
    replica: u32,
    /// Safekeeper addresses to stream WAL from, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    safekeepers: Vec<String>,
    /// ZooKeeper ensemble (`host:port[,...][/chroot]`) with the table catalog;
    /// the replica registers itself there. Env: FERRY_ZOOKEEPER.
    #[arg(long, env = "FERRY_ZOOKEEPER")]
    zookeeper: String,
    /// Data directory (the replica lives in `<data dir>/s<shard>r<replica>`).
    /// Default: $FERRY_DATA_DIR.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// HTTP endpoint: /status, /metrics and the read API.
    #[arg(long, default_value = "127.0.0.1:7678")]
    http: String,
    /// Bearer token every HTTP request must carry. Env: FERRY_API_TOKEN.
    #[arg(long, env = "FERRY_API_TOKEN", hide_env_values = true)]
    api_token: Option<String>,
    /// Folders a `file://` export destination must lie in, comma-separated
    /// (created if missing; a request naming any other local folder is
    /// refused before anything is written). Default: `<data dir>/lake`.
    /// Env: FERRY_EXPORT_ROOTS.
    #[arg(long, value_delimiter = ',', env = "FERRY_EXPORT_ROOTS")]
    export_roots: Vec<PathBuf>,
    /// The size a table that exports itself makes its lake files near to:
    /// a partition whose rows stopped changing has its small parts merged
    /// on the replicas up to it, and the next increment replaces the
    /// lake's small files by the merged ones. MiB.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=16384))]
    lake_target_file_mib: u64,
    /// A replica without a state file (new, or its data dir lost) is first
    /// built from a copy of a peer replica of its shard: `auto` (the live
    /// replica of the shard furthest ahead, as registered in ZooKeeper; none
    /// registered: it starts empty and streams the WAL from the start) or the
    /// peer's HTTP `host:port`. It then streams WAL from the copy's position,
    /// so it needs no WAL the safekeepers removed. Ignored for a replica with
    /// a state file.
    #[arg(long, value_name = "auto|HOST:PORT")]
    bootstrap_from: Option<String>,
    /// What a copy checks beyond the crc32c of every part's bytes: `rows`
    /// decodes every part and checks its rows against its footer (a part
    /// the donor's disk damaged is refused; CPU-bound), `footers` checks
    /// the footers only (about twice as fast; rows are checked when read,
    /// merged or exported).
    #[arg(long, value_enum, default_value_t = BootstrapCheck::Rows)]
    bootstrap_check: BootstrapCheck,
    /// No WAL is applied while less than this is free on the data dir's
    /// file system (the WAL waits on the safekeepers, the writer's lag
    /// limits hold inserts back); applying resumes by itself once an eighth
    /// more is free: `512MiB`, `2GiB`, bytes, or `0` (never).
    #[arg(long, default_value = "1GiB", value_parser = ferry_host::paths::parse_byte_size)]
    min_free_disk: u64,
}

/// `--bootstrap-check`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum BootstrapCheck {
    Rows,
    Footers,
}

pub async fn replica(args: ReplicaArgs) -> anyhow::Result<()> {
    let mut shutdown = ferry_host::signals::ShutdownSignal::install()?;
    anyhow::ensure!(
        args.shard != ferry_replica::ALL_SHARDS,
        "--shard {} is reserved",
        args.shard
    );
    let token = match args.api_token.as_deref() {
        None | Some("") => None,
        Some(t) => Some(
            ferry_ingest::ApiToken::new(t)
                .map_err(|e| anyhow::anyhow!("--api-token / FERRY_API_TOKEN: {e}"))?,
        ),
    };
    let data_dir = ferry_host::paths::data_dir(args.data_dir.as_deref(), "FERRY_DATA_DIR", None)?;
    let http_listener = ferry_host::http::bind(&args.http).await?;
    let coord_metrics = Arc::new(ferry_coord::CoordMetrics::default());
    let sessions: Arc<dyn ferry_coord::SessionFactory> = Arc::new(ferry_coord::ZkSessions {
        options: ferry_coord::zk::ZkOptions::new(args.zookeeper.clone()),
        metrics: Arc::clone(&coord_metrics),
    });
    let catalog = ferry_ingest::Catalog::open(Arc::clone(&sessions))
        .await
        .with_context(|| format!("opening the table catalog at {}", args.zookeeper))?;
    check_replica_against_cluster(&catalog, &args).await?;
    ferry_host::paths::create_dir(&data_dir)?;
    let _lock = ferry_host::lockfile::lock_dir(&data_dir)?;
    let disk: Arc<dyn ferry_env::Disk> = Arc::new(
        ferry_env::RealDisk::open_root(&data_dir)
            .with_context(|| format!("opening {}", data_dir.display()))?,
    );
    let dir = format!("s{}r{}", args.shard, args.replica);
    let destinations: Arc<dyn ferry_export::Destinations> =
        Arc::new(ferry_export::StorageDestinations::new(
            ferry_host::s3_settings_from_env(),
            ferry_host::paths::export_roots(&args.export_roots, &data_dir)?,
        ));
    let exporter_name = dir.clone();
    let registered_as = ferry_export::peers::replica_node(args.shard, args.replica);
    let peers = Arc::new(ferry_export::peers::Peers::new(
        catalog.renewing_session(),
        registered_as.clone(),
        Arc::new(ferry_node::http::HttpPeers::new(
            Arc::new(TcpNetwork),
            args.api_token.clone(),
        )),
    ));
    if let Some(from) = &args.bootstrap_from {
        let built = tokio::select! {
            _ = shutdown.recv() => return Ok(()),
            built = copy_from_peer(&args, from, &disk, &dir, &peers) => built?,
        };
        if let Some(b) = built {
            say!(
                "replica {} of shard {} built from {} at {}: {} parts, {} copied ({} bytes)",
                args.replica,
                args.shard,
                b.donor,
                b.disk_consistent_lsn,
                b.parts,
                b.copied,
                b.bytes_copied
            );
        }
    }
    if args.bootstrap_from.is_none()
        && ferry_replica::replica::bootstrap::copy_unfinished(disk.as_ref(), &dir).await?
    {
        anyhow::bail!(
            "{} holds a copy from a peer replica that did not finish; start with --bootstrap-from auto (or the peer's HOST:PORT) to finish it, or remove that directory to start replica {} of shard {} empty",
            data_dir.join(&dir).display(),
            args.replica,
            args.shard
        );
    }
    let mut node = ferry_node::ReplicaNode::start(
        ferry_node::ReplicaNodeConfig {
            dir: dir.clone(),
            shard: args.shard,
            replica: args.replica,
            wal: ferry_node::WalSource::Safekeepers {
                network: Arc::new(TcpNetwork),
                config: ferry_replica::StreamConfig {
                    space: (args.min_free_disk > 0).then(|| {
                        ferry_env::space::SpaceBreaker::new(
                            format!("replica {} of shard {}", args.replica, args.shard),
                            args.min_free_disk,
                        )
                    }),
                    members: Some(follow_safekeeper_set(catalog.clone())),
                    ..ferry_replica::StreamConfig::new(args.safekeepers.clone())
                },
            },
            merges: Some(ferry_node::replica::REPLACED_PART_GRACE),
            export: Some(ferry_node::ExportSeams {
                config: ferry_export::ExporterConfig::new(exporter_name.clone()),
                sessions: Arc::clone(&sessions),
                destinations: Arc::clone(&destinations),
            }),
        },
        ferry_node::ReplicaSeams {
            disk,
            clock: Arc::new(ferry_env::SystemClock),
            cpu: ferry_env::Cpu::BlockingPool,
            tables: Arc::new(ferry_host::reads::CatalogTables(catalog.clone())),
        },
    )
    .await
    .with_context(|| format!("opening the replica in {}", data_dir.join(&dir).display()))?;
    let mut status_rx = node.reader.status.clone();
    let shared = Arc::clone(&node.replica);
    let reads = Arc::new(ferry_host::reads::Reads {
        catalog: catalog.clone(),
        replicas: vec![node.reader.clone()],
    });
    // Exports: this replica's exporter, and requests that snapshot the
    // other shards through their replicas (crate::peers).
    let local_parts = Arc::clone(&node.parts);
    let request_parts: Arc<dyn ferry_export::LocalParts> = Arc::new(
        ferry_export::ReplicaSet::new(vec![Arc::clone(&shared)])
            .with_remote(Arc::clone(&peers) as Arc<dyn ferry_export::RemoteShards>),
    );
    let export_view = node
        .exports
        .clone()
        .context("the replica node runs an exporter")?;
    let commit_peers = Arc::clone(&peers);
    let export_api = Arc::new(ferry_node::exports::ExportApi {
        session: catalog.renewing_session(),
        sessions: Arc::clone(&sessions),
        parts: request_parts,
        local: local_parts,
        destinations,
        replica_name: exporter_name.clone(),
        clock: Arc::new(ferry_env::SystemClock),
        commit_lsn: Arc::new(move || {
            let peers = Arc::clone(&commit_peers);
            Box::pin(async move { peers.commit_lsn().await })
        }),
        target_file_bytes: args.lake_target_file_mib << 20,
        maintain: {
            let peers = Arc::clone(&peers);
            Arc::new(move |table, record| {
                let peers = Arc::clone(&peers);
                Box::pin(async move { peers.maintain(&table, &record).await })
            })
        },
        view: export_view.clone(),
        // The edge's randomness: transaction ids only need to differ.
        ids: ferry_node::exports::TransactionIds::new(rand::random()),
    });
    // Tables that export themselves: one replica node runs each table's rounds.
    let policies = ferry_node::exports::Policies::start(&export_api);
    let status_replica = status_rx.clone();
    let status_policies = policies.status.clone();
    let status = move || {
        let s = status_replica.borrow().clone();
        let policies = status_policies.borrow().tables.clone();
        async move {
            let mut v = serde_json::to_value(s).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert(
                    "export_policies".into(),
                    serde_json::to_value(policies).unwrap_or_default(),
                );
            }
            v
        }
    };
    let sampled = status_rx.clone();
    let sampled_coord = Arc::clone(&coord_metrics);
    let sampled_policies = policies.status.clone();
    let metrics = ferry_host::metrics::NodeMetrics::new(Default::default(), move || {
        let mut out = ferry_host::metrics::replica(&sampled.borrow());
        out.extend(ferry_host::metrics::export_policies(
            &sampled_policies.borrow(),
        ));
        out.extend(ferry_host::metrics::coordination(&sampled_coord));
        out.extend(ferry_host::metrics::exporter(
            &exporter_name,
            &export_view.borrow(),
        ));
        Box::pin(async move { out })
    });
    let donor = Arc::new(ferry_replica::replica::bootstrap::LocalDonor {
        replica: Arc::clone(&shared),
        clock: Arc::new(ferry_env::SystemClock),
        name: registered_as.clone(),
    });
    let router = ferry_host::reads::router(reads)
        .merge(ferry_node::exports::router(export_api))
        .merge(ferry_node::bootstrap::router(donor))
        .merge(ferry_host::http::node_routes(status, Arc::new(metrics)));
    let http = ferry_host::http::serve(http_listener, router, token)?;
    let registered_http = http.addr.clone();
    let registration = tokio::spawn(ferry_export::peers::register(
        catalog.renewing_session(),
        registered_as.clone(),
        status_rx.clone(),
        move |s: &ferry_replica::ReplicaStatus| ferry_export::peers::Registration {
            http: registered_http.clone(),
            disk_consistent_lsn: Some(s.disk_consistent_lsn.to_string()),
        },
    ));
    say!(
        "replica {} of shard {} streaming from {}, reads and status on http://{}/status, registered as {registered_as}",
        args.replica,
        args.shard,
        args.safekeepers.join(","),
        http.addr
    );
    let outcome = tokio::select! {
        _ = shutdown.recv() => Ok(()),
        e = node.stopped() => {
            let hint = matches!(
                &e,
                ferry_node::ReplicaNodeStopped::Replica(ferry_replica::ReplicaError::WalRemoved { .. })
            );
            let e = anyhow::Error::new(e);
            Err(if hint {
                e.context(format!(
                    "replica {} of shard {} cannot be built from the WAL: start it with --bootstrap-from auto to copy a peer replica (a replica with a state file is never overwritten: move its folder {} aside first)",
                    args.replica,
                    args.shard,
                    data_dir.join(&dir).display()
                ))
            } else {
                e
            })
        }
    };
    policies.stop().await;
    node.stop().await;
    registration.abort();
    http.stop().await;
    let _ = status_rx.borrow_and_update();
    catalog.close().await;
    outcome?;
    say!(
        "replica stopped cleanly at {}",
        status_rx.borrow().disk_consistent_lsn
    );
    Ok(())
}

/// How many times a copy from a peer is tried before the replica gives up.
const COPY_ATTEMPTS: u32 = 5;
/// The pause between two tries.
const COPY_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

/// Builds the replica from a peer's copy when it has no state file (see
/// `--bootstrap-from`); `None` when it needs none or no peer is registered.
async fn copy_from_peer(
    args: &ReplicaArgs,
    from: &str,
    disk: &Arc<dyn ferry_env::Disk>,
    dir: &str,
    peers: &ferry_export::peers::Peers,
) -> anyhow::Result<Option<ferry_replica::replica::bootstrap::Bootstrapped>> {
    use ferry_replica::replica::bootstrap;
    if !bootstrap::needs_copy(disk.as_ref(), dir).await? {
        return Ok(None);
    }
    let http = ferry_node::http::HttpPeers::new(Arc::new(TcpNetwork), args.api_token.clone());
    let mut last_error = String::new();
    for attempt in 1..=COPY_ATTEMPTS {
        let donors: Vec<String> = if from == "auto" {
            let found = peers.replicas_of(args.shard).await.map_err(|e| {
                anyhow::anyhow!("looking for a peer replica of shard {}: {e}", args.shard)
            })?;
            if found.is_empty() && bootstrap::copy_unfinished(disk.as_ref(), dir).await? {
                // A copy began from a peer that is not registered now: the
                // replica cannot start empty over it.
                last_error = format!(
                    "no other replica of shard {} is registered, and the copy begun from one must finish",
                    args.shard
                );
                say!("{last_error}: waiting (attempt {attempt} of {COPY_ATTEMPTS})");
                tokio::time::sleep(COPY_RETRY).await;
                continue;
            }
            if found.is_empty() {
                say!(
                    "no other replica of shard {} is registered: replica {} starts empty and streams the WAL from its start",
                    args.shard,
                    args.replica
                );
                return Ok(None);
            }
            found.into_iter().map(|(_, r)| r.http).collect()
        } else {
            vec![from.to_string()]
        };
        for addr in donors {
            let source = ferry_node::bootstrap::HttpDonor {
                peers: http.clone(),
                addr: addr.clone(),
            };
            say!(
                "replica {} of shard {} has no state: copying replica {addr} (attempt {attempt} of {COPY_ATTEMPTS})",
                args.replica,
                args.shard
            );
            match bootstrap::copy_from_peer(
                disk,
                dir,
                args.shard,
                args.replica,
                ferry_env::Cpu::BlockingPool,
                match args.bootstrap_check {
                    BootstrapCheck::Rows => bootstrap::CopyCheck::Rows,
                    BootstrapCheck::Footers => bootstrap::CopyCheck::Footers,
                },
                &source,
            )
            .await
            {
                Ok(built) => return Ok(Some(built)),
                Err(bootstrap::BootstrapError::Replica(e)) => {
                    return Err(anyhow::Error::new(e).context("writing the copy"))
                }
                Err(e) => {
                    tracing::warn!(donor = %addr, error = %e, "copying a peer replica failed");
                    last_error = e.to_string();
                }
            }
        }
        tokio::time::sleep(COPY_RETRY).await;
    }
    anyhow::bail!(
        "could not build the replica from a peer after {COPY_ATTEMPTS} attempts: {last_error}"
    )
}
