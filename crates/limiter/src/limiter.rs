//! The limiter: one keyed table per limit, and the all-or-nothing decision across limits.
//!
//! The admit path (`decide`, `charge_all`) lives here; what a refused request reports is in
//! [`refusal`].

mod refusal;

use smallvec::SmallVec;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::algo::{Algo, Charge, Gcra, Rule, Step};
use crate::clock::{duration_to_nanos, Nanos};
use crate::decision::{
    Admission, Decision, Layer, Layers, LimitId, Report, SlotGuard, INLINE_LAYERS,
};
use crate::table::{Expiry, Moved, State, Table, TableStats};
use crate::{Key, Limit};

/// Why a set of limits could not make a limiter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimiterError {
    /// Two limits share a name (headers name limits, so names must be unique).
    #[error("two limits are named {0:?}")]
    DuplicateName(String),
}

/// What a refusing limit saw while charging: its state and its wait.
type Seen = (u128, Option<u64>);

/// Why charging stopped before the last layer.
enum Stop {
    /// A limit's capacity is below the cost (found before anything is charged).
    TooLarge,
    /// The layer at this position refused; what it saw (`None`: the key is blocked).
    Refused(usize, Option<Seen>),
}

/// What a charge left: the key's new state, the charge's tag (for a refund), and how long the
/// request must be held before it conforms (0 unless the limit lets requests be held).
type Charged = (u128, u64, u64);

/// What [`charge`] tells its caller beside the charge: how long to hold the request (the
/// longest of the limits'), and the state before a window's charge made ahead of time.
struct Held<'a> {
    wait: &'a mut u64,
    before: Option<u128>,
}

/// Charges `cost` to one key's `state` by compare-and-swap: the new state and the charge's tag,
/// or the state that refused it and its wait. A limit that may hold requests up to `ahead`
/// nanoseconds admits one that would pass within that time, charged as of the moment it will
/// pass, and raises `held.wait` to its hold (an out-parameter, so that the common path, which
/// holds nothing, carries no wait). A window charged ahead also leaves in `held.before` the
/// state it replaced: its window may be a later one, and taking the count back from there
/// would leave the current window read as spent.
///
/// A token bucket in a 64-bit table (nearly every one) is charged by a loop of its own: the
/// general loop sets up every algorithm's 128-bit constants before its first step, which
/// was half the cost of an admission. Whatever that loop does not admit goes to the general
/// one, which decides again from a fresh read.
#[inline]
fn charge(
    rule: &Rule,
    state: State<'_>,
    cost: u32,
    now: u64,
    ahead: u64,
    held: &mut Held<'_>,
) -> Result<Result<(u128, u64), Seen>, Moved> {
    if let (Rule::Gcra(gcra), State::Narrow(word)) = (rule, state) {
        if let Some(next) = admit_narrow(gcra, word, cost, now) {
            return Ok(Ok((u128::from(next), 0)));
        }
    }
    let ((next, tag, wait), before) = match charge_any(rule, state, cost, now, ahead)? {
        Ok(charged) => charged,
        Err(seen) => return Ok(Err(seen)),
    };
    *held.wait = (*held.wait).max(wait);
    if wait > 0 && !matches!(rule, Rule::Gcra(_)) {
        held.before = Some(before);
    }
    Ok(Ok((next, tag)))
}

/// A token bucket's admission in a narrow word, by compare-and-swap: the new state, or `None`
/// having charged nothing, when the bucket refuses, the word holds a mark, or the limit needs
/// the wide arithmetic (the general loop then decides from a fresh read).
#[inline(always)]
fn admit_narrow(gcra: &Gcra, word: &AtomicU64, cost: u32, now: u64) -> Option<u64> {
    let mut tat = word.load(Ordering::Acquire);
    // A mark (above the highest state) leaves the loop; the general one reports it.
    while tat <= State::NARROW_LIVE_MAX {
        let next = gcra
            .admit_narrow(tat, cost, now)?
            .min(State::NARROW_LIVE_MAX);
        match word.compare_exchange_weak(tat, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(next),
            Err(actual) => tat = actual,
        }
    }
    None
}

/// [`charge`] for any rule and word, with the state the charge replaced. A request held for
/// `wait` is decided as it will be when it passes, at `now + wait`, and charged so now:
/// whoever comes later finds that charge and queues behind it.
#[inline(never)]
fn charge_any(
    rule: &Rule,
    state: State<'_>,
    cost: u32,
    now: u64,
    ahead: u64,
) -> Result<Result<(Charged, u128), Seen>, Moved> {
    let mut current = state.load()?;
    loop {
        let charged = match eval_ahead(rule, current, cost, now, ahead) {
            Ok(charged) => charged,
            Err(seen) => return Ok(Err(seen)),
        };
        match state.compare_exchange_weak(current, charged.0)? {
            Ok(()) => return Ok(Ok((charged, current))),
            Err(actual) => current = actual,
        }
    }
}

/// [`Algo::eval`] for a limit that may hold a request up to `ahead` nanoseconds: a request
/// refused now but passing within that time is admitted as it will be when it passes.
fn eval_ahead(rule: &Rule, state: u128, cost: u32, now: u64, ahead: u64) -> Result<Charged, Seen> {
    match rule.eval(state, cost, now) {
        Step::Admit { state, tag } => Ok((state, tag, 0)),
        Step::Refuse { wait: Some(wait) } if wait <= ahead => match rule {
            Rule::Gcra(gcra) => Ok((gcra.charge_ahead(state, cost, now), 0, wait)),
            _ => match rule.eval(state, cost, now.saturating_add(wait)) {
                Step::Admit { state, tag } => Ok((state, tag, wait)),
                // Not reached: a wait is when the same request passes.
                Step::Refuse { .. } => Err((state, Some(wait))),
            },
        },
        Step::Refuse { wait } => Err((state, wait)),
    }
}

/// A limit with its rule and tables.
#[derive(Debug)]
struct Compiled {
    limit: Limit,
    rule: Rule,
    capacity: Option<u32>,
    /// How long this limit may hold a request, in nanoseconds (0: it refuses at once).
    ahead: u64,
    table: Arc<Table>,
    /// Blocked keys and when their block ends, for limits with `block_for`.
    blocks: Option<(u64, Table)>,
}

impl Compiled {
    /// The admission of a request by a token bucket without `block_for`, whose key is
    /// already in a narrow table: the key's new state, or `None` having charged nothing (for
    /// [`Limiter::charge_all`] to decide). Exactly what `charge_all` does for such a limit
    /// when the request conforms.
    #[inline(always)]
    fn charge_alone(&self, key: Key, cost: u32, now: u64) -> Option<u128> {
        match (&self.rule, &self.blocks) {
            // A `u64` out of the table's closure: an `Option<u128>` came back through memory.
            (Rule::Gcra(gcra), None) => (self.table)
                .narrow_present(key, |word| admit_narrow(gcra, word, cost, now))
                .map(u128::from),
            _ => None,
        }
    }
}

/// Decides requests against a fixed set of limits. Share it (e.g. in an `Arc`); every method
/// takes `&self` and no lock is global: each limit's table is sharded.
#[derive(Debug)]
pub struct Limiter {
    id: u64,
    limits: Box<[Compiled]>,
    /// The smallest capacity of any limit: a cost up to it fits every limit.
    min_capacity: u32,
}

/// Distinguishes limiters, so an admission is never refunded to the wrong one.
static NEXT_LIMITER: AtomicU64 = AtomicU64::new(1);

impl Limiter {
    /// A limiter for `limits`; their [`LimitId`]s are their positions in this list.
    pub fn new(limits: impl IntoIterator<Item = Limit>) -> Result<Self, LimiterError> {
        let mut names = HashSet::new();
        let mut compiled = Vec::new();
        for limit in limits {
            if !names.insert(limit.name().to_owned()) {
                return Err(LimiterError::DuplicateName(limit.name().to_owned()));
            }
            let rule = Rule::new(&limit);
            let interval = duration_to_nanos(limit.window());
            let narrow = rule.fits_narrow();
            let table = Table::new(limit.max_keys(), Expiry::Rule(rule), interval, narrow);
            let table = Arc::new(table);
            let blocks = limit.block_for().map(|d| {
                let table = Table::new(limit.max_keys(), Expiry::Deadline, interval, true);
                (duration_to_nanos(d), table)
            });
            let capacity = limit.capacity();
            let ahead = limit.max_delay().map_or(0, duration_to_nanos);
            compiled.push(Compiled {
                limit,
                rule,
                capacity,
                ahead,
                table,
                blocks,
            });
        }
        let min_capacity = compiled
            .iter()
            .filter_map(|c| c.capacity)
            .min()
            .unwrap_or(u32::MAX);
        Ok(Limiter {
            id: NEXT_LIMITER.fetch_add(1, Ordering::Relaxed),
            limits: compiled.into_boxed_slice(),
            min_capacity,
        })
    }

    /// The id of the limit named `name`.
    pub fn id(&self, name: &str) -> Option<LimitId> {
        let i = self.limits.iter().position(|c| c.limit.name() == name)?;
        Some(LimitId(i as u32))
    }

    /// Every limit's id, in the order of the list given to [`Limiter::new`] (no search by
    /// name: [`Limiter::id`] looks through the limits).
    pub fn ids(&self) -> impl ExactSizeIterator<Item = LimitId> + use<> {
        (0..self.limits.len() as u32).map(LimitId)
    }

    /// The definition of limit `id`.
    ///
    /// # Panics
    /// If `id` does not belong to this limiter.
    pub fn limit(&self, id: LimitId) -> &Limit {
        &self.limits[id.index()].limit
    }

    pub(crate) fn rule(&self, id: LimitId) -> &Rule {
        &self.limits[id.index()].rule
    }

    /// How long limit `id` may hold a request, in nanoseconds.
    pub(crate) fn ahead(&self, id: LimitId) -> u64 {
        self.limits[id.index()].ahead
    }

    /// Decides a request of `cost` against every `(limit, key)` at `now`: either admits it and
    /// charges every limit, or refuses it and charges none. Concurrency limits take one slot
    /// per request whatever the cost. A cost of zero charges nothing and is always admitted
    /// (unless a key is blocked or a concurrency limit is full).
    ///
    /// Limits are charged in order by compare-and-swap; if a later one refuses, the earlier
    /// charges are taken back at `now`. A concurrent request may meanwhile see a charge that is
    /// then taken back and be refused. Windows take a charge back exactly. A token bucket gives
    /// back what is still owed of the charge at `now` ([`Limiter::refund`]); a concurrent
    /// request whose `now` was read later, and found the bucket refilled past this charge, may
    /// in the worst case keep the time between the two readings as extra tokens (a bucket
    /// earning a token a microsecond, with readings 5 us apart on purpose, admitted a second
    /// request in about 1 instant of 1,000; at a token a millisecond, nanoseconds apart, a
    /// thousandth of a token per such race).
    ///
    /// # Panics
    /// If a [`LimitId`] does not belong to this limiter.
    pub fn decide(&self, layers: &[(LimitId, Key)], cost: u32, now: Nanos) -> Decision {
        self.decide_with(layers, cost, now, |decision| {
            let empty = self.empty_admission(0, cost, now.0, false);
            std::mem::replace(decision, Decision::Admitted(empty))
        })
    }

    /// Decides like [`Limiter::decide`] and lends the decision to `f` in the place it was
    /// built. A [`Decision`] is about 270 bytes: returning one copies it (a `memcpy`, a sixth of
    /// a hot-key decision's instructions under callgrind), lending it does not. What must
    /// outlive `f` is taken with [`Admission::take_slots`].
    ///
    /// # Panics
    /// If a [`LimitId`] does not belong to this limiter.
    #[inline]
    pub fn decide_with<R>(
        &self,
        layers: &[(LimitId, Key)],
        cost: u32,
        now: Nanos,
        f: impl FnOnce(&mut Decision) -> R,
    ) -> R {
        let admission = self.empty_admission(layers.len(), cost, now.0, true);
        let mut decision = Decision::Admitted(admission);
        if let Decision::Admitted(admission) = &mut decision {
            // A token bucket alone (one per-IP limit, say) has a path of its own: through
            // `charge_all` (a call, in the bench build, with the bookkeeping of every kind of
            // limit) a hot-key decision took about 60 instructions more, and the bench's
            // random keys up to twice the time (docs/benchmarks.md, "Stop 37").
            let alone = match layers {
                &[(limit, key)] => (self.limits[limit.index()].charge_alone(key, cost, now.0))
                    .map(|state| admission.layers.push(Layer::admitted(limit, key, state, 0))),
                _ => None,
            };
            if alone.is_none() {
                if let Err(stop) = self.charge_all(admission, layers, cost, now.0) {
                    decision = self.not_admitted(admission, layers, stop, cost, now.0);
                }
            }
        }
        let result = f(&mut decision);
        if decision.holds_nothing() {
            // Its drop would only look through empty and inline vectors: about 25 of a hot-key
            // decision's ~320 instructions (callgrind). It holds nothing, so nothing leaks.
            std::mem::forget(decision);
        }
        result
    }

    /// Charges every layer in order into `admission`, or says why it stopped. The caller
    /// takes back what was charged.
    #[inline]
    fn charge_all(
        &self,
        admission: &mut Admission,
        layers: &[(LimitId, Key)],
        cost: u32,
        now: u64,
    ) -> Result<(), Stop> {
        let too_large = |&(limit, _): &(LimitId, Key)| matches!(self.limits[limit.index()].capacity, Some(cap) if cost > cap);
        if cost > self.min_capacity && layers.iter().any(too_large) {
            return Err(Stop::TooLarge);
        }
        for (position, &(limit, key)) in layers.iter().enumerate() {
            let c = &self.limits[limit.index()];
            if c.blocks.is_some() && c.blocked_until(key, now).is_some() {
                return Err(Stop::Refused(position, None));
            }
            // The admission is recorded inside the closure and the closure answers only
            // whether it refused: a charge's result is 48 bytes, and returning it through the
            // table's lookups copied it via the stack, where its reload waited on the stores
            // (perf: about a fifth of a hot-key decision). Run again under the shard's lock
            // if the entry moved: a `Moved` charged and recorded nothing.
            let mut refused = None;
            // Inlined into both of the table's paths: out of line (it has two callers) it
            // cost a hot-key decision about 30 instructions of call and captures.
            let admitted = c.table.update(
                key,
                now,
                #[inline(always)]
                |s| {
                    let mut held = Held {
                        wait: &mut admission.wait,
                        before: None,
                    };
                    match charge(&c.rule, s, cost, now, c.ahead, &mut held)? {
                        Ok((state, tag)) => {
                            if let Some(before) = held.before {
                                admission.before.push((position, before));
                            }
                            let layer = Layer::admitted(limit, key, state, tag);
                            admission.layers.push(layer);
                            Ok(true)
                        }
                        Err(seen) => {
                            refused = Some(seen);
                            Ok(false)
                        }
                    }
                },
            );
            if !admitted {
                return Err(Stop::Refused(position, refused));
            }
            if c.rule.counts_requests() {
                let table = Arc::clone(&c.table);
                admission.slots.push(SlotGuard { table, key });
            }
        }
        Ok(())
    }

    /// The decision when [`Limiter::charge_all`] stopped: what it charged is taken back.
    #[cold]
    #[inline(never)]
    fn not_admitted(
        &self,
        admission: &mut Admission,
        layers: &[(LimitId, Key)],
        stop: Stop,
        cost: u32,
        now: u64,
    ) -> Decision {
        self.take_back(admission, false, now);
        admission.slots.clear(); // releases its slots before the refusal looks at them
        match stop {
            Stop::TooLarge => match self.too_large(layers, cost, now) {
                Some(too_large) => Decision::CostTooLarge(too_large),
                None => unreachable!("a capacity below the cost was found"),
            },
            Stop::Refused(position, first) => {
                Decision::Refused(self.refusal(layers, position, first, cost, now))
            }
        }
    }

    /// Decides like [`Limiter::decide`] but charges nothing and starts no block: "would this
    /// pass?", e.g. for limits in dry-run mode. An admission it returns holds no slots, and
    /// refunding it changes nothing.
    pub fn check(&self, layers: &[(LimitId, Key)], cost: u32, now: Nanos) -> Decision {
        if let Some(too_large) = self.too_large(layers, cost, now.0) {
            return Decision::CostTooLarge(too_large);
        }
        let mut admission = self.empty_admission(layers.len(), cost, now.0, false);
        for &(limit, key) in layers {
            let c = &self.limits[limit.index()];
            let blocked = c.blocked_until(key, now.0).is_some();
            match eval_ahead(&c.rule, c.table.load(key), cost, now.0, c.ahead) {
                Ok((state, tag, wait)) if !blocked => {
                    admission.wait = admission.wait.max(wait);
                    admission
                        .layers
                        .push(Layer::admitted(limit, key, state, tag));
                }
                _ => return Decision::Refused(self.refusal_unchecked(layers, cost, now.0, false)),
            }
        }
        Decision::Admitted(admission)
    }

    /// Each limit's figures for its key as they stand at `now`, charging nothing: what a caller
    /// not served after all is told (the gateway's 503 at capacity, after [`Limiter::refund`]).
    /// `r` is what is left, `t` the time until it grows (zero when full); a blocked key has 0
    /// left until its block ends.
    ///
    /// # Panics
    /// If a [`LimitId`] does not belong to this limiter.
    pub fn figures<'a>(
        &'a self,
        layers: &'a [(LimitId, Key)],
        now: Nanos,
    ) -> impl Iterator<Item = Report> + 'a {
        layers.iter().map(move |&(limit, key)| {
            let c = &self.limits[limit.index()];
            let (remaining, reset) = match c.blocked_until(key, now.0) {
                Some(until) => (0, Some(until.saturating_sub(now.0))),
                None => c.rule.after_admission(c.table.load(key), now.0),
            };
            Report::of(&c.rule, limit, remaining, reset)
        })
    }

    /// Takes back every charge of `admission` at `now` and releases the slots it still holds,
    /// e.g. when the gateway answers 503 at capacity. Windows get the charge back while its
    /// window still counts (one charged ahead into a later window for a held request gets its
    /// earlier state back, if nobody was charged since: else the windows before that later one
    /// would read as spent); a token bucket gets back what is still owed of it at `now` (once
    /// the bucket has refilled past the charge there is nothing left to give back, and giving
    /// it back anyway would undo a later request's charge). Pass the current time: an `now`
    /// earlier than a charge made since by another request could give part of that one back.
    ///
    /// A token bucket keeps one time per key, not the history of its charges, so what is owed
    /// is worked out from the time this charge left: exact for a refund made soon after the
    /// charge (as the gateway's are, within microseconds). Made later, it errs both ways by up
    /// to the time since the charge: a charge under later ones is owed whole while the bucket
    /// stays in debt, but gets back only what its own time still covers (ten requests at once
    /// at 10 per second, the first refunded 100 ms later, gets nothing back); and after another
    /// request of the key was refunded meanwhile, that time overstates what is owed (a burst
    /// of 2 charged twice, the first refunded at once and the second a second later, after a
    /// third request, let two more through). Windows are exact. Also exact but for keys
    /// evicted or swept in between. The admission is left charging nothing: refunding it again
    /// changes nothing.
    ///
    /// # Panics
    /// If `admission` came from another limiter.
    pub fn refund(&self, admission: &mut Admission, now: Nanos) {
        self.give_back(admission, false, now);
    }

    /// Takes back an admission whose request will not be served after all, typically one held
    /// by a `max_delay` limit whose client left before it passed. Like [`Limiter::refund`],
    /// except that a token bucket with a `max_delay` is given its charge back only if nobody
    /// was charged after it. A request held behind this one keeps the moment it was given; taking a charge back
    /// from the middle of the queue would hand that moment again to the next request (two
    /// requests at once where the bucket allows one). Windows count requests, not moments, and
    /// always get theirs back. The admission is left charging nothing.
    ///
    /// # Panics
    /// If `admission` came from another limiter.
    pub fn withdraw(&self, admission: &mut Admission, now: Nanos) {
        self.give_back(admission, true, now);
    }

    /// [`Limiter::refund`], or with `spare_queues` [`Limiter::withdraw`].
    fn give_back(&self, admission: &mut Admission, spare_queues: bool, now: Nanos) {
        assert_eq!(admission.limiter, self.id, "admission from another limiter");
        if admission.charged {
            self.take_back(admission, spare_queues, now.0.max(admission.now));
            admission.charged = false;
        }
        admission.slots.clear();
    }

    /// Takes back the quota charges of `admission` (its slots are released by its drop); with
    /// `spare_queues`, a token bucket's with a `max_delay` only if its state is still the one
    /// the charge left. A window charged ahead of time whose state is still the one the charge
    /// left gets back the state before it (only its count comes out otherwise: the state
    /// stays in the later window, where another request was charged since).
    /// `now` is when: no earlier than the admission.
    fn take_back(&self, admission: &Admission, spare_queues: bool, now: u64) {
        for (position, layer) in admission.layers.iter().enumerate().rev() {
            let c = &self.limits[layer.limit.index()];
            if c.rule.counts_requests() {
                continue; // the slot guard releases it when the admission drops
            }
            // Only a limit that holds requests queues them behind a charge: the others get
            // it back whoever was charged since (review: a 503 at the end of a hold kept the
            // charge of every token bucket another request of the caller's had touched).
            let only_from = (spare_queues && c.ahead > 0 && matches!(c.rule, Rule::Gcra(_)))
                .then(|| layer.state());
            let charge = Charge {
                cost: admission.cost,
                tag: layer.tag(),
                left: layer.state(),
                now,
            };
            let before = (admission.before.iter())
                .find(|&&(p, _)| p == position)
                .map(|&(_, before)| before);
            c.table.existing(layer.key, |state| {
                state.update(|s| match (only_from, before) {
                    (_, Some(before)) if s == layer.state() => Some(before),
                    (Some(expected), _) if s != expected => None,
                    _ => Some(c.rule.undo(s, charge)),
                })
            });
        }
    }

    /// Removes keys that have returned to the fresh state. Call it from a background task as
    /// often as you like: each table is walked at most once per its limit's window. Returns
    /// how many tables were walked.
    pub fn sweep(&self, now: Nanos) -> usize {
        let mut walked = 0;
        for c in self.limits.iter() {
            walked += usize::from(c.table.sweep(now.0));
            if let Some((_, blocks)) = &c.blocks {
                blocks.sweep(now.0);
            }
        }
        walked
    }

    /// Counters of limit `id`'s table.
    pub fn stats(&self, id: LimitId) -> TableStats {
        self.limits[id.index()].table.stats()
    }

    /// Counters of limit `id`'s table of blocked keys, if it has `block_for`: a second table,
    /// bounded by the same `max_keys`, whose evictions end blocks early.
    pub fn block_stats(&self, id: LimitId) -> Option<TableStats> {
        let (_, blocks) = self.limits[id.index()].blocks.as_ref()?;
        Some(blocks.stats())
    }

    /// An admission with nothing charged yet. Inlined, and reserving only past the inline
    /// layers, so that LLVM builds it in the caller's frame: a returned or escaping one is
    /// copied (~30 instructions on a decision of ~500).
    #[inline(always)]
    fn empty_admission(&self, layers: usize, cost: u32, now: u64, charged: bool) -> Admission {
        let mut out = Admission {
            limiter: self.id,
            cost,
            now,
            wait: 0,
            charged,
            layers: Layers::new(),
            slots: SmallVec::new(),
            before: Vec::new(),
        };
        if layers > INLINE_LAYERS {
            out.layers.reserve(layers);
        }
        out
    }
}
