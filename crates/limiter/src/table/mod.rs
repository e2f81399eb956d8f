//! A keyed table: sharded, bounded, swept.
//!
//! Why not dashmap: a `DashMap<Key, AtomicU128>` stores the same 32-byte entries plus a control
//! byte in power-of-two tables at 7/8 load, so at 1,000,000 keys it sits just past a doubling
//! (917,504 = 7/8 of 2^20) and holds 2^21 buckets: 69 bytes per key, against 27.4 (64-bit
//! states) or 36.6 (128-bit) here. It also cannot sample random entries for eviction. See
//! `examples/bytes_per_key.rs` for the figures.
//!
//! Requests take a shard's read lock and update their key's state by compare-and-swap; only a
//! new key, an eviction or a sweep takes the shard's write lock.
//!
//! A state is one atomic word: 64 bits where the algorithm's states provably fit (a token bucket
//! whose time unit is the nanosecond, a concurrency count, a block's end), else 128. The narrow
//! word is a plain `lock cmpxchg` (about half the cost of `cmpxchg16b`) and a 24-byte slot.

mod slots;

use portable_atomic::AtomicU128;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use crate::algo::{Algo, Rule};
use crate::Key;
use slots::{slots_for, Slots};

/// An atomic state word, read and written as a `u128` whatever its width.
pub(crate) trait Cell: Default + std::fmt::Debug + Send + Sync {
    fn load(&self) -> u128;
    fn get(&mut self) -> u128;
    fn set(&mut self, state: u128);
}

/// A narrow word holds states below 2^64 only; the rules that use it never make larger ones
/// (see `Rule::fits_narrow`), and a larger value saturates instead of wrapping.
fn narrow(state: u128) -> u64 {
    u64::try_from(state).unwrap_or(u64::MAX)
}

impl Cell for AtomicU64 {
    #[inline]
    fn load(&self) -> u128 {
        u128::from(AtomicU64::load(self, Ordering::Acquire))
    }
    fn get(&mut self) -> u128 {
        u128::from(*self.get_mut())
    }
    fn set(&mut self, state: u128) {
        *self.get_mut() = narrow(state);
    }
}

impl Cell for AtomicU128 {
    #[inline]
    fn load(&self) -> u128 {
        AtomicU128::load(self, Ordering::Acquire)
    }
    fn get(&mut self) -> u128 {
        *self.get_mut()
    }
    fn set(&mut self, state: u128) {
        *self.get_mut() = state;
    }
}

/// One key's state word in a table of either width.
#[derive(Clone, Copy)]
pub(crate) enum State<'a> {
    Narrow(&'a AtomicU64),
    Wide(&'a AtomicU128),
}

impl State<'_> {
    #[inline]
    pub(crate) fn load(self) -> u128 {
        match self {
            State::Narrow(s) => Cell::load(s),
            State::Wide(s) => Cell::load(s),
        }
    }

    /// A weak compare-and-swap: `Err` carries the value found.
    #[inline]
    pub(crate) fn compare_exchange_weak(self, current: u128, new: u128) -> Result<(), u128> {
        let (acq_rel, acquire) = (Ordering::AcqRel, Ordering::Acquire);
        match self {
            State::Narrow(s) => s
                .compare_exchange_weak(narrow(current), narrow(new), acq_rel, acquire)
                .map(drop)
                .map_err(u128::from),
            State::Wide(s) => s
                .compare_exchange_weak(current, new, acq_rel, acquire)
                .map(drop),
        }
    }

    /// Replaces the state with `f(state)` until that sticks; `None` leaves it as it is.
    pub(crate) fn update(self, mut f: impl FnMut(u128) -> Option<u128>) {
        let mut current = self.load();
        while let Some(new) = f(current) {
            match self.compare_exchange_weak(current, new) {
                Ok(()) => return,
                Err(actual) => current = actual,
            }
        }
    }
}

/// Shards per table, at most.
const MAX_SHARDS: usize = 64;

/// Places per shard, at least (but for tables smaller than this, which have one shard). The cap
/// is split evenly over the shards while keys land on them at random, so a shard fills, and
/// starts evicting, before the table as a whole does: with 64 shards, a table of 100 keys
/// evicted at a median of 14 keys held, one of 1,000 at 56%. With at least 4,096 places per
/// shard the first eviction comes at about 98% of `max_keys` for any size.
const MIN_SHARD_CAP: usize = 4096;

/// What a table's states mean, to tell when an entry is fresh again.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Expiry {
    /// States of this rule's algorithm.
    Rule(Rule),
    /// The state is itself the time it expires at (a block's end).
    Deadline,
}

impl Expiry {
    fn at(&self, state: u128) -> u64 {
        match self {
            Expiry::Rule(rule) => rule.expiry(state),
            Expiry::Deadline => u64::try_from(state).unwrap_or(u64::MAX),
        }
    }

    /// What forgetting `state` at `now` costs, least first: when it becomes fresh, then how
    /// much of the quota it holds used (one window's callers all become fresh at its end; of
    /// those, forgetting one that spent its quota gives it all back).
    fn rank(&self, state: u128, now: u64) -> (u64, u32) {
        let used = match self {
            Expiry::Rule(rule) => rule.quota().saturating_sub(rule.remaining(state, now)),
            Expiry::Deadline => 0,
        };
        (self.at(state), used)
    }
}

/// Counters describing a table, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TableStats {
    /// Keys held now.
    pub keys: usize,
    /// Keys evicted to make room for new ones since the table was made.
    pub evictions: u64,
    /// Full walks of the table by [`crate::Limiter::sweep`].
    pub walks: u64,
    /// Keys removed because they had returned to the fresh state: by sweeps, or to make room.
    pub swept: u64,
    /// Bytes held by the slot arrays.
    pub bytes: usize,
}

#[derive(Debug)]
#[repr(align(64))] // one cache line per shard lock: no false sharing between shards
struct Shard<S> {
    slots: RwLock<Slots<S>>,
    cap: usize,
}

/// A bounded map from [`Key`] to one state word of either width.
#[derive(Debug)]
pub(crate) enum Table {
    Narrow(Words<AtomicU64>),
    Wide(Words<AtomicU128>),
}

macro_rules! each {
    ($self:ident, $t:ident => $e:expr) => {
        match $self {
            Table::Narrow($t) => $e,
            Table::Wide($t) => $e,
        }
    };
}

impl Table {
    /// A table of at most `max_keys` keys (split exactly across shards), walked by sweeps at
    /// most once per `sweep_interval` nanoseconds, with narrow words if `narrow`.
    pub(crate) fn new(max_keys: usize, expiry: Expiry, sweep_interval: u64, narrow: bool) -> Self {
        if narrow {
            Table::Narrow(Words::new(max_keys, expiry, sweep_interval))
        } else {
            Table::Wide(Words::new(max_keys, expiry, sweep_interval))
        }
    }

    /// Runs `f` on `key`'s state, creating the entry (fresh) if absent; when the shard is full,
    /// an entry whose forgetting costs least at `now` (of a sample) makes room.
    #[inline]
    pub(crate) fn update<R>(&self, key: Key, now: u64, f: impl FnOnce(State<'_>) -> R) -> R {
        match self {
            Table::Narrow(t) => t.update(key, now, |s| f(State::Narrow(s))),
            Table::Wide(t) => t.update(key, now, |s| f(State::Wide(s))),
        }
    }

    /// Runs `f` on `key`'s state if the key is present.
    #[inline]
    pub(crate) fn existing<R>(&self, key: Key, f: impl FnOnce(State<'_>) -> R) -> Option<R> {
        match self {
            Table::Narrow(t) => t.existing(key, |s| f(State::Narrow(s))),
            Table::Wide(t) => t.existing(key, |s| f(State::Wide(s))),
        }
    }

    /// `key`'s state, fresh (zero) if absent.
    #[inline]
    pub(crate) fn load(&self, key: Key) -> u128 {
        self.existing(key, |s| s.load()).unwrap_or(0)
    }

    /// Removes entries that are fresh at `now`, walking the whole table, unless a walk already
    /// happened within the sweep interval. Returns whether it walked.
    pub(crate) fn sweep(&self, now: u64) -> bool {
        each!(self, t => t.sweep(now))
    }

    /// The table's counters.
    pub(crate) fn stats(&self) -> TableStats {
        each!(self, t => t.stats())
    }
}

/// A table of one word width.
#[derive(Debug)]
pub(crate) struct Words<S> {
    shards: Box<[Shard<S>]>,
    expiry: Expiry,
    sweep_interval: u64,
    next_walk: AtomicU64,
    walks: AtomicU64,
    swept: AtomicU64,
    evictions: AtomicU64,
}

/// A power of two from 1 to `MAX_SHARDS`, leaving each shard `MIN_SHARD_CAP` places or more.
fn shard_count(max_keys: usize) -> usize {
    let wanted = (max_keys / MIN_SHARD_CAP).clamp(1, MAX_SHARDS);
    1 << wanted.ilog2()
}

impl<S: Cell> Words<S> {
    fn new(max_keys: usize, expiry: Expiry, sweep_interval: u64) -> Self {
        let count = shard_count(max_keys);
        let shards = (0..count)
            .map(|i| Shard {
                slots: RwLock::new(Slots::new(0x5eed ^ ((i as u64) << 32))),
                cap: max_keys / count + usize::from(i < max_keys % count),
            })
            .collect();
        Words {
            shards,
            expiry,
            sweep_interval: sweep_interval.max(1),
            next_walk: AtomicU64::new(0),
            walks: AtomicU64::new(0),
            swept: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    #[inline]
    fn shard(&self, key: Key) -> &Shard<S> {
        // The first word's low bits (its high bits pick the slot within the shard): the
        // first word is ready three SipHash rounds before the second, so the shard's lock
        // need not wait for the whole key.
        &self.shards[key.0[0] as usize & (self.shards.len() - 1)]
    }

    #[inline]
    fn update<R>(&self, key: Key, now: u64, f: impl FnOnce(&S) -> R) -> R {
        let shard = self.shard(key);
        {
            let slots = shard.slots.read().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = slots.find(key.0) {
                return f(&slots.slot(i).state);
            }
        }
        let mut slots = shard.slots.write().unwrap_or_else(|e| e.into_inner());
        let i = match slots.find(key.0) {
            Some(i) => i,
            None => {
                if slots.len() >= shard.cap {
                    if let Some((victim, (expiry, _))) =
                        slots.pick_victim(|s| self.expiry.rank(s, now))
                    {
                        slots.remove_at(victim);
                        // One already fresh, not yet swept, took nothing with it: it
                        // counts as swept.
                        let count = if expiry > now {
                            &self.evictions
                        } else {
                            &self.swept
                        };
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                }
                slots.insert(key.0, slots_for(shard.cap))
            }
        };
        f(&slots.slot(i).state)
    }

    #[inline]
    fn existing<R>(&self, key: Key, f: impl FnOnce(&S) -> R) -> Option<R> {
        let slots = self
            .shard(key)
            .slots
            .read()
            .unwrap_or_else(|e| e.into_inner());
        slots.find(key.0).map(|i| f(&slots.slot(i).state))
    }

    fn sweep(&self, now: u64) -> bool {
        let due = self.next_walk.load(Ordering::Acquire);
        let next = now.saturating_add(self.sweep_interval);
        if now < due
            || self
                .next_walk
                .compare_exchange(due, next, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return false;
        }
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut slots = shard.slots.write().unwrap_or_else(|e| e.into_inner());
            removed += slots.retain(|s| self.expiry.at(s) > now);
        }
        self.swept.fetch_add(removed as u64, Ordering::Relaxed);
        self.walks.fetch_add(1, Ordering::Relaxed);
        true
    }

    fn stats(&self) -> TableStats {
        let (mut keys, mut slots_total) = (0, 0);
        for shard in self.shards.iter() {
            let slots = shard.slots.read().unwrap_or_else(|e| e.into_inner());
            keys += slots.len();
            slots_total += slots.capacity();
        }
        TableStats {
            keys,
            evictions: self.evictions.load(Ordering::Relaxed),
            walks: self.walks.load(Ordering::Relaxed),
            swept: self.swept.load(Ordering::Relaxed),
            bytes: slots_total * std::mem::size_of::<slots::Slot<S>>()
                + self.shards.len() * std::mem::size_of::<Shard<S>>(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KeyHasher;

    fn put(state: State<'_>, value: u128) {
        state.update(|_| Some(value));
    }

    /// Both widths of table, for tests that hold for either.
    fn tables(max_keys: usize, sweep_interval: u64) -> [Table; 2] {
        [false, true].map(|narrow| Table::new(max_keys, Expiry::Deadline, sweep_interval, narrow))
    }

    fn keys(n: u64) -> impl Iterator<Item = Key> {
        let h = KeyHasher::with_secret(b"table");
        (0..n).map(move |i| h.key(&[&i.to_le_bytes()]))
    }

    #[test]
    fn full_table_evicts_instead_of_growing() {
        for t in tables(1_000, 1) {
            for (i, k) in keys(5_000).enumerate() {
                t.update(k, 0, |s| put(s, i as u128 + 1));
            }
            let stats = t.stats();
            assert_eq!(stats.keys, 1_000);
            assert_eq!(stats.evictions, 4_000);
        }
    }

    /// An entry evicted after it became fresh (a long window's sweep has not come yet) takes
    /// nothing with it: it is not counted, and so not warned about, as an eviction.
    #[test]
    fn evicting_an_entry_already_fresh_is_not_counted() {
        for t in tables(1_000, 1) {
            let mut new = keys(1_200);
            for k in new.by_ref().take(1_000) {
                t.update(k, 0, |s| put(s, 10));
            }
            // At 500 every entry is fresh: the victims are, and are not counted.
            for k in new.by_ref().take(100) {
                t.update(k, 500, |s| put(s, 1_000));
            }
            assert_eq!((t.stats().keys, t.stats().evictions), (1_000, 0));
            assert_eq!(t.stats().swept, 100);
            // At 5 none is: the entries ending at 10 make room, and are counted.
            for k in new {
                t.update(k, 5, |s| put(s, 10));
            }
            assert_eq!((t.stats().keys, t.stats().evictions), (1_000, 100));
        }
    }

    #[test]
    fn eviction_prefers_entries_that_expire_soonest() {
        for t in tables(6_400, 1) {
            let all: Vec<Key> = keys(6_400).collect();
            for (i, k) in all.iter().enumerate() {
                // Half expired long ago, half recent.
                let deadline = if i % 2 == 0 { 1 } else { 1_000_000 };
                t.update(*k, 0, |s| put(s, deadline));
            }
            for k in keys(7_040).skip(6_400) {
                t.update(k, 0, |s| put(s, 1_000_000));
            }
            let recent = all.iter().skip(1).step_by(2);
            let recent_kept = recent.filter(|k| t.load(**k) != 0).count();
            // Five samples all recent: about 1 eviction in 20 takes a recent entry.
            assert!(
                recent_kept >= 3_100,
                "kept {recent_kept} of 3200 recent entries"
            );
        }
    }

    #[test]
    fn sweep_walks_at_most_once_per_interval_and_removes_fresh_entries() {
        for t in tables(1_000, 100) {
            let ks: Vec<Key> = keys(10).collect();
            for (i, k) in ks.iter().enumerate() {
                t.update(*k, 0, |s| put(s, if i < 4 { 50 } else { 500 }));
            }
            assert!(t.sweep(60));
            assert!(!t.sweep(159));
            assert!(t.sweep(160));
            let stats = t.stats();
            assert_eq!((stats.walks, stats.swept, stats.keys), (2, 4, 6));
        }
    }

    #[test]
    fn shards_keep_thousands_of_places_each() {
        let counts: Vec<usize> = [
            1,
            4,
            1000,
            8191,
            8192,
            100_000,
            262_144,
            1 << 20,
            usize::MAX,
        ]
        .iter()
        .map(|&m| shard_count(m))
        .collect();
        assert_eq!(counts, [1, 1, 1, 1, 2, 16, 64, 64, 64]);
    }

    /// A small table holds `max_keys` callers before it evicts any (review: with 64 shards, a
    /// table of 100 evicted with 14 callers held, by the median of random seeds).
    #[test]
    fn a_small_table_fills_before_it_evicts() {
        for t in tables(1000, 1) {
            for k in keys(1000) {
                t.update(k, 0, |s| put(s, 1));
            }
            assert_eq!((t.stats().keys, t.stats().evictions), (1000, 0));
        }
    }

    #[test]
    fn tiny_caps_are_split_exactly() {
        for cap in [1, 2, 3, 7, 64, 65, 1000] {
            let t = Words::<AtomicU64>::new(cap, Expiry::Deadline, 1);
            let total: usize = t.shards.iter().map(|s| s.cap).sum();
            assert_eq!(total, cap);
            assert!(t.shards.iter().all(|s| s.cap >= 1));
        }
    }

    #[test]
    fn narrow_words_hold_what_wide_ones_do_below_two_to_the_64() {
        let [wide, narrow] = tables(100, 1);
        let k = keys(1).next().unwrap();
        for t in [&wide, &narrow] {
            t.update(k, 0, |s| put(s, u128::from(u64::MAX)));
            assert_eq!(t.load(k), u128::from(u64::MAX));
            // A compare-and-swap against a stale value fails and reports the current one.
            let stale = t.update(k, 0, |s| s.compare_exchange_weak(7, 8));
            assert_eq!(stale, Err(u128::from(u64::MAX)));
        }
        // Beyond 64 bits a narrow word saturates rather than wrapping.
        narrow.update(k, 0, |s| put(s, u128::from(u64::MAX) + 5));
        assert_eq!(narrow.load(k), u128::from(u64::MAX));
        assert_eq!(std::mem::size_of::<slots::Slot<AtomicU64>>(), 24);
        assert_eq!(std::mem::size_of::<slots::Slot<AtomicU128>>(), 32);
    }
}
