//! Test vectors of the prefix cache's standard block hash ([`Xxh3Hasher`],
//! `pagedkv-xxh3-v1`), computed by an independent implementation from the encoding
//! documented on [`Xxh3Hasher`]: Python 3.11 with the PyPI `xxhash` package 4.1.0
//! (bindings of the reference C library), running this snippet:
//!
//! ```text
//! import struct, xxhash
//! def namespace(salt=b"", extra=b""):
//!     return xxhash.xxh3_64_intdigest(struct.pack("<I", len(salt)) + salt
//!                                     + struct.pack("<I", len(extra)) + extra)
//! def block(parent, tokens, extra=b""):
//!     return xxhash.xxh3_64_intdigest(struct.pack("<QI", parent, len(tokens))
//!         + struct.pack(f"<{len(tokens)}I", *tokens) + struct.pack("<I", len(extra)) + extra)
//! def span_key(offset_in_block, key):
//!     return struct.pack("<II", offset_in_block, len(key)) + key
//! h = lambda x: f"0x{x:016x}"
//! ns0 = namespace()
//! print("ns empty", h(ns0))
//! print("ns salt", h(namespace(b"tenant-a")))
//! print("ns extra", h(namespace(b"", b"lora-7")))
//! print("ns both", h(namespace(b"tenant-a", b"lora-7")))
//! b0 = block(ns0, list(range(16)))
//! print("b0", h(b0))
//! print("b1", h(block(b0, list(range(16, 32)))))
//! print("img", h(block(ns0, list(range(16)), span_key(5, b"image:0123abcd"))))
//! print("two spans", h(block(ns0, [7, 7, 7, 7], span_key(0, b"a") + span_key(2, b"bc"))))
//! print("high ids", h(block(0xFFFFFFFFFFFFFFFF, [0xFFFFFFFF, 0x80000000, 0, 1])))
//! print("300", h(block(ns0, list(range(300)))))
//! ```
//!
//! The manager-level vectors (the hashes a router sees in `PrefixEvent::BlockStored`,
//! per-block keys encoded by the manager) are in `tests/cache/prefix.rs`,
//! `stored_events_carry_tokens_block_size_keys_and_medium`.

use pagedkv::pool::prefix::BlockHash;
use pagedkv::pool::prefix::{PrefixHasher, Xxh3Hasher};
use pagedkv::PrefixConfig;

/// `offset_in_block: u32 LE ‖ len(key): u32 LE ‖ key`, one keyed span's part of a
/// block's extra-key bytes.
fn span_key(offset_in_block: u32, key: &[u8]) -> Vec<u8> {
    let mut v = offset_in_block.to_le_bytes().to_vec();
    v.extend_from_slice(&(key.len() as u32).to_le_bytes());
    v.extend_from_slice(key);
    v
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn namespace_seeds_match_the_python_reference() {
    let h = Xxh3Hasher;
    assert_eq!(h.namespace(b"", b""), BlockHash(0xc77b3abb6f87acd9));
    assert_eq!(h.namespace(b"tenant-a", b""), BlockHash(0xe839483c20684050));
    assert_eq!(h.namespace(b"", b"lora-7"), BlockHash(0x5f0227dcce4c9308));
    assert_eq!(
        h.namespace(b"tenant-a", b"lora-7"),
        BlockHash(0xa89d2209c27ba8c2)
    );
}

#[test]
fn block_hashes_match_the_python_reference() {
    let h = Xxh3Hasher;
    let ns0 = h.namespace(b"", b"");
    let b0 = h.block(ns0, &toks(0..16), b"");
    assert_eq!(b0, BlockHash(0x5166b716b27c8dd9));
    assert_eq!(
        h.block(b0, &toks(16..32), b""),
        BlockHash(0x0a7ddd4171401a15)
    );
    assert_eq!(
        h.block(ns0, &toks(0..16), &span_key(5, b"image:0123abcd")),
        BlockHash(0xf2023fb7b4d2d7b4)
    );
    let mut two = span_key(0, b"a");
    two.extend_from_slice(&span_key(2, b"bc"));
    assert_eq!(
        h.block(ns0, &[7, 7, 7, 7], &two),
        BlockHash(0x69cac07e59d410e6)
    );
    assert_eq!(
        h.block(BlockHash(u64::MAX), &[u32::MAX, 0x8000_0000, 0, 1], b""),
        BlockHash(0x05396dfbd7927c83)
    );
    // 1,216 encoded bytes: the streaming path.
    assert_eq!(
        h.block(ns0, &toks(0..300), b""),
        BlockHash(0x43fe42ef0e3c0ac8)
    );
}

#[test]
fn the_standard_hasher_is_the_default() {
    let c = PrefixConfig::for_arena(8);
    assert_eq!(c.hasher.name(), "pagedkv-xxh3-v1");
    assert_eq!(c.hasher.namespace(b"", b""), Xxh3Hasher.namespace(b"", b""));
}
