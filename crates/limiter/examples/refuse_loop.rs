//! `n` refused decisions in a loop, each followed by the layers' figures (what a gateway's 429
//! reports), against the four limits of `bench/sluice.toml`'s `/refuse` route. For profilers
//! that count instructions, as `hot_key_loop`:
//!
//! ```text
//! cargo build --profile bench -p sluice-limiter --example refuse_loop
//! valgrind --tool=callgrind --toggle-collect='refuse_loop::run' \
//!     target/release/examples/refuse_loop 100000
//! ```
//!
//! and divide the instructions collected by `n + 1`.

use sluice_limiter::{Algorithm, Clock, KeyHasher, Limit, Limiter, SystemClock};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

/// Every decision after the first is refused by the last limit (one request a day).
#[inline(never)]
fn run(n: u64, limiter: &Limiter, hasher: &KeyHasher, clock: &SystemClock) {
    let ids: Vec<_> = limiter.ids().collect();
    for _ in 0..n {
        let layers = [
            (ids[0], hasher.key(&[b"127.0.0.1"])),
            (ids[1], hasher.key(&[b"key-1"])),
            (ids[2], hasher.key(&[b"refuse"])),
            (ids[3], hasher.key(&[b"key-1"])),
        ];
        black_box(limiter.decide_with(&layers, 1, clock.now(), |d| d.is_admitted()));
        black_box(limiter.figures(&layers, clock.now()).count());
    }
}

fn main() {
    let Some(Ok(n)) = std::env::args().nth(1).map(|n| n.parse::<u64>()) else {
        eprintln!("usage: refuse_loop DECISIONS");
        std::process::exit(2);
    };
    let big = NonZeroU32::new(1_000_000_000).unwrap();
    let one = NonZeroU32::new(1).unwrap();
    let limits = [
        ("per-ip", Algorithm::TokenBucket { burst: big }, big, 1),
        ("per-key", Algorithm::FixedWindow, big, 3600),
        ("per-route", Algorithm::TokenBucket { burst: big }, big, 1),
        ("refuse", Algorithm::TokenBucket { burst: one }, one, 86400),
    ]
    .map(|(name, algorithm, quota, secs)| {
        Limit::new(name, algorithm, quota, Duration::from_secs(secs)).unwrap()
    });
    let limiter = Limiter::new(limits).unwrap();
    let (hasher, clock) = (KeyHasher::new_random(), SystemClock::new());
    run(1, &limiter, &hasher, &clock);
    run(n, &limiter, &hasher, &clock);
}
