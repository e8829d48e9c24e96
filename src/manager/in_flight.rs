//! Blocks in flight: those a step is writing.
//!
//! Between [`KvCache::reserve`] (or [`KvCache::reserve_step`]) and
//! [`KvCache::commit`] the model writes K/V through the slots it was handed, and
//! reads the context through the table it was handed, so every block of a sequence
//! holding an uncommitted reservation is in flight. Nothing may move, free or remap
//! such a block until the commit (the [engine contract](crate::guide::engine_contract)): the slots would go
//! stale and the step's write land in a freed block, with `check_invariants` none the
//! wiser.
//!
//! This module is the one place that says which blocks those are, as
//! [`KvCache::readable_blocks`] is the one place that says what a reader may
//! read. Every mover asks it:
//!
//! - per sequence (`KvCache::idle`): preemption, fork, swap-out and
//!   `truncate` (whose released tail holds the reservation's slots) refuse a sequence
//!   mid-step with [`Error::SequenceState`];
//! - per block ([`KvCache::in_flight_blocks`]): defragmentation (of one manager
//!   or of KV-cache groups) plans around them, they stay put;
//! - per tail ([`KvCache::check_tail_not_in_flight`]): a shrink whose released
//!   tail holds one refuses, changing nothing;
//! - per manager ([`KvCache::mid_step_sequence`]): the broker takes no memory
//!   from a model mid-step, and does not put it to sleep.
//!
//! The other movers respect it without asking, because a sequence mid-step holds a
//! reference to every block of its table (so none of them is free or cached) and is
//! resident (so it has no host or disk blocks):
//!
//! - grow (`plan_grow`, `executor::grow_to`): adds free blocks at the tail and plans
//!   no move; block ids, and so slots, stay what they were (a CUDA arena grows its
//!   virtual mapping in place);
//! - disk spill and restore (`plan_spill` / `plan_restore`, `executor::spill_to_disk`
//!   / `restore_from_disk`), the host<->disk tier moves: they take only swapped-out
//!   sequences, and copy between host blocks and disk slots, never device blocks;
//! - prefix spill and restore (`plan_prefix_spill` / `plan_prefix_restore`): the
//!   spill copies and evicts only evictable cached blocks, the restore writes only
//!   free device blocks;
//! - prefix reset and eviction (`reset_prefix_cache`, `evict_cached`): drop only
//!   cached blocks, never a block a table references, one that a reservation revived
//!   included (`tests/memory/movers.rs`);
//! - import (`ExportView::import_into[_cache]`, group exports alike): admits a new
//!   sequence ([`Error::DuplicateSequence`] rather than replacing one); its evictions,
//!   on admission or after a failed write, drop only cached blocks;
//! - group page lending (`give_pages`, `move_page`, `reclaim_page` in
//!   `manager/groups/`): lends only free pages and reclaims only pages the hidden
//!   lender holds, which reserves nothing, so no mid-step table names either.
//!
//! `free` of a sequence mid-step is its owner abandoning the step, not a mover: it
//! goes through.
//!
//! Swap transfers in flight are the other kind of block in flight; the movers refuse
//! them separately (their blocks are held by the tier, not by a reservation).

use super::{KvCache, Sequence};
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};

/// Whether `s` holds an uncommitted reservation: the step that reserved is writing
/// into its blocks.
#[inline]
pub(crate) fn is_mid_step(s: &Sequence) -> bool {
    s.scheduled > 0
}

/// The typed refusal of a call that would move, free or remap the blocks of `seq`,
/// which is mid-step.
pub(crate) fn mid_step_error(seq: SeqId) -> Error {
    Error::SequenceState {
        seq,
        state: "holding an uncommitted reservation (in this step's batch)",
        needed: "committed (commit first; cancel(seq) drops every reservation)",
    }
}

impl KvCache {
    /// The lowest-numbered sequence holding an uncommitted reservation, if any
    /// (O(sequences)).
    pub(crate) fn mid_step_sequence(&self) -> Option<SeqId> {
        if let Some(h) = &self.hybrid {
            return h.mid_step_sequence();
        }
        self.seqs
            .iter()
            .filter(|(_, s)| is_mid_step(s))
            .map(|(&id, _)| id)
            .min()
    }

    /// Refuses with [`Self::mid_step_sequence`]'s error while any sequence is mid-step.
    pub(crate) fn check_no_step_in_flight(&self) -> Result<()> {
        self.mid_step_sequence()
            .map_or(Ok(()), |seq| Err(mid_step_error(seq)))
    }

    /// One flag per block of the arena: whether a sequence mid-step holds it. `None`
    /// when no sequence is mid-step (the common case: no allocation).
    pub(crate) fn in_flight_blocks(&self) -> Option<Vec<bool>> {
        let mut flags: Option<Vec<bool>> = None;
        for s in self.seqs.values().filter(|s| is_mid_step(s)) {
            let flags = flags.get_or_insert_with(|| vec![false; self.num_blocks()]);
            for b in held(s) {
                if let Some(f) = flags.get_mut(b.index()) {
                    *f = true;
                }
            }
        }
        flags
    }

    /// Refuses when a sequence mid-step holds a block at or above `new_len`: shrinking
    /// the arena to `new_len` blocks would move it.
    pub(crate) fn check_tail_not_in_flight(&self, new_len: usize) -> Result<()> {
        let seq = self
            .seqs
            .iter()
            .filter(|(_, s)| is_mid_step(s) && held(s).any(|b| b.index() >= new_len))
            .map(|(&id, _)| id)
            .min();
        seq.map_or(Ok(()), |seq| Err(mid_step_error(seq)))
    }
}

/// The device blocks `s`'s table names (not the holes a sliding window left).
fn held(s: &Sequence) -> impl Iterator<Item = BlockId> + '_ {
    s.table[s.released..]
        .iter()
        .copied()
        .filter(|&b| b != BlockId::RELEASED)
}
