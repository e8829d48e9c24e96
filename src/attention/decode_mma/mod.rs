//! The tensor-core decode path of `kernels/paged_attention.cu` (`DECODE_MMA`), seen
//! from the host: which specialisations take it, how much dynamic shared memory a
//! launch needs, and (feature `testing`) a CPU replay of the kernel lane by lane.
//!
//! No GPU has run this kernel. The replay is the proof of its indexing that can be had
//! without one: it builds every lane's registers from the bytes the kernel's lanes
//! copy and read (the cp.async chunk map and its swizzle, the permuted head dims of
//! the K operand, the eighths of the V rows, the `prmt` byte interleave of fp8 V),
//! multiplies them with the `mma.sync.m16n8k16` fragment layouts of the PTX ISA
//! (A: `a0,a1` row `g` cols `2j, 2j+1`, `a2,a3` row `g+8`, `a4..a7` cols `+8`; B:
//! `b0,b1` rows `2j, 2j+1` col `g`, `b2,b3` rows `+8`; C: `c0,c1` row `g` cols `2j, 2j+1`,
//! `c2,c3` row `g+8`; `g = lane / 4`, `j = lane % 4`), and runs the per-tile softmax,
//! the warp merge and the split merge in the kernel's order. A wrong fragment, chunk or
//! dim map gives a wrong answer here, which the tests compare with the `f64` reference.
//!
//! What only a GPU can confirm: that the hardware's fragment layouts are the ones the
//! PTX ISA documents (the replay assumes them), that `cvt.rn.f16x2.e4m3x2` puts the low
//! byte in the low half, and everything about timing (the pipeline's `wait_group`
//! depth, bank conflicts).

use crate::layout::shape::DType;

// The replay is tooling for the crate's own tests (feature `testing`); the launch
// geometry above is what the CUDA launcher needs.
#[cfg(feature = "testing")]
mod replay;
#[cfg(feature = "testing")]
pub use replay::{
    check_against_reference, mma_rounded_queries, mma_unit_roundoff, replay_decode_mma,
    replay_decode_work_list, WorkListReplay,
};

/// Tokens per tile (one MMA k of the P V product, two n-tiles of the scores).
pub const MMA_TILE: usize = 16;

/// Warps per CTA (`NUM_THREADS / 32` with the crate's 128 threads).
pub const MMA_WARPS: usize = 4;

/// Whether a specialisation compiles the tensor-core path; mirrors the kernel's
/// `DECODE_MMA` default.
///
/// Pages smaller than a tile must still hold a multiple of 32 of its 16-byte chunks
/// (`PKV_PAGE_TILE_CHUNKS % 32 == 0`): the kernel's cp.async copy takes each copy's
/// page as a compile-time index, right only when the 32 lanes of one copy stay in one
/// page. So bf16/f16 d32 pages 1-4, d64 pages 1-2, d128 page 1 and fp8 d64 pages 1-4,
/// d128 pages 1-2, d256 page 1 keep the simple path; the kernel `static_assert`s the
/// same condition on its tensor-core path, and `tests/kernels/compile.rs` checks that
/// the PTX of a specialisation holds `mma.sync` exactly when this says so.
pub fn uses_mma(dtype: DType, gqa_group: usize, head_dim: usize, block_size: usize) -> bool {
    let row_bytes = head_dim * dtype.size_bytes();
    dtype != DType::F32
        && (3..=16).contains(&gqa_group)
        && head_dim.is_multiple_of(16)
        && head_dim <= 256
        && row_bytes >= 64
        && row_bytes.is_power_of_two()
        && block_size > 0
        && (block_size.is_multiple_of(MMA_TILE) || MMA_TILE.is_multiple_of(block_size))
        && page_tile_chunks(row_bytes, block_size).is_multiple_of(32)
}

/// 16-byte chunks of one page inside one tile (`PKV_PAGE_TILE_CHUNKS`): the page's
/// rows in the tile (`min(block_size, MMA_TILE)`) times the chunks of a row.
fn page_tile_chunks(row_bytes: usize, block_size: usize) -> usize {
    block_size.min(MMA_TILE) * row_bytes / 16
}

/// Pipeline stages of the tensor-core path: 3 when they fit in 64 KiB per CTA, else 2
/// (the kernel's `MMA_STAGES` default).
pub fn mma_stages(dtype: DType, head_dim: usize) -> usize {
    let stage = 2 * MMA_TILE * head_dim * dtype.size_bytes();
    if 3 * stage * MMA_WARPS <= 64 * 1024 {
        3
    } else {
        2
    }
}

/// Dynamic shared memory a launch of `paged_attention_decode` needs, in bytes: the
/// pipeline's stages, or the warp merge's rows when larger; 0 for the simple path.
pub fn decode_dynamic_shared_bytes(
    dtype: DType,
    gqa_group: usize,
    head_dim: usize,
    block_size: usize,
) -> usize {
    if !uses_mma(dtype, gqa_group, head_dim, block_size) {
        return 0;
    }
    let pipeline =
        MMA_WARPS * mma_stages(dtype, head_dim) * 2 * MMA_TILE * head_dim * dtype.size_bytes();
    let merge = MMA_WARPS * 16 * (2 + head_dim) * 4;
    pipeline.max(merge)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_is_chosen_like_the_kernel() {
        assert!(
            !uses_mma(DType::BF16, 1, 128, 16),
            "GQA 1 keeps the simple path"
        );
        assert!(
            !uses_mma(DType::BF16, 2, 128, 16),
            "GQA 2 keeps the simple path"
        );
        assert!(!uses_mma(DType::F32, 8, 128, 16));
        assert!(!uses_mma(DType::BF16, 32, 128, 16));
        assert!(!uses_mma(DType::Fp8E4M3, 8, 32, 16), "32-byte rows");
        assert!(
            !uses_mma(DType::BF16, 8, 128, 24),
            "pages that do not nest with tiles"
        );
        assert!(!uses_mma(DType::BF16, 8, 96, 16), "192-byte rows");
        assert!(!uses_mma(DType::BF16, 8, 512, 16), "head dims over 256");
        for g in [3, 4, 5, 8, 16] {
            for bs in [8, 16, 32] {
                assert!(uses_mma(DType::BF16, g, 128, bs));
                assert!(uses_mma(DType::Fp8E4M3, g, 64, bs));
            }
        }
        // Pages under a tile: the smallest that holds 32 of a tile's chunks (512 bytes
        // of rows) takes the tensor cores, the next smaller one keeps the simple path,
        // because the kernel's copy could not name its page at compile time.
        for (dtype, d, smallest) in [
            (DType::BF16, 32, 8),
            (DType::F16, 64, 4),
            (DType::BF16, 128, 2),
            (DType::F16, 256, 1),
            (DType::Fp8E4M3, 64, 8),
            (DType::Fp8E4M3, 128, 4),
            (DType::Fp8E4M3, 256, 2),
        ] {
            for bs in [1, 2, 4, 8, 16] {
                assert_eq!(
                    uses_mma(dtype, 8, d, bs),
                    bs >= smallest,
                    "{dtype} d{d} page {bs}"
                );
            }
        }
        // bf16 d128: 2 stages of K+V per warp (64 KiB); fp8 d128: 3 stages (48 KiB).
        assert_eq!(
            decode_dynamic_shared_bytes(DType::BF16, 8, 128, 16),
            64 * 1024
        );
        assert_eq!(
            decode_dynamic_shared_bytes(DType::Fp8E4M3, 8, 128, 16),
            48 * 1024
        );
        // fp8 d64: 3 stages of 4 KiB per warp.
        assert_eq!(
            decode_dynamic_shared_bytes(DType::Fp8E4M3, 8, 64, 16),
            24 * 1024
        );
        assert_eq!(decode_dynamic_shared_bytes(DType::BF16, 1, 128, 16), 0);
    }
}
