//! sluice's rate-limit decisions: exact, layered, bounded.
//!
//! - [`Limit`] defines a limit: [`Algorithm`] (GCRA token bucket, fixed window, sliding window,
//!   concurrency), quota, window, optional `block_for`, and `max_keys`.
//! - [`KeyHasher`] turns a caller's identity into a 128-bit [`Key`]; the raw identity is never
//!   stored.
//! - [`Limiter`] holds one bounded, sharded table per limit and decides a request against
//!   several limits at once, all or nothing: [`Limiter::decide`] returns a [`Decision`], with
//!   per-limit [`Report`]s for the `RateLimit` headers.
//! - Time is passed in as [`Nanos`] (since the Unix epoch), read from a [`Clock`].
//!
//! Pure: no I/O, no async runtime.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod algo;
mod clock;
mod decision;
mod key;
mod limit;
mod limiter;
mod table;

pub use clock::{Clock, ManualClock, Nanos, SystemClock};
pub use decision::{
    Admission, CostTooLarge, Decision, LimitId, Refusal, RefusalReason, Report, Slots,
};
pub use key::{Key, KeyHasher};
pub use limit::{Algorithm, Limit, LimitError, DEFAULT_MAX_KEYS};
pub use limiter::{Limiter, LimiterError};
pub use table::TableStats;
