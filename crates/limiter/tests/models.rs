//! Property tests: each algorithm admits exactly what an obvious reference model admits, and a
//! refusal's wait is exact (the request passes at `now + wait`, not one nanosecond earlier).

mod common;

use common::*;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use sluice_limiter::{Decision, Limit, Limiter, Nanos, Report};
use std::collections::HashMap;
use std::time::Duration;

/// A model decides an arrival of `cost` at `t` (non-decreasing) and remembers it if admitted.
trait Model: Clone {
    fn offer(&mut self, t: u64, cost: u32) -> bool;
}

/// Token bucket in exact rational arithmetic: tokens are counted in units of `1 / window`.
#[derive(Clone)]
struct RationalBucket {
    quota: u128,
    window: u128,
    burst: u128,
    tokens: u128,
    last: Option<u64>,
}

impl Model for RationalBucket {
    fn offer(&mut self, t: u64, cost: u32) -> bool {
        let full = self.burst * self.window;
        let tokens = match self.last {
            None => full,
            Some(last) => full.min(self.tokens + u128::from(t - last) * self.quota),
        };
        self.last = Some(t);
        let need = u128::from(cost) * self.window;
        let admit = tokens >= need;
        self.tokens = if admit { tokens - need } else { tokens };
        admit
    }
}

/// Every window's count, kept forever.
#[derive(Clone)]
struct Windows {
    quota: u128,
    window: u64,
    sliding: bool,
    counts: HashMap<u64, u128>,
}

impl Model for Windows {
    fn offer(&mut self, t: u64, cost: u32) -> bool {
        let (i, w) = (t / self.window, u128::from(self.window));
        let current = self.counts.get(&i).copied().unwrap_or(0);
        let admit = if self.sliding {
            let previous = self.counts.get(&i.wrapping_sub(1)).copied().unwrap_or(0);
            let elapsed = u128::from(t % self.window);
            // previous * (1 - elapsed / w) + current + cost <= quota, times w.
            previous * (w - elapsed) + (current + u128::from(cost)) * w <= self.quota * w
        } else {
            current + u128::from(cost) <= self.quota
        };
        if admit {
            *self.counts.entry(i).or_default() += u128::from(cost);
        }
        admit
    }
}

fn config() -> ProptestConfig {
    ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/models.txt",
        ))),
        ..ProptestConfig::default()
    }
}

/// Replays `arrivals` (gap, cost) against the limiter and the model; on each refusal, checks
/// that the wait is exact on a copy of the model.
fn agree<M: Model>(limit: Limit, mut model: M, start: u64, arrivals: &[(u64, u32)]) {
    let capacity = limit.capacity().unwrap();
    let name = limit.name().to_owned();
    let limiter = Limiter::new([limit]).unwrap();
    let layers = all_layers(&limiter, &[&name]);
    let mut t = start;
    for (step, &(gap, cost)) in arrivals.iter().enumerate() {
        t += gap;
        match limiter.decide(&layers, cost, Nanos(t)) {
            Decision::CostTooLarge(_) => assert!(cost > capacity),
            Decision::Admitted(_) => assert!(model.offer(t, cost), "step {step}: admitted"),
            Decision::Refused(r) => {
                assert!(!model.clone().offer(t, cost), "step {step}: refused");
                let wait = r.wait().unwrap().as_nanos() as u64;
                assert!(wait > 0);
                assert!(
                    model.clone().offer(t + wait, cost),
                    "step {step}: passes after {wait}"
                );
                assert!(
                    !model.clone().offer(t + wait - 1, cost),
                    "step {step}: 1 ns early"
                );
            }
        }
    }
}

fn arrivals(max_gap: u64, max_cost: u32) -> impl Strategy<Value = Vec<(u64, u32)>> {
    prop::collection::vec((0..=max_gap, 0..=max_cost), 1..150)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn gcra_admits_what_a_rational_token_bucket_admits(
        (quota, window, burst) in (1u32..40, 1_000u64..3_000_000, 1u32..20),
        start in 0u64..u64::MAX / 4,
        arrivals in arrivals(400_000, 22),
    ) {
        let limit = bucket("b", quota, Duration::from_nanos(window), burst);
        let model = RationalBucket {
            quota: u128::from(quota), window: u128::from(window), burst: u128::from(burst),
            tokens: 0, last: None,
        };
        agree(limit, model, start, &arrivals);
    }

    /// A quota that divides the window keeps the state in a 64-bit word (nanosecond units).
    #[test]
    fn gcra_in_whole_nanoseconds_admits_what_a_rational_token_bucket_admits(
        (quota, per_token, burst) in (1u32..40, 25u64..75_000, 1u32..20),
        start in 0u64..u64::MAX / 2,
        arrivals in arrivals(400_000, 22),
    ) {
        let window = u64::from(quota) * per_token;
        let limit = bucket("b", quota, Duration::from_nanos(window), burst);
        let model = RationalBucket {
            quota: u128::from(quota), window: u128::from(window), burst: u128::from(burst),
            tokens: 0, last: None,
        };
        agree(limit, model, start, &arrivals);
    }

    #[test]
    fn fixed_window_admits_what_per_window_counts_admit(
        (quota, window) in (1u32..40, 1_000u64..3_000_000),
        start in 0u64..u64::MAX / 4,
        arrivals in arrivals(400_000, 42),
    ) {
        let model = Windows {
            quota: u128::from(quota), window, sliding: false, counts: HashMap::new(),
        };
        agree(fixed("f", quota, Duration::from_nanos(window)), model, start, &arrivals);
    }

    #[test]
    fn sliding_window_admits_what_the_two_counter_estimate_admits(
        (quota, window) in (1u32..40, 1_000u64..3_000_000),
        start in 0u64..u64::MAX / 4,
        arrivals in arrivals(400_000, 42),
    ) {
        let model = Windows {
            quota: u128::from(quota), window, sliding: true, counts: HashMap::new(),
        };
        agree(sliding("s", quota, Duration::from_nanos(window)), model, start, &arrivals);
    }
}

/// What a decision tells its caller about its first limit: the outcome, the wait, and the
/// figures reported for that limit.
fn first_limit(limiter: &Limiter, d: &Decision) -> (&'static str, Option<Duration>, Report) {
    let (outcome, wait) = match d {
        Decision::Admitted(a) => ("admitted", Some(a.wait())),
        Decision::Refused(r) => ("refused", r.wait()),
        Decision::CostTooLarge(_) => ("too large", None),
    };
    (outcome, wait, d.reports(limiter).next().unwrap())
}

proptest! {
    #![proptest_config(config())]

    /// One token bucket decided alone takes a path of its own (`Limiter::decide_with`); beside
    /// a second limit that never refuses it goes through the general one. Both give the same
    /// outcomes, waits (of requests held, with a `max_delay`) and figures, and the same state
    /// after refunds and withdrawals.
    #[test]
    fn one_bucket_alone_decides_as_it_does_among_layers(
        (quota, per_token, burst) in (1u32..40, 25u64..75_000, 1u32..20),
        start in 0u64..u64::MAX / 2,
        // After each admission: keep it, refund it, or withdraw it.
        steps in prop::collection::vec((0..=400_000u64, 0..=22u32, 0..3u8), 1..150),
        max_delay in prop::option::of(1..1_000_000u64),
    ) {
        let window = Duration::from_nanos(u64::from(quota) * per_token);
        let b = || {
            let b = bucket("b", quota, window, burst);
            match max_delay {
                Some(d) => b.with_max_delay(Duration::from_nanos(d)).unwrap(),
                None => b,
            }
        };
        let alone = Limiter::new([b()]).unwrap();
        let wide = fixed("wide", u32::MAX, Duration::from_secs(1));
        let among = Limiter::new([b(), wide]).unwrap();
        let one = all_layers(&alone, &["b"]);
        let two = all_layers(&among, &["b", "wide"]);
        let mut t = start;
        for (step, &(gap, cost, after)) in steps.iter().enumerate() {
            t += gap;
            let mut d1 = alone.decide(&one, cost, Nanos(t));
            let mut d2 = among.decide(&two, cost, Nanos(t));
            prop_assert_eq!(first_limit(&alone, &d1), first_limit(&among, &d2), "step {}", step);
            if let (Decision::Admitted(a1), Decision::Admitted(a2)) = (&mut d1, &mut d2) {
                if after == 1 {
                    alone.refund(a1, Nanos(t));
                    among.refund(a2, Nanos(t));
                } else if after == 2 {
                    alone.withdraw(a1, Nanos(t));
                    among.withdraw(a2, Nanos(t));
                }
            }
            let figures = alone.figures(&one, Nanos(t)).next();
            prop_assert_eq!(figures, among.figures(&two[..1], Nanos(t)).next(), "step {}", step);
        }
    }
}
