//! sluice's shared store on Redis: one Lua round trip per decision.
//!
//! Instances of sluice that share a Redis share one budget per caller. A request's layers
//! (every `(limit, key)` that applies to it) go to Redis in one `EVALSHA` of a script that
//! reads the clock with `TIME`, decides all four algorithms of `sluice-limiter` with the same
//! math (in microseconds), and charges every layer or none. Requests waiting at the same
//! moment share one `EVALSHA` (decided in order, each as if alone), so a request costs at most
//! one round trip and Redis reads and writes each key once per call.
//!
//! - [`RemoteLimit`] is a [`sluice_limiter::Limit`] checked to be exact in the script.
//! - [`RedisStore::decide`] returns a [`RemoteDecision`] with per-layer [`LayerReport`]s, the
//!   figures of the `RateLimit` headers, in the order the layers were given.
//! - [`Mode::Full`] evaluates without charging, for an instance that is full (a refusal still
//!   starts blocks); [`Mode::CheckOnly`] without writing anything.
//! - Concurrency slots are leases with an expiry; a [`Lease`] releases them when dropped.
//! - Keys are named `sluice:<limit>:<hex of the keyed hash>`: raw identities never reach Redis.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod decision;
mod error;
mod limit;
mod script;
mod store;

pub use decision::{
    LayerReport, Lease, RemoteAdmission, RemoteDecision, RemoteRefusal, RemoteRefusalReason,
};
pub use error::StoreError;
pub use limit::{LimitTooLarge, RemoteLimit};
pub use store::{BackgroundWrite, Layer, Mode, RedisStore, StoreOptions};
