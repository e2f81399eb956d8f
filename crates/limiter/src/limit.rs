//! A limit's definition, validated at construction: an invalid limit cannot be built.

use std::num::NonZeroU32;
use std::time::Duration;

/// The default bound on keys held per limit.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// How a limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// GCRA token bucket: `quota` tokens per `window`, holding at most `burst` tokens.
    TokenBucket {
        /// Bucket size: the most a key may spend at once after idling.
        burst: NonZeroU32,
    },
    /// A counter per window; windows aligned to multiples of `window` since the Unix epoch.
    FixedWindow,
    /// The two-counter estimate `previous * (1 - elapsed / window) + current`.
    SlidingWindow,
    /// At most `quota` requests in flight per key; each request holds one slot.
    Concurrency,
}

/// Why a limit could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// The name is empty.
    #[error("limit name must not be empty")]
    EmptyName,
    /// The window is zero or longer than 584 years (u64 nanoseconds).
    #[error("limit {name:?}: window must be between 1 ns and 584 years, got {window:?}")]
    BadWindow {
        /// The limit's name.
        name: String,
        /// The rejected window.
        window: Duration,
    },
    /// `block_for` is zero or longer than 584 years.
    #[error("limit {name:?}: block_for must be between 1 ns and 584 years, got {block_for:?}")]
    BadBlockFor {
        /// The limit's name.
        name: String,
        /// The rejected duration.
        block_for: Duration,
    },
    /// `block_for` on a concurrency limit: a slot frees when a request ends, not after a time.
    #[error("limit {name:?}: block_for does not apply to a concurrency limit")]
    BlockForOnConcurrency {
        /// The limit's name.
        name: String,
    },
    /// `max_delay` is zero or longer than 584 years.
    #[error("limit {name:?}: max_delay must be between 1 ns and 584 years, got {max_delay:?}")]
    BadMaxDelay {
        /// The limit's name.
        name: String,
        /// The rejected duration.
        max_delay: Duration,
    },
    /// `max_delay` on a concurrency limit: a slot frees when a request ends, not at a time
    /// that could be reserved.
    #[error("limit {name:?}: max_delay does not apply to a concurrency limit")]
    MaxDelayOnConcurrency {
        /// The limit's name.
        name: String,
    },
    /// `max_keys` is zero.
    #[error("limit {name:?}: max_keys must be at least 1")]
    ZeroMaxKeys {
        /// The limit's name.
        name: String,
    },
}

/// One limit: what is counted, how much is allowed, and how many keys it may remember.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    name: String,
    algorithm: Algorithm,
    quota: NonZeroU32,
    window: Duration,
    block_for: Option<Duration>,
    max_delay: Option<Duration>,
    max_keys: usize,
}

impl Limit {
    /// A limit allowing `quota` per `window` (for [`Algorithm::Concurrency`], `quota` in flight;
    /// its `window` only sets how often the sweep walks the table).
    pub fn new(
        name: impl Into<String>,
        algorithm: Algorithm,
        quota: NonZeroU32,
        window: Duration,
    ) -> Result<Self, LimitError> {
        let name = name.into();
        if name.is_empty() {
            return Err(LimitError::EmptyName);
        }
        if window.is_zero() || window.as_nanos() > u128::from(u64::MAX) {
            return Err(LimitError::BadWindow { name, window });
        }
        Ok(Limit {
            name,
            algorithm,
            quota,
            window,
            block_for: None,
            max_delay: None,
            max_keys: DEFAULT_MAX_KEYS,
        })
    }

    /// After this limit refuses a key, refuse that key for `block_for` whatever its counters say.
    pub fn with_block_for(mut self, block_for: Duration) -> Result<Self, LimitError> {
        if self.algorithm == Algorithm::Concurrency {
            return Err(LimitError::BlockForOnConcurrency { name: self.name });
        }
        if block_for.is_zero() || block_for.as_nanos() > u128::from(u64::MAX) {
            let name = self.name;
            return Err(LimitError::BadBlockFor { name, block_for });
        }
        self.block_for = Some(block_for);
        Ok(self)
    }

    /// Lets this limit admit a request that would pass within `max_delay`: the limit is
    /// charged now, as of the moment the request will pass, and the admission says how long
    /// to hold it ([`crate::Admission::wait`]). So a held request keeps its place: one that
    /// comes later queues behind it instead of taking the quota it waits for.
    pub fn with_max_delay(mut self, max_delay: Duration) -> Result<Self, LimitError> {
        if self.algorithm == Algorithm::Concurrency {
            return Err(LimitError::MaxDelayOnConcurrency { name: self.name });
        }
        if max_delay.is_zero() || max_delay.as_nanos() > u128::from(u64::MAX) {
            let name = self.name;
            return Err(LimitError::BadMaxDelay { name, max_delay });
        }
        self.max_delay = Some(max_delay);
        Ok(self)
    }

    /// Bounds the keys this limit remembers (default [`DEFAULT_MAX_KEYS`]).
    pub fn with_max_keys(mut self, max_keys: usize) -> Result<Self, LimitError> {
        if max_keys == 0 {
            return Err(LimitError::ZeroMaxKeys { name: self.name });
        }
        self.max_keys = max_keys;
        Ok(self)
    }

    /// The name, as used in response headers.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Requests (or tokens) allowed per window; for concurrency, requests in flight.
    pub fn quota(&self) -> NonZeroU32 {
        self.quota
    }

    /// The window (for concurrency: the sweep interval only).
    pub fn window(&self) -> Duration {
        self.window
    }

    /// How long a key stays refused after a refusal, if set.
    pub fn block_for(&self) -> Option<Duration> {
        self.block_for
    }

    /// The longest this limit lets a request be held until it passes, if set.
    pub fn max_delay(&self) -> Option<Duration> {
        self.max_delay
    }

    /// The most keys this limit remembers.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// The largest cost one request can ever be admitted with (`None`: cost is not counted).
    pub fn capacity(&self) -> Option<u32> {
        match self.algorithm {
            Algorithm::TokenBucket { burst } => Some(burst.get()),
            Algorithm::FixedWindow | Algorithm::SlidingWindow => Some(self.quota.get()),
            Algorithm::Concurrency => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn zero_window_cannot_be_built() {
        let err = Limit::new("a", Algorithm::FixedWindow, q(1), Duration::ZERO).unwrap_err();
        assert!(matches!(err, LimitError::BadWindow { .. }));
        assert!(err.to_string().contains("\"a\""));
    }

    #[test]
    fn empty_name_cannot_be_built() {
        let err = Limit::new("", Algorithm::FixedWindow, q(1), Duration::from_secs(1));
        assert_eq!(err, Err(LimitError::EmptyName));
    }

    #[test]
    fn block_for_on_concurrency_cannot_be_built() {
        let limit = Limit::new("c", Algorithm::Concurrency, q(1), Duration::from_secs(1)).unwrap();
        let err = limit.with_block_for(Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, LimitError::BlockForOnConcurrency { .. }));
    }

    #[test]
    fn zero_block_for_and_zero_max_keys_cannot_be_built() {
        let limit = Limit::new("f", Algorithm::FixedWindow, q(1), Duration::from_secs(1)).unwrap();
        assert!(limit.clone().with_block_for(Duration::ZERO).is_err());
        assert!(limit.with_max_keys(0).is_err());
    }

    #[test]
    fn max_delay_needs_a_length_and_a_limit_that_counts_time() {
        let limit = Limit::new("f", Algorithm::FixedWindow, q(1), Duration::from_secs(1)).unwrap();
        assert!(limit.clone().with_max_delay(Duration::ZERO).is_err());
        let held = limit.with_max_delay(Duration::from_millis(250)).unwrap();
        assert_eq!(held.max_delay(), Some(Duration::from_millis(250)));
        let slots = Limit::new("c", Algorithm::Concurrency, q(1), Duration::from_secs(1)).unwrap();
        assert_eq!(
            slots.with_max_delay(Duration::from_secs(1)),
            Err(LimitError::MaxDelayOnConcurrency { name: "c".into() })
        );
    }

    #[test]
    fn capacity_is_burst_for_a_bucket_and_quota_for_windows() {
        let burst = Algorithm::TokenBucket { burst: q(5) };
        let tb = Limit::new("t", burst, q(100), Duration::from_secs(1)).unwrap();
        assert_eq!(tb.capacity(), Some(5));
        let fw = Limit::new("f", Algorithm::FixedWindow, q(7), Duration::from_secs(1)).unwrap();
        assert_eq!(fw.capacity(), Some(7));
        assert_eq!(fw.max_keys(), DEFAULT_MAX_KEYS);
    }
}
