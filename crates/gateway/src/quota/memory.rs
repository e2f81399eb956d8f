//! Deciding in this instance's memory: the store in memory mode, and the `on_error = "local"`
//! fallback of a shared store.

use std::time::Duration;

use sluice_limiter::{Decision, LimitId, Refusal, Slots};

use super::{Held, Layers, Outcome, Pass, Quota, Refused, Stop};
use crate::capacity::{Capacity, InFlight};

/// One decision in memory: done, or hold the request this long and decide again (delay mode).
// Returned once per request and matched at once: boxing the pass would cost an allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Step {
    Done(Result<Pass, Stop>),
    Wait(Duration),
}

impl Quota {
    /// Quota, then capacity (refunding the quota when full). `slot` is a capacity slot the
    /// caller already holds, if any.
    pub(super) async fn admit_in_memory(
        &self,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        slot: Option<InFlight>,
    ) -> Result<Pass, Stop> {
        let start = tokio::time::Instant::now();
        self.hold_in_memory(layers, cost, capacity, slot, start, None)
            .await
    }

    /// The decision loop of [`Quota::admit_in_memory`] for a request that arrived at `start`:
    /// waits `wait` first if given (the request was refused once and is held, delay mode).
    pub(super) async fn hold_in_memory(
        &self,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        mut slot: Option<InFlight>,
        start: tokio::time::Instant,
        mut wait: Option<Duration>,
    ) -> Result<Pass, Stop> {
        loop {
            let waited = match wait {
                Some(wait) => {
                    tokio::time::sleep(wait).await;
                    start.elapsed()
                }
                None => Duration::ZERO,
            };
            let delayed = wait.is_some();
            match self.step_in_memory(layers, cost, capacity, &mut slot, waited, delayed) {
                Step::Done(result) => return result,
                Step::Wait(next) => wait = Some(next),
            }
        }
    }

    /// One decision of [`Quota::hold_in_memory`], `waited` after the request arrived. Not
    /// async: most requests need no more, and no future then carries the decision's state.
    pub(super) fn step_in_memory(
        &self,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        slot: &mut Option<InFlight>,
        waited: Duration,
        delayed: bool,
    ) -> Step {
        let now = self.clock.now();
        self.limiter
            .decide_with(&layers.enforced, cost, now, |decision| match decision {
                Decision::Admitted(admission) => {
                    let reports = admission
                        .reports(&self.limiter)
                        .map(|r| (r.limit, r))
                        .collect();
                    let Some(slot) = slot.take().or_else(|| capacity.try_acquire()) else {
                        self.limiter.refund(admission);
                        return Step::Done(Err(Stop::Overloaded));
                    };
                    let (dry_run, dry_refused) = self.dry_run_in_memory(layers, cost);
                    let outcome = Outcome::of(dry_refused, delayed);
                    let held = Held {
                        _enforced: Some(admission.take_slots()),
                        _dry_run: dry_run,
                        _lease: None,
                    };
                    Step::Done(Ok(Pass {
                        slot,
                        held,
                        reports,
                        outcome,
                    }))
                }
                Decision::Refused(refusal) => {
                    let refusing = refusal.refusing(&self.limiter);
                    let Some(wait) = self.delay_for(refusing, waited) else {
                        return Step::Done(Err(Stop::Quota(Box::new(self.refused(refusal)))));
                    };
                    // Held requests are in-flight work: a full gateway cannot hold more.
                    if slot.is_none() {
                        match capacity.try_acquire() {
                            Some(s) => *slot = Some(s),
                            None => return Step::Done(Err(Stop::Overloaded)),
                        }
                    }
                    Step::Wait(wait)
                }
                Decision::CostTooLarge(c) => Step::Done(Err(Stop::CostTooLarge(c.limit()))),
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
