//! Which block holds each registered hash: an open-addressed table of 8-byte slots.
//!
//! A slot packs a 32-bit tag of the hash (which also gives the slot the probe starts
//! from) and the block id. The full hash is not stored: a tag match is confirmed
//! against the hash in the block's entry, which a hit reads anyway. At most half the
//! slots are used, so a probe usually reads one cache line (eight slots), and the
//! table is a quarter the size of a `HashMap<BlockHash, BlockId>` with room for the
//! same arena (16-byte buckets, a control byte each, sized for 7/8 load).
//!
//! Removing a block's hash needs no confirmation (the block id is in the slot), and
//! the slot a hash probes first is known before the probe, so a caller that knows a
//! hash ahead of time can [`HashSlots::prefetch`] its line: eviction does, for the
//! block it will most likely evict next. Deletion shifts the rest of the run back
//! (linear probing without tombstones), so a table never degrades with churn.

use super::super::BlockHash;
use crate::ids::BlockId;
use crate::pool::prefetch;

/// An unused slot.
const EMPTY: u64 = 0;

/// See the module docs.
#[derive(Debug, Clone)]
pub(super) struct HashSlots {
    /// `tag << 32 | (block + 1)`, or `EMPTY`.
    slots: Vec<u64>,
    /// `slots.len() - 1` (a power of two minus one).
    mask: usize,
    len: usize,
}

/// The 32-bit tag of `h`: its bits folded and multiplied, so a hasher whose hashes
/// differ only in their high bits (a custom `PrefixHasher`) still spreads over slots.
#[inline]
fn tag(h: BlockHash) -> u32 {
    ((h.0 ^ (h.0 >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
}

#[inline]
fn pack(tag: u32, b: BlockId) -> u64 {
    (u64::from(tag) << 32) | (u64::from(b.0) + 1)
}

#[inline]
fn slot_tag(slot: u64) -> u32 {
    (slot >> 32) as u32
}

#[inline]
fn slot_block(slot: u64) -> BlockId {
    // Never called on `EMPTY`; the low half of a used slot is at least 1.
    BlockId(((slot & u64::from(u32::MAX)) as u32).wrapping_sub(1))
}

/// Slots for `blocks` blocks: a power of two, at least twice as many.
fn capacity_for(blocks: usize) -> usize {
    blocks.saturating_mul(2).max(16).next_power_of_two()
}

impl HashSlots {
    /// An empty table with room for `blocks` blocks (block ids below `u32::MAX`).
    pub(super) fn new(blocks: usize) -> Self {
        let n = capacity_for(blocks);
        HashSlots {
            slots: vec![EMPTY; n],
            mask: n - 1,
            len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        tag as usize & self.mask
    }

    /// The block registered under `h`. `hash_of` gives the hash a block is
    /// registered under (its entry's); it decides between blocks whose tags match.
    #[inline]
    pub(super) fn get(
        &self,
        h: BlockHash,
        hash_of: impl Fn(BlockId) -> Option<BlockHash>,
    ) -> Option<BlockId> {
        let t = tag(h);
        let mut i = self.home(t);
        loop {
            let s = *self.slots.get(i)?;
            if s == EMPTY {
                return None;
            }
            if slot_tag(s) == t && hash_of(slot_block(s)) == Some(h) {
                return Some(slot_block(s));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Records `h -> b` unless `h` is already registered (then returns the block that
    /// holds it and changes nothing). `hash_of` as in [`Self::get`]. The table grows
    /// when it would be more than half full.
    pub(super) fn insert(
        &mut self,
        h: BlockHash,
        b: BlockId,
        hash_of: impl Fn(BlockId) -> Option<BlockHash>,
    ) -> Result<(), BlockId> {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow(self.slots.len() * 2);
        }
        let t = tag(h);
        let mut i = self.home(t);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                self.slots[i] = pack(t, b);
                self.len += 1;
                return Ok(());
            }
            if slot_tag(s) == t && hash_of(slot_block(s)) == Some(h) {
                return Err(slot_block(s));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Where `h` registered to `b` is, if it is.
    fn find_exact(&self, h: BlockHash, b: BlockId) -> Option<usize> {
        let want = pack(tag(h), b);
        let mut i = self.home(tag(h));
        loop {
            let s = *self.slots.get(i)?;
            if s == EMPTY {
                return None;
            }
            if s == want {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Forgets `h -> b`; returns whether it was recorded.
    pub(super) fn remove(&mut self, h: BlockHash, b: BlockId) -> bool {
        let Some(mut hole) = self.find_exact(h, b) else {
            return false;
        };
        // Backward shift: move each later slot of the run into the hole unless its
        // probe starts after the hole (cyclically), so every key stays reachable.
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slots[j];
            if s == EMPTY {
                break;
            }
            let home = self.home(slot_tag(s));
            // `s` may move to `hole` when `home` is not in the cyclic range (hole, j].
            let dist_home = j.wrapping_sub(home) & self.mask;
            let dist_hole = j.wrapping_sub(hole) & self.mask;
            if dist_home >= dist_hole {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Points `h`, registered to `from`, at `to` instead; returns whether it was
    /// registered to `from`.
    pub(super) fn repoint(&mut self, h: BlockHash, from: BlockId, to: BlockId) -> bool {
        match self.find_exact(h, from) {
            Some(i) => {
                self.slots[i] = pack(tag(h), to);
                true
            }
            None => false,
        }
    }

    /// Makes room for `blocks` blocks (at most half the slots used); never shrinks.
    pub(super) fn reserve(&mut self, blocks: usize) {
        let n = capacity_for(blocks);
        if n > self.slots.len() {
            self.grow(n);
        }
    }

    /// Re-places every slot into a table of `n` slots: the tag alone gives a slot's
    /// probe start, so no hash is read.
    fn grow(&mut self, n: usize) {
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; n]);
        self.mask = n - 1;
        for s in old.into_iter().filter(|&s| s != EMPTY) {
            let mut i = self.home(slot_tag(s));
            while self.slots[i] != EMPTY {
                i = (i + 1) & self.mask;
            }
            self.slots[i] = s;
        }
    }

    /// Hints the CPU to fetch the line a probe for `h` starts on.
    #[inline]
    pub(super) fn prefetch(&self, h: BlockHash) {
        if let Some(s) = self.slots.get(self.home(tag(h))) {
            prefetch(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Against a `HashMap` model, with hashes that share tags (so confirmation and
    /// backward shifts both run) and churn far past the table's size.
    #[test]
    fn matches_a_map_under_churn() {
        let blocks = 64usize;
        let mut t = HashSlots::new(blocks);
        let mut model: HashMap<BlockHash, BlockId> = HashMap::new();
        let mut owner: Vec<Option<BlockHash>> = vec![None; blocks];
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct low bits: many equal tags.
            let h = BlockHash((x % 97) | ((x >> 40) << 40));
            let b = BlockId((x >> 20) as u32 % blocks as u32);
            let hash_of = |b: BlockId| owner[b.index()];
            match owner[b.index()] {
                Some(old) if step % 3 == 0 => {
                    assert!(t.remove(old, b));
                    model.remove(&old);
                    owner[b.index()] = None;
                }
                Some(old) => {
                    assert_eq!(t.get(old, hash_of), Some(b));
                    assert!(!t.remove(old, BlockId((b.0 + 1) % blocks as u32)) || blocks == 1);
                }
                None => {
                    let want = model.get(&h).copied();
                    assert_eq!(t.insert(h, b, hash_of), want.map_or(Ok(()), Err));
                    if want.is_none() {
                        model.insert(h, b);
                        owner[b.index()] = Some(h);
                    }
                }
            }
            assert_eq!(t.len(), model.len());
        }
        let hash_of = |b: BlockId| owner[b.index()];
        for (&h, &b) in &model {
            assert_eq!(t.get(h, hash_of), Some(b));
        }
        t.reserve(4 * blocks);
        for (&h, &b) in &model {
            assert_eq!(t.get(h, hash_of), Some(b), "after growing");
        }
    }

    /// Two hashes with one tag: the entry's hash tells them apart.
    #[test]
    fn equal_tags_are_told_apart_by_the_entry() {
        let mut seen = HashMap::new();
        let (h1, h2) = (0u64..)
            .find_map(|i| {
                let h = BlockHash(i.wrapping_mul(0x2545_F491_4F6C_DD1D));
                seen.insert(tag(h), h).map(|other| (other, h))
            })
            .unwrap();
        assert_ne!(h1, h2);
        let mut t = HashSlots::new(8);
        let mut owner = [None; 8];
        for (h, b) in [(h1, 2u32), (h2, 5)] {
            assert_eq!(
                t.insert(h, BlockId(b), |x: BlockId| owner[x.index()]),
                Ok(())
            );
            owner[b as usize] = Some(h);
        }
        assert_eq!(t.get(h1, |x: BlockId| owner[x.index()]), Some(BlockId(2)));
        assert_eq!(t.get(h2, |x: BlockId| owner[x.index()]), Some(BlockId(5)));
        assert_eq!(
            t.insert(h2, BlockId(6), |x: BlockId| owner[x.index()]),
            Err(BlockId(5))
        );
        assert!(t.remove(h1, BlockId(2)));
        owner[2] = None;
        assert_eq!(t.get(h1, |x: BlockId| owner[x.index()]), None);
        assert_eq!(t.get(h2, |x: BlockId| owner[x.index()]), Some(BlockId(5)));
    }

    #[test]
    fn repoint_moves_one_hash() {
        let mut t = HashSlots::new(4);
        let mut owner = [None; 4];
        owner[1] = Some(BlockHash(7));
        t.insert(BlockHash(7), BlockId(1), |b: BlockId| owner[b.index()])
            .unwrap();
        assert!(!t.repoint(BlockHash(7), BlockId(2), BlockId(3)));
        assert!(t.repoint(BlockHash(7), BlockId(1), BlockId(3)));
        owner[3] = owner[1].take();
        assert_eq!(
            t.get(BlockHash(7), |b: BlockId| owner[b.index()]),
            Some(BlockId(3))
        );
        assert_eq!(t.len(), 1);
    }
}
