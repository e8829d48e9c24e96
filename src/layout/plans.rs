//! Data-movement plans: what the manager decides, and a storage backend executes.
//!
//! Plans name whole blocks (every layer, K and V). Executing one is the only way KV
//! bytes move between blocks, so each plan can be checked byte-for-byte on
//! [`crate::executor::storage::HostStorage`] and executed in one batch on a GPU.

use crate::ids::BlockId;

/// One whole-block copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockCopy {
    /// Source block.
    pub src: BlockId,
    /// Destination block (always distinct from every source of the same plan).
    pub dst: BlockId,
}

/// Copy-on-write copies accumulated over a scheduler step; execute before writing K/V.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyPlan {
    copies: Vec<BlockCopy>,
}

impl CopyPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty plan with room for `copies` copies, so a scheduler can size its step
    /// buffers once (at most one copy per sequence a step writes into a shared block).
    pub fn with_capacity(copies: usize) -> Self {
        CopyPlan {
            copies: Vec::with_capacity(copies),
        }
    }

    /// Copies the plan can hold before it allocates.
    pub fn capacity(&self) -> usize {
        self.copies.capacity()
    }

    /// Adds a copy.
    pub fn push(&mut self, src: BlockId, dst: BlockId) {
        self.copies.push(BlockCopy { src, dst });
    }

    /// The copies, in the order they were added.
    pub fn copies(&self) -> &[BlockCopy] {
        &self.copies
    }

    /// Number of copies.
    pub fn len(&self) -> usize {
        self.copies.len()
    }

    /// Whether the plan is empty.
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty()
    }

    /// Empties the plan, keeping its buffer.
    pub fn clear(&mut self) {
        self.copies.clear();
    }
}

/// Defragmentation moves: whole blocks relocated inside the arena.
///
/// Every destination is a free block and no destination is also a source, so the moves
/// can run in any order or all at once. Executing a plan is
/// [`crate::executor::storage::Storage::copy_blocks`] on its [`CopyPlan`] ([`Self::to_copy_plan`]
/// or `CopyPlan::from`), so a backend's one batched copy serves both.
/// Plans made by the manager list moves with ascending sources and ascending
/// destinations, so [`Self::runs`] merges neighbours into long transfers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MovePlan {
    moves: Vec<BlockCopy>,
}

impl MovePlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a move of `src`'s contents to `dst`.
    pub fn push(&mut self, src: BlockId, dst: BlockId) {
        self.moves.push(BlockCopy { src, dst });
    }

    /// The moves, in order.
    pub fn moves(&self) -> &[BlockCopy] {
        &self.moves
    }

    /// Number of blocks moved.
    pub fn len(&self) -> usize {
        self.moves.len()
    }

    /// Whether the plan moves nothing.
    pub fn is_empty(&self) -> bool {
        self.moves.is_empty()
    }

    /// `(src_start, dst_start, len)` runs of consecutive blocks on both sides.
    pub fn runs(&self) -> Vec<(u32, u32, u32)> {
        merge_runs(self.moves.iter().map(|m| (m.src.0, m.dst.0)))
    }

    /// The same moves as a copy plan, for [`crate::executor::storage::Storage::copy_blocks`].
    pub fn to_copy_plan(&self) -> CopyPlan {
        CopyPlan {
            copies: self.moves.clone(),
        }
    }
}

impl From<MovePlan> for CopyPlan {
    fn from(plan: MovePlan) -> Self {
        CopyPlan { copies: plan.moves }
    }
}

/// Direction of a [`SwapPlan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SwapDirection {
    /// Device blocks to host-tier blocks (preemption).
    Out,
    /// Host-tier blocks back to device blocks.
    In,
}

/// One block moved between the device arena and the host tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SwapPair {
    /// Block in the device arena.
    pub device: BlockId,
    /// Block in the host tier.
    pub host: BlockId,
}

/// Whole-block transfers between the device arena and the host tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapPlan {
    direction: SwapDirection,
    pairs: Vec<SwapPair>,
}

impl SwapPlan {
    /// An empty plan in `direction`.
    pub fn new(direction: SwapDirection) -> Self {
        SwapPlan {
            direction,
            pairs: Vec::new(),
        }
    }

    /// Adds a transfer.
    pub fn push(&mut self, device: BlockId, host: BlockId) {
        self.pairs.push(SwapPair { device, host });
    }

    /// The direction.
    pub fn direction(&self) -> SwapDirection {
        self.direction
    }

    /// The transfers, in order.
    pub fn pairs(&self) -> &[SwapPair] {
        &self.pairs
    }

    /// Number of blocks moved.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether the plan moves nothing.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// `(src, dst, len)` runs of consecutive blocks on both sides, in source/destination
    /// order of the direction.
    pub fn runs(&self) -> Vec<(u32, u32, u32)> {
        match self.direction {
            SwapDirection::Out => merge_runs(self.pairs.iter().map(|p| (p.device.0, p.host.0))),
            SwapDirection::In => merge_runs(self.pairs.iter().map(|p| (p.host.0, p.device.0))),
        }
    }
}

/// Groups `(src, dst)` block pairs into runs where both sides are consecutive, so a
/// backend issues one transfer per run instead of one per block.
///
/// Returns `(src_start, dst_start, len)` triples in input order.
pub fn merge_runs(pairs: impl IntoIterator<Item = (u32, u32)>) -> Vec<(u32, u32, u32)> {
    let mut runs: Vec<(u32, u32, u32)> = Vec::new();
    for (s, d) in pairs {
        if let Some(last) = runs.last_mut() {
            if last.0.checked_add(last.2) == Some(s) && last.1.checked_add(last.2) == Some(d) {
                last.2 += 1;
                continue;
            }
        }
        runs.push((s, d, 1));
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_only_when_both_sides_are_consecutive() {
        let runs = merge_runs([(4, 10), (5, 11), (6, 12), (8, 13), (9, 20)]);
        assert_eq!(runs, vec![(4, 10, 3), (8, 13, 1), (9, 20, 1)]);
        assert!(merge_runs([]).is_empty());
    }
}
