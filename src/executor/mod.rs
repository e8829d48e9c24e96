//! The executor layer: everything that moves bytes. Storage backends carry out the
//! plans the manager emits ([`crate::CopyPlan`], [`crate::SwapPlan`],
//! [`crate::MovePlan`]); the host, disk and transfer-engine tiers live here too.
//!
//! Imports run downward only: this layer names the manager, the tables, the pools,
//! the layout and the ids, never `attention` or anything above it.

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod shard;
pub mod storage;
pub mod tier;

use std::time::Instant;

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};
use crate::layout::plans::{MovePlan, SwapDirection, SwapPlan};
use crate::manager::{CostModel, DefragOptions, KvCache};
use storage::Storage;
use tier::DiskTier;

/// Fails unless `storage` holds the manager's arena (same layout, same size).
pub(crate) fn check_storage<S: Storage + ?Sized>(kv: &KvCache, storage: &S) -> Result<()> {
    if storage.layout() != kv.layout() {
        return Err(Error::config(
            "storage",
            "the storage's layout differs from the manager's",
        ));
    }
    if storage.num_blocks() != kv.num_blocks() {
        return Err(Error::ShapeMismatch {
            what: "storage blocks",
            expected: kv.num_blocks(),
            got: storage.num_blocks(),
        });
    }
    Ok(())
}

/// Compacts resident blocks toward block 0: [`KvCache::plan_defragment`], the
/// moves on `storage`, then the commit. Returns the executed plan (empty when there
/// was nothing to do or the fragmentation was below `opts.min_fragmentation`).
///
/// ```
/// use pagedkv::executor::{defragment_with, grow_to, shrink_to};
/// use pagedkv::{CacheConfig, DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId};
/// use pagedkv::manager::DefragOptions;
///
/// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1,
///                          head_dim: 8, kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 16)?;
/// let mut kv = KvCache::new(layout, CacheConfig::new(64))?;
/// let mut storage = HostStorage::new(layout, 64)?;
/// let mut slots = Vec::new();
/// for i in 0..64 {
///     kv.admit(SeqId(i), 16, &mut slots)?;          // one block each
/// }
/// for i in (1..64).step_by(2) {
///     kv.free(SeqId(i))?;                           // a checkerboard
/// }
/// assert!(kv.fragmentation().fragmentation > 0.49);
///
/// let plan = defragment_with(&mut kv, &mut storage, DefragOptions::FULL)?;
/// assert_eq!(plan.len(), 16);                       // live blocks above 32 move down
/// assert_eq!(kv.fragmentation().high_water_blocks, 32);
/// shrink_to(&mut kv, 32, &mut storage)?;            // give the tail back
/// grow_to(&mut kv, 48, &mut storage)?;              // and take some again
/// # Ok::<(), pagedkv::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidConfig`] for options out of range or a storage with another
/// layout, [`Error::ShapeMismatch`] for a storage of another size, and whatever
/// [`Storage::copy_blocks`] returns. On error the manager is unchanged and the
/// tables still read the same bytes (a failed copy only wrote into free blocks).
pub fn defragment_with<S: Storage + ?Sized>(
    kv: &mut KvCache,
    storage: &mut S,
    opts: DefragOptions,
) -> Result<MovePlan> {
    check_storage(kv, storage)?;
    let start = Instant::now();
    let pending = kv.plan_defragment(opts)?;
    if !pending.plan().is_empty() {
        storage.copy_blocks(&pending.plan().to_copy_plan())?;
    }
    let plan = pending.commit()?;
    kv.record_defrag_time(start.elapsed());
    Ok(plan)
}

/// Shrinks the arena to `num_blocks`: [`KvCache::plan_shrink`], the moves on
/// `storage`, the storage's tail released, then the commit. Returns the executed moves.
/// A hybrid cache's `storage` is the one storage of its pages (every group's layout
/// equal): the moves are over page ids, whichever group owns them.
///
/// # Errors
/// As [`KvCache::plan_shrink`]; [`Error::InvalidConfig`] /
/// [`Error::ShapeMismatch`] for a storage that does not hold the manager's arena;
/// whatever [`Storage::copy_blocks`] or [`Storage::resize`] returns. On error the
/// manager is unchanged and its tables read the same bytes.
pub fn shrink_to<S: Storage + ?Sized>(
    kv: &mut KvCache,
    num_blocks: usize,
    storage: &mut S,
) -> Result<MovePlan> {
    check_storage(kv, storage)?;
    let start = Instant::now();
    let pending = kv.plan_shrink(num_blocks)?;
    if !pending.plan().is_empty() {
        storage.copy_blocks(&pending.plan().to_copy_plan())?;
    }
    if num_blocks != storage.num_blocks() {
        storage.resize(num_blocks)?;
    }
    let plan = pending.commit()?;
    kv.record_defrag_time(start.elapsed());
    Ok(plan)
}

/// Grows the arena to `num_blocks`: the storage first, then the manager
/// ([`KvCache::plan_grow`]). No live data moves.
///
/// # Errors
/// As [`KvCache::plan_grow`]; [`Error::InvalidConfig`] /
/// [`Error::ShapeMismatch`] for a storage that does not hold the manager's arena;
/// whatever [`Storage::resize`] returns. On error nothing changed.
pub fn grow_to<S: Storage + ?Sized>(
    kv: &mut KvCache,
    num_blocks: usize,
    storage: &mut S,
) -> Result<()> {
    check_storage(kv, storage)?;
    let pending = kv.plan_grow(num_blocks)?;
    if num_blocks != storage.num_blocks() {
        storage.resize(num_blocks)?;
    }
    pending.commit().map(|_| ())
}

fn check_disk(kv: &KvCache, disk: &DiskTier) -> Result<()> {
    if disk.num_slots() != kv.num_disk_slots() {
        return Err(Error::config(
            "num_disk_slots",
            format!(
                "the disk tier has {} slots, the manager was configured with {}",
                disk.num_slots(),
                kv.num_disk_slots()
            ),
        ));
    }
    if disk.block_bytes() != kv.layout().block_bytes() {
        return Err(Error::ShapeMismatch {
            what: "bytes of one disk slot",
            expected: kv.layout().block_bytes(),
            got: disk.block_bytes(),
        });
    }
    Ok(())
}

/// Writes the host-tier blocks of swapped-out `seqs` to the disk tier and releases
/// them from the host tier ([`KvCache::plan_spill`], the copies, the commit).
/// Returns the blocks written. Each block is read from `storage`'s host tier and
/// written to `disk` with its checksum.
///
/// # Errors
/// As [`KvCache::plan_spill`]; [`Error::Io`] from a failed write;
/// [`Error::InvalidConfig`] / [`Error::ShapeMismatch`] when `disk` does not match the
/// manager. Nothing changed on error: the sequences keep their host blocks, whose
/// bytes are untouched (a failed write leaves a free slot that nothing reads).
pub fn spill_to_disk<S: Storage + ?Sized>(
    kv: &mut KvCache,
    seqs: &[SeqId],
    storage: &S,
    disk: &mut DiskTier,
) -> Result<usize> {
    check_disk(kv, disk)?;
    let mut buf = vec![0u8; kv.layout().block_bytes()];
    let pending = kv.plan_spill(seqs)?;
    for (host, slot) in pending.moves() {
        storage.read_host_block(host, &mut buf)?;
        disk.write_slot(slot, &buf)?;
    }
    pending.commit()
}

/// Reads the disk-tier blocks of swapped-out `seqs` back into the host tier, each
/// checked against its checksum ([`KvCache::plan_restore`], the copies, the
/// commit); afterwards [`KvCache::swap_in_group`] can bring them to the device.
/// Returns the blocks read.
///
/// # Errors
/// As [`KvCache::plan_restore`]; [`Error::Io`]; [`Error::Checksum`] when a
/// block read back differs from what was written; [`Error::InvalidConfig`] /
/// [`Error::ShapeMismatch`] when `disk` does not match the manager. Nothing changed on
/// error: the sequences stay on disk, and only free host blocks were written.
pub fn restore_from_disk<S: Storage + ?Sized>(
    kv: &mut KvCache,
    seqs: &[SeqId],
    storage: &mut S,
    disk: &DiskTier,
) -> Result<usize> {
    check_disk(kv, disk)?;
    let mut buf = vec![0u8; kv.layout().block_bytes()];
    let pending = kv.plan_restore(seqs)?;
    for (host, slot) in pending.moves() {
        disk.read_slot(slot, &mut buf)?;
        storage.write_host_block(host, &buf)?;
    }
    pending.commit()
}

/// Times one swap-out and one swap-in of `num_blocks` blocks on `storage` (device
/// blocks `0..n` to host blocks `0..n` and back); returns bytes per second over both.
/// It overwrites host-tier blocks `0..n`; device blocks come back unchanged.
///
/// # Errors
/// [`Error::InvalidConfig`] when `num_blocks` is 0 or exceeds either tier; the
/// storage's swap errors.
pub fn measure_swap_bandwidth<S: Storage + ?Sized>(
    storage: &mut S,
    num_blocks: usize,
) -> Result<f64> {
    let limit = storage.num_blocks().min(storage.num_host_blocks());
    if num_blocks == 0 || num_blocks > limit {
        return Err(Error::config(
            "num_blocks",
            format!("probe of {num_blocks} blocks; must be in 1..={limit}"),
        ));
    }
    let mut out = SwapPlan::new(SwapDirection::Out);
    let mut back = SwapPlan::new(SwapDirection::In);
    for b in 0..num_blocks as u32 {
        out.push(BlockId(b), BlockId(b));
        back.push(BlockId(b), BlockId(b));
    }
    let start = Instant::now();
    storage.swap(&out)?;
    storage.swap(&back)?;
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    let bytes = 2.0 * (num_blocks * storage.layout().block_bytes()) as f64;
    Ok(bytes / secs)
}

/// A [`CostModel`] whose swap bandwidth is measured on `storage`
/// ([`measure_swap_bandwidth`], run it at start-up) and whose prefill throughput is
/// the engine's `prefill_tokens_per_s`.
///
/// # Errors
/// As [`measure_swap_bandwidth`]; [`Error::InvalidConfig`] when
/// `prefill_tokens_per_s` is not positive.
pub fn probe_cost_model<S: Storage + ?Sized>(
    storage: &mut S,
    num_blocks: usize,
    prefill_tokens_per_s: f64,
) -> Result<CostModel> {
    let swap_bytes_per_s = measure_swap_bandwidth(storage, num_blocks)?;
    CostModel::new(swap_bytes_per_s, prefill_tokens_per_s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::shape::{DType, ModelShape};
    use crate::layout::KvLayout;
    use crate::manager::CacheConfig;
    use storage::HostStorage;

    #[test]
    fn storage_of_another_size_is_rejected() {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 1,
            num_kv_heads: 1,
            head_dim: 4,
            kv_dtype: DType::F16,
        };
        let layout = KvLayout::new(shape, 2).unwrap();
        let mut kv = KvCache::new(layout, CacheConfig::new(4)).unwrap();
        let mut storage = HostStorage::new(layout, 5).unwrap();
        for result in [
            defragment_with(&mut kv, &mut storage, DefragOptions::FULL).map(|_| ()),
            shrink_to(&mut kv, 3, &mut storage).map(|_| ()),
            grow_to(&mut kv, 5, &mut storage),
        ] {
            assert!(matches!(result, Err(Error::ShapeMismatch { .. })));
        }
        assert_eq!(kv.num_blocks(), 4);
    }
}
