//! The store keeps deciding across what happens to its connection: a Redis that restarts (the
//! first decision after it is Redis's again, not a failure), and a connection that goes silent
//! without closing (replaced, instead of timing out until the kernel gives it up).

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use sluice_store_redis::{Layer, Mode, RedisStore, StoreError, StoreOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test]
async fn the_first_decision_after_redis_restarts_is_decided_by_it() {
    let mut redis = RedisServer::start();
    let port = redis.port;
    let store = redis.store().await;
    let limit = remote(&fixed("a", 100, SECOND));
    let layers = [Layer::enforced(&limit, key("caller"))];
    assert!(admitted(&store, &layers).await);
    // Restarted at once: the store's connection is still the dead one's.
    redis.kill();
    let mut redis = RedisServer::start_on(port);
    let after = store.decide(&layers, 1, Mode::Charge).await;
    assert!(
        after.as_ref().is_ok_and(|d| d.is_admitted()),
        "the first decision after the restart: {after:?}"
    );
    assert_eq!(redis.calls("script|load"), 1, "the script loaded again");
    // Down for a while, with decisions failing meanwhile.
    redis.kill();
    let down = store.decide(&layers, 1, Mode::Charge).await;
    assert!(
        matches!(&down, Err(e) if e.is_store_failure()),
        "Redis is down: {down:?}"
    );
    let _redis = RedisServer::start_on(port);
    let after = store.decide(&layers, 1, Mode::Charge).await;
    assert!(
        after.as_ref().is_ok_and(|d| d.is_admitted()),
        "the first decision after the second restart: {after:?}"
    );
}

/// A reconnection Redis refused for its credentials (restarted without the password the
/// store's url gives) does not leave the store on that refusal once Redis takes them again:
/// the connection manager hands every later call the refusal it remembers, at once, and
/// reconnects only after I/O errors, so the store connects anew itself (review: the gateway
/// stayed on `on_error` until restarted).
#[tokio::test]
async fn a_reconnection_refused_for_credentials_is_tried_again() {
    let mut redis = RedisServer::start();
    let port = redis.port;
    redis.cli(&["CONFIG", "SET", "requirepass", "sekret"]);
    let options = StoreOptions {
        timeout: Duration::from_millis(500),
        ..StoreOptions::default()
    };
    let url = format!("redis://:sekret@127.0.0.1:{port}");
    let store = RedisStore::connect(&url, options).await.unwrap();
    let limit = remote(&fixed("a", 1000, SECOND));
    let layers = [Layer::enforced(&limit, key("caller"))];
    assert!(admitted(&store, &layers).await);
    // Back without a password: the reconnection's AUTH is refused.
    redis.kill();
    let redis = RedisServer::start_on(port);
    let mut refused = Vec::new();
    for _ in 0..5 {
        let e = store.decide(&layers, 1, Mode::Charge).await.unwrap_err();
        refused.push(e.to_string());
    }
    // The password is back: decisions are Redis's again within seconds.
    redis.cli(&["CONFIG", "SET", "requirepass", "sekret"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.decide(&layers, 1, Mode::Charge).await {
            Ok(d) => {
                assert!(d.is_admitted());
                break;
            }
            Err(e) => assert!(
                Instant::now() < deadline,
                "Redis takes the password again, but: {e} (before: {refused:?})"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A Redis that went down (connections refused) is named so: decisions time out while the
/// connection manager waits on its reconnection, and once the store's own attempt to connect
/// anew has failed, their error says why, not only that Redis did not answer in time. An
/// answer clears it.
#[tokio::test]
async fn a_redis_that_refuses_connections_is_named_so() {
    let mut redis = RedisServer::start();
    let port = redis.port;
    let options = StoreOptions {
        timeout: Duration::from_millis(200),
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&redis.url(), options).await.unwrap();
    let limit = remote(&fixed("a", 1000, SECOND));
    let layers = [Layer::enforced(&limit, key("caller"))];
    assert!(admitted(&store, &layers).await);
    redis.kill();
    let mut seen = Vec::new();
    let named = loop {
        let e = store.decide(&layers, 1, Mode::Charge).await.unwrap_err();
        assert!(e.is_store_failure(), "{e}");
        if let StoreError::Unreachable { why, .. } = &e {
            break why.to_string();
        }
        seen.push(e.to_string());
        assert!(seen.len() < 50, "never named the refusal: {seen:?}");
    };
    assert!(named.to_lowercase().contains("refused"), "{named}");
    let redis = RedisServer::start_on(port);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match store.decide(&layers, 1, Mode::Charge).await {
            Ok(d) => {
                assert!(d.is_admitted());
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "Redis is back, but: {e}"),
        }
    }
    // Answered: a later silence is a plain timeout again, not the old refusal.
    let stalled = stall_for_a_second(&redis).await;
    let late = store.decide(&layers, 1, Mode::Charge).await;
    assert!(matches!(late, Err(StoreError::Timeout(_))), "{late:?}");
    stalled.await.unwrap();
}

/// A TCP relay in front of Redis that can fall silent on the connections it holds (bytes are
/// no longer passed either way, nothing is closed), as a dropped route or a firewall that
/// forgot the connection does; connections made after that pass.
struct Relay {
    addr: SocketAddr,
    accepted: Arc<AtomicU64>,
    silent_below: Arc<AtomicU64>,
}

impl Relay {
    async fn start(to: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let silent_below = Arc::new(AtomicU64::new(0));
        let (count, silent) = (Arc::clone(&accepted), Arc::clone(&silent_below));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let id = count.fetch_add(1, Ordering::SeqCst);
                let server = TcpStream::connect(to).await.unwrap();
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pump(cr, sw, id, Arc::clone(&silent)));
                tokio::spawn(pump(sr, cw, id, Arc::clone(&silent)));
            }
        });
        Relay {
            addr,
            accepted,
            silent_below,
        }
    }

    /// Every connection made so far falls silent.
    fn silence(&self) {
        let made = self.accepted.load(Ordering::SeqCst);
        self.silent_below.store(made, Ordering::SeqCst);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    id: u64,
    silent_below: Arc<AtomicU64>,
) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if id < silent_below.load(Ordering::SeqCst) {
            // Swallowed; the halves stay open (held by this task) until the test ends.
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A Redis, a relay in front of it, and a store (timeout 200 ms) that talks through the relay.
async fn relayed() -> (RedisServer, Relay, RedisStore) {
    let redis = RedisServer::start();
    let relay = Relay::start(format!("127.0.0.1:{}", redis.port).parse().unwrap()).await;
    let options = StoreOptions {
        timeout: Duration::from_millis(200),
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&format!("redis://{}", relay.addr), options)
        .await
        .unwrap();
    (redis, relay, store)
}

#[tokio::test]
async fn a_connection_that_falls_silent_is_replaced() {
    let (_redis, relay, store) = relayed().await;
    let limit = remote(&fixed("a", 1000, SECOND));
    let layers = [Layer::enforced(&limit, key("caller"))];
    assert!(admitted(&store, &layers).await);
    relay.silence();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut timeouts = 0;
    loop {
        match store.decide(&layers, 1, Mode::Charge).await {
            Ok(d) => {
                assert!(d.is_admitted());
                break;
            }
            Err(StoreError::Timeout(_)) => timeouts += 1,
            Err(e) => panic!("{e}"),
        }
        assert!(
            Instant::now() < deadline,
            "still timing out after {timeouts} decisions: the silent connection was kept"
        );
    }
    assert!(timeouts >= 1, "the silence was noticed");
    assert!(
        relay.accepted.load(Ordering::SeqCst) >= 2,
        "a new connection"
    );
}

#[tokio::test]
async fn a_release_that_fails_is_tried_again_instead_of_holding_the_slot_until_it_expires() {
    let (_redis, relay, store) = relayed().await;
    let limit = remote(&concurrency("one-at-a-time", 1));
    let layers = [Layer::enforced(&limit, key("caller"))];
    let first = store.decide(&layers, 1, Mode::Charge).await.unwrap();
    assert!(first.is_admitted());
    assert!(!store
        .decide(&layers, 1, Mode::Charge)
        .await
        .unwrap()
        .is_admitted());
    relay.silence();
    drop(first); // its release goes out on the silent connection and times out
                 // Well within the lease's 60 s expiry, the slot is free again.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match store.decide(&layers, 1, Mode::Charge).await {
            Ok(d) if d.is_admitted() => break,
            Ok(_) | Err(StoreError::Timeout(_)) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(
            Instant::now() < deadline,
            "the slot is still held: the failed release was not tried again"
        );
        // Each refusal is one call; spaced so the loop does not spin against Redis.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Stalls `redis` for a second (`DEBUG SLEEP 1`); returns once the stall has begun (a `PING`
/// on another connection no longer answers at once), with the task that ends with it.
async fn stall_for_a_second(redis: &RedisServer) -> tokio::task::JoinHandle<()> {
    let mut probe = redis.admin().await;
    let mut admin = redis.admin().await;
    let stall = tokio::spawn(async move {
        let _: () = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg("1")
            .query_async(&mut admin)
            .await
            .unwrap();
    });
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "DEBUG SLEEP never stalled Redis"
        );
        let cmd = redis::cmd("PING");
        let ping = cmd.query_async::<String>(&mut probe);
        if tokio::time::timeout(Duration::from_millis(100), ping)
            .await
            .is_err()
        {
            return stall;
        }
    }
}

/// Redis stalls past the store's timeout, then runs the decision it was sent: the request
/// has already been answered without it (a fallback), so the lease that decision took must
/// not hold the caller's slot until it expires.
#[tokio::test]
async fn a_lease_taken_by_a_decision_that_came_too_late_is_released() {
    let redis = RedisServer::start();
    let options = StoreOptions {
        timeout: Duration::from_millis(300),
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&redis.url(), options).await.unwrap();
    let limit = remote(&concurrency("one-at-a-time", 1));
    let layers = [Layer::enforced(&limit, key("caller"))];
    let stall = stall_for_a_second(&redis).await;
    let late = store.decide(&layers, 1, Mode::Charge).await;
    assert!(matches!(late, Err(StoreError::Timeout(_))), "{late:?}");
    stall.await.unwrap();
    // Redis ran the late decision (a lease) and then the release: the slot is free.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = store.decide(&layers, 1, Mode::Charge).await.unwrap();
        if d.is_admitted() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the late decision's lease still holds the slot"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Redis stalls past the store's timeout, then reaches a decision whose sender has given up:
/// the request was answered without it (a fallback), so it must not be charged in Redis too.
/// Also for the first decision after connecting: the store reads Redis's clock as it connects.
#[tokio::test]
async fn a_decision_redis_reaches_after_its_deadline_charges_nothing() {
    for first in [true, false] {
        decision_past_its_deadline_charges_nothing(first).await;
    }
}

async fn decision_past_its_deadline_charges_nothing(first: bool) {
    let redis = RedisServer::start();
    let options = StoreOptions {
        timeout: Duration::from_millis(300),
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&redis.url(), options).await.unwrap();
    let limit = remote(&fixed("once-an-hour", 1, Duration::from_secs(3600)));
    if !first {
        let other = [Layer::enforced(&limit, key("someone else"))];
        assert!(admitted(&store, &other).await);
    }
    let layers = [Layer::enforced(&limit, key("caller"))];
    let stall = stall_for_a_second(&redis).await;
    let late = store.decide(&layers, 1, Mode::Charge).await;
    assert!(matches!(late, Err(StoreError::Timeout(_))), "{late:?}");
    stall.await.unwrap();
    // Redis reached the late decision after its deadline and charged nothing: the caller's
    // one request an hour is still there.
    let after = store.decide(&layers, 1, Mode::Charge).await.unwrap();
    assert!(
        after.is_admitted(),
        "the late decision was charged (first: {first}): {after:?}"
    );
}

/// A Redis that answers but refuses the connection says why: the error names the wrong
/// password or the missing database, rather than a silence.
#[tokio::test]
async fn a_wrong_password_or_database_is_named_not_taken_for_silence() {
    let server = RedisServer::start();
    let url = server.url();
    let port = url.rsplit(':').next().unwrap();
    assert_eq!(
        server
            .cli(&["CONFIG", "SET", "requirepass", "right"])
            .trim(),
        "OK"
    );
    let options = StoreOptions::default();
    let refused = |url: String| async move {
        match RedisStore::connect(&url, options).await {
            Ok(_) => panic!("{url} connected"),
            Err(e) => e.to_string(),
        }
    };
    let wrong = refused(format!("redis://:wrong@127.0.0.1:{port}")).await;
    assert!(wrong.contains("authentication failed"), "{wrong}");
    let missing = refused(format!("redis://127.0.0.1:{port}")).await;
    assert!(missing.contains("NOAUTH"), "{missing}");
    let no_db = refused(format!("redis://:right@127.0.0.1:{port}/99")).await;
    assert!(no_db.contains("DB index"), "{no_db}");
    assert!(
        RedisStore::connect(&format!("redis://:right@127.0.0.1:{port}"), options)
            .await
            .is_ok()
    );
}
