//! A block pool several schedulers share: per-shard free-block caches with a global
//! refill, in the style of thread-caching memory allocators.
//!
//! Data-parallel engines run one scheduler per rank. With a single pool behind one
//! mutex, every allocation from every scheduler serialises on that lock. Here each
//! scheduler allocates from its own shard. A shard is a small cache of free blocks behind
//! its own lock, which only that scheduler normally takes, so the lock stays
//! uncontended. The global free list is touched once per `batch` allocations, to refill
//! a cache or take back an overfull one. When both the shard and the global list are
//! empty, the allocator steals from the other shards before it reports
//! [`Error::OutOfBlocks`]. So a free block is never out of reach because another
//! scheduler's cache holds it.
//!
//! Each block's ownership is one atomic byte. Allocation marks it taken, and freeing
//! swaps it back with a compare-exchange, so a double free is an error in release
//! builds too, whichever shard frees the block.

use std::sync::Arc;

use crossbeam_utils::CachePadded;

use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::sync::{AtomicU8, Mutex, Ordering};

const FREE: u8 = 0;
const TAKEN: u8 = 1;

/// One scheduler's cache of free blocks, and the net count of blocks its handle took
/// (allocations minus frees through it; may go negative when blocks are freed through
/// another shard). Kept under the shard's own lock, so the hot path touches no shared
/// cache line.
#[derive(Debug, Default)]
struct Shard {
    free: Vec<BlockId>,
    taken: isize,
}

#[derive(Debug)]
struct Inner {
    global: Mutex<Vec<BlockId>>,
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    owner: Box<[AtomicU8]>,
    batch: usize,
}

/// One arena's blocks, shared by several schedulers through [`ShardHandle`]s.
#[derive(Debug, Clone)]
pub struct ShardedPool {
    inner: Arc<Inner>,
}

impl ShardedPool {
    /// A pool of `num_blocks` blocks for `num_shards` schedulers, moving blocks between
    /// the global list and a shard `batch` at a time.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when a count is 0 or the arena exceeds the `u32` ids.
    pub fn new(num_blocks: usize, num_shards: usize, batch: usize) -> Result<Self> {
        if num_blocks == 0 || num_blocks >= u32::MAX as usize {
            return Err(Error::config(
                "num_blocks",
                format!("{num_blocks} is not in 1..u32::MAX"),
            ));
        }
        if num_shards == 0 || batch == 0 {
            return Err(Error::config(
                "num_shards/batch",
                format!("{num_shards} shards, batch {batch}"),
            ));
        }
        let global = (0..num_blocks as u32).rev().map(BlockId).collect();
        Ok(ShardedPool {
            inner: Arc::new(Inner {
                global: Mutex::new(global),
                shards: (0..num_shards)
                    .map(|_| {
                        CachePadded::new(Mutex::new(Shard {
                            free: Vec::with_capacity(2 * batch + 1),
                            taken: 0,
                        }))
                    })
                    .collect(),
                owner: (0..num_blocks).map(|_| AtomicU8::new(FREE)).collect(),
                batch,
            }),
        })
    }

    /// The handle for scheduler `shard`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `shard` is not below the number of shards.
    pub fn handle(&self, shard: usize) -> Result<ShardHandle> {
        if shard >= self.inner.shards.len() {
            return Err(Error::config(
                "shard",
                format!("{shard} of {} shards", self.inner.shards.len()),
            ));
        }
        Ok(ShardHandle {
            pool: self.clone(),
            shard,
        })
    }

    /// Blocks in the arena.
    pub fn num_blocks(&self) -> usize {
        self.inner.owner.len()
    }

    /// Blocks allocated now (exact when no call is in flight).
    pub fn num_taken(&self) -> usize {
        let net: isize = self.inner.shards.iter().map(|s| s.lock().taken).sum();
        net.max(0) as usize
    }

    /// Checks that every block is either taken or in exactly one free list. Call it when
    /// no other thread is using the pool.
    ///
    /// # Errors
    /// A message naming the first inconsistent block.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut seen = vec![false; self.num_blocks()];
        let lists = std::iter::once(self.inner.global.lock().clone())
            .chain(self.inner.shards.iter().map(|s| s.lock().free.clone()));
        let mut free = 0;
        for list in lists {
            for b in list {
                let i = b.index();
                if std::mem::replace(&mut seen[i], true) {
                    return Err(format!("block {b} is in two free lists"));
                }
                if self.inner.owner[i].load(Ordering::Acquire) != FREE {
                    return Err(format!("block {b} is in a free list but marked taken"));
                }
                free += 1;
            }
        }
        if free + self.num_taken() != self.num_blocks() {
            return Err(format!(
                "{free} free + {} taken != {} blocks",
                self.num_taken(),
                self.num_blocks()
            ));
        }
        Ok(())
    }
}

/// One scheduler's access to a [`ShardedPool`]. Blocks allocated through one handle may
/// be freed through any handle.
#[derive(Debug)]
pub struct ShardHandle {
    pool: ShardedPool,
    shard: usize,
}

impl ShardHandle {
    /// Takes one block.
    ///
    /// # Errors
    /// [`Error::OutOfBlocks`] when no shard and not the global list has a free block. A
    /// block that another thread is moving between lists at that instant is not seen.
    pub fn allocate(&self) -> Result<BlockId> {
        let inner = &self.pool.inner;
        let b = {
            let mut shard = inner.shards[self.shard].lock();
            let b = shard.free.pop();
            shard.taken += isize::from(b.is_some());
            b
        };
        let b = match b {
            Some(b) => b,
            None => self.refill()?,
        };
        // The block came off a free list, which only holds blocks marked FREE.
        let marked = inner.owner[b.index()].compare_exchange(
            FREE,
            TAKEN,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        debug_assert!(marked.is_ok(), "free list held a taken block");
        Ok(b)
    }

    /// Takes a batch from the global list, else half of another shard's cache; keeps one
    /// block and caches the rest. Never holds two locks at once.
    fn refill(&self) -> Result<BlockId> {
        let inner = &self.pool.inner;
        let mut got: Vec<BlockId> = {
            let mut global = inner.global.lock();
            let from = global.len() - inner.batch.min(global.len());
            global.drain(from..).collect()
        };
        if got.is_empty() {
            for (i, other) in inner.shards.iter().enumerate() {
                if i != self.shard {
                    let mut o = other.lock();
                    let from = o.free.len() - o.free.len().div_ceil(2);
                    got.extend(o.free.drain(from..));
                    if !got.is_empty() {
                        break;
                    }
                }
            }
        }
        let b = got.pop().ok_or(Error::OutOfBlocks { needed: 1, free: 0 })?;
        let mut shard = inner.shards[self.shard].lock();
        shard.free.append(&mut got);
        shard.taken += 1;
        Ok(b)
    }

    /// Returns a block to the pool.
    ///
    /// # Errors
    /// [`Error::BlockOutOfRange`], or [`Error::DoubleFree`] when it is not allocated.
    pub fn free(&self, block: BlockId) -> Result<()> {
        let inner = &self.pool.inner;
        let owner = inner
            .owner
            .get(block.index())
            .ok_or(Error::BlockOutOfRange {
                block,
                num_blocks: inner.owner.len(),
            })?;
        owner
            .compare_exchange(TAKEN, FREE, Ordering::AcqRel, Ordering::Acquire)
            .map_err(|_| Error::DoubleFree(block))?;
        let mut shard = inner.shards[self.shard].lock();
        shard.free.push(block);
        shard.taken -= 1;
        if shard.free.len() > 2 * inner.batch {
            let from = shard.free.len() - inner.batch;
            inner.global.lock().extend(shard.free.drain(from..));
        }
        Ok(())
    }

    /// Returns this shard's cached free blocks to the global list.
    pub fn flush(&self) {
        let inner = &self.pool.inner;
        let mut shard = inner.shards[self.shard].lock();
        inner.global.lock().append(&mut shard.free);
    }

    /// The shard index.
    pub fn shard(&self) -> usize {
        self.shard
    }
}
