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
pub mod fence;
mod host;
pub(crate) mod readers;
pub(crate) mod vmm_plan;

#[cfg(feature = "cuda")]
pub use cuda::{ArenaSize, CudaStorage, CudaStorageConfig, DeviceCopyPlan};
pub use fence::{FenceEvent, SwapFence};
pub use host::HostStorage;

use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::plans::{CopyPlan, SwapPlan};
use crate::layout::{KvLayout, Slot};
use crate::manager::TierConfig;

impl TierConfig {
    /// The tiers of a manager whose swaps `storage` executes: its host tier's size
    /// taken from the storage (so it is given once, where the memory is), and no disk
    /// tier (set [`TierConfig::num_disk_slots`] after, as for the [`crate::executor::tier::DiskTier`]).
    ///
    /// ```
    /// use pagedkv::{DType, HostStorage, KvCache, KvLayout, ModelShape, TierConfig};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 4,
    ///                          kv_dtype: DType::F16 };
    /// let layout = KvLayout::new(shape, 16)?;
    /// let store = HostStorage::with_host_tier(layout, 32, 8)?;
    /// let kv = KvCache::builder(layout)
    ///     .num_blocks(32)
    ///     .tiers(TierConfig::for_storage(&store))
    ///     .build()?;
    /// assert_eq!(TierConfig::for_storage(&store).num_host_blocks, 8);
    /// # drop(kv);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn for_storage<S: Storage + ?Sized>(storage: &S) -> Self {
        TierConfig {
            num_host_blocks: storage.num_host_blocks(),
            num_disk_slots: 0,
        }
    }
}

/// Executes plans on real memory laid out by a [`KvLayout`].
///
/// Wrappers that change one or two methods and forward the rest are written with
/// [`delegate_storage!`](crate::delegate_storage).
// A new method must be added to `delegate_storage!` too: a new default method missing
// there would silently keep its default in every wrapper instead of forwarding.
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
    /// For a latent (MLA) layout `k` holds the `[tokens, kv_lora_rank + rope_dim]`
    /// latent vectors and `v` is empty.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`], [`Error::BlockOutOfRange`], checked before any write.
    fn write_slots(&mut self, layer: usize, slots: &[Slot], k: &[u8], v: &[u8]) -> Result<()>;

    /// Reads the first `num_tokens` tokens of a block table for one layer into
    /// contiguous `[tokens, kv_heads, head_dim]` byte buffers (for a latent layout:
    /// the latent vectors into `k`, and an empty `v`).
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
    /// [`Error::BlockOutOfRange`] for a device block, [`Error::HostBlockOutOfRange`] for
    /// a host block (the manager's host tier is larger than this storage's), or
    /// [`Error::CorruptBlockTable`] for a destination written twice, before any byte
    /// moves; backend failures.
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

    /// The completion point of every swap this storage has enqueued so far: complete
    /// once their copies have landed. [`Self::swap`] and [`Self::swap_layer`] may
    /// return before the bytes move (`CudaStorage` only enqueues them); a reader of the
    /// moved blocks waits for this fence first (or, on a GPU, makes its stream wait on
    /// it). The [`crate::executor::tier::TransferEngine`] takes one after every layer it enqueues.
    ///
    /// # Errors
    /// Backend failures. The default, for storages whose swaps finish before they
    /// return, is [`SwapFence::complete`].
    fn swap_fence(&self) -> Result<SwapFence> {
        Ok(SwapFence::complete())
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

    /// The unit in which the arena's memory is held, per layer region: `Some(g)` when,
    /// after any [`Self::resize`], each layer region maps exactly its blocks' bytes
    /// rounded up to a multiple of `g` (1: byte-exact, as host memory is); `None` when
    /// a shrink can leave more mapped than that (a `CudaStorage` backed by physical
    /// chunks larger than the granule). The memory broker reads it at registration.
    fn mapping_granule_bytes(&self) -> Option<usize> {
        Some(1)
    }
}

/// Implements [`Storage`] for a type by forwarding every method to one of its fields,
/// except the methods listed after `except`, which the invocation writes itself.
///
/// Wrappers that inject a fault, gate a transfer or mirror plans onto a second storage
/// override one or two methods; this writes the rest. Every method of the trait is
/// forwarded, the default ones included ([`Storage::swap_layer`],
/// [`Storage::read_host_block`], [`Storage::write_host_block`]). A default method that
/// is listed but not written keeps the trait's default (`Err(Error::Unsupported)`)
/// instead of forwarding: a wrapper that runs every swap on two storages lists
/// `swap_layer` so that callers fall back to its [`Storage::swap`]. A listed name that
/// is not a method of [`Storage`] does not compile.
///
/// The field's type must implement [`Storage`] itself (methods are called as
/// `Storage::method(&self.field, ..)`, without auto-deref). Generic wrappers put their
/// parameters in brackets after `impl`: `impl [S: Storage] Logged<S> => inner;`.
///
/// ```
/// use pagedkv::{delegate_storage, DType, Error, HostStorage, KvLayout, ModelShape, Storage};
///
/// /// A storage that refuses to grow past `max_blocks`, as a GPU short of memory would.
/// struct Capped {
///     inner: HostStorage,
///     max_blocks: usize,
/// }
///
/// delegate_storage! {
///     Capped => inner, except [resize, swap_layer];
///
///     fn resize(&mut self, num_blocks: usize) -> pagedkv::Result<()> {
///         if num_blocks > self.max_blocks {
///             return Err(Error::OutOfBlocks { needed: num_blocks, free: self.max_blocks });
///         }
///         self.inner.resize(num_blocks)
///     }
///     // `swap_layer` is listed and not written: the trait's default refuses it.
/// }
///
/// /// Counts the copy plans it runs; generic over the inner storage.
/// struct Counting<S> {
///     inner: S,
///     copies: usize,
/// }
///
/// delegate_storage! {
///     impl [S: Storage] Counting<S> => inner, except [copy_blocks];
///
///     fn copy_blocks(&mut self, plan: &pagedkv::CopyPlan) -> pagedkv::Result<()> {
///         self.copies += 1;
///         self.inner.copy_blocks(plan)
///     }
/// }
///
/// let shape = ModelShape { num_layers: 2, num_q_heads: 4, num_kv_heads: 2, head_dim: 8,
///                          kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 16)?;
/// let capped = Capped { inner: HostStorage::with_host_tier(layout, 8, 4)?, max_blocks: 10 };
/// let mut s = Counting { inner: capped, copies: 0 };
/// assert_eq!((s.num_blocks(), s.num_host_blocks()), (8, 4)); // forwarded
/// s.resize(10)?;
/// assert!(matches!(s.resize(11), Err(Error::OutOfBlocks { needed: 11, free: 10 })));
/// let plan = pagedkv::SwapPlan::new(pagedkv::layout::plans::SwapDirection::Out);
/// assert!(matches!(s.swap_layer(0, &plan), Err(Error::Unsupported(_))));
/// s.copy_blocks(&pagedkv::CopyPlan::new())?;
/// assert_eq!(s.copies, 1);
/// # Ok::<(), pagedkv::Error>(())
/// ```
///
/// A misspelt name is an error, not a silently forwarded method:
///
/// ```compile_fail
/// struct Typo {
///     inner: pagedkv::HostStorage,
/// }
/// pagedkv::delegate_storage! { Typo => inner, except [resise]; }
/// ```
#[macro_export]
macro_rules! delegate_storage {
    // ---- internal rules: check the listed names ----
    (@check) => {};
    (@check layout $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check num_blocks $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check copy_blocks $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check write_slots $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check read_tokens $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check num_host_blocks $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check swap $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check swap_layer $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check swap_fence $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check read_host_block $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check write_host_block $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check resize $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check mapping_granule_bytes $($rest:ident)*) => { $crate::delegate_storage!(@check $($rest)*); };
    (@check $other:ident $($rest:ident)*) => {
        ::core::compile_error!(::core::concat!(
            "delegate_storage!: `", ::core::stringify!($other), "` is not a method of `Storage`"
        ));
    };

    // ---- internal rules: one forwarding method per name not listed ----
    (@each $f:tt [$($skip:ident)*]) => {};
    (@each $f:tt [$($skip:ident)*] $m:ident $($rest:ident)*) => {
        $crate::delegate_storage!(@one $f $m [$($skip)*]);
        $crate::delegate_storage!(@each $f [$($skip)*] $($rest)*);
    };
    // A name matches itself only literally, hence one rule per method.
    (@one $f:tt layout [layout $($r:ident)*]) => {};
    (@one $f:tt num_blocks [num_blocks $($r:ident)*]) => {};
    (@one $f:tt copy_blocks [copy_blocks $($r:ident)*]) => {};
    (@one $f:tt write_slots [write_slots $($r:ident)*]) => {};
    (@one $f:tt read_tokens [read_tokens $($r:ident)*]) => {};
    (@one $f:tt num_host_blocks [num_host_blocks $($r:ident)*]) => {};
    (@one $f:tt swap [swap $($r:ident)*]) => {};
    (@one $f:tt swap_layer [swap_layer $($r:ident)*]) => {};
    (@one $f:tt swap_fence [swap_fence $($r:ident)*]) => {};
    (@one $f:tt read_host_block [read_host_block $($r:ident)*]) => {};
    (@one $f:tt write_host_block [write_host_block $($r:ident)*]) => {};
    (@one $f:tt resize [resize $($r:ident)*]) => {};
    (@one $f:tt mapping_granule_bytes [mapping_granule_bytes $($r:ident)*]) => {};
    (@one $f:tt $m:ident [$x:ident $($r:ident)*]) => {
        $crate::delegate_storage!(@one $f $m [$($r)*]);
    };
    (@one $f:tt $m:ident []) => { $crate::delegate_storage!(@fwd $f $m); };

    (@fwd $f:tt layout) => {
        #[inline]
        fn layout(&self) -> &$crate::layout::KvLayout {
            $crate::executor::storage::Storage::layout(&self.$f)
        }
    };
    (@fwd $f:tt num_blocks) => {
        #[inline]
        fn num_blocks(&self) -> usize {
            $crate::executor::storage::Storage::num_blocks(&self.$f)
        }
    };
    (@fwd $f:tt copy_blocks) => {
        fn copy_blocks(
            &mut self,
            plan: &$crate::layout::plans::CopyPlan,
        ) -> $crate::error::Result<()> {
            $crate::executor::storage::Storage::copy_blocks(&mut self.$f, plan)
        }
    };
    (@fwd $f:tt write_slots) => {
        fn write_slots(
            &mut self,
            layer: usize,
            slots: &[$crate::layout::Slot],
            k: &[u8],
            v: &[u8],
        ) -> $crate::error::Result<()> {
            $crate::executor::storage::Storage::write_slots(&mut self.$f, layer, slots, k, v)
        }
    };
    (@fwd $f:tt read_tokens) => {
        fn read_tokens(
            &self,
            layer: usize,
            table: &[$crate::ids::BlockId],
            num_tokens: usize,
            k: &mut [u8],
            v: &mut [u8],
        ) -> $crate::error::Result<()> {
            $crate::executor::storage::Storage::read_tokens(&self.$f, layer, table, num_tokens, k, v)
        }
    };
    (@fwd $f:tt num_host_blocks) => {
        #[inline]
        fn num_host_blocks(&self) -> usize {
            $crate::executor::storage::Storage::num_host_blocks(&self.$f)
        }
    };
    (@fwd $f:tt swap) => {
        fn swap(&mut self, plan: &$crate::layout::plans::SwapPlan) -> $crate::error::Result<()> {
            $crate::executor::storage::Storage::swap(&mut self.$f, plan)
        }
    };
    (@fwd $f:tt swap_layer) => {
        fn swap_layer(
            &mut self,
            layer: usize,
            plan: &$crate::layout::plans::SwapPlan,
        ) -> $crate::error::Result<()> {
            $crate::executor::storage::Storage::swap_layer(&mut self.$f, layer, plan)
        }
    };
    (@fwd $f:tt swap_fence) => {
        fn swap_fence(&self) -> $crate::error::Result<$crate::executor::storage::SwapFence> {
            $crate::executor::storage::Storage::swap_fence(&self.$f)
        }
    };
    (@fwd $f:tt read_host_block) => {
        fn read_host_block(
            &self,
            block: $crate::ids::BlockId,
            out: &mut [u8],
        ) -> $crate::error::Result<()> {
            $crate::executor::storage::Storage::read_host_block(&self.$f, block, out)
        }
    };
    (@fwd $f:tt write_host_block) => {
        fn write_host_block(
            &mut self,
            block: $crate::ids::BlockId,
            data: &[u8],
        ) -> $crate::error::Result<()> {
            $crate::executor::storage::Storage::write_host_block(&mut self.$f, block, data)
        }
    };
    (@fwd $f:tt resize) => {
        fn resize(&mut self, num_blocks: usize) -> $crate::error::Result<()> {
            $crate::executor::storage::Storage::resize(&mut self.$f, num_blocks)
        }
    };
    (@fwd $f:tt mapping_granule_bytes) => {
        fn mapping_granule_bytes(&self) -> ::core::option::Option<usize> {
            $crate::executor::storage::Storage::mapping_granule_bytes(&self.$f)
        }
    };

    // ---- the entry points ----
    (
        impl [$($gen:tt)*] $ty:ty => $field:tt $(, except [$($skip:ident),* $(,)?])?;
        $($body:tt)*
    ) => {
        $crate::delegate_storage!(@check $($($skip)*)?);
        impl<$($gen)*> $crate::executor::storage::Storage for $ty {
            $($body)*
            $crate::delegate_storage!(
                @each $field [$($($skip)*)?]
                layout num_blocks copy_blocks write_slots read_tokens num_host_blocks
                swap swap_layer swap_fence read_host_block write_host_block resize
                mapping_granule_bytes
            );
        }
    };
    ($ty:ty => $($rest:tt)*) => {
        $crate::delegate_storage!(impl [] $ty => $($rest)*);
    };
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

/// Checks a host-tier block id against the tier's size and a whole-block buffer length
/// (every layer, K and V): what `read_host_block`/`write_host_block` of every backend
/// accept.
pub(crate) fn check_host_block_io(
    layout: &KvLayout,
    num_host_blocks: usize,
    block: BlockId,
    len: usize,
) -> Result<()> {
    if block.index() >= num_host_blocks {
        return Err(Error::BlockOutOfRange {
            block,
            num_blocks: num_host_blocks,
        });
    }
    if len != layout.block_bytes() {
        return Err(Error::ShapeMismatch {
            what: "bytes of one host-tier block (all layers)",
            expected: layout.block_bytes(),
            got: len,
        });
    }
    Ok(())
}

/// Checks a swap plan against the sizes of both tiers: ids in range, no destination
/// written twice.
///
/// # Errors
/// [`Error::BlockOutOfRange`] (a device block), [`Error::HostBlockOutOfRange`] (a host
/// block: the manager's host tier is larger than the storage's),
/// [`Error::CorruptBlockTable`].
pub fn validate_swap_plan(plan: &SwapPlan, device_blocks: usize, host_blocks: usize) -> Result<()> {
    for p in plan.pairs() {
        if p.device.index() >= device_blocks {
            return Err(Error::BlockOutOfRange {
                block: p.device,
                num_blocks: device_blocks,
            });
        }
        if p.host.index() >= host_blocks {
            return Err(Error::HostBlockOutOfRange {
                block: p.host,
                host_blocks,
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
    if layout.is_latent() {
        // One vector per token: it travels in `k`, and `v` has no half to fill.
        for (what, expected, got) in [
            ("latent bytes for the tokens (in k)", want, k),
            ("V bytes of a latent layout (it has no V half)", 0, v),
        ] {
            if got != expected {
                return Err(Error::ShapeMismatch {
                    what,
                    expected,
                    got,
                });
            }
        }
        return Ok(());
    }
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
