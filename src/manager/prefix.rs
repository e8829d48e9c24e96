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
//!   content independently) is a *duplicate*: it is not registered twice (counted in
//!   [`PrefixStats::duplicate_blocks`]); the cached copy stays the one requests find,
//!   and the sequence's chain goes on through it, so its later blocks are registered
//!   as they fill. Should the cached copy be evicted first, the sequence registers its
//!   own copy before the next block. A swapped-in sequence goes on the same way (its
//!   blocks are fresh copies of its chain), and a truncation keeps the chain up to the
//!   new length. Registration never stops while the ids are known.
//!
//! One rule for token ids, whichever call brings them ([`KvCache::admit_tokens`],
//! [`KvCache::admit_prompt`], [`KvCache::append_tokens`],
//! [`KvCache::append_tokens_batch`], [`KvCache::add_token_ids`]): ids are
//! known from position 0 on, without a gap. A sequence admitted without ids
//! ([`KvCache::admit`]) starts tracking, in the default namespace, when the ids
//! of position 0 arrive; ids that would leave a gap (tokens appended without ids came
//! first) are dropped by the appends and refused by `add_token_ids`
//! ([`crate::Error::TokenIdsGap`]), which fills the gap. A sliding-window manager
//! tracks no ids at all (it registers nothing): every call drops them. A full block is
//! registered once it is computed and its ids are known, whichever comes last. The
//! rule is `starts_tracking`, which every call asks.

use super::{KvCache, Sequence};
use crate::error::{Error, Result};
use crate::ids::{BlockId, PinId, SeqHandle, SeqId};
use crate::layout::plans::CopyPlan;
use crate::layout::Slot;
use crate::pool::prefix::index::{BlockKeys, Namespace, PrefixIndex, Registration};
use crate::pool::prefix::{
    Admission, AdmitOptions, BlockDigest, BlockHash, PinnedPrefix, PrefixConfig, PrefixEvent,
    PrefixReset, PrefixStats,
};
use crate::pool::BlockState;

/// A sequence's progress through the prefix cache: its leading `chain` blocks are
/// registered (by it or before it), `last` is the hash of the last of them, and `ids`
/// holds the known token ids from position `chain * block_size` on (a whole prompt
/// after admission, or sampled ids as they arrive). `keys` are the extra keys of its
/// blocks (by block index), so later blocks register with the key of their span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SeqPrefix {
    ns: Namespace,
    keys: BlockKeys,
    priority: i32,
    chain: usize,
    last: Option<BlockHash>,
    ids: Vec<u32>,
    /// Block `chain` duplicates block `.1`, registered under hash `.0`: the sequence
    /// shares that copy in its place once its own block's K/V is surely written
    /// ([`KvCache::settle_twin`]); set together with `Sequence::twin_pending`.
    twin: Option<(BlockHash, BlockId)>,
    /// The ids of the reservation outstanding came with it
    /// ([`KvCache::reserve_step_tokens`]): its commit drops those of the
    /// positions it rejects.
    step_ids: bool,
}

impl SeqPrefix {
    /// Tracking from position 0 in namespace `ns`, no block keys (a sequence admitted
    /// without token ids whose first ids arrive).
    fn starting(ns: Namespace) -> Self {
        SeqPrefix {
            ns,
            keys: BlockKeys::default(),
            priority: 0,
            chain: 0,
            last: None,
            ids: Vec::new(),
            twin: None,
            step_ids: false,
        }
    }

    /// The cached copy a pending twin will share, for defragmentation to follow it.
    pub(crate) fn twin_copy_mut(&mut self) -> Option<&mut BlockId> {
        self.twin.as_mut().map(|(_, copy)| copy)
    }

    /// The same progress rewound to position 0, for a sequence whose blocks are about
    /// to be replaced by fresh copies (a swap-out): the chain's ids are read from the
    /// cache now, while its blocks are still registered, so that the swapped-in copies
    /// register again (or share the cached copies) link by link. `None` when a link
    /// is not registered (a corrupt state).
    pub(crate) fn rewound(&self, table: &[BlockId], index: &PrefixIndex) -> Option<Self> {
        let mut ids = Vec::with_capacity(self.chain * index.block_size() + self.ids.len());
        for &b in table.get(..self.chain)? {
            if !index.is_registered(b) {
                return None;
            }
            ids.extend_from_slice(index.block_tokens(b));
        }
        ids.extend_from_slice(&self.ids);
        Some(SeqPrefix {
            chain: 0,
            last: None,
            ids,
            twin: None,
            step_ids: false,
            ..self.clone()
        })
    }
}

/// A prefix-cache lookup that admission reuses: [`KvCache::lookup_prefix`]
/// hashes the prompt once, [`KvCache::can_admit_hit`] and
/// [`KvCache::admit_prompt`] read the result without hashing again. Reuse one
/// value across requests: its buffers keep their capacity.
///
/// A hit found before other calls changed the cache is checked again at admission
/// (each block must still hold the same content, compared by hash, chain, token ids,
/// extra keys and namespace, not rehashed); blocks that no longer do are simply not
/// shared.
///
/// With a host level ([`KvCache::plan_host_store`]), the lookup goes on past the last
/// device block in the host level's index: [`Self::host_tokens`] more leading tokens
/// are held there, in chain order (a lookup stops at the first block no tier holds).
/// [`Self::cached_tokens`] stays the device part, so a hit with no host part reads as
/// before; [`KvCache::admit_prompt`] loads the host part back ([`KvCache::load_job`]).
///
/// With a disk level ([`KvCache::adopt_disk_prefixes`], [`KvCache::plan_disk_store`]),
/// the lookup goes on past the host part in the disk index: [`Self::disk_tokens`] more
/// tokens, loaded through staging host blocks ([`KvCache::disk_load_job`]).
#[derive(Debug, Clone, Default)]
pub struct PrefixHit {
    blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
    /// Hashes of the blocks found in the host level after `blocks`, in chain order.
    host: Vec<BlockHash>,
    /// Hashes of the blocks found in the disk level after `host`, in chain order.
    disk: Vec<BlockHash>,
    ns: Option<Namespace>,
    keys: BlockKeys,
    prompt_len: usize,
    block_size: usize,
    collision: bool,
    priority: i32,
}

impl PrefixHit {
    /// Leading prompt tokens found in the cache (whole blocks, below the prompt length).
    pub fn cached_tokens(&self) -> usize {
        self.blocks.len() * self.block_size
    }

    /// Blocks found in the cache.
    pub fn cached_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The prompt length the lookup was made for.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Leading prompt tokens found on the device: [`Self::cached_tokens`], named for
    /// the tier.
    pub fn device_tokens(&self) -> usize {
        self.cached_tokens()
    }

    /// Prompt tokens after the device part found in the host level of the prefix
    /// cache (whole blocks; 0 without a host level).
    pub fn host_tokens(&self) -> usize {
        self.host.len() * self.block_size
    }

    /// Blocks found in the host level after the device part.
    pub fn host_blocks(&self) -> usize {
        self.host.len()
    }

    /// Prompt tokens after the host part found in the disk level of the prefix cache
    /// (whole blocks; 0 without a disk level).
    pub fn disk_tokens(&self) -> usize {
        self.disk.len() * self.block_size
    }

    /// Blocks found in the disk level after the host part.
    pub fn disk_blocks(&self) -> usize {
        self.disk.len()
    }

    /// Leading prompt tokens some tier holds: device plus host plus disk.
    pub fn total_tokens(&self) -> usize {
        self.cached_tokens() + self.host_tokens() + self.disk_tokens()
    }

    /// The disk part's block hashes, in chain order.
    pub(crate) fn disk_hashes(&self) -> &[BlockHash] {
        &self.disk
    }

    /// The host part's block hashes, in chain order.
    pub(crate) fn host_hashes(&self) -> &[BlockHash] {
        &self.host
    }

    /// Drops the host part (a caller that serves device hits only).
    pub(crate) fn drop_host_part(&mut self) {
        self.host.clear();
        self.disk.clear();
    }

    /// The cached blocks found, in prompt order.
    pub(crate) fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Keeps the first `device_blocks` device blocks of the hit and, after them, host
    /// then disk blocks up to `blocks` in all (a hybrid hit whose groups split the same
    /// way between the device and the lower levels).
    pub(crate) fn truncate_with_host(&mut self, device_blocks: usize, blocks: usize) {
        self.blocks.truncate(device_blocks);
        self.hashes.truncate(device_blocks);
        let rest = blocks.saturating_sub(self.blocks.len());
        self.host.truncate(rest);
        self.disk.truncate(rest - self.host.len());
    }

    /// Keeps the first `blocks` device blocks of the hit and none of its host or disk
    /// part (a hit limited by another KV-cache group, which serves fewer).
    pub(crate) fn truncate_blocks(&mut self, blocks: usize) {
        self.blocks.truncate(blocks);
        self.hashes.truncate(blocks);
        self.host.clear();
        self.disk.clear();
    }
}

/// Records token ids for positions `s.computed..` (the tokens a one-call append or
/// admission gives slots to). Ids before the known range are already registered
/// content and skipped; ids after a gap (tokens appended without ids) cannot be placed
/// and are dropped: registration waits for [`KvCache::add_token_ids`].
#[inline(always)]
pub(crate) fn record_ids(s: &mut Sequence, ids: &[u32], bs: usize) {
    let pos = s.computed;
    let Some(p) = s.prefix.as_deref_mut() else {
        return;
    };
    // The decode step: one id right after the known ones, with room for it (what the
    // general path below does in that case, without a call: it ran per token).
    if let &[id] = ids {
        if pos == p.chain * bs + p.ids.len() && p.ids.len() < p.ids.capacity() {
            p.ids.push(id);
            return;
        }
    }
    record_ids_at(p, pos, ids, bs);
}

/// Whether `ids` of positions `first..` start tracking a sequence whose ids are not
/// tracked yet (the one rule of the module docs): they are those of position 0, and the
/// manager has no sliding window (which registers nothing, so never tracks).
fn starts_tracking(windowed: bool, first: usize, ids: &[u32]) -> bool {
    first == 0 && !ids.is_empty() && !windowed
}

/// Records `ids`, the ids of the query tokens of the reservation `s` is getting now
/// (tracking starts if they are position 0's), and marks them as the step's: the
/// commit keeps only the accepted ones ([`commit_step_ids`]).
#[inline]
pub(crate) fn record_step_ids(
    index: &PrefixIndex,
    windowed: bool,
    s: &mut Sequence,
    ids: &[u32],
    bs: usize,
) {
    start_tracking(index, windowed, s, ids);
    record_ids(s, ids, bs);
    if let Some(p) = s.prefix.as_deref_mut() {
        p.step_ids = true;
    }
}

/// A reservation without ids: none of the ids known are the step's.
#[inline]
pub(crate) fn forget_step_ids(s: &mut Sequence) {
    if let Some(p) = s.prefix.as_deref_mut() {
        p.step_ids = false;
    }
}

/// At a commit: when the ids of the reservation came with it, the ids past the
/// computed tokens are those of rejected positions, and go.
#[inline]
pub(crate) fn commit_step_ids(s: &mut Sequence, bs: usize) {
    let computed = s.computed;
    if let Some(p) = s.prefix.as_deref_mut() {
        if std::mem::take(&mut p.step_ids) {
            p.ids.truncate(computed.saturating_sub(p.chain * bs));
        }
    }
}

/// Starts tracking the ids of `s`, admitted without any, when [`starts_tracking`] says
/// `ids` (those of the tokens from `s.computed` on) do.
#[inline]
pub(crate) fn start_tracking(index: &PrefixIndex, windowed: bool, s: &mut Sequence, ids: &[u32]) {
    if s.prefix.is_none() && !s.tracking_stopped && starts_tracking(windowed, s.computed, ids) {
        s.prefix = Some(Box::new(SeqPrefix::starting(index.default_namespace())));
    }
}

/// [`record_ids`] for every other case.
#[inline(never)]
fn record_ids_at(p: &mut SeqPrefix, pos: usize, ids: &[u32], bs: usize) {
    let known_start = p.chain * bs;
    let known_end = known_start + p.ids.len();
    if pos > known_end {
        return;
    }
    let skip = known_start.saturating_sub(pos).min(ids.len());
    let at = pos.max(known_start) - known_start;
    p.ids.truncate(at);
    match &ids[skip..] {
        // The decode step: one id, pushed without a copy call.
        &[id] => p.ids.push(id),
        rest => p.ids.extend_from_slice(rest),
    }
}

/// Registers every block of `s` that is full, computed and whose ids are known, in
/// order after its chain; returns how many were registered. A block whose content is
/// already cached in another block (a duplicate) is not registered twice: the chain
/// stops before it until [`KvCache::settle_twin`] shares the cached copy in its
/// place (see the module docs). Called after every slot-handing call: the common case
/// (no block completed) is one comparison, so the work is per block, not per token.
#[inline(always)]
pub(crate) fn extend_chain_in(prefix: &mut PrefixIndex, bs: usize, s: &mut Sequence) -> usize {
    let Some(p) = s.prefix.as_deref() else {
        return 0;
    };
    if p.ids.len() < bs || (p.chain + 1) * bs > s.computed || p.twin.is_some() {
        return 0;
    }
    extend_chain_full(prefix, bs, s)
}

/// [`extend_chain_in`] once at least one block is ready to register (out of line: the
/// check above runs per token, this per block).
#[inline(never)]
fn extend_chain_full(prefix: &mut PrefixIndex, bs: usize, s: &mut Sequence) -> usize {
    let Some(p) = s.prefix.as_deref_mut() else {
        return 0;
    };
    let (mut registered, mut used) = (0, 0);
    let mut broken = false;
    while p.ids.len() - used >= bs && (p.chain + 1) * bs <= s.computed {
        // `register_next` reads the block's ids from `p.ids`, so lend them out.
        let ids = std::mem::take(&mut p.ids);
        let link = register_next(prefix, &s.table, p, &ids[used..used + bs]);
        p.ids = ids;
        match link {
            Link::Stored => registered += 1,
            Link::Shared => {}
            Link::Duplicate(hash, copy) => {
                p.twin = Some((hash, copy));
                s.twin_pending = true;
                break;
            }
            Link::Broken => {
                broken = true;
                break;
            }
        }
        used += bs;
    }
    if broken {
        // Only a corrupt state or a hash collision gets here. Tracking ends for good:
        // a chain started again would be in the default namespace.
        s.prefix = None;
        s.tracking_stopped = true;
    } else {
        p.ids.drain(..used);
    }
    registered
}

/// What [`register_next`] did with the next block of a chain.
enum Link {
    /// Registered.
    Stored,
    /// Registered already under this very hash by a fork sibling that holds it too.
    Shared,
    /// Its content is registered in block `.1` under hash `.0`.
    Duplicate(BlockHash, BlockId),
    /// The chain cannot go on: the table does not hold it (a corrupt state), or the
    /// next block's hash collides with other content.
    Broken,
}

/// Extends the chain by `table[p.chain]`, now full with `ids`, when it registers (or
/// a fork sibling registered it); reports a duplicate without extending.
fn register_next(
    prefix: &mut PrefixIndex,
    table: &[BlockId],
    p: &mut SeqPrefix,
    ids: &[u32],
) -> Link {
    let Some(&b) = table.get(p.chain) else {
        return Link::Broken;
    };
    // The chain must still be what this sequence holds (a move elsewhere that lost a
    // registered block would break it).
    if p.chain > 0 && table.get(p.chain - 1).and_then(|&pb| prefix.hash_of(pb)) != p.last {
        return Link::Broken;
    }
    let key = p.keys.get(p.chain);
    // The parent is the block before, checked above.
    let parent_block = p.chain.checked_sub(1).and_then(|i| table.get(i).copied());
    let hash = prefix.hash_next(p.last, parent_block, &p.ns, ids, key.map_or(&[][..], |k| k));
    let link = match prefix.register(b, hash, p.last, parent_block, &p.ns, key, ids, p.priority) {
        Registration::Stored => Link::Stored,
        // The same content, compared byte for byte (not a hash collision).
        Registration::Duplicate(copy)
            if prefix.confirms(copy, p.last, &p.ns, ids, key.map_or(&[][..], |k| k)) =>
        {
            return Link::Duplicate(hash, copy)
        }
        // A 64-bit collision: the hash is taken by other content, so no later block of
        // this sequence can be registered under a parent found by it.
        Registration::Duplicate(_) => return Link::Broken,
        Registration::Refused if prefix.hash_of(b) == Some(hash) => Link::Shared,
        Registration::Refused => return Link::Broken,
    };
    p.chain += 1;
    p.last = Some(hash);
    link
}

impl KvCache {
    /// A manager whose prefix cache is tuned by `prefix` (shorthand for
    /// [`KvCache::builder`] with [`crate::manager::CacheBuilder::prefix`]).
    ///
    /// # Errors
    /// As [`KvCache::new`]; [`Error::InvalidConfig`] when
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
        if let Some(g0) = self.first_group() {
            return g0.prefix_config();
        }
        self.prefix.config()
    }

    /// Looks `tokens` up in the prefix cache once and fills `hit` (its buffers are
    /// reused) for [`Self::can_admit_hit`] and [`Self::admit_prompt`]. Changes nothing
    /// (no counters either). Returns the cached tokens on the device; past them the
    /// lookup goes on in the host level of the prefix cache
    /// ([`PrefixHit::host_tokens`]), until the first block no tier holds.
    ///
    /// # Errors
    /// [`Error::PrefixKeyTooLong`] (for the cache salt, the extra key or a block key);
    /// `hit` is cleared then.
    pub fn lookup_prefix(
        &self,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
        hit: &mut PrefixHit,
    ) -> Result<usize> {
        self.one_group("lookup_prefix")?;
        hit.blocks.clear();
        hit.hashes.clear();
        hit.host.clear();
        hit.disk.clear();
        hit.ns = None;
        hit.keys = BlockKeys::default();
        hit.collision = false;
        let bs = self.block_size();
        hit.block_size = bs;
        hit.prompt_len = tokens.len();
        hit.priority = opts.retention_priority;
        let ns = self.prefix.namespace(opts)?;
        hit.keys = self.prefix.block_keys(opts.block_keys)?;
        let found = self.prefix.lookup(
            &ns,
            &hit.keys,
            tokens,
            tokens.len().saturating_sub(1) / bs,
            &mut hit.blocks,
        );
        hit.collision = found.collision;
        if self.window.is_some() {
            // A window manager serves no hits (see `CacheBuilder::sliding_window`).
            hit.blocks.clear();
            hit.collision = false;
        }
        for &b in &hit.blocks {
            hit.hashes.push(self.prefix.hash_of(b).unwrap_or_default());
        }
        if self.window.is_none() && !hit.collision {
            let last = hit.blocks.last().map(|&b| {
                (
                    self.prefix.hash_of(b).unwrap_or_default(),
                    self.prefix.digest_of(b),
                )
            });
            let max = tokens.len().saturating_sub(1) / bs;
            self.tiers.host_cache.extend_hit(
                &self.prefix,
                &ns,
                &hit.keys,
                tokens,
                hit.blocks.len(),
                max,
                last,
                &mut hit.host,
            );
            // Then the disk level, from the last block found so far.
            let last = match hit.host.last() {
                Some(&h) => self.tiers.host_cache.saved_of(h).map(|s| (h, s.digest())),
                None => last,
            };
            self.tiers.disk_cache.extend_hit(
                &self.prefix,
                &ns,
                &hit.keys,
                tokens,
                hit.blocks.len() + hit.host.len(),
                max,
                last,
                &mut hit.disk,
            );
        }
        hit.ns = Some(ns);
        Ok(hit.cached_tokens())
    }

    /// Loads `hit`'s host part into resident `seq`, admitted with `hit`'s device part
    /// only (its table is that part, all computed, nothing reserved): allocates a
    /// device block per host block the host level still holds under the chain (and,
    /// after an intact host part, per disk block the disk index still holds, each with
    /// a staging host block), and marks the sequence loading as [`Self::admit_prompt`]
    /// does. Returns the tokens
    /// loading. For a hybrid admission, which moves pages to each group between the
    /// revival of the device parts and the loads (`groups/host_level.rs`).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is not as
    /// described; [`Error::OutOfBlocks`]. Nothing changed on error.
    pub(crate) fn start_host_load(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        hit: &PrefixHit,
    ) -> Result<usize> {
        let bs = self.block_size();
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))?;
        let device = hit.blocks.len();
        if s.table.len() != device || s.computed != device * bs || s.in_flight.is_some() {
            return Err(Error::SequenceState {
                seq,
                state: "not admitted with the hit's device part alone",
                needed: "admitted with the hit's device part alone",
            });
        }
        let Some(ns) = hit.ns.as_ref() else {
            return Ok(0);
        };
        let parent = hit.hashes.last().copied();
        let host = self.confirm_host_hit(hit, device, parent, ns, &hit.keys, tokens);
        // The disk part, as in `admit_prompt`: from an intact host part, as far as the
        // disk index still holds it and the host tier can stage it.
        let mut disk = if host.len() == hit.host_hashes().len() {
            let parent = host.last().copied().or(parent);
            let first = device + host.len();
            self.confirm_disk_hit(hit.disk_hashes(), first, parent, ns, &hit.keys, tokens)
        } else {
            Vec::new()
        };
        if !disk.is_empty() {
            disk.truncate(self.staging_room(&host));
        }
        if host.is_empty() && disk.is_empty() {
            return Ok(0);
        }
        self.ensure_available(host.len() + disk.len())?;
        let mut table = std::mem::take(
            &mut self
                .seqs
                .get_mut(&seq)
                .ok_or(Error::UnknownSequence(seq))?
                .table,
        );
        let load = self.plan_load(seq, device, &host, &disk, &mut table);
        let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        s.table = table;
        let load = load?;
        let loading = (host.len() + disk.len()) * bs;
        s.num_tokens += loading;
        s.in_flight = Some(load);
        self.tables_changed();
        Ok(loading)
    }

    /// `hit` without its host and disk parts.
    pub(crate) fn device_part(hit: &PrefixHit) -> PrefixHit {
        let mut d = hit.clone();
        d.host.clear();
        d.disk.clear();
        d
    }

    /// Cuts `hit`'s device part to its first `device_blocks` blocks and looks its host
    /// and disk parts up again from there, for a hybrid hit whose groups' device parts
    /// end apart (`groups/host_level.rs`).
    pub(crate) fn rebase_host_hit(
        &self,
        tokens: &[u32],
        hit: &mut PrefixHit,
        device_blocks: usize,
    ) {
        let PrefixHit {
            blocks,
            hashes,
            host,
            disk,
            ns,
            keys,
            collision,
            ..
        } = hit;
        blocks.truncate(device_blocks);
        hashes.truncate(device_blocks);
        host.clear();
        disk.clear();
        let Some(ns) = ns.as_ref() else {
            return;
        };
        if self.window.is_some() || *collision {
            return;
        }
        let last = blocks.last().map(|&b| {
            (
                self.prefix.hash_of(b).unwrap_or_default(),
                self.prefix.digest_of(b),
            )
        });
        let max = tokens.len().saturating_sub(1) / self.block_size();
        self.tiers.host_cache.extend_hit(
            &self.prefix,
            ns,
            keys,
            tokens,
            blocks.len(),
            max,
            last,
            host,
        );
        let last = match host.last() {
            Some(&h) => self.tiers.host_cache.saved_of(h).map(|s| (h, s.digest())),
            None => last,
        };
        self.tiers.disk_cache.extend_hit(
            &self.prefix,
            ns,
            keys,
            tokens,
            blocks.len() + host.len(),
            max,
            last,
            disk,
        );
    }

    /// Whether [`Self::admit_prompt`] of `hit`'s prompt, computed in full, would fit
    /// now while keeping the watermark: cached hits are not counted as needed, and a hit
    /// that would revive an evictable block is counted once (it stops being available).
    pub fn can_admit_hit(&self, hit: &PrefixHit) -> bool {
        if self.hybrid.is_some() {
            return false;
        }
        hit.prompt_len <= self.max_seq_len()
            && self.layout.blocks_for_tokens(hit.prompt_len) - hit.blocks.len()
                + self.count_evictable(&hit.blocks)
                + self.config.watermark_blocks
                <= self.num_available_blocks()
    }

    /// Whether [`Self::admit_prompt`] of `hit`'s prompt, followed by a reservation of
    /// its first `first_chunk` uncached tokens, would fit now while keeping the
    /// watermark: the admission rule of a chunked-prefill scheduler that admits a
    /// request once its first chunk fits (as vLLM does) rather than its whole prompt
    /// ([`Self::can_admit_hit`]). The later chunks then compete for blocks like any
    /// running sequence's step.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, CacheConfig, DType, KvCache, KvLayout, ModelShape};
    /// use pagedkv::{PrefixHit, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let cfg = CacheConfig { watermark_blocks: 0, ..CacheConfig::new(16) };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, cfg)?;
    /// kv.admit(SeqId(1), 128, &mut Vec::new())?;           // 8 of the 16 blocks
    /// let prompt: Vec<u32> = (0..200).collect();          // 13 blocks
    /// let mut hit = PrefixHit::default();
    /// kv.lookup_prefix(&prompt, &AdmitOptions::default(), &mut hit)?;
    /// assert!(!kv.can_admit_hit(&hit));
    /// assert!(kv.can_admit_chunk(&hit, 64));                // 4 blocks
    /// assert!(!kv.can_admit_chunk(&hit, 192));              // 12 blocks
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn can_admit_chunk(&self, hit: &PrefixHit, first_chunk: usize) -> bool {
        if self.hybrid.is_some() {
            return false;
        }
        // A host part is loaded into new blocks before the first chunk.
        let held = hit
            .total_tokens()
            .saturating_add(first_chunk)
            .min(hit.prompt_len);
        hit.prompt_len <= self.max_seq_len()
            && self
                .layout
                .blocks_for_tokens(held)
                .saturating_sub(hit.blocks.len())
                + self.count_evictable(&hit.blocks)
                + self.config.watermark_blocks
                <= self.num_available_blocks()
    }

    /// Admits `seq` with prompt `tokens` for chunked prefill: shares `hit`'s cached
    /// blocks (from [`Self::lookup_prefix`] of the same tokens) and allocates nothing
    /// else. The sequence starts with `cached_tokens` computed tokens and knows every
    /// prompt id; each step the engine calls [`Self::reserve`] for a chunk and
    /// [`Self::commit`] once it is computed, and only then are the chunk's full blocks
    /// registered for other requests.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, CacheConfig, CopyPlan, DType, KvCache, KvLayout,
    ///               ModelShape, PrefixHit, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 2, num_q_heads: 8, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::BF16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
    /// let prompt: Vec<u32> = (0..100).collect();
    /// let (mut hit, mut slots, mut copies) = (PrefixHit::default(), Vec::new(), CopyPlan::default());
    /// let opts = AdmitOptions::default();
    ///
    /// kv.lookup_prefix(&prompt, &opts, &mut hit)?;
    /// assert!(kv.can_admit_hit(&hit));
    /// kv.admit_prompt(SeqId(1), &prompt, &hit)?;
    /// kv.reserve(SeqId(1), 40, 0, &mut slots, &mut copies)?; // first chunk of 40 tokens
    /// // ... the model computes the chunk ...
    /// assert_eq!(kv.commit(SeqId(1), 40)?, 2);                 // 2 full blocks registered
    ///
    /// // Another request sees only the computed blocks, never the rest of the prompt.
    /// kv.lookup_prefix(&prompt, &opts, &mut hit)?;
    /// assert_eq!(hit.cached_tokens(), 32);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Host-level hits
    /// When `hit` has a host part ([`PrefixHit::host_tokens`], see
    /// [`Self::plan_host_store`]), the blocks the host level still holds under the same
    /// chain get fresh device blocks and a load is recorded: run
    /// [`Self::load_job`]'s plan, then [`Self::complete_swap`] (the loaded tokens count
    /// as computed, the blocks are registered on the device) or [`Self::abort_swap`]
    /// (the sequence keeps only its device part, computed; the host copies stay).
    /// [`Admission::loading_tokens`] says how many tokens load. Until then the sequence
    /// is "swapping in": reserve, append, fork, truncate and free are refused with
    /// [`Error::SequenceState`]. Availability counts the loaded blocks as needed
    /// ([`Self::can_admit_hit`] already did).
    ///
    /// # Errors
    /// [`Error::DuplicateSequence`] (also for an id that is swapped out),
    /// [`Error::TooLong`], [`Error::ShapeMismatch`] when `hit` was made for a prompt of
    /// another length, [`Error::OutOfBlocks`] when the arena cannot hold the revived
    /// and loaded blocks; on error nothing changed.
    pub fn admit_prompt(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        hit: &PrefixHit,
    ) -> Result<Admission> {
        self.one_group("admit_prompt")?;
        self.admit_prompt_inner(seq, tokens, hit, true)
    }

    /// [`Self::admit_prompt`]; `recheck: false` only for a hit looked up on `tokens`
    /// with nothing changed since (inside [`Self::admit_tokens`]), whose blocks the
    /// lookup has just confirmed.
    fn admit_prompt_inner(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        hit: &PrefixHit,
        recheck: bool,
    ) -> Result<Admission> {
        if self.contains(seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let len = tokens.len();
        if len > self.max_seq_len() {
            return Err(Error::TooLong {
                tokens: len,
                limit: self.max_seq_len(),
            });
        }
        if hit.prompt_len != len || (hit.block_size != 0 && hit.block_size != self.block_size()) {
            return Err(Error::ShapeMismatch {
                what: "prompt length of the prefix hit",
                expected: len,
                got: hit.prompt_len,
            });
        }
        let bs = self.block_size();
        let ns = match &hit.ns {
            Some(ns) => ns.clone(),
            None => self.prefix.namespace(&AdmitOptions::default())?,
        };
        // Re-check the hit without hashing: each block must still be registered under
        // the same hash, chained, with the prompt's ids, extra keys and namespace.
        let mut valid = 0;
        let mut parent = None;
        for (i, (&b, &h)) in hit.blocks.iter().zip(&hit.hashes).enumerate() {
            let same = !recheck
                || (self.prefix.hash_of(b) == Some(h)
                    && self.prefix.confirms(
                        b,
                        parent,
                        &ns,
                        &tokens[i * bs..(i + 1) * bs],
                        hit.keys.bytes(i),
                    )
                    && self.pool.state(b).is_ok_and(|s| s != BlockState::Free));
            if !same {
                break;
            }
            valid += 1;
            parent = Some(h);
        }
        // The host part goes on only from an intact device part, and only as far as
        // the host level still holds it under the same chain.
        let host = if valid == hit.blocks.len() {
            self.confirm_host_hit(hit, valid, parent, &ns, &hit.keys, tokens)
        } else {
            Vec::new()
        };
        // The disk part goes on only from an intact host part, as far as the disk
        // index still holds it and the host tier can stage it.
        let mut disk = if host.len() == hit.host_hashes().len() {
            let parent = host.last().copied().or(parent);
            let first = valid + host.len();
            self.confirm_disk_hit(hit.disk_hashes(), first, parent, &ns, &hit.keys, tokens)
        } else {
            Vec::new()
        };
        if !disk.is_empty() {
            disk.truncate(self.staging_room(&host));
        }
        let mut table = self.new_table(valid + host.len() + disk.len());
        table.extend_from_slice(&hit.blocks[..valid]);
        let revived = self.count_evictable(&table);
        self.ensure_available(revived + host.len() + disk.len())?;
        self.seqs.reserve_room(1)?;
        for &b in &table {
            let revive = self.pool.state(b)? == BlockState::Cached;
            self.share_copy(b, hit.priority, revive)?;
        }
        self.prefix.note_query(len, valid, hit.collision);
        self.note_device_hit(valid);
        let cached = valid * bs;
        let load = if host.is_empty() && disk.is_empty() {
            None
        } else {
            Some(self.plan_load(seq, valid, &host, &disk, &mut table)?)
        };
        // A window manager registers nothing: its blocks leave before the sequence ends.
        let prefix = self.window.is_none().then(|| {
            Box::new(SeqPrefix {
                ns,
                keys: hit.keys.clone(),
                priority: hit.priority,
                chain: valid,
                last: valid.checked_sub(1).map(|i| hit.hashes[i]),
                ids: tokens[cached..].to_vec(),
                twin: None,
                step_ids: false,
            })
        });
        let loading = (host.len() + disk.len()) * bs;
        let s = Sequence {
            table,
            num_tokens: cached + loading,
            computed: cached,
            prefix,
            in_flight: load,
            admission: self.tiers.next_admission(),
            ..Sequence::default()
        };
        self.seqs.insert(seq, s)?;
        self.note_usage();
        Ok(Admission {
            cached_tokens: cached,
            cached_blocks: valid,
            new_blocks: 0,
            registered_blocks: 0,
            loading_tokens: loading,
        })
    }

    /// Admits `seq` with prompt `tokens` and schedules the whole uncached rest in this
    /// step: [`Self::lookup_prefix`], [`Self::admit_prompt`], then a reservation of the
    /// uncached tokens committed at once. Slots of the *uncached* tokens
    /// (`tokens[cached_tokens..]`) go into `slots` (cleared first); the prompt's full
    /// blocks are registered now, so the engine must write every slot it was given in
    /// the step that follows, before any other step reads them (engines that run
    /// `reshape_and_cache` for the whole batch before attention do). For chunked
    /// prefill use [`Self::admit_prompt`], [`Self::reserve`] and [`Self::commit`].
    ///
    /// Hits are confirmed against the stored token ids, the chain of parents, the
    /// block keys (`opts.block_keys`) and the namespace (`opts.cache_salt`,
    /// `opts.extra_key`), so a hash collision is a miss.
    /// At least one token is left to compute; see the module docs of `manager::prefix`
    /// for the exact contract. Only device hits are served: the tokens the host level
    /// of the prefix cache holds are computed again (loading them would leave the
    /// sequence unable to take its slots in this call; [`Self::admit_prompt`] loads).
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, CacheConfig, DType, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 2, num_q_heads: 8, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::BF16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
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
        self.one_group("admit_tokens")?;
        slots.clear();
        if self.contains(seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        if tokens.len() > self.max_seq_len() {
            return Err(Error::TooLong {
                tokens: tokens.len(),
                limit: self.max_seq_len(),
            });
        }
        let mut hit = PrefixHit::default();
        self.lookup_prefix(tokens, opts, &mut hit)?;
        // One call that hands out slots at once serves device hits only: a load
        // would leave the sequence unable to take its slots until it completes.
        hit.drop_host_part();
        let total = self.layout.blocks_for_tokens(tokens.len());
        self.ensure_available(total - hit.cached_blocks() + self.count_evictable(&hit.blocks))?;
        // Nothing below fails on a consistent manager: the availability check covered
        // the revivals and the new blocks.
        // The hit was looked up just now on these very tokens: nothing to re-check.
        let mut a = self.admit_prompt_inner(seq, tokens, &hit, false)?;
        let rest = tokens.len() - a.cached_tokens;
        let mut copies = CopyPlan::default();
        match self.reserve_inner(seq, rest, 0, true, None, slots, &mut copies) {
            Ok(registered) => a.registered_blocks = registered,
            Err(e) => {
                // Unreachable on a consistent manager; undo the admission all the same.
                let _ = self.free(seq);
                return Err(e);
            }
        }
        a.new_blocks = total - a.cached_blocks;
        Ok(a)
    }

    /// Appends `tokens` to `seq` as [`Self::append`] does (slots into `slots`,
    /// copy-on-write into `copies`, committed at once) and records their ids, so every
    /// full computed block is registered. The ids follow the one rule of the module
    /// docs, as [`Self::add_token_ids`] follows it: they are kept when they continue
    /// the known ids (from position 0 for a sequence admitted without any) and dropped
    /// after a gap, which [`Self::add_token_ids`] can fill; a sliding-window manager
    /// drops them all.
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
        self.one_group("append_tokens")?;
        self.reserve_inner(seq, tokens.len(), 0, true, Some(tokens), slots, copies)
            .map(|_| ())
    }

    /// Whether the token ids of `seq` are tracked, so that its full computed blocks are
    /// registered in the prefix cache as they fill: a sequence admitted with ids
    /// ([`Self::admit_tokens`], [`Self::admit_prompt`]) or given them since
    /// ([`Self::append_tokens`] or [`Self::add_token_ids`] from position 0). Tracking
    /// goes on through duplicate blocks, swaps and truncations (see the module docs).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when it is swapped out.
    pub fn is_registering(&self, seq: SeqId) -> Result<bool> {
        if let Some(g0) = self.first_group() {
            return g0.is_registering(seq);
        }
        Ok(self.seq(seq)?.prefix.is_some())
    }

    /// Records the token ids of positions `first..first + ids.len()` of `seq` that
    /// were not known when their slots were handed out (asynchronous scheduling samples
    /// ids after the step is launched; a plain [`Self::append`] gives none; a
    /// truncation cuts the known ids at its length). Full computed blocks whose ids
    /// are all known are registered at once. Ids may run ahead of the computed tokens
    /// (a prompt's are known at admission). Ids at positions already registered are
    /// skipped. The ids follow the one rule of the module docs, as
    /// [`Self::append_tokens`] follows it: a sequence admitted without ids
    /// ([`Self::admit`]) starts tracking in the default namespace when the ids of
    /// position 0 arrive; a sliding-window manager tracks none (the call records
    /// nothing and returns 0). Returns the blocks registered.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is swapped out or
    /// has a swap in flight; [`Error::TokenIdsGap`] when `first` is past the known ids
    /// (the ids in between are missing; never on a sliding-window manager);
    /// [`Error::TooLong`] past the longest sequence. Nothing changed on error.
    pub fn add_token_ids(&mut self, seq: SeqId, first: usize, ids: &[u32]) -> Result<usize> {
        if let Some(h) = &mut self.hybrid {
            // Every group checks first, so a refusal changes no group.
            // A recurrent-state group holds no tokens: it registers nothing.
            for g in 0..h.num_groups() {
                if h.state_pages(g).is_none() {
                    h.group(g).check_token_ids(seq, first, ids)?;
                }
            }
            let mut registered = 0;
            for g in 0..h.num_groups() {
                if h.state_pages(g).is_none() {
                    registered += h.group_mut(g).add_token_ids(seq, first, ids)?;
                }
            }
            return Ok(registered);
        }
        self.check_token_ids(seq, first, ids)?;
        let bs = self.block_size();
        let s = self.resident(seq)?;
        let (known_start, _) = s
            .prefix
            .as_deref()
            .map_or((0, 0), |p| (p.chain * bs, p.chain * bs + p.ids.len()));
        let windowed = self.window.is_some();
        let untracked = s.prefix.is_none();
        if untracked && (s.tracking_stopped || !starts_tracking(windowed, first, ids)) {
            return Ok(0);
        }
        let default_ns = self.prefix.default_namespace();
        let h = self.handle(seq)?;
        let s = self.seqs.at_mut(h).ok_or(Error::StaleHandle(h))?;
        let p = s
            .prefix
            .get_or_insert_with(|| Box::new(SeqPrefix::starting(default_ns)));
        let skip = known_start.saturating_sub(first).min(ids.len());
        p.ids.truncate(first.max(known_start) - known_start);
        p.ids.extend_from_slice(&ids[skip..]);
        Ok(extend_chain_in(&mut self.prefix, bs, s))
    }

    /// The refusals of [`Self::add_token_ids`], changing nothing.
    fn check_token_ids(&self, seq: SeqId, first: usize, ids: &[u32]) -> Result<()> {
        let bs = self.block_size();
        let s = self.resident(seq)?;
        let known_end = s
            .prefix
            .as_deref()
            .map_or(0, |p| p.chain * bs + p.ids.len());
        let windowed = self.window.is_some();
        let untracked = s.prefix.is_none();
        if first > known_end && !(untracked && windowed) {
            return Err(Error::TokenIdsGap {
                seq,
                first,
                known: known_end,
            });
        }
        let end = first.saturating_add(ids.len());
        if end > self.max_seq_len() {
            return Err(Error::TooLong {
                tokens: end,
                limit: self.max_seq_len(),
            });
        }
        Ok(())
    }

    /// Leading tokens of `tokens` that [`Self::admit_tokens`] would serve from the cache
    /// now: the device part only (admit_tokens does not load from the host level, and
    /// host tokens are not free to use: they cost a load and device blocks). Changes
    /// nothing (no counters either). Allocates a [`PrefixHit`]: schedulers keep one and
    /// call [`Self::lookup_prefix`], which also reports the host part.
    ///
    /// # Errors
    /// [`Error::PrefixKeyTooLong`].
    pub fn cached_prefix_len(&self, tokens: &[u32], opts: &AdmitOptions<'_>) -> Result<usize> {
        if let Some(h) = &self.hybrid {
            return h.cached_prefix_len(tokens, opts);
        }
        self.lookup_prefix(tokens, opts, &mut PrefixHit::default())
    }

    /// Whether [`Self::admit_tokens`] of `tokens` would succeed now while keeping the
    /// watermark ([`Self::lookup_prefix`] then [`Self::can_admit_hit`]).
    pub fn can_admit_tokens(&self, tokens: &[u32], opts: &AdmitOptions<'_>) -> bool {
        if let Some(h) = &self.hybrid {
            return h.can_admit(tokens.len());
        }
        let mut hit = PrefixHit::default();
        self.lookup_prefix(tokens, opts, &mut hit).is_ok() && self.can_admit_hit(&hit)
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
        self.one_group("pin_prefix")?;
        let ns = self.prefix.namespace(opts)?;
        let keys = self.prefix.block_keys(opts.block_keys)?;
        let bs = self.block_size();
        let want = tokens.len() / bs;
        let mut chain = Vec::with_capacity(want);
        let found = self.prefix.lookup(&ns, &keys, tokens, want, &mut chain);
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
        self.one_group("unpin_prefix")?;
        self.prefix.unpin(pin).map(|_| ())
    }

    /// Evicts up to `max_blocks` evictable cached blocks now (leaves first, in policy
    /// order) and returns how many went. Before shrinking the arena, or to drop a
    /// tenant's cache.
    pub fn evict_cached(&mut self, max_blocks: usize) -> usize {
        if let Some(h) = &mut self.hybrid {
            return h.evict_cached(max_blocks);
        }
        let mut n = 0;
        while n < max_blocks && self.evict_one().is_ok() {
            n += 1;
        }
        n
    }

    /// Empties the prefix cache as far as it can without touching what is in use (as
    /// vLLM's `reset_prefix_cache`, after a weight update or to drop every tenant's
    /// cache): every cached block that no sequence references and no pin holds is
    /// evicted to the free list. Blocks a sequence references stay registered (those
    /// sequences keep sharing them and keep registering their later blocks) and pinned
    /// blocks stay until unpinned; the result counts both, so an engine that needs an
    /// empty cache sees what still holds blocks.
    ///
    /// Emits one [`PrefixEvent::AllCleared`] (no `BlockRemoved` per evicted block),
    /// then a `BlockStored` for every block kept, parents first, so a router's copy of
    /// the index stays exact.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, CacheConfig, DType, KvCache, KvLayout, ModelShape, SeqId};
    ///
    /// let shape = ModelShape { num_layers: 2, num_q_heads: 8, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::BF16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
    /// let (opts, mut slots) = (AdmitOptions::default(), Vec::new());
    /// kv.admit_tokens(SeqId(1), &(0..40).collect::<Vec<u32>>(), &opts, &mut slots)?;
    /// kv.admit_tokens(SeqId(2), &(100..140).collect::<Vec<u32>>(), &opts, &mut slots)?;
    /// kv.free(SeqId(1))?;                           // 2 cached blocks
    ///
    /// let reset = kv.reset_prefix_cache()?;
    /// assert_eq!((reset.evicted_blocks, reset.kept_live_blocks), (2, 2));
    /// assert_eq!(kv.stats().cached_blocks, 0);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// Only when the manager's state was already corrupt (the pool refuses to evict a
    /// block the index offered); the blocks evicted before it stay evicted.
    pub fn reset_prefix_cache(&mut self) -> Result<PrefixReset> {
        self.one_group("reset_prefix_cache")?;
        let mut evicted_blocks = 0;
        let mut result = Ok(());
        while let Some(b) = self.prefix.pop_victim_quietly() {
            if let Err(e) = self.pool.evict(b) {
                result = Err(e);
                break;
            }
            evicted_blocks += 1;
        }
        let (kept_live_blocks, kept_pinned_blocks) = self.prefix.announce_reset();
        result.map(|()| PrefixReset {
            evicted_blocks,
            kept_live_blocks,
            kept_pinned_blocks,
        })
    }

    /// Prefix-cache counters now.
    pub fn prefix_stats(&self) -> PrefixStats {
        if let Some(g0) = self.first_group() {
            return g0.prefix_stats();
        }
        self.prefix.stats(self.pool.num_cached())
    }

    /// The full chain digest of the registered block with hash `hash`, when the
    /// configured hasher chains digests wider than the 64-bit hash
    /// ([`crate::pool::prefix::PrefixHasher::chains_digests`], as vLLM's `sha256_cbor`
    /// does); `None` for other hashers or a hash not registered now.
    pub fn prefix_digest(&self, hash: BlockHash) -> Option<BlockDigest> {
        if let Some(g0) = self.first_group() {
            return g0.prefix_digest(hash);
        }
        self.prefix.digest_of(self.prefix.block_of(hash)?)
    }

    /// Moves the [`PrefixEvent`]s recorded since the last call into `out` (recorded
    /// only with [`PrefixConfig::record_events`]).
    pub fn drain_prefix_events(&mut self, out: &mut Vec<PrefixEvent>) {
        if let Some(h) = &mut self.hybrid {
            return h.drain_prefix_events(out);
        }
        self.prefix.drain_events(out);
    }

    // ---- hooks called from `manager/mod.rs` ---------------------------------------

    /// Settles the duplicates of sequence `h` (see the module docs): while the block
    /// after its chain duplicates a registered copy, the sequence shares that copy in
    /// its place and lets go of its own, and the chain goes on; a copy evicted since
    /// lets the sequence register its own block instead. Returns the blocks registered.
    ///
    /// Called where the sequence's own block is surely written: by [`Self::commit`] and
    /// a swap-in's completion (its step or transfer is done), and at the next call that
    /// hands the sequence slots (the one-call appends register before the engine
    /// writes). While a fork sibling still holds the sequence's own block the twin
    /// stays pending: sharing the copy alone would leave the sibling holding the
    /// blocks registered next without their parent (a live block under a cached
    /// one, which eviction could not honour). Settles at most
    /// `max_twins` twins (a reservation settles one, so that [`Self::twin_frees`] is
    /// what it gives back). Never fails on a consistent manager; on a pool error the
    /// sequence keeps its own block.
    #[cold]
    #[inline(never)]
    pub(crate) fn settle_twin(&mut self, h: SeqHandle, max_twins: usize) -> Result<usize> {
        let bs = self.block_size();
        let (mut registered, mut settled) = (0, 0);
        // Out of its slot while blocks are released (see `replace_protected`).
        let mut s = self.seqs.take(h).ok_or(Error::StaleHandle(h))?;
        let mut result = Ok(());
        while let Some((hash, copy)) = s.prefix.as_deref().and_then(|p| p.twin) {
            if settled == max_twins {
                break;
            }
            settled += 1;
            let (chain, priority) = match s.prefix.as_deref() {
                Some(p) => (p.chain, p.priority),
                None => break,
            };
            let Some(&own) = s.table.get(chain) else {
                break;
            };
            // Still the same content (the copy may have been evicted and its block
            // registered again since).
            let same = s.prefix.as_deref().is_some_and(|p| {
                let key = p.keys.get(chain).map_or(&[][..], |k| &k[..]);
                p.ids.get(..bs).is_some_and(|ids| {
                    self.prefix.hash_of(copy) == Some(hash)
                        && self.prefix.confirms(copy, p.last, &p.ns, ids, key)
                })
            });
            let take = if same {
                match (self.pool.state(copy), self.pool.refcount(own)) {
                    (Ok(state), Ok(own_refs)) => {
                        let revive = state == BlockState::Cached;
                        if own_refs > 1 {
                            // A fork sibling holds the own block too: wait until it
                            // is this sequence's alone.
                            break;
                        }
                        Some(revive)
                    }
                    (Err(e), _) | (_, Err(e)) => {
                        result = Err(e);
                        break;
                    }
                }
            } else {
                None
            };
            if let Some(p) = s.prefix.as_deref_mut() {
                p.twin = None;
            }
            s.twin_pending = false;
            if let Some(revive) = take {
                if let Err(e) = self.share_copy(copy, priority, revive) {
                    result = Err(e);
                    break;
                }
                s.table[chain] = copy;
                self.tables_changed();
                if let Err(e) = self.release_block(own) {
                    result = Err(e);
                }
                if let Some(p) = s.prefix.as_deref_mut() {
                    p.chain += 1;
                    p.last = Some(hash);
                    p.ids.drain(..bs);
                }
            }
            // The next blocks (or the own block, when the copy left).
            registered += extend_chain_in(&mut self.prefix, bs, &mut s);
            if result.is_err() {
                break;
            }
        }
        self.seqs.put(h, s);
        result.map(|()| registered)
    }

    /// Blocks settling the first pending twin of `s` with no spare block gives back:
    /// one when the cached copy is live and the sequence's own block is its alone
    /// (sharing a cached copy revives it, which takes back the block the own one
    /// frees; a block a fork sibling still holds frees nothing).
    pub(crate) fn twin_frees(&self, s: &Sequence) -> usize {
        let Some((hash, copy)) = s.prefix.as_deref().and_then(|p| p.twin) else {
            return 0;
        };
        let own = s.prefix.as_deref().and_then(|p| s.table.get(p.chain));
        let frees = self.prefix.hash_of(copy) == Some(hash)
            && self.pool.state(copy) == Ok(BlockState::Live)
            && own.is_some_and(|&b| self.pool.refcount(b) == Ok(1));
        usize::from(frees)
    }

    /// Takes a reference to registered block `b` for a sequence that holds its whole
    /// content: revives it when cached.
    fn share_copy(&mut self, b: BlockId, priority: i32, revive: bool) -> Result<()> {
        let bs = self.block_size();
        if revive {
            self.pool.revive(b)?;
            if let Some(f) = self.pool.fill_mut(b) {
                *f = bs as u16;
            }
            self.live_token_slots += bs;
        } else {
            self.pool.incref(b)?;
            // The new holder holds the whole block (a holder that truncated into it may
            // have lowered the fill).
            if usize::from(self.pool.fill(b)) < bs {
                self.fill_dirty.insert(b);
                self.set_fill(b, bs);
            }
        }
        self.prefix.on_hit(b, priority, revive);
        Ok(())
    }

    /// Cached blocks among `blocks` that count as available (so reviving them uses
    /// availability up).
    /// Blocks admitting `hit`'s prompt in full takes from the available ones: the
    /// uncached blocks, plus each cached hit block it revives (it stops being
    /// evictable).
    pub(crate) fn hit_admission_blocks(&self, hit: &PrefixHit) -> usize {
        self.layout.blocks_for_tokens(hit.prompt_len) - hit.blocks.len()
            + self.count_evictable(&hit.blocks)
    }

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

    /// After `s` was truncated to `new_len`: the chain and known ids follow (the new
    /// last block's kept ids come from the cache), so registration goes on from the
    /// new length. A pending twin is dropped: the next registration finds it again if
    /// its block is still full.
    pub(crate) fn prefix_after_truncate(&mut self, s: &mut Sequence, new_len: usize) {
        let bs = self.block_size();
        s.twin_pending = false;
        let Some(p) = s.prefix.as_deref_mut() else {
            return;
        };
        p.twin = None;
        let chain_tokens = p.chain * bs;
        if new_len >= chain_tokens {
            p.ids.truncate(new_len - chain_tokens);
            return;
        }
        let keep = new_len / bs;
        p.chain = keep;
        p.ids.clear();
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
            _ if tail == 0 => Some(&[][..]),
            _ => None,
        };
        match tail_ids {
            Some(ids) if keep == 0 || p.last.is_some() => p.ids.extend_from_slice(ids),
            // A chain block that is not registered: only a corrupt state gets here.
            _ => {
                s.prefix = None;
                s.tracking_stopped = true;
            }
        }
    }

    /// The prefix half of [`Self::check_invariants`]: the index against the pool, and
    /// every tracked sequence's chain against its table: the chain covers only
    /// computed tokens (known ids may run ahead: a prompt's are known at admission),
    /// and every link is registered under its parent.
    pub(crate) fn check_prefix_invariants(&self) -> std::result::Result<(), String> {
        self.prefix.check(&self.pool)?;
        let bs = self.block_size();
        for (id, s) in &self.seqs {
            let Some(p) = s.prefix.as_deref() else {
                continue;
            };
            if p.chain > s.table.len() || p.chain * bs > s.computed {
                return Err(format!(
                    "{id}: chain of {} blocks over {} blocks with {} computed tokens",
                    p.chain,
                    s.table.len(),
                    s.computed
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
            if s.twin_pending != p.twin.is_some() {
                return Err(format!(
                    "{id}: twin pending {} but twin {:?}",
                    s.twin_pending, p.twin
                ));
            }
            if let Some((hash, copy)) = p.twin {
                let own = s.table.get(p.chain).copied();
                // The copy may have been evicted since (then the settling registers
                // the sequence's own block, whose id may even be the copy's old one,
                // reused after a defragmentation moved it there), and a fork sibling
                // holding the same block may have registered it under the same hash.
                let own_hash = own.and_then(|b| self.prefix.hash_of(b));
                if own.is_none()
                    || own_hash.is_some_and(|h| h != hash)
                    || (p.chain + 1) * bs > s.computed
                {
                    return Err(format!(
                        "{id}: block {} ({own:?}, registered as {own_hash:?}) twins {copy} \
                         ({hash:?}) but is not a full computed block of that content",
                        p.chain
                    ));
                }
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
    use crate::manager::{CacheConfig, KvCache};
    use crate::pool::prefix::AdmitOptions;

    fn kv(num_blocks: usize) -> KvCache {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 1,
            num_kv_heads: 1,
            head_dim: 2,
            kv_dtype: DType::F32,
        };
        KvCache::new(
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
        kv.fill_dirty.resize(4);
        kv.check_invariants().unwrap();
    }
}
