//! Appends as the driver takes them: refused when too many wait, queued
//! behind the election, earlier appends or back-pressure, released in order,
//! and handed to the proposer (inserts get their block numbers here); and the
//! shutdown checkpoint, queued behind everything that waits.

use bytes::BytesMut;
use ferry_wal::record::Record;
use ferry_wal::Lsn;
use tokio::sync::oneshot;

use super::{Command, Driver, Insert, Pending, WriterError};
use crate::proposer::{Action, ProposerError};

impl Driver {
    pub(super) fn on_command(&mut self, cmd: Command) -> Vec<Action> {
        match cmd {
            Command::Append { records, reply } => {
                if self.waiters.len() + self.queued.len() >= self.config.max_pending_appends {
                    let _ = reply.send(Err(WriterError::Overloaded));
                    return Vec::new();
                }
                if let Some(safekeepers) = self.proposer.quorum_out_of_space() {
                    let _ = reply.send(Err(WriterError::DiskFull { safekeepers }));
                    return Vec::new();
                }
                // Behind waiting appends, or while a replica lags too far,
                // an append waits its turn.
                if self.proposer.is_elected() && self.queued.is_empty() && self.throttle().is_none()
                {
                    self.append_now(records, reply)
                } else {
                    self.queued.push_back((records, reply));
                    Vec::new()
                }
            }
            Command::Shutdown { reply, linger } => {
                self.linger_after_shutdown = linger;
                let checkpoint = Record::ShutdownCheckpoint {
                    term: self.proposer.term(),
                }
                .to_bytes();
                let (tx, rx) = oneshot::channel();
                self.shutdown = Some(reply);
                // The checkpoint's own waiter is not needed: completion is seen
                // through `shutdown` when commit reaches its end.
                drop(rx);
                // Behind everything that waits, which back-pressure no longer
                // holds back (`release_queued`).
                self.queued.push_back((Pending::Records(checkpoint), tx));
                self.release_queued()
            }
        }
    }

    /// The lag that holds appends back now, if any (never during a clean
    /// shutdown, nor while no replica reported).
    pub(super) fn throttle(&self) -> Option<(&'static str, u64)> {
        if self.shutdown.is_some() {
            return None;
        }
        let min = self.proposer.overall_minimum()?;
        self.config
            .back_pressure
            .exceeded(self.proposer.end_lsn(), &min)
    }

    /// Appends what waits, in order, while the writer is elected and no lag
    /// holds it back; each append moves the end of WAL, so the lag is checked
    /// again before the next.
    pub(super) fn release_queued(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        // Released together, they leave in one message per safekeeper.
        let batching = std::mem::replace(&mut self.batching, true);
        while self.proposer.is_elected() && self.throttle().is_none() {
            let Some((records, reply)) = self.queued.pop_front() else {
                break;
            };
            actions.extend(self.append_now(records, reply));
        }
        self.batching = batching;
        if !batching {
            actions.extend(self.proposer.send_pending());
        }
        actions
    }

    fn append_now(
        &mut self,
        pending: Pending,
        reply: oneshot::Sender<Result<Lsn, WriterError>>,
    ) -> Vec<Action> {
        if !self.proposer.is_elected() {
            self.queued.push_back((pending, reply));
            return Vec::new();
        }
        let records = match pending {
            Pending::Records(records) => records,
            Pending::Inserts { inserts, blocks } => {
                // Block numbers are the LSNs the records start at: known only now.
                let mut at = self.proposer.end_lsn().0;
                let mut numbers = Vec::with_capacity(inserts.len());
                let mut ends = Vec::with_capacity(inserts.len());
                let mut out = BytesMut::with_capacity(inserts.iter().map(Insert::record_len).sum());
                for i in inserts {
                    numbers.push(at);
                    at += i.into_record(at).encode(&mut out) as u64;
                    ends.push(out.len());
                }
                let _ = blocks.send(numbers);
                let records = out.freeze();
                let appended = self.proposer.append_encoded_unsent(&records, &ends);
                return self.appended(appended, reply);
            }
        };
        let appended = self.proposer.append_unsent(&records);
        self.appended(appended, reply)
    }

    /// Queues the reply of an append the proposer took (or answers why not).
    fn appended(
        &mut self,
        appended: Result<Lsn, ProposerError>,
        reply: oneshot::Sender<Result<Lsn, WriterError>>,
    ) -> Vec<Action> {
        match appended {
            Ok(end) => {
                self.waiters.push_back((end, reply));
                if self.batching {
                    Vec::new()
                } else {
                    self.proposer.send_pending()
                }
            }
            Err(ProposerError::InvalidRecords(e)) => {
                let _ = reply.send(Err(WriterError::InvalidRecords(e)));
                Vec::new()
            }
            Err(ProposerError::Superseded(term)) => {
                let _ = reply.send(Err(WriterError::Superseded { term }));
                Vec::new()
            }
            Err(ProposerError::NotElected) => {
                unreachable!("checked above that the proposer is elected")
            }
        }
    }
}
