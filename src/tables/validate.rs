//! Validation of batch tables: what every kernel launch (CPU or CUDA) and the
//! manager's own checks rely on. The kernels trust these checks for memory safety: a
//! table entry a kernel reads must name a block inside the arena, and each row must
//! cover its context length.

use super::{CsrTables, PaddedTables};
use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::KvLayout;

/// Longest context the kernels accept: keeps every token index and
/// `split_begin + tokens_per_split` inside `u32`. (ALiBi distances are computed in
/// `f32`, exact up to 2^24 tokens.)
pub const MAX_CONTEXT_TOKENS: usize = 1 << 30;

fn check_row(
    layout: &KvLayout,
    num_blocks: usize,
    row: usize,
    entries: &[u32],
    context: usize,
    first_read_block: usize,
) -> Result<()> {
    if context > MAX_CONTEXT_TOKENS {
        return Err(Error::TooLong {
            tokens: context,
            limit: MAX_CONTEXT_TOKENS,
        });
    }
    let needed = layout.blocks_for_tokens(context);
    if needed > entries.len() {
        return Err(Error::CorruptBlockTable(format!(
            "sequence {row}: {context} tokens need {needed} blocks, the table has {}",
            entries.len()
        )));
    }
    // Before the window: never read, so a hole a sliding window left is fine there.
    let before = first_read_block.min(needed);
    if let Some(&b) = entries[..before]
        .iter()
        .find(|&&b| b as usize >= num_blocks && BlockId(b) != BlockId::RELEASED)
    {
        return Err(Error::BlockOutOfRange {
            block: BlockId(b),
            num_blocks,
        });
    }
    if let Some(&b) = entries[before..needed]
        .iter()
        .find(|&&b| b as usize >= num_blocks)
    {
        // A hole inside the window is outside the arena like any other id.
        return Err(Error::BlockOutOfRange {
            block: BlockId(b),
            num_blocks,
        });
    }
    Ok(())
}

/// Checks padded tables before a launch over an arena of `num_blocks` blocks: the
/// buffer is `batch * max_blocks` long, there is one context length per row, each row
/// covers its context, and every entry a kernel will read (the first
/// `ceil(len / block_size)` of each row) names a block inside the arena. Padding past
/// that is never read and not checked.
///
/// Returns the longest context of the batch.
///
/// ```
/// use pagedkv::tables::validate_tables;
/// use pagedkv::{DType, Error, KvLayout, ModelShape};
/// use pagedkv::tables::PaddedTables;
///
/// let shape = ModelShape { num_layers: 1, num_q_heads: 8, num_kv_heads: 2, head_dim: 64, kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 16)?;
/// // Two sequences over an arena of 10 blocks: 17 tokens in blocks 3, 4; 5 tokens in 9.
/// let mut t = PaddedTables { tables: vec![3, 4, 9, 0], context_lens: vec![17, 5], batch: 2, max_blocks: 2 };
/// assert_eq!(validate_tables(&layout, 10, &t)?, 17);
/// t.tables[2] = 10; // outside the arena: rejected before any launch
/// assert!(matches!(validate_tables(&layout, 10, &t), Err(Error::BlockOutOfRange { .. })));
/// # Ok::<(), Error>(())
/// ```
///
/// # Errors
/// [`Error::ShapeMismatch`], [`Error::CorruptBlockTable`], [`Error::BlockOutOfRange`],
/// [`Error::TooLong`] for a context over [`MAX_CONTEXT_TOKENS`].
pub fn validate_tables(
    layout: &KvLayout,
    num_blocks: usize,
    tables: &PaddedTables,
) -> Result<usize> {
    validate_tables_window(layout, num_blocks, tables, None, None)
}

/// [`validate_tables`] for attention under a sliding window of `window` tokens: entries
/// of blocks entirely before the window of a row's first query are never read, so
/// there (and only there) [`BlockId::RELEASED`] holes are accepted. A row's queries
/// are its last tokens: one per row for decode (`query_start_loc: None`), or
/// `query_start_loc[i + 1] - query_start_loc[i]` for prefill. Without a window it is
/// [`validate_tables`].
///
/// ```
/// use pagedkv::tables::validate_tables_window;
/// use pagedkv::{BlockId, DType, Error, KvLayout, ModelShape};
/// use pagedkv::tables::PaddedTables;
///
/// let shape = ModelShape { num_layers: 1, num_q_heads: 8, num_kv_heads: 2, head_dim: 64, kv_dtype: DType::F16 };
/// let layout = KvLayout::new(shape, 16)?;
/// // 40 tokens, window 16: the decode query at 39 reads 24..40, blocks 1 and 2.
/// let hole = BlockId::RELEASED.0;
/// let mut t = PaddedTables { tables: vec![hole, 4, 5], context_lens: vec![40], batch: 1, max_blocks: 3 };
/// assert_eq!(validate_tables_window(&layout, 10, &t, Some(16), None)?, 40);
/// t.tables = vec![3, hole, 5]; // a hole inside the window: refused
/// assert!(validate_tables_window(&layout, 10, &t, Some(16), None).is_err());
/// # Ok::<(), Error>(())
/// ```
///
/// # Errors
/// As [`validate_tables`]; a hole inside the window is [`Error::BlockOutOfRange`].
pub fn validate_tables_window(
    layout: &KvLayout,
    num_blocks: usize,
    tables: &PaddedTables,
    window: Option<usize>,
    query_start_loc: Option<&[usize]>,
) -> Result<usize> {
    let cells = tables
        .batch
        .checked_mul(tables.max_blocks)
        .ok_or(Error::ShapeMismatch {
            what: "padded table cells (batch * max_blocks overflows)",
            expected: usize::MAX,
            got: tables.tables.len(),
        })?;
    if tables.tables.len() != cells {
        return Err(Error::ShapeMismatch {
            what: "padded table cells (batch * max_blocks)",
            expected: cells,
            got: tables.tables.len(),
        });
    }
    if tables.context_lens.len() != tables.batch {
        return Err(Error::ShapeMismatch {
            what: "context lengths (one per sequence)",
            expected: tables.batch,
            got: tables.context_lens.len(),
        });
    }
    if tables.max_blocks > u32::MAX as usize {
        return Err(Error::ShapeMismatch {
            what: "padded table width (must fit u32)",
            expected: u32::MAX as usize,
            got: tables.max_blocks,
        });
    }
    let mut longest = 0;
    for (i, &len) in tables.context_lens.iter().enumerate() {
        let row = &tables.tables[i * tables.max_blocks..(i + 1) * tables.max_blocks];
        let first_read = match window {
            None => 0,
            Some(w) => {
                // A malformed `query_start_loc` is refused later; reading it as
                // more queries only makes this check stricter.
                let queries = match query_start_loc {
                    None => 1,
                    Some(loc) => match (loc.get(i), loc.get(i + 1)) {
                        (Some(&a), Some(&b)) if b >= a => b - a,
                        _ => usize::MAX,
                    },
                };
                let first_query = (len as usize).saturating_sub(queries.max(1));
                (first_query + 1).saturating_sub(w) / layout.block_size()
            }
        };
        check_row(layout, num_blocks, i, row, len as usize, first_read)?;
        longest = longest.max(len as usize);
    }
    Ok(longest)
}

/// Checks CSR tables before a launch over an arena of `num_blocks` blocks: `indptr`
/// has `batch + 1` non-decreasing offsets from 0 to `indices.len()`, each
/// `last_page_len` is `1..=block_size` for a non-empty row and 0 for an empty one, and
/// every index names a block inside the arena.
///
/// Returns the longest context of the batch.
///
/// # Errors
/// [`Error::ShapeMismatch`], [`Error::CorruptBlockTable`], [`Error::BlockOutOfRange`],
/// [`Error::TooLong`].
pub fn validate_csr(layout: &KvLayout, num_blocks: usize, tables: &CsrTables) -> Result<usize> {
    let batch = tables.last_page_len.len();
    if tables.indptr.len() != batch + 1 {
        return Err(Error::ShapeMismatch {
            what: "CSR indptr (batch + 1 offsets)",
            expected: batch + 1,
            got: tables.indptr.len(),
        });
    }
    if tables.indptr[0] != 0 || tables.indptr[batch] as usize != tables.indices.len() {
        return Err(Error::CorruptBlockTable(format!(
            "CSR indptr must run from 0 to {} (the indices), runs from {} to {}",
            tables.indices.len(),
            tables.indptr[0],
            tables.indptr[batch]
        )));
    }
    let bs = layout.block_size();
    let mut longest = 0;
    for i in 0..batch {
        let (start, end) = (tables.indptr[i] as usize, tables.indptr[i + 1] as usize);
        if end < start {
            return Err(Error::CorruptBlockTable(format!(
                "CSR indptr decreases at sequence {i}: {start} then {end}"
            )));
        }
        if end > tables.indices.len() {
            return Err(Error::CorruptBlockTable(format!(
                "CSR indptr of sequence {i} ends at {end}, past the {} indices",
                tables.indices.len()
            )));
        }
        let nb = end - start;
        let last = tables.last_page_len[i] as usize;
        let context = match (nb, last) {
            (0, 0) => 0,
            (0, _) => {
                return Err(Error::CorruptBlockTable(format!(
                    "sequence {i} has no blocks but last_page_len {last}"
                )))
            }
            (_, l) if l == 0 || l > bs => {
                return Err(Error::CorruptBlockTable(format!(
                    "sequence {i}: last_page_len {l} outside 1..={bs}"
                )))
            }
            (n, l) => (n - 1).saturating_mul(bs).saturating_add(l),
        };
        check_row(
            layout,
            num_blocks,
            i,
            &tables.indices[start..end],
            context,
            0,
        )?;
        longest = longest.max(context);
    }
    Ok(longest)
}
