//! Drives a request through a [`RetryPolicy`], sleeping on tokio's clock between attempts.

use std::future::Future;
use std::time::SystemTime;

use http::{Method, Response};
use rand::Rng;

use crate::retry::{Attempt, Decision, RetryPolicy, StopReason};

/// The response a retry loop ended with, and why it ended.
#[derive(Debug)]
pub struct Outcome<B> {
    /// The last response received.
    pub response: Response<B>,
    /// How many requests were sent, first one included.
    pub attempts: u32,
    /// Why no further request was sent.
    pub stop: StopReason,
}

/// Sends a request with `send`, and sends it again while `policy` says to, sleeping in between.
///
/// `send` builds and sends the request afresh on each call. A transport error ends the loop at
/// once and is returned: only a throttling response says how long to wait. The total time is
/// measured with `tokio::time::Instant` and waits use `tokio::time::sleep`, so tests can pause
/// and advance time. `Retry-After` dates are read against `SystemTime::now()`.
///
/// `method` must be the method of the request `send` sends: the policy sends a request again
/// only if its method is idempotent (unless [`RetryPolicy::retry_non_idempotent`] opts in).
/// Nothing ties the two together, so build the request's method from the same value.
///
/// `rng` draws the backoff when a refusal has no usable `Retry-After`, and the spread of one it
/// has: pass a seeded `rand::rngs::StdRng` in tests, and `StdRng::from_entropy()` (which is
/// `Send`) in services.
///
/// Only the response's headers are read: a problem body's `retry_after` is not (the body is
/// the caller's, of any type), so a refusal whose `Retry-After` a proxy stripped is backed off.
/// A 429 or 503 the upstream itself sent through the gateway is retried like the gateway's
/// own: with [`RetryPolicy::retry_non_idempotent`], a `POST` the upstream refused after acting
/// on part of it is sent again.
///
/// # Panics
///
/// When it sleeps, in a tokio runtime built without timers (`enable_time`): the first
/// refusal, not the first request, finds that out.
pub async fn send_with_retry<F, Fut, B, E, R>(
    policy: &RetryPolicy,
    method: &Method,
    rng: &mut R,
    mut send: F,
) -> Result<Outcome<B>, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Response<B>, E>>,
    R: Rng + ?Sized,
{
    let start = tokio::time::Instant::now();
    let mut attempts = 0u32;
    loop {
        let response = send().await?;
        attempts = attempts.saturating_add(1);
        let attempt = Attempt {
            number: attempts,
            method,
            status: response.status(),
            headers: response.headers(),
            elapsed: start.elapsed(),
            now: SystemTime::now(),
        };
        match policy.decide(&attempt, rng) {
            Decision::Retry(wait) => {
                // Release the refused response (and its connection) before sleeping.
                drop(response);
                tokio::time::sleep(wait).await;
            }
            Decision::Stop(stop) => {
                return Ok(Outcome {
                    response,
                    attempts,
                    stop,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backoff;
    use http::StatusCode;
    use rand::{rngs::StdRng, SeedableRng};
    use std::num::NonZeroU32;
    use std::time::Duration;
    use tokio::time::Instant;

    fn response(status: u16, retry_after: Option<&str>) -> Response<()> {
        let mut b = Response::builder().status(status);
        if let Some(v) = retry_after {
            b = b.header("retry-after", v);
        }
        b.body(()).unwrap()
    }

    fn policy(attempts: u32, budget_secs: u64) -> RetryPolicy {
        let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5)).unwrap();
        RetryPolicy::new(
            NonZeroU32::new(attempts).unwrap(),
            Duration::from_secs(budget_secs),
            backoff,
        )
    }

    /// What a run of [`send_with_retry`] did: its result, requests sent, paused time spent.
    struct Run {
        result: Result<Outcome<()>, &'static str>,
        sent: u32,
        elapsed: Duration,
    }

    async fn run(
        policy: RetryPolicy,
        method: Method,
        mut reply: impl FnMut() -> Result<Response<()>, &'static str>,
    ) -> Run {
        let start = Instant::now();
        let mut sent = 0;
        let mut rng = StdRng::seed_from_u64(9);
        let result = send_with_retry(&policy, &method, &mut rng, || {
            sent += 1;
            let r = reply();
            async move { r }
        })
        .await;
        Run {
            result,
            sent,
            elapsed: start.elapsed(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn sleeps_retry_after_then_returns_the_success() {
        let mut replies = vec![response(200, None), response(503, Some("3"))];
        let run = run(policy(5, 60), Method::GET, || Ok(replies.pop().unwrap())).await;
        let out = run.result.unwrap();
        assert_eq!(out.response.status(), StatusCode::OK);
        assert_eq!((out.attempts, run.sent), (2, 2));
        assert_eq!(out.stop, StopReason::Final(StatusCode::OK));
        // The 3 s asked, and at most the policy's spread of 1 s more.
        let asked = Duration::from_secs(3);
        assert!(
            (asked..=asked * 4 / 3).contains(&run.elapsed),
            "{:?}",
            run.elapsed
        );
    }

    #[tokio::test(start_paused = true)]
    async fn over_budget_returns_the_refusal_without_sleeping() {
        let run = run(policy(5, 30), Method::GET, || Ok(response(429, Some("60")))).await;
        let out = run.result.unwrap();
        assert_eq!(out.response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(out.attempts, 1);
        assert!(matches!(out.stop, StopReason::OverBudget { .. }));
        assert_eq!(run.elapsed, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn attempts_cap_bounds_the_requests_sent() {
        let run = run(policy(4, 600), Method::GET, || Ok(response(503, None))).await;
        let out = run.result.unwrap();
        assert_eq!((run.sent, out.attempts), (4, 4));
        assert_eq!(out.stop, StopReason::AttemptsExhausted);
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_waits_stay_under_their_ceilings_in_total() {
        // 4 attempts, 3 backoff waits with ceilings 100 + 200 + 400 ms.
        let run = run(policy(4, 600), Method::GET, || Ok(response(429, None))).await;
        assert!(
            run.elapsed <= Duration::from_millis(700),
            "{:?}",
            run.elapsed
        );
    }

    #[tokio::test(start_paused = true)]
    async fn post_is_sent_once() {
        let run = run(policy(5, 60), Method::POST, || Ok(response(429, Some("1")))).await;
        assert_eq!(run.sent, 1);
        assert_eq!(run.result.unwrap().stop, StopReason::NotIdempotent);
    }

    #[tokio::test(start_paused = true)]
    async fn transport_error_is_returned_at_once() {
        let run = run(policy(5, 60), Method::GET, || Err("connection refused")).await;
        assert_eq!(run.result.unwrap_err(), "connection refused");
        assert_eq!(run.sent, 1);
    }
}
