//! The step path: one call reserves every sequence of a model step and fills the
//! buffers the step reads, one call commits what the step accepted.
//!
//! [`KvCache::reserve_step`] is [`KvCache::reserve`] for a whole batch,
//! reached by handle (no id is hashed), checked as a whole before anything changes,
//! and writing straight into fixed-capacity [`StepBuffers`]: vLLM's slot mapping
//! (`i64`, `-1` for padding), positions, `query_start_loc`, the padded block tables
//! with their context lengths (the [`PaddedTables`] this crate's kernels read) and the
//! step's copy-on-write copies. Sized once, the buffers never allocate, so their
//! addresses can be captured by a CUDA graph; [`StepBuffers::pad_to`] pads a batch up
//! to a captured shape. [`KvCache::commit_step`] commits every sequence's
//! accepted tokens, also checked as a whole first.
//!
//! A table row is written only where it changed: the buffers remember which sequence
//! each row held, how much of its table they wrote and how many leading entries are
//! holes, and the manager counts every other change to an entry already handed out (a
//! copy-on-write, a shared cached copy, a truncation, a defragmentation). While that
//! count stands, a sequence in the same row as last step gets only its new entries
//! written, and the holes a window's release made since.

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqHandle, SeqId};
use crate::layout::plans::CopyPlan;
use crate::layout::{PaddedTables, Slot};

use super::groups::Groups;
use super::{swap, KvCache};

/// One sequence's part of a step: `new_tokens` query tokens after its computed ones
/// (a prefill chunk, or a decode token and its drafts), then `lookahead` slots
/// reserved for later (never context, not in the step's buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepEntry {
    /// The sequence ([`KvCache::handle`]).
    pub seq: SeqHandle,
    /// Query tokens this step computes.
    pub new_tokens: usize,
    /// Slots reserved after the query tokens.
    pub lookahead: usize,
}

/// The inputs of one model step, filled by [`KvCache::reserve_step`] into
/// buffers allocated once ([`StepBuffers::new`]) at fixed capacities.
///
/// What a caller may rely on: after every reservation that succeeds, each buffer
/// holds what a fill from scratch would (the slots, positions and query starts of
/// this step's entries; row `i` of the tables the blocks of entry `i`'s context,
/// [`BlockId::RELEASED`] for a window's given-back blocks and 0 past them; the
/// context lengths; this step's copies), whatever the buffers held before and
/// whichever cache filled them last. The tables are kept between steps and only the
/// entries that changed are written (see the module docs), which stays invisible:
/// the buffers are read through shared references only, a refused reservation
/// leaves them as they were, and [`Self::pad_to`] writes only padding. A clone
/// carries what its rows hold, so it may be filled in place of the original.
#[derive(Debug, Clone)]
pub struct StepBuffers {
    max_seqs: usize,
    max_tokens: usize,
    slot_mapping: Vec<i64>,
    positions: Vec<i64>,
    query_start_loc: Vec<u32>,
    tables: PaddedTables,
    /// Per row: what its table entries hold (one record per row: a step reads it
    /// for every row).
    written: Vec<RowWritten>,
    /// The manager's table epoch the rows were written against.
    written_for: Option<u64>,
    copies: CopyPlan,
    scratch: Vec<Slot>,
    /// Rows and query tokens of the step, before padding.
    rows: usize,
    tokens: usize,
}

impl StepBuffers {
    /// Buffers for steps of at most `max_seqs` sequences and `max_tokens` query
    /// tokens, with table rows of `table_width` blocks (the blocks of the longest
    /// context).
    pub fn new(max_seqs: usize, max_tokens: usize, table_width: usize) -> Self {
        let mut tables = PaddedTables {
            tables: Vec::with_capacity(max_seqs * table_width),
            context_lens: Vec::with_capacity(max_seqs),
            batch: 0,
            max_blocks: table_width,
        };
        tables.tables.clear();
        StepBuffers {
            max_seqs,
            max_tokens,
            slot_mapping: Vec::with_capacity(max_tokens),
            positions: Vec::with_capacity(max_tokens),
            query_start_loc: Vec::with_capacity(max_seqs + 1),
            tables,
            written: vec![RowWritten::default(); max_seqs],
            written_for: None,
            copies: CopyPlan::new(),
            scratch: Vec::with_capacity(max_tokens),
            rows: 0,
            tokens: 0,
        }
    }

    /// The slot of every query token, in batch order (`-1` for padding): the input
    /// of a `reshape_and_cache` kernel.
    pub fn slot_mapping(&self) -> &[i64] {
        &self.slot_mapping
    }

    /// The position of every query token in its sequence (0 for padding).
    pub fn positions(&self) -> &[i64] {
        &self.positions
    }

    /// `rows + 1` offsets: row `i`'s query tokens are
    /// `query_start_loc[i]..query_start_loc[i + 1]`.
    pub fn query_start_loc(&self) -> &[u32] {
        &self.query_start_loc
    }

    /// The block tables, `rows x table_width`, and each row's context length (the
    /// computed tokens plus this step's; 0 for padding). Entries past a row's blocks
    /// are 0, never read.
    pub fn tables(&self) -> &PaddedTables {
        &self.tables
    }

    /// The copy-on-write copies to run before the step writes.
    pub fn copies(&self) -> &CopyPlan {
        &self.copies
    }

    /// Rows of the step, padding included.
    pub fn rows(&self) -> usize {
        self.tables.batch
    }

    /// Query tokens of the step, padding included.
    pub fn num_tokens(&self) -> usize {
        self.slot_mapping.len()
    }

    /// Rows and query tokens the reservation filled, before padding.
    pub fn unpadded(&self) -> (usize, usize) {
        (self.rows, self.tokens)
    }

    /// Pads the step to `rows` rows and `tokens` query tokens (a captured CUDA
    /// graph's shape): padding rows have no query and context 0, padding tokens slot
    /// `-1`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shape is below the step's or above the
    /// buffers' capacity; nothing changed.
    pub fn pad_to(&mut self, rows: usize, tokens: usize) -> Result<()> {
        if rows < self.tables.batch || rows > self.max_seqs {
            return Err(Error::ShapeMismatch {
                what: "padded rows of a step (at least the step's, at most max_seqs)",
                expected: self.max_seqs,
                got: rows,
            });
        }
        if tokens < self.slot_mapping.len() || tokens > self.max_tokens {
            return Err(Error::ShapeMismatch {
                what: "padded query tokens of a step (at least the step's, at most max_tokens)",
                expected: self.max_tokens,
                got: tokens,
            });
        }
        self.resize_rows(rows);
        self.tables.context_lens.resize(rows, 0);
        self.tables.batch = rows;
        let end = self.query_start_loc.last().copied().unwrap_or(0);
        self.query_start_loc.resize(rows + 1, end);
        self.slot_mapping.resize(tokens, -1);
        self.positions.resize(tokens, 0);
        Ok(())
    }

    /// Starts a step: empties every buffer but the tables' rows.
    fn begin(&mut self) {
        self.slot_mapping.clear();
        self.positions.clear();
        self.query_start_loc.clear();
        self.query_start_loc.push(0);
        self.tables.context_lens.clear();
        self.copies.clear();
        self.rows = 0;
        self.tokens = 0;
    }

    /// Makes the tables `rows` rows long. Rows cut off forget what they held (they
    /// come back zeroed), so a row past the tables' length always has nothing
    /// written.
    fn resize_rows(&mut self, rows: usize) {
        let width = self.tables.max_blocks;
        let now = self.tables.tables.len() / width.max(1);
        for row in rows..now {
            self.written[row] = RowWritten::default();
        }
        self.tables.tables.resize(rows * width, 0);
        self.tables.batch = rows;
    }

    /// Row `row` will hold `seq`'s table of `len` entries whose first `released` are
    /// holes: how many of its entries are already written for it (0 unless it held
    /// the same sequence). A window's blocks given back since the row was written
    /// become holes here (only the entries that changed are written), and what the
    /// row held past `len` is zeroed.
    #[inline(always)]
    fn take_row(&mut self, row: usize, seq: SeqHandle, len: usize, released: usize) -> usize {
        let w = &mut self.written[row];
        // The decode step: the same sequence, no new hole, no shorter table (what
        // the general case below does then: no entry to clear).
        if w.seq == Some(seq) && w.released == released && w.len <= len {
            let kept = w.len;
            w.len = len;
            return kept;
        }
        self.take_row_changed(row, seq, len, released)
    }

    /// [`Self::take_row`] for a row whose sequence, holes or length went down.
    #[inline(never)]
    fn take_row_changed(
        &mut self,
        row: usize,
        seq: SeqHandle,
        len: usize,
        released: usize,
    ) -> usize {
        let width = self.tables.max_blocks;
        let was = self.written[row];
        let kept = if was.seq == Some(seq) {
            was.len.min(len)
        } else {
            0
        };
        let holes = was.released.min(kept)..released.min(kept);
        if !holes.is_empty() {
            self.tables.tables[row * width + holes.start..row * width + holes.end]
                .fill(BlockId::RELEASED.0);
        }
        if was.len > len {
            self.tables.tables[row * width + len..row * width + was.len].fill(0);
        }
        self.written[row] = RowWritten {
            seq: Some(seq),
            len,
            released,
        };
        kept
    }

    /// Writes `table[kept..]` into row `row` (its first `kept` entries are current).
    fn write_row(&mut self, row: usize, kept: usize, table: &[BlockId]) {
        let width = self.tables.max_blocks;
        let dst = &mut self.tables.tables[row * width..row * width + table.len()];
        for (d, b) in dst[kept..].iter_mut().zip(&table[kept..]) {
            *d = b.0;
        }
    }

    /// Forgets what row `row` holds for its sequence: the next step writes it whole.
    fn forget_row(&mut self, row: usize) {
        self.written[row].seq = None;
    }
}

/// What a row of [`StepBuffers`]' tables holds: the sequence it was last written
/// for, how many entries of its table (past them the row is 0) and how many of those
/// lead as holes (a window's given-back blocks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct RowWritten {
    seq: Option<SeqHandle>,
    len: usize,
    released: usize,
}

impl KvCache {
    /// Reserves every sequence of a step in one call, as [`Self::reserve`] does for
    /// each entry in order, and fills `out` with the step's inputs (see
    /// [`StepBuffers`]). The whole batch is checked before anything changes: on
    /// error nothing changed and `out` holds the previous step.
    ///
    /// ```
    /// use pagedkv::{CacheConfig, DType, KvCache, KvLayout, ModelShape, SeqId};
    /// use pagedkv::{StepBuffers, StepEntry};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
    /// let mut slots = Vec::new();
    /// kv.admit(SeqId(1), 0, &mut slots)?;                  // a prompt to prefill
    /// kv.admit(SeqId(2), 20, &mut slots)?;
    /// kv.commit(SeqId(2), 0)?;
    /// let mut step = StepBuffers::new(8, 256, 16);
    /// let (a, b) = (kv.handle(SeqId(1))?, kv.handle(SeqId(2))?);
    /// let entries = [
    ///     StepEntry { seq: a, new_tokens: 30, lookahead: 0 },  // a prefill chunk
    ///     StepEntry { seq: b, new_tokens: 1, lookahead: 2 },   // a decode, 2 lookahead slots
    /// ];
    /// kv.reserve_step(&entries, &mut step)?;
    /// assert_eq!(step.query_start_loc(), &[0, 30, 31]);
    /// assert_eq!(step.tables().context_lens, vec![30, 21]);
    /// step.pad_to(4, 32)?;                                  // a captured graph's shape
    /// assert_eq!(step.slot_mapping()[31], -1);
    /// kv.commit_step(&[(a, 30), (b, 1)])?;
    /// assert_eq!(kv.num_computed_tokens(SeqId(2))?, 21);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the step has more sequences or query tokens than
    /// `out` holds, or a table is wider than its rows; [`Error::StaleHandle`];
    /// [`Error::DuplicateInBatch`]; for any entry, the errors of [`Self::reserve`];
    /// [`Error::OutOfBlocks`] when the step's whole need (as
    /// [`Self::blocks_needed_batch`] counts it) is not available.
    pub fn reserve_step(&mut self, entries: &[StepEntry], out: &mut StepBuffers) -> Result<()> {
        self.one_group("reserve_step")?;
        self.reserve_step_inner(entries, None, out)
    }

    /// [`Self::reserve_step`] with the token ids of the step's query tokens, one per
    /// query token, entry after entry (`ids.len()` is the step's query token count):
    /// the input ids an engine knows when it schedules (a prompt chunk's; a decode's
    /// last sampled token and its drafts). They are recorded as
    /// [`Self::append_tokens`] records them, so the prefix cache registers the blocks
    /// they fill as soon as they are committed, and a sequence admitted without ids
    /// starts tracking when position 0's arrive; ids after a gap (a position whose id
    /// never came) are not recorded, where [`Self::add_token_ids`] would report
    /// [`Error::TokenIdsGap`]. The ids of positions a commit rejects (drafts) are
    /// dropped by that commit.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, CacheConfig, DType, KvCache, KvLayout, ModelShape};
    /// use pagedkv::{PrefixHit, SeqId, StepBuffers, StepEntry};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 4)?, CacheConfig::new(64))?;
    /// let mut slots = Vec::new();
    /// kv.admit(SeqId(1), 0, &mut slots)?;
    /// let mut step = StepBuffers::new(8, 64, 16);
    /// let a = kv.handle(SeqId(1))?;
    /// kv.reserve_step_tokens(&[StepEntry { seq: a, new_tokens: 6, lookahead: 0 }],
    ///                        &[1, 2, 3, 4, 5, 6], &mut step)?;
    /// assert_eq!(kv.commit_step(&[(a, 6)])?, 1);           // one full block registered
    /// let mut hit = PrefixHit::default();
    /// assert_eq!(kv.lookup_prefix(&[1, 2, 3, 4, 9], &AdmitOptions::default(), &mut hit)?, 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// Those of [`Self::reserve_step`]; [`Error::ShapeMismatch`] when `ids` does not
    /// hold one id per query token. Nothing changed on error.
    pub fn reserve_step_tokens(
        &mut self,
        entries: &[StepEntry],
        ids: &[u32],
        out: &mut StepBuffers,
    ) -> Result<()> {
        self.one_group("reserve_step_tokens")?;
        self.reserve_step_inner(entries, Some(ids), out)
    }

    /// [`Self::reserve_step`] for a step scheduled before the outstanding steps of its
    /// sequences are committed (asynchronous scheduling, pipeline micro-batches): an
    /// entry whose sequence holds reservations gets one more on top of them, as
    /// [`Self::reserve_ahead`] does (its rows: positions after every outstanding query
    /// token, context through its own query tokens); the other entries are reserved
    /// as by [`Self::reserve_step`]. Commits take each sequence's reservations oldest
    /// first ([`Self::commit_step`]); a commit that rejects drafts rebases the later
    /// ones, whose slots the engine then reads again ([`Self::slots`]) or computes
    /// from the unchanged tables.
    ///
    /// ```
    /// use pagedkv::{CacheConfig, DType, KvCache, KvLayout, ModelShape, SeqId};
    /// use pagedkv::{StepBuffers, StepEntry};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 4, num_kv_heads: 2, head_dim: 64,
    ///                          kv_dtype: DType::F16 };
    /// let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(64))?;
    /// kv.admit(SeqId(1), 20, &mut Vec::new())?;
    /// let a = kv.handle(SeqId(1))?;
    /// let (mut n, mut n1) = (StepBuffers::new(8, 64, 8), StepBuffers::new(8, 64, 8));
    /// kv.reserve_step(&[StepEntry { seq: a, new_tokens: 1, lookahead: 0 }], &mut n)?;
    /// kv.reserve_step_ahead(&[StepEntry { seq: a, new_tokens: 1, lookahead: 0 }], &mut n1)?;
    /// assert_eq!((n.positions(), n1.positions()), (&[20][..], &[21][..]));
    /// assert_eq!(n1.tables().context_lens, vec![22]);
    /// kv.commit_step(&[(a, 1)])?; // step N
    /// kv.commit_step(&[(a, 1)])?; // step N + 1
    /// assert_eq!(kv.num_computed_tokens(SeqId(1))?, 22);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// Those of [`Self::reserve_step`]; [`Error::SequenceState`] for an entry of 0
    /// query tokens whose sequence holds a reservation; [`Error::NotOnHybrid`] on a
    /// cache of several groups (use [`Self::reserve_step_ahead_grouped`]). Nothing
    /// changed on error.
    pub fn reserve_step_ahead(
        &mut self,
        entries: &[StepEntry],
        out: &mut StepBuffers,
    ) -> Result<()> {
        self.one_group("reserve_step_ahead")?;
        let bound = self.check_step(entries, None, out, true)?;
        self.fill_step(entries, None, out, bound, true)
    }

    fn reserve_step_inner(
        &mut self,
        entries: &[StepEntry],
        ids: Option<&[u32]>,
        out: &mut StepBuffers,
    ) -> Result<()> {
        let bound = self.check_step(entries, ids, out, false)?;
        self.fill_step(entries, ids, out, bound, false)
    }

    /// Every check of [`Self::reserve_step`] but the blocks' availability, changing
    /// nothing; returns a bound of the blocks the step takes (each sequence counted
    /// alone, every block it writes into counted as copied).
    pub(super) fn check_step(
        &mut self,
        entries: &[StepEntry],
        ids: Option<&[u32]>,
        out: &StepBuffers,
        ahead: bool,
    ) -> Result<usize> {
        if entries.len() > out.max_seqs {
            return Err(Error::ShapeMismatch {
                what: "sequences of a step (StepBuffers max_seqs)",
                expected: out.max_seqs,
                got: entries.len(),
            });
        }
        let tokens = entries
            .iter()
            .try_fold(0usize, |t, e| t.checked_add(e.new_tokens))
            .unwrap_or(usize::MAX);
        if tokens > out.max_tokens {
            return Err(Error::ShapeMismatch {
                what: "query tokens of a step (StepBuffers max_tokens)",
                expected: out.max_tokens,
                got: tokens,
            });
        }
        if let Some(ids) = ids {
            if ids.len() != tokens {
                return Err(Error::ShapeMismatch {
                    what: "token ids of a step (one per query token)",
                    expected: tokens,
                    got: ids.len(),
                });
            }
        }
        // Check every entry first, so that a failed call changes nothing.
        let width = out.tables.max_blocks;
        let max_len = self.max_seq_len();
        let layout = self.layout;
        let mut bound = 0usize;
        self.seqs.begin_batch();
        for e in entries {
            // Marked now, reported after the other checks (as `Seqs::mark` would be).
            let (seq, s, first) = self
                .seqs
                .at_mut_marking(e.seq)
                .ok_or(Error::StaleHandle(e.seq))?;
            let s = &*s;
            swap::check_resident(seq, s)?;
            if s.scheduled > 0 {
                super::check_stack(seq, ahead, e.new_tokens, ids.is_some())?;
            }
            // After the outstanding query tokens (none, unless `ahead`).
            let base = s.computed + s.scheduled;
            let target = super::target_within(base, e.new_tokens, e.lookahead, max_len)?;
            // A row holds the blocks of the context (lookahead slots are not read).
            let blocks = layout.blocks_for_tokens(base + e.new_tokens);
            if blocks > width {
                return Err(Error::ShapeMismatch {
                    what: "blocks of a sequence's table (StepBuffers table_width)",
                    expected: width,
                    got: blocks,
                });
            }
            // A bound without a look at the blocks: every block written may be copied
            // (`reserve_span`'s count: the blocks appended and those written into).
            let new_len = target.max(s.num_tokens);
            let written_end = layout.blocks_for_tokens(target).min(s.table.len());
            bound += layout.blocks_for_tokens(new_len) - s.table.len()
                + written_end.saturating_sub(layout.block_index(s.computed));
            if !first {
                return Err(Error::DuplicateInBatch(seq));
            }
        }
        Ok(bound)
    }

    /// The blocks the checked step takes, shared blocks counted once.
    pub(super) fn step_need(&self, entries: &[StepEntry]) -> Result<usize> {
        let mut let_go = std::collections::HashMap::new();
        let mut exact = 0;
        for e in entries {
            let s = self.seqs.at(e.seq).ok_or(Error::StaleHandle(e.seq))?.1;
            let base = s.computed + s.scheduled;
            let target = self.reserve_target_from(base, e.new_tokens, e.lookahead)?;
            exact += self.batch_cost(s, target, &mut let_go);
        }
        Ok(exact)
    }

    /// Reserves the step [`Self::check_step`] passed (its `bound`) and fills `out`:
    /// fails only when the step's blocks are not available (nothing changed then).
    pub(super) fn fill_step(
        &mut self,
        entries: &[StepEntry],
        ids: Option<&[u32]>,
        out: &mut StepBuffers,
        bound: usize,
        ahead: bool,
    ) -> Result<()> {
        // Only when the bound does not fit is the exact count taken.
        if bound > self.num_available_blocks() {
            let exact = self.step_need(entries)?;
            self.ensure_available(exact)?;
        }
        // Nothing below fails on a consistent manager: every entry was checked and
        // the step's blocks are available.
        if out.written_for != Some(self.table_epoch) {
            // Entries handed out before may have changed since: rewrite every row.
            out.written.iter_mut().for_each(|w| w.seq = None);
        }
        out.begin();
        let rows = entries.len();
        out.resize_rows(rows);
        // Sized once for the step (the checks held it to the capacities), then
        // written in place: a store per token and per row, not a push.
        let tokens = entries.iter().map(|e| e.new_tokens).sum::<usize>();
        out.slot_mapping.resize(tokens, -1);
        out.positions.resize(tokens, 0);
        out.query_start_loc.resize(rows + 1, 0);
        out.tables.context_lens.resize(rows, 0);
        let max_len = self.max_seq_len();
        let mut at = 0;
        for (row, e) in entries.iter().enumerate() {
            let n = e.new_tokens;
            let query = at..at + n;
            at += n;
            let step_ids = ids.map(|ids| &ids[query.clone()]);
            if e.lookahead == 0 {
                if let Some(r) = self.reserve_in_last_block(e.seq, n, step_ids, max_len) {
                    // The common decode step: consecutive slots of the own last block,
                    // and a row that only grows (no lookup of the sequence again).
                    let first = r.end - n;
                    if n == 1 {
                        out.slot_mapping[query.start] = r.first as i64;
                        out.positions[query.start] = first as i64;
                    } else {
                        let slots = out.slot_mapping[query.clone()].iter_mut();
                        for (k, (slot, pos)) in slots.zip(&mut out.positions[query]).enumerate() {
                            *slot = (r.first + k as u64) as i64;
                            *pos = (first + k) as i64;
                        }
                    }
                    out.query_start_loc[row + 1] = at as u32;
                    out.tables.context_lens[row] = r.end as u32;
                    let blocks = self.layout.blocks_for_tokens(r.end);
                    let kept = out.take_row(row, e.seq, blocks, r.released.min(blocks));
                    if kept < blocks {
                        let s = self.seqs.at(e.seq).ok_or(Error::StaleHandle(e.seq))?.1;
                        out.write_row(row, kept, &s.table[..blocks]);
                    }
                    continue;
                }
            }
            out.scratch.clear();
            let epoch = self.table_epoch;
            self.reserve_at(
                e.seq,
                n,
                e.lookahead,
                false,
                step_ids,
                &mut out.scratch,
                &mut out.copies,
                ahead,
            )?;
            if self.table_epoch != epoch {
                // This reservation changed an entry of its own table (a copy-on-write, a
                // shared copy, a window's release): rewrite its row.
                out.forget_row(row);
            }
            for (d, slot) in out.slot_mapping[query.clone()].iter_mut().zip(&out.scratch) {
                *d = slot.0 as i64;
            }
            let s = self.seqs.at(e.seq).ok_or(Error::StaleHandle(e.seq))?.1;
            let context = s.computed + s.scheduled;
            // The entry's query tokens are the last ones reserved.
            let first = context - n;
            for (d, p) in out.positions[query].iter_mut().zip(first..context) {
                *d = p as i64;
            }
            out.query_start_loc[row + 1] = at as u32;
            out.tables.context_lens[row] = context as u32;
            let table = &s.table[..self.layout.blocks_for_tokens(context)];
            let kept = out.take_row(row, e.seq, table.len(), s.released.min(table.len()));
            out.write_row(row, kept, table);
        }
        // A reservation changes only its own sequence's entries: every row written
        // above is current for the count as it stands now.
        out.written_for = Some(self.table_epoch);
        out.tables.batch = rows;
        out.rows = rows;
        out.tokens = out.slot_mapping.len();
        Ok(())
    }

    /// Commits every `(sequence, accepted)` of a step, as [`Self::commit`] does for
    /// each in order. Returns the blocks registered in the prefix cache.
    ///
    /// # Errors
    /// [`Error::StaleHandle`]; [`Error::DuplicateInBatch`]; for any entry, the
    /// errors of [`Self::commit`]. Every entry is checked first: on error nothing
    /// changed.
    pub fn commit_step(&mut self, accepted: &[(SeqHandle, usize)]) -> Result<usize> {
        if let Some(h) = &mut self.hybrid {
            return h.commit_step(accepted);
        }
        // The leading decode commits are made as they are checked (and taken back if
        // a later entry fails); the rest once every entry passed.
        let decoded = self.check_commit_step_decoding(accepted)?;
        self.commit_step_checked(&accepted[decoded..])
    }

    /// [`Self::check_commit_step`] that also commits the leading entries that are a
    /// decode commit ([`Self::check_commit_entry`]) as it checks them: one pass over
    /// the sequences, not two. Returns how many it committed; on error it takes them
    /// back, so that nothing changed.
    fn check_commit_step_decoding(&mut self, accepted: &[(SeqHandle, usize)]) -> Result<usize> {
        self.seqs.begin_batch();
        let mut decoded = 0;
        for (k, &(h, n)) in accepted.iter().enumerate() {
            match self.check_commit_entry(h, n, decoded == k) {
                Ok(true) => decoded += 1,
                Ok(false) => {}
                Err(e) => {
                    for &(h, n) in &accepted[..decoded] {
                        if let Some(s) = self.seqs.at_mut(h) {
                            // A decode commit accepted all `n` reserved tokens.
                            s.computed -= n;
                            s.scheduled = n;
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(decoded)
    }

    /// The checks of one entry of [`Self::commit_step`] (a sequence named twice is
    /// refused at its second entry). With `commit`, an entry that is a decode commit
    /// (every reserved token accepted, no ids tracked, and [`Self::commit_plain`]'s
    /// conditions: one reservation, no twin, no window block to give back) is
    /// committed at once, which changes only its computed and reserved counts, so
    /// that it can be taken back exactly. Returns whether it was committed.
    #[inline(always)]
    fn check_commit_entry(&mut self, h: SeqHandle, n: usize, commit: bool) -> Result<bool> {
        let (window, bs) = (self.window, self.block_size());
        let (seq, s, first) = self.seqs.at_mut_marking(h).ok_or(Error::StaleHandle(h))?;
        if !first {
            return Err(Error::DuplicateInBatch(seq));
        }
        swap::check_resident(seq, s)?;
        let oldest = if s.has_later() {
            s.oldest_scheduled()
        } else {
            s.scheduled
        };
        if n > oldest {
            return Err(Error::CommitPastReservation {
                seq,
                committed: n,
                reserved: oldest,
            });
        }
        if commit
            && n == s.scheduled
            && s.prefix.is_none()
            && super::commits_plainly(window, bs, s, n)
        {
            s.computed += n;
            s.scheduled = 0;
            return Ok(true);
        }
        Ok(false)
    }

    /// The checks of [`Self::commit_step`], changing nothing.
    pub(super) fn check_commit_step(&mut self, accepted: &[(SeqHandle, usize)]) -> Result<()> {
        self.seqs.begin_batch();
        for &(h, n) in accepted {
            let (seq, s) = self.seqs.at(h).ok_or(Error::StaleHandle(h))?;
            swap::check_resident(seq, s)?;
            if n > s.oldest_scheduled() {
                return Err(Error::CommitPastReservation {
                    seq,
                    committed: n,
                    reserved: s.oldest_scheduled(),
                });
            }
            if !self.seqs.mark(h) {
                return Err(Error::DuplicateInBatch(seq));
            }
        }
        Ok(())
    }

    /// [`Self::commit_step`] once [`Self::check_commit_step`] passed; returns the
    /// blocks registered. Fails only on a corrupt manager.
    pub(super) fn commit_step_checked(&mut self, accepted: &[(SeqHandle, usize)]) -> Result<usize> {
        let mut registered = 0;
        for &(h, n) in accepted {
            registered += match self.commit_plain(h, n)? {
                Some(r) => r,
                None => self.commit_at(h, n)?,
            };
        }
        Ok(registered)
    }
}

/// Table entries are block ids; `BlockId::RELEASED` (a window's hole) reads as
/// `u32::MAX`, never inside a query's window.
const _: () = assert!(BlockId::RELEASED.0 == u32::MAX);

/// The step path of a hybrid cache: the engine holds group 0's handles
/// ([`KvCache::handle`]) and one [`StepBuffers`] per group.
impl KvCache {
    /// [`Self::reserve_step`] in every group of the cache: `out[g]` gets group `g`'s
    /// slot mapping, tables and copies (positions and query starts are the same in
    /// every group). The whole step is checked in every group, and the arena's pages
    /// counted, before anything changes; on error nothing changed. A one-group cache
    /// takes one buffer, as [`Self::reserve_step`].
    ///
    /// ```
    /// use pagedkv::{DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape, SeqId};
    /// use pagedkv::{StepBuffers, StepEntry};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 8,
    ///                          kv_dtype: DType::BF16 };
    /// let l = KvLayout::new(shape, 16)?;
    /// let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::window(l, 32)], 64)?;
    /// kv.admit_grouped(SeqId(1), 40, &mut GroupStep::default())?;
    /// let mut bufs = [StepBuffers::new(8, 64, 8), StepBuffers::new(8, 64, 8)];
    /// let h = kv.handle(SeqId(1))?;
    /// kv.reserve_step_grouped(&[StepEntry { seq: h, new_tokens: 1, lookahead: 0 }], &mut bufs)?;
    /// assert_eq!(bufs[0].positions(), bufs[1].positions());
    /// kv.commit_step(&[(h, 1)])?;
    /// assert_eq!(kv.num_computed_tokens(SeqId(1))?, 41);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `out` has not one buffer per group; otherwise as
    /// [`Self::reserve_step`], [`Error::OutOfBlocks`] with the pages all groups need.
    pub fn reserve_step_grouped(
        &mut self,
        entries: &[StepEntry],
        out: &mut [StepBuffers],
    ) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.reserve_step(entries, None, out, false),
            None => self.reserve_step_inner(entries, None, one_buffer(out)?),
        }
    }

    /// [`Self::reserve_step_ahead`] in every group of the cache (see
    /// [`Self::reserve_step_grouped`]): a step reserved on top of the outstanding ones
    /// in every group at once (a state group reserves nothing, as in every step).
    ///
    /// ```
    /// use pagedkv::{DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape, SeqId};
    /// use pagedkv::{StepBuffers, StepEntry};
    ///
    /// let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 8,
    ///                          kv_dtype: DType::BF16 };
    /// let l = KvLayout::new(shape, 16)?;
    /// let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::window(l, 32)], 64)?;
    /// kv.admit_grouped(SeqId(1), 40, &mut GroupStep::default())?;
    /// let h = kv.handle(SeqId(1))?;
    /// let e = [StepEntry { seq: h, new_tokens: 1, lookahead: 0 }];
    /// let mut n = [StepBuffers::new(8, 64, 8), StepBuffers::new(8, 64, 8)];
    /// let mut n1 = [StepBuffers::new(8, 64, 8), StepBuffers::new(8, 64, 8)];
    /// kv.reserve_step_grouped(&e, &mut n)?;
    /// kv.reserve_step_ahead_grouped(&e, &mut n1)?;
    /// assert_eq!((n1[0].positions(), n1[1].positions()), (&[41][..], &[41][..]));
    /// assert_eq!(kv.num_reservations(SeqId(1))?, 2);
    /// kv.commit_step(&[(h, 1)])?;
    /// kv.commit_step(&[(h, 1)])?;
    /// assert_eq!(kv.num_computed_tokens(SeqId(1))?, 42);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Self::reserve_step_grouped`] and [`Self::reserve_step_ahead`].
    pub fn reserve_step_ahead_grouped(
        &mut self,
        entries: &[StepEntry],
        out: &mut [StepBuffers],
    ) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.reserve_step(entries, None, out, true),
            None => self.reserve_step_ahead(entries, one_buffer(out)?),
        }
    }

    /// [`Self::reserve_step_tokens`] in every group of the cache (see
    /// [`Self::reserve_step_grouped`]): the full and latent groups register the blocks
    /// the ids fill once committed.
    ///
    /// # Errors
    /// As [`Self::reserve_step_grouped`] and [`Self::reserve_step_tokens`].
    pub fn reserve_step_tokens_grouped(
        &mut self,
        entries: &[StepEntry],
        ids: &[u32],
        out: &mut [StepBuffers],
    ) -> Result<()> {
        match &mut self.hybrid {
            Some(h) => h.reserve_step(entries, Some(ids), out, false),
            None => self.reserve_step_inner(entries, Some(ids), one_buffer(out)?),
        }
    }
}

/// The checks of a state group's rows in a step: its buffers hold the step's rows and
/// a row holds the state pages. Allocates nothing: returns 0 pages.
fn check_state_rows(rows: usize, pages: usize, out: &StepBuffers) -> Result<usize> {
    if rows > out.max_seqs {
        return Err(Error::ShapeMismatch {
            what: "sequences of a step (StepBuffers max_seqs)",
            expected: out.max_seqs,
            got: rows,
        });
    }
    if pages > out.tables.max_blocks {
        return Err(Error::ShapeMismatch {
            what: "state pages of a sequence (StepBuffers table_width)",
            expected: out.tables.max_blocks,
            got: pages,
        });
    }
    Ok(0)
}

impl KvCache {
    /// A state group's buffers of a step whose KV group 0 filled `first`: the same
    /// rows, query starts, positions and context lengths; every slot `-1` (a state
    /// group writes no K/V through slots); each row's table the sequence's state
    /// pages, where the recurrent kernel reads and writes its state; no copies.
    /// Checked by [`check_state_rows`]; a stale handle leaves its row empty (the
    /// KV groups refused it first).
    fn fill_state_rows(&self, entries: &[StepEntry], first: &StepBuffers, out: &mut StepBuffers) {
        let width = out.tables.max_blocks;
        out.begin();
        out.slot_mapping.resize(first.slot_mapping.len(), -1);
        out.positions.extend_from_slice(&first.positions);
        out.query_start_loc.clear();
        out.query_start_loc
            .extend_from_slice(&first.query_start_loc);
        out.tables
            .context_lens
            .extend_from_slice(&first.tables.context_lens);
        out.resize_rows(entries.len());
        for (row, e) in entries.iter().enumerate() {
            let table = self.seqs.at(e.seq).map_or(&[][..], |(_, s)| &s.table[..]);
            // State pages never change under a live sequence but a compaction moves
            // them: write the whole row every step (a few entries).
            out.forget_row(row);
            out.take_row(row, e.seq, table.len(), 0);
            for (d, b) in out.tables.tables[row * width..].iter_mut().zip(table) {
                *d = b.0;
            }
        }
        out.written_for = None;
        out.tables.batch = entries.len();
        out.rows = first.rows;
        out.tokens = first.tokens;
    }
}

/// The one buffer of a one-group cache's step.
fn one_buffer(out: &mut [StepBuffers]) -> Result<&mut StepBuffers> {
    let got = out.len();
    match out {
        [b] => Ok(b),
        _ => Err(Error::ShapeMismatch {
            what: "step buffers (one per KV-cache group)",
            expected: 1,
            got,
        }),
    }
}

impl Groups {
    /// Group `g`'s handle of the sequence group 0's handle `h0` names: the same
    /// handle where the groups' slots agree (they admit and free the same sequences
    /// in the same order), else a lookup of the id.
    pub(super) fn group_handle(&self, g: usize, h0: SeqHandle) -> Result<SeqHandle> {
        if g == 0 {
            return Ok(h0);
        }
        let (seq, _) = self.group(0).seqs.at(h0).ok_or(Error::StaleHandle(h0))?;
        let kv = self.group(g);
        match kv.seqs.at(h0) {
            Some((id, _)) if id == seq => Ok(h0),
            _ => kv.seqs.handle(&seq).ok_or(Error::StaleHandle(h0)),
        }
    }

    /// [`Self::group_handle`]: `h0` itself where group `g`'s slot under it holds the
    /// sequence (the usual case, see [`Self::names`]), else the handle last found for
    /// group 0's slot of `h0` (`step_handles`, kept by [`Self::step_handle`]), which
    /// is checked the same way: it names the sequence only when that slot of group
    /// `g`, at that generation, holds `h0`'s id. Where the groups' slots differ, a
    /// step then looks no id up but for sequences new to their slot.
    pub(super) fn known_handle(&self, g: usize, h0: SeqHandle) -> Result<SeqHandle> {
        if g == 0 {
            return Ok(h0);
        }
        let (seq, _) = self.group(0).seqs.at(h0).ok_or(Error::StaleHandle(h0))?;
        if self.names(g, h0, seq) {
            return Ok(h0);
        }
        let known = self
            .step_handles
            .get(g)
            .and_then(|t| t.get(h0.index as usize));
        match known {
            Some(&h) if matches!(self.group(g).seqs.at(h), Some((id, _)) if id == seq) => Ok(h),
            _ => self.group_handle(g, h0),
        }
    }

    /// Whether handle `h` of group `g` names `seq`: group 0's handle is group `g`'s
    /// where their slots agree, which they do unless a failed call undid an insertion
    /// in some groups only (every group holds the same hidden sequences, in the same
    /// slots, and admits and frees the same sequences in the same order).
    #[inline]
    fn names(&self, g: usize, h: SeqHandle, seq: SeqId) -> bool {
        matches!(self.group(g).seqs.at(h), Some((id, _)) if id == seq)
    }

    /// [`Self::known_handle`], recording what it found (no allocation once the
    /// record spans group 0's slots).
    fn step_handle(&mut self, g: usize, h0: SeqHandle) -> Result<SeqHandle> {
        let h = self.known_handle(g, h0)?;
        if g > 0 {
            if self.step_handles.len() <= g {
                self.step_handles.resize_with(g + 1, Vec::new);
            }
            let record = &mut self.step_handles[g];
            let i = h0.index as usize;
            if record.len() <= i {
                record.resize(i + 1, h0);
            }
            record[i] = h;
        }
        Ok(h)
    }

    /// Fills `list` with a step's `items` (group 0's handles, read by `handle`) under
    /// group `g`'s handles, rewritten by `with`; leaves it empty when every handle is
    /// the same in group `g` (always in group 0; in the others where the groups'
    /// slots agree, the usual case), so that `items` serve as they are. A step's
    /// lists are then one per group whose handles differ, each as long as `items`.
    fn own_handles<T: Copy>(
        &mut self,
        g: usize,
        items: &[T],
        handle: impl Fn(&T) -> SeqHandle,
        with: impl Fn(T, SeqHandle) -> T,
        list: &mut Vec<T>,
    ) -> Result<()> {
        list.clear();
        if g == 0 {
            return Ok(());
        }
        let mut own = false;
        for (i, &item) in items.iter().enumerate() {
            let h0 = handle(&item);
            let h = match self.group(0).seqs.at(h0) {
                // The usual case: the same slot in both groups (nothing to record).
                Some((seq, _)) if self.names(g, h0, seq) => h0,
                _ => self.step_handle(g, h0)?,
            };
            if !own && h != h0 {
                // The first handle that differs: the items so far are the same.
                own = true;
                list.extend_from_slice(&items[..i]);
            }
            if own {
                list.push(with(item, h));
            }
        }
        Ok(())
    }

    /// One pass over a step's `items` that serves every group: whether every group's
    /// slot under group 0's handle (`of(item).0`) holds the item's sequence (then no
    /// group needs lists of its own handles), and in `giving` the indices of the items
    /// whose window groups may give blocks back when the sequence's next query sits
    /// `of(item).1` tokens after its computed ones (0 before a reservation, the
    /// accepted count at a commit): those where a window group holds blocks before
    /// that query's window, or whose slot there is not group 0's (decided by id
    /// later). Reads each sequence's slot once per group; allocates nothing once
    /// `giving` has grown.
    ///
    /// # Errors
    /// [`Error::StaleHandle`] for a handle group 0 does not hold; nothing changed.
    fn scan_step<T>(
        &self,
        items: &[T],
        of: impl Fn(&T) -> (SeqHandle, usize),
        giving: &mut Vec<u32>,
    ) -> Result<bool> {
        giving.clear();
        let mut same = true;
        let (first, rest) = self.all_groups().split_at(1);
        for (i, item) in items.iter().enumerate() {
            let (h, ahead) = of(item);
            let (seq, s0) = first[0].seqs.at(h).ok_or(Error::StaleHandle(h))?;
            let query = s0.computed + ahead;
            let mut gives = false;
            for kv in rest {
                match kv.seqs.at(h) {
                    Some((id, s)) if id == seq => {
                        gives |= kv.window.is_some()
                            && kv.first_block_in_window(query).min(s.table.len()) > s.released;
                    }
                    _ => {
                        same = false;
                        gives |= kv.window.is_some();
                    }
                }
            }
            if gives {
                giving.push(i as u32);
            }
        }
        Ok(same)
    }

    /// Whether group 0's step checks answer for KV group `g`, whose handles are group
    /// 0's: the same block size and longest sequence, and buffers of the same
    /// capacities. Every check then reads what group 0's read (the same sequences,
    /// swap states, reservations and token counts, so the same table lengths:
    /// `check_invariants` compares them), and the bound of the blocks the step takes
    /// is group 0's.
    fn checks_as_group_0(&self, g: usize, out: &[StepBuffers]) -> bool {
        let (kv, kv0) = (self.group(g), self.group(0));
        let capacity = |b: &StepBuffers| (b.max_seqs, b.max_tokens, b.tables.max_blocks);
        kv.block_size() == kv0.block_size()
            && kv.max_seq_len() == kv0.max_seq_len()
            && capacity(&out[g]) == capacity(&out[0])
    }

    /// [`KvCache::reserve_step_grouped`] of a hybrid cache.
    pub(super) fn reserve_step(
        &mut self,
        entries: &[StepEntry],
        ids: Option<&[u32]>,
        out: &mut [StepBuffers],
        ahead: bool,
    ) -> Result<()> {
        let groups = self.num_groups();
        if out.len() != groups {
            return Err(Error::ShapeMismatch {
                what: "step buffers (one per KV-cache group)",
                expected: groups,
                got: out.len(),
            });
        }
        // Each group's entries, by its own handles where they are not group 0's (kept
        // buffers: no allocation once grown), then every group's checks, before
        // anything changes.
        let mut scratch = std::mem::take(&mut self.step_entries);
        let mut giving = std::mem::take(&mut self.step_giving);
        scratch.resize_with(groups, Vec::new);
        let result = self
            .scan_step(entries, |e| (e.seq, 0), &mut giving)
            .and_then(|same| {
                self.reserve_step_in_groups(entries, ids, out, &mut scratch, &giving, same, ahead)
            });
        self.step_entries = scratch;
        self.step_giving = giving;
        result
    }

    /// [`Self::reserve_step`] once [`Self::scan_step`] found whether every handle is
    /// group 0's (`same`) and which entries give window blocks back first (`giving`).
    #[allow(clippy::too_many_arguments)]
    fn reserve_step_in_groups(
        &mut self,
        entries: &[StepEntry],
        ids: Option<&[u32]>,
        out: &mut [StepBuffers],
        per_group: &mut [Vec<StepEntry>],
        giving: &[u32],
        same: bool,
        ahead: bool,
    ) -> Result<()> {
        for (g, list) in per_group.iter_mut().enumerate() {
            list.clear();
            if !same {
                self.own_handles(g, entries, |e| e.seq, |e, seq| StepEntry { seq, ..e }, list)?;
            }
        }
        let per_group = &*per_group;
        // Group `g`'s entries: group 0's where every handle is the same.
        let list_of = |g: usize| match &per_group[g] {
            own if own.len() == entries.len() => &own[..],
            _ => entries,
        };
        let mut bounds: smallvec::SmallVec<[usize; 8]> = smallvec::SmallVec::new();
        for (g, buffers) in out.iter().enumerate() {
            let list = list_of(g);
            bounds.push(match self.state_pages(g) {
                // A state group allocates nothing in a step.
                Some(pages) => check_state_rows(list.len(), pages, buffers)?,
                None if g > 0 && per_group[g].is_empty() && self.checks_as_group_0(g, out) => {
                    bounds[0]
                }
                None => self.group_mut(g).check_step(list, ids, buffers, ahead)?,
            });
        }
        // Pages per group: the bound where the arena holds every bound, else each
        // group's exact need (shared blocks counted once).
        let free = self.num_free_pages();
        let exact = bounds.iter().sum::<usize>() > free;
        for g in 0..per_group.len() {
            let need = if self.state_pages(g).is_some() {
                0
            } else if exact {
                self.group(g).step_need(list_of(g))?
            } else {
                bounds[g]
            };
            self.set_need(g, need);
        }
        self.give_needed_pages()?;
        // The dead window blocks the reservations would give back (an admission
        // leaves those of its prompt), given back and kept first, as the
        // per-sequence calls do; the checks above hold, nothing below fails.
        self.keep_dead_windows(entries, giving)?;
        for (g, &bound) in bounds.iter().enumerate() {
            if self.state_pages(g).is_none() {
                self.group_mut(g)
                    .fill_step(list_of(g), ids, &mut out[g], bound, ahead)?;
            }
        }
        // Then the state groups' rows, beside group 0's (never a state group).
        let (first, rest) = out.split_at_mut(1);
        for g in 1..per_group.len() {
            if self.state_pages(g).is_some() {
                self.group(g)
                    .fill_state_rows(list_of(g), &first[0], &mut rest[g - 1]);
            }
        }
        self.note_step_usage();
        Ok(())
    }

    /// [`KvCache::commit_step`] of a hybrid cache: every group checks, then every
    /// group commits.
    pub(super) fn commit_step(&mut self, accepted: &[(SeqHandle, usize)]) -> Result<usize> {
        let groups = self.num_groups();
        let mut scratch = std::mem::take(&mut self.step_accepted);
        scratch.resize_with(groups, Vec::new);
        let mut giving = std::mem::take(&mut self.step_giving);
        let result = (|| {
            let same = self.scan_step(accepted, |&(h, n)| (h, n), &mut giving)?;
            for (g, list) in scratch.iter_mut().enumerate() {
                list.clear();
                if !same {
                    self.own_handles(g, accepted, |a| a.0, |(_, n), h| (h, n), list)?;
                }
            }
            // Group `g`'s entries: group 0's where every handle is the same.
            let list_of = |g: usize| match &scratch[g] {
                own if own.len() == accepted.len() => &own[..],
                _ => accepted,
            };
            // A state group holds no reservation: nothing to commit there. Group 0's
            // checks answer for a group whose handles are group 0's (an empty list):
            // the same sequences, in the same state, holding the same reservations
            // (every call reserves and commits in every KV group alike).
            for (g, own) in scratch.iter().enumerate() {
                if self.state_pages(g).is_none() && (g == 0 || !own.is_empty()) {
                    self.group_mut(g).check_commit_step(list_of(g))?;
                }
            }
            // The window blocks the commits give back stay cached.
            self.note_step_leaving(accepted, &giving);
            let mut registered = 0;
            for g in 0..groups {
                if self.state_pages(g).is_none() {
                    registered += self.group_mut(g).commit_step_checked(list_of(g))?;
                }
            }
            self.keep_leaving()?;
            Ok(registered)
        })();
        self.step_accepted = scratch;
        self.step_giving = giving;
        result
    }
}
