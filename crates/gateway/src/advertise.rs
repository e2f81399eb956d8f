//! The add-headers step: the IETF RateLimit fields (draft-ietf-httpapi-ratelimit-headers,
//! revision 11: Structured Fields lists), the legacy `X-RateLimit-*` trio, and the route cost.

use std::sync::OnceLock;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;
use sluice_limiter::Report;

static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static RATELIMIT_COST: HeaderName = HeaderName::from_static("ratelimit-cost");
static X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Whole seconds, rounded up: a client that waits this long is not early.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// A route's `RateLimit-Policy` value, made by the first response that needs it and reused
/// while the same limits apply with the same quotas and windows. Unlike `RateLimit`, the
/// policy does not change from one request to the next; writing and checking it again for
/// every response cost ~400 instructions.
#[derive(Debug, Default)]
pub(crate) struct PolicyCache(OnceLock<(Vec<PolicyItem>, HeaderValue)>);

/// What a policy member is made of: the limit's name (an sf-string), quota and window.
type PolicyItem = (Box<str>, u32, Option<Duration>);

impl PolicyCache {
    /// The cached value if it was made from exactly these limits, quotas and windows.
    fn get(&self, items: &[(&str, Report)]) -> Option<&HeaderValue> {
        let (made_from, value) = self.0.get()?;
        let same = made_from.len() == items.len()
            && made_from
                .iter()
                .zip(items)
                .all(|((name, quota, window), (n, r))| {
                    **name == **n && *quota == r.quota && *window == r.window
                });
        same.then_some(value)
    }

    /// Keeps `value` if nothing is cached yet (a route whose limits vary from request to
    /// request, e.g. with and without an API key, caches the first set and builds the others).
    fn offer(&self, items: &[(&str, Report)], value: &HeaderValue) {
        self.0.get_or_init(|| {
            let made_from = items
                .iter()
                .map(|(n, r)| (Box::from(*n), r.quota, r.window));
            (made_from.collect(), value.clone())
        });
    }
}

/// Writes the fields for every limit that applied, in configuration order. Each item's name
/// is already an sf-string ([`sf_string`], made once per limit when the gateway starts).
pub(crate) fn write(
    headers: &mut HeaderMap,
    items: &[(&str, Report)],
    cost: u32,
    legacy: Legacy,
    cache: &PolicyCache,
) {
    if items.is_empty() {
        return;
    }
    let policy = match cache.get(items) {
        Some(v) => Some(v.clone()),
        None => {
            let v = value(policy(items));
            if let Some(v) = &v {
                cache.offer(items, v);
            }
            v
        }
    };
    // Each field the gateway writes replaces the upstream's; and where it writes a family
    // (the IETF fields, the legacy trio), the upstream's others of it go too, or a client
    // would read the gateway's figures beside the upstream's (review: the upstream's
    // `X-RateLimit-Reset: 3600` beside the gateway's `X-RateLimit-Remaining: 0`).
    match policy {
        Some(v) => headers.insert(RATELIMIT_POLICY.clone(), v),
        None => headers.remove(&RATELIMIT_POLICY),
    };
    match value(state(items)) {
        Some(v) => headers.insert(RATELIMIT.clone(), v),
        None => headers.remove(&RATELIMIT),
    };
    match cost {
        1 => headers.remove(&RATELIMIT_COST),
        _ => headers.insert(RATELIMIT_COST.clone(), HeaderValue::from(cost)),
    };
    if let Legacy::On { refusing } = legacy {
        // The limit that refused, on a 429; else the one closest to refusing: least
        // remaining, then the longest wait. A concurrency limit only once its slots are all
        // taken: the trio reads as a quota per window, which its slots are not (review: a
        // shipped config showed its 32 slots on every response, not the per-IP rate). With
        // only such limits (all with free slots), no trio (review: a lone one was sent).
        let closest = || {
            items
                .iter()
                .filter(|(_, r)| r.window.is_some() || r.remaining == 0)
                .min_by_key(|(_, r)| (r.remaining, std::cmp::Reverse(r.reset)))
        };
        let Some((_, r)) = refusing.and_then(|i| items.get(i)).or_else(closest) else {
            for name in [&X_LIMIT, &X_REMAINING, &X_RESET] {
                headers.remove(name);
            }
            return;
        };
        headers.insert(X_LIMIT.clone(), HeaderValue::from(r.quota));
        headers.insert(X_REMAINING.clone(), HeaderValue::from(r.remaining));
        // A limit with no reset time (concurrency: a slot frees when a request ends) says
        // none, rather than 0, "now", beside a Retry-After that says otherwise.
        match r.window.and(r.reset) {
            Some(reset) => headers.insert(X_RESET.clone(), HeaderValue::from(ceil_secs(reset))),
            None => headers.remove(&X_RESET),
        };
    }
}

/// Whether to write the legacy `X-RateLimit-*` trio, and for a 429, which item refused (the
/// trio then describes it: a client reading only the trio learns why it was refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Legacy {
    Off,
    On { refusing: Option<usize> },
}

/// `RateLimit-Policy`: each limit's quota and window.
fn policy(items: &[(&str, Report)]) -> String {
    let window = |r: &Report| r.window.map(|w| ceil_secs(w).max(1));
    list(items, (";q=", |r| r.quota.into()), (";w=", window))
}

/// `RateLimit`: each limit's remaining quota and time to reset. A concurrency limit (no
/// window) has no time to reset: its slots free when requests end.
fn state(items: &[(&str, Report)]) -> String {
    let reset = |r: &Report| r.window.and(r.reset).map(ceil_secs);
    list(items, (";r=", |r| r.remaining.into()), (";t=", reset))
}

/// An sf-list with a member per limit: its name, the `first` parameter, and the `second` when
/// it has one.
fn list(
    items: &[(&str, Report)],
    first: (&str, fn(&Report) -> u64),
    second: (&str, fn(&Report) -> Option<u64>),
) -> String {
    let mut out = String::with_capacity(32 * items.len());
    let mut digits = itoa::Buffer::new();
    for (i, (name, r)) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(name);
        out.push_str(first.0);
        out.push_str(digits.format(first.1(r)));
        if let Some(n) = second.1(r) {
            out.push_str(second.0);
            out.push_str(digits.format(n));
        }
    }
    out
}

fn value(s: String) -> Option<HeaderValue> {
    HeaderValue::try_from(s).ok()
}

/// `s` as an sf-string (RFC 8941 section 3.3.3): quoted, with `"` and `\` escaped and
/// characters outside printable ASCII left out.
pub(crate) fn sf_string(s: &str) -> Box<str> {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars().filter(|c| (' '..='~').contains(c)) {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out.into_boxed_str()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_limiter::{Algorithm, Limit, Limiter};
    use std::num::NonZeroU32;

    fn report(quota: u32, window: Option<u64>, remaining: u32, reset_ms: Option<u64>) -> Report {
        Report {
            limit: any_limit_id(),
            quota,
            window: window.map(Duration::from_secs),
            remaining,
            reset: reset_ms.map(Duration::from_millis),
        }
    }

    /// Reports name their limit; these tests only format figures, so any id does.
    fn any_limit_id() -> sluice_limiter::LimitId {
        let limit = Limit::new(
            "x",
            Algorithm::FixedWindow,
            NonZeroU32::MIN,
            Duration::from_secs(1),
        )
        .unwrap();
        Limiter::new([limit]).unwrap().id("x").unwrap()
    }

    #[test]
    fn fields_list_every_limit_as_structured_field_members() {
        let mut h = HeaderMap::new();
        let (ip, key) = (sf_string("per-ip"), sf_string("key-quota"));
        let items = [
            (&*ip, report(40, Some(2), 31, Some(400))),
            (&*key, report(1000, Some(3600), 997, Some(2_112_300))),
        ];
        write(&mut h, &items, 1, Legacy::Off, &PolicyCache::default());
        assert_eq!(
            h["ratelimit-policy"],
            "\"per-ip\";q=40;w=2, \"key-quota\";q=1000;w=3600"
        );
        assert_eq!(
            h["ratelimit"],
            "\"per-ip\";r=31;t=1, \"key-quota\";r=997;t=2113"
        );
        assert!(!h.contains_key("ratelimit-cost"));
        assert!(!h.contains_key("x-ratelimit-limit"));
    }

    /// Review: where the gateway writes a family of fields, the upstream's others of it went
    /// through beside them (its `X-RateLimit-Reset: 3600` with the gateway's
    /// `X-RateLimit-Remaining: 0`, its `RateLimit-Cost: 9` on a route of cost 1).
    #[test]
    fn the_upstreams_fields_of_a_family_the_gateway_writes_are_not_left_beside_its_own() {
        let upstreams = || {
            let mut h = HeaderMap::new();
            for (name, value) in [
                ("x-ratelimit-limit", "5000"),
                ("x-ratelimit-remaining", "4999"),
                ("x-ratelimit-reset", "3600"),
                ("ratelimit-cost", "9"),
                ("ratelimit", "\"up\";r=1"),
            ] {
                h.insert(name, HeaderValue::from_static(value));
            }
            h
        };
        let name = sf_string("conc");
        // A full concurrency limit: the trio without a reset.
        let items = [(&*name, report(1, None, 0, None))];
        let mut h = upstreams();
        let legacy = Legacy::On { refusing: None };
        write(&mut h, &items, 1, legacy, &PolicyCache::default());
        assert_eq!(h["x-ratelimit-limit"], "1");
        assert_eq!(h["x-ratelimit-remaining"], "0");
        assert!(!h.contains_key("x-ratelimit-reset"), "{h:?}");
        assert!(!h.contains_key("ratelimit-cost"), "{h:?}");
        assert_eq!(h["ratelimit"], "\"conc\";r=0");
        // A concurrency limit with free slots: no trio at all.
        let items = [(&*name, report(2, None, 1, None))];
        let mut h = upstreams();
        write(&mut h, &items, 1, legacy, &PolicyCache::default());
        assert!(!h.contains_key("x-ratelimit-limit"), "{h:?}");
        assert!(!h.contains_key("x-ratelimit-reset"), "{h:?}");
    }

    #[test]
    fn legacy_headers_describe_the_limit_closest_to_refusing_and_cost_is_echoed() {
        let mut h = HeaderMap::new();
        let names = ["a", "b", "c"].map(sf_string);
        let items = [
            (&*names[0], report(10, Some(60), 3, Some(5_000))),
            (&*names[1], report(5, Some(1), 3, Some(9_000))),
            // A concurrency limit with free slots: the limiter says "now" (zero); no `t`.
            (&*names[2], report(10, None, 4, Some(0))),
        ];
        write(
            &mut h,
            &items,
            5,
            Legacy::On { refusing: None },
            &PolicyCache::default(),
        );
        assert_eq!(h["x-ratelimit-limit"], "5");
        assert_eq!(h["x-ratelimit-remaining"], "3");
        assert_eq!(h["x-ratelimit-reset"], "9");
        assert_eq!(h["ratelimit-cost"], "5");
        assert_eq!(h["ratelimit"], "\"a\";r=3;t=5, \"b\";r=3;t=9, \"c\";r=4");
        // A concurrency limit with fewer left than any rate is not the trio's while it has a
        // slot free (the trio reads as a quota per window); once full, it is.
        for (slots_left, limit) in [(1, "10"), (0, "2")] {
            let mut h = HeaderMap::new();
            let items = [
                (&*names[0], report(10, Some(60), 3, Some(5_000))),
                (&*names[2], report(2, None, slots_left, Some(0))),
            ];
            let legacy = Legacy::On { refusing: None };
            write(&mut h, &items, 1, legacy, &PolicyCache::default());
            assert_eq!(h["x-ratelimit-limit"], limit, "{slots_left} slots left");
        }
        // On a 429 the trio describes the limit that refused, here a full concurrency limit,
        // not another that also has nothing left (review: it named a `delay` limit).
        let mut h = HeaderMap::new();
        let spent = [
            (&*names[0], report(10, Some(60), 0, Some(5_000))),
            (&*names[2], report(2, None, 0, None)),
        ];
        let refusing = Legacy::On { refusing: Some(1) };
        write(&mut h, &spent, 1, refusing, &PolicyCache::default());
        assert_eq!(h["x-ratelimit-limit"], "2");
        assert!(!h.contains_key("x-ratelimit-reset"));
        // A concurrency limit has no reset time: spent, no X-RateLimit-Reset (not 0); with a
        // slot free, and no other limit, no trio at all.
        for (remaining, reset) in [(0, None), (1, Some(0))] {
            let mut h = HeaderMap::new();
            write(
                &mut h,
                &[(&*names[2], report(2, None, remaining, reset))],
                1,
                Legacy::On { refusing: None },
                &PolicyCache::default(),
            );
            let trio = (remaining == 0).then(|| remaining.to_string());
            let sent = h
                .get("x-ratelimit-remaining")
                .map(|v| v.to_str().unwrap().to_owned());
            assert_eq!(sent, trio);
            assert_eq!(h.contains_key("x-ratelimit-limit"), remaining == 0);
            assert!(!h.contains_key("x-ratelimit-reset"));
            assert_eq!(h["ratelimit"], format!("\"c\";r={remaining}").as_str());
        }
    }

    #[test]
    fn a_cached_policy_is_used_only_for_the_limits_it_was_made_from() {
        let cache = PolicyCache::default();
        let (a, b) = (sf_string("a"), sf_string("b"));
        let policy = |items: &[(&str, Report)]| {
            let mut h = HeaderMap::new();
            write(&mut h, items, 1, Legacy::Off, &cache);
            h["ratelimit-policy"].clone()
        };
        let two = [
            (&*a, report(10, Some(60), 3, None)),
            (&*b, report(5, Some(1), 4, None)),
        ];
        assert_eq!(policy(&two), "\"a\";q=10;w=60, \"b\";q=5;w=1");
        assert_eq!(
            policy(&two),
            "\"a\";q=10;w=60, \"b\";q=5;w=1",
            "from the cache"
        );
        assert_eq!(policy(&two[..1]), "\"a\";q=10;w=60", "fewer limits");
        let other_quota = [(&*a, report(11, Some(60), 3, None)), two[1]];
        assert_eq!(policy(&other_quota), "\"a\";q=11;w=60, \"b\";q=5;w=1");
        let other_window = [two[0], (&*b, report(5, None, 4, None))];
        assert_eq!(policy(&other_window), "\"a\";q=10;w=60, \"b\";q=5");
        let other_name = [two[0], (&*a, report(5, Some(1), 4, None))];
        assert_eq!(policy(&other_name), "\"a\";q=10;w=60, \"a\";q=5;w=1");
    }

    #[test]
    fn names_are_quoted_and_escaped_as_sf_strings() {
        assert_eq!(&*sf_string("per-ip"), "\"per-ip\"");
        assert_eq!(&*sf_string("a\"b\\c\u{e9}\n"), "\"a\\\"b\\\\c\"");
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(42)), 42);
        assert_eq!(ceil_secs(Duration::from_nanos(42_000_000_001)), 43);
    }
}
