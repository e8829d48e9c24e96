//! The host tier as a level of a hybrid cache's prefix cache.
//!
//! **Design: one host level per group.** Every group is a one-group [`KvCache`] with
//! its own prefix index, and its own host level (`manager/tier_cache.rs`) over the host
//! blocks it owns of the shared host tier (a host block belongs to one group at a
//! time, as for swap). So a group stores, looks up, loads and evicts its own copies
//! with the one-group code, keyed by its own chain hashes; this module spreads the free
//! host blocks over the groups and makes the groups' transfers one job:
//!
//! * a store ([`KvCache::plan_host_store_grouped`]) gives every group an even share of
//!   the free host blocks, then plans each group's store by the configured
//!   [`HostStorePolicy`](crate::manager::HostStorePolicy) (a group evicts its own host entries,
//!   leaf first, when its share is short): one [`GroupSwapJob`] with one ticket per
//!   group, an empty plan for a group with nothing to store;
//! * a lookup ([`KvCache::admit_prompt_grouped`]) goes on into the host levels after
//!   the device part every group holds: a group whose device part goes further looks
//!   its host part up again from there (a sequence is computed as far in every group,
//!   so the device part is the same in every group, and the rest loads). The hit is
//!   the longest prefix every group serves from device or host, and the admission
//!   revives every group's device part first, then moves free pages to the groups
//!   that load (a move may evict a cached page; the revived ones are held by then),
//!   then records each group's load ([`KvCache::load_job_grouped`]: one ticket per
//!   group). The groups' block sizes must be equal (else device hits only);
//! * the load completes or aborts in every group at once
//!   ([`KvCache::complete_swap_grouped`], [`KvCache::abort_swap_grouped`]): a completed
//!   load counts the loaded tokens as computed in every group, an aborted one frees
//!   the loaded pages and keeps the device part in every group.
//!
//! A hybrid cache with a sliding-window or recurrent-state group refuses the host
//! level ([`Error::NotOnHybrid`]): a window group keeps no registered blocks to store
//! (its kept blocks live in `groups/window_cache.rs`), and a state group resumes only
//! from checkpoints, which are not stored. [`KvCache::admit_tokens_grouped`] serves
//! device hits only, as [`KvCache::admit_tokens`] does.

use crate::error::{Error, Result};
use crate::ids::SeqId;
use crate::manager::tier_cache::{HostCacheConfig, HostCacheStats};

use super::{GroupSwapJob, Groups, HOST_LENDER, NOT_LENT};
#[allow(unused_imports)] // for the docs
use crate::manager::KvCache;

/// The `seq` of a store's [`GroupSwapJob`]: a store moves cached blocks, no sequence.
pub(crate) const STORE_JOB: SeqId = SeqId(u64::MAX);

impl Groups {
    /// Whether the groups' host levels can serve hits: no window and no state group.
    pub(super) fn host_level_served(&self) -> bool {
        self.groups.iter().all(|kv| kv.window.is_none()) && !self.has_state_group()
    }

    fn check_host_level(&self, operation: &'static str) -> Result<()> {
        if self.host_level_served() {
            return Ok(());
        }
        Err(Error::NotOnHybrid {
            operation,
            groups: self.groups.len(),
        })
    }

    /// Sets every group's host level to `config`.
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] with a window or state group (nothing changed).
    pub fn set_host_cache(&mut self, config: HostCacheConfig) -> Result<()> {
        self.check_host_level("set_host_cache with a window or state group")?;
        for kv in &mut self.groups {
            kv.set_host_cache(config.clone())?;
        }
        Ok(())
    }

    /// The groups' host-level counters, summed.
    pub fn host_cache_stats(&self) -> HostCacheStats {
        let mut sum = HostCacheStats::default();
        for kv in &self.groups {
            let s = kv.host_cache_stats();
            sum.cached_blocks += s.cached_blocks;
            sum.stores_in_flight += s.stores_in_flight;
            sum.loads_in_flight += s.loads_in_flight;
            sum.stored_blocks += s.stored_blocks;
            sum.stored_bytes += s.stored_bytes;
            sum.removed_blocks += s.removed_blocks;
            sum.aborted_stores += s.aborted_stores;
            sum.loaded_blocks += s.loaded_blocks;
            sum.loaded_bytes += s.loaded_bytes;
            sum.aborted_loads += s.aborted_loads;
            sum.device_hit_tokens += s.device_hit_tokens;
            sum.host_hit_tokens += s.host_hit_tokens;
        }
        sum
    }

    /// Evicts up to `n` host entries in each group (leaf first, by its policy);
    /// returns how many went in all.
    ///
    /// # Errors
    /// A pool error (a corrupt manager).
    pub fn evict_host_cache(&mut self, n: usize) -> Result<usize> {
        let mut evicted = 0;
        for kv in &mut self.groups {
            evicted += kv.evict_host_cache(n)?;
        }
        Ok(evicted)
    }

    /// Plans a store to every group's host level (see the module docs): at most
    /// `max_blocks` blocks in each group. `None` when no group has anything to store
    /// or room for it.
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] with a window or state group. A pool error means the
    /// manager's state was corrupt. Nothing changed on error.
    pub fn plan_host_store(&mut self, max_blocks: usize) -> Result<Option<GroupSwapJob>> {
        self.check_host_level("plan_host_store_grouped with a window or state group")?;
        let n = self.groups.len();
        let free = self.num_free_host_blocks();
        for (g, need) in self.needs.iter_mut().enumerate() {
            *need = free / n + usize::from(g < free % n);
        }
        self.give_host_blocks()?;
        let mut job = GroupSwapJob {
            seq: STORE_JOB,
            tickets: Vec::with_capacity(n),
            plans: Vec::with_capacity(n),
        };
        for g in 0..n {
            let planned = self.groups[g]
                .plan_host_store_inner(max_blocks, true)
                .and_then(|j| {
                    j.ok_or_else(|| Error::CorruptBlockTable("a store without a ticket".into()))
                });
            match planned {
                Ok(j) => {
                    job.tickets.push(j.ticket);
                    job.plans.push(j.plan);
                }
                Err(e) => {
                    // Unreachable on a consistent manager; undo the groups done.
                    for (kv, &t) in self.groups.iter_mut().zip(&job.tickets) {
                        let _ = kv.abort_swap(t);
                    }
                    return Err(e);
                }
            }
        }
        if job.plans.iter().all(|p| p.is_empty()) {
            // Nothing to copy: the empty stores end here, counted as no store.
            self.complete_swap(&job)?;
            return Ok(None);
        }
        Ok(Some(job))
    }

    /// The load of `seq` in flight in every group (admitted from a host hit).
    pub fn load_job(&self, seq: SeqId) -> Option<GroupSwapJob> {
        let mut job = GroupSwapJob {
            seq,
            tickets: Vec::with_capacity(self.groups.len()),
            plans: Vec::with_capacity(self.groups.len()),
        };
        for kv in &self.groups {
            let j = kv.load_job(seq)?;
            job.tickets.push(j.ticket);
            job.plans.push(j.plan);
        }
        Some(job)
    }

    /// Makes `needed` host blocks free for swapped sequences, which come before the
    /// host levels' entries: evicts entries (each group its own, leaf first, group 0
    /// first) when the free blocks are too few.
    ///
    /// # Errors
    /// [`Error::TierFull`] when even evicting every entry that can go (those no load
    /// reads) is not enough; nothing changed then.
    pub(super) fn make_host_room(&mut self, needed: usize) -> Result<()> {
        let free = self.num_free_host_blocks();
        if needed <= free {
            return Ok(());
        }
        let evictable: usize = self
            .groups
            .iter()
            .map(|kv| kv.tiers.host_cache.evictable_count())
            .sum();
        if needed > free + evictable {
            return Err(Error::TierFull {
                tier: "host",
                needed,
                free,
            });
        }
        let mut short = needed - free;
        for kv in &mut self.groups {
            if short == 0 {
                break;
            }
            short -= kv.evict_host_cache(short)?;
        }
        Ok(())
    }

    /// Moves free host blocks so that every group `g` has `needs[g]` free, taking
    /// them from groups with more than their need (the caller checked the total).
    pub(super) fn give_host_blocks(&mut self) -> Result<()> {
        let total: usize = self.needs.iter().sum();
        let free = self.num_free_host_blocks();
        for to in 0..self.groups.len() {
            while self.groups[to].num_free_host_blocks() < self.needs[to] {
                let from = (0..self.groups.len())
                    .find(|&h| h != to && self.groups[h].num_free_host_blocks() > self.needs[h])
                    .ok_or(Error::TierFull {
                        tier: "host",
                        needed: total,
                        free,
                    })?;
                let (block, at) = self.groups[from].lend_host_block(HOST_LENDER)?;
                self.host_lent_pos[from][block.index()] = at as u32;
                let pos = self.host_lent_pos[to][block.index()];
                if let Some(moved) =
                    self.groups[to].reclaim_host_block(HOST_LENDER, pos as usize)?
                {
                    self.host_lent_pos[to][moved.index()] = pos;
                }
                self.host_lent_pos[to][block.index()] = NOT_LENT;
            }
        }
        Ok(())
    }
}
