//! Bugs seen in peers, pinned.

mod common;

use common::*;
use sluice_limiter::Limiter;
use std::time::Duration;

fn admitted(limiter: &Limiter, name: &str, tries: u32, now: sluice_limiter::Nanos) -> usize {
    let layers = all_layers(limiter, &[name]);
    (0..tries)
        .filter(|_| limiter.decide(&layers, 1, now).is_admitted())
        .count()
}

#[test]
fn burst_of_5_refilled_admits_5_not_6() {
    // governor #107 / #249: after a burst was spent and the bucket refilled, 6 passed.
    let limiter = Limiter::new([bucket("b", 5, Duration::from_secs(1), 5)]).unwrap();
    assert_eq!(admitted(&limiter, "b", 10, at(0)), 5);
    assert_eq!(admitted(&limiter, "b", 10, at(SEC)), 5, "exactly refilled");
    assert_eq!(
        admitted(&limiter, "b", 10, at(100 * SEC)),
        5,
        "after a long idle"
    );
}

#[test]
fn two_requests_a_tenth_of_a_second_apart_at_1000_per_second_both_pass() {
    for burst in [1, 1000] {
        let limiter = Limiter::new([bucket("b", 1000, Duration::from_secs(1), burst)]).unwrap();
        assert_eq!(admitted(&limiter, "b", 1, at(0)), 1);
        assert_eq!(admitted(&limiter, "b", 1, at(SEC / 10)), 1, "burst {burst}");
    }
}
