//! Export and import of one sequence of a [`KvCache`] of any number of groups (a hybrid
//! model, or one group): one
//! buffer carries every group's part, and the import admits the sequence in every
//! group at once.
//!
//! ```
//! use pagedkv::{BlockId, DType, GroupSpec, GroupStep, HostStorage, KvCache, KvLayout,
//!               ModelShape, SeqId, Storage};
//! use pagedkv::export::groups::{export_group_sequence, exported_group_len,
//!                               import_group_sequence};
//!
//! let shape = ModelShape { num_layers: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 4,
//!                          kv_dtype: DType::F32 };
//! let l = KvLayout::new(shape, 4)?;
//! let specs = [GroupSpec::full(l), GroupSpec::window(l, 8)];
//! let (mut prefill, mut prefill_kv) = (KvCache::hybrid(&specs, 16)?, HostStorage::new(l, 16)?);
//! let mut step = GroupStep::default();
//! prefill.admit_grouped(SeqId(1), 20, &mut step)?;
//! for slots in &step.slots {                   // each group's K/V of the 20 tokens
//!     prefill_kv.write_slots(0, slots, &[7; 20 * 16], &[8; 20 * 16])?;
//! }
//! prefill.append_grouped(SeqId(1), 1, &mut step)?;     // the window group gives 3 blocks back
//! for slots in &step.slots {
//!     prefill_kv.write_slots(0, slots, &[7; 16], &[8; 16])?;
//! }
//!
//! let mut wire = vec![0; exported_group_len(&prefill, &prefill_kv, SeqId(1), false)?];
//! export_group_sequence(&prefill, &prefill_kv, SeqId(1), None, &mut wire)?;
//!
//! let (mut decode, mut decode_kv) = (KvCache::hybrid(&specs, 16)?, HostStorage::new(l, 16)?);
//! import_group_sequence(&mut decode, &mut decode_kv, SeqId(5), &wire)?;
//! assert_eq!(decode.num_computed_tokens(SeqId(5))?, 21);
//! let window_table = decode.group(1).block_table(SeqId(5))?;
//! assert_eq!(window_table.iter().filter(|&&b| b == BlockId::RELEASED).count(), 3); // holes
//!
//! wire[100] ^= 1;                              // corrupted on the way
//! assert!(import_group_sequence(&mut decode, &mut decode_kv, SeqId(6), &wire).is_err());
//! assert!(!decode.contains(SeqId(6)));
//! # Ok::<(), pagedkv::Error>(())
//! ```
//!
//! # Format (version 1)
//!
//! All integers little-endian. A group header of `40 + 24 x num_groups` bytes:
//!
//! | offset | type | field |
//! |---|---|---|
//! | 0 | `[u8; 8]` | magic [`GROUP_EXPORT_MAGIC`] |
//! | 8 | `u32` | version [`GROUP_EXPORT_VERSION`] |
//! | 12 | `u32` | `num_groups` (1 to 255) |
//! | 16 | `u64` | fixed checksum: XXH64 (seed 0) of bytes 0..40 with this field zeroed |
//! | 24 | `u64` | `num_tokens` of the sequence |
//! | 32 | `u64` | group table checksum: XXH64 of bytes 40 to the end of the group header |
//! | 40 + 24 g | `u64` x 3 | group `g`: sliding window in tokens (0: none; `u64::MAX`: a recurrent-state group), hole blocks, record bytes |
//!
//! As in the single-manager format, no count is trusted before the checksum that
//! covers it passed: a flipped `num_groups` fails the fixed checksum, not a length check.
//!
//! then one record per group, in group order: an export of the
//! [single-manager format](super) of the tokens the group holds, from its first held
//! block to `num_tokens` (`num_tokens - holes x block_size` tokens). A window group's
//! holes (blocks it gave back) are holes here too: only held blocks carry bytes. A
//! recurrent-state group's record is its state pages whole, as the group's own
//! `pages x block_size` "tokens" of its layout (every byte of every page; no holes,
//! no token ids). Each record keeps its own header checksum, tables checksum and
//! block hashes, so every byte of the buffer is covered by a checksum. A reader
//! older than state records refuses one (its token count disagrees, or its window
//! matches no receiver group).
//!
//! Import checks, before anything is allocated: the group header and its checksum,
//! every record (as [`ExportView::parse`]) and its agreement with the group header,
//! then the receiver: the same number of groups, the same window per group, each
//! record compatible with its group's layout ([`super::ExportHeader::check_compatible`];
//! block sizes may differ, but a window group's holes must be whole blocks of the
//! receiver; a state group only into a state group of the same page layout, block
//! size and pages per sequence, [`Error::ExportShape`]), then the pages of every
//! group against the arena ([`Error::OutOfBlocks`]). With token ids (in every record, each carrying its
//! tokens' ids, checked to agree), [`GroupExportView::import_into_cache`] imports
//! through the receiver's prefix caches, for a sequence without window holes (an
//! export right after the prefill) into a cache without a state group (its admission
//! would resume from a checkpoint, and checkpoint positions whose state the export
//! does not hold).

use crate::error::{Error, Result};
use crate::executor::storage::Storage;
use crate::ids::{BlockId, SeqId};
use crate::manager::groups::GroupStep;
use crate::manager::KvCache;
use crate::pool::prefix::{Admission, AdmitOptions};

use super::{
    check_storage, export_blocks, exported_len, format_err, read_u32, read_u64, row_bytes, xxh64,
    ExportView,
};

/// First 8 bytes of every group export.
pub const GROUP_EXPORT_MAGIC: [u8; 8] = *b"PAGEDKVG";

/// The group format version this build writes and reads.
pub const GROUP_EXPORT_VERSION: u32 = 1;

const FIXED: usize = 40;
const PER_GROUP: usize = 24;
const CHECKSUM_AT: usize = 16;
const TABLE_CHECKSUM_AT: usize = 32;

fn header_len(num_groups: usize) -> usize {
    FIXED + PER_GROUP * num_groups
}

/// One group's part of a sequence: its held blocks and the tokens they hold.
struct Part<'a> {
    /// The window in tokens (0: none), or [`STATE_WINDOW`] for a state group.
    window: u64,
    holes: usize,
    held: &'a [BlockId],
    tokens: usize,
    record_len: usize,
}

/// The window field of a recurrent-state group's entry.
const STATE_WINDOW: u64 = u64::MAX;

/// The import through the prefix caches cannot carry a state: its admission may resume
/// from a checkpoint and checkpoint positions whose state the export does not hold.
fn refuse_state_groups(groups: &KvCache, operation: &'static str) -> Result<()> {
    match (0..groups.num_groups()).any(|g| groups.group_state_pages(g).is_some()) {
        true => Err(Error::NotOnHybrid {
            operation,
            groups: groups.num_groups(),
        }),
        false => Ok(()),
    }
}

fn parts<'a, S: Storage + ?Sized>(
    groups: &'a KvCache,
    storage: &S,
    seq: SeqId,
    with_token_ids: bool,
) -> Result<(usize, Vec<Part<'a>>)> {
    if !groups.contains(seq) {
        return Err(Error::UnknownSequence(seq));
    }
    let num_tokens = groups.group(0).readable_blocks(seq)?.1;
    let mut out = Vec::with_capacity(groups.num_groups());
    for g in 0..groups.num_groups() {
        let kv = groups.group(g);
        check_storage(kv, storage)?;
        let (table, computed) = kv.readable_blocks(seq)?;
        if groups.group_state_pages(g).is_some() {
            // The state pages, whole: the group's own count of "tokens".
            out.push(Part {
                window: STATE_WINDOW,
                holes: 0,
                held: table,
                tokens: computed,
                record_len: exported_len(kv.layout(), computed, false)?,
            });
            continue;
        }
        let holes = table
            .iter()
            .take_while(|&&b| b == BlockId::RELEASED)
            .count();
        let tokens = computed.saturating_sub(holes * kv.block_size());
        out.push(Part {
            window: kv.sliding_window().unwrap_or(0) as u64,
            holes,
            held: &table[holes..],
            tokens,
            record_len: exported_len(kv.layout(), tokens, with_token_ids)?,
        });
    }
    Ok((num_tokens, out))
}

fn total_len(parts: &[Part<'_>]) -> Result<usize> {
    parts
        .iter()
        .try_fold(header_len(parts.len()), |sum, p| {
            sum.checked_add(p.record_len)
        })
        .ok_or_else(|| Error::Unsupported("group export size overflows usize".into()))
}

/// Bytes [`export_group_sequence`] writes for `seq` now, with or without token ids.
///
/// # Errors
/// As [`export_group_sequence`], except for the buffer.
pub fn exported_group_len<S: Storage + ?Sized>(
    groups: &KvCache,
    storage: &S,
    seq: SeqId,
    with_token_ids: bool,
) -> Result<usize> {
    total_len(&parts(groups, storage, seq, with_token_ids)?.1)
}

/// Exports every computed token of `seq` in every group of `groups` (their K/V in
/// `storage`, shared by all groups, so every group's layout must be the storage's)
/// into `out` (see the [module docs](self) for the format); returns the bytes written.
/// `token_ids`, when given, travel in every record (a holed record carries the ids of
/// its tokens), for [`GroupExportView::import_into_cache`].
///
/// # Errors
/// [`Error::UnknownSequence`]; [`Error::SequenceState`] when the sequence's bytes are
/// not readable (swapped out, or a swap in flight); [`Error::InvalidConfig`] when a
/// group's layout is not the storage's; [`Error::ShapeMismatch`] when `out` is too
/// short or `token_ids` is not one per computed token; as [`export_blocks`]. Nothing changes; `out` holds unspecified bytes after
/// an error.
pub fn export_group_sequence<S: Storage + ?Sized>(
    groups: &KvCache,
    storage: &S,
    seq: SeqId,
    token_ids: Option<&[u32]>,
    out: &mut [u8],
) -> Result<usize> {
    let (num_tokens, parts) = parts(groups, storage, seq, token_ids.is_some())?;
    if let Some(ids) = token_ids.filter(|ids| ids.len() != num_tokens) {
        return Err(Error::ShapeMismatch {
            what: "token ids for the exported tokens",
            expected: num_tokens,
            got: ids.len(),
        });
    }
    let total = total_len(&parts)?;
    if out.len() < total {
        return Err(Error::ShapeMismatch {
            what: "group export buffer bytes (at least)",
            expected: total,
            got: out.len(),
        });
    }
    let (head, mut rest) = out[..total].split_at_mut(header_len(parts.len()));
    for p in &parts {
        let (record, tail) = rest.split_at_mut(p.record_len);
        let ids = token_ids
            .filter(|_| p.window != STATE_WINDOW)
            .map(|ids| &ids[num_tokens - p.tokens..]);
        export_blocks(storage, p.held, p.tokens, ids, record)?;
        rest = tail;
    }
    head.fill(0);
    head[..8].copy_from_slice(&GROUP_EXPORT_MAGIC);
    head[8..12].copy_from_slice(&GROUP_EXPORT_VERSION.to_le_bytes());
    // `KvCache::hybrid` allows at most 255 groups.
    head[12..16].copy_from_slice(&(parts.len() as u32).to_le_bytes());
    head[24..32].copy_from_slice(&(num_tokens as u64).to_le_bytes());
    for (p, dst) in parts.iter().zip(head[FIXED..].chunks_exact_mut(PER_GROUP)) {
        for (i, v) in [p.window, p.holes as u64, p.record_len as u64]
            .into_iter()
            .enumerate()
        {
            dst[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes());
        }
    }
    let table = xxh64(&head[FIXED..]);
    head[TABLE_CHECKSUM_AT..FIXED].copy_from_slice(&table.to_le_bytes());
    let checksum = xxh64(&head[..FIXED]);
    head[CHECKSUM_AT..CHECKSUM_AT + 8].copy_from_slice(&checksum.to_le_bytes());
    Ok(total)
}

/// One group's part of a validated group export.
#[derive(Debug, Clone, Copy)]
pub struct GroupRecord<'a> {
    /// The sender group's sliding window (`None`: full, latent or state).
    pub window: Option<usize>,
    /// A recurrent-state group's pages per sequence (`None`: a KV group); the record
    /// holds every byte of them, as `pages x block_size` "tokens" of its layout.
    pub state_pages: Option<usize>,
    /// Blocks (of the sender's block size) before the first held one.
    pub holes: usize,
    /// The held tokens' K/V, validated.
    pub view: ExportView<'a>,
}

/// A validated group export: group header parsed, every record and checksum passed.
#[derive(Debug, Clone)]
pub struct GroupExportView<'a> {
    num_tokens: usize,
    records: Vec<GroupRecord<'a>>,
}

fn usize_field(what: &'static str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| format_err(what, 0, v))
}

impl<'a> GroupExportView<'a> {
    /// Validates a group export at the start of `buf` (trailing bytes are ignored).
    ///
    /// # Errors
    /// [`Error::ExportFormat`] for a wrong magic or version, a group count out of
    /// range, or fields that contradict each other or their records;
    /// [`Error::ExportTruncated`] when `buf` is shorter than the header says;
    /// [`Error::Checksum`] for the group header or any record (as
    /// [`ExportView::parse`]).
    pub fn parse(buf: &'a [u8]) -> Result<Self> {
        if buf.len() >= 8 && buf[..8] != GROUP_EXPORT_MAGIC {
            return Err(format_err(
                "group magic",
                u64::from_le_bytes(GROUP_EXPORT_MAGIC),
                read_u64(buf),
            ));
        }
        if buf.len() >= 12 && read_u32(&buf[8..]) != GROUP_EXPORT_VERSION {
            return Err(format_err(
                "group version",
                GROUP_EXPORT_VERSION.into(),
                read_u32(&buf[8..]).into(),
            ));
        }
        if buf.len() < FIXED {
            return Err(Error::ExportTruncated {
                needed: FIXED,
                got: buf.len(),
            });
        }
        let stored = read_u64(&buf[CHECKSUM_AT..]);
        let mut h = xxhash_rust::xxh64::Xxh64::new(0);
        h.update(&buf[..CHECKSUM_AT]);
        h.update(&[0; 8]);
        h.update(&buf[CHECKSUM_AT + 8..FIXED]);
        let computed = h.digest();
        if stored != computed {
            return Err(Error::Checksum {
                what: "KV group export header".into(),
                expected: stored,
                got: computed,
            });
        }
        let num_groups = read_u32(&buf[12..]) as usize;
        if !(1..=255).contains(&num_groups) {
            return Err(format_err("num_groups", 255, num_groups as u64));
        }
        let head_len = header_len(num_groups);
        if buf.len() < head_len {
            return Err(Error::ExportTruncated {
                needed: head_len,
                got: buf.len(),
            });
        }
        let head = &buf[..head_len];
        let stored = read_u64(&head[TABLE_CHECKSUM_AT..]);
        let computed = xxh64(&head[FIXED..]);
        if stored != computed {
            return Err(Error::Checksum {
                what: "KV group export table".into(),
                expected: stored,
                got: computed,
            });
        }
        let num_tokens = usize_field("num_tokens", read_u64(&head[24..]))?;
        let mut sum = head_len;
        let mut fields = Vec::with_capacity(num_groups);
        for f in head[FIXED..].chunks_exact(PER_GROUP) {
            let window = match read_u64(f) {
                STATE_WINDOW => None,
                w => Some(usize_field("window", w)?),
            };
            let holes = usize_field("holes", read_u64(&f[8..]))?;
            let len = usize_field("record_len", read_u64(&f[16..]))?;
            sum =
                sum.checked_add(len)
                    .ok_or(format_err("record_len (overflows)", 0, len as u64))?;
            fields.push((window, holes, len));
        }
        let total = sum;
        if buf.len() < total {
            return Err(Error::ExportTruncated {
                needed: total,
                got: buf.len(),
            });
        }
        let mut at = head_len;
        let mut records = Vec::with_capacity(num_groups);
        for (window, holes, len) in fields {
            let view = ExportView::parse(&buf[at..at + len])?;
            let h = view.header();
            if h.total_len() != len {
                return Err(format_err("record_len", h.total_len() as u64, len as u64));
            }
            let Some(window) = window else {
                // A state group: whole pages, no holes, no token ids.
                let bs = h.layout().block_size();
                if holes > 0 || h.has_token_ids() || h.num_tokens() == 0 || h.num_tokens() % bs != 0
                {
                    return Err(format_err(
                        "state record (whole pages, no holes, no token ids)",
                        0,
                        h.num_tokens() as u64,
                    ));
                }
                records.push(GroupRecord {
                    window: None,
                    state_pages: Some(h.num_tokens() / bs),
                    holes,
                    view,
                });
                at += len;
                continue;
            };
            let hole_tokens = holes
                .checked_mul(h.layout().block_size())
                .ok_or(format_err("holes (overflow)", 0, holes as u64))?;
            if hole_tokens.checked_add(h.num_tokens()) != Some(num_tokens) {
                return Err(format_err(
                    "record tokens (num_tokens - holes x block_size)",
                    num_tokens.saturating_sub(hole_tokens) as u64,
                    h.num_tokens() as u64,
                ));
            }
            if window == 0 && holes > 0 {
                return Err(format_err(
                    "holes of a group without window",
                    0,
                    holes as u64,
                ));
            }
            records.push(GroupRecord {
                window: (window > 0).then_some(window),
                state_pages: None,
                holes,
                view,
            });
            at += len;
        }
        let Some(first_kv) = records.iter().find(|r| r.state_pages.is_none()) else {
            return Err(format_err("KV groups (at least one)", 1, 0));
        };
        let with_ids = first_kv.view.header().has_token_ids();
        // Every record's ids are the tail of a whole record's (when one has no holes).
        let kv_records = || records.iter().filter(|r| r.state_pages.is_none());
        let whole = kv_records().find(|r| r.holes == 0);
        for r in kv_records() {
            let agree = r.view.header().has_token_ids() == with_ids
                && whole.is_none_or(|w| {
                    let skip = num_tokens - r.view.header().num_tokens();
                    w.view.token_ids().skip(skip).eq(r.view.token_ids())
                });
            if !agree {
                return Err(format_err("token ids (the same in every record)", 1, 0));
            }
        }
        Ok(GroupExportView {
            num_tokens,
            records,
        })
    }

    /// Tokens of the sequence.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Each group's record, in group order.
    pub fn records(&self) -> &[GroupRecord<'a>] {
        &self.records
    }

    /// Admits the exported sequence as `seq` in every group of `groups` at once and
    /// writes each group's held tokens into `storage` (shared by every group). Holes
    /// stay holes.
    ///
    /// # Errors
    /// [`Error::ExportShape`] when the number of groups, a group's window, or a
    /// record's shape differs, or a window group's holes are not whole blocks of the
    /// receiver; [`Error::ExportDType`]; [`Error::InvalidConfig`] when a group's layout
    /// is not the storage's; [`Error::DuplicateSequence`], [`Error::TooLong`],
    /// [`Error::OutOfBlocks`] from the admission. All of these leave every group as it
    /// was. Should the storage fail a write after the admission, the sequence is freed
    /// again before the error returns.
    pub fn import_into<S: Storage + ?Sized>(
        &self,
        groups: &mut KvCache,
        storage: &mut S,
        seq: SeqId,
    ) -> Result<()> {
        let holes = self.receiver_holes(groups, storage)?;
        let mut step = GroupStep::default();
        groups.admit_with_holes_grouped(seq, self.num_tokens, &holes, &mut step)?;
        self.write(groups, storage, seq, &step, 0)
    }

    /// [`Self::import_into`] through the receiver's prefix caches
    /// ([`KvCache::admit_tokens_grouped`] with the exported token ids): a prefix every
    /// group already serves is shared instead of written, and the imported full blocks
    /// are registered in the full and latent groups. Only the uncached tokens' K/V is
    /// written. Returns what the admission did.
    ///
    /// # Errors
    /// [`Error::ExportFormat`] when the export carries no token ids;
    /// [`Error::NotOnHybrid`] when the receiver has a recurrent-state group;
    /// [`Error::Unsupported`] when a window group's part has holes (the prefix caches
    /// admit whole prompts: export right after the prefill, before the window moves);
    /// otherwise as [`Self::import_into`] and [`KvCache::admit_tokens_grouped`], all
    /// before anything changes. If the storage fails a write, the sequence is freed
    /// and every evictable cached page evicted, so a page registered by this call but
    /// never written cannot be hit later.
    pub fn import_into_cache<S: Storage + ?Sized>(
        &self,
        groups: &mut KvCache,
        storage: &mut S,
        seq: SeqId,
        opts: &AdmitOptions<'_>,
    ) -> Result<Admission> {
        refuse_state_groups(
            groups,
            "import through the prefix caches into a cache with a recurrent-state group",
        )?;
        let Some(first) = self
            .records
            .first()
            .filter(|r| r.view.header().has_token_ids())
        else {
            return Err(format_err(
                "token ids (needed to use the prefix cache)",
                1,
                0,
            ));
        };
        if let Some((g, r)) = self.records.iter().enumerate().find(|(_, r)| r.holes > 0) {
            return Err(Error::Unsupported(format!(
                "import through the prefix caches of a sequence whose group {g} has {} \
                 window holes",
                r.holes
            )));
        }
        self.receiver_holes(groups, storage)?;
        let tokens: Vec<u32> = first.view.token_ids().collect();
        let mut step = GroupStep::default();
        let admission = groups.admit_tokens_grouped(seq, &tokens, opts, &mut step)?;
        if let Err(e) = self.write(groups, storage, seq, &step, admission.cached_tokens) {
            groups.evict_cached(usize::MAX);
            return Err(e);
        }
        Ok(admission)
    }

    /// Checks that `groups` and `storage` can take this export; returns each group's
    /// holes in the receiver's blocks.
    fn receiver_holes<S: Storage + ?Sized>(
        &self,
        groups: &KvCache,
        storage: &S,
    ) -> Result<Vec<usize>> {
        if self.records.len() != groups.num_groups() {
            return Err(Error::ExportShape {
                what: "num_groups",
                sender: self.records.len(),
                receiver: groups.num_groups(),
            });
        }
        let mut holes = Vec::with_capacity(self.records.len());
        for (g, r) in self.records.iter().enumerate() {
            let kv = groups.group(g);
            let state = groups.group_state_pages(g);
            if r.state_pages.is_some() != state.is_some() {
                return Err(Error::ExportShape {
                    what: "recurrent-state group (1) or KV group (0)",
                    sender: usize::from(r.state_pages.is_some()),
                    receiver: usize::from(state.is_some()),
                });
            }
            if let (Some(sent), Some(pages)) = (r.state_pages, state) {
                // Byte for byte: the same page layout and the same pages.
                r.view.header().check_compatible(kv.layout())?;
                check_storage(kv, storage)?;
                let bs = r.view.header().layout().block_size();
                if bs != kv.block_size() {
                    return Err(Error::ExportShape {
                        what: "state page tokens (block size of the state group)",
                        sender: bs,
                        receiver: kv.block_size(),
                    });
                }
                if sent != pages {
                    return Err(Error::ExportShape {
                        what: "state pages per sequence",
                        sender: sent,
                        receiver: pages,
                    });
                }
                holes.push(0);
                continue;
            }
            let receiver = kv.sliding_window();
            if r.window != receiver {
                return Err(Error::ExportShape {
                    what: "sliding window of a group (0: none)",
                    sender: r.window.unwrap_or(0),
                    receiver: receiver.unwrap_or(0),
                });
            }
            r.view.header().check_compatible(kv.layout())?;
            check_storage(kv, storage)?;
            let hole_tokens = r.holes * r.view.header().layout().block_size();
            if hole_tokens % kv.block_size() != 0 {
                return Err(Error::ExportShape {
                    what: "window hole tokens (a multiple of the receiver's block size)",
                    sender: hole_tokens,
                    receiver: kv.block_size(),
                });
            }
            holes.push(hole_tokens / kv.block_size());
        }
        Ok(holes)
    }

    /// Writes every record's tokens from position `skip` on (and past its holes) into
    /// the slots of `step`; frees `seq` when a write fails.
    fn write<S: Storage + ?Sized>(
        &self,
        groups: &mut KvCache,
        storage: &mut S,
        seq: SeqId,
        step: &GroupStep,
        skip: usize,
    ) -> Result<()> {
        let mut state_slots = Vec::new();
        for (g, (r, slots)) in self.records.iter().zip(&step.slots).enumerate() {
            let layout = r.view.header().layout();
            let slots =
                match r.state_pages {
                    // Every token place of every state page, in order: the whole pages.
                    Some(_) => {
                        let kv = groups.group(g);
                        let pages = kv.block_table(seq)?;
                        state_slots.clear();
                        state_slots.extend(pages.iter().flat_map(|&b| {
                            (0..kv.block_size()).map(move |o| kv.layout().slot(b, o))
                        }));
                        &state_slots
                    }
                    None => slots,
                };
            // A state record is written whole (its "tokens" are its pages').
            let first = self.num_tokens.saturating_sub(r.view.header().num_tokens());
            let at = match r.state_pages {
                Some(_) => 0,
                None => skip.saturating_sub(first) * row_bytes(layout),
            };
            for layer in 0..layout.num_layers() {
                let written = match r.view.layer(layer) {
                    // A latent layout's V is empty.
                    Some((k, v)) => {
                        storage.write_slots(layer, slots, &k[at..], &v[at.min(v.len())..])
                    }
                    None => Ok(()),
                };
                if let Err(e) = written {
                    // The fresh sequence owns its pages alone: freeing it cannot fail,
                    // and if it did, the write error is still the one to report.
                    let _ = groups.free(seq);
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

/// Validates the group export at the start of `buf` ([`GroupExportView::parse`]) and
/// imports it as `seq` in every group ([`GroupExportView::import_into`]). A buffer that
/// fails any check, or does not fit the receiver, changes nothing.
///
/// # Errors
/// As [`GroupExportView::parse`] and [`GroupExportView::import_into`].
pub fn import_group_sequence<S: Storage + ?Sized>(
    groups: &mut KvCache,
    storage: &mut S,
    seq: SeqId,
    buf: &[u8],
) -> Result<()> {
    GroupExportView::parse(buf)?.import_into(groups, storage, seq)
}
