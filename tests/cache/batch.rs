//! The batch decode step (`append_batch`, `append_tokens_batch`) against the
//! per-sequence calls, and the handles it runs on.
//!
//! The model-based test drives two managers with the same random actions; on one every
//! decode step is a batch call by handle, on the other one `append` (or
//! `append_tokens`) per sequence. Slots, copies, tables, counters and prefix-cache
//! counters must agree after every step, and both must pass `check_invariants`.
//!
//! `blocks_needed_batch` against the per-sequence `blocks_needed`: over random fork
//! trees (siblings sharing partly filled last blocks, some diverged by earlier steps),
//! its count equals the sum of `blocks_needed` read just before each reservation and
//! the drop in available blocks, and a batch that fits by the count is reserved
//! without an error.

use pagedkv::manager::preempt::{CostModel, PreemptAction, PreemptMode};
use pagedkv::{
    AdmitOptions, CopyPlan, DType, Error, KvCache, KvLayout, ModelShape, PreemptPolicy, SeqHandle,
    SeqId,
};
use proptest::prelude::*;

const BS: usize = 4;

fn manager(num_blocks: usize) -> KvCache {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    KvCache::builder(KvLayout::new(shape, BS).unwrap())
        .num_blocks(num_blocks)
        .watermark_blocks(0)
        .build()
        .unwrap()
}

#[derive(Debug, Clone)]
enum Action {
    /// Admit a prompt (with ids: one of two shared prefixes plus a tail; or without).
    Admit { ids: bool, prefix: u8, tail: u8 },
    /// One decode step over every running sequence.
    Step,
    /// Fork a running sequence (its next append copies the shared last block).
    Fork(u8),
    /// Truncate a running sequence by a few tokens.
    Truncate(u8, u8),
    /// Free a running sequence.
    Free(u8),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        2 => (any::<bool>(), 0u8..3, 0u8..10)
            .prop_map(|(ids, prefix, tail)| Action::Admit { ids, prefix, tail }),
        6 => Just(Action::Step),
        1 => any::<u8>().prop_map(Action::Fork),
        1 => (any::<u8>(), 1u8..6).prop_map(|(k, n)| Action::Truncate(k, n)),
        1 => any::<u8>().prop_map(Action::Free),
    ]
}

struct Pair {
    batch: KvCache,
    single: KvCache,
    /// Running sequences: id, whether its ids are known, and its handle in `batch`.
    running: Vec<(SeqId, bool, SeqHandle)>,
    next: u64,
    clock: u32,
}

impl Pair {
    fn check(&self) {
        self.batch.check_invariants().unwrap();
        self.single.check_invariants().unwrap();
        assert_eq!(self.batch.stats(), self.single.stats());
        assert_eq!(self.batch.prefix_stats(), self.single.prefix_stats());
        for &(id, _, h) in &self.running {
            assert_eq!(
                self.batch.block_table(id).unwrap(),
                self.single.block_table(id).unwrap()
            );
            assert_eq!(self.batch.handle(id).unwrap(), h, "handles stay put");
        }
    }

    fn apply(&mut self, a: &Action) {
        let (mut s1, mut s2) = (Vec::new(), Vec::new());
        let (mut c1, mut c2) = (CopyPlan::new(), CopyPlan::new());
        let opts = AdmitOptions::default();
        match *a {
            Action::Admit { ids, prefix, tail } => {
                let id = SeqId(self.next);
                self.next += 1;
                let len = 9 + usize::from(tail);
                let prompt: Vec<u32> = (0..len as u32)
                    .map(|t| {
                        if t < 8 {
                            u32::from(prefix) * 100 + t
                        } else {
                            1_000 + t
                        }
                    })
                    .collect();
                let (r1, r2) = if ids {
                    (
                        self.batch
                            .admit_tokens(id, &prompt, &opts, &mut s1)
                            .map(drop),
                        self.single
                            .admit_tokens(id, &prompt, &opts, &mut s2)
                            .map(drop),
                    )
                } else {
                    (
                        self.batch.admit(id, len, &mut s1),
                        self.single.admit(id, len, &mut s2),
                    )
                };
                assert_eq!(r1, r2);
                if r1.is_ok() {
                    let h = self.batch.handle(id).unwrap();
                    self.running.push((id, ids, h));
                }
            }
            Action::Step => {
                self.clock += 1;
                let handles: Vec<SeqHandle> = self.running.iter().map(|r| r.2).collect();
                let all_ids = self.running.iter().all(|r| r.1);
                let tokens: Vec<u32> = (0..self.running.len() as u32)
                    .map(|k| 5_000 + self.clock * 7 + k)
                    .collect();
                let before = (self.batch.stats(), self.batch.prefix_stats());
                let r1 = if all_ids {
                    self.batch
                        .append_tokens_batch(&handles, &tokens, &mut s1, &mut c1)
                } else {
                    self.batch.append_batch(&handles, &mut s1, &mut c1)
                };
                match r1 {
                    Ok(()) => {
                        for (k, &(id, _, _)) in self.running.iter().enumerate() {
                            let mut one = Vec::new();
                            if all_ids {
                                self.single
                                    .append_tokens(id, &tokens[k..k + 1], &mut one, &mut c2)
                                    .unwrap();
                            } else {
                                self.single.append(id, 1, &mut one, &mut c2).unwrap();
                            }
                            s2.extend_from_slice(&one);
                        }
                        assert_eq!(s1, s2);
                        assert_eq!(c1, c2);
                    }
                    Err(e) => {
                        assert!(matches!(e, Error::OutOfBlocks { .. }), "{e}");
                        assert_eq!(
                            (self.batch.stats(), self.batch.prefix_stats()),
                            before,
                            "a failed batch changes nothing"
                        );
                        // Drop the newest sequence on both sides to make room.
                        if let Some((id, _, _)) = self.running.pop() {
                            self.batch.free(id).unwrap();
                            self.single.free(id).unwrap();
                        }
                    }
                }
            }
            Action::Fork(k) => {
                if self.running.is_empty() {
                    return;
                }
                let (parent, ids, _) = self.running[usize::from(k) % self.running.len()];
                let child = SeqId(self.next);
                self.next += 1;
                let r1 = self.batch.fork(parent, child);
                assert_eq!(r1, self.single.fork(parent, child));
                if r1.is_ok() {
                    let h = self.batch.handle(child).unwrap();
                    self.running.push((child, ids, h));
                }
            }
            Action::Truncate(k, n) => {
                if self.running.is_empty() {
                    return;
                }
                let (id, _, _) = self.running[usize::from(k) % self.running.len()];
                let len = self.batch.num_tokens(id).unwrap();
                let new_len = len.saturating_sub(usize::from(n)).max(1);
                assert_eq!(
                    self.batch.truncate(id, new_len),
                    self.single.truncate(id, new_len)
                );
            }
            Action::Free(k) => {
                if self.running.is_empty() {
                    return;
                }
                let (id, _, h) = self
                    .running
                    .swap_remove(usize::from(k) % self.running.len());
                self.batch.free(id).unwrap();
                self.single.free(id).unwrap();
                assert_eq!(
                    self.batch.append_batch(&[h], &mut s1, &mut c1),
                    Err(Error::StaleHandle(h))
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(64))]
    #[test]
    fn batch_step_matches_per_sequence_calls(actions in proptest::collection::vec(action(), 1..120)) {
        let mut p = Pair {
            batch: manager(48),
            single: manager(48),
            running: Vec::new(),
            next: 0,
            clock: 0,
        };
        for a in &actions {
            p.apply(a);
            p.check();
        }
    }
}

#[test]
fn refused_batches_change_nothing() {
    let mut kv = manager(8);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 4, &mut slots).unwrap();
    kv.admit(SeqId(2), 3, &mut slots).unwrap();
    let (h1, h2) = (kv.handle(SeqId(1)).unwrap(), kv.handle(SeqId(2)).unwrap());
    let before = kv.stats();

    // Listed twice.
    assert_eq!(
        kv.append_batch(&[h1, h2, h1], &mut slots, &mut copies),
        Err(Error::DuplicateInBatch(SeqId(1)))
    );
    // Token ids that do not match the batch.
    assert!(matches!(
        kv.append_tokens_batch(&[h1, h2], &[7], &mut slots, &mut copies),
        Err(Error::ShapeMismatch { .. })
    ));
    assert_eq!(kv.stats(), before);

    // Out of blocks: seq 1 needs a new block, seq 2 does not; fill the arena first.
    kv.admit(SeqId(3), 6 * BS, &mut slots).unwrap();
    assert_eq!(kv.num_available_blocks(), 0);
    let full = kv.stats();
    assert!(matches!(
        kv.append_batch(&[h2, h1], &mut slots, &mut copies),
        Err(Error::OutOfBlocks { needed: 1, free: 0 })
    ));
    assert_eq!(kv.stats(), full);
    assert_eq!(
        kv.num_tokens(SeqId(2)).unwrap(),
        3,
        "seq 2 got nothing either"
    );
    // Seq 2 alone fits its last block.
    kv.append_batch(&[h2], &mut slots, &mut copies).unwrap();
    assert_eq!(slots.len(), 1);
    kv.check_invariants().unwrap();

    // One holding an uncommitted reservation.
    kv.free(SeqId(3)).unwrap();
    kv.reserve(SeqId(2), 1, 0, &mut slots, &mut copies).unwrap();
    let reserved = kv.stats();
    assert!(matches!(
        kv.append_batch(&[h1, h2], &mut slots, &mut copies),
        Err(Error::SequenceState { .. })
    ));
    assert_eq!(kv.stats(), reserved);
    assert_eq!(kv.num_tokens(SeqId(1)).unwrap(), 4);
    kv.commit(SeqId(2), 1).unwrap();

    // A freed sequence's handle is stale even once its slot is reused.
    kv.free(SeqId(1)).unwrap();
    kv.admit(SeqId(4), 1, &mut slots).unwrap();
    assert_eq!(
        kv.append_batch(&[h1], &mut slots, &mut copies),
        Err(Error::StaleHandle(h1))
    );
    assert_ne!(kv.handle(SeqId(4)).unwrap(), h1);
    kv.check_invariants().unwrap();
}

#[derive(Debug, Clone)]
enum Build {
    /// Fork sequence `pick` (mod the live count) into a new one.
    Fork { pick: usize },
    /// Reserve and commit `n` tokens on sequence `pick`: siblings diverge.
    Step { pick: usize, n: usize },
}

fn build_op() -> impl Strategy<Value = Build> {
    prop_oneof![
        3 => any::<usize>().prop_map(|pick| Build::Fork { pick }),
        1 => (any::<usize>(), 1..6usize).prop_map(|(pick, n)| Build::Step { pick, n }),
    ]
}

proptest! {
    #![proptest_config(crate::support::proptest_config(256))]

    #[test]
    fn batch_count_is_what_reserving_takes(
        num_blocks in 16..64usize,
        prompt in 1..13usize,
        tree in prop::collection::vec(build_op(), 0..12),
        // (which sequence, n, lookahead); order kept, duplicates dropped.
        batch in prop::collection::vec((any::<usize>(), 0..6usize, 0..4usize), 1..10),
    ) {
        let mut kv = manager(num_blocks);
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
        kv.admit(SeqId(0), prompt, &mut slots).unwrap();
        let mut live = vec![SeqId(0)];
        for op in tree {
            match op {
                Build::Fork { pick } => {
                    let child = SeqId(live.len() as u64);
                    kv.fork(live[pick % live.len()], child).unwrap();
                    live.push(child);
                }
                Build::Step { pick, n } => {
                    // Out of blocks is fine: the tree is just smaller.
                    let _ = kv.append(live[pick % live.len()], n, &mut slots, &mut copies);
                }
            }
        }
        let mut entries: Vec<(SeqId, usize, usize)> = Vec::new();
        for (pick, n, lookahead) in batch {
            let seq = live[pick % live.len()];
            if entries.iter().all(|e| e.0 != seq) {
                entries.push((seq, n, lookahead));
            }
        }
        let count = kv.blocks_needed_batch(&entries).unwrap();
        let before = kv.num_available_blocks();
        if count > before {
            return Ok(());
        }
        // One at a time, as an engine would: each reservation's own need, read just
        // before it, sums to the batch's count.
        let mut stepwise = 0;
        for &(seq, n, lookahead) in &entries {
            stepwise += kv.blocks_needed(seq, n, lookahead).unwrap();
            kv.reserve(seq, n, lookahead, &mut slots, &mut copies).unwrap();
        }
        prop_assert_eq!(stepwise, count);
        // No block is registered here, so every block taken leaves the pool.
        prop_assert_eq!(before - kv.num_available_blocks(), count);
    }
}

#[test]
fn siblings_sharing_a_last_block_take_one_copy_fewer() {
    let mut kv = manager(32);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    kv.admit(SeqId(0), 6, &mut slots).unwrap();
    for child in 1..4 {
        kv.fork(SeqId(0), SeqId(child)).unwrap();
    }
    let batch: Vec<_> = (0..4).map(|s| (SeqId(s), 1, 0)).collect();
    let summed: usize = batch
        .iter()
        .map(|&(s, n, l)| kv.blocks_needed(s, n, l).unwrap())
        .sum();
    assert_eq!(summed, 4);
    assert_eq!(kv.blocks_needed_batch(&batch).unwrap(), 3);
    let before = kv.num_available_blocks();
    for &(s, n, l) in &batch {
        kv.reserve(s, n, l, &mut slots, &mut copies).unwrap();
    }
    assert_eq!(before - kv.num_available_blocks(), 3);
}

#[test]
fn a_sequence_listed_twice_is_refused() {
    let mut kv = manager(8);
    let mut slots = Vec::new();
    kv.admit(SeqId(0), 3, &mut slots).unwrap();
    let err = kv
        .blocks_needed_batch(&[(SeqId(0), 1, 0), (SeqId(0), 1, 0)])
        .unwrap_err();
    assert!(matches!(err, Error::DuplicateInBatch(SeqId(0))), "{err}");
}

// ---- the step path: reserve_step / commit_step against reserve / commit -----------

#[derive(Debug, Clone)]
enum StepAction {
    /// Admit a prompt with ids (one of two shared prefixes plus a tail), or (`ids`
    /// false) a prompt of that length without any.
    Admit {
        prefix: u8,
        tail: u8,
        ids: bool,
    },
    /// One step: per running sequence (in row order) its query tokens, lookahead and
    /// accepted share (out of 4); with `true`, the query tokens' ids come with the
    /// step (`reserve_step_tokens`), and the per-sequence side adds the accepted ones
    /// after its commit (`add_token_ids`).
    Step(Vec<(u8, u8, u8)>, bool),
    /// Move the first running sequence to the back (rows change owners).
    Rotate,
    Fork(u8),
    Truncate(u8, u8),
    Free(u8),
    Defrag,
    /// Preempt (recompute) for this many blocks, then admit each victim again under
    /// its id with as many tokens as it held, in its row while there is room: the
    /// row's sequence is new under the same id.
    Preempt(u8),
}

fn step_action() -> impl Strategy<Value = StepAction> {
    prop_oneof![
        2 => (0u8..2, 0u8..10, any::<bool>())
            .prop_map(|(prefix, tail, ids)| StepAction::Admit { prefix, tail, ids }),
        6 => (prop::collection::vec((1u8..6, 0u8..3, 0u8..5), 8), any::<bool>())
            .prop_map(|(plan, ids)| StepAction::Step(plan, ids)),
        1 => Just(StepAction::Rotate),
        1 => any::<u8>().prop_map(StepAction::Fork),
        1 => (any::<u8>(), 1u8..6).prop_map(|(k, n)| StepAction::Truncate(k, n)),
        1 => any::<u8>().prop_map(StepAction::Free),
        1 => Just(StepAction::Defrag),
        2 => (1u8..6).prop_map(StepAction::Preempt),
    ]
}

const ROWS: usize = 8;
const WIDTH: usize = 24;

struct StepPair {
    step: KvCache,
    single: KvCache,
    running: Vec<SeqId>,
    buf: pagedkv::StepBuffers,
    next: u64,
}

impl StepPair {
    fn apply(&mut self, a: &StepAction) {
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        match a {
            StepAction::Admit { prefix, tail, ids } => {
                let id = SeqId(self.next);
                self.next += 1;
                let mut prompt: Vec<u32> = (0..9).map(|t| t + 100 * u32::from(*prefix)).collect();
                prompt.extend((0..u32::from(*tail)).map(|t| 1_000 + self.next as u32 * 16 + t));
                let opts = AdmitOptions::default();
                let (r1, r2) = if *ids {
                    (
                        self.step
                            .admit_tokens(id, &prompt, &opts, &mut slots)
                            .map(|_| ()),
                        self.single
                            .admit_tokens(id, &prompt, &opts, &mut slots)
                            .map(|_| ()),
                    )
                } else {
                    (
                        self.step.admit(id, prompt.len(), &mut slots),
                        self.single.admit(id, prompt.len(), &mut slots),
                    )
                };
                assert_eq!(r1.is_ok(), r2.is_ok());
                if r1.is_ok() {
                    self.running.push(id);
                }
            }
            StepAction::Step(plan, with_ids) => {
                let rows = self.running.len().min(ROWS);
                let entries: Vec<pagedkv::StepEntry> = (0..rows)
                    .map(|k| pagedkv::StepEntry {
                        seq: self.step.handle(self.running[k]).unwrap(),
                        new_tokens: usize::from(plan[k].0),
                        lookahead: usize::from(plan[k].1),
                    })
                    .collect();
                // An id per query token: a function of the sequence and position.
                let mut ids = Vec::new();
                for (k, e) in entries.iter().enumerate() {
                    let id = self.running[k];
                    let first = self.step.num_computed_tokens(id).unwrap();
                    ids.extend((first..first + e.new_tokens).map(|p| (p * 7 + k) as u32 % 5));
                }
                let before = (self.step.stats(), self.step.prefix_stats());
                let reserved = if *with_ids {
                    self.step.reserve_step_tokens(&entries, &ids, &mut self.buf)
                } else {
                    self.step.reserve_step(&entries, &mut self.buf)
                };
                match reserved {
                    Ok(()) => {
                        let mut mapping = Vec::new();
                        let mut positions = Vec::new();
                        let mut starts = vec![0u32];
                        for (k, e) in entries.iter().enumerate() {
                            let id = self.running[k];
                            let first = self.single.num_computed_tokens(id).unwrap();
                            self.single
                                .reserve(id, e.new_tokens, e.lookahead, &mut slots, &mut copies)
                                .unwrap();
                            mapping.extend(slots[..e.new_tokens].iter().map(|s| s.0 as i64));
                            positions.extend((first..first + e.new_tokens).map(|p| p as i64));
                            starts.push(mapping.len() as u32);
                        }
                        assert_eq!(self.buf.slot_mapping(), &mapping[..]);
                        assert_eq!(self.buf.positions(), &positions[..]);
                        assert_eq!(self.buf.query_start_loc(), &starts[..]);
                        assert_eq!(self.buf.copies(), &copies);
                        let mut want = pagedkv::tables::PaddedTables::default();
                        self.single
                            .fill_padded_fixed(&self.running[..rows], rows, WIDTH, &mut want)
                            .unwrap();
                        assert_eq!(self.buf.tables(), &want, "tables after reserve_step");
                        // Padding to a captured shape.
                        self.buf.pad_to(ROWS, 64).unwrap();
                        let t = self.buf.tables();
                        assert_eq!((t.batch, t.context_lens.len()), (ROWS, ROWS));
                        assert!(self.buf.slot_mapping()[mapping.len()..]
                            .iter()
                            .all(|&s| s == -1));
                        assert_eq!(self.buf.query_start_loc().len(), ROWS + 1);
                        let accepted: Vec<(SeqHandle, usize)> = entries
                            .iter()
                            .enumerate()
                            .map(|(k, e)| (e.seq, e.new_tokens * usize::from(plan[k].2) / 4))
                            .collect();
                        self.step.commit_step(&accepted).unwrap();
                        let mut at = 0;
                        for (k, &(_, n)) in accepted.iter().enumerate() {
                            let id = self.running[k];
                            let first = self.single.num_computed_tokens(id).unwrap();
                            let step_ids = &ids[at..at + entries[k].new_tokens];
                            at += entries[k].new_tokens;
                            // The accepted ids, known before the commit registers.
                            if *with_ids && (first == 0 || self.single.is_registering(id).unwrap())
                            {
                                // Ids after a gap (a step without ids) are not
                                // recorded by either side.
                                match self.single.add_token_ids(id, first, &step_ids[..n]) {
                                    Ok(_) | Err(Error::TokenIdsGap { .. }) => {}
                                    Err(e) => panic!("{e}"),
                                }
                            }
                            self.single.commit(id, n).unwrap();
                        }
                    }
                    Err(e) => {
                        assert!(
                            matches!(
                                e,
                                Error::OutOfBlocks { .. }
                                    | Error::TooLong { .. }
                                    | Error::ShapeMismatch { .. }
                            ),
                            "{e}"
                        );
                        assert_eq!(
                            (self.step.stats(), self.step.prefix_stats()),
                            before,
                            "a failed step changes nothing"
                        );
                        if let Some(id) = self.running.pop() {
                            self.step.free(id).unwrap();
                            self.single.free(id).unwrap();
                        }
                    }
                }
            }
            StepAction::Rotate => {
                if !self.running.is_empty() {
                    self.running.rotate_left(1);
                }
            }
            StepAction::Fork(k) => {
                if self.running.is_empty() {
                    return;
                }
                let parent = self.running[usize::from(*k) % self.running.len()];
                let child = SeqId(self.next);
                self.next += 1;
                let r1 = self.step.fork(parent, child);
                assert_eq!(r1, self.single.fork(parent, child));
                if r1.is_ok() {
                    self.running.push(child);
                }
            }
            StepAction::Truncate(k, n) => {
                if self.running.is_empty() {
                    return;
                }
                let id = self.running[usize::from(*k) % self.running.len()];
                let len = self.step.num_tokens(id).unwrap();
                let new_len = len.saturating_sub(usize::from(*n)).max(1);
                assert_eq!(
                    self.step.truncate(id, new_len),
                    self.single.truncate(id, new_len)
                );
            }
            StepAction::Free(k) => {
                if self.running.is_empty() {
                    return;
                }
                let id = self.running.remove(usize::from(*k) % self.running.len());
                self.step.free(id).unwrap();
                self.single.free(id).unwrap();
            }
            StepAction::Preempt(need) => {
                let policy = PreemptPolicy {
                    mode: PreemptMode::AlwaysRecompute,
                    cost: CostModel::new(1e9, 1e4).unwrap(),
                    unschedule_below: None,
                };
                let need = usize::from(*need);
                let (r1, r2) = (
                    self.step.preempt_for(need, &policy),
                    self.single.preempt_for(need, &policy),
                );
                assert_eq!(r1.is_ok(), r2.is_ok());
                let (Ok(p1), Ok(p2)) = (r1, r2) else {
                    return;
                };
                assert_eq!(
                    p1.iter().map(|p| &p.seqs).collect::<Vec<_>>(),
                    p2.iter().map(|p| &p.seqs).collect::<Vec<_>>()
                );
                for p in p1 {
                    let PreemptAction::Recompute { tokens } = p.action else {
                        panic!("a recompute policy swapped");
                    };
                    for (id, n) in tokens {
                        let row = self.running.iter().position(|&r| r == id);
                        let admitted = self.step.admit(id, n.max(1), &mut slots).is_ok();
                        assert_eq!(
                            admitted,
                            self.single.admit(id, n.max(1), &mut slots).is_ok()
                        );
                        match row {
                            Some(row) if !admitted => {
                                self.running.remove(row);
                            }
                            None if admitted => self.running.push(id),
                            _ => {}
                        }
                    }
                }
            }
            StepAction::Defrag => {
                for kv in [&mut self.step, &mut self.single] {
                    let pending = kv
                        .plan_defragment(pagedkv::manager::DefragOptions::FULL)
                        .unwrap();
                    pending.commit().unwrap();
                }
            }
        }
    }

    fn check(&self) {
        self.step.check_invariants().unwrap();
        assert_eq!(self.step.stats(), self.single.stats());
        assert_eq!(self.step.prefix_stats(), self.single.prefix_stats());
        for &id in &self.running {
            assert_eq!(
                self.step.block_table(id).unwrap(),
                self.single.block_table(id).unwrap()
            );
            assert_eq!(
                self.step.num_computed_tokens(id).unwrap(),
                self.single.num_computed_tokens(id).unwrap()
            );
        }
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(96))]
    /// Slots, positions, offsets, copies, tables (written only where they changed)
    /// and every counter agree with per-sequence `reserve` / `commit` and
    /// `fill_padded_fixed` (a fill from scratch) after every step, through forks,
    /// truncations, frees, preemptions, defragmentations and rows changing owners.
    #[test]
    fn reserve_step_matches_per_sequence_calls(
        actions in proptest::collection::vec(step_action(), 1..80)
    ) {
        let mut p = StepPair {
            step: manager(64),
            single: manager(64),
            running: Vec::new(),
            buf: pagedkv::StepBuffers::new(ROWS, 64, WIDTH),
            next: 0,
        };
        for a in &actions {
            p.apply(a);
            p.check();
        }
    }
}

#[test]
fn refused_steps_change_nothing() {
    let mut kv = manager(8);
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 4, &mut slots).unwrap();
    kv.admit(SeqId(2), 3, &mut slots).unwrap();
    let (h1, h2) = (kv.handle(SeqId(1)).unwrap(), kv.handle(SeqId(2)).unwrap());
    let e = |seq, new_tokens, lookahead| pagedkv::StepEntry {
        seq,
        new_tokens,
        lookahead,
    };
    let mut buf = pagedkv::StepBuffers::new(2, 8, 4);
    kv.reserve_step(&[e(h1, 1, 0), e(h2, 1, 0)], &mut buf)
        .unwrap();
    kv.commit_step(&[(h1, 1), (h2, 1)]).unwrap();
    let (before, shown) = (kv.stats(), buf.clone());
    let same = |kv: &KvCache, buf: &pagedkv::StepBuffers| {
        assert_eq!(kv.stats(), before);
        assert_eq!(buf.slot_mapping(), shown.slot_mapping());
        assert_eq!(buf.tables(), shown.tables());
    };
    // Listed twice; more rows or tokens than the buffers hold; a table too wide.
    assert_eq!(
        kv.reserve_step(&[e(h1, 1, 0), e(h1, 1, 0)], &mut buf),
        Err(Error::DuplicateInBatch(SeqId(1)))
    );
    for bad in [
        vec![e(h1, 1, 0), e(h2, 1, 0), e(h2, 1, 0)],
        vec![e(h1, 5, 0), e(h2, 4, 0)],
        vec![e(h1, 12, 0)],
    ] {
        assert!(matches!(
            kv.reserve_step(&bad, &mut buf),
            Err(Error::ShapeMismatch { .. })
        ));
        same(&kv, &buf);
    }
    // Out of blocks: the arena is full and seq 1 needs a new block.
    kv.admit(SeqId(3), 5 * BS, &mut slots).unwrap();
    let full = kv.stats();
    assert!(matches!(
        kv.reserve_step(&[e(h2, 1, 0), e(h1, 4, 0)], &mut buf),
        Err(Error::OutOfBlocks { .. })
    ));
    assert_eq!(kv.stats(), full);
    assert_eq!(
        kv.context_len(SeqId(2)).unwrap(),
        4,
        "seq 2 got nothing either"
    );
    // A commit past a reservation refuses the whole step.
    kv.free(SeqId(3)).unwrap();
    kv.reserve_step(&[e(h1, 2, 0), e(h2, 1, 0)], &mut buf)
        .unwrap();
    let reserved = kv.stats();
    assert!(matches!(
        kv.commit_step(&[(h1, 2), (h2, 2)]),
        Err(Error::CommitPastReservation { .. })
    ));
    assert_eq!(kv.stats(), reserved);
    assert_eq!(kv.num_computed_tokens(SeqId(1)).unwrap(), 5);
    // Listed twice: the commits made before the second entry are taken back.
    assert_eq!(
        kv.commit_step(&[(h1, 2), (h2, 1), (h1, 2)]),
        Err(Error::DuplicateInBatch(SeqId(1)))
    );
    assert_eq!(kv.stats(), reserved);
    assert_eq!(kv.num_computed_tokens(SeqId(1)).unwrap(), 5);
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 4);
    assert_eq!(kv.context_len(SeqId(2)).unwrap(), 5);
    // And a second reservation of a reserved sequence.
    assert!(matches!(
        kv.reserve_step(&[e(h1, 1, 0)], &mut buf),
        Err(Error::SequenceState { .. })
    ));
    kv.commit_step(&[(h1, 2), (h2, 1)]).unwrap();
    // Padding below the step or past the buffers.
    assert!(buf.pad_to(1, 8).is_err());
    assert!(buf.pad_to(2, 9).is_err());
    kv.check_invariants().unwrap();
}
