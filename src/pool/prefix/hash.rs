//! Content hashes of full blocks, chained from a namespace seed.
//!
//! A block's hash covers its parent block's hash, its token ids and the extra keys of
//! keyed spans (images, audio) that start in it; the first block of a prompt chains
//! from a *namespace seed* that covers the tenant's cache salt and the request's extra
//! key (a LoRA id). So equal hashes mean "probably the same prefix in the same
//! namespace" and the manager confirms every hit against the stored tokens, keys and
//! chain before reuse: a hash is a lookup key, never proof.
//!
//! [`Xxh3Hasher`] (the default) is specified byte for byte so that a router can
//! recompute it; [`ChainHasher`] is this crate's own mix; with the `vllm-hash`
//! feature, [`super::VllmHasher`] computes vLLM's `sha256_cbor` block hashes.
//!
//! The index keys on a 64-bit [`BlockHash`]. A hasher whose chain state is wider
//! (vLLM's 32-byte SHA-256 digests: each block hashes its parent's *whole* digest)
//! says so with [`PrefixHasher::chains_digests`]; the index then keeps one
//! [`BlockDigest`] per registered block (32 bytes a block of the arena, allocated only
//! for such a hasher) and hashes through [`PrefixHasher::block_digest`], handing it the
//! parent block's stored digest. The 64-bit key of a digest is its last eight bytes
//! read big-endian ([`BlockDigest::key`]), which is the integer vLLM publishes in its
//! KV events, so the crate's events carry vLLM's own hash values.

/// The content hash of one full block (or of a namespace seed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct BlockHash(pub u64);

impl std::fmt::Display for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#018x}", self.0)
    }
}

/// A block's full chain digest, for hashers whose chain is wider than the 64-bit
/// [`BlockHash`] the index keys on (see [`PrefixHasher::chains_digests`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BlockDigest(pub [u8; 32]);

impl BlockDigest {
    /// The 64-bit index key of this digest: its last eight bytes read big-endian
    /// (vLLM's `int.from_bytes(digest, "big") & (2**64 - 1)`, the block hash its KV
    /// events carry).
    pub fn key(&self) -> BlockHash {
        let mut low = [0u8; 8];
        low.copy_from_slice(&self.0[24..]);
        BlockHash(u64::from_be_bytes(low))
    }

    /// The digest of a narrow hasher: `hash` in the last eight bytes (big-endian),
    /// zeros before, so that [`Self::key`] gives `hash` back.
    pub fn from_key(hash: BlockHash) -> Self {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&hash.0.to_be_bytes());
        BlockDigest(d)
    }
}

impl std::fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockDigest({self})")
    }
}

impl std::fmt::Display for BlockDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Computes the chained hashes of the prefix cache.
///
/// Implementations must be deterministic (an external router recomputes them) but need
/// not be collision-free: the manager verifies every hit against the stored token ids,
/// the chain of parents, the namespace and the block's extra keys, so a collision costs
/// a cache miss, never another prompt's K/V.
pub trait PrefixHasher: std::fmt::Debug + Send + Sync {
    /// The seed the first block of a prompt chains from, for a tenant's `cache_salt`
    /// and a request's `extra_key` (both may be empty).
    fn namespace(&self, cache_salt: &[u8], extra_key: &[u8]) -> BlockHash;

    /// The hash of a full block holding `tokens`, whose predecessor hashed to `parent`
    /// (the namespace seed for the first block), with the block's extra keys `extra`
    /// in their encoding (see [`crate::AdmitOptions::block_keys`]; empty for a block
    /// where no keyed span starts, which is most blocks).
    fn block(&self, parent: BlockHash, tokens: &[u32], extra: &[u8]) -> BlockHash;

    /// A short name for logs, benches and a router's configuration.
    fn name(&self) -> &'static str {
        "custom"
    }

    /// Whether each block's hash chains from its parent's whole [`BlockDigest`] rather
    /// than from the parent's 64-bit [`BlockHash`] (`false`, the default). When `true`
    /// the index stores a digest per registered block and hashes only through
    /// [`Self::block_digest`]; [`Self::block`] and [`Self::namespace`] are then not
    /// called by the crate.
    fn chains_digests(&self) -> bool {
        false
    }

    /// The digest of a full block holding `tokens` with the block's extra-key bytes
    /// `extra`, whose predecessor's digest is `parent` (`None` for the first block of a
    /// prompt, which chains from the namespace of `cache_salt` and `extra_key`).
    ///
    /// The default serves narrow hashers: [`Self::block`] chained from the parent's
    /// [`BlockDigest::key`] (or [`Self::namespace`]), widened by
    /// [`BlockDigest::from_key`].
    fn block_digest(
        &self,
        parent: Option<&BlockDigest>,
        cache_salt: &[u8],
        extra_key: &[u8],
        tokens: &[u32],
        extra: &[u8],
    ) -> BlockDigest {
        let parent = parent.map_or_else(|| self.namespace(cache_salt, extra_key), |d| d.key());
        BlockDigest::from_key(self.block(parent, tokens, extra))
    }

    /// A boxed copy (the manager is `Clone`).
    fn clone_box(&self) -> Box<dyn PrefixHasher>;
}

impl Clone for Box<dyn PrefixHasher> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// The default hasher, `pagedkv-xxh3-v1`: XXH3-64 (seed 0, default secret) over a
/// documented byte encoding, so that an external KV-aware router can recompute every
/// block hash in any language that has XXH3 (Python's `xxhash.xxh3_64_intdigest`, the
/// reference C library's `XXH3_64bits`).
///
/// All integers are little-endian; `‖` is concatenation.
///
/// - **Namespace seed** (the parent of a prompt's first block):
///   `xxh3_64(len(cache_salt): u32 ‖ cache_salt ‖ len(extra_key): u32 ‖ extra_key)`.
///   With no salt and no extra key that is the hash of 8 zero bytes.
/// - **Block**: `xxh3_64(parent: u64 ‖ n_tokens: u32 ‖ token_0: u32 ‖ … ‖
///   token_{n-1}: u32 ‖ len(extra): u32 ‖ extra)`, where `parent` is the previous
///   block's hash (the namespace seed for the first block), `n_tokens` is the block
///   size, and `extra` is the block's extra-key bytes: empty (so `len(extra)` is 0)
///   unless a keyed span starts in the block, and then, for each span that starts in
///   it in order of position, `offset_in_block: u32 ‖ len(key): u32 ‖ key`
///   (see [`crate::AdmitOptions::block_keys`]).
///
/// In Python (the test vectors of `tests/io/prefix_hash.rs` were made this way):
///
/// ```text
/// import struct, xxhash
/// def namespace(salt=b"", extra=b""):
///     return xxhash.xxh3_64_intdigest(struct.pack("<I", len(salt)) + salt
///                                     + struct.pack("<I", len(extra)) + extra)
/// def block(parent, tokens, extra=b""):
///     return xxhash.xxh3_64_intdigest(struct.pack("<QI", parent, len(tokens))
///         + struct.pack(f"<{len(tokens)}I", *tokens) + struct.pack("<I", len(extra)) + extra)
/// def span_key(offset_in_block, key):
///     return struct.pack("<II", offset_in_block, len(key)) + key
/// ```
///
/// Encoding a block copies its bytes into a stack buffer (heap-free, one-shot XXH3 for
/// blocks up to 124 tokens; streaming XXH3, which gives the same digest, beyond).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Xxh3Hasher;

/// Bytes encoded on the stack before XXH3 switches to streaming.
const STACK_BYTES: usize = 512;

/// Encoded block inputs up to this many bytes take [`Xxh3Hasher::block`]'s one-pass
/// path: 32 token ids (128 bytes) plus the parent and the two lengths. Small enough
/// that zeroing the buffer is a few vector stores, not a `memset` call.
const SMALL_BLOCK_BYTES: usize = 144;

/// A length as the encoding's `u32` (see [`Xxh3Writer::write_len`]).
#[inline]
fn encoded_len(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Feeds XXH3 from a stack buffer: one-shot when everything fits, streaming otherwise
/// (XXH3's streaming digest equals its one-shot digest of the same bytes).
struct Xxh3Writer {
    buf: [u8; STACK_BYTES],
    len: usize,
    stream: Option<xxhash_rust::xxh3::Xxh3Default>,
}

impl Xxh3Writer {
    #[inline]
    fn new() -> Self {
        Xxh3Writer {
            buf: [0; STACK_BYTES],
            len: 0,
            stream: None,
        }
    }

    #[inline]
    fn write(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.len == STACK_BYTES {
                self.stream
                    .get_or_insert_with(xxhash_rust::xxh3::Xxh3Default::new)
                    .update(&self.buf);
                self.len = 0;
            }
            let n = bytes.len().min(STACK_BYTES - self.len);
            self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
            self.len += n;
            bytes = &bytes[n..];
        }
    }

    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write(&x.to_le_bytes());
    }

    /// A length as the encoding's `u32`. Lengths past `u32::MAX` cannot occur (keys are
    /// bounded by `PrefixConfig::max_key_bytes`, blocks by `u16` fills); saturating
    /// keeps this total without a panic path.
    #[inline]
    fn write_len(&mut self, n: usize) {
        self.write_u32(encoded_len(n));
    }

    #[inline]
    fn finish(self) -> u64 {
        match self.stream {
            None => xxhash_rust::xxh3::xxh3_64(&self.buf[..self.len]),
            Some(mut s) => {
                s.update(&self.buf[..self.len]);
                s.digest()
            }
        }
    }
}

impl PrefixHasher for Xxh3Hasher {
    fn namespace(&self, cache_salt: &[u8], extra_key: &[u8]) -> BlockHash {
        let mut w = Xxh3Writer::new();
        for part in [cache_salt, extra_key] {
            w.write_len(part.len());
            w.write(part);
        }
        BlockHash(w.finish())
    }

    #[inline]
    fn block(&self, parent: BlockHash, tokens: &[u32], extra: &[u8]) -> BlockHash {
        // The usual block (up to 32 ids, short or no extra key) is encoded in one pass
        // into a small buffer: the same bytes as the writer below, without zeroing
        // its 512-byte buffer or copying each id through a bounds-checked write.
        let ids_end = tokens.len().saturating_mul(4).saturating_add(12);
        let len = ids_end.saturating_add(4).saturating_add(extra.len());
        if len <= SMALL_BLOCK_BYTES {
            let mut buf = [0u8; SMALL_BLOCK_BYTES];
            buf[..8].copy_from_slice(&parent.0.to_le_bytes());
            buf[8..12].copy_from_slice(&encoded_len(tokens.len()).to_le_bytes());
            for (dst, t) in buf[12..ids_end].chunks_exact_mut(4).zip(tokens) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            buf[ids_end..ids_end + 4].copy_from_slice(&encoded_len(extra.len()).to_le_bytes());
            buf[ids_end + 4..len].copy_from_slice(extra);
            return BlockHash(xxhash_rust::xxh3::xxh3_64(&buf[..len]));
        }
        let mut w = Xxh3Writer::new();
        w.write(&parent.0.to_le_bytes());
        w.write_len(tokens.len());
        for &t in tokens {
            w.write_u32(t);
        }
        w.write_len(extra.len());
        w.write(extra);
        BlockHash(w.finish())
    }

    fn name(&self) -> &'static str {
        "pagedkv-xxh3-v1"
    }

    fn clone_box(&self) -> Box<dyn PrefixHasher> {
        Box::new(*self)
    }
}

/// `pagedkv-chain-v1`, the hasher before [`Xxh3Hasher`]: stable across platforms and
/// runs, not cryptographic, and specific to this crate (a router would have to port
/// it). Its inner loop is one 64x64->128-bit multiply per two token ids; whether that
/// is measurably faster than [`Xxh3Hasher`] is what the `prefix/block_hash` bench group
/// compares (see `benches/prefix.rs`).
///
/// The state starts at `parent ^ SEED`; each 64-bit little-endian word (two token ids,
/// the low one first; an odd last token is zero-extended) is mixed as
/// `state = fold(state ^ word, MUL)` where `fold(a, b)` is the high 64 bits XOR the low
/// 64 bits of the 128-bit product; a non-empty `extra` is then mixed eight bytes per
/// word (the last word zero-padded and tagged with the length in its top byte); the
/// token count is mixed last and the result goes through the `splitmix64` finalizer.
/// Namespace seeds hash `len(salt) ‖ salt ‖ extra_key` the same way, eight bytes per
/// word. Blocks without extra keys hash as they did before extra keys existed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChainHasher;

const SEED: u64 = 0x243f_6a88_85a3_08d3;
const MUL: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

#[inline]
fn finish(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Mixes `bytes` eight per word, the last (zero-padded) word tagged with the length.
#[inline]
fn mix_bytes(mut h: u64, bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        h = fold(h ^ u64::from_le_bytes(b), MUL);
    }
    let rest = words.remainder();
    let mut b = [0u8; 8];
    b[..rest.len()].copy_from_slice(rest);
    fold(
        h ^ u64::from_le_bytes(b) ^ ((bytes.len() as u64) << 56),
        MUL,
    )
}

impl PrefixHasher for ChainHasher {
    fn namespace(&self, cache_salt: &[u8], extra_key: &[u8]) -> BlockHash {
        let mut h = fold(SEED ^ cache_salt.len() as u64, MUL);
        for part in [cache_salt, extra_key] {
            h = mix_bytes(h, part);
        }
        BlockHash(finish(h))
    }

    #[inline]
    fn block(&self, parent: BlockHash, tokens: &[u32], extra: &[u8]) -> BlockHash {
        let mut h = parent.0 ^ SEED;
        let mut pairs = tokens.chunks_exact(2);
        for p in &mut pairs {
            h = fold(h ^ (u64::from(p[0]) | u64::from(p[1]) << 32), MUL);
        }
        if let [last] = pairs.remainder() {
            h = fold(h ^ u64::from(*last), MUL);
        }
        if !extra.is_empty() {
            h = mix_bytes(h, extra);
        }
        BlockHash(finish(fold(h ^ tokens.len() as u64, MUL)))
    }

    fn name(&self) -> &'static str {
        "pagedkv-chain-v1"
    }

    fn clone_box(&self) -> Box<dyn PrefixHasher> {
        Box::new(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(h: &dyn PrefixHasher) {
        let ns = h.namespace(b"", b"");
        let a = h.block(ns, &[1, 2, 3, 4], b"");
        assert_eq!(a, h.block(ns, &[1, 2, 3, 4], b""));
        assert_ne!(a, h.block(ns, &[1, 2, 4, 3], b""));
        assert_ne!(a, h.block(ns, &[1, 2, 3], b""));
        assert_ne!(a, h.block(a, &[1, 2, 3, 4], b""));
        assert_ne!(a, h.block(ns, &[1, 2, 3, 4], b"\0"));
        assert_ne!(
            h.block(ns, &[1, 2, 3, 4], b"k1"),
            h.block(ns, &[1, 2, 3, 4], b"k2")
        );
        assert_ne!(ns, h.namespace(b"tenant", b""));
        // The salt/extra split point is part of the key.
        assert_ne!(h.namespace(b"ab", b"c"), h.namespace(b"a", b"bc"));
        assert_ne!(h.namespace(b"", b""), h.namespace(b"", b"\0"));
    }

    #[test]
    fn narrow_digests_round_trip_their_key() {
        let h = BlockHash(0x0123_4567_89ab_cdef);
        assert_eq!(BlockDigest::from_key(h).key(), h);
        let ns = Xxh3Hasher.namespace(b"s", b"");
        let a = Xxh3Hasher.block(ns, &[1, 2], b"");
        let d = Xxh3Hasher.block_digest(None, b"s", b"", &[1, 2], b"");
        assert_eq!(d.key(), a);
        let next = Xxh3Hasher.block_digest(Some(&d), b"s", b"", &[3], b"");
        assert_eq!(next.key(), Xxh3Hasher.block(a, &[3], b""));
    }

    #[test]
    fn hashes_depend_on_parent_tokens_extra_and_namespace() {
        check(&ChainHasher);
        check(&Xxh3Hasher);
    }

    /// The documented encoding, written out byte by byte.
    fn reference_xxh3(parent: u64, tokens: &[u32], extra: &[u8]) -> u64 {
        let mut bytes = parent.to_le_bytes().to_vec();
        bytes.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        bytes.extend_from_slice(&(extra.len() as u32).to_le_bytes());
        bytes.extend_from_slice(extra);
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }

    #[test]
    fn xxh3_one_pass_and_writer_paths_hash_the_same_encoding() {
        // Sizes on both sides of SMALL_BLOCK_BYTES (32 ids and no key is 144 bytes).
        let tokens: Vec<u32> = (0..70u32).map(|t| t.wrapping_mul(2_654_435_761)).collect();
        let key: Vec<u8> = (0..600u32).map(|b| b as u8).collect();
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 64, 70] {
            for k in [0, 1, 3, 4, 5, 17, 600] {
                assert_eq!(
                    Xxh3Hasher
                        .block(BlockHash(n as u64), &tokens[..n], &key[..k])
                        .0,
                    reference_xxh3(n as u64, &tokens[..n], &key[..k]),
                    "{n} ids, {k} key bytes"
                );
            }
        }
    }

    #[test]
    fn xxh3_streams_past_the_stack_buffer_with_the_same_digest() {
        // 300 tokens: 1,216 encoded bytes, past STACK_BYTES.
        let tokens: Vec<u32> = (0..300).collect();
        let mut bytes = 7u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&300u32.to_le_bytes());
        for t in &tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        bytes.extend_from_slice(&0u32.to_le_bytes());
        assert_eq!(
            Xxh3Hasher.block(BlockHash(7), &tokens, b"").0,
            xxhash_rust::xxh3::xxh3_64(&bytes)
        );
    }
}
