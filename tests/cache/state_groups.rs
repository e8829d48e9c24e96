//! Recurrent-state groups (`GroupSpec::state`) beside an attention group, over one
//! arena and one `HostStorage`:
//!
//! * configuration errors; a sequence holds exactly the state pages from admission to
//!   free, whatever its length (appends, reservations and batch steps take none; the
//!   step's state rows are the state pages);
//! * a fork copies the state (the copy plan run on the storage), never shares it: the
//!   child's state changes, the parent's bytes stay;
//! * swap out and in carry the state byte for byte; recompute preemption frees it;
//! * truncation below the computed tokens and the plain fork are refused; a
//!   prefix hit without a checkpoint is cut to 0, never answered wrongly; every
//!   failed call changes nothing;
//! * checkpoints: a hit resumes at the deepest position where the attention groups'
//!   chain and a checkpoint agree, the checkpoint's bytes copied into the new state;
//!   checkpoints survive compaction and are evicted least recently used first;
//! * a model-based property test: every sequence's state and K/V bytes against a
//!   shadow after every action (admit, append, state step, fork, free, swap,
//!   compaction);
//! * the page waste of real hybrid models' states (`page_waste`, printed).

use pagedkv::layout::Slot;
use pagedkv::manager::preempt::{CostModel, PreemptMode};
use pagedkv::{
    AdmitOptions, BlockId, DType, Error, GroupSpec, GroupStep, HostStorage, KvCache, KvLayout,
    ModelShape, PreemptPolicy, SeqId, StepBuffers, StepEntry, Storage,
};
use proptest::prelude::*;

// The fixture `state_export.rs` shares.
pub(crate) const HEAD_DIM: usize = 2;
pub(crate) const BS: usize = 4;
pub(crate) const LAYERS: usize = 2;
pub(crate) const STATE_PAGES: usize = 3;

pub(crate) fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: LAYERS,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: HEAD_DIM,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, BS).unwrap()
}

fn specs() -> [GroupSpec; 2] {
    [
        GroupSpec::full(layout()),
        GroupSpec::state(layout(), STATE_PAGES),
    ]
}

/// Every group's state, in full.
fn snapshot(kv: &KvCache) -> Vec<String> {
    let mut out: Vec<String> = (0..kv.num_groups())
        .map(|g| format!("{:?}", kv.group(g)))
        .collect();
    out.push(format!("{:?}", kv.group_stats()));
    out.push(format!("{:?}", kv.tier_stats()));
    out
}

fn f32_bytes(vals: impl Iterator<Item = f32>) -> Vec<u8> {
    vals.flat_map(|x| x.to_le_bytes()).collect()
}

/// Every slot of `pages`, in order.
fn page_slots(pages: &[BlockId]) -> Vec<Slot> {
    pages
        .iter()
        .flat_map(|p| (0..BS).map(move |o| Slot(p.0 as u64 * BS as u64 + o as u64)))
        .collect()
}

/// The state value `tag` puts at element `i` of layer `layer` (exact in f32).
fn state_value(tag: u64, layer: usize, i: usize) -> f32 {
    (tag as usize * 10_000 + layer * 1_000 + i) as f32 + 0.5
}

/// Writes a state tagged `tag` into every layer slot of the state pages `pages`.
fn write_state(store: &mut HostStorage, pages: &[BlockId], tag: u64) {
    let slots = page_slots(pages);
    for layer in 0..LAYERS {
        let vals = |sign: f32| {
            f32_bytes((0..slots.len() * HEAD_DIM).map(move |i| sign * state_value(tag, layer, i)))
        };
        store
            .write_slots(layer, &slots, &vals(1.0), &vals(-1.0))
            .unwrap();
    }
}

/// Every byte of the state pages `pages`, all layers, K and V halves.
fn read_pages(store: &HostStorage, pages: &[BlockId]) -> Vec<u8> {
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        let mut k = vec![0u8; pages.len() * BS * HEAD_DIM * 4];
        let mut v = k.clone();
        store
            .read_tokens(layer, pages, pages.len() * BS, &mut k, &mut v)
            .unwrap();
        out.extend(k);
        out.extend(v);
    }
    out
}

/// The bytes a state tagged `tag` has in `n` pages.
fn state_bytes(tag: u64, n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        for sign in [1.0f32, -1.0] {
            out.extend(f32_bytes(
                (0..n * BS * HEAD_DIM).map(|i| sign * state_value(tag, layer, i)),
            ));
        }
    }
    out
}

fn state_pages(kv: &KvCache, seq: SeqId) -> Vec<BlockId> {
    kv.group(1).block_table(seq).unwrap().to_vec()
}

#[test]
fn config_errors() {
    let l = layout();
    let bad = |specs: &[GroupSpec], pages| {
        let e = KvCache::hybrid(specs, pages);
        assert!(matches!(e, Err(Error::InvalidConfig { .. })), "{e:?}");
    };
    // Group 0 answers for the tokens: it cannot be a state group.
    bad(&[GroupSpec::state(l, 1), GroupSpec::full(l)], 8);
    bad(&[GroupSpec::full(l), GroupSpec::state(l, 0)], 8);
    bad(&[GroupSpec::full(l), GroupSpec::state(l, 9)], 8);
    let both = GroupSpec {
        window: Some(8),
        ..GroupSpec::state(l, 1)
    };
    bad(&[GroupSpec::full(l), both], 8);
    assert!(matches!(
        GroupSpec::state_for_bytes(l, 0),
        Err(Error::InvalidConfig { .. })
    ));
    // Page sizing: whole pages, the padding of the last one is the waste.
    let page = l.block_bytes() as u64;
    let s = GroupSpec::state_for_bytes(l, 2 * page + 1).unwrap();
    assert_eq!(s.state_pages, Some(3));
    assert_eq!(s.state_waste_bytes(2 * page + 1), page - 1);
    let s = GroupSpec::state_for_bytes(l, 2 * page).unwrap();
    assert_eq!((s.state_pages, s.state_waste_bytes(2 * page)), (Some(2), 0));
    assert_eq!(GroupSpec::full(l).state_waste_bytes(5), 0);
    let kv = KvCache::hybrid(&specs(), 8).unwrap();
    assert_eq!(kv.group_state_pages(1), Some(STATE_PAGES));
    assert_eq!(kv.group_state_pages(0), None);
    assert_eq!(kv.group_state_pages(7), None);
}

#[test]
fn a_sequence_holds_its_state_pages_from_admission_to_free_whatever_its_length() {
    let mut kv = KvCache::hybrid_with_host_tier(&specs(), 32, 16).unwrap();
    let mut step = GroupStep::default();
    // 5 tokens: 2 KV pages, and the 3 state pages; 100 tokens: 25 and 3.
    assert_eq!(kv.admission_blocks(5), 2 + STATE_PAGES);
    assert_eq!(kv.admission_blocks(100), 25 + STATE_PAGES);
    assert!(kv.can_admit(10));
    kv.admit_grouped(SeqId(1), 10, &mut step).unwrap();
    assert_eq!(step.slots[0].len(), 10);
    assert!(step.slots[1].is_empty() && step.copies[1].is_empty());
    assert_eq!(kv.group_stats().used_per_group, vec![3, STATE_PAGES]);
    let state = state_pages(&kv, SeqId(1));
    assert_eq!(state.len(), STATE_PAGES);
    kv.check_invariants().unwrap();

    // Appends, reservations and commits take no state page.
    for _ in 0..30 {
        kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
        assert!(step.slots[1].is_empty());
        assert_eq!(step.slots[0].len(), 1);
    }
    assert_eq!(kv.blocks_needed(SeqId(1), 8, 4).unwrap(), 3); // KV only: 40 -> 52
    kv.reserve_grouped(SeqId(1), 8, 4, &mut step).unwrap();
    assert!(step.slots[1].is_empty());
    kv.commit(SeqId(1), 5).unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(1)).unwrap(), 45);
    // Truncation past the computed tokens (the lookahead slots) is allowed.
    kv.truncate(SeqId(1), 45).unwrap();
    assert_eq!(
        kv.group_stats().used_per_group,
        vec![45usize.div_ceil(BS), STATE_PAGES]
    );
    assert_eq!(state_pages(&kv, SeqId(1)), state);
    kv.check_invariants().unwrap();

    // The batch step: the state group's row is the state pages, no slot is written
    // there, and its rows, positions and context lengths are group 0's.
    kv.admit_grouped(SeqId(2), 3, &mut step).unwrap();
    let mut bufs: Vec<StepBuffers> = (0..2).map(|_| StepBuffers::new(4, 32, 16)).collect();
    let (a, b) = (kv.handle(SeqId(1)).unwrap(), kv.handle(SeqId(2)).unwrap());
    let entries = [
        StepEntry {
            seq: a,
            new_tokens: 1,
            lookahead: 0,
        },
        StepEntry {
            seq: b,
            new_tokens: 6,
            lookahead: 0,
        },
    ];
    let used_before = kv.group_stats().used_per_group[1];
    kv.reserve_step_grouped(&entries, &mut bufs).unwrap();
    assert_eq!(kv.group_stats().used_per_group[1], used_before);
    assert_eq!(bufs[1].slot_mapping(), &[-1i64; 7][..]);
    assert_eq!(bufs[1].positions(), bufs[0].positions());
    assert_eq!(bufs[1].query_start_loc(), bufs[0].query_start_loc());
    assert_eq!(bufs[1].tables().context_lens, bufs[0].tables().context_lens);
    assert_eq!(bufs[1].unpadded(), bufs[0].unpadded());
    assert!(bufs[1].copies().is_empty());
    let t = bufs[1].tables();
    for (row, seq) in [SeqId(1), SeqId(2)].into_iter().enumerate() {
        let want: Vec<u32> = state_pages(&kv, seq).iter().map(|p| p.0).collect();
        assert_eq!(
            &t.tables[row * t.max_blocks..row * t.max_blocks + STATE_PAGES],
            &want[..]
        );
    }
    kv.commit_step(&[(a, 1), (b, 6)]).unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 9);
    // A table narrower than the state is refused before anything changes.
    let before = snapshot(&kv);
    let mut narrow = vec![StepBuffers::new(4, 32, 16), StepBuffers::new(4, 32, 2)];
    assert!(matches!(
        kv.reserve_step_grouped(&entries, &mut narrow),
        Err(Error::ShapeMismatch { .. })
    ));
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();

    // Free returns every page.
    kv.free(SeqId(1)).unwrap();
    kv.free(SeqId(2)).unwrap();
    let st = kv.group_stats();
    assert_eq!((st.used_pages, st.free_pages, st.num_sequences), (0, 32, 0));
    assert_eq!(kv.stats().used_blocks, 0);
    kv.check_invariants().unwrap();
}

#[test]
fn fork_copies_the_state_and_the_parent_keeps_its_bytes() {
    let mut kv = KvCache::hybrid_with_host_tier(&specs(), 32, 16).unwrap();
    let mut store = HostStorage::with_host_tier(layout(), 32, 16).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 8, &mut step).unwrap();
    let parent = state_pages(&kv, SeqId(1));
    write_state(&mut store, &parent, 1);

    kv.fork_grouped(SeqId(1), SeqId(2), &mut step).unwrap();
    // The KV group shares (no copy yet); the state group copies every page.
    assert!(step.copies[0].is_empty());
    assert_eq!(
        kv.group(0).block_table(SeqId(2)).unwrap(),
        kv.group(0).block_table(SeqId(1)).unwrap()
    );
    let child = state_pages(&kv, SeqId(2));
    assert_eq!(child.len(), STATE_PAGES);
    assert!(
        child.iter().all(|p| !parent.contains(p)),
        "{child:?} {parent:?}"
    );
    let pairs: Vec<(BlockId, BlockId)> = step.copies[1]
        .copies()
        .iter()
        .map(|c| (c.src, c.dst))
        .collect();
    let want: Vec<(BlockId, BlockId)> = parent.iter().copied().zip(child.clone()).collect();
    assert_eq!(pairs, want);
    assert_eq!(kv.group_stats().used_per_group, vec![2, 2 * STATE_PAGES]);
    for copies in &step.copies {
        store.copy_blocks(copies).unwrap();
    }
    assert_eq!(read_pages(&store, &child), state_bytes(1, STATE_PAGES));
    kv.check_invariants().unwrap();

    // The child's next step rewrites its state; the parent's stays.
    write_state(&mut store, &child, 2);
    assert_eq!(read_pages(&store, &parent), state_bytes(1, STATE_PAGES));
    assert_eq!(read_pages(&store, &child), state_bytes(2, STATE_PAGES));
    // Both go on decoding; the forks stay in one fork group for preemption.
    kv.append_grouped(SeqId(2), 1, &mut step).unwrap();
    kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
    assert_eq!(state_pages(&kv, SeqId(1)), parent);
    kv.check_invariants().unwrap();

    // The plain fork returns no copies: refused on a cache with a state group.
    let before = snapshot(&kv);
    assert!(matches!(
        kv.fork(SeqId(1), SeqId(3)),
        Err(Error::NotOnHybrid { groups: 2, .. })
    ));
    assert_eq!(snapshot(&kv), before);

    // Free the parent: the child's state stays whole.
    kv.free(SeqId(1)).unwrap();
    assert_eq!(read_pages(&store, &child), state_bytes(2, STATE_PAGES));
    kv.free(SeqId(2)).unwrap();
    assert_eq!(kv.group_stats().used_pages, 0);
    kv.check_invariants().unwrap();
}

#[test]
fn swap_out_and_in_carry_the_state_byte_for_byte() {
    let (pages, host) = (12, 12);
    let mut kv = KvCache::hybrid_with_host_tier(&specs(), pages, host).unwrap();
    let mut store = HostStorage::with_host_tier(layout(), pages, host).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 7, &mut step).unwrap();
    let state = state_pages(&kv, SeqId(1));
    write_state(&mut store, &state, 7);

    let job = kv.swap_out_grouped(SeqId(1)).unwrap();
    assert_eq!(job.plans[1].len(), STATE_PAGES);
    for p in &job.plans {
        store.swap(p).unwrap();
    }
    kv.complete_swap_grouped(&job).unwrap();
    assert_eq!(kv.group_stats().used_pages, 0);
    assert_eq!(kv.tier_stats().host_used_blocks, 2 + STATE_PAGES);
    kv.check_invariants().unwrap();

    // Another sequence takes the arena and overwrites every page it gets.
    kv.admit_grouped(SeqId(2), 4 * BS, &mut step).unwrap();
    let other = state_pages(&kv, SeqId(2));
    write_state(&mut store, &other, 9);
    let kv_pages = kv.group(0).block_table(SeqId(2)).unwrap().to_vec();
    write_state(&mut store, &kv_pages, 9);
    // Not enough left for the swap-in: refused, nothing changed.
    kv.admit_grouped(SeqId(3), BS, &mut step).unwrap();
    let before = snapshot(&kv);
    assert!(matches!(
        kv.swap_in_grouped(SeqId(1)),
        Err(Error::OutOfBlocks { needed: 5, free: 1 })
    ));
    assert_eq!(snapshot(&kv), before);
    kv.free(SeqId(3)).unwrap();

    let job = kv.swap_in_grouped(SeqId(1)).unwrap();
    for p in &job.plans {
        store.swap(p).unwrap();
    }
    kv.complete_swap_grouped(&job).unwrap();
    let back = state_pages(&kv, SeqId(1));
    assert_eq!(back.len(), STATE_PAGES);
    assert_eq!(read_pages(&store, &back), state_bytes(7, STATE_PAGES));
    assert_eq!(read_pages(&store, &other), state_bytes(9, STATE_PAGES));
    kv.check_invariants().unwrap();

    // Recompute preemption frees the state pages with the KV pages.
    let policy = PreemptPolicy {
        mode: PreemptMode::AlwaysRecompute,
        ..PreemptPolicy::cost_based(CostModel::new(1e9, 1e4).unwrap())
    };
    let free = kv.group_stats().free_pages;
    let p = kv.preempt_for(free + 1, &policy).unwrap();
    let freed: usize = p.iter().map(|p| p.blocks_freed).sum();
    assert_eq!(kv.group_stats().free_pages, free + freed);
    assert!(p.iter().any(|p| p.blocks_freed > STATE_PAGES));
    kv.check_invariants().unwrap();
    for id in kv.sequence_ids().collect::<Vec<_>>() {
        kv.free(id).unwrap();
    }
    assert_eq!(kv.group_stats().used_pages, 0);
    kv.check_invariants().unwrap();
}

#[test]
fn failed_calls_change_nothing_and_refusals_are_typed() {
    // 8 pages: one 2-page sequence (2 KV + 3 state = 5) leaves 3.
    let mut kv = KvCache::hybrid_with_host_tier(&specs(), 8, 4).unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 2 * BS, &mut step).unwrap();
    let before = snapshot(&kv);

    // Admission: its KV page fits, its state does not.
    assert!(!kv.can_admit(1));
    assert!(matches!(
        kv.admit_grouped(SeqId(2), 1, &mut step),
        Err(Error::OutOfBlocks { needed: 4, free: 3 })
    ));
    assert_eq!(snapshot(&kv), before);
    let opts = AdmitOptions::default();
    assert!(matches!(
        kv.admit_tokens_grouped(SeqId(2), &[1], &opts, &mut step),
        Err(Error::OutOfBlocks { needed: 4, free: 3 })
    ));
    assert_eq!(snapshot(&kv), before);
    // The chunked admission reserves no token but takes the state: 3 of 3 fit.
    kv.admit_prompt_grouped(SeqId(2), &[1], &opts).unwrap();
    assert_eq!(kv.group_stats().used_per_group, vec![2, 2 * STATE_PAGES]);
    kv.free(SeqId(2)).unwrap();

    // Fork: the child's state needs 3 pages; take 1 first so 2 are left.
    kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
    let before_fork = snapshot(&kv);
    assert!(matches!(
        kv.fork_grouped(SeqId(1), SeqId(2), &mut step),
        Err(Error::OutOfBlocks { needed: 3, free: 2 })
    ));
    assert_eq!(snapshot(&kv), before_fork);
    assert!(matches!(
        kv.fork_grouped(SeqId(9), SeqId(2), &mut step),
        Err(Error::UnknownSequence(SeqId(9)))
    ));
    assert!(matches!(
        kv.fork_grouped(SeqId(1), SeqId(1), &mut step),
        Err(Error::DuplicateSequence(SeqId(1)))
    ));
    assert_eq!(snapshot(&kv), before_fork);

    // Truncation below the computed tokens would roll the state back.
    assert_eq!(
        kv.truncate(SeqId(1), 3),
        Err(Error::StateRollback {
            seq: SeqId(1),
            computed: 2 * BS + 1,
            new_len: 3
        })
    );
    assert_eq!(snapshot(&kv), before_fork);
    // A fork with a reservation outstanding is refused as in a KV cache.
    kv.reserve_grouped(SeqId(1), 1, 0, &mut step).unwrap();
    let reserved = snapshot(&kv);
    assert!(matches!(
        kv.fork_grouped(SeqId(1), SeqId(2), &mut step),
        Err(Error::SequenceState { .. })
    ));
    assert_eq!(snapshot(&kv), reserved);
    kv.commit(SeqId(1), 1).unwrap();

    // Export carries the state (tests/state_export.rs); a short buffer is refused.
    let store = HostStorage::with_host_tier(layout(), 8, 4).unwrap();
    assert!(matches!(
        pagedkv::export::groups::export_group_sequence(&kv, &store, SeqId(1), None, &mut []),
        Err(Error::ShapeMismatch { .. })
    ));
    kv.check_invariants().unwrap();
}

#[test]
fn without_a_checkpoint_a_state_group_serves_no_prefix_hit() {
    let opts = AdmitOptions::default();
    let prompt: Vec<u32> = (0..4 * BS as u32).collect();
    // The control: the same attention group alone serves the hit.
    let mut plain =
        KvCache::hybrid(&[GroupSpec::full(layout()), GroupSpec::full(layout())], 32).unwrap();
    let mut step = GroupStep::default();
    plain
        .admit_tokens_grouped(SeqId(1), &prompt, &opts, &mut step)
        .unwrap();
    let a = plain
        .admit_tokens_grouped(SeqId(2), &prompt, &opts, &mut step)
        .unwrap();
    assert_eq!(a.cached_tokens, 3 * BS);

    let mut kv = KvCache::hybrid(&specs(), 32).unwrap();
    let a = kv
        .admit_tokens_grouped(SeqId(1), &prompt, &opts, &mut step)
        .unwrap();
    assert_eq!(a.cached_tokens, 0);
    assert_eq!(a.new_blocks, 4 + STATE_PAGES);
    assert_eq!(step.slots[0].len(), prompt.len());
    assert!(step.slots[1].is_empty());
    // The attention group registered its blocks, but no hit resumes a state.
    assert_eq!(kv.cached_prefix_len(&prompt, &opts).unwrap(), 0);
    let a = kv
        .admit_tokens_grouped(SeqId(2), &prompt, &opts, &mut step)
        .unwrap();
    assert_eq!(a.cached_tokens, 0);
    assert_eq!(step.slots[0].len(), prompt.len());
    // Chunked prefill: the same, and token ids appended never reach the state group.
    let a = kv.admit_prompt_grouped(SeqId(3), &prompt, &opts).unwrap();
    assert_eq!(a.cached_tokens, 0);
    assert_eq!(kv.group_stats().used_per_group[1], 3 * STATE_PAGES);
    kv.reserve_grouped(SeqId(3), prompt.len(), 0, &mut step)
        .unwrap();
    kv.commit(SeqId(3), prompt.len()).unwrap();
    kv.append_tokens_grouped(SeqId(3), &[7; BS], &mut step)
        .unwrap();
    kv.add_token_ids(SeqId(3), prompt.len() + BS, &[1, 2])
        .unwrap();
    assert_eq!(kv.group(1).pool().num_cached(), 0);
    for id in [1, 2, 3] {
        kv.free(SeqId(id)).unwrap();
    }
    assert_eq!(kv.cached_prefix_len(&prompt, &opts).unwrap(), 0);
    kv.check_invariants().unwrap();
}

/// Runs every copy plan of `step` on `store`.
fn run_copies(store: &mut HostStorage, step: &GroupStep) {
    for c in &step.copies {
        store.copy_blocks(c).unwrap();
    }
}

#[test]
fn checkpoints_serve_hits_at_the_deepest_agreed_position_with_the_state_bytes() {
    let pages = 32;
    let mut kv = KvCache::hybrid_with_host_tier(&specs(), pages, 8).unwrap();
    let mut store = HostStorage::with_host_tier(layout(), pages, 8).unwrap();
    let mut step = GroupStep::default();
    let opts = AdmitOptions::default();
    let prompt = |n: u32| (0..n).collect::<Vec<u32>>();

    // Sequence 1 computes 12 tokens; its state after them is tagged 12.
    kv.admit_tokens_grouped(SeqId(1), &prompt(12), &opts, &mut step)
        .unwrap();
    write_state(&mut store, &state_pages(&kv, SeqId(1)), 12);
    assert!(kv.checkpoint_grouped(SeqId(1), &mut step).unwrap());
    assert_eq!(step.copies[1].len(), STATE_PAGES);
    assert!(step.copies[0].is_empty());
    run_copies(&mut store, &step);
    assert_eq!(kv.num_state_checkpoints(), 1);
    // Checkpoint pages are cached (free to take), not used by a sequence.
    let st = kv.group_stats();
    assert_eq!(st.used_per_group, vec![3, STATE_PAGES]);
    assert_eq!(st.cached_pages, STATE_PAGES);
    kv.check_invariants().unwrap();
    // Again at the same prefix: nothing new.
    assert!(!kv.checkpoint_grouped(SeqId(1), &mut step).unwrap());
    assert!(step.copies.iter().all(|c| c.is_empty()));

    // Sequence 1 goes on to 16 tokens; its state changes, the checkpoint's stays.
    kv.append_tokens_grouped(SeqId(1), &[12, 13, 14, 15], &mut step)
        .unwrap();
    write_state(&mut store, &state_pages(&kv, SeqId(1)), 16);

    // A prompt extending the first 12 tokens resumes from the checkpoint.
    assert_eq!(kv.cached_prefix_len(&prompt(14), &opts).unwrap(), 12);
    let a = kv
        .admit_tokens_grouped(SeqId(2), &prompt(14), &opts, &mut step)
        .unwrap();
    assert_eq!(a.cached_tokens, 12);
    assert_eq!(step.slots[0].len(), 2);
    let s2 = state_pages(&kv, SeqId(2));
    let pairs: Vec<BlockId> = step.copies[1].copies().iter().map(|c| c.dst).collect();
    assert_eq!(pairs, s2);
    run_copies(&mut store, &step);
    assert_eq!(read_pages(&store, &s2), state_bytes(12, STATE_PAGES));

    // The attention groups reach 16 tokens, a checkpoint only 12: the hit stops there.
    assert_eq!(kv.cached_prefix_len(&prompt(20), &opts).unwrap(), 12);
    // Checkpointed at 16 too, the deeper one serves.
    assert!(kv.checkpoint_grouped(SeqId(1), &mut step).unwrap());
    run_copies(&mut store, &step);
    let a = kv
        .admit_tokens_grouped(SeqId(3), &prompt(20), &opts, &mut step)
        .unwrap();
    assert_eq!(a.cached_tokens, 16);
    run_copies(&mut store, &step);
    assert_eq!(
        read_pages(&store, &state_pages(&kv, SeqId(3))),
        state_bytes(16, STATE_PAGES)
    );
    // A prompt that leaves the prefix at token 8 has no checkpoint there: no hit.
    let mut other = prompt(14);
    other[9] = 99;
    assert_eq!(kv.cached_prefix_len(&other, &opts).unwrap(), 0);
    // Another salt: another key, no hit.
    let salted = AdmitOptions {
        cache_salt: b"tenant",
        ..AdmitOptions::default()
    };
    assert_eq!(kv.cached_prefix_len(&prompt(14), &salted).unwrap(), 0);
    // The chunked admission hands out no copies: no hit with a state group.
    let a = kv
        .admit_prompt_grouped(SeqId(4), &prompt(14), &opts)
        .unwrap();
    assert_eq!(a.cached_tokens, 0);
    kv.free(SeqId(4)).unwrap();
    kv.check_invariants().unwrap();

    // Compaction moves checkpoint pages with their bytes.
    kv.free(SeqId(1)).unwrap();
    let pending = kv.plan_defragment_grouped().unwrap();
    store.copy_blocks(&pending.plan().to_copy_plan()).unwrap();
    pending.commit().unwrap();
    kv.check_invariants().unwrap();
    let a = kv
        .admit_tokens_grouped(SeqId(5), &prompt(14), &opts, &mut step)
        .unwrap();
    assert_eq!(a.cached_tokens, 12);
    run_copies(&mut store, &step);
    assert_eq!(
        read_pages(&store, &state_pages(&kv, SeqId(5))),
        state_bytes(12, STATE_PAGES)
    );
    kv.check_invariants().unwrap();

    // A checkpoint needs the sequence idle.
    kv.reserve_grouped(SeqId(5), 1, 0, &mut step).unwrap();
    let before = snapshot(&kv);
    assert!(matches!(
        kv.checkpoint_grouped(SeqId(5), &mut step),
        Err(Error::SequenceState { .. })
    ));
    assert!(matches!(
        kv.checkpoint_grouped(SeqId(77), &mut step),
        Err(Error::UnknownSequence(SeqId(77)))
    ));
    assert_eq!(snapshot(&kv), before);
    kv.commit(SeqId(5), 1).unwrap();

    // When the arena needs pages, checkpoints are evicted (least recently used
    // first) rather than failing the admission.
    let free = kv.group_stats().free_pages;
    assert_eq!(free, pages - kv.group_stats().used_pages);
    let tokens = (free - STATE_PAGES) * BS;
    kv.admit_grouped(SeqId(6), tokens, &mut step).unwrap();
    assert_eq!(kv.num_state_checkpoints(), 0);
    assert_eq!(kv.group_stats().free_pages, 0);
    kv.check_invariants().unwrap();
    // No room for a checkpoint now: refused, nothing changed.
    kv.free(SeqId(6)).unwrap();
    kv.admit_grouped(SeqId(6), tokens, &mut step).unwrap();
    let before = snapshot(&kv);
    let r = kv.checkpoint_grouped(SeqId(5), &mut step);
    assert!(
        matches!(r, Ok(false) | Err(Error::OutOfBlocks { .. })),
        "{r:?}"
    );
    assert_eq!(snapshot(&kv), before);
    for id in kv.sequence_ids().collect::<Vec<_>>() {
        kv.free(id).unwrap();
    }
    kv.evict_cached(usize::MAX);
    let st = kv.group_stats();
    assert_eq!(
        (st.used_pages, st.free_pages, st.cached_pages),
        (0, pages, 0)
    );
    kv.check_invariants().unwrap();
}

/// An arena full of live sequences and checkpoints: a new checkpoint evicts the
/// least recently used one (a repeated checkpoint call counts as a use).
#[test]
fn checkpoints_evict_the_least_recently_used_first() {
    // One state page per sequence; 8 pages.
    let specs = [GroupSpec::full(layout()), GroupSpec::state(layout(), 1)];
    let mut kv = KvCache::hybrid(&specs, 8).unwrap();
    let mut step = GroupStep::default();
    let opts = AdmitOptions::default();
    let prompt = |f: u32| [f + 10; BS];
    // Three live sequences of one block each: 3 KV + 3 state pages.
    for f in 0..3u32 {
        kv.admit_tokens_grouped(SeqId(f as u64 + 1), &prompt(f), &opts, &mut step)
            .unwrap();
    }
    assert!(kv.checkpoint_grouped(SeqId(1), &mut step).unwrap());
    assert!(kv.checkpoint_grouped(SeqId(2), &mut step).unwrap());
    assert_eq!(kv.group_stats().free_pages, 2); // the two checkpoints' pages
                                                // Use the first again: the second is now the least recently used.
    assert!(!kv.checkpoint_grouped(SeqId(1), &mut step).unwrap());
    assert!(kv.checkpoint_grouped(SeqId(3), &mut step).unwrap());
    assert_eq!(kv.num_state_checkpoints(), 2);
    kv.check_invariants().unwrap();
    let hit = |kv: &KvCache, f: u32| {
        let mut p = prompt(f).to_vec();
        p.push(1);
        kv.cached_prefix_len(&p, &opts).unwrap()
    };
    assert_eq!(
        (hit(&kv, 0), hit(&kv, 1), hit(&kv, 2)),
        (BS, 0, BS),
        "the least recently used went"
    );
}

/// A checkpoint whose prefix the attention group no longer caches serves no hit: it
/// is evicted before a usable one, even a less recently used one.
#[test]
fn checkpoints_whose_prefix_is_gone_are_evicted_first() {
    let specs = [GroupSpec::full(layout()), GroupSpec::state(layout(), 1)];
    let mut kv = KvCache::hybrid(&specs, 8).unwrap();
    let mut step = GroupStep::default();
    let opts = AdmitOptions::default();
    let hit = |kv: &KvCache, f: u32| kv.cached_prefix_len(&[f, f, f, f, 1], &opts).unwrap();
    // A: live, its chain cached. B: newer, freed, then its block evicted.
    kv.admit_tokens_grouped(SeqId(1), &[10; BS], &opts, &mut step)
        .unwrap();
    assert!(kv.checkpoint_grouped(SeqId(1), &mut step).unwrap());
    kv.admit_tokens_grouped(SeqId(2), &[11; BS], &opts, &mut step)
        .unwrap();
    assert!(kv.checkpoint_grouped(SeqId(2), &mut step).unwrap());
    kv.free(SeqId(2)).unwrap();
    assert_eq!((hit(&kv, 10), hit(&kv, 11)), (BS, BS));
    assert_eq!(kv.evict_cached(1), 1); // B's attention block
    assert_eq!(hit(&kv, 11), 0);
    assert_eq!(kv.num_state_checkpoints(), 2);
    // 8 pages: A's 2, two checkpoints; 4 free. Taking 5 evicts one checkpoint: B's.
    kv.admit_grouped(SeqId(3), 4 * BS, &mut step).unwrap();
    assert_eq!(kv.num_state_checkpoints(), 1);
    assert_eq!(hit(&kv, 10), BS, "the usable checkpoint stays");
    kv.check_invariants().unwrap();
}

/// The page waste of the state of real hybrid models: the planner's state bytes
/// per sequence in pages of the model's own KV block (16 tokens), and the same state
/// through `GroupSpec::state_for_bytes`. Printed with `--nocapture`.
#[test]
fn page_waste() {
    use pagedkv::plan::{ModelSpec, PlanInput};
    const GIB: u64 = 1 << 30;
    for file in [
        "jamba-1.5-mini.json",
        "qwen3-next-80b-a3b.json",
        "nemotron-h-8b.json",
        "granite-4.0-h-tiny.json",
    ] {
        let path = format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"));
        let mut i = PlanInput::new(ModelSpec::from_file(path).unwrap(), 141 * GIB);
        i.context_tokens = 8192;
        let plan = i.plan().unwrap();
        let st = plan.state.expect("a hybrid model has a state");
        // A page-sized layout: one layer of `block_bytes / 16 / 2 / 4` f32 elements.
        let per_token_elems = plan.block_bytes as usize / 16 / 2 / 4;
        let l = KvLayout::new(
            ModelShape {
                num_layers: 1,
                num_q_heads: 1,
                num_kv_heads: 1,
                head_dim: per_token_elems,
                kv_dtype: DType::F32,
            },
            16,
        )
        .unwrap();
        assert_eq!(l.block_bytes() as u64, plan.block_bytes, "{file}");
        let spec = GroupSpec::state_for_bytes(l, st.bytes_per_sequence).unwrap();
        assert_eq!(spec.state_pages, Some(st.pages_per_sequence as usize));
        let waste = spec.state_waste_bytes(st.bytes_per_sequence);
        assert_eq!(waste, st.waste_bytes_per_sequence);
        assert!(waste < plan.block_bytes);
        eprintln!(
            "{file}: state {} B/seq in {} pages of {} B, waste {} B ({:.3} % of the state pages)",
            st.bytes_per_sequence,
            st.pages_per_sequence,
            plan.block_bytes,
            waste,
            100.0 * waste as f64 / (st.pages_per_sequence * plan.block_bytes) as f64
        );
    }
}

// ---- the model-based test ---------------------------------------------------------

#[derive(Debug, Clone)]
enum Action {
    Admit(usize),
    Append(usize, usize),
    /// A model step of sequence `i`: its state rewritten (new tag), one token appended.
    Step(usize),
    Fork(usize),
    Free(usize),
    SwapOut(usize),
    SwapIn(usize),
    Truncate(usize, usize),
    Compact,
    /// Admit a prompt of `n` tokens of family `f` (repeated prompts: the attention
    /// group registers and would hit; a state group serves no hit).
    /// With `true`, the state is checkpointed right after the prompt (an engine that
    /// checkpoints the end of every prompt).
    AdmitTokens(u32, usize, bool),
    /// A batch step of `n` query tokens of sequence `i` through `StepBuffers`, its
    /// state rewritten.
    Batch(usize, usize),
    /// Checkpoint sequence `i`'s state (made only at a registered block boundary).
    Checkpoint(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (1..20usize).prop_map(Action::Admit),
        3 => (any::<usize>(), 1..6usize).prop_map(|(i, n)| Action::Append(i, n)),
        4 => any::<usize>().prop_map(Action::Step),
        3 => any::<usize>().prop_map(Action::Fork),
        4 => any::<usize>().prop_map(Action::Free),
        2 => any::<usize>().prop_map(Action::SwapOut),
        2 => any::<usize>().prop_map(Action::SwapIn),
        1 => (any::<usize>(), 0..8usize).prop_map(|(i, n)| Action::Truncate(i, n)),
        1 => Just(Action::Compact),
        5 => (0..2u32, prop_oneof![1..20usize, (1..5usize).prop_map(|k| k * BS)], any::<bool>())
            .prop_map(|(f, n, c)| Action::AdmitTokens(f, n, c)),
        2 => (any::<usize>(), 1..6usize).prop_map(|(i, n)| Action::Batch(i, n)),
        2 => any::<usize>().prop_map(Action::Checkpoint),
    ]
}

const PAGES: usize = 40;
const HOST: usize = 12;

/// A live or swapped sequence in the shadow: its state's tag and the K/V value tag
/// of each token (a fork's tokens keep the parent's tags).
#[derive(Debug, Clone)]
struct Shadow {
    id: SeqId,
    state: u64,
    tokens: Vec<u64>,
    /// The prompt family of a sequence admitted with token ids.
    family: Option<u32>,
}

struct Model {
    kv: KvCache,
    store: HostStorage,
    step: GroupStep,
    live: Vec<Shadow>,
    swapped: Vec<Shadow>,
    next: u64,
    forks: usize,
    swaps: usize,
    bufs: Vec<StepBuffers>,
    batches: usize,
    /// The state tag each checkpoint made holds, by (family, position).
    checkpoints: std::collections::HashMap<(u32, usize), u64>,
    state_hits: usize,
}

fn kv_value(tag: u64, pos: usize) -> f32 {
    (tag as usize * 1_000 + pos) as f32
}

impl Model {
    fn new() -> Self {
        Model {
            kv: KvCache::hybrid_with_host_tier(&specs(), PAGES, HOST).unwrap(),
            store: HostStorage::with_host_tier(layout(), PAGES, HOST).unwrap(),
            step: GroupStep::default(),
            live: Vec::new(),
            swapped: Vec::new(),
            next: 1,
            forks: 0,
            swaps: 0,
            bufs: (0..2).map(|_| StepBuffers::new(4, 16, PAGES)).collect(),
            batches: 0,
            checkpoints: Default::default(),
            state_hits: 0,
        }
    }

    /// Runs the step's copies, then writes group 0's slots from `first` with `tag`.
    fn write_kv(&mut self, first: usize, tag: u64) {
        for c in &self.step.copies {
            self.store.copy_blocks(c).unwrap();
        }
        let slots = self.step.slots[0].clone();
        self.write_slots(&slots, first, tag);
    }

    /// Writes `slots` as tokens `first..` tagged `tag`.
    fn write_slots(&mut self, slots: &[Slot], first: usize, tag: u64) {
        for layer in 0..LAYERS {
            let vals = |sign: f32| {
                f32_bytes(
                    (0..slots.len()).flat_map(|i| [sign * kv_value(tag, first + i); HEAD_DIM]),
                )
            };
            self.store
                .write_slots(layer, slots, &vals(1.0), &vals(-1.0))
                .unwrap();
        }
    }

    fn check(&self) {
        self.kv.check_invariants().unwrap();
        let mut seen = std::collections::HashSet::new();
        for s in &self.live {
            let pages = state_pages(&self.kv, s.id);
            assert_eq!(pages.len(), STATE_PAGES);
            assert!(pages.iter().all(|p| seen.insert(*p)), "state page shared");
            assert_eq!(
                read_pages(&self.store, &pages),
                state_bytes(s.state, STATE_PAGES),
                "state of {}",
                s.id
            );
            let n = self.kv.num_computed_tokens(s.id).unwrap();
            assert_eq!(n, s.tokens.len());
            let table = self.kv.group(0).block_table(s.id).unwrap();
            for layer in 0..LAYERS {
                let mut k = vec![0u8; n * HEAD_DIM * 4];
                let mut v = k.clone();
                self.store
                    .read_tokens(layer, table, n, &mut k, &mut v)
                    .unwrap();
                let want = f32_bytes(
                    s.tokens
                        .iter()
                        .enumerate()
                        .flat_map(|(p, &t)| [kv_value(t, p); HEAD_DIM]),
                );
                assert_eq!(k, want, "K of {} layer {layer}", s.id);
            }
        }
        let st = self.kv.group_stats();
        assert_eq!(st.num_sequences, self.live.len());
        assert_eq!(st.used_per_group[1], self.live.len() * STATE_PAGES);
    }

    /// Checkpoints live sequence `k`, running the copies and recording the state tag
    /// the checkpoint holds.
    fn checkpoint(&mut self, k: usize, before: &[String]) -> Result<(), Error> {
        let s = &self.live[k];
        match self.kv.checkpoint_grouped(s.id, &mut self.step) {
            Ok(true) => {
                let f = s.family.expect("only prompts with ids register");
                assert_eq!(s.tokens.len() % BS, 0);
                self.checkpoints.insert((f, s.tokens.len()), s.state);
                for c in &self.step.copies {
                    self.store.copy_blocks(c).unwrap();
                }
                Ok(())
            }
            Ok(false) => {
                assert!(self.step.copies.iter().all(|c| c.is_empty()));
                assert_eq!(snapshot(&self.kv), before);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn apply(&mut self, a: &Action) {
        let before = snapshot(&self.kv);
        let pick = |i: usize, v: &[Shadow]| (!v.is_empty()).then(|| i % v.len());
        let r: Result<(), Error> = match *a {
            Action::Admit(n) => {
                let id = SeqId(self.next);
                self.next += 1;
                let r = self.kv.admit_grouped(id, n, &mut self.step);
                if r.is_ok() {
                    self.write_kv(0, id.0);
                    let pages = state_pages(&self.kv, id);
                    write_state(&mut self.store, &pages, id.0);
                    self.live.push(Shadow {
                        id,
                        state: id.0,
                        tokens: vec![id.0; n],
                        family: None,
                    });
                }
                r
            }
            Action::Append(i, n) | Action::Truncate(i, n) if pick(i, &self.live).is_none() => {
                let _ = n;
                return;
            }
            Action::Append(i, n) => {
                let k = i % self.live.len();
                let id = self.live[k].id;
                let r = self.kv.append_grouped(id, n, &mut self.step);
                if r.is_ok() {
                    let first = self.live[k].tokens.len();
                    let tag = self.next;
                    self.next += 1;
                    self.write_kv(first, tag);
                    self.live[k].tokens.extend(std::iter::repeat_n(tag, n));
                }
                r
            }
            Action::Step(i) => {
                let Some(k) = pick(i, &self.live) else { return };
                let id = self.live[k].id;
                let r = self.kv.append_grouped(id, 1, &mut self.step);
                if r.is_ok() {
                    let tag = self.next;
                    self.next += 1;
                    let first = self.live[k].tokens.len();
                    self.write_kv(first, tag);
                    self.live[k].tokens.push(tag);
                    let pages = state_pages(&self.kv, id);
                    write_state(&mut self.store, &pages, tag);
                    self.live[k].state = tag;
                }
                r
            }
            Action::Fork(i) => {
                let Some(k) = pick(i, &self.live) else { return };
                let child = SeqId(self.next);
                self.next += 1;
                let r = self.kv.fork_grouped(self.live[k].id, child, &mut self.step);
                if r.is_ok() {
                    for c in &self.step.copies {
                        self.store.copy_blocks(c).unwrap();
                    }
                    let s = Shadow {
                        id: child,
                        ..self.live[k].clone()
                    };
                    self.live.push(s);
                    self.forks += 1;
                }
                r
            }
            Action::Free(i) => {
                let Some(k) = pick(i, &self.live) else { return };
                let s = self.live.swap_remove(k);
                self.kv.free(s.id).unwrap();
                Ok(())
            }
            Action::SwapOut(i) => {
                let Some(k) = pick(i, &self.live) else { return };
                match self.kv.swap_out_grouped(self.live[k].id) {
                    Ok(job) => {
                        for p in &job.plans {
                            self.store.swap(p).unwrap();
                        }
                        self.kv.complete_swap_grouped(&job).unwrap();
                        let s = self.live.swap_remove(k);
                        self.swapped.push(s);
                        self.swaps += 1;
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Action::SwapIn(i) => {
                let Some(k) = pick(i, &self.swapped) else {
                    return;
                };
                match self.kv.swap_in_grouped(self.swapped[k].id) {
                    Ok(job) => {
                        for p in &job.plans {
                            self.store.swap(p).unwrap();
                        }
                        self.kv.complete_swap_grouped(&job).unwrap();
                        let s = self.swapped.swap_remove(k);
                        self.live.push(s);
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Action::Truncate(i, cut) => {
                let k = i % self.live.len();
                let s = &self.live[k];
                let len = s.tokens.len().saturating_sub(cut);
                let r = self.kv.truncate(s.id, len);
                if cut > 0 && !s.tokens.is_empty() {
                    assert!(matches!(r, Err(Error::StateRollback { .. })), "{r:?}");
                } else {
                    r.as_ref().unwrap();
                }
                r
            }
            Action::AdmitTokens(f, n, checkpoint) => {
                let id = SeqId(self.next);
                self.next += 1;
                let tokens = vec![f; n];
                let opts = AdmitOptions::default();
                let looked = self.kv.cached_prefix_len(&tokens, &opts).unwrap();
                match self
                    .kv
                    .admit_tokens_grouped(id, &tokens, &opts, &mut self.step)
                {
                    Ok(a) => {
                        let c = a.cached_tokens;
                        assert_eq!(c, looked);
                        assert_eq!(self.step.slots[0].len(), n - c);
                        // Every sequence of the family writes the same K/V (as the
                        // same prompt computes), so a shared block holds it.
                        self.write_kv(c, 100_000 + f as u64);
                        let pages = state_pages(&self.kv, id);
                        if c > 0 {
                            // Resumed from a checkpoint at exactly `c`: its bytes.
                            let tag = self.checkpoints[&(f, c)];
                            assert_eq!(
                                read_pages(&self.store, &pages),
                                state_bytes(tag, STATE_PAGES),
                                "the state resumed at {c}"
                            );
                            self.state_hits += 1;
                        } else {
                            assert!(self.step.copies[1].is_empty());
                        }
                        write_state(&mut self.store, &pages, id.0);
                        self.live.push(Shadow {
                            id,
                            state: id.0,
                            tokens: vec![100_000 + f as u64; n],
                            family: Some(f),
                        });
                        if checkpoint {
                            let before = snapshot(&self.kv);
                            let _ = self.checkpoint(self.live.len() - 1, &before);
                        }
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Action::Batch(i, n) => {
                let Some(k) = pick(i, &self.live) else { return };
                let id = self.live[k].id;
                let h = self.kv.handle(id).unwrap();
                let entries = [StepEntry {
                    seq: h,
                    new_tokens: n,
                    lookahead: 0,
                }];
                match self.kv.reserve_step_grouped(&entries, &mut self.bufs) {
                    Ok(()) => {
                        let pages = state_pages(&self.kv, id);
                        let t = self.bufs[1].tables();
                        let row: Vec<BlockId> = t.tables[..STATE_PAGES]
                            .iter()
                            .map(|&b| BlockId(b))
                            .collect();
                        assert_eq!(row, pages, "the state row of {id}");
                        assert!(self.bufs[1].slot_mapping().iter().all(|&s| s == -1));
                        self.store.copy_blocks(self.bufs[0].copies()).unwrap();
                        let slots: Vec<Slot> = self.bufs[0]
                            .slot_mapping()
                            .iter()
                            .map(|&s| Slot(s as u64))
                            .collect();
                        let tag = self.next;
                        self.next += 1;
                        let first = self.live[k].tokens.len();
                        self.write_slots(&slots, first, tag);
                        write_state(&mut self.store, &pages, tag);
                        self.kv.commit_step(&[(h, n)]).unwrap();
                        self.live[k].tokens.extend(std::iter::repeat_n(tag, n));
                        self.live[k].state = tag;
                        self.batches += 1;
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Action::Checkpoint(i) => {
                let Some(k) = pick(i, &self.live) else { return };
                self.checkpoint(k, &before)
            }
            Action::Compact => {
                let pending = self.kv.plan_defragment_grouped().unwrap();
                self.store
                    .copy_blocks(&pending.plan().to_copy_plan())
                    .unwrap();
                pending.commit().unwrap();
                Ok(())
            }
        };
        match r {
            Ok(()) => {}
            Err(Error::OutOfBlocks { .. })
            | Err(Error::TierFull { .. })
            | Err(Error::StateRollback { .. }) => assert_eq!(snapshot(&self.kv), before),
            Err(e) => panic!("{a:?}: {e}"),
        }
        self.check();
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(64))]

    #[test]
    fn state_and_kv_bytes_follow_the_shadow(actions in proptest::collection::vec(action(), 1..60)) {
        let mut m = Model::new();
        for a in &actions {
            m.apply(a);
        }
        // Free everything: every page comes back.
        for s in std::mem::take(&mut m.live) {
            m.kv.free(s.id).unwrap();
        }
        for s in std::mem::take(&mut m.swapped) {
            m.kv.free(s.id).unwrap();
        }
        let st = m.kv.group_stats();
        prop_assert_eq!(st.used_pages, 0);
        prop_assert_eq!(st.free_pages, PAGES);
        prop_assert_eq!(m.kv.tier_stats().host_used_blocks, 0);
        m.kv.check_invariants().unwrap();
    }
}

/// The property run covers forks, swaps, batch steps and checkpoint hits (not vacuous).
#[test]
fn the_model_run_forks_and_swaps() {
    // A fixed seed: the counts below are the same every run.
    let mut runner = proptest::test_runner::TestRunner::new_with_rng(
        ProptestConfig {
            cases: 32,
            ..ProptestConfig::default()
        },
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    let seen = std::sync::Mutex::new((0, 0, 0, 0));
    runner
        .run(&proptest::collection::vec(action(), 1..60), |actions| {
            let mut m = Model::new();
            for a in &actions {
                m.apply(a);
            }
            let mut s = seen.lock().unwrap();
            s.0 += usize::from(m.forks > 0);
            s.1 += usize::from(m.swaps > 0);
            s.2 += usize::from(m.batches > 0);
            s.3 += usize::from(m.state_hits > 0);
            Ok(())
        })
        .unwrap();
    let (forks, swaps, batches, hits) = seen.into_inner().unwrap();
    eprintln!(
        "{forks} forks, {swaps} swaps, {batches} batch steps, {hits} checkpoint hits of 32 cases"
    );
    assert!(
        forks >= 16 && swaps >= 8 && batches >= 16 && hits >= 4,
        "{forks} forks, {swaps} swaps, {batches} batch steps, {hits} checkpoint hits of 32"
    );
}

/// `KvCache::stats` of a hybrid cache counts the pages each group lends neither as
/// used nor as live tokens (it overflowed before: the lenders' full blocks were
/// counted live); a state group's pages count as full.
#[test]
fn cache_stats_of_a_hybrid_cache_count_own_pages_only() {
    let mut step = GroupStep::default();
    let mut kv =
        KvCache::hybrid(&[GroupSpec::full(layout()), GroupSpec::full(layout())], 8).unwrap();
    kv.admit_grouped(SeqId(1), 5, &mut step).unwrap();
    let st = kv.stats();
    assert_eq!((st.used_blocks, st.live_token_slots), (4, 10));
    assert_eq!(st.internal_waste_slots, 4 * BS - 10);
    let mut kv = KvCache::hybrid(&specs(), 8).unwrap();
    kv.admit_grouped(SeqId(1), 5, &mut step).unwrap();
    let st = kv.stats();
    assert_eq!(st.used_blocks, 2 + STATE_PAGES);
    assert_eq!(st.live_token_slots, 5 + STATE_PAGES * BS);
}
