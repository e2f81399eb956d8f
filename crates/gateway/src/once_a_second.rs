//! A gate for things done at most once a second, such as a warning that a busy path would
//! otherwise write on every request. Lock-free: whoever finds the second passed and claims it
//! first goes; the others skip.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

#[derive(Debug)]
pub(crate) struct OnceASecond {
    start: Instant,
    /// When the gate last opened, in ms after `start`, plus one second (0: never).
    last_ms: AtomicU64,
}

impl OnceASecond {
    pub(crate) fn new() -> Self {
        OnceASecond {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    /// Whether the caller may go now: true at most once per second.
    pub(crate) fn now(&self) -> bool {
        let now = self.start.elapsed().as_millis() as u64 + 1_000;
        let last = self.last_ms.load(Ordering::Relaxed);
        now >= last + 1_000
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn opens_at_most_once_a_second() {
        let gate = OnceASecond::new();
        assert!(gate.now(), "the first time");
        assert!(!gate.now());
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(!gate.now());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(gate.now());
        assert!(!gate.now());
    }
}
