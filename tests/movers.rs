//! Reliability, round 3: nothing moves a block that this step is writing.
//!
//! Between `reserve` (or `reserve_step`) and `commit` the model writes K/V through the
//! slots it was handed, so every block of a sequence holding a reservation is in
//! flight: defragmentation plans around those blocks, a shrink whose tail holds one
//! refuses (changing nothing), the broker takes no memory from a model mid-step, and
//! `truncate` refuses a sequence mid-step. Each case writes the step through the
//! reserved slots after the mover ran and reads the committed bytes back from
//! `HostStorage`, and each refusal leaves everything as it was. (The round's two
//! bookkeeping defects have their tests beside their kin: `tests/reliability.rs` for
//! the group swap-in's fills, `tests/prefix.rs` for the one rule of token ids.)

use pagedkv::broker::{Broker, BrokerConfig, ModelLimits, SleepOptions};
use pagedkv::executor::{defragment_with, shrink_to};
use pagedkv::{
    AdmitOptions, CopyPlan, DType, DefragOptions, Error, GroupSpec, GroupStep, HostStorage,
    KvCacheGroups, KvCacheManager, KvLayout, ModelShape, SeqId, Slot, Storage, TierConfig,
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

fn manager(num_blocks: usize) -> (KvCacheManager, HostStorage) {
    let kv = KvCacheManager::builder(layout())
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
fn check(kv: &KvCacheManager, storage: &HostStorage, seq: SeqId, len: usize) {
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
fn snapshot(kv: &KvCacheManager, storage: &HostStorage) -> String {
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
fn reserved_above_a_hole() -> (KvCacheManager, HostStorage, Vec<Slot>) {
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
    let mut kv = KvCacheGroups::new(&[GroupSpec::full(l), GroupSpec::full(l)], 8)
        .unwrap()
        .with_watermark(0)
        .unwrap();
    let mut step = GroupStep::default();
    kv.admit(SeqId(1), 4, &mut step).unwrap();
    kv.admit(SeqId(2), 3, &mut step).unwrap();
    kv.free(SeqId(1)).unwrap();
    kv.reserve(SeqId(2), 1, 0, &mut step).unwrap();
    let tables: Vec<_> = (0..2)
        .map(|g| kv.group(g).block_table(SeqId(2)).unwrap().to_vec())
        .collect();
    let pending = kv.plan_defragment();
    assert!(pending.plan().is_empty(), "{:?}", pending.plan());
    pending.commit().unwrap();
    for (g, t) in tables.iter().enumerate() {
        assert_eq!(kv.group(g).block_table(SeqId(2)).unwrap(), t);
    }
    kv.commit(SeqId(2), 1).unwrap();
    kv.check_invariants().unwrap();
    let pending = kv.plan_defragment();
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
        let kv = KvCacheManager::builder(l)
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
