//! Deciding in this instance's memory: the store in memory mode, and the `on_error = "local"`
//! fallback of a shared store.

use sluice_limiter::{Decision, LimitId, Refusal, Slots};

use super::{Held, Layers, Outcome, Pass, Quota, Refused, Stop};
use crate::capacity::{Capacity, InFlight};

impl Quota {
    /// Quota, then capacity (refunding the quota when full). `slot` is a capacity slot the
    /// caller already holds, if any.
    pub(super) async fn admit_in_memory(
        &self,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        mut slot: Option<InFlight>,
    ) -> Result<Pass, Stop> {
        let start = tokio::time::Instant::now();
        let mut delayed = false;
        loop {
            match self
                .limiter
                .decide(&layers.enforced, cost, self.clock.now())
            {
                Decision::Admitted(admission) => {
                    let reports = admission
                        .reports(&self.limiter)
                        .map(|r| (r.limit, r))
                        .collect();
                    let Some(slot) = slot.or_else(|| capacity.try_acquire()) else {
                        self.limiter.refund(admission);
                        return Err(Stop::Overloaded);
                    };
                    let (dry_run, dry_refused) = self.dry_run_in_memory(layers, cost);
                    let outcome = Outcome::of(dry_refused, delayed);
                    let held = Held {
                        _enforced: Some(admission.into_slots()),
                        _dry_run: dry_run,
                        _lease: None,
                    };
                    return Ok(Pass {
                        slot,
                        held,
                        reports,
                        outcome,
                    });
                }
                Decision::Refused(refusal) => {
                    let refusing = refusal.refusing(&self.limiter);
                    let Some(wait) = self.delay_for(refusing, start.elapsed()) else {
                        return Err(Stop::Quota(Box::new(self.refused(&refusal))));
                    };
                    // Held requests are in-flight work: a full gateway cannot hold more.
                    if slot.is_none() {
                        slot = Some(capacity.try_acquire().ok_or(Stop::Overloaded)?);
                    }
                    delayed = true;
                    tokio::time::sleep(wait).await;
                }
                Decision::CostTooLarge(c) => return Err(Stop::CostTooLarge(c.limit())),
            }
        }
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
        match self.limiter.decide(&layers.dry_run, cost, self.clock.now()) {
            Decision::Admitted(a) => (Some(a.into_slots()), None),
            Decision::Refused(r) => (None, Some(r.limit())),
            Decision::CostTooLarge(c) => (None, Some(c.limit())),
        }
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
