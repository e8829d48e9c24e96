//! Decode over a latent (MLA) cache in the absorbed form, on the CPU.
//!
//! DeepSeek-V2/V3's multi-head latent attention caches, per token and layer, one vector
//! `[c ; k_rope]` of `kv_lora_rank + rope_dim` elements (512 + 64 for DeepSeek-V3; see
//! [`KvKind::Latent`]). Head `h`'s key is `[W_UK_h c ; k_rope]` and its value
//! `W_UV_h c`. Absorbing `W_UK_h` into the query (`q_abs_h = [W_UK_hᵀ q_nope_h ;
//! q_rope_h]`) turns the scores into dot products with the cached vector itself, and
//! moving `W_UV_h` after the weighted sum leaves a sum of cached latents. So decode is
//! MQA with one shared "KV head" whose key is the whole vector and whose value is its
//! first `kv_lora_rank` elements:
//!
//! ```text
//! logit[t] = scale * (q_abs[h] . latent[t])                     (kv_lora_rank + rope_dim)
//! out[h]   = sum_t softmax(logit)[t] * latent[t][..kv_lora_rank]
//! lse[h]   = ln(sum_t exp(logit[t]))
//! ```
//!
//! The caller projects `out[h]` through `W_UV_h` (and `o_proj`) as the model does. The
//! query of a decode step sits at `context_len - 1` and sees the whole context; there
//! is no window, ALiBi or causal mask to apply. fp8 caches are dequantised as `code *
//! kv_scale`.
//!
//! | function | what |
//! |---|---|
//! | [`write_latent`] | `f32` latents into their slots, in the cache dtype |
//! | [`mla_decode_reference`] | `f64` plain loops, for tests |
//! | [`mla_decode`] | rayon over (sequence, group of heads); each page decoded once per group |

use rayon::prelude::*;

use super::DecodeOutput;
use crate::error::{Error, Result};
use crate::executor::storage::{HostStorage, Storage};
use crate::ids::BlockId;
use crate::layout::convert::{
    check_scale, decode_fp8_with, decode_one_f64, decode_unchecked, encode, fp8_e4m3_table,
};
use crate::layout::shape::{DType, KvKind};
use crate::layout::{Kv, KvLayout, Slot};
use crate::tables::{validate_tables, PaddedTables};

/// Query heads one job of [`mla_decode`] serves at most: every page it decodes is
/// reused by that many heads.
pub const MAX_HEADS_PER_JOB: usize = 16;

/// Parameters of one MLA decode call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaParams {
    /// Softmax scale: `1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)` (times YaRN's
    /// `mscale²` where the model uses it), not `1 / sqrt(kv_lora_rank + rope_dim)`.
    pub scale: f32,
    /// fp8 dequantisation scale of the latents (1.0 otherwise).
    pub kv_scale: f32,
}

impl MlaParams {
    /// Scale `1 / sqrt(qk_head_dim)`, fp8 scale 1.
    pub fn new(qk_head_dim: usize) -> Self {
        MlaParams {
            scale: 1.0 / (qk_head_dim.max(1) as f32).sqrt(),
            kv_scale: 1.0,
        }
    }
}

/// `(kv_lora_rank, rope_dim)` of a latent layout.
///
/// # Errors
/// [`Error::Unsupported`] for a standard K/V layout.
pub fn latent_dims(layout: &KvLayout) -> Result<(usize, usize)> {
    match layout.kind() {
        KvKind::Latent {
            kv_lora_rank,
            rope_dim,
        } => Ok((kv_lora_rank, rope_dim)),
        KvKind::Standard => Err(Error::Unsupported(
            "MLA decode reads a latent cache; this layout has separate K and V".into(),
        )),
    }
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            what,
            expected,
            got,
        })
    }
}

/// Every check of a decode call, before any read. Returns `(batch, kv_lora_rank)`.
fn check_decode(
    storage: &HostStorage,
    layer: usize,
    q: usize,
    tables: &PaddedTables,
    params: &MlaParams,
) -> Result<(usize, usize)> {
    let layout = storage.layout();
    let (rank, _) = latent_dims(layout)?;
    if layer >= layout.num_layers() {
        return Err(Error::ShapeMismatch {
            what: "layer index",
            expected: layout.num_layers(),
            got: layer,
        });
    }
    if !params.scale.is_finite() {
        return Err(Error::config(
            "scale",
            format!("{} is not finite", params.scale),
        ));
    }
    check_scale("kv_scale", params.kv_scale)?;
    validate_tables(layout, storage.num_blocks(), tables)?;
    let s = layout.shape();
    check_len(
        "q elements (batch * q_heads * (kv_lora_rank + rope_dim))",
        tables.batch * s.num_q_heads * s.head_dim,
        q,
    )?;
    Ok((tables.batch, rank))
}

/// Writes `f32` latent vectors (`[tokens, kv_lora_rank + rope_dim]`, one token per
/// slot) into their slots of one layer, in the cache dtype (fp8: `x / kv_scale`).
///
/// # Errors
/// Before any write: [`Error::Unsupported`] for a standard layout,
/// [`Error::ShapeMismatch`] for a bad layer or length, [`Error::BlockOutOfRange`] for a
/// slot outside the arena, [`Error::InvalidConfig`] for a bad scale.
pub fn write_latent(
    storage: &mut HostStorage,
    layer: usize,
    slots: &[Slot],
    latent: &[f32],
    kv_scale: f32,
) -> Result<()> {
    let layout = *storage.layout();
    latent_dims(&layout)?;
    let d = layout.shape().head_dim;
    check_len(
        "latent elements (tokens * (kv_lora_rank + rope_dim))",
        slots.len() * d,
        latent.len(),
    )?;
    let mut bytes = vec![0u8; latent.len() * layout.dtype().size_bytes()];
    encode(layout.dtype(), latent, kv_scale, &mut bytes)?;
    storage.write_slots(layer, slots, &bytes, &[])
}

/// MLA decode in `f64`: one absorbed query per sequence and head over the sequence's
/// whole context, read in place through the block tables.
///
/// `q` is `[batch, q_heads, kv_lora_rank + rope_dim]`; the output is `[batch, q_heads,
/// kv_lora_rank]` and `lse` is `[batch, q_heads]` (`-inf` and zeros for an empty
/// context).
///
/// # Errors
/// Before any read: [`Error::Unsupported`] for a standard layout;
/// [`Error::ShapeMismatch`] for a bad layer, `q` length or table shape;
/// [`Error::CorruptBlockTable`], [`Error::BlockOutOfRange`] for bad tables;
/// [`Error::InvalidConfig`] for a bad scale.
pub fn mla_decode_reference(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    tables: &PaddedTables,
    params: &MlaParams,
) -> Result<DecodeOutput> {
    let (batch, rank) = check_decode(storage, layer, q.len(), tables, params)?;
    let layout = storage.layout();
    let s = layout.shape();
    let (qh, d, bs, dtype) = (s.num_q_heads, s.head_dim, layout.block_size(), s.kv_dtype);
    let region = storage.region(layer);
    let mut out = DecodeOutput {
        out: vec![0.0; batch * qh * rank],
        lse: vec![f64::NEG_INFINITY; batch * qh],
    };
    for i in 0..batch {
        let ctx = tables.context_lens[i] as usize;
        let table = tables.row(i);
        let base = |t: usize| layout.elem_offset(BlockId(table[t / bs]), Kv::K, 0, t % bs);
        let x = |t: usize, j: usize| decode_one_f64(dtype, region, base(t) + j, params.kv_scale);
        for h in 0..qh {
            if ctx == 0 {
                continue;
            }
            let row = i * qh + h;
            let qv = &q[row * d..(row + 1) * d];
            let logits: Vec<f64> = (0..ctx)
                .map(|t| {
                    let dot: f64 = (0..d).map(|j| f64::from(qv[j]) * x(t, j)).sum();
                    dot * f64::from(params.scale)
                })
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            let o = &mut out.out[row * rank..(row + 1) * rank];
            for (t, wt) in w.iter().enumerate() {
                let p = wt / sum;
                for (j, oj) in o.iter_mut().enumerate() {
                    *oj += p * x(t, j);
                }
            }
            out.lse[row] = m + sum.ln();
        }
    }
    Ok(out)
}

/// Heads per job: the largest divisor of `q_heads` up to [`MAX_HEADS_PER_JOB`].
fn heads_per_job(q_heads: usize) -> usize {
    (1..=MAX_HEADS_PER_JOB.min(q_heads))
        .rev()
        .find(|g| q_heads.is_multiple_of(*g))
        .unwrap_or(1)
}

/// MLA decode on the CPU in `f32`, in parallel over (sequence, group of up to
/// [`MAX_HEADS_PER_JOB`] heads). A job walks its sequence page by page, decodes each
/// page of latents once into `f32`, and serves every head of the group from it with an
/// online (running-max) softmax, so the cache is read `q_heads / group` times per
/// sequence rather than `q_heads` times.
///
/// Shapes as in [`mla_decode_reference`]: `q` `[batch, q_heads, kv_lora_rank +
/// rope_dim]`, `out` `[batch, q_heads, kv_lora_rank]`, `lse` `[batch, q_heads]`.
///
/// # Errors
/// As [`mla_decode_reference`], plus [`Error::ShapeMismatch`] for `out` or `lse`
/// lengths; nothing is written on error.
pub fn mla_decode(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    tables: &PaddedTables,
    params: &MlaParams,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<()> {
    let (batch, rank) = check_decode(storage, layer, q.len(), tables, params)?;
    let layout = storage.layout();
    let s = layout.shape();
    let (qh, d, bs, dtype) = (s.num_q_heads, s.head_dim, layout.block_size(), s.kv_dtype);
    check_len(
        "out elements (batch * q_heads * kv_lora_rank)",
        batch * qh * rank,
        out.len(),
    )?;
    let mut own_lse;
    let lse = match lse {
        Some(l) => {
            check_len("lse elements (batch * q_heads)", batch * qh, l.len())?;
            l
        }
        None => {
            own_lse = vec![0.0f32; batch * qh];
            &mut own_lse[..]
        }
    };
    let lut = (dtype == DType::Fp8E4M3).then(|| fp8_e4m3_table(params.kv_scale));
    let g = heads_per_job(qh);
    let region = storage.region(layer);
    let es = dtype.size_bytes();
    out.par_chunks_mut(g * rank)
        .zip(lse.par_chunks_mut(g))
        .enumerate()
        .for_each_init(
            || (vec![0f32; bs * d], vec![0f32; bs]),
            |(tile, scores), (job, (out, lse))| {
                let seq = job / (qh / g);
                let h0 = (job % (qh / g)) * g;
                let ctx = tables.context_lens[seq] as usize;
                out.fill(0.0);
                lse.fill(f32::NEG_INFINITY);
                if ctx == 0 {
                    return;
                }
                let table = tables.row(seq);
                let mut max = vec![f32::NEG_INFINITY; g];
                let mut sum = vec![0f32; g];
                let mut t0 = 0;
                while t0 < ctx {
                    let n = (ctx - t0).min(bs);
                    let start = layout.elem_offset(BlockId(table[t0 / bs]), Kv::K, 0, 0) * es;
                    let tile = &mut tile[..n * d];
                    // The tables were validated against the arena and a page's n <= bs
                    // latents are contiguous, so the range is inside the region.
                    let bytes = &region[start..start + n * d * es];
                    match &lut {
                        Some(lut) => decode_fp8_with(lut, bytes, tile),
                        None => decode_unchecked(dtype, bytes, tile),
                    }
                    for k in 0..g {
                        let row = seq * qh + h0 + k;
                        let qv = &q[row * d..(row + 1) * d];
                        let sc = &mut scores[..n];
                        let mut m = max[k];
                        for (t, sc) in sc.iter_mut().enumerate() {
                            let x = &tile[t * d..(t + 1) * d];
                            *sc = dot(qv, x) * params.scale;
                            m = m.max(*sc);
                        }
                        let acc = &mut out[k * rank..(k + 1) * rank];
                        let correction = (max[k] - m).exp();
                        if correction != 1.0 {
                            acc.iter_mut().for_each(|a| *a *= correction);
                        }
                        let mut l = sum[k] * correction;
                        for (t, &sc) in sc.iter().enumerate() {
                            let p = (sc - m).exp();
                            l += p;
                            let x = &tile[t * d..t * d + rank];
                            acc.iter_mut().zip(x).for_each(|(a, &v)| *a += p * v);
                        }
                        max[k] = m;
                        sum[k] = l;
                    }
                    t0 += n;
                }
                for k in 0..g {
                    let inv = 1.0 / sum[k];
                    out[k * rank..(k + 1) * rank]
                        .iter_mut()
                        .for_each(|a| *a *= inv);
                    lse[k] = max[k] + sum[k].ln();
                }
            },
        );
    Ok(())
}

/// Dot product with eight independent accumulators (so the compiler vectorises it).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::shape::ModelShape;

    #[test]
    fn heads_are_grouped_by_divisors() {
        assert_eq!(heads_per_job(128), 16);
        assert_eq!(heads_per_job(16), 16);
        assert_eq!(heads_per_job(12), 12);
        assert_eq!(heads_per_job(20), 10);
        assert_eq!(heads_per_job(17), 1);
        assert_eq!(heads_per_job(1), 1);
    }

    #[test]
    fn standard_layouts_are_refused() {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            kv_dtype: DType::F32,
        };
        let mut st = HostStorage::new(KvLayout::new(shape, 4).unwrap(), 2).unwrap();
        let t = PaddedTables {
            tables: vec![0],
            context_lens: vec![1],
            batch: 1,
            max_blocks: 1,
        };
        let p = MlaParams::new(8);
        assert!(matches!(
            mla_decode_reference(&st, 0, &[0.0; 16], &t, &p),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            write_latent(&mut st, 0, &[Slot(0)], &[0.0; 8], 1.0),
            Err(Error::Unsupported(_))
        ));
    }
}
