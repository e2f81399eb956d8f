//! `header_timeout`: a connection with no request in flight must send its next request head
//! within the timeout of becoming idle (of connecting, or of its last response ending), or it
//! is closed (gracefully: HTTP/2 first sends `GOAWAY`; see `server::drive`). This stops clients that connect and send nothing, or half a head, from holding
//! connections (slowloris), over HTTP/1.1 and HTTP/2 alike.
//!
//! One timer per connection, which wakes at most once per timeout period to look at the
//! connection's state; a request only counts itself in and out. It replaces hyper's HTTP/1
//! header timeout, which covers neither HTTP/2 nor a connection that sends nothing at all
//! (the protocol detection waits for the first bytes before hyper's timer starts; that took a
//! `peek` of our own). Measured with callgrind, a forwarded request costs the same either way:
//! hyper made and dropped a timer per request, this one polls the connection's timer when the
//! connection waits.

use std::pin::pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// One connection's state for its header timeout.
#[derive(Debug)]
pub(crate) struct HeadTimeout {
    timeout: Duration,
    /// When the connection was accepted; `idle_since` counts from here.
    start: Instant,
    /// Requests whose heads have arrived and whose responses have not ended.
    in_flight: AtomicUsize,
    /// When the last response ended, in nanoseconds after `start` (0: none yet).
    idle_since: AtomicU64,
}

impl HeadTimeout {
    pub(crate) fn new(timeout: Duration) -> Arc<Self> {
        Arc::new(HeadTimeout {
            timeout,
            start: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
        })
    }

    /// A request's head has arrived: the connection is busy until the returned guard drops
    /// (when the response ends, or the request is abandoned).
    pub(crate) fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(Arc::clone(self))
    }

    /// Whether a request is in flight on the connection.
    pub(crate) fn is_busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0
    }

    /// Resolves when the connection has been idle for the timeout: then close it.
    pub(crate) async fn expired(&self) {
        let mut timer = pin!(tokio::time::sleep_until(self.idle_deadline()));
        loop {
            timer.as_mut().await;
            let next = if !self.is_busy() {
                let deadline = self.idle_deadline();
                if Instant::now() >= deadline {
                    return;
                }
                deadline
            } else {
                // Busy: no head is awaited now; look again a timeout later.
                Instant::now() + self.timeout
            };
            timer.as_mut().reset(next);
        }
    }

    fn idle_deadline(&self) -> Instant {
        let idle_since = Duration::from_nanos(self.idle_since.load(Ordering::Acquire));
        self.start + idle_since + self.timeout
    }
}

/// A request in flight on its connection; dropping it makes the connection idle again (if it
/// was the last).
#[derive(Debug)]
pub(crate) struct Busy(Arc<HeadTimeout>);

impl Drop for Busy {
    fn drop(&mut self) {
        let t = &self.0;
        let now = u64::try_from(t.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // Before the count: whoever sees no request in flight sees this end too.
        t.idle_since.fetch_max(now, Ordering::AcqRel);
        t.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;

    const T: Duration = Duration::from_secs(10);

    /// Whether `expired` has resolved after `after` more (paused) time.
    async fn expired_after(
        f: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
        after: Duration,
    ) -> bool {
        tokio::time::timeout(after, f.as_mut()).await.is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_expires_a_timeout_after_it_started() {
        let t = HeadTimeout::new(T);
        let mut expired = pin!(t.expired());
        assert!(!expired_after(&mut expired, T - Duration::from_millis(1)).await);
        assert!(expired_after(&mut expired, Duration::from_millis(2)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_connection_never_expires_and_an_idle_one_counts_from_its_last_response() {
        let t = HeadTimeout::new(T);
        let mut expired = pin!(t.expired());
        tokio::time::advance(Duration::from_secs(5)).await;
        let first = t.begin();
        let second = t.begin();
        // Busy far longer than the timeout: a slow upstream is not the client's head.
        assert!(!expired_after(&mut expired, T * 3).await);
        drop(first);
        assert!(
            !expired_after(&mut expired, T * 2).await,
            "one still in flight"
        );
        drop(second);
        assert!(!expired_after(&mut expired, T - Duration::from_millis(1)).await);
        assert!(expired_after(&mut expired, Duration::from_millis(2)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn each_response_end_moves_the_deadline() {
        let t = HeadTimeout::new(T);
        let mut expired = pin!(t.expired());
        for _ in 0..5 {
            assert!(!expired_after(&mut expired, T - Duration::from_secs(1)).await);
            drop(t.begin());
        }
        assert!(!expired_after(&mut expired, T - Duration::from_millis(1)).await);
        assert!(expired_after(&mut expired, Duration::from_millis(2)).await);
    }
}
