//! The serve simulation's storage backends and its GPU path (`--backend cuda`).
//!
//! With `--backend cuda` the simulation runs the trace with every arena a
//! `CudaStorage` (a missing GPU fails here, with no fallback), then again on the host:
//!
//! * the arena of the real model shape: every step's K/V goes through the cache-write
//!   kernel (`reshape_and_cache`, via `Storage::write_slots` and the slot mapping), copy
//!   and swap plans and resizes run on the device, and finished sequences are read back
//!   and checked as on the host;
//! * the attention model's cache ([`Checked`] over `cuda::Gpu`): K/V written by the
//!   cache-write kernel from `f32`, prompts (in launches of at most `--prefill-chunk`
//!   tokens) through the paged prefill kernel, decode through the paged decode kernel
//!   (its split planner and merge included). A host shadow of the same cache gets the
//!   same writes and plans, every launch's output is compared with the host attention
//!   path on the same bytes, and the model goes on with the GPU's output.
//!
//! The GPU runs must then agree with the host runs on every scheduling figure and on
//! the K/V checksum read back from the arena ([`compare_runs`]), and the shadow cache
//! must equal the GPU cache byte for byte at the end of each run.
//!
//! The chunking ([`prefill_chunked`]) is shared by both backends; the host model's
//! outputs do not depend on the chunk size, so `--prefill-chunk` leaves the host
//! checksums unchanged. `examples/serve_gpu/tests.rs` runs this module on the CPU:
//! the chunk → launch arguments through the replay of the prefill kernel's tiling, and
//! [`Checked`] over a CPU device.

// Without the `cuda` feature only the tests run a `Checked` cache (over a CPU device).
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use pagedkv::attention::cuda_prefill::plan_chunks;
use pagedkv::attention::model::{ModelAttention, TinyModel};
use pagedkv::attention::AttentionParams;
use pagedkv::executor::storage::SwapFence;
use pagedkv::layout::Slot;
use pagedkv::tables::PaddedTables;
use pagedkv::{BlockId, CopyPlan, HostStorage, KvLayout, Storage, SwapPlan};

/// Where the simulation's arenas live.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StorageKind {
    /// Host memory (`HostStorage`) and CPU attention.
    #[default]
    Host,
    /// `CudaStorage` and the CUDA kernels, checked against a host run of the same trace.
    Cuda,
}

/// A model cache the simulation can run plans on and check at the end of a run.
pub trait ModelCache: ModelAttention {
    /// Checks what the backend can check about its whole state (the CUDA cache against
    /// its host shadow, byte for byte); nothing for the host cache.
    ///
    /// # Errors
    /// [`pagedkv::Error::CorruptBlockTable`] naming the first difference.
    fn verify(&self) -> pagedkv::Result<()> {
        Ok(())
    }
}

impl ModelCache for HostStorage {}

/// What the GPU path checked, over every run of the process.
#[derive(Debug, Default, Clone)]
pub struct GpuChecks {
    /// Prefill launches compared with the host attention path.
    pub prefill_launches: usize,
    /// Decode launches compared with the host attention path.
    pub decode_launches: usize,
    /// Largest relative L2 error of a prefill launch's output.
    pub prefill_max_rel_err: f64,
    /// Largest relative L2 error of a decode launch's output.
    pub decode_max_rel_err: f64,
    /// The tolerance every launch was held to.
    pub tolerance: f64,
    /// Whole-cache byte comparisons (GPU against the host shadow) that passed.
    pub cache_compares: usize,
    /// Seconds in the GPU attention calls (uploads, launches, downloads, syncs).
    pub gpu_attention_seconds: f64,
    /// Seconds in the host attention calls on the same inputs.
    pub host_attention_seconds: f64,
}

impl GpuChecks {
    /// The summary line under the table.
    pub fn print(&self) {
        println!(
            "GPU path: {} prefill and {} decode launches each within {:.1e} (relative L2) of the host attention path on the same bytes (largest {:.1e} / {:.1e}); the model cache equalled its host shadow byte for byte after {} runs; every run made the host run's scheduling decisions and left the same K/V checksum. Attention time: GPU calls (with their copies) {:.2} s, host {:.2} s.",
            self.prefill_launches,
            self.decode_launches,
            self.tolerance,
            self.prefill_max_rel_err,
            self.decode_max_rel_err,
            self.cache_compares,
            self.gpu_attention_seconds,
            self.host_attention_seconds
        );
    }

    /// The summary as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "prefill_launches_checked": self.prefill_launches,
            "decode_launches_checked": self.decode_launches,
            "prefill_max_rel_err": self.prefill_max_rel_err,
            "decode_max_rel_err": self.decode_max_rel_err,
            "tolerance": self.tolerance,
            "cache_compares": self.cache_compares,
            "gpu_attention_seconds": self.gpu_attention_seconds,
            "host_attention_seconds": self.host_attention_seconds,
        })
    }
}

/// Shared between the caches of the runs and `main`, which prints it.
pub type SharedChecks = Rc<RefCell<GpuChecks>>;

/// The tolerance of one launch's output against the host path, as relative L2 error.
/// Both sides read the same cache bytes (checked) and the same `f32` queries, and both
/// compute in `f32`; they differ only in summation order (and the GPU's `exp2f`), so
/// the bound is `f32`'s rounding over the longest softmax: `max_len` terms times
/// `f32::EPSILON`, and never under 1e-5.
pub fn tolerance(max_len: usize) -> f64 {
    (max_len as f64 * f64::from(f32::EPSILON)).max(1e-5)
}

/// The arena of the real model shape, on either backend.
pub struct Arena(Box<dyn Storage>);

/// The arena of the real model shape: `num_blocks` blocks, `host_blocks` of host tier.
///
/// # Errors
/// Allocation errors; for `Cuda`, [`pagedkv::Error::CudaUnavailable`] without a GPU or
/// without the `cuda` feature (never a fallback to the host).
pub fn arena(
    kind: StorageKind,
    layout: KvLayout,
    num_blocks: usize,
    host_blocks: usize,
) -> pagedkv::Result<Arena> {
    Ok(Arena(match kind {
        StorageKind::Host => Box::new(host_storage(layout, num_blocks, host_blocks)?),
        StorageKind::Cuda => cuda::arena(layout, num_blocks, host_blocks)?,
    }))
}

// Every method forwards, the defaults included (a box is not a `Storage` itself, so
// `delegate_storage!` cannot name it).
impl Storage for Arena {
    fn layout(&self) -> &KvLayout {
        self.0.layout()
    }
    fn num_blocks(&self) -> usize {
        self.0.num_blocks()
    }
    fn copy_blocks(&mut self, plan: &CopyPlan) -> pagedkv::Result<()> {
        self.0.copy_blocks(plan)
    }
    fn write_slots(
        &mut self,
        layer: usize,
        slots: &[Slot],
        k: &[u8],
        v: &[u8],
    ) -> pagedkv::Result<()> {
        self.0.write_slots(layer, slots, k, v)
    }
    fn read_tokens(
        &self,
        layer: usize,
        table: &[BlockId],
        num_tokens: usize,
        k: &mut [u8],
        v: &mut [u8],
    ) -> pagedkv::Result<()> {
        self.0.read_tokens(layer, table, num_tokens, k, v)
    }
    fn num_host_blocks(&self) -> usize {
        self.0.num_host_blocks()
    }
    fn swap(&mut self, plan: &SwapPlan) -> pagedkv::Result<()> {
        self.0.swap(plan)
    }
    fn swap_layer(&mut self, layer: usize, plan: &SwapPlan) -> pagedkv::Result<()> {
        self.0.swap_layer(layer, plan)
    }
    fn swap_fence(&self) -> pagedkv::Result<SwapFence> {
        self.0.swap_fence()
    }
    fn read_host_block(&self, block: BlockId, out: &mut [u8]) -> pagedkv::Result<()> {
        self.0.read_host_block(block, out)
    }
    fn write_host_block(&mut self, block: BlockId, data: &[u8]) -> pagedkv::Result<()> {
        self.0.write_host_block(block, data)
    }
    fn resize(&mut self, num_blocks: usize) -> pagedkv::Result<()> {
        self.0.resize(num_blocks)
    }
}

/// The attention model's cache; for `Cuda` a [`CheckedCuda`] reporting into `checks`.
///
/// # Errors
/// As [`arena`]; kernel compile or load errors.
pub fn model_cache(
    kind: StorageKind,
    layout: KvLayout,
    num_blocks: usize,
    host_blocks: usize,
    checks: &SharedChecks,
) -> pagedkv::Result<Box<dyn ModelCache>> {
    match kind {
        StorageKind::Host => Ok(Box::new(host_storage(layout, num_blocks, host_blocks)?)),
        StorageKind::Cuda => cuda::model_cache(layout, num_blocks, host_blocks, checks),
    }
}

fn host_storage(
    layout: KvLayout,
    num_blocks: usize,
    host_blocks: usize,
) -> pagedkv::Result<HostStorage> {
    if host_blocks == 0 {
        HostStorage::new(layout, num_blocks)
    } else {
        HostStorage::with_host_tier(layout, num_blocks, host_blocks)
    }
}

/// Prefills the uncached tail of one sequence's prompt (`tail`, after `cached` cached
/// tokens; `tables` is the sequence alone, its context the whole prompt) in launches
/// of at most `chunk` tokens (0: one launch), each attending to the cached prefix, the
/// earlier chunks and itself. The last chunk's final hidden states end in `hidden`.
///
/// # Errors
/// As [`plan_chunks`] and [`TinyModel::prefill_tokens`].
pub fn prefill_chunked(
    model: &TinyModel,
    cache: &mut dyn ModelCache,
    tables: &PaddedTables,
    cached: usize,
    tail: &[u32],
    chunk: usize,
    hidden: &mut Vec<f32>,
) -> pagedkv::Result<()> {
    for launch in plan_chunks(tables, &[cached], chunk)? {
        let r = &launch.positions[0];
        let tokens = &tail[r.start - cached..r.end - cached];
        hidden.resize(tokens.len() * model.hidden_size(), 0.0);
        model.prefill_tokens(
            cache,
            &launch.tables,
            &launch.query_start_loc,
            tokens,
            hidden,
        )?;
    }
    Ok(())
}

/// The scheduling figures and the K/V checksum a run on the GPU must share with the
/// host run of the same configuration.
pub fn schedule_figures(s: &serde_json::Value) -> Vec<(&'static str, serde_json::Value)> {
    [
        "requests_served",
        "sequences_served",
        "tokens_generated",
        "prefill_tokens_saved",
        "steps",
        "peak_concurrent_seqs",
        "peak_used_blocks",
        "admissions_delayed",
        "preemptions",
        "cow_copies",
        "schedule_hash",
        "kv_checksum",
    ]
    .into_iter()
    .map(|k| (k, s[k].clone()))
    .collect()
}

/// Checks that every GPU run made the host run's scheduling decisions and left the
/// same K/V bytes (runs are `(name, summary JSON)`, in the same order).
///
/// # Errors
/// A message naming the run and the first figure that differs.
pub fn compare_runs(
    host: &[(String, serde_json::Value)],
    gpu: &[(String, serde_json::Value)],
) -> Result<(), String> {
    if host.len() != gpu.len() {
        return Err(format!(
            "{} host runs but {} GPU runs",
            host.len(),
            gpu.len()
        ));
    }
    for ((name, h), (gname, g)) in host.iter().zip(gpu) {
        if name != gname {
            return Err(format!("run {name} on the host, {gname} on the GPU"));
        }
        for ((key, hv), (_, gv)) in schedule_figures(h).iter().zip(schedule_figures(g)) {
            if *hv != gv {
                return Err(format!(
                    "run {name}: {key} is {hv} on the host but {gv} on the GPU"
                ));
            }
        }
    }
    Ok(())
}

/// The device half of a checked model cache: the cache write and the attention
/// launches of one backend. `cuda::Gpu` is the CUDA one; `examples/serve_gpu/tests.rs`
/// has a CPU one that replays the prefill kernel's tiling, so [`Checked`] runs on
/// the CPU in tests exactly as it runs over the GPU here.
pub trait Device: Storage {
    /// Writes `f32` K/V of one layer into `slots`, converting to the cache dtype.
    ///
    /// # Errors
    /// Shape and slot errors; backend failures.
    fn write_kv(
        &mut self,
        layer: usize,
        slots: &[Slot],
        k: &[f32],
        v: &[f32],
        params: &AttentionParams,
    ) -> pagedkv::Result<()>;

    /// Prefill attention of one layer; returns `[tokens, q_heads, head_dim]`.
    ///
    /// # Errors
    /// Validation and backend failures.
    fn prefill(
        &mut self,
        layer: usize,
        q: &[f32],
        query_start_loc: &[usize],
        tables: &PaddedTables,
        params: &AttentionParams,
    ) -> pagedkv::Result<Vec<f32>>;

    /// Decode attention of one layer; returns `[batch, q_heads, head_dim]`.
    ///
    /// # Errors
    /// Validation and backend failures.
    fn decode(
        &mut self,
        layer: usize,
        q: &[f32],
        tables: &PaddedTables,
        params: &AttentionParams,
    ) -> pagedkv::Result<Vec<f32>>;

    /// One layer's bytes of `block`.
    ///
    /// # Errors
    /// Range and backend failures.
    fn block_bytes(&self, layer: usize, block: BlockId) -> pagedkv::Result<Vec<u8>>;
}

/// A model cache on a [`Device`] with a host shadow: writes and plans go to both,
/// attention runs on both, and each device launch's output must be within
/// [`tolerance`] of the host path's on the same bytes; the model goes on with the
/// device's output. [`ModelCache::verify`] compares the two caches byte for byte.
pub struct Checked<D: Device> {
    dev: D,
    host: HostStorage,
    checks: SharedChecks,
    host_out: Vec<f32>,
}

impl<D: Device> Checked<D> {
    /// `dev` and an empty host shadow of the same layout, size and host tier.
    ///
    /// # Errors
    /// Allocation errors.
    pub fn new(dev: D, checks: &SharedChecks) -> pagedkv::Result<Self> {
        let host = host_storage(*dev.layout(), dev.num_blocks(), dev.num_host_blocks())?;
        Ok(Checked {
            dev,
            host,
            checks: checks.clone(),
            host_out: Vec::new(),
        })
    }

    /// The device half, for what the checks do not cover (and for tests that plant
    /// a difference).
    #[allow(dead_code)] // the example does not; examples/serve_gpu/tests.rs does
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    /// Holds a device output to the host path's (in `host_out`) and counts it.
    fn check(&mut self, decode: bool, layer: usize, dev: &[f32]) -> pagedkv::Result<()> {
        let e = rel_err(dev, &self.host_out);
        let mut guard = self.checks.borrow_mut();
        let c = &mut *guard;
        let tol = c.tolerance;
        let (n, max) = if decode {
            (&mut c.decode_launches, &mut c.decode_max_rel_err)
        } else {
            (&mut c.prefill_launches, &mut c.prefill_max_rel_err)
        };
        *n += 1;
        *max = max.max(e);
        if e.is_nan() || e > tol {
            let what = if decode { "decode" } else { "prefill" };
            return Err(pagedkv::Error::CorruptBlockTable(format!(
                "{what} of layer {layer}: the device output is {e:.3e} (relative L2) from the host path's, over the tolerance {tol:.1e}"
            )));
        }
        Ok(())
    }
}

/// Runs `f`, adding its time to the host's or the device's attention seconds.
fn timed<T>(checks: &SharedChecks, host: bool, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    let s = t.elapsed().as_secs_f64();
    let mut c = checks.borrow_mut();
    if host {
        c.host_attention_seconds += s;
    } else {
        c.gpu_attention_seconds += s;
    }
    out
}

/// Relative L2 distance of `a` from `b` (infinite for a length mismatch or a
/// non-finite `a`, e.g. a row the kernel never wrote).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (f64::from(x) - f64::from(y)).powi(2);
        den += f64::from(y).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

// Token I/O reads and writes the device; plans run on both. Per-layer swaps and
// host-block I/O keep the trait's refusal (callers fall back to `swap`).
pagedkv::delegate_storage! {
    impl [D: Device] Checked<D> => dev, except [
        copy_blocks, swap, resize, swap_layer, read_host_block, write_host_block,
    ];

    fn copy_blocks(&mut self, plan: &CopyPlan) -> pagedkv::Result<()> {
        // The host first: it validates everything, so a bad plan fails before the
        // device is touched and the two stay equal.
        self.host.copy_blocks(plan)?;
        self.dev.copy_blocks(plan)
    }
    fn swap(&mut self, plan: &SwapPlan) -> pagedkv::Result<()> {
        self.host.swap(plan)?;
        self.dev.swap(plan)
    }
    fn resize(&mut self, num_blocks: usize) -> pagedkv::Result<()> {
        self.host.resize(num_blocks)?;
        self.dev.resize(num_blocks)
    }
}

impl<D: Device> ModelAttention for Checked<D> {
    fn write_kv(
        &mut self,
        layer: usize,
        slots: &[Slot],
        k: &[f32],
        v: &[f32],
        params: &AttentionParams,
    ) -> pagedkv::Result<()> {
        ModelAttention::write_kv(&mut self.host, layer, slots, k, v, params)?;
        self.dev.write_kv(layer, slots, k, v, params)
    }

    fn prefill(
        &mut self,
        layer: usize,
        q: &[f32],
        query_start_loc: &[usize],
        tables: &PaddedTables,
        params: &AttentionParams,
        out: &mut [f32],
    ) -> pagedkv::Result<()> {
        let mut host_out = std::mem::take(&mut self.host_out);
        host_out.resize(out.len(), 0.0);
        let host = &mut self.host;
        timed(&self.checks, true, || {
            ModelAttention::prefill(
                host,
                layer,
                q,
                query_start_loc,
                tables,
                params,
                &mut host_out,
            )
        })?;
        self.host_out = host_out;
        let dev = &mut self.dev;
        let got = timed(&self.checks, false, || {
            dev.prefill(layer, q, query_start_loc, tables, params)
        })?;
        self.check(false, layer, &got)?;
        out.copy_from_slice(&got);
        Ok(())
    }

    fn decode(
        &mut self,
        layer: usize,
        q: &[f32],
        tables: &PaddedTables,
        params: &AttentionParams,
        out: &mut [f32],
    ) -> pagedkv::Result<()> {
        let mut host_out = std::mem::take(&mut self.host_out);
        host_out.resize(out.len(), 0.0);
        let host = &mut self.host;
        timed(&self.checks, true, || {
            ModelAttention::decode(host, layer, q, tables, params, &mut host_out)
        })?;
        self.host_out = host_out;
        let dev = &mut self.dev;
        let got = timed(&self.checks, false, || dev.decode(layer, q, tables, params))?;
        self.check(true, layer, &got)?;
        out.copy_from_slice(&got);
        Ok(())
    }
}

impl<D: Device> ModelCache for Checked<D> {
    fn verify(&self) -> pagedkv::Result<()> {
        if self.dev.num_blocks() != self.host.num_blocks() {
            return Err(pagedkv::Error::CorruptBlockTable(format!(
                "the device cache has {} blocks, its host shadow {}",
                self.dev.num_blocks(),
                self.host.num_blocks()
            )));
        }
        let layout = *self.host.layout();
        let bpl = layout.block_bytes_per_layer();
        for layer in 0..layout.num_layers() {
            let host = self.host.region(layer);
            for b in 0..self.host.num_blocks() {
                let block = BlockId(b as u32);
                let start = layout.block_byte_offset(block);
                if self.dev.block_bytes(layer, block)? != host[start..start + bpl] {
                    return Err(pagedkv::Error::CorruptBlockTable(format!(
                        "block {b} of layer {layer} differs between the device cache and its host shadow"
                    )));
                }
            }
        }
        self.checks.borrow_mut().cache_compares += 1;
        Ok(())
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::{ModelCache, SharedChecks};
    use pagedkv::{KvLayout, Storage};

    fn refuse<T>() -> pagedkv::Result<T> {
        Err(pagedkv::Error::CudaUnavailable(
            "this build has no `cuda` feature (rebuild without --no-default-features)".into(),
        ))
    }

    pub fn arena(_: KvLayout, _: usize, _: usize) -> pagedkv::Result<Box<dyn Storage>> {
        refuse()
    }

    pub fn model_cache(
        _: KvLayout,
        _: usize,
        _: usize,
        _: &SharedChecks,
    ) -> pagedkv::Result<Box<dyn ModelCache>> {
        refuse()
    }
}

/// The kernel modules `serve --backend cuda` launches for the model cache `layout`
/// that are neither among the prebuilt cubins (`executor::cuda::catalog()`, from
/// `PREBUILT_ATTENTION`) nor compilable here (no NVRTC, as on the GPU machine); empty
/// when the run can start. examples/serve_gpu/tests.rs holds the models
/// `.ci/gpu-check` runs to an empty list without NVRTC.
#[cfg(feature = "cuda")]
pub fn unprebuilt_kernels(
    layout: &KvLayout,
    nvrtc: bool,
) -> Vec<pagedkv::executor::cuda::KernelSpec> {
    use pagedkv::executor::cuda::{catalog, AttentionSpec, KernelSpec, PrefillSpec};
    if nvrtc {
        return Vec::new();
    }
    let all = catalog();
    [
        KernelSpec::CacheOps,
        KernelSpec::Attention(AttentionSpec::for_layout(layout)),
        KernelSpec::Prefill(PrefillSpec::for_layout(layout)),
    ]
    .into_iter()
    .filter(|s| !all.contains(s))
    .collect()
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{Checked, Device, ModelCache, SharedChecks};
    use pagedkv::attention::cuda::{CudaAttention, Tables};
    use pagedkv::attention::cuda_prefill::CudaPrefill;
    use pagedkv::attention::AttentionParams;
    use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
    use pagedkv::layout::Slot;
    use pagedkv::tables::PaddedTables;
    use pagedkv::{BlockId, DType, KvLayout, Storage};

    fn cuda_storage(
        layout: KvLayout,
        num_blocks: usize,
        host_blocks: usize,
    ) -> pagedkv::Result<CudaStorage> {
        CudaStorage::new(
            layout,
            CudaStorageConfig {
                host_blocks,
                ..CudaStorageConfig::blocks(num_blocks)
            },
        )
    }

    pub fn arena(
        layout: KvLayout,
        num_blocks: usize,
        host_blocks: usize,
    ) -> pagedkv::Result<Box<dyn Storage>> {
        Ok(Box::new(cuda_storage(layout, num_blocks, host_blocks)?))
    }

    pub fn model_cache(
        layout: KvLayout,
        num_blocks: usize,
        host_blocks: usize,
        checks: &SharedChecks,
    ) -> pagedkv::Result<Box<dyn ModelCache>> {
        let missing = super::unprebuilt_kernels(&layout, pagedkv::executor::cuda::nvrtc_present());
        if !missing.is_empty() {
            return Err(pagedkv::Error::Unsupported(format!(
                "no NVRTC here and no prebuilt cubin for {missing:?} (PREBUILT_ATTENTION \
                 lists what .ci/gpu-check build prebuilds)"
            )));
        }
        let storage = cuda_storage(layout, num_blocks, host_blocks)?;
        let prefill = CudaPrefill::new(&storage)?;
        let decode = CudaAttention::new(&storage)?;
        Ok(Box::new(Checked::new(
            Gpu {
                storage,
                prefill,
                decode,
            },
            checks,
        )?))
    }

    /// The model cache in a `CudaStorage`, with the prefill and decode kernels.
    pub struct Gpu {
        storage: CudaStorage,
        prefill: CudaPrefill,
        decode: CudaAttention,
    }

    pagedkv::delegate_storage! { Gpu => storage; }

    fn bytes(x: &[f32]) -> Vec<u8> {
        x.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    impl Device for Gpu {
        fn write_kv(
            &mut self,
            layer: usize,
            slots: &[Slot],
            k: &[f32],
            v: &[f32],
            params: &AttentionParams,
        ) -> pagedkv::Result<()> {
            // The cache-write kernel converts f32 to the cache dtype (as
            // convert::encode does on the host).
            self.storage.reshape_and_cache(
                layer,
                slots,
                &bytes(k),
                &bytes(v),
                DType::F32,
                params.k_scale,
                params.v_scale,
            )
        }

        fn prefill(
            &mut self,
            layer: usize,
            q: &[f32],
            query_start_loc: &[usize],
            tables: &PaddedTables,
            params: &AttentionParams,
        ) -> pagedkv::Result<Vec<f32>> {
            let (out, _lse) = self.prefill.prefill_host(
                &self.storage,
                layer,
                q,
                query_start_loc,
                tables,
                params,
            )?;
            Ok(out)
        }

        fn decode(
            &mut self,
            layer: usize,
            q: &[f32],
            tables: &PaddedTables,
            params: &AttentionParams,
        ) -> pagedkv::Result<Vec<f32>> {
            // The split planner chooses, so the merge kernel runs too.
            let (out, _lse) = self.decode.decode_host(
                &self.storage,
                layer,
                q,
                Tables::Padded(tables),
                params,
                None,
            )?;
            Ok(out)
        }

        fn block_bytes(&self, layer: usize, block: BlockId) -> pagedkv::Result<Vec<u8>> {
            self.storage.block_bytes(layer, block)
        }
    }
}
