//! Hostile input on every public entry point: out-of-range ids, lengths near
//! `u32::MAX`/`usize::MAX`, zero sizes, NaN/inf scales, mismatched shapes, tables that
//! point outside the arena or at freed blocks. Each gets a typed error, never a panic or
//! an out-of-bounds access, and the state is unchanged.

use pagedkv::attention::cpu::{paged_decode, reshape_and_cache};
use pagedkv::attention::reference::paged_decode_reference;
use pagedkv::attention::AttentionParams;
use pagedkv::layout::plans::SwapDirection;
use pagedkv::layout::Slot;
use pagedkv::pool::sharded::ShardedPool;
use pagedkv::pool::BlockPool;
use pagedkv::tables::{CsrTables, PaddedTables};
use pagedkv::{
    BlockId, CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape,
    SeqId, Storage, SwapPlan,
};

const BS: usize = 4;
const BLOCKS: usize = 16;

fn shape() -> ModelShape {
    ModelShape {
        num_layers: 2,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        kv_dtype: DType::BF16,
    }
}

fn setup() -> (KvCache, HostStorage) {
    let layout = KvLayout::new(shape(), BS).unwrap();
    let kv = KvCache::new(
        layout,
        CacheConfig {
            watermark_blocks: 0,
            ..CacheConfig::new(BLOCKS)
        },
    )
    .unwrap();
    (kv, HostStorage::with_host_tier(layout, BLOCKS, 4).unwrap())
}

fn snapshot(kv: &KvCache) -> String {
    let mut ids: Vec<_> = kv.sequence_ids().collect();
    ids.sort();
    let t: Vec<_> = ids
        .iter()
        .map(|&s| {
            (
                kv.block_table(s).unwrap().to_vec(),
                kv.num_tokens(s).unwrap(),
            )
        })
        .collect();
    format!("{:?} {t:?}", kv.stats())
}

#[test]
fn manager_lengths_near_the_limits() {
    let (mut kv, _) = setup();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 5, &mut slots).unwrap();
    let before = snapshot(&kv);
    for n in [
        usize::MAX,
        usize::MAX / 2,
        u32::MAX as usize,
        u32::MAX as usize + 1,
        BLOCKS * BS + 1,
    ] {
        assert!(
            matches!(
                kv.admit(SeqId(2), n, &mut slots),
                Err(Error::TooLong { .. })
            ),
            "admit {n}"
        );
        assert!(
            kv.append(SeqId(1), n, &mut slots, &mut copies).is_err(),
            "append {n}"
        );
        assert!(!kv.can_admit(n));
        assert!(!kv.can_append(SeqId(1), n));
        assert!(kv.truncate(SeqId(1), n).is_err());
        assert!(kv.slots(SeqId(1), 0..n, &mut slots).is_err());
    }
    assert!(kv.slots(SeqId(1), 3..usize::MAX, &mut slots).is_err());
    let mut c = pagedkv::baseline::ContiguousCache::new(*kv.layout(), BLOCKS, 16).unwrap();
    use pagedkv::baseline::CacheAllocator;
    c.admit(SeqId(1), 5, &mut slots).unwrap();
    assert!(matches!(
        c.append(SeqId(1), usize::MAX, &mut slots, &mut copies),
        Err(Error::TooLong { .. })
    ));
    assert_eq!(c.num_tokens(SeqId(1)).unwrap(), 5);
    assert!(kv.fork(SeqId(u64::MAX), SeqId(3)).is_err());
    assert!(kv.free(SeqId(u64::MAX)).is_err());
    assert_eq!(snapshot(&kv), before);
    assert!(copies.is_empty());
    kv.check_invariants().unwrap();
}

#[test]
fn zero_sizes() {
    let layout = KvLayout::new(shape(), BS).unwrap();
    assert!(KvCache::new(layout, CacheConfig::new(0)).is_err());
    assert!(KvCache::new(layout, CacheConfig::new(0)).is_err());
    assert!(pagedkv::baseline::ContiguousCache::new(layout, 8, 0).is_err());
    assert!(ShardedPool::new(0, 1, 1).is_err());
    assert!(ShardedPool::new(4, 0, 1).is_err());
    assert!(ShardedPool::new(4, 1, 0).is_err());
    let mut z = shape();
    z.head_dim = 0;
    assert!(KvLayout::new(z, BS).is_err());
    // Zero-token sequences are legal and hold no block.
    let (mut kv, _) = setup();
    let mut slots = Vec::new();
    kv.admit(SeqId(0), 0, &mut slots).unwrap();
    assert!(kv.block_table(SeqId(0)).unwrap().is_empty());
    kv.check_invariants().unwrap();
}

#[test]
fn pool_ids_out_of_range() {
    let mut p = BlockPool::new(4).unwrap();
    for b in [BlockId(4), BlockId(u32::MAX), BlockId(u32::MAX - 1)] {
        assert!(matches!(p.incref(b), Err(Error::BlockOutOfRange { .. })));
        assert!(matches!(p.decref(b), Err(Error::BlockOutOfRange { .. })));
        assert!(p.take(b).is_err());
        assert!(p.revive(b).is_err());
        assert!(p.evict(b).is_err());
        assert!(p.relocate(BlockId(0), b).is_err());
        assert!(p.state(b).is_err());
    }
    assert!(BlockPool::new(u32::MAX as usize).is_err());
    p.check_invariants().unwrap();
    assert_eq!(p.num_free(), 4);
}

#[test]
fn storage_slots_and_plans_outside_the_arena() {
    let (_, mut store) = setup();
    let token = 2 * 8 * 2;
    let one = vec![7u8; token];
    let before: Vec<u8> = store.region(0).to_vec();
    for slot in [
        Slot((BLOCKS * BS) as u64),
        Slot(u64::MAX),
        Slot((u32::MAX as u64 + 1) * BS as u64),
    ] {
        assert!(
            matches!(
                store.write_slots(0, &[slot], &one, &one),
                Err(Error::BlockOutOfRange { .. })
            ),
            "{slot:?}"
        );
    }
    assert!(store
        .write_slots(usize::MAX, &[Slot(0)], &one, &one)
        .is_err());
    let mut plan = CopyPlan::new();
    plan.push(BlockId(u32::MAX), BlockId(0));
    assert!(store.copy_blocks(&plan).is_err());
    let mut swap = SwapPlan::new(SwapDirection::Out);
    swap.push(BlockId(0), BlockId(4));
    assert!(matches!(
        store.swap(&swap),
        Err(Error::HostBlockOutOfRange { host_blocks: 4, .. })
    ));
    let mut swap = SwapPlan::new(SwapDirection::In);
    swap.push(BlockId(0), BlockId(1));
    swap.push(BlockId(0), BlockId(2));
    assert!(
        matches!(store.swap(&swap), Err(Error::CorruptBlockTable(_))),
        "a device block written twice"
    );
    assert_eq!(store.region(0), &before[..]);
    let (mut k, mut v) = (vec![0u8; token], vec![0u8; token]);
    assert!(store
        .read_tokens(0, &[BlockId(u32::MAX)], 1, &mut k, &mut v)
        .is_err());
    assert!(store.read_tokens(0, &[], 1, &mut k, &mut v).is_err());
}

#[test]
fn attention_rejects_bad_tables_scales_and_shapes_before_reading() {
    let (mut kv, mut store) = setup();
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 6, &mut slots).unwrap();
    let n = slots.len() * 2 * 8;
    reshape_and_cache(
        &mut store,
        0,
        &slots,
        &vec![0.5; n],
        &vec![0.25; n],
        1.0,
        1.0,
    )
    .unwrap();
    let mut tables = PaddedTables::default();
    kv.fill_padded(&[SeqId(1)], &mut tables).unwrap();
    let params = AttentionParams::new(8);
    let q = vec![0.1f32; 4 * 8];
    let mut out = vec![0f32; 4 * 8];
    paged_decode(&store, 0, &q, &tables, &params, &mut out, None).unwrap();

    // A table entry outside the arena.
    let mut bad = tables.clone();
    bad.tables[0] = BLOCKS as u32;
    assert!(matches!(
        paged_decode(&store, 0, &q, &bad, &params, &mut out, None),
        Err(Error::BlockOutOfRange { .. })
    ));
    assert!(paged_decode_reference(&store, 0, &q, &bad, &params).is_err());
    // A context longer than the table covers, and one near u32::MAX.
    for ctx in [9, u32::MAX] {
        let mut bad = tables.clone();
        bad.context_lens[0] = ctx;
        assert!(
            paged_decode(&store, 0, &q, &bad, &params, &mut out, None).is_err(),
            "ctx {ctx}"
        );
        assert!(
            paged_decode_reference(&store, 0, &q, &bad, &params).is_err(),
            "ctx {ctx}"
        );
    }
    // Mismatched shapes: q, out, layer.
    assert!(paged_decode(&store, 0, &q[1..], &tables, &params, &mut out, None).is_err());
    assert!(paged_decode(&store, 0, &q, &tables, &params, &mut out[1..], None).is_err());
    assert!(paged_decode(&store, 2, &q, &tables, &params, &mut out, None).is_err());
    // NaN and infinite scales.
    for s in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -1.0] {
        // A softmax scale of 0 or below is odd but well defined; only non-finite fails.
        let p = AttentionParams {
            scale: s,
            ..params.clone()
        };
        assert_eq!(
            paged_decode(&store, 0, &q, &tables, &p, &mut out, None).is_err(),
            !s.is_finite(),
            "scale {s}"
        );
        let p = AttentionParams {
            k_scale: s,
            ..params.clone()
        };
        assert!(
            paged_decode(&store, 0, &q, &tables, &p, &mut out, None).is_err(),
            "k_scale {s}"
        );
        assert!(
            reshape_and_cache(&mut store, 0, &slots, &vec![0.5; n], &vec![0.25; n], s, 1.0)
                .is_err()
        );
        let mut bytes = vec![0u8; 4];
        assert!(
            pagedkv::layout::convert::encode(DType::Fp8E4M3, &[1.0; 4], s, &mut bytes).is_err()
        );
    }
    // Wrong ALiBi slope count.
    let p = AttentionParams {
        alibi_slopes: Some(vec![0.5; 3]),
        ..params.clone()
    };
    assert!(paged_decode(&store, 0, &q, &tables, &p, &mut out, None).is_err());
}

#[test]
fn tables_naming_freed_blocks_are_caught() {
    let (mut kv, _) = setup();
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 6, &mut slots).unwrap();
    kv.admit(SeqId(2), 3, &mut slots).unwrap();
    let (mut padded, mut csr) = (PaddedTables::default(), CsrTables::default());
    kv.fill_padded(&[SeqId(1), SeqId(2)], &mut padded).unwrap();
    kv.fill_csr(&[SeqId(1), SeqId(2)], &mut csr).unwrap();
    kv.check_padded(&padded).unwrap();
    kv.check_csr(&csr).unwrap();
    kv.free(SeqId(2)).unwrap();
    // The engine kept stale tables: both forms are rejected now.
    assert!(matches!(
        kv.check_padded(&padded),
        Err(Error::CorruptBlockTable(_))
    ));
    assert!(matches!(
        kv.check_csr(&csr),
        Err(Error::CorruptBlockTable(_))
    ));
    // Outside the arena, inconsistent shapes, bad indptr.
    let mut p = padded.clone();
    p.tables[0] = u32::MAX;
    assert!(kv.check_padded(&p).is_err());
    p.tables.pop();
    assert!(matches!(
        kv.check_padded(&p),
        Err(Error::ShapeMismatch { .. })
    ));
    let mut p = padded.clone();
    p.batch = usize::MAX;
    assert!(kv.check_padded(&p).is_err());
    let mut c = csr.clone();
    c.indptr[1] = u32::MAX;
    assert!(kv.check_csr(&c).is_err());
    let mut c = csr.clone();
    c.last_page_len[0] = 0;
    assert!(kv.check_csr(&c).is_err());
}
