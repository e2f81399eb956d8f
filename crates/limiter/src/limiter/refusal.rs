//! What a request that is not admitted reports: the refusing limit with the longest wait,
//! every limit's figures, and blocks started. Off the admit path.

use std::time::Duration;

use super::{Compiled, Limiter, Seen};
use crate::algo::{Algo, Step};
use crate::clock::Nanos;
use crate::decision::{CostTooLarge, Layer, Layers, LimitId, Refusal, RefusalReason};
use crate::Key;

impl Limiter {
    /// The first limit whose capacity is below `cost`, with every limit's figures.
    pub(super) fn too_large(
        &self,
        layers: &[(LimitId, Key)],
        cost: u32,
        now: u64,
    ) -> Option<CostTooLarge> {
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
    pub(super) fn refusal(
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
    pub(super) fn refusal_unchecked(
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
                    // It would have held the request: it did not refuse.
                    Step::Refuse { wait: Some(wait) } if wait <= c.ahead => continue,
                    Step::Refuse { wait } => match (&c.blocks, block) {
                        (Some((block_for, blocks)), true) => {
                            // The block covers the counters' wait too, so its end is a real retry time.
                            let until = now.saturating_add((*block_for).max(wait.unwrap_or(0)));
                            let until_state = u128::from(until);
                            blocks.update(layer.key, now, |s| {
                                s.update(|end| (until_state > end).then_some(until_state))
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
    pub(super) fn blocked_until(&self, key: Key, now: u64) -> Option<u64> {
        let (_, blocks) = self.blocks.as_ref()?;
        let until = u64::try_from(blocks.load(key)).unwrap_or(u64::MAX);
        (until > now).then_some(until)
    }
}
