//! The routing step: the longest path prefix (on segment boundaries) whose method and host match.

use http::{Method, Request};
use sluice_config::Route;

/// Routes ordered for matching: longest path first, file order among equals.
#[derive(Debug)]
pub(crate) struct Router {
    routes: Vec<(usize, Route)>,
}

impl Router {
    pub(crate) fn new(routes: &[Route]) -> Self {
        let mut routes: Vec<(usize, Route)> = routes.iter().cloned().enumerate().collect();
        routes.sort_by(|(ia, a), (ib, b)| b.path.len().cmp(&a.path.len()).then(ia.cmp(ib)));
        Self { routes }
    }

    /// The matching route and its index in the configuration.
    pub(crate) fn find<B>(&self, req: &Request<B>) -> Option<(usize, &Route)> {
        let path = req.uri().path();
        // Looked up only if a route names a host: most configurations have none.
        let host = std::cell::OnceCell::new();
        self.routes
            .iter()
            .find(|(_, r)| {
                path_matches(&r.path, path)
                    && method_matches(r.methods.as_deref(), req.method())
                    && r.host.as_deref().is_none_or(|h| {
                        let host = host.get_or_init(|| request_host(req));
                        host.is_some_and(|x| x.eq_ignore_ascii_case(h))
                    })
            })
            .map(|(i, r)| (*i, r))
    }
}

/// `/v1/search` matches `/v1/search` and `/v1/search/x`, not `/v1/searchx`.
fn path_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

fn method_matches(methods: Option<&[Method]>, method: &Method) -> bool {
    methods.is_none_or(|ms| ms.contains(method))
}

/// The host a request is addressed to, without port: `Host` for HTTP/1.1, `:authority` for h2.
pub(crate) fn request_host<B>(req: &Request<B>) -> Option<&str> {
    let raw = match req.headers().get(http::header::HOST) {
        Some(h) => h.to_str().ok()?,
        None => req.uri().authority()?.as_str(),
    };
    let without_port = if raw.starts_with('[') {
        raw.split_inclusive(']').next().unwrap_or(raw)
    } else {
        raw.rsplit_once(':').map_or(raw, |(h, _)| h)
    };
    Some(without_port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_config::{Respond, RouteAction};
    use std::num::NonZeroU32;

    fn route(name: &str, path: &str, methods: Option<Vec<Method>>, host: Option<&str>) -> Route {
        Route {
            name: name.into(),
            path: path.into(),
            methods,
            host: host.map(Into::into),
            cost: NonZeroU32::MIN,
            action: RouteAction::Respond(Respond {
                status: http::StatusCode::OK,
                body: String::new(),
                content_type: "text/plain".into(),
            }),
        }
    }

    fn find<'a>(router: &'a Router, method: &str, uri: &str, host: &str) -> Option<&'a str> {
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header("host", host)
            .body(())
            .unwrap();
        router.find(&req).map(|(_, r)| r.name.as_str())
    }

    #[test]
    fn prefix_matches_on_segment_boundaries_and_longest_wins() {
        let router = Router::new(&[
            route("api", "/", None, None),
            route("search", "/v1/search", Some(vec![Method::GET]), None),
        ]);
        assert_eq!(find(&router, "GET", "/v1/search", "a"), Some("search"));
        assert_eq!(find(&router, "GET", "/v1/search/x", "a"), Some("search"));
        assert_eq!(find(&router, "GET", "/v1/search?q=1", "a"), Some("search"));
        assert_eq!(find(&router, "GET", "/v1/searchx", "a"), Some("api"));
        assert_eq!(find(&router, "POST", "/v1/search", "a"), Some("api"));
    }

    #[test]
    fn host_is_matched_without_port_and_case() {
        let router = Router::new(&[route("h", "/x", None, Some("api.example.com"))]);
        assert_eq!(
            find(&router, "GET", "/x", "API.example.com:8080"),
            Some("h")
        );
        assert_eq!(find(&router, "GET", "/x", "other.example.com"), None);
        assert_eq!(find(&router, "GET", "/y", "api.example.com"), None);
    }

    #[test]
    fn ipv6_host_keeps_its_brackets() {
        let req = Request::builder()
            .uri("/")
            .header("host", "[::1]:80")
            .body(())
            .unwrap();
        assert_eq!(request_host(&req), Some("[::1]"));
    }
}
