//! The seed's agent story: an agent whose quota is spent retries on its own, ten attempts at
//! most. Without Retry-After it sends ten requests in no time and gives up a minute before its
//! quota would let it through; honouring Retry-After it sends two and the second is admitted.
//!
//! The API is a fake in the test (a closure over a quota window that reopens after 60 s) and
//! time is tokio's paused clock: nothing sleeps for real.

use std::cell::Cell;
use std::convert::Infallible;
use std::num::NonZeroU32;
use std::time::Duration;

use http::{Method, Response, StatusCode};
use rand::{rngs::StdRng, SeedableRng};
use sluice_client::{send_with_retry, Backoff, Outcome, Problem, RetryPolicy, StopReason};
use tokio::time::Instant;

const WINDOW_RESETS_IN: Duration = Duration::from_secs(60);

/// A key whose quota is spent until `opens_at`, refused with sluice's 429.
struct SpentQuota {
    opens_at: Instant,
    sends_retry_after: bool,
    requests: Cell<u32>,
}

impl SpentQuota {
    fn new(sends_retry_after: bool) -> Self {
        SpentQuota {
            opens_at: Instant::now() + WINDOW_RESETS_IN,
            sends_retry_after,
            requests: Cell::new(0),
        }
    }

    fn handle(&self) -> Response<Vec<u8>> {
        self.requests.set(self.requests.get() + 1);
        let now = Instant::now();
        if now >= self.opens_at {
            return Response::new(b"ok".to_vec());
        }
        let wait = (self.opens_at - now).as_secs_f64().ceil() as u64;
        let body = format!(
            r#"{{"type":"https://api.example.com/problems/quota-exceeded","title":"Your key has used its quota for this window","status":429,"detail":"5 of 5 requests used in a 60 s window.","policy":"key-quota","quota":5,"window":60,"retry_after":{wait}}}"#
        );
        let mut b = Response::builder()
            .status(429)
            .header("content-type", "application/problem+json");
        if self.sends_retry_after {
            b = b.header("retry-after", wait.to_string());
        }
        b.body(body.into_bytes()).unwrap()
    }
}

fn ten_attempts(budget: Duration, backoff: Backoff) -> RetryPolicy {
    RetryPolicy::new(NonZeroU32::new(10).unwrap(), budget, backoff)
}

/// Lets `policy` drive GET requests to `api`; returns the outcome and the paused time spent.
async fn agent(api: &SpentQuota, policy: RetryPolicy) -> (Outcome<Vec<u8>>, Duration) {
    let start = Instant::now();
    let out = send_with_retry(&policy, &Method::GET, &mut StdRng::seed_from_u64(5), || {
        let r = api.handle();
        async move { Ok::<_, Infallible>(r) }
    })
    .await
    .unwrap();
    (out, start.elapsed())
}

#[tokio::test(start_paused = true)]
async fn agent_without_retry_after_sends_ten_requests_in_no_time() {
    // The seed's naive agent: nothing to wait for, so it retries at once.
    let api = SpentQuota::new(false);
    let start = Instant::now();
    let mut last = api.handle();
    while last.status() == StatusCode::TOO_MANY_REQUESTS && api.requests.get() < 10 {
        last = api.handle();
    }
    assert_eq!(api.requests.get(), 10);
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(last.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(start_paused = true)]
async fn agent_honouring_retry_after_sends_two_requests_and_the_second_is_admitted() {
    let api = SpentQuota::new(true);
    let (out, elapsed) = agent(
        &api,
        ten_attempts(Duration::from_secs(120), Backoff::default()),
    )
    .await;
    assert_eq!(out.attempts, 2);
    assert_eq!(api.requests.get(), 2);
    assert_eq!(out.response.status(), StatusCode::OK);
    assert_eq!(out.stop, StopReason::Final(StatusCode::OK));
    // The wait asked, and at most the policy's spread of a second more.
    let spread = Duration::from_secs(1);
    assert!(
        (WINDOW_RESETS_IN..=WINDOW_RESETS_IN + spread).contains(&elapsed),
        "{elapsed:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn agent_with_a_30_s_budget_keeps_the_refusal_and_its_problem_body() {
    let api = SpentQuota::new(true);
    let (out, elapsed) = agent(
        &api,
        ten_attempts(Duration::from_secs(30), Backoff::default()),
    )
    .await;
    assert_eq!(out.attempts, 1);
    assert_eq!(elapsed, Duration::ZERO, "gave up instead of sleeping");
    let problem = Problem::from_slice(out.response.body()).unwrap();
    assert_eq!(problem.policy.as_deref(), Some("key-quota"));
    assert_eq!(problem.retry_after, Some(WINDOW_RESETS_IN));
}

#[tokio::test(start_paused = true)]
async fn agent_using_the_policy_without_retry_after_backs_off_instead_of_hammering() {
    // Same server as the naive agent's; the policy's backoff spreads the attempts out.
    let api = SpentQuota::new(false);
    let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30)).unwrap();
    let (out, elapsed) = agent(&api, ten_attempts(Duration::from_secs(600), backoff)).await;
    assert!(out.attempts <= 10);
    assert_eq!(api.requests.get(), out.attempts);
    assert!(elapsed > Duration::ZERO);
    // At most nine waits, with ceilings 1, 2, 4, 8, 16, 30, 30, 30, 30 s.
    assert!(elapsed <= Duration::from_secs(151), "{elapsed:?}");
}
