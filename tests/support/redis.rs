//! A real `redis-server` on a free loopback port, killed on drop, driven with `redis-cli`
//! (shared with the store's tests: `sluice-test-redis`).

pub use sluice_test_redis::RedisServer;

/// The secret every sluice instance in these tests shares (keys in Redis are keyed hashes).
pub const HASH_SECRET: &str = "test-secret-shared-by-every-instance";
