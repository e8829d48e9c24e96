//! Sequences, block tables and the [`KvCacheManager`].
//!
//! The manager is pure bookkeeping: it never touches KV memory. Whenever data must
//! move (copy-on-write), it returns a plan that a [`crate::executor::storage::Storage`] executes.

mod builder;
mod defrag;
pub mod preempt;
mod prefix;
mod shared;
mod swap;

pub use builder::CacheBuilder;
pub use defrag::{DefragCounters, DefragOptions, FragStats, PendingDefrag, PendingResize};
pub use preempt::CostModel;
pub use prefix::PrefixHit;
pub use shared::SharedKvCacheManager;
pub use swap::{PendingTierMove, SwapJob, TierBlock, TierConfig, TierStats};

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};
use crate::layout::plans::CopyPlan;
use crate::layout::{KvLayout, Slot};
use crate::pool::prefix::index::PrefixIndex;
use crate::pool::prefix::PrefixConfig;
use crate::pool::{BlockPool, BlockState};

/// Tuning of a [`KvCacheManager`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// Blocks in the device arena.
    pub num_blocks: usize,
    /// Blocks [`KvCacheManager::can_admit`] keeps in reserve so that running sequences
    /// can still grow after an admission (vLLM's watermark).
    pub watermark_blocks: usize,
    /// Longest sequence, in tokens, the manager accepts (0: whatever the arena holds).
    pub max_seq_len_tokens: usize,
    /// Largest arena [`crate::executor::grow_to`] accepts, in blocks (0: the `u32` id
    /// space is the only limit).
    pub max_num_blocks: usize,
}

impl CacheConfig {
    /// `num_blocks` blocks, a 1 % watermark, no per-sequence limit.
    pub fn new(num_blocks: usize) -> Self {
        CacheConfig {
            num_blocks,
            watermark_blocks: num_blocks / 100,
            max_seq_len_tokens: 0,
            max_num_blocks: 0,
        }
    }
}

/// Hashes a [`SeqId`] with one multiply (Fibonacci hashing): sequence ids come from the
/// engine, not from an adversary, and the lookup is on the per-token path.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SeqIdHasher(u64);

impl Hasher for SeqIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The map from sequence ids to their tables.
pub(crate) type SeqMap<V> = HashMap<SeqId, V, BuildHasherDefault<SeqIdHasher>>;

/// One sequence's block table and lengths.
///
/// `computed <= computed + scheduled <= num_tokens`: tokens whose K/V is written,
/// then the tokens of this step (slots handed out, not yet committed), then lookahead
/// slots (allocated, never context). The table covers exactly `num_tokens`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sequence {
    pub(crate) table: Vec<BlockId>,
    /// Allocated token slots.
    pub(crate) num_tokens: usize,
    /// Tokens whose K/V the engine reported written ([`KvCacheManager::commit`]).
    pub(crate) computed: usize,
    /// Tokens reserved by [`KvCacheManager::reserve`] and not yet committed.
    pub(crate) scheduled: usize,
    /// Registration stopped for good (a duplicate block, a swap-in): token ids that
    /// arrive later are not recorded.
    pub(crate) registration_stopped: bool,
    /// Prefix-cache progress; `None` when the token ids are unknown.
    pub(crate) prefix: Option<Box<prefix::SeqPrefix>>,
    /// The admission this sequence descends from (forks inherit it): its fork group
    /// and its age for preemption.
    pub(crate) admission: u64,
    /// Preemption priority set by the engine (lower is preempted first).
    pub(crate) priority: i32,
    /// A swap transfer of this sequence that has not completed yet.
    pub(crate) in_flight: Option<swap::InFlight>,
}

/// Snapshot of the manager's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Blocks in the arena.
    pub num_blocks: usize,
    /// Blocks referenced by at least one table.
    pub used_blocks: usize,
    /// Blocks on the free list.
    pub free_blocks: usize,
    /// Unreferenced blocks kept for the prefix cache (evictable, so also available).
    pub cached_blocks: usize,
    /// Highest `used_blocks` since the last [`KvCacheManager::take_peak_used_blocks`].
    pub peak_used_blocks: usize,
    /// Sequences known to the manager.
    pub num_sequences: usize,
    /// Token slots of used blocks that hold a live token (a shared block counts once).
    pub live_token_slots: usize,
    /// Token slots of used blocks that hold nothing (mostly last-block tails).
    pub internal_waste_slots: usize,
}

impl CacheStats {
    /// Live token slots over all slots of the arena, in `[0, 1]`.
    pub fn utilization(&self, block_size: usize) -> f64 {
        let slots = self.num_blocks * block_size;
        if slots == 0 {
            0.0
        } else {
            self.live_token_slots as f64 / slots as f64
        }
    }
}

/// Maps sequences to block tables over one [`BlockPool`].
///
/// ```
/// use pagedkv::{CacheConfig, CopyPlan, DType, KvCacheManager, KvLayout, ModelShape, SeqId};
///
/// let shape = ModelShape { num_layers: 2, num_q_heads: 8, num_kv_heads: 2, head_dim: 64,
///                          kv_dtype: DType::BF16 };
/// let layout = KvLayout::new(shape, 16)?;
/// let mut kv = KvCacheManager::new(layout, CacheConfig::new(64))?;
/// let mut slots = Vec::new();
/// let mut copies = CopyPlan::default();
///
/// kv.admit(SeqId(1), 20, &mut slots)?;            // prompt: 20 tokens -> 2 blocks
/// assert_eq!(slots.len(), 20);
/// kv.fork(SeqId(1), SeqId(2))?;                     // parallel sampling: share all blocks
/// kv.append(SeqId(2), 1, &mut slots, &mut copies)?; // writes into the shared last block
/// assert_eq!(copies.len(), 1);                      // -> one copy-on-write
/// kv.free(SeqId(1))?;
/// kv.free(SeqId(2))?;
/// assert_eq!(kv.stats().used_blocks, 0);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pub(crate) layout: KvLayout,
    pub(crate) config: CacheConfig,
    pub(crate) pool: BlockPool,
    pub(crate) seqs: SeqMap<Sequence>,
    /// Filled token slots of each block (meaningful for live blocks).
    pub(crate) block_fill: Vec<u16>,
    pub(crate) live_token_slots: usize,
    pub(crate) peak_used_blocks: usize,
    /// The prefix cache (see `manager/prefix.rs`).
    pub(crate) prefix: PrefixIndex,
    /// Host and disk tiers, swapped sequences and in-flight transfers.
    pub(crate) tiers: swap::Tiers,
    /// Cumulative defragmentation counters.
    pub(crate) defrag_counters: defrag::DefragCounters,
}

impl KvCacheManager {
    /// A manager for an arena of `config.num_blocks` blocks of `layout`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the arena is empty or the watermark is not smaller
    /// than the arena.
    pub fn new(layout: KvLayout, config: CacheConfig) -> Result<Self> {
        if config.num_blocks == 0 {
            return Err(Error::config(
                "num_blocks",
                "the arena needs at least one block",
            ));
        }
        if config.watermark_blocks >= config.num_blocks {
            return Err(Error::config(
                "watermark_blocks",
                format!(
                    "{} must be below num_blocks {}",
                    config.watermark_blocks, config.num_blocks
                ),
            ));
        }
        if config.max_num_blocks != 0 && config.num_blocks > config.max_num_blocks {
            return Err(Error::config(
                "max_num_blocks",
                format!(
                    "{} is below num_blocks {}",
                    config.max_num_blocks, config.num_blocks
                ),
            ));
        }
        Ok(KvCacheManager {
            layout,
            config,
            pool: BlockPool::new(config.num_blocks)?,
            seqs: SeqMap::default(),
            block_fill: vec![0; config.num_blocks],
            live_token_slots: 0,
            peak_used_blocks: 0,
            prefix: PrefixIndex::new(
                config.num_blocks,
                layout.block_size(),
                PrefixConfig::for_arena(config.num_blocks),
            )?,
            tiers: swap::Tiers::new(TierConfig::default())?,
            defrag_counters: defrag::DefragCounters::default(),
        })
    }

    /// The arena layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.layout.block_size()
    }

    /// Blocks in the arena.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Blocks an allocation can obtain now: free plus evictable (cached and not pinned).
    pub fn num_available_blocks(&self) -> usize {
        self.pool.num_free() + self.pool.num_cached() - self.prefix.pinned_cached()
    }

    /// Longest sequence the manager accepts.
    pub fn max_seq_len(&self) -> usize {
        let arena = self.num_blocks() * self.block_size();
        match self.config.max_seq_len_tokens {
            0 => arena,
            n => n.min(arena),
        }
    }

    pub(crate) fn seq(&self, seq: SeqId) -> Result<&Sequence> {
        self.seqs.get(&seq).ok_or_else(|| self.absent_error(seq))
    }

    /// Whether a new sequence of `num_tokens` tokens fits while keeping the watermark.
    pub fn can_admit(&self, num_tokens: usize) -> bool {
        num_tokens <= self.max_seq_len()
            && self.layout.blocks_for_tokens(num_tokens) + self.config.watermark_blocks
                <= self.num_available_blocks()
    }

    /// Whether `n` more tokens fit on `seq` without preemption (the watermark is not
    /// applied: running sequences may dip into it). See [`Self::blocks_needed`].
    pub fn can_append(&self, seq: SeqId, n: usize) -> bool {
        self.blocks_needed(seq, n, 0)
            .is_ok_and(|needed| needed <= self.num_available_blocks())
    }

    /// Admits sequence `seq` with a prompt of `num_tokens` tokens and writes the slots of
    /// all its tokens into `slots` (cleared first).
    ///
    /// # Errors
    /// [`Error::DuplicateSequence`], [`Error::TooLong`], [`Error::OutOfBlocks`]; on error
    /// nothing changed (`slots` may have been cleared).
    pub fn admit(&mut self, seq: SeqId, num_tokens: usize, slots: &mut Vec<Slot>) -> Result<()> {
        slots.clear();
        if self.contains(seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        if num_tokens > self.max_seq_len() {
            return Err(Error::TooLong {
                tokens: num_tokens,
                limit: self.max_seq_len(),
            });
        }
        let needed = self.layout.blocks_for_tokens(num_tokens);
        self.ensure_available(needed)?;
        let mut s = Sequence {
            table: Vec::with_capacity(needed + 1),
            admission: self.tiers.next_admission(),
            ..Sequence::default()
        };
        for _ in 0..needed {
            let b = self.alloc_block()?;
            s.table.push(b);
        }
        self.fill_tokens(&mut s, num_tokens, slots);
        s.computed = num_tokens;
        self.seqs.insert(seq, s);
        self.note_usage();
        Ok(())
    }

    /// Appends `n` tokens to `seq` and commits them at once: the decode fast path of
    /// an engine that writes the K/V of every slot it was given in this step before
    /// anything reads them (one for decode, several for speculative or chunked steps).
    /// Equivalent to [`Self::reserve`]`(seq, n, 0, ..)` then [`Self::commit`]`(seq, n)`.
    /// Writes their slots into `slots` (cleared first). When a write lands in a shared
    /// block, the block is copied first and the copy is added to `copies`, which the
    /// engine executes before writing K/V.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::TooLong`], [`Error::OutOfBlocks`];
    /// [`Error::SequenceState`] when `seq` is swapped out, has a swap in flight, or
    /// has uncommitted reserved tokens. On error nothing changed.
    pub fn append(
        &mut self,
        seq: SeqId,
        n: usize,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        self.reserve_inner(seq, n, 0, true, None, slots, copies)
            .map(|_| ())
    }

    /// Reserves slots for the next `n` tokens of `seq` plus `lookahead` slots after
    /// them, for one step (vLLM's `allocate_slots(num_new, num_lookahead)`). `slots`
    /// (cleared first) gets `n + lookahead` slots for token positions
    /// `computed..computed + n + lookahead`.
    ///
    /// The `n` tokens are this step's: the batch views count them as context
    /// ([`Self::fill_padded`] reports `computed + n`) and [`Self::commit`] marks how
    /// many of them were computed. Lookahead slots (a drafter's next proposals) are
    /// allocated but never context and never registered. Blocks with no computed token
    /// are rewritten freely: a draft rejected by [`Self::commit`] costs no copy when
    /// its slots are reserved again. A block that holds computed tokens and is shared
    /// (fork) or registered in the prefix cache is copied first (`copies`).
    ///
    /// ```
    /// use pagedkv::{CacheConfig, CopyPlan, DType, KvCacheManager, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let mut kv = KvCacheManager::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
    /// let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    /// kv.admit(SeqId(1), 10, &mut slots)?;
    /// // Speculative step: 1 verified token + 3 drafts this step, 2 lookahead slots.
    /// kv.reserve(SeqId(1), 4, 2, &mut slots, &mut copies)?;
    /// assert_eq!(slots.len(), 6);
    /// assert_eq!(kv.context_len(SeqId(1))?, 14);      // computed + this step
    /// kv.commit(SeqId(1), 2)?;                          // 2 accepted, 2 drafts rejected
    /// assert_eq!(kv.num_computed_tokens(SeqId(1))?, 12);
    /// assert_eq!(kv.context_len(SeqId(1))?, 12);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::TooLong`], [`Error::OutOfBlocks`];
    /// [`Error::SequenceState`] when `seq` is swapped out, has a swap in flight, or
    /// already has an uncommitted reservation. On error nothing changed.
    pub fn reserve(
        &mut self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        self.reserve_inner(seq, n, lookahead, false, None, slots, copies)
            .map(|_| ())
    }

    /// Marks `n` of the tokens reserved by [`Self::reserve`] as computed (their K/V is
    /// written): `n` is the accepted part, the rest of the reservation (rejected drafts)
    /// is dropped and its slots are reserved again by the next call. Full computed
    /// blocks whose token ids are known are registered in the prefix cache now.
    /// `commit(seq, 0)` cancels a reservation. Returns the blocks registered.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is swapped out
    /// or has a swap in flight; [`Error::CommitPastReservation`] when `n` is more than
    /// the reservation. Nothing changed on error.
    pub fn commit(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let s = self.resident(seq)?;
        if n > s.scheduled {
            return Err(Error::CommitPastReservation {
                seq,
                committed: n,
                reserved: s.scheduled,
            });
        }
        let mut s = self.seqs.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        s.computed += n;
        s.scheduled = 0;
        let registered = self.extend_chain(&mut s);
        self.seqs.insert(seq, s);
        Ok(registered)
    }

    /// Blocks [`Self::reserve`]`(seq, n, lookahead, ..)` would take from the pool now
    /// (new blocks plus copies of shared or registered blocks written into). Compare
    /// with [`Self::num_available_blocks`] before scheduling, or pass the shortfall's
    /// total to [`Self::preempt_for`].
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is swapped out or
    /// has a swap in flight; [`Error::TooLong`] past the longest sequence.
    pub fn blocks_needed(&self, seq: SeqId, n: usize, lookahead: usize) -> Result<usize> {
        let s = self.resident(seq)?;
        let target = self.reserve_target(s, n, lookahead)?;
        Ok(self.reserve_cost(s, target).0)
    }

    /// Tokens of `seq` whose K/V is written (committed).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn num_computed_tokens(&self, seq: SeqId) -> Result<usize> {
        match self.tiers.swapped.get(&seq) {
            Some(swapped) => Ok(swapped.computed),
            None => Ok(self.seq(seq)?.computed),
        }
    }

    /// The context length attention reads for `seq` in this step: computed tokens
    /// plus the uncommitted reserved ones (never lookahead slots). What
    /// [`Self::fill_padded`] and [`Self::fill_csr`] report.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn context_len(&self, seq: SeqId) -> Result<usize> {
        let s = self.seq(seq)?;
        Ok(s.computed + s.scheduled)
    }

    /// The end of a reservation of `n + lookahead` tokens after the computed ones.
    fn reserve_target(&self, s: &Sequence, n: usize, lookahead: usize) -> Result<usize> {
        let end = s
            .computed
            .checked_add(n)
            .and_then(|e| e.checked_add(lookahead))
            .unwrap_or(usize::MAX);
        if end > self.max_seq_len() {
            return Err(Error::TooLong {
                tokens: end,
                limit: self.max_seq_len(),
            });
        }
        Ok(end)
    }

    /// Blocks a reservation up to `target` takes, and the first table index it writes.
    /// Blocks from that index on that are shared or registered are replaced: copied
    /// when they hold computed tokens, taken fresh otherwise.
    fn reserve_cost(&self, s: &Sequence, target: usize) -> (usize, usize) {
        let bs = self.block_size();
        let first = s.computed / bs;
        let new_len = target.max(s.num_tokens);
        let new_blocks = self.layout.blocks_for_tokens(new_len) - s.table.len();
        let written_end = self.layout.blocks_for_tokens(target).min(s.table.len());
        let replaced = (first..written_end)
            .filter(|&i| self.is_protected(s.table[i]))
            .count();
        (new_blocks + replaced, first)
    }

    /// Shared (by a fork or a prefix hit) or registered: writes must go elsewhere.
    fn is_protected(&self, b: BlockId) -> bool {
        self.pool.refcount(b).unwrap_or(0) > 1 || self.prefix.is_registered(b)
    }

    /// The one slot-handing path: reserve `n + lookahead` slots after the computed
    /// tokens, then commit the `n` at once when `commit_now` (with their ids when
    /// `tokens` is given).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reserve_inner(
        &mut self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        commit_now: bool,
        tokens: Option<&[u32]>,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<usize> {
        slots.clear();
        let s = self.resident(seq)?;
        if s.scheduled > 0 {
            return Err(Error::SequenceState {
                seq,
                state: "holding an uncommitted reservation",
                needed: "committed (commit first; commit(seq, 0) cancels)",
            });
        }
        let target = self.reserve_target(s, n, lookahead)?;
        let (needed, first) = self.reserve_cost(s, target);
        if needed == 0 && s.prefix.is_none() && s.computed == s.num_tokens && commit_now {
            // The common decode case: the tokens land in the sequence's own blocks and
            // no prefix-cache bookkeeping follows the sequence.
            let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
            fill_slots(
                &self.layout,
                s,
                target,
                slots,
                &mut self.block_fill,
                &mut self.live_token_slots,
            );
            s.computed = target;
            return Ok(0);
        }
        self.ensure_available(needed)?;
        // Every step below succeeds: `ensure_available` reserved enough blocks.
        let bs = self.block_size();
        let mut s = self.seqs.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        let written_end = self.layout.blocks_for_tokens(target).min(s.table.len());
        for i in first..written_end {
            let old = s.table[i];
            if !self.is_protected(old) {
                continue;
            }
            let new = self.alloc_block()?;
            let keep = s.computed.saturating_sub(i * bs).min(bs);
            if keep > 0 {
                copies.push(old, new);
            }
            self.block_fill[new.index()] = keep as u16;
            self.live_token_slots += keep;
            self.release_block(old)?;
            s.table[i] = new;
        }
        let new_len = target.max(s.num_tokens);
        while s.table.len() < self.layout.blocks_for_tokens(new_len) {
            let b = self.alloc_block()?;
            s.table.push(b);
        }
        // Slots of the reserved positions; fills count every allocated slot.
        slots.reserve(target - s.computed);
        for pos in s.computed..target {
            let b = s.table[pos / bs];
            let off = pos % bs;
            slots.push(self.layout.slot(b, off));
            let fill = &mut self.block_fill[b.index()];
            if usize::from(*fill) <= off {
                self.live_token_slots += off + 1 - usize::from(*fill);
                *fill = (off + 1) as u16;
            }
        }
        s.num_tokens = new_len;
        if let Some(ids) = tokens {
            prefix::record_ids(&mut s, ids, bs);
        }
        if commit_now {
            s.computed += n;
        } else {
            s.scheduled = n;
        }
        let registered = self.extend_chain(&mut s);
        self.seqs.insert(seq, s);
        self.note_usage();
        Ok(registered)
    }

    /// Extends `s` to `new_len` tokens over blocks already in its table, emitting slots.
    fn fill_tokens(&mut self, s: &mut Sequence, new_len: usize, slots: &mut Vec<Slot>) {
        fill_slots(
            &self.layout,
            s,
            new_len,
            slots,
            &mut self.block_fill,
            &mut self.live_token_slots,
        );
    }

    /// Drops the last slots of `seq` so it holds `new_len` (rejected speculative
    /// tokens on the one-call path, lookahead slots no longer wanted); blocks no longer
    /// needed are released and the computed count follows.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::PastEnd`] when `new_len` is longer than
    /// the sequence; [`Error::SequenceState`] when it is swapped out or has a swap in
    /// flight. Nothing changed on error.
    pub fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        let s = self.resident(seq)?;
        if new_len > s.num_tokens {
            return Err(Error::PastEnd {
                seq,
                end: new_len,
                len: s.num_tokens,
            });
        }
        let mut s = self.seqs.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        let keep = self.layout.blocks_for_tokens(new_len);
        let mut result = Ok(());
        while s.table.len() > keep {
            if let Some(b) = s.table.pop() {
                result = result.and(self.release_block(b));
            }
        }
        let tail = new_len % self.block_size();
        if let Some(&last) = s.table.last() {
            if tail != 0 && self.pool.refcount(last)? == 1 {
                let fill = &mut self.block_fill[last.index()];
                self.live_token_slots -= usize::from(*fill) - tail.min(usize::from(*fill));
                *fill = (*fill).min(tail as u16);
            }
        }
        s.num_tokens = new_len;
        if s.computed + s.scheduled > new_len {
            s.computed = s.computed.min(new_len);
            s.scheduled = new_len - s.computed;
        }
        self.prefix_after_truncate(&mut s, new_len);
        self.seqs.insert(seq, s);
        result
    }

    /// Forks `parent` into a new sequence `child` that shares every block
    /// (parallel sampling, beam search). Copy-on-write happens on the next append.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`] for the parent, [`Error::DuplicateSequence`] for the
    /// child, [`Error::SequenceState`] when the parent is swapped out, has a swap in
    /// flight or holds an uncommitted reservation. Nothing changed on error.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        let p = self.idle(parent)?;
        if self.contains(child) {
            return Err(Error::DuplicateSequence(child));
        }
        let c = p.clone();
        for &b in &c.table {
            self.pool.incref(b)?;
        }
        self.seqs.insert(child, c);
        Ok(())
    }

    /// Frees `seq`; blocks nobody else references are released (host and disk blocks
    /// too when it is swapped out).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] while a swap of `seq` is in
    /// flight (complete or abort it first). A refcount error here means the manager's
    /// own state was corrupt; it is reported after every block was processed.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        if !self.seqs.contains_key(&seq) {
            return self.free_swapped(seq);
        }
        self.resident(seq)?;
        let s = self.seqs.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        let mut result = Ok(());
        for &b in s.table.iter().rev() {
            result = result.and(self.release_block(b));
        }
        result
    }

    /// The block table of `seq`.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        Ok(&self.seq(seq)?.table)
    }

    /// Tokens held by `seq` (on the device or swapped out).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        match self.tiers.swapped.get(&seq) {
            Some(swapped) => Ok(swapped.num_tokens),
            None => Ok(self.seq(seq)?.num_tokens),
        }
    }

    /// Whether `seq` is known (on the device or swapped out).
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq) || self.tiers.swapped.contains_key(&seq)
    }

    /// Ids of the sequences that have a device block table (resident, or with a swap
    /// in flight), in no particular order.
    pub fn sequence_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// The slots of tokens `range` of `seq`, written into `slots` (cleared first).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::PastEnd`] when the range runs past the
    /// sequence's allocated slots.
    pub fn slots(
        &self,
        seq: SeqId,
        range: std::ops::Range<usize>,
        slots: &mut Vec<Slot>,
    ) -> Result<()> {
        slots.clear();
        let s = self.seq(seq)?;
        if range.end > s.num_tokens {
            return Err(Error::PastEnd {
                seq,
                end: range.end,
                len: s.num_tokens,
            });
        }
        for pos in range {
            let (b, off) = self.layout.locate(&s.table, pos)?;
            slots.push(self.layout.slot(b, off));
        }
        Ok(())
    }

    /// Counters now.
    pub fn stats(&self) -> CacheStats {
        let used = self.pool.num_live();
        CacheStats {
            num_blocks: self.num_blocks(),
            used_blocks: used,
            free_blocks: self.pool.num_free(),
            cached_blocks: self.pool.num_cached(),
            peak_used_blocks: self.peak_used_blocks.max(used),
            num_sequences: self.seqs.len(),
            live_token_slots: self.live_token_slots,
            internal_waste_slots: used * self.block_size() - self.live_token_slots,
        }
    }

    /// Returns the peak of used blocks since the last call and restarts the window.
    pub fn take_peak_used_blocks(&mut self) -> usize {
        let peak = self.peak_used_blocks.max(self.pool.num_live());
        self.peak_used_blocks = self.pool.num_live();
        peak
    }

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    // ---- the three places blocks enter and leave tables -------------------------

    /// Fails unless `needed` blocks can be obtained now.
    fn ensure_available(&self, needed: usize) -> Result<()> {
        let free = self.num_available_blocks();
        if needed > free {
            return Err(Error::OutOfBlocks { needed, free });
        }
        Ok(())
    }

    /// Takes one block for a table, evicting a cached block when none is free.
    pub(crate) fn alloc_block(&mut self) -> Result<BlockId> {
        if self.pool.num_free() == 0 {
            self.evict_one()?;
        }
        let b = self.pool.allocate()?;
        self.block_fill[b.index()] = 0;
        Ok(b)
    }

    /// Drops one table reference to `b`; a registered block is kept cached at zero.
    pub(crate) fn release_block(&mut self, b: BlockId) -> Result<()> {
        let registered = self.prefix.is_registered(b);
        let rc = if registered {
            self.pool.decref_keep(b)?
        } else {
            self.pool.decref(b)?
        };
        if rc == 0 {
            self.live_token_slots -= usize::from(self.block_fill[b.index()]);
            self.block_fill[b.index()] = 0;
            if registered {
                self.prefix.on_cached(b);
            }
        }
        Ok(())
    }

    fn note_usage(&mut self) {
        self.peak_used_blocks = self.peak_used_blocks.max(self.pool.num_live());
    }

    /// Checks every invariant between tables and pool: refcounts equal table
    /// references, no table points at a free block, tables cover exactly their tokens,
    /// the live-slot counter matches the blocks' fills, and the prefix cache is
    /// consistent: every cached block is in the index exactly once, the index names only
    /// live or cached blocks with matching hashes, chains are linked parent to child
    /// (no live block under a cached parent), pins and eviction candidates match.
    ///
    /// # Errors
    /// A message describing the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.pool.check_invariants()?;
        let mut refs = vec![0u32; self.num_blocks()];
        for (id, s) in &self.seqs {
            if s.table.len() != self.layout.blocks_for_tokens(s.num_tokens) {
                return Err(format!(
                    "sequence {id}: {} tokens but {} blocks",
                    s.num_tokens,
                    s.table.len()
                ));
            }
            for &b in &s.table {
                match refs.get_mut(b.index()) {
                    Some(r) => *r += 1,
                    None => return Err(format!("sequence {id} points outside the arena at {b}")),
                }
            }
        }
        let mut live_slots = 0;
        for (i, &r) in refs.iter().enumerate() {
            let b = BlockId(i as u32);
            let rc = self.pool.refcount(b).map_err(|e| e.to_string())?;
            if rc != r {
                return Err(format!("block {b}: refcount {rc} but {r} table references"));
            }
            if r > 0 {
                if self.pool.state(b).map_err(|e| e.to_string())? != BlockState::Live {
                    return Err(format!("block {b} is referenced but not live"));
                }
                live_slots += usize::from(self.block_fill[i]);
            }
        }
        if live_slots != self.live_token_slots {
            return Err(format!(
                "live slots {} but blocks hold {live_slots}",
                self.live_token_slots
            ));
        }
        self.check_prefix_invariants()?;
        self.check_tier_invariants()
    }
}

/// Extends `s` to `new_len` tokens over blocks already in its table, emitting slots and
/// keeping the per-block fill counts (split borrows, so the hot path needs no `&mut self`).
fn fill_slots(
    layout: &KvLayout,
    s: &mut Sequence,
    new_len: usize,
    slots: &mut Vec<Slot>,
    block_fill: &mut [u16],
    live_token_slots: &mut usize,
) {
    let bs = layout.block_size();
    slots.reserve(new_len - s.num_tokens);
    for pos in s.num_tokens..new_len {
        let b = s.table[pos / bs];
        let off = pos % bs;
        slots.push(layout.slot(b, off));
        let fill = &mut block_fill[b.index()];
        if usize::from(*fill) <= off {
            *live_token_slots += off + 1 - usize::from(*fill);
            *fill = (off + 1) as u16;
        }
    }
    s.num_tokens = new_len;
}
