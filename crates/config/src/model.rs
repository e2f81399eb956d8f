//! The validated configuration. Every value here has been checked: a `Config` that exists is
//! one sluice can run.

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use crate::Cidr;

/// A whole, validated sluice configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The main listener and its capacity.
    pub gateway: Gateway,
    /// The admin listener (`/live`, `/ready`).
    pub admin: Admin,
    /// How callers are identified.
    pub identity: Identity,
    /// How responses and refusals are written.
    pub responses: Responses,
    /// Named upstream services, in file order.
    pub upstreams: Vec<Upstream>,
    /// Routes, in file order; matching picks the longest path prefix.
    pub routes: Vec<Route>,
    /// Limits, in file order.
    pub limits: Vec<Limit>,
    /// Where counters live: this instance's memory, or a Redis shared by instances.
    pub store: Store,
}

/// `[gateway]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Gateway {
    /// Address of the main listener.
    pub listen: SocketAddr,
    /// Admitted, unfinished requests at which the gateway is full.
    pub max_in_flight: NonZeroUsize,
    /// Requests held by `delay` limits at once; past it, such limits refuse what they would hold.
    pub max_held: NonZeroUsize,
    /// Client connections open at once on the main listener (`None`: half the process's
    /// open-files limit, decided at start).
    pub max_connections: Option<NonZeroUsize>,
    /// Client connections open at once from one client address (IPv6 by its
    /// `identity.ipv6_prefix` network), trusted proxies aside (`None`: no such cap).
    pub max_connections_per_ip: Option<NonZeroUsize>,
    /// A path on the main listener answered 200 (503 when full or draining), outside every limit.
    pub health_path: Option<String>,
    /// Time a client has to finish sending its request head.
    pub header_timeout: Duration,
    /// Time a response being sent may go without a byte moving on its connection.
    pub send_timeout: Duration,
    /// The largest request body forwarded, in bytes (`None`: no limit).
    pub max_body_size: Option<u64>,
    /// Time in-flight requests get to finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// Time between SIGTERM and the start of the drain, during which readiness fails but the
    /// main listener still accepts and serves (zero: the drain starts at once).
    pub drain_delay: Duration,
    /// The range a 503's `Retry-After` is drawn from.
    pub overload_retry_after: RetryRange,
    /// Whether runs of slashes in a request's path are merged into one (see [`crate::path`]).
    pub merge_slashes: bool,
    /// Whether a request no route matches is counted by the per-caller limits that apply to
    /// every route, before its 404.
    pub count_unrouted: bool,
    /// The slowest a request body may arrive (`None`: no minimum).
    pub min_body_rate: Option<MinBodyRate>,
}

/// A minimum rate for request bodies, as Kestrel's `MinRequestBodyDataRate`: after `grace`,
/// a body still arriving must average at least `bytes_per_second` since it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinBodyRate {
    /// Bytes per second, averaged from the start of the body.
    pub bytes_per_second: u64,
    /// Time a body has before the rate is asked of it.
    pub grace: Duration,
}

/// A range of whole seconds, `min <= max`, both at least one second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryRange {
    /// Shortest wait.
    pub min: Duration,
    /// Longest wait.
    pub max: Duration,
}

/// `[admin]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admin {
    /// Address of the admin listener.
    pub listen: SocketAddr,
}

/// `[identity]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Where a caller's API key is read, first found wins.
    pub api_key: Vec<KeySource>,
    /// Peers whose `client_ip_header` is believed.
    pub trusted_proxies: Vec<Cidr>,
    /// The one header trusted proxies give the client's address in.
    pub client_ip_header: ClientIpHeader,
    /// IPv6 clients are counted per network of this many bits.
    pub ipv6_prefix: u8,
}

/// The header trusted proxies append the client's address to. One, not both: a proxy passes
/// on the header it does not write as the client sent it, so reading that one would let the
/// client choose its own address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientIpHeader {
    /// `X-Forwarded-For` (HAProxy's `option forwardfor`, nginx, cloud load balancers).
    XForwardedFor,
    /// `Forwarded` (RFC 7239), its `for=` parameters.
    Forwarded,
}

/// One place an API key can be read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A request header (name lower-cased).
    Header(String),
    /// `Authorization: Bearer <key>`.
    Bearer,
    /// A query-string parameter.
    Query(String),
}

/// `[responses]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Responses {
    /// Prefix of problem `type` URIs: `problem_base` + `quota-exceeded`.
    pub problem_base: String,
    /// Also send `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
    pub legacy_headers: bool,
}

/// `[upstreams.<name>]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// The table name.
    pub name: String,
    /// `http://host:port`, no path.
    pub url: http::Uri,
    /// Time allowed to open a TCP connection.
    pub connect_timeout: Duration,
    /// Time allowed until the upstream's response head arrives.
    pub timeout: Duration,
    /// The most idle connections each serving thread keeps open to this upstream (0: none,
    /// every connection closes after its request).
    pub idle_connections: u16,
    /// A tunnel (a switched protocol, e.g. WebSocket) through which no byte passed either way
    /// for this long is closed.
    pub tunnel_idle_timeout: Duration,
}

/// `[[routes]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Unique name, used by limits and logs.
    pub name: String,
    /// Path prefix, matched on segment boundaries.
    pub path: String,
    /// Methods matched; `None` matches every method.
    pub methods: Option<Vec<http::Method>>,
    /// Host matched (without port, lower case); `None` matches every host.
    pub host: Option<String>,
    /// Units of quota a request on this route costs.
    pub cost: NonZeroU32,
    /// What the gateway does with a matched request.
    pub action: RouteAction,
}

/// What a route does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteAction {
    /// Forward to `upstreams[index]`.
    Upstream(usize),
    /// Answer directly.
    Respond(Respond),
}

/// A fixed answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Respond {
    /// Status code.
    pub status: http::StatusCode,
    /// Body.
    pub body: String,
    /// `Content-Type` of the body.
    pub content_type: String,
}

/// `[[limits]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// Unique name, shown to callers as the policy.
    pub name: String,
    /// The parts of the key a caller is counted under.
    pub by: Vec<KeyPart>,
    /// How requests are counted.
    pub algorithm: Algorithm,
    /// Requests (cost units) per window, or requests in flight for `concurrency`.
    pub quota: NonZeroU32,
    /// The window; `None` only for `concurrency`.
    pub window: Option<Duration>,
    /// Routes (indices into `Config::routes`) the limit applies to; `None` means all.
    pub routes: Option<Vec<usize>>,
    /// Enforce, only report, or hold requests.
    pub mode: Mode,
    /// After a refusal, refuse the same key for this long.
    pub block_for: Option<Duration>,
    /// The most callers (keys) this instance remembers for the limit; past it, new ones
    /// evict others (of a sample, the one whose forgetting costs least).
    pub max_keys: NonZeroU32,
}

impl Limit {
    /// The largest cost a request can ever have under this limit, and what it is called (a
    /// token bucket's burst, a window's quota); `None` for concurrency, which takes one slot
    /// per request whatever the cost.
    pub fn capacity(&self) -> Option<(NonZeroU32, &'static str)> {
        match self.algorithm {
            Algorithm::TokenBucket { burst } => Some((burst, "burst")),
            Algorithm::FixedWindow | Algorithm::SlidingWindow => Some((self.quota, "quota")),
            Algorithm::Concurrency => None,
        }
    }

    /// Whether the limit applies to the route at `route` (an index into `Config::routes`).
    pub fn applies_to(&self, route: usize) -> bool {
        self.routes.as_ref().is_none_or(|rs| rs.contains(&route))
    }

    /// Whether the limit counts requests no route matches (when `gateway.count_unrouted`
    /// says so): a limit on every route that counts each caller apart (by IP, API key,
    /// header) and refuses. Not one by `route` (there is none) nor `global` (it guards the
    /// upstreams, which a 404 never reaches: a scanner would spend everyone's quota); not
    /// `concurrency` (a 404 is answered at once); not `delay` (holding a request for a path
    /// that does not exist helps nobody).
    pub fn counts_unrouted(&self) -> bool {
        self.routes.is_none()
            && self.algorithm != Algorithm::Concurrency
            && !matches!(self.mode, Mode::Delay { .. })
            && !self
                .by
                .iter()
                .any(|p| matches!(p, KeyPart::Route | KeyPart::Global))
    }
}

impl Route {
    /// Whether the route matches requests with `method`. Servers disagree here, and a request
    /// is then counted under the more specific route (see the paths): method names are
    /// compared ignoring ASCII case (RFC 9110 makes them case-sensitive, but some frameworks
    /// do not), and `GET` also matches `HEAD`, which most frameworks answer with the `GET`
    /// handler (as nginx's `limit_except GET` allows `HEAD` too).
    pub fn matches_method(&self, method: &http::Method) -> bool {
        self.methods
            .as_deref()
            .is_none_or(|ms| methods_match(ms.iter().map(http::Method::as_str), method.as_str()))
    }
}

/// Whether `method` is one of `methods`, by [`Route::matches_method`]'s rule.
pub(crate) fn methods_match<'a>(methods: impl IntoIterator<Item = &'a str>, method: &str) -> bool {
    let head = method.eq_ignore_ascii_case("HEAD");
    methods
        .into_iter()
        .any(|m| m == method || m.eq_ignore_ascii_case(method) || (head && m == "GET"))
}

/// A part of a limit's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// The client IP (IPv6 per `ipv6_prefix` network).
    Ip,
    /// The caller's API key.
    ApiKey,
    /// The matched route.
    Route,
    /// One bucket for everyone.
    Global,
    /// A request header's value (name lower-cased).
    Header(String),
}

/// A counting algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// GCRA with a bucket of `burst` (default: `quota`).
    TokenBucket {
        /// Bucket size.
        burst: NonZeroU32,
    },
    /// A counter per window aligned to the Unix epoch.
    FixedWindow,
    /// The two-counter sliding-window estimate.
    SlidingWindow,
    /// Requests in flight.
    Concurrency,
}

impl Algorithm {
    /// The name used in the TOML.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::TokenBucket { .. } => "token_bucket",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::Concurrency => "concurrency",
        }
    }
}

/// What a limit does when it would refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Refuse.
    Enforce,
    /// Never refuse; log and report what would have happened.
    DryRun,
    /// Hold the request up to `max_delay` until it would pass; refuse only beyond that.
    Delay {
        /// The longest a request is held.
        max_delay: Duration,
    },
}

/// `[store]`: where limits are counted.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Store {
    /// In this instance's memory (the default): each instance counts alone.
    #[default]
    Memory,
    /// In a Redis shared by every instance, so they share one budget per caller.
    Redis(RedisStore),
}

/// `[store]` with `kind = "redis"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisStore {
    /// `redis://host:port[/db]`, or `rediss://` for TLS.
    pub url: String,
    /// A decision Redis cannot give in this time follows `on_error`.
    pub timeout: Duration,
    /// What a request gets when Redis fails or is too slow.
    pub on_error: OnError,
    /// With `on_error = "local"`: how many instances share the quota, so each enforces
    /// `quota / instances` meanwhile.
    pub instances: NonZeroU32,
    /// The environment variable holding the secret of the keyed hash (read at run time).
    pub hash_secret_env: String,
}

/// What a request gets when the shared store cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// Admit (fail open).
    Allow,
    /// Refuse with 503 and `Retry-After`.
    Deny,
    /// Decide in this instance's memory with each quota divided by `instances`.
    Local,
}
