//! The hybrid side of the one front door: a [`KvCache`] over several KV-cache groups
//! (full attention, sliding window, latent), built by [`KvCache::hybrid`], and the
//! `_grouped` calls that hand out every group's slots. Those calls serve a one-group
//! cache too (one entry per group buffer), so an engine written against them runs
//! every model.
//!
//! A hybrid cache keeps no tables of its own: its calls go to its groups (each a
//! one-group `KvCache`, see `manager/groups/` for the page lending between them).
//! The calls of the one-group API that are not yet carried across groups refuse with
//! [`Error::NotOnHybrid`], naming the call; none of them answers for one group alone
//! where the answer would be the whole cache's.

use crate::error::{Error, Result};
use crate::ids::SeqId;
use crate::pool::prefix::index::PrefixIndex;
use crate::pool::prefix::{Admission, AdmitOptions, PrefixConfig};

use super::groups::{
    CheckpointPolicy, GroupSpec, GroupStats, GroupStep, GroupSwapJob, Groups, PendingGroupDefrag,
    STORE_JOB,
};
use super::{CacheConfig, KvCache};

impl KvCache {
    /// A hybrid model's cache: one group per spec, each with its own block tables,
    /// drawing pages from one arena of `num_pages` pages (every group's block is one
    /// page; see the [hybrid guide](crate::guide::hybrid)). Every page starts owned by
    /// group 0 and moves to the group that needs it.
    ///
    /// ```
    /// use pagedkv::{DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// // One global and one local (window 32) group of 2 layers each: equal pages.
    /// let shape = ModelShape { num_layers: 2, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::BF16 };
    /// let layout = KvLayout::new(shape, 16)?;
    /// let mut kv = KvCache::hybrid(&[GroupSpec::full(layout), GroupSpec::window(layout, 32)], 64)?;
    /// let mut step = GroupStep::default();
    /// kv.admit_grouped(SeqId(1), 100, &mut step)?;     // 7 pages in each group
    /// assert_eq!(step.slots[0].len(), 100);
    /// for _ in 0..100 {
    ///     kv.append_grouped(SeqId(1), 1, &mut step)?;  // the window group gives pages back
    /// }
    /// let st = kv.group_stats();
    /// assert_eq!(st.used_per_group, vec![13, 3]);
    /// assert_eq!(kv.group(1).block_table(SeqId(1))?.len(), 13); // holes before the window
    /// kv.fork(SeqId(1), SeqId(2))?;                     // lifecycle calls serve every cache
    /// kv.free(SeqId(1))?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when there is no group, more than 255, no page, or the
    /// groups' page bytes (`layout.block_bytes()`) differ; a window of 0 tokens.
    pub fn hybrid(specs: &[GroupSpec], num_pages: usize) -> Result<Self> {
        Self::hybrid_with_host_tier(specs, num_pages, 0)
    }

    /// [`Self::hybrid`] with a host tier of `num_host_blocks` blocks, shared by every
    /// group as the arena is (a host block belongs to one group at a time and moves to
    /// the group that needs it), for [`Self::swap_out_grouped`] and
    /// [`Self::swap_in_grouped`].
    ///
    /// # Errors
    /// As [`Self::hybrid`]; [`Error::InvalidConfig`] when the host tier does not fit
    /// `u32` ids.
    pub fn hybrid_with_host_tier(
        specs: &[GroupSpec],
        num_pages: usize,
        num_host_blocks: usize,
    ) -> Result<Self> {
        Self::hybrid_with_prefix(
            specs,
            num_pages,
            num_host_blocks,
            &PrefixConfig::for_arena(num_pages),
        )
    }

    /// [`Self::hybrid_with_host_tier`] whose groups' prefix caches take `prefix` (see
    /// [`Self::hybrid_builder`], the way in for every option).
    pub(crate) fn hybrid_with_prefix(
        specs: &[GroupSpec],
        num_pages: usize,
        num_host_blocks: usize,
        prefix: &PrefixConfig,
    ) -> Result<Self> {
        let mut groups = Groups::with_host_tier(specs, num_pages, num_host_blocks)?;
        for g in 0..groups.num_groups() {
            let kv = groups.group_mut(g);
            // No sequence is admitted yet: each group's index starts over with `prefix`.
            kv.prefix = PrefixIndex::new(num_pages, kv.layout.block_size(), prefix.clone())?;
            // At most 255 groups (checked by `with_host_tier`).
            kv.prefix.set_group(g as u8);
        }
        let first = specs[0].layout;
        // The shell's own tables stay empty: one block, never handed out.
        let mut kv = KvCache::new(
            first,
            CacheConfig {
                watermark_blocks: 0,
                ..CacheConfig::new(1)
            },
        )?;
        kv.hybrid = Some(Box::new(groups));
        Ok(kv)
    }

    /// Keeps `blocks` free at admission ([`Self::can_admit`]), so running sequences can
    /// grow without an immediate preemption (for one group, `watermark_blocks` of the
    /// config).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `blocks` is not below the arena.
    pub fn with_watermark_blocks(mut self, blocks: usize) -> Result<Self> {
        match self.hybrid.take() {
            Some(h) => {
                self.hybrid = Some(Box::new(h.with_watermark(blocks)?));
            }
            None => {
                if blocks >= self.num_blocks() {
                    return Err(Error::config(
                        "watermark_blocks",
                        format!("{blocks} must be below num_blocks {}", self.num_blocks()),
                    ));
                }
                self.config.watermark_blocks = blocks;
            }
        }
        Ok(self)
    }

    /// Room each block table makes at once, in every group
    /// ([`super::CacheConfig::table_capacity_blocks`]; for one group, the config's):
    /// with the longest sequence's blocks, the step path allocates nothing once the
    /// sequences are admitted.
    pub fn with_table_capacity_blocks(mut self, blocks: usize) -> Self {
        match &mut self.hybrid {
            Some(h) => {
                for g in 0..h.num_groups() {
                    h.group_mut(g).config.table_capacity_blocks = blocks;
                }
            }
            None => self.config.table_capacity_blocks = blocks,
        }
        self
    }

    /// KV-cache groups: 1 unless built by [`Self::hybrid`].
    pub fn num_groups(&self) -> usize {
        self.hybrid.as_ref().map_or(1, |h| h.num_groups())
    }

    /// Whether the cache has several groups ([`Self::hybrid`]).
    pub fn is_hybrid(&self) -> bool {
        self.hybrid.is_some()
    }

    /// Group `g`, read-only: its block tables, batch views (`fill_padded`, `fill_csr`),
    /// `readable_blocks`. A one-group cache is its own group 0. A hybrid group's own
    /// `stats` and `sequence_ids` count the hidden sequence that holds the pages other
    /// groups own; use [`Self::group_stats`] instead.
    ///
    /// # Panics
    /// When `g >= num_groups()`.
    pub fn group(&self, g: usize) -> &KvCache {
        match &self.hybrid {
            Some(h) => h.group(g),
            None => {
                assert!(g == 0, "group {g} of a one-group cache");
                self
            }
        }
    }

    /// The pages every sequence holds in group `g` when it is a recurrent-state group
    /// ([`GroupSpec::state`]; its table of a sequence is the sequence's state pages);
    /// `None` for a KV group, a one-group cache, or past the groups.
    pub fn group_state_pages(&self, g: usize) -> Option<usize> {
        self.hybrid.as_ref().and_then(|h| h.state_pages(g))
    }

    /// Forks `parent` into `child` in every group and hands out the copies the fork
    /// needs: a KV group shares every block (copy-on-write on the next write, as
    /// [`Self::fork`]; `step.copies[g]` empty), a recurrent-state group
    /// ([`GroupSpec::state`]) gives the child state pages of its own and puts a copy of
    /// each parent page into the child's in `step.copies[g]`: run them before the
    /// child's next step. A state page is never shared, since every step writes the
    /// state in place. `step.slots` are left empty. On a cache without a state group
    /// this is [`Self::fork`] with no copies.
    ///
    /// ```
    /// use pagedkv::{DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 8,
    ///                          kv_dtype: DType::BF16 };
    /// let l = KvLayout::new(shape, 16)?;
    /// // An attention group and a recurrent group whose state takes 3 pages a sequence.
    /// let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::state(l, 3)], 64)?;
    /// let mut step = GroupStep::default();
    /// kv.admit_grouped(SeqId(1), 40, &mut step)?;           // 3 + 3 pages
    /// assert!(step.slots[1].is_empty());                     // no K/V slot in a state group
    /// let state = kv.group(1).block_table(SeqId(1))?.to_vec(); // where the kernel finds it
    /// assert_eq!(state.len(), 3);
    /// kv.fork_grouped(SeqId(1), SeqId(2), &mut step)?;
    /// assert!(step.copies[0].is_empty());                    // KV blocks shared
    /// assert_eq!(step.copies[1].len(), 3);                   // state copied page by page
    /// assert_eq!(kv.group_stats().used_per_group, vec![3, 6]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Self::fork`]; [`Error::OutOfBlocks`] with the state pages needed and the
    /// arena's free pages. Nothing changed on error.
    pub fn fork_grouped(
        &mut self,
        parent: SeqId,
        child: SeqId,
        step: &mut GroupStep,
    ) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.fork_copying(parent, child, step),
            None => {
                step.one_group();
                self.fork(parent, child)
            }
        }
    }

    /// Checkpoints the state of `seq` for prefix caching: when the cache has a
    /// recurrent-state group ([`GroupSpec::state`]), `seq` holds no reservation, its
    /// computed tokens end on a block boundary of group 0 and that block is
    /// registered in group 0's prefix cache (the sequence was admitted or extended
    /// with token ids), the state after those tokens is copied into pages the cache
    /// owns: `step.copies[g]` of each state group, to run **after** the step that
    /// computed those tokens wrote the state and before the sequence's next step
    /// changes it. Returns whether a checkpoint was made (false, with no copies,
    /// when any condition fails, or when one exists already at that prefix).
    ///
    /// A later [`Self::admit_tokens_grouped`] of a prompt that extends the prefix
    /// resumes from the deepest position where the attention groups' cached chain
    /// reaches and a checkpoint sits at exactly that position: its `cached_tokens`
    /// stop there, and `step.copies[g]` copies the checkpoint into the new sequence's
    /// state pages. Checkpoint pages count as free (as cached pages do): the least
    /// recently used is evicted when the arena needs pages. Under a
    /// [`CheckpointPolicy`] with `turn_end`, the sequence keeps one rolling
    /// checkpoint, overwritten in place at each call that makes one (the copies then
    /// write over its pages), and the admission checkpoints itself
    /// ([`Self::set_checkpoint_policy`]). [`Self::admit_prompt_grouped`]
    /// (which hands out no copies) serves no hit on a cache with a state group, nor
    /// does a cache that also has a window group or attention groups of another
    /// block size than group 0's.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape,
    ///               SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 8,
    ///                          kv_dtype: DType::BF16 };
    /// let l = KvLayout::new(shape, 16)?;
    /// let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::state(l, 2)], 64)?;
    /// let (opts, mut step) = (AdmitOptions::default(), GroupStep::default());
    /// let prompt: Vec<u32> = (0..32).collect();
    /// kv.admit_tokens_grouped(SeqId(1), &prompt, &opts, &mut step)?; // the engine computes it
    /// assert!(kv.checkpoint_grouped(SeqId(1), &mut step)?);        // state after 32 tokens
    /// assert_eq!(step.copies[1].len(), 2);
    /// let longer: Vec<u32> = (0..40).collect();
    /// let a = kv.admit_tokens_grouped(SeqId(2), &longer, &opts, &mut step)?;
    /// assert_eq!(a.cached_tokens, 32);            // resumes from the checkpoint
    /// assert_eq!(step.copies[1].len(), 2);        // checkpoint -> the new state pages
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is swapped out,
    /// has a swap in flight or holds a reservation; [`Error::OutOfBlocks`] when the
    /// arena has no room for the checkpoint even after evicting the others. Nothing
    /// changed on error.
    pub fn checkpoint_grouped(&mut self, seq: SeqId, step: &mut GroupStep) -> Result<bool> {
        match &mut self.hybrid {
            Some(h) => h.checkpoint(seq, step),
            None => {
                step.one_group();
                self.resident(seq).map(|_| false)
            }
        }
    }

    /// Sets where the cache checkpoints its recurrent state on its own (see
    /// [`CheckpointPolicy`] and the [hybrid guide](crate::guide::hybrid)): at
    /// admission ([`Self::admit_tokens_grouped`] hands the checkpoints out in
    /// [`GroupStep::checkpoints`]), and whether [`Self::checkpoint_grouped`] keeps one
    /// rolling checkpoint per sequence (the turn end's). The checkpoints held stay.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, CheckpointPolicy, DType, GroupSpec, GroupStep, KvCache,
    ///               KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 8,
    ///                          kv_dtype: DType::BF16 };
    /// let l = KvLayout::new(shape, 16)?;
    /// let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::state(l, 2)], 64)?;
    /// kv.set_checkpoint_policy(CheckpointPolicy::chat(4))?;
    /// let (opts, mut step) = (AdmitOptions::default(), GroupStep::default());
    /// let prompt: Vec<u32> = (0..40).collect();
    /// kv.admit_tokens_grouped(SeqId(1), &prompt, &opts, &mut step)?;
    /// // Compute tokens 0..32, run the copies, compute 32..40.
    /// assert_eq!(step.checkpoints.len(), 1);
    /// assert_eq!(step.checkpoints[0].position, 32);
    /// assert_eq!(step.checkpoints[0].copies[1].len(), 2);
    /// for t in 40..48 {                               // decode to the next block boundary
    ///     kv.append_tokens_grouped(SeqId(1), &[t], &mut step)?;
    ///     kv.checkpoint_grouped(SeqId(1), &mut step)?; // rolling: true at 48 only
    /// }
    /// kv.free(SeqId(1))?;                              // 48 stays: the turn end
    /// let next: Vec<u32> = (0..60).collect();
    /// let a = kv.admit_tokens_grouped(SeqId(2), &next, &opts, &mut step)?;
    /// assert_eq!(a.cached_tokens, 48);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] without a recurrent-state group (a one-group cache
    /// included), with `max_per_chain` 0, or `every_tokens` not a multiple of group
    /// 0's block size. Nothing changed on error.
    pub fn set_checkpoint_policy(&mut self, policy: CheckpointPolicy) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.set_checkpoint_policy(policy),
            None => Err(Error::config(
                "checkpoint policy",
                "the cache has no recurrent-state group",
            )),
        }
    }

    /// The checkpoint policy ([`Self::set_checkpoint_policy`]; the default on a cache
    /// without a state group).
    pub fn checkpoint_policy(&self) -> CheckpointPolicy {
        self.hybrid
            .as_ref()
            .map_or_else(CheckpointPolicy::default, |h| h.checkpoint_policy())
    }

    /// State checkpoints held for prefix caching ([`Self::checkpoint_grouped`]).
    pub fn num_state_checkpoints(&self) -> usize {
        self.hybrid.as_ref().map_or(0, |h| h.num_checkpoints())
    }

    /// Bytes of one block (a page: every group's block has this size).
    pub fn block_bytes(&self) -> usize {
        self.group(0).layout.block_bytes()
    }

    /// Blocks admitting a prompt of `num_tokens` takes, all groups together.
    pub fn admission_blocks(&self, num_tokens: usize) -> usize {
        match &self.hybrid {
            Some(h) => h.admit_pages(num_tokens),
            None => self.layout.blocks_for_tokens(num_tokens),
        }
    }

    /// One past the highest block any group holds (used or cached): equal to the held
    /// blocks in a compact arena. O(blocks), a monitoring call.
    pub fn high_water_blocks(&self) -> usize {
        match &self.hybrid {
            Some(h) => h.high_water(),
            None => self.fragmentation().high_water_blocks,
        }
    }

    /// Admits `seq` with a prompt of `num_tokens` tokens in every group; `step.slots[g]`
    /// gets the slots of every prompt token in group `g` (see [`Self::admit`]).
    ///
    /// # Errors
    /// [`Error::DuplicateSequence`], [`Error::TooLong`], [`Error::OutOfBlocks`] (with the
    /// blocks all groups need and the arena's free blocks). Nothing changed on error.
    pub fn admit_grouped(
        &mut self,
        seq: SeqId,
        num_tokens: usize,
        step: &mut GroupStep,
    ) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.admit(seq, num_tokens, step),
            None => {
                let (slots, _) = step.one_group();
                self.admit(seq, num_tokens, slots)
            }
        }
    }

    /// Admits `seq` with prompt `tokens` in every group, sharing the cached prefix every
    /// group holds, and schedules the whole uncached rest in this step (see
    /// [`Self::admit_tokens`]; for a hybrid cache, [`crate::guide::hybrid`] says which
    /// group serves which hit): `step.slots[g]` gets the slots of
    /// `tokens[cached_tokens..]` in group `g`. `cached_tokens` is common to all groups;
    /// `cached_blocks`, `new_blocks` and `registered_blocks` are summed over them.
    /// Under a [`CheckpointPolicy`], `step.checkpoints` lists the state checkpoints to
    /// take inside the step (see [`Self::set_checkpoint_policy`]); a checkpoint the
    /// arena has no room for is skipped, the admission stands.
    ///
    /// # Errors
    /// [`Error::DuplicateSequence`], [`Error::TooLong`], [`Error::PrefixKeyTooLong`],
    /// [`Error::OutOfBlocks`]. Nothing changed on error.
    pub fn admit_tokens_grouped(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
        step: &mut GroupStep,
    ) -> Result<Admission> {
        match &mut self.hybrid {
            Some(h) => h.admit_tokens(seq, tokens, opts, step),
            None => {
                let (slots, _) = step.one_group();
                self.admit_tokens(seq, tokens, opts, slots)
            }
        }
    }

    /// The chunked-prefill admission of every cache: admits `seq` with the prefix of
    /// prompt `tokens` that every group serves from its prefix cache, computed, and
    /// the prompt's ids recorded; nothing is reserved for the rest. The engine then
    /// reserves the rest chunk by chunk ([`Self::reserve_grouped`]) and commits each
    /// ([`Self::commit`]), which registers the full blocks it completes (see
    /// [`Self::admit_prompt`]; for one group, [`Self::lookup_prefix`] then
    /// [`Self::admit_prompt`]). Only the cached pages the hit revives (and, for a
    /// host hit, the pages it loads into) are checked against the arena: check the
    /// first chunk with [`Self::blocks_needed`].
    ///
    /// With a host level ([`Self::set_host_cache`]; full and latent groups of one block
    /// size), the hit goes on into every group's host level after the device part
    /// every group holds: `cached_tokens` is that device part and `loading_tokens` the
    /// host part, which the sequence loads ([`Self::load_job_grouped`]) before it can
    /// step. With a disk level ([`Self::set_disk_cache`], `groups/disk_level.rs`), the
    /// hit goes on past every group's host part into its disk index, as far as the host
    /// tier can stage it (free blocks, and entries the load does not read, evicted);
    /// `loading_tokens` counts that part too, staged first
    /// ([`Self::disk_load_job_grouped`], [`Self::mark_disk_load_staged_grouped`]).
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape,
    ///               SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 8,
    ///                          kv_dtype: DType::BF16 };
    /// let l = KvLayout::new(shape, 16)?;
    /// let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::full(l)], 64)?;
    /// let (prompt, opts, mut step) = ((0..100).collect::<Vec<u32>>(), AdmitOptions::default(),
    ///                                 GroupStep::default());
    /// kv.admit_prompt_grouped(SeqId(1), &prompt, &opts)?;
    /// kv.reserve_grouped(SeqId(1), 40, 0, &mut step)?;  // the first chunk, in every group
    /// assert_eq!(kv.commit(SeqId(1), 40)?, 2 * 2);       // 2 full blocks in each group
    /// let a = kv.admit_prompt_grouped(SeqId(2), &prompt, &opts)?;
    /// assert_eq!(a.cached_tokens, 32);                   // computed blocks only
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::DuplicateSequence`], [`Error::TooLong`], [`Error::PrefixKeyTooLong`],
    /// [`Error::OutOfBlocks`] (for the revived pages). Nothing changed on error.
    pub fn admit_prompt_grouped(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
    ) -> Result<Admission> {
        match &mut self.hybrid {
            Some(h) => h.admit_prompt(seq, tokens, opts),
            None => {
                let mut hit = super::PrefixHit::default();
                self.lookup_prefix(tokens, opts, &mut hit)?;
                self.admit_prompt(seq, tokens, &hit)
            }
        }
    }

    /// Admits `seq` with `num_tokens` tokens, all computed, whose first `holes[g]`
    /// blocks in group `g` are holes (blocks a window group gave back): `step.slots[g]`
    /// gets the slots of the tokens after the holes, which the caller writes. For an
    /// import ([`crate::export::groups`]); registers nothing in a prefix cache.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `holes` does not have one entry per group, or a
    /// group has holes it could not have; as [`Self::admit_grouped`]. Nothing changed
    /// on error.
    pub(crate) fn admit_with_holes_grouped(
        &mut self,
        seq: SeqId,
        num_tokens: usize,
        holes: &[usize],
        step: &mut GroupStep,
    ) -> Result<()> {
        if let Some(h) = &mut self.hybrid {
            return h.admit_with_holes(seq, num_tokens, holes, step);
        }
        let most = self.first_block_in_window(num_tokens);
        let (slots, _) = step.one_group();
        match *holes {
            [h] if h <= most => self.admit_holed(seq, num_tokens, h, slots),
            [h] => Err(Error::ShapeMismatch {
                what: "hole blocks of a group (at most those before its window)",
                expected: most,
                got: h,
            }),
            _ => Err(Error::ShapeMismatch {
                what: "hole counts (one per group)",
                expected: 1,
                got: holes.len(),
            }),
        }
    }

    /// Appends and commits `n` tokens of `seq` in every group (see [`Self::append`]).
    ///
    /// # Errors
    /// As [`Self::reserve_grouped`]. Nothing changed on error.
    pub fn append_grouped(&mut self, seq: SeqId, n: usize, step: &mut GroupStep) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.append(seq, n, step),
            None => {
                let (slots, copies) = step.one_group();
                self.append(seq, n, slots, copies)
            }
        }
    }

    /// Appends and commits `tokens` to `seq` in every group and records their ids, so
    /// that every full computed block is registered in the prefix caches of the full
    /// and latent groups (see [`Self::append_tokens`]).
    ///
    /// # Errors
    /// As [`Self::append_grouped`]. Nothing changed on error.
    pub fn append_tokens_grouped(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        step: &mut GroupStep,
    ) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.append_tokens(seq, tokens, step),
            None => {
                let (slots, copies) = step.one_group();
                self.append_tokens(seq, tokens, slots, copies)
            }
        }
    }

    /// Reserves slots for the next `n` tokens of `seq` plus `lookahead` in every group
    /// (see [`Self::reserve`]); [`Self::commit`] marks the computed ones.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::SequenceState`] (swapped out, or holding
    /// an uncommitted reservation), [`Error::TooLong`], [`Error::OutOfBlocks`] with the
    /// blocks all groups need. Nothing changed on error.
    pub fn reserve_grouped(
        &mut self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        step: &mut GroupStep,
    ) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.reserve(seq, n, lookahead, step),
            None => {
                let (slots, copies) = step.one_group();
                self.reserve(seq, n, lookahead, slots, copies)
            }
        }
    }

    /// [`Self::reserve_ahead`] in every group of the cache: reserves the next `n`
    /// query tokens of `seq` plus `lookahead` on top of its outstanding reservations
    /// (the per-sequence form of [`Self::reserve_step_ahead_grouped`]; a state group
    /// reserves nothing). Commits take the reservations oldest first.
    ///
    /// ```
    /// use pagedkv::{DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 8,
    ///                          kv_dtype: DType::BF16 };
    /// let l = KvLayout::new(shape, 16)?;
    /// let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::window(l, 32)], 64)?;
    /// let mut step = GroupStep::default();
    /// kv.admit_grouped(SeqId(1), 40, &mut step)?;
    /// kv.reserve_grouped(SeqId(1), 1, 0, &mut step)?;        // step N
    /// kv.reserve_ahead_grouped(SeqId(1), 1, 0, &mut step)?;  // step N+1, before N commits
    /// assert_eq!(kv.num_reservations(SeqId(1))?, 2);
    /// kv.commit(SeqId(1), 1)?;
    /// kv.commit(SeqId(1), 1)?;
    /// assert_eq!(kv.num_computed_tokens(SeqId(1))?, 42);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Self::reserve_grouped`], except that outstanding reservations are allowed
    /// (then `n` must be at least 1). Nothing changed on error.
    pub fn reserve_ahead_grouped(
        &mut self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        step: &mut GroupStep,
    ) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.reserve_ahead(seq, n, lookahead, step),
            None => {
                let (slots, copies) = step.one_group();
                self.reserve_ahead(seq, n, lookahead, slots, copies)
            }
        }
    }

    /// Plans the swap-out of `seq` in every group at once: each group's plan copies the
    /// blocks the sequence holds there (a window group's holes stay holes) to blocks of
    /// the shared host tier. Execute every plan of the job, then
    /// [`Self::complete_swap_grouped`], or [`Self::abort_swap_grouped`] when a transfer
    /// failed (see [`Self::swap_out`]).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is swapped, has
    /// a swap in flight or holds an uncommitted reservation; [`Error::TierFull`] when
    /// the host tier lacks room for every group's blocks even after evicting the host
    /// level's entries that can go (see [`Self::plan_host_store_grouped`]). Nothing
    /// changed on error.
    pub fn swap_out_grouped(&mut self, seq: SeqId) -> Result<GroupSwapJob> {
        match &mut self.hybrid {
            Some(h) => h.swap_out(seq),
            None => self.swap_out(seq).map(|j| GroupSwapJob::one(seq, j)),
        }
    }

    /// Plans the swap-out of every sequence of `seqs` in every group, one
    /// [`GroupSwapJob`] per sequence (as [`Self::swap_out_grouped`] each), after
    /// checking that the host tier holds all of them: either every job is planned or
    /// none. A block two sequences share (a shared prefix) takes a host block for each
    /// of them and comes back unshared; a one-group cache moves a fork group's shared
    /// blocks once with [`Self::swap_out_group`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an empty list or a repeated id; as
    /// [`Self::swap_out_grouped`], with [`Error::TierFull`] counting every sequence's
    /// blocks. Nothing changed on error.
    pub fn swap_out_each_grouped(&mut self, seqs: &[SeqId]) -> Result<Vec<GroupSwapJob>> {
        match &mut self.hybrid {
            Some(h) => h.swap_out_each(seqs),
            None => {
                super::swap::check_group(seqs)?;
                // Each sequence's blocks against the host tier first, so that no job is
                // planned unless all are (a shared block counted once per sequence).
                let mut total = 0usize;
                for &seq in seqs {
                    let s = self.idle(seq)?;
                    total += s.table.len() - s.released;
                }
                self.make_host_room(total)?;
                super::swap::plan_each(
                    self,
                    seqs,
                    |kv, seq| kv.swap_out(seq).map(|j| GroupSwapJob::one(seq, j)),
                    |kv, job| {
                        let _ = kv.abort_swap_grouped(job);
                    },
                )
            }
        }
    }

    /// Plans the swap-in of swapped-out `seq` in every group at once; execute every
    /// plan, then [`Self::complete_swap_grouped`] or [`Self::abort_swap_grouped`].
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is not swapped
    /// out; [`Error::OutOfBlocks`] with the blocks all groups need. Nothing changed on
    /// error.
    pub fn swap_in_grouped(&mut self, seq: SeqId) -> Result<GroupSwapJob> {
        match &mut self.hybrid {
            Some(h) => h.swap_in(seq),
            None => self.swap_in(seq).map(|j| GroupSwapJob::one(seq, j)),
        }
    }

    /// Finishes both directions of a swap in every group (see [`Self::complete_swap`]).
    ///
    /// # Errors
    /// [`Error::UnknownTicket`] when the job is not in flight;
    /// [`Error::ShapeMismatch`] when it has not one ticket per group (nothing changed).
    pub fn complete_swap_grouped(&mut self, job: &GroupSwapJob) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.complete_swap(job),
            None => self.complete_swap(GroupSwapJob::only_ticket(job)?),
        }
    }

    /// Undoes a swap in every group (see [`Self::abort_swap`]).
    ///
    /// # Errors
    /// As [`Self::complete_swap_grouped`].
    pub fn abort_swap_grouped(&mut self, job: &GroupSwapJob) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.abort_swap(job),
            None => self.abort_swap(GroupSwapJob::only_ticket(job)?),
        }
    }

    /// Plans a store to the host level of the prefix cache in every group (see
    /// [`Self::plan_host_store`] for one group, and `groups/host_level.rs`): each group
    /// gets an even share of the free host blocks and stores at most `max_blocks` of
    /// its registered blocks by the configured policy, evicting its own host entries
    /// leaf first when its share is short. Run every plan of the job (device -> host),
    /// then [`Self::complete_swap_grouped`] (the copies become findable) or
    /// [`Self::abort_swap_grouped`]. The job's `seq` names no sequence
    /// (`SeqId(u64::MAX)`): a store moves cached blocks. `None` when no group has
    /// anything to store or room for it.
    ///
    /// ```
    /// use pagedkv::manager::HostCacheConfig;
    /// use pagedkv::{AdmitOptions, DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape,
    ///               SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 8,
    ///                          kv_dtype: DType::BF16 };
    /// let l = KvLayout::new(shape, 16)?;
    /// let mut kv = KvCache::hybrid_with_host_tier(&[GroupSpec::full(l), GroupSpec::full(l)],
    ///                                             16, 8)?;
    /// kv.set_host_cache(HostCacheConfig::default())?;
    /// let (prompt, opts, mut step) = ((0..40).collect::<Vec<u32>>(), AdmitOptions::default(),
    ///                                 GroupStep::default());
    /// kv.admit_tokens_grouped(SeqId(1), &prompt, &opts, &mut step)?; // 2 full blocks a group
    /// kv.free(SeqId(1))?;
    /// let store = kv.plan_host_store_grouped(8)?.expect("registered blocks to store");
    /// assert_eq!(store.plans.iter().map(|p| p.len()).sum::<usize>(), 4);
    /// // (run every plan: device -> host)
    /// kv.complete_swap_grouped(&store)?;
    /// kv.evict_cached(usize::MAX);                       // gone from the device
    /// let a = kv.admit_prompt_grouped(SeqId(2), &prompt, &opts)?;
    /// assert_eq!((a.cached_tokens, a.loading_tokens), (0, 32));
    /// let load = kv.load_job_grouped(SeqId(2)).expect("a host hit loads");
    /// // (run every plan: host -> device)
    /// kv.complete_swap_grouped(&load)?;
    /// assert_eq!(kv.num_computed_tokens(SeqId(2))?, 32);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] on a hybrid cache with a window or state group. A pool
    /// error means the manager's state was corrupt. Nothing changed on error.
    pub fn plan_host_store_grouped(&mut self, max_blocks: usize) -> Result<Option<GroupSwapJob>> {
        match &mut self.hybrid {
            Some(h) => h.plan_host_store(max_blocks),
            None => Ok(self
                .plan_host_store(max_blocks)?
                .map(|j| GroupSwapJob::one(STORE_JOB, j))),
        }
    }

    /// The load of `seq` in flight in every group, admitted from a host hit by
    /// [`Self::admit_prompt_grouped`] (for one group, [`Self::load_job`]): run every
    /// plan (host -> device), then [`Self::complete_swap_grouped`] (the loaded tokens
    /// are computed in every group) or [`Self::abort_swap_grouped`] (the loaded pages
    /// are freed; the sequence keeps its device part). Until then the sequence is
    /// loading: the calls that read or change its blocks refuse.
    pub fn load_job_grouped(&self, seq: SeqId) -> Option<GroupSwapJob> {
        match &self.hybrid {
            Some(h) => h.load_job(seq),
            None => self.load_job(seq).map(|j| GroupSwapJob::one(seq, j)),
        }
    }

    /// Counters of every group now (for one group, [`Self::stats`] in group terms).
    pub fn group_stats(&self) -> GroupStats {
        match &self.hybrid {
            Some(h) => h.stats(),
            None => {
                let st = self.stats();
                GroupStats {
                    num_pages: st.num_blocks,
                    used_pages: st.used_blocks,
                    free_pages: self.num_available_blocks(),
                    cached_pages: st.cached_blocks,
                    peak_used_pages: st.peak_used_blocks,
                    used_per_group: vec![st.used_blocks],
                    owned_per_group: vec![st.num_blocks],
                    page_moves: 0,
                    num_sequences: st.num_sequences,
                }
            }
        }
    }

    /// Plans a compaction of a hybrid cache's whole arena (see
    /// [`PendingGroupDefrag`]); [`Self::plan_defragment`] makes the same plan with its
    /// options and serves every cache.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a one-group cache.
    pub fn plan_defragment_grouped(&mut self) -> Result<PendingGroupDefrag<'_>> {
        match &mut self.hybrid {
            Some(h) => Ok(h.plan_defragment()),
            None => Err(Error::Unsupported(
                "plan_defragment_grouped on a one-group cache: use plan_defragment".into(),
            )),
        }
    }
}
