//! `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers, revision 11).
//!
//! Both fields are Structured Fields lists (RFC 9651). Each member is an sf-string naming a policy,
//! with integer parameters: `q` (quota) and optional `w` (window, seconds) on a policy, `r`
//! (remaining) and optional `t` (seconds until reset) on a limit. `w` and `t` are absent for
//! concurrency limits. Unknown parameters are ignored, as the draft asks.

use std::time::Duration;

use http::header::HeaderMap;
use sfv::{BareItem, Item, List, ListEntry, Parser};

/// Name of the `RateLimit-Policy` field.
pub const RATELIMIT_POLICY: &str = "ratelimit-policy";
/// Name of the `RateLimit` field.
pub const RATELIMIT: &str = "ratelimit";

/// One member of `RateLimit-Policy`: a quota the server enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The policy's name, shared with the matching [`Limit`].
    pub name: String,
    /// `q`: units allowed per window (or at once, for a concurrency limit).
    pub quota: u64,
    /// `w`: the window; `None` when the field has no `w` (a concurrency limit).
    pub window: Option<Duration>,
    /// `qu`: the quota unit as the server wrote it; `None` means requests. Revisions of the
    /// draft name the units differently (`request` or `requests`, `content-bytes`,
    /// `concurrency` or `concurrent-requests`), so the value is passed on, not checked.
    pub unit: Option<String>,
    /// `pk`: the partition key the server counts this request under.
    pub partition_key: Option<Vec<u8>>,
}

/// One member of `RateLimit`: what is left of a policy's quota for this caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// The policy's name, shared with the matching [`Policy`].
    pub name: String,
    /// `r`: units left.
    pub remaining: u64,
    /// `t`: time until the quota resets; `None` when the field has no `t`.
    pub reset: Option<Duration>,
    /// `pk`: the partition key the server counts this request under.
    pub partition_key: Option<Vec<u8>>,
}

/// Why a `RateLimit` or `RateLimit-Policy` field could not be read.
///
/// The draft tells a client to ignore a malformed field; this error says why, so the caller can
/// log it before ignoring it.
#[derive(Debug, thiserror::Error)]
pub enum RateLimitError {
    /// The field is not a Structured Fields list.
    #[error("not a Structured Fields list: {0}")]
    Syntax(#[source] sfv::Error),
    /// The field's bytes are not visible ASCII and spaces.
    #[error("the field value is not ASCII")]
    NotAscii,
    /// A member is an inner list where a policy item belongs.
    #[error("member {index} is an inner list, not a policy item")]
    InnerList {
        /// Position of the member in the list, from 0.
        index: usize,
    },
    /// A member's value is not an sf-string.
    #[error("member {index}: the policy name is not a string")]
    NameNotString {
        /// Position of the member in the list, from 0.
        index: usize,
    },
    /// A required parameter is missing.
    #[error("policy {name:?}: required parameter {param} is missing")]
    MissingParam {
        /// The policy's name.
        name: String,
        /// The missing parameter's key.
        param: &'static str,
    },
    /// A known parameter has the wrong type or a value out of its range (negative, or a window
    /// of zero).
    #[error("policy {name:?}: parameter {param} has the wrong type or a value out of range")]
    BadParam {
        /// The policy's name.
        name: String,
        /// The parameter's key.
        param: &'static str,
    },
}

impl Policy {
    fn from_item(index: usize, item: &Item) -> Result<Self, RateLimitError> {
        let name = item_name(index, item)?;
        let params = Params { name: &name, item };
        Ok(Policy {
            quota: params.required_u64("q")?,
            window: params.window("w")?,
            unit: params.string("qu")?,
            partition_key: params.bytes("pk")?,
            name,
        })
    }
}

impl Limit {
    fn from_item(index: usize, item: &Item) -> Result<Self, RateLimitError> {
        let name = item_name(index, item)?;
        let params = Params { name: &name, item };
        Ok(Limit {
            remaining: params.required_u64("r")?,
            reset: params.seconds("t")?,
            partition_key: params.bytes("pk")?,
            name,
        })
    }
}

/// Parses one `RateLimit-Policy` field value.
pub fn parse_policies(value: impl AsRef<[u8]>) -> Result<Vec<Policy>, RateLimitError> {
    parse_items(value.as_ref(), Policy::from_item)
}

/// Parses one `RateLimit` field value.
pub fn parse_limits(value: impl AsRef<[u8]>) -> Result<Vec<Limit>, RateLimitError> {
    parse_items(value.as_ref(), Limit::from_item)
}

/// Parses every `RateLimit-Policy` field line of `headers` as one list.
///
/// No field is an empty list, not an error.
pub fn policies(headers: &HeaderMap) -> Result<Vec<Policy>, RateLimitError> {
    parse_policies(combined(headers, RATELIMIT_POLICY))
}

/// Parses every `RateLimit` field line of `headers` as one list.
///
/// No field is an empty list, not an error.
pub fn limits(headers: &HeaderMap) -> Result<Vec<Limit>, RateLimitError> {
    parse_limits(combined(headers, RATELIMIT))
}

/// RFC 9651 section 4.2: a list split over several field lines is their comma-joined values
/// (an empty line adds nothing, wherever it comes).
fn combined(headers: &HeaderMap, name: &str) -> Vec<u8> {
    let mut joined = Vec::new();
    for value in headers.get_all(name) {
        if value.as_bytes().trim_ascii().is_empty() {
            continue;
        }
        if !joined.is_empty() {
            joined.extend_from_slice(b", ");
        }
        joined.extend_from_slice(value.as_bytes());
    }
    joined
}

fn parse_items<T>(
    value: &[u8],
    member: impl Fn(usize, &Item) -> Result<T, RateLimitError>,
) -> Result<Vec<T>, RateLimitError> {
    if !value.is_ascii() {
        return Err(RateLimitError::NotAscii);
    }
    let list: List = Parser::new(value).parse().map_err(RateLimitError::Syntax)?;
    list.iter()
        .enumerate()
        .map(|(index, entry)| match entry {
            ListEntry::Item(item) => member(index, item),
            ListEntry::InnerList(_) => Err(RateLimitError::InnerList { index }),
        })
        .collect()
}

fn item_name(index: usize, item: &Item) -> Result<String, RateLimitError> {
    match &item.bare_item {
        BareItem::String(name) => Ok(name.as_str().to_owned()),
        _ => Err(RateLimitError::NameNotString { index }),
    }
}

/// Typed access to one item's parameters, naming the policy in errors.
struct Params<'a> {
    name: &'a str,
    item: &'a Item,
}

impl Params<'_> {
    fn get(&self, key: &str) -> Option<&BareItem> {
        self.item
            .params
            .iter()
            .find_map(|(k, v)| (k.as_str() == key).then_some(v))
    }

    fn bad(&self, param: &'static str) -> RateLimitError {
        RateLimitError::BadParam {
            name: self.name.to_owned(),
            param,
        }
    }

    fn u64(&self, param: &'static str) -> Result<Option<u64>, RateLimitError> {
        let Some(value) = self.get(param) else {
            return Ok(None);
        };
        let int = value.as_integer().ok_or_else(|| self.bad(param))?;
        u64::try_from(i64::from(int))
            .map(Some)
            .map_err(|_| self.bad(param))
    }

    fn required_u64(&self, param: &'static str) -> Result<u64, RateLimitError> {
        self.u64(param)?
            .ok_or_else(|| RateLimitError::MissingParam {
                name: self.name.to_owned(),
                param,
            })
    }

    fn seconds(&self, param: &'static str) -> Result<Option<Duration>, RateLimitError> {
        Ok(self.u64(param)?.map(Duration::from_secs))
    }

    /// A window: seconds, and not zero (draft section 3.1: "a non-negative, non-zero" integer;
    /// a client dividing a quota by it must not be handed zero).
    fn window(&self, param: &'static str) -> Result<Option<Duration>, RateLimitError> {
        match self.seconds(param)? {
            Some(w) if w.is_zero() => Err(self.bad(param)),
            w => Ok(w),
        }
    }

    fn string(&self, param: &'static str) -> Result<Option<String>, RateLimitError> {
        self.get(param)
            .map(|v| match v {
                BareItem::String(s) => Ok(s.as_str().to_owned()),
                _ => Err(self.bad(param)),
            })
            .transpose()
    }

    fn bytes(&self, param: &'static str) -> Result<Option<Vec<u8>>, RateLimitError> {
        self.get(param)
            .map(|v| match v {
                BareItem::ByteSequence(b) => Ok(b.clone()),
                _ => Err(self.bad(param)),
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn secs(s: u64) -> Option<Duration> {
        Some(Duration::from_secs(s))
    }

    fn policy(name: &str, quota: u64, window: Option<Duration>) -> Policy {
        Policy {
            name: name.into(),
            quota,
            window,
            unit: None,
            partition_key: None,
        }
    }

    fn limit(name: &str, remaining: u64, reset: Option<Duration>) -> Limit {
        Limit {
            name: name.into(),
            remaining,
            reset,
            partition_key: None,
        }
    }

    #[test]
    fn an_empty_field_line_adds_nothing_wherever_it_comes() {
        for lines in [["\"a\";r=1", ""], ["", "\"a\";r=1"]] {
            let mut h = HeaderMap::new();
            for line in lines {
                h.append(RATELIMIT, http::HeaderValue::from_static(line));
            }
            assert_eq!(limits(&h).unwrap(), [limit("a", 1, None)], "{lines:?}");
        }
    }

    #[test]
    fn sluice_policy_field_parses_into_policies() {
        let parsed = parse_policies(r#""per-ip";q=40;w=2, "key-quota";q=1000;w=3600"#).unwrap();
        assert_eq!(
            parsed,
            [
                policy("per-ip", 40, secs(2)),
                policy("key-quota", 1000, secs(3600))
            ]
        );
    }

    #[test]
    fn sluice_ratelimit_field_parses_into_limits() {
        let parsed = parse_limits(r#""per-ip";r=31;t=1, "key-quota";r=997;t=2113"#).unwrap();
        assert_eq!(
            parsed,
            [
                limit("per-ip", 31, secs(1)),
                limit("key-quota", 997, secs(2113))
            ]
        );
    }

    #[test]
    fn concurrency_policy_without_window_or_reset_has_none() {
        let p = parse_policies(r#""in-flight";q=64;qu="concurrency""#).unwrap();
        assert_eq!(p[0].window, None);
        assert_eq!(p[0].unit.as_deref(), Some("concurrency"));
        let l = parse_limits(r#""in-flight";r=3"#).unwrap();
        assert_eq!(l, [limit("in-flight", 3, None)]);
    }

    #[test]
    fn unknown_parameters_are_ignored() {
        let p = parse_policies(r#""burst";q=100;w=60;x-vendor=?1;zz="hi""#).unwrap();
        assert_eq!(p, [policy("burst", 100, secs(60))]);
    }

    #[test]
    fn partition_key_is_read_as_bytes() {
        let l = parse_limits(r#""burst";r=5;pk=:AQID:"#).unwrap();
        assert_eq!(l[0].partition_key.as_deref(), Some(&[1u8, 2, 3][..]));
    }

    #[test]
    fn missing_quota_is_an_error() {
        let err = parse_policies(r#""burst";w=60"#).unwrap_err();
        assert!(
            matches!(err, RateLimitError::MissingParam { param: "q", .. }),
            "{err}"
        );
        let err = parse_limits(r#""burst";t=60"#).unwrap_err();
        assert!(
            matches!(err, RateLimitError::MissingParam { param: "r", .. }),
            "{err}"
        );
    }

    #[test]
    fn negative_or_non_integer_parameters_are_errors() {
        for bad in [
            r#""b";q=-1"#,
            r#""b";q=1.5"#,
            r#""b";q="10""#,
            r#""b";q=10;w=-60"#,
            r#""b";q=10;w=0"#, // review: a window of zero was accepted
            r#""b";q=10;w=?1"#,
            r#""b";q=10;qu=request"#,
            r#""b";q=10;pk="text""#,
        ] {
            let err = parse_policies(bad).unwrap_err();
            assert!(
                matches!(err, RateLimitError::BadParam { .. }),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn token_or_integer_names_are_errors() {
        let err = parse_policies("burst;q=10").unwrap_err();
        assert!(
            matches!(err, RateLimitError::NameNotString { index: 0 }),
            "{err}"
        );
        let err = parse_limits(r#""a";r=1, 7;r=1"#).unwrap_err();
        assert!(
            matches!(err, RateLimitError::NameNotString { index: 1 }),
            "{err}"
        );
    }

    #[test]
    fn inner_list_member_is_an_error() {
        let err = parse_policies(r#"("a" "b");q=1"#).unwrap_err();
        assert!(
            matches!(err, RateLimitError::InnerList { index: 0 }),
            "{err}"
        );
    }

    #[test]
    fn malformed_syntax_is_an_error_not_a_panic() {
        for bad in [
            r#""unterminated;q=1"#,
            r#""a";q=1,"#,
            r#""a";Q=1"#,
            r#""a";q=99999999999999999999"#,
            "limit=100, remaining=50, reset=30;;",
            "\"a\";q=1 \"b\"",
        ] {
            let err = parse_policies(bad).unwrap_err();
            assert!(matches!(err, RateLimitError::Syntax(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn non_ascii_bytes_are_an_error() {
        let value = HeaderValue::from_bytes(b"\"\xe9\";q=1").unwrap();
        assert!(matches!(
            parse_policies(&value),
            Err(RateLimitError::NotAscii)
        ));
    }

    #[test]
    fn empty_field_is_an_empty_list() {
        assert_eq!(parse_limits("").unwrap(), []);
        assert_eq!(limits(&HeaderMap::new()).unwrap(), []);
    }

    #[test]
    fn field_lines_are_joined_into_one_list() {
        let mut headers = HeaderMap::new();
        headers.append(
            RATELIMIT_POLICY,
            HeaderValue::from_static(r#""per-ip";q=40;w=2"#),
        );
        headers.append(
            RATELIMIT_POLICY,
            HeaderValue::from_static(r#""key-quota";q=5;w=60"#),
        );
        headers.insert(
            RATELIMIT,
            HeaderValue::from_static(r#""key-quota";r=0;t=42"#),
        );
        let names: Vec<_> = policies(&headers)
            .unwrap()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(names, ["per-ip", "key-quota"]);
        assert_eq!(limits(&headers).unwrap(), [limit("key-quota", 0, secs(42))]);
    }
}
