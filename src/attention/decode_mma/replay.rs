//! The lane-by-lane CPU replay of the tensor-core decode path (feature `testing`): see
//! the parent module for what it proves and what only a GPU can confirm.

// The replay indexes by lane, tile and k-step the way the kernel's lanes do; iterator
// chains would hide exactly the indices it exists to show.
#![allow(clippy::needless_range_loop)]

use super::{uses_mma, MMA_TILE, MMA_WARPS};
use crate::attention::reference::paged_decode_reference;
use crate::attention::{check_decode_q, check_paged, AttentionParams, SplitPlan, WorkList};
use crate::error::{Error, Result};
use crate::executor::storage::{HostStorage, Storage};
use crate::layout::convert::fp8_e4m3_to_f32;
use crate::layout::shape::DType;
use crate::tables::PaddedTables;
use half::{bf16, f16};
/// The kernel's geometry for one specialisation.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    dtype: DType,
    head_dim: usize,
    es: usize,
}

impl Geometry {
    fn row_bytes(&self) -> usize {
        self.head_dim * self.es
    }
    fn row_chunks(&self) -> usize {
        self.row_bytes() / 16
    }
    fn epc(&self) -> usize {
        16 / self.es
    }
    fn ksteps(&self) -> usize {
        self.head_dim / 16
    }
    fn ntiles_o(&self) -> usize {
        self.head_dim / 8
    }
    fn eighth_bytes(&self) -> usize {
        self.row_bytes() / 8
    }
    /// `mma_swizzle` of the kernel.
    fn swizzle(&self, t: usize) -> usize {
        if self.row_chunks() < 8 {
            return 0;
        }
        let low_bit = if self.eighth_bytes() >= 32 { 0 } else { 1 };
        ((((t >> 1) & 1) << low_bit) | ((((t >> 2) ^ t) & 1) << 2)) & (self.row_chunks() - 1)
    }
    /// Physical head dim of lane-local K element `i` of a lane with quad index `j`.
    fn k_dim(&self, j: usize, i: usize) -> usize {
        (j + 4 * (i / self.epc())) * self.epc() + i % self.epc()
    }
    /// Physical head dim of output n-tile `u`, column `n`.
    fn o_dim(&self, u: usize, n: usize) -> usize {
        n * self.ntiles_o() + u
    }
    /// Rounds to the MMA operand type (bf16 for bf16 caches, f16 otherwise), as bits.
    fn round(&self, x: f32) -> u16 {
        if self.dtype == DType::BF16 {
            bf16::from_f32(x).to_bits()
        } else {
            f16::from_f32(x).to_bits()
        }
    }
    fn value(&self, bits: u16) -> f32 {
        if self.dtype == DType::BF16 {
            bf16::from_bits(bits).to_f32()
        } else {
            f16::from_bits(bits).to_f32()
        }
    }
    fn pack(&self, lo: f32, hi: f32) -> u32 {
        u32::from(self.round(lo)) | (u32::from(self.round(hi)) << 16)
    }
    fn unpack(&self, r: u32) -> [f32; 2] {
        [self.value(r as u16), self.value((r >> 16) as u16)]
    }
}

/// `cvt.rn.f16x2.e4m3x2` of the low 16 bits of `two`: low byte to the low half.
fn fp8x2_to_f16x2(two: u32) -> u32 {
    let h = |b: u32| u32::from(f16::from_f32(fp8_e4m3_to_f32(b as u8)).to_bits());
    h(two & 0xff) | (h((two >> 8) & 0xff) << 16)
}

/// `__byte_perm(a, b, sel)` (`prmt.b32`, default mode).
fn byte_perm(a: u32, b: u32, sel: u32) -> u32 {
    let bytes = (u64::from(b) << 32) | u64::from(a);
    (0..4).fold(0u32, |acc, k| {
        let s = (sel >> (4 * k)) & 0x7;
        acc | ((((bytes >> (8 * s)) & 0xff) as u32) << (8 * k))
    })
}

/// One warp-wide `mma.sync.m16n8k16.row.col.f32` with the PTX ISA's fragment layouts:
/// `a[lane]` the A registers, `b[lane]` the B registers, `c[lane]` accumulated.
fn mma_16816(geo: &Geometry, c: &mut [[f32; 4]; 32], a: &[[u32; 4]; 32], b: &[[u32; 2]; 32]) {
    let mut am = [[0.0f32; 16]; 16];
    let mut bm = [[0.0f32; 8]; 16];
    for lane in 0..32 {
        let (g, j) = (lane / 4, lane % 4);
        for (reg, (row, col)) in [
            (g, 2 * j),
            (g + 8, 2 * j),
            (g, 2 * j + 8),
            (g + 8, 2 * j + 8),
        ]
        .into_iter()
        .enumerate()
        {
            let [lo, hi] = geo.unpack(a[lane][reg]);
            am[row][col] = lo;
            am[row][col + 1] = hi;
        }
        for (reg, k) in [2 * j, 2 * j + 8].into_iter().enumerate() {
            let [lo, hi] = geo.unpack(b[lane][reg]);
            bm[k][g] = lo;
            bm[k + 1][g] = hi;
        }
    }
    for lane in 0..32 {
        let (g, j) = (lane / 4, lane % 4);
        for (e, (row, col)) in [
            (g, 2 * j),
            (g, 2 * j + 1),
            (g + 8, 2 * j),
            (g + 8, 2 * j + 1),
        ]
        .into_iter()
        .enumerate()
        {
            let mut acc = c[lane][e];
            for k in 0..16 {
                acc += am[row][k] * bm[k][col];
            }
            c[lane][e] = acc;
        }
    }
}

/// The per-lane state of one warp.
struct WarpState {
    o: Vec<[[f32; 4]; 32]>,
    m: [[f32; 2]; 32],
    l: [[f32; 2]; 32],
}

/// One CTA of the tensor-core path: tokens `[begin, end)` of `seq` for `kv_head`.
#[derive(Debug, Clone, Copy)]
struct Cta {
    seq: usize,
    kv_head: usize,
    begin: u32,
    end: u32,
}

/// One CTA's result: the normalised partial output of its group's query heads
/// (`group x head_dim`, times `v_scale`) and their log-sum-exps (natural log, `-inf`
/// for an empty range), as the kernel writes a split's partial.
struct Partial {
    out: Vec<f32>,
    lse: Vec<f32>,
}

/// Replays each CTA of `ctas` lane by lane: the cp.async stage, the tensor-core
/// products, the per-tile softmax and the warp merge.
fn replay_ctas(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    tables: &PaddedTables,
    params: &AttentionParams,
    ctas: &[Cta],
) -> Result<Vec<Partial>> {
    let layout = *storage.layout();
    let batch = check_paged(&layout, storage.num_blocks(), layer, tables, params, None)?;
    check_decode_q(&layout, batch, q.len())?;
    let s = layout.shape();
    let (d, group, bs, dtype) = (s.head_dim, s.group_size(), layout.block_size(), s.kv_dtype);
    if !uses_mma(dtype, group, d, bs) {
        return Err(Error::Unsupported(format!(
            "the tensor-core decode path does not take {dtype} GQA {group} head_dim {d} block {bs}"
        )));
    }
    let geo = Geometry {
        dtype,
        head_dim: d,
        es: dtype.size_bytes(),
    };
    let fp8 = dtype == DType::Fp8E4M3;
    let scale_log2 =
        params.scale * if fp8 { params.k_scale } else { 1.0 } * std::f32::consts::LOG2_E;
    let v_scale = if fp8 { params.v_scale } else { 1.0 };
    let region = storage.region(layer);
    let st = layout.strides();
    let es = geo.es;
    let (sb, skv, sh, stok) = (st.block * es, st.kv * es, st.head * es, st.token * es);
    let qh = s.num_q_heads;
    let (row_bytes, chunks) = (geo.row_bytes(), geo.row_chunks());
    let tile_bytes = MMA_TILE * row_bytes;
    let mut parts = Vec::with_capacity(ctas.len());
    for &Cta {
        seq,
        kv_head,
        begin,
        end,
    } in ctas
    {
        let table = tables.row(seq);
        let ctx = tables.context_lens[seq];
        let mut part = Partial {
            out: vec![0.0; group * d],
            lse: vec![f32::NEG_INFINITY; group],
        };
        let tile0 = begin / MMA_TILE as u32 * MMA_TILE as u32;
        let num_tiles = if begin < end {
            (end - tile0).div_ceil(MMA_TILE as u32) as usize
        } else {
            0
        };
        // q as A fragments, per lane.
        let qrow0 = seq * qh + kv_head * group;
        let qa: Vec<[[u32; 4]; 32]> = (0..geo.ksteps())
            .map(|ks| {
                let mut regs = [[0u32; 4]; 32];
                for (lane, r) in regs.iter_mut().enumerate() {
                    let (g, j) = (lane / 4, lane % 4);
                    for half in 0..2 {
                        let row = g + 8 * half;
                        let v = |e: usize| {
                            let dim = geo.k_dim(j, 4 * ks + e);
                            if row < group {
                                q[(qrow0 + row) * d + dim] * scale_log2
                            } else {
                                0.0
                            }
                        };
                        r[half] = geo.pack(v(0), v(1));
                        r[2 + half] = geo.pack(v(2), v(3));
                    }
                }
                regs
            })
            .collect();
        let slope = |lane: usize, half: usize| -> f32 {
            let row = lane / 4 + 8 * half;
            if row < group {
                params.slope(kv_head * group + row) * std::f32::consts::LOG2_E
            } else {
                0.0
            }
        };
        let two_halves = group > 8;
        let mut warps: Vec<WarpState> = (0..MMA_WARPS)
            .map(|_| WarpState {
                o: vec![[[0.0; 4]; 32]; geo.ntiles_o()],
                m: [[f32::NEG_INFINITY; 2]; 32],
                l: [[0.0; 2]; 32],
            })
            .collect();
        let pages_per_tile = if bs >= MMA_TILE { 1 } else { MMA_TILE / bs };
        for (warp, ws) in warps.iter_mut().enumerate() {
            let mut tile = warp;
            while tile < num_tiles {
                // The stage as the lanes' cp.async leave it.
                let mut smem = vec![0u8; 2 * tile_bytes];
                let tbase = tile0 + (tile * MMA_TILE) as u32;
                let ids: Vec<u32> = (0..pages_per_tile)
                    .map(|p| {
                        let t = tbase + (p * (MMA_TILE / pages_per_tile)) as u32;
                        if t < end {
                            table[t as usize / bs]
                        } else {
                            0
                        }
                    })
                    .collect();
                for lane in 0..32 {
                    for c in 0..MMA_TILE * chunks / 32 {
                        let x = lane + 32 * c;
                        let (tt, ch) = (x / chunks, x % chunks);
                        let t = tbase + tt as u32;
                        if t < begin || t >= end {
                            continue; // zero-filled
                        }
                        // The kernel's compile-time page of copy c.
                        let page = (32 * c) / ((MMA_TILE / pages_per_tile) * chunks);
                        assert_eq!(page, tt / (MMA_TILE / pages_per_tile));
                        let blk = ids[page] as usize;
                        let src = kv_head * sh + blk * sb + (t as usize % bs) * stok + ch * 16;
                        let dst = tt * row_bytes + (ch ^ geo.swizzle(tt)) * 16;
                        smem[dst..dst + 16].copy_from_slice(&region[src..src + 16]);
                        smem[tile_bytes + dst..tile_bytes + dst + 16]
                            .copy_from_slice(&region[src + skv..src + skv + 16]);
                    }
                }
                let word = |off: usize| {
                    u32::from_le_bytes([smem[off], smem[off + 1], smem[off + 2], smem[off + 3]])
                };
                // S = Q K^T.
                let mut sc = [[[0.0f32; 4]; 32]; 2];
                for (nt, snt) in sc.iter_mut().enumerate() {
                    for ks in 0..geo.ksteps() {
                        let mut b = [[0u32; 2]; 32];
                        for (lane, bl) in b.iter_mut().enumerate() {
                            let (g, j) = (lane / 4, lane % 4);
                            let tt = 8 * nt + g;
                            // Lane-local word w of the row: chunk j + 4 (w / 4).
                            let kw = |w: usize| {
                                let c = j + 4 * (w / 4);
                                word(tt * row_bytes + (c ^ geo.swizzle(tt)) * 16 + 4 * (w % 4))
                            };
                            if fp8 {
                                let w = kw(ks);
                                *bl = [fp8x2_to_f16x2(w & 0xffff), fp8x2_to_f16x2(w >> 16)];
                            } else {
                                *bl = [kw(2 * ks), kw(2 * ks + 1)];
                            }
                        }
                        mma_16816(&geo, snt, &qa[ks], &b);
                    }
                }
                // Mask, ALiBi, per-tile softmax, P fragments.
                let mut pa = [[0u32; 4]; 32];
                let mut corr = [[1.0f32; 2]; 32];
                let mut tmax = [[f32::NEG_INFINITY; 2]; 32];
                for lane in 0..32 {
                    let j = lane % 4;
                    for nt in 0..2 {
                        for e in 0..4 {
                            let t = tbase + (8 * nt + 2 * j + (e & 1)) as u32;
                            let x = sc[nt][lane][e]
                                + slope(lane, e >> 1) * (t as f32 - (ctx as f32 - 1.0));
                            let x = if t >= begin && t < end {
                                x
                            } else {
                                f32::NEG_INFINITY
                            };
                            sc[nt][lane][e] = x;
                            tmax[lane][e >> 1] = tmax[lane][e >> 1].max(x);
                        }
                    }
                }
                let halves = if two_halves { 2 } else { 1 };
                for half in 0..halves {
                    // shfl_xor 1 then 2: the quad's max.
                    let t1: Vec<f32> = (0..32)
                        .map(|ln| tmax[ln][half].max(tmax[ln ^ 1][half]))
                        .collect();
                    let t2: Vec<f32> = (0..32).map(|ln| t1[ln].max(t1[ln ^ 2])).collect();
                    for lane in 0..32 {
                        let m_old = ws.m[lane][half];
                        let m_new = m_old.max(t2[lane]);
                        let m_use = if m_new == f32::NEG_INFINITY {
                            0.0
                        } else {
                            m_new
                        };
                        corr[lane][half] = (m_old - m_use).exp2();
                        ws.m[lane][half] = m_new;
                        for snt in sc.iter_mut() {
                            for e in 0..2 {
                                let v = &mut snt[lane][2 * half + e];
                                *v = (*v - m_use).exp2();
                            }
                        }
                        let p = |nt: usize, e: usize| sc[nt][lane][2 * half + e];
                        ws.l[lane][half] = ws.l[lane][half] * corr[lane][half]
                            + ((p(0, 0) + p(0, 1)) + (p(1, 0) + p(1, 1)));
                    }
                }
                for lane in 0..32 {
                    if !two_halves {
                        for snt in sc.iter_mut() {
                            snt[lane][2] = 0.0;
                            snt[lane][3] = 0.0;
                        }
                    }
                    let pk = |nt: usize, e: usize| geo.pack(sc[nt][lane][e], sc[nt][lane][e + 1]);
                    pa[lane] = [
                        pk(0, 0),
                        if two_halves { pk(0, 2) } else { 0 },
                        pk(1, 0),
                        if two_halves { pk(1, 2) } else { 0 },
                    ];
                }
                // V: eighth g of the rows of tokens 2j, 2j+1, 2j+8, 2j+9.
                let eighth = geo.eighth_bytes();
                let vw = |lane: usize, r: usize, w: usize| {
                    let (g, j) = (lane / 4, lane % 4);
                    let tt = 2 * j + (r & 1) + 8 * (r >> 1);
                    let byte = g * eighth + 4 * w;
                    word(
                        tile_bytes
                            + tt * row_bytes
                            + ((byte / 16) ^ geo.swizzle(tt)) * 16
                            + byte % 16,
                    )
                };
                for u in 0..geo.ntiles_o() {
                    let mut b = [[0u32; 2]; 32];
                    for (lane, bl) in b.iter_mut().enumerate() {
                        for (kh, slot) in bl.iter_mut().enumerate() {
                            let a = vw(lane, 2 * kh, u * es / 4);
                            let c = vw(lane, 2 * kh + 1, u * es / 4);
                            *slot = if fp8 {
                                let byte = (u % 4) as u32;
                                fp8x2_to_f16x2(byte_perm(a, c, byte | ((byte + 4) << 4)))
                            } else {
                                byte_perm(a, c, if u % 2 == 0 { 0x5410 } else { 0x7632 })
                            };
                        }
                    }
                    let o = &mut ws.o[u];
                    for lane in 0..32 {
                        o[lane][0] *= corr[lane][0];
                        o[lane][1] *= corr[lane][0];
                        if two_halves {
                            o[lane][2] *= corr[lane][1];
                            o[lane][3] *= corr[lane][1];
                        }
                    }
                    mma_16816(&geo, o, &pa, &b);
                }
                tile += MMA_WARPS;
            }
            // The quad's partial sums: shfl_xor 1, then 2.
            for half in 0..2 {
                let l1: Vec<f32> = (0..32)
                    .map(|ln| ws.l[ln][half] + ws.l[ln ^ 1][half])
                    .collect();
                for ln in 0..32 {
                    ws.l[ln][half] = l1[ln] + l1[ln ^ 2];
                }
            }
        }
        // Warp merge, in warp order, from the shared-memory rows.
        for r in 0..group {
            let lane_of = |r: usize| (r % 8) * 4; // j = 0 writes m and l
            let half = r / 8;
            let ms: Vec<f32> = warps.iter().map(|w| w.m[lane_of(r)][half]).collect();
            let ls: Vec<f32> = warps.iter().map(|w| w.l[lane_of(r)][half]).collect();
            let mt = ms.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let row = r;
            for dim in 0..d {
                // dim = (2j + (e & 1)) * ntiles + u
                let (n, u) = (dim / geo.ntiles_o(), dim % geo.ntiles_o());
                debug_assert_eq!(geo.o_dim(u, n), dim);
                let lane = (r % 8) * 4 + n / 2;
                let e = 2 * half + (n & 1);
                let (mut lsum, mut acc) = (0.0f32, 0.0f32);
                if mt != f32::NEG_INFINITY {
                    for (w, ws) in warps.iter().enumerate() {
                        if ms[w] != f32::NEG_INFINITY {
                            let f = (ms[w] - mt).exp2();
                            lsum += ls[w] * f;
                            acc += ws.o[u][lane][e] * f;
                        }
                    }
                }
                part.out[row * d + dim] = if lsum > 0.0 {
                    acc / lsum * v_scale
                } else {
                    0.0
                };
                if dim == 0 {
                    part.lse[row] = if lsum > 0.0 {
                        (mt + lsum.log2()) * std::f32::consts::LN_2
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        }
        parts.push(part);
    }
    Ok(parts)
}

/// Replays `paged_attention_decode`'s tensor-core path on the CPU for every sequence,
/// KV head and split of `plan`, then merges the splits as `paged_attention_merge`
/// does. Returns `out` and `lse` (natural log) like the kernel.
///
/// # Errors
/// As [`crate::attention::reference::paged_decode_reference`]; [`Error::Unsupported`] for
/// a layout the tensor-core path does not take (see [`uses_mma`]);
/// [`crate::Error::InvalidConfig`] for a plan with no splits or a split length that
/// is not a whole number of blocks.
pub fn replay_decode_mma(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    tables: &PaddedTables,
    params: &AttentionParams,
    plan: SplitPlan,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let bs = storage.layout().block_size();
    if plan.num_splits == 0
        || plan.num_splits > crate::attention::MAX_SPLITS
        || !(plan.tokens_per_split as usize).is_multiple_of(bs)
    {
        return Err(Error::config(
            "plan",
            format!(
                "{plan:?}: 1..={} splits of whole {bs}-token blocks",
                crate::attention::MAX_SPLITS
            ),
        ));
    }
    let max_context = tables.context_lens.iter().copied().max().unwrap_or(0) as u64;
    if u64::from(plan.num_splits) * u64::from(plan.tokens_per_split) < max_context {
        return Err(Error::config(
            "plan",
            format!("{plan:?} does not cover a context of {max_context}"),
        ));
    }
    let s = storage.layout().shape();
    let (d, group, qh) = (s.head_dim, s.group_size(), s.num_q_heads);
    let window = params.sliding_window.unwrap_or(0) as u32;
    let mut ctas = Vec::new();
    for (seq, &ctx) in tables.context_lens.iter().enumerate() {
        for kv_head in 0..s.num_kv_heads {
            for split in 0..plan.num_splits {
                let mut begin = split * plan.tokens_per_split;
                let end = (begin + plan.tokens_per_split).min(ctx);
                if window != 0 && ctx > window && begin < ctx - window {
                    begin = ctx - window;
                }
                ctas.push(Cta {
                    seq,
                    kv_head,
                    begin,
                    end,
                });
            }
        }
    }
    let parts = replay_ctas(storage, layer, q, tables, params, &ctas)?;
    let batch = tables.batch;
    let splits = plan.num_splits as usize;
    let mut part_out = vec![0.0f32; batch * qh * splits * d];
    let mut part_lse = vec![f32::NEG_INFINITY; batch * qh * splits];
    for (i, (cta, part)) in ctas.iter().zip(&parts).enumerate() {
        let split = i % splits;
        for r in 0..group {
            let row = (cta.seq * qh + cta.kv_head * group + r) * splits + split;
            part_out[row * d..(row + 1) * d].copy_from_slice(&part.out[r * d..(r + 1) * d]);
            part_lse[row] = part.lse[r];
        }
    }
    // paged_attention_merge (identity for one split, as the kernel writes directly).
    if splits == 1 {
        return Ok((part_out, part_lse));
    }
    let mut out = vec![0.0f32; batch * qh * d];
    let mut lse = vec![f32::NEG_INFINITY; batch * qh];
    for row in 0..batch * qh {
        lse[row] = merge_row(
            &part_lse[row * splits..(row + 1) * splits],
            |sp, dim| part_out[(row * splits + sp) * d + dim],
            &mut out[row * d..(row + 1) * d],
        );
    }
    Ok((out, lse))
}

/// The split merge of one query head's row, as `paged_attention_merge` and the fused
/// merge compute it: the log-sum-exps `pl` of the splits in split order, `part(sp,
/// dim)` the splits' partial outputs; writes the row and returns its log-sum-exp.
/// The order of the sums is the split order, whatever order the splits finished in.
fn merge_row(pl: &[f32], part: impl Fn(usize, usize) -> f32, out: &mut [f32]) -> f32 {
    let mx = pl.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut wsum = 0.0f32;
    if mx != f32::NEG_INFINITY {
        for &x in pl {
            if x != f32::NEG_INFINITY {
                wsum += (x - mx).exp();
            }
        }
    }
    for (dim, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        if wsum > 0.0 {
            for (sp, &x) in pl.iter().enumerate() {
                if x != f32::NEG_INFINITY {
                    acc += (x - mx).exp() * part(sp, dim);
                }
            }
            acc /= wsum;
        }
        *o = acc;
    }
    if wsum > 0.0 {
        mx + wsum.ln()
    } else {
        f32::NEG_INFINITY
    }
}

/// What [`replay_decode_work_list`] leaves behind: the output and log-sum-exp rows
/// like the kernel's, and the per-(sequence, KV head) arrival counters after the
/// launch (all 0 when every merging CTA reset its counter, as the next launch needs).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkListReplay {
    /// `[batch, q_heads, head_dim]`.
    pub out: Vec<f32>,
    /// `[batch, q_heads]`, natural log.
    pub lse: Vec<f32>,
    /// `[batch, num_kv_heads]` arrival counters after the launch.
    pub counters: Vec<u32>,
}

/// Replays a work-list launch of the tensor-core path with its fused merge: CTA `i`
/// serves KV head `i % num_kv_heads` of item `i / num_kv_heads` (grid x = KV head,
/// y = item), and the CTAs finish in the order `arrival` gives (a permutation of
/// `0..items * num_kv_heads`). A sequence of one chunk writes its output directly.
/// Otherwise each CTA writes its f32 partial at row `item * q_heads + q_head`, then
/// bumps its (sequence, KV head) counter; the CTA that brings it to the sequence's
/// chunk count merges the partials of items `first..first + chunks` in chunk order
/// (`paged_attention_merge`'s sums, so the bits do not depend on which CTA came last)
/// and resets the counter to 0. Partials not yet written read as NaN here, so a merge
/// that ran early would show.
///
/// # Errors
/// As [`replay_decode_mma`] for the storage, tables and queries;
/// [`Error::ShapeMismatch`] for a list whose per-sequence counts do not match the
/// batch or its items, or an `arrival` of the wrong length;
/// [`crate::Error::InvalidConfig`] for an item outside its sequence's context or out
/// of order, or an `arrival` that is not a permutation.
pub fn replay_decode_work_list(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    tables: &PaddedTables,
    params: &AttentionParams,
    list: &WorkList,
    arrival: &[usize],
) -> Result<WorkListReplay> {
    let s = storage.layout().shape();
    let (d, group, qh, kvh) = (s.head_dim, s.group_size(), s.num_q_heads, s.num_kv_heads);
    let batch = tables.batch;
    if list.first.len() != batch || list.chunks.len() != batch {
        return Err(Error::ShapeMismatch {
            what: "sequences of the work list",
            expected: batch,
            got: list.first.len().min(list.chunks.len()),
        });
    }
    let total: usize = list.chunks.iter().map(|&c| c as usize).sum();
    if total != list.items.len() {
        return Err(Error::ShapeMismatch {
            what: "items of the work list (sum of its chunk counts)",
            expected: total,
            got: list.items.len(),
        });
    }
    for (i, w) in list.items.iter().enumerate() {
        let seq = w.seq as usize;
        let ok = seq < batch
            && w.begin <= w.end
            && w.end <= tables.context_lens[seq]
            && w.chunk < list.chunks[seq]
            && list.first[seq] as usize + w.chunk as usize == i;
        if !ok {
            return Err(Error::config(
                "work list",
                format!("item {i} {w:?} is outside its sequence or out of order"),
            ));
        }
    }
    let n_ctas = list.items.len() * kvh;
    if arrival.len() != n_ctas {
        return Err(Error::ShapeMismatch {
            what: "CTAs in the arrival order",
            expected: n_ctas,
            got: arrival.len(),
        });
    }
    let mut seen = vec![false; n_ctas];
    for &a in arrival {
        if a >= n_ctas || std::mem::replace(&mut seen[a], true) {
            return Err(Error::config(
                "arrival",
                format!("{a}: not a permutation of 0..{n_ctas}"),
            ));
        }
    }
    let ctas: Vec<Cta> = arrival
        .iter()
        .map(|&a| {
            let w = list.items[a / kvh];
            Cta {
                seq: w.seq as usize,
                kv_head: a % kvh,
                begin: w.begin,
                end: w.end,
            }
        })
        .collect();
    let parts = replay_ctas(storage, layer, q, tables, params, &ctas)?;
    let mut out = vec![0.0f32; batch * qh * d];
    let mut lse = vec![f32::NEG_INFINITY; batch * qh];
    let mut part_out = vec![f32::NAN; list.items.len() * qh * d];
    let mut part_lse = vec![f32::NAN; list.items.len() * qh];
    let mut counters = vec![0u32; batch * kvh];
    for (&a, part) in arrival.iter().zip(&parts) {
        let (item, kv_head) = (a / kvh, a % kvh);
        let w = list.items[item];
        let seq = w.seq as usize;
        let n = list.chunks[seq] as usize;
        let heads = kv_head * group..(kv_head + 1) * group;
        if n == 1 {
            for (r, h) in heads.enumerate() {
                let row = seq * qh + h;
                out[row * d..(row + 1) * d].copy_from_slice(&part.out[r * d..(r + 1) * d]);
                lse[row] = part.lse[r];
            }
            continue;
        }
        for (r, h) in heads.clone().enumerate() {
            let row = item * qh + h;
            part_out[row * d..(row + 1) * d].copy_from_slice(&part.out[r * d..(r + 1) * d]);
            part_lse[row] = part.lse[r];
        }
        // __threadfence; atomicAdd on the (sequence, KV head) counter.
        let counter = &mut counters[seq * kvh + kv_head];
        *counter += 1;
        if *counter as usize != n {
            continue;
        }
        *counter = 0; // the merging CTA resets it for the next launch
        let first = list.first[seq] as usize;
        for h in heads {
            let pl: Vec<f32> = (0..n).map(|c| part_lse[(first + c) * qh + h]).collect();
            let row = seq * qh + h;
            lse[row] = merge_row(
                &pl,
                |c, dim| part_out[((first + c) * qh + h) * d + dim],
                &mut out[row * d..(row + 1) * d],
            );
        }
    }
    Ok(WorkListReplay { out, lse, counters })
}

/// The queries the tensor-core path effectively attends with: each element times the
/// kernel's `scale_log2`, rounded to the MMA type, divided back. The `f64` reference
/// on these queries differs from the kernel only by the rounding of P and `f32`
/// arithmetic, which is what the tight test bounds.
pub fn mma_rounded_queries(dtype: DType, q: &[f32], params: &AttentionParams) -> Vec<f32> {
    let fp8 = dtype == DType::Fp8E4M3;
    let c = params.scale * if fp8 { params.k_scale } else { 1.0 } * std::f32::consts::LOG2_E;
    let geo = Geometry {
        dtype,
        head_dim: 16,
        es: dtype.size_bytes(),
    };
    q.iter()
        .map(|&x| (f64::from(geo.value(geo.round(x * c))) / f64::from(c)) as f32)
        .collect()
}

/// Checks a decode result of the tensor-core path (`out`, `lse` as the kernel writes
/// them) against the `f64` reference with the bound its arithmetic gives, and returns
/// the worst ratio of error to bound. The reference runs on
/// [`mma_rounded_queries`] (the kernel rounds `q * scale * log2(e)` to the MMA type
/// once); what remains is P rounded to the MMA type on the numerator only (unit
/// roundoff `u`, [`mma_unit_roundoff`]) and `f32` arithmetic, so each element must
/// satisfy `|out - ref| <= (u + (ctx + head_dim + 64) 2^-23) A` with
/// `A = sum_t w_t |v_t|` (the reference over the cache with V's signs cleared), and
/// each log-sum-exp `|lse - ref| <= 4 (ctx + head_dim + 64) 2^-23 (1 + |ref|)`.
///
/// # Errors
/// A message naming the first element outside its bound; reference errors as text.
pub fn check_against_reference(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    tables: &PaddedTables,
    params: &AttentionParams,
    out: &[f32],
    lse: &[f32],
) -> std::result::Result<f64, String> {
    let layout = *storage.layout();
    let s = layout.shape();
    let d = s.head_dim;
    let qr = mma_rounded_queries(s.kv_dtype, q, params);
    let want =
        paged_decode_reference(storage, layer, &qr, tables, params).map_err(|e| e.to_string())?;
    let scale = paged_decode_reference(&abs_v(storage, layer, tables), layer, &qr, tables, params)
        .map_err(|e| e.to_string())?;
    if out.len() != want.out.len() || lse.len() != want.lse.len() {
        return Err(format!(
            "{} outputs and {} lse for {} and {}",
            out.len(),
            lse.len(),
            want.out.len(),
            want.lse.len()
        ));
    }
    let u = mma_unit_roundoff(s.kv_dtype);
    let mut worst: f64 = 0.0;
    for row in 0..want.lse.len() {
        let ctx = tables.context_lens[row / s.num_q_heads] as f64;
        let gamma = (ctx + d as f64 + 64.0) * 2f64.powi(-23);
        for dim in 0..d {
            let i = row * d + dim;
            let bound = (u + gamma) * scale.out[i] + 1e-30;
            let err = (f64::from(out[i]) - want.out[i]).abs();
            if err > bound || out[i].is_nan() {
                return Err(format!(
                    "row {row} dim {dim}: {} vs {} (bound {bound:e})",
                    out[i], want.out[i]
                ));
            }
            worst = worst.max(err / bound);
        }
        let (a, b) = (f64::from(lse[row]), want.lse[row]);
        let lb = 4.0 * gamma * (1.0 + b.abs());
        if !(a == b || (a - b).abs() <= lb) {
            return Err(format!("row {row}: lse {a} vs {b} (bound {lb:e})"));
        }
    }
    Ok(worst)
}

/// A copy of the storage with the sign of every V element of the tables' contexts
/// cleared (the reference over it gives `sum_t w_t |v_t|`).
fn abs_v(storage: &HostStorage, layer: usize, tables: &PaddedTables) -> HostStorage {
    let layout = *storage.layout();
    let mut st = storage.clone();
    let es = layout.dtype().size_bytes();
    let shape = layout.shape();
    let bs = layout.block_size();
    for i in 0..tables.batch {
        for h in 0..shape.num_kv_heads {
            for t in 0..tables.context_lens[i] as usize {
                let blk = crate::ids::BlockId(tables.row(i)[t / bs]);
                let v = layout.elem_offset(blk, crate::layout::Kv::V, h, t % bs);
                for x in 0..shape.head_dim {
                    st.region_mut(layer)[(v + x) * es + es - 1] &= 0x7f;
                }
            }
        }
    }
    st
}

/// Unit roundoff of the MMA operand type: 2^-8 for bf16, 2^-11 for f16 (f16 and fp8
/// caches).
pub fn mma_unit_roundoff(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        2f64.powi(-8)
    } else {
        2f64.powi(-11)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::BlockId;
    use crate::layout::shape::ModelShape;
    use crate::layout::{Kv, KvLayout};

    fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// What the K/V and q of a case look like.
    #[derive(Clone, Copy, PartialEq)]
    enum Data {
        /// Uniform in [-1, 1].
        Random,
        /// q positive, one token's K eight times the rest: its weight is ~1.
        Peaked { token: usize },
        /// V of token t is one-hot at dim t (context <= head_dim), K small: every
        /// token's weight shows in its own output dim.
        OneHot,
    }

    struct Case {
        st: HostStorage,
        tables: PaddedTables,
        q: Vec<f32>,
    }

    fn case(dtype: DType, group: usize, d: usize, bs: usize, ctxs: &[usize], data: Data) -> Case {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 2 * group,
            num_kv_heads: 2,
            head_dim: d,
            kv_dtype: dtype,
        };
        let layout = KvLayout::new(shape, bs).unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (d * 131 + group * 7 + bs) as u64;
        let blocks_per: Vec<usize> = ctxs.iter().map(|c| c.div_ceil(bs)).collect();
        let num_blocks = blocks_per.iter().sum::<usize>() + 3;
        let mut st = HostStorage::new(layout, num_blocks).unwrap();
        let n = st.region(0).len() / dtype.size_bytes();
        let mut vals: Vec<f32> = (0..n).map(|_| rng(&mut seed)).collect();
        let tables = crate::tables::test_tables::scrambled(ctxs, bs, num_blocks);
        for (i, &ctx) in ctxs.iter().enumerate() {
            for h in 0..2 {
                for t in 0..ctx {
                    let blk = BlockId(tables.row(i)[t / bs]);
                    let (k, v) = (
                        layout.elem_offset(blk, Kv::K, h, t % bs),
                        layout.elem_offset(blk, Kv::V, h, t % bs),
                    );
                    match data {
                        Data::Random => {}
                        Data::Peaked { token } => {
                            for x in &mut vals[k..k + d] {
                                *x = if t == token { 8.0 } else { *x * 0.125 };
                            }
                        }
                        Data::OneHot => {
                            for (dim, x) in vals[v..v + d].iter_mut().enumerate() {
                                *x = if dim == t { 1.0 } else { 0.0 };
                            }
                            for x in &mut vals[k..k + d] {
                                *x *= 0.25;
                            }
                        }
                    }
                }
            }
        }
        crate::layout::convert::encode(dtype, &vals, 1.0, st.region_mut(0)).unwrap();
        let q: Vec<f32> = (0..ctxs.len() * shape.num_q_heads * d)
            .map(|_| match data {
                Data::Peaked { .. } => 0.5 + 0.25 * rng(&mut seed),
                _ => rng(&mut seed),
            })
            .collect();
        Case { st, tables, q }
    }

    fn check(c: &Case, params: &AttentionParams, splits: u32) -> std::result::Result<f64, String> {
        let max = c.tables.context_lens.iter().copied().max().unwrap() as usize;
        let plan =
            crate::attention::split_plan_with(max, c.st.layout().block_size(), splits).unwrap();
        let (out, lse) = replay_decode_mma(&c.st, 0, &c.q, &c.tables, params, plan).unwrap();
        check_against_reference(&c.st, 0, &c.q, &c.tables, params, &out, &lse)
    }

    fn work_list_for(c: &Case, params: &AttentionParams, sms: usize) -> WorkList {
        let bs = c.st.layout().block_size();
        crate::attention::build_work_list(
            &c.tables.context_lens,
            params.sliding_window,
            2,
            bs,
            sms,
            1,
            1 << 20,
        )
        .unwrap()
    }

    fn shuffled(n: usize, seed: &mut u64) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = ((rng(seed) + 1.0) * 0.5 * (i + 1) as f32) as usize;
            v.swap(i, j.min(i));
        }
        v
    }

    #[test]
    fn the_work_list_replay_with_the_fused_merge_matches_the_reference() {
        // Uneven lengths in one batch; on 4 SMs at 1 CTA each the long sequence is
        // cut into several chunks, the short ones are not.
        let ctxs = [1, 17, 4096];
        for dtype in [DType::BF16, DType::Fp8E4M3] {
            let c = case(dtype, 8, 128, 16, &ctxs, Data::Random);
            let mut params = AttentionParams::new(128);
            for window in [None, Some(1000), Some(5)] {
                params.sliding_window = window;
                let list = work_list_for(&c, &params, 4);
                let want = if window == Some(5) { 1 } else { 2 };
                assert!(list.chunks[2] >= want, "{:?}", list.chunks);
                assert_eq!(&list.chunks[..2], &[1, 1]);
                let arrival: Vec<usize> = (0..list.items.len() * 2).rev().collect();
                let r =
                    replay_decode_work_list(&c.st, 0, &c.q, &c.tables, &params, &list, &arrival)
                        .unwrap();
                assert!(r.counters.iter().all(|&x| x == 0), "{:?}", r.counters);
                check_against_reference(&c.st, 0, &c.q, &c.tables, &params, &r.out, &r.lse)
                    .unwrap_or_else(|e| panic!("{dtype} window {window:?}: {e}"));
            }
        }
    }

    #[test]
    fn the_fused_merge_gives_the_same_bits_whatever_the_arrival_order() {
        // Three or more chunks per long sequence: a sum of two terms is the same
        // in either order, so only n >= 3 can show an order-dependent merge.
        let c = case(DType::BF16, 8, 64, 16, &[1800, 33, 1, 1100], Data::Random);
        let mut params = AttentionParams::new(64);
        params.sliding_window = Some(1500);
        let list = work_list_for(&c, &params, 1);
        assert!(
            list.chunks[0] >= 3 && list.chunks[3] >= 3,
            "{:?}",
            list.chunks
        );
        let n = list.items.len() * 2;
        let bits = |arrival: &[usize]| {
            let r = replay_decode_work_list(&c.st, 0, &c.q, &c.tables, &params, &list, arrival)
                .unwrap();
            assert!(r.counters.iter().all(|&x| x == 0));
            assert!(
                r.out.iter().all(|x| x.is_finite()),
                "a merge read an unwritten partial"
            );
            let o: Vec<u32> = r.out.iter().map(|x| x.to_bits()).collect();
            let l: Vec<u32> = r.lse.iter().map(|x| x.to_bits()).collect();
            (o, l)
        };
        let base = bits(&(0..n).collect::<Vec<_>>());
        check_against_reference(
            &c.st,
            0,
            &c.q,
            &c.tables,
            &params,
            &{
                base.0
                    .iter()
                    .map(|&b| f32::from_bits(b))
                    .collect::<Vec<_>>()
            },
            &base
                .1
                .iter()
                .map(|&b| f32::from_bits(b))
                .collect::<Vec<_>>(),
        )
        .unwrap();
        assert_eq!(bits(&(0..n).rev().collect::<Vec<_>>()), base);
        let mut seed = 77u64;
        for _ in 0..6 {
            assert_eq!(bits(&shuffled(n, &mut seed)), base);
        }
    }

    #[test]
    fn a_bad_work_list_or_arrival_order_is_refused() {
        let c = case(DType::BF16, 8, 64, 16, &[300, 20], Data::Random);
        let params = AttentionParams::new(64);
        let list = work_list_for(&c, &params, 1);
        let n = list.items.len() * 2;
        let ok: Vec<usize> = (0..n).collect();
        let run = |l: &WorkList, a: &[usize]| {
            replay_decode_work_list(&c.st, 0, &c.q, &c.tables, &params, l, a)
        };
        assert!(run(&list, &ok).is_ok());
        let mut dup = ok.clone();
        dup[1] = dup[0];
        assert!(matches!(run(&list, &dup), Err(Error::InvalidConfig { .. })));
        assert!(matches!(
            run(&list, &ok[1..]),
            Err(Error::ShapeMismatch { .. })
        ));
        let mut long = list.clone();
        long.items[0].end = 400;
        assert!(matches!(run(&long, &ok), Err(Error::InvalidConfig { .. })));
        let mut swapped = list.clone();
        swapped.items.swap(0, 1);
        assert!(run(&swapped, &ok).is_err());
        let mut short = list.clone();
        short.chunks.pop();
        assert!(matches!(run(&short, &ok), Err(Error::ShapeMismatch { .. })));
    }
    #[test]
    fn helpers_follow_the_ptx_semantics() {
        // prmt: selector nibbles pick bytes of {b, a}.
        assert_eq!(byte_perm(0x3322_1100, 0x7766_5544, 0x5410), 0x5544_1100);
        assert_eq!(byte_perm(0x3322_1100, 0x7766_5544, 0x7632), 0x7766_3322);
        assert_eq!(byte_perm(0x3322_1100, 0x7766_5544, 0x0062), 0x0000_6622);
        // e4m3 0x38 = 1.0, 0xc0 = -2.0: low byte to the low half.
        let h = fp8x2_to_f16x2(0xc038);
        assert_eq!(h & 0xffff, 0x3c00);
        assert_eq!(h >> 16, 0xc000);
        // The K dim map is a bijection per lane quad; so is the output map.
        for (dt, d) in [
            (DType::BF16, 64),
            (DType::BF16, 128),
            (DType::Fp8E4M3, 128),
            (DType::BF16, 256),
        ] {
            let geo = Geometry {
                dtype: dt,
                head_dim: d,
                es: dt.size_bytes(),
            };
            let mut seen = vec![false; d];
            for j in 0..4 {
                for i in 0..d / 4 {
                    let x = geo.k_dim(j, i);
                    assert!(!seen[x]);
                    seen[x] = true;
                }
            }
            let mut seen = vec![false; d];
            for u in 0..geo.ntiles_o() {
                for n in 0..8 {
                    assert!(!std::mem::replace(&mut seen[geo.o_dim(u, n)], true));
                }
            }
        }
    }

    #[test]
    fn an_emulated_mma_is_a_matrix_product() {
        // Fragments built from the PTX layouts, the product checked element by element.
        let geo = Geometry {
            dtype: DType::F16,
            head_dim: 16,
            es: 2,
        };
        let am = |r: usize, k: usize| ((r * 16 + k) % 7) as f32 - 3.0;
        let bm = |k: usize, n: usize| ((k * 8 + n) % 5) as f32 - 2.0;
        let mut a = [[0u32; 4]; 32];
        let mut b = [[0u32; 2]; 32];
        for lane in 0..32 {
            let (g, j) = (lane / 4, lane % 4);
            a[lane] = [
                geo.pack(am(g, 2 * j), am(g, 2 * j + 1)),
                geo.pack(am(g + 8, 2 * j), am(g + 8, 2 * j + 1)),
                geo.pack(am(g, 2 * j + 8), am(g, 2 * j + 9)),
                geo.pack(am(g + 8, 2 * j + 8), am(g + 8, 2 * j + 9)),
            ];
            b[lane] = [
                geo.pack(bm(2 * j, g), bm(2 * j + 1, g)),
                geo.pack(bm(2 * j + 8, g), bm(2 * j + 9, g)),
            ];
        }
        let mut c = [[0.0f32; 4]; 32];
        mma_16816(&geo, &mut c, &a, &b);
        for lane in 0..32 {
            let (g, j) = (lane / 4, lane % 4);
            for (e, (r, n)) in [
                (g, 2 * j),
                (g, 2 * j + 1),
                (g + 8, 2 * j),
                (g + 8, 2 * j + 1),
            ]
            .into_iter()
            .enumerate()
            {
                let want: f32 = (0..16).map(|k| am(r, k) * bm(k, n)).sum();
                assert_eq!(c[lane][e], want);
            }
        }
    }

    // One test per dtype, so that the test threads share the replays.
    #[test]
    fn the_replay_matches_the_reference_over_groups_dims_and_pages_bf16() {
        replay_over_groups_dims_and_pages(DType::BF16);
    }

    #[test]
    fn the_replay_matches_the_reference_over_groups_dims_and_pages_f16() {
        replay_over_groups_dims_and_pages(DType::F16);
    }

    #[test]
    fn the_replay_matches_the_reference_over_groups_dims_and_pages_fp8() {
        replay_over_groups_dims_and_pages(DType::Fp8E4M3);
    }

    fn replay_over_groups_dims_and_pages(dtype: DType) {
        // Contexts crossing tiles, pages and warps; one shorter than a tile; splits
        // of several tiles and of part of one; windows and ALiBi.
        let ctxs = [133, 7, 70];
        let mut shapes = Vec::new();
        for group in [3, 4, 5, 8, 16] {
            shapes.push((dtype, group, 128, 16));
        }
        for (d, bs) in [(64, 8), (64, 32), (256, 16), (128, 8), (128, 32)] {
            shapes.push((dtype, 8, d, bs));
        }
        let mut worst: f64 = 0.0;
        for (dtype, group, d, bs) in shapes {
            let c = case(dtype, group, d, bs, &ctxs, Data::Random);
            let mut params = AttentionParams::new(d);
            if dtype == DType::Fp8E4M3 {
                params.k_scale = 0.5;
                params.v_scale = 2.0;
            }
            for (window, alibi, splits) in [
                (None, false, 1),
                (None, true, 3),
                (Some(40), false, 2),
                (Some(5), true, 1),
            ] {
                params.sliding_window = window;
                params.alibi_slopes =
                    alibi.then(|| (0..2 * group).map(|h| 0.05 * (h + 1) as f32).collect());
                match check(&c, &params, splits) {
                    Ok(w) => worst = worst.max(w),
                    Err(e) => panic!("{dtype} g{group} d{d} bs{bs} {window:?} alibi {alibi} splits {splits}: {e}"),
                }
            }
        }
        // The bound is not vacuous: the worst element uses a visible part of it.
        assert!(worst > 0.01, "worst error / bound {worst}");
    }

    /// Pages of 1, 2 and 4 tokens (several per tile): every shape the tensor-core path
    /// takes is replayed, with the lanes' compile-time page of each copy checked
    /// against the token it copies (the replay's `assert_eq!`); the shapes it does not
    /// take are refused by the replay, as the kernel compiles the simple path for them.
    #[test]
    fn small_pages_are_replayed_or_left_to_the_simple_path() {
        let ctxs = [37, 5, 18];
        let (mut replayed, mut refused) = (0, 0);
        for dtype in [DType::BF16, DType::F16, DType::Fp8E4M3] {
            for d in [32, 64, 128, 256] {
                for bs in [1, 2, 4] {
                    let group = if d == 256 { 4 } else { 8 };
                    if dtype == DType::Fp8E4M3 && d == 32 {
                        continue; // 32-byte rows: never the tensor cores
                    }
                    let c = case(dtype, group, d, bs, &ctxs, Data::Random);
                    let mut params = AttentionParams::new(d);
                    if !uses_mma(dtype, group, d, bs) {
                        let plan = crate::attention::split_plan_with(37, bs, 1).unwrap();
                        let r = replay_decode_mma(&c.st, 0, &c.q, &c.tables, &params, plan);
                        assert!(
                            matches!(r, Err(Error::Unsupported(_))),
                            "{dtype} d{d} bs{bs}"
                        );
                        refused += 1;
                        continue;
                    }
                    for (window, splits) in [(None, 1), (Some(9), 2)] {
                        params.sliding_window = window;
                        check(&c, &params, splits).unwrap_or_else(|e| {
                            panic!("{dtype} d{d} bs{bs} {window:?} splits {splits}: {e}")
                        });
                    }
                    replayed += 1;
                }
            }
        }
        // 16-bit: d64 page 4, d128 pages 2-4, d256 pages 1-4; fp8: d128 page 4, d256 2-4.
        assert_eq!((replayed, refused), (15, 18));
    }

    #[test]
    fn a_sharply_peaked_context_is_followed_through_the_rescale() {
        // The peak sits in the last warp's second tile of the first sequence and in a
        // later split; the output must be that token's V within the bound.
        for dtype in [DType::BF16, DType::Fp8E4M3] {
            let c = case(dtype, 8, 128, 16, &[150, 90], Data::Peaked { token: 125 });
            let params = AttentionParams::new(128);
            for splits in [1, 2] {
                check(&c, &params, splits)
                    .unwrap_or_else(|e| panic!("{dtype} splits {splits}: {e}"));
            }
        }
    }

    #[test]
    fn every_token_is_distinguishable_so_a_dropped_or_doubled_one_fails() {
        for (dtype, d, bs) in [
            (DType::BF16, 128, 16),
            (DType::Fp8E4M3, 64, 8),
            (DType::F16, 128, 32),
        ] {
            let ctx = d - 3;
            let c = case(dtype, 5, d, bs, &[ctx], Data::OneHot);
            let params = AttentionParams::new(d);
            for splits in [1, 3] {
                check(&c, &params, splits).unwrap_or_else(|e| panic!("{dtype} d{d}: {e}"));
            }
            // Out dim t is token t's weight w (one-hot V). A kernel that dropped token
            // t would give 0 there; one that doubled it 2w / (1 + w). Both miss by more
            // than the bound, for every token of every head.
            let qr = mma_rounded_queries(dtype, &c.q, &params);
            let want = paged_decode_reference(&c.st, 0, &qr, &c.tables, &params).unwrap();
            let u = mma_unit_roundoff(dtype);
            let gamma = (ctx as f64 + d as f64 + 64.0) * 2f64.powi(-23);
            for row in 0..want.lse.len() {
                for t in 0..ctx {
                    let w = want.out[row * d + t];
                    let bound = (u + gamma) * w;
                    assert!(
                        w > bound && w * (1.0 - w) / (1.0 + w) > bound,
                        "token {t}: {w}"
                    );
                }
            }
            // And a replay over a cache whose token 11 lost its V fails the check.
            let mut broken = Case {
                st: c.st.clone(),
                tables: c.tables.clone(),
                q: c.q.clone(),
            };
            let layout = *c.st.layout();
            for h in 0..2 {
                let blk = BlockId(c.tables.row(0)[11 / bs]);
                let v = layout.elem_offset(blk, Kv::V, h, 11 % bs);
                let es = dtype.size_bytes();
                broken.st.region_mut(0)[v * es..(v + d) * es].fill(0);
            }
            let (out, _) = replay_decode_mma(
                &broken.st,
                0,
                &broken.q,
                &broken.tables,
                &params,
                crate::attention::split_plan_with(ctx, bs, 1).unwrap(),
            )
            .unwrap();
            let bad = (0..want.lse.len()).any(|row| {
                let w = want.out[row * d + 11];
                (f64::from(out[row * d + 11]) - w).abs() > (u + gamma) * w
            });
            assert!(bad, "{dtype}: a lost token went unnoticed");
        }
    }
}
