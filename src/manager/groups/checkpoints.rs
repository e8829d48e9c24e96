//! Prefix caching for recurrent-state groups by **checkpoints**: the state after
//! position `p` of a prompt, copied into pages the cache owns, keyed by the chain hash
//! of group 0's block that ends at `p` (the hash of the whole prefix up to `p`, salt
//! and extra keys included, the key under which the attention groups cache it).
//!
//! A hit resumes from the deepest position at which every group agrees: the
//! attention groups' cached chain reaches it, and a checkpoint exists at exactly that
//! position. The admission copies the checkpoint into the new sequence's state pages
//! (one copy per page in the state group's `CopyPlan`).
//!
//! The pages of every checkpoint of state group `g` are held, in that group's
//! manager, by one hidden sequence ([`CHECKPOINTS`]) whose table is the checkpoints'
//! pages slot after slot (`pages_per_seq` each; removing a slot moves the last one
//! into it), so compaction moves them like any page and the group's invariants count
//! them. Checkpoint pages count as free for every allocation (as cached blocks do):
//! when the arena runs short, a checkpoint whose prefix group 0's cache no longer
//! holds goes first (it can serve no hit), then the least recently used (never the
//! one an admission is copying from).

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};
use crate::pool::prefix::BlockHash;

use super::{is_hidden, GroupStep, Groups};
use crate::manager::{KvCache, Sequence};

/// The hidden sequence of each state group that holds its checkpoints' pages.
pub(in crate::manager) const CHECKPOINTS: SeqId = SeqId(u64::MAX - 2);

/// One checkpoint: the prefix's hash, its position in tokens, its last use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    hash: BlockHash,
    position: usize,
    last_used: u64,
}

/// The checkpoints of a hybrid cache's state groups.
#[derive(Debug, Clone, Default)]
pub(in crate::manager) struct Checkpoints {
    /// By prefix hash: the checkpoint's slot.
    by_hash: HashMap<BlockHash, usize>,
    slots: Vec<Slot>,
    clock: u64,
    /// The slot an admission copies from during the call: never evicted then, and
    /// not counted free.
    pinned: Option<usize>,
}

impl Checkpoints {
    /// Checkpoints held.
    pub(in crate::manager) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Checkpoints that may be evicted now.
    fn evictable(&self) -> usize {
        self.slots.len() - usize::from(self.pinned.is_some())
    }
}

impl KvCache {
    /// Adds the hidden holder of checkpoint pages (a state group's manager).
    pub(in crate::manager) fn insert_checkpoint_holder(&mut self) -> Result<()> {
        self.seqs.reserve_room(1)?;
        self.seqs
            .insert(CHECKPOINTS, Sequence::default())
            .map(|_| ())
    }
}

impl Groups {
    /// Pages one checkpoint takes, all state groups together.
    fn pages_per_checkpoint(&self) -> usize {
        self.state_pages.iter().flatten().sum()
    }

    /// Checkpoint pages an allocation may evict now.
    pub(in crate::manager) fn evictable_checkpoint_pages(&self) -> usize {
        self.checkpoints.evictable() * self.pages_per_checkpoint()
    }

    /// Pages group `g`'s checkpoints hold.
    pub(in crate::manager) fn checkpoint_pages_of(&self, g: usize) -> usize {
        self.state_pages(g).unwrap_or(0) * self.checkpoints.len()
    }

    /// Checkpoints held.
    pub fn num_checkpoints(&self) -> usize {
        self.checkpoints.len()
    }

    /// Whether checkpoints can serve hits in this cache: a state group, no window
    /// group (a window hit is served by a live sequence's blocks at its own depth),
    /// and every attention group of group 0's block size (a checkpoint sits at one of
    /// its block boundaries).
    fn checkpoints_apply(&self) -> bool {
        let bs = self.groups[0].block_size();
        self.has_state_group()
            && self
                .groups
                .iter()
                .zip(&self.state_pages)
                .all(|(kv, state)| {
                    kv.window.is_none() && (state.is_some() || kv.block_size() == bs)
                })
    }

    /// The deepest hit of at most `cached` tokens a checkpoint serves, given group
    /// 0's hit blocks: `(tokens, slot)`, `(0, None)` without one.
    pub(in crate::manager) fn checkpoint_hit(
        &self,
        hit_blocks: &[BlockId],
        cached: usize,
    ) -> (usize, Option<usize>) {
        if !self.checkpoints_apply() || self.checkpoints.slots.is_empty() {
            return (0, None);
        }
        let kv0 = &self.groups[0];
        let bs = kv0.block_size();
        for k in (1..=(cached / bs).min(hit_blocks.len())).rev() {
            let Some(hash) = kv0.prefix.hash_of(hit_blocks[k - 1]) else {
                continue;
            };
            if let Some(&slot) = self.checkpoints.by_hash.get(&hash) {
                if self.checkpoints.slots[slot].position == k * bs {
                    return (k * bs, Some(slot));
                }
            }
        }
        (0, None)
    }

    /// Pins `slot` for the admission under way (see [`Checkpoints::pinned`]);
    /// `None` unpins.
    pub(in crate::manager) fn pin_checkpoint(&mut self, slot: Option<usize>) {
        self.checkpoints.pinned = slot;
    }

    /// Marks the pinned checkpoint used (an admission copied it) and unpins it.
    pub(in crate::manager) fn use_pinned_checkpoint(&mut self) {
        if let Some(s) = self.checkpoints.pinned.take() {
            self.checkpoints.clock += 1;
            self.checkpoints.slots[s].last_used = self.checkpoints.clock;
        }
    }

    /// The pages of checkpoint `slot` in state group `g`.
    fn checkpoint_pages(&self, g: usize, slot: usize) -> Result<&[BlockId]> {
        let p = self.state_pages(g).unwrap_or(0);
        let holder = self.groups[g].seq(CHECKPOINTS)?;
        holder.table.get(slot * p..(slot + 1) * p).ok_or_else(|| {
            Error::CorruptBlockTable(format!("group {g}: no pages for checkpoint {slot}"))
        })
    }

    /// Puts into `step.copies[g]` of every state group the copy of the pinned
    /// checkpoint into `seq`'s state pages.
    pub(in crate::manager) fn copy_from_pinned(
        &self,
        seq: SeqId,
        step: &mut GroupStep,
    ) -> Result<()> {
        let Some(slot) = self.checkpoints.pinned else {
            return Ok(());
        };
        for g in 0..self.groups.len() {
            if self.state_pages(g).is_none() {
                continue;
            }
            let src = self.checkpoint_pages(g, slot)?;
            let dst = &self.groups[g].seq(seq)?.table;
            for (&s, &d) in src.iter().zip(dst) {
                step.copies[g].push(s, d);
            }
        }
        Ok(())
    }

    /// Evicts a checkpoint that is not pinned: first one whose prefix group 0's cache
    /// no longer holds (it can serve no hit), else the least recently used; false
    /// when none.
    pub(in crate::manager) fn evict_checkpoint(&mut self) -> Result<bool> {
        let pinned = self.checkpoints.pinned;
        let kv0 = &self.groups[0];
        let lru = (0..self.checkpoints.slots.len())
            .filter(|&s| Some(s) != pinned)
            .min_by_key(|&s| {
                let slot = &self.checkpoints.slots[s];
                (kv0.prefix.block_of(slot.hash).is_some(), slot.last_used)
            });
        match lru {
            Some(s) => self.remove_checkpoint(s).map(|()| true),
            None => Ok(false),
        }
    }

    /// Evicts every checkpoint not pinned; returns the pages freed.
    pub(in crate::manager) fn evict_checkpoints(&mut self, max_pages: usize) -> Result<usize> {
        let per = self.pages_per_checkpoint();
        let mut freed = 0;
        while freed + per <= max_pages && self.evict_checkpoint()? {
            freed += per;
        }
        Ok(freed)
    }

    /// Removes checkpoint `slot`: its pages are freed in every state group, and the
    /// last slot moves into it.
    fn remove_checkpoint(&mut self, slot: usize) -> Result<()> {
        let last = self.checkpoints.slots.len() - 1;
        for g in 0..self.groups.len() {
            let Some(p) = self.state_pages(g) else {
                continue;
            };
            let kv = &mut self.groups[g];
            let bs = kv.block_size();
            let holder = kv
                .seqs
                .get_mut(&CHECKPOINTS)
                .ok_or(Error::UnknownSequence(CHECKPOINTS))?;
            if holder.table.len() != (last + 1) * p {
                return Err(Error::CorruptBlockTable(format!(
                    "group {g}: {} checkpoint pages for {} checkpoints",
                    holder.table.len(),
                    last + 1
                )));
            }
            for j in 0..p {
                holder.table.swap(slot * p + j, last * p + j);
            }
            let gone: smallvec::SmallVec<[BlockId; 8]> = holder.table.drain(last * p..).collect();
            holder.num_tokens -= p * bs;
            holder.computed -= p * bs;
            kv.tables_changed();
            for b in gone {
                kv.release_block(b)?;
            }
        }
        let gone = self.checkpoints.slots.swap_remove(slot);
        self.checkpoints.by_hash.remove(&gone.hash);
        if slot < last {
            let moved = self.checkpoints.slots[slot].hash;
            self.checkpoints.by_hash.insert(moved, slot);
            if self.checkpoints.pinned == Some(last) {
                self.checkpoints.pinned = Some(slot);
            }
        }
        Ok(())
    }

    /// Checkpoints `seq`'s state at its computed position `p` (see
    /// [`KvCache::checkpoint_grouped`]).
    pub(in crate::manager) fn checkpoint(
        &mut self,
        seq: SeqId,
        step: &mut GroupStep,
    ) -> Result<bool> {
        step.reset(self.groups.len());
        if is_hidden(seq) {
            return Err(Error::UnknownSequence(seq));
        }
        let kv0 = &self.groups[0];
        let s = kv0.idle(seq)?;
        let bs = kv0.block_size();
        let p = s.computed;
        if !self.checkpoints_apply() || p == 0 || !p.is_multiple_of(bs) {
            return Ok(false);
        }
        let Some(hash) = s.table.get(p / bs - 1).and_then(|&b| kv0.prefix.hash_of(b)) else {
            return Ok(false);
        };
        if let Some(&slot) = self.checkpoints.by_hash.get(&hash) {
            if self.checkpoints.slots[slot].position == p {
                self.checkpoints.clock += 1;
                self.checkpoints.slots[slot].last_used = self.checkpoints.clock;
                return Ok(false);
            }
            // The same hash at another position: a collision; keep the older one.
            return Ok(false);
        }
        for (need, state) in self.needs.iter_mut().zip(&self.state_pages) {
            *need = state.unwrap_or(0);
        }
        self.give_pages()?;
        let slot = self.checkpoints.slots.len();
        for g in 0..self.groups.len() {
            let Some(pages) = self.state_pages(g) else {
                continue;
            };
            let kv = &mut self.groups[g];
            let bs = kv.block_size();
            for i in 0..pages {
                let b = kv.alloc_block()?;
                kv.set_fill(b, bs);
                let src = kv.seq(seq)?.table[i];
                let holder = kv
                    .seqs
                    .get_mut(&CHECKPOINTS)
                    .ok_or(Error::UnknownSequence(CHECKPOINTS))?;
                holder.table.push(b);
                holder.num_tokens += bs;
                holder.computed += bs;
                step.copies[g].push(src, b);
            }
        }
        self.checkpoints.clock += 1;
        self.checkpoints.slots.push(Slot {
            hash,
            position: p,
            last_used: self.checkpoints.clock,
        });
        self.checkpoints.by_hash.insert(hash, slot);
        self.note_usage();
        Ok(true)
    }

    /// The checkpoints' invariants: each state group's holder holds exactly the
    /// checkpoints' pages, each once, and the index matches the slots.
    pub(in crate::manager) fn check_checkpoints(&self) -> std::result::Result<(), String> {
        let n = self.checkpoints.slots.len();
        if self.checkpoints.by_hash.len() != n
            || self
                .checkpoints
                .slots
                .iter()
                .enumerate()
                .any(|(i, s)| self.checkpoints.by_hash.get(&s.hash) != Some(&i))
        {
            return Err(format!("checkpoint index disagrees with its {n} slots"));
        }
        if self.checkpoints.pinned.is_some() {
            return Err("a checkpoint is pinned between calls".into());
        }
        for g in 0..self.groups.len() {
            let Some(p) = self.state_pages(g) else {
                continue;
            };
            let kv = &self.groups[g];
            let holder = kv.seq(CHECKPOINTS).map_err(|e| format!("group {g}: {e}"))?;
            if holder.table.len() != n * p
                || holder.computed != n * p * kv.block_size()
                || holder.num_tokens != holder.computed
            {
                return Err(format!(
                    "group {g}: {} checkpoint pages ({} tokens) for {n} checkpoints of {p}",
                    holder.table.len(),
                    holder.computed
                ));
            }
            if let Some(&b) = holder
                .table
                .iter()
                .find(|&&b| kv.pool.refcount(b).unwrap_or(0) != 1)
            {
                return Err(format!("group {g}: checkpoint page {b} is shared or free"));
            }
        }
        Ok(())
    }
}
