//! KV export and import for disaggregated serving.
//!
//! A prefill instance computes a prompt's K/V, [exports](export_sequence) the sequence
//! into a self-describing byte buffer in caller-provided memory, any transport carries
//! the bytes, and a decode instance [imports](import_sequence) them: the header and the
//! checksums are validated first, and only then are blocks allocated on the receiving
//! manager (a new sequence is admitted) and the K/V written through the receiving
//! storage. A buffer that fails any check allocates nothing.
//!
//! ```
//! use pagedkv::{CacheConfig, DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId,
//!               Storage};
//! use pagedkv::export::{export_sequence, exported_len, import_sequence};
//!
//! let shape = ModelShape { num_layers: 2, num_q_heads: 8, num_kv_heads: 2, head_dim: 8,
//!                          kv_dtype: DType::F16 };
//! let (prefill_layout, decode_layout) = (KvLayout::new(shape, 16)?, KvLayout::new(shape, 32)?);
//! let mut prefill = KvCache::new(prefill_layout, CacheConfig::new(32))?;
//! let mut prefill_kv = HostStorage::new(prefill_layout, 32)?;
//! let mut slots = Vec::new();
//! prefill.admit(SeqId(7), 40, &mut slots)?;
//! let row = 40 * 2 * 8 * 2;                                  // tokens x heads x dim x bytes
//! for layer in 0..2 {
//!     prefill_kv.write_slots(layer, &slots, &vec![layer as u8; row], &vec![9; row])?;
//! }
//!
//! let mut wire = vec![0u8; exported_len(&prefill_layout, 40, false)?];
//! export_sequence(&prefill, &prefill_kv, SeqId(7), None, &mut wire)?;
//!
//! // The decode side pages by 32 tokens; the export is token-major, so it re-pages.
//! let mut decode = KvCache::new(decode_layout, CacheConfig::new(16))?;
//! let mut decode_kv = HostStorage::new(decode_layout, 16)?;
//! let imported = import_sequence(&mut decode, &mut decode_kv, SeqId(1), &wire)?;
//! assert_eq!((imported.num_tokens, imported.table.len()), (40, 2));
//! let (mut k, mut v) = (vec![0; row], vec![0; row]);
//! decode_kv.read_tokens(1, &imported.table, 40, &mut k, &mut v)?;
//! assert!(k.iter().all(|&b| b == 1) && v.iter().all(|&b| b == 9));
//!
//! wire[300] ^= 1;                                            // corrupted on the way
//! assert!(import_sequence(&mut decode, &mut decode_kv, SeqId(2), &wire).is_err());
//! assert!(!decode.contains(SeqId(2)));
//! # Ok::<(), pagedkv::Error>(())
//! ```
//!
//! # Format (version 1)
//!
//! All integers little-endian. A fixed part of [`HEADER_FIXED_BYTES`] bytes:
//!
//! | offset | type | field |
//! |---|---|---|
//! | 0 | `[u8; 8]` | magic [`EXPORT_MAGIC`] |
//! | 8 | `u32` | version [`EXPORT_VERSION`] |
//! | 12 | `u32` | flags: bit 0 = token ids present; other bits must be 0 |
//! | 16 | `u64` | header checksum: XXH64 (seed 0) of the fixed part with this field zeroed |
//! | 24 | `u64` | tables checksum: XXH64 of the bytes from 128 to `header_len` |
//! | 32 | `u64` | `header_len`: fixed part + token ids + block hashes |
//! | 40 | `u64` | `payload_len` |
//! | 48 | `u32` x 4 | `num_layers`, `num_q_heads`, `num_kv_heads`, `head_dim` |
//! | 64 | `u32` | dtype: 0 f32, 1 f16, 2 bf16, 3 fp8 e4m3 |
//! | 68 | `u32` | sender's block size (tokens) |
//! | 72 | `u64` x 4 | sender's arena strides in elements: block, K/V, head, token |
//! | 104 | `u64` | `num_tokens` |
//! | 112 | `u64` | `num_blocks` = `ceil(num_tokens / block_size)` |
//! | 120 | `u32` | reserved, 0 |
//! | 124 | `u32` | `kv_lora_rank`: 0 for separate K and V; otherwise a latent (MLA) layout ([`KvKind::Latent`]) of one vector of `head_dim` per token, `rope_dim = head_dim - kv_lora_rank` |
//!
//! then the token ids (`num_tokens` x `u32`, zero-padded to a multiple of 8 bytes) when
//! flag bit 0 is set, then one `u64` content hash per sender block, then the payload at
//! offset `header_len`: for each layer, K then V, each `[num_tokens, num_kv_heads,
//! head_dim]` in the cache dtype, i.e. exactly what [`Storage::read_tokens`] returns
//! (a latent layout: the `[num_tokens, head_dim]` latent vectors of each layer, no V).
//! Bytes 120..128 were one reserved `u64` before latent layouts: a K/V export is
//! byte-for-byte what it was, and a build that predates latent exports refuses one
//! as a nonzero reserved field.
//!
//! The hash of block `b` is XXH64 over its tokens' rows of the payload, in payload
//! order (layer 0 K, layer 0 V, layer 1 K, ...; a latent layout: layer 0, layer 1, ...). Together the hashes cover every payload
//! byte once, so they are the payload checksum, and a mismatch names the block. They
//! are content checksums, not the prefix cache's chained token hashes (the prefix cache
//! is being built on another branch; registering imported blocks in it is left to
//! whoever wires the two together: the token ids travel for that purpose).
//!
//! # Decisions
//!
//! - **Block size may differ** between sender and receiver. The payload is token-major,
//!   so it does not depend on the sender's paging: the receiver admits the tokens into
//!   its own blocks and writes them through its slot mapping. The sender's block size and
//!   strides are recorded (and checked for consistency) but only the block hashes use
//!   them.
//! - **Everything else must match**: layers, query and KV heads, head dim and dtype;
//!   otherwise [`Error::ExportShape`] or [`Error::ExportDType`]. Tensor-parallel degree
//!   may differ: a [`crate::executor::shard::ShardedStorage`] exports and imports the joined heads.
//! - **Validation order**: magic, version (so a newer format is named as such), header
//!   checksum, consistency of the header's fields, length, tables checksum, block
//!   hashes, compatibility with the receiver. No length from the buffer is trusted
//!   before the checksum that covers it passed.
//! - **The transport** is the caller's: the buffer is host memory any byte transport can
//!   carry. With the `nixl` feature, `export::nixl` moves the pages themselves between
//!   two arenas over NVIDIA NIXL, this header being the control message. FP8 scales are
//!   not exported because the crate does not store them yet.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::executor::storage::Storage;
use crate::ids::{BlockId, SeqId};
use crate::layout::shape::{DType, KvKind, ModelShape};
use crate::layout::{KvLayout, Strides};
use crate::manager::KvCache;

pub mod groups;
#[cfg(feature = "nixl")]
pub mod nixl;

/// First 8 bytes of every export.
pub const EXPORT_MAGIC: [u8; 8] = *b"PAGEDKV\0";

/// The format version this build writes and reads.
pub const EXPORT_VERSION: u32 = 1;

/// Bytes of the fixed part of the header; [`ExportHeader::parse`] needs only these.
pub const HEADER_FIXED_BYTES: usize = 128;

const FLAG_TOKEN_IDS: u32 = 1;
const KNOWN_FLAGS: u32 = FLAG_TOKEN_IDS;

/// Byte offsets of the fixed header's fields.
mod off {
    pub const VERSION: usize = 8;
    pub const FLAGS: usize = 12;
    pub const HEADER_CHECKSUM: usize = 16;
    pub const TABLES_CHECKSUM: usize = 24;
    pub const HEADER_LEN: usize = 32;
    pub const PAYLOAD_LEN: usize = 40;
    pub const NUM_LAYERS: usize = 48;
    pub const NUM_Q_HEADS: usize = 52;
    pub const NUM_KV_HEADS: usize = 56;
    pub const HEAD_DIM: usize = 60;
    pub const DTYPE: usize = 64;
    pub const BLOCK_SIZE: usize = 68;
    pub const STRIDES: usize = 72;
    pub const NUM_TOKENS: usize = 104;
    pub const NUM_BLOCKS: usize = 112;
    pub const RESERVED: usize = 120;
    pub const KV_LORA_RANK: usize = 124;
}

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Fp8E4M3 => 3,
    }
}

fn dtype_from_code(c: u32) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| dtype_code(d) == c)
}

// ---- bytes, XXH64 ----------------------------------------------------------------------

fn read_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn read_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

/// XXH64 with seed 0 of `data`: the checksum the export format uses, public so that
/// tools (and tests) can build or patch headers.
pub fn xxh64(data: &[u8]) -> u64 {
    xxhash_rust::xxh64::xxh64(data, 0)
}

// ---- sizes -------------------------------------------------------------------------

/// Byte counts of one export.
#[derive(Debug, Clone, Copy)]
struct Lens {
    /// Token ids, padded.
    ids: usize,
    header: usize,
    payload: usize,
    total: usize,
}

/// Bytes of one layer's K (or V) row of one token.
fn row_bytes(layout: &KvLayout) -> usize {
    layout.shape().num_kv_heads * layout.shape().head_dim * layout.dtype().size_bytes()
}

fn lens(layout: &KvLayout, num_tokens: usize, with_token_ids: bool) -> Option<Lens> {
    let ids = if with_token_ids {
        num_tokens.checked_mul(4)?.checked_next_multiple_of(8)?
    } else {
        0
    };
    let hashes = layout.blocks_for_tokens(num_tokens).checked_mul(8)?;
    let header = HEADER_FIXED_BYTES.checked_add(ids)?.checked_add(hashes)?;
    let payload = num_tokens.checked_mul(layout.token_bytes())?;
    Some(Lens {
        ids,
        header,
        payload,
        total: header.checked_add(payload)?,
    })
}

/// Bytes an export of `num_tokens` tokens from a cache of `layout` occupies, so the
/// caller can size the buffer (and the transport its frame).
///
/// # Errors
/// [`Error::TooLong`] when the size does not fit in `usize`.
pub fn exported_len(layout: &KvLayout, num_tokens: usize, with_token_ids: bool) -> Result<usize> {
    lens(layout, num_tokens, with_token_ids)
        .map(|l| l.total)
        .ok_or_else(|| too_long(layout, num_tokens))
}

fn too_long(layout: &KvLayout, num_tokens: usize) -> Error {
    Error::TooLong {
        tokens: num_tokens,
        // A bound, not the exact limit: the header also needs room.
        limit: usize::MAX / (layout.token_bytes() + 4),
    }
}

/// The content hash of every block of `layout.block_size()` tokens in a payload.
fn block_hashes(layout: &KvLayout, num_tokens: usize, payload: &[u8]) -> Vec<u64> {
    let bs = layout.block_size();
    let row = row_bytes(layout);
    let halves = layout.kind().vectors_per_head() * layout.num_layers();
    (0..layout.blocks_for_tokens(num_tokens))
        .into_par_iter()
        .with_min_len(4)
        .map(|b| {
            let (t0, t1) = (b * bs, ((b + 1) * bs).min(num_tokens));
            let mut h = xxhash_rust::xxh64::Xxh64::new(0);
            for half in 0..halves {
                let base = half * num_tokens * row;
                h.update(&payload[base + t0 * row..base + t1 * row]);
            }
            h.digest()
        })
        .collect()
}

// ---- header ------------------------------------------------------------------------

/// The header's `kv_lora_rank` of a layout: 0 for separate K and V.
fn kv_lora_rank(layout: &KvLayout) -> usize {
    match layout.kind() {
        KvKind::Standard => 0,
        KvKind::Latent { kv_lora_rank, .. } => kv_lora_rank,
    }
}

/// What the fixed part of an export header says, after validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportHeader {
    layout: KvLayout,
    num_tokens: usize,
    has_token_ids: bool,
    lens: (usize, usize, usize),
}

fn format_err(what: &'static str, expected: u64, got: u64) -> Error {
    Error::ExportFormat {
        what,
        expected,
        got,
    }
}

/// XXH64 of a fixed header with its checksum field taken as zero.
fn fixed_checksum(fixed: &[u8]) -> u64 {
    let mut h = xxhash_rust::xxh64::Xxh64::new(0);
    h.update(&fixed[..off::HEADER_CHECKSUM]);
    h.update(&[0; 8]);
    h.update(&fixed[off::HEADER_CHECKSUM + 8..HEADER_FIXED_BYTES]);
    h.digest()
}

impl ExportHeader {
    /// Reads and validates the fixed part of a header from the start of `buf`, which
    /// needs only [`HEADER_FIXED_BYTES`] bytes: a receiver reading from a stream can
    /// learn [`Self::total_len`] before it has the rest.
    ///
    /// # Errors
    /// [`Error::ExportFormat`] for a wrong magic or version (checked first, so a buffer
    /// of another format is named as such), an unknown flag, or fields that contradict
    /// each other; [`Error::ExportTruncated`] for fewer than [`HEADER_FIXED_BYTES`]
    /// bytes; [`Error::Checksum`] when the header checksum fails;
    /// [`Error::InvalidConfig`] for a shape or block size no cache could have.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        if buf.len() >= 8 && buf[..8] != EXPORT_MAGIC {
            return Err(format_err(
                "magic",
                u64::from_le_bytes(EXPORT_MAGIC),
                read_u64(buf),
            ));
        }
        if buf.len() >= off::VERSION + 4 {
            let version = read_u32(&buf[off::VERSION..]);
            if version != EXPORT_VERSION {
                return Err(format_err("version", EXPORT_VERSION.into(), version.into()));
            }
        }
        if buf.len() < HEADER_FIXED_BYTES {
            return Err(Error::ExportTruncated {
                needed: HEADER_FIXED_BYTES,
                got: buf.len(),
            });
        }
        let f = &buf[..HEADER_FIXED_BYTES];
        let stored = read_u64(&f[off::HEADER_CHECKSUM..]);
        let computed = fixed_checksum(f);
        if stored != computed {
            return Err(Error::Checksum {
                what: "KV export header".into(),
                expected: stored,
                got: computed,
            });
        }
        let u32_at = |o: usize| read_u32(&f[o..]);
        let u64_at = |o: usize| read_u64(&f[o..]);
        let flags = u32_at(off::FLAGS);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(format_err("flags", KNOWN_FLAGS.into(), flags.into()));
        }
        if u32_at(off::RESERVED) != 0 {
            return Err(format_err("reserved", 0, u32_at(off::RESERVED).into()));
        }
        let code = u32_at(off::DTYPE);
        let kv_dtype = dtype_from_code(code).ok_or(format_err("dtype code", 3, code.into()))?;
        let shape = ModelShape {
            num_layers: u32_at(off::NUM_LAYERS) as usize,
            num_q_heads: u32_at(off::NUM_Q_HEADS) as usize,
            num_kv_heads: u32_at(off::NUM_KV_HEADS) as usize,
            head_dim: u32_at(off::HEAD_DIM) as usize,
            kv_dtype,
        };
        let kind = match u32_at(off::KV_LORA_RANK) as usize {
            0 => KvKind::Standard,
            rank if rank < shape.head_dim => KvKind::Latent {
                kv_lora_rank: rank,
                rope_dim: shape.head_dim - rank,
            },
            rank => {
                return Err(format_err(
                    "kv_lora_rank (below head_dim)",
                    shape.head_dim as u64,
                    rank as u64,
                ))
            }
        };
        let layout = KvLayout::with_kind(shape, u32_at(off::BLOCK_SIZE) as usize, kind)?;
        let s = layout.strides();
        for (i, (what, want)) in [
            ("stride_block", s.block),
            ("stride_kv", s.kv),
            ("stride_head", s.head),
            ("stride_token", s.token),
        ]
        .into_iter()
        .enumerate()
        {
            let got = u64_at(off::STRIDES + 8 * i);
            if got != want as u64 {
                return Err(format_err(what, want as u64, got));
            }
        }
        let raw_tokens = u64_at(off::NUM_TOKENS);
        let num_tokens =
            usize::try_from(raw_tokens).map_err(|_| format_err("num_tokens", 0, raw_tokens))?;
        let want_blocks = layout.blocks_for_tokens(num_tokens) as u64;
        if u64_at(off::NUM_BLOCKS) != want_blocks {
            return Err(format_err(
                "num_blocks",
                want_blocks,
                u64_at(off::NUM_BLOCKS),
            ));
        }
        let has_token_ids = flags & FLAG_TOKEN_IDS != 0;
        let l = lens(&layout, num_tokens, has_token_ids).ok_or(format_err(
            "num_tokens (size overflows)",
            0,
            raw_tokens,
        ))?;
        for (what, want, o) in [
            ("header_len", l.header, off::HEADER_LEN),
            ("payload_len", l.payload, off::PAYLOAD_LEN),
        ] {
            if u64_at(o) != want as u64 {
                return Err(format_err(what, want as u64, u64_at(o)));
            }
        }
        Ok(ExportHeader {
            layout,
            num_tokens,
            has_token_ids,
            lens: (l.ids, l.header, l.payload),
        })
    }

    /// The sender's layout: shape, dtype, block size and strides.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Tokens exported.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Blocks of the sender's block size the tokens filled (one hash each).
    pub fn num_blocks(&self) -> usize {
        self.layout.blocks_for_tokens(self.num_tokens)
    }

    /// Whether the export carries the token ids.
    pub fn has_token_ids(&self) -> bool {
        self.has_token_ids
    }

    /// Bytes of the header (fixed part, token ids, block hashes).
    pub fn header_len(&self) -> usize {
        self.lens.1
    }

    /// Bytes of the K/V payload.
    pub fn payload_len(&self) -> usize {
        self.lens.2
    }

    /// Bytes of the whole export.
    pub fn total_len(&self) -> usize {
        self.lens.1 + self.lens.2
    }

    /// Checks that a cache of `receiver` can hold this export's K/V: every shape field
    /// and the dtype equal; the block size may differ.
    ///
    /// # Errors
    /// [`Error::ExportShape`], [`Error::ExportDType`].
    pub fn check_compatible(&self, receiver: &KvLayout) -> Result<()> {
        let (s, r) = (self.layout.shape(), receiver.shape());
        for (what, sender, receiver) in [
            ("num_layers", s.num_layers, r.num_layers),
            ("num_kv_heads", s.num_kv_heads, r.num_kv_heads),
            ("head_dim", s.head_dim, r.head_dim),
            ("num_q_heads", s.num_q_heads, r.num_q_heads),
        ] {
            if sender != receiver {
                return Err(Error::ExportShape {
                    what,
                    sender,
                    receiver,
                });
            }
        }
        if self.layout.kind() != receiver.kind() {
            return Err(Error::ExportShape {
                what: "kv_lora_rank (0: separate K and V)",
                sender: kv_lora_rank(&self.layout),
                receiver: kv_lora_rank(receiver),
            });
        }
        if s.kv_dtype != r.kv_dtype {
            return Err(Error::ExportDType {
                sender: s.kv_dtype.name(),
                receiver: r.kv_dtype.name(),
            });
        }
        Ok(())
    }
}

// ---- export ------------------------------------------------------------------------

/// Exports the first `num_tokens` tokens held by the blocks of `table` in `storage` into
/// `out`, and returns the bytes written (`exported_len(storage.layout(), num_tokens,
/// token_ids.is_some())`). Table entries past the blocks the tokens need are ignored.
///
/// # Errors
/// [`Error::ShapeMismatch`] when `token_ids` is not `num_tokens` long or `out` is too
/// short; [`Error::CorruptBlockTable`], [`Error::BlockOutOfRange`] from the storage;
/// [`Error::TooLong`] when the size overflows. The cache is never changed; `out` holds
/// unspecified bytes after an error.
pub fn export_blocks<S: Storage + ?Sized>(
    storage: &S,
    table: &[BlockId],
    num_tokens: usize,
    token_ids: Option<&[u32]>,
    out: &mut [u8],
) -> Result<usize> {
    let layout = *storage.layout();
    if let Some(ids) = token_ids {
        if ids.len() != num_tokens {
            return Err(Error::ShapeMismatch {
                what: "token ids for the exported tokens",
                expected: num_tokens,
                got: ids.len(),
            });
        }
    }
    let l = lens(&layout, num_tokens, token_ids.is_some())
        .ok_or_else(|| too_long(&layout, num_tokens))?;
    let total = l.total;
    if out.len() < total {
        return Err(Error::ShapeMismatch {
            what: "export buffer bytes (at least)",
            expected: total,
            got: out.len(),
        });
    }
    let (head, payload) = out[..total].split_at_mut(l.header);

    let half = num_tokens * row_bytes(&layout);
    let per_layer = layout.kind().vectors_per_head() * half;
    for (layer, kv) in payload.chunks_exact_mut(per_layer.max(1)).enumerate() {
        // A latent layout's one vector travels as K, with an empty V.
        let (k, v) = kv.split_at_mut(half);
        storage.read_tokens(layer, table, num_tokens, k, v)?;
    }
    if half == 0 {
        // No tokens: `chunks_exact_mut` skipped the reads, but the table is still checked.
        storage.read_tokens(0, table, 0, &mut [], &mut [])?;
    }

    let (fixed, tables) = head.split_at_mut(HEADER_FIXED_BYTES);
    let (ids_out, hashes_out) = tables.split_at_mut(l.ids);
    ids_out.fill(0);
    for (dst, id) in ids_out
        .chunks_exact_mut(4)
        .zip(token_ids.unwrap_or_default())
    {
        dst.copy_from_slice(&id.to_le_bytes());
    }
    let hashes = block_hashes(&layout, num_tokens, payload);
    for (dst, h) in hashes_out.chunks_exact_mut(8).zip(hashes) {
        dst.copy_from_slice(&h.to_le_bytes());
    }
    let tables_checksum = xxh64(tables);

    let shape = layout.shape();
    let Strides {
        block,
        kv,
        head: head_stride,
        token,
    } = layout.strides();
    fixed.fill(0);
    let mut put = |o: usize, bytes: &[u8]| fixed[o..o + bytes.len()].copy_from_slice(bytes);
    put(0, &EXPORT_MAGIC);
    put(off::VERSION, &EXPORT_VERSION.to_le_bytes());
    let flags = if token_ids.is_some() {
        FLAG_TOKEN_IDS
    } else {
        0
    };
    put(off::FLAGS, &flags.to_le_bytes());
    put(off::TABLES_CHECKSUM, &tables_checksum.to_le_bytes());
    put(off::HEADER_LEN, &(l.header as u64).to_le_bytes());
    put(off::PAYLOAD_LEN, &(l.payload as u64).to_le_bytes());
    // `ModelShape::validate` bounds every count by 2^16, so these casts are lossless.
    for (o, v) in [
        (off::NUM_LAYERS, shape.num_layers),
        (off::NUM_Q_HEADS, shape.num_q_heads),
        (off::NUM_KV_HEADS, shape.num_kv_heads),
        (off::HEAD_DIM, shape.head_dim),
        (off::BLOCK_SIZE, layout.block_size()),
        (off::KV_LORA_RANK, kv_lora_rank(&layout)),
    ] {
        put(o, &(v as u32).to_le_bytes());
    }
    put(off::DTYPE, &dtype_code(shape.kv_dtype).to_le_bytes());
    for (i, s) in [block, kv, head_stride, token].into_iter().enumerate() {
        put(off::STRIDES + 8 * i, &(s as u64).to_le_bytes());
    }
    put(off::NUM_TOKENS, &(num_tokens as u64).to_le_bytes());
    put(
        off::NUM_BLOCKS,
        &(layout.blocks_for_tokens(num_tokens) as u64).to_le_bytes(),
    );
    let checksum = fixed_checksum(fixed);
    fixed[off::HEADER_CHECKSUM..off::HEADER_CHECKSUM + 8].copy_from_slice(&checksum.to_le_bytes());
    Ok(total)
}

/// Exports every computed token of sequence `seq` of `manager`, whose K/V live in
/// `storage`, into `out`; returns the bytes written. `token_ids`, when given, travel with
/// the K/V (for the receiver's prefix cache, or to check the prompt).
///
/// # Errors
/// [`Error::UnknownSequence`]; [`Error::SequenceState`] when the sequence's bytes are not
/// readable ([`KvCache::readable_blocks`]: swapped out, or a swap in flight);
/// [`Error::InvalidConfig`] when `storage` does not have the manager's layout; as
/// [`export_blocks`].
pub fn export_sequence<S: Storage + ?Sized>(
    manager: &KvCache,
    storage: &S,
    seq: SeqId,
    token_ids: Option<&[u32]>,
    out: &mut [u8],
) -> Result<usize> {
    // A hybrid cache's sequences go out through `export_group_sequence`.
    manager.one_group("export_sequence")?;
    check_storage(manager, storage)?;
    let (table, computed) = manager.readable_blocks(seq)?;
    if table.first() == Some(&BlockId::RELEASED) {
        return Err(Error::Unsupported(format!(
            "export of {seq}: its sliding window gave its first blocks back"
        )));
    }
    export_blocks(storage, table, computed, token_ids, out)
}

fn check_storage<S: Storage + ?Sized>(manager: &KvCache, storage: &S) -> Result<()> {
    if storage.layout() != manager.layout() {
        return Err(Error::config(
            "storage",
            format!(
                "storage layout {:?} differs from the manager's {:?}",
                storage.layout(),
                manager.layout()
            ),
        ));
    }
    if storage.num_blocks() < manager.num_blocks() {
        return Err(Error::config(
            "storage",
            format!(
                "storage holds {} blocks, the manager hands out {}",
                storage.num_blocks(),
                manager.num_blocks()
            ),
        ));
    }
    Ok(())
}

// ---- import ------------------------------------------------------------------------

/// A validated export: header parsed, every checksum passed.
#[derive(Debug, Clone, Copy)]
pub struct ExportView<'a> {
    header: ExportHeader,
    /// Exactly the export's bytes.
    bytes: &'a [u8],
}

impl<'a> ExportView<'a> {
    /// Validates an export at the start of `buf` (trailing bytes are ignored): the
    /// header as [`ExportHeader::parse`], then the length, the token ids and block
    /// hashes against their checksum, and every block of the payload against its hash.
    ///
    /// # Errors
    /// As [`ExportHeader::parse`]; [`Error::ExportTruncated`] when `buf` is shorter than
    /// the header says; [`Error::Checksum`] naming the tables or the first bad block.
    pub fn parse(buf: &'a [u8]) -> Result<Self> {
        let header = ExportHeader::parse(buf)?;
        let total = header.total_len();
        if buf.len() < total {
            return Err(Error::ExportTruncated {
                needed: total,
                got: buf.len(),
            });
        }
        let bytes = &buf[..total];
        let tables = &bytes[HEADER_FIXED_BYTES..header.header_len()];
        let stored = read_u64(&bytes[off::TABLES_CHECKSUM..]);
        let computed = xxh64(tables);
        if stored != computed {
            return Err(Error::Checksum {
                what: "KV export token ids and block hashes".into(),
                expected: stored,
                got: computed,
            });
        }
        let view = ExportView { header, bytes };
        let computed = block_hashes(&header.layout, header.num_tokens, view.payload());
        if let Some((b, (stored, got))) = view
            .block_hashes()
            .zip(computed)
            .enumerate()
            .find(|(_, (s, c))| s != c)
        {
            return Err(Error::Checksum {
                what: format!("KV export payload, block {b}"),
                expected: stored,
                got,
            });
        }
        Ok(view)
    }

    /// The header.
    pub fn header(&self) -> &ExportHeader {
        &self.header
    }

    /// The export's bytes, exactly [`ExportHeader::total_len`] of them.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The token ids (empty when the export carries none).
    pub fn token_ids(&self) -> impl ExactSizeIterator<Item = u32> + 'a {
        let n = if self.header.has_token_ids {
            self.header.num_tokens
        } else {
            0
        };
        self.bytes[HEADER_FIXED_BYTES..HEADER_FIXED_BYTES + 4 * n]
            .chunks_exact(4)
            .map(read_u32)
    }

    /// The content hash of each sender block (see the module docs).
    pub fn block_hashes(&self) -> impl ExactSizeIterator<Item = u64> + 'a {
        let start = HEADER_FIXED_BYTES + self.header.lens.0;
        self.bytes[start..self.header.header_len()]
            .chunks_exact(8)
            .map(read_u64)
    }

    /// The K/V payload.
    pub fn payload(&self) -> &'a [u8] {
        &self.bytes[self.header.header_len()..]
    }

    /// One layer's K and V, each `[num_tokens, num_kv_heads, head_dim]` (a latent
    /// layout: its `[num_tokens, head_dim]` latent vectors and an empty V), or `None`
    /// for a layer past the last.
    pub fn layer(&self, layer: usize) -> Option<(&'a [u8], &'a [u8])> {
        if layer >= self.header.layout.num_layers() {
            return None;
        }
        let half = self.header.num_tokens * row_bytes(&self.header.layout);
        let per_layer = self.header.layout.kind().vectors_per_head() * half;
        let kv = &self.payload()[layer * per_layer..(layer + 1) * per_layer];
        Some(kv.split_at(half))
    }

    /// Admits the exported tokens as a new sequence `seq` of `manager` and writes their
    /// K/V into `storage`, re-paging them to the receiver's block size.
    ///
    /// # Errors
    /// [`Error::ExportShape`], [`Error::ExportDType`]; [`Error::InvalidConfig`] when
    /// `storage` does not have the manager's layout; [`Error::DuplicateSequence`],
    /// [`Error::TooLong`], [`Error::OutOfBlocks`] from the admission. All of these are
    /// found before anything is allocated. Should the storage fail a write after the
    /// admission (a device fault), the sequence is freed again before the error
    /// returns, so only the manager's peak-usage counter can show it was there.
    pub fn import_into<S: Storage + ?Sized>(
        &self,
        manager: &mut KvCache,
        storage: &mut S,
        seq: SeqId,
    ) -> Result<ImportedSequence> {
        self.header.check_compatible(manager.layout())?;
        check_storage(manager, storage)?;
        let n = self.header.num_tokens;
        let mut slots = Vec::with_capacity(n);
        manager.admit(seq, n, &mut slots)?;
        for layer in 0..self.header.layout.num_layers() {
            let written = match self.layer(layer) {
                Some((k, v)) => storage.write_slots(layer, &slots, k, v),
                None => Ok(()),
            };
            if let Err(e) = written {
                // The freshly admitted sequence owns its blocks alone: freeing it cannot
                // fail, and if it did, the write error is still the one to report.
                let _ = manager.free(seq);
                return Err(e);
            }
        }
        Ok(ImportedSequence {
            seq,
            num_tokens: n,
            table: manager.block_table(seq)?.to_vec(),
            token_ids: self
                .header
                .has_token_ids
                .then(|| self.token_ids().collect()),
        })
    }

    /// [`Self::import_into`] through the receiver's prefix cache: the exported token ids
    /// are admitted with [`KvCache::admit_tokens`], so a prefix the receiver
    /// already caches is shared instead of written again, and the imported full blocks
    /// are registered for later requests (a decode instance can serve the next turn of a
    /// conversation from them). Only the uncached tokens' K/V is written.
    ///
    /// # Errors
    /// [`Error::ExportFormat`] when the export carries no token ids; otherwise as
    /// [`Self::import_into`] and [`KvCache::admit_tokens`]. If the storage fails
    /// a write, the sequence is freed and every evictable cached block is evicted, so a
    /// block registered by this call but never written cannot be hit later.
    pub fn import_into_cache<S: Storage + ?Sized>(
        &self,
        manager: &mut KvCache,
        storage: &mut S,
        seq: SeqId,
        opts: &crate::pool::prefix::AdmitOptions<'_>,
    ) -> Result<(ImportedSequence, usize)> {
        if !self.header.has_token_ids {
            return Err(Error::ExportFormat {
                what: "token ids (needed to use the prefix cache)",
                expected: 1,
                got: 0,
            });
        }
        self.header.check_compatible(manager.layout())?;
        check_storage(manager, storage)?;
        let n = self.header.num_tokens;
        let tokens: Vec<u32> = self.token_ids().collect();
        let mut slots = Vec::with_capacity(n);
        let cached = manager
            .admit_tokens(seq, &tokens, opts, &mut slots)?
            .cached_tokens;
        let row = row_bytes(&self.header.layout);
        for layer in 0..self.header.layout.num_layers() {
            let written = match self.layer(layer) {
                Some((k, v)) => {
                    // A latent layout's V is empty.
                    storage.write_slots(
                        layer,
                        &slots,
                        &k[cached * row..],
                        &v[(cached * row).min(v.len())..],
                    )
                }
                None => Ok(()),
            };
            if let Err(e) = written {
                let _ = manager.free(seq);
                manager.evict_cached(usize::MAX);
                return Err(e);
            }
        }
        let imported = ImportedSequence {
            seq,
            num_tokens: n,
            table: manager.block_table(seq)?.to_vec(),
            token_ids: Some(tokens),
        };
        Ok((imported, cached))
    }
}

/// A sequence created by an import.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedSequence {
    /// The new sequence.
    pub seq: SeqId,
    /// Tokens it holds.
    pub num_tokens: usize,
    /// Its block table on the receiving manager.
    pub table: Vec<BlockId>,
    /// The token ids, when the export carried them.
    pub token_ids: Option<Vec<u32>>,
}

/// Validates the export at the start of `buf` ([`ExportView::parse`]) and imports it as
/// sequence `seq` ([`ExportView::import_into`]). A buffer that fails any check, or does
/// not fit the receiver, allocates nothing.
///
/// # Errors
/// As [`ExportView::parse`] and [`ExportView::import_into`].
pub fn import_sequence<S: Storage + ?Sized>(
    manager: &mut KvCache,
    storage: &mut S,
    seq: SeqId,
    buf: &[u8],
) -> Result<ImportedSequence> {
    ExportView::parse(buf)?.import_into(manager, storage, seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh64_matches_reference_vectors() {
        // Reference values from the C implementation (python-xxhash 4.1).
        assert_eq!(xxh64(b""), 0xef46_db37_51d8_e999);
        assert_eq!(xxh64(b"abc"), 0x44bc_2cf5_ad77_0999);
        assert_eq!(
            xxh64(b"Nobody inspects the spammish repetition"),
            0xfbce_a83c_8a37_8bf1
        );
        let bytes: Vec<u8> = (0..=255u8).collect();
        assert_eq!(xxh64(&bytes[..37]), 0xd93f_a2df_ee5c_24c9);
        let long: Vec<u8> = bytes.iter().copied().cycle().take(768).collect();
        assert_eq!(xxh64(&long), 0x8e03_c838_c596_036f);
        // Streaming in uneven pieces gives the one-shot hash.
        for step in [1, 3, 7, 31, 32, 33, 100] {
            let mut h = xxhash_rust::xxh64::Xxh64::new(0);
            for piece in long.chunks(step) {
                h.update(piece);
            }
            assert_eq!(h.digest(), 0x8e03_c838_c596_036f, "step {step}");
        }
    }

    #[test]
    fn dtype_codes_round_trip() {
        for d in DType::ALL {
            assert_eq!(dtype_from_code(dtype_code(d)), Some(d));
        }
        assert_eq!(dtype_from_code(4), None);
    }
}
