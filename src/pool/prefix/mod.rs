//! Prefix caching: content-addressed full blocks shared across requests.
//!
//! | piece | what it does |
//! |---|---|
//! | [`PrefixHasher`] ([`Xxh3Hasher`], [`ChainHasher`], `VllmHasher` with feature `vllm-hash`) | chained hash of (parent hash, token ids, the block's extra keys), seeded per namespace (cache salt + extra key) |
//! | index (internal) | hash -> block, stored token ids, block keys and parent links to confirm every hit, pins, eviction candidates |
//! | [`EvictionPolicy`] ([`LruPolicy`], [`CostAwarePolicy`]) | which unreferenced cached block goes first |
//! | [`crate::KvCache::admit_tokens`] and friends | the manager's entry points, in `manager/prefix.rs` |
//!
//! A block enters the cache when it becomes full in a sequence admitted or extended
//! *with token ids* ([`crate::KvCache::admit_tokens`],
//! [`crate::KvCache::append_tokens`]); the plain `admit`/`append` never touch
//! it. Registered blocks are immutable: writing into one (after a truncation made it
//! the partial last block) goes through copy-on-write. When the last table reference
//! goes, a registered block stays `Cached` (content kept, findable, evictable) until an
//! allocation needs the memory.
//!
//! Bookkeeping is allocated once for the arena: `4 * block_size` bytes of token ids
//! and an entry of about a hundred bytes per block, so a hit is confirmed by comparing
//! the stored ids without touching K/V memory.
//!
//! Known limits: a block whose content is already registered under another block (two
//! requests computing the same content side by side) is not registered again, and its
//! sequence registers nothing after it (see `admit_tokens`); blocks are registered when
//! the call that fills them returns, so an engine that drops a step it was given must
//! not leave those blocks' K/V unwritten and then free the sequence into the cache.

mod candidates;
mod hash;
pub(crate) mod index;
mod policy;
#[cfg(feature = "vllm-hash")]
mod vllm;

pub use hash::{BlockDigest, BlockHash, ChainHasher, PrefixHasher, Xxh3Hasher};
pub use index::DiskEntry;
pub use policy::{CostAwarePolicy, EvictionCandidate, EvictionPolicy, LruPolicy};
#[cfg(feature = "vllm-hash")]
pub use vllm::VllmHasher;

use crate::ids::{BlockId, PinId};

/// Longest cache salt or extra key [`PrefixConfig::for_arena`] accepts, in bytes.
pub const DEFAULT_MAX_KEY_BYTES: usize = 256;

/// Tuning of the prefix cache of a [`crate::KvCache`].
#[derive(Debug, Clone)]
pub struct PrefixConfig {
    /// Most blocks that pins may hold at once; pinned blocks are never evicted and do
    /// not count as available.
    pub max_pinned_blocks: usize,
    /// Longest cache salt, and longest extra key, in bytes.
    pub max_key_bytes: usize,
    /// Whether [`PrefixEvent`]s are recorded for [`crate::KvCache::drain_prefix_events`]
    /// (off by default: nobody drains them otherwise).
    pub record_events: bool,
    /// Where to send every [`PrefixEvent`] as it happens (a router thread's receiver),
    /// besides or instead of recording. Sending never blocks: a full or disconnected
    /// channel drops the event and counts it in [`PrefixStats::dropped_events`].
    pub event_channel: Option<crossbeam_channel::Sender<PrefixEvent>>,
    /// The content hash: [`Xxh3Hasher`] (the default, recomputable by a router from its
    /// documented encoding), [`ChainHasher`], or with feature `vllm-hash`
    /// `VllmHasher` (vLLM's `sha256_cbor` hashes, so routers that recompute vLLM's
    /// hashes agree with the engine; the index then keeps a 32-byte digest per block).
    pub hasher: Box<dyn PrefixHasher>,
    /// The eviction order among unreferenced cached blocks.
    pub policy: Box<dyn EvictionPolicy>,
}

impl PrefixConfig {
    /// Defaults for an arena of `num_blocks`: pins may hold a quarter of it, keys up to
    /// [`DEFAULT_MAX_KEY_BYTES`], no events recorded or sent, [`Xxh3Hasher`],
    /// [`LruPolicy`].
    pub fn for_arena(num_blocks: usize) -> Self {
        PrefixConfig {
            max_pinned_blocks: num_blocks / 4,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES,
            record_events: false,
            event_channel: None,
            hasher: Box::new(Xxh3Hasher),
            policy: Box::new(LruPolicy),
        }
    }
}

/// Per-request keys of [`crate::KvCache::admit_tokens`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmitOptions<'a> {
    /// Anything besides the token ids that changes the K/V of every block (a LoRA
    /// adapter id). Requests share blocks only when their extra keys are equal. For an
    /// input that changes only the tokens from some position on (an image, an audio
    /// clip), use [`Self::block_keys`]: the text before it stays shareable.
    pub extra_key: &'a [u8],
    /// The tenant's namespace: requests share blocks only when their salts are equal.
    pub cache_salt: &'a [u8],
    /// Retention priority of the blocks this request uses: when memory is needed, every
    /// evictable block of a lower priority goes before any of a higher one.
    pub retention_priority: i32,
    /// Keyed spans: `(position, key)` for each input whose K/V is not determined by the
    /// token ids alone (a multimodal input's placeholder tokens: the key is the input's
    /// content hash), `position` being the span's first token in the prompt.
    ///
    /// A span salts the hash of the block that holds `position`, and since hashes chain,
    /// every block after it: blocks before that block stay shareable with a request
    /// without the span (a text-only one), blocks from it on are shared only with
    /// requests whose spans there are equal (same key, same offset in the block). The
    /// key bytes of that block are stored and compared on every hit, so a hash
    /// collision is a miss.
    ///
    /// A block's extra-key bytes (the `extra` of [`PrefixHasher::block`]) are, for each
    /// span starting in it in order of position (spans at the same position in the order
    /// given), `offset_in_block: u32 LE ‖ len(key): u32 LE ‖ key`; a block where no span
    /// starts has none. Each key is at most [`PrefixConfig::max_key_bytes`] long. A
    /// span at or past the end of the prompt keys the block that holds its position if
    /// that block is ever registered (by later tokens of the same sequence).
    pub block_keys: &'a [(usize, &'a [u8])],
}

/// What [`crate::KvCache::admit_tokens`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Admission {
    /// Leading prompt tokens whose K/V is already cached; the engine computes only the
    /// rest. Always a multiple of the block size and below the prompt length (0 for an
    /// empty prompt).
    pub cached_tokens: usize,
    /// Blocks shared from the cache (`cached_tokens / block_size`).
    pub cached_blocks: usize,
    /// Blocks allocated for the uncached tokens.
    pub new_blocks: usize,
    /// Blocks of the prompt newly registered in the cache.
    pub registered_blocks: usize,
    /// Prompt tokens after `cached_tokens` found in the host level of the prefix cache
    /// and being loaded into fresh device blocks ([`crate::KvCache::load_job`]); they
    /// count as computed only once [`crate::KvCache::complete_swap`] completes the
    /// load. 0 without a host-level hit.
    pub loading_tokens: usize,
}

/// A pinned prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedPrefix {
    /// Pass to [`crate::KvCache::unpin_prefix`].
    pub id: PinId,
    /// Tokens covered (whole blocks).
    pub tokens: usize,
    /// Blocks covered.
    pub blocks: usize,
}

/// Which memory tier a cached block lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The device arena (GPU memory, or the host arena of a CPU engine): the blocks a
    /// hit shares.
    Device,
    /// The host (swap) tier: blocks of the host level of the prefix cache
    /// ([`crate::KvCache::plan_host_store`]), which a lookup finds after the device
    /// chain and an admission loads back, and cached blocks spilled there
    /// ([`crate::KvCache::plan_prefix_spill`]), which are only found once restored.
    Host,
    /// The disk tier: cached blocks kept in a [`crate::executor::tier::DiskPrefixStore`]
    /// (the `block` of their events is the disk slot). Like the host tier, a hit is
    /// served from the device only, after the block is brought back.
    Disk,
}

/// A change to the set of cached blocks, for an external (KV-aware) router.
///
/// A router that keeps a copy of the index applies these in order: `BlockStored`
/// adds, `BlockRemoved` removes, `AllCleared` empties its copy (and is followed by a
/// `BlockStored` for every block still registered, parents first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefixEvent {
    /// A full block was registered and can now be hit.
    BlockStored {
        /// Its content hash.
        hash: BlockHash,
        /// The hash of the block before it (`None` for the first block of a prompt).
        parent: Option<BlockHash>,
        /// Where it lives.
        block: BlockId,
        /// Its token ids (`block_size` of them).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// The block's extra-key bytes as hashed (empty unless a keyed span starts in
        /// it; encoding in [`AdmitOptions::block_keys`]).
        extra_keys: Vec<u8>,
        /// The tier that holds it.
        medium: Medium,
        /// The KV-cache group whose prefix cache holds it: `Some(g)` on a hybrid cache
        /// (group `g`, vLLM's `group_idx`), `None` on a one-group cache.
        group: Option<u8>,
    },
    /// A block left the cache (evicted to the free list, or moved: a `BlockStored` for
    /// its new place follows).
    BlockRemoved {
        /// Its content hash.
        hash: BlockHash,
        /// Where it lived.
        block: BlockId,
        /// The tier it left.
        medium: Medium,
        /// The KV-cache group it left, as in `BlockStored`.
        group: Option<u8>,
    },
    /// [`crate::KvCache::reset_prefix_cache`] ran: forget every block. The blocks
    /// it kept (referenced by a sequence, or pinned) follow as `BlockStored`, parents
    /// first.
    AllCleared,
}

/// What [`crate::KvCache::reset_prefix_cache`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixReset {
    /// Cached blocks dropped to the free list.
    pub evicted_blocks: usize,
    /// Registered blocks kept because a sequence references them.
    pub kept_live_blocks: usize,
    /// Registered blocks kept, unreferenced, because a pin holds them.
    pub kept_pinned_blocks: usize,
}

/// Prefix-cache counters; totals since the manager was created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixStats {
    /// Successful admissions through the prefix cache
    /// ([`crate::KvCache::admit_tokens`] and
    /// [`crate::KvCache::admit_prompt`]).
    pub queries: u64,
    /// Prompt tokens of those calls.
    pub query_tokens: u64,
    /// Prompt tokens served from the cache.
    pub hit_tokens: u64,
    /// Blocks served from the cache.
    pub hit_blocks: u64,
    /// Blocks registered.
    pub stored_blocks: u64,
    /// Blocks evicted.
    pub evicted_blocks: u64,
    /// Full blocks not registered because an equal block already was (the sequence
    /// stops registering there; see `admit_tokens`).
    pub duplicate_blocks: u64,
    /// Events the configured channel refused (full or disconnected).
    pub dropped_events: u64,
    /// Hash hits rejected because the stored tokens, chain or namespace differed.
    pub rejected_collisions: u64,
    /// Blocks in the index now (live or cached).
    pub registered_blocks: usize,
    /// Cached blocks that an allocation may evict now (neither referenced nor pinned).
    pub evictable_blocks: usize,
    /// Blocks held by at least one pin now.
    pub pinned_blocks: usize,
    /// Pins held now.
    pub pins: usize,
}

impl PrefixStats {
    /// `hit_tokens / query_tokens`, in `[0, 1]`.
    pub fn hit_rate(&self) -> f64 {
        if self.query_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.query_tokens as f64
        }
    }
}
