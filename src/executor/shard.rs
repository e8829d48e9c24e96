//! Tensor-parallel sharding of the KV arena: [`ShardedStorage`].
//!
//! Under tensor parallelism each GPU computes attention for a slice of the heads, so
//! each GPU holds the K/V of `num_kv_heads / N` heads of *every* block. The block
//! tables are the same on every GPU: one [`crate::KvCache`] serves them all,
//! and every plan it emits (copy-on-write, swap, resize) must run on every shard.
//!
//! [`ShardedStorage`] is that fan-out. It implements [`Storage`] with the *full*
//! layout (all heads), so the manager, the export code and the engine see one cache;
//! each shard is an ordinary [`Storage`] with its own [`KvLayout`] of the reduced head
//! count ([`shard_layout`]). Shard `i` holds KV heads
//! `i * heads_per_shard .. (i + 1) * heads_per_shard`, the split Megatron-style
//! attention uses. Token I/O ([`Storage::write_slots`], [`Storage::read_tokens`]) splits
//! and joins the heads of each token row; because a shard's heads are contiguous inside
//! a `[kv_heads, head_dim]` row, that is one `memcpy` per token and shard.
//!
//! ```
//! use pagedkv::{DType, KvLayout, ModelShape, Storage};
//! use pagedkv::executor::shard::ShardedStorage;
//!
//! let shape = ModelShape { num_layers: 2, num_q_heads: 32, num_kv_heads: 8, head_dim: 64,
//!                          kv_dtype: DType::BF16 };
//! let layout = KvLayout::new(shape, 16)?;
//! let tp = ShardedStorage::host(layout, 4, 128, 0)?;          // 4 "GPUs", 2 KV heads each
//! assert_eq!(tp.heads_per_shard(), 2);
//! assert_eq!(tp.shards()[0].layout().shape().num_kv_heads, 2);
//! assert_eq!(tp.layout().shape().num_kv_heads, 8);              // the manager's view
//! assert!(ShardedStorage::host(layout, 3, 128, 0).is_err());    // 8 heads over 3: uneven
//! # Ok::<(), pagedkv::Error>(())
//! ```

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::executor::storage::{validate_copy_plan, validate_swap_plan, HostStorage, Storage};
use crate::ids::BlockId;
use crate::layout::plans::{CopyPlan, SwapPlan};
use crate::layout::{KvLayout, Slot};

/// The layout of one of `num_shards` tensor-parallel shards of `layout`: the same
/// layers, head dim, dtype and block size, `num_kv_heads / num_shards` KV heads and
/// `num_q_heads / num_shards` query heads.
///
/// # Errors
/// [`Error::InvalidConfig`] for zero shards; [`Error::UnevenHeadSplit`] when the KV
/// heads do not divide by `num_shards` (query heads then divide too, since they are a
/// multiple of the KV heads).
pub fn shard_layout(layout: &KvLayout, num_shards: usize) -> Result<KvLayout> {
    if num_shards == 0 {
        return Err(Error::config("num_shards", "needs at least one shard"));
    }
    let mut shape = *layout.shape();
    if !shape.num_kv_heads.is_multiple_of(num_shards) {
        return Err(Error::UnevenHeadSplit {
            num_kv_heads: shape.num_kv_heads,
            num_shards,
        });
    }
    shape.num_kv_heads /= num_shards;
    shape.num_q_heads /= num_shards;
    KvLayout::new(shape, layout.block_size())
}

/// One KV arena split by heads over N storages (one per GPU), driven by one manager.
///
/// Every shard has the same number of blocks (and of host-tier blocks), so one block id
/// names the same block on every shard. Plans are validated once against the common
/// sizes and then executed shard by shard.
///
/// A backend failure on shard `k` after validation passed (a CUDA error, say) leaves
/// shards `0..k` with the plan executed and the others without; the shards then
/// disagree and the engine must treat the cache as lost, as it must after any device
/// fault. Host shards cannot fail after validation.
#[derive(Debug)]
pub struct ShardedStorage<S: Storage> {
    layout: KvLayout,
    shard_layout: KvLayout,
    shards: Vec<S>,
    /// Per-shard K and V staging for splitting and joining token rows, reused across
    /// calls (a mutex because `read_tokens` takes `&self`).
    scratch: Mutex<(Vec<u8>, Vec<u8>)>,
}

impl<S: Storage> ShardedStorage<S> {
    /// Groups `shards` into one storage of the full `layout`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for no shards, a shard whose layout is not
    /// `shard_layout(&layout, shards.len())`, or shards of different sizes;
    /// [`Error::UnevenHeadSplit`].
    pub fn new(layout: KvLayout, shards: Vec<S>) -> Result<Self> {
        let expected = shard_layout(&layout, shards.len())?;
        for (i, s) in shards.iter().enumerate() {
            if *s.layout() != expected {
                return Err(Error::config(
                    "shards",
                    format!(
                        "shard {i} has layout {:?}, expected {expected:?}",
                        s.layout()
                    ),
                ));
            }
            for (what, got, want) in [
                ("blocks", s.num_blocks(), shards[0].num_blocks()),
                (
                    "host-tier blocks",
                    s.num_host_blocks(),
                    shards[0].num_host_blocks(),
                ),
            ] {
                if got != want {
                    return Err(Error::config(
                        "shards",
                        format!("shard {i} has {got} {what}, shard 0 has {want}"),
                    ));
                }
            }
        }
        Ok(ShardedStorage {
            layout,
            shard_layout: expected,
            shards,
            scratch: Mutex::new((Vec::new(), Vec::new())),
        })
    }

    /// Builds `num_shards` shards with `make(shard_index, shard_layout)` and groups them.
    ///
    /// # Errors
    /// As [`Self::new`], plus the first error `make` returns.
    pub fn try_from_fn(
        layout: KvLayout,
        num_shards: usize,
        mut make: impl FnMut(usize, KvLayout) -> Result<S>,
    ) -> Result<Self> {
        let sl = shard_layout(&layout, num_shards)?;
        let shards = (0..num_shards)
            .map(|i| make(i, sl))
            .collect::<Result<Vec<_>>>()?;
        Self::new(layout, shards)
    }

    /// Number of shards.
    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    /// KV heads each shard holds.
    pub fn heads_per_shard(&self) -> usize {
        self.shard_layout.shape().num_kv_heads
    }

    /// The KV heads (of the full model) that shard `shard` holds.
    pub fn shard_heads(&self, shard: usize) -> std::ops::Range<usize> {
        let h = self.heads_per_shard();
        shard * h..(shard + 1) * h
    }

    /// The layout every shard has.
    pub fn shard_layout(&self) -> &KvLayout {
        &self.shard_layout
    }

    /// The shards, in head order.
    pub fn shards(&self) -> &[S] {
        &self.shards
    }

    /// Takes the shards back.
    pub fn into_shards(self) -> Vec<S> {
        self.shards
    }

    fn check_slots(&self, slots: &[Slot]) -> Result<()> {
        let num_blocks = self.num_blocks();
        for &slot in slots {
            let block = self.layout.split_slot(slot).0;
            if block.index() >= num_blocks {
                return Err(Error::BlockOutOfRange { block, num_blocks });
            }
        }
        Ok(())
    }

    /// Bytes of one shard's heads in one token row.
    fn shard_row_bytes(&self) -> usize {
        self.heads_per_shard() * self.layout.shape().head_dim * self.layout.dtype().size_bytes()
    }
}

impl ShardedStorage<HostStorage> {
    /// `num_shards` [`HostStorage`] shards of `num_blocks` blocks each, with a host tier
    /// of `num_host_blocks` blocks each (0 for none): tensor parallelism on any machine.
    ///
    /// # Errors
    /// [`Error::UnevenHeadSplit`], [`Error::InvalidConfig`].
    pub fn host(
        layout: KvLayout,
        num_shards: usize,
        num_blocks: usize,
        num_host_blocks: usize,
    ) -> Result<Self> {
        Self::try_from_fn(layout, num_shards, |_, sl| {
            HostStorage::with_host_tier(sl, num_blocks, num_host_blocks)
        })
    }
}

/// Copies shard `shard`'s slice (`row` bytes at `shard * row`) of each of `tokens` rows
/// of `full_row` bytes from `full` into the packed `part`.
fn split_rows(full: &[u8], part: &mut [u8], full_row: usize, row: usize, shard: usize) {
    for (dst, src) in part.chunks_exact_mut(row).zip(full.chunks_exact(full_row)) {
        dst.copy_from_slice(&src[shard * row..(shard + 1) * row]);
    }
}

/// The inverse of [`split_rows`].
fn join_rows(part: &[u8], full: &mut [u8], full_row: usize, row: usize, shard: usize) {
    for (src, dst) in part.chunks_exact(row).zip(full.chunks_exact_mut(full_row)) {
        dst[shard * row..(shard + 1) * row].copy_from_slice(src);
    }
}

impl<S: Storage> Storage for ShardedStorage<S> {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Each shard holds its part of every block in its own regions: exact when every
    /// shard is, in the coarsest shard's unit.
    fn mapping_granule_bytes(&self) -> Option<usize> {
        self.shards
            .iter()
            .map(Storage::mapping_granule_bytes)
            .try_fold(1, |acc, g| g.map(|g| acc.max(g)))
    }

    fn num_blocks(&self) -> usize {
        // `new` checked that the shards agree; the minimum stays safe for validation
        // should a backend change its size behind our back.
        self.shards
            .iter()
            .map(Storage::num_blocks)
            .min()
            .unwrap_or(0)
    }

    fn copy_blocks(&mut self, plan: &CopyPlan) -> Result<()> {
        validate_copy_plan(plan, self.num_blocks())?;
        for s in &mut self.shards {
            s.copy_blocks(plan)?;
        }
        Ok(())
    }

    fn write_slots(&mut self, layer: usize, slots: &[Slot], k: &[u8], v: &[u8]) -> Result<()> {
        crate::executor::storage::check_token_io(
            &self.layout,
            layer,
            slots.len(),
            k.len(),
            v.len(),
        )?;
        self.check_slots(slots)?;
        if let [only] = self.shards.as_mut_slice() {
            return only.write_slots(layer, slots, k, v);
        }
        let row = self.shard_row_bytes();
        let full_row = row * self.shards.len();
        let (sk, sv) = self.scratch.get_mut();
        sk.resize(slots.len() * row, 0);
        sv.resize(slots.len() * row, 0);
        for (i, shard) in self.shards.iter_mut().enumerate() {
            split_rows(k, sk, full_row, row, i);
            split_rows(v, sv, full_row, row, i);
            shard.write_slots(layer, slots, sk, sv)?;
        }
        Ok(())
    }

    fn read_tokens(
        &self,
        layer: usize,
        table: &[BlockId],
        num_tokens: usize,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<()> {
        crate::executor::storage::check_token_io(
            &self.layout,
            layer,
            num_tokens,
            k.len(),
            v.len(),
        )?;
        if let [only] = self.shards.as_slice() {
            return only.read_tokens(layer, table, num_tokens, k, v);
        }
        // Check the table here so that an error leaves the outputs untouched.
        let needed = self.layout.blocks_for_tokens(num_tokens);
        if needed > table.len() {
            return Err(Error::CorruptBlockTable(format!(
                "{num_tokens} tokens need {needed} blocks, the table has {}",
                table.len()
            )));
        }
        let num_blocks = self.num_blocks();
        if let Some(&block) = table[..needed].iter().find(|b| b.index() >= num_blocks) {
            return Err(Error::BlockOutOfRange { block, num_blocks });
        }
        let row = self.shard_row_bytes();
        let full_row = row * self.shards.len();
        let mut scratch = self.scratch.lock();
        let (sk, sv) = &mut *scratch;
        sk.resize(num_tokens * row, 0);
        sv.resize(num_tokens * row, 0);
        for (i, shard) in self.shards.iter().enumerate() {
            shard.read_tokens(layer, table, num_tokens, sk, sv)?;
            join_rows(sk, k, full_row, row, i);
            join_rows(sv, v, full_row, row, i);
        }
        Ok(())
    }

    fn num_host_blocks(&self) -> usize {
        self.shards
            .iter()
            .map(Storage::num_host_blocks)
            .min()
            .unwrap_or(0)
    }

    fn swap_fence(&self) -> Result<crate::executor::storage::SwapFence> {
        let fences = self
            .shards
            .iter()
            .map(Storage::swap_fence)
            .collect::<Result<Vec<_>>>()?;
        Ok(crate::executor::storage::SwapFence::all(fences))
    }

    fn swap(&mut self, plan: &SwapPlan) -> Result<()> {
        validate_swap_plan(plan, self.num_blocks(), self.num_host_blocks())?;
        for s in &mut self.shards {
            s.swap(plan)?;
        }
        Ok(())
    }

    /// Resizes every shard. When shard `k` refuses, shards `0..k` are resized back to the
    /// old size before the error returns; after a refused *shrink* their blocks above
    /// the new size come back zeroed (the caller was giving them up anyway).
    fn resize(&mut self, num_blocks: usize) -> Result<()> {
        let old = self.num_blocks();
        for k in 0..self.shards.len() {
            if let Err(e) = self.shards[k].resize(num_blocks) {
                for s in &mut self.shards[..k] {
                    // Going back to a size the backend held a moment ago; should this
                    // fail too, the first error is the one worth reporting.
                    let _ = s.resize(old);
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::shape::{DType, ModelShape};

    fn layout(kv_heads: usize) -> KvLayout {
        let shape = ModelShape {
            num_layers: 2,
            num_q_heads: kv_heads * 2,
            num_kv_heads: kv_heads,
            head_dim: 4,
            kv_dtype: DType::F16,
        };
        KvLayout::new(shape, 4).unwrap()
    }

    #[test]
    fn uneven_split_is_a_typed_error() {
        assert_eq!(
            shard_layout(&layout(6), 4),
            Err(Error::UnevenHeadSplit {
                num_kv_heads: 6,
                num_shards: 4
            })
        );
        assert!(matches!(
            shard_layout(&layout(6), 0),
            Err(Error::InvalidConfig { .. })
        ));
        let sl = shard_layout(&layout(6), 3).unwrap();
        assert_eq!(sl.shape().num_kv_heads, 2);
        assert_eq!(sl.shape().num_q_heads, 4);
    }

    #[test]
    fn mismatched_shards_are_rejected() {
        let l = layout(4);
        let sl = shard_layout(&l, 2).unwrap();
        let a = HostStorage::new(sl, 8).unwrap();
        let b = HostStorage::new(sl, 9).unwrap();
        assert!(matches!(
            ShardedStorage::new(l, vec![a.clone(), b]),
            Err(Error::InvalidConfig { .. })
        ));
        let wrong = HostStorage::new(l, 8).unwrap();
        assert!(matches!(
            ShardedStorage::new(l, vec![a, wrong]),
            Err(Error::InvalidConfig { .. })
        ));
    }

    #[test]
    fn rows_split_and_join() {
        let full: Vec<u8> = (0..24).collect();
        let mut part = vec![0; 8];
        split_rows(&full, &mut part, 12, 4, 1);
        assert_eq!(part, [4, 5, 6, 7, 16, 17, 18, 19]);
        let mut back = vec![0; 24];
        join_rows(&part, &mut back, 12, 4, 1);
        assert_eq!(&back[4..8], &[4, 5, 6, 7]);
        assert_eq!(&back[16..20], &[16, 17, 18, 19]);
        assert_eq!(back[0], 0);
    }

    #[test]
    fn bad_write_changes_no_shard() {
        let mut s = ShardedStorage::host(layout(4), 2, 4, 0).unwrap();
        let row = 4 * 4 * 2;
        let bad = [Slot(3), Slot(99)];
        let r = s.write_slots(0, &bad, &vec![7; 2 * row], &vec![7; 2 * row]);
        assert!(matches!(r, Err(Error::BlockOutOfRange { .. })));
        assert!(s
            .shards()
            .iter()
            .all(|h| h.region(0).iter().all(|&b| b == 0)));
    }
}
