//! Pure planning for `CudaStorage`'s virtual-memory arena and its batched swaps: which
//! physical chunks back a region, which of them a shrink releases, and which copies a
//! swap issues. No device here, so the rules are unit-tested on the CPU; the CUDA code
//! only carries the plans out.
//!
//! **Chunks.** Backing a 100+ GiB arena with chunks of the allocation granularity
//! (2 MiB) costs tens of thousands of `cuMemCreate`/`cuMemMap`/`cuMemSetAccess` calls.
//! A region is instead backed by chunks of power-of-two multiples of the granularity,
//! largest first, up to [`MAX_CHUNK_BYTES`]: a 1.25 GiB region is two chunks
//! (1 GiB + 256 MiB). Resizing still works at the granularity: growth appends the
//! binary decomposition of the new tail; a shrink releases whole chunks from the tail
//! and, where the last kept chunk straddles the new end, keeps it (its bytes past the
//! end stay mapped until a later shrink goes below its start: [`plan_shrink`] says
//! which). A region whose chunks are all one granule (`CudaStorageConfig::granule_chunks`,
//! what the memory broker requires) never straddles: a shrink to whole granules maps
//! exactly its target.
// Only the CUDA backend uses these; the unit tests run without it too.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// The largest physical chunk a region is backed with. 1 GiB keeps a 141 GiB H200
/// arena of 80 layers at 2 chunks per layer, while one chunk stays small next to the
/// memory a resize gives back.
pub(crate) const MAX_CHUNK_BYTES: usize = 1 << 30;

/// Chunk sizes, in mapping order, that back `[mapped, target)` of a region: each a
/// power-of-two multiple of `granularity` no larger than `max_chunk`, largest first
/// (the binary decomposition of the tail, in granules). Empty when `target <= mapped`.
///
/// `mapped` and `target` are multiples of `granularity` (callers round up); `target`
/// that is not is rounded up here.
pub(crate) fn plan_growth(
    mapped: usize,
    target: usize,
    granularity: usize,
    max_chunk: usize,
) -> Vec<usize> {
    let g = granularity.max(1);
    let target = target.div_ceil(g) * g;
    if target <= mapped {
        return Vec::new();
    }
    // The largest power-of-two multiple of the granularity not above max_chunk.
    let mut top = g;
    while top.checked_mul(2).is_some_and(|t| t <= max_chunk) {
        top *= 2;
    }
    let mut left = target - mapped;
    let mut out = Vec::new();
    out.extend(std::iter::repeat_n(top, left / top));
    left %= top;
    let mut size = top / 2;
    while left > 0 && size >= g {
        if left >= size {
            out.push(size);
            left -= size;
        }
        size /= 2;
    }
    out
}

/// What a shrink to `target` bytes does to a region backed by `chunks` (sizes, in
/// mapping order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShrinkPlan {
    /// Chunks kept from the start; those past it are unmapped and released whole.
    pub(crate) keep: usize,
    /// Bytes still mapped afterwards (at least `target`).
    pub(crate) mapped_after: usize,
}

/// Chunks to release so that a region of `chunks` backs at least `target` bytes: every
/// chunk that starts at or past `target` goes; a chunk straddling `target` stays.
pub(crate) fn plan_shrink(chunks: &[usize], target: usize) -> ShrinkPlan {
    let mut start = 0usize;
    for (i, &c) in chunks.iter().enumerate() {
        if start >= target {
            return ShrinkPlan {
                keep: i,
                mapped_after: start,
            };
        }
        start += c;
    }
    ShrinkPlan {
        keep: chunks.len(),
        mapped_after: start,
    }
}

/// One contiguous byte copy of a swap: offsets into a layer's device region and the
/// layer's host tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyRun {
    pub(crate) src_offset: usize,
    pub(crate) dst_offset: usize,
    pub(crate) bytes: usize,
}

/// The byte copies of one layer of a swap: `runs` are `(src, dst, len)` in blocks
/// (`SwapPlan::runs`), `bpl` the bytes of a block in one layer. `None` when a byte
/// count overflows (the plan was validated, so only absurd layouts get here).
pub(crate) fn layer_copy_runs(runs: &[(u32, u32, u32)], bpl: usize) -> Option<Vec<CopyRun>> {
    runs.iter()
        .map(|&(src, dst, len)| {
            Some(CopyRun {
                src_offset: (src as usize).checked_mul(bpl)?,
                dst_offset: (dst as usize).checked_mul(bpl)?,
                bytes: (len as usize).checked_mul(bpl)?,
            })
        })
        .collect()
}

/// How a layer's runs are issued. One run is one `cuMemcpyAsync`; several are one
/// `cuMemcpyBatchAsync` when the driver has it (CUDA 13.0's `_v2` entry point: the
/// symbol is looked up lazily and a missing one would abort, so the driver version is
/// checked first), else one call per run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IssueMode {
    /// Nothing to copy.
    Nothing,
    /// `cuMemcpyAsync` per run (`n` calls).
    PerRun(usize),
    /// One `cuMemcpyBatchAsync` of `n` copies.
    Batch(usize),
}

/// The first driver version (`cuDriverGetVersion`) with `cuMemcpyBatchAsync_v2`.
pub(crate) const BATCH_MIN_DRIVER: i32 = 13000;

pub(crate) fn issue_mode(runs: usize, driver_version: i32) -> IssueMode {
    match runs {
        0 => IssueMode::Nothing,
        1 => IssueMode::PerRun(1),
        n if driver_version >= BATCH_MIN_DRIVER => IssueMode::Batch(n),
        n => IssueMode::PerRun(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const GIB: usize = 1 << 30;

    fn check_plan(mapped: usize, target: usize, g: usize, max: usize) -> Vec<usize> {
        let plan = plan_growth(mapped, target, g, max);
        let sum: usize = plan.iter().sum();
        assert_eq!(
            mapped + sum,
            target.div_ceil(g) * g,
            "covers the tail exactly"
        );
        for w in plan.windows(2) {
            assert!(w[0] >= w[1], "largest first: {plan:?}");
        }
        for &c in &plan {
            assert!(c % g == 0 && c <= max.max(g) && (c / g).is_power_of_two());
        }
        plan
    }

    #[test]
    fn a_100_gib_arena_takes_a_few_hundred_chunks_not_fifty_thousand() {
        // 112 GiB over 80 layers: 1.4 GiB per layer (rounded to granules).
        let per_layer = (112 * GIB / 80).div_ceil(2 * MIB) * 2 * MIB;
        let plan = check_plan(0, per_layer, 2 * MIB, MAX_CHUNK_BYTES);
        let total = plan.len() * 80;
        assert!(plan.len() <= 10, "{plan:?}");
        assert!(total <= 800, "{total} chunks");
        // Granule-sized chunks would take 57360.
        assert_eq!(80 * per_layer / (2 * MIB), 57360);
        // A 1.25 GiB region is exactly two chunks.
        assert_eq!(
            check_plan(0, GIB + 256 * MIB, 2 * MIB, GIB),
            vec![GIB, 256 * MIB]
        );
    }

    #[test]
    fn regions_past_4_gib_and_growth_in_granules() {
        let plan = check_plan(0, 5 * GIB + 6 * MIB, 2 * MIB, GIB);
        assert_eq!(plan, [vec![GIB; 5], vec![4 * MIB, 2 * MIB]].concat());
        // Growing a mapped region by one granule maps one granule.
        assert_eq!(
            check_plan(5 * GIB, 5 * GIB + 2 * MIB, 2 * MIB, GIB),
            vec![2 * MIB]
        );
        // Unaligned targets round up; nothing to do when already mapped.
        assert_eq!(check_plan(0, 1, 2 * MIB, GIB), vec![2 * MIB]);
        assert!(plan_growth(4 * MIB, 4 * MIB, 2 * MIB, GIB).is_empty());
        assert!(plan_growth(4 * MIB, MIB, 2 * MIB, GIB).is_empty());
        // A cap below the granularity still maps granules; odd caps round down to a
        // power of two of granules.
        assert_eq!(check_plan(0, 6 * MIB, 2 * MIB, MIB), vec![2 * MIB; 3]);
        assert_eq!(check_plan(0, 12 * MIB, 2 * MIB, 6 * MIB), vec![4 * MIB; 3]);
        for (m, t) in [(0, 3 * GIB + 2 * MIB), (2 * MIB, 7 * MIB), (0, 0)] {
            check_plan(m, t, 2 * MIB, GIB);
        }
    }

    #[test]
    fn shrink_releases_whole_chunks_from_the_tail() {
        let chunks = [GIB, GIB, 256 * MIB, 2 * MIB];
        let whole = 2 * GIB + 258 * MIB;
        // To the start of a chunk: everything after it goes.
        assert_eq!(
            plan_shrink(&chunks, 2 * GIB),
            ShrinkPlan {
                keep: 2,
                mapped_after: 2 * GIB
            }
        );
        // Inside a chunk: the straddling chunk stays whole.
        assert_eq!(
            plan_shrink(&chunks, GIB + MIB),
            ShrinkPlan {
                keep: 2,
                mapped_after: 2 * GIB
            }
        );
        assert_eq!(plan_shrink(&chunks, whole).keep, 4);
        assert_eq!(plan_shrink(&chunks, 0).keep, 0);
        // Growth after a shrink appends to what is left.
        let after = plan_shrink(&chunks, GIB + MIB).mapped_after;
        assert_eq!(
            check_plan(after, whole, 2 * MIB, GIB),
            vec![256 * MIB, 2 * MIB]
        );
        // Granule-backed regions (the old layout) shrink to the granule.
        let granules = vec![2 * MIB; 8];
        assert_eq!(plan_shrink(&granules, 5 * MIB).mapped_after, 6 * MIB);
    }

    /// What `CudaStorageConfig::granule_chunks` buys the memory broker: with physical
    /// chunks of one granule, any sequence of grows and shrinks to whole granules
    /// leaves exactly the target mapped; with power-of-two chunks a shrink by one
    /// granule can keep a straddling chunk.
    #[test]
    fn granule_chunks_shrink_exactly_and_larger_chunks_can_straddle() {
        let g = 2 * MIB;
        let mut z = 0x2545_f491_4f6c_dd1du64;
        for (max_chunk, exact) in [(g, true), (GIB, false)] {
            let mut chunks: Vec<usize> = Vec::new();
            let mut straddled = false;
            for _ in 0..2000 {
                z ^= z << 13;
                z ^= z >> 7;
                z ^= z << 17;
                let target = (z % 40) as usize * g;
                let mapped: usize = chunks.iter().sum();
                if target >= mapped {
                    chunks.extend(plan_growth(mapped, target, g, max_chunk));
                } else {
                    let plan = plan_shrink(&chunks, target);
                    chunks.truncate(plan.keep);
                    assert_eq!(plan.mapped_after, chunks.iter().sum::<usize>());
                }
                let mapped: usize = chunks.iter().sum();
                assert!(mapped >= target);
                straddled |= mapped > target;
                if exact {
                    assert_eq!(mapped, target);
                    assert!(chunks.iter().all(|&c| c == g));
                }
            }
            assert_eq!(straddled, !exact);
        }
        // The smallest straddle: 3 granules are [2g, g]; a shrink to 1 keeps 2g.
        assert_eq!(plan_growth(0, 3 * g, g, GIB), vec![2 * g, g]);
        assert_eq!(plan_shrink(&[2 * g, g], g).mapped_after, 2 * g);
    }

    #[test]
    fn swap_runs_become_byte_copies_and_batches_need_a_13_0_driver() {
        let runs = [(0, 10, 3), (7, 2, 1)];
        let copies = layer_copy_runs(&runs, 4096).unwrap();
        assert_eq!(
            copies,
            vec![
                CopyRun {
                    src_offset: 0,
                    dst_offset: 40960,
                    bytes: 12288
                },
                CopyRun {
                    src_offset: 28672,
                    dst_offset: 8192,
                    bytes: 4096
                }
            ]
        );
        // Offsets past 4 GiB stay exact.
        let far = layer_copy_runs(&[(u32::MAX - 1, 0, 1)], 1 << 20).unwrap();
        assert_eq!(far[0].src_offset, (u32::MAX as usize - 1) << 20);
        assert!(layer_copy_runs(&[(u32::MAX, 0, 1)], usize::MAX / 2).is_none());
        assert_eq!(issue_mode(0, 13000), IssueMode::Nothing);
        assert_eq!(issue_mode(1, 13000), IssueMode::PerRun(1));
        assert_eq!(issue_mode(5, 13000), IssueMode::Batch(5));
        assert_eq!(issue_mode(5, 12080), IssueMode::PerRun(5));
    }
}
