//! GCRA: the token bucket as one theoretical arrival time (TAT) per key.
//!
//! Time is kept in units of `1/scale` ns where `scale = quota / gcd(window, quota)`, so the
//! emission interval `window / quota` is a whole number of units and no rounding ever drifts
//! (governor rounds it to whole nanoseconds). The TAT fits in 128 bits for any quota and window.

use super::{ceil_div_u64, div, Algo, Charge, Step};

/// A token bucket of `burst` tokens refilled at `quota` per `window`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gcra {
    /// Units per nanosecond.
    scale: u128,
    /// Emission interval (time to earn one token), in units.
    interval: u128,
    /// Bucket size times the interval: the most debt a key may hold, in units.
    tolerance: u128,
    burst: u32,
    /// `(interval, tolerance)` in nanoseconds when the unit is the nanosecond and the debt fits
    /// comfortably in 64 bits, as for nearly every real quota: see [`Gcra::admit_narrow`].
    narrow: Option<(u64, u64)>,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Gcra {
    pub(crate) fn new(quota: u32, window_ns: u64, burst: u32) -> Self {
        let g = gcd(window_ns, u64::from(quota));
        let interval = u128::from(window_ns / g);
        let scale = u128::from(u64::from(quota) / g);
        let tolerance = interval * u128::from(burst);
        let narrow =
            (scale == 1 && tolerance <= 1 << 62).then_some((interval as u64, tolerance as u64));
        Gcra {
            scale,
            interval,
            tolerance,
            burst,
            narrow,
        }
    }

    /// Whether every TAT fits in 64 bits until the year 2400: when the unit is the nanosecond
    /// (the quota divides the window in nanoseconds, as round quotas do) and the bucket holds
    /// less than 2^62 ns (146 years) of debt.
    pub(crate) fn fits_narrow(&self) -> bool {
        self.narrow.is_some()
    }

    /// [`Algo::eval`]'s admission in 64-bit nanoseconds: the TAT after charging `cost` at
    /// `now`, or `None` when the request is refused or the limit needs the wide arithmetic
    /// (then [`Algo::eval`] decides). Same result as `eval` whenever it answers.
    #[inline]
    pub(crate) fn admit_narrow(&self, tat: u64, cost: u32, now: u64) -> Option<u64> {
        let (interval, tolerance) = self.narrow?;
        let new_tat = tat
            .max(now)
            .checked_add(u64::from(cost).checked_mul(interval)?)?;
        (new_tat - now <= tolerance).then_some(new_tat)
    }

    /// The TAT after charging `cost` at `now` whatever the debt: for a request admitted ahead
    /// (held until it conforms). Its TAT already says when it passes; charging it at the
    /// moment it passes instead, rounded up to the nanosecond, would add that rounding.
    pub(crate) fn charge_ahead(&self, tat: u128, cost: u32, now: u64) -> u128 {
        tat.max(u128::from(now) * self.scale) + u128::from(cost) * self.interval
    }

    /// Debt at `now` in units: how far the TAT is ahead of now.
    #[inline]
    fn debt(&self, tat: u128, now: u64) -> u128 {
        tat.saturating_sub(u128::from(now) * self.scale)
    }
}

impl Algo for Gcra {
    #[inline]
    fn eval(&self, tat: u128, cost: u32, now: u64) -> Step {
        let now_units = u128::from(now) * self.scale;
        let increment = u128::from(cost) * self.interval;
        let new_tat = tat.max(now_units) + increment;
        if new_tat - now_units <= self.tolerance {
            Step::Admit {
                state: new_tat,
                tag: 0,
            }
        } else {
            Step::Refuse {
                wait: self.wait(tat, cost, now),
            }
        }
    }

    /// Gives back what is still owed of the charge: the charge raised the TAT to `left`, and
    /// the time since has paid off the part of it that `now` has passed. Subtracting the whole
    /// charge would be wrong once the bucket has refilled past it: a later charge then started
    /// from `now` (the `max` in [`Algo::eval`]), not from this charge's TAT, and taking this
    /// charge back would take that later one back instead (a burst of 1 charged at 0 and again
    /// at 5 s would, refunded for the first, admit a third request at 5 s). Charges made since
    /// on top of this one (a debt that never fell to `now`) are not touched: subtraction
    /// commutes with them. A TAT pulled below `now` is equivalent to `now`.
    fn undo(&self, tat: u128, charge: Charge) -> u128 {
        let owed = charge
            .left
            .saturating_sub(u128::from(charge.now) * self.scale);
        tat.saturating_sub((u128::from(charge.cost) * self.interval).min(owed))
    }

    fn expiry(&self, tat: u128) -> u64 {
        ceil_div_u64(tat, self.scale)
    }

    fn remaining(&self, tat: u128, now: u64) -> u32 {
        let room = self.tolerance.saturating_sub(self.debt(tat, now));
        u32::try_from(div(room, self.interval)).unwrap_or(u32::MAX)
    }

    fn wait(&self, tat: u128, cost: u32, now: u64) -> Option<u64> {
        let needed = self.debt(tat, now) + u128::from(cost) * self.interval;
        Some(ceil_div_u64(
            needed.saturating_sub(self.tolerance),
            self.scale,
        ))
    }

    fn quota(&self) -> u32 {
        self.burst
    }

    fn window(&self) -> Option<u64> {
        Some(ceil_div_u64(self.tolerance, self.scale))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn run(g: &Gcra, tat: &mut u128, cost: u32, now: u64) -> bool {
        match g.eval(*tat, cost, now) {
            Step::Admit { state, .. } => {
                *tat = state;
                true
            }
            Step::Refuse { .. } => false,
        }
    }

    #[test]
    fn a_third_of_a_second_interval_does_not_drift() {
        // 3 per second: tokens accrue every 333_333_333.3 ns. Rounding the interval to whole
        // nanoseconds (as governor does) would admit the ninth token 3 ns early.
        let g = Gcra::new(3, SEC, 3);
        let t0 = 100 * SEC;
        let mut tat = 0;
        assert!(run(&g, &mut tat, 3, t0));
        for k in 1..=9u64 {
            let due = t0 + (k * SEC).div_ceil(3);
            assert!(
                !run(&g, &mut tat, 1, due - 1),
                "token {k} is not due 1 ns early"
            );
            assert!(run(&g, &mut tat, 1, due), "token {k} is due at {due}");
        }
    }

    #[test]
    fn refusal_waits_exactly_for_the_missing_tokens() {
        let g = Gcra::new(10, SEC, 10);
        let mut tat = 0;
        let now = 50 * SEC;
        assert!(run(&g, &mut tat, 10, now));
        assert_eq!(
            g.eval(tat, 3, now),
            Step::Refuse {
                wait: Some(3 * SEC / 10)
            }
        );
        assert!(!run(&g, &mut tat, 3, now + 3 * SEC / 10 - 1));
        assert!(run(&g, &mut tat, 3, now + 3 * SEC / 10));
    }

    #[test]
    fn figures_name_burst_and_refill_time() {
        let g = Gcra::new(10, SEC, 5);
        assert_eq!(g.quota(), 5);
        assert_eq!(g.window(), Some(SEC / 2));
        assert_eq!(g.remaining(0, SEC), 5);
    }

    #[test]
    fn undo_restores_the_bucket() {
        let g = Gcra::new(10, SEC, 5);
        let now = 9 * SEC;
        let Step::Admit { state, .. } = g.eval(0, 2, now) else {
            panic!()
        };
        assert_eq!(g.remaining(state, now), 3);
        let charge = Charge {
            cost: 2,
            tag: 0,
            left: state,
            now,
        };
        assert_eq!(g.remaining(g.undo(state, charge), now), 5);
    }

    /// Only what is still owed comes back: a charge the bucket refilled past gives nothing,
    /// one half paid off gives half, and a charge under later ones comes back whole.
    #[test]
    fn undo_gives_back_what_is_still_owed() {
        let g = Gcra::new(1, SEC, 4); // a token a second, four in the bucket
        let charge = |left, now| Charge {
            cost: 2,
            tag: 0,
            left,
            now,
        };
        // Charged 2 at 0 on a full bucket: TAT 2 s.
        let Step::Admit { state: a, .. } = g.eval(0, 2, 0) else {
            panic!()
        };
        // At 5 s the charge is paid off; another charged 1 then (TAT 6 s) keeps its charge.
        let Step::Admit { state: b, .. } = g.eval(a, 1, 5 * SEC) else {
            panic!()
        };
        assert_eq!(g.undo(b, charge(a, 5 * SEC)), b);
        // At 1 s half of it is owed.
        assert_eq!(g.undo(a, charge(a, SEC)), a - u128::from(SEC));
        // Under a later charge at 0 (TAT 3 s), all of it is owed at 0.
        let Step::Admit { state: c, .. } = g.eval(a, 1, 0) else {
            panic!()
        };
        assert_eq!(g.undo(c, charge(a, 0)), u128::from(SEC));
    }

    proptest::proptest! {
        /// The 64-bit admission answers exactly as `eval` wherever it answers, and answers for
        /// every admission that fits in 64 bits: tested around the bucket's edge, where an
        /// off-by-one would show.
        #[test]
        fn narrow_admission_is_evals_admission(
            (per_token, burst, cost) in (1u64..1_000_000, 1u32..1_000, 0u32..1_100),
            now in 0u64..u64::MAX / 2,
            edge in -3i64..=3,
            far in proptest::bool::ANY,
        ) {
            let g = Gcra::new(burst, per_token * u64::from(burst), burst);
            proptest::prop_assert!(g.fits_narrow());
            let tolerance = per_token * u64::from(burst);
            let increment = per_token * u64::from(cost);
            // A TAT whose charge lands `edge` ns from the edge, or one long past.
            let tat = if far {
                now.saturating_sub(tolerance)
            } else {
                (now + tolerance).saturating_sub(increment).saturating_add_signed(edge)
            };
            let expected = match g.eval(u128::from(tat), cost, now) {
                Step::Admit { state, .. } => Some(u64::try_from(state).unwrap()),
                Step::Refuse { .. } => None,
            };
            proptest::prop_assert_eq!(g.admit_narrow(tat, cost, now), expected);
        }
    }
}
