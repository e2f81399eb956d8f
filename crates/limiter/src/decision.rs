//! What a decision returns: an admission (with its guards), a refusal, or a cost that can never
//! fit; and, for each limit involved, the figures for response headers.

use smallvec::SmallVec;
use std::sync::Arc;
use std::time::Duration;

use crate::algo::{Algo, Rule, Step};
use crate::clock::Nanos;
use crate::table::Table;
use crate::{Key, Limiter};

/// Layers held inline; a request against more limits spills to the heap.
pub(crate) const INLINE_LAYERS: usize = 4;

/// A limit's index within its [`Limiter`].
///
/// Aligned like a [`Key`]'s words, so that a layer `(LimitId, Key)` is three whole words:
/// with a 4-byte id, callers building `[(LimitId, Key)]` copied each layer as 4 + 16 bytes at
/// odd offsets, and the decision's first read of it waited on those stores (perf: about a
/// sixth of a hot-key decision in the bench's harness).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(align(8))]
pub struct LimitId(pub(crate) u32);

impl LimitId {
    /// The position of the limit in the list given to [`Limiter::new`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One limit's figures after a decision, as the `RateLimit` header's `q`, `w`, `r`, `t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// The limit.
    pub limit: LimitId,
    /// `q`: the quota (a token bucket's burst; a concurrency limit's slots).
    pub quota: u32,
    /// `w`: the window; for a token bucket, the time to refill a full bucket. `None` for
    /// concurrency, which has no window.
    pub window: Option<Duration>,
    /// `r`: quota remaining after this request (0 while blocked).
    pub remaining: u32,
    /// `t`: after an admission, the time until the remaining quota grows (zero when full); after
    /// a refusal, for a limit that would not admit the request, the time until it would (for
    /// one that would, as after an admission). For concurrency, zero while a slot
    /// is free, else `None`: slots free when requests end, not with time.
    pub reset: Option<Duration>,
}

/// One limit's part in a decision: enough to report on it and to take its charge back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layer {
    pub(crate) key: Key,
    /// The state after this request's charge (admitted) or as seen (not admitted), as two
    /// words: a `u128` would align the layer to 16 bytes and grow every decision.
    state: [u64; 2],
    /// Admitted: the charge's window, for refunds. Not admitted: when a block on this key
    /// ends, or 0 if it is not blocked.
    aux: u64,
    pub(crate) limit: LimitId,
}

impl Layer {
    pub(crate) fn admitted(limit: LimitId, key: Key, state: u128, tag: u64) -> Self {
        Layer {
            key,
            state: [state as u64, (state >> 64) as u64],
            aux: tag,
            limit,
        }
    }

    pub(crate) fn pending(limit: LimitId, key: Key, state: u128, blocked: Option<u64>) -> Self {
        let state = [state as u64, (state >> 64) as u64];
        Layer {
            key,
            state,
            aux: blocked.unwrap_or(0),
            limit,
        }
    }

    pub(crate) fn state(&self) -> u128 {
        u128::from(self.state[0]) | (u128::from(self.state[1]) << 64)
    }

    pub(crate) fn set_state(&mut self, state: u128) {
        self.state = [state as u64, (state >> 64) as u64];
    }

    pub(crate) fn tag(&self) -> u64 {
        self.aux
    }

    pub(crate) fn blocked_until(&self) -> Option<u64> {
        (self.aux != 0).then_some(self.aux)
    }

    pub(crate) fn block(&mut self, until: u64) {
        self.aux = until;
    }
}

pub(crate) type Layers = SmallVec<[Layer; INLINE_LAYERS]>;
// `Decision::holds_nothing` relies on layers being plain data.
const _: () = assert!(!std::mem::needs_drop::<Layer>());

/// A concurrency slot, released when dropped.
#[derive(Debug)]
pub(crate) struct SlotGuard {
    pub(crate) table: Arc<Table>,
    pub(crate) key: Key,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.table.existing(self.key, |state| {
            // Not a plain decrement: a zero count must not wrap.
            state.update(|n| n.checked_sub(1))
        });
    }
}

/// The outcome of [`Limiter::decide`] (or [`Limiter::check`]).
#[derive(Debug)]
#[must_use = "an admission holds concurrency slots until dropped"]
pub enum Decision {
    /// Every limit admitted the request and was charged.
    Admitted(Admission),
    /// A limit refused the request; no limit was charged.
    Refused(Refusal),
    /// The cost exceeds a limit's capacity: the request can never pass, however long it waits.
    CostTooLarge(CostTooLarge),
}

/// An admitted request. Dropping it releases its concurrency slots (quota charges stay);
/// [`Limiter::refund`] takes every charge back. (A field that needs dropping, other than
/// `layers`, `slots` and `before`, must be known to `Decision::holds_nothing`.)
#[derive(Debug)]
pub struct Admission {
    pub(crate) limiter: u64,
    pub(crate) cost: u32,
    pub(crate) now: u64,
    /// How long to hold the request before it conforms to every limit (limits with a
    /// `max_delay` only).
    pub(crate) wait: u64,
    /// False for [`Limiter::check`]'s answer, which charged nothing.
    pub(crate) charged: bool,
    pub(crate) layers: Layers,
    pub(crate) slots: SmallVec<[SlotGuard; 1]>,
    /// For each window charged ahead of time (a held request), its position in `layers` and
    /// the state the charge replaced, to put back if nobody was charged since. Empty, and not
    /// allocated, unless a window holds the request.
    pub(crate) before: Vec<(usize, u128)>,
}

impl Admission {
    /// How long to hold the request before forwarding it: zero unless a limit with a
    /// `max_delay` ([`crate::Limit::with_max_delay`]) admitted it ahead of time. The charges
    /// are already made; hold it, do not decide again.
    pub fn wait(&self) -> Duration {
        Duration::from_nanos(self.wait)
    }

    /// Moves the admission out, leaving in its place one that charges and holds nothing: for
    /// a caller lent the decision ([`crate::Limiter::decide_with`]) that must keep the charges
    /// past it, e.g. to [`crate::Limiter::withdraw`] a held request whose client leaves.
    pub fn take(&mut self) -> Admission {
        let charged = std::mem::replace(&mut self.charged, false);
        Admission {
            limiter: self.limiter,
            cost: self.cost,
            now: self.now,
            wait: self.wait,
            charged,
            layers: std::mem::take(&mut self.layers),
            slots: std::mem::take(&mut self.slots),
            before: std::mem::take(&mut self.before),
        }
    }

    /// Takes what of the admission must live until the request ends: its concurrency slots
    /// (released when dropped). A few words, against the whole admission's ~270 bytes, for a
    /// caller that keeps them in each request's state. A refund after this takes back the
    /// quota charges only.
    pub fn take_slots(&mut self) -> Slots {
        Slots {
            _guards: std::mem::take(&mut self.slots),
        }
    }
}

/// The concurrency slots of an admission ([`Admission::take_slots`]), released when dropped.
#[derive(Debug)]
#[must_use = "dropping it releases the slots at once"]
pub struct Slots {
    /// Held only to be dropped.
    _guards: SmallVec<[SlotGuard; 1]>,
}

/// Why a limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalReason {
    /// The limit's quota is used up for now (this refusal may have started a block).
    Exhausted,
    /// An earlier refusal blocked the key until `until`, whatever the counters say.
    Blocked {
        /// When the block ends.
        until: Nanos,
    },
}

/// A refused request: nothing was charged. (Plain data but for `layers`: see
/// `Decision::holds_nothing`.)
#[derive(Debug, Clone)]
pub struct Refusal {
    pub(crate) limit: LimitId,
    pub(crate) wait: Option<Duration>,
    pub(crate) reason: RefusalReason,
    pub(crate) cost: u32,
    pub(crate) now: u64,
    pub(crate) layers: Layers,
}

impl Refusal {
    /// The refusing limit with the longest wait.
    pub fn limit(&self) -> LimitId {
        self.limit
    }

    /// How long until the request would pass every refusing limit, exact to the nanosecond;
    /// `None` when only concurrency limits refused (slots free when requests end).
    pub fn wait(&self) -> Option<Duration> {
        self.wait
    }

    /// Why [`Refusal::limit`] refused.
    pub fn reason(&self) -> RefusalReason {
        self.reason
    }
}

/// A request whose cost exceeds a limit's capacity (a token bucket's burst, a window's quota).
/// (Plain data but for `layers`: see `Decision::holds_nothing`.)
#[derive(Debug, Clone)]
pub struct CostTooLarge {
    pub(crate) limit: LimitId,
    pub(crate) capacity: u32,
    pub(crate) cost: u32,
    pub(crate) now: u64,
    pub(crate) layers: Layers,
}

impl CostTooLarge {
    /// The first limit whose capacity is below the cost.
    pub fn limit(&self) -> LimitId {
        self.limit
    }

    /// That limit's capacity.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }
}

impl Decision {
    /// Whether dropping it would do nothing: no concurrency slot to release and no layers on
    /// the heap (every other field of every variant is plain data). Lets
    /// [`Limiter::decide_with`] skip the drop.
    #[inline]
    pub(crate) fn holds_nothing(&self) -> bool {
        match self {
            // A refund clears the slots but keeps a spilled buffer: spilled counts too.
            Decision::Admitted(a) => {
                a.slots.is_empty()
                    && !a.slots.spilled()
                    && !a.layers.spilled()
                    && a.before.capacity() == 0
            }
            Decision::Refused(r) => !r.layers.spilled(),
            Decision::CostTooLarge(c) => !c.layers.spilled(),
        }
    }

    /// Whether the request was admitted.
    pub fn is_admitted(&self) -> bool {
        matches!(self, Decision::Admitted(_))
    }

    /// One [`Report`] per limit of the decision, in the order they were given.
    pub fn reports<'a>(&'a self, limiter: &'a Limiter) -> impl Iterator<Item = Report> + 'a {
        let (layers, cost, now, admitted) = match self {
            Decision::Admitted(a) => (&a.layers, a.cost, a.now, true),
            Decision::Refused(r) => (&r.layers, r.cost, r.now, false),
            Decision::CostTooLarge(c) => (&c.layers, c.cost, c.now, false),
        };
        reports(layers, cost, now, admitted, limiter)
    }
}

impl Admission {
    /// One [`Report`] per limit, in the order they were given: the figures after this charge,
    /// at the decision (for a held request, before its [`Admission::wait`]).
    pub fn reports<'a>(&'a self, limiter: &'a Limiter) -> impl Iterator<Item = Report> + 'a {
        reports(&self.layers, self.cost, self.now, true, limiter)
    }
}

impl Refusal {
    /// One [`Report`] per limit, in the order they were given: the figures as seen, nothing
    /// charged.
    pub fn reports<'a>(&'a self, limiter: &'a Limiter) -> impl Iterator<Item = Report> + 'a {
        reports(&self.layers, self.cost, self.now, false, limiter)
    }

    /// Every limit that refused, with its own wait (the rest of a block; `None` for a full
    /// concurrency limit). [`Refusal::limit`] is the one with the longest wait. A limit that
    /// would have held the request (its wait within its `max_delay`) did not refuse.
    pub fn refusing<'a>(
        &'a self,
        limiter: &'a Limiter,
    ) -> impl Iterator<Item = (LimitId, Option<Duration>)> + 'a {
        self.layers.iter().filter_map(move |layer| {
            let wait = match layer.blocked_until() {
                Some(until) => Some(until.saturating_sub(self.now)),
                None => match limiter
                    .rule(layer.limit)
                    .eval(layer.state(), self.cost, self.now)
                {
                    Step::Admit { .. } => return None,
                    Step::Refuse { wait: Some(w) } if w <= limiter.ahead(layer.limit) => {
                        return None
                    }
                    Step::Refuse { wait } => wait,
                },
            };
            Some((layer.limit, wait.map(Duration::from_nanos)))
        })
    }
}

fn reports<'a>(
    layers: &'a Layers,
    cost: u32,
    now: u64,
    admitted: bool,
    limiter: &'a Limiter,
) -> impl Iterator<Item = Report> + 'a {
    layers.iter().map(move |layer| {
        let rule = limiter.rule(layer.limit);
        let (remaining, reset) = if admitted {
            rule.after_admission(layer.state(), now)
        } else if let Some(until) = layer.blocked_until() {
            (0, Some(until.saturating_sub(now)))
        } else {
            match rule.pending(layer.state(), cost, now) {
                // A limit that would admit the request (another refused it) reports like an
                // admission, on its state as it is: when its remaining quota grows.
                (_, Some(0)) => rule.after_admission(layer.state(), now),
                pending => pending,
            }
        };
        Report::of(rule, layer.limit, remaining, reset)
    })
}

impl Report {
    pub(crate) fn of(rule: &Rule, limit: LimitId, remaining: u32, reset: Option<u64>) -> Report {
        Report {
            limit,
            quota: rule.quota(),
            window: rule.window().map(Duration::from_nanos),
            remaining,
            reset: reset.map(Duration::from_nanos),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Algorithm, KeyHasher, Limit, Limiter, Nanos};
    use std::num::NonZeroU32;
    use std::time::Duration;

    /// The figures as they stand ([`Limiter::figures`]): after an admission of any cost is
    /// refunded, they are those from before it, and they never say more is left than before,
    /// also when a `delay` limit held the request (a fixed window that charged a held request
    /// into its next window has given up the rest of the current one). Checked for every
    /// algorithm, from states reached by earlier requests spread over two windows.
    #[test]
    fn figures_after_a_refund_are_those_from_before_it() {
        let q = NonZeroU32::new(10).unwrap();
        let algorithms = [
            Algorithm::TokenBucket {
                burst: NonZeroU32::new(6).unwrap(),
            },
            Algorithm::TokenBucket { burst: q },
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::Concurrency,
        ];
        let second = 1_000_000_000;
        for algorithm in algorithms {
            for delay in [false, true] {
                let limit = Limit::new("l", algorithm, q, Duration::from_secs(1)).unwrap();
                let limit = match delay && algorithm != Algorithm::Concurrency {
                    true => limit.with_max_delay(Duration::from_secs(2)).unwrap(),
                    false => limit,
                };
                let limiter = Limiter::new([limit]).unwrap();
                let key = KeyHasher::with_secret(b"t").key(&[b"k"]);
                let layers = [(limiter.id("l").unwrap(), key)];
                let figures = |now: Nanos| limiter.figures(&layers, now).next().unwrap();
                let fresh = figures(Nanos(0));
                assert_eq!(fresh.remaining, fresh.quota, "{algorithm:?}");
                assert_eq!(fresh.reset, Some(Duration::ZERO), "{algorithm:?}");
                let mut kept = Vec::new();
                let mut were_held = 0;
                for step in 0..40u64 {
                    let now = Nanos(step * second / 13);
                    if step % 2 == 0 {
                        kept.push(limiter.decide(&layers, 2, now));
                    }
                    for cost in 1..=6 {
                        let before = figures(now);
                        let held = limiter.decide_with(&layers, cost, now, |d| match d {
                            super::Decision::Admitted(a) => {
                                let held = !a.wait().is_zero();
                                limiter.refund(a, now);
                                Some(held)
                            }
                            _ => None,
                        });
                        let after = figures(now);
                        let what = format!("{algorithm:?} delay {delay} step {step} cost {cost}");
                        match held {
                            Some(true) => {
                                were_held += 1;
                                assert!(after.remaining <= before.remaining, "{what}");
                            }
                            _ => assert_eq!(after, before, "{what}"),
                        }
                    }
                }
                let can_hold = delay && algorithm != Algorithm::Concurrency;
                assert_eq!(were_held > 0, can_hold, "{algorithm:?} delay {delay}");
            }
        }
    }

    /// Two concurrency limits put an admission's slots on the heap; a refund empties them but
    /// keeps the buffer, so the decision must still be dropped, not forgotten.
    #[test]
    fn a_refunded_admission_with_spilled_slots_still_holds_something() {
        let one = NonZeroU32::new(1).unwrap();
        let limit = |name: &str| {
            Limit::new(name, Algorithm::Concurrency, one, Duration::from_secs(1)).unwrap()
        };
        let limiter = Limiter::new([limit("a"), limit("b")]).unwrap();
        let key = KeyHasher::with_secret(b"t").key(&[b"k"]);
        let layers = [
            (limiter.id("a").unwrap(), key),
            (limiter.id("b").unwrap(), key),
        ];
        limiter.decide_with(&layers, 1, Nanos(0), |d| {
            assert!(d.is_admitted());
            assert!(!d.holds_nothing(), "holds two slots");
            let super::Decision::Admitted(a) = d else {
                unreachable!()
            };
            limiter.refund(a, Nanos(0));
            assert!(a.slots.is_empty());
            assert!(!d.holds_nothing(), "the slots' heap buffer is still owned");
        });
    }
}
