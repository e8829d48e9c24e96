//! Block tables of a batch, in the two forms kernels take, and their validation.
//!
//! This layer sits above the manager (which it asks for tables) and below the
//! executor and attention (which read the views); it never names either.

mod validate;

pub use validate::{validate_csr, validate_tables, validate_tables_window, MAX_CONTEXT_TOKENS};

use crate::error::{Error, Result};
use crate::ids::SeqId;
use crate::manager::KvCache;

/// Defined with the layout, where the manager's step buffers can hold one.
pub use crate::layout::PaddedTables;

/// CSR block tables: `indices[indptr[i]..indptr[i+1]]` are sequence `i`'s blocks and
/// `last_page_len[i]` the tokens in its last block (the form FlashInfer takes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CsrTables {
    /// `batch + 1` offsets into `indices`.
    pub indptr: Vec<u32>,
    /// All block ids of the batch, one sequence after another.
    pub indices: Vec<u32>,
    /// Tokens in each sequence's last block (1..=block_size; 0 for an empty sequence).
    pub last_page_len: Vec<u32>,
}

impl KvCache {
    /// The rows of a batch: each sequence's context (computed plus this step's
    /// reserved tokens, never lookahead slots) and the blocks covering it. Fails on
    /// the first sequence that is unknown or not readable.
    fn row(&self, id: SeqId) -> Result<(&[crate::ids::BlockId], usize)> {
        // The state check export uses too: one predicate for reading a sequence.
        self.readable_blocks(id)?;
        let s = self.seq(id)?;
        let context = s.computed + s.scheduled;
        let blocks = self.layout().blocks_for_tokens(context);
        Ok((&s.table[..blocks], context))
    }

    fn check_batch(&self, seqs: &[SeqId]) -> Result<usize> {
        let mut max_blocks = 0;
        for &id in seqs {
            max_blocks = max_blocks.max(self.row(id)?.0.len());
        }
        Ok(max_blocks)
    }

    /// Fills `out` with the padded tables of `seqs`, reusing its buffers (no allocation
    /// once they have grown to the batch's size).
    ///
    /// # Errors
    /// [`crate::Error::UnknownSequence`], [`crate::Error::SequenceState`] for a sequence swapped out or
    /// with a swap in flight (its blocks are not readable); `out` is untouched on error.
    pub fn fill_padded(&self, seqs: &[SeqId], out: &mut PaddedTables) -> Result<()> {
        // A hybrid cache's tables are its groups': `kv.group(g).fill_padded(..)`.
        self.one_group("fill_padded")?;
        let max_blocks = self.check_batch(seqs)?;
        self.fill_padded_shape(seqs, seqs.len(), max_blocks, out)
    }

    /// Fills `out` with padded tables of a fixed shape, `[max_batch, max_blocks]`, the
    /// shape a captured CUDA graph replays: rows past `seqs` have context 0, entries past
    /// a row's blocks are 0 (never read). With buffers sized once, no step allocates.
    ///
    /// # Errors
    /// As [`Self::fill_padded`]; [`crate::Error::ShapeMismatch`] when `seqs` has more
    /// than `max_batch` sequences or one needs more than `max_blocks` blocks; `out` is
    /// untouched on error.
    pub fn fill_padded_fixed(
        &self,
        seqs: &[SeqId],
        max_batch: usize,
        max_blocks: usize,
        out: &mut PaddedTables,
    ) -> Result<()> {
        // A hybrid cache's tables are its groups': `kv.group(g).fill_padded_fixed(..)`.
        self.one_group("fill_padded_fixed")?;
        if seqs.len() > max_batch {
            return Err(Error::ShapeMismatch {
                what: "sequences in a fixed-shape batch (max_batch)",
                expected: max_batch,
                got: seqs.len(),
            });
        }
        let widest = self.check_batch(seqs)?;
        if widest > max_blocks {
            return Err(Error::ShapeMismatch {
                what: "blocks of a row in a fixed-shape batch (max_blocks)",
                expected: max_blocks,
                got: widest,
            });
        }
        self.fill_padded_shape(seqs, max_batch, max_blocks, out)
    }

    /// Fills `batch` rows of `max_blocks` entries; the caller checked that `seqs` fit.
    fn fill_padded_shape(
        &self,
        seqs: &[SeqId],
        batch: usize,
        max_blocks: usize,
        out: &mut PaddedTables,
    ) -> Result<()> {
        out.tables.clear();
        out.context_lens.clear();
        out.batch = batch;
        out.max_blocks = max_blocks;
        out.tables.resize(batch * max_blocks, 0);
        out.context_lens.resize(batch, 0);
        for (row, &id) in seqs.iter().enumerate() {
            let (table, context) = self.row(id)?;
            let dst = &mut out.tables[row * max_blocks..row * max_blocks + table.len()];
            for (d, b) in dst.iter_mut().zip(table) {
                *d = b.0;
            }
            out.context_lens[row] = context as u32;
        }
        Ok(())
    }

    /// Fills `out` with the CSR tables of `seqs`, reusing its buffers.
    ///
    /// # Errors
    /// [`crate::Error::UnknownSequence`], [`crate::Error::SequenceState`] for a sequence swapped out or
    /// with a swap in flight (its blocks are not readable); `out` is untouched on error.
    pub fn fill_csr(&self, seqs: &[SeqId], out: &mut CsrTables) -> Result<()> {
        // A hybrid cache's tables are its groups': `kv.group(g).fill_csr(..)`.
        self.one_group("fill_csr")?;
        self.check_batch(seqs)?;
        out.indptr.clear();
        out.indices.clear();
        out.last_page_len.clear();
        out.indptr.push(0);
        let bs = self.block_size();
        for &id in seqs {
            let (table, context) = self.row(id)?;
            out.indices.extend(table.iter().map(|b| b.0));
            out.indptr.push(out.indices.len() as u32);
            let last = match context {
                0 => 0,
                n => (n - 1) % bs + 1,
            };
            out.last_page_len.push(last as u32);
        }
        Ok(())
    }

    /// Checks block tables that came from outside (an engine's own buffers, a remote
    /// peer) before a kernel reads through them: every entry a context covers must name
    /// a live block of this arena, and every context must fit its row. Catches tables that
    /// point outside the arena or at freed (or merely cached) blocks.
    ///
    /// # Errors
    /// As [`validate_tables`] (inconsistent dimensions, a context its
    /// row does not cover, an entry outside the arena), and [`Error::CorruptBlockTable`]
    /// for an entry naming a block that is not live.
    pub fn check_padded(&self, tables: &PaddedTables) -> Result<()> {
        // A hybrid cache's tables are its groups': `kv.group(g).check_padded(..)`.
        self.one_group("check_padded")?;
        // Shapes, coverage and arena bounds: the checks that guard kernel launches.
        // Under the manager's window, holes before a decode query's window pass.
        validate_tables_window(&self.layout, self.num_blocks(), tables, self.window, None)?;
        for (row, &ctx) in tables.context_lens.iter().enumerate() {
            let used = self.layout.blocks_for_tokens(ctx as usize);
            for &b in &tables.row(row)[..used] {
                let b = crate::ids::BlockId(b);
                if b != crate::ids::BlockId::RELEASED {
                    self.check_live(b)?;
                }
            }
        }
        Ok(())
    }

    /// [`Self::check_padded`] for CSR tables.
    ///
    /// # Errors
    /// As [`validate_csr`], and [`Error::CorruptBlockTable`] for an
    /// index naming a block that is not live.
    pub fn check_csr(&self, tables: &CsrTables) -> Result<()> {
        // A hybrid cache's tables are its groups': `kv.group(g).check_csr(..)`.
        self.one_group("check_csr")?;
        validate_csr(&self.layout, self.num_blocks(), tables)?;
        for &b in &tables.indices {
            self.check_live(crate::ids::BlockId(b))?;
        }
        Ok(())
    }

    fn check_live(&self, b: crate::ids::BlockId) -> Result<()> {
        match self.pool.state(b)? {
            crate::pool::BlockState::Live => Ok(()),
            state => Err(Error::CorruptBlockTable(format!(
                "table names block {b}, which is {state:?}"
            ))),
        }
    }
}

/// Table builders shared by the kernels' CPU replay tests.
#[cfg(test)]
pub(crate) mod test_tables {
    use super::PaddedTables;

    /// Padded tables for `ctxs` tokens per sequence in blocks of `block_size`, the
    /// blocks of an arena of `num_blocks` handed out in a scrambled order (from the top
    /// down, the first and third swapped), so a kernel that ignores the table fails.
    pub(crate) fn scrambled(ctxs: &[usize], block_size: usize, num_blocks: usize) -> PaddedTables {
        let blocks_per: Vec<usize> = ctxs.iter().map(|c| c.div_ceil(block_size)).collect();
        let max_blocks = blocks_per.iter().copied().max().unwrap_or(0);
        let mut tables = vec![0u32; ctxs.len() * max_blocks];
        let mut order: Vec<u32> = (0..num_blocks as u32).rev().collect();
        order.swap(0, 2);
        let mut next = 0;
        for (i, &nb) in blocks_per.iter().enumerate() {
            for j in 0..nb {
                tables[i * max_blocks + j] = order[next];
                next += 1;
            }
        }
        PaddedTables {
            tables,
            context_lens: ctxs.iter().map(|&c| c as u32).collect(),
            batch: ctxs.len(),
            max_blocks,
        }
    }
}
