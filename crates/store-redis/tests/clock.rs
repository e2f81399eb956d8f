//! Redis's clock stepping back (a failover to a replica whose clock lags, a VM restored, an
//! NTP step): states written ahead of the new clock are no quota spent for as long as the
//! step. Simulated by moving a stored state forward, as the step leaves it.

mod common;

use std::time::Duration;

use common::*;
use sluice_store_redis::{Layer, Mode, RedisStore, RemoteDecision, RemoteLimit};

const HOUR_US: f64 = 3_600_000_000.0;

/// Moves the first number of the one state key of `limit` (a window's index, a bucket's time
/// in us) forward by `by`, and its expiry by an hour, as a clock step back of an hour leaves
/// them.
async fn step_back(server: &RedisServer, store_key: &str, by: f64) {
    let mut admin = server.admin().await;
    let state: Vec<u8> = redis::cmd("GET")
        .arg(store_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(state[0], 0, "a state in the script's binary form");
    let mut moved = state.clone();
    let field = |i: usize| f64::from_le_bytes(state[1 + 8 * i..9 + 8 * i].try_into().unwrap());
    moved[1..9].copy_from_slice(&(field(0) + by).to_le_bytes());
    let exp = (state.len() - 1) / 8 - 1; // the expiry is the last field
    moved[1 + 8 * exp..9 + 8 * exp].copy_from_slice(&(field(exp) + HOUR_US).to_le_bytes());
    let _: () = redis::cmd("SET")
        .arg(store_key)
        .arg(moved)
        .arg("KEEPTTL")
        .query_async(&mut admin)
        .await
        .unwrap();
}

async fn wait_of(store: &RedisStore, layers: &[Layer<'_>]) -> Option<Duration> {
    match store.decide(layers, 1, Mode::Charge).await.unwrap() {
        RemoteDecision::Admitted(_) => None,
        RemoteDecision::Refused(r) => Some(r.wait.expect("a wait")),
        other => panic!("{other:?}"),
    }
}

/// A window state an hour ahead of the clock is taken for the current window's (its count
/// kept), not for a window spent until the clock catches up (review: "30 of 30 used" and a
/// `Retry-After` of about an hour).
#[tokio::test]
async fn a_window_written_ahead_of_a_clock_that_stepped_back_counts_as_the_current_one() {
    let server = RedisServer::start();
    let store = server.store().await;
    for limit in [
        fixed("fw", 3, Duration::from_secs(60)),
        sliding("sw", 3, Duration::from_secs(60)),
    ] {
        let limit: RemoteLimit = remote(&limit);
        let k = key("caller");
        let layers = [Layer::enforced(&limit, k)];
        assert_eq!(wait_of(&store, &layers).await, None);
        step_back(&server, &limit.key_name(k), 60.0).await;
        // One of three spent: two more pass, then the window is spent.
        assert_eq!(
            wait_of(&store, &layers).await,
            None,
            "{}",
            limit.limit().name()
        );
        assert_eq!(
            wait_of(&store, &layers).await,
            None,
            "{}",
            limit.limit().name()
        );
        let wait = wait_of(&store, &layers).await;
        assert!(
            wait.is_some_and(|w| w <= Duration::from_secs(120)),
            "{}: {wait:?}",
            limit.limit().name()
        );
    }
}

/// A token bucket's debt past a full bucket (and the longest hold) is taken as a full
/// bucket's: the wait is at most what refilling the whole bucket takes (review: about an
/// hour, with `w=20` in the policy).
#[tokio::test]
async fn a_bucket_written_ahead_of_a_clock_that_stepped_back_waits_at_most_a_full_refill() {
    let server = RedisServer::start();
    let store = server.store().await;
    let limit = remote(&bucket("tb", 10, Duration::from_secs(10), 20));
    let k = key("caller");
    let layers = [Layer::enforced(&limit, k)];
    assert_eq!(wait_of(&store, &layers).await, None);
    step_back(&server, &limit.key_name(k), HOUR_US).await;
    let wait = wait_of(&store, &layers).await;
    assert!(
        wait.is_some_and(|w| w <= Duration::from_secs(1)),
        "a full bucket's debt: the next token within a second: {wait:?}"
    );
}
