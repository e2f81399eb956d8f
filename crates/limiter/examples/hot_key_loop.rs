//! `n` hot-key decisions in a loop, by sluice or by governor, for profilers that count
//! instructions (the criterion bench's times move with code layout; instruction counts do not):
//!
//! ```text
//! cargo build --profile bench -p sluice-limiter --example hot_key_loop
//! valgrind --tool=callgrind --toggle-collect='hot_key_loop::run_*' \
//!     target/release/examples/hot_key_loop sluice 200000
//! ```
//!
//! and divide the instructions collected by `n + 1` (one warm-up decision). Same work per
//! decision as the bench's `hot_single_key` group, built as the bench is (one codegen unit, fat
//! LTO: with the release profile's split, what gets inlined into governor's side moves with
//! unrelated edits).
//!
//! `prehashed` makes sluice's decisions with the key hashed once, before the loop: timed
//! against `sluice` (`time hot_key_loop prehashed 100000000`), it shows what the hash adds to a
//! decision's critical path. `floor` does only what any decision must: read the clock and
//! compare-and-swap one word with a value computed from it.

use governor::{Quota, RateLimiter};
use sluice_limiter::{Algorithm, Clock, KeyHasher, Limit, LimitId, Limiter, SystemClock};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

type Governor = governor::DefaultKeyedRateLimiter<u64>;

#[inline(never)]
fn run_sluice(n: u64, limiter: &Limiter, id: LimitId, hasher: &KeyHasher, clock: &SystemClock) {
    for _ in 0..n {
        let layers = [(id, hasher.key(&[&black_box(42u64).to_le_bytes()]))];
        black_box(limiter.decide_with(&layers, 1, clock.now(), |d| d.is_admitted()));
    }
}

#[inline(never)]
fn run_prehashed(n: u64, limiter: &Limiter, id: LimitId, hasher: &KeyHasher, clock: &SystemClock) {
    let key = hasher.key(&[&42u64.to_le_bytes()]);
    for _ in 0..n {
        let layers = [(id, black_box(key))];
        black_box(limiter.decide_with(&layers, 1, clock.now(), |d| d.is_admitted()));
    }
}

#[inline(never)]
fn run_floor(n: u64, clock: &SystemClock) {
    let word = std::sync::atomic::AtomicU64::new(0);
    for _ in 0..n {
        let now = clock.now().0;
        let seen = word.load(std::sync::atomic::Ordering::Acquire);
        let next = seen.max(now) + 1;
        let swapped = word.compare_exchange_weak(
            seen,
            black_box(next),
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
        );
        black_box(swapped.is_ok());
    }
}

#[inline(never)]
fn run_governor(n: u64, governor: &Governor) {
    for _ in 0..n {
        black_box(governor.check_key(&black_box(42)).is_ok());
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (side, n) = match (args.next(), args.next().map(|n| n.parse::<u64>())) {
        (Some(side), Some(Ok(n)))
            if ["sluice", "prehashed", "governor", "floor"].contains(&side.as_str()) =>
        {
            (side, n)
        }
        _ => {
            eprintln!("usage: hot_key_loop sluice|prehashed|governor|floor DECISIONS");
            std::process::exit(2);
        }
    };
    let rate = NonZeroU32::new(1_000_000_000).expect("nonzero");
    if side == "floor" {
        run_floor(n, &SystemClock::new());
    } else if side != "governor" {
        let algorithm = Algorithm::TokenBucket { burst: rate };
        let limit = Limit::new("l", algorithm, rate, Duration::from_secs(1)).expect("limit");
        let limiter = Limiter::new([limit]).expect("limiter");
        let id = limiter.id("l").expect("limit l");
        let (hasher, clock) = (KeyHasher::new_random(), SystemClock::new());
        run_sluice(1, &limiter, id, &hasher, &clock);
        if side == "prehashed" {
            run_prehashed(n, &limiter, id, &hasher, &clock);
        } else {
            run_sluice(n, &limiter, id, &hasher, &clock);
        }
    } else {
        let governor: Governor = RateLimiter::dashmap(Quota::per_second(rate));
        run_governor(1, &governor);
        run_governor(n, &governor);
    }
}
