//! Why the store could not decide. Every variant is the gateway's side (a 503 or the
//! configured fallback), never the caller's.

use std::time::Duration;

/// A failed store call.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis did not answer within the store's timeout.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// Redis answered with an error, or the connection failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The script's reply did not have the documented layout (a script of another version?).
    #[error("unexpected reply from the decision script: {0}")]
    Reply(String),
    /// The request's layers cannot be sent as given.
    #[error("invalid layers: {0}")]
    Layers(&'static str),
}
