//! [`CudaStorage`]: the arena in VRAM, with a pinned host tier.
//!
//! - **Arena.** One region per layer, each a virtual-address range reserved once for
//!   the largest size the arena may reach (`cuMemAddressReserve`) and backed by
//!   physical chunks (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`) planned by
//!   [`super::vmm_plan`]: power-of-two multiples of the allocation granularity up to
//!   1 GiB, largest first, so a 100+ GiB arena costs a few hundred driver calls, not
//!   tens of thousands. Growing maps chunks at the tail (in granules past the big
//!   ones); shrinking unmaps and releases whole tail chunks (`cuMemUnmap`,
//!   `cuMemRelease`), keeping one that straddles the new end; with
//!   [`CudaStorageConfig::granule_chunks`] every chunk is one granule, so a shrink
//!   releases exactly the bytes past the end (what the memory broker requires, read
//!   through [`Storage::mapping_granule_bytes`]). Live blocks never move and region
//!   addresses never change, so a resize copies nothing and the per-layer base
//!   pointers uploaded once stay valid.
//! - **Streams.** Kernels and K/V writes run on the compute stream; swaps run on a
//!   separate transfer stream so they overlap compute. Ordering between the two is by
//!   events only (no device-wide synchronisation): a swap waits for the compute work
//!   queued before it; a swap-out's reads finish before compute may overwrite the
//!   blocks; compute on a layer waits for the last swap that touched it, so a
//!   swapped-in sequence can be consumed layer by layer as it arrives.
//! - **Completion.** Each enqueued swap layer records a fresh event, handed out as a
//!   [`SwapFence`] ([`Storage::swap_fence`], [`CudaStorage::layer_fence`]); the rules of
//!   which fence covers what are pure code in [`super::fence`], unit-tested on the CPU.
//!   A caller's own stream waits on one with [`CudaStorage::wait_fence_on`].
//! - **Foreign readers.** A kernel that reads the arena on a stream other than the
//!   compute stream (an engine's decode, [`crate::attention::cuda::DecodeGraphStep`]) is
//!   ordered by events both ways, never by a device synchronisation:
//!   [`CudaStorage::order_read_on`] makes the reading stream wait for the compute
//!   stream's writes queued so far and for the layer's last swap;
//!   [`CudaStorage::record_read_on`] records the stream's point after its reads in one
//!   ledger ([`super::readers`]: an event per foreign stream), and everything of the
//!   storage's own that overwrites or unmaps blocks waits for that ledger first: K/V
//!   writes and block copies on the compute stream, swaps on the transfer stream (on
//!   the device), a shrink and the storage's drop (on the host). A block the manager
//!   frees is only overwritten by one of those, so freeing needs no call of its own.
//!   The decode methods of [`crate::attention::cuda`] do both calls themselves.
//! - **Host tier and batched transfers.** One page-locked region per layer
//!   (`cuMemHostAlloc`); a swap copies merged runs ([`SwapPlan::runs`]) with the copy
//!   engines: one `cuMemcpyBatchAsync` per layer for several runs on a 13.0+ driver,
//!   else one `cuMemcpyAsync` per run. Why not a gather/scatter kernel for scattered
//!   runs: host<->device bytes through a kernel need mapped pinned memory and take SMs
//!   from compute, while the copy engines reach PCIe/C2C bandwidth on their own; the
//!   per-call cost the batch call removes is host overhead, which the driver can only
//!   amortise. Device-to-device copies (`copy_blocks`) are a kernel already, one launch
//!   per plan. This choice is reasoned, not measured: no GPU was available when it
//!   was made; `examples/gpu_bench` reports swap GB/s and host enqueue time beside
//!   one pinned memcpy of the same bytes, which is the measurement that should confirm
//!   or overturn it.

use super::copy::{for_each_token_run, table_places};
use super::fence::{FenceEvent, FenceLedger, SwapFence};
use super::readers::{OwnStream, ReaderLedger};
use super::vmm_plan::{
    issue_mode, layer_copy_runs, plan_growth, plan_shrink, IssueMode, MAX_CHUNK_BYTES,
};
use super::{check_token_io, validate_copy_plan, validate_swap_plan, Storage};
use crate::error::{Error, Result};
use crate::executor::cuda::{compile, driver_err, open_device, DeviceInfo, KernelSpec};
use crate::ids::BlockId;
use crate::layout::plans::{CopyPlan, SwapDirection, SwapPlan};
use crate::layout::shape::DType;
use crate::layout::{Kv, KvLayout, Slot};
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// How big the arena is at start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArenaSize {
    /// Exactly this many blocks.
    Blocks(usize),
    /// As many blocks as fit in this many bytes (all layers together).
    Bytes(usize),
    /// `fraction` of the device memory free at start, minus `reserve_bytes` left for
    /// activations and the engine (vLLM's `gpu_memory_utilization`, applied to free
    /// memory since the weights are usually loaded already).
    FractionOfFree {
        /// In `(0, 1]`.
        fraction: f64,
        /// Bytes to leave free on top.
        reserve_bytes: usize,
    },
}

/// Settings of a [`CudaStorage`].
#[derive(Debug, Clone, PartialEq)]
pub struct CudaStorageConfig {
    /// Device ordinal.
    pub device: usize,
    /// Arena size at start.
    pub size: ArenaSize,
    /// Largest arena [`Storage::resize`] may grow to; `None`: as many blocks as the
    /// device's total memory holds. Only address space is reserved for it.
    pub max_blocks: Option<usize>,
    /// Blocks of the pinned host tier (0: none).
    pub host_blocks: usize,
    /// Back each layer region with physical chunks of exactly one allocation granule
    /// instead of power-of-two multiples of it: a shrink then releases exactly the
    /// bytes past the new end (no chunk straddles it), and
    /// [`Storage::mapping_granule_bytes`] reports the granule, as the memory broker
    /// requires. Costs one `cuMemCreate`/`cuMemMap` per granule per layer (a 1 GiB
    /// region: 512), so off by default.
    pub granule_chunks: bool,
}

impl CudaStorageConfig {
    /// `num_blocks` blocks on device 0, no host tier.
    pub fn blocks(num_blocks: usize) -> Self {
        CudaStorageConfig {
            device: 0,
            size: ArenaSize::Blocks(num_blocks),
            max_blocks: None,
            host_blocks: 0,
            granule_chunks: false,
        }
    }
}

/// One layer's region: a reserved address range and the chunks mapped at its start,
/// sized by [`plan_growth`] (power-of-two multiples of the granularity, largest first).
#[derive(Debug)]
struct VmmRegion {
    base: sys::CUdeviceptr,
    reserved_bytes: usize,
    granularity: usize,
    /// The largest physical chunk: [`MAX_CHUNK_BYTES`], or the granularity
    /// ([`CudaStorageConfig::granule_chunks`]).
    max_chunk: usize,
    /// Handles and sizes, in mapping order from `base`.
    chunks: Vec<(sys::CUmemGenericAllocationHandle, usize)>,
}

impl VmmRegion {
    fn reserve(reserved_bytes: usize, granularity: usize, max_chunk: usize) -> Result<Self> {
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is a valid out-pointer; size and alignment are multiples of the
        // allocation granularity as cuMemAddressReserve requires.
        unsafe { sys::cuMemAddressReserve(&mut base, reserved_bytes, granularity, 0, 0) }
            .result()
            .map_err(driver_err("cuMemAddressReserve"))?;
        Ok(VmmRegion {
            base,
            reserved_bytes,
            granularity,
            max_chunk,
            chunks: Vec::new(),
        })
    }

    fn mapped_bytes(&self) -> usize {
        self.chunks.iter().map(|&(_, n)| n).sum()
    }

    fn chunk_sizes(&self) -> Vec<usize> {
        self.chunks.iter().map(|&(_, n)| n).collect()
    }

    /// Maps chunks until at least `bytes` are backed, in as few chunks as
    /// [`plan_growth`] allows; when the device refuses a large chunk (fragmented
    /// physical memory), the rest is planned again with chunks half as large, down to
    /// the granularity. On failure the region is as it was.
    fn grow_to(
        &mut self,
        bytes: usize,
        prop: &sys::CUmemAllocationProp,
        access: &sys::CUmemAccessDesc,
    ) -> Result<()> {
        let before = self.chunks.len();
        let mut max_chunk = self.max_chunk;
        'plan: loop {
            for size in plan_growth(self.mapped_bytes(), bytes, self.granularity, max_chunk) {
                if let Err(e) = self.map_one(size, prop, access) {
                    if size > self.granularity && matches!(e, Error::Cuda(_)) {
                        max_chunk = size / 2;
                        continue 'plan;
                    }
                    self.release_past(before);
                    return Err(e);
                }
            }
            return Ok(());
        }
    }

    fn map_one(
        &mut self,
        size: usize,
        prop: &sys::CUmemAllocationProp,
        access: &sys::CUmemAccessDesc,
    ) -> Result<()> {
        let at = self.base + self.mapped_bytes() as u64;
        if self.mapped_bytes() + size > self.reserved_bytes {
            return Err(Error::config(
                "num_blocks",
                format!(
                    "past the reserved maximum of {} bytes per layer",
                    self.reserved_bytes
                ),
            ));
        }
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer; `prop` describes pinned device memory
        // of this context's device; the size is a multiple of the granularity.
        unsafe { sys::cuMemCreate(&mut handle, size, prop, 0) }
            .result()
            .map_err(driver_err("cuMemCreate"))?;
        // SAFETY: `[at, at + size)` lies inside this region's reservation (checked
        // above) and is not mapped (chunks are mapped in order from the base).
        let mapped = unsafe { sys::cuMemMap(at, size, 0, handle, 0) }
            .result()
            .map_err(driver_err("cuMemMap"));
        if let Err(e) = mapped {
            // SAFETY: `handle` was created above and is not mapped anywhere.
            let _ = unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        // SAFETY: the range was just mapped; `access` is one valid descriptor.
        let access_set = unsafe { sys::cuMemSetAccess(at, size, access, 1) }
            .result()
            .map_err(driver_err("cuMemSetAccess"));
        if let Err(e) = access_set {
            // SAFETY: undoes the map and create above; nothing else refers to them.
            unsafe {
                let _ = sys::cuMemUnmap(at, size);
                let _ = sys::cuMemRelease(handle);
            }
            return Err(e);
        }
        self.chunks.push((handle, size));
        Ok(())
    }

    /// Releases whole chunks from the tail while the rest still backs `bytes`
    /// ([`plan_shrink`]). Callers make sure no queued work touches them.
    fn shrink_to(&mut self, bytes: usize) {
        let plan = plan_shrink(&self.chunk_sizes(), bytes);
        self.release_past(plan.keep);
    }

    /// Unmaps and releases chunks past the first `keep`. Callers make sure no queued
    /// work touches them. Errors here cannot leave memory in use; they are ignored.
    fn release_past(&mut self, keep: usize) {
        while self.chunks.len() > keep {
            let Some((handle, size)) = self.chunks.pop() else {
                break;
            };
            let at = self.base + self.mapped_bytes() as u64;
            // SAFETY: `[at, at + size)` is the last mapped chunk, backed by `handle`;
            // no queued work uses it (the caller synchronised the streams).
            unsafe {
                let _ = sys::cuMemUnmap(at, size);
                let _ = sys::cuMemRelease(handle);
            }
        }
    }
}

impl Drop for VmmRegion {
    fn drop(&mut self) {
        self.release_past(0);
        // SAFETY: the reservation was made in `reserve` with this size and nothing is
        // mapped in it any more. A failure cannot be reported from Drop; it is ignored.
        let _ = unsafe { sys::cuMemAddressFree(self.base, self.reserved_bytes) };
    }
}

/// Kernels of `kernels/cache_ops.cu` loaded into the storage's context.
#[derive(Debug)]
struct CacheKernels {
    copy_blocks: CudaFunction,
    reshape: Vec<((DType, DType), CudaFunction)>,
}

impl CacheKernels {
    fn reshape(&self, input: DType, cache: DType) -> Result<&CudaFunction> {
        self.reshape
            .iter()
            .find(|((i, c), _)| *i == input && *c == cache)
            .map(|(_, f)| f)
            .ok_or_else(|| Error::Unsupported(format!("writing {input} K/V into a {cache} cache")))
    }
}

/// The KV arena in VRAM: one region per layer, a pinned host tier, a compute and a
/// transfer stream. See the module docs for the design.
///
/// Every method validates its arguments on the host before any memory is touched, so
/// a rejected call leaves the arena as it was.
pub struct CudaStorage {
    layout: KvLayout,
    num_blocks: usize,
    max_blocks: usize,
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    transfer: Arc<CudaStream>,
    regions: Vec<VmmRegion>,
    /// Device array of the region base addresses, for `copy_blocks`.
    layer_bases: CudaSlice<u64>,
    num_host_blocks: usize,
    host: Vec<PinnedHostSlice<u8>>,
    host_ptrs: Vec<usize>,
    kernels: CacheKernels,
    /// One fence (a fresh CUDA event) per enqueued swap layer, and which layers each
    /// covers: see [`super::fence`] for the rules.
    fences: FenceLedger<SwapFence>,
    /// Recorded on the compute stream before work on another stream that must follow
    /// it (a swap, a foreign read), which waits on it.
    compute_mark: CudaEvent,
    /// Foreign streams that read the arena, each with its last recorded event (see
    /// the module docs and [`super::readers`]). A mutex because reads are recorded
    /// through `&self`; every method leaves the ledger consistent, so a poisoned lock
    /// is taken over as it is.
    readers: Mutex<ReaderLedger<CudaEvent>>,
    /// `cuDriverGetVersion`, which decides whether swaps use `cuMemcpyBatchAsync`.
    driver_version: i32,
}

/// A CUDA event recorded on the transfer stream after a swap's copies: the device side
/// of a [`SwapFence`] that `CudaStorage` hands out.
struct CudaFence(CudaEvent);

impl FenceEvent for CudaFence {
    fn is_complete(&self) -> Result<bool> {
        self.0.try_is_complete().map_err(driver_err("cuEventQuery"))
    }

    fn wait(&self) -> Result<()> {
        self.0
            .synchronize()
            .map_err(driver_err("cuEventSynchronize"))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStorage")
            .field("device", &self.info)
            .field("num_blocks", &self.num_blocks)
            .field("max_blocks", &self.max_blocks)
            .field("num_host_blocks", &self.num_host_blocks)
            .finish_non_exhaustive()
    }
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        // Queued kernels and copies may still use the regions and the host tier that
        // the fields' own drops release; wait for both streams first. Errors cannot
        // be reported from Drop, and a failed wait leaves nothing better to do.
        let _ = self.ctx.bind_to_thread();
        let _ = self.sync_readers();
        let _ = self.compute.synchronize();
        let _ = self.transfer.synchronize();
    }
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl CudaStorage {
    /// Opens the device, reserves and maps the arena, allocates the pinned host tier,
    /// compiles and loads the cache kernels, then warms up: every byte of the arena is
    /// written once (zero) so first-touch costs are paid here, not in the first step.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without a driver or device, or on a device without
    /// virtual memory management (`cuMemMap`; some virtualised GPUs) (fall back to
    /// [`crate::HostStorage`], e.g. with [`crate::executor::storage::auto`]); [`Error::InvalidConfig`]
    /// for an impossible size; [`Error::Cuda`] for driver or NVRTC failures. Everything
    /// allocated so far is released.
    pub fn new(layout: KvLayout, config: CudaStorageConfig) -> Result<Self> {
        let (ctx, info) = open_device(config.device)?;
        ctx.bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))?;
        let vmm = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )
            .map_err(driver_err(
                "cuDeviceGetAttribute(virtual memory management)",
            ))?;
        if vmm == 0 {
            return Err(Error::CudaUnavailable(format!(
                "device {} ({}) does not support virtual memory management \
                 (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0), which \
                 CudaStorage maps its arena with",
                config.device, info.name
            )));
        }
        let bpl = layout.block_bytes_per_layer();
        let layers = layout.num_layers();
        let (alloc_prop, access) = vmm_props(config.device);
        let mut chunk = 0usize;
        // SAFETY: valid out-pointer and property struct.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut chunk,
                &alloc_prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        }
        .result()
        .map_err(driver_err("cuMemGetAllocationGranularity"))?;
        let chunk = chunk.max(1);

        let num_blocks = match config.size {
            ArenaSize::Blocks(n) => n,
            ArenaSize::Bytes(b) => blocks_in_budget(b, bpl, layers, chunk),
            ArenaSize::FractionOfFree {
                fraction,
                reserve_bytes,
            } => {
                if !(fraction > 0.0 && fraction <= 1.0) {
                    return Err(Error::config(
                        "fraction",
                        format!("{fraction}; must be in (0, 1]"),
                    ));
                }
                let budget =
                    ((info.free_bytes as f64 * fraction) as usize).saturating_sub(reserve_bytes);
                let n = blocks_in_budget(budget, bpl, layers, chunk);
                if n == 0 {
                    return Err(Error::OutOfBlocks { needed: 1, free: 0 });
                }
                n
            }
        };
        let max_blocks = config
            .max_blocks
            .unwrap_or(info.total_bytes / layout.block_bytes().max(1))
            .max(num_blocks);
        let reserve = max_blocks
            .checked_mul(bpl)
            .map(|b| round_up(b.max(1), chunk))
            .ok_or_else(|| Error::config("max_blocks", format!("{max_blocks} blocks overflow")))?;
        let region_bytes = num_blocks
            .checked_mul(bpl)
            .ok_or_else(|| Error::config("num_blocks", format!("{num_blocks} blocks overflow")))?;

        let mut regions = Vec::with_capacity(layers);
        for _ in 0..layers {
            let max_chunk = if config.granule_chunks {
                chunk
            } else {
                MAX_CHUNK_BYTES
            };
            let mut r = VmmRegion::reserve(reserve, chunk, max_chunk)?;
            r.grow_to(region_bytes, &alloc_prop, &access)?;
            regions.push(r);
        }
        let compute = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let transfer = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let bases: Vec<u64> = regions.iter().map(|r| r.base).collect();
        let layer_bases = compute
            .clone_htod(&bases)
            .map_err(driver_err("cuMemcpyHtoD(layer bases)"))?;

        let host_bytes = config
            .host_blocks
            .checked_mul(bpl)
            .ok_or_else(|| Error::config("host_blocks", "overflow"))?;
        let mut host = Vec::new();
        let mut host_ptrs = Vec::new();
        if config.host_blocks > 0 {
            for _ in 0..layers {
                // SAFETY: the memory is zeroed below before anything reads it.
                let mut h = unsafe {
                    ctx.alloc_pinned_with_flags::<u8>(host_bytes, sys::CU_MEMHOSTALLOC_PORTABLE)
                }
                .map_err(driver_err("cuMemHostAlloc"))?;
                h.as_mut_slice()
                    .map_err(driver_err("pinned host slice"))?
                    .fill(0);
                host_ptrs.push(h.as_mut_ptr().map_err(driver_err("pinned host slice"))? as usize);
                host.push(h);
            }
        }

        let module = compile(&KernelSpec::CacheOps, info.arch)?;
        let loaded = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(module.cubin.clone()))
            .map_err(driver_err("cuModuleLoadData(cache_ops)"))?;
        let f = |name: &str| {
            loaded
                .load_function(name)
                .map_err(driver_err("cuModuleGetFunction"))
        };
        use DType::*;
        let mut reshape = Vec::new();
        for (i, c, name) in [
            (F32, F32, "reshape_and_cache_f32_f32"),
            (F32, F16, "reshape_and_cache_f32_f16"),
            (F32, BF16, "reshape_and_cache_f32_bf16"),
            (F32, Fp8E4M3, "reshape_and_cache_f32_fp8"),
            (F16, F16, "reshape_and_cache_f16_f16"),
            (F16, Fp8E4M3, "reshape_and_cache_f16_fp8"),
            (BF16, BF16, "reshape_and_cache_bf16_bf16"),
            (BF16, Fp8E4M3, "reshape_and_cache_bf16_fp8"),
            (Fp8E4M3, Fp8E4M3, "reshape_and_cache_fp8_fp8"),
        ] {
            reshape.push(((i, c), f(name)?));
        }
        let kernels = CacheKernels {
            copy_blocks: f("copy_blocks")?,
            reshape,
        };
        let mut driver_version = 0i32;
        // SAFETY: valid out-pointer.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(driver_err("cuDriverGetVersion"))?;
        let compute_mark = ctx.new_event(None).map_err(driver_err("cuEventCreate"))?;

        let storage = CudaStorage {
            layout,
            num_blocks,
            max_blocks,
            info,
            ctx,
            compute,
            transfer,
            regions,
            layer_bases,
            num_host_blocks: config.host_blocks,
            host,
            host_ptrs,
            kernels,
            fences: FenceLedger::new(layers),
            compute_mark,
            readers: Mutex::default(),
            driver_version,
        };
        // Warm-up: touch the whole arena once.
        storage.zero_range(0, region_bytes)?;
        storage
            .compute
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        Ok(storage)
    }

    /// The device this arena lives on.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream kernels and K/V writes run on. Engines enqueue their model on it (or
    /// make their stream wait on it) so their reads follow this storage's writes.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The stream swaps run on.
    pub fn transfer_stream(&self) -> &Arc<CudaStream> {
        &self.transfer
    }

    /// The most blocks [`Storage::resize`] can grow to.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Device address of `layer`'s region (stable for the storage's lifetime, across
    /// resizes).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a bad layer.
    pub fn region_ptr(&self, layer: usize) -> Result<u64> {
        self.regions
            .get(layer)
            .map(|r| r.base)
            .ok_or(Error::ShapeMismatch {
                what: "layer index",
                expected: self.layout.num_layers(),
                got: layer,
            })
    }

    /// Whether the last swap that touched `layer` has landed (true when none did).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a bad layer; [`Error::Cuda`].
    pub fn is_layer_ready(&self, layer: usize) -> Result<bool> {
        self.check_layer(layer)?;
        self.fences
            .layer(layer)
            .map_or(Ok(true), SwapFence::is_complete)
    }

    /// Whether every swap enqueued so far has landed: the fence of the latest one,
    /// which covers all earlier ones (one in-order transfer stream), whatever layers
    /// they touched and in whatever order.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn is_swap_complete(&self) -> Result<bool> {
        self.fences
            .latest()
            .map_or(Ok(true), SwapFence::is_complete)
    }

    /// The fence after which the last swap that touched `layer` has landed
    /// ([`SwapFence::complete`] when none is in flight).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a bad layer.
    pub fn layer_fence(&self, layer: usize) -> Result<SwapFence> {
        self.check_layer(layer)?;
        Ok(self.fences.layer(layer).cloned().unwrap_or_default())
    }

    /// Makes `stream` wait (on the GPU; the host does not block) until `fence` has
    /// passed, so an engine's own stream can read swapped-in blocks without a host
    /// synchronisation. A fence that is not this backend's (a combined fence of
    /// several storages) is waited for on the host instead.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn wait_fence_on(&self, fence: &SwapFence, stream: &CudaStream) -> Result<()> {
        match fence.event() {
            None => Ok(()),
            Some(e) => match e.as_any().downcast_ref::<CudaFence>() {
                Some(CudaFence(event)) => {
                    stream.wait(event).map_err(driver_err("cuStreamWaitEvent"))
                }
                None => fence.wait(),
            },
        }
    }

    /// Makes the compute stream wait (on the GPU; the host does not block) until the
    /// last swap that touched `layer` has landed. Every method of this storage that
    /// reads or writes a layer on the compute stream does this itself.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a bad layer; [`Error::Cuda`].
    pub fn wait_layer(&self, layer: usize) -> Result<()> {
        self.check_layer(layer)?;
        match self.fences.layer(layer) {
            Some(f) => self.wait_fence_on(f, &self.compute),
            None => Ok(()),
        }
    }

    /// Orders a read of `layer` that is about to be enqueued on `stream` after the
    /// writes before it: `stream` waits, on the GPU, for everything queued on the
    /// compute stream so far (K/V writes, block copies) and for the last swap that
    /// touched `layer`. On the compute stream itself only the swap needs a wait. Pair it
    /// with [`Self::record_read_on`] after the read; the decode methods of
    /// [`crate::attention::cuda`] call both.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a bad layer; [`Error::Cuda`].
    pub fn order_read_on(&self, stream: &CudaStream, layer: usize) -> Result<()> {
        self.check_layer(layer)?;
        if !self.is_compute(stream) {
            self.compute_mark
                .record(&self.compute)
                .map_err(driver_err("cuEventRecord"))?;
            stream
                .wait(&self.compute_mark)
                .map_err(driver_err("cuStreamWaitEvent"))?;
        }
        self.wait_fence_on(&self.layer_fence(layer)?, stream)
    }

    /// Records that reads of the arena were enqueued on `stream`: an event recorded on
    /// it now goes into the storage's ledger of foreign readers (one per stream,
    /// re-recorded on each call), and every later write on the compute stream, swap,
    /// shrink and the storage's drop waits for it. Nothing to do for the compute stream
    /// (its own order covers it). Reads of the arena on a foreign stream that are not
    /// recorded here are not ordered with the storage's later writes.
    ///
    /// # Errors
    /// [`Error::Cuda`]; the stream's earlier point stays in the ledger then.
    pub fn record_read_on(&self, stream: &CudaStream) -> Result<()> {
        if self.is_compute(stream) {
            return Ok(());
        }
        let key = stream.cu_stream() as usize;
        let mut readers = self.readers();
        let event = match readers.take_event(key) {
            Some(e) => e,
            None => self
                .ctx
                .new_event(None)
                .map_err(driver_err("cuEventCreate"))?,
        };
        // Points that passed order nothing: keep the ledger to reads in flight.
        readers.forget_completed(|e| e.try_is_complete().unwrap_or(false));
        // A failed record leaves the event at its earlier point, which stays covered.
        let recorded = event.record(stream).map_err(driver_err("cuEventRecord"));
        readers.recorded(key, event);
        recorded
    }

    /// Foreign streams whose recorded reads may still be in flight (the ledger's size,
    /// for tests and diagnostics).
    pub fn foreign_readers(&self) -> usize {
        self.readers().len()
    }

    /// Blocks the host until every foreign read recorded with [`Self::record_read_on`]
    /// so far has finished, and empties the ledger.
    ///
    /// # Errors
    /// [`Error::Cuda`]; the reads not yet waited for stay in the ledger.
    pub fn sync_readers(&self) -> Result<()> {
        self.readers().drain(|e| {
            e.synchronize()
                .map_err(driver_err("cuEventSynchronize(foreign reader)"))
        })
    }

    /// Makes one of the storage's own streams wait, on the device, for every foreign
    /// read recorded so far that it has not waited for yet.
    fn wait_readers(&self, who: OwnStream) -> Result<()> {
        let stream = match who {
            OwnStream::Compute => &self.compute,
            OwnStream::Transfer => &self.transfer,
        };
        self.readers().for_unwaited(who, |e| {
            stream
                .wait(e)
                .map_err(driver_err("cuStreamWaitEvent(foreign reader)"))
        })
    }

    fn readers(&self) -> MutexGuard<'_, ReaderLedger<CudaEvent>> {
        self.readers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn is_compute(&self, stream: &CudaStream) -> bool {
        stream.cu_stream() == self.compute.cu_stream()
    }

    /// Bytes of physical memory mapped behind `layer`'s region, and in how many
    /// chunks (see the module docs).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a bad layer.
    pub fn mapped_bytes(&self, layer: usize) -> Result<(usize, usize)> {
        self.check_layer(layer)?;
        let r = &self.regions[layer];
        Ok((r.mapped_bytes(), r.chunks.len()))
    }

    /// Bytes of address space reserved per layer (what [`Self::max_blocks`] can use).
    pub fn reserved_bytes_per_layer(&self) -> usize {
        self.regions.first().map_or(0, |r| r.reserved_bytes)
    }

    /// Blocks the host until every queued swap has finished (stream, not device,
    /// synchronisation).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn sync_transfers(&self) -> Result<()> {
        self.transfer
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))
    }

    /// Blocks the host until the compute stream is idle.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn sync_compute(&self) -> Result<()> {
        self.compute
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))
    }

    /// Copies one layer's bytes of `block` to the host (waits for queued work).
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], [`Error::ShapeMismatch`]; [`Error::Cuda`].
    pub fn block_bytes(&self, layer: usize, block: BlockId) -> Result<Vec<u8>> {
        self.check_layer(layer)?;
        self.check_block(block)?;
        let n = self.layout.block_bytes_per_layer();
        let mut out = vec![0u8; n];
        self.wait_layer(layer)?;
        let src = self.regions[layer].base + self.layout.block_byte_offset(block) as u64;
        self.dtoh(&mut out, src)?;
        Ok(out)
    }

    /// One layer's bytes of host-tier `block` (waits for queued swaps).
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], [`Error::ShapeMismatch`]; [`Error::Cuda`].
    pub fn host_block_bytes(&self, layer: usize, block: BlockId) -> Result<Vec<u8>> {
        self.check_layer(layer)?;
        if block.index() >= self.num_host_blocks {
            return Err(Error::BlockOutOfRange {
                block,
                num_blocks: self.num_host_blocks,
            });
        }
        self.sync_transfers()?;
        let n = self.layout.block_bytes_per_layer();
        let start = block.index() * n;
        let bytes = self.host[layer]
            .as_slice()
            .map_err(driver_err("pinned host slice"))?;
        Ok(bytes[start..start + n].to_vec())
    }

    /// Writes K/V of `slots.len()` tokens for one layer, converting from `input` dtype
    /// to the cache dtype (quantising to fp8 as `x / scale`, round-to-nearest-even,
    /// saturating, exactly as [`crate::layout::convert::encode`]). `k` and `v` are `[tokens, kv_heads, head_dim]` elements of `input`,
    /// as bytes, on the host. Tokens run in parallel: when two tokens name the same
    /// slot, which one lands is unspecified (the manager never hands out a slot twice).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`], [`Error::BlockOutOfRange`], [`Error::Unsupported`] for
    /// a conversion without a kernel, before anything is written; [`Error::Cuda`].
    #[allow(clippy::too_many_arguments)]
    pub fn reshape_and_cache(
        &mut self,
        layer: usize,
        slots: &[Slot],
        k: &[u8],
        v: &[u8],
        input: DType,
        k_scale: f32,
        v_scale: f32,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let func = self.kernels.reshape(input, self.layout.dtype())?;
        let shape = self.layout.shape();
        let want = slots.len() * shape.num_kv_heads * shape.head_dim * input.size_bytes();
        for got in [k.len(), v.len()] {
            if got != want {
                return Err(Error::ShapeMismatch {
                    what: "K/V bytes for the tokens",
                    expected: want,
                    got,
                });
            }
        }
        for &s in slots {
            self.check_block(self.layout.split_slot(s).0)?;
        }
        for (field, s) in [("k_scale", k_scale), ("v_scale", v_scale)] {
            if !(s.is_finite() && s > 0.0) {
                return Err(Error::config(
                    field,
                    format!("{s} must be positive and finite"),
                ));
            }
        }
        if slots.is_empty() {
            return Ok(());
        }
        let func = func.clone();
        let slot_ids: Vec<u64> = slots.iter().map(|s| s.0).collect();
        let d_slots = self.htod(&slot_ids)?;
        let d_k = self.htod(k)?;
        let d_v = self.htod(v)?;
        self.launch_reshape(
            &func,
            layer,
            &d_slots,
            &d_k,
            &d_v,
            slots.len(),
            k_scale,
            v_scale,
        )
    }

    /// [`Self::reshape_and_cache`] with K, V and the slot mapping already on the
    /// device (the engine's step). Slots at or past `num_blocks * block_size` are
    /// skipped by the kernel (use `u64::MAX` for padding tokens).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when a buffer is shorter than `num_tokens` needs;
    /// [`Error::Unsupported`]; [`Error::Cuda`].
    #[allow(clippy::too_many_arguments)]
    pub fn reshape_and_cache_device(
        &mut self,
        layer: usize,
        slots: &CudaSlice<u64>,
        k: &CudaSlice<u8>,
        v: &CudaSlice<u8>,
        num_tokens: usize,
        input: DType,
        k_scale: f32,
        v_scale: f32,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let func = self.kernels.reshape(input, self.layout.dtype())?.clone();
        let shape = self.layout.shape();
        let want = num_tokens * shape.num_kv_heads * shape.head_dim * input.size_bytes();
        for (what, expected, got) in [
            ("slot mapping entries", num_tokens, slots.len()),
            ("K bytes on the device", want, k.len()),
            ("V bytes on the device", want, v.len()),
        ] {
            if got < expected {
                return Err(Error::ShapeMismatch {
                    what,
                    expected,
                    got,
                });
            }
        }
        if num_tokens == 0 {
            return Ok(());
        }
        self.launch_reshape(&func, layer, slots, k, v, num_tokens, k_scale, v_scale)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_reshape(
        &self,
        func: &CudaFunction,
        layer: usize,
        slots: &CudaSlice<u64>,
        k: &CudaSlice<u8>,
        v: &CudaSlice<u8>,
        num_tokens: usize,
        k_scale: f32,
        v_scale: f32,
    ) -> Result<()> {
        if num_tokens > i32::MAX as usize {
            return Err(Error::TooLong {
                tokens: num_tokens,
                limit: i32::MAX as usize,
            });
        }
        self.wait_layer(layer)?;
        // A slot written here may belong to a block that a foreign read still reads
        // (freed by the manager and handed out again).
        self.wait_readers(OwnStream::Compute)?;
        let shape = self.layout.shape();
        let s = self.layout.strides();
        let base = self.regions[layer].base;
        let (heads, dim, bs) = (
            shape.num_kv_heads as u32,
            shape.head_dim as u32,
            self.layout.block_size() as u32,
        );
        let (sb, skv, sh, st) = (s.block as u64, s.kv as u64, s.head as u64, s.token as u64);
        let num_slots = (self.num_blocks * self.layout.block_size()) as u64;
        // The kernel divides (x / scale) rather than multiplying by a reciprocal, so its
        // fp8 codes are those of pagedkv::layout::convert::encode bit for bit.
        let (ks, vs) = (k_scale, v_scale);
        let cfg = LaunchConfig {
            grid_dim: (num_tokens as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.compute.launch_builder(func);
        b.arg(&base)
            .arg(k)
            .arg(v)
            .arg(slots)
            .arg(&heads)
            .arg(&dim)
            .arg(&bs)
            .arg(&sb)
            .arg(&skv)
            .arg(&sh)
            .arg(&st)
            .arg(&num_slots)
            .arg(&ks)
            .arg(&vs);
        // SAFETY: the argument list matches `reshape_and_cache_<in>_<cache>` in
        // kernels/cache_ops.cu. Bounds: the grid has one CTA per token and `slots`,
        // `k`, `v` hold at least `num_tokens` tokens (checked by the callers); the
        // kernel writes only slots below `num_slots` = the blocks mapped in this
        // layer's region times the block size, at offsets computed from the layout's
        // strides, so every write stays inside the mapped part of the region.
        unsafe { b.launch(cfg) }.map_err(driver_err("cuLaunchKernel(reshape_and_cache)"))?;
        Ok(())
    }

    /// Makes the storage's context current on this thread, which the raw driver calls
    /// (memcpy, memset, VMM) need; cudarc's safe calls do it themselves.
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))
    }

    /// Enqueues one layer of a swap plan on the transfer stream, so a transfer engine
    /// can hand layers over as they land; running every layer once is [`Storage::swap`].
    /// ([`Storage::swap_layer`] for `CudaStorage` calls this.)
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a bad layer; as [`Storage::swap`].
    pub fn swap_layer(&mut self, layer: usize, plan: &SwapPlan) -> Result<()> {
        self.check_layer(layer)?;
        validate_swap_plan(plan, self.num_blocks, self.num_host_blocks)?;
        self.enqueue_swap(plan, layer..layer + 1)
    }

    /// Copies host-tier `block`, every layer one after the other
    /// (`layout().block_bytes()` bytes), into `out`, after queued swaps finish.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], [`Error::ShapeMismatch`] for a wrong `out` length;
    /// [`Error::Cuda`].
    pub fn read_host_block(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        self.check_host_block(block, out.len())?;
        self.sync_transfers()?;
        let n = self.layout.block_bytes_per_layer();
        for (layer, chunk) in out.chunks_exact_mut(n).enumerate() {
            let bytes = self.host[layer]
                .as_slice()
                .map_err(driver_err("pinned host slice"))?;
            chunk.copy_from_slice(&bytes[block.index() * n..][..n]);
        }
        Ok(())
    }

    /// Overwrites host-tier `block` with `data`, laid out as by
    /// [`Self::read_host_block`], after queued swaps (which may read it) finish.
    ///
    /// # Errors
    /// As [`Self::read_host_block`].
    pub fn write_host_block(&mut self, block: BlockId, data: &[u8]) -> Result<()> {
        self.check_host_block(block, data.len())?;
        self.sync_transfers()?;
        let n = self.layout.block_bytes_per_layer();
        for (layer, chunk) in data.chunks_exact(n).enumerate() {
            let bytes = self.host[layer]
                .as_mut_slice()
                .map_err(driver_err("pinned host slice"))?;
            bytes[block.index() * n..][..n].copy_from_slice(chunk);
        }
        Ok(())
    }

    fn check_host_block(&self, block: BlockId, len: usize) -> Result<()> {
        super::check_host_block_io(&self.layout, self.num_host_blocks, block, len)
    }

    /// Enqueues the runs of a validated swap plan for `layers` on the transfer stream,
    /// recording one fence (a fresh event) after each layer's copies; the last one is
    /// the swap's and covers every layer it enqueued.
    fn enqueue_swap(&mut self, plan: &SwapPlan, layers: std::ops::Range<usize>) -> Result<()> {
        if plan.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // Fences already passed need no event any more.
        self.fences
            .forget_completed(|f| f.is_complete().unwrap_or(false));
        // The swap sees everything queued on compute before it...
        self.compute_mark
            .record(&self.compute)
            .map_err(driver_err("cuEventRecord"))?;
        self.transfer
            .wait(&self.compute_mark)
            .map_err(driver_err("cuStreamWaitEvent"))?;
        // ... and every foreign read of the arena recorded so far (a swap-in overwrites
        // device blocks such a read may still be reading).
        self.wait_readers(OwnStream::Transfer)?;
        let bpl = self.layout.block_bytes_per_layer();
        let runs = layer_copy_runs(&plan.runs(), bpl)
            .ok_or_else(|| Error::config("swap plan", "byte offsets overflow"))?;
        for layer in layers {
            self.enqueue_layer_copies(plan.direction(), layer, &runs)?;
            let event = self
                .ctx
                .new_event(None)
                .map_err(driver_err("cuEventCreate"))?;
            event
                .record(&self.transfer)
                .map_err(driver_err("cuEventRecord"))?;
            // ...and a swap-out finishes reading a layer's device blocks before compute
            // may reuse them. A swap-in is waited for per layer, by whoever touches it.
            if plan.direction() == SwapDirection::Out {
                self.compute
                    .wait(&event)
                    .map_err(driver_err("cuStreamWaitEvent"))?;
            }
            let fence = SwapFence::pending(Arc::new(CudaFence(event)));
            self.fences.recorded([layer], fence);
        }
        Ok(())
    }

    /// One layer's copies of a swap: one `cuMemcpyAsync` for a single run, one
    /// `cuMemcpyBatchAsync` for several when the driver has it (see
    /// [`super::vmm_plan::issue_mode`]).
    fn enqueue_layer_copies(
        &self,
        direction: SwapDirection,
        layer: usize,
        runs: &[super::vmm_plan::CopyRun],
    ) -> Result<()> {
        let dev = self.regions[layer].base;
        let host = self.host_ptrs[layer] as u64;
        let stream = self.transfer.cu_stream();
        // Device and host addresses share one 64-bit space (unified addressing, which
        // every sm_80+ device on a 64-bit host has).
        let (src_base, dst_base) = match direction {
            SwapDirection::Out => (dev, host),
            SwapDirection::In => (host, dev),
        };
        match issue_mode(runs.len(), self.driver_version) {
            IssueMode::Nothing => Ok(()),
            IssueMode::PerRun(_) => {
                for run in runs {
                    let (src, dst) = (
                        src_base + run.src_offset as u64,
                        dst_base + run.dst_offset as u64,
                    );
                    let r = match direction {
                        // SAFETY: the plan was validated by the caller: device runs lie
                        // below `num_blocks` (mapped), host runs below
                        // `num_host_blocks` (inside the pinned region of
                        // `host_blocks * bpl` bytes, alive as long as `self`); the
                        // transfer stream orders these with later swaps and the fences
                        // order them with compute.
                        SwapDirection::Out => unsafe {
                            sys::cuMemcpyDtoHAsync_v2(
                                dst as *mut std::ffi::c_void,
                                src,
                                run.bytes,
                                stream,
                            )
                        },
                        // SAFETY: as above, with the roles of the two sides exchanged.
                        SwapDirection::In => unsafe {
                            sys::cuMemcpyHtoDAsync_v2(
                                dst,
                                src as *const std::ffi::c_void,
                                run.bytes,
                                stream,
                            )
                        },
                    };
                    r.result().map_err(driver_err("cuMemcpyAsync(swap)"))?;
                }
                Ok(())
            }
            IssueMode::Batch(n) => {
                let mut srcs: Vec<u64> = runs
                    .iter()
                    .map(|r| src_base + r.src_offset as u64)
                    .collect();
                let mut dsts: Vec<u64> = runs
                    .iter()
                    .map(|r| dst_base + r.dst_offset as u64)
                    .collect();
                let mut sizes: Vec<usize> = runs.iter().map(|r| r.bytes).collect();
                let (dev_loc, host_loc) = (
                    sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: self.info.ordinal as i32,
                    },
                    sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                        id: 0,
                    },
                );
                let (src_loc, dst_loc) = match direction {
                    SwapDirection::Out => (dev_loc, host_loc),
                    SwapDirection::In => (host_loc, dev_loc),
                };
                let mut attrs = [sys::CUmemcpyAttributes {
                    // Sources are read in stream order: the swap waited for compute.
                    srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                    srcLocHint: src_loc,
                    dstLocHint: dst_loc,
                    flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
                }];
                let mut attr_idx = [0usize];
                // SAFETY: the three arrays hold `n` entries each and outlive the call
                // (the driver copies the descriptors; the bytes they name are validated
                // as in the per-run path above). One attribute applies from copy 0.
                unsafe {
                    sys::cuMemcpyBatchAsync_v2(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        n,
                        attrs.as_mut_ptr(),
                        attr_idx.as_mut_ptr(),
                        1,
                        stream,
                    )
                }
                .result()
                .map_err(driver_err("cuMemcpyBatchAsync(swap)"))
            }
        }
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer < self.layout.num_layers() {
            Ok(())
        } else {
            Err(Error::ShapeMismatch {
                what: "layer index",
                expected: self.layout.num_layers(),
                got: layer,
            })
        }
    }

    fn check_block(&self, block: BlockId) -> Result<()> {
        if block.index() < self.num_blocks {
            Ok(())
        } else {
            Err(Error::BlockOutOfRange {
                block,
                num_blocks: self.num_blocks,
            })
        }
    }

    fn htod<T: cudarc::driver::DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.compute
            .clone_htod(data)
            .map_err(driver_err("cuMemcpyHtoDAsync"))
    }

    /// Copies device bytes at `src` into `out` on the compute stream and waits.
    fn dtoh(&self, out: &mut [u8], src: sys::CUdeviceptr) -> Result<()> {
        self.bind()?;
        // SAFETY: `src..src + out.len()` lies in a mapped region (callers check block
        // ids against `num_blocks`); `out` is a live host buffer of that length; the
        // stream is synchronised before `out` is used or dropped.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                out.as_mut_ptr().cast(),
                src,
                out.len(),
                self.compute.cu_stream(),
            )
        }
        .result()
        .map_err(driver_err("cuMemcpyDtoHAsync"))?;
        self.sync_compute()
    }

    /// Zeroes bytes `[from, to)` of every region on the compute stream.
    fn zero_range(&self, from: usize, to: usize) -> Result<()> {
        if to <= from {
            return Ok(());
        }
        self.bind()?;
        for r in &self.regions {
            // SAFETY: `[from, to)` lies inside the mapped part of the region (callers
            // pass byte counts of mapped blocks).
            unsafe {
                sys::cuMemsetD8Async(r.base + from as u64, 0, to - from, self.compute.cu_stream())
            }
            .result()
            .map_err(driver_err("cuMemsetD8Async"))?;
        }
        Ok(())
    }
}

/// A copy plan validated against a [`CudaStorage`] and uploaded, so it can be
/// launched any number of times without host work ([`CudaStorage::copy_blocks_uploaded`]).
#[derive(Debug)]
pub struct DeviceCopyPlan {
    pairs: Option<CudaSlice<u32>>,
    copies: usize,
    /// One past the largest block id it names.
    blocks_needed: usize,
}

impl DeviceCopyPlan {
    /// Copies in the plan.
    pub fn len(&self) -> usize {
        self.copies
    }

    /// Whether the plan copies nothing.
    pub fn is_empty(&self) -> bool {
        self.copies == 0
    }
}

impl CudaStorage {
    /// Validates `plan` (as [`Storage::copy_blocks`] does) and uploads its pairs on the
    /// compute stream.
    ///
    /// # Errors
    /// As [`Storage::copy_blocks`]; [`Error::TooLong`] past `i32::MAX` copies.
    pub fn upload_copy_plan(&self, plan: &CopyPlan) -> Result<DeviceCopyPlan> {
        validate_copy_plan(plan, self.num_blocks)?;
        if plan.len() > i32::MAX as usize {
            return Err(Error::TooLong {
                tokens: plan.len(),
                limit: i32::MAX as usize,
            });
        }
        if plan.is_empty() {
            return Ok(DeviceCopyPlan {
                pairs: None,
                copies: 0,
                blocks_needed: 0,
            });
        }
        let pairs: Vec<u32> = plan
            .copies()
            .iter()
            .flat_map(|c| [c.src.0, c.dst.0])
            .collect();
        let blocks_needed = pairs.iter().map(|&b| b as usize + 1).max().unwrap_or(0);
        Ok(DeviceCopyPlan {
            pairs: Some(self.htod(&pairs)?),
            copies: plan.len(),
            blocks_needed,
        })
    }

    /// Launches an uploaded copy plan: one `copy_blocks` kernel over every layer, after
    /// the layers' last swaps. No host work beyond the launch.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`] when the arena shrank below the plan since it was
    /// uploaded; [`Error::Cuda`].
    pub fn copy_blocks_uploaded(&mut self, plan: &DeviceCopyPlan) -> Result<()> {
        let Some(d_pairs) = &plan.pairs else {
            return Ok(());
        };
        if plan.blocks_needed > self.num_blocks {
            return Err(Error::BlockOutOfRange {
                block: BlockId(plan.blocks_needed as u32 - 1),
                num_blocks: self.num_blocks,
            });
        }
        for layer in 0..self.layout.num_layers() {
            self.wait_layer(layer)?;
        }
        // Destinations may be blocks a foreign read still reads.
        self.wait_readers(OwnStream::Compute)?;
        let block_bytes = self.layout.block_bytes_per_layer() as u64;
        let cfg = LaunchConfig {
            grid_dim: (plan.copies as u32, self.layout.num_layers() as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.compute.launch_builder(&self.kernels.copy_blocks);
        b.arg(&self.layer_bases).arg(d_pairs).arg(&block_bytes);
        // SAFETY: arguments match `copy_blocks` in kernels/cache_ops.cu. Bounds: the
        // grid is (plan length, layers); `d_pairs` holds 2 ids per copy and
        // `layer_bases` one address per layer; every id was checked below `num_blocks`
        // at upload and is still below it (checked above), and each region maps at
        // least `num_blocks * block_bytes` bytes, so reads and writes stay inside the
        // regions; no destination is a source, so CTAs never touch each other's bytes.
        unsafe { b.launch(cfg) }.map_err(driver_err("cuLaunchKernel(copy_blocks)"))?;
        Ok(())
    }
}

/// Allocation properties (pinned device memory on `device`) and read-write access
/// for that device, as the VMM calls take them.
fn vmm_props(device: usize) -> (sys::CUmemAllocationProp, sys::CUmemAccessDesc) {
    let prop = sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device as i32,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    };
    let access = sys::CUmemAccessDesc {
        location: prop.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    (prop, access)
}

/// Blocks that fit `budget` bytes over `layers` regions, each rounded up to `chunk`.
pub(crate) fn blocks_in_budget(budget: usize, bpl: usize, layers: usize, chunk: usize) -> usize {
    let per_layer = (budget / layers.max(1)) / chunk * chunk;
    per_layer / bpl.max(1)
}

impl Storage for CudaStorage {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The granule with [`CudaStorageConfig::granule_chunks`]; otherwise `None` (a
    /// shrink keeps a chunk that straddles the new end).
    fn mapping_granule_bytes(&self) -> Option<usize> {
        let r = self.regions.first()?;
        (r.max_chunk <= r.granularity).then_some(r.granularity)
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn copy_blocks(&mut self, plan: &CopyPlan) -> Result<()> {
        let uploaded = self.upload_copy_plan(plan)?;
        self.copy_blocks_uploaded(&uploaded)
    }

    fn write_slots(&mut self, layer: usize, slots: &[Slot], k: &[u8], v: &[u8]) -> Result<()> {
        check_token_io(&self.layout, layer, slots.len(), k.len(), v.len())?;
        if self.layout.is_latent() {
            // `reshape_and_cache` in kernels/cache_ops.cu writes a K and a V vector per
            // token; a latent layout has one, and `v` is empty.
            return Err(Error::Unsupported(
                "CudaStorage::write_slots of a latent (MLA) layout: the cache-write kernel has no latent form yet".into(),
            ));
        }
        let d = self.layout.dtype();
        self.reshape_and_cache(layer, slots, k, v, d, 1.0, 1.0)
    }

    fn read_tokens(
        &self,
        layer: usize,
        table: &[BlockId],
        num_tokens: usize,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<()> {
        check_token_io(&self.layout, layer, num_tokens, k.len(), v.len())?;
        let nb = self.layout.blocks_for_tokens(num_tokens);
        if nb > table.len() {
            return Err(Error::CorruptBlockTable(format!(
                "{num_tokens} tokens need {nb} blocks, the table has {}",
                table.len()
            )));
        }
        for &b in &table[..nb] {
            self.check_block(b)?;
        }
        let bpl = self.layout.block_bytes_per_layer();
        let mut staged = vec![0u8; nb * bpl];
        self.wait_layer(layer)?;
        self.bind()?;
        for (i, &b) in table[..nb].iter().enumerate() {
            let src = self.regions[layer].base + self.layout.block_byte_offset(b) as u64;
            // SAFETY: `b` is below `num_blocks`, so `[src, src + bpl)` is mapped;
            // the destination chunk is inside `staged`, which outlives the copy
            // (the stream is synchronised below before it is read).
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    staged[i * bpl..].as_mut_ptr().cast(),
                    src,
                    bpl,
                    self.compute.cu_stream(),
                )
            }
            .result()
            .map_err(driver_err("cuMemcpyDtoHAsync"))?;
        }
        self.sync_compute()?;
        // `staged` holds the table's blocks in table order, so it is addressed as a
        // region whose blocks are numbered 0, 1, 2, ...
        let places = table_places(&self.layout, (0..).map(BlockId), num_tokens);
        for_each_token_run(&self.layout, places, |run| {
            let out = match run.kv {
                Kv::K => &mut *k,
                Kv::V => &mut *v,
            };
            out[run.buf].copy_from_slice(&staged[run.region]);
        });
        Ok(())
    }

    fn num_host_blocks(&self) -> usize {
        self.num_host_blocks
    }

    fn swap(&mut self, plan: &SwapPlan) -> Result<()> {
        validate_swap_plan(plan, self.num_blocks, self.num_host_blocks)?;
        self.enqueue_swap(plan, 0..self.layout.num_layers())
    }

    fn swap_fence(&self) -> Result<SwapFence> {
        Ok(self.fences.latest().cloned().unwrap_or_default())
    }

    fn swap_layer(&mut self, layer: usize, plan: &SwapPlan) -> Result<()> {
        CudaStorage::swap_layer(self, layer, plan)
    }

    fn read_host_block(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        CudaStorage::read_host_block(self, block, out)
    }

    fn write_host_block(&mut self, block: BlockId, data: &[u8]) -> Result<()> {
        CudaStorage::write_host_block(self, block, data)
    }

    fn resize(&mut self, num_blocks: usize) -> Result<()> {
        if num_blocks > self.max_blocks {
            return Err(Error::config(
                "num_blocks",
                format!(
                    "{num_blocks} blocks exceed the reserved maximum of {}",
                    self.max_blocks
                ),
            ));
        }
        let bpl = self.layout.block_bytes_per_layer();
        let (old_bytes, new_bytes) = (self.num_blocks * bpl, num_blocks * bpl);
        self.bind()?;
        // Queued work may still touch the tail being unmapped, or the bytes being
        // zeroed; wait for both streams and for every foreign read (not the whole
        // device).
        self.sync_readers()?;
        self.sync_compute()?;
        self.sync_transfers()?;
        if num_blocks > self.num_blocks {
            let before: Vec<usize> = self.regions.iter().map(|r| r.chunks.len()).collect();
            let (prop, access) = vmm_props(self.info.ordinal);
            for i in 0..self.regions.len() {
                if let Err(e) = self.regions[i].grow_to(new_bytes, &prop, &access) {
                    for (r, &keep) in self.regions.iter_mut().zip(&before) {
                        r.release_past(keep);
                    }
                    return Err(e);
                }
            }
            self.zero_range(old_bytes, new_bytes)?;
            self.sync_compute()?;
        } else {
            for r in &mut self.regions {
                r.shrink_to(new_bytes);
            }
        }
        self.num_blocks = num_blocks;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_count_whole_chunks_per_layer() {
        let mib = 1 << 20;
        // 80 layers, 2 MiB chunks, 64 KiB blocks: 1 GiB gives 12 MiB per layer
        // (13.1 rounded down to chunks) = 192 blocks.
        assert_eq!(blocks_in_budget(1 << 30, 64 << 10, 80, 2 * mib), 192);
        // Whatever the inputs, the rounded-up regions fit the budget.
        for (budget, bpl, layers, chunk) in [
            (10 * mib + 1, 3000, 3, 2 * mib),
            (mib, 4096, 1, 2 * mib),
            (0, 1, 1, 1),
            (usize::MAX / 2, 1 << 20, 80, 2 * mib),
        ] {
            let n = blocks_in_budget(budget, bpl, layers, chunk);
            assert!(layers * round_up((n * bpl).max(1), chunk) <= budget.max(layers * chunk));
            assert!(n * bpl * layers <= budget);
        }
        assert_eq!(blocks_in_budget(mib, 4096, 1, 2 * mib), 0);
    }
}
