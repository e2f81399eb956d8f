//! A circuit breaker in front of the shared store: after a few failures in a row, stop
//! calling it for a cool-down, then let one request probe it. A dead store then costs no
//! latency per request.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Failures in a row that open the breaker.
const TRIP_AFTER: u32 = 3;

#[derive(Debug)]
pub(super) struct Breaker {
    epoch: Instant,
    cool_down: Duration,
    failures: AtomicU32,
    /// Milliseconds since `epoch` until which the store is not called (0: closed).
    open_until_ms: AtomicU64,
    probing: AtomicBool,
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
    pub(super) fn new(cool_down: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            cool_down,
            failures: AtomicU32::new(0),
            open_until_ms: AtomicU64::new(0),
            probing: AtomicBool::new(false),
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
        match self
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Gate::Probe,
            Err(_) => Gate::Skip,
        }
    }

    pub(super) fn success(&self) {
        self.failures.store(0, Ordering::Release);
        self.open_until_ms.store(0, Ordering::Release);
        self.probing.store(false, Ordering::Release);
    }

    /// Records a failure; returns true when this one opened (or re-opened) the breaker.
    pub(super) fn failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let was_probe = self.probing.swap(false, Ordering::AcqRel);
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

    #[tokio::test(start_paused = true)]
    async fn opens_after_three_failures_then_lets_one_probe_through_after_the_cool_down() {
        let b = Breaker::new(Duration::from_secs(1));
        assert_eq!(b.gate(), Gate::Call);
        assert!(!b.failure());
        assert!(!b.failure());
        assert!(b.failure());
        assert_eq!(b.gate(), Gate::Skip);
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(b.gate(), Gate::Probe);
        assert_eq!(b.gate(), Gate::Skip, "one probe at a time");
        assert!(b.failure(), "a failed probe re-opens");
        assert_eq!(b.gate(), Gate::Skip);
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(b.gate(), Gate::Probe);
        b.success();
        assert_eq!(b.gate(), Gate::Call);
    }
}
