//! The `f64` reference: plain loops over the stored K/V values, read through the block
//! tables and the [`KvLayout`](crate::KvLayout). Slow and obviously right; the fast
//! path and the CUDA kernels are tested against it.

use super::{check_decode_q, check_paged, check_prefill_q, AttentionParams, DecodeOutput};
use crate::error::Result;
use crate::executor::storage::{HostStorage, Storage};
use crate::ids::BlockId;
use crate::layout::convert::decode_one_f64;
use crate::layout::Kv;
use crate::tables::PaddedTables;

/// Paged decode attention in `f64`: one query token per sequence, at position
/// `context_len - 1`, over the sequence's whole (or windowed) context.
///
/// `q` is `[batch, q_heads, head_dim]`; the output is `[batch, q_heads, head_dim]` and
/// `lse` is `[batch, q_heads]`.
///
/// # Errors
/// Before any read: [`crate::Error::ShapeMismatch`] for a bad layer, `q` length, table
/// shape or slope count; [`crate::Error::CorruptBlockTable`] for a context longer than its
/// table covers; [`crate::Error::BlockOutOfRange`] for a table entry outside the arena;
/// [`crate::Error::InvalidConfig`] for a bad shape or parameter.
pub fn paged_decode_reference(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    tables: &PaddedTables,
    params: &AttentionParams,
) -> Result<DecodeOutput> {
    let layout = storage.layout();
    let batch = check_paged(layout, storage.num_blocks(), layer, tables, params, None)?;
    check_decode_q(layout, batch, q.len())?;
    let s = layout.shape();
    let (qh, d) = (s.num_q_heads, s.head_dim);
    let mut out = DecodeOutput {
        out: vec![0.0; batch * qh * d],
        lse: vec![f64::NEG_INFINITY; batch * qh],
    };
    for i in 0..batch {
        let ctx = tables.context_lens[i] as usize;
        if ctx == 0 {
            continue;
        }
        let p = ctx - 1;
        for h in 0..qh {
            let row = i * qh + h;
            let lse = attend(
                storage,
                layer,
                tables.row(i),
                p,
                params.window_start(p)..ctx,
                &q[row * d..(row + 1) * d],
                h,
                params,
                &mut out.out[row * d..(row + 1) * d],
            );
            out.lse[row] = lse;
        }
    }
    Ok(out)
}

/// Paged prefill attention in `f64`: sequence `i` brings the query tokens
/// `query_start_loc[i]..query_start_loc[i + 1]` of `q`, which are the *last* tokens of its
/// context (their K/V already written to the cache). Query `j` of `n` sits at position
/// `context_len - n + j` and attends causally to the cached prefix and to the new tokens
/// up to itself.
///
/// `q` is `[tokens, q_heads, head_dim]`; the output is `[tokens, q_heads, head_dim]` and
/// `lse` is `[tokens, q_heads]`.
///
/// # Errors
/// As [`paged_decode_reference`], plus [`crate::Error::ShapeMismatch`] or
/// [`crate::Error::InvalidConfig`] for `query_start_loc` (wrong length, decreasing, more
/// queries than context).
pub fn paged_prefill_reference(
    storage: &HostStorage,
    layer: usize,
    q: &[f32],
    query_start_loc: &[usize],
    tables: &PaddedTables,
    params: &AttentionParams,
) -> Result<DecodeOutput> {
    let layout = storage.layout();
    let batch = check_paged(
        layout,
        storage.num_blocks(),
        layer,
        tables,
        params,
        Some(query_start_loc),
    )?;
    let tokens = check_prefill_q(layout, tables, query_start_loc, q.len())?;
    let s = layout.shape();
    let (qh, d) = (s.num_q_heads, s.head_dim);
    let mut out = DecodeOutput {
        out: vec![0.0; tokens * qh * d],
        lse: vec![f64::NEG_INFINITY; tokens * qh],
    };
    for i in 0..batch {
        let ctx = tables.context_lens[i] as usize;
        let (a, b) = (query_start_loc[i], query_start_loc[i + 1]);
        for (j, tok) in (a..b).enumerate() {
            let p = ctx - (b - a) + j;
            for h in 0..qh {
                let row = tok * qh + h;
                out.lse[row] = attend(
                    storage,
                    layer,
                    tables.row(i),
                    p,
                    params.window_start(p)..p + 1,
                    &q[row * d..(row + 1) * d],
                    h,
                    params,
                    &mut out.out[row * d..(row + 1) * d],
                );
            }
        }
    }
    Ok(out)
}

/// One query head at position `p` over the cached positions `range`; writes the
/// normalised output and returns the lse (`-inf` and zeros for an empty range).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend(
    storage: &HostStorage,
    layer: usize,
    table: &[u32],
    p: usize,
    range: std::ops::Range<usize>,
    q: &[f32],
    h: usize,
    params: &AttentionParams,
    out: &mut [f64],
) -> f64 {
    let layout = storage.layout();
    let s = layout.shape();
    let (d, bs, dtype) = (s.head_dim, layout.block_size(), layout.dtype());
    let kv_head = h / s.group_size();
    let region = storage.region(layer);
    let slope = f64::from(params.slope(h));
    let elem = |kv: Kv, t: usize| {
        let block = BlockId(table[t / bs]);
        layout.elem_offset(block, kv, kv_head, t % bs)
    };
    out.fill(0.0);
    if range.is_empty() {
        return f64::NEG_INFINITY;
    }
    let logits: Vec<f64> = range
        .clone()
        .map(|t| {
            let base = elem(Kv::K, t);
            let dot: f64 = (0..d)
                .map(|i| f64::from(q[i]) * decode_one_f64(dtype, region, base + i, params.k_scale))
                .sum();
            dot * f64::from(params.scale) + slope * (t as f64 - p as f64)
        })
        .collect();
    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
    let sum: f64 = weights.iter().sum();
    for (t, w) in range.zip(&weights) {
        let base = elem(Kv::V, t);
        let p = w / sum;
        for (i, o) in out.iter_mut().enumerate() {
            *o += p * decode_one_f64(dtype, region, base + i, params.v_scale);
        }
    }
    m + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::merge_lse;
    use crate::layout::shape::{DType, ModelShape};
    use crate::layout::KvLayout;

    #[test]
    fn two_ranges_merge_into_the_whole() {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            kv_dtype: DType::F32,
        };
        let layout = KvLayout::new(shape, 4).unwrap();
        let mut st = HostStorage::new(layout, 4).unwrap();
        for (i, b) in st.region_mut(0).chunks_exact_mut(4).enumerate() {
            let x = ((i * 7919) % 97) as f32 / 50.0 - 1.0;
            b.copy_from_slice(&x.to_le_bytes());
        }
        let table = [2u32, 0, 3];
        let q: Vec<f32> = (0..8).map(|i| i as f32 * 0.3 - 1.0).collect();
        let mut params = AttentionParams::new(8);
        params.alibi_slopes = Some(vec![0.25, 0.5]);
        let (mut whole, mut a, mut b, mut merged) = ([0.0; 8], [0.0; 8], [0.0; 8], [0.0; 8]);
        for split in [1, 4, 5, 9] {
            let lw = attend(&st, 0, &table, 10, 0..11, &q, 1, &params, &mut whole);
            let la = attend(&st, 0, &table, 10, 0..split, &q, 1, &params, &mut a);
            let lb = attend(&st, 0, &table, 10, split..11, &q, 1, &params, &mut b);
            let lm = merge_lse(&a, la, &b, lb, &mut merged);
            assert!((lm - lw).abs() < 1e-12);
            for (x, y) in merged.iter().zip(&whole) {
                assert!((x - y).abs() < 1e-12);
            }
        }
    }
}
