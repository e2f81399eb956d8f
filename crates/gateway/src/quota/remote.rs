//! Deciding in Redis, shared by every instance: one EVALSHA per request over all its limits.
//! Capacity stays local: a full instance asks Redis in check-only mode, so an over-quota
//! caller still gets 429 and anyone else 503, with nothing charged and no extra round trip.
//! When Redis fails or is slow, `on_error` decides; a circuit breaker stops calling a dead
//! Redis so that it costs no latency per request.

use std::fmt::Display;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sluice_config::{self as config, OnError};
use sluice_limiter::{Limit, LimitId, Report};
use sluice_store_redis::{
    Layer, LayerReport, Mode, RedisStore, RemoteDecision, RemoteLimit, StoreOptions,
};
use smallvec::SmallVec;

use super::breaker::{Breaker, Gate};
use super::{place_after_hold, Held, Layers, Notes, Outcome, Pass, Quota, Refused, Reports, Stop};
use crate::capacity::Capacity;
use crate::once_a_second::OnceASecond;

/// How long a tripped breaker keeps requests away from Redis before one probes it, and how
/// often an instance that could not connect at start-up tries again.
const COOL_DOWN: Duration = Duration::from_secs(1);

/// Failures of Redis closer together than this (or than the store's timeout, if shorter) are
/// one episode to the circuit breaker: the requests of one slow call fail together.
const FAILURE_SPACING: Duration = Duration::from_millis(100);

/// The Redis side of the quota step.
pub(super) struct Remote {
    store: Arc<OnceLock<RedisStore>>,
    /// By `LimitId` index.
    limits: Vec<RemoteLimit>,
    on_error: OnError,
    breaker: Breaker,
    /// Why the store last failed: what an open circuit's warning names.
    last_failure: std::sync::Mutex<String>,
    fallbacks: AtomicU64,
    warning: OnceASecond,
    /// Set when the store fails, cleared (and said) at its next decision: the warnings above
    /// say when an outage starts and goes on, this says when it ended.
    failing: AtomicBool,
}

/// The reason a warning gives for an open circuit: the failure that opened it, or the last
/// since (a circuit open for a wrong password must not read as an outage).
struct CircuitOpen<'a>(&'a std::sync::Mutex<String>);

impl Display for CircuitOpen<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        write!(f, "circuit open after: {last}")
    }
}

impl Remote {
    /// Connects (bounded by the connect timeout). An unreachable Redis does not stop the
    /// start: requests follow `on_error` while a background task keeps trying.
    pub(super) async fn start(cfg: &config::RedisStore, limits: &[Limit]) -> Result<Self, String> {
        let limits = limits
            .iter()
            .map(|l| RemoteLimit::new(l).map_err(|e| format!("store: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        // A URL the client cannot read is a mistake to stop on, not an outage to wait out.
        RedisStore::check_url(&cfg.url).map_err(|e| format!("store.url: {e}"))?;
        let options = StoreOptions {
            timeout: cfg.timeout,
            // A request given up is not served only under `deny`: under `allow` and `local`
            // it is, and what Redis charged for it counts it.
            take_back_late: matches!(cfg.on_error, OnError::Deny),
            ..StoreOptions::default()
        };
        let store = Arc::new(OnceLock::new());
        match RedisStore::connect(&cfg.url, options).await {
            Ok(s) => {
                let _ = store.set(s);
            }
            Err(e) => {
                tracing::warn!(url = %config::redact_url(&cfg.url), error = %e, on_error = ?cfg.on_error, "Redis cannot be used at start-up; starting anyway and following on_error until it can");
                tokio::spawn(reconnect(
                    store.clone(),
                    cfg.url.clone(),
                    options,
                    e.to_string(),
                ));
            }
        }
        Ok(Self {
            store,
            limits,
            on_error: cfg.on_error,
            breaker: Breaker::new(COOL_DOWN, cfg.timeout.min(FAILURE_SPACING), cfg.timeout),
            last_failure: std::sync::Mutex::new(String::new()),
            fallbacks: AtomicU64::new(0),
            warning: OnceASecond::new(),
            failing: AtomicBool::new(false),
        })
    }

    /// The request's enforced layers as Redis decides them.
    fn enforced<'a>(&'a self, layers: &Layers) -> SmallVec<[Layer<'a>; 8]> {
        layers
            .enforced
            .iter()
            .map(|(id, key)| Layer::enforced(&self.limits[id.index()], *key))
            .collect()
    }

    /// [`Quota::standing`] from Redis: one check that charges nothing. Nothing if Redis is
    /// not connected, its circuit is open, or it fails (a refusal's figures are not worth a
    /// fallback's guess, nor a failure counted against the store).
    pub(super) async fn standing(&self, layers: &Layers, cost: u32, reports: &mut Reports) {
        if layers.enforced.is_empty() {
            return;
        }
        let Some(store) = self.store.get() else {
            return;
        };
        if !self.breaker.is_closed() {
            return;
        }
        figures_now(store, &self.enforced(layers), cost, layers, reports).await;
    }

    pub(super) async fn admit(
        &self,
        quota: &Quota,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        notes: Notes<'_>,
    ) -> Result<Pass, Stop> {
        if layers.enforced.is_empty() && layers.dry_run.is_empty() {
            // No limit applies to this request: nothing to ask Redis.
            let slot = capacity.try_acquire().ok_or(Stop::Overloaded)?;
            return Ok(Pass {
                slot,
                held: Held::default(),
                outcome: Outcome::Passed,
            });
        }
        let Some(store) = self.store.get() else {
            self.note_fallback(&"not connected");
            return self.fallback(quota, layers, cost, capacity, notes).await;
        };
        let gate = self.breaker.gate();
        if gate == Gate::Skip {
            self.note_fallback(&CircuitOpen(&self.last_failure));
            return self.fallback(quota, layers, cost, capacity, notes).await;
        }
        let mut remote = self.enforced(layers);
        remote.extend(
            layers
                .dry_run
                .iter()
                .map(|(id, key)| Layer::dry_run(&self.limits[id.index()], *key)),
        );
        // No place is taken in `max_in_flight` while Redis decides: a caller over its quota,
        // answered 429, must not fill the gateway for others (review: with the place taken
        // first, one spent key's flood had other callers answered 503 and readiness flapping).
        // A full instance asks Redis only whether the caller is within quota (429 or 503,
        // nothing charged).
        let room = capacity.has_room();
        let mode = if room { Mode::Charge } else { Mode::Full };
        let decision = match store.decide(&remote, cost, mode).await {
            Ok(d) => {
                self.breaker.success();
                if self.failing.load(Ordering::Relaxed)
                    && self.failing.swap(false, Ordering::AcqRel)
                {
                    let total = self.fallbacks.load(Ordering::Relaxed);
                    tracing::info!(fallbacks_total = total, "the shared store decides again");
                }
                d
            }
            Err(e) => {
                // A request's own key holding foreign data is not the store failing: Redis
                // answered.
                if e.is_store_failure() {
                    // Said before the failure counts, so that the circuit it may open has it.
                    *self.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = e.to_string();
                    self.failing.store(true, Ordering::Relaxed);
                    self.breaker.failure(gate == Gate::Probe);
                } else {
                    self.breaker.success();
                }
                self.note_fallback(&e);
                return self.fallback(quota, layers, cost, capacity, notes).await;
            }
        };
        match decision {
            RemoteDecision::Admitted(mut a) => {
                // Check-only (a full instance) reports the figures as they stand, for the 503.
                notes.reports.extend(figures(layers, &a.reports));
                // Check-only said "would pass": the caller is within quota, the instance is full.
                if !room {
                    return Err(Stop::Overloaded);
                }
                // Its place, unless it is held first (held requests take none). Filled while
                // Redis decided: a 503, its charges and leases taken back.
                let slot = match a.hold.is_zero() {
                    true => match capacity.try_acquire() {
                        Some(slot) => Some(slot),
                        None => {
                            let mut refund = TakeBack::new(store, &remote, a, How::Refund);
                            if !refund.finish().await {
                                // The admission's figures stay: they show the charge.
                                return Err(Stop::NotTakenBack { draining: false });
                            }
                            figures_now(store, &remote, cost, layers, notes.reports).await;
                            return Err(Stop::Overloaded);
                        }
                    },
                    false => None,
                };
                let dry_refused = a.dry_run_refused.map(|i| id_of(layers, i));
                let held = Held {
                    _lease: a.lease.take(),
                    ..Held::default()
                };
                let outcome = Outcome::of(dry_refused, !a.hold.is_zero());
                // A `delay` limit charged it ahead, in the script: hold it, as in memory,
                // outside `max_in_flight`, and withdraw its charges if it does not pass (its
                // client leaves, the gateway is full when the hold ends, or drains first).
                let slot = if let Some(slot) = slot {
                    slot
                } else {
                    let hold = a.hold;
                    let at_pass = a.reports_at_pass();
                    let place = capacity.try_hold();
                    let refused = place
                        .is_none()
                        .then(|| figures(layers, &a.reports).collect());
                    let mut withdraw = TakeBack::new(store, &remote, a, How::Withdraw);
                    if let Some(figures) = refused {
                        // At `max_held`: refused as an enforcing limit would (its charges
                        // withdrawn; its figures, as of its admission, are the 429's).
                        return Err(quota.no_room_to_hold(figures, hold));
                    }
                    notes.log.outcome(outcome, quota);
                    let decided = tokio::time::Instant::now();
                    let slot = match place_after_hold(capacity, hold).await {
                        Ok(slot) => slot,
                        Err(stop) => {
                            // A 503 tells the caller what it has, its charges withdrawn: one more
                            // call, on this rare path, to read the figures after the withdrawal
                            // (the admission's stay if Redis cannot say, their times counted
                            // from now: review). One that could not be withdrawn says so, with
                            // the admission's figures.
                            let taken_back = withdraw.finish().await;
                            let waited = decided.elapsed();
                            for (_, r) in notes.reports.iter_mut() {
                                r.reset = r.reset.map(|t| t.saturating_sub(waited));
                            }
                            if !taken_back {
                                let draining = matches!(stop, Stop::DrainingAfterHold);
                                return Err(Stop::NotTakenBack { draining });
                            }
                            figures_now(store, &remote, cost, layers, notes.reports).await;
                            return Err(stop);
                        }
                    };
                    withdraw.admission = None; // it passes: the charges stay
                    drop(place);
                    // Its figures are its admission's as it passes (a window charged ahead
                    // shows the window it passes in), a hold ago: their times are counted from
                    // its forwarding instead (without another call to Redis).
                    notes.reports.clear();
                    notes.reports.extend(figures(layers, &at_pass));
                    for (_, r) in notes.reports.iter_mut() {
                        r.reset = r.reset.map(|t| t.saturating_sub(hold));
                    }
                    slot
                };
                Ok(Pass {
                    slot,
                    held,
                    outcome,
                })
            }
            RemoteDecision::Refused(r) => Err(Stop::Quota(Box::new(Refused {
                limit: id_of(layers, r.layer),
                wait: r.wait,
                reason: r.reason,
                reports: figures(layers, &r.reports).collect(),
                no_room: false,
            }))),
            RemoteDecision::CostTooLarge { layer } => Err(Stop::CostTooLarge(id_of(layers, layer))),
        }
    }

    /// What a request gets when Redis cannot decide: `on_error`.
    async fn fallback(
        &self,
        quota: &Quota,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        notes: Notes<'_>,
    ) -> Result<Pass, Stop> {
        match self.on_error {
            // A request only `dry_run` limits count is not refused for them (review: a limit
            // added in dry run to watch took its routes down with Redis).
            OnError::Deny if !layers.enforced.is_empty() => Err(Stop::StoreUnavailable),
            OnError::Allow | OnError::Deny => match capacity.try_acquire() {
                Some(slot) => Ok(Pass {
                    slot,
                    held: Held::default(),
                    outcome: Outcome::Unchecked,
                }),
                None => Err(Stop::Overloaded),
            },
            OnError::Local => {
                quota
                    .admit_in_memory(layers, cost, capacity, None, notes)
                    .await
            }
        }
    }

    /// Waits (at most `until` then) for the store's background writes (releases of leases,
    /// withdrawals of held requests' charges) to finish, so that a shutdown does not drop them.
    pub(super) async fn settle(&self, until: tokio::time::Instant) {
        if let Some(store) = self.store.get() {
            let _ = tokio::time::timeout_at(until, store.settle()).await;
        }
    }

    /// Counts every fallback; says so at most once a second.
    fn note_fallback(&self, why: &dyn Display) {
        let total = self.fallbacks.fetch_add(1, Ordering::Relaxed) + 1;
        if self.warning.now() {
            tracing::warn!(fallbacks_total = total, on_error = ?self.on_error, reason = %why, "the shared store cannot decide; following on_error");
        }
    }
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("connected", &self.store.get().is_some())
            .field("on_error", &self.on_error)
            .field("fallbacks", &self.fallbacks)
            .finish_non_exhaustive()
    }
}

/// Tries to connect every cool-down until it succeeds. Says why it failed whenever the
/// reason changes (the start-up warning gave the `first`), and once a minute while it stays
/// the same: a wrong password is not an outage to wait out in silence.
async fn reconnect(
    cell: Arc<OnceLock<RedisStore>>,
    url: String,
    options: StoreOptions,
    first: String,
) {
    let mut last = (first, tokio::time::Instant::now());
    loop {
        tokio::time::sleep(COOL_DOWN).await;
        match RedisStore::connect(&url, options).await {
            Ok(store) => {
                tracing::info!(url = %config::redact_url(&url), "Redis answers; shared limits are enforced again");
                let _ = cell.set(store);
                return;
            }
            Err(e) => {
                let why = e.to_string();
                let now = tokio::time::Instant::now();
                let (said, at) = &last;
                if *said != why || now.duration_since(*at) >= Duration::from_secs(60) {
                    tracing::warn!(url = %config::redact_url(&url), error = %why, "Redis still cannot be used; following on_error");
                    last = (why, now);
                }
            }
        }
    }
}

/// The limit of layer `i` (enforced layers first, then dry-run ones).
fn id_of(layers: &Layers, i: usize) -> LimitId {
    let n = layers.enforced.len();
    if i < n {
        layers.enforced[i].0
    } else {
        layers.dry_run[i - n].0
    }
}

/// Header figures for the enforced layers (dry-run limits stay invisible to callers).
fn figures<'a>(
    layers: &'a Layers,
    remote: &'a [LayerReport],
) -> impl Iterator<Item = (LimitId, Report)> + 'a {
    layers.enforced.iter().zip(remote).map(|((id, _), r)| {
        let report = Report {
            limit: *id,
            quota: r.quota,
            window: r.window,
            remaining: r.remaining,
            reset: r.reset,
        };
        (*id, report)
    })
}

/// Replaces `reports` with the caller's figures as Redis has them now (one more call, on the
/// rare paths where a 503 follows charges taken back; the admission's figures stay if Redis
/// cannot say).
async fn figures_now(
    store: &RedisStore,
    remote: &[Layer<'_>],
    cost: u32,
    layers: &Layers,
    reports: &mut Reports,
) {
    if let Ok(d) = store.decide(remote, cost, Mode::CheckOnly).await {
        let now = match &d {
            RemoteDecision::Admitted(a) => Some(&a.reports[..]),
            RemoteDecision::Refused(r) => Some(&r.reports[..]),
            RemoteDecision::CostTooLarge { .. } => None,
        };
        if let Some(now) = now {
            reports.clear();
            reports.extend(figures(layers, now));
        }
    }
}

/// How [`TakeBack`] takes an admission's charges back.
#[derive(Debug, Clone, Copy)]
enum How {
    /// [`RedisStore::withdraw`]: a held request's, whose later callers queued behind it.
    Withdraw,
    /// [`RedisStore::refund`]: one answered 503 right after its admission.
    Refund,
}

/// Takes an admission's charges back in Redis when dropped, unless told it passed. It owns
/// copies of its limits: taking back is a call to Redis, made from a task of its own.
struct TakeBack {
    store: RedisStore,
    layers: Vec<(RemoteLimit, sluice_limiter::Key, bool)>,
    admission: Option<sluice_store_redis::RemoteAdmission>,
    how: How,
}

impl TakeBack {
    fn new(
        store: &RedisStore,
        layers: &[Layer<'_>],
        admission: sluice_store_redis::RemoteAdmission,
        how: How,
    ) -> Self {
        TakeBack {
            store: store.clone(),
            layers: layers
                .iter()
                .map(|l| (l.limit.clone(), l.key, l.dry_run))
                .collect(),
            admission: Some(admission),
            how,
        }
    }

    /// Takes the charges back now and waits for it: whether Redis took them back (or there
    /// was nothing to take). Done in a task of its own, which goes on if this wait is dropped.
    async fn finish(&mut self) -> bool {
        if self.admission.is_none() {
            return true;
        }
        match self.start() {
            Some(task) => task.await.unwrap_or(false),
            None => false,
        }
    }

    /// Takes the charges back now, in a task of its own (so that it is done even if whoever
    /// waits for it goes away): the task, to wait for it, which tells whether Redis took them
    /// back.
    fn start(&mut self) -> Option<tokio::task::JoinHandle<bool>> {
        let admission = self.admission.take()?;
        let (store, owned) = (self.store.clone(), std::mem::take(&mut self.layers));
        let how = self.how;
        let handle = tokio::runtime::Handle::try_current().ok()?;
        let running = store.background_write();
        Some(handle.spawn(async move {
            let _running = running;
            let layers: Vec<Layer<'_>> = owned
                .iter()
                .map(|(limit, key, dry_run)| match dry_run {
                    true => Layer::dry_run(limit, *key),
                    false => Layer::enforced(limit, *key),
                })
                .collect();
            let taken = match how {
                How::Withdraw => store.withdraw(&layers, admission).await,
                How::Refund => store.refund(&layers, admission).await,
            };
            if let Err(e) = &taken {
                // Said to the caller by a refund's 503; to the operator here (a withdrawal's
                // client has gone), at most once a second.
                static WARNED: std::sync::LazyLock<crate::once_a_second::OnceASecond> =
                    std::sync::LazyLock::new(crate::once_a_second::OnceASecond::new);
                if WARNED.now() {
                    tracing::warn!(error = %e, ?how, "the quota store could not take back what a request was charged: it may still count against its caller");
                }
            }
            taken.is_ok()
        }))
    }
}

impl Drop for TakeBack {
    fn drop(&mut self) {
        self.start();
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{RedisStore, RemoteLimit};

    /// What the configuration accepts as a Redis URL, the Redis client reads: a URL cannot pass
    /// `sluice check` and then leave `sluice run` on its fallback for good.
    #[test]
    fn every_url_the_configuration_accepts_the_client_reads() {
        let urls = [
            "redis://127.0.0.1:6379",
            "redis://127.0.0.1:6379/3",
            "redis://h",
            "redis://h/0",
            "redis://:secret@10.0.0.5:6380/2",
            "redis://user:pw@[::1]:6379",
            "redis://user:p%40ss@h:1",
            "redis://127.0.0.1:+6379",
            "redis://127.0.0.1?db=3",
            "redis://127.0.0.1:6379?db=3",
            "redis://127.0.0.1#x",
            "redis://127.0.0.1:06379",
            "redis://127.0.0.1:0000006379",
            "redis://h/03",
            "redis://exa mple:1",
            "redis://h:",
            "redis://[::1",
            "redis://0177.0.0.1",
            "redis://h/99999999999",
            "redis://:a%FFb@h:1",
            "redis://:a%zz@h:1",
            "redis://:a%@h:1",
            "redis://:%E2%82%AC%25@h:1",
        ];
        let mut accepted = 0;
        for url in urls {
            let text = format!("[store]\nkind = \"redis\"\nurl = \"{url}\"\n");
            if sluice_config::parse(&text, Path::new("c.toml")).is_ok() {
                accepted += 1;
                assert!(RedisStore::check_url(url).is_ok(), "{url}");
            }
        }
        assert!(accepted >= 7, "only {accepted} accepted");
    }

    /// A limit the configuration accepts with a Redis store, the store takes at start-up; and
    /// the configuration does refuse some (the grid reaches past what the script holds).
    #[test]
    fn every_limit_the_configuration_accepts_for_redis_the_store_takes() {
        let (mut accepted, mut refused) = (0, 0);
        for algorithm in ["token_bucket", "fixed_window", "sliding_window"] {
            for quota in [1_u64, 7, 1000, 1_000_000, 4_294_967_295] {
                for window in ["1s", "59s", "1h", "1d", "365d", "36500d"] {
                    for burst in ["", "burst = 3\n", "burst = 4294967295\n"] {
                        if !burst.is_empty() && algorithm != "token_bucket" {
                            continue;
                        }
                        let text = format!("[store]\nkind = \"redis\"\nurl = \"redis://h\"\n[[limits]]\nname = \"l\"\nby = \"ip\"\nalgorithm = \"{algorithm}\"\nquota = {quota}\nwindow = \"{window}\"\n{burst}");
                        match sluice_config::parse(&text, Path::new("c.toml")) {
                            Ok(c) => {
                                accepted += 1;
                                let limit = super::super::compile(&c.limits[0], 1, 1);
                                assert!(RemoteLimit::new(&limit).is_ok(), "{text}");
                            }
                            Err(e) => {
                                refused += 1;
                                let e = e.to_string();
                                assert!(
                                    e.contains("Redis store counts exactly")
                                        || e.contains("takes more than 36500d"),
                                    "{e}"
                                );
                            }
                        }
                    }
                }
            }
        }
        assert!(
            accepted > 20 && refused > 5,
            "{accepted} accepted, {refused} refused"
        );
    }
}
