//! A circuit breaker in front of the shared store: after a few failures in a row, stop
//! calling it for a cool-down, then let one request probe it. A dead store then costs no
//! latency per request.
//!
//! Failures are counted once per `spacing` (the store's timeout, at most 100 ms), not once per
//! request: many requests share one call to the store, and they fail together when that call
//! fails or is slow, so counting each would open the breaker on a single slow call. "Three in a
//! row" means the store failed in three separate periods with no success between them.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Failures in a row that open the breaker.
const TRIP_AFTER: u32 = 3;

#[derive(Debug)]
pub(super) struct Breaker {
    epoch: Instant,
    cool_down: Duration,
    spacing: Duration,
    /// How long a probe may be out before it is taken for lost: the cool-down, or the longest
    /// a call to the store may take if that is longer (a probe still waiting on its call is not
    /// lost, and a second probe beside it would be one too many).
    probe_lifetime: Duration,
    failures: AtomicU32,
    /// Milliseconds since `epoch`, plus one, of the last failure counted (0: none since the
    /// last success).
    last_counted_ms: AtomicU64,
    /// Milliseconds since `epoch` until which the store is not called (0: closed).
    open_until_ms: AtomicU64,
    /// Milliseconds since `epoch`, plus one, when the current probe was let through (0: no
    /// probe out). A probe that never reports (its request was dropped) expires after
    /// `probe_lifetime`, so the breaker cannot stay open for good.
    probe_since_ms: AtomicU64,
}

/// Whether a request may call the store.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Gate {
    /// Closed: call it.
    Call,
    /// Half-open: this request is the one probe.
    Probe,
    /// Open: do not call it.
    Skip,
}

impl Breaker {
    /// A breaker that opens for `cool_down`, counting at most one failure per `spacing`, in
    /// front of a store whose calls take at most `call_timeout`.
    pub(super) fn new(cool_down: Duration, spacing: Duration, call_timeout: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            cool_down,
            spacing,
            probe_lifetime: cool_down.max(call_timeout),
            failures: AtomicU32::new(0),
            last_counted_ms: AtomicU64::new(0),
            open_until_ms: AtomicU64::new(0),
            probe_since_ms: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub(super) fn gate(&self) -> Gate {
        let until = self.open_until_ms.load(Ordering::Acquire);
        if until == 0 {
            return Gate::Call;
        }
        if self.now_ms() < until {
            return Gate::Skip;
        }
        let now = self.now_ms() + 1;
        let probe = self.probe_since_ms.load(Ordering::Acquire);
        let expired = probe != 0 && now >= probe + self.probe_lifetime.as_millis() as u64;
        if probe != 0 && !expired {
            return Gate::Skip;
        }
        match self
            .probe_since_ms
            .compare_exchange(probe, now, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Gate::Probe,
            Err(_) => Gate::Skip,
        }
    }

    /// Whether calls go to the store as usual (no failure has opened the circuit), without
    /// claiming the probe that [`Breaker::gate`] hands out once it has.
    pub(super) fn is_closed(&self) -> bool {
        self.open_until_ms.load(Ordering::Acquire) == 0
    }

    pub(super) fn success(&self) {
        self.failures.store(0, Ordering::Release);
        self.last_counted_ms.store(0, Ordering::Release);
        self.open_until_ms.store(0, Ordering::Release);
        self.probe_since_ms.store(0, Ordering::Release);
    }

    /// Records a failure of the store by a request that `probe`d it or not; returns true when
    /// this one opened (or re-opened) the breaker. A failed probe re-opens it at once;
    /// otherwise a failure within `spacing` of the last one counted is the same episode and is
    /// not counted again. Only the probe's own answer ends the probe: a late failure of a call
    /// made before the breaker opened leaves it out, so no second probe goes beside it.
    pub(super) fn failure(&self, probe: bool) -> bool {
        let was_probe = probe && self.probe_since_ms.swap(0, Ordering::AcqRel) != 0;
        let now = self.now_ms() + 1;
        let last = self.last_counted_ms.load(Ordering::Acquire);
        let spacing = self.spacing.as_millis() as u64;
        let counted = (last == 0 || now >= last.saturating_add(spacing))
            && self
                .last_counted_ms
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
        let n = if counted {
            self.failures.fetch_add(1, Ordering::AcqRel) + 1
        } else {
            self.failures.load(Ordering::Acquire)
        };
        if n >= TRIP_AFTER || was_probe {
            let until = self.now_ms() + self.cool_down.as_millis() as u64;
            self.open_until_ms.store(until.max(1), Ordering::Release);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPACING: Duration = Duration::from_millis(50);

    /// Three failures, each in its own timeout period.
    async fn three_failures(b: &Breaker) -> [bool; 3] {
        let mut opened = [false; 3];
        for (i, o) in opened.iter_mut().enumerate() {
            if i > 0 {
                tokio::time::advance(SPACING).await;
            }
            *o = b.failure(false);
        }
        opened
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_three_failures_then_lets_one_probe_through_after_the_cool_down() {
        let b = Breaker::new(Duration::from_secs(1), SPACING, SPACING);
        assert_eq!(b.gate(), Gate::Call);
        assert_eq!(three_failures(&b).await, [false, false, true]);
        assert_eq!(b.gate(), Gate::Skip);
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(b.gate(), Gate::Probe);
        assert_eq!(b.gate(), Gate::Skip, "one probe at a time");
        assert!(b.failure(true), "a failed probe re-opens");
        assert_eq!(b.gate(), Gate::Skip);
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(b.gate(), Gate::Probe);
        b.success();
        assert_eq!(b.gate(), Gate::Call);
    }

    #[tokio::test(start_paused = true)]
    async fn many_requests_failing_together_count_as_one_failure() {
        let b = Breaker::new(Duration::from_secs(1), SPACING, SPACING);
        // One slow call: a hundred requests time out within the same period.
        for _ in 0..100 {
            assert!(!b.failure(false));
        }
        assert_eq!(b.gate(), Gate::Call);
        tokio::time::advance(SPACING - Duration::from_millis(1)).await;
        assert!(!b.failure(false), "still the same episode");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!b.failure(false), "the second");
        tokio::time::advance(SPACING).await;
        assert!(b.failure(false), "the third period opens it");
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_never_reports_expires_after_a_cool_down() {
        let b = Breaker::new(Duration::from_secs(1), SPACING, SPACING);
        three_failures(&b).await;
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(b.gate(), Gate::Probe);
        // Its request is dropped, or fails on its own data: no success, no failure.
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(b.gate(), Gate::Skip, "still out");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(b.gate(), Gate::Probe, "a new probe after a cool-down");
        b.success();
        assert_eq!(b.gate(), Gate::Call);
    }

    /// A store timeout of 3 s against a cool-down of 1 s: the probe may wait 3 s on its call.
    #[tokio::test(start_paused = true)]
    async fn one_probe_at_a_time_while_its_call_may_still_be_running() {
        let b = Breaker::new(Duration::from_secs(1), SPACING, Duration::from_secs(3));
        three_failures(&b).await;
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(b.gate(), Gate::Probe);
        // A call made before the breaker opened fails late: not the probe's answer.
        tokio::time::advance(Duration::from_millis(500)).await;
        b.failure(false);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(
            b.gate(),
            Gate::Skip,
            "the probe's call may still be running"
        );
        tokio::time::advance(Duration::from_millis(1000)).await;
        assert_eq!(
            b.gate(),
            Gate::Probe,
            "3 s on: that probe is lost, a new one goes"
        );
        assert!(b.failure(true));
        assert_eq!(b.gate(), Gate::Skip);
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_between_failures_starts_the_count_again() {
        let b = Breaker::new(Duration::from_secs(1), SPACING, SPACING);
        assert!(!b.failure(false));
        tokio::time::advance(SPACING).await;
        assert!(!b.failure(false));
        b.success();
        assert_eq!(three_failures(&b).await, [false, false, true]);
    }
}
