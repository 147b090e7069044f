//! The table catalog, kept in coordination so that every node (writers routing
//! inserts, replicas naming parts, exports) reads the same definitions.
//!
//! Layout:
//!
//! ```text
//! /ferry/tables/<name>          JSON of the Table (id and definition); only its
//!                               `export` section changes (`set_export`, a
//!                               compare-and-swap on the node's version)
//! /ferry/tables/<name>/refs/    one child per holder (a replica, an export) that
//!                               needs the table; a table with refs is not dropped
//! /ferry/table_ids/id-NNNNNNNNNN  one persistent sequential node per id handed out
//! ```
//!
//! Invariants:
//! * a table id is handed out once, ever (a sequential node's counter never goes
//!   back), so WAL records of a dropped table can never be read as rows of a new
//!   table of the same name;
//! * a table node and its `refs` node are created and deleted in one multi, so no
//!   reader sees a table without `refs` (or the reverse);
//! * drop deletes `refs` and the table in one multi: a holder registered under
//!   `refs` makes the delete fail as a whole (ZooKeeper deletes only childless
//!   nodes), so a drop can never race a new holder. Export tasks live under
//!   the table (`exports/`): a PENDING one holds the table; finished ones are
//!   deleted first, and an export created meanwhile makes the multi fail.

use std::sync::Arc;

use ferry_coord::{CoordError, CreateMode, Op, RenewingSession, Session, SessionFactory};
use ferry_table::def::ExportDefaults;
use ferry_table::{Table, TableDef};

pub const TABLES: &str = "/ferry/tables";
const TABLE_IDS: &str = "/ferry/table_ids";
/// Attempts of one catalog change across lost connections (outcome unknown).
const ATTEMPTS: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("no table named {0:?}")]
    NoSuchTable(String),
    #[error("table {name:?} exists with a different definition (id {id}){hint}")]
    Conflict {
        name: String,
        id: u64,
        /// What to do instead: change only the export, or drop the table.
        hint: &'static str,
    },
    #[error("table {name:?} is still used by {holders:?}")]
    InUse { name: String, holders: Vec<String> },
    #[error("table record {path} in coordination is not valid: {detail}")]
    Damaged { path: String, detail: String },
    #[error("invalid table name {0:?}")]
    InvalidName(String),
    #[error(transparent)]
    Coord(#[from] CoordError),
}

/// What a table id names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableById {
    Known(Table),
    /// The id was handed out, but its table is gone.
    Dropped,
    /// No table ever had this id.
    Unknown,
}

/// The catalog. It holds a coordination session and opens a new one of the same
/// back-end when that one has expired (or was closed), so that a node outlives
/// a session expiry; a request caught by the expiry fails once (503), and the
/// next one runs on the new session.
#[derive(Clone)]
pub struct Catalog {
    session: RenewingSession,
}

fn table_path(name: &str) -> String {
    format!("{TABLES}/{name}")
}

/// A table node's JSON, which must name the table it is stored under.
fn parse_table(path: &str, name: &str, data: &[u8]) -> Result<Table, CatalogError> {
    let table: Table = serde_json::from_slice(data).map_err(|e| CatalogError::Damaged {
        path: path.to_string(),
        detail: e.to_string(),
    })?;
    if table.def.name != name {
        return Err(CatalogError::Damaged {
            path: path.to_string(),
            detail: format!("it names table {:?}", table.def.name),
        });
    }
    Ok(table)
}

impl Catalog {
    /// A catalog on a session opened from `sessions`.
    pub async fn open(sessions: Arc<dyn SessionFactory>) -> Result<Catalog, CatalogError> {
        let catalog = Catalog {
            session: RenewingSession::open(sessions).await?,
        };
        let s = catalog.session().await?;
        ferry_coord::create_all(&*s, TABLES).await?;
        ferry_coord::create_all(&*s, TABLE_IDS).await?;
        Ok(catalog)
    }

    /// The live session, a new one if the last one ended.
    pub async fn session(&self) -> Result<Session, CatalogError> {
        Ok(self.session.session().await?)
    }

    /// The catalog's renewing session, for other users of the same back-end.
    pub fn renewing_session(&self) -> RenewingSession {
        self.session.clone()
    }

    /// Closes the session (at shutdown).
    pub async fn close(&self) {
        self.session.close().await;
    }

    /// Creates a table, or returns the existing one if it has exactly this
    /// definition (creating twice is a no-op); `created` tells which.
    pub async fn create(&self, def: &TableDef) -> Result<(Table, bool), CatalogError> {
        let path = table_path(&def.name);
        let mut last = None;
        for _ in 0..ATTEMPTS {
            let session = self.session().await?;
            if let Some(existing) = self.get(&def.name).await? {
                return if &existing.def == def {
                    Ok((existing, false))
                } else {
                    let only_export = TableDef {
                        export: def.export.clone(),
                        ..existing.def.clone()
                    } == *def;
                    Err(CatalogError::Conflict {
                        name: def.name.clone(),
                        id: existing.id,
                        hint: if only_export {
                            "; only its [export] differs: change that with PATCH /tables/<name> \
                             (ferry table set-export)"
                        } else {
                            "; drop it first or choose another name"
                        },
                    })
                };
            }
            let id = match session
                .create(
                    &format!("{TABLE_IDS}/id-"),
                    def.name.as_bytes(),
                    CreateMode::PersistentSequential,
                )
                .await
            {
                Ok((created, _)) => parse_id(&created)?,
                Err(e @ CoordError::ConnectionLoss { .. }) => {
                    // An id may have been spent: harmless, ids need not be dense.
                    last = Some(e);
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let table = Table {
                id,
                def: def.clone(),
            };
            let data = serde_json::to_vec(&table).expect("a table serialises");
            let ops = vec![
                Op::create(path.clone(), data, CreateMode::Persistent),
                Op::create(format!("{path}/refs"), Vec::new(), CreateMode::Persistent),
            ];
            match session.multi(ops).await {
                Ok(_) => {
                    tracing::info!(table = %def.name, id, "table created");
                    return Ok((table, true));
                }
                // Created meanwhile (by a racing request, or by this one before
                // the connection dropped): the next round compares definitions.
                Err(CoordError::MultiFailed { source, .. })
                    if matches!(*source, CoordError::NodeExists { .. }) => {}
                Err(e @ CoordError::ConnectionLoss { .. }) => last = Some(e),
                Err(e) => return Err(e.into()),
            }
        }
        Err(last
            .unwrap_or_else(|| CoordError::Backend("table creation did not settle".into()))
            .into())
    }

    /// Replaces a table's `[export]` section (its default format and export
    /// policy); `None` removes it. Everything else of a definition is
    /// fixed at creation. A compare-and-swap on the table node: a racing
    /// change makes this one read again and apply on top of it.
    pub async fn set_export(
        &self,
        name: &str,
        export: Option<ExportDefaults>,
    ) -> Result<Table, CatalogError> {
        if !ferry_table::def::valid_name(name) {
            return Err(CatalogError::InvalidName(name.to_string()));
        }
        let path = table_path(name);
        let mut last = None;
        for _ in 0..ATTEMPTS {
            let session = self.session().await?;
            let (data, stat) = match session.get(&path).await {
                Ok(found) => found,
                Err(CoordError::NoNode { .. }) => {
                    return Err(CatalogError::NoSuchTable(name.to_string()))
                }
                Err(e) => return Err(e.into()),
            };
            let mut table = parse_table(&path, name, &data)?;
            if table.def.export == export {
                return Ok(table);
            }
            table.def.export = export.clone();
            let data = serde_json::to_vec(&table).expect("a table serialises");
            match session.set(&path, &data, Some(stat.version)).await {
                Ok(_) => {
                    tracing::info!(table = %name, export = ?table.def.export, "table export changed");
                    return Ok(table);
                }
                // Changed meanwhile, or applied before the connection dropped:
                // the next round reads it again.
                Err(e @ (CoordError::BadVersion { .. } | CoordError::ConnectionLoss { .. })) => {
                    last = Some(e)
                }
                Err(CoordError::NoNode { .. }) => {
                    return Err(CatalogError::NoSuchTable(name.to_string()))
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(last
            .unwrap_or_else(|| CoordError::Backend("the export change did not settle".into()))
            .into())
    }

    /// The table named `name`, if it exists.
    pub async fn get(&self, name: &str) -> Result<Option<Table>, CatalogError> {
        if !ferry_table::def::valid_name(name) {
            return Err(CatalogError::InvalidName(name.to_string()));
        }
        let path = table_path(name);
        match self.session().await?.get(&path).await {
            Ok((data, _)) => Ok(Some(parse_table(&path, name, &data)?)),
            Err(CoordError::NoNode { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The table with id `id`, as WAL records name it: known, dropped (its id
    /// was handed out, the table is gone or the name now belongs to a newer
    /// table), or never handed out at all.
    pub async fn by_id(&self, id: u64) -> Result<TableById, CatalogError> {
        if id == 0 {
            return Ok(TableById::Unknown);
        }
        let path = format!("{TABLE_IDS}/id-{:010}", id - 1);
        let name = match self.session().await?.get(&path).await {
            Ok((data, _)) => String::from_utf8(data).map_err(|_| CatalogError::Damaged {
                path: path.clone(),
                detail: "not a table name".into(),
            })?,
            Err(CoordError::NoNode { .. }) => return Ok(TableById::Unknown),
            Err(e) => return Err(e.into()),
        };
        if name.is_empty() {
            // Handed out by a creation that did not finish: no record names it.
            return Ok(TableById::Dropped);
        }
        match self.get(&name).await? {
            Some(t) if t.id == id => Ok(TableById::Known(t)),
            _ => Ok(TableById::Dropped),
        }
    }

    /// Every table, by name.
    pub async fn list(&self) -> Result<Vec<Table>, CatalogError> {
        let (mut names, _) = match self.session().await?.children(TABLES).await {
            Ok(c) => c,
            Err(CoordError::NoNode { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        names.sort();
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            // Dropped between the listing and the read: not listed.
            if let Some(t) = self.get(&name).await? {
                out.push(t);
            }
        }
        Ok(out)
    }

    /// Registers `holder` as needing the table (it cannot be dropped until
    /// [`Catalog::release`]); ephemeral holders vanish with their session.
    pub async fn hold(
        &self,
        name: &str,
        holder: &str,
        ephemeral: bool,
    ) -> Result<(), CatalogError> {
        let mode = if ephemeral {
            CreateMode::Ephemeral
        } else {
            CreateMode::Persistent
        };
        match self
            .session()
            .await?
            .create(&format!("{}/refs/{holder}", table_path(name)), b"", mode)
            .await
        {
            Ok(_) | Err(CoordError::NodeExists { .. }) => Ok(()),
            Err(CoordError::NoNode { .. }) => Err(CatalogError::NoSuchTable(name.to_string())),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn release(&self, name: &str, holder: &str) -> Result<(), CatalogError> {
        match self
            .session()
            .await?
            .delete(&format!("{}/refs/{holder}", table_path(name)), None)
            .await
        {
            Ok(()) | Err(CoordError::NoNode { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Drops a table nothing holds. Finished export tasks under the table go
    /// with it; a PENDING one (or one being created) holds the table.
    pub async fn drop_table(&self, name: &str) -> Result<Table, CatalogError> {
        let Some(table) = self.get(name).await? else {
            return Err(CatalogError::NoSuchTable(name.to_string()));
        };
        let path = table_path(name);
        let session = self.session().await?;
        let exports = format!("{path}/exports");
        let tasks = match session.children(&exports).await {
            Ok((c, _)) => c,
            Err(CoordError::NoNode { .. }) => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        let mut live = Vec::new();
        for t in &tasks {
            match session.get(&format!("{exports}/{t}/status")).await {
                Ok((status, _)) if status != b"PENDING" => {}
                Ok(_) | Err(CoordError::NoNode { .. }) => live.push(format!("export {t}")),
                Err(e) => return Err(e.into()),
            }
        }
        if !live.is_empty() {
            return Err(CatalogError::InUse {
                name: name.to_string(),
                holders: live,
            });
        }
        for t in &tasks {
            delete_tree(&session, &format!("{exports}/{t}")).await?;
        }
        let mut ops = Vec::new();
        if !tasks.is_empty() || session.exists(&exports).await?.is_some() {
            ops.push(Op::delete(exports.clone(), None));
        }
        if session
            .exists(&format!("{path}/exports_cleanup_lock"))
            .await?
            .is_some()
        {
            ops.push(Op::delete(format!("{path}/exports_cleanup_lock"), None));
        }
        ops.push(Op::delete(format!("{path}/refs"), None));
        ops.push(Op::delete(path.clone(), None));
        match session.multi(ops).await {
            Ok(_) => {
                tracing::info!(table = %name, id = table.id, "table dropped");
                Ok(table)
            }
            Err(CoordError::MultiFailed { source, .. }) => match *source {
                CoordError::NotEmpty { .. } => {
                    let (holders, _) = session
                        .children(&format!("{path}/refs"))
                        .await
                        .unwrap_or_default();
                    Err(CatalogError::InUse {
                        name: name.to_string(),
                        holders,
                    })
                }
                CoordError::NoNode { .. } => Err(CatalogError::NoSuchTable(name.to_string())),
                other => Err(other.into()),
            },
            Err(e) => Err(e.into()),
        }
    }
}

/// Deletes a node and everything under it, deepest first (nodes already
/// gone are fine).
async fn delete_tree(session: &Session, path: &str) -> Result<(), CoordError> {
    let mut stack = vec![(path.to_string(), false)];
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            match session.delete(&node, None).await {
                Ok(()) | Err(CoordError::NoNode { .. }) => {}
                Err(e) => return Err(e),
            }
            continue;
        }
        let children = match session.children(&node).await {
            Ok((c, _)) => c,
            Err(CoordError::NoNode { .. }) => continue,
            Err(e) => return Err(e),
        };
        stack.push((node.clone(), true));
        stack.extend(children.into_iter().map(|c| (format!("{node}/{c}"), false)));
    }
    Ok(())
}

fn parse_id(created: &str) -> Result<u64, CatalogError> {
    created
        .rsplit_once("id-")
        .and_then(|(_, n)| n.parse::<u64>().ok())
        // Ids start at 1: 0 is never a table.
        .map(|n| n + 1)
        .ok_or_else(|| CatalogError::Damaged {
            path: created.to_string(),
            detail: "not a sequential id node".into(),
        })
}
