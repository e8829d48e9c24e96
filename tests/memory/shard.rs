//! Tensor-parallel sharding: a `ShardedStorage` of N host shards must hold, head for
//! head, the same bytes as one unsharded `HostStorage` after the same random workload
//! (admit, append with copy-on-write after forks, free, swap out and in, resize), and
//! every live sequence must read back the K/V written for it.

use std::collections::HashMap;

use pagedkv::executor::shard::ShardedStorage;
use pagedkv::layout::plans::SwapDirection;
use pagedkv::layout::Kv;
use pagedkv::layout::Slot;
use pagedkv::{
    BlockId, CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape,
    SeqId, Storage, SwapPlan,
};

const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 8;
const LAYERS: usize = 2;
const BLOCK: usize = 4;
const BLOCKS: usize = 48;
const HOST_BLOCKS: usize = 32;
const ELEM: usize = 2;
const ROW: usize = KV_HEADS * HEAD_DIM * ELEM;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: LAYERS,
        num_q_heads: 2 * KV_HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        kv_dtype: DType::F16,
    };
    KvLayout::new(shape, BLOCK).unwrap()
}

/// SplitMix64: a tiny seeded generator, so failures replay exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The K (or V) row of one token in one layer: every byte depends on the token's
/// content tag, the layer, K/V and the byte's position.
fn token_row(tag: u64, layer: usize, kv: Kv, out: &mut Vec<u8>) {
    let mut r = Rng(tag ^ ((layer as u64) << 40) ^ ((kv as u64) << 48));
    out.extend((0..ROW).map(|_| r.next() as u8));
}

fn rows(tags: &[u64], layer: usize) -> (Vec<u8>, Vec<u8>) {
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for &t in tags {
        token_row(t, layer, Kv::K, &mut k);
        token_row(t, layer, Kv::V, &mut v);
    }
    (k, v)
}

/// One manager driving an unsharded storage and a sharded one in lockstep, with a
/// shadow of what every sequence should hold.
struct Rig {
    manager: KvCache,
    whole: HostStorage,
    sharded: ShardedStorage<HostStorage>,
    /// Content tag of each token of each live sequence.
    shadow: HashMap<SeqId, Vec<u64>>,
    host_free: Vec<BlockId>,
    swapped: Vec<(Vec<BlockId>, Vec<u64>)>,
    next_seq: u64,
    /// What the workload did: copy-on-write copies, swap-outs, swap-ins, resizes.
    counts: [usize; 4],
}

impl Rig {
    fn new(num_shards: usize) -> Self {
        let mut config = CacheConfig::new(BLOCKS);
        config.watermark_blocks = 0;
        Rig {
            manager: KvCache::new(layout(), config).unwrap(),
            whole: HostStorage::with_host_tier(layout(), BLOCKS, HOST_BLOCKS).unwrap(),
            sharded: ShardedStorage::host(layout(), num_shards, BLOCKS, HOST_BLOCKS).unwrap(),
            shadow: HashMap::new(),
            host_free: (0..HOST_BLOCKS as u32).rev().map(BlockId).collect(),
            swapped: Vec::new(),
            next_seq: 0,
            counts: [0; 4],
        }
    }

    fn write(&mut self, slots: &[Slot], tags: &[u64]) {
        for layer in 0..LAYERS {
            let (k, v) = rows(tags, layer);
            self.whole.write_slots(layer, slots, &k, &v).unwrap();
            self.sharded.write_slots(layer, slots, &k, &v).unwrap();
        }
    }

    fn pick(&mut self, rng: &mut Rng) -> Option<SeqId> {
        let mut ids: Vec<SeqId> = self.shadow.keys().copied().collect();
        ids.sort();
        (!ids.is_empty()).then(|| ids[rng.below(ids.len())])
    }

    fn step(&mut self, rng: &mut Rng) {
        let mut slots = Vec::new();
        let mut copies = CopyPlan::new();
        match rng.below(10) {
            0..=2 => {
                let n = 1 + rng.below(3 * BLOCK);
                let seq = SeqId(self.next_seq);
                if self.manager.admit(seq, n, &mut slots).is_ok() {
                    self.next_seq += 1;
                    let tags: Vec<u64> = (0..n).map(|_| rng.next()).collect();
                    self.write(&slots, &tags);
                    self.shadow.insert(seq, tags);
                }
            }
            3..=4 => {
                let Some(seq) = self.pick(rng) else { return };
                let n = 1 + rng.below(BLOCK + 2);
                if self.manager.append(seq, n, &mut slots, &mut copies).is_ok() {
                    // Copy-on-write first, on every shard, then the new tokens.
                    self.counts[0] += copies.len();
                    self.whole.copy_blocks(&copies).unwrap();
                    self.sharded.copy_blocks(&copies).unwrap();
                    let tags: Vec<u64> = (0..n).map(|_| rng.next()).collect();
                    self.write(&slots, &tags);
                    self.shadow.get_mut(&seq).unwrap().extend(tags);
                }
            }
            5 => {
                let Some(parent) = self.pick(rng) else { return };
                let child = SeqId(self.next_seq);
                self.next_seq += 1;
                self.manager.fork(parent, child).unwrap();
                let tags = self.shadow[&parent].clone();
                self.shadow.insert(child, tags);
            }
            6 => {
                let Some(seq) = self.pick(rng) else { return };
                self.manager.free(seq).unwrap();
                self.shadow.remove(&seq);
            }
            7 => {
                // Swap out: device blocks to host-tier blocks, then the device blocks
                // are released (and soon reused with other data).
                let Some(seq) = self.pick(rng) else { return };
                let table = self.manager.block_table(seq).unwrap().to_vec();
                if table.len() > self.host_free.len() {
                    return;
                }
                let mut plan = SwapPlan::new(SwapDirection::Out);
                let host: Vec<BlockId> = table
                    .iter()
                    .map(|_| self.host_free.pop().unwrap())
                    .collect();
                for (&d, &h) in table.iter().zip(&host) {
                    plan.push(d, h);
                }
                self.whole.swap(&plan).unwrap();
                self.sharded.swap(&plan).unwrap();
                self.manager.free(seq).unwrap();
                let tags = self.shadow.remove(&seq).unwrap();
                self.swapped.push((host, tags));
                self.counts[1] += 1;
            }
            8 => {
                // Swap in to whatever blocks the manager hands out now.
                if self.swapped.is_empty() {
                    return;
                }
                let i = rng.below(self.swapped.len());
                let n = self.swapped[i].1.len();
                let seq = SeqId(self.next_seq);
                if self.manager.admit(seq, n, &mut slots).is_err() {
                    return;
                }
                self.next_seq += 1;
                let (host, tags) = self.swapped.swap_remove(i);
                let table = self.manager.block_table(seq).unwrap();
                let mut plan = SwapPlan::new(SwapDirection::In);
                for (&d, &h) in table.iter().zip(&host) {
                    plan.push(d, h);
                }
                self.whole.swap(&plan).unwrap();
                self.sharded.swap(&plan).unwrap();
                self.host_free.extend(host);
                self.counts[2] += 1;
                self.shadow.insert(seq, tags);
            }
            _ => {
                // Grow the arena, then give the growth back: the kept blocks survive.
                let extra = 1 + rng.below(8);
                self.whole.resize(BLOCKS + extra).unwrap();
                self.sharded.resize(BLOCKS + extra).unwrap();
                assert_eq!(self.sharded.num_blocks(), BLOCKS + extra);
                self.whole.resize(BLOCKS).unwrap();
                self.sharded.resize(BLOCKS).unwrap();
                self.counts[3] += 1;
            }
        }
    }

    /// Head for head, the shards hold exactly the unsharded arena and host tier.
    fn assert_heads_identical(&self) {
        let l = layout();
        let sl = *self.sharded.shard_layout();
        let hps = self.sharded.heads_per_shard();
        let run = l.strides().head * ELEM;
        fn tier(s: &HostStorage, host: bool, layer: usize) -> &[u8] {
            if host {
                s.host_region(layer)
            } else {
                s.region(layer)
            }
        }
        for layer in 0..LAYERS {
            for host in [false, true] {
                let whole = tier(&self.whole, host, layer);
                let shard_of = |s: usize| tier(&self.sharded.shards()[s], host, layer);
                let blocks = whole.len() / l.block_bytes_per_layer();
                for b in 0..blocks {
                    for kv in [Kv::K, Kv::V] {
                        for h in 0..KV_HEADS {
                            let a = l.elem_offset(BlockId(b as u32), kv, h, 0) * ELEM;
                            let o = sl.elem_offset(BlockId(b as u32), kv, h % hps, 0) * ELEM;
                            assert_eq!(
                                &whole[a..a + run],
                                &shard_of(h / hps)[o..o + run],
                                "layer {layer} block {b} {kv:?} head {h}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every live sequence reads back, through the sharded storage, what was written.
    fn assert_sequences_read_back(&self) {
        for (&seq, tags) in &self.shadow {
            let table = self.manager.block_table(seq).unwrap();
            for layer in 0..LAYERS {
                let (want_k, want_v) = rows(tags, layer);
                let (mut k, mut v) = (vec![0; want_k.len()], vec![0; want_v.len()]);
                self.sharded
                    .read_tokens(layer, table, tags.len(), &mut k, &mut v)
                    .unwrap();
                assert!(k == want_k && v == want_v, "{seq} layer {layer}");
            }
        }
    }
}

fn run(num_shards: usize, seed: u64, steps: usize) {
    let mut rig = Rig::new(num_shards);
    let mut rng = Rng(seed);
    for i in 0..steps {
        rig.step(&mut rng);
        rig.manager
            .check_invariants()
            .unwrap_or_else(|e| panic!("step {i}: {e}"));
        if i % 25 == 0 {
            rig.assert_heads_identical();
        }
    }
    rig.assert_heads_identical();
    rig.assert_sequences_read_back();
}

#[test]
fn sharded_matches_unsharded_head_for_head() {
    for num_shards in [1, 2, 4] {
        for seed in 0..4 {
            run(num_shards, seed * 7919 + num_shards as u64, 300);
        }
    }
}

#[test]
fn workload_exercises_cow_swap_and_resize() {
    // Guards the test above against a generator that never reaches the paths it is
    // meant to check.
    let mut rig = Rig::new(2);
    let mut rng = Rng(2);
    for _ in 0..300 {
        rig.step(&mut rng);
    }
    let [cow, out, back, resizes] = rig.counts;
    assert!(
        cow >= 5 && out >= 5 && back >= 3 && resizes >= 5,
        "{:?}",
        rig.counts
    );
}

#[test]
fn uneven_head_split_is_rejected() {
    for n in [3, 5, 8] {
        assert_eq!(
            ShardedStorage::host(layout(), n, 4, 0).err(),
            Some(Error::UnevenHeadSplit {
                num_kv_heads: KV_HEADS,
                num_shards: n
            })
        );
    }
}

#[test]
fn failed_calls_change_no_shard() {
    let mut rig = Rig::new(4);
    let mut rng = Rng(3);
    for _ in 0..60 {
        rig.step(&mut rng);
    }
    let before: Vec<HostStorage> = rig.sharded.shards().to_vec();
    let same = |s: &ShardedStorage<HostStorage>| {
        s.shards().iter().zip(&before).all(|(a, b)| {
            (0..LAYERS).all(|l| a.region(l) == b.region(l) && a.host_region(l) == b.host_region(l))
        })
    };
    // A copy plan naming a block past the arena.
    let mut bad = CopyPlan::new();
    bad.push(BlockId(0), BlockId(1));
    bad.push(BlockId(2), BlockId(BLOCKS as u32));
    assert!(matches!(
        rig.sharded.copy_blocks(&bad),
        Err(Error::BlockOutOfRange { .. })
    ));
    // A swap plan that writes one host block twice.
    let mut twice = SwapPlan::new(SwapDirection::Out);
    twice.push(BlockId(0), BlockId(5));
    twice.push(BlockId(1), BlockId(5));
    assert!(matches!(
        rig.sharded.swap(&twice),
        Err(Error::CorruptBlockTable(_))
    ));
    // K/V of the wrong length, and a slot past the arena.
    let slots = [Slot(0), Slot((BLOCKS * BLOCK) as u64)];
    assert!(matches!(
        rig.sharded
            .write_slots(0, &slots[..1], &[1; ROW - 1], &[1; ROW - 1]),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        rig.sharded
            .write_slots(1, &slots, &[1; 2 * ROW], &[1; 2 * ROW]),
        Err(Error::BlockOutOfRange { .. })
    ));
    // A resize that cannot be done.
    assert!(matches!(
        rig.sharded.resize(usize::MAX),
        Err(Error::InvalidConfig { .. })
    ));
    assert_eq!(rig.sharded.num_blocks(), BLOCKS);
    assert!(same(&rig.sharded));
    // A read through a table too short for the tokens leaves the output alone.
    let mut k = vec![7; 9 * ROW];
    let mut v = vec![7; 9 * ROW];
    assert!(matches!(
        rig.sharded
            .read_tokens(0, &[BlockId(0), BlockId(1)], 9, &mut k, &mut v),
        Err(Error::CorruptBlockTable(_))
    ));
    assert!(k.iter().chain(&v).all(|&b| b == 7));
}

/// A host shard that refuses to grow past a limit, as a GPU short of memory would.
struct Capped {
    inner: HostStorage,
    max_blocks: usize,
}

// No host tier: per-layer swaps and host-block I/O keep the trait's refusal.
pagedkv::delegate_storage! {
    Capped => inner, except [
        num_host_blocks, resize, swap_layer, read_host_block, write_host_block,
    ];

    fn num_host_blocks(&self) -> usize {
        0
    }
    fn resize(&mut self, num_blocks: usize) -> pagedkv::Result<()> {
        if num_blocks > self.max_blocks {
            return Err(Error::OutOfBlocks {
                needed: num_blocks,
                free: self.max_blocks,
            });
        }
        self.inner.resize(num_blocks)
    }
}

#[test]
fn a_refused_resize_rolls_the_other_shards_back() {
    let caps = [100, 100, 60, 100];
    let mut tp = ShardedStorage::try_from_fn(layout(), 4, |i, sl| {
        Ok(Capped {
            inner: HostStorage::new(sl, BLOCKS)?,
            max_blocks: caps[i],
        })
    })
    .unwrap();
    let slots: Vec<Slot> = (0..(BLOCKS * BLOCK) as u64).step_by(3).map(Slot).collect();
    let tags: Vec<u64> = (0..slots.len() as u64).collect();
    for layer in 0..LAYERS {
        let (k, v) = rows(&tags, layer);
        tp.write_slots(layer, &slots, &k, &v).unwrap();
    }
    let before: Vec<Vec<u8>> = tp
        .shards()
        .iter()
        .map(|s| s.inner.region(1).to_vec())
        .collect();
    assert_eq!(
        tp.resize(80),
        Err(Error::OutOfBlocks {
            needed: 80,
            free: 60
        })
    );
    for (s, b) in tp.shards().iter().zip(&before) {
        assert_eq!(s.num_blocks(), BLOCKS);
        assert!(s.inner.region(1) == &b[..]);
    }
    tp.resize(60).unwrap();
    assert!(tp.shards().iter().all(|s| s.num_blocks() == 60));
}
