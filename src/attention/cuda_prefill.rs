//! Paged prefill / chunked prefill on the GPU: `kernels/paged_prefill.cu` over a
//! `CudaStorage` arena, the GPU twin of [`super::reference::paged_prefill_reference`].
//!
//! Query tokens come packed as `[tokens, q_heads, head_dim]` `f32` with
//! `query_start_loc` offsets (vLLM's `cu_seqlens_q`); sequence `i`'s queries are the
//! last `qlen_i` positions of its context, whose K/V are already in the cache (written
//! by `reshape_and_cache` first). Each query attends to the cached prefix plus the
//! chunk up to itself (causal), inside the sliding window, with ALiBi if given.
//!
//! The host half is plain code, tested on the CPU: [`PrefillTiles`] is the launch's
//! tile list (one CTA per KV head and tile of `q_tile` query tokens of one sequence),
//! [`validate_prefill`] the checks made before any launch, and [`replay_tiling`] runs
//! the kernel's exact loop structure (tiles, key tiles, masks, base-2 online softmax in
//! `f32`) on a `HostStorage`, so the tiling is checked against the `f64` reference
//! without a GPU. The kernel itself has only been compiled here (NVRTC, sm_80/sm_90);
//! `tests/cuda/prefill.rs` runs it against the reference on a GPU.
//!
//! # Multi-query decode (speculative verification)
//!
//! Verifying `k` draft tokens is this kernel with `k` queries per sequence: write the
//! drafts' K/V into their lookahead slots, then launch with
//! [`verify_query_start_loc`] and the contexts counting the drafts. Draft `j` sits at
//! position `ctx - k + j` and attends to the prefix and to drafts `0..=j`, exactly what
//! `k` successive one-token decode steps would compute; sequences may carry different
//! `k` (0 and 1 included) in one launch. A unit test checks that equality on the
//! replayed tiling against the CPU decode path.

use super::{check_paged, check_prefill_q, AttentionParams, DecodeOutput};
use crate::error::{Error, Result};
use crate::executor::storage::{HostStorage, Storage};
use crate::ids::BlockId;
use crate::layout::convert::decode_one_f64;
use crate::layout::shape::DType;
use crate::layout::{Kv, KvLayout};
use crate::tables::PaddedTables;

/// The CTAs of one prefill launch along the grid's y axis: tile `t` covers query
/// tokens `q0[t] .. min(q0[t] + q_tile, end of its sequence)` of sequence `seq[t]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefillTiles {
    /// The sequence of each tile.
    pub seq: Vec<u32>,
    /// The first query token (index into the packed queries) of each tile.
    pub q0: Vec<u32>,
}

impl PrefillTiles {
    /// Cuts every sequence's queries into tiles of `q_tile` tokens (the last one
    /// shorter); sequences without queries get none.
    ///
    /// # Errors
    /// [`Error::TooLong`] when a token index does not fit the kernel's `u32`.
    pub fn plan(query_start_loc: &[usize], q_tile: usize) -> Result<Self> {
        let q_tile = q_tile.max(1);
        let mut t = PrefillTiles::default();
        if let Some(&last) = query_start_loc.last() {
            if last > u32::MAX as usize {
                return Err(Error::TooLong {
                    tokens: last,
                    limit: u32::MAX as usize,
                });
            }
        }
        for (i, w) in query_start_loc.windows(2).enumerate() {
            for q0 in (w[0]..w[1]).step_by(q_tile) {
                t.seq.push(i as u32);
                t.q0.push(q0 as u32);
            }
        }
        Ok(t)
    }

    /// Tiles (CTAs per KV head).
    pub fn len(&self) -> usize {
        self.seq.len()
    }

    /// Whether there is nothing to launch.
    pub fn is_empty(&self) -> bool {
        self.seq.is_empty()
    }
}

/// The kernel's default `Q_TILE` and `KV_TILE` for a layout (what `PrefillSpec`
/// compiles): 16 query rows per CTA (`16 / group` tokens, at least one), and 32 keys
/// per shared-memory tile (16 past head dim 128). [`replay_tiling`] takes these to
/// replay a launch as the GPU would run it.
pub fn kernel_tile_sizes(layout: &KvLayout) -> (usize, usize) {
    let s = layout.shape();
    let q_tile = (16 / s.group_size().max(1)).max(1);
    let kv_tile = if s.head_dim > 128 { 16 } else { 32 };
    (q_tile, kv_tile)
}

/// `query_start_loc` of a speculative-verification launch (multi-query decode):
/// sequence `i` brings its last `query_tokens[i]` positions (the drafts, usually with
/// the last accepted token in front) as queries; `tables.context_lens` count them.
///
/// # Errors
/// [`Error::ShapeMismatch`] when `query_tokens` does not have one entry per sequence;
/// [`Error::InvalidConfig`] when a sequence has more query tokens than its context.
pub fn verify_query_start_loc(tables: &PaddedTables, query_tokens: &[usize]) -> Result<Vec<usize>> {
    if query_tokens.len() != tables.batch || tables.context_lens.len() != tables.batch {
        return Err(Error::ShapeMismatch {
            what: "query token counts (one per sequence)",
            expected: tables.batch,
            got: query_tokens.len(),
        });
    }
    let mut qsl = Vec::with_capacity(tables.batch + 1);
    qsl.push(0);
    for (i, (&k, &ctx)) in query_tokens.iter().zip(&tables.context_lens).enumerate() {
        if k > ctx as usize {
            return Err(Error::config(
                "query_tokens",
                format!("sequence {i} has {k} query tokens but a context of {ctx}"),
            ));
        }
        qsl.push(qsl[i] + k);
    }
    Ok(qsl)
}

/// One launch of a chunked prefill over a batch (see [`plan_chunks`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillChunk {
    /// The batch's tables with each context cut after this chunk (the computed prefix,
    /// earlier chunks and this one): what the kernel and the host attention take.
    pub tables: PaddedTables,
    /// Offsets of each sequence's queries among the chunk's packed tokens (batch + 1).
    pub query_start_loc: Vec<usize>,
    /// For each sequence, the positions its queries hold (`ctx - qlen .. ctx` of this
    /// chunk's context); the caller packs the tokens (and K/V) of these positions.
    pub positions: Vec<std::ops::Range<usize>>,
}

/// Cuts the uncomputed tail of every sequence of `tables` into launches of at most
/// `chunk_tokens` query tokens per sequence (0: one launch with every tail whole).
/// Sequence `i` has `computed[i]` leading tokens whose K/V is already cached (a prefix
/// cache hit, or earlier chunks) and `tables.context_lens[i]` tokens in all. Launch `c`
/// holds positions `computed[i] + c * chunk_tokens ..` up to the next chunk boundary or
/// the context's end; its queries attend to the cached prefix and the earlier chunks
/// (whose K/V the caller has written by then) and causally within the chunk. A sequence
/// whose tail is done has no queries in the later launches. No tail at all: no launch.
///
/// # Errors
/// [`Error::ShapeMismatch`] when `computed` does not have one entry per sequence;
/// [`Error::InvalidConfig`] when a sequence has more computed tokens than its context.
pub fn plan_chunks(
    tables: &PaddedTables,
    computed: &[usize],
    chunk_tokens: usize,
) -> Result<Vec<PrefillChunk>> {
    if computed.len() != tables.batch || tables.context_lens.len() != tables.batch {
        return Err(Error::ShapeMismatch {
            what: "computed token counts (one per sequence)",
            expected: tables.batch,
            got: computed.len(),
        });
    }
    let mut longest = 0;
    for (i, (&c, &ctx)) in computed.iter().zip(&tables.context_lens).enumerate() {
        if c > ctx as usize {
            return Err(Error::config(
                "computed",
                format!("sequence {i} has {c} computed tokens but a context of {ctx}"),
            ));
        }
        longest = longest.max(ctx as usize - c);
    }
    if longest == 0 {
        return Ok(Vec::new());
    }
    let chunk = if chunk_tokens == 0 {
        longest
    } else {
        chunk_tokens
    };
    let launches = longest.div_ceil(chunk);
    let mut out = Vec::with_capacity(launches);
    for c in 0..launches {
        let mut t = tables.clone();
        let mut qsl = Vec::with_capacity(tables.batch + 1);
        qsl.push(0);
        let mut positions = Vec::with_capacity(tables.batch);
        for (i, &done) in computed.iter().enumerate() {
            let ctx = tables.context_lens[i] as usize;
            let start = (done + c * chunk).min(ctx);
            let end = (start + chunk).min(ctx);
            t.context_lens[i] = end as u32;
            qsl.push(qsl[i] + end - start);
            positions.push(start..end);
        }
        out.push(PrefillChunk {
            tables: t,
            query_start_loc: qsl,
            positions,
        });
    }
    Ok(out)
}

/// What a launch needs to know after validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillShape {
    /// Packed query tokens.
    pub tokens: usize,
    /// Sequences.
    pub batch: usize,
    /// One past the largest block id the kernel may read.
    pub blocks_needed: usize,
}

/// The checks made before any prefill launch: layer, parameters, tables against the
/// arena (every entry the kernel reads names a block below `num_blocks`, each row
/// covers its context), `query_start_loc` (from 0, non-decreasing, `qlen <= ctx`),
/// and `q` of `[tokens, q_heads, head_dim]` elements.
///
/// # Errors
/// As [`super::reference::paged_prefill_reference`]; [`Error::TooLong`] for a context
/// or token count past `u32`.
pub fn validate_prefill(
    layout: &KvLayout,
    num_blocks: usize,
    layer: usize,
    q_len: usize,
    query_start_loc: &[usize],
    tables: &PaddedTables,
    params: &AttentionParams,
) -> Result<PrefillShape> {
    let batch = check_paged(
        layout,
        num_blocks,
        layer,
        tables,
        params,
        Some(query_start_loc),
    )?;
    let tokens = check_prefill_q(layout, tables, query_start_loc, q_len)?;
    if tokens > u32::MAX as usize {
        return Err(Error::TooLong {
            tokens,
            limit: u32::MAX as usize,
        });
    }
    let bs = layout.block_size();
    let blocks_needed = (0..batch)
        .flat_map(|i| {
            let n = (tables.context_lens[i] as usize).div_ceil(bs);
            tables.row(i)[..n].iter()
        })
        .map(|&b| b as usize + 1)
        .max()
        .unwrap_or(0);
    Ok(PrefillShape {
        tokens,
        batch,
        blocks_needed,
    })
}

/// Runs the kernel's algorithm on the CPU, tile by tile and key tile by key tile, in
/// `f32` with base-2 exponentials and the same masks and rescaling, so a wrong tile
/// bound or mask shows up against the `f64` reference without a GPU. `q_tile` and
/// `kv_tile` are the kernel's `Q_TILE` and `KV_TILE`. Returns `out` and `lse` (natural
/// log) like the kernel.
///
/// # Errors
/// As [`validate_prefill`].
#[allow(clippy::too_many_arguments)]
pub fn replay_tiling(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    query_start_loc: &[usize],
    tables: &PaddedTables,
    params: &AttentionParams,
    q_tile: usize,
    kv_tile: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let layout = *storage.layout();
    let shape = validate_prefill(
        &layout,
        storage.num_blocks(),
        layer,
        q.len(),
        query_start_loc,
        tables,
        params,
    )?;
    let s = layout.shape();
    let (qh, d, g, bs) = (
        s.num_q_heads,
        s.head_dim,
        s.group_size(),
        layout.block_size(),
    );
    let fp8 = s.kv_dtype == DType::Fp8E4M3;
    let scale_log2 =
        params.scale * if fp8 { params.k_scale } else { 1.0 } * std::f32::consts::LOG2_E;
    let v_scale = if fp8 { params.v_scale } else { 1.0 };
    let region = storage.region(layer);
    let (q_tile, kv_tile) = (q_tile.max(1), kv_tile.max(1));
    let tiles = PrefillTiles::plan(query_start_loc, q_tile)?;
    let mut out = vec![0.0f32; shape.tokens * qh * d];
    let mut lse = vec![f32::NEG_INFINITY; shape.tokens * qh];
    let window = params.sliding_window.unwrap_or(0);
    for kv_head in 0..s.num_kv_heads {
        for (&seq, &q0) in tiles.seq.iter().zip(&tiles.q0) {
            let (seq, q0) = (seq as usize, q0 as usize);
            let (qa, qb) = (query_start_loc[seq], query_start_loc[seq + 1]);
            let ctx = tables.context_lens[seq] as usize;
            let ntok = (qb - q0).min(q_tile);
            let p_first = ctx - (qb - qa) + (q0 - qa);
            let p_last = p_first + ntok - 1;
            let kbegin = if window != 0 && p_first + 1 > window {
                p_first + 1 - window
            } else {
                0
            };
            let kend = (p_last + 1).min(ctx);
            let rows = ntok * g;
            let (mut m, mut l) = (vec![f32::NEG_INFINITY; rows], vec![0.0f32; rows]);
            let mut acc = vec![0.0f32; rows * d];
            let row_of = |r: usize| (q0 + r / g) * qh + kv_head * g + r % g;
            let mut base = kbegin;
            while base < kend {
                // The shared-memory tile, decoded to f32 (zeros past the end).
                let elem = |kv: Kv, t: usize, i: usize| -> f32 {
                    let pos = base + t;
                    if pos >= kend {
                        return 0.0;
                    }
                    let blk = BlockId(tables.row(seq)[pos / bs]);
                    let off = layout.elem_offset(blk, kv, kv_head, pos % bs) + i;
                    decode_one_f64(s.kv_dtype, region, off, 1.0) as f32
                };
                let kt: Vec<f32> = (0..kv_tile * d)
                    .map(|x| elem(Kv::K, x / d, x % d))
                    .collect();
                let vt: Vec<f32> = (0..kv_tile * d)
                    .map(|x| elem(Kv::V, x / d, x % d))
                    .collect();
                for r in 0..rows {
                    let p = p_first + r / g;
                    let wstart = if window != 0 && p + 1 > window {
                        p + 1 - window
                    } else {
                        0
                    };
                    let head = kv_head * g + r % g;
                    let slope = params.slope(head) * std::f32::consts::LOG2_E;
                    let qrow = &q[row_of(r) * d..][..d];
                    let logits: Vec<f32> = (0..kv_tile)
                        .map(|t| {
                            let pos = base + t;
                            if pos < kend && pos <= p && pos >= wstart {
                                let dot: f32 = (0..d).map(|i| qrow[i] * kt[t * d + i]).sum();
                                dot * scale_log2 + slope * (pos as f32 - p as f32)
                            } else {
                                f32::NEG_INFINITY
                            }
                        })
                        .collect();
                    let mt = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    if mt == f32::NEG_INFINITY {
                        continue;
                    }
                    let m_new = m[r].max(mt);
                    let corr = if m[r] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (m[r] - m_new).exp2()
                    };
                    let pr: Vec<f32> = logits
                        .iter()
                        .map(|&x| {
                            if x == f32::NEG_INFINITY {
                                0.0
                            } else {
                                (x - m_new).exp2()
                            }
                        })
                        .collect();
                    l[r] = l[r] * corr + pr.iter().sum::<f32>();
                    let a = &mut acc[r * d..][..d];
                    for (i, x) in a.iter_mut().enumerate() {
                        *x = *x * corr + (0..kv_tile).map(|t| pr[t] * vt[t * d + i]).sum::<f32>();
                    }
                    m[r] = m_new;
                }
                base += kv_tile;
            }
            for r in 0..rows {
                let row = row_of(r);
                let inv = if l[r] > 0.0 { v_scale / l[r] } else { 0.0 };
                for i in 0..d {
                    out[row * d + i] = acc[r * d + i] * inv;
                }
                lse[row] = if l[r] > 0.0 {
                    (m[r] + l[r].log2()) * std::f32::consts::LN_2
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    }
    Ok((out, lse))
}

/// Turns a reference output into `f32` rows, for comparisons.
pub fn reference_f32(r: &DecodeOutput) -> (Vec<f32>, Vec<f32>) {
    (
        r.out.iter().map(|&x| x as f32).collect(),
        r.lse.iter().map(|&x| x as f32).collect(),
    )
}

#[cfg(feature = "cuda")]
pub use gpu::CudaPrefill;

#[cfg(feature = "cuda")]
mod gpu {
    use super::{validate_prefill, PrefillTiles};
    use crate::attention::AttentionParams;
    use crate::error::{Error, Result};
    use crate::executor::cuda::{compile, driver_err, KernelSpec, PrefillSpec, PREFILL_WARPS};
    use crate::executor::storage::{CudaStorage, Storage};
    use crate::layout::shape::DType;
    use crate::tables::PaddedTables;
    use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

    /// The prefill kernel for one storage's layout, compiled and loaded.
    #[derive(Debug)]
    pub struct CudaPrefill {
        spec: PrefillSpec,
        func: CudaFunction,
    }

    impl CudaPrefill {
        /// Compiles (or fetches from the process cache) the specialisation for
        /// `storage`'s layout and loads it into its context.
        ///
        /// # Errors
        /// [`Error::Unsupported`] for a shape the kernel cannot take (see
        /// [`PrefillSpec::check`]); [`Error::CudaUnavailable`] without NVRTC;
        /// [`Error::Cuda`].
        pub fn new(storage: &CudaStorage) -> Result<Self> {
            let spec = PrefillSpec::for_layout(storage.layout());
            spec.check()?;
            let module = compile(&KernelSpec::Prefill(spec), storage.device().arch)?;
            let loaded = storage
                .context()
                .load_module(cudarc::nvrtc::Ptx::from_binary(module.cubin.clone()))
                .map_err(driver_err("cuModuleLoadData(paged_prefill)"))?;
            let func = loaded
                .load_function("paged_prefill")
                .map_err(driver_err("cuModuleGetFunction"))?;
            Ok(CudaPrefill { spec, func })
        }

        /// The compiled specialisation.
        pub fn spec(&self) -> PrefillSpec {
            self.spec
        }

        /// Runs prefill attention for one layer from and to host memory and waits:
        /// `q` is `[tokens, q_heads, head_dim]`, the result `(out, lse)` the same rows
        /// (lse in natural log), as [`crate::attention::reference::paged_prefill_reference`].
        /// Everything is validated before anything is enqueued; the launch runs on the
        /// storage's compute stream after the layer's last swap has landed.
        ///
        /// # Errors
        /// As [`validate_prefill`]; [`Error::ShapeMismatch`] for more tiles than the
        /// grid's y limit; [`Error::Cuda`].
        pub fn prefill_host(
            &self,
            storage: &CudaStorage,
            layer: usize,
            q: &[f32],
            query_start_loc: &[usize],
            tables: &PaddedTables,
            params: &AttentionParams,
        ) -> Result<(Vec<f32>, Vec<f32>)> {
            let layout = *storage.layout();
            let shape = validate_prefill(
                &layout,
                storage.num_blocks(),
                layer,
                q.len(),
                query_start_loc,
                tables,
                params,
            )?;
            let s = layout.shape();
            let rows = shape.tokens * s.num_q_heads;
            let tiles = PrefillTiles::plan(query_start_loc, self.spec.q_tile())?;
            if tiles.len() > 65535 {
                return Err(Error::ShapeMismatch {
                    what: "prefill tiles per launch (grid y limit)",
                    expected: 65535,
                    got: tiles.len(),
                });
            }
            if tiles.is_empty() {
                return Ok((Vec::new(), Vec::new()));
            }
            let region = storage.region_ptr(layer)?;
            let stream = storage.compute_stream();
            let up32 = |v: &[u32]| -> Result<CudaSlice<u32>> {
                stream
                    .clone_htod(if v.is_empty() { &[0][..] } else { v })
                    .map_err(driver_err("cuMemcpyHtoDAsync(prefill tables)"))
            };
            let qsl: Vec<u32> = query_start_loc.iter().map(|&x| x as u32).collect();
            let d_ids = up32(&tables.tables)?;
            let d_lens = up32(&tables.context_lens)?;
            let d_qsl = up32(&qsl)?;
            let d_seq = up32(&tiles.seq)?;
            let d_q0 = up32(&tiles.q0)?;
            let d_q = stream
                .clone_htod(q)
                .map_err(driver_err("cuMemcpyHtoDAsync(q)"))?;
            // Poisoned outputs: a row the kernel misses shows up as NaN.
            let mut d_out = stream
                .clone_htod(&vec![f32::NAN; rows * s.head_dim])
                .map_err(driver_err("cuMemcpyHtoDAsync(out)"))?;
            let mut d_lse = stream
                .clone_htod(&vec![f32::NAN; rows])
                .map_err(driver_err("cuMemcpyHtoDAsync(lse)"))?;
            let alibi = match &params.alibi_slopes {
                Some(a) => Some(
                    stream
                        .clone_htod(a)
                        .map_err(driver_err("cuMemcpyHtoDAsync(alibi)"))?,
                ),
                None => None,
            };
            let fp8 = s.kv_dtype == DType::Fp8E4M3;
            let scale_log2 =
                params.scale * if fp8 { params.k_scale } else { 1.0 } * std::f32::consts::LOG2_E;
            let v_scale = if fp8 { params.v_scale } else { 1.0 };
            let window = params.sliding_window.unwrap_or(0) as u32;
            let row_stride = tables.max_blocks as u32;
            let st = layout.strides();
            let (sb, skv, sh, stok) = (
                st.block as u64,
                st.kv as u64,
                st.head as u64,
                st.token as u64,
            );
            let null = 0u64;
            storage.wait_layer(layer)?;
            let cfg = LaunchConfig {
                grid_dim: (s.num_kv_heads as u32, tiles.len() as u32, 1),
                block_dim: (PREFILL_WARPS * 32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&self.func);
            b.arg(&mut d_out)
                .arg(&mut d_lse)
                .arg(&d_q)
                .arg(&region)
                .arg(&d_ids)
                .arg(&d_lens)
                .arg(&d_qsl)
                .arg(&d_seq)
                .arg(&d_q0)
                .arg(&row_stride)
                .arg(&sb)
                .arg(&skv)
                .arg(&sh)
                .arg(&stok);
            match &alibi {
                Some(a) => b.arg(a),
                None => b.arg(&null),
            };
            b.arg(&scale_log2).arg(&v_scale).arg(&window);
            // SAFETY: arguments match `paged_prefill` (kernels/paged_prefill.cu) compiled
            // for this layout's head dim, block size, group and dtype. Bounds: the grid
            // is (KV heads, tiles); each tile names a sequence below `batch` and a first
            // token inside its queries (PrefillTiles::plan), so the kernel reads and
            // writes rows below `tokens * q_heads`, which `q`, `out` and `lse` hold; the
            // tables were validated so that every entry read (the first
            // ceil(ctx / block_size) of each row) is below the arena's block count, and
            // the kernel reads positions below each context only; cache offsets use the
            // layout's strides, so reads stay in the mapped region.
            unsafe { b.launch(cfg) }.map_err(driver_err("cuLaunchKernel(paged_prefill)"))?;
            let o = stream
                .clone_dtoh(&d_out)
                .map_err(driver_err("cuMemcpyDtoH"))?;
            let l = stream
                .clone_dtoh(&d_lse)
                .map_err(driver_err("cuMemcpyDtoH"))?;
            stream
                .synchronize()
                .map_err(driver_err("cuStreamSynchronize"))?;
            Ok((o, l))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::reference::paged_prefill_reference;
    use crate::layout::shape::ModelShape;

    #[test]
    fn tiles_cover_every_query_once() {
        let qsl = [0, 5, 5, 21, 22];
        let t = PrefillTiles::plan(&qsl, 4).unwrap();
        assert_eq!(t.seq, vec![0, 0, 2, 2, 2, 2, 3]);
        assert_eq!(t.q0, vec![0, 4, 5, 9, 13, 17, 21]);
        let mut seen = [0; 22];
        for (&s, &q0) in t.seq.iter().zip(&t.q0) {
            let end = qsl[s as usize + 1];
            for n in &mut seen[q0 as usize..(q0 as usize + 4).min(end)] {
                *n += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1));
        assert!(PrefillTiles::plan(&[0], 4).unwrap().is_empty());
        assert!(PrefillTiles::plan(&[0, u32::MAX as usize + 1], 4).is_err());
    }

    fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// A storage of random non-zero K/V, tables over scattered blocks, and queries.
    fn case(
        dtype: DType,
        group: usize,
        ctxs: &[usize],
        qlens: &[usize],
    ) -> (HostStorage, PaddedTables, Vec<usize>, Vec<f32>) {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 2 * group,
            num_kv_heads: 2,
            head_dim: 32,
            kv_dtype: dtype,
        };
        let layout = KvLayout::new(shape, 4).unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let blocks_per: Vec<usize> = ctxs.iter().map(|c| c.div_ceil(4)).collect();
        let total: usize = blocks_per.iter().sum();
        let num_blocks = total + 3;
        let mut st = HostStorage::new(layout, num_blocks).unwrap();
        let n_elems = st.region(0).len() / dtype.size_bytes();
        let vals: Vec<f32> = (0..n_elems).map(|_| rng(&mut seed)).collect();
        crate::layout::convert::encode(dtype, &vals, 1.0, st.region_mut(0)).unwrap();
        let tables = crate::tables::test_tables::scrambled(ctxs, 4, num_blocks);
        let mut qsl = vec![0];
        for &q in qlens {
            qsl.push(qsl.last().unwrap() + q);
        }
        let q: Vec<f32> = (0..qsl[ctxs.len()] * shape.num_q_heads * 32)
            .map(|_| rng(&mut seed))
            .collect();
        (st, tables, qsl, q)
    }

    fn rel_err(a: &[f32], b: &[f64]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den.max(1e-30)).sqrt()
    }

    #[test]
    fn the_kernels_tiling_replayed_on_the_cpu_matches_the_f64_reference() {
        // Chunks with a cached prefix, a whole prompt, an empty chunk, a one-token
        // chunk (decode), chunks crossing tile and block boundaries; GQA 1 and 4;
        // every dtype; windows and ALiBi.
        let ctxs = [37, 9, 6, 70];
        let qlens = [13, 9, 0, 1];
        for dtype in [DType::F16, DType::BF16, DType::Fp8E4M3] {
            for group in [1, 4] {
                let (st, tables, qsl, q) = case(dtype, group, &ctxs, &qlens);
                let mut params = AttentionParams::new(32);
                if dtype == DType::Fp8E4M3 {
                    params.k_scale = 0.5;
                    params.v_scale = 2.0;
                }
                for (window, alibi) in [(None, false), (Some(5), true), (Some(40), false)] {
                    params.sliding_window = window;
                    params.alibi_slopes =
                        alibi.then(|| (0..2 * group).map(|h| 0.1 * (h + 1) as f32).collect());
                    let want = paged_prefill_reference(&st, 0, &q, &qsl, &tables, &params).unwrap();
                    for (q_tile, kv_tile) in [(16 / group, 32), (3, 5), (1, 1)] {
                        let (out, lse) =
                            replay_tiling(&st, 0, &q, &qsl, &tables, &params, q_tile, kv_tile)
                                .unwrap();
                        let e = rel_err(&out, &want.out);
                        assert!(
                            e < 1e-5,
                            "{dtype} g{group} {window:?} tiles {q_tile}/{kv_tile}: {e}"
                        );
                        for (a, b) in lse.iter().zip(&want.lse) {
                            assert!(
                                (*a as f64 - b).abs() < 1e-4 * b.abs().max(1.0),
                                "lse {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn chunks_cover_every_tail_token_once_in_order() {
        let tables = PaddedTables {
            tables: vec![0; 3 * 4],
            context_lens: vec![37, 9, 20],
            batch: 3,
            max_blocks: 4,
        };
        let computed = [5, 9, 0];
        for chunk in [0, 1, 7, 16, 40] {
            let plan = plan_chunks(&tables, &computed, chunk).unwrap();
            let mut next = computed.to_vec();
            for launch in &plan {
                for (i, done) in next.iter_mut().enumerate() {
                    let r = &launch.positions[i];
                    // Each launch continues where the last one stopped, ends at its
                    // context, and counts its queries in query_start_loc.
                    assert_eq!(r.start, *done);
                    assert_eq!(r.end, launch.tables.context_lens[i] as usize);
                    assert_eq!(
                        launch.query_start_loc[i + 1] - launch.query_start_loc[i],
                        r.len()
                    );
                    assert!(chunk == 0 || r.len() <= chunk);
                    *done = r.end;
                }
                assert_eq!(launch.tables.tables, tables.tables);
            }
            let want: Vec<usize> = tables.context_lens.iter().map(|&c| c as usize).collect();
            assert_eq!(next, want, "chunk {chunk}");
            let longest: usize = 32; // sequence 0: 37 - 5
            let launches = if chunk == 0 {
                1
            } else {
                longest.div_ceil(chunk)
            };
            assert_eq!(plan.len(), launches, "chunk {chunk}");
        }
        assert!(plan_chunks(&tables, &[37, 9, 20], 4).unwrap().is_empty());
        assert!(matches!(
            plan_chunks(&tables, &[0, 0], 4),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            plan_chunks(&tables, &[0, 10, 0], 4),
            Err(Error::InvalidConfig { .. })
        ));
    }

    #[test]
    fn multi_query_verification_is_successive_decode_steps() {
        // Drafts of 4, 1, 0 and 7 tokens; the kernel's tile sizes and smaller ones.
        let ctxs = [37, 9, 6, 70];
        let drafts = [4, 1, 0, 7];
        for dtype in [DType::BF16, DType::Fp8E4M3] {
            for group in [1, 4] {
                let (st, tables, qsl, q) = case(dtype, group, &ctxs, &drafts);
                assert_eq!(verify_query_start_loc(&tables, &drafts).unwrap(), qsl);
                let mut params = AttentionParams::new(32);
                params.alibi_slopes = Some((0..2 * group).map(|h| 0.1 * (h + 1) as f32).collect());
                params.sliding_window = Some(30);
                let layout = *st.layout();
                let row = layout.shape().num_q_heads * 32;
                for (q_tile, kv_tile) in [kernel_tile_sizes(&layout), (3, 5)] {
                    let (out, _) =
                        replay_tiling(&st, 0, &q, &qsl, &tables, &params, q_tile, kv_tile).unwrap();
                    for (i, &k) in drafts.iter().enumerate() {
                        for j in 0..k {
                            // Decode step j of sequence i: its context ends at the draft.
                            let one = PaddedTables {
                                tables: tables.row(i).to_vec(),
                                context_lens: vec![(ctxs[i] - k + j + 1) as u32],
                                batch: 1,
                                max_blocks: tables.max_blocks,
                            };
                            let t = qsl[i] + j;
                            let qrow = &q[t * row..(t + 1) * row];
                            let mut want = vec![0f32; row];
                            crate::attention::cpu::paged_decode(
                                &st, 0, qrow, &one, &params, &mut want, None,
                            )
                            .unwrap();
                            let got = &out[t * row..(t + 1) * row];
                            let err = got
                                .iter()
                                .zip(&want)
                                .map(|(a, b)| (a - b).abs())
                                .fold(0.0f32, f32::max);
                            assert!(err < 1e-5, "{dtype} g{group} seq {i} draft {j}: {err}");
                        }
                    }
                }
            }
        }
        let (_, tables, _, _) = case(DType::BF16, 1, &ctxs, &drafts);
        assert!(verify_query_start_loc(&tables, &[1, 2]).is_err());
        assert!(verify_query_start_loc(&tables, &[1, 10, 0, 0]).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn tile_sizes_are_the_compiled_specs() {
        for (head_dim, group) in [(64, 1), (64, 4), (128, 8), (128, 32), (256, 2)] {
            let shape = ModelShape {
                num_layers: 1,
                num_q_heads: 2 * group,
                num_kv_heads: 2,
                head_dim,
                kv_dtype: DType::BF16,
            };
            let layout = KvLayout::new(shape, 16).unwrap();
            let spec = crate::executor::cuda::PrefillSpec::for_layout(&layout);
            assert_eq!(kernel_tile_sizes(&layout), (spec.q_tile(), spec.kv_tile()));
        }
    }

    #[test]
    fn validation_rejects_before_any_launch() {
        let (st, tables, qsl, q) = case(DType::BF16, 1, &[10, 5], &[4, 5]);
        let l = *st.layout();
        let p = AttentionParams::new(32);
        let ok = validate_prefill(&l, st.num_blocks(), 0, q.len(), &qsl, &tables, &p).unwrap();
        assert_eq!((ok.tokens, ok.batch), (9, 2));
        assert!(ok.blocks_needed <= st.num_blocks());
        // Arena shrunk below the tables, wrong q length, bad offsets, bad layer.
        assert!(validate_prefill(&l, 2, 0, q.len(), &qsl, &tables, &p).is_err());
        assert!(validate_prefill(&l, st.num_blocks(), 0, q.len() - 1, &qsl, &tables, &p).is_err());
        assert!(
            validate_prefill(&l, st.num_blocks(), 0, q.len(), &[0, 3, 9], &tables, &p).is_err()
        );
        assert!(
            validate_prefill(&l, st.num_blocks(), 0, q.len(), &[1, 4, 9], &tables, &p).is_err()
        );
        assert!(validate_prefill(&l, st.num_blocks(), 1, q.len(), &qsl, &tables, &p).is_err());
    }
}
