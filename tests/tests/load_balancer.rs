//! sluice behind a real HAProxy: a spent quota (429) never costs the instance its place in the
//! pool; a full gateway (503, readiness failing) is taken out by both the passive rule
//! (consecutive 5xx, like Envoy's outlier detection) and the active one (a readiness probe),
//! and comes back when the load clears, with every caller's quota intact. Liveness stays up.
//! A stop with `drain_delay` is seen as a failing readiness check before the port closes.

use std::time::Duration;

use sluice_tests::haproxy::{Backend, HaProxy};
use sluice_tests::{get, MockUpstream, Reply, Sluice};

fn config(upstream: &str) -> String {
    format!(
        r#"
[gateway]
listen = "127.0.0.1:0"
max_in_flight = 3

[admin]
listen = "127.0.0.1:0"

[responses]
problem_base = "https://api.example.com/problems/"

[upstreams.app]
url = "{upstream}"

[[routes]]
name = "api"
path = "/"
upstream = "app"

[[limits]]
name = "key-quota"
by = "api_key"
algorithm = "fixed_window"
quota = 5
window = "1h"
"#
    )
}

/// Three views of the same instance: passive 5xx counting (active checks every 2 s, so the
/// passive rule acts first), an active readiness probe, and a liveness probe. (HAProxy spreads
/// the first checks of all servers over the longest `inter`, so none is very long.)
fn backends() -> Vec<Backend> {
    vec![
        Backend {
            name: "passive",
            check: "option httpchk GET /ready".into(),
            server_options: "inter 2s downinter 100ms rise 2 fall 2 observe layer7 error-limit 5 on-error mark-down".into(),
        },
        Backend { name: "active", check: "option httpchk GET /ready".into(), server_options: "inter 100ms rise 2 fall 2".into() },
        Backend { name: "live", check: "option httpchk GET /live".into(), server_options: "inter 100ms rise 2 fall 2".into() },
    ]
}

async fn via(lb: &HaProxy, backend: &str, key: &str) -> Reply {
    get(lb.frontend(backend), "/v1/items", &[("x-api-key", key)]).await
}

const WITHIN: Duration = Duration::from_secs(5);

#[tokio::test]
async fn spent_quota_gets_429s_and_the_balancer_keeps_the_instance_up() {
    let up = MockUpstream::start().await;
    let gw = Sluice::start(&config(&up.url()));
    let lb = HaProxy::start(gw.main, gw.admin.port(), &backends()).await;
    for b in ["passive", "active", "live"] {
        lb.wait_checked(b, WITHIN).await;
    }
    let mut codes = Vec::new();
    for _ in 0..15 {
        let r = via(&lb, "passive", "key_a").await;
        codes.push(r.status.as_u16());
        // Read from HAProxy's own stats, after every answer, not inferred.
        assert_eq!(
            lb.server_status("passive").await.0,
            "UP",
            "a 429 moved HAProxy after {codes:?}"
        );
    }
    assert_eq!(codes, [[200; 5].as_slice(), [429; 10].as_slice()].concat());
    assert_eq!(
        via(&lb, "passive", "key_b").await.status,
        200,
        "other callers are unaffected"
    );
    assert_eq!(lb.server_status("active").await.0, "UP");
}

#[tokio::test]
async fn full_gateway_is_marked_down_by_both_rules_and_up_again_with_quota_intact() {
    let up = MockUpstream::start().await;
    let gw = Sluice::start(&config(&up.url()));
    let lb = HaProxy::start(gw.main, gw.admin.port(), &backends()).await;
    for b in ["passive", "active", "live"] {
        lb.wait_checked(b, WITHIN).await;
    }

    // Three slow requests fill a gateway of capacity 3.
    let main = gw.main;
    let slow: Vec<_> = (0..3)
        .map(|_| tokio::spawn(async move { get(main, "/hold", &[]).await }))
        .collect();
    up.wait_holding(3).await;

    // Passive rule: five 503s in a row through HAProxy mark the server down at once, before
    // its next active check.
    let before = lb.stats("passive").await;
    for _ in 0..5 {
        let r = via(&lb, "passive", "key_a").await;
        assert_eq!(r.status, 503);
        assert!(r
            .header("retry-after")
            .parse::<u64>()
            .is_ok_and(|s| (2..=5).contains(&s)));
        assert_eq!(r.json()["policy"], "server-capacity");
    }
    let passive = lb.stats("passive").await;
    assert!(
        passive["status"].starts_with("DOWN"),
        "five 503s did not mark the server down: {passive:?}"
    );
    // HANA: HAProxy's health analyzer (the observe rule) took it down, not an active check.
    assert_eq!(
        (
            passive["check_status"].as_str(),
            passive["hanafail"].as_str()
        ),
        ("HANA", "1"),
        "{passive:?}"
    );
    assert_eq!(before["hanafail"], "0");
    // Active rule: the readiness probe fails on its own.
    let active = lb.wait_status("active", "DOWN", WITHIN).await;
    assert!(
        active.1.starts_with("L7STS"),
        "the active check failed on /ready's status: {active:?}"
    );
    // Overload is reported on readiness only: liveness stays up.
    assert_eq!(get(gw.admin, "/live", &[]).await.status, 200);
    assert_eq!(lb.server_status("live").await.0, "UP");

    up.release(3);
    for s in slow {
        assert_eq!(s.await.unwrap().status, 200);
    }
    lb.wait_status("active", "UP", WITHIN).await;
    lb.wait_status("passive", "UP", WITHIN).await;
    assert_eq!(
        lb.server_status("live").await.0,
        "UP",
        "liveness never went down"
    );

    // key_a was refused five times, all for capacity, and still has its whole quota.
    let mut codes = Vec::new();
    for _ in 0..6 {
        codes.push(via(&lb, "active", "key_a").await.status.as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 200, 200, 429]);
}

/// A stop with `drain_delay`: the balancer takes the instance out on its readiness check's 503
/// (L7STS) while the instance still serves, not on a refused connection (L4CON, which is what
/// it met when the listener closed at the signal: review), and requests sent meanwhile are
/// answered.
#[tokio::test]
async fn with_a_drain_delay_the_balancer_sees_the_503_before_the_port_closes() {
    let up = MockUpstream::start().await;
    let cfg = config(&up.url()).replace(
        "max_in_flight = 3",
        "max_in_flight = 3\ndrain_delay = \"3s\"\nshutdown_grace = \"5s\"",
    );
    let mut gw = Sluice::start(&cfg);
    let lb = HaProxy::start(gw.main, gw.admin.port(), &backends()).await;
    for b in ["active", "live"] {
        lb.wait_checked(b, WITHIN).await;
    }
    gw.terminate();
    let active = lb.wait_status("active", "DOWN", WITHIN).await;
    assert!(
        active.1.starts_with("L7STS"),
        "taken out on /ready's 503, not a closed port: {active:?}"
    );
    // Still serving (through the balancer that checks liveness only).
    assert_eq!(via(&lb, "live", "key_a").await.status, 200);
    assert_eq!(gw.wait_exit(Duration::from_secs(15)).await.code(), Some(0));
}
