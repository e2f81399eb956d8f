//! Exactness under concurrency: threads hammer one key on a frozen clock.
//!
//! As the issue asks: 1000 runs of the scenario, cycling through 2 to 64 threads (about 6 s
//! per test in a debug build on 2 cores), for one layer and for three.

mod common;

use common::*;
use sluice_limiter::{Decision, Key, LimitId, Limiter, Nanos};
use std::sync::Barrier;
use std::time::Duration;

const RUNS: usize = 1000;
const MAX_THREADS: usize = 64;

/// Threads for run `i`: every count from 2 to `MAX_THREADS`, in turn.
fn threads_for(run: usize) -> usize {
    2 + run % (MAX_THREADS - 1)
}

/// Each thread decides until refused; returns the admissions (kept alive: they hold slots).
fn hammer(limiter: &Limiter, layers: &[(LimitId, Key)], threads: usize) -> Vec<Decision> {
    let start = Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let mut mine = Vec::new();
                    loop {
                        let d = limiter.decide(layers, 1, T0);
                        if !d.is_admitted() {
                            return mine;
                        }
                        mine.push(d);
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

#[test]
fn threads_on_one_key_admit_exactly_the_quota() {
    let window = Duration::from_secs(60);
    for run in 0..RUNS {
        let limit = match run % 4 {
            0 => bucket("one", 1000, window, 1000),
            1 => fixed("one", 1000, window),
            2 => sliding("one", 1000, window),
            _ => concurrency("one", 1000),
        };
        let limiter = Limiter::new([limit]).unwrap();
        let layers = all_layers(&limiter, &["one"]);
        let admitted = hammer(&limiter, &layers, threads_for(run));
        assert_eq!(
            admitted.len(),
            1000,
            "run {run}, {} threads",
            threads_for(run)
        );
    }
}

#[test]
fn three_layers_under_threads_neither_over_admit_nor_charge_refusals() {
    // The tightest layer sits in the middle, so refusals there roll back the first layer.
    for run in 0..RUNS {
        let window = Duration::from_secs(60);
        let limiter = Limiter::new([
            fixed("outer", 3000, window),
            match run % 3 {
                0 => bucket("tight", 1000, window, 1000),
                1 => sliding("tight", 1000, window),
                _ => concurrency("tight", 1000),
            },
            bucket("inner", 2000, window, 2000),
        ])
        .unwrap();
        let layers = all_layers(&limiter, &["outer", "tight", "inner"]);
        let admitted = hammer(&limiter, &layers, threads_for(run));
        assert_eq!(admitted.len(), 1000, "run {run}");
        let left: Vec<u32> = observe(&limiter, &layers, T0)
            .iter()
            .map(|r| r.remaining)
            .collect();
        assert_eq!(
            left,
            [2000, 0, 1000],
            "run {run}: every layer charged exactly 1000"
        );
    }
}

/// A little xorshift generator, seeded per thread.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// One run of [`held_window_charges_taken_back_by_threads_never_over_admit`]: `threads`
/// threads decide requests of cost 1 or 2 against a held fixed window (and, with
/// `two_layers`, a token bucket that refuses some: taken back at once), and take back a random
/// one of their admissions half the time, by refund or withdrawal. What stays admitted may
/// not exceed the quota in any window.
fn restore_run(seed: u64, threads: usize, two_layers: bool, advancing: bool) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;
    const QUOTA: u32 = 4;
    let window = 10 * SEC;
    let mut limits = vec![fixed("f", QUOTA, Duration::from_secs(10))
        .with_max_delay(Duration::from_secs(35))
        .unwrap()];
    if two_layers {
        limits.push(bucket("b", 50, Duration::from_secs(10), 3));
    }
    let limiter = Limiter::new(limits).unwrap();
    let names: &[&str] = if two_layers { &["f", "b"] } else { &["f"] };
    let layers = all_layers(&limiter, names);
    let clock = AtomicU64::new(T0.0 + 5 * SEC);
    let kept: Mutex<Vec<(u64, u32)>> = Mutex::new(Vec::new());
    let start = Barrier::new(threads);
    std::thread::scope(|s| {
        for t in 0..threads as u64 {
            let (limiter, layers, clock, kept, start) = (&limiter, &layers, &clock, &kept, &start);
            s.spawn(move || {
                let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9) ^ ((t + 1) * 0x1234_5677));
                let mut mine = Vec::new();
                start.wait();
                for _ in 0..400 {
                    let now = match advancing {
                        true => clock.fetch_add(rng.below(3) * 1_000_000, Ordering::Relaxed),
                        false => clock.load(Ordering::Relaxed),
                    };
                    let cost = 1 + rng.below(2) as u32;
                    if let Decision::Admitted(a) = limiter.decide(layers, cost, Nanos(now)) {
                        let passes_in = (now + a.wait().as_nanos() as u64) / window;
                        mine.push((a, passes_in, cost));
                    }
                    if !mine.is_empty() && rng.below(2) == 0 {
                        let i = rng.below(mine.len() as u64) as usize;
                        let (mut a, _, _) = mine.swap_remove(i);
                        let later = Nanos(clock.load(Ordering::Relaxed).max(now));
                        match rng.below(2) {
                            0 => limiter.refund(&mut a, later),
                            _ => limiter.withdraw(&mut a, later),
                        }
                    }
                }
                let passing = mine.into_iter().map(|(_, w, cost)| (w, cost));
                kept.lock().unwrap().extend(passing);
            });
        }
    });
    let mut per_window = std::collections::BTreeMap::<u64, u32>::new();
    for (w, cost) in kept.into_inner().unwrap() {
        *per_window.entry(w).or_default() += cost;
    }
    for (w, total) in &per_window {
        assert!(
            *total <= QUOTA,
            "seed {seed}, {threads} threads: window {w} holds {total}: {per_window:?}"
        );
    }
}

/// A window charged ahead for a held request gets its earlier state back when the charge is
/// taken back, by compare-and-swap, only if the state is still the one the charge left: under
/// threads taking back at random, no window ever passes more than its quota (by a reviewer;
/// the same test fails at once if the state is put back without that check).
#[test]
fn held_window_charges_taken_back_by_threads_never_over_admit() {
    for seed in 0..300 {
        restore_run(seed, 2 + (seed as usize % 7), seed % 2 == 0, seed % 3 == 0);
    }
}

/// Concurrency slots taken and given back by threads on one key while another thread floods
/// the limit's table with other callers (evicting those whose slots are back, as fresh) and
/// sweeps it (rebuilding it): the key never has more than its quota in flight, and every slot
/// comes back. A slot taken or given back on an array being rebuilt is redone on the new one.
#[test]
fn slots_racing_rebuilds_and_evictions_stay_within_the_quota() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    const QUOTA: usize = 4;
    const THREADS: usize = 4;
    let limit = concurrency("c", QUOTA as u32).with_max_keys(4_096).unwrap();
    let limiter = Limiter::new([limit]).unwrap();
    let id = limiter.id("c").unwrap();
    let hot = [(id, key("hot"))];
    let in_flight = AtomicUsize::new(0);
    let take_and_give_back = || {
        let d = limiter.decide(&hot, 1, T0);
        if !d.is_admitted() {
            return 0;
        }
        // Counted after the slot is taken and before it is given back (by `d`'s drop): never
        // more than the slots held.
        let now = in_flight.fetch_add(1, SeqCst) + 1;
        assert!(now <= QUOTA, "{now} in flight");
        in_flight.fetch_sub(1, SeqCst);
        1
    };
    let admitted = while_threads_run(THREADS, take_and_give_back, || {
        for round in 1..=6u64 {
            for i in 0..6_000 {
                let caller = [(id, key(&format!("flood {round} {i}")))];
                assert!(limiter.decide(&caller, 1, T0).is_admitted());
            }
            // A sweep walks at most once per window (a second for a concurrency limit).
            assert_eq!(limiter.sweep(at(round * SEC)), 1);
        }
    });
    assert!(admitted > 0);
    let stats = limiter.stats(id);
    assert!(stats.swept > 0, "{stats:?}");
    // Every slot came back: the quota is whole again, and no more.
    let held: Vec<Decision> = (0..QUOTA).map(|_| limiter.decide(&hot, 1, T0)).collect();
    assert!(held.iter().all(Decision::is_admitted));
    assert!(!limiter.decide(&hot, 1, T0).is_admitted());
}

/// Threads spend one key's token bucket (alone, so on its own lock-free path) while another
/// thread floods the table with other callers: the table grows through rebuilds that freeze
/// the key's entry under the threads, and with a small `max_keys` it also evicts (other keys:
/// the hot one, spent furthest ahead, costs most to forget) and rebuilds to clear out the
/// dead. On a frozen clock, what the threads were admitted and what is left add up to the
/// quota, none lost and none twice.
#[test]
fn a_bucket_spent_across_rebuilds_loses_and_repeats_no_charge() {
    let grown = spend_one_key_while_flooding(100_000);
    assert_eq!(grown.evictions, 0, "{grown:?}");
    let evicting = spend_one_key_while_flooding(4_096);
    assert!(evicting.evictions > 20_000, "{evicting:?}");
}

/// The race above on a table of `max_keys`; its counters after.
fn spend_one_key_while_flooding(max_keys: usize) -> sluice_limiter::TableStats {
    use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    // More than the threads can spend while the flood lasts (checked below).
    const QUOTA: u32 = 50_000_000;
    const THREADS: usize = 4;
    const FLOOD: usize = 30_000;
    const BATCH: usize = 500;
    let limit = bucket("b", QUOTA, Duration::from_secs(100), QUOTA)
        .with_max_keys(max_keys)
        .unwrap();
    let limiter = Limiter::new([limit]).unwrap();
    let id = limiter.id("b").unwrap();
    let hot = [(id, key("hot"))];
    assert!(limiter.decide(&hot, 1, T0).is_admitted());
    let bytes_before = limiter.stats(id).bytes;
    let decided = AtomicU64::new(0);
    let spend = || {
        let admitted = u32::from(limiter.decide(&hot, 1, T0).is_admitted());
        decided.fetch_add(1, SeqCst);
        admitted
    };
    let admitted = while_threads_run(THREADS, spend, || {
        for batch in 0..FLOOD / BATCH {
            let before = decided.load(SeqCst);
            for i in batch * BATCH..(batch + 1) * BATCH {
                let caller = [(id, key(&format!("flood {i}")))];
                assert!(limiter.decide(&caller, 1, T0).is_admitted());
            }
            // The threads decide between every two batches: they race the whole flood.
            let mut yields = 0u32;
            while decided.load(SeqCst) == before {
                yields += 1;
                assert!(yields < 10_000_000, "the threads made no progress");
                std::thread::yield_now();
            }
        }
    });
    let stats = limiter.stats(id);
    assert!(stats.bytes > bytes_before, "the table grew: {stats:?}");
    let left = limiter.figures(&hot, T0).next().unwrap().remaining;
    assert!(left > 0, "the quota outlasted the flood");
    assert_eq!(
        1 + admitted + left,
        QUOTA,
        "{admitted} admitted, {left} left"
    );
    stats
}

/// Runs `work` over and over on `threads` threads while `main` runs on this one (all start
/// together), until `main` returns: the sum of what `work` returned.
fn while_threads_run<T: std::iter::Sum<T> + std::ops::AddAssign + Default + Send>(
    threads: usize,
    work: impl Fn() -> T + Sync,
    main: impl FnOnce(),
) -> T {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let stop = AtomicBool::new(false);
    let started = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    started.wait();
                    let mut total = T::default();
                    while !stop.load(SeqCst) {
                        total += work();
                    }
                    total
                })
            })
            .collect();
        started.wait();
        main();
        stop.store(true, SeqCst);
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    })
}
