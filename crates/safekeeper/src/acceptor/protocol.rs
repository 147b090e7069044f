//! The proposer-acceptor protocol on a safekeeper: greetings, votes, the
//! elected writer's truncation point, and appends, gathered into one write
//! and one fsync per batch (group commit).

use bytes::BytesMut;
use ferry_wal::proto::{
    AppendRequest, AppendResponse, FromSafekeeper, Greeting, GreetingResponse, ProposerElected,
    Restored, ToSafekeeper, VoteResponse,
};
use ferry_wal::{Lsn, Term};

use super::{refused, Acceptor, AcceptorError};

/// Most WAL gathered from a batch of appends before it is written out.
const MAX_PENDING_WAL_BYTES: usize = 8 << 20;
/// Appends smaller than this are copied together into one write.
const JOIN_BELOW_BYTES: usize = 32 << 10;

impl Acceptor {
    /// Greeting: checks that the writer writes our cluster's timeline with our
    /// geometry.
    pub fn handle_greeting(&self, greeting: &Greeting) -> Result<FromSafekeeper, AcceptorError> {
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
        Ok(FromSafekeeper::Greeting(GreetingResponse {
            term: self.state.term,
            node_id: self.config.node_id,
            restored: self.state.restored_up_to.map(|_| Restored {
                flush_lsn: self.flush_lsn(),
                ready: self.quarantine_over,
            }),
        }))
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

    /// Vote request: grants the vote iff `term` is above every term seen here,
    /// persisting the new term before answering.
    pub async fn handle_vote(&mut self, term: Term) -> Result<FromSafekeeper, AcceptorError> {
        if self.state.restored_up_to.is_some() {
            // It forgot the terms it voted in: a vote now could be a second
            // vote in one of them.
            return Err(refused(
                self.state.term,
                "restored from the backup: it votes again only once a writer brought it back",
            ));
        }
        self.flush().await?;
        let vote_given = self.state.term < term;
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

    /// Whether this safekeeper takes the elected writer's word, decided from
    /// its state and its WAL's end alone (nothing is written): a restored
    /// safekeeper only rejoins, at its end and after its quarantine; WAL of
    /// the writer's own term is never cut; committed WAL is never cut; the
    /// writer cannot start past our end.
    fn check_elected(&self, msg: &ProposerElected, flush_lsn: Lsn) -> Result<(), AcceptorError> {
        match (self.state.restored_up_to.is_some(), msg.rejoin) {
            (false, false) => {}
            (false, true) => {
                return Err(refused(
                    self.state.term,
                    "not a restored safekeeper (it rejoined already)",
                ))
            }
            (true, false) => {
                return Err(refused(
                    self.state.term,
                    "restored from the backup: only a writer that proved it is current may bring it back",
                ))
            }
            (true, true) => {
                // The writer greeted us after the quarantine and then heard
                // a quorum of the others in its term; our WAL is committed
                // WAL, so it is the writer's up to our end.
                if !self.quarantine_over {
                    return Err(refused(
                        self.state.term,
                        "restored from the backup: still in quarantine",
                    ));
                }
                if msg.start_streaming_at != flush_lsn {
                    return Err(refused(
                        self.state.term,
                        format!(
                            "a restored safekeeper rejoins at its end {flush_lsn}, not at {}",
                            msg.start_streaming_at
                        ),
                    ));
                }
            }
        }
        if self.last_log_term() == msg.term && flush_lsn > msg.start_streaming_at {
            return Err(refused(
                self.state.term,
                format!(
                    "already holds WAL of term {} up to {flush_lsn}, beyond {}",
                    msg.term, msg.start_streaming_at
                ),
            ));
        }
        if msg.start_streaming_at < self.commit_lsn {
            // The writer would lose committed WAL: never do it.
            tracing::error!(
                node = self.config.node_id,
                start = %msg.start_streaming_at,
                commit = %self.commit_lsn,
                "election asks to truncate committed WAL"
            );
            return Err(refused(
                self.state.term,
                format!(
                    "start_streaming_at {} is below commit_lsn {}: refusing to truncate committed WAL",
                    msg.start_streaming_at, self.commit_lsn
                ),
            ));
        }
        if msg.start_streaming_at > flush_lsn {
            return Err(refused(
                self.state.term,
                format!(
                    "start_streaming_at {} is beyond flush_lsn {flush_lsn}",
                    msg.start_streaming_at
                ),
            ));
        }
        Ok(())
    }

    /// The elected writer tells where our WAL stops agreeing with its own: cut the
    /// divergent tail, adopt its term history, and persist before answering.
    pub async fn handle_elected(
        &mut self,
        msg: &ProposerElected,
    ) -> Result<FromSafekeeper, AcceptorError> {
        if msg.term < self.state.term {
            return Err(refused(
                self.state.term,
                format!("term {} is stale", msg.term),
            ));
        }
        if !msg.term_history.is_well_formed() || msg.term_history.last_term() != msg.term {
            return Err(refused(self.state.term, "malformed term history"));
        }
        self.flush().await?;
        let flush_lsn = self.flush_lsn();
        self.check_elected(msg, flush_lsn)?;
        if self.state.durable_lsn > msg.start_streaming_at {
            // The recorded durable point goes down before the WAL does, so that
            // a crash in between never finds less WAL than recorded.
            self.state.durable_lsn = msg.start_streaming_at;
            self.state.commit_lsn = self.commit_lsn;
            self.control.persist(&self.state).await?;
        }
        self.wal.truncate(msg.start_streaming_at).await?;
        // The pair of `check_elected`'s refusal: committed WAL is never cut.
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
        self.control.persist(&self.state).await?;
        self.publish_backup();
        Ok(self.append_response())
    }

    /// Writes an append without flushing; [`Acceptor::flush_appends`] makes a
    /// batch durable with one fsync and produces the answer.
    pub async fn append_no_flush(&mut self, req: &AppendRequest) -> Result<(), AcceptorError> {
        if req.term < self.state.term {
            return Err(refused(
                self.state.term,
                format!("term {} is stale", req.term),
            ));
        }
        if req.term > self.state.term || self.state.term_history.last_term() != req.term {
            return Err(refused(
                self.state.term,
                format!("append of term {} before its election", req.term),
            ));
        }
        if !req.is_consistent() {
            return Err(refused(
                self.state.term,
                "append bounds do not match its payload",
            ));
        }
        if !req.wal.is_empty() {
            // Appends of one batch are gathered and written with one call at the
            // flush: one system call and one fsync for the whole batch.
            let expected = Lsn(self.wal.write_lsn().0 + self.pending_wal_bytes as u64);
            if req.begin_lsn != expected {
                return Err(refused(
                    self.state.term,
                    format!(
                        "WAL write at {} but the WAL ends at {expected}",
                        req.begin_lsn
                    ),
                ));
            }
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
        let commit = self.commit_lsn.max(self.pending_commit_lsn.min(flush_lsn));
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
    ) -> Result<Vec<FromSafekeeper>, AcceptorError> {
        let mut out = Vec::new();
        let mut appended = false;
        for msg in msgs {
            if appended && !matches!(msg, ToSafekeeper::Append(_)) {
                out.push(self.flush_appends().await?);
                appended = false;
            }
            let result = match msg {
                ToSafekeeper::Greeting(g) => self.handle_greeting(&g).map(Some),
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
