//! The table catalog on the embedded store: creating twice, conflicts, ids never
//! reused, drops refused while a holder is registered, and a new session after
//! the old one expired.

#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // a real temp dir

use std::sync::Arc;
use std::time::Duration;

use ferry_coord::embedded::EmbeddedStore;
use ferry_coord::EmbeddedSessions;
use ferry_ingest::{Catalog, CatalogError};
use ferry_table::TableDef;

fn def(shards: u32) -> TableDef {
    ferry_testkit::table::id_d_toml(shards).def()
}

async fn catalog(dir: &std::path::Path) -> (EmbeddedStore, Catalog) {
    let disk = Arc::new(ferry_env::RealDisk::open_root(dir).expect("disk"));
    let store = EmbeddedStore::open(disk, "coord", Default::default())
        .await
        .expect("store");
    let sessions = Arc::new(EmbeddedSessions {
        store: store.clone(),
        timeout: Duration::from_secs(10),
        metrics: Default::default(),
    });
    let catalog = Catalog::open(sessions).await.expect("catalog");
    (store, catalog)
}

#[tokio::test]
async fn tables_are_created_once_held_and_dropped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, catalog) = catalog(dir.path()).await;
    let (t, created) = catalog.create(&def(2)).await.expect("create");
    assert!(created);
    assert_eq!(t.id, 1);
    let (again, created) = catalog.create(&def(2)).await.expect("same definition");
    assert!(!created);
    assert_eq!(again, t);
    assert!(matches!(
        catalog.create(&def(3)).await,
        Err(CatalogError::Conflict { id: 1, .. })
    ));
    assert!(matches!(
        catalog.get("../x").await,
        Err(CatalogError::InvalidName(_))
    ));

    // A holder keeps the table; released, it can be dropped.
    catalog.hold("t", "replica-0-0", false).await.expect("hold");
    match catalog.drop_table("t").await {
        Err(CatalogError::InUse { holders, .. }) => assert_eq!(holders, ["replica-0-0"]),
        other => panic!("drop of a held table: {other:?}"),
    }
    assert_eq!(catalog.list().await.expect("list").len(), 1);
    catalog.release("t", "replica-0-0").await.expect("release");
    assert_eq!(catalog.drop_table("t").await.expect("drop").id, 1);
    assert!(catalog.get("t").await.expect("get").is_none());
    assert!(matches!(
        catalog.drop_table("t").await,
        Err(CatalogError::NoSuchTable(_))
    ));

    // A new table of the same name gets a new id: records of the old one can
    // never be read as its rows.
    let (t2, _) = catalog.create(&def(2)).await.expect("create again");
    assert_eq!(t2.id, 2);
    use ferry_ingest::TableById;
    assert_eq!(
        catalog.by_id(2).await.expect("by id"),
        TableById::Known(t2.clone())
    );
    assert_eq!(catalog.by_id(1).await.expect("by id"), TableById::Dropped);
    assert_eq!(catalog.by_id(3).await.expect("by id"), TableById::Unknown);
    assert_eq!(catalog.by_id(0).await.expect("by id"), TableById::Unknown);

    // The catalog outlives its session.
    let session = catalog.session().await.expect("session");
    assert!(store
        .expire_session(session.session_id())
        .await
        .expect("expire"));
    let mut state = session.session_state();
    state
        .wait_for(|s| s.is_terminal())
        .await
        .expect("session ends");
    assert_eq!(
        catalog.list().await.expect("list on a new session").len(),
        1
    );
    assert_ne!(
        catalog.session().await.expect("session").session_id(),
        session.session_id()
    );
    catalog.close().await;
    store.shutdown().await;
}

#[tokio::test]
async fn a_pending_export_holds_its_table_and_finished_ones_go_with_it() {
    use ferry_coord::{CreateMode, SessionFactory};
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, catalog) = catalog(dir.path()).await;
    catalog.create(&def(2)).await.expect("create");
    let sessions = EmbeddedSessions {
        store: store.clone(),
        timeout: Duration::from_secs(10),
        metrics: Default::default(),
    };
    let s = sessions.open().await.expect("session");
    let task = "/ferry/tables/t/exports/x_0123456789abcdef";
    ferry_coord::create_all(s.as_ref(), &format!("{task}/processed"))
        .await
        .expect("task");
    s.create(
        &format!("{task}/processed/x_1_1_0"),
        b"{}",
        CreateMode::Persistent,
    )
    .await
    .expect("entry");
    s.create(
        &format!("{task}/status"),
        b"PENDING",
        CreateMode::Persistent,
    )
    .await
    .expect("status");
    s.create(
        "/ferry/tables/t/exports_cleanup_lock",
        b"r0",
        CreateMode::Ephemeral,
    )
    .await
    .expect("cleanup lock");
    match catalog.drop_table("t").await {
        Err(CatalogError::InUse { holders, .. }) => {
            assert_eq!(holders, ["export x_0123456789abcdef"])
        }
        other => panic!("drop with a pending export: {other:?}"),
    }
    assert!(
        catalog.get("t").await.expect("get").is_some(),
        "nothing changed"
    );
    s.set(&format!("{task}/status"), b"COMPLETED", Some(0))
        .await
        .expect("completed");
    catalog.drop_table("t").await.expect("drop");
    assert!(catalog.get("t").await.expect("get").is_none());
    assert!(s.exists(task).await.expect("exists").is_none());
}

/// Only `[export]` changes after creation: two catalogs (two nodes) setting
/// it at once each apply on top of the other's (a compare-and-swap), the
/// rest of the definition never moves, and creating the table again with
/// the old `[export]` is a conflict that names the way to change it.
#[tokio::test]
async fn only_the_export_section_changes_and_racing_changes_both_apply() {
    use ferry_table::def::ExportDefaults;
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, catalog) = catalog(dir.path()).await;
    let sessions = Arc::new(EmbeddedSessions {
        store: store.clone(),
        timeout: Duration::from_secs(10),
        metrics: Default::default(),
    });
    let other = Catalog::open(sessions).await.expect("second catalog");
    let (t, _) = catalog.create(&def(2)).await.expect("create");
    let policy = |to: &str| {
        ExportDefaults::from_json(format!(r#"{{"to": "{to}", "freshness": "5s"}}"#).as_bytes())
            .expect("valid")
    };
    let (a, b) = tokio::join!(
        catalog.set_export("t", Some(policy("file:///lake/a"))),
        other.set_export("t", Some(policy("file:///lake/b"))),
    );
    let (a, b) = (a.expect("a"), b.expect("b"));
    let now = catalog.get("t").await.expect("get").expect("table");
    // Whichever applied last is what the catalog holds; both applied.
    assert!(now == a || now == b, "{now:?}");
    assert_eq!(now.id, t.id);
    assert_eq!(
        TableDef {
            export: None,
            ..now.def.clone()
        },
        t.def,
        "nothing but [export] moved"
    );
    match catalog.create(&def(2)).await {
        Err(e @ CatalogError::Conflict { .. }) => {
            assert!(e.to_string().contains("PATCH"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    // Removed again; the same definition is then a no-op create.
    assert_eq!(catalog.set_export("t", None).await.expect("off").def, t.def);
    assert!(!catalog.create(&def(2)).await.expect("same").1);
    assert!(matches!(
        catalog.set_export("nope", None).await,
        Err(CatalogError::NoSuchTable(_))
    ));
    assert!(matches!(
        catalog.set_export("../x", None).await,
        Err(CatalogError::InvalidName(_))
    ));
}
