//! Deciding in this instance's memory: the store in memory mode, and the `on_error = "local"`
//! fallback of a shared store.

use std::time::Duration;

use sluice_limiter::{Decision, LimitId, Refusal, Slots};

use super::{Held, Layers, Outcome, Pass, Quota, Refused, Reports, Stop};
use crate::capacity::{Capacity, InFlight};

impl Quota {
    /// Quota, then capacity (refunding the quota when full), and the wait of a request held
    /// by `delay` limits. `slot` is a capacity slot the caller already holds, if any.
    pub(super) async fn admit_in_memory(
        &self,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        slot: Option<InFlight>,
        reports: &mut Reports,
    ) -> Result<Pass, Stop> {
        let (result, hold) = self.decide_in_memory(layers, cost, capacity, slot, reports);
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        result
    }

    /// One decision in memory, and how long to hold the request before it passes: `delay`
    /// limits admit a request that passes within their `max_delay` and charge it now, as of
    /// when it will pass, so it keeps its place (and is decided once). Not async: most
    /// requests are not held, and no future then carries the decision's state.
    pub(super) fn decide_in_memory(
        &self,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        slot: Option<InFlight>,
        reports: &mut Reports,
    ) -> (Result<Pass, Stop>, Duration) {
        let now = self.clock.now();
        self.limiter
            .decide_with(&layers.enforced, cost, now, |decision| match decision {
                Decision::Admitted(admission) => {
                    // A held request is in-flight work: a full gateway cannot hold more.
                    let Some(slot) = slot.or_else(|| capacity.try_acquire()) else {
                        self.limiter.refund(admission);
                        return (Err(Stop::Overloaded), Duration::ZERO);
                    };
                    reports.extend(admission.reports(&self.limiter).map(|r| (r.limit, r)));
                    let hold = admission.wait();
                    let (dry_run, dry_refused) = self.dry_run_in_memory(layers, cost);
                    let held = Held {
                        _enforced: Some(admission.take_slots()),
                        _dry_run: dry_run,
                        _lease: None,
                    };
                    let pass = Pass {
                        slot,
                        held,
                        outcome: Outcome::of(dry_refused, !hold.is_zero()),
                    };
                    (Ok(pass), hold)
                }
                Decision::Refused(refusal) => {
                    let refused = Stop::Quota(Box::new(self.refused(refusal)));
                    (Err(refused), Duration::ZERO)
                }
                Decision::CostTooLarge(c) => (Err(Stop::CostTooLarge(c.limit())), Duration::ZERO),
            })
    }

    fn refused(&self, refusal: &Refusal) -> Refused {
        Refused {
            limit: refusal.limit(),
            wait: refusal.wait(),
            reason: refusal.reason(),
            reports: refusal
                .reports(&self.limiter)
                .map(|r| (r.limit, r))
                .collect(),
        }
    }

    /// Dry-run limits are decided (and charged) like enforced ones, but never refuse.
    fn dry_run_in_memory(&self, layers: &Layers, cost: u32) -> (Option<Slots>, Option<LimitId>) {
        if layers.dry_run.is_empty() {
            return (None, None);
        }
        let now = self.clock.now();
        self.limiter
            .decide_with(&layers.dry_run, cost, now, |decision| match decision {
                Decision::Admitted(a) => (Some(a.take_slots()), None),
                Decision::Refused(r) => (None, Some(r.limit())),
                Decision::CostTooLarge(c) => (None, Some(c.limit())),
            })
    }
}

impl Outcome {
    pub(super) fn of(dry_refused: Option<LimitId>, delayed: bool) -> Self {
        match (dry_refused, delayed) {
            (Some(id), _) => Outcome::RejectedDryRun(id),
            (None, true) => Outcome::Delayed,
            (None, false) => Outcome::Passed,
        }
    }
}
