//! One request's walk through the gateway, in order:
//! health -> match route -> (identify, quota: next issues) -> capacity -> forward or respond.
//! Every step that answers early returns a response; nothing jumps back.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use rand::Rng;
use sluice_config::{Cidr, Config, Respond, RetryRange, RouteAction};

use crate::access_log::AccessLog;
use crate::body::Body;
use crate::capacity::Capacity;
use crate::forward::{prepare_request, strip_hop_by_hop, UpstreamClient};
use crate::problem::Problem;
use crate::request_id::{RequestIds, X_REQUEST_ID};
use crate::route::Router;

/// Everything a request needs, built once from the configuration.
#[derive(Debug)]
pub(crate) struct Shared {
    router: Router,
    route_names: Vec<Arc<str>>,
    upstreams: Vec<UpstreamClient>,
    pub(crate) capacity: Capacity,
    health_path: Option<String>,
    pub(crate) problem_base: String,
    overload_retry_after: RetryRange,
    trusted_proxies: Vec<Cidr>,
    ids: RequestIds,
}

impl Shared {
    pub(crate) fn new(config: &Config) -> Self {
        Self {
            router: Router::new(&config.routes),
            route_names: config
                .routes
                .iter()
                .map(|r| Arc::from(r.name.as_str()))
                .collect(),
            upstreams: config.upstreams.iter().map(UpstreamClient::new).collect(),
            capacity: Capacity::new(config.gateway.max_in_flight.get()),
            health_path: config.gateway.health_path.clone(),
            problem_base: config.responses.problem_base.clone(),
            overload_retry_after: config.gateway.overload_retry_after,
            trusted_proxies: config.identity.trusted_proxies.clone(),
            ids: RequestIds::new(),
        }
    }
}

/// hyper's service function for the main listener.
pub(crate) async fn handle(
    shared: Arc<Shared>,
    peer: SocketAddr,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let request_id = shared.ids.ensure(req.headers_mut());
    let peer = peer.ip().to_canonical();
    let mut log = AccessLog::start(
        req.method().clone(),
        req.uri().clone(),
        peer,
        request_id.clone(),
    );
    let mut res = walk(&shared, peer, req, &mut log).await;
    log.status(res.status());
    res.headers_mut().insert(X_REQUEST_ID.clone(), request_id);
    res.body_mut().log_on_end(log);
    Ok(res)
}

async fn walk(
    shared: &Shared,
    peer: IpAddr,
    mut req: Request<Incoming>,
    log: &mut AccessLog,
) -> Response<Body> {
    if shared.health_path.as_deref() == Some(req.uri().path()) {
        return readiness(&shared.capacity);
    }
    let Some((index, route)) = shared.router.find(&req) else {
        return Problem::not_found().into_response(&shared.problem_base);
    };
    log.route(shared.route_names[index].clone());

    let Some(slot) = shared.capacity.try_acquire() else {
        return Problem::overloaded(overload_retry_after(shared.overload_retry_after))
            .into_response(&shared.problem_base);
    };

    let mut res = match &route.action {
        RouteAction::Respond(r) => respond(r),
        RouteAction::Upstream(u) => {
            let trusted = shared.trusted_proxies.iter().any(|c| c.contains(peer));
            prepare_request(&mut req, peer, trusted);
            let sent = shared.upstreams[*u].send(req).await;
            log.upstream_done();
            match sent {
                Ok(res) => {
                    let (mut parts, body) = res.into_parts();
                    strip_hop_by_hop(&mut parts.headers);
                    Response::from_parts(parts, Body::upstream(body))
                }
                Err(problem) => problem.into_response(&shared.problem_base),
            }
        }
    };
    res.body_mut().hold(slot);
    res
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

/// `/ready` and `health_path`: 200 unless the gateway is full or draining.
pub(crate) fn readiness(capacity: &Capacity) -> Response<Body> {
    let (status, text) = if capacity.is_ready() {
        (StatusCode::OK, "ready\n")
    } else if capacity.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "full\n")
    };
    plain(status, text)
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
