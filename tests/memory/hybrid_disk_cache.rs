//! The disk tier as a prefix-cache level of a hybrid cache (two full groups over one
//! arena and one host tier, one disk level and one `DiskPrefixStore` per group): a
//! prompt evicted from VRAM and from the host hits from disk with the same K/V bytes
//! in every group (the device and host arenas scribbled before the load); a hit that
//! spans host and disk loads both parts; the load completes only once every group's
//! disk part is staged; an aborted load (by hand, or on a block missing from one
//! group's store) keeps the device part in every group; the hit is cut to the staging
//! blocks the free host tier has; latent groups load their own bytes too; a restart
//! adopts every group's reopened store; the grouped calls refuse typed with nothing
//! changed, and window and state groups refuse the disk level; a model-based
//! interleaving. Invariants after every call; refusals compared on full snapshots.

use crate::support::snapshot::groups_snapshot as snapshot;
use crate::support::tiers::{layout, prompt, TempDir, BS};
use crate::support::two_groups::{prompts, TwoGroups};

use pagedkv::executor::tier::{
    load_prefix_from_host, load_prefix_from_tiers, load_prefix_from_tiers_grouped,
    spill_host_prefixes_to_disk_grouped, DiskPrefixStore,
};
use pagedkv::manager::groups::{GroupDiskLoadJob, GroupDiskStoreJob};
use pagedkv::manager::{DiskCacheConfig, DiskPlacement, HostCacheConfig};
use pagedkv::{
    AdmitOptions, BlockId, DType, Error, GroupSpec, GroupStep, HostStorage, KvCache, KvKind,
    KvLayout, ModelShape, SeqId, Storage,
};

const PAGES: usize = 40;

struct World {
    kv: KvCache,
    st: HostStorage,
    stores: Vec<DiskPrefixStore>,
    dirs: Vec<TempDir>,
    step: GroupStep,
}

impl World {
    /// Two full groups over `PAGES` pages and a host tier of `host` blocks,
    /// write-through host and disk levels, one store of `disk` blocks per group.
    fn new(host: usize, disk: usize) -> Self {
        Self::with_layout(layout(), host, disk)
    }

    /// [`Self::new`] with both groups of layout `l`.
    fn with_layout(l: KvLayout, host: usize, disk: usize) -> Self {
        let dirs = vec![TempDir::new(), TempDir::new()];
        let stores = dirs
            .iter()
            .map(|d| DiskPrefixStore::create(&d.0, &l, disk).unwrap())
            .collect();
        Self::with_stores(l, host, stores, dirs)
    }

    fn with_stores(
        l: KvLayout,
        host: usize,
        stores: Vec<DiskPrefixStore>,
        dirs: Vec<TempDir>,
    ) -> Self {
        let mut kv =
            KvCache::hybrid_with_host_tier(&[GroupSpec::full(l), GroupSpec::full(l)], PAGES, host)
                .unwrap();
        kv.set_host_cache(HostCacheConfig::default()).unwrap();
        kv.set_disk_cache(DiskCacheConfig::default()).unwrap();
        World {
            kv,
            st: HostStorage::with_host_tier(l, PAGES, host).unwrap(),
            stores,
            dirs,
            step: GroupStep::default(),
        }
    }

    /// Stores every registered block to the host levels, then every host entry to the
    /// disk levels; returns the blocks written to disk.
    fn store_down(&mut self) -> usize {
        if let Some(job) = self.kv.plan_host_store_grouped(usize::MAX).unwrap() {
            for plan in &job.plans {
                self.st.swap(plan).unwrap();
            }
            self.kv.complete_swap_grouped(&job).unwrap();
            self.check();
        }
        let spill =
            spill_host_prefixes_to_disk_grouped(&mut self.kv, &self.st, &mut self.stores, 64)
                .unwrap();
        self.check();
        spill.stored_blocks
    }

    /// Fills every device page and every host block with junk: bytes read later come
    /// from disk (or from where the test says).
    fn scribble(&mut self) {
        for layer in 0..self.st.layout().num_layers() {
            self.st.region_mut(layer).fill(0xA5);
        }
        let junk = vec![0x5A; self.st.layout().block_bytes()];
        for b in 0..self.st.num_host_blocks() {
            self.st.write_host_block(BlockId(b as u32), &junk).unwrap();
        }
    }

    /// Evicts every device page and every host entry the prefix caches hold.
    fn evict_above_disk(&mut self) {
        self.kv.evict_cached(usize::MAX);
        self.kv.evict_host_cache(usize::MAX).unwrap();
        self.check();
        assert_eq!(self.kv.host_cache_stats().cached_blocks, 0);
    }
}

impl TwoGroups for World {
    fn parts(&mut self) -> (&mut KvCache, &mut HostStorage, &mut GroupStep) {
        (&mut self.kv, &mut self.st, &mut self.step)
    }
    fn cache(&self) -> &KvCache {
        &self.kv
    }
    fn storage(&self) -> &HostStorage {
        &self.st
    }
}

#[test]
fn a_prompt_evicted_from_vram_and_host_hits_from_disk_with_its_bytes() {
    let mut w = World::new(16, 32);
    let p = prompt(4 * BS + 2, 0);
    assert_eq!(w.compute(1, &p), 0);
    w.kv.free(SeqId(1)).unwrap();
    // Write-through at both levels: 4 blocks a group, each group into its own store.
    assert_eq!(w.store_down(), 8);
    assert_eq!((w.stores[0].len(), w.stores[1].len()), (4, 4));
    let stats = w.kv.disk_cache_stats();
    assert_eq!((stats.cached_blocks, stats.stored_blocks), (8, 8));
    // Nothing left to store.
    assert_eq!(w.store_down(), 0);
    w.evict_above_disk();
    w.scribble();
    let free_host = w.kv.num_free_host_blocks();

    // The next turn: the whole prefix (4 blocks a group) comes from disk.
    assert_eq!(w.admit_prompt(2, &p), (0, 4 * BS));
    let disk = w.kv.disk_load_job_grouped(SeqId(2)).expect("a disk part");
    assert_eq!(disk.jobs.len(), 2);
    for j in &disk.jobs {
        assert_eq!(j.as_ref().map(|j| j.items.len()), Some(4));
    }
    // Staging blocks of the shared host tier, one per disk block, none shared.
    let mut staging: Vec<BlockId> = disk
        .jobs
        .iter()
        .flatten()
        .flat_map(|j| j.items.iter().map(|i| i.host))
        .collect();
    staging.sort();
    staging.dedup();
    assert_eq!(staging.len(), 8);
    assert_eq!(w.kv.num_free_host_blocks(), free_host - 8);
    // Not staged: the completion is refused in every group, nothing changed; also
    // with group 0's part staged and group 1's not.
    let load = w.kv.load_job_grouped(SeqId(2)).unwrap();
    for staged in [vec![None, None], vec![disk.jobs[0].clone(), None]] {
        if staged[0].is_some() {
            let only_0 = GroupDiskLoadJob {
                seq: SeqId(2),
                jobs: staged,
            };
            w.kv.mark_disk_load_staged_grouped(&only_0).unwrap();
        }
        let before = snapshot(&w.kv);
        let e = w.kv.complete_swap_grouped(&load).unwrap_err();
        assert!(matches!(e, Error::SequenceState { .. }), "{e:?}");
        assert_eq!(snapshot(&w.kv), before);
        w.check();
    }
    // A disk load job of another shape is refused, nothing changed.
    let before = snapshot(&w.kv);
    let e =
        w.kv.mark_disk_load_staged_grouped(&GroupDiskLoadJob {
            seq: SeqId(2),
            jobs: vec![None],
        })
        .unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    assert_eq!(snapshot(&w.kv), before);

    // The one-group helpers refuse a hybrid cache rather than find nothing to load.
    let e = load_prefix_from_tiers(&mut w.kv, &mut w.st, &mut w.stores[0], SeqId(2)).unwrap_err();
    assert!(matches!(e, Error::NotOnHybrid { .. }), "{e:?}");
    let e = load_prefix_from_host(&mut w.kv, &mut w.st, SeqId(2)).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
    assert_eq!(snapshot(&w.kv), before);
    assert_eq!(
        load_prefix_from_tiers_grouped(&mut w.kv, &mut w.st, &mut w.stores, SeqId(2)).unwrap(),
        8
    );
    w.check();
    assert_eq!(w.kv.num_computed_tokens(SeqId(2)).unwrap(), 4 * BS);
    w.assert_bytes(2, &p, 4 * BS);
    // The staging blocks went back; the disk copies stay.
    assert_eq!(w.kv.num_free_host_blocks(), free_host);
    let stats = w.kv.disk_cache_stats();
    assert_eq!((stats.cached_blocks, stats.loaded_blocks), (8, 8));
    assert_eq!(stats.disk_hit_tokens, 2 * 4 * BS as u64);

    // The sequence steps on in every group.
    w.kv.reserve_grouped(SeqId(2), 2, 0, &mut w.step).unwrap();
    w.kv.commit(SeqId(2), 2).unwrap();
    w.check();
    w.kv.free(SeqId(2)).unwrap();
    w.check();
}

#[test]
fn latent_groups_hit_from_disk_with_their_bytes() {
    let kind = KvKind::Latent {
        kv_lora_rank: 3,
        rope_dim: 1,
    };
    let l = KvLayout::with_kind(ModelShape::latent(2, 2, 3, 1, DType::F32), BS, kind).unwrap();
    let mut w = World::with_layout(l, 16, 32);
    let p = prompt(3 * BS + 1, 70);
    w.compute(1, &p);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store_down(), 6);
    w.evict_above_disk();
    w.scribble();
    assert_eq!(w.admit_prompt(2, &p), (0, 3 * BS));
    assert_eq!(
        load_prefix_from_tiers_grouped(&mut w.kv, &mut w.st, &mut w.stores, SeqId(2)).unwrap(),
        6
    );
    w.check();
    w.assert_bytes(2, &p, 3 * BS);
}

#[test]
fn a_hit_over_host_and_disk_loads_both_parts_in_every_group() {
    let p = prompt(4 * BS + 1, 100);
    // Device -> host -> disk, then the device and the host tail evicted (leaf first:
    // each group keeps its first 2 blocks on the host); the device arena scribbled.
    let mut w = World::new(16, 32);
    w.compute(1, &p);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store_down(), 8);
    w.kv.evict_cached(usize::MAX);
    assert_eq!(w.kv.evict_host_cache(2).unwrap(), 4);
    w.check();
    for layer in 0..w.st.layout().num_layers() {
        w.st.region_mut(layer).fill(0xA5);
    }
    assert_eq!(w.admit_prompt(2, &p), (0, 4 * BS));
    let disk = w.kv.disk_load_job_grouped(SeqId(2)).unwrap();
    for j in &disk.jobs {
        assert_eq!(j.as_ref().map(|j| j.items.len()), Some(2));
    }
    assert_eq!(
        load_prefix_from_tiers_grouped(&mut w.kv, &mut w.st, &mut w.stores, SeqId(2)).unwrap(),
        8
    );
    w.check();
    w.assert_bytes(2, &p, 4 * BS);
    let (host, disk) = (w.kv.host_cache_stats(), w.kv.disk_cache_stats());
    assert_eq!((host.loaded_blocks, disk.loaded_blocks), (4, 4));
}

#[test]
fn an_aborted_load_keeps_the_device_part_in_every_group() {
    let mut w = World::new(16, 32);
    let long = prompt(4 * BS + 1, 0);
    w.compute(1, &long);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store_down(), 8);
    w.evict_above_disk();
    // The first 2 blocks back on the device (computed again, device hits only).
    let short = prompt(2 * BS + 1, 0);
    assert_eq!(w.compute(3, &short), 0);
    w.kv.free(SeqId(3)).unwrap();
    w.check();
    let free_host = w.kv.num_free_host_blocks();

    // Device part 2 blocks a group, disk part 2 blocks a group.
    assert_eq!(w.admit_prompt(2, &long), (2 * BS, 2 * BS));
    let load = w.kv.load_job_grouped(SeqId(2)).unwrap();
    w.kv.abort_swap_grouped(&load).unwrap();
    w.check();
    assert_eq!(w.kv.num_computed_tokens(SeqId(2)).unwrap(), 2 * BS);
    for g in 0..2 {
        assert_eq!(w.kv.group(g).block_table(SeqId(2)).unwrap().len(), 2);
    }
    w.assert_bytes(2, &long, 2 * BS);
    assert_eq!(w.kv.num_free_host_blocks(), free_host);
    assert_eq!(w.kv.disk_cache_stats().cached_blocks, 8);
    assert!(w.kv.disk_load_job_grouped(SeqId(2)).is_none());
    w.kv.free(SeqId(2)).unwrap();
    w.check();

    // A block missing from group 1's store: a typed miss, the load aborted in every
    // group, the entry dropped from group 1's index only.
    assert_eq!(w.admit_prompt(4, &long), (2 * BS, 2 * BS));
    let job = w.kv.disk_load_job_grouped(SeqId(4)).unwrap();
    let gone = job.jobs[1].as_ref().unwrap().items[1].hash;
    w.stores[1].remove(gone).unwrap();
    let e =
        load_prefix_from_tiers_grouped(&mut w.kv, &mut w.st, &mut w.stores, SeqId(4)).unwrap_err();
    assert!(matches!(e, Error::DiskEntryMissing { .. }), "{e:?}");
    w.check();
    assert_eq!(w.kv.num_computed_tokens(SeqId(4)).unwrap(), 2 * BS);
    w.assert_bytes(4, &long, 2 * BS);
    assert_eq!(w.kv.num_free_host_blocks(), free_host);
    assert_eq!(w.kv.disk_cache_slot_grouped(1, gone), None);
    assert!(w.kv.disk_cache_slot_grouped(0, gone).is_some());
    let stats = w.kv.disk_cache_stats();
    assert_eq!((stats.cached_blocks, stats.dropped_blocks), (7, 1));
    w.kv.free(SeqId(4)).unwrap();
    w.check();
    // The next lookup stops where group 1's chain is cut.
    assert_eq!(w.admit_prompt(5, &long), (2 * BS, BS));
}

#[test]
fn a_disk_hit_is_cut_to_the_free_host_blocks_it_stages_in() {
    let mut w = World::new(10, 32);
    let p = prompt(4 * BS + 1, 7);
    w.compute(1, &p);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store_down(), 8);
    w.evict_above_disk();
    // A swapped sequence takes 6 host blocks (3 a group): 4 stay free, 2 a group.
    w.compute(9, &prompt(2 * BS + 1, 5000));
    let out = w.kv.swap_out_grouped(SeqId(9)).unwrap();
    for plan in &out.plans {
        w.st.swap(plan).unwrap();
    }
    w.kv.complete_swap_grouped(&out).unwrap();
    w.check();
    assert_eq!(w.kv.num_free_host_blocks(), 4);
    assert_eq!(w.admit_prompt(2, &p), (0, 2 * BS));
    assert_eq!(w.kv.num_free_host_blocks(), 0);
    assert_eq!(
        load_prefix_from_tiers_grouped(&mut w.kv, &mut w.st, &mut w.stores, SeqId(2)).unwrap(),
        4
    );
    w.check();
    w.assert_bytes(2, &p, 2 * BS);
    assert_eq!(w.kv.num_free_host_blocks(), 4);
}

#[test]
fn groups_whose_device_parts_differ_load_from_the_common_device_part_on() {
    let mut w = World::new(16, 32);
    let p = prompt(4 * BS + 1, 300);
    w.compute(1, &p);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store_down(), 8);
    w.kv.evict_host_cache(usize::MAX).unwrap();
    // Group 0 first: group 0 keeps 2 blocks on the device, group 1 all 4.
    assert_eq!(w.kv.evict_cached(2), 2);
    w.check();
    assert_eq!(w.admit_prompt(2, &p), (2 * BS, 2 * BS));
    let disk = w.kv.disk_load_job_grouped(SeqId(2)).unwrap();
    for j in &disk.jobs {
        assert_eq!(j.as_ref().map(|j| j.items.len()), Some(2));
    }
    assert_eq!(
        load_prefix_from_tiers_grouped(&mut w.kv, &mut w.st, &mut w.stores, SeqId(2)).unwrap(),
        4
    );
    w.check();
    w.assert_bytes(2, &p, 4 * BS);
    w.kv.free(SeqId(2)).unwrap();
    w.check();
}

#[test]
fn staging_evicts_host_entries_the_load_does_not_read() {
    // A host tier of 8 blocks: `a` reaches the disk, then keeps its first 2 blocks a
    // group on the host; `b` fills the rest of the host tier.
    let mut w = World::new(8, 32);
    let a = prompt(4 * BS + 1, 0);
    let b = prompt(2 * BS + 1, 7000);
    w.compute(1, &a);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store_down(), 8);
    w.kv.evict_cached(usize::MAX);
    assert_eq!(w.kv.evict_host_cache(2).unwrap(), 4);
    w.compute(2, &b);
    w.kv.free(SeqId(2)).unwrap();
    w.store_down();
    w.kv.evict_cached(usize::MAX);
    w.check();
    assert_eq!(w.kv.num_free_host_blocks(), 0);
    assert_eq!(w.kv.host_cache_stats().cached_blocks, 8);
    for g in 0..2 {
        let mut hit = pagedkv::PrefixHit::default();
        w.kv.group(g)
            .lookup_prefix(&a, &AdmitOptions::default(), &mut hit)
            .unwrap();
        assert_eq!((hit.host_tokens(), hit.disk_tokens()), (2 * BS, 2 * BS));
    }
    let removed = w.kv.host_cache_stats().removed_blocks;
    for layer in 0..w.st.layout().num_layers() {
        w.st.region_mut(layer).fill(0xA5);
    }

    // `a` hits whole: 2 blocks a group from the host, 2 from disk, staged in the host
    // blocks of `b`'s entries (evicted), never in those of `a`'s host part.
    assert_eq!(w.admit_prompt(3, &a), (0, 4 * BS));
    let host = w.kv.host_cache_stats();
    assert_eq!((host.cached_blocks, host.removed_blocks), (4, removed + 4));
    assert_eq!(
        load_prefix_from_tiers_grouped(&mut w.kv, &mut w.st, &mut w.stores, SeqId(3)).unwrap(),
        8
    );
    w.check();
    w.assert_bytes(3, &a, 4 * BS);
    let (host, disk) = (w.kv.host_cache_stats(), w.kv.disk_cache_stats());
    assert_eq!((host.loaded_blocks, disk.loaded_blocks), (4, 4));
}

#[test]
fn a_restart_adopts_every_groups_store_and_hits_from_disk() {
    let p = prompt(3 * BS + 3, 50);
    let dirs = {
        let mut w = World::new(16, 32);
        w.compute(1, &p);
        w.kv.free(SeqId(1)).unwrap();
        assert_eq!(w.store_down(), 6);
        for s in &w.stores {
            s.sync().unwrap();
        }
        std::mem::take(&mut w.dirs)
    };
    let stores = dirs
        .iter()
        .map(|d| DiskPrefixStore::open(&d.0, &layout()).unwrap())
        .collect();
    let mut w = World::with_stores(layout(), 16, stores, dirs);
    for g in 0..2 {
        let entries = w.stores[g].entries();
        assert_eq!(w.kv.adopt_disk_prefixes_grouped(g, entries).unwrap(), 3);
        w.check();
    }
    assert_eq!(w.kv.disk_cache_stats().adopted_blocks, 6);
    assert_eq!(w.admit_prompt(2, &p), (0, 3 * BS));
    assert_eq!(
        load_prefix_from_tiers_grouped(&mut w.kv, &mut w.st, &mut w.stores, SeqId(2)).unwrap(),
        6
    );
    w.check();
    w.assert_bytes(2, &p, 3 * BS);
}

#[test]
fn grouped_refusals_change_nothing() {
    let mut w = World::new(16, 32);
    let p = prompt(2 * BS + 1, 0);
    w.compute(1, &p);
    w.kv.free(SeqId(1)).unwrap();
    let job = w.kv.plan_host_store_grouped(usize::MAX).unwrap().unwrap();
    for plan in &job.plans {
        w.st.swap(plan).unwrap();
    }
    w.kv.complete_swap_grouped(&job).unwrap();
    let job = w.kv.plan_disk_store_grouped(usize::MAX).unwrap().unwrap();
    w.check();
    let hashes: Vec<_> = job
        .jobs
        .iter()
        .map(|j| j.as_ref().unwrap().items[0].entry.hash)
        .collect();
    let place = |h| DiskPlacement {
        hash: h,
        slot: pagedkv::ids::DiskSlot(0),
        evicted: None,
    };
    let before = snapshot(&w.kv);
    // One placement list per group.
    let e =
        w.kv.complete_disk_store_grouped(&job, &[vec![place(hashes[0])]])
            .unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    // Group 1 names a block its job does not store (a made-up hash): group 0 is not
    // completed either.
    let bogus = pagedkv::pool::prefix::BlockHash(hashes[1].0 ^ 1);
    let e =
        w.kv.complete_disk_store_grouped(&job, &[vec![place(hashes[0])], vec![place(bogus)]])
            .unwrap_err();
    assert!(matches!(e, Error::CorruptBlockTable(_)), "{e:?}");
    // A job whose group 1 stores nothing cannot take placements there.
    let half = GroupDiskStoreJob {
        jobs: vec![job.jobs[0].clone(), None],
    };
    let e =
        w.kv.complete_disk_store_grouped(&half, &[vec![], vec![place(hashes[1])]])
            .unwrap_err();
    assert!(matches!(e, Error::CorruptBlockTable(_)), "{e:?}");
    // A group the cache does not have.
    let e =
        w.kv.adopt_disk_prefixes_grouped(2, std::iter::empty())
            .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    // The one-group calls still refuse a hybrid cache.
    let e = w.kv.plan_disk_store(8).unwrap_err();
    assert!(matches!(e, Error::NotOnHybrid { .. }), "{e:?}");
    let e =
        w.kv.complete_disk_store(job.jobs[0].as_ref().unwrap().ticket, &[])
            .unwrap_err();
    assert!(matches!(e, Error::NotOnHybrid { .. }), "{e:?}");
    assert_eq!(snapshot(&w.kv), before);
    w.check();
    // Empty placements abort in every group: the host entries are released.
    w.kv.complete_disk_store_grouped(&job, &[vec![], vec![]])
        .unwrap();
    w.check();
    assert_eq!(w.kv.disk_cache_stats().cached_blocks, 0);
    assert_eq!(w.kv.disk_cache_stats().stores_in_flight, 0);
    assert_eq!(w.kv.evict_host_cache(usize::MAX).unwrap(), 4);
}

#[test]
fn window_and_state_groups_refuse_the_disk_level() {
    let l = layout();
    for specs in [
        [GroupSpec::full(l), GroupSpec::window(l, 2 * BS)],
        [GroupSpec::full(l), GroupSpec::state(l, 1)],
    ] {
        let mut kv = KvCache::hybrid_with_host_tier(&specs, 16, 8).unwrap();
        let before = snapshot(&kv);
        let e = kv.set_disk_cache(DiskCacheConfig::default()).unwrap_err();
        assert!(matches!(e, Error::NotOnHybrid { .. }), "{e:?}");
        let e = kv.plan_disk_store_grouped(8).unwrap_err();
        assert!(matches!(e, Error::NotOnHybrid { .. }), "{e:?}");
        let e = kv
            .adopt_disk_prefixes_grouped(0, std::iter::empty())
            .unwrap_err();
        assert!(matches!(e, Error::NotOnHybrid { .. }), "{e:?}");
        assert_eq!(snapshot(&kv), before);
        kv.check_invariants().unwrap();
    }
}

// ---- model-based interleaving ----------------------------------------------------

use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Action {
    /// Admit through `admit_prompt_grouped` (host and disk hits load), after evicting
    /// every cached device page (`evict` 1 or 2) and every host entry that can go too
    /// (`evict` 3); compute the rest unless loading.
    Admit {
        seq: u8,
        prompt: u8,
        evict: u8,
    },
    /// Run (`ok`: through `load_prefix_from_tiers_grouped`) or abort the load of the
    /// `pick`-th loading sequence, then compute the rest.
    FinishLoad {
        pick: u8,
        ok: bool,
    },
    /// Free, then (with `store`) store everything down to the disk.
    Free {
        seq: u8,
        store: bool,
    },
    /// Store registered blocks to the host levels.
    HostStore {
        max: u8,
    },
    /// Plan a disk store and run it (`ok`) or abort it.
    DiskStore {
        max: u8,
        ok: bool,
    },
    EvictDevice {
        n: u8,
    },
    EvictHost {
        n: u8,
    },
    /// Evict every device page and host entry that can go: the next hits come from disk.
    Flush,
    /// Remove the `pick`-th entry from group `g`'s store behind the index's back (a
    /// later load finds it missing).
    LoseDiskBlock {
        g: u8,
        pick: u8,
    },
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0..6u8, 0..4u8, 0..4u8)
            .prop_map(|(seq, prompt, evict)| Action::Admit { seq, prompt, evict }),
        8 => (0..6u8, 0..4u8).prop_map(|(pick, ok)| Action::FinishLoad { pick, ok: ok > 0 }),
        8 => (0..6u8, 0..4u8).prop_map(|(seq, store)| Action::Free { seq, store: store > 0 }),
        1 => (1..8u8).prop_map(|max| Action::HostStore { max }),
        2 => (1..8u8, 0..4u8).prop_map(|(max, ok)| Action::DiskStore { max, ok: ok > 0 }),
        3 => (1..64u8).prop_map(|n| Action::EvictDevice { n }),
        3 => (1..16u8).prop_map(|n| Action::EvictHost { n }),
        3 => Just(Action::Flush),
        1 => (0..2u8, 0..8u8).prop_map(|(g, pick)| Action::LoseDiskBlock { g, pick }),
    ]
}

impl World {
    /// Every idle sequence reads its prompt's bytes up to its computed tokens in every
    /// group.
    fn assert_all_bytes(&self, live: &BTreeMap<u64, usize>, ps: &[Vec<u32>]) {
        for (&seq, &p) in live {
            if self.kv.load_job_grouped(SeqId(seq)).is_some() {
                continue;
            }
            let n = self.kv.num_computed_tokens(SeqId(seq)).unwrap();
            self.assert_bytes(seq, &ps[p], n);
        }
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(96))]

    /// Random interleavings of admissions (host and disk hits loading), loads run or
    /// aborted (some finding a block missing), frees, host and disk stores (completed
    /// or aborted; small stores that evict), evictions on a hybrid cache of two full
    /// groups: the invariants hold after every step, a refused call changes nothing,
    /// and every computed token reads its bytes in both groups.
    #[test]
    fn hybrid_disk_level_interleavings_keep_bytes_and_invariants(
        actions in proptest::collection::vec(action(), 10..60),
    ) {
        let mut w = World::new(12, 10);
        let ps = prompts();
        let mut live: BTreeMap<u64, usize> = BTreeMap::new();
        for a in actions {
            if let Action::Admit { evict, .. } = a {
                if evict > 0 {
                    w.kv.evict_cached(usize::MAX);
                }
                if evict > 2 {
                    w.kv.evict_host_cache(usize::MAX).unwrap();
                }
                w.check();
            }
            let before = snapshot(&w.kv);
            let refused = match a {
                Action::Admit { seq, prompt, .. } => {
                    let (seq, p) = (u64::from(seq), usize::from(prompt));
                    let r = w.kv.admit_prompt_grouped(SeqId(seq), &ps[p], &AdmitOptions::default());
                    if let Ok(adm) = &r {
                        live.insert(seq, p);
                        if adm.loading_tokens == 0 {
                            w.compute_rest(seq, &ps[p], adm.cached_tokens);
                        }
                    }
                    r.err()
                }
                Action::FinishLoad { pick, ok } => {
                    let loading: Vec<u64> = live
                        .keys()
                        .copied()
                        .filter(|&s| w.kv.load_job_grouped(SeqId(s)).is_some())
                        .collect();
                    if let Some(&seq) = loading.get(usize::from(pick) % loading.len().max(1)) {
                        if ok {
                            let r = load_prefix_from_tiers_grouped(
                                &mut w.kv, &mut w.st, &mut w.stores, SeqId(seq),
                            );
                            if let Err(e) = r {
                                prop_assert!(
                                    matches!(e, Error::DiskEntryMissing { .. }),
                                    "{e:?}"
                                );
                            }
                        } else {
                            let job = w.kv.load_job_grouped(SeqId(seq)).unwrap();
                            w.kv.abort_swap_grouped(&job).unwrap();
                        }
                        prop_assert!(w.kv.load_job_grouped(SeqId(seq)).is_none());
                        w.check();
                        let from = w.kv.num_computed_tokens(SeqId(seq)).unwrap();
                        w.compute_rest(seq, &ps[live[&seq]], from);
                    }
                    None
                }
                Action::Free { seq, store } => {
                    let seq = u64::from(seq);
                    let r = w.kv.free(SeqId(seq));
                    if r.is_ok() {
                        live.remove(&seq);
                        if store {
                            w.store_down();
                        }
                    }
                    r.err()
                }
                Action::HostStore { max } => {
                    if let Some(job) = w.kv.plan_host_store_grouped(usize::from(max)).unwrap() {
                        for plan in &job.plans {
                            w.st.swap(plan).unwrap();
                        }
                        w.kv.complete_swap_grouped(&job).unwrap();
                    }
                    None
                }
                Action::DiskStore { max, ok } => {
                    if ok {
                        spill_host_prefixes_to_disk_grouped(
                            &mut w.kv, &w.st, &mut w.stores, usize::from(max),
                        )
                        .unwrap();
                    } else if let Some(job) =
                        w.kv.plan_disk_store_grouped(usize::from(max)).unwrap()
                    {
                        w.check();
                        w.kv.complete_disk_store_grouped(&job, &[vec![], vec![]]).unwrap();
                    }
                    None
                }
                Action::EvictDevice { n } => {
                    w.kv.evict_cached(usize::from(n));
                    None
                }
                Action::EvictHost { n } => {
                    w.kv.evict_host_cache(usize::from(n)).unwrap();
                    None
                }
                Action::Flush => {
                    w.kv.evict_cached(usize::MAX);
                    w.kv.evict_host_cache(usize::MAX).unwrap();
                    None
                }
                Action::LoseDiskBlock { g, pick } => {
                    let store = &mut w.stores[usize::from(g)];
                    let entries: Vec<_> = store.entries().iter().map(|(_, e)| e.hash).collect();
                    if let Some(&h) = entries.get(usize::from(pick) % entries.len().max(1)) {
                        store.remove(h).unwrap();
                    }
                    None
                }
            };
            if let Some(e) = refused {
                prop_assert!(!matches!(e, Error::CorruptBlockTable(_)), "{a:?}: {e:?}");
                prop_assert_eq!(snapshot(&w.kv), before, "{:?} refused with {:?}", a, e);
            }
            w.check();
            w.assert_all_bytes(&live, &ps);
        }
    }
}
