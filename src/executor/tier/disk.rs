//! [`DiskTier`]: host-tier blocks spilled to one preallocated file.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{Error, Result};
use crate::ids::DiskSlot;
use crate::layout::KvLayout;
use xxhash_rust::xxh64::xxh64 as xxh64_seeded;

/// Slots start at multiples of this many bytes (a page, and a multiple of every
/// common filesystem block), so one slot never straddles two pages needlessly.
pub const DISK_SLOT_ALIGN: u64 = 4096;

/// One preallocated file cut into block-aligned slots, written and read with
/// positional I/O (`pwrite`/`pread`), every slot checksummed.
///
/// It only moves bytes; which slot holds what is the manager's bookkeeping
/// ([`crate::KvCache::plan_spill`]). The checksum of each written slot is
/// kept in memory and checked on every read, so a torn write, a bad sector or a file
/// changed behind the tier's back is an [`Error::Checksum`], never wrong K/V.
#[derive(Debug)]
pub struct DiskTier {
    slots: SlotFile,
    /// Checksum of the bytes last written to each slot; `None` until written.
    checksums: Vec<Option<u64>>,
}

/// The slot arithmetic and positional I/O of a file of block slots, without any
/// bookkeeping of what the slots hold: shared by [`DiskTier`] (checksums in memory)
/// and [`super::DiskPrefixStore`] (checksums in its journal).
#[derive(Debug)]
pub(crate) struct SlotFile {
    file: File,
    block_bytes: usize,
    slot_stride: u64,
    num_slots: usize,
}

impl SlotFile {
    /// Slots of `layout`'s blocks over `file`, which is used as is.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the size overflows or there are more slots than
    /// `u32` ids.
    pub(crate) fn new(file: File, layout: &KvLayout, num_slots: usize) -> Result<Self> {
        let slot_stride = Self::checked_stride(layout, num_slots)?;
        Ok(SlotFile {
            file,
            block_bytes: layout.block_bytes(),
            slot_stride,
            num_slots,
        })
    }

    /// Bytes a file of `num_slots` slots of `layout` spans.
    ///
    /// # Errors
    /// As [`Self::new`].
    pub(crate) fn checked_file_bytes(layout: &KvLayout, num_slots: usize) -> Result<u64> {
        Ok(Self::checked_stride(layout, num_slots)? * num_slots as u64)
    }

    fn checked_stride(layout: &KvLayout, num_slots: usize) -> Result<u64> {
        if num_slots >= u32::MAX as usize {
            return Err(Error::config(
                "num_disk_slots",
                format!("{num_slots} exceeds the u32 id space"),
            ));
        }
        let block_bytes = layout.block_bytes();
        let slot_stride = (block_bytes as u64).div_ceil(DISK_SLOT_ALIGN) * DISK_SLOT_ALIGN;
        if slot_stride.checked_mul(num_slots as u64).is_none() {
            return Err(Error::config(
                "num_disk_slots",
                format!("{num_slots} slots of {slot_stride} bytes overflow"),
            ));
        }
        Ok(slot_stride)
    }

    pub(crate) fn num_slots(&self) -> usize {
        self.num_slots
    }

    pub(crate) fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub(crate) fn slot_offset(&self, slot: DiskSlot) -> u64 {
        u64::from(slot.0) * self.slot_stride
    }

    pub(crate) fn file_bytes(&self) -> u64 {
        self.slot_stride * self.num_slots as u64
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    fn check(&self, slot: DiskSlot, len: usize) -> Result<()> {
        if slot.0 as usize >= self.num_slots {
            return Err(Error::BlockOutOfRange {
                block: crate::ids::BlockId(slot.0),
                num_blocks: self.num_slots,
            });
        }
        if len != self.block_bytes {
            return Err(Error::ShapeMismatch {
                what: "bytes of one disk slot",
                expected: self.block_bytes,
                got: len,
            });
        }
        Ok(())
    }

    /// Writes one block's bytes into `slot`.
    pub(crate) fn write(&self, slot: DiskSlot, data: &[u8]) -> Result<()> {
        self.check(slot, data.len())?;
        self.file
            .write_all_at(data, self.slot_offset(slot))
            .map_err(|e| Error::Io(format!("write disk {slot}: {e}")))
    }

    /// Reads one block's bytes from `slot`, unchecked.
    pub(crate) fn read(&self, slot: DiskSlot, out: &mut [u8]) -> Result<()> {
        self.check(slot, out.len())?;
        self.file
            .read_exact_at(out, self.slot_offset(slot))
            .map_err(|e| Error::Io(format!("read disk {slot}: {e}")))
    }
}

impl DiskTier {
    /// Creates (or truncates) the file at `path` and sizes it for `num_slots` blocks of
    /// `layout`.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be created or sized; [`Error::InvalidConfig`]
    /// when the size overflows.
    pub fn create(path: &Path, layout: &KvLayout, num_slots: usize) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| Error::Io(format!("open {}: {e}", path.display())))?;
        let tier = Self::with_file(file, layout, num_slots)?;
        tier.slots
            .file()
            .set_len(tier.file_bytes())
            .map_err(|e| Error::Io(format!("size {}: {e}", path.display())))?;
        Ok(tier)
    }

    /// Uses an open file (or block device) as is, without resizing it; it must be
    /// readable and writable over `num_slots` slots.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the size overflows or there are more slots than
    /// `u32` ids.
    pub fn with_file(file: File, layout: &KvLayout, num_slots: usize) -> Result<Self> {
        Ok(DiskTier {
            slots: SlotFile::new(file, layout, num_slots)?,
            checksums: vec![None; num_slots],
        })
    }

    /// Slots in the file.
    pub fn num_slots(&self) -> usize {
        self.slots.num_slots()
    }

    /// Bytes of one block (what a slot holds).
    pub fn block_bytes(&self) -> usize {
        self.slots.block_bytes()
    }

    /// Byte offset of `slot` in the file.
    pub fn slot_offset(&self, slot: DiskSlot) -> u64 {
        self.slots.slot_offset(slot)
    }

    /// Bytes the file spans.
    pub fn file_bytes(&self) -> u64 {
        self.slots.file_bytes()
    }

    /// Writes one block into `slot` and records its checksum.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], [`Error::ShapeMismatch`]; [`Error::Io`] when the
    /// write fails (disk full, say), after which the slot reads as unwritten.
    pub fn write_slot(&mut self, slot: DiskSlot, data: &[u8]) -> Result<()> {
        self.slots.check(slot, data.len())?;
        // Forget the old checksum first: if the write fails half way, a later read
        // of this slot must fail rather than pass a stale checksum.
        self.checksums[slot.0 as usize] = None;
        self.slots.write(slot, data)?;
        self.checksums[slot.0 as usize] = Some(xxh64_seeded(data, 0));
        Ok(())
    }

    /// Reads `slot` into `out` and checks it against the checksum of its last write.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], [`Error::ShapeMismatch`]; [`Error::Io`] when the
    /// read fails or the slot was never written successfully; [`Error::Checksum`] when
    /// the bytes differ from what was written. `out` holds unchecked bytes after an
    /// error.
    pub fn read_slot(&self, slot: DiskSlot, out: &mut [u8]) -> Result<()> {
        self.slots.check(slot, out.len())?;
        let expected = self.checksums[slot.0 as usize]
            .ok_or_else(|| Error::Io(format!("disk {slot} was never written successfully")))?;
        self.slots.read(slot, out)?;
        let got = xxh64_seeded(out, 0);
        if got != expected {
            return Err(Error::Checksum {
                what: format!("disk {slot}"),
                expected,
                got,
            });
        }
        Ok(())
    }
}
