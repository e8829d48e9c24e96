//! The one place that knows where a byte of K or V lives.
//!
//! The arena is layer-major: each layer owns one region (one contiguous tensor, the
//! shape engines and kernels expect), and inside a region blocks follow each other:
//!
//! ```text
//! region[layer] = [block][K|V][kv_head][token][dim]
//! ```
//!
//! A latent (MLA) layout ([`KvKind::Latent`]) has one vector per token and no K/V
//! split: `region[layer] = [block][token][kv_lora_rank + rope_dim]`, a block being
//! `block_size` such vectors. Its `kv` stride is 0: [`Kv::V`] addresses the same
//! vector as [`Kv::K`], because the values of the absorbed form are the first
//! `kv_lora_rank` elements of the cached latent.
//!
//! So a page of one head (`block_size` tokens x `head_dim`) is one contiguous run, and
//! consecutive block ids are consecutive bytes, which lets copy plans merge runs.
//! Because a block's offset inside its region does not depend on how many blocks the
//! region holds, an arena grows or shrinks at its tail without moving live data.

pub mod convert;
pub mod plans;
pub mod shape;

use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::shape::{DType, KvKind, ModelShape};

/// Largest block size (tokens per page) the layout accepts.
pub const MAX_BLOCK_SIZE: usize = 1024;

/// K or V half of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kv {
    /// Keys.
    K = 0,
    /// Values.
    V = 1,
}

/// Element strides inside one layer region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Strides {
    /// Elements from one block to the next.
    pub block: usize,
    /// Elements from a block's K half to its V half (0 for a latent layout, whose
    /// values are part of the one cached vector).
    pub kv: usize,
    /// Elements from one KV head to the next inside a half.
    pub head: usize,
    /// Elements from one token to the next inside a head's page.
    pub token: usize,
}

/// Addressing of a paged KV arena: shape, block size, strides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    shape: ModelShape,
    kind: KvKind,
    block_size: usize,
    /// `log2(block_size)` when it is a power of two (as every engine's is), else
    /// [`NOT_POW2`]: the per-token paths then shift instead of dividing.
    block_shift: u32,
    strides: Strides,
}

/// [`KvLayout::block_shift`] of a block size that is not a power of two.
const NOT_POW2: u32 = u32::MAX;

impl KvLayout {
    /// A layout for `shape` with pages of `block_size` tokens.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an invalid shape or a block size of 0 or above
    /// [`MAX_BLOCK_SIZE`].
    pub fn new(shape: ModelShape, block_size: usize) -> Result<Self> {
        Self::with_kind(shape, block_size, KvKind::Standard)
    }

    /// A layout of the given kind. For [`KvKind::Latent`] the shape must have one KV
    /// head of `head_dim = kv_lora_rank + rope_dim` ([`ModelShape::latent`] builds it);
    /// a block is then `[block_size][head_dim]` per layer.
    ///
    /// ```
    /// use pagedkv::layout::shape::{DType, KvKind, ModelShape};
    /// use pagedkv::KvLayout;
    ///
    /// // DeepSeek-V3: 61 layers, 128 query heads, latent 512 + rope 64, bf16.
    /// let shape = ModelShape::latent(61, 128, 512, 64, DType::BF16);
    /// let kind = KvKind::Latent { kv_lora_rank: 512, rope_dim: 64 };
    /// let layout = KvLayout::with_kind(shape, 64, kind)?;
    /// assert_eq!(layout.token_bytes(), 61 * 576 * 2); // 70,272 bytes per token
    /// assert_eq!(layout.block_bytes_per_layer(), 64 * 576 * 2);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Self::new`]; [`Error::InvalidConfig`] for a latent kind whose
    /// `kv_lora_rank` is 0 or whose shape is not one head of the latent width.
    pub fn with_kind(shape: ModelShape, block_size: usize, kind: KvKind) -> Result<Self> {
        shape.validate()?;
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(Error::config(
                "block_size",
                format!("{block_size} tokens; must be in 1..={MAX_BLOCK_SIZE}"),
            ));
        }
        if let KvKind::Latent {
            kv_lora_rank,
            rope_dim,
        } = kind
        {
            if kv_lora_rank == 0 {
                return Err(Error::config("kv_lora_rank", "must be positive"));
            }
            if shape.num_kv_heads != 1 || Some(shape.head_dim) != kind.latent_dim() {
                return Err(Error::config(
                    "head_dim",
                    format!(
                        "a latent cache is one vector of kv_lora_rank {kv_lora_rank} + rope_dim {rope_dim} per token; the shape has {} KV heads of {} (use ModelShape::latent)",
                        shape.num_kv_heads, shape.head_dim
                    ),
                ));
            }
        }
        let token = shape.head_dim;
        let head = block_size * token;
        let half = shape.num_kv_heads * head;
        let (kv, block) = match kind {
            KvKind::Standard => (half, 2 * half),
            KvKind::Latent { .. } => (0, half),
        };
        Ok(KvLayout {
            shape,
            kind,
            block_size,
            block_shift: if block_size.is_power_of_two() {
                block_size.trailing_zeros()
            } else {
                NOT_POW2
            },
            strides: Strides {
                block,
                kv,
                head,
                token,
            },
        })
    }

    /// The model shape.
    pub const fn shape(&self) -> &ModelShape {
        &self.shape
    }

    /// Standard K/V or latent (MLA).
    pub const fn kind(&self) -> KvKind {
        self.kind
    }

    /// Whether this is a latent (MLA) layout.
    pub const fn is_latent(&self) -> bool {
        matches!(self.kind, KvKind::Latent { .. })
    }

    /// Tokens per block.
    pub const fn block_size(&self) -> usize {
        self.block_size
    }

    /// Element type.
    pub const fn dtype(&self) -> DType {
        self.shape.kv_dtype
    }

    /// Layers, i.e. regions.
    pub const fn num_layers(&self) -> usize {
        self.shape.num_layers
    }

    /// Element strides inside a layer region.
    pub const fn strides(&self) -> Strides {
        self.strides
    }

    /// Elements of one block in one layer (K and V, all KV heads; or the latent
    /// vectors).
    pub const fn block_elems_per_layer(&self) -> usize {
        self.strides.block
    }

    /// Bytes of one block in one layer.
    pub const fn block_bytes_per_layer(&self) -> usize {
        self.strides.block * self.shape.kv_dtype.size_bytes()
    }

    /// Bytes of one block over all layers.
    pub const fn block_bytes(&self) -> usize {
        self.block_bytes_per_layer() * self.shape.num_layers
    }

    /// Bytes of one token's K and V (or latent vector) over all layers.
    pub const fn token_bytes(&self) -> usize {
        self.kind.vectors_per_head()
            * self.shape.num_layers
            * self.shape.num_kv_heads
            * self.shape.head_dim
            * self.shape.kv_dtype.size_bytes()
    }

    /// Bytes of one layer region holding `num_blocks` blocks.
    pub const fn region_bytes(&self, num_blocks: usize) -> usize {
        num_blocks * self.block_bytes_per_layer()
    }

    /// How many whole blocks fit in `budget_bytes` (all layers).
    pub const fn blocks_for_budget(&self, budget_bytes: usize) -> usize {
        budget_bytes / self.block_bytes()
    }

    /// Blocks needed to hold `tokens` tokens.
    #[inline]
    pub const fn blocks_for_tokens(&self, tokens: usize) -> usize {
        if self.block_shift == NOT_POW2 {
            tokens.div_ceil(self.block_size)
        } else {
            (tokens >> self.block_shift) + (tokens & (self.block_size - 1) != 0) as usize
        }
    }

    /// The table index of token position `pos` (`pos / block_size`, a shift when the
    /// block size is a power of two: this is on the per-token path).
    #[inline]
    pub const fn block_index(&self, pos: usize) -> usize {
        if self.block_shift == NOT_POW2 {
            pos / self.block_size
        } else {
            pos >> self.block_shift
        }
    }

    /// The offset of token position `pos` in its block (`pos % block_size`).
    #[inline]
    pub const fn block_offset(&self, pos: usize) -> usize {
        if self.block_shift == NOT_POW2 {
            pos % self.block_size
        } else {
            pos & (self.block_size - 1)
        }
    }

    /// Element offset, inside a layer region, of `(block, kv, head, token, dim)`.
    ///
    /// In a latent layout `head` is 0 and `kv` does not matter (its stride is 0).
    ///
    /// Arguments are not range-checked here: callers validate block ids against the
    /// arena, and `head`, `token`, `dim` against the shape, before addressing memory.
    #[inline]
    pub const fn elem_offset(&self, block: BlockId, kv: Kv, head: usize, token: usize) -> usize {
        let s = self.strides;
        block.index() * s.block + kv as usize * s.kv + head * s.head + token * s.token
    }

    /// Byte offset, inside a layer region, of the start of `block`.
    #[inline]
    pub const fn block_byte_offset(&self, block: BlockId) -> usize {
        block.index() * self.block_bytes_per_layer()
    }

    /// The block and in-block position holding token `pos` of a table.
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when the table does not cover `pos`.
    #[inline]
    pub fn locate(&self, table: &[BlockId], pos: usize) -> Result<(BlockId, usize)> {
        let b = table.get(self.block_index(pos)).ok_or_else(|| {
            Error::CorruptBlockTable(format!(
                "token {pos} needs entry {} but the table has {}",
                pos / self.block_size,
                table.len()
            ))
        })?;
        Ok((*b, self.block_offset(pos)))
    }

    /// The flat slot of `(block, offset)`: `block * block_size + offset`.
    #[inline]
    pub const fn slot(&self, block: BlockId, offset: usize) -> Slot {
        Slot(block.0 as u64 * self.block_size as u64 + offset as u64)
    }

    /// Splits a slot into `(block, offset)`.
    #[inline]
    pub const fn split_slot(&self, slot: Slot) -> (BlockId, usize) {
        let bs = self.block_size as u64;
        // A block index past the u32 id space cannot be in any arena: saturate so the
        // caller's range check rejects it instead of seeing a wrapped, valid-looking id.
        let q = slot.0 / bs;
        let block = if q > u32::MAX as u64 {
            u32::MAX
        } else {
            q as u32
        };
        (BlockId(block), (slot.0 % bs) as usize)
    }
}

/// A token's place in the arena: `block * block_size + offset` (vLLM's slot mapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct Slot(pub u64);

/// Padded block tables: `[batch, max_blocks]` row-major plus context lengths (the form
/// vLLM's kernels take). Entries past a sequence's last block are 0 and never read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PaddedTables {
    /// `batch * max_blocks` block ids, row-major.
    pub tables: Vec<u32>,
    /// Tokens of each sequence.
    pub context_lens: Vec<u32>,
    /// Rows.
    pub batch: usize,
    /// Columns (the longest table in the batch).
    pub max_blocks: usize,
}

impl PaddedTables {
    /// The table row of sequence `i` of the batch.
    pub fn row(&self, i: usize) -> &[u32] {
        &self.tables[i * self.max_blocks..(i + 1) * self.max_blocks]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ModelShape {
        ModelShape {
            num_layers: 2,
            num_q_heads: 8,
            num_kv_heads: 2,
            head_dim: 4,
            kv_dtype: DType::F16,
        }
    }

    #[test]
    fn strides_follow_hnd_order() {
        let l = KvLayout::new(shape(), 16).unwrap();
        let s = l.strides();
        assert_eq!((s.token, s.head, s.kv, s.block), (4, 64, 128, 256));
        assert_eq!(l.block_bytes_per_layer(), 512);
        assert_eq!(l.block_bytes(), 1024);
        assert_eq!(l.token_bytes(), 2 * 2 * 2 * 4 * 2);
        assert_eq!(l.block_bytes(), l.token_bytes() * 16);
        assert_eq!(
            l.elem_offset(BlockId(3), Kv::V, 1, 5),
            3 * 256 + 128 + 64 + 20
        );
    }

    #[test]
    fn slots_round_trip() {
        let l = KvLayout::new(shape(), 16).unwrap();
        let table = [BlockId(7), BlockId(2)];
        let (b, o) = l.locate(&table, 17).unwrap();
        assert_eq!((b, o), (BlockId(2), 1));
        assert_eq!(l.split_slot(l.slot(b, o)), (b, o));
        assert!(matches!(
            l.locate(&table, 32),
            Err(Error::CorruptBlockTable(_))
        ));
    }

    #[test]
    fn latent_layout_is_one_vector_per_token() {
        // DeepSeek-V3 in bf16: 61 layers x 576 x 2 bytes per token.
        let kind = KvKind::Latent {
            kv_lora_rank: 512,
            rope_dim: 64,
        };
        let shape = ModelShape::latent(61, 128, 512, 64, DType::BF16);
        let l = KvLayout::with_kind(shape, 16, kind).unwrap();
        assert!(l.is_latent() && l.kind() == kind);
        let s = l.strides();
        assert_eq!(
            (s.token, s.head, s.kv, s.block),
            (576, 16 * 576, 0, 16 * 576)
        );
        assert_eq!(l.token_bytes(), 70_272);
        assert_eq!(l.block_bytes_per_layer(), 16 * 576 * 2);
        assert_eq!(l.block_bytes(), l.token_bytes() * 16);
        assert_eq!(
            l.elem_offset(BlockId(3), Kv::K, 0, 5),
            3 * 16 * 576 + 5 * 576
        );
        assert_eq!(
            l.elem_offset(BlockId(3), Kv::V, 0, 5),
            l.elem_offset(BlockId(3), Kv::K, 0, 5)
        );
        // The standard layout of the same shape is twice as large.
        let std = KvLayout::new(shape, 16).unwrap();
        assert_eq!(std.token_bytes(), 2 * l.token_bytes());
        // The shape must be one head of the latent width.
        for bad in [
            ModelShape::latent(61, 128, 512, 32, DType::BF16),
            ModelShape {
                num_kv_heads: 2,
                ..shape
            },
        ] {
            assert!(matches!(
                KvLayout::with_kind(bad, 16, kind),
                Err(Error::InvalidConfig {
                    field: "head_dim",
                    ..
                })
            ));
        }
        let zero = KvKind::Latent {
            kv_lora_rank: 0,
            rope_dim: 576,
        };
        assert!(KvLayout::with_kind(shape, 16, zero).is_err());
    }

    #[test]
    fn bad_block_sizes_are_errors() {
        for bs in [0, MAX_BLOCK_SIZE + 1] {
            assert!(matches!(
                KvLayout::new(shape(), bs),
                Err(Error::InvalidConfig {
                    field: "block_size",
                    ..
                })
            ));
        }
    }
}
