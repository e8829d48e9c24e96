//! Physical blocks: free list, refcounts, and the cached (evictable) state.
//!
//! Every block is in exactly one state:
//!
//! | state    | refcount | on the free list | meaning                                         |
//! |----------|----------|------------------|-------------------------------------------------|
//! | `Free`   | 0        | yes              | holds nothing anyone wants                      |
//! | `Live`   | >= 1     | no               | referenced by `refcount` block-table entries    |
//! | `Cached` | 0        | no               | unreferenced, content kept for the prefix cache |
//!
//! All operations are O(1) and none allocates: the free list and its position index
//! are sized once for the arena (and again only on [`BlockPool::resize`]).

pub mod prefix;
mod runs;
pub mod sharded;

pub(crate) use runs::pick_free_run;

use crate::error::{Error, Result};
use crate::ids::BlockId;

/// What a block is doing; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// On the free list.
    Free,
    /// Referenced by at least one table.
    Live,
    /// Unreferenced but kept (evictable) for the prefix cache.
    Cached,
}

const NOT_FREE: u32 = u32::MAX;

/// One block's refcount and fill, side by side (see [`BlockPool::fill`]).
#[derive(Debug, Clone, Copy, Default)]
struct BlockMeta {
    refcount: u32,
    fill: u16,
}

/// Hints the CPU to bring `x`'s cache line in (no effect off x86-64).
#[inline]
pub(crate) fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults and reads nothing into the
    // program; `x` is a valid reference in any case. SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (x as *const T).cast(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// A pool of `num_blocks` physical blocks with O(1) allocate/free and refcounts.
#[derive(Debug, Clone)]
pub struct BlockPool {
    /// Per block, its refcount and the manager's fill in one 8-byte record: the decode
    /// step asks both of its last block, so they share a cache line.
    meta: Vec<BlockMeta>,
    state: Vec<BlockState>,
    /// Free blocks as a stack; the top is handed out next.
    free: Vec<BlockId>,
    /// `free_pos[b]` = index of `b` in `free`, or `NOT_FREE`.
    free_pos: Vec<u32>,
    num_cached: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks; low ids are handed out first.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `num_blocks` does not fit a `u32` id space.
    pub fn new(num_blocks: usize) -> Result<Self> {
        if num_blocks >= u32::MAX as usize {
            return Err(Error::config(
                "num_blocks",
                format!("{num_blocks} exceeds the u32 id space"),
            ));
        }
        let mut pool = BlockPool {
            meta: Vec::new(),
            state: Vec::new(),
            free: Vec::new(),
            free_pos: Vec::new(),
            num_cached: 0,
        };
        pool.grow(num_blocks);
        Ok(pool)
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.state.len()
    }

    /// Blocks on the free list.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks in the `Cached` state (evictable).
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Blocks in the `Live` state.
    pub fn num_live(&self) -> usize {
        self.num_blocks() - self.num_free() - self.num_cached
    }

    /// The state of `block`.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`].
    pub fn state(&self, block: BlockId) -> Result<BlockState> {
        self.check(block)?;
        Ok(self.state[block.index()])
    }

    /// The refcount of `block` (0 when free or cached).
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`].
    pub fn refcount(&self, block: BlockId) -> Result<u32> {
        self.check(block)?;
        Ok(self.meta[block.index()].refcount)
    }

    /// Whether `block` is live with exactly one reference (a table may write into it
    /// in place); `false` for anything else, out-of-range ids included.
    #[inline]
    pub fn is_private(&self, block: BlockId) -> bool {
        self.meta
            .get(block.index())
            .is_some_and(|m| m.refcount == 1)
    }

    /// The manager's fill of `block`: slots of it that hold a token of some holder
    /// (0 out of range). The pool stores it beside the refcount and never reads it.
    #[inline]
    pub(crate) fn fill(&self, block: BlockId) -> u16 {
        self.meta.get(block.index()).map_or(0, |m| m.fill)
    }

    /// The fill of `block`, to change (`None` out of range).
    #[inline]
    pub(crate) fn fill_mut(&mut self, block: BlockId) -> Option<&mut u16> {
        self.meta.get_mut(block.index()).map(|m| &mut m.fill)
    }

    /// The fill of `block` when it is live with exactly one reference (the decode
    /// step's question and answer from one record); `None` otherwise.
    #[inline(always)]
    pub(crate) fn private_fill_mut(&mut self, block: BlockId) -> Option<&mut u16> {
        match self.meta.get_mut(block.index()) {
            Some(m) if m.refcount == 1 => Some(&mut m.fill),
            _ => None,
        }
    }

    #[inline]
    fn check(&self, block: BlockId) -> Result<()> {
        if block.index() < self.state.len() {
            Ok(())
        } else {
            Err(Error::BlockOutOfRange {
                block,
                num_blocks: self.state.len(),
            })
        }
    }

    /// Takes one free block; its refcount becomes 1.
    ///
    /// # Errors
    /// [`Error::OutOfBlocks`] when the free list is empty.
    #[inline]
    pub fn allocate(&mut self) -> Result<BlockId> {
        let b = self
            .free
            .pop()
            .ok_or(Error::OutOfBlocks { needed: 1, free: 0 })?;
        self.free_pos[b.index()] = NOT_FREE;
        self.state[b.index()] = BlockState::Live;
        self.meta[b.index()].refcount = 1;
        Ok(b)
    }

    /// Takes `n` free blocks, all or none, appending them to `out`.
    ///
    /// # Errors
    /// [`Error::OutOfBlocks`] when fewer than `n` are free; nothing is taken.
    pub fn allocate_n(&mut self, n: usize, out: &mut impl Extend<BlockId>) -> Result<()> {
        if n > self.free.len() {
            return Err(Error::OutOfBlocks {
                needed: n,
                free: self.free.len(),
            });
        }
        for _ in 0..n {
            let b = self.allocate()?;
            out.extend(std::iter::once(b));
        }
        Ok(())
    }

    /// Takes a specific free block (defragmentation and resizing pick destinations).
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], or [`Error::CorruptBlockTable`] when it is not free.
    pub fn take(&mut self, block: BlockId) -> Result<()> {
        self.check(block)?;
        let pos = self.free_pos[block.index()];
        if pos == NOT_FREE {
            return Err(Error::CorruptBlockTable(format!(
                "block {block} is not free"
            )));
        }
        self.unlink_free(block, pos);
        self.state[block.index()] = BlockState::Live;
        self.meta[block.index()].refcount = 1;
        Ok(())
    }

    fn unlink_free(&mut self, block: BlockId, pos: u32) {
        let last = self.free.len() - 1;
        self.free.swap(pos as usize, last);
        let moved = self.free[pos as usize];
        self.free_pos[moved.index()] = pos;
        self.free.pop();
        self.free_pos[block.index()] = NOT_FREE;
    }

    /// Adds a reference to a live block; returns the new count.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], or [`Error::CorruptBlockTable`] when it is not live.
    #[inline]
    pub fn incref(&mut self, block: BlockId) -> Result<u32> {
        self.check(block)?;
        if self.state[block.index()] != BlockState::Live {
            return Err(Error::CorruptBlockTable(format!(
                "incref of non-live block {block}"
            )));
        }
        let rc = &mut self.meta[block.index()].refcount;
        *rc = rc.checked_add(1).ok_or_else(|| {
            Error::CorruptBlockTable(format!("refcount overflow on block {block}"))
        })?;
        Ok(*rc)
    }

    /// Adds a reference to every block of `blocks` (a fork), all or none.
    ///
    /// # Errors
    /// As [`Self::incref`] for the first block that cannot take one more reference;
    /// nothing changed then.
    pub fn incref_all(&mut self, blocks: &[BlockId]) -> Result<()> {
        // One pass that checks each block as it adds its reference; the first block
        // that cannot take one undoes the references added before it. (A block listed
        // twice, which only a corrupt table does, is checked at each listing.)
        for (i, &b) in blocks.iter().enumerate() {
            match self.meta.get_mut(b.index()) {
                // Live <=> refcount > 0 (see the module table; `check_invariants` holds
                // the pool to it), so the refcount alone answers. One comparison
                // refuses both a count of 0 (`rc - 1` wraps) and one at the bound
                // `incref_all` has always kept: one reference of headroom.
                Some(m) if m.refcount.wrapping_sub(1) < u32::MAX - 2 => m.refcount += 1,
                _ => return Err(self.undo_increfs(&blocks[..i], b)),
            }
        }
        Ok(())
    }

    /// [`Self::incref_all`] refused `bad`: the error (read before anything changes
    /// back), then the references added to `done` are taken off again.
    #[cold]
    #[inline(never)]
    fn undo_increfs(&mut self, done: &[BlockId], bad: BlockId) -> Error {
        let error = match self.meta.get(bad.index()) {
            None => Error::BlockOutOfRange {
                block: bad,
                num_blocks: self.meta.len(),
            },
            Some(m) if m.refcount == 0 => {
                Error::CorruptBlockTable(format!("incref of non-live block {bad}"))
            }
            Some(_) => Error::CorruptBlockTable(format!("refcount overflow on block {bad}")),
        };
        for &d in done {
            self.meta[d.index()].refcount -= 1;
        }
        error
    }

    /// Drops a reference; at zero the block goes to the free list. Returns the new count.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], or [`Error::DoubleFree`] when the block is not live.
    #[inline]
    pub fn decref(&mut self, block: BlockId) -> Result<u32> {
        let rc = self.decref_inner(block)?;
        if rc == 0 {
            self.push_free(block);
        }
        Ok(rc)
    }

    /// Drops a reference; at zero the block becomes `Cached` (kept, evictable).
    ///
    /// # Errors
    /// As [`Self::decref`].
    #[inline]
    pub fn decref_keep(&mut self, block: BlockId) -> Result<u32> {
        let rc = self.decref_inner(block)?;
        if rc == 0 {
            self.state[block.index()] = BlockState::Cached;
            self.num_cached += 1;
        }
        Ok(rc)
    }

    /// Drops a table's reference to `block`. At zero the block becomes `Cached` when
    /// `keep()` says so, else `Free`, and its fill goes to 0 (no holder holds a slot
    /// of it). `keep` is asked only at zero, so releasing a shared block reads and
    /// writes nothing but its record. Returns the references left, whether a block
    /// released at zero was kept, and the fill it held then (0 when shared).
    ///
    /// # Errors
    /// As [`Self::decref`].
    #[inline(always)]
    pub(crate) fn release(
        &mut self,
        block: BlockId,
        keep: impl FnOnce() -> bool,
    ) -> Result<(u32, bool, u16)> {
        let num_blocks = self.meta.len();
        let Some(m) = self.meta.get_mut(block.index()) else {
            return Err(Error::BlockOutOfRange { block, num_blocks });
        };
        // As in `decref_inner`: a zero count is the double free.
        if m.refcount == 0 {
            return Err(Error::DoubleFree(block));
        }
        m.refcount -= 1;
        if m.refcount != 0 {
            return Ok((m.refcount, false, 0));
        }
        let fill = std::mem::take(&mut m.fill);
        let kept = keep();
        if kept {
            self.state[block.index()] = BlockState::Cached;
            self.num_cached += 1;
        } else {
            self.push_free(block);
        }
        Ok((0, kept, fill))
    }

    #[inline(always)]
    fn decref_inner(&mut self, block: BlockId) -> Result<u32> {
        let num_blocks = self.meta.len();
        let Some(BlockMeta { refcount: rc, .. }) = self.meta.get_mut(block.index()) else {
            return Err(Error::BlockOutOfRange { block, num_blocks });
        };
        // Live <=> refcount > 0 (as in `incref_all`): free and cached blocks have
        // none, so a zero count is the double free, whatever the state says.
        if *rc == 0 {
            return Err(Error::DoubleFree(block));
        }
        *rc -= 1;
        Ok(*rc)
    }

    fn push_free(&mut self, block: BlockId) {
        self.state[block.index()] = BlockState::Free;
        self.free_pos[block.index()] = self.free.len() as u32;
        self.free.push(block);
    }

    /// Brings a cached block back to life with refcount 1 (a prefix-cache hit).
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when it is not cached.
    pub fn revive(&mut self, block: BlockId) -> Result<()> {
        self.check(block)?;
        if self.state[block.index()] != BlockState::Cached {
            return Err(Error::CorruptBlockTable(format!(
                "revive of uncached block {block}"
            )));
        }
        self.state[block.index()] = BlockState::Live;
        self.meta[block.index()].refcount = 1;
        self.num_cached -= 1;
        Ok(())
    }

    /// Evicts a cached block to the free list.
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when it is not cached.
    pub fn evict(&mut self, block: BlockId) -> Result<()> {
        self.check(block)?;
        if self.state[block.index()] != BlockState::Cached {
            return Err(Error::CorruptBlockTable(format!(
                "evict of uncached block {block}"
            )));
        }
        self.num_cached -= 1;
        self.push_free(block);
        Ok(())
    }

    /// Moves a live block's refcount (and fill) to a free block and frees the source
    /// (defragmentation after its data moved). Returns nothing; both ids are checked.
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when `src` is not live or `dst` is not free.
    pub fn relocate(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        self.check(src)?;
        self.check(dst)?;
        let src_state = self.state[src.index()];
        if src_state == BlockState::Free {
            return Err(Error::CorruptBlockTable(format!(
                "relocate of free block {src}"
            )));
        }
        let pos = self.free_pos[dst.index()];
        if pos == NOT_FREE {
            return Err(Error::CorruptBlockTable(format!(
                "relocate into non-free block {dst}"
            )));
        }
        self.unlink_free(dst, pos);
        self.state[dst.index()] = src_state;
        // The whole record moves: the refcount and the manager's fill.
        self.meta[dst.index()] = std::mem::take(&mut self.meta[src.index()]);
        self.push_free(src);
        Ok(())
    }

    /// Grows or shrinks the pool to `num_blocks`. Growing adds free blocks at the top;
    /// shrinking needs every removed block to be free.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when a block at or above `num_blocks` is not free or the
    /// size exceeds the id space; the pool is unchanged.
    pub fn resize(&mut self, num_blocks: usize) -> Result<()> {
        if num_blocks >= u32::MAX as usize {
            return Err(Error::config(
                "num_blocks",
                format!("{num_blocks} exceeds the u32 id space"),
            ));
        }
        let old = self.num_blocks();
        if num_blocks >= old {
            self.grow(num_blocks - old);
            return Ok(());
        }
        if let Some(b) = (num_blocks..old).find(|&b| self.state[b] != BlockState::Free) {
            return Err(Error::config(
                "num_blocks",
                format!(
                    "cannot shrink to {num_blocks}: block {b} is {:?}",
                    self.state[b]
                ),
            ));
        }
        for b in num_blocks..old {
            let id = BlockId(b as u32);
            let pos = self.free_pos[b];
            self.unlink_free(id, pos);
        }
        self.meta.truncate(num_blocks);
        self.state.truncate(num_blocks);
        self.free_pos.truncate(num_blocks);
        self.free.shrink_to(num_blocks);
        Ok(())
    }

    fn grow(&mut self, extra: usize) {
        let old = self.num_blocks();
        let new = old + extra;
        self.meta.resize(new, BlockMeta::default());
        self.state.resize(new, BlockState::Free);
        self.free_pos.resize(new, NOT_FREE);
        self.free.reserve_exact(extra);
        // Push high ids first so the lowest id is on top of the stack.
        for b in (old..new).rev() {
            self.push_free(BlockId(b as u32));
        }
    }

    /// The state of every block, indexed by block id.
    pub fn states(&self) -> &[BlockState] {
        &self.state
    }

    /// Rebuilds the free list so the lowest free ids are handed out first, in O(blocks).
    /// After a compaction the freed sources sit at the top of the arena; without this
    /// they would be the next blocks allocated and the arena would re-fragment at once.
    pub fn reorder_free_low_first(&mut self) {
        self.free.clear();
        for b in (0..self.state.len()).rev() {
            if self.state[b] == BlockState::Free {
                self.free_pos[b] = self.free.len() as u32;
                self.free.push(BlockId(b as u32));
            }
        }
    }

    /// Free block ids, in no particular order.
    pub fn free_blocks(&self) -> &[BlockId] {
        &self.free
    }

    /// Checks every internal invariant; returns a description of the first violation.
    ///
    /// # Errors
    /// A message naming the broken invariant and the block.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let n = self.num_blocks();
        if self.meta.len() != n || self.free_pos.len() != n {
            return Err("array lengths differ".into());
        }
        let mut cached = 0;
        for b in 0..n {
            let (st, rc, pos) = (self.state[b], self.meta[b].refcount, self.free_pos[b]);
            match st {
                BlockState::Free => {
                    if rc != 0 {
                        return Err(format!("free block {b} has refcount {rc}"));
                    }
                    if pos == NOT_FREE || self.free.get(pos as usize) != Some(&BlockId(b as u32)) {
                        return Err(format!("free block {b} is not on the free list"));
                    }
                }
                BlockState::Live | BlockState::Cached => {
                    if pos != NOT_FREE {
                        return Err(format!("{st:?} block {b} is on the free list"));
                    }
                    if st == BlockState::Live && rc == 0 {
                        return Err(format!("live block {b} has refcount 0"));
                    }
                    if st == BlockState::Cached {
                        if rc != 0 {
                            return Err(format!("cached block {b} has refcount {rc}"));
                        }
                        cached += 1;
                    }
                }
            }
        }
        if cached != self.num_cached {
            return Err(format!(
                "cached count {} but {cached} cached blocks",
                self.num_cached
            ));
        }
        let free_states = self
            .state
            .iter()
            .filter(|s| **s == BlockState::Free)
            .count();
        if free_states != self.free.len() {
            return Err(format!(
                "{} on the free list but {free_states} free",
                self.free.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_free_round_trip() {
        let mut p = BlockPool::new(4).unwrap();
        let a = p.allocate().unwrap();
        assert_eq!(a, BlockId(0));
        assert_eq!(p.incref(a).unwrap(), 2);
        assert_eq!(p.decref(a).unwrap(), 1);
        assert_eq!(p.decref(a).unwrap(), 0);
        assert_eq!(p.decref(a), Err(Error::DoubleFree(a)));
        assert_eq!(p.num_free(), 4);
        p.check_invariants().unwrap();
    }

    #[test]
    fn batch_allocate_is_all_or_nothing() {
        let mut p = BlockPool::new(3).unwrap();
        let mut out = Vec::new();
        assert_eq!(
            p.allocate_n(4, &mut out),
            Err(Error::OutOfBlocks { needed: 4, free: 3 })
        );
        assert!(out.is_empty());
        assert_eq!(p.num_free(), 3);
        p.allocate_n(3, &mut out).unwrap();
        assert_eq!(out, vec![BlockId(0), BlockId(1), BlockId(2)]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn incref_all_is_all_or_nothing() {
        let mut p = BlockPool::new(4).unwrap();
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        p.incref(b).unwrap();
        let free = BlockId(3);
        // A free block, an out-of-range id, then a block listed twice at the headroom
        // bound: each fails after earlier increments, which are undone.
        for bad in [
            vec![a, b, free],
            vec![a, b, BlockId(9)],
            vec![b, a, free, a],
        ] {
            assert!(p.incref_all(&bad).is_err());
            assert_eq!((p.refcount(a).unwrap(), p.refcount(b).unwrap()), (1, 2));
            p.check_invariants().unwrap();
        }
        p.meta[a.index()].refcount = u32::MAX - 2;
        assert!(p.incref_all(&[b, a, a]).is_err());
        assert_eq!(
            (p.refcount(a).unwrap(), p.refcount(b).unwrap()),
            (u32::MAX - 2, 2)
        );
        p.incref_all(&[a, b]).unwrap();
        assert_eq!(
            (p.refcount(a).unwrap(), p.refcount(b).unwrap()),
            (u32::MAX - 1, 3)
        );
    }

    #[test]
    fn cached_blocks_revive_and_evict() {
        let mut p = BlockPool::new(2).unwrap();
        let a = p.allocate().unwrap();
        p.decref_keep(a).unwrap();
        assert_eq!((p.num_cached(), p.num_free(), p.num_live()), (1, 1, 0));
        p.revive(a).unwrap();
        p.decref_keep(a).unwrap();
        p.evict(a).unwrap();
        assert!(p.evict(a).is_err());
        assert_eq!(p.num_free(), 2);
        p.check_invariants().unwrap();
    }

    #[test]
    fn take_relocate_and_resize() {
        let mut p = BlockPool::new(8).unwrap();
        p.take(BlockId(7)).unwrap();
        assert!(p.take(BlockId(7)).is_err());
        assert!(p.resize(4).is_err());
        assert_eq!(p.num_blocks(), 8);
        p.relocate(BlockId(7), BlockId(2)).unwrap();
        p.resize(4).unwrap();
        assert_eq!((p.num_blocks(), p.num_free(), p.num_live()), (4, 3, 1));
        p.resize(6).unwrap();
        assert_eq!(p.num_free(), 5);
        assert!(matches!(
            p.incref(BlockId(9)),
            Err(Error::BlockOutOfRange { .. })
        ));
        p.check_invariants().unwrap();
    }
}
