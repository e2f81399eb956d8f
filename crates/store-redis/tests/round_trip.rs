//! One `EVALSHA` per decision, `NOSCRIPT` handled, every key with an expiry, no raw identity
//! in Redis; and a slow Redis answered by a typed timeout within a bound.

mod common;

use std::time::Duration;

use common::*;
use sluice_store_redis::{
    Layer, Mode, RedisStore, RemoteDecision, RemoteLimit, StoreError, StoreOptions,
};

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test]
async fn each_decision_over_three_limits_is_one_evalsha() {
    let server = RedisServer::start();
    let store = server.store().await;
    let limits = [
        remote(&fixed("a", 100, SECOND)),
        remote(&sliding("b", 100, SECOND)),
        remote(&bucket("c", 100, SECOND, 100)),
    ];
    let k = key("caller");
    let layers: Vec<_> = limits.iter().map(|l| Layer::enforced(l, k)).collect();
    for _ in 0..20 {
        let _ = store.decide(&layers, 1, Mode::Charge).await.unwrap();
    }
    assert_eq!(server.calls("evalsha"), 20);
    assert_eq!(server.calls("eval"), 0);
    assert_eq!(server.calls("script|load"), 1, "loaded once, at connect");
}

#[tokio::test]
async fn script_flush_is_survived_by_reloading_transparently() {
    let server = RedisServer::start();
    let store = server.store().await;
    let limit = remote(&fixed("a", 5, SECOND));
    let layers = [Layer::enforced(&limit, key("caller"))];
    assert!(admitted(&store, &layers).await);
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut server.admin().await)
        .await
        .unwrap();
    assert!(admitted(&store, &layers).await);
    assert_eq!(server.calls("script|load"), 2);
    assert!(admitted(&store, &layers).await);
    assert_eq!(server.calls("script|load"), 2, "reloaded once only");
}

#[tokio::test]
async fn every_key_expires_and_names_only_the_keyed_hash() {
    let server = RedisServer::start();
    let store = server.store().await;
    let limits = [
        remote(&fixed("fw", 1, SECOND).with_block_for(10 * SECOND).unwrap()),
        remote(&sliding("sw", 5, SECOND)),
        remote(&bucket("tb", 5, SECOND, 5)),
        remote(&concurrency("cc", 5)),
    ];
    let k = key("secret-api-key-42");
    let layers: Vec<_> = limits.iter().map(|l| Layer::enforced(l, k)).collect();
    let held = store.decide(&layers, 1, Mode::Charge).await.unwrap();
    assert!(held.is_admitted());
    let _ = store.decide(&layers, 1, Mode::Charge).await.unwrap(); // refused: starts a block
    let mut admin = server.admin().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(keys.len(), 4, "{keys:?}");
    for name in keys {
        assert!(!name.contains("secret-api-key"), "{name}");
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&name)
            .query_async(&mut admin)
            .await
            .unwrap();
        let bound = if name.starts_with("sluice:fw:") {
            10_000
        } else {
            60_000
        };
        assert!(ttl > 0 && ttl <= bound, "{name}: PTTL {ttl}");
    }
    assert!(limits.iter().all(|l| {
        let name = l.key_name(k);
        name.starts_with(&format!("sluice:{}:", l.limit().name()))
    }));
}

#[tokio::test]
async fn sleeping_redis_gives_a_timeout_error_within_the_timeout() {
    let server = RedisServer::start();
    let timeout = Duration::from_millis(100);
    let options = StoreOptions {
        timeout,
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&server.url(), options).await.unwrap();
    let limit = remote(&fixed("a", 5, SECOND));
    let layers = [Layer::enforced(&limit, key("caller"))];
    assert!(store.decide(&layers, 1, Mode::Charge).await.is_ok());
    // Redis sleeps 0.5 s (bounded); the store gives up after 0.1 s.
    let mut admin = server.admin().await;
    let sleeper = tokio::spawn(async move {
        let _: redis::RedisResult<()> = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg("0.5")
            .query_async(&mut admin)
            .await;
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let start = tokio::time::Instant::now();
    let err = store.decide(&layers, 1, Mode::Charge).await.unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(err, StoreError::Timeout(t) if t == timeout),
        "{err}"
    );
    assert!(
        took >= timeout && took < timeout + Duration::from_millis(150),
        "{took:?}"
    );
    sleeper.await.unwrap();
    assert!(
        store.decide(&layers, 1, Mode::Charge).await.is_ok(),
        "answers again"
    );
}

#[tokio::test]
async fn unreachable_redis_fails_to_connect_with_a_typed_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port(); // bound then dropped: nothing listens there
    let options = StoreOptions {
        connect_timeout: Duration::from_millis(300),
        ..StoreOptions::default()
    };
    let start = tokio::time::Instant::now();
    let url = format!("redis://127.0.0.1:{port}/");
    let err = RedisStore::connect(&url, options).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Redis(_) | StoreError::Timeout(_)),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(1));
}

/// A store with `timeout` on a fresh Redis, a limit of 1,000 an hour, and one decision made, so
/// that the store knows Redis's clock and requests carry their deadlines to it.
async fn warmed(timeout: Duration) -> (RedisServer, RedisStore, RemoteLimit) {
    let server = RedisServer::start();
    let options = StoreOptions {
        timeout,
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&server.url(), options).await.unwrap();
    let limit = remote(&fixed("l", 1000, Duration::from_secs(3600)));
    let warm = [Layer::enforced(&limit, key("warm"))];
    assert!(store.decide(&warm, 1, Mode::Charge).await.is_ok());
    (server, store, limit)
}

/// Decides for caller `name` in a task of its own: the result, and when it came (from `start`).
fn ask(
    store: &RedisStore,
    limit: &RemoteLimit,
    name: &'static str,
    start: tokio::time::Instant,
) -> tokio::task::JoinHandle<(Result<(), StoreError>, Duration)> {
    let (store, limit) = (store.clone(), limit.clone());
    tokio::spawn(async move {
        let layers = [Layer::enforced(&limit, key(name))];
        let result = store.decide(&layers, 1, Mode::Charge).await.map(drop);
        (result, start.elapsed())
    })
}

/// What caller `name` has left, without charging it.
async fn remaining(store: &RedisStore, limit: &RemoteLimit, name: &str) -> u32 {
    let layers = [Layer::enforced(limit, key(name))];
    match store.decide(&layers, 1, Mode::CheckOnly).await.unwrap() {
        RemoteDecision::Admitted(a) => a.reports[0].remaining,
        other => panic!("{other:?}"),
    }
}

/// Each request has the whole timeout from its own asking, whatever the requests it shares a
/// call with: one that asked after the runtime was stuck past an older request's timeout is
/// still decided (the older one, out of time before its call went, is answered `Timeout`
/// without being sent).
#[tokio::test(flavor = "current_thread")]
async fn a_request_batched_with_one_out_of_time_still_gets_its_whole_timeout() {
    let timeout = Duration::from_millis(50);
    let (server, store, limit) = warmed(timeout).await;
    let calls = server.calls("evalsha");
    let start = tokio::time::Instant::now();
    let old = ask(&store, &limit, "old", start);
    // The only thread is busy past the old request's timeout before the batcher runs.
    let stuck = tokio::spawn(async move { std::thread::sleep(timeout + timeout / 5) });
    let new = ask(&store, &limit, "new", start);
    let (old, _) = old.await.unwrap();
    stuck.await.unwrap();
    let (new, _) = new.await.unwrap();
    assert!(matches!(old, Err(StoreError::Timeout(_))), "{old:?}");
    assert!(new.is_ok(), "{new:?}");
    assert_eq!(
        server.calls("evalsha"),
        calls + 1,
        "the old request was not sent"
    );
    // The old one charged nothing: its caller followed `on_error` instead.
    assert_eq!(remaining(&store, &limit, "old").await, 1000);
}

/// The call's timer is re-armed for each request's own deadline: while a stalled Redis holds
/// the call, the older request is answered `Timeout` at its deadline (and Redis, reaching it
/// later, charges it nothing), and the newer one goes on waiting and gets its decision.
#[tokio::test(flavor = "current_thread")]
async fn while_a_call_waits_each_request_is_given_up_at_its_own_deadline() {
    let timeout = Duration::from_millis(400);
    let (server, store, limit) = warmed(timeout).await;
    let start = tokio::time::Instant::now();
    let old = ask(&store, &limit, "old", start);
    // The only thread is busy for 250 ms, so both requests go in one call; 200 ms in, Redis
    // is stalled for 350 ms from another connection: the call is answered at about 550 ms,
    // past the old request's deadline (400 ms), within the new one's (650 ms).
    let mut cli = server.cli_command(&["DEBUG", "SLEEP", "0.35"]);
    cli.stdout(std::process::Stdio::null());
    let stuck = tokio::spawn(async move {
        std::thread::sleep(Duration::from_millis(200));
        let sleeper = cli.spawn().expect("redis-cli runs");
        std::thread::sleep(Duration::from_millis(50));
        sleeper
    });
    let new = ask(&store, &limit, "new", start);
    let (old, old_took) = old.await.unwrap();
    let mut sleeper = stuck.await.unwrap();
    let (new, new_took) = new.await.unwrap();
    sleeper.wait().unwrap();
    assert!(matches!(old, Err(StoreError::Timeout(_))), "{old:?}");
    assert!(
        old_took >= timeout && old_took < new_took,
        "the old request was given up at {old_took:?}, the new one answered at {new_took:?}"
    );
    assert!(new.is_ok(), "{new:?} at {new_took:?}");
    assert_eq!(
        remaining(&store, &limit, "old").await,
        1000,
        "given up, and not charged"
    );
    assert_eq!(remaining(&store, &limit, "new").await, 999);
}
