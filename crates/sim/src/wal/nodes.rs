//! The WAL workload's safekeepers: created once, started with settings drawn
//! at every start (through the shared [`crate::safekeepers`] harness),
//! crashed (most right after a write), crashed inside a partial upload, and
//! one of them losing its data dir and rebuilt from the backup or a peer.

use std::sync::Arc;
use std::time::Duration;

use ferry_env::Disk;
use ferry_node::SafekeeperOpen;
use ferry_safekeeper::acceptor::{Acceptor, AcceptorConfig};
use ferry_safekeeper::partial::PartialBackupConfig;
use ferry_safekeeper::wal_storage::Preallocation;
use ferry_wal::Lsn;
use rand::Rng;
use tokio::time::Instant;

use super::schedule::PULL_WRITE_BYTES;
use super::{cluster_id, node_name, Failure, PullPlan, Sim, SAFEKEEPERS, TIMELINE};
use crate::safekeepers::draw_backup_settings;
use crate::world::AfterAWrite;

/// Most safekeeper crashes wait for the next write, so they land between it
/// and its fsync.
const CRASH: AfterAWrite = AfterAWrite {
    prob: 0.7,
    within: Duration::from_secs(1),
};

impl Sim {
    pub(super) fn acceptor_config(&self, i: usize) -> AcceptorConfig {
        AcceptorConfig {
            cluster_id: cluster_id(),
            node_id: i as u64,
            timeline_id: TIMELINE,
            segment_size: Self::segment(),
            preallocation: self.preallocation[i],
        }
    }

    /// Creates safekeeper `i` on its empty disk (once, when the cluster is made).
    pub(super) async fn create_acceptor(&self, i: usize) -> Result<(), Failure> {
        let disk: Arc<dyn Disk> = Arc::new(self.safekeepers.disks[i].for_process());
        Acceptor::create(disk, &format!("sk{i}"), self.acceptor_config(i))
            .await
            .map(drop)
            .map_err(|e| self.fail(format!("sk{i} cannot be created: {e}")))
    }

    /// Opens safekeeper `i`'s acceptor from its disk, as a restart does: it
    /// must find its control file and every WAL record below its commit point.
    pub(super) async fn open_acceptor(&self, i: usize) -> Result<Acceptor, Failure> {
        let disk: Arc<dyn Disk> = Arc::new(self.safekeepers.disks[i].for_process());
        Acceptor::open(disk, &format!("sk{i}"), self.acceptor_config(i))
            .await
            .map_err(|e| self.fail(format!("sk{i} cannot recover from its disk: {e}")))
    }

    /// Starts safekeeper `i` from its disk (unless it waits for its
    /// restore), with its WAL preallocation policy and its backup, removal
    /// and partial backup settings drawn from the world's generator, in
    /// that order, at every start: preallocated and growing segments, and
    /// switches between them across restarts, all meet crashes.
    pub(super) async fn start_safekeeper(&mut self, i: usize) -> Result<(), Failure> {
        if self.restoring == Some(i) {
            self.log(format!("sk{i} waits for its restore"));
            return Ok(());
        }
        // A restart comes with a repaired disk.
        self.safekeepers.disks[i].set_failing(false);
        self.preallocation[i] = match self.world.rng.random_range(0..4) {
            0 => Preallocation::Always,
            1 => Preallocation::Never,
            _ => Preallocation::Auto,
        };
        let mut config = draw_backup_settings(&mut self.world.rng, &self.world.lake);
        config.restore_quarantine = Duration::from_secs(5);
        // Catches up from a peer of its term while no writer runs.
        config.peer_recovery = Some(ferry_safekeeper::recovery::PeerRecovery {
            network: self.world.net.node(&node_name(i)),
            peers: (0..SAFEKEEPERS)
                .filter(|&p| p != i)
                .map(node_name)
                .collect(),
        });
        config.partial_backup = self
            .world
            .rng
            .random_bool(0.7)
            .then(|| PartialBackupConfig {
                timeout: Duration::from_millis(self.world.rng.random_range(100..=3000)),
            });
        let described = format!(
            "WAL preallocation {}, {} backup jobs, keep-horizon {}, removal every {:?}, partial backup {:?}",
            self.preallocation[i],
            config.backup.as_ref().map_or(0, |b| b.parallel_jobs),
            config.walsenders_keep_horizon,
            config.removal_interval,
            config.partial_backup.map(|p| p.timeout)
        );
        let acceptor = self.acceptor_config(i);
        self.safekeepers
            .start(
                &mut self.world,
                i,
                SafekeeperOpen::Open,
                acceptor,
                config,
                "cannot recover from its disk",
                &described,
            )
            .await?;
        // A new incarnation restarts from its persisted commit_lsn.
        self.seen_commits[i] = Lsn(0);
        Ok(())
    }

    pub(super) async fn crash_safekeeper(&mut self, i: usize) {
        self.safekeepers
            .crash(&mut self.world, i, Some(CRASH))
            .await;
    }

    /// Loses safekeeper `i`'s data dir and rebuilds it from the backup or a
    /// peer (a rebuild may crash half way, find the backup incomplete or
    /// the peer gone; it is tried again later, see [`Sim::try_restore`]).
    pub(super) async fn lose_disk(&mut self, i: usize) -> Result<(), Failure> {
        if self.restored.is_some() || self.restoring.is_some() {
            self.log(format!(
                "sk{i} keeps its disk: one data dir is lost per run"
            ));
            return Ok(());
        }
        self.crash_safekeeper(i).await;
        self.safekeepers.disks[i].lose(&node_name(i));
        self.safekeepers.disks[i].set_failing(false);
        self.log(format!("sk{i} lost its data dir"));
        self.restoring = Some(i);
        self.try_restore().await
    }

    /// See [`super::Event::PullDuringCatchUp`].
    pub(super) async fn pull_during_catch_up(
        &mut self,
        lost: usize,
        writes: u32,
        plan: PullPlan,
    ) -> Result<(), Failure> {
        if self.restored.is_some() || self.restoring.is_some() {
            self.log(format!(
                "sk{lost} keeps its disk: one data dir is lost per run"
            ));
            return Ok(());
        }
        // Every safekeeper runs, the replica is cut from all.
        for i in 0..SAFEKEEPERS {
            if self.safekeepers.servers[i].is_none() {
                self.start_safekeeper(i).await?;
            }
            self.world.partition("replica", &node_name(i));
        }
        // Until the writes committed, one failed (the rest are not sent) or
        // the faults left no chance.
        let first = self.next_block;
        self.write(writes, PULL_WRITE_BYTES);
        let blocks = first..self.next_block;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline
            && !blocks.is_empty()
            && !self.acked.contains_key(&(blocks.end - 1))
            && !blocks.clone().any(|b| self.not_acked.contains(&b))
        {
            let step = (Instant::now() + Duration::from_millis(100)).min(deadline);
            self.run_until(step).await?;
        }
        // The lost safekeeper is lost in step with its peers (its flush, the
        // last the writer saw, bounds their peer horizon from then on), as
        // far as the faults let it be.
        let end = self.acked.values().copied().max().unwrap_or(Lsn(0));
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && !self.all_flushed_to(end).await {
            let step = (Instant::now() + Duration::from_millis(100)).min(deadline);
            self.run_until(step).await?;
        }
        // The writer's next messages carry the peer horizon to every one.
        let until = Instant::now() + Duration::from_millis(300);
        self.run_until(until).await?;
        self.pull_plan = Some(plan);
        self.lose_disk(lost).await?;
        // Whatever became of the pull, the replica is back.
        self.pull_plan = None;
        for i in 0..SAFEKEEPERS {
            self.world.heal("replica", &node_name(i));
        }
        Ok(())
    }

    /// Whether every safekeeper runs and flushed up to `end`.
    async fn all_flushed_to(&self, end: Lsn) -> bool {
        for server in &self.safekeepers.servers {
            let Some(server) = server else {
                return false;
            };
            let flushed = server.status().await.flush_lsn.parse::<Lsn>();
            if flushed.map_or(true, |f| f < end) {
                return false;
            }
        }
        true
    }

    /// One attempt to rebuild the lost safekeeper, pulled from a running
    /// peer or restored from the backup; on success it starts. A failed or
    /// crashed attempt leaves it down for the next one.
    pub(super) async fn try_restore(&mut self) -> Result<(), Failure> {
        let Some(i) = self.restoring else {
            return Ok(());
        };
        // Each attempt comes with a working disk (one that failed meanwhile
        // was replaced).
        self.safekeepers.disks[i].set_failing(false);
        let disk: Arc<dyn Disk> = Arc::new(self.safekeepers.disks[i].for_process());
        let config = self.acceptor_config(i);
        let dir = node_name(i);
        // Half of the attempts pull from a running peer (as `ferry
        // safekeeper --pull-from-peers` does), the others restore from the
        // backup; both may be cut by a crash.
        let donors: Vec<usize> = (0..SAFEKEEPERS)
            .filter(|&p| p != i && self.safekeepers.servers[p].is_some())
            .collect();
        let plan = self.pull_plan.take().filter(|_| !donors.is_empty());
        let donor = match plan.is_some() || self.pull_rng.random_bool(0.5) {
            true if !donors.is_empty() => Some(donors[self.pull_rng.random_range(0..donors.len())]),
            _ => None,
        };
        let net = self.world.net.node(&dir);
        let rebuild = async {
            match donor {
                Some(d) => ferry_safekeeper::pull::pull_from_peer(
                    Arc::clone(&disk),
                    &dir,
                    &config,
                    net.as_ref(),
                    &node_name(d),
                    Some(&self.world.lake),
                )
                .await
                .map(|r| {
                    (
                        r.start_lsn,
                        r.commit_lsn,
                        format!(
                            "pulled from sk{d}: WAL {}..{}, term {}",
                            r.start_lsn, r.commit_lsn, r.term
                        ),
                    )
                })
                .map_err(|e| {
                    (
                        matches!(e, ferry_safekeeper::pull::PullError::Exists(_)),
                        e.to_string(),
                    )
                }),
                None => ferry_safekeeper::restore::restore_from_backup(
                    Arc::clone(&disk),
                    &dir,
                    &config,
                    &self.world.lake,
                )
                .await
                .map(|r| {
                    (
                        Lsn(0),
                        r.restored_lsn,
                        format!(
                            "restored {} whole segments and partial {:?}: WAL up to {}",
                            r.whole_segments, r.partial, r.restored_lsn
                        ),
                    )
                })
                .map_err(|e| {
                    (
                        matches!(e, ferry_safekeeper::restore::RestoreError::Exists(_)),
                        e.to_string(),
                    )
                }),
            }
        };
        let result = match plan {
            // The puller's disk stalls once the copy began (the donor waits
            // for it, a connection's buffer ahead), and the replica comes
            // back meanwhile.
            Some(plan) => {
                let disk = self.safekeepers.disks[i].clone();
                let net = self.world.net.clone();
                let lag = async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    disk.stall_until(Instant::now() + plan.stall);
                    tokio::time::sleep(plan.heal).await;
                    for p in 0..SAFEKEEPERS {
                        net.heal("replica", &node_name(p));
                    }
                };
                Some(tokio::join!(rebuild, lag).0)
            }
            None => {
                let crash_after = self
                    .world
                    .rng
                    .random_bool(0.3)
                    .then(|| Duration::from_millis(self.world.rng.random_range(0..300)));
                match crash_after {
                    Some(after) => tokio::select! {
                        r = rebuild => Some(r),
                        () = tokio::time::sleep(after) => None,
                    },
                    None => Some(rebuild.await),
                }
            }
        };
        let how = if donor.is_some() { "pull" } else { "restore" };
        let (start, end, report) = match result {
            Some(Ok(done)) => done,
            Some(Err((true, e))) => {
                return Err(self.fail(format!(
                    "sk{i}: the {how} found a safekeeper on a lost disk: {e}"
                )));
            }
            // A donor holds its WAL removal at the copy's start until the
            // pull ends: a pull never finds WAL it copies removed.
            Some(Err((false, e))) if donor.is_some() && e.contains("was removed locally") => {
                return Err(self.fail(format!(
                    "sk{i}: the donor removed WAL the pull was copying: {e}"
                )));
            }
            Some(Err((false, e))) => {
                self.log(format!("sk{i} {how} failed: {e}"));
                return Ok(());
            }
            None => {
                self.world.crash_disk(&node_name(i));
                self.log(format!("sk{i} crashed during its {how}"));
                return Ok(());
            }
        };
        let acceptor = self.open_acceptor(i).await?;
        let rebuilt = acceptor
            .wal_reader()
            .read_all(start, end)
            .await
            .map_err(|e| self.fail(format!("sk{i} cannot read its rebuilt WAL: {e}")))?;
        drop(acceptor);
        self.log(format!("sk{i} {report}"));
        self.restored = Some((i, start, rebuilt));
        self.restoring = None;
        if donor.is_some() {
            self.pulled += 1;
        }
        // It forgot its votes: a rebuilt one starts from the term it was
        // given (0 from the backup, the donor's from a pull).
        self.seen_terms[i] = 0;
        self.start_safekeeper(i).await
    }

    /// See [`Event::CrashInPartialUpload`].
    pub(super) async fn crash_in_partial_upload(
        &mut self,
        i: usize,
        applied: bool,
    ) -> Result<(), Failure> {
        let Some(server) = self.safekeepers.servers[i].clone() else {
            return Ok(());
        };
        let mine = format!("_sk{i}.partial");
        let mut events = self.world.lake_store.subscribe();
        events.borrow_and_update();
        let seen = tokio::time::timeout(
            Duration::from_secs(3),
            events.wait_for(|e| e.key.ends_with(&mine) && e.applied == applied),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .map(|e| e.clone());
        let Some(event) = seen else {
            self.log(format!("sk{i} made no partial upload step in 3 s"));
            return Ok(());
        };
        // Nothing else runs in between: the safekeeper is killed before its
        // next step.
        server.kill().await;
        self.safekeepers.servers[i] = None;
        self.world.crash_disk(&node_name(i));
        self.log(format!(
            "sk{i} crashed {} {} of {}",
            if event.applied {
                "right after"
            } else {
                "as it sent"
            },
            if event.delete {
                "the delete"
            } else {
                "the put"
            },
            event.key
        ));
        self.start_safekeeper(i).await
    }
}
