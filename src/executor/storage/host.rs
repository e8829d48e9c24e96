//! [`HostStorage`]: the arena in aligned host memory.

use super::copy::{for_each_token_run, table_places};
use super::{check_token_io, validate_copy_plan, validate_swap_plan, Storage};
use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::plans::{CopyPlan, SwapDirection, SwapPlan};
use crate::layout::{Kv, KvLayout, Slot};

/// Alignment of every region: a cache line, and a multiple of every vector width used.
pub const REGION_ALIGN: usize = 64;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; REGION_ALIGN]);

/// A zero-initialised, 64-byte-aligned byte buffer.
#[derive(Clone)]
pub(crate) struct AlignedBytes {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedBytes {
    pub(crate) fn zeroed(len: usize) -> Self {
        AlignedBytes {
            lines: vec![Line([0; REGION_ALIGN]); len.div_ceil(REGION_ALIGN)],
            len,
        }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `lines` is `len.div_ceil(64)` initialised 64-byte `Line`s with no
        // padding (repr(C) over a byte array), so its first `len` bytes are initialised
        // `u8`s inside one allocation, borrowed for the lifetime of `&self`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.len) }
    }

    /// Resizes to `len` bytes, keeping the common prefix; new bytes are zero.
    pub(crate) fn resize(&mut self, len: usize) {
        self.lines
            .resize(len.div_ceil(REGION_ALIGN), Line([0; REGION_ALIGN]));
        self.lines.shrink_to_fit();
        let old = self.len;
        self.len = len;
        if len > old {
            // The tail of the last old line may hold stale bytes from an earlier shrink.
            self.as_mut_slice()[old..].fill(0);
        }
    }
}

impl std::fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBytes")
            .field("len", &self.len)
            .finish()
    }
}

/// The KV arena in host memory: one 64-byte-aligned region per layer, allocated once.
#[derive(Debug, Clone)]
pub struct HostStorage {
    layout: KvLayout,
    num_blocks: usize,
    regions: Vec<AlignedBytes>,
    num_host_blocks: usize,
    /// The host tier: one region per layer, same layout.
    host_regions: Vec<AlignedBytes>,
}

impl HostStorage {
    /// Allocates `num_blocks` blocks of `layout`, zeroed.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the size overflows.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Result<Self> {
        let bytes = num_blocks
            .checked_mul(layout.block_bytes_per_layer())
            .ok_or_else(|| Error::config("num_blocks", format!("{num_blocks} blocks overflow")))?;
        let regions = (0..layout.num_layers())
            .map(|_| AlignedBytes::zeroed(bytes))
            .collect();
        Ok(HostStorage {
            layout,
            num_blocks,
            regions,
            num_host_blocks: 0,
            host_regions: Vec::new(),
        })
    }

    /// Like [`Self::new`], plus a host tier of `num_host_blocks` blocks to swap to.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when a size overflows.
    pub fn with_host_tier(
        layout: KvLayout,
        num_blocks: usize,
        num_host_blocks: usize,
    ) -> Result<Self> {
        let mut s = Self::new(layout, num_blocks)?;
        let bytes = num_host_blocks
            .checked_mul(layout.block_bytes_per_layer())
            .ok_or_else(|| {
                Error::config(
                    "num_host_blocks",
                    format!("{num_host_blocks} blocks overflow"),
                )
            })?;
        s.host_regions = (0..layout.num_layers())
            .map(|_| AlignedBytes::zeroed(bytes))
            .collect();
        s.num_host_blocks = num_host_blocks;
        Ok(s)
    }

    /// One layer's host-tier region.
    ///
    /// # Panics
    /// When `layer` is not below the number of layers or there is no host tier.
    pub fn host_region(&self, layer: usize) -> &[u8] {
        self.host_regions[layer].as_slice()
    }

    /// Bytes of the whole arena.
    pub fn total_bytes(&self) -> usize {
        self.num_blocks * self.layout.block_bytes()
    }

    /// One layer's region.
    ///
    /// # Panics
    /// When `layer` is not below the number of layers.
    pub fn region(&self, layer: usize) -> &[u8] {
        self.regions[layer].as_slice()
    }

    /// One layer's region, mutably.
    ///
    /// # Panics
    /// When `layer` is not below the number of layers.
    pub fn region_mut(&mut self, layer: usize) -> &mut [u8] {
        self.regions[layer].as_mut_slice()
    }

    /// The bytes of one block in one layer.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], [`Error::ShapeMismatch`] for a bad layer.
    pub fn block_bytes(&self, layer: usize, block: BlockId) -> Result<&[u8]> {
        self.check_block(block)?;
        let region = self.regions.get(layer).ok_or(Error::ShapeMismatch {
            what: "layer index",
            expected: self.layout.num_layers(),
            got: layer,
        })?;
        let n = self.layout.block_bytes_per_layer();
        let start = self.layout.block_byte_offset(block);
        Ok(&region.as_slice()[start..start + n])
    }

    /// Checks a host-tier block id and a whole-block buffer length; returns the bytes
    /// of the block per layer.
    fn check_host_block_io(&self, block: BlockId, len: usize) -> Result<usize> {
        super::check_host_block_io(&self.layout, self.num_host_blocks, block, len)?;
        Ok(self.layout.block_bytes_per_layer())
    }

    fn check_block(&self, block: BlockId) -> Result<()> {
        if block.index() < self.num_blocks {
            Ok(())
        } else {
            Err(Error::BlockOutOfRange {
                block,
                num_blocks: self.num_blocks,
            })
        }
    }

    /// Resizes every region to `num_blocks` blocks by reallocation, keeping the contents
    /// of the blocks that remain; new blocks are zero.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the size overflows; nothing changed.
    pub fn resize_blocks(&mut self, num_blocks: usize) -> Result<()> {
        let bytes = num_blocks
            .checked_mul(self.layout.block_bytes_per_layer())
            .ok_or_else(|| Error::config("num_blocks", format!("{num_blocks} blocks overflow")))?;
        for r in &mut self.regions {
            r.resize(bytes);
        }
        self.num_blocks = num_blocks;
        Ok(())
    }
}

impl Storage for HostStorage {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn copy_blocks(&mut self, plan: &CopyPlan) -> Result<()> {
        validate_copy_plan(plan, self.num_blocks)?;
        let n = self.layout.block_bytes_per_layer();
        for region in &mut self.regions {
            let bytes = region.as_mut_slice();
            for c in plan.copies() {
                let src = self.layout.block_byte_offset(c.src);
                let dst = self.layout.block_byte_offset(c.dst);
                bytes.copy_within(src..src + n, dst);
            }
        }
        Ok(())
    }

    fn write_slots(&mut self, layer: usize, slots: &[Slot], k: &[u8], v: &[u8]) -> Result<()> {
        check_token_io(&self.layout, layer, slots.len(), k.len(), v.len())?;
        for &slot in slots {
            self.check_block(self.layout.split_slot(slot).0)?;
        }
        let region = self.regions[layer].as_mut_slice();
        let places = slots.iter().map(|&slot| self.layout.split_slot(slot));
        for_each_token_run(&self.layout, places, |run| {
            let data = match run.kv {
                Kv::K => k,
                Kv::V => v,
            };
            region[run.region].copy_from_slice(&data[run.buf]);
        });
        Ok(())
    }

    fn num_host_blocks(&self) -> usize {
        self.num_host_blocks
    }

    fn swap(&mut self, plan: &SwapPlan) -> Result<()> {
        validate_swap_plan(plan, self.num_blocks, self.num_host_blocks)?;
        let n = self.layout.block_bytes_per_layer();
        for (dev, host) in self.regions.iter_mut().zip(&mut self.host_regions) {
            let (dev, host) = (dev.as_mut_slice(), host.as_mut_slice());
            for (src, dst, len) in plan.runs() {
                let (src, dst, bytes) = (src as usize * n, dst as usize * n, len as usize * n);
                match plan.direction() {
                    SwapDirection::Out => {
                        host[dst..dst + bytes].copy_from_slice(&dev[src..src + bytes])
                    }
                    SwapDirection::In => {
                        dev[dst..dst + bytes].copy_from_slice(&host[src..src + bytes])
                    }
                }
            }
        }
        Ok(())
    }

    fn swap_layer(&mut self, layer: usize, plan: &SwapPlan) -> Result<()> {
        validate_swap_plan(plan, self.num_blocks, self.num_host_blocks)?;
        let layers = self.layout.num_layers();
        let (Some(dev), Some(host)) = (
            self.regions.get_mut(layer),
            self.host_regions.get_mut(layer),
        ) else {
            return Err(Error::ShapeMismatch {
                what: "layer index",
                expected: layers,
                got: layer,
            });
        };
        let n = self.layout.block_bytes_per_layer();
        let (dev, host) = (dev.as_mut_slice(), host.as_mut_slice());
        for (src, dst, len) in plan.runs() {
            let (src, dst, bytes) = (src as usize * n, dst as usize * n, len as usize * n);
            match plan.direction() {
                SwapDirection::Out => {
                    host[dst..dst + bytes].copy_from_slice(&dev[src..src + bytes])
                }
                SwapDirection::In => dev[dst..dst + bytes].copy_from_slice(&host[src..src + bytes]),
            }
        }
        Ok(())
    }

    fn read_host_block(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        let n = self.check_host_block_io(block, out.len())?;
        let start = self.layout.block_byte_offset(block);
        for (region, dst) in self.host_regions.iter().zip(out.chunks_exact_mut(n)) {
            dst.copy_from_slice(&region.as_slice()[start..start + n]);
        }
        Ok(())
    }

    fn write_host_block(&mut self, block: BlockId, data: &[u8]) -> Result<()> {
        let n = self.check_host_block_io(block, data.len())?;
        let start = self.layout.block_byte_offset(block);
        for (region, src) in self.host_regions.iter_mut().zip(data.chunks_exact(n)) {
            region.as_mut_slice()[start..start + n].copy_from_slice(src);
        }
        Ok(())
    }

    fn resize(&mut self, num_blocks: usize) -> Result<()> {
        self.resize_blocks(num_blocks)
    }

    fn read_tokens(
        &self,
        layer: usize,
        table: &[BlockId],
        num_tokens: usize,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<()> {
        check_token_io(&self.layout, layer, num_tokens, k.len(), v.len())?;
        if self.layout.blocks_for_tokens(num_tokens) > table.len() {
            return Err(Error::CorruptBlockTable(format!(
                "{num_tokens} tokens need {} blocks, the table has {}",
                self.layout.blocks_for_tokens(num_tokens),
                table.len()
            )));
        }
        for &b in &table[..self.layout.blocks_for_tokens(num_tokens)] {
            self.check_block(b)?;
        }
        let region = self.regions[layer].as_slice();
        let places = table_places(&self.layout, table.iter().copied(), num_tokens);
        for_each_token_run(&self.layout, places, |run| {
            let out = match run.kv {
                Kv::K => &mut *k,
                Kv::V => &mut *v,
            };
            out[run.buf].copy_from_slice(&region[run.region]);
        });
        Ok(())
    }
}
