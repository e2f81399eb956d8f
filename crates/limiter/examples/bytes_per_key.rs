//! Bytes per key at 1,000,000 keys, for each algorithm, counted by a global allocator wrapper
//! (the `cap` crate: no unsafe code here). For comparison: a `DashMap` holding the same 32-byte
//! entries, and governor's keyed limiter.
//!
//! Run: `cargo run --release -p sluice-limiter --example bytes_per_key`

use cap::Cap;
use dashmap::DashMap;
use portable_atomic::AtomicU128;
use sluice_limiter::{Algorithm, KeyHasher, Limit, Limiter, Nanos};
use std::alloc::System;
use std::num::NonZeroU32;
use std::time::Duration;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

const KEYS: u64 = 1_000_000;

/// Bytes allocated by `fill` and still held by what it returns, per key.
fn per_key<T>(fill: impl FnOnce() -> T) -> (f64, T) {
    let before = ALLOCATOR.allocated();
    let held = fill();
    let bytes = ALLOCATOR.allocated() - before;
    (bytes as f64 / KEYS as f64, held)
}

fn main() {
    let hasher = KeyHasher::new_random();
    let quota = NonZeroU32::new(100).unwrap();
    let algorithms = [
        ("token_bucket", Algorithm::TokenBucket { burst: quota }),
        ("fixed_window", Algorithm::FixedWindow),
        ("sliding_window", Algorithm::SlidingWindow),
        ("concurrency", Algorithm::Concurrency),
    ];
    println!("{:<34} {:>14}", "table at 1,000,000 keys", "bytes per key");
    for (name, algorithm) in algorithms {
        let limit = Limit::new(name, algorithm, quota, Duration::from_secs(60)).unwrap();
        let (bytes, limiter) = per_key(|| {
            let limiter = Limiter::new([limit]).unwrap();
            let id = limiter.id(name).unwrap();
            for i in 0..KEYS {
                let key = hasher.key(&[&i.to_le_bytes()]);
                let d = limiter.decide(&[(id, key)], 1, Nanos(1_700_000_000_000_000_000));
                assert!(d.is_admitted());
            }
            limiter
        });
        // Each of the 64 shards holds at most max_keys / 64, so a few keys were already evicted
        // from the fullest shards: divide by the keys actually held.
        let held = limiter.stats(limiter.id(name).unwrap()).keys;
        let per_held = bytes * KEYS as f64 / held as f64;
        println!("sluice {name:<27} {per_held:>14.1}   ({held} keys held)");
    }
    // A table whose cap is far off: what it holds at any count, not only when full. It grows
    // by a quarter at a time, so the worst count is just after a growth; counts from 100,000 to
    // 1,000,000 in steps of 1,000 (each measured on a table filled once, in order) find it.
    println!();
    println!(
        "{:<34} {:>14} {:>14}",
        "max_keys 10,000,000, 100k-1M keys", "worst", "at 1,000,000"
    );
    for (name, algorithm) in algorithms {
        let limit = Limit::new(name, algorithm, quota, Duration::from_secs(60))
            .and_then(|l| l.with_max_keys(10_000_000))
            .unwrap();
        let before = ALLOCATOR.allocated();
        let limiter = Limiter::new([limit]).unwrap();
        let id = limiter.id(name).unwrap();
        let mut worst = 0f64;
        for i in 0..KEYS {
            let key = hasher.key(&[&i.to_le_bytes()]);
            let d = limiter.decide(&[(id, key)], 1, Nanos(1_700_000_000_000_000_000));
            assert!(d.is_admitted());
            let n = i + 1;
            if n >= 100_000 && n % 1_000 == 0 {
                let per = (ALLOCATOR.allocated() - before) as f64 / n as f64;
                worst = worst.max(per);
            }
        }
        let at_end = (ALLOCATOR.allocated() - before) as f64 / KEYS as f64;
        assert_eq!(limiter.stats(id).keys as u64, KEYS);
        println!("sluice {name:<27} {worst:>14.1} {at_end:>14.1}");
    }
    println!();
    let (bytes, _map) = per_key(|| {
        let map: DashMap<[u64; 2], AtomicU128> = DashMap::new();
        for i in 0..KEYS {
            let k = hasher.key(&[&i.to_le_bytes()]).to_bytes();
            let words = [
                u64::from_le_bytes(k[..8].try_into().unwrap()),
                u64::from_le_bytes(k[8..].try_into().unwrap()),
            ];
            map.insert(words, AtomicU128::new(0));
        }
        map
    });
    println!("{:<34} {bytes:>14.1}", "dashmap<[u64; 2], AtomicU128>");
    let (bytes, _gov) = per_key(|| {
        let gov: governor::DefaultKeyedRateLimiter<u64> =
            governor::RateLimiter::dashmap(governor::Quota::per_second(quota));
        for i in 0..KEYS {
            let _ = gov.check_key(&i);
        }
        gov
    });
    println!("{:<34} {bytes:>14.1}", "governor keyed (u64 key)");
}
