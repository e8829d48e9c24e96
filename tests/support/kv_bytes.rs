//! K/V byte patterns for tests that check data byte for byte: every token carries a
//! `u32` value, and its K and V bytes in each layer are a hash of (value, layer, K or
//! V, byte), so a misplaced block, layer, token or half shows. Works with any storage
//! and any layout (a latent layout has no V).

#![allow(dead_code)] // each test binary uses its own part

use pagedkv::layout::Slot;
use pagedkv::{BlockId, KvLayout, Storage};

/// Bytes of one token's K (or V) in one layer.
pub fn row_bytes(l: &KvLayout) -> usize {
    l.shape().num_kv_heads * l.shape().head_dim * l.dtype().size_bytes()
}

/// K (`kind` 0) or V (`kind` 1) bytes of tokens with `values` in `layer`.
pub fn kv_pattern(l: &KvLayout, layer: usize, kind: u64, values: &[u32]) -> Vec<u8> {
    if kind == 1 && l.kind().vectors_per_head() == 1 {
        return Vec::new();
    }
    let row = row_bytes(l);
    let mut out = Vec::with_capacity(values.len() * row);
    for &v in values {
        let mut z = u64::from(v) << 20 ^ (layer as u64) << 4 ^ kind;
        for _ in 0..row {
            z = z
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(0x632b_e59b_d9b4_e019);
            out.push((z >> 56) as u8);
        }
    }
    out
}

/// Writes the tokens with `values` through `slots` in every layer.
pub fn write_values<S: Storage + ?Sized>(st: &mut S, slots: &[Slot], values: &[u32]) {
    let l = *st.layout();
    for layer in 0..l.num_layers() {
        let (k, v) = (
            kv_pattern(&l, layer, 0, values),
            kv_pattern(&l, layer, 1, values),
        );
        st.write_slots(layer, slots, &k, &v).expect("writing K/V");
    }
}

/// Whether the first `values.len()` tokens through `table` hold `values`, in every
/// layer; the first layer that differs otherwise.
pub fn check_values<S: Storage + ?Sized>(
    st: &S,
    table: &[BlockId],
    values: &[u32],
) -> Result<(), usize> {
    let l = *st.layout();
    for layer in 0..l.num_layers() {
        let (want_k, want_v) = (
            kv_pattern(&l, layer, 0, values),
            kv_pattern(&l, layer, 1, values),
        );
        let (mut k, mut v) = (vec![0; want_k.len()], vec![0; want_v.len()]);
        st.read_tokens(layer, table, values.len(), &mut k, &mut v)
            .map_err(|_| layer)?;
        if k != want_k || v != want_v {
            return Err(layer);
        }
    }
    Ok(())
}
