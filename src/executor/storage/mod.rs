//! Storage backends: the only code that touches KV memory. They execute the plans the
//! manager emits.
//!
//! | backend | memory | availability |
//! |---|---|---|
//! | [`HostStorage`] | aligned host memory, one region per layer | always |
//! | `CudaStorage` (feature `cuda`) | one VRAM region per layer + pinned host tier | when a driver and a GPU are found |

mod copy;
#[cfg(feature = "cuda")]
mod cuda;
mod host;

#[cfg(feature = "cuda")]
pub use cuda::{ArenaSize, CudaStorage, CudaStorageConfig};
pub use host::HostStorage;

use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::plans::{CopyPlan, SwapPlan};
use crate::layout::{KvLayout, Slot};

/// Executes plans on real memory laid out by a [`KvLayout`].
pub trait Storage {
    /// The layout of the arena.
    fn layout(&self) -> &KvLayout;

    /// Blocks in the arena.
    fn num_blocks(&self) -> usize;

    /// Executes a copy-on-write plan: every layer's K and V of each source block is
    /// copied to its destination.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`] or [`Error::CorruptBlockTable`] (a destination that is
    /// also a source) before any byte moves; backend failures.
    fn copy_blocks(&mut self, plan: &CopyPlan) -> Result<()>;

    /// Writes K and V of `slots.len()` tokens for one layer. `k` and `v` hold
    /// `[tokens, kv_heads, head_dim]` elements already in the cache dtype, as bytes.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`], [`Error::BlockOutOfRange`], checked before any write.
    fn write_slots(&mut self, layer: usize, slots: &[Slot], k: &[u8], v: &[u8]) -> Result<()>;

    /// Reads the first `num_tokens` tokens of a block table for one layer into
    /// contiguous `[tokens, kv_heads, head_dim]` byte buffers.
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when the table does not cover the tokens,
    /// [`Error::BlockOutOfRange`], [`Error::ShapeMismatch`] for short outputs.
    fn read_tokens(
        &self,
        layer: usize,
        table: &[BlockId],
        num_tokens: usize,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<()>;

    /// Blocks in the host tier this storage swaps to (0 when it has none).
    fn num_host_blocks(&self) -> usize;

    /// Executes a swap plan between the device arena and the host tier, every layer.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`] on either side or [`Error::CorruptBlockTable`] for a
    /// destination written twice, before any byte moves; backend failures.
    fn swap(&mut self, plan: &SwapPlan) -> Result<()>;

    /// Executes one layer of a swap plan, so a transfer engine can signal each layer as
    /// it lands (attention on layer 0 starts before the last layer arrives). Running
    /// every layer once is the same as [`Self::swap`].
    ///
    /// # Errors
    /// As [`Self::swap`], plus [`Error::ShapeMismatch`] for a bad layer;
    /// [`Error::Unsupported`] by default, and callers then fall back to [`Self::swap`].
    fn swap_layer(&mut self, layer: usize, plan: &SwapPlan) -> Result<()> {
        let _ = (layer, plan);
        Err(Error::Unsupported("per-layer swap".into()))
    }

    /// Copies one host-tier block, every layer one after the other
    /// (`layout().block_bytes()` bytes), into `out` (the disk tier writes it out).
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], [`Error::ShapeMismatch`] for a wrong `out` length;
    /// [`Error::Unsupported`] by default.
    fn read_host_block(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        let _ = (block, out);
        Err(Error::Unsupported("host-tier block reads".into()))
    }

    /// Overwrites one host-tier block with `data`, laid out as by
    /// [`Self::read_host_block`] (the disk tier reads a block back).
    ///
    /// # Errors
    /// As [`Self::read_host_block`].
    fn write_host_block(&mut self, block: BlockId, data: &[u8]) -> Result<()> {
        let _ = (block, data);
        Err(Error::Unsupported("host-tier block writes".into()))
    }

    /// Grows or shrinks the device arena to `num_blocks`, keeping the contents of every
    /// block below the smaller of the old and new sizes.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the size is impossible; nothing changed.
    fn resize(&mut self, num_blocks: usize) -> Result<()>;
}

/// The storage [`auto`] picked.
#[derive(Debug, Clone, PartialEq)]
pub enum Backend {
    /// A `CudaStorage` on this device ordinal.
    Cuda(usize),
    /// [`HostStorage`], with the reason the GPU path was not taken.
    Host(String),
}

/// A `CudaStorage` of `num_blocks` blocks (plus `host_blocks` pinned host blocks) on
/// device 0 when a driver and a GPU are there, otherwise a [`HostStorage`] of the same
/// size. The reason for a fallback is returned, not hidden.
///
/// ```
/// use pagedkv::executor::storage::{auto, Backend};
/// use pagedkv::{DType, KvLayout, ModelShape};
///
/// let shape = ModelShape {
///     num_layers: 2,
///     num_q_heads: 8,
///     num_kv_heads: 2,
///     head_dim: 64,
///     kv_dtype: DType::BF16,
/// };
/// let (storage, backend) = auto(KvLayout::new(shape, 16)?, 64, 8)?;
/// assert_eq!((storage.num_blocks(), storage.num_host_blocks()), (64, 8));
/// if let Backend::Host(why) = backend {
///     println!("host fallback: {why}");
/// }
/// # Ok::<(), pagedkv::Error>(())
/// ```
///
/// # Errors
/// Only errors that are not "CUDA unavailable": an invalid size, or a CUDA failure on
/// a machine that has a GPU (that is a bug or an out-of-memory, not a reason to fall
/// back silently).
pub fn auto(
    layout: KvLayout,
    num_blocks: usize,
    host_blocks: usize,
) -> Result<(Box<dyn Storage + Send>, Backend)> {
    #[cfg(feature = "cuda")]
    {
        let config = CudaStorageConfig {
            host_blocks,
            ..CudaStorageConfig::blocks(num_blocks)
        };
        match CudaStorage::new(layout, config) {
            Ok(s) => Ok((Box::new(s), Backend::Cuda(0))),
            Err(Error::CudaUnavailable(why)) => {
                let host = HostStorage::with_host_tier(layout, num_blocks, host_blocks)?;
                Ok((Box::new(host), Backend::Host(why)))
            }
            Err(e) => Err(e),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let host = HostStorage::with_host_tier(layout, num_blocks, host_blocks)?;
        Ok((
            Box::new(host),
            Backend::Host("built without the `cuda` feature".into()),
        ))
    }
}

/// Checks a swap plan against the sizes of both tiers: ids in range, no destination
/// written twice.
///
/// # Errors
/// [`Error::BlockOutOfRange`], [`Error::CorruptBlockTable`].
pub fn validate_swap_plan(plan: &SwapPlan, device_blocks: usize, host_blocks: usize) -> Result<()> {
    for p in plan.pairs() {
        if p.device.index() >= device_blocks {
            return Err(Error::BlockOutOfRange {
                block: p.device,
                num_blocks: device_blocks,
            });
        }
        if p.host.index() >= host_blocks {
            return Err(Error::BlockOutOfRange {
                block: p.host,
                num_blocks: host_blocks,
            });
        }
    }
    let mut dsts: Vec<u32> = plan
        .pairs()
        .iter()
        .map(|p| match plan.direction() {
            crate::layout::plans::SwapDirection::Out => p.host.0,
            crate::layout::plans::SwapDirection::In => p.device.0,
        })
        .collect();
    dsts.sort_unstable();
    if let Some(w) = dsts.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::CorruptBlockTable(format!(
            "block {} is written twice by one swap plan",
            w[0]
        )));
    }
    Ok(())
}

/// Checks a copy plan against an arena of `num_blocks`: ids in range and no block both
/// written and read, so copies can run in any order or all at once.
///
/// # Errors
/// [`Error::BlockOutOfRange`], [`Error::CorruptBlockTable`].
pub fn validate_copy_plan(plan: &CopyPlan, num_blocks: usize) -> Result<()> {
    for c in plan.copies() {
        for b in [c.src, c.dst] {
            if b.index() >= num_blocks {
                return Err(Error::BlockOutOfRange {
                    block: b,
                    num_blocks,
                });
            }
        }
    }
    let mut dsts: Vec<u32> = plan.copies().iter().map(|c| c.dst.0).collect();
    dsts.sort_unstable();
    if let Some(w) = dsts.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::CorruptBlockTable(format!(
            "block {} is written twice by one plan",
            w[0]
        )));
    }
    if let Some(c) = plan
        .copies()
        .iter()
        .find(|c| dsts.binary_search(&c.src.0).is_ok())
    {
        return Err(Error::CorruptBlockTable(format!(
            "block {} is both read and written by one plan",
            c.src
        )));
    }
    Ok(())
}

/// Bytes of one token-head vector in the cache dtype.
pub(crate) fn head_bytes(layout: &KvLayout) -> usize {
    layout.shape().head_dim * layout.dtype().size_bytes()
}

/// Checks the arguments shared by `write_slots` and `read_tokens`.
pub(crate) fn check_token_io(
    layout: &KvLayout,
    layer: usize,
    tokens: usize,
    k: usize,
    v: usize,
) -> Result<()> {
    if layer >= layout.num_layers() {
        return Err(Error::ShapeMismatch {
            what: "layer index",
            expected: layout.num_layers(),
            got: layer,
        });
    }
    let want = tokens * layout.shape().num_kv_heads * head_bytes(layout);
    for got in [k, v] {
        if got != want {
            return Err(Error::ShapeMismatch {
                what: "K/V bytes for the tokens",
                expected: want,
                got,
            });
        }
    }
    Ok(())
}
