//! Defragmentation and the elastic arena: fragmentation metrics, compaction plans,
//! and shrinking or growing the arena.
//!
//! # Compaction
//!
//! A block is *resident* when it is live (referenced by a table) or cached (kept for
//! the prefix cache); both hold data someone may read, so both move. With `r`
//! resident blocks, full compaction leaves them in exactly `[0, r)`. The planner is the
//! classic two-finger sweep: one finger walks down from the top of the arena to
//! collect resident blocks at or above `r` (the only blocks that must move), the other
//! walks up from block 0 to collect the holes below `r`. Each such block moves exactly
//! once, so the plan has the fewest moves possible; its destinations are all below `r`
//! and its sources all at or above `r`, so no block is both read and written and the
//! plan runs as one batch. Shared blocks are sources once; every table entry that
//! names them is remapped in one pass over the tables through a dense move map, so
//! planning and committing are linear in the arena and the tables.
//!
//! # Blocks a step is writing
//!
//! The blocks of a sequence holding an uncommitted reservation are in flight (see
//! `manager/in_flight.rs`): the model writes through the slots it was handed until
//! the commit. Compaction plans around them: they are never sources and stay where
//! they are, while every other block at or above `r` still moves into the holes below
//! `r` (there are at least as many holes below `r` as resident blocks above it, so the
//! pinned ones only leave holes unfilled). A shrink whose released tail holds such a
//! block refuses with [`Error::SequenceState`] and changes nothing.
//!
//! # Two ways to run it
//!
//! - [`crate::executor::defragment_with`] plans, executes on a [`Storage`] and commits
//!   in one call.
//! - [`KvCache::plan_defragment`] returns a [`PendingDefrag`]: the engine
//!   executes [`PendingDefrag::plan`] itself (on its own stream, say) and then calls
//!   [`PendingDefrag::commit`], which remaps the tables and frees the sources. Until
//!   the commit the tables still point at the sources, which stay intact. The pending
//!   plan holds the manager's `&mut` borrow, so nothing can allocate a destination or
//!   write into a source meanwhile; that is why no destination needs a reservation.
//!   Dropping it without a commit aborts: the manager is unchanged, and whatever was
//!   copied went into free blocks.
//!
//! # Elastic arena
//!
//! [`crate::executor::shrink_to`] moves only the resident blocks above the new size
//! into holes below it, then releases the tail in the storage and the manager.
//! [`crate::executor::grow_to`] adds free blocks at the tail; since a block's address
//! does not depend on the arena size (see [`crate::layout`]), no live data moves.
//!
//! A hybrid cache resizes its one arena across groups (`manager/groups/`): a shrink
//! moves every page any group holds at or above the new size (live, cached, kept
//! window pages, checkpoints) into the lowest free pages below it, whichever group
//! owns them, and every group's pool loses the tail; grown pages start in group 0, as
//! at construction. [`PendingResize`] serves both.

use super::KvCache;
use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::plans::MovePlan;
use crate::pool::BlockState;

/// How much one [`crate::executor::defragment_with`] or
/// [`KvCache::plan_defragment`] call may do.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DefragOptions {
    /// Most blocks one call moves (`usize::MAX`: a full compaction). The highest
    /// resident blocks go first, so each step lowers the high-water mark as far as its
    /// budget allows. Must be at least 1.
    pub max_moves_per_step: usize,
    /// Plan nothing unless [`FragStats::fragmentation`] is at least this ratio, in
    /// `[0, 1]` (0: always compact).
    pub min_fragmentation: f64,
}

impl DefragOptions {
    /// Compact everything, whatever the fragmentation.
    pub const FULL: DefragOptions = DefragOptions {
        max_moves_per_step: usize::MAX,
        min_fragmentation: 0.0,
    };

    /// At most `max_moves_per_step` moves per call, whatever the fragmentation.
    pub const fn incremental(max_moves_per_step: usize) -> Self {
        DefragOptions {
            max_moves_per_step,
            min_fragmentation: 0.0,
        }
    }

    /// These options, acting only at or above `min_fragmentation`.
    pub const fn above(self, min_fragmentation: f64) -> Self {
        DefragOptions {
            min_fragmentation,
            ..self
        }
    }

    fn validate(&self) -> Result<()> {
        if self.max_moves_per_step == 0 {
            return Err(Error::config(
                "max_moves_per_step",
                "0 moves per step; must be at least 1",
            ));
        }
        if !(0.0..=1.0).contains(&self.min_fragmentation) {
            return Err(Error::config(
                "min_fragmentation",
                format!("{} is not a ratio in [0, 1]", self.min_fragmentation),
            ));
        }
        Ok(())
    }
}

impl Default for DefragOptions {
    fn default() -> Self {
        Self::FULL
    }
}

/// Cumulative counters of the moves defragmentation and shrinking made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DefragCounters {
    /// Committed move plans (defragmentation passes and shrinks that moved blocks).
    pub runs: u64,
    /// Blocks moved, over all passes.
    pub moved_blocks: u64,
    /// Microseconds spent planning and copying in [`crate::executor::defragment_with`]
    /// and [`crate::executor::shrink_to`] (the two-phase API is timed by the engine).
    pub time_us: u64,
}

/// How scattered the arena and the block tables are; see
/// [`KvCache::fragmentation`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FragStats {
    /// Blocks in the arena.
    pub num_blocks: usize,
    /// Blocks referenced by at least one table.
    pub live_blocks: usize,
    /// Unreferenced blocks kept for the prefix cache (they move with compaction too).
    pub cached_blocks: usize,
    /// Blocks on the free list.
    pub free_blocks: usize,
    /// Highest resident (live or cached) block + 1; 0 when none is resident. The arena
    /// can shrink to this without moving anything.
    pub high_water_blocks: usize,
    /// Free blocks below the high-water mark.
    pub holes_below_high_water: usize,
    /// Longest run of consecutive free blocks anywhere in the arena.
    pub largest_free_run_blocks: usize,
    /// Moves a full compaction needs: resident blocks at or above the resident count.
    pub moves_to_compact: usize,
    /// Mean number of contiguous runs (maximal stretches of consecutive block ids) per
    /// block table, over sequences holding at least one block; 1.0 is perfectly
    /// contiguous, 0.0 when no sequence holds a block.
    pub mean_runs_per_sequence: f64,
    /// Most contiguous runs in one block table.
    pub max_runs_per_sequence: usize,
    /// Token slots of live blocks that hold no token (mostly last-block tails).
    pub internal_waste_slots: usize,
    /// The fragmentation figure, in `[0, 1]`:
    /// `holes_below_high_water / high_water_blocks` (0 when nothing is resident).
    ///
    /// It is the share of the arena's occupied prefix that holds nothing: 0 when the
    /// resident blocks are packed in `[0, resident)`, about 0.5 for a checkerboard, and
    /// close to 1 when a few blocks pin the top of an otherwise empty arena. It says
    /// how much a shrink would gain from compacting first.
    pub fragmentation: f64,
}

/// Where resident blocks sit, from one pass over the block states.
#[derive(Debug, Clone, Copy)]
struct Occupancy {
    resident: usize,
    high_water: usize,
}

impl Occupancy {
    fn fragmentation(&self) -> f64 {
        if self.high_water == 0 {
            0.0
        } else {
            (self.high_water - self.resident) as f64 / self.high_water as f64
        }
    }
}

/// A compaction planned but not yet committed; see the module docs.
///
/// It holds the manager's `&mut` borrow, so the manager cannot change until it is
/// committed or dropped. Dropping it aborts the compaction and leaves the manager as
/// it was.
#[derive(Debug)]
#[must_use = "dropping a pending compaction aborts it"]
pub struct PendingDefrag<'a> {
    manager: &'a mut KvCache,
    plan: MovePlan,
    /// A hybrid cache's moves by owner group (`plan` is their union over page ids).
    per_group: Vec<MovePlan>,
}

impl PendingDefrag<'_> {
    /// The moves to execute before [`Self::commit`]; the tables still point at the
    /// sources. On a hybrid cache they are over page ids, whichever group owns them
    /// (one storage of every group's pages executes them).
    pub fn plan(&self) -> &MovePlan {
        &self.plan
    }

    /// The moves of group `g`'s pages, for a storage per group: the whole plan on a
    /// one-group cache (`g == 0`).
    ///
    /// # Panics
    /// When `g >= num_groups()`.
    pub fn group_plan(&self, g: usize) -> &MovePlan {
        match self.per_group.is_empty() {
            true => {
                assert_eq!(g, 0, "group {g} of a one-group cache");
                &self.plan
            }
            false => &self.per_group[g],
        }
    }

    /// Records that the plan was executed: tables now point at the destinations and the
    /// sources are free. Returns the plan.
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when the manager's own state contradicts the plan
    /// (it cannot, since the plan was made under the same borrow); nothing changed then.
    pub fn commit(self) -> Result<MovePlan> {
        if let Some(h) = &mut self.manager.hybrid {
            h.commit_group_moves(&self.per_group)?;
            return Ok(self.plan);
        }
        self.manager.commit_moves(&self.plan)?;
        self.manager.pool.reorder_free_low_first();
        Ok(self.plan)
    }
}

/// A resize planned by [`KvCache::plan_shrink`] or
/// [`KvCache::plan_grow`] and not yet committed. Like [`PendingDefrag`], it
/// holds the manager's `&mut` borrow; dropping it aborts and changes nothing.
#[derive(Debug)]
#[must_use = "dropping a pending resize aborts it"]
pub struct PendingResize<'a> {
    manager: &'a mut KvCache,
    num_blocks: usize,
    plan: MovePlan,
}

impl PendingResize<'_> {
    /// The moves to execute before the storage shrinks (empty for a grow).
    pub fn plan(&self) -> &MovePlan {
        &self.plan
    }

    /// The arena size after the commit, in blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Records that the moves were executed and the storage resized: tables point at
    /// the destinations and the arena has [`Self::num_blocks`] blocks. Returns the plan.
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when the manager's own state contradicts the plan
    /// (it cannot, since the plan was made under the same borrow).
    pub fn commit(self) -> Result<MovePlan> {
        self.manager.commit_resize(self.num_blocks, &self.plan)?;
        Ok(self.plan)
    }
}

impl KvCache {
    /// Fragmentation metrics, from one pass over the block states and one over the
    /// tables: O(blocks + table entries), so a monitoring call rather than a per-token
    /// one on large arenas.
    pub fn fragmentation(&self) -> FragStats {
        if let Some(g0) = self.first_group() {
            return g0.fragmentation();
        }
        let states = self.pool.states();
        let (mut resident, mut high_water, mut largest_run, mut run) = (0, 0, 0, 0);
        for (i, st) in states.iter().enumerate() {
            if *st == BlockState::Free {
                run += 1;
                largest_run = largest_run.max(run);
            } else {
                resident += 1;
                high_water = i + 1;
                run = 0;
            }
        }
        let resident_below = states[..resident]
            .iter()
            .filter(|s| **s != BlockState::Free)
            .count();
        let occupancy = Occupancy {
            resident,
            high_water,
        };

        let (mut tables, mut runs_total, mut runs_max) = (0usize, 0usize, 0usize);
        for s in self.seqs.values() {
            let live = &s.table[s.released..];
            if live.is_empty() {
                continue;
            }
            let runs = 1 + live
                .windows(2)
                .filter(|w| w[0].0.checked_add(1) != Some(w[1].0))
                .count();
            tables += 1;
            runs_total += runs;
            runs_max = runs_max.max(runs);
        }

        let live = self.pool.num_live();
        FragStats {
            num_blocks: states.len(),
            live_blocks: live,
            cached_blocks: self.pool.num_cached(),
            free_blocks: self.pool.num_free(),
            high_water_blocks: high_water,
            holes_below_high_water: high_water - resident,
            largest_free_run_blocks: largest_run,
            moves_to_compact: resident - resident_below,
            mean_runs_per_sequence: if tables == 0 {
                0.0
            } else {
                runs_total as f64 / tables as f64
            },
            max_runs_per_sequence: runs_max,
            internal_waste_slots: live * self.block_size() - self.live_token_slots,
            fragmentation: occupancy.fragmentation(),
        }
    }

    /// Plans a compaction and returns it pending: execute [`PendingDefrag::plan`] on the
    /// storage, then [`PendingDefrag::commit`]. The plan is empty when the
    /// fragmentation is below `opts.min_fragmentation` or the arena is compact. The
    /// blocks of a sequence holding an uncommitted reservation never move: the plan
    /// compacts around them (see the module docs).
    ///
    /// On a hybrid cache the plan compacts the whole arena over page ids, whichever
    /// group owns a page ([`PendingDefrag::group_plan`] splits it by group), as
    /// [`Self::plan_defragment_grouped`] does, with the same options; while a swap
    /// transfer is in flight it plans nothing rather than refusing.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for options out of range; nothing changed.
    pub fn plan_defragment(&mut self, opts: DefragOptions) -> Result<PendingDefrag<'_>> {
        if let Some(h) = &self.hybrid {
            opts.validate()?;
            let (resident, high_water) = h.page_occupancy();
            let occupancy = Occupancy {
                resident,
                high_water,
            };
            let (plan, per_group) = if occupancy.fragmentation() < opts.min_fragmentation {
                (MovePlan::new(), vec![MovePlan::new(); h.num_groups()])
            } else {
                h.defrag_moves(opts.max_moves_per_step)
            };
            return Ok(PendingDefrag {
                manager: self,
                plan,
                per_group,
            });
        }
        self.check_no_transfers()?;
        opts.validate()?;
        let occupancy = self.occupancy();
        let plan = if occupancy.fragmentation() < opts.min_fragmentation {
            MovePlan::new()
        } else {
            // The blocks a step is writing stay put (see the module docs).
            let pinned = self.in_flight_blocks();
            self.plan_moves(
                occupancy.resident,
                opts.max_moves_per_step,
                pinned.as_deref(),
            )
        };
        Ok(PendingDefrag {
            manager: self,
            plan,
            per_group: Vec::new(),
        })
    }

    /// Cumulative defragmentation counters (for metrics).
    pub fn defrag_counters(&self) -> DefragCounters {
        if let Some(g0) = self.first_group() {
            return g0.defrag_counters();
        }
        self.defrag_counters
    }

    /// Adds `elapsed` to [`DefragCounters::time_us`]: the executor that ran a plan
    /// reports how long it took.
    pub fn record_defrag_time(&mut self, elapsed: std::time::Duration) {
        if let Some(h) = &mut self.hybrid {
            return h.group_mut(0).record_defrag_time(elapsed);
        }
        self.defrag_counters.time_us += elapsed.as_micros() as u64;
    }

    /// Plans shrinking the arena to `num_blocks`: resident blocks at or above it move
    /// into the lowest holes (the fewest moves; no full compaction). Execute
    /// [`PendingResize::plan`], shrink the storage, then [`PendingResize::commit`]
    /// ([`crate::executor::shrink_to`] does all three).
    ///
    /// Cached (prefix-cache) blocks count as resident: evict them first to shrink
    /// further. On a hybrid cache, every page any group holds is resident (see the
    /// module docs), and the arena cannot go below a state group's pages per sequence.
    ///
    /// # Errors
    /// [`Error::ShrinkBelowResident`] when the live and cached blocks need more than
    /// `num_blocks`; [`Error::InvalidConfig`] when `num_blocks` is above the arena, is
    /// 0, or is not above the watermark; [`Error::Unsupported`] while swaps are in
    /// flight; [`Error::SequenceState`] when a sequence holding an uncommitted
    /// reservation holds a block at or above `num_blocks` (the step is writing into
    /// it: commit first). Nothing changed.
    pub fn plan_shrink(&mut self, num_blocks: usize) -> Result<PendingResize<'_>> {
        if let Some(h) = &self.hybrid {
            let plan = h.plan_shrink(num_blocks)?;
            return Ok(PendingResize {
                manager: self,
                num_blocks,
                plan,
            });
        }
        self.check_no_transfers()?;
        let old = self.num_blocks();
        if num_blocks > old {
            return Err(Error::config(
                "num_blocks",
                format!("shrink to {num_blocks} is above the arena's {old} blocks; grow instead"),
            ));
        }
        let resident = self.pool.num_live() + self.pool.num_cached();
        if num_blocks < resident {
            return Err(Error::ShrinkBelowResident {
                requested: num_blocks,
                live: self.pool.num_live(),
                cached: self.pool.num_cached(),
            });
        }
        self.check_new_size(num_blocks)?;
        self.check_tail_not_in_flight(num_blocks)?;
        let plan = if num_blocks == old {
            MovePlan::new()
        } else {
            // No block at or above `num_blocks` is in flight: nothing to plan around.
            self.plan_moves(num_blocks, usize::MAX, None)
        };
        Ok(PendingResize {
            manager: self,
            num_blocks,
            plan,
        })
    }

    /// Plans growing the arena to `num_blocks` by adding free blocks at the tail; no
    /// live data moves (the plan is empty). Grow the storage, then
    /// [`PendingResize::commit`] ([`crate::executor::grow_to`] does both). The lowest
    /// free blocks are still handed out first.
    ///
    /// # Errors
    /// [`Error::ArenaLimit`] above `CacheConfig::max_num_blocks` (or the `u32` id
    /// space); [`Error::InvalidConfig`] when `num_blocks` is below the arena. Nothing
    /// changed.
    pub fn plan_grow(&mut self, num_blocks: usize) -> Result<PendingResize<'_>> {
        let old = self.num_blocks();
        if num_blocks < old {
            return Err(Error::config(
                "num_blocks",
                format!("grow to {num_blocks} is below the arena's {old} blocks; shrink instead"),
            ));
        }
        let max = self.max_num_blocks();
        if num_blocks > max {
            return Err(Error::ArenaLimit {
                requested: num_blocks,
                max,
            });
        }
        Ok(PendingResize {
            manager: self,
            num_blocks,
            plan: MovePlan::new(),
        })
    }

    /// Sets the arena to `num_blocks` after `plan`'s moves were executed (shrink) or
    /// nothing moved (grow).
    fn commit_resize(&mut self, num_blocks: usize, plan: &MovePlan) -> Result<()> {
        if num_blocks == self.num_blocks() {
            return Ok(());
        }
        if let Some(h) = &mut self.hybrid {
            return h.commit_resize(num_blocks, plan);
        }
        // Nothing below can fail: the plan was made from this state and, once it is
        // applied, every block at or above `num_blocks` is free.
        self.commit_moves(plan)?;
        self.resize_arena(num_blocks)
    }

    /// Sets the arena to `num_blocks`; every block at or above a smaller size is free.
    pub(crate) fn resize_arena(&mut self, num_blocks: usize) -> Result<()> {
        self.pool.resize(num_blocks)?;
        self.prefix.resize(num_blocks)?;
        self.fill_dirty.resize(num_blocks);
        self.config.num_blocks = num_blocks;
        self.pool.reorder_free_low_first();
        Ok(())
    }

    /// The largest arena [`Self::plan_grow`] accepts.
    pub fn max_num_blocks(&self) -> usize {
        if let Some(g0) = self.first_group() {
            return g0.max_num_blocks();
        }
        // The pool needs ids strictly below u32::MAX.
        let id_space = u32::MAX as usize - 1;
        match self.config.max_num_blocks {
            0 => id_space,
            n => n.min(id_space),
        }
    }

    /// The free blocks kept at admission, below which the arena cannot shrink: the
    /// config's `watermark_blocks`, or a hybrid cache's watermark in pages.
    pub(crate) fn arena_watermark(&self) -> usize {
        match &self.hybrid {
            Some(h) => h.watermark_pages(),
            None => self.config.watermark_blocks,
        }
    }

    // ---- internals ----------------------------------------------------------------

    fn occupancy(&self) -> Occupancy {
        let states = self.pool.states();
        let high_water = states
            .iter()
            .rposition(|s| *s != BlockState::Free)
            .map_or(0, |i| i + 1);
        Occupancy {
            resident: self.pool.num_live() + self.pool.num_cached(),
            high_water,
        }
    }

    fn check_new_size(&self, num_blocks: usize) -> Result<()> {
        if num_blocks == 0 || num_blocks <= self.config.watermark_blocks {
            return Err(Error::config(
                "num_blocks",
                format!(
                    "{num_blocks} blocks; the arena needs more than the watermark of {}",
                    self.config.watermark_blocks
                ),
            ));
        }
        Ok(())
    }

    /// Moves the highest resident blocks at or above `target` (at most `max_moves` of
    /// them) into the lowest free blocks below `target`, leaving the blocks `pinned`
    /// flags where they are. Sources and destinations are both listed ascending, so
    /// neighbours merge into runs.
    ///
    /// The caller guarantees `target >= resident`, so the holes below `target` are at
    /// least as many as the resident blocks above it (pinned or not).
    fn plan_moves(&self, target: usize, max_moves: usize, pinned: Option<&[bool]>) -> MovePlan {
        let states = self.pool.states();
        let is_pinned = |b: usize| pinned.is_some_and(|p| p.get(b).copied().unwrap_or(false));
        let mut sources: Vec<u32> = Vec::new();
        let mut hi = states.len();
        while hi > target && sources.len() < max_moves {
            hi -= 1;
            if states[hi] != BlockState::Free && !is_pinned(hi) {
                sources.push(hi as u32);
            }
        }
        sources.reverse();
        let mut plan = MovePlan::new();
        let mut lo = 0;
        for &src in &sources {
            while lo < target && states[lo] != BlockState::Free {
                lo += 1;
            }
            if lo >= target {
                // Unreachable when `target >= resident`; stop rather than plan a move
                // into an occupied block.
                break;
            }
            plan.push(BlockId(src), BlockId(lo as u32));
            lo += 1;
        }
        plan
    }

    /// Applies executed moves: each source's state, refcount and fill pass to its
    /// destination, the source is freed, and every table entry naming a source is
    /// remapped in one pass. Validates the whole plan first, so an error leaves
    /// everything unchanged.
    pub(crate) fn commit_moves(&mut self, plan: &MovePlan) -> Result<()> {
        let moves = plan.moves();
        let (Some(first), Some(last)) = (moves.first(), moves.last()) else {
            return Ok(());
        };
        self.defrag_counters.runs += 1;
        self.defrag_counters.moved_blocks += moves.len() as u64;
        // The planner's shape: strictly ascending sources and destinations, every
        // destination below every source. It makes sources and destinations distinct
        // without a set.
        let ascending = moves
            .windows(2)
            .all(|w| w[0].src < w[1].src && w[0].dst < w[1].dst);
        if !ascending || last.dst >= first.src {
            return Err(Error::CorruptBlockTable(
                "move plan is not ascending with destinations below sources".into(),
            ));
        }
        for m in moves {
            if self.pool.state(m.src)? == BlockState::Free {
                return Err(Error::CorruptBlockTable(format!(
                    "move source {} is free",
                    m.src
                )));
            }
            if self.pool.state(m.dst)? != BlockState::Free {
                return Err(Error::CorruptBlockTable(format!(
                    "move destination {} is not free",
                    m.dst
                )));
            }
        }

        self.tables_changed();
        let base = first.src.0;
        let mut move_map = vec![u32::MAX; (last.src.0 - base) as usize + 1];
        for m in moves {
            self.pool.relocate(m.src, m.dst)?;
            self.on_block_moved(m.src, m.dst)?;
            move_map[(m.src.0 - base) as usize] = m.dst.0;
        }
        let remap = |b: &mut BlockId| {
            if let Some(&dst) = b.0.checked_sub(base).and_then(|i| move_map.get(i as usize)) {
                if dst != u32::MAX {
                    b.0 = dst;
                }
            }
        };
        // Tables (`BlockId::RELEASED` holes are never in the move range) and the
        // cached copy a pending twin will share both name device blocks.
        for s in self.seqs.values_mut() {
            s.table
                .iter_mut()
                .filter(|b| **b != BlockId::RELEASED)
                .for_each(remap);
            if let Some(copy) = s.prefix.as_deref_mut().and_then(|p| p.twin_copy_mut()) {
                remap(copy);
            }
        }
        Ok(())
    }

    /// Blocks must not move while a swap transfer reads or writes them.
    fn check_no_transfers(&self) -> Result<()> {
        match self.tiers.num_in_flight() {
            0 => Ok(()),
            n => Err(Error::Unsupported(format!(
                "defragmentation with {n} swap transfers in flight; complete or abort them first"
            ))),
        }
    }

    /// Called once per moved block, after the pool relocated it (with its fill):
    /// everything else keyed by physical block id follows the data from `src` to `dst`
    /// (the fill-recount flag and the prefix cache's hash -> block index).
    pub(crate) fn on_block_moved(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        if self.fill_dirty.remove(&src) {
            self.fill_dirty.insert(dst);
        }
        self.prefix.relocate(src, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::SeqId;
    use crate::layout::shape::{DType, ModelShape};
    use crate::layout::KvLayout;
    use crate::manager::CacheConfig;

    fn manager(num_blocks: usize) -> KvCache {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 1,
            num_kv_heads: 1,
            head_dim: 4,
            kv_dtype: DType::F16,
        };
        let layout = KvLayout::new(shape, 2).unwrap();
        let mut config = CacheConfig::new(num_blocks);
        config.watermark_blocks = 0;
        KvCache::new(layout, config).unwrap()
    }

    #[test]
    fn planner_pairs_top_sources_with_bottom_holes_ascending() {
        let mut kv = manager(8);
        let mut slots = Vec::new();
        for i in 0..8 {
            kv.admit(SeqId(i), 2, &mut slots).unwrap();
        }
        for i in [0, 2, 3] {
            kv.free(SeqId(i)).unwrap();
        }
        // Resident: 1, 4, 5, 6, 7 -> target 5; holes below 5: 0, 2, 3; sources 5, 6, 7.
        let pending = kv.plan_defragment(DefragOptions::FULL).unwrap();
        let moves: Vec<(u32, u32)> = pending
            .plan()
            .moves()
            .iter()
            .map(|m| (m.src.0, m.dst.0))
            .collect();
        assert_eq!(moves, vec![(5, 0), (6, 2), (7, 3)]);
        drop(pending);
        // Incremental: the highest first.
        let pending = kv.plan_defragment(DefragOptions::incremental(1)).unwrap();
        assert_eq!(pending.plan().moves()[0].src, BlockId(7));
        assert_eq!(pending.plan().moves()[0].dst, BlockId(0));
    }

    #[test]
    fn aborted_plan_changes_nothing_and_commit_remaps() {
        let mut kv = manager(4);
        let mut slots = Vec::new();
        kv.admit(SeqId(1), 2, &mut slots).unwrap();
        kv.admit(SeqId(2), 2, &mut slots).unwrap();
        kv.free(SeqId(1)).unwrap();
        drop(kv.plan_defragment(DefragOptions::FULL).unwrap());
        assert_eq!(kv.block_table(SeqId(2)).unwrap(), &[BlockId(1)]);
        let plan = kv
            .plan_defragment(DefragOptions::FULL)
            .unwrap()
            .commit()
            .unwrap();
        assert_eq!(plan.len(), 1);
        assert_eq!(kv.block_table(SeqId(2)).unwrap(), &[BlockId(0)]);
        kv.check_invariants().unwrap();
        // The freed source is not handed out before the lower free blocks.
        kv.admit(SeqId(3), 2, &mut slots).unwrap();
        assert_eq!(kv.block_table(SeqId(3)).unwrap(), &[BlockId(1)]);
    }

    #[test]
    fn cached_blocks_follow_compaction() {
        let mut kv = manager(8);
        let mut slots = Vec::new();
        for i in 0..7 {
            kv.admit(SeqId(i), 2, &mut slots).unwrap();
        }
        // Block 7 is registered in the prefix cache and stays there, cached, once freed.
        let opts = crate::pool::prefix::AdmitOptions::default();
        kv.admit_tokens(SeqId(7), &[5, 6], &opts, &mut slots)
            .unwrap();
        let cached = kv.block_table(SeqId(7)).unwrap()[0];
        assert_eq!(cached, BlockId(7));
        kv.free(SeqId(7)).unwrap();
        assert_eq!(kv.pool.state(cached).unwrap(), BlockState::Cached);
        for i in 0..6 {
            kv.free(SeqId(i)).unwrap();
        }
        let f = kv.fragmentation();
        assert_eq!(
            (f.live_blocks, f.cached_blocks, f.moves_to_compact),
            (1, 1, 2)
        );
        // Bookkeeping only: the bytes are the executor's (tests/memory/defrag.rs checks them).
        let plan = kv
            .plan_defragment(DefragOptions::FULL)
            .unwrap()
            .commit()
            .unwrap();
        assert_eq!(plan.runs(), vec![(6, 0, 2)]);
        assert_eq!(kv.pool.state(BlockId(1)).unwrap(), BlockState::Cached);
        assert_eq!(kv.block_table(SeqId(6)).unwrap(), &[BlockId(0)]);
        kv.check_invariants().unwrap();
        // The cache entry followed its block: the same prompt hits block 1.
        let hit = kv.cached_prefix_len(&[5, 6, 7], &opts).unwrap();
        assert_eq!(hit, 2);
        assert_eq!(
            kv.plan_shrink(1).map(|p| p.num_blocks()),
            Err(Error::ShrinkBelowResident {
                requested: 1,
                live: 1,
                cached: 1
            })
        );
        assert!(kv.plan_shrink(2).unwrap().plan().is_empty());
        kv.plan_shrink(2).unwrap().commit().unwrap();
        assert_eq!(kv.num_blocks(), 2);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn bad_options_are_rejected() {
        let mut kv = manager(4);
        for opts in [
            DefragOptions::incremental(0),
            DefragOptions::FULL.above(1.5),
            DefragOptions::FULL.above(f64::NAN),
        ] {
            assert!(matches!(
                kv.plan_defragment(opts),
                Err(Error::InvalidConfig { .. })
            ));
        }
    }
}
