//! A sequence's life after admission: truncation, forks and their groups, free.

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};

use super::{swap, KvCache};

impl KvCache {
    /// Drops the last slots of `seq` so it holds `new_len` (rejected speculative
    /// tokens on the one-call path, lookahead slots no longer wanted); blocks no longer
    /// needed are released and the computed count follows.
    ///
    /// A sequence holding an uncommitted reservation is refused: the step is writing
    /// through the slots it was handed, and the blocks this would release are among
    /// them (nothing frees a block a step is writing). Commit first; `commit(seq, 0)`
    /// cancels the reservation, and its slots stay allocated for `truncate` to drop.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::PastEnd`] when `new_len` is longer than
    /// the sequence; [`Error::SequenceState`] when it is swapped out, has a swap in
    /// flight or holds an uncommitted reservation. Nothing changed on error.
    pub fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        if let Some(h) = &mut self.hybrid {
            return h.truncate(seq, new_len);
        }
        self.check_truncate(seq, new_len)?;
        self.truncate_checked(seq, new_len)
    }

    /// The refusals of [`Self::truncate`], changing nothing.
    pub(crate) fn check_truncate(&self, seq: SeqId, new_len: usize) -> Result<()> {
        let s = self.idle(seq)?;
        if new_len > s.num_tokens {
            return Err(Error::PastEnd {
                seq,
                end: new_len,
                len: s.num_tokens,
            });
        }
        self.check_truncate_window(seq, s, new_len)
    }

    /// [`Self::truncate`] once [`Self::check_truncate`] passed: an error here is the
    /// manager's own corruption.
    pub(crate) fn truncate_checked(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        let h = self
            .seqs
            .handle(&seq)
            .ok_or_else(|| self.absent_error(seq))?;
        self.tables_changed();
        // Out of its slot while blocks are released (see `replace_protected`).
        let mut s = self.seqs.take(h).ok_or(Error::StaleHandle(h))?;
        let keep = self.layout.blocks_for_tokens(new_len);
        let result = self.release_table(s.table.get(keep..).unwrap_or(&[]));
        s.table.truncate(keep);
        let tail = new_len % self.block_size();
        if let Some(&last) = s.table.last() {
            if tail != 0 {
                // A shared block keeps what its other holders hold (`s` is out of the
                // map, so the scan sees only them).
                let want = if self.pool.refcount(last)? == 1 {
                    tail
                } else {
                    self.fill_dirty.insert(last);
                    self.holders_fill(last).max(tail)
                };
                self.set_fill(last, want);
            }
        }
        s.num_tokens = new_len;
        // No reservation (`idle` above): only the computed count follows.
        s.computed = s.computed.min(new_len);
        self.prefix_after_truncate(&mut s, new_len);
        self.seqs.put(h, s);
        result
    }

    /// Puts `seq` in the fork group of `with` (see [`crate::manager::preempt`]: a
    /// group is preempted as a whole, and its age is its admission's). Siblings that a
    /// recompute preemption sent back are re-admitted one by one, each starting a
    /// group of its own; joining them again keeps preemption from splitting a request
    /// whose samples must all finish. `with` may be swapped out. Blocks are not
    /// shared by this (a re-admission shares its prompt through the prefix cache).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`] for either; [`Error::SequenceState`] when `seq` is
    /// swapped out or has a swap in flight. Nothing changed on error.
    pub fn join_fork_group(&mut self, seq: SeqId, with: SeqId) -> Result<()> {
        if let Some(h) = &mut self.hybrid {
            return h.join_fork_group(seq, with);
        }
        let admission = match self.seqs.get(&with) {
            Some(s) => s.admission,
            None => self
                .tiers
                .swapped
                .get(&with)
                .map(|s| s.admission)
                .ok_or(Error::UnknownSequence(with))?,
        };
        self.resident(seq)?;
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.admission = admission;
        }
        Ok(())
    }

    /// Forks `parent` into a new sequence `child` that shares every block
    /// (parallel sampling, beam search). Copy-on-write happens on the next append.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`] for the parent, [`Error::DuplicateSequence`] for the
    /// child, [`Error::SequenceState`] when the parent is swapped out, has a swap in
    /// flight or holds an uncommitted reservation. Nothing changed on error.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if let Some(h) = &mut self.hybrid {
            return h.fork(parent, child);
        }
        let p = self.idle(parent)?;
        if self.contains(child) {
            return Err(Error::DuplicateSequence(child));
        }
        let mut c = p.clone();
        let room = self.config.table_capacity_blocks.max(c.table.len() + 1);
        c.table.reserve_exact(room - c.table.len());
        self.seqs.reserve_room(1)?;
        self.pool.incref_all(&c.table[c.released..])?;
        self.seqs.insert(child, c)?;
        Ok(())
    }

    /// An empty block table with room for `blocks` entries, one more, and
    /// [`CacheConfig::table_capacity_blocks`].
    pub(crate) fn new_table(&self, blocks: usize) -> Vec<BlockId> {
        Vec::with_capacity(self.config.table_capacity_blocks.max(blocks + 1))
    }

    /// Frees `seq`; blocks nobody else references are released (host and disk blocks
    /// too when it is swapped out).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] while a swap of `seq` is in
    /// flight (complete or abort it first). A refcount error here means the manager's
    /// own state was corrupt; it is reported after every block was processed.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        if let Some(h) = &mut self.hybrid {
            return h.free(seq);
        }
        // Two lookups of the id (its handle, then its removal), not three.
        let Some(h) = self.seqs.handle(&seq) else {
            return self.free_swapped(seq);
        };
        if let Some((_, s)) = self.seqs.at(h) {
            swap::check_resident(seq, s)?;
        }
        let s = self.seqs.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        self.release_table(&s.table[s.released..])
    }
}
