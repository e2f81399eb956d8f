//! The four algorithms as pure functions over one state word per key (handled as a `u128`;
//! stored in 64 bits where the rule's states fit).
//!
//! A state of zero is the fresh state of every algorithm, so a missing table entry and a zero
//! entry mean the same thing. Times are integer nanoseconds since the Unix epoch.

mod concurrency;
mod fixed_window;
mod gcra;
mod sliding_window;

pub(crate) use concurrency::Concurrency;
pub(crate) use fixed_window::FixedWindow;
pub(crate) use gcra::Gcra;
pub(crate) use sliding_window::SlidingWindow;

use crate::clock::duration_to_nanos;
use crate::limit::{Algorithm, Limit};

/// What one algorithm decides for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Admit, storing `state`; `tag` identifies the charge for a later refund (window index).
    Admit { state: u128, tag: u64 },
    /// Refuse; `wait` until the same cost would pass (`None`: not a matter of time).
    Refuse { wait: Option<u64> },
}

/// An admission's charge on one key, to be taken back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Charge {
    pub(crate) cost: u32,
    /// The charge's window ([`Step::Admit`]'s tag).
    pub(crate) tag: u64,
    /// The key's state right after the charge.
    pub(crate) left: u128,
    /// When it is taken back: no earlier than the charge, and than any charge made since.
    pub(crate) now: u64,
}

#[cfg(test)]
impl Charge {
    /// A charge of `cost` in window `tag`, for the window algorithms' tests (which read neither
    /// `left` nor `now`).
    pub(crate) fn of(cost: u32, tag: u64) -> Self {
        Charge {
            cost,
            tag,
            left: 0,
            now: 0,
        }
    }
}

/// The operations every algorithm provides over its state word.
pub(crate) trait Algo {
    /// Decides `cost` at `now` against `state`, without side effects.
    fn eval(&self, state: u128, cost: u32, now: u64) -> Step;
    /// The state with an earlier admission's `charge` taken back.
    fn undo(&self, state: u128, charge: Charge) -> u128;
    /// When `state` becomes equivalent to fresh (`u64::MAX`: not by the passing of time).
    fn expiry(&self, state: u128) -> u64;
    /// Quota left at `now`.
    fn remaining(&self, state: u128, now: u64) -> u32;
    /// Nanoseconds until `cost` would pass (0: now; `None`: not a matter of time).
    fn wait(&self, state: u128, cost: u32, now: u64) -> Option<u64>;
    /// The quota advertised in headers (`q`).
    fn quota(&self) -> u32;
    /// The window advertised in headers (`w`), in nanoseconds.
    fn window(&self) -> Option<u64>;
}

/// One limit's algorithm with its parameters, ready to evaluate.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rule {
    Gcra(Gcra),
    Fixed(FixedWindow),
    Sliding(SlidingWindow),
    Concurrency(Concurrency),
}

macro_rules! dispatch {
    ($self:ident, $a:ident => $e:expr) => {
        match $self {
            Rule::Gcra($a) => $e,
            Rule::Fixed($a) => $e,
            Rule::Sliding($a) => $e,
            Rule::Concurrency($a) => $e,
        }
    };
}

impl Rule {
    /// The rule for `limit`.
    pub(crate) fn new(limit: &Limit) -> Rule {
        let quota = limit.quota().get();
        let window = duration_to_nanos(limit.window());
        match limit.algorithm() {
            Algorithm::TokenBucket { burst } => Rule::Gcra(Gcra::new(quota, window, burst.get())),
            Algorithm::FixedWindow => Rule::Fixed(FixedWindow::new(quota, window)),
            Algorithm::SlidingWindow => Rule::Sliding(SlidingWindow::new(quota, window)),
            Algorithm::Concurrency => Rule::Concurrency(Concurrency::new(quota)),
        }
    }

    /// Whether this rule's states fit a 64-bit word (see `table`): token buckets counted in
    /// whole nanoseconds, and concurrency counts. Window states pack an index and counts and
    /// stay 128-bit.
    pub(crate) fn fits_narrow(&self) -> bool {
        match self {
            Rule::Gcra(g) => g.fits_narrow(),
            Rule::Concurrency(_) => true,
            Rule::Fixed(_) | Rule::Sliding(_) => false,
        }
    }

    /// Whether every request uses one unit whatever its cost (concurrency slots).
    pub(crate) fn counts_requests(&self) -> bool {
        matches!(self, Rule::Concurrency(_))
    }

    /// `(remaining, reset)` after an admission that left `state` at `now`: reset is the time
    /// until the remaining quota grows by one (zero when full).
    pub(crate) fn after_admission(&self, state: u128, now: u64) -> (u32, Option<u64>) {
        let remaining = self.remaining(state, now);
        let reset = if remaining >= self.quota() {
            Some(0)
        } else {
            self.wait(state, remaining + 1, now)
        };
        (remaining, reset)
    }

    /// `(remaining, wait)` for a request of `cost` not charged against `state`; no wait for a
    /// cost above the limit's capacity, which never fits (a finite one would send the caller
    /// back to be refused again).
    pub(crate) fn pending(&self, state: u128, cost: u32, now: u64) -> (u32, Option<u64>) {
        let never = !matches!(self, Rule::Concurrency(_)) && cost > self.quota();
        let wait = if never {
            None
        } else {
            self.wait(state, cost, now)
        };
        (self.remaining(state, now), wait)
    }
}

impl Algo for Rule {
    #[inline]
    fn eval(&self, state: u128, cost: u32, now: u64) -> Step {
        dispatch!(self, a => a.eval(state, cost, now))
    }
    fn undo(&self, state: u128, charge: Charge) -> u128 {
        dispatch!(self, a => a.undo(state, charge))
    }
    fn expiry(&self, state: u128) -> u64 {
        dispatch!(self, a => a.expiry(state))
    }
    fn remaining(&self, state: u128, now: u64) -> u32 {
        dispatch!(self, a => a.remaining(state, now))
    }
    fn wait(&self, state: u128, cost: u32, now: u64) -> Option<u64> {
        dispatch!(self, a => a.wait(state, cost, now))
    }
    fn quota(&self) -> u32 {
        dispatch!(self, a => a.quota())
    }
    fn window(&self) -> Option<u64> {
        dispatch!(self, a => a.window())
    }
}

/// A window algorithm's step for a state of a window after `now`'s: nothing fits now, and the
/// state is left as it is (a free request passes without touching it; its tag is that window).
fn later(state: u128, cost: u32, wait: impl FnOnce() -> Option<u64>) -> Step {
    if cost == 0 {
        let tag = (state >> 64) as u64;
        Step::Admit { state, tag }
    } else {
        Step::Refuse { wait: wait() }
    }
}

/// `ceil(a / b)` saturated into u64 nanoseconds.
#[inline]
pub(crate) fn ceil_div_u64(a: u128, b: u128) -> u64 {
    match (u64::try_from(a), u64::try_from(b)) {
        (Ok(a), Ok(b)) => a.div_ceil(b),
        _ => u64::try_from(a.div_ceil(b)).unwrap_or(u64::MAX),
    }
}

/// `a / b`, by one 64-bit division when both fit, as they nearly always do: a 128-bit
/// division is a call of about a hundred instructions (`__udivti3`), and every response's
/// RateLimit figures take a few.
#[inline]
pub(crate) fn div(a: u128, b: u128) -> u128 {
    match (u64::try_from(a), u64::try_from(b)) {
        (Ok(a), Ok(b)) => u128::from(a / b),
        _ => a / b,
    }
}
