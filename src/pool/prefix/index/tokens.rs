//! The stored token ids of every block, `block_size` per block, laid out from a
//! 64-byte boundary.
//!
//! A `Vec<u32>` of megabytes comes from `mmap` through the allocator with a 16-byte
//! header, so with 16-token blocks every block's 64 bytes straddled two cache lines:
//! a registration wrote two lines and a hit's confirmation read two. The ids start at
//! the first cache-line boundary of the buffer instead (a few ids of padding), so a
//! block of 16 ids is one line (and smaller power-of-two blocks never straddle one).

/// Cache-line size the layout aligns to, in bytes.
const LINE_BYTES: usize = 64;

/// See the module docs.
#[derive(Debug, Clone)]
pub(super) struct TokenStore {
    ids: Vec<u32>,
    /// Index in `ids` of block 0's first id: the first one on a line boundary when the
    /// buffer was made (a clone may land elsewhere; only the speed depends on it).
    start: usize,
    block_size: usize,
    num_blocks: usize,
}

impl TokenStore {
    /// Zeroed ids for `num_blocks` blocks of `block_size`.
    pub(super) fn new(num_blocks: usize, block_size: usize) -> Self {
        let len = num_blocks * block_size;
        let pad = LINE_BYTES / std::mem::size_of::<u32>() - 1;
        let ids = vec![0u32; len + pad];
        // How many ids from the buffer's start to the next line boundary (the
        // allocator aligns a `u32` buffer to 4 bytes at least, so this is exact).
        let misalign = ids.as_ptr() as usize % LINE_BYTES;
        let start = ((LINE_BYTES - misalign) % LINE_BYTES) / std::mem::size_of::<u32>();
        TokenStore {
            ids,
            start,
            block_size,
            num_blocks,
        }
    }

    /// Where block `b`'s ids are in `ids`, `None` past the arena.
    #[inline]
    fn range(&self, b: usize) -> Option<std::ops::Range<usize>> {
        let from = self.start + b * self.block_size;
        (b < self.num_blocks).then_some(from..from + self.block_size)
    }

    /// The ids of block `b` (empty when out of range).
    #[inline]
    pub(super) fn block(&self, b: usize) -> &[u32] {
        self.range(b).and_then(|r| self.ids.get(r)).unwrap_or(&[])
    }

    /// Overwrites the ids of block `b`; `ids` must be `block_size` long (nothing is
    /// written otherwise, or when `b` is out of range).
    #[inline]
    pub(super) fn store(&mut self, b: usize, ids: &[u32]) {
        if let Some(dst) = self.range(b).and_then(|r| self.ids.get_mut(r)) {
            if dst.len() == ids.len() {
                dst.copy_from_slice(ids);
            }
        }
    }

    /// Copies block `src`'s ids to block `dst` (both in range).
    pub(super) fn copy_block(&mut self, src: usize, dst: usize) {
        if let (Some(from), Some(to)) = (self.range(src), self.range(dst)) {
            self.ids.copy_within(from, to.start);
        }
    }

    /// Follows the arena to `num_blocks`, keeping every kept block's ids, aligned anew.
    pub(super) fn resize(&mut self, num_blocks: usize) {
        let mut out = TokenStore::new(num_blocks, self.block_size);
        let n = self.num_blocks.min(num_blocks) * self.block_size;
        out.ids[out.start..out.start + n].copy_from_slice(&self.ids[self.start..self.start + n]);
        *self = out;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_start_on_lines_and_survive_moves_and_resizes() {
        let mut t = TokenStore::new(10, 16);
        assert_eq!(t.block(0).as_ptr() as usize % LINE_BYTES, 0);
        for b in 0..10 {
            let ids: Vec<u32> = (0..16).map(|i| (b * 100 + i) as u32).collect();
            t.store(b, &ids);
        }
        t.store(3, &[1, 2, 3]); // wrong length: ignored
        assert_eq!(t.block(3)[0], 300);
        assert!(t.block(10).is_empty());
        t.copy_block(2, 7);
        assert_eq!(t.block(7), t.block(2));
        t.resize(20);
        assert_eq!(t.block(0).as_ptr() as usize % LINE_BYTES, 0);
        assert_eq!(t.block(9)[5], 905);
        assert_eq!(t.block(7)[0], 200);
        assert_eq!(t.block(15), &[0; 16][..]);
        t.resize(4);
        assert_eq!(t.block(3)[15], 315);
        assert!(t.block(4).is_empty());
        let z = TokenStore::new(0, 16);
        assert!(z.block(0).is_empty());
    }
}
