//! Checks that run on the host before every attention launch, and the planner that
//! splits long contexts across CTAs. Pure functions: usable and tested without a GPU.
//!
//! The kernels trust these checks for memory safety: a table entry the kernel reads
//! must name a block inside the arena, and each row must cover its context length.

use super::AttentionParams;
use crate::error::{Error, Result};
use crate::layout::KvLayout;
use crate::tables::{PaddedTables, MAX_CONTEXT_TOKENS};

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
    let start = |ctx: usize| live_range(ctx as u32, sliding_window).0 as usize;
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
        if best.is_none_or(|(c, _)| cost < c) {
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

/// Words of a step's staging buffer before its context lengths: `[batch,
/// tokens_per_split, num_splits, 0]`, read by the kernels of a fixed-grid launch.
pub const STEP_HEADER_WORDS: usize = 4;

/// Fixed capacities of a capturable decode step (`DecodeGraphStep` on the GPU): its
/// grid and every buffer are sized from these once, so a step never allocates and its
/// launches do not depend on the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCapacity {
    /// Most sequences of a step (the grid's y dimension).
    pub max_batch: usize,
    /// Most block-table entries one sequence may need (`ceil(context / block_size)`):
    /// the row stride of the staged tables.
    pub max_blocks_per_seq: usize,
    /// Most splits of one sequence (the grid's z dimension), `1..=MAX_SPLITS`.
    pub max_splits: u32,
}

impl StepCapacity {
    /// Checks the capacities: a batch of `1..=65535` (the grid's y limit), at least
    /// one block per sequence (whose tokens fit `u32`), splits in `1..=MAX_SPLITS`, and a staging buffer whose size fits
    /// `u32` offsets.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the capacity.
    pub fn validate(&self, block_size: usize) -> Result<()> {
        if !(1..=65535).contains(&self.max_batch) {
            return Err(Error::config(
                "max_batch",
                format!("{}; must be in 1..=65535", self.max_batch),
            ));
        }
        let max_tokens = self.max_blocks_per_seq.checked_mul(block_size.max(1));
        if self.max_blocks_per_seq == 0 || max_tokens.is_none_or(|t| t > u32::MAX as usize) {
            return Err(Error::config(
                "max_blocks_per_seq",
                format!(
                    "{}; must be at least 1, its tokens within u32",
                    self.max_blocks_per_seq
                ),
            ));
        }
        if !(1..=MAX_SPLITS).contains(&self.max_splits) {
            return Err(Error::config(
                "max_splits",
                format!("{}; must be in 1..={MAX_SPLITS}", self.max_splits),
            ));
        }
        if self
            .staging_words_checked()
            .is_none_or(|w| w > u32::MAX as usize)
        {
            return Err(Error::config(
                "max_batch * max_blocks_per_seq",
                "the staged tables must fit u32 offsets".to_string(),
            ));
        }
        Ok(())
    }

    fn staging_words_checked(&self) -> Option<usize> {
        self.max_batch
            .checked_mul(self.max_blocks_per_seq)?
            .checked_add(self.max_batch)?
            .checked_add(STEP_HEADER_WORDS)
    }

    /// `u32` words of the staging buffer: the header ([`STEP_HEADER_WORDS`]), then
    /// `max_batch` context lengths, then `max_batch` rows of `max_blocks_per_seq`
    /// block ids. Saturates for capacities [`Self::validate`] refuses.
    pub fn staging_words(&self) -> usize {
        self.staging_words_checked().unwrap_or(usize::MAX)
    }
}

/// What [`stage_decode_step`] wrote: the host's record of a staged step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedStep {
    /// Sequences of the step.
    pub batch: usize,
    /// Longest context of the step.
    pub max_context: usize,
    /// The split cut the kernels will read from the staged header.
    pub plan: SplitPlan,
    /// One past the largest block id anywhere in the staged tables (at least 1): the
    /// arena must still hold this many blocks when the step runs.
    pub blocks_needed: usize,
}

/// The host half of a capturable decode step, pure and allocation-free: validates
/// `tables` against the arena (`num_blocks` blocks, the window's holes allowed as in
/// [`crate::tables::validate_tables_window`]) and against `cap`, plans the splits
/// ([`plan_splits_for_occupancy`], capped at `cap.max_splits`), and writes the whole
/// staging buffer (layout in [`StepCapacity::staging_words`]): lengths and rows past
/// the batch, and entries past each row's blocks, are 0, and a window's released
/// holes are written as block 0, so every word a kernel could read, even from a mix of
/// two steps' words, names a block below `blocks_needed` and a context that fits its
/// row.
///
/// # Errors
/// The validation errors of [`crate::tables::validate_tables_window`];
/// [`Error::ShapeMismatch`] for a batch over `cap.max_batch`, a sequence needing more
/// than `cap.max_blocks_per_seq` blocks, or a `staging` slice of the wrong length;
/// [`Error::InvalidConfig`] for capacities [`StepCapacity::validate`] refuses. On
/// error `staging` is unchanged.
#[allow(clippy::too_many_arguments)]
pub fn stage_decode_step(
    layout: &KvLayout,
    num_blocks: usize,
    cap: &StepCapacity,
    tables: &PaddedTables,
    sliding_window: Option<usize>,
    num_sms: usize,
    ctas_per_sm: usize,
    staging: &mut [u32],
) -> Result<StagedStep> {
    let bs = layout.block_size();
    cap.validate(bs)?;
    if staging.len() != cap.staging_words() {
        return Err(Error::ShapeMismatch {
            what: "staging words (StepCapacity::staging_words)",
            expected: cap.staging_words(),
            got: staging.len(),
        });
    }
    let max_context =
        crate::tables::validate_tables_window(layout, num_blocks, tables, sliding_window, None)?;
    if tables.batch > cap.max_batch {
        return Err(Error::ShapeMismatch {
            what: "sequences of a decode step (StepCapacity::max_batch)",
            expected: cap.max_batch,
            got: tables.batch,
        });
    }
    let needed = |len: u32| (len as usize).div_ceil(bs);
    if let Some(&len) = tables
        .context_lens
        .iter()
        .find(|&&len| needed(len) > cap.max_blocks_per_seq)
    {
        return Err(Error::ShapeMismatch {
            what: "blocks of one sequence (StepCapacity::max_blocks_per_seq)",
            expected: cap.max_blocks_per_seq,
            got: needed(len),
        });
    }
    let mut plan = plan_splits_for_occupancy(
        &tables.context_lens,
        sliding_window,
        layout.shape().num_kv_heads,
        bs,
        num_sms,
        ctas_per_sm,
    );
    if plan.num_splits > cap.max_splits {
        plan = split_plan_with(max_context, bs, cap.max_splits)?;
    }
    // Everything is checked: from here on the buffer is written whole.
    let (header, rest) = staging.split_at_mut(STEP_HEADER_WORDS);
    let (lens, ids) = rest.split_at_mut(cap.max_batch);
    header.copy_from_slice(&[
        tables.batch as u32,
        plan.tokens_per_split,
        plan.num_splits,
        0,
    ]);
    lens[..tables.batch].copy_from_slice(&tables.context_lens);
    lens[tables.batch..].fill(0);
    let mut largest = 0u32;
    for (i, row) in ids.chunks_exact_mut(cap.max_blocks_per_seq).enumerate() {
        let n = tables.context_lens.get(i).map_or(0, |&l| needed(l));
        let src: &[u32] = if i < tables.batch {
            &tables.tables[i * tables.max_blocks..][..n]
        } else {
            &[]
        };
        for (d, &id) in row[..n].iter_mut().zip(src) {
            // Validation let through only ids inside the arena and the window's holes.
            *d = if (id as usize) < num_blocks { id } else { 0 };
            largest = largest.max(*d);
        }
        row[n..].fill(0);
    }
    Ok(StagedStep {
        batch: tables.batch,
        max_context,
        plan,
        blocks_needed: largest as usize + 1,
    })
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

/// Words of one [`WorkItem`] in the device array the work-list kernel reads.
pub const WORK_ITEM_WORDS: usize = 4;

/// One CTA's work in a work-list launch (per KV head): tokens `[begin, end)` of
/// sequence `seq`, its `chunk`-th piece of `chunks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkItem {
    /// The sequence (row of the batch).
    pub seq: u32,
    /// Index of this chunk among the sequence's chunks, in token order.
    pub chunk: u32,
    /// First token, inside the sequence's live range (the window's first token or 0).
    pub begin: u32,
    /// One past the last token.
    pub end: u32,
}

/// A decode launch's work list: every sequence cut into chunks of its own live range
/// (the sliding window's tokens, not the batch maximum), one item per (sequence,
/// chunk), in sequence then chunk order. A sequence's partials live at rows
/// `first[seq] + chunk`; the last CTA of a (sequence, KV head) to finish merges them
/// in chunk order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkList {
    /// The items, sequence by sequence, chunks in token order.
    pub items: Vec<WorkItem>,
    /// Index in `items` of each sequence's first chunk.
    pub first: Vec<u32>,
    /// Chunks of each sequence (at least 1: an empty context still writes its output).
    pub chunks: Vec<u32>,
    /// The chunk length the cut aims at (the occupancy planner's split length).
    pub target_tokens: u32,
}

impl WorkList {
    /// The device encoding the kernel's `read_work` takes: a header
    /// `[items, 0, 0, 0]`, then [`WORK_ITEM_WORDS`] words per item,
    /// `[seq, chunk | chunks << 16, begin, end]` (`chunks` being the sequence's chunk
    /// count, at most [`MAX_SPLITS`]); the sequence's first item is the item's index
    /// minus `chunk`. A fixed-capacity grid's CTAs past `items` return.
    pub fn device_words(&self) -> Vec<u32> {
        let header = [self.items.len() as u32, 0, 0, 0];
        header
            .into_iter()
            .chain(self.items.iter().flat_map(|w| {
                let n = self.chunks.get(w.seq as usize).copied().unwrap_or(0);
                [w.seq, w.chunk | n << 16, w.begin, w.end]
            }))
            .collect()
    }
}

/// Device buffer lengths (in elements) a work-list launch needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkBuffers {
    /// `u32` words of [`WorkList::device_words`].
    pub words: usize,
    /// `u32` arrival counters, one per (sequence, KV head).
    pub counters: usize,
    /// f32 partial outputs, `items x q_heads x head_dim`.
    pub part_out: usize,
    /// f32 partial log-sum-exps, `items x q_heads`.
    pub part_lse: usize,
}

impl WorkList {
    /// The buffer lengths its launch needs for `num_kv_heads` KV heads, `q_heads`
    /// query heads of `head_dim`: the counters cover every sequence of the batch
    /// (the kernel indexes them `seq * KV heads + head`).
    pub fn buffers(&self, num_kv_heads: usize, q_heads: usize, head_dim: usize) -> WorkBuffers {
        let items = self.items.len();
        WorkBuffers {
            words: (items + 1) * WORK_ITEM_WORDS,
            counters: self.chunks.len() * num_kv_heads,
            part_out: items * q_heads * head_dim,
            part_lse: items * q_heads,
        }
    }
}

/// The live range of a context of `ctx` tokens: `[ctx - window, ctx)` under a
/// sliding window shorter than the context, else `[0, ctx)`.
pub fn live_range(ctx: u32, sliding_window: Option<usize>) -> (u32, u32) {
    match sliding_window {
        Some(w) if w > 0 && (ctx as usize) > w => (ctx - w as u32, ctx),
        _ => (0, ctx),
    }
}

/// Builds the work list of a decode launch from each sequence's own length: the chunk
/// length is the one [`plan_splits_for_occupancy`] picks for the batch (balanced to
/// the occupancy the driver reports); each sequence's live range ([`live_range`]) is
/// cut into `ceil(live / target)` chunks of equal length rounded up to whole blocks
/// (boundaries on block multiples, so no page is read by two CTAs' copies more than
/// needed), at most [`MAX_SPLITS`] per sequence. A sequence with no live token gets
/// one empty chunk, so its output row is still written.
///
/// # Errors
/// [`Error::InvalidConfig`] when the list would hold more than `max_items` items (a
/// fixed-capacity launch's grid) or a context exceeds [`MAX_CONTEXT_TOKENS`].
#[allow(clippy::too_many_arguments)]
pub fn build_work_list(
    context_lens: &[u32],
    sliding_window: Option<usize>,
    num_kv_heads: usize,
    block_size: usize,
    num_sms: usize,
    ctas_per_sm: usize,
    max_items: usize,
) -> Result<WorkList> {
    let plan = plan_splits_for_occupancy(
        context_lens,
        sliding_window,
        num_kv_heads,
        block_size,
        num_sms,
        ctas_per_sm,
    );
    cut_work_list(
        context_lens,
        sliding_window,
        block_size,
        plan.tokens_per_split,
        max_items,
    )
}

/// [`build_work_list`] with the chunk length given (`target_tokens`, raised to one
/// block): a forced split plan's length ([`split_plan_with`]) or the occupancy
/// planner's.
///
/// # Errors
/// As [`build_work_list`].
pub fn cut_work_list(
    context_lens: &[u32],
    sliding_window: Option<usize>,
    block_size: usize,
    target_tokens: u32,
    max_items: usize,
) -> Result<WorkList> {
    if let Some(&c) = context_lens
        .iter()
        .find(|&&c| c as usize > MAX_CONTEXT_TOKENS)
    {
        return Err(Error::TooLong {
            tokens: c as usize,
            limit: MAX_CONTEXT_TOKENS,
        });
    }
    let bs = block_size.max(1) as u32;
    let target = target_tokens.max(bs);
    let mut items = Vec::new();
    let mut first = Vec::with_capacity(context_lens.len());
    let mut chunks = Vec::with_capacity(context_lens.len());
    for (seq, &ctx) in context_lens.iter().enumerate() {
        let (start, end) = live_range(ctx, sliding_window);
        // Cut from the block boundary at or before `start`, so every chunk boundary
        // but the first and last sits on a block edge.
        let base = start / bs * bs;
        let span = end - base;
        let n = span.div_ceil(target).clamp(1, MAX_SPLITS);
        let size = span.div_ceil(n).max(1).next_multiple_of(bs);
        let used = span.div_ceil(size).max(1);
        first.push(items.len() as u32);
        chunks.push(used);
        for k in 0..used {
            items.push(WorkItem {
                seq: seq as u32,
                chunk: k,
                begin: (base + k * size).max(start).min(end),
                end: (base + (k + 1) * size).min(end),
            });
        }
    }
    if items.len() > max_items {
        return Err(Error::config(
            "work list",
            format!(
                "{} (sequence, chunk) items; the launch holds at most {max_items}",
                items.len()
            ),
        ));
    }
    Ok(WorkList {
        items,
        first,
        chunks,
        target_tokens: target,
    })
}
#[cfg(test)]
mod occupancy_tests {
    use super::*;

    /// A launch's buffer sizes follow its list: counters per (sequence, KV head),
    /// partials per (item, query head); a forced target cuts as many chunks as asked.
    #[test]
    fn work_buffers_are_sized_from_the_list() {
        let lens = [1u32, 17, 4096, 0];
        let wl = cut_work_list(&lens, None, 16, 1024, 64).unwrap();
        assert_eq!(wl.chunks, vec![1, 1, 4, 1]);
        let b = wl.buffers(8, 64, 128);
        assert_eq!(b.words, (7 + 1) * WORK_ITEM_WORDS);
        assert_eq!(b.words, wl.device_words().len());
        assert_eq!(b.counters, 4 * 8);
        assert_eq!((b.part_out, b.part_lse), (7 * 64 * 128, 7 * 64));
        assert!(cut_work_list(&lens, None, 16, 1024, 6).is_err());
    }

    /// The work list's invariants for one batch: each (sequence, chunk) once, in
    /// order; each sequence's chunks tile its live range with no gap or overlap,
    /// interior boundaries on block edges; no chunk over the target length.
    fn check_work_list(wl: &WorkList, lens: &[u32], window: Option<usize>, bs: u32) {
        assert_eq!(wl.first.len(), lens.len());
        assert_eq!(wl.chunks.len(), lens.len());
        let mut seen = std::collections::HashSet::new();
        for w in &wl.items {
            assert!(seen.insert((w.seq, w.chunk)), "{w:?} twice");
        }
        assert_eq!(
            wl.items.len() as u32,
            wl.chunks.iter().sum::<u32>(),
            "items vs chunk counts"
        );
        for (s, &ctx) in lens.iter().enumerate() {
            let (start, end) = live_range(ctx, window);
            let (f, n) = (wl.first[s] as usize, wl.chunks[s] as usize);
            assert!((1..=MAX_SPLITS as usize).contains(&n));
            let mine = &wl.items[f..f + n];
            let mut at = start;
            for (k, w) in mine.iter().enumerate() {
                assert_eq!((w.seq, w.chunk), (s as u32, k as u32));
                assert_eq!(w.begin, at, "seq {s} chunk {k}: gap or overlap");
                assert!(w.end >= w.begin);
                assert!(w.end - w.begin <= wl.target_tokens, "{w:?} over the target");
                if k + 1 < n {
                    assert!(w.end > w.begin, "empty chunk inside seq {s}");
                    assert_eq!(w.end % bs, 0, "interior boundary off a block edge");
                }
                at = w.end;
            }
            assert_eq!(at, end, "seq {s}: live range not covered");
        }
    }

    #[test]
    fn the_work_list_tiles_each_sequence_once_from_its_own_length() {
        // Uneven lengths: the short ones get one chunk each, not the maximum's count.
        let lens = [1u32, 17, 4096, 0, 300];
        for window in [None, Some(100), Some(4000), Some(1)] {
            for bs in [8u32, 16, 32] {
                let wl = build_work_list(&lens, window, 8, bs as usize, 132, 3, 1 << 20).unwrap();
                check_work_list(&wl, &lens, window, bs);
                assert_eq!(wl.chunks[0], 1);
                assert_eq!(wl.chunks[3], 1, "an empty context still has its item");
            }
        }
        // Alone on the GPU, 4096 tokens are split; 17 tokens never are.
        let wl = build_work_list(&lens, None, 8, 16, 132, 3, 1 << 20).unwrap();
        assert!(wl.chunks[2] > 1, "{:?}", wl.chunks);
        assert_eq!(wl.chunks[1], 1);
        // A window shorter than the target leaves one chunk for the long sequence.
        let wl = build_work_list(&lens, Some(100), 8, 16, 132, 3, 1 << 20).unwrap();
        assert_eq!(wl.chunks[2], 1);
        assert_eq!(
            (
                wl.items[wl.first[2] as usize].begin,
                wl.items[wl.first[2] as usize].end
            ),
            (3996, 4096)
        );
        // Random batches.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for _ in 0..300 {
            let batch = 1 + next(40) as usize;
            let lens: Vec<u32> = (0..batch).map(|_| next(20_000) as u32).collect();
            let window = [None, Some(1 + next(5000) as usize)][next(2) as usize];
            let bs = [1u32, 8, 16, 32, 256][next(5) as usize];
            let sms = 1 + next(140) as usize;
            let wl = build_work_list(
                &lens,
                window,
                1 + next(8) as usize,
                bs as usize,
                sms,
                1 + next(4) as usize,
                1 << 20,
            )
            .unwrap();
            check_work_list(&wl, &lens, window, bs);
        }
    }

    #[test]
    fn the_work_list_keeps_the_planners_balance_at_the_bench_shape() {
        // 64 x 4096 on 132 SMs at 3 CTAs per SM: the occupancy planner's 3 splits
        // of 1,376 tokens, now per sequence (1376, 1376, 1344).
        let lens = vec![4096u32; 64];
        let wl = build_work_list(&lens, None, 8, 16, 132, 3, 1 << 20).unwrap();
        assert_eq!(wl.target_tokens, 1376);
        assert_eq!(wl.items.len(), 64 * 3);
        let sizes: Vec<u32> = wl.items[..3].iter().map(|w| w.end - w.begin).collect();
        assert_eq!(sizes, [1376, 1376, 1344]);
        let words = wl.device_words();
        assert_eq!(words.len(), (64 * 3 + 1) * WORK_ITEM_WORDS);
        assert_eq!(&words[..4], &[192, 0, 0, 0]);
        assert_eq!(&words[8..12], &[0, 1 | 3 << 16, 1376, 2752]);
        // One long sequence among short ones: the short ones cost one item each,
        // the fixed grid would have given them the long one's split count.
        let mut lens = vec![100u32; 20];
        lens.push(32_768);
        let wl = build_work_list(&lens, None, 8, 16, 132, 3, 1 << 20).unwrap();
        let plan = plan_splits_for_occupancy(&lens, None, 8, 16, 132, 3);
        assert_eq!(wl.items.len() as u32, 20 + wl.chunks[20]);
        assert!(wl.chunks[20] >= plan.num_splits.min(MAX_SPLITS) - 1);
        assert!(wl.items.len() < lens.len() * plan.num_splits as usize);
    }

    #[test]
    fn a_work_list_over_its_capacity_is_refused() {
        let lens = vec![4096u32; 64];
        let e = build_work_list(&lens, None, 8, 16, 132, 3, 191).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
        assert!(build_work_list(&lens, None, 8, 16, 132, 3, 192).is_ok());
        let e = build_work_list(&[u32::MAX], None, 8, 16, 132, 3, 1 << 20).unwrap_err();
        assert!(matches!(e, Error::TooLong { .. }), "{e:?}");
    }
    #[test]
    fn resident_ctas_is_sms_times_occupancy() {
        assert_eq!(resident_ctas(132, 3), 396);
        assert_eq!(resident_ctas(0, 0), 1);
        assert_eq!(resident_ctas(108, 2), 216);
    }

    #[test]
    fn wave_quantisation_is_avoided() {
        // The work-list case: 64 x 4096 tokens, 8 KV heads, 132 SMs at 3 CTAs per SM. One
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

    fn step_layout() -> KvLayout {
        use crate::layout::shape::{DType, ModelShape};
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 8,
            num_kv_heads: 2,
            head_dim: 64,
            kv_dtype: DType::BF16,
        };
        KvLayout::new(shape, 16).unwrap()
    }

    #[test]
    fn a_staged_step_is_written_whole_in_its_fixed_layout() {
        let l = step_layout();
        let cap = StepCapacity {
            max_batch: 3,
            max_blocks_per_seq: 4,
            max_splits: 2,
        };
        assert_eq!(cap.staging_words(), 4 + 3 + 12);
        let mut staging = vec![0xdead_beefu32; cap.staging_words()];
        // Two sequences: 17 tokens in blocks 5, 9 (the padding entry 7777 is never
        // read and must not be staged), and 0 tokens.
        let t = PaddedTables {
            tables: vec![5, 9, 7777, 1, 2, 3],
            context_lens: vec![17, 0],
            batch: 2,
            max_blocks: 3,
        };
        let st = stage_decode_step(&l, 10, &cap, &t, None, 132, 3, &mut staging).unwrap();
        assert_eq!(st.batch, 2);
        assert_eq!(st.max_context, 17);
        assert_eq!(st.blocks_needed, 10);
        assert_eq!(st.plan.num_splits, 1);
        assert_eq!(
            staging,
            [
                2,
                st.plan.tokens_per_split,
                1,
                0, // header
                17,
                0,
                0, // lengths, the third row past the batch
                5,
                9,
                0,
                0, // row 0: its two blocks
                0,
                0,
                0,
                0, // row 1: empty
                0,
                0,
                0,
                0, // row 2: past the batch
            ]
        );
        // A window's released hole before the window is staged as block 0.
        let hole = crate::ids::BlockId::RELEASED.0;
        let t = PaddedTables {
            tables: vec![hole, hole, 4, 6],
            context_lens: vec![60],
            batch: 1,
            max_blocks: 4,
        };
        let st = stage_decode_step(&l, 10, &cap, &t, Some(16), 132, 3, &mut staging).unwrap();
        assert_eq!(&staging[7..11], &[0, 0, 4, 6]);
        assert_eq!(st.blocks_needed, 7);
    }

    #[test]
    fn a_step_over_its_capacities_is_refused_and_changes_nothing() {
        let l = step_layout();
        let cap = StepCapacity {
            max_batch: 2,
            max_blocks_per_seq: 2,
            max_splits: 3,
        };
        let mut staging = vec![7u32; cap.staging_words()];
        let before = staging.clone();
        let three = PaddedTables {
            tables: vec![1, 2, 3],
            context_lens: vec![1, 1, 1],
            batch: 3,
            max_blocks: 1,
        };
        let long = PaddedTables {
            tables: vec![1, 2, 3],
            context_lens: vec![33],
            batch: 1,
            max_blocks: 3,
        };
        let bad_id = PaddedTables {
            tables: vec![10],
            context_lens: vec![1],
            batch: 1,
            max_blocks: 1,
        };
        for (t, n) in [(&three, 10), (&long, 10), (&bad_id, 10)] {
            let r = stage_decode_step(&l, n, &cap, t, None, 132, 3, &mut staging);
            assert!(r.is_err(), "{t:?}");
            assert_eq!(staging, before);
        }
        let ok = PaddedTables {
            tables: vec![1],
            context_lens: vec![1],
            batch: 1,
            max_blocks: 1,
        };
        assert!(matches!(
            stage_decode_step(&l, 10, &cap, &ok, None, 132, 3, &mut staging[1..]),
            Err(Error::ShapeMismatch { .. })
        ));
        for bad in [
            StepCapacity {
                max_batch: 0,
                ..cap
            },
            StepCapacity {
                max_batch: 65536,
                ..cap
            },
            StepCapacity {
                max_blocks_per_seq: 0,
                ..cap
            },
            StepCapacity {
                max_splits: 0,
                ..cap
            },
            StepCapacity {
                max_splits: MAX_SPLITS + 1,
                ..cap
            },
        ] {
            let mut s = vec![0u32; 64];
            assert!(matches!(
                stage_decode_step(&l, 10, &bad, &ok, None, 132, 3, &mut s),
                Err(Error::InvalidConfig { .. })
            ));
        }
        assert_eq!(staging, before);
    }

    #[test]
    fn the_staged_split_count_never_exceeds_the_grid() {
        // One 32k sequence wants ~33 splits on 132 SMs; a grid of 4 gets exactly 4,
        // which still cover the context.
        let l = step_layout();
        let cap = StepCapacity {
            max_batch: 1,
            max_blocks_per_seq: 2048,
            max_splits: 4,
        };
        let mut staging = vec![0u32; cap.staging_words()];
        let t = PaddedTables {
            tables: (0..2048).collect(),
            context_lens: vec![32768],
            batch: 1,
            max_blocks: 2048,
        };
        let free = plan_splits_for_occupancy(&[32768], None, 2, 16, 132, 3);
        assert!(free.num_splits > 4);
        let st = stage_decode_step(&l, 2048, &cap, &t, None, 132, 3, &mut staging).unwrap();
        assert_eq!(st.plan.num_splits, 4);
        assert!(4 * st.plan.tokens_per_split as usize >= 32768);
        assert_eq!(&staging[..3], &[1, st.plan.tokens_per_split, 4]);
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
