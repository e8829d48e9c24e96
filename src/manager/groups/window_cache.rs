//! The sliding-window groups' cache of given-back blocks, so that a prefix hit does
//! not need a live sequence that still holds the window.
//!
//! A window group's block leaves its sequence when it falls out of the window of the
//! next query, or when the sequence is freed. If no other sequence holds it, and the
//! first full (or latent) group holds the sequence's block at the same index
//! registered under chain hash `H` (the hash of the whole prefix up to the block's
//! end, salt and extra keys included), the page is kept, keyed by `H`: it holds the
//! window layers' K/V of exactly that prefix's last block. A hit of `h` blocks then
//! needs, in every window group, only the blocks inside the window of the query at
//! `h * block_size` (the first token it computes), each found cached by its hash or
//! held by a live sequence whose full-group block at that index is the hit's; the
//! blocks before are holes of the new sequence (as vLLM's `SlidingWindowManager`
//! does with its null blocks).
//!
//! Why not the group's own prefix index: the index is a tree whose parents outlive
//! their children (a block with registered children is never evicted, and a live
//! block's parent is live), which a window breaks: it gives back the oldest blocks
//! of a prefix first, while the newer ones stay live. The pages are instead held, in
//! the window group's manager, by one hidden sequence ([`WINDOW_CACHE`]) whose table
//! is the cache's pages slot after slot (removing a slot moves the last one into
//! it), as the state groups' checkpoints are: compaction moves them like any page,
//! the group's invariants count them, and each holds one reference (the holder's)
//! until it is revived or evicted. They count as free for every allocation, as
//! cached blocks do: when the arena runs short they go after the groups' prefix
//! caches' pages, the least recently kept first.
//!
//! The calls that give window blocks back keep them: [`Groups::commit`], the appends
//! and reservations, [`Groups::free`], and the batch step's reservation and commit
//! (`manager/step.rs`). A swap-out, a truncation, a sequence whose ids the full group
//! does not track, and a window block whose full-group block is not registered (a
//! duplicate's) give them to the free list as before.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};
use crate::pool::prefix::BlockHash;
use crate::pool::BlockState;

use super::{is_hidden, GroupSpec, Groups};
use crate::manager::{KvCache, PrefixHit, SeqIdHasher, Sequence};

/// Cached pages by chain hash. The key is already a well-mixed 64-bit hash, so one
/// multiply ([`SeqIdHasher`]'s) spreads it; SipHash was about 4 % of a prefix-caching
/// batch step's instructions (every kept, revived and evicted window page hashes).
type ByHash = HashMap<BlockHash, usize, BuildHasherDefault<SeqIdHasher>>;

/// The hidden sequence of each window group that holds its cached pages.
pub(in crate::manager) const WINDOW_CACHE: SeqId = SeqId(u64::MAX - 3);

/// The window groups' cached pages.
#[derive(Debug, Clone, Default)]
pub(in crate::manager) struct WindowCache {
    /// By group: the slot (index in the holder's table) of each cached hash.
    by_hash: Vec<ByHash>,
    /// By group and slot: what the page holds and when it was cached.
    slots: Vec<Vec<Kept>>,
    /// Pages cached, all groups together.
    count: usize,
    /// `(tick, group, hash)` of the pages in the order they were cached, oldest
    /// first; an entry whose page left the cache since (revived) is stale, skipped by
    /// eviction and dropped in place when the queue is full. Sized at creation to
    /// twice the arena, so it never grows.
    order: VecDeque<(u64, usize, BlockHash)>,
    clock: u64,
    /// Scratch of the calls that give window blocks back (`note_leaving`).
    leaving: Vec<Leaving>,
    /// The full (or latent) group whose registered chain keys the window groups'
    /// blocks: the first one, when there is a window group, no state group, and every
    /// group has its block size (else window groups keep nothing and serve no hit).
    key: Option<usize>,
}

impl WindowCache {
    /// An empty cache for the window groups among `specs`, over an arena of `pages`
    /// pages.
    pub(in crate::manager) fn new(specs: &[GroupSpec], pages: usize) -> Self {
        let kv_group = |s: &GroupSpec| s.state_pages.is_none();
        let key = specs
            .iter()
            .position(|s| kv_group(s) && s.window.is_none())
            .filter(|&f| {
                // With a state group, a hit resumes only from a checkpoint, and no
                // checkpoint serves a cache with a window group (`checkpoints.rs`):
                // nothing kept could serve a hit.
                let bs = specs[f].layout.block_size();
                specs.iter().any(|s| s.window.is_some())
                    && specs
                        .iter()
                        .all(|s| kv_group(s) && s.layout.block_size() == bs)
            });
        // Room for every page of the arena, allocated once (none at all when nothing
        // is ever kept).
        let room = |s: &GroupSpec| match (key, s.window) {
            (Some(_), Some(_)) => pages,
            _ => 0,
        };
        WindowCache {
            by_hash: specs
                .iter()
                .map(|s| ByHash::with_capacity_and_hasher(room(s), Default::default()))
                .collect(),
            slots: specs.iter().map(|s| Vec::with_capacity(room(s))).collect(),
            order: VecDeque::with_capacity(if key.is_some() { 2 * pages } else { 0 }),
            key,
            ..Self::default()
        }
    }

    /// Pages cached, all window groups together.
    pub(in crate::manager) fn len(&self) -> usize {
        self.count
    }

    /// Where `(g, hash)` cached at `tick` is now, if it still is.
    fn live(&self, tick: u64, g: usize, hash: BlockHash) -> Option<usize> {
        let &slot = self.by_hash[g].get(&hash)?;
        (self.slots[g][slot].tick == tick).then_some(slot)
    }
}

/// One cached window page: the chain hash of its prefix, its block index in the
/// sequences that hold that prefix (a hit checks it, as the checkpoints check their
/// position: a hash met at another depth is a collision), and when it was cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kept {
    hash: BlockHash,
    index: usize,
    tick: u64,
}

/// A window block that a call may give back: its sequence and group, its index in
/// the sequence's table, its page, and the full group's chain hash at that index
/// when it is known before the call.
#[derive(Debug, Clone, Copy)]
pub(in crate::manager) struct Leaving {
    seq: SeqId,
    g: usize,
    index: usize,
    page: BlockId,
    hash: Option<BlockHash>,
}

/// Where a window hit finds one of its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::manager) enum WindowSource {
    /// Cached under this chain hash.
    Cached(BlockHash),
    /// Held by a live sequence.
    Live(BlockId),
}

/// A hit's window blocks: for every window group `g`, the sources of table indices
/// `first[g]..` up to the hit's end (the indices before are holes).
#[derive(Debug, Clone, Default)]
pub(in crate::manager) struct WindowHit {
    first: Vec<usize>,
    sources: Vec<Vec<WindowSource>>,
}

impl WindowHit {
    /// Cached pages the hit revives in group `g` (they stop being free).
    pub(in crate::manager) fn revived(&self, g: usize) -> usize {
        self.sources.get(g).map_or(0, |s| {
            s.iter()
                .filter(|s| matches!(s, WindowSource::Cached(_)))
                .count()
        })
    }
}

impl KvCache {
    /// Adds the hidden holder of cached window pages (a window group's manager).
    pub(in crate::manager) fn insert_window_cache_holder(&mut self) -> Result<()> {
        self.seqs.reserve_room(1)?;
        self.seqs
            .insert(WINDOW_CACHE, Sequence::default())
            .map(|_| ())
    }
}

impl Groups {
    /// See [`WindowCache::key`].
    fn window_key_group(&self) -> Option<usize> {
        self.window_cache.key
    }

    /// Cached window pages an allocation may evict now, all groups together.
    pub(in crate::manager) fn window_cached_pages(&self) -> usize {
        self.window_cache.len()
    }

    /// Cached window pages group `g` holds.
    pub(in crate::manager) fn window_cache_pages_of(&self, g: usize) -> usize {
        self.window_cache.slots.get(g).map_or(0, Vec::len)
    }

    /// The chain hash under which group `f` registered `seq`'s block `index`.
    fn chain_hash(&self, f: usize, seq: SeqId, index: usize) -> Option<BlockHash> {
        let kv = &self.groups[f];
        let b = *kv.seq(seq).ok()?.table.get(index)?;
        kv.prefix.hash_of(b)
    }

    /// Forgets the window blocks noted for the last call: a call that gives window
    /// blocks back calls it first, then [`Self::note_leaving`], then does its work,
    /// then [`Self::keep_leaving`].
    pub(in crate::manager) fn forget_leaving(&mut self) {
        self.window_cache.leaving.clear();
    }

    /// Notes the window blocks of `seq` a call gives back when the next query reaches
    /// `query` (`None`: every computed block, the sequence is freed). Notes nothing
    /// for a sequence whose ids the key group does not track (it registers nothing).
    pub(in crate::manager) fn note_leaving(&mut self, seq: SeqId, query: Option<usize>) {
        let Some(f) = self.window_key_group() else {
            return;
        };
        if self.groups[f].seq(seq).map_or(true, |s| s.prefix.is_none()) {
            return;
        }
        // Out of the cache while the groups are read (no allocation: an empty Vec).
        let mut out = std::mem::take(&mut self.window_cache.leaving);
        for (g, kv) in self.groups.iter().enumerate() {
            if kv.window.is_none() {
                continue;
            }
            let Ok(s) = kv.seq(seq) else { continue };
            if s.in_flight.is_some() {
                continue;
            }
            let end = match query {
                Some(q) => kv.first_block_in_window(q),
                None => s.computed / kv.block_size(),
            }
            .min(s.table.len());
            for index in s.released..end {
                out.push(Leaving {
                    seq,
                    g,
                    index,
                    page: s.table[index],
                    hash: self.chain_hash(f, seq, index),
                });
            }
        }
        self.window_cache.leaving = out;
    }

    /// After the call [`Self::note_leaving`] noted blocks for: keeps in the cache each
    /// page the call gave back to the free list (no other sequence held it) whose
    /// chain hash is known and not cached yet. Callers run it before an allocation
    /// could reuse a page (a page taken since is not free, and is skipped).
    pub(in crate::manager) fn keep_leaving(&mut self) -> Result<()> {
        let Some(f) = self.window_key_group() else {
            return Ok(());
        };
        if self.window_cache.leaving.is_empty() {
            return Ok(());
        }
        let leaving = std::mem::take(&mut self.window_cache.leaving);
        let done = self.keep_each(f, &leaving);
        self.window_cache.leaving = leaving;
        done
    }

    fn keep_each(&mut self, f: usize, leaving: &[Leaving]) -> Result<()> {
        for l in leaving {
            let Some(hash) = l.hash.or_else(|| self.chain_hash(f, l.seq, l.index)) else {
                continue;
            };
            let kv = &self.groups[l.g];
            if kv.pool.state(l.page)? != BlockState::Free
                || self.window_cache.by_hash[l.g].contains_key(&hash)
            {
                continue;
            }
            self.cache_page(l.g, l.page, hash, l.index)?;
        }
        Ok(())
    }

    /// Takes free page `page` of window group `g`, block `index` of the prefix whose
    /// chain hash is `hash`, into the cache.
    fn cache_page(&mut self, g: usize, page: BlockId, hash: BlockHash, index: usize) -> Result<()> {
        let kv = &mut self.groups[g];
        let bs = kv.block_size();
        kv.pool.take(page)?;
        if let Some(fill) = kv.pool.fill_mut(page) {
            *fill = 0;
        }
        kv.set_fill(page, bs);
        let holder = kv
            .seqs
            .get_mut(&WINDOW_CACHE)
            .ok_or(Error::UnknownSequence(WINDOW_CACHE))?;
        let slot = holder.table.len();
        holder.table.push(page);
        holder.num_tokens += bs;
        holder.computed += bs;
        let c = &mut self.window_cache;
        c.clock += 1;
        c.slots[g].push(Kept {
            hash,
            index,
            tick: c.clock,
        });
        c.by_hash[g].insert(hash, slot);
        c.count += 1;
        if c.order.len() == c.order.capacity() {
            // Full: drop the stale entries (at most `pages` are live), in place.
            let (by_hash, slots) = (&c.by_hash, &c.slots);
            c.order
                .retain(|&(t, g, h)| by_hash[g].get(&h).is_some_and(|&s| slots[g][s].tick == t));
        }
        c.order.push_back((c.clock, g, hash));
        Ok(())
    }

    /// Removes slot `slot` of group `g` from the cache and returns its page, still
    /// holding the holder's reference (the caller hands it on or releases it); the
    /// last slot moves into it.
    fn uncache_slot(&mut self, g: usize, slot: usize) -> Result<BlockId> {
        let kv = &mut self.groups[g];
        let bs = kv.block_size();
        let holder = kv
            .seqs
            .get_mut(&WINDOW_CACHE)
            .ok_or(Error::UnknownSequence(WINDOW_CACHE))?;
        let c = &mut self.window_cache;
        if holder.table.len() != c.slots[g].len() || slot >= holder.table.len() {
            return Err(Error::CorruptBlockTable(format!(
                "group {g}: cached window slot {slot} of {} pages, {} slots",
                holder.table.len(),
                c.slots[g].len()
            )));
        }
        let page = holder.table.swap_remove(slot);
        holder.num_tokens -= bs;
        holder.computed -= bs;
        kv.tables_changed();
        let gone = c.slots[g].swap_remove(slot);
        c.by_hash[g].remove(&gone.hash);
        c.count -= 1;
        if let Some(moved) = c.slots[g].get(slot) {
            c.by_hash[g].insert(moved.hash, slot);
        }
        Ok(page)
    }

    /// Evicts the least recently cached window page; false when none is cached.
    pub(in crate::manager) fn evict_window_page(&mut self) -> Result<bool> {
        while let Some((tick, g, hash)) = self.window_cache.order.pop_front() {
            if let Some(slot) = self.window_cache.live(tick, g, hash) {
                let page = self.uncache_slot(g, slot)?;
                self.groups[g].release_block(page)?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Evicts up to `max_pages` cached window pages; returns how many.
    pub(in crate::manager) fn evict_window_pages(&mut self, max_pages: usize) -> Result<usize> {
        let mut evicted = 0;
        while evicted < max_pages && self.evict_window_page()? {
            evicted += 1;
        }
        Ok(evicted)
    }

    /// The deepest hit of at most `cached` tokens (whole blocks of the full groups'
    /// hit `hits`) whose window every window group serves, cached or live, and where
    /// each block comes from; `(0, None)` when none (or no window group).
    pub(in crate::manager) fn window_hit(
        &self,
        hits: &[PrefixHit],
        cached: usize,
    ) -> (usize, Option<WindowHit>) {
        let Some(f) = self.window_key_group() else {
            return (0, None);
        };
        let full = &self.groups[f];
        let bs = full.block_size();
        let top = (cached / bs).min(hits[f].blocks().len());
        let hit = &hits[f].blocks()[..top];
        // The hit's blocks are registered: their hashes are the prompt's chain.
        let hashes: Vec<Option<BlockHash>> = hit.iter().map(|&b| full.prefix.hash_of(b)).collect();
        let mut found: Vec<Vec<Option<WindowSource>>> = vec![Vec::new(); self.groups.len()];
        for (g, kv) in self.groups.iter().enumerate() {
            if kv.window.is_none() {
                continue;
            }
            let (cache, kept) = (&self.window_cache.by_hash[g], &self.window_cache.slots[g]);
            let mut src: Vec<Option<WindowSource>> = hashes
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    h.filter(|h| cache.get(h).is_some_and(|&slot| kept[slot].index == i))
                        .map(WindowSource::Cached)
                })
                .collect();
            // A live sequence holding the hit's full block at index `i` holds the
            // prompt's tokens up to there (a registered block is keyed by its whole
            // prefix), so its window block `i` holds the prompt's K/V.
            for (&id, s) in full.seqs.iter() {
                if is_hidden(id) || s.in_flight.is_some() {
                    continue;
                }
                let Ok(w) = kv.seq(id) else { continue };
                if w.in_flight.is_some() {
                    continue;
                }
                let end = top
                    .min(w.table.len())
                    .min(w.computed / bs)
                    .min(s.table.len());
                for i in w.released..end {
                    if src[i].is_none() && s.table[i] == hit[i] {
                        src[i] = Some(WindowSource::Live(w.table[i]));
                    }
                }
            }
            found[g] = src;
        }
        // missing[g][k]: blocks before index `k` no source serves.
        let missing: Vec<Vec<usize>> = found
            .iter()
            .map(|src| {
                let mut m = Vec::with_capacity(src.len() + 1);
                m.push(0);
                for s in src {
                    m.push(m[m.len() - 1] + usize::from(s.is_none()));
                }
                m
            })
            .collect();
        for h in (1..=top).rev() {
            let serves = |g: usize, kv: &KvCache| {
                let first = kv.first_block_in_window(h * bs).min(h);
                missing[g][h] == missing[g][first]
            };
            let all = self
                .groups
                .iter()
                .enumerate()
                .all(|(g, kv)| kv.window.is_none() || serves(g, kv));
            if !all {
                continue;
            }
            let mut wh = WindowHit {
                first: vec![0; self.groups.len()],
                sources: vec![Vec::new(); self.groups.len()],
            };
            for (g, kv) in self.groups.iter().enumerate() {
                if kv.window.is_some() {
                    let first = kv.first_block_in_window(h * bs).min(h);
                    wh.first[g] = first;
                    wh.sources[g] = found[g][first..h].iter().flatten().copied().collect();
                }
            }
            return (h * bs, Some(wh));
        }
        (0, None)
    }

    /// Admits `seq` in window group `g` with the first `cached` tokens computed: the
    /// blocks of `hit` (cached ones revived, live ones shared), holes before them.
    /// Registers nothing. Checks every source before it changes anything.
    pub(in crate::manager) fn admit_window_hit(
        &mut self,
        g: usize,
        seq: SeqId,
        cached: usize,
        hit: &WindowHit,
    ) -> Result<crate::pool::prefix::Admission> {
        let (first, sources) = (hit.first[g], &hit.sources[g]);
        let kv = &self.groups[g];
        if kv.contains(seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        if first + sources.len() != cached / kv.block_size() {
            return Err(Error::CorruptBlockTable(format!(
                "group {g}: a window hit of {cached} tokens with {} blocks after {first}",
                sources.len()
            )));
        }
        for src in sources {
            let ok = match *src {
                WindowSource::Cached(h) => self.window_cache.by_hash[g].contains_key(&h),
                WindowSource::Live(p) => kv.pool.state(p).is_ok_and(|s| s == BlockState::Live),
            };
            if !ok {
                return Err(Error::CorruptBlockTable(format!(
                    "group {g}: the window block {src:?} of a hit is gone"
                )));
            }
        }
        self.groups[g].seqs.reserve_room(1)?;
        let mut table = Vec::with_capacity(first + sources.len() + 1);
        table.resize(first, BlockId::RELEASED);
        for src in sources {
            let page = match *src {
                WindowSource::Cached(h) => {
                    let slot = self.window_cache.by_hash[g][&h];
                    // The holder's reference passes to the sequence.
                    self.uncache_slot(g, slot)?
                }
                WindowSource::Live(p) => {
                    self.groups[g].pool.incref(p)?;
                    p
                }
            };
            table.push(page);
        }
        let kv = &mut self.groups[g];
        let s = Sequence {
            table,
            released: first,
            num_tokens: cached,
            computed: cached,
            admission: kv.tiers.next_admission(),
            ..Sequence::default()
        };
        kv.seqs.insert(seq, s)?;
        Ok(crate::pool::prefix::Admission {
            cached_tokens: cached,
            cached_blocks: sources.len(),
            new_blocks: 0,
            registered_blocks: 0,
            loading_tokens: 0,
        })
    }

    /// The cache's invariants: each window group's holder holds exactly the cached
    /// pages, each once and by it alone, and the index and order match the slots.
    pub(in crate::manager) fn check_window_cache(&self) -> std::result::Result<(), String> {
        let c = &self.window_cache;
        let mut total = 0;
        for (g, kv) in self.groups.iter().enumerate() {
            let slots = &c.slots[g];
            total += slots.len();
            if kv.window.is_none() {
                if !slots.is_empty() || !c.by_hash[g].is_empty() {
                    return Err(format!("group {g}: window pages cached in a full group"));
                }
                continue;
            }
            let holder = kv
                .seq(WINDOW_CACHE)
                .map_err(|e| format!("group {g}: {e}"))?;
            if holder.table.len() != slots.len()
                || holder.computed != slots.len() * kv.block_size()
                || holder.num_tokens != holder.computed
                || holder.released != 0
            {
                return Err(format!(
                    "group {g}: {} cached window pages ({} tokens) for {} slots",
                    holder.table.len(),
                    holder.computed,
                    slots.len()
                ));
            }
            if let Some(&b) = holder
                .table
                .iter()
                .find(|&&b| kv.pool.refcount(b).unwrap_or(0) != 1)
            {
                return Err(format!(
                    "group {g}: cached window page {b} is shared or free"
                ));
            }
            if c.by_hash[g].len() != slots.len()
                || slots
                    .iter()
                    .enumerate()
                    .any(|(i, k)| c.by_hash[g].get(&k.hash) != Some(&i))
            {
                return Err(format!(
                    "group {g}: window cache index disagrees with its slots"
                ));
            }
        }
        // Every cached page is in the order once, oldest first.
        let live: Vec<u64> = c
            .order
            .iter()
            .filter(|&&(t, g, h)| c.live(t, g, h).is_some())
            .map(|&(t, _, _)| t)
            .collect();
        if live.len() != total || c.count != total || live.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!(
                "window cache order holds {} of {total} pages ({} counted), or out of order",
                live.len(),
                c.count
            ));
        }
        Ok(())
    }
}

/// The batch step path (`manager/step.rs`).
impl Groups {
    /// [`Self::forget_leaving`], then [`Self::note_leaving`] for the commit of
    /// `accepted` (group 0's handles and accepted counts), at the items `giving`
    /// lists (`scan_step`: the others give nothing back).
    pub(in crate::manager) fn note_step_leaving(
        &mut self,
        accepted: &[(crate::ids::SeqHandle, usize)],
        giving: &[u32],
    ) {
        self.forget_leaving();
        if self.window_key_group().is_none() {
            return;
        }
        for &i in giving {
            let Some(&(h, n)) = accepted.get(i as usize) else {
                continue;
            };
            if let Some((id, s)) = self.groups[0].seqs.at(h) {
                let query = s.computed + n;
                self.note_leaving(id, Some(query));
            }
        }
    }

    /// Before a batch step's reservations (the groups' `fill_step`): gives back, and
    /// keeps, the window blocks of each entry's sequence that lie before the window
    /// of its next query (at its computed count), which the reservation would
    /// otherwise give straight to the free list: those of a prompt an admission
    /// computed, whose query never ran. Only the entries `giving` lists (`scan_step`)
    /// hold any. Releasing them first changes no count a reservation checked (each
    /// page given back is kept, still counted free) and leaves no page free for an
    /// allocation of the step to take before it is kept.
    pub(in crate::manager) fn keep_dead_windows(
        &mut self,
        entries: &[crate::manager::StepEntry],
        giving: &[u32],
    ) -> Result<()> {
        if self.window_key_group().is_none() {
            return Ok(());
        }
        self.forget_leaving();
        for &i in giving {
            let Some(e) = entries.get(i as usize) else {
                continue;
            };
            let Some((id, s)) = self.groups[0].seqs.at(e.seq) else {
                continue;
            };
            let query = s.computed;
            self.note_leaving(id, Some(query));
            for g in 0..self.groups.len() {
                if self.groups[g].window.is_some() {
                    let h = self.known_handle(g, e.seq)?;
                    self.groups[g].release_out_of_window(h, query)?;
                }
            }
        }
        self.keep_leaving()
    }
}
