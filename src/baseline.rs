//! The baseline every comparison runs beside: a contiguous-reservation cache, and the
//! [`CacheAllocator`] trait both it and the paged [`KvCache`] implement.
//!
//! [`ContiguousCache`] gives each sequence one run of `max_len` tokens, reserved up front
//! in the same arena and with the same layout, so slots, storage and attention work
//! unchanged. That is what engines without paging do, and it is why they waste memory:
//! every reservation is sized for the longest possible sequence.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};
use crate::layout::plans::CopyPlan;
use crate::layout::{KvLayout, Slot};
use crate::manager::{CacheStats, KvCache, SeqMap};

/// The calls the serve simulation and the benches make, so paged and contiguous
/// allocation run the same code side by side.
pub trait CacheAllocator {
    /// Short name for reports (`paged`, `contiguous`).
    fn name(&self) -> &'static str;
    /// The arena layout.
    fn layout(&self) -> &KvLayout;
    /// Whether a new sequence of `num_tokens` tokens can be admitted now.
    fn can_admit(&self, num_tokens: usize) -> bool;
    /// Admits a sequence; writes the slots of its tokens.
    ///
    /// # Errors
    /// As [`KvCache::admit`].
    fn admit(&mut self, seq: SeqId, num_tokens: usize, slots: &mut Vec<Slot>) -> Result<()>;
    /// Appends tokens; writes their slots; adds any needed copies to `copies`.
    ///
    /// # Errors
    /// As [`KvCache::append`].
    fn append(
        &mut self,
        seq: SeqId,
        n: usize,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()>;
    /// Forks `parent` into `child`; adds any needed copies to `copies`.
    ///
    /// # Errors
    /// As [`KvCache::fork`], plus [`Error::OutOfBlocks`] where forking copies.
    fn fork(&mut self, parent: SeqId, child: SeqId, copies: &mut CopyPlan) -> Result<()>;
    /// Frees a sequence.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    fn free(&mut self, seq: SeqId) -> Result<()>;
    /// The sequence's blocks.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    fn block_table(&self, seq: SeqId) -> Result<&[BlockId]>;
    /// The sequence's tokens.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    fn num_tokens(&self, seq: SeqId) -> Result<usize>;
    /// Counters now.
    fn stats(&self) -> CacheStats;
}

impl CacheAllocator for KvCache {
    fn name(&self) -> &'static str {
        "paged"
    }
    fn layout(&self) -> &KvLayout {
        KvCache::layout(self)
    }
    fn can_admit(&self, num_tokens: usize) -> bool {
        KvCache::can_admit(self, num_tokens)
    }
    fn admit(&mut self, seq: SeqId, num_tokens: usize, slots: &mut Vec<Slot>) -> Result<()> {
        KvCache::admit(self, seq, num_tokens, slots)
    }
    fn append(
        &mut self,
        seq: SeqId,
        n: usize,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        KvCache::append(self, seq, n, slots, copies)
    }
    fn fork(&mut self, parent: SeqId, child: SeqId, _copies: &mut CopyPlan) -> Result<()> {
        KvCache::fork(self, parent, child)
    }
    fn free(&mut self, seq: SeqId) -> Result<()> {
        KvCache::free(self, seq)
    }
    fn block_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        KvCache::block_table(self, seq)
    }
    fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        KvCache::num_tokens(self, seq)
    }
    fn stats(&self) -> CacheStats {
        KvCache::stats(self)
    }
}

#[derive(Debug, Clone)]
struct Reservation {
    table: Vec<BlockId>,
    num_tokens: usize,
}

/// Contiguous `max_len` reservations, first fit over a coalescing free-extent map.
#[derive(Debug, Clone)]
pub struct ContiguousCache {
    layout: KvLayout,
    num_blocks: usize,
    max_len: usize,
    reservation_blocks: usize,
    /// Free extents: start block -> length in blocks, coalesced.
    free: BTreeMap<u32, u32>,
    free_blocks: usize,
    seqs: SeqMap<Reservation>,
    live_tokens: usize,
    peak_used_blocks: usize,
}

impl ContiguousCache {
    /// An arena of `num_blocks` blocks where each sequence reserves `max_len` tokens.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `max_len` is 0 or one reservation exceeds the arena.
    pub fn new(layout: KvLayout, num_blocks: usize, max_len: usize) -> Result<Self> {
        let reservation_blocks = layout.blocks_for_tokens(max_len);
        if max_len == 0 || reservation_blocks > num_blocks || num_blocks >= u32::MAX as usize {
            return Err(Error::config(
                "max_len",
                format!("{max_len} tokens ({reservation_blocks} blocks) in an arena of {num_blocks} blocks"),
            ));
        }
        let mut free = BTreeMap::new();
        free.insert(0, num_blocks as u32);
        Ok(ContiguousCache {
            layout,
            num_blocks,
            max_len,
            reservation_blocks,
            free,
            free_blocks: num_blocks,
            seqs: SeqMap::default(),
            live_tokens: 0,
            peak_used_blocks: 0,
        })
    }

    /// Tokens reserved per sequence.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    fn find_extent(&self) -> Option<u32> {
        let need = self.reservation_blocks as u32;
        self.free
            .iter()
            .find(|(_, &len)| len >= need)
            .map(|(&s, _)| s)
    }

    fn reserve(&mut self) -> Result<Vec<BlockId>> {
        let start = self.find_extent().ok_or(Error::OutOfBlocks {
            needed: self.reservation_blocks,
            free: self.largest_free_extent(),
        })?;
        let len = self.free.remove(&start).unwrap_or(0);
        let need = self.reservation_blocks as u32;
        if len > need {
            self.free.insert(start + need, len - need);
        }
        self.free_blocks -= self.reservation_blocks;
        let used = self.num_blocks - self.free_blocks;
        self.peak_used_blocks = self.peak_used_blocks.max(used);
        Ok((start..start + need).map(BlockId).collect())
    }

    fn release(&mut self, table: &[BlockId]) {
        let (mut start, mut len) = (table[0].0, table.len() as u32);
        if let Some((&s, &l)) = self.free.range(..start).next_back() {
            if s + l == start {
                self.free.remove(&s);
                start = s;
                len += l;
            }
        }
        if let Some(&l) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += l;
        }
        self.free.insert(start, len);
        self.free_blocks += table.len();
    }

    /// Longest free run, in blocks (what the next reservation can get).
    pub fn largest_free_extent(&self) -> usize {
        self.free.values().map(|&l| l as usize).max().unwrap_or(0)
    }

    fn write_slots(
        layout: &KvLayout,
        r: &Reservation,
        range: std::ops::Range<usize>,
        slots: &mut Vec<Slot>,
    ) {
        let bs = layout.block_size();
        slots.extend(range.map(|p| layout.slot(r.table[p / bs], p % bs)));
    }
}

impl CacheAllocator for ContiguousCache {
    fn name(&self) -> &'static str {
        "contiguous"
    }
    fn layout(&self) -> &KvLayout {
        &self.layout
    }
    fn can_admit(&self, num_tokens: usize) -> bool {
        num_tokens <= self.max_len && self.find_extent().is_some()
    }
    fn admit(&mut self, seq: SeqId, num_tokens: usize, slots: &mut Vec<Slot>) -> Result<()> {
        slots.clear();
        if self.seqs.contains_key(&seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        if num_tokens > self.max_len {
            return Err(Error::TooLong {
                tokens: num_tokens,
                limit: self.max_len,
            });
        }
        let r = Reservation {
            table: self.reserve()?,
            num_tokens,
        };
        Self::write_slots(&self.layout, &r, 0..num_tokens, slots);
        self.live_tokens += num_tokens;
        self.seqs.insert(seq, r);
        Ok(())
    }
    fn append(
        &mut self,
        seq: SeqId,
        n: usize,
        slots: &mut Vec<Slot>,
        _copies: &mut CopyPlan,
    ) -> Result<()> {
        slots.clear();
        let max_len = self.max_len;
        let r = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        let new_len = r.num_tokens.saturating_add(n);
        if new_len > max_len {
            return Err(Error::TooLong {
                tokens: new_len,
                limit: max_len,
            });
        }
        Self::write_slots(&self.layout, r, r.num_tokens..new_len, slots);
        r.num_tokens = new_len;
        self.live_tokens += n;
        Ok(())
    }
    fn fork(&mut self, parent: SeqId, child: SeqId, copies: &mut CopyPlan) -> Result<()> {
        let p = self
            .seqs
            .get(&parent)
            .ok_or(Error::UnknownSequence(parent))?;
        if self.seqs.contains_key(&child) {
            return Err(Error::DuplicateSequence(child));
        }
        let num_tokens = p.num_tokens;
        let used = self.layout.blocks_for_tokens(num_tokens);
        let src: Vec<BlockId> = p.table[..used].to_vec();
        let table = self.reserve()?;
        for (s, d) in src.iter().zip(&table) {
            copies.push(*s, *d);
        }
        self.live_tokens += num_tokens;
        self.seqs.insert(child, Reservation { table, num_tokens });
        Ok(())
    }
    fn free(&mut self, seq: SeqId) -> Result<()> {
        let r = self.seqs.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        self.live_tokens -= r.num_tokens;
        self.release(&r.table);
        Ok(())
    }
    fn block_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        Ok(&self
            .seqs
            .get(&seq)
            .ok_or(Error::UnknownSequence(seq))?
            .table)
    }
    fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        Ok(self
            .seqs
            .get(&seq)
            .ok_or(Error::UnknownSequence(seq))?
            .num_tokens)
    }
    fn stats(&self) -> CacheStats {
        let used = self.num_blocks - self.free_blocks;
        CacheStats {
            num_blocks: self.num_blocks,
            used_blocks: used,
            free_blocks: self.free_blocks,
            cached_blocks: 0,
            peak_used_blocks: self.peak_used_blocks.max(used),
            num_sequences: self.seqs.len(),
            live_token_slots: self.live_tokens,
            internal_waste_slots: used * self.layout.block_size() - self.live_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::shape::{DType, ModelShape};

    fn layout() -> KvLayout {
        let s = ModelShape {
            num_layers: 1,
            num_q_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            kv_dtype: DType::F32,
        };
        KvLayout::new(s, 4).unwrap()
    }

    #[test]
    fn reservations_coalesce_on_free() {
        let mut c = ContiguousCache::new(layout(), 8, 8).unwrap();
        let mut slots = Vec::new();
        for i in 0..4 {
            c.admit(SeqId(i), 1, &mut slots).unwrap();
        }
        assert!(!c.can_admit(1));
        c.free(SeqId(1)).unwrap();
        c.free(SeqId(2)).unwrap();
        assert_eq!(c.largest_free_extent(), 4);
        c.free(SeqId(0)).unwrap();
        c.free(SeqId(3)).unwrap();
        assert_eq!(c.largest_free_extent(), 8);
        assert_eq!(c.stats().used_blocks, 0);
    }

    #[test]
    fn appends_past_the_reservation_fail() {
        let mut c = ContiguousCache::new(layout(), 8, 8).unwrap();
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        c.admit(SeqId(0), 7, &mut slots).unwrap();
        c.append(SeqId(0), 1, &mut slots, &mut copies).unwrap();
        assert_eq!(slots, vec![Slot(7)]);
        assert_eq!(
            c.append(SeqId(0), 1, &mut slots, &mut copies),
            Err(Error::TooLong {
                tokens: 9,
                limit: 8
            })
        );
        c.fork(SeqId(0), SeqId(1), &mut copies).unwrap();
        assert_eq!(copies.len(), 2);
    }
}
