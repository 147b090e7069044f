//! Export pins and the parts merges replaced: a pinned part stays on disk
//! and readable by its export after a merge replaced it, across restarts;
//! replaced parts no pin names go to the merge task for removal.

use super::{Replica, ReplicaError};
use crate::part::{PartMeta, PartName};

impl Replica {
    /// Pins parts for an export (its transaction id): while pinned, a part
    /// a merge replaces stays on disk and readable through
    /// [`export_part`](Self::export_part), across restarts. Persisted before
    /// it returns. Pinning again under the same id replaces the list.
    pub async fn pin(
        &mut self,
        export: &str,
        table_id: u64,
        names: &[PartName],
    ) -> Result<(), ReplicaError> {
        let list: Vec<(u64, PartName)> = names.iter().map(|n| (table_id, n.clone())).collect();
        if self.state.pins.get(export) == Some(&list) {
            return Ok(());
        }
        self.state.pins.insert(export.to_string(), list);
        self.persist().await
    }

    /// Releases an export's pins; kept parts no other pin names go to the
    /// merge task for removal after the grace period.
    pub async fn unpin(&mut self, export: &str) -> Result<(), ReplicaError> {
        if self.state.pins.remove(export).is_none() {
            return Ok(());
        }
        self.persist().await?;
        self.free_unpinned();
        Ok(())
    }

    /// Hands kept parts no pin or hold names any more to the merge task.
    pub(super) fn free_unpinned(&mut self) {
        let freed: Vec<(u64, PartName)> = self
            .kept
            .iter()
            .flat_map(|(t, p)| p.keys().map(move |n| (*t, n.clone())))
            .filter(|(t, n)| !self.is_pinned(*t, n) && !self.unpinned.contains(&(*t, n.clone())))
            .collect();
        if !freed.is_empty() {
            self.unpinned.extend(freed);
            // Wakes the merge task.
            self.status.send_modify(|_| {});
        }
    }

    /// Transaction ids of the exports holding pins.
    pub fn pinned_exports(&self) -> Vec<String> {
        self.state.pins.keys().cloned().collect()
    }

    /// Whether an export's pin or a copy's hold keeps the part.
    fn is_pinned(&self, table_id: u64, name: &PartName) -> bool {
        self.state
            .pins
            .values()
            .flatten()
            .any(|(t, n)| *t == table_id && n == name)
            || self.is_held(table_id, name)
    }

    /// A part to export: active, or replaced and kept by a pin. Its path
    /// and metadata.
    pub fn export_part(&self, table_id: u64, name: &PartName) -> Option<(String, PartMeta)> {
        let meta = self
            .parts
            .get(&table_id)
            .and_then(|p| p.get(name))
            .or_else(|| self.kept.get(&table_id).and_then(|p| p.get(name)))?;
        Some((self.part_path(table_id, name), meta.clone()))
    }

    /// Replaced parts waiting for removal (the merge task's to take).
    pub fn take_replaced(&mut self) -> Vec<(u64, PartName)> {
        std::mem::take(&mut self.unpinned)
    }

    /// Forgets replaced parts whose grace period is over, except those a pin
    /// names now; returns the paths of the files to remove.
    pub fn release_replaced(&mut self, parts: &[(u64, PartName)]) -> Vec<String> {
        let mut paths = Vec::new();
        for (t, n) in parts {
            if self.is_pinned(*t, n) {
                continue;
            }
            if let Some(kept) = self.kept.get_mut(t) {
                if kept.remove(n).is_some() {
                    paths.push(self.part_path(*t, n));
                }
            }
        }
        paths
    }
}
