//! One conformance suite, run against every coordination back-end.

mod common;

use common::{create, ephemeral, Backend, SOON};
use ferry_coord::path::{MAX_DATA_BYTES, MAX_REQUEST_BYTES};
use ferry_coord::{
    CoordError, CreateMode, Op, OpResult, RequestKind, SessionState, WatchEvent, WatchEventKind,
};

async fn fired(watch: ferry_coord::Watch) -> WatchEvent {
    tokio::time::timeout(SOON, watch.changed())
        .await
        .expect("watch did not fire in time")
}

async fn nodes_crud_and_stats(b: &dyn Backend) {
    let s = b.session().await;
    let before = s.exists("/").await.expect("root").expect("root exists");
    let (path, stat) = s
        .create("/a", b"one", CreateMode::Persistent)
        .await
        .expect("create");
    assert_eq!(path, "/a");
    assert_eq!(
        (stat.version, stat.data_length, stat.num_children),
        (0, 3, 0)
    );
    assert_eq!(stat.czxid, stat.mzxid);
    assert_eq!(stat.ephemeral_owner, 0);

    let (data, got) = s.get("/a").await.expect("get");
    assert_eq!((data.as_slice(), got), (&b"one"[..], stat));

    let set = s.set("/a", b"two!", Some(0)).await.expect("set");
    assert_eq!(
        (set.version, set.data_length, set.czxid),
        (1, 4, stat.czxid)
    );
    assert!(set.mzxid > stat.mzxid);
    assert!(matches!(
        s.set("/a", b"x", Some(0)).await,
        Err(CoordError::BadVersion { .. })
    ));
    let any = s
        .set("/a", b"three", None)
        .await
        .expect("unconditional set");
    assert_eq!(any.version, 2);

    create(&*s, "/a/b", b"").await;
    let parent = s.exists("/a").await.expect("exists").expect("parent");
    assert_eq!((parent.num_children, parent.cversion), (1, 1));
    assert!(parent.pzxid > any.mzxid, "pzxid follows child changes");
    assert_eq!(
        parent.version, 2,
        "a child does not change the parent's version"
    );

    assert!(matches!(
        s.delete("/a/b", Some(5)).await,
        Err(CoordError::BadVersion { .. })
    ));
    s.delete("/a/b", Some(0)).await.expect("delete");
    let parent = s.exists("/a").await.expect("exists").expect("parent");
    assert_eq!((parent.num_children, parent.cversion), (0, 2));
    s.delete("/a", None).await.expect("delete");
    assert_eq!(s.exists("/a").await.expect("exists"), None);
    assert!(matches!(s.get("/a").await, Err(CoordError::NoNode { .. })));
    let after = s.exists("/").await.expect("root").expect("root exists");
    assert_eq!(after.num_children, before.num_children);
}

async fn typed_errors(b: &dyn Backend) {
    let s = b.session().await;
    assert!(matches!(
        s.create("/missing/child", b"", CreateMode::Persistent)
            .await,
        Err(CoordError::NoNode { .. })
    ));
    create(&*s, "/p", b"").await;
    assert!(matches!(
        s.create("/p", b"", CreateMode::Persistent).await,
        Err(CoordError::NodeExists { .. })
    ));
    create(&*s, "/p/c", b"").await;
    assert!(matches!(
        s.delete("/p", None).await,
        Err(CoordError::NotEmpty { .. })
    ));
    assert!(matches!(
        s.delete("/nope", None).await,
        Err(CoordError::NoNode { .. })
    ));
    assert!(matches!(
        s.set("/nope", b"", None).await,
        Err(CoordError::NoNode { .. })
    ));
    assert!(matches!(
        s.children("/nope").await,
        Err(CoordError::NoNode { .. })
    ));
    ephemeral(&*s, "/e").await;
    assert!(matches!(
        s.create("/e/child", b"", CreateMode::Persistent).await,
        Err(CoordError::NoChildrenForEphemerals { .. })
    ));
    assert!(matches!(
        s.create("/e/child", b"", CreateMode::Ephemeral).await,
        Err(CoordError::NoChildrenForEphemerals { .. })
    ));
}

async fn bad_input_is_refused_alike(b: &dyn Backend) {
    let s = b.session().await;
    create(&*s, "/ok", b"").await;
    let bad_paths = [
        "",
        "relative",
        "/trailing/",
        "//double",
        "/a//b",
        "/./x",
        "/a/..",
        "/a/../ok",
        "/nul\0",
        "/ctl\u{1}",
        "/astral\u{1F600}",
        "/a/b\u{10000}",
    ];
    for p in bad_paths {
        let invalid = |r: Result<(), CoordError>| {
            assert!(
                matches!(r, Err(CoordError::InvalidPath { .. })),
                "{p:?}: {r:?}"
            );
        };
        invalid(s.create(p, b"", CreateMode::Persistent).await.map(|_| ()));
        invalid(s.get(p).await.map(|_| ()));
        invalid(s.exists(p).await.map(|_| ()));
        invalid(s.set(p, b"", None).await.map(|_| ()));
        invalid(s.delete(p, None).await);
        invalid(s.children(p).await.map(|_| ()));
    }
    assert!(matches!(
        s.create("/", b"", CreateMode::Persistent).await,
        Err(CoordError::InvalidPath { .. })
    ));
    assert!(matches!(
        s.delete("/", None).await,
        Err(CoordError::InvalidPath { .. })
    ));
    let too_big = vec![7u8; MAX_DATA_BYTES + 1];
    assert!(matches!(
        s.create("/big", &too_big, CreateMode::Persistent).await,
        Err(CoordError::TooLarge { .. })
    ));
    assert!(matches!(
        s.set("/ok", &too_big, None).await,
        Err(CoordError::TooLarge { .. })
    ));
    let err = s
        .multi(vec![
            Op::create("/m1", b"".to_vec(), CreateMode::Persistent),
            Op::create("/bad/", b"".to_vec(), CreateMode::Persistent),
        ])
        .await
        .expect_err("bad op in multi");
    assert!(
        matches!(&err, CoordError::MultiFailed { index: 1, source } if matches!(**source, CoordError::InvalidPath { .. })),
        "{err:?}"
    );
    // Several large ops that are each fine but too large together.
    let half = vec![1u8; MAX_REQUEST_BYTES / 2 + 10];
    let err = s
        .multi(vec![
            Op::create("/h1", half.clone(), CreateMode::Persistent),
            Op::create("/h2", half, CreateMode::Persistent),
        ])
        .await
        .expect_err("oversized multi");
    assert!(matches!(err, CoordError::TooLarge { .. }), "{err:?}");
    // Nothing of the refused requests happened.
    let (children, _) = s.children("/").await.expect("children");
    assert!(
        !children
            .iter()
            .any(|c| ["big", "m1", "h1", "h2"].contains(&c.as_str())),
        "{children:?}"
    );
}

async fn largest_data_round_trips(b: &dyn Backend) {
    let s = b.session().await;
    let data: Vec<u8> = (0..MAX_DATA_BYTES).map(|i| (i % 251) as u8).collect();
    create(&*s, "/large", &data).await;
    let (got, stat) = s.get("/large").await.expect("get");
    assert_eq!(stat.data_length as usize, MAX_DATA_BYTES);
    assert!(got == data, "large data changed on the way");
}

async fn sequential_nodes(b: &dyn Backend) {
    let s = b.session().await;
    create(&*s, "/q", b"").await;
    let (p0, _) = s
        .create("/q/n-", b"", CreateMode::PersistentSequential)
        .await
        .expect("seq");
    let (p1, _) = s
        .create("/q/n-", b"", CreateMode::PersistentSequential)
        .await
        .expect("seq");
    assert_eq!(
        (p0.as_str(), p1.as_str()),
        ("/q/n-0000000000", "/q/n-0000000001")
    );
    create(&*s, "/q/plain", b"").await;
    s.delete("/q/n-0000000000", None).await.expect("delete");
    let (p3, stat) = s
        .create("/q/e-", b"", CreateMode::EphemeralSequential)
        .await
        .expect("eseq");
    assert_eq!(
        p3, "/q/e-0000000003",
        "the counter counts the children ever created"
    );
    assert_eq!(stat.ephemeral_owner, s.session_id());
    let (p4, _) = s
        .create("/q/", b"", CreateMode::PersistentSequential)
        .await
        .expect("seq");
    assert_eq!(p4, "/q/0000000004");
    let (children, stat) = s.children("/q").await.expect("children");
    assert_eq!(
        children,
        vec!["0000000004", "e-0000000003", "n-0000000001", "plain"]
    );
    assert_eq!(
        (stat.num_children, stat.cversion),
        (4, 6),
        "cversion counts creations and deletions"
    );
}

async fn multi_is_atomic(b: &dyn Backend) {
    let s = b.session().await;
    create(&*s, "/t", b"v0").await;
    create(&*s, "/t/old", b"").await;
    let results = s
        .multi(vec![
            Op::check("/t", 0),
            Op::create("/t/dir", b"".to_vec(), CreateMode::Persistent),
            Op::create(
                "/t/dir/seq-",
                b"x".to_vec(),
                CreateMode::PersistentSequential,
            ),
            Op::set("/t", b"v1".to_vec(), Some(0)),
            Op::check("/t", 1),
            Op::delete("/t/old", None),
        ])
        .await
        .expect("multi");
    assert_eq!(results.len(), 6);
    assert_eq!(results[0], OpResult::Check);
    assert!(matches!(&results[1], OpResult::Create { path, .. } if path == "/t/dir"));
    assert!(
        matches!(&results[2], OpResult::Create { path, .. } if path == "/t/dir/seq-0000000000")
    );
    assert!(matches!(&results[3], OpResult::Set { stat } if stat.version == 1));
    assert_eq!(
        (results[4].clone(), results[5].clone()),
        (OpResult::Check, OpResult::Delete)
    );

    let (data, stat) = s.get("/t").await.expect("get");
    let err = s
        .multi(vec![
            Op::create("/t/new", b"".to_vec(), CreateMode::Persistent),
            Op::set("/t", b"v2".to_vec(), None),
            Op::create("/t/dir", b"".to_vec(), CreateMode::Persistent),
            Op::delete("/t/dir/seq-0000000000", None),
        ])
        .await
        .expect_err("third op must fail");
    match &err {
        CoordError::MultiFailed { index, source } => {
            assert_eq!(*index, 2);
            assert!(
                matches!(**source, CoordError::NodeExists { .. }),
                "{source:?}"
            );
        }
        other => panic!("expected MultiFailed, got {other:?}"),
    }
    assert_eq!(
        s.get("/t").await.expect("get"),
        (data, stat),
        "nothing applied"
    );
    assert_eq!(s.exists("/t/new").await.expect("exists"), None);
    assert!(s
        .exists("/t/dir/seq-0000000000")
        .await
        .expect("exists")
        .is_some());

    let err = s
        .multi(vec![Op::check("/t", 0)])
        .await
        .expect_err("stale check");
    assert!(
        matches!(err.root(), CoordError::BadVersion { .. }),
        "{err:?}"
    );
    assert_eq!(s.multi(vec![]).await.expect("empty multi"), vec![]);
}

async fn ephemerals_vanish_on_close(b: &dyn Backend) {
    let owner = b.session().await;
    let other = b.session().await;
    owner
        .create("/lock", b"me", CreateMode::Ephemeral)
        .await
        .expect("ephemeral");
    let stat = other
        .exists("/lock")
        .await
        .expect("exists")
        .expect("visible");
    assert_eq!(stat.ephemeral_owner, owner.session_id());
    assert_ne!(owner.session_id(), other.session_id());
    let (_, watch) = other.exists_watch("/lock").await.expect("watch");
    owner.close().await;
    assert_eq!(
        other.exists("/lock").await.expect("exists"),
        None,
        "gone once close returns"
    );
    assert_eq!(fired(watch).await.kind, WatchEventKind::NodeDeleted);
    assert_eq!(*owner.session_state().borrow(), SessionState::Closed);
    assert!(matches!(
        owner.get("/").await,
        Err(CoordError::SessionClosed)
    ));
}

async fn ephemerals_vanish_on_expiry(b: &dyn Backend) {
    let owner = b.session().await;
    let other = b.session().await;
    create(&*owner, "/owned", b"").await;
    ephemeral(&*owner, "/owned/e").await;
    let (_, _, owners_watch) = owner.get_watch("/owned").await.expect("watch");
    let (_, others_watch) = other.exists_watch("/owned/e").await.expect("watch");
    let mut state = owner.session_state();
    b.expire(&owner).await;
    tokio::time::timeout(SOON, state.wait_for(|s| *s == SessionState::Expired))
        .await
        .expect("expiry observed in time")
        .expect("state channel");
    assert_eq!(fired(others_watch).await.kind, WatchEventKind::NodeDeleted);
    assert_eq!(other.exists("/owned/e").await.expect("exists"), None);
    assert!(
        other.exists("/owned").await.expect("exists").is_some(),
        "persistent stays"
    );
    assert_eq!(
        fired(owners_watch).await.kind,
        WatchEventKind::SessionExpired
    );
    assert!(matches!(
        owner.get("/owned").await,
        Err(CoordError::SessionExpired)
    ));
}

async fn watches_fire_on_changes(b: &dyn Backend) {
    let watcher = b.session().await;
    let writer = b.session().await;
    // exists-watch on a missing node fires on creation.
    let (none, w) = watcher.exists_watch("/w").await.expect("exists watch");
    assert_eq!(none, None);
    create(&*writer, "/w", b"0").await;
    assert_eq!(
        fired(w).await,
        WatchEvent {
            kind: WatchEventKind::NodeCreated,
            path: "/w".into()
        }
    );
    // data watch fires on set, then (re-set) on delete.
    let (_, _, w) = watcher.get_watch("/w").await.expect("get watch");
    writer.set("/w", b"1", None).await.expect("set");
    assert_eq!(fired(w).await.kind, WatchEventKind::NodeDataChanged);
    // children watch fires on a child created and on a child deleted.
    let (_, _, w) = watcher.children_watch("/w").await.expect("children watch");
    create(&*writer, "/w/c", b"").await;
    assert_eq!(
        fired(w).await,
        WatchEvent {
            kind: WatchEventKind::NodeChildrenChanged,
            path: "/w".into()
        }
    );
    let (kids, _, w) = watcher.children_watch("/w").await.expect("children watch");
    assert_eq!(kids, vec!["c"]);
    writer.delete("/w/c", None).await.expect("delete child");
    assert_eq!(fired(w).await.kind, WatchEventKind::NodeChildrenChanged);
    // a setData does not fire a children watch; the delete of the node does.
    let (_, _, cw) = watcher.children_watch("/w").await.expect("children watch");
    let (_, _, dw) = watcher.get_watch("/w").await.expect("get watch");
    writer.set("/w", b"2", None).await.expect("set");
    assert_eq!(fired(dw).await.kind, WatchEventKind::NodeDataChanged);
    writer.delete("/w", None).await.expect("delete");
    assert_eq!(fired(cw).await.kind, WatchEventKind::NodeDeleted);
}

/// Following a node by "read with watch, wait, re-read" never misses the last
/// value, however fast the writer goes.
async fn watches_never_miss_the_last_change(b: &dyn Backend) {
    let watcher = b.session().await;
    let writer = b.session().await;
    create(&*writer, "/counter", b"0").await;
    let rounds = 60u32;
    let writes = tokio::spawn(async move {
        for i in 1..=rounds {
            writer
                .set("/counter", i.to_string().as_bytes(), None)
                .await
                .expect("set");
            if i % 7 == 0 {
                tokio::task::yield_now().await;
            }
        }
        writer
    });
    let last = rounds.to_string().into_bytes();
    let mut seen_versions = Vec::new();
    loop {
        let (data, stat, w) = watcher.get_watch("/counter").await.expect("get watch");
        seen_versions.push(stat.version);
        if data == last {
            break;
        }
        assert_eq!(fired(w).await.kind, WatchEventKind::NodeDataChanged);
    }
    assert!(
        seen_versions.windows(2).all(|v| v[0] < v[1]),
        "{seen_versions:?}"
    );
    assert_eq!(*seen_versions.last().expect("seen"), rounds as i32);
    writes.await.expect("writer task");
}

async fn traffic_is_counted(b: &dyn Backend) {
    let s = b.session().await;
    let before = s.metrics().snapshot();
    create(&*s, "/m", b"").await;
    let ops = (0..10)
        .map(|i| Op::create(format!("/m/{i}"), b"".to_vec(), CreateMode::Persistent))
        .collect();
    s.multi(ops).await.expect("multi");
    let _ = s.get("/m/nope").await;
    s.children("/m").await.expect("children");
    let after = s.metrics().snapshot();
    let delta = |k: RequestKind| after.round_trips_of(k) - before.round_trips_of(k);
    assert_eq!(delta(RequestKind::Create), 1);
    assert_eq!(delta(RequestKind::Multi), 1);
    assert_eq!(delta(RequestKind::Get), 1);
    assert_eq!(delta(RequestKind::Children), 1);
    assert_eq!(after.multi_ops - before.multi_ops, 10);
    assert_eq!(after.total_round_trips() - before.total_round_trips(), 4);
    let errors: u64 = after.errors.iter().map(|(_, n)| n).sum::<u64>()
        - before.errors.iter().map(|(_, n)| n).sum::<u64>();
    assert_eq!(errors, 1);
}

async fn create_all_builds_paths(b: &dyn Backend) {
    let s = b.session().await;
    ferry_coord::create_all(&*s, "/x/y/z")
        .await
        .expect("create_all");
    ferry_coord::create_all(&*s, "/x/y/z")
        .await
        .expect("idempotent");
    assert!(s.exists("/x/y/z").await.expect("exists").is_some());
    assert!(matches!(
        ferry_coord::create_all(&*s, "/x//y").await,
        Err(CoordError::InvalidPath { .. })
    ));
}

/// Version -1 means "any version" to ZooKeeper: passed on by mistake (from a
/// garbage stat, say) it would make a conditional write unconditional. Both
/// back-ends refuse every negative version before anything is sent.
async fn negative_versions_are_refused_alike(b: &dyn Backend) {
    let s = b.session().await;
    create(&*s, "/v", b"0").await;
    create(&*s, "/v/child", b"").await;
    let invalid = |r: Result<(), CoordError>| {
        assert!(
            matches!(r, Err(CoordError::InvalidVersion { version: -1, .. })),
            "{r:?}"
        );
    };
    invalid(s.set("/v", b"x", Some(-1)).await.map(|_| ()));
    // Not NotEmpty and not BadVersion: refused before the node is looked at.
    invalid(s.delete("/v", Some(-1)).await);
    invalid(s.delete("/v/child", Some(-7)).await.map_err(|e| match e {
        CoordError::InvalidVersion { path, .. } => CoordError::InvalidVersion { path, version: -1 },
        other => other,
    }));
    for op in [
        Op::check("/v", -1),
        Op::set("/v", b"x".to_vec(), Some(-1)),
        Op::delete("/v/child", Some(-1)),
    ] {
        let err = s
            .multi(vec![Op::check("/v", 0), op])
            .await
            .expect_err("refused");
        assert!(
            matches!(&err, CoordError::MultiFailed { index: 1, source } if matches!(**source, CoordError::InvalidVersion { .. })),
            "{err:?}"
        );
    }
    let (data, stat) = s.get("/v").await.expect("get");
    assert_eq!((data.as_slice(), stat.version), (&b"0"[..], 0), "unchanged");
    assert!(s.exists("/v/child").await.expect("exists").is_some());
}

/// ZooKeeper 3.8 answers a create inside a multi with a garbage stat (version
/// -1): no back-end hands out a stat there. A caller that takes the version a
/// fresh node has (0) keeps its conditional write conditional.
async fn versioned_set_after_a_multi_create_stays_conditional(b: &dyn Backend) {
    let s = b.session().await;
    let other = b.session().await;
    let results = s
        .multi(vec![
            Op::create("/mc", b"a".to_vec(), CreateMode::Persistent),
            Op::create("/mc/seq-", b"".to_vec(), CreateMode::PersistentSequential),
        ])
        .await
        .expect("multi");
    assert_eq!(
        results,
        vec![
            OpResult::Create { path: "/mc".into() },
            OpResult::Create {
                path: "/mc/seq-0000000000".into()
            }
        ]
    );
    let fresh = s.exists("/mc").await.expect("exists").expect("created");
    assert_eq!((fresh.version, fresh.cversion), (0, 1));
    other.set("/mc", b"b", None).await.expect("other session");
    assert!(matches!(
        s.set("/mc", b"c", Some(0)).await,
        Err(CoordError::BadVersion { .. })
    ));
    let (data, _) = s.get("/mc").await.expect("get");
    assert_eq!(data, b"b", "the conditional write did not happen");
}

/// A multi is sized exactly as ZooKeeper receives it (with the chroot): one
/// at the limit goes through, one byte more is a typed error before any I/O
/// (ZooKeeper would drop the connection, outcome unknown).
async fn multi_size_is_checked_exactly(b: &dyn Backend) {
    use ferry_coord::multi_request_bytes;
    let s = b.session().await;
    create(&*s, "/big", b"").await;
    let prefix = s.path_prefix_bytes();
    let build = |extra: usize| {
        let mut ops: Vec<Op> = (0..100)
            .map(|i| {
                Op::create(
                    format!("/big/n{i:03}"),
                    vec![3u8; 10_000],
                    CreateMode::Persistent,
                )
            })
            .collect();
        let used = multi_request_bytes(&ops, prefix);
        let last = MAX_REQUEST_BYTES
            - used
            - multi_request_bytes(
                &[Op::create("/big/last", Vec::new(), CreateMode::Persistent)],
                prefix,
            )
            + multi_request_bytes(&[], prefix)
            + extra;
        ops.push(Op::create(
            "/big/last",
            vec![4u8; last],
            CreateMode::Persistent,
        ));
        ops
    };
    let over = build(1);
    assert_eq!(multi_request_bytes(&over, prefix), MAX_REQUEST_BYTES + 1);
    let err = s.multi(over).await.expect_err("one byte too many");
    assert!(matches!(err, CoordError::TooLarge { .. }), "{err:?}");
    assert_eq!(s.children("/big").await.expect("children").0.len(), 0);
    // Many small operations, which a rough per-operation estimate undercounts.
    let many: Vec<Op> = (0..20_000)
        .map(|i| {
            Op::create(
                format!("/big/s{i:05}"),
                vec![1u8; 4],
                CreateMode::Persistent,
            )
        })
        .collect();
    let err = s.multi(many).await.expect_err("too many operations");
    assert!(matches!(err, CoordError::TooLarge { .. }), "{err:?}");
    let exact = build(0);
    assert_eq!(multi_request_bytes(&exact, prefix), MAX_REQUEST_BYTES);
    s.multi(exact).await.expect("exactly at the limit");
    assert_eq!(s.children("/big").await.expect("children").0.len(), 101);
    assert_eq!(*s.session_state().borrow(), SessionState::Connected);
}

/// A client sees a watch event before it can read the data that fired it.
async fn watch_events_come_before_the_data(b: &dyn Backend) {
    let watcher = b.session().await;
    let writer = b.session().await;
    create(&*watcher, "/w", b"0").await;
    for i in 1..=50u32 {
        let (_, _, watch) = watcher.get_watch("/w").await.expect("watch");
        let value = i.to_string();
        writer.set("/w", value.as_bytes(), None).await.expect("set");
        // Read until the change shows: from then on the event is there.
        loop {
            let (data, _) = watcher.get("/w").await.expect("get");
            if data == value.as_bytes() {
                break;
            }
        }
        let event = tokio::time::timeout(std::time::Duration::ZERO, watch.changed())
            .await
            .expect("the event is delivered before the new data is readable");
        assert_eq!(event.kind, WatchEventKind::NodeDataChanged);
    }
}

/// Closing a session deletes its ephemerals, and its own watches on them see
/// that (as on ZooKeeper); the rest of its watches see the session closed.
async fn a_closing_session_sees_its_own_ephemerals_go(b: &dyn Backend) {
    let s = b.session().await;
    create(&*s, "/own", b"").await;
    ephemeral(&*s, "/own/e").await;
    let (_, _, on_node) = s.get_watch("/own/e").await.expect("watch");
    let (_, _, on_parent) = s.children_watch("/own").await.expect("watch");
    s.close().await;
    let node = fired(on_node).await;
    assert_eq!(
        (node.kind, node.path.as_str()),
        (WatchEventKind::NodeDeleted, "/own/e")
    );
    let parent = fired(on_parent).await;
    assert_eq!(
        (parent.kind, parent.path.as_str()),
        (WatchEventKind::NodeChildrenChanged, "/own")
    );
}

/// Errors of a sequential create name the prefix the caller gave, as
/// ZooKeeper's do.
async fn sequential_create_errors_name_the_prefix(b: &dyn Backend) {
    let s = b.session().await;
    let err = s
        .create("/nowhere/q-", b"", CreateMode::PersistentSequential)
        .await
        .expect_err("no parent");
    assert_eq!(
        err,
        CoordError::NoNode {
            path: "/nowhere/q-".into()
        }
    );
    ephemeral(&*s, "/eph").await;
    let err = s
        .create("/eph/q-", b"", CreateMode::EphemeralSequential)
        .await
        .expect_err("no children for ephemerals");
    assert_eq!(
        err,
        CoordError::NoChildrenForEphemerals {
            path: "/eph/q-".into()
        }
    );
}

/// A request on a handle after `close` returned is always `SessionClosed`.
async fn requests_after_close_are_session_closed(b: &dyn Backend) {
    for _ in 0..30 {
        let s = b.session().await;
        s.close().await;
        let err = s.get("/").await.expect_err("closed");
        assert_eq!(err, CoordError::SessionClosed);
        let err = s
            .create("/after-close", b"", CreateMode::Persistent)
            .await
            .expect_err("closed");
        assert_eq!(err, CoordError::SessionClosed);
    }
}

/// After its session expired, a node opens a new one through its factory
/// without knowing the back-end: the old ephemerals are gone, the new session
/// works and can take them again.
async fn a_factory_replaces_an_expired_session(b: &dyn Backend) {
    let factory = b.factory();
    let old = b.session().await;
    old.create("/leader", b"old", CreateMode::Ephemeral)
        .await
        .expect("ephemeral");
    b.expire(&old).await;
    assert!(matches!(
        old.get("/").await,
        Err(CoordError::SessionExpired)
    ));
    let new = factory.open().await.expect("a new session");
    assert_ne!(new.session_id(), old.session_id());
    assert_eq!(*new.session_state().borrow(), SessionState::Connected);
    assert_eq!(new.exists("/leader").await.expect("exists"), None);
    let (_, stat) = new
        .create("/leader", b"new", CreateMode::Ephemeral)
        .await
        .expect("taken again");
    assert_eq!(stat.ephemeral_owner, new.session_id());
}

/// What a node holds: after an expiry the next request runs on a new session
/// (the export request path and the writer's commit record rely on it).
async fn a_renewing_session_replaces_an_expired_one(b: &dyn Backend) {
    let renewing = ferry_coord::RenewingSession::with(b.factory(), b.session().await);
    let old = renewing.session().await.expect("live");
    let mut state = old.session_state();
    b.expire(&old).await;
    tokio::time::timeout(SOON, state.wait_for(|s| *s == SessionState::Expired))
        .await
        .expect("expiry observed in time")
        .expect("state channel");
    assert_eq!(renewing.renewals(), 0);
    let new = renewing.session().await.expect("a new session");
    assert_ne!(new.session_id(), old.session_id());
    assert_eq!(renewing.renewals(), 1);
    new.create("/renewed", b"", CreateMode::Persistent)
        .await
        .expect("the new session works");
    // A live session is kept.
    let again = renewing.session().await.expect("live");
    assert_eq!(again.session_id(), new.session_id());
    assert_eq!(renewing.renewals(), 1);
    renewing.close().await;
}

/// Bad input is refused as such even on an expired session (ZooKeeper's
/// client checks a request before it asks the server); a closed handle
/// answers `SessionClosed` first.
async fn bad_input_on_an_ended_session_is_still_bad_input(b: &dyn Backend) {
    let s = b.session().await;
    b.expire(&s).await;
    assert!(matches!(
        s.delete("/", Some(1)).await,
        Err(CoordError::InvalidPath { .. })
    ));
    assert!(matches!(
        s.set("/x", b"", Some(-1)).await,
        Err(CoordError::InvalidVersion { .. })
    ));
    assert_eq!(s.get("/x").await, Err(CoordError::SessionExpired));
    s.close().await;
    assert_eq!(s.delete("/", Some(1)).await, Err(CoordError::SessionClosed));
}

conformance!(
    nodes_crud_and_stats,
    typed_errors,
    bad_input_is_refused_alike,
    largest_data_round_trips,
    sequential_nodes,
    multi_is_atomic,
    ephemerals_vanish_on_close,
    ephemerals_vanish_on_expiry,
    watches_fire_on_changes,
    watches_never_miss_the_last_change,
    traffic_is_counted,
    create_all_builds_paths,
    negative_versions_are_refused_alike,
    versioned_set_after_a_multi_create_stays_conditional,
    multi_size_is_checked_exactly,
    watch_events_come_before_the_data,
    a_closing_session_sees_its_own_ephemerals_go,
    sequential_create_errors_name_the_prefix,
    requests_after_close_are_session_closed,
    a_factory_replaces_an_expired_session,
    a_renewing_session_replaces_an_expired_one,
    bad_input_on_an_ended_session_is_still_bad_input,
);
