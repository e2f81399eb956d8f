//! sluice's limiter against governor's keyed (DashMap) limiter, in the same groups and run.
//!
//! Both sides take the caller's raw identity (a u64) per request: governor hashes it into its
//! DashMap, sluice into a 128-bit [`Key`]; both read their own real clock. Quotas are large so
//! that every request takes the admit path. After the groups, the ratio sluice/governor of
//! the mean times is printed for each group (read from criterion's estimates).
//!
//! Each side's whole decision is one `#[inline(never)]` function (`sluice_decide`,
//! `governor_check`), so both are called the same way from the same loops. That does not make
//! the times independent of code layout: governor's identical code has measured 32 ns in one
//! build of this file and 43-44 ns in another, each steady across runs. Compare instruction
//! counts (`examples/hot_key_loop.rs` under callgrind) when a ratio moves for no reason.

use criterion::{black_box, criterion_group, Criterion};
use governor::{Quota, RateLimiter};
use sluice_limiter::{Algorithm, Clock, Key, KeyHasher, Limit, LimitId, Limiter, SystemClock};
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::time::Duration;

const RATE: u32 = 1_000_000_000;
const KEYS: u64 = 1_000_000;
const GROUPS: [&str; 4] = [
    "hot_single_key",
    "random_keys_1m",
    "three_layers",
    "two_threads_one_key",
];

fn sluice(layers: usize) -> (Limiter, Vec<LimitId>) {
    let nz = NonZeroU32::new(RATE).unwrap();
    let limits = (0..layers).map(|i| {
        let algorithm = Algorithm::TokenBucket { burst: nz };
        Limit::new(format!("l{i}"), algorithm, nz, Duration::from_secs(1)).unwrap()
    });
    let limiter = Limiter::new(limits).unwrap();
    let ids = (0..layers)
        .map(|i| limiter.id(&format!("l{i}")).unwrap())
        .collect();
    (limiter, ids)
}

type Governor = governor::DefaultKeyedRateLimiter<u64>;

fn governor() -> Governor {
    RateLimiter::dashmap(Quota::per_second(NonZeroU32::new(RATE).unwrap()))
}

// Inlined: out of line, the key came back through the stack as two 8-byte stores that the
// decision's 16-byte read of it waited on (perf: about a tenth of a hot-key decision).
#[inline(always)]
fn key(hasher: &KeyHasher, id: u64) -> Key {
    hasher.key(&[&id.to_le_bytes()])
}

/// One sluice decision for caller `id` against limits `ids` (one key each), at the clock's now.
#[inline(never)]
fn sluice_decide<const N: usize>(
    limiter: &Limiter,
    ids: &[LimitId],
    hasher: &KeyHasher,
    clock: &SystemClock,
    callers: [u64; N],
) -> bool {
    // Hashed first, then paired: hashing inside `from_fn`'s closure made LLVM copy each key
    // through a misaligned 16-byte load that no store could forward (perf annotate: a stall of
    // about 8 ns per decision, the harness's cost, not the limiter's).
    let keys = callers.map(|caller| key(hasher, caller));
    let layers: [(LimitId, Key); N] = std::array::from_fn(|i| (ids[i], keys[i]));
    limiter.decide_with(&layers, 1, clock.now(), |d| d.is_admitted())
}

/// One governor check per limiter, in turn, for `callers`.
#[inline(never)]
fn governor_check<const N: usize>(govs: &[Governor; N], callers: [u64; N]) -> bool {
    govs.iter()
        .zip(callers)
        .all(|(gov, caller)| gov.check_key(&caller).is_ok())
}

/// A cheap pseudo-random walk over `0..KEYS`.
fn next_key(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state % KEYS
}

fn hot_single_key(c: &mut Criterion) {
    let mut g = c.benchmark_group(GROUPS[0]);
    let (limiter, ids) = sluice(1);
    let (hasher, clock) = (KeyHasher::new_random(), SystemClock::new());
    g.bench_function("sluice", |b| {
        b.iter(|| sluice_decide(&limiter, &ids, &hasher, &clock, [black_box(42)]))
    });
    let gov = [governor()];
    g.bench_function("governor", |b| {
        b.iter(|| governor_check(&gov, [black_box(42)]))
    });
    g.finish();
}

fn random_keys(c: &mut Criterion) {
    let mut g = c.benchmark_group(GROUPS[1]);
    let (limiter, ids) = sluice(1);
    let (hasher, clock) = (KeyHasher::new_random(), SystemClock::new());
    let gov = [governor()];
    for k in 0..KEYS {
        sluice_decide(&limiter, &ids, &hasher, &clock, [k]);
        governor_check(&gov, [k]);
    }
    let mut state = 0x9e37_79b9_7f4a_7c15;
    g.bench_function("sluice", |b| {
        b.iter(|| sluice_decide(&limiter, &ids, &hasher, &clock, [next_key(&mut state)]))
    });
    g.bench_function("governor", |b| {
        b.iter(|| governor_check(&gov, [next_key(&mut state)]))
    });
    g.finish();
}

fn three_layers(c: &mut Criterion) {
    let mut g = c.benchmark_group(GROUPS[2]);
    let (limiter, ids) = sluice(3);
    let (hasher, clock) = (KeyHasher::new_random(), SystemClock::new());
    let callers = || black_box([1, 2, 3]);
    g.bench_function("sluice", |b| {
        b.iter(|| sluice_decide(&limiter, &ids, &hasher, &clock, callers()))
    });
    // governor has no layered decision: three limiters checked in turn (and no rollback).
    let govs = [governor(), governor(), governor()];
    g.bench_function("governor", |b| b.iter(|| governor_check(&govs, callers())));
    g.finish();
}

/// Two threads each make `iters` decisions on one key; the time per decision per thread.
fn two_threads(iters: u64, decide: &(dyn Fn() -> bool + Sync)) -> Duration {
    let start = Barrier::new(2);
    let times: Vec<Duration> = std::thread::scope(|s| {
        let run = || {
            start.wait();
            let t = quanta::Instant::now();
            for _ in 0..iters {
                black_box(decide());
            }
            quanta::Instant::now() - t
        };
        let other = s.spawn(run);
        let mine = run();
        vec![mine, other.join().unwrap()]
    });
    times.into_iter().max().unwrap()
}

fn two_threads_one_key(c: &mut Criterion) {
    let mut g = c.benchmark_group(GROUPS[3]);
    let (limiter, ids) = sluice(1);
    let (hasher, clock) = (KeyHasher::new_random(), SystemClock::new());
    let sluice = || sluice_decide(&limiter, &ids, &hasher, &clock, [black_box(7)]);
    g.bench_function("sluice", |b| b.iter_custom(|n| two_threads(n, &sluice)));
    let gov = [governor()];
    let gov_decide = || governor_check(&gov, [black_box(7)]);
    g.bench_function("governor", |b| {
        b.iter_custom(|n| two_threads(n, &gov_decide))
    });
    g.finish();
}

/// The mean of one benchmark, in ns, from criterion's saved estimates.
fn mean_ns(group: &str, side: &str) -> Option<f64> {
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "../../target".into());
    let path = format!("{target}/criterion/{group}/{side}/new/estimates.json");
    let json = std::fs::read_to_string(path).ok()?;
    let mean = &json[json.find("\"mean\"")?..];
    let value = &mean[mean.find("\"point_estimate\":")? + 17..];
    value[..value.find([',', '}'])?].trim().parse().ok()
}

fn print_ratios() {
    println!(
        "\n{:<22} {:>12} {:>12} {:>16}",
        "group", "sluice ns", "governor ns", "sluice/governor"
    );
    for group in GROUPS {
        match (mean_ns(group, "sluice"), mean_ns(group, "governor")) {
            (Some(s), Some(g)) => println!("{group:<22} {s:>12.1} {g:>12.1} {:>16.2}", s / g),
            _ => println!("{group:<22} (no estimates found: set CARGO_TARGET_DIR)"),
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    targets = hot_single_key, random_keys, three_layers, two_threads_one_key
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    print_ratios();
}
