//! The WAL workload's checks: at every step, of every running safekeeper
//! ([`Sim::check_safekeepers`]), of every writer's reported status and
//! acknowledgement ([`Sim::observe`], [`Sim::record_commit`]) and of every
//! walsender frame ([`Sim::check_walsenders`]); once the faults stopped and
//! every safekeeper caught up, of the WAL on every disk, in the backup and
//! at the replica ([`Sim::check_disks`]).

use std::collections::BTreeMap;

use bytes::Bytes;
use ferry_safekeeper::backup::segment_key;
use ferry_safekeeper::control::{PartialRemoteSegment, UploadStatus};
use ferry_safekeeper::partial::PARTIAL_DIR;
use ferry_wal::record::{self, Record};
use ferry_wal::Lsn;
use ferry_writer::driver::{WriterError, WriterStatus};

use super::walreceiver;
use super::{cluster_id, payload_is_intact, Failure, Sim, SAFEKEEPERS, SEGMENT_BYTES};
use crate::world::disk::SimDisk;

impl Sim {
    /// Invariants of every running (not failed) safekeeper, checked at every step of the
    /// run (not only from a final status): commit_lsn never passes flush_lsn,
    /// the term never goes back (not even across a restart), and commit_lsn
    /// never goes back within one incarnation.
    pub(super) async fn check_safekeepers(&mut self) -> Result<(), Failure> {
        for i in 0..SAFEKEEPERS {
            let Some(server) = self.safekeepers.servers[i].clone() else {
                continue;
            };
            let (term, flush, commit) = server.positions().await;
            if server.failure().borrow().is_some() {
                // Stopped on a disk error (perhaps while we waited for its
                // lock): its memory may be ahead of its disk, which is exactly
                // why it answers nothing any more.
                continue;
            }
            if commit > flush {
                return Err(self.fail(format!(
                    "sk{i}: commit_lsn {commit} is beyond its flush_lsn {flush}"
                )));
            }
            if term < self.seen_terms[i] {
                return Err(self.fail(format!(
                    "sk{i}: term went back from {} to {term}",
                    self.seen_terms[i]
                )));
            }
            if commit < self.seen_commits[i] {
                return Err(self.fail(format!(
                    "sk{i}: commit_lsn went back from {} to {commit}",
                    self.seen_commits[i]
                )));
            }
            self.seen_terms[i] = term;
            self.seen_commits[i] = commit;
            // One snapshot: both positions move while the checker waits.
            let status = server.status().await;
            let backup: Lsn = status
                .backup_lsn
                .parse()
                .map_err(|e: String| self.fail(e))?;
            let commit: Lsn = status
                .commit_lsn
                .parse()
                .map_err(|e: String| self.fail(e))?;
            let removed = Lsn(status.last_removed_segno * SEGMENT_BYTES);
            if backup > commit {
                return Err(self.fail(format!(
                    "sk{i}: backup_lsn {backup} is beyond its commit_lsn {commit}"
                )));
            }
            if removed > backup {
                return Err(self.fail(format!(
                    "sk{i}: removed WAL below {removed}, beyond backup_lsn {backup}"
                )));
            }
            // Partial objects: the entries before and after the listing (an
            // entry outlives its object on both sides).
            let before = server.partial_segments().await;
            let objects = self.partial_objects().await?;
            let after = server.partial_segments().await;
            self.check_one_uploaded(i, &after)?;
            let mut entries = after;
            entries.extend(before);
            self.check_partial_orphans(i, &objects, &entries)?;
            // The replica registered itself with its first feedback; it has
            // reported at most what it received so far.
            let received = walreceiver::lock(&self.received).wal.len() as u64;
            if removed.0 > received {
                return Err(self.fail(format!(
                    "sk{i}: removed WAL below {removed}, which the replica has not applied (it received {received} bytes)"
                )));
            }
        }
        Ok(())
    }

    /// A walsender broke an invariant (seen by the simulated replica).
    pub(super) fn check_walsenders(&self) -> Result<(), Failure> {
        let received = walreceiver::lock(&self.received);
        match received.violations.first() {
            Some(v) => Err(self.fail(v.clone())),
            None => Ok(()),
        }
    }

    /// The cluster's backup as it really is (no faults): what checks read.
    pub(super) fn truth(&self) -> Result<ferry_storage::Location, Failure> {
        ferry_storage::Location::from_store("sim://truth", self.world.lake_store.truth(), "")
            .and_then(|root| ferry_safekeeper::backup::cluster_folder(&root, &cluster_id()))
            .map_err(|e| self.fail(e.to_string()))
    }

    /// Names of the partial objects the backup really holds.
    pub(super) async fn partial_objects(&self) -> Result<Vec<String>, Failure> {
        let truth = self.truth()?;
        let listed = truth
            .list(PARTIAL_DIR)
            .await
            .map_err(|e| self.fail(format!("listing the partial objects: {e}")))?;
        Ok(listed
            .into_iter()
            .map(|(key, _)| key.rsplit('/').next().unwrap_or_default().to_string())
            .collect())
    }

    /// Every partial object of safekeeper `i` must be named by `entries` (its
    /// control file's list).
    pub(super) fn check_partial_orphans(
        &self,
        i: usize,
        objects: &[String],
        entries: &[PartialRemoteSegment],
    ) -> Result<(), Failure> {
        let suffix = format!("_sk{i}.partial");
        for object in objects.iter().filter(|o| o.ends_with(&suffix)) {
            if !entries.iter().any(|e| &e.name == object) {
                return Err(self.fail(format!(
                    "sk{i}: partial object {object} is in the backup but not in its control file (an orphan)"
                )));
            }
        }
        Ok(())
    }

    /// At most one entry of one control file's list is `Uploaded`.
    pub(super) fn check_one_uploaded(
        &self,
        i: usize,
        entries: &[PartialRemoteSegment],
    ) -> Result<(), Failure> {
        let uploaded = entries
            .iter()
            .filter(|e| e.status == UploadStatus::Uploaded)
            .count();
        if uploaded > 1 {
            return Err(self.fail(format!(
                "sk{i}: {uploaded} partial entries are Uploaded (at most one may be)"
            )));
        }
        Ok(())
    }

    /// Segment `segno` as the backup really holds it (no faults), if whole.
    pub(super) async fn backup_segment(&self, segno: u64) -> Option<Bytes> {
        let truth = self.truth().ok()?;
        let object = truth.get(&segment_key(Self::segment(), segno)).await.ok()?;
        (object.len() as u64 == SEGMENT_BYTES).then_some(object)
    }

    /// The status of incarnation `writer`, if it still runs.
    pub(super) fn status_of(&self, writer: u64) -> Option<WriterStatus> {
        if writer == self.writers_started {
            return self.status.as_ref().map(|rx| rx.borrow().clone());
        }
        self.old_writers
            .get(&writer)
            .map(|(_, rx)| rx.borrow().clone())
    }

    /// Highest LSN committed by writers elected in terms below `term`.
    pub(super) fn committed_below(&self, term: u64) -> Lsn {
        self.committed_by
            .iter()
            .filter(|(w, _)| self.elected.get(w).is_some_and(|(t, _)| *t < term))
            .map(|(_, l)| *l)
            .max()
            .unwrap_or(Lsn(0))
    }

    /// Records that `writer` got `lsn` committed, checking it against every
    /// election of a higher term: they must all have started at or above it
    /// (whenever they happened, as writers may run side by side).
    pub(super) fn record_commit(&mut self, writer: u64, lsn: Lsn) -> Result<(), Failure> {
        let Some(&(my_term, _)) = self.elected.get(&writer) else {
            return Err(self.fail(format!(
                "writer {writer} committed {lsn} without having been seen elected"
            )));
        };
        let entry = self.committed_by.entry(writer).or_insert(Lsn(0));
        *entry = (*entry).max(lsn);
        if let Some((later, (term, epoch))) = self
            .elected
            .iter()
            .find(|(_, (t, e))| *t > my_term && *e < lsn)
        {
            return Err(self.fail(format!(
                "writer {later} was elected in term {term} at {epoch}, below {lsn} committed by writer {writer} in term {my_term}: committed WAL lost"
            )));
        }
        if lsn > self.committed {
            self.committed = lsn;
        }
        self.produced = self.produced.max(lsn);
        Ok(())
    }

    /// Checks the status of writer incarnation `writer` against what is known to
    /// be committed and produced.
    pub(super) fn observe(&mut self, writer: u64, s: &WriterStatus) -> Result<(), Failure> {
        let parse = |v: &str| {
            v.parse::<Lsn>()
                .map_err(|e| self.fail(format!("bad status LSN: {e}")))
        };
        let end = parse(&s.end_lsn)?;
        let commit = parse(&s.commit_lsn)?;
        let epoch = parse(&s.epoch_start_lsn)?;
        // A superseded writer was elected in its term, even if the status that
        // showed it elected was overwritten before it could be looked at.
        let was_elected = s.elected || s.superseded_by.is_some();
        if was_elected && !self.elected.contains_key(&writer) {
            if let Some(other) = self.term_owner.insert(s.term, writer) {
                return Err(self.fail(format!(
                    "writers {other} and {writer} were both elected in term {}",
                    s.term
                )));
            }
            self.elections += 1;
            self.log(format!(
                "writer {writer} elected in term {} at epoch start {epoch}",
                s.term
            ));
            let before = self.committed_below(s.term);
            if epoch < before {
                return Err(self.fail(format!(
                    "election of term {} starts at {epoch}, below the committed {before}: committed WAL lost",
                    s.term
                )));
            }
            // Writers side by side: the other one may have produced WAL since
            // its status was last looked at.
            let ends: Vec<String> = self
                .old_writers
                .values()
                .map(|(_, rx)| rx.borrow().end_lsn.clone())
                .chain(self.status.iter().map(|rx| rx.borrow().end_lsn.clone()))
                .collect();
            for end in ends {
                let end: Lsn = end
                    .parse()
                    .map_err(|e| self.fail(format!("bad status LSN: {e}")))?;
                self.produced = self.produced.max(end);
            }
            if epoch > self.produced {
                return Err(self.fail(format!(
                    "election of term {} starts at {epoch}, beyond all WAL ever produced ({}): WAL invented",
                    s.term, self.produced
                )));
            }
            self.elected.insert(writer, (s.term, epoch));
        }
        if s.synced && commit > Lsn(0) {
            let mine = self.committed_by.get(&writer).copied().unwrap_or(Lsn(0));
            let before = self.committed_below(s.term);
            if commit < mine || commit < before {
                return Err(self.fail(format!(
                    "commit_lsn went back: writer {writer} reports {commit} after {}",
                    mine.max(before)
                )));
            }
            if commit > mine {
                self.log(format!("writer {writer} commit_lsn {commit}"));
            }
            self.record_commit(writer, commit)?;
        }
        self.produced = self.produced.max(end);
        Ok(())
    }

    pub(super) fn on_result(
        &mut self,
        writer: u64,
        block: u64,
        result: Result<Lsn, WriterError>,
    ) -> Result<(), Failure> {
        // The acknowledgement may overtake the status that shows the election.
        if let Some(s) = self.status_of(writer) {
            self.observe(writer, &s)?;
        }
        match result {
            Ok(end) => {
                if self.acked.insert(block, end).is_some() {
                    return Err(self.fail(format!("block {block} acknowledged twice")));
                }
                self.record_commit(writer, end)?;
            }
            Err(e) => {
                self.not_acked.insert(block);
                if matches!(e, WriterError::DiskFull { .. }) {
                    // "Nothing was written": checked at the end.
                    self.refused_unwritten.insert(block);
                }
                self.log(format!("block {block} not acknowledged: {e}"));
            }
        }
        Ok(())
    }

    /// Stops every node and checks the WAL on every disk.
    pub(super) async fn check_disks(&mut self, committed: Lsn) -> Result<(), Failure> {
        self.kill_writer();
        self.kill_old_writers()?;
        self.safekeepers.stop_all().await;
        let mut wals = Vec::new();
        let mut backup_lsns = Vec::new();
        let mut removed = Vec::new();
        let objects = self.partial_objects().await?;
        let mut uploaded_partials = Vec::new();
        for i in 0..SAFEKEEPERS {
            let acceptor = self.open_acceptor(i).await?;
            // Up to what it knows was committed: at least every acknowledged
            // write, and more when a later term committed writes whose
            // answers were lost (a replica may have received those too).
            let upto = acceptor
                .flush_lsn()
                .min(committed.max(acceptor.commit_lsn()));
            let state = acceptor.state().clone();
            self.check_partial_orphans(i, &objects, &state.partial_backup)?;
            self.check_one_uploaded(i, &state.partial_backup)?;
            uploaded_partials.extend(
                state
                    .partial_backup
                    .iter()
                    .filter(|e| e.status == UploadStatus::Uploaded)
                    .cloned(),
            );
            backup_lsns.push(state.backup_lsn);
            removed.push(state.last_removed_segno);
            let mut wal = Vec::with_capacity(upto.0 as usize);
            // What this safekeeper removed must be in the backup: WAL removed
            // locally is read from there, by replicas as here.
            for segno in 0..state.last_removed_segno {
                let object = self.backup_segment(segno).await.ok_or_else(|| {
                    self.fail(format!(
                        "sk{i} removed segment {segno} (below {}), which is not in the backup (its backup_lsn {})",
                        state.last_removed_segno, state.backup_lsn
                    ))
                })?;
                wal.extend_from_slice(&object);
            }
            while (wal.len() as u64) < upto.0 {
                let max = (upto.0 - wal.len() as u64) as usize;
                let chunk = acceptor
                    .read_for_recovery(acceptor.term(), Lsn(wal.len() as u64), max)
                    .await
                    .map_err(|e| self.fail(format!("sk{i} cannot read its WAL: {e}")))?;
                if chunk.is_empty() {
                    return Err(self.fail(format!("sk{i} WAL ends early at {}", wal.len())));
                }
                wal.extend_from_slice(&chunk);
            }
            wals.push(wal);
        }
        for i in 0..SAFEKEEPERS {
            for j in i + 1..SAFEKEEPERS {
                let common = wals[i].len().min(wals[j].len());
                if wals[i][..common] != wals[j][..common] {
                    let at = (0..common)
                        .find(|&k| wals[i][k] != wals[j][k])
                        .unwrap_or(common);
                    return Err(self.fail(format!(
                        "sk{i} and sk{j} disagree on committed WAL at byte {at}"
                    )));
                }
            }
        }
        let holders = wals
            .iter()
            .filter(|w| w.len() as u64 >= committed.0)
            .count();
        if holders != SAFEKEEPERS {
            return Err(self.fail(format!(
                "after catching up, committed WAL up to {committed} is on only {holders} safekeepers"
            )));
        }
        // The longest committed WAL (the others are prefixes of it, checked
        // above).
        let Some(full) = wals.iter().max_by_key(|w| w.len()) else {
            return Err(self.fail("no safekeeper holds the committed WAL"));
        };
        let full = Bytes::from(full.clone());
        let committed = Lsn(full.len() as u64);
        // Every segment below any safekeeper's backup_lsn is in the backup,
        // whole, with the committed bytes.
        let backed_up = backup_lsns.iter().copied().max().unwrap_or(Lsn(0));
        if backed_up > committed {
            return Err(self.fail(format!(
                "backup_lsn {backed_up} is beyond the committed end {committed}"
            )));
        }
        for segno in 0..backed_up.0 / SEGMENT_BYTES {
            let at = (segno * SEGMENT_BYTES) as usize;
            let expected = &full[at..at + SEGMENT_BYTES as usize];
            match self.backup_segment(segno).await {
                Some(object) if object[..] == *expected => {}
                Some(_) => {
                    return Err(self.fail(format!(
                        "backup segment {segno} differs from the committed WAL"
                    )))
                }
                None => {
                    return Err(self.fail(format!(
                        "segment {segno} is below backup_lsn {backed_up} but not in the backup"
                    )))
                }
            }
        }
        // An uploaded partial object holds the committed WAL below its
        // commit_lsn, byte for byte.
        for entry in &uploaded_partials {
            let truth = self.truth()?;
            let key = ferry_safekeeper::partial::partial_key(&entry.name);
            let Ok(object) = truth.get(&key).await else {
                return Err(self.fail(format!(
                    "uploaded partial {} is not in the backup",
                    entry.name
                )));
            };
            let start = entry.flush_lsn.0 / SEGMENT_BYTES * SEGMENT_BYTES;
            if object.len() as u64 != entry.flush_lsn.0 - start {
                return Err(self.fail(format!(
                    "partial {} holds {} bytes, not the flushed prefix of {}",
                    entry.name,
                    object.len(),
                    entry.flush_lsn.0 - start
                )));
            }
            // Only the part below its commit_lsn is final: WAL past it may
            // have been cut by a later term.
            let upto = entry.commit_lsn.min(committed).0;
            if upto > start
                && object[..(upto - start) as usize] != full[start as usize..upto as usize]
            {
                return Err(self.fail(format!(
                    "partial {} differs from the committed WAL below its commit_lsn",
                    entry.name
                )));
            }
        }
        // A restored safekeeper held exactly committed WAL, and was brought
        // back (it votes again).
        if let Some((i, start, restored)) = &self.restored {
            let start = start.0 as usize;
            let end = start + restored.len();
            if end > full.len() || restored[..] != full[start..end] {
                let at = (0..restored.len().min(full.len().saturating_sub(start)))
                    .find(|&k| restored[k] != full[start + k])
                    .map_or(end.min(full.len()), |k| start + k);
                return Err(self.fail(format!(
                    "sk{i} was rebuilt with WAL {start}..{end} that is not the committed WAL ({} bytes): they differ at byte {at}",
                    full.len()
                )));
            }
            let acceptor = self.open_acceptor(*i).await?;
            if let Some(lsn) = acceptor.restored_up_to() {
                return Err(self.fail(format!(
                    "sk{i}, restored up to {lsn}, was never brought back"
                )));
            }
        }
        // No safekeeper removed WAL the replica had not applied.
        let applied = walreceiver::lock(&self.received).wal.len() as u64;
        for (i, &segno) in removed.iter().enumerate() {
            if segno * SEGMENT_BYTES > applied {
                return Err(self.fail(format!(
                    "sk{i} removed segments below {segno}, beyond what the replica applied ({applied} bytes)"
                )));
            }
        }
        self.log(format!(
            "backup_lsn per safekeeper {backup_lsns:?}, segments removed below {removed:?}, {} partial objects, uploaded {:?}",
            objects.len(),
            uploaded_partials.iter().map(|e| e.name.as_str()).collect::<Vec<_>>()
        ));
        {
            let received = walreceiver::lock(&self.received);
            let n = received.wal.len();
            if n > full.len() || received.wal[..] != full[..n] {
                let at = (0..n.min(full.len()))
                    .find(|&k| received.wal[k] != full[k])
                    .unwrap_or(n.min(full.len()));
                return Err(self.fail(format!(
                    "the replica received {n} bytes that differ from the committed WAL ({} bytes) at byte {at}",
                    full.len()
                )));
            }
        }
        let mut seen: BTreeMap<u64, Lsn> = BTreeMap::new();
        let mut at = 0usize;
        while at < full.len() {
            let (rec, len) = record::decode(&full.slice(at..))
                .map_err(|e| self.fail(format!("committed WAL damaged at {at}: {e}")))?;
            at += len;
            if let Record::Insert {
                block_number,
                arrow_ipc,
                ..
            } = rec
            {
                if !payload_is_intact(block_number, &arrow_ipc) {
                    return Err(self.fail(format!("block {block_number} changed in the WAL")));
                }
                if seen.insert(block_number, Lsn(at as u64)).is_some() {
                    return Err(self.fail(format!("block {block_number} appears twice in the WAL")));
                }
            }
        }
        // A writer that refused an append for lack of disk space wrote
        // nothing of it: the API tells the client so (503 disk_full), and a
        // retry without the key must not make it twice.
        if let Some(block) = self.refused_unwritten.iter().find(|b| seen.contains_key(b)) {
            return Err(self.fail(format!(
                "block {block} was refused for lack of disk space (nothing written), yet it is in the committed WAL"
            )));
        }
        for (block, end) in &self.acked {
            match seen.get(block) {
                None => {
                    return Err(self.fail(format!("acknowledged block {block} (end {end}) is lost")))
                }
                Some(found) if found != end => {
                    return Err(self.fail(format!(
                        "acknowledged block {block} ends at {found}, acknowledged at {end}"
                    )))
                }
                Some(_) => {}
            }
        }
        // Low-level counters make the log (and its hash) sensitive to any change
        // in the execution, not only to the events above.
        let fsyncs: Vec<u64> = self.safekeepers.disks.iter().map(SimDisk::fsyncs).collect();
        self.log(format!("fsyncs per safekeeper disk: {fsyncs:?}"));
        let (frames, connections) = {
            let r = walreceiver::lock(&self.received);
            (r.frames, r.connections)
        };
        self.log(format!(
            "checked: {} acknowledged blocks in {} bytes of committed WAL; safekeepers hold {:?} bytes of it; the replica got it in {frames} walsender frames over {connections} connections",
            self.acked.len(),
            full.len(),
            wals.iter().map(Vec::len).collect::<Vec<_>>()
        ));
        Ok(())
    }
}
