//! What one decision costs Redis: the `usec` of `evalsha` in `INFO commandstats` per decision,
//! for requests with three token-bucket layers, as the gateway sends them (per-IP, per-API-key
//! and per-route keys), all admitted (large quotas). Decisions in flight together share
//! `EVALSHA`s (the store's batcher), so the count of decisions per call is printed too.
//!
//! ```text
//! cargo run --release -p sluice-store-redis --example evalsha_cost -- \
//!     [decisions per round, default 20000] [rounds, default 5]
//! ```
//!
//! Starts its own `redis-server` on a free loopback port (`--save '' --appendonly no`) and kills
//! it at the end. Each round resets the statistics (`CONFIG RESETSTAT`), runs the decisions
//! (16 in flight on one multiplexed connection; `SLUICE_BENCH_IN_FLIGHT` changes it; with
//! `SLUICE_BENCH_ONE_CALLER` set, all from one caller to one route) and reads the statistics;
//! a warm-up round first creates every key. What is measured is Redis's time
//! in the script, not the round trip. On a shared machine it varies from run to run: compare
//! versions in alternation, several times.

use std::net::{TcpListener, TcpStream};
use std::num::NonZeroU32;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use sluice_limiter::{Algorithm, KeyHasher, Limit};
use sluice_store_redis::{Layer, Mode, RedisStore, RemoteLimit, StoreOptions};

/// Decisions in flight at once (`SLUICE_BENCH_IN_FLIGHT` overrides).
const IN_FLIGHT: usize = 16;
/// Distinct callers per layer: many IPs, fewer API keys, a handful of routes.
const IPS: usize = 1_000;
const API_KEYS: usize = 100;
const ROUTES: usize = 10;

fn bucket(name: &str, quota: u32, burst: u32) -> RemoteLimit {
    let algorithm = Algorithm::TokenBucket {
        burst: NonZeroU32::new(burst).unwrap(),
    };
    let quota = NonZeroU32::new(quota).unwrap();
    let limit = Limit::new(name, algorithm, quota, Duration::from_secs(1)).unwrap();
    RemoteLimit::new(&limit).unwrap()
}

async fn round(store: &RedisStore, limits: &Arc<[RemoteLimit; 3]>, n: usize) -> usize {
    let hasher = Arc::new(KeyHasher::with_secret(b"bench secret"));
    let in_flight = std::env::var("SLUICE_BENCH_IN_FLIGHT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(IN_FLIGHT);
    let one_caller = std::env::var_os("SLUICE_BENCH_ONE_CALLER").is_some();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..in_flight {
        let (store, limits, hasher) = (store.clone(), Arc::clone(limits), Arc::clone(&hasher));
        tasks.spawn(async move {
            let mut admitted = 0;
            for i in (t..n).step_by(in_flight) {
                // SLUICE_BENCH_ONE_CALLER: every request from one IP with one key to one route
                // (as bench/compare's forward workload), so a call's requests share every key.
                let i = if one_caller { 0 } else { i };
                let ip = format!("10.0.{}.{}", (i % IPS) / 256, (i % IPS) % 256);
                let api_key = format!("key-{}", i % API_KEYS);
                let route = format!("route-{}", i % ROUTES);
                let layers = [
                    Layer::enforced(&limits[0], hasher.key(&[ip.as_bytes()])),
                    Layer::enforced(&limits[1], hasher.key(&[api_key.as_bytes()])),
                    Layer::enforced(&limits[2], hasher.key(&[route.as_bytes()])),
                ];
                let d = store.decide(&layers, 1, Mode::Charge).await.unwrap();
                admitted += usize::from(d.is_admitted());
            }
            admitted
        });
    }
    tasks.join_all().await.into_iter().sum()
}

async fn evalsha_stats(url: &str) -> String {
    let mut admin = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut admin)
        .await
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await
        .unwrap();
    info.lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .unwrap_or("cmdstat_evalsha: none")
        .to_owned()
}

/// A field of the `cmdstat_evalsha` line.
fn field(line: &str, name: &str) -> f64 {
    line.split([',', ':'])
        .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().unwrap());
    let n = args.next().unwrap_or(20_000);
    let rounds = args.next().unwrap_or(5);

    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let mut server = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server starts");
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        std::thread::sleep(Duration::from_millis(10));
    }
    let url = format!("redis://127.0.0.1:{port}/");
    let options = StoreOptions {
        timeout: Duration::from_secs(5),
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&url, options).await.unwrap();
    // Quotas large enough that every request is admitted, even at full speed.
    let limits = Arc::new([
        bucket("per-ip", 10_000, 20_000),
        bucket("per-key", 100_000, 200_000),
        bucket("per-route", 1_000_000, 2_000_000),
    ]);

    round(&store, &limits, IPS.max(API_KEYS).max(ROUTES)).await; // warm-up: every key exists
    evalsha_stats(&url).await;
    let mut figures = Vec::new();
    for r in 1..=rounds {
        let start = tokio::time::Instant::now();
        let admitted = round(&store, &limits, n).await;
        let took = start.elapsed();
        let line = evalsha_stats(&url).await;
        // Several decisions may share one EVALSHA: Redis's time per decision is the figure.
        let per_decision = field(&line, "usec") / n as f64;
        let per_call = n as f64 / field(&line, "calls");
        figures.push(per_decision);
        println!(
            "round {r}: {admitted}/{n} admitted in {took:.2?}, {per_decision:.2} us of Redis \
             per decision, {per_call:.1} decisions per EVALSHA; {line}"
        );
    }
    figures.sort_by(f64::total_cmp);
    println!(
        "Redis us per decision over {rounds} rounds of {n}: median {:.2}, min {:.2}, max {:.2}",
        figures[figures.len() / 2],
        figures[0],
        figures[figures.len() - 1]
    );
    // A clean exit, so that a profiler wrapped around redis-server writes its results.
    if let Ok(mut admin) = redis::Client::open(url.as_str()).and_then(|c| c.get_connection()) {
        let _: redis::RedisResult<()> = redis::cmd("SHUTDOWN").arg("NOSAVE").query(&mut admin);
    }
    for _ in 0..500 {
        if let Ok(Some(_)) = server.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = server.kill();
    let _ = server.wait();
}
