//! Changing the safekeeper set (`ferry safekeeper-set`): the configuration
//! kept in coordination (`/ferry/safekeepers`, replaced only by a
//! compare-and-swap on its version) and the change driver that moves it
//! through a joint configuration (the rules: `ferry_wal::membership`; the
//! invariant and its proof sketch: `docs/protocols/membership.md`).
//!
//! The driver, step by step:
//! 1. the joint configuration (old set, new set) is recorded by a
//!    compare-and-swap over the current one (a change already under way is
//!    resumed if it moves to the same set, else refused);
//! 2. it is handed to every safekeeper of both sets until a majority of the
//!    old set adopted it: from then on no writer of the old generation can
//!    commit, and the highest position among those answers (the sync
//!    position) covers everything it could have committed;
//! 3. it is handed to the new set again, with the highest term heard as a
//!    floor, until a majority of the new set reached the sync position (a
//!    writer of the joint configuration streams to the new members; a new
//!    member can also be pulled from a peer first), and every joining member
//!    did and votes again (not required for safety: so that the new set
//!    survives its first failure);
//! 4. the new set alone is recorded (compare-and-swap over the joint one)
//!    and handed out. A writer learns it from any safekeeper it greets.
//!
//! Stopping the driver anywhere is safe: running it again resumes; an abort
//! before step 4 records the old set alone in a higher generation. Every
//! step is idempotent, and a configuration of a higher generation seen on a
//! safekeeper (another driver raced this one) stops it.

use std::collections::BTreeMap;
use std::time::Duration;

use ferry_coord::{CoordError, Coordination, CreateMode};
use ferry_env::Network;
use ferry_wal::membership::{self, Configuration, Member, MembershipError, Position};
use ferry_wal::proto::{self, Configured, FromSafekeeper, ToSafekeeper};
use ferry_wal::{ClusterId, Term};
use tokio::io::AsyncWriteExt;

use crate::commit_record::ROOT;

/// Where the current configuration is kept.
pub const CONFIGURATION: &str = "/ferry/safekeepers";

/// What to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangeRequest {
    /// Safekeeper `old` leaves, `new` joins.
    Replace {
        old: u64,
        new: Member,
    },
    Add(Member),
    Remove(u64),
    /// Go back to the old set of the change under way.
    Abort,
    /// Finish the change under way (after an interrupted run).
    Finish,
}

/// Why a change did not happen or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    #[error("no safekeeper configuration is recorded in {CONFIGURATION}; record the current set first (`ferry safekeeper-set init`)")]
    NoConfiguration,
    #[error("a safekeeper configuration is already recorded ({0})")]
    AlreadyRecorded(String),
    #[error(transparent)]
    Membership(#[from] MembershipError),
    #[error("the configuration in {CONFIGURATION} is not valid: {0}")]
    Invalid(String),
    #[error(
        "another change replaced the configuration meanwhile (now {0}); nothing more was done"
    )]
    Raced(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{what} in the coordination store: {source}")]
    Coordination {
        what: &'static str,
        #[source]
        source: CoordError,
    },
}

fn coordination(what: &'static str) -> impl FnOnce(CoordError) -> ChangeError {
    move |source| ChangeError::Coordination { what, source }
}

/// The recorded configuration and the version a compare-and-swap names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub configuration: Configuration,
    pub version: i32,
}

/// The configuration recorded in coordination, if any.
pub async fn read_configuration(
    session: &dyn Coordination,
) -> Result<Option<Recorded>, ChangeError> {
    match session.get(CONFIGURATION).await {
        Ok((data, stat)) => {
            let configuration: Configuration =
                serde_json::from_slice(&data).map_err(|e| ChangeError::Invalid(e.to_string()))?;
            configuration
                .validate()
                .map_err(|e| ChangeError::Invalid(e.to_string()))?;
            Ok(Some(Recorded {
                configuration,
                version: stat.version,
            }))
        }
        Err(CoordError::NoNode { .. }) => Ok(None),
        Err(e) => Err(coordination("reading the safekeeper configuration")(e)),
    }
}

/// Records `next` if the recorded configuration is still at `expected`
/// (`None`: none recorded yet). An unknown outcome (connection loss) is
/// settled by reading back.
async fn compare_and_swap(
    session: &dyn Coordination,
    next: &Configuration,
    expected: Option<i32>,
) -> Result<i32, ChangeError> {
    let data = serde_json::to_vec(next).map_err(|e| ChangeError::Invalid(e.to_string()))?;
    let written = match expected {
        None => {
            ferry_coord::create_all(session, ROOT)
                .await
                .map_err(coordination("creating the ferry root"))?;
            session
                .create(CONFIGURATION, &data, CreateMode::Persistent)
                .await
                .map(|(_, stat)| stat.version)
        }
        Some(version) => session
            .set(CONFIGURATION, &data, Some(version))
            .await
            .map(|stat| stat.version),
    };
    match written {
        Ok(version) => Ok(version),
        Err(CoordError::NodeExists { .. } | CoordError::BadVersion { .. }) => {
            let now = read_configuration(session).await?;
            Err(ChangeError::Raced(
                now.map_or("none".into(), |r| r.configuration.describe()),
            ))
        }
        Err(CoordError::ConnectionLoss { .. }) => match read_configuration(session).await? {
            Some(r) if r.configuration == *next => Ok(r.version),
            now => Err(ChangeError::Raced(
                now.map_or("none".into(), |r| r.configuration.describe()),
            )),
        },
        Err(e) => Err(coordination("recording the safekeeper configuration")(e)),
    }
}

/// Records the first configuration of a cluster (generation 1) after each
/// member confirmed its node id; refused if one is recorded.
pub async fn init(
    session: &dyn Coordination,
    network: &dyn Network,
    cluster_id: &ClusterId,
    members: Vec<Member>,
    call_timeout: Duration,
) -> Result<Configuration, ChangeError> {
    if let Some(r) = read_configuration(session).await? {
        return Err(ChangeError::AlreadyRecorded(r.configuration.describe()));
    }
    let conf = Configuration::initial(members)?;
    // Each address must be the safekeeper the configuration names: asked
    // with the configuration itself, which each adopts.
    for m in &conf.members {
        configure(network, m, cluster_id, &conf, 0, call_timeout)
            .await
            .map_err(|e| ChangeError::Timeout(format!("safekeeper {m}: {e}")))?;
    }
    compare_and_swap(session, &conf, None).await?;
    Ok(conf)
}

/// How a change runs.
#[derive(Debug, Clone)]
pub struct ChangeOptions {
    pub cluster_id: ClusterId,
    /// The whole change gives up after this (the joint configuration stays
    /// recorded: run again to resume, or abort).
    pub timeout: Duration,
    /// Pause between rounds of asking the safekeepers.
    pub retry: Duration,
    /// Longest wait for one safekeeper's answer.
    pub call_timeout: Duration,
}

impl ChangeOptions {
    pub fn new(cluster_id: ClusterId) -> ChangeOptions {
        ChangeOptions {
            cluster_id,
            timeout: Duration::from_secs(600),
            retry: Duration::from_millis(200),
            call_timeout: Duration::from_secs(5),
        }
    }
}

/// The set a request moves `members` to.
fn target(members: &[Member], request: &ChangeRequest) -> Result<Vec<Member>, MembershipError> {
    let mut set = members.to_vec();
    let missing = |id: u64| MembershipError::Refused(format!("safekeeper {id} is not a member"));
    match request {
        ChangeRequest::Replace { old, new } => {
            let at = set.iter().position(|m| m.id == *old).ok_or(missing(*old))?;
            set[at] = new.clone();
        }
        ChangeRequest::Add(new) => set.push(new.clone()),
        ChangeRequest::Remove(id) => {
            let at = set.iter().position(|m| m.id == *id).ok_or(missing(*id))?;
            set.remove(at);
        }
        ChangeRequest::Abort | ChangeRequest::Finish => {}
    }
    Ok(set)
}

/// Runs a change to its end (see the module documentation); returns the
/// configuration recorded at the end. `progress` is told each step.
pub async fn change(
    session: &dyn Coordination,
    network: &dyn Network,
    request: ChangeRequest,
    options: &ChangeOptions,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Configuration, ChangeError> {
    let deadline = tokio::time::Instant::now() + options.timeout;
    let recorded = read_configuration(session)
        .await?
        .ok_or(ChangeError::NoConfiguration)?;
    let current = recorded.configuration;
    let mut version = recorded.version;
    let joint = match (&current.new_members, &request) {
        (Some(_), ChangeRequest::Abort) => {
            let aborted = current.aborted()?;
            compare_and_swap(session, &aborted, Some(version)).await?;
            progress(&format!("recorded {}", aborted.describe()));
            hand_out(network, &current.all_members(), &aborted, options, progress).await;
            return Ok(aborted);
        }
        (None, ChangeRequest::Abort | ChangeRequest::Finish) => {
            return Err(MembershipError::NoChange(current.generation).into())
        }
        (Some(_), ChangeRequest::Finish) => current,
        (Some(new), request) => {
            // The same change run again resumes; another one waits.
            if target(&current.members, request)? != *new {
                return Err(MembershipError::ChangeUnderWay {
                    generation: current.generation,
                    members: format!(
                        "{:?}",
                        current.members.iter().map(|m| m.id).collect::<Vec<_>>()
                    ),
                    new_members: format!("{:?}", new.iter().map(|m| m.id).collect::<Vec<_>>()),
                }
                .into());
            }
            current
        }
        (None, request) => {
            let joint = current.joint(target(&current.members, request)?)?;
            version = compare_and_swap(session, &joint, Some(version)).await?;
            progress(&format!("recorded {}", joint.describe()));
            joint
        }
    };
    // 2. A majority of the old set adopts the joint configuration.
    let everyone = joint.all_members();
    let (sync, sync_term) = loop {
        let answers = ask(network, &everyone, &joint, 0, options).await;
        raced(&joint, &answers)?;
        let adopted: BTreeMap<u64, &Configured> = answers
            .iter()
            .filter(|(_, c)| generation(c) == joint.generation)
            .map(|(id, c)| (*id, c))
            .collect();
        let old_majority = Configuration {
            new_members: None,
            ..joint.clone()
        }
        .is_quorum(|id| adopted.contains_key(&id));
        if old_majority {
            let sync = membership::sync_position(
                joint
                    .members
                    .iter()
                    .filter_map(|m| adopted.get(&m.id).map(|c| c.position)),
            )
            .unwrap_or(Position {
                last_log_term: 0,
                flush_lsn: ferry_wal::Lsn(0),
            });
            let term = adopted.values().map(|c| c.term).max().unwrap_or(0);
            break (sync, term);
        }
        wait(
            deadline,
            options,
            format!(
                "a majority of the old set did not take {} in time (answered: {:?}); the joint configuration stays recorded: run the change again to resume, or abort it",
                joint.describe(),
                adopted.keys().collect::<Vec<_>>()
            ),
        )
        .await?;
    };
    progress(&format!(
        "a majority of the old set took generation {}; the new set must reach {sync}",
        joint.generation
    ));

    // 3. A majority of the new set reaches the sync position.
    let new_members = joint.new_members.clone().unwrap_or_default();
    let joining: Vec<u64> = new_members
        .iter()
        .map(|m| m.id)
        .filter(|id| !joint.members.iter().any(|o| o.id == *id))
        .collect();
    loop {
        let answers = ask(network, &new_members, &joint, sync_term, options).await;
        raced(&joint, &answers)?;
        let at: BTreeMap<u64, Position> = answers
            .iter()
            .filter(|(_, c)| generation(c) == joint.generation)
            .map(|(id, c)| (*id, c.position))
            .collect();
        // Safety needs a majority of the new set at the sync position. The
        // driver also waits for every joining safekeeper to be there and
        // voting again (a pulled one is brought back by the writer first):
        // switched earlier, the new set would stop at its first failure.
        let joining_ready = joining.iter().all(|id| {
            answers.iter().any(|(a, c)| {
                a == id && generation(c) == joint.generation && c.position >= sync && !c.restored
            })
        });
        if membership::caught_up(&joint, sync, |id| at.get(&id).copied()) && joining_ready {
            break;
        }
        wait(
            deadline,
            options,
            format!(
                "a majority of the new set did not reach {sync} in time (positions: {at:?}); is a writer running, or were the new safekeepers pulled from a peer? The joint configuration stays recorded: run the change again to resume, or abort it"
            ),
        )
        .await?;
    }
    progress("a majority of the new set caught up");

    // 4. The switch.
    let switched = joint.switched()?;
    compare_and_swap(session, &switched, Some(version)).await?;
    progress(&format!("recorded {}", switched.describe()));
    hand_out(network, &everyone, &switched, options, progress).await;
    Ok(switched)
}

fn generation(c: &Configured) -> u32 {
    c.configuration.as_ref().map_or(0, |c| c.generation)
}

/// A safekeeper holds a configuration above `joint`'s: another change
/// moved on, and this one must not.
fn raced(joint: &Configuration, answers: &[(u64, Configured)]) -> Result<(), ChangeError> {
    match answers
        .iter()
        .find(|(_, c)| generation(c) > joint.generation)
    {
        Some((id, c)) => Err(ChangeError::Raced(format!(
            "safekeeper {id} holds {}",
            c.configuration
                .as_ref()
                .map_or("none".into(), |c| c.describe())
        ))),
        None => Ok(()),
    }
}

async fn wait(
    deadline: tokio::time::Instant,
    options: &ChangeOptions,
    why: String,
) -> Result<(), ChangeError> {
    if tokio::time::Instant::now() + options.retry > deadline {
        return Err(ChangeError::Timeout(why));
    }
    tokio::time::sleep(options.retry).await;
    Ok(())
}

/// Hands `conf` to `members` once, best effort (writers and later changes
/// spread it further); says who did not take it.
async fn hand_out(
    network: &dyn Network,
    members: &[Member],
    conf: &Configuration,
    options: &ChangeOptions,
    progress: &(dyn Fn(&str) + Sync),
) {
    let answers = ask(network, members, conf, 0, options).await;
    let missing: Vec<u64> = members
        .iter()
        .map(|m| m.id)
        .filter(|id| {
            !answers
                .iter()
                .any(|(a, c)| a == id && generation(c) >= conf.generation)
        })
        .collect();
    if !missing.is_empty() {
        progress(&format!(
            "safekeepers {missing:?} did not take generation {} yet (they learn it from the next writer or change)",
            conf.generation
        ));
    }
}

/// Asks each member in turn; the answers of those that answered.
async fn ask(
    network: &dyn Network,
    members: &[Member],
    conf: &Configuration,
    min_term: Term,
    options: &ChangeOptions,
) -> Vec<(u64, Configured)> {
    let mut answers = Vec::new();
    for m in members {
        match configure(
            network,
            m,
            &options.cluster_id,
            conf,
            min_term,
            options.call_timeout,
        )
        .await
        {
            Ok(c) => answers.push((m.id, c)),
            Err(e) => {
                tracing::debug!(member = %m, error = %e, "safekeeper did not take the configuration")
            }
        }
    }
    answers
}

/// One `Configure` call on its own connection.
async fn configure(
    network: &dyn Network,
    member: &Member,
    cluster_id: &ClusterId,
    conf: &Configuration,
    min_term: Term,
    call_timeout: Duration,
) -> Result<Configured, String> {
    let call = async {
        let mut conn = network
            .connect(&member.addr)
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        proto::write_frame(
            &mut conn,
            &ToSafekeeper::Configure {
                cluster_id: cluster_id.clone(),
                configuration: conf.clone(),
                min_term,
            },
        )
        .await
        .map_err(|e| e.to_string())?;
        conn.flush().await.map_err(|e| e.to_string())?;
        match proto::read_frame::<_, FromSafekeeper>(&mut conn).await {
            Ok(Some(FromSafekeeper::Configured(c))) if c.node_id == member.id => Ok(c),
            Ok(Some(FromSafekeeper::Configured(c))) => Err(format!(
                "the safekeeper at {} is node {}, not {}",
                member.addr, c.node_id, member.id
            )),
            Ok(Some(FromSafekeeper::Refused { reason, .. })) => Err(format!("refused: {reason}")),
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    };
    tokio::time::timeout(call_timeout, call)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {call_timeout:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(id: u64) -> Member {
        Member {
            id,
            addr: format!("sk{id}:1"),
        }
    }

    #[test]
    fn requests_name_their_target_set() {
        let set = vec![m(0), m(1), m(2)];
        assert_eq!(
            target(&set, &ChangeRequest::Replace { old: 2, new: m(3) }).expect("replace"),
            vec![m(0), m(1), m(3)]
        );
        assert_eq!(
            target(&set, &ChangeRequest::Add(m(3))).expect("add"),
            vec![m(0), m(1), m(2), m(3)]
        );
        assert_eq!(
            target(&set, &ChangeRequest::Remove(0)).expect("remove"),
            vec![m(1), m(2)]
        );
        assert!(target(&set, &ChangeRequest::Remove(9)).is_err());
        assert!(target(&set, &ChangeRequest::Replace { old: 9, new: m(3) }).is_err());
    }
}
