//! Full-jitter exponential backoff, for refusals that carry no usable `Retry-After`.

use std::time::Duration;

use rand::Rng;

/// Full-jitter exponential backoff: the wait before retry `n` (from 0) is uniform in
/// `[0, min(cap, base * 2^n)]`.
///
/// Full jitter spreads refused callers over the whole interval, so they do not come back in
/// the same instant and trip the limit again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
}

/// Why a [`Backoff`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackoffError {
    /// A zero base would never back off at all.
    #[error("the backoff base must be greater than zero")]
    ZeroBase,
    /// The cap must leave room for at least the first wait.
    #[error("the backoff cap ({cap:?}) must be at least the base ({base:?})")]
    CapBelowBase {
        /// The base given.
        base: Duration,
        /// The cap given.
        cap: Duration,
    },
}

impl Backoff {
    /// A backoff whose first ceiling is `base`, doubling up to `cap`.
    pub fn new(base: Duration, cap: Duration) -> Result<Self, BackoffError> {
        if base.is_zero() {
            return Err(BackoffError::ZeroBase);
        }
        if cap < base {
            return Err(BackoffError::CapBelowBase { base, cap });
        }
        Ok(Backoff { base, cap })
    }

    /// The first ceiling.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The largest ceiling.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// The upper bound of the wait before retry `retry` (from 0): `min(cap, base * 2^retry)`.
    pub fn ceiling(&self, retry: u32) -> Duration {
        2u32.checked_pow(retry)
            .and_then(|factor| self.base.checked_mul(factor))
            .map_or(self.cap, |ceiling| ceiling.min(self.cap))
    }

    /// Draws the wait before retry `retry` (from 0), uniform in `[0, ceiling(retry)]`.
    pub fn wait<R: Rng + ?Sized>(&self, retry: u32, rng: &mut R) -> Duration {
        self.wait_within(retry, Duration::MAX, rng)
    }

    /// [`Backoff::wait`], drawn from zero to the smaller of the ceiling and `limit` (what is
    /// left of a time budget).
    pub fn wait_within<R: Rng + ?Sized>(
        &self,
        retry: u32,
        limit: Duration,
        rng: &mut R,
    ) -> Duration {
        let ceiling = self.ceiling(retry).min(limit);
        let ceiling = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.gen_range(0..=ceiling))
    }
}

impl Default for Backoff {
    /// 100 ms, doubling up to 10 s.
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(10),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn ceiling_doubles_from_base_until_the_cap() {
        let b = Backoff::new(ms(100), ms(1000)).unwrap();
        let ceilings: Vec<_> = (0..6).map(|n| b.ceiling(n)).collect();
        assert_eq!(
            ceilings,
            [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
        );
    }

    #[test]
    fn ceiling_saturates_at_the_cap_for_huge_retry_numbers() {
        let b = Backoff::new(ms(100), Duration::from_secs(30)).unwrap();
        assert_eq!(b.ceiling(31), Duration::from_secs(30));
        assert_eq!(b.ceiling(32), Duration::from_secs(30));
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn waits_stay_within_zero_and_the_ceiling() {
        let b = Backoff::new(ms(100), ms(1000)).unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        for retry in 0..8 {
            for _ in 0..200 {
                let wait = b.wait(retry, &mut rng);
                assert!(wait <= b.ceiling(retry), "retry {retry}: {wait:?}");
            }
        }
    }

    #[test]
    fn waits_spread_over_the_whole_interval() {
        // Full jitter, not "ceiling plus a little": some draws land in the bottom and top tenth.
        let b = Backoff::new(ms(1000), ms(1000)).unwrap();
        let mut rng = StdRng::seed_from_u64(11);
        let waits: Vec<_> = (0..500).map(|_| b.wait(0, &mut rng)).collect();
        assert!(waits.iter().any(|w| *w < ms(100)));
        assert!(waits.iter().any(|w| *w > ms(900)));
    }

    #[test]
    fn same_seed_gives_the_same_waits() {
        let b = Backoff::default();
        let draw = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..5).map(|n| b.wait(n, &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
    }

    #[test]
    fn zero_base_is_refused() {
        assert_eq!(
            Backoff::new(Duration::ZERO, ms(10)),
            Err(BackoffError::ZeroBase)
        );
    }

    #[test]
    fn cap_below_base_is_refused() {
        let err = Backoff::new(ms(10), ms(5)).unwrap_err();
        assert_eq!(
            err,
            BackoffError::CapBelowBase {
                base: ms(10),
                cap: ms(5)
            }
        );
    }
}
