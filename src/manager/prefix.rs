//! The manager's prefix-cache entry points; the index itself is [`crate::pool::prefix`].
//!
//! Contract with the engine:
//! - A block is registered (findable by other requests) as soon as the call that fills
//!   it returns, as in vLLM v1: the engine must write the K/V of every slot it was
//!   given in the step that follows, before any other step reads them. Another request
//!   admitted in the same step may already share the block; engines that write the
//!   cache of the whole batch before attention (`reshape_and_cache`, then attention,
//!   per layer) satisfy this.
//! - At least one prompt token is always left to compute (the engine needs its
//!   logits), so hits are capped at `(len - 1) / block_size` whole blocks. When a
//!   whole prompt of whole blocks hits, its last block is recomputed into a fresh block
//!   rather than shared and copied: no copy plan at admission, at the price of
//!   `block_size - 1` extra tokens of prefill.
//! - A full block equal to one already registered (two requests filling the same
//!   content independently) is a *duplicate*: it is not registered, and the sequence
//!   stops registering from there on, because a later block can only be found through
//!   a parent the sequence holds. Counted in [`PrefixStats::duplicate_blocks`].

use super::{KvCacheManager, Sequence};
use crate::error::{Error, Result};
use crate::ids::{BlockId, PinId, SeqId};
use crate::layout::plans::CopyPlan;
use crate::layout::Slot;
use crate::pool::prefix::index::{Namespace, PrefixIndex};
use crate::pool::prefix::{
    Admission, AdmitOptions, BlockHash, PinnedPrefix, PrefixConfig, PrefixEvent, PrefixStats,
};
use crate::pool::BlockState;

/// A sequence's progress through the prefix cache: its leading `chain` blocks are
/// registered (by it or before it), `last` is the hash of the last of them, and
/// `pending` holds the token ids written after them (fewer than a block).
#[derive(Debug, Clone)]
pub(crate) struct SeqPrefix {
    ns: Namespace,
    priority: i32,
    chain: usize,
    last: Option<BlockHash>,
    pending: Vec<u32>,
}

impl KvCacheManager {
    /// A manager whose prefix cache is tuned by `prefix` ([`KvCacheManager::new`] uses
    /// [`PrefixConfig::for_arena`]).
    ///
    /// # Errors
    /// As [`KvCacheManager::new`]; [`Error::InvalidConfig`] when
    /// `prefix.max_pinned_blocks` exceeds the arena.
    pub fn with_prefix_config(
        layout: crate::layout::KvLayout,
        config: super::CacheConfig,
        prefix: PrefixConfig,
    ) -> Result<Self> {
        let mut kv = Self::new(layout, config)?;
        kv.prefix = PrefixIndex::new(config.num_blocks, layout.block_size(), prefix)?;
        Ok(kv)
    }

    /// The prefix-cache configuration.
    pub fn prefix_config(&self) -> &PrefixConfig {
        self.prefix.config()
    }

    /// Admits `seq` with prompt `tokens`, sharing the longest cached prefix, and writes
    /// the slots of the *uncached* tokens (`tokens[cached_tokens..]`) into `slots`
    /// (cleared first). Full blocks of the prompt are registered for later requests.
    ///
    /// Hits are confirmed against the stored token ids, the chain of parents and the
    /// namespace (`opts.cache_salt`, `opts.extra_key`), so a hash collision is a miss.
    /// At least one token is left to compute; see the module docs of `manager::prefix`
    /// for the exact contract.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, CacheConfig, DType, KvCacheManager, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 2, num_q_heads: 8, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::BF16 };
    /// let mut kv = KvCacheManager::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
    /// let system: Vec<u32> = (0..40).collect();
    /// let mut slots = Vec::new();
    /// let opts = AdmitOptions::default();
    ///
    /// let a = kv.admit_tokens(SeqId(1), &system, &opts, &mut slots)?;
    /// assert_eq!((a.cached_tokens, slots.len()), (0, 40));
    /// kv.free(SeqId(1))?;                          // its 2 full blocks stay cached
    ///
    /// let b = kv.admit_tokens(SeqId(2), &system, &opts, &mut slots)?;
    /// assert_eq!((b.cached_tokens, slots.len()), (32, 8)); // only the tail is computed
    ///
    /// let tenant = AdmitOptions { cache_salt: b"tenant-b", ..opts };
    /// let c = kv.admit_tokens(SeqId(3), &system, &tenant, &mut slots)?;
    /// assert_eq!(c.cached_tokens, 0);               // other namespace: nothing shared
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::DuplicateSequence`], [`Error::TooLong`], [`Error::PrefixKeyTooLong`],
    /// [`Error::OutOfBlocks`]; on error nothing changed (`slots` may have been cleared).
    pub fn admit_tokens(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
        slots: &mut Vec<Slot>,
    ) -> Result<Admission> {
        slots.clear();
        if self.seqs.contains_key(&seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let len = tokens.len();
        if len > self.max_seq_len() {
            return Err(Error::TooLong {
                tokens: len,
                limit: self.max_seq_len(),
            });
        }
        let ns = self.prefix.namespace(opts)?;
        let bs = self.block_size();
        let total = self.layout.blocks_for_tokens(len);
        let mut table = Vec::with_capacity(total + 1);
        let found = self
            .prefix
            .lookup(&ns, tokens, len.saturating_sub(1) / bs, &mut table);
        let cached_blocks = table.len();
        let revived = self.count_evictable(&table);
        self.ensure_available(total - cached_blocks + revived)?;

        // Commit. Nothing below fails unless the manager's own state is corrupt: the
        // hits are registered (live or cached) and `ensure_available` covered both the
        // revivals and the new blocks.
        for &b in &table {
            let revive = self.pool.state(b)? == BlockState::Cached;
            if revive {
                self.pool.revive(b)?;
                self.block_fill[b.index()] = bs as u16;
                self.live_token_slots += bs;
            } else {
                self.pool.incref(b)?;
            }
            self.prefix.on_hit(b, opts.priority, revive);
        }
        self.prefix.note_query(len, cached_blocks, found.collision);
        for _ in cached_blocks..total {
            let b = self.alloc_block()?;
            table.push(b);
        }
        let mut s = Sequence {
            table,
            num_tokens: cached_blocks * bs,
            prefix: Some(Box::new(SeqPrefix {
                ns,
                priority: opts.priority,
                chain: cached_blocks,
                last: found.last,
                pending: Vec::with_capacity(bs),
            })),
            admission: self.tiers.next_admission(),
            ..Sequence::default()
        };
        self.fill_tokens(&mut s, len, slots);
        let registered = self.extend_chain(&mut s, &tokens[cached_blocks * bs..]);
        self.seqs.insert(seq, s);
        self.note_usage();
        Ok(Admission {
            cached_tokens: cached_blocks * bs,
            cached_blocks,
            new_blocks: total - cached_blocks,
            registered_blocks: registered,
        })
    }

    /// Appends `tokens` to `seq` as [`Self::append`] does (slots into `slots`,
    /// copy-on-write into `copies`) and registers every block they fill, when `seq` was
    /// admitted with [`Self::admit_tokens`] and has not been extended without ids
    /// since.
    ///
    /// # Errors
    /// As [`Self::append`]; nothing changed on error.
    pub fn append_tokens(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> Result<()> {
        self.append_inner(seq, tokens.len(), Some(tokens), slots, copies)
    }

    /// Leading tokens of `tokens` that [`Self::admit_tokens`] would serve from the cache
    /// now. Changes nothing (no counters either).
    ///
    /// # Errors
    /// [`Error::PrefixKeyTooLong`].
    pub fn cached_prefix_len(&self, tokens: &[u32], opts: &AdmitOptions<'_>) -> Result<usize> {
        let ns = self.prefix.namespace(opts)?;
        let mut hits = Vec::new();
        let bs = self.block_size();
        self.prefix
            .lookup(&ns, tokens, tokens.len().saturating_sub(1) / bs, &mut hits);
        Ok(hits.len() * bs)
    }

    /// Whether [`Self::admit_tokens`] of `tokens` would succeed now while keeping the
    /// watermark: cached hits are not counted as needed, and a hit that would revive an
    /// evictable block is counted once (it stops being available).
    pub fn can_admit_tokens(&self, tokens: &[u32], opts: &AdmitOptions<'_>) -> bool {
        let Ok(ns) = self.prefix.namespace(opts) else {
            return false;
        };
        if tokens.len() > self.max_seq_len() {
            return false;
        }
        let mut hits = Vec::new();
        let bs = self.block_size();
        self.prefix
            .lookup(&ns, tokens, tokens.len().saturating_sub(1) / bs, &mut hits);
        let needed =
            self.layout.blocks_for_tokens(tokens.len()) - hits.len() + self.count_evictable(&hits);
        needed + self.config.watermark_blocks <= self.num_available_blocks()
    }

    /// Pins the cached prefix `tokens` (whole blocks; a trailing partial block is
    /// ignored) so that it is never evicted until [`Self::unpin_prefix`]. Pinned blocks
    /// that nobody references are kept but no longer count as available.
    ///
    /// # Errors
    /// [`Error::PrefixKeyTooLong`]; [`Error::PrefixNotCached`] when not every whole
    /// block of `tokens` is cached (or there is none); [`Error::PinLimit`] past
    /// [`PrefixConfig::max_pinned_blocks`]. Nothing changed on error.
    pub fn pin_prefix(&mut self, tokens: &[u32], opts: &AdmitOptions<'_>) -> Result<PinnedPrefix> {
        let ns = self.prefix.namespace(opts)?;
        let bs = self.block_size();
        let want = tokens.len() / bs;
        let mut chain = Vec::with_capacity(want);
        let found = self.prefix.lookup(&ns, tokens, want, &mut chain);
        let last = match found.last {
            Some(last) if want > 0 && chain.len() == want => last,
            _ => {
                return Err(Error::PrefixNotCached {
                    requested_tokens: tokens.len(),
                    cached_tokens: chain.len() * bs,
                })
            }
        };
        let id = self.prefix.pin(&chain, last)?;
        Ok(PinnedPrefix {
            id,
            tokens: want * bs,
            blocks: want,
        })
    }

    /// Releases a pin; its blocks become evictable again once nothing else pins or
    /// references them.
    ///
    /// # Errors
    /// [`Error::UnknownPin`] for a pin never taken or already released; nothing changed.
    pub fn unpin_prefix(&mut self, pin: PinId) -> Result<()> {
        self.prefix.unpin(pin).map(|_| ())
    }

    /// Evicts up to `max_blocks` evictable cached blocks now (leaves first, in policy
    /// order) and returns how many went. Before shrinking the arena, or to drop a
    /// tenant's cache.
    pub fn evict_cached(&mut self, max_blocks: usize) -> usize {
        let mut n = 0;
        while n < max_blocks && self.evict_one().is_ok() {
            n += 1;
        }
        n
    }

    /// Prefix-cache counters now.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix.stats(self.pool.num_cached())
    }

    /// Moves the [`PrefixEvent`]s recorded since the last call into `out` (recorded
    /// only with [`PrefixConfig::record_events`]).
    pub fn drain_prefix_events(&mut self, out: &mut Vec<PrefixEvent>) {
        self.prefix.drain_events(out);
    }

    // ---- hooks called from `manager/mod.rs` ---------------------------------------

    /// Cached blocks among `blocks` that count as available (so reviving them uses
    /// availability up).
    fn count_evictable(&self, blocks: &[BlockId]) -> usize {
        blocks
            .iter()
            .filter(|&&b| self.pool.state(b) == Ok(BlockState::Cached) && !self.prefix.is_pinned(b))
            .count()
    }

    /// Evicts the policy's next victim to the free list.
    pub(crate) fn evict_one(&mut self) -> Result<()> {
        let b = self
            .prefix
            .pop_victim()
            .ok_or(Error::OutOfBlocks { needed: 1, free: 0 })?;
        self.pool.evict(b)
    }

    /// After `s` grew: registers the blocks `tokens` filled, or stops registering when
    /// the ids are unknown (`None`: a plain `append`).
    pub(crate) fn prefix_after_append(&mut self, s: &mut Sequence, tokens: Option<&[u32]>) {
        match tokens {
            None => s.prefix = None,
            Some(t) => {
                self.extend_chain(s, t);
            }
        }
    }

    /// After `s` was truncated to `new_len`: the chain and pending ids follow.
    pub(crate) fn prefix_after_truncate(&mut self, s: &mut Sequence, new_len: usize) {
        let bs = self.block_size();
        let Some(p) = s.prefix.as_deref_mut() else {
            return;
        };
        let chain_tokens = p.chain * bs;
        if new_len >= chain_tokens {
            p.pending.truncate(new_len - chain_tokens);
            return;
        }
        let keep = new_len / bs;
        p.chain = keep;
        p.pending.clear();
        p.last = match keep {
            0 => None,
            k => s.table.get(k - 1).and_then(|&b| self.prefix.hash_of(b)),
        };
        let tail = new_len % bs;
        // The new last block is a registered block of the chain; its ids are known.
        let tail_ids = match s.table.get(keep) {
            Some(&b) if tail > 0 && self.prefix.is_registered(b) => {
                self.prefix.block_tokens(b).get(..tail)
            }
            _ => Some(&[][..]),
        };
        match tail_ids {
            Some(ids) if keep == 0 || p.last.is_some() => p.pending.extend_from_slice(ids),
            _ => s.prefix = None,
        }
    }

    /// Feeds token ids written after `s`'s chain and registers every block they fill;
    /// returns how many were registered.
    fn extend_chain(&mut self, s: &mut Sequence, mut new: &[u32]) -> usize {
        let bs = self.block_size();
        let Some(mut p) = s.prefix.take() else {
            return 0;
        };
        let mut registered = 0;
        let mut ok = true;
        if !p.pending.is_empty() {
            let take = (bs - p.pending.len()).min(new.len());
            p.pending.extend_from_slice(&new[..take]);
            new = &new[take..];
            if p.pending.len() == bs {
                let ids = std::mem::take(&mut p.pending);
                ok = self.register_next(&s.table, &mut p, &ids);
                p.pending = ids;
                p.pending.clear();
                registered += usize::from(ok);
            }
        }
        let mut chunks = new.chunks_exact(bs);
        for chunk in &mut chunks {
            if !ok {
                break;
            }
            ok = self.register_next(&s.table, &mut p, chunk);
            registered += usize::from(ok);
        }
        if ok {
            p.pending.extend_from_slice(chunks.remainder());
            s.prefix = Some(p);
        }
        registered
    }

    /// Registers `table[p.chain]`, now full with `ids`, as the next link of the chain.
    fn register_next(&mut self, table: &[BlockId], p: &mut SeqPrefix, ids: &[u32]) -> bool {
        let Some(&b) = table.get(p.chain) else {
            return false;
        };
        // The chain must still be what this sequence holds (a swap or move elsewhere
        // may have replaced blocks).
        if p.chain > 0
            && table
                .get(p.chain - 1)
                .and_then(|&pb| self.prefix.hash_of(pb))
                != p.last
        {
            return false;
        }
        let hash = self.prefix.hasher().block(p.last.unwrap_or(p.ns.seed), ids);
        if !self
            .prefix
            .register(b, hash, p.last, &p.ns, ids, p.priority)
        {
            return false;
        }
        p.chain += 1;
        p.last = Some(hash);
        true
    }

    /// The prefix half of [`Self::check_invariants`]: the index against the pool, and
    /// every tracked sequence's chain against its table.
    pub(crate) fn check_prefix_invariants(&self) -> std::result::Result<(), String> {
        self.prefix.check(&self.pool)?;
        let bs = self.block_size();
        for (id, s) in &self.seqs {
            let Some(p) = s.prefix.as_deref() else {
                continue;
            };
            if p.chain > s.table.len() || p.pending.len() >= bs {
                return Err(format!(
                    "{id}: chain {} over {} blocks, {} pending ids",
                    p.chain,
                    s.table.len(),
                    p.pending.len()
                ));
            }
            if p.chain * bs + p.pending.len() != s.num_tokens {
                return Err(format!(
                    "{id}: chain {} + {} pending ids but {} tokens",
                    p.chain,
                    p.pending.len(),
                    s.num_tokens
                ));
            }
            let mut parent = None;
            for (i, &b) in s.table[..p.chain].iter().enumerate() {
                if self.prefix.parent_of(b) != Some(parent) {
                    return Err(format!(
                        "{id}: block {i} ({b}) is not linked into its chain"
                    ));
                }
                parent = self.prefix.hash_of(b);
            }
            if parent != p.last {
                return Err(format!(
                    "{id}: chain ends at {parent:?}, recorded {:?}",
                    p.last
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::ids::{BlockId, SeqId};
    use crate::layout::shape::{DType, ModelShape};
    use crate::layout::KvLayout;
    use crate::manager::{CacheConfig, KvCacheManager};
    use crate::pool::prefix::AdmitOptions;

    fn kv(num_blocks: usize) -> KvCacheManager {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 1,
            num_kv_heads: 1,
            head_dim: 2,
            kv_dtype: DType::F32,
        };
        KvCacheManager::new(
            KvLayout::new(shape, 4).unwrap(),
            CacheConfig::new(num_blocks),
        )
        .unwrap()
    }

    /// The hook defragmentation calls after moving a registered block's data.
    #[test]
    fn relocated_blocks_stay_findable() {
        let mut kv = kv(8);
        let mut slots = Vec::new();
        let prompt: Vec<u32> = (0..9).collect();
        let opts = AdmitOptions::default();
        kv.admit_tokens(SeqId(1), &prompt, &opts, &mut slots)
            .unwrap();
        kv.free(SeqId(1)).unwrap();
        let (first, dst) = (BlockId(0), BlockId(7));
        kv.pool.relocate(first, dst).unwrap();
        kv.prefix.relocate(first, dst).unwrap();
        kv.check_invariants().unwrap();
        assert!(kv.prefix.relocate(BlockId(1), dst).is_err());
        let a = kv
            .admit_tokens(SeqId(2), &prompt, &opts, &mut slots)
            .unwrap();
        assert_eq!(a.cached_tokens, 8);
        assert_eq!(kv.block_table(SeqId(2)).unwrap()[0], dst);
        kv.check_invariants().unwrap();
        // Shrinking past a registered block is refused; past free ones it follows.
        assert!(kv.prefix.resize(7).is_err());
        kv.free(SeqId(2)).unwrap();
        assert_eq!(kv.evict_cached(usize::MAX), 2);
        kv.prefix.resize(4).unwrap();
        kv.pool.resize(4).unwrap();
        kv.block_fill.truncate(4);
        kv.check_invariants().unwrap();
    }
}
