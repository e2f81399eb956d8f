//! Request paths in normal form.
//!
//! A limit on a route is only as good as the gateway's agreement with the upstream about which
//! resource a path names. `/v1/login`, `/v1/./login`, `//v1/login`, `/v1/%6Cogin` and
//! `/v1/x/../login` name the same resource for most servers; a gateway that matched routes on
//! the raw bytes would let a caller reach the upstream's login handler through the catch-all
//! route, past the login route's limit. So the gateway matches and forwards the path in normal
//! form (RFC 3986 section 6.2.2): percent-encoded unreserved characters decoded, the remaining
//! escapes in upper case, dot segments removed, and (by default) runs of slashes merged, as
//! nginx does before matching its locations and Envoy does with `normalize_path` and
//! `merge_slashes`.
//!
//! Routes are matched on one more step, [`route_key`]: escaped slashes are read as slashes and
//! each segment's parameters (`;...`) are dropped first, as many servers do before they route,
//! so `/v1%2Flogin` and `/v1/login;x` are counted as the login route they reach there. The
//! forwarded path keeps them as they are. A path that climbs (`..`) only when read that way
//! (`/v1/public/..;/login`) names different resources on different servers: see
//! [`is_ambiguous`].

use std::borrow::Cow;

/// A path with a `%` not followed by two hexadecimal digits: servers disagree about what it
/// names (some reject it, some pass it on, some decode what they can), so it is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MalformedPath;

/// `path` (without its query) in normal form, borrowed when it already is. A path that does
/// not start with `/` (`*`, or the empty path of a `CONNECT`) is returned as it is.
pub fn normalize(path: &str, merge_slashes: bool) -> Result<Cow<'_, str>, MalformedPath> {
    if !path.starts_with('/') || is_plain(path, merge_slashes) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path)?;
    let resolved = resolve(&decoded, merge_slashes, false);
    Ok(if resolved == path {
        Cow::Borrowed(path)
    } else {
        Cow::Owned(resolved)
    })
}

/// What a path in normal form is matched against routes as: `normal` with escaped slashes and
/// backslashes (`%2F`, `%5C`, `\\`) read as `/`, each segment's parameters (from `;` to the
/// segment's end) dropped, and dot segments removed again. Many servers (Python's ASGI and
/// WSGI servers, Go's before 1.22, some Java containers) decode `%2F` before they route, and
/// Windows ones take `\\` for `/`: a route must not be escaped that way either.
pub fn route_key(normal: &str, merge_slashes: bool) -> Cow<'_, str> {
    let Some(slashes) = slashes_read(normal) else {
        return Cow::Borrowed(normal);
    };
    let key = resolve(&slashes, merge_slashes, true);
    if key == normal {
        Cow::Borrowed(normal)
    } else {
        Cow::Owned(key)
    }
}

/// Why a request's path is refused (400).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadPath {
    /// A `%` not followed by two hexadecimal digits ([`MalformedPath`]).
    Malformed,
    /// A segment that climbs only once reinterpreted: see [`is_ambiguous`].
    Ambiguous,
}

/// A request's path in normal form ([`normalize`]), or why it is refused: malformed, or
/// [`is_ambiguous`]. One pass over the usual path, which needs neither step.
pub fn normalize_request(path: &str, merge_slashes: bool) -> Result<Cow<'_, str>, BadPath> {
    // A plain path has no `%`, `\\` or segment starting with `.`: none can become `..`.
    if !path.starts_with('/') || is_plain(path, merge_slashes) {
        return Ok(Cow::Borrowed(path));
    }
    let normal = normalize(path, merge_slashes).map_err(|MalformedPath| BadPath::Malformed)?;
    if is_ambiguous(&normal) {
        return Err(BadPath::Ambiguous);
    }
    Ok(normal)
}

/// Whether `normal` (a path in normal form) holds a segment that becomes `..` only once
/// escaped slashes or backslashes are read as `/` or segment parameters are dropped (`..;x`,
/// `..%2F`, `%5C..`). Servers disagree about which resource such a path names: a Java
/// container climbs out of the segment before `..;x`, nginx and most others do not, Python's
/// servers climb at `..%2F`, Go's do not. Whichever route the gateway counted it under, some
/// upstream would serve another, so such a path is refused rather than guessed at.
pub fn is_ambiguous(normal: &str) -> bool {
    slashes_read(normal).is_some_and(|slashes| {
        slashes
            .split('/')
            .any(|segment| segment.split(';').next() == Some(".."))
    })
}

/// `normal` with escaped slashes and backslashes (`%2F`, `%5C`, `\\`) read as `/`, as the route
/// lookup reads it; `None` when nothing there could be read otherwise (no `;`, `\\` or `%`:
/// most paths).
fn slashes_read(normal: &str) -> Option<String> {
    if !normal.starts_with('/') || !normal.bytes().any(|b| matches!(b, b';' | b'\\' | b'%')) {
        return None;
    }
    Some(
        normal
            .replace("%2F", "/")
            .replace("%5C", "/")
            .replace('\\', "/"),
    )
}

/// Whether `path` holds nothing [`normalize`] would change and nothing [`is_ambiguous`]
/// could find: no `%`, no `\\`, no byte outside ASCII, no segment starting with `.`, and (when
/// merging) no `//`. One pass, no allocation: most paths take only this.
fn is_plain(path: &str, merge_slashes: bool) -> bool {
    let mut after_slash = false;
    for &b in path.as_bytes() {
        if b == b'%'
            || b == b'\\'
            || !b.is_ascii()
            || (after_slash && (b == b'.' || (merge_slashes && b == b'/')))
        {
            return false;
        }
        after_slash = b == b'/';
    }
    true
}

/// `path` with each `%XX` of an unreserved character (letters, digits, `-`, `.`, `_`, `~`)
/// replaced by the character, every other escape's hex digits in upper case, and each byte
/// outside ASCII escaped (`/café` is `/caf%C3%A9`, as clients send it: both spellings name
/// one resource, and must meet one route).
/// The byte that the percent-escape at `bytes[at]` (a `%` and two hex digits) encodes, if
/// it is one.
pub(crate) fn escaped(bytes: &[u8], at: usize) -> Option<u8> {
    let digit = |j: usize| bytes.get(j).and_then(|&b| char::from(b).to_digit(16));
    let (hi, lo) = (digit(at + 1)?, digit(at + 2)?);
    u8::try_from(hi << 4 | lo).ok()
}

fn decode_unreserved(path: &str) -> Result<Cow<'_, str>, MalformedPath> {
    if !path.bytes().any(|b| b == b'%' || !b.is_ascii()) {
        return Ok(Cow::Borrowed(path));
    }
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let escape = |out: &mut Vec<u8>, value: u8| {
        out.extend_from_slice(&[
            b'%',
            HEX[usize::from(value >> 4)],
            HEX[usize::from(value & 0xf)],
        ]);
    };
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(path.len() + 8);
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let value = escaped(bytes, i).ok_or(MalformedPath)?;
                if value.is_ascii_alphanumeric() || matches!(value, b'-' | b'.' | b'_' | b'~') {
                    out.push(value);
                } else {
                    escape(&mut out, value);
                }
                i += 3;
            }
            b if !b.is_ascii() => {
                escape(&mut out, b);
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    // Only ASCII went in: escapes, and the path's own ASCII bytes.
    String::from_utf8(out)
        .map(Cow::Owned)
        .map_err(|_| MalformedPath)
}

/// `path` (starting with `/`) with its dot segments removed (RFC 3986 section 5.2.4: `.`
/// goes, `..` takes the segment before it along), empty segments dropped when
/// `merge_slashes` (except a last one: a trailing slash stays), and each segment cut at its
/// first `;` first when `strip_params`.
fn resolve(path: &str, merge_slashes: bool, strip_params: bool) -> String {
    let mut kept: Vec<&str> = Vec::new();
    let mut segments = path[1..].split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        let segment = if strip_params {
            segment.split(';').next().unwrap_or_default()
        } else {
            segment
        };
        match segment {
            "." | ".." => {
                if segment == ".." {
                    kept.pop();
                }
                // `/a/b/..` is `/a/`: the directory, with its slash.
                if last {
                    kept.push("");
                }
            }
            "" if merge_slashes && !last => {}
            _ => kept.push(segment),
        }
    }
    let mut out = String::with_capacity(path.len());
    out.push('/');
    out.push_str(&kept.join("/"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(path: &str) -> String {
        normalize(path, true).unwrap().into_owned()
    }

    #[test]
    fn plain_paths_are_borrowed_as_they_are() {
        for p in [
            "/",
            "/v1/login",
            "/a.b/c.",
            "/v1/search/",
            "*",
            "",
            "/x;y=1",
        ] {
            assert!(
                matches!(normalize(p, true), Ok(Cow::Borrowed(b)) if b == p),
                "{p}"
            );
        }
        // A segment starting with a dot that is not a dot segment takes the slow path and
        // comes back unchanged, still borrowed.
        assert!(matches!(
            normalize("/.well-known/x", true),
            Ok(Cow::Borrowed(_))
        ));
    }

    #[test]
    fn dot_segments_are_removed_as_rfc_3986_says() {
        // RFC 3986 section 5.2.4's own examples, and the cases around the root.
        assert_eq!(n("/a/b/c/./../../g"), "/a/g");
        assert_eq!(n("/v1/./login"), "/v1/login");
        assert_eq!(n("/v1/x/../login"), "/v1/login");
        assert_eq!(n("/v1/login/."), "/v1/login/");
        assert_eq!(n("/v1/login/.."), "/v1/");
        assert_eq!(n("/.."), "/");
        assert_eq!(n("/../../v1/login"), "/v1/login");
        assert_eq!(n("/."), "/");
        assert_eq!(n("/..."), "/...");
        assert_eq!(n("/a/.b/..c"), "/a/.b/..c");
    }

    #[test]
    fn slashes_are_merged_unless_turned_off() {
        assert_eq!(n("//v1//login"), "/v1/login");
        assert_eq!(n("/v1/login//"), "/v1/login/");
        assert_eq!(n("//"), "/");
        let keep = |p| normalize(p, false).unwrap().into_owned();
        assert_eq!(keep("//v1//login"), "//v1//login");
        assert_eq!(keep("/a//../b"), "/a/b");
        assert_eq!(keep("/a//."), "/a//");
    }

    #[test]
    fn unreserved_escapes_are_decoded_and_others_upper_cased() {
        assert_eq!(n("/v1/%6Cogin"), "/v1/login");
        assert_eq!(n("/v1/%6c%6F%67%69%6e"), "/v1/login");
        assert_eq!(n("/%7Euser/a%2Db%5Fc%2e"), "/~user/a-b_c.");
        // Decoded before dot segments are looked for, as the RFC orders it.
        assert_eq!(n("/v1/public/%2e%2E/login"), "/v1/login");
        // Reserved and other characters stay escaped: `%2F` is not a segment boundary.
        assert_eq!(n("/a%2fb/%20%3f"), "/a%2Fb/%20%3F");
        assert_eq!(n("/caf%C3%a9"), "/caf%C3%A9");
        // Bytes outside ASCII are escaped: the raw and the escaped spelling meet.
        assert_eq!(n("/café/ü"), "/caf%C3%A9/%C3%BC");
        assert_eq!(n("/caf%c3%a9/./x"), n("/café/x"));
    }

    #[test]
    fn malformed_escapes_are_refused() {
        for p in ["/a%", "/a%2", "/a%zz", "/a%2g/b", "/%%41"] {
            assert_eq!(normalize(p, true), Err(MalformedPath), "{p}");
        }
    }

    #[test]
    fn a_path_that_climbs_only_once_reinterpreted_is_ambiguous() {
        for p in [
            "/v1/search/..;x",
            "/v1/search/..;/x",
            "/v1/search/..%2Fx",
            "/v1/search%2F..",
            "/v1/search/..%5Cx",
            "/v1/search/..\\x",
        ] {
            let normal = n(p);
            assert!(is_ambiguous(&normal), "{p} -> {normal}");
        }
        for p in [
            "/v1/search",
            "/v1/search;x",
            "/v1/search/.;x",
            "/v1/a%2Fb",
            "/v1/..x;y",
            "/v1/x..;y",
            "/v1/%2E%2E/search",
            "/v1/search/%2E%2E",
        ] {
            let normal = n(p);
            assert!(!is_ambiguous(&normal), "{p} -> {normal}");
        }
    }

    #[test]
    fn a_request_path_is_normalized_or_refused_in_one_call() {
        assert!(matches!(
            normalize_request("/v1/search", true),
            Ok(Cow::Borrowed(_))
        ));
        assert_eq!(
            normalize_request("/v1/./search", true).unwrap(),
            "/v1/search"
        );
        assert_eq!(normalize_request("/v1/%zz", true), Err(BadPath::Malformed));
        // A backslash takes the slow path: it may hide a dot segment.
        for p in ["/v1/search\\..\\x", "/v1/search/..;x", "/v1/search/..%2fx"] {
            assert_eq!(normalize_request(p, true), Err(BadPath::Ambiguous), "{p}");
        }
        assert_eq!(
            normalize_request("/v1\\search", true).unwrap(),
            "/v1\\search"
        );
    }

    #[test]
    fn route_keys_drop_segment_parameters_then_dot_segments() {
        assert_eq!(route_key("/v1/login;x=1", true), "/v1/login");
        assert_eq!(route_key("/v1;v=2/login", true), "/v1/login");
        assert_eq!(route_key("/v1/public/..;/login", true), "/v1/login");
        assert_eq!(route_key("/v1/;x/login", true), "/v1/login");
        assert!(matches!(route_key("/v1/login", true), Cow::Borrowed(_)));
        assert!(matches!(route_key("/v1/a%20b", true), Cow::Borrowed(_)));
        assert_eq!(route_key("/v1%2Flogin", true), "/v1/login");
        assert_eq!(route_key("/v1%5Clogin", true), "/v1/login");
        assert_eq!(route_key("/v1\\login", true), "/v1/login");
        assert_eq!(route_key("/v1/x/..%2Flogin", true), "/v1/login");
    }

    /// Every output is a fixed point: normalizing twice changes nothing, and no dot segment
    /// or (when merging) empty inner segment survives.
    #[test]
    fn normal_form_is_a_fixed_point() {
        let alphabet = ["/", ".", "..", "a", "%2e", "%2F", "%41", ";p", "//"];
        let mut paths = vec![String::new()];
        for _ in 0..4 {
            paths = paths
                .iter()
                .flat_map(|p| alphabet.iter().map(move |s| format!("{p}{s}")))
                .collect();
            for p in &paths {
                let p = format!("/{p}");
                for merge in [true, false] {
                    let once = normalize(&p, merge).unwrap().into_owned();
                    assert_eq!(normalize(&once, merge).unwrap(), once, "{p} {merge}");
                    let segments: Vec<&str> = once[1..].split('/').collect();
                    assert!(
                        !segments.iter().any(|s| *s == "." || *s == ".."),
                        "{p} -> {once}"
                    );
                    if merge {
                        let inner = &segments[..segments.len() - 1];
                        assert!(!inner.contains(&""), "{p} -> {once}");
                    }
                    let key = route_key(&once, merge).into_owned();
                    assert_eq!(route_key(&key, merge), key, "{p} {merge}");
                }
            }
        }
    }
}
