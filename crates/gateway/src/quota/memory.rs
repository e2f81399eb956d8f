//! Deciding in this instance's memory: the store in memory mode, and the `on_error = "local"`
//! fallback of a shared store.

use std::time::Duration;

use sluice_limiter::{Admission, Clock, Decision, LimitId, Limiter, Refusal, Slots};

use super::{place_after_hold, Held, Layers, Notes, Outcome, Pass, Quota, Refused, Reports, Stop};
use crate::capacity::{Capacity, HeldPlace, InFlight};

impl Quota {
    /// Takes `admission` back, and the caller's figures after it, read as of the refund: a
    /// bucket's refund keeps the time it ran, so figures read before it would show a unit
    /// spent (review: a fresh caller's 503 said `r=9;t=1` of a burst of 10).
    fn refunded<'a>(
        &'a self,
        admission: &mut Admission,
        layers: &'a Layers,
    ) -> impl Iterator<Item = (LimitId, sluice_limiter::Report)> + 'a {
        let later = self.clock.now();
        self.limiter.refund(admission, later);
        let figures = self.limiter.figures(&layers.enforced, later);
        figures.map(|r| (r.limit, r))
    }

    /// Quota, then capacity (refunding the quota when full), and the wait of a request held
    /// by `delay` limits. `slot` is a capacity slot the caller already holds, if any.
    pub(super) async fn admit_in_memory(
        &self,
        layers: &Layers,
        cost: u32,
        capacity: &Capacity,
        slot: Option<InFlight>,
        notes: Notes<'_>,
    ) -> Result<Pass, Stop> {
        match self.decide_in_memory(layers, cost, capacity, slot, notes.reports) {
            Decided::Now(result) => result,
            Decided::Later(hold) => self.hold(hold, layers, capacity, notes).await,
        }
    }

    /// Holds an admitted request until it passes, its outcome already in `log` (so that one
    /// whose client leaves is logged as such), then gives it its place in `max_in_flight`:
    /// a held request takes none, so that a caller sending faster than its rate fills no
    /// place that others need (nor fails readiness). If the gateway is full when the hold
    /// ends, or starts draining with a grace that ends before it, the request is answered
    /// 503 at that moment. If it is not passed (503, or dropped when its client leaves), its
    /// charges are withdrawn ([`Limiter::withdraw`]: a token bucket gets its charge back only
    /// if nobody queued behind it).
    pub(super) async fn hold(
        &self,
        hold: Hold,
        layers: &Layers,
        capacity: &Capacity,
        notes: Notes<'_>,
    ) -> Result<Pass, Stop> {
        notes.log.outcome(hold.outcome, self);
        let mut withdraw = Withdraw {
            limiter: &self.limiter,
            clock: &*self.clock,
            admissions: hold.admissions,
        };
        let slot = match place_after_hold(capacity, hold.wait).await {
            Ok(slot) => slot,
            Err(stop) => {
                // A 503 tells the caller what it has, its charges withdrawn.
                drop(withdraw);
                let figures = self.limiter.figures(&layers.enforced, self.clock.now());
                notes.reports.clear();
                notes.reports.extend(figures.map(|r| (r.limit, r)));
                return Err(stop);
            }
        };
        // It passes: the charges stay. Its figures as it is forwarded, not as of its admission
        // a hold ago (a `t` counted from then would send the caller back that much too late).
        withdraw.admissions.clear();
        let figures = self.limiter.figures(&layers.enforced, self.clock.now());
        notes.reports.clear();
        notes.reports.extend(figures.map(|r| (r.limit, r)));
        Ok(Pass {
            slot,
            held: hold.held,
            outcome: hold.outcome,
        })
    }

    /// One decision in memory, or how long to hold the request before it passes: `delay`
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
    ) -> Decided {
        let now = self.clock.now();
        self.limiter
            .decide_with(&layers.enforced, cost, now, |decision| match decision {
                Decision::Admitted(admission) => {
                    // A full gateway answers 503 now, to a request it would hold too.
                    let Some(slot) = slot.or_else(|| capacity.try_acquire()) else {
                        // A 503 tells the caller what it has, nothing having been charged.
                        reports.extend(self.refunded(admission, layers));
                        return Decided::Now(Err(Stop::Overloaded));
                    };
                    let wait = admission.wait();
                    let held_back = !wait.is_zero();
                    // At `max_held`, a `delay` limit refuses what it would hold, as an
                    // enforcing one does: charged nothing, told when it would pass.
                    let place = if held_back {
                        let Some(place) = capacity.try_hold() else {
                            let figures = self.refunded(admission, layers).collect();
                            return Decided::Now(Err(self.no_room_to_hold(figures, wait)));
                        };
                        Some(place)
                    } else {
                        None
                    };
                    reports.extend(admission.reports(&self.limiter).map(|r| (r.limit, r)));
                    let (dry_run, dry_refused, dry_admission) =
                        self.dry_run_in_memory(layers, cost, held_back);
                    let held = Held {
                        _enforced: Some(admission.take_slots()),
                        _dry_run: dry_run,
                        _lease: None,
                    };
                    let outcome = Outcome::of(dry_refused, held_back);
                    if !held_back {
                        return Decided::Now(Ok(Pass {
                            slot,
                            held,
                            outcome,
                        }));
                    }
                    // Held: its place in `max_in_flight` is taken when the hold ends. Rare, so
                    // the charges are kept here, to withdraw them if it does not pass.
                    drop(slot);
                    Decided::Later(Hold {
                        wait,
                        outcome,
                        held,
                        _place: place,
                        admissions: std::iter::once(admission.take())
                            .chain(dry_admission)
                            .collect(),
                    })
                }
                Decision::Refused(refusal) => {
                    Decided::Now(Err(Stop::Quota(Box::new(self.refused(refusal)))))
                }
                Decision::CostTooLarge(c) => Decided::Now(Err(Stop::CostTooLarge(c.limit()))),
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
            no_room: false,
        }
    }

    /// Dry-run limits are decided (and charged) like enforced ones, but never refuse. With
    /// `keep` (a held request), their admission too, to withdraw it like the enforced one.
    fn dry_run_in_memory(
        &self,
        layers: &Layers,
        cost: u32,
        keep: bool,
    ) -> (Option<Slots>, Option<LimitId>, Option<Admission>) {
        if layers.dry_run.is_empty() {
            return (None, None, None);
        }
        let now = self.clock.now();
        self.limiter
            .decide_with(&layers.dry_run, cost, now, |decision| match decision {
                Decision::Admitted(a) => (Some(a.take_slots()), None, keep.then(|| a.take())),
                Decision::Refused(r) => (None, Some(r.limit()), None),
                Decision::CostTooLarge(c) => (None, Some(c.limit()), None),
            })
    }
}

/// What a decision in memory says.
#[derive(Debug)]
pub(super) enum Decided {
    /// Admitted to pass now (with its place in `max_in_flight`), or not admitted.
    Now(Result<Pass, Stop>),
    /// Admitted by `delay` limits to pass after a hold.
    Later(Hold),
}

/// A request admitted by `delay` limits ahead of time: how long to hold it, and its charges.
#[derive(Debug)]
pub(super) struct Hold {
    pub(super) wait: Duration,
    pub(super) outcome: Outcome,
    /// Its concurrency slots, taken at admission.
    held: Held,
    /// Its place among `max_held`, until the hold ends.
    _place: Option<HeldPlace>,
    /// The enforced limits' admission, then the dry-run limits' if they admitted it.
    admissions: Vec<Admission>,
}

/// Withdraws a held request's charges when dropped, unless told it passed.
struct Withdraw<'a> {
    limiter: &'a Limiter,
    clock: &'a dyn Clock,
    admissions: Vec<Admission>,
}

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        for admission in &mut self.admissions {
            self.limiter.withdraw(admission, self.clock.now());
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
