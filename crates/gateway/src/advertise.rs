//! The add-headers step: the IETF RateLimit fields (draft-ietf-httpapi-ratelimit-headers,
//! revision 11: Structured Fields lists), the legacy `X-RateLimit-*` trio, and the route cost.

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

/// Writes the fields for every limit that applied, in configuration order. Each item's name
/// is already an sf-string ([`sf_string`], made once per limit when the gateway starts).
pub(crate) fn write(headers: &mut HeaderMap, items: &[(&str, Report)], cost: u32, legacy: bool) {
    if items.is_empty() {
        return;
    }
    let mut policy = String::with_capacity(32 * items.len());
    let mut state = String::with_capacity(24 * items.len());
    let mut digits = itoa::Buffer::new();
    for (i, (name, r)) in items.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        policy.push_str(name);
        policy.push_str(";q=");
        policy.push_str(digits.format(r.quota));
        if let Some(w) = r.window {
            policy.push_str(";w=");
            policy.push_str(digits.format(ceil_secs(w).max(1)));
        }
        state.push_str(name);
        state.push_str(";r=");
        state.push_str(digits.format(r.remaining));
        if let Some(t) = r.reset {
            state.push_str(";t=");
            state.push_str(digits.format(ceil_secs(t)));
        }
    }
    insert(headers, &RATELIMIT_POLICY, policy);
    insert(headers, &RATELIMIT, state);
    if cost != 1 {
        headers.insert(RATELIMIT_COST.clone(), HeaderValue::from(cost));
    }
    if legacy {
        // The limit closest to refusing: least remaining, then the longest wait.
        let (_, r) = items
            .iter()
            .min_by_key(|(_, r)| (r.remaining, std::cmp::Reverse(r.reset)))
            .expect("items is not empty");
        headers.insert(X_LIMIT.clone(), HeaderValue::from(r.quota));
        headers.insert(X_REMAINING.clone(), HeaderValue::from(r.remaining));
        headers.insert(
            X_RESET.clone(),
            HeaderValue::from(r.reset.map_or(0, ceil_secs)),
        );
    }
}

fn insert(headers: &mut HeaderMap, name: &HeaderName, value: String) {
    if let Ok(v) = HeaderValue::try_from(value) {
        headers.insert(name.clone(), v);
    }
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
        write(&mut h, &items, 1, false);
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

    #[test]
    fn legacy_headers_describe_the_limit_closest_to_refusing_and_cost_is_echoed() {
        let mut h = HeaderMap::new();
        let names = ["a", "b", "c"].map(sf_string);
        let items = [
            (&*names[0], report(10, Some(60), 3, Some(5_000))),
            (&*names[1], report(5, Some(1), 3, Some(9_000))),
            (&*names[2], report(10, None, 4, None)),
        ];
        write(&mut h, &items, 5, true);
        assert_eq!(h["x-ratelimit-limit"], "5");
        assert_eq!(h["x-ratelimit-remaining"], "3");
        assert_eq!(h["x-ratelimit-reset"], "9");
        assert_eq!(h["ratelimit-cost"], "5");
        assert_eq!(h["ratelimit"], "\"a\";r=3;t=5, \"b\";r=3;t=9, \"c\";r=4");
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
