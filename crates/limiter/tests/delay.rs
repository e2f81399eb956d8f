//! Limits that may hold a request (`max_delay`): a request that passes within it is admitted at
//! once, charged as of when it will pass, and told how long to wait; later requests queue behind.

mod common;

use common::*;
use sluice_limiter::{Decision, Limit, Limiter, Nanos};
use std::time::Duration;

fn held(limit: Limit, max_delay: Duration) -> Limiter {
    Limiter::new([limit.with_max_delay(max_delay).unwrap()]).unwrap()
}

/// The wait of an admitted decision, or `Err` with the refusal's `Retry-After`.
fn wait_of(limiter: &Limiter, name: &str, now: Nanos) -> Result<Duration, Option<Duration>> {
    let layers = all_layers(limiter, &[name]);
    match limiter.decide(&layers, 1, now) {
        Decision::Admitted(a) => Ok(a.wait()),
        Decision::Refused(r) => Err(r.wait()),
        Decision::CostTooLarge(_) => panic!("cost 1 fits"),
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

#[test]
fn a_token_bucket_queues_held_requests_in_arrival_order() {
    let limiter = held(bucket("b", 1, Duration::from_secs(1), 1), secs(3.0));
    let waits: Vec<_> = (0..5).map(|_| wait_of(&limiter, "b", T0)).collect();
    assert_eq!(
        waits,
        [
            Ok(secs(0.0)),
            Ok(secs(1.0)),
            Ok(secs(2.0)),
            Ok(secs(3.0)),
            Err(Some(secs(4.0)))
        ]
    );
    // One second later a newcomer does not take the token the second request waited for: it
    // queues after the three still held (they pass at 1, 2 and 3 s; it at 4 s).
    assert_eq!(wait_of(&limiter, "b", at(SEC)), Ok(secs(3.0)));
}

#[test]
fn a_fixed_window_reserves_its_next_windows() {
    let limiter = held(fixed("f", 2, Duration::from_secs(10)), secs(15.0));
    let now = at(5 * SEC); // 5 s into a 10 s window
    let waits: Vec<_> = (0..7).map(|_| wait_of(&limiter, "f", now)).collect();
    assert_eq!(
        waits,
        [
            Ok(secs(0.0)),
            Ok(secs(0.0)),
            Ok(secs(5.0)),
            Ok(secs(5.0)),
            Ok(secs(15.0)),
            Ok(secs(15.0)),
            Err(Some(secs(25.0)))
        ]
    );
}

#[test]
fn a_sliding_window_reserves_when_the_estimate_leaves_room() {
    let limiter = held(sliding("s", 4, Duration::from_secs(10)), secs(15.0));
    let waits: Vec<_> = (0..7).map(|_| wait_of(&limiter, "s", T0)).collect();
    // Next window: 4 * (1 - e/10) + reserved + 1 <= 4 at e = 2.5 s, then 5 s; 7.5 s is too far.
    assert_eq!(
        waits,
        [
            Ok(secs(0.0)),
            Ok(secs(0.0)),
            Ok(secs(0.0)),
            Ok(secs(0.0)),
            Ok(secs(12.5)),
            Ok(secs(15.0)),
            Err(Some(secs(17.5)))
        ]
    );
}

#[test]
fn a_request_that_read_the_clock_before_a_later_window_began_leaves_it_alone() {
    // Enforced, no delay: a state of window 1 exists when a request stamped in window 0 comes.
    let limiter = Limiter::new([fixed("f", 1, Duration::from_secs(10))]).unwrap();
    assert_eq!(wait_of(&limiter, "f", at(10 * SEC)), Ok(secs(0.0)));
    assert_eq!(
        wait_of(&limiter, "f", at(9 * SEC)),
        Err(Some(secs(11.0))),
        "window 0 is spent once the state moved on, and window 1 is full: it fits at 20 s"
    );
    assert_eq!(
        wait_of(&limiter, "f", at(10 * SEC)),
        Err(Some(secs(10.0))),
        "window 1 still holds its one request"
    );
    let sliding = Limiter::new([sliding("s", 1, Duration::from_secs(10))]).unwrap();
    assert_eq!(wait_of(&sliding, "s", at(10 * SEC)), Ok(secs(0.0)));
    assert!(wait_of(&sliding, "s", at(9 * SEC)).is_err());
    assert!(wait_of(&sliding, "s", at(10 * SEC)).is_err());
}

#[test]
fn a_refusal_by_another_layer_takes_the_reservation_back() {
    let limiter = Limiter::new([
        bucket("smooth", 1, Duration::from_secs(1), 1)
            .with_max_delay(secs(5.0))
            .unwrap(),
        fixed("daily", 1, Duration::from_secs(86_400)),
    ])
    .unwrap();
    let both = all_layers(&limiter, &["smooth", "daily"]);
    assert!(limiter.decide(&both, 1, T0).is_admitted());
    let Decision::Refused(r) = limiter.decide(&both, 1, T0) else {
        panic!("daily is spent")
    };
    assert_eq!(r.limit(), limiter.id("daily").unwrap());
    assert_eq!(
        wait_of(&limiter, "smooth", T0),
        Ok(secs(1.0)),
        "the refused request's reservation (at 1 s) was taken back"
    );
}

#[test]
fn a_held_admission_reports_as_of_its_decision_and_refunds_exactly() {
    let limiter = held(bucket("b", 2, Duration::from_secs(1), 2), secs(1.0));
    let layers = all_layers(&limiter, &["b"]);
    let _first_two = [
        limiter.decide(&layers, 1, T0),
        limiter.decide(&layers, 1, T0),
    ];
    let before = observe(&limiter, &layers, T0);
    let Decision::Admitted(mut a) = limiter.decide(&layers, 1, T0) else {
        panic!("held 500 ms")
    };
    assert_eq!(a.wait(), secs(0.5));
    let report = a.reports(&limiter).next().unwrap();
    assert_eq!(
        (report.remaining, report.reset),
        (0, Some(secs(1.0))),
        "nothing left, and the next token comes 500 ms after the held request passes"
    );
    limiter.refund(&mut a);
    assert_eq!(observe(&limiter, &layers, T0), before);
}
