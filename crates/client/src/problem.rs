//! Problem details bodies (RFC 9457), with the members sluice adds: `policy`, `retry_after`,
//! `quota` and `window`.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::error::Category;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// Media type of a problem details body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// A problem details body.
///
/// Every member is optional. As RFC 9457 section 3.1 asks, a member whose value has the wrong
/// type is treated as absent, and unknown members are ignored; only a body that is not a JSON
/// object is an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// `type`: a URI naming the problem; `about:blank` when absent.
    pub problem_type: String,
    /// `title`: a short human-readable summary of the problem type.
    pub title: Option<String>,
    /// `status`: the HTTP status code the server sent.
    pub status: Option<u16>,
    /// `detail`: a human-readable explanation of this occurrence.
    pub detail: Option<String>,
    /// `instance`: a URI naming this occurrence.
    pub instance: Option<String>,
    /// `policy`: the name of the policy that refused the request, as in `RateLimit-Policy`.
    pub policy: Option<String>,
    /// `retry_after`: the server's wait in whole seconds, the same as the `Retry-After` field.
    pub retry_after: Option<Duration>,
    /// `quota`: the policy's quota.
    pub quota: Option<u64>,
    /// `window`: the policy's window in whole seconds.
    pub window: Option<Duration>,
}

/// Why a body could not be read as a problem.
#[derive(Debug, thiserror::Error)]
pub enum ProblemError {
    /// The body is not JSON.
    #[error("the body is not JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The body is JSON but not an object.
    #[error("the body is JSON but not an object")]
    NotAnObject,
}

/// The members [`Problem`] reads.
const MEMBERS: [&str; 9] = [
    "type",
    "title",
    "status",
    "detail",
    "instance",
    "policy",
    "retry_after",
    "quota",
    "window",
];

impl Problem {
    /// Reads a problem details body.
    pub fn from_slice(body: &[u8]) -> Result<Self, ProblemError> {
        // A UTF-8 byte-order mark some servers write first is no part of the JSON text (RFC
        // 8259 section 8.1 lets a parser ignore it; serde_json does not).
        let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
        // Member by member, so that one serde_json cannot hold (a number beyond a double,
        // `1e400`) is ignored as RFC 9457 asks of a bad member, rather than failing the body
        // and losing its `policy` (review).
        let raw: HashMap<String, Box<RawValue>> = match serde_json::from_slice(body) {
            Ok(members) => members,
            // Valid JSON of another type than an object.
            Err(e) if e.classify() == Category::Data => return Err(ProblemError::NotAnObject),
            Err(e) => return Err(e.into()),
        };
        // Only the members read below are parsed: an unknown one (a large array, say) is
        // ignored, not built into values (review: a 10 MB body took 373 MB).
        let members: Map<String, Value> = raw
            .into_iter()
            .filter(|(k, _)| MEMBERS.contains(&k.as_str()))
            .filter_map(|(k, v)| Some((k, serde_json::from_str(v.get()).ok()?)))
            .collect();
        Ok(Self::from_members(&members))
    }

    fn from_members(m: &Map<String, Value>) -> Self {
        let string = |key: &str| m.get(key).and_then(Value::as_str).map(str::to_owned);
        // A whole number written as a float (`42.0`, `4.2e1`, as JavaScript and Python
        // encoders may write it) is that number.
        let unsigned = |key: &str| {
            let v = m.get(key)?;
            v.as_u64().or_else(|| {
                let f = v.as_f64()?;
                // `u64::MAX as f64` is 2^64, itself out of range.
                (f.fract() == 0.0 && (0.0..u64::MAX as f64).contains(&f)).then_some(f as u64)
            })
        };
        Problem {
            problem_type: string("type").unwrap_or_else(|| "about:blank".to_owned()),
            title: string("title"),
            status: unsigned("status").and_then(|s| u16::try_from(s).ok()),
            detail: string("detail"),
            instance: string("instance"),
            policy: string("policy"),
            retry_after: unsigned("retry_after").map(Duration::from_secs),
            quota: unsigned("quota"),
            window: unsigned("window").map(Duration::from_secs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body that starts with a UTF-8 byte-order mark is read (review: "not JSON").
    #[test]
    fn a_byte_order_mark_before_the_body_is_passed_over() {
        let p = Problem::from_slice(b"\xEF\xBB\xBF{\"status\":429,\"policy\":\"k\"}").unwrap();
        assert_eq!((p.status, p.policy.as_deref()), (Some(429), Some("k")));
    }

    #[test]
    fn sluice_quota_body_reads_every_member() {
        let body = br#"{"type":"https://api.example.com/problems/quota-exceeded","title":"Your key has used its quota for this window","status":429,"detail":"5 of 5 requests used in a 60 s window.","policy":"key-quota","quota":5,"window":60,"retry_after":42}"#;
        let p = Problem::from_slice(body).unwrap();
        assert_eq!(
            p,
            Problem {
                problem_type: "https://api.example.com/problems/quota-exceeded".into(),
                title: Some("Your key has used its quota for this window".into()),
                status: Some(429),
                detail: Some("5 of 5 requests used in a 60 s window.".into()),
                instance: None,
                policy: Some("key-quota".into()),
                retry_after: Some(Duration::from_secs(42)),
                quota: Some(5),
                window: Some(Duration::from_secs(60)),
            }
        );
    }

    #[test]
    fn whole_numbers_written_as_floats_are_read() {
        let p = Problem::from_slice(br#"{"retry_after": 42.0, "quota": 4.2e1, "window": 1.5}"#)
            .unwrap();
        assert_eq!(p.retry_after, Some(Duration::from_secs(42)));
        assert_eq!(p.quota, Some(42));
        assert_eq!(p.window, None, "not a whole number");
        let p = Problem::from_slice(br#"{"retry_after": -1.0, "quota": 1e30}"#).unwrap();
        assert_eq!((p.retry_after, p.quota), (None, None));
    }

    #[test]
    fn missing_members_are_none_and_type_defaults_to_about_blank() {
        let p = Problem::from_slice(b"{}").unwrap();
        assert_eq!(p.problem_type, "about:blank");
        assert_eq!(
            (p.title, p.status, p.policy, p.retry_after),
            (None, None, None, None)
        );
    }

    #[test]
    fn extra_members_are_ignored() {
        let p = Problem::from_slice(br#"{"status":503,"queue_depth":12,"nested":{"a":[1]}}"#);
        assert_eq!(p.unwrap().status, Some(503));
    }

    #[test]
    fn members_of_the_wrong_type_are_absent() {
        let p = Problem::from_slice(
            br#"{"type":7,"status":"429","retry_after":1.5,"quota":-1,"window":"60","policy":null}"#,
        )
        .unwrap();
        assert_eq!(p.problem_type, "about:blank");
        assert_eq!(p.status, None);
        assert_eq!(p.retry_after, None, "1.5 is absent here too, never zero");
        assert_eq!((p.quota, p.window, p.policy), (None, None, None));
    }

    #[test]
    fn status_out_of_u16_range_is_absent() {
        let p = Problem::from_slice(br#"{"status":70000}"#).unwrap();
        assert_eq!(p.status, None);
    }

    #[test]
    fn html_error_page_is_an_error() {
        let err = Problem::from_slice(b"<html>503 Service Unavailable</html>").unwrap_err();
        assert!(matches!(err, ProblemError::Json(_)));
    }

    #[test]
    fn a_number_beyond_a_double_is_an_absent_member_not_a_bad_body() {
        // Review: `1e400` failed the whole body, and 2^64 read as u64::MAX.
        let p = Problem::from_slice(
            br#"{"status":429,"policy":"key-quota","retry_after":1e400,"quota":18446744073709551616.0,"window":18446744073709551616}"#,
        )
        .unwrap();
        assert_eq!(p.policy.as_deref(), Some("key-quota"));
        assert_eq!(p.status, Some(429));
        assert_eq!((p.retry_after, p.quota, p.window), (None, None, None));
        // Malformed JSON is still an error.
        assert!(matches!(
            Problem::from_slice(br#"{"status":429,"#),
            Err(ProblemError::Json(_))
        ));
    }

    #[test]
    fn json_that_is_not_an_object_is_an_error() {
        for body in [&b"[]"[..], b"null", b"429", br#""quota""#] {
            let err = Problem::from_slice(body).unwrap_err();
            assert!(matches!(err, ProblemError::NotAnObject));
        }
    }
}
