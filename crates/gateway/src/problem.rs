//! RFC 9457 problem details: every answer the gateway writes itself on an error path.
//! A problem says who caused it (caller 4xx, upstream 502/504, gateway 503) and never
//! shows internals.

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use serde_json::Value;

use crate::body::Body;

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
    pub(crate) extra: Vec<(&'static str, Value)>,
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
            extra: Vec::new(),
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

    pub(crate) fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "The request is malformed",
            detail,
        )
    }

    pub(crate) fn upstream_unavailable() -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "upstream-unavailable", "The upstream service could not be reached", "The connection to the upstream service was refused, reset or closed before it answered.")
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
    pub(crate) fn overloaded(retry_after: u64) -> Self {
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server-overloaded",
            "The service is at capacity",
            "Retry after the delay in Retry-After. Your quota was not charged.",
        );
        p.retry_after = Some(retry_after);
        p.extra.push(("policy", Value::from("server-capacity")));
        p
    }

    /// The shared store cannot decide and `on_error = "deny"`. Nothing was charged.
    pub(crate) fn store_unavailable(retry_after: u64) -> Self {
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "quota-store-unavailable",
            "The service cannot check quotas right now",
            "Retry after the delay in Retry-After. Your quota was not charged.",
        );
        p.retry_after = Some(retry_after);
        p.extra.push(("policy", Value::from("quota-store")));
        p
    }

    /// The JSON body.
    pub(crate) fn to_json(&self, problem_base: &str) -> Vec<u8> {
        // Written member by member into one buffer (no intermediate map): refusals are a hot
        // path when a caller hammers past its quota.
        let mut out = Vec::with_capacity(256 + self.detail.len());
        let member = |out: &mut Vec<u8>, key: &str, value: &dyn erased::Json| {
            out.push(if out.is_empty() { b'{' } else { b',' });
            out.push(b'"');
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(b"\":");
            value.write(out);
        };
        member(&mut out, "type", &Joined(problem_base, self.kind));
        member(&mut out, "title", &self.title);
        member(&mut out, "status", &self.status.as_u16());
        member(&mut out, "detail", &self.detail.as_str());
        for (k, v) in &self.extra {
            member(&mut out, k, v);
        }
        if let Some(s) = self.retry_after {
            member(&mut out, "retry_after", &s);
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

/// Two strings written as one JSON string.
struct Joined<'a>(&'a str, &'a str);

mod erased {
    /// A value that writes itself as JSON (serde_json does the escaping).
    pub(super) trait Json {
        fn write(&self, out: &mut Vec<u8>);
    }

    impl<T: serde::Serialize> Json for T {
        fn write(&self, out: &mut Vec<u8>) {
            serde_json::to_writer(out, self).expect("writing JSON to a Vec cannot fail");
        }
    }
}

impl serde::Serialize for Joined<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{}{}", self.0, self.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overload_body_matches_the_contract() {
        let json: Value =
            serde_json::from_slice(&Problem::overloaded(3).to_json("https://x/p/")).unwrap();
        assert_eq!(json["type"], "https://x/p/server-overloaded");
        assert_eq!(json["status"], 503);
        assert_eq!(json["policy"], "server-capacity");
        assert_eq!(json["retry_after"], 3);
        assert_eq!(
            json["detail"],
            "Retry after the delay in Retry-After. Your quota was not charged."
        );
    }

    #[test]
    fn response_carries_type_cache_and_retry_headers() {
        let res = Problem::overloaded(4).into_response("urn:x:");
        assert_eq!(res.status(), 503);
        assert_eq!(res.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(res.headers()[CACHE_CONTROL], "no-store");
        assert_eq!(res.headers()[RETRY_AFTER], "4");
    }
}
