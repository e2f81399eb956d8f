//! The forwarding step: rewrite the request for the upstream, send it over a pooled
//! keep-alive connection, and map failures to 502 / 504. Bodies stream both ways.

use std::error::Error as StdError;
use std::io;
use std::net::IpAddr;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue, HOST};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, Request, Response, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use sluice_config::Upstream;

use crate::problem::Problem;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Hop-by-hop headers (RFC 9110 section 7.6.1) that `http` has no constant for; the others
/// are listed in `is_hop_by_hop`.
const HOP_BY_HOP: [&str; 2] = ["keep-alive", "proxy-connection"];

/// One upstream service and its connection pool.
#[derive(Debug)]
pub(crate) struct UpstreamClient {
    scheme: Scheme,
    authority: Authority,
    timeout: Duration,
    client: Client<HttpConnector, Incoming>,
}

impl UpstreamClient {
    pub(crate) fn new(u: &Upstream) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(u.connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .timer(TokioTimer::new())
            .build(connector);
        Self {
            scheme: u.url.scheme().cloned().unwrap_or(Scheme::HTTP),
            authority: u
                .url
                .authority()
                .cloned()
                .expect("validated upstream URLs have a host"),
            timeout: u.timeout,
            client,
        }
    }

    /// Sends `req` (already rewritten) and waits for the response head within `timeout`.
    pub(crate) async fn send(
        &self,
        mut req: Request<Incoming>,
    ) -> Result<Response<Incoming>, Problem> {
        let path = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|_| Problem::bad_request("The request target cannot be forwarded."))?;
        *req.version_mut() = http::Version::HTTP_11;
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_elapsed) => Err(Problem::upstream_timeout()),
            Ok(Ok(res)) => Ok(res),
            Ok(Err(e)) if caused_by_timeout(&e) => Err(Problem::upstream_timeout()),
            Ok(Err(e)) => {
                tracing::debug!(error = %display_chain(&e), "upstream request failed");
                Err(Problem::upstream_unavailable())
            }
        }
    }
}

/// A connect timeout is a 504 (the upstream did not answer in time), like nginx.
fn caused_by_timeout(e: &(dyn StdError + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err
            .downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::TimedOut)
        {
            return true;
        }
        cur = err.source();
    }
    false
}

fn display_chain(e: &(dyn StdError + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        out.push_str(": ");
        out.push_str(&err.to_string());
        cur = err.source();
    }
    out
}

/// Removes hop-by-hop headers, including every header the `Connection` header names. One
/// pass over the names, without hashing, in the usual case where there are none.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut found: smallvec::SmallVec<[HeaderName; 4]> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n))
        .cloned()
        .collect();
    if found.is_empty() {
        return;
    }
    if found.contains(&http::header::CONNECTION) {
        let named = headers
            .get_all(http::header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok());
        found.extend(named.collect::<Vec<_>>());
    }
    for name in found {
        headers.remove(name);
    }
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    use http::header::{
        CONNECTION, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRAILER, TRANSFER_ENCODING,
        UPGRADE,
    };
    [
        CONNECTION,
        PROXY_AUTHENTICATE,
        PROXY_AUTHORIZATION,
        TE,
        TRAILER,
        TRANSFER_ENCODING,
        UPGRADE,
    ]
    .contains(name)
        || HOP_BY_HOP.contains(&name.as_str())
}

/// Rewrites request headers for the upstream: hop-by-hop stripped, the peer appended to
/// `X-Forwarded-For`, `X-Forwarded-Proto` set (kept only from a trusted proxy), `Host` kept
/// (taken from `:authority` for HTTP/2).
pub(crate) fn prepare_request<B>(req: &mut Request<B>, peer: IpAddr, peer_trusted: bool) {
    if !req.headers().contains_key(HOST) {
        if let Some(host) = req
            .uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        {
            req.headers_mut().insert(HOST, host);
        }
    }
    let headers = req.headers_mut();
    strip_hop_by_hop(headers);
    let mut xff = String::new();
    for v in headers.get_all(&X_FORWARDED_FOR) {
        if let Ok(s) = v.to_str() {
            if !s.trim().is_empty() {
                xff.push_str(s.trim());
                xff.push_str(", ");
            }
        }
    }
    xff.push_str(&peer.to_canonical().to_string());
    if let Ok(v) = HeaderValue::from_str(&xff) {
        headers.insert(X_FORWARDED_FOR.clone(), v);
    }
    if !(peer_trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_named_headers_and_hop_by_hop_are_removed() {
        let mut req = Request::builder()
            .uri("/")
            .header("connection", "keep-alive, X-Secret")
            .header("x-secret", "1")
            .header("keep-alive", "timeout=5")
            .header("te", "trailers")
            .header("upgrade", "websocket")
            .header("x-kept", "yes")
            .body(())
            .unwrap();
        prepare_request(&mut req, "192.0.2.1".parse().unwrap(), false);
        let h = req.headers();
        for gone in ["connection", "x-secret", "keep-alive", "te", "upgrade"] {
            assert!(!h.contains_key(gone), "{gone} was forwarded");
        }
        assert_eq!(h["x-kept"], "yes");
    }

    #[test]
    fn forwarded_for_gets_the_peer_appended_and_proto_is_set() {
        let mut req = Request::builder()
            .uri("/")
            .header("x-forwarded-for", "203.0.113.9")
            .header("x-forwarded-for", "198.51.100.2")
            .header("x-forwarded-proto", "https")
            .body(())
            .unwrap();
        prepare_request(&mut req, "::ffff:192.0.2.1".parse().unwrap(), false);
        assert_eq!(
            req.headers()["x-forwarded-for"],
            "203.0.113.9, 198.51.100.2, 192.0.2.1"
        );
        assert_eq!(
            req.headers()["x-forwarded-proto"],
            "http",
            "untrusted peer cannot claim https"
        );
    }

    #[test]
    fn trusted_proxy_keeps_its_forwarded_proto_and_h2_authority_becomes_host() {
        let mut req = Request::builder()
            .uri("http://api.example.com/x")
            .header("x-forwarded-proto", "https")
            .body(())
            .unwrap();
        prepare_request(&mut req, "10.0.0.1".parse().unwrap(), true);
        assert_eq!(req.headers()["x-forwarded-proto"], "https");
        assert_eq!(req.headers()["host"], "api.example.com");
    }
}
