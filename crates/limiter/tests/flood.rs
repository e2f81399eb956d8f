//! A flood of distinct callers: the table stays at its cap, evicts, and sweeps on schedule.

mod common;

use common::*;
use sluice_limiter::{KeyHasher, Limiter};
use std::time::Duration;

#[test]
fn two_million_keys_keep_the_table_at_its_cap_and_walks_match_sweep_periods() {
    const KEYS: u64 = 2_000_000;
    const CAP: usize = 100_000;
    const STEP: u64 = 2_000; // ns between keys: 500,000 new keys per one-second window
    let limit = fixed("flood", 5, Duration::from_secs(1))
        .with_max_keys(CAP)
        .unwrap();
    let limiter = Limiter::new([limit]).unwrap();
    let id = limiter.id("flood").unwrap();
    let hasher = KeyHasher::new_random();
    for i in 0..KEYS {
        let now = at(i * STEP);
        let key = hasher.key(&[&i.to_le_bytes()]);
        assert!(
            limiter.decide(&[(id, key)], 1, now).is_admitted(),
            "a full table never refuses"
        );
        if i % 1_000 == 0 {
            limiter.sweep(now); // the gateway's background task, called far more often than due
            assert!(limiter.stats(id).keys <= CAP);
        }
    }
    let stats = limiter.stats(id);
    let periods = (KEYS * STEP).div_ceil(SEC); // windows the flood spanned, from T0
    assert_eq!(stats.walks, periods);
    assert_eq!(stats.keys, CAP);
    assert_eq!(stats.evictions + stats.swept + stats.keys as u64, KEYS);
    assert!(
        stats.evictions > 1_500_000,
        "evictions: {}",
        stats.evictions
    );
}
