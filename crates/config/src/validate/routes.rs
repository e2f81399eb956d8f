//! `[[routes]]`.

use std::num::NonZeroU32;

use super::Validator;
use crate::model::{methods_match, Respond, Route, RouteAction, Upstream};
use crate::raw::{RawRespond, RawRoute, Table, S};

impl Validator<'_> {
    pub(super) fn routes(
        &mut self,
        raw: &[Table<RawRoute>],
        upstreams: &[Upstream],
        merge_slashes: bool,
    ) -> Vec<Route> {
        self.unique_names("routes", raw.iter().map(|r| &r.name));
        self.reachable(raw);
        raw.iter()
            .enumerate()
            .filter_map(|(i, r)| self.route(i, r, upstreams, merge_slashes))
            .collect()
    }

    /// Paths are matched regardless of case: a route with the path of an earlier one but for
    /// case, the same host (or the earlier one has none: every host), and no method the earlier
    /// one does not match, could never match.
    fn reachable(&mut self, raw: &[Table<RawRoute>]) {
        // The methods a route matches (`None`: all), as the router compares them: ignoring
        // case, and `GET` taking `HEAD`.
        fn names(ms: &S<Vec<S<String>>>) -> impl Iterator<Item = &str> {
            ms.get_ref().iter().map(|m| m.get_ref().as_str())
        }
        // Whether every method of `later` is matched by `earlier`, as the router matches them.
        let covers = |earlier: &RawRoute, later: &RawRoute| match (&earlier.methods, &later.methods)
        {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(e), Some(l)) => names(l).all(|m| methods_match(names(e), m)),
        };
        let host = |r: &RawRoute| {
            r.host.as_ref().map(|h| {
                let h = h.get_ref();
                h.strip_suffix('.').unwrap_or(h).to_ascii_lowercase()
            })
        };
        // Routes by path as matched (ignoring case) and host, in file order: a route can be
        // shadowed only by an earlier one of its path with its host or none, so a file of
        // many routes is compared neither pair by pair nor, for many hosts on one path (a
        // host per tenant on `/`), against every route of the path (review: 20,000 such
        // routes took 15 s to check).
        type Place = (String, Option<String>);
        let place = |r: &RawRoute| -> Place { (r.path.get_ref().to_ascii_lowercase(), host(r)) };
        let mut by_place: std::collections::HashMap<Place, Vec<usize>> = Default::default();
        let places: Vec<Place> = raw.iter().map(|r| place(r)).collect();
        for (j, p) in places.iter().enumerate() {
            by_place.entry(p.clone()).or_default().push(j);
        }
        for (j, later) in raw.iter().enumerate() {
            let (path, later_host) = &places[j];
            let earlier_of = |host: Option<String>| {
                let list = by_place
                    .get(&(path.clone(), host))
                    .map_or(&[][..], Vec::as_slice);
                let earlier = &list[..list.partition_point(|&i| i < j)];
                earlier.iter().copied().find(|&i| covers(&raw[i], later))
            };
            // The first written of the matches for every host and those for this host.
            let any_host = earlier_of(None);
            let this_host = later_host
                .as_ref()
                .and_then(|h| earlier_of(Some(h.clone())));
            let shadowed = match (any_host, this_host) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if let Some(i) = shadowed {
                let (hosts, hint) = if raw[i].host.is_none() && later.host.is_some() {
                    ("with no host (so every host, this route's too)", " (among routes of the same path the first written is matched: write the one with a host first)")
                } else {
                    ("with the same host", "")
                };
                self.err(
                    Some(later.path.span()),
                    &format!("routes[{j}].path"),
                    format!(
                        "\"{}\" is routes[{i}]'s path (paths match regardless of case), {hosts} and every method of this route: this route could never match{hint}",
                        later.path.get_ref()
                    ),
                );
            }
        }
    }

    fn route(
        &mut self,
        i: usize,
        r: &RawRoute,
        upstreams: &[Upstream],
        merge_slashes: bool,
    ) -> Option<Route> {
        let key = |field: &str| format!("routes[{i}].{field}");
        self.path(&r.path, &key("path"), merge_slashes);
        if let Some(ms) = r.methods.as_ref().filter(|ms| ms.get_ref().is_empty()) {
            self.err(
                Some(ms.span()),
                &key("methods"),
                "an empty list matches no request; leave the key out for every method",
            );
        }
        let methods = r.methods.as_ref().map(|ms| {
            let all = ms.get_ref();
            // A set, not a look back over the list: 100,000 methods took 19 s (review).
            let mut seen = std::collections::HashSet::with_capacity(all.len());
            all.iter()
                .filter_map(|m| {
                    let v = m.get_ref();
                    if !seen.insert(v.as_str()) {
                        self.err(Some(m.span()), &key("methods"), format!("\"{v}\" is listed twice"));
                        return None;
                    }
                    // Methods are case-sensitive (RFC 9110 section 9.1): a lowercase letter is a
                    // slip for the standard ones. Any other token is a method (`M-SEARCH`).
                    let ok = !v.bytes().any(|b| b.is_ascii_lowercase());
                    match http::Method::from_bytes(v.as_bytes()) {
                        Ok(http::Method::CONNECT) => {
                            self.err(Some(m.span()), &key("methods"), "\"CONNECT\" is never routed: the gateway answers it 405 (it opens no tunnels)".to_string());
                            None
                        }
                        Ok(method) if ok => Some(method),
                        Ok(_) => {
                            self.err(Some(m.span()), &key("methods"), format!("\"{v}\" is not an HTTP method (write it in capitals, e.g. \"GET\")"));
                            None
                        }
                        Err(_) => {
                            self.err(Some(m.span()), &key("methods"), format!("\"{v}\" is not an HTTP method (a method is a token: capitals, digits and !#$%&'*+-.^_`|~)"));
                            None
                        }
                    }
                })
                .collect()
        });
        let host = r.host.as_ref().map(|h| {
            let v = h.get_ref();
            if v.contains('*') {
                self.err(
                    Some(h.span()),
                    &key("host"),
                    format!("\"{v}\": wildcards are not supported; a route matches one host exactly (leave host out for every host)"),
                );
            } else if !crate::host::host_ok(v) {
                // A host and a port each valid is a port written in; anything else with a
                // colon (`a:`, `a:b`, `a:65536`, `[::1]x`) is no host, and a route holding it
                // could never match (found by review: they were taken as having no port).
                let port = |p: &str| {
                    !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u16>().is_ok_and(|p| p > 0)
                };
                let with_port = match v.strip_prefix('[') {
                    Some(_) => v.split_once("]:").map(|(h, p)| (&v[..h.len() + 1], p)),
                    None => v.rsplit_once(':').filter(|(h, _)| !h.contains(':')),
                }
                .is_some_and(|(h, p)| crate::host::host_ok(h) && port(p));
                let message = if with_port {
                    format!("\"{v}\" has a port: a route matches its host on any port (write the host alone)")
                } else {
                    format!("\"{v}\" is not a host name")
                };
                self.err(Some(h.span()), &key("host"), message);
            }
            // A fully qualified name's trailing dot names the same host; requests are matched
            // without it.
            v.strip_suffix('.').unwrap_or(v).to_ascii_lowercase()
        });
        let cost = match &r.cost {
            None => Some(NonZeroU32::MIN),
            Some(c) => self.positive_u32(c, &key("cost")),
        };
        let action = match (&r.upstream, &r.respond) {
            (Some(u), None) => self.upstream_ref(u, &key("upstream"), upstreams),
            (None, Some(resp)) => self.respond(resp, &key("respond")),
            (Some(u), Some(_)) => {
                self.err(
                    Some(u.span()),
                    &key("upstream"),
                    "a route has either upstream or respond, not both",
                );
                None
            }
            (None, None) => {
                self.err(
                    Some(r.name.span()),
                    &key("name"),
                    format!(
                        "route \"{}\" needs upstream = \"<name>\" or respond = {{ status = 200 }}",
                        r.name.get_ref()
                    ),
                );
                None
            }
        };
        Some(Route {
            name: r.name.get_ref().clone(),
            path: r.path.get_ref().clone(),
            methods,
            host,
            cost: cost?,
            action: action?,
        })
    }

    fn upstream_ref(
        &mut self,
        u: &S<String>,
        key: &str,
        upstreams: &[Upstream],
    ) -> Option<RouteAction> {
        let found = upstreams.iter().position(|x| &x.name == u.get_ref());
        if found.is_none() && !self.refused_upstreams.contains(u.get_ref()) {
            let known: Vec<&str> = upstreams.iter().map(|x| x.name.as_str()).collect();
            self.err(
                Some(u.span()),
                key,
                format!(
                    "\"{}\" is not an upstream (known: {})",
                    u.get_ref(),
                    list_or_none(&known)
                ),
            );
        }
        found.map(RouteAction::Upstream)
    }

    fn respond(&mut self, raw: &Table<RawRespond>, key: &str) -> Option<RouteAction> {
        let status = u16::try_from(*raw.status.get_ref())
            .ok()
            .filter(|s| (200..=599).contains(s))
            .and_then(|s| http::StatusCode::from_u16(s).ok());
        if status.is_none() {
            self.err(
                Some(raw.status.span()),
                &format!("{key}.status"),
                format!(
                    "{} is not a status code between 200 and 599",
                    raw.status.get_ref()
                ),
            );
        }
        // 204, 205 and 304 responses have no body (RFC 9110 sections 15.3.5, 15.3.6, 15.4.5):
        // it would not be sent, or must not be.
        if let Some(
            s @ (http::StatusCode::NO_CONTENT
            | http::StatusCode::RESET_CONTENT
            | http::StatusCode::NOT_MODIFIED),
        ) = status
        {
            if let Some(body) = raw.body.as_ref().filter(|b| !b.get_ref().is_empty()) {
                self.err(
                    Some(body.span()),
                    &format!("{key}.body"),
                    format!(
                        "a {} response has no body: \"{}\" would never be sent (leave body out)",
                        s.as_u16(),
                        body.get_ref()
                    ),
                );
            }
        }
        let content_type = match &raw.content_type {
            Some(c) => {
                let v = c.get_ref();
                let problem = if v.trim().is_empty() {
                    Some("is empty (leave content_type out for \"text/plain; charset=utf-8\")")
                } else if http::HeaderValue::from_str(v).is_err() {
                    Some("is not a valid header value")
                } else {
                    None
                };
                if let Some(problem) = problem {
                    self.err(
                        Some(c.span()),
                        &format!("{key}.content_type"),
                        format!("\"{v}\" {problem}"),
                    );
                    return None;
                }
                v.clone()
            }
            None => "text/plain; charset=utf-8".to_owned(),
        };
        Some(RouteAction::Respond(Respond {
            status: status?,
            body: raw
                .body
                .as_ref()
                .map(|b| b.get_ref().clone())
                .unwrap_or_default(),
            content_type,
        }))
    }
}

/// The names quoted, the first ten of them; "none" for none.
pub(super) fn list_or_none(names: &[&str]) -> String {
    const SHOWN: usize = 10;
    if names.is_empty() {
        return "none".to_owned();
    }
    let mut out = names
        .iter()
        .take(SHOWN)
        .map(|n| format!("\"{n}\""))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        out.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    out
}
