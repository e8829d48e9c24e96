//! The host tier as a level of the prefix cache.
//!
//! Registered device blocks are copied into host-tier blocks ahead of their eviction
//! (a *store*); a lookup that runs out of device blocks goes on in the host level's
//! index; admitting such a hit allocates device blocks and *loads* the host copies into
//! them. Both are plans: the manager never touches memory.
//!
//! # Store
//!
//! ```text
//! plan_host_store ---> (run the device -> host SwapPlan) ---> complete_swap: findable on the host
//!                  \-> abort_swap: host blocks released, nothing else changed
//! ```
//!
//! [`KvCache::plan_host_store`] picks device blocks by [`HostStorePolicy`] (never one
//! whose content the host level holds or is storing already), takes a free host block
//! for each (evicting host entries when the level is full) and returns a [`SwapJob`].
//! Until the ticket completes or aborts, each device block carries one extra pool
//! reference: it is not evictable, not freed when its sequences go, and not moved
//! (defragmentation refuses while a transfer is in flight). The completion makes the
//! host copies findable: the host index maps a block's hash to its host block, with the
//! parent hash, token ids, extra keys and namespace the device index keeps
//! (`SavedEntry`), so a host hit is confirmed byte for byte as a device hit is.
//!
//! Call it once the K/V of the blocks registered so far is written (between steps):
//! a block is registered as soon as the call that fills it returns (see
//! `manager/prefix.rs`), before the engine has written it.
//!
//! # Load
//!
//! [`KvCache::admit_prompt`] with a [`PrefixHit`] whose [`PrefixHit::host_tokens`] is
//! not 0 shares the device part as always, allocates one device block per host block
//! and records a host -> device [`SwapJob`] ([`KvCache::load_job`]); the sequence is
//! then *loading*: its computed tokens are the device part only, and it is marked
//! "swapping in", so every call that reads or changes its blocks
//! ([`KvCache::reserve`], append, fork, truncate, free) is refused with
//! [`Error::SequenceState`] until [`KvCache::complete_swap`] (the loaded tokens count
//! as computed and the blocks are registered on the device, cached and findable) or
//! [`KvCache::abort_swap`] (the loaded blocks are freed; the sequence keeps its device
//! part, computed; the host copies stay). While a load reads a host entry the entry
//! holds one more host-pool reference and is never evicted. The
//! [`crate::TransferEngine`] runs a load like a swap-in, layer by layer.
//!
//! # Capacity
//!
//! The host tier's blocks are shared with swapped-out sequences, which come first: a
//! swap-out (or a restore from disk) evicts host entries to make room rather than fail.
//! Eviction is leaf-first (an entry with a child in the host level stays until the
//! child goes), in the order of [`HostCacheConfig::eviction`] ([`LruPolicy`] by
//! default, or [`crate::pool::prefix::CostAwarePolicy`] for a frequency-aware order).
//! An entry whose parent has left both tiers can no longer be hit (a lookup stops at
//! the gap); eviction reaches it in its turn.
//!
//! Each candidate search scans the host index: O(entries) per eviction, which is what
//! a host tier of thousands of blocks affords; a candidate set like the device index's
//! is the next step if it shows in a profile.
//!
//! On a hybrid cache ([`KvCache::hybrid`]) of full and latent groups, every group has
//! a host level of its own over the shared host tier (`groups/host_level.rs`):
//! [`KvCache::plan_host_store_grouped`], [`KvCache::admit_prompt_grouped`] and
//! [`KvCache::load_job_grouped`]. A hybrid cache with a window or state group refuses
//! with [`Error::NotOnHybrid`], as do the one-group calls `plan_host_store` and the
//! disk level. The sleep-time spill ([`KvCache::plan_prefix_spill`]) keeps
//! its own host blocks, invisible to lookups until restored.
//!
//! # Below the host: the disk level
//!
//! Host entries go on to the disk level (`manager/disk_level.rs`): a lookup continues
//! there after the host part ([`PrefixHit::disk_tokens`]), and a load of such a hit
//! stages each disk block in a host block of its own before the device copies (the
//! load's plan ends with them). A disk store holds its host entries as a load does
//! (one reader each), so they are not evicted while being written.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::disk_level::{DiskLoadItem, DiskLoadJob};
use super::{swap::InFlight, KvCache, PrefixHit};
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId, SwapTicket};
use crate::layout::plans::{SwapDirection, SwapPlan};
use crate::manager::SwapJob;
use crate::pool::prefix::index::{BlockKeys, Namespace, PrefixIndex, SavedEntry};
use crate::pool::prefix::{BlockDigest, BlockHash, EvictionCandidate, EvictionPolicy, LruPolicy};
use crate::pool::{pick_free_run, BlockState};

/// Which device blocks [`KvCache::plan_host_store`] copies to the host level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostStorePolicy {
    /// Every registered block (full and computed), parents first.
    WriteThrough,
    /// The cached, unreferenced blocks nearest eviction: at most `ahead_blocks` of the
    /// blocks an eviction of everything evictable would drop, deepest and least
    /// recently used first (leaves go first on the device).
    WriteBack {
        /// How many blocks nearest eviction a plan looks at.
        ahead_blocks: usize,
    },
    /// Write-through for blocks hit at least `min_hits` times on the device since they
    /// were registered (an admission filter: `min_hits: 1` stores what was seen twice).
    Selective {
        /// Device hits a block needs before it is stored.
        min_hits: u32,
    },
}

/// Tuning of the host level of the prefix cache ([`KvCache::set_host_cache`]).
#[derive(Debug, Clone)]
pub struct HostCacheConfig {
    /// What a store copies.
    pub store: HostStorePolicy,
    /// The eviction order among host entries (leaves only): [`LruPolicy`] (the
    /// default) or a frequency-aware policy such as
    /// [`crate::pool::prefix::CostAwarePolicy`].
    pub eviction: Box<dyn EvictionPolicy>,
}

impl Default for HostCacheConfig {
    /// Write-through, LRU.
    fn default() -> Self {
        HostCacheConfig {
            store: HostStorePolicy::WriteThrough,
            eviction: Box::new(LruPolicy),
        }
    }
}

/// Counters of the host level of the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostCacheStats {
    /// Entries in the host index now (findable host blocks).
    pub cached_blocks: usize,
    /// Stores planned and not yet completed or aborted.
    pub stores_in_flight: usize,
    /// Loads planned and not yet completed or aborted.
    pub loads_in_flight: usize,
    /// Blocks that became host entries (completed stores).
    pub stored_blocks: u64,
    /// Bytes of those blocks.
    pub stored_bytes: u64,
    /// Host entries that left (evicted).
    pub removed_blocks: u64,
    /// Stores aborted.
    pub aborted_stores: u64,
    /// Blocks loaded back to the device (completed loads).
    pub loaded_blocks: u64,
    /// Bytes of those blocks.
    pub loaded_bytes: u64,
    /// Loads aborted.
    pub aborted_loads: u64,
    /// Prompt tokens admitted from device hits ([`KvCache::admit_prompt`],
    /// [`KvCache::admit_tokens`]).
    pub device_hit_tokens: u64,
    /// Prompt tokens served from the host level (counted when their load completes).
    pub host_hit_tokens: u64,
}

/// One host entry: a block's content in a host-tier block.
#[derive(Debug, Clone)]
struct HostEntry {
    host: BlockId,
    saved: SavedEntry,
    /// Host entries whose parent is this one.
    children: u32,
    /// Loads reading it (each holds one more host-pool reference).
    readers: u32,
    last_used: u64,
    hits: u32,
    /// The eviction policy's key, set when the entry was stored or last hit.
    key: u64,
}

/// One block of a store in flight.
#[derive(Debug, Clone)]
struct StoreItem {
    device: BlockId,
    host: BlockId,
    saved: SavedEntry,
}

/// A store in flight.
#[derive(Debug, Clone, Default)]
struct PendingStore {
    items: Vec<StoreItem>,
    /// Device blocks held (one pool reference each): the stored blocks and their
    /// ancestors (the device index keeps no live block under a cached parent).
    holds: Vec<BlockId>,
}

/// A load in flight.
#[derive(Debug, Clone)]
struct PendingLoad {
    seq: SeqId,
    /// Blocks of the device part (before the loaded ones in the table).
    device_blocks: usize,
    /// The host entries read, in chain order (one per loaded block of the host part).
    hashes: Vec<BlockHash>,
    /// The disk part after them: each block's hash and its staging host block (one
    /// host-pool reference each), in chain order.
    disk: Vec<(BlockHash, BlockId)>,
    /// Whether the executor reported the disk part staged
    /// ([`KvCache::mark_disk_load_staged`]).
    staged: bool,
    /// Host part's copies, then the disk part's (from the staging blocks).
    plan: SwapPlan,
}

/// A host entry a disk store could take (`manager/disk_level.rs`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoreCandidate {
    pub(crate) hash: BlockHash,
    pub(crate) host: BlockId,
    pub(crate) depth: u32,
    /// The host eviction key (lower goes first).
    pub(crate) key: u64,
}

/// The host level's bookkeeping inside the tiers.
#[derive(Debug, Clone, Default)]
pub(crate) struct HostLevel {
    config: HostCacheConfig,
    entries: HashMap<BlockHash, HostEntry>,
    stores: BTreeMap<SwapTicket, PendingStore>,
    loads: BTreeMap<SwapTicket, PendingLoad>,
    clock: u64,
    stats: HostCacheStats,
}

impl HostLevel {
    /// Stores and loads in flight.
    pub(crate) fn num_in_flight(&self) -> usize {
        self.stores.len() + self.loads.len()
    }

    /// Device blocks held by stores in flight (one pool reference each).
    pub(crate) fn held_device_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.stores.values().flat_map(|p| p.holds.iter().copied())
    }

    /// Whether a store in flight holds device block `b`.
    pub(crate) fn holds_device(&self, b: BlockId) -> bool {
        self.held_device_blocks().any(|d| d == b)
    }

    /// The host entries with `keep(hash)`, for a disk store.
    pub(crate) fn store_candidates(&self, keep: impl Fn(BlockHash) -> bool) -> Vec<StoreCandidate> {
        self.entries
            .values()
            .filter(|e| keep(e.saved.hash))
            .map(|e| StoreCandidate {
                hash: e.saved.hash,
                host: e.host,
                depth: e.saved.depth,
                key: e.key,
            })
            .collect()
    }

    /// The saved content of host entry `h`.
    pub(crate) fn saved_of(&self, h: BlockHash) -> Option<&SavedEntry> {
        self.entries.get(&h).map(|e| &e.saved)
    }

    /// One more reader of host entry `h` (a disk store reading it).
    pub(crate) fn add_reader(&mut self, h: BlockHash) {
        if let Some(e) = self.entries.get_mut(&h) {
            e.readers += 1;
        }
    }

    /// One reader less of host entry `h`.
    pub(crate) fn remove_reader(&mut self, h: BlockHash) {
        if let Some(e) = self.entries.get_mut(&h) {
            e.readers = e.readers.saturating_sub(1);
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn key_of(&mut self, last_used: u64, depth: u32, hits: u32) -> u64 {
        self.config.eviction.key(&EvictionCandidate {
            last_used,
            depth,
            hits,
        })
    }

    /// Pushes onto `out` the hashes of the host entries that continue a chain after
    /// `first` device blocks (the last with hash and digest `last`), for the leading
    /// blocks of `tokens` up to `max_blocks` in all.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn extend_hit(
        &self,
        index: &PrefixIndex,
        ns: &Namespace,
        keys: &BlockKeys,
        tokens: &[u32],
        first: usize,
        max_blocks: usize,
        last: Option<(BlockHash, Option<BlockDigest>)>,
        out: &mut Vec<BlockHash>,
    ) {
        if self.entries.is_empty() {
            return;
        }
        let held = |h: &BlockHash| self.entries.get(h).map(|e| &e.saved);
        extend_chain_hit(
            index,
            ns,
            keys,
            tokens,
            (first, max_blocks),
            last,
            out,
            held,
        );
    }

    /// Entries an eviction could take now, leaf by leaf: those with no reader and no
    /// reader below them.
    pub(crate) fn evictable_count(&self) -> usize {
        self.evictable_count_reading(&[])
    }

    /// [`Self::evictable_count`] with `extra` entries counted as read too.
    fn evictable_count_reading(&self, extra: &[BlockHash]) -> usize {
        let mut kept: HashSet<BlockHash> = HashSet::new();
        let read = self
            .entries
            .values()
            .filter(|e| e.readers > 0)
            .map(|e| e.saved.hash)
            .chain(extra.iter().copied());
        for h in read {
            let mut at = Some(h);
            // Up the chain while the host level holds it (a parent elsewhere is not
            // an entry).
            while let Some(h) = at.filter(|h| self.entries.contains_key(h)) {
                if !kept.insert(h) {
                    break;
                }
                at = self.entries.get(&h).and_then(|e| e.saved.parent);
            }
        }
        self.entries.len() - kept.len()
    }

    /// The next entry to evict: a leaf with no reader, lowest key first (ties by host
    /// block, so the order is reproducible).
    fn victim(&self) -> Option<BlockHash> {
        self.entries
            .values()
            .filter(|e| e.children == 0 && e.readers == 0)
            .min_by_key(|e| (e.key, e.host))
            .map(|e| e.saved.hash)
    }

    /// Checks the level against itself (children, readers, stats); the host-pool
    /// references are counted by the tier check.
    fn check(&self, disk_readers: &HashMap<BlockHash, u32>) -> std::result::Result<(), String> {
        let mut children: HashMap<BlockHash, u32> = HashMap::new();
        let mut hosts = HashSet::new();
        for (&h, e) in &self.entries {
            if e.saved.hash != h {
                return Err(format!("host entry {h:?} holds {:?}", e.saved.hash));
            }
            if !hosts.insert(e.host) {
                return Err(format!("host block {} holds two entries", e.host));
            }
            if let Some(p) = e.saved.parent.filter(|p| self.entries.contains_key(p)) {
                *children.entry(p).or_default() += 1;
            }
        }
        let mut readers: HashMap<BlockHash, u32> = disk_readers.clone();
        for l in self.loads.values() {
            if l.hashes.len() + l.disk.len() != l.plan.len() {
                return Err(format!(
                    "load of {}: {} host and {} disk blocks but {} copies",
                    l.seq,
                    l.hashes.len(),
                    l.disk.len(),
                    l.plan.len()
                ));
            }
            for (&(h, staging), pair) in l.disk.iter().zip(&l.plan.pairs()[l.hashes.len()..]) {
                if pair.host != staging || !hosts.insert(staging) {
                    return Err(format!(
                        "load of {} stages {h:?} in {staging}, copied from {} or held twice",
                        l.seq, pair.host
                    ));
                }
            }
            for (h, pair) in l.hashes.iter().zip(l.plan.pairs()) {
                *readers.entry(*h).or_default() += 1;
                match self.entries.get(h) {
                    Some(e) if e.host == pair.host => {}
                    _ => return Err(format!("load of {} reads {h:?}, not held", l.seq)),
                }
            }
        }
        for (&h, e) in &self.entries {
            let c = children.get(&h).copied().unwrap_or(0);
            let r = readers.get(&h).copied().unwrap_or(0);
            if e.children != c || e.readers != r {
                return Err(format!(
                    "host entry {h:?}: {} children and {} readers recorded, {c} and {r} found",
                    e.children, e.readers
                ));
            }
        }
        let mut storing = HashSet::new();
        for item in self.stores.values().flat_map(|p| &p.items) {
            if !hosts.insert(item.host) {
                return Err(format!("host block {} stored twice", item.host));
            }
            if self.entries.contains_key(&item.saved.hash) || !storing.insert(item.saved.hash) {
                return Err(format!("{:?} is stored twice", item.saved.hash));
            }
        }
        let held = self.stats.stored_blocks - self.stats.removed_blocks;
        if held != self.entries.len() as u64 {
            return Err(format!(
                "{} host entries but {} stored and {} removed",
                self.entries.len(),
                self.stats.stored_blocks,
                self.stats.removed_blocks
            ));
        }
        Ok(())
    }
}

impl KvCache {
    /// Sets the host level's configuration (store policy, eviction order); the entries
    /// stay. See the module docs of `manager/tier_cache.rs`, in short: a store copies
    /// registered device blocks to free host blocks, a lookup goes on in the host
    /// level, and admitting such a hit loads the blocks back.
    ///
    /// On a hybrid cache every group gets a host level of its own with this
    /// configuration, over the shared host tier (see `groups/host_level.rs`).
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] on a hybrid cache with a sliding-window or
    /// recurrent-state group (nothing changed).
    pub fn set_host_cache(&mut self, config: HostCacheConfig) -> Result<()> {
        if let Some(h) = &mut self.hybrid {
            return h.set_host_cache(config);
        }
        self.tiers.host_cache.config = config;
        Ok(())
    }

    /// The host level's configuration.
    pub fn host_cache_config(&self) -> &HostCacheConfig {
        if let Some(g0) = self.first_group() {
            return g0.host_cache_config();
        }
        &self.tiers.host_cache.config
    }

    /// Counters of the host level now.
    /// On a hybrid cache, the sum over the groups' host levels (a block stored in
    /// every group counts once per group).
    pub fn host_cache_stats(&self) -> HostCacheStats {
        if let Some(h) = &self.hybrid {
            return h.host_cache_stats();
        }
        let h = &self.tiers.host_cache;
        HostCacheStats {
            cached_blocks: h.entries.len(),
            stores_in_flight: h.stores.len(),
            loads_in_flight: h.loads.len(),
            ..h.stats
        }
    }

    /// Whether the host level holds a findable copy of the block registered on the
    /// device under `hash` (or of a block with that hash that left the device).
    pub fn host_cache_contains(&self, hash: BlockHash) -> bool {
        if let Some(g0) = self.first_group() {
            return g0.host_cache_contains(hash);
        }
        self.tiers.host_cache.entries.contains_key(&hash)
    }

    /// Plans a store to the host level by the configured [`HostStorePolicy`]: at most
    /// `max_blocks` registered device blocks whose content the host level neither holds
    /// nor is storing, parents first, each into a free host block (host entries are
    /// evicted, leaf first, when the tier has no free block; a swapped-out sequence's
    /// blocks are never taken). Returns `None` when there is nothing to store or no
    /// room. Run the job's plan (device -> host), then [`Self::complete_swap`] with its
    /// ticket, or [`Self::abort_swap`]; meanwhile the device blocks are held (not
    /// evictable, not freed, not moved).
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] on a hybrid cache (use [`Self::plan_host_store_grouped`]).
    /// A pool error means the manager's state was corrupt. Nothing changed on error.
    pub fn plan_host_store(&mut self, max_blocks: usize) -> Result<Option<SwapJob>> {
        self.one_group("plan_host_store")?;
        self.plan_host_store_inner(max_blocks, false)
    }

    /// [`Self::plan_host_store`]; with `always`, a store of nothing is a job too (an
    /// empty plan whose ticket completes or aborts as any other), for a hybrid store
    /// that needs one ticket per group.
    pub(crate) fn plan_host_store_inner(
        &mut self,
        max_blocks: usize,
        always: bool,
    ) -> Result<Option<SwapJob>> {
        let level = &self.tiers.host_cache;
        let storing: HashSet<BlockHash> = level
            .stores
            .values()
            .flat_map(|p| &p.items)
            .map(|i| i.saved.hash)
            .collect();
        let eligible = |b: &BlockId| {
            self.prefix
                .hash_of(*b)
                .is_some_and(|h| !level.entries.contains_key(&h) && !storing.contains(&h))
                && matches!(
                    self.pool.state(*b),
                    Ok(BlockState::Live | BlockState::Cached)
                )
        };
        let mut picks: Vec<BlockId> = match level.config.store {
            HostStorePolicy::WriteThrough => self
                .prefix
                .registered_by_depth()
                .into_iter()
                .filter(eligible)
                .collect(),
            HostStorePolicy::Selective { min_hits } => self
                .prefix
                .registered_by_depth()
                .into_iter()
                .filter(|b| self.prefix.hits_of(*b) >= min_hits && eligible(b))
                .collect(),
            HostStorePolicy::WriteBack { ahead_blocks } => {
                let closure = self.prefix.evictable_closure();
                let mut near: Vec<BlockId> = closure
                    .iter()
                    .rev()
                    .take(ahead_blocks)
                    .copied()
                    .filter(eligible)
                    .collect();
                // Parents first, as in the closure.
                near.reverse();
                near
            }
        };
        let room = self.tiers.host_free() + level.evictable_count();
        picks.truncate(max_blocks.min(room));
        if picks.is_empty() && !always {
            return Ok(None);
        }
        let mut saved = Vec::with_capacity(picks.len());
        for &b in &picks {
            saved.push(self.prefix.save_entry(b).ok_or_else(|| {
                Error::CorruptBlockTable(format!("registered block {b} has no entry"))
            })?);
        }
        // Every check is done; from here on nothing fails on a consistent manager.
        let short = picks.len().saturating_sub(self.tiers.host_free());
        self.evict_host_entries(short)?;
        let hosts = pick_free_run(self.tiers.host_pool(), picks.len(), 0);
        let mut plan = SwapPlan::new(SwapDirection::Out);
        let mut items = Vec::with_capacity(picks.len());
        for ((&device, &host), saved) in picks.iter().zip(&hosts).zip(saved) {
            self.tiers.host_pool_mut().take(host)?;
            plan.push(device, host);
            items.push(StoreItem {
                device,
                host,
                saved,
            });
        }
        // Hold the stored blocks and every block above them, parents first: a held
        // block under a parent that goes cached (revived, or its sequences freed)
        // would be a live block under a cached one, which eviction cannot honour.
        let mut holds: Vec<BlockId> = Vec::with_capacity(picks.len());
        let mut seen = HashSet::new();
        for &b in &picks {
            let mut path = Vec::new();
            let mut at = Some(b);
            while let Some(x) = at {
                if !seen.insert(x) {
                    break;
                }
                path.push(x);
                at = self
                    .prefix
                    .parent_of(x)
                    .flatten()
                    .and_then(|h| self.prefix.block_of(h));
            }
            holds.extend(path.into_iter().rev());
        }
        // `holds` lists each path parents first, and a path stops at a block held
        // already, so every parent is held before its child.
        for &b in &holds {
            self.hold_device(b)?;
        }
        let ticket = self.tiers.next_ticket();
        self.tiers
            .host_cache
            .stores
            .insert(ticket, PendingStore { items, holds });
        Ok(Some(SwapJob {
            ticket,
            seqs: Vec::new(),
            plan,
        }))
    }

    /// Evicts host entries that can go (no reader, leaves first) until `n` host blocks
    /// are free or none can; returns how many went.
    ///
    /// On a hybrid cache, each group's level evicts up to `n` of its own entries (its
    /// host blocks are its own); returns how many went in all.
    pub fn evict_host_cache(&mut self, n: usize) -> Result<usize> {
        if let Some(h) = &mut self.hybrid {
            return h.evict_host_cache(n);
        }
        let before = self.tiers.host_cache.entries.len();
        let want = n.min(self.tiers.host_cache.evictable_count());
        self.evict_host_entries(want)?;
        Ok(before - self.tiers.host_cache.entries.len())
    }

    /// The load of `seq` in flight (admitted from a host-level hit), to run with
    /// [`crate::Storage::swap`] or a [`crate::executor::tier::TransferEngine`], then
    /// [`Self::complete_swap`] or [`Self::abort_swap`] with its ticket.
    pub fn load_job(&self, seq: SeqId) -> Option<SwapJob> {
        let l = self
            .tiers
            .host_cache
            .loads
            .iter()
            .find(|(_, l)| l.seq == seq)?;
        Some(SwapJob {
            ticket: *l.0,
            seqs: vec![seq],
            plan: l.1.plan.clone(),
        })
    }

    /// The disk part of the load of `seq` in flight (admitted from a hit that goes
    /// on into the disk level), `None` when it has none: read each item's block from
    /// the disk store into its staging host block, then call
    /// [`Self::mark_disk_load_staged`] before running [`Self::load_job`]'s plan (whose
    /// last copies read the staging blocks).
    pub fn disk_load_job(&self, seq: SeqId) -> Option<DiskLoadJob> {
        let (&ticket, l) = self
            .tiers
            .host_cache
            .loads
            .iter()
            .find(|(_, l)| l.seq == seq && !l.disk.is_empty())?;
        Some(DiskLoadJob {
            ticket,
            seq,
            items: l
                .disk
                .iter()
                .map(|&(hash, host)| DiskLoadItem { hash, host })
                .collect(),
        })
    }

    /// The sequence of load `ticket` when its disk part is not staged yet (its
    /// completion refuses); `None` for any other ticket.
    pub(crate) fn unstaged_disk_load(&self, ticket: SwapTicket) -> Option<SeqId> {
        let l = self.tiers.host_cache.loads.get(&ticket)?;
        (!l.disk.is_empty() && !l.staged).then_some(l.seq)
    }

    /// Whether `ticket` is a load of the host level in flight.
    pub(crate) fn is_host_load(&self, ticket: SwapTicket) -> bool {
        self.tiers.host_cache.loads.contains_key(&ticket)
    }

    /// Records that the disk part of load `ticket` is in its staging host blocks, so
    /// [`Self::complete_swap`] may complete it (it refuses before, with
    /// [`Error::SequenceState`]: the device copies would read unwritten staging
    /// blocks).
    ///
    /// # Errors
    /// [`Error::UnknownTicket`] when `ticket` is not a load in flight.
    pub fn mark_disk_load_staged(&mut self, ticket: SwapTicket) -> Result<()> {
        let l = self
            .tiers
            .host_cache
            .loads
            .get_mut(&ticket)
            .ok_or(Error::UnknownTicket(ticket))?;
        l.staged = true;
        Ok(())
    }

    // ---- hooks ----------------------------------------------------------------------

    /// Evicts `n` host entries (the caller checked that `n` can go).
    pub(crate) fn evict_host_entries(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            let Some(h) = self.tiers.host_cache.victim() else {
                return Err(Error::TierFull {
                    tier: "host",
                    needed: n,
                    free: self.tiers.host_free(),
                });
            };
            self.remove_host_entry(h)?;
        }
        Ok(())
    }

    fn remove_host_entry(&mut self, h: BlockHash) -> Result<()> {
        let level = &mut self.tiers.host_cache;
        let Some(e) = level.entries.remove(&h) else {
            return Ok(());
        };
        level.config.eviction.on_evict(e.key);
        if let Some(p) = e.saved.parent.and_then(|p| level.entries.get_mut(&p)) {
            p.children -= 1;
        }
        level.stats.removed_blocks += 1;
        self.prefix.announce_host(&e.saved, e.host, false);
        self.tiers.host_pool_mut().decref(e.host)?;
        Ok(())
    }

    /// Makes `needed` host blocks free for a swapped sequence, evicting host entries
    /// when the tier lacks them. Changes nothing when even that is not enough.
    pub(crate) fn make_host_room(&mut self, needed: usize) -> Result<()> {
        let free = self.tiers.host_free();
        if needed <= free {
            return Ok(());
        }
        if needed > free + self.tiers.host_cache.evictable_count() {
            return Err(Error::TierFull {
                tier: "host",
                needed,
                free,
            });
        }
        self.evict_host_entries(needed - free)
    }

    /// One more pool reference to registered device block `b` for a store reading it
    /// (a cached block is revived without counting as a hit).
    fn hold_device(&mut self, b: BlockId) -> Result<()> {
        let bs = self.block_size();
        match self.pool.state(b)? {
            BlockState::Cached => {
                self.pool.revive(b)?;
                if let Some(f) = self.pool.fill_mut(b) {
                    *f = bs as u16;
                }
                self.live_token_slots += bs;
                self.prefix.on_hold(b);
            }
            BlockState::Live => {
                self.pool.incref(b)?;
                if usize::from(self.pool.fill(b)) < bs {
                    self.fill_dirty.insert(b);
                    self.set_fill(b, bs);
                }
            }
            BlockState::Free => {
                return Err(Error::CorruptBlockTable(format!("store of free block {b}")))
            }
        }
        Ok(())
    }

    /// Allocates the device blocks of a load for `seq`, whose table holds its
    /// `device_blocks` device part, appends them to `table` and records the load
    /// (host entries `hashes` read, one reader each). The caller checked that the
    /// blocks are available. Returns the sequence's in-flight mark.
    pub(crate) fn plan_load(
        &mut self,
        seq: SeqId,
        device_blocks: usize,
        hashes: &[BlockHash],
        disk: &[BlockHash],
        table: &mut Vec<BlockId>,
    ) -> Result<InFlight> {
        let bs = self.block_size();
        let mut plan = SwapPlan::new(SwapDirection::In);
        for h in hashes {
            let host = self
                .tiers
                .host_cache
                .entries
                .get(h)
                .map(|e| e.host)
                .ok_or_else(|| Error::CorruptBlockTable(format!("host entry {h:?} left")))?;
            let dev = self.alloc_block()?;
            self.set_fill(dev, bs);
            table.push(dev);
            plan.push(dev, host);
        }
        for (h, pair) in hashes.iter().zip(plan.pairs()) {
            self.tiers.host_pool_mut().incref(pair.host)?;
            if let Some(e) = self.tiers.host_cache.entries.get_mut(h) {
                e.readers += 1;
            }
        }
        // The disk part: a staging host block per block (the caller checked that the
        // host tier can give them, the host part above being read now).
        let mut staged = Vec::with_capacity(disk.len());
        if !disk.is_empty() {
            let short = disk.len().saturating_sub(self.tiers.host_free());
            self.evict_host_entries(short)?;
            let hosts = pick_free_run(self.tiers.host_pool(), disk.len(), 0);
            for (&h, &host) in disk.iter().zip(&hosts) {
                self.tiers.host_pool_mut().take(host)?;
                let dev = self.alloc_block()?;
                self.set_fill(dev, bs);
                table.push(dev);
                plan.push(dev, host);
                staged.push((h, host));
            }
        }
        let ticket = self.tiers.next_ticket();
        self.tiers.host_cache.loads.insert(
            ticket,
            PendingLoad {
                seq,
                device_blocks,
                hashes: hashes.to_vec(),
                disk: staged,
                staged: false,
                plan,
            },
        );
        Ok(InFlight {
            direction: SwapDirection::In,
            ticket,
        })
    }

    /// Counts the device part of an admission without a load.
    pub(crate) fn note_device_hit(&mut self, blocks: usize) {
        self.tiers.host_cache.stats.device_hit_tokens += (blocks * self.block_size()) as u64;
    }

    /// Completes (`done`) or aborts a store or load of the host level; `None` when the
    /// ticket is not one.
    pub(crate) fn finish_host_transfer(
        &mut self,
        ticket: SwapTicket,
        done: bool,
    ) -> Option<Result<()>> {
        let level = &mut self.tiers.host_cache;
        if let Some(store) = level.stores.remove(&ticket) {
            return Some(self.finish_store(store, done));
        }
        if done {
            if let Some(l) = level
                .loads
                .get(&ticket)
                .filter(|l| !l.disk.is_empty() && !l.staged)
            {
                return Some(Err(Error::SequenceState {
                    seq: l.seq,
                    state: "loading with its disk part not staged",
                    needed: "disk part staged (mark_disk_load_staged)",
                }));
            }
        }
        let load = level.loads.remove(&ticket)?;
        Some(self.finish_load(load, done))
    }

    fn finish_store(&mut self, store: PendingStore, done: bool) -> Result<()> {
        let mut result = Ok(());
        let block_bytes = self.layout.block_bytes() as u64;
        // Children first, so that no live block is left under a cached parent.
        for &b in store.holds.iter().rev() {
            result = result.and(self.release_block(b));
        }
        for item in store.items {
            if !done {
                result = result.and(self.tiers.host_pool_mut().decref(item.host).map(drop));
                continue;
            }
            let level = &mut self.tiers.host_cache;
            if level.entries.contains_key(&item.saved.hash) {
                // Unreachable: a plan never stores what is held or being stored.
                result = result.and(self.tiers.host_pool_mut().decref(item.host).map(drop));
                continue;
            }
            let clock = level.tick();
            let key = level.key_of(clock, item.saved.depth, 0);
            if let Some(p) = item.saved.parent.and_then(|p| level.entries.get_mut(&p)) {
                p.children += 1;
            }
            let children = level
                .entries
                .values()
                .filter(|e| e.saved.parent == Some(item.saved.hash))
                .count() as u32;
            level.stats.stored_blocks += 1;
            level.stats.stored_bytes += block_bytes;
            self.prefix.announce_host(&item.saved, item.host, true);
            self.tiers.host_cache.entries.insert(
                item.saved.hash,
                HostEntry {
                    host: item.host,
                    saved: item.saved,
                    children,
                    readers: 0,
                    last_used: clock,
                    hits: 0,
                    key,
                },
            );
        }
        if !done {
            self.tiers.host_cache.stats.aborted_stores += 1;
        }
        result
    }

    fn finish_load(&mut self, load: PendingLoad, done: bool) -> Result<()> {
        let bs = self.block_size();
        let mut result = Ok(());
        for (h, pair) in load.hashes.iter().zip(load.plan.pairs()) {
            result = result.and(self.tiers.host_pool_mut().decref(pair.host).map(drop));
            let level = &mut self.tiers.host_cache;
            let clock = level.tick();
            if let Some(e) = level.entries.get_mut(h) {
                e.readers -= 1;
                if done {
                    e.hits = e.hits.saturating_add(1);
                    e.last_used = clock;
                }
            }
            if done {
                if let Some((d, hits)) = level.entries.get(h).map(|e| (e.saved.depth, e.hits)) {
                    let key = level.key_of(clock, d, hits);
                    if let Some(e) = level.entries.get_mut(h) {
                        e.key = key;
                    }
                }
            }
        }
        for &(_, staging) in &load.disk {
            result = result.and(self.tiers.host_pool_mut().decref(staging).map(drop));
        }
        let n_host = load.hashes.len();
        let n_disk = load.disk.len();
        let n = n_host + n_disk;
        let Ok(handle) = self.handle(load.seq) else {
            return result.and(Err(Error::UnknownSequence(load.seq)));
        };
        let Some(s) = self.seqs.at_mut(handle) else {
            return result.and(Err(Error::UnknownSequence(load.seq)));
        };
        s.in_flight = None;
        if done {
            s.computed += n * bs;
            let stats = &mut self.tiers.host_cache.stats;
            stats.loaded_blocks += n_host as u64;
            stats.loaded_bytes += (n_host * self.layout.block_bytes()) as u64;
            stats.host_hit_tokens += (n_host * bs) as u64;
            let disk = &mut self.tiers.disk_cache.stats;
            disk.loaded_blocks += n_disk as u64;
            disk.disk_hit_tokens += (n_disk * bs) as u64;
            // The loaded blocks register on the device (or share copies registered
            // meanwhile), as a swap-in's do.
            return result.and(self.register_swapped_in(load.seq));
        }
        let loaded: Vec<BlockId> = s.table.drain(load.device_blocks..).collect();
        s.num_tokens = load.device_blocks * bs;
        self.tables_changed();
        self.tiers.host_cache.stats.aborted_loads += 1;
        result.and(self.release_table(&loaded))
    }

    /// The host level's part of [`Self::check_invariants`]: the level against itself,
    /// each load against its sequence (loading, computed up to its device part, its
    /// table ending with the loaded blocks), and the host-pool references it holds
    /// added to `host_refs` (one per entry and per reader, one per store's block).
    /// Returns the sequences it marks in flight.
    pub(crate) fn check_host_cache(
        &self,
        host_refs: &mut [u32],
    ) -> std::result::Result<usize, String> {
        let level = &self.tiers.host_cache;
        level.check(&self.tiers.disk_cache.readers())?;
        let mut count = |b: BlockId, n: u32| match host_refs.get_mut(b.index()) {
            Some(r) => {
                *r += n;
                Ok(())
            }
            None => Err(format!("host level names {b}, outside the host tier")),
        };
        for e in level.entries.values() {
            count(e.host, 1 + e.readers)?;
        }
        for l in level.loads.values() {
            for &(_, staging) in &l.disk {
                count(staging, 1)?;
            }
        }
        for item in level.stores.values().flat_map(|p| &p.items) {
            count(item.host, 1)?;
            if self.prefix.hash_of(item.device) != Some(item.saved.hash) {
                return Err(format!(
                    "store reads {}, no longer registered as {:?}",
                    item.device, item.saved.hash
                ));
            }
        }
        let bs = self.block_size();
        for (&ticket, l) in &level.loads {
            let s = self
                .seqs
                .get(&l.seq)
                .ok_or_else(|| format!("load {ticket} of unknown {}", l.seq))?;
            let marked = Some(InFlight {
                direction: SwapDirection::In,
                ticket,
            });
            let tail: Vec<BlockId> = l.plan.pairs().iter().map(|p| p.device).collect();
            if s.in_flight != marked
                || s.computed != l.device_blocks * bs
                || s.scheduled != 0
                || s.table.get(l.device_blocks..) != Some(&tail[..])
            {
                return Err(format!(
                    "{} loading under {ticket}: marked {:?}, {} computed, table {:?}, \
                     {} device blocks then {tail:?}",
                    l.seq, s.in_flight, s.computed, s.table, l.device_blocks
                ));
            }
        }
        Ok(level.loads.len())
    }
}

impl KvCache {
    /// Staging host blocks a load reading host entries `reading` can take now (free
    /// ones plus host entries it may evict).
    pub(crate) fn staging_room(&self, reading: &[BlockHash]) -> usize {
        self.tiers.host_free() + self.tiers.host_cache.evictable_count_reading(reading)
    }

    /// The leading blocks of `hit`'s host part that the host level still holds under
    /// the chain from `parent` (the hash of the last of `device_blocks` device blocks),
    /// with the prompt's ids in `tokens` and the request's `keys`: what admission loads.
    pub(crate) fn confirm_host_hit(
        &self,
        hit: &PrefixHit,
        device_blocks: usize,
        mut parent: Option<BlockHash>,
        ns: &Namespace,
        keys: &BlockKeys,
        tokens: &[u32],
    ) -> Vec<BlockHash> {
        let bs = self.block_size();
        let entries = &self.tiers.host_cache.entries;
        let mut out = Vec::with_capacity(hit.host_hashes().len());
        for (i, &h) in hit.host_hashes().iter().enumerate() {
            let b = device_blocks + i;
            let Some(chunk) = tokens.get(b * bs..(b + 1) * bs) else {
                break;
            };
            match entries.get(&h) {
                Some(e) if e.saved.confirms(parent, ns, chunk, keys.bytes(b)) => {}
                _ => break,
            }
            out.push(h);
            parent = Some(h);
        }
        out
    }
}

/// Pushes onto `out` the hashes of the blocks a lower level holds (`held` gives each
/// block's saved identity) that continue a chain after `blocks.0` blocks (the last with
/// hash and digest `last`), for the leading blocks of `tokens` up to `blocks.1` in all:
/// each confirmed by parent, namespace, ids and keys, the chain stopping at the first
/// block the level does not hold. The host and disk levels' lookups.
#[allow(clippy::too_many_arguments)]
pub(crate) fn extend_chain_hit<'a>(
    index: &PrefixIndex,
    ns: &Namespace,
    keys: &BlockKeys,
    tokens: &[u32],
    blocks: (usize, usize),
    last: Option<(BlockHash, Option<BlockDigest>)>,
    out: &mut Vec<BlockHash>,
    held: impl Fn(&BlockHash) -> Option<&'a SavedEntry>,
) {
    let bs = index.block_size();
    let (mut parent, mut digest) = match last {
        Some((h, d)) => (Some(h), d),
        None => (None, None),
    };
    for i in blocks.0..blocks.1 {
        let Some(chunk) = tokens.get(i * bs..(i + 1) * bs) else {
            break;
        };
        let extra = keys.bytes(i);
        let (h, d) = index.chain_hash(parent, digest.as_ref(), ns, chunk, extra);
        match held(&h) {
            Some(saved) if saved.confirms(parent, ns, chunk, extra) => {}
            _ => break,
        }
        out.push(h);
        parent = Some(h);
        digest = d;
    }
}
