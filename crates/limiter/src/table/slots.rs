//! One shard's open-addressing table: linear probing over slots of a 16-byte key and an 8- or
//! 16-byte state, no per-entry heap node and no control bytes: a zero key marks a free slot.
//!
//! Keys are already uniform keyed hashes, so a key's first word picks its home slot directly
//! (multiply-shift onto any table size, no power-of-two rounding). So capacity need not double:
//! past [`DOUBLING_UNTIL`] slots it grows by a quarter, and it is clamped to what the shard's cap
//! needs at 7/8 load. A full table costs `24 * 8/7 = 27.4` (narrow states) or `32 * 8/7 = 36.6`
//! (wide) bytes per key, and a table just grown at most a quarter more (34.3 or 45.7), where a
//! hash map that doubles pays up to twice its full cost.

use super::Cell;

/// The free-slot marker: [`crate::Key`] is never zero.
const FREE: [u64; 2] = [0, 0];
/// Slots in a shard's first allocation.
const MIN_SLOTS: usize = 16;
/// Entries looked at to choose an eviction victim (as Redis's approximate LRU does).
const SAMPLES: usize = 5;
/// Slots looked at, one run from a random place, when every sampled entry was pinned. Not the
/// whole shard: with every entry pinned (more callers in flight than `max_keys`) each new
/// caller would walk them all under the shard's write lock (review: 16,000 callers in flight
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
    key: [u64; 2],
    pub(crate) state: S,
}

/// The slots of one shard.
#[derive(Debug)]
pub(crate) struct Slots<S> {
    slots: Box<[Slot<S>]>,
    len: usize,
    rng: u64,
}

/// Slots needed to hold `entries` at no more than 7/8 load, with one slot always free.
pub(crate) fn slots_for(entries: usize) -> usize {
    (entries.saturating_mul(8) / 7 + 1).max(entries + 1)
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
            slots: Box::default(),
            len: 0,
            rng: seed | 1,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    #[inline]
    fn home(&self, key: [u64; 2]) -> usize {
        ((u128::from(key[0]) * self.slots.len() as u128) >> 64) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// The slot holding `key`. Terminates: there is always a free slot.
    #[inline]
    pub(crate) fn find(&self, key: [u64; 2]) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut i = self.home(key);
        loop {
            let slot = &self.slots[i];
            if slot.key == key {
                return Some(i);
            }
            if slot.key == FREE {
                return None;
            }
            i = self.next(i);
        }
    }

    pub(crate) fn slot(&self, i: usize) -> &Slot<S> {
        &self.slots[i]
    }

    /// Inserts absent `key` with the fresh state, growing towards `max_slots` if needed.
    pub(crate) fn insert(&mut self, key: [u64; 2], max_slots: usize) -> usize {
        let needed = slots_for(self.len + 1);
        if needed > self.slots.len() {
            let grown = grown(self.slots.len());
            // Past the clamp only when the entries found were pinned (requests in flight),
            // and then by a quarter too, not a slot per insert (a rebuild each).
            let target = if needed > max_slots {
                grown.max(needed)
            } else {
                grown.min(max_slots).max(needed)
            };
            self.rebuild(target, |_| true);
        }
        let mut i = self.home(key);
        while self.slots[i].key != FREE {
            i = self.next(i);
        }
        self.slots[i].key = key;
        self.slots[i].state.set(0);
        self.len += 1;
        i
    }

    /// Removes the entry at `i`, shifting later entries of its probe run back (no tombstones).
    pub(crate) fn remove_at(&mut self, mut i: usize) {
        let mut j = i;
        loop {
            j = self.next(j);
            let key = self.slots[j].key;
            if key == FREE {
                break;
            }
            let home = self.home(key);
            // Move j into the hole at i unless its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !stays {
                let state = self.slots[j].state.get();
                self.slots[i].key = key;
                self.slots[i].state.set(state);
                i = j;
            }
        }
        self.slots[i].key = FREE;
        self.slots[i].state.set(0);
        self.len -= 1;
    }

    fn random(&mut self) -> u64 {
        // xorshift64*: sampling needs speed, not secrecy.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Of a few sampled entries, the one whose forgetting costs least by `rank`: the state
    /// that becomes fresh soonest, and of those the one that used least (`rank`'s order).
    /// Pinned entries (ranked `u64::MAX` first) are skipped; if the sample holds only those, a
    /// run of [`PINNED_SCAN`] slots is looked at. The victim's index and rank, or `None` if
    /// every entry looked at is pinned.
    pub(crate) fn pick_victim(
        &mut self,
        rank: impl Fn(u128) -> (u64, u32),
    ) -> Option<(usize, (u64, u32))> {
        let n = self.slots.len();
        let mut best: Option<((u64, u32), usize)> = None;
        let consider = |best: &mut Option<((u64, u32), usize)>, i: usize, state: u128| {
            let r = rank(state);
            if r.0 != u64::MAX && !matches!(best, Some((b, _)) if *b <= r) {
                *best = Some((r, i));
            }
        };
        for _ in 0..SAMPLES.min(self.len) {
            let mut i = ((u128::from(self.random()) * n as u128) >> 64) as usize;
            while self.slots[i].key == FREE {
                i = self.next(i);
            }
            consider(&mut best, i, self.slots[i].state.get());
        }
        if best.is_none() && n > 0 {
            let mut i = ((u128::from(self.random()) * n as u128) >> 64) as usize;
            for _ in 0..PINNED_SCAN.min(n) {
                if self.slots[i].key != FREE {
                    consider(&mut best, i, self.slots[i].state.get());
                }
                i = self.next(i);
            }
        }
        best.map(|(r, i)| (i, r))
    }

    /// Drops entries for which `keep` is false, returning how many; shrinks the allocation to
    /// what the survivors need.
    pub(crate) fn retain(&mut self, keep: impl Fn(u128) -> bool) -> usize {
        let survivors = self
            .slots
            .iter()
            .filter(|s| s.key != FREE && keep(s.state.load()))
            .count();
        let removed = self.len - survivors;
        if removed > 0 {
            let target = if survivors == 0 {
                0
            } else {
                slots_for(survivors).max(MIN_SLOTS)
            };
            self.rebuild(target, keep);
        }
        removed
    }

    /// Moves the kept entries into a fresh array of `size` slots.
    fn rebuild(&mut self, size: usize, keep: impl Fn(u128) -> bool) {
        let fresh: Box<[Slot<S>]> = (0..size).map(|_| Slot::default()).collect();
        let old = std::mem::replace(&mut self.slots, fresh);
        self.len = 0;
        for mut slot in old.into_vec() {
            let state = slot.state.get();
            if slot.key != FREE && keep(state) {
                let i = self.insert_unchecked(slot.key);
                self.slots[i].state.set(state);
            }
        }
    }

    fn insert_unchecked(&mut self, key: [u64; 2]) -> usize {
        let mut i = self.home(key);
        while self.slots[i].key != FREE {
            i = self.next(i);
        }
        self.slots[i].key = key;
        self.len += 1;
        i
    }

    #[cfg(test)]
    fn state(&self, i: usize) -> u128 {
        self.slots[i].state.load()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use portable_atomic::AtomicU128;
    use std::sync::atomic::Ordering;

    type Wide = Slots<AtomicU128>;

    fn key(i: u64) -> [u64; 2] {
        // Spread like a hash, but crowd homes to exercise wrap-around and shifting.
        [i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1, i + 1]
    }

    #[test]
    fn removal_keeps_every_other_key_findable() {
        let mut s = Wide::new(7);
        for i in 0..1000 {
            s.insert(key(i), usize::MAX);
        }
        for i in (0..1000).step_by(3) {
            let at = s.find(key(i)).unwrap();
            s.remove_at(at);
        }
        for i in 0..1000 {
            assert_eq!(s.find(key(i)).is_some(), i % 3 != 0, "key {i}");
        }
        assert_eq!(s.len(), 1000 - 334);
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
    /// its entries need at 7/8 load, at any count: 45.7 bytes per key for 32-byte slots at
    /// worst, not a doubled map's 73.
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
            let at = s.insert(key(i), usize::MAX);
            s.slot(at).state.store(u128::from(i), Ordering::Relaxed);
        }
        assert_eq!(s.retain(|state| state >= 490), 490);
        assert_eq!(s.len(), 10);
        assert_eq!(s.capacity(), MIN_SLOTS);
        assert_eq!(s.state(s.find(key(495)).unwrap()), 495);
        assert!(s.find(key(3)).is_none());
    }

    #[test]
    fn victim_is_never_a_pinned_entry() {
        let mut s = Wide::new(7);
        for i in 0..50 {
            let at = s.insert(key(i), usize::MAX);
            let pinned = if i == 42 { 0 } else { u128::MAX };
            s.slot(at).state.store(pinned, Ordering::Relaxed);
        }
        let rank = |state: u128| (if state == u128::MAX { u64::MAX } else { 1 }, 0);
        let (victim, _) = s.pick_victim(rank).unwrap();
        assert_eq!(s.find(key(42)), Some(victim));
    }

    /// More callers pinned than the cap (requests in flight): each new one costs a bounded
    /// look and the table grows by a quarter at a time, not a slot (a rebuild) per insert.
    #[test]
    fn pinned_entries_past_the_cap_grow_the_table_a_quarter_at_a_time() {
        let mut s = Slots::<std::sync::atomic::AtomicU64>::new(7);
        let max = slots_for(16);
        let (mut rebuilds, mut last) = (0, 0);
        for i in 0..20_000 {
            if s.len() >= 16 {
                assert_eq!(s.pick_victim(|_| (u64::MAX, 0)), None);
            }
            let at = s.insert(key(i), max);
            s.slot(at).state.store(u64::MAX, Ordering::Relaxed);
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
            let at = s.insert(key(i), usize::MAX);
            let used = if i % 2 == 0 { 1 } else { 100 };
            s.slot(at).state.store(used, Ordering::Relaxed);
        }
        let mut spent = 0;
        for _ in 0..400 {
            let (victim, rank) = s.pick_victim(|used| (1_000, used as u32)).unwrap();
            assert_eq!(rank, (1_000, s.state(victim) as u32));
            spent += usize::from(s.state(victim) == 100);
        }
        assert!(spent < 40, "{spent} of 400 victims had spent their quota");
    }
}
