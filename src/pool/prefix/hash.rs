//! Content hashes of full blocks, chained from a namespace seed.
//!
//! A block's hash covers its parent block's hash and its token ids; the first block of
//! a prompt chains from a *namespace seed* that covers the tenant's cache salt and the
//! request's extra key (LoRA id, multimodal hash). So equal hashes mean "probably the
//! same prefix in the same namespace" and the manager confirms every hit against the
//! stored tokens and chain before reuse: a hash is a lookup key, never proof.

/// The content hash of one full block (or of a namespace seed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct BlockHash(pub u64);

impl std::fmt::Display for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#018x}", self.0)
    }
}

/// Computes the chained hashes of the prefix cache.
///
/// Implementations must be deterministic (an external router recomputes them) but need
/// not be collision-free: the manager verifies every hit against the stored token ids,
/// the chain of parents and the namespace, so a collision costs a cache miss, never
/// another prompt's K/V.
pub trait PrefixHasher: std::fmt::Debug + Send + Sync {
    /// The seed the first block of a prompt chains from, for a tenant's `cache_salt`
    /// and a request's `extra_key` (both may be empty).
    fn namespace(&self, cache_salt: &[u8], extra_key: &[u8]) -> BlockHash;

    /// The hash of a full block holding `tokens`, whose predecessor hashed to `parent`
    /// (the namespace seed for the first block).
    fn block(&self, parent: BlockHash, tokens: &[u32]) -> BlockHash;

    /// A boxed copy (the manager is `Clone`).
    fn clone_box(&self) -> Box<dyn PrefixHasher>;
}

impl Clone for Box<dyn PrefixHasher> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// The default hasher, `pagedkv-chain-v1`: fast, stable across platforms and runs, not
/// cryptographic.
///
/// The state starts at `parent ^ SEED`; each 64-bit little-endian word (two token ids,
/// the low one first; an odd last token is zero-extended) is mixed as
/// `state = fold(state ^ word, MUL)` where `fold(a, b)` is the high 64 bits XOR the low
/// 64 bits of the 128-bit product; the length is mixed last and the result goes through
/// the `splitmix64` finalizer. Namespace seeds hash `len(salt) ‖ salt ‖ extra_key` the
/// same way, eight bytes per word.
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

impl PrefixHasher for ChainHasher {
    fn namespace(&self, cache_salt: &[u8], extra_key: &[u8]) -> BlockHash {
        let mut h = fold(SEED ^ cache_salt.len() as u64, MUL);
        for part in [cache_salt, extra_key] {
            let mut words = part.chunks_exact(8);
            for w in &mut words {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                h = fold(h ^ u64::from_le_bytes(b), MUL);
            }
            let rest = words.remainder();
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            h = fold(h ^ u64::from_le_bytes(b) ^ ((part.len() as u64) << 56), MUL);
        }
        BlockHash(finish(h))
    }

    #[inline]
    fn block(&self, parent: BlockHash, tokens: &[u32]) -> BlockHash {
        let mut h = parent.0 ^ SEED;
        let mut pairs = tokens.chunks_exact(2);
        for p in &mut pairs {
            h = fold(h ^ (u64::from(p[0]) | u64::from(p[1]) << 32), MUL);
        }
        if let [last] = pairs.remainder() {
            h = fold(h ^ u64::from(*last), MUL);
        }
        BlockHash(finish(fold(h ^ tokens.len() as u64, MUL)))
    }

    fn clone_box(&self) -> Box<dyn PrefixHasher> {
        Box::new(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_depend_on_parent_tokens_and_namespace() {
        let h = ChainHasher;
        let ns = h.namespace(b"", b"");
        let a = h.block(ns, &[1, 2, 3, 4]);
        assert_eq!(a, h.block(ns, &[1, 2, 3, 4]));
        assert_ne!(a, h.block(ns, &[1, 2, 4, 3]));
        assert_ne!(a, h.block(ns, &[1, 2, 3]));
        assert_ne!(a, h.block(a, &[1, 2, 3, 4]));
        assert_ne!(ns, h.namespace(b"tenant", b""));
        // The salt/extra split point is part of the key.
        assert_ne!(h.namespace(b"ab", b"c"), h.namespace(b"a", b"bc"));
        assert_ne!(h.namespace(b"", b""), h.namespace(b"", b"\0"));
    }
}
