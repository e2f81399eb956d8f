//! `[gateway]`, `[admin]`, `[identity]`, `[responses]` and `[upstreams.*]`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroUsize;
use std::ops::Range;
use std::time::Duration;

use super::Validator;
use crate::cidr::cover_a_family;
use crate::model::{
    Admin, ClientIpHeader, Gateway, Identity, KeySource, MinBodyRate, Responses, RetryRange,
    Upstream,
};
use crate::raw::{RawAdmin, RawGateway, RawIdentity, RawResponses, RawUpstream, Table, S};
use crate::Cidr;

const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9901";
/// Idle connections each serving thread keeps per upstream unless `idle_connections` says.
const DEFAULT_IDLE_CONNECTIONS: u16 = 256;

/// The most places `identity.api_key` may name.
const MAX_KEY_SOURCES: usize = 16;

impl Validator<'_> {
    fn socket_addr(&mut self, v: &Option<S<String>>, key: &str, default: &str) -> SocketAddr {
        let fallback = default.parse().expect("default listen addresses parse");
        let Some(v) = v else { return fallback };
        v.get_ref().parse().unwrap_or_else(|_| {
            let msg = format!("\"{}\" is not an address and port (write e.g. \"127.0.0.1:8080\" or \"[::1]:8080\")", v.get_ref());
            self.err(Some(v.span()), key, msg);
            fallback
        })
    }

    pub(super) fn gateway(&mut self, raw: &RawGateway) -> Gateway {
        let listen = self.socket_addr(&raw.listen, "gateway.listen", DEFAULT_LISTEN);
        let max_in_flight = self.count(&raw.max_in_flight, "gateway.max_in_flight", 256);
        let max_held = self.count(&raw.max_held, "gateway.max_held", 1024);
        let max_connections = raw.max_connections.as_ref().and_then(|v| {
            self.positive_u32(v, "gateway.max_connections")
                .and_then(|n| NonZeroUsize::new(n.get() as usize))
        });
        let max_connections_per_ip = raw.max_connections_per_ip.as_ref().and_then(|v| {
            let n = self
                .positive_u32(v, "gateway.max_connections_per_ip")
                .and_then(|n| NonZeroUsize::new(n.get() as usize))?;
            if let Some(max) = max_connections.filter(|max| n >= *max) {
                self.err(Some(v.span()), "gateway.max_connections_per_ip", format!("{n} is not below max_connections ({max}): one client could still take every place"));
                return None;
            }
            Some(n)
        });
        let merge_slashes = raw.merge_slashes.unwrap_or(true);
        let health_path = raw.health_path.as_ref().map(|p| {
            self.path(p, "gateway.health_path", merge_slashes);
            p.get_ref().clone()
        });
        let header_timeout = self.duration(
            &raw.header_timeout,
            "gateway.header_timeout",
            Duration::from_secs(10),
        );
        let send_timeout = self.duration(
            &raw.send_timeout,
            "gateway.send_timeout",
            Duration::from_secs(60),
        );
        let max_body_size = raw
            .max_body_size
            .as_ref()
            .and_then(|v| match crate::size::parse_size(v.get_ref()) {
                Ok(0) => {
                    let msg = format!("\"{}\" must be larger than zero", v.get_ref());
                    self.err(Some(v.span()), "gateway.max_body_size", msg);
                    None
                }
                Ok(n) => Some(n),
                Err(msg) => {
                    self.err(Some(v.span()), "gateway.max_body_size", msg);
                    None
                }
            });
        let shutdown_grace = self.duration(
            &raw.shutdown_grace,
            "gateway.shutdown_grace",
            Duration::from_secs(30),
        );
        let drain_delay = match &raw.drain_delay {
            None => Duration::ZERO,
            Some(v) => self
                .duration_or_zero(v, "gateway.drain_delay")
                .unwrap_or_default(),
        };
        let overload_retry_after = self.retry_range(raw);
        let min_body_rate = self.min_body_rate(raw);
        Gateway {
            listen,
            max_in_flight,
            max_held,
            max_connections,
            max_connections_per_ip,
            health_path,
            header_timeout,
            send_timeout,
            max_body_size,
            shutdown_grace,
            drain_delay,
            overload_retry_after,
            merge_slashes,
            count_unrouted: raw.count_unrouted.unwrap_or(true),
            min_body_rate,
        }
    }

    /// A count (1 to 4294967295), `default` when left out (and after an error, reported).
    fn count(&mut self, v: &Option<S<i64>>, key: &str, default: usize) -> NonZeroUsize {
        let n = match v {
            None => Some(default),
            Some(v) => self.positive_u32(v, key).map(|n| n.get() as usize),
        };
        n.and_then(NonZeroUsize::new).unwrap_or(NonZeroUsize::MIN)
    }

    fn min_body_rate(&mut self, raw: &RawGateway) -> Option<MinBodyRate> {
        let grace = self.duration(
            &raw.min_body_rate_grace,
            "gateway.min_body_rate_grace",
            Duration::from_secs(5),
        );
        let bytes_per_second = match &raw.min_body_rate {
            None => 240,
            Some(v) => match crate::size::parse_size(v.get_ref()) {
                Ok(n) => n,
                Err(msg) => {
                    self.err(Some(v.span()), "gateway.min_body_rate", msg);
                    240
                }
            },
        };
        if let (0, Some(g)) = (bytes_per_second, &raw.min_body_rate_grace) {
            let msg = format!(
                "\"{}\" is not used: min_body_rate is off (0B), so no body is asked a rate",
                g.get_ref()
            );
            self.err(Some(g.span()), "gateway.min_body_rate_grace", msg);
        }
        (bytes_per_second > 0).then_some(MinBodyRate {
            bytes_per_second,
            grace,
        })
    }

    fn retry_range(&mut self, raw: &RawGateway) -> RetryRange {
        let default = RetryRange {
            min: Duration::from_secs(2),
            max: Duration::from_secs(5),
        };
        let Some(r) = &raw.overload_retry_after else {
            return default;
        };
        let key = "gateway.overload_retry_after";
        let why = "Retry-After is sent in seconds";
        let min = self.required_whole_seconds(&r.min, &format!("{key}.min"), why);
        let max = self.required_whole_seconds(&r.max, &format!("{key}.max"), why);
        let (Some(min), Some(max)) = (min, max) else {
            return default;
        };
        if min > max {
            // At `min` (the range is no spanned value of its own: toml gives a table written
            // with dotted keys, `overload_retry_after.min = "2s"`, no span).
            self.err(
                Some(r.min.span()),
                key,
                format!(
                    "min \"{}\" is longer than max \"{}\"",
                    r.min.get_ref(),
                    r.max.get_ref()
                ),
            );
        }
        RetryRange { min, max }
    }

    /// A path a request is compared with: it must be in the normal form requests are
    /// brought to first (see [`crate::path`]), or no request could ever match it.
    pub(super) fn path(&mut self, p: &S<String>, key: &str, merge_slashes: bool) {
        let v = p.get_ref();
        if !v.starts_with('/')
            || v.contains(['?', '#'])
            || v.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            self.err(Some(p.span()), key, format!("\"{v}\" is not a path (it must start with \"/\" and hold no query, fragment or spaces)"));
            return;
        }
        let normal = crate::path::normalize(v, merge_slashes)
            .map(|n| crate::path::route_key(&n, merge_slashes).into_owned());
        match normal {
            Ok(n) if n == *v => {}
            Ok(n) => self.err(Some(p.span()), key, format!("\"{v}\" is not in normal form, and requests are matched after they are brought to it (write \"{n}\")")),
            Err(_) => self.err(Some(p.span()), key, format!("\"{v}\" has a \"%\" not followed by two hexadecimal digits")),
        }
    }

    /// `gateway_span`: where `gateway.listen` is written, to point at when `admin.listen` is not.
    pub(super) fn admin(
        &mut self,
        raw: &RawAdmin,
        gateway: &Gateway,
        gateway_span: Option<Range<usize>>,
    ) -> Admin {
        let listen = self.socket_addr(&raw.listen, "admin.listen", DEFAULT_ADMIN_LISTEN);
        if overlap(listen, gateway.listen) {
            let (span, key) = match &raw.listen {
                Some(l) => (Some(l.span()), "admin.listen"),
                None => (gateway_span, "gateway.listen"),
            };
            let what = if listen == gateway.listen {
                "is also"
            } else {
                "shares its port with"
            };
            self.err(span, key, format!("admin.listen \"{listen}\" {what} gateway.listen \"{}\": the two could not both be bound (the admin endpoints need their own port, or another address that is not a wildcard's)", gateway.listen));
        }
        Admin { listen }
    }

    pub(super) fn identity(&mut self, raw: &RawIdentity) -> Identity {
        let api_key = match &raw.api_key {
            None => vec![KeySource::Header("x-api-key".into()), KeySource::Bearer],
            Some(list) if list.get_ref().is_empty() => {
                self.err(Some(list.span()), "identity.api_key", "an empty list finds no key, so every limit by \"api_key\" would count nobody; leave the key out for the default [\"header:x-api-key\", \"bearer\"]");
                Vec::new()
            }
            Some(list) if list.get_ref().len() > MAX_KEY_SOURCES => {
                let msg = format!(
                    "{} sources: at most {MAX_KEY_SOURCES} (each is looked for on every request)",
                    list.get_ref().len()
                );
                self.err(Some(list.span()), "identity.api_key", msg);
                Vec::new()
            }
            Some(list) => {
                let mut sources: Vec<KeySource> = Vec::new();
                for (i, s) in list.get_ref().iter().enumerate() {
                    let key = format!("identity.api_key[{i}]");
                    match self.key_source(s, &key) {
                        Some(k) if sources.contains(&k) => {
                            let msg = format!("\"{}\" is listed twice", s.get_ref());
                            self.err(Some(s.span()), &key, msg);
                        }
                        Some(k) => sources.push(k),
                        None => {}
                    }
                }
                sources
            }
        };
        let mut trusted_proxies = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (i, s) in raw.trusted_proxies.iter().flatten().enumerate() {
            let key = format!("identity.trusted_proxies[{i}]");
            let written = s.get_ref();
            match written.parse::<Cidr>() {
                Err(msg) => self.err(Some(s.span()), &key, msg),
                // Named as written, and as read where that differs (`::ffff:0:0/96` is every
                // IPv4 address).
                Ok(c) if c.is_everything() && raw.allow_trust_all != Some(true) => {
                    let read = c.to_string();
                    let as_read = if read == *written {
                        String::new()
                    } else {
                        format!(" (as {read})")
                    };
                    self.err(
                        Some(s.span()),
                        &key,
                        format!("\"{written}\"{as_read} trusts every peer, which lets any caller choose its own client IP; set identity.allow_trust_all = true if that is really meant"),
                    );
                }
                Ok(c) if !seen.insert(c) => {
                    let msg = format!("\"{written}\" is listed twice (as {c})");
                    self.err(Some(s.span()), &key, msg);
                }
                Ok(c) => trusted_proxies.push(c),
            }
        }
        let whole = trusted_proxies.iter().any(Cidr::is_everything);
        if !whole && raw.allow_trust_all != Some(true) && cover_a_family(&trusted_proxies) {
            let last = raw.trusted_proxies.iter().flatten().last().map(S::span);
            let networks: Vec<String> =
                trusted_proxies.iter().map(|c| format!("\"{c}\"")).collect();
            let msg = format!("{} together hold every address of IPv4 or of IPv6: that trusts every peer of that family, which lets any caller choose its own client IP; set identity.allow_trust_all = true if that is really meant", networks.join(", "));
            self.err(last, "identity.trusted_proxies", msg);
        }
        let ipv6_prefix = match &raw.ipv6_prefix {
            None => 64,
            Some(v) => match u8::try_from(*v.get_ref())
                .ok()
                .filter(|p| (1..=128).contains(p))
            {
                Some(p) => p,
                None => {
                    self.err(
                        Some(v.span()),
                        "identity.ipv6_prefix",
                        format!("{} is not a prefix length between 1 and 128", v.get_ref()),
                    );
                    64
                }
            },
        };
        let client_ip_header = match raw.client_ip_header.as_ref() {
            None => ClientIpHeader::XForwardedFor,
            Some(v) => match v.get_ref().to_ascii_lowercase().as_str() {
                "x-forwarded-for" => ClientIpHeader::XForwardedFor,
                "forwarded" => ClientIpHeader::Forwarded,
                _ => {
                    self.err(
                        Some(v.span()),
                        "identity.client_ip_header",
                        format!(
                            "\"{}\" is not \"x-forwarded-for\" or \"forwarded\"",
                            v.get_ref()
                        ),
                    );
                    ClientIpHeader::XForwardedFor
                }
            },
        };
        Identity {
            api_key,
            trusted_proxies,
            client_ip_header,
            ipv6_prefix,
        }
    }

    fn key_source(&mut self, s: &S<String>, key: &str) -> Option<KeySource> {
        let v = s.get_ref();
        let parsed = match v.split_once(':') {
            None if v == "bearer" => Some(KeySource::Bearer),
            Some(("header", name)) if is_header_name(name) => {
                Some(KeySource::Header(name.to_ascii_lowercase()))
            }
            Some(("query", name)) if !name.is_empty() && !name.contains(['&', '=', '#']) => {
                Some(KeySource::Query(name.to_owned()))
            }
            _ => None,
        };
        if parsed.is_none() {
            self.err(Some(s.span()), key, format!("\"{v}\" is not a key source (write \"header:<name>\", \"bearer\" or \"query:<name>\")"));
        }
        parsed
    }

    pub(super) fn responses(&mut self, raw: &RawResponses) -> Responses {
        let problem_base = match &raw.problem_base {
            None => "urn:sluice:problem:".to_owned(),
            Some(v) => {
                let s = v.get_ref();
                // RFC 3986: a scheme from a letter, then only URI characters, each `%` an
                // escape (found by review: `-:x`, `1http://x/`, `<x>` and `%zz` were taken).
                let scheme_ok = s.split_once(':').is_some_and(|(scheme, _)| {
                    scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                        && scheme
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
                });
                let uri_char =
                    |c: char| c.is_ascii_alphanumeric() || "-._~:/?#[]@!$&'()*+,;=%".contains(c);
                let escapes_ok = s
                    .bytes()
                    .enumerate()
                    .all(|(i, b)| b != b'%' || crate::path::escaped(s.as_bytes(), i).is_some());
                if !scheme_ok || !s.chars().all(uri_char) || !escapes_ok {
                    self.err(Some(v.span()), "responses.problem_base", format!("\"{s}\" is not an absolute URI (write e.g. \"https://api.example.com/problems/\")"));
                }
                s.clone()
            }
        };
        Responses {
            problem_base,
            legacy_headers: raw.legacy_headers.unwrap_or(false),
        }
    }

    pub(super) fn upstreams(
        &mut self,
        raw: &BTreeMap<S<String>, Table<RawUpstream>>,
    ) -> Vec<Upstream> {
        let mut out = Vec::with_capacity(raw.len());
        for (name, u) in raw {
            let key = format!("upstreams.{}", name.get_ref());
            // Its other keys are checked even when the name is refused: every problem at once.
            let usable = super::usable_name(name.get_ref());
            if !usable {
                self.err(
                    Some(name.span()),
                    &key,
                    super::unusable_name(name.get_ref()),
                );
            }
            // An override is checked instead of the file's URL, which it replaces: a template's
            // placeholder there (`http://app:PORT`) does not stop it.
            let url = match self.url_overrides.iter().find(|(n, _)| n == name.get_ref()) {
                Some((n, url)) => {
                    // Its password hidden in the key as in the message (review: the key
                    // quoted it whole).
                    let key = format!("--upstream {n}={}", crate::host::redact_url(url));
                    self.upstream_url(url, None, &key)
                }
                None => {
                    self.upstream_url(u.url.get_ref(), Some(u.url.span()), &format!("{key}.url"))
                }
            };
            let connect_timeout = self.duration(
                &u.connect_timeout,
                &format!("{key}.connect_timeout"),
                Duration::from_secs(2),
            );
            let timeout = self.duration(
                &u.timeout,
                &format!("{key}.timeout"),
                Duration::from_secs(30),
            );
            let tunnel_idle_timeout = self.duration(
                &u.tunnel_idle_timeout,
                &format!("{key}.tunnel_idle_timeout"),
                Duration::from_secs(60),
            );
            let idle_connections = u
                .idle_connections
                .as_ref()
                .map_or(Some(DEFAULT_IDLE_CONNECTIONS), |v| {
                    self.integer::<u16>(v, &format!("{key}.idle_connections"), 0, 65_535)
                });
            let Some(url) = url.filter(|_| usable) else {
                self.refused_upstreams.push(name.get_ref().clone());
                continue;
            };
            out.push(Upstream {
                name: name.get_ref().clone(),
                url,
                connect_timeout,
                timeout,
                idle_connections: idle_connections.unwrap_or(DEFAULT_IDLE_CONNECTIONS),
                tunnel_idle_timeout,
            });
        }
        out
    }

    /// An upstream's URL `s`, from the file (at `span`) or from `--upstream` (no span).
    fn upstream_url(
        &mut self,
        s: &str,
        span: Option<Range<usize>>,
        key: &str,
    ) -> Option<http::Uri> {
        let uri: Option<http::Uri> = s.parse().ok();
        let authority = uri.as_ref().and_then(|u| u.authority());
        let userinfo = authority.is_some_and(|a| a.as_str().contains('@'));
        let port = authority.and_then(|a| {
            let (_, port) = a.as_str().rsplit_once(':')?;
            // An IPv6 address without a port ends in `]`, not in digits.
            (!port.ends_with(']')).then_some(port)
        });
        let problem = match &uri {
            None => "is not a URL (write e.g. \"http://127.0.0.1:3000\")",
            Some(u) if u.scheme().is_none() => "has no scheme (write e.g. \"http://127.0.0.1:3000\")",
            Some(u) if u.scheme_str() == Some("https") => "is not supported: upstreams are reached over plain http:// (TLS to upstreams is not built yet)",
            Some(u) if u.scheme_str() != Some("http") => "is not supported: upstreams are reached over plain http://",
            Some(u) if u.host().is_none_or(str::is_empty) => "has no host",
            Some(u) if !u.host().is_some_and(crate::host::host_ok) => "has a host that is neither a name (letters, digits, '-', '_' and '.'), a dotted IPv4 address nor a bracketed IPv6 one",
            Some(_) if userinfo => "has a user or password: an upstream URL is scheme, host and port only",
            Some(_) if port == Some("") => "has an empty port (leave out the \":\" for port 80)",
            Some(_) if port.is_some_and(|p| !p.bytes().all(|b| b.is_ascii_digit())) => {
                "has a port that is not a number"
            }
            Some(_) if port.is_some_and(|p| !matches!(p.parse::<u16>(), Ok(1..))) => {
                "has a port outside 1 to 65535"
            }
            Some(_) if s.contains('#') => "has a fragment; an upstream URL is scheme, host and port only",
            Some(u) if !matches!(u.path(), "" | "/") || u.query().is_some() => "has a path or query; an upstream URL is scheme, host and port only",
            Some(_) => return uri,
        };
        // The whole URL's password is hidden before quoting: the message's own guard finds
        // passwords word by word, and one holding a blank or a quote spans several words.
        let shown = crate::host::redact_url(s);
        self.err(span, key, format!("\"{shown}\" {problem}"));
        None
    }
}

/// Whether sockets bound to `a` and `b` would clash: the same port (not 0, which picks a free
/// one) and the same address, or a wildcard that covers the other (`0.0.0.0` covers IPv4,
/// `[::]` both families, as Linux binds it by default). IPv4-mapped IPv6 addresses are IPv4.
fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() || a.port() == 0 {
        return false;
    }
    let (x, y) = (a.ip().to_canonical(), b.ip().to_canonical());
    let covers = |w: IpAddr, o: IpAddr| w.is_unspecified() && (w.is_ipv6() || o.is_ipv4());
    x == y || covers(x, y) || covers(y, x)
}

/// An HTTP field name: a non-empty RFC 9110 token.
pub(crate) fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}
