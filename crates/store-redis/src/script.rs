//! The decision script's contract: what goes in, what comes back.
//!
//! One `EVALSHA <sha> <numkeys> KEYS... ARGV...` decides one request or several, in order: the
//! store sends together the requests that are waiting at the same moment (see `store.rs`).
//! KEYS are every request's keys in turn, one per layer, `sluice:<limit>:<hex>`.
//!
//! ARGV (decimal strings, but for the layers' parameters; times in microseconds since the Unix
//! epoch): `[lease TTL, number of requests]`, then for each request:
//!
//! | # | value |
//! |---|-------|
//! | 1 | mode: `d` decide and charge, `c` check only (nothing written), `b` check at a full instance (nothing charged; a refusal starts blocks), `r` refund, `w` withdraw (a refund that leaves a token bucket alone unless its TAT is the tag) |
//! | 2 | cost |
//! | 3 | lease id (the ZSET member of concurrency layers; empty if none) |
//! | 4 | `now` pinned by tests, or empty: the script reads Redis `TIME` (once per call) |
//! | 5 | deadline, or empty: a decision reached later than this (Redis's clock, as the sender estimates it) charges nothing and answers `[5, 0, now]`, since its sender has stopped waiting |
//! | 6 | n, its number of layers (and of its keys) |
//!
//! then one per layer, in KEYS order: its parameters, one binary string read with a single
//! `struct.unpack` (cheaper in Redis than parsing several decimal arguments): the algorithm
//! (`g` token bucket, `f` fixed window, `s` sliding window, `c` concurrency) and dry-run (`1`/`0`)
//! as one byte each, then six little-endian doubles: the quota advertised (a token bucket's
//! burst, the most one request may cost), the window, the GCRA scale (units per us), the GCRA
//! interval (units), `block_for` (0: none) and the limit's `max_delay` (0: none; the script then
//! admits a request that passes within it, charged now in the window it passes in, and tells how
//! long to hold it).
//! [`RemoteLimit`](crate::RemoteLimit) computes both forms once. In refund and withdraw modes only, then one per layer: its refund tag (`-1`: not charged); then three per layer: the state a window charged ahead for a held request replaced (`-1 -1 -1`: none), put back if the state is still the one the charge left.
//!
//! Reply: an array with one bulk string per request, in order: its figures as little-endian
//! doubles (all integers below 2^53, so exact; one string costs Redis less to send than the
//! integers one by one, and the gateway far less to parse):
//! `[outcome, layer, wait, blocked_until, dry_refused, now]` then 5 per layer:
//! `[remaining, reset, tag, own_wait, blocked_until]`; an admitted request that is held
//! (wait above 0) then has 3 more per layer: the state its charge replaced, if the layer is a
//! window charged ahead (`[window index, count or previous count, current count]`), else
//! `[-1, -1, -1]`; then 2 more per layer: for a fixed or sliding window or a token bucket, its
//! figures as the request passes (`[remaining, reset]`, the reset counted from the decision),
//! else (concurrency) `[-1, -1]`.
//! - outcome: 1 admitted, 0 refused, 2 cost too large (the header only), 3 refunded (refund
//!   mode: nothing else), 4 failed: `[4, layer]`, that layer's key holds another type in Redis
//!   (read with `redis.pcall`, so the request fails alone, before writing anything); 5
//!   expired: `[5, 0, now]`, reached after its deadline, nothing charged;
//! - layer: 1-based refusing layer (the longest wait) or the layer whose capacity is too small;
//! - wait: refused, until the request would pass (-1 for none); admitted, how long to hold it
//!   first (-1: not held; a limit's `max_delay`), its figures being as of the decision;
//! - reset: -1 for none; own_wait: -2 not refusing, -1 refusing without a wait;
//! - blocked_until: 0 for none; in the header, non-zero when the refusal is due to an
//!   earlier block (`RefusalReason::Blocked`); dry_refused: 1-based dry-run layer, 0 none;
//! - tag: the charge's window index for a refund (a token bucket: its TAT in whole us after
//!   the charge, for a withdrawal), -1 if this layer was not charged.
//!
//! Requests in one call are decided as if each had its own, in order: a later one sees the
//! earlier ones' charges. Each key is read once (`GET`) when first needed and written once at
//! the end of the call, whatever the number of requests sharing it.
//!
//! Keys: a window or bucket state is a byte 0 then its fields as little-endian doubles (one
//! `struct.pack`): token bucket `[TAT in whole us, its fraction in 1/scale us, block end, exp]`,
//! fixed window `[window index, count, block end, exp]`, sliding window `[window index, previous
//! count, current count, block end, exp]`; block end 0 for none. States written by earlier
//! versions (decimal integers separated by spaces, a missing trailing field read as 0) are still
//! read; those versions read this form as a fresh state, so while both run beside each other a
//! caller's state written by one is ignored by the other. A state lives at least until the
//! later of its return to fresh and its block's end (it is deleted once fresh); `exp` is the
//! time until which its key's expiry is known to keep it.
//! A write that needs no later expiry keeps the key's (`SET .. KEEPTTL`, half the cost of
//! setting one); otherwise it sets `PX`, for a bucket past the need by its refill time (at most
//! 1 s) so that a busy key's next writes keep it. A key may so outlive its state by up to 1 s.
//! Concurrency keys are ZSETs of lease ids scored by expiry, trimmed when charged, `PEXPIRE`d
//! by the lease TTL.

use std::time::Duration;

use sluice_limiter::{Nanos, RefusalReason};

use crate::decision::{HeldLayer, LayerReport, RemoteAdmission, RemoteDecision, RemoteRefusal};
use crate::store::Layer;
use crate::StoreError;

/// The script's source.
pub(crate) const SOURCE: &str = include_str!("decide.lua");

/// A release: the lease (`ARGV[1]`) out of each key; a key of another type holds none.
const RELEASE: &str = "for _, k in ipairs(KEYS) do redis.pcall('ZREM', k, ARGV[1]) end";

const HEADER: usize = 6;
const PER_LAYER: usize = 5;
/// Figures per layer after the others, in a held admission's reply.
const REPLACED: usize = 3;
/// Integers per layer after those, in a held admission's reply: its figures as it passes.
const AT_PASS: usize = 2;

/// What a refund or withdrawal sends of the admission: each layer's tag, and what a held
/// request's window charges replaced (empty if it was not held).
pub(crate) type Charges<'a> = (&'a [Option<u64>], &'a [HeldLayer]);

/// One request's part of an `EVALSHA`: its keys and its arguments (see the module's doc).
#[derive(Debug, Default)]
pub(crate) struct Part {
    /// The keys, then the arguments, one after the other; `ends[i]` is where piece `i` ends.
    bytes: Vec<u8>,
    ends: Vec<usize>,
    /// How many of the pieces are keys.
    keys: usize,
    /// A lease's release: `ZREM` of its one argument (the lease id) from each key, sent in the
    /// batch's pipeline ahead of its `EVALSHA` rather than in it (see [`Part::release`]).
    release: bool,
}

impl Part {
    /// A request's part: its layers' keys, mode, cost, lease, pinned clock, parameters and,
    /// when refunding, the charges' tags.
    pub(crate) fn new(
        layers: &[Layer<'_>],
        mode: &str,
        cost: u32,
        lease: &str,
        (now, deadline): (Option<Nanos>, Option<u64>),
        tags: Option<Charges<'_>>,
    ) -> Self {
        let mut part = Part {
            bytes: Vec::with_capacity(64 + 96 * layers.len()),
            ends: Vec::with_capacity(6 + 3 * layers.len()),
            keys: layers.len(),
            release: false,
        };
        for layer in layers {
            layer.limit.push_key_name(&mut part.bytes, layer.key);
            part.ends.push(part.bytes.len());
        }
        let mut figure = itoa::Buffer::new();
        part.arg(mode.as_bytes());
        part.arg(figure.format(cost).as_bytes());
        part.arg(lease.as_bytes());
        match now {
            Some(now) => part.arg(figure.format(now.0 / 1_000).as_bytes()),
            None => part.arg(b""),
        }
        match deadline {
            Some(us) => part.arg(figure.format(us).as_bytes()),
            None => part.arg(b""),
        }
        part.arg(figure.format(layers.len()).as_bytes());
        for layer in layers {
            part.arg(&layer.limit.spec[usize::from(layer.dry_run)]);
        }
        if let Some((tags, replaced)) = tags {
            let replaced =
                (0..tags.len()).flat_map(|i| replaced.get(i).map_or([-1; 3], |h| h.replaced));
            let tags = tags.iter().map(|tag| tag.map_or(-1, |t| t as i64));
            part.charges(tags, replaced);
        }
        part
    }

    /// A release: the lease `lease` taken out of every concurrency key in `keys`. Sent
    /// through the batcher, as `ZREM`s in the pipeline of the batch it falls in, ahead of that
    /// batch's `EVALSHA`: it reaches Redis before any decision asked for after it, and does not
    /// depend on the script (a call Redis answers `NOSCRIPT` is sent again after `SCRIPT
    /// LOAD`, when a later batch may have gone ahead of it). Answered `[3]`.
    pub(crate) fn release(keys: &[String], lease: &str) -> Self {
        let mut part = Part {
            bytes: Vec::with_capacity(lease.len() + keys.iter().map(String::len).sum::<usize>()),
            ends: Vec::with_capacity(1 + keys.len()),
            keys: keys.len(),
            release: true,
        };
        for key in keys {
            part.bytes.extend_from_slice(key.as_bytes());
            part.ends.push(part.bytes.len());
        }
        part.arg(lease.as_bytes());
        part
    }

    /// The refund of this decision's charges, from its reply's `figures`, if it charged
    /// (mode `d`, admitted) but its caller never learnt it: the caller stopped waiting (the
    /// store's timeout, or its client left) while Redis, reached in time, decided. `None`
    /// for anything else, or a reply that does not fit the decision.
    pub(crate) fn refund_of(&self, figures: &[i64]) -> Option<Part> {
        let mut args = self.args();
        if self.release || args.next()? != b"d" || figures.first() != Some(&1) {
            return None;
        }
        let (cost, lease, pinned, _deadline) =
            (args.next()?, args.next()?, args.next()?, args.next()?);
        let count = args.next()?;
        let n = std::str::from_utf8(count).ok()?.parse::<usize>().ok()?;
        let held = figures.get(2).is_some_and(|&h| h > 0);
        let per_layer = if held {
            PER_LAYER + REPLACED + AT_PASS
        } else {
            PER_LAYER
        };
        if n != self.keys || figures.len() != HEADER + per_layer * n {
            return None;
        }
        let mut part = Part {
            bytes: Vec::with_capacity(self.bytes.len() + 64 * n),
            ends: Vec::with_capacity(self.ends.len() + 4 * n),
            keys: n,
            release: false,
        };
        for key in self.keys() {
            part.bytes.extend_from_slice(key);
            part.ends.push(part.bytes.len());
        }
        for arg in [&b"r"[..], cost, lease, pinned, b"", count] {
            part.arg(arg);
        }
        for spec in args.take(n) {
            part.arg(spec);
        }
        let tags = (0..n).map(|i| figures[HEADER + PER_LAYER * i + 2]);
        let tail = HEADER + PER_LAYER * n;
        let replaced = (0..n * REPLACED).map(|i| if held { figures[tail + i] } else { -1 });
        part.charges(tags, replaced);
        Some(part)
    }

    /// Whether this is a release ([`Part::release`]).
    pub(crate) fn is_release(&self) -> bool {
        self.release
    }

    /// A release's command, added to `pipe` (its reply ignored): an `EVAL` of a few lines
    /// rather than plain `ZREM`s, whose error on a key of another type (something else wrote
    /// it) would be the whole pipeline's, every decision of the batch failing with it (review);
    /// `EVAL` carries its text, so it never meets `NOSCRIPT`.
    pub(crate) fn push_release(&self, pipe: &mut redis::Pipeline) {
        if let Some(lease) = self.args().next() {
            let cmd = pipe.cmd("EVAL").arg(RELEASE).arg(self.keys);
            for key in self.keys() {
                cmd.arg(key);
            }
            cmd.arg(lease).ignore();
        }
    }

    /// A take-back's last arguments: each layer's tag, then three figures per layer for the
    /// state a window charged ahead replaced (`-1`s: none).
    fn charges(&mut self, tags: impl Iterator<Item = i64>, replaced: impl Iterator<Item = i64>) {
        let mut figure = itoa::Buffer::new();
        for v in tags.chain(replaced) {
            self.arg(figure.format(v).as_bytes());
        }
    }

    fn arg(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
        self.ends.push(self.bytes.len());
    }

    fn pieces(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(&self.ends).map(|(s, &e)| &self.bytes[s..e])
    }

    fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.pieces().take(self.keys)
    }

    fn args(&self) -> impl Iterator<Item = &[u8]> {
        self.pieces().skip(self.keys)
    }
}

/// Builds the `EVALSHA` of `parts`, decided in that order.
pub(crate) fn invocation<'a>(
    sha: &str,
    lease_ttl: Duration,
    parts: impl Iterator<Item = &'a Part> + Clone,
) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha);
    cmd.arg(parts.clone().map(|p| p.keys).sum::<usize>());
    for part in parts.clone() {
        for key in part.keys() {
            cmd.arg(key);
        }
    }
    cmd.arg(lease_ttl.as_micros().to_string())
        .arg(parts.clone().count());
    for part in parts {
        for arg in part.args() {
            cmd.arg(arg);
        }
    }
    cmd
}

/// One request's reply: its figures, packed as little-endian doubles holding integers.
pub(crate) fn unpack(reply: &[u8]) -> Result<Vec<i64>, StoreError> {
    if reply.len() % 8 != 0 {
        return Err(StoreError::Reply(format!(
            "a reply of {} bytes",
            reply.len()
        )));
    }
    let figure = |chunk: &[u8]| {
        let v = f64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        // Every figure is an integer of magnitude below 2^53 (see decide.lua). Checked by a
        // round trip through i64 (two conversions) rather than `fract` (a call of libm's
        // `trunc` per figure, 21 figures a request); NaN becomes 0 and fails the comparison.
        let i = v as i64;
        match i as f64 == v && i.unsigned_abs() < 1 << 53 {
            true => Ok(i),
            false => Err(StoreError::Reply(format!(
                "figure {v} is not an exact integer"
            ))),
        }
    };
    // Sized at once: collecting through `Result` would grow it four times.
    let mut figures = Vec::with_capacity(reply.len() / 8);
    for chunk in reply.chunks_exact(8) {
        figures.push(figure(chunk)?);
    }
    Ok(figures)
}

fn micros(v: i64) -> Option<Duration> {
    u64::try_from(v).ok().map(Duration::from_micros)
}

fn at(v: i64) -> Option<Nanos> {
    u64::try_from(v)
        .ok()
        .filter(|&u| u > 0)
        .map(|u| Nanos(u.saturating_mul(1_000)))
}

fn index(v: i64, layers: usize) -> Result<usize, StoreError> {
    usize::try_from(v)
        .ok()
        .filter(|&i| (1..=layers).contains(&i))
        .map(|i| i - 1)
        .ok_or_else(|| StoreError::Reply(format!("layer {v} out of range")))
}

/// Turns the script's reply into a decision; the admission's lease is attached by the caller.
pub(crate) fn decision(
    reply: &[i64],
    layers: &[Layer<'_>],
    cost: u32,
) -> Result<RemoteDecision, StoreError> {
    if reply.first() == Some(&2) && reply.len() >= 2 {
        let layer = index(reply[1], layers.len())?;
        return Ok(RemoteDecision::CostTooLarge { layer });
    }
    if reply.first() == Some(&4) && reply.len() >= 2 {
        return Err(StoreError::KeyType(index(reply[1], layers.len())?));
    }
    if reply.first() == Some(&5) {
        return Err(StoreError::Expired);
    }
    // A held admission's reply ends with what its windows' charges replaced.
    let held = reply.first() == Some(&1) && reply.get(2).is_some_and(|&h| h > 0);
    let per_layer = if held {
        PER_LAYER + REPLACED + AT_PASS
    } else {
        PER_LAYER
    };
    if reply.len() != HEADER + per_layer * layers.len() {
        return Err(StoreError::Reply(format!("{} integers", reply.len())));
    }
    let tail = HEADER + PER_LAYER * layers.len();
    let at_pass = if held {
        tail + REPLACED * layers.len()
    } else {
        tail
    };
    let replaced = reply[tail..at_pass].chunks_exact(REPLACED);
    let at_pass = reply[at_pass..].chunks_exact(AT_PASS);
    let held = (replaced.zip(at_pass))
        .map(|(r, f)| HeldLayer {
            replaced: [r[0], r[1], r[2]],
            at_pass: (f[0] >= 0).then(|| (u32::try_from(f[0]).unwrap_or(0), micros(f[1]))),
        })
        .collect();
    let now = Nanos(u64::try_from(reply[5]).unwrap_or(0).saturating_mul(1_000));
    let mut reports = Vec::with_capacity(layers.len());
    let mut tags = Vec::with_capacity(layers.len());
    for (layer, f) in layers.iter().zip(reply[HEADER..].chunks_exact(PER_LAYER)) {
        reports.push(LayerReport {
            quota: layer.limit.quota(),
            window: layer.limit.window(),
            remaining: u32::try_from(f[0]).unwrap_or(0),
            reset: micros(f[1]),
            refuses: f[3] != -2,
            wait: micros(f[3]),
            blocked_until: at(f[4]),
        });
        tags.push(u64::try_from(f[2]).ok());
    }
    match reply[0] {
        1 => Ok(RemoteDecision::Admitted(RemoteAdmission {
            hold: hold(reply[2], layers)?,
            reports,
            dry_run_refused: (reply[4] != 0)
                .then(|| index(reply[4], layers.len()))
                .transpose()?,
            now,
            cost,
            tags,
            held,
            lease: None,
        })),
        0 => Ok(RemoteDecision::Refused(RemoteRefusal {
            layer: index(reply[1], layers.len())?,
            wait: micros(reply[2]),
            reason: match at(reply[3]) {
                Some(until) => RefusalReason::Blocked { until },
                None => RefusalReason::Exhausted,
            },
            reports,
            now,
        })),
        other => Err(StoreError::Reply(format!("outcome {other}"))),
    }
}

/// An admitted request's hold, which no enforced layer's `max_delay` is shorter than: a reply
/// past it (a hostile or broken Redis) is refused, rather than holding the request for as long
/// as it says (review: 142 years, on routes with no `delay` limit at all).
fn hold(micros_held: i64, layers: &[Layer<'_>]) -> Result<Duration, StoreError> {
    let hold = micros(micros_held).unwrap_or(Duration::ZERO);
    let most = layers
        .iter()
        .filter(|l| !l.dry_run)
        .filter_map(|l| l.limit.max_delay())
        .max()
        .unwrap_or(Duration::ZERO);
    match hold <= most {
        true => Ok(hold),
        false => Err(StoreError::Reply(format!(
            "a hold of {} us, past every limit's max_delay",
            hold.as_micros()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RemoteLimit;
    use sluice_limiter::{Algorithm, KeyHasher, Limit};
    use std::num::NonZeroU32;

    fn fixed() -> RemoteLimit {
        let quota = NonZeroU32::new(5).unwrap();
        let limit = Limit::new("f", Algorithm::FixedWindow, quota, Duration::from_secs(1));
        RemoteLimit::new(&limit.unwrap()).unwrap()
    }

    #[test]
    fn refusal_reply_names_the_layer_its_wait_and_its_block() {
        let limit = fixed();
        let key = KeyHasher::with_secret(b"s").key(&[b"a"]);
        let layers = [Layer::enforced(&limit, key), Layer::enforced(&limit, key)];
        let reply = [
            0, 2, 250_000, 9_000_000, 0, 8_000_000, 5, 0, -1, -2, 0, 0, 1_000_000, -1, 1_000_000,
            9_000_000,
        ];
        let RemoteDecision::Refused(r) = decision(&reply, &layers, 1).unwrap() else {
            panic!("not a refusal")
        };
        assert_eq!(r.layer, 1);
        assert_eq!(r.wait, Some(Duration::from_millis(250)));
        let until = Nanos(9_000_000_000);
        assert_eq!(r.reason, RefusalReason::Blocked { until });
        assert_eq!(r.reports[0].reset, Some(Duration::ZERO));
        assert_eq!(
            r.refusing().collect::<Vec<_>>(),
            vec![(1, Some(Duration::from_secs(1)))]
        );
    }

    #[test]
    fn packed_replies_unpack_to_their_integers_and_others_are_typed_errors() {
        let figures = [1.0, -1.0, -2.0, 0.0, 1_764_000_000_123_456.0, 21.0];
        let packed: Vec<u8> = figures.iter().flat_map(|f: &f64| f.to_le_bytes()).collect();
        assert_eq!(
            unpack(&packed).unwrap(),
            vec![1, -1, -2, 0, 1_764_000_000_123_456, 21]
        );
        assert!(matches!(unpack(&packed[..7]), Err(StoreError::Reply(_))));
        assert!(matches!(
            unpack(&0.5f64.to_le_bytes()),
            Err(StoreError::Reply(_))
        ));
        assert!(matches!(
            unpack(&f64::NAN.to_le_bytes()),
            Err(StoreError::Reply(_))
        ));
        let edge = 9_007_199_254_740_991.0f64; // 2^53 - 1
        assert_eq!(unpack(&edge.to_le_bytes()).unwrap(), [(1i64 << 53) - 1]);
        assert_eq!(unpack(&(-edge).to_le_bytes()).unwrap(), [1 - (1i64 << 53)]);
        assert_eq!(unpack(&(-0.0f64).to_le_bytes()).unwrap(), [0]);
        for far in [
            2f64.powi(53),
            -(2f64.powi(53)),
            2f64.powi(63),
            f64::INFINITY,
            1e300,
        ] {
            assert!(
                matches!(unpack(&far.to_le_bytes()), Err(StoreError::Reply(_))),
                "{far}"
            );
        }
    }

    #[test]
    fn short_reply_is_a_typed_error() {
        let limit = fixed();
        let key = KeyHasher::with_secret(b"s").key(&[b"a"]);
        let layers = [Layer::enforced(&limit, key)];
        assert!(matches!(
            decision(&[1, 0, -1], &layers, 1),
            Err(StoreError::Reply(_))
        ));
    }

    /// Review: a reply that held a request for 2^52 us (142 years) was obeyed, on a route with
    /// no `delay` limit. A hold is at most the longest `max_delay` of the enforced layers.
    #[test]
    fn a_hold_past_every_limits_max_delay_is_a_bad_reply() {
        let second = Duration::from_secs(1);
        let delayed = Limit::new(
            "d",
            Algorithm::FixedWindow,
            NonZeroU32::new(5).unwrap(),
            second,
        )
        .unwrap()
        .with_max_delay(3 * second)
        .unwrap();
        let delayed = RemoteLimit::new(&delayed).unwrap();
        let plain = fixed();
        let key = KeyHasher::with_secret(b"s").key(&[b"a"]);
        let admitted = |hold: i64| {
            let mut reply = vec![1, 0, hold, 0, 0, 8_000_000, 4, 0, 1, -2, 0];
            if hold > 0 {
                // A held admission's: nothing replaced, the decision's figures stand.
                reply.extend([-1, -1, -1, -1, -1]);
            }
            reply
        };
        let held = |layers: &[Layer<'_>], hold: i64| match decision(&admitted(hold), layers, 1) {
            Ok(RemoteDecision::Admitted(a)) => Ok(a.hold),
            Ok(_) => panic!("not an admission"),
            Err(e) => Err(e),
        };
        let with_delay = [Layer::enforced(&delayed, key)];
        assert_eq!(held(&with_delay, 2_000_000).unwrap(), 2 * second);
        assert_eq!(held(&with_delay, 3_000_000).unwrap(), 3 * second);
        assert!(matches!(
            held(&with_delay, 3_000_001),
            Err(StoreError::Reply(_))
        ));
        let without = [Layer::enforced(&plain, key)];
        assert_eq!(held(&without, -1).unwrap(), Duration::ZERO);
        assert!(matches!(held(&without, 1 << 52), Err(StoreError::Reply(_))));
        // A dry-run layer holds nothing.
        let dry = [Layer::dry_run(&delayed, key)];
        assert!(matches!(held(&dry, 1_000_000), Err(StoreError::Reply(_))));
    }
}
