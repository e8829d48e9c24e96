//! vLLM's `sha256_cbor` prefix-block hash (feature `vllm-hash`).
//!
//! What vLLM computes (`vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`, with
//! `sha256_cbor` from its hashing utilities, read at vLLM's main branch): the hash of a
//! full block is
//!
//! ```text
//! sha256(cbor2.dumps((parent_digest, tuple(token_ids), extra_keys), canonical=True))
//! ```
//!
//! a 32-byte digest, where `parent_digest` is the previous block's digest, or
//! `NONE_HASH` for the first block of a prompt, and `extra_keys` is `None` or a tuple
//! (LoRA name, multimodal `(identifier, offset)` pairs, cache salt on the first block
//! only, prompt-embedding digests, in that order). `NONE_HASH` is set once per process
//! by `init_none_hash`: `sha256_cbor(os.environ["PYTHONHASHSEED"])` (the seed as a
//! text string) when that variable is set, 32 random bytes otherwise. The KV events
//! carry the digest's last eight bytes read as a big-endian unsigned integer
//! (`maybe_convert_block_hash` with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the
//! default), which is [`BlockDigest::key`].
//!
//! The CBOR here is written by hand (RFC 8949): the input holds only byte strings,
//! text strings, unsigned integers, arrays and null, and for those `cbor2`'s canonical
//! mode is RFC 8949's preferred serialization: the shortest head for every length and
//! integer, definite lengths, tuples as arrays. Canonical mode changes map key order and
//! float width, and neither occurs.
//!
//! How this crate's keys map onto vLLM's `extra_keys`:
//!
//! | crate | vLLM | hashed as |
//! |---|---|---|
//! | [`AdmitOptions::extra_key`](crate::AdmitOptions::extra_key) | the LoRA name (`lora_request.lora_name`), on every block | text if UTF-8, else bytes |
//! | [`AdmitOptions::block_keys`](crate::AdmitOptions::block_keys) span | a multimodal `(identifier, offset in block)` pair, on the block where the span starts | `[text or bytes, uint]` |
//! | [`AdmitOptions::cache_salt`](crate::AdmitOptions::cache_salt) | `cache_salt`, on the first block only | text if UTF-8, else bytes |
//!
//! Known differences (unfinished): vLLM also keys every *later* block that a multimodal
//! input overlaps (with a negative offset), which this crate's block keys cannot say,
//! so hashes agree with vLLM only for inputs that lie within one block; vLLM's
//! prompt-embedding keys have no counterpart. A difference costs a router a miss, never
//! a wrong hit: the crate confirms every hit against the stored token ids and keys.

use sha2::{Digest, Sha256};

use super::hash::{BlockDigest, BlockHash, PrefixHasher};
use crate::error::{Error, Result};

/// vLLM's `sha256_cbor` block hasher, `vllm-sha256-cbor` (see the module docs for the
/// exact definition and how the crate's keys map onto vLLM's extra keys).
///
/// Select it with [`crate::PrefixConfig::hasher`] (or
/// [`crate::manager::CacheBuilder::hasher`]); the index then chains 32-byte digests and
/// keys on their low 64 bits, the integers vLLM's KV events carry.
///
/// ```
/// use pagedkv::pool::prefix::{PrefixHasher, VllmHasher};
/// let h = VllmHasher::with_python_hash_seed("0");
/// let first = h.block_digest(None, b"", b"", &[1, 2, 3, 4], b"");
/// let second = h.block_digest(Some(&first), b"", b"", &[5, 6, 7, 8], b"");
/// assert_ne!(first.key(), second.key());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VllmHasher {
    none_hash: BlockDigest,
}

impl VllmHasher {
    /// The hasher of a vLLM process started with `PYTHONHASHSEED=seed`: `NONE_HASH` is
    /// `sha256(cbor(seed))`, the seed hashed as a CBOR text string.
    pub fn with_python_hash_seed(seed: &str) -> Self {
        let mut sha = Sha256::new();
        text_or_bytes(&mut sha, seed.as_bytes());
        VllmHasher {
            none_hash: BlockDigest(sha.finalize().into()),
        }
    }

    /// The hasher with a given `NONE_HASH` (a vLLM process without `PYTHONHASHSEED`
    /// draws 32 random bytes: pass what it drew, or draw your own).
    pub fn with_none_hash(none_hash: BlockDigest) -> Self {
        VllmHasher { none_hash }
    }

    /// [`Self::with_none_hash`] from a byte slice.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `bytes` is not 32 bytes long.
    pub fn with_none_hash_bytes(bytes: &[u8]) -> Result<Self> {
        let digest: [u8; 32] = bytes.try_into().map_err(|_| {
            Error::config(
                "none_hash",
                format!("a NONE_HASH is 32 bytes, got {}", bytes.len()),
            )
        })?;
        Ok(Self::with_none_hash(BlockDigest(digest)))
    }

    /// The hasher of a vLLM process run in this environment: from `PYTHONHASHSEED`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `PYTHONHASHSEED` is unset or not Unicode. vLLM
    /// then uses 32 random bytes, which no router can recompute; this crate asks for
    /// the choice to be explicit ([`Self::with_none_hash`]).
    pub fn from_env() -> Result<Self> {
        match std::env::var("PYTHONHASHSEED") {
            Ok(seed) => Ok(Self::with_python_hash_seed(&seed)),
            Err(e) => Err(Error::config("PYTHONHASHSEED", e.to_string())),
        }
    }

    /// The digest the first block of every prompt chains from (vLLM's `NONE_HASH`).
    pub fn none_hash(&self) -> BlockDigest {
        self.none_hash
    }

    /// Appends to `out` the canonical CBOR that [`PrefixHasher::block_digest`] hashes
    /// for these arguments (for a router, or a test, to compare bytes with vLLM's).
    pub fn encode_block_input(
        &self,
        parent: Option<&BlockDigest>,
        cache_salt: &[u8],
        extra_key: &[u8],
        tokens: &[u32],
        extra: &[u8],
        out: &mut Vec<u8>,
    ) {
        encode_block(
            out,
            parent.is_none(),
            parent.unwrap_or(&self.none_hash),
            cache_salt,
            extra_key,
            tokens,
            extra,
        );
    }
}

impl PrefixHasher for VllmHasher {
    /// The key of `NONE_HASH`: every namespace chains from it (the salt and the LoRA
    /// name go into the blocks' extra keys, as in vLLM). Not used by the index, which
    /// chains digests for this hasher.
    fn namespace(&self, _cache_salt: &[u8], _extra_key: &[u8]) -> BlockHash {
        self.none_hash.key()
    }

    /// A 64-bit parent cannot chain vLLM's hashes (the digest's other 24 bytes are
    /// gone): this hashes from `BlockDigest::from_key(parent)`, which is *not* vLLM's
    /// value. The index never calls it for this hasher; use
    /// [`PrefixHasher::block_digest`].
    fn block(&self, parent: BlockHash, tokens: &[u32], extra: &[u8]) -> BlockHash {
        let parent = BlockDigest::from_key(parent);
        self.block_digest(Some(&parent), &[], &[], tokens, extra)
            .key()
    }

    fn name(&self) -> &'static str {
        "vllm-sha256-cbor"
    }

    fn chains_digests(&self) -> bool {
        true
    }

    fn block_digest(
        &self,
        parent: Option<&BlockDigest>,
        cache_salt: &[u8],
        extra_key: &[u8],
        tokens: &[u32],
        extra: &[u8],
    ) -> BlockDigest {
        // CBOR goes straight into SHA-256 (it buffers): no encoding buffer per block.
        let mut sha = Sha256::new();
        encode_block(
            &mut sha,
            parent.is_none(),
            parent.unwrap_or(&self.none_hash),
            cache_salt,
            extra_key,
            tokens,
            extra,
        );
        BlockDigest(sha.finalize().into())
    }

    fn clone_box(&self) -> Box<dyn PrefixHasher> {
        Box::new(*self)
    }
}

/// Where CBOR goes: a buffer, or SHA-256 directly.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Sink for Sha256 {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

/// CBOR major types (RFC 8949 §3.1).
const UNSIGNED: u8 = 0;
const BYTES: u8 = 2;
const TEXT: u8 = 3;
const ARRAY: u8 = 4;
/// Simple value 22, `null` (RFC 8949 §3.3): Python's `None`.
const NULL: u8 = 0xf6;

/// A data item's head with the shortest argument (RFC 8949 §4.2.1).
fn head(out: &mut impl Sink, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        out.put(&[m | n as u8]);
    } else if n <= u64::from(u8::MAX) {
        out.put(&[m | 24, n as u8]);
    } else if n <= u64::from(u16::MAX) {
        out.put(&[m | 25]);
        out.put(&(n as u16).to_be_bytes());
    } else if n <= u64::from(u32::MAX) {
        out.put(&[m | 26]);
        out.put(&(n as u32).to_be_bytes());
    } else {
        out.put(&[m | 27]);
        out.put(&n.to_be_bytes());
    }
}

/// A key as Python would hold it: a `str` (CBOR text) when it is UTF-8, else `bytes`.
fn text_or_bytes(out: &mut impl Sink, key: &[u8]) {
    let major = if std::str::from_utf8(key).is_ok() {
        TEXT
    } else {
        BYTES
    };
    head(out, major, key.len() as u64);
    out.put(key);
}

/// The spans of a block's extra-key bytes (`offset: u32 LE ‖ len: u32 LE ‖ key` each,
/// see `AdmitOptions::block_keys`); `Err(rest)` for bytes that do not parse, which are
/// hashed as one byte string (the index never produces them).
fn spans(mut extra: &[u8]) -> impl Iterator<Item = std::result::Result<(u32, &[u8]), &[u8]>> {
    std::iter::from_fn(move || {
        if extra.is_empty() {
            return None;
        }
        let parsed = (|| {
            let offset = u32::from_le_bytes(extra.get(..4)?.try_into().ok()?);
            let len = u32::from_le_bytes(extra.get(4..8)?.try_into().ok()?) as usize;
            let key = extra.get(8..8usize.checked_add(len)?)?;
            Some((offset, key, 8 + len))
        })();
        match parsed {
            Some((offset, key, used)) => {
                extra = &extra[used..];
                Some(Ok((offset, key)))
            }
            None => {
                let rest = std::mem::take(&mut extra);
                Some(Err(rest))
            }
        }
    })
}

/// `(parent, tuple(tokens), extra_keys)` as canonical CBOR.
fn encode_block(
    out: &mut impl Sink,
    first: bool,
    parent: &BlockDigest,
    cache_salt: &[u8],
    extra_key: &[u8],
    tokens: &[u32],
    extra: &[u8],
) {
    head(out, ARRAY, 3);
    head(out, BYTES, 32);
    out.put(&parent.0);
    head(out, ARRAY, tokens.len() as u64);
    for &t in tokens {
        head(out, UNSIGNED, u64::from(t));
    }
    // vLLM's order: LoRA name, multimodal keys, cache salt (first block only).
    let lora = usize::from(!extra_key.is_empty());
    let salt = usize::from(first && !cache_salt.is_empty());
    let n = lora + spans(extra).count() + salt;
    if n == 0 {
        out.put(&[NULL]);
        return;
    }
    head(out, ARRAY, n as u64);
    if lora == 1 {
        text_or_bytes(out, extra_key);
    }
    for span in spans(extra) {
        match span {
            Ok((offset, key)) => {
                head(out, ARRAY, 2);
                text_or_bytes(out, key);
                head(out, UNSIGNED, u64::from(offset));
            }
            Err(rest) => {
                head(out, BYTES, rest.len() as u64);
                out.put(rest);
            }
        }
    }
    if salt == 1 {
        text_or_bytes(out, cache_salt);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cbor(n: u64) -> Vec<u8> {
        let mut v = Vec::new();
        head(&mut v, UNSIGNED, n);
        v
    }

    #[test]
    fn heads_are_shortest_rfc8949_appendix_a() {
        // RFC 8949 Appendix A examples.
        assert_eq!(cbor(0), [0x00]);
        assert_eq!(cbor(23), [0x17]);
        assert_eq!(cbor(24), [0x18, 0x18]);
        assert_eq!(cbor(100), [0x18, 0x64]);
        assert_eq!(cbor(1000), [0x19, 0x03, 0xe8]);
        assert_eq!(cbor(1_000_000), [0x1a, 0x00, 0x0f, 0x42, 0x40]);
        assert_eq!(
            cbor(1_000_000_000_000),
            [0x1b, 0x00, 0x00, 0x00, 0xe8, 0xd4, 0xa5, 0x10, 0x00]
        );
        let mut v = Vec::new();
        text_or_bytes(&mut v, b"IETF");
        assert_eq!(v, [0x64, 0x49, 0x45, 0x54, 0x46]);
        v.clear();
        text_or_bytes(&mut v, &[1, 2, 3, 0xff]);
        assert_eq!(v, [0x44, 1, 2, 3, 0xff]);
    }

    #[test]
    fn malformed_extra_bytes_hash_as_one_byte_string() {
        let all: Vec<_> = spans(&[1, 0, 0, 0, 9, 0, 0, 0, b'x']).collect();
        assert_eq!(all, [Err(&[1, 0, 0, 0, 9, 0, 0, 0, b'x'][..])]);
        let ok: Vec<_> = spans(&[2, 0, 0, 0, 1, 0, 0, 0, b'x']).collect();
        assert_eq!(ok, [Ok((2, &b"x"[..]))]);
    }
}
