//! A real `redis-server` per test, on a free loopback port, killed on drop; and helpers.
#![allow(dead_code)] // each test binary uses a different subset

use std::net::{TcpListener, TcpStream};
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sluice_limiter::{Algorithm, Key, KeyHasher, Limit, Nanos};
use sluice_store_redis::{RedisStore, RemoteLimit, StoreOptions};

pub const SEC: u64 = 1_000_000_000;
/// A start time well past the epoch, on a whole minute.
pub const T0: Nanos = Nanos(1_700_000_040 * SEC);

/// A `redis-server` child on `127.0.0.1:port`, without persistence.
pub struct RedisServer {
    child: Child,
    pub port: u16,
}

fn redis_server_binary() -> PathBuf {
    let candidates = ["/usr/bin/redis-server", "/usr/local/bin/redis-server"];
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("redis-server"))
        .chain(candidates.iter().map(PathBuf::from))
        .find(|p| p.is_file());
    found.unwrap_or_else(|| {
        panic!(
            "redis-server is not installed: these tests drive a real Redis. Install it with \
             `apt-get install redis-server` (scripts/test does so)"
        )
    })
}

impl RedisServer {
    /// Starts a server and waits (at most 5 s) until it answers. The port is picked free and
    /// bound by redis-server a moment later, so another test may take it in between: then
    /// redis-server exits (or what answers is not Redis) and another port is tried.
    pub fn start() -> Self {
        for _ in 0..5 {
            if let Some(server) = Self::try_start() {
                return server;
            }
        }
        panic!("redis-server did not start in 5 tries");
    }

    fn try_start() -> Option<Self> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let child = Command::new(redis_server_binary())
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--enable-debug-command", "local"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        let mut server = RedisServer { child, port };
        // At most 500 tries 10 ms apart: about 5 s.
        for tries in 0.. {
            if let Ok(Some(_)) = server.child.try_wait() {
                return None; // could not bind: the port was taken
            }
            if answers_ping(port) {
                break;
            }
            assert!(tries < 500, "redis-server did not answer on port {port}");
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(server)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// A store on this server with a generous timeout (loopback, shared 2-core machine).
    pub async fn store(&self) -> RedisStore {
        let options = StoreOptions {
            timeout: Duration::from_secs(2),
            ..StoreOptions::default()
        };
        RedisStore::connect(&self.url(), options)
            .await
            .expect("store connects")
    }

    /// A plain connection for inspecting the server.
    pub async fn admin(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("admin connection")
    }
}

/// `calls` of one command in `INFO commandstats` (0 if never called); the commands a script
/// runs are counted too.
pub async fn calls(server: &RedisServer, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut server.admin().await)
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether what listens on `port` is a Redis answering `PING`.
fn answers_ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut conn) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
    let mut reply = [0u8; 7];
    conn.write_all(b"PING\r\n").is_ok()
        && conn.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}

pub fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

pub fn at(offset_us: u64) -> Nanos {
    Nanos(T0.0 + offset_us * 1_000)
}

pub fn key(name: &str) -> Key {
    KeyHasher::with_secret(b"test secret").key(&[name.as_bytes()])
}

pub fn bucket(name: &str, quota: u32, window: Duration, burst: u32) -> Limit {
    let algorithm = Algorithm::TokenBucket { burst: nz(burst) };
    Limit::new(name, algorithm, nz(quota), window).unwrap()
}

pub fn fixed(name: &str, quota: u32, window: Duration) -> Limit {
    Limit::new(name, Algorithm::FixedWindow, nz(quota), window).unwrap()
}

pub fn sliding(name: &str, quota: u32, window: Duration) -> Limit {
    Limit::new(name, Algorithm::SlidingWindow, nz(quota), window).unwrap()
}

pub fn concurrency(name: &str, quota: u32) -> Limit {
    Limit::new(
        name,
        Algorithm::Concurrency,
        nz(quota),
        Duration::from_secs(1),
    )
    .unwrap()
}

pub fn remote(limit: &Limit) -> RemoteLimit {
    RemoteLimit::new(limit).expect("limit fits the store")
}

/// `d` rounded up to the microsecond: what the store reports for the in-memory `d`.
pub fn ceil_us(d: Duration) -> Duration {
    Duration::from_micros(u64::try_from(d.as_nanos().div_ceil(1_000)).unwrap())
}

/// A small deterministic generator (xorshift64*), so sequences are reproducible.
pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}
