//! Checks that run on the host before every attention launch, and the planner that
//! splits long contexts across CTAs. Pure functions: usable and tested without a GPU.
//!
//! The kernels trust these checks for memory safety: a table entry the kernel reads
//! must name a block inside the arena, and each row must cover its context length.

use super::AttentionParams;
use crate::error::{Error, Result};
use crate::layout::KvLayout;
use crate::tables::MAX_CONTEXT_TOKENS;

/// Most splits of one sequence's context.
pub const MAX_SPLITS: u32 = 64;

/// The planner does not split a context into pieces shorter than this.
pub const MIN_TOKENS_PER_SPLIT: usize = 256;

/// Checks attention parameters against the model ([`AttentionParams::validate`]) and
/// the kernels' own limit: a window that fits `u32`.
///
/// # Errors
/// [`Error::ShapeMismatch`] for a slope count, [`Error::InvalidConfig`] otherwise.
pub fn validate_params(layout: &KvLayout, params: &AttentionParams) -> Result<()> {
    params.validate(layout.shape().num_q_heads)?;
    if let Some(w) = params.sliding_window {
        if w > u32::MAX as usize {
            return Err(Error::config(
                "sliding_window",
                format!("{w}; the GPU kernels take at most u32::MAX"),
            ));
        }
    }
    Ok(())
}

/// How a decode launch cuts each sequence's context: split `s` covers tokens
/// `[s * tokens_per_split, (s + 1) * tokens_per_split)`. With one split the kernel
/// writes the output directly; with more, a merge kernel combines the partial results
/// by their log-sum-exp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    /// Splits per sequence (the grid's z dimension).
    pub num_splits: u32,
    /// Tokens per split, a multiple of the block size.
    pub tokens_per_split: u32,
}

/// Chooses the split count for a batch: enough CTAs to give every SM two, but no
/// split shorter than [`MIN_TOKENS_PER_SPLIT`] tokens and at most [`MAX_SPLITS`].
/// A batch that already fills the GPU (64 sequences x 8 KV heads on 132 SMs) gets one
/// split; one sequence of 32k tokens with 8 KV heads gets 33 splits of 1008 tokens.
pub fn plan_splits(
    batch: usize,
    num_kv_heads: usize,
    max_context: usize,
    block_size: usize,
    num_sms: usize,
) -> SplitPlan {
    let bs = block_size.max(1);
    let ctas = batch.saturating_mul(num_kv_heads).max(1);
    let target = num_sms.max(1) * 2;
    let by_len = (max_context / MIN_TOKENS_PER_SPLIT).max(1);
    let wanted = if ctas >= target {
        1
    } else {
        target.div_ceil(ctas)
    };
    let splits = wanted.min(by_len).min(MAX_SPLITS as usize).max(1);
    even_splits(max_context, bs, splits)
}

/// CTAs of the decode kernel the GPU holds at once: `num_sms` times the CTAs per SM
/// the driver reports for the compiled kernel (`cuOccupancyMaxActiveBlocksPerMultiprocessor`
/// with its threads and dynamic shared memory; `CudaAttention` asks it once per
/// specialisation). At least 1.
pub fn resident_ctas(num_sms: usize, ctas_per_sm: usize) -> usize {
    num_sms.max(1).saturating_mul(ctas_per_sm.max(1))
}

/// Tokens of fixed cost a CTA pays besides its tokens (launch, q load, epilogue),
/// in the planner's cost model: what a split must beat.
pub const CTA_OVERHEAD_TOKENS: usize = 64;

/// Number of splits of `plan` that hold tokens of a context of `ctx` tokens whose
/// attention starts at `start` (the sliding window's first token, or 0): the CTAs
/// that do work for this sequence and KV head.
fn busy_splits(plan: &SplitPlan, start: usize, ctx: usize) -> usize {
    if start >= ctx {
        return 0;
    }
    let per = plan.tokens_per_split.max(1) as usize;
    (ctx - 1) / per - start / per + 1
}

/// The split plan for a batch on a device, from each sequence's own context length
/// and the occupancy the driver reports, honouring the sliding window.
///
/// Cost model (pure, `O(batch)` per candidate): each candidate split count `n`
/// (1..=[`MAX_SPLITS`], splits of at least [`MIN_TOKENS_PER_SPLIT`] tokens) gives
/// `C(n)` CTAs that hold tokens (per sequence: the splits that meet its windowed
/// range, times the KV heads). They run in `ceil(C(n) / resident)` waves of at most
/// `tokens_per_split + CTA_OVERHEAD_TOKENS` token-times each, `resident` being
/// [`resident_ctas`]. The smallest estimate wins, ties to fewer splits. Wave
/// quantisation is the effect this catches: 64 sequences x 8 KV heads on 132 SMs at 3
/// CTAs per SM is 1.29 waves in one split (two waves' time), 3 splits of 1,376 tokens
/// fill 3.9 waves (four waves of a third: 31 % less, see the tests). The estimate
/// assumes each wave as long as a full split; short sequences' CTAs end early, which
/// it does not credit.
pub fn plan_splits_for_occupancy(
    context_lens: &[u32],
    sliding_window: Option<usize>,
    num_kv_heads: usize,
    block_size: usize,
    num_sms: usize,
    ctas_per_sm: usize,
) -> SplitPlan {
    let bs = block_size.max(1);
    let max_context = context_lens.iter().copied().max().unwrap_or(0) as usize;
    let resident = resident_ctas(num_sms, ctas_per_sm);
    let heads = num_kv_heads.max(1);
    let start = |ctx: usize| match sliding_window {
        Some(w) if w > 0 && ctx > w => ctx - w,
        _ => 0,
    };
    let max_splits = (max_context / MIN_TOKENS_PER_SPLIT).clamp(1, MAX_SPLITS as usize);
    let mut best: Option<(u128, SplitPlan)> = None;
    let mut last_per = 0;
    for n in 1..=max_splits {
        let plan = even_splits(max_context, bs, n);
        if plan.tokens_per_split as usize == last_per {
            continue; // the same cut as a smaller n
        }
        last_per = plan.tokens_per_split as usize;
        let ctas: usize = context_lens
            .iter()
            .map(|&c| busy_splits(&plan, start(c as usize), c as usize))
            .sum::<usize>()
            .saturating_mul(heads);
        let waves = ctas.div_ceil(resident).max(1) as u128;
        let cost = waves * (plan.tokens_per_split as u128 + CTA_OVERHEAD_TOKENS as u128);
        if best.map_or(true, |(c, _)| cost < c) {
            best = Some((cost, plan));
        }
    }
    best.map_or_else(|| even_splits(max_context, bs, 1), |(_, p)| p)
}

/// Bytes the split merge adds to one layer's decode: with `num_splits > 1` every split
/// writes an f32 row and log-sum-exp per query head, and `paged_attention_merge` reads
/// them back and writes the output row; 0 with one split. The figure behind keeping
/// the merge a second launch: at the bench shape it is about 1.4 % of the K/V bytes
/// (see the tests), what fusing it into the last CTA of each sequence could save,
/// besides one launch.
pub fn split_merge_bytes(batch: usize, q_heads: usize, head_dim: usize, num_splits: u32) -> usize {
    if num_splits <= 1 {
        return 0;
    }
    let per_row = 2 * num_splits as usize * (head_dim + 1) + head_dim;
    batch * q_heads * per_row * 4
}

/// Element capacities of the device buffers a batch's block tables are copied into
/// (`CudaAttention::upload_tables_into`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TableCapacity {
    /// Block ids (padded rows or CSR indices).
    pub ids: usize,
    /// Context lengths or last-page lengths.
    pub lens: usize,
    /// CSR row offsets (0 for padded tables).
    pub indptr: usize,
}

impl TableCapacity {
    /// The capacity a step needing `need` leaves, and whether it allocated: `self`
    /// when every buffer fits, else each short buffer grown to the next power of two
    /// at or above its need, so a batch whose tables grow step by step reallocates
    /// O(log growth) times, and a steady batch never after its first step.
    pub fn grow_for(self, need: TableCapacity) -> (TableCapacity, bool) {
        let g = |have: usize, want: usize| {
            if want <= have {
                have
            } else {
                want.next_power_of_two()
            }
        };
        let next = TableCapacity {
            ids: g(self.ids, need.ids),
            lens: g(self.lens, need.lens),
            indptr: g(self.indptr, need.indptr),
        };
        (next, next != self)
    }
}

fn even_splits(max_context: usize, bs: usize, splits: usize) -> SplitPlan {
    let per = max_context.div_ceil(splits).max(1).next_multiple_of(bs);
    let used = max_context.div_ceil(per).max(1);
    SplitPlan {
        num_splits: used as u32,
        tokens_per_split: per as u32,
    }
}

/// A plan with exactly `num_splits` splits (some may be empty for short sequences),
/// for tests that exercise every split count and for callers that tune by hand.
///
/// # Errors
/// [`Error::InvalidConfig`] for 0 or more than [`MAX_SPLITS`] splits, or a context
/// over [`MAX_CONTEXT_TOKENS`].
pub fn split_plan_with(
    max_context: usize,
    block_size: usize,
    num_splits: u32,
) -> Result<SplitPlan> {
    if num_splits == 0 || num_splits > MAX_SPLITS {
        return Err(Error::config(
            "num_splits",
            format!("{num_splits}; must be in 1..={MAX_SPLITS}"),
        ));
    }
    if max_context > MAX_CONTEXT_TOKENS {
        return Err(Error::TooLong {
            tokens: max_context,
            limit: MAX_CONTEXT_TOKENS,
        });
    }
    let per = max_context
        .div_ceil(num_splits as usize)
        .max(1)
        .next_multiple_of(block_size.max(1));
    Ok(SplitPlan {
        num_splits,
        tokens_per_split: per as u32,
    })
}

#[cfg(test)]
mod occupancy_tests {
    use super::*;

    #[test]
    fn resident_ctas_is_sms_times_occupancy() {
        assert_eq!(resident_ctas(132, 3), 396);
        assert_eq!(resident_ctas(0, 0), 1);
        assert_eq!(resident_ctas(108, 2), 216);
    }

    #[test]
    fn wave_quantisation_is_avoided() {
        // Issue 19's case: 64 x 4096 tokens, 8 KV heads, 132 SMs at 3 CTAs per SM. One
        // split is 512 CTAs: 2 waves of 4096 (+64). Three splits of 1376: 1536 CTAs,
        // 4 waves of 1376 (+64) = 5760 against 8320.
        let lens = vec![4096u32; 64];
        let p = plan_splits_for_occupancy(&lens, None, 8, 16, 132, 3);
        assert_eq!(
            p,
            SplitPlan {
                num_splits: 3,
                tokens_per_split: 1376
            }
        );
        // At 4 CTAs per SM one wave holds all 512: no split.
        let p = plan_splits_for_occupancy(&lens, None, 8, 16, 132, 4);
        assert_eq!(p.num_splits, 1);
        // The old planner (2 CTAs per SM, batch maximum) never splits this batch.
        assert_eq!(plan_splits(64, 8, 4096, 16, 132).num_splits, 1);
    }

    #[test]
    fn per_sequence_lengths_and_the_window_count_only_busy_ctas() {
        // One long sequence among short ones: the short ones add one CTA per head
        // whatever the split, so the long one is split as if alone.
        let mut lens = vec![100u32; 20];
        lens.push(32768);
        let p = plan_splits_for_occupancy(&lens, None, 8, 16, 132, 3);
        let alone = plan_splits_for_occupancy(&[32768], None, 8, 16, 132, 3);
        assert!(p.num_splits >= alone.num_splits / 2, "{p:?} vs {alone:?}");
        assert!(p.num_splits > 1);
        // A window of 512 tokens: the long context does only 512 tokens of work, so it
        // is not split as if it had 32k (the batch maximum would).
        let busy = |plan: &SplitPlan| busy_splits(plan, 32768 - 512, 32768);
        let w = plan_splits_for_occupancy(&[32768], Some(512), 8, 16, 132, 3);
        assert!(busy(&w) <= 2, "{w:?}");
        assert_eq!(busy_splits(&w, 0, 0), 0);
        // Every plan covers the longest context in whole blocks.
        for plan in [p, alone, w] {
            assert_eq!(plan.tokens_per_split % 16, 0);
            assert!(plan.num_splits as usize * plan.tokens_per_split as usize >= 32768);
            assert!(plan.num_splits <= MAX_SPLITS);
        }
        // An empty batch or empty contexts: one split.
        assert_eq!(
            plan_splits_for_occupancy(&[], None, 8, 16, 132, 3).num_splits,
            1
        );
        assert_eq!(
            plan_splits_for_occupancy(&[0, 0], None, 8, 16, 132, 3).num_splits,
            1
        );
    }

    #[test]
    fn the_merge_is_a_small_share_of_the_step_at_the_bench_shape() {
        // 64 x 4096 tokens, 64 query / 8 KV heads, d128, bf16, the planner's 3 splits:
        // 64 x 64 x (2 x 3 x 129 + 128) x 4 bytes against 64 x 4096 x 8 x 128 x 2 x 2.
        let merge = split_merge_bytes(64, 64, 128, 3);
        assert_eq!(merge, 64 * 64 * 902 * 4);
        let kv = 64 * 4096 * 8 * 128 * 2 * 2;
        let share = merge as f64 / kv as f64;
        assert!((0.013..0.014).contains(&share), "{share}");
        assert_eq!(split_merge_bytes(64, 64, 128, 1), 0);
    }

    #[test]
    fn a_decode_trace_reallocates_table_buffers_only_as_they_double() {
        // 64 sequences decoding from 100 to 4196 tokens, page 16, padded tables (the
        // row stride is the batch's longest row): 4096 steps.
        let mut cap = TableCapacity::default();
        let mut allocs = Vec::new();
        for step in 0..4096usize {
            let ctx = 100 + step;
            let need = TableCapacity {
                ids: 64 * (ctx + 1).div_ceil(16),
                lens: 64,
                indptr: 0,
            };
            let (next, grown) = cap.grow_for(need);
            assert!(next.ids >= need.ids && next.lens >= need.lens);
            if grown {
                allocs.push(step);
            }
            cap = next;
        }
        // 448 ids at the start (512), 16,832 at the end: 512, 1024, ..., 32768, seven
        // allocations in 4096 steps, when the page count crosses 8, 16, ..., 256.
        assert_eq!(allocs, [0, 28, 156, 412, 924, 1948, 3996]);
        assert_eq!(allocs[0], 0);
        // A steady batch allocates nothing after its first step.
        let need = TableCapacity {
            ids: 1000,
            lens: 64,
            indptr: 65,
        };
        let (cap, first) = TableCapacity::default().grow_for(need);
        assert!(first);
        for _ in 0..100 {
            assert_eq!(cap.grow_for(need), (cap, false));
        }
    }

    #[test]
    fn busy_splits_counts_intervals_meeting_the_range() {
        let plan = SplitPlan {
            num_splits: 4,
            tokens_per_split: 256,
        };
        assert_eq!(busy_splits(&plan, 0, 1), 1);
        assert_eq!(busy_splits(&plan, 0, 256), 1);
        assert_eq!(busy_splits(&plan, 0, 257), 2);
        assert_eq!(busy_splits(&plan, 255, 257), 2);
        assert_eq!(busy_splits(&plan, 256, 512), 1);
        assert_eq!(busy_splits(&plan, 0, 1024), 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::BlockId;
    use crate::layout::shape::{DType, ModelShape};
    use crate::tables::{validate_csr, validate_tables, CsrTables, PaddedTables};

    fn layout() -> KvLayout {
        KvLayout::new(
            ModelShape {
                num_layers: 2,
                num_q_heads: 8,
                num_kv_heads: 2,
                head_dim: 64,
                kv_dtype: DType::BF16,
            },
            16,
        )
        .unwrap()
    }

    fn padded(rows: &[&[u32]], lens: &[u32], max_blocks: usize) -> PaddedTables {
        let mut tables = vec![0; rows.len() * max_blocks];
        for (i, r) in rows.iter().enumerate() {
            tables[i * max_blocks..i * max_blocks + r.len()].copy_from_slice(r);
        }
        PaddedTables {
            tables,
            context_lens: lens.to_vec(),
            batch: rows.len(),
            max_blocks,
        }
    }

    #[test]
    fn good_padded_tables_pass_and_report_the_longest_context() {
        let t = padded(&[&[3, 4], &[9]], &[17, 16], 2);
        assert_eq!(validate_tables(&layout(), 10, &t).unwrap(), 17);
        // Padding past the context is never read, so it may hold anything.
        let mut t = padded(&[&[3, u32::MAX], &[9, 7]], &[16, 1], 2);
        assert_eq!(validate_tables(&layout(), 10, &t).unwrap(), 16);
        t.context_lens = vec![0, 0];
        assert_eq!(validate_tables(&layout(), 10, &t).unwrap(), 0);
    }

    #[test]
    fn hostile_padded_tables_are_rejected() {
        let l = layout();
        // Block id past the arena, in the part the kernel reads.
        let t = padded(&[&[3, 10]], &[17], 2);
        assert_eq!(
            validate_tables(&l, 10, &t),
            Err(Error::BlockOutOfRange {
                block: BlockId(10),
                num_blocks: 10
            })
        );
        let t = padded(&[&[u32::MAX]], &[1], 1);
        assert!(matches!(
            validate_tables(&l, 10, &t),
            Err(Error::BlockOutOfRange { .. })
        ));
        // Context longer than the row covers.
        let t = padded(&[&[1, 2]], &[33], 2);
        assert!(matches!(
            validate_tables(&l, 10, &t),
            Err(Error::CorruptBlockTable(_))
        ));
        // Lengths near u32::MAX: over the kernel limit, whatever the table.
        for len in [u32::MAX, u32::MAX - 15, (MAX_CONTEXT_TOKENS + 1) as u32] {
            let t = padded(&[&[1]], &[len], 1);
            assert!(matches!(
                validate_tables(&l, 10, &t),
                Err(Error::TooLong { .. })
            ));
        }
        // Short buffer, missing or extra lengths.
        let mut t = padded(&[&[1, 2]], &[17], 2);
        t.tables.pop();
        assert!(matches!(
            validate_tables(&l, 10, &t),
            Err(Error::ShapeMismatch { .. })
        ));
        let mut t = padded(&[&[1, 2]], &[17], 2);
        t.context_lens.push(1);
        assert!(matches!(
            validate_tables(&l, 10, &t),
            Err(Error::ShapeMismatch { .. })
        ));
        let t = PaddedTables {
            tables: vec![],
            context_lens: vec![],
            batch: usize::MAX,
            max_blocks: 2,
        };
        assert!(matches!(
            validate_tables(&l, 10, &t),
            Err(Error::ShapeMismatch { .. })
        ));
    }

    fn csr(rows: &[&[u32]], last: &[u32]) -> CsrTables {
        let mut t = CsrTables::default();
        t.indptr.push(0);
        for r in rows {
            t.indices.extend_from_slice(r);
            t.indptr.push(t.indices.len() as u32);
        }
        t.last_page_len = last.to_vec();
        t
    }

    #[test]
    fn good_csr_tables_pass() {
        let t = csr(&[&[3, 4], &[], &[9]], &[1, 0, 16]);
        assert_eq!(validate_csr(&layout(), 10, &t).unwrap(), 17);
    }

    #[test]
    fn hostile_csr_tables_are_rejected() {
        let l = layout();
        let bad = [
            csr(&[&[3, 10]], &[1]), // id out of range
            csr(&[&[3]], &[17]),    // last page longer than a block
            csr(&[&[3]], &[0]),     // non-empty row with an empty last page
            csr(&[&[]], &[5]),      // empty row claiming tokens
        ];
        for t in &bad {
            assert!(validate_csr(&l, 10, t).is_err(), "{t:?}");
        }
        let mut t = csr(&[&[1], &[2]], &[1, 1]);
        t.indptr = vec![0, 2, 1];
        assert!(matches!(
            validate_csr(&l, 10, &t),
            Err(Error::CorruptBlockTable(_))
        ));
        let mut t = csr(&[&[1]], &[1]);
        t.indptr = vec![0, 5];
        assert!(matches!(
            validate_csr(&l, 10, &t),
            Err(Error::CorruptBlockTable(_))
        ));
        let mut t = csr(&[&[1]], &[1]);
        t.indptr.pop();
        assert!(matches!(
            validate_csr(&l, 10, &t),
            Err(Error::ShapeMismatch { .. })
        ));
    }

    #[test]
    fn params_are_checked() {
        let l = layout();
        let mut p = AttentionParams::new(64);
        assert!(validate_params(&l, &p).is_ok());
        p.alibi_slopes = Some(vec![0.5; 7]);
        assert!(matches!(
            validate_params(&l, &p),
            Err(Error::ShapeMismatch { .. })
        ));
        p.alibi_slopes = Some(vec![0.5; 8]);
        assert!(validate_params(&l, &p).is_ok());
        for bad in [
            AttentionParams {
                k_scale: 0.0,
                ..AttentionParams::new(64)
            },
            AttentionParams {
                v_scale: f32::NAN,
                ..AttentionParams::new(64)
            },
            AttentionParams {
                sliding_window: Some(0),
                ..AttentionParams::new(64)
            },
            AttentionParams {
                scale: f32::INFINITY,
                ..AttentionParams::new(64)
            },
        ] {
            assert!(validate_params(&l, &bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn planner_fills_the_gpu_without_tiny_splits() {
        // A batch that fills 132 SMs twice over is not split.
        let p = plan_splits(64, 8, 4096, 16, 132);
        assert_eq!(p.num_splits, 1);
        assert!(p.tokens_per_split as usize >= 4096);
        // One long sequence is split to fill the GPU.
        let p = plan_splits(1, 8, 32768, 16, 132);
        assert_eq!(p.num_splits, 33);
        assert_eq!(p.tokens_per_split % 16, 0);
        assert!(p.num_splits as usize * p.tokens_per_split as usize >= 32768);
        // A short context is never cut below the minimum.
        let p = plan_splits(1, 1, 300, 16, 132);
        assert_eq!(p.num_splits, 1);
        // Every plan covers its context, with splits that are whole blocks.
        for batch in [1, 3, 17, 200] {
            for ctx in [0, 1, 15, 16, 17, 255, 256, 4097, 100_000] {
                for bs in [1, 8, 16, 32] {
                    let p = plan_splits(batch, 4, ctx, bs, 108);
                    assert!((1..=MAX_SPLITS).contains(&p.num_splits));
                    assert_eq!(p.tokens_per_split as usize % bs, 0);
                    assert!(p.num_splits as usize * p.tokens_per_split as usize >= ctx);
                    // No split is wholly past the context.
                    assert!(
                        ((p.num_splits - 1) as usize * (p.tokens_per_split as usize)) < ctx.max(1)
                    );
                }
            }
        }
    }

    #[test]
    fn forced_split_counts_cover_the_context() {
        for n in 1..=MAX_SPLITS {
            for ctx in [0, 1, 16, 100, 4096] {
                let p = split_plan_with(ctx, 16, n).unwrap();
                assert_eq!(p.num_splits, n);
                assert!(n as usize * p.tokens_per_split as usize >= ctx);
            }
        }
        assert!(split_plan_with(10, 16, 0).is_err());
        assert!(split_plan_with(10, 16, MAX_SPLITS + 1).is_err());
        assert!(split_plan_with(MAX_CONTEXT_TOKENS + 1, 16, 1).is_err());
    }
}
