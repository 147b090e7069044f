//! Watches: registered by reads, taken out of the registry by the change
//! that fires them the moment it is applied (and delivered once the batch
//! is durable), and ended with a session event when their session ends.

use std::collections::BTreeMap;

use tokio::sync::oneshot;

use super::tree::Change;
use super::{Store, WatchSender};
use crate::path;
use crate::types::{Watch, WatchEvent, WatchEventKind};

impl Store {
    /// Fires every remaining watch of `session` with a session event.
    pub(super) fn end_watches(&mut self, session: i64, kind: WatchEventKind) {
        for registry in [&mut self.data_watches, &mut self.child_watches] {
            registry.retain(|_, watchers| {
                let mut i = 0;
                while i < watchers.len() {
                    if watchers[i].0 == session {
                        let (_, tx) = watchers.remove(i);
                        self.watch_fires.push((
                            tx,
                            WatchEvent {
                                kind,
                                path: String::new(),
                            },
                        ));
                    } else {
                        i += 1;
                    }
                }
                !watchers.is_empty()
            });
        }
    }

    fn fire(
        registry: &mut BTreeMap<String, Vec<(i64, WatchSender)>>,
        path: &str,
        kind: WatchEventKind,
        out: &mut Vec<(WatchSender, WatchEvent)>,
    ) {
        if let Some(watchers) = registry.remove(path) {
            for (_, tx) in watchers {
                out.push((
                    tx,
                    WatchEvent {
                        kind,
                        path: path.to_string(),
                    },
                ));
            }
        }
    }

    /// Takes the watches the changes applied so far fire out of the registry
    /// (delivered when the batch is durable).
    pub(super) fn collect_fires(&mut self) {
        for change in std::mem::take(&mut self.changes) {
            match change {
                Change::Created(p) => {
                    Self::fire(
                        &mut self.data_watches,
                        &p,
                        WatchEventKind::NodeCreated,
                        &mut self.watch_fires,
                    );
                    Self::fire(
                        &mut self.child_watches,
                        path::parent(&p),
                        WatchEventKind::NodeChildrenChanged,
                        &mut self.watch_fires,
                    );
                }
                Change::Deleted(p) => {
                    Self::fire(
                        &mut self.data_watches,
                        &p,
                        WatchEventKind::NodeDeleted,
                        &mut self.watch_fires,
                    );
                    Self::fire(
                        &mut self.child_watches,
                        &p,
                        WatchEventKind::NodeDeleted,
                        &mut self.watch_fires,
                    );
                    Self::fire(
                        &mut self.child_watches,
                        path::parent(&p),
                        WatchEventKind::NodeChildrenChanged,
                        &mut self.watch_fires,
                    );
                }
                Change::DataChanged(p) => {
                    Self::fire(
                        &mut self.data_watches,
                        &p,
                        WatchEventKind::NodeDataChanged,
                        &mut self.watch_fires,
                    );
                }
            }
        }
    }
}

pub(super) fn register(
    registry: &mut BTreeMap<String, Vec<(i64, WatchSender)>>,
    session: i64,
    path: String,
) -> oneshot::Receiver<WatchEvent> {
    let (tx, rx) = oneshot::channel();
    registry.entry(path).or_default().push((session, tx));
    rx
}

pub(super) fn watch_from(rx: oneshot::Receiver<WatchEvent>) -> Watch {
    Watch::new(async move {
        rx.await.unwrap_or(WatchEvent {
            kind: WatchEventKind::Disconnected,
            path: String::new(),
        })
    })
}
