//! Sliding-window managers: which blocks a sequence still needs, and giving back
//! those that left the window (the holes of `BlockId::RELEASED`).

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqHandle, SeqId};

use super::{KvCache, Sequence};

impl KvCache {
    /// The sliding window, in tokens (`None`: every layer attends to the whole
    /// context and nothing is given back).
    pub fn sliding_window(&self) -> Option<usize> {
        if let Some(g0) = self.first_group() {
            return g0.sliding_window();
        }
        self.window
    }

    /// The first table index the query at position `query` reads under the window:
    /// it reads keys `query + 1 - window ..= query` (see
    /// [`crate::attention::AttentionParams::window_start`]).
    pub(super) fn first_block_in_window(&self, query: usize) -> usize {
        match self.window {
            Some(w) => (query + 1).saturating_sub(w) / self.block_size(),
            None => 0,
        }
    }

    /// Gives back the blocks of sequence `h` that lie entirely before the window of
    /// the query at position `query` (the earliest query still to be computed),
    /// leaving [`BlockId::RELEASED`] holes. Called whenever `computed` grows: by
    /// `commit` with the new count, by the one-call paths with the step's first
    /// position (their step is computed after the call). O(1) amortised per token:
    /// each block is released once.
    pub(super) fn release_out_of_window(&mut self, h: SeqHandle, query: usize) -> Result<()> {
        let (_, s) = self.seqs.at(h).ok_or(Error::StaleHandle(h))?;
        let keep_from = self.first_block_in_window(query).min(s.table.len());
        if keep_from <= s.released {
            return Ok(());
        }
        // No table epoch bump: the entries that change are the sequence's leading
        // ones, which `StepBuffers` rows track by the released count (see
        // `manager/step.rs`), so other rows stay current.
        // Out of its slot while blocks are released (see `replace_protected`).
        let mut s = self.seqs.take(h).ok_or(Error::StaleHandle(h))?;
        let mut result = Ok(());
        for i in s.released..keep_from {
            let b = std::mem::replace(&mut s.table[i], BlockId::RELEASED);
            if let Err(e) = self.release_block(b) {
                result = result.and(Err(e));
            }
        }
        s.released = keep_from;
        self.seqs.put(h, s);
        result
    }

    /// Fails when a truncation of `s` to `new_len` would leave its next query with
    /// keys in blocks the window already gave back.
    pub(super) fn check_truncate_window(
        &self,
        seq: SeqId,
        s: &Sequence,
        new_len: usize,
    ) -> Result<()> {
        let computed = s.computed.min(new_len);
        if s.released > 0 && self.first_block_in_window(computed) < s.released {
            return Err(Error::SequenceState {
                seq,
                state: "holding no blocks for the window of that length (given back)",
                needed: "a length whose window starts after the released blocks",
            });
        }
        Ok(())
    }
}
