//! The disk tier as the third level of the prefix cache.
//!
//! The bytes and the journal of the disk level live in the executor's
//! [`crate::executor::tier::DiskPrefixStore`]; the manager keeps the level's *index*
//! (hash -> disk slot and the block's identity, like the host index) and plans every
//! move, so that bookkeeping stays pure and a lookup never touches a file.
//!
//! # Open
//!
//! ```text
//! DiskPrefixStore::open(dir) --entries()--> KvCache::adopt_disk_prefixes: findable on disk
//! ```
//!
//! After a restart the store replays its journal; [`KvCache::adopt_disk_prefixes`]
//! takes its entries (parents first) into the manager's disk index
//! (`executor::tier::adopt_disk_store` does both).
//!
//! # Store (host -> disk)
//!
//! ```text
//! plan_disk_store ---> (store_from each item) ---> complete_disk_store(placements)
//! ```
//!
//! [`KvCache::plan_disk_store`] picks host entries the disk index does not hold (nor is
//! storing) by [`DiskStorePolicy`]: every one (write-through) or the ones the host
//! level evicts next (write-back). The host level evicts synchronously, inside the
//! manager, so an entry can only reach the disk while it is still on the host: the
//! store runs ahead of eviction, the way the host level's own write-back runs ahead of
//! the device's. Each picked entry gets one more reader (its host block is not evicted
//! nor reused) until [`KvCache::complete_disk_store`] reports where each block went
//! (a [`DiskPlacement`]: its slot and the entry the store evicted for it, if any).
//! Items not reported were not stored. The manager announces Disk-medium
//! `BlockStored` / `BlockRemoved` events from those reports: the store chooses its
//! own victims (leaf-first LRU), the manager mirrors them.
//!
//! # Lookup and load (disk -> host -> device)
//!
//! [`KvCache::lookup_prefix`] continues past the device and host parts in the disk
//! index ([`crate::PrefixHit::disk_tokens`]) and stops at the first block no tier
//! holds. [`KvCache::admit_prompt`] of such a hit allocates a device block and a
//! *staging* host block per disk block (as many as the host tier can give, evicting
//! host entries not read by this load; the rest of the disk part is computed again)
//! and records one load for the host and disk parts. The executor reads each disk
//! block into its staging block ([`KvCache::disk_load_job`]), reports that with
//! [`KvCache::mark_disk_load_staged`], runs the host -> device plan and completes the
//! swap: only then do the tokens count as computed. A block the store no longer holds
//! or whose bytes fail their checksum is a miss: the executor aborts the load (the
//! sequence keeps its device part, computed; host copies stay) and drops the entry
//! from the disk index ([`KvCache::remove_disk_entry`]). The staging blocks are
//! released when the load ends (the disk copy stays; the device copy is registered).
//!
//! Consistency across tiers: a chain is stored parents first, and a lookup confirms
//! every block against its parent hash, tokens, keys and namespace in whichever tier
//! holds it, so a chain cut in one tier is a shorter hit, never a wrong one.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::KvCache;
use crate::error::{Error, Result};
use crate::ids::{BlockId, DiskSlot, SeqId, SwapTicket};
use crate::pool::prefix::index::{BlockKeys, Namespace, PrefixIndex, SavedEntry};
use crate::pool::prefix::{BlockDigest, BlockHash, DiskEntry};

/// Which host entries [`KvCache::plan_disk_store`] copies to the disk level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DiskStorePolicy {
    /// Every host entry the disk level does not hold, parents first.
    #[default]
    WriteThrough,
    /// At most `ahead_blocks` host entries nearest host eviction (lowest eviction key
    /// first), stored parents first.
    WriteBack {
        /// How many host entries nearest eviction a plan looks at.
        ahead_blocks: usize,
    },
}

/// Tuning of the disk level of the prefix cache ([`KvCache::set_disk_cache`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskCacheConfig {
    /// What a store copies.
    pub store: DiskStorePolicy,
}

/// Counters of the disk level of the prefix cache (the manager's side; the store's
/// own counters are [`crate::executor::tier::DiskPrefixStore::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskLevelStats {
    /// Entries in the disk index now.
    pub cached_blocks: usize,
    /// Disk stores planned and not yet completed.
    pub stores_in_flight: usize,
    /// Entries taken from a store's journal ([`KvCache::adopt_disk_prefixes`]).
    pub adopted_blocks: u64,
    /// Blocks that became disk entries through a completed store.
    pub stored_blocks: u64,
    /// Entries that left the index: evicted by the store, or dropped.
    pub removed_blocks: u64,
    /// Of those, evicted by the store to make room.
    pub evicted_blocks: u64,
    /// Of those, dropped after a load found them missing or corrupt.
    pub dropped_blocks: u64,
    /// Blocks loaded from disk to the device (completed loads).
    pub loaded_blocks: u64,
    /// Prompt tokens served from the disk level (counted when their load completes).
    pub disk_hit_tokens: u64,
}

/// One block of a disk store: the host block holding it and its identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskStoreItem {
    /// The host-tier block to read.
    pub host: BlockId,
    /// The block's identity, as the store journals it.
    pub entry: DiskEntry,
}

/// A store to the disk level to carry out ([`KvCache::plan_disk_store`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskStoreJob {
    /// The ticket to complete it with.
    pub ticket: SwapTicket,
    /// The blocks, parents first.
    pub items: Vec<DiskStoreItem>,
}

/// Where the store put one block of a [`DiskStoreJob`]
/// ([`KvCache::complete_disk_store`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskPlacement {
    /// The stored block's hash.
    pub hash: BlockHash,
    /// The slot holding it.
    pub slot: DiskSlot,
    /// The entry the store evicted to make room (its hash and slot), if any.
    pub evicted: Option<(BlockHash, DiskSlot)>,
}

/// One block of a load from the disk level: read `hash` from the store into staging
/// host block `host`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLoadItem {
    /// The block's hash in the store.
    pub hash: BlockHash,
    /// The staging host-tier block to write.
    pub host: BlockId,
}

/// The disk part of a load in flight ([`KvCache::disk_load_job`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskLoadJob {
    /// The load's ticket (the one of [`KvCache::load_job`]).
    pub ticket: SwapTicket,
    /// The loading sequence.
    pub seq: SeqId,
    /// The disk blocks to stage, in chain order.
    pub items: Vec<DiskLoadItem>,
}

/// One entry of the disk index.
#[derive(Debug, Clone)]
pub(crate) struct DiskIndexEntry {
    pub(crate) slot: DiskSlot,
    pub(crate) saved: SavedEntry,
}

/// The disk level's bookkeeping inside the tiers.
#[derive(Debug, Clone, Default)]
pub(crate) struct DiskLevel {
    config: DiskCacheConfig,
    pub(crate) entries: HashMap<BlockHash, DiskIndexEntry>,
    /// Stores in flight: the hashes and host blocks read.
    pub(crate) stores: BTreeMap<SwapTicket, Vec<(BlockHash, BlockId)>>,
    pub(crate) stats: DiskLevelStats,
}

impl DiskLevel {
    /// Host entries read by disk stores in flight, with how many stores read each.
    pub(crate) fn readers(&self) -> HashMap<BlockHash, u32> {
        let mut out: HashMap<BlockHash, u32> = HashMap::new();
        for &(h, _) in self.stores.values().flatten() {
            *out.entry(h).or_default() += 1;
        }
        out
    }

    /// Pushes onto `out` the hashes of the disk entries that continue a chain after
    /// `first` blocks (the last with hash and digest `last`), for the leading blocks of
    /// `tokens` up to `max_blocks` in all.
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
        super::tier_cache::extend_chain_hit(
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

    /// Checks the level against itself: keys, unique slots, counters.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let mut slots = HashSet::new();
        for (&h, e) in &self.entries {
            if e.saved.hash != h {
                return Err(format!("disk entry {h:?} holds {:?}", e.saved.hash));
            }
            if !slots.insert(e.slot) {
                return Err(format!("disk slot {} holds two entries", e.slot));
            }
        }
        let s = &self.stats;
        let held = (s.adopted_blocks + s.stored_blocks).checked_sub(s.removed_blocks);
        if held != Some(self.entries.len() as u64)
            || s.evicted_blocks + s.dropped_blocks > s.removed_blocks
        {
            return Err(format!(
                "{} disk entries but {} adopted, {} stored, {} removed ({} evicted, {} dropped)",
                self.entries.len(),
                s.adopted_blocks,
                s.stored_blocks,
                s.removed_blocks,
                s.evicted_blocks,
                s.dropped_blocks
            ));
        }
        let mut storing = HashSet::new();
        // (A hash being stored may be held on disk meanwhile: adopted from the store
        // while the store was in flight; its completion then keeps the entry.)
        for &(h, _) in self.stores.values().flatten() {
            if !storing.insert(h) {
                return Err(format!("{h:?} is stored twice"));
            }
        }
        Ok(())
    }
}

impl KvCache {
    /// Sets the disk level's configuration; the entries stay. See the module docs of
    /// `manager/disk_level.rs`.
    ///
    /// On a hybrid cache of full and latent groups, every group's disk level
    /// (`groups/disk_level.rs`).
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] on a hybrid cache with a window or state group.
    pub fn set_disk_cache(&mut self, config: DiskCacheConfig) -> Result<()> {
        if let Some(h) = &mut self.hybrid {
            return h.set_disk_cache(config);
        }
        self.tiers.disk_cache.config = config;
        Ok(())
    }

    /// The disk level's configuration (group 0's on a hybrid cache).
    pub fn disk_cache_config(&self) -> DiskCacheConfig {
        if let Some(g0) = self.first_group() {
            return g0.disk_cache_config();
        }
        self.tiers.disk_cache.config
    }

    /// Counters of the disk level now (on a hybrid cache, every group's, summed).
    pub fn disk_cache_stats(&self) -> DiskLevelStats {
        if let Some(h) = &self.hybrid {
            return h.disk_cache_stats();
        }
        let d = &self.tiers.disk_cache;
        DiskLevelStats {
            cached_blocks: d.entries.len(),
            stores_in_flight: d.stores.len(),
            ..d.stats
        }
    }

    /// The disk slot holding the block with this hash in the disk index, if any
    /// (`None` on a hybrid cache, whose groups keep the indexes:
    /// [`Self::disk_cache_slot_grouped`]).
    pub fn disk_cache_slot(&self, hash: BlockHash) -> Option<DiskSlot> {
        self.tiers.disk_cache.entries.get(&hash).map(|e| e.slot)
    }

    /// Takes the entries of a disk store (as
    /// [`crate::executor::tier::DiskPrefixStore::entries`] lists them after an open,
    /// parents first) into the disk index, so lookups find them. A hash the index
    /// holds already is skipped (its slot is kept). Returns the entries taken.
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] on a hybrid cache; [`Error::ShapeMismatch`] for an entry
    /// whose token ids are not `block_size` of them; [`Error::CorruptBlockTable`] for a
    /// slot named twice (by two entries, or by an entry and the index). Nothing
    /// changed on error.
    pub fn adopt_disk_prefixes<'a, I>(&mut self, entries: I) -> Result<usize>
    where
        I: IntoIterator<Item = (DiskSlot, &'a DiskEntry)>,
    {
        self.one_group("adopt_disk_prefixes")?;
        let bs = self.block_size();
        let level = &self.tiers.disk_cache;
        let mut used: HashSet<DiskSlot> = level.entries.values().map(|e| e.slot).collect();
        let mut depth: HashMap<BlockHash, u32> = HashMap::new();
        let mut new: Vec<DiskIndexEntry> = Vec::new();
        for (slot, e) in entries {
            if e.tokens.len() != bs {
                return Err(Error::ShapeMismatch {
                    what: "token ids of one disk-cached block",
                    expected: bs,
                    got: e.tokens.len(),
                });
            }
            if level.entries.contains_key(&e.hash) || depth.contains_key(&e.hash) {
                continue;
            }
            if !used.insert(slot) {
                return Err(Error::CorruptBlockTable(format!(
                    "disk slot {slot} named twice in the disk index"
                )));
            }
            let d = e
                .parent
                .and_then(|p| {
                    depth
                        .get(&p)
                        .copied()
                        .or_else(|| level.entries.get(&p).map(|x| x.saved.depth))
                })
                .map_or(1, |d| d.saturating_add(1));
            depth.insert(e.hash, d);
            new.push(DiskIndexEntry {
                slot,
                saved: SavedEntry::from_disk_entry(e, d),
            });
        }
        let n = new.len();
        for e in new {
            self.prefix.announce_disk(&e.saved, e.slot, true);
            self.tiers.disk_cache.entries.insert(e.saved.hash, e);
        }
        self.tiers.disk_cache.stats.adopted_blocks += n as u64;
        Ok(n)
    }

    /// Plans a store of host entries to the disk level by the configured
    /// [`DiskStorePolicy`]: at most `max_blocks` host entries whose hash the disk index
    /// neither holds nor is storing, parents first. Returns `None` when there is
    /// nothing to store. Write each item's host block into the store (e.g.
    /// `DiskPrefixStore::store_from`), then report where each went with
    /// [`Self::complete_disk_store`]; meanwhile the host entries are held (not
    /// evicted).
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] on a hybrid cache; a pool error means the manager's state
    /// was corrupt. Nothing changed on error.
    pub fn plan_disk_store(&mut self, max_blocks: usize) -> Result<Option<DiskStoreJob>> {
        self.one_group("plan_disk_store")?;
        let disk = &self.tiers.disk_cache;
        let storing: HashSet<BlockHash> = disk.stores.values().flatten().map(|x| x.0).collect();
        let mut picks = self
            .tiers
            .host_cache
            .store_candidates(|h| !disk.entries.contains_key(&h) && !storing.contains(&h));
        if let DiskStorePolicy::WriteBack { ahead_blocks } = disk.config.store {
            // Nearest host eviction first, then parents first among those kept.
            picks.sort_by_key(|c| c.key);
            picks.truncate(ahead_blocks);
        }
        picks.sort_by_key(|c| (c.depth, c.host));
        picks.truncate(max_blocks);
        if picks.is_empty() {
            return Ok(None);
        }
        // Check the pool first, so that a corrupt state fails before anything changed.
        for c in &picks {
            if self.tiers.host_pool().refcount(c.host)? == 0 {
                return Err(Error::CorruptBlockTable(format!(
                    "host entry in free host block {}",
                    c.host
                )));
            }
        }
        let mut items = Vec::with_capacity(picks.len());
        let mut reads = Vec::with_capacity(picks.len());
        for c in picks {
            let Some(entry) = self
                .tiers
                .host_cache
                .saved_of(c.hash)
                .map(|s| s.to_disk_entry())
            else {
                continue;
            };
            self.tiers.host_pool_mut().incref(c.host)?;
            self.tiers.host_cache.add_reader(c.hash);
            reads.push((c.hash, c.host));
            items.push(DiskStoreItem {
                host: c.host,
                entry,
            });
        }
        let ticket = self.tiers.next_ticket();
        self.tiers.disk_cache.stores.insert(ticket, reads);
        Ok(Some(DiskStoreJob { ticket, items }))
    }

    /// Completes a disk store: `placements` say where the store put each block it
    /// stored (also a block it held already) and what it evicted for it; a block of
    /// the job not named was not stored. The host entries are released, the stored
    /// blocks become findable on disk (a Disk-medium `BlockStored` event each) and the
    /// evicted ones leave the disk index (`BlockRemoved`). An empty `placements`
    /// aborts the store.
    ///
    /// # Errors
    /// [`Error::UnknownTicket`] when `ticket` is not a disk store in flight;
    /// [`Error::CorruptBlockTable`] for a placement of a hash the job does not store.
    /// Nothing changed on either. A pool error means the manager's state was corrupt
    /// (reported after everything was processed).
    pub fn complete_disk_store(
        &mut self,
        ticket: SwapTicket,
        placements: &[DiskPlacement],
    ) -> Result<()> {
        self.one_group("complete_disk_store")?;
        self.check_disk_store(ticket, placements)?;
        let reads = self
            .tiers
            .disk_cache
            .stores
            .remove(&ticket)
            .unwrap_or_default();
        let mut result = Ok(());
        let mut saved: HashMap<BlockHash, SavedEntry> = HashMap::new();
        for &(h, host) in &reads {
            if let Some(s) = self.tiers.host_cache.saved_of(h) {
                saved.insert(h, s.clone());
            }
            self.tiers.host_cache.remove_reader(h);
            result = result.and(self.tiers.host_pool_mut().decref(host).map(drop));
        }
        for p in placements {
            if let Some((gone, _)) = p.evicted {
                self.drop_disk_entry(gone, false);
            }
            // The store reports the slot now holds this block: an entry the index
            // still had there is gone from the store.
            let stale: Vec<BlockHash> = self
                .tiers
                .disk_cache
                .entries
                .values()
                .filter(|e| e.slot == p.slot && e.saved.hash != p.hash)
                .map(|e| e.saved.hash)
                .collect();
            for h in stale {
                self.drop_disk_entry(h, false);
            }
            if self.tiers.disk_cache.entries.contains_key(&p.hash) {
                continue;
            }
            let Some(s) = saved.get(&p.hash) else {
                continue;
            };
            self.prefix.announce_disk(s, p.slot, true);
            let level = &mut self.tiers.disk_cache;
            level.stats.stored_blocks += 1;
            level.entries.insert(
                p.hash,
                DiskIndexEntry {
                    slot: p.slot,
                    saved: s.clone(),
                },
            );
        }
        result
    }

    /// The refusals of [`Self::complete_disk_store`], checked without a change.
    pub(crate) fn check_disk_store(
        &self,
        ticket: SwapTicket,
        placements: &[DiskPlacement],
    ) -> Result<()> {
        let reads = self
            .tiers
            .disk_cache
            .stores
            .get(&ticket)
            .ok_or(Error::UnknownTicket(ticket))?;
        if let Some(p) = placements
            .iter()
            .find(|p| !reads.iter().any(|&(h, _)| h == p.hash))
        {
            return Err(Error::CorruptBlockTable(format!(
                "disk placement of {:?}, not stored by {ticket}",
                p.hash
            )));
        }
        Ok(())
    }

    /// Drops the block with this hash from the disk index (a Disk-medium
    /// `BlockRemoved` event), e.g. after the store reported it missing or corrupt or
    /// removed it. Returns whether it was held (`false` on a hybrid cache:
    /// [`Self::remove_disk_entry_grouped`] names the group).
    pub fn remove_disk_entry(&mut self, hash: BlockHash) -> bool {
        self.drop_disk_entry(hash, true)
    }

    fn drop_disk_entry(&mut self, hash: BlockHash, dropped: bool) -> bool {
        let level = &mut self.tiers.disk_cache;
        let Some(e) = level.entries.remove(&hash) else {
            return false;
        };
        level.stats.removed_blocks += 1;
        if dropped {
            level.stats.dropped_blocks += 1;
        } else {
            level.stats.evicted_blocks += 1;
        }
        self.prefix.announce_disk(&e.saved, e.slot, false);
        true
    }

    /// The leading hashes of `hashes` (a hit's disk part) the disk index still holds
    /// under the chain from `parent`, for blocks `first..` of `tokens`.
    pub(crate) fn confirm_disk_hit(
        &self,
        hashes: &[BlockHash],
        first: usize,
        mut parent: Option<BlockHash>,
        ns: &Namespace,
        keys: &BlockKeys,
        tokens: &[u32],
    ) -> Vec<BlockHash> {
        let bs = self.block_size();
        let entries = &self.tiers.disk_cache.entries;
        let mut out = Vec::with_capacity(hashes.len());
        for (i, &h) in hashes.iter().enumerate() {
            let b = first + i;
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
