//! One shard's open-addressing table: linear probing over slots of a 16-byte key and an 8- or
//! 16-byte state, no per-entry heap node and no control bytes: a zero key marks a free slot.
//!
//! Keys are already uniform keyed hashes, so a key's first word picks its home slot directly
//! (multiply-shift onto any table size, no power-of-two rounding). So capacity need not double:
//! past [`DOUBLING_UNTIL`] slots it grows by a quarter, and it is clamped to what the shard's cap
//! needs at 7/8 load, plus an eighth for evicted entries (below). A full table costs
//! `24 * 8/7 * 9/8 = 30.9` (narrow states) or `32 * 8/7 * 9/8 = 41.1` (wide) bytes per key, and
//! a table just grown at most a quarter more, where a hash map that doubles pays up to twice
//! its full cost.
//!
//! Requests read an array without any lock (see `Table`), so an array's slots are never reused
//! or moved while it is in use:
//! - a key, once written into a free slot, stays in that slot for the array's life;
//! - an evicted entry stays in place, its state marked dead, until the next rebuild;
//! - a rebuild (growth, shrinking, or clearing out the dead) copies the entries into a new
//!   array, freezing each old state as it takes it, so that a request that still holds the old
//!   array fails its compare-and-swap instead of charging a copy nobody reads again.
//!
//! So a request that found its key can only charge that key's state, and only while the state
//! is live: there is no moment at which a slot holds another key's state.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Cell;

/// The free-slot marker: [`crate::Key`] is never zero.
const FREE: [u64; 2] = [0, 0];
/// Slots in a shard's first allocation.
const MIN_SLOTS: usize = 16;
/// Entries looked at to choose an eviction victim (as Redis's approximate LRU does).
const SAMPLES: usize = 5;
/// Slots looked at, one run from a random place, when every sampled entry was pinned. Not the
/// whole shard: with every entry pinned (more callers in flight than `max_keys`) each new
/// caller would walk them all under the shard's lock (review: 16,000 callers in flight
/// took 1.9 s to admit). A shard whose run holds only pinned entries grows instead.
const PINNED_SCAN: usize = 256;
/// Below this many slots a shard doubles (small tables cost little and should not rebuild
/// often); from it on it grows by a quarter, so the memory a grown table leaves unused stays
/// under a fifth. Rebuilding costs about four moves per entry over the table's growth instead
/// of doubling's one; a rebuild happens on the insert that needs room, as in any growing map.
const DOUBLING_UNTIL: usize = 256;

/// One entry: the key and its algorithm state.
#[derive(Debug, Default)]
pub(crate) struct Slot<S> {
    key: [AtomicU64; 2],
    pub(crate) state: S,
}

impl<S> Slot<S> {
    /// The slot's key ([`FREE`] if none). The first word is read first, with `Acquire`: the
    /// writer stores it last, with `Release`, so a reader that sees it sees the rest.
    #[inline]
    fn key(&self) -> [u64; 2] {
        let first = self.key[0].load(Ordering::Acquire);
        [first, self.key[1].load(Ordering::Relaxed)]
    }

    fn claim(&self, key: [u64; 2]) {
        self.key[1].store(key[1], Ordering::Relaxed);
        self.key[0].store(key[0], Ordering::Release);
    }
}

#[inline]
fn home(len: usize, key: [u64; 2]) -> usize {
    ((u128::from(key[0]) * len as u128) >> 64) as usize
}

#[inline]
fn next(len: usize, i: usize) -> usize {
    if i + 1 == len {
        0
    } else {
        i + 1
    }
}

/// Looks for `key` in `slots` without a lock: the index of the first entry with its key,
/// whatever its state. The entry may be frozen or dead (its state a mark): the reader finds that
/// when it reads the state, and asks the lock. Terminates: an array always keeps a free slot.
#[inline]
pub(crate) fn probe<S: Cell>(slots: &[Slot<S>], key: [u64; 2]) -> Option<usize> {
    look(slots, key, false)
}

/// The look itself; `skip_dead` (under the lock) passes over dead entries of the key, since
/// an evicted key may have been inserted again further on.
#[inline(always)]
fn look<S: Cell>(slots: &[Slot<S>], key: [u64; 2], skip_dead: bool) -> Option<usize> {
    if slots.is_empty() {
        return None;
    }
    let mut i = home(slots.len(), key);
    loop {
        let slot = &slots[i];
        let found = slot.key();
        if found == key && !(skip_dead && slot.state.mark() == Some(super::Mark::Dead)) {
            return Some(i);
        } else if found == FREE {
            return None;
        }
        i = next(slots.len(), i);
    }
}

/// The slots of one shard, as its lock's holder sees them.
#[derive(Debug)]
pub(crate) struct Slots<S> {
    slots: Arc<[Slot<S>]>,
    /// Live entries.
    len: usize,
    /// Evicted entries still in place (see the module's docs).
    dead: usize,
    rng: u64,
}

/// Slots needed to hold `entries` at no more than 7/8 load, with one slot always free.
pub(crate) fn slots_for(entries: usize) -> usize {
    (entries.saturating_mul(8) / 7 + 1).max(entries + 1)
}

/// Slots a shard capped at `cap` entries grows to at most (unless its entries are pinned):
/// its cap at 7/8 load, and an eighth more for entries evicted since the last rebuild, so
/// that a full shard is rebuilt once per an eighth of its cap evicted, not at every eviction.
pub(crate) fn max_slots(cap: usize) -> usize {
    slots_for(cap.saturating_add(cap / 8 + 1))
}

/// The capacity a table of `slots` grows to when it needs room.
fn grown(slots: usize) -> usize {
    if slots < DOUBLING_UNTIL {
        (slots * 2).max(MIN_SLOTS)
    } else {
        slots + slots / 4
    }
}

impl<S: Cell> Slots<S> {
    pub(crate) fn new(seed: u64) -> Self {
        Slots {
            slots: Arc::new([]),
            len: 0,
            dead: 0,
            rng: seed | 1,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The current array, as readers without the lock are to see it.
    pub(crate) fn array(&self) -> &Arc<[Slot<S>]> {
        &self.slots
    }

    /// The slot holding `key`'s live entry. Under the shard's lock no state is frozen (only a
    /// rebuild, which holds the lock, freezes, and it freezes the array it replaces).
    #[inline]
    pub(crate) fn find(&self, key: [u64; 2]) -> Option<usize> {
        look(&self.slots, key, true)
    }

    pub(crate) fn slot(&self, i: usize) -> &Slot<S> {
        &self.slots[i]
    }

    /// Inserts absent `key` with the fresh state, growing towards `max_slots` if needed (or
    /// rebuilding at the same size to clear out dead entries). The slot's index, and whether
    /// the array was replaced (the caller publishes the new one).
    pub(crate) fn insert(&mut self, key: [u64; 2], max_slots: usize) -> (usize, bool) {
        let mut rebuilt = false;
        if slots_for(self.len + self.dead + 1) > self.slots.len() {
            // Towards `max_slots`: a shard that evicts is at its cap, and its room for the
            // dead is what lies between the cap at 7/8 load and `max_slots`. At `max_slots`
            // this clears the dead out at the same size.
            let needed = slots_for(self.len + 1);
            let target = if needed > max_slots {
                // Past the clamp only when the entries found were pinned (requests in
                // flight), and then by a quarter too, not a slot per insert (a rebuild each).
                grown(self.slots.len()).max(needed)
            } else {
                grown(self.slots.len()).min(max_slots).max(needed)
            };
            self.rebuild(target, |_| true);
            rebuilt = true;
        }
        (self.insert_unchecked(key), rebuilt)
    }

    fn random(&mut self) -> u64 {
        // xorshift64*: sampling needs speed, not secrecy.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// The live state at `i`, if the slot holds a live entry.
    fn live(&self, i: usize) -> Option<u128> {
        let slot = &self.slots[i];
        if slot.key() == FREE {
            return None;
        }
        slot.state.live()
    }

    /// Of a few sampled entries, the one whose forgetting costs least by `rank`: the state
    /// that becomes fresh soonest, and of those the one that used least (`rank`'s order).
    /// Pinned entries (ranked `u64::MAX` first) are skipped; if the sample holds only those, a
    /// run of [`PINNED_SCAN`] slots is looked at. The victim's index, rank and the state it
    /// was ranked by, or `None` if every entry looked at is pinned.
    fn pick_victim(&mut self, rank: &impl Fn(u128) -> (u64, u32)) -> Option<Victim> {
        let n = self.slots.len();
        let mut best: Option<Victim> = None;
        let consider = |best: &mut Option<Victim>, index: usize, state: u128| {
            let r = rank(state);
            if r.0 != u64::MAX && !matches!(best, Some(b) if b.rank <= r) {
                *best = Some(Victim {
                    index,
                    rank: r,
                    state,
                });
            }
        };
        for _ in 0..SAMPLES.min(self.len) {
            let mut i = ((u128::from(self.random()) * n as u128) >> 64) as usize;
            let state = loop {
                match self.live(i) {
                    Some(state) => break state,
                    None => i = next(n, i),
                }
            };
            consider(&mut best, i, state);
        }
        if best.is_none() && n > 0 {
            let mut i = ((u128::from(self.random()) * n as u128) >> 64) as usize;
            for _ in 0..PINNED_SCAN.min(n) {
                if let Some(state) = self.live(i) {
                    consider(&mut best, i, state);
                }
                i = next(n, i);
            }
        }
        best
    }

    /// Evicts the entry whose forgetting costs least (see `pick_victim`): marks it dead, unless
    /// a request charged it after it was chosen (then another is chosen, for as long as that
    /// happens: each miss is another request's charge made, and giving up would put the
    /// shard past its cap). The victim's rank, or `None` if no entry could be evicted (every
    /// one looked at was pinned).
    pub(crate) fn evict(&mut self, rank: impl Fn(u128) -> (u64, u32)) -> Option<(u64, u32)> {
        loop {
            let victim = self.pick_victim(&rank)?;
            if self.slots[victim.index].state.kill(victim.state) {
                self.len -= 1;
                self.dead += 1;
                return Some(victim.rank);
            }
        }
    }

    /// Drops entries for which `keep` is false, returning how many; shrinks the allocation to
    /// what the survivors need. Entries are judged on their frozen states, so a request that
    /// charges one meanwhile either lands before the freeze (and is judged with it) or fails
    /// and asks the lock.
    pub(crate) fn retain(&mut self, keep: impl Fn(u128) -> bool) -> (usize, bool) {
        let survivors = (0..self.slots.len())
            .filter(|&i| self.live(i).is_some_and(&keep))
            .count();
        let before = self.len;
        if survivors == self.len && self.dead == 0 {
            return (0, false);
        }
        let target = if survivors == 0 {
            0
        } else {
            slots_for(survivors).max(MIN_SLOTS)
        };
        self.rebuild(target, keep);
        (before - self.len, true)
    }

    /// Moves the kept live entries into a fresh array of `size` slots (at least enough for
    /// them), freezing every state of the old one.
    fn rebuild(&mut self, size: usize, keep: impl Fn(u128) -> bool) {
        let fresh: Arc<[Slot<S>]> = (0..size).map(|_| Slot::default()).collect();
        let old = std::mem::replace(&mut self.slots, fresh);
        let mut kept = Vec::new();
        for slot in old.iter() {
            let key = slot.key();
            if key == FREE {
                continue;
            }
            if let Some(state) = slot.state.freeze() {
                if keep(state) {
                    kept.push((key, state));
                }
            }
        }
        if slots_for(kept.len()) > self.slots.len() {
            // More survived the freeze than were counted live before it: never too small.
            let size = slots_for(kept.len()).max(MIN_SLOTS);
            self.slots = (0..size).map(|_| Slot::default()).collect();
        }
        self.len = 0;
        self.dead = 0;
        for (key, state) in kept {
            let i = self.insert_unchecked(key);
            self.slots[i].state.store(state);
        }
    }

    fn insert_unchecked(&mut self, key: [u64; 2]) -> usize {
        let n = self.slots.len();
        let mut i = home(n, key);
        while self.slots[i].key() != FREE {
            i = next(n, i);
        }
        self.slots[i].claim(key);
        self.len += 1;
        i
    }

    #[cfg(test)]
    fn state(&self, i: usize) -> u128 {
        self.slots[i].state.load()
    }
}

/// An entry chosen for eviction.
#[derive(Debug, Clone, Copy)]
struct Victim {
    index: usize,
    rank: (u64, u32),
    /// The state it was ranked by: it is marked dead only if still that.
    state: u128,
}

#[cfg(test)]
mod tests {
    use super::*;
    use portable_atomic::AtomicU128;

    type Wide = Slots<AtomicU128>;

    fn key(i: u64) -> [u64; 2] {
        // Spread like a hash, but crowd homes to exercise wrap-around.
        [i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1, i + 1]
    }

    fn put<S: Cell>(s: &mut Slots<S>, i: u64, state: u128) {
        let (at, _) = s.insert(key(i), usize::MAX);
        s.slot(at).state.store(state);
    }

    /// Victims charged between being chosen and being marked dead (here: every entry, each
    /// time one is ranked, for the first 400 rankings, 80 victims' worth) are passed over
    /// until one is not: the eviction happens, so the insert that needed room does not put
    /// the shard past its cap.
    #[test]
    fn an_eviction_outlasts_victims_charged_under_it() {
        let mut s = Wide::new(7);
        for i in 0..100 {
            put(&mut s, i, 5);
        }
        let slots = Arc::clone(s.array());
        let rankings = std::cell::Cell::new(0);
        let charged_under = |state: u128| {
            rankings.set(rankings.get() + 1);
            if rankings.get() <= 400 {
                for slot in slots.iter().filter(|slot| slot.key() != FREE) {
                    Cell::store(&slot.state, Cell::load(&slot.state) + 1);
                }
            }
            (u64::try_from(state).unwrap(), 0)
        };
        assert!(s.evict(charged_under).is_some());
        assert!(rankings.get() > 400, "{} rankings", rankings.get());
        assert_eq!((s.len(), s.dead), (99, 1));
    }

    /// An evicted entry stays in place, dead, and every other key stays findable; the key can
    /// come back (in another slot), and the next rebuild clears the dead out.
    #[test]
    fn evicted_entries_stay_dead_in_place_until_a_rebuild() {
        let mut s = Wide::new(7);
        for i in 0..1000 {
            put(&mut s, i, 5);
        }
        let capacity = s.capacity();
        let mut evicted = Vec::new();
        for _ in 0..100 {
            assert_eq!(s.evict(|_| (1, 0)), Some((1, 0)));
        }
        for i in 0..1000 {
            match s.find(key(i)) {
                Some(at) => assert_eq!(s.state(at), 5),
                None => evicted.push(i),
            }
        }
        assert_eq!((evicted.len(), s.len(), s.dead), (100, 900, 100));
        assert_eq!(s.capacity(), capacity, "no rebuild for an eviction");
        // An evicted key inserted again is found live past its dead entry.
        let (again, rebuilt) = s.insert(key(evicted[0]), usize::MAX);
        assert!(!rebuilt);
        assert_eq!(s.find(key(evicted[0])), Some(again));
        assert_eq!(s.find(key(evicted[1])), None);
        let Some(dead) = probe(&s.slots, key(evicted[1])) else {
            panic!("a dead entry is found without the lock");
        };
        assert_eq!(s.slots[dead].state.mark(), Some(super::super::Mark::Dead));
        // A rebuild drops the dead.
        assert_eq!(s.retain(|_| true), (0, true));
        assert_eq!((s.len(), s.dead), (901, 0));
    }

    /// A victim charged after it was chosen is not killed: its charge would be lost.
    #[test]
    fn a_victim_charged_meanwhile_is_not_killed() {
        let mut s = Wide::new(7);
        put(&mut s, 1, 5);
        let victim = s.pick_victim(&|_| (1, 0)).unwrap();
        Cell::store(&s.slot(victim.index).state, 6);
        assert!(!s.slot(victim.index).state.kill(victim.state));
        assert_eq!(s.state(victim.index), 6);
    }

    /// A rebuild freezes the array it replaces: a reader still holding it finds its key
    /// frozen, and a compare-and-swap on the old state fails.
    #[test]
    fn a_rebuild_freezes_the_old_array() {
        let mut s = Wide::new(7);
        put(&mut s, 1, 5);
        let old = Arc::clone(s.array());
        let Some(at) = probe(&old, key(1)) else {
            panic!("key 1 not found");
        };
        for i in 2..100 {
            put(&mut s, i, 5);
        }
        assert!(!Arc::ptr_eq(&old, s.array()), "grown");
        assert_eq!(probe(&old, key(1)), Some(at));
        assert_eq!(old[at].state.mark(), Some(super::super::Mark::Frozen));
        assert!(Cell::compare_exchange_weak(&old[at].state, 5, 6).is_err());
        assert_eq!(s.state(s.find(key(1)).unwrap()), 5);
    }

    /// A full shard (live entries at its cap) is rebuilt once per an eighth of its cap
    /// evicted, not at every eviction.
    #[test]
    fn a_full_shard_clears_its_dead_once_per_an_eighth_of_its_cap() {
        let cap = 800;
        let mut s = Slots::<std::sync::atomic::AtomicU64>::new(7);
        let mut rebuilds = 0;
        for i in 0..10_000 {
            if s.len() >= cap {
                assert!(s.evict(|_| (1, 0)).is_some());
            }
            let (at, rebuilt) = s.insert(key(i), max_slots(cap));
            Cell::store(&s.slot(at).state, 1);
            rebuilds += usize::from(rebuilt && i >= cap as u64);
            assert!(s.len() <= cap && s.capacity() <= max_slots(cap));
        }
        // 9,200 evictions, a rebuild per about 100 of them.
        assert!((80..=100).contains(&rebuilds), "{rebuilds} rebuilds");
    }

    #[test]
    fn growth_is_clamped_to_the_cap_at_seven_eighths_load() {
        let mut s = Wide::new(7);
        let max = slots_for(100);
        for i in 0..100 {
            s.insert(key(i), max);
        }
        assert_eq!(s.capacity(), max);
        assert!(s.capacity() * 7 >= s.len() * 8);
    }

    /// Past the doubling range a table is never more than a quarter (and a slot) larger than
    /// its entries need at 7/8 load, at any count.
    #[test]
    fn grown_tables_stay_within_a_quarter_of_full() {
        let mut s = Slots::<std::sync::atomic::AtomicU64>::new(7);
        let mut grew = 0;
        let mut last = 0;
        for i in 0..200_000 {
            s.insert(key(i), usize::MAX);
            if s.capacity() != last {
                grew += 1;
                last = s.capacity();
            }
            if s.capacity() > 256 {
                let needed = slots_for(s.len());
                assert!(
                    s.capacity() * 4 <= needed * 5 + 4,
                    "{} slots for {}",
                    s.capacity(),
                    s.len()
                );
            }
            assert!(s.capacity() * 7 >= s.len() * 8);
        }
        // Doubling to 256, then by a quarter to about 228,000.
        assert!((25..40).contains(&grew), "{grew} rebuilds");
        for i in (0..200_000).step_by(997) {
            assert!(s.find(key(i)).is_some(), "key {i}");
        }
    }

    #[test]
    fn retain_shrinks_and_keeps_survivors() {
        let mut s = Wide::new(7);
        for i in 0..500 {
            put(&mut s, i, u128::from(i));
        }
        assert_eq!(s.retain(|state| state >= 490), (490, true));
        assert_eq!(s.len(), 10);
        assert_eq!(s.capacity(), MIN_SLOTS);
        assert_eq!(s.state(s.find(key(495)).unwrap()), 495);
        assert!(s.find(key(3)).is_none());
        assert_eq!(
            s.retain(|_| true),
            (0, false),
            "nothing to remove: no rebuild"
        );
    }

    #[test]
    fn victim_is_never_a_pinned_entry() {
        let mut s = Wide::new(7);
        let pinned = AtomicU128::LIVE_MAX;
        for i in 0..50 {
            put(&mut s, i, if i == 42 { 0 } else { pinned });
        }
        let rank = |state: u128| (if state == pinned { u64::MAX } else { 1 }, 0);
        let victim = s.pick_victim(&rank).unwrap();
        assert_eq!(s.find(key(42)), Some(victim.index));
    }

    /// More callers pinned than the cap (requests in flight): each new one costs a bounded
    /// look and the table grows by a quarter at a time, not a slot (a rebuild) per insert.
    #[test]
    fn pinned_entries_past_the_cap_grow_the_table_a_quarter_at_a_time() {
        let mut s = Slots::<std::sync::atomic::AtomicU64>::new(7);
        let max = max_slots(16);
        let (mut rebuilds, mut last) = (0, 0);
        for i in 0..20_000 {
            if s.len() >= 16 {
                assert_eq!(s.evict(|_| (u64::MAX, 0)), None);
            }
            let (at, _) = s.insert(key(i), max);
            Cell::store(&s.slot(at).state, 7);
            if s.capacity() != last {
                rebuilds += 1;
                last = s.capacity();
            }
        }
        assert_eq!(s.len(), 20_000);
        assert!(
            rebuilds < 40,
            "{rebuilds} rebuilds for 20,000 pinned entries"
        );
    }

    /// Among entries that become fresh at the same moment (one window's callers), the one
    /// that used least is forgotten first: a spent caller is evicted only when every sampled
    /// entry was spent (1 in 32 here), not half the time.
    #[test]
    fn victim_among_equal_expiries_is_the_one_that_used_least() {
        let mut s = Wide::new(7);
        for i in 0..1_000 {
            put(&mut s, i, if i % 2 == 0 { 1 } else { 100 });
        }
        let mut spent = 0;
        for _ in 0..400 {
            let victim = s.pick_victim(&|used| (1_000, used as u32)).unwrap();
            assert_eq!(victim.rank, (1_000, s.state(victim.index) as u32));
            spent += usize::from(s.state(victim.index) == 100);
        }
        assert!(spent < 40, "{spent} of 400 victims had spent their quota");
    }
}
