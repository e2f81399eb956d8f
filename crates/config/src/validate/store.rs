//! `[store]`: `kind = "memory"` (the default, no other key) or `kind = "redis"`.

use std::num::NonZeroU32;
use std::time::Duration;

use super::Validator;
use crate::host::{host_ok, redact_url};
use crate::model::{Algorithm, Limit, OnError, RedisStore, Store};
use crate::raw::{RawLimit, RawStore, Table, S};

/// `timeout` when not written.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
/// `hash_secret_env` when not written.
pub(crate) const DEFAULT_SECRET_ENV: &str = "SLUICE_HASH_SECRET";

impl Validator<'_> {
    pub(super) fn store(&mut self, raw: &RawStore) -> Store {
        let kind = raw.kind.as_ref().map_or("memory", |k| k.get_ref().as_str());
        match kind {
            "memory" => {
                self.unused_with_memory(raw);
                Store::Memory
            }
            "redis" => self.redis(raw).map_or(Store::Memory, Store::Redis),
            other => {
                let span = raw.kind.as_ref().map(S::span);
                let msg =
                    format!("\"{other}\" is not a store kind (write \"memory\" or \"redis\")");
                self.err(span, "store.kind", msg);
                Store::Memory
            }
        }
    }

    /// Redis keys under `kind = "memory"` are a mistake: most likely a forgotten `kind`.
    fn unused_with_memory(&mut self, raw: &RawStore) {
        let quoted = |v: &Option<S<String>>| {
            v.as_ref()
                .map(|v| (v.span(), format!("\"{}\"", v.get_ref())))
        };
        let set = [
            ("url", quoted(&raw.url)),
            ("timeout", quoted(&raw.timeout)),
            ("on_error", quoted(&raw.on_error)),
            (
                "instances",
                raw.instances
                    .as_ref()
                    .map(|v| (v.span(), v.get_ref().to_string())),
            ),
            ("hash_secret_env", quoted(&raw.hash_secret_env)),
        ];
        for (key, found) in set {
            if let Some((span, value)) = found {
                let msg = format!("{value} is not used: the store is \"memory\" (set kind = \"redis\" to share limits through Redis)");
                self.err(Some(span), &format!("store.{key}"), msg);
            }
        }
    }

    fn redis(&mut self, raw: &RawStore) -> Option<RedisStore> {
        // Without a url the other keys are still checked: every problem at once (review).
        let url = match &raw.url {
            Some(url) => self.redis_url(url).then(|| url.get_ref().clone()),
            None => {
                let span = raw.kind.as_ref().map(S::span);
                self.err(
                    span,
                    "store.url",
                    "required with kind = \"redis\" (write e.g. url = \"redis://127.0.0.1:6379\")",
                );
                None
            }
        };
        let timeout = self.duration(&raw.timeout, "store.timeout", DEFAULT_TIMEOUT);
        let on_error = match &raw.on_error {
            None => OnError::Local,
            Some(v) => {
                match v.get_ref().as_str() {
                    "allow" => OnError::Allow,
                    "deny" => OnError::Deny,
                    "local" => OnError::Local,
                    other => {
                        let msg = format!("\"{other}\" is not a fallback (write \"allow\", \"deny\" or \"local\")");
                        self.err(Some(v.span()), "store.on_error", msg);
                        OnError::Local
                    }
                }
            }
        };
        let instances = match &raw.instances {
            None => Some(NonZeroU32::MIN),
            Some(v) if on_error != OnError::Local => {
                let msg = format!(
                    "{} is not used: only on_error = \"local\" divides the quota among instances",
                    v.get_ref()
                );
                self.err(Some(v.span()), "store.instances", msg);
                None
            }
            Some(v) => self.positive_u32(v, "store.instances"),
        };
        let hash_secret_env = match &raw.hash_secret_env {
            None => Some(DEFAULT_SECRET_ENV.to_owned()),
            Some(v) if is_env_name(v.get_ref()) => Some(v.get_ref().clone()),
            Some(v) => {
                let msg = format!("\"{}\" is not an environment variable name (letters, digits and '_', not starting with a digit)", v.get_ref());
                self.err(Some(v.span()), "store.hash_secret_env", msg);
                None
            }
        };
        Some(RedisStore {
            url: url?,
            timeout,
            on_error,
            instances: instances?,
            hash_secret_env: hash_secret_env?,
        })
    }

    /// `redis://`, an optional `user:password@`, a host, an optional port and an optional
    /// database number; nothing else (no query, no fragment), so that what is accepted here is
    /// what the Redis client reads, whole. `rediss://` (TLS) is refused until sluice is built
    /// with TLS.
    fn redis_url(&mut self, v: &S<String>) -> bool {
        let s = v.get_ref();
        let problem = match s.split_once("://") {
            Some(("rediss", _)) => Some("needs TLS to Redis, which this build of sluice does not have yet: use redis:// on a private network or through a TLS tunnel"),
            Some(("redis", rest)) => redis_url_problem(rest),
            _ => Some("is not a Redis URL (write \"redis://host:port\")"),
        };
        if let Some(problem) = problem {
            let shown = redact_url(s);
            self.err(
                Some(v.span()),
                "store.url",
                format!("\"{shown}\" {problem}"),
            );
        }
        problem.is_none()
    }
}

impl Validator<'_> {
    /// Limits the Redis store cannot decide exactly: its script counts in microseconds in Lua
    /// numbers (doubles, exact up to 2^53, and the script keeps a factor of two in hand). The
    /// same products as `sluice_store_redis::RemoteLimit::new` checks when `sluice run` starts,
    /// so that `sluice check` refuses what `run` would (a test in the gateway holds the two
    /// together).
    pub(super) fn redis_exact(&mut self, limits: &[Limit], raw: &[Table<RawLimit>]) {
        const EXACT: u128 = 1 << 52;
        for (i, (l, r)) in limits.iter().zip(raw).enumerate() {
            let Some(window) = l.window else { continue };
            let window_us = window.as_micros();
            let quota = u128::from(l.quota.get());
            let too_large = match l.algorithm {
                Algorithm::TokenBucket { burst } => {
                    window_us / gcd(window_us, quota) * u128::from(burst.get()) * 2 > EXACT
                }
                Algorithm::SlidingWindow => quota * window_us * 3 > EXACT,
                Algorithm::FixedWindow | Algorithm::Concurrency => false,
            };
            if too_large {
                let written = r
                    .window
                    .as_ref()
                    .map_or(String::new(), |w| w.get_ref().clone());
                let msg = match l.algorithm {
                    Algorithm::TokenBucket { burst } => format!("\"{written}\" with a quota of {quota} and a burst of {burst} (token_bucket: window / quota, reduced, times burst) is more than the Redis store counts exactly (its script counts microseconds in Lua numbers): shorten the window, or lower the burst"),
                    _ => format!("\"{written}\" with a quota of {quota} ({}) is more than the Redis store counts exactly (its script counts microseconds in Lua numbers): shorten the window or lower the quota", l.algorithm.name()),
                };
                self.err(
                    r.window.as_ref().map(S::span),
                    &format!("limits[{i}].window"),
                    msg,
                );
            }
        }
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

/// What is wrong with a Redis URL after `redis://`, if anything.
fn redis_url_problem(rest: &str) -> Option<&'static str> {
    // A `/`, `?` or `#` before the last `@` is part of an unencoded password, which the
    // client would cut there.
    if rest
        .rfind('@')
        .is_some_and(|at| rest[..at].contains(['/', '?', '#']))
    {
        return Some(
            "has '/', '?' or '#' in its user or password (percent-encode them: %2F, %3F, %23)",
        );
    }
    if rest.contains(['?', '#']) {
        return Some("has a query or fragment, which sluice does not read (write the database as a path: \"redis://host:6379/3\")");
    }
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (userinfo, host_port) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    if userinfo.is_some_and(|u| u.chars().any(|c| c.is_whitespace() || c.is_control())) {
        return Some(
            "has a space or control character in its user or password (percent-encode it)",
        );
    }
    // The client percent-decodes the user and password: a `%` not starting an escape would
    // be refused when sluice runs, and one that does is read as the character it encodes
    // (review: `check` passed both).
    if let Some(problem) = userinfo.and_then(percent_problem) {
        return Some(problem);
    }
    let (host, port) = split_port(host_port);
    let written = if host_port.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    if host.is_empty() {
        Some("has no host")
    } else if host_port.starts_with('[')
        && host_port
            .split_once(']')
            .is_some_and(|(_, after)| !after.is_empty() && !after.starts_with(':'))
    {
        // Review: `redis://[::1]x` passed `check`, and `run` refused it.
        Some("has something after its bracketed IPv6 address that is not ':' and a port")
    } else if !host_ok(&written) {
        Some("has a host that is neither a name (letters, digits, '-', '_' and '.'), a dotted IPv4 address nor a bracketed IPv6 one")
    } else if port.is_some_and(|p| !port_ok(p)) {
        Some("has a port that is not between 1 and 65535")
    } else if !(path.is_empty() || path.len() <= 9 && path.bytes().all(|b| b.is_ascii_digit())) {
        Some("has a path that is not a database number (write e.g. \"redis://host:6379/0\")")
    } else {
        None
    }
}

/// What is wrong with a URL's percent-encoded user and password, if anything: a `%` must
/// start an escape of two hex digits (a literal `%` is `%25`), and what they decode to must
/// be UTF-8.
fn percent_problem(userinfo: &str) -> Option<&'static str> {
    let bytes = userinfo.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let Some(b) = crate::path::escaped(bytes, i) else {
                return Some(
                    "has a '%' in its user or password that starts no escape (a '%' is written %25)",
                );
            };
            decoded.push(b);
            i += 3;
        } else {
            decoded.push(bytes[i]);
            i += 1;
        }
    }
    if std::str::from_utf8(&decoded).is_err() {
        return Some(
            "has a user or password whose percent-escapes decode to bytes that are not UTF-8",
        );
    }
    None
}

/// A port as written in a URL: ASCII digits (leading zeros allowed) for 1 to 65535.
fn port_ok(p: &str) -> bool {
    // Leading zeros are the same port to the Redis client's URL parser, as to the upstreams'
    // (review: `:037379` was "not between 1 and 65535").
    !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u16>().is_ok_and(|p| p != 0)
}

/// `host:port` -> (`host`, `Some(port)`); `[::1]:6379` keeps the brackets out of the port.
fn split_port(host_port: &str) -> (&str, Option<&str>) {
    if let Some(rest) = host_port.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((host, tail)) => (host, tail.strip_prefix(':')),
            None => ("", None),
        };
    }
    match host_port.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (host_port, None),
    }
}

/// A POSIX-portable environment variable name.
fn is_env_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names_are_letters_digits_and_underscores_not_leading_digits() {
        assert!(is_env_name("SLUICE_HASH_SECRET"));
        assert!(is_env_name("_x1"));
        assert!(!is_env_name("1X"));
        assert!(!is_env_name("A-B"));
        assert!(!is_env_name(""));
    }

    #[test]
    fn ports_split_from_names_and_bracketed_ipv6() {
        assert_eq!(split_port("h:6379"), ("h", Some("6379")));
        assert_eq!(split_port("[::1]:6379"), ("::1", Some("6379")));
        assert_eq!(split_port("[::1]"), ("::1", None));
        assert_eq!(split_port("h"), ("h", None));
    }

    #[test]
    fn only_a_port_may_follow_a_bracketed_ipv6_address() {
        assert_eq!(redis_url_problem("[::1]:6379"), None);
        assert_eq!(redis_url_problem("[::1]"), None);
        assert_eq!(redis_url_problem("[::1]/2"), None);
        for url in [
            "[::1]x",
            "[::1]junk:6379",
            "u:p@[::1]x/0",
            "[::1]x]",
            "[::1]]",
        ] {
            let problem = redis_url_problem(url);
            assert!(
                problem.is_some_and(|p| p.contains("bracketed IPv6")),
                "{url}: {problem:?}"
            );
        }
    }
}
