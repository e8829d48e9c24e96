//! Paged attention on the CPU: an `f64` reference, a fast rayon path, `reshape_and_cache`,
//! and a tiny random-weight model for the serve simulation.
//!
//! Every kernel reads K and V in place through block tables and the [`KvLayout`]; nothing
//! gathers a sequence into a contiguous copy.
//!
//! # Semantics (shared by every kernel here and by the CUDA kernels)
//!
//! A query token at absolute position `p` of a sequence (for decode `p = ctx - 1`; for a
//! prefill chunk of `n` new tokens ending at `ctx`, `p = ctx - n + j`) attends to the
//! cached positions `start..=p`, where `start = p + 1 - w` under a sliding window of `w`
//! tokens and 0 otherwise. For query head `h`, with `kv_head = h / (q_heads / kv_heads)`:
//!
//! ```text
//! logit[t] = scale * (q[h] . k[kv_head, t]) + alibi_slope[h] * (t - p)
//! out[h]   = sum_t softmax(logit)[t] * v[kv_head, t]
//! lse[h]   = ln(sum_t exp(logit[t]))            (natural log, of the scaled logits)
//! ```
//!
//! fp8 caches are dequantised as `code * k_scale` (keys) and `code * v_scale` (values).
//! A sequence with no context produces zeros and `lse = -inf`.
//!
//! | module | what |
//! |---|---|
//! | [`reference`](mod@reference) | `f64` decode and prefill over the stored values, for tests |
//! | [`cpu`] | rayon decode (split-KV) and chunked prefill, `reshape_and_cache` |
//! | [`mla`] | decode over a latent (MLA) cache in the absorbed form, `f64` and rayon |
//! | `model` (feature `testing`) | `TinyModel`, a seeded random attention stack the crate's tests and examples run |
//! | [`rope`] | rotary embeddings (interleaved and NeoX halves) fused with the cache write |
//! | [`plan_splits`] | the split planner of the GPU kernels (pure, no GPU needed) |
//! | [`decode_mma`] | the decode kernel's tensor-core path: launch geometry, and (feature `testing`) a CPU replay of its lanes |
//! | `cuda` (feature `cuda`) | the paged decode kernel over a `CudaStorage` |

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_prefill;
pub mod decode_mma;
mod kernel_plan;
mod kernels;
pub mod mla;
#[cfg(any(test, feature = "testing"))]
pub mod model;
pub mod reference;
pub mod rope;

pub use kernel_plan::{
    build_work_list, cut_work_list, live_range, plan_splits, plan_splits_for_occupancy,
    resident_ctas, split_merge_bytes, split_plan_with, stage_decode_step, validate_params,
    SplitPlan, StagedStep, StepCapacity, TableCapacity, WorkBuffers, WorkItem, WorkList,
    CTA_OVERHEAD_TOKENS, MAX_SPLITS, MIN_TOKENS_PER_SPLIT, STEP_HEADER_WORDS, WORK_ITEM_WORDS,
};
pub use rope::{rope_and_cache, Rope, RopeStyle};

use crate::error::{Error, Result};
use crate::layout::convert::check_scale;
use crate::layout::KvLayout;
use crate::tables::PaddedTables;

/// Parameters of one attention call.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionParams {
    /// Softmax scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// ALiBi slopes, one per query head.
    pub alibi_slopes: Option<Vec<f32>>,
    /// Attend only to the last `w` tokens (the query's own position included).
    pub sliding_window: Option<usize>,
    /// fp8 dequantisation scale of keys (1.0 otherwise).
    pub k_scale: f32,
    /// fp8 dequantisation scale of values (1.0 otherwise).
    pub v_scale: f32,
}

impl AttentionParams {
    /// Plain attention for `head_dim`: scale `1 / sqrt(head_dim)`, no ALiBi, no window,
    /// fp8 scales 1.
    pub fn new(head_dim: usize) -> Self {
        AttentionParams {
            scale: 1.0 / (head_dim.max(1) as f32).sqrt(),
            alibi_slopes: None,
            sliding_window: None,
            k_scale: 1.0,
            v_scale: 1.0,
        }
    }

    /// Checks the parameters against `num_q_heads`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a non-finite softmax scale, a fp8 scale that is not
    /// finite and positive, a window of 0 or a non-finite slope;
    /// [`Error::ShapeMismatch`] for a slope count other than `num_q_heads`.
    pub fn validate(&self, num_q_heads: usize) -> Result<()> {
        if !self.scale.is_finite() {
            return Err(Error::config(
                "scale",
                format!("{} is not finite", self.scale),
            ));
        }
        check_scale("k_scale", self.k_scale)?;
        check_scale("v_scale", self.v_scale)?;
        if self.sliding_window == Some(0) {
            return Err(Error::config("sliding_window", "a window of 0 tokens"));
        }
        if let Some(s) = &self.alibi_slopes {
            if s.len() != num_q_heads {
                return Err(Error::ShapeMismatch {
                    what: "ALiBi slopes (one per query head)",
                    expected: num_q_heads,
                    got: s.len(),
                });
            }
            if let Some(x) = s.iter().find(|x| !x.is_finite()) {
                return Err(Error::config("alibi_slopes", format!("{x} is not finite")));
            }
        }
        Ok(())
    }

    /// The ALiBi slope of query head `h` (0 without ALiBi).
    #[inline]
    pub fn slope(&self, h: usize) -> f32 {
        self.alibi_slopes.as_ref().map_or(0.0, |s| s[h])
    }

    /// First position a query at position `p` attends to.
    #[inline]
    pub fn window_start(&self, p: usize) -> usize {
        match self.sliding_window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// The standard ALiBi slopes for `num_heads` heads (Press et al.; also for head counts
/// that are not powers of two).
pub fn alibi_slopes(num_heads: usize) -> Vec<f32> {
    fn pow2_slopes(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-(2f64.powf(-((n as f64).log2() - 3.0))));
        (0..n).map(|i| start * start.powi(i as i32)).collect()
    }
    if num_heads == 0 {
        return Vec::new();
    }
    let closest = 1usize << (usize::BITS - 1 - num_heads.leading_zeros());
    let mut s = pow2_slopes(closest);
    if closest < num_heads {
        let extra = pow2_slopes(2 * closest);
        s.extend(extra.iter().step_by(2).take(num_heads - closest));
    }
    s.into_iter().map(|x| x as f32).collect()
}

/// Output of the reference kernels.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeOutput {
    /// `[tokens, q_heads, head_dim]` (decode: one token per sequence).
    pub out: Vec<f64>,
    /// `[tokens, q_heads]`: natural-log sum-exp of the scaled logits (`-inf` for an
    /// empty context).
    pub lse: Vec<f64>,
}

/// Merges the normalised outputs of two KV splits of the same query head into `out`
/// and returns the merged `lse`: `out = (e^(lse_a) out_a + e^(lse_b) out_b) / (e^(lse_a) + e^(lse_b))`,
/// computed max-subtracted. A split with `lse = -inf` (no tokens) contributes nothing.
///
/// # Panics
/// When the three slices differ in length.
pub fn merge_lse(out_a: &[f64], lse_a: f64, out_b: &[f64], lse_b: f64, out: &mut [f64]) -> f64 {
    assert!(out_a.len() == out.len() && out_b.len() == out.len());
    if lse_a == f64::NEG_INFINITY && lse_b == f64::NEG_INFINITY {
        out.fill(0.0);
        return f64::NEG_INFINITY;
    }
    let m = lse_a.max(lse_b);
    let (wa, wb) = ((lse_a - m).exp(), (lse_b - m).exp());
    let sum = wa + wb;
    for ((o, a), b) in out.iter_mut().zip(out_a).zip(out_b) {
        *o = (wa * a + wb * b) / sum;
    }
    m + sum.ln()
}

/// Checks what every paged kernel needs before touching memory: a valid shape, the layer,
/// the tables' own consistency, every used table entry inside the arena, and the
/// parameters. Returns the batch size.
pub(crate) fn check_paged(
    layout: &KvLayout,
    num_blocks: usize,
    layer: usize,
    tables: &PaddedTables,
    params: &AttentionParams,
    query_start_loc: Option<&[usize]>,
) -> Result<usize> {
    layout.shape().validate()?;
    if layout.is_latent() {
        return Err(Error::Unsupported(
            "a latent (MLA) cache has no separate K and V: read it with attention::mla".into(),
        ));
    }
    if layer >= layout.num_layers() {
        return Err(Error::ShapeMismatch {
            what: "layer index",
            expected: layout.num_layers(),
            got: layer,
        });
    }
    params.validate(layout.shape().num_q_heads)?;
    // The same table checks that guard kernel launches; holes a sliding window left
    // are accepted only before the window of each row's first query.
    crate::tables::validate_tables_window(
        layout,
        num_blocks,
        tables,
        params.sliding_window,
        query_start_loc,
    )?;
    Ok(tables.batch)
}

/// Checks decode queries: `[batch, q_heads, head_dim]`.
pub(crate) fn check_decode_q(layout: &KvLayout, batch: usize, q: usize) -> Result<()> {
    let s = layout.shape();
    let want = batch * s.num_q_heads * s.head_dim;
    if q != want {
        return Err(Error::ShapeMismatch {
            what: "q elements (batch * q_heads * head_dim)",
            expected: want,
            got: q,
        });
    }
    Ok(())
}

/// Checks prefill queries: `query_start_loc` has `batch + 1` non-decreasing offsets from 0,
/// each sequence's query count fits its context, and `q` is `[tokens, q_heads, head_dim]`.
/// Returns the number of query tokens.
pub(crate) fn check_prefill_q(
    layout: &KvLayout,
    tables: &PaddedTables,
    query_start_loc: &[usize],
    q: usize,
) -> Result<usize> {
    let batch = tables.batch;
    if query_start_loc.len() != batch + 1 {
        return Err(Error::ShapeMismatch {
            what: "query_start_loc entries (batch + 1)",
            expected: batch + 1,
            got: query_start_loc.len(),
        });
    }
    if query_start_loc[0] != 0 {
        return Err(Error::config(
            "query_start_loc",
            format!("must start at 0, starts at {}", query_start_loc[0]),
        ));
    }
    for i in 0..batch {
        let (a, b) = (query_start_loc[i], query_start_loc[i + 1]);
        if b < a {
            return Err(Error::config(
                "query_start_loc",
                format!("decreases at sequence {i}: {a} then {b}"),
            ));
        }
        let ctx = tables.context_lens[i] as usize;
        if b - a > ctx {
            return Err(Error::config(
                "query_start_loc",
                format!(
                    "sequence {i} has {} query tokens but a context of {ctx}",
                    b - a
                ),
            ));
        }
    }
    let tokens = query_start_loc[batch];
    let s = layout.shape();
    let want = tokens * s.num_q_heads * s.head_dim;
    if q != want {
        return Err(Error::ShapeMismatch {
            what: "q elements (tokens * q_heads * head_dim)",
            expected: want,
            got: q,
        });
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_of_two_halves_is_the_whole() {
        // Softmax over 4 logits with 2-d values, split 2 + 2.
        let logits = [0.3f64, -1.2, 2.0, 0.7];
        let vals = [[1.0f64, -2.0], [0.5, 0.25], [-1.0, 3.0], [2.0, 2.0]];
        let part = |r: std::ops::Range<usize>| {
            let m = logits[r.clone()]
                .iter()
                .cloned()
                .fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = logits[r.clone()].iter().map(|x| (x - m).exp()).sum();
            let mut o = [0.0; 2];
            for t in r {
                let p = (logits[t] - m).exp() / l;
                o[0] += p * vals[t][0];
                o[1] += p * vals[t][1];
            }
            (o, m + l.ln())
        };
        let (oa, la) = part(0..2);
        let (ob, lb) = part(2..4);
        let (ow, lw) = part(0..4);
        let mut o = [0.0; 2];
        let l = merge_lse(&oa, la, &ob, lb, &mut o);
        assert!((l - lw).abs() < 1e-12);
        for i in 0..2 {
            assert!((o[i] - ow[i]).abs() < 1e-12);
        }
        // Merging with an empty split is the identity, in either order.
        let l = merge_lse(&oa, la, &[9.0, 9.0], f64::NEG_INFINITY, &mut o);
        assert_eq!((l, o), (la, oa));
        let l = merge_lse(&[9.0, 9.0], f64::NEG_INFINITY, &oa, la, &mut o);
        assert_eq!((l, o), (la, oa));
        let l = merge_lse(
            &[1.0; 2],
            f64::NEG_INFINITY,
            &[2.0; 2],
            f64::NEG_INFINITY,
            &mut o,
        );
        assert_eq!((l, o), (f64::NEG_INFINITY, [0.0; 2]));
        // Large lse values do not overflow.
        let l = merge_lse(&[1.0], 1000.0, &[3.0], 1000.0, &mut o[..1]);
        assert!((l - (1000.0 + 2f64.ln())).abs() < 1e-9 && (o[0] - 2.0).abs() < 1e-12);
    }

    #[test]
    fn alibi_slopes_match_the_paper() {
        let s = alibi_slopes(8);
        let want: Vec<f32> = (1..=8).map(|i| 2f32.powi(-i)).collect();
        assert_eq!(s, want);
        let s = alibi_slopes(12);
        assert_eq!(s.len(), 12);
        assert_eq!(&s[..8], &want[..]);
        assert_eq!(s[8], 2f32.powf(-0.5));
    }

    #[test]
    fn params_are_checked() {
        let mut p = AttentionParams::new(64);
        assert!(p.validate(4).is_ok());
        p.alibi_slopes = Some(vec![0.5; 3]);
        assert!(matches!(p.validate(4), Err(Error::ShapeMismatch { .. })));
        p.alibi_slopes = None;
        p.sliding_window = Some(0);
        assert!(matches!(p.validate(4), Err(Error::InvalidConfig { .. })));
        p.sliding_window = None;
        p.k_scale = -1.0;
        assert!(matches!(
            p.validate(4),
            Err(Error::InvalidConfig {
                field: "k_scale",
                ..
            })
        ));
        assert_eq!(AttentionParams::new(64).window_start(10), 0);
        p.sliding_window = Some(4);
        assert_eq!(p.window_start(10), 7);
        assert_eq!(p.window_start(2), 0);
    }
}
