//! Concurrency: the sharded pool and the shared manager handle driven from 8 threads
//! for a bounded number of operations, then every invariant and byte checked.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pagedkv::manager::SharedKvCache;
use pagedkv::pool::sharded::ShardedPool;
use pagedkv::{
    CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape, SeqId, Storage,
};

fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed;
    move || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z ^ (z >> 31)
    }
}

#[test]
fn sharded_pool_hands_out_every_block_once() {
    let pool = ShardedPool::new(10, 3, 2).unwrap();
    let handles: Vec<_> = (0..3).map(|s| pool.handle(s).unwrap()).collect();
    let mut got: Vec<_> = (0..10)
        .map(|i| handles[i % 3].allocate().unwrap())
        .collect();
    assert_eq!(
        handles[0].allocate(),
        Err(Error::OutOfBlocks { needed: 1, free: 0 })
    );
    got.sort();
    got.dedup();
    assert_eq!(got.len(), 10);
    // Free everything through shard 2: shard 0 must still reach those blocks (stealing).
    for &b in &got {
        handles[2].free(b).unwrap();
    }
    assert_eq!(handles[2].free(got[0]), Err(Error::DoubleFree(got[0])));
    pool.check_invariants().unwrap();
    for _ in 0..10 {
        handles[0].allocate().unwrap();
    }
    assert_eq!(pool.num_taken(), 10);
    pool.check_invariants().unwrap();
    assert!(pool.handle(3).is_err());
    assert!(ShardedPool::new(0, 1, 1).is_err());
    assert!(matches!(
        handles[0].free(pagedkv::BlockId(99)),
        Err(Error::BlockOutOfRange { .. })
    ));
}

#[test]
fn sharded_pool_stress_8_threads() {
    const BLOCKS: usize = 512;
    let pool = ShardedPool::new(BLOCKS, 8, 16).unwrap();
    // Who holds each block: 0 = nobody. A block handed to two threads at once fails.
    let holder: Arc<Vec<AtomicU64>> = Arc::new((0..BLOCKS).map(|_| AtomicU64::new(0)).collect());
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let h = pool.handle(t as usize).unwrap();
            let other = pool.handle(((t + 1) % 8) as usize).unwrap();
            let holder = holder.clone();
            std::thread::spawn(move || {
                let mut next = rng(t);
                let mut held = Vec::new();
                for _ in 0..20_000 {
                    if next().is_multiple_of(2) && held.len() < 100 {
                        match h.allocate() {
                            Ok(b) => {
                                let prev = holder[b.index()].swap(t + 1, Ordering::AcqRel);
                                assert_eq!(prev, 0, "block {b} handed out twice");
                                held.push(b);
                            }
                            Err(Error::OutOfBlocks { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                    } else if let Some(b) = held.pop() {
                        assert_eq!(holder[b.index()].swap(0, Ordering::AcqRel), t + 1);
                        // Free through a neighbour's handle now and then: any shard may free.
                        if next().is_multiple_of(4) {
                            other.free(b)
                        } else {
                            h.free(b)
                        }
                        .unwrap();
                    }
                }
                held
            })
        })
        .collect();
    let mut still_held = 0;
    for t in threads {
        still_held += t.join().unwrap().len();
    }
    assert_eq!(pool.num_taken(), still_held);
    pool.check_invariants().unwrap();
}

#[test]
fn shared_manager_stress_8_threads() {
    const HEAD_DIM: usize = 4;
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 1,
        num_kv_heads: 1,
        head_dim: HEAD_DIM,
        kv_dtype: DType::F32,
    };
    let layout = KvLayout::new(shape, 8).unwrap();
    let cfg = CacheConfig {
        num_blocks: 256,
        watermark_blocks: 0,
        max_seq_len_tokens: 0,
        ..CacheConfig::new(0)
    };
    let kv = SharedKvCache::new(KvCache::new(layout, cfg).unwrap());
    let store = Arc::new(parking_lot::Mutex::new(
        HostStorage::new(layout, 256).unwrap(),
    ));
    let word = |seq: u64, pos: usize| -> [u8; 4 * HEAD_DIM] {
        let mut out = [0u8; 4 * HEAD_DIM];
        for d in 0..HEAD_DIM {
            out[d * 4..d * 4 + 4]
                .copy_from_slice(&((seq * 10_000 + pos as u64) as f32 + d as f32).to_le_bytes());
        }
        out
    };
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (kv, store) = (kv.clone(), store.clone());
            std::thread::spawn(move || {
                let mut next = rng(100 + t);
                let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
                let mut mine: Vec<(SeqId, usize)> = Vec::new();
                let mut id = t * 1_000_000;
                for _ in 0..3_000 {
                    match next() % 4 {
                        0 => {
                            id += 1;
                            let n = (next() % 30) as usize;
                            // Lock order: manager, then storage, so a slot cannot be reused
                            // by another thread before our write lands.
                            let mut m = kv.lock();
                            if m.admit(SeqId(id), n, &mut slots).is_ok() {
                                let bytes: Vec<u8> = (0..n).flat_map(|p| word(id, p)).collect();
                                store.lock().write_slots(0, &slots, &bytes, &bytes).unwrap();
                                mine.push((SeqId(id), n));
                            }
                        }
                        1 | 2 if !mine.is_empty() => {
                            let i = (next() as usize) % mine.len();
                            let (seq, len) = mine[i];
                            let mut m = kv.lock();
                            copies.clear();
                            if m.append(seq, 1, &mut slots, &mut copies).is_ok() {
                                let mut s = store.lock();
                                s.copy_blocks(&copies).unwrap();
                                let w = word(seq.0, len);
                                s.write_slots(0, &slots, &w, &w).unwrap();
                                mine[i].1 += 1;
                            }
                        }
                        _ if !mine.is_empty() => {
                            let i = (next() as usize) % mine.len();
                            kv.free(mine.swap_remove(i).0).unwrap();
                        }
                        _ => {}
                    }
                }
                mine
            })
        })
        .collect();
    let survivors: Vec<_> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let m = kv.lock();
    m.check_invariants().unwrap();
    let s = store.lock();
    for (seq, len) in survivors {
        assert_eq!(m.num_tokens(seq).unwrap(), len);
        let (mut k, mut v) = (vec![0u8; len * 4 * HEAD_DIM], vec![0u8; len * 4 * HEAD_DIM]);
        s.read_tokens(0, m.block_table(seq).unwrap(), len, &mut k, &mut v)
            .unwrap();
        for p in 0..len {
            assert_eq!(&k[p * 16..(p + 1) * 16], &word(seq.0, p), "{seq} token {p}");
        }
    }
}
