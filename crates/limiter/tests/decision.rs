//! The layered decision: all or nothing, longest wait, refunds, reports.

mod common;

use common::*;
use sluice_limiter::{Decision, Limiter, RefusalReason, Report};
use std::time::Duration;

#[test]
fn refused_request_charges_no_layer() {
    let limiter = Limiter::new([
        fixed("roomy", 10, Duration::from_secs(60)),
        bucket("tight", 1, Duration::from_secs(1), 1),
    ])
    .unwrap();
    let layers = all_layers(&limiter, &["roomy", "tight"]);
    assert!(limiter.decide(&layers, 1, T0).is_admitted());
    let before = observe(&limiter, &layers, T0);
    for _ in 0..5 {
        assert!(!limiter.decide(&layers, 1, T0).is_admitted());
    }
    assert_eq!(observe(&limiter, &layers, T0), before);
    assert_eq!(
        before[0].remaining, 9,
        "only the admitted request charged `roomy`"
    );
}

#[test]
fn refusal_names_the_limit_with_the_longest_wait() {
    let limiter = Limiter::new([
        fixed("second", 1, Duration::from_secs(1)),
        fixed("minute", 1, Duration::from_secs(60)),
        fixed("open", 100, Duration::from_secs(1)),
    ])
    .unwrap();
    let layers = all_layers(&limiter, &["second", "minute", "open"]);
    assert!(limiter.decide(&layers, 1, at(10 * SEC)).is_admitted());
    let Decision::Refused(r) = limiter.decide(&layers, 1, at(10 * SEC)) else {
        panic!("both windows are used up");
    };
    assert_eq!(r.limit(), limiter.id("minute").unwrap());
    assert_eq!(
        r.wait(),
        Some(Duration::from_secs(50)),
        "T0 is on a whole minute"
    );
    assert_eq!(r.reason(), RefusalReason::Exhausted);
}

#[test]
fn cost_above_burst_is_its_own_outcome_and_charges_nothing() {
    let limiter = Limiter::new([
        fixed("window", 100, Duration::from_secs(1)),
        bucket("bucket", 100, Duration::from_secs(1), 5),
    ])
    .unwrap();
    let layers = all_layers(&limiter, &["window", "bucket"]);
    let decision = limiter.decide(&layers, 6, T0);
    let figures = decision.reports(&limiter).collect::<Vec<_>>();
    let Decision::CostTooLarge(c) = decision else {
        panic!("6 can never fit a bucket of 5");
    };
    assert_eq!(
        (c.limit(), c.capacity()),
        (limiter.id("bucket").unwrap(), 5)
    );
    assert_eq!(observe(&limiter, &layers, T0)[0].remaining, 100);
    // No limit says when 6 would fit the bucket: it never will (review: the bucket said
    // 200 ms). The window, where 6 fits, says what it would after an admission.
    assert_eq!(figures[1].reset, None);
    assert_eq!(figures[0].reset, Some(Duration::ZERO));
    assert!(limiter.decide(&layers, 5, T0).is_admitted());
}

#[test]
fn refund_restores_every_algorithm_exactly() {
    let limiter = Limiter::new([
        bucket("bucket", 7, Duration::from_secs(3), 7),
        fixed("fixed", 7, Duration::from_secs(3)),
        sliding("sliding", 7, Duration::from_secs(3)),
        concurrency("slots", 2),
    ])
    .unwrap();
    let layers = all_layers(&limiter, &["bucket", "fixed", "sliding", "slots"]);
    let now = at(SEC + 123);
    let _held = limiter.decide(&layers, 2, now);
    let before = observe(&limiter, &layers, now);
    let Decision::Admitted(mut a) = limiter.decide(&layers, 3, now) else {
        panic!()
    };
    assert_ne!(observe(&limiter, &layers, now), before);
    limiter.refund(&mut a, now);
    assert_eq!(observe(&limiter, &layers, now), before);
    limiter.refund(&mut a, now);
    assert_eq!(
        observe(&limiter, &layers, now),
        before,
        "a second refund is a no-op"
    );
}

#[test]
fn a_lent_decision_is_the_returned_one() {
    let limits = || {
        Limiter::new([
            bucket("bucket", 3, Duration::from_secs(3), 3),
            fixed("fixed", 4, Duration::from_secs(3)),
        ])
        .unwrap()
    };
    let (returned, lent) = (limits(), limits());
    let layers = all_layers(&returned, &["bucket", "fixed"]);
    // Admitted, admitted, refused (bucket), free, too large, refused (fixed).
    for cost in [1, 2, 1, 0, 5, 1] {
        let d = returned.decide(&layers, cost, T0);
        let expected: (bool, Vec<Report>) = (d.is_admitted(), d.reports(&returned).collect());
        let got = lent.decide_with(&layers, cost, T0, |d| {
            (d.is_admitted(), d.reports(&lent).collect())
        });
        assert_eq!(got, expected, "cost {cost}");
    }
}

#[test]
fn refund_after_later_admissions_keeps_theirs() {
    let limiter = Limiter::new([bucket("b", 10, Duration::from_secs(1), 10)]).unwrap();
    let layers = all_layers(&limiter, &["b"]);
    let Decision::Admitted(mut first) = limiter.decide(&layers, 4, T0) else {
        panic!()
    };
    let _second = limiter.decide(&layers, 3, T0);
    limiter.refund(&mut first, T0);
    assert_eq!(observe(&limiter, &layers, T0)[0].remaining, 7);
}

/// A token bucket's charge that the bucket has since refilled past is owed no more: taking it
/// back must not take a later charge back instead (review: a burst of 1 charged at 0 and at
/// 5 s, the first refunded, admitted a third request at 5 s).
#[test]
fn refunding_a_charge_the_bucket_refilled_past_gives_nothing_back() {
    let limiter = Limiter::new([bucket("b", 1, Duration::from_secs(1), 1)]).unwrap();
    let layers = all_layers(&limiter, &["b"]);
    let Decision::Admitted(mut first) = limiter.decide(&layers, 1, T0) else {
        panic!()
    };
    let later = at(5 * SEC);
    assert!(limiter.decide(&layers, 1, later).is_admitted());
    limiter.refund(&mut first, later);
    assert!(
        !limiter.decide(&layers, 1, later).is_admitted(),
        "the one token at 5 s is taken"
    );
    // Half refilled past: half of a cost-2 charge is still owed and comes back.
    let limiter = Limiter::new([bucket("b", 4, Duration::from_secs(4), 4)]).unwrap();
    let layers = all_layers(&limiter, &["b"]);
    let Decision::Admitted(mut two) = limiter.decide(&layers, 2, T0) else {
        panic!()
    };
    // A second later 3 are left (one refilled), and a request takes them all; without the
    // first charge it would have found 4 and left 1.
    let one_later = at(SEC);
    assert!(limiter.decide(&layers, 3, one_later).is_admitted());
    assert_eq!(observe(&limiter, &layers, one_later)[0].remaining, 0);
    limiter.refund(&mut two, one_later);
    assert_eq!(observe(&limiter, &layers, one_later)[0].remaining, 1);
}

/// A refused request's roll-back, with another request charged on the same bucket by a
/// later clock in between, must not take that request's charge back: the bucket had refilled
/// past the rolled-back charge by the other's clock.
#[test]
fn a_roll_back_owes_only_what_is_left_at_the_refund() {
    let limiter = Limiter::new([bucket("b", 1, Duration::from_secs(1), 1)]).unwrap();
    let layers = all_layers(&limiter, &["b"]);
    let Decision::Admitted(mut a) = limiter.decide(&layers, 1, T0) else {
        panic!()
    };
    // Another request, 1.5 s later by its clock, finds the bucket full again and takes it.
    let later = at(SEC + SEC / 2);
    assert!(limiter.decide(&layers, 1, later).is_admitted());
    // The first is given back at the later time: 0 s of its charge is still owed.
    limiter.refund(&mut a, later);
    assert!(!limiter.decide(&layers, 1, later).is_admitted());
    assert!(limiter
        .decide(&layers, 1, at(2 * SEC + SEC / 2))
        .is_admitted());
}

#[test]
fn concurrency_slot_is_released_when_the_admission_drops() {
    let limiter = Limiter::new([concurrency("slots", 2)]).unwrap();
    let layers = all_layers(&limiter, &["slots"]);
    let a = limiter.decide(&layers, 1, T0);
    let b = limiter.decide(&layers, 1, T0);
    let Decision::Refused(r) = limiter.decide(&layers, 1, T0) else {
        panic!()
    };
    assert_eq!(
        r.wait(),
        None,
        "a slot frees when a request ends, not after a time"
    );
    drop(a);
    assert!(limiter.decide(&layers, 1, T0).is_admitted());
    drop(b);
}

#[test]
fn an_admissions_slots_alone_hold_its_concurrency_slots() {
    let limiter = Limiter::new([
        concurrency("slots", 1),
        bucket("b", 10, Duration::from_secs(1), 10),
    ])
    .unwrap();
    let layers = all_layers(&limiter, &["slots", "b"]);
    let Decision::Admitted(mut a) = limiter.decide(&layers, 1, T0) else {
        panic!()
    };
    let slots = a.take_slots();
    assert!(!limiter.decide(&layers, 1, T0).is_admitted(), "slot held");
    drop(slots);
    assert!(limiter.decide(&layers, 1, T0).is_admitted(), "slot freed");
    // The quota charges stayed: 2 of 10 used.
    assert_eq!(observe(&limiter, &layers, T0)[1].remaining, 8);
}

#[test]
fn check_decides_without_charging() {
    let limiter = Limiter::new([fixed("f", 2, Duration::from_secs(1))]).unwrap();
    let layers = all_layers(&limiter, &["f"]);
    for _ in 0..10 {
        assert!(limiter.check(&layers, 2, T0).is_admitted());
    }
    assert!(limiter.decide(&layers, 2, T0).is_admitted());
    assert!(!limiter.check(&layers, 1, T0).is_admitted());
}

#[test]
fn bucket_reports_burst_as_quota_and_refill_time_as_window() {
    let limiter = Limiter::new([bucket("b", 10, Duration::from_secs(1), 5)]).unwrap();
    let layers = all_layers(&limiter, &["b"]);
    let d = limiter.decide(&layers, 1, T0);
    let r = reports(&limiter, &d)[0];
    assert_eq!((r.quota, r.window), (5, Some(Duration::from_millis(500))));
    assert_eq!(
        (r.remaining, r.reset),
        (4, Some(Duration::from_millis(100)))
    );
}

#[test]
fn refused_report_gives_the_exact_wait_and_no_remaining() {
    let limiter = Limiter::new([fixed("f", 3, Duration::from_secs(10))]).unwrap();
    let layers = all_layers(&limiter, &["f"]);
    assert!(limiter.decide(&layers, 3, at(SEC)).is_admitted());
    let d = limiter.decide(&layers, 1, at(4 * SEC + 1));
    let r = reports(&limiter, &d)[0];
    assert_eq!((r.quota, r.remaining), (3, 0));
    assert_eq!(r.reset, Some(Duration::from_nanos(6 * SEC - 1)));
}

#[test]
fn sweep_removes_only_keys_back_to_fresh() {
    let limiter = Limiter::new([fixed("f", 5, Duration::from_secs(1))]).unwrap();
    let id = limiter.id("f").unwrap();
    let old = limiter.decide(&[(id, key("old"))], 1, at(0));
    let new = limiter.decide(&[(id, key("new"))], 1, at(SEC));
    assert_eq!(limiter.sweep(at(SEC + 1)), 1);
    assert_eq!((limiter.stats(id).keys, limiter.stats(id).swept), (1, 1));
    drop((old, new));
}

#[test]
fn duplicate_limit_names_are_rejected() {
    let err = Limiter::new([fixed("x", 1, Duration::from_secs(1)), concurrency("x", 1)]);
    assert!(err.is_err());
}

#[test]
fn ids_are_the_limits_in_the_order_given() {
    let names = ["c", "a", "b"];
    let limiter = Limiter::new(names.map(|n| fixed(n, 1, Duration::from_secs(1)))).unwrap();
    let ids: Vec<_> = limiter.ids().collect();
    let by_name: Vec<_> = names.iter().map(|n| limiter.id(n).unwrap()).collect();
    assert_eq!(ids, by_name);
    assert_eq!(
        ids.iter().map(|id| id.index()).collect::<Vec<_>>(),
        [0, 1, 2]
    );
}
