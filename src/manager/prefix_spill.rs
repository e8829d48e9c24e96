//! Spilling the prefix cache to the host tier, and restoring it.
//!
//! A model put to sleep gives its arena back, and with it the unreferenced blocks its
//! prefix cache holds. Rather than evicting them, [`KvCache::plan_prefix_spill`]
//! plans copying them to free host-tier blocks (a [`SwapPlan`] out); once the executor
//! has run the plan, [`PendingPrefixSpill::commit`] keeps each block's content (hash,
//! parent, token ids, keys) beside its host block and evicts the device copies. Later,
//! [`KvCache::plan_prefix_restore`] plans copying them back into free device
//! blocks (a [`SwapPlan`] in), and [`PendingPrefixRestore::commit`] registers them again
//! under their old hashes, as cached blocks: a request with that prefix hits as if
//! they had never left. [`crate::executor::tier::spill_cached_prefixes`] and
//! [`crate::executor::tier::restore_spilled_prefixes`] do plan, copies and commit.
//!
//! Only what an eviction of everything evictable would drop is spilled: cached,
//! unpinned blocks with no referenced or pinned descendant. When the host tier has
//! fewer free blocks than that, the blocks nearest the root of their chains go first
//! (so every spilled block's parent is spilled too, or stays on the device) and the
//! rest is evicted; [`PrefixSpill`] says how many of each. Spilled blocks hold host
//! blocks until they are restored or dropped ([`KvCache::drop_spilled_prefixes`]),
//! and count in [`crate::manager::TierStats::host_used_blocks`]. A hit is only served from the
//! device: lookups do not see spilled blocks until they are restored.

use std::collections::HashSet;

use super::KvCache;
use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::plans::{SwapDirection, SwapPlan};
use crate::pool::pick_free_run;
use crate::pool::prefix::index::SavedEntry;
use crate::pool::prefix::BlockHash;

/// One cached block whose bytes live in a host-tier block.
#[derive(Debug, Clone)]
pub(crate) struct SpilledPrefix {
    pub(crate) host: BlockId,
    saved: SavedEntry,
}

/// What a committed prefix spill did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixSpill {
    /// Cached blocks copied to the host tier (still indexed, restorable).
    pub spilled_blocks: usize,
    /// Cached blocks evicted because the host tier had no room for them.
    pub evicted_blocks: usize,
}

/// What a committed prefix restore did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixRestore {
    /// Blocks copied back to the device and registered again (cached, findable).
    pub restored_blocks: usize,
    /// Spilled blocks given up: their content is registered on the device again
    /// (computed anew meanwhile) or their parent is gone, so they could never be hit.
    pub dropped_blocks: usize,
    /// Spilled blocks still on the host tier (the arena had no free block for them).
    pub still_spilled_blocks: usize,
}

/// A prefix spill the manager has planned: run [`Self::plan`] (device to host), then
/// [`Self::commit`]. It holds the manager's `&mut` borrow, so nothing can take the
/// host blocks meanwhile; dropping it aborts and leaves the manager as it was (the
/// host blocks written were free, so nothing reads them).
#[derive(Debug)]
#[must_use = "dropping a pending prefix spill aborts it"]
pub struct PendingPrefixSpill<'a> {
    manager: &'a mut KvCache,
    plan: SwapPlan,
    saved: Vec<SavedEntry>,
    evictable: usize,
}

impl PendingPrefixSpill<'_> {
    /// The copies, device block to host block.
    pub fn plan(&self) -> &SwapPlan {
        &self.plan
    }

    /// Blocks the commit keeps on the host tier.
    pub fn spilled_blocks(&self) -> usize {
        self.saved.len()
    }

    /// Blocks the commit evicts (no room on the host tier).
    pub fn evicted_blocks(&self) -> usize {
        self.evictable - self.saved.len()
    }

    /// Records that the copies landed: the host blocks are taken and hold the saved
    /// content, and every evictable cached block leaves the device (spilled or not).
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when the pools disagree with the plan, which was
    /// made under the same borrow: only a manager already corrupt gets there.
    pub fn commit(self) -> Result<PrefixSpill> {
        let m = self.manager;
        for &pair in self.plan.pairs() {
            m.tiers.host_pool_mut().take(pair.host)?;
        }
        let evicted = m.evict_cached(usize::MAX);
        if evicted != self.evictable {
            return Err(Error::CorruptBlockTable(format!(
                "prefix spill planned {} evictable blocks, evicted {evicted}",
                self.evictable
            )));
        }
        for (pair, saved) in self.plan.pairs().iter().zip(self.saved) {
            m.prefix.announce_host(&saved, pair.host, true);
            m.tiers.spilled.push(SpilledPrefix {
                host: pair.host,
                saved,
            });
        }
        let spilled_blocks = self.plan.len();
        Ok(PrefixSpill {
            spilled_blocks,
            evicted_blocks: self.evictable - spilled_blocks,
        })
    }
}

/// A prefix restore the manager has planned: run [`Self::plan`] (host to device), then
/// [`Self::commit`]. Dropping it aborts and leaves the manager as it was (the device
/// blocks written were free).
#[derive(Debug)]
#[must_use = "dropping a pending prefix restore aborts it"]
pub struct PendingPrefixRestore<'a> {
    manager: &'a mut KvCache,
    plan: SwapPlan,
    /// Index into the spilled list of each pair of the plan.
    picks: Vec<usize>,
    /// Indices of spilled blocks to give up.
    drops: Vec<usize>,
}

impl PendingPrefixRestore<'_> {
    /// The copies, host block to device block.
    pub fn plan(&self) -> &SwapPlan {
        &self.plan
    }

    /// Registers the restored blocks again (cached, findable under their old hashes),
    /// releases their host blocks and those of the blocks given up.
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] / [`Error::DoubleFree`] when the pools disagree
    /// with the plan, made under the same borrow: only a manager already corrupt gets
    /// there.
    pub fn commit(self) -> Result<PrefixRestore> {
        let m = self.manager;
        let mut gone = vec![false; m.tiers.spilled.len()];
        let (mut restored, mut dropped) = (0, 0);
        for (pair, &i) in self.plan.pairs().iter().zip(&self.picks) {
            let s = &m.tiers.spilled[i];
            let (dev, host) = (pair.device, s.host);
            m.pool.take(dev)?;
            if m.prefix.restore_entry(dev, &s.saved) {
                m.pool.decref_keep(dev)?;
                m.prefix.on_cached(dev);
                restored += 1;
            } else {
                m.pool.decref(dev)?;
                dropped += 1;
            }
            gone[i] = true;
            m.tiers.host_pool_mut().decref(host)?;
        }
        for &i in &self.drops {
            let host = m.tiers.spilled[i].host;
            m.tiers.host_pool_mut().decref(host)?;
            gone[i] = true;
            dropped += 1;
        }
        let spilled = std::mem::take(&mut m.tiers.spilled);
        for (s, gone) in spilled.into_iter().zip(gone) {
            if gone {
                m.prefix.announce_host(&s.saved, s.host, false);
            } else {
                m.tiers.spilled.push(s);
            }
        }
        Ok(PrefixRestore {
            restored_blocks: restored,
            dropped_blocks: dropped,
            still_spilled_blocks: m.tiers.spilled.len(),
        })
    }
}

impl KvCache {
    /// Plans spilling the prefix cache's evictable blocks to the host tier (see the
    /// module docs): as many as the host tier has free blocks for, parents first; the
    /// commit evicts the rest. Changes nothing until [`PendingPrefixSpill::commit`].
    ///
    /// # Errors
    /// None today; a `Result` so that a later tier check can refuse without an API
    /// change.
    pub fn plan_prefix_spill(&mut self) -> Result<PendingPrefixSpill<'_>> {
        self.one_group("plan_prefix_spill")?;
        let closure = self.prefix.evictable_closure();
        let n = closure.len().min(self.tiers.host_pool().num_free());
        let hosts = pick_free_run(self.tiers.host_pool(), n, 0);
        let mut plan = SwapPlan::new(SwapDirection::Out);
        let mut saved = Vec::with_capacity(n);
        for (&dev, &host) in closure.iter().zip(&hosts) {
            let entry = self.prefix.save_entry(dev).ok_or_else(|| {
                Error::CorruptBlockTable(format!("cached block {dev} has no prefix entry"))
            })?;
            saved.push(entry);
            plan.push(dev, host);
        }
        Ok(PendingPrefixSpill {
            manager: self,
            plan,
            saved,
            evictable: closure.len(),
        })
    }

    /// Plans restoring spilled prefix blocks into free device blocks, parents first, as
    /// many as the free list holds (cached blocks are not evicted for them). Spilled
    /// blocks that can never be hit again (their content is registered on the device
    /// again, or their parent is gone) are given up by the commit. Changes nothing
    /// until [`PendingPrefixRestore::commit`].
    ///
    /// # Errors
    /// None today; a `Result` so that a later check can refuse without an API change.
    pub fn plan_prefix_restore(&mut self) -> Result<PendingPrefixRestore<'_>> {
        self.one_group("plan_prefix_restore")?;
        let spilled = &self.tiers.spilled;
        let mut order: Vec<usize> = (0..spilled.len()).collect();
        order.sort_unstable_by_key(|&i| {
            let s = &spilled[i].saved;
            (s.depth, std::cmp::Reverse(s.last_used), spilled[i].host)
        });
        let all: HashSet<BlockHash> = spilled.iter().map(|s| s.saved.hash).collect();
        let room = self.pool.num_free();
        let (mut picks, mut drops) = (Vec::new(), Vec::new());
        let mut chosen: HashSet<BlockHash> = HashSet::new();
        let mut given_up: HashSet<BlockHash> = HashSet::new();
        for i in order {
            let s = &spilled[i].saved;
            let on_device = |h: BlockHash| self.prefix.block_of(h).is_some();
            if on_device(s.hash) || chosen.contains(&s.hash) {
                drops.push(i);
                given_up.insert(s.hash);
                continue;
            }
            let parent_here = s.parent.is_none_or(|p| on_device(p) || chosen.contains(&p));
            let orphan = s
                .parent
                .is_some_and(|p| !parent_here && (!all.contains(&p) || given_up.contains(&p)));
            if orphan {
                drops.push(i);
                given_up.insert(s.hash);
            } else if parent_here && picks.len() < room {
                picks.push(i);
                chosen.insert(s.hash);
            }
            // Otherwise it stays spilled: no room, or its parent stays spilled.
        }
        let devs = pick_free_run(&self.pool, picks.len(), 0);
        let mut plan = SwapPlan::new(SwapDirection::In);
        for (&i, &dev) in picks.iter().zip(&devs) {
            plan.push(dev, spilled[i].host);
        }
        Ok(PendingPrefixRestore {
            manager: self,
            plan,
            picks,
            drops,
        })
    }

    /// Prefix-cache blocks spilled to the host tier and not yet restored.
    pub fn spilled_prefix_blocks(&self) -> usize {
        if let Some(g0) = self.first_group() {
            return g0.spilled_prefix_blocks();
        }
        self.tiers.spilled.len()
    }

    /// Gives up every spilled prefix block (after a weight update, say: their K/V is
    /// stale) and frees their host blocks. Returns how many.
    ///
    /// # Errors
    /// [`Error::DoubleFree`] only when the host tier's refcounts were already corrupt;
    /// the blocks before it are released.
    pub fn drop_spilled_prefixes(&mut self) -> Result<usize> {
        self.one_group("drop_spilled_prefixes")?;
        let spilled = std::mem::take(&mut self.tiers.spilled);
        let n = spilled.len();
        for s in spilled {
            self.tiers.host_pool_mut().decref(s.host)?;
            self.prefix.announce_host(&s.saved, s.host, false);
        }
        Ok(n)
    }
}
