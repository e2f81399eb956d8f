//! `[[limits]]`, and the checks that join limits to routes.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;

use super::routes::list_or_none;
use super::sections::is_header_name;
use super::Validator;
use crate::model::{Algorithm, KeyPart, Limit, Mode, Route};
use crate::raw::{RawLimit, RawRoute, Table, S};

/// The most parts one limit's key may have.
const MAX_KEY_PARTS: usize = 8;

impl Validator<'_> {
    pub(super) fn limits(
        &mut self,
        raw: &[Table<RawLimit>],
        raw_routes: &[Table<RawRoute>],
        routes: &[Route],
    ) -> Vec<Limit> {
        self.unique_names("limits", raw.iter().map(|l| &l.name));
        // Route names to indices, once: a limit may list thousands.
        let route_index: HashMap<&str, usize> = raw_routes
            .iter()
            .enumerate()
            .rev()
            .map(|(i, r)| (r.name.get_ref().as_str(), i))
            .collect();
        let limits: Vec<Limit> = raw
            .iter()
            .enumerate()
            .filter_map(|(i, l)| self.limit(i, l, raw_routes, &route_index))
            .collect();
        // Only when every route and limit is valid do indices line up; otherwise the errors
        // already reported are what the user must fix first.
        if limits.len() == raw.len() && routes.len() == raw_routes.len() {
            self.costs_fit(&limits, routes, raw_routes);
        }
        limits
    }

    fn limit(
        &mut self,
        i: usize,
        l: &RawLimit,
        raw_routes: &[Table<RawRoute>],
        route_index: &HashMap<&str, usize>,
    ) -> Option<Limit> {
        let key = |field: &str| format!("limits[{i}].{field}");
        let by = self.key_parts(&l.by, &key("by"));
        let quota = self.positive_u32(&l.quota, &key("quota"));
        let algorithm = self.algorithm(l, &key("algorithm"), &key("burst"));
        let window = match (&l.window, algorithm) {
            (Some(w), Some(Algorithm::Concurrency)) => {
                self.err(Some(w.span()), &key("window"), format!("\"{}\" is not used: a concurrency limit counts requests in flight, not per window", w.get_ref()));
                None
            }
            (Some(w), _) => self.required_whole_seconds(
                w,
                &key("window"),
                "the RateLimit fields tell callers windows in seconds (write e.g. \"1s\" with the quota to match)",
            ),
            (None, Some(Algorithm::Concurrency)) | (None, None) => None,
            (None, Some(a)) => {
                self.err(
                    Some(l.name.span()),
                    &key("window"),
                    format!("a {} limit needs a window (e.g. window = \"1m\")", a.name()),
                );
                None
            }
        };
        if let Some(names) = l.routes.as_ref().filter(|ns| ns.get_ref().is_empty()) {
            self.err(
                Some(names.span()),
                &key("routes"),
                "an empty list limits no route; leave the key out for every route",
            );
        }
        let routes = l.routes.as_ref().map(|names| {
            let mut seen = HashSet::new();
            let mut known: Option<String> = None;
            names
                .get_ref()
                .iter()
                .enumerate()
                .filter_map(|(j, n)| {
                    if !seen.insert(n.get_ref().as_str()) {
                        self.err(
                            Some(n.span()),
                            &format!("limits[{i}].routes[{j}]"),
                            format!("\"{}\" is listed twice", n.get_ref()),
                        );
                        return None;
                    }
                    let found = route_index.get(n.get_ref().as_str()).copied();
                    if found.is_none() {
                        let known = known.get_or_insert_with(|| {
                            let names: Vec<&str> = raw_routes
                                .iter()
                                .map(|r| r.name.get_ref().as_str())
                                .collect();
                            list_or_none(&names)
                        });
                        self.err(
                            Some(n.span()),
                            &format!("limits[{i}].routes[{j}]"),
                            format!("\"{}\" is not a route (known: {known})", n.get_ref()),
                        );
                    }
                    found
                })
                .collect::<Vec<_>>()
        });
        let mode = self.mode(l, &key("mode"), &key("max_delay"), algorithm);
        let block_for = l
            .block_for
            .as_ref()
            .and_then(|b| self.required_duration(b, &key("block_for")));
        // Every key is checked before any problem ends the limit, so that `sluice check` lists
        // them all at once.
        let block_ok = match (&l.block_for, algorithm) {
            (Some(b), Some(Algorithm::Concurrency)) => {
                let msg = format!("\"{}\" is not used: a concurrency slot frees when a request ends, so there is nothing to block", b.get_ref());
                self.err(Some(b.span()), &key("block_for"), msg);
                false
            }
            (Some(_), _) => block_for.is_some(),
            (None, _) => true,
        };
        let max_keys = match &l.max_keys {
            Some(m) => self.positive_u32(m, &key("max_keys")),
            None => NonZeroU32::new(1_000_000),
        };
        // A bucket's full refill time is its `w` in `RateLimit-Policy`: beyond the longest
        // duration accepted anywhere, the field could not say it.
        let mut refill_ok = true;
        if let (Some(Algorithm::TokenBucket { burst }), Some(w), Some(q)) =
            (algorithm, window, quota)
        {
            let refill = w.as_nanos() * u128::from(burst.get()) / u128::from(q.get());
            if refill > super::MAX_DURATION.as_nanos() {
                let span = l.burst.as_ref().map_or(l.quota.span(), |b| b.span());
                self.err(Some(span), &key(if l.burst.is_some() { "burst" } else { "quota" }), format!("a bucket of {burst} refilled {q} per {} takes more than 36500d (100 years) to fill: lower the burst or shorten the window", l.window.as_ref().map_or("", |w| w.get_ref().as_str())));
                refill_ok = false;
            }
        }
        let algorithm = algorithm?;
        if !block_ok || !refill_ok || (algorithm != Algorithm::Concurrency && window.is_none()) {
            return None;
        }
        Some(Limit {
            name: l.name.get_ref().clone(),
            by: by?,
            algorithm,
            quota: quota?,
            window,
            routes,
            mode: mode?,
            block_for,
            max_keys: max_keys?,
        })
    }

    fn key_parts(&mut self, by: &S<crate::raw::OneOrMany>, key: &str) -> Option<Vec<KeyPart>> {
        let items = by.get_ref().items();
        if items.is_empty() {
            self.err(Some(by.span()), key, "an empty list counts nobody; name at least one of \"ip\", \"api_key\", \"route\", \"global\", \"header:<name>\"");
            return None;
        }
        if items.len() > MAX_KEY_PARTS {
            let msg = format!("{} parts: at most {MAX_KEY_PARTS} (each is read and hashed on every request the limit covers)", items.len());
            self.err(Some(by.span()), key, msg);
            return None;
        }
        let mut parts = Vec::with_capacity(items.len());
        for (i, (item, place)) in items.into_iter().enumerate() {
            // An element of a list is pointed at itself, and named; a lone string is the key's
            // value.
            let (span, key) = match place {
                Some(place) => (Some(place), format!("{key}[{i}]")),
                None => (Some(by.span()), key.to_owned()),
            };
            let key = key.as_str();
            let part = match item {
                "ip" => KeyPart::Ip,
                "api_key" => KeyPart::ApiKey,
                "route" => KeyPart::Route,
                "global" => KeyPart::Global,
                _ => match item.strip_prefix("header:") {
                    Some(name) if is_header_name(name) => {
                        KeyPart::Header(name.to_ascii_lowercase())
                    }
                    _ => {
                        self.err(span, key, format!("\"{item}\" is not a key part (write \"ip\", \"api_key\", \"route\", \"global\" or \"header:<name>\")"));
                        return None;
                    }
                },
            };
            if parts.contains(&part) {
                self.err(span, key, format!("\"{item}\" is named twice"));
                return None;
            }
            parts.push(part);
        }
        Some(parts)
    }

    fn algorithm(&mut self, l: &RawLimit, key: &str, burst_key: &str) -> Option<Algorithm> {
        let name = l
            .algorithm
            .as_ref()
            .map_or("token_bucket", |a| a.get_ref().as_str());
        let algorithm = match name {
            "token_bucket" => {
                let burst = match &l.burst {
                    Some(b) => self.positive_u32(b, burst_key)?,
                    None => u32::try_from(*l.quota.get_ref())
                        .ok()
                        .and_then(NonZeroU32::new)?,
                };
                Algorithm::TokenBucket { burst }
            }
            "fixed_window" => Algorithm::FixedWindow,
            "sliding_window" => Algorithm::SlidingWindow,
            "concurrency" => Algorithm::Concurrency,
            other => {
                let span = l.algorithm.as_ref().map(|a| a.span());
                self.err(span, key, format!("\"{other}\" is not an algorithm (write \"token_bucket\", \"fixed_window\", \"sliding_window\" or \"concurrency\")"));
                return None;
            }
        };
        if let (Some(b), false) = (&l.burst, matches!(algorithm, Algorithm::TokenBucket { .. })) {
            self.err(
                Some(b.span()),
                burst_key,
                format!(
                    "{} is not used: burst applies to token_bucket limits only, not {name}",
                    b.get_ref()
                ),
            );
            return None;
        }
        Some(algorithm)
    }

    fn mode(
        &mut self,
        l: &RawLimit,
        key: &str,
        delay_key: &str,
        algorithm: Option<Algorithm>,
    ) -> Option<Mode> {
        let name = l.mode.as_ref().map_or("enforce", |m| m.get_ref().as_str());
        let max_delay = l
            .max_delay
            .as_ref()
            .and_then(|d| self.required_duration(d, delay_key));
        match (name, &l.max_delay) {
            ("delay", None) => {
                let span = l.mode.as_ref().map(|m| m.span());
                self.err(span, key, "\"delay\" needs max_delay, the longest a request may be held (e.g. max_delay = \"500ms\")");
                None
            }
            ("delay", Some(_)) if algorithm == Some(Algorithm::Concurrency) => {
                let span = l.mode.as_ref().map(|m| m.span());
                self.err(span, key, "\"delay\" is not supported for concurrency limits (use \"enforce\" or \"dry_run\")");
                None
            }
            ("delay", Some(_)) => max_delay.map(|max_delay| Mode::Delay { max_delay }),
            ("enforce" | "dry_run", Some(d)) => {
                self.err(
                    Some(d.span()),
                    delay_key,
                    format!(
                        "\"{}\" is not used: max_delay applies only with mode = \"delay\"",
                        d.get_ref()
                    ),
                );
                None
            }
            ("enforce", None) => Some(Mode::Enforce),
            ("dry_run", None) => Some(Mode::DryRun),
            (other, _) => {
                let span = l.mode.as_ref().map(|m| m.span());
                self.err(
                    span,
                    key,
                    format!(
                        "\"{other}\" is not a mode (write \"enforce\", \"dry_run\" or \"delay\")"
                    ),
                );
                None
            }
        }
    }

    /// A route whose cost exceeds the most a limit can ever hold would be refused forever. A
    /// dry-run limit refuses nothing, so it only says it would (`sluice check` and `run` warn).
    fn costs_fit(&mut self, limits: &[Limit], routes: &[Route], raw_routes: &[Table<RawRoute>]) {
        for (ri, route) in routes.iter().enumerate() {
            for limit in limits {
                let applies = limit.applies_to(ri) && limit.mode != Mode::DryRun;
                let Some((capacity, what)) = limit.capacity() else {
                    continue;
                };
                if applies && route.cost > capacity {
                    let span = raw_routes[ri].cost.as_ref().map(|c| c.span());
                    self.err(span, &format!("routes[{ri}].cost"), format!("{} is larger than the {what} of limit \"{}\" ({capacity}): no request on route \"{}\" could ever pass", route.cost, limit.name, route.name));
                }
            }
        }
    }
}
