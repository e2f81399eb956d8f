//! Fixed window: one counter per window, windows aligned to multiples of the window length since
//! the Unix epoch. State: window index in the high 64 bits, count in the low 64.

use super::{later, Algo, Charge, Step};

/// `quota` per aligned window of `window` nanoseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FixedWindow {
    quota: u32,
    window: u64,
}

fn unpack(state: u128) -> (u64, u64) {
    ((state >> 64) as u64, state as u64)
}

fn pack(index: u64, count: u64) -> u128 {
    (u128::from(index) << 64) | u128::from(count)
}

impl FixedWindow {
    pub(crate) fn new(quota: u32, window: u64) -> Self {
        FixedWindow { quota, window }
    }

    /// The count charged to the window containing `now`. A state of a later window (charged
    /// ahead for a delayed request, or by a request that read the clock after this one) means
    /// this window is spent: its count was given up when the state moved on.
    #[inline]
    fn count_at(&self, state: u128, now: u64) -> u64 {
        let (index, count) = unpack(state);
        let now_index = now / self.window;
        if index == now_index {
            count
        } else if index > now_index {
            u64::from(self.quota)
        } else {
            0
        }
    }

    /// For a state of a window after `now`'s: the start of that window.
    fn later_start(&self, state: u128, now: u64) -> Option<u64> {
        let (index, _) = unpack(state);
        (index > now / self.window).then(|| index.saturating_mul(self.window))
    }

    /// Nanoseconds from `now` to the end of its window.
    fn until_window_end(&self, now: u64) -> u64 {
        self.window - now % self.window
    }
}

impl Algo for FixedWindow {
    #[inline]
    fn eval(&self, state: u128, cost: u32, now: u64) -> Step {
        if self.later_start(state, now).is_some() {
            return later(state, cost, || self.wait(state, cost, now));
        }
        let count = self.count_at(state, now) + u64::from(cost);
        if count <= u64::from(self.quota) {
            let index = now / self.window;
            Step::Admit {
                state: pack(index, count),
                tag: index,
            }
        } else {
            Step::Refuse {
                wait: self.wait(state, cost, now),
            }
        }
    }

    fn undo(&self, state: u128, charge: Charge) -> u128 {
        let (index, count) = unpack(state);
        if index == charge.tag {
            pack(index, count.saturating_sub(u64::from(charge.cost)))
        } else {
            state // the charged window has ended: nothing left to take back
        }
    }

    /// The end of the counted window; with nothing counted, its start: a state of a later
    /// window (charged ahead for a held request, which was then withdrawn) also says that the
    /// windows before it are spent, and must outlive them.
    fn expiry(&self, state: u128) -> u64 {
        let (index, count) = unpack(state);
        let end = if count == 0 {
            index
        } else {
            index.saturating_add(1)
        };
        end.saturating_mul(self.window)
    }

    fn remaining(&self, state: u128, now: u64) -> u32 {
        let left = u64::from(self.quota).saturating_sub(self.count_at(state, now));
        u32::try_from(left).unwrap_or(u32::MAX)
    }

    fn wait(&self, state: u128, cost: u32, now: u64) -> Option<u64> {
        if let Some(start) = self.later_start(state, now) {
            return Some((start - now).saturating_add(self.wait(state, cost, start)?));
        }
        if self.count_at(state, now) + u64::from(cost) <= u64::from(self.quota) {
            Some(0)
        } else {
            Some(self.until_window_end(now))
        }
    }

    fn quota(&self) -> u32 {
        self.quota
    }

    fn window(&self) -> Option<u64> {
        Some(self.window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn windows_align_to_the_unix_epoch_and_reset_exactly() {
        let fw = FixedWindow::new(2, 60 * SEC);
        let now = 600 * SEC + 45 * SEC; // 45 s into an epoch-aligned minute
        let Step::Admit { state, .. } = fw.eval(0, 2, now) else {
            panic!()
        };
        assert_eq!(
            fw.eval(state, 1, now),
            Step::Refuse {
                wait: Some(15 * SEC)
            }
        );
        assert!(matches!(fw.eval(state, 1, 660 * SEC), Step::Admit { .. }));
        assert_eq!(fw.expiry(state), 660 * SEC);
    }

    #[test]
    fn a_state_of_a_later_window_is_kept_and_waited_for() {
        let fw = FixedWindow::new(2, 10 * SEC);
        let later = pack(3, 1); // window [30 s, 40 s) holds 1
        assert_eq!(
            fw.eval(later, 1, 25 * SEC),
            Step::Refuse {
                wait: Some(5 * SEC)
            }
        );
        assert_eq!(
            fw.eval(later, 2, 25 * SEC),
            Step::Refuse {
                wait: Some(15 * SEC)
            }
        );
        assert_eq!(fw.remaining(later, 25 * SEC), 0);
        assert_eq!(
            fw.eval(later, 1, 30 * SEC),
            Step::Admit {
                state: pack(3, 2),
                tag: 3
            }
        );
    }

    #[test]
    fn a_later_windows_state_emptied_by_a_withdrawal_keeps_this_window_spent_until_it_starts() {
        let fw = FixedWindow::new(2, SEC);
        // Window 10 is spent; a held request was charged in window 11, then withdrawn.
        let back = fw.undo(pack(11, 1), Charge::of(1, 11));
        assert_eq!(back, pack(11, 0));
        assert_eq!(
            fw.remaining(back, 10 * SEC + 5),
            0,
            "window 10 is still spent"
        );
        assert_eq!(
            fw.expiry(back),
            11 * SEC,
            "kept (not swept as fresh) until window 11"
        );
        assert_eq!(
            fw.expiry(pack(9, 0)),
            9 * SEC,
            "an empty past window is fresh"
        );
    }

    #[test]
    fn undo_in_a_later_window_changes_nothing() {
        let fw = FixedWindow::new(5, SEC);
        let Step::Admit { state, tag } = fw.eval(0, 3, 10 * SEC) else {
            panic!()
        };
        assert_eq!(
            fw.remaining(fw.undo(state, Charge::of(3, tag)), 10 * SEC),
            5
        );
        assert_eq!(fw.undo(state, Charge::of(3, tag + 1)), state);
    }
}
