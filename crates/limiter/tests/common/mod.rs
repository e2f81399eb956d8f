//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test binary uses a different subset

use sluice_limiter::{Algorithm, Decision, Key, KeyHasher, Limit, LimitId, Limiter, Nanos, Report};
use std::num::NonZeroU32;
use std::time::Duration;

pub const SEC: u64 = 1_000_000_000;
/// A start time well past the epoch, on a whole minute.
pub const T0: Nanos = Nanos(1_700_000_040 * SEC);

pub fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

pub fn at(offset_ns: u64) -> Nanos {
    Nanos(T0.0 + offset_ns)
}

pub fn bucket(name: &str, quota: u32, window: Duration, burst: u32) -> Limit {
    let algorithm = Algorithm::TokenBucket { burst: nz(burst) };
    Limit::new(name, algorithm, nz(quota), window).unwrap()
}

pub fn fixed(name: &str, quota: u32, window: Duration) -> Limit {
    Limit::new(name, Algorithm::FixedWindow, nz(quota), window).unwrap()
}

pub fn sliding(name: &str, quota: u32, window: Duration) -> Limit {
    Limit::new(name, Algorithm::SlidingWindow, nz(quota), window).unwrap()
}

pub fn concurrency(name: &str, quota: u32) -> Limit {
    Limit::new(
        name,
        Algorithm::Concurrency,
        nz(quota),
        Duration::from_secs(1),
    )
    .unwrap()
}

pub fn key(name: &str) -> Key {
    KeyHasher::with_secret(b"tests").key(&[name.as_bytes()])
}

/// Every limit of `limiter`, each with its own key.
pub fn all_layers(limiter: &Limiter, names: &[&str]) -> Vec<(LimitId, Key)> {
    names
        .iter()
        .map(|n| (limiter.id(n).unwrap(), key(n)))
        .collect()
}

pub fn reports(limiter: &Limiter, d: &Decision) -> Vec<Report> {
    d.reports(limiter).collect()
}

/// What a `check` of cost 0 reports: the observable state of every layer, unchanged.
pub fn observe(limiter: &Limiter, layers: &[(LimitId, Key)], now: Nanos) -> Vec<Report> {
    layers
        .iter()
        .map(|&layer| {
            let d = limiter.check(&[layer], 0, now);
            let report = d.reports(limiter).next().unwrap();
            report
        })
        .collect()
}
