//! The fast CPU path: rayon paged decode with split-KV, chunked prefill, a contiguous
//! baseline running the same kernel, and `reshape_and_cache`.
//!
//! # How it works
//!
//! Work is cut into jobs of one sequence and one KV head (decode: also one KV split;
//! prefill: also a chunk of query tokens). A job holds the `group` query heads that share
//! the KV head as *rows*, and walks the KV positions tile by tile, a tile being the part
//! of one page inside the range (never more than `block_size` tokens, never across a
//! page). Each tile of K and V is used in place when the cache is `f32`, and decoded once
//! into a small per-thread buffer otherwise, then serves every row: `f32` dot products,
//! an online (running-max) softmax, and `p . V` accumulated in `f32`.
//!
//! Splits cut the KV axis at multiples of `split_tokens`. Each split keeps its own
//! `(max, sum, acc)` state; states are folded in position order with one shared function,
//! whether the splits ran as separate jobs (decode) or one after another inside a job
//! (prefill). So a row's result depends only on its own query, its range, the block size
//! and `split_tokens`: never on the batch it ran in, the other rows of its job, the
//! number of threads, or which blocks hold its pages. Decode and prefill of the same
//! token with the same `split_tokens` give bit-identical outputs.
//!
//! While a tile is computed, the next one (usually a page elsewhere in the arena) is
//! prefetched. On x86-64 the kernels are compiled twice and the AVX2+FMA+F16C copy is
//! chosen at run time; elsewhere (and without those features) the portable copy runs. The
//! two copies round differently (FMA, exp polynomial), so bit-identity holds within one
//! machine, not across them.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::kernels::Avx2;
use super::kernels::{Kern, Portable};
use super::{check_decode_q, check_paged, check_prefill_q, AttentionParams};
use crate::error::{Error, Result};
use crate::executor::storage::{HostStorage, Storage};
use crate::ids::BlockId;
use crate::layout::convert::{check_scale, encode_unchecked, fp8_e4m3_table};
use crate::layout::shape::DType;
use crate::layout::{Kv, KvLayout, Slot};
use crate::tables::PaddedTables;

/// The planner never cuts splits shorter than this many tokens.
pub const MIN_SPLIT_TOKENS: usize = 256;

/// Tokens per tile of [`contiguous_decode`] (the paged kernels use the block size).
pub const CONTIGUOUS_TILE_TOKENS: usize = 16;

/// Query tokens per prefill job, at most.
const MAX_PREFILL_CHUNK: usize = 16;

/// Chooses `split_tokens` for a decode batch: no split (`usize::MAX`) when sequences times
/// KV heads already give every thread several jobs, or when the longest context is short;
/// otherwise splits of equal work so that there are about four jobs per thread, each of at
/// least [`MIN_SPLIT_TOKENS`] tokens, rounded up to whole blocks.
pub fn plan_split_tokens(
    context_lens: &[u32],
    num_kv_heads: usize,
    block_size: usize,
    threads: usize,
) -> usize {
    let max_ctx = context_lens.iter().copied().max().unwrap_or(0) as usize;
    let live = context_lens.iter().filter(|&&c| c > 0).count();
    let target = threads.max(1) * 4;
    if live * num_kv_heads >= target || max_ctx <= MIN_SPLIT_TOKENS {
        return usize::MAX;
    }
    let total: usize = context_lens.iter().map(|&c| c as usize).sum::<usize>() * num_kv_heads;
    let per_job = total.div_ceil(target).max(MIN_SPLIT_TOKENS);
    let s = per_job.div_ceil(block_size.max(1)) * block_size.max(1);
    if s >= max_ctx {
        usize::MAX
    } else {
        s
    }
}

/// Number of KV splits a context of `ctx` tokens (attending from `start`) gets.
pub fn num_splits(start: usize, ctx: usize, split_tokens: usize) -> usize {
    let mut n = 0;
    let mut t = start;
    while t < ctx {
        t = next_boundary(t, split_tokens).min(ctx);
        n += 1;
    }
    n
}

#[inline(always)]
fn next_boundary(t: usize, split_tokens: usize) -> usize {
    (t / split_tokens + 1).saturating_mul(split_tokens)
}

fn check_split(split_tokens: usize) -> Result<()> {
    if split_tokens == 0 {
        return Err(Error::config("split_tokens", "must be positive"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// KV sources: where the rows of a tile live.

/// Gives the kernels the bytes of K or V rows.
trait KvSource: Sync {
    /// End (exclusive) of the tile holding position `t`.
    fn tile_end(&self, t: usize) -> usize;
    /// Most rows a tile can have.
    fn max_tile(&self) -> usize;
    /// Bytes of `n` rows from position `t`, and the row stride in elements. The slice
    /// is `((n - 1) * stride + head_dim) * elem` bytes long.
    fn rows(&self, seq: usize, kv_head: usize, kv: Kv, t: usize, n: usize) -> (&[u8], usize);
}

struct PagedSource<'a> {
    layout: &'a KvLayout,
    region: &'a [u8],
    tables: &'a PaddedTables,
}

impl KvSource for PagedSource<'_> {
    #[inline(always)]
    fn tile_end(&self, t: usize) -> usize {
        let bs = self.layout.block_size();
        (t / bs + 1) * bs
    }
    fn max_tile(&self) -> usize {
        self.layout.block_size()
    }
    #[inline(always)]
    fn rows(&self, seq: usize, kv_head: usize, kv: Kv, t: usize, n: usize) -> (&[u8], usize) {
        let bs = self.layout.block_size();
        let block = self.tables.tables[seq * self.tables.max_blocks + t / bs];
        let es = self.layout.dtype().size_bytes();
        let d = self.layout.shape().head_dim;
        let start = self.layout.elem_offset(BlockId(block), kv, kv_head, t % bs) * es;
        (&self.region[start..start + n * d * es], d)
    }
}

/// A contiguous KV cache, `[batch, max_tokens, kv_heads, head_dim]` per K and V, in
/// `dtype` (little-endian bytes): the layout of engines without paging.
#[derive(Debug, Clone, Copy)]
pub struct ContiguousKv<'a> {
    /// Keys.
    pub k: &'a [u8],
    /// Values.
    pub v: &'a [u8],
    /// Element type.
    pub dtype: DType,
    /// Sequences.
    pub batch: usize,
    /// Tokens reserved per sequence.
    pub max_tokens: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl ContiguousKv<'_> {
    /// Bytes of K (or V) for this shape.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] (field `max_tokens`) when the product does not fit in a
    /// `usize`: a wrapped size would let short slices pass the length check.
    pub fn bytes(&self) -> Result<usize> {
        [
            self.max_tokens,
            self.num_kv_heads,
            self.head_dim,
            self.dtype.size_bytes(),
        ]
        .iter()
        .try_fold(self.batch, |acc, &n| acc.checked_mul(n))
        .ok_or(Error::OutOfRange {
            field: "max_tokens",
            value: self.max_tokens as f64,
            allowed: "batch * max_tokens * num_kv_heads * head_dim * dtype bytes within usize",
        })
    }

    /// Byte offset of `(seq, token, kv_head)`.
    pub fn offset(&self, seq: usize, token: usize, kv_head: usize) -> usize {
        ((seq * self.max_tokens + token) * self.num_kv_heads + kv_head)
            * self.head_dim
            * self.dtype.size_bytes()
    }
}

struct ContiguousSource<'a> {
    kv: ContiguousKv<'a>,
}

impl KvSource for ContiguousSource<'_> {
    #[inline(always)]
    fn tile_end(&self, t: usize) -> usize {
        (t / CONTIGUOUS_TILE_TOKENS + 1) * CONTIGUOUS_TILE_TOKENS
    }
    fn max_tile(&self) -> usize {
        CONTIGUOUS_TILE_TOKENS
    }
    #[inline(always)]
    fn rows(&self, seq: usize, kv_head: usize, kv: Kv, t: usize, n: usize) -> (&[u8], usize) {
        let c = &self.kv;
        let stride = c.num_kv_heads * c.head_dim;
        let start = c.offset(seq, t, kv_head);
        let len = ((n - 1) * stride + c.head_dim) * c.dtype.size_bytes();
        let data = match kv {
            Kv::K => c.k,
            Kv::V => c.v,
        };
        (&data[start..start + len], stride)
    }
}

// ---------------------------------------------------------------------------------------
// Tiles as f32.

fn cast_f32(b: &[u8]) -> Option<&[f32]> {
    if cfg!(target_endian = "big") {
        return None;
    }
    // SAFETY: every bit pattern is a valid `f32`, and `align_to` only puts correctly
    // aligned, in-bounds elements in the middle part; we use it only when it is the whole.
    let (pre, mid, post) = unsafe { b.align_to::<f32>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// The tile as `f32` rows: in place for an aligned `f32` cache, else decoded into
/// `scratch`. Returns the rows and their stride.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile_f32<'s, K: Kern>(
    dtype: DType,
    bytes: &'s [u8],
    stride: usize,
    n: usize,
    d: usize,
    lut: &[f32; 256],
    scale: f32,
    scratch: &'s mut [f32],
) -> (&'s [f32], usize) {
    if dtype == DType::F32 {
        if let Some(x) = cast_f32(bytes) {
            return (x, stride);
        }
    }
    let es = dtype.size_bytes();
    if stride == d {
        K::decode(dtype, bytes, lut, scale, &mut scratch[..n * d]);
    } else {
        for r in 0..n {
            let src = &bytes[r * stride * es..(r * stride + d) * es];
            K::decode(dtype, src, lut, scale, &mut scratch[r * d..(r + 1) * d]);
        }
    }
    (&scratch[..n * d], d)
}

// ---------------------------------------------------------------------------------------
// The arithmetic.

/// One query row of a job.
#[derive(Debug, Clone, Copy)]
struct Row {
    /// Offset of the row's query vector in `q`.
    qoff: usize,
    /// The query's position.
    pos: usize,
    /// Positions the row attends to in the current split: `start..end`.
    start: usize,
    end: usize,
    slope: f32,
    /// Running max and sum of the current split.
    m: f32,
    l: f32,
}

/// Folds a split's state `(m, l, a)` into a running total `(tm, tl, ta)`; a split without
/// tokens (`l == 0`) changes nothing, and the first split is copied.
#[inline(always)]
fn fold(tm: &mut f32, tl: &mut f32, ta: &mut [f32], m: f32, l: f32, a: &[f32]) {
    if l == 0.0 {
        return;
    }
    if *tl == 0.0 {
        *tm = m;
        *tl = l;
        ta.copy_from_slice(a);
        return;
    }
    let nm = tm.max(m);
    let (ca, cb) = ((*tm - nm).exp(), (m - nm).exp());
    *tl = *tl * ca + l * cb;
    for (x, &y) in ta.iter_mut().zip(a) {
        *x = *x * ca + y * cb;
    }
    *tm = nm;
}

/// Writes the normalised output of a final state and returns its lse.
#[inline(always)]
fn finish(m: f32, l: f32, acc: &[f32], out: &mut [f32]) -> f32 {
    if l == 0.0 {
        out.fill(0.0);
        return f32::NEG_INFINITY;
    }
    let inv = 1.0 / l;
    for (o, &a) in out.iter_mut().zip(acc) {
        *o = a * inv;
    }
    m + l.ln()
}

/// Per-call constants.
struct Ctx<'a, S> {
    src: &'a S,
    q: &'a [f32],
    dtype: DType,
    d: usize,
    group: usize,
    q_heads: usize,
    kv_heads: usize,
    scale: f32,
    params: &'a AttentionParams,
    k_lut: [f32; 256],
    v_lut: [f32; 256],
    split_tokens: usize,
}

/// Per-thread buffers.
#[derive(Default)]
struct Scratch {
    rows: Vec<Row>,
    acc: Vec<f32>,
    tot: Vec<f32>,
    tot_ml: Vec<(f32, f32)>,
    logits: Vec<f32>,
    kt: Vec<f32>,
    vt: Vec<f32>,
}

impl Scratch {
    fn new(max_tile: usize, d: usize, group: usize) -> Self {
        Scratch {
            logits: vec![0.0; max_tile * group],
            kt: vec![0.0; max_tile * d],
            vt: vec![0.0; max_tile * d],
            ..Default::default()
        }
    }
}

/// Runs `rows` over the positions `lo..hi` (inside one split) of `(seq, kv_head)`, tile by
/// tile, updating each row's `(m, l)` and its accumulator in `acc` (`rows * d`). Rows come
/// in groups of `group` (one query token's heads of this KV head) that share their range
/// and whose query vectors are contiguous in `q`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn run_range<K: Kern, S: KvSource>(
    cx: &Ctx<'_, S>,
    seq: usize,
    kv_head: usize,
    lo: usize,
    hi: usize,
    rows: &mut [Row],
    acc: &mut [f32],
    logits: &mut [f32],
    kt: &mut [f32],
    vt: &mut [f32],
) {
    let (d, g) = (cx.d, cx.group);
    let mut t0 = lo;
    while t0 < hi {
        let t1 = cx.src.tile_end(t0).min(hi);
        let n = t1 - t0;
        let (kb, ks) = cx.src.rows(seq, kv_head, Kv::K, t0, n);
        let (k, ks) = tile_f32::<K>(cx.dtype, kb, ks, n, d, &cx.k_lut, cx.params.k_scale, kt);
        let (vb, vs) = cx.src.rows(seq, kv_head, Kv::V, t0, n);
        let (v, vs) = tile_f32::<K>(cx.dtype, vb, vs, n, d, &cx.v_lut, cx.params.v_scale, vt);
        if t1 < hi {
            // The next tile is usually another page somewhere else in the arena: ask for
            // it now, while this one is computed.
            let n2 = cx.src.tile_end(t1).min(hi) - t1;
            let es = cx.dtype.size_bytes();
            for kv in [Kv::K, Kv::V] {
                let (b, st) = cx.src.rows(seq, kv_head, kv, t1, n2);
                K::prefetch(b, n2, d * es, st * es);
            }
        }
        for (gi, grp) in rows.chunks_mut(g).enumerate() {
            let (a, b) = (grp[0].start.max(t0), grp[0].end.min(t1));
            if a >= b {
                continue;
            }
            let m = b - a;
            let q0 = grp[0].qoff;
            let lg = &mut logits[..g * m];
            K::qk(&cx.q[q0..q0 + g * d], g, d, &k[(a - t0) * ks..], ks, m, lg);
            for (j, row) in grp.iter_mut().enumerate() {
                let lr = &mut lg[j * m..(j + 1) * m];
                let dist0 = (a as i64 - row.pos as i64) as f32;
                let mx = K::bias_max(lr, cx.scale, row.slope, dist0);
                let r = gi * g + j;
                let ar = &mut acc[r * d..(r + 1) * d];
                let m_new = row.m.max(mx);
                if m_new > row.m {
                    if row.l != 0.0 {
                        let c = (row.m - m_new).exp();
                        row.l *= c;
                        for x in ar.iter_mut() {
                            *x *= c;
                        }
                    }
                    row.m = m_new;
                }
                let sum = K::exp_sum(lr, m_new);
                row.l += sum;
                K::pv(ar, lr, &v[(a - t0) * vs..], vs);
            }
        }
        t0 = t1;
    }
}

/// One decode job: `group` rows of one sequence and KV head over one split `lo..hi`.
/// Writes `[m; group][l; group][acc; group * d]` into `part`.
#[inline(always)]
fn decode_job<K: Kern, S: KvSource>(
    cx: &Ctx<'_, S>,
    job: &DecodeJob,
    part: &mut [f32],
    sc: &mut Scratch,
) {
    let (g, d) = (cx.group, cx.d);
    let (ml, acc) = part.split_at_mut(2 * g);
    acc.fill(0.0);
    sc.rows.clear();
    for j in 0..g {
        let h = job.kv_head * g + j;
        sc.rows.push(Row {
            qoff: (job.seq * cx.q_heads + h) * d,
            pos: job.pos,
            start: job.lo,
            end: job.hi,
            slope: cx.params.slope(h),
            m: f32::NEG_INFINITY,
            l: 0.0,
        });
    }
    let Scratch {
        rows,
        logits,
        kt,
        vt,
        ..
    } = sc;
    run_range::<K, S>(
        cx,
        job.seq,
        job.kv_head,
        job.lo,
        job.hi,
        rows,
        acc,
        logits,
        kt,
        vt,
    );
    for (j, row) in rows.iter().enumerate() {
        ml[j] = row.m;
        ml[g + j] = row.l;
    }
}

/// One prefill job: query tokens `tok0..tok1` of one sequence, every KV head; writes
/// `out` (`[tokens, q_heads, d]`) and `lse` (`[tokens, q_heads]`) of those tokens.
#[inline(always)]
fn prefill_job<K: Kern, S: KvSource>(
    cx: &Ctx<'_, S>,
    job: &PrefillJob,
    out: &mut [f32],
    lse: &mut [f32],
    sc: &mut Scratch,
) {
    let (g, d, qh) = (cx.group, cx.d, cx.q_heads);
    let nt = job.tok1 - job.tok0;
    let nrows = nt * g;
    let Scratch {
        rows,
        acc,
        tot,
        tot_ml,
        logits,
        kt,
        vt,
    } = sc;
    acc.resize(nrows * d, 0.0);
    tot.resize(nrows * d, 0.0);
    for kv_head in 0..cx.kv_heads {
        rows.clear();
        let (mut lo, mut hi) = (usize::MAX, 0);
        for i in 0..nt {
            let pos = job.first_pos + i;
            let start = cx.params.window_start(pos);
            lo = lo.min(start);
            hi = hi.max(pos + 1);
            for j in 0..g {
                let h = kv_head * g + j;
                rows.push(Row {
                    qoff: ((job.tok0 + i) * qh + h) * d,
                    pos,
                    start,
                    end: pos + 1,
                    slope: cx.params.slope(h),
                    m: f32::NEG_INFINITY,
                    l: 0.0,
                });
            }
        }
        tot_ml.clear();
        tot_ml.resize(nrows, (f32::NEG_INFINITY, 0.0));
        let mut s0 = lo;
        while s0 < hi {
            let s1 = next_boundary(s0, cx.split_tokens).min(hi);
            for row in rows.iter_mut() {
                row.m = f32::NEG_INFINITY;
                row.l = 0.0;
            }
            acc[..nrows * d].fill(0.0);
            run_range::<K, S>(
                cx,
                job.seq,
                kv_head,
                s0,
                s1,
                rows,
                &mut acc[..nrows * d],
                logits,
                kt,
                vt,
            );
            for (r, row) in rows.iter().enumerate() {
                let (tm, tl) = &mut tot_ml[r];
                fold(
                    tm,
                    tl,
                    &mut tot[r * d..(r + 1) * d],
                    row.m,
                    row.l,
                    &acc[r * d..(r + 1) * d],
                );
            }
            s0 = s1;
        }
        for i in 0..nt {
            for j in 0..g {
                let r = i * g + j;
                let h = kv_head * g + j;
                let (m, l) = tot_ml[r];
                let o = &mut out[(i * qh + h) * d..(i * qh + h + 1) * d];
                lse[i * qh + h] = finish(m, l, &tot[r * d..(r + 1) * d], o);
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct DecodeJob {
    seq: usize,
    kv_head: usize,
    pos: usize,
    lo: usize,
    hi: usize,
}

#[derive(Debug, Clone, Copy)]
struct PrefillJob {
    seq: usize,
    /// Global query token range of the job.
    tok0: usize,
    tok1: usize,
    /// Position of query token `tok0`.
    first_pos: usize,
}

/// Which copy of the kernels runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            return Isa::Avx2Fma;
        }
    }
    Isa::Portable
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_job_avx2<S: KvSource>(
    cx: &Ctx<'_, S>,
    job: &DecodeJob,
    part: &mut [f32],
    sc: &mut Scratch,
) {
    decode_job::<Avx2, S>(cx, job, part, sc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefill_job_avx2<S: KvSource>(
    cx: &Ctx<'_, S>,
    job: &PrefillJob,
    out: &mut [f32],
    lse: &mut [f32],
    sc: &mut Scratch,
) {
    prefill_job::<Avx2, S>(cx, job, out, lse, sc)
}

fn run_decode_job<S: KvSource>(
    isa: Isa,
    cx: &Ctx<'_, S>,
    job: &DecodeJob,
    part: &mut [f32],
    sc: &mut Scratch,
) {
    match isa {
        Isa::Portable => decode_job::<Portable, S>(cx, job, part, sc),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2Fma` is only chosen after detecting AVX2, FMA and F16C at run time.
        Isa::Avx2Fma => unsafe { decode_job_avx2(cx, job, part, sc) },
    }
}

fn run_prefill_job<S: KvSource>(
    isa: Isa,
    cx: &Ctx<'_, S>,
    job: &PrefillJob,
    out: &mut [f32],
    lse: &mut [f32],
    sc: &mut Scratch,
) {
    match isa {
        Isa::Portable => prefill_job::<Portable, S>(cx, job, out, lse, sc),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2Fma` is only chosen after detecting AVX2, FMA and F16C at run time.
        Isa::Avx2Fma => unsafe { prefill_job_avx2(cx, job, out, lse, sc) },
    }
}

// ---------------------------------------------------------------------------------------
// Drivers.

#[allow(clippy::too_many_arguments)]
fn make_ctx<'a, S>(
    src: &'a S,
    q: &'a [f32],
    dtype: DType,
    d: usize,
    q_heads: usize,
    kv_heads: usize,
    params: &'a AttentionParams,
    split_tokens: usize,
) -> Ctx<'a, S> {
    let fp8 = dtype == DType::Fp8E4M3;
    Ctx {
        src,
        q,
        dtype,
        d,
        group: q_heads / kv_heads,
        q_heads,
        kv_heads,
        scale: params.scale,
        params,
        k_lut: if fp8 {
            fp8_e4m3_table(params.k_scale)
        } else {
            [0.0; 256]
        },
        v_lut: if fp8 {
            fp8_e4m3_table(params.v_scale)
        } else {
            [0.0; 256]
        },
        split_tokens,
    }
}

/// Runs a decode batch: jobs `(seq, kv_head, split)`, then a fold of the splits.
fn decode_driver<S: KvSource>(
    cx: &Ctx<'_, S>,
    isa: Isa,
    context_lens: &[u32],
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    let (g, d, qh) = (cx.group, cx.d, cx.q_heads);
    let mut jobs = Vec::new();
    // Per sequence: first job and splits per KV head.
    let mut first = Vec::with_capacity(context_lens.len());
    for (seq, &ctx) in context_lens.iter().enumerate() {
        let ctx = ctx as usize;
        if ctx == 0 {
            first.push((jobs.len(), 0usize));
            continue;
        }
        let pos = ctx - 1;
        let start = cx.params.window_start(pos);
        let n = num_splits(start, ctx, cx.split_tokens);
        first.push((jobs.len(), n));
        for kv_head in 0..cx.kv_heads {
            let mut lo = start;
            while lo < ctx {
                let hi = next_boundary(lo, cx.split_tokens).min(ctx);
                jobs.push(DecodeJob {
                    seq,
                    kv_head,
                    pos,
                    lo,
                    hi,
                });
                lo = hi;
            }
        }
    }
    let part_len = g * (d + 2);
    let mut parts = vec![0f32; jobs.len() * part_len];
    let max_tile = cx.src.max_tile();
    jobs.par_iter()
        .zip(parts.par_chunks_mut(part_len))
        .for_each_init(
            || Scratch::new(max_tile, d, cx.group),
            |sc, (job, part)| run_decode_job(isa, cx, job, part, sc),
        );
    let mut lse_buf;
    let lse = match lse {
        Some(l) => l,
        None => {
            lse_buf = vec![0f32; context_lens.len() * qh];
            &mut lse_buf[..]
        }
    };
    out.par_chunks_mut(qh * d)
        .zip(lse.par_chunks_mut(qh))
        .enumerate()
        .for_each_init(
            || vec![0f32; d],
            |tot, (seq, (out, lse))| {
                let (j0, n) = first[seq];
                for kv_head in 0..cx.kv_heads {
                    for j in 0..g {
                        let h = kv_head * g + j;
                        let (mut tm, mut tl) = (f32::NEG_INFINITY, 0.0f32);
                        for s in 0..n {
                            let part = &parts[(j0 + kv_head * n + s) * part_len..][..part_len];
                            let acc = &part[2 * g + j * d..2 * g + (j + 1) * d];
                            fold(&mut tm, &mut tl, tot, part[j], part[g + j], acc);
                        }
                        lse[h] = finish(tm, tl, tot, &mut out[h * d..(h + 1) * d]);
                    }
                }
            },
        );
}

/// Runs a prefill batch: jobs `(seq, chunk of query tokens)`, every KV head, splits folded
/// inside the job.
fn prefill_driver<S: KvSource>(
    cx: &Ctx<'_, S>,
    isa: Isa,
    context_lens: &[u32],
    query_start_loc: &[usize],
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    let (d, qh) = (cx.d, cx.q_heads);
    let tokens = *query_start_loc.last().unwrap_or(&0);
    let threads = rayon::current_num_threads();
    let chunk = (tokens / (threads * 4)).clamp(1, MAX_PREFILL_CHUNK);
    let mut jobs = Vec::new();
    for (seq, &ctx) in context_lens.iter().enumerate() {
        let (a, b) = (query_start_loc[seq], query_start_loc[seq + 1]);
        let first_pos = ctx as usize - (b - a);
        let mut t = a;
        while t < b {
            let e = (t + chunk).min(b);
            jobs.push(PrefillJob {
                seq,
                tok0: t,
                tok1: e,
                first_pos: first_pos + (t - a),
            });
            t = e;
        }
    }
    let mut lse_buf;
    let lse = match lse {
        Some(l) => l,
        None => {
            lse_buf = vec![0f32; tokens * qh];
            &mut lse_buf[..]
        }
    };
    // Cut the outputs into the jobs' token ranges (jobs are in token order).
    let mut pieces = Vec::with_capacity(jobs.len());
    let (mut out_rest, mut lse_rest) = (out, lse);
    for job in &jobs {
        let nt = job.tok1 - job.tok0;
        let (o, or) = std::mem::take(&mut out_rest).split_at_mut(nt * qh * d);
        let (l, lr) = std::mem::take(&mut lse_rest).split_at_mut(nt * qh);
        pieces.push((job, o, l));
        out_rest = or;
        lse_rest = lr;
    }
    let max_tile = cx.src.max_tile();
    pieces.into_par_iter().for_each_init(
        || Scratch::new(max_tile, d, cx.group),
        |sc, (job, o, l)| run_prefill_job(isa, cx, job, o, l, sc),
    );
}

fn check_out(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::ShapeMismatch {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// Paged decode attention: one query token per sequence (at position `context_len - 1`)
/// over its context, read in place through `tables`. `q` and `out` are
/// `[batch, q_heads, head_dim]`; `lse`, when given, `[batch, q_heads]`. The KV axis is split
/// as [`plan_split_tokens`] decides for the global rayon pool.
///
/// # Errors
/// Before any read: [`Error::ShapeMismatch`] for a bad layer, `q`, `out` or `lse` length,
/// table shape or slope count; [`Error::CorruptBlockTable`] for a context longer than its
/// table covers; [`Error::BlockOutOfRange`] for a table entry outside the arena;
/// [`Error::InvalidConfig`] for a bad shape or parameter.
pub fn paged_decode(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    tables: &PaddedTables,
    params: &AttentionParams,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    let layout = storage.layout();
    let split = plan_split_tokens(
        &tables.context_lens,
        layout.shape().num_kv_heads,
        layout.block_size(),
        rayon::current_num_threads(),
    );
    paged_decode_split(storage, layer, q, tables, params, split, out, lse)
}

/// [`paged_decode`] with the KV axis cut at every multiple of `split_tokens` (any positive
/// value; `usize::MAX` for no split).
///
/// # Errors
/// As [`paged_decode`], plus [`Error::InvalidConfig`] for `split_tokens == 0`.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_split(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    tables: &PaddedTables,
    params: &AttentionParams,
    split_tokens: usize,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    let layout = storage.layout();
    let batch = check_paged(layout, storage.num_blocks(), layer, tables, params, None)?;
    check_decode_q(layout, batch, q.len())?;
    check_split(split_tokens)?;
    let s = layout.shape();
    check_out("out elements", q.len(), out.len())?;
    if let Some(l) = &lse {
        check_out("lse elements", batch * s.num_q_heads, l.len())?;
    }
    let src = PagedSource {
        layout,
        region: storage.region(layer),
        tables,
    };
    let cx = make_ctx(
        &src,
        q,
        layout.dtype(),
        s.head_dim,
        s.num_q_heads,
        s.num_kv_heads,
        params,
        split_tokens,
    );
    decode_driver(&cx, isa(), &tables.context_lens, out, lse);
    Ok(())
}

/// Paged (chunked) prefill attention: sequence `i` brings the query tokens
/// `query_start_loc[i]..query_start_loc[i + 1]` of `q`, the last tokens of its context
/// (their K/V already in the cache, see [`reshape_and_cache`]), each attending causally
/// to the cached prefix and to the new tokens up to itself. `q` and `out` are
/// `[tokens, q_heads, head_dim]`, `lse` `[tokens, q_heads]`.
///
/// `split_tokens` (`None`: no split) cuts the KV axis as in [`paged_decode_split`]; with
/// the same value, a token's output is bit-identical to decoding it.
///
/// # Errors
/// As [`paged_decode`], plus [`Error::ShapeMismatch`] or [`Error::InvalidConfig`] for
/// `query_start_loc` (wrong length, decreasing, more queries than context) or
/// `split_tokens == Some(0)`.
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    query_start_loc: &[usize],
    tables: &PaddedTables,
    params: &AttentionParams,
    split_tokens: Option<usize>,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    let layout = storage.layout();
    check_paged(
        layout,
        storage.num_blocks(),
        layer,
        tables,
        params,
        Some(query_start_loc),
    )?;
    let tokens = check_prefill_q(layout, tables, query_start_loc, q.len())?;
    let split = split_tokens.unwrap_or(usize::MAX);
    check_split(split)?;
    let s = layout.shape();
    check_out("out elements", q.len(), out.len())?;
    if let Some(l) = &lse {
        check_out("lse elements", tokens * s.num_q_heads, l.len())?;
    }
    let src = PagedSource {
        layout,
        region: storage.region(layer),
        tables,
    };
    let cx = make_ctx(
        &src,
        q,
        layout.dtype(),
        s.head_dim,
        s.num_q_heads,
        s.num_kv_heads,
        params,
        split,
    );
    prefill_driver(&cx, isa(), &tables.context_lens, query_start_loc, out, lse);
    Ok(())
}

/// Decode attention over a [`ContiguousKv`] cache, with the same kernel as
/// [`paged_decode_split`] (tiles of [`CONTIGUOUS_TILE_TOKENS`] tokens): the baseline that
/// paged attention is measured against. `split_tokens: None` asks the planner.
///
/// # Errors
/// [`Error::ShapeMismatch`] for buffers that do not match the shape or a context longer
/// than `max_tokens`; [`Error::InvalidConfig`] for a bad head count or parameter;
/// [`Error::OutOfRange`] when the shape's size does not fit in a `usize`.
#[allow(clippy::too_many_arguments)]
pub fn contiguous_decode(
    kv: &ContiguousKv<'_>,
    num_q_heads: usize,
    q: &[f32],
    context_lens: &[u32],
    params: &AttentionParams,
    split_tokens: Option<usize>,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    if kv.num_kv_heads == 0 || kv.head_dim == 0 || !num_q_heads.is_multiple_of(kv.num_kv_heads) {
        return Err(Error::config(
            "num_kv_heads",
            format!(
                "{num_q_heads} query heads do not divide into {} KV heads",
                kv.num_kv_heads
            ),
        ));
    }
    params.validate(num_q_heads)?;
    let kv_bytes = kv.bytes()?;
    check_out("K bytes", kv_bytes, kv.k.len())?;
    check_out("V bytes", kv_bytes, kv.v.len())?;
    check_out("context lengths", kv.batch, context_lens.len())?;
    if let Some(&c) = context_lens.iter().find(|&&c| c as usize > kv.max_tokens) {
        return Err(Error::TooLong {
            tokens: c as usize,
            limit: kv.max_tokens,
        });
    }
    // batch and head_dim are bounded by the checked K size above; the query heads are not.
    let want = kv
        .batch
        .checked_mul(num_q_heads)
        .and_then(|n| n.checked_mul(kv.head_dim))
        .ok_or(Error::OutOfRange {
            field: "num_q_heads",
            value: num_q_heads as f64,
            allowed: "batch * num_q_heads * head_dim within usize",
        })?;
    check_out("q elements", want, q.len())?;
    check_out("out elements", want, out.len())?;
    if let Some(l) = &lse {
        check_out("lse elements", kv.batch * num_q_heads, l.len())?;
    }
    let split = match split_tokens {
        Some(s) => s,
        None => plan_split_tokens(
            context_lens,
            kv.num_kv_heads,
            CONTIGUOUS_TILE_TOKENS,
            rayon::current_num_threads(),
        ),
    };
    check_split(split)?;
    let src = ContiguousSource { kv: *kv };
    let cx = make_ctx(
        &src,
        q,
        kv.dtype,
        kv.head_dim,
        num_q_heads,
        kv.num_kv_heads,
        params,
        split,
    );
    decode_driver(&cx, isa(), context_lens, out, lse);
    Ok(())
}

/// Writes new tokens' K and V into their slots of one layer, converting (fp8: quantising
/// as `x / scale`) to the cache dtype. `k` and `v` are `f32` `[tokens, kv_heads, head_dim]`,
/// one token per slot. (vLLM's `reshape_and_cache`.)
///
/// # Errors
/// Before any write: [`Error::ShapeMismatch`] for a bad layer or lengths,
/// [`Error::BlockOutOfRange`] for a slot outside the arena, [`Error::InvalidConfig`] for a
/// scale that is not finite and positive.
pub fn reshape_and_cache(
    storage: &mut HostStorage,
    layer: usize,
    slots: &[Slot],
    k: &[f32],
    v: &[f32],
    k_scale: f32,
    v_scale: f32,
) -> Result<()> {
    let layout = *storage.layout();
    if layout.is_latent() {
        return Err(Error::Unsupported(
            "reshape_and_cache of a latent (MLA) cache: write the latent vectors with attention::mla::write_latent".into(),
        ));
    }
    if layer >= layout.num_layers() {
        return Err(Error::ShapeMismatch {
            what: "layer index",
            expected: layout.num_layers(),
            got: layer,
        });
    }
    let s = layout.shape();
    let (d, heads) = (s.head_dim, s.num_kv_heads);
    let want = slots.len() * heads * d;
    check_out("K elements (tokens * kv_heads * head_dim)", want, k.len())?;
    check_out("V elements (tokens * kv_heads * head_dim)", want, v.len())?;
    check_scale("k_scale", k_scale)?;
    check_scale("v_scale", v_scale)?;
    let num_blocks = storage.num_blocks();
    let bs = layout.block_size() as u64;
    for slot in slots {
        let block = slot.0 / bs;
        if block >= num_blocks as u64 {
            return Err(Error::BlockOutOfRange {
                block: BlockId(u32::try_from(block).unwrap_or(u32::MAX)),
                num_blocks,
            });
        }
    }
    let dtype = layout.dtype();
    let es = dtype.size_bytes();
    let region = storage.region_mut(layer);
    for (t, &slot) in slots.iter().enumerate() {
        let (block, off) = layout.split_slot(slot);
        for h in 0..heads {
            let src = (t * heads + h) * d;
            for (kv, data, scale) in [(Kv::K, k, k_scale), (Kv::V, v, v_scale)] {
                let dst = layout.elem_offset(block, kv, h, off) * es;
                encode_unchecked(
                    dtype,
                    &data[src..src + d],
                    scale,
                    &mut region[dst..dst + d * es],
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::attention::reference::{paged_decode_reference, paged_prefill_reference};
    use crate::layout::shape::ModelShape;

    /// Both kernel copies against the reference (the integration tests only reach the
    /// one this machine picks).
    #[test]
    fn every_isa_matches_the_reference() {
        let mut isas = vec![Isa::Portable];
        if isa() != Isa::Portable {
            isas.push(isa());
        }
        for dtype in DType::ALL {
            let shape = ModelShape {
                num_layers: 1,
                num_q_heads: 8,
                num_kv_heads: 2,
                head_dim: 72, // not a multiple of 64 or 32: every tail loop runs
                kv_dtype: dtype,
            };
            let layout = KvLayout::new(shape, 16).unwrap();
            let mut st = HostStorage::new(layout, 12).unwrap();
            let mut seed = 7u64;
            let mut rnd = || {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            };
            let slots: Vec<Slot> = (0..12 * 16).map(Slot).collect();
            let k: Vec<f32> = (0..slots.len() * 2 * 72).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..slots.len() * 2 * 72).map(|_| rnd()).collect();
            reshape_and_cache(&mut st, 0, &slots, &k, &v, 0.01, 0.01).unwrap();
            let tables = PaddedTables {
                tables: vec![5, 2, 9, 11, 0, 3, 0, 0, 7, 1, 4, 6],
                context_lens: vec![61, 17, 57],
                batch: 3,
                max_blocks: 4,
            };
            let params = AttentionParams {
                alibi_slopes: Some(super::super::alibi_slopes(8)),
                sliding_window: Some(40),
                k_scale: 0.01,
                v_scale: 0.01,
                ..AttentionParams::new(72)
            };
            let q: Vec<f32> = (0..3 * 8 * 72).map(|_| rnd()).collect();
            let want = paged_decode_reference(&st, 0, &q, &tables, &params).unwrap();
            let qsl = [0, 3, 4, 9];
            let qp: Vec<f32> = (0..9 * 8 * 72).map(|_| rnd()).collect();
            let want_p = paged_prefill_reference(&st, 0, &qp, &qsl, &tables, &params).unwrap();
            for &isa in &isas {
                let src = PagedSource {
                    layout: &layout,
                    region: st.region(0),
                    tables: &tables,
                };
                for split in [usize::MAX, 16, 23] {
                    let cx = make_ctx(&src, &q, dtype, 72, 8, 2, &params, split);
                    let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; 24]);
                    decode_driver(&cx, isa, &tables.context_lens, &mut out, Some(&mut lse));
                    for (a, b) in out.iter().zip(&want.out).chain(lse.iter().zip(&want.lse)) {
                        assert!(
                            (f64::from(*a) - b).abs() < 3e-5 * (1.0 + b.abs()),
                            "{isa:?} {dtype}: {a} vs {b}"
                        );
                    }
                    let cx = make_ctx(&src, &qp, dtype, 72, 8, 2, &params, split);
                    let (mut out, mut lse) = (vec![0f32; qp.len()], vec![0f32; 72]);
                    prefill_driver(
                        &cx,
                        isa,
                        &tables.context_lens,
                        &qsl,
                        &mut out,
                        Some(&mut lse),
                    );
                    for (a, b) in out
                        .iter()
                        .zip(&want_p.out)
                        .chain(lse.iter().zip(&want_p.lse))
                    {
                        assert!(
                            (f64::from(*a) - b).abs() < 3e-5 * (1.0 + b.abs()),
                            "{isa:?} {dtype}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn planner_splits_only_when_threads_would_idle() {
        // Big batch: no split.
        assert_eq!(plan_split_tokens(&[8192; 32], 4, 16, 16), usize::MAX);
        // One long sequence: about four jobs per thread, whole blocks.
        let s = plan_split_tokens(&[8192], 4, 16, 4);
        assert_eq!(s, 2048);
        assert_eq!(num_splits(0, 8192, s) * 4, 16);
        // Short contexts never split.
        assert_eq!(plan_split_tokens(&[200], 1, 16, 64), usize::MAX);
        // Never below the minimum.
        let s = plan_split_tokens(&[4096], 1, 16, 64);
        assert_eq!(s, MIN_SPLIT_TOKENS);
        assert_eq!(plan_split_tokens(&[], 8, 16, 8), usize::MAX);
        assert_eq!(num_splits(5, 5, 4), 0);
        assert_eq!(num_splits(3, 9, 4), 3);
        assert_eq!(num_splits(0, 9, usize::MAX), 1);
    }
}
