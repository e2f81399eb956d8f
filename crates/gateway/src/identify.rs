//! The identify step: who is calling. The client IP (the TCP peer, or behind trusted proxies
//! the first untrusted hop of `client_ip_header`, walked right to left) and the
//! API key (from the configured sources, first found wins).

use std::borrow::Cow;
use std::net::IpAddr;

use http::header::{AUTHORIZATION, FORWARDED};
use http::{HeaderMap, HeaderName, Uri};
use sluice_config::{mask_v6, Cidr, ClientIpHeader, Identity, KeySource};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Keys longer than this are refused with 400 rather than silently skipping a limit. Long
/// enough for any bearer token in use (JWTs with many claims run to several KiB); a key is
/// hashed once per limit, so this bounds that work well below the 64 KiB request head.
pub(crate) const MAX_KEY_BYTES: usize = 16 * 1024;

/// The identity rules from `[identity]`.
#[derive(Debug)]
pub(crate) struct Identify {
    trusted: Vec<Cidr>,
    client_ip_header: ClientIpHeader,
    ipv6_prefix: u8,
    key_sources: Vec<Source>,
}

/// A key source as a request is read by it: a header by its name, a query parameter by the
/// name folded as servers read it ([`param_name`]).
#[derive(Debug)]
enum Source {
    Header(Option<HeaderName>),
    Bearer,
    Query(Vec<u8>),
}

impl Identify {
    pub(crate) fn new(identity: &Identity) -> Self {
        let key_sources = identity
            .api_key
            .iter()
            .map(|s| match s {
                KeySource::Header(h) => Source::Header(HeaderName::from_bytes(h.as_bytes()).ok()),
                KeySource::Bearer => Source::Bearer,
                KeySource::Query(name) => Source::Query(param_name(name.as_bytes())),
            })
            .collect();
        Self {
            trusted: identity.trusted_proxies.clone(),
            client_ip_header: identity.client_ip_header,
            ipv6_prefix: identity.ipv6_prefix,
            key_sources,
        }
    }

    /// The headers this identifies callers by: the API key's header sources, `Authorization`
    /// when bearer keys are read, and the client-IP header when some proxy is trusted.
    pub(crate) fn header_names(&self) -> Vec<HeaderName> {
        let mut names: Vec<HeaderName> = Vec::new();
        for source in &self.key_sources {
            let name = match source {
                Source::Header(header) => header.clone(),
                Source::Bearer => Some(AUTHORIZATION),
                Source::Query(_) => None,
            };
            names.extend(name);
        }
        if !self.trusted.is_empty() {
            names.push(match self.client_ip_header {
                ClientIpHeader::Forwarded => FORWARDED,
                ClientIpHeader::XForwardedFor => X_FORWARDED_FOR.clone(),
            });
        }
        names
    }

    pub(crate) fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|c| c.contains(ip))
    }

    /// The client's address. Headers are believed only from a trusted peer (`peer_trusted`,
    /// from [`Identify::is_trusted`], computed once per connection by the caller), and only as far
    /// as the chain of trusted hops goes: an attacker-chosen string never becomes the answer.
    pub(crate) fn client_ip(
        &self,
        peer: IpAddr,
        peer_trusted: bool,
        headers: &HeaderMap,
    ) -> IpAddr {
        let peer = peer.to_canonical();
        if !peer_trusted {
            return peer;
        }
        let name = match self.client_ip_header {
            ClientIpHeader::Forwarded => &FORWARDED,
            ClientIpHeader::XForwardedFor => &X_FORWARDED_FOR,
        };
        // Split as bytes, each element read as text on its own: a client's stray non-ASCII
        // byte, which a proxy passes on in front of what it appends, must cost only its own
        // element, not the proxy's entry to its right.
        let elements: Vec<Option<&str>> = headers
            .get_all(name)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .map(|e| std::str::from_utf8(e).ok())
            .collect();
        let parse = match self.client_ip_header {
            ClientIpHeader::Forwarded => forwarded_for,
            ClientIpHeader::XForwardedFor => parse_hop,
        };
        self.walk(peer, elements.into_iter().map(|e| e.and_then(parse)))
    }

    /// Right to left: skip trusted hops; the first untrusted one is the client. A malformed
    /// entry ends the walk at the last address that was validated.
    fn walk(&self, peer: IpAddr, hops: impl DoubleEndedIterator<Item = Option<IpAddr>>) -> IpAddr {
        let mut last = peer;
        for hop in hops.rev() {
            let Some(ip) = hop else { return last };
            if !self.is_trusted(ip) {
                return ip;
            }
            last = ip;
        }
        last
    }

    /// The address a limit counts: IPv6 reduced to its `ipv6_prefix` network.
    pub(crate) fn ip_bucket(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(_) => ip,
            IpAddr::V6(v6) => IpAddr::V6(mask_v6(u128::from(v6), self.ipv6_prefix).into()),
        }
    }

    /// The caller's API key from the first source that has one; `Ok(None)` when none does.
    /// A source that holds two different keys (two `X-Api-Key` headers, two `Authorization`
    /// headers, a query parameter given twice) is an error, not a choice: servers disagree
    /// about which of them counts (the first, the last, both joined), so a caller could be
    /// counted under one key and served under the other.
    pub(crate) fn api_key<'r>(
        &self,
        headers: &'r HeaderMap,
        uri: &'r Uri,
    ) -> Result<Option<Cow<'r, [u8]>>, KeyError> {
        for source in &self.key_sources {
            let found = match source {
                Source::Header(header) => match header {
                    Some(h) => only(headers.get_all(h).iter().map(|v| trim(v.as_bytes()).into()))?,
                    None => None,
                },
                Source::Bearer => only(
                    headers
                        .get_all(AUTHORIZATION)
                        .iter()
                        .filter_map(|v| bearer(v.as_bytes()))
                        .map(Into::into),
                )?,
                Source::Query(name) => match uri.query() {
                    Some(q) => {
                        let values = query_params(q, name).collect::<Result<Vec<_>, _>>()?;
                        only(values.into_iter().map(Into::into))?
                    }
                    None => None,
                },
            };
            match found {
                Some(k) if k.len() > MAX_KEY_BYTES => return Err(KeyError::TooLong),
                Some(k) if !k.iter().all(|b| matches!(b, 0x21..=0x7e)) => {
                    return Err(KeyError::Unreadable)
                }
                Some(k) => return Ok(Some(k)),
                None => {}
            }
        }
        Ok(None)
    }
}

/// Why a request's API key cannot be used: answered 400.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum KeyError {
    /// Longer than [`MAX_KEY_BYTES`]: refused rather than silently skipping a limit.
    TooLong,
    /// One source holds two different keys.
    Ambiguous,
    /// A byte that is not visible ASCII (a space inside, a byte outside ASCII). Servers trim
    /// and decode such keys differently (Python's `str.strip()` takes a trailing `\xa0` off,
    /// as `trim_ascii` does not), so one key could be counted as many.
    Unreadable,
}

/// The one value of a source: `None` if it has none, or only empty ones; an error if it has
/// two different ones, an empty one beside another included (review: `X-Api-Key:` empty and
/// then a random one was counted under the random one, and served by an upstream reading the
/// first value, empty, under the `Authorization` key it falls back to).
fn only<'r>(
    values: impl Iterator<Item = Cow<'r, [u8]>>,
) -> Result<Option<Cow<'r, [u8]>>, KeyError> {
    let mut found: Option<Cow<'r, [u8]>> = None;
    for v in values {
        match &found {
            None => found = Some(v),
            Some(f) if *f == v => {}
            Some(_) => return Err(KeyError::Ambiguous),
        }
    }
    Ok(found.filter(|v| !v.is_empty()))
}

fn trim(b: &[u8]) -> &[u8] {
    b.trim_ascii()
}

/// The token of `Bearer <token>`. RFC 9110 puts one space after the scheme; a tab (or
/// several blanks) is taken too, since servers that split the value on whitespace accept it
/// and a caller must not step outside its key's limits by spelling the separator otherwise.
fn bearer(v: &[u8]) -> Option<&[u8]> {
    let v = trim(v);
    let (scheme, rest) = v.split_at_checked(6)?;
    (scheme.eq_ignore_ascii_case(b"bearer") && matches!(rest.first(), Some(b' ' | b'\t')))
        .then(|| trim(rest))
}

/// Every value of the parameter named `name` (folded: [`param_name`]) in a query string,
/// percent-decoded, under any name servers read as `name`: parameters are split at `;` as well as `&` (Rack 2, Python before 3.9.2 and Go
/// before 1.17 did), and names are compared in any case (ASP.NET Core) with `.`, `[`, spaces
/// and `+` taken for `_` (PHP). A value that begins or ends with `+` is refused: form-decoding
/// servers read a space there, which a server that trims takes off, so `K+` would be counted
/// apart from `K` and served as it (review).
fn query_params<'q>(
    query: &'q str,
    name: &'q [u8],
) -> impl Iterator<Item = Result<Vec<u8>, KeyError>> + 'q {
    query.split(['&', ';']).filter_map(move |pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (param_name(k.as_bytes()) == name).then(|| match v.starts_with('+') || v.ends_with('+') {
            true => Err(KeyError::Unreadable),
            false => Ok(percent_decode(v.as_bytes())),
        })
    })
}

/// A query parameter's name as the most lenient servers read it: decoded (`+` as a space),
/// leading spaces dropped and cut at a NUL (PHP), in lower case, with `.`, `[` and spaces as
/// `_`. (Review: `api_key%00x=K` was no key to the gateway and `api_key=K` to PHP.)
pub(crate) fn param_name(raw: &[u8]) -> Vec<u8> {
    percent_decode(raw)
        .iter()
        .take_while(|&&b| b != 0)
        .skip_while(|b| matches!(b, b' ' | b'+'))
        .map(|b| match b.to_ascii_lowercase() {
            b'.' | b'[' | b' ' | b'+' => b'_',
            other => other,
        })
        .collect()
}

/// `%XX` escapes decoded; `+` stays `+`. Servers that form-decode read it as a space, others
/// as `+`: a key taken as `+` is counted under one name whichever they do (its spelling with
/// `%20` has a space, and is refused), and a base64 key pasted unescaped still counts.
fn percent_decode(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            s[i],
            s.get(i + 1).copied().and_then(hex),
            s.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// One `X-Forwarded-For` entry: an address, optionally `v4:port` or `[v6]:port`.
fn parse_hop(s: &str) -> Option<IpAddr> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (addr, port) = rest.split_once(']')?;
        if !(port.is_empty() || port.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        return addr
            .parse::<std::net::Ipv6Addr>()
            .ok()
            .map(|a| IpAddr::V6(a).to_canonical());
    }
    let (addr, port) = s.rsplit_once(':')?;
    if !is_port(port) {
        return None;
    }
    addr.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

fn is_port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

/// The `for=` of one `Forwarded` element (RFC 7239), quoted or not. `unknown`, obfuscated
/// identifiers and a missing `for=` are malformed for our purpose: they stop the walk.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    element.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("for") {
            return None;
        }
        let v = v.trim();
        let v = v
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(v);
        parse_hop(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identify(trusted: &[&str]) -> Identify {
        identify_by(trusted, ClientIpHeader::XForwardedFor)
    }

    fn identify_by(trusted: &[&str], client_ip_header: ClientIpHeader) -> Identify {
        Identify::new(&Identity {
            api_key: vec![
                KeySource::Header("x-api-key".into()),
                KeySource::Bearer,
                KeySource::Query("api_key".into()),
            ],
            trusted_proxies: trusted.iter().map(|c| c.parse().unwrap()).collect(),
            client_ip_header,
            ipv6_prefix: 64,
        })
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn client(id: &Identify, peer: IpAddr, h: &HeaderMap) -> IpAddr {
        id.client_ip(peer, id.is_trusted(peer), h)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn spoofed_forwarded_for_from_untrusted_peer_is_ignored() {
        let id = identify(&["10.0.0.0/8"]);
        let h = headers(&[("x-forwarded-for", "1.2.3.4")]);
        assert_eq!(client(&id, ip("192.0.2.9"), &h), ip("192.0.2.9"));
    }

    #[test]
    fn walk_skips_trusted_hops_from_the_right() {
        let id = identify(&["10.0.0.0/8", "127.0.0.1"]);
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 203.0.113.5, 10.1.1.1")]);
        assert_eq!(
            client(&id, ip("127.0.0.1"), &h),
            ip("203.0.113.5"),
            "the spoofed leftmost entry is never reached"
        );
        let h = headers(&[
            ("x-forwarded-for", "6.6.6.6"),
            ("x-forwarded-for", "10.2.2.2"),
        ]);
        assert_eq!(
            client(&id, ip("10.0.0.1"), &h),
            ip("6.6.6.6"),
            "header lines are one list"
        );
    }

    #[test]
    fn malformed_entry_stops_at_the_last_validated_address() {
        let id = identify(&["10.0.0.0/8"]);
        let h = headers(&[("x-forwarded-for", "203.0.113.5, garbage, 10.1.1.1")]);
        assert_eq!(client(&id, ip("10.0.0.1"), &h), ip("10.1.1.1"));
        let h = headers(&[("x-forwarded-for", "not-an-ip")]);
        assert_eq!(client(&id, ip("10.0.0.1"), &h), ip("10.0.0.1"));
    }

    #[test]
    fn forwarded_header_with_quoted_ipv6_and_ports() {
        let id = identify_by(&["10.0.0.0/8"], ClientIpHeader::Forwarded);
        let h = headers(&[(
            "forwarded",
            r#"for=192.0.2.60;proto=http, for="[2001:db8:cafe::17]:4711";by=10.0.0.2"#,
        )]);
        assert_eq!(client(&id, ip("10.0.0.1"), &h), ip("2001:db8:cafe::17"));
        let h = headers(&[("forwarded", r#"for="198.51.100.3:8080""#)]);
        assert_eq!(client(&id, ip("10.0.0.1"), &h), ip("198.51.100.3"));
        let h = headers(&[("forwarded", "for=unknown, for=10.3.3.3")]);
        assert_eq!(
            client(&id, ip("10.0.0.1"), &h),
            ip("10.3.3.3"),
            "unknown stops the walk"
        );
    }

    /// A proxy passes on the header it does not write as the client sent it: only the
    /// configured one is read, or a client behind an `X-Forwarded-For` proxy could choose its
    /// address with `Forwarded`, and the other way round.
    #[test]
    fn only_the_configured_header_is_believed() {
        let both = headers(&[
            ("forwarded", "for=6.6.6.6"),
            ("x-forwarded-for", "203.0.113.5"),
        ]);
        let xff = identify_by(&["10.0.0.0/8"], ClientIpHeader::XForwardedFor);
        assert_eq!(client(&xff, ip("10.0.0.1"), &both), ip("203.0.113.5"));
        let fwd = identify_by(&["10.0.0.0/8"], ClientIpHeader::Forwarded);
        assert_eq!(client(&fwd, ip("10.0.0.1"), &both), ip("6.6.6.6"));
        let only_fwd = headers(&[("forwarded", "for=6.6.6.6")]);
        assert_eq!(client(&xff, ip("10.0.0.1"), &only_fwd), ip("10.0.0.1"));
    }

    #[test]
    fn a_non_ascii_byte_costs_only_its_own_element() {
        let id = identify(&["10.0.0.0/8"]);
        let xff = |raw: &[u8]| {
            let mut h = HeaderMap::new();
            h.append(
                X_FORWARDED_FOR.clone(),
                http::HeaderValue::from_bytes(raw).unwrap(),
            );
            h
        };
        let h = xff(b"\xff, 203.0.113.7");
        assert_eq!(client(&id, ip("10.0.0.1"), &h), ip("203.0.113.7"));
        let h = xff(b"203.0.113.7, \xff");
        assert_eq!(
            client(&id, ip("10.0.0.1"), &h),
            ip("10.0.0.1"),
            "malformed: stop"
        );
    }

    #[test]
    fn ipv4_mapped_peers_are_normalised_and_ipv6_is_bucketed_per_prefix() {
        let id = identify(&[]);
        assert_eq!(
            client(&id, ip("::ffff:192.0.2.1"), &HeaderMap::new()),
            ip("192.0.2.1")
        );
        assert_eq!(
            id.ip_bucket(ip("2001:db8:1:2:aaaa::1")),
            id.ip_bucket(ip("2001:db8:1:2:bbbb::9"))
        );
        assert_ne!(
            id.ip_bucket(ip("2001:db8:1:2::1")),
            id.ip_bucket(ip("2001:db8:1:3::1"))
        );
    }

    #[test]
    fn a_bearer_token_is_read_whatever_blanks_follow_the_scheme() {
        let id = identify(&[]);
        let uri: Uri = "/x".parse().unwrap();
        for value in [
            "Bearer tok",
            "bearer\ttok",
            "BEARER  \t tok ",
            " Bearer tok",
        ] {
            let h = headers(&[("authorization", value)]);
            let key = id.api_key(&h, &uri).unwrap();
            assert_eq!(key.as_deref(), Some(&b"tok"[..]), "{value:?}");
        }
        for value in ["Bearertok", "Basic dG9r", "Bearer", "Bearer \t "] {
            let h = headers(&[("authorization", value)]);
            assert_eq!(id.api_key(&h, &uri).unwrap(), None, "{value:?}");
        }
    }

    #[test]
    fn api_key_sources_in_order_first_found_wins() {
        let id = identify(&[]);
        let uri: Uri = "/x?api_key=q%2Dkey".parse().unwrap();
        let h = headers(&[("authorization", "Bearer tok-1")]);
        assert_eq!(
            id.api_key(&h, &uri).unwrap().as_deref(),
            Some(&b"tok-1"[..])
        );
        let h = headers(&[("authorization", "Bearer tok-1"), ("x-api-key", " hdr ")]);
        assert_eq!(id.api_key(&h, &uri).unwrap().as_deref(), Some(&b"hdr"[..]));
        assert_eq!(
            id.api_key(&HeaderMap::new(), &uri).unwrap().as_deref(),
            Some(&b"q-key"[..])
        );
        assert_eq!(
            id.api_key(
                &headers(&[("authorization", "Basic eA==")]),
                &"/".parse().unwrap()
            )
            .unwrap(),
            None
        );
    }

    /// Servers trim and decode keys with spaces inside or bytes outside ASCII differently
    /// (Python's `str.strip()` takes a trailing `\xa0` off): one key must not be counted as
    /// many, so such a key is refused, from every source.
    #[test]
    fn keys_with_bytes_outside_visible_ascii_are_refused() {
        let id = identify(&[]);
        let root: Uri = "/".parse().unwrap();
        for key in [
            &b"k1\xa0"[..],
            b"\xa0k1",
            b"k1\x85",
            b"k 1",
            b"k\t1",
            b"caf\xc3\xa9",
        ] {
            let h = {
                let mut h = HeaderMap::new();
                h.append("x-api-key", http::HeaderValue::from_bytes(key).unwrap());
                h
            };
            assert_eq!(id.api_key(&h, &root), Err(KeyError::Unreadable), "{key:?}");
        }
        let h = headers(&[("authorization", "Bearer tok en")]);
        assert_eq!(id.api_key(&h, &root), Err(KeyError::Unreadable));
        // A base64 key pasted unescaped keeps its `+`.
        let uri: Uri = "/x?api_key=abc+def=".parse().unwrap();
        let none = HeaderMap::new();
        assert_eq!(
            id.api_key(&none, &uri).unwrap().as_deref(),
            Some(&b"abc+def="[..])
        );
        // But a `+` at either end is a space to a form-decoding server, which trimming takes
        // off, as it takes off an escaped one.
        for query in [
            "/x?api_key=k+",
            "/x?api_key=+k",
            "/x?api_key=k++",
            "/x?api_key=k%20",
            "/x?api_key=k%A0",
            "/x?api_key=%00k",
        ] {
            let uri: Uri = query.parse().unwrap();
            let none = HeaderMap::new();
            assert_eq!(
                id.api_key(&none, &uri),
                Err(KeyError::Unreadable),
                "{query}"
            );
        }
        // Every visible ASCII character is fine, and blanks around the key are trimmed.
        let visible: String = (0x21u8..=0x7e).map(char::from).collect();
        let h = headers(&[("x-api-key", &format!(" {visible}\t"))]);
        assert_eq!(
            id.api_key(&h, &root).unwrap().as_deref(),
            Some(visible.as_bytes())
        );
    }

    #[test]
    fn keys_over_16_kib_are_refused_not_skipped() {
        let id = identify(&[]);
        let long = "k".repeat(16 * 1024 + 1);
        let h = headers(&[("x-api-key", &long)]);
        assert_eq!(
            id.api_key(&h, &"/".parse().unwrap()),
            Err(KeyError::TooLong)
        );
        let h = headers(&[("x-api-key", &long[..16 * 1024])]);
        assert!(id.api_key(&h, &"/".parse().unwrap()).unwrap().is_some());
        // A bearer token of the size JWTs come in is a key like any other.
        let jwt = format!("Bearer eyJ{}", "a".repeat(1500));
        let h = headers(&[("authorization", &jwt)]);
        assert!(id.api_key(&h, &"/".parse().unwrap()).unwrap().is_some());
    }

    #[test]
    fn a_source_holding_two_different_keys_is_refused_not_resolved() {
        let id = identify(&[]);
        let root: Uri = "/".parse().unwrap();
        let two = headers(&[("x-api-key", "k1"), ("x-api-key", "k2")]);
        assert_eq!(id.api_key(&two, &root), Err(KeyError::Ambiguous));
        let two = headers(&[("authorization", "Bearer a"), ("authorization", "Bearer b")]);
        assert_eq!(id.api_key(&two, &root), Err(KeyError::Ambiguous));
        let uri: Uri = "/x?api_key=a&b=1&api%5Fkey=b".parse().unwrap();
        assert_eq!(
            id.api_key(&HeaderMap::new(), &uri),
            Err(KeyError::Ambiguous)
        );
        // The same key repeated is one key.
        let same = headers(&[("x-api-key", "k1"), ("x-api-key", " k1 ")]);
        assert_eq!(
            id.api_key(&same, &root).unwrap().as_deref(),
            Some(&b"k1"[..])
        );
        // An empty value beside a key is another value: an upstream reading the first one
        // sees no key there, and falls back to its next source (review).
        let beside = headers(&[
            ("x-api-key", ""),
            ("x-api-key", "random"),
            ("authorization", "Bearer spent"),
        ]);
        assert_eq!(id.api_key(&beside, &root), Err(KeyError::Ambiguous));
        for query in ["/x?api_key=&api_key=k", "/x?api_key&api_key=k"] {
            let uri: Uri = query.parse().unwrap();
            let none = HeaderMap::new();
            assert_eq!(id.api_key(&none, &uri), Err(KeyError::Ambiguous), "{query}");
        }
        // Empty values alone are no key: the next source is read, as the upstream would.
        let empty = headers(&[
            ("x-api-key", ""),
            ("x-api-key", " "),
            ("authorization", "Bearer k"),
        ]);
        assert_eq!(
            id.api_key(&empty, &root).unwrap().as_deref(),
            Some(&b"k"[..])
        );
        // Different keys in different sources are the configured order's business: an app's
        // key beside a user's bearer token is a common pattern, and the first source wins.
        let both = headers(&[("x-api-key", "app"), ("authorization", "Bearer user")]);
        assert_eq!(
            id.api_key(&both, &root).unwrap().as_deref(),
            Some(&b"app"[..])
        );
    }

    /// Review: servers read a query parameter under names that are not the configured one,
    /// byte for byte (PHP turns `.`, `[` and spaces into `_`, ASP.NET Core ignores case, older
    /// servers split at `;`): each of those was no key to the gateway and the key to the
    /// upstream.
    #[test]
    fn a_query_key_is_found_under_every_name_servers_read_as_its_own() {
        let id = identify(&[]);
        let none = HeaderMap::new();
        for query in [
            "/x?api.key=K",
            "/x?api+key=K",
            "/x?api%20key=K",
            "/x?api[key=K",
            "/x?API_KEY=K",
            "/x?Api.Key=K",
            "/x?a=1;api_key=K",
            "/x?api_key=K;a=1",
            "/x?+api_key=K",
            "/x?%20api_key=K",
            "/x?++api.key=K",
            // PHP cuts a name at a NUL (review).
            "/x?api_key%00x=K",
            "/x?api_key%00=K",
        ] {
            let uri: Uri = query.parse().unwrap();
            assert_eq!(
                id.api_key(&none, &uri).unwrap().as_deref(),
                Some(&b"K"[..]),
                "{query}"
            );
        }
        // Two spellings with different keys: which one counts is the server's choice.
        let uri: Uri = "/x?api_key=RANDOM&api.key=K".parse().unwrap();
        assert_eq!(id.api_key(&none, &uri), Err(KeyError::Ambiguous));
        let uri: Uri = "/x?api_key=fresh&api_key%00=K".parse().unwrap();
        assert_eq!(id.api_key(&none, &uri), Err(KeyError::Ambiguous));
        // Other names are other parameters.
        for query in ["/x?apikey=K", "/x?api_keys=K", "/x?xapi_key=K"] {
            let uri: Uri = query.parse().unwrap();
            assert_eq!(id.api_key(&none, &uri), Ok(None), "{query}");
        }
    }
}
