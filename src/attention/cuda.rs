//! Paged-attention decode on the GPU: `kernels/paged_attention.cu` over a
//! [`CudaStorage`] arena.
//!
//! One launch of `paged_attention_decode` per layer and step in [`CudaAttention::decode`]:
//! a CTA per (KV head, work item) serves every query head of the GQA group from one load
//! of K/V. The [work list](super::cut_work_list) cuts each sequence's own live range at
//! the length the [occupancy-aware split planner](super::plan_splits_for_occupancy)
//! picks (or a forced split's); the last CTA of a sequence's chunks merges their
//! partials by log-sum-exp, in chunk order, in the same launch. The CUDA-graph step
//! ([`DecodeGraphStep`]) still uses the fixed (KV heads, batch, splits) grid and a
//! second launch (`paged_attention_merge`).
//!
//! Queries and outputs (`[batch, q_heads, head_dim]`) are `f32` in
//! [`CudaAttention::decode`], or f32, f16 or bf16 in [`CudaAttention::decode_io`] (the
//! kernel converts on load and store; a runtime argument, not a specialisation); the
//! log-sum-exp of each row is `f32`, in natural-log units, as the CPU reference does.
//!
//! ```no_run
//! # fn main() -> pagedkv::Result<()> {
//! use pagedkv::attention::cuda::{CudaAttention, Tables};
//! use pagedkv::attention::AttentionParams;
//! use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
//! use pagedkv::tables::PaddedTables;
//! use pagedkv::{DType, KvLayout, ModelShape};
//!
//! let shape = ModelShape { num_layers: 1, num_q_heads: 8, num_kv_heads: 2, head_dim: 128, kv_dtype: DType::BF16 };
//! let storage = CudaStorage::new(KvLayout::new(shape, 16)?, CudaStorageConfig::blocks(1024))?;
//! let mut attn = CudaAttention::new(&storage)?;
//! // One sequence of 20 tokens in blocks 7 and 3.
//! let tables = PaddedTables { tables: vec![7, 3], context_lens: vec![20], batch: 1, max_blocks: 2 };
//! let q = vec![0.1f32; 8 * 128];
//! let (out, lse) = attn.decode_host(&storage, 0, &q, Tables::Padded(&tables), &AttentionParams::new(128), None)?;
//! assert_eq!((out.len(), lse.len()), (8 * 128, 8));
//! # Ok(())
//! # }
//! ```

use super::{
    cut_work_list, plan_splits_for_occupancy, split_plan_with, validate_params, AttentionParams,
    SplitPlan,
};
use super::{StagedStep, StepCapacity, TableCapacity, STEP_HEADER_WORDS};
use crate::error::{Error, Result};
use crate::executor::cuda::{compile, driver_err, AttentionSpec, KernelSpec, ATTENTION_THREADS};
use crate::executor::storage::{CudaStorage, Storage};
use crate::layout::shape::DType;
use crate::tables::{validate_csr, validate_tables};
use crate::tables::{CsrTables, PaddedTables};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

/// Block tables of a batch, in either form the manager exports.
#[derive(Debug, Clone, Copy)]
pub enum Tables<'a> {
    /// `[batch, max_blocks]` plus context lengths (vLLM's form).
    Padded(&'a PaddedTables),
    /// `indptr` / `indices` / `last_page_len` (FlashInfer's form).
    Csr(&'a CsrTables),
}

/// Block tables validated against an arena and uploaded to the device, ready for any
/// number of launches (every layer of a step uses the same tables).
#[derive(Debug)]
pub struct DeviceTables {
    ids: CudaSlice<u32>,
    indptr: Option<CudaSlice<u32>>,
    lens: CudaSlice<u32>,
    batch: usize,
    row_stride: u32,
    max_context: usize,
    /// Each sequence's context length, for the split planner.
    context_lens: Vec<u32>,
    /// One past the largest block id the kernel may read.
    blocks_needed: usize,
    /// Element capacities of the buffers (at least what this batch uses).
    capacity: TableCapacity,
}

impl DeviceTables {
    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Longest context of the batch.
    pub fn max_context(&self) -> usize {
        self.max_context
    }
}

/// Queries of a decode call on the device, `[batch, q_heads, head_dim]`, in the
/// dtype the engine holds them in (16-bit ones as raw bits).
#[derive(Debug, Clone, Copy)]
pub enum Queries<'a> {
    /// `f32`.
    F32(&'a CudaSlice<f32>),
    /// IEEE half, as `u16` bits.
    F16(&'a CudaSlice<u16>),
    /// bfloat16, as `u16` bits.
    BF16(&'a CudaSlice<u16>),
}

/// Where a decode call writes its output, `[batch, q_heads, head_dim]` (16-bit dtypes
/// as raw bits, rounded to nearest even).
#[derive(Debug)]
pub enum Outputs<'a> {
    /// `f32`.
    F32(&'a mut CudaSlice<f32>),
    /// IEEE half, as `u16` bits.
    F16(&'a mut CudaSlice<u16>),
    /// bfloat16, as `u16` bits.
    BF16(&'a mut CudaSlice<u16>),
}

impl Queries<'_> {
    fn len(&self) -> usize {
        match self {
            Queries::F32(q) => q.len(),
            Queries::F16(q) | Queries::BF16(q) => q.len(),
        }
    }
    /// The kernels' io dtype code (the cache dtype codes of `kernels/common.cuh`).
    fn code(&self) -> u32 {
        match self {
            Queries::F32(_) => 0,
            Queries::F16(_) => 1,
            Queries::BF16(_) => 2,
        }
    }
}

impl Outputs<'_> {
    fn len(&self) -> usize {
        match self {
            Outputs::F32(o) => o.len(),
            Outputs::F16(o) | Outputs::BF16(o) => o.len(),
        }
    }
    fn code(&self) -> u32 {
        match self {
            Outputs::F32(_) => 0,
            Outputs::F16(_) => 1,
            Outputs::BF16(_) => 2,
        }
    }
}

/// Replaces `slot` with a zeroed buffer of `need` elements unless it holds at least
/// that many; on error `slot` is unchanged.
fn grow_zeroed<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    slot: &mut Option<CudaSlice<T>>,
    need: usize,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) -> Result<()> {
    if slot.as_ref().is_none_or(|b| b.len() < need) {
        *slot = Some(stream.alloc_zeros(need).map_err(driver_err("cuMemAlloc"))?);
    }
    Ok(())
}

/// Most items of one work-list launch: the grid's y dimension limit.
const MAX_GRID_ITEMS: usize = 65_535;

/// The decode kernels for one storage's layout, compiled and loaded.
#[derive(Debug)]
pub struct CudaAttention {
    spec: AttentionSpec,
    decode: CudaFunction,
    merge: CudaFunction,
    /// Work-list launch scratch, grown on demand: the list's words, the arrival
    /// counters (zeroed once per allocation; the kernel resets them), the partials.
    work_words: Option<CudaSlice<u32>>,
    counters: Option<CudaSlice<u32>>,
    part_out: Option<CudaSlice<f32>>,
    part_lse: Option<CudaSlice<f32>>,
    /// Dynamic shared memory of a decode launch (the tensor-core path's pipeline).
    shared_bytes: u32,
    /// Resident CTAs per SM of the decode kernel, as the driver reports it.
    ctas_per_sm: u32,
    /// The last ALiBi slopes uploaded, on the host and on the device.
    alibi: Option<(Vec<f32>, CudaSlice<f32>)>,
}

/// Validated tables on the host, ready to copy.
struct HostTables<'t> {
    ids: &'t [u32],
    indptr: Option<&'t [u32]>,
    lens: &'t [u32],
    batch: usize,
    row_stride: u32,
    max_context: usize,
    context_lens: Vec<u32>,
    blocks_needed: usize,
}

fn host_tables<'t>(storage: &CudaStorage, tables: Tables<'t>) -> Result<HostTables<'t>> {
    let layout = storage.layout();
    let bs = layout.block_size();
    let t = match tables {
        Tables::Padded(p) => {
            let max_context = validate_tables(layout, storage.num_blocks(), p)?;
            let rows = p
                .context_lens
                .iter()
                .enumerate()
                .map(|(i, &l)| (i * p.max_blocks, (l as usize).div_ceil(bs)));
            HostTables {
                ids: &p.tables,
                indptr: None,
                lens: &p.context_lens,
                batch: p.batch,
                row_stride: p.max_blocks as u32,
                max_context,
                context_lens: p.context_lens.clone(),
                blocks_needed: largest_read(&p.tables, rows),
            }
        }
        Tables::Csr(c) => {
            let max_context = validate_csr(layout, storage.num_blocks(), c)?;
            HostTables {
                ids: &c.indices,
                indptr: Some(&c.indptr),
                lens: &c.last_page_len,
                batch: c.last_page_len.len(),
                row_stride: 0,
                max_context,
                context_lens: (0..c.last_page_len.len())
                    .map(|i| {
                        let nb = c.indptr[i + 1] - c.indptr[i];
                        if nb == 0 {
                            0
                        } else {
                            (nb - 1) * bs as u32 + c.last_page_len[i]
                        }
                    })
                    .collect(),
                blocks_needed: c.indices.iter().map(|&b| b as usize + 1).max().unwrap_or(0),
            }
        }
    };
    if t.batch > 65535 {
        return Err(Error::ShapeMismatch {
            what: "sequences per launch (grid y limit)",
            expected: 65535,
            got: t.batch,
        });
    }
    Ok(t)
}

fn largest_read(ids: &[u32], rows: impl Iterator<Item = (usize, usize)>) -> usize {
    rows.flat_map(|(start, n)| ids[start..start + n].iter())
        .map(|&b| b as usize + 1)
        .max()
        .unwrap_or(0)
}

impl CudaAttention {
    /// Compiles (or fetches from the process cache) the specialisation for `storage`'s
    /// layout and loads it into its context.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a head size the kernel cannot take;
    /// [`Error::CudaUnavailable`] without NVRTC; [`Error::Cuda`].
    pub fn new(storage: &CudaStorage) -> Result<Self> {
        Self::with_spec(storage, AttentionSpec::for_layout(storage.layout()))
    }

    /// Like [`Self::new`] with a hand-tuned specialisation (another `unroll` or
    /// `vec_bytes`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `spec` does not describe the storage's layout;
    /// otherwise as [`Self::new`].
    pub fn with_spec(storage: &CudaStorage, spec: AttentionSpec) -> Result<Self> {
        if storage.layout().is_latent() {
            return Err(Error::Unsupported(
                "the standard paged decode kernel reads K and V; a latent (MLA) cache needs kernels/mla_decode.cu".into(),
            ));
        }
        let want = AttentionSpec {
            unroll: spec.unroll,
            vec_bytes: spec.vec_bytes,
            ..AttentionSpec::for_layout(storage.layout())
        };
        if spec != want {
            return Err(Error::config(
                "spec",
                format!("{spec:?} does not match the storage's layout, which needs {want:?}"),
            ));
        }
        let module = compile(&KernelSpec::Attention(spec), storage.device().arch)?;
        let loaded = storage
            .context()
            .load_module(cudarc::nvrtc::Ptx::from_binary(module.cubin.clone()))
            .map_err(driver_err("cuModuleLoadData(paged_attention)"))?;
        let f = |n: &str| {
            loaded
                .load_function(n)
                .map_err(driver_err("cuModuleGetFunction"))
        };
        let decode = f("paged_attention_decode")?;
        let shared_bytes = super::decode_mma::decode_dynamic_shared_bytes(
            spec.dtype,
            spec.gqa_group,
            spec.head_dim,
            spec.block_size,
        ) as u32;
        if shared_bytes > 48 * 1024 {
            decode
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_bytes as i32,
                )
                .map_err(driver_err("cuFuncSetAttribute(max dynamic shared memory)"))?;
        }
        let ctas_per_sm = decode
            .occupancy_max_active_blocks_per_multiprocessor(
                ATTENTION_THREADS,
                shared_bytes as usize,
                None,
            )
            .map_err(driver_err("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        if ctas_per_sm == 0 {
            return Err(Error::Unsupported(format!(
                "the decode kernel for {spec:?} does not fit on an SM ({shared_bytes} bytes of dynamic shared memory)"
            )));
        }
        Ok(CudaAttention {
            spec,
            ctas_per_sm,
            decode,
            merge: f("paged_attention_merge")?,
            work_words: None,
            counters: None,
            part_out: None,
            part_lse: None,
            shared_bytes,
            alibi: None,
        })
    }

    /// The compiled specialisation.
    pub fn spec(&self) -> AttentionSpec {
        self.spec
    }

    /// Validates `tables` against `storage`'s arena (see
    /// [`crate::tables::validate_tables`]) and uploads them into new buffers of exactly
    /// their size.
    ///
    /// # Errors
    /// The validation errors; [`Error::ShapeMismatch`] for a batch over 65535 (the grid's
    /// y limit); [`Error::Cuda`].
    pub fn upload_tables(&self, storage: &CudaStorage, tables: Tables<'_>) -> Result<DeviceTables> {
        let h = host_tables(storage, tables)?;
        let stream = storage.compute_stream();
        let up = |v: &[u32]| {
            stream
                .clone_htod(if v.is_empty() { &[0u32][..] } else { v })
                .map_err(driver_err("cuMemcpyHtoDAsync(tables)"))
        };
        let ids = up(h.ids)?;
        let indptr = h.indptr.map(up).transpose()?;
        let lens = up(h.lens)?;
        let capacity = TableCapacity {
            ids: ids.len(),
            lens: lens.len(),
            indptr: indptr.as_ref().map_or(0, |p| p.len()),
        };
        Ok(DeviceTables {
            ids,
            indptr,
            lens,
            batch: h.batch,
            row_stride: h.row_stride,
            max_context: h.max_context,
            context_lens: h.context_lens,
            blocks_needed: h.blocks_needed,
            capacity,
        })
    }

    /// Like [`Self::upload_tables`], into `dst`'s buffers: a step whose tables fit
    /// them allocates nothing (the buffers keep their capacity, grown by
    /// [`TableCapacity::grow_for`], powers of two, when a step needs more). Returns
    /// whether it allocated. The copy is still from pageable host memory, so the call
    /// is not capturable in a CUDA graph.
    ///
    /// # Errors
    /// As [`Self::upload_tables`]; `dst` is unchanged on a validation error.
    pub fn upload_tables_into(
        &self,
        storage: &CudaStorage,
        tables: Tables<'_>,
        dst: &mut DeviceTables,
    ) -> Result<bool> {
        let h = host_tables(storage, tables)?;
        let stream = storage.compute_stream();
        let need = TableCapacity {
            ids: h.ids.len().max(1),
            lens: h.lens.len().max(1),
            indptr: h.indptr.map_or(0, |p| p.len()),
        };
        let (capacity, grown) = dst.capacity.grow_for(need);
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<u32>(n)
                .map_err(driver_err("cuMemAlloc(tables)"))
        };
        if capacity.ids > dst.capacity.ids {
            dst.ids = alloc(capacity.ids)?;
        }
        if capacity.lens > dst.capacity.lens {
            dst.lens = alloc(capacity.lens)?;
        }
        if capacity.indptr > dst.capacity.indptr || (h.indptr.is_some() && dst.indptr.is_none()) {
            dst.indptr = Some(alloc(capacity.indptr.max(need.indptr))?);
        }
        dst.capacity = capacity;
        let copy = |src: &[u32], d: &mut CudaSlice<u32>| {
            if src.is_empty() {
                return Ok(());
            }
            stream
                .memcpy_htod(src, d)
                .map_err(driver_err("cuMemcpyHtoDAsync(tables)"))
        };
        copy(h.ids, &mut dst.ids)?;
        copy(h.lens, &mut dst.lens)?;
        match (h.indptr, &mut dst.indptr) {
            (Some(src), Some(d)) => copy(src, d)?,
            (None, _) => {}
            (Some(_), None) => return Err(Error::Cuda("indptr buffer missing".into())),
        }
        // The kernel tells padded from CSR tables by a null indptr.
        if h.indptr.is_none() {
            dst.indptr = None;
            dst.capacity.indptr = 0;
        }
        dst.batch = h.batch;
        dst.row_stride = h.row_stride;
        dst.max_context = h.max_context;
        dst.context_lens.clear();
        dst.context_lens.extend_from_slice(&h.context_lens);
        dst.blocks_needed = h.blocks_needed;
        Ok(grown)
    }

    /// Resident CTAs per SM of the decode kernel, from the driver
    /// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`, with its dynamic shared memory).
    pub fn ctas_per_sm(&self) -> u32 {
        self.ctas_per_sm
    }

    /// The split plan the planner picks for these tables on this device (no window).
    pub fn plan(&self, storage: &CudaStorage, tables: &DeviceTables) -> SplitPlan {
        self.plan_windowed(storage, tables, None)
    }

    /// [`super::plan_splits_for_occupancy`] over the tables' own context lengths, the
    /// window, and the driver's occupancy for this kernel.
    pub fn plan_windowed(
        &self,
        storage: &CudaStorage,
        tables: &DeviceTables,
        sliding_window: Option<usize>,
    ) -> SplitPlan {
        plan_splits_for_occupancy(
            &tables.context_lens,
            sliding_window,
            storage.layout().shape().num_kv_heads,
            storage.layout().block_size(),
            storage.device().num_sms,
            self.ctas_per_sm as usize,
        )
    }

    /// Enqueues decode attention for one layer on the storage's compute stream:
    /// `out[b, h, :]` = softmax over the context of `q[b, h, :] . k` (scaled, plus
    /// ALiBi, inside the sliding window) times `v`, and `lse[b, h]` its log-sum-exp.
    /// `splits`: `None` lets the planner choose; `Some(n)` forces `n` splits.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for short buffers or a bad layer; parameter and table
    /// errors; [`Error::BlockOutOfRange`] when the arena shrank below the tables since
    /// they were uploaded; [`Error::Cuda`]. Nothing is enqueued on error.
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &mut self,
        storage: &CudaStorage,
        layer: usize,
        q: &CudaSlice<f32>,
        tables: &DeviceTables,
        params: &AttentionParams,
        splits: Option<u32>,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<SplitPlan> {
        self.decode_io(
            storage,
            layer,
            Queries::F32(q),
            tables,
            params,
            splits,
            Outputs::F32(out),
            lse,
        )
    }

    /// [`Self::decode`] with queries and outputs in f32, f16 or bf16 (`lse` stays f32).
    /// The kernel converts q once as it loads it and rounds the output once as it
    /// stores it; split partials stay f32.
    ///
    /// # Errors
    /// As [`Self::decode`].
    #[allow(clippy::too_many_arguments)]
    pub fn decode_io(
        &mut self,
        storage: &CudaStorage,
        layer: usize,
        q: Queries<'_>,
        tables: &DeviceTables,
        params: &AttentionParams,
        splits: Option<u32>,
        out: Outputs<'_>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<SplitPlan> {
        let stream = storage.compute_stream().clone();
        self.decode_io_on(storage, &stream, layer, q, tables, params, splits, out, lse)
    }

    /// [`Self::decode_io`] enqueued on the caller's `stream` (of the storage's
    /// context) instead of the storage's compute stream. Ordered by events, with no
    /// host synchronisation: the stream first waits, on the GPU, for the writes queued
    /// on the compute stream so far and for the last swap that touched `layer`
    /// ([`CudaStorage::order_read_on`]); after the launch the stream's point goes into
    /// the storage's ledger of foreign readers ([`CudaStorage::record_read_on`]), so
    /// the storage's later writes, swaps, shrinks and drop wait for this read. Ordering
    /// against the buffers' other streams is cudarc's event tracking.
    ///
    /// # Errors
    /// As [`Self::decode`]; an [`Error::Cuda`] from recording the read comes after the
    /// launch was enqueued.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_io_on(
        &mut self,
        storage: &CudaStorage,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        layer: usize,
        q: Queries<'_>,
        tables: &DeviceTables,
        params: &AttentionParams,
        splits: Option<u32>,
        mut out: Outputs<'_>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<SplitPlan> {
        let layout = *storage.layout();
        let shape = layout.shape();
        validate_params(&layout, params)?;
        let region = storage.region_ptr(layer)?;
        if tables.blocks_needed > storage.num_blocks() {
            return Err(Error::BlockOutOfRange {
                block: crate::ids::BlockId(tables.blocks_needed as u32 - 1),
                num_blocks: storage.num_blocks(),
            });
        }
        let rows = tables.batch * shape.num_q_heads;
        let elems = rows * shape.head_dim;
        for (what, expected, got) in [
            ("query elements", elems, q.len()),
            ("output elements", elems, out.len()),
            ("log-sum-exp entries", rows, lse.len()),
        ] {
            if got < expected {
                return Err(Error::ShapeMismatch {
                    what,
                    expected,
                    got,
                });
            }
        }
        let plan = match splits {
            Some(n) => split_plan_with(tables.max_context, layout.block_size(), n)?,
            None => self.plan_windowed(storage, tables, params.sliding_window),
        };
        if tables.batch == 0 {
            return Ok(plan);
        }
        let fp8 = shape.kv_dtype == DType::Fp8E4M3;
        let scale_log2 =
            params.scale * if fp8 { params.k_scale } else { 1.0 } * std::f32::consts::LOG2_E;
        let v_scale = if fp8 { params.v_scale } else { 1.0 };
        let window = params.sliding_window.unwrap_or(0) as u32;
        // ALiBi slopes go to the device once per distinct slope vector, not per call.
        if let Some(s) = &params.alibi_slopes {
            if self.alibi.as_ref().is_none_or(|(host, _)| host != s) {
                let dev = stream
                    .clone_htod(s)
                    .map_err(driver_err("cuMemcpyHtoDAsync(alibi)"))?;
                self.alibi = Some((s.clone(), dev));
            }
        }
        let alibi = match (&params.alibi_slopes, &self.alibi) {
            (Some(_), Some((_, dev))) => Some(dev),
            _ => None,
        };
        // The work list: each sequence's own live range cut at the plan's length, one
        // CTA per (KV head, item); the last CTA of a sequence merges (no second launch).
        let work = cut_work_list(
            &tables.context_lens,
            params.sliding_window,
            layout.block_size(),
            plan.tokens_per_split,
            MAX_GRID_ITEMS,
        )?;
        let words = work.device_words();
        let need = work.buffers(shape.num_kv_heads, shape.num_q_heads, shape.head_dim);
        // Counters are zeroed once per allocation: every merging CTA resets its own.
        grow_zeroed(&mut self.work_words, need.words, stream)?;
        grow_zeroed(&mut self.counters, need.counters, stream)?;
        grow_zeroed(&mut self.part_out, need.part_out, stream)?;
        grow_zeroed(&mut self.part_lse, need.part_lse, stream)?;
        let (Some(wd), Some(ctr), Some(po), Some(pl)) = (
            &mut self.work_words,
            &mut self.counters,
            &mut self.part_out,
            &mut self.part_lse,
        ) else {
            return Err(Error::Cuda("work-list scratch missing".into()));
        };
        stream
            .memcpy_htod(&words, wd)
            .map_err(driver_err("cuMemcpyHtoDAsync(work list)"))?;
        storage.order_read_on(stream, layer)?;
        let s = layout.strides();
        let (sb, skv, sh, st) = (s.block as u64, s.kv as u64, s.head as u64, s.token as u64);
        let null = 0u64;
        let cfg = LaunchConfig {
            grid_dim: (shape.num_kv_heads as u32, work.items.len() as u32, 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: self.shared_bytes,
        };
        let (q_code, out_code) = (q.code(), out.code());
        let mut b = stream.launch_builder(&self.decode);
        match &mut out {
            Outputs::F32(o) => b.arg(&mut **o),
            Outputs::F16(o) | Outputs::BF16(o) => b.arg(&mut **o),
        };
        b.arg(&mut *lse);
        match q {
            Queries::F32(q) => b.arg(q),
            Queries::F16(q) | Queries::BF16(q) => b.arg(q),
        };
        b.arg(&region).arg(&tables.ids);
        match &tables.indptr {
            Some(p) => b.arg(p),
            None => b.arg(&null),
        };
        b.arg(&tables.lens)
            .arg(&tables.row_stride)
            .arg(&sb)
            .arg(&skv)
            .arg(&sh)
            .arg(&st);
        match alibi {
            Some(a) => b.arg(a),
            None => b.arg(&null),
        };
        b.arg(&scale_log2)
            .arg(&v_scale)
            .arg(&window)
            .arg(&plan.tokens_per_split)
            .arg(&plan.num_splits)
            .arg(&q_code)
            .arg(&out_code)
            .arg(&null) // no step words: the work list decides
            .arg(&*wd)
            .arg(&mut *ctr)
            .arg(&mut *po)
            .arg(&mut *pl);
        // SAFETY: arguments match `paged_attention_decode` (kernels/paged_attention.cu)
        // compiled for this layout's head dim, block size, group and dtype, and the
        // dynamic shared memory is what its path needs (`decode_dynamic_shared_bytes`
        // mirrors the kernel's `DECODE_MMA` and `MMA_STAGES`); `q_code` and `out_code`
        // name the element types of `q` and `out`, so the kernel reads and writes whole
        // elements (partials are f32). Bounds: the grid is (KV heads, items) and `wd`
        // holds the list's `(items + 1) * 4` words (uploaded above, stream-ordered
        // before the launch); each item's sequence is below the batch, so its output
        // rows are inside `q`, `out`, `lse` (checked above to hold batch * q_heads
        // rows) and its counter inside `ctr` (batch * KV heads, zeroed when allocated,
        // reset by each merging CTA); partial rows `item * q_heads + h` are inside
        // `po`/`pl` (items * q_heads rows); the tables were validated at upload so that
        // every entry read (the first ceil(len / block_size) of each row) is below the
        // arena's block count, which is still at least `blocks_needed` (checked
        // above), and each item's token range lies inside its sequence's context;
        // cache offsets use the layout's strides, so reads stay inside the region.
        let launched = unsafe { b.launch(cfg) };
        if let Err(e) = launched {
            // The counters are only reset by the merging CTAs of a launch that ran to
            // the end; after a failed launch their state is unknown, so the next call
            // allocates them zeroed again.
            self.counters = None;
            return Err(driver_err("cuLaunchKernel(paged_attention_decode)")(e));
        }
        storage.record_read_on(stream)?;
        Ok(plan)
    }

    /// [`Self::decode`] from and to host memory, waiting for the result: uploads `q`
    /// and the tables, runs, and returns `(out, lse)`. For tests and tools; an engine
    /// keeps its buffers on the device.
    ///
    /// # Errors
    /// As [`Self::decode`] and [`Self::upload_tables`].
    pub fn decode_host(
        &mut self,
        storage: &CudaStorage,
        layer: usize,
        q: &[f32],
        tables: Tables<'_>,
        params: &AttentionParams,
        splits: Option<u32>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let t = self.upload_tables(storage, tables)?;
        let shape = storage.layout().shape();
        let rows = t.batch * shape.num_q_heads;
        let stream = storage.compute_stream();
        if q.len() != rows * shape.head_dim {
            return Err(Error::ShapeMismatch {
                what: "query elements",
                expected: rows * shape.head_dim,
                got: q.len(),
            });
        }
        let q_or_pad: &[f32] = if q.is_empty() { &[0.0] } else { q };
        let d_q = stream
            .clone_htod(q_or_pad)
            .map_err(driver_err("cuMemcpyHtoDAsync(q)"))?;
        let mut out = stream
            .alloc_zeros::<f32>((rows * shape.head_dim).max(1))
            .map_err(driver_err("cuMemAlloc"))?;
        let mut lse = stream
            .alloc_zeros::<f32>(rows.max(1))
            .map_err(driver_err("cuMemAlloc"))?;
        self.decode(storage, layer, &d_q, &t, params, splits, &mut out, &mut lse)?;
        let mut o = stream
            .clone_dtoh(&out)
            .map_err(driver_err("cuMemcpyDtoH"))?;
        let mut l = stream
            .clone_dtoh(&lse)
            .map_err(driver_err("cuMemcpyDtoH"))?;
        stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        o.truncate(rows * shape.head_dim);
        l.truncate(rows);
        Ok((o, l))
    }
}

/// Raw device addresses of a [`DecodeGraphStep`]'s buffers, taken once at
/// construction: the step's launches and copies pass these instead of the
/// [`CudaSlice`]s, so cudarc records and waits on no event for them (its event
/// tracking is per slice use, and events cannot be waited on inside a capture).
#[derive(Debug, Clone, Copy)]
struct StepPtrs {
    step: u64,
    q: u64,
    out: u64,
    lse: u64,
    part_out: u64,
    part_lse: u64,
    alibi: u64,
}

/// A decode step that can be captured in a CUDA graph and replayed: built once with
/// fixed [`StepCapacity`]s, it owns every buffer a step touches (the staged tables and
/// context lengths, f32 queries and outputs, the split partials) plus pinned host
/// staging, and its launches use a grid of (KV heads, `max_batch`, `max_splits`) whatever
/// the batch. The batch, lengths and split cut are words in device memory that the
/// kernels read; CTAs past a sequence's batch index or splits return at once.
///
/// Per step the host only writes pinned memory ([`Self::stage`],
/// [`Self::stage_queries`]); the device half ([`Self::enqueue_upload`],
/// [`Self::enqueue_decode`], or the whole step as a graph: [`Self::capture`],
/// [`Self::replay`]) enqueues `cuMemcpyHtoDAsync` from that pinned memory and the
/// decode and merge kernels on the step's stream: no allocation, no pageable upload, no
/// host synchronisation.
///
/// Ordering with the storage is by events, outside the graph: [`Self::replay`], and
/// [`Self::enqueue_decode`] on a stream that is not capturing, make the step's stream
/// wait for the compute stream's writes and the layers' last swaps before the step
/// ([`CudaStorage::order_read_on`]) and record the step's reads in the storage's ledger
/// of foreign readers after it ([`CudaStorage::record_read_on`]), so later writes,
/// swaps and shrinks wait for the step. Inside an engine's own capture (a stream that is
/// capturing) [`Self::enqueue_decode`] can do neither (an event recorded outside a
/// capture cannot be waited on inside it): the engine calls [`Self::order_reads`]
/// before launching its graph and [`Self::record_reads`] after.
///
/// Contract (the caller's, not checked): stage a new step only after the previous
/// step's upload has run on the stream (a decode loop's wait for its sampled tokens
/// orders this). Breaking it gives wrong results, not out-of-bounds reads: every word
/// ever staged is in bounds (see [`super::stage_decode_step`]).
///
/// Dropping the step synchronises its stream first: its copies read the pinned staging
/// through raw pointers, which no cudarc event guards. A failure of that wait cannot be
/// returned from `drop`; it is recorded in the context ([`cudarc::driver::CudaContext::check_err`]
/// returns it, and the next cudarc call on the context fails with it).
pub struct DecodeGraphStep {
    /// Dropped first: the graph names the buffers below.
    graph: Option<(cudarc::driver::CudaGraph, Vec<(usize, u64)>)>,
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    decode: CudaFunction,
    merge: CudaFunction,
    shared_bytes: u32,
    layout: crate::layout::KvLayout,
    params: AttentionParams,
    cap: StepCapacity,
    num_sms: usize,
    ctas_per_sm: usize,
    staging: cudarc::driver::PinnedHostSlice<u32>,
    q_staging: cudarc::driver::PinnedHostSlice<f32>,
    /// Host addresses of `staging` and `q_staging`, taken once: cudarc's accessors
    /// wait on the slice's event first, a driver call that has no place in a step (or
    /// in a capture). Addresses, not pointers, keep the step `Send`.
    staging_addr: usize,
    q_staging_addr: usize,
    staged: StagedStep,
    ptrs: StepPtrs,
    // Owned for their lifetime only; used through `ptrs`.
    _step_dev: CudaSlice<u32>,
    q: CudaSlice<f32>,
    out: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    _part_out: CudaSlice<f32>,
    _part_lse: CudaSlice<f32>,
    _alibi: Option<CudaSlice<f32>>,
}

impl std::fmt::Debug for DecodeGraphStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraphStep")
            .field("cap", &self.cap)
            .field("staged", &self.staged)
            .field("captured", &self.graph.is_some())
            .finish_non_exhaustive()
    }
}

impl CudaAttention {
    /// Builds a [`DecodeGraphStep`] for `storage`'s layout on `stream` (of the storage's
    /// context) with fixed capacities and attention parameters (ALiBi slopes are
    /// uploaded here, once). Allocates every buffer, zeroes them, and waits for the
    /// stream once; no later step allocates. The split scratch is
    /// `max_batch * q_heads * max_splits * (head_dim + 1)` f32s: size `max_splits` to
    /// what the planner picks for the longest batch the engine runs.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for capacities [`StepCapacity::validate`] refuses and
    /// for bad parameters ([`super::validate_params`]); [`Error::Cuda`].
    pub fn graph_step(
        &self,
        storage: &CudaStorage,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        cap: StepCapacity,
        params: &AttentionParams,
    ) -> Result<DecodeGraphStep> {
        use cudarc::driver::DevicePtr;
        let layout = *storage.layout();
        validate_params(&layout, params)?;
        cap.validate(layout.block_size())?;
        let shape = layout.shape();
        let rows = cap.max_batch * shape.num_q_heads;
        let elems = rows * shape.head_dim;
        let part_rows = rows * cap.max_splits as usize;
        let zeros_u32 = |n: usize| {
            stream
                .alloc_zeros::<u32>(n)
                .map_err(driver_err("cuMemAlloc(step)"))
        };
        let zeros = |n: usize| {
            stream
                .alloc_zeros::<f32>(n)
                .map_err(driver_err("cuMemAlloc(step)"))
        };
        let step_dev = zeros_u32(cap.staging_words())?;
        let q = zeros(elems)?;
        let out = zeros(elems)?;
        let lse = zeros(rows)?;
        let part_out = zeros(part_rows * shape.head_dim)?;
        let part_lse = zeros(part_rows)?;
        let alibi = params
            .alibi_slopes
            .as_ref()
            .map(|s| {
                stream
                    .clone_htod(s)
                    .map_err(driver_err("cuMemcpyHtoDAsync(alibi)"))
            })
            .transpose()?;
        let ctx = storage.context();
        // SAFETY: pinned allocations of `u32`/`f32`, for which every bit pattern is
        // valid; both are filled with zeros below before any read.
        let (mut staging, mut q_staging) = unsafe {
            (
                ctx.alloc_pinned::<u32>(cap.staging_words())
                    .map_err(driver_err("cuMemHostAlloc(step staging)"))?,
                ctx.alloc_pinned::<f32>(elems)
                    .map_err(driver_err("cuMemHostAlloc(query staging)"))?,
            )
        };
        staging
            .as_mut_slice()
            .map_err(driver_err("cuEventSynchronize"))?
            .fill(0);
        q_staging
            .as_mut_slice()
            .map_err(driver_err("cuEventSynchronize"))?
            .fill(0.0);
        let staging_addr = staging
            .as_mut_ptr()
            .map_err(driver_err("cuEventSynchronize"))? as usize;
        let q_staging_addr = q_staging
            .as_mut_ptr()
            .map_err(driver_err("cuEventSynchronize"))? as usize;
        let ptr = |s: &CudaSlice<f32>| s.device_ptr(stream).0;
        let ptrs = StepPtrs {
            step: step_dev.device_ptr(stream).0,
            q: ptr(&q),
            out: ptr(&out),
            lse: ptr(&lse),
            part_out: ptr(&part_out),
            part_lse: ptr(&part_lse),
            alibi: alibi.as_ref().map_or(0, ptr),
        };
        // The allocations and zero fills are on `stream`; the steps use the buffers
        // there too, but an engine may read `out` elsewhere first.
        stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        Ok(DecodeGraphStep {
            graph: None,
            stream: stream.clone(),
            decode: self.decode.clone(),
            merge: self.merge.clone(),
            shared_bytes: self.shared_bytes,
            layout,
            params: params.clone(),
            cap,
            num_sms: storage.device().num_sms,
            ctas_per_sm: self.ctas_per_sm as usize,
            staging,
            q_staging,
            staging_addr,
            q_staging_addr,
            staged: StagedStep {
                batch: 0,
                max_context: 0,
                plan: SplitPlan {
                    num_splits: 1,
                    tokens_per_split: layout.block_size() as u32,
                },
                blocks_needed: 0,
            },
            ptrs,
            _step_dev: step_dev,
            q,
            out,
            lse,
            _part_out: part_out,
            _part_lse: part_lse,
            _alibi: alibi,
        })
    }
}

impl DecodeGraphStep {
    fn staging_mut(&mut self) -> &mut [u32] {
        // SAFETY: `staging_addr` is the start of `self.staging`, a live pinned
        // allocation of `staging.len()` u32s (any bits valid, zeroed at construction)
        // owned by `self`; `&mut self` makes this the only host reference.
        unsafe { std::slice::from_raw_parts_mut(self.staging_addr as *mut u32, self.staging.len()) }
    }

    fn q_staging_mut(&mut self) -> &mut [f32] {
        // SAFETY: as `staging_mut`, for `q_staging`.
        unsafe {
            std::slice::from_raw_parts_mut(self.q_staging_addr as *mut f32, self.q_staging.len())
        }
    }

    /// The capacities the step was built with.
    pub fn capacity(&self) -> StepCapacity {
        self.cap
    }

    /// What the last successful [`Self::stage`] wrote (batch 0 before the first).
    pub fn staged(&self) -> StagedStep {
        self.staged
    }

    /// The host half of a step: validates `tables` against `storage`'s arena and the
    /// capacities and writes them, with the split plan, into the pinned staging buffer
    /// ([`super::stage_decode_step`]; no allocation, no device call).
    ///
    /// # Errors
    /// As [`super::stage_decode_step`]; the staging buffer is unchanged on error.
    pub fn stage(&mut self, storage: &CudaStorage, tables: &PaddedTables) -> Result<StagedStep> {
        if *storage.layout() != self.layout {
            return Err(Error::config(
                "storage",
                "not the layout this step was built for".to_string(),
            ));
        }
        let (layout, cap, window) = (self.layout, self.cap, self.params.sliding_window);
        let (num_sms, ctas_per_sm) = (self.num_sms, self.ctas_per_sm);
        let staged = super::stage_decode_step(
            &layout,
            storage.num_blocks(),
            &cap,
            tables,
            window,
            num_sms,
            ctas_per_sm,
            self.staging_mut(),
        )?;
        self.staged = staged;
        Ok(staged)
    }

    /// Writes f32 queries `[batch, q_heads, head_dim]` (at most `max_batch` rows of
    /// sequences) into the pinned query staging; [`Self::enqueue_upload_queries`]
    /// copies them. Engines whose queries are already on the device write
    /// [`Self::queries_mut`] instead.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for more elements than the capacity holds.
    pub fn stage_queries(&mut self, q: &[f32]) -> Result<()> {
        let dst = self.q_staging_mut();
        if q.len() > dst.len() {
            return Err(Error::ShapeMismatch {
                what: "query elements (max_batch * q_heads * head_dim)",
                expected: dst.len(),
                got: q.len(),
            });
        }
        dst[..q.len()].copy_from_slice(q);
        Ok(())
    }

    /// The device queries the step reads, `[max_batch, q_heads, head_dim]` f32.
    pub fn queries_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.q
    }

    /// The outputs `[max_batch, q_heads, head_dim]` and log-sum-exps
    /// `[max_batch, q_heads]` of the last step run (rows past its batch are stale).
    pub fn outputs(&self) -> (&CudaSlice<f32>, &CudaSlice<f32>) {
        (&self.out, &self.lse)
    }

    /// Enqueues the copy of the whole staging buffer (header, lengths, tables) from
    /// pinned memory to the device on the step's stream. Capturable.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn enqueue_upload(&self) -> Result<()> {
        let stream = &self.stream;
        // SAFETY: see `staging_mut`; `&self` excludes host writes while it is borrowed.
        let src = unsafe {
            std::slice::from_raw_parts(self.staging_addr as *const u32, self.staging.len())
        };
        // SAFETY: `ptrs.step` is the step's own device buffer of exactly
        // `staging_words` u32s (allocated with the same capacity), alive while `self`
        // is; `src` is pinned, so the asynchronous copy reads it in place, and it lives
        // as long as `self` (the caller's contract orders host rewrites after the copy).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.ptrs.step, src, stream.cu_stream())
        }
        .map_err(driver_err("cuMemcpyHtoDAsync(step staging)"))
    }

    /// Enqueues the copy of the whole query staging (see [`Self::stage_queries`]) to
    /// the device queries on the step's stream. Capturable.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn enqueue_upload_queries(&self) -> Result<()> {
        // SAFETY: see `q_staging_mut`; `&self` excludes host writes while borrowed.
        let src = unsafe {
            std::slice::from_raw_parts(self.q_staging_addr as *const f32, self.q_staging.len())
        };
        // SAFETY: `ptrs.q` is the step's query buffer, `max_batch * q_heads * head_dim`
        // f32s, the same length as the pinned `src`; both live as long as `self`.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.ptrs.q, src, self.stream.cu_stream())
        }
        .map_err(driver_err("cuMemcpyHtoDAsync(query staging)"))
    }

    fn check_storage(&self, storage: &CudaStorage) -> Result<()> {
        if *storage.layout() != self.layout {
            return Err(Error::config(
                "storage",
                "not the layout this step was built for".to_string(),
            ));
        }
        if self.staged.blocks_needed > storage.num_blocks() {
            return Err(Error::BlockOutOfRange {
                block: crate::ids::BlockId(self.staged.blocks_needed as u32 - 1),
                num_blocks: storage.num_blocks(),
            });
        }
        Ok(())
    }

    /// Enqueues decode attention for `layer` over the staged step: the decode kernel on
    /// the fixed grid, then the merge (always, so that the launch does not depend on
    /// the split count; with one split it copies the row exactly). Reads the device
    /// staging and queries, writes [`Self::outputs`]. On a stream that is not
    /// capturing, ordered after the storage's writes and swaps and recorded as a
    /// foreign read; capturable, and then the engine orders the graph's launches
    /// ([`Self::order_reads`], [`Self::record_reads`]).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a bad layer; [`Error::BlockOutOfRange`] when the
    /// arena shrank below the staged tables; [`Error::InvalidConfig`] for another
    /// layout's storage; [`Error::Cuda`]. No kernel is enqueued on a validation error.
    pub fn enqueue_decode(&self, storage: &CudaStorage, layer: usize) -> Result<()> {
        self.check_storage(storage)?;
        let region = storage.region_ptr(layer)?;
        let capturing = self
            .stream
            .capture_status()
            .map_err(driver_err("cuStreamIsCapturing"))?
            != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if capturing {
            return self.launch(region);
        }
        storage.order_read_on(&self.stream, layer)?;
        self.launch(region)?;
        storage.record_read_on(&self.stream)
    }

    /// Makes the step's stream wait, on the GPU, for the writes queued on `storage`'s
    /// compute stream so far and for the last swaps of `layers`
    /// ([`CudaStorage::order_read_on`]). [`Self::replay`] does this itself; an engine
    /// that captures [`Self::enqueue_decode`] into its own graph calls it before each
    /// launch of that graph.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a bad layer; [`Error::Cuda`].
    pub fn order_reads(&self, storage: &CudaStorage, layers: &[usize]) -> Result<()> {
        layers
            .iter()
            .try_for_each(|&l| storage.order_read_on(&self.stream, l))
    }

    /// Records the reads enqueued on the step's stream so far in `storage`'s ledger of
    /// foreign readers ([`CudaStorage::record_read_on`]), so its later writes, swaps and
    /// shrinks wait for them. [`Self::replay`] does this itself; see
    /// [`Self::order_reads`].
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn record_reads(&self, storage: &CudaStorage) -> Result<()> {
        storage.record_read_on(&self.stream)
    }

    fn launch(&self, region: u64) -> Result<()> {
        let shape = self.layout.shape();
        let p = &self.params;
        let fp8 = shape.kv_dtype == DType::Fp8E4M3;
        let scale_log2 = p.scale * if fp8 { p.k_scale } else { 1.0 } * std::f32::consts::LOG2_E;
        let v_scale = if fp8 { p.v_scale } else { 1.0 };
        let window = p.sliding_window.unwrap_or(0) as u32;
        let s = self.layout.strides();
        let (sb, skv, sh, st) = (s.block as u64, s.kv as u64, s.head as u64, s.token as u64);
        let (null, zero, f32_code) = (0u64, 0u32, 0u32);
        let lens = self.ptrs.step + (STEP_HEADER_WORDS * 4) as u64;
        let ids = lens + (self.cap.max_batch * 4) as u64;
        let row_stride = self.cap.max_blocks_per_seq as u32;
        let cfg = LaunchConfig {
            grid_dim: (
                shape.num_kv_heads as u32,
                self.cap.max_batch as u32,
                self.cap.max_splits,
            ),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: self.shared_bytes,
        };
        let mut b = self.stream.launch_builder(&self.decode);
        b.arg(&self.ptrs.part_out)
            .arg(&self.ptrs.part_lse)
            .arg(&self.ptrs.q)
            .arg(&region)
            .arg(&ids)
            .arg(&null)
            .arg(&lens)
            .arg(&row_stride)
            .arg(&sb)
            .arg(&skv)
            .arg(&sh)
            .arg(&st)
            .arg(&self.ptrs.alibi)
            .arg(&scale_log2)
            .arg(&v_scale)
            .arg(&window)
            .arg(&zero)
            .arg(&zero)
            .arg(&f32_code)
            .arg(&f32_code)
            .arg(&self.ptrs.step)
            // The fixed grid, not the work list: its counters and partials unused.
            .arg(&null)
            .arg(&null)
            .arg(&null)
            .arg(&null);
        // SAFETY: arguments match `paged_attention_decode` compiled for this layout
        // (the step was built from its `CudaAttention`), with the dynamic shared memory
        // its path needs; every pointer is raw (no cudarc event) and names a buffer
        // owned by `self` or the layer's mapped region. Bounds: with `step` non-null
        // the kernel reads [batch, tokens_per_split, num_splits] from the staged
        // header and returns from every CTA with y >= batch or z >= num_splits, and
        // every staged header has batch <= max_batch (the grid's y) and num_splits <=
        // max_splits (its z) (`stage_decode_step` checks); so the partials it writes,
        // rows (seq * q_heads + h) * num_splits + split, lie in the scratch of
        // max_batch * q_heads * max_splits rows. Lengths are read at
        // `lens[seq]`, seq < max_batch, ids at `seq * max_blocks_per_seq + i` for
        // i < ceil(len / block_size) <= max_blocks_per_seq, and every staged id is
        // below `blocks_needed`, at most the arena's block count (checked above).
        unsafe { b.launch(cfg) }.map_err(driver_err("cuLaunchKernel(paged_attention_decode)"))?;
        let cfg = LaunchConfig {
            grid_dim: (shape.num_q_heads as u32, self.cap.max_batch as u32, 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut m = self.stream.launch_builder(&self.merge);
        m.arg(&self.ptrs.out)
            .arg(&self.ptrs.lse)
            .arg(&self.ptrs.part_out)
            .arg(&self.ptrs.part_lse)
            .arg(&zero)
            .arg(&f32_code)
            .arg(&self.ptrs.step);
        // SAFETY: arguments match `paged_attention_merge`; every CTA with y >= the
        // staged batch returns, the others read `num_splits` (<= max_splits) partial
        // rows of the scratch written above and write one row of `out` and `lse`
        // (max_batch * q_heads rows each, f32).
        unsafe { m.launch(cfg) }.map_err(driver_err("cuLaunchKernel(paged_attention_merge)"))?;
        Ok(())
    }

    /// Captures one decode step into a CUDA graph on the step's stream: the staging
    /// upload, the query upload when `upload_queries`, then decode and merge for each
    /// of `layers`. Replaces a previous capture only on success.
    ///
    /// # Errors
    /// As [`Self::enqueue_decode`] (checked for every layer before capture begins);
    /// [`Error::Cuda`] when the stream cannot be captured (a legacy default stream) or
    /// instantiation fails, with the capture ended.
    pub fn capture(
        &mut self,
        storage: &CudaStorage,
        layers: &[usize],
        upload_queries: bool,
    ) -> Result<()> {
        self.check_storage(storage)?;
        let regions = layers
            .iter()
            .map(|&l| storage.region_ptr(l).map(|r| (l, r)))
            .collect::<Result<Vec<_>>>()?;
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_err("cuStreamBeginCapture"))?;
        let body = (|| {
            self.enqueue_upload()?;
            if upload_queries {
                self.enqueue_upload_queries()?;
            }
            regions.iter().try_for_each(|&(_, r)| self.launch(r))
        })();
        // End the capture whatever happened, so the stream is usable again.
        let ended = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(driver_err("cuStreamEndCapture/cuGraphInstantiate"));
        body?;
        let graph = ended?.ok_or_else(|| Error::Cuda("the capture recorded no graph".into()))?;
        self.graph = Some((graph, regions));
        Ok(())
    }

    /// Launches the captured graph on the step's stream: what [`Self::capture`]
    /// recorded, over whatever is staged now, ordered after the storage's writes and
    /// the captured layers' swaps and recorded as a foreign read (see the type's docs).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] without a capture, or when a captured layer's region
    /// moved (another storage); [`Error::BlockOutOfRange`] when the arena shrank below
    /// the staged tables; [`Error::Cuda`]. Nothing is launched on error.
    pub fn replay(&self, storage: &CudaStorage) -> Result<()> {
        let Some((graph, regions)) = &self.graph else {
            return Err(Error::config("graph", "nothing captured yet".to_string()));
        };
        self.check_storage(storage)?;
        for &(layer, region) in regions {
            if storage.region_ptr(layer)? != region {
                return Err(Error::config(
                    "storage",
                    format!("layer {layer}'s region is not the one captured"),
                ));
            }
        }
        let layers: Vec<usize> = regions.iter().map(|&(l, _)| l).collect();
        self.order_reads(storage, &layers)?;
        graph.launch().map_err(driver_err("cuGraphLaunch"))?;
        self.record_reads(storage)
    }
}

impl Drop for DecodeGraphStep {
    fn drop(&mut self) {
        // The staging copies read `staging`/`q_staging` by raw address and the kernels
        // use the buffers through raw pointers: no cudarc event guards them, so wait
        // for the stream before the fields are freed. Never panic here: a failure is
        // recorded in the context, whose next checked call returns it.
        let synced = self.stream.synchronize();
        self.stream.context().record_err(synced);
    }
}
