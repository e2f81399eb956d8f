//! Why the store could not decide. Every variant is the gateway's side (a 503 or the
//! configured fallback), never the caller's.

use std::sync::Arc;
use std::time::Duration;

/// A failed store call.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis did not answer within the store's timeout.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// Redis did not answer within the store's timeout, and the last attempt to connect to it
    /// anew (since its last answer) failed, for the reason given (`Connection refused`, say):
    /// the same outage as [`StoreError::Timeout`], named.
    #[error("redis did not answer within {within:?}, and connecting to it anew failed: {why}")]
    Unreachable {
        /// The store's timeout.
        within: Duration,
        /// Why the attempt to connect failed.
        why: Arc<str>,
    },
    /// Redis reached the request after its sender had stopped waiting (a stalled Redis): it
    /// charged nothing.
    #[error("redis reached the request after its deadline")]
    Expired,
    /// Redis answered with an error, or the connection failed.
    #[error("redis: {0}{hint}", hint = auth_hint(.0))]
    Redis(#[from] redis::RedisError),
    /// The script's reply did not have the documented layout (a script of another version?).
    #[error("unexpected reply from the decision script: {0}")]
    Reply(String),
    /// The request's layers cannot be sent as given.
    #[error("invalid layers: {0}")]
    Layers(&'static str),
    /// The Redis key of this layer (0-based) holds a value of another type, written by
    /// something other than this limit: the request fails, the others sharing its call do not.
    #[error("the Redis key of layer {0} holds a value of another type")]
    KeyType(usize),
}

/// What to add to an error that means Redis wants other credentials than the store's `url`
/// gives: said plainly, since Redis's own words for it can be far from it (a client that
/// reconnects without a password, once one is set, sends a command and hears "Protocol error:
/// unauthenticated multibulk length").
fn auth_hint(e: &redis::RedisError) -> &'static str {
    let text = e.to_string();
    let auth = e.kind() == redis::ErrorKind::AuthenticationFailed
        || ["NOAUTH", "WRONGPASS", "unauthenticated"]
            .iter()
            .any(|w| text.contains(w));
    if auth {
        " (Redis wants a password, or another one, than the store's url gives: was it set or changed?)"
    } else {
        ""
    }
}

impl StoreError {
    /// Whether the store itself failed (no answer in time, a broken connection, Redis
    /// refusing the script, an unreadable reply), as opposed to this request alone (its
    /// layers, or its key holding data of another type).
    pub fn is_store_failure(&self) -> bool {
        match self {
            StoreError::Timeout(_)
            | StoreError::Unreachable { .. }
            | StoreError::Expired
            | StoreError::Redis(_)
            | StoreError::Reply(_) => true,
            StoreError::Layers(_) | StoreError::KeyType(_) => false,
        }
    }

    /// The same failure, for another request of the same call (a Redis error's kind and
    /// message are kept; `RedisError` cannot be cloned).
    pub(crate) fn share(&self) -> StoreError {
        match self {
            StoreError::Timeout(d) => StoreError::Timeout(*d),
            StoreError::Unreachable { within, why } => StoreError::Unreachable {
                within: *within,
                why: Arc::clone(why),
            },
            StoreError::Expired => StoreError::Expired,
            StoreError::Redis(e) => {
                StoreError::Redis(redis::RedisError::from((e.kind(), "redis", e.to_string())))
            }
            StoreError::Reply(s) => StoreError::Reply(s.clone()),
            StoreError::Layers(s) => StoreError::Layers(s),
            StoreError::KeyType(layer) => StoreError::KeyType(*layer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_failures_of_the_store_itself_count_against_it() {
        let redis = redis::RedisError::from((redis::ErrorKind::IoError, "gone"));
        for e in [
            StoreError::Timeout(Duration::from_millis(25)),
            StoreError::Unreachable {
                within: Duration::from_millis(25),
                why: "Connection refused".into(),
            },
            StoreError::Redis(redis),
            StoreError::Reply("2 replies for 3 requests".into()),
        ] {
            assert!(e.is_store_failure(), "{e}");
        }
        for e in [StoreError::Layers("none"), StoreError::KeyType(1)] {
            assert!(!e.is_store_failure(), "{e}");
        }
    }

    #[test]
    fn errors_that_mean_other_credentials_say_so() {
        let said = |kind, text: &'static str| {
            StoreError::Redis((kind, "x", text.into()).into()).to_string()
        };
        for (kind, text) in [
            (
                redis::ErrorKind::ResponseError,
                "Protocol error: unauthenticated multibulk length",
            ),
            (
                redis::ErrorKind::ResponseError,
                "NOAUTH Authentication required.",
            ),
            (
                redis::ErrorKind::AuthenticationFailed,
                "WRONGPASS invalid username-password pair",
            ),
        ] {
            assert!(
                said(kind, text).contains("Redis wants a password"),
                "{}",
                said(kind, text)
            );
        }
        let other = said(redis::ErrorKind::IoError, "connection reset");
        assert!(!other.contains("password"), "{other}");
    }
}
