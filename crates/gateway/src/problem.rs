//! RFC 9457 problem details: every answer the gateway writes itself on an error path.
//! A problem says who caused it (caller 4xx, upstream 502/504, gateway 503) and never
//! shows internals.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use smallvec::SmallVec;

use crate::body::Body;

/// The title of every `headers-too-large` problem.
const HEAD_TOO_LARGE: &str = "The request head is too large";

/// A problem to answer with.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub(crate) status: StatusCode,
    /// Appended to `problem_base` to make the `type` URI.
    pub(crate) kind: &'static str,
    pub(crate) title: &'static str,
    pub(crate) detail: String,
    /// Whole seconds for `Retry-After` and the body's `retry_after`.
    pub(crate) retry_after: Option<u64>,
    /// Extension members, in order (`policy`, `quota`, `window`, ...).
    pub(crate) extra: SmallVec<[(&'static str, Member); 3]>,
    /// The request's body was left unread (or broken): its connection cannot carry another
    /// request, and an HTTP/1.1 answer says so with `Connection: close`.
    pub(crate) ends_connection: bool,
}

/// An extension member's value.
#[derive(Debug, Clone)]
pub(crate) enum Member {
    /// Words of this crate: written as they are.
    Text(&'static str),
    /// A configured name (a limit's), which configuration allows only from `[A-Za-z0-9._-]`:
    /// written as it is.
    Name(Arc<str>),
    Number(u64),
}

/// What a 503 to a request a `delay` limit held says of its charges (see
/// [`Problem::overloaded`]).
const WITHDRAWN_AFTER_HOLD: &str = "Retry after the delay in Retry-After. This request's charge \
was withdrawn, unless another of your requests is held behind it; the RateLimit fields show \
what you have.";

const NOT_TAKEN_BACK: &str = "Retry after the delay in Retry-After. The gateway could not \
confirm that what this request was charged was taken back (the shared quota store failed or did \
not answer in time), so it may still count against your quota.";

/// What a 503 cost the caller's quota, as its body says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Charges {
    /// Nothing was charged, or what was is taken back.
    None,
    /// A held request's charges were withdrawn, but for a token bucket's that a later request
    /// of the caller is held behind.
    WithdrawnAfterHold,
    /// The shared store charged the request, and taking the charge back failed or timed out
    /// (a call that timed out may still be carried out: the charge may or may not stand).
    NotTakenBack,
}

impl Charges {
    fn detail(self, none: &'static str) -> &'static str {
        match self {
            Charges::None => none,
            Charges::WithdrawnAfterHold => WITHDRAWN_AFTER_HOLD,
            Charges::NotTakenBack => NOT_TAKEN_BACK,
        }
    }
}

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            title,
            detail: detail.into(),
            retry_after: None,
            extra: SmallVec::new(),
            ends_connection: false,
        }
    }

    pub(crate) fn not_found() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not-found",
            "No route matches this request",
            "No route is configured for this method, host and path.",
        )
    }

    /// 405 for `CONNECT`: a reverse proxy forwards requests for resources, it does not open
    /// tunnels to where a caller names (hyper would take an upstream's 2xx to one as the
    /// switch to a tunnel, and end the connection).
    pub(crate) fn connect_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "The method is not allowed",
            "This gateway does not open CONNECT tunnels.",
        )
    }

    /// 405 for a `TRACE` whose `Max-Forwards` is spent: the gateway is then its final
    /// recipient (RFC 9110 section 7.6.2), and does not reflect requests (their cookies and
    /// credentials would come back to a script that sent them).
    pub(crate) fn trace_not_reflected() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "The method is not allowed",
            "Max-Forwards is 0 and this gateway does not reflect TRACE requests.",
        )
    }

    pub(crate) fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "The request is malformed",
            detail,
        )
    }

    /// 431: an HTTP/2 request with more header fields than HTTP/1.1's limit (hyper answers
    /// that one itself, before the gateway sees the request).
    pub(crate) fn too_many_headers(max: usize) -> Self {
        Self::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers-too-large",
            HEAD_TOO_LARGE,
            format!("The request has more than {max} header fields."),
        )
    }

    /// 431 over HTTP/1.1, where hyper cannot say which of the two limits a head went past.
    pub(crate) fn head_too_large(max_bytes: usize, max_fields: usize) -> Self {
        Self::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers-too-large",
            HEAD_TOO_LARGE,
            format!(
                "The request head is larger than {} KiB or has more than {max_fields} header fields.",
                max_bytes / 1024
            ),
        )
    }

    /// 413: the request's body is over `max_body_size` (declared, or found while forwarding).
    pub(crate) fn body_too_large(limit: u64) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            "The request body is too large",
            format!("The request body is larger than the gateway's limit of {limit} bytes."),
        )
    }

    /// 501: a transfer coding other than `chunked`, which the gateway cannot pass on.
    pub(crate) fn unsupported_coding() -> Self {
        Self::new(
            StatusCode::NOT_IMPLEMENTED,
            "unsupported-transfer-coding",
            "The request's transfer coding is not supported",
            "Only the chunked transfer coding is supported (RFC 9112 section 6.1); send other codings as Content-Encoding.",
        )
    }

    /// 502: the upstream's response is framed in a way the gateway cannot pass on faithfully.
    pub(crate) fn upstream_bad_response() -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream-bad-response",
            "The upstream service sent a response the gateway cannot pass on",
            "The response's head was malformed (not HTTP/1.x, an invalid field, a folded line, too large), its length ambiguous or malformed (Content-Length and Transfer-Encoding together, differing or invalid Content-Length values, a malformed chunk), or its transfer coding other than chunked.",
        )
    }

    pub(crate) fn upstream_unavailable() -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "upstream-unavailable", "The upstream service could not be reached", "The connection to the upstream service was refused, reset or closed before it answered.")
    }

    /// 408: the request body stopped coming, or came slower than `min_body_rate`.
    pub(crate) fn body_timeout() -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "request-timeout",
            "The request body did not arrive in time",
            "The request body stopped arriving, or arrived slower than the gateway's minimum rate.",
        )
    }

    pub(crate) fn upstream_timeout() -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream-timeout",
            "The upstream service did not answer in time",
            "The upstream service did not answer within the gateway's time limit.",
        )
    }

    /// The gateway is full. Names no queue depth or limit: that would tell callers how hard to push.
    /// `charges`: what it cost the caller. Found full when a `delay` limit's hold ended, the
    /// request's charges are withdrawn, except a token bucket's that a later request of the
    /// caller is held behind (it keeps the moment it was given), so the body promises no more
    /// than that; and when the shared store could not take a charge back, it says so.
    pub(crate) fn overloaded(retry_after: u64, charges: Charges) -> Self {
        let detail =
            charges.detail("Retry after the delay in Retry-After. Your quota was not charged.");
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server-overloaded",
            "The service is at capacity",
            detail,
        );
        p.retry_after = Some(retry_after);
        p.extra.push(("policy", Member::Text("server-capacity")));
        p
    }

    /// This instance is going away (another can answer), not full: a held request whose hold
    /// would end after the shutdown grace, its charges withdrawn as after a hold that found the
    /// gateway full; or an HTTP/2 stream opened long after the connection was told to stop
    /// (nothing charged).
    pub(crate) fn draining(retry_after: u64, charges: Charges) -> Self {
        let detail = charges.detail(
            "This connection was told to stop opening streams (GOAWAY): retry on a new one, after \
the delay in Retry-After. Your quota was not charged.",
        );
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting-down",
            "The service is shutting down",
            detail,
        );
        p.retry_after = Some(retry_after);
        p.extra.push(("policy", Member::Text("server-draining")));
        p
    }

    /// The shared store cannot decide and `on_error = "deny"`. Nothing stays charged: what
    /// Redis charged for a decision whose answer came too late is taken back when the answer
    /// comes (but for an answer that never comes: docs/configuration.md, `timeout`).
    pub(crate) fn store_unavailable(retry_after: u64) -> Self {
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "quota-store-unavailable",
            "The service cannot check quotas right now",
            "Retry after the delay in Retry-After. Your quota was not charged.",
        );
        p.retry_after = Some(retry_after);
        p.extra.push(("policy", Member::Text("quota-store")));
        p
    }

    /// The JSON body, written member by member into one buffer: refusals are a hot path when
    /// a caller hammers past its quota.
    pub(crate) fn to_json(&self, problem_base: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(256 + self.detail.len());
        let mut digits = itoa::Buffer::new();
        let key = member_name;
        key(&mut out, "type");
        out.push(b'"');
        escaped(&mut out, problem_base);
        plain_string_rest(&mut out, self.kind);
        key(&mut out, "title");
        out.push(b'"');
        plain_string_rest(&mut out, self.title);
        key(&mut out, "status");
        out.extend_from_slice(digits.format(self.status.as_u16()).as_bytes());
        key(&mut out, "detail");
        out.push(b'"');
        escaped(&mut out, &self.detail);
        out.push(b'"');
        for (k, v) in &self.extra {
            key(&mut out, k);
            match v {
                Member::Text(t) => {
                    out.push(b'"');
                    plain_string_rest(&mut out, t);
                }
                Member::Name(n) => {
                    out.push(b'"');
                    plain_string_rest(&mut out, n);
                }
                Member::Number(n) => out.extend_from_slice(digits.format(*n).as_bytes()),
            }
        }
        if let Some(s) = self.retry_after {
            key(&mut out, "retry_after");
            out.extend_from_slice(digits.format(s).as_bytes());
        }
        out.extend_from_slice(b"}\n");
        out
    }

    pub(crate) fn into_response(self, problem_base: &str) -> Response<Body> {
        let body = Bytes::from(self.to_json(problem_base));
        let mut res = Response::new(Body::full(body));
        *res.status_mut() = self.status;
        let h = res.headers_mut();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(s) = self.retry_after {
            h.insert(RETRY_AFTER, HeaderValue::from(s));
        }
        res
    }
}

/// A member's name and colon, after `{` or `,`. Names are identifiers of this file: written as
/// they are. Always inlined: out of line (as one build's codegen units had it), its eight
/// calls cost a 429 about 500 instructions more.
#[inline(always)]
fn member_name(out: &mut Vec<u8>, key: &str) {
    debug_assert!(key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
    out.push(if out.is_empty() { b'{' } else { b',' });
    out.push(b'"');
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\":");
}

/// The rest of a JSON string whose opening quote is written: `text`, which needs no escape
/// (words of this crate, and names that configuration allows only from `[A-Za-z0-9._-]`), and
/// the closing quote. Refusals are answered at the rate callers send them; a sixth of a 429's
/// body work was looking for escapes where none can be.
fn plain_string_rest(out: &mut Vec<u8>, text: &str) {
    debug_assert!(
        !text.bytes().any(|b| ESCAPE[usize::from(b)]),
        "{text:?} needs escaping"
    );
    out.extend_from_slice(text.as_bytes());
    out.push(b'"');
}

/// `text` as the inside of a JSON string (RFC 8259 section 7). Eight bytes are checked at a
/// time, and runs that need no escape are copied whole.
fn escaped(out: &mut Vec<u8>, text: &str) {
    let bytes = text.as_bytes();
    let (mut start, mut i) = (0, 0);
    while i < bytes.len() {
        if let Some(word) = bytes.get(i..i + 8) {
            let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            if !word_needs_escape(word) {
                i += 8;
                continue;
            }
        }
        let b = bytes[i];
        if ESCAPE[usize::from(b)] {
            out.extend_from_slice(&bytes[start..i]);
            escape(out, b);
            start = i + 1;
        }
        i += 1;
    }
    out.extend_from_slice(&bytes[start..]);
}

/// Whether any of the eight bytes of `w` is below 0x20, `"` or `\` (exact: the usual
/// "has a byte less than n" and "has a zero byte" word tests).
fn word_needs_escape(w: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let has_zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH != 0;
    let below_space = w.wrapping_sub(ONES * 0x20) & !w & HIGH != 0;
    below_space || has_zero(w ^ (ONES * u64::from(b'"'))) || has_zero(w ^ (ONES * u64::from(b'\\')))
}

/// The bytes a JSON string cannot hold as they are: control characters, `"` and `\`.
static ESCAPE: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = true;
        b += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

/// Writes the escape of byte `b`, one that [`ESCAPE`] marks.
fn escape(out: &mut Vec<u8>, b: u8) {
    match b {
        b'"' => out.extend_from_slice(b"\\\""),
        b'\\' => out.extend_from_slice(b"\\\\"),
        b'\n' => out.extend_from_slice(b"\\n"),
        b'\r' => out.extend_from_slice(b"\\r"),
        b'\t' => out.extend_from_slice(b"\\t"),
        _ => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(b"\\u00");
            out.extend_from_slice(&[HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn json_strings_escape_what_json_requires_and_keep_the_rest() {
        let json_string = |out: &mut Vec<u8>, parts: &[&str]| {
            out.push(b'"');
            for part in parts {
                escaped(out, part);
            }
            out.push(b'"');
        };
        let mut out = Vec::new();
        let nasty = "a\"b\\c\nd\re\tf\u{1}g\u{1f}h\u{7f}é✓/";
        json_string(&mut out, &["type:", nasty, "", "end"]);
        let back: String = serde_json::from_slice(&out).unwrap();
        assert_eq!(back, format!("type:{nasty}end"));
        let reference = serde_json::to_vec(&format!("type:{nasty}end")).unwrap();
        assert_eq!(out, reference, "the same bytes as serde_json");
        // Every byte a JSON string may need escaped (and some that it does not), at every
        // position of a string long enough for the eight-byte steps, reads back as itself.
        let plain = "abcdefghijklmnopqrs";
        for c in (0u8..128).map(char::from).chain(['é', '✓']) {
            for at in 0..=plain.len() {
                let text = format!("{}{c}{}", &plain[..at], &plain[at..]);
                let mut out = Vec::new();
                json_string(&mut out, &[&text]);
                let back: String = serde_json::from_slice(&out).unwrap();
                assert_eq!(back, text, "{c:?} at {at}");
                assert_eq!(out.len() > text.len() + 2, c < ' ' || c == '"' || c == '\\');
            }
        }
    }

    #[test]
    fn extension_members_are_written_in_order_with_their_types() {
        let mut p = Problem::new(StatusCode::TOO_MANY_REQUESTS, "quota-exceeded", "T", "D");
        p.extra.push(("policy", Member::Name(Arc::from("per-key"))));
        p.extra.push(("quota", Member::Number(40)));
        p.extra.push(("note", Member::Text("x")));
        p.retry_after = Some(7);
        let body = String::from_utf8(p.to_json("urn:p:")).unwrap();
        assert_eq!(
            body,
            "{\"type\":\"urn:p:quota-exceeded\",\"title\":\"T\",\"status\":429,\"detail\":\"D\",\
             \"policy\":\"per-key\",\"quota\":40,\"note\":\"x\",\"retry_after\":7}\n"
        );
        let json: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(json["policy"], "per-key");
    }

    #[test]
    fn the_problem_base_and_the_detail_are_escaped() {
        let p = Problem::bad_request("a \"quoted\" \\ detail\n");
        let json: Value = serde_json::from_slice(&p.to_json("urn:a\\b:")).unwrap();
        assert_eq!(json["type"], "urn:a\\b:bad-request");
        assert_eq!(json["detail"], "a \"quoted\" \\ detail\n");
    }

    #[test]
    fn overload_body_matches_the_contract() {
        let json: Value =
            serde_json::from_slice(&Problem::overloaded(3, Charges::None).to_json("https://x/p/"))
                .unwrap();
        assert_eq!(json["type"], "https://x/p/server-overloaded");
        assert_eq!(json["status"], 503);
        assert_eq!(json["policy"], "server-capacity");
        assert_eq!(json["retry_after"], 3);
        assert_eq!(
            json["detail"],
            "Retry after the delay in Retry-After. Your quota was not charged."
        );
        // After a hold, a token bucket's charge can stay (a later request is held behind it):
        // the body does not promise what may not be so.
        let json: Value = serde_json::from_slice(
            &Problem::overloaded(3, Charges::WithdrawnAfterHold).to_json("https://x/p/"),
        )
        .unwrap();
        assert_eq!(json["policy"], "server-capacity");
        let detail = json["detail"].as_str().unwrap();
        assert!(!detail.contains("not charged"), "{detail}");
        assert!(detail.contains("unless another of your requests is held behind it"));
        // A charge the shared store could not take back: said to stand, in either 503.
        for p in [
            Problem::overloaded(3, Charges::NotTakenBack),
            Problem::draining(3, Charges::NotTakenBack),
        ] {
            let json: Value = serde_json::from_slice(&p.to_json("https://x/p/")).unwrap();
            let detail = json["detail"].as_str().unwrap();
            assert!(!detail.contains("not charged"), "{detail}");
            assert!(
                detail.contains("may still count against your quota"),
                "{detail}"
            );
        }
    }

    #[test]
    fn response_carries_type_cache_and_retry_headers() {
        let res = Problem::overloaded(4, Charges::None).into_response("urn:x:");
        assert_eq!(res.status(), 503);
        assert_eq!(res.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(res.headers()[CACHE_CONTROL], "no-store");
        assert_eq!(res.headers()[RETRY_AFTER], "4");
    }
}
