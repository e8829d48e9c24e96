//! The serve simulation's storage backends and its GPU path (`--backend cuda`).
//!
//! With `--backend cuda` the simulation first runs on the host as always, then runs the
//! same trace again with every arena a `CudaStorage`:
//!
//! * the arena of the real model shape: every step's K/V goes through the cache-write
//!   kernel (`reshape_and_cache`, via `Storage::write_slots` and the slot mapping), copy
//!   and swap plans and resizes run on the device, and finished sequences are read back
//!   and checked as on the host;
//! * the attention model's cache ([`CheckedCuda`]): K/V written by the cache-write
//!   kernel from `f32`, prompts (in chunks of `--prefill-chunk` tokens) through the
//!   paged prefill kernel, decode through the paged decode kernel (its split planner
//!   and merge included). A host shadow of the same cache gets the same writes and
//!   plans, and every launch's output is compared with the host attention path on the
//!   same bytes; the GPU output is the one the model goes on with.
//!
//! The host and GPU runs must then agree on every scheduling figure and on the K/V
//! checksum read back from the arena ([`compare_runs`]), and the shadow cache must
//! equal the GPU cache byte for byte at the end of each run.
//!
//! The chunking ([`prefill_chunked`]) is shared by both backends; the host model's
//! outputs do not depend on the chunk size, so `--prefill-chunk` leaves the host
//! checksums unchanged. `tests/serve_prefill_chunks.rs` checks the chunk → launch
//! arguments on the CPU with the replay of the prefill kernel's tiling.

use std::cell::RefCell;
use std::rc::Rc;

use pagedkv::attention::cuda_prefill::plan_chunks;
use pagedkv::attention::model::{ModelAttention, TinyModel};
use pagedkv::{
    BlockId, CopyPlan, HostStorage, KvLayout, PaddedTables, Slot, Storage, SwapFence, SwapPlan,
};

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

#[cfg(feature = "cuda")]
mod cuda {
    use std::time::Instant;

    use super::{ModelCache, SharedChecks};
    use pagedkv::attention::cuda::{CudaAttention, Tables};
    use pagedkv::attention::cuda_prefill::CudaPrefill;
    use pagedkv::attention::model::ModelAttention;
    use pagedkv::attention::AttentionParams;
    use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
    use pagedkv::{
        BlockId, CopyPlan, DType, Error, HostStorage, KvLayout, PaddedTables, Slot, Storage,
        SwapPlan,
    };

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
        let gpu = cuda_storage(layout, num_blocks, host_blocks)?;
        let prefill = CudaPrefill::new(&gpu)?;
        let decode = CudaAttention::new(&gpu)?;
        Ok(Box::new(CheckedCuda {
            host: super::host_storage(layout, num_blocks, host_blocks)?,
            gpu,
            prefill,
            decode,
            checks: checks.clone(),
            host_out: Vec::new(),
        }))
    }

    /// The attention model's cache on the GPU with a host shadow: writes and plans go
    /// to both, attention runs on both, and each GPU launch's output must be within
    /// [`super::tolerance`] of the host path's on the same bytes.
    pub(super) struct CheckedCuda {
        gpu: CudaStorage,
        host: HostStorage,
        prefill: CudaPrefill,
        decode: CudaAttention,
        checks: SharedChecks,
        host_out: Vec<f32>,
    }

    // Token I/O reads and writes the GPU; plans run on both. Per-layer swaps and
    // host-block I/O keep the trait's refusal (callers fall back to `swap`).
    pagedkv::delegate_storage! {
        CheckedCuda => gpu, except [
            copy_blocks, swap, resize, swap_layer, read_host_block, write_host_block,
        ];

        fn copy_blocks(&mut self, plan: &CopyPlan) -> pagedkv::Result<()> {
            self.gpu.copy_blocks(plan)?;
            self.host.copy_blocks(plan)
        }
        fn swap(&mut self, plan: &SwapPlan) -> pagedkv::Result<()> {
            self.gpu.swap(plan)?;
            self.host.swap(plan)
        }
        fn resize(&mut self, num_blocks: usize) -> pagedkv::Result<()> {
            self.gpu.resize(num_blocks)?;
            self.host.resize(num_blocks)
        }
    }

    fn rel_err(a: &[f32], b: &[f32]) -> f64 {
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (&x, &y) in a.iter().zip(b) {
            num += (f64::from(x) - f64::from(y)).powi(2);
            den += f64::from(y).powi(2);
        }
        if a.len() != b.len() || a.iter().any(|x| !x.is_finite()) {
            return f64::INFINITY;
        }
        (num / den.max(1e-30)).sqrt()
    }

    fn bytes(x: &[f32]) -> Vec<u8> {
        x.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    impl CheckedCuda {
        /// Holds a GPU output to the host path's (already in `host_out`) and counts it.
        fn check(&mut self, what: &str, layer: usize, gpu: &[f32]) -> pagedkv::Result<()> {
            let e = rel_err(gpu, &self.host_out);
            let mut c = self.checks.borrow_mut();
            let tol = c.tolerance;
            if what == "prefill" {
                c.prefill_launches += 1;
                c.prefill_max_rel_err = c.prefill_max_rel_err.max(e);
            } else {
                c.decode_launches += 1;
                c.decode_max_rel_err = c.decode_max_rel_err.max(e);
            }
            if e.is_nan() || e > tol {
                return Err(Error::Cuda(format!(
                    "{what} of layer {layer}: the GPU output is {e:.3e} (relative L2) from the host path's, over the tolerance {tol:.1e}"
                )));
            }
            Ok(())
        }
    }

    impl ModelAttention for CheckedCuda {
        fn write_kv(
            &mut self,
            layer: usize,
            slots: &[Slot],
            k: &[f32],
            v: &[f32],
            params: &AttentionParams,
        ) -> pagedkv::Result<()> {
            // The host first: it validates everything, so a bad call fails before the
            // GPU is touched and the two stay equal.
            self.host.write_kv(layer, slots, k, v, params)?;
            self.gpu.reshape_and_cache(
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
            out: &mut [f32],
        ) -> pagedkv::Result<()> {
            let t = Instant::now();
            self.host_out.resize(out.len(), 0.0);
            self.host.prefill(
                layer,
                q,
                query_start_loc,
                tables,
                params,
                &mut self.host_out,
            )?;
            let host_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let (gpu_out, _lse) =
                self.prefill
                    .prefill_host(&self.gpu, layer, q, query_start_loc, tables, params)?;
            let gpu_s = t.elapsed().as_secs_f64();
            {
                let mut c = self.checks.borrow_mut();
                c.host_attention_seconds += host_s;
                c.gpu_attention_seconds += gpu_s;
            }
            self.check("prefill", layer, &gpu_out)?;
            out.copy_from_slice(&gpu_out);
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
            let t = Instant::now();
            self.host_out.resize(out.len(), 0.0);
            self.host
                .decode(layer, q, tables, params, &mut self.host_out)?;
            let host_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            // The split planner chooses, so the merge kernel runs too.
            let (gpu_out, _lse) = self.decode.decode_host(
                &self.gpu,
                layer,
                q,
                Tables::Padded(tables),
                params,
                None,
            )?;
            let gpu_s = t.elapsed().as_secs_f64();
            {
                let mut c = self.checks.borrow_mut();
                c.host_attention_seconds += host_s;
                c.gpu_attention_seconds += gpu_s;
            }
            self.check("decode", layer, &gpu_out)?;
            out.copy_from_slice(&gpu_out);
            Ok(())
        }
    }

    impl ModelCache for CheckedCuda {
        fn verify(&self) -> pagedkv::Result<()> {
            if self.gpu.num_blocks() != self.host.num_blocks() {
                return Err(Error::CorruptBlockTable(format!(
                    "the GPU cache has {} blocks, its host shadow {}",
                    self.gpu.num_blocks(),
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
                    if self.gpu.block_bytes(layer, block)? != host[start..start + bpl] {
                        return Err(Error::CorruptBlockTable(format!(
                            "block {b} of layer {layer} differs between the GPU cache and its host shadow"
                        )));
                    }
                }
            }
            self.checks.borrow_mut().cache_compares += 1;
            Ok(())
        }
    }
}
