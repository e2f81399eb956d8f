//! The store decides as the in-memory limiter does: the same random sequences of requests
//! (pinned clock, so exact without sleeping) give the same admissions, refusals, refusing
//! limit, waits and header figures (the store's times are the in-memory ones rounded up to the
//! microsecond, Redis `TIME`'s unit).

mod common;

use std::time::Duration;

use common::*;
use sluice_limiter::{Decision, Key, Limit, LimitId, Limiter, Nanos, RefusalReason, Report};
use sluice_store_redis::{Layer, LayerReport, Mode, RemoteDecision};

fn same_reports(memory: impl Iterator<Item = Report>, store: &[LayerReport], ctx: &str) {
    let memory: Vec<Report> = memory.collect();
    assert_eq!(memory.len(), store.len(), "{ctx}");
    for (m, s) in memory.iter().zip(store) {
        assert_eq!(m.quota, s.quota, "{ctx}: q");
        assert_eq!(m.window, s.window, "{ctx}: w");
        assert_eq!(m.remaining, s.remaining, "{ctx}: r");
        assert_eq!(m.reset.map(ceil_us), s.reset, "{ctx}: t");
    }
}

fn ceil_at(n: Nanos) -> Nanos {
    Nanos(n.0.div_ceil(1_000) * 1_000)
}

/// Runs `steps` random requests (gaps up to `max_gap_us`, costs up to `max_cost`) against
/// both stores over all `limits` at once, comparing every outcome.
async fn same_sequence(
    limits: Vec<Limit>,
    seed: u64,
    steps: usize,
    max_gap_us: u64,
    max_cost: u32,
) {
    same_sequence_taking_back(limits, seed, steps, max_gap_us, max_cost, (0, false)).await;
}

/// [`same_sequence`], taking back admissions by a refund (a 503 on arrival) or a withdrawal
/// (a held client that left), alternately: at once, one in `take_back_one_in` (0: none) and
/// one held admission in two; or, with `late`, after each request, while a one in
/// `take_back_one_in` chance says so, any one of the last six admissions not yet taken back
/// (review: at once, the state was always still the one the charge left, so the branch for a
/// state charged since never ran).
async fn same_sequence_taking_back(
    limits: Vec<Limit>,
    seed: u64,
    steps: usize,
    max_gap_us: u64,
    max_cost: u32,
    (take_back_one_in, late): (u64, bool),
) {
    let server = RedisServer::start();
    let store = server.store().await;
    let limiter = Limiter::new(limits.clone()).unwrap();
    let remotes: Vec<_> = limits.iter().map(remote).collect();
    let k = key("caller");
    let memory_layers: Vec<(LimitId, Key)> = limits
        .iter()
        .map(|l| (limiter.id(l.name()).unwrap(), k))
        .collect();
    let layers: Vec<Layer> = remotes.iter().map(|r| Layer::enforced(r, k)).collect();
    let mut rng = Rng(seed);
    let mut t = 0;
    let (mut admitted, mut held, mut taken_back) = (0, 0, 0);
    let mut pending = Vec::new();
    for step in 0..steps {
        t += if rng.below(3) == 0 {
            0
        } else {
            rng.below(max_gap_us)
        };
        let cost = 1 + rng.below(u64::from(max_cost)) as u32;
        let now = at(t);
        let ctx = format!("seed {seed} step {step} at +{t}us cost {cost}");
        let memory = limiter.decide(&memory_layers, cost, now);
        let remote = store
            .decide_at(&layers, cost, Mode::Charge, now)
            .await
            .unwrap();
        match (&memory, &remote) {
            (Decision::Admitted(m), RemoteDecision::Admitted(s)) => {
                admitted += 1;
                held += usize::from(!s.hold.is_zero());
                assert_eq!(ceil_us(m.wait()), s.hold, "{ctx}: hold");
                same_reports(m.reports(&limiter), &s.reports, &ctx);
            }
            (Decision::Refused(m), RemoteDecision::Refused(s)) => {
                assert_eq!(m.limit().index(), s.layer, "{ctx}: refusing limit");
                assert_eq!(m.wait().map(ceil_us), s.wait, "{ctx}: wait");
                let reason = match m.reason() {
                    RefusalReason::Blocked { until } => RefusalReason::Blocked {
                        until: ceil_at(until),
                    },
                    r => r,
                };
                assert_eq!(reason, s.reason, "{ctx}: reason");
                same_reports(m.reports(&limiter), &s.reports, &ctx);
                let refusing: Vec<_> = m
                    .refusing(&limiter)
                    .map(|(id, w)| (id.index(), w.map(ceil_us)))
                    .collect();
                assert_eq!(
                    refusing,
                    s.refusing().collect::<Vec<_>>(),
                    "{ctx}: refusing"
                );
            }
            (Decision::CostTooLarge(m), RemoteDecision::CostTooLarge { layer }) => {
                assert_eq!(m.limit().index(), *layer, "{ctx}");
            }
            (m, s) => panic!("{ctx}: memory {m:?}, store {s:?}"),
        }
        if let (Decision::Admitted(m), RemoteDecision::Admitted(s)) = (memory, remote) {
            pending.push((m, s));
        }
        if take_back_one_in > 0 && !pending.is_empty() {
            // At once, held requests are taken back more often: half of them.
            let held_now = pending.last().is_some_and(|(m, _)| !m.wait().is_zero());
            let odds = if held_now && !late {
                2
            } else {
                take_back_one_in
            };
            while !pending.is_empty() && rng.below(odds) == 0 {
                let i = match late {
                    true => rng.below(pending.len() as u64) as usize,
                    false => pending.len() - 1,
                };
                let (mut m, s) = pending.swap_remove(i);
                taken_back += 1;
                if taken_back % 2 == 0 {
                    limiter.refund(&mut m, now);
                    store.refund_at(&layers, s, now).await.unwrap();
                } else {
                    limiter.withdraw(&mut m, now);
                    store.withdraw_at(&layers, s, now).await.unwrap();
                }
            }
        }
        // Only the last few admissions may be taken back later (the gateway's are, within
        // a hold at most).
        if !late {
            pending.clear();
        } else if pending.len() > 6 {
            pending.remove(0);
        }
    }
    if take_back_one_in > 0 {
        assert!(taken_back > 1, "the sequence took nothing back");
    }
    assert!(
        admitted > steps / 10,
        "the sequence admitted too little to test much"
    );
    assert!(admitted < steps, "the sequence never refused");
    if limits.iter().any(|l| l.max_delay().is_some()) {
        assert!(held > 0, "the sequence held no request");
    }
}

#[tokio::test]
async fn token_bucket_matches_memory_including_a_third_of_a_second_interval() {
    let third = bucket("third", 3, Duration::from_secs(1), 3);
    same_sequence(vec![third], 1, 200, 400_000, 3).await;
    let burst = bucket("burst", 10, Duration::from_secs(1), 5);
    same_sequence(vec![burst], 2, 200, 300_000, 4).await;
}

#[tokio::test]
async fn fixed_window_matches_memory_on_epoch_aligned_windows() {
    let limit = fixed("fixed", 5, Duration::from_secs(1));
    same_sequence(vec![limit], 3, 200, 300_000, 6).await;
}

#[tokio::test]
async fn sliding_window_matches_memory() {
    let limit = sliding("sliding", 10, Duration::from_secs(10));
    same_sequence(vec![limit], 4, 200, 2_000_000, 6).await;
    let odd = sliding("odd", 7, Duration::from_micros(1_234_567));
    same_sequence(vec![odd], 5, 200, 400_000, 3).await;
}

#[tokio::test]
async fn a_held_window_request_is_charged_in_the_window_it_passes_in_as_in_memory() {
    let second = Duration::from_secs(1);
    let fixed_held = fixed("fixed", 3, second)
        .with_max_delay(Duration::from_millis(1_500))
        .unwrap();
    same_sequence(vec![fixed_held], 50, 300, 150_000, 2).await;
    let sliding_held = sliding("sliding", 6, 2 * second)
        .with_max_delay(Duration::from_millis(1_200))
        .unwrap();
    same_sequence(vec![sliding_held], 51, 300, 200_000, 3).await;
    let odd = sliding("odd", 5, Duration::from_micros(1_234_567))
        .with_max_delay(Duration::from_millis(2_500))
        .unwrap();
    same_sequence(vec![odd], 52, 300, 150_000, 2).await;
    let layers = held_layers();
    same_sequence(layers, 53, 300, 120_000, 1).await;
}

/// Layered: a held window beside a held bucket and an enforced window.
fn held_layers() -> Vec<Limit> {
    let second = Duration::from_secs(1);
    vec![
        fixed("held-fixed", 4, second)
            .with_max_delay(Duration::from_millis(900))
            .unwrap(),
        bucket("held-bucket", 6, second, 2)
            .with_max_delay(Duration::from_millis(400))
            .unwrap(),
        sliding("cap", 12, 3 * second),
    ]
}

/// A request a window held into a later window, then taken back (a 503 on arrival, a client
/// that left), left the state in that later window with Redis, and the windows before it
/// spent; memory puts the state back as it was, and now Redis too. Found by this test: a token
/// bucket's refund gave back up to 1 us less than memory's (the charge's TAT is sent in whole
/// microseconds; its fraction is now read from the state while nobody charged since).
#[tokio::test]
async fn held_requests_taken_back_leave_the_same_state_as_in_memory() {
    let second = Duration::from_secs(1);
    let fixed_held = fixed("fixed", 3, second)
        .with_max_delay(Duration::from_millis(1_500))
        .unwrap();
    same_sequence_taking_back(vec![fixed_held], 60, 300, 700_000, 3, (3, false)).await;
    let sliding_held = sliding("sliding", 6, 2 * second)
        .with_max_delay(Duration::from_millis(1_200))
        .unwrap();
    same_sequence_taking_back(vec![sliding_held], 61, 300, 900_000, 4, (3, false)).await;
    let layers = held_layers();
    same_sequence_taking_back(layers, 62, 300, 120_000, 2, (4, false)).await;
}

/// As above, with admissions taken back later, after others were charged (by a reviewer).
#[tokio::test]
async fn held_requests_taken_back_later_leave_the_same_state_as_in_memory() {
    let second = Duration::from_secs(1);
    for seed in 0..6 {
        let fixed_held = fixed("fixed", 3, second)
            .with_max_delay(Duration::from_millis(2_500))
            .unwrap();
        same_sequence_taking_back(vec![fixed_held], 100 + seed, 300, 300_000, 3, (3, true)).await;
        let sliding_held = sliding("sliding", 6, 2 * second)
            .with_max_delay(Duration::from_millis(2_200))
            .unwrap();
        same_sequence_taking_back(vec![sliding_held], 200 + seed, 300, 400_000, 4, (3, true)).await;
        let layers = vec![
            fixed("held-fixed", 4, second)
                .with_max_delay(Duration::from_millis(1_900))
                .unwrap(),
            sliding("cap", 12, 3 * second),
        ];
        same_sequence_taking_back(layers, 300 + seed, 300, 120_000, 2, (4, true)).await;
    }
}

#[tokio::test]
async fn a_held_token_bucket_request_is_charged_ahead_and_held_as_in_memory() {
    let second = Duration::from_secs(1);
    let smooth = bucket("smooth", 10, second, 2)
        .with_max_delay(Duration::from_millis(450))
        .unwrap();
    same_sequence(vec![smooth], 40, 250, 150_000, 2).await;
    let third = bucket("third", 3, second, 1)
        .with_max_delay(Duration::from_millis(900))
        .unwrap();
    same_sequence(vec![third], 41, 250, 500_000, 1).await;
    // With an enforced layer that may refuse what the held one charged: taken back.
    let layers = vec![
        bucket("held", 5, second, 1)
            .with_max_delay(Duration::from_millis(600))
            .unwrap(),
        fixed("cap", 6, 2 * second),
    ];
    same_sequence(layers, 42, 250, 300_000, 1).await;
}

#[tokio::test]
async fn block_for_matches_memory() {
    let second = Duration::from_secs(1);
    let limits = vec![
        bucket("tb", 4, second, 4)
            .with_block_for(Duration::from_millis(500))
            .unwrap(),
        fixed("fw", 5, second).with_block_for(2 * second).unwrap(),
        sliding("sw", 8, 4 * second)
            .with_block_for(3 * second)
            .unwrap(),
    ];
    for (i, limit) in limits.into_iter().enumerate() {
        same_sequence(vec![limit], 10 + i as u64, 150, 600_000, 3).await;
    }
}

#[tokio::test]
async fn three_layers_refuse_with_the_longest_wait_as_in_memory() {
    let second = Duration::from_secs(1);
    let limits = vec![
        bucket("tb", 6, second, 3),
        fixed("fw", 8, 2 * second),
        sliding("sw", 10, 3 * second)
            .with_block_for(second)
            .unwrap(),
    ];
    same_sequence(limits, 20, 250, 400_000, 3).await;
}

#[tokio::test]
async fn concurrency_matches_memory_as_slots_are_taken_and_released() {
    let server = RedisServer::start();
    let store = server.store().await;
    let limit = concurrency("conc", 3);
    let limiter = Limiter::new([limit.clone()]).unwrap();
    let remote_limit = remote(&limit);
    let k = key("caller");
    let memory_layers = [(limiter.id("conc").unwrap(), k)];
    let layers = [Layer::enforced(&remote_limit, k)];
    let (mut memory_held, mut store_held) = (Vec::new(), Vec::new());
    let mut rng = Rng(30);
    for step in 0..120 {
        let ctx = format!("step {step}");
        if rng.below(5) < 2 && !memory_held.is_empty() {
            let i = rng.below(memory_held.len() as u64) as usize;
            drop(memory_held.swap_remove(i));
            let lease: sluice_store_redis::Lease = store_held.swap_remove(i);
            lease.release().await.unwrap();
            continue;
        }
        let now = at(step);
        let memory = limiter.decide(&memory_layers, 1, now);
        let remote = store
            .decide_at(&layers, 1, Mode::Charge, now)
            .await
            .unwrap();
        match (memory, remote) {
            (Decision::Admitted(m), RemoteDecision::Admitted(mut s)) => {
                same_reports(m.reports(&limiter), &s.reports, &ctx);
                memory_held.push(m);
                store_held.push(
                    s.lease
                        .take()
                        .expect("a concurrency admission holds a lease"),
                );
            }
            (Decision::Refused(m), RemoteDecision::Refused(s)) => {
                same_reports(m.reports(&limiter), &s.reports, &ctx);
                assert_eq!((m.wait(), s.wait), (None, None), "{ctx}");
            }
            (m, s) => panic!("{ctx}: memory {m:?}, store {s:?}"),
        }
    }
}
