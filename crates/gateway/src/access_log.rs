//! The access log: one line per request, written when the response body ends or the client
//! goes away (so `total_ms` covers the whole exchange), through `tracing` target `access`.

use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderValue, Method, StatusCode, Uri};
use tokio::time::Instant;

use crate::quota::{Outcome, Quota};

/// What the access-log line will say about one request. Logged on drop.
#[derive(Debug)]
pub(crate) struct AccessLog {
    method: Method,
    /// The path only: a query string may carry an API key.
    uri: Uri,
    client: IpAddr,
    request_id: HeaderValue,
    route: Option<Arc<str>>,
    key: Option<String>,
    decision: Option<&'static str>,
    policy: Option<Arc<str>>,
    status: Option<StatusCode>,
    start: Instant,
    upstream_ms: Option<f64>,
    bytes: u64,
    body_failed: bool,
}

impl AccessLog {
    pub(crate) fn start(method: Method, uri: Uri, client: IpAddr, request_id: HeaderValue) -> Self {
        Self {
            method,
            uri,
            client,
            request_id,
            route: None,
            key: None,
            decision: None,
            policy: None,
            status: None,
            start: Instant::now(),
            upstream_ms: None,
            bytes: 0,
            body_failed: false,
        }
    }

    pub(crate) fn route(&mut self, name: Arc<str>) {
        self.route = Some(name);
    }

    /// The client as identified (behind trusted proxies, not the TCP peer).
    pub(crate) fn client(&mut self, ip: IpAddr) {
        self.client = ip;
    }

    /// A fingerprint of the API key: raw keys never reach logs.
    pub(crate) fn key(&mut self, fingerprint: String) {
        self.key = Some(fingerprint);
    }

    /// The limiter's verdict, nginx-style, with the policy it concerns.
    pub(crate) fn outcome(&mut self, outcome: Outcome, quota: &Quota) {
        let (word, policy) = match outcome {
            Outcome::Passed => ("PASSED", None),
            Outcome::Delayed => ("DELAYED", None),
            Outcome::Rejected(id) => ("REJECTED", Some(id)),
            Outcome::RejectedDryRun(id) => ("REJECTED_DRY_RUN", Some(id)),
            Outcome::Overloaded => ("OVERLOADED", None),
        };
        self.decision = Some(word);
        self.policy = match (outcome, policy) {
            (Outcome::Overloaded, _) => Some(Arc::from("server-capacity")),
            (_, Some(id)) => Some(quota.info(id).name.clone()),
            _ => None,
        };
    }

    pub(crate) fn status(&mut self, status: StatusCode) {
        self.status = Some(status);
    }

    /// Marks the moment the upstream's response head arrived.
    pub(crate) fn upstream_done(&mut self) {
        self.upstream_ms = Some(ms_since(self.start));
    }

    pub(crate) fn add_bytes(&mut self, n: usize) {
        self.bytes += n as u64;
    }

    pub(crate) fn upstream_body_failed(&mut self) {
        self.body_failed = true;
    }
}

/// Whether access-log lines are written at all (level `info` for target `access`).
pub(crate) fn enabled() -> bool {
    tracing::enabled!(target: "access", tracing::Level::INFO)
}

fn ms_since(start: Instant) -> f64 {
    (start.elapsed().as_micros() as f64) / 1000.0
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        // 499: the client went away before a response head was sent (nginx's convention).
        let status = self.status.map_or(499, |s| s.as_u16());
        tracing::info!(
            target: "access",
            method = %self.method,
            path = self.uri.path(),
            route = self.route.as_deref().unwrap_or("-"),
            key = self.key.as_deref(),
            decision = self.decision,
            policy = self.policy.as_deref(),
            status,
            client = %self.client,
            request_id = self.request_id.to_str().unwrap_or("-"),
            upstream_ms = self.upstream_ms,
            total_ms = ms_since(self.start),
            bytes = self.bytes,
            body_failed = self.body_failed,
            "request"
        );
    }
}
