//! The capacity step: how much admitted work is unfinished, and whether the gateway is full
//! or draining. Readiness reads the same numbers, so it fails exactly when admissions would.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::task::AbortHandle;

use tokio::time::Instant;

/// How long after draining starts an HTTP/2 client has to stop opening streams: the first
/// `GOAWAY` and the `PING` after it take one round trip, which is far below this on any network a
/// gateway serves.
pub(crate) const GOODBYE_HEARD: std::time::Duration = std::time::Duration::from_secs(2);

/// Counts in-flight requests against `max_in_flight`. Clones share the counts.
#[derive(Debug, Clone)]
pub(crate) struct Capacity {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    in_flight: AtomicUsize,
    max: usize,
    /// Set at the stop signal: readiness fails from then on (`gateway.drain_delay` before
    /// draining starts, or as it starts).
    stopping: AtomicBool,
    draining: AtomicBool,
    /// Woken when the last in-flight slot is released while draining.
    drained: tokio::sync::Notify,
    /// When the shutdown grace ends, once draining has started.
    grace_ends: OnceLock<Instant>,
    /// When draining started (and HTTP/2 connections were sent their first `GOAWAY`).
    drain_started: OnceLock<Instant>,
    /// Woken when draining starts, and when its grace is ended early.
    draining_started: tokio::sync::Notify,
    /// Requests held by `delay` limits now, and the most there may be (`gateway.max_held`).
    held: AtomicUsize,
    max_held: usize,
    /// Set when the grace is ended early (a second stop signal); `draining_started`'s
    /// waiters are woken then too.
    hurried: AtomicBool,
    /// Set, and its waiters woken, when the grace has ended with work still running.
    cut: AtomicBool,
    /// Requests running (in flight or held) when the first thread cut: the threads cut moments
    /// apart, and a later one would count what an earlier one has already cut.
    cut_count: std::sync::OnceLock<usize>,
    cut_now: tokio::sync::Notify,
    /// Open tunnels, aborted by a cut: a tunnel does not poll for the cut on its every wake.
    tunnels: Mutex<HashMap<u64, AbortHandle>>,
    next_tunnel: AtomicU64,
}

/// An open tunnel's entry among [`Capacity`]'s, removed when the tunnel's task drops it
/// (see [`Capacity::spawn_tunnel`]).
#[derive(Debug)]
struct TunnelEntry {
    inner: Arc<Inner>,
    id: u64,
}

impl Drop for TunnelEntry {
    fn drop(&mut self) {
        self.inner
            .tunnels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

/// A held request's place among `max_held`; given back when dropped.
#[derive(Debug)]
pub(crate) struct HeldPlace {
    inner: Arc<Inner>,
}

/// One admitted request's slot; released when dropped (response body finished, client gone).
#[derive(Debug)]
pub(crate) struct InFlight {
    inner: Arc<Inner>,
}

impl Capacity {
    pub(crate) fn new(max: usize) -> Self {
        Self::with_max_held(max, usize::MAX)
    }

    /// With at most `max_held` requests held by `delay` limits at once.
    pub(crate) fn with_max_held(max: usize, max_held: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                in_flight: AtomicUsize::new(0),
                max,
                stopping: AtomicBool::new(false),
                draining: AtomicBool::new(false),
                drained: tokio::sync::Notify::new(),
                grace_ends: OnceLock::new(),
                drain_started: OnceLock::new(),
                draining_started: tokio::sync::Notify::new(),
                held: AtomicUsize::new(0),
                max_held,
                hurried: AtomicBool::new(false),
                cut: AtomicBool::new(false),
                cut_count: std::sync::OnceLock::new(),
                cut_now: tokio::sync::Notify::new(),
                tunnels: Mutex::new(HashMap::new()),
                next_tunnel: AtomicU64::new(0),
            }),
        }
    }

    /// Takes a slot, or `None` when the gateway is full.
    pub(crate) fn try_acquire(&self) -> Option<InFlight> {
        let inner = &self.inner;
        let mut current = inner.in_flight.load(Ordering::Relaxed);
        loop {
            if current >= inner.max {
                return None;
            }
            match inner.in_flight.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Some(InFlight {
                        inner: inner.clone(),
                    })
                }
                Err(seen) => current = seen,
            }
        }
    }

    /// A place for a request held by a `delay` limit, or `None` at `max_held`. Held requests
    /// take no place in flight (a caller over its rate must not fill the gateway for others),
    /// but they are bounded: each holds its request's head and a connection or stream.
    pub(crate) fn try_hold(&self) -> Option<HeldPlace> {
        let inner = &self.inner;
        inner
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < inner.max_held).then_some(n + 1)
            })
            .ok()?;
        Some(HeldPlace {
            inner: inner.clone(),
        })
    }

    /// Ready means: not stopping (draining, or about to) and not full. Nothing else fails
    /// readiness.
    pub(crate) fn is_ready(&self) -> bool {
        !self.is_stopping() && self.has_room()
    }

    /// Fails readiness from now on, while requests are still accepted and served: the
    /// `drain_delay` before draining starts, for load balancers to see it first.
    pub(crate) fn stop_soon(&self) {
        self.inner.stopping.store(true, Ordering::Release);
    }

    /// Whether readiness fails for the stop: [`Capacity::stop_soon`] or draining.
    pub(crate) fn is_stopping(&self) -> bool {
        self.inner.stopping.load(Ordering::Acquire)
    }

    /// Whether a slot is free now (another may take it before this caller does).
    pub(crate) fn has_room(&self) -> bool {
        self.in_flight() < self.inner.max
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::Acquire)
    }

    /// Fails readiness from now on; work still in flight has until `grace_ends`.
    pub(crate) fn start_draining(&self, grace_ends: Instant) {
        let _ = self.inner.drain_started.set(Instant::now());
        let _ = self.inner.grace_ends.set(grace_ends);
        self.inner.stopping.store(true, Ordering::Release);
        self.inner.draining.store(true, Ordering::Release);
        self.inner.draining_started.notify_waiters();
    }

    /// Whether draining started more than [`GOODBYE_HEARD`] ago: an HTTP/2 stream opened
    /// since comes from a client that has had the first `GOAWAY` that long and opens streams
    /// anyway (RFC 9113 section 6.8 prohibits it), and that has not answered the `PING` after
    /// it, without which hyper never sends the `GOAWAY` that refuses new streams.
    pub(crate) fn goodbye_ignored(&self) -> bool {
        self.inner
            .drain_started
            .get()
            .is_some_and(|started| started.elapsed() >= GOODBYE_HEARD)
    }

    /// Resolves once draining has started with a grace that ends before `moment` (or was
    /// ended early by [`Capacity::end_grace_now`]); never otherwise. A request held until
    /// `moment` would be cut at exit without an answer.
    pub(crate) async fn draining_before(&self, moment: Instant) {
        loop {
            // Registered before the check, so a start (or a hurry) in between still wakes it.
            let started = self.inner.draining_started.notified();
            if self.inner.hurried.load(Ordering::Acquire) {
                return;
            }
            if let Some(&end) = self.inner.grace_ends.get() {
                if end < moment {
                    return;
                }
            }
            started.await;
        }
    }

    /// Requests held by `delay` limits now.
    pub(crate) fn held(&self) -> usize {
        self.inner.held.load(Ordering::Acquire)
    }

    /// Ends the shutdown grace now (an operator's second stop signal): every serving thread's
    /// [`Capacity::grace_over`] resolves, and what still runs is cut as at the grace's end.
    pub(crate) fn end_grace_now(&self) {
        self.inner.hurried.store(true, Ordering::Release);
        // Wakes `grace_over`, and `draining_before`, so that held requests are answered 503
        // now, as those whose hold outlasts the grace are.
        self.inner.draining_started.notify_waiters();
    }

    /// Resolves at `deadline`, the grace's end, or earlier once [`Capacity::end_grace_now`]
    /// has been called.
    pub(crate) async fn grace_over(&self, deadline: Instant) {
        let hurried = async {
            loop {
                // Registered before the check, so a hurry in between still wakes it.
                let hurry = self.inner.draining_started.notified();
                if self.inner.hurried.load(Ordering::Acquire) {
                    return;
                }
                hurry.await;
            }
        };
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => {}
            () = hurried => {}
        }
    }

    /// Ends what still runs when the shutdown grace is over: connections drop their requests
    /// and tunnels close (see [`Capacity::cut_off`]), while the runtimes still run, so that
    /// those requests' last writes to the shared store (lease releases) go out rather than
    /// being dropped with the runtime, leaving leases until they expire.
    ///
    /// How many requests were running (in flight or held) at the first cut, if there was one.
    pub(crate) fn cut_count(&self) -> Option<usize> {
        self.inner.cut_count.get().copied()
    }

    /// Returns how many requests were running (in flight or held) at the first cut.
    pub(crate) fn cut(&self) -> usize {
        let count = *self
            .inner
            .cut_count
            .get_or_init(|| self.in_flight() + self.held());
        self.inner.cut.store(true, Ordering::Release);
        self.inner.cut_now.notify_waiters();
        let tunnels =
            std::mem::take(&mut *self.inner.tunnels.lock().unwrap_or_else(|e| e.into_inner()));
        for tunnel in tunnels.into_values() {
            tunnel.abort();
        }
        count
    }

    /// Spawns a tunnel's task, tracked until it ends so that a cut aborts it (a tunnel does
    /// not poll for the cut on its every wake). Tracked right after the spawn, on the spawning
    /// thread's single-threaded runtime, so before the task first runs (and drops its entry,
    /// if it ends at once). A tunnel spawned after a cut is aborted at once.
    pub(crate) fn spawn_tunnel(
        &self,
        tunnel: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let entry = TunnelEntry {
            inner: Arc::clone(&self.inner),
            id: self.inner.next_tunnel.fetch_add(1, Ordering::Relaxed),
        };
        let id = entry.id;
        let task = tokio::spawn(async move {
            let _entry = entry;
            tunnel.await;
        });
        let mut tunnels = self.inner.tunnels.lock().unwrap_or_else(|e| e.into_inner());
        if self.is_cut() {
            task.abort();
        } else {
            tunnels.insert(id, task.abort_handle());
        }
        task
    }

    /// Whether [`Capacity::cut`] has been called.
    pub(crate) fn is_cut(&self) -> bool {
        self.inner.cut.load(Ordering::Acquire)
    }

    /// Resolves once [`Capacity::cut`] has been called. A waiter locks the notifier's list
    /// when polled: for draining connections only, never per request (tunnels, which live
    /// long and wake on every byte, are aborted instead).
    pub(crate) async fn cut_off(&self) {
        loop {
            // Registered before the check, so a cut in between still wakes it.
            let cut = self.inner.cut_now.notified();
            if self.is_cut() {
                return;
            }
            cut.await;
        }
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }

    /// Resolves once draining has started and no slot is held: every request has ended,
    /// including those whose connection hyper no longer tracks (open tunnels).
    pub(crate) async fn drained(&self) {
        loop {
            // Registered before the check, so a release in between still wakes it.
            let released = self.inner.drained.notified();
            if self.is_draining() && self.in_flight() == 0 {
                return;
            }
            released.await;
        }
    }
}

impl Drop for HeldPlace {
    fn drop(&mut self) {
        self.inner.held.fetch_sub(1, Ordering::AcqRel);
    }
}

impl InFlight {
    /// The gateway's capacity this slot belongs to.
    pub(crate) fn capacity(&self) -> Capacity {
        Capacity {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let before = self.inner.in_flight.fetch_sub(1, Ordering::AcqRel);
        if before == 1 && self.inner.draining.load(Ordering::Acquire) {
            self.inner.drained.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn full_gateway_refuses_and_turns_unready_until_a_slot_is_released() {
        let cap = Capacity::new(2);
        let a = cap.try_acquire().unwrap();
        assert!(cap.is_ready());
        let _b = cap.try_acquire().unwrap();
        assert!(!cap.is_ready());
        assert!(cap.try_acquire().is_none());
        drop(a);
        assert!(cap.is_ready());
        assert!(cap.try_acquire().is_some());
    }

    #[tokio::test]
    async fn drained_waits_for_the_last_slot_once_draining() {
        let cap = Arc::new(Capacity::new(2));
        let (a, b) = (cap.try_acquire().unwrap(), cap.try_acquire().unwrap());
        cap.start_draining(Instant::now());
        let waiter = {
            let cap = cap.clone();
            tokio::spawn(async move { cap.drained().await })
        };
        drop(a);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one slot still held");
        drop(b);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("drained once the last slot went")
            .unwrap();
    }

    #[tokio::test]
    async fn a_cut_aborts_the_tracked_tunnels_and_an_ended_one_leaves_no_entry() {
        let cap = Capacity::new(2);
        let spawn = |cap: &Capacity| cap.spawn_tunnel(std::future::pending());
        let (open, ended) = (spawn(&cap), spawn(&cap));
        ended.abort();
        assert!(ended.await.unwrap_err().is_cancelled());
        assert_eq!(
            cap.inner.tunnels.lock().unwrap().len(),
            1,
            "the ended one's entry went"
        );
        cap.cut();
        assert!(open.await.unwrap_err().is_cancelled(), "aborted by the cut");
        // One spawned after the cut does not outlive it.
        let late = spawn(&cap);
        assert!(late.await.unwrap_err().is_cancelled());
        assert!(cap.inner.tunnels.lock().unwrap().is_empty());
    }

    /// What the cut counts is what ran at the first thread's cut: a later thread's count
    /// (each thread cuts, moments apart) missed what the first had already cut (review: the
    /// warning said `requests: 0` while a tunnel was cut).
    #[test]
    fn the_cut_counts_what_ran_at_the_first_cut() {
        let cap = Capacity::new(4);
        let (a, b) = (cap.try_acquire().unwrap(), cap.try_acquire().unwrap());
        assert_eq!(cap.cut(), 2);
        drop((a, b));
        assert_eq!(cap.cut(), 2, "a later thread's cut");
    }

    #[tokio::test]
    async fn cut_off_resolves_for_waiters_before_and_after_the_cut() {
        let cap = Arc::new(Capacity::new(2));
        let early = {
            let cap = cap.clone();
            tokio::spawn(async move { cap.cut_off().await })
        };
        tokio::task::yield_now().await;
        assert!(!early.is_finished(), "not cut yet");
        cap.cut();
        early.await.unwrap();
        // One that starts waiting after the cut does not wait.
        tokio::time::timeout(Duration::from_secs(5), cap.cut_off())
            .await
            .expect("already cut");
    }

    #[tokio::test(start_paused = true)]
    async fn draining_before_a_moment_resolves_only_for_a_grace_that_ends_before_it() {
        let cap = Arc::new(Capacity::new(2));
        let now = Instant::now();
        let (soon, late) = (now + Duration::from_secs(5), now + Duration::from_secs(20));
        let before = |moment| {
            let cap = cap.clone();
            tokio::spawn(async move { cap.draining_before(moment).await })
        };
        let (soon, late) = (before(soon), before(late));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!soon.is_finished() && !late.is_finished(), "not draining");
        cap.start_draining(Instant::now() - Duration::from_secs(50));
        tokio::time::timeout(Duration::from_secs(1), late)
            .await
            .expect("the grace ends before the late moment")
            .unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!soon.is_finished(), "the grace ends after the early moment");
        // Already draining when asked.
        assert!(tokio::time::timeout(
            Duration::from_secs(1),
            cap.draining_before(now + Duration::from_secs(11))
        )
        .await
        .is_ok());
    }

    #[test]
    fn draining_fails_readiness_without_refusing_in_flight_work() {
        let cap = Capacity::new(2);
        let slot = cap.try_acquire().unwrap();
        cap.start_draining(Instant::now());
        assert!(!cap.is_ready());
        drop(slot);
        assert_eq!(cap.in_flight(), 0);
    }
}
