//! A limit as the script sees it: its parameters in microseconds, checked to stay exact in the
//! script's doubles (Lua 5.1 in Redis has no 64-bit integers: every value must stay below 2^53).

use std::time::Duration;

use sluice_limiter::{Algorithm, Key, Limit};

/// The largest integer every intermediate value of the script may reach.
const EXACT: u128 = 1 << 52;

/// Why a limit cannot be decided exactly by the script.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitTooLarge {
    /// The window, `block_for` or `max_delay` is not a whole number of microseconds (Redis
    /// `TIME`'s unit).
    #[error("limit {name:?}: {what} {value:?} is not a whole number of microseconds")]
    NotMicroseconds {
        /// The limit's name.
        name: String,
        /// `window`, `block_for` or `max_delay`.
        what: &'static str,
        /// The rejected duration.
        value: Duration,
    },
    /// Quota and window are so large that the script's arithmetic would lose exactness.
    #[error("limit {name:?}: {detail} exceeds 2^52, the exact range of the store's arithmetic")]
    Inexact {
        /// The limit's name.
        name: String,
        /// Which product is too large.
        detail: &'static str,
    },
}

/// A limit ready for the script: a [`Limit`] with its parameters in microseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteLimit {
    limit: Limit,
    /// Key prefix: `sluice:<name>:<shape>:`.
    prefix: String,
    pub(crate) code: &'static str,
    /// GCRA: units per microsecond, emission interval in units, bucket size.
    pub(crate) scale: u64,
    pub(crate) interval: u64,
    pub(crate) burst: u32,
    /// The script's argument for this limit's parameters, enforced (`[0]`) or dry-run (`[1]`):
    /// see [`spec`].
    pub(crate) spec: [Vec<u8>; 2],
}

/// A layer's parameters as the script reads them with one `struct.unpack('<c1c1dddddd', ..)`:
/// the algorithm's letter, `1` for a dry-run layer (else `0`), then as little-endian doubles
/// (exact: all are below 2^53) the quota advertised (a token bucket's burst, also the most one
/// request may cost), the window, the GCRA scale and interval, `block_for` (0: none) and how
/// long the limit may hold a request (its `max_delay`; 0: none), times in microseconds.
fn spec(code: &str, dry_run: bool, quota: u32, window_us: u64, rest: [u64; 4]) -> Vec<u8> {
    let [scale, interval, block_us, ahead_us] = rest;
    let mut out = Vec::with_capacity(2 + 6 * 8);
    out.extend_from_slice(code.as_bytes());
    out.push(if dry_run { b'1' } else { b'0' });
    for v in [
        u64::from(quota),
        window_us,
        scale,
        interval,
        block_us,
        ahead_us,
    ] {
        out.extend_from_slice(&(v as f64).to_le_bytes());
    }
    out
}

fn micros(name: &str, what: &'static str, d: Duration) -> Result<u64, LimitTooLarge> {
    let us = d.as_micros();
    if d.subsec_nanos() % 1_000 != 0 || us >= EXACT {
        let name = name.to_owned();
        return Err(LimitTooLarge::NotMicroseconds {
            name,
            what,
            value: d,
        });
    }
    Ok(us as u64)
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl RemoteLimit {
    /// How long the limit may hold a request (`delay` mode), if it may.
    pub(crate) fn max_delay(&self) -> Option<std::time::Duration> {
        self.limit.max_delay()
    }

    /// Checks that `limit` can be decided exactly by the script: its window and `block_for`
    /// are whole microseconds, and (token bucket) `burst * window_us / gcd(window_us, quota)`
    /// or (sliding window) `quota * window_us` stay within 2^52.
    pub fn new(limit: &Limit) -> Result<Self, LimitTooLarge> {
        let name = limit.name();
        let quota = limit.quota().get();
        let window_us = micros(name, "window", limit.window())?;
        let block_us = match limit.block_for() {
            Some(d) => micros(name, "block_for", d)?,
            None => 0,
        };
        let inexact = |detail| LimitTooLarge::Inexact {
            name: name.to_owned(),
            detail,
        };
        let (mut scale, mut interval, mut burst) = (0, 0, 0);
        let code = match limit.algorithm() {
            Algorithm::TokenBucket { burst: b } => {
                let g = gcd(window_us, u64::from(quota));
                (scale, interval, burst) = (u64::from(quota) / g, window_us / g, b.get());
                if u128::from(interval) * u128::from(burst) * 2 > EXACT {
                    return Err(inexact("burst * window_us / gcd(window_us, quota)"));
                }
                "g"
            }
            Algorithm::FixedWindow => "f",
            Algorithm::SlidingWindow => {
                if u128::from(quota) * u128::from(window_us) * 3 > EXACT {
                    return Err(inexact("quota * window_us"));
                }
                "s"
            }
            Algorithm::Concurrency => "c",
        };
        let advertised = if code == "g" { burst } else { quota };
        let ahead_us = match limit.max_delay() {
            Some(d) => micros(name, "max_delay", d)?,
            None => 0,
        };
        let rest = [scale, interval, block_us, ahead_us];
        // What a state under this limit's key means: a window's index counts windows of this
        // length, a bucket's time is this rate's and burst's. A limit whose algorithm, window,
        // rate or burst changes (its name kept) counts in keys of its own from then on, rather
        // than read what another meaning wrote (review: a window read under another length
        // refused for decades, or, read as stale, let a rolling change admit without limit).
        let shape = match limit.algorithm() {
            Algorithm::TokenBucket { burst } => format!("tb.{quota}.{window_us}.{burst}"),
            Algorithm::FixedWindow => format!("fw.{window_us}"),
            Algorithm::SlidingWindow => format!("sw.{window_us}"),
            Algorithm::Concurrency => "cc".to_owned(),
        };
        Ok(RemoteLimit {
            limit: limit.clone(),
            prefix: format!("sluice:{name}:{shape}:"),
            code,
            scale,
            interval,
            burst,
            spec: [false, true].map(|dry| spec(code, dry, advertised, window_us, rest)),
        })
    }

    /// The limit.
    pub fn limit(&self) -> &Limit {
        &self.limit
    }

    /// The name of `key`'s entry under this limit in Redis: `sluice:<limit name>:<shape>:<32
    /// hex digits of the keyed hash>`, so raw identities never reach Redis. The shape is the
    /// algorithm and what gives its state a meaning: `fw.<window in us>`, `sw.<window in us>`,
    /// `tb.<quota>.<window in us>.<burst>`, or `cc`.
    pub fn key_name(&self, key: Key) -> String {
        let mut out = Vec::with_capacity(self.prefix.len() + 32);
        self.push_key_name(&mut out, key);
        // The prefix is a `String` and the rest hex digits.
        String::from_utf8(out).unwrap_or_default()
    }

    /// Appends [`RemoteLimit::key_name`] to `out`, without a `String` of its own.
    pub(crate) fn push_key_name(&self, out: &mut Vec<u8>, key: Key) {
        out.extend_from_slice(self.prefix.as_bytes());
        push_hex(out, key);
    }

    /// `q`: the quota advertised (a token bucket's burst).
    pub(crate) fn quota(&self) -> u32 {
        match self.limit.algorithm() {
            Algorithm::TokenBucket { burst } => burst.get(),
            _ => self.limit.quota().get(),
        }
    }

    /// `w`: the window advertised; a bucket's refill time; none for concurrency (as in memory).
    pub(crate) fn window(&self) -> Option<Duration> {
        let window = self.limit.window().as_nanos();
        match self.limit.algorithm() {
            Algorithm::TokenBucket { burst } => {
                let quota = u128::from(self.limit.quota().get());
                let ns = (u128::from(burst.get()) * window).div_ceil(quota);
                Some(Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX)))
            }
            Algorithm::Concurrency => None,
            _ => Some(self.limit.window()),
        }
    }

    pub(crate) fn is_concurrency(&self) -> bool {
        self.code == "c"
    }
}

fn push_hex(out: &mut Vec<u8>, key: Key) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 32];
    for (pair, b) in digits.chunks_exact_mut(2).zip(key.to_bytes()) {
        pair[0] = HEX[usize::from(b >> 4)];
        pair[1] = HEX[usize::from(b & 15)];
    }
    // One append of 32 bytes instead of 32 pushes of one each.
    out.extend_from_slice(&digits);
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_limiter::KeyHasher;
    use std::num::NonZeroU32;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn key_names_carry_the_limit_and_the_hash_never_the_identity() {
        let key = KeyHasher::with_secret(b"s").key(&[b"api-key-123"]);
        let limit = Limit::new(
            "per-ip",
            Algorithm::FixedWindow,
            nz(1),
            Duration::from_secs(1),
        );
        let remote = RemoteLimit::new(&limit.unwrap()).unwrap();
        let name = remote.key_name(key);
        let prefix = "sluice:per-ip:fw.1000000:";
        assert!(name.starts_with(prefix));
        assert_eq!(name.len(), prefix.len() + 32);
        assert!(!name.contains("api-key"));
        // The hash's bytes in order, two lower-case hex digits each: names are shared with
        // other instances and earlier versions, so they must not change.
        let hex: String = key.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(name, format!("{prefix}{hex}"));
    }

    /// What gives a state its meaning is in its key's name: a change of algorithm, window,
    /// rate or burst counts in keys of its own; a change of quota (windows, concurrency),
    /// `block_for` or `max_delay` keeps the counts.
    #[test]
    fn key_names_change_with_what_a_state_means() {
        let key = KeyHasher::with_secret(b"s").key(&[b"k"]);
        let second = Duration::from_secs(1);
        let name = |algorithm, quota, window| {
            let limit = Limit::new("l", algorithm, nz(quota), window).unwrap();
            let prefix = RemoteLimit::new(&limit).unwrap().key_name(key);
            prefix[..prefix.len() - 32].to_owned()
        };
        let bucket = |burst| Algorithm::TokenBucket { burst: nz(burst) };
        assert_eq!(
            name(Algorithm::FixedWindow, 5, second),
            "sluice:l:fw.1000000:"
        );
        assert_eq!(
            name(Algorithm::FixedWindow, 9, second),
            "sluice:l:fw.1000000:"
        );
        assert_eq!(
            name(Algorithm::FixedWindow, 5, 2 * second),
            "sluice:l:fw.2000000:"
        );
        assert_eq!(
            name(Algorithm::SlidingWindow, 5, second),
            "sluice:l:sw.1000000:"
        );
        assert_eq!(name(bucket(5), 5, second), "sluice:l:tb.5.1000000.5:");
        assert_eq!(name(bucket(9), 5, second), "sluice:l:tb.5.1000000.9:");
        assert_eq!(name(Algorithm::Concurrency, 5, second), "sluice:l:cc:");
        assert_eq!(name(Algorithm::Concurrency, 9, second), "sluice:l:cc:");
        let delayed = Limit::new("l", Algorithm::FixedWindow, nz(5), second)
            .unwrap()
            .with_max_delay(3 * second)
            .unwrap()
            .with_block_for(60 * second)
            .unwrap();
        let held = RemoteLimit::new(&delayed).unwrap().key_name(key);
        assert_eq!(held[..held.len() - 32], *"sluice:l:fw.1000000:");
    }

    #[test]
    fn sub_microsecond_window_is_refused() {
        let w = Duration::from_nanos(1_500);
        let limit = Limit::new("f", Algorithm::FixedWindow, nz(1), w).unwrap();
        assert!(matches!(
            RemoteLimit::new(&limit),
            Err(LimitTooLarge::NotMicroseconds { .. })
        ));
    }

    #[test]
    fn sliding_window_beyond_exact_range_is_refused() {
        let day = Duration::from_secs(86_400);
        let big = Limit::new("s", Algorithm::SlidingWindow, nz(1_000_000), day).unwrap();
        assert!(matches!(
            RemoteLimit::new(&big),
            Err(LimitTooLarge::Inexact { .. })
        ));
        let fine = Limit::new("s", Algorithm::SlidingWindow, nz(10_000), day).unwrap();
        assert!(RemoteLimit::new(&fine).is_ok());
    }

    #[test]
    fn bucket_of_a_third_per_second_keeps_exact_units() {
        let burst = Algorithm::TokenBucket { burst: nz(3) };
        let limit = Limit::new("t", burst, nz(3), Duration::from_secs(1)).unwrap();
        let r = RemoteLimit::new(&limit).unwrap();
        assert_eq!((r.scale, r.interval, r.burst), (3, 1_000_000, 3));
        assert_eq!(r.window(), Some(Duration::from_secs(1)));
    }
}
