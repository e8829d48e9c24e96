//! The one walk of token K/V bytes between a layer region and a contiguous
//! `[token][kv_head][head_dim]` buffer. Every backend's token writes and reads go
//! through [`for_each_token_run`], so the addressing is written once.
//!
//! In the HND layout of [`KvLayout`] one `(token, head)` vector of K or V is
//! `head_dim` contiguous elements in both the buffer and the region, and two heads of
//! a token are a page apart in the region: the vector is the longest contiguous run.

use std::ops::Range;

use crate::ids::BlockId;
use crate::layout::{Kv, KvLayout};

/// One contiguous run of a token copy: the same `head_dim` elements of K or V seen in
/// the contiguous buffer and in the layer region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenRun {
    /// Which buffer (`k` or `v`) and which half of the block.
    pub kv: Kv,
    /// Bytes in the contiguous `[token][kv_head][head_dim]` buffer.
    pub buf: Range<usize>,
    /// Bytes in the layer region addressed by [`KvLayout::elem_offset`].
    pub region: Range<usize>,
}

/// Calls `run` for every `(token, KV head, K/V)` vector of the tokens placed at
/// `places`, where item `t` is the `(block, offset in block)` of token `t` of the
/// buffer. Runs come in buffer order: token, then head, then K before V, so when two
/// tokens share a slot the later one is written last.
///
/// Nothing is checked here: callers validate block ids and buffer lengths
/// ([`super::check_token_io`]) before any byte moves, and the ranges then lie inside
/// the region and the buffers.
pub(crate) fn for_each_token_run(
    layout: &KvLayout,
    places: impl IntoIterator<Item = (BlockId, usize)>,
    mut run: impl FnMut(TokenRun),
) {
    let head_bytes = super::head_bytes(layout);
    let heads = layout.shape().num_kv_heads;
    let elem = layout.dtype().size_bytes();
    // A latent layout has one vector per token, carried in the `k` buffer.
    let halves: &[Kv] = if layout.is_latent() {
        &[Kv::K]
    } else {
        &[Kv::K, Kv::V]
    };
    for (t, (block, off)) in places.into_iter().enumerate() {
        for h in 0..heads {
            let buf = (t * heads + h) * head_bytes;
            for &kv in halves {
                let region = layout.elem_offset(block, kv, h, off) * elem;
                run(TokenRun {
                    kv,
                    buf: buf..buf + head_bytes,
                    region: region..region + head_bytes,
                });
            }
        }
    }
}

/// The places of the first `num_tokens` tokens of a block table: every offset of each
/// block in turn. Stops early when `blocks` runs out (callers check the table covers
/// the tokens first).
pub(crate) fn table_places(
    layout: &KvLayout,
    blocks: impl IntoIterator<Item = BlockId>,
    num_tokens: usize,
) -> impl Iterator<Item = (BlockId, usize)> {
    let block_size = layout.block_size();
    blocks
        .into_iter()
        .flat_map(move |b| (0..block_size).map(move |off| (b, off)))
        .take(num_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::shape::{DType, ModelShape};

    #[test]
    fn runs_cover_the_buffer_once_in_order() {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 4,
            num_kv_heads: 2,
            head_dim: 4,
            kv_dtype: DType::F16,
        };
        let layout = KvLayout::new(shape, 4).unwrap();
        let table = [BlockId(3), BlockId(1)];
        let places: Vec<_> = table_places(&layout, table, 6).collect();
        assert_eq!(places.len(), 6);
        assert_eq!(places[4], (BlockId(1), 0));
        let mut runs = Vec::new();
        for_each_token_run(&layout, places, |r| runs.push(r));
        // 6 tokens * 2 heads * (K, V), each 4 elements of 2 bytes.
        assert_eq!(runs.len(), 24);
        for (i, pair) in runs.chunks_exact(2).enumerate() {
            assert_eq!((pair[0].kv, pair[1].kv), (Kv::K, Kv::V));
            assert_eq!(pair[0].buf, i * 8..i * 8 + 8);
            assert_eq!(pair[0].buf, pair[1].buf);
        }
        // Token 5 (block 1, offset 1), head 1, V.
        let last = runs.last().unwrap();
        let want = layout.elem_offset(BlockId(1), Kv::V, 1, 1) * 2;
        assert_eq!(last.region, want..want + 8);
    }
}
