//! A real `redis-server` per test, on a free loopback port, killed on drop; and helpers.
#![allow(dead_code)] // each test binary uses a different subset

use std::num::NonZeroU32;
use std::time::Duration;

use sluice_limiter::{Algorithm, Key, KeyHasher, Limit, Nanos};
use sluice_store_redis::{Layer, Mode, RedisStore, RemoteLimit, StoreOptions};

pub const SEC: u64 = 1_000_000_000;
/// A start time well past the epoch, on a whole minute.
pub const T0: Nanos = Nanos(1_700_000_040 * SEC);

pub use sluice_test_redis::RedisServer;

/// Connections to a test server, for the store's tests.
pub trait Connect {
    /// A store on this server with a generous timeout (loopback, shared 2-core machine).
    async fn store(&self) -> RedisStore;
    /// A plain connection for inspecting the server.
    async fn admin(&self) -> redis::aio::MultiplexedConnection;
}

impl Connect for RedisServer {
    async fn store(&self) -> RedisStore {
        let options = StoreOptions {
            timeout: Duration::from_secs(2),
            ..StoreOptions::default()
        };
        RedisStore::connect(&self.url(), options)
            .await
            .expect("store connects")
    }

    async fn admin(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("admin connection")
    }
}

/// Whether a charging decision over `layers` (cost 1) is admitted; a store error fails the test.
pub async fn admitted(store: &RedisStore, layers: &[Layer<'_>]) -> bool {
    store
        .decide(layers, 1, Mode::Charge)
        .await
        .expect("the store decides")
        .is_admitted()
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
