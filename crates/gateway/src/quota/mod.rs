//! The quota step: one all-or-nothing decision over every limit that applies to the route,
//! charging the route's cost; and the capacity step, so that a 503 never costs quota.
//! `delay` limits admit a request that passes within their `max_delay`, charged at once, and it
//! is held until then (as in-flight work), not decided again; `dry_run` limits are
//! decided after admission and never refuse. Limits are counted in this instance's memory
//! (`memory.rs`) or in Redis shared by every instance (`remote.rs`).

mod breaker;
mod memory;
mod remote;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName};
use sluice_config::Store;
use sluice_config::{self as config, Config, KeyPart, Mode};
use sluice_limiter::{
    Algorithm, Clock, Key, KeyHasher, Limit, LimitId, Limiter, RefusalReason, Report, Slots,
};
use smallvec::SmallVec;

use crate::access_log::AccessLog;
use crate::capacity::{Capacity, InFlight};
use memory::Decided;
use remote::Remote;

/// Inline capacity for a request's limits; more spill to the heap.
const INLINE: usize = 4;

pub(crate) type Reports = SmallVec<[(LimitId, Report); INLINE]>;

/// Where a decision leaves what the response and the access log need: the figures of the
/// limits that applied, and the outcome of a request that is held before it passes.
pub(crate) struct Notes<'a> {
    pub(crate) reports: &'a mut Reports,
    pub(crate) log: &'a mut AccessLog,
}
type KeyedLayers = SmallVec<[(LimitId, Key); INLINE]>;

/// The limits of the configuration, compiled, with what decides them.
pub(crate) struct Quota {
    /// This instance's counters: the store itself in memory mode; with Redis, the limits'
    /// ids and the `on_error = "local"` fallback (quotas divided by `instances`).
    limiter: Limiter,
    remote: Option<Remote>,
    clock: Arc<dyn Clock>,
    hasher: KeyHasher,
    pub(crate) limits: Vec<LimitInfo>,
    /// For each route (configuration index): the limits that apply, by mode; and last, at
    /// index [`Quota::unrouted`], those that count a request no route matches (see there).
    by_route: Vec<RouteLimits>,
    /// The headers some limit counts callers by (`by = "header:<name>"`), each once.
    key_headers: Vec<HeaderName>,
    /// Each route's part of a key by `route`: its name's keyed hash (a name, not an index,
    /// so that instances sharing a Redis agree on it while their route lists differ, as in a
    /// rolling change that adds a route; hashed once, so a key costs 16 bytes of it whatever
    /// the name's length).
    route_parts: Vec<[u8; 16]>,
    /// Evictions already warned about, per limit: its counters' table and its blocks'.
    evictions: std::sync::Mutex<Vec<[EvictionWatch; 2]>>,
}

/// What the gateway needs to know about a limit beyond its counters.
#[derive(Debug)]
pub(crate) struct LimitInfo {
    pub(crate) name: Arc<str>,
    /// The name as the RateLimit fields write it (an sf-string), made once.
    pub(crate) field_name: Box<str>,
    parts: Vec<Part>,
    pub(crate) config: config::Limit,
}

#[derive(Debug)]
enum Part {
    Ip,
    ApiKey,
    Route,
    Global,
    Header(HeaderName),
}

/// A route's limits, each with its key when that is the same for every caller (a limit by
/// `route` or `global`): made once at start instead of hashed on every request.
#[derive(Debug, Default)]
struct RouteLimits {
    enforced: SmallVec<[(LimitId, Option<Key>); INLINE]>,
    dry_run: SmallVec<[(LimitId, Option<Key>); 2]>,
    /// The headers its enforcing limits count callers by, each once (see
    /// [`Quota::bad_key_header`]).
    key_headers: Vec<HeaderName>,
}

/// Who is calling, as the limits see it.
#[derive(Debug)]
pub(crate) struct Caller<'r> {
    /// The client IP, IPv6 reduced to its network.
    pub(crate) ip: IpAddr,
    pub(crate) api_key: Option<&'r [u8]>,
    pub(crate) route: usize,
    pub(crate) headers: &'r HeaderMap,
}

/// The keyed limits of one request.
#[derive(Debug)]
pub(crate) struct Layers {
    enforced: KeyedLayers,
    dry_run: KeyedLayers,
}

/// An admitted request: its charges and slots live as long as its response body. (Its
/// figures for the headers are written to the caller's `Reports`, not carried here: a pass is
/// moved several times on its way out, and the figures are most of its size.)
#[derive(Debug)]
pub(crate) struct Pass {
    pub(crate) slot: InFlight,
    pub(crate) held: Held,
    pub(crate) outcome: Outcome,
}

/// What of the admissions lives until the response ends: concurrency slots and Redis leases,
/// released on drop. Only the slots of an admission, not the whole admission: this goes
/// into every request's state and is moved with it several times.
#[derive(Debug, Default)]
pub(crate) struct Held {
    _enforced: Option<Slots>,
    _dry_run: Option<Slots>,
    _lease: Option<sluice_store_redis::Lease>,
}

/// How a request fared, for the access log (nginx's `$limit_req_status` words).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Passed,
    Delayed,
    Rejected(LimitId),
    RejectedDryRun(LimitId),
    Overloaded,
    /// A held request whose hold would have ended after the shutdown grace: a 503.
    Draining,
    /// The shared store could not decide and `on_error = "deny"`: the `quota-store` 503, or a
    /// plain 404 for a request no route matches.
    StoreUnavailable,
    /// The shared store could not decide and `on_error = "allow"`: passed unchecked.
    Unchecked,
}

/// Why a header a limit counts callers by cannot be used: answered 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyHeader {
    /// Sent twice with different values.
    Twice,
    /// A byte outside ASCII.
    NotAscii,
}

/// A request that is not admitted.
#[derive(Debug)]
pub(crate) enum Stop {
    /// 429: the caller's quota (or a block) refused it. Boxed: it is large, and rare next to
    /// admissions.
    Quota(Box<Refused>),
    /// The cost exceeds what a limit can ever hold (configuration prevents this).
    CostTooLarge(LimitId),
    /// 503: the gateway is full; nothing was charged.
    Overloaded,
    /// 503: the gateway was full when a held request's hold ended; its charges were withdrawn,
    /// except a token bucket's that a later request of the same caller is held behind.
    OverloadedAfterHold,
    /// 503: the gateway began to shut down with a grace that ends before a held request's
    /// hold would; its charges were withdrawn as for [`Stop::OverloadedAfterHold`].
    DrainingAfterHold,
    /// 503: the gateway was full (a [`Stop::Overloaded`] or [`Stop::OverloadedAfterHold`]),
    /// or began to shut down ([`Stop::DrainingAfterHold`]: `true`), and the shared store could
    /// not take back what it charged the request.
    NotTakenBack { draining: bool },
    /// 503: an HTTP/2 stream opened long after its connection was told to stop
    /// ([`crate::capacity::Capacity::goodbye_ignored`]); nothing was asked or charged.
    Draining,
    /// 503: the shared store cannot decide and `on_error = "deny"`; nothing was charged.
    StoreUnavailable,
}

/// A refusal, from either store: the limit with the longest wait, and every limit's figures.
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) limit: LimitId,
    pub(crate) wait: Option<Duration>,
    pub(crate) reason: RefusalReason,
    pub(crate) reports: Reports,
    /// Refused only because `max_held` requests were held: no counter refused it, and no
    /// `block_for` block started.
    pub(crate) no_room: bool,
}

impl Quota {
    pub(crate) async fn new(config: &Config, clock: Arc<dyn Clock>) -> Result<Self, String> {
        let (hasher, divide_by) = match &config.store {
            Store::Memory => (KeyHasher::new_random(), 1),
            Store::Redis(r) => {
                // Bytes as they are: a secret need not be UTF-8 (`sluice check` takes it so).
                let secret = std::env::var_os(&r.hash_secret_env)
                    .map(std::ffi::OsString::into_encoded_bytes)
                    .unwrap_or_default();
                if secret.is_empty() {
                    return Err(format!("store: the environment variable {} is empty or not set; every instance sharing the Redis store needs the same secret there (it keys the hashes that name callers in Redis)", r.hash_secret_env));
                }
                (KeyHasher::with_secret(&secret), r.instances.get())
            }
        };
        let compiled: Vec<Limit> = config.limits.iter().map(|l| compile(l, 1, 1)).collect();
        let remote = match &config.store {
            Store::Memory => None,
            Store::Redis(r) => Some(Remote::start(r, &compiled).await?),
        };
        // With Redis, this limiter is the local fallback: each quota divided by `instances`.
        let limiter = Limiter::new(config.limits.iter().map(|l| {
            let most = (divide_by > 1).then(|| largest_cost(config, l)).flatten();
            compile(l, divide_by, most.unwrap_or(1))
        }))
        .expect("validated configuration has unique limit names");
        // In configuration order, as the limiter was given them (a search by name for every
        // route and limit took 90 s to start 5,000 routes with 5,000 limits).
        let ids: Vec<LimitId> = limiter.ids().collect();
        let limits: Vec<LimitInfo> = config
            .limits
            .iter()
            .map(|l| LimitInfo {
                name: Arc::from(l.name.as_str()),
                field_name: crate::advertise::sf_string(&l.name),
                parts: l.by.iter().map(part).collect(),
                config: l.clone(),
            })
            .collect();
        let mut route_parts: Vec<[u8; 16]> = config
            .routes
            .iter()
            .map(|r| hasher.key(&[b"route", r.name.as_bytes()]).to_bytes())
            .collect();
        // The unrouted "route": none of its limits counts by route, so its part is never read.
        route_parts.push([0; 16]);
        let unrouted = config.routes.len();
        // Limit by limit, each onto the routes it names (in configuration order on each
        // route): asking every route whether every limit applies walked each limit's route
        // list once per route.
        let mut by_route: Vec<RouteLimits> =
            (0..=unrouted).map(|_| RouteLimits::default()).collect();
        for ((l, info), &id) in config.limits.iter().zip(&limits).zip(&ids) {
            let mut routes: Vec<usize> = match &l.routes {
                None => (0..unrouted).collect(),
                // Indices past the routes name none (a validated file has none).
                Some(named) => named.iter().copied().filter(|&r| r < unrouted).collect(),
            };
            if config.gateway.count_unrouted && l.counts_unrouted() {
                routes.push(unrouted);
            }
            for r in routes {
                let on_route = &mut by_route[r];
                let entry = (id, key_of(&hasher, &info.parts, &route_parts[r], None));
                match l.mode {
                    Mode::DryRun => on_route.dry_run.push(entry),
                    Mode::Enforce | Mode::Delay { .. } => {
                        on_route.enforced.push(entry);
                        for p in &info.parts {
                            if let Part::Header(h) = p {
                                if !on_route.key_headers.contains(h) {
                                    on_route.key_headers.push(h.clone());
                                }
                            }
                        }
                    }
                }
            }
        }
        // Limits of each caller before those shared by all (by route or global): a caller
        // over its own quota is then refused before its request charges, even for a moment,
        // what everyone shares (a charge taken back at once still refused a concurrent request
        // near the shared limit). Config order otherwise (the sort is stable).
        for on_route in &mut by_route {
            on_route
                .enforced
                .sort_by_key(|&(_, shared)| shared.is_some());
        }
        let mut key_headers: Vec<HeaderName> = Vec::new();
        for info in &limits {
            for p in &info.parts {
                if let Part::Header(h) = p {
                    if !key_headers.contains(h) {
                        key_headers.push(h.clone());
                    }
                }
            }
        }
        let evictions = std::sync::Mutex::new(vec![[EvictionWatch::default(); 2]; limits.len()]);
        Ok(Self {
            limiter,
            remote,
            clock,
            hasher,
            limits,
            by_route,
            key_headers,
            route_parts,
            evictions,
        })
    }

    /// The index that [`Caller::route`] takes for a request no route matches (one past the
    /// routes). Such a request is counted, at cost 1, by the limits that [`counts_unrouted`]
    /// (unless `gateway.count_unrouted = false`): otherwise a caller could send as many
    /// requests as it likes to paths that do not exist (a scanner), each one costing the
    /// gateway, and none ever refused.
    pub(crate) fn unrouted(&self) -> usize {
        self.by_route.len() - 1
    }

    /// Whether some limit counts requests no route matches.
    pub(crate) fn counts_unrouted(&self) -> bool {
        let unrouted = &self.by_route[self.unrouted()];
        !unrouted.enforced.is_empty() || !unrouted.dry_run.is_empty()
    }

    /// The headers some limit counts callers by.
    pub(crate) fn key_headers(&self) -> &[HeaderName] {
        &self.key_headers
    }

    /// A header some limit counts callers by that `headers` holds twice with different
    /// values (an empty one beside another included), or with a byte outside ASCII. Such a request is refused, as
    /// one with two API keys is: the limit would count the first value, and an upstream may
    /// read the last; and servers trim such bytes differently (Python's `str.strip()` takes a
    /// trailing `\xa0` off), so one caller could be counted as many.
    ///
    /// Only the headers of enforcing limits on `route` (as [`Caller::route`]) are looked at:
    /// a header that no limit there counts by is the upstream's business, and a `dry_run`
    /// limit never refuses (it counts by the first value).
    pub(crate) fn bad_key_header(
        &self,
        headers: &HeaderMap,
        route: usize,
    ) -> Option<(&HeaderName, KeyHeader)> {
        self.by_route[route].key_headers.iter().find_map(|h| {
            // Empty values too: `x-tenant:` empty before `x-tenant: a` is counted under `a`
            // and served as no tenant by an upstream reading the first (review).
            let mut values = headers
                .get_all(h)
                .into_iter()
                .map(|v| v.as_bytes().trim_ascii());
            let first = values.next()?;
            let mut twice = false;
            for v in std::iter::once(first).chain(values) {
                if !v.is_ascii() {
                    return Some((h, KeyHeader::NotAscii));
                }
                twice |= v != first;
            }
            twice.then_some((h, KeyHeader::Twice))
        })
    }

    pub(crate) fn info(&self, id: LimitId) -> &LimitInfo {
        &self.limits[id.index()]
    }

    /// A short, non-reversible fingerprint of an API key for logs: 64 bits of the keyed hash
    /// (32 bits gave two of 65,000 keys the same fingerprint about half the time), so the same
    /// across instances and restarts with the Redis store's shared secret, and per process in
    /// memory.
    pub(crate) fn fingerprint(&self, api_key: &[u8]) -> String {
        let bytes = self.hasher.key(&[b"fingerprint", api_key]).to_bytes();
        let word = u64::from_be_bytes(bytes[..8].try_into().expect("eight bytes"));
        crate::request_id::hex(word)
            .iter()
            .map(|&b| char::from(b))
            .collect()
    }

    /// Keys the request under every limit of its route. A limit whose key part is missing
    /// (no API key, no such header) does not apply.
    pub(crate) fn layers(&self, caller: &Caller<'_>) -> Layers {
        let route = &self.by_route[caller.route];
        let ip = match caller.ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        let keyed = |&(id, fixed): &(LimitId, Option<Key>)| {
            let parts = &self.limits[id.index()].parts;
            let who = Some((&ip, caller));
            let route = &self.route_parts[caller.route];
            let key = fixed.or_else(|| key_of(&self.hasher, parts, route, who));
            Some((id, key?))
        };
        Layers {
            enforced: route.enforced.iter().filter_map(keyed).collect(),
            dry_run: route.dry_run.iter().filter_map(keyed).collect(),
        }
    }

    /// Quota and capacity: admits the request (its figures in `notes`) or says why not.
    /// Nothing is charged unless the request is admitted. A request held by `delay` limits
    /// has its outcome in the notes' log before it is held, so that one whose client leaves
    /// meanwhile is logged as such.
    pub(crate) async fn admit(
        &self,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        notes: Notes<'_>,
    ) -> Result<Pass, Stop> {
        // The futures that wait (a delay, a call to Redis) are boxed, so that the request's
        // own future stays small: it was 6 KB, copied into its box on every request.
        match &self.remote {
            None => {
                // `admit_in_memory` written out rather than awaited: an inner future on this,
                // the common path, cost about 300 instructions per request (callgrind).
                match self.decide_in_memory(layers, cost, capacity, None, notes.reports) {
                    Decided::Now(result) => result,
                    Decided::Later(hold) => {
                        Box::pin(self.hold(hold, layers, capacity, notes)).await
                    }
                }
            }
            Some(remote) => Box::pin(remote.admit(self, layers, cost, capacity, notes)).await,
        }
    }

    /// The caller's figures as they stand, charging nothing and starting no block: for an
    /// answer that refuses the request before any limit decides it (a body too large), so that
    /// it advertises the limits as every other answer does. With the Redis store, one call
    /// (nothing in `reports` if Redis cannot answer).
    pub(crate) async fn standing(&self, layers: &Layers, cost: u32, reports: &mut Reports) {
        match &self.remote {
            None => {
                let figures = self.limiter.figures(&layers.enforced, self.clock.now());
                reports.extend(figures.map(|r| (r.limit, r)));
            }
            Some(remote) => Box::pin(remote.standing(layers, cost, reports)).await,
        }
    }

    /// At shutdown: waits (at most `until` then) for writes to the shared store still running
    /// in the background, such as the withdrawal of a held request whose client just left.
    pub(crate) async fn settle(&self, until: tokio::time::Instant) {
        if let Some(remote) = &self.remote {
            remote.settle(until).await;
        }
    }

    /// The 429 of a request a `delay` limit would hold for `wait` when `max_held` requests are
    /// held already, with the caller's `figures`: named after the `delay` limit whose quota
    /// comes back last (the one that holds it longest), whose `t` is then the wait, as a
    /// refusing limit's is (review: with a route's `cost` above 1, `t` said when one unit came
    /// back, sooner than `Retry-After`; with Redis, as of the admission then withdrawn, later).
    pub(super) fn no_room_to_hold(&self, mut figures: Reports, wait: Duration) -> Stop {
        let delay = |id: &LimitId| matches!(self.info(*id).config.mode, Mode::Delay { .. });
        let limit = figures
            .iter()
            .filter(|(id, _)| delay(id))
            .max_by_key(|(_, r)| r.reset)
            .or(figures.first())
            .map(|(id, _)| *id);
        let Some(limit) = limit else {
            return Stop::Overloaded; // no figures at all: cannot happen for a held request
        };
        for (_, report) in figures.iter_mut().filter(|(id, _)| *id == limit) {
            report.reset = report.reset.map(|_| wait);
        }
        Stop::Quota(Box::new(Refused {
            limit,
            wait: Some(wait),
            reason: RefusalReason::Exhausted,
            reports: figures,
            no_room: true,
        }))
    }

    /// Removes keys that returned to their fresh state (each table at most once per window),
    /// and says when a table is full.
    pub(crate) fn sweep(&self) -> usize {
        let swept = self.limiter.sweep(self.clock.now());
        self.warn_of_evictions();
        swept
    }

    /// Warns, at most once a minute per table, of each limit whose table of callers (or of
    /// blocked callers) is full, so that new callers evict others and what those were counted
    /// (a spent quota, a block) is forgotten: a full table never refuses, but it should not
    /// forget in silence.
    fn warn_of_evictions(&self) {
        let mut watches = self.evictions.lock().unwrap_or_else(|e| e.into_inner());
        for ((info, [counts, blocks]), id) in self
            .limits
            .iter()
            .zip(watches.iter_mut())
            .zip(self.limiter.ids())
        {
            let stats = self.limiter.stats(id);
            if let Some(evicted) = counts.news(stats.evictions) {
                tracing::warn!(
                    policy = &*info.name,
                    evicted,
                    keys = stats.keys,
                    max_keys = info.config.max_keys.get(),
                    "a limit's table of callers is full: new callers evict others, whose counts are forgotten; raise its max_keys"
                );
            }
            // Blocks have a table of their own (review: it filled, and blocks of an hour ended
            // early, while the counters' table, swept every short window, never evicted).
            let Some(stats) = self.limiter.block_stats(id) else {
                continue;
            };
            if let Some(evicted) = blocks.news(stats.evictions) {
                tracing::warn!(
                    policy = &*info.name,
                    evicted,
                    blocked = stats.keys,
                    max_keys = info.config.max_keys.get(),
                    "a limit's table of blocked callers is full: new blocks end others early; raise its max_keys"
                );
            }
        }
    }
}

/// One table's evictions already warned about, and when the last warning was.
#[derive(Debug, Default, Clone, Copy)]
struct EvictionWatch {
    seen: u64,
    warned: Option<tokio::time::Instant>,
}

impl EvictionWatch {
    /// The evictions to warn of now, out of `total` so far: none within a minute of the last
    /// warning (they are told with the next).
    fn news(&mut self, total: u64) -> Option<u64> {
        let recent = self
            .warned
            .is_some_and(|at| at.elapsed() < Duration::from_secs(60));
        if total <= self.seen || recent {
            return None;
        }
        let news = total - self.seen;
        self.seen = total;
        self.warned = Some(tokio::time::Instant::now());
        Some(news)
    }
}

impl std::fmt::Debug for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quota")
            .field("limiter", &self.limiter)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// The key of a limit keyed by `parts`, for `caller` (with its address as 16 bytes) on the
/// route whose part is `route`, or `None` if the caller lacks a part (no API key, no such header).
/// Without a caller, the key every caller shares, if the parts are only `route` and
/// `global`: made once at start.
fn key_of(
    hasher: &KeyHasher,
    parts: &[Part],
    route: &[u8],
    caller: Option<(&[u8; 16], &Caller<'_>)>,
) -> Option<Key> {
    let mut bytes: SmallVec<[&[u8]; 4]> = SmallVec::new();
    for p in parts {
        bytes.push(match (p, caller) {
            (Part::Route, _) => route,
            (Part::Global, _) => b"",
            (Part::Ip, Some((ip, _))) => ip,
            (Part::ApiKey, Some((_, c))) => c.api_key?,
            (Part::Header(h), Some((_, c))) => header_values(c.headers, h).next()?,
            (Part::Ip | Part::ApiKey | Part::Header(_), None) => return None,
        });
    }
    Some(hasher.key(&bytes))
}

/// Waits out a `delay` hold of `wait`, then takes the request's place in `max_in_flight`; the
/// 503 to answer if the gateway is full then, or as soon as it starts draining with a grace
/// that ends first (answered then, rather than cut without an answer at exit).
async fn place_after_hold(capacity: &Capacity, wait: Duration) -> Result<InFlight, Stop> {
    let release = tokio::time::Instant::now() + wait;
    tokio::select! {
        () = tokio::time::sleep_until(release) => capacity.try_acquire().ok_or(Stop::OverloadedAfterHold),
        () = capacity.draining_before(release) => Err(Stop::DrainingAfterHold),
    }
}

/// The values of header `name` that can count a caller: trimmed, empty ones left out (as an
/// empty API key is no key), so that an empty value puts a request outside the limit rather
/// than into one bucket shared by every caller who sends it empty.
fn header_values<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
) -> impl Iterator<Item = &'h [u8]> + 'h {
    headers
        .get_all(name)
        .into_iter()
        .map(|v| v.as_bytes().trim_ascii())
        .filter(|v| !v.is_empty())
}

fn part(p: &KeyPart) -> Part {
    match p {
        KeyPart::Ip => Part::Ip,
        KeyPart::ApiKey => Part::ApiKey,
        KeyPart::Route => Part::Route,
        KeyPart::Global => Part::Global,
        KeyPart::Header(h) => {
            Part::Header(HeaderName::from_bytes(h.as_bytes()).expect("validated header name"))
        }
    }
}

/// The largest cost of the routes `l` applies to, if they cost more than 1 (and `l` counts
/// cost: a concurrency limit takes one slot per request).
fn largest_cost(config: &Config, l: &config::Limit) -> Option<u32> {
    if l.algorithm == config::Algorithm::Concurrency {
        return None;
    }
    let costs = config
        .routes
        .iter()
        .enumerate()
        .filter(|&(i, _)| l.applies_to(i));
    costs.map(|(_, r)| r.cost.get()).max().filter(|&c| c > 1)
}

/// The limiter's form of a configured limit, with quota (and burst) divided by `divide_by`,
/// for the local fallback of a store shared by that many instances; but never below `floor`,
/// the largest cost of the routes it applies to, or those routes could not be served at all
/// while the store is away (each instance then admits one such request where the shares
/// would round to less).
fn compile(l: &config::Limit, divide_by: u32, floor: u32) -> Limit {
    let share = |n: std::num::NonZeroU32| {
        let part = (n.get() / divide_by).max(floor.min(n.get()));
        std::num::NonZeroU32::new(part).unwrap_or(std::num::NonZeroU32::MIN)
    };
    let algorithm = match l.algorithm {
        config::Algorithm::TokenBucket { burst } => Algorithm::TokenBucket {
            burst: share(burst),
        },
        config::Algorithm::FixedWindow => Algorithm::FixedWindow,
        config::Algorithm::SlidingWindow => Algorithm::SlidingWindow,
        config::Algorithm::Concurrency => Algorithm::Concurrency,
    };
    // A concurrency limit's window only paces the sweep of its table.
    let window = l.window.unwrap_or(Duration::from_secs(1));
    let limit =
        Limit::new(l.name.clone(), algorithm, share(l.quota), window).expect("validated limit");
    let limit = match l.block_for {
        Some(b) => limit.with_block_for(b).expect("validated block_for"),
        None => limit,
    };
    let limit = limit
        .with_max_keys(l.max_keys.get() as usize)
        .expect("validated max_keys");
    match l.mode {
        Mode::Delay { max_delay } => limit
            .with_max_delay(max_delay)
            .expect("validated max_delay"),
        Mode::Enforce | Mode::DryRun => limit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_limiter::SystemClock;

    /// A gateway with one route, "one"; the tests add their routes and limits.
    const ROUTE_ONE: &str = r#"
[gateway]
listen = "127.0.0.1:0"
[identity]
api_key = ["header:x-api-key"]
[upstreams.app]
url = "http://127.0.0.1:1"
[[routes]]
name = "one"
path = "/one"
upstream = "app"
"#;

    const CONFIG: &str = r#"
[[routes]]
name = "two"
path = "/two"
upstream = "app"
[[limits]]
name = "per-route"
by = "route"
quota = 10
window = "1s"
[[limits]]
name = "everyone"
by = "global"
quota = 10
window = "1s"
[[limits]]
name = "per-ip-and-route"
by = ["ip", "route"]
quota = 10
window = "1s"
[[limits]]
name = "per-key-dry"
by = "api_key"
quota = 10
window = "1s"
mode = "dry_run"
"#;

    fn keys(quota: &Quota, ip: &str, api_key: &[u8], route: usize) -> Vec<(LimitId, Key)> {
        let headers = HeaderMap::new();
        let caller = Caller {
            ip: ip.parse().unwrap(),
            api_key: Some(api_key),
            route,
            headers: &headers,
        };
        let layers = quota.layers(&caller);
        layers.enforced.into_iter().chain(layers.dry_run).collect()
    }

    #[tokio::test]
    async fn a_key_header_sent_twice_with_different_values_is_found() {
        // Both limits on route "one" only; "two" and unrouted requests are not counted by them
        // (a dry-run limit by the header on "two" refuses nothing, so it is not checked).
        let config = format!(
            "{ROUTE_ONE}[[routes]]\nname = \"two\"\npath = \"/two\"\nupstream = \"app\"\n\
             [[limits]]\nname = \"t\"\nby = [\"header:x-tenant\", \"ip\"]\nquota = 1\nwindow = \"1s\"\nroutes = [\"one\"]\n\
             [[limits]]\nname = \"u\"\nby = \"header:X-Tenant\"\nquota = 1\nwindow = \"1s\"\nroutes = [\"one\"]\n\
             [[limits]]\nname = \"d\"\nby = \"header:x-tenant\"\nquota = 1\nwindow = \"1s\"\nroutes = [\"two\"]\nmode = \"dry_run\"\n"
        );
        let config = sluice_config::parse(&config, "test.toml".as_ref()).unwrap();
        let quota = Quota::new(&config, Arc::new(SystemClock::new()))
            .await
            .unwrap();
        assert_eq!(quota.key_headers.len(), 1, "each header once");
        let headers = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(
                    "x-tenant",
                    http::HeaderValue::from_bytes(v.as_bytes()).unwrap(),
                );
            }
            h.append("x-other", "1".parse().unwrap());
            h.append("x-other", "2".parse().unwrap());
            h
        };
        let found = quota.bad_key_header(&headers(&["a", "b"]), 0);
        assert_eq!(
            found.map(|(h, why)| (h.as_str(), why)),
            Some(("x-tenant", KeyHeader::Twice))
        );
        // An empty value beside another is another value: an upstream reading the first
        // sees no tenant (review).
        for twice in [&["", "a"][..], &["a", ""], &["", " a "]] {
            let found = quota.bad_key_header(&headers(twice), 0);
            assert_eq!(
                found.map(|(_, why)| why),
                Some(KeyHeader::Twice),
                "{twice:?}"
            );
        }
        // A byte outside ASCII (here U+00A0, which Python's `str.strip()` would take off the
        // end, so that every such spelling were one caller upstream and many here).
        for not_ascii in [&["a\u{a0}"][..], &["a", "a\u{a0}"], &["\u{a0}a", "a"]] {
            let found = quota.bad_key_header(&headers(not_ascii), 0);
            assert_eq!(
                found.map(|(_, why)| why),
                Some(KeyHeader::NotAscii),
                "{not_ascii:?}"
            );
        }
        for fine in [
            &[][..],
            &["a"],
            &["a", "a"],
            &["a", " a"],
            &["", " "],
            &["a b"],
        ] {
            assert_eq!(quota.bad_key_header(&headers(fine), 0), None, "{fine:?}");
        }
        // Where no limit counts by the header, it is the upstream's business.
        for elsewhere in [1, quota.unrouted()] {
            let twice = headers(&["a", "b"]);
            assert_eq!(quota.bad_key_header(&twice, elsewhere), None);
            let not_ascii = headers(&["a\u{a0}"]);
            assert_eq!(quota.bad_key_header(&not_ascii, elsewhere), None);
        }
        // An empty value is no value, as an empty API key is no key: such a request is outside
        // both limits, not in one bucket with every caller who sends the header empty.
        let keyed = |values: &[&str]| {
            let headers = headers(values);
            let caller = Caller {
                ip: "192.0.2.1".parse().unwrap(),
                api_key: None,
                route: 0,
                headers: &headers,
            };
            let layers = quota.layers(&caller);
            layers.enforced.to_vec()
        };
        assert_eq!(keyed(&["a"]).len(), 2);
        assert_eq!(keyed(&[""]), []);
        assert_eq!(keyed(&[" "]), []);
        assert_eq!(keyed(&["", "a"]), keyed(&["a"]));
        assert_eq!(keyed(&[" a "]), keyed(&["a"]));
    }

    #[tokio::test]
    async fn keys_made_at_start_are_the_keys_a_request_would_make() {
        let config = format!("{ROUTE_ONE}{CONFIG}");
        let config = sluice_config::parse(&config, "test.toml".as_ref()).unwrap();
        let mut quota = Quota::new(&config, Arc::new(SystemClock::new()))
            .await
            .unwrap();
        let a = keys(&quota, "192.0.2.1", b"a", 0);
        assert_eq!(a.len(), 4);
        let fixed = |q: &Quota| {
            q.by_route
                .iter()
                .flat_map(|r| r.enforced.iter().chain(&r.dry_run))
                .filter(|(_, k)| k.is_some())
                .count()
        };
        assert_eq!(fixed(&quota), 4, "per-route and global, on both routes");
        // Each caller's limits come first, then those all callers share (route and global,
        // in the file's order), so that a caller over its own quota is refused before it
        // charges what everyone shares.
        for route in &quota.by_route {
            let shared: Vec<bool> = route.enforced.iter().map(|(_, k)| k.is_some()).collect();
            assert!(shared.is_sorted(), "{shared:?}");
        }
        // Enforced: per-ip-and-route, then per-route and global; then the dry-run per-key.
        // Route and global keys are the same for every caller; the others are not.
        let b = keys(&quota, "192.0.2.2", b"b", 0);
        assert_eq!((a[1], a[2]), (b[1], b[2]));
        assert_ne!(a[0], b[0]);
        assert_ne!(a[3], b[3]);
        let other_route = keys(&quota, "192.0.2.1", b"a", 1);
        assert_ne!(a[1], other_route[1], "per-route differs between routes");
        assert_eq!(a[2], other_route[2], "global does not");
        // Without the keys made at start, every request makes the same keys itself.
        for route in &mut quota.by_route {
            for (_, fixed) in route.enforced.iter_mut().chain(route.dry_run.iter_mut()) {
                *fixed = None;
            }
        }
        assert_eq!(keys(&quota, "192.0.2.1", b"a", 0), a);
        assert_eq!(keys(&quota, "192.0.2.1", b"a", 1), other_route);
    }

    /// A `delay` limit of one token refilled every 500 ms, held at most 750 ms, and a
    /// dry-run window of two, both by API key; the limiter's clock stands still.
    async fn held_quota() -> (Quota, Arc<sluice_limiter::ManualClock>) {
        let limits = r#"
[[limits]]
name = "smooth"
by = "api_key"
quota = 2
window = "1s"
burst = 1
mode = "delay"
max_delay = "750ms"
[[limits]]
name = "trial"
by = "api_key"
algorithm = "fixed_window"
quota = 2
window = "1h"
mode = "dry_run"
"#;
        let config = format!("{ROUTE_ONE}{limits}");
        let config = sluice_config::parse(&config, "test.toml".as_ref()).unwrap();
        let clock = Arc::new(sluice_limiter::ManualClock::new(sluice_limiter::Nanos(
            1_700_000_000_000_000_000,
        )));
        (Quota::new(&config, clock.clone()).await.unwrap(), clock)
    }

    fn caller_k(headers: &HeaderMap) -> Caller<'_> {
        Caller {
            ip: "192.0.2.1".parse().unwrap(),
            api_key: Some(b"k"),
            route: 0,
            headers,
        }
    }

    fn log() -> AccessLog {
        let req = http::Request::get("/one").body(()).unwrap();
        AccessLog::start(
            &req,
            [192, 0, 2, 1].into(),
            &http::HeaderValue::from_static("id"),
        )
    }

    /// A clock a nanosecond later at every reading, as a real one is between two readings.
    struct Ticking(std::sync::atomic::AtomicU64);

    impl sluice_limiter::Clock for Ticking {
        fn now(&self) -> sluice_limiter::Nanos {
            sluice_limiter::Nanos(self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
        }
    }

    /// A 503 tells a caller its figures as they stand, nothing having been charged: a fresh
    /// caller's bucket is full (review: a new key was shown `r=9;t=1` of a burst of 10, the
    /// refund's time being read after the figures').
    #[tokio::test]
    async fn a_503_shows_a_fresh_caller_its_whole_bucket() {
        let limits = r#"
[[limits]]
name = "tb"
by = "api_key"
quota = 5
window = "1s"
burst = 10
[[limits]]
name = "fw"
by = "api_key"
algorithm = "fixed_window"
quota = 10
window = "1h"
"#;
        let config = format!("{ROUTE_ONE}{limits}");
        let config = sluice_config::parse(&config, "test.toml".as_ref()).unwrap();
        let clock = Arc::new(Ticking(std::sync::atomic::AtomicU64::new(
            1_700_000_000_000_000_000,
        )));
        let quota = Quota::new(&config, clock).await.unwrap();
        let capacity = Capacity::new(1);
        let _full = capacity.try_acquire().expect("the one place");
        let headers = HeaderMap::new();
        let layers = quota.layers(&caller_k(&headers));
        for _ in 0..3 {
            let mut reports = Reports::new();
            let answer = quota.decide_in_memory(&layers, 1, &capacity, None, &mut reports);
            assert!(matches!(answer, Decided::Now(Err(Stop::Overloaded))));
            let figures: Vec<_> = reports
                .iter()
                .map(|(_, r)| (r.remaining, r.reset))
                .collect();
            assert_eq!(
                figures,
                [(10, Some(Duration::ZERO)), (10, Some(Duration::ZERO))],
                "{reports:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_request_dropped_while_held_has_its_dry_run_charges_withdrawn_too() {
        let (quota, _) = held_quota().await;
        let capacity = Capacity::new(64);
        let headers = HeaderMap::new();
        let layers = quota.layers(&caller_k(&headers));
        let decide = || quota.decide_in_memory(&layers, 1, &capacity, None, &mut Reports::new());
        let first = decide();
        assert!(
            matches!(first, Decided::Now(Ok(_))),
            "the bucket's one token"
        );
        let Decided::Later(hold) = decide() else {
            panic!("held")
        };
        // Held 500 ms; its client leaves after 10.
        let (mut log, mut reports) = (log(), Reports::new());
        let notes = Notes {
            reports: &mut reports,
            log: &mut log,
        };
        let held = quota.hold(hold, &layers, &capacity, notes);
        let left = tokio::time::timeout(Duration::from_millis(10), held).await;
        assert!(left.is_err(), "still held when its client left");
        // Both its charges came back: the bucket's (nobody queued behind it) and the dry-run
        // window's, which would otherwise refuse this third request (its quota is two).
        let Decided::Later(third) = decide() else {
            panic!("held")
        };
        assert_eq!(third.outcome, Outcome::Delayed);
        assert_eq!(third.wait, Duration::from_millis(500));
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_request_takes_its_place_in_flight_when_it_passes_or_is_answered_503() {
        let (quota, clock) = held_quota().await;
        let capacity = Capacity::new(1);
        let headers = HeaderMap::new();
        let layers = quota.layers(&caller_k(&headers));
        let decide = || quota.decide_in_memory(&layers, 1, &capacity, None, &mut Reports::new());
        let Decided::Now(Ok(first)) = decide() else {
            panic!("the bucket's one token")
        };
        drop(first);
        // Held: the one place stays free, and the gateway ready, while it waits.
        let Decided::Later(hold) = decide() else {
            panic!("held")
        };
        assert_eq!((capacity.in_flight(), capacity.is_ready()), (0, true));
        // Someone else takes the place; when the hold ends the gateway is full: 503, and the
        // held request's charges come back (the next one waits 500 ms, not 1,000).
        let other = capacity.try_acquire().expect("free");
        let start = tokio::time::Instant::now();
        let (answer, reports) = hold_out(&quota, hold, &layers, &capacity).await;
        assert!(
            matches!(answer, Err(Stop::OverloadedAfterHold)),
            "{answer:?}"
        );
        assert_eq!(start.elapsed(), Duration::from_millis(500));
        // Its figures are the caller's as they stand after the withdrawal (the limiter's clock
        // stands still): the first request's token comes back in 500 ms, not the 1,000 its
        // own charge had made it (the dry-run limit is not shown).
        assert_eq!(reports.len(), 1, "{reports:?}");
        let smooth = reports[0].1;
        assert_eq!(
            (smooth.remaining, smooth.reset),
            (0, Some(Duration::from_millis(500)))
        );
        drop(other);
        let Decided::Later(hold) = decide() else {
            panic!("held")
        };
        assert_eq!(hold.wait, Duration::from_millis(500), "charges withdrawn");
        // A place free when the hold ends: it passes, and holds the place.
        let pass = hold_out(&quota, hold, &layers, &capacity)
            .await
            .0
            .expect("passes");
        assert_eq!(pass.outcome, Outcome::Delayed);
        assert_eq!(capacity.in_flight(), 1);
        drop(pass);
        clock.advance(Duration::from_millis(500));
        // Draining: a hold that ends within the grace is waited out; one that would end after
        // it is answered 503 at once rather than cut at exit, its charges withdrawn.
        let Decided::Later(hold) = decide() else {
            panic!("held")
        };
        assert_eq!(hold.wait, Duration::from_millis(500));
        capacity.start_draining(tokio::time::Instant::now() + Duration::from_millis(200));
        let start = tokio::time::Instant::now();
        let (answer, _) = hold_out(&quota, hold, &layers, &capacity).await;
        assert!(matches!(answer, Err(Stop::DrainingAfterHold)), "{answer:?}");
        assert_eq!(start.elapsed(), Duration::ZERO);
        let Decided::Later(hold) = decide() else {
            panic!("held")
        };
        assert_eq!(hold.wait, Duration::from_millis(500), "charges withdrawn");
        let capacity = Capacity::new(1);
        capacity.start_draining(tokio::time::Instant::now() + Duration::from_secs(10));
        assert!(hold_out(&quota, hold, &layers, &capacity).await.0.is_ok());
    }

    /// Holds `hold` out: the answer, and the figures for its headers.
    async fn hold_out(
        quota: &Quota,
        hold: memory::Hold,
        layers: &Layers,
        capacity: &Capacity,
    ) -> (Result<Pass, Stop>, Reports) {
        let (mut log, mut reports) = (log(), Reports::new());
        let notes = Notes {
            reports: &mut reports,
            log: &mut log,
        };
        let answer = quota.hold(hold, layers, capacity, notes).await;
        (answer, reports)
    }
}
