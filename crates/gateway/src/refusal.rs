//! The words of a 429: which limit refused, in plain language, with the figures an agent
//! needs to choose between waiting and failing.

use http::StatusCode;
use sluice_config::{Algorithm, KeyPart};
use sluice_limiter::RefusalReason;

use crate::advertise::ceil_secs;
use crate::problem::{Member, Problem};
use crate::quota::{LimitInfo, Refused};

/// Whose quota a limit counts, for the title.
#[derive(Debug, Clone, Copy)]
enum Scope {
    Key,
    Ip,
    RouteForKey,
    RouteForIp,
    Route,
    Global,
    Other,
}

fn scope(info: &LimitInfo) -> Scope {
    let by = &info.config.by;
    // Per-route when the route is part of the key; a per-key limit that only some routes
    // carry is still the key's quota.
    let per_route = by.contains(&KeyPart::Route);
    let (key, ip) = (by.contains(&KeyPart::ApiKey), by.contains(&KeyPart::Ip));
    match (per_route, key, ip) {
        (true, true, _) => Scope::RouteForKey,
        (true, false, true) => Scope::RouteForIp,
        (true, false, false) => Scope::Route,
        (false, true, _) => Scope::Key,
        (false, false, true) => Scope::Ip,
        _ if by == &[KeyPart::Global] => Scope::Global,
        _ => Scope::Other,
    }
}

/// The 429 for a refusal by limit `info`, whose figures are `report`.
pub(crate) fn quota_exceeded(info: &LimitInfo, refused: &Refused, cost: u32) -> Problem {
    let report = refused
        .reports
        .iter()
        .find(|(id, _)| *id == refused.limit)
        .map(|(_, r)| r);
    let limit = &info.config;
    let quota = report.map_or(limit.quota.get(), |r| r.quota);
    let window = report.and_then(|r| r.window).or(limit.window);
    let remaining = report.map_or(0, |r| r.remaining);
    let retry_after = refused.wait.map_or(1, ceil_secs).max(1);
    let secs = window.map(ceil_secs);
    let used = quota - remaining;
    let (title, detail) = match (refused.reason, limit.algorithm) {
        (RefusalReason::Blocked { .. }, _) => (
            blocked_title(info),
            Sentence::new()
                .text("Blocked by policy ")
                .text(&info.name)
                .text(" for exceeding it; the block ends in ")
                .number(retry_after)
                .text(" s.")
                .0,
        ),
        (_, Algorithm::Concurrency) => (
            "Too many of your requests are in progress",
            Sentence::new()
                .number(used)
                .text(" of ")
                .number(quota)
                .text(" concurrent requests are in progress.")
                .0,
        ),
        (_, Algorithm::TokenBucket { .. }) => (
            title_for_now(info),
            Sentence::new()
                .number(used)
                .text(" of ")
                .number(quota)
                .text(" requests used; the bucket refills ")
                .number(limit.quota.get())
                .text(" per ")
                .number(limit.window.map_or(0, ceil_secs))
                .text(" s.")
                .costs(cost, remaining)
                .0,
        ),
        (_, Algorithm::FixedWindow | Algorithm::SlidingWindow) => (
            title_for_window(info),
            Sentence::new()
                .number(used)
                .text(" of ")
                .number(quota)
                .text(" requests used in a ")
                .number(secs.unwrap_or(0))
                .text(" s window.")
                .costs(cost, remaining)
                .0,
        ),
    };
    // The refusal that starts a block says so: its wait is the block's, not the counters'.
    let detail = match (refused.reason, limit.block_for) {
        (RefusalReason::Exhausted, Some(_)) if !refused.no_room => {
            Sentence(detail)
                .text(" Exceeding it blocks you; the block ends in ")
                .number(retry_after)
                .text(" s.")
                .0
        }
        _ => detail,
    };
    let mut p = Problem::new(
        StatusCode::TOO_MANY_REQUESTS,
        "quota-exceeded",
        title,
        detail,
    );
    p.retry_after = Some(retry_after);
    p.extra.push(("policy", Member::Name(info.name.clone())));
    p.extra.push(("quota", Member::Number(quota.into())));
    if let Some(w) = secs {
        p.extra.push(("window", Member::Number(w)));
    }
    p
}

/// A detail sentence written piece by piece: `format!`'s machinery cost about 1,000
/// instructions per 429 (callgrind), and refusals are the hot path of a caller hammering past
/// its quota.
struct Sentence(String);

impl Sentence {
    fn new() -> Self {
        Sentence(String::with_capacity(128))
    }

    fn text(mut self, text: &str) -> Self {
        self.0.push_str(text);
        self
    }

    fn number(mut self, n: impl itoa::Integer) -> Self {
        self.0.push_str(itoa::Buffer::new().format(n));
        self
    }

    /// What a request that costs more than one adds.
    fn costs(self, cost: u32, remaining: u32) -> Self {
        if cost <= 1 {
            return self;
        }
        self.text(" This request costs ")
            .number(cost)
            .text("; ")
            .number(remaining)
            .text(" remain.")
    }
}

fn title_for_window(info: &LimitInfo) -> &'static str {
    match scope(info) {
        Scope::Key => "Your key has used its quota for this window",
        Scope::Ip => "Your IP address has used its quota for this window",
        Scope::RouteForKey => "Your key has used its quota for this route in this window",
        Scope::RouteForIp => "Your IP address has used its quota for this route in this window",
        Scope::Route => "The quota for this route is used up for this window",
        Scope::Global => "The shared quota of this API is used up for this window",
        Scope::Other => "Your quota is used up for this window",
    }
}

fn title_for_now(info: &LimitInfo) -> &'static str {
    match scope(info) {
        Scope::Key => "Your key is sending requests faster than its rate limit",
        Scope::Ip => "Your IP address is sending requests faster than its rate limit",
        Scope::RouteForKey => "Your key is calling this route faster than its rate limit",
        Scope::RouteForIp => "Your IP address is calling this route faster than its rate limit",
        Scope::Route => "Requests to this route are coming faster than its rate limit",
        Scope::Global => "This API is receiving requests faster than its shared rate limit",
        Scope::Other => "Requests are coming faster than the rate limit",
    }
}

fn blocked_title(info: &LimitInfo) -> &'static str {
    match scope(info) {
        Scope::Key | Scope::RouteForKey => "Your key is blocked for exceeding its quota",
        Scope::Ip | Scope::RouteForIp => "Your IP address is blocked for exceeding its quota",
        _ => "You are blocked for exceeding a quota",
    }
}

#[cfg(test)]
mod tests {
    use super::Sentence;

    #[test]
    fn a_sentence_is_its_pieces_in_order_and_costs_only_above_one() {
        let s = |cost| {
            Sentence::new()
                .number(3_u32)
                .text(" of ")
                .number(u64::MAX)
                .text(" used.")
                .costs(cost, 7)
                .0
        };
        assert_eq!(s(1), "3 of 18446744073709551615 used.");
        assert_eq!(s(0), "3 of 18446744073709551615 used.");
        assert_eq!(
            s(5),
            "3 of 18446744073709551615 used. This request costs 5; 7 remain."
        );
    }
}
