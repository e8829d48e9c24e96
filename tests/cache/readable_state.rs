//! Reliability, round 2: defects found from outside through the public API, each with
//! the class it belongs to.
//!
//! - Every entry point that reads a sequence's bytes agrees on which states are
//!   readable: one predicate ([`KvCache::readable_blocks`]), checked here for
//!   every state a sequence can be in.
//! - Every counter the metrics publish equals what the tables say:
//!   `check_invariants` recomputes each block's fill (the most any holder holds in it)
//!   and the live-slot counter from the tables; these are the cases that drifted.

use pagedkv::export::{export_sequence, exported_len};
use pagedkv::tables::{CsrTables, PaddedTables};
use pagedkv::{
    AdmitOptions, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape, SeqId,
    Storage, TierConfig,
};

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    KvLayout::new(shape, 4).unwrap()
}

fn manager() -> KvCache {
    KvCache::builder(layout())
        .num_blocks(16)
        .watermark_blocks(0)
        .tiers(TierConfig {
            num_host_blocks: 16,
            num_disk_slots: 0,
        })
        .build()
        .unwrap()
}

/// The tokens the tables really hold: for each block, the most any holder holds.
fn real_live_slots(kv: &KvCache, seqs: &[SeqId]) -> usize {
    let mut fill = std::collections::HashMap::new();
    for &id in seqs {
        let Ok(table) = kv.block_table(id) else {
            continue;
        };
        let n = kv.num_tokens(id).unwrap();
        for (i, b) in table.iter().enumerate() {
            let held = n.saturating_sub(i * 4).min(4);
            let f = fill.entry(*b).or_insert(0);
            *f = held.max(*f);
        }
    }
    fill.values().sum()
}

/// Truncating into a block a fork shares, then freeing the longer holder: the block
/// held 3 slots for the manager, 1 in truth.
#[test]
fn truncate_into_a_fork_shared_block_keeps_utilisation_exact() {
    let mut kv = manager();
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 7, &mut slots).unwrap(); // block 1 holds 3
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    kv.truncate(SeqId(2), 5).unwrap(); // holder 2 holds 1 of block 1
    assert_eq!(kv.stats().live_token_slots, 7);
    kv.free(SeqId(1)).unwrap();
    assert_eq!(kv.stats().live_token_slots, 5);
    assert_eq!(real_live_slots(&kv, &[SeqId(2)]), 5);
    kv.check_invariants().unwrap();
    // The other way: the shorter holder leaves first.
    kv.admit(SeqId(3), 7, &mut slots).unwrap();
    kv.fork(SeqId(3), SeqId(4)).unwrap();
    kv.truncate(SeqId(3), 6).unwrap();
    kv.truncate(SeqId(4), 5).unwrap();
    assert_eq!(
        kv.stats().live_token_slots,
        real_live_slots(&kv, &[SeqId(2), SeqId(3), SeqId(4)])
    );
    kv.free(SeqId(4)).unwrap();
    assert_eq!(
        kv.stats().live_token_slots,
        real_live_slots(&kv, &[SeqId(2), SeqId(3)])
    );
    kv.check_invariants().unwrap();
}

/// A group swap-in gives a block that a fork and its truncated parent share the
/// longer holder's fill; when that holder went, the fill stayed ("block #1: fill 4 but
/// its holders hold 1") and `live_token_slots` counted 8 for 5 tokens. Reached by
/// `preempt_for`'s swap action too.
#[test]
fn a_group_swap_in_keeps_shared_fills_exact() {
    let mut kv = manager();
    let mut storage = HostStorage::with_host_tier(layout(), 16, 16).unwrap();
    let mut slots = Vec::new();
    let round_trip = |kv: &mut KvCache, storage: &mut HostStorage| {
        let group = [SeqId(1), SeqId(2)];
        let job = kv.swap_out_group(&group).unwrap();
        storage.swap(&job.plan).unwrap();
        kv.complete_swap(job.ticket).unwrap();
        let job = kv.swap_in_group(&group).unwrap();
        storage.swap(&job.plan).unwrap();
        kv.complete_swap(job.ticket).unwrap();
        kv.check_invariants().unwrap();
    };
    kv.admit(SeqId(1), 8, &mut slots).unwrap();
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    kv.truncate(SeqId(2), 5).unwrap();
    round_trip(&mut kv, &mut storage);
    kv.free(SeqId(1)).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.stats().live_token_slots, 5);
    assert_eq!(real_live_slots(&kv, &[SeqId(2)]), 5);
    // The other way: the shorter holder (here the parent) leaves first.
    kv.free(SeqId(2)).unwrap();
    kv.admit(SeqId(1), 8, &mut slots).unwrap();
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    kv.truncate(SeqId(1), 6).unwrap();
    round_trip(&mut kv, &mut storage);
    kv.free(SeqId(1)).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.stats().live_token_slots, 8);
    kv.truncate(SeqId(2), 5).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.stats().live_token_slots, 5);
}

/// Truncating into a block the prefix cache shares: a second request holds the whole
/// block, so truncation must not lower it; when the other leaves, it must.
#[test]
fn truncate_into_a_prefix_shared_block_keeps_utilisation_exact() {
    let mut kv = manager();
    let mut slots = Vec::new();
    let opts = AdmitOptions::default();
    let p: Vec<u32> = (0..9).collect();
    kv.admit_tokens(SeqId(1), &p, &opts, &mut slots).unwrap();
    let a = kv.admit_tokens(SeqId(2), &p, &opts, &mut slots).unwrap();
    assert_eq!(a.cached_blocks, 2);
    kv.truncate(SeqId(1), 6).unwrap(); // into block 1, which 2 holds whole
    let all = [SeqId(1), SeqId(2)];
    assert_eq!(kv.stats().live_token_slots, real_live_slots(&kv, &all));
    kv.free(SeqId(2)).unwrap();
    assert_eq!(
        kv.stats().live_token_slots,
        real_live_slots(&kv, &[SeqId(1)])
    );
    assert_eq!(kv.stats().live_token_slots, 6);
    // A new request hits the block that holder 1 truncated into (its bytes are whole
    // and still registered): the new holder holds it whole.
    let a = kv.admit_tokens(SeqId(3), &p, &opts, &mut slots).unwrap();
    assert_eq!(a.cached_blocks, 2);
    let all = [SeqId(1), SeqId(3)];
    assert_eq!(kv.stats().live_token_slots, real_live_slots(&kv, &all));
    kv.check_invariants().unwrap();
}

/// A sequence whose swap-in is planned but not executed was exported with the device
/// bytes still there (another sequence's) and valid checksums.
#[test]
fn no_entry_point_reads_a_sequence_mid_swap() {
    let l = layout();
    let mut kv = manager();
    let mut storage = HostStorage::with_host_tier(l, 16, 16).unwrap();
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 6, &mut slots).unwrap();
    let mut out = vec![0u8; exported_len(&l, 7, false).unwrap()];
    let mut padded = PaddedTables::default();
    let mut csr = CsrTables::default();

    // Every state, and whether its bytes are readable.
    let mut states: Vec<(&str, bool)> = Vec::new();
    let mut check = |kv: &KvCache, storage: &HostStorage, name: &'static str| {
        let readable = kv.readable_blocks(SeqId(1)).is_ok();
        let export = export_sequence(kv, storage, SeqId(1), None, &mut out);
        let fill_p = kv.fill_padded(&[SeqId(1)], &mut padded);
        let fill_c = kv.fill_csr(&[SeqId(1)], &mut csr);
        for (what, r) in [
            ("export", export.map(drop)),
            ("fill_padded", fill_p),
            ("fill_csr", fill_c),
        ] {
            assert_eq!(
                r.is_ok(),
                readable,
                "{what} disagrees with readable_blocks in state {name}: {r:?}"
            );
            if let Err(e) = r {
                assert!(
                    matches!(e, Error::SequenceState { .. } | Error::UnknownSequence(_)),
                    "{what} in state {name}: {e}"
                );
            }
        }
        states.push((name, readable));
    };
    check(&kv, &storage, "resident");
    let mut copies = CopyPlan::new();
    kv.reserve(SeqId(1), 1, 2, &mut slots, &mut copies).unwrap();
    check(&kv, &storage, "resident with a reservation");
    kv.commit(SeqId(1), 1).unwrap();
    let job = kv.swap_out(SeqId(1)).unwrap();
    check(&kv, &storage, "swapping out");
    storage.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    check(&kv, &storage, "swapped out");
    let job = kv.swap_in(SeqId(1)).unwrap();
    check(&kv, &storage, "swapping in");
    storage.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    check(&kv, &storage, "resident again");
    kv.free(SeqId(1)).unwrap();
    check(&kv, &storage, "freed");
    assert_eq!(
        states,
        [
            ("resident", true),
            ("resident with a reservation", true),
            ("swapping out", false),
            ("swapped out", false),
            ("swapping in", false),
            ("resident again", true),
            ("freed", false),
        ]
    );
    kv.check_invariants().unwrap();
}

/// Fixed-shape tables for graph capture: the shape never depends on the batch.
#[test]
fn fixed_shape_tables_keep_their_shape() {
    let mut kv = manager();
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 9, &mut slots).unwrap();
    kv.admit(SeqId(2), 2, &mut slots).unwrap();
    let mut t = PaddedTables::default();
    kv.fill_padded_fixed(&[SeqId(1), SeqId(2)], 4, 8, &mut t)
        .unwrap();
    assert_eq!((t.batch, t.max_blocks, t.tables.len()), (4, 8, 32));
    assert_eq!(t.context_lens, [9, 2, 0, 0]);
    let cap = (t.tables.capacity(), t.context_lens.capacity());
    kv.fill_padded_fixed(&[SeqId(2)], 4, 8, &mut t).unwrap();
    assert_eq!((t.batch, t.max_blocks), (4, 8));
    assert_eq!(t.context_lens, [2, 0, 0, 0]);
    assert_eq!((t.tables.capacity(), t.context_lens.capacity()), cap);
    pagedkv::tables::validate_tables(kv.layout(), kv.num_blocks(), &t).unwrap();
    let before = t.clone();
    assert!(matches!(
        kv.fill_padded_fixed(&[SeqId(1)], 4, 2, &mut t),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        kv.fill_padded_fixed(&[SeqId(1), SeqId(2)], 1, 8, &mut t),
        Err(Error::ShapeMismatch { .. })
    ));
    assert_eq!(t, before);
}
