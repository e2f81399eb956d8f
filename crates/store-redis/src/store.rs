//! The store: a multiplexed, reconnecting connection, the script's SHA, and the calls that
//! use them, each bounded by the store's timeout.
//!
//! Decisions, refunds and the first try of each lease's release go through one task, the
//! batcher: it takes every request waiting at that moment (up to [`MAX_BATCH`]) into one
//! pipeline (the releases, then one `EVALSHA` for the rest), sends it without waiting for the
//! previous ones to answer, and hands each request its part of the reply. A request alone
//! still costs one round trip; under load, requests share them, and Redis reads and writes
//! each key once per call instead of once per request. Nothing waits for a batch to fill: a
//! request that arrives while Redis is idle is sent at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use sluice_limiter::{Clock, Key, Nanos, SystemClock};
use tokio::sync::{mpsc, oneshot};

use crate::decision::{Lease, LeaseSlots, RemoteDecision};
use crate::script::Part;
use crate::{script, RemoteAdmission, RemoteLimit, StoreError};

/// The most requests one `EVALSHA` carries: it bounds the time Redis spends in one call (a few
/// milliseconds at most) and the size of its arguments.
pub(crate) const MAX_BATCH: usize = 64;

/// How the store talks to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreOptions {
    /// The most one call may take, round trip included (default 50 ms).
    pub timeout: Duration,
    /// The most connecting at start-up may take (default 1 s).
    pub connect_timeout: Duration,
    /// How long a concurrency lease lives if never released or renewed, e.g. because its
    /// instance crashed (default 60 s). A held lease is renewed every third of it, so this
    /// bounds how long a dead instance's slots stay taken, not how long a request may run.
    pub lease_ttl: Duration,
    /// Whether what Redis charged for a decision answered after `timeout` is taken back when
    /// its answer comes (waited for up to 5 s more): right when a request given up is not
    /// served (the gateway's `on_error = "deny"`), not when it is served anyway (then the
    /// charge counts it). Default true. A decision whose caller stopped waiting for another
    /// reason (its client left) is taken back whatever this says.
    pub take_back_late: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            timeout: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(1),
            lease_ttl: Duration::from_secs(60),
            take_back_late: true,
        }
    }
}

/// Whether a decision charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Decide and, if admitted, charge every layer (refusals start blocks).
    Charge,
    /// Decide without writing anything, e.g. to read a caller's figures.
    CheckOnly,
    /// Decide for an instance that is full, so that a caller over quota still gets 429 and
    /// anyone else 503, with nothing charged and no extra round trip; a refusal starts blocks
    /// (`block_for`) as with [`Mode::Charge`], as in memory, where such a request is decided
    /// before the gateway finds itself full.
    Full,
}

/// One `(limit, key)` of a request.
#[derive(Debug, Clone, Copy)]
pub struct Layer<'a> {
    /// The limit.
    pub limit: &'a RemoteLimit,
    /// The caller's keyed hash under that limit.
    pub key: Key,
    /// A dry-run layer is decided after the enforced ones admit, all or nothing among the
    /// dry-run layers, and never refuses the request.
    pub dry_run: bool,
}

impl<'a> Layer<'a> {
    /// An enforced layer.
    pub fn enforced(limit: &'a RemoteLimit, key: Key) -> Self {
        Layer {
            limit,
            key,
            dry_run: false,
        }
    }

    /// A dry-run layer.
    pub fn dry_run(limit: &'a RemoteLimit, key: Key) -> Self {
        Layer {
            limit,
            key,
            dry_run: true,
        }
    }
}

/// Calls in a row that time out or fail, with none answered between, after which the
/// connection is taken for silent (or stuck) and replaced.
const SILENT_AFTER: u32 = 3;
/// The shortest time between two replacements: a Redis that is slow rather than unreachable
/// (every call past the timeout) gets one new connection a second at most.
const REPLACE_EVERY: Duration = Duration::from_secs(1);

/// The connection to Redis, replaceable.
///
/// redis-rs's manager reconnects after the failures it sees (a reset, a close), but a
/// connection that falls silent (a dropped route, a firewall or NAT that forgot it, a Redis
/// host that froze) shows it none: every call would time out until the kernel gave the
/// connection up, minutes later. And a reconnection the manager saw refused for anything but
/// an I/O error (Redis back with another password, or fewer databases) is handed to every
/// later call at once, for good: it reconnects after I/O errors only. So after
/// [`SILENT_AFTER`] calls in a row time out or fail, a new connection is opened beside it and,
/// once connected, takes its place; the old one closes with its last clone (calls still
/// waiting on it time out as they would have).
struct Link {
    client: redis::Client,
    config: ConnectionManagerConfig,
    connect_timeout: Duration,
    current: Mutex<ConnectionManager>,
    timeouts: AtomicU32,
    replacing: AtomicBool,
    last_replaced: Mutex<Option<tokio::time::Instant>>,
    /// Why the last attempt to connect anew failed, while Redis has not answered since: a
    /// timeout then says so (a Redis that is down refuses connections, but the manager's
    /// calls wait on its reconnection past the store's timeout, so they only ever time out).
    unreachable: Mutex<Option<Arc<str>>>,
    /// Whether `unreachable` holds a reason (read on every answer, locked only then).
    known_unreachable: AtomicBool,
}

impl Link {
    fn conn(&self) -> ConnectionManager {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn answered(&self) {
        self.timeouts.store(0, Ordering::Relaxed);
        if self.known_unreachable.load(Ordering::Relaxed) {
            self.set_unreachable(None);
        }
    }

    fn set_unreachable(&self, why: Option<Arc<str>>) {
        let mut reason = self.unreachable.lock().unwrap_or_else(|e| e.into_inner());
        self.known_unreachable
            .store(why.is_some(), Ordering::Relaxed);
        *reason = why;
    }

    /// The error for a call not answered `within` the store's timeout: named after the last
    /// failed attempt to connect anew, if there is one since Redis last answered.
    fn timeout(&self, within: Duration) -> StoreError {
        if !self.known_unreachable.load(Ordering::Relaxed) {
            return StoreError::Timeout(within);
        }
        match &*self.unreachable.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(why) => StoreError::Unreachable {
                within,
                why: Arc::clone(why),
            },
            None => StoreError::Timeout(within),
        }
    }

    /// A call timed out or failed.
    fn failed(self: &Arc<Self>) {
        if self.timeouts.fetch_add(1, Ordering::Relaxed) + 1 < SILENT_AFTER {
            return;
        }
        if self.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        // Checked while holding the flag: a replacement that just ended has set it.
        let now = tokio::time::Instant::now();
        let last = *self.last_replaced.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| now < t + REPLACE_EVERY) {
            self.replacing.store(false, Ordering::Release);
            return;
        }
        let link = Arc::clone(self);
        tokio::spawn(async move {
            let fresh =
                ConnectionManager::new_with_config(link.client.clone(), link.config.clone());
            match tokio::time::timeout(link.connect_timeout, fresh).await {
                Ok(Ok(conn)) => {
                    *link.current.lock().unwrap_or_else(|e| e.into_inner()) = conn;
                    link.timeouts.store(0, Ordering::Relaxed);
                    link.set_unreachable(None);
                }
                Ok(Err(e)) => link.set_unreachable(Some(e.to_string().into())),
                // The manager retries a refused connection past the timeout: one plain try
                // says why.
                Err(_) => {
                    let why = match why_not(&link.client, link.connect_timeout).await {
                        StoreError::Redis(e) => e.to_string(),
                        _ => format!("no connection within {:?}", link.connect_timeout),
                    };
                    link.set_unreachable(Some(why.into()));
                }
            }
            *link.last_replaced.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(tokio::time::Instant::now());
            link.replacing.store(false, Ordering::Release);
        });
    }
}

/// A Redis-backed decision store. Cheap to clone: clones share one multiplexed connection
/// and one batcher.
#[derive(Clone)]
pub struct RedisStore {
    link: Arc<Link>,
    sha: Arc<str>,
    options: StoreOptions,
    /// Lease ids: this store's random prefix and a counter.
    instance: u64,
    leases: Arc<AtomicU64>,
    /// Redis's clock as this instance sees it, for the deadlines decisions carry.
    clock: Arc<RedisClock>,
    /// The leases held now, renewed by one task (see [`renewer`]).
    held: Arc<HeldLeases>,
    /// Writes still running in tasks of their own (releases, withdrawals), for a shutdown
    /// to wait for.
    background: Arc<Background>,
    /// To the batcher (see the module's doc); it stops when every clone is dropped.
    calls: mpsc::UnboundedSender<Call>,
}

/// A request's figures, and whether its call was sent twice (see [`eval`]).
pub(crate) type CallResult = Result<(Vec<i64>, bool), StoreError>;

fn batcher_stopped() -> StoreError {
    StoreError::Reply("the store's batcher has stopped".into())
}

/// A request waiting for its part of an `EVALSHA`.
struct Call {
    part: Part,
    /// When the request asked: its call must be answered within the store's timeout of this.
    since: tokio::time::Instant,
    /// The request's figures, and whether the call was sent twice (see [`eval`]).
    reply: oneshot::Sender<CallResult>,
    /// The concurrency lease the request asks for, released if its caller is gone by the
    /// time the call is answered (see [`answer`]).
    lease: Option<(RedisStore, Arc<LeaseSlots>)>,
}

/// Answers `call`. A caller that stopped waiting (its client left while Redis decided) cannot
/// hold the lease the call may have taken: that is released, or the caller's slots stayed
/// taken until the lease expired (review: a client that left during a stalled decision kept
/// its key at its concurrency limit for a minute).
///
/// Likewise its charges: returns their refund ([`Part::refund_of`]), for the caller to send.
fn answer(call: Call, result: Result<(Vec<i64>, bool), StoreError>) -> Option<Part> {
    let Call {
        reply, lease, part, ..
    } = call;
    let Err(result) = reply.send(result) else {
        return None;
    };
    if let Some((store, slots)) = lease {
        let took = match &result {
            Ok((figures, _)) => figures.first() == Some(&1),
            Err(e) => e.is_store_failure(),
        };
        if took {
            crate::decision::release_later(store, slots);
        }
    }
    part.refund_of(&result.ok()?.0)
}

/// How long a call whose every request was given up is still waited for, to take back what
/// Redis charged for them if it answers (see [`send`]).
const LATE_ANSWER_WAIT: Duration = Duration::from_secs(5);

/// Sends `refunds` (charges of requests whose callers had stopped waiting) in one call, once:
/// a refund sent twice would give back twice.
async fn send_refunds(link: &Link, sha: &str, options: StoreOptions, refunds: Vec<Part>) {
    if refunds.is_empty() {
        return;
    }
    let mut pipe = redis::pipe();
    pipe.add_command(script::invocation(sha, options.lease_ttl, refunds.iter()));
    let mut conn = link.conn();
    let once = AtomicBool::new(true);
    let call = eval(&mut conn, &pipe, true, &once);
    // Not sent again if it fails: the charges then stay, as they did before this was done.
    let _ = tokio::time::timeout(options.timeout.max(LATE_ANSWER_WAIT), call).await;
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("sha", &self.sha)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Whether the client reads `url` (no connection is made).
    pub fn check_url(url: &str) -> Result<(), StoreError> {
        redis::Client::open(url).map(drop).map_err(StoreError::from)
    }

    /// Connects to `url` (`redis://host:port/db`) and loads the script (`SCRIPT LOAD`).
    pub async fn connect(url: &str, options: StoreOptions) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(options.connect_timeout)
            .set_number_of_retries(1)
            .set_max_delay(1_000);
        let clock = Arc::new(RedisClock::default());
        let start = async {
            let mut conn =
                ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
            // A small command first: a Redis that wants a password answers it NOAUTH, where
            // the script's 25 KB would get only "unauthenticated bulk length" and a close.
            let _: String = redis::cmd("PING").query_async(&mut conn).await?;
            let sha = load(&mut conn).await?;
            // Redis's clock, so that the first decisions carry their deadlines too (a stalled
            // Redis that reaches them late then charges nothing, as it does later decisions).
            let sent = clock.local_micros();
            let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await?;
            clock.sample(
                sent,
                secs * 1_000_000 + micros,
                tokio::time::Instant::now(),
                false,
            );
            Ok::<_, StoreError>((conn, sha))
        };
        let (conn, sha) = match tokio::time::timeout(options.connect_timeout, start).await {
            Ok(started) => started?,
            Err(_) => return Err(why_not(&client, options.connect_timeout).await),
        };
        let link = Arc::new(Link {
            client,
            config,
            connect_timeout: options.connect_timeout,
            current: Mutex::new(conn),
            timeouts: AtomicU32::new(0),
            replacing: AtomicBool::new(false),
            last_replaced: Mutex::new(None),
            unreachable: Mutex::new(None),
            known_unreachable: AtomicBool::new(false),
        });
        let sha: Arc<str> = Arc::from(sha);
        let (calls, queue) = mpsc::unbounded_channel();
        tokio::spawn(batcher(Arc::clone(&link), Arc::clone(&sha), options, queue));
        let held = Arc::new(HeldLeases::default());
        tokio::spawn(renewer(
            Arc::downgrade(&link),
            options,
            Arc::downgrade(&held),
        ));
        Ok(RedisStore {
            link,
            sha,
            options,
            instance: rand::random(),
            leases: Arc::new(AtomicU64::new(0)),
            clock,
            held,
            background: Arc::default(),
            calls,
        })
    }

    /// Marks a write that runs in a task of its own (a release, a withdrawal) until the
    /// returned guard is dropped, so that [`RedisStore::settle`] waits for it.
    pub fn background_write(&self) -> BackgroundWrite {
        self.background.running.fetch_add(1, Ordering::AcqRel);
        BackgroundWrite(Arc::clone(&self.background))
    }

    /// Resolves once no background write is running: a shutdown waits for this (bounded by
    /// its caller), so that a release or withdrawal started just before is not dropped with
    /// the runtime. From then on a release that fails is not tried again later: the store is
    /// closing, and its retries' waits would only hold up the exit.
    pub async fn settle(&self) {
        self.background.closing.store(true, Ordering::Release);
        self.background.closing_now.notify_waiters();
        loop {
            let idle = self.background.idle.notified();
            if self.background.running.load(Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }

    /// Whether a shutdown is waiting for the background writes (see [`RedisStore::settle`]).
    pub(crate) fn closing(&self) -> bool {
        self.background.closing.load(Ordering::Acquire)
    }

    /// Waits `wait`, or less if a shutdown starts waiting for the background writes meanwhile.
    pub(crate) async fn retry_after(&self, wait: Duration) {
        let closing = self.background.closing_now.notified();
        if self.closing() {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = closing => {}
        }
    }

    /// Decides a request of `cost` against every layer in one round trip, at Redis's clock.
    pub async fn decide(
        &self,
        layers: &[Layer<'_>],
        cost: u32,
        mode: Mode,
    ) -> Result<RemoteDecision, StoreError> {
        self.decide_inner(layers, cost, mode, None).await
    }

    /// [`RedisStore::decide`] at `now` (truncated to the microsecond) instead of Redis `TIME`:
    /// for tests that must be exact without sleeping. Production code calls `decide`.
    pub async fn decide_at(
        &self,
        layers: &[Layer<'_>],
        cost: u32,
        mode: Mode,
        now: Nanos,
    ) -> Result<RemoteDecision, StoreError> {
        self.decide_inner(layers, cost, mode, Some(now)).await
    }

    async fn decide_inner(
        &self,
        layers: &[Layer<'_>],
        cost: u32,
        mode: Mode,
        now: Option<Nanos>,
    ) -> Result<RemoteDecision, StoreError> {
        check_layers(layers)?;
        let leases = mode == Mode::Charge && layers.iter().any(|l| l.limit.is_concurrency());
        let n = self.leases.fetch_add(u64::from(leases), Ordering::Relaxed);
        let lease_id = if leases {
            format!("{:016x}-{n:x}", self.instance)
        } else {
            String::new()
        };
        let code = match mode {
            Mode::Charge => "d",
            Mode::CheckOnly => "c",
            Mode::Full => "b",
        };
        let sent = self.clock.local_micros();
        // Past this (Redis's clock), this request is no longer waited for: Redis then
        // charges nothing for it. (Redis's clock is read when the store connects.)
        let deadline = match now {
            None => self.clock.deadline(sent, self.options.timeout),
            Some(_) => None,
        };
        // The lease in every concurrency layer, for releasing it whatever the call took: if
        // the call fails, or its caller is gone by the time it is answered ([`answer`]).
        let every = leases.then(|| {
            let keys = layers
                .iter()
                .filter(|l| l.limit.is_concurrency())
                .map(|l| l.limit.key_name(l.key))
                .collect();
            Arc::new(LeaseSlots {
                id: lease_id.clone(),
                keys,
            })
        });
        let release = || {
            if let Some(every) = &every {
                crate::decision::release_later(self.clone(), Arc::clone(every));
            }
        };
        let part = Part::new(layers, code, cost, &lease_id, (now, deadline), None);
        let lease = every.as_ref().map(|e| (self.clone(), Arc::clone(e)));
        let reply = self.call(part, lease).await;
        let reply = match reply {
            Ok((reply, resent)) => {
                if now.is_none() {
                    self.clock.learn(sent, &reply, tokio::time::Instant::now());
                }
                // A call sent twice (its connection broke) may have taken a lease in its first
                // run that the second run counted against it: unless it admitted, that lease
                // is released.
                if resent && reply.first() != Some(&1) {
                    release();
                }
                reply
            }
            // The call may still run in Redis after this request stopped waiting (a stalled
            // Redis answers late): its lease must not hold the caller's slots until it
            // expires. The release goes out after the call on the same connection, so it
            // finds the lease if the call ran, and removes nothing if it did not.
            Err(e) => {
                if e.is_store_failure() {
                    release();
                }
                return Err(e);
            }
        };
        let mut decision = script::decision(&reply, layers, cost)?;
        if let RemoteDecision::Admitted(a) = &mut decision {
            let keys: Vec<String> = layers
                .iter()
                .zip(&a.tags)
                .filter(|(l, tag)| l.limit.is_concurrency() && tag.is_some())
                .map(|(l, _)| l.limit.key_name(l.key))
                .collect();
            if !keys.is_empty() {
                let slots = Arc::new(LeaseSlots { id: lease_id, keys });
                self.held.insert(n, Arc::clone(&slots));
                a.lease = Some(Lease {
                    store: Some(self.clone()),
                    slots,
                    n,
                });
            }
        }
        Ok(decision)
    }

    /// Takes back every charge of `admission` (decided over `layers`) and its leases, in one
    /// round trip; e.g. when the gateway answers 503 after admitting. Deciding with
    /// [`Mode::Full`] when the instance is already full avoids it in the common case.
    pub async fn refund(
        &self,
        layers: &[Layer<'_>],
        admission: RemoteAdmission,
    ) -> Result<(), StoreError> {
        self.take_back(layers, admission, "r", None).await
    }

    /// [`RedisStore::refund`] at `now` instead of Redis `TIME`, as [`RedisStore::decide_at`]
    /// is: for tests. Production code calls `refund`.
    pub async fn refund_at(
        &self,
        layers: &[Layer<'_>],
        admission: RemoteAdmission,
        now: Nanos,
    ) -> Result<(), StoreError> {
        self.take_back(layers, admission, "r", Some(now)).await
    }

    /// Takes back the charges of an admission whose request will not be served after all (a
    /// request held by a `max_delay` limit whose client left), as
    /// [`sluice_limiter::Limiter::withdraw`] does in memory: like [`RedisStore::refund`], but
    /// a token bucket gets its charge back only if its TAT is still the one this charge left
    /// (nobody queued behind it since), and only if a charge moves it by 1 us or more (the
    /// state's resolution, so that a later charge always shows).
    pub async fn withdraw(
        &self,
        layers: &[Layer<'_>],
        admission: RemoteAdmission,
    ) -> Result<(), StoreError> {
        self.take_back(layers, admission, "w", None).await
    }

    /// [`RedisStore::withdraw`] at `now` instead of Redis `TIME`, as [`RedisStore::decide_at`]
    /// is: for tests. Production code calls `withdraw`.
    pub async fn withdraw_at(
        &self,
        layers: &[Layer<'_>],
        admission: RemoteAdmission,
        now: Nanos,
    ) -> Result<(), StoreError> {
        self.take_back(layers, admission, "w", Some(now)).await
    }

    async fn take_back(
        &self,
        layers: &[Layer<'_>],
        mut admission: RemoteAdmission,
        mode: &str,
        now: Option<Nanos>,
    ) -> Result<(), StoreError> {
        check_layers(layers)?;
        if admission.tags.len() != layers.len() {
            return Err(StoreError::Layers(
                "refund with other layers than the decision",
            ));
        }
        let lease = admission.lease.take();
        if admission.tags.iter().all(Option::is_none) {
            return Ok(()); // check-only: nothing was charged
        }
        let mut lease_id = String::new();
        if let Some(mut lease) = lease {
            lease.leave_register();
            lease.store = None; // the refund removes it; no release on drop
            lease_id.clone_from(&lease.slots.id);
        }
        let tags = Some((admission.tags.as_slice(), admission.held.as_slice()));
        let part = Part::new(layers, mode, admission.cost, &lease_id, (now, None), tags);
        match self.call(part, None).await?.0.first() {
            Some(3) => Ok(()),
            _ => Err(StoreError::Reply("refund not confirmed".into())),
        }
    }

    /// Removes a lease from every concurrency key it is in: one pipelined round trip.
    pub(crate) async fn release(&self, slots: &LeaseSlots) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        for key in &slots.keys {
            pipe.cmd("ZREM").arg(key).arg(&slots.id).ignore();
        }
        let mut conn = self.link.conn();
        let call = pipe.query_async::<()>(&mut conn);
        // A release's timeout does not count towards replacing the connection: a stalled
        // decision's leases are released at once, and would count one stall several times.
        let Ok(done) = tokio::time::timeout(self.options.timeout, call).await else {
            return Err(self.link.timeout(self.options.timeout));
        };
        done?;
        self.link.answered();
        Ok(())
    }

    pub(crate) fn held_leases(&self) -> &HeldLeases {
        &self.held
    }

    /// Has the batcher decide `part` in the next `EVALSHA`, within the timeout of this asking
    /// (kept by the call's timer, see [`send`], not by one per request).
    async fn call(
        &self,
        part: Part,
        lease: Option<(RedisStore, Arc<LeaseSlots>)>,
    ) -> Result<(Vec<i64>, bool), StoreError> {
        let answer = self.submit(part, lease)?;
        answer.await.map_err(|_| batcher_stopped())?
    }

    /// Hands `part` to the batcher now, ahead of every call asked for after this returns;
    /// the answer comes on the receiver.
    fn submit(
        &self,
        part: Part,
        lease: Option<(RedisStore, Arc<LeaseSlots>)>,
    ) -> Result<oneshot::Receiver<CallResult>, StoreError> {
        let (reply, answer) = oneshot::channel();
        let since = tokio::time::Instant::now();
        let call = Call {
            part,
            since,
            reply,
            lease,
        };
        self.calls.send(call).map_err(|_| batcher_stopped())?;
        Ok(answer)
    }

    /// Asks the batcher now to release `slots`, ahead of any decision asked for after this
    /// (a lease dropped at a response's end, before the caller's next request is decided:
    /// review, a caller sending one request at a time under a concurrency limit of 1 was
    /// refused every other request while the release waited for a timer tick). Whether it
    /// was confirmed comes on the receiver.
    pub(crate) fn release_first(
        &self,
        slots: &LeaseSlots,
    ) -> Option<oneshot::Receiver<CallResult>> {
        self.submit(Part::release(&slots.keys, &slots.id), None)
            .ok()
    }
}

/// How far Redis's clock is ahead of this host's, learned from the clock each answer carries.
///
/// This host's clock is the limiter's [`SystemClock`] (the Unix epoch read once, then
/// monotonic), so a step of this host's wall clock does not move it. A sample is Redis's
/// `TIME` at the decision minus this clock when the request was sent: never less than the true offset, and more by the round trip and any wait in Redis.
/// The smallest sample is kept for ten seconds (so one slow answer does not move the deadlines
/// later), then the next one replaces it, whatever it is (so the estimate follows drift). An
/// answer that says a request arrived past its deadline while its sender was still waiting
/// shows the estimate is too small (a host's clock was stepped): it replaces it at once, so a
/// step costs one call's requests a fallback, not ten seconds of them. The age is measured on
/// the monotonic clock, which no step moves. A deadline is late by at most a round trip: a
/// decision Redis reaches within that of its sender giving up still charges.
#[derive(Debug, Default)]
struct RedisClock {
    local: SystemClock,
    /// The offset kept (us) and when it was learned.
    best: Mutex<Option<(i64, tokio::time::Instant)>>,
}

/// How long the smallest sample of Redis's clock offset is kept.
const OFFSET_KEPT: Duration = Duration::from_secs(10);

impl RedisClock {
    /// This host's clock in microseconds since the Unix epoch (Redis `TIME`'s scale).
    fn local_micros(&self) -> i64 {
        i64::try_from(self.local.now().0 / 1_000).unwrap_or(i64::MAX)
    }

    fn deadline(&self, sent: i64, timeout: Duration) -> Option<u64> {
        let best = *self.best.lock().unwrap_or_else(|e| e.into_inner());
        let timeout = i64::try_from(timeout.as_micros()).unwrap_or(i64::MAX);
        best.and_then(|(offset, _)| {
            u64::try_from(sent.saturating_add(timeout).saturating_add(offset)).ok()
        })
    }

    /// Learns from `reply` (a decision's figures, Redis's `TIME` among them) to a request sent
    /// at `sent` (wall clock, us), received at `now` (monotonic).
    fn learn(&self, sent: i64, reply: &[i64], now: tokio::time::Instant) {
        let (redis_now, expired) = match reply {
            [5, _, t, ..] => (*t, true),
            [0..=2, rest @ ..] if rest.len() >= 5 => (rest[4], false),
            _ => return,
        };
        self.sample(sent, redis_now, now, expired);
    }

    /// Learns that Redis's clock read `redis_now` (us) for a request sent at `sent`; whether
    /// that request was `expired` when Redis reached it.
    fn sample(&self, sent: i64, redis_now: i64, now: tokio::time::Instant, expired: bool) {
        if redis_now <= 0 {
            return;
        }
        let sample = redis_now - sent;
        let mut best = self.best.lock().unwrap_or_else(|e| e.into_inner());
        match *best {
            Some((offset, at))
                if !expired && sample >= offset && now.duration_since(at) < OFFSET_KEPT => {}
            _ => *best = Some((sample, now)),
        }
    }
}

/// Why a connection could not be made in time. The connection manager retries what fails
/// (its first try's error is lost in its back-off), so one plain try says it, when Redis
/// answers at all: a wrong password or user (`WRONGPASS`), one missing (`NOAUTH`), a database
/// that does not exist. Otherwise the silence is the reason.
async fn why_not(client: &redis::Client, within: Duration) -> StoreError {
    let attempt = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    match tokio::time::timeout(within, attempt).await {
        Ok(Err(e)) => StoreError::Redis(e),
        Ok(Ok(_)) | Err(_) => StoreError::Timeout(within),
    }
}

/// Writes running in tasks of their own.
#[derive(Debug, Default)]
struct Background {
    running: AtomicUsize,
    /// Woken when the last one ends.
    idle: tokio::sync::Notify,
    /// Set (and woken) when a shutdown waits for them: no more retries.
    closing: AtomicBool,
    closing_now: tokio::sync::Notify,
}

/// A background write, running until dropped (see [`RedisStore::background_write`]).
#[derive(Debug)]
pub struct BackgroundWrite(Arc<Background>);

impl Drop for BackgroundWrite {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// The leases this store's requests hold, by number.
#[derive(Debug, Default)]
pub(crate) struct HeldLeases(Mutex<HashMap<u64, Arc<LeaseSlots>>>);

impl HeldLeases {
    fn insert(&self, n: u64, slots: Arc<LeaseSlots>) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(n, slots);
    }

    pub(crate) fn remove(&self, n: u64) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(&n);
    }

    fn snapshot(&self) -> Vec<(u64, Arc<LeaseSlots>)> {
        let held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        held.iter().map(|(n, s)| (*n, Arc::clone(s))).collect()
    }

    fn contains(&self, n: u64) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&n)
    }
}

/// Every third of the lease TTL, renews every lease held at that moment, until every store
/// clone is dropped. A renewal that fails is tried again a third later: a lease outlives two
/// missed renewals. A renewal also puts back a lease Redis no longer has (its data lost in a
/// restart, a failover or a flush, or the lease expired while Redis could not be reached),
/// so that a request still running counts again within a third of the TTL.
async fn renewer(link: Weak<Link>, options: StoreOptions, held: Weak<HeldLeases>) {
    let every = options.lease_ttl / 3;
    loop {
        tokio::time::sleep(every).await;
        let Some(leases) = held.upgrade().map(|h| h.snapshot()) else {
            return;
        };
        for (n, slots) in leases {
            // The connection of the moment, for each lease: a release goes out on the current
            // one, and a renewal must not overtake it on a connection since replaced.
            let Some(mut conn) = link.upgrade().map(|l| l.conn()) else {
                return;
            };
            // Released since the snapshot (its request ended): not put back.
            let still_held = || held.upgrade().is_some_and(|h| h.contains(n));
            if still_held() {
                renew(&mut conn, &slots, &options, still_held).await;
            }
        }
    }
}

/// Renews one lease on `conn`. A release that reached Redis between the look at the register
/// and the renewal would be undone by it, and the slot held until the lease TTL ends: so if
/// the lease has left the register (`still_held`) by the time the renewal is answered, it is
/// removed again, after the renewal. (A release that leaves the register after that look is
/// sent after the renewal was answered, so it cannot be overtaken.)
async fn renew<C: redis::aio::ConnectionLike>(
    conn: &mut C,
    slots: &LeaseSlots,
    options: &StoreOptions,
    still_held: impl Fn() -> bool,
) {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(RENEW)
        .arg(slots.keys.len())
        .arg(&slots.keys)
        .arg(&slots.id);
    cmd.arg(options.lease_ttl.as_micros().to_string());
    // A failure (Redis down, a timeout) is not a request's: the next period tries again.
    let _ = tokio::time::timeout(options.timeout, cmd.query_async::<i64>(conn)).await;
    if !still_held() {
        let mut pipe = redis::pipe();
        for key in &slots.keys {
            pipe.cmd("ZREM").arg(key).arg(&slots.id).ignore();
        }
        let _ = tokio::time::timeout(options.timeout, pipe.query_async::<()>(conn)).await;
    }
}

/// The renewal script: in each key (a concurrency ZSET, see `script.rs`), member `ARGV[1]`
/// expires at Redis's `TIME` plus `ARGV[2]` microseconds, put back if it is missing, and the
/// key lives at least as long. A key of another type is left alone.
const RENEW: &str = r"
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local ttl = tonumber(ARGV[2])
local renewed = 0
for _, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'zset' or kind == 'none' then
    redis.call('ZADD', key, now + ttl, ARGV[1])
    redis.call('PEXPIRE', key, math.ceil(ttl / 1000))
    renewed = renewed + 1
  end
end
return renewed
";

/// The batcher: takes the requests waiting at that moment into one `EVALSHA` and sends it,
/// without waiting for the answer to the previous one, until every store clone is dropped.
async fn batcher(
    link: Arc<Link>,
    sha: Arc<str>,
    options: StoreOptions,
    mut queue: mpsc::UnboundedReceiver<Call>,
) {
    let mut waiting = Vec::with_capacity(MAX_BATCH);
    while queue.recv_many(&mut waiting, MAX_BATCH).await > 0 {
        // A request whose caller stopped waiting (dropped) is left out.
        let batch: Vec<Call> = waiting.drain(..).filter(|c| !c.reply.is_closed()).collect();
        if !batch.is_empty() {
            tokio::spawn(send(Arc::clone(&link), Arc::clone(&sha), options, batch));
        }
    }
}

/// Sends one batch and answers each of its requests. A request whose key Redis cannot read
/// fails alone (the script reads with `redis.pcall`); an error of the whole call (the
/// connection, Redis refusing the script) is every request's.
///
/// Each request is answered within the store's timeout of its own asking, as it would be with
/// a timer of its own: the call's one timer is set for the earliest deadline among the
/// requests still waiting, and when it fires, those whose time is up are answered `Timeout`
/// and the rest go on waiting (in a batch their deadlines are usually microseconds apart).
/// That is also the deadline each request carries to Redis, which charges nothing for a
/// request it reaches later: a request answered `Timeout` here is not charged there (but for
/// the round trip's margin, see [`RedisClock`]). A request whose time ran out before its call
/// went (a busy runtime) is answered at once and not sent.
async fn send(link: Arc<Link>, sha: Arc<str>, options: StoreOptions, batch: Vec<Call>) {
    let timeout = options.timeout;
    let now = tokio::time::Instant::now();
    let mut waiting: Vec<Option<Call>> = Vec::with_capacity(batch.len());
    for call in batch {
        if call.since + timeout <= now {
            answer(call, Err(link.timeout(timeout)));
        } else {
            waiting.push(Some(call));
        }
    }
    if waiting.is_empty() {
        return;
    }
    let mut conn = link.conn();
    // Each request's place among the call's replies; none for a release, which goes first,
    // as a command of its own in the call's pipeline (see `Part::release`).
    let mut sent = 0;
    let replies_at: Vec<Option<usize>> = (waiting.iter().flatten())
        .map(|c| {
            (!c.part.is_release()).then(|| {
                sent += 1;
                sent - 1
            })
        })
        .collect();
    let mut pipe = redis::pipe();
    for call in waiting.iter().flatten().filter(|c| c.part.is_release()) {
        call.part.push_release(&mut pipe);
    }
    let parts = (waiting.iter().flatten())
        .map(|c| &c.part)
        .filter(|p| !p.is_release());
    if sent > 0 {
        pipe.add_command(script::invocation(&sha, options.lease_ttl, parts));
    }
    // Set once a request of the call has been given up: the call is then not sent again on a
    // new connection (see `eval`), since its caller has followed `on_error` already.
    let gave_up = AtomicBool::new(false);
    let call = eval(&mut conn, &pipe, sent > 0, &gave_up);
    tokio::pin!(call);
    // With `take_back_late`, the decisions given up for time, by their place among the
    // call's replies: Redis may have reached them in time and charged them, their answers
    // only late (a slow path back). What they charged is taken back when the answers come
    // (review: a 503 under `deny` that said nothing was charged had been charged).
    let mut given_up: Vec<(usize, Part)> = Vec::new();
    let result = loop {
        let Some(first) = waiting.iter().flatten().map(|c| c.since).min() else {
            // Every request's time ran out: the call timed out. Releases alone do not count
            // towards replacing the connection, as `RedisStore::release`'s do not (review: a
            // stall's leases, released through the batcher, counted it again).
            if sent > 0 {
                link.failed();
            }
            if !given_up.is_empty() {
                // Still waited for a while, to take back what Redis charged.
                if let Ok(Ok((replies, _))) = tokio::time::timeout(LATE_ANSWER_WAIT, call).await {
                    let refunds = late_refunds(&given_up, &replies);
                    send_refunds(&link, &sha, options, refunds).await;
                }
            }
            return;
        };
        match tokio::time::timeout_at(first + timeout, &mut call).await {
            Ok(result) => break result,
            Err(_) => {
                let now = tokio::time::Instant::now();
                for (i, slot) in waiting.iter_mut().enumerate() {
                    if let Some(mut late) = slot.take_if(|c| c.since + timeout <= now) {
                        if let Some(at) = replies_at[i].filter(|_| options.take_back_late) {
                            given_up.push((at, std::mem::take(&mut late.part)));
                        }
                        answer(late, Err(link.timeout(timeout)));
                        gave_up.store(true, Ordering::Relaxed);
                    }
                }
            }
        }
    };
    let result = result.and_then(|(replies, resent)| {
        if replies.len() == sent {
            Ok((replies, resent))
        } else {
            let got = replies.len();
            Err(StoreError::Reply(format!(
                "{got} replies for {sent} requests"
            )))
        }
    });
    if result.is_ok() {
        link.answered();
    }
    match result {
        Ok((replies, resent)) => {
            // Each request's reply read alone: one that does not parse (a key holding a state
            // nothing of sluice's wrote) fails its request, not the others of the call, which
            // Redis decided and charged.
            let mut refunds = late_refunds(&given_up, &replies);
            for (slot, at) in waiting.into_iter().zip(replies_at) {
                let figures = match at {
                    Some(at) => script::unpack(&replies[at]),
                    None => Ok(vec![3]), // a release: its command ran
                };
                if let Some(call) = slot {
                    refunds.extend(answer(call, figures.map(|r| (r, resent))));
                }
            }
            send_refunds(&link, &sha, options, refunds).await;
        }
        Err(e) => {
            // A manager stuck on a refused reconnection fails every call at once: counted as
            // a timeout is, towards replacing it (review: a Redis that had come back with the
            // password again was never used until a restart).
            if sent > 0 {
                link.failed();
            }
            for call in waiting.into_iter().flatten() {
                answer(call, Err(e.share()));
            }
        }
    }
}

/// The refunds of the decisions `given_up` (by their place among `replies`) that Redis
/// admitted and charged.
fn late_refunds(given_up: &[(usize, Part)], replies: &[Vec<u8>]) -> Vec<Part> {
    (given_up.iter())
        .filter_map(|(at, part)| {
            let figures = script::unpack(replies.get(*at)?).ok()?;
            part.refund_of(&figures)
        })
        .collect()
}

/// Runs `pipe` (the batch's releases, then its `EVALSHA` if `script`), loading the script
/// again if Redis lost it (`NOSCRIPT`, e.g. after a restart or `SCRIPT FLUSH`; the releases,
/// which ran, run again, removing nothing), and sending it once more if the connection turns out
/// broken (Redis restarted or closed it; the manager is connecting anew): otherwise the first
/// call after every Redis restart would fail. A call whose connection broke after Redis ran it
/// but before the answer came back (every call in flight on it) is then run twice, charging
/// its requests twice, which errs towards refusing; and a concurrency lease the first run took
/// may make the second refuse, so the caller releases the leases of a resent call that did
/// not admit (see `decide_inner`). Only a broken or refused connection is a reason: a reply
/// that does not parse means Redis ran the call, and it is not sent again; nor is a call one
/// of whose requests has been given up (`gave_up`): its caller followed `on_error`, and its
/// deadline in Redis's clock, which would keep a late run from charging it, is unknown until
/// the store's first answer. Returns the replies and whether the call was sent twice.
async fn eval(
    conn: &mut ConnectionManager,
    pipe: &redis::Pipeline,
    script: bool,
    gave_up: &AtomicBool,
) -> Result<(Vec<Vec<u8>>, bool), StoreError> {
    let (mut loaded, mut resent) = (false, false);
    loop {
        // The `EVALSHA`'s replies, the pipeline's one result not ignored (releases' are).
        let run = async {
            match script {
                true => (pipe.query_async(conn).await).map(|(replies,)| replies),
                false => (pipe.query_async::<()>(conn).await).map(|()| Vec::new()),
            }
        };
        match run.await {
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError && !loaded => {
                loaded = true;
                load(conn).await?;
            }
            Err(e)
                if !resent
                    && (e.is_connection_dropped() || e.is_connection_refusal())
                    && !gave_up.load(Ordering::Relaxed) =>
            {
                resent = true;
            }
            other => return Ok((other?, resent)),
        }
    }
}

async fn load(conn: &mut ConnectionManager) -> Result<String, StoreError> {
    let mut cmd = redis::cmd("SCRIPT");
    cmd.arg("LOAD").arg(script::SOURCE);
    Ok(cmd.query_async(conn).await?)
}

/// The script reads each key once: a request may not name the same key twice.
fn check_layers(layers: &[Layer<'_>]) -> Result<(), StoreError> {
    if layers.is_empty() {
        return Err(StoreError::Layers("a decision needs at least one layer"));
    }
    for (i, a) in layers.iter().enumerate() {
        if layers[..i]
            .iter()
            .any(|b| b.key == a.key && b.limit.limit().name() == a.limit.limit().name())
        {
            return Err(StoreError::Layers("the same limit and key appear twice"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A release that reaches Redis while a renewal of the same lease is on its way is not
    /// undone by it (review: the slot stayed taken until the lease TTL ended). Played in the
    /// racing order: the renewer has looked at the register, the request ends and its
    /// release runs, then the renewal arrives.
    #[tokio::test]
    async fn a_renewal_overtaken_by_its_release_does_not_bring_the_lease_back() {
        let server = sluice_test_redis::RedisServer::start();
        let client = redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let slots = LeaseSlots {
            id: "lease-1".into(),
            keys: vec!["c:one".into(), "c:two".into()],
        };
        let options = StoreOptions::default();
        for key in &slots.keys {
            assert_eq!(server.cli(&["ZADD", key, "1", &slots.id]).trim(), "1");
        }
        let held = HeldLeases::default();
        held.insert(
            7,
            Arc::new(LeaseSlots {
                id: slots.id.clone(),
                keys: slots.keys.clone(),
            }),
        );
        // The renewer's look: still held.
        assert!(held.contains(7));
        // The request ends: the lease leaves the register and its release runs.
        held.remove(7);
        for key in &slots.keys {
            assert_eq!(server.cli(&["ZREM", key, &slots.id]).trim(), "1");
        }
        // The renewal arrives after it.
        renew(&mut conn, &slots, &options, || held.contains(7)).await;
        for key in &slots.keys {
            assert_eq!(
                server.cli(&["ZSCORE", key, &slots.id]).trim(),
                "",
                "{key}: the released lease came back"
            );
        }
        // A lease still held is renewed (and put back if Redis lost it).
        held.insert(
            8,
            Arc::new(LeaseSlots {
                id: "lease-2".into(),
                keys: slots.keys.clone(),
            }),
        );
        let kept = LeaseSlots {
            id: "lease-2".into(),
            keys: slots.keys.clone(),
        };
        renew(&mut conn, &kept, &options, || held.contains(8)).await;
        for key in &slots.keys {
            assert_ne!(server.cli(&["ZSCORE", key, "lease-2"]).trim(), "", "{key}");
        }
    }

    #[test]
    fn the_clock_offset_is_the_smallest_recent_sample_and_follows_a_step() {
        let clock = RedisClock::default();
        let timeout = Duration::from_millis(50);
        let t0 = tokio::time::Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        assert_eq!(
            clock.deadline(1_000, timeout),
            None,
            "unknown before any answer"
        );
        // Redis 5 s ahead; answers seen 300 us and 100 us after sending.
        clock.learn(1_000_000, &[1, 0, -1, 0, 0, 6_000_300], at(0));
        clock.learn(2_000_000, &[0, 1, 5, 0, 0, 7_000_100], at(1));
        assert_eq!(clock.deadline(3_000_000, timeout), Some(8_050_100));
        // A slower answer does not move it later...
        clock.learn(3_000_000, &[1, 0, -1, 0, 0, 8_009_000], at(2));
        assert_eq!(clock.deadline(3_000_000, timeout), Some(8_050_100));
        // ...until the best sample is ten seconds old (monotonic): then the next one counts.
        clock.learn(13_000_000, &[1, 0, -1, 0, 0, 18_000_700], at(11));
        assert_eq!(clock.deadline(14_000_000, timeout), Some(19_050_700));
        // This host's clock is stepped back 2 s: samples are 2 s larger, so deadlines come
        // 2 s early and Redis answers "expired" while the sender still waits; that one answer
        // replaces the estimate, well within ten seconds.
        clock.learn(12_000_000, &[5, 0, 19_000_200], at(12));
        assert_eq!(clock.deadline(12_000_000, timeout), Some(19_050_200));
        // Replies without Redis's clock teach nothing.
        clock.learn(13_000_000, &[3], at(13));
        clock.learn(13_000_000, &[4, 1], at(13));
        assert_eq!(clock.deadline(12_000_000, timeout), Some(19_050_200));
    }
}
