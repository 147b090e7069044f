//! The proposer-acceptor protocol on a safekeeper: greetings, votes, the
//! elected writer's truncation point, and appends, gathered into one write
//! and one fsync per batch (group commit).

use bytes::BytesMut;
use ferry_wal::membership::{Configuration, Generation, Position};
use ferry_wal::proto::{
    AppendRequest, AppendResponse, Configured, FromSafekeeper, Greeting, GreetingResponse,
    ProposerElected, Restored, ToSafekeeper, VoteResponse,
};
use ferry_wal::{Lsn, Term};

use super::decide::{self, Positions};
use super::{refused, Acceptor, AcceptorError};

/// Most WAL gathered from a batch of appends before it is written out.
const MAX_PENDING_WAL_BYTES: usize = 8 << 20;
/// Appends smaller than this are copied together into one write.
const JOIN_BELOW_BYTES: usize = 32 << 10;

/// What a safekeeper remembers of one writer connection: the generation
/// its greeting carried (0 until it greets). Votes, elections, appends and
/// reads of a connection whose generation is older than the safekeeper's
/// are refused (`decide::generation_allows`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WriterSession {
    generation: Generation,
}

impl Acceptor {
    /// Greeting: checks that the writer writes our cluster's timeline with our
    /// geometry, adopts the writer's configuration if it is newer (persisted
    /// before the answer), and answers with ours.
    pub async fn handle_greeting(
        &mut self,
        greeting: &Greeting,
        session: &mut WriterSession,
    ) -> Result<FromSafekeeper, AcceptorError> {
        if greeting.cluster_id != self.config.cluster_id {
            return Err(refused(
                self.state.term,
                format!(
                    "cluster {} is not served here (this safekeeper belongs to cluster {})",
                    greeting.cluster_id, self.config.cluster_id
                ),
            ));
        }
        if greeting.timeline_id != self.config.timeline_id {
            return Err(refused(
                self.state.term,
                format!(
                    "timeline {} is not served here (this is timeline {})",
                    greeting.timeline_id, self.config.timeline_id
                ),
            ));
        }
        if greeting.segment_bytes != self.config.segment_size.bytes() {
            return Err(refused(
                self.state.term,
                format!(
                    "segment size {} differs from this safekeeper's {}",
                    greeting.segment_bytes,
                    self.config.segment_size.bytes()
                ),
            ));
        }
        // A first configuration comes from the change driver only (see
        // `decide::generation_allows`): a writer's greeting hands a newer
        // one to a safekeeper that holds one.
        if let (Some(offered), Some(_)) = (&greeting.configuration, &self.state.configuration) {
            if decide::adopt_configuration(
                self.state.term,
                self.state.configuration.as_ref(),
                offered,
            )? {
                self.persist_configuration(offered.clone(), None).await?;
            }
        }
        session.generation = decide::generation_of(greeting.configuration.as_ref());
        Ok(FromSafekeeper::Greeting(GreetingResponse {
            term: self.state.term,
            node_id: self.config.node_id,
            restored: self.state.restored_up_to.map(|_| Restored {
                flush_lsn: self.flush_lsn(),
                ready: self.quarantine_over,
            }),
            configuration: self.state.configuration.clone(),
        }))
    }

    /// The configuration this safekeeper holds (`None`: generation 0).
    pub fn configuration(&self) -> Option<&Configuration> {
        self.state.configuration.as_ref()
    }

    /// The membership change driver's message: adopts `configuration` if it
    /// is newer and raises the term to `min_term`, persisted before the
    /// answer, which tells where this safekeeper's WAL stands.
    pub async fn handle_configure(
        &mut self,
        cluster_id: &ferry_wal::ClusterId,
        configuration: &Configuration,
        min_term: Term,
    ) -> Result<FromSafekeeper, AcceptorError> {
        if *cluster_id != self.config.cluster_id {
            return Err(refused(
                self.state.term,
                format!(
                    "a configuration of cluster {cluster_id}: this safekeeper belongs to cluster {}",
                    self.config.cluster_id
                ),
            ));
        }
        let adopt = decide::adopt_configuration(
            self.state.term,
            self.state.configuration.as_ref(),
            configuration,
        )?;
        let raise = (min_term > self.state.term).then_some(min_term);
        if adopt || raise.is_some() {
            let conf = if adopt {
                configuration.clone()
            } else {
                // Raising the term alone keeps the configuration held.
                self.state
                    .configuration
                    .clone()
                    .unwrap_or_else(|| configuration.clone())
            };
            self.persist_configuration(conf, raise).await?;
        }
        Ok(self.configured())
    }

    /// Where this safekeeper stands: its configuration, term and WAL.
    fn configured(&self) -> FromSafekeeper {
        FromSafekeeper::Configured(Configured {
            node_id: self.config.node_id,
            configuration: self.state.configuration.clone(),
            term: self.state.term,
            position: Position {
                last_log_term: self.last_log_term(),
                flush_lsn: self.flush_lsn(),
            },
            commit_lsn: self.commit_lsn,
            restored: self.state.restored_up_to.is_some(),
        })
    }

    /// WAL a peer of the same term flushed, appended here while no writer
    /// runs (peer recovery: `crate::server`). The same rules as a writer's
    /// append: only in the term whose election this safekeeper accepted,
    /// only at its end; the commit_lsn the peer knows comes along. `None`:
    /// refused (a writer moved the term meanwhile, or the WAL moved); the
    /// new flush_lsn otherwise.
    pub async fn recovery_append(
        &mut self,
        term: Term,
        begin_lsn: Lsn,
        wal: bytes::Bytes,
        commit_lsn: Lsn,
    ) -> Result<Option<Lsn>, AcceptorError> {
        let end_lsn = Lsn(begin_lsn.0 + wal.len() as u64);
        if self.state.restored_up_to.is_some() {
            let named = self
                .state
                .configuration
                .as_ref()
                .is_none_or(|c| c.contains(self.config.node_id));
            if named || end_lsn > commit_lsn {
                return Ok(None);
            }
        }
        let req = AppendRequest {
            term,
            begin_lsn,
            end_lsn,
            commit_lsn: commit_lsn.min(end_lsn),
            truncate_lsn: Lsn(0),
            backup_lsn: Lsn(0),
            backup_duty: self.backup_view.borrow().duty,
            remote_consistent_lsn: None,
            probe: 0,
            wal,
        };
        match self.append_no_flush(&req).await {
            Ok(()) => {}
            Err(e) if e.is_refusal() => return Ok(None),
            Err(e) => return Err(e),
        }
        self.flush_appends().await?;
        Ok(Some(self.flush_lsn()))
    }

    /// Persists a configuration (and a raised term) after flushing pending
    /// WAL, as a vote does, so that the persisted positions stay consistent.
    async fn persist_configuration(
        &mut self,
        configuration: Configuration,
        term: Option<Term>,
    ) -> Result<(), AcceptorError> {
        self.flush().await?;
        let generation = decide::generation_of(self.state.configuration.as_ref());
        if configuration.generation >= generation {
            tracing::info!(
                node = self.config.node_id,
                configuration = %configuration.describe(),
                "adopting a safekeeper configuration"
            );
            self.state.configuration = Some(configuration);
        }
        if let Some(term) = term {
            self.state.term = self.state.term.max(term);
        }
        self.state.commit_lsn = self.commit_lsn;
        self.control.persist(&self.state).await?;
        Ok(())
    }

    /// Whether the writer of `session` may vote, elect, append or read here.
    fn check_generation(&self, session: &WriterSession) -> Result<(), AcceptorError> {
        decide::generation_allows(
            self.state.term,
            self.state.configuration.as_ref(),
            self.config.node_id,
            session.generation,
        )
    }

    /// Rebuilt from the backup up to this LSN and not brought back yet.
    pub fn restored_up_to(&self) -> Option<Lsn> {
        self.state.restored_up_to
    }

    /// The quarantine of a restored safekeeper is over: every election that
    /// could still hold one of its lost votes has ended, so a writer that
    /// greets it from now on may bring it back.
    pub fn end_quarantine(&mut self) {
        self.quarantine_over = true;
    }

    /// What the decisions in `decide` read of this acceptor, with the WAL's
    /// end as it stands now.
    fn positions(&self) -> Positions {
        Positions {
            term: self.state.term,
            history_term: self.state.term_history.last_term(),
            last_log_term: self.last_log_term(),
            flush_lsn: self.flush_lsn(),
            commit_lsn: self.commit_lsn,
            durable_lsn: self.state.durable_lsn,
            restored: self.state.restored_up_to.is_some(),
            quarantine_over: self.quarantine_over,
        }
    }

    /// Vote request: grants the vote iff `term` is above every term seen here,
    /// persisting the new term before answering.
    pub async fn handle_vote(&mut self, term: Term) -> Result<FromSafekeeper, AcceptorError> {
        decide::vote(&self.positions(), term)?;
        self.flush().await?;
        let vote_given = decide::vote(&self.positions(), term)?;
        if vote_given {
            self.state.term = term;
            // Persisted positions stay consistent: backup_lsn (which may have
            // moved in memory) never passes the persisted commit_lsn.
            self.state.commit_lsn = self.commit_lsn;
            self.control.persist(&self.state).await?;
        }
        let flush_lsn = self.flush_lsn();
        Ok(FromSafekeeper::Vote(VoteResponse {
            term: self.state.term,
            vote_given,
            flush_lsn,
            truncate_lsn: self.peer_horizon_lsn,
            term_history: self.state.term_history.up_to(flush_lsn),
            timeline_start_lsn: self.state.timeline_start_lsn,
        }))
    }

    /// The elected writer tells where our WAL stops agreeing with its own: cut the
    /// divergent tail, adopt its term history, and persist before answering.
    /// Whether to take its word is [`decide::elected`]'s answer; this performs
    /// the writes it plans, in its order.
    pub async fn handle_elected(
        &mut self,
        msg: &ProposerElected,
    ) -> Result<FromSafekeeper, AcceptorError> {
        decide::elected_message(&self.positions(), msg)?;
        self.flush().await?;
        let flush_lsn = self.flush_lsn();
        let plan = decide::elected(&self.positions(), msg)?;
        if let Some(lower) = plan.lower_durable_to {
            // The recorded durable point goes down before the WAL does, so that
            // a crash in between never finds less WAL than recorded.
            self.state.durable_lsn = lower;
            self.state.commit_lsn = self.commit_lsn;
            self.control.persist(&self.state).await?;
        }
        self.wal.truncate(plan.truncate_at).await?;
        // The pair of `decide::elected`'s refusal: committed WAL is never cut.
        assert!(
            self.wal.flush_lsn() >= self.commit_lsn,
            "the WAL was truncated to {} below commit_lsn {}",
            self.wal.flush_lsn(),
            self.commit_lsn
        );
        // Commit announcements of an older writer say nothing about this term's WAL.
        self.pending_commit_lsn = self.commit_lsn;
        // Probes count within one writer's term only.
        self.probe_seen = 0;
        self.state.term = msg.term;
        self.state.term_history = msg.term_history.clone();
        self.state.timeline_start_lsn = msg.timeline_start_lsn;
        self.state.commit_lsn = self.commit_lsn;
        self.state.peer_horizon_lsn = self.peer_horizon_lsn;
        if self.state.restored_up_to.take().is_some() {
            tracing::info!(
                node = self.config.node_id,
                term = msg.term,
                at = %flush_lsn,
                "restored safekeeper brought back by a writer"
            );
        }
        // A writer greeting again in its own term (it took a newer
        // configuration in place) changes nothing the file must hold
        // before the answer: the term, its history and the restore mark
        // are already there, and positions are saved lazily
        // (`maybe_persist`). Skipping the write keeps a membership
        // change from holding every append for a sync.
        let persisted = self.control.state();
        let same_term = persisted.term == self.state.term
            && persisted.term_history == self.state.term_history
            && persisted.timeline_start_lsn == self.state.timeline_start_lsn
            && persisted.restored_up_to == self.state.restored_up_to;
        if same_term {
            // The positions in `state` stay the ones on disk, which
            // `maybe_persist` measures its distance from.
            self.state.commit_lsn = persisted.commit_lsn;
            self.state.peer_horizon_lsn = persisted.peer_horizon_lsn;
        } else {
            self.control.persist(&self.state).await?;
        }
        self.publish_backup();
        Ok(self.append_response())
    }

    /// Writes an append without flushing; [`Acceptor::flush_appends`] makes a
    /// batch durable with one fsync and produces the answer.
    pub async fn append_no_flush(&mut self, req: &AppendRequest) -> Result<(), AcceptorError> {
        // Appends of one batch are gathered and written with one call at the
        // flush: one system call and one fsync for the whole batch, so the
        // WAL's end is what is written plus what is gathered.
        let wal_end = Lsn(self.wal.write_lsn().0 + self.pending_wal_bytes as u64);
        decide::append(&self.positions(), req, wal_end)?;
        if !req.wal.is_empty() {
            if self.pending_wal_bytes + req.wal.len() > MAX_PENDING_WAL_BYTES {
                self.write_pending().await?;
            }
            self.pending_wal_bytes += req.wal.len();
            self.pending_wal.push(req.wal.clone());
        }
        if !req.wal.is_empty() {
            self.appends_received += 1;
        }
        self.probe_seen = self.probe_seen.max(req.probe);
        self.pending_commit_lsn = self.pending_commit_lsn.max(req.commit_lsn);
        self.peer_horizon_lsn = self
            .peer_horizon_lsn
            .max(req.truncate_lsn.min(req.commit_lsn));
        if let Some(h) = req.remote_consistent_lsn {
            self.writer_replica_horizon = Some(h);
        }
        // A peer's uploads are in the same backup: its backup_lsn is ours to
        // rely on up to our own commit_lsn (adopted at the flush).
        if req.backup_lsn <= req.commit_lsn {
            self.peer_backup_lsn = self.peer_backup_lsn.max(req.backup_lsn);
        }
        self.backup_view.send_if_modified(|v| {
            let changed = v.duty != req.backup_duty;
            v.duty = req.backup_duty;
            changed
        });
        Ok(())
    }

    /// Flushes the WAL written so far (one fsync for the whole batch), advances
    /// commit_lsn and answers with the new positions.
    pub async fn flush_appends(&mut self) -> Result<FromSafekeeper, AcceptorError> {
        self.flush().await?;
        Ok(self.append_response())
    }

    async fn write_pending(&mut self) -> Result<(), AcceptorError> {
        // Small appends are joined into one write (one system call); a large one
        // is written from the frame it arrived in, without a copy.
        let mut small = BytesMut::new();
        for chunk in std::mem::take(&mut self.pending_wal) {
            if chunk.len() < JOIN_BELOW_BYTES {
                small.extend_from_slice(&chunk);
                continue;
            }
            if !small.is_empty() {
                let begin = self.wal.write_lsn();
                self.wal.write(begin, small.split().freeze()).await?;
            }
            let begin = self.wal.write_lsn();
            self.wal.write(begin, chunk).await?;
        }
        if !small.is_empty() {
            let begin = self.wal.write_lsn();
            self.wal.write(begin, small.freeze()).await?;
        }
        self.pending_wal_bytes = 0;
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), AcceptorError> {
        self.write_pending().await?;
        if self.wal.write_lsn() > self.wal.flush_lsn() {
            self.wal_fsyncs += 1;
        }
        let flush_lsn = self.wal.flush().await?;
        let commit =
            decide::commit_after_flush(self.commit_lsn, self.pending_commit_lsn, flush_lsn);
        assert!(commit >= self.commit_lsn, "commit_lsn went back");
        if commit > self.commit_lsn {
            self.commit_lsn = commit;
            self.commit_watch.send_replace(commit);
            self.maybe_persist().await?;
        }
        let shared = self.peer_backup_lsn.min(self.commit_lsn);
        if shared > self.state.backup_lsn {
            self.state.backup_lsn = shared;
        }
        self.publish_backup();
        Ok(())
    }

    fn append_response(&self) -> FromSafekeeper {
        FromSafekeeper::Append(AppendResponse {
            term: self.state.term,
            flush_lsn: self.flush_lsn(),
            commit_lsn: self.commit_lsn,
            backup_lsn: self.state.backup_lsn,
            probe: self.probe_seen,
            shard_feedback: self.feedback.all(),
            forgotten_replicas: self.feedback.forgotten(),
        })
    }

    /// Handles a batch of messages from the writer that arrived together: appends
    /// in a row share one fsync and one answer (group commit). Refusals become
    /// `Refused` answers; an `Err` is a storage failure and the safekeeper must stop.
    pub async fn handle_batch(
        &mut self,
        msgs: Vec<ToSafekeeper>,
        session: &mut WriterSession,
    ) -> Result<Vec<FromSafekeeper>, AcceptorError> {
        let mut out = Vec::new();
        let mut appended = false;
        for msg in msgs {
            if appended && !matches!(msg, ToSafekeeper::Append(_)) {
                out.push(self.flush_appends().await?);
                appended = false;
            }
            let writes = matches!(
                msg,
                ToSafekeeper::VoteRequest { .. }
                    | ToSafekeeper::Elected(_)
                    | ToSafekeeper::Append(_)
                    | ToSafekeeper::ReadWal { .. }
            );
            if writes {
                if let Err(e) = self.check_generation(session) {
                    out.push(e.to_message(self.state.term));
                    continue;
                }
            }
            let result = match msg {
                ToSafekeeper::Greeting(g) => self.handle_greeting(&g, session).await.map(Some),
                ToSafekeeper::Configure {
                    cluster_id,
                    configuration,
                    min_term,
                } => self
                    .handle_configure(&cluster_id, &configuration, min_term)
                    .await
                    .map(Some),
                ToSafekeeper::Position { cluster_id } if cluster_id == self.config.cluster_id => {
                    Ok(Some(self.configured()))
                }
                ToSafekeeper::Position { cluster_id } => Err(refused(
                    self.state.term,
                    format!("cluster {cluster_id} is not served here"),
                )),
                ToSafekeeper::VoteRequest { term } => self.handle_vote(term).await.map(Some),
                ToSafekeeper::Elected(e) => self.handle_elected(&e).await.map(Some),
                ToSafekeeper::Append(a) => match self.append_no_flush(&a).await {
                    Ok(()) => {
                        appended = true;
                        Ok(None)
                    }
                    Err(e) => Err(e),
                },
                ToSafekeeper::ReadWal {
                    term,
                    begin_lsn,
                    end_lsn,
                } => match self.read_range(term, begin_lsn, end_lsn, &mut out).await {
                    Ok(()) => Ok(None),
                    Err(e) => Err(e),
                },
                ToSafekeeper::Feedback(fb) => {
                    self.record_feedback(fb);
                    Ok(None)
                }
                ToSafekeeper::ForgetReplica(forget) => self.forget_replica(forget).await.map(Some),
                ToSafekeeper::StartReplication { .. } => Err(refused(
                    self.state.term,
                    "START_REPLICATION opens its own connection",
                )),
                ToSafekeeper::Pull(_) => {
                    Err(refused(self.state.term, "a pull opens its own connection"))
                }
            };
            match result {
                Ok(Some(reply)) => out.push(reply),
                Ok(None) => {}
                Err(e) if e.is_refusal() => out.push(e.to_message(self.state.term)),
                Err(e) => return Err(e),
            }
        }
        if appended {
            out.push(self.flush_appends().await?);
        }
        Ok(out)
    }
}
