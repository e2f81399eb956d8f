//! `block_for`: after a refusal, the key stays refused until the block ends.

mod common;

use common::*;
use sluice_limiter::{Decision, Limit, Limiter, Nanos, RefusalReason};
use std::time::Duration;

fn blocked_limiter(block_for: Duration) -> Limiter {
    let limit = fixed("login", 2, Duration::from_secs(1))
        .with_block_for(block_for)
        .unwrap();
    Limiter::new([limit]).unwrap()
}

/// For a window and for a token bucket (which, alone, takes a path of its own).
#[test]
fn refused_key_stays_refused_until_the_block_ends_whatever_the_counters_say() {
    let bucket = bucket("login", 2, Duration::from_secs(1), 2);
    for limit in [fixed("login", 2, Duration::from_secs(1)), bucket] {
        refused_key_stays_refused_until_the_block_ends(limit);
    }
}

fn refused_key_stays_refused_until_the_block_ends(limit: Limit) {
    let limit = limit.with_block_for(Duration::from_secs(10)).unwrap();
    let limiter = Limiter::new([limit]).unwrap();
    let layers = all_layers(&limiter, &["login"]);
    assert!(limiter.decide(&layers, 2, at(0)).is_admitted());
    let Decision::Refused(first) = limiter.decide(&layers, 1, at(0)) else {
        panic!()
    };
    assert_eq!(first.reason(), RefusalReason::Exhausted);
    assert_eq!(first.wait(), Some(Duration::from_secs(10)));

    // Two windows later the counter is fresh, but the block holds: wait = rest of the block.
    let Decision::Refused(later) = limiter.decide(&layers, 1, at(2 * SEC + 5)) else {
        panic!("blocked");
    };
    let until = Nanos(T0.0 + 10 * SEC);
    assert_eq!(later.reason(), RefusalReason::Blocked { until });
    assert_eq!(later.wait(), Some(Duration::from_nanos(8 * SEC - 5)));
    assert!(!limiter.decide(&layers, 1, at(10 * SEC - 1)).is_admitted());
    assert!(limiter.decide(&layers, 1, at(10 * SEC)).is_admitted());
}

#[test]
fn short_block_still_covers_the_counters_wait() {
    // A block shorter than the window would send the client back too early: it is stretched.
    let limiter = blocked_limiter(Duration::from_millis(100));
    let layers = all_layers(&limiter, &["login"]);
    assert!(limiter.decide(&layers, 2, at(SEC / 4)).is_admitted());
    let Decision::Refused(r) = limiter.decide(&layers, 1, at(SEC / 4)) else {
        panic!()
    };
    assert_eq!(r.wait(), Some(Duration::from_millis(750)));
    assert!(limiter.decide(&layers, 1, at(SEC)).is_admitted());
}

#[test]
fn block_on_one_layer_charges_no_other() {
    let blocked = fixed("login", 1, Duration::from_secs(1))
        .with_block_for(Duration::from_secs(60))
        .unwrap();
    let limiter = Limiter::new([fixed("ip", 100, Duration::from_secs(60)), blocked]).unwrap();
    let layers = all_layers(&limiter, &["ip", "login"]);
    assert!(limiter.decide(&layers, 1, at(0)).is_admitted());
    for s in 0..10 {
        assert!(!limiter.decide(&layers, 1, at(s * SEC)).is_admitted());
    }
    assert_eq!(observe(&limiter, &layers, at(10 * SEC))[0].remaining, 99);
}

#[test]
fn check_does_not_start_a_block() {
    let limiter = blocked_limiter(Duration::from_secs(10));
    let layers = all_layers(&limiter, &["login"]);
    assert!(limiter.decide(&layers, 2, at(0)).is_admitted());
    assert!(!limiter.check(&layers, 1, at(0)).is_admitted());
    assert!(
        limiter.decide(&layers, 1, at(SEC)).is_admitted(),
        "no block was started"
    );
}

/// A block as long as `with_block_for` allows ends past the end of time: it saturates there
/// and blocks, instead of overflowing (a panic on the request path with overflow checks, a
/// block ending in the past without).
#[test]
fn a_block_past_the_end_of_time_still_blocks() {
    let limiter = blocked_limiter(Duration::from_secs(580 * 365 * 24 * 3600));
    let layers = all_layers(&limiter, &["login"]);
    assert!(limiter.decide(&layers, 2, at(0)).is_admitted());
    let Decision::Refused(first) = limiter.decide(&layers, 1, at(0)) else {
        panic!()
    };
    assert!(first.wait().unwrap() > Duration::from_secs(500 * 365 * 24 * 3600));
    assert!(!limiter.decide(&layers, 1, at(2 * SEC)).is_admitted());
}

/// Blocks live in a table of their own, bounded by the same `max_keys`: when it is full, new
/// blocks evict old ones, and that shows in its own counters (review: the counters' table
/// of a short window is swept every window and never evicts, so its figures said nothing
/// while blocks of an hour were forgotten).
#[test]
fn blocks_forgotten_when_their_table_is_full_are_counted() {
    let limit = fixed("login", 1, Duration::from_secs(1))
        .with_block_for(Duration::from_secs(3_600))
        .unwrap()
        .with_max_keys(100)
        .unwrap();
    let limiter = Limiter::new([limit]).unwrap();
    let id = limiter.id("login").unwrap();
    let hasher = sluice_limiter::KeyHasher::new_random();
    for caller in 0u64..300 {
        // A caller every 10 ms: its counters are fresh by the next window, its block is not.
        let now = at(caller * SEC / 100);
        let layers = [(id, hasher.key(&[&caller.to_le_bytes()]))];
        assert!(limiter.decide(&layers, 1, now).is_admitted());
        assert!(!limiter.decide(&layers, 1, now).is_admitted());
        limiter.sweep(now);
    }
    let blocks = limiter.block_stats(id).expect("a limit with block_for");
    assert_eq!((blocks.keys, blocks.evictions), (100, 200));
    assert_eq!(limiter.stats(id).evictions, 0);
    let plain = Limiter::new([fixed("plain", 1, Duration::from_secs(1))]).unwrap();
    assert_eq!(plain.block_stats(plain.id("plain").unwrap()), None);
}
