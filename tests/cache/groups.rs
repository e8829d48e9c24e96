//! KV-cache groups over one arena of pages (`KvCache`).
//!
//! * configuration errors (no group, no page, pages of different bytes); a latent
//!   (MLA) group beside a full group when their pages have the same bytes;
//! * memory moves between groups: a group takes pages another group freed;
//! * atomicity across groups: a call that fails for want of pages in a later group,
//!   or for a sequence's state, leaves every group as it was (full `Debug` snapshots);
//! * the steady-state `OutOfBlocks` of a window manager at its first decode step, and
//!   the groups' release-before-allocate that avoids it;
//! * a model-based property test with byte checks: every group writes its own value
//!   for each token into **one** `HostStorage` shared by all groups; after every
//!   action every computed token each group still needs (all of them for the full
//!   group, the window of the next query for the window group) holds its own bytes,
//!   forks copy-on-write per group, frees, compaction of the whole arena (pages change
//!   owner), admissions with token ids that share prefix hits (the hit's bytes are
//!   read back in every group, window groups included), swap-out (completed or aborted) and swap-in
//!   with the plans run on the shared storage (window sequences with holes included),
//!   preemption by swap or else by recompute, and every failed call changes nothing;
//! * prefix hits equal across groups of different block sizes; a window group's hit
//!   served from a live sequence's window blocks (holes before them), and from the
//!   blocks it gave back once no live sequence holds them; cached pages moving to the
//!   group that needs them;
//! * swap: host blocks of the shared tier move between groups, failures
//!   (`TierFull`, `OutOfBlocks`, state, unknown ticket) change nothing.

use pagedkv::export::groups::{
    export_group_sequence, exported_group_len, import_group_sequence, GroupExportView,
};
use pagedkv::layout::Slot;
use pagedkv::manager::preempt::{CostModel, PreemptAction, PreemptMode};
use pagedkv::manager::DefragOptions;
use pagedkv::{
    AdmitOptions, BlockId, CopyPlan, DType, Error, GroupSpec, GroupStep, HostStorage, KvCache,
    KvKind, KvLayout, ModelShape, PreemptPolicy, SeqId, StepBuffers, StepEntry, Storage,
};
use proptest::prelude::*;

use crate::support::faulty_storage;
use faulty_storage::FaultyStorage;

const HEAD_DIM: usize = 2;

fn layout(bs: usize, layers: usize) -> KvLayout {
    let shape = ModelShape {
        num_layers: layers,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: HEAD_DIM,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, bs).unwrap()
}

use crate::support::snapshot::groups_snapshot as snapshot;

#[test]
fn config_errors() {
    let l = layout(4, 1);
    assert!(matches!(
        KvCache::hybrid(&[], 8),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        KvCache::hybrid(&[GroupSpec::full(l)], 0),
        Err(Error::InvalidConfig { .. })
    ));
    // Two layers per page against one: different page bytes.
    let e = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::window(layout(4, 2), 8)], 8);
    assert!(matches!(e, Err(Error::InvalidConfig { .. })), "{e:?}");
    // Equal bytes from different block sizes and layer counts are accepted.
    KvCache::hybrid(
        &[
            GroupSpec::full(layout(8, 1)),
            GroupSpec::window(layout(4, 2), 8),
        ],
        8,
    )
    .unwrap()
    .check_invariants()
    .unwrap();
    let kv = KvCache::hybrid(&[GroupSpec::full(l)], 8).unwrap();
    assert!(kv.with_watermark_blocks(8).is_err());
}

/// A latent (MLA) group beside a full group: 4 tokens x (3 + 1) latent dims x f32 is
/// the same 64 bytes as 4 tokens x K/V x 2 dims x f32, so they share the pages.
#[test]
fn latent_group_shares_pages_with_a_full_group() {
    let kind = KvKind::Latent {
        kv_lora_rank: 3,
        rope_dim: 1,
    };
    let latent = KvLayout::with_kind(ModelShape::latent(1, 2, 3, 1, DType::F32), BS, kind).unwrap();
    let full = layout(BS, 1);
    assert_eq!(latent.block_bytes(), full.block_bytes());
    let mut kv = KvCache::hybrid(&[GroupSpec::full(full), GroupSpec::full(latent)], 10).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 10, &mut step).unwrap(); // 3 pages in each group
    kv.append_grouped(SeqId(1), 6, &mut step).unwrap(); // 4 in each
    assert_eq!(kv.group_stats().used_per_group, vec![4, 4]);
    assert!(kv.group(1).layout().is_latent());
    assert!(matches!(
        kv.append_grouped(SeqId(1), 5, &mut step),
        Err(Error::OutOfBlocks { needed: 4, free: 2 })
    ));
    kv.check_invariants().unwrap();
}

#[test]
fn pages_move_to_the_group_that_needs_them() {
    let l = layout(4, 1);
    let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::window(l, 8)], 40).unwrap();
    let mut step = GroupStep::default();
    // 20 tokens: 5 pages in each group, 10 of the 40.
    kv.admit_grouped(SeqId(1), 20, &mut step).unwrap();
    assert_eq!(kv.group_stats().owned_per_group.iter().sum::<usize>(), 40);
    assert_eq!(kv.group_stats().used_per_group, vec![5, 5]);
    // Decoding: the window group gives pages back, the full group keeps taking them;
    // together they use every page of the arena at the end.
    let mut n = 0;
    while kv.append_grouped(SeqId(1), 1, &mut step).is_ok() {
        n += 1;
        kv.check_invariants().unwrap();
    }
    let st = kv.group_stats();
    // The full group holds 37 pages (148 tokens), the window group the 2 its next
    // query reads; the next token needs a page in each, and 1 is free.
    assert_eq!(st.used_per_group, vec![37, 2], "{st:?}");
    assert_eq!(st.free_pages, 1);
    assert_eq!(20 + n, 148);
    assert!(st.page_moves > 0);
    // A second sequence now fails whole, and changes nothing.
    let before = snapshot(&kv);
    assert!(matches!(
        kv.admit_grouped(SeqId(2), 1, &mut step),
        Err(Error::OutOfBlocks { needed: 2, free: 1 })
    ));
    assert_eq!(snapshot(&kv), before);
    kv.free(SeqId(1)).unwrap();
    assert_eq!(kv.group_stats().used_pages, 0);
    // Now the window group alone can take almost all of it.
    kv.admit_grouped(SeqId(3), 4 * 39, &mut step).unwrap_err();
    kv.admit_grouped(SeqId(3), 4 * 20, &mut step).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn failure_in_a_later_group_leaves_the_earlier_ones_unchanged() {
    let l = layout(4, 1);
    let specs = [
        GroupSpec::full(l),
        GroupSpec::window(l, 4),
        GroupSpec::full(l),
    ];
    let mut kv = KvCache::hybrid(&specs, 12).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 12, &mut step).unwrap(); // 3 pages in each group: 9 of 12
    kv.check_invariants().unwrap();
    let before = snapshot(&kv);
    // 8 tokens more: group 0 alone would fit (2 pages), all three groups do not.
    let e = kv.admit_grouped(SeqId(2), 8, &mut step);
    assert!(
        matches!(e, Err(Error::OutOfBlocks { needed: 6, free: 3 })),
        "{e:?}"
    );
    assert_eq!(snapshot(&kv), before);
    // The same for an append that needs pages in every group.
    let e = kv.reserve_grouped(SeqId(1), 8, 0, &mut step);
    assert!(matches!(e, Err(Error::OutOfBlocks { .. })), "{e:?}");
    assert_eq!(snapshot(&kv), before);
    // State errors: unknown, too long, duplicate, pending reservation.
    assert!(matches!(
        kv.append_grouped(SeqId(9), 1, &mut step),
        Err(Error::UnknownSequence(_))
    ));
    assert!(matches!(
        kv.admit_grouped(SeqId(1), 1, &mut step),
        Err(Error::DuplicateSequence(_))
    ));
    assert!(matches!(
        kv.admit_grouped(SeqId(5), 1000, &mut step),
        Err(Error::TooLong { .. })
    ));
    assert!(matches!(
        kv.admit_grouped(SeqId(u64::MAX), 1, &mut step),
        Err(Error::DuplicateSequence(_))
    ));
    assert_eq!(snapshot(&kv), before);
    kv.reserve_grouped(SeqId(1), 1, 0, &mut step).unwrap();
    let before = snapshot(&kv);
    assert!(matches!(
        kv.append_grouped(SeqId(1), 1, &mut step),
        Err(Error::SequenceState { .. })
    ));
    assert!(matches!(
        kv.commit(SeqId(1), 2),
        Err(Error::CommitPastReservation { .. })
    ));
    assert!(matches!(
        kv.fork(SeqId(1), SeqId(4)),
        Err(Error::SequenceState { .. })
    ));
    assert_eq!(snapshot(&kv), before);
    kv.commit(SeqId(1), 1).unwrap();
    kv.check_invariants().unwrap();
}

/// The steady-state `OutOfBlocks`: a window manager's one-call append allocates the
/// step's block before it gives back the blocks that fell out of the window, so the
/// first decode step after a prompt longer than the window that fills its last block
/// needs one block more than the manager holds afterwards. A window arena sized to what sequences hold
/// (prompt, then window) fails there although half its blocks are dead. The groups
/// give the dead blocks back first.
#[test]
fn first_decode_step_after_a_long_prompt_needs_no_extra_page() {
    let l = layout(16, 1);
    // Prompt 128 tokens = 8 blocks, window 64: the query at 128 reads 65..=128.
    let mut single = KvCache::builder(l)
        .num_blocks(8)
        .watermark_blocks(0)
        .sliding_window(64)
        .build()
        .unwrap();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    single.admit(SeqId(1), 128, &mut slots).unwrap();
    let e = single.append(SeqId(1), 1, &mut slots, &mut copies);
    assert!(
        matches!(e, Err(Error::OutOfBlocks { needed: 1, free: 0 })),
        "{e:?}"
    );

    let mut kv = KvCache::hybrid(&[GroupSpec::window(l, 64)], 8).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 128, &mut step).unwrap();
    assert_eq!(kv.blocks_needed(SeqId(1), 1, 0).unwrap(), 0);
    for _ in 0..500 {
        kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
    }
    kv.check_invariants().unwrap();
    assert!(kv.group_stats().used_pages <= 5);
}

// ---- model-based property test with byte checks -------------------------------------

const BS: usize = 4;
const WINDOW: usize = 6;
const PAGES: usize = 40;
const HOST_BLOCKS: usize = 24;

#[derive(Debug, Clone)]
enum Action {
    Admit(usize),
    /// Admit a prompt of `len` tokens of family `f` (every token `f`): prompts of one
    /// family share their leading blocks through the prefix caches.
    AdmitTokens(usize, usize),
    Append(usize, usize),
    /// Reserve `n` plus `lookahead`, write them, commit `accepted` of the `n`.
    Step(usize, usize, usize, usize),
    Fork(usize),
    Free(usize),
    /// Compact the whole arena (moves execute on the shared storage).
    Defrag,
    /// Swap a sequence out (plans run on the shared storage), or abort the swap.
    SwapOut(usize, bool),
    /// Swap a swapped-out sequence back in.
    SwapIn(usize),
    /// Export a sequence and import it as a new one on the same groups and storage;
    /// with `Some(at)`, flip byte `at % len` of the buffer first (refused, no change).
    ExportImport(usize, Option<usize>),
    /// Truncate a sequence to `keep` of its tokens (`keep % (len + 1)`): refused,
    /// with nothing changed, where a window group gave back the blocks of the new
    /// length's window.
    Truncate(usize, usize),
    /// Chunked prefill of a prompt of family `f` (as `AdmitTokens`): admit the
    /// prefix every group serves, then reserve, write and commit chunks of `chunk`
    /// tokens; a chunk that does not fit frees the sequence (recompute later).
    AdmitChunked(usize, usize, usize),
    /// One step of up to `k` sequences (from the `s`-th) through the step path
    /// (`reserve_step_grouped` into one `StepBuffers` per group, then `commit_step`):
    /// each computes `n` query tokens plus `la` lookahead slots and accepts `acc`.
    BatchStep(usize, usize, usize, usize, usize),
}

/// [`action`] with batch steps among the actions (a separate strategy, as
/// [`action_with_export`]).
fn action_with_batch_steps() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => action(),
        3 => (0usize..8, 1usize..5, 1usize..5, 0usize..3, 0usize..6)
            .prop_map(|(s, k, n, la, acc)| Action::BatchStep(s, k, n, la, acc)),
    ]
}

/// [`action`] with chunked prefills among the actions (a separate strategy, as
/// [`action_with_export`]).
fn action_with_chunks() -> impl Strategy<Value = Action> {
    prop_oneof![
        5 => action(),
        2 => (0usize..3, 0usize..30, 1usize..9).prop_map(|(f, n, c)| Action::AdmitChunked(f, n, c)),
    ]
}

/// [`action`] with truncation among the actions (a separate strategy, as
/// [`action_with_export`]).
fn action_with_truncate() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => action(),
        1 => (0usize..8, 0usize..60).prop_map(|(s, k)| Action::Truncate(s, k)),
    ]
}

/// [`action`] with export/import among the actions (a separate strategy, so the
/// persisted seeds of the tests that use `action` still generate what they did).
fn action_with_export() -> impl Strategy<Value = Action> {
    prop_oneof![
        8 => action(),
        1 => (0usize..8, proptest::option::weighted(0.3, 0usize..100_000))
            .prop_map(|(s, c)| Action::ExportImport(s, c)),
    ]
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        2 => (0usize..30).prop_map(Action::Admit),
        2 => (0usize..3, 0usize..30).prop_map(|(f, n)| Action::AdmitTokens(f, n)),
        5 => (0usize..8, 1usize..4).prop_map(|(s, n)| Action::Append(s, n)),
        3 => (0usize..8, 1usize..6, 0usize..3, 0usize..6)
            .prop_map(|(s, n, la, acc)| Action::Step(s, n, la, acc)),
        1 => (0usize..8).prop_map(Action::Fork),
        1 => (0usize..8).prop_map(Action::Free),
        1 => Just(Action::Defrag),
        1 => (0usize..8, proptest::bool::weighted(0.2)).prop_map(|(s, a)| Action::SwapOut(s, a)),
        1 => (0usize..8).prop_map(Action::SwapIn),
    ]
}

/// The writer id of the prompt tokens of family `f`: their K/V depends on the tokens
/// only, so every sequence of the family writes (and may share) the same bytes.
fn family_writer(f: usize) -> u64 {
    900 + f as u64
}

/// The writer id of rejected drafts and lookahead slots (no sequence has it).
const DRAFT_WRITER: u64 = 999;

/// The value group `g` writes for sequence `id` at position `pos` (exact in f32).
fn value(g: usize, id: u64, pos: usize) -> f32 {
    (g * 1_000_000 + id as usize * 1_000 + pos) as f32
}

struct Model {
    kv: KvCache,
    store: HostStorage,
    step: GroupStep,
    /// Per live sequence: its id and, per position, the writer id whose value is
    /// there (a fork keeps its parent's up to the fork point).
    seqs: Vec<(SeqId, Vec<u64>)>,
    /// Swapped-out sequences, as `seqs`.
    swapped: Vec<(SeqId, Vec<u64>)>,
    next: u64,
    /// Prompt tokens served from the prefix caches so far.
    hits: usize,
    /// Admissions with a hit served by window groups too.
    hits_with_window: usize,
    /// Pages copied on write (copy plans run, all groups).
    cow_copies: usize,
    /// Swap-outs and swap-ins completed that moved blocks.
    swaps: usize,
    /// Chunked admissions made.
    chunked: usize,
    /// One step buffer per group, and the batch steps reserved through them.
    bufs: Vec<StepBuffers>,
    batch_steps: usize,
    /// Truncations that cut tokens, and those a window group refused.
    truncations: usize,
    refused_truncations: usize,
    /// Preempt through `preempt_for` (alternating swap and recompute policies)
    /// instead of the model's own choice of the longest sequence.
    by_policy: bool,
    /// Preemptions `preempt_for` carried out, by swap and by recompute.
    policy_swaps: usize,
    policy_recomputes: usize,
}

impl Model {
    fn write(&mut self, id: SeqId, first: usize) {
        self.write_step(id, first, usize::MAX);
    }

    /// Runs the step's copies and writes its slots from position `first`: the first
    /// `accepted` as `id`'s tokens, the rest (rejected drafts and lookahead slots) as
    /// [`DRAFT_WRITER`]'s, so that a draft's bytes never pass for the token later
    /// committed at its position.
    fn write_step(&mut self, id: SeqId, first: usize, accepted: usize) {
        for g in 0..self.kv.num_groups() {
            self.cow_copies += self.step.copies[g].copies().len();
            self.store.copy_blocks(&self.step.copies[g]).unwrap();
            let slots = &self.step.slots[g];
            let mut k = Vec::new();
            let mut v = Vec::new();
            for i in 0..slots.len() {
                let writer = if i < accepted { id.0 } else { DRAFT_WRITER };
                let x = value(g, writer, first + i);
                for _ in 0..HEAD_DIM {
                    k.extend_from_slice(&x.to_le_bytes());
                    v.extend_from_slice(&(-x).to_le_bytes());
                }
            }
            self.store.write_slots(0, slots, &k, &v).unwrap();
        }
    }

    fn check(&self) {
        self.kv.check_invariants().unwrap();
        let l = *self.kv.group(0).layout();
        let (mut k, mut v) = (vec![0u8; BS * HEAD_DIM * 4], vec![0u8; BS * HEAD_DIM * 4]);
        for (id, writers) in &self.seqs {
            let computed = self.kv.num_computed_tokens(*id).unwrap();
            assert_eq!(computed, writers.len());
            for g in 0..self.kv.num_groups() {
                let (table, c) = self.kv.group(g).readable_blocks(*id).unwrap();
                assert_eq!(c, computed);
                let from = match self.kv.group(g).sliding_window() {
                    Some(w) => (computed + 1).saturating_sub(w),
                    None => 0,
                };
                for (pos, &writer) in writers.iter().enumerate().skip(from) {
                    let b = table[pos / BS];
                    assert_ne!(b, BlockId::RELEASED, "group {g} seq {id} pos {pos}");
                    self.store.read_tokens(0, &[b], BS, &mut k, &mut v).unwrap();
                    let off = (pos % BS) * HEAD_DIM * 4;
                    let got = f32::from_le_bytes(k[off..off + 4].try_into().unwrap());
                    let want = value(g, writer, pos);
                    assert_eq!(got, want, "group {g} seq {id} pos {pos} block {b}");
                    let gv = f32::from_le_bytes(v[off..off + 4].try_into().unwrap());
                    assert_eq!(gv, -want);
                }
            }
        }
        let _ = l;
    }

    fn apply(&mut self, a: &Action) {
        let before = snapshot(&self.kv);
        let pick =
            |n: usize, seqs: &[(SeqId, Vec<u64>)]| (!seqs.is_empty()).then(|| n % seqs.len());
        let result = match *a {
            Action::Admit(n) => {
                let id = SeqId(self.next);
                self.next += 1;
                let r = self.kv.admit_grouped(id, n, &mut self.step);
                if r.is_ok() {
                    self.write(id, 0);
                    self.seqs.push((id, vec![id.0; n]));
                }
                r
            }
            Action::AdmitTokens(f, n) => {
                let id = SeqId(self.next);
                self.next += 1;
                let tokens = vec![f as u32; n];
                let opts = AdmitOptions::default();
                let looked = self.kv.cached_prefix_len(&tokens, &opts).unwrap();
                let r = self
                    .kv
                    .admit_tokens_grouped(id, &tokens, &opts, &mut self.step);
                match r {
                    Ok(a) => {
                        assert_eq!(a.cached_tokens, looked);
                        assert!(a.cached_tokens % BS == 0 && (n == 0 || a.cached_tokens < n));
                        if a.cached_tokens > 0 {
                            self.hits_with_window += usize::from(
                                (0..self.kv.num_groups())
                                    .any(|g| self.kv.group(g).sliding_window().is_some()),
                            );
                        }
                        for g in 0..self.kv.num_groups() {
                            assert_eq!(self.step.slots[g].len(), n - a.cached_tokens);
                        }
                        self.write(SeqId(family_writer(f)), a.cached_tokens);
                        self.seqs.push((id, vec![family_writer(f); n]));
                        self.hits += a.cached_tokens;
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Action::Append(s, n) => {
                let Some(i) = pick(s, &self.seqs) else { return };
                let id = self.seqs[i].0;
                let first = self.seqs[i].1.len();
                let needed = self.kv.blocks_needed(id, n, 0).unwrap_or(usize::MAX);
                let used = self.kv.group_stats().used_pages;
                let r = self.kv.append_grouped(id, n, &mut self.step);
                if r.is_ok() {
                    // What the call said it takes is what it took (a call that gives
                    // back more window pages than it takes says 0). A copy on write
                    // of a truncated sequence's registered last block lets the block
                    // go to the prefix cache, so the used pages grow by less.
                    let now = self.kv.group_stats().used_pages;
                    let copied = self.step.copies.iter().any(|c| !c.is_empty());
                    if needed > 0 && !copied {
                        assert_eq!(now, used + needed);
                    } else if needed > 0 {
                        assert!(now <= used + needed, "{now} > {used} + {needed}");
                    } else {
                        assert!(now <= used, "{now} > {used}");
                    }
                    self.write(id, first);
                    self.seqs[i].1.extend(std::iter::repeat_n(id.0, n));
                }
                r
            }
            Action::Step(s, n, la, acc) => {
                let Some(i) = pick(s, &self.seqs) else { return };
                let id = self.seqs[i].0;
                let first = self.seqs[i].1.len();
                let r = self.kv.reserve_grouped(id, n, la, &mut self.step);
                if r.is_ok() {
                    let acc = acc.min(n);
                    self.write_step(id, first, acc);
                    self.kv.commit(id, acc).unwrap();
                    self.seqs[i].1.extend(std::iter::repeat_n(id.0, acc));
                }
                r
            }
            Action::Fork(s) => {
                let Some(i) = pick(s, &self.seqs) else { return };
                let child = SeqId(self.next);
                self.next += 1;
                let r = self.kv.fork(self.seqs[i].0, child);
                if r.is_ok() {
                    let w = self.seqs[i].1.clone();
                    self.seqs.push((child, w));
                }
                r
            }
            Action::Defrag => {
                let pending = self.kv.plan_defragment_grouped().unwrap();
                self.store
                    .copy_blocks(&pending.plan().to_copy_plan())
                    .unwrap();
                pending.commit().unwrap();
                let st = self.kv.group_stats();
                assert_eq!(self.kv.high_water_blocks(), st.used_pages + st.cached_pages);
                Ok(())
            }
            Action::SwapOut(s, abort) => {
                let Some(i) = pick(s, &self.seqs) else { return };
                let id = self.seqs[i].0;
                if abort {
                    let r = self.kv.swap_out_grouped(id);
                    if let Ok(job) = &r {
                        // The sequence stays resident and readable.
                        self.kv.abort_swap_grouped(job).unwrap();
                        assert!(!self.kv.is_swapped(id));
                    }
                    r.map(drop)
                } else {
                    self.swap_out(i)
                }
            }
            Action::SwapIn(s) => {
                let Some(i) = pick(s, &self.swapped) else {
                    return;
                };
                let id = self.swapped[i].0;
                let r = self.kv.swap_in_grouped(id);
                if let Ok(job) = &r {
                    for plan in &job.plans {
                        self.store.swap(plan).unwrap();
                    }
                    self.kv.complete_swap_grouped(job).unwrap();
                    self.swaps += usize::from(job.plans.iter().any(|p| !p.is_empty()));
                    let w = self.swapped.swap_remove(i);
                    self.seqs.push(w);
                }
                r.map(drop)
            }
            Action::ExportImport(s, corrupt) => {
                let Some(i) = pick(s, &self.seqs) else { return };
                let id = self.seqs[i].0;
                let len = exported_group_len(&self.kv, &self.store, id, false).unwrap();
                let mut wire = vec![0u8; len];
                export_group_sequence(&self.kv, &self.store, id, None, &mut wire).unwrap();
                let copy = SeqId(self.next);
                self.next += 1;
                if let Some(at) = corrupt {
                    wire[at % len] ^= 0x20;
                    let r = import_group_sequence(&mut self.kv, &mut self.store, copy, &wire);
                    assert!(
                        matches!(r, Err(Error::Checksum { .. } | Error::ExportFormat { .. })),
                        "byte {} of {len}: {r:?}",
                        at % len
                    );
                    assert_eq!(snapshot(&self.kv), before);
                    Ok(())
                } else {
                    let r = import_group_sequence(&mut self.kv, &mut self.store, copy, &wire);
                    if r.is_ok() {
                        let w = self.seqs[i].1.clone();
                        self.seqs.push((copy, w));
                    }
                    r
                }
            }
            Action::AdmitChunked(f, n, chunk) => {
                let id = SeqId(self.next);
                self.next += 1;
                let tokens = vec![f as u32; n];
                let opts = AdmitOptions::default();
                let looked = self.kv.cached_prefix_len(&tokens, &opts).unwrap();
                match self.kv.admit_prompt_grouped(id, &tokens, &opts) {
                    Ok(a) => {
                        assert_eq!(a.cached_tokens, looked);
                        assert_eq!(self.kv.num_computed_tokens(id).unwrap(), a.cached_tokens);
                        self.hits += a.cached_tokens;
                        self.chunked += 1;
                        let writer = family_writer(f);
                        self.seqs.push((id, vec![writer; a.cached_tokens]));
                        let mut done = a.cached_tokens;
                        while done < n {
                            let c = chunk.min(n - done);
                            let before = snapshot(&self.kv);
                            match self.kv.reserve_grouped(id, c, 0, &mut self.step) {
                                Ok(()) => {
                                    self.write(SeqId(writer), done);
                                    self.kv.commit(id, c).unwrap();
                                    self.seqs
                                        .last_mut()
                                        .unwrap()
                                        .1
                                        .extend(std::iter::repeat_n(writer, c));
                                    done += c;
                                }
                                Err(Error::OutOfBlocks { .. }) => {
                                    assert_eq!(snapshot(&self.kv), before);
                                    self.seqs.pop();
                                    self.kv.free(id).unwrap();
                                    break;
                                }
                                Err(e) => panic!("{a:?}: chunk at {done}: {e}"),
                            }
                        }
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Action::BatchStep(s, k, n, la, acc) => {
                if self.seqs.is_empty() {
                    return;
                }
                let picked: Vec<usize> = (0..k.min(self.seqs.len()))
                    .map(|j| (s + j) % self.seqs.len())
                    .collect();
                let entries: Vec<StepEntry> = picked
                    .iter()
                    .map(|&i| StepEntry {
                        seq: self.kv.handle(self.seqs[i].0).unwrap(),
                        new_tokens: n,
                        lookahead: la,
                    })
                    .collect();
                let r = self.kv.reserve_step_grouped(&entries, &mut self.bufs);
                if r.is_ok() {
                    let acc = acc.min(n);
                    for g in 0..self.kv.num_groups() {
                        let b = &self.bufs[g];
                        self.cow_copies += b.copies().copies().len();
                        self.store.copy_blocks(b.copies()).unwrap();
                        for (row, &i) in picked.iter().enumerate() {
                            let (id, first) = (self.seqs[i].0, self.seqs[i].1.len());
                            let q = b.query_start_loc();
                            let (lo, hi) = (q[row] as usize, q[row + 1] as usize);
                            assert_eq!(hi - lo, n);
                            assert_eq!(b.positions()[lo], first as i64);
                            assert_eq!(b.tables().context_lens[row] as usize, first + n);
                            // The row is the group's table, holes included (rows are
                            // written only where they changed).
                            let table = self.kv.group(g).block_table(id).unwrap();
                            let width = b.tables().max_blocks;
                            let blocks = (first + n).div_ceil(BS);
                            let row_ids: Vec<u32> = table[..blocks].iter().map(|x| x.0).collect();
                            assert_eq!(
                                &b.tables().tables[row * width..row * width + blocks],
                                &row_ids[..],
                                "group {g} row {row}"
                            );
                            let slots: Vec<Slot> = b.slot_mapping()[lo..hi]
                                .iter()
                                .map(|&x| Slot(x as u64))
                                .collect();
                            let mut kk = Vec::new();
                            let mut vv = Vec::new();
                            for t in 0..n {
                                let writer = if t < acc { id.0 } else { DRAFT_WRITER };
                                let x = value(g, writer, first + t);
                                for _ in 0..HEAD_DIM {
                                    kk.extend_from_slice(&x.to_le_bytes());
                                    vv.extend_from_slice(&(-x).to_le_bytes());
                                }
                            }
                            self.store.write_slots(0, &slots, &kk, &vv).unwrap();
                        }
                    }
                    let accepted: Vec<_> = entries.iter().map(|e| (e.seq, acc)).collect();
                    self.kv.commit_step(&accepted).unwrap();
                    for &i in &picked {
                        let id = self.seqs[i].0;
                        self.seqs[i].1.extend(std::iter::repeat_n(id.0, acc));
                    }
                    self.batch_steps += 1;
                }
                r
            }
            Action::Truncate(s, keep) => {
                let Some(i) = pick(s, &self.seqs) else { return };
                let id = self.seqs[i].0;
                let new_len = keep % (self.seqs[i].1.len() + 1);
                match self.kv.truncate(id, new_len) {
                    Ok(()) => {
                        self.truncations += usize::from(new_len < self.seqs[i].1.len());
                        self.seqs[i].1.truncate(new_len);
                        assert_eq!(self.kv.num_tokens(id).unwrap(), new_len);
                    }
                    Err(Error::SequenceState { .. }) => {
                        assert_eq!(snapshot(&self.kv), before, "refused {a:?} changed state");
                        self.refused_truncations += 1;
                    }
                    Err(e) => panic!("{a:?}: {e}"),
                }
                Ok(())
            }
            Action::Free(s) => {
                let Some(i) = pick(s, &self.seqs) else { return };
                let (id, _) = self.seqs.swap_remove(i);
                self.kv.free(id).unwrap();
                Ok(())
            }
        };
        match result {
            Ok(()) => {}
            Err(Error::OutOfBlocks { needed, .. }) if self.by_policy => {
                assert_eq!(snapshot(&self.kv), before, "failed {a:?} changed state");
                self.preempt_by_policy(needed);
            }
            Err(Error::OutOfBlocks { .. } | Error::TooLong { .. } | Error::TierFull { .. }) => {
                assert_eq!(snapshot(&self.kv), before, "failed {a:?} changed state");
                // Preemption of the longest: by swap when the host tier takes it, else
                // by recompute (free it and admit it again later).
                let longest = (0..self.seqs.len()).max_by_key(|&i| self.seqs[i].1.len());
                if let Some(i) = longest.filter(|_| !matches!(a, Action::SwapOut(..))) {
                    if self.swap_out(i).is_ok() {
                        self.check();
                        return;
                    }
                    let (id, w) = self.seqs.swap_remove(i);
                    self.kv.free(id).unwrap();
                    let again = SeqId(self.next);
                    self.next += 1;
                    if self
                        .kv
                        .admit_grouped(again, w.len(), &mut self.step)
                        .is_ok()
                    {
                        self.write(again, 0);
                        self.seqs.push((again, vec![again.0; w.len()]));
                    }
                }
            }
            Err(e) => panic!("{a:?}: {e}"),
        }
        self.check();
    }
}

impl Model {
    /// `preempt_for(needed)` with a swap policy and a recompute policy in turn: the
    /// pages it says it frees are free afterwards (a swap's once completed), swapped
    /// sequences keep their bytes for the swap-in, recomputed ones are admitted
    /// again. A refusal (too little to preempt) changes nothing.
    fn preempt_by_policy(&mut self, needed: usize) {
        let mode = if (self.policy_swaps + self.policy_recomputes).is_multiple_of(2) {
            PreemptMode::AlwaysSwap
        } else {
            PreemptMode::AlwaysRecompute
        };
        let policy = PreemptPolicy {
            mode,
            ..PreemptPolicy::cost_based(CostModel::new(1e9, 1e4).unwrap())
        };
        let before = snapshot(&self.kv);
        let preempted = match self.kv.preempt_for(needed, &policy) {
            Ok(p) => p,
            Err(Error::OutOfBlocks { .. }) => {
                assert_eq!(
                    snapshot(&self.kv),
                    before,
                    "refused preempt_for changed state"
                );
                return;
            }
            Err(e) => panic!("preempt_for({needed}): {e}"),
        };
        let mut readmit = Vec::new();
        for p in preempted {
            match p.action {
                PreemptAction::SwapGroups(job) => {
                    assert_eq!(p.seqs, vec![job.seq]);
                    for plan in &job.plans {
                        self.store.swap(plan).unwrap();
                    }
                    self.kv.complete_swap_grouped(&job).unwrap();
                    self.swaps += usize::from(job.plans.iter().any(|p| !p.is_empty()));
                    let i = self.seqs.iter().position(|s| s.0 == job.seq).unwrap();
                    let w = self.seqs.swap_remove(i);
                    self.swapped.push(w);
                    self.policy_swaps += 1;
                }
                PreemptAction::Recompute { tokens } => {
                    for (id, n) in tokens {
                        assert!(!self.kv.contains(id));
                        let i = self.seqs.iter().position(|s| s.0 == id).unwrap();
                        let (_, w) = self.seqs.swap_remove(i);
                        assert_eq!(w.len(), n);
                        readmit.push(n);
                    }
                    self.policy_recomputes += 1;
                }
                PreemptAction::Swap(_) => panic!("a hybrid cache swaps with a GroupSwapJob"),
            }
        }
        let st = self.kv.group_stats();
        assert!(
            st.free_pages >= needed,
            "{st:?} after preempt_for({needed})"
        );
        self.check();
        for n in readmit {
            let again = SeqId(self.next);
            self.next += 1;
            if self.kv.admit_grouped(again, n, &mut self.step).is_ok() {
                self.write(again, 0);
                self.seqs.push((again, vec![again.0; n]));
            }
        }
    }

    /// Swaps out `seqs[i]`: runs every group's plan on the shared storage, completes.
    fn swap_out(&mut self, i: usize) -> Result<(), Error> {
        let id = self.seqs[i].0;
        let job = self.kv.swap_out_grouped(id)?;
        for plan in &job.plans {
            self.store.swap(plan).unwrap();
        }
        self.kv.complete_swap_grouped(&job).unwrap();
        self.swaps += usize::from(job.plans.iter().any(|p| !p.is_empty()));
        assert!(self.kv.is_swapped(id));
        let w = self.seqs.swap_remove(i);
        self.swapped.push(w);
        Ok(())
    }
}

fn model(specs: &[GroupSpec]) -> Model {
    Model {
        kv: KvCache::hybrid_with_host_tier(specs, PAGES, HOST_BLOCKS).unwrap(),
        // One storage for every group: a page (and a host block) belongs to one group
        // at a time.
        store: HostStorage::with_host_tier(specs[0].layout, PAGES, HOST_BLOCKS).unwrap(),
        step: GroupStep::default(),
        seqs: Vec::new(),
        swapped: Vec::new(),
        next: 0,
        hits: 0,
        hits_with_window: 0,
        cow_copies: 0,
        swaps: 0,
        chunked: 0,
        bufs: (0..specs.len())
            .map(|_| StepBuffers::new(8, 64, PAGES))
            .collect(),
        batch_steps: 0,
        truncations: 0,
        refused_truncations: 0,
        by_policy: false,
        policy_swaps: 0,
        policy_recomputes: 0,
    }
}

#[test]
fn compaction_moves_pages_across_groups_and_keeps_every_byte() {
    let l = layout(BS, 1);
    let mut m = model(&[GroupSpec::full(l), GroupSpec::window(l, WINDOW)]);
    // Group 1's pages come from group 0; a fork shares and copies on write.
    m.apply(&Action::Admit(20)); // seq 0: 5 + 5 pages
    m.apply(&Action::Admit(9)); // seq 1: 3 + 3
    m.apply(&Action::Fork(1)); // seq 2 shares seq 1's pages
    m.apply(&Action::Append(2, 3)); // copy-on-write of the shared last page
    for _ in 0..6 {
        m.apply(&Action::Append(0, 3)); // the window group gives pages back
    }
    let id0 = m.seqs[0].0;
    m.apply(&Action::Free(0)); // holes low in the arena
    let used = m.kv.group_stats().used_pages;
    assert!(m.kv.high_water_blocks() > used);
    let pending = m.kv.plan_defragment_grouped().unwrap();
    let plan = pending.plan().clone();
    assert!(!plan.is_empty());
    // Compute what the plan moves: its pages come from both groups.
    let owners: Vec<usize> = (0..2).map(|g| pending.group_plan(g).len()).collect();
    m.store.copy_blocks(&plan.to_copy_plan()).unwrap();
    pending.commit().unwrap();
    assert_eq!(m.kv.high_water_blocks(), used);
    assert_eq!(owners.iter().sum::<usize>(), plan.len());
    assert!(owners.iter().all(|&n| n > 0), "{owners:?}");
    m.check();
    assert!(!m.kv.contains(id0));
    // A dropped plan changes nothing.
    let before = snapshot(&m.kv);
    drop(m.kv.plan_defragment_grouped().unwrap());
    assert_eq!(snapshot(&m.kv), before);
}

/// The one-group call defragments a hybrid cache too: `executor::defragment_with`
/// (through `plan_defragment`) makes the plan `plan_defragment_grouped` makes on a
/// twin, keeps every byte, and honours the options (a move budget, a fragmentation
/// floor).
#[test]
fn defragment_with_serves_a_hybrid_cache_as_the_grouped_plan_does() {
    let l = layout(BS, 1);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, WINDOW)];
    let build = || {
        let mut m = model(&specs);
        m.apply(&Action::Admit(20));
        m.apply(&Action::Admit(9));
        m.apply(&Action::Fork(1));
        m.apply(&Action::Append(2, 3));
        for _ in 0..6 {
            m.apply(&Action::Append(0, 3));
        }
        m.apply(&Action::Free(0));
        m
    };
    let (mut m, mut twin) = (build(), build());
    let used = m.kv.group_stats().used_pages;
    let want = twin.kv.plan_defragment_grouped().unwrap().plan().clone();
    assert!(want.len() > 1);

    // A fragmentation floor above the arena's plans nothing and changes nothing.
    let before = snapshot(&m.kv);
    let none =
        m.kv.plan_defragment(DefragOptions::FULL.above(0.99))
            .unwrap();
    assert!(none.plan().is_empty());
    none.commit().unwrap();
    assert_eq!(snapshot(&m.kv), before);
    // A dropped plan changes nothing either.
    drop(m.kv.plan_defragment(DefragOptions::FULL).unwrap());
    assert_eq!(snapshot(&m.kv), before);
    // A budget of one move moves the plan's first page only.
    let one =
        pagedkv::executor::defragment_with(&mut m.kv, &mut m.store, DefragOptions::incremental(1))
            .unwrap();
    assert_eq!(one.moves(), &want.moves()[..1]);
    m.check();
    // The rest, in full: the grouped plan's other moves.
    let rest =
        pagedkv::executor::defragment_with(&mut m.kv, &mut m.store, DefragOptions::FULL).unwrap();
    assert_eq!(rest.moves(), &want.moves()[1..]);
    assert_eq!(m.kv.high_water_blocks(), used);
    m.check();
}

/// Cases of one property run that saw each kind of event, checked once the run is
/// over, so the random actions cannot drift into covering nothing (a manager that
/// stopped serving hits, copying on write or swapping fails here, not vacuously).
#[derive(Debug, Default)]
struct Coverage {
    cases: usize,
    hits: usize,
    window_hits: usize,
    cow: usize,
    swaps: usize,
    truncations: usize,
    refused_truncations: usize,
    batch_steps: usize,
}

impl Coverage {
    /// At least one case and `percent` % of the cases saw `what` (`n` of them).
    /// The floors sit four or more standard deviations below what a run sees.
    fn floor(&self, what: &str, n: usize, percent: usize) {
        assert!(
            n > 0 && n * 100 >= self.cases * percent,
            "only {n} of {} cases saw {what} (want {percent} %)",
            self.cases
        );
    }
}

/// Runs `cases` random cases of `actions` on groups `specs` (as `proptest!` would,
/// the persisted seeds of `groups.proptest-regressions` first), each through
/// [`run_and_free_all`], and returns what the run covered.
fn run_property(
    actions: impl Strategy<Value = Vec<Action>>,
    specs: &[GroupSpec],
    cases: u32,
) -> Coverage {
    let config = ProptestConfig {
        source_file: Some(file!()),
        ..crate::support::proptest_config(cases)
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let seen = std::sync::Mutex::new(Coverage::default());
    let result = runner.run(&actions, |actions| {
        let m = run_and_free_all(specs, &actions);
        let mut c = seen.lock().unwrap();
        c.cases += 1;
        c.hits += usize::from(m.hits > 0);
        c.window_hits += usize::from(m.hits_with_window > 0);
        c.cow += usize::from(m.cow_copies > 0);
        c.swaps += usize::from(m.swaps > 0);
        c.truncations += usize::from(m.truncations > 0);
        c.batch_steps += usize::from(m.batch_steps > 0);
        c.refused_truncations += usize::from(m.refused_truncations > 0);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}\n{runner}");
    }
    let c = seen.into_inner().unwrap();
    eprintln!("coverage: {c:?}");
    c
}

#[test]
fn groups_keep_every_token_in_one_shared_arena() {
    let l = layout(BS, 1);
    let specs = [
        GroupSpec::full(l),
        GroupSpec::window(l, WINDOW),
        GroupSpec::full(l),
    ];
    let c = run_property(proptest::collection::vec(action(), 1..80), &specs, 64);
    c.floor("a copy-on-write", c.cow, 25);
    c.floor("a swap", c.swaps, 50);
    // Window groups serve hits only from live holders: about 15 % of the cases.
    c.floor("a prefix hit served by a window group", c.window_hits, 0);
}

/// Two full groups share prefix hits: every served block holds the family's bytes
/// in both groups, on the one shared storage.
#[test]
fn prefix_hits_hold_their_bytes_in_every_group() {
    let l = layout(BS, 1);
    let specs = [GroupSpec::full(l), GroupSpec::full(l)];
    let c = run_property(proptest::collection::vec(action(), 1..80), &specs, 64);
    c.floor("a copy-on-write", c.cow, 25);
    c.floor("a swap", c.swaps, 50);
    c.floor("a prefix hit", c.hits, 25);
}

/// Batch steps through the step path among the other actions (full + window and
/// full + full): every group's buffers hold the step's slots, positions and context
/// lengths; drafts written past the accepted tokens never pass for them; a refused
/// step changes nothing.
#[test]
fn batch_steps_fill_every_groups_buffers() {
    let l = layout(BS, 1);
    for specs in [
        vec![GroupSpec::full(l), GroupSpec::window(l, WINDOW)],
        vec![GroupSpec::full(l), GroupSpec::full(l)],
    ] {
        let c = run_property(
            proptest::collection::vec(action_with_batch_steps(), 1..80),
            &specs,
            48,
        );
        c.floor("a batch step", c.batch_steps, 50);
        // 13-30 of 57 cases in eight runs.
        c.floor("a copy-on-write", c.cow, 5);
    }
}

/// Chunked prefills among the other actions (two full groups and a window group):
/// the prefix every group serves is admitted computed, each chunk's commit registers
/// what it completes, and later prompts of the family hit those blocks with their
/// bytes in every group.
#[test]
fn chunked_prefills_share_their_prefix_in_every_group() {
    let l = layout(BS, 1);
    for specs in [
        vec![GroupSpec::full(l), GroupSpec::full(l)],
        vec![GroupSpec::full(l), GroupSpec::window(l, WINDOW)],
    ] {
        let c = run_property(
            proptest::collection::vec(action_with_chunks(), 1..80),
            &specs,
            48,
        );
        c.floor("a prefix hit", c.hits, 25);
    }
}

/// Truncation among the other actions, on a full and a window group: every group
/// cuts the same tokens (the bytes before the cut stay), and a window group's refusal
/// (the new length's window starts in blocks it gave back) changes no group.
#[test]
fn truncation_cuts_every_group_or_none() {
    let l = layout(BS, 1);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, WINDOW)];
    let c = run_property(
        proptest::collection::vec(action_with_truncate(), 1..80),
        &specs,
        64,
    );
    // 43-58 of 73 cases in five runs.
    c.floor("a truncation", c.truncations, 30);
    c.floor("a refused truncation", c.refused_truncations, 10);
}

/// Export and import among the other actions: the imported copy holds its
/// source's bytes in every group (window holes stay holes), and a flipped byte
/// anywhere in the buffer is refused with nothing changed.
#[test]
fn exported_sequences_import_with_their_bytes_in_every_group() {
    let l = layout(BS, 1);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, WINDOW)];
    let c = run_property(
        proptest::collection::vec(action_with_export(), 1..80),
        &specs,
        64,
    );
    c.floor("a copy-on-write", c.cow, 25);
    c.floor("a swap", c.swaps, 50);
    c.floor("a prefix hit served by a window group", c.window_hits, 0);
}

/// Applies `actions` (each checked), then frees every sequence: no page stays used.
/// Returns the model (its counters: hits, copies, swaps).
fn run_and_free_all(specs: &[GroupSpec], actions: &[Action]) -> Model {
    let mut m = model(specs);
    for a in actions {
        m.apply(a);
    }
    for (id, _) in std::mem::take(&mut m.seqs)
        .into_iter()
        .chain(std::mem::take(&mut m.swapped))
    {
        m.kv.free(id).unwrap();
    }
    m.kv.check_invariants().unwrap();
    assert_eq!(m.kv.group_stats().used_pages, 0);
    assert_eq!(m.kv.num_free_host_blocks(), HOST_BLOCKS);
    m
}

#[test]
fn prefix_hits_are_served_and_counted_in_every_group() {
    let l = layout(BS, 1);
    let mut m = model(&[GroupSpec::full(l), GroupSpec::full(l)]);
    m.apply(&Action::AdmitTokens(1, 22)); // 5 full blocks registered per group
    m.apply(&Action::Free(0)); // they stay cached
    assert_eq!(m.kv.group_stats().used_pages, 0);
    m.apply(&Action::AdmitTokens(1, 30));
    assert_eq!(m.hits, 20, "5 blocks of 4 tokens, in both groups");
    m.apply(&Action::AdmitTokens(1, 21)); // shares live blocks this time
    assert_eq!(m.hits, 40);
    m.apply(&Action::AdmitTokens(2, 21)); // another family: no hit
    assert_eq!(m.hits, 40);
    m.apply(&Action::Fork(1));
    m.apply(&Action::Append(3, 5));
    m.check();
}

/// A step whose drafts are rejected leaves draft bytes in slots that the next calls
/// hand out again for the tokens really committed there; every computed position must
/// hold the committed token's bytes (the model writes drafts as [`DRAFT_WRITER`]),
/// through a fork, a copy-on-write, a swap and a prefix hit of the family's prompt.
#[test]
fn rejected_drafts_never_pass_for_the_tokens_committed_after_them() {
    let l = layout(BS, 1);
    let mut m = model(&[GroupSpec::full(l), GroupSpec::full(l)]);
    m.apply(&Action::AdmitTokens(1, 6)); // seq 0: one full block registered
    m.apply(&Action::Step(0, 3, 2, 1)); // positions 6..11 reserved, 6 accepted
    assert_eq!(m.kv.num_computed_tokens(m.seqs[0].0).unwrap(), 7);
    m.apply(&Action::Fork(0)); // seq 1 shares the block holding drafts 7 and 8..
    m.apply(&Action::Append(0, 3)); // 7..10 committed: copy on write of that block
    m.apply(&Action::Step(1, 4, 0, 2)); // the child: 7, 8 accepted, 9, 10 drafts
    m.apply(&Action::Append(1, 2)); // 9, 10 committed over the drafts
    m.apply(&Action::SwapOut(0, false));
    m.apply(&Action::SwapIn(0));
    m.apply(&Action::AdmitTokens(1, 9)); // hits the family's first block
    assert_eq!(m.hits, BS);
    assert!(m.cow_copies > 0 && m.swaps > 0);
    m.check();
}

#[test]
fn appended_token_ids_register_so_the_next_turn_hits() {
    let l = layout(4, 1);
    let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::full(l)], 40).unwrap();
    let mut step = GroupStep::default();
    let opts = AdmitOptions::default();
    let turn1: Vec<u32> = (0..10).collect();
    kv.admit_tokens_grouped(SeqId(1), &turn1, &opts, &mut step)
        .unwrap();
    // The answer: 7 tokens with ids, then one without (its block never registers).
    kv.append_tokens_grouped(SeqId(1), &[50, 51, 52], &mut step)
        .unwrap();
    assert_eq!((step.slots[0].len(), step.slots[1].len()), (3, 3));
    kv.append_tokens_grouped(SeqId(1), &[53, 54, 55, 56], &mut step)
        .unwrap();
    kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
    kv.free(SeqId(1)).unwrap();
    let mut turn2 = turn1.clone();
    turn2.extend([50, 51, 52, 53, 54, 55, 56, 57, 60, 61]);
    // 17 known ids of 18 tokens: 4 full blocks registered (16 tokens) in each group.
    let r = kv
        .admit_tokens_grouped(SeqId(2), &turn2, &opts, &mut step)
        .unwrap();
    assert_eq!(r.cached_tokens, 16);
    kv.check_invariants().unwrap();
    let before = snapshot(&kv);
    assert!(matches!(
        kv.append_tokens_grouped(SeqId(9), &[1], &mut step),
        Err(Error::UnknownSequence(_))
    ));
    assert_eq!(snapshot(&kv), before);
}

#[test]
fn a_window_group_serves_a_hit_whose_window_blocks_a_live_sequence_holds() {
    let l = layout(BS, 1);
    // Window 8 tokens, blocks of 4: the query at 28 reads from 21, blocks 5 and 6.
    let mut m = model(&[GroupSpec::full(l), GroupSpec::window(l, 8)]);
    m.apply(&Action::AdmitTokens(1, 30)); // seq 0: 7 full blocks registered
    let id0 = m.seqs[0].0;
    let w = m.kv.group(1).block_table(id0).unwrap().to_vec();
    m.apply(&Action::AdmitTokens(1, 40)); // hit of 28 tokens in both groups
    assert_eq!((m.hits, m.hits_with_window), (28, 1));
    let id1 = m.seqs[1].0;
    let t = m.kv.group(1).block_table(id1).unwrap();
    assert!(t[..5].iter().all(|&b| b == BlockId::RELEASED));
    assert_eq!(t[5..7], w[5..7], "the window blocks are shared");
    m.check(); // every byte each group reads, the shared window blocks included
               // seq 0 decodes past the hit's window: a third prompt is served only as far as
               // the blocks seq 1 still holds.
    for _ in 0..4 {
        m.apply(&Action::Append(0, 3));
    }
    m.apply(&Action::Free(1));
    let before = m.hits;
    m.apply(&Action::AdmitTokens(1, 40));
    // No live sequence holds the window of the hit at 36 any more: seq 1 left its
    // window blocks 7 and 8 cached when freed (`tests/window_cache.rs`).
    assert_eq!(m.hits, before + 36);
    m.apply(&Action::AdmitTokens(2, 30));
    m.apply(&Action::AdmitTokens(2, 13)); // 12 tokens: window blocks 1 and 2
    assert_eq!(m.hits, before + 36 + 12);
    m.check();
}

#[test]
fn hits_agree_across_block_sizes_and_window_groups_hit_their_cache() {
    // Pages of equal bytes: 2 layers of 4 tokens, 1 layer of 8 tokens.
    let (a, b) = (layout(4, 2), layout(8, 1));
    let mut kv = KvCache::hybrid(&[GroupSpec::full(a), GroupSpec::full(b)], 40).unwrap();
    let mut step = GroupStep::default();
    let opts = AdmitOptions::default();
    let prompt: Vec<u32> = (0..30).collect();
    kv.admit_tokens_grouped(SeqId(1), &prompt[..14], &opts, &mut step)
        .unwrap();
    // Group 0 registered 3 blocks (12 tokens), group 1 one block (8 tokens).
    let r = kv
        .admit_tokens_grouped(SeqId(2), &prompt, &opts, &mut step)
        .unwrap();
    assert_eq!(r.cached_tokens, 8);
    assert_eq!((r.cached_blocks, r.new_blocks), (2 + 1, 6 + 3));
    assert_eq!((step.slots[0].len(), step.slots[1].len()), (22, 22));
    assert_eq!(
        kv.group(0).block_table(SeqId(2)).unwrap()[..2],
        kv.group(0).block_table(SeqId(1)).unwrap()[..2]
    );
    assert_eq!(
        kv.group(1).block_table(SeqId(2)).unwrap()[0],
        kv.group(1).block_table(SeqId(1)).unwrap()[0]
    );
    kv.check_invariants().unwrap();

    let l = layout(4, 1);
    let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::window(l, 8)], 40).unwrap();
    kv.admit_tokens_grouped(SeqId(1), &prompt, &opts, &mut step)
        .unwrap();
    kv.free(SeqId(1)).unwrap();
    // Group 0 holds the prompt's 7 full blocks cached, the window group the blocks
    // seq 1 gave back at its free: the window of the hit at 28 (blocks 5 and 6).
    assert_eq!(kv.cached_prefix_len(&prompt, &opts).unwrap(), 28);
    let r = kv
        .admit_tokens_grouped(SeqId(2), &prompt, &opts, &mut step)
        .unwrap();
    assert_eq!(r.cached_tokens, 28);
    kv.check_invariants().unwrap();
}

#[test]
fn cached_pages_go_to_the_group_that_needs_them_and_failures_change_nothing() {
    let l = layout(4, 1);
    let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::full(l)], 20).unwrap();
    let mut step = GroupStep::default();
    let opts = AdmitOptions::default();
    let prompt: Vec<u32> = (0..40).collect();
    // 10 pages in each group: the whole arena, then cached in both.
    kv.admit_tokens_grouped(SeqId(1), &prompt, &opts, &mut step)
        .unwrap();
    kv.free(SeqId(1)).unwrap();
    assert_eq!(
        (kv.group_stats().used_pages, kv.num_available_blocks()),
        (0, 20)
    );
    let before = snapshot(&kv);
    for bad in [
        kv.admit_tokens_grouped(SeqId(2), &[7; 44], &opts, &mut step), // 22 pages of 20
        kv.admit_tokens_grouped(SeqId(2), &[7; 81], &opts, &mut step), // longer than the arena
    ] {
        assert!(
            matches!(bad, Err(Error::OutOfBlocks { .. } | Error::TooLong { .. })),
            "{bad:?}"
        );
        assert_eq!(snapshot(&kv), before);
    }
    // A hit of 9 blocks in each group and 1 new page each: fits.
    assert_eq!(kv.cached_prefix_len(&prompt, &opts).unwrap(), 36);
    // Another prompt takes 20 pages: every cached page is evicted, by its own group.
    kv.admit_tokens_grouped(SeqId(3), &[5; 40], &opts, &mut step)
        .unwrap();
    assert_eq!(kv.cached_prefix_len(&prompt, &opts).unwrap(), 0);
    let before = snapshot(&kv);
    assert!(matches!(
        kv.admit_tokens_grouped(SeqId(3), &prompt, &opts, &mut step),
        Err(Error::DuplicateSequence(_))
    ));
    assert!(matches!(
        kv.admit_tokens_grouped(SeqId(4), &prompt, &opts, &mut step),
        Err(Error::OutOfBlocks {
            needed: 20,
            free: 0
        })
    ));
    assert_eq!(snapshot(&kv), before);
    kv.free(SeqId(3)).unwrap();
    // Now a hit of the [5; 40] prompt, and the rest of the arena taken from the cache.
    let r = kv
        .admit_tokens_grouped(SeqId(4), &[5; 40], &opts, &mut step)
        .unwrap();
    assert_eq!(r.cached_tokens, 36);
    kv.check_invariants().unwrap();
}

#[test]
fn swap_moves_host_blocks_between_groups_and_failures_change_nothing() {
    let l = layout(4, 1);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, 8)];
    let mut kv = KvCache::hybrid_with_host_tier(&specs, 20, 6).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 20, &mut step).unwrap(); // 5 + 5 pages
    kv.admit_grouped(SeqId(2), 8, &mut step).unwrap(); // 2 + 2 pages
    let before = snapshot(&kv);
    assert!(matches!(
        kv.swap_out_grouped(SeqId(1)),
        Err(Error::TierFull {
            needed: 10,
            free: 6,
            ..
        })
    ));
    assert_eq!(snapshot(&kv), before);
    // Every host block starts in group 0; the window group's two move to it.
    let job = kv.swap_out_grouped(SeqId(2)).unwrap();
    assert_eq!((job.plans[0].len(), job.plans[1].len()), (2, 2));
    let before = snapshot(&kv);
    assert!(matches!(
        kv.swap_out_grouped(SeqId(2)),
        Err(Error::SequenceState { .. })
    ));
    assert!(matches!(
        kv.swap_in_grouped(SeqId(2)),
        Err(Error::SequenceState { .. })
    ));
    assert!(matches!(
        kv.append_grouped(SeqId(2), 1, &mut step),
        Err(Error::SequenceState { .. })
    ));
    assert_eq!(snapshot(&kv), before);
    kv.complete_swap_grouped(&job).unwrap();
    assert!(kv.is_swapped(SeqId(2)));
    assert_eq!(kv.group_stats().used_pages, 10);
    kv.check_invariants().unwrap();
    let before = snapshot(&kv);
    assert!(matches!(
        kv.complete_swap_grouped(&job),
        Err(Error::UnknownTicket(_))
    ));
    assert_eq!(snapshot(&kv), before);
    // Fill the arena: the swap-in needs 4 pages and finds 0, and changes nothing.
    kv.admit_grouped(SeqId(3), 20, &mut step).unwrap();
    let before = snapshot(&kv);
    assert!(matches!(
        kv.swap_in_grouped(SeqId(2)),
        Err(Error::OutOfBlocks { needed: 4, free: 0 })
    ));
    assert_eq!(snapshot(&kv), before);
    kv.free(SeqId(3)).unwrap();
    let job = kv.swap_in_grouped(SeqId(2)).unwrap();
    kv.complete_swap_grouped(&job).unwrap();
    kv.append_grouped(SeqId(2), 1, &mut step).unwrap();
    assert_eq!(kv.num_free_host_blocks(), 6);
    kv.check_invariants().unwrap();
}

#[test]
fn gemma3_like_swap_moves_only_the_window_blocks_held() {
    // One full and five window groups (window 1,024, blocks of 16), as Gemma-3's
    // 8 global and 40 local layers; one layer a group here (page bytes do not matter).
    let l = layout(16, 1);
    let mut specs = vec![GroupSpec::full(l)];
    specs.extend(std::iter::repeat_n(GroupSpec::window(l, 1024), 5));
    let mut kv = KvCache::hybrid_with_host_tier(&specs, 2000, 2000).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 4000, &mut step).unwrap();
    kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
    // 4,001 tokens: 251 blocks; the query at 4,000 reads from 2,977, block 186.
    let job = kv.swap_out_grouped(SeqId(1)).unwrap();
    let moved: Vec<usize> = job.plans.iter().map(|p| p.len()).collect();
    assert_eq!(moved, [251, 65, 65, 65, 65, 65]);
    assert_eq!(moved.iter().sum::<usize>(), 576); // every layer full: 6 x 251 = 1,506
    kv.complete_swap_grouped(&job).unwrap();
    assert_eq!(kv.group_stats().used_pages, 0);
    let job = kv.swap_in_grouped(SeqId(1)).unwrap();
    kv.complete_swap_grouped(&job).unwrap();
    kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
    kv.check_invariants().unwrap();
}

// ---- export and import of a sequence across groups -------------------------------

/// The K value group `g` writes for layer `layer` at position `pos` (V is its negation).
fn export_value(g: usize, layer: usize, pos: usize) -> f32 {
    (100_000 * layer + 1_000 * g + pos) as f32 + 0.25
}

fn f32_bytes(vals: impl Iterator<Item = f32>) -> Vec<u8> {
    vals.flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes every layer of every group's slots of `step` for the tokens from `first`.
fn write_step(store: &mut HostStorage, step: &GroupStep, first: usize, layers: usize) {
    for (g, slots) in step.slots.iter().enumerate() {
        for layer in 0..layers {
            let vals = |sign: f32| {
                f32_bytes(
                    (0..slots.len())
                        .flat_map(move |i| [sign * export_value(g, layer, first + i); HEAD_DIM]),
                )
            };
            store
                .write_slots(layer, slots, &vals(1.0), &vals(-1.0))
                .unwrap();
        }
    }
}

/// Checks that `seq` holds, in every group, its own values for every token it still
/// holds, and returns each group's hole blocks.
fn check_sequence_bytes(
    kv: &KvCache,
    store: &HostStorage,
    seq: SeqId,
    layers: usize,
) -> Vec<usize> {
    let n = kv.num_computed_tokens(seq).unwrap();
    let mut holes = Vec::new();
    for g in 0..kv.num_groups() {
        let grp = kv.group(g);
        let (table, computed) = grp.readable_blocks(seq).unwrap();
        assert_eq!(computed, n);
        let h = table
            .iter()
            .take_while(|&&b| b == BlockId::RELEASED)
            .count();
        let first = h * grp.block_size();
        let tokens = n - first;
        for layer in 0..layers {
            let mut k = vec![0u8; tokens * HEAD_DIM * 4];
            let mut v = k.clone();
            store
                .read_tokens(layer, &table[h..], tokens, &mut k, &mut v)
                .unwrap();
            let want = |sign: f32| {
                f32_bytes((first..n).flat_map(|p| [sign * export_value(g, layer, p); HEAD_DIM]))
            };
            assert_eq!(k, want(1.0), "group {g} layer {layer} K");
            assert_eq!(v, want(-1.0), "group {g} layer {layer} V");
        }
        holes.push(h);
    }
    holes
}

/// Every byte of every page of the storage.
fn storage_bytes(store: &HostStorage, pages: usize, bs: usize, layers: usize) -> Vec<u8> {
    let table: Vec<BlockId> = (0..pages as u32).map(BlockId).collect();
    let mut out = Vec::new();
    for layer in 0..layers {
        let mut k = vec![0u8; pages * bs * HEAD_DIM * 4];
        let mut v = k.clone();
        store
            .read_tokens(layer, &table, pages * bs, &mut k, &mut v)
            .unwrap();
        out.extend(k);
        out.extend(v);
    }
    out
}

#[test]
fn a_sequence_exports_and_imports_across_groups_with_window_holes() {
    const LAYERS: usize = 2;
    const PAGES: usize = 32;
    let l = layout(4, LAYERS);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, 8)];
    let mut sender = KvCache::hybrid(&specs, PAGES).unwrap();
    let mut sender_kv = HostStorage::new(l, PAGES).unwrap();
    let mut step = GroupStep::default();
    sender.admit_grouped(SeqId(1), 10, &mut step).unwrap();
    write_step(&mut sender_kv, &step, 0, LAYERS);
    for pos in 10..30 {
        sender.append_grouped(SeqId(1), 1, &mut step).unwrap();
        write_step(&mut sender_kv, &step, pos, LAYERS);
    }
    let sent_holes = check_sequence_bytes(&sender, &sender_kv, SeqId(1), LAYERS);
    assert_eq!(sent_holes[0], 0);
    assert!(
        sent_holes[1] >= 4,
        "the window group gave blocks back: {sent_holes:?}"
    );

    let len = exported_group_len(&sender, &sender_kv, SeqId(1), false).unwrap();
    let mut wire = vec![0u8; len];
    assert_eq!(
        export_group_sequence(&sender, &sender_kv, SeqId(1), None, &mut wire).unwrap(),
        len
    );
    // Only held blocks carry bytes: the window group's record is shorter.
    let view = GroupExportView::parse(&wire).unwrap();
    assert_eq!(view.num_tokens(), 30);
    let held: Vec<usize> = view
        .records()
        .iter()
        .map(|r| r.view.header().num_tokens())
        .collect();
    assert_eq!(held, vec![30, 30 - 4 * sent_holes[1]]);

    // The receiver holds another sequence first, so the pages differ.
    let mut receiver = KvCache::hybrid(&specs, PAGES).unwrap();
    let mut receiver_kv = HostStorage::new(l, PAGES).unwrap();
    receiver.admit_grouped(SeqId(9), 7, &mut step).unwrap();
    write_step(&mut receiver_kv, &step, 0, LAYERS);

    // Every bad buffer or mismatch is refused with nothing changed, bytes included.
    let before = (
        snapshot(&receiver),
        storage_bytes(&receiver_kv, PAGES, 4, LAYERS),
    );
    let unchanged = |kv: &KvCache, st: &HostStorage| {
        assert_eq!(snapshot(kv), before.0);
        assert_eq!(storage_bytes(st, PAGES, 4, LAYERS), before.1);
        assert!(!kv.contains(SeqId(5)));
        kv.check_invariants().unwrap();
    };
    let header_len = 40 + 24 * 2;
    let second_record = header_len + view.records()[0].view.header().total_len();
    for at in [3, 20, header_len + 150, second_record + 140, len - 1] {
        let mut bad = wire.clone();
        bad[at] ^= 0x10;
        let e = import_group_sequence(&mut receiver, &mut receiver_kv, SeqId(5), &bad);
        assert!(
            matches!(e, Err(Error::Checksum { .. } | Error::ExportFormat { .. })),
            "byte {at}: {e:?}"
        );
        unchanged(&receiver, &receiver_kv);
    }
    for cut in [
        0,
        10,
        header_len - 1,
        header_len + 10,
        second_record,
        len - 1,
    ] {
        let e = import_group_sequence(&mut receiver, &mut receiver_kv, SeqId(5), &wire[..cut]);
        assert!(
            matches!(e, Err(Error::ExportTruncated { .. })),
            "cut {cut}: {e:?}"
        );
        unchanged(&receiver, &receiver_kv);
    }
    let e = import_group_sequence(&mut receiver, &mut receiver_kv, SeqId(9), &wire);
    assert!(matches!(e, Err(Error::DuplicateSequence(_))), "{e:?}");
    unchanged(&receiver, &receiver_kv);
    // Mismatched group specs: another window, another number of groups.
    for other in [
        vec![GroupSpec::full(l), GroupSpec::window(l, 12)],
        vec![GroupSpec::full(l), GroupSpec::full(l)],
        vec![GroupSpec::full(l)],
        vec![
            GroupSpec::full(l),
            GroupSpec::window(l, 8),
            GroupSpec::window(l, 8),
        ],
    ] {
        let mut kv = KvCache::hybrid(&other, PAGES).unwrap();
        let mut st = HostStorage::new(l, PAGES).unwrap();
        let snap = snapshot(&kv);
        let e = import_group_sequence(&mut kv, &mut st, SeqId(5), &wire);
        assert!(matches!(e, Err(Error::ExportShape { .. })), "{e:?}");
        assert_eq!(snapshot(&kv), snap);
    }
    // Out of pages: 8 full + 3 window pages needed, 10 in the arena.
    let mut small = KvCache::hybrid(&specs, 10).unwrap();
    let mut small_kv = HostStorage::new(l, 10).unwrap();
    let snap = snapshot(&small);
    let e = import_group_sequence(&mut small, &mut small_kv, SeqId(5), &wire);
    assert!(matches!(e, Err(Error::OutOfBlocks { .. })), "{e:?}");
    assert_eq!(snapshot(&small), snap);

    // The good buffer imports: the same tokens, the same holes, every held byte.
    import_group_sequence(&mut receiver, &mut receiver_kv, SeqId(5), &wire).unwrap();
    receiver.check_invariants().unwrap();
    assert_eq!(receiver.num_computed_tokens(SeqId(5)).unwrap(), 30);
    assert_eq!(
        check_sequence_bytes(&receiver, &receiver_kv, SeqId(5), LAYERS),
        sent_holes
    );
    check_sequence_bytes(&receiver, &receiver_kv, SeqId(9), LAYERS);
    // Pages taken: only the held blocks.
    let st = receiver.group_stats();
    assert_eq!(st.used_per_group, vec![2 + 8, 2 + 8 - sent_holes[1]]);
    // The imported sequence decodes on: the window group keeps giving blocks back.
    for pos in 30..40 {
        receiver.append_grouped(SeqId(5), 1, &mut step).unwrap();
        write_step(&mut receiver_kv, &step, pos, LAYERS);
    }
    receiver.check_invariants().unwrap();
    check_sequence_bytes(&receiver, &receiver_kv, SeqId(5), LAYERS);
    // Exported again from the receiver, it is the same K/V.
    let mut again =
        vec![0u8; exported_group_len(&receiver, &receiver_kv, SeqId(5), false).unwrap()];
    export_group_sequence(&receiver, &receiver_kv, SeqId(5), None, &mut again).unwrap();
    let back = GroupExportView::parse(&again).unwrap();
    assert_eq!(back.num_tokens(), 40);
    receiver.free(SeqId(5)).unwrap();
    receiver.free(SeqId(9)).unwrap();
    receiver.check_invariants().unwrap();
    assert_eq!(receiver.group_stats().used_pages, 0);
}

#[test]
fn latent_groups_export_and_import_with_window_holes() {
    let kind = KvKind::Latent {
        kv_lora_rank: 6,
        rope_dim: 2,
    };
    let l = KvLayout::with_kind(ModelShape::latent(1, 4, 6, 2, DType::F32), 4, kind).unwrap();
    let specs = [GroupSpec::full(l), GroupSpec::window(l, 8)];
    let latent = |g: usize, pos: usize| f32_bytes((0..8).map(|i| (1000 * g + 10 * pos + i) as f32));
    let write = |store: &mut HostStorage, step: &GroupStep, first: usize| {
        for (g, slots) in step.slots.iter().enumerate() {
            let k: Vec<u8> = (first..first + slots.len())
                .flat_map(|p| latent(g, p))
                .collect();
            store.write_slots(0, slots, &k, &[]).unwrap();
        }
    };
    let held = |kv: &KvCache, store: &HostStorage, seq: SeqId| -> Vec<(usize, Vec<u8>)> {
        (0..kv.num_groups())
            .map(|g| {
                let (table, n) = kv.group(g).readable_blocks(seq).unwrap();
                let h = table
                    .iter()
                    .take_while(|&&b| b == BlockId::RELEASED)
                    .count();
                let mut k = vec![0u8; (n - 4 * h) * 32];
                store
                    .read_tokens(0, &table[h..], n - 4 * h, &mut k, &mut [])
                    .unwrap();
                let want: Vec<u8> = (4 * h..n).flat_map(|p| latent(g, p)).collect();
                assert_eq!(k, want, "group {g}");
                (h, k)
            })
            .collect()
    };
    let mut sender = KvCache::hybrid(&specs, 16).unwrap();
    let mut sender_kv = HostStorage::new(l, 16).unwrap();
    let mut step = GroupStep::default();
    sender.admit_grouped(SeqId(1), 6, &mut step).unwrap();
    write(&mut sender_kv, &step, 0);
    for pos in 6..21 {
        sender.append_grouped(SeqId(1), 1, &mut step).unwrap();
        write(&mut sender_kv, &step, pos);
    }
    let sent = held(&sender, &sender_kv, SeqId(1));
    assert!(sent[1].0 > 0, "the window group holds holes");
    let mut wire = vec![0u8; exported_group_len(&sender, &sender_kv, SeqId(1), false).unwrap()];
    export_group_sequence(&sender, &sender_kv, SeqId(1), None, &mut wire).unwrap();

    let mut receiver = KvCache::hybrid(&specs, 16).unwrap();
    let mut receiver_kv = HostStorage::new(l, 16).unwrap();
    import_group_sequence(&mut receiver, &mut receiver_kv, SeqId(3), &wire).unwrap();
    receiver.check_invariants().unwrap();
    assert_eq!(held(&receiver, &receiver_kv, SeqId(3)), sent);
    // A K/V receiver of the same page bytes refuses it, unchanged.
    let std = layout(4, 2);
    let mut kv_groups =
        KvCache::hybrid(&[GroupSpec::full(std), GroupSpec::window(std, 8)], 16).unwrap();
    let mut kv_store = HostStorage::new(std, 16).unwrap();
    let snap = snapshot(&kv_groups);
    let e = import_group_sequence(&mut kv_groups, &mut kv_store, SeqId(3), &wire);
    assert!(matches!(e, Err(Error::ExportShape { .. })), "{e:?}");
    assert_eq!(snapshot(&kv_groups), snap);
}

#[test]
fn a_storage_fault_during_a_group_import_frees_the_sequence_in_every_group() {
    let l = layout(4, 2);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, 8)];
    let mut sender = KvCache::hybrid(&specs, 16).unwrap();
    let mut sender_kv = HostStorage::new(l, 16).unwrap();
    let mut step = GroupStep::default();
    sender.admit_grouped(SeqId(1), 21, &mut step).unwrap();
    write_step(&mut sender_kv, &step, 0, 2);
    let ids: Vec<u32> = (0..21).collect();
    let mut wire = vec![0u8; exported_group_len(&sender, &sender_kv, SeqId(1), true).unwrap()];
    export_group_sequence(&sender, &sender_kv, SeqId(1), Some(&ids), &mut wire).unwrap();
    // Admitted in both groups, then group 0's layer 1 fails to write.
    let mut receiver = KvCache::hybrid(&specs, 16).unwrap();
    let mut faulty = FaultyStorage {
        inner: HostStorage::new(l, 16).unwrap(),
        failing_layer: 1,
    };
    let before = receiver.group_stats();
    let e = import_group_sequence(&mut receiver, &mut faulty, SeqId(2), &wire).unwrap_err();
    assert_eq!(e, Error::Cuda("simulated fault".into()));
    assert!(!receiver.contains(SeqId(2)));
    receiver.check_invariants().unwrap();
    let now = receiver.group_stats();
    assert_eq!((now.used_pages, now.num_sequences), (before.used_pages, 0));
    // Through the prefix caches: the blocks registered by the failed import are
    // evicted, so no later prompt hits bytes that were never written.
    let opts = AdmitOptions::default();
    let e = GroupExportView::parse(&wire).unwrap().import_into_cache(
        &mut receiver,
        &mut faulty,
        SeqId(2),
        &opts,
    );
    assert_eq!(e.unwrap_err(), Error::Cuda("simulated fault".into()));
    assert!(!receiver.contains(SeqId(2)));
    assert_eq!(receiver.group_stats().cached_pages, 0);
    assert_eq!(receiver.cached_prefix_len(&ids, &opts).unwrap(), 0);
    receiver.check_invariants().unwrap();
    // With a working storage the same buffer imports.
    faulty.failing_layer = usize::MAX;
    import_group_sequence(&mut receiver, &mut faulty, SeqId(2), &wire).unwrap();
    check_sequence_bytes(&receiver, &faulty.inner, SeqId(2), 2);
}

#[test]
fn a_group_export_re_pages_to_another_block_size_when_the_holes_are_whole_blocks() {
    let (small, big) = (layout(4, 2), layout(8, 2));
    let sent = |tokens: usize| {
        let specs = [GroupSpec::full(small), GroupSpec::window(small, 8)];
        let mut kv = KvCache::hybrid(&specs, 32).unwrap();
        let mut st = HostStorage::new(small, 32).unwrap();
        let mut step = GroupStep::default();
        kv.admit_grouped(SeqId(1), 1, &mut step).unwrap();
        write_step(&mut st, &step, 0, 2);
        for pos in 1..tokens {
            kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
            write_step(&mut st, &step, pos, 2);
        }
        let holes = check_sequence_bytes(&kv, &st, SeqId(1), 2);
        let mut wire = vec![0u8; exported_group_len(&kv, &st, SeqId(1), false).unwrap()];
        export_group_sequence(&kv, &st, SeqId(1), None, &mut wire).unwrap();
        (holes, wire)
    };
    let receiver = || {
        let specs = [GroupSpec::full(big), GroupSpec::window(big, 8)];
        (
            KvCache::hybrid(&specs, 16).unwrap(),
            HostStorage::new(big, 16).unwrap(),
        )
    };
    // 26 tokens: 4 holes of 4 tokens are 2 of 8.
    let (holes, wire) = sent(26);
    assert_eq!(holes, vec![0, 4]);
    let (mut kv, mut st) = receiver();
    import_group_sequence(&mut kv, &mut st, SeqId(2), &wire).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(check_sequence_bytes(&kv, &st, SeqId(2), 2), vec![0, 2]);
    // 30 tokens: 5 holes of 4 tokens are not whole blocks of 8: refused, no change.
    let (holes, wire) = sent(30);
    assert_eq!(holes, vec![0, 5]);
    let snap = snapshot(&kv);
    let e = import_group_sequence(&mut kv, &mut st, SeqId(3), &wire);
    assert!(
        matches!(
            e,
            Err(Error::ExportShape {
                sender: 20,
                receiver: 8,
                ..
            })
        ),
        "{e:?}"
    );
    assert_eq!(snapshot(&kv), snap);
}

#[test]
fn a_group_export_with_token_ids_imports_through_the_prefix_caches() {
    let l = layout(4, 2);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, 8)];
    let opts = AdmitOptions::default();
    let tokens: Vec<u32> = (100..123).collect();
    let mut sender = KvCache::hybrid(&specs, 32).unwrap();
    let mut sender_kv = HostStorage::new(l, 32).unwrap();
    let mut step = GroupStep::default();
    sender
        .admit_tokens_grouped(SeqId(1), &tokens, &opts, &mut step)
        .unwrap();
    write_step(&mut sender_kv, &step, 0, 2);
    let export = |kv: &KvCache, st: &HostStorage, ids: Option<&[u32]>| {
        let mut wire = vec![0u8; exported_group_len(kv, st, SeqId(1), ids.is_some()).unwrap()];
        export_group_sequence(kv, st, SeqId(1), ids, &mut wire).map(|_| wire)
    };
    assert!(matches!(
        export(&sender, &sender_kv, Some(&tokens[1..])),
        Err(Error::ShapeMismatch { .. })
    ));
    // Right after the prefill: no holes yet.
    let wire = export(&sender, &sender_kv, Some(&tokens)).unwrap();
    let view = GroupExportView::parse(&wire).unwrap();
    // Records whose token ids disagree (each checksummed on its own) are refused.
    let other: Vec<u32> = tokens.iter().map(|t| t + 1).collect();
    let mut spliced = export(&sender, &sender_kv, Some(&other)).unwrap();
    let second = 40 + 24 * 2 + view.records()[0].view.header().total_len();
    spliced[..second].copy_from_slice(&wire[..second]);
    assert!(matches!(
        GroupExportView::parse(&spliced),
        Err(Error::ExportFormat { .. })
    ));

    let mut rx = KvCache::hybrid(&specs, 32).unwrap();
    let mut rx_kv = HostStorage::new(l, 32).unwrap();
    let a = view
        .import_into_cache(&mut rx, &mut rx_kv, SeqId(10), &opts)
        .unwrap();
    assert_eq!(a.cached_tokens, 0);
    check_sequence_bytes(&rx, &rx_kv, SeqId(10), 2);
    // The same conversation again: the prefix every group serves is shared (the
    // window group's from the live sequence 10), only the rest is written.
    let looked = rx.cached_prefix_len(&tokens, &opts).unwrap();
    assert_eq!(looked, 20);
    let used = rx.group_stats().used_pages;
    let b = view
        .import_into_cache(&mut rx, &mut rx_kv, SeqId(11), &opts)
        .unwrap();
    assert_eq!(b.cached_tokens, 20);
    assert_eq!(rx.group_stats().used_pages, used + 2);
    check_sequence_bytes(&rx, &rx_kv, SeqId(11), 2);
    rx.check_invariants().unwrap();

    // Refusals change nothing: no token ids; window holes.
    let snap = snapshot(&rx);
    let plain = export(&sender, &sender_kv, None).unwrap();
    let e = GroupExportView::parse(&plain).unwrap().import_into_cache(
        &mut rx,
        &mut rx_kv,
        SeqId(12),
        &opts,
    );
    assert!(matches!(e, Err(Error::ExportFormat { .. })), "{e:?}");
    let mut ids = tokens.clone();
    for t in 0..10 {
        sender
            .append_tokens_grouped(SeqId(1), &[200 + t], &mut step)
            .unwrap();
        write_step(&mut sender_kv, &step, 23 + t as usize, 2);
        ids.push(200 + t);
    }
    let holed = export(&sender, &sender_kv, Some(&ids)).unwrap();
    let holed = GroupExportView::parse(&holed).unwrap();
    assert!(holed.records()[1].holes > 0);
    let e = holed.import_into_cache(&mut rx, &mut rx_kv, SeqId(12), &opts);
    assert!(matches!(e, Err(Error::Unsupported(_))), "{e:?}");
    assert_eq!(snapshot(&rx), snap);
    // The holed export still imports without the caches, holes and all.
    holed.import_into(&mut rx, &mut rx_kv, SeqId(12)).unwrap();
    check_sequence_bytes(&rx, &rx_kv, SeqId(12), 2);
    rx.check_invariants().unwrap();
}

/// A bug the coverage run above found (its random search, not a planted mutation): a
/// prompt whose full blocks are cached in the full groups but that no live sequence
/// holds in the window group is admitted with no hit, so the full groups recompute and
/// register twins of the cached blocks; a fork, a step with rejected drafts and two
/// admissions that take cached pages across groups later leave a live block whose
/// parent is a cached one (`check_invariants`: "group 0: live block #23 has a cached
/// parent #10"): the step's sequence shared the cached copies in place of its own
/// blocks while its fork sibling still held them, then registered a block they share
/// under the copy. A twin whose own block a sibling still holds now stays pending.
#[test]
fn twins_of_cached_blocks_keep_their_parents_live_across_group_page_moves() {
    let l = layout(BS, 1);
    let specs = [
        GroupSpec::full(l),
        GroupSpec::window(l, WINDOW),
        GroupSpec::full(l),
    ];
    use Action::*;
    let actions = [
        AdmitTokens(1, 13),
        Admit(9),
        Admit(1),
        Admit(9),
        Free(0),
        Free(0),
        Free(0),
        Free(0),
        AdmitTokens(1, 26),
        Fork(0),
        Step(0, 3, 0, 1),
        Admit(6),
        Admit(1),
    ];
    run_and_free_all(&specs, &actions);
}

/// Preemption by `preempt_for` on a hybrid cache (full + window groups): the model
/// preempts through the policy, alternating swap and recompute, with the byte shadow
/// checked after each; a refusal changes nothing. Priorities order the victims.
#[test]
fn preempt_for_frees_pages_in_every_group() {
    let l = layout(BS, 1);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, WINDOW)];
    let config = ProptestConfig {
        source_file: Some(file!()),
        ..crate::support::proptest_config(48)
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let seen = std::sync::Mutex::new((0, 0));
    runner
        .run(&proptest::collection::vec(action(), 1..80), |actions| {
            let mut m = model(&specs);
            m.by_policy = true;
            for a in &actions {
                m.apply(a);
            }
            let mut s = seen.lock().unwrap();
            s.0 += usize::from(m.policy_swaps > 0);
            s.1 += usize::from(m.policy_recomputes > 0);
            Ok(())
        })
        .unwrap();
    let (swaps, recomputes) = seen.into_inner().unwrap();
    eprintln!("preempt_for: swaps in {swaps}, recomputes in {recomputes} of 48 cases");
    assert!(
        swaps >= 10 && recomputes >= 10,
        "{swaps} / {recomputes} of 48 cases"
    );

    // Priorities: the lower-priority sequence goes first, though it is the older.
    let mut kv = KvCache::hybrid_with_host_tier(&specs, 8, 8).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 8, &mut step).unwrap(); // 2 pages in each group
    kv.admit_grouped(SeqId(2), 8, &mut step).unwrap();
    kv.set_preempt_priority(SeqId(1), -1).unwrap();
    let policy = PreemptPolicy {
        mode: PreemptMode::AlwaysRecompute,
        ..PreemptPolicy::cost_based(CostModel::new(1e9, 1e4).unwrap())
    };
    let before = snapshot(&kv);
    assert!(matches!(
        kv.preempt_for(9, &policy),
        Err(Error::OutOfBlocks { needed: 9, free: 8 })
    ));
    assert_eq!(snapshot(&kv), before);
    let p = kv.preempt_for(4, &policy).unwrap();
    assert_eq!(p.len(), 1);
    assert_eq!((p[0].seqs.clone(), p[0].blocks_freed), (vec![SeqId(1)], 4));
    assert!(!kv.contains(SeqId(1)) && kv.contains(SeqId(2)));
    assert_eq!(kv.tier_stats().preempt_recomputes, 1);
    assert_eq!(kv.take_preempt_events().len(), 1);
    kv.check_invariants().unwrap();
}

/// A refused batch commit changes no group: one entry past its reservation, a handle
/// listed twice, or a stale handle after entries that would commit (and give window
/// blocks back) on their own; then the same step commits.
#[test]
fn a_refused_batch_commit_changes_no_group() {
    let l = layout(BS, 1);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, WINDOW)];
    let mut kv = KvCache::hybrid(&specs, PAGES).unwrap();
    let mut step = GroupStep::default();
    for id in 1..=3 {
        kv.admit_grouped(SeqId(id), 7, &mut step).unwrap();
    }
    let h: Vec<_> = (1..=3).map(|id| kv.handle(SeqId(id)).unwrap()).collect();
    let mut bufs = [StepBuffers::new(4, 16, 8), StepBuffers::new(4, 16, 8)];
    let entries: Vec<_> = h[..2]
        .iter()
        .map(|&seq| StepEntry {
            seq,
            new_tokens: 2,
            lookahead: 0,
        })
        .collect();
    kv.reserve_step_grouped(&entries, &mut bufs).unwrap();
    kv.free(SeqId(3)).unwrap();
    let before = snapshot(&kv);
    for (accepted, what) in [
        (vec![(h[0], 2), (h[1], 3)], "past the reservation"),
        (vec![(h[0], 2), (h[0], 2)], "listed twice"),
        (vec![(h[0], 2), (h[1], 2), (h[2], 1)], "stale"),
    ] {
        assert!(kv.commit_step(&accepted).is_err(), "{what}");
        assert_eq!(snapshot(&kv), before, "{what}");
        kv.check_invariants().unwrap();
    }
    kv.commit_step(&[(h[0], 2), (h[1], 2)]).unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(1)).unwrap(), 9);
    kv.check_invariants().unwrap();
}

/// A refused batch step changes no group and no buffer: a stale handle, a handle
/// listed twice, a step past the longest sequence, and steps that only the window
/// group's buffers cannot hold (narrower rows, fewer query tokens or rows).
#[test]
fn a_refused_batch_step_changes_no_group() {
    let l = layout(BS, 1);
    let specs = [GroupSpec::full(l), GroupSpec::window(l, WINDOW)];
    let mut kv = KvCache::hybrid(&specs, PAGES).unwrap();
    let mut step = GroupStep::default();
    for id in 1..=3 {
        kv.admit_grouped(SeqId(id), 7, &mut step).unwrap();
    }
    let h: Vec<_> = (1..=3).map(|id| kv.handle(SeqId(id)).unwrap()).collect();
    kv.free(SeqId(3)).unwrap();
    let e = |seq, new_tokens| StepEntry {
        seq,
        new_tokens,
        lookahead: 0,
    };
    let wide = || StepBuffers::new(4, 16, 8);
    let longest = kv.group(0).max_seq_len();
    let before = snapshot(&kv);
    for (entries, window_bufs, what) in [
        (vec![e(h[0], 1), e(h[2], 1)], wide(), "stale"),
        (vec![e(h[0], 1), e(h[0], 1)], wide(), "listed twice"),
        (vec![e(h[0], 1), e(h[1], longest)], wide(), "too long"),
        (
            vec![e(h[0], 1), e(h[1], 2)],
            StepBuffers::new(4, 16, 2),
            "narrow",
        ),
        (
            vec![e(h[0], 1), e(h[1], 2)],
            StepBuffers::new(4, 2, 8),
            "few tokens",
        ),
        (
            vec![e(h[0], 1), e(h[1], 2)],
            StepBuffers::new(1, 16, 8),
            "few rows",
        ),
    ] {
        let mut bufs = [wide(), window_bufs];
        let was = format!("{bufs:?}");
        assert!(
            kv.reserve_step_grouped(&entries, &mut bufs).is_err(),
            "{what}"
        );
        assert_eq!(snapshot(&kv), before, "{what}");
        assert_eq!(format!("{bufs:?}"), was, "{what}");
        kv.check_invariants().unwrap();
    }
    let mut bufs = [wide(), wide()];
    kv.reserve_step_grouped(&[e(h[0], 1), e(h[1], 2)], &mut bufs)
        .unwrap();
    assert_eq!(bufs[1].tables().context_lens, vec![8, 9]);
}
