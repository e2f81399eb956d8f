//! The limiter: one keyed table per limit, and the all-or-nothing decision across limits.

use smallvec::SmallVec;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::algo::{Algo, Rule, Step};
use crate::clock::{duration_to_nanos, Nanos};
use crate::decision::{
    Admission, CostTooLarge, Decision, Layer, Layers, LimitId, Refusal, RefusalReason, SlotGuard,
};
use crate::table::{Expiry, Table, TableStats};
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

/// A limit with its rule and tables.
#[derive(Debug)]
struct Compiled {
    limit: Limit,
    rule: Rule,
    capacity: Option<u32>,
    table: Arc<Table>,
    /// Blocked keys and when their block ends, for limits with `block_for`.
    blocks: Option<(u64, Table)>,
}

/// Decides requests against a fixed set of limits. Share it (e.g. in an `Arc`); every method
/// takes `&self` and no lock is global: each limit's table is sharded.
#[derive(Debug)]
pub struct Limiter {
    id: u64,
    limits: Box<[Compiled]>,
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
            let table = Arc::new(Table::new(limit.max_keys(), Expiry::Rule(rule), interval));
            let blocks = limit.block_for().map(|d| {
                let table = Table::new(limit.max_keys(), Expiry::Deadline, interval);
                (duration_to_nanos(d), table)
            });
            let capacity = limit.capacity();
            compiled.push(Compiled {
                limit,
                rule,
                capacity,
                table,
                blocks,
            });
        }
        Ok(Limiter {
            id: NEXT_LIMITER.fetch_add(1, Ordering::Relaxed),
            limits: compiled.into_boxed_slice(),
        })
    }

    /// The id of the limit named `name`.
    pub fn id(&self, name: &str) -> Option<LimitId> {
        let i = self.limits.iter().position(|c| c.limit.name() == name)?;
        Some(LimitId(i as u32))
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

    /// Decides a request of `cost` against every `(limit, key)` at `now`: either admits it and
    /// charges every limit, or refuses it and charges none. Concurrency limits take one slot
    /// per request whatever the cost. A cost of zero charges nothing and is always admitted
    /// (unless a key is blocked or a concurrency limit is full).
    ///
    /// Limits are charged in order by compare-and-swap; if a later one refuses, the earlier
    /// charges are taken back. A concurrent request may meanwhile see a charge that is then
    /// taken back and be refused: no limit ever admits more than its quota.
    ///
    /// # Panics
    /// If a [`LimitId`] does not belong to this limiter.
    pub fn decide(&self, layers: &[(LimitId, Key)], cost: u32, now: Nanos) -> Decision {
        if let Some(too_large) = self.too_large(layers, cost, now.0) {
            return Decision::CostTooLarge(too_large);
        }
        // Built in place and returned as is: moving a decision costs a 272-byte copy.
        let mut decision =
            Decision::Admitted(self.empty_admission(layers.len(), cost, now.0, true));
        let Decision::Admitted(admission) = &mut decision else {
            unreachable!("just built")
        };
        match self.charge_all(admission, layers, cost, now.0) {
            Ok(()) => decision,
            Err((position, first)) => {
                if let Decision::Admitted(admission) = decision {
                    self.refund(admission);
                }
                Decision::Refused(self.refusal(layers, position, first, cost, now.0))
            }
        }
    }

    /// Charges every layer in order into `admission`; on a refusal, the refusing position and
    /// (unless it was blocked) the state it saw and its wait. The caller refunds.
    #[inline]
    fn charge_all(
        &self,
        admission: &mut Admission,
        layers: &[(LimitId, Key)],
        cost: u32,
        now: u64,
    ) -> Result<(), (usize, Option<Seen>)> {
        for (position, &(limit, key)) in layers.iter().enumerate() {
            let c = &self.limits[limit.index()];
            if c.blocked_until(key, now).is_some() {
                return Err((position, None));
            }
            let charge = c.table.update(key, |state| {
                let mut current = state.load(Ordering::Acquire);
                loop {
                    let step = c.rule.eval(current, cost, now);
                    let Step::Admit { state: next, .. } = step else {
                        return (step, current);
                    };
                    match state.compare_exchange_weak(
                        current,
                        next,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => return (step, next),
                        Err(actual) => current = actual,
                    }
                }
            });
            match charge {
                (Step::Admit { state, tag }, _) => {
                    admission
                        .layers
                        .push(Layer::admitted(limit, key, state, tag));
                    if c.rule.counts_requests() {
                        let table = Arc::clone(&c.table);
                        admission.slots.push(SlotGuard { table, key });
                    }
                }
                (Step::Refuse { wait }, seen) => return Err((position, Some((seen, wait)))),
            }
        }
        Ok(())
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
            match c.rule.eval(c.table.load(key), cost, now.0) {
                Step::Admit { state, tag } if !blocked => {
                    admission
                        .layers
                        .push(Layer::admitted(limit, key, state, tag));
                }
                _ => return Decision::Refused(self.refusal_unchecked(layers, cost, now.0, false)),
            }
        }
        Decision::Admitted(admission)
    }

    /// Takes back every charge of `admission` and releases its slots, e.g. when the gateway
    /// answers 503 at capacity. Exact unless a charged key was evicted or swept in between.
    ///
    /// # Panics
    /// If `admission` came from another limiter.
    pub fn refund(&self, admission: Admission) {
        assert_eq!(admission.limiter, self.id, "admission from another limiter");
        if !admission.charged {
            return;
        }
        for layer in admission.layers.iter().rev() {
            let c = &self.limits[layer.limit.index()];
            if c.rule.counts_requests() {
                continue; // the slot guard releases it when `admission` drops
            }
            c.table.existing(layer.key, |state| {
                let undo = |s| Some(c.rule.undo(s, admission.cost, layer.tag()));
                let _ = state.fetch_update(Ordering::AcqRel, Ordering::Acquire, undo);
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

    fn empty_admission(&self, layers: usize, cost: u32, now: u64, charged: bool) -> Admission {
        let mut out = Admission {
            limiter: self.id,
            cost,
            now,
            charged,
            layers: Layers::new(),
            slots: SmallVec::new(),
        };
        out.layers.reserve(layers);
        out
    }

    /// The first limit whose capacity is below `cost`, with every limit's figures.
    fn too_large(&self, layers: &[(LimitId, Key)], cost: u32, now: u64) -> Option<CostTooLarge> {
        let (limit, capacity) = layers.iter().find_map(|&(limit, _)| {
            let capacity = self.limits[limit.index()].capacity?;
            (cost > capacity).then_some((limit, capacity))
        })?;
        let layers = self.snapshot(layers, now);
        Some(CostTooLarge {
            limit,
            capacity,
            cost,
            now,
            layers,
        })
    }

    /// The refusal after limit `position` refused (`first`: the state it saw and its wait;
    /// `None` if it was blocked): the limits after it are checked too, so the wait reported is
    /// the longest, and every limit that refused starts its block.
    fn refusal(
        &self,
        layers: &[(LimitId, Key)],
        position: usize,
        first: Option<Seen>,
        cost: u32,
        now: u64,
    ) -> Refusal {
        let mut refusal = self.refusal_unchecked(layers, cost, now, true);
        if refusal.wait.is_none() && refusal.reason == RefusalReason::Exhausted {
            // Raced: the state that refused us has changed since. Report what we saw.
            if let Some((seen, wait)) = first {
                refusal.limit = layers[position].0;
                refusal.layers[position].set_state(seen);
                refusal.wait = wait.map(Duration::from_nanos);
            }
        }
        refusal
    }

    /// Evaluates every layer without charging; the refusing layer with the longest wait names
    /// the refusal. With `block`, layers refused by their counters start their blocks.
    fn refusal_unchecked(
        &self,
        layers: &[(LimitId, Key)],
        cost: u32,
        now: u64,
        block: bool,
    ) -> Refusal {
        let mut out = self.snapshot(layers, now);
        // (order key, limit, wait, reason): a known wait outranks an unknown one.
        let mut worst: Option<(u64, LimitId, Option<u64>, RefusalReason)> = None;
        for layer in out.iter_mut() {
            let c = &self.limits[layer.limit.index()];
            let (wait, reason) = if let Some(until) = layer.blocked_until() {
                let reason = RefusalReason::Blocked {
                    until: Nanos(until),
                };
                (Some(until - now), reason)
            } else {
                match c.rule.eval(layer.state(), cost, now) {
                    Step::Admit { .. } => continue,
                    Step::Refuse { wait } => match (&c.blocks, block) {
                        (Some((block_for, blocks)), true) => {
                            // The block covers the counters' wait too, so its end is a real retry time.
                            let until = now + (*block_for).max(wait.unwrap_or(0));
                            blocks.update(layer.key, |s| {
                                s.fetch_max(u128::from(until), Ordering::AcqRel)
                            });
                            layer.block(until);
                            (Some(until - now), RefusalReason::Exhausted)
                        }
                        _ => (wait, RefusalReason::Exhausted),
                    },
                }
            };
            let rank = wait.map_or(0, |w| w.saturating_add(1));
            if !matches!(worst, Some((best, ..)) if best >= rank) {
                worst = Some((rank, layer.limit, wait, reason));
            }
        }
        let (_, limit, wait, reason) =
            worst.unwrap_or((0, layers[0].0, None, RefusalReason::Exhausted));
        Refusal {
            limit,
            wait: wait.map(Duration::from_nanos),
            reason,
            cost,
            now,
            layers: out,
        }
    }

    /// Every layer's current state, with its block if blocked.
    fn snapshot(&self, layers: &[(LimitId, Key)], now: u64) -> Layers {
        layers
            .iter()
            .map(|&(limit, key)| {
                let c = &self.limits[limit.index()];
                let state = c.table.load(key);
                let blocked_until = c.blocked_until(key, now);
                Layer::pending(limit, key, state, blocked_until)
            })
            .collect()
    }
}

impl Compiled {
    /// When `key`'s block on this limit ends, if it is blocked at `now`.
    #[inline]
    fn blocked_until(&self, key: Key, now: u64) -> Option<u64> {
        let (_, blocks) = self.blocks.as_ref()?;
        let until = u64::try_from(blocks.load(key)).unwrap_or(u64::MAX);
        (until > now).then_some(until)
    }
}
