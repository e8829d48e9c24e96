//! The prefix index: which registered block holds which content, and which of them
//! may be evicted next.
//!
//! Every registered block has an entry (its hash, the hash of its parent block, its
//! token ids, its namespace if it is the first block of a prompt, its extra-key bytes
//! if a keyed span starts in it) and is found by hash through `by_hash`, one block per
//! hash. A hit is confirmed against the entry before reuse: the tokens must be equal,
//! the parent must be the block just confirmed (so the whole chain is confirmed by
//! induction from the first block), the block's extra-key bytes must be equal, and the
//! first block's namespace bytes must be equal. A different prompt whose hash collides
//! is a miss.
//!
//! Parent links are hashes, not block ids, so a block can move (defragmentation) by
//! updating one map entry. That is exact because a block is registered only under a
//! registered parent that its sequence holds, and a block with registered children is
//! never evicted: the block a parent hash names cannot change while a child names it.
//!
//! Eviction candidates are cached, unpinned leaves (no registered children), ordered by
//! `(priority, policy key, block)`: in a sorted intrusive list when they arrive in order
//! (O(1), the usual case under `LruPolicy`), in an ordered set otherwise (O(log n)); see
//! `candidates`.

use std::collections::HashMap;
use std::sync::Arc;

use super::candidates::Candidates;
use super::{
    AdmitOptions, BlockDigest, BlockHash, EvictionCandidate, Medium, PrefixConfig, PrefixEvent,
    PrefixStats,
};
use crate::error::{Error, Result};
use crate::ids::{BlockId, PinId};
use crate::pool::{BlockPool, BlockState};

mod spill;
mod table;
mod tokens;
use crate::pool::prefetch;
pub use spill::DiskEntry;
pub(crate) use spill::SavedEntry;
use table::HashSlots;
use tokens::TokenStore;

/// A request's namespace: the exact key bytes (compared on every first-block hit) and
/// the hash seed the first block chains from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Namespace {
    pub(crate) key: Arc<[u8]>,
    pub(crate) seed: BlockHash,
}

impl Namespace {
    /// `(cache_salt, extra_key)` back from the key bytes (`len(salt): u64 LE ‖ salt ‖
    /// extra_key`, or empty for the default namespace), for digest-chaining hashers.
    pub(crate) fn parts(&self) -> (&[u8], &[u8]) {
        let k = &*self.key;
        let Some(len) = k.get(..8).and_then(|l| <[u8; 8]>::try_from(l).ok()) else {
            return (&[], &[]);
        };
        let split = usize::try_from(u64::from_le_bytes(len))
            .ok()
            .and_then(|n| n.checked_add(8))
            .filter(|&end| end <= k.len())
            .unwrap_or(k.len());
        (&k[8..split], &k[split..])
    }
}

/// A request's per-block extra keys: `(block index in the prompt, extra-key bytes)`,
/// sorted by block index, only for blocks where a keyed span starts (usually none, so
/// usually no allocation). The bytes are encoded as `AdmitOptions::block_keys` says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BlockKeys(Vec<(usize, Arc<[u8]>)>);

impl BlockKeys {
    /// The extra-key bytes of block `index`, if a keyed span starts in it.
    pub(crate) fn get(&self, index: usize) -> Option<&Arc<[u8]>> {
        self.0
            .binary_search_by_key(&index, |&(b, _)| b)
            .ok()
            .and_then(|i| self.0.get(i))
            .map(|(_, k)| k)
    }

    /// The extra-key bytes of block `index` (empty for most blocks).
    pub(crate) fn bytes(&self, index: usize) -> &[u8] {
        self.get(index).map_or(&[], |k| k)
    }
}

/// One registered block, in one aligned 64-byte record: registration, eviction and
/// hit confirmation each read or write it, so it is one cache line (it was 112 bytes
/// over two). The rarely read namespace and extra-key bytes live in `PrefixIndex::cold`.
#[derive(Debug, Clone)]
#[repr(align(64))]
struct Entry {
    hash: BlockHash,
    /// The parent's hash, meaningful when `has_parent` (an `Option` would take 16 bytes).
    parent_hash: BlockHash,
    last_used: u64,
    /// The policy key while `is_candidate`.
    candidate_key: u64,
    /// Where the parent was registered when this block was (meaningful when
    /// `has_parent`): a hint, trusted only while that block's entry still carries the
    /// parent hash (a relocation or an eviction since makes it stale, and the lookup
    /// by hash answers then). Saves a hash probe per eviction.
    parent_block: BlockId,
    depth: u32,
    /// Registered blocks whose parent is this one.
    children: u32,
    pins: u32,
    hits: u32,
    priority: i32,
    /// The priority while `is_candidate`.
    candidate_priority: i32,
    has_parent: bool,
    /// Mirrors the pool: refcount 0, content kept.
    cached: bool,
    /// In the candidate set under `(candidate_priority, candidate_key)`.
    is_candidate: bool,
    /// `PrefixIndex::cold` holds a record for this block (a first block, or one
    /// where a keyed span starts).
    has_cold: bool,
}

const _: () = assert!(std::mem::size_of::<Option<Entry>>() == 64);

impl Entry {
    fn parent(&self) -> Option<BlockHash> {
        self.has_parent.then_some(self.parent_hash)
    }

    fn parent_hint(&self) -> Option<BlockId> {
        self.has_parent.then_some(self.parent_block)
    }

    fn candidate(&self) -> Option<(i32, u64)> {
        self.is_candidate
            .then_some((self.candidate_priority, self.candidate_key))
    }

    fn take_candidate(&mut self) -> Option<(i32, u64)> {
        let c = self.candidate();
        self.is_candidate = false;
        c
    }

    fn set_candidate(&mut self, priority: i32, key: u64) {
        self.candidate_priority = priority;
        self.candidate_key = key;
        self.is_candidate = true;
    }
}

/// The cold part of an entry: read on a first block's hit confirmation, on events
/// and on spills, never on the per-block paths.
#[derive(Debug, Clone, Default)]
struct ColdEntry {
    /// The namespace key, on first blocks only (later blocks inherit it by the chain).
    ns: Option<Arc<[u8]>>,
    /// The block's extra-key bytes, on blocks where a keyed span starts only (later
    /// blocks inherit them by the chain).
    key: Option<Arc<[u8]>>,
}

/// What a lookup found.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lookup {
    /// Hash of the last confirmed block, `None` when nothing hit.
    pub(crate) last: Option<BlockHash>,
    /// A hash hit was rejected on confirmation.
    pub(crate) collision: bool,
}

/// What [`PrefixIndex::register`] did with a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Registration {
    /// Registered: findable by its hash from now on.
    Stored,
    /// Block `.0` is registered under the same hash (the same content, filled
    /// independently): it stays the cached copy.
    Duplicate(BlockId),
    /// Not a live full block of the arena, registered already, or under a parent that
    /// is registered nowhere.
    Refused,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct PrefixIndex {
    block_size: usize,
    entries: Vec<Option<Entry>>,
    /// Namespace and extra-key bytes of the entries flagged `has_cold`, by block.
    cold: HashMap<BlockId, ColdEntry>,
    /// `registered[b] == entries[b].is_some()`, one byte per block: the question
    /// every block release asks, answered without touching the (large) entry.
    registered: Vec<bool>,
    /// `block_size` token ids per block, meaningful for registered blocks.
    tokens: TokenStore,
    by_hash: HashSlots,
    candidates: Candidates,
    pins: HashMap<PinId, BlockHash>,
    next_pin: u64,
    pinned_blocks: usize,
    /// Pinned blocks in the cached state: kept, not evictable, not available.
    pinned_cached: usize,
    clock: u64,
    config: PrefixConfig,
    events: Vec<PrefixEvent>,
    counters: PrefixStats,
    default_ns: Namespace,
    /// The chain digest of each registered block, by block, when the hasher chains
    /// digests wider than the 64-bit key (`PrefixHasher::chains_digests`); empty
    /// otherwise. Meaningful where `registered` is set; follows relocations.
    digests: Vec<BlockDigest>,
    /// The last digest `hash_next` computed, with its key: the registration that
    /// usually follows takes it instead of hashing the block again.
    recent_digest: Option<(BlockHash, BlockDigest)>,
    /// The KV-cache group this index serves on a hybrid cache (its events say so);
    /// `None` on a one-group cache.
    group: Option<u8>,
}

impl PrefixIndex {
    pub(crate) fn new(num_blocks: usize, block_size: usize, config: PrefixConfig) -> Result<Self> {
        if config.max_pinned_blocks > num_blocks {
            return Err(Error::config(
                "max_pinned_blocks",
                format!(
                    "{} exceeds the arena of {num_blocks} blocks",
                    config.max_pinned_blocks
                ),
            ));
        }
        let default_ns = Namespace {
            key: Arc::from(&[][..]),
            seed: config.hasher.namespace(&[], &[]),
        };
        Ok(PrefixIndex {
            block_size,
            entries: vec![None; num_blocks],
            cold: HashMap::new(),
            registered: vec![false; num_blocks],
            tokens: TokenStore::new(num_blocks, block_size),
            // Sized for the whole arena now: growing it re-places every registered
            // hash in the middle of serving.
            by_hash: HashSlots::new(num_blocks),
            candidates: Candidates::new(num_blocks),
            pins: HashMap::new(),
            next_pin: 0,
            pinned_blocks: 0,
            pinned_cached: 0,
            clock: 0,
            events: Vec::new(),
            counters: PrefixStats::default(),
            default_ns,
            digests: if config.hasher.chains_digests() {
                vec![BlockDigest::default(); num_blocks]
            } else {
                Vec::new()
            },
            recent_digest: None,
            group: None,
            config,
        })
    }

    /// Marks this index as group `g`'s of a hybrid cache: its events carry the group.
    pub(crate) fn set_group(&mut self, g: u8) {
        self.group = Some(g);
    }

    /// The hash of a sequence's next full block `tokens` (extra-key bytes `extra`),
    /// chained from `parent`, the hash of the sequence's previous block, registered in
    /// `parent_block` (`None` for a first block, which chains from `ns`).
    pub(crate) fn hash_next(
        &mut self,
        parent: Option<BlockHash>,
        parent_block: Option<BlockId>,
        ns: &Namespace,
        tokens: &[u32],
        extra: &[u8],
    ) -> BlockHash {
        if self.digests.is_empty() {
            return self
                .config
                .hasher
                .block(parent.unwrap_or(ns.seed), tokens, extra);
        }
        let d = self.digest_under(parent.and(parent_block), ns, tokens, extra);
        self.recent_digest = Some((d.key(), d));
        d.key()
    }

    /// A block's digest under the digest of registered block `parent_block` (`None`:
    /// a first block in `ns`), for a digest-chaining hasher.
    fn digest_under(
        &self,
        parent_block: Option<BlockId>,
        ns: &Namespace,
        tokens: &[u32],
        extra: &[u8],
    ) -> BlockDigest {
        let (salt, extra_key) = ns.parts();
        let parent = parent_block.and_then(|pb| self.digests.get(pb.index()));
        self.config
            .hasher
            .block_digest(parent, salt, extra_key, tokens, extra)
    }

    /// The chain digest of registered block `b`, when the hasher chains digests
    /// (`PrefixHasher::chains_digests`); `None` otherwise or when `b` is not registered.
    pub(crate) fn digest_of(&self, b: BlockId) -> Option<BlockDigest> {
        if !self.is_registered(b) {
            return None;
        }
        self.digests.get(b.index()).copied()
    }

    pub(crate) fn config(&self) -> &PrefixConfig {
        &self.config
    }

    /// The namespace of a request, after checking its key lengths.
    pub(crate) fn namespace(&self, opts: &AdmitOptions<'_>) -> Result<Namespace> {
        let limit = self.config.max_key_bytes;
        for (what, key) in [
            ("cache salt", opts.cache_salt),
            ("extra key", opts.extra_key),
        ] {
            if key.len() > limit {
                return Err(Error::PrefixKeyTooLong {
                    what,
                    len: key.len(),
                    limit,
                });
            }
        }
        if opts.cache_salt.is_empty() && opts.extra_key.is_empty() {
            return Ok(self.default_ns.clone());
        }
        // The salt's length goes first so that ("ab", "c") and ("a", "bc") differ.
        let mut key = Vec::with_capacity(8 + opts.cache_salt.len() + opts.extra_key.len());
        key.extend_from_slice(&(opts.cache_salt.len() as u64).to_le_bytes());
        key.extend_from_slice(opts.cache_salt);
        key.extend_from_slice(opts.extra_key);
        Ok(Namespace {
            key: key.into(),
            seed: self
                .config
                .hasher
                .namespace(opts.cache_salt, opts.extra_key),
        })
    }

    /// A request's per-block extra keys (`AdmitOptions::block_keys`), encoded, after
    /// checking their lengths.
    pub(crate) fn block_keys(&self, spans: &[(usize, &[u8])]) -> Result<BlockKeys> {
        if spans.is_empty() {
            return Ok(BlockKeys::default());
        }
        // The encoding writes lengths as u32.
        let limit = self.config.max_key_bytes.min(u32::MAX as usize);
        if let Some(&(_, key)) = spans.iter().find(|(_, key)| key.len() > limit) {
            return Err(Error::PrefixKeyTooLong {
                what: "block key",
                len: key.len(),
                limit,
            });
        }
        let bs = self.block_size;
        let mut order: Vec<usize> = (0..spans.len()).collect();
        order.sort_by_key(|&i| spans[i].0); // stable: equal positions keep their order
        let mut keys = Vec::new();
        let mut i = 0;
        while let Some(&first) = order.get(i) {
            let block = spans[first].0 / bs;
            let mut bytes = Vec::new();
            while let Some(&j) = order.get(i) {
                let (pos, key) = spans[j];
                if pos / bs != block {
                    break;
                }
                // Both fit: the offset is below the block size (a u16), the length was
                // checked above.
                bytes.extend_from_slice(&((pos % bs) as u32).to_le_bytes());
                bytes.extend_from_slice(&(key.len() as u32).to_le_bytes());
                bytes.extend_from_slice(key);
                i += 1;
            }
            keys.push((block, Arc::from(bytes)));
        }
        Ok(BlockKeys(keys))
    }

    /// Confirmed cached blocks for the leading full blocks of `tokens` (with the
    /// request's block `keys`), at most `max_blocks`, pushed onto `out` in order.
    pub(crate) fn lookup(
        &self,
        ns: &Namespace,
        keys: &BlockKeys,
        tokens: &[u32],
        max_blocks: usize,
        out: &mut Vec<BlockId>,
    ) -> Lookup {
        let mut found = Lookup {
            last: None,
            collision: false,
        };
        let wide = !self.digests.is_empty();
        let mut prev = None;
        for (i, chunk) in tokens
            .chunks_exact(self.block_size)
            .take(max_blocks)
            .enumerate()
        {
            let extra = keys.bytes(i);
            let h = if wide {
                self.digest_under(prev, ns, chunk, extra).key()
            } else {
                self.config
                    .hasher
                    .block(found.last.unwrap_or(ns.seed), chunk, extra)
            };
            let Some(b) = self.by_hash.get(h, |b| self.hash_of(b)) else {
                break;
            };
            if !self.confirms(b, found.last, ns, chunk, extra) {
                found.collision = true;
                break;
            }
            out.push(b);
            found.last = Some(h);
            prev = Some(b);
        }
        found
    }

    /// Whether registered block `b` holds exactly this content: chained under
    /// `parent`, the same token ids and extra-key bytes, and for a first block the same
    /// namespace. Compares bytes, never hashes alone.
    pub(crate) fn confirms(
        &self,
        b: BlockId,
        parent: Option<BlockHash>,
        ns: &Namespace,
        tokens: &[u32],
        extra: &[u8],
    ) -> bool {
        // The extra key is compared only when the block has one: `&[] == &[]` still
        // calls `memcmp` on the empty slice's dangling pointer, and glibc's AVX-512
        // `memcmp` reads short inputs with a masked load, which on the AMD EPYC (Zen 4)
        // machines here takes a slow assist at such an address (77 ns a compare
        // against 2 ns on a heap pointer): 7 % of the prefix-on decode trace's time.
        self.entry(b).is_some_and(|e| {
            e.parent() == parent
                && self.block_tokens(b) == tokens
                && self.cold_key(b, e).map_or(extra.is_empty(), |k| k == extra)
                && (e.has_parent || self.cold_ns(b, e) == Some(&*ns.key))
        })
    }

    /// The block registered under parent hash `ph`: `hint` when its entry carries
    /// `ph` (hashes are unique in the index, so that is the block), else by hash.
    #[inline]
    fn resolve_parent(&self, ph: BlockHash, hint: Option<BlockId>) -> Option<BlockId> {
        match hint {
            Some(b) if self.entry(b).is_some_and(|e| e.hash == ph) => Some(b),
            _ => self.block_of(ph),
        }
    }

    /// The cold record of registered block `b` (entry `e`), if it has one.
    fn cold_entry(&self, b: BlockId, e: &Entry) -> Option<&ColdEntry> {
        if e.has_cold {
            self.cold.get(&b)
        } else {
            None
        }
    }

    /// The extra-key bytes of registered block `b` (entry `e`), if it has any.
    fn cold_key(&self, b: BlockId, e: &Entry) -> Option<&[u8]> {
        self.cold_entry(b, e).and_then(|c| c.key.as_deref())
    }

    /// The namespace key of registered first block `b` (entry `e`).
    fn cold_ns(&self, b: BlockId, e: &Entry) -> Option<&[u8]> {
        self.cold_entry(b, e).and_then(|c| c.ns.as_deref())
    }

    fn entry(&self, b: BlockId) -> Option<&Entry> {
        self.entries.get(b.index()).and_then(Option::as_ref)
    }

    fn entry_mut(&mut self, b: BlockId) -> Option<&mut Entry> {
        self.entries.get_mut(b.index()).and_then(Option::as_mut)
    }

    /// Tokens per block.
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// The default namespace (no cache salt, no extra key).
    pub(crate) fn default_namespace(&self) -> Namespace {
        self.default_ns.clone()
    }

    /// The token ids stored for `b` (meaningful when registered).
    pub(crate) fn block_tokens(&self, b: BlockId) -> &[u32] {
        self.tokens.block(b.index())
    }

    /// Whether `b` has an entry (a flag read, no lookup: on every block release).
    #[inline]
    pub(crate) fn is_registered(&self, b: BlockId) -> bool {
        self.registered.get(b.index()).copied().unwrap_or(false)
    }

    pub(crate) fn hash_of(&self, b: BlockId) -> Option<BlockHash> {
        self.entry(b).map(|e| e.hash)
    }

    pub(crate) fn is_pinned(&self, b: BlockId) -> bool {
        self.entry(b).is_some_and(|e| e.pins > 0)
    }

    /// The block registered under `hash`.
    pub(crate) fn block_of(&self, hash: BlockHash) -> Option<BlockId> {
        self.by_hash.get(hash, |b| self.hash_of(b))
    }

    /// Cached blocks that are pinned (kept, but not available).
    pub(crate) fn pinned_cached(&self) -> usize {
        self.pinned_cached
    }

    /// Advances the logical clock.
    pub(crate) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Records a hit on registered block `b`; `revived` when it was cached.
    pub(crate) fn on_hit(&mut self, b: BlockId, priority: i32, revived: bool) {
        let clock = self.tick();
        let Some(e) = self.entry_mut(b) else { return };
        e.hits = e.hits.saturating_add(1);
        e.last_used = clock;
        if revived {
            e.cached = false;
            e.priority = priority;
            let (candidate, pinned) = (e.take_candidate(), e.pins > 0);
            if let Some((p, k)) = candidate {
                self.candidates.remove(p, k, b.0);
            }
            if pinned {
                self.pinned_cached -= 1;
            }
        } else {
            e.priority = e.priority.max(priority);
        }
    }

    /// Counts one admission query.
    pub(crate) fn note_query(&mut self, tokens: usize, hit_blocks: usize, collision: bool) {
        let c = &mut self.counters;
        c.queries += 1;
        c.query_tokens += tokens as u64;
        c.hit_blocks += hit_blocks as u64;
        c.hit_tokens += (hit_blocks * self.block_size) as u64;
        c.rejected_collisions += u64::from(collision);
    }

    /// Registers live full block `b` (with its extra-key bytes `key`, if a keyed span
    /// starts in it). `parent_hint` is where the caller holds the parent block (checked
    /// against `parent`, see [`Self::resolve_parent`]). Anything but
    /// [`Registration::Stored`] changes nothing but a counter.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn register(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        parent_hint: Option<BlockId>,
        ns: &Namespace,
        key: Option<&Arc<[u8]>>,
        tokens: &[u32],
        priority: i32,
    ) -> Registration {
        // The dense flag, not the entry: the entry's line is written below anyway, and
        // reading it first costs a cache miss on every registration.
        if tokens.len() != self.block_size
            || self.is_registered(b)
            || b.index() >= self.entries.len()
        {
            return Registration::Refused;
        }
        // The probe below usually misses the cache: ask for its line first, and write
        // the ids meanwhile (an unregistered block's stored ids mean nothing, so a
        // refused registration leaves nothing behind).
        self.by_hash.prefetch(hash);
        self.tokens.store(b.index(), tokens);
        // The parent first (reads only), then one probe that both refuses a taken
        // hash and claims a free one; a duplicate counts whether or not the parent
        // is registered, as it did when the hash was checked first.
        let (depth, parent_block) = match parent {
            None => (1, None),
            Some(ph) => match self
                .resolve_parent(ph, parent_hint)
                .and_then(|pb| Some((self.entry(pb)?.depth + 1, Some(pb))))
            {
                Some(found) => found,
                None => {
                    return match self.block_of(hash) {
                        Some(copy) => {
                            self.counters.duplicate_blocks += 1;
                            Registration::Duplicate(copy)
                        }
                        None => Registration::Refused,
                    };
                }
            },
        };
        let entries = &self.entries;
        let hash_at = |b: BlockId| Some(entries.get(b.index())?.as_ref()?.hash);
        if let Err(copy) = self.by_hash.insert(hash, b, hash_at) {
            self.counters.duplicate_blocks += 1;
            return Registration::Duplicate(copy);
        }
        // Every check passed: from here on the registration completes.
        if let Some(pb) = parent_block {
            if let Some(pe) = self.entry_mut(pb) {
                pe.children += 1;
                if let Some((p, k)) = pe.take_candidate() {
                    // Unreachable while parents are held by the registering sequence;
                    // kept so the candidate set never holds a non-leaf.
                    self.candidates.remove(p, k, pb.0);
                }
            }
        }
        if !self.digests.is_empty() {
            let d = match self.recent_digest.take() {
                Some((h, d)) if h == hash => d,
                // A registration under a hash computed earlier (a twin, a restored
                // spill): the same content under the same parent, hashed again.
                _ => self.digest_under(parent_block, ns, tokens, key.map_or(&[][..], |k| k)),
            };
            self.digests[b.index()] = d;
        }
        let clock = self.tick();
        self.registered[b.index()] = true;
        let cold = ColdEntry {
            ns: parent.is_none().then(|| ns.key.clone()),
            key: key.filter(|k| !k.is_empty()).cloned(),
        };
        let has_cold = cold.ns.is_some() || cold.key.is_some();
        if has_cold {
            self.cold.insert(b, cold);
        }
        self.entries[b.index()] = Some(Entry {
            hash,
            parent_hash: parent.unwrap_or(BlockHash(0)),
            last_used: clock,
            candidate_key: 0,
            parent_block: parent_block.unwrap_or(BlockId(u32::MAX)),
            depth,
            children: 0,
            pins: 0,
            hits: 0,
            priority,
            candidate_priority: 0,
            has_parent: parent.is_some(),
            cached: false,
            is_candidate: false,
            has_cold,
        });
        self.counters.stored_blocks += 1;
        self.emit_stored(b);
        Registration::Stored
    }

    /// Registered block `b` lost its last table reference and is now cached.
    pub(crate) fn on_cached(&mut self, b: BlockId) {
        let clock = self.tick();
        let Some(e) = self.entry_mut(b) else { return };
        e.cached = true;
        e.last_used = clock;
        if e.pins > 0 {
            self.pinned_cached += 1;
        } else {
            self.offer_candidate(b);
        }
    }

    /// Adds `b` to the candidates when it is a cached, unpinned leaf.
    fn offer_candidate(&mut self, b: BlockId) {
        let Some(e) = self.entries.get(b.index()).and_then(Option::as_ref) else {
            return;
        };
        if !e.cached || e.pins > 0 || e.children > 0 || e.is_candidate {
            return;
        }
        let info = EvictionCandidate {
            last_used: e.last_used,
            depth: e.depth,
            hits: e.hits,
        };
        let key = self.config.policy.key(&info);
        let priority = e.priority;
        if let Some(e) = self.entry_mut(b) {
            e.set_candidate(priority, key);
        }
        self.candidates.insert(priority, key, b.0);
    }

    /// Takes the next victim out of the index; the caller evicts it from the pool.
    pub(crate) fn pop_victim(&mut self) -> Option<BlockId> {
        self.take_victim(true)
    }

    /// Takes the next victim out without a `BlockRemoved` (a reset announces
    /// `AllCleared` instead); the caller evicts it from the pool.
    pub(crate) fn pop_victim_quietly(&mut self) -> Option<BlockId> {
        self.take_victim(false)
    }

    fn take_victim(&mut self, announce: bool) -> Option<BlockId> {
        let (_, key, id) = self.candidates.pop_first()?;
        let b = BlockId(id);
        let e = self.entries.get_mut(b.index())?.take()?;
        self.registered[b.index()] = false;
        if e.has_cold {
            self.cold.remove(&b);
        }
        self.by_hash.remove(e.hash, b);
        self.config.policy.on_evict(key);
        self.counters.evicted_blocks += 1;
        if announce {
            self.emit(PrefixEvent::BlockRemoved {
                hash: e.hash,
                block: b,
                medium: Medium::Device,
                group: self.group,
            });
        }
        if let Some(pb) = e
            .parent()
            .and_then(|ph| self.resolve_parent(ph, e.parent_hint()))
        {
            if let Some(pe) = self.entry_mut(pb) {
                pe.children -= 1;
            }
            self.offer_candidate(pb);
            self.prefetch_eviction(pb);
        }
        Some(b)
    }

    /// Eviction walks a released chain from its leaf up: the parent a victim leaves
    /// behind is almost always the next victim. Its slot in `by_hash`, its own
    /// parent's entry and that parent's candidate record are what that eviction will
    /// read and write (all long cold), so their lines are requested now, while the
    /// caller does a block's worth of other work.
    fn prefetch_eviction(&self, next: BlockId) {
        let Some(e) = self.entry(next) else { return };
        if e.children == 0 && e.is_candidate {
            self.by_hash.prefetch(e.hash);
            if let Some(g) = e.parent_hint() {
                if let Some(ge) = self.entries.get(g.index()) {
                    prefetch(ge);
                }
                self.candidates.prefetch(g.0);
            }
        }
    }

    /// Pins the chain `blocks` (first block first) whose last hash is `last`.
    pub(crate) fn pin(&mut self, blocks: &[BlockId], last: BlockHash) -> Result<PinId> {
        let requested = blocks.iter().filter(|&&b| !self.is_pinned(b)).count();
        let limit = self.config.max_pinned_blocks;
        if self.pinned_blocks + requested > limit {
            return Err(Error::PinLimit {
                requested,
                pinned: self.pinned_blocks,
                limit,
            });
        }
        for &b in blocks {
            let Some(e) = self.entries.get_mut(b.index()).and_then(Option::as_mut) else {
                continue;
            };
            e.pins += 1;
            if e.pins == 1 {
                self.pinned_blocks += 1;
                if e.cached {
                    self.pinned_cached += 1;
                }
                if let Some((p, k)) = e.take_candidate() {
                    self.candidates.remove(p, k, b.0);
                }
            }
        }
        let id = PinId(self.next_pin);
        self.next_pin += 1;
        self.pins.insert(id, last);
        Ok(id)
    }

    /// Releases a pin; returns the blocks it covered.
    pub(crate) fn unpin(&mut self, id: PinId) -> Result<usize> {
        let mut hash = self.pins.remove(&id).ok_or(Error::UnknownPin(id))?;
        let mut blocks = 0;
        while let Some(b) = self.block_of(hash) {
            let Some(e) = self.entry_mut(b) else { break };
            e.pins -= 1;
            let (unpinned, cached, parent) = (e.pins == 0, e.cached, e.parent());
            blocks += 1;
            if unpinned {
                self.pinned_blocks -= 1;
                if cached {
                    self.pinned_cached -= 1;
                    self.offer_candidate(b);
                }
            }
            match parent {
                Some(p) => hash = p,
                None => break,
            }
        }
        Ok(blocks)
    }

    /// Moves the entry of `src` to `dst` (its data moved there). Hash links make this
    /// O(log n); emits `BlockRemoved` then `BlockStored`.
    ///
    /// Defragmentation calls this for every moved block.
    pub(crate) fn relocate(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        let n = self.entries.len();
        for b in [src, dst] {
            if b.index() >= n {
                return Err(Error::BlockOutOfRange {
                    block: b,
                    num_blocks: n,
                });
            }
        }
        if self.entries[dst.index()].is_some() {
            return Err(Error::CorruptBlockTable(format!(
                "relocation into registered block {dst}"
            )));
        }
        let Some(e) = self.entries[src.index()].take() else {
            return Ok(());
        };
        self.registered[src.index()] = false;
        self.registered[dst.index()] = true;
        self.tokens.copy_block(src.index(), dst.index());
        if !self.digests.is_empty() {
            self.digests[dst.index()] = self.digests[src.index()];
        }
        // `src`'s hash leads to `src` in a consistent index (`check_invariants`);
        // the table changes only when it does.
        self.by_hash.repoint(e.hash, src, dst);
        if e.has_cold {
            if let Some(cold) = self.cold.remove(&src) {
                self.cold.insert(dst, cold);
            }
        }
        if let Some((p, k)) = e.candidate() {
            self.candidates.remove(p, k, src.0);
            self.candidates.insert(p, k, dst.0);
        }
        self.emit(PrefixEvent::BlockRemoved {
            hash: e.hash,
            block: src,
            medium: Medium::Device,
            group: self.group,
        });
        self.entries[dst.index()] = Some(e);
        self.emit_stored(dst);
        Ok(())
    }

    /// After a reset evicted every candidate: announces `AllCleared`, then a
    /// `BlockStored` for every block still registered, parents first (by depth), so a
    /// router's copy of the index stays exact. Returns the blocks kept
    /// `(live, cached and pinned)`.
    pub(crate) fn announce_reset(&mut self) -> (usize, usize) {
        let mut kept: Vec<(u32, BlockId)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|e| (e.depth, BlockId(i as u32))))
            .collect();
        let cached = kept
            .iter()
            .filter(|&&(_, b)| self.entry(b).is_some_and(|e| e.cached))
            .count();
        self.emit(PrefixEvent::AllCleared);
        if self.events_on() {
            kept.sort_unstable();
            for &(_, b) in &kept {
                self.emit_stored(b);
            }
        }
        (kept.len() - cached, cached)
    }

    /// Follows the arena to `num_blocks`; shrinking needs no entry at or above it.
    pub(crate) fn resize(&mut self, num_blocks: usize) -> Result<()> {
        if let Some(b) = self
            .entries
            .iter()
            .skip(num_blocks)
            .position(Option::is_some)
        {
            return Err(Error::config(
                "num_blocks",
                format!("block {} is still in the prefix cache", num_blocks + b),
            ));
        }
        self.entries.resize(num_blocks, None);
        self.cold.retain(|b, _| b.index() < num_blocks);
        self.registered.resize(num_blocks, false);
        self.candidates.resize(num_blocks);
        self.tokens.resize(num_blocks);
        if !self.digests.is_empty() {
            self.digests.resize(num_blocks, BlockDigest::default());
        }
        self.by_hash.reserve(num_blocks);
        Ok(())
    }

    /// Whether events go anywhere (recorded or sent); when not, none is built.
    fn events_on(&self) -> bool {
        self.config.record_events || self.config.event_channel.is_some()
    }

    /// Emits `BlockStored` for registered block `b` from its entry; builds nothing when
    /// events are off (the token ids are copied into the event).
    fn emit_stored(&mut self, b: BlockId) {
        if !self.events_on() {
            return;
        }
        let Some(e) = self.entry(b) else { return };
        let event = PrefixEvent::BlockStored {
            hash: e.hash,
            parent: e.parent(),
            block: b,
            token_ids: self.block_tokens(b).to_vec(),
            block_size: self.block_size,
            extra_keys: self.cold_key(b, e).map(<[u8]>::to_vec).unwrap_or_default(),
            medium: Medium::Device,
            group: self.group,
        };
        self.emit(event);
    }

    /// Records `event` for `drain_events` and sends it to the channel, as configured.
    /// The channel never blocks the manager: a full or closed channel drops the event
    /// and counts it.
    fn emit(&mut self, event: PrefixEvent) {
        match &self.config.event_channel {
            Some(tx) => {
                if self.config.record_events {
                    self.events.push(event.clone());
                }
                if tx.try_send(event).is_err() {
                    self.counters.dropped_events += 1;
                }
            }
            None if self.config.record_events => self.events.push(event),
            None => {}
        }
    }

    pub(crate) fn drain_events(&mut self, out: &mut Vec<PrefixEvent>) {
        out.append(&mut self.events);
    }

    pub(crate) fn stats(&self, pool_cached: usize) -> PrefixStats {
        PrefixStats {
            registered_blocks: self.by_hash.len(),
            evictable_blocks: pool_cached - self.pinned_cached,
            pinned_blocks: self.pinned_blocks,
            pins: self.pins.len(),
            ..self.counters
        }
    }

    /// Parent hash of registered block `b` (`Some(None)` for a first block).
    pub(crate) fn parent_of(&self, b: BlockId) -> Option<Option<BlockHash>> {
        self.entry(b).map(Entry::parent)
    }

    /// Checks the index against the pool; see `KvCache::check_invariants`.
    pub(crate) fn check(&self, pool: &BlockPool) -> std::result::Result<(), String> {
        if self.entries.len() != pool.num_blocks() {
            return Err(format!(
                "index covers {} blocks, pool {}",
                self.entries.len(),
                pool.num_blocks()
            ));
        }
        let mut children = vec![0u32; self.entries.len()];
        let mut registered = 0;
        let (mut pinned, mut pinned_cached) = (0, 0);
        let mut candidates = 0;
        if self.registered.len() != self.entries.len() {
            return Err(format!(
                "{} registered flags for {} entries",
                self.registered.len(),
                self.entries.len()
            ));
        }
        for (i, slot) in self.entries.iter().enumerate() {
            let b = BlockId(i as u32);
            if self.registered[i] != slot.is_some() {
                return Err(format!(
                    "block {b}: registered flag {} but entry present {}",
                    self.registered[i],
                    slot.is_some()
                ));
            }
            let state = pool.state(b).map_err(|e| e.to_string())?;
            let Some(e) = slot else {
                if state == BlockState::Cached {
                    return Err(format!("cached block {b} is not in the index"));
                }
                continue;
            };
            registered += 1;
            if self.cold_key(b, e).is_some_and(<[u8]>::is_empty) {
                return Err(format!("block {b} stores an empty extra key"));
            }
            let cold = self.cold.get(&b);
            if e.has_cold != cold.is_some()
                || cold.is_some_and(|c| c.ns.is_none() && c.key.is_none())
            {
                return Err(format!(
                    "block {b}: cold flag {} but cold record {cold:?}",
                    e.has_cold
                ));
            }
            if !e.has_parent && e.parent_hash != BlockHash(0) {
                return Err(format!("first block {b} carries a parent hash"));
            }
            if self.block_of(e.hash) != Some(b) {
                return Err(format!(
                    "block {b} hash {} does not lead back to it",
                    e.hash
                ));
            }
            if let Some(d) = self.digests.get(i).filter(|d| d.key() != e.hash) {
                return Err(format!("block {b} hash {} but digest {d}", e.hash));
            }
            match state {
                BlockState::Free => return Err(format!("free block {b} is in the index")),
                BlockState::Cached if !e.cached => {
                    return Err(format!("block {b} is cached but its entry says live"))
                }
                BlockState::Live if e.cached => {
                    return Err(format!("block {b} is live but its entry says cached"))
                }
                _ => {}
            }
            let has_ns = self.cold_ns(b, e).is_some();
            match e.parent() {
                None => {
                    if e.depth != 1 || !has_ns {
                        return Err(format!(
                            "first block {b}: depth {} or no namespace",
                            e.depth
                        ));
                    }
                }
                Some(ph) => {
                    let pb = self
                        .block_of(ph)
                        .ok_or_else(|| format!("block {b}: parent {ph} is not registered"))?;
                    let pe = self.entry(pb).ok_or("parent entry missing")?;
                    if pe.depth + 1 != e.depth || has_ns {
                        return Err(format!("block {b}: depth {} under {}", e.depth, pe.depth));
                    }
                    if e.pins > pe.pins {
                        return Err(format!("block {b} is pinned more than its parent {pb}"));
                    }
                    if !e.cached && pe.cached {
                        return Err(format!("live block {b} has a cached parent {pb}"));
                    }
                    children[pb.index()] += 1;
                }
            }
            if e.pins > 0 {
                pinned += 1;
                pinned_cached += usize::from(e.cached);
            }
            if e.is_candidate {
                candidates += 1;
            }
        }
        for (i, slot) in self.entries.iter().enumerate() {
            let Some(e) = slot else { continue };
            if e.children != children[i] {
                return Err(format!(
                    "block #{i}: {} children recorded, {} registered",
                    e.children, children[i]
                ));
            }
            let should = e.cached && e.pins == 0 && e.children == 0;
            let is = e
                .candidate()
                .is_some_and(|(p, k)| self.candidates.contains(p, k, i as u32));
            if should != is {
                return Err(format!("block #{i}: candidate {is}, should be {should}"));
            }
        }
        if registered != self.by_hash.len() {
            return Err(format!(
                "{registered} entries but {} hashes",
                self.by_hash.len()
            ));
        }
        self.candidates.check()?;
        if candidates != self.candidates.len() {
            return Err(format!(
                "{candidates} flagged candidates, {} in the set",
                self.candidates.len()
            ));
        }
        if (pinned, pinned_cached) != (self.pinned_blocks, self.pinned_cached) {
            return Err(format!(
                "pinned {pinned}/{pinned_cached} cached, counters {}/{}",
                self.pinned_blocks, self.pinned_cached
            ));
        }
        let mut pins = vec![0u32; self.entries.len()];
        for (id, &last) in &self.pins {
            let mut h = Some(last);
            while let Some(hash) = h {
                let b = self
                    .block_of(hash)
                    .ok_or_else(|| format!("{id} names unregistered {hash}"))?;
                pins[b.index()] += 1;
                h = self.entry(b).and_then(Entry::parent);
            }
        }
        for (i, slot) in self.entries.iter().enumerate() {
            let want = slot.as_ref().map_or(0, |e| e.pins);
            if pins[i] != want {
                return Err(format!(
                    "block #{i}: {want} pins recorded, {} held",
                    pins[i]
                ));
            }
        }
        Ok(())
    }
}
