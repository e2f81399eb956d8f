//! Sliding window: the two-counter estimate `previous * (1 - elapsed / window) + current`,
//! computed exactly in integers (`previous * (window - elapsed) + current * window`, compared
//! with `quota * window`). State: window index (high 64 bits), previous count (32), current (32).

use super::{div, later, Algo, Charge, Step};

/// `quota` per sliding window of `window` nanoseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlidingWindow {
    quota: u32,
    window: u64,
}

fn pack(index: u64, previous: u32, current: u32) -> u128 {
    (u128::from(index) << 64) | (u128::from(previous) << 32) | u128::from(current)
}

fn unpack(state: u128) -> (u64, u32, u32) {
    ((state >> 64) as u64, (state >> 32) as u32, state as u32)
}

impl SlidingWindow {
    pub(crate) fn new(quota: u32, window: u64) -> Self {
        SlidingWindow { quota, window }
    }

    /// (previous, current) counts as seen from the window containing `now`. A state of a later
    /// window (charged ahead for a delayed request, or by a request that read the clock after
    /// this one) leaves no room now: the counts `now` would need were given up when the state
    /// moved on.
    #[inline]
    fn counts_at(&self, state: u128, now: u64) -> (u32, u32) {
        let (index, previous, current) = unpack(state);
        let now_index = now / self.window;
        if index == now_index {
            (previous, current)
        } else if index.checked_add(1) == Some(now_index) {
            (current, 0)
        } else if index > now_index {
            (0, self.quota)
        } else {
            (0, 0)
        }
    }

    /// For a state of a window after `now`'s: the start of that window.
    fn later_start(&self, state: u128, now: u64) -> Option<u64> {
        let (index, _, _) = unpack(state);
        (index > now / self.window).then(|| index.saturating_mul(self.window))
    }

    /// The estimate scaled by the window: `previous * (window - elapsed) + current * window`.
    #[inline]
    fn used_scaled(&self, previous: u32, current: u32, now: u64) -> u128 {
        let w = u128::from(self.window);
        let elapsed = u128::from(now % self.window);
        u128::from(previous) * (w - elapsed) + u128::from(current) * w
    }

    /// The first offset into a window at which `weight` requests decaying over it leave room for
    /// `room` more (`window` if never within that window).
    fn first_fit(&self, weight: u32, room: u128) -> u128 {
        let w = u128::from(self.window);
        if weight == 0 {
            return 0;
        }
        w - div(room * w, u128::from(weight)).min(w)
    }
}

impl Algo for SlidingWindow {
    #[inline]
    fn eval(&self, state: u128, cost: u32, now: u64) -> Step {
        if self.later_start(state, now).is_some() {
            return later(state, cost, || self.wait(state, cost, now));
        }
        let (previous, current) = self.counts_at(state, now);
        let used = self.used_scaled(previous, current, now);
        let limit = u128::from(self.quota) * u128::from(self.window);
        if used + u128::from(cost) * u128::from(self.window) <= limit {
            let index = now / self.window;
            // current + cost <= quota here, so it fits in 32 bits.
            Step::Admit {
                state: pack(index, previous, current + cost),
                tag: index,
            }
        } else {
            Step::Refuse {
                wait: self.wait(state, cost, now),
            }
        }
    }

    fn undo(&self, state: u128, charge: Charge) -> u128 {
        let (index, previous, current) = unpack(state);
        let (cost, tag) = (charge.cost, charge.tag);
        if index == tag {
            pack(index, previous, current.saturating_sub(cost))
        } else if tag.checked_add(1) == Some(index) {
            pack(index, previous.saturating_sub(cost), current)
        } else {
            state // the charge no longer weighs on any estimate
        }
    }

    /// When the counts stop weighing on any estimate; with nothing counted, the start of the
    /// state's window: a state of a later window (charged ahead for a held request, which was
    /// then withdrawn) also says that the windows before it are spent, and must outlive them.
    fn expiry(&self, state: u128) -> u64 {
        let (index, previous, current) = unpack(state);
        let windows_left = if current > 0 {
            2
        } else {
            u64::from(previous > 0)
        };
        index
            .saturating_add(windows_left)
            .saturating_mul(self.window)
    }

    fn remaining(&self, state: u128, now: u64) -> u32 {
        let (previous, current) = self.counts_at(state, now);
        let limit = u128::from(self.quota) * u128::from(self.window);
        let room = limit.saturating_sub(self.used_scaled(previous, current, now));
        u32::try_from(div(room, u128::from(self.window))).unwrap_or(u32::MAX)
    }

    fn wait(&self, state: u128, cost: u32, now: u64) -> Option<u64> {
        if let Some(start) = self.later_start(state, now) {
            return Some((start - now).saturating_add(self.wait(state, cost, start)?));
        }
        let (previous, current) = self.counts_at(state, now);
        let (q, n, w) = (self.quota, cost, u128::from(self.window));
        let used = self.used_scaled(previous, current, now);
        if used + u128::from(n) * w <= u128::from(q) * w {
            return Some(0);
        }
        let elapsed = u128::from(now % self.window);
        // Later in this window, as `previous` decays.
        if let Some(room) = q.checked_sub(current).and_then(|r| r.checked_sub(n)) {
            let at = self.first_fit(previous, u128::from(room));
            if at < w {
                return Some(u64::try_from(at - elapsed).unwrap_or(u64::MAX));
            }
        }
        // In the next window `current` becomes the decaying count; after it, nothing weighs.
        let room = q.checked_sub(n)?;
        let at = self.first_fit(current, u128::from(room)).min(w);
        Some(u64::try_from(w - elapsed + at).unwrap_or(u64::MAX))
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
    fn eighty_last_minute_ten_now_a_quarter_in_estimates_seventy() {
        // The seed text's example: 80 * 0.75 + 10 = 70, so 30 of 100 remain.
        let sw = SlidingWindow::new(100, 60 * SEC);
        let minute = 1_000;
        let state = pack(minute, 80, 10);
        let now = minute * 60 * SEC + 15 * SEC;
        assert_eq!(sw.remaining(state, now), 30);
        assert!(matches!(sw.eval(state, 30, now), Step::Admit { .. }));
        assert!(matches!(sw.eval(state, 31, now), Step::Refuse { .. }));
    }

    #[test]
    fn a_state_of_a_later_window_is_kept_and_waited_for() {
        let sw = SlidingWindow::new(100, 60 * SEC);
        let later = pack(1_001, 80, 10); // the minute after `now`'s
        let now = 1_000 * 60 * SEC + 45 * SEC;
        assert_eq!(sw.remaining(later, now), 0);
        // From that minute's start: 80 * (1 - e) + 10 + 30 <= 100 at e = 0.25 (the seed's
        // example: 70 used a quarter in).
        assert_eq!(sw.wait(later, 30, now), Some(15 * SEC + 15 * SEC));
        assert!(matches!(sw.eval(later, 1, now), Step::Refuse { .. }));
        assert_eq!(
            sw.eval(later, 30, now + 30 * SEC),
            Step::Admit {
                state: pack(1_001, 80, 40),
                tag: 1_001
            }
        );
    }

    #[test]
    fn refused_request_waits_until_the_previous_window_decays_enough() {
        // 80 previous, 10 current, a quarter in: 31 more fit once 80 * (1 - x) <= 59,
        // i.e. x >= 21/80 of the window: 15.75 s into the minute, 0.75 s from now.
        let sw = SlidingWindow::new(100, 60 * SEC);
        let state = pack(1_000, 80, 10);
        let now = 1_000 * 60 * SEC + 15 * SEC;
        assert_eq!(sw.wait(state, 31, now), Some(750_000_000));
        assert!(matches!(
            sw.eval(state, 31, now + 750_000_000),
            Step::Admit { .. }
        ));
        assert!(matches!(
            sw.eval(state, 31, now + 749_999_999),
            Step::Refuse { .. }
        ));
    }

    #[test]
    fn full_current_window_waits_into_the_next() {
        let sw = SlidingWindow::new(10, 10 * SEC);
        let state = pack(5, 0, 10);
        // In window 6, the 10 decay: 1 fits once 10 * (1 - x) <= 9, x >= 0.1: at 61 s.
        assert_eq!(sw.wait(state, 1, 55 * SEC), Some(6 * SEC));
        // A full-quota request must wait for the window after next.
        assert_eq!(sw.wait(state, 10, 55 * SEC), Some(15 * SEC));
        assert_eq!(sw.expiry(state), 70 * SEC);
    }

    #[test]
    fn a_later_windows_state_emptied_by_a_withdrawal_keeps_the_windows_before_it_spent() {
        let sw = SlidingWindow::new(1, SEC);
        // Window 10 is spent (quota 1); a held request was charged two windows ahead, in 12
        // (in 11 the one of 10 still weighs), then withdrawn.
        let back = sw.undo(pack(12, 0, 1), Charge::of(1, 12));
        assert_eq!(unpack(back), (12, 0, 0));
        assert_eq!(
            sw.remaining(back, 11 * SEC + 5),
            0,
            "window 11 is still spent"
        );
        assert_eq!(
            sw.expiry(back),
            12 * SEC,
            "kept (not swept as fresh) until window 12"
        );
        assert_eq!(
            sw.expiry(pack(9, 0, 0)),
            9 * SEC,
            "an empty past window is fresh"
        );
    }

    #[test]
    fn undo_reaches_the_charge_after_it_became_previous() {
        let sw = SlidingWindow::new(10, SEC);
        let Step::Admit { state, tag } = sw.eval(0, 4, 3 * SEC) else {
            panic!()
        };
        let rolled = sw.eval(state, 1, 4 * SEC);
        let Step::Admit { state: later, .. } = rolled else {
            panic!()
        };
        assert_eq!(unpack(sw.undo(later, Charge::of(4, tag))), (4, 0, 1));
    }
}
