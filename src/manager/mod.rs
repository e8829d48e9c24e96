//! Sequences, block tables and the [`KvCache`].
//!
//! The manager is pure bookkeeping: it never touches KV memory. Whenever data must
//! move (copy-on-write), it returns a plan that a [`crate::executor::storage::Storage`] executes.

mod builder;
mod defrag;
mod disk_level;
pub mod groups;
mod hybrid;
mod in_flight;
mod invariants;
mod lifecycle;
pub mod preempt;
mod prefix;
mod prefix_spill;
mod seqs;
mod shared;
mod step;
mod swap;
mod tier_cache;
mod window;

pub use builder::CacheBuilder;
pub use defrag::{DefragCounters, DefragOptions, FragStats, PendingDefrag, PendingResize};
pub use disk_level::{
    DiskCacheConfig, DiskLevelStats, DiskLoadItem, DiskLoadJob, DiskPlacement, DiskStoreItem,
    DiskStoreJob, DiskStorePolicy,
};
pub use preempt::CostModel;
pub use prefix::PrefixHit;
pub use prefix_spill::{PendingPrefixRestore, PendingPrefixSpill, PrefixRestore, PrefixSpill};
pub use shared::SharedKvCache;
pub use step::{StepBuffers, StepEntry};
pub use swap::{PendingTierMove, SwapJob, TierBlock, TierConfig, TierStats};
pub use tier_cache::{HostCacheConfig, HostCacheStats, HostStorePolicy};

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqHandle, SeqId};
use crate::layout::plans::CopyPlan;
use crate::layout::{KvLayout, Slot};
use crate::pool::prefix::index::PrefixIndex;
use crate::pool::prefix::PrefixConfig;
use crate::pool::BlockPool;

/// Tuning of a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// Blocks in the device arena.
    pub num_blocks: usize,
    /// Blocks [`KvCache::can_admit`] keeps in reserve so that running sequences
    /// can still grow after an admission (vLLM's watermark).
    pub watermark_blocks: usize,
    /// Longest sequence, in tokens, the manager accepts (0: whatever the arena holds).
    pub max_seq_len_tokens: usize,
    /// Largest arena [`crate::executor::grow_to`] accepts, in blocks (0: the `u32` id
    /// space is the only limit).
    pub max_num_blocks: usize,
    /// Entries a sequence's block table makes room for the first time it grows past
    /// its admission (0: it grows by doubling). Set it to the longest sequence's
    /// blocks and a decode step never allocates once its batch is admitted.
    pub table_capacity_blocks: usize,
}

impl CacheConfig {
    /// `num_blocks` blocks, a 1 % watermark, no per-sequence limit.
    pub fn new(num_blocks: usize) -> Self {
        CacheConfig {
            num_blocks,
            watermark_blocks: num_blocks / 100,
            max_seq_len_tokens: 0,
            max_num_blocks: 0,
            table_capacity_blocks: 0,
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

/// One flag per block of the arena: a set of blocks that answers `contains` with one
/// byte read, or none while the set is empty (no hashing: asked on every release of
/// a shared block).
#[derive(Debug, Clone, Default)]
pub(crate) struct BlockFlags {
    flags: Vec<bool>,
    /// Flags set: while none is (the usual case), a question costs no memory read.
    set: usize,
}

impl BlockFlags {
    pub(crate) fn new(num_blocks: usize) -> Self {
        BlockFlags {
            flags: vec![false; num_blocks],
            set: 0,
        }
    }

    /// Sets the flag of `b`; returns whether it was clear.
    pub(crate) fn insert(&mut self, b: BlockId) -> bool {
        let newly = match self.flags.get_mut(b.index()) {
            Some(f) => !std::mem::replace(f, true),
            None => false,
        };
        self.set += usize::from(newly);
        newly
    }

    /// Clears the flag of `b`; returns whether it was set.
    #[inline]
    pub(crate) fn remove(&mut self, b: &BlockId) -> bool {
        if self.set == 0 {
            return false;
        }
        let was = self
            .flags
            .get_mut(b.index())
            .is_some_and(|f| std::mem::replace(f, false));
        self.set -= usize::from(was);
        was
    }

    #[inline]
    pub(crate) fn contains(&self, b: &BlockId) -> bool {
        self.set != 0 && self.flags.get(b.index()).copied().unwrap_or(false)
    }

    /// Follows the arena to `num_blocks` (new blocks unflagged).
    pub(crate) fn resize(&mut self, num_blocks: usize) {
        self.flags.resize(num_blocks, false);
        self.set = self.count();
    }

    fn count(&self) -> usize {
        self.flags.iter().filter(|&&f| f).count()
    }

    /// Whether the count of set flags is exact (for `check_invariants`).
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let n = self.count();
        if n == self.set {
            Ok(())
        } else {
            Err(format!(
                "{} blocks flagged but the count says {}",
                n, self.set
            ))
        }
    }
}

/// The map from sequence ids to their tables.
pub(crate) type SeqMap<V> = HashMap<SeqId, V, BuildHasherDefault<SeqIdHasher>>;

/// One sequence's block table and lengths.
///
/// `computed <= computed + scheduled <= num_tokens`: tokens whose K/V is written,
/// then the tokens of this step (slots handed out, not yet committed), then lookahead
/// slots (allocated, never context). The table covers exactly `num_tokens`.
///
/// In declaration order (`repr(C)`): what the decode step reads (the table, the three
/// lengths, the prefix state and whether a swap is in flight) fills the first 64
/// bytes, so an append reads one line of it (`seqs::Slot` is line-aligned); the rest
/// is 40 bytes, so that the slot is two lines.
#[derive(Debug, Clone, Default)]
#[repr(C)]
pub(crate) struct Sequence {
    /// One entry per block of `num_tokens`; the first `released` are
    /// [`BlockId::RELEASED`] (given back by a sliding window).
    pub(crate) table: Vec<BlockId>,
    /// Allocated token slots.
    pub(crate) num_tokens: usize,
    /// Tokens whose K/V the engine reported written ([`KvCache::commit`]).
    pub(crate) computed: usize,
    /// Tokens reserved by [`KvCache::reserve`] and not yet committed.
    pub(crate) scheduled: usize,
    /// Prefix-cache progress; `None` when the token ids are unknown.
    pub(crate) prefix: Option<Box<prefix::SeqPrefix>>,
    /// A swap transfer of this sequence that has not completed yet (its direction,
    /// which tells `None` apart, comes first: byte 56).
    pub(crate) in_flight: Option<swap::InFlight>,
    /// Leading table entries given back because every token in them fell out of the
    /// sliding window (always 0 without one). Holes are only ever a prefix.
    pub(crate) released: usize,
    /// The admission this sequence descends from (forks inherit it): its fork group
    /// and its age for preemption.
    pub(crate) admission: u64,
    /// Preemption priority set by the engine (lower is preempted first).
    pub(crate) preempt_priority: i32,
    /// The block after the prefix chain duplicates a cached copy that the sequence
    /// will share in its place (see `manager/prefix.rs`): the next call that hands
    /// it slots settles that first, so the decode fast path steps aside.
    pub(crate) twin_pending: bool,
    /// Tracking of its ids ended on a broken chain (a hash collision, or a corrupt
    /// state): ids of position 0 arriving later do not start it again, since the new
    /// chain would be in the default namespace, not the admission's (its cache salt
    /// and keys are gone with the tracking).
    pub(crate) tracking_stopped: bool,
    /// Query tokens of the reservations made on top of the oldest outstanding one
    /// ([`KvCache::reserve_ahead`]), oldest first; `scheduled` counts them too, so the
    /// oldest reservation holds `scheduled - later.sum()`. Empty (or `None`) with one
    /// reservation or none. Boxed (allocated at the first reservation ahead, then
    /// kept) so that a sequence's slot, generation and batch stamp included, is two
    /// cache lines (see `seqs::Slot`).
    #[allow(clippy::box_collection)] // The box is the point: 8 bytes in the slot, not 32.
    pub(crate) later: Option<Box<std::collections::VecDeque<usize>>>,
}

impl Sequence {
    /// Query tokens of the reservations after the oldest outstanding one.
    #[inline]
    pub(crate) fn later_tokens(&self) -> usize {
        self.later.as_deref().map_or(0, |q| q.iter().sum())
    }

    /// Whether reservations are outstanding on top of the oldest one.
    #[inline]
    pub(crate) fn has_later(&self) -> bool {
        self.later.as_deref().is_some_and(|q| !q.is_empty())
    }

    /// How many reservations are outstanding on top of the oldest one.
    #[inline]
    pub(crate) fn num_later(&self) -> usize {
        self.later.as_deref().map_or(0, |q| q.len())
    }

    /// Query tokens of the oldest outstanding reservation (what a commit accepts from).
    #[inline]
    pub(crate) fn oldest_scheduled(&self) -> usize {
        self.scheduled - self.later_tokens()
    }
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
    /// Highest `used_blocks` since the last [`KvCache::take_peak_used_blocks`].
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
/// use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};
///
/// let shape = ModelShape { num_layers: 2, num_q_heads: 8, num_kv_heads: 2, head_dim: 64,
///                          kv_dtype: DType::BF16 };
/// let layout = KvLayout::new(shape, 16)?;
/// let mut kv = KvCache::new(layout, CacheConfig::new(64))?;
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
pub struct KvCache {
    pub(crate) layout: KvLayout,
    pub(crate) config: CacheConfig,
    pub(crate) pool: BlockPool,
    /// Resident sequences (and those with a swap in flight), by handle; the `SeqId`
    /// map sits at the edge (see `manager/seqs.rs`).
    pub(crate) seqs: seqs::Seqs,
    /// Shared blocks whose holders hold different lengths (after a truncation into a
    /// shared block): when one of them lets go, the fill is recomputed from the
    /// tables. Rare, so a set and a scan.
    pub(crate) fill_dirty: BlockFlags,
    pub(crate) live_token_slots: usize,
    pub(crate) peak_used_blocks: usize,
    /// The prefix cache (see `manager/prefix.rs`).
    pub(crate) prefix: PrefixIndex,
    /// Host and disk tiers, swapped sequences and in-flight transfers.
    pub(crate) tiers: swap::Tiers,
    /// Cumulative defragmentation counters.
    pub(crate) defrag_counters: defrag::DefragCounters,
    /// Sliding window in tokens: blocks entirely before the window of a sequence's
    /// next query are given back (see [`CacheBuilder::sliding_window`]).
    pub(crate) window: Option<usize>,
    /// Changes whenever a table entry already handed out changes (a copy-on-write, a
    /// shared cached copy, a window's release, a truncation, a move): step buffers
    /// rewrite their rows then (see `manager/step.rs`). Drawn from one process-wide
    /// counter, so no two managers (nor a clone that diverged) share a value.
    pub(crate) table_epoch: u64,
    /// The KV-cache groups of a hybrid model ([`KvCache::hybrid`]); `None` for one
    /// group, the common case. A hybrid cache keeps no tables of its own: every call
    /// goes to its groups, each a one-group `KvCache` (see `manager/groups/`).
    pub(crate) hybrid: Option<Box<groups::Groups>>,
}

/// Whether a reservation may go on top of the outstanding ones of `seq` (which holds
/// some): only through the calls that reserve ahead ([`KvCache::reserve_ahead`],
/// [`KvCache::reserve_step_ahead`]), for at least one query token, without token ids
/// and without committing at once.
fn check_stack(seq: SeqId, ahead: bool, n: usize, ids_or_commit: bool) -> Result<()> {
    if !ahead {
        return Err(Error::SequenceState {
            seq,
            state: "holding an uncommitted reservation",
            needed: "committed (commit first; cancel(seq) drops it; reserve_ahead stacks another)",
        });
    }
    if n == 0 || ids_or_commit {
        return Err(Error::SequenceState {
            seq,
            state: "holding an uncommitted reservation",
            needed: "a reservation ahead of at least one query token, without token ids \
                     (add_token_ids gives them later)",
        });
    }
    Ok(())
}

/// The sequence-side conditions of [`KvCache::in_last_block`]: `n` committed-next
/// tokens land in the sequence's last block, which already holds computed tokens;
/// nothing is reserved, swapping, pending as a twin, past `max_len`, or (with a
/// window) due to leave the window at this step's first position. Returns the offset
/// in the block, the end position and the block. The block's own conditions (private,
/// not registered) are the caller's.
#[inline(always)]
fn in_last_block_span(
    layout: &KvLayout,
    window: Option<usize>,
    max_len: usize,
    s: &Sequence,
    n: usize,
) -> Option<(usize, usize, BlockId)> {
    let bs = layout.block_size();
    let off = layout.block_offset(s.computed);
    // `off + n <= bs` also keeps `s.computed + n` from overflowing.
    if off == 0
        || n == 0
        || n > bs - off
        || s.computed != s.num_tokens
        || s.scheduled != 0
        || s.in_flight.is_some()
        || s.twin_pending
    {
        return None;
    }
    let end = s.computed + n;
    if end > max_len {
        return None;
    }
    if let Some(w) = window {
        // What `release_out_of_window` gives back at the step's first position: a
        // step that releases takes the general path.
        let keep_from = ((s.computed + 1).saturating_sub(w) / bs).min(s.table.len());
        if keep_from > s.released {
            return None;
        }
    }
    let &last = s.table.last()?;
    Some((off, end, last))
}

/// The end of a reservation of `n + lookahead` tokens from position `base` when it
/// is at most `max_len` ([`KvCache::max_seq_len`], which a batch call reads once).
#[inline(always)]
pub(crate) fn target_within(
    base: usize,
    n: usize,
    lookahead: usize,
    max_len: usize,
) -> Result<usize> {
    let end = base
        .checked_add(n)
        .and_then(|e| e.checked_add(lookahead))
        .unwrap_or(usize::MAX);
    if end > max_len {
        return Err(Error::TooLong {
            tokens: end,
            limit: max_len,
        });
    }
    Ok(end)
}

/// What [`KvCache::in_last_block`] did for `n` tokens of a sequence: the first of
/// their consecutive slots, the blocks registered, the sequence's tokens after them
/// (its context: it held no reservation) and its leading holes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InLastBlock {
    pub(crate) first: u64,
    pub(crate) registered: usize,
    pub(crate) end: usize,
    pub(crate) released: usize,
}

/// Whether a commit of `n` tokens of `s` (checked: at most its oldest reservation)
/// takes [`KvCache::commit_plain`]: one reservation, no twin to settle, and no window
/// block to give back (`release_out_of_window` at the new computed count would
/// release nothing).
#[inline(always)]
pub(crate) fn commits_plainly(window: Option<usize>, bs: usize, s: &Sequence, n: usize) -> bool {
    !s.twin_pending
        && n <= s.scheduled
        && !s.has_later()
        && window.is_none_or(|w| {
            ((s.computed + n + 1).saturating_sub(w) / bs).min(s.table.len()) <= s.released
        })
}

/// The next value of [`KvCache::table_epoch`].
fn next_table_epoch() -> u64 {
    static EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    EPOCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
}

impl KvCache {
    /// Records that a table entry already handed out changed.
    #[inline]
    pub(crate) fn tables_changed(&mut self) {
        self.table_epoch = next_table_epoch();
    }

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
        Ok(KvCache {
            layout,
            config,
            pool: BlockPool::new(config.num_blocks)?,
            seqs: seqs::Seqs::default(),
            fill_dirty: BlockFlags::new(config.num_blocks),
            live_token_slots: 0,
            peak_used_blocks: 0,
            prefix: PrefixIndex::new(
                config.num_blocks,
                layout.block_size(),
                PrefixConfig::for_arena(config.num_blocks),
            )?,
            tiers: swap::Tiers::new(TierConfig::default())?,
            defrag_counters: defrag::DefragCounters::default(),
            window: None,
            table_epoch: next_table_epoch(),
            hybrid: None,
        })
    }

    /// `Err(`[`Error::NotOnHybrid`]`)` on a hybrid cache: the guard of every call
    /// that serves one group only so far. One branch on a `None` for one group.
    #[inline]
    pub(crate) fn one_group(&self, operation: &'static str) -> Result<()> {
        match &self.hybrid {
            None => Ok(()),
            Some(h) => Err(Error::NotOnHybrid {
                operation,
                groups: h.num_groups(),
            }),
        }
    }

    /// Group 0 of a hybrid cache (`None` for one group): the calls that read one
    /// group's state answer from it.
    #[inline]
    pub(crate) fn first_group(&self) -> Option<&KvCache> {
        self.hybrid.as_deref().map(|h| h.group(0))
    }

    /// The arena layout.
    pub fn layout(&self) -> &KvLayout {
        if let Some(g0) = self.first_group() {
            return g0.layout();
        }
        &self.layout
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        if let Some(g0) = self.first_group() {
            return g0.config();
        }
        &self.config
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        if let Some(g0) = self.first_group() {
            return g0.block_size();
        }
        self.layout.block_size()
    }

    /// Blocks in the arena.
    pub fn num_blocks(&self) -> usize {
        if let Some(h) = &self.hybrid {
            return h.num_pages();
        }
        self.pool.num_blocks()
    }

    /// Blocks an allocation can obtain now: free plus evictable (cached and not pinned).
    pub fn num_available_blocks(&self) -> usize {
        if let Some(h) = &self.hybrid {
            return h.num_free_pages();
        }
        self.pool.num_free() + self.pool.num_cached() - self.prefix.pinned_cached()
    }

    /// Longest sequence the manager accepts: `max_seq_len_tokens`, and without a
    /// sliding window at most the arena (a window manager holds only the window).
    pub fn max_seq_len(&self) -> usize {
        if let Some(g0) = self.first_group() {
            return g0.max_seq_len();
        }
        let arena = match self.window {
            Some(_) => usize::MAX,
            None => self.num_blocks() * self.block_size(),
        };
        match self.config.max_seq_len_tokens {
            0 => arena,
            n => n.min(arena),
        }
    }

    pub(crate) fn seq(&self, seq: SeqId) -> Result<&Sequence> {
        self.seqs.get(&seq).ok_or_else(|| self.absent_error(seq))
    }

    /// The handle of `seq` for the step path ([`Self::reserve_step`],
    /// [`Self::reserve_step_grouped`], [`Self::commit_step`]) and the per-step batch
    /// calls ([`Self::append_batch`], [`Self::append_tokens_batch`]): look it up once
    /// (at admission, after a swap-in) and keep it while the sequence runs. It stays
    /// valid until the sequence is freed or swapped out; every other call keeps it
    /// (truncation, copy-on-write, commit). A hybrid cache hands out group 0's handle.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when it is swapped out.
    #[inline]
    pub fn handle(&self, seq: SeqId) -> Result<SeqHandle> {
        if let Some(h) = &self.hybrid {
            if groups::is_hidden(seq) {
                return Err(Error::UnknownSequence(seq));
            }
            return h.group(0).handle(seq);
        }
        self.seqs.handle(&seq).ok_or_else(|| self.absent_error(seq))
    }

    /// The decode step of a whole batch in one call: appends one token to every
    /// sequence of `seqs` and commits it, as [`Self::append`]`(seq, 1, ..)` does for
    /// each in order, and writes the step's slot mapping into `slots` (cleared first;
    /// slot `k` belongs to `seqs[k]`). Copy-on-writes go into `copies` (appended). The
    /// sequences are reached by handle: no id is hashed and no sequence moves.
    ///
    /// ```
    /// use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
    /// let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    /// let mut running = Vec::new();
    /// for id in 0..4 {
    ///     kv.admit(SeqId(id), 16, &mut slots)?;
    ///     running.push(kv.handle(SeqId(id))?);
    /// }
    /// kv.append_batch(&running, &mut slots, &mut copies)?; // one token each
    /// assert_eq!(slots.len(), 4);
    /// assert_eq!(kv.num_tokens(SeqId(3))?, 17);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::StaleHandle`]; [`Error::DuplicateInBatch`] when a sequence is listed
    /// twice; for any sequence, the errors of [`Self::append`]; [`Error::OutOfBlocks`]
    /// when the blocks the appends need one by one (each needs at most one: a new
    /// last block or a copy of a shared one; a block shared by two sequences of the
    /// batch counts for both) are not available. Every sequence is checked before any
    /// changes: on error nothing changed.
    pub fn append_batch(
        &mut self,
        seqs: &[SeqHandle],
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        self.one_group("append_batch")?;
        self.append_batch_inner(seqs, None, slots, copies)
    }

    /// [`Self::append_batch`] with the sampled token ids (`tokens[k]` for `seqs[k]`),
    /// as [`Self::append_tokens`] does per sequence: a block a token completes is
    /// registered in the prefix cache.
    ///
    /// # Errors
    /// As [`Self::append_batch`]; [`Error::ShapeMismatch`] when `tokens` and `seqs`
    /// differ in length. Nothing changed on error.
    pub fn append_tokens_batch(
        &mut self,
        seqs: &[SeqHandle],
        tokens: &[u32],
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        self.one_group("append_tokens_batch")?;
        if tokens.len() != seqs.len() {
            return Err(Error::ShapeMismatch {
                what: "token ids of the batch (one per sequence)",
                expected: seqs.len(),
                got: tokens.len(),
            });
        }
        self.append_batch_inner(seqs, Some(tokens), slots, copies)
    }

    fn append_batch_inner(
        &mut self,
        seqs: &[SeqHandle],
        tokens: Option<&[u32]>,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        slots.clear();
        // Check every sequence first, so that a failed call changes nothing.
        let max_len = self.max_seq_len();
        let mut needed = 0;
        self.seqs.begin_batch();
        for &h in seqs {
            let (seq, s) = self.seqs.at(h).ok_or(Error::StaleHandle(h))?;
            swap::check_resident(seq, s)?;
            if s.scheduled > 0 {
                return Err(Error::SequenceState {
                    seq,
                    state: "holding an uncommitted reservation",
                    needed: "committed (commit first; cancel(seq) drops every reservation)",
                });
            }
            if s.computed >= max_len {
                return Err(Error::TooLong {
                    tokens: s.computed + 1,
                    limit: max_len,
                });
            }
            // Exact, and it brings each sequence's last block's counters into the
            // cache in a loop whose iterations do not wait on each other.
            needed += self.reserve_cost(s, s.computed + 1).0;
            if !self.seqs.mark(h) {
                return Err(Error::DuplicateInBatch(seq));
            }
        }
        // Each sequence's need is counted as if it were alone: a block shared by two
        // of them is counted for both, though the second append finds it private.
        self.ensure_available(needed)?;
        slots.reserve(seqs.len());
        // Nothing below fails on a consistent manager: every sequence was checked and
        // the blocks are available.
        for (k, &h) in seqs.iter().enumerate() {
            let ids = tokens.and_then(|t| t.get(k..k + 1));
            if self.append_in_last_block(h, 1, ids, slots).is_none() {
                self.reserve_at(h, 1, 0, true, ids, slots, copies, false)?;
            }
        }
        Ok(())
    }

    /// Whether a new sequence of `num_tokens` tokens fits while keeping the watermark.
    pub fn can_admit(&self, num_tokens: usize) -> bool {
        if let Some(h) = &self.hybrid {
            return h.can_admit(num_tokens);
        }
        num_tokens <= self.max_seq_len()
            && self.layout.blocks_for_tokens(num_tokens) + self.config.watermark_blocks
                <= self.num_available_blocks()
    }

    /// Whether `n` more tokens fit on `seq` without preemption (the watermark is not
    /// applied: running sequences may dip into it). See [`Self::blocks_needed`].
    pub fn can_append(&self, seq: SeqId, n: usize) -> bool {
        if let Some(h) = &self.hybrid {
            return h
                .pages_needed(seq, n, 0)
                .is_ok_and(|p| p <= h.num_free_pages());
        }
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
        self.one_group("admit")?;
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
        self.seqs.reserve_room(1)?;
        let mut s = Sequence {
            table: self.new_table(needed),
            admission: self.tiers.next_admission(),
            ..Sequence::default()
        };
        for _ in 0..needed {
            let b = self.alloc_block()?;
            s.table.push(b);
        }
        self.fill_tokens(&mut s, num_tokens, slots);
        s.computed = num_tokens;
        self.seqs.insert(seq, s)?;
        self.note_usage();
        // Nothing leaves the window here: the prompt's own queries, computed in the
        // step after this call, read it from position 0.
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
        self.one_group("append")?;
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
    /// use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
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
        self.one_group("reserve")?;
        self.reserve_inner(seq, n, lookahead, false, None, slots, copies)
            .map(|_| ())
    }

    /// Marks `n` of the tokens reserved by [`Self::reserve`] as computed (their K/V is
    /// written): `n` is the accepted part, the rest of the reservation (rejected drafts)
    /// is dropped and its slots are reserved again by the next call. Full computed
    /// blocks whose token ids are known are registered in the prefix cache now.
    /// `commit(seq, 0)` cancels a reservation. Returns the blocks registered.
    ///
    /// With several reservations outstanding ([`Self::reserve_ahead`]) this commits the
    /// oldest; the later ones are rebased onto the new computed count (see there).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is swapped out
    /// or has a swap in flight; [`Error::CommitPastReservation`] when `n` is more than
    /// the (oldest) reservation. Nothing changed on error.
    pub fn commit(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        if let Some(h) = &mut self.hybrid {
            return h.commit(seq, n);
        }
        let h = self.handle(seq)?;
        self.commit_at(h, n)
    }

    /// Reserves `n` query tokens plus `lookahead` slots for a step scheduled before
    /// the outstanding steps of `seq` are committed (asynchronous scheduling, several
    /// pipeline micro-batches in flight): the new reservation goes on top of them, its
    /// query tokens at positions `computed + scheduled..` (every outstanding query token
    /// assumed accepted). With none outstanding it is [`Self::reserve`].
    ///
    /// Commits take the reservations oldest first. A commit that accepts fewer tokens
    /// than its reservation held (rejected drafts) **rebases** the later reservations:
    /// their query tokens now start at the new computed count, so their slots are
    /// those of the positions after it: read them again with [`Self::slots`]
    /// (`computed..computed + n`), or compute them on the device from the block table,
    /// which does not change (the slots were allocated by the first reservation). The
    /// context of a step is everything before its last query token, as the batch views
    /// report it (`computed + every outstanding query token`).
    ///
    /// A reservation ahead takes no token ids (they are the outputs of steps not
    /// finished yet): [`Self::add_token_ids`] gives them later, and registration in the
    /// prefix cache waits for them. [`Self::cancel`] drops every outstanding
    /// reservation; `truncate`, fork, swap and preemption refuse a sequence holding one.
    ///
    /// ```
    /// use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
    /// let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    /// kv.admit(SeqId(1), 10, &mut slots)?;
    /// kv.reserve(SeqId(1), 3, 0, &mut slots, &mut copies)?;       // step N: 1 + 2 drafts
    /// kv.reserve_ahead(SeqId(1), 1, 0, &mut slots, &mut copies)?; // step N+1, at 13
    /// assert_eq!(kv.num_reservations(SeqId(1))?, 2);
    /// assert_eq!(kv.context_len(SeqId(1))?, 14);
    /// kv.commit(SeqId(1), 2)?;                    // step N: one draft rejected
    /// kv.slots(SeqId(1), 12..13, &mut slots)?;    // step N+1's rebased slot
    /// assert_eq!(kv.context_len(SeqId(1))?, 13);
    /// kv.commit(SeqId(1), 1)?;
    /// assert_eq!(kv.num_computed_tokens(SeqId(1))?, 13);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Self::reserve`]; [`Error::SequenceState`] when a reservation is outstanding
    /// and `n` is 0. [`Error::NotOnHybrid`] on a cache of several groups. Nothing
    /// changed on error.
    pub fn reserve_ahead(
        &mut self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        self.one_group("reserve_ahead")?;
        slots.clear();
        let h = self.handle(seq)?;
        self.reserve_at(h, n, lookahead, false, None, slots, copies, true)
            .map(|_| ())
    }

    /// Outstanding (uncommitted) reservations of `seq`.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn num_reservations(&self, seq: SeqId) -> Result<usize> {
        if let Some(h) = &self.hybrid {
            return h.num_reservations(seq);
        }
        let s = self.seq(seq)?;
        Ok(match s.scheduled {
            0 => 0,
            _ => 1 + s.num_later(),
        })
    }

    /// Cancels every outstanding reservation of `seq` (as `commit(seq, 0)` for each):
    /// its computed tokens stay, its reserved slots stay allocated for the next
    /// reservation. What to call for a sequence a scheduler drops from its in-flight
    /// steps. Returns the blocks registered (a pending duplicate settled).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is swapped out
    /// or has a swap in flight. Nothing changed on error.
    pub fn cancel(&mut self, seq: SeqId) -> Result<usize> {
        let mut registered = self.commit(seq, 0)?;
        while self.num_reservations(seq)? > 0 {
            registered += self.commit(seq, 0)?;
        }
        Ok(registered)
    }

    /// [`Self::commit`] by handle.
    pub(crate) fn commit_at(&mut self, h: SeqHandle, n: usize) -> Result<usize> {
        let (seq, s) = self.seqs.at(h).ok_or(Error::StaleHandle(h))?;
        swap::check_resident(seq, s)?;
        let oldest = s.oldest_scheduled();
        if n > oldest {
            return Err(Error::CommitPastReservation {
                seq,
                committed: n,
                reserved: oldest,
            });
        }
        let bs = self.block_size();
        let s = self.seqs.at_mut(h).ok_or(Error::StaleHandle(h))?;
        s.computed += n;
        // The reservations on top of it, if any, now start at the new computed count
        // (rebased: their slots are those of the positions after it).
        s.scheduled -= oldest;
        if let Some(q) = s.later.as_deref_mut() {
            q.pop_front();
        }
        prefix::commit_step_ids(s, bs);
        let computed = s.computed;
        let mut registered = prefix::extend_chain_in(&mut self.prefix, bs, s);
        if s.twin_pending {
            // The step's K/V is written: share the cached copies of its duplicates.
            registered += self.settle_twin(h, usize::MAX)?;
        }
        // The step is computed: the next query sits at `computed`.
        self.release_out_of_window(h, computed)?;
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
        if let Some(h) = &self.hybrid {
            return h.pages_needed(seq, n, lookahead);
        }
        let s = self.resident(seq)?;
        let target = self.reserve_target(s, n, lookahead)?;
        Ok(self.reserve_cost(s, target).0)
    }

    /// [`Self::blocks_needed`] of a one-group cache, from the end of `seq`'s
    /// outstanding reservations when `ahead` (what [`Self::reserve_ahead`] takes),
    /// else from its computed tokens.
    pub(crate) fn blocks_needed_from_end(
        &self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        ahead: bool,
    ) -> Result<usize> {
        let s = self.resident(seq)?;
        let base = if ahead {
            s.computed + s.scheduled
        } else {
            s.computed
        };
        let target = self.reserve_target_from(base, n, lookahead)?;
        Ok(self.reserve_cost(s, target).0)
    }

    /// Blocks the reservations of `batch`, each `(seq, n, lookahead)`, take from the
    /// pool when made in that order by [`Self::reserve`] (the need of a step, for
    /// [`Self::num_available_blocks`] or [`Self::preempt_for`]). Unlike a sum of
    /// [`Self::blocks_needed`], it follows copy-on-write through the batch: fork
    /// siblings that share a last block each copy it until one holder is left, and
    /// that last one writes in place (unless the block is registered in the prefix
    /// cache), so `k` siblings take `k - 1` copies, not `k`. When the count fits the
    /// available blocks, every reservation of the batch, in order, fits too.
    ///
    /// ```
    /// use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
    /// let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    /// kv.admit(SeqId(1), 10, &mut slots)?;
    /// kv.fork(SeqId(1), SeqId(2))?; // both share the partly filled block
    /// assert_eq!(kv.blocks_needed(SeqId(1), 1, 0)? + kv.blocks_needed(SeqId(2), 1, 0)?, 2);
    /// let batch = [(SeqId(1), 1, 0), (SeqId(2), 1, 0)];
    /// assert_eq!(kv.blocks_needed_batch(&batch)?, 1); // one copy; the last writes in place
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// What [`Self::blocks_needed`] returns for any entry;
    /// [`Error::DuplicateInBatch`] when a sequence is listed twice (its second
    /// reservation would be refused).
    pub fn blocks_needed_batch(&self, batch: &[(SeqId, usize, usize)]) -> Result<usize> {
        // References the batch's earlier copies let go of, by block.
        let mut let_go: HashMap<BlockId, u32> = HashMap::new();
        let mut seen = std::collections::HashSet::with_capacity(batch.len());
        let mut total = 0usize;
        for &(seq, n, lookahead) in batch {
            if !seen.insert(seq) {
                return Err(Error::DuplicateInBatch(seq));
            }
            let s = self.resident(seq)?;
            let target = self.reserve_target(s, n, lookahead)?;
            total += self.batch_cost(s, target, &mut let_go);
        }
        Ok(total)
    }

    /// One reservation's part of [`Self::blocks_needed_batch`]: its blocks, given the
    /// references the batch's earlier copies let go of (`let_go`, updated).
    pub(crate) fn batch_cost(
        &self,
        s: &Sequence,
        target: usize,
        let_go: &mut HashMap<BlockId, u32>,
    ) -> usize {
        let (new_blocks, written) = self.reserve_span(s, target);
        let mut cost = new_blocks;
        for &b in written {
            let holders = self
                .pool
                .refcount(b)
                .unwrap_or(0)
                .saturating_sub(let_go.get(&b).copied().unwrap_or(0));
            if holders > 1 || self.prefix.is_registered(b) {
                // Replaced by a fresh block; this holder lets go of the old one.
                cost += 1;
                *let_go.entry(b).or_insert(0) += 1;
            }
        }
        // A twin settled first gives a block back (see `reserve_cost`); counted on
        // today's holders, so an earlier sibling's settling only adds room.
        let frees = if s.twin_pending {
            self.twin_frees(s)
        } else {
            0
        };
        cost.saturating_sub(frees)
    }

    /// Tokens of `seq` whose K/V is written (committed).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn num_computed_tokens(&self, seq: SeqId) -> Result<usize> {
        if let Some(h) = &self.hybrid {
            return h.num_computed_tokens(seq);
        }
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
        if let Some(h) = &self.hybrid {
            return h.context_len(seq);
        }
        let s = self.seq(seq)?;
        Ok(s.computed + s.scheduled)
    }

    /// The end of a reservation of `n + lookahead` tokens after the computed ones.
    pub(crate) fn reserve_target(&self, s: &Sequence, n: usize, lookahead: usize) -> Result<usize> {
        self.reserve_target_from(s.computed, n, lookahead)
    }

    /// The end of a reservation of `n + lookahead` tokens from position `base`.
    #[inline]
    pub(crate) fn reserve_target_from(
        &self,
        base: usize,
        n: usize,
        lookahead: usize,
    ) -> Result<usize> {
        target_within(base, n, lookahead, self.max_seq_len())
    }

    /// Blocks a reservation up to `target` takes, and the first table index it writes.
    /// Blocks from that index on that are shared or registered are replaced: copied
    /// when they hold computed tokens, taken fresh otherwise.
    ///
    /// The count is net of a pending twin the reservation settles first (see
    /// `manager/prefix.rs`): sharing a live cached copy gives the sequence's own
    /// block back.
    pub(crate) fn reserve_cost(&self, s: &Sequence, target: usize) -> (usize, usize) {
        let (new_blocks, written) = self.reserve_span(s, target);
        let replaced = written.iter().filter(|&&b| self.is_protected(b)).count();
        let cost = new_blocks + replaced;
        if s.twin_pending {
            (cost.saturating_sub(self.twin_frees(s)), replaced)
        } else {
            (cost, replaced)
        }
    }

    /// The blocks a reservation up to `target` appends, and the blocks of the table
    /// it writes into (from the first uncomputed one): the one place both
    /// [`Self::reserve_cost`] and [`Self::blocks_needed_batch`] read them from.
    pub(crate) fn reserve_span<'s>(
        &self,
        s: &'s Sequence,
        target: usize,
    ) -> (usize, &'s [BlockId]) {
        let first = self.layout.block_index(s.computed);
        let new_len = target.max(s.num_tokens);
        let new_blocks = self.layout.blocks_for_tokens(new_len) - s.table.len();
        let written_end = self.layout.blocks_for_tokens(target).min(s.table.len());
        (new_blocks, s.table.get(first..written_end).unwrap_or(&[]))
    }

    /// Shared (by a fork or a prefix hit) or registered: writes must go elsewhere.
    #[inline]
    fn is_protected(&self, b: BlockId) -> bool {
        self.pool.refcount(b).unwrap_or(0) > 1 || self.prefix.is_registered(b)
    }

    /// The one slot-handing path, by id: [`Self::reserve_at`] after one lookup at the
    /// edge. Clears `slots` first.
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
        let h = self.handle(seq)?;
        if commit_now && lookahead == 0 {
            if let Some(registered) = self.append_in_last_block(h, n, tokens, slots) {
                return Ok(registered);
            }
        }
        self.reserve_at(h, n, lookahead, commit_now, tokens, slots, copies, false)
    }

    /// [`Self::reserve_at`] of `n` query tokens (no lookahead) in the common case of
    /// [`Self::in_last_block`], or `None`, having changed nothing.
    /// `max_len` is [`Self::max_seq_len`], read once per step.
    #[inline(always)]
    pub(crate) fn reserve_in_last_block(
        &mut self,
        h: SeqHandle,
        n: usize,
        tokens: Option<&[u32]>,
        max_len: usize,
    ) -> Option<InLastBlock> {
        self.in_last_block(h, n, tokens, false, max_len)
    }

    /// [`Self::commit_at`] of a sequence already checked (resident, `n` at most its
    /// reservation) that holds one reservation, has no twin to settle and no window
    /// block to give back: the accepted tokens become computed and, where its ids
    /// are tracked, the blocks they complete register (what `commit_at` does then,
    /// without its second look-up and window pass). Returns the blocks registered,
    /// or `None`, having changed nothing, when the general path is needed.
    ///
    /// # Errors
    /// Only on a corrupt manager (a twin found by the registration fails to settle).
    #[inline(always)]
    pub(crate) fn commit_plain(&mut self, h: SeqHandle, n: usize) -> Result<Option<usize>> {
        let (window, bs) = (self.window, self.block_size());
        let KvCache { seqs, prefix, .. } = self;
        let s = match seqs.at_mut(h) {
            Some(s) if commits_plainly(window, bs, s, n) => s,
            _ => return Ok(None),
        };
        s.computed += n;
        s.scheduled = 0;
        if s.prefix.is_none() {
            return Ok(Some(0));
        }
        prefix::commit_step_ids(s, bs);
        let registered = prefix::extend_chain_in(prefix, bs, s);
        if s.twin_pending {
            // The step's K/V is written: share the cached copies of its duplicates.
            return Ok(Some(registered + self.settle_twin(h, usize::MAX)?));
        }
        Ok(Some(registered))
    }

    /// The common decode step, in place: `n` committed tokens that all land in the
    /// sequence's own last block (see [`Self::in_last_block`]); appends their slots to
    /// `slots` and returns the blocks registered, or `None`, having changed nothing,
    /// when the call needs the general path (which also reports every error).
    #[inline(always)]
    fn append_in_last_block(
        &mut self,
        h: SeqHandle,
        n: usize,
        tokens: Option<&[u32]>,
        slots: &mut Vec<Slot>,
    ) -> Option<usize> {
        let InLastBlock {
            first, registered, ..
        } = self.in_last_block(h, n, tokens, true, self.max_seq_len())?;
        if n == 1 {
            // The decode step: a push, not the general extend (a third of the path's
            // instructions under callgrind).
            slots.push(Slot(first));
        } else {
            slots.extend((first..first + n as u64).map(Slot));
        }
        Some(registered)
    }

    /// `n` tokens that all land in the sequence's own last block, which already holds
    /// computed tokens and is neither shared nor registered (so no block is taken,
    /// copied or released and no window moves): what [`Self::reserve_at`] does in
    /// that case, without its general bookkeeping (cost count, replacement scan,
    /// block loop). With `commit` they are computed at once (with their ids, when
    /// given); without, they are this step's reservation (its ids marked as the
    /// step's). Returns what it did ([`InLastBlock`]), or `None`, having changed
    /// nothing, when the general path is needed.
    #[inline(always)]
    fn in_last_block(
        &mut self,
        h: SeqHandle,
        n: usize,
        tokens: Option<&[u32]>,
        commit: bool,
        max_len: usize,
    ) -> Option<InLastBlock> {
        let KvCache {
            layout,
            pool,
            prefix,
            seqs,
            live_token_slots,
            window,
            ..
        } = self;
        let bs = layout.block_size();
        let s = seqs.at_mut(h)?;
        let (off, end, last) = in_last_block_span(layout, *window, max_len, s, n)?;
        // Private (refcount 1) and its fill come from one record of the pool.
        let fill = pool.private_fill_mut(last)?;
        if prefix.is_registered(last) {
            return None;
        }
        let first = layout.slot(last, 0).0 + off as u64;
        let filled = off + n;
        if usize::from(*fill) < filled {
            *live_token_slots += filled - usize::from(*fill);
            *fill = filled as u16;
        }
        s.num_tokens = end;
        if commit {
            if let Some(ids) = tokens {
                prefix::record_ids(s, ids, bs);
            }
            s.computed = end;
        } else {
            s.scheduled = n;
            match tokens {
                Some(ids) => prefix::record_step_ids(prefix, false, s, ids, bs),
                None => prefix::forget_step_ids(s),
            }
        }
        // Without token ids there is nothing to register: skip the call.
        let registered = if s.prefix.is_some() {
            prefix::extend_chain_in(prefix, bs, s)
        } else {
            0
        };
        Some(InLastBlock {
            first,
            registered,
            end,
            released: s.released,
        })
    }

    /// Whether [`Self::in_last_block`] serves `n` tokens of sequence `h` now (the same
    /// conditions, changing nothing): a hybrid cache asks every group before any
    /// group appends.
    #[inline]
    pub(crate) fn fits_in_last_block(&self, h: SeqHandle, n: usize) -> bool {
        let Some((_, s)) = self.seqs.at(h) else {
            return false;
        };
        in_last_block_span(&self.layout, self.window, self.max_seq_len(), s, n).is_some_and(
            |(_, _, last)| {
                self.pool.refcount(last).is_ok_and(|r| r == 1) && !self.prefix.is_registered(last)
            },
        )
    }

    /// The one slot-handing path: reserve `n + lookahead` slots after the computed
    /// tokens of the sequence `h` names, then commit the `n` at once when `commit_now`
    /// (with their ids when `tokens` is given). With `ahead`, a sequence holding
    /// reservations gets one more on top of them (after their query tokens, no ids:
    /// see [`Self::reserve_ahead`]). Appends the slots to `slots` (not cleared). Reaches the sequence by index and changes it in place (split borrows
    /// of the manager's fields); only a copy-on-write takes it out of its slot, so that
    /// the release of the old block does not count this sequence among its holders.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reserve_at(
        &mut self,
        h: SeqHandle,
        n: usize,
        lookahead: usize,
        commit_now: bool,
        tokens: Option<&[u32]>,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
        ahead: bool,
    ) -> Result<usize> {
        let (seq, s) = self.seqs.at(h).ok_or(Error::StaleHandle(h))?;
        swap::check_resident(seq, s)?;
        let stacked = s.scheduled > 0;
        if stacked {
            check_stack(seq, ahead, n, commit_now || tokens.is_some())?;
        }
        // The reservation's first query: after the outstanding ones' query tokens.
        let base = s.computed + s.scheduled;
        let target = self.reserve_target_from(base, n, lookahead)?;
        let (needed, replaced) = self.reserve_cost(s, target);
        let twin = s.twin_pending;
        if needed > 0 {
            self.ensure_available(needed)?;
        }
        // Every step below succeeds: `ensure_available` reserved enough blocks, net of
        // what settling one twin gives back (with no spare block it takes none, and it
        // replaces a full computed block, outside the span this reservation writes).
        let mut registered = 0;
        if twin {
            registered += self.settle_twin(h, 1)?;
        }
        let bs = self.block_size();
        if replaced > 0 {
            self.replace_protected(h, target, copies)?;
        }
        let windowed = self.window.is_some();
        let table_capacity = self.config.table_capacity_blocks;
        let KvCache {
            layout,
            pool,
            prefix,
            seqs,
            live_token_slots,
            peak_used_blocks,
            ..
        } = self;
        let s = seqs.at_mut(h).ok_or(Error::StaleHandle(h))?;
        let new_len = target.max(s.num_tokens);
        let want = layout.blocks_for_tokens(new_len);
        if s.table.len() < want {
            if s.table.capacity() < want {
                s.table.reserve(want.max(table_capacity) - s.table.len());
            }
            while s.table.len() < want {
                s.table.push(alloc_block_in(pool, prefix)?);
            }
            *peak_used_blocks = (*peak_used_blocks).max(pool.num_live());
        }
        // Slots of the reserved positions; fills count every allocated slot.
        push_slots(
            layout,
            &s.table,
            base..target,
            slots,
            pool,
            live_token_slots,
        );
        s.num_tokens = new_len;
        match tokens {
            // A reservation on top of others takes no ids (checked): the outstanding
            // ones' ids stay theirs.
            _ if stacked => {}
            Some(ids) if !commit_now => prefix::record_step_ids(prefix, windowed, s, ids, bs),
            Some(ids) => {
                prefix::start_tracking(prefix, windowed, s, ids);
                prefix::record_ids(s, ids, bs);
            }
            None => prefix::forget_step_ids(s),
        }
        // The oldest outstanding step's first query: the engine computes the step
        // after this call, and a window keeps what that step reads.
        let first_query = s.computed;
        if commit_now {
            s.computed += n;
        } else if stacked {
            s.scheduled += n;
            s.later.get_or_insert_default().push_back(n);
        } else {
            s.scheduled = n;
        }
        registered += prefix::extend_chain_in(prefix, bs, s);
        if windowed {
            self.release_out_of_window(h, first_query)?;
        }
        Ok(registered)
    }

    /// Copy-on-write before a reservation up to `target`: every block from the first
    /// uncomputed one up to `target` that is shared or registered is replaced by a
    /// fresh block (copied when it holds computed tokens). The caller checked that the
    /// blocks are available.
    fn replace_protected(
        &mut self,
        h: SeqHandle,
        target: usize,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        let bs = self.block_size();
        self.tables_changed();
        // Out of its slot while old blocks are released: a release that recounts a
        // block's holders must not count this sequence.
        let mut s = self.seqs.take(h).ok_or(Error::StaleHandle(h))?;
        let first = s.computed / bs;
        let written_end = self.layout.blocks_for_tokens(target).min(s.table.len());
        let mut result = Ok(());
        for i in first..written_end {
            let old = s.table[i];
            if !self.is_protected(old) {
                continue;
            }
            let new = match self.alloc_block() {
                Ok(b) => b,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            if s.computed > i * bs {
                copies.push(old, new);
            }
            // The new block holds this sequence's allocated slots of that block.
            let fill = s.num_tokens.saturating_sub(i * bs).min(bs);
            if let Some(f) = self.pool.fill_mut(new) {
                *f = fill as u16;
            }
            self.live_token_slots += fill;
            s.table[i] = new;
            if let Err(e) = self.release_block(old) {
                result = Err(e);
                break;
            }
        }
        self.seqs.put(h, s);
        result
    }

    /// Extends `s` to `new_len` tokens over blocks already in its table, emitting slots.
    fn fill_tokens(&mut self, s: &mut Sequence, new_len: usize, slots: &mut Vec<Slot>) {
        fill_slots(
            &self.layout,
            s,
            new_len,
            slots,
            &mut self.pool,
            &mut self.live_token_slots,
        );
    }

    /// The block table of `seq`: bookkeeping (it is there, in flight or not, while the
    /// sequence has device blocks). To read the bytes behind it, use
    /// [`Self::readable_blocks`].
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        if let Some(g0) = self.first_group() {
            return g0.block_table(seq);
        }
        Ok(&self.seq(seq)?.table)
    }

    /// The one predicate for reading a sequence's K/V bytes (export, batch views,
    /// attention inputs): the blocks that hold its computed tokens and their number.
    /// A sequence is readable when it has device blocks and no swap in flight: a
    /// swap-in's bytes have not landed, a swap-out's blocks are about to be freed.
    /// Under a sliding window the leading entries may be [`BlockId::RELEASED`]: only
    /// blocks before the window of the next query are.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when it is swapped out or
    /// has a swap in flight.
    pub fn readable_blocks(&self, seq: SeqId) -> Result<(&[BlockId], usize)> {
        if let Some(g0) = self.first_group() {
            return g0.readable_blocks(seq);
        }
        let s = self.resident(seq)?;
        let blocks = self.layout.blocks_for_tokens(s.computed);
        Ok((&s.table[..blocks], s.computed))
    }

    /// Allocated token slots of `seq` (on the device or swapped out): computed tokens,
    /// this step's reserved ones and lookahead slots.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        if let Some(g0) = self.first_group() {
            return g0.num_tokens(seq);
        }
        match self.tiers.swapped.get(&seq) {
            Some(swapped) => Ok(swapped.num_tokens),
            None => Ok(self.seq(seq)?.num_tokens),
        }
    }

    /// Whether `seq` is known (on the device or swapped out).
    pub fn contains(&self, seq: SeqId) -> bool {
        if let Some(h) = &self.hybrid {
            return h.contains(seq);
        }
        self.seqs.contains_key(&seq) || self.tiers.swapped.contains_key(&seq)
    }

    /// Ids of the sequences that have a device block table (resident, or with a swap
    /// in flight), in no particular order.
    pub fn sequence_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        let hybrid = self.hybrid.is_some();
        let kv = self.first_group().unwrap_or(self);
        kv.seqs
            .keys()
            .copied()
            .filter(move |&s| !(hybrid && groups::is_hidden(s)))
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
        self.one_group("slots")?;
        slots.clear();
        let s = self.seq(seq)?;
        if range.end > s.num_tokens {
            return Err(Error::PastEnd {
                seq,
                end: range.end,
                len: s.num_tokens,
            });
        }
        if range.start < s.released * self.block_size() && !range.is_empty() {
            return Err(Error::SequenceState {
                seq,
                state: "holding no blocks for those positions (given back by the window)",
                needed: "positions inside the sliding window",
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
        if let Some(h) = &self.hybrid {
            return h.cache_stats();
        }
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
        if let Some(h) = &mut self.hybrid {
            return h.take_peak_used_pages();
        }
        let peak = self.peak_used_blocks.max(self.pool.num_live());
        self.peak_used_blocks = self.pool.num_live();
        peak
    }

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        if let Some(g0) = self.first_group() {
            return g0.pool();
        }
        &self.pool
    }

    // ---- the three places blocks enter and leave tables -------------------------

    /// Fails unless `needed` blocks can be obtained now.
    pub(crate) fn ensure_available(&self, needed: usize) -> Result<()> {
        let free = self.num_available_blocks();
        if needed > free {
            return Err(Error::OutOfBlocks { needed, free });
        }
        Ok(())
    }

    /// Takes one block for a table, evicting a cached block when none is free.
    pub(crate) fn alloc_block(&mut self) -> Result<BlockId> {
        alloc_block_in(&mut self.pool, &mut self.prefix)
    }

    /// Drops one table reference to each of `table`'s blocks, last first (a table
    /// taken out of the slab). Every block is processed; the first error is returned
    /// (it means the manager's own state was corrupt).
    pub(crate) fn release_table(&mut self, table: &[BlockId]) -> Result<()> {
        let mut first_error = None;
        for &b in table.iter().rev() {
            self.release_block_inline(b, &mut first_error);
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Drops one table reference to `b`; a registered block is kept cached at zero.
    /// Whether it is registered is a flag read, not an index lookup.
    #[inline]
    pub(crate) fn release_block(&mut self, b: BlockId) -> Result<()> {
        let mut error = None;
        self.release_block_inline(b, &mut error);
        error.map_or(Ok(()), Err)
    }

    /// [`Self::release_block`], inlined into the table loop of a free. An error goes
    /// to `first_error` out of line (unless one is there already), so the loop carries
    /// no `Result` (keeping one in registers spilled the loop's state).
    #[inline(always)]
    fn release_block_inline(&mut self, b: BlockId, first_error: &mut Option<Error>) {
        // Whether the block is registered matters only when its last reference goes.
        let prefix = &self.prefix;
        let (rc, kept, fill) = match self.pool.release(b, || prefix.is_registered(b)) {
            Ok(r) => r,
            Err(e) => return note_first_error(first_error, e),
        };
        if rc == 0 {
            self.live_token_slots -= usize::from(fill);
            self.fill_dirty.remove(&b);
            if kept {
                self.prefix.on_cached(b);
            }
        } else if self.fill_dirty.contains(&b) {
            self.recount_fill(b, rc);
        }
    }

    /// A holder let go of shared block `b`, whose holders hold different lengths: it
    /// may have held the most, so recount (the caller has taken it out of the slab).
    #[cold]
    fn recount_fill(&mut self, b: BlockId, rc: u32) {
        let want = self.holders_fill(b);
        self.set_fill(b, want);
        if rc == 1 {
            self.fill_dirty.remove(&b);
        }
    }

    /// The most slots any sequence in the map holds in block `b` (a scan of every
    /// table: only for the rare shared blocks of `fill_dirty`).
    fn holders_fill(&self, b: BlockId) -> usize {
        let bs = self.block_size();
        self.seqs
            .values()
            .flat_map(|s| {
                s.table
                    .iter()
                    .enumerate()
                    .filter(move |(_, &x)| x == b)
                    .map(move |(i, _)| s.num_tokens.saturating_sub(i * bs).min(bs))
            })
            .max()
            .unwrap_or(0)
            .max(if self.tiers.host_cache.holds_device(b) {
                bs
            } else {
                0
            })
    }

    /// Sets the fill of live block `b`, keeping `live_token_slots` in step.
    pub(crate) fn set_fill(&mut self, b: BlockId, fill: usize) {
        if let Some(f) = self.pool.fill_mut(b) {
            let old = usize::from(std::mem::replace(f, fill as u16));
            self.live_token_slots = self.live_token_slots - old + fill;
        }
    }

    fn note_usage(&mut self) {
        self.peak_used_blocks = self.peak_used_blocks.max(self.pool.num_live());
    }
}

/// Keeps the first of a loop's errors (out of line: only a corrupt manager gets here).
#[cold]
#[inline(never)]
fn note_first_error(first_error: &mut Option<Error>, e: Error) {
    first_error.get_or_insert(e);
}

/// Takes one block for a table, evicting a cached block when none is free (split
/// borrows: callers hold a sequence of the slab meanwhile).
#[inline]
fn alloc_block_in(pool: &mut BlockPool, prefix: &mut PrefixIndex) -> Result<BlockId> {
    if pool.num_free() == 0 {
        let victim = prefix
            .pop_victim()
            .ok_or(Error::OutOfBlocks { needed: 1, free: 0 })?;
        pool.evict(victim)?;
    }
    let b = pool.allocate()?;
    if let Some(f) = pool.fill_mut(b) {
        *f = 0;
    }
    Ok(b)
}

/// Extends `s` to `new_len` tokens over blocks already in its table, emitting slots and
/// keeping the per-block fill counts (split borrows, so the hot path needs no `&mut self`).
fn fill_slots(
    layout: &KvLayout,
    s: &mut Sequence,
    new_len: usize,
    slots: &mut Vec<Slot>,
    pool: &mut BlockPool,
    live_token_slots: &mut usize,
) {
    push_slots(
        layout,
        &s.table,
        s.num_tokens..new_len,
        slots,
        pool,
        live_token_slots,
    );
    s.num_tokens = new_len;
}

/// Pushes the slots of positions `range` of `table` and raises each block's fill to
/// cover them. Block by block: per token only the slot is written.
#[inline]
fn push_slots(
    layout: &KvLayout,
    table: &[BlockId],
    range: std::ops::Range<usize>,
    slots: &mut Vec<Slot>,
    pool: &mut BlockPool,
    live_token_slots: &mut usize,
) {
    slots.reserve(range.len());
    let bs = layout.block_size();
    let mut pos = range.start;
    while pos < range.end {
        let b = table[layout.block_index(pos)];
        let off = layout.block_offset(pos);
        let end = (off + (range.end - pos)).min(bs);
        let base = layout.slot(b, 0).0;
        slots.extend((off..end).map(|o| Slot(base + o as u64)));
        if let Some(fill) = pool.fill_mut(b) {
            if usize::from(*fill) < end {
                *live_token_slots += end - usize::from(*fill);
                *fill = end as u16;
            }
        }
        pos += end - off;
    }
}
