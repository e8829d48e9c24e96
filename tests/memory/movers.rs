//! Reliability, round 3: nothing moves a block that this step is writing.
//!
//! Between `reserve` (or `reserve_step`) and `commit` the model writes K/V through the
//! slots it was handed, so every block of a sequence holding a reservation is in
//! flight: defragmentation plans around those blocks, a shrink whose tail holds one
//! refuses (changing nothing), the broker takes no memory from a model mid-step, and
//! `truncate` refuses a sequence mid-step. Each case writes the step through the
//! reserved slots after the mover ran and reads the committed bytes back from
//! `HostStorage`, and each refusal leaves everything as it was. (The round's two
//! bookkeeping defects have their tests beside their kin: `tests/cache/readable_state.rs` for
//! the group swap-in's fills, `tests/cache/prefix.rs` for the one rule of token ids.)

use pagedkv::broker::{Broker, BrokerConfig, ModelLimits, SleepOptions};
use pagedkv::executor::{defragment_with, shrink_to};
use pagedkv::layout::Slot;
use pagedkv::manager::preempt::{CostModel, PreemptAction, PreemptMode};
use pagedkv::manager::DefragOptions;
use pagedkv::{
    AdmitOptions, CopyPlan, DType, Error, GroupSpec, GroupStep, HostStorage, KvCache, KvLayout,
    ModelShape, PreemptPolicy, SeqId, Storage, TierConfig,
};

const BS: usize = 4;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 1,
        num_kv_heads: 1,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    KvLayout::new(shape, BS).unwrap()
}

fn manager(num_blocks: usize) -> (KvCache, HostStorage) {
    let kv = KvCache::builder(layout())
        .num_blocks(num_blocks)
        .watermark_blocks(0)
        .tiers(TierConfig {
            num_host_blocks: num_blocks,
            num_disk_slots: 0,
        })
        .build()
        .unwrap();
    let storage = HostStorage::with_host_tier(layout(), num_blocks, num_blocks).unwrap();
    (kv, storage)
}

/// One token's K (kind 0) or V (kind 1) bytes in one layer, a function of the
/// sequence, the position and `salt` (so a step's bytes differ from stale ones).
fn token_bytes(seq: SeqId, pos: usize, layer: usize, kind: u8, salt: u8, out: &mut Vec<u8>) {
    let n = layout().shape().head_dim * layout().dtype().size_bytes();
    for i in 0..n {
        out.push(
            (seq.0 as u8)
                .wrapping_mul(31)
                .wrapping_add(pos as u8 * 7)
                .wrapping_add(layer as u8 * 3 + kind)
                .wrapping_add(salt)
                .wrapping_add(i as u8)
                | 1,
        );
    }
}

fn write(storage: &mut HostStorage, seq: SeqId, first_pos: usize, slots: &[Slot]) {
    for layer in 0..layout().num_layers() {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for i in 0..slots.len() {
            token_bytes(seq, first_pos + i, layer, 0, 0, &mut k);
            token_bytes(seq, first_pos + i, layer, 1, 0, &mut v);
        }
        storage.write_slots(layer, slots, &k, &v).unwrap();
    }
}

/// Reads back the first `len` tokens of `seq` and compares them with what `write`
/// wrote (every byte is odd, so a zeroed or stale block shows).
fn check(kv: &KvCache, storage: &HostStorage, seq: SeqId, len: usize) {
    let table = kv.block_table(seq).unwrap();
    for layer in 0..layout().num_layers() {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for pos in 0..len {
            token_bytes(seq, pos, layer, 0, 0, &mut k);
            token_bytes(seq, pos, layer, 1, 0, &mut v);
        }
        let (mut rk, mut rv) = (vec![0; k.len()], vec![0; v.len()]);
        storage
            .read_tokens(layer, table, len, &mut rk, &mut rv)
            .unwrap();
        let per_token = k.len() / len;
        for pos in 0..len {
            let r = pos * per_token..(pos + 1) * per_token;
            assert!(
                rk[r.clone()] == k[r.clone()] && rv[r.clone()] == v[r],
                "{seq} layer {layer} position {pos}: K/V bytes are not the step's"
            );
        }
    }
}

/// Everything a failed call must leave as it was.
fn snapshot(kv: &KvCache, storage: &HostStorage) -> String {
    let mut ids: Vec<_> = kv.sequence_ids().collect();
    ids.sort();
    let tables: Vec<_> = ids
        .iter()
        .map(|&s| {
            (
                s,
                kv.block_table(s).unwrap().to_vec(),
                kv.num_tokens(s).unwrap(),
                kv.num_computed_tokens(s).unwrap(),
            )
        })
        .collect();
    format!(
        "{:?} {:?} {:?} {tables:?} {}",
        kv.stats(),
        kv.fragmentation(),
        kv.pool().states(),
        storage.num_blocks()
    )
}

/// The repro: sequence 2 sits above a hole left by sequence 1 and holds a
/// reservation of 2 tokens (positions 6-7) when the arena is compacted.
fn reserved_above_a_hole() -> (KvCache, HostStorage, Vec<Slot>) {
    let (mut kv, mut storage) = manager(8);
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 8, &mut slots).unwrap();
    write(&mut storage, SeqId(1), 0, &slots);
    kv.admit(SeqId(2), 6, &mut slots).unwrap();
    write(&mut storage, SeqId(2), 0, &slots);
    kv.free(SeqId(1)).unwrap();
    let mut step = Vec::new();
    kv.reserve(SeqId(2), 2, 0, &mut step, &mut CopyPlan::new())
        .unwrap();
    (kv, storage, step)
}

#[test]
fn defragmentation_leaves_a_reserved_sequence_in_place() {
    let (mut kv, mut storage, step) = reserved_above_a_hole();
    let table = kv.block_table(SeqId(2)).unwrap().to_vec();
    let plan = defragment_with(&mut kv, &mut storage, DefragOptions::FULL).unwrap();
    assert!(
        plan.is_empty(),
        "moved blocks under a reservation: {plan:?}"
    );
    assert_eq!(kv.block_table(SeqId(2)).unwrap(), table);
    write(&mut storage, SeqId(2), 6, &step);
    kv.commit(SeqId(2), 2).unwrap();
    kv.check_invariants().unwrap();
    check(&kv, &storage, SeqId(2), 8);
    // Committed, the sequence moves like any other.
    let plan = defragment_with(&mut kv, &mut storage, DefragOptions::FULL).unwrap();
    assert_eq!(plan.len(), 2);
    check(&kv, &storage, SeqId(2), 8);
    kv.check_invariants().unwrap();
}

/// Compaction works around a reserved sequence: the others still move into the holes
/// below it, and nothing of the reserved one moves.
#[test]
fn defragmentation_compacts_around_a_reserved_sequence() {
    let (mut kv, mut storage) = manager(8);
    let mut slots = Vec::new();
    for (seq, len) in [(1, 4), (2, 4), (3, 4), (4, 4), (5, 4), (6, 3)] {
        kv.admit(SeqId(seq), len, &mut slots).unwrap();
        write(&mut storage, SeqId(seq), 0, &slots);
    }
    // Blocks 0-5; free 1 and 2: holes at 0 and 1, sources 4 (seq 5) and 5 (seq 6).
    kv.free(SeqId(1)).unwrap();
    kv.free(SeqId(2)).unwrap();
    let mut step = Vec::new();
    kv.reserve(SeqId(6), 1, 0, &mut step, &mut CopyPlan::new())
        .unwrap();
    let reserved = kv.block_table(SeqId(6)).unwrap().to_vec();
    let plan = defragment_with(&mut kv, &mut storage, DefragOptions::FULL).unwrap();
    assert_eq!(plan.len(), 1, "{plan:?}");
    assert_eq!(kv.block_table(SeqId(6)).unwrap(), reserved);
    assert!(kv.block_table(SeqId(5)).unwrap()[0].0 < 2);
    write(&mut storage, SeqId(6), 3, &step);
    kv.commit(SeqId(6), 1).unwrap();
    kv.check_invariants().unwrap();
    for seq in 3..=5 {
        check(&kv, &storage, SeqId(seq), 4);
    }
    check(&kv, &storage, SeqId(6), 4);
}

/// The two-phase API and `reserve_step` hold the same rule.
#[test]
fn planned_defragmentation_skips_a_step_reservation() {
    let (mut kv, mut storage) = manager(8);
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 8, &mut slots).unwrap();
    kv.admit(SeqId(2), 6, &mut slots).unwrap();
    write(&mut storage, SeqId(2), 0, &slots);
    kv.free(SeqId(1)).unwrap();
    let h = kv.handle(SeqId(2)).unwrap();
    let mut buffers = pagedkv::StepBuffers::new(4, 8, 4);
    kv.reserve_step(
        &[pagedkv::StepEntry {
            seq: h,
            new_tokens: 2,
            lookahead: 0,
        }],
        &mut buffers,
    )
    .unwrap();
    let pending = kv.plan_defragment(DefragOptions::FULL).unwrap();
    assert!(pending.plan().is_empty(), "{:?}", pending.plan());
    pending.commit().unwrap();
    let step: Vec<Slot> = buffers
        .slot_mapping()
        .iter()
        .filter(|&&s| s >= 0)
        .map(|&s| Slot(s as u64))
        .collect();
    assert_eq!(step.len(), 2);
    write(&mut storage, SeqId(2), 6, &step);
    kv.commit(SeqId(2), 2).unwrap();
    check(&kv, &storage, SeqId(2), 8);
}

#[test]
fn shrink_refuses_a_tail_under_a_reservation_and_changes_nothing() {
    let (mut kv, mut storage, step) = reserved_above_a_hole();
    let before = snapshot(&kv, &storage);
    for target in [2, 3] {
        let e = shrink_to(&mut kv, target, &mut storage).unwrap_err();
        assert!(
            matches!(e, Error::SequenceState { seq: SeqId(2), .. }),
            "{e:?}"
        );
        assert_eq!(snapshot(&kv, &storage), before);
        assert!(matches!(
            kv.plan_shrink(target).map(|p| p.num_blocks()),
            Err(Error::SequenceState { seq: SeqId(2), .. })
        ));
        assert_eq!(snapshot(&kv, &storage), before);
    }
    // A tail without the reserved blocks still goes.
    shrink_to(&mut kv, 4, &mut storage).unwrap();
    assert_eq!(kv.num_blocks(), 4);
    write(&mut storage, SeqId(2), 6, &step);
    kv.commit(SeqId(2), 2).unwrap();
    kv.check_invariants().unwrap();
    check(&kv, &storage, SeqId(2), 8);
    // Committed, the shrink moves it.
    shrink_to(&mut kv, 2, &mut storage).unwrap();
    check(&kv, &storage, SeqId(2), 8);
    kv.check_invariants().unwrap();
}

/// KV-cache groups compact over one page arena: a page of a sequence holding a
/// reservation in any group stays where it is.
#[test]
fn group_defragmentation_leaves_a_reserved_sequence_in_place() {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 1,
        num_kv_heads: 1,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    let l = KvLayout::new(shape, BS).unwrap();
    let mut kv = KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::full(l)], 8)
        .unwrap()
        .with_watermark_blocks(0)
        .unwrap();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 4, &mut step).unwrap();
    kv.admit_grouped(SeqId(2), 3, &mut step).unwrap();
    kv.free(SeqId(1)).unwrap();
    kv.reserve_grouped(SeqId(2), 1, 0, &mut step).unwrap();
    let tables: Vec<_> = (0..2)
        .map(|g| kv.group(g).block_table(SeqId(2)).unwrap().to_vec())
        .collect();
    let pending = kv.plan_defragment_grouped().unwrap();
    assert!(pending.plan().is_empty(), "{:?}", pending.plan());
    pending.commit().unwrap();
    for (g, t) in tables.iter().enumerate() {
        assert_eq!(kv.group(g).block_table(SeqId(2)).unwrap(), t);
    }
    kv.commit(SeqId(2), 1).unwrap();
    kv.check_invariants().unwrap();
    let pending = kv.plan_defragment_grouped().unwrap();
    assert!(!pending.plan().is_empty());
    pending.commit().unwrap();
    kv.check_invariants().unwrap();
}

const CHUNK: usize = 512;

/// Two models of 128-byte blocks (4 per chunk) sharing a budget of 4 chunks: model A
/// holds 3 chunks, model B 1. A's prefix cache holds 9 blocks and a sequence at the
/// top of its arena holds a reservation: a chunk of A is only to be had by evicting
/// cached blocks and moving the reserved ones.
fn broker_with_a_mid_step() -> (
    Broker<HostStorage>,
    pagedkv::broker::ModelId,
    pagedkv::broker::ModelId,
    Vec<Slot>,
) {
    let l = layout();
    assert_eq!(l.block_bytes(), CHUNK / 4);
    let mut b = Broker::new(BrokerConfig::new(4 * CHUNK, CHUNK)).unwrap();
    let model = |blocks| {
        let kv = KvCache::builder(l)
            .num_blocks(blocks)
            .watermark_blocks(0)
            .build()
            .unwrap();
        (kv, HostStorage::new(l, blocks).unwrap())
    };
    let (kv, storage) = model(12);
    let a = b
        .register("a", kv, storage, ModelLimits::new(CHUNK, 4 * CHUNK))
        .unwrap();
    let (kv, storage) = model(4);
    let bm = b
        .register("b", kv, storage, ModelLimits::new(CHUNK, 4 * CHUNK))
        .unwrap();
    let mut g = b.lock(a).unwrap();
    let (kv, storage) = g.parts_mut();
    let mut slots = Vec::new();
    let prompt: Vec<u32> = (0..36).collect();
    kv.admit_tokens(SeqId(1), &prompt, &AdmitOptions::default(), &mut slots)
        .unwrap();
    kv.admit(SeqId(2), 6, &mut slots).unwrap();
    write(storage, SeqId(2), 0, &slots);
    kv.free(SeqId(1)).unwrap();
    assert_eq!(kv.stats().cached_blocks, 9);
    let mut step = Vec::new();
    kv.reserve(SeqId(2), 2, 0, &mut step, &mut CopyPlan::new())
        .unwrap();
    assert!(kv.block_table(SeqId(2)).unwrap()[0].0 >= 8);
    drop(g);
    (b, a, bm, step)
}

/// Model A is between `reserve` and `commit` with its guard released; model B under
/// pressure takes nothing from it (no eviction, no move), and A's step lands where its
/// slots said.
#[test]
fn the_broker_takes_nothing_from_a_model_mid_step() {
    let (b, a, bm, step) = broker_with_a_mid_step();
    let before = {
        let g = b.lock(a).unwrap();
        snapshot(g.kv(), g.storage())
    };
    let mut g = b.lock(bm).unwrap();
    assert_eq!(g.ensure_available(8).unwrap(), 4);
    drop(g);
    b.check_invariants().unwrap();
    let mut g = b.lock(a).unwrap();
    assert_eq!(snapshot(g.kv(), g.storage()), before);
    let (kv, storage) = g.parts_mut();
    write(storage, SeqId(2), 6, &step);
    kv.commit(SeqId(2), 2).unwrap();
    check(g.kv(), g.storage(), SeqId(2), 8);
    drop(g);
    // Committed, A gives its idle chunks; its sequence moves with its bytes.
    let mut g = b.lock(bm).unwrap();
    assert!(g.ensure_available(8).unwrap() >= 8);
    drop(g);
    b.check_invariants().unwrap();
    let g = b.lock(a).unwrap();
    assert!(g.kv().num_blocks() < 12);
    check(g.kv(), g.storage(), SeqId(2), 8);
}

/// A model mid-step does not go to sleep: the call refuses and changes nothing (no
/// swap, no spill, no eviction of its 9 cached blocks, no shrink).
#[test]
fn sleep_refuses_a_model_mid_step() {
    let (b, a, _, step) = broker_with_a_mid_step();
    let before = {
        let g = b.lock(a).unwrap();
        snapshot(g.kv(), g.storage())
    };
    for opts in [
        SleepOptions::default(),
        SleepOptions {
            swap_out_sequences: true,
            spill_cached_prefixes: true,
        },
    ] {
        let e = b.sleep(a, opts).unwrap_err();
        assert!(
            matches!(e, Error::SequenceState { seq: SeqId(2), .. }),
            "{e:?}"
        );
        let g = b.lock(a).unwrap();
        assert_eq!(snapshot(g.kv(), g.storage()), before);
        assert!(!g.is_sleeping());
    }
    b.check_invariants().unwrap();
    let mut g = b.lock(a).unwrap();
    let (kv, storage) = g.parts_mut();
    write(storage, SeqId(2), 6, &step);
    kv.commit(SeqId(2), 2).unwrap();
    check(g.kv(), g.storage(), SeqId(2), 8);
    drop(g);
    b.sleep(a, SleepOptions::default()).unwrap();
    let g = b.lock(a).unwrap();
    check(g.kv(), g.storage(), SeqId(2), 8);
}

/// `truncate` releases the blocks past the new length, and a reservation's slots are
/// in those blocks: mid-step it refuses (it used to cancel the reservation silently
/// and free the block the step was writing), changing nothing. Committed, or
/// cancelled with `commit(seq, 0)`, the same call goes through.
#[test]
fn truncate_refuses_a_sequence_mid_step_and_changes_nothing() {
    let (mut kv, mut storage, step) = reserved_above_a_hole();
    let before = snapshot(&kv, &storage);
    // 4 releases the block of positions 4-7 (the step writes 6-7 there); 7 only cuts
    // the reservation.
    for new_len in [4, 7, 8] {
        let e = kv.truncate(SeqId(2), new_len).unwrap_err();
        assert!(
            matches!(e, Error::SequenceState { seq: SeqId(2), .. }),
            "{e:?}"
        );
        assert_eq!(snapshot(&kv, &storage), before);
    }
    write(&mut storage, SeqId(2), 6, &step);
    kv.commit(SeqId(2), 2).unwrap();
    kv.check_invariants().unwrap();
    check(&kv, &storage, SeqId(2), 8);
    kv.truncate(SeqId(2), 7).unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 7);
    check(&kv, &storage, SeqId(2), 7);
    // A cancelled reservation leaves its slots allocated; truncate drops them.
    let mut step = Vec::new();
    kv.reserve(SeqId(2), 1, 2, &mut step, &mut CopyPlan::new())
        .unwrap();
    assert!(kv.truncate(SeqId(2), 8).is_err());
    kv.commit(SeqId(2), 0).unwrap();
    assert_eq!(kv.num_tokens(SeqId(2)).unwrap(), 10);
    kv.truncate(SeqId(2), 7).unwrap();
    assert_eq!(kv.block_table(SeqId(2)).unwrap().len(), 2);
    kv.check_invariants().unwrap();
    check(&kv, &storage, SeqId(2), 7);
}

/// The prefix cache's droppers (`reset_prefix_cache`, the spill to the host tier)
/// take only unreferenced blocks, and a reservation references every block of its
/// table, including a cached one it revived: a whole-prompt hit recomputes its last
/// block, and the reservation shares the cached copy in its place. Nothing of the
/// reserved sequence goes, and its blocks stay registered.
#[test]
fn prefix_reset_and_spill_leave_a_block_revived_by_a_reservation() {
    let (mut kv, mut storage) = manager(8);
    let (opts, mut slots) = (AdmitOptions::default(), Vec::new());
    let prompt: Vec<u32> = (0..8).collect();
    kv.admit_tokens(SeqId(1), &prompt, &opts, &mut slots)
        .unwrap();
    let cached = kv.block_table(SeqId(1)).unwrap().to_vec();
    kv.free(SeqId(1)).unwrap();
    let a = kv
        .admit_tokens(SeqId(2), &prompt, &opts, &mut slots)
        .unwrap();
    assert_eq!(a.cached_tokens, 4);
    assert_ne!(kv.block_table(SeqId(2)).unwrap()[1], cached[1]);
    let mut step = Vec::new();
    kv.reserve(SeqId(2), 1, 0, &mut step, &mut CopyPlan::new())
        .unwrap();
    let table = kv.block_table(SeqId(2)).unwrap().to_vec();
    assert_eq!(table[..2], cached[..], "the reservation revived the copy");
    assert_eq!(kv.stats().cached_blocks, 0);
    let reset = kv.reset_prefix_cache().unwrap();
    assert_eq!((reset.evicted_blocks, reset.kept_live_blocks), (0, 2));
    let spill = pagedkv::executor::tier::spill_cached_prefixes(&mut kv, &mut storage).unwrap();
    assert_eq!((spill.spilled_blocks, spill.evicted_blocks), (0, 0));
    assert_eq!(kv.block_table(SeqId(2)).unwrap(), table);
    write(&mut storage, SeqId(2), 8, &step);
    kv.commit(SeqId(2), 1).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(
        kv.cached_prefix_len(&(0..9).collect::<Vec<_>>(), &opts)
            .unwrap(),
        8
    );
}

// ---------------------------------------------------------------------------------
// The model: every mover at any point of a step, against a byte shadow.
// ---------------------------------------------------------------------------------

/// What one position's K/V holds, as a tag: `token_tag` for a position admitted with
/// token ids (a function of the token prefix, as in a real model, so a prefix hit
/// reads the same bytes), a fresh counter for every other write, drafts included.
/// 0 is never written.
type Tag = u32;

/// Tags of positions admitted with token ids carry the high bit; counters stay below.
fn token_tag(prefix_hash: u64) -> Tag {
    (prefix_hash as u32) | 0x8000_0000
}

fn chain(prev: u64, token: u32) -> u64 {
    let mut z = prev.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(token);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 31)
}

/// One token's K (kind 0) or V (kind 1) bytes of `tag` in `layer`.
fn tag_bytes(tag: Tag, layer: usize, kind: u8, out: &mut Vec<u8>) {
    let n = layout().shape().head_dim * layout().dtype().size_bytes();
    // The tag, then bytes that tell the layer and the kind apart.
    out.extend_from_slice(&tag.to_le_bytes());
    out.extend((4..n).map(|i| (layer as u8) << 4 | kind << 2 | i as u8));
}

fn write_tags(storage: &mut HostStorage, slots: &[Slot], tags: &[Tag]) {
    assert_eq!(slots.len(), tags.len());
    for layer in 0..layout().num_layers() {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for &t in tags {
            tag_bytes(t, layer, 0, &mut k);
            tag_bytes(t, layer, 1, &mut v);
        }
        storage.write_slots(layer, slots, &k, &v).unwrap();
    }
}

/// The step a sequence is in: reserved, and perhaps written.
#[derive(Debug, Clone)]
struct Step {
    /// The first reserved position (the computed count at `reserve`).
    first: usize,
    /// Positions of this step (the rest of `slots` is lookahead).
    n: usize,
    /// The slots `reserve` handed out: `n` positions, then the lookahead.
    slots: Vec<Slot>,
    /// What the step wrote through `slots` (drafts in the lookahead), once written.
    written: Option<Vec<Tag>>,
}

#[derive(Debug, Clone, Default)]
struct Shadow {
    /// The tag of every computed position.
    computed: Vec<Tag>,
    step: Option<Step>,
}

#[derive(Debug, Clone)]
enum Action {
    /// `admit` of `len` fresh tokens, or (`prompt` is `Some`) `admit_tokens` of one of
    /// a few shared prompts plus a tail.
    Admit {
        len: u8,
        prompt: Option<u8>,
    },
    Reserve {
        pick: u8,
        n: u8,
        lookahead: u8,
    },
    /// The model writes the step of a sequence mid-step.
    Write {
        pick: u8,
    },
    /// `accept` of the step (clamped); an unwritten step is cancelled (`commit(seq, 0)`).
    Commit {
        pick: u8,
        accept: u8,
    },
    Defrag {
        opts: u8,
        planned: bool,
    },
    Shrink {
        by: u8,
        planned: bool,
    },
    Grow {
        by: u8,
    },
    Preempt {
        extra: u8,
        swap: bool,
    },
    Fork {
        pick: u8,
    },
    SwapOut {
        pick: u8,
    },
    SwapIn {
        pick: u8,
    },
    Truncate {
        pick: u8,
        len: u8,
    },
    ResetPrefix,
    Free {
        pick: u8,
    },
}

fn mover_action() -> impl proptest::strategy::Strategy<Value = Action> {
    use proptest::prelude::*;
    let b = any::<u8>;
    prop_oneof![
        3 => (1..14u8, prop::option::weighted(0.4, 0..3u8))
            .prop_map(|(len, prompt)| Action::Admit { len, prompt }),
        4 => (b(), 1..6u8, 0..3u8).prop_map(|(pick, n, lookahead)| Action::Reserve { pick, n, lookahead }),
        4 => b().prop_map(|pick| Action::Write { pick }),
        3 => (b(), b()).prop_map(|(pick, accept)| Action::Commit { pick, accept }),
        2 => (b(), any::<bool>()).prop_map(|(opts, planned)| Action::Defrag { opts, planned }),
        2 => (1..12u8, any::<bool>()).prop_map(|(by, planned)| Action::Shrink { by, planned }),
        1 => (1..12u8).prop_map(|by| Action::Grow { by }),
        1 => (0..8u8, any::<bool>()).prop_map(|(extra, swap)| Action::Preempt { extra, swap }),
        1 => b().prop_map(|pick| Action::Fork { pick }),
        1 => b().prop_map(|pick| Action::SwapOut { pick }),
        1 => b().prop_map(|pick| Action::SwapIn { pick }),
        1 => (b(), b()).prop_map(|(pick, len)| Action::Truncate { pick, len }),
        1 => Just(Action::ResetPrefix),
        1 => b().prop_map(|pick| Action::Free { pick }),
    ]
}

const MODEL_BLOCKS: usize = 12;
const MODEL_MAX_BLOCKS: usize = 24;

struct Model {
    kv: KvCache,
    storage: HostStorage,
    seqs: std::collections::BTreeMap<SeqId, Shadow>,
    /// Swapped out: the computed tags, read again after the swap-in.
    swapped: std::collections::BTreeMap<SeqId, Vec<Tag>>,
    next_seq: u64,
    next_tag: Tag,
    slots: Vec<Slot>,
    copies: CopyPlan,
    seen: Seen,
}

/// What a run exercised, so the test can tell that it reached the interleavings.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    /// Movers run while a step was reserved and not yet written.
    before_write: usize,
    /// Movers run while a step was written and not yet committed.
    before_commit: usize,
    /// Defragmentations and shrinks that moved blocks with a step in flight.
    moved_mid_step: usize,
    /// Refusals of a sequence mid-step.
    refused_mid_step: usize,
    /// Commits that made positions computed.
    commits: usize,
    swaps: usize,
}

/// Everything a refused call must leave as it was, swapped sequences included.
fn full_snapshot(kv: &KvCache, storage: &HostStorage) -> String {
    let mut ids: Vec<_> = kv.sequence_ids().collect();
    ids.sort();
    let tables: Vec<_> = ids
        .iter()
        .map(|&s| {
            (
                s,
                kv.block_table(s).ok().map(<[_]>::to_vec),
                kv.num_tokens(s).ok(),
                kv.num_computed_tokens(s).ok(),
            )
        })
        .collect();
    format!(
        "{:?} {:?} {:?} {:?} {tables:?} {} {}",
        kv.stats(),
        kv.tier_stats(),
        kv.fragmentation(),
        kv.pool().states(),
        kv.num_blocks(),
        storage.num_blocks()
    )
}

fn is_state_error(e: &Error, seq: SeqId) -> bool {
    matches!(e, Error::SequenceState { seq: s, .. } if *s == seq)
}

impl Model {
    fn new() -> Self {
        let kv = KvCache::builder(layout())
            .num_blocks(MODEL_BLOCKS)
            .max_num_blocks(MODEL_MAX_BLOCKS)
            .watermark_blocks(0)
            .tiers(TierConfig {
                num_host_blocks: 16,
                num_disk_slots: 0,
            })
            .build()
            .unwrap();
        let storage = HostStorage::with_host_tier(layout(), MODEL_BLOCKS, 16).unwrap();
        Model {
            kv,
            storage,
            seqs: Default::default(),
            swapped: Default::default(),
            next_seq: 0,
            next_tag: 1,
            slots: Vec::new(),
            copies: CopyPlan::new(),
            seen: Seen::default(),
        }
    }

    fn tag(&mut self) -> Tag {
        self.next_tag += 1;
        self.next_tag
    }

    fn pick(&self, p: u8) -> Option<SeqId> {
        let n = self.seqs.len();
        (n > 0).then(|| *self.seqs.keys().nth(p as usize % n).unwrap())
    }

    fn pick_mid_step(&self, p: u8) -> Option<SeqId> {
        let ids: Vec<_> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.step.is_some())
            .map(|(&id, _)| id)
            .collect();
        (!ids.is_empty()).then(|| ids[p as usize % ids.len()])
    }

    fn mid_step_tables(&self) -> Vec<(SeqId, Vec<pagedkv::BlockId>)> {
        self.seqs
            .iter()
            .filter(|(_, s)| s.step.is_some())
            .map(|(&id, _)| (id, self.kv.block_table(id).unwrap().to_vec()))
            .collect()
    }

    /// Runs a swap plan on the storage and completes it; the sequences move tiers.
    fn finish_swap(&mut self, job: &pagedkv::manager::SwapJob, seqs: &[SeqId], out: bool) {
        self.storage.swap(&job.plan).unwrap();
        self.seen.swaps += 1;
        self.kv.complete_swap(job.ticket).unwrap();
        for &id in seqs {
            if out {
                let s = self.seqs.remove(&id).unwrap();
                assert!(s.step.is_none(), "{id} swapped out mid-step");
                self.swapped.insert(id, s.computed);
            } else {
                let computed = self.swapped.remove(&id).unwrap();
                self.seqs.insert(
                    id,
                    Shadow {
                        computed,
                        step: None,
                    },
                );
            }
        }
    }

    fn apply(&mut self, a: &Action) {
        let before = full_snapshot(&self.kv, &self.storage);
        let in_flight = self.mid_step_tables();
        let frag = self.kv.fragmentation();
        let is_mover = !matches!(
            a,
            Action::Admit { .. }
                | Action::Reserve { .. }
                | Action::Write { .. }
                | Action::Commit { .. }
        );
        if is_mover {
            for s in self.seqs.values().filter_map(|s| s.step.as_ref()) {
                match s.written {
                    None => self.seen.before_write += 1,
                    Some(_) => self.seen.before_commit += 1,
                }
            }
        }
        // `None`: the action did not apply (no sequence to pick).
        let Some(refused) = self.act(a) else {
            return;
        };
        // `Err` of a call the model allows to fail: it must have changed nothing.
        if matches!(a, Action::Defrag { .. } | Action::Shrink { .. })
            && !in_flight.is_empty()
            && self.kv.fragmentation() != frag
        {
            self.seen.moved_mid_step += 1;
        }
        if let Some(e) = refused {
            if matches!(e, Error::SequenceState { seq, .. } if in_flight.iter().any(|t| t.0 == seq))
            {
                self.seen.refused_mid_step += 1;
            }
            assert_eq!(
                full_snapshot(&self.kv, &self.storage),
                before,
                "{a:?} refused ({e}) but changed the manager"
            );
        }
        // Nothing remaps a block a step is writing, whatever ran.
        for (seq, table) in in_flight {
            if self.seqs.get(&seq).is_some_and(|s| s.step.is_some()) {
                let now = self.kv.block_table(seq).unwrap();
                assert_eq!(now, table, "{a:?} remapped {seq} mid-step");
            }
        }
    }

    /// Runs `a`; `Some(Some(e))` when the manager refused it with `e`.
    fn act(&mut self, a: &Action) -> Option<Option<Error>> {
        Some(match *a {
            Action::Admit { len, prompt } => self.admit(len, prompt),
            Action::Reserve { pick, n, lookahead } => {
                let seq = self.pick(pick)?;
                let (n, lookahead) = (n as usize, lookahead as usize);
                let mid_step = self.seqs[&seq].step.is_some();
                self.copies.clear();
                match self
                    .kv
                    .reserve(seq, n, lookahead, &mut self.slots, &mut self.copies)
                {
                    Ok(()) => {
                        assert!(!mid_step, "{seq}: a second reservation went through");
                        assert_eq!(self.slots.len(), n + lookahead);
                        if !self.copies.is_empty() {
                            self.storage.copy_blocks(&self.copies).unwrap();
                        }
                        let s = self.seqs.get_mut(&seq).unwrap();
                        s.step = Some(Step {
                            first: s.computed.len(),
                            n,
                            slots: self.slots.clone(),
                            written: None,
                        });
                        None
                    }
                    Err(e) => {
                        assert!(!mid_step || is_state_error(&e, seq), "{e:?}");
                        Some(e)
                    }
                }
            }
            Action::Write { pick } => {
                let seq = self.pick_mid_step(pick)?;
                let step = self.seqs[&seq].step.clone().unwrap();
                if step.written.is_some() {
                    return Some(None);
                }
                let tags: Vec<Tag> = (0..step.slots.len()).map(|_| self.tag()).collect();
                write_tags(&mut self.storage, &step.slots, &tags);
                self.seqs
                    .get_mut(&seq)
                    .unwrap()
                    .step
                    .as_mut()
                    .unwrap()
                    .written = Some(tags);
                None
            }
            Action::Commit { pick, accept } => {
                let seq = self.pick_mid_step(pick)?;
                let s = self.seqs.get_mut(&seq).unwrap();
                let step = s.step.take().unwrap();
                let accept = match &step.written {
                    Some(tags) => {
                        let accept = accept as usize % (step.n + 1);
                        s.computed.extend_from_slice(&tags[..accept]);
                        self.seen.commits += usize::from(accept > 0);
                        accept
                    }
                    None => 0,
                };
                self.kv.commit(seq, accept).unwrap();
                None
            }
            Action::Defrag { opts, planned } => {
                let opts = match opts % 3 {
                    0 => DefragOptions::FULL,
                    1 => DefragOptions::incremental(1 + opts as usize % 4),
                    _ => DefragOptions::FULL.above(f64::from(opts) / 255.0),
                };
                if planned {
                    let pending = self.kv.plan_defragment(opts).unwrap();
                    if !pending.plan().is_empty() {
                        self.storage
                            .copy_blocks(&pending.plan().to_copy_plan())
                            .unwrap();
                    }
                    pending.commit().unwrap();
                } else {
                    defragment_with(&mut self.kv, &mut self.storage, opts).unwrap();
                }
                None
            }
            Action::Shrink { by, planned } => {
                let target = self.kv.num_blocks().saturating_sub(by as usize).max(1);
                if planned {
                    match self.kv.plan_shrink(target) {
                        Ok(pending) => {
                            if !pending.plan().is_empty() {
                                self.storage
                                    .copy_blocks(&pending.plan().to_copy_plan())
                                    .unwrap();
                            }
                            self.storage.resize(target).unwrap();
                            pending.commit().unwrap();
                            None
                        }
                        Err(e) => Some(e),
                    }
                } else {
                    shrink_to(&mut self.kv, target, &mut self.storage).err()
                }
            }
            Action::Grow { by } => {
                let target = self.kv.num_blocks() + by as usize;
                pagedkv::executor::grow_to(&mut self.kv, target, &mut self.storage).err()
            }
            Action::Preempt { extra, swap } => {
                let needed = self.kv.num_available_blocks() + 1 + extra as usize;
                let policy = PreemptPolicy {
                    mode: if swap {
                        PreemptMode::AlwaysSwap
                    } else {
                        PreemptMode::AlwaysRecompute
                    },
                    cost: CostModel::new(1e9, 1e4).unwrap(),
                    unschedule_below: None,
                };
                match self.kv.preempt_for(needed, &policy) {
                    Ok(preempted) => {
                        for p in preempted {
                            assert!(p.unscheduled.is_empty());
                            for id in &p.seqs {
                                assert!(self.seqs[id].step.is_none(), "preempted {id} mid-step");
                            }
                            match p.action {
                                PreemptAction::Swap(job) => self.finish_swap(&job, &p.seqs, true),
                                PreemptAction::SwapGroups(_) => {
                                    panic!("a one-group cache swaps with a SwapJob")
                                }
                                PreemptAction::Recompute { .. } => {
                                    for id in &p.seqs {
                                        self.seqs.remove(id);
                                    }
                                }
                            }
                        }
                        None
                    }
                    Err(e) => Some(e),
                }
            }
            Action::Fork { pick } => {
                let parent = self.pick(pick)?;
                let child = SeqId(self.next_seq);
                self.next_seq += 1;
                let mid_step = self.seqs[&parent].step.is_some();
                match self.kv.fork(parent, child) {
                    Ok(()) => {
                        assert!(!mid_step, "fork of {parent} mid-step went through");
                        let computed = self.seqs[&parent].computed.clone();
                        self.seqs.insert(
                            child,
                            Shadow {
                                computed,
                                step: None,
                            },
                        );
                        None
                    }
                    Err(e) => {
                        assert!(mid_step && is_state_error(&e, parent), "{e:?}");
                        Some(e)
                    }
                }
            }
            Action::SwapOut { pick } => {
                let seq = self.pick(pick)?;
                let mid_step = self.seqs[&seq].step.is_some();
                match self.kv.swap_out(seq) {
                    Ok(job) => {
                        assert!(!mid_step, "swap-out of {seq} mid-step went through");
                        self.finish_swap(&job, &[seq], true);
                        None
                    }
                    Err(e) => {
                        assert!(!mid_step || is_state_error(&e, seq), "{e:?}");
                        Some(e)
                    }
                }
            }
            Action::SwapIn { pick } => {
                let n = self.swapped.len();
                if n == 0 {
                    return Some(None);
                }
                let seq = *self.swapped.keys().nth(pick as usize % n).unwrap();
                match self.kv.swap_in(seq) {
                    Ok(job) => {
                        self.finish_swap(&job, &[seq], false);
                        None
                    }
                    Err(e) => Some(e),
                }
            }
            Action::Truncate { pick, len } => {
                let seq = self.pick(pick)?;
                let new_len = len as usize % (self.kv.num_tokens(seq).unwrap() + 1);
                let mid_step = self.seqs[&seq].step.is_some();
                match self.kv.truncate(seq, new_len) {
                    Ok(()) => {
                        assert!(!mid_step, "truncate of {seq} mid-step went through");
                        self.seqs.get_mut(&seq).unwrap().computed.truncate(new_len);
                        None
                    }
                    Err(e) => {
                        assert!(mid_step && is_state_error(&e, seq), "{e:?}");
                        Some(e)
                    }
                }
            }
            Action::ResetPrefix => {
                self.kv.reset_prefix_cache().unwrap();
                None
            }
            Action::Free { pick } => {
                // Of any sequence: one mid-step is its owner abandoning the step.
                let seq = self.pick(pick)?;
                self.kv.free(seq).unwrap();
                self.seqs.remove(&seq);
                None
            }
        })
    }

    fn admit(&mut self, len: u8, prompt: Option<u8>) -> Option<Error> {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        let Some(p) = prompt else {
            let len = len as usize;
            if let Err(e) = self.kv.admit(seq, len, &mut self.slots) {
                return Some(e);
            }
            let tags: Vec<Tag> = (0..len).map(|_| self.tag()).collect();
            write_tags(&mut self.storage, &self.slots.clone(), &tags);
            self.seqs.insert(
                seq,
                Shadow {
                    computed: tags,
                    step: None,
                },
            );
            return None;
        };
        let mut tokens: Vec<u32> = match p {
            0 => (0..10).collect(),
            1 => (0..6).chain(50..57).collect(),
            _ => (100..109).collect(),
        };
        tokens.extend((0..u32::from(len % 5)).map(|i| 900 + i));
        let adm =
            match self
                .kv
                .admit_tokens(seq, &tokens, &AdmitOptions::default(), &mut self.slots)
            {
                Ok(adm) => adm,
                Err(e) => return Some(e),
            };
        let mut hash = 0;
        let tags: Vec<Tag> = tokens
            .iter()
            .map(|&t| {
                hash = chain(hash, t);
                token_tag(hash)
            })
            .collect();
        write_tags(
            &mut self.storage,
            &self.slots.clone(),
            &tags[adm.cached_tokens..],
        );
        self.seqs.insert(
            seq,
            Shadow {
                computed: tags,
                step: None,
            },
        );
        None
    }

    /// Reads every resident sequence back through its current table: computed
    /// positions through `readable_blocks`, a written step through the table its
    /// slots address, and the slots of every step still address that table.
    fn check(&self, after: &Action) {
        if let Err(e) = self.kv.check_invariants() {
            panic!("after {after:?}: invariant broken: {e}");
        }
        assert_eq!(self.storage.num_blocks(), self.kv.num_blocks());
        let l = layout();
        for (&seq, s) in &self.seqs {
            let (blocks, computed) = self.kv.readable_blocks(seq).unwrap();
            assert_eq!(
                computed,
                s.computed.len(),
                "after {after:?}: {seq} computed"
            );
            self.expect_tags(seq, blocks, 0, &s.computed, after);
            let Some(step) = &s.step else { continue };
            let table = self.kv.block_table(seq).unwrap();
            for (i, &slot) in step.slots.iter().enumerate() {
                let pos = step.first + i;
                let want = table.get(pos / BS).map(|&b| l.slot(b, pos % BS));
                assert_eq!(
                    want,
                    Some(slot),
                    "after {after:?}: {seq} position {pos}: the step's slot went stale"
                );
            }
            if let Some(tags) = &step.written {
                self.expect_tags(seq, table, step.first, tags, after);
            }
        }
    }

    /// Positions `first..first + tags.len()` of `seq`, read through `table`, hold
    /// `tags`' bytes.
    fn expect_tags(
        &self,
        seq: SeqId,
        table: &[pagedkv::BlockId],
        first: usize,
        tags: &[Tag],
        after: &Action,
    ) {
        let len = first + tags.len();
        if tags.is_empty() {
            return;
        }
        for layer in 0..layout().num_layers() {
            let per_token = layout().shape().head_dim * layout().dtype().size_bytes();
            let (mut rk, mut rv) = (vec![0; len * per_token], vec![0; len * per_token]);
            self.storage
                .read_tokens(layer, table, len, &mut rk, &mut rv)
                .unwrap();
            for (i, &t) in tags.iter().enumerate() {
                let (mut k, mut v) = (Vec::new(), Vec::new());
                tag_bytes(t, layer, 0, &mut k);
                tag_bytes(t, layer, 1, &mut v);
                let r = (first + i) * per_token..(first + i + 1) * per_token;
                assert!(
                    rk[r.clone()] == k[..] && rv[r] == v[..],
                    "after {after:?}: {seq} layer {layer} position {}: K/V bytes are not \
                     the ones written (want tag {t:#x})",
                    first + i
                );
            }
        }
    }

    /// Frees everything: nothing leaks.
    fn finish(mut self) -> Seen {
        let ids: Vec<_> = self
            .seqs
            .keys()
            .chain(self.swapped.keys())
            .copied()
            .collect();
        for id in ids {
            self.kv.free(id).unwrap();
        }
        self.kv.evict_cached(usize::MAX);
        self.kv.check_invariants().unwrap();
        let s = self.kv.stats();
        assert_eq!((s.used_blocks, s.cached_blocks), (0, 0), "leak");
        assert_eq!(self.kv.tier_stats().host_used_blocks, 0, "host tier leak");
        self.seen
    }
}

/// Every mover (defragmentation, one-call and planned; shrink, one-call and
/// planned; grow; preemption; fork; swap out and in; truncate; prefix reset; free of
/// another sequence) at any point of a step: before `reserve`, between `reserve` and
/// the step's write, between the write and `commit`. Movers that refuse a sequence
/// mid-step return `SequenceState` and change nothing; the others leave the step's
/// blocks where its slots say; every committed position reads the bytes its step
/// wrote, through the sequence's current table. Reverting the defragmentation fix
/// (an empty `in_flight_blocks`) fails the table check at the move; with that check
/// off, the byte shadow still catches it when a write follows the move (found in some
/// runs, not all: the table check is the reliable one).
#[test]
fn every_mover_between_reserve_and_commit_keeps_the_steps_bytes() {
    use proptest::prelude::*;
    use proptest::test_runner::TestRunner;
    let config = ProptestConfig {
        source_file: Some(file!()),
        ..crate::support::proptest_config(256)
    };
    let mut runner = TestRunner::new(config);
    let total = std::cell::RefCell::new(Vec::new());
    let result = runner.run(&prop::collection::vec(mover_action(), 8..64), |actions| {
        let mut m = Model::new();
        for a in &actions {
            m.apply(a);
            m.check(a);
        }
        total.borrow_mut().push(m.finish());
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}\n{runner}");
    }
    let total = total.into_inner();
    let cases = |f: fn(&Seen) -> usize| total.iter().filter(|s| f(s) > 0).count();
    eprintln!(
        "cases with: mover before write {}, before commit {}, moves mid-step {}, refusals {}, commits {}, swaps {} (of {})",
        cases(|s| s.before_write),
        cases(|s| s.before_commit),
        cases(|s| s.moved_mid_step),
        cases(|s| s.refused_mid_step),
        cases(|s| s.commits),
        cases(|s| s.swaps),
        total.len()
    );
    // 256 cases see about 167, 127, 77, 147, 97 and 140; the floors are far below.
    for (what, n, floor) in [
        ("a mover before the write", cases(|s| s.before_write), 64),
        ("a mover before the commit", cases(|s| s.before_commit), 48),
        ("a move mid-step", cases(|s| s.moved_mid_step), 24),
        ("a refusal mid-step", cases(|s| s.refused_mid_step), 48),
        ("a commit", cases(|s| s.commits), 32),
        ("a swap", cases(|s| s.swaps), 48),
    ] {
        assert!(n >= floor, "only {n} cases saw {what}");
    }
}
