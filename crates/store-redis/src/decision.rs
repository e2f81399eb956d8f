//! What a remote decision returns: the same outcomes and figures as `sluice_limiter`'s
//! `Decision`, indexed by the position of each layer in the request.

use std::sync::Arc;
use std::time::Duration;

use sluice_limiter::{Nanos, RefusalReason};

use crate::store::RedisStore;

/// Why the refusing layer refused: [`RefusalReason`] of the in-memory limiter.
pub type RemoteRefusalReason = RefusalReason;

/// One layer's figures, as the `RateLimit` header's `q`, `w`, `r`, `t` (see
/// `sluice_limiter::Report`), plus its own part in a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerReport {
    /// `q`: the quota (a token bucket's burst; a concurrency limit's slots).
    pub quota: u32,
    /// `w`: the window (a token bucket's refill time); `None` for concurrency.
    pub window: Option<Duration>,
    /// `r`: quota remaining after this request (0 while blocked).
    pub remaining: u32,
    /// `t`: after an admission, the time until the remaining quota grows (zero when full);
    /// otherwise, for a layer that would not admit the request, the time until it would (for
    /// one that would, as after an admission). For concurrency, as in memory: zero
    /// while a slot is free, else `None` (slots free when requests end, not with time).
    pub reset: Option<Duration>,
    /// Whether this layer refused the request (or would have, for a dry-run layer).
    pub refuses: bool,
    /// When `refuses`: this layer's own wait (`None`: a full concurrency limit).
    pub wait: Option<Duration>,
    /// When this layer's key is blocked until, if it is (including a block this request
    /// started).
    pub blocked_until: Option<Nanos>,
}

/// The outcome of [`RedisStore::decide`].
#[derive(Debug)]
#[must_use = "an admission holds concurrency leases until dropped"]
pub enum RemoteDecision {
    /// Every enforced layer admitted the request (and, unless check-only, was charged).
    Admitted(RemoteAdmission),
    /// An enforced layer refused; nothing was charged (blocks may have started).
    Refused(RemoteRefusal),
    /// The cost exceeds the capacity of layer `layer`: it can never pass.
    CostTooLarge {
        /// The first layer whose capacity is below the cost.
        layer: usize,
    },
}

/// An admitted request. Dropping it releases its concurrency leases (quota charges stay);
/// [`RedisStore::refund`] takes every charge back.
#[derive(Debug)]
pub struct RemoteAdmission {
    /// How long to hold the request before forwarding it: zero unless a limit with a
    /// `max_delay` admitted it ahead of time (its charge is made; do not decide again). The
    /// reports are as of the decision, as in memory.
    pub hold: Duration,
    /// One report per layer, in the order given (dry-run layers included).
    pub reports: Vec<LayerReport>,
    /// The first dry-run layer that refused (the one with the longest wait), if any: it was
    /// not charged, the request passes anyway.
    pub dry_run_refused: Option<usize>,
    /// Redis's clock at the decision.
    pub now: Nanos,
    pub(crate) cost: u32,
    /// Per layer: the charge's tag for a refund (a window's index; a bucket's TAT in whole us),
    /// or `None` if not charged.
    pub(crate) tags: Vec<Option<u64>>,
    /// Per layer, for a held request only (else empty).
    pub(crate) held: Vec<HeldLayer>,
    /// The request's concurrency leases, if it holds any.
    pub lease: Option<Lease>,
}

/// What a held request's admission says of one layer beyond its figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeldLayer {
    /// The state a window charged ahead replaced (`-1`s: none), to put back when taken back
    /// if nobody was charged since.
    pub(crate) replaced: [i64; 3],
    /// For a fixed or sliding window or a token bucket, its `remaining` and `reset` as the
    /// request passes, from the state the decision left, the reset counted from the decision;
    /// `None` (concurrency) where the decision's figures stand. See
    /// [`RemoteAdmission::reports_at_pass`].
    pub(crate) at_pass: Option<(u32, Option<Duration>)>,
}

impl RemoteAdmission {
    /// The reports as the request passes, at the end of its hold: a window shows the window
    /// the request passes in and a token bucket what refilled during the hold, where
    /// [`RemoteAdmission::reports`] are as of the decision (a window charged ahead shown
    /// spent). Concurrency limits' are the decision's. Resets count from the decision, as in
    /// `reports`.
    pub fn reports_at_pass(&self) -> Vec<LayerReport> {
        let mut reports = self.reports.clone();
        for (report, held) in reports.iter_mut().zip(&self.held) {
            if let Some((remaining, reset)) = held.at_pass {
                report.remaining = remaining;
                report.reset = reset;
            }
        }
        reports
    }
}

/// A refused request: nothing was charged.
#[derive(Debug, Clone)]
pub struct RemoteRefusal {
    /// The refusing layer with the longest wait.
    pub layer: usize,
    /// How long until the request would pass every refusing layer (to the microsecond,
    /// rounded up); `None` when only concurrency layers refused.
    pub wait: Option<Duration>,
    /// Why [`RemoteRefusal::layer`] refused.
    pub reason: RemoteRefusalReason,
    /// One report per layer, in the order given.
    pub reports: Vec<LayerReport>,
    /// Redis's clock at the decision.
    pub now: Nanos,
}

impl RemoteRefusal {
    /// Every layer that refused, with its own wait.
    pub fn refusing(&self) -> impl Iterator<Item = (usize, Option<Duration>)> + '_ {
        self.reports
            .iter()
            .enumerate()
            .filter(|(_, r)| r.refuses)
            .map(|(i, r)| (i, r.wait))
    }
}

impl RemoteDecision {
    /// Whether the request was admitted.
    pub fn is_admitted(&self) -> bool {
        matches!(self, RemoteDecision::Admitted(_))
    }
}

/// A request's concurrency slots in Redis: one lease id in the ZSET of each concurrency
/// layer. While it is held, the store renews it every third of its lease TTL (it is in the
/// store's register of held leases), so a request may run for as long as it likes (a stream,
/// a tunnel) and keep its slots. Dropping it leaves the register and releases the slots with
/// one pipelined round trip (spawned on the current tokio runtime); if that fails, or the
/// instance dies, the lease expires on its own within the lease TTL.
#[derive(Debug)]
pub struct Lease {
    pub(crate) store: Option<RedisStore>,
    /// Shared with the store's register while held.
    pub(crate) slots: Arc<LeaseSlots>,
    /// Its entry in the store's register of held leases.
    pub(crate) n: u64,
}

/// What a lease holds: its id (the ZSET member) in each of its keys.
#[derive(Debug)]
pub(crate) struct LeaseSlots {
    pub(crate) id: String,
    pub(crate) keys: Vec<String>,
}

impl Lease {
    /// Releases the slots now and waits for Redis to confirm.
    pub async fn release(mut self) -> Result<(), crate::StoreError> {
        self.leave_register();
        match self.store.take() {
            Some(store) => store.release(&self.slots).await,
            None => Ok(()),
        }
    }

    /// The lease id (the ZSET member).
    pub fn id(&self) -> &str {
        &self.slots.id
    }

    /// Stops the renewals.
    pub(crate) fn leave_register(&self) {
        if let Some(store) = &self.store {
            store.held_leases().remove(self.n);
        }
    }
}

/// When a dropped lease's release is tried again, directly (not through the batcher), after
/// its first try: at once, then again after each failure.
const RELEASE_RETRIES: [std::time::Duration; 4] = [
    std::time::Duration::ZERO,
    std::time::Duration::from_millis(250),
    std::time::Duration::from_secs(1),
    std::time::Duration::from_secs(5),
];

impl Drop for Lease {
    fn drop(&mut self) {
        self.leave_register();
        let Some(store) = self.store.take() else {
            return;
        };
        let slots = Arc::clone(&self.slots);
        release_later(store, slots);
    }
}

/// Releases `slots` in the background. The first try is handed to the store's batcher at
/// once, so that it reaches Redis before any decision asked for after this call (the same
/// caller's next request). A release that fails (Redis unreachable as the response ends) is
/// tried again a few times over about six seconds, so that the caller's slot is not held
/// until the lease expires (the store's lease TTL) because of a short outage. Removing a
/// lease is idempotent.
pub(crate) fn release_later(store: RedisStore, slots: Arc<LeaseSlots>) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        let running = store.background_write();
        let first = store.release_first(&slots);
        handle.spawn(async move {
            let _running = running;
            if let Some(answer) = first {
                if matches!(answer.await, Ok(Ok((figures, _))) if figures.first() == Some(&3)) {
                    return;
                }
            }
            for wait in RELEASE_RETRIES {
                // A shutdown waiting for this cuts the waits short: one more try, then no more.
                let closing = store.closing();
                store.retry_after(wait).await;
                if store.release(&slots).await.is_ok() || closing {
                    return;
                }
            }
        });
    }
}
