//! Named fragmentation scenarios, each run under paged and contiguous allocation.

use pagedkv::baseline::{CacheAllocator, ContiguousCache};
use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};

const BLOCK: usize = 16;
const BLOCKS: usize = 256;
const MAX_LEN: usize = 512;

fn layout() -> KvLayout {
    let s = ModelShape {
        num_layers: 1,
        num_q_heads: 4,
        num_kv_heads: 1,
        head_dim: 8,
        kv_dtype: DType::F16,
    };
    KvLayout::new(s, BLOCK).unwrap()
}

fn paged() -> KvCache {
    KvCache::new(
        layout(),
        CacheConfig {
            num_blocks: BLOCKS,
            watermark_blocks: 0,
            max_seq_len_tokens: MAX_LEN,
            ..CacheConfig::new(0)
        },
    )
    .unwrap()
}

fn contiguous() -> ContiguousCache {
    ContiguousCache::new(layout(), BLOCKS, MAX_LEN).unwrap()
}

/// Admits as many sequences of `len` tokens as fit; returns how many.
fn fill(a: &mut dyn CacheAllocator, first_id: u64, len: usize) -> u64 {
    let mut slots = Vec::new();
    let mut id = first_id;
    while a.can_admit(len) {
        a.admit(SeqId(id), len, &mut slots).unwrap();
        id += 1;
    }
    id - first_id
}

#[test]
fn bursty_arrivals() {
    // A burst of short prompts arrives at once: paged holds every one the arena can,
    // contiguous only arena / max_len.
    let (mut p, mut c) = (paged(), contiguous());
    let np = fill(&mut p, 0, 40);
    let nc = fill(&mut c, 0, 40);
    assert_eq!(np as usize, BLOCKS / 3, "40 tokens take 3 blocks each");
    assert_eq!(nc as usize, BLOCKS * BLOCK / MAX_LEN);
    p.check_invariants().unwrap();
}

#[test]
fn long_tail_lengths() {
    // Mostly short, a few long: paged capacity tracks the real lengths.
    let lens = [20, 30, 25, 500, 18, 22, 400, 35, 16, 27];
    let (mut p, mut c) = (paged(), contiguous());
    let mut slots = Vec::new();
    let (mut np, mut nc) = (0, 0);
    for (i, &len) in lens.iter().cycle().take(200).enumerate() {
        if p.can_admit(len) {
            p.admit(SeqId(i as u64), len, &mut slots).unwrap();
            np += 1;
        }
        if c.can_admit(len) {
            c.admit(SeqId(i as u64), len, &mut slots).unwrap();
            nc += 1;
        }
    }
    assert!(np >= 3 * nc, "paged {np} vs contiguous {nc}");
    let s = p.stats();
    assert!(s.internal_waste_slots < s.used_blocks * BLOCK / 2);
    p.check_invariants().unwrap();
}

#[test]
fn many_forks_of_one_prompt() {
    // Parallel sampling: 32 forks of a 300-token prompt share its blocks; each fork's
    // first append copies only the shared partial block.
    let (mut p, mut c) = (paged(), contiguous());
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    p.admit(SeqId(0), 300, &mut slots).unwrap();
    c.admit(SeqId(0), 300, &mut slots).unwrap();
    let prompt_blocks = 300usize.div_ceil(BLOCK);
    let mut forks_c = 0;
    for i in 1..=32 {
        p.fork(SeqId(0), SeqId(i)).unwrap();
        if c.fork(SeqId(0), SeqId(i), &mut copies).is_ok() {
            forks_c += 1;
        }
    }
    assert_eq!(
        p.stats().used_blocks,
        prompt_blocks,
        "forks share every block"
    );
    assert_eq!(
        forks_c,
        BLOCKS * BLOCK / MAX_LEN - 1,
        "contiguous copies the prompt per fork"
    );
    copies.clear();
    for i in 1..=32 {
        p.append(SeqId(i), 1, &mut slots, &mut copies).unwrap();
    }
    assert_eq!(copies.len(), 32, "one copy-on-write per fork");
    assert_eq!(p.stats().used_blocks, prompt_blocks + 32);
    p.check_invariants().unwrap();
}

#[test]
fn fill_to_full_then_free_every_other() {
    // Checkerboard: after freeing every other sequence, paged can use all the freed
    // space for one long sequence; contiguous cannot place one reservation larger than
    // a freed hole.
    let mut p = paged();
    let mut slots = Vec::new();
    let n = fill(&mut p, 0, 16);
    assert_eq!(n as usize, BLOCKS);
    for i in (0..n).step_by(2) {
        p.free(SeqId(i)).unwrap();
    }
    assert_eq!(p.stats().free_blocks, BLOCKS / 2);
    p.admit(SeqId(1000), MAX_LEN, &mut slots).unwrap();
    p.check_invariants().unwrap();

    let mut c = ContiguousCache::new(layout(), BLOCKS, 64).unwrap();
    let n = fill(&mut c, 0, 16);
    for i in (0..n).step_by(2) {
        c.free(SeqId(i)).unwrap();
    }
    assert_eq!(c.largest_free_extent(), 64usize.div_ceil(BLOCK));
    assert_eq!(c.stats().free_blocks, BLOCKS / 2);
}
