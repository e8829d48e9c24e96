//! The prefix cache's spill to the host tier and its restore, carried out: the
//! manager's plan, the copies on the storage, the commit (see
//! [`KvCache::plan_prefix_spill`]).

use super::disk_cache::{DiskPrefixStore, DiskStoreOutcome};
use super::engine::{DiskJobReport, TransferEngine};
use crate::error::{Error, Result};
use crate::executor::check_storage;
use crate::executor::storage::Storage;
use crate::ids::{SeqId, SwapTicket};
use crate::manager::{DiskPlacement, KvCache, PrefixRestore, PrefixSpill};

/// Copies the prefix cache's evictable blocks to `storage`'s host tier (as many as it
/// has free blocks for, parents first), keeps them indexed there and evicts them from
/// the device; the rest is evicted. Afterwards the arena can shrink past them, and
/// [`restore_spilled_prefixes`] brings them back.
///
/// ```
/// use pagedkv::executor::tier::{restore_spilled_prefixes, spill_cached_prefixes};
/// use pagedkv::{AdmitOptions, CacheConfig, DType, HostStorage, KvCache, KvLayout,
///               ModelShape, SeqId, TierConfig};
///
/// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1,
///                          head_dim: 8, kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 4)?;
/// let tiers = TierConfig { num_host_blocks: 8, num_disk_slots: 0 };
/// let mut kv = KvCache::with_tiers(layout, CacheConfig::new(16), tiers)?;
/// let mut storage = HostStorage::with_host_tier(layout, 16, 8)?;
/// let (prompt, opts, mut slots) = ((0..13).collect::<Vec<u32>>(), AdmitOptions::default(), Vec::new());
/// kv.admit_tokens(SeqId(1), &prompt, &opts, &mut slots)?;
/// kv.free(SeqId(1))?;                                   // 3 full blocks stay cached
/// let spill = spill_cached_prefixes(&mut kv, &mut storage)?;
/// assert_eq!((spill.spilled_blocks, spill.evicted_blocks), (3, 0));
/// assert_eq!(kv.cached_prefix_len(&prompt, &opts)?, 0); // not on the device now
/// let restore = restore_spilled_prefixes(&mut kv, &mut storage)?;
/// assert_eq!(restore.restored_blocks, 3);
/// assert_eq!(kv.cached_prefix_len(&prompt, &opts)?, 12); // hits again
/// # Ok::<(), pagedkv::Error>(())
/// ```
///
/// # Errors
/// [`crate::Error::InvalidConfig`] / [`crate::Error::ShapeMismatch`] for a storage
/// that does not hold the manager's arena; the storage's swap errors. Nothing changed
/// on error (only free host blocks were written).
pub fn spill_cached_prefixes<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
) -> Result<PrefixSpill> {
    check_storage(kv, storage)?;
    let pending = kv.plan_prefix_spill()?;
    if !pending.plan().is_empty() {
        storage.swap(pending.plan())?;
    }
    pending.commit()
}

/// Copies spilled prefix blocks back from `storage`'s host tier into free device
/// blocks and registers them again, parents first, as many as the arena has free
/// blocks for; gives up those that can never be hit again.
///
/// # Errors
/// As [`spill_cached_prefixes`]. Nothing changed on error (only free device blocks
/// were written).
pub fn restore_spilled_prefixes<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
) -> Result<PrefixRestore> {
    check_storage(kv, storage)?;
    let pending = kv.plan_prefix_restore()?;
    if !pending.plan().is_empty() {
        storage.swap(pending.plan())?;
    }
    pending.commit()
}

/// Stores up to `max_blocks` device blocks into the host level of the prefix cache
/// (by the manager's [`crate::manager::HostStorePolicy`]; in every group of a hybrid
/// cache) and runs the copies on `storage` at once: [`KvCache::plan_host_store_grouped`]
/// (for one group, [`KvCache::plan_host_store`]), [`Storage::swap`] of every plan,
/// [`KvCache::complete_swap_grouped`]. Returns the blocks stored (0 when there was nothing to
/// store or no room). An engine that overlaps the copies with compute submits the job
/// to a [`super::TransferEngine`] instead.
///
/// ```
/// use pagedkv::executor::tier::{load_prefix_from_host, store_prefixes_to_host};
/// use pagedkv::{AdmitOptions, CacheConfig, DType, HostStorage, KvCache, KvLayout,
///               ModelShape, PrefixHit, SeqId, TierConfig};
///
/// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1,
///                          head_dim: 8, kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 4)?;
/// let tiers = TierConfig { num_host_blocks: 8, num_disk_slots: 0 };
/// let mut kv = KvCache::with_tiers(layout, CacheConfig::new(16), tiers)?;
/// let mut storage = HostStorage::with_host_tier(layout, 16, 8)?;
/// let (prompt, opts, mut slots) = ((0..13).collect::<Vec<u32>>(), AdmitOptions::default(), Vec::new());
/// kv.admit_tokens(SeqId(1), &prompt, &opts, &mut slots)?;
/// // ... the engine writes the prompt's K/V ...
/// assert_eq!(store_prefixes_to_host(&mut kv, &mut storage, 64)?, 3); // write-through
/// kv.free(SeqId(1))?;
/// kv.evict_cached(usize::MAX);                          // gone from the device
/// let mut hit = PrefixHit::default();
/// kv.lookup_prefix(&prompt, &opts, &mut hit)?;
/// assert_eq!((hit.device_tokens(), hit.host_tokens()), (0, 12));
/// let a = kv.admit_prompt(SeqId(2), &prompt, &hit)?;
/// assert_eq!((a.cached_tokens, a.loading_tokens), (0, 12));
/// assert_eq!(load_prefix_from_host(&mut kv, &mut storage, SeqId(2))?, 3);
/// assert_eq!(kv.num_computed_tokens(SeqId(2))?, 12);
/// # Ok::<(), pagedkv::Error>(())
/// ```
///
/// # Errors
/// [`crate::Error::InvalidConfig`] / [`crate::Error::ShapeMismatch`] for a storage
/// that does not hold the manager's arena; [`crate::Error::NotOnHybrid`] for a hybrid
/// cache with a window or state group (a hybrid cache of full and latent groups
/// stores in every group: [`KvCache::plan_host_store_grouped`]); the storage's swap
/// errors, after which the store is aborted (nothing changed in the manager but host
/// entries evicted to make room).
pub fn store_prefixes_to_host<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    max_blocks: usize,
) -> Result<usize> {
    check_storage(kv, storage)?;
    let Some(job) = kv.plan_host_store_grouped(max_blocks)? else {
        return Ok(0);
    };
    if let Err(e) = job.plans.iter().try_for_each(|plan| storage.swap(plan)) {
        kv.abort_swap_grouped(&job)?;
        return Err(e);
    }
    kv.complete_swap_grouped(&job)?;
    Ok(job.plans.iter().map(|plan| plan.len()).sum())
}

/// Runs the load of `seq` (admitted from a host-level hit, see
/// [`KvCache::load_job`], or every group's for a hybrid cache:
/// [`KvCache::load_job_grouped`]) on `storage` and completes it: the loaded tokens count as
/// computed and their blocks are registered on the device. Returns the blocks loaded
/// (0 when `seq` has no load in flight).
///
/// # Errors
/// As [`store_prefixes_to_host`]; a storage error aborts the load: `seq` keeps only
/// its device-hit tokens, computed, and the host copies stay.
/// [`crate::Error::Unsupported`] (nothing done) for a load with a disk part
/// ([`KvCache::disk_load_job`]): [`load_prefix_from_tiers`] runs those.
pub fn load_prefix_from_host<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    seq: SeqId,
) -> Result<usize> {
    check_storage(kv, storage)?;
    if kv.disk_load_job_grouped(seq).is_some() {
        return Err(crate::error::Error::Unsupported(format!(
            "the load of {seq} has a disk part: use load_prefix_from_tiers(_grouped)"
        )));
    }
    run_host_load(kv, storage, seq)
}

/// Takes the entries of an opened [`DiskPrefixStore`] into the manager's disk index
/// ([`KvCache::adopt_disk_prefixes`] of [`DiskPrefixStore::entries`]), so that lookups
/// find them. Returns the entries taken.
///
/// # Errors
/// [`crate::Error::ShapeMismatch`] for a store made for another layout; as
/// [`KvCache::adopt_disk_prefixes`]. Nothing changed on error.
pub fn adopt_disk_store(kv: &mut KvCache, store: &DiskPrefixStore) -> Result<usize> {
    check_layout(kv, store)?;
    kv.adopt_disk_prefixes(store.entries())
}

fn check_layout(kv: &KvCache, store: &DiskPrefixStore) -> Result<()> {
    if store.layout() != kv.layout() {
        return Err(Error::ShapeMismatch {
            what: "bytes of one block (disk store vs cache layout)",
            expected: kv.layout().block_bytes(),
            got: store.block_bytes(),
        });
    }
    Ok(())
}

/// What [`spill_host_prefixes_to_disk`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiskSpill {
    /// Blocks written to the store.
    pub stored_blocks: usize,
    /// Blocks the store held already (not written again; indexed now).
    pub already_present: usize,
    /// Entries the store evicted to make room (announced removed).
    pub evicted_blocks: usize,
}

/// Stores up to `max_blocks` host entries of the prefix cache into the disk level (by
/// the manager's [`crate::manager::DiskStorePolicy`]): [`KvCache::plan_disk_store`],
/// [`DiskPrefixStore::store_from`] for each block (parents first), then
/// [`KvCache::complete_disk_store`] with where each went and what the store evicted,
/// so the manager's disk index follows the store's and announces Disk-medium events.
///
/// ```
/// use pagedkv::executor::tier::{adopt_disk_store, load_prefix_from_tiers,
///     spill_host_prefixes_to_disk, store_prefixes_to_host, DiskPrefixStore};
/// use pagedkv::{AdmitOptions, CacheConfig, DType, HostStorage, KvCache, KvLayout,
///               ModelShape, PrefixHit, SeqId, TierConfig};
///
/// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1,
///                          head_dim: 8, kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 4)?;
/// let tiers = TierConfig { num_host_blocks: 8, num_disk_slots: 0 };
/// let dir = std::env::temp_dir().join(format!("pagedkv-doc-disk-tier-{}", std::process::id()));
/// let (prompt, opts) = ((0..13).collect::<Vec<u32>>(), AdmitOptions::default());
/// {
///     let mut kv = KvCache::with_tiers(layout, CacheConfig::new(16), tiers)?;
///     let mut storage = HostStorage::with_host_tier(layout, 16, 8)?;
///     let mut store = DiskPrefixStore::create(&dir, &layout, 64)?;
///     kv.admit_tokens(SeqId(1), &prompt, &opts, &mut Vec::new())?;
///     // ... the engine writes the prompt's K/V ...
///     store_prefixes_to_host(&mut kv, &mut storage, 64)?;           // device -> host
///     let spill = spill_host_prefixes_to_disk(&mut kv, &storage, &mut store, 64)?;
///     assert_eq!(spill.stored_blocks, 3);                          // host -> disk
/// }
/// // A restart: a new cache and storage, the tier directory reopened.
/// let mut kv = KvCache::with_tiers(layout, CacheConfig::new(16), tiers)?;
/// let mut storage = HostStorage::with_host_tier(layout, 16, 8)?;
/// let mut store = DiskPrefixStore::open(&dir, &layout)?;
/// assert_eq!(adopt_disk_store(&mut kv, &store)?, 3);
/// let mut hit = PrefixHit::default();
/// kv.lookup_prefix(&prompt, &opts, &mut hit)?;
/// assert_eq!((hit.device_tokens(), hit.host_tokens(), hit.disk_tokens()), (0, 0, 12));
/// kv.admit_prompt(SeqId(2), &prompt, &hit)?;
/// assert_eq!(load_prefix_from_tiers(&mut kv, &mut storage, &mut store, SeqId(2))?, 3);
/// assert_eq!(kv.num_computed_tokens(SeqId(2))?, 12);
/// # drop(store);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), pagedkv::Error>(())
/// ```
///
/// # Errors
/// [`crate::Error::InvalidConfig`] / [`crate::Error::ShapeMismatch`] for a storage or
/// store that does not fit the manager's layout; as [`DiskPrefixStore::store_from`]. On a store error the blocks stored before it are
/// still indexed (they are in the store's journal); the rest are not, and the error is
/// returned.
pub fn spill_host_prefixes_to_disk<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &S,
    store: &mut DiskPrefixStore,
    max_blocks: usize,
) -> Result<DiskSpill> {
    check_storage(kv, storage)?;
    check_layout(kv, store)?;
    let Some(job) = kv.plan_disk_store(max_blocks)? else {
        return Ok(DiskSpill::default());
    };
    let mut out = DiskSpill::default();
    let mut placements = Vec::with_capacity(job.items.len());
    let mut failed = None;
    for item in &job.items {
        match store.store_from(storage, item.host, &item.entry) {
            Ok(DiskStoreOutcome::Stored { slot, evicted }) => {
                out.stored_blocks += 1;
                out.evicted_blocks += usize::from(evicted.is_some());
                placements.push(DiskPlacement {
                    hash: item.entry.hash,
                    slot,
                    evicted: evicted.map(|e| (e.hash, e.slot)),
                });
            }
            Ok(DiskStoreOutcome::AlreadyPresent { slot }) => {
                out.already_present += 1;
                placements.push(DiskPlacement {
                    hash: item.entry.hash,
                    slot,
                    evicted: None,
                });
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    kv.complete_disk_store(job.ticket, &placements)?;
    match failed {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// Reads the disk part of the load of `seq` ([`KvCache::disk_load_job`]) from `store`
/// into its staging host blocks (checksummed) and marks it staged
/// ([`KvCache::mark_disk_load_staged`]). Returns the blocks staged (0 when the load has
/// no disk part). The host -> device part then runs like a host-level load: at once
/// ([`load_prefix_from_tiers`] does both), or on a [`super::TransferEngine`], layer
/// by layer, whose [`super::TransferEngine::is_layer_ready`] /
/// [`super::TransferEngine::layer_fence`] tell attention which layers have landed.
///
/// The disk part itself is not per layer: a disk slot holds one block's bytes for
/// every layer and is verified as a whole (its checksum covers all layers), so no
/// layer of it can be exposed before the whole block is read and checked.
///
/// # Errors
/// [`crate::Error::Checksum`] when a disk block's bytes are corrupt, or
/// [`crate::Error::DiskEntryMissing`] when the store no longer holds one: a miss. The
/// load is aborted (`seq` keeps only its device-hit tokens, computed; host copies
/// stay; no wrong byte reaches a device block that counts), and the entry is dropped
/// from the disk index (and from the store, for a checksum failure). An I/O error or
/// a storage error aborts the load the same way, the entry kept.
/// [`crate::Error::ShapeMismatch`] (nothing done) for a store or storage of another
/// layout; [`crate::Error::NotOnHybrid`] (nothing done) for a hybrid cache
/// ([`load_prefix_from_tiers_grouped`] serves it).
pub fn stage_disk_load<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    store: &mut DiskPrefixStore,
    seq: SeqId,
) -> Result<usize> {
    check_storage(kv, storage)?;
    check_layout(kv, store)?;
    refuse_hybrid(kv, "stage_disk_load (use load_prefix_from_tiers_grouped)")?;
    let Some(disk) = kv.disk_load_job(seq) else {
        return Ok(0);
    };
    for item in &disk.items {
        let err = match store.load_into(storage, item.host, item.hash) {
            Ok(true) => continue,
            Ok(false) => {
                kv.remove_disk_entry(item.hash);
                Error::DiskEntryMissing { hash: item.hash.0 }
            }
            Err(e @ Error::Checksum { .. }) => {
                kv.remove_disk_entry(item.hash);
                e
            }
            Err(e) => e,
        };
        kv.abort_swap(disk.ticket)?;
        return Err(err);
    }
    kv.mark_disk_load_staged(disk.ticket)?;
    Ok(disk.items.len())
}

/// Runs the load of `seq` (admitted from a hit whose tail is in the host or disk
/// level) and completes it: [`stage_disk_load`], then every block is copied to the
/// device ([`KvCache::load_job`]) and the swap completed, so the loaded tokens count
/// as computed. Returns the blocks loaded (0 when `seq` has no load in flight).
///
/// # Errors
/// As [`stage_disk_load`]; a storage error in the device copies aborts the load as in
/// [`load_prefix_from_host`].
pub fn load_prefix_from_tiers<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    store: &mut DiskPrefixStore,
    seq: SeqId,
) -> Result<usize> {
    stage_disk_load(kv, storage, store, seq)?;
    let Some(job) = kv.load_job(seq) else {
        return Ok(0);
    };
    if let Err(e) = storage.swap(&job.plan) {
        kv.abort_swap(job.ticket)?;
        return Err(e);
    }
    kv.complete_swap(job.ticket)?;
    Ok(job.plan.len())
}

fn check_group_stores(kv: &KvCache, stores: &[DiskPrefixStore]) -> Result<()> {
    if stores.len() != kv.num_groups() {
        return Err(Error::ShapeMismatch {
            what: "disk stores (one per KV-cache group)",
            expected: kv.num_groups(),
            got: stores.len(),
        });
    }
    for (g, store) in stores.iter().enumerate() {
        check_layout(kv.group(g), store)?;
    }
    Ok(())
}

/// [`spill_host_prefixes_to_disk`] of every group of a hybrid cache of full and latent
/// groups (one group: the same call): `stores[g]` is group `g`'s store (the groups'
/// disk levels are apart, see `manager/groups/disk_level.rs`), and every group's
/// host entries are read from `storage`'s shared host tier. Returns the counts summed
/// over the groups.
///
/// ```
/// use pagedkv::executor::tier::{load_prefix_from_tiers_grouped,
///     spill_host_prefixes_to_disk_grouped, store_prefixes_to_host, DiskPrefixStore};
/// use pagedkv::manager::{DiskCacheConfig, HostCacheConfig};
/// use pagedkv::{AdmitOptions, DType, GroupSpec, GroupStep, HostStorage, KvCache, KvLayout,
///               ModelShape, SeqId};
///
/// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1,
///                          head_dim: 8, kv_dtype: DType::F16 };
/// let l = KvLayout::new(shape, 4)?;
/// let mut kv = KvCache::hybrid_with_host_tier(&[GroupSpec::full(l), GroupSpec::full(l)], 16, 8)?;
/// kv.set_host_cache(HostCacheConfig::default())?;
/// kv.set_disk_cache(DiskCacheConfig::default())?;
/// let mut storage = HostStorage::with_host_tier(l, 16, 8)?;
/// let base = std::env::temp_dir().join(format!("pagedkv-doc-hybrid-disk-{}", std::process::id()));
/// let mut stores = (0..2)                                  // one store per group
///     .map(|g| DiskPrefixStore::create(&base.join(format!("group{g}")), &l, 64))
///     .collect::<Result<Vec<_>, _>>()?;
/// let (prompt, opts) = ((0..13).collect::<Vec<u32>>(), AdmitOptions::default());
/// kv.admit_tokens_grouped(SeqId(1), &prompt, &opts, &mut GroupStep::default())?;
/// // ... the engine writes the prompt's K/V in every group ...
/// kv.free(SeqId(1))?;
/// assert_eq!(store_prefixes_to_host(&mut kv, &mut storage, 64)?, 6);   // device -> host
/// let spill = spill_host_prefixes_to_disk_grouped(&mut kv, &storage, &mut stores, 64)?;
/// assert_eq!(spill.stored_blocks, 6);                                 // host -> disk
/// kv.evict_cached(usize::MAX);
/// kv.evict_host_cache(usize::MAX)?;                        // only the disk holds it now
/// let a = kv.admit_prompt_grouped(SeqId(2), &prompt, &opts)?;
/// assert_eq!((a.cached_tokens, a.loading_tokens), (0, 12));
/// assert_eq!(load_prefix_from_tiers_grouped(&mut kv, &mut storage, &mut stores, SeqId(2))?, 6);
/// assert_eq!(kv.num_computed_tokens(SeqId(2))?, 12);
/// # drop(stores);
/// # std::fs::remove_dir_all(&base).unwrap();
/// # Ok::<(), pagedkv::Error>(())
/// ```
///
/// # Errors
/// [`crate::Error::ShapeMismatch`] (nothing done) when `stores` has not one store per
/// group or a store does not fit its group's layout; as [`spill_host_prefixes_to_disk`]:
/// on a store error the blocks stored before it (in any group) are still indexed,
/// the rest are not, and the error is returned.
pub fn spill_host_prefixes_to_disk_grouped<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &S,
    stores: &mut [DiskPrefixStore],
    max_blocks: usize,
) -> Result<DiskSpill> {
    check_storage(kv, storage)?;
    check_group_stores(kv, stores)?;
    let Some(job) = kv.plan_disk_store_grouped(max_blocks)? else {
        return Ok(DiskSpill::default());
    };
    let mut out = DiskSpill::default();
    let mut placements = vec![Vec::new(); job.jobs.len()];
    let mut failed = None;
    'groups: for ((j, store), placed) in job.jobs.iter().zip(stores).zip(&mut placements) {
        for item in j.iter().flat_map(|j| &j.items) {
            let (slot, evicted) = match store.store_from(storage, item.host, &item.entry) {
                Ok(DiskStoreOutcome::Stored { slot, evicted }) => {
                    out.stored_blocks += 1;
                    out.evicted_blocks += usize::from(evicted.is_some());
                    (slot, evicted.map(|e| (e.hash, e.slot)))
                }
                Ok(DiskStoreOutcome::AlreadyPresent { slot }) => {
                    out.already_present += 1;
                    (slot, None)
                }
                Err(e) => {
                    failed = Some(e);
                    break 'groups;
                }
            };
            placed.push(DiskPlacement {
                hash: item.entry.hash,
                slot,
                evicted,
            });
        }
    }
    kv.complete_disk_store_grouped(&job, &placements)?;
    match failed {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// [`load_prefix_from_tiers`] of every group of a hybrid cache of full and latent
/// groups (one group: the same call): each group's disk part is read from its own
/// store (`stores[g]`) into its staging host blocks, checksummed; every group's part
/// is marked staged ([`KvCache::mark_disk_load_staged_grouped`]); then every group's
/// host -> device plan runs and the load completes in every group. Returns the
/// blocks loaded in all (0 when `seq` has no load in flight).
///
/// # Errors
/// [`crate::Error::ShapeMismatch`] (nothing done) as in
/// [`spill_host_prefixes_to_disk_grouped`]; as [`stage_disk_load`]: a missing or
/// corrupt disk block is a miss, dropped from its group's disk index, and the load
/// is aborted in every group (`seq` keeps its device part, computed; host copies
/// stay); a storage error in the device copies aborts the load the same way.
pub fn load_prefix_from_tiers_grouped<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    stores: &mut [DiskPrefixStore],
    seq: SeqId,
) -> Result<usize> {
    check_storage(kv, storage)?;
    check_group_stores(kv, stores)?;
    if let Some(disk) = kv.disk_load_job_grouped(seq) {
        for (g, (j, store)) in disk.jobs.iter().zip(stores.iter_mut()).enumerate() {
            for item in j.iter().flat_map(|j| &j.items) {
                let err = match store.load_into(storage, item.host, item.hash) {
                    Ok(true) => continue,
                    Ok(false) => {
                        kv.remove_disk_entry_grouped(g, item.hash);
                        Error::DiskEntryMissing { hash: item.hash.0 }
                    }
                    Err(e @ Error::Checksum { .. }) => {
                        kv.remove_disk_entry_grouped(g, item.hash);
                        e
                    }
                    Err(e) => e,
                };
                if let Some(job) = kv.load_job_grouped(seq) {
                    kv.abort_swap_grouped(&job)?;
                }
                return Err(err);
            }
        }
        kv.mark_disk_load_staged_grouped(&disk)?;
    }
    run_host_load(kv, storage, seq)
}

/// Plans a store of up to `max_blocks` host entries to the disk level
/// ([`KvCache::plan_disk_store`], clamped to what the engine's in-flight budget has
/// room for) and queues it on `engine`'s worker ([`TransferEngine::submit_disk_store`]),
/// so no file is written on the caller's thread. Returns the store's ticket, or
/// `None` when there was nothing to store. [`complete_disk_jobs`] completes it.
///
/// # Errors
/// [`Error::TransferBudget`] when the budget has no room for one block;
/// [`Error::Unsupported`] without an attached store; [`Error::ShapeMismatch`] /
/// [`Error::InvalidConfig`] for a storage or store of another layout. Nothing changed
/// on error.
pub fn submit_disk_store<S: Storage + Send + 'static>(
    kv: &mut KvCache,
    engine: &mut TransferEngine<S>,
    max_blocks: usize,
) -> Result<Option<SwapTicket>> {
    check_engine(kv, engine)?;
    let room = engine.budget_room_blocks();
    if room == 0 {
        return Err(Error::TransferBudget {
            needed: kv.layout().block_bytes() as u64,
            in_flight: engine.in_flight_bytes(),
            budget: engine.in_flight_budget().unwrap_or(u64::MAX),
        });
    }
    let Some(job) = kv.plan_disk_store(max_blocks.min(room))? else {
        return Ok(None);
    };
    if let Err(e) = engine.submit_disk_store(&job) {
        // Nothing reported stored: the plan's readers are released.
        kv.complete_disk_store(job.ticket, &[])?;
        return Err(e);
    }
    Ok(Some(job.ticket))
}

/// Queues the disk -> host staging of the load of `seq` ([`KvCache::disk_load_job`])
/// on `engine`'s worker ([`TransferEngine::submit_disk_stage`]). Returns its ticket
/// (the load's), or `None` when the load has no disk part. [`complete_disk_jobs`]
/// marks it staged; then the load's host -> device swap ([`KvCache::load_job`]) is
/// submitted like a host-level load.
///
/// # Errors
/// As [`submit_disk_store`] ([`Error::TransferBudget`] when the staging does not fit
/// the budget; [`Error::NotOnHybrid`] for a hybrid cache). Nothing changed on error.
pub fn submit_disk_stage<S: Storage + Send + 'static>(
    kv: &mut KvCache,
    engine: &mut TransferEngine<S>,
    seq: SeqId,
) -> Result<Option<SwapTicket>> {
    check_engine(kv, engine)?;
    refuse_hybrid(kv, "submit_disk_stage")?;
    let Some(job) = kv.disk_load_job(seq) else {
        return Ok(None);
    };
    engine.submit_disk_stage(&job)?;
    Ok(Some(job.ticket))
}

/// Completes, on the manager's side, every disk job `engine` reports finished
/// ([`TransferEngine::poll_disk_completed`]) and returns the reports, errors included:
/// a store is completed with its placements ([`KvCache::complete_disk_store`]; blocks
/// after a failure are not indexed, as in [`spill_host_prefixes_to_disk`]); a staging
/// is marked staged ([`KvCache::mark_disk_load_staged`]) or, on failure, its load is
/// aborted ([`KvCache::abort_swap`]) after dropping a missing or corrupt entry from
/// the disk index, as in [`stage_disk_load`].
///
/// # Errors
/// The manager's errors for a ticket it does not know (a job submitted for another
/// cache); the reports polled before it are completed.
pub fn complete_disk_jobs<S: Storage + Send + 'static>(
    kv: &mut KvCache,
    engine: &mut TransferEngine<S>,
) -> Result<Vec<DiskJobReport>> {
    let reports = engine.poll_disk_completed();
    for report in &reports {
        match report {
            DiskJobReport::Store {
                ticket, placements, ..
            } => kv.complete_disk_store(*ticket, placements)?,
            DiskJobReport::Stage {
                ticket,
                result,
                drop_entry,
                ..
            } => match result {
                Ok(_) => kv.mark_disk_load_staged(*ticket)?,
                Err(_) => {
                    if let Some(hash) = drop_entry {
                        kv.remove_disk_entry(*hash);
                    }
                    kv.abort_swap(*ticket)?;
                }
            },
        }
    }
    Ok(reports)
}

/// The one-group disk helpers whose manager calls answer "nothing to do" on a hybrid
/// cache (its loads live in the groups) refuse it instead.
fn refuse_hybrid(kv: &KvCache, operation: &'static str) -> Result<()> {
    if kv.is_hybrid() {
        return Err(Error::NotOnHybrid {
            operation,
            groups: kv.num_groups(),
        });
    }
    Ok(())
}

fn check_engine<S: Storage + Send + 'static>(
    kv: &KvCache,
    engine: &TransferEngine<S>,
) -> Result<()> {
    check_storage(kv, &*engine.storage().lock())?;
    match engine.disk_store_layout() {
        Some(layout) if layout == kv.layout() => Ok(()),
        Some(layout) => Err(Error::ShapeMismatch {
            what: "bytes of one block (disk store vs cache layout)",
            expected: kv.layout().block_bytes(),
            got: layout.block_bytes(),
        }),
        None => Err(Error::Unsupported(
            "no disk store is attached to the transfer engine".into(),
        )),
    }
}

/// Runs the host-to-device load of `seq` in flight in every group (its disk part, if
/// any, already staged) and completes it; on a failed copy aborts it. Returns the
/// blocks loaded (0 when no load is in flight).
fn run_host_load<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    seq: SeqId,
) -> Result<usize> {
    let Some(job) = kv.load_job_grouped(seq) else {
        return Ok(0);
    };
    if let Err(e) = job.plans.iter().try_for_each(|plan| storage.swap(plan)) {
        kv.abort_swap_grouped(&job)?;
        return Err(e);
    }
    kv.complete_swap_grouped(&job)?;
    Ok(job.plans.iter().map(|plan| plan.len()).sum())
}
