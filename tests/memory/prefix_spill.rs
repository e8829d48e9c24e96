//! Spilling the prefix cache to the host tier and restoring it, on one manager: what is
//! spilled (only what an eviction of everything would drop: not blocks referenced,
//! pinned, or above such blocks), the restore's order and its room, and the spilled
//! blocks it gives up (content computed again meanwhile, parent gone). Bytes are
//! checked block by block against what was written before the spill.

use crate::support::tiers::{layout, BS};

use pagedkv::executor::tier::{restore_spilled_prefixes, spill_cached_prefixes};
use pagedkv::{AdmitOptions, HostStorage, KvCache, SeqId, Storage, TierConfig};

fn setup(blocks: usize, host: usize) -> (KvCache, HostStorage) {
    let layout = layout();
    let kv = KvCache::builder(layout)
        .num_blocks(blocks)
        .watermark_blocks(0)
        .max_pinned_blocks(blocks)
        .tiers(TierConfig {
            num_host_blocks: host,
            ..TierConfig::default()
        })
        .build()
        .unwrap();
    (
        kv,
        HostStorage::with_host_tier(layout, blocks, host).unwrap(),
    )
}

/// Layer `layer`'s K/V bytes of token id `t` at `pos`: a function of both, so a block
/// holds the same bytes whichever request computed it.
fn pattern(t: u32, pos: usize, layer: usize, kind: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (t as usize * 31 + pos * 7 + layer * 3 + kind as usize + i * 13) as u8)
        .collect()
}

fn token_len(storage: &HostStorage) -> usize {
    let s = storage.layout().shape();
    s.num_kv_heads * s.head_dim * s.kv_dtype.size_bytes()
}

/// Admits `prompt` as `seq` and writes the K/V of the tokens the cache did not hold.
fn admit(kv: &mut KvCache, storage: &mut HostStorage, seq: u64, prompt: &[u32]) -> usize {
    let mut slots = Vec::new();
    let a = kv
        .admit_tokens(SeqId(seq), prompt, &AdmitOptions::default(), &mut slots)
        .unwrap();
    let n = token_len(storage);
    for layer in 0..2 {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (i, &t) in prompt[a.cached_tokens..].iter().enumerate() {
            k.extend(pattern(t, a.cached_tokens + i, layer, 0, n));
            v.extend(pattern(t, a.cached_tokens + i, layer, 1, n));
        }
        storage.write_slots(layer, &slots, &k, &v).unwrap();
    }
    a.cached_tokens
}

/// Checks every token of `seq` against the pattern.
fn check(kv: &KvCache, storage: &HostStorage, seq: u64, prompt: &[u32]) {
    let table = kv.block_table(SeqId(seq)).unwrap();
    let n = token_len(storage);
    for layer in 0..2 {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (i, &t) in prompt.iter().enumerate() {
            k.extend(pattern(t, i, layer, 0, n));
            v.extend(pattern(t, i, layer, 1, n));
        }
        let (mut rk, mut rv) = (vec![0; k.len()], vec![0; v.len()]);
        storage
            .read_tokens(layer, table, prompt.len(), &mut rk, &mut rv)
            .unwrap();
        assert!(rk == k && rv == v, "seq {seq} layer {layer}: bytes differ");
    }
}

fn scribble(storage: &mut HostStorage) {
    for layer in 0..2 {
        storage.region_mut(layer).fill(0x5A);
    }
}

fn cached(kv: &KvCache, prompt: &[u32]) -> usize {
    kv.cached_prefix_len(prompt, &AdmitOptions::default())
        .unwrap()
}

#[test]
fn referenced_and_pinned_blocks_and_their_ancestors_stay_on_the_device() {
    let (mut kv, mut storage) = setup(32, 32);
    // A: 4 blocks, live. B shares A's first 2 blocks, then 2 of its own; freed.
    let a: Vec<u32> = (0..17).collect();
    let mut b: Vec<u32> = (0..8).collect();
    b.extend(100..109);
    admit(&mut kv, &mut storage, 1, &a);
    assert_eq!(admit(&mut kv, &mut storage, 2, &b), 8);
    kv.free(SeqId(2)).unwrap();
    // C: 3 blocks, freed, and its first 2 pinned: only C's third block may go.
    let c: Vec<u32> = (200..213).collect();
    admit(&mut kv, &mut storage, 3, &c);
    kv.free(SeqId(3)).unwrap();
    let pin = kv.pin_prefix(&c[..8], &AdmitOptions::default()).unwrap();
    let spill = spill_cached_prefixes(&mut kv, &mut storage).unwrap();
    // B's 2 own blocks (their parent is A's live block) and C's third.
    assert_eq!((spill.spilled_blocks, spill.evicted_blocks), (3, 0));
    kv.check_invariants().unwrap();
    assert_eq!(cached(&kv, &b), 8); // A's shared blocks are still here
    assert_eq!(cached(&kv, &c), 8); // the pinned ones too
    let r = restore_spilled_prefixes(&mut kv, &mut storage).unwrap();
    assert_eq!(
        (r.restored_blocks, r.dropped_blocks, r.still_spilled_blocks),
        (3, 0, 0)
    );
    assert_eq!(cached(&kv, &b), 16);
    assert_eq!(cached(&kv, &c), 12);
    kv.unpin_prefix(pin.id).unwrap();
    assert_eq!(admit(&mut kv, &mut storage, 4, &b), 16);
    check(&kv, &storage, 4, &b);
    kv.check_invariants().unwrap();
}

#[test]
fn restore_gives_up_blocks_that_can_never_hit_and_waits_for_room() {
    let (mut kv, mut storage) = setup(16, 32);
    // A live; B hangs off A's first block and is freed (cached, child of a live block).
    let a: Vec<u32> = (0..9).collect();
    let mut b: Vec<u32> = (0..4).collect();
    b.extend(50..59);
    admit(&mut kv, &mut storage, 1, &a);
    admit(&mut kv, &mut storage, 2, &b);
    kv.free(SeqId(2)).unwrap();
    // D: 3 blocks of its own, freed.
    let d: Vec<u32> = (300..313).collect();
    admit(&mut kv, &mut storage, 3, &d);
    kv.free(SeqId(3)).unwrap();
    let spill = spill_cached_prefixes(&mut kv, &mut storage).unwrap();
    assert_eq!(spill.spilled_blocks, 5); // B's 2 own blocks, D's 3
                                         // A leaves and is evicted: B's spilled blocks lost their parent. D is computed
                                         // again on the device: its spilled copies are duplicates now.
    kv.free(SeqId(1)).unwrap();
    kv.evict_cached(usize::MAX);
    admit(&mut kv, &mut storage, 4, &d);
    let r = restore_spilled_prefixes(&mut kv, &mut storage).unwrap();
    assert_eq!(
        (r.restored_blocks, r.dropped_blocks, r.still_spilled_blocks),
        (0, 5, 0)
    );
    assert_eq!(kv.spilled_prefix_blocks(), 0);
    assert_eq!(kv.tier_stats().host_used_blocks, 0);
    kv.check_invariants().unwrap();
    kv.free(SeqId(4)).unwrap();
    kv.evict_cached(usize::MAX);

    // Room for 2 of 3 blocks: the first two of the chain come back, the third waits
    // for a later restore.
    let e: Vec<u32> = (400..413).collect();
    admit(&mut kv, &mut storage, 5, &e);
    kv.free(SeqId(5)).unwrap();
    assert_eq!(
        spill_cached_prefixes(&mut kv, &mut storage)
            .unwrap()
            .spilled_blocks,
        3
    );
    scribble(&mut storage);
    let mut slots = Vec::new();
    kv.admit(SeqId(6), 14 * BS, &mut slots).unwrap(); // leaves 2 free blocks
    let r = restore_spilled_prefixes(&mut kv, &mut storage).unwrap();
    assert_eq!(
        (r.restored_blocks, r.dropped_blocks, r.still_spilled_blocks),
        (2, 0, 1)
    );
    assert_eq!(cached(&kv, &e), 8);
    kv.check_invariants().unwrap();
    kv.free(SeqId(6)).unwrap();
    let r = restore_spilled_prefixes(&mut kv, &mut storage).unwrap();
    assert_eq!((r.restored_blocks, r.still_spilled_blocks), (1, 0));
    assert_eq!(admit(&mut kv, &mut storage, 7, &e), 12);
    check(&kv, &storage, 7, &e);
    kv.check_invariants().unwrap();
}
