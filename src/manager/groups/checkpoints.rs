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
//! one an admission is copying from). Each admission and each new checkpoint also
//! drops the checkpoints whose prefix group 0's cache evicted (they can serve no
//! hit), so that the attention groups' cache and the checkpoints share the arena
//! instead of the checkpoints taking all of it.
//!
//! Where checkpoints are taken is the [`CheckpointPolicy`]'s choice (off by default:
//! only where the engine calls `checkpoint_grouped`). The useful positions in a chat
//! trace are three, all block boundaries of group 0:
//!
//! * the end of a **shared prefix**: an admission whose prompt the attention groups
//!   hold further than any checkpoint (a system prompt another conversation computed)
//!   recomputes the state from the checkpoint it found, and checkpoints where the
//!   attention groups' hit ends, so that the next conversation resumes there;
//! * the end of the prompt's **last full block**, which the next turn of the same
//!   conversation extends;
//! * the **turn end**: the last block boundary the sequence's decode reached. The
//!   state there is gone once the next token is computed, so the policy keeps one
//!   *rolling* checkpoint per sequence (its prompt end's, when taken): each
//!   `checkpoint_grouped` call on a block boundary overwrites it in place (the same
//!   pages: one state copy per block decoded, no allocation), and the one left when
//!   the sequence is freed is its turn end. A turn so costs one checkpoint's pages,
//!   not two: a state is large (74 MiB a sequence for Qwen3-Next-80B-A3B, the K/V of
//!   3,000 tokens).
//!
//! The first two are taken inside the admission's step: the engine computes the
//! prompt up to each [`StateCheckpoint::position`], runs its copies, then computes
//! on. A checkpoint is keyed by a registered block's hash, so a position past blocks
//! the admission recomputed as duplicates of cached ones (an attention hit longer
//! than the state's) is skipped: those blocks are registered as the sequence's next
//! calls settle them, and the turn end's checkpoint is taken then. Each chain (the checkpoints on one sequence's prefix) keeps at most
//! [`CheckpointPolicy::max_per_chain`]: a new checkpoint evicts its chain's least
//! recently used first, the shallower of two used at once.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};
use crate::layout::plans::CopyPlan;
use crate::pool::prefix::{AdmitOptions, BlockHash};

use super::{is_hidden, GroupStep, Groups};
use crate::manager::{KvCache, PrefixHit, Sequence};

/// Where a hybrid cache with a recurrent-state group checkpoints the state on its
/// own, for prefix hits (see [`KvCache::set_checkpoint_policy`]). The default takes
/// none (only the engine's [`KvCache::checkpoint_grouped`] calls) and bounds
/// nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointPolicy {
    /// At admission ([`KvCache::admit_tokens_grouped`]): checkpoint where the attention
    /// groups' cached prefix ends, when no checkpoint reaches it (the end of a shared
    /// system prompt). The admission positions cost one more prefix lookup of group 0
    /// per admission (the prompt's block hashes once more).
    pub shared_prefix_end: bool,
    /// At admission: checkpoint at the end of the prompt's last full block of group 0.
    pub prompt_end: bool,
    /// At admission: checkpoint at every multiple of `every_tokens` tokens past the hit
    /// (0: none; else a multiple of group 0's block size), as vLLM's
    /// `mamba_cache_mode="align"` does at every block of a block size raised to the
    /// state's page (528 to 8,320 tokens). For comparisons (`benches/checkpoints.rs`):
    /// at small multiples it costs one state copy per multiple.
    pub every_tokens: usize,
    /// [`KvCache::checkpoint_grouped`] keeps one rolling checkpoint per sequence (with
    /// `prompt_end`, the prompt end's), overwritten in place at each block boundary
    /// its decode reaches: the one left at the sequence's free is the turn end's.
    pub turn_end: bool,
    /// Most checkpoints kept on one chain (the checkpoints on one sequence's prefix);
    /// at least 1. A new checkpoint evicts the chain's least recently used first.
    pub max_per_chain: usize,
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        CheckpointPolicy {
            shared_prefix_end: false,
            prompt_end: false,
            every_tokens: 0,
            turn_end: false,
            max_per_chain: usize::MAX,
        }
    }
}

impl CheckpointPolicy {
    /// The policy of a multi-turn chat: checkpoints at shared prefix ends, prompt ends
    /// and turn ends, at most `max_per_chain` on one chain.
    pub fn chat(max_per_chain: usize) -> Self {
        CheckpointPolicy {
            shared_prefix_end: true,
            prompt_end: true,
            every_tokens: 0,
            turn_end: true,
            max_per_chain,
        }
    }
}

/// A checkpoint taken inside a step ([`GroupStep::checkpoints`]): after computing the
/// tokens up to `position`, and before computing the next one, run `copies[g]` (the
/// sequence's state pages to the checkpoint's, in each state group; empty for a KV
/// group). The checkpoint serves hits from the call's return on, as the prompt's
/// blocks do: an admission later in the same step that resumes from it copies pages
/// this step has not written yet, so an engine runs such an admission's step after
/// this one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateCheckpoint {
    /// The position, in tokens, whose state the copies save.
    pub position: usize,
    /// The copies, per group.
    pub copies: Vec<CopyPlan>,
}

/// The positions an admission will checkpoint, each with its prefix hash when the
/// lookup before the admission found it (a position the attention groups held).
pub(in crate::manager) type AdmissionTargets = smallvec::SmallVec<[(usize, Option<BlockHash>); 2]>;

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
    policy: CheckpointPolicy,
    /// By live sequence: the hash of its rolling (turn end) checkpoint.
    rolling: HashMap<SeqId, BlockHash>,
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

    /// The checkpoint policy.
    pub(in crate::manager) fn checkpoint_policy(&self) -> CheckpointPolicy {
        self.checkpoints.policy
    }

    /// Sets the checkpoint policy (see [`KvCache::set_checkpoint_policy`]).
    pub(in crate::manager) fn set_checkpoint_policy(
        &mut self,
        policy: CheckpointPolicy,
    ) -> Result<()> {
        if !self.has_state_group() {
            return Err(Error::config(
                "checkpoint policy",
                "the cache has no recurrent-state group",
            ));
        }
        let bs = self.groups[0].block_size();
        if !policy.every_tokens.is_multiple_of(bs) {
            return Err(Error::config(
                "checkpoint policy every_tokens",
                format!(
                    "{} is not a multiple of the block size {bs}",
                    policy.every_tokens
                ),
            ));
        }
        if policy.max_per_chain == 0 {
            return Err(Error::config(
                "checkpoint policy max_per_chain",
                "0: a chain keeps at least one checkpoint",
            ));
        }
        if !policy.turn_end {
            self.checkpoints.rolling.clear();
        }
        self.checkpoints.policy = policy;
        Ok(())
    }

    /// Forgets `seq`'s rolling checkpoint (the checkpoint stays: it is the turn end's).
    pub(in crate::manager) fn forget_rolling(&mut self, seq: SeqId) {
        self.checkpoints.rolling.remove(&seq);
    }

    /// The positions an admission of `tokens` will checkpoint under the policy, looked
    /// up before the admission (which may change which blocks are registered): the
    /// end of group 0's cached prefix (with its hash) and the end of the prompt's last
    /// full block. Empty when the policy takes none or checkpoints do not apply.
    pub(in crate::manager) fn admission_targets(
        &self,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
    ) -> Result<AdmissionTargets> {
        let policy = self.checkpoints.policy;
        let mut targets = AdmissionTargets::new();
        if !(policy.shared_prefix_end || policy.prompt_end || policy.every_tokens > 0)
            || !self.checkpoints_apply()
        {
            return Ok(targets);
        }
        let kv0 = &self.groups[0];
        let bs = kv0.block_size();
        let mut hit = PrefixHit::default();
        kv0.lookup_prefix(tokens, opts, &mut hit)?;
        let held = hit.blocks();
        let hash_at = |pos: usize| match pos / bs {
            0 => None,
            k => held.get(k - 1).and_then(|&b| kv0.prefix.hash_of(b)),
        };
        let shared = held.len() * bs;
        if policy.shared_prefix_end && shared > 0 {
            targets.push((shared, hash_at(shared)));
        }
        let last = tokens.len() / bs * bs;
        if policy.every_tokens > 0 {
            let every = policy.every_tokens;
            for pos in (every..=last).step_by(every).filter(|&p| p != shared) {
                targets.push((pos, hash_at(pos)));
            }
            targets.sort_unstable_by_key(|t| t.0);
        } else if policy.prompt_end && last > 0 && last != shared {
            targets.push((last, hash_at(last)));
        }
        Ok(targets)
    }

    /// Takes the admission checkpoints `targets` of `seq` past its `cached` tokens into
    /// `step.checkpoints`. A checkpoint the arena has no pages for is skipped (the
    /// admission stands); other errors are internal.
    pub(in crate::manager) fn checkpoint_admission(
        &mut self,
        seq: SeqId,
        cached: usize,
        targets: &AdmissionTargets,
        step: &mut GroupStep,
    ) -> Result<()> {
        // The admission may have evicted cached blocks that checkpoints stand on.
        self.drop_orphan_checkpoints()?;
        let bs = self.groups[0].block_size();
        let last = self.groups[0].num_tokens(seq)? / bs * bs;
        for &(position, hash) in targets.iter().filter(|t| t.0 > cached) {
            let hash = match hash {
                Some(h) => Some(h),
                None => self.prefix_hash(seq, position)?,
            };
            let Some(hash) = hash else { continue };
            let mut copies = vec![CopyPlan::new(); self.groups.len()];
            match self.checkpoint_keyed(seq, position, hash, &mut copies) {
                Ok(true) => {
                    // With turn ends, the prompt end's checkpoint is the sequence's
                    // rolling one: its decode moves it to the turn end.
                    if self.checkpoints.policy.turn_end && position == last {
                        self.checkpoints.rolling.insert(seq, hash);
                    }
                    step.checkpoints.push(StateCheckpoint { position, copies });
                }
                Ok(false) | Err(Error::OutOfBlocks { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Removes the checkpoints whose prefix group 0's cache no longer holds: they can
    /// serve no hit, and a state is the K/V of thousands of tokens. Without this, the
    /// attention groups' cache would give up every page before a checkpoint did (a
    /// checkpoint is the last page an allocation takes), leaving checkpoints no hit
    /// can reach. O(checkpoints).
    pub(in crate::manager) fn drop_orphan_checkpoints(&mut self) -> Result<()> {
        let mut s = 0;
        while s < self.checkpoints.slots.len() {
            let orphan = self.groups[0]
                .prefix
                .block_of(self.checkpoints.slots[s].hash)
                .is_none();
            if orphan && Some(s) != self.checkpoints.pinned {
                // The last slot moves into `s`: look at `s` again.
                self.remove_checkpoint(s)?;
            } else {
                s += 1;
            }
        }
        Ok(())
    }

    /// The hash of group 0's block of `seq` that ends at `position`, when registered.
    fn prefix_hash(&self, seq: SeqId, position: usize) -> Result<Option<BlockHash>> {
        let kv0 = &self.groups[0];
        let bs = kv0.block_size();
        if position == 0 || !position.is_multiple_of(bs) {
            return Ok(None);
        }
        let s = kv0.seq(seq)?;
        Ok(s.table
            .get(position / bs - 1)
            .and_then(|&b| kv0.prefix.hash_of(b)))
    }

    /// Whether a checkpoint keyed `hash` exists; marks it used when it does.
    fn touch_checkpoint(&mut self, hash: BlockHash) -> bool {
        match self.checkpoints.by_hash.get(&hash) {
            Some(&slot) => {
                // At another position it is a collision: the older one stays.
                self.checkpoints.clock += 1;
                self.checkpoints.slots[slot].last_used = self.checkpoints.clock;
                true
            }
            None => false,
        }
    }

    /// Checkpoints `seq`'s state at its computed position `p` (see
    /// [`KvCache::checkpoint_grouped`]); with the policy's `turn_end`, as the
    /// sequence's rolling checkpoint.
    pub(in crate::manager) fn checkpoint(
        &mut self,
        seq: SeqId,
        step: &mut GroupStep,
    ) -> Result<bool> {
        step.reset(self.groups.len());
        if is_hidden(seq) {
            return Err(Error::UnknownSequence(seq));
        }
        let p = self.groups[0].idle(seq)?.computed;
        if !self.checkpoints_apply() {
            return Ok(false);
        }
        let Some(hash) = self.prefix_hash(seq, p)? else {
            return Ok(false);
        };
        if self.touch_checkpoint(hash) {
            return Ok(false);
        }
        if self.checkpoints.policy.turn_end {
            if let Some(slot) = self
                .checkpoints
                .rolling
                .get(&seq)
                .and_then(|old| self.checkpoints.by_hash.get(old))
                .copied()
            {
                return self.overwrite_checkpoint(seq, slot, p, hash, &mut step.copies);
            }
        }
        let made = self.checkpoint_keyed(seq, p, hash, &mut step.copies)?;
        if made && self.checkpoints.policy.turn_end {
            self.checkpoints.rolling.insert(seq, hash);
        }
        Ok(made)
    }

    /// Moves `seq`'s rolling checkpoint `slot` to position `p` (key `hash`): the copies
    /// write `seq`'s state over the slot's pages.
    fn overwrite_checkpoint(
        &mut self,
        seq: SeqId,
        slot: usize,
        p: usize,
        hash: BlockHash,
        copies: &mut [CopyPlan],
    ) -> Result<bool> {
        for (g, plan) in copies.iter_mut().enumerate() {
            if self.state_pages(g).is_none() {
                continue;
            }
            let dst = self.checkpoint_pages(g, slot)?;
            let src = &self.groups[g].seq(seq)?.table;
            for (&s, &d) in src.iter().zip(dst) {
                plan.push(s, d);
            }
        }
        self.checkpoints.clock += 1;
        let old = std::mem::replace(
            &mut self.checkpoints.slots[slot],
            Slot {
                hash,
                position: p,
                last_used: self.checkpoints.clock,
            },
        );
        self.checkpoints.by_hash.remove(&old.hash);
        self.checkpoints.by_hash.insert(hash, slot);
        self.checkpoints.rolling.insert(seq, hash);
        Ok(true)
    }

    /// Checkpoints `seq`'s state at position `p` under `hash` (the caller checked
    /// that `p` is a block boundary of group 0 and `hash` its prefix's key): new pages
    /// in every state group, `copies[g]` from the sequence's state pages. False when
    /// a checkpoint with that key exists. Then bounds the chain.
    fn checkpoint_keyed(
        &mut self,
        seq: SeqId,
        p: usize,
        hash: BlockHash,
        copies: &mut [CopyPlan],
    ) -> Result<bool> {
        if self.touch_checkpoint(hash) {
            return Ok(false);
        }
        for (need, state) in self.needs.iter_mut().zip(&self.state_pages) {
            *need = state.unwrap_or(0);
        }
        // Checked before the orphans go, so that a refusal changes nothing (the check
        // counts every evictable checkpoint, orphans included).
        self.check_needs()?;
        self.drop_orphan_checkpoints()?;
        self.give_pages()?;
        let slot = self.checkpoints.slots.len();
        for (g, plan) in copies.iter_mut().enumerate() {
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
                plan.push(src, b);
            }
        }
        self.checkpoints.clock += 1;
        self.checkpoints.slots.push(Slot {
            hash,
            position: p,
            last_used: self.checkpoints.clock,
        });
        self.checkpoints.by_hash.insert(hash, slot);
        self.bound_chain(seq, p)?;
        self.note_usage();
        Ok(true)
    }

    /// Evicts checkpoints on `seq`'s prefix before position `p` (its chain, the one at
    /// `p` excluded) until the chain holds at most `max_per_chain`: least recently
    /// used first, the shallower of two used at once.
    fn bound_chain(&mut self, seq: SeqId, p: usize) -> Result<()> {
        let max = self.checkpoints.policy.max_per_chain;
        if max == usize::MAX {
            return Ok(());
        }
        let kv0 = &self.groups[0];
        let bs = kv0.block_size();
        let table = &kv0.seq(seq)?.table;
        let mut chain: Vec<(u64, usize, BlockHash)> = table[..p / bs - 1]
            .iter()
            .enumerate()
            .filter_map(|(i, &b)| {
                let hash = kv0.prefix.hash_of(b)?;
                let slot = &self.checkpoints.slots[*self.checkpoints.by_hash.get(&hash)?];
                (slot.position == (i + 1) * bs).then_some((slot.last_used, slot.position, hash))
            })
            .collect();
        chain.sort_unstable();
        let excess = (chain.len() + 1).saturating_sub(max);
        for &(_, _, hash) in &chain[..excess] {
            if let Some(&slot) = self.checkpoints.by_hash.get(&hash) {
                self.remove_checkpoint(slot)?;
            }
        }
        Ok(())
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
        if let Some(seq) = self
            .checkpoints
            .rolling
            .keys()
            .find(|&&s| !self.groups[0].contains(s))
        {
            return Err(format!("rolling checkpoint of {seq}, which is gone"));
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
