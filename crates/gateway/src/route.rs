//! The routing step: the request's path brought to normal form, then the longest path prefix
//! (on segment boundaries) whose method and host match.

use std::borrow::Cow;
use std::collections::HashMap;

use http::uri::PathAndQuery;
use http::{Request, Uri};
use sluice_config::path::{normalize_request, route_key, BadPath};
use sluice_config::Route;

use crate::problem::Problem;

/// Rewrites `req`'s path in normal form (see [`sluice_config::path`]), so that it is matched
/// and forwarded as one; the query is kept as it came. A path that cannot be brought to it
/// (a malformed `%` escape), or whose resource servers disagree about, is the caller's error:
/// see [`bad_path`].
pub(crate) fn normalize_path<B>(req: &mut Request<B>, merge_slashes: bool) -> Result<(), BadPath> {
    // A query with no path before it (`http://h?q`, HTTP/2's `:path` `?q`) goes with `/`
    // (RFC 9112 section 3.2.1; review: the upstream got `GET ?q HTTP/1.1`).
    let no_path = (req.uri().path_and_query()).is_some_and(|pq| pq.as_str().starts_with('?'));
    let path = match normalize_request(req.uri().path(), merge_slashes)? {
        Cow::Borrowed(path) if no_path => path.to_owned(),
        Cow::Borrowed(_) => return Ok(()),
        Cow::Owned(path) => path,
    };
    let uri = req.uri();
    let target = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path,
    };
    let mut parts = uri.clone().into_parts();
    // Cannot fail: the normal form only holds characters the path held, or unreserved ones.
    parts.path_and_query = PathAndQuery::try_from(target).ok();
    *req.uri_mut() = Uri::from_parts(parts).map_err(|_| BadPath::Malformed)?;
    Ok(())
}

/// The 400 for a path [`normalize_path`] refused.
pub(crate) fn bad_path(why: BadPath) -> Problem {
    Problem::bad_request(match why {
        BadPath::Malformed => "The request path has a \"%\" not followed by two hexadecimal digits.",
        BadPath::Ambiguous => "The request path has a \"..\" segment once its \";\" parameters are dropped or its escaped slashes read as \"/\" (\"..;\", \"..%2F\", \"..%5C\"): servers disagree about which resource it names.",
    })
}

/// Routes ordered for matching: longest path first, file order among equals.
#[derive(Debug)]
pub(crate) struct Router {
    routes: Vec<(usize, Route)>,
    /// With many routes: the positions in `routes` of each path (ASCII lower case), by host,
    /// so that a request looks up the few prefixes of its own path that a route could be, and
    /// of those the routes for its host or any, instead of walking every route (a host per
    /// tenant on `/`, 20,000 of them).
    by_path: Option<HashMap<Box<[u8]>, OnePath>>,
}

/// The routes of one path, as positions in [`Router::routes`] (ascending: file order).
#[derive(Debug, Default)]
struct OnePath {
    any_host: Vec<usize>,
    /// By host, in ASCII lower case.
    by_host: HashMap<Box<str>, Vec<usize>>,
}

/// Below this many routes a walk over them costs less than hashing a path's prefixes.
const INDEX_FROM: usize = 32;

impl Router {
    pub(crate) fn new(routes: &[Route]) -> Self {
        let mut routes: Vec<(usize, Route)> = routes.iter().cloned().enumerate().collect();
        routes.sort_by(|(ia, a), (ib, b)| b.path.len().cmp(&a.path.len()).then(ia.cmp(ib)));
        let by_path = (routes.len() >= INDEX_FROM).then(|| {
            let mut by_path: HashMap<Box<[u8]>, OnePath> = HashMap::new();
            for (at, (_, r)) in routes.iter().enumerate() {
                let path = r.path.to_ascii_lowercase().into_bytes().into_boxed_slice();
                let place = by_path.entry(path).or_default();
                match &r.host {
                    None => place.any_host.push(at),
                    Some(h) => {
                        let host = h.to_ascii_lowercase().into_boxed_str();
                        place.by_host.entry(host).or_default().push(at);
                    }
                }
            }
            by_path
        });
        Self { routes, by_path }
    }

    /// The matching route and its index in the configuration, for a request whose path is
    /// in normal form: matched on its [`route_key`] (segment parameters dropped).
    pub(crate) fn find<B>(&self, req: &Request<B>, merge_slashes: bool) -> Option<(usize, &Route)> {
        let key = route_key(req.uri().path(), merge_slashes);
        let path = key.as_ref();
        let Some(by_path) = &self.by_path else {
            // Looked up only if a route names a host: most configurations have none.
            let host = std::cell::OnceCell::new();
            let found = self.routes.iter().find(|(_, r)| {
                path_matches(&r.path, path)
                    && r.matches_method(req.method())
                    && r.host.as_deref().is_none_or(|h| {
                        let host = host.get_or_init(|| request_host(req));
                        host.is_some_and(|x| x.eq_ignore_ascii_case(h))
                    })
            });
            return found.map(|(i, r)| (*i, r));
        };
        let lower = path.to_ascii_lowercase();
        let host = std::cell::OnceCell::new();
        for place in prefixes(lower.as_bytes()).filter_map(|p| by_path.get(p)) {
            let for_host = if place.by_host.is_empty() {
                None
            } else {
                let host = host.get_or_init(|| request_host(req).map(str::to_ascii_lowercase));
                host.as_deref().and_then(|h| place.by_host.get(h))
            };
            let in_order = merged(&place.any_host, for_host.map_or(&[][..], Vec::as_slice));
            let found = in_order
                .map(|at| &self.routes[at])
                .find(|(_, r)| r.matches_method(req.method()));
            if let Some((i, r)) = found {
                return Some((*i, r));
            }
        }
        None
    }
}

/// Two ascending lists of positions as one, ascending.
fn merged<'a>(a: &'a [usize], b: &'a [usize]) -> impl Iterator<Item = usize> + 'a {
    let (mut a, mut b) = (a.iter().copied().peekable(), b.iter().copied().peekable());
    std::iter::from_fn(move || match (a.peek(), b.peek()) {
        (Some(&x), Some(&y)) if y < x => b.next(),
        (Some(_), _) => a.next(),
        (None, _) => b.next(),
    })
}

/// The prefixes of `path` a route's path can be and match it by [`path_matches`], longest
/// first (the order the walk over routes sorted by length meets them): the path, then at each
/// `/` from the last, what ends with it and what ends before it.
fn prefixes(path: &[u8]) -> impl Iterator<Item = &[u8]> {
    let slashes = path
        .iter()
        .enumerate()
        .rev()
        .filter(|&(_, &b)| b == b'/')
        .flat_map(move |(i, _)| [&path[..=i], &path[..i]]);
    std::iter::once(path)
        .chain(slashes)
        .filter(move |p| !p.is_empty())
        // The path's own last `/` gives the path again.
        .scan(None, |last: &mut Option<usize>, p| {
            let repeat = *last == Some(p.len());
            *last = Some(p.len());
            Some((!repeat).then_some(p))
        })
        .flatten()
}

/// `/v1/search` matches `/v1/search`, `/v1/search/x` and `/V1/Search`, not `/v1/searchx`.
/// Case is ignored (ASCII): Express and ASP.NET Core route `/V1/Search` to the `/v1/search`
/// handler by default, and counting such a request under the route's limits costs nothing
/// where the upstream tells case apart (it is a different, usually missing, resource there).
fn path_matches(prefix: &str, path: &str) -> bool {
    let Some((head, rest)) = path.split_at_checked(prefix.len()) else {
        return false;
    };
    head.eq_ignore_ascii_case(prefix)
        && (rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'))
}

/// The host a request is addressed to, without port and without the trailing dot of a fully
/// qualified name (`api.example.com.` is the same host, and must not miss its route): `Host`
/// for HTTP/1.1, `:authority` for h2.
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
    Some(without_port.strip_suffix('.').unwrap_or(without_port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;
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

    /// The route a request is matched to, after its path is brought to normal form (as
    /// `handle` does).
    fn find<'a>(router: &'a Router, method: &str, uri: &str, host: &str) -> Option<&'a str> {
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .header("host", host)
            .body(())
            .unwrap();
        normalize_path(&mut req, true).unwrap();
        router.find(&req, true).map(|(_, r)| r.name.as_str())
    }

    /// The request target `uri` becomes before it is matched and forwarded.
    fn normalized(uri: &str, merge_slashes: bool) -> Result<String, BadPath> {
        let mut req = Request::builder().uri(uri).body(()).unwrap();
        normalize_path(&mut req, merge_slashes)?;
        Ok(req.uri().to_string())
    }

    /// With many routes the router looks up its path's prefixes instead of walking the
    /// routes: it finds the same route for every request, order among equals included.
    #[test]
    fn the_index_of_many_routes_finds_what_the_walk_finds() {
        let paths = [
            "/",
            "/a",
            "/a/",
            "/A",
            "/a/b",
            "/A/B/",
            "/a/bc",
            "/a/b/c",
            "/a//b",
            "/x",
            "/x/",
            "/x/y/z",
            "/caf%C3%A9",
            "*",
        ];
        let methods = [None, Some(vec![Method::GET]), Some(vec![Method::POST])];
        let hosts = [None, Some("h1.example"), Some("H2.example")];
        let mut routes = Vec::new();
        for (i, path) in paths.iter().enumerate() {
            for (j, m) in methods.iter().enumerate() {
                // Not every combination, so that some paths have only hosts or only methods.
                let host = hosts[(i + j) % hosts.len()];
                routes.push(route(&format!("r{i}-{j}"), path, m.clone(), host));
            }
        }
        let indexed = Router::new(&routes);
        assert!(indexed.by_path.is_some(), "{} routes", routes.len());
        let walked = Router {
            routes: indexed.routes.clone(),
            by_path: None,
        };
        let requests = [
            "/",
            "/a",
            "/a/",
            "/a/b",
            "/a/b/",
            "/A/b/c/d",
            "/a/bc",
            "/a/bcd",
            "/a//b",
            "/a//b/c",
            "/x",
            "/x/y",
            "/x/y/z/w",
            "/X/Y/Z",
            "/caf%c3%a9/x",
            "/nothing",
            "/ab",
        ];
        let mut compared = 0;
        for path in requests {
            for method in ["GET", "HEAD", "POST", "DELETE"] {
                for host in ["h1.example", "h2.EXAMPLE", "other"] {
                    for merge in [true, false] {
                        let req = Request::builder()
                            .method(method)
                            .uri(path)
                            .header("host", host)
                            .body(())
                            .unwrap();
                        let (a, b) = (indexed.find(&req, merge), walked.find(&req, merge));
                        assert_eq!(
                            a.map(|(i, _)| i),
                            b.map(|(i, _)| i),
                            "{method} {path} on {host}"
                        );
                        compared += usize::from(a.is_some());
                    }
                }
            }
        }
        assert!(compared > 300, "{compared} requests found a route");
    }

    #[test]
    fn prefixes_are_the_places_a_route_can_match_longest_first() {
        let all = |p: &str| -> Vec<String> {
            prefixes(p.as_bytes())
                .map(|b| String::from_utf8(b.to_vec()).unwrap())
                .collect()
        };
        assert_eq!(all("/a/bc"), ["/a/bc", "/a/", "/a", "/"]);
        assert_eq!(all("/a/b/"), ["/a/b/", "/a/b", "/a/", "/a", "/"]);
        assert_eq!(all("/a//b"), ["/a//b", "/a//", "/a/", "/a", "/"]);
        assert_eq!(all("/"), ["/"]);
        assert_eq!(all("*"), ["*"]);
    }

    #[test]
    fn every_spelling_of_a_path_matches_its_route() {
        let router = Router::new(&[
            route("catch-all", "/", None, None),
            route("login", "/v1/login", None, None),
        ]);
        for spelling in [
            "/v1/login",
            "/v1/./login",
            "//v1//login",
            "/v1/x/../login",
            "/v1/%6Cogin",
            "/v1/%6c%6f%67%69%6e/",
            "/v1/public/%2e%2e/login",
            "/../v1/login",
            "/v1/login;jsessionid=1",
            "/v1;v=2/login",
            "/V1/LOGIN",
            "/v1/Login/x",
            "/v1%2Flogin",
            "/v1%5clogin",
            "/v1/login%2Fx",
        ] {
            assert_eq!(
                find(&router, "GET", spelling, "a"),
                Some("login"),
                "{spelling}"
            );
        }
        assert_eq!(find(&router, "GET", "/v1/logins", "a"), Some("catch-all"));
        // Spellings servers disagree about (a Java container climbs at `..;`, Python's
        // servers at `..%2F`, nginx at neither) name no route: they are refused.
        for ambiguous in [
            "/v1/public/..;/login",
            "/v1/login/..;x",
            "/v1/%2e%2e%2flogin",
            "/v1/x%2F..%2F..%2Flogin",
        ] {
            let mut req = Request::builder().uri(ambiguous).body(()).unwrap();
            assert_eq!(
                normalize_path(&mut req, true),
                Err(BadPath::Ambiguous),
                "{ambiguous}"
            );
        }
    }

    /// A path outside ASCII is matched, and forwarded, escaped: the raw and the escaped
    /// spelling reach one route.
    #[test]
    fn a_path_outside_ascii_meets_its_escaped_route() {
        let router = Router::new(&[
            route("catch-all", "/", None, None),
            route("cafe", "/caf%C3%A9", None, None),
        ]);
        // (Raw bytes outside ASCII come from hyper's parser, not from `Uri`'s: see the e2e
        // test `a_path_outside_ascii_is_forwarded_escaped`.)
        for spelling in ["/caf%C3%A9", "/caf%c3%a9/x", "/caf%C3%a9;v=1"] {
            assert_eq!(
                find(&router, "GET", spelling, "a"),
                Some("cafe"),
                "{spelling}"
            );
        }
    }

    /// A route for `GET` is also the route of `HEAD` and of `get`: a request the upstream
    /// answers with the same handler must not slip past the route's limits.
    #[test]
    fn methods_match_ignoring_case_and_get_takes_head() {
        let router = Router::new(&[
            route("catch-all", "/", None, None),
            route("search", "/v1/search", Some(vec![Method::GET]), None),
            route("upload", "/v1/upload", Some(vec![Method::POST]), None),
        ]);
        for method in ["GET", "HEAD", "get", "Head"] {
            assert_eq!(
                find(&router, method, "/v1/search", "a"),
                Some("search"),
                "{method}"
            );
        }
        for method in ["POST", "PUT", "OPTIONS"] {
            assert_eq!(
                find(&router, method, "/v1/search", "a"),
                Some("catch-all"),
                "{method}"
            );
        }
        assert_eq!(find(&router, "post", "/v1/upload", "a"), Some("upload"));
        assert_eq!(find(&router, "HEAD", "/v1/upload", "a"), Some("catch-all"));
    }

    #[test]
    fn the_normal_form_is_what_is_forwarded_with_the_query_as_it_came() {
        assert_eq!(
            normalized("/v1/./a/../login?x=/./&y=%2e", true).unwrap(),
            "/v1/login?x=/./&y=%2e"
        );
        assert_eq!(
            normalized("http://h.example/a//b/%7e", true).unwrap(),
            "http://h.example/a/b/~"
        );
        assert_eq!(normalized("/a//b", false).unwrap(), "/a//b");
        // Segment parameters are forwarded: only routing looks past them.
        assert_eq!(normalized("/v1/login;x=1", true).unwrap(), "/v1/login;x=1");
        assert_eq!(normalized("*", true).unwrap(), "*");
        assert_eq!(normalized("http://h?q=1", true).unwrap(), "http://h/?q=1");
        // As HTTP/2 hands it over: a `:path` of `?q=1`.
        let mut parts = http::uri::Parts::default();
        parts.path_and_query = Some(http::uri::PathAndQuery::from_static("?q=1"));
        let mut req = Request::builder()
            .uri(Uri::from_parts(parts).unwrap())
            .body(())
            .unwrap();
        normalize_path(&mut req, true).unwrap();
        assert_eq!(req.uri().to_string(), "/?q=1");
        assert_eq!(normalized("/v1/%zz?q=1", true), Err(BadPath::Malformed));
        assert_eq!(
            bad_path(BadPath::Malformed).status,
            http::StatusCode::BAD_REQUEST
        );
        // A dot segment only once reinterpreted: refused, whether or not the normal form
        // changed anything else.
        for uri in [
            "/v1/search/..;x",
            "/v1/./search/..%2Fx?q=1",
            "/v1/search/..%5c",
        ] {
            assert_eq!(normalized(uri, true), Err(BadPath::Ambiguous), "{uri}");
        }
        assert_eq!(
            bad_path(BadPath::Ambiguous).status,
            http::StatusCode::BAD_REQUEST
        );
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
        assert_eq!(find(&router, "GET", "/x", "api.example.com."), Some("h"));
        assert_eq!(find(&router, "GET", "/x", "API.example.com.:80"), Some("h"));
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
