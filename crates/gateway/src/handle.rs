//! One request's walk through the gateway, in order:
//! health -> match route -> identify -> quota -> capacity -> forward or respond -> headers.
//! Every step that answers early returns a response; nothing jumps back.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use rand::Rng;
use sluice_config::{Config, Respond, RetryRange, RouteAction};
use sluice_limiter::{Clock, LimitId, Report};
use smallvec::SmallVec;

use crate::access_log::AccessLog;
use crate::advertise;
use crate::body::Body;
use crate::capacity::Capacity;
use crate::forward::{
    answer_dropped, bad_host, bad_target, max_forwards_spent, method_override, one_content_length,
    padded_value, prepare_request, set_upgrade, strip_hop_by_hop, switched_as_asked,
    unsupported_coding, upgrade_protocol, IdentityHeaders, Peer, UploadTail, UpstreamClient,
};
use crate::head_error::HeadErrors;
use crate::head_timeout::Busy;
use crate::identify::{Identify, KeyError, MAX_KEY_BYTES};
use crate::problem::{Charges, Problem};
use crate::quota::{Caller, KeyHeader, Notes, Outcome, Quota, Reports, Stop};
use crate::refusal::quota_exceeded;
use crate::request_id::{RequestIds, X_REQUEST_ID};
use crate::route::{bad_path, normalize_path, Router};
use crate::server::{
    check_max_connections, default_max_connections, ConnectionCap, MAX_HEADERS, MAX_HEAD_BYTES,
};

/// Everything a request needs, built once from the configuration.
#[derive(Debug)]
pub(crate) struct Shared {
    router: Router,
    route_names: Vec<Arc<str>>,
    upstreams: Vec<UpstreamClient>,
    pub(crate) identify: Identify,
    pub(crate) quota: Quota,
    pub(crate) capacity: Capacity,
    /// What requests no route matches take instead of a place in `max_in_flight`: they are
    /// answered at once, and a full gateway does not answer them 503.
    unrouted_capacity: Capacity,
    pub(crate) connections: ConnectionCap,
    health_path: Option<String>,
    /// `gateway.merge_slashes`: how request paths are brought to normal form.
    merge_slashes: bool,
    /// The headers callers are identified and counted by (API key sources, `Authorization`
    /// for bearer keys, headers limits count by, the client-IP header): a `Connection`
    /// header cannot remove them before the upstream sees them.
    identity_headers: IdentityHeaders,
    /// `gateway.min_body_rate`.
    min_body_rate: Option<sluice_config::MinBodyRate>,
    /// The largest request body forwarded (`u64::MAX`: no limit).
    max_body_size: u64,
    pub(crate) problem_base: String,
    /// Problem answers in place of hyper's own to request heads it refuses.
    pub(crate) head_errors: Arc<HeadErrors>,
    legacy_headers: bool,
    overload_retry_after: RetryRange,
    ids: RequestIds,
    /// Per route, then one for requests no route matches.
    policies: Vec<advertise::PolicyCache>,
}

impl Shared {
    /// Closes the upstream connections unused for [`crate::forward::IDLE_TIMEOUT`].
    pub(crate) fn close_idle_upstreams(&self, now: tokio::time::Instant) {
        for upstream in &self.upstreams {
            upstream.close_idle(now);
        }
    }

    pub(crate) async fn new(config: &Config, clock: Arc<dyn Clock>) -> Result<Self, String> {
        let identify = Identify::new(&config.identity);
        let quota = Quota::new(config, clock).await?;
        let mut identity_headers = identify.header_names();
        identity_headers.extend(quota.key_headers().iter().cloned());
        Ok(Self {
            router: Router::new(&config.routes),
            route_names: config
                .routes
                .iter()
                .map(|r| Arc::from(r.name.as_str()))
                .collect(),
            upstreams: config.upstreams.iter().map(UpstreamClient::new).collect(),
            identify,
            quota,
            identity_headers: IdentityHeaders::new(identity_headers),
            capacity: Capacity::with_max_held(
                config.gateway.max_in_flight.get(),
                config.gateway.max_held.get(),
            ),
            unrouted_capacity: Capacity::new(usize::MAX),
            connections: ConnectionCap::new(
                match config.gateway.max_connections {
                    Some(n) => {
                        check_max_connections(n.get(), config.gateway.max_in_flight.get());
                        n.get()
                    }
                    None => default_max_connections(config.gateway.max_in_flight.get()),
                },
                config.gateway.max_connections_per_ip.map(|n| n.get()),
                config.identity.ipv6_prefix,
            ),
            health_path: config.gateway.health_path.clone(),
            merge_slashes: config.gateway.merge_slashes,
            min_body_rate: config.gateway.min_body_rate,
            max_body_size: config.gateway.max_body_size.unwrap_or(u64::MAX),
            problem_base: config.responses.problem_base.clone(),
            head_errors: Arc::new(HeadErrors::new(&config.responses.problem_base)),
            legacy_headers: config.responses.legacy_headers,
            overload_retry_after: config.gateway.overload_retry_after,
            ids: RequestIds::new(),
            // One more for requests no route matches (`Quota::unrouted`).
            policies: (0..=config.routes.len())
                .map(|_| Default::default())
                .collect(),
        })
    }
}

/// About the size of a request head as it came: request line and header lines.
fn head_bytes<B>(req: &Request<B>) -> usize {
    let uri = req.uri();
    let target = uri.path_and_query().map_or(1, |p| p.as_str().len())
        + uri
            .authority()
            .map_or(0, |a| a.as_str().len() + "http://".len());
    let line = req.method().as_str().len() + target + " HTTP/1.1\r\n".len() + 1;
    let fields = req.headers().iter();
    line + fields
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum::<usize>()
}

/// hyper's service function for the main listener.
pub(crate) async fn handle(
    shared: Arc<Shared>,
    peer: Peer,
    mut busy: Busy,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let http2 = req.version() == http::Version::HTTP_2;
    let head_over_http2 = http2 && req.method() == http::Method::HEAD;
    if http2 {
        busy.http2();
    } else {
        busy.http1();
    }
    // Counted before the gateway adds its own (HTTP/1.1 past it never gets here), with
    // HTTP/2's cookie crumbs as the one field they are over HTTP/1.1.
    let too_many_headers = req.headers().len() > MAX_HEADERS && {
        let cookies = req.headers().get_all(http::header::COOKIE).iter().count();
        req.headers().len() - cookies.saturating_sub(1) > MAX_HEADERS
    };
    // hyper holds an HTTP/1.1 head to MAX_HEAD_BYTES only while it has nothing else buffered:
    // on a kept-alive connection a later head up to about twice that gets through. (HTTP/2's
    // header lists are held to it by the h2 layer.)
    let head_too_large = !http2 && head_bytes(&req) > MAX_HEAD_BYTES;
    // Room for what the walk adds (X-Request-Id, X-Forwarded-For, X-Forwarded-Proto, Via) at
    // once: hyper sizes the map for the headers it parsed, and each growth rehashes it.
    req.headers_mut().reserve(4);
    let request_id = shared.ids.ensure(req.headers_mut());
    let mut log = AccessLog::start(&req, peer.ip, &request_id);
    log.watch_cut(&shared.capacity);
    // Before any refusal, so that every line names the client, not the proxy in front
    // (review: 413s, bad paths and health checks behind a load balancer named the balancer).
    let client = shared
        .identify
        .client_ip(peer.ip, peer.trusted, req.headers());
    log.client(client);
    // Not boxed: hyper keeps each connection's service future in one box it reuses, so the
    // walk's state (~4.5 KiB) is copied into it once per request; a box of our own cost an
    // allocation and a free of that size on top (1,660 instructions per forwarded request).
    // Written inline rather than as a function of its own: an inner future was one more
    // place the request and the response were copied through.
    // The body stays here unless it is forwarded: an answer of the gateway's own to an
    // HTTP/1.1 request whose body is still coming ends the connection, and says so.
    let mut req = req.map(Some);
    let mut res = {
        let (shared, peer, log) = (&*shared, &peer, &mut log);
        'walk: {
            if too_many_headers {
                break 'walk Problem::too_many_headers(MAX_HEADERS)
                    .into_response(&shared.problem_base);
            }
            if head_too_large {
                break 'walk Problem::head_too_large(MAX_HEAD_BYTES, MAX_HEADERS)
                    .into_response(&shared.problem_base);
            }
            if http2 && padded_value(req.headers()) {
                break 'walk Problem::bad_request("A header field value begins or ends with a space or tab, which HTTP/2 does not allow (RFC 9113 section 8.2.1).").into_response(&shared.problem_base);
            }
            // In any case: some servers take `connect` for `CONNECT`, as route methods are
            // matched (docs/configuration.md, `methods`).
            if req.method().as_str().eq_ignore_ascii_case("CONNECT") {
                let mut res = Problem::connect_not_allowed().into_response(&shared.problem_base);
                res.headers_mut().insert(http::header::ALLOW, allowed(None));
                break 'walk res;
            }
            // A path, or an http URI: nothing else is routed (`*` only for `OPTIONS`).
            if let Some(detail) = bad_target(&req) {
                break 'walk Problem::bad_request(detail).into_response(&shared.problem_base);
            }
            // Matched and forwarded in normal form: no spelling of a path escapes its route.
            if let Err(why) = normalize_path(&mut req, shared.merge_slashes) {
                break 'walk bad_path(why).into_response(&shared.problem_base);
            }
            if shared.health_path.as_deref() == Some(req.uri().path()) {
                break 'walk readiness(&shared.capacity);
            }
            // Routed by `Host` (health checks above need none): it must be one, and valid.
            if let Some(detail) = bad_host(&req) {
                break 'walk Problem::bad_request(detail).into_response(&shared.problem_base);
            }
            // And by its method, which the upstream must not read otherwise.
            if let Some(method) = method_override(&req) {
                let detail = format!("The request asks to be served as {method} (a method override): send that request with its own method instead. The gateway routes and counts requests by their own method.");
                break 'walk Problem::bad_request(detail).into_response(&shared.problem_base);
            }
            // A request no route matches is still counted (and refused) by the limits that
            // apply to every caller wherever they go (see `Quota::unrouted`), then answered 404.
            let (index, route) = match shared.router.find(&req, shared.merge_slashes) {
                Some((index, route)) => {
                    log.route(&shared.route_names[index]);
                    (index, Some(route))
                }
                None if shared.quota.counts_unrouted() => (shared.quota.unrouted(), None),
                None => break 'walk Problem::not_found().into_response(&shared.problem_base),
            };
            // A body declared over the limit is refused before it costs any quota. (A request
            // answered 404 is not forwarded: its body does not matter.)
            let size = req
                .body()
                .as_ref()
                .map_or_else(Default::default, http_body::Body::size_hint);
            // Answered once the caller is known, with its figures (below).
            let refused_body = if route.is_some() && size.lower() > shared.max_body_size {
                Some(Problem::body_too_large(shared.max_body_size))
            // Only an HTTP/1 body of no declared length can be chunked (HTTP/2 has no transfer
            // codings: its bodies of no declared length go upstream chunked).
            } else if route.is_some()
                && size.exact().is_none()
                && !http2
                && unsupported_coding(req.headers())
            {
                Some(Problem::unsupported_coding())
            } else {
                None
            };

            // Identify (the client's address is, above).
            let api_key = match shared.identify.api_key(req.headers(), req.uri()) {
                Ok(key) => key,
                Err(KeyError::TooLong) => {
                    let detail = format!("The API key is longer than {MAX_KEY_BYTES} bytes.");
                    break 'walk Problem::bad_request(detail).into_response(&shared.problem_base);
                }
                Err(KeyError::Ambiguous) => {
                    let detail = "The request carries two different API keys in one place (a header sent twice, say, or once empty and once not). Send one.";
                    break 'walk Problem::bad_request(detail).into_response(&shared.problem_base);
                }
                Err(KeyError::Unreadable) => {
                    let detail = "The API key has a byte that is not a visible ASCII character (a space inside it, a byte outside ASCII, or a `+` at either end of a query parameter, which servers read as a space).";
                    break 'walk Problem::bad_request(detail).into_response(&shared.problem_base);
                }
            };
            if let Some((name, why)) = shared.quota.bad_key_header(req.headers(), index) {
                let detail = match why {
                    KeyHeader::Twice => format!("The request carries the {name} header twice with different values, and a limit counts callers by it. Send it once."),
                    KeyHeader::NotAscii => format!("The {name} header, which a limit counts callers by, has a byte outside ASCII. Send it in ASCII."),
                };
                break 'walk Problem::bad_request(detail).into_response(&shared.problem_base);
            }
            // The fingerprint is a keyed hash: only worth computing when the access log is written.
            if let Some(k) = api_key.as_deref().filter(|_| log.is_on()) {
                log.key(shared.quota.fingerprint(k));
            }
            let caller = Caller {
                ip: shared.identify.ip_bucket(client),
                api_key: api_key.as_deref(),
                route: index,
                headers: req.headers(),
            };
            let layers = shared.quota.layers(&caller);
            drop(api_key);

            // Quota, then capacity.
            let cost = route.map_or(1, |r| r.cost.get());
            // A body refused before any limit decides: nothing charged, but the caller's
            // figures advertised, as on every other answer (review: a 413 carried none).
            if let Some(problem) = refused_body {
                let mut reports = Reports::new();
                shared.quota.standing(&layers, cost, &mut reports).await;
                let mut res = problem.into_response(&shared.problem_base);
                advertise(shared, index, res.headers_mut(), &reports, cost, None);
                break 'walk res;
            }
            // A client that keeps opening HTTP/2 streams after the shutdown's GOAWAY would keep
            // the drain going to the grace's end (review): what it opens late is turned away,
            // as a client that heeds GOAWAY sees the stream refused.
            if http2 && shared.capacity.goodbye_ignored() {
                break 'walk stopped(shared, index, Stop::Draining, (&Reports::new(), cost), log);
            }
            let capacity = match route {
                Some(_) => &shared.capacity,
                None => &shared.unrouted_capacity,
            };
            let mut reports = Reports::new();
            let pass = match shared
                .quota
                .admit(
                    &layers,
                    cost,
                    capacity,
                    Notes {
                        reports: &mut reports,
                        log,
                    },
                )
                .await
            {
                Ok(pass) => pass,
                // A shared store that cannot decide (`on_error = "deny"`) has nothing to
                // protect from a request no route matches: it gets its 404.
                Err(Stop::StoreUnavailable) if route.is_none() => {
                    log.outcome(Outcome::StoreUnavailable, &shared.quota);
                    break 'walk Problem::not_found().into_response(&shared.problem_base);
                }
                Err(stop) => break 'walk stopped(shared, index, stop, (&reports, cost), log),
            };
            log.outcome(pass.outcome, &shared.quota);

            // Forward or respond.
            let Some(route) = route else {
                let mut res = Problem::not_found().into_response(&shared.problem_base);
                advertise(shared, index, res.headers_mut(), &reports, cost, None);
                res.body_mut().hold(pass.slot, pass.held, None);
                break 'walk res;
            };
            let mut res = match &route.action {
                RouteAction::Respond(r) => respond(r),
                RouteAction::Upstream(_) if max_forwards_spent(&mut req) => {
                    let mut res = if req.method() == http::Method::TRACE {
                        Problem::trace_not_reflected().into_response(&shared.problem_base)
                    } else {
                        plain(StatusCode::OK, "")
                    };
                    res.headers_mut()
                        .insert(http::header::ALLOW, allowed(Some(route)));
                    res
                }
                RouteAction::Upstream(u) => {
                    let upgrade = upgrade_protocol(&req);
                    let asked = upgrade.clone();
                    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut req));
                    prepare_request(
                        &mut req,
                        peer,
                        shared.upstreams[*u].authority(),
                        &shared.identity_headers,
                    );
                    if let Some(protocol) = upgrade {
                        set_upgrade(req.headers_mut(), protocol);
                    }
                    let body = req.body_mut().take().expect("taken once, here");
                    let req = std::mem::replace(&mut req, Request::new(None)).map(|_| body);
                    log.upstream_start();
                    busy.forwarded();
                    let sent = shared.upstreams[*u]
                        .send(req, shared.max_body_size, shared.min_body_rate)
                        .await;
                    log.upstream_done();
                    match (sent, client_side) {
                        (Ok(mut res), Some(client_side))
                            if res.status() == StatusCode::SWITCHING_PROTOCOLS
                                && asked.as_ref().is_some_and(|asked| {
                                    let got = res.headers().get(http::header::UPGRADE);
                                    switched_as_asked(asked, got)
                                }) =>
                        {
                            let upstream_side = hyper::upgrade::on(&mut res);
                            let (mut parts, _) = res.into_parts();
                            let protocol = parts.headers.get(http::header::UPGRADE).cloned();
                            strip_hop_by_hop(&mut parts.headers, &[]);
                            if let Some(protocol) = protocol {
                                set_upgrade(&mut parts.headers, protocol);
                            }
                            let mut res = Response::from_parts(parts, Body::full(Bytes::new()));
                            advertise(shared, index, res.headers_mut(), &reports, cost, None);
                            let hold = (pass.slot, pass.held, busy.take_room());
                            let idle = shared.upstreams[*u].tunnel_idle_timeout();
                            // The exchange lasts as long as the tunnel: its line is written
                            // when that ends.
                            log.status(res.status());
                            let tunnel_log = log.take();
                            // Tracked, for a cut at the end of the shutdown grace to end it.
                            shared.capacity.spawn_tunnel(crate::tunnel::splice(
                                client_side,
                                upstream_side,
                                idle,
                                hold,
                                tunnel_log,
                            ));
                            break 'walk res;
                        }
                        // Unasked, or to a protocol the client did not ask for: the upstream
                        // answered, wrongly (review: this was "could not be reached").
                        (Ok(res), _) if res.status() == StatusCode::SWITCHING_PROTOCOLS => {
                            tracing::debug!(upgrade = ?res.headers().get(http::header::UPGRADE), "the upstream switched protocols unasked, or to one not asked for");
                            answer_dropped(&res);
                            Problem::upstream_bad_response().into_response(&shared.problem_base)
                        }
                        // Ambiguous framing (RFC 9112 section 6.3), or a coding the gateway
                        // would drop with the hop-by-hop header: refused as nginx does. The
                        // unread body closes the upstream connection.
                        (Ok(res), _)
                            if res.headers().contains_key(http::header::TRANSFER_ENCODING)
                                && (res.headers().contains_key(http::header::CONTENT_LENGTH)
                                    || unsupported_coding(res.headers())) =>
                        {
                            // The framing fields' values, and the other fields' names only: a
                            // value may be a secret (review: `Set-Cookie` was logged whole).
                            let names: Vec<&str> =
                                res.headers().keys().map(|n| n.as_str()).collect();
                            tracing::debug!(
                                transfer_encoding = ?res.headers().get_all(http::header::TRANSFER_ENCODING).iter().collect::<Vec<_>>(),
                                content_length = ?res.headers().get_all(http::header::CONTENT_LENGTH).iter().collect::<Vec<_>>(),
                                fields = ?names,
                                "the upstream's response framing cannot be passed on"
                            );
                            answer_dropped(&res);
                            Problem::upstream_bad_response().into_response(&shared.problem_base)
                        }
                        (Ok(res), _) => {
                            let (mut parts, body) = res.into_parts();
                            // The gateway's own HTTP version, not the upstream's (RFC 9110
                            // section 6.2).
                            parts.version = if http2 {
                                http::Version::HTTP_2
                            } else {
                                http::Version::HTTP_11
                            };
                            let stripped = strip_hop_by_hop(&mut parts.headers, &[]);
                            one_content_length(parts.status, &mut parts.headers);
                            // RateLimit-Policy, RateLimit, X-Request-Id: one growth at most.
                            parts.headers.reserve(3);
                            let timeout = shared.upstreams[*u].timeout();
                            let body =
                                Body::upstream(body, timeout).without_in_trailers(&stripped.named);
                            Response::from_parts(parts, body)
                        }
                        (Err(problem), _) => {
                            let close = problem.ends_connection && !http2;
                            let mut res = problem.into_response(&shared.problem_base);
                            if close {
                                let close = HeaderValue::from_static("close");
                                res.headers_mut().insert(http::header::CONNECTION, close);
                            }
                            res
                        }
                    }
                }
            };
            advertise(shared, index, res.headers_mut(), &reports, cost, None);
            let upload = res.extensions_mut().remove::<UploadTail>();
            res.body_mut().hold(pass.slot, pass.held, upload);
            res
        }
    };
    let (parts, body) = req.into_parts();
    if let (false, Some(body)) = (http2, body) {
        if !rest_arrived(body, &parts.headers).await {
            res.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
    }
    log.status(res.status());
    res.headers_mut().insert(X_REQUEST_ID.clone(), request_id);
    if head_over_http2 {
        without_body_for_head(&mut res);
    }
    res.body_mut().log_on_end(log);
    res.body_mut().keep_busy(busy);
    Ok(res)
}

/// Whether the rest of an HTTP/1.1 request's body the gateway answers without forwarding is
/// here already (at most [`REST_READ`] bytes in [`REST_PIECES`] pieces, read and dropped),
/// so that the connection can go on. If not, hyper closes the connection once the answer is written, and the answer must
/// say so (RFC 9110 section 15: a server answering before it read the whole request says
/// whether it closes; review: 429s, 503s and 413s to uploads ended their connections with no
/// `Connection: close`, and a client reusing one lost its next request). A body sent with
/// `Expect: 100-continue` is not read: reading it would ask the client for what was refused.
async fn rest_arrived(mut body: Incoming, headers: &http::HeaderMap) -> bool {
    if http_body::Body::is_end_stream(&body) {
        return true;
    }
    // As hyper reads it: only this expectation makes it wait to be asked for the body.
    let expects_continue = headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue {
        return false;
    }
    let (mut budget, mut pieces) = (REST_READ, REST_PIECES);
    // hyper hands a body over a piece (a chunk) per turn of its connection, between polls of
    // the service: the turns that bring nothing are counted, not the pieces (review: bodies
    // of three chunks, all arrived, were taken for unfinished).
    let mut idle_turns = 0;
    while idle_turns < REST_TURNS {
        let mut moved = false;
        let over = std::future::poll_fn(|cx| loop {
            match http_body::Body::poll_frame(Pin::new(&mut body), cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let len = frame.data_ref().map_or(0, Bytes::len);
                    match (budget.checked_sub(len), pieces.checked_sub(1)) {
                        (Some(left), Some(more)) => (budget, pieces) = (left, more),
                        _ => return Poll::Ready(Some(false)),
                    }
                    moved = true;
                }
                Poll::Ready(None) => return Poll::Ready(Some(true)),
                Poll::Ready(Some(Err(_))) => return Poll::Ready(Some(false)),
                Poll::Pending => return Poll::Ready(None),
            }
        })
        .await;
        match over {
            Some(over) => return over,
            None if http_body::Body::is_end_stream(&body) => return true,
            None => {
                idle_turns = if moved { 0 } else { idle_turns + 1 };
                tokio::task::yield_now().await;
            }
        }
    }
    false
}

/// The most of a request's body read to keep its connection after an answer of the
/// gateway's own.
const REST_READ: usize = 64 * 1024;
/// The most pieces (chunks) of it read: each costs hyper a turn, and a body of one-byte
/// chunks would otherwise cost 65,536 of them (review), where forwarding refuses a body of
/// tiny pieces after 1,024.
const REST_PIECES: usize = 1_024;
/// The turns in a row that hand over nothing before the rest is taken for still coming.
const REST_TURNS: usize = 3;

/// The answer to a request that was not admitted: 429, 503 (or 500 for an impossible cost).
/// `reports` are the figures of a request refused for capacity: the caller's as they stand,
/// since nothing was charged.
fn stopped(
    shared: &Shared,
    route: usize,
    stop: Stop,
    (reports, cost): (&Reports, u32),
    log: &mut AccessLog,
) -> Response<Body> {
    match stop {
        Stop::Quota(refused) => {
            log.outcome(Outcome::Rejected(refused.limit), &shared.quota);
            let info = shared.quota.info(refused.limit);
            let mut res = quota_exceeded(info, &refused, cost).into_response(&shared.problem_base);
            let limit = Some(refused.limit);
            advertise(
                shared,
                route,
                res.headers_mut(),
                &refused.reports,
                cost,
                limit,
            );
            res
        }
        Stop::StoreUnavailable => {
            log.outcome(Outcome::StoreUnavailable, &shared.quota);
            let retry_after = overload_retry_after(shared.overload_retry_after);
            Problem::store_unavailable(retry_after).into_response(&shared.problem_base)
        }
        Stop::Overloaded
        | Stop::OverloadedAfterHold
        | Stop::DrainingAfterHold
        | Stop::Draining
        | Stop::NotTakenBack { .. } => {
            let retry_after = overload_retry_after(shared.overload_retry_after);
            let charges = match stop {
                Stop::OverloadedAfterHold | Stop::DrainingAfterHold => Charges::WithdrawnAfterHold,
                Stop::NotTakenBack { .. } => Charges::NotTakenBack,
                _ => Charges::None,
            };
            let (outcome, problem) = match stop {
                Stop::DrainingAfterHold
                | Stop::Draining
                | Stop::NotTakenBack { draining: true } => {
                    (Outcome::Draining, Problem::draining(retry_after, charges))
                }
                _ => (
                    Outcome::Overloaded,
                    Problem::overloaded(retry_after, charges),
                ),
            };
            log.outcome(outcome, &shared.quota);
            let mut res = problem.into_response(&shared.problem_base);
            advertise(shared, route, res.headers_mut(), reports, cost, None);
            res
        }
        Stop::CostTooLarge(id) => {
            tracing::error!(
                policy = &*shared.quota.info(id).name,
                cost,
                "route cost exceeds the limit's capacity"
            );
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "misconfigured",
                "The gateway is misconfigured",
                "This route costs more than one of its limits can ever allow.",
            )
            .into_response(&shared.problem_base)
        }
    }
}

/// RateLimit fields for the limits that applied (dry-run limits stay invisible to callers).
fn advertise(
    shared: &Shared,
    route: usize,
    headers: &mut http::HeaderMap,
    reports: &Reports,
    cost: u32,
    refusing: Option<LimitId>,
) {
    // In configuration order (limits are charged each caller's first, then the shared ones).
    let mut sorted: SmallVec<[(LimitId, Report); 8]> = reports.iter().copied().collect();
    sorted.sort_unstable_by_key(|(id, _)| *id);
    let legacy = if shared.legacy_headers {
        let refusing = refusing.and_then(|id| sorted.iter().position(|(i, _)| *i == id));
        advertise::Legacy::On { refusing }
    } else {
        advertise::Legacy::Off
    };
    let items: SmallVec<[(&str, Report); 8]> = sorted
        .iter()
        .map(|(id, r)| (&*shared.quota.info(*id).field_name, *r))
        .collect();
    let policy = &shared.policies[route];
    advertise::write(headers, &items, cost, legacy, policy);
}

/// Whole seconds drawn uniformly from the configured range, so refused callers spread out.
fn overload_retry_after(range: RetryRange) -> u64 {
    rand::thread_rng().gen_range(range.min.as_secs()..=range.max.as_secs())
}

fn respond(r: &Respond) -> Response<Body> {
    let mut res = Response::new(Body::full(Bytes::copy_from_slice(r.body.as_bytes())));
    *res.status_mut() = r.status;
    if let Ok(ct) = HeaderValue::from_str(&r.content_type) {
        res.headers_mut().insert(CONTENT_TYPE, ct);
    }
    res
}

/// `Allow` for a `405` and for an `OPTIONS` the gateway answers itself (RFC 9110 sections
/// 15.5.6 and 9.3.7): the route's methods when it names them, with `HEAD` beside `GET` as
/// routes match, else the methods a reverse proxy forwards. Never `CONNECT` (refused) nor
/// `TRACE` (reflected by no one here once `Max-Forwards` is spent).
fn allowed(route: Option<&sluice_config::Route>) -> HeaderValue {
    const ANY: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";
    let Some(methods) = route.and_then(|r| r.methods.as_deref()) else {
        return HeaderValue::from_static(ANY);
    };
    let mut names: Vec<&str> = Vec::with_capacity(methods.len() + 1);
    for m in methods {
        let name = m.as_str();
        let refused = ["CONNECT", "TRACE"]
            .iter()
            .any(|r| r.eq_ignore_ascii_case(name));
        if !refused && !names.iter().any(|n| n.eq_ignore_ascii_case(name)) {
            names.push(name);
        }
        if *m == http::Method::GET && !names.contains(&"HEAD") {
            names.push("HEAD");
        }
    }
    // Method names are tokens, which header values take as they are.
    HeaderValue::from_str(&names.join(", ")).unwrap_or(HeaderValue::from_static(ANY))
}

/// `/ready` and `health_path`: 503 while draining and while `max_in_flight` requests run (when
/// requests get 503), and only then. Not at `max_connections`: new connections wait in the
/// backlog there, and the connections open (a load balancer's) are still served.
pub(crate) fn readiness(capacity: &Capacity) -> Response<Body> {
    let (status, text) = if capacity.is_ready() {
        (StatusCode::OK, "ready\n")
    } else if capacity.is_stopping() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "full\n")
    };
    plain(status, text)
}

/// An answer the gateway wrote itself to an HTTP/2 `HEAD`: its body dropped, its length kept
/// in `Content-Length` (see [`Body::drop_for_head`]).
pub(crate) fn without_body_for_head(res: &mut Response<Body>) {
    if let Some(len) = res.body_mut().drop_for_head() {
        res.headers_mut()
            .insert(http::header::CONTENT_LENGTH, HeaderValue::from(len));
    }
}

pub(crate) fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut res = Response::new(Body::full(Bytes::from_static(text.as_bytes())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}
