//! `sluice demo`: the seed's scenarios, on real sockets, in a few seconds. An in-process
//! upstream, a sluice gateway on free loopback ports with a built-in configuration, and a
//! balancer model; what happened is printed in plain words.

mod balancer;
mod http;

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, SystemTime};

use ::http::{Method, StatusCode};
use anyhow::Context;
use balancer::Balancer;
use http::{get, Reply, Upstream};
use sluice_client::{retry_after, retry_after_header, Backoff, Problem, RetryPolicy};
use sluice_gateway::Gateway;
use tokio::sync::oneshot;

/// The demo's configuration: a gateway of capacity 3, a key quota of 5 a minute, and an agent
/// route whose window is shortened to 2 s so the retry story finishes in seconds.
const CONFIG: &str = r#"
[gateway]
listen = "127.0.0.1:0"
max_in_flight = 3
health_path = "/health"
overload_retry_after = { min = "2s", max = "5s" }

[admin]
listen = "127.0.0.1:0"

[responses]
problem_base = "https://api.example.com/problems/"

[upstreams.app]
url = "http://UPSTREAM"

[[routes]]
name = "agent"
path = "/agent"
upstream = "app"

[[routes]]
name = "api"
path = "/"
upstream = "app"

[[limits]]
name = "key-quota"
by = "api_key"
routes = ["api"]
algorithm = "fixed_window"
quota = 5
window = "1m"

[[limits]]
name = "agent-quota"
by = "api_key"
routes = ["agent"]
algorithm = "fixed_window"
quota = 1
window = "2s"
"#;

/// A gateway and its upstream, running until dropped.
struct Stage {
    upstream: Upstream,
    main: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    _stop: oneshot::Sender<()>,
}

impl Stage {
    async fn start() -> anyhow::Result<Self> {
        let upstream = Upstream::start().await?;
        let text = CONFIG.replace("UPSTREAM", &upstream.addr.to_string());
        let config =
            sluice_config::parse(&text, Path::new("<demo>")).map_err(|e| anyhow::anyhow!("{e}"))?;
        let gateway = Gateway::bind(&config).await?;
        let (main, admin) = (gateway.main_addr(), gateway.admin_addr());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(gateway.run(async move {
            let _ = stopped.await;
        }));
        Ok(Self {
            upstream,
            main,
            admin,
            _stop: stop,
        })
    }

    async fn probes(&self) -> anyhow::Result<Vec<StatusCode>> {
        let mut out = Vec::new();
        for _ in 0..3 {
            out.push(get(self.admin, "/ready", None).await?.status);
        }
        Ok(out)
    }
}

/// Runs every scenario and returns the text to print.
pub(crate) async fn run() -> anyhow::Result<String> {
    let mut out = String::new();
    writeln!(
        out,
        "sluice demo: an in-process upstream and a sluice gateway on free loopback ports."
    )?;
    writeln!(
        out,
        "The agent story's window is shortened from 60 s to 2 s so the demo finishes in seconds.\n"
    )?;
    scenario_1(&mut out).await.context("scenario 1")?;
    scenario_2(&mut out).await.context("scenario 2")?;
    clock_skew(&mut out)?;
    agent(&mut out).await.context("the agent story")?;
    Ok(out)
}

fn statuses(replies: &[Reply]) -> String {
    replies
        .iter()
        .map(|r| r.status.as_u16().to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

fn retry_afters(replies: &[Reply]) -> String {
    let values: Vec<&str> = replies
        .iter()
        .filter(|r| r.status.as_u16() >= 429)
        .filter_map(|r| r.headers.get("retry-after").and_then(|v| v.to_str().ok()))
        .collect();
    if values.is_empty() {
        String::new()
    } else {
        format!(" Retry-After: {}", values.join(", "))
    }
}

/// A reply's field `name`, or `-`.
fn field<'a>(reply: &'a Reply, name: &str) -> &'a str {
    reply
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
}

fn pretty(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or_else(|_| String::from_utf8_lossy(body).into_owned())
}

async fn calls(
    stage: &Stage,
    key: &str,
    n: usize,
    balancer: &mut Balancer,
) -> anyhow::Result<Vec<Reply>> {
    let mut replies = Vec::with_capacity(n);
    for _ in 0..n {
        let r = get(stage.main, "/v1/items", Some(key)).await?;
        balancer.observe(r.status);
        replies.push(r);
    }
    Ok(replies)
}

async fn scenario_1(out: &mut String) -> anyhow::Result<()> {
    let stage = Stage::start().await?;
    let mut balancer = Balancer::default();
    writeln!(
        out,
        "scenario 1: key_a goes past its quota of 5 a minute, key_b stays under it"
    )?;
    let a = calls(&stage, "key_a", 7, &mut balancer).await?;
    let b = calls(&stage, "key_b", 2, &mut balancer).await?;
    writeln!(out, "key_a {}{}", statuses(&a), retry_afters(&a))?;
    writeln!(out, "key_b {}{}", statuses(&b), retry_afters(&b))?;
    writeln!(
        out,
        "(a fixed window aligned to the clock's minute: Retry-After counts to the next one)"
    )?;
    writeln!(
        out,
        "every answer: RateLimit-Policy: {}",
        field(&a[0], "ratelimit-policy")
    )?;
    for (n, reply) in [(4, &a[3]), (6, &a[5])] {
        writeln!(
            out,
            "key_a's answer {n} ({}): RateLimit: {}",
            reply.status.as_u16(),
            field(reply, "ratelimit")
        )?;
    }
    writeln!(out, "{}", balancer.verdict(&stage.probes().await?))?;
    writeln!(out, "{}\n", pretty(&a[5].body))?;
    Ok(())
}

async fn scenario_2(out: &mut String) -> anyhow::Result<()> {
    let stage = Stage::start().await?;
    let mut balancer = Balancer::default();
    writeln!(
        out,
        "scenario 2: three slow requests fill the gateway (capacity 3), then key_a and key_b call"
    )?;
    let main = stage.main;
    let slow: Vec<_> = (0..3)
        .map(|_| tokio::spawn(async move { get(main, "/slow", None).await }))
        .collect();
    // Readiness turns 503 once all three are in flight.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while get(stage.admin, "/ready", None).await?.status == StatusCode::OK {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the slow requests never filled the gateway"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let a = calls(&stage, "key_a", 3, &mut balancer).await?;
    let b = calls(&stage, "key_b", 2, &mut balancer).await?;
    writeln!(out, "key_a {}{}", statuses(&a), retry_afters(&a))?;
    writeln!(out, "key_b {}{}", statuses(&b), retry_afters(&b))?;
    writeln!(
        out,
        "key_b's 503: RateLimit: {} (its figures as they stand: nothing charged)",
        field(&b[1], "ratelimit")
    )?;
    writeln!(out, "{}", balancer.verdict(&stage.probes().await?))?;
    writeln!(out, "{}", pretty(&a[0].body))?;
    stage.upstream.release(3);
    for s in slow {
        s.await??;
    }
    while get(stage.admin, "/ready", None).await?.status != StatusCode::OK {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline + Duration::from_secs(5),
            "readiness did not return"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let after = calls(&stage, "key_a", 5, &mut Balancer::default()).await?;
    writeln!(out, "key_a, after the load clears {}", statuses(&after))?;
    writeln!(
        out,
        "key_a was refused three times, all for capacity, and still had its whole quota.\n"
    )?;
    Ok(())
}

fn clock_skew(out: &mut String) -> anyhow::Result<()> {
    // Whole seconds, as an HTTP-date carries them.
    let unix = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)?
        .as_secs();
    let server_now = SystemTime::UNIX_EPOCH + Duration::from_secs(unix);
    let client_now = server_now + Duration::from_secs(30);
    let date = httpdate::fmt_http_date(server_now + Duration::from_secs(60));
    let secs = retry_after("60", client_now).context("seconds parse")?;
    let by_date = retry_after(&date, client_now).context("date parse")?;
    writeln!(
        out,
        "Retry-After for a 60 s wait, read by a client whose clock runs 30 s fast"
    )?;
    writeln!(
        out,
        "seconds    {:<31} client waits {} s",
        "60",
        secs.as_secs()
    )?;
    writeln!(
        out,
        "HTTP-date  {date:<31} client waits {} s",
        by_date.as_secs()
    )?;
    writeln!(out, "The client with a fast clock comes back early and is refused again: sluice sends seconds.\n")?;
    Ok(())
}

async fn agent(out: &mut String) -> anyhow::Result<()> {
    let stage = Stage::start().await?;
    writeln!(
        out,
        "an agent retrying on its own after its quota is spent, ten attempts at most"
    )?;
    spend(&stage).await?;
    let start = tokio::time::Instant::now();
    let mut last = StatusCode::OK;
    for _ in 0..10 {
        last = get(stage.main, "/agent", Some("agent")).await?.status;
        if last == StatusCode::OK {
            break;
        }
    }
    writeln!(
        out,
        "without Retry-After  10 attempts in {} s, last status {}",
        start.elapsed().as_secs(),
        last.as_u16()
    )?;

    spend(&stage).await?;
    let policy = RetryPolicy::new(10.try_into()?, Duration::from_secs(30), Backoff::default());
    let mut rng = rand::thread_rng();
    let start = tokio::time::Instant::now();
    let outcome = sluice_client::send_with_retry(&policy, &Method::GET, &mut rng, || {
        http::send(stage.main, "/agent", Some("agent"))
    })
    .await?;
    writeln!(
        out,
        "with Retry-After     {} attempts in {} s, last status {}",
        outcome.attempts,
        start.elapsed().as_secs_f64().round(),
        outcome.response.status().as_u16()
    )?;
    Ok(())
}

/// Uses up the agent's quota: calls until refused, and shows what the refusal says.
async fn spend(stage: &Stage) -> anyhow::Result<()> {
    for _ in 0..5 {
        let r = get(stage.main, "/agent", Some("agent")).await?;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            let problem = Problem::from_slice(&r.body)?;
            anyhow::ensure!(
                problem.policy.as_deref() == Some("agent-quota"),
                "unexpected refusal: {problem:?}"
            );
            anyhow::ensure!(
                retry_after_header(&r.headers, SystemTime::now()).is_some(),
                "a 429 without Retry-After"
            );
            return Ok(());
        }
    }
    anyhow::bail!("the agent's quota was never spent")
}
