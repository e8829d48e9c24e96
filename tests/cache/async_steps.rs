//! Several outstanding reservations per sequence (asynchronous scheduling): a step
//! reserved on top of steps not yet committed (`reserve_ahead`, `reserve_step_ahead`),
//! commits oldest first, a commit that rejects drafts rebasing the later reservations.
//!
//! The model-based test drives one cache with random interleavings of reservations
//! ahead (per sequence and as batch steps), commits accepting part of a reservation,
//! cancels, forks and frees, with K/V written through the slots the cache hands out at
//! each commit. After every action: every counter against the model (computed tokens,
//! context, reservations), the slots of every outstanding position unchanged since it
//! was reserved (nothing moves under a step in flight), `check_invariants`, and the
//! bytes of every computed token read back through the block table.

use crate::support::kv_bytes;

use std::collections::{BTreeMap, VecDeque};

use pagedkv::layout::Slot;
use pagedkv::{
    CopyPlan, DType, Error, GroupSpec, HostStorage, KvCache, KvLayout, ModelShape, SeqId,
    StepBuffers, StepEntry, Storage,
};
use proptest::prelude::*;

const BS: usize = 4;
const BLOCKS: usize = 40;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    KvLayout::new(shape, BS).unwrap()
}

fn cache() -> KvCache {
    KvCache::builder(layout())
        .num_blocks(BLOCKS)
        .watermark_blocks(0)
        .build()
        .unwrap()
}

#[derive(Debug, Clone)]
enum Action {
    Admit(u8),
    /// Reserve ahead for one sequence: (which, query tokens, lookahead).
    Reserve(u8, u8, u8),
    /// One batch step ahead over up to three sequences.
    Step(u8, u8),
    /// Commit the oldest reservation of one sequence, accepting a share of it.
    Commit(u8, u8),
    /// Commit the oldest reservation of every sequence holding one, in one call.
    CommitStep(u8),
    Cancel(u8),
    Fork(u8),
    Free(u8),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        1 => (0u8..12).prop_map(Action::Admit),
        4 => (any::<u8>(), 1u8..5, 0u8..3).prop_map(|(s, n, l)| Action::Reserve(s, n, l)),
        2 => (any::<u8>(), 1u8..4).prop_map(|(s, n)| Action::Step(s, n)),
        4 => (any::<u8>(), any::<u8>()).prop_map(|(s, a)| Action::Commit(s, a)),
        2 => any::<u8>().prop_map(Action::CommitStep),
        1 => any::<u8>().prop_map(Action::Cancel),
        1 => any::<u8>().prop_map(Action::Fork),
        1 => any::<u8>().prop_map(Action::Free),
    ]
}

#[derive(Debug, Clone, Default)]
struct Model {
    /// The value written for each computed position.
    values: Vec<u32>,
    /// Query tokens of the outstanding reservations, oldest first.
    queue: VecDeque<usize>,
    /// Slots of outstanding positions, as reserved.
    reserved_slots: BTreeMap<usize, Slot>,
}

impl Model {
    fn scheduled(&self) -> usize {
        self.queue.iter().sum()
    }
}

struct World {
    kv: KvCache,
    st: HostStorage,
    seqs: BTreeMap<SeqId, Model>,
    next_seq: u64,
    next_value: u32,
    step: StepBuffers,
}

impl World {
    fn new() -> Self {
        World {
            kv: cache(),
            st: HostStorage::new(layout(), BLOCKS).unwrap(),
            seqs: BTreeMap::new(),
            next_seq: 1,
            next_value: 1,
            step: StepBuffers::new(4, 64, BLOCKS),
        }
    }

    fn pick(&self, i: u8) -> Option<SeqId> {
        let n = self.seqs.len();
        (n > 0).then(|| *self.seqs.keys().nth(i as usize % n).unwrap())
    }

    fn values(&mut self, n: usize) -> Vec<u32> {
        let v: Vec<u32> = (self.next_value..self.next_value + n as u32).collect();
        self.next_value += n as u32;
        v
    }

    /// Writes the next `n` computed tokens of `seq` through the slots the cache gives
    /// for their positions now.
    fn write(&mut self, seq: SeqId, n: usize) {
        let from = self.seqs[&seq].values.len();
        let mut slots = Vec::new();
        self.kv.slots(seq, from..from + n, &mut slots).unwrap();
        let values = self.values(n);
        kv_bytes::write_values(&mut self.st, &slots, &values);
        self.seqs.get_mut(&seq).unwrap().values.extend(values);
    }

    fn record(&mut self, seq: SeqId, first: usize, slots: &[Slot]) {
        let m = self.seqs.get_mut(&seq).unwrap();
        for (i, &s) in slots.iter().enumerate() {
            m.reserved_slots.insert(first + i, s);
        }
    }

    fn after_commit(&mut self, seq: SeqId, accepted: usize) {
        let m = self.seqs.get_mut(&seq).unwrap();
        m.queue.pop_front();
        if m.queue.is_empty() {
            m.reserved_slots.clear();
        }
        let _ = accepted;
    }

    fn apply(&mut self, a: &Action) {
        let mut copies = CopyPlan::default();
        match *a {
            Action::Admit(len) => {
                let seq = SeqId(self.next_seq);
                self.next_seq += 1;
                let mut slots = Vec::new();
                if self.kv.admit(seq, len as usize, &mut slots).is_err() {
                    return;
                }
                self.seqs.insert(seq, Model::default());
                let values = self.values(len as usize);
                kv_bytes::write_values(&mut self.st, &slots, &values);
                self.seqs.get_mut(&seq).unwrap().values = values;
            }
            Action::Reserve(i, n, la) => {
                let Some(seq) = self.pick(i) else { return };
                let (n, la) = (n as usize, la as usize);
                let before = self.kv.stats();
                let mut slots = Vec::new();
                match self.kv.reserve_ahead(seq, n, la, &mut slots, &mut copies) {
                    Ok(()) => {
                        self.st.copy_blocks(&copies).unwrap();
                        let m = &self.seqs[&seq];
                        let base = m.values.len() + m.scheduled();
                        assert_eq!(slots.len(), n + la);
                        let mut now = Vec::new();
                        self.kv.slots(seq, base..base + n + la, &mut now).unwrap();
                        assert_eq!(slots, now, "{seq:?}: the slots of positions {base}..");
                        self.record(seq, base, &slots[..n]);
                        self.seqs.get_mut(&seq).unwrap().queue.push_back(n);
                    }
                    Err(Error::OutOfBlocks { .. }) | Err(Error::TooLong { .. }) => {
                        assert_eq!(self.kv.stats(), before, "a refused reservation");
                    }
                    Err(e) => panic!("reserve_ahead {seq:?}: {e}"),
                }
            }
            Action::Step(i, rows) => {
                let ids: Vec<SeqId> = (0..rows)
                    .filter_map(|r| self.pick(i.wrapping_add(r)))
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect();
                let entries: Vec<StepEntry> = ids
                    .iter()
                    .enumerate()
                    .map(|(k, &seq)| StepEntry {
                        seq: self.kv.handle(seq).unwrap(),
                        new_tokens: 1 + k % 2,
                        lookahead: k % 3,
                    })
                    .collect();
                let before = self.kv.stats();
                match self.kv.reserve_step_ahead(&entries, &mut self.step) {
                    Ok(()) => {
                        self.st.copy_blocks(self.step.copies()).unwrap();
                        let mut at = 0;
                        for (row, (&seq, e)) in ids.iter().zip(&entries).enumerate() {
                            let m = &self.seqs[&seq];
                            let base = m.values.len() + m.scheduled();
                            let n = e.new_tokens;
                            let positions = &self.step.positions()[at..at + n];
                            let want: Vec<i64> = (base..base + n).map(|p| p as i64).collect();
                            assert_eq!(positions, want, "{seq:?}: positions of row {row}");
                            assert_eq!(
                                self.step.tables().context_lens[row] as usize,
                                base + n,
                                "{seq:?}: context of row {row}"
                            );
                            let mut now = Vec::new();
                            self.kv.slots(seq, base..base + n, &mut now).unwrap();
                            let mapped: Vec<Slot> = self.step.slot_mapping()[at..at + n]
                                .iter()
                                .map(|&s| Slot(s as u64))
                                .collect();
                            assert_eq!(mapped, now, "{seq:?}: slot mapping of row {row}");
                            at += n;
                            self.record(seq, base, &now);
                            self.seqs.get_mut(&seq).unwrap().queue.push_back(n);
                        }
                    }
                    Err(Error::OutOfBlocks { .. }) | Err(Error::TooLong { .. }) => {
                        assert_eq!(self.kv.stats(), before, "a refused step");
                    }
                    Err(e) => panic!("reserve_step_ahead: {e}"),
                }
            }
            Action::Commit(i, share) => {
                let Some(seq) = self.pick(i) else { return };
                let Some(&oldest) = self.seqs[&seq].queue.front() else {
                    assert!(
                        self.kv.commit(seq, 1).is_err(),
                        "a commit with nothing reserved"
                    );
                    return;
                };
                // More than the oldest reservation is refused, even with later ones.
                let err = self.kv.commit(seq, oldest + 1).unwrap_err();
                assert!(
                    matches!(err, Error::CommitPastReservation { reserved, .. } if reserved == oldest),
                    "{err}"
                );
                let accepted = share as usize % (oldest + 1);
                self.write(seq, accepted);
                self.kv.commit(seq, accepted).unwrap();
                self.after_commit(seq, accepted);
            }
            Action::CommitStep(share) => {
                let mut accepted = Vec::new();
                let seqs: Vec<SeqId> = self.seqs.keys().copied().collect();
                for seq in seqs {
                    if let Some(&oldest) = self.seqs[&seq].queue.front() {
                        let a = (share as usize + seq.0 as usize) % (oldest + 1);
                        self.write(seq, a);
                        accepted.push((self.kv.handle(seq).unwrap(), a));
                        self.after_commit(seq, a);
                    }
                }
                self.kv.commit_step(&accepted).unwrap();
            }
            Action::Cancel(i) => {
                let Some(seq) = self.pick(i) else { return };
                self.kv.cancel(seq).unwrap();
                let m = self.seqs.get_mut(&seq).unwrap();
                m.queue.clear();
                m.reserved_slots.clear();
            }
            Action::Fork(i) => {
                let Some(parent) = self.pick(i) else { return };
                let child = SeqId(self.next_seq);
                let busy = !self.seqs[&parent].queue.is_empty();
                match self.kv.fork(parent, child) {
                    Ok(()) => {
                        assert!(!busy, "a fork of a sequence mid-step");
                        self.next_seq += 1;
                        let values = self.seqs[&parent].values.clone();
                        self.seqs.insert(
                            child,
                            Model {
                                values,
                                ..Model::default()
                            },
                        );
                    }
                    Err(Error::SequenceState { .. }) => assert!(busy),
                    Err(e) => panic!("fork: {e}"),
                }
            }
            Action::Free(i) => {
                let Some(seq) = self.pick(i) else { return };
                self.kv.free(seq).unwrap();
                self.seqs.remove(&seq);
            }
        }
    }

    fn check(&self) {
        self.kv.check_invariants().unwrap();
        for (&seq, m) in &self.seqs {
            let computed = m.values.len();
            assert_eq!(
                self.kv.num_computed_tokens(seq).unwrap(),
                computed,
                "{seq:?}"
            );
            assert_eq!(
                self.kv.context_len(seq).unwrap(),
                computed + m.scheduled(),
                "{seq:?}: context"
            );
            assert_eq!(
                self.kv.num_reservations(seq).unwrap(),
                m.queue.len(),
                "{seq:?}"
            );
            for (&pos, &slot) in &m.reserved_slots {
                let mut now = Vec::new();
                self.kv.slots(seq, pos..pos + 1, &mut now).unwrap();
                assert_eq!(now[0], slot, "{seq:?}: position {pos} moved mid-step");
            }
            let table = self.kv.block_table(seq).unwrap();
            assert_eq!(
                kv_bytes::check_values(&self.st, table, &m.values),
                Ok(()),
                "{seq:?}: computed K/V"
            );
        }
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(96))]

    #[test]
    fn reservations_ahead_match_the_model(actions in proptest::collection::vec(action(), 1..150)) {
        let mut w = World::new();
        for a in &actions {
            w.apply(a);
            w.check();
        }
    }
}

fn admitted(len: usize) -> KvCache {
    let mut kv = cache();
    kv.admit(SeqId(1), len, &mut Vec::new()).unwrap();
    kv
}

#[test]
fn a_second_reservation_needs_the_call_that_stacks() {
    let mut kv = admitted(6);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    kv.reserve(SeqId(1), 2, 0, &mut slots, &mut copies).unwrap();
    let before = (kv.stats(), kv.context_len(SeqId(1)).unwrap());
    // `reserve` refuses (a scheduler that forgot to commit), as before.
    let err = kv
        .reserve(SeqId(1), 1, 0, &mut slots, &mut copies)
        .unwrap_err();
    assert!(matches!(err, Error::SequenceState { .. }), "{err}");
    // So do ids with a reservation ahead, and a reservation ahead of nothing.
    let mut step = StepBuffers::new(4, 16, 8);
    let h = kv.handle(SeqId(1)).unwrap();
    let e = [StepEntry {
        seq: h,
        new_tokens: 1,
        lookahead: 0,
    }];
    assert!(matches!(
        kv.reserve_step_tokens(&e, &[7], &mut step),
        Err(Error::SequenceState { .. })
    ));
    assert!(matches!(
        kv.reserve_ahead(SeqId(1), 0, 1, &mut slots, &mut copies),
        Err(Error::SequenceState { .. })
    ));
    assert_eq!((kv.stats(), kv.context_len(SeqId(1)).unwrap()), before);
    assert_eq!(kv.num_reservations(SeqId(1)).unwrap(), 1);
    kv.check_invariants().unwrap();
}

#[test]
fn a_rejected_draft_rebases_the_next_reservation() {
    let mut kv = admitted(6);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    kv.reserve(SeqId(1), 3, 0, &mut slots, &mut copies).unwrap(); // positions 6..9
    kv.reserve_ahead(SeqId(1), 2, 1, &mut slots, &mut copies)
        .unwrap(); // 9..11, + 11
    let mut want = Vec::new();
    kv.slots(SeqId(1), 9..12, &mut want).unwrap();
    assert_eq!(slots, want);
    assert_eq!(kv.context_len(SeqId(1)).unwrap(), 11);
    kv.commit(SeqId(1), 1).unwrap(); // two drafts rejected: the next step starts at 7
    assert_eq!(kv.num_computed_tokens(SeqId(1)).unwrap(), 7);
    assert_eq!(kv.context_len(SeqId(1)).unwrap(), 9);
    assert_eq!(kv.num_reservations(SeqId(1)).unwrap(), 1);
    // Its 2 tokens commit in full (the allocated slots still cover them).
    kv.commit(SeqId(1), 2).unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(1)).unwrap(), 9);
    assert_eq!(kv.num_reservations(SeqId(1)).unwrap(), 0);
    kv.check_invariants().unwrap();
}

#[test]
fn cancel_drops_every_reservation_and_movers_wait_for_it() {
    let mut kv = admitted(5);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    for _ in 0..3 {
        kv.reserve_ahead(SeqId(1), 2, 0, &mut slots, &mut copies)
            .unwrap();
    }
    assert_eq!(kv.num_reservations(SeqId(1)).unwrap(), 3);
    assert_eq!(kv.context_len(SeqId(1)).unwrap(), 11);
    // One commit still leaves the sequence mid-step: movers refuse it.
    kv.commit(SeqId(1), 2).unwrap();
    assert!(matches!(
        kv.fork(SeqId(1), SeqId(2)),
        Err(Error::SequenceState { .. })
    ));
    assert!(matches!(
        kv.truncate(SeqId(1), 3),
        Err(Error::SequenceState { .. })
    ));
    kv.cancel(SeqId(1)).unwrap();
    assert_eq!(kv.num_reservations(SeqId(1)).unwrap(), 0);
    assert_eq!(kv.context_len(SeqId(1)).unwrap(), 7);
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    kv.check_invariants().unwrap();
}

/// On a hybrid cache the per-sequence reservation ahead is `reserve_ahead_grouped`
/// (the one-group `reserve_ahead`, with one slot list, refuses by name). In every group
/// it hands out the slots of the positions after the outstanding reservations, through
/// the group's table, as many slots and copies as the batch step ahead does on a twin
/// cache (which may pick other pages), through window releases and rebasing commits.
#[test]
fn a_hybrid_reservation_ahead_per_sequence_matches_the_batch_step() {
    let l = layout();
    let specs = [GroupSpec::full(l), GroupSpec::window(l, 8)];
    let mut kv = KvCache::hybrid(&specs, 48).unwrap();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    let err = kv
        .reserve_ahead(SeqId(1), 1, 0, &mut slots, &mut copies)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotOnHybrid {
                operation: "reserve_ahead",
                ..
            }
        ),
        "{err}"
    );
    let mut twin = KvCache::hybrid(&specs, 48).unwrap();
    let mut step = pagedkv::GroupStep::default();
    kv.admit_grouped(SeqId(1), 10, &mut step).unwrap();
    twin.admit_grouped(SeqId(1), 10, &mut step).unwrap();
    let h = twin.handle(SeqId(1)).unwrap();
    let mut bufs = [StepBuffers::new(4, 16, 16), StepBuffers::new(4, 16, 16)];
    // (new tokens, lookahead, accepted at the commit of the oldest reservation).
    let steps = [
        (3, 0, 3),
        (2, 1, 1),
        (4, 0, 4),
        (1, 2, 0),
        (3, 0, 2),
        (2, 0, 2),
    ];
    for (i, &(n, lookahead, accepted)) in steps.iter().enumerate() {
        let base = kv.context_len(SeqId(1)).unwrap();
        kv.reserve_ahead_grouped(SeqId(1), n, lookahead, &mut step)
            .unwrap();
        let e = [StepEntry {
            seq: h,
            new_tokens: n,
            lookahead,
        }];
        twin.reserve_step_ahead_grouped(&e, &mut bufs).unwrap();
        for (g, b) in bufs.iter().enumerate() {
            let table = kv.group(g).block_table(SeqId(1)).unwrap();
            let want: Vec<u64> = (base..base + n + lookahead)
                .map(|p| u64::from(table[p / BS].0) * BS as u64 + (p % BS) as u64)
                .collect();
            let got: Vec<u64> = step.slots[g].iter().map(|s| s.0).collect();
            assert_eq!(got, want, "step {i} group {g}: slots through the table");
            // The batch's slot mapping holds the query tokens; lookahead slots are
            // the per-sequence call's tail.
            assert_eq!(n, b.slot_mapping().len(), "step {i} group {g}");
            assert_eq!(
                step.copies[g].copies().len(),
                b.copies().copies().len(),
                "step {i} group {g}"
            );
        }
        assert_eq!(
            kv.num_reservations(SeqId(1)),
            twin.num_reservations(SeqId(1))
        );
        kv.check_invariants().unwrap();
        // Every other step, the oldest reservation commits (some drafts rejected), so
        // the next reservation goes on top of one still outstanding.
        if i % 2 == 1 {
            kv.commit(SeqId(1), accepted).unwrap();
            twin.commit_step(&[(h, accepted)]).unwrap();
            assert_eq!(
                kv.num_computed_tokens(SeqId(1)),
                twin.num_computed_tokens(SeqId(1))
            );
            assert_eq!(kv.context_len(SeqId(1)), twin.context_len(SeqId(1)));
            kv.check_invariants().unwrap();
        }
    }
    for g in 0..2 {
        assert_eq!(
            kv.group(g).block_table(SeqId(1)).unwrap().len(),
            twin.group(g).block_table(SeqId(1)).unwrap().len(),
            "group {g}"
        );
    }
    assert_eq!(
        kv.group_stats().used_per_group,
        twin.group_stats().used_per_group
    );
    // A stacked reservation of no query token is refused before any page moves.
    let snapshot = crate::support::snapshot::groups_snapshot;
    let before = snapshot(&kv);
    assert!(matches!(
        kv.reserve_ahead_grouped(SeqId(1), 0, 8, &mut step),
        Err(Error::SequenceState { .. })
    ));
    // More than the arena holds: refused, nothing changed.
    assert!(matches!(
        kv.reserve_ahead_grouped(SeqId(1), 200, 0, &mut step),
        Err(Error::OutOfBlocks { .. } | Error::TooLong { .. })
    ));
    assert_eq!(snapshot(&kv), before);
    kv.cancel(SeqId(1)).unwrap();
    assert_eq!(kv.num_reservations(SeqId(1)).unwrap(), 0);
    kv.check_invariants().unwrap();
}

/// Priority preemption that unschedules a sequence cancels every reservation it holds,
/// so the swap (or recompute) that follows takes it whole.
#[test]
fn unscheduling_a_sequence_cancels_its_reservations_ahead() {
    use pagedkv::manager::preempt::{CostModel, PreemptMode};
    use pagedkv::{PreemptPolicy, TierConfig};
    let mut kv = KvCache::builder(layout())
        .num_blocks(5)
        .watermark_blocks(0)
        .tiers(TierConfig {
            num_host_blocks: 8,
            num_disk_slots: 0,
        })
        .build()
        .unwrap();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    kv.admit(SeqId(1), 12, &mut slots).unwrap(); // 3 full blocks
    kv.admit(SeqId(2), 5, &mut slots).unwrap(); // 2 blocks: the arena is full
    kv.set_preempt_priority(SeqId(1), 5).unwrap();
    kv.set_preempt_priority(SeqId(2), 1).unwrap();
    kv.reserve(SeqId(2), 1, 0, &mut slots, &mut copies).unwrap();
    kv.reserve_ahead(SeqId(2), 2, 0, &mut slots, &mut copies)
        .unwrap();
    let policy = PreemptPolicy {
        mode: PreemptMode::AlwaysSwap,
        cost: CostModel::new(1e9, 1e4).unwrap(),
        unschedule_below: None,
    }
    .unscheduling_below(5);
    let need = kv.blocks_needed(SeqId(1), 1, 0).unwrap();
    let out = kv.preempt_for(need, &policy).unwrap();
    assert_eq!(out[0].unscheduled, vec![SeqId(2)]);
    let pagedkv::manager::preempt::PreemptAction::Swap(job) = &out[0].action else {
        panic!("{:?}", out[0].action)
    };
    kv.complete_swap(job.ticket).unwrap();
    assert!(kv.is_swapped(SeqId(2)));
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 5);
    kv.check_invariants().unwrap();
}

/// On a hybrid cache the step ahead goes on top in every group at once, commits take it
/// oldest first in every group, and a rejected draft rebases it in every group.
#[test]
fn a_hybrid_step_ahead_stacks_and_rebases_in_every_group() {
    let l = layout();
    let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::window(l, 8)], 48).unwrap();
    kv.admit_grouped(SeqId(1), 10, &mut pagedkv::GroupStep::default())
        .unwrap();
    let h = kv.handle(SeqId(1)).unwrap();
    let mut n = [StepBuffers::new(4, 16, 16), StepBuffers::new(4, 16, 16)];
    let mut n1 = [StepBuffers::new(4, 16, 16), StepBuffers::new(4, 16, 16)];
    let e = |k| {
        [StepEntry {
            seq: h,
            new_tokens: k,
            lookahead: 0,
        }]
    };
    kv.reserve_step_grouped(&e(3), &mut n).unwrap(); // positions 10..13
                                                     // The plain step refuses a second reservation; the step ahead stacks it.
    assert!(matches!(
        kv.reserve_step_grouped(&e(1), &mut n1),
        Err(Error::SequenceState { .. })
    ));
    kv.reserve_step_ahead_grouped(&e(2), &mut n1).unwrap(); // 13..15
    for (g, buffers) in n1.iter().enumerate() {
        assert_eq!(buffers.positions(), &[13, 14], "group {g}");
        assert_eq!(buffers.tables().context_lens, vec![15], "group {g}");
    }
    assert_eq!(kv.num_reservations(SeqId(1)).unwrap(), 2);
    kv.check_invariants().unwrap();
    kv.commit_step(&[(h, 1)]).unwrap(); // two drafts rejected: step N+1 now at 11..13
    assert_eq!(kv.num_computed_tokens(SeqId(1)).unwrap(), 11);
    assert_eq!(kv.context_len(SeqId(1)).unwrap(), 13);
    kv.check_invariants().unwrap();
    kv.commit_step(&[(h, 2)]).unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(1)).unwrap(), 13);
    assert_eq!(kv.num_reservations(SeqId(1)).unwrap(), 0);
    kv.check_invariants().unwrap();
}
