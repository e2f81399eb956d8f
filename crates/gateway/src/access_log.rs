//! The access log: one line per request, written when the response body ends or the client
//! goes away (so `total_ms` covers the whole exchange), through `tracing` target `access`.

use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderValue, Method, Request, StatusCode, Uri};
use tokio::time::Instant;

use crate::capacity::Capacity;
use crate::quota::{Outcome, Quota};

/// What the access-log line will say about one request. Logged on drop. Inert when access
/// lines are not written (`SLUICE_LOG` below `info` for target `access`): the request then
/// pays for no copies of its method, path and id, and no reading of the clock.
#[derive(Debug)]
pub(crate) struct AccessLog(Option<Box<Line>>);

#[derive(Debug)]
struct Line {
    method: Method,
    /// The path only: a query string may carry an API key.
    uri: Uri,
    client: IpAddr,
    request_id: HeaderValue,
    route: Option<Arc<str>>,
    key: Option<String>,
    decision: Option<&'static str>,
    policy: Option<Arc<str>>,
    status: Option<StatusCode>,
    start: Instant,
    /// When the request went to its upstream, in ms after `start`.
    upstream_start: Option<f64>,
    /// How long the upstream took to answer its head.
    upstream_ms: Option<f64>,
    bytes: u64,
    body_failed: bool,
    /// Tells whether the request was cut at the end of the shutdown grace (see
    /// [`AccessLog::watch_cut`]).
    cut: Option<Capacity>,
    /// The connection asked for the response's body (its head is on its way).
    body_begun: bool,
    /// The response's last byte was handed to the connection: nothing was cut.
    ended: bool,
    /// A tunnel's bytes each way and how it ended, written when it closes.
    tunnel: Option<(u64, u64, &'static str)>,
}

impl AccessLog {
    pub(crate) fn start<B>(req: &Request<B>, client: IpAddr, request_id: &HeaderValue) -> Self {
        if !enabled() {
            return AccessLog(None);
        }
        AccessLog(Some(Box::new(Line {
            method: req.method().clone(),
            uri: req.uri().clone(),
            client,
            request_id: request_id.clone(),
            route: None,
            key: None,
            decision: None,
            policy: None,
            status: None,
            start: Instant::now(),
            upstream_start: None,
            upstream_ms: None,
            bytes: 0,
            body_failed: false,
            cut: None,
            body_begun: false,
            ended: false,
            tunnel: None,
        })))
    }

    /// Whether the line will be written.
    pub(crate) fn is_on(&self) -> bool {
        self.0.is_some()
    }

    pub(crate) fn route(&mut self, name: &Arc<str>) {
        if let Some(l) = &mut self.0 {
            l.route = Some(Arc::clone(name));
        }
    }

    /// The client as identified (behind trusted proxies, not the TCP peer).
    pub(crate) fn client(&mut self, ip: IpAddr) {
        if let Some(l) = &mut self.0 {
            l.client = ip;
        }
    }

    /// A fingerprint of the API key: raw keys never reach logs.
    pub(crate) fn key(&mut self, fingerprint: String) {
        if let Some(l) = &mut self.0 {
            l.key = Some(fingerprint);
        }
    }

    /// The limiter's verdict, nginx-style, with the policy it concerns.
    pub(crate) fn outcome(&mut self, outcome: Outcome, quota: &Quota) {
        let Some(l) = &mut self.0 else { return };
        let (word, policy) = match outcome {
            Outcome::Passed => ("PASSED", None),
            Outcome::Delayed => ("DELAYED", None),
            Outcome::Rejected(id) => ("REJECTED", Some(id)),
            Outcome::RejectedDryRun(id) => ("REJECTED_DRY_RUN", Some(id)),
            Outcome::Overloaded => ("OVERLOADED", None),
            Outcome::Draining => ("DRAINING", None),
            Outcome::StoreUnavailable => ("STORE_UNAVAILABLE", None),
            Outcome::Unchecked => ("UNCHECKED", None),
        };
        l.decision = Some(word);
        // The policy the answer's problem body names (a 404's names none, but the line says
        // why its request was not counted).
        l.policy = match (outcome, policy) {
            (Outcome::Overloaded, _) => Some(Arc::from("server-capacity")),
            (Outcome::Draining, _) => Some(Arc::from("server-draining")),
            (Outcome::StoreUnavailable | Outcome::Unchecked, _) => Some(Arc::from("quota-store")),
            (_, Some(id)) => Some(quota.info(id).name.clone()),
            _ => None,
        };
    }

    pub(crate) fn status(&mut self, status: StatusCode) {
        if let Some(l) = &mut self.0 {
            l.status = Some(status);
        }
    }

    /// Marks the moment the request goes to its upstream (after any `delay` hold).
    pub(crate) fn upstream_start(&mut self) {
        if let Some(l) = &mut self.0 {
            l.upstream_start = Some(ms_since(l.start));
        }
    }

    /// Marks the moment the upstream's response head arrived: `upstream_ms` is the time since
    /// [`AccessLog::upstream_start`]. A request that ends before (its client gone, say) is
    /// logged with the time it waited.
    pub(crate) fn upstream_done(&mut self) {
        if let Some(l) = &mut self.0 {
            let before = l.upstream_start.unwrap_or(0.0);
            l.upstream_ms = Some(ms_since(l.start) - before);
        }
    }

    /// Lets the line say `cut = "shutdown"` when the request ends because the shutdown grace
    /// ran out (not because its client left).
    pub(crate) fn watch_cut(&mut self, capacity: &Capacity) {
        if let Some(l) = &mut self.0 {
            l.cut = Some(capacity.clone());
        }
    }

    /// The response's last byte went to the connection: the request ended whole, even if the
    /// shutdown grace ran out just after (review: after a second signal, held requests' complete
    /// 503s were logged `cut = "shutdown"`).
    pub(crate) fn ended(&mut self) {
        if let Some(l) = &mut self.0 {
            l.ended = true;
        }
    }

    /// The connection asked for the response's body: its head was sent, or is on its way.
    pub(crate) fn body_begun(&mut self) {
        if let Some(l) = &mut self.0 {
            l.body_begun = true;
        }
    }

    pub(crate) fn add_bytes(&mut self, n: usize) {
        if let Some(l) = &mut self.0 {
            l.bytes += n as u64;
        }
    }

    /// Takes the line over, for a tunnel to write when it closes (a protocol switch's
    /// exchange lasts as long as the tunnel); this one is left inert.
    pub(crate) fn take(&mut self) -> AccessLog {
        AccessLog(self.0.take())
    }

    /// A tunnel's end: bytes from the client (`up`) and to it (`down`), and why it ended.
    pub(crate) fn tunnel(&mut self, up: u64, down: u64, end: &'static str) {
        if let Some(l) = &mut self.0 {
            l.bytes = down;
            l.tunnel = Some((up, down, end));
        }
    }

    pub(crate) fn upstream_body_failed(&mut self) {
        if let Some(l) = &mut self.0 {
            l.body_failed = true;
        }
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        let Some(l) = &self.0 else { return };
        // 499: the client went away before a response head was sent (nginx's convention), or
        // the request was cut at the end of the shutdown grace (said by `cut`).
        let status = l.status.map_or(499, |s| s.as_u16());
        // To the microsecond: a difference of two float milliseconds reads 0.5569999999999999.
        let upstream_ms = l
            .upstream_ms
            .or_else(|| l.upstream_start.map(|s| ms_since(l.start) - s))
            .map(|ms| (ms * 1000.0).round() / 1000.0);
        // Cut at the shutdown grace's end; or, its body asked for and not ended, without the
        // upstream's body failing: the client went away (an HTTP/1.1 connection closed, an
        // HTTP/2 stream reset) or was dropped for not reading (`send_timeout`), mid-body or
        // before its first byte (a long poll given up). A body never asked for (`HEAD`, 204,
        // 304, an empty one) is no cut.
        let cut = if l.ended {
            None
        } else if l.cut.as_ref().is_some_and(Capacity::is_cut) {
            Some("shutdown")
        } else if l.body_begun && !l.body_failed && l.tunnel.is_none() {
            Some("client")
        } else {
            None
        };
        let (tunnel_up, tunnel_down, tunnel_end) = match l.tunnel {
            Some((up, down, end)) => (Some(up), Some(down), Some(end)),
            None => (None, None, None),
        };
        tracing::info!(
            target: "access",
            method = &*shown(l.method.as_str()),
            path = &*shown(l.uri.path()),
            route = l.route.as_deref().unwrap_or("-"),
            key = l.key.as_deref(),
            decision = l.decision,
            policy = l.policy.as_deref(),
            status,
            client = %l.client,
            request_id = l.request_id.to_str().unwrap_or("-"),
            upstream_ms,
            total_ms = ms_since(l.start),
            bytes = l.bytes,
            body_failed = l.body_failed,
            cut,
            tunnel_up,
            tunnel_down,
            tunnel_end,
            "request"
        );
    }
}

/// Whether access-log lines are written at all (level `info` for target `access`).
fn enabled() -> bool {
    tracing::enabled!(target: "access", tracing::Level::INFO)
}

/// The longest path or method written whole: a longer one (up to the 64 KiB a head may
/// hold) is cut there and marked, so that a line stays under the 16 KiB at which log shippers
/// (Docker's json-file driver) split lines and break the JSON. (The request id is at most 128
/// bytes, the other fields are the gateway's.)
const MAX_LOGGED: usize = 4096;

/// `text` as logged: characters a reader of the log could take for something else written as
/// `\u{..}` (controls, C1's CSI among them, which terminals act on; U+2028 and U+2029, line
/// breaks to many readers; the bidirectional overrides, which turn text around on screen), a
/// backslash as `\\` (so that a path spelling `\u{9b}` is not read as one escaped), and cut
/// once it reaches [`MAX_LOGGED`] bytes, marked. An HTTP/2 `:path` may hold such characters
/// (review: the JSON format wrote them raw).
fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    let odd = |c: char| {
        c.is_control()
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{feff}')
    };
    let plain = text.len() <= MAX_LOGGED
        && !text.contains('\\')
        && (text.bytes().all(|b| (b' '..=b'~').contains(&b)) || !text.chars().any(odd));
    if plain {
        return text.into();
    }
    let mut out = String::with_capacity(text.len().min(MAX_LOGGED) + 32);
    let mut taken = 0;
    for c in text.chars() {
        if out.len() >= MAX_LOGGED {
            break;
        }
        taken += c.len_utf8();
        if odd(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else if c == '\\' {
            out.push_str("\\\\");
        } else {
            out.push(c);
        }
    }
    if taken < text.len() {
        out.push_str(&format!("...(cut, {} bytes)", text.len()));
    }
    out.into()
}

fn ms_since(start: Instant) -> f64 {
    (start.elapsed().as_micros() as f64) / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata};

    #[test]
    fn long_paths_are_cut_and_marked() {
        assert_eq!(shown("/a/b"), "/a/b");
        let long = format!("/{}", "x".repeat(70_000));
        let cut = shown(&long);
        assert!(cut.len() < MAX_LOGGED + 40, "{}", cut.len());
        assert!(cut.ends_with("...(cut, 70001 bytes)"));
    }

    /// What a reader of the log could take for something else is written escaped, in either
    /// format (the JSON one writes what it is given).
    #[test]
    fn controls_line_breaks_and_direction_overrides_are_escaped() {
        assert_eq!(shown("/caf\u{e9}/x y"), "/caf\u{e9}/x y");
        assert_eq!(shown("/c1/\u{9b}31mRED"), "/c1/\\u{9b}31mRED");
        assert_eq!(shown("/bidi/\u{202e}gnp.exe"), "/bidi/\\u{202e}gnp.exe");
        assert_eq!(shown("/ls/a\u{2028}b\u{85}c"), "/ls/a\\u{2028}b\\u{85}c");
        let long = format!("/\u{9b}{}", "x".repeat(70_000));
        let cut = shown(&long);
        assert!(
            cut.starts_with("/\\u{9b}xx") && cut.ends_with("bytes)"),
            "{cut}"
        );
        // A backslash is escaped too: the spelling of an escape is not the escape.
        assert_eq!(shown("/bs/\\u{9b}"), "/bs/\\\\u{9b}");
        // Cut after escaping, so that escapes cannot take a line past its bound.
        let escapes = "\u{85}".repeat(4_000);
        let cut = shown(&escapes);
        assert!(cut.len() < MAX_LOGGED + 40, "{}", cut.len());
        assert!(cut.ends_with("...(cut, 8000 bytes)"), "{cut}");
    }

    /// Counts the events it is given; `level` is the most verbose it wants.
    struct Counting {
        level: tracing::Level,
        events: std::sync::atomic::AtomicUsize,
    }

    impl tracing::Subscriber for Counting {
        fn enabled(&self, m: &Metadata<'_>) -> bool {
            *m.level() <= self.level
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, _: &Event<'_>) {
            self.events
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    /// Whether a request's log is on, and how many lines it wrote, under `level`.
    fn run(level: tracing::Level) -> (bool, usize) {
        let sub = std::sync::Arc::new(Counting {
            level,
            events: Default::default(),
        });
        let on = tracing::subscriber::with_default(std::sync::Arc::clone(&sub), || {
            let req = Request::get("/a?k=secret").body(()).unwrap();
            let mut log = AccessLog::start(
                &req,
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                &"id".parse().unwrap(),
            );
            log.status(StatusCode::OK);
            log.is_on()
        });
        (on, sub.events.load(std::sync::atomic::Ordering::Relaxed))
    }

    #[test]
    fn a_log_that_is_not_written_costs_nothing_and_writes_nothing() {
        assert_eq!(run(tracing::Level::WARN), (false, 0));
        assert_eq!(run(tracing::Level::INFO), (true, 1));
    }
}
