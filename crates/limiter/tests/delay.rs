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
    limiter.refund(&mut a, T0);
    assert_eq!(observe(&limiter, &layers, T0), before);
}

/// The admission of one more request of `name` at `now`, which must be admitted.
fn admit(limiter: &Limiter, name: &str, now: Nanos) -> sluice_limiter::Admission {
    match limiter.decide(&all_layers(limiter, &[name]), 1, now) {
        Decision::Admitted(a) => a,
        other => panic!("not admitted: {other:?}"),
    }
}

/// The wait a request of `name` would get at `now`, charging nothing.
fn would_wait(limiter: &Limiter, name: &str, now: Nanos) -> Option<Duration> {
    match limiter.check(&all_layers(limiter, &[name]), 1, now) {
        Decision::Admitted(a) => Some(a.wait()),
        _ => None,
    }
}

#[test]
fn a_withdrawn_token_bucket_charge_comes_back_only_from_the_end_of_the_queue() {
    let limiter = held(bucket("b", 1, Duration::from_secs(1), 1), secs(3.0));
    let _passes = admit(&limiter, "b", T0);
    let mut second = admit(&limiter, "b", T0);
    let mut third = admit(&limiter, "b", T0);
    assert_eq!((second.wait(), third.wait()), (secs(1.0), secs(2.0)));
    assert_eq!(would_wait(&limiter, "b", T0), Some(secs(3.0)));
    // The second's client leaves while the third queues behind it: the third keeps its
    // moment (2 s) and the bucket keeps the charge. A refund would hand 2 s to the next
    // request as well: two requests at once where the bucket allows one.
    limiter.withdraw(&mut second, T0);
    assert_eq!(would_wait(&limiter, "b", T0), Some(secs(3.0)));
    // The last of the queue leaves: its moment goes to the next request.
    limiter.withdraw(&mut third, T0);
    assert_eq!(would_wait(&limiter, "b", T0), Some(secs(2.0)));
    // Withdrawing again takes nothing more.
    limiter.withdraw(&mut third, T0);
    assert_eq!(would_wait(&limiter, "b", T0), Some(secs(2.0)));
}

#[test]
fn a_withdrawn_window_charge_comes_back_while_its_window_is_counted() {
    let limiter = held(fixed("f", 1, Duration::from_secs(10)), secs(25.0));
    let now = at(5 * SEC); // 5 s into a 10 s window
    let mut passes = admit(&limiter, "f", now);
    let mut next_window = admit(&limiter, "f", now);
    assert_eq!(next_window.wait(), secs(5.0));
    // Windows count requests, not moments: the charge comes back, whoever came since.
    limiter.withdraw(&mut next_window, now);
    assert_eq!(would_wait(&limiter, "f", now), Some(secs(5.0)));
    limiter.withdraw(&mut next_window, now);
    assert_eq!(
        would_wait(&limiter, "f", now),
        Some(secs(5.0)),
        "taken back once"
    );
    // A fixed window keeps the count of its latest window only: once a later window is
    // charged, an earlier one's charge is gone, and nothing comes back.
    let _later = admit(&limiter, "f", now);
    limiter.withdraw(&mut passes, now);
    assert_eq!(would_wait(&limiter, "f", now), Some(secs(15.0)));
}

#[test]
fn a_withdrawn_charge_comes_back_from_the_limits_that_hold_nothing_whoever_came_since() {
    let d = bucket("d", 1, Duration::from_secs(1), 1)
        .with_max_delay(secs(3.0))
        .unwrap();
    let e = bucket("e", 3, Duration::from_secs(100), 3);
    let limiter = Limiter::new([d, e]).unwrap();
    let both = all_layers(&limiter, &["d", "e"]);
    let Decision::Admitted(_passes) = limiter.decide(&both, 1, T0) else {
        panic!("the first passes");
    };
    let Decision::Admitted(mut held) = limiter.decide(&both, 1, T0) else {
        panic!("the second is held");
    };
    assert_eq!(held.wait(), secs(1.0));
    // Another request of the caller's, on a route `d` does not cover, spends `e`'s last.
    let e_only = all_layers(&limiter, &["e"]);
    assert!(matches!(
        limiter.decide(&e_only, 1, T0),
        Decision::Admitted(_)
    ));
    // The held request's client leaves: `e` holds nobody's moment, so its charge comes back
    // (review: it was kept, as if the other request had queued behind it; a 503 at the end
    // of a hold cost the caller quota).
    limiter.withdraw(&mut held, T0);
    assert!(matches!(
        limiter.check(&e_only, 1, T0),
        Decision::Admitted(_)
    ));
    // And `d`, with nobody behind it, gives back its moment too.
    assert_eq!(would_wait(&limiter, "d", T0), Some(secs(1.0)));
}

/// The wait of a request of `cost` on `layers` at `now`, or `None` if it is not admitted.
fn wait_at(
    limiter: &Limiter,
    layers: &[(sluice_limiter::LimitId, sluice_limiter::Key)],
    cost: u32,
    now: Nanos,
) -> Option<Duration> {
    match limiter.decide(layers, cost, now) {
        Decision::Admitted(a) => Some(a.wait()),
        _ => None,
    }
}

#[test]
fn a_window_charge_held_into_a_later_window_and_taken_back_leaves_the_current_one_as_it_was() {
    // Review (limit math): the charge was taken back from the later window, but the state
    // stayed there, so the current window read as spent and the next request was held till
    // the later one, though its window had room.
    let limiter = held(fixed("f", 3, Duration::from_secs(10)), secs(25.0));
    let layers = all_layers(&limiter, &["f"]);
    let now = at(5 * SEC);
    assert_eq!(wait_at(&limiter, &layers, 2, now), Some(secs(0.0)));
    let Decision::Admitted(mut next_window) = limiter.decide(&layers, 2, now) else {
        panic!("2 more fit in the next window");
    };
    assert_eq!(next_window.wait(), secs(5.0));
    limiter.refund(&mut next_window, now);
    assert_eq!(
        wait_at(&limiter, &layers, 1, now),
        Some(secs(0.0)),
        "the current window has 1 left"
    );
    assert_eq!(
        wait_at(&limiter, &layers, 1, now),
        Some(secs(5.0)),
        "and then none"
    );
}

#[test]
fn a_window_charge_held_into_a_later_window_comes_back_whole_when_another_layer_refuses() {
    // The same when another layer refuses the request (429): nothing of it stays charged.
    let now = at(5 * SEC);
    let limiter = Limiter::new([
        fixed("f", 3, Duration::from_secs(10))
            .with_max_delay(secs(25.0))
            .unwrap(),
        fixed("daily", 2, Duration::from_secs(86_400)),
    ])
    .unwrap();
    let both = all_layers(&limiter, &["f", "daily"]);
    let f_only = all_layers(&limiter, &["f"]);
    assert_eq!(wait_at(&limiter, &both, 2, now), Some(secs(0.0)));
    assert!(matches!(
        limiter.decide(&both, 2, now),
        Decision::Refused(r) if r.limit() == limiter.id("daily").unwrap()
    ));
    assert_eq!(wait_at(&limiter, &f_only, 1, now), Some(secs(0.0)));
}

#[test]
fn a_sliding_window_charge_held_into_a_later_window_and_taken_back_leaves_its_estimate() {
    // A sliding window's estimate falls through the current window, so a state moved to a
    // later one would also hold requests that a smaller estimate lets through.
    let limiter = held(sliding("s", 2, Duration::from_secs(10)), secs(15.0));
    let layers = all_layers(&limiter, &["s"]);
    assert_eq!(wait_at(&limiter, &layers, 2, T0), Some(secs(0.0)));
    let Decision::Admitted(mut ahead) = limiter.decide(&layers, 2, at(12 * SEC)) else {
        panic!("2 fit once the first window no longer weighs, at 20 s");
    };
    assert_eq!(ahead.wait(), secs(8.0));
    limiter.refund(&mut ahead, at(12 * SEC));
    // At 16 s the first window's 2 weigh 0.8: one more fits.
    assert_eq!(wait_at(&limiter, &layers, 1, at(16 * SEC)), Some(secs(0.0)));
}

#[test]
fn a_withdrawn_window_charge_leaves_a_later_window_to_whoever_was_charged_there_since() {
    let limiter = held(fixed("f", 2, Duration::from_secs(10)), secs(25.0));
    let layers = all_layers(&limiter, &["f"]);
    let now = at(5 * SEC);
    assert_eq!(wait_at(&limiter, &layers, 2, now), Some(secs(0.0)));
    let Decision::Admitted(mut first_held) = limiter.decide(&layers, 1, now) else {
        panic!("held into the next window");
    };
    let Decision::Admitted(_second_held) = limiter.decide(&layers, 1, now) else {
        panic!("held into the next window too");
    };
    // The first held request's client leaves: the state is not put back as it was before
    // it (that would drop the second's charge); its count comes out of the next window.
    limiter.withdraw(&mut first_held, now);
    assert_eq!(wait_at(&limiter, &layers, 1, now), Some(secs(5.0)));
    assert_eq!(wait_at(&limiter, &layers, 1, now), Some(secs(15.0)));
}
