//! Time as integer nanoseconds since the Unix epoch, read through a [`Clock`].
//!
//! Algorithms never read the system clock: the caller passes `now`. Windows are aligned to
//! multiples of their length since the Unix epoch, so gateways sharing a store agree on them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time: nanoseconds since the Unix epoch (enough until the year 2554).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Nanos(pub u64);

impl Nanos {
    /// The instant `d` after the Unix epoch (saturating at `u64::MAX` nanoseconds).
    pub fn from_unix(d: Duration) -> Self {
        Nanos(duration_to_nanos(d))
    }

    /// This instant plus `d`, saturating.
    pub fn saturating_add(self, d: Duration) -> Self {
        Nanos(self.0.saturating_add(duration_to_nanos(d)))
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Nanos) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// A `Duration` in whole nanoseconds, saturating at `u64::MAX` (584 years).
pub(crate) fn duration_to_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A source of the current time.
pub trait Clock: Send + Sync {
    /// The current time.
    fn now(&self) -> Nanos;
}

/// The real clock: a monotonic clock (quanta's calibrated TSC, falling back to the OS monotonic
/// clock) plus the Unix-epoch offset read once at construction, so it never goes backwards when
/// the wall clock is stepped, yet its windows align with the epoch.
#[derive(Debug, Clone)]
pub struct SystemClock {
    clock: quanta::Clock,
    origin: u64,
    origin_unix: u64,
}

impl SystemClock {
    /// Reads the wall clock once to anchor the monotonic clock to the Unix epoch.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        SystemClock {
            clock,
            origin,
            origin_unix: duration_to_nanos(since_epoch),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Nanos {
        let elapsed = self.clock.delta_as_nanos(self.origin, self.clock.raw());
        Nanos(self.origin_unix.saturating_add(elapsed))
    }
}

/// A clock that only moves when told to: tests advance it instead of sleeping.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// A clock stopped at `start`.
    pub fn new(start: Nanos) -> Self {
        ManualClock {
            now: AtomicU64::new(start.0),
        }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        let d = duration_to_nanos(d);
        // Saturates at the end of time rather than wrapping to its start.
        let _ = self
            .now
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some(t.saturating_add(d))
            });
    }

    /// Sets the clock to `t` (it may go backwards: tests of stale readings need that).
    pub fn set(&self, t: Nanos) {
        self.now.store(t.0, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        Nanos(self.now.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::new(Nanos(1_000));
        assert_eq!(clock.now(), Nanos(1_000));
        clock.advance(Duration::from_nanos(500));
        assert_eq!(clock.now(), Nanos(1_500));
        clock.set(Nanos(7));
        assert_eq!(clock.now(), Nanos(7));
    }

    #[test]
    fn system_clock_is_anchored_to_the_unix_epoch_and_monotonic() {
        let clock = SystemClock::new();
        let wall = duration_to_nanos(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
        let a = clock.now();
        let b = clock.now();
        assert!(b >= a);
        assert!(
            a.0.abs_diff(wall) < 5_000_000_000,
            "within 5 s of the wall clock"
        );
    }

    #[test]
    fn nanos_arithmetic_saturates() {
        assert_eq!(
            Nanos(u64::MAX - 1).saturating_add(Duration::from_secs(1)),
            Nanos(u64::MAX)
        );
        assert_eq!(Nanos(1).saturating_since(Nanos(5)), Duration::ZERO);
        assert_eq!(
            Nanos::from_unix(Duration::from_secs(2)),
            Nanos(2_000_000_000)
        );
    }
}
