//! A decision Redis reaches in time but whose answer comes back after the store's timeout
//! (a slow path from Redis to the gateway): the caller has followed `on_error` already, so
//! what Redis charged for it is taken back when the answer comes.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use sluice_store_redis::{Layer, Mode, RedisStore, RemoteDecision, StoreError, StoreOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy to `redis` that, while `slow` is set, holds each piece of Redis's answers back
/// for `delay` before passing it on (the requests go through at once). Returns its address.
async fn slow_way_back(redis: String, slow: Arc<AtomicBool>, delay: Duration) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(&redis).await else {
                return;
            };
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
            });
            let slow = Arc::clone(&slow);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match server_read.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if slow.load(Ordering::Relaxed) {
                        // The network's delay, not the test's clock: what is measured is
                        // that the answer comes after the store stopped waiting.
                        tokio::time::sleep(delay).await;
                    }
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("redis://{addr}")
}

/// What is left of a quota of 10 after a decision.
fn remaining(d: RemoteDecision) -> u32 {
    match d {
        RemoteDecision::Admitted(a) => a.reports[0].remaining,
        RemoteDecision::Refused(r) => r.reports[0].remaining,
        other => panic!("{other:?}"),
    }
}

/// Watches `layers` through `direct` (a store without the slow way back) until the second
/// request's charge has been seen (8 left of 10) and then taken back (9 again), within 10 s.
async fn charged_then_back(direct: &RedisStore, layers: &[Layer<'_>], what: &str) {
    let watch = async {
        let mut seen_charged = false;
        loop {
            let now = direct.decide(layers, 1, Mode::CheckOnly).await.unwrap();
            match remaining(now) {
                8 => seen_charged = true,
                9 if seen_charged => return,
                9 => {}
                other => panic!("remaining {other}"),
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), watch)
        .await
        .expect(what);
}

#[tokio::test]
async fn what_redis_charged_for_a_decision_answered_too_late_is_taken_back() {
    let server = RedisServer::start();
    let slow = Arc::new(AtomicBool::new(false));
    let redis = server.url().trim_start_matches("redis://").to_owned();
    let proxy = slow_way_back(redis, Arc::clone(&slow), Duration::from_secs(1)).await;
    let options = StoreOptions {
        timeout: Duration::from_millis(100),
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&proxy, options).await.unwrap();
    let direct = server.store().await;
    let limit = remote(&fixed("f", 10, Duration::from_secs(3600)));
    let layers = [Layer::enforced(&limit, key("caller"))];
    // Answers on time: learn Redis's clock, charge one.
    let first = store.decide(&layers, 1, Mode::Charge).await.unwrap();
    assert_eq!(remaining(first), 9);
    slow.store(true, Ordering::Relaxed);
    let late = store.decide(&layers, 1, Mode::Charge).await;
    assert!(matches!(late, Err(StoreError::Timeout(_))), "{late:?}");
    // Redis charged it (it came in time); its answer, then the refund, come back later.
    charged_then_back(&direct, &layers, "the late decision's charge taken back").await;
}

/// A decision whose caller stopped waiting before Redis answered (its client left) is taken
/// back when the answer comes, whatever `take_back_late` says: the request is not served.
#[tokio::test]
async fn what_redis_charged_for_a_caller_that_left_is_taken_back() {
    let server = RedisServer::start();
    let slow = Arc::new(AtomicBool::new(false));
    let redis = server.url().trim_start_matches("redis://").to_owned();
    let proxy = slow_way_back(redis, Arc::clone(&slow), Duration::from_secs(1)).await;
    let options = StoreOptions {
        timeout: Duration::from_secs(5),
        take_back_late: false,
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&proxy, options).await.unwrap();
    let direct = server.store().await;
    let limit = remote(&fixed("f", 10, Duration::from_secs(3600)));
    let layers = [Layer::enforced(&limit, key("caller"))];
    assert!(store
        .decide(&layers, 1, Mode::Charge)
        .await
        .unwrap()
        .is_admitted());
    slow.store(true, Ordering::Relaxed);
    // The caller leaves after 100 ms, long before the store's timeout.
    let left = tokio::time::timeout(
        Duration::from_millis(100),
        store.decide(&layers, 1, Mode::Charge),
    );
    assert!(left.await.is_err(), "answered before the caller left");
    charged_then_back(
        &direct,
        &layers,
        "the charge of the caller that left taken back",
    )
    .await;
}
