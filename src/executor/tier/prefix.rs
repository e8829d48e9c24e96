//! The prefix cache's spill to the host tier and its restore, carried out: the
//! manager's plan, the copies on the storage, the commit (see
//! [`KvCache::plan_prefix_spill`]).

use crate::error::Result;
use crate::executor::check_storage;
use crate::executor::storage::Storage;
use crate::manager::{KvCache, PrefixRestore, PrefixSpill};

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
/// (by the manager's [`crate::manager::HostStorePolicy`]) and runs the copies on
/// `storage` at once: [`KvCache::plan_host_store`], [`Storage::swap`],
/// [`KvCache::complete_swap`]. Returns the blocks stored (0 when there was nothing to
/// store or no room). An engine that overlaps the copies with compute submits the job
/// to a [`crate::TransferEngine`] instead.
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
/// that does not hold the manager's arena; [`crate::Error::NotOnHybrid`]; the
/// storage's swap errors, after which the store is aborted (nothing changed in the
/// manager but host entries evicted to make room).
pub fn store_prefixes_to_host<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    max_blocks: usize,
) -> Result<usize> {
    check_storage(kv, storage)?;
    let Some(job) = kv.plan_host_store(max_blocks)? else {
        return Ok(0);
    };
    if let Err(e) = storage.swap(&job.plan) {
        kv.abort_swap(job.ticket)?;
        return Err(e);
    }
    kv.complete_swap(job.ticket)?;
    Ok(job.plan.len())
}

/// Runs the load of `seq` (admitted from a host-level hit, see
/// [`KvCache::load_job`]) on `storage` and completes it: the loaded tokens count as
/// computed and their blocks are registered on the device. Returns the blocks loaded
/// (0 when `seq` has no load in flight).
///
/// # Errors
/// As [`store_prefixes_to_host`]; a storage error aborts the load: `seq` keeps only
/// its device-hit tokens, computed, and the host copies stay.
pub fn load_prefix_from_host<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    seq: crate::ids::SeqId,
) -> Result<usize> {
    check_storage(kv, storage)?;
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
