//! Client helpers for APIs behind sluice (or any throttle that keeps the same contract).
//!
//! A throttled API answers `429 Too Many Requests` when the caller has spent its own quota and
//! `503 Service Unavailable` when the server is full, both with `Retry-After` and a problem
//! details body. This crate reads those answers and retries the way they ask:
//!
//! - [`retry_after`]: `Retry-After` as delay-seconds or an HTTP-date. Anything else (`1.5`, `-3`,
//!   empty, garbage) is absent, never a wait of zero.
//! - [`parse_policies`] / [`parse_limits`] (and [`policies`] / [`limits`] over a `HeaderMap`):
//!   the `RateLimit-Policy` and `RateLimit` Structured Fields of
//!   draft-ietf-httpapi-ratelimit-headers (revision 11), into [`Policy`] and [`Limit`].
//! - [`Problem`]: the problem details body, with `policy` and `retry_after`.
//! - [`RetryPolicy`]: the retry decision without I/O. It waits `Retry-After` on 429 and 503, else
//!   until a spent `RateLimit` limit resets (spreading either over up to a second after it, so
//!   callers told the same moment do not all come back in it), else a full-jitter [`Backoff`]
//!   draw; honours a zero wait once only; caps attempts and total time; and retries only
//!   idempotent methods unless told otherwise.
//! - [`send_with_retry`]: drives any `FnMut() -> Future<Output = Result<Response<B>, E>>`
//!   through a [`RetryPolicy`], sleeping with `tokio::time::sleep`.
//!
//! # Example
//!
//! ```
//! use std::num::NonZeroU32;
//! use std::time::{Duration, SystemTime};
//!
//! use http::{Method, Response};
//! use rand::{rngs::StdRng, SeedableRng};
//! use sluice_client::{limits, retry_after, send_with_retry, Backoff, Problem, RetryPolicy};
//!
//! // Reading one refusal by hand.
//! assert_eq!(retry_after("42", SystemTime::now()), Some(Duration::from_secs(42)));
//! assert_eq!(retry_after("1.5", SystemTime::now()), None); // absent, not zero
//! let problem = Problem::from_slice(br#"{"status":429,"policy":"key-quota","retry_after":42}"#)?;
//! assert_eq!(problem.policy.as_deref(), Some("key-quota"));
//!
//! // Letting the policy drive a request: at most 3 attempts and 30 s in all.
//! let policy = RetryPolicy::new(
//!     NonZeroU32::new(3).unwrap(),
//!     Duration::from_secs(30),
//!     Backoff::new(Duration::from_millis(100), Duration::from_secs(5))?,
//! );
//! let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
//! let outcome = rt.block_on(send_with_retry(
//!     &policy,
//!     &Method::GET,
//!     &mut StdRng::from_entropy(),
//!     // In real code: build the request and send it with your HTTP client.
//!     || async {
//!         let response = Response::builder()
//!             .status(200)
//!             .header("ratelimit", r#""key-quota";r=4;t=42"#)
//!             .body(())?;
//!         Ok::<_, http::Error>(response)
//!     },
//! ))?;
//! assert_eq!(outcome.attempts, 1);
//! let left = limits(outcome.response.headers())?;
//! assert_eq!(left[0].remaining, 4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backoff;
mod date;
mod drive;
mod problem;
mod ratelimit;
mod retry;
mod retry_after;

pub use backoff::{Backoff, BackoffError};
pub use drive::{send_with_retry, Outcome};
pub use problem::{Problem, ProblemError, PROBLEM_JSON};
pub use ratelimit::{
    limits, parse_limits, parse_policies, policies, Limit, Policy, RateLimitError, RATELIMIT,
    RATELIMIT_POLICY,
};
pub use retry::{Attempt, Decision, RetryPolicy, StopReason};
pub use retry_after::{retry_after, retry_after_header};
