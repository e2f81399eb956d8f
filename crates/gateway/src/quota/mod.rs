//! The quota step: one all-or-nothing decision over every limit that applies to the route,
//! charging the route's cost; then the capacity step, which refunds the quota when the
//! gateway is full. `delay` limits hold a request until it would pass (as in-flight work);
//! `dry_run` limits are decided after admission and never refuse.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName};
use sluice_config::{self as config, Config, KeyPart, Mode};
use sluice_limiter::{
    Admission, Algorithm, Clock, Decision, Key, KeyHasher, Limit, LimitId, Limiter, Refusal, Report,
};
use smallvec::SmallVec;

use crate::capacity::{Capacity, InFlight};

/// Inline capacity for a request's limits; more spill to the heap.
const INLINE: usize = 8;

pub(crate) type Reports = SmallVec<[(LimitId, Report); INLINE]>;
type KeyedLayers = SmallVec<[(LimitId, Key); INLINE]>;

/// The limits of the configuration, compiled, with the limiter that decides them.
pub(crate) struct Quota {
    limiter: Limiter,
    clock: Arc<dyn Clock>,
    hasher: KeyHasher,
    pub(crate) limits: Vec<LimitInfo>,
    /// For each route (configuration index): the limits that apply, by mode.
    by_route: Vec<RouteLimits>,
}

/// What the gateway needs to know about a limit beyond its counters.
#[derive(Debug)]
pub(crate) struct LimitInfo {
    pub(crate) name: Arc<str>,
    parts: Vec<Part>,
    pub(crate) mode: Mode,
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

#[derive(Debug, Default)]
struct RouteLimits {
    enforced: SmallVec<[LimitId; INLINE]>,
    dry_run: SmallVec<[LimitId; 2]>,
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

/// An admitted request: its charges and slots live as long as its response body.
#[derive(Debug)]
pub(crate) struct Pass {
    pub(crate) slot: InFlight,
    pub(crate) held: Held,
    pub(crate) reports: Reports,
    pub(crate) outcome: Outcome,
}

/// Admissions kept until the response ends (concurrency slots are released on drop).
#[derive(Debug)]
pub(crate) struct Held {
    _enforced: Admission,
    _dry_run: Option<Admission>,
}

/// How a request fared, for the access log (nginx's `$limit_req_status` words).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Passed,
    Delayed,
    Rejected(LimitId),
    RejectedDryRun(LimitId),
    Overloaded,
}

/// A request that is not admitted.
#[derive(Debug)]
pub(crate) enum Stop {
    /// 429: the caller's quota (or a block) refused it. Boxed: it is large, and rare next to
    /// admissions.
    Quota(Box<(Refusal, Reports)>),
    /// The cost exceeds what a limit can ever hold (configuration prevents this).
    CostTooLarge(LimitId),
    /// 503: the gateway is full; nothing was charged.
    Overloaded,
}

impl Quota {
    pub(crate) fn new(config: &Config, clock: Arc<dyn Clock>) -> Self {
        let limiter = Limiter::new(config.limits.iter().map(compile))
            .expect("validated configuration has unique limit names");
        let id = |l: &config::Limit| {
            limiter
                .id(&l.name)
                .expect("every configured limit is in the limiter")
        };
        let by_route = (0..config.routes.len())
            .map(|r| {
                let mut limits = RouteLimits::default();
                for l in config
                    .limits
                    .iter()
                    .filter(|l| l.routes.as_ref().is_none_or(|rs| rs.contains(&r)))
                {
                    match l.mode {
                        Mode::DryRun => limits.dry_run.push(id(l)),
                        Mode::Enforce | Mode::Delay { .. } => limits.enforced.push(id(l)),
                    }
                }
                limits
            })
            .collect();
        let limits = config
            .limits
            .iter()
            .map(|l| LimitInfo {
                name: Arc::from(l.name.as_str()),
                parts: l.by.iter().map(part).collect(),
                mode: l.mode,
                config: l.clone(),
            })
            .collect();
        Self {
            limiter,
            clock,
            hasher: KeyHasher::new_random(),
            limits,
            by_route,
        }
    }

    pub(crate) fn info(&self, id: LimitId) -> &LimitInfo {
        &self.limits[id.index()]
    }

    /// A short, non-reversible fingerprint of an API key for logs (per-process seed).
    pub(crate) fn fingerprint(&self, api_key: &[u8]) -> String {
        let bytes = self.hasher.key(&[b"fingerprint", api_key]).to_bytes();
        bytes[..4].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Keys the request under every limit of its route. A limit whose key part is missing
    /// (no API key, no such header) does not apply.
    pub(crate) fn layers(&self, caller: &Caller<'_>) -> Layers {
        let route = &self.by_route[caller.route];
        let ip = match caller.ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        let route_bytes = (caller.route as u32).to_le_bytes();
        let key = |id: LimitId| -> Option<(LimitId, Key)> {
            let mut parts: SmallVec<[&[u8]; 4]> = SmallVec::new();
            for p in &self.limits[id.index()].parts {
                parts.push(match p {
                    Part::Ip => &ip,
                    Part::ApiKey => caller.api_key?,
                    Part::Route => &route_bytes,
                    Part::Global => b"",
                    Part::Header(h) => caller.headers.get(h)?.as_bytes(),
                });
            }
            Some((id, self.hasher.key(&parts)))
        };
        Layers {
            enforced: route.enforced.iter().filter_map(|id| key(*id)).collect(),
            dry_run: route.dry_run.iter().filter_map(|id| key(*id)).collect(),
        }
    }

    /// Quota, then capacity: admits the request or says why not. Nothing is charged unless
    /// the request is admitted.
    pub(crate) async fn admit(
        &self,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
    ) -> Result<Pass, Stop> {
        let start = tokio::time::Instant::now();
        let mut slot: Option<InFlight> = None;
        let mut delayed = false;
        loop {
            let now = self.clock.now();
            match self.limiter.decide(&layers.enforced, cost, now) {
                Decision::Admitted(admission) => {
                    let reports = admission
                        .reports(&self.limiter)
                        .map(|r| (r.limit, r))
                        .collect();
                    let Some(slot) = slot.or_else(|| capacity.try_acquire()) else {
                        self.limiter.refund(admission);
                        return Err(Stop::Overloaded);
                    };
                    let (dry_run, dry_refused) = self.dry_run(layers, cost);
                    let outcome = match (dry_refused, delayed) {
                        (Some(id), _) => Outcome::RejectedDryRun(id),
                        (None, true) => Outcome::Delayed,
                        (None, false) => Outcome::Passed,
                    };
                    return Ok(Pass {
                        slot,
                        held: Held {
                            _enforced: admission,
                            _dry_run: dry_run,
                        },
                        reports,
                        outcome,
                    });
                }
                Decision::Refused(refusal) => {
                    let Some(wait) = self.delay_for(&refusal, start.elapsed()) else {
                        let reports = refusal
                            .reports(&self.limiter)
                            .map(|r| (r.limit, r))
                            .collect();
                        return Err(Stop::Quota(Box::new((refusal, reports))));
                    };
                    // Held requests are in-flight work: a full gateway cannot hold more.
                    if slot.is_none() {
                        slot = Some(capacity.try_acquire().ok_or(Stop::Overloaded)?);
                    }
                    delayed = true;
                    tokio::time::sleep(wait).await;
                }
                Decision::CostTooLarge(c) => return Err(Stop::CostTooLarge(c.limit())),
            }
        }
    }

    /// Dry-run limits are decided (and charged) like enforced ones, but never refuse.
    fn dry_run(&self, layers: &Layers, cost: u32) -> (Option<Admission>, Option<LimitId>) {
        if layers.dry_run.is_empty() {
            return (None, None);
        }
        match self.limiter.decide(&layers.dry_run, cost, self.clock.now()) {
            Decision::Admitted(a) => (Some(a), None),
            Decision::Refused(r) => (None, Some(r.limit())),
            Decision::CostTooLarge(c) => (None, Some(c.limit())),
        }
    }

    /// How long to hold a refused request: only when every refusing limit is in `delay` mode
    /// and the request would pass within each one's `max_delay`, counted from arrival.
    fn delay_for(&self, refusal: &Refusal, waited: Duration) -> Option<Duration> {
        let mut longest = Duration::ZERO;
        for (id, wait) in refusal.refusing(&self.limiter) {
            let Mode::Delay { max_delay } = self.limits[id.index()].mode else {
                return None;
            };
            let wait = wait?;
            if waited + wait > max_delay {
                return None;
            }
            longest = longest.max(wait);
        }
        Some(longest)
    }

    /// Removes keys that returned to their fresh state (each table at most once per window).
    pub(crate) fn sweep(&self) -> usize {
        self.limiter.sweep(self.clock.now())
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

fn compile(l: &config::Limit) -> Limit {
    let algorithm = match l.algorithm {
        config::Algorithm::TokenBucket { burst } => Algorithm::TokenBucket { burst },
        config::Algorithm::FixedWindow => Algorithm::FixedWindow,
        config::Algorithm::SlidingWindow => Algorithm::SlidingWindow,
        config::Algorithm::Concurrency => Algorithm::Concurrency,
    };
    // A concurrency limit's window only paces the sweep of its table.
    let window = l.window.unwrap_or(Duration::from_secs(1));
    let limit = Limit::new(l.name.clone(), algorithm, l.quota, window).expect("validated limit");
    match l.block_for {
        Some(b) => limit.with_block_for(b).expect("validated block_for"),
        None => limit,
    }
}
