//! KV-cache groups: a hybrid model (full-attention, sliding-window and latent layers)
//! as one block table per group for every sequence, over **one** arena of pages.
//!
//! The design is vLLM's hybrid allocator: every group's block is one *page* of the
//! same size in bytes, and a page belongs to exactly one group at a time. Each group
//! is a [`KvCache`] whose pool spans every page of the arena; the pages another
//! group owns are held, in that group's pool, by a hidden *lender* sequence (one
//! reference each, no token of its own), so the group's own allocator, window
//! freeing, copy-on-write and invariants run unchanged. When a group needs more free
//! pages than it owns, hybrid [`KvCache`] moves free pages to it from the others (O(1)
//! a page: one pool `allocate` in the giver, one swap-remove in the taker's lender
//! table). Memory therefore moves freely between groups, and a hybrid model's
//! concurrency is bounded by the whole arena, not by a fixed split.
//!
//! One storage holds every group when the groups' layouts are equal (the usual way:
//! split the model's layers into groups of the same number of layers, as vLLM does;
//! Gemma-3 with 8 global and 40 local layers is one full group and five window groups
//! of 8 layers): layer slot `j` of page `p` holds layer `j` of whichever group owns
//! `p`. Groups of different layouts with the same page bytes share the page budget,
//! but their storage must address a page per layout.
//!
//! Every call acts on all groups at once and is atomic across them: the whole need of
//! every group is checked against the arena's free pages (counting the window blocks
//! the call may give back first) before anything changes, so a failure in any group
//! leaves every group as it was.
//!
//! Prefix caching ([`KvCache::admit_tokens_grouped`]): every full or latent group
//! registers its prompt blocks in its own manager's prefix cache, and a hit is served
//! only as far as every group holds it. A sliding-window group keeps the blocks it
//! gives back (out of the window, or at the sequence's free), keyed by the full
//! group's chain hash of the same block (`groups/window_cache.rs`), and serves a hit
//! when it holds, cached or in a live sequence, the blocks inside the window of the
//! query at the hit's end; the blocks before are holes. Cached pages (a group's prefix
//! cache, a window group's kept blocks) count as free for every group: a group that
//! needs a page takes it from another group's cache, the prefix caches first (each by
//! its group's policy), then the window blocks (least recently kept first).
//!
//! Swap ([`KvCache::swap_out_grouped`], [`KvCache::swap_in_grouped`]): one plan per
//! group, over one host tier shared the way the arena is (each group's host pool
//! spans the whole tier; a hidden swapped sequence holds the host blocks other groups
//! own, and free host blocks move to the group that needs them). A window group moves
//! only the blocks a sequence still holds; its holes come back as holes.
//!
//! Export and import of one sequence across every group (window holes stay holes):
//! [`crate::export::groups`].
//!
//! Compaction ([`KvCache::plan_defragment_grouped`]) and resize ([`KvCache::plan_shrink`],
//! [`KvCache::plan_grow`]) plan one `MovePlan` over page ids: a destination owned by
//! another group changes owner at commit; a shrink then takes the tail out of every
//! group's pool (the lenders give their pages back first), a grow adds pages owned by
//! group 0.
//!
//! **Recurrent-state groups** ([`GroupSpec::state`]: the Mamba, Mamba-2 or gated
//! DeltaNet layers of a hybrid model) hold a fixed state per sequence, whatever its
//! length: every sequence holds exactly the group's `pages_per_seq` pages from its
//! admission to its free. Inside, the group is a one-group manager like the others
//! whose sequences are `pages_per_seq` full blocks of computed "tokens" of its own
//! (never registered, never reserved), so lending, swap, compaction and invariants
//! run unchanged. Call by call:
//!
//! * admission allocates the state pages (counted by `can_admit` and `admit_pages`);
//!   `step.slots[g]` stays empty (no K/V slot);
//! * appends, reservations and commits allocate and change nothing in the group; in a
//!   batch step ([`KvCache::reserve_step_grouped`]) the group's buffers carry group
//!   0's rows, positions and context lengths, every slot `-1`, and each row's table is
//!   the sequence's state pages: that is where the kernel finds the state;
//! * [`KvCache::fork_grouped`] gives the child pages of its own and copies the state
//!   (one copy per page in the group's `CopyPlan`); a state page is never shared.
//!   [`KvCache::fork`], which returns no copies, refuses ([`Error::NotOnHybrid`]);
//! * truncation below the computed tokens is refused ([`Error::StateRollback`]): the
//!   state after token `p` cannot be recovered from the state after a later token, so
//!   an engine that speculates keeps each draft's state itself. A commit of fewer
//!   tokens than were reserved (rejected drafts) is accepted as in any group: the
//!   cache cannot see what the state kernel consumed, and the engine restores the
//!   state of the accepted prefix from its per-draft copies;
//! * swap moves the state pages like KV pages; recompute preemption frees them;
//! * prefix hits resume from **checkpoints** of the state ([`KvCache::checkpoint_grouped`],
//!   `groups/checkpoints.rs`): a hit stops at the deepest position where the attention
//!   groups' cached chain and a checkpoint agree, and without a checkpoint there is no
//!   hit (`cached_tokens` 0, every prompt token computed). A [`CheckpointPolicy`]
//!   places them: at shared prefix ends and prompt ends during the admission's step
//!   ([`GroupStep::checkpoints`]), and at turn ends;
//! * export and import of a sequence carry the state pages byte for byte
//!   ([`crate::export::groups`]); the import through the prefix caches refuses
//!   ([`Error::NotOnHybrid`]).
//!
//! The state takes whole pages of the arena: a state of `B` bytes per sequence takes
//! `ceil(B / page_bytes)` pages ([`GroupSpec::state_for_bytes`]) and wastes less than
//! one page per sequence ([`GroupSpec::state_waste_bytes`]; `cargo test --test
//! cache state_groups::page_waste -- --nocapture` prints it for the hybrid models of
//! `tests/data`).

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqHandle, SeqId, SwapTicket};
use crate::layout::plans::{CopyPlan, MovePlan, SwapPlan};
use crate::layout::{KvLayout, Slot};
use crate::pool::prefix::{Admission, AdmitOptions};
use crate::pool::BlockState;

use super::{KvCache, PrefixHit, Sequence, TierConfig};

/// The sequence id that holds, in each group, the pages other groups own.
const LENDER: SeqId = SeqId(u64::MAX);

/// The swapped sequence id that holds, in each group, the host-tier blocks other
/// groups own.
const HOST_LENDER: SeqId = SeqId(u64::MAX - 1);

pub(super) fn is_hidden(seq: SeqId) -> bool {
    seq == LENDER || seq == HOST_LENDER || seq == CHECKPOINTS || seq == WINDOW_CACHE
}

mod checkpoints;
pub use checkpoints::{CheckpointPolicy, StateCheckpoint};
use checkpoints::{Checkpoints, CHECKPOINTS};
mod window_cache;
use window_cache::{WindowCache, WindowHit, WINDOW_CACHE};
mod host_level;
pub(crate) use host_level::STORE_JOB;
mod disk_level;
use disk_level::tier_tokens;
pub use disk_level::{GroupDiskLoadJob, GroupDiskStoreJob};

const NOT_LENT: u32 = u32::MAX;

/// One KV-cache group: its layout (the layers it holds) and its attention kind.
#[derive(Debug, Clone, Copy)]
pub struct GroupSpec {
    /// The group's layers, dtype and block size; its `block_bytes()` is the page size
    /// and must be equal across groups.
    pub layout: KvLayout,
    /// Sliding window in tokens (`None`: every token stays, as for full attention and
    /// latent/MLA layers).
    pub window: Option<usize>,
    /// A recurrent-state group (Mamba-2, gated DeltaNet layers): the pages each
    /// sequence holds from admission to free, whatever its length (`None`: a KV
    /// group). See [`GroupSpec::state`].
    pub state_pages: Option<usize>,
}

impl GroupSpec {
    /// A group of full-attention (or latent) layers.
    pub fn full(layout: KvLayout) -> Self {
        GroupSpec {
            layout,
            window: None,
            state_pages: None,
        }
    }

    /// A group of sliding-window layers of `tokens`.
    pub fn window(layout: KvLayout, tokens: usize) -> Self {
        GroupSpec {
            layout,
            window: Some(tokens),
            state_pages: None,
        }
    }

    /// A group of recurrent layers (Mamba, Mamba-2, gated DeltaNet) whose state per
    /// sequence is fixed whatever its length: every sequence holds exactly
    /// `pages_per_seq` pages of the arena in this group, from its admission to its
    /// free (see the [module docs](self) for how each call treats them).
    ///
    /// **Where a kernel finds a sequence's state**: the group's block table of the
    /// sequence (`kv.group(g).block_table(seq)`, or the row of the group's
    /// [`crate::StepBuffers`] in a step) is its `pages_per_seq` state pages, in order.
    /// They are pages of the arena like any other, addressed through `layout`: the
    /// kernel of the group's layer `j` reads and writes layer slot `j` of each state
    /// page as plain bytes (the token structure of the layout does not apply), so the
    /// state of one layer is `pages_per_seq x layout.block_bytes() / num_layers`
    /// bytes. New state pages are not zeroed: the engine initialises a new
    /// sequence's state before its first step. `layout` must have the page bytes of
    /// the other groups, as for any group; the state group must not be group 0.
    ///
    /// The group's own counts of a sequence (`kv.group(g).num_computed_tokens`,
    /// `readable_blocks`, its batch views' context lengths) are its own:
    /// `pages_per_seq x block_size` "tokens", never the sequence's; the cache's
    /// counts (`kv.num_computed_tokens`) are the sequence's.
    pub fn state(layout: KvLayout, pages_per_seq: usize) -> Self {
        GroupSpec {
            layout,
            window: None,
            state_pages: Some(pages_per_seq),
        }
    }

    /// [`Self::state`] for a state of `bytes_per_seq` bytes per sequence (all of the
    /// group's recurrent layers together, as the planner's
    /// `StatePlan::bytes_per_sequence` gives it, feature `planner`): `ceil(bytes_per_seq / layout.block_bytes())`
    /// pages. The padding of the last page, [`Self::state_waste_bytes`], is the only
    /// waste: below one page per sequence.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `bytes_per_seq` is 0.
    pub fn state_for_bytes(layout: KvLayout, bytes_per_seq: u64) -> Result<Self> {
        if bytes_per_seq == 0 {
            return Err(Error::config(
                "state bytes per sequence",
                "0 bytes: a state group holds at least one byte",
            ));
        }
        let page = layout.block_bytes() as u64;
        let pages = usize::try_from(bytes_per_seq.div_ceil(page)).map_err(|_| {
            Error::config(
                "state bytes per sequence",
                format!("{bytes_per_seq} bytes: more pages than the address space"),
            )
        })?;
        Ok(Self::state(layout, pages))
    }

    /// Bytes of the state pages of one sequence left unused by a state of
    /// `bytes_per_seq` bytes: `pages x block_bytes - bytes_per_seq` (0 for a KV
    /// group, or a state larger than the pages).
    pub fn state_waste_bytes(&self, bytes_per_seq: u64) -> u64 {
        let held = self.state_pages.unwrap_or(0) as u64 * self.layout.block_bytes() as u64;
        held.saturating_sub(bytes_per_seq)
    }
}

/// What one call hands the engine, per group: the slots to write (`slots[g]`) and the
/// copy-on-write plan to run first (`copies[g]`). Reused across calls (cleared by
/// each call), so a step allocates nothing once the buffers have grown.
#[derive(Debug, Clone, Default)]
pub struct GroupStep {
    /// Slots of each group, in token order.
    pub slots: Vec<Vec<Slot>>,
    /// Copy-on-write plan of each group; execute before writing K/V.
    pub copies: Vec<CopyPlan>,
    /// State checkpoints to take inside this step, by position (an admission under a
    /// [`CheckpointPolicy`]): compute the tokens up to each one's `position`, run its
    /// copies, then compute on.
    pub checkpoints: Vec<StateCheckpoint>,
}

impl GroupStep {
    /// The buffers of a one-group cache, emptied.
    pub(crate) fn one_group(&mut self) -> (&mut Vec<Slot>, &mut CopyPlan) {
        self.reset(1);
        (&mut self.slots[0], &mut self.copies[0])
    }

    fn reset(&mut self, groups: usize) {
        self.slots.resize_with(groups, Vec::new);
        self.copies.resize_with(groups, CopyPlan::new);
        self.slots.iter_mut().for_each(Vec::clear);
        self.copies.iter_mut().for_each(CopyPlan::clear);
        self.checkpoints.clear();
    }
}

/// Counters of a hybrid [`KvCache`] now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupStats {
    /// Pages in the arena.
    pub num_pages: usize,
    /// Pages held by sequences, all groups together.
    pub used_pages: usize,
    /// Pages an allocation can obtain, all groups together: free, and cached in a
    /// group's prefix cache (unreferenced, evicted when needed).
    pub free_pages: usize,
    /// Of `free_pages`, those cached in a prefix cache.
    pub cached_pages: usize,
    /// Highest `used_pages` so far.
    pub peak_used_pages: usize,
    /// Pages each group's sequences hold.
    pub used_per_group: Vec<usize>,
    /// Pages each group owns (held or free).
    pub owned_per_group: Vec<usize>,
    /// Pages moved from one group to another so far.
    pub page_moves: u64,
    /// Sequences on the device (swapped-out ones are not counted).
    pub num_sequences: usize,
}

/// A hybrid model's KV cache: several KV-cache groups, each with its own block tables,
/// drawing pages from one arena; the state behind a hybrid [`KvCache`]. See the
/// [module docs](self).
#[derive(Debug, Clone)]
pub(crate) struct Groups {
    groups: Vec<KvCache>,
    /// `lent_pos[g][page]`: the page's index in group `g`'s lender table, or
    /// `NOT_LENT` when group `g` owns the page.
    lent_pos: Vec<Vec<u32>>,
    /// Pages each group lends (its lender's table length), kept here so that usage
    /// needs no lookup.
    lent: Vec<usize>,
    num_pages: usize,
    watermark_pages: usize,
    peak_used_pages: usize,
    page_moves: u64,
    /// Scratch: each group's need in the call being checked.
    needs: Vec<usize>,
    /// Scratch of the step path: each group's entries and accepted counts, by that
    /// group's handles (see `manager/step.rs`).
    pub(super) step_entries: Vec<Vec<super::StepEntry>>,
    pub(super) step_accepted: Vec<Vec<(SeqHandle, usize)>>,
    /// Scratch of the step path: `step_handles[g][i]`, group `g`'s handle last found
    /// for the sequence in group 0's slot `i`: a guess, checked at every use (see
    /// `manager/step.rs`), that spares the lookup by id where the groups' slots differ.
    pub(super) step_handles: Vec<Vec<SeqHandle>>,
    /// Scratch of the step path: the step's items whose window blocks a window group
    /// may give back (see `manager/step.rs`).
    pub(super) step_giving: Vec<u32>,
    /// `host_lent_pos[g][block]`: as `lent_pos`, for the shared host tier.
    host_lent_pos: Vec<Vec<u32>>,
    /// `state_pages[g]`: the pages each sequence holds in group `g` when it is a
    /// recurrent-state group ([`GroupSpec::state`]).
    state_pages: Vec<Option<usize>>,
    /// The state groups' prefix checkpoints (`groups/checkpoints.rs`).
    checkpoints: Checkpoints,
    /// The window groups' given-back blocks (`groups/window_cache.rs`).
    window_cache: WindowCache,
}

impl Groups {
    /// Groups `specs` over one arena of `num_pages` pages and one host tier of
    /// `num_host_blocks` blocks (the storage's host tier, shared by every group as the
    /// arena is: a host block belongs to one group at a time and moves to the group
    /// that needs it), for [`Self::swap_out`] and [`Self::swap_in`].
    ///
    /// # Errors
    /// As [`Self::new`]; [`Error::InvalidConfig`] when the host tier does not fit
    /// `u32` ids.
    pub fn with_host_tier(
        specs: &[GroupSpec],
        num_pages: usize,
        num_host_blocks: usize,
    ) -> Result<Self> {
        let first = specs
            .first()
            .ok_or_else(|| Error::config("groups", "a model needs at least one group"))?;
        if specs.len() > 255 {
            return Err(Error::config(
                "groups",
                format!("{} groups; at most 255", specs.len()),
            ));
        }
        if num_host_blocks >= NOT_LENT as usize {
            return Err(Error::config(
                "num_host_blocks",
                format!("{num_host_blocks} blocks; at most 2^32 - 2"),
            ));
        }
        if num_pages == 0 || num_pages >= NOT_LENT as usize {
            return Err(Error::config(
                "num_pages",
                format!("{num_pages} pages; the arena needs 1 to 2^32 - 2"),
            ));
        }
        let page = first.layout.block_bytes();
        if let Some((g, s)) = specs
            .iter()
            .enumerate()
            .find(|(_, s)| s.layout.block_bytes() != page)
        {
            return Err(Error::config(
                "groups",
                format!(
                    "group {g} has pages of {} bytes, group 0 of {page}: every group's \
                     block must be the same number of bytes (split the layers evenly or \
                     choose block sizes that match)",
                    s.layout.block_bytes()
                ),
            ));
        }
        for (g, s) in specs.iter().enumerate() {
            match s.state_pages {
                None => {}
                Some(_) if g == 0 => {
                    return Err(Error::config(
                        "groups",
                        "group 0 is a state group: put a KV group first (group 0 \
                         answers for the sequences' tokens)",
                    ))
                }
                Some(_) if s.window.is_some() => {
                    return Err(Error::config(
                        "groups",
                        format!("group {g} has both a window and a state"),
                    ))
                }
                Some(p) if p == 0 || p > num_pages => {
                    return Err(Error::config(
                        "state_pages",
                        format!(
                            "group {g}: {p} state pages per sequence; 1 to the arena's \
                             {num_pages}"
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        // Every group accepts the same longest sequence: the arena in the smallest
        // block size of a full group (window groups hold only their window, state
        // groups their state).
        let max_len = specs
            .iter()
            .filter(|s| s.window.is_none() && s.state_pages.is_none())
            .map(|s| num_pages * s.layout.block_size())
            .min()
            .unwrap_or(usize::MAX);
        let mut groups = Vec::with_capacity(specs.len());
        let mut lent_pos = Vec::with_capacity(specs.len());
        let mut host_lent_pos = Vec::with_capacity(specs.len());
        for (g, spec) in specs.iter().enumerate() {
            // A state group's sequences hold `pages` blocks of "tokens" of its own.
            let own_len = match spec.state_pages {
                Some(pages) => pages * spec.layout.block_size(),
                None => max_len,
            };
            let mut b = KvCache::builder(spec.layout)
                .num_blocks(num_pages)
                .watermark_blocks(0)
                .max_seq_len_tokens(own_len)
                .tiers(TierConfig {
                    num_host_blocks,
                    num_disk_slots: 0,
                });
            if let Some(w) = spec.window {
                b = b.sliding_window(w);
            }
            let mut kv = b.build()?;
            kv.seqs.reserve_room(1)?;
            kv.seqs.insert(LENDER, Sequence::default())?;
            kv.insert_host_lender(HOST_LENDER);
            // Every group holds the same hidden sequences in the same slots (empty
            // where the group has no use for one), so that the groups admit and free
            // the same sequences into the same slots and group 0's handle of a
            // sequence is every group's: the step path then translates no handle.
            if specs.iter().any(|s| s.state_pages.is_some()) {
                kv.insert_checkpoint_holder()?;
            }
            if specs.iter().any(|s| s.window.is_some()) {
                kv.insert_window_cache_holder()?;
            }
            let mut pos = vec![NOT_LENT; num_pages];
            let mut host_pos = vec![NOT_LENT; num_host_blocks];
            if g > 0 {
                // Every page and host block starts in group 0: the others lend them.
                for _ in 0..num_pages {
                    let (p, at) = kv.lend_page()?;
                    pos[p.index()] = at as u32;
                }
                for _ in 0..num_host_blocks {
                    let (h, at) = kv.lend_host_block(HOST_LENDER)?;
                    host_pos[h.index()] = at as u32;
                }
            }
            groups.push(kv);
            lent_pos.push(pos);
            host_lent_pos.push(host_pos);
        }
        let lent = (0..groups.len())
            .map(|g| if g == 0 { 0 } else { num_pages })
            .collect();
        Ok(Groups {
            needs: vec![0; groups.len()],
            step_entries: Vec::new(),
            step_accepted: Vec::new(),
            step_handles: Vec::new(),
            step_giving: Vec::new(),
            lent,
            groups,
            lent_pos,
            host_lent_pos,
            num_pages,
            watermark_pages: 0,
            peak_used_pages: 0,
            page_moves: 0,
            state_pages: specs.iter().map(|s| s.state_pages).collect(),
            checkpoints: Checkpoints::default(),
            window_cache: WindowCache::new(specs, num_pages),
        })
    }

    /// Keeps `pages` free at admission ([`Self::can_admit`]), so running sequences can
    /// grow without an immediate preemption.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `pages` is not below the arena.
    pub fn with_watermark(mut self, pages: usize) -> Result<Self> {
        if pages >= self.num_pages {
            return Err(Error::config(
                "watermark_pages",
                format!("{pages} must be below num_pages {}", self.num_pages),
            ));
        }
        self.watermark_pages = pages;
        Ok(self)
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// Pages in the arena.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// The pages every sequence holds in group `g` when it is a recurrent-state group
    /// ([`GroupSpec::state`]); `None` for a KV group or past the groups.
    pub fn state_pages(&self, g: usize) -> Option<usize> {
        self.state_pages.get(g).copied().flatten()
    }

    /// Whether any group is a recurrent-state group.
    pub fn has_state_group(&self) -> bool {
        self.state_pages.iter().any(Option::is_some)
    }

    /// Admits `seq`'s state in state group `g`: `pages` fresh pages (available in the
    /// group, which the caller ensured), held as `pages` blocks of computed tokens
    /// of the group's own, with no token ids (nothing registered). Leaves `scratch`
    /// empty.
    fn admit_state(&mut self, g: usize, seq: SeqId, scratch: &mut Vec<Slot>) -> Result<()> {
        let pages = self
            .state_pages(g)
            .ok_or_else(|| Error::CorruptBlockTable(format!("group {g} is not a state group")))?;
        let kv = &mut self.groups[g];
        let tokens = pages * kv.block_size();
        let r = kv.admit(seq, tokens, scratch);
        scratch.clear();
        r
    }

    /// Group `g`, read-only: its block tables, batch views (`fill_padded`, `fill_csr`),
    /// `readable_blocks`. Its own `stats` and `sequence_ids` count the hidden sequences
    /// (the holders of the pages other groups own, of checkpoints and of kept window
    /// blocks); use [`Self::stats`] instead.
    ///
    /// # Panics
    /// When `g >= num_groups()`.
    pub fn group(&self, g: usize) -> &KvCache {
        &self.groups[g]
    }

    /// Every group, read-only, in order (the step path's pass over them).
    pub(in crate::manager) fn all_groups(&self) -> &[KvCache] {
        &self.groups
    }

    /// Whether `seq` is here.
    pub fn contains(&self, seq: SeqId) -> bool {
        !is_hidden(seq) && self.groups[0].contains(seq)
    }

    /// The sequences on the device (not the swapped-out ones), in no particular order.
    pub fn sequence_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.groups[0].sequence_ids().filter(|&s| !is_hidden(s))
    }

    /// Tokens of `seq` whose K/V is written (the same in every group).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn num_computed_tokens(&self, seq: SeqId) -> Result<usize> {
        self.check_id(seq)?;
        self.groups[0].num_computed_tokens(seq)
    }

    /// Outstanding reservations of `seq` (the same in every group).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn num_reservations(&self, seq: SeqId) -> Result<usize> {
        self.check_id(seq)?;
        self.groups[0].num_reservations(seq)
    }

    /// Context attention reads for `seq` this step (computed plus reserved).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`].
    pub fn context_len(&self, seq: SeqId) -> Result<usize> {
        self.check_id(seq)?;
        self.groups[0].context_len(seq)
    }

    /// Pages of the whole arena an allocation can obtain: free, or cached in a
    /// group's prefix cache (evicted when taken).
    pub fn num_free_pages(&self) -> usize {
        self.groups
            .iter()
            .map(|kv| kv.num_available_blocks())
            .sum::<usize>()
            + self.evictable_checkpoint_pages()
            + self.window_cached_pages()
    }

    /// Whether a new sequence of `num_tokens` tokens fits in every group at once while
    /// keeping the watermark.
    pub fn can_admit(&self, num_tokens: usize) -> bool {
        num_tokens <= self.groups[0].max_seq_len()
            && self.admit_pages(num_tokens) + self.watermark_pages <= self.num_free_pages()
    }

    /// Pages admitting a prompt of `num_tokens` takes, all groups together.
    pub fn admit_pages(&self, num_tokens: usize) -> usize {
        self.groups
            .iter()
            .zip(&self.state_pages)
            .map(|(kv, state)| state.unwrap_or_else(|| kv.layout.blocks_for_tokens(num_tokens)))
            .sum()
    }

    /// Pages [`Self::reserve`]`(seq, n, lookahead, ..)` would take from the arena now,
    /// all groups together, net of the window pages the call gives back first (pass it
    /// to a preemption decision).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when it holds an
    /// uncommitted reservation; [`Error::TooLong`].
    pub fn pages_needed(&self, seq: SeqId, n: usize, lookahead: usize) -> Result<usize> {
        let mut total = 0usize;
        let mut back = 0usize;
        for (kv, state) in self.groups.iter().zip(&self.state_pages) {
            // A state group's pages are all allocated at admission.
            if state.is_none() {
                total += kv.blocks_needed(seq, n, lookahead)?;
                back += kv.dead_window_pages(seq)?;
            }
        }
        Ok(total.saturating_sub(back))
    }

    /// Admits `seq` with a prompt of `num_tokens` tokens in every group; `step.slots[g]`
    /// gets the slots of every prompt token in group `g`.
    ///
    /// # Errors
    /// [`Error::DuplicateSequence`], [`Error::TooLong`], [`Error::OutOfBlocks`] (with the
    /// pages all groups need and the arena's free pages). Nothing changed on error.
    pub fn admit(&mut self, seq: SeqId, num_tokens: usize, step: &mut GroupStep) -> Result<()> {
        self.admit_holed(seq, num_tokens, None, step)
    }

    /// Admits `seq` with `num_tokens` tokens, all computed, whose first `holes[g]`
    /// blocks in group `g` are holes (blocks a window group gave back): `step.slots[g]`
    /// gets the slots of the tokens after the holes, which the caller writes. For an
    /// import ([`crate::export::groups`]); registers nothing in a prefix cache. A
    /// state group's pages are allocated (its slots stay empty; the caller writes
    /// the pages through the group's block table).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `holes` does not have one entry per group, or a
    /// group has holes it could not have (a full group, or a window group past the
    /// blocks before the window of the query at `num_tokens`); as [`Self::admit`].
    /// Nothing changed on error.
    pub(crate) fn admit_with_holes(
        &mut self,
        seq: SeqId,
        num_tokens: usize,
        holes: &[usize],
        step: &mut GroupStep,
    ) -> Result<()> {
        if holes.len() != self.groups.len() {
            step.reset(self.groups.len());
            return Err(Error::ShapeMismatch {
                what: "hole counts (one per group)",
                expected: self.groups.len(),
                got: holes.len(),
            });
        }
        self.admit_holed(seq, num_tokens, Some(holes), step)
    }

    /// [`Self::admit`] with `holes[g]` hole blocks in group `g` (none when `None`).
    fn admit_holed(
        &mut self,
        seq: SeqId,
        num_tokens: usize,
        holes: Option<&[usize]>,
        step: &mut GroupStep,
    ) -> Result<()> {
        step.reset(self.groups.len());
        if is_hidden(seq) || self.groups[0].contains(seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let limit = self.groups[0].max_seq_len();
        if num_tokens > limit {
            return Err(Error::TooLong {
                tokens: num_tokens,
                limit,
            });
        }
        let holes_of = |g: usize| holes.and_then(|h| h.get(g).copied()).unwrap_or(0);
        for (g, (need, kv)) in self.needs.iter_mut().zip(&self.groups).enumerate() {
            let h = holes_of(g);
            let most = kv.first_block_in_window(num_tokens);
            if h > most {
                return Err(Error::ShapeMismatch {
                    what: "hole blocks of a group (at most those before its window)",
                    expected: most,
                    got: h,
                });
            }
            *need = match self.state_pages[g] {
                Some(pages) => pages,
                None => kv.layout.blocks_for_tokens(num_tokens) - h,
            };
        }
        self.give_pages()?;
        for g in 0..self.groups.len() {
            let h = holes_of(g);
            let done = if self.state_pages[g].is_some() {
                self.admit_state(g, seq, &mut step.slots[g])
            } else {
                self.groups[g].admit_holed(seq, num_tokens, h, &mut step.slots[g])
            };
            if let Err(e) = done {
                // Unreachable after the checks above; undo the groups already done.
                for kv in &mut self.groups[..g] {
                    let _ = kv.free(seq);
                }
                return Err(e);
            }
        }
        self.note_usage();
        Ok(())
    }

    /// Leading tokens of `tokens` every group can serve from its prefix cache now: the
    /// longest prefix, in whole blocks of every group, that each group's cache holds
    /// (see [`Self::admit_tokens`]). Changes nothing.
    ///
    /// # Errors
    /// [`Error::PrefixKeyTooLong`] (for the cache salt, the extra key or a block key).
    pub fn cached_prefix_len(&self, tokens: &[u32], opts: &AdmitOptions<'_>) -> Result<usize> {
        let mut hits = Vec::new();
        Ok(self.common_hit(tokens, opts, true, false, &mut hits)?.0)
    }

    /// Admits `seq` with prompt `tokens` in every group, sharing the cached prefix every
    /// group holds, and schedules the whole uncached rest in this step (committed at
    /// once, as [`KvCache::admit_tokens`] does in one manager): `step.slots[g]`
    /// gets the slots of `tokens[cached_tokens..]` in group `g`. The prompt's full
    /// blocks are registered in the prefix cache of every full or latent group, so the
    /// engine must write every slot it was given in the step that follows.
    ///
    /// The hit is the same number of tokens in every group: the longest prefix each
    /// group's cache holds, rounded down to whole blocks of every group (groups may
    /// have different block sizes). **A sliding-window group serves a hit when it holds
    /// every block inside the window of the query at the hit's end** (the first token
    /// the new sequence computes), each either kept from a sequence that gave it back
    /// (fell out of its window, or freed), under the full group's chain hash of that
    /// block, or held by a live sequence that holds the hit's registered block at the
    /// same index in the first full group (which proves its tokens up to there are the
    /// prompt's). The new sequence revives or shares those blocks and starts with holes
    /// before them, so a shared system prompt keeps hitting after its holders decoded
    /// past it or left. With no full group, or block sizes unlike the full group's, a
    /// window group keeps and serves nothing. A block is kept only when the full
    /// group's block at its index is registered (a duplicate's is not), and not by a
    /// swap-out or a truncation.
    ///
    /// Cached blocks count as free pages for every group: when a group needs a page
    /// and only cached pages of another group are left, that group's prefix cache
    /// evicts one (its own policy) and the page moves.
    ///
    /// Returns what the admission did: `cached_tokens` is common to all groups,
    /// `cached_blocks`, `new_blocks` and `registered_blocks` are summed over the groups.
    ///
    /// # Errors
    /// [`Error::DuplicateSequence`], [`Error::TooLong`], [`Error::PrefixKeyTooLong`],
    /// [`Error::OutOfBlocks`] (with the pages all groups need, cached hit pages not
    /// counted, and the arena's free and evictable pages). Nothing changed on error.
    pub fn admit_tokens(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
        step: &mut GroupStep,
    ) -> Result<Admission> {
        step.reset(self.groups.len());
        // Where the checkpoint policy checkpoints this prompt (looked up before).
        let targets = self.admission_targets(tokens, opts)?;
        let done = self.admit_tokens_pinned(seq, tokens, opts, step);
        // Unpins the checkpoint the admission copied, if any.
        match done {
            Ok(_) => self.use_pinned_checkpoint(),
            Err(_) => self.pin_checkpoint(None),
        }
        let a = done?;
        self.checkpoint_admission(seq, a.cached_tokens, &targets, step)?;
        Ok(a)
    }

    /// [`Self::admit_tokens`] with the hit's checkpoint pinned (by `admit_hit`).
    fn admit_tokens_pinned(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
        step: &mut GroupStep,
    ) -> Result<Admission> {
        let mut sum = self.admit_hit(seq, tokens, opts, true)?;
        let cached = sum.cached_tokens;
        let mut state = 0;
        for ((need, kv), pages) in self
            .needs
            .iter_mut()
            .zip(&self.groups)
            .zip(&self.state_pages)
        {
            // A state group's pages were taken by `admit_hit`.
            *need = match pages {
                Some(p) => {
                    state += p;
                    0
                }
                None => kv.layout.blocks_for_tokens(tokens.len()) - cached / kv.block_size(),
            };
        }
        sum.new_blocks = self.needs.iter().sum::<usize>() + state;
        let rest = tokens.len() - cached;
        let done = self.give_and_reserve(seq, rest, 0, true, None, step, false);
        if let Ok(registered) = done {
            sum.registered_blocks = registered;
        }
        // The state resumes from the checkpoint: copied into the new state pages.
        let done = done.and_then(|_| self.copy_from_pinned(seq, step));
        if let Err(e) = done {
            // Unreachable after the check of `admit_hit`; undo all the same.
            for kv in &mut self.groups {
                let _ = kv.free(seq);
            }
            return Err(e);
        }
        self.note_usage();
        Ok(sum)
    }

    /// The chunked-prefill admission (see [`KvCache::admit_prompt`]): admits `seq`
    /// with the prefix of `tokens` every group serves, computed, and the prompt's ids
    /// recorded, reserving nothing for the rest: the engine reserves the rest chunk by
    /// chunk ([`Self::reserve`]), and each commit registers the full blocks it
    /// completes in the full and latent groups. Only the cached hit pages it revives
    /// are checked against the arena.
    ///
    /// # Errors
    /// As [`Self::admit_tokens`]. Nothing changed on error.
    pub fn admit_prompt(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
    ) -> Result<Admission> {
        let a = self.admit_hit(seq, tokens, opts, false)?;
        self.note_usage();
        Ok(a)
    }

    /// Admits `seq` in every group with the hit every group serves (looked up here),
    /// checking first that the arena holds the pages it revives and, with
    /// `whole_prompt`, the pages of the rest of the prompt too (left in `needs`).
    /// Returns the admission with `cached_tokens` and `cached_blocks` set.
    fn admit_hit(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
        whole_prompt: bool,
    ) -> Result<Admission> {
        if is_hidden(seq) || self.groups[0].contains(seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let limit = self.groups[0].max_seq_len();
        if tokens.len() > limit {
            return Err(Error::TooLong {
                tokens: tokens.len(),
                limit,
            });
        }
        let mut hits = Vec::new();
        let (cached, source, checkpoint) =
            self.common_hit(tokens, opts, whole_prompt, !whole_prompt, &mut hits)?;
        // The checkpoint the state groups resume from stays until the admission
        // copied it (the caller unpins).
        self.pin_checkpoint(checkpoint);
        // Every group's need, revivals of cached hit pages included, against the
        // arena's free and evictable pages, before anything changes. A window group's
        // hit blocks are cached (revived: counted) or held by a live sequence already;
        // its holes need no page.
        for (g, (((need, kv), hit), state)) in self
            .needs
            .iter_mut()
            .zip(&self.groups)
            .zip(&hits)
            .zip(&self.state_pages)
            .enumerate()
        {
            if let Some(pages) = state {
                // The state exists from admission on, whatever is reserved.
                *need = *pages;
                continue;
            }
            let rest = kv.layout.blocks_for_tokens(tokens.len()) - cached / kv.block_size();
            let revived = match (kv.window, &source) {
                (Some(_), Some(wh)) => wh.revived(g),
                _ => kv.hit_admission_blocks(hit) - rest,
            };
            *need = revived + if whole_prompt { rest } else { 0 };
        }
        self.check_needs()?;
        // Revive the hits first: a page moved to another group below must not be one
        // of them (moving evicts by the giver's policy).
        let mut sum = Admission::default();
        // A host or disk hit's part (`groups/host_level.rs`, `groups/disk_level.rs`):
        // the same in every group.
        let loading = hits.iter().map(tier_tokens).max().unwrap_or(0);
        for (g, hit) in hits.iter().enumerate() {
            if self.state_pages[g].is_some() {
                continue;
            }
            let done = match (self.groups[g].window, &source) {
                (Some(_), Some(wh)) => self.admit_window_hit(g, seq, cached, wh),
                // The device part only: the loads' pages come after every revival.
                _ if tier_tokens(hit) > 0 => {
                    self.groups[g].admit_prompt(seq, tokens, &KvCache::device_part(hit))
                }
                _ => self.groups[g].admit_prompt(seq, tokens, hit),
            };
            let done = match done {
                Ok(a) if a.cached_tokens + loading == cached => Ok(a),
                Ok(a) => Err(Error::CorruptBlockTable(format!(
                    "group {g} served {} cached and {loading} loading tokens of {cached} \
                     looked up",
                    a.cached_tokens
                ))),
                Err(e) => Err(e),
            };
            match done {
                Ok(a) => sum.cached_blocks += a.cached_blocks,
                Err(e) => {
                    // Unreachable: the hits were looked up under the same borrow.
                    for kv in &mut self.groups[..=g] {
                        let _ = kv.free(seq);
                    }
                    return Err(e);
                }
            }
        }
        if loading > 0 {
            // Each group's load pages, moved now that the revived hit blocks are held
            // (the check above counted them), and its staging host blocks (counted by
            // `common_hit`); then the loads.
            for (need, hit) in self.needs.iter_mut().zip(hits.iter()) {
                *need = hit.host_blocks() + hit.disk_blocks();
            }
            let mut done = self.give_pages();
            if done.is_ok() && hits.iter().any(|h| h.disk_blocks() > 0) {
                done = self.give_staging_blocks(&hits);
            }
            for (kv, hit) in self.groups.iter_mut().zip(hits.iter()) {
                done = done.and_then(|()| match kv.start_host_load(seq, tokens, hit)? {
                    n if n == loading => Ok(()),
                    n => Err(Error::CorruptBlockTable(format!(
                        "a group loads {n} tokens of a hit whose lower part is {loading}"
                    ))),
                });
            }
            if let Err(e) = done {
                // Unreachable: the arena's pages were counted above.
                for kv in &mut self.groups {
                    if let Some(j) = kv.load_job(seq) {
                        let _ = kv.abort_swap(j.ticket);
                    }
                    let _ = kv.free(seq);
                }
                return Err(e);
            }
            sum.loading_tokens = loading;
        }
        // Then the state groups' pages, taken after the revivals (see above); the
        // check above counted them.
        let mut scratch = Vec::new();
        for g in 0..self.groups.len() {
            let Some(pages) = self.state_pages[g] else {
                continue;
            };
            // `needs` is spent (the callers set it again before using it).
            self.needs.iter_mut().for_each(|n| *n = 0);
            self.needs[g] = pages;
            let done = self
                .give_pages()
                .and_then(|()| self.admit_state(g, seq, &mut scratch));
            if let Err(e) = done {
                // Unreachable: the arena's pages were counted above.
                for kv in &mut self.groups {
                    let _ = kv.free(seq);
                }
                return Err(e);
            }
        }
        sum.cached_tokens = cached - sum.loading_tokens;
        Ok(sum)
    }

    /// Appends and commits `n` tokens of `seq` in every group (the decode path; see
    /// [`KvCache::append`]).
    ///
    /// # Errors
    /// As [`Self::reserve`]. Nothing changed on error.
    pub fn append(&mut self, seq: SeqId, n: usize, step: &mut GroupStep) -> Result<()> {
        self.step(seq, n, 0, true, None, step, false)
    }

    /// Appends and commits `tokens` to `seq` in every group as [`Self::append`] does,
    /// and records their ids, so that every full computed block is registered in the
    /// prefix caches of the full and latent groups (a later prompt that continues this
    /// conversation hits them).
    ///
    /// # Errors
    /// As [`Self::append`]. Nothing changed on error.
    pub fn append_tokens(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        step: &mut GroupStep,
    ) -> Result<()> {
        self.step(seq, tokens.len(), 0, true, Some(tokens), step, false)
    }

    /// Reserves slots for the next `n` tokens of `seq` plus `lookahead` in every group
    /// (see [`KvCache::reserve`]); [`Self::commit`] marks the computed ones.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::SequenceState`] (swapped out, or holding
    /// an uncommitted reservation), [`Error::TooLong`], [`Error::OutOfBlocks`] with the
    /// pages all groups need. Nothing changed on error.
    pub fn reserve(
        &mut self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        step: &mut GroupStep,
    ) -> Result<()> {
        self.step(seq, n, lookahead, false, None, step, false)
    }

    /// Reserves the next `n` query tokens of `seq` plus `lookahead` in every group on
    /// top of its outstanding reservations (see [`KvCache::reserve_ahead`]): the
    /// per-sequence form of the batch step's reservation ahead.
    ///
    /// # Errors
    /// As [`Self::reserve`], except that outstanding reservations are allowed: then
    /// `n` must be at least 1. Nothing changed on error.
    pub fn reserve_ahead(
        &mut self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        step: &mut GroupStep,
    ) -> Result<()> {
        self.step(seq, n, lookahead, false, None, step, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        commit_now: bool,
        tokens: Option<&[u32]>,
        step: &mut GroupStep,
        ahead: bool,
    ) -> Result<()> {
        step.reset(self.groups.len());
        self.check_id(seq)?;
        if commit_now && lookahead == 0 && self.append_in_last_blocks(seq, n, tokens, step)? {
            return Ok(());
        }
        let kv0 = &self.groups[0];
        let outstanding = kv0.context_len(seq)? != kv0.num_computed_tokens(seq)?;
        if ahead && outstanding {
            // What the groups' `reserve_at` checks for a stacked reservation, checked
            // here before any page moves.
            super::check_stack(seq, true, n, commit_now || tokens.is_some())?;
        } else if outstanding {
            return Err(Error::SequenceState {
                seq,
                state: "holding an uncommitted reservation",
                needed: "committed (commit first; cancel(seq) drops every reservation)",
            });
        }
        let mut back = 0;
        for ((need, kv), state) in self
            .needs
            .iter_mut()
            .zip(&self.groups)
            .zip(&self.state_pages)
        {
            *need = 0;
            if state.is_none() {
                *need = kv.blocks_needed_from_end(seq, n, lookahead, ahead)?;
                back += kv.dead_window_pages(seq)?;
            }
        }
        let total: usize = self.needs.iter().sum();
        let free = self.num_free_pages();
        if total > free + back {
            return Err(Error::OutOfBlocks {
                needed: total,
                free: free + back,
            });
        }
        // The call succeeds from here: give back the window pages no query reads any
        // more *before* allocating, so that a group sized to its steady state does
        // not need a page more for the instant between allocation and release. The
        // pages given back stay cached (counted free) until an allocation evicts them.
        let computed = kv0.num_computed_tokens(seq)?;
        self.forget_leaving();
        self.note_leaving(seq, Some(computed));
        if back > 0 {
            for kv in &mut self.groups {
                kv.release_dead_window(seq)?;
            }
            self.keep_leaving()?;
        }
        self.give_and_reserve(seq, n, lookahead, commit_now, tokens, step, ahead)?;
        // Shared blocks the reservation gave back (no allocation follows it there).
        self.keep_leaving()?;
        self.note_usage();
        Ok(())
    }

    /// The decode step's common case in every group at once: when each group's own
    /// last block takes the `n` tokens in place (see `KvCache::in_last_block`: no
    /// page taken, copied or released, no window moving), appends and commits them
    /// there and returns true; otherwise returns false having changed nothing (every
    /// group is asked before any appends).
    fn append_in_last_blocks(
        &mut self,
        seq: SeqId,
        n: usize,
        tokens: Option<&[u32]>,
        step: &mut GroupStep,
    ) -> Result<bool> {
        let mut handles: smallvec::SmallVec<[SeqHandle; 8]> = smallvec::SmallVec::new();
        let Some(h0) = self.groups[0].seqs.handle(&seq) else {
            return Ok(false);
        };
        for (kv, state) in self.groups.iter().zip(&self.state_pages) {
            if state.is_some() {
                // A state group takes no slot; its placeholder is never used.
                handles.push(h0);
                continue;
            }
            // The groups admit and free the same sequences in the same order, so
            // group 0's handle names the sequence in the others too; checked (the
            // slot's id), with a lookup of the id where it does not.
            let h = match kv.seqs.at(h0) {
                Some((id, _)) if id == seq => Some(h0),
                _ => kv.seqs.handle(&seq),
            };
            match h {
                Some(h) if kv.fits_in_last_block(h, n) => handles.push(h),
                _ => return Ok(false),
            }
        }
        for (((kv, h), slots), state) in self
            .groups
            .iter_mut()
            .zip(handles)
            .zip(&mut step.slots)
            .zip(&self.state_pages)
        {
            if state.is_some() {
                continue;
            }
            if kv.append_in_last_block(h, n, tokens, slots).is_none() {
                return Err(Error::CorruptBlockTable(format!(
                    "{seq}: a group's last block refused the step it said it takes"
                )));
            }
        }
        Ok(true)
    }

    /// Moves pages to the groups by `needs`, then reserves in every group (the checks
    /// are the caller's: failures here are internal corruption). Returns the blocks
    /// registered in the prefix caches.
    #[allow(clippy::too_many_arguments)]
    fn give_and_reserve(
        &mut self,
        seq: SeqId,
        n: usize,
        lookahead: usize,
        commit_now: bool,
        tokens: Option<&[u32]>,
        step: &mut GroupStep,
        ahead: bool,
    ) -> Result<usize> {
        self.give_pages()?;
        let mut registered = 0;
        for (g, kv) in self.groups.iter_mut().enumerate() {
            if self.state_pages[g].is_some() {
                continue;
            }
            if ahead {
                // A reservation on top of others takes no ids: it registers nothing.
                kv.reserve_ahead(seq, n, lookahead, &mut step.slots[g], &mut step.copies[g])?;
                continue;
            }
            registered += kv.reserve_inner(
                seq,
                n,
                lookahead,
                commit_now,
                tokens,
                &mut step.slots[g],
                &mut step.copies[g],
            )?;
        }
        Ok(registered)
    }

    /// Marks `n` reserved tokens of `seq` computed in every group (see
    /// [`KvCache::commit`]); window groups give back what left the window.
    ///
    /// # Errors
    /// [`Error::UnknownSequence`], [`Error::SequenceState`],
    /// [`Error::CommitPastReservation`]. Nothing changed on error.
    pub fn commit(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        self.check_id(seq)?;
        self.forget_leaving();
        if let Ok(computed) = self.groups[0].num_computed_tokens(seq) {
            self.note_leaving(seq, Some(computed + n));
        }
        // Group 0 checks; the others hold the same sequence state.
        let mut registered = self.groups[0].commit(seq, n)?;
        for (kv, state) in self.groups.iter_mut().zip(&self.state_pages).skip(1) {
            if state.is_none() {
                registered += kv.commit(seq, n)?;
            }
        }
        self.keep_leaving()?;
        Ok(registered)
    }

    /// Truncates `seq` to `new_len` tokens in every group (see [`KvCache::truncate`]);
    /// every group checks first (a window group refuses a length whose window starts
    /// in blocks it gave back), so a refusal changes no group. The blocks released
    /// stay with the group that held them. A state group holds the state after the
    /// last computed token, which no truncation can roll back: with a state group,
    /// only the slots past the computed tokens can be dropped.
    ///
    /// # Errors
    /// As [`KvCache::truncate`]; [`Error::StateRollback`] below the computed tokens
    /// when a group is a state group. Nothing changed on error.
    pub fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        self.check_id(seq)?;
        for (kv, state) in self.groups.iter().zip(&self.state_pages) {
            if state.is_none() {
                kv.check_truncate(seq, new_len)?;
            }
        }
        if self.has_state_group() {
            let computed = self.groups[0].num_computed_tokens(seq)?;
            if new_len < computed {
                return Err(Error::StateRollback {
                    seq,
                    computed,
                    new_len,
                });
            }
        }
        for (kv, state) in self.groups.iter_mut().zip(&self.state_pages) {
            if state.is_none() {
                kv.truncate_checked(seq, new_len)?;
            }
        }
        self.note_usage();
        Ok(())
    }

    /// Puts `seq` in the fork group of `with` in every group (see
    /// [`KvCache::join_fork_group`]).
    ///
    /// # Errors
    /// As [`KvCache::join_fork_group`]. Nothing changed on error.
    pub fn join_fork_group(&mut self, seq: SeqId, with: SeqId) -> Result<()> {
        self.check_id(seq)?;
        self.check_id(with)?;
        // Group 0 checks; the others hold the same sequences in the same states.
        self.groups[0].join_fork_group(seq, with)?;
        for kv in &mut self.groups[1..] {
            kv.join_fork_group(seq, with)?;
        }
        Ok(())
    }

    /// Forks `parent` into `child` in every group: all pages shared, copy-on-write on
    /// the next write.
    ///
    /// # Errors
    /// As [`KvCache::fork`]; [`Error::NotOnHybrid`] when a group is a state group
    /// (the child's state must be copied: [`Self::fork_copying`]). Nothing changed on
    /// error.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if self.has_state_group() {
            return Err(Error::NotOnHybrid {
                operation: "fork on a cache with a recurrent-state group (the child's state \
                            is a copy: use fork_grouped)",
                groups: self.groups.len(),
            });
        }
        self.check_id(parent)?;
        if is_hidden(child) {
            return Err(Error::DuplicateSequence(child));
        }
        self.groups[0].fork(parent, child)?;
        for kv in &mut self.groups[1..] {
            kv.fork(parent, child)?;
        }
        Ok(())
    }

    /// Forks `parent` into `child` in every group: a KV group shares every page
    /// (copy-on-write on the next write, as [`Self::fork`]); a state group gives the
    /// child state pages of its own and puts one copy per page, parent page to child
    /// page, in `step.copies[g]`, which the engine runs before the child's next step
    /// writes its state. No state page is ever shared: each sequence's state is
    /// written in place every step. `step.slots` are left empty.
    ///
    /// # Errors
    /// As [`KvCache::fork`]; [`Error::OutOfBlocks`] with the state pages every state
    /// group needs and the arena's free pages. Nothing changed on error.
    pub fn fork_copying(
        &mut self,
        parent: SeqId,
        child: SeqId,
        step: &mut GroupStep,
    ) -> Result<()> {
        step.reset(self.groups.len());
        self.check_id(parent)?;
        if is_hidden(child) || self.groups[0].contains(child) {
            return Err(Error::DuplicateSequence(child));
        }
        // The checks of every group's fork (the groups hold the same sequences in the
        // same states), before any page moves.
        self.groups[0].idle(parent)?;
        for (need, state) in self.needs.iter_mut().zip(&self.state_pages) {
            *need = state.unwrap_or(0);
        }
        self.give_pages()?;
        let mut scratch = Vec::new();
        for g in 0..self.groups.len() {
            let done = match self.state_pages[g] {
                None => self.groups[g].fork(parent, child),
                Some(_) => self.admit_state(g, child, &mut scratch).and_then(|()| {
                    let kv = &mut self.groups[g];
                    // The child is one of the parent's fork group, as in a KV group.
                    kv.join_fork_group(child, parent)?;
                    let priority = kv.seq(parent)?.preempt_priority;
                    kv.set_preempt_priority(child, priority)?;
                    let (from, to) = (&kv.seq(parent)?.table, &kv.seq(child)?.table);
                    for (&src, &dst) in from.iter().zip(to) {
                        step.copies[g].push(src, dst);
                    }
                    Ok(())
                }),
            };
            if let Err(e) = done {
                // Unreachable after the checks above; undo the groups done.
                for kv in &mut self.groups[..=g] {
                    let _ = kv.free(child);
                }
                step.reset(self.groups.len());
                return Err(e);
            }
        }
        self.note_usage();
        Ok(())
    }

    /// Frees `seq` in every group (preemption by recompute is a free and a later
    /// admission).
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]. Nothing changed on error.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        self.check_id(seq)?;
        self.forget_leaving();
        self.note_leaving(seq, None);
        self.groups[0].free(seq)?;
        self.forget_rolling(seq);
        let mut result = Ok(());
        for kv in &mut self.groups[1..] {
            if let Err(e) = kv.free(seq) {
                result = result.and(Err(e));
            }
        }
        result.and(self.keep_leaving())
    }

    /// Plans the swap-out of `seq` in every group at once: each group's plan copies
    /// the blocks the sequence holds there (a window group's holes stay holes) to host
    /// blocks of the shared host tier, which move to the groups that need them.
    /// Execute every plan of the job (one storage: its host block ids are the shared
    /// tier's), then [`Self::complete_swap`], or [`Self::abort_swap`] when a transfer
    /// failed. Preemption by swap is a swap-out and a later [`Self::swap_in`].
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is swapped, has
    /// a swap in flight or holds an uncommitted reservation; [`Error::TierFull`] when
    /// the host tier lacks room for every group's blocks even after evicting the host
    /// levels' entries that can go (swapped sequences come first). Nothing changed on
    /// error.
    pub fn swap_out(&mut self, seq: SeqId) -> Result<GroupSwapJob> {
        self.check_id(seq)?;
        for (need, kv) in self.needs.iter_mut().zip(&self.groups) {
            let s = kv.idle(seq)?;
            *need = s.table.len() - s.released;
        }
        let total: usize = self.needs.iter().sum();
        // Swapped sequences come before the host levels' entries.
        self.make_host_room(total)?;
        self.give_host_blocks()?;
        self.each_group_swap(seq, KvCache::swap_out)
    }

    /// Plans the swap-out of every sequence of `seqs` in every group, one job per
    /// sequence (as [`Self::swap_out`] each: a block two sequences share, a shared
    /// prefix, takes a host block for each), after checking that the host tier holds
    /// all of them: either every job is planned or none. Execute and complete (or
    /// abort) each job as one of [`Self::swap_out`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an empty list or a repeated id; as
    /// [`Self::swap_out`], with [`Error::TierFull`] counting every sequence's blocks.
    /// Nothing changed on error.
    pub fn swap_out_each(&mut self, seqs: &[SeqId]) -> Result<Vec<GroupSwapJob>> {
        super::swap::check_group(seqs)?;
        let mut total = 0usize;
        for &seq in seqs {
            self.check_id(seq)?;
            for kv in &self.groups {
                let s = kv.idle(seq)?;
                total += s.table.len() - s.released;
            }
        }
        self.make_host_room(total)?;
        super::swap::plan_each(self, seqs, Self::swap_out, |g, job| {
            let _ = g.abort_swap(job);
        })
    }

    /// Plans the swap-in of swapped-out `seq` in every group at once (pages move to
    /// the groups that need them); execute every plan, then [`Self::complete_swap`]
    /// or [`Self::abort_swap`].
    ///
    /// # Errors
    /// [`Error::UnknownSequence`]; [`Error::SequenceState`] when `seq` is not swapped
    /// out; [`Error::OutOfBlocks`] with the pages all groups need. Nothing changed on
    /// error.
    pub fn swap_in(&mut self, seq: SeqId) -> Result<GroupSwapJob> {
        self.check_id(seq)?;
        for (need, kv) in self.needs.iter_mut().zip(&self.groups) {
            *need = kv.swapped_table(seq)?.len();
        }
        self.give_pages()?;
        let job = self.each_group_swap(seq, KvCache::swap_in)?;
        self.note_usage();
        Ok(job)
    }

    /// Finishes both directions of a swap in every group (see
    /// [`KvCache::complete_swap`]).
    ///
    /// # Errors
    /// [`Error::UnknownTicket`] when the job is not in flight (nothing changed).
    pub fn complete_swap(&mut self, job: &GroupSwapJob) -> Result<()> {
        self.check_staged(job)?;
        self.finish_swap(job, KvCache::complete_swap)
    }

    /// Undoes a swap in every group (see [`KvCache::abort_swap`]).
    ///
    /// # Errors
    /// [`Error::UnknownTicket`] when the job is not in flight (nothing changed).
    pub fn abort_swap(&mut self, job: &GroupSwapJob) -> Result<()> {
        self.finish_swap(job, KvCache::abort_swap)
    }

    /// Evicts up to `max_pages` cached pages from the groups' prefix caches (each by
    /// its group's policy, group 0 first); returns how many were evicted.
    pub fn evict_cached(&mut self, max_pages: usize) -> usize {
        let mut evicted = 0;
        for kv in &mut self.groups {
            evicted += kv.evict_cached(max_pages - evicted);
        }
        // Then the window groups' cached pages, then the state groups' checkpoints
        // (whole ones only).
        evicted += self.evict_window_pages(max_pages - evicted).unwrap_or(0);
        evicted + self.evict_checkpoints(max_pages - evicted).unwrap_or(0)
    }

    /// Whether `seq` is swapped out (in every group).
    pub fn is_swapped(&self, seq: SeqId) -> bool {
        !is_hidden(seq) && self.groups[0].is_swapped(seq)
    }

    /// Free host-tier blocks, all groups together.
    pub fn num_free_host_blocks(&self) -> usize {
        self.groups.iter().map(|kv| kv.num_free_host_blocks()).sum()
    }

    /// Counters now.
    pub fn stats(&self) -> GroupStats {
        let used_per_group: Vec<usize> = (0..self.groups.len()).map(|g| self.own_used(g)).collect();
        let used_pages = used_per_group.iter().sum();
        GroupStats {
            num_pages: self.num_pages,
            used_pages,
            free_pages: self.num_free_pages(),
            cached_pages: self
                .groups
                .iter()
                .map(|kv| kv.pool.num_cached())
                .sum::<usize>()
                + self.evictable_checkpoint_pages()
                + self.window_cached_pages(),
            peak_used_pages: self.peak_used_pages.max(used_pages),
            owned_per_group: self.lent.iter().map(|l| self.num_pages - l).collect(),
            used_per_group,
            page_moves: self.page_moves,
            num_sequences: self.sequence_ids().count(),
        }
    }

    /// [`KvCache::stats`] of the whole arena: every group's own pages (not those it
    /// lends) and the tokens in them.
    pub fn cache_stats(&self) -> super::CacheStats {
        let st = self.stats();
        let mut live = 0;
        let mut slots = 0;
        for (g, kv) in self.groups.iter().enumerate() {
            // The lender holds each page it lends as a full block of its own, a state
            // group's checkpoint holder each checkpoint page, and a window group's
            // cache holder each cached page.
            live += kv.live_token_slots
                - (self.lent[g] + self.checkpoint_pages_of(g) + self.window_cache_pages_of(g))
                    * kv.block_size();
            slots += self.own_used(g) * kv.block_size();
        }
        super::CacheStats {
            num_blocks: st.num_pages,
            used_blocks: st.used_pages,
            free_blocks: st.free_pages - st.cached_pages,
            cached_blocks: st.cached_pages,
            peak_used_blocks: st.peak_used_pages,
            num_sequences: st.num_sequences,
            live_token_slots: live,
            internal_waste_slots: slots - live,
        }
    }

    /// The highest used pages since the last call (or since creation), and starts a
    /// new period at the pages used now.
    pub fn take_peak_used_pages(&mut self) -> usize {
        let used = self.stats().used_pages;
        let peak = self.peak_used_pages.max(used);
        self.peak_used_pages = used;
        peak
    }

    /// Every group's prefix events, group after group.
    pub fn drain_prefix_events(&mut self, out: &mut Vec<crate::pool::prefix::PrefixEvent>) {
        for kv in &mut self.groups {
            kv.drain_prefix_events(out);
        }
    }

    /// [`KvCache::tier_stats`] of the shared host tier: group 0's counters (every
    /// group swaps together), the tier's use summed over the groups.
    pub fn tier_stats(&self) -> super::TierStats {
        let kv0 = &self.groups[0];
        let st = kv0.tier_stats();
        super::TierStats {
            host_used_blocks: st.host_blocks - self.num_free_host_blocks(),
            swapped_sequences: kv0.tiers.swapped.keys().filter(|&&s| !is_hidden(s)).count(),
            ..st
        }
    }

    /// Group `g`, to change what only it holds (its counters, its events).
    pub(crate) fn group_mut(&mut self, g: usize) -> &mut KvCache {
        &mut self.groups[g]
    }

    /// Checks every group's invariants and the page ownership: every page is owned by
    /// exactly one group and lent (held once by the lender) in all the others, and the
    /// groups hold the same sequences with the same token counts.
    ///
    /// # Errors
    /// A message describing the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        for (g, kv) in self.groups.iter().enumerate() {
            kv.check_invariants()
                .map_err(|e| format!("group {g}: {e}"))?;
            let lender = kv.seq(LENDER).map_err(|e| format!("group {g}: {e}"))?;
            for (i, &p) in lender.table.iter().enumerate() {
                if self.lent_pos[g].get(p.index()) != Some(&(i as u32)) {
                    return Err(format!("group {g}: page {p} lent at {i}, not recorded"));
                }
            }
            let recorded = self.lent_pos[g].iter().filter(|&&x| x != NOT_LENT).count();
            if recorded != lender.table.len() || self.lent[g] != recorded {
                return Err(format!(
                    "group {g}: {recorded} pages recorded lent, {} counted, {} held by the \
                     lender",
                    self.lent[g],
                    lender.table.len()
                ));
            }
        }
        for (g, kv) in self.groups.iter().enumerate() {
            for (i, h) in kv.lent_host_blocks(HOST_LENDER).enumerate() {
                if self.host_lent_pos[g].get(h.index()) != Some(&(i as u32)) {
                    return Err(format!(
                        "group {g}: host block {h} lent at {i}, not recorded"
                    ));
                }
            }
        }
        let host_blocks = self.host_lent_pos.first().map_or(0, Vec::len);
        for h in 0..host_blocks {
            let owners = self
                .host_lent_pos
                .iter()
                .filter(|pos| pos[h] == NOT_LENT)
                .count();
            if owners != 1 {
                return Err(format!("host block {h} is owned by {owners} groups"));
            }
        }
        for p in 0..self.num_pages {
            let owners = self
                .lent_pos
                .iter()
                .filter(|pos| pos[p] == NOT_LENT)
                .count();
            if owners != 1 {
                return Err(format!("page {p} is owned by {owners} groups"));
            }
        }
        let kv0 = &self.groups[0];
        for id in kv0.swapped_sequence_ids().filter(|&s| !is_hidden(s)) {
            if self.groups.iter().any(|kv| !kv.is_swapped(id)) {
                return Err(format!("sequence {id} is not swapped in every group"));
            }
        }
        // The same counts, reservations and swap states in every KV group (the batch
        // step checks group 0 for every group whose handles are group 0's).
        let counts = |kv: &KvCache, id| {
            (
                kv.num_tokens(id).ok(),
                kv.num_computed_tokens(id).ok(),
                kv.context_len(id).ok(),
                kv.num_reservations(id).ok(),
                kv.swap_in_flight(id).is_some(),
            )
        };
        for id in self.sequence_ids() {
            let want = counts(kv0, id);
            for (g, kv) in self.groups.iter().enumerate().skip(1) {
                if self.state_pages[g].is_some() {
                    continue;
                }
                if counts(kv, id) != want {
                    return Err(format!("sequence {id}: group {g} differs from group 0"));
                }
            }
        }
        self.check_state_groups()?;
        // Every group holds the same hidden sequences (see `with_host_tier`).
        let seqs = |g: usize| self.groups[g].seqs.len();
        if (0..self.groups.len()).any(|g| seqs(g) != seqs(0)) {
            return Err("groups hold different numbers of sequences".into());
        }
        self.check_checkpoints()?;
        self.check_window_cache()?;
        Ok(())
    }

    /// The state groups' own invariants: every sequence (on the device or swapped
    /// out) holds exactly the group's state pages, all computed, no reservation, no
    /// hole, each page held by it alone (a fork copies, never shares), and nothing is
    /// cached in the group's prefix cache.
    fn check_state_groups(&self) -> std::result::Result<(), String> {
        for (g, kv) in self.groups.iter().enumerate() {
            let Some(pages) = self.state_pages[g] else {
                continue;
            };
            let tokens = pages * kv.block_size();
            if kv.pool.num_cached() != 0 {
                return Err(format!(
                    "state group {g}: {} pages cached in its prefix cache",
                    kv.pool.num_cached()
                ));
            }
            for (&id, s) in kv.seqs.iter() {
                if is_hidden(id) {
                    continue;
                }
                if s.table.len() != pages
                    || s.released != 0
                    || s.num_tokens != tokens
                    || s.computed != tokens
                    || s.scheduled != 0
                {
                    return Err(format!(
                        "state group {g}: {id} holds {} pages ({} released), {} tokens, \
                         {} computed, {} scheduled; {pages} state pages expected",
                        s.table.len(),
                        s.released,
                        s.num_tokens,
                        s.computed,
                        s.scheduled
                    ));
                }
                if let Some(&p) = s
                    .table
                    .iter()
                    .find(|&&p| kv.pool.refcount(p).unwrap_or(0) != 1)
                {
                    return Err(format!(
                        "state group {g}: {id}'s state page {p} has {} holders",
                        kv.pool.refcount(p).unwrap_or(0)
                    ));
                }
            }
            for id in kv.swapped_sequence_ids().filter(|&s| !is_hidden(s)) {
                let held = kv.swapped_table(id).map_err(|e| e.to_string())?.len();
                if held != pages {
                    return Err(format!(
                        "state group {g}: swapped {id} holds {held} blocks; {pages} expected"
                    ));
                }
            }
        }
        Ok(())
    }

    /// One past the highest page any group holds (used or cached): equal to the held
    /// pages (`used_pages + cached_pages`) in a compact arena, which [`Self::plan_defragment`] makes. O(groups x pages), a
    /// monitoring call.
    pub fn high_water(&self) -> usize {
        self.held_pages().rposition(|h| h).map_or(0, |p| p + 1)
    }

    /// Plans a compaction of the whole arena: every page held (by any group) at or
    /// above the number of held pages moves into the lowest free page below it, the
    /// fewest moves possible; a destination owned by another group changes owner at
    /// commit. Execute [`PendingGroupDefrag::plan`] on the storage (when all groups
    /// share one storage, the plan's page ids are that storage's blocks; otherwise
    /// [`PendingGroupDefrag::group_plan`] per group), then commit. Dropping the
    /// pending value changes nothing. The pages of a sequence holding an uncommitted
    /// reservation (in any group) stay where they are: the step is writing into them,
    /// and the plan compacts around them.
    pub fn plan_defragment(&mut self) -> PendingGroupDefrag<'_> {
        let (plan, per_group) = self.defrag_moves(usize::MAX);
        PendingGroupDefrag {
            groups: self,
            plan,
            per_group,
        }
    }

    /// The arena's occupancy in pages: `(resident, high_water)`, the pages any group
    /// holds (live, cached, kept) and one past the highest of them.
    pub(crate) fn page_occupancy(&self) -> (usize, usize) {
        let held: Vec<bool> = self.held_pages().collect();
        let resident = held.iter().filter(|&&h| h).count();
        let high_water = held.iter().rposition(|&h| h).map_or(0, |p| p + 1);
        (resident, high_water)
    }

    /// A compaction's moves over page ids (at most `max_moves`: the lowest held pages
    /// above the resident count, into the lowest free pages below it) and each group's
    /// share of them. Nothing moves while a swap transfer is in flight, nor a page a
    /// step is writing.
    pub(crate) fn defrag_moves(&self, max_moves: usize) -> (MovePlan, Vec<MovePlan>) {
        let mut held: Vec<bool> = self.held_pages().collect();
        if self.groups.iter().any(|kv| kv.tiers.num_in_flight() > 0) {
            // Pages must not move while a swap transfer reads or writes them: plan
            // nothing (every page counts as held in place).
            held.iter_mut().for_each(|h| *h = true);
        }
        // Every group's tables name pages by id, so their flags share one index.
        let mut pinned = vec![false; self.num_pages];
        for flags in self.groups.iter().filter_map(|kv| kv.in_flight_blocks()) {
            for (p, f) in pinned.iter_mut().zip(flags) {
                *p |= f;
            }
        }
        let resident = held.iter().filter(|&&h| h).count();
        let sources = (resident..self.num_pages).filter(|&p| held[p] && !pinned[p]);
        let dests = (0..resident).filter(|&p| !held[p]);
        let mut plan = MovePlan::new();
        let mut per_group = vec![MovePlan::new(); self.groups.len()];
        for (src, dst) in sources.zip(dests).take(max_moves) {
            let (src, dst) = (BlockId(src as u32), BlockId(dst as u32));
            plan.push(src, dst);
            per_group[self.owner(src)].push(src, dst);
        }
        (plan, per_group)
    }

    /// The sequence of any group mid-step (holding an uncommitted reservation), the
    /// lowest id; `None` when no group is mid-step.
    pub fn mid_step_sequence(&self) -> Option<SeqId> {
        self.groups
            .iter()
            .filter_map(|kv| kv.mid_step_sequence())
            .min()
    }

    /// Plans shrinking the arena to `num_pages` (see [`KvCache::plan_shrink`]): every
    /// page held by any group (live, cached in a prefix cache, a kept window page, a
    /// checkpoint) at or above `num_pages` moves into the lowest free page below it,
    /// whoever owns that page; the fewest moves, no full compaction. Returns the moves
    /// over page ids.
    ///
    /// # Errors
    /// [`Error::ShrinkBelowResident`] when the held pages need more than `num_pages`
    /// (`live`: the pages the sequences hold; `cached`: the rest, evictable or not);
    /// [`Error::InvalidConfig`] when `num_pages` is above the arena, is 0, is not above
    /// the watermark, or is below a state group's pages per sequence;
    /// [`Error::Unsupported`] while swaps are in flight; [`Error::SequenceState`] when
    /// a sequence holding an uncommitted reservation holds a page at or above
    /// `num_pages`. Nothing changed.
    pub fn plan_shrink(&self, num_pages: usize) -> Result<MovePlan> {
        if let Some(n) = self
            .groups
            .iter()
            .map(|kv| kv.tiers.num_in_flight())
            .find(|&n| n > 0)
        {
            return Err(Error::Unsupported(format!(
                "shrink with {n} swap transfers in flight; complete or abort them first"
            )));
        }
        let old = self.num_pages;
        if num_pages > old {
            return Err(Error::config(
                "num_pages",
                format!("shrink to {num_pages} is above the arena's {old} pages; grow instead"),
            ));
        }
        let held: Vec<bool> = self.held_pages().collect();
        let resident = held.iter().filter(|&&h| h).count();
        if num_pages < resident {
            let live = self.stats().used_pages;
            return Err(Error::ShrinkBelowResident {
                requested: num_pages,
                live,
                cached: resident - live,
            });
        }
        self.check_new_size(num_pages)?;
        for kv in &self.groups {
            kv.check_tail_not_in_flight(num_pages)?;
        }
        let sources = (num_pages..old).filter(|&p| held[p]);
        let dests = (0..num_pages).filter(|&p| !held[p]);
        let mut plan = MovePlan::new();
        for (src, dst) in sources.zip(dests) {
            plan.push(BlockId(src as u32), BlockId(dst as u32));
        }
        Ok(plan)
    }

    /// The pages kept free at admission ([`Self::with_watermark`]).
    pub fn watermark_pages(&self) -> usize {
        self.watermark_pages
    }

    /// Refuses an arena of `num_pages` that cannot hold the watermark or one state.
    pub fn check_new_size(&self, num_pages: usize) -> Result<()> {
        if num_pages == 0 || num_pages <= self.watermark_pages {
            return Err(Error::config(
                "num_pages",
                format!(
                    "{num_pages} pages; the arena needs more than the watermark of {}",
                    self.watermark_pages
                ),
            ));
        }
        if let Some((g, p)) = self
            .state_pages
            .iter()
            .enumerate()
            .find_map(|(g, p)| p.filter(|&p| p > num_pages).map(|p| (g, p)))
        {
            return Err(Error::config(
                "num_pages",
                format!("{num_pages} pages; state group {g} needs {p} per sequence"),
            ));
        }
        Ok(())
    }

    /// Sets the arena to `num_pages` after `plan`'s moves (from [`Self::plan_shrink`],
    /// empty for a grow) were executed: the moves commit as a compaction's do, the
    /// pages at or above a smaller size leave every group's pool (the lenders give
    /// theirs back first), and the pages a larger size adds belong to group 0 (the
    /// other groups' lenders hold them), as at construction.
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when the groups' state contradicts the plan (it
    /// cannot: the plan was made under the same borrow).
    pub(super) fn commit_resize(&mut self, num_pages: usize, plan: &MovePlan) -> Result<()> {
        let mut per_group = vec![MovePlan::new(); self.groups.len()];
        for m in plan.moves() {
            per_group[self.owner(m.src)].push(m.src, m.dst);
        }
        self.commit_group_moves(&per_group)?;
        let old = self.num_pages;
        // Every page at or above a smaller size is free in its owner now; the other
        // groups' lenders give it back, so that it is free in every group.
        for p in num_pages..old {
            for g in 0..self.groups.len() {
                let pos = self.lent_pos[g][p];
                if pos == NOT_LENT {
                    continue;
                }
                if let Some(moved) = self.groups[g].reclaim_page(pos as usize)? {
                    self.lent_pos[g][moved.index()] = pos;
                }
                self.lent_pos[g][p] = NOT_LENT;
                self.lent[g] -= 1;
            }
        }
        for kv in &mut self.groups {
            kv.resize_arena(num_pages)?;
        }
        for pos in &mut self.lent_pos {
            pos.resize(num_pages, NOT_LENT);
        }
        for g in 1..self.groups.len() {
            for p in old..num_pages {
                let at = self.groups[g].lend_this_page(BlockId(p as u32))?;
                self.lent_pos[g][p] = at as u32;
                self.lent[g] += 1;
            }
        }
        self.num_pages = num_pages;
        // Every group accepts the longest sequence the new arena holds, as at
        // construction.
        let max_len = self
            .groups
            .iter()
            .zip(&self.state_pages)
            .filter(|(kv, s)| kv.window.is_none() && s.is_none())
            .map(|(kv, _)| num_pages * kv.block_size())
            .min()
            .unwrap_or(usize::MAX);
        for (kv, s) in self.groups.iter_mut().zip(&self.state_pages) {
            if s.is_none() {
                kv.config.max_seq_len_tokens = max_len;
            }
        }
        Ok(())
    }

    /// Commits executed moves, `per_group[g]` holding those of group `g`'s pages: each
    /// destination changes owner to the source's group, then every group remaps its
    /// tables.
    pub(crate) fn commit_group_moves(&mut self, per_group: &[MovePlan]) -> Result<()> {
        for (g, plan) in per_group.iter().enumerate() {
            for m in plan.moves() {
                self.move_page_to(m.dst, g)?;
            }
        }
        for (kv, plan) in self.groups.iter_mut().zip(per_group) {
            if !plan.is_empty() {
                kv.commit_moves(plan)?;
                kv.pool.reorder_free_low_first();
            }
        }
        Ok(())
    }

    // ---- internals ----------------------------------------------------------------

    /// Runs one swap call in every group; undoes the groups done when one fails
    /// (unreachable after the caller's checks).
    fn each_group_swap(
        &mut self,
        seq: SeqId,
        call: fn(&mut KvCache, SeqId) -> Result<super::SwapJob>,
    ) -> Result<GroupSwapJob> {
        self.each_group_job(seq, |kv| call(kv, seq))
    }

    /// Runs `call` in every group, collecting the job `seq` of their tickets and plans;
    /// aborts the groups' tickets taken so far when one fails.
    pub(super) fn each_group_job(
        &mut self,
        seq: SeqId,
        mut call: impl FnMut(&mut KvCache) -> Result<super::SwapJob>,
    ) -> Result<GroupSwapJob> {
        let mut job = GroupSwapJob {
            seq,
            tickets: Vec::with_capacity(self.groups.len()),
            plans: Vec::with_capacity(self.groups.len()),
        };
        for g in 0..self.groups.len() {
            match call(&mut self.groups[g]) {
                Ok(j) => {
                    job.tickets.push(j.ticket);
                    job.plans.push(j.plan);
                }
                Err(e) => {
                    for (kv, &t) in self.groups.iter_mut().zip(&job.tickets) {
                        let _ = kv.abort_swap(t);
                    }
                    return Err(e);
                }
            }
        }
        Ok(job)
    }

    fn finish_swap(
        &mut self,
        job: &GroupSwapJob,
        call: fn(&mut KvCache, SwapTicket) -> Result<()>,
    ) -> Result<()> {
        if job.tickets.len() != self.groups.len() {
            return Err(Error::ShapeMismatch {
                what: "tickets of the group swap job",
                expected: self.groups.len(),
                got: job.tickets.len(),
            });
        }
        // Group 0 refuses an unknown ticket before anything changes.
        call(&mut self.groups[0], job.tickets[0])?;
        let mut result = Ok(());
        for (kv, &t) in self.groups.iter_mut().zip(&job.tickets).skip(1) {
            result = result.and(call(kv, t));
        }
        result
    }

    /// The group that owns `page`.
    fn owner(&self, page: BlockId) -> usize {
        self.lent_pos
            .iter()
            .position(|pos| pos[page.index()] == NOT_LENT)
            .unwrap_or(0)
    }

    /// For every page, whether its owner holds it (live or cached).
    fn held_pages(&self) -> impl DoubleEndedIterator<Item = bool> + ExactSizeIterator + '_ {
        (0..self.num_pages).map(move |p| {
            let page = BlockId(p as u32);
            self.groups[self.owner(page)]
                .pool
                .state(page)
                .is_ok_and(|s| s != BlockState::Free)
        })
    }

    /// Moves the free page `page` from its owner to group `to`.
    fn move_page_to(&mut self, page: BlockId, to: usize) -> Result<()> {
        let from = self.owner(page);
        if from == to {
            return Ok(());
        }
        let at = self.groups[from].lend_this_page(page)?;
        self.hand_over(from, page, at, to)
    }

    fn check_id(&self, seq: SeqId) -> Result<()> {
        if is_hidden(seq) {
            return Err(Error::UnknownSequence(seq));
        }
        Ok(())
    }

    /// Looks `tokens` up in every group (`hits[g]`) and cuts every hit to the tokens
    /// all groups serve, in whole blocks of each; returns those tokens and, when a
    /// window group is among the groups and the hit is not empty, where its window
    /// blocks come from (see `groups/window_cache.rs`).
    fn common_hit(
        &self,
        tokens: &[u32],
        opts: &AdmitOptions<'_>,
        state_hits: bool,
        host_hits: bool,
        hits: &mut Vec<PrefixHit>,
    ) -> Result<(usize, Option<WindowHit>, Option<usize>)> {
        hits.resize_with(self.groups.len(), PrefixHit::default);
        let mut cached = usize::MAX;
        for ((kv, hit), state) in self
            .groups
            .iter()
            .zip(hits.iter_mut())
            .zip(&self.state_pages)
        {
            let found = kv.lookup_prefix(tokens, opts, hit)?;
            // A state group's own cache holds nothing (its checkpoints are below).
            if kv.window.is_none() && state.is_none() {
                cached = cached.min(found);
            }
        }
        // The host levels (`groups/host_level.rs`) continue the device part every
        // group holds: a group whose device part goes further looks its host part up
        // again from there (the sequence is computed as far in every group).
        let bs0 = self.groups[0].block_size();
        let host_hits = host_hits
            && cached != usize::MAX
            && self.host_level_served()
            && self.groups.iter().all(|kv| kv.block_size() == bs0);
        let device = cached;
        if host_hits {
            for (kv, hit) in self.groups.iter().zip(hits.iter_mut()) {
                if hit.cached_tokens() > device {
                    kv.rebase_host_hit(tokens, hit, device / bs0);
                }
            }
            cached = device + hits.iter().map(tier_tokens).min().unwrap_or(0);
            cached = self.cut_to_staging_room(hits, device, cached);
        }
        let mut checkpoint = None;
        if self.has_state_group() {
            // A state group resumes only from a checkpoint at exactly the hit's end
            // (`groups/checkpoints.rs`): the deepest one the attention groups' hit
            // reaches, or no hit. `state_hits` false (an admission that cannot hand
            // out the checkpoint's copies): no hit.
            (cached, checkpoint) = match state_hits {
                true => self.checkpoint_hit(hits[0].blocks(), cached),
                false => (0, None),
            };
        }
        if cached == usize::MAX {
            // Window groups only: no group registers anything.
            cached = 0;
        }
        // Rounding down to one group's blocks can cut a whole block of another: repeat
        // until every group agrees (the count only falls, so this ends).
        loop {
            let agreed = self
                .groups
                .iter()
                .zip(&self.state_pages)
                .filter(|(_, state)| state.is_none())
                .map(|(kv, _)| cached / kv.block_size() * kv.block_size())
                .min()
                .unwrap_or(0);
            if agreed == cached {
                break;
            }
            cached = agreed;
        }
        let mut source = None;
        if cached > 0 && self.groups.iter().any(|kv| kv.window.is_some()) {
            (cached, source) = self.window_hit(hits, cached);
        }
        for (kv, hit) in self.groups.iter().zip(hits.iter_mut()) {
            let bs = kv.block_size();
            if host_hits {
                hit.truncate_with_host(device.min(cached) / bs, cached / bs);
            } else {
                hit.truncate_blocks(cached / bs);
            }
        }
        Ok((cached, source, checkpoint))
    }

    /// Fails with [`Error::OutOfBlocks`] when the arena's free (and evictable) pages
    /// are fewer than all groups' `needs`; returns both counts.
    fn check_needs(&self) -> Result<(usize, usize)> {
        let total: usize = self.needs.iter().sum();
        let free = self.num_free_pages();
        if total > free {
            return Err(Error::OutOfBlocks {
                needed: total,
                free,
            });
        }
        Ok((total, free))
    }

    /// Moves free pages so that every group `g` has `needs[g]` available, or fails
    /// with nothing moved when the arena has too few.
    fn give_pages(&mut self) -> Result<()> {
        let (total, free) = self.check_needs()?;
        for to in 0..self.groups.len() {
            while self.groups[to].num_available_blocks() < self.needs[to] {
                let from = (0..self.groups.len())
                    .find(|&h| h != to && self.groups[h].num_available_blocks() > self.needs[h]);
                match from {
                    Some(from) => self.move_page(from, to)?,
                    // Then the window groups' cached pages, then the state groups'
                    // checkpoints, the last pages to take.
                    None if self.evict_window_page()? => {}
                    None if self.evict_checkpoint()? => {}
                    None => {
                        return Err(Error::OutOfBlocks {
                            needed: total,
                            free,
                        })
                    }
                }
            }
        }
        Ok(())
    }

    /// Sets group `g`'s need for [`Self::give_needed_pages`].
    pub(super) fn set_need(&mut self, g: usize, need: usize) {
        self.needs[g] = need;
    }

    /// [`Self::give_pages`] for the needs set by [`Self::set_need`]: fails with
    /// nothing moved when the arena has too few.
    pub(super) fn give_needed_pages(&mut self) -> Result<()> {
        self.give_pages()
    }

    /// Records the pages in use after a step.
    pub(super) fn note_step_usage(&mut self) {
        self.note_usage();
    }

    /// Moves one free page of group `from` to group `to`.
    fn move_page(&mut self, from: usize, to: usize) -> Result<()> {
        let (page, at) = self.groups[from].lend_page()?;
        self.hand_over(from, page, at, to)
    }

    /// Records `page` lent by `from` at index `at` of its lender, and takes it back in
    /// group `to`, which owns it from now on.
    fn hand_over(&mut self, from: usize, page: BlockId, at: usize, to: usize) -> Result<()> {
        self.lent_pos[from][page.index()] = at as u32;
        let pos = self.lent_pos[to][page.index()];
        if pos == NOT_LENT {
            return Err(Error::CorruptBlockTable(format!(
                "page {page} is owned by groups {from} and {to}"
            )));
        }
        if let Some(moved) = self.groups[to].reclaim_page(pos as usize)? {
            self.lent_pos[to][moved.index()] = pos;
        }
        self.lent_pos[to][page.index()] = NOT_LENT;
        self.lent[from] += 1;
        self.lent[to] -= 1;
        self.page_moves += 1;
        Ok(())
    }

    /// Pages group `g`'s sequences hold.
    fn own_used(&self, g: usize) -> usize {
        self.groups[g].pool.num_live()
            - self.lent[g]
            - self.checkpoint_pages_of(g)
            - self.window_cache_pages_of(g)
    }

    fn note_usage(&mut self) {
        let used: usize = (0..self.groups.len()).map(|g| self.own_used(g)).sum();
        self.peak_used_pages = self.peak_used_pages.max(used);
    }
}

impl KvCache {
    /// Takes one free page of this group and lends it: the lender holds it (one
    /// reference, full fill). Returns the page and its index in the lender's table.
    fn lend_page(&mut self) -> Result<(BlockId, usize)> {
        let b = self.alloc_block()?;
        Ok((b, self.push_lent(b)?))
    }

    /// Lends the free page `page` (see [`Self::lend_page`]).
    fn lend_this_page(&mut self, page: BlockId) -> Result<usize> {
        self.pool.take(page)?;
        if let Some(f) = self.pool.fill_mut(page) {
            *f = 0;
        }
        self.push_lent(page)
    }

    /// Gives the just-taken page `b` to the lender; returns its index there.
    fn push_lent(&mut self, b: BlockId) -> Result<usize> {
        let bs = self.block_size();
        self.set_fill(b, bs);
        let s = self
            .seqs
            .get_mut(&LENDER)
            .ok_or(Error::UnknownSequence(LENDER))?;
        s.table.push(b);
        s.num_tokens += bs;
        s.computed += bs;
        Ok(s.table.len() - 1)
    }

    /// Takes back the lent page at index `pos` of the lender's table: it becomes free
    /// here. Returns the page the swap-remove moved into `pos`, if any.
    fn reclaim_page(&mut self, pos: usize) -> Result<Option<BlockId>> {
        let bs = self.block_size();
        let s = self
            .seqs
            .get_mut(&LENDER)
            .ok_or(Error::UnknownSequence(LENDER))?;
        if pos >= s.table.len() {
            return Err(Error::CorruptBlockTable(format!(
                "lent page index {pos} of {}",
                s.table.len()
            )));
        }
        let b = s.table.swap_remove(pos);
        let moved = s.table.get(pos).copied();
        s.num_tokens -= bs;
        s.computed -= bs;
        self.tables_changed();
        self.release_block(b)?;
        Ok(moved)
    }

    /// Pages a window group gives back now if `seq`'s blocks before the window of its
    /// next query (at `computed`) are released: those only `seq` holds.
    fn dead_window_pages(&self, seq: SeqId) -> Result<usize> {
        if self.window.is_none() {
            return Ok(0);
        }
        let s = self.seq(seq)?;
        if s.scheduled > 0 {
            return Ok(0);
        }
        let keep_from = self.first_block_in_window(s.computed).min(s.table.len());
        Ok(s.table[s.released.min(keep_from)..keep_from]
            .iter()
            .filter(|&&b| self.pool.refcount(b).unwrap_or(0) == 1)
            .count())
    }

    /// Admits `seq` with `num_tokens` computed tokens whose first `holes` blocks are
    /// holes (checked by the caller: at most those before the window), allocating the
    /// rest and writing their tokens' slots into `slots`.
    pub(super) fn admit_holed(
        &mut self,
        seq: SeqId,
        num_tokens: usize,
        holes: usize,
        slots: &mut Vec<Slot>,
    ) -> Result<()> {
        slots.clear();
        if holes == 0 {
            return self.admit(seq, num_tokens, slots);
        }
        if self.contains(seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let needed = self.layout.blocks_for_tokens(num_tokens);
        self.ensure_available(needed - holes)?;
        self.seqs.reserve_room(1)?;
        let mut table = Vec::with_capacity(needed + 1);
        table.resize(holes, BlockId::RELEASED);
        while table.len() < needed {
            table.push(self.alloc_block()?);
        }
        let mut s = Sequence {
            table,
            released: holes,
            num_tokens: holes * self.block_size(),
            admission: self.tiers.next_admission(),
            ..Sequence::default()
        };
        self.fill_tokens(&mut s, num_tokens, slots);
        s.computed = num_tokens;
        self.seqs.insert(seq, s)?;
        self.note_usage();
        Ok(())
    }

    /// Releases `seq`'s blocks before the window of its next query (no query reads
    /// them: the sequence holds no reservation).
    fn release_dead_window(&mut self, seq: SeqId) -> Result<()> {
        if self.window.is_none() {
            return Ok(());
        }
        let computed = self.seq(seq)?.computed;
        let h = self.handle(seq)?;
        self.release_out_of_window(h, computed)
    }
}

/// A swap of one sequence in every group, planned by [`KvCache::swap_out_grouped`] or
/// [`KvCache::swap_in_grouped`]: execute `plans` (any order), then
/// [`KvCache::complete_swap_grouped`] or [`KvCache::abort_swap_grouped`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSwapJob {
    /// The sequence.
    pub seq: SeqId,
    /// Each group's ticket.
    pub tickets: Vec<SwapTicket>,
    /// Each group's plan: device pages and blocks of the shared host tier.
    pub plans: Vec<SwapPlan>,
}

impl GroupSwapJob {
    /// The job of a one-group cache's swap.
    pub(crate) fn one(seq: SeqId, job: super::SwapJob) -> Self {
        GroupSwapJob {
            seq,
            tickets: vec![job.ticket],
            plans: vec![job.plan],
        }
    }

    /// The ticket of a one-group cache's job.
    pub(crate) fn only_ticket(job: &GroupSwapJob) -> Result<SwapTicket> {
        match job.tickets[..] {
            [t] => Ok(t),
            _ => Err(Error::ShapeMismatch {
                what: "tickets of the group swap job",
                expected: 1,
                got: job.tickets.len(),
            }),
        }
    }
}

/// A compaction of a hybrid [`KvCache`] arena planned but not yet committed. It holds
/// the groups' `&mut` borrow; dropping it aborts with nothing changed.
#[derive(Debug)]
#[must_use = "dropping a pending compaction aborts it"]
pub struct PendingGroupDefrag<'a> {
    groups: &'a mut Groups,
    plan: MovePlan,
    per_group: Vec<MovePlan>,
}

impl PendingGroupDefrag<'_> {
    /// Every move, over page ids (one storage shared by all groups executes this).
    pub fn plan(&self) -> &MovePlan {
        &self.plan
    }

    /// The moves of group `g`'s pages (for a storage per group).
    ///
    /// # Panics
    /// When `g >= num_groups()`.
    pub fn group_plan(&self, g: usize) -> &MovePlan {
        &self.per_group[g]
    }

    /// Records that the plan was executed: destinations change owner where needed,
    /// every group's tables point at them, the sources are free. Returns the plan.
    ///
    /// # Errors
    /// [`Error::CorruptBlockTable`] when the groups' state contradicts the plan (it
    /// cannot: the plan was made under the same borrow).
    pub fn commit(self) -> Result<MovePlan> {
        self.groups.commit_group_moves(&self.per_group)?;
        Ok(self.plan)
    }
}

#[cfg(test)]
mod tests {
    use super::GroupSpec;
    use crate::ids::{BlockId, SeqId};
    use crate::layout::shape::{DType, ModelShape};
    use crate::layout::KvLayout;
    use crate::manager::{KvCache, StepBuffers, StepEntry};

    fn cache() -> KvCache {
        let shape = ModelShape {
            num_layers: 1,
            num_q_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
            kv_dtype: DType::F32,
        };
        let l = KvLayout::new(shape, 4).unwrap();
        let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::window(l, 8)], 32).unwrap();
        for id in 1..=2 {
            kv.admit_grouped(SeqId(id), 7, &mut super::GroupStep::default())
                .unwrap();
        }
        kv
    }

    /// The step path where a group's slots are not group 0's (no public call leaves
    /// them so: forced here by moving a sequence to a new generation of its slot in
    /// the window group): it serves the same slots, tables and window releases as a
    /// twin whose slots agree, through the handles it looks up by id.
    #[test]
    fn the_step_path_looks_handles_up_where_a_groups_slots_differ() {
        let (mut moved, mut twin) = (cache(), cache());
        let groups = moved.hybrid.as_mut().unwrap();
        let s = groups.groups[1].seqs.remove(&SeqId(1)).unwrap();
        groups.groups[1].seqs.insert(SeqId(1), s).unwrap();
        let h0 = moved.handle(SeqId(1)).unwrap();
        assert_ne!(moved.group(1).handle(SeqId(1)).unwrap(), h0);
        moved.check_invariants().unwrap();
        let bufs = || [StepBuffers::new(4, 16, 8), StepBuffers::new(4, 16, 8)];
        let (mut a, mut b) = (bufs(), bufs());
        // Across the window's first release (at 9 the window starts in block 0's end).
        for _ in 0..6 {
            for (kv, out) in [(&mut moved, &mut a), (&mut twin, &mut b)] {
                let e: Vec<_> = [1, 2]
                    .map(|id| StepEntry {
                        seq: kv.handle(SeqId(id)).unwrap(),
                        new_tokens: 1,
                        lookahead: 0,
                    })
                    .to_vec();
                kv.reserve_step_grouped(&e, out).unwrap();
                kv.commit_step(&[(e[0].seq, 1), (e[1].seq, 1)]).unwrap();
                kv.check_invariants().unwrap();
            }
            for g in 0..2 {
                assert_eq!(a[g].slot_mapping(), b[g].slot_mapping(), "group {g}");
                assert_eq!(a[g].tables(), b[g].tables(), "group {g}");
            }
        }
        for id in 1..=2 {
            for g in 0..2 {
                assert_eq!(
                    moved.group(g).block_table(SeqId(id)).unwrap(),
                    twin.group(g).block_table(SeqId(id)).unwrap()
                );
            }
        }
        assert!(moved.group(1).block_table(SeqId(1)).unwrap()[0] == BlockId::RELEASED);
    }
}
