//! Concurrency: at most `quota` requests in flight per key. State: the count in flight. Every
//! request takes one slot whatever its cost; the slot is released by the admission's guard.

use super::{Algo, Charge, Step};

/// At most `quota` requests in flight.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Concurrency {
    quota: u32,
}

impl Concurrency {
    pub(crate) fn new(quota: u32) -> Self {
        Concurrency { quota }
    }
}

impl Algo for Concurrency {
    #[inline]
    fn eval(&self, in_flight: u128, _cost: u32, _now: u64) -> Step {
        if in_flight < u128::from(self.quota) {
            Step::Admit {
                state: in_flight + 1,
                tag: 0,
            }
        } else {
            Step::Refuse { wait: None }
        }
    }

    fn undo(&self, in_flight: u128, _charge: Charge) -> u128 {
        in_flight.saturating_sub(1)
    }

    fn expiry(&self, in_flight: u128) -> u64 {
        // An entry with requests in flight must outlive them: never evicted, never swept.
        if in_flight == 0 {
            0
        } else {
            u64::MAX
        }
    }

    fn remaining(&self, in_flight: u128, _now: u64) -> u32 {
        let left = u128::from(self.quota).saturating_sub(in_flight);
        u32::try_from(left).unwrap_or(u32::MAX)
    }

    fn wait(&self, in_flight: u128, _cost: u32, _now: u64) -> Option<u64> {
        (in_flight < u128::from(self.quota)).then_some(0)
    }

    fn quota(&self) -> u32 {
        self.quota
    }

    fn window(&self) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_the_slot_past_quota_without_a_wait() {
        let c = Concurrency::new(1);
        assert_eq!(c.eval(0, 9, 0), Step::Admit { state: 1, tag: 0 });
        assert_eq!(c.eval(1, 1, 0), Step::Refuse { wait: None });
        assert_eq!(c.undo(1, Charge::of(1, 0)), 0);
        assert_eq!(c.expiry(1), u64::MAX);
    }
}
