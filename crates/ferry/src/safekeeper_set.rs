//! `ferry safekeeper-set`: shows and changes the safekeeper set of a
//! distributed deployment (the configuration in ZooKeeper and on the
//! safekeepers; the driver is `ferry_node::membership`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry_env::TcpNetwork;
use ferry_node::membership::{self, ChangeOptions, ChangeRequest};
use ferry_wal::membership::Member;
use ferry_wal::ClusterId;

use ferry_host::say;

#[derive(Debug, clap::Args)]
pub struct SafekeeperSetArgs {
    #[command(subcommand)]
    pub action: SetAction,
    /// ZooKeeper ensemble holding the cluster's configuration.
    #[arg(long, env = "FERRY_ZOOKEEPER", global = true)]
    pub zookeeper: Option<String>,
    /// The cluster (safekeepers of another cluster refuse the change).
    #[arg(long, global = true)]
    pub cluster_id: Option<ClusterId>,
    /// Give up a change after this long (the joint configuration stays
    /// recorded: run the same change again to resume it, or abort it).
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration, global = true)]
    pub timeout: Duration,
}

#[derive(Debug, clap::Subcommand)]
pub enum SetAction {
    /// Prints the recorded configuration.
    Show,
    /// Records the current set as generation 1 (once per cluster; every
    /// safekeeper must answer as the id named): `--members 0=host:port,...`.
    Init {
        /// The current safekeepers, `ID=HOST:PORT` comma-separated, in the
        /// writers' order.
        #[arg(long, value_delimiter = ',', required = true, value_parser = parse_member)]
        members: Vec<Member>,
    },
    /// Replaces safekeeper `--old` by `--new ID=HOST:PORT` (start the new
    /// one first, best with `--pull-from-peers`).
    Replace {
        /// The id of the safekeeper that leaves.
        #[arg(long)]
        old: u64,
        /// The safekeeper that joins, `ID=HOST:PORT`.
        #[arg(long, value_parser = parse_member)]
        new: Member,
    },
    /// Adds safekeeper `ID=HOST:PORT`.
    Add {
        /// The safekeeper that joins, `ID=HOST:PORT`.
        #[arg(value_parser = parse_member)]
        member: Member,
    },
    /// Removes safekeeper `ID`.
    Remove {
        /// The id of the safekeeper that leaves.
        id: u64,
    },
    /// Goes back to the old set of the change under way.
    Abort,
    /// Finishes a change under way that an earlier run left unfinished.
    Finish,
}

/// `ID=HOST:PORT`.
fn parse_member(s: &str) -> Result<Member, String> {
    let (id, addr) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected ID=HOST:PORT"))?;
    let id: u64 = id
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: the id must be a number"))?;
    let addr = addr.trim();
    if addr.is_empty() || addr.len() > ferry_wal::membership::MAX_ADDR_BYTES {
        return Err(format!(
            "{s:?}: the address must be 1 to {} bytes",
            ferry_wal::membership::MAX_ADDR_BYTES
        ));
    }
    Ok(Member {
        id,
        addr: addr.to_string(),
    })
}

pub async fn run(args: SafekeeperSetArgs) -> anyhow::Result<()> {
    let connect = args
        .zookeeper
        .clone()
        .context("--zookeeper (or FERRY_ZOOKEEPER) is required: the configuration lives there")?;
    let sessions = ferry_coord::ZkSessions {
        options: ferry_coord::zk::ZkOptions::new(connect.clone()),
        metrics: Arc::new(ferry_coord::CoordMetrics::default()),
    };
    let session = ferry_coord::SessionFactory::open(&sessions)
        .await
        .with_context(|| format!("connecting to ZooKeeper at {connect}"))?;
    let cluster_id = || {
        args.cluster_id
            .clone()
            .context("--cluster-id is required for a change")
    };
    let progress = |step: &str| say!("{step}");
    let result = match args.action {
        SetAction::Show => match membership::read_configuration(&*session).await? {
            Some(r) => {
                say!("{}", r.configuration.describe());
                Ok(())
            }
            None => {
                say!("no configuration recorded (the writers' --safekeepers list is the set)");
                Ok(())
            }
        },
        SetAction::Init { members } => {
            let conf = membership::init(
                &*session,
                &TcpNetwork,
                &cluster_id()?,
                members,
                Duration::from_secs(5),
            )
            .await?;
            say!("recorded {}", conf.describe());
            Ok(())
        }
        action => {
            let request = match action {
                SetAction::Replace { old, new } => ChangeRequest::Replace { old, new },
                SetAction::Add { member } => ChangeRequest::Add(member),
                SetAction::Remove { id } => ChangeRequest::Remove(id),
                SetAction::Abort => ChangeRequest::Abort,
                _ => ChangeRequest::Finish,
            };
            let mut options = ChangeOptions::new(cluster_id()?);
            options.timeout = args.timeout;
            let conf =
                membership::change(&*session, &TcpNetwork, request, &options, &progress).await?;
            say!("done: {}", conf.describe());
            Ok(())
        }
    };
    session.close().await;
    result
}
