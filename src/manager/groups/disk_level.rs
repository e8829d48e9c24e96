//! The disk level of the prefix cache on a hybrid cache of full and latent groups.
//!
//! **Design: one disk level per group, each over a store of its own.** Every group is
//! a one-group [`KvCache`] with its own prefix index and host level
//! (`groups/host_level.rs`); it also keeps its own disk index (`manager/disk_level.rs`),
//! which mirrors a [`DiskPrefixStore`](crate::executor::tier::DiskPrefixStore) of its
//! own: one store directory per group, made for the group's layout. The groups' chain
//! hashes are computed the same way in every group (the same tokens give the same
//! hash), so the groups cannot share one store keyed by hash; and a latent group's
//! block has another layout than a full group's. The disk slots are the stores' own,
//! so nothing is lent between groups on disk. What this module adds to the one-group
//! calls:
//!
//! * a store ([`KvCache::plan_disk_store_grouped`]) plans every group's store by the
//!   configured [`DiskStorePolicy`](crate::manager::DiskStorePolicy) (each group's
//!   host entries, read from the shared host tier): one [`GroupDiskStoreJob`], one
//!   ticket per group that has something to store; it completes (or, with no
//!   placements, aborts) in every group at once
//!   ([`KvCache::complete_disk_store_grouped`]), checked in every group before
//!   anything changes;
//! * a lookup ([`KvCache::admit_prompt_grouped`]) goes on past each group's host part
//!   into its disk index: the hit is the longest prefix every group holds on some
//!   tier (device, host or disk), cut further so that every group's disk part has a
//!   staging block in the shared host tier: a free block, or one of a host entry
//!   that no group's part of this load reads (evicted, leaf first, as on one group;
//!   the rest of the disk part is computed again). The admission evicts those
//!   entries, moves the free host blocks to the groups that stage, then records each
//!   group's load (host and disk parts) as on one group;
//! * the load's disk parts ([`KvCache::disk_load_job_grouped`]) are read from each
//!   group's store into the staging blocks and marked staged in every group at once
//!   ([`KvCache::mark_disk_load_staged_grouped`]); then the load's plans run and
//!   [`KvCache::complete_swap_grouped`] completes it (refused, with nothing changed,
//!   while any group's disk part is not staged), or [`KvCache::abort_swap_grouped`]
//!   frees the loaded pages and the staging blocks and keeps the device part in every
//!   group;
//! * a restart adopts each group's reopened store into its own index
//!   ([`KvCache::adopt_disk_prefixes_grouped`]).
//!
//! A hybrid cache with a sliding-window or recurrent-state group refuses the disk
//! level as it refuses the host level ([`Error::NotOnHybrid`]).

use crate::error::{Error, Result};
use crate::ids::{DiskSlot, SeqId};
use crate::manager::disk_level::{
    DiskCacheConfig, DiskLevelStats, DiskLoadJob, DiskPlacement, DiskStoreJob,
};
use crate::manager::KvCache;
use crate::pool::prefix::{BlockHash, DiskEntry};

use super::{GroupSwapJob, Groups, PrefixHit};

/// A store to every group's disk level ([`KvCache::plan_disk_store_grouped`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupDiskStoreJob {
    /// Group `g`'s store (`None`: nothing to store in that group). Write each item's
    /// host block into group `g`'s store.
    pub jobs: Vec<Option<DiskStoreJob>>,
}

/// The disk parts of a load in every group ([`KvCache::disk_load_job_grouped`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupDiskLoadJob {
    /// The loading sequence.
    pub seq: SeqId,
    /// Group `g`'s disk part (`None`: the group loads no block from disk). Read each
    /// item from group `g`'s store into its staging host block.
    pub jobs: Vec<Option<DiskLoadJob>>,
}

/// The tokens of a hit's host and disk parts.
pub(super) fn tier_tokens(hit: &PrefixHit) -> usize {
    hit.host_tokens() + hit.disk_tokens()
}

impl Groups {
    fn check_disk_level(&self, operation: &'static str) -> Result<()> {
        if self.host_level_served() {
            return Ok(());
        }
        Err(Error::NotOnHybrid {
            operation,
            groups: self.groups.len(),
        })
    }

    fn check_group(&self, g: usize) -> Result<()> {
        if g < self.groups.len() {
            return Ok(());
        }
        Err(Error::config(
            "group",
            format!("group {g} of a cache of {} groups", self.groups.len()),
        ))
    }

    /// Sets every group's disk level to `config`.
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] with a window or state group (nothing changed).
    pub(crate) fn set_disk_cache(&mut self, config: DiskCacheConfig) -> Result<()> {
        self.check_disk_level("set_disk_cache with a window or state group")?;
        for kv in &mut self.groups {
            kv.set_disk_cache(config)?;
        }
        Ok(())
    }

    /// The groups' disk-level counters, summed.
    pub(crate) fn disk_cache_stats(&self) -> DiskLevelStats {
        let mut sum = DiskLevelStats::default();
        for kv in &self.groups {
            let s = kv.disk_cache_stats();
            sum.cached_blocks += s.cached_blocks;
            sum.stores_in_flight += s.stores_in_flight;
            sum.adopted_blocks += s.adopted_blocks;
            sum.stored_blocks += s.stored_blocks;
            sum.removed_blocks += s.removed_blocks;
            sum.evicted_blocks += s.evicted_blocks;
            sum.dropped_blocks += s.dropped_blocks;
            sum.loaded_blocks += s.loaded_blocks;
            sum.disk_hit_tokens += s.disk_hit_tokens;
        }
        sum
    }

    /// Plans every group's store to its disk level; `None` when no group has anything
    /// to store.
    pub(crate) fn plan_disk_store(
        &mut self,
        max_blocks: usize,
    ) -> Result<Option<GroupDiskStoreJob>> {
        self.check_disk_level("plan_disk_store_grouped with a window or state group")?;
        let mut jobs: Vec<Option<DiskStoreJob>> = Vec::with_capacity(self.groups.len());
        for g in 0..self.groups.len() {
            match self.groups[g].plan_disk_store(max_blocks) {
                Ok(j) => jobs.push(j),
                Err(e) => {
                    // Unreachable on a consistent manager; undo the groups done.
                    for (kv, j) in self.groups.iter_mut().zip(&jobs) {
                        if let Some(j) = j {
                            let _ = kv.complete_disk_store(j.ticket, &[]);
                        }
                    }
                    return Err(e);
                }
            }
        }
        if jobs.iter().all(Option::is_none) {
            return Ok(None);
        }
        Ok(Some(GroupDiskStoreJob { jobs }))
    }

    /// Completes every group's store of `job` with its `placements`.
    pub(crate) fn complete_disk_store(
        &mut self,
        job: &GroupDiskStoreJob,
        placements: &[Vec<DiskPlacement>],
    ) -> Result<()> {
        let n = self.groups.len();
        for (what, got) in [
            ("stores of the group disk store job", job.jobs.len()),
            ("placement lists of the group disk store", placements.len()),
        ] {
            if got != n {
                return Err(Error::ShapeMismatch {
                    what,
                    expected: n,
                    got,
                });
            }
        }
        // Every group's ticket and placements first: nothing changes on a refusal.
        for ((kv, j), p) in self.groups.iter().zip(&job.jobs).zip(placements) {
            match j {
                Some(j) => kv.check_disk_store(j.ticket, p)?,
                None if p.is_empty() => {}
                None => {
                    return Err(Error::CorruptBlockTable(format!(
                        "disk placement of {:?} in a group that stores nothing",
                        p[0].hash
                    )))
                }
            }
        }
        let mut result = Ok(());
        for ((kv, j), p) in self.groups.iter_mut().zip(&job.jobs).zip(placements) {
            if let Some(j) = j {
                result = result.and(kv.complete_disk_store(j.ticket, p));
            }
        }
        result
    }

    /// Takes a store's entries into group `g`'s disk index.
    pub(crate) fn adopt_disk_prefixes<'a, I>(&mut self, g: usize, entries: I) -> Result<usize>
    where
        I: IntoIterator<Item = (DiskSlot, &'a DiskEntry)>,
    {
        self.check_disk_level("adopt_disk_prefixes_grouped with a window or state group")?;
        self.check_group(g)?;
        self.groups[g].adopt_disk_prefixes(entries)
    }

    /// Drops `hash` from group `g`'s disk index; whether it was held.
    pub(crate) fn remove_disk_entry(&mut self, g: usize, hash: BlockHash) -> bool {
        self.groups
            .get_mut(g)
            .is_some_and(|kv| kv.remove_disk_entry(hash))
    }

    /// Every group's disk part of the load of `seq`; `None` when no group has one.
    pub(crate) fn disk_load_job(&self, seq: SeqId) -> Option<GroupDiskLoadJob> {
        let jobs: Vec<Option<DiskLoadJob>> =
            self.groups.iter().map(|kv| kv.disk_load_job(seq)).collect();
        if jobs.iter().all(Option::is_none) {
            return None;
        }
        Some(GroupDiskLoadJob { seq, jobs })
    }

    /// Marks every group's disk part of `job` staged.
    pub(crate) fn mark_disk_load_staged(&mut self, job: &GroupDiskLoadJob) -> Result<()> {
        if job.jobs.len() != self.groups.len() {
            return Err(Error::ShapeMismatch {
                what: "disk parts of the group disk load job",
                expected: self.groups.len(),
                got: job.jobs.len(),
            });
        }
        // Every ticket first: nothing changes on a refusal.
        for (kv, j) in self.groups.iter().zip(&job.jobs) {
            if let Some(j) = j {
                if !kv.is_host_load(j.ticket) {
                    return Err(Error::UnknownTicket(j.ticket));
                }
            }
        }
        for (kv, j) in self.groups.iter_mut().zip(&job.jobs) {
            if let Some(j) = j {
                kv.mark_disk_load_staged(j.ticket)?;
            }
        }
        Ok(())
    }

    /// Refuses the completion of `job` when a group's disk part is not staged, before
    /// any group completes.
    pub(super) fn check_staged(&self, job: &GroupSwapJob) -> Result<()> {
        for (kv, &t) in self.groups.iter().zip(&job.tickets) {
            if let Some(seq) = kv.unstaged_disk_load(t) {
                return Err(Error::SequenceState {
                    seq,
                    state: "loading with its disk part not staged",
                    needed: "every group's disk part staged (mark_disk_load_staged_grouped)",
                });
            }
        }
        Ok(())
    }

    /// The leading tokens after `device` of a hit of `cached` tokens (device part
    /// included) whose disk parts, in every group, fit as staging blocks in the
    /// shared host tier's free blocks and the host entries that can be evicted (none
    /// that the hit's host parts read): `cached` cut by whole blocks until they do.
    pub(super) fn cut_to_staging_room(
        &self,
        hits: &[PrefixHit],
        device: usize,
        mut cached: usize,
    ) -> usize {
        let bs = self.groups[0].block_size();
        // Each group's free host blocks and the entries it can evict; the host parts
        // before the cut are protected (a superset of those after it).
        let free: usize = self
            .groups
            .iter()
            .zip(hits)
            .map(|(kv, h)| kv.staging_room(h.host_hashes()))
            .sum();
        let staging = |cached: usize| -> usize {
            let blocks = (cached - device) / bs;
            hits.iter()
                .map(|h| blocks.saturating_sub(h.host_blocks()).min(h.disk_blocks()))
                .sum()
        };
        while cached > device && staging(cached) > free {
            cached -= bs;
        }
        cached
    }

    /// Makes a free host block for each block of the hits' disk parts (counted by
    /// [`Self::cut_to_staging_room`]): evicts host entries the hits' host parts do not
    /// read (each group its own, leaf first, group 0 first) when the free blocks are
    /// too few, then moves free host blocks to the groups that stage.
    pub(super) fn give_staging_blocks(&mut self, hits: &[PrefixHit]) -> Result<()> {
        let need: usize = hits.iter().map(PrefixHit::disk_blocks).sum();
        let mut short = need.saturating_sub(self.num_free_host_blocks());
        for (kv, hit) in self.groups.iter_mut().zip(hits) {
            if short == 0 {
                break;
            }
            // The entries this load reads are held while the group evicts.
            for &h in hit.host_hashes() {
                kv.tiers.host_cache.add_reader(h);
            }
            let n = short.min(kv.tiers.host_cache.evictable_count());
            let evicted = kv.evict_host_entries(n);
            for &h in hit.host_hashes() {
                kv.tiers.host_cache.remove_reader(h);
            }
            evicted?;
            short -= n;
        }
        if short > 0 {
            return Err(Error::TierFull {
                tier: "host",
                needed: need,
                free: self.num_free_host_blocks(),
            });
        }
        for (need, hit) in self.needs.iter_mut().zip(hits) {
            *need = hit.disk_blocks();
        }
        self.give_host_blocks()
    }
}

impl KvCache {
    /// Plans a store to the disk level of the prefix cache in every group (see
    /// [`Self::plan_disk_store`] for one group, and `groups/disk_level.rs`): each
    /// group's host entries by the configured policy, at most `max_blocks` a group.
    /// Write each item of `jobs[g]` into group `g`'s
    /// [`DiskPrefixStore`](crate::executor::tier::DiskPrefixStore), then report where
    /// each went with [`Self::complete_disk_store_grouped`]; meanwhile the host entries
    /// are held. `None` when no group has anything to store. On a one-group cache, the
    /// one job of [`Self::plan_disk_store`].
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] on a hybrid cache with a window or state group. A pool
    /// error means the manager's state was corrupt. Nothing changed on error.
    pub fn plan_disk_store_grouped(
        &mut self,
        max_blocks: usize,
    ) -> Result<Option<GroupDiskStoreJob>> {
        match &mut self.hybrid {
            Some(h) => h.plan_disk_store(max_blocks),
            None => Ok(self
                .plan_disk_store(max_blocks)?
                .map(|j| GroupDiskStoreJob {
                    jobs: vec![Some(j)],
                })),
        }
    }

    /// Completes every group's store of `job`: `placements[g]` says where group `g`'s
    /// store put each block (see [`Self::complete_disk_store`]); empty lists abort.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `job` or `placements` has not one entry per group;
    /// [`Error::UnknownTicket`] when a group's store is not in flight;
    /// [`Error::CorruptBlockTable`] for a placement of a hash its group's job does not
    /// store. Nothing changed on any of these (every group is checked first).
    pub fn complete_disk_store_grouped(
        &mut self,
        job: &GroupDiskStoreJob,
        placements: &[Vec<DiskPlacement>],
    ) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.complete_disk_store(job, placements),
            None => {
                let (Some(Some(j)), Some(p), 1, 1) = (
                    job.jobs.first(),
                    placements.first(),
                    job.jobs.len(),
                    placements.len(),
                ) else {
                    return Err(Error::ShapeMismatch {
                        what: "stores of the group disk store job",
                        expected: 1,
                        got: job.jobs.len(),
                    });
                };
                self.complete_disk_store(j.ticket, p)
            }
        }
    }

    /// Takes the entries of group `g`'s disk store (as
    /// [`DiskPrefixStore::entries`](crate::executor::tier::DiskPrefixStore::entries)
    /// lists them after an open) into group `g`'s disk index (see
    /// [`Self::adopt_disk_prefixes`]). Returns the entries taken.
    ///
    /// # Errors
    /// [`Error::NotOnHybrid`] on a hybrid cache with a window or state group;
    /// [`Error::InvalidConfig`] for a group the cache does not have; as
    /// [`Self::adopt_disk_prefixes`]. Nothing changed on error.
    pub fn adopt_disk_prefixes_grouped<'a, I>(&mut self, g: usize, entries: I) -> Result<usize>
    where
        I: IntoIterator<Item = (DiskSlot, &'a DiskEntry)>,
    {
        match &mut self.hybrid {
            Some(h) => h.adopt_disk_prefixes(g, entries),
            None if g == 0 => self.adopt_disk_prefixes(entries),
            None => Err(Error::config(
                "group",
                format!("group {g} of a one-group cache"),
            )),
        }
    }

    /// Drops `hash` from group `g`'s disk index (see [`Self::remove_disk_entry`]);
    /// whether it was held.
    pub fn remove_disk_entry_grouped(&mut self, g: usize, hash: BlockHash) -> bool {
        match &mut self.hybrid {
            Some(h) => h.remove_disk_entry(g, hash),
            None => g == 0 && self.remove_disk_entry(hash),
        }
    }

    /// The disk slot holding `hash` in group `g`'s disk index, if any.
    pub fn disk_cache_slot_grouped(&self, g: usize, hash: BlockHash) -> Option<DiskSlot> {
        match &self.hybrid {
            Some(h) => (g < h.num_groups()).then(|| h.group(g).disk_cache_slot(hash))?,
            None => (g == 0).then(|| self.disk_cache_slot(hash))?,
        }
    }

    /// The disk parts of the load of `seq` in every group (admitted by
    /// [`Self::admit_prompt_grouped`] from a hit that goes on into the disk level;
    /// for one group, [`Self::disk_load_job`]), `None` when no group has one: read
    /// each item of `jobs[g]` from group `g`'s store into its staging host block, then
    /// call [`Self::mark_disk_load_staged_grouped`] before running
    /// [`Self::load_job_grouped`]'s plans.
    pub fn disk_load_job_grouped(&self, seq: SeqId) -> Option<GroupDiskLoadJob> {
        match &self.hybrid {
            Some(h) => h.disk_load_job(seq),
            None => self.disk_load_job(seq).map(|j| GroupDiskLoadJob {
                seq,
                jobs: vec![Some(j)],
            }),
        }
    }

    /// Records that every group's disk part of `job` is in its staging host blocks,
    /// so [`Self::complete_swap_grouped`] may complete the load.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `job` has not one entry per group;
    /// [`Error::UnknownTicket`] when a group's load is not in flight. Nothing changed
    /// on error.
    pub fn mark_disk_load_staged_grouped(&mut self, job: &GroupDiskLoadJob) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.mark_disk_load_staged(job),
            None => match job.jobs.as_slice() {
                [Some(j)] => self.mark_disk_load_staged(j.ticket),
                _ => Err(Error::ShapeMismatch {
                    what: "disk parts of the group disk load job",
                    expected: 1,
                    got: job.jobs.len(),
                }),
            },
        }
    }
}
