//! Defragmentation, shrink and grow, checked byte-for-byte on `HostStorage`.
//!
//! Every token's K and V are a byte pattern determined by a tag the test gives the
//! token (a forked child inherits its parent's tags), so after any operation every
//! sequence's bytes can be recomputed and compared.

use std::collections::HashMap;

use pagedkv::layout::Slot;
use pagedkv::manager::{DefragOptions, FragStats};
use pagedkv::pool::BlockState;
use pagedkv::{
    BlockId, CacheConfig, CacheStats, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout,
    ModelShape, MovePlan, SeqId, Storage,
};
use proptest::prelude::*;

const BLOCK_SIZE: usize = 4;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    KvLayout::new(shape, BLOCK_SIZE).unwrap()
}

/// The byte `i` of a token's K (`kv == 0`) or V (`kv == 1`) in `layer`.
fn pattern(tag: u64, layer: usize, kv: u64, i: usize) -> u8 {
    let mut x =
        tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((layer as u64) << 40) ^ (kv << 48) ^ i as u64;
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x >> 56) as u8
}

/// A manager, its storage, and the tags of every sequence's tokens.
struct Harness<S: Storage = HostStorage> {
    kv: KvCache,
    storage: S,
    tags: HashMap<SeqId, Vec<u64>>,
    next_tag: u64,
    next_seq: u64,
    slots: Vec<Slot>,
}

/// Everything a failed call must leave as it was.
#[derive(Debug, PartialEq)]
struct Snapshot {
    tables: Vec<(SeqId, Vec<BlockId>, usize)>,
    stats: CacheStats,
    frag: FragStats,
    states: Vec<BlockState>,
    refcounts: Vec<u32>,
    storage_blocks: usize,
}

impl Harness<HostStorage> {
    fn new(num_blocks: usize, max_num_blocks: usize) -> Self {
        let storage = HostStorage::new(layout(), num_blocks).unwrap();
        Harness::with_storage(num_blocks, max_num_blocks, storage)
    }
}

impl<S: Storage> Harness<S> {
    fn with_storage(num_blocks: usize, max_num_blocks: usize, storage: S) -> Self {
        let mut config = CacheConfig::new(num_blocks);
        config.watermark_blocks = 0;
        config.max_num_blocks = max_num_blocks;
        Harness {
            kv: KvCache::new(layout(), config).unwrap(),
            storage,
            tags: HashMap::new(),
            next_tag: 1,
            next_seq: 1,
            slots: Vec::new(),
        }
    }

    fn seqs(&self) -> Vec<SeqId> {
        let mut ids: Vec<SeqId> = self.tags.keys().copied().collect();
        ids.sort();
        ids
    }

    fn pick(&self, i: usize) -> Option<SeqId> {
        let ids = self.seqs();
        (!ids.is_empty()).then(|| ids[i % ids.len()])
    }

    /// Writes the K/V of the tokens whose slots are in `self.slots`.
    fn write(&mut self, tags: &[u64]) {
        let token_bytes = layout().shape().num_kv_heads * 4 * 2;
        for layer in 0..layout().num_layers() {
            let mut k = Vec::with_capacity(tags.len() * token_bytes);
            let mut v = Vec::with_capacity(tags.len() * token_bytes);
            for &t in tags {
                k.extend((0..token_bytes).map(|i| pattern(t, layer, 0, i)));
                v.extend((0..token_bytes).map(|i| pattern(t, layer, 1, i)));
            }
            self.storage
                .write_slots(layer, &self.slots, &k, &v)
                .unwrap();
        }
    }

    fn fresh_tags(&mut self, n: usize) -> Vec<u64> {
        let tags: Vec<u64> = (self.next_tag..self.next_tag + n as u64).collect();
        self.next_tag += n as u64;
        tags
    }

    fn admit(&mut self, tokens: usize) -> Option<SeqId> {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        match self.kv.admit(seq, tokens, &mut self.slots) {
            Ok(()) => {
                let tags = self.fresh_tags(tokens);
                self.write(&tags);
                self.tags.insert(seq, tags);
                Some(seq)
            }
            Err(Error::OutOfBlocks { .. } | Error::TooLong { .. }) => None,
            Err(e) => panic!("admit: {e}"),
        }
    }

    fn append(&mut self, seq: SeqId, n: usize) {
        let mut copies = CopyPlan::new();
        match self.kv.append(seq, n, &mut self.slots, &mut copies) {
            Ok(()) => {
                self.storage.copy_blocks(&copies).unwrap();
                let tags = self.fresh_tags(n);
                self.write(&tags);
                self.tags.get_mut(&seq).unwrap().extend(tags);
            }
            Err(Error::OutOfBlocks { .. } | Error::TooLong { .. }) => assert!(copies.is_empty()),
            Err(e) => panic!("append: {e}"),
        }
    }

    fn fork(&mut self, parent: SeqId) -> SeqId {
        let child = SeqId(self.next_seq);
        self.next_seq += 1;
        self.kv.fork(parent, child).unwrap();
        let tags = self.tags[&parent].clone();
        self.tags.insert(child, tags);
        child
    }

    fn free(&mut self, seq: SeqId) {
        self.kv.free(seq).unwrap();
        self.tags.remove(&seq);
    }

    /// Every sequence reads back exactly its tokens' patterns, and every invariant holds.
    fn verify(&self) {
        self.kv.check_invariants().unwrap();
        assert_eq!(self.storage.num_blocks(), self.kv.num_blocks());
        let token_bytes = layout().shape().num_kv_heads * 4 * 2;
        for (seq, tags) in &self.tags {
            let table = self.kv.block_table(*seq).unwrap();
            assert_eq!(self.kv.num_tokens(*seq).unwrap(), tags.len());
            for layer in 0..layout().num_layers() {
                let mut k = vec![0; tags.len() * token_bytes];
                let mut v = vec![0; tags.len() * token_bytes];
                self.storage
                    .read_tokens(layer, table, tags.len(), &mut k, &mut v)
                    .unwrap();
                for (t, &tag) in tags.iter().enumerate() {
                    for i in 0..token_bytes {
                        assert_eq!(
                            k[t * token_bytes + i],
                            pattern(tag, layer, 0, i),
                            "{seq} token {t} layer {layer} K byte {i}"
                        );
                        assert_eq!(
                            v[t * token_bytes + i],
                            pattern(tag, layer, 1, i),
                            "{seq} token {t} layer {layer} V byte {i}"
                        );
                    }
                }
            }
        }
    }

    fn snapshot(&self) -> Snapshot {
        let mut tables: Vec<_> = self
            .seqs()
            .into_iter()
            .map(|s| {
                (
                    s,
                    self.kv.block_table(s).unwrap().to_vec(),
                    self.kv.num_tokens(s).unwrap(),
                )
            })
            .collect();
        tables.sort();
        let pool = self.kv.pool();
        Snapshot {
            tables,
            stats: self.kv.stats(),
            frag: self.kv.fragmentation(),
            states: pool.states().to_vec(),
            refcounts: (0..pool.num_blocks())
                .map(|b| pool.refcount(BlockId(b as u32)).unwrap())
                .collect(),
            storage_blocks: self.storage.num_blocks(),
        }
    }

    fn refcount(&self, b: BlockId) -> u32 {
        self.kv.pool().refcount(b).unwrap()
    }

    /// Runs a defragmentation and checks the plan against the state before it.
    fn defragment(&mut self, opts: DefragOptions) -> MovePlan {
        let before = self.kv.fragmentation();
        let refcounts = self.snapshot().refcounts;
        let resident = before.live_blocks + before.cached_blocks;
        // Counted here from the block states, not trusted from `FragStats`.
        let above = self.kv.pool().states()[resident..]
            .iter()
            .filter(|s| **s != BlockState::Free)
            .count();
        assert_eq!(before.moves_to_compact, above);
        let plan =
            pagedkv::executor::defragment_with(&mut self.kv, &mut self.storage, opts).unwrap();
        check_plan_shape(&plan);
        for m in plan.moves() {
            assert_eq!(
                self.refcount(m.dst),
                refcounts[m.src.index()],
                "a moved block keeps its sharers"
            );
            assert_eq!(self.refcount(m.src), 0);
        }
        let after = self.kv.fragmentation();
        assert!(
            plan.len() <= above,
            "never more moves than resident blocks above"
        );
        if before.fragmentation < opts.min_fragmentation {
            assert!(plan.is_empty());
        } else {
            assert_eq!(
                plan.len(),
                before.moves_to_compact.min(opts.max_moves_per_step)
            );
        }
        if plan.len() == before.moves_to_compact {
            // Full compaction: resident blocks occupy exactly [0, resident).
            assert_eq!(after.high_water_blocks, resident);
            assert_eq!(after.holes_below_high_water, 0);
            assert_eq!(after.fragmentation, 0.0);
            let states = self.kv.pool().states();
            assert!(states[..resident].iter().all(|s| *s != BlockState::Free));
            assert!(states[resident..].iter().all(|s| *s == BlockState::Free));
        }
        assert!(after.high_water_blocks <= before.high_water_blocks);
        assert_eq!(after.moves_to_compact, before.moves_to_compact - plan.len());
        plan
    }
}

/// Sources distinct, destinations distinct, no block both read and written: the plan
/// runs as one batch.
fn check_plan_shape(plan: &MovePlan) {
    let mut srcs: Vec<u32> = plan.moves().iter().map(|m| m.src.0).collect();
    let mut dsts: Vec<u32> = plan.moves().iter().map(|m| m.dst.0).collect();
    srcs.sort_unstable();
    dsts.sort_unstable();
    srcs.dedup();
    dsts.dedup();
    assert_eq!(srcs.len(), plan.len(), "a block moves once");
    assert_eq!(dsts.len(), plan.len(), "a destination is written once");
    assert!(srcs.iter().all(|s| dsts.binary_search(s).is_err()));
}

// ---- property test ----------------------------------------------------------------

#[derive(Debug, Clone)]
enum Action {
    Admit {
        tokens: usize,
    },
    Append {
        seq: usize,
        n: usize,
    },
    Fork {
        seq: usize,
    },
    Free {
        seq: usize,
    },
    /// Frees every `stride`-th sequence (from `offset`): holes all over the arena.
    Thin {
        stride: usize,
        offset: usize,
    },
    Defrag {
        max_moves: usize,
        min_frag_pct: u8,
    },
    /// The two-phase API: plan, execute on the storage, then commit or drop.
    TwoPhase {
        commit: bool,
        max_moves: usize,
    },
    Shrink {
        pick: usize,
    },
    Grow {
        extra: usize,
    },
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0usize..24).prop_map(|tokens| Action::Admit { tokens }),
        4 => (any::<usize>(), 1usize..9).prop_map(|(seq, n)| Action::Append { seq, n }),
        2 => any::<usize>().prop_map(|seq| Action::Fork { seq }),
        3 => any::<usize>().prop_map(|seq| Action::Free { seq }),
        1 => (2usize..4, 0usize..4).prop_map(|(stride, offset)| Action::Thin { stride, offset }),
        2 => (prop_oneof![Just(usize::MAX), 1usize..6], prop_oneof![Just(0u8), 0u8..80])
            .prop_map(|(max_moves, min_frag_pct)| Action::Defrag { max_moves, min_frag_pct }),
        2 => (any::<bool>(), prop_oneof![Just(usize::MAX), 1usize..6])
            .prop_map(|(commit, max_moves)| Action::TwoPhase { commit, max_moves }),
        2 => any::<usize>().prop_map(|pick| Action::Shrink { pick }),
        2 => (0usize..48).prop_map(|extra| Action::Grow { extra }),
    ]
}

const START_BLOCKS: usize = 48;
const MAX_BLOCKS: usize = 96;

fn run(actions: Vec<Action>) {
    let mut h = Harness::new(START_BLOCKS, MAX_BLOCKS);
    for a in actions {
        match a {
            Action::Admit { tokens } => {
                h.admit(tokens);
            }
            Action::Append { seq, n } => {
                if let Some(s) = h.pick(seq) {
                    h.append(s, n);
                }
            }
            Action::Fork { seq } => {
                if let Some(s) = h.pick(seq) {
                    h.fork(s);
                }
            }
            Action::Free { seq } => {
                if let Some(s) = h.pick(seq) {
                    h.free(s);
                }
            }
            Action::Thin { stride, offset } => {
                for s in h.seqs().into_iter().skip(offset % stride).step_by(stride) {
                    h.free(s);
                }
            }
            Action::Defrag {
                max_moves,
                min_frag_pct,
            } => {
                let opts =
                    DefragOptions::incremental(max_moves).above(f64::from(min_frag_pct) / 100.0);
                h.defragment(opts);
            }
            Action::TwoPhase { commit, max_moves } => {
                let before = h.snapshot();
                let above = before.frag.moves_to_compact;
                let pending =
                    h.kv.plan_defragment(DefragOptions::incremental(max_moves))
                        .unwrap();
                check_plan_shape(pending.plan());
                assert_eq!(pending.plan().len(), above.min(max_moves));
                h.storage
                    .copy_blocks(&pending.plan().to_copy_plan())
                    .unwrap();
                if commit {
                    let plan = pending.commit().unwrap();
                    assert_eq!(h.kv.fragmentation().moves_to_compact, above - plan.len());
                } else {
                    // Never committed: the tables must still read the same bytes,
                    // since only free blocks were written.
                    drop(pending);
                    assert_eq!(h.snapshot(), before);
                }
            }
            Action::Shrink { pick } => {
                let frag = h.kv.fragmentation();
                let resident = frag.live_blocks + frag.cached_blocks;
                let n = h.kv.num_blocks();
                if pick % 5 == 0 && resident > 0 {
                    let before = h.snapshot();
                    let err = pagedkv::executor::shrink_to(&mut h.kv, resident - 1, &mut h.storage)
                        .unwrap_err();
                    assert_eq!(
                        err,
                        Error::ShrinkBelowResident {
                            requested: resident - 1,
                            live: frag.live_blocks,
                            cached: frag.cached_blocks,
                        }
                    );
                    assert_eq!(h.snapshot(), before);
                } else {
                    // Mostly close to the resident count, where blocks must move.
                    let slack = if pick % 3 == 0 {
                        n - resident
                    } else {
                        (n - resident) / 4
                    };
                    let target = (resident + (pick / 5) % (slack + 1)).max(1);
                    let above = h.kv.pool().states()[target..]
                        .iter()
                        .filter(|s| **s != BlockState::Free)
                        .count();
                    let plan =
                        pagedkv::executor::shrink_to(&mut h.kv, target, &mut h.storage).unwrap();
                    check_plan_shape(&plan);
                    assert_eq!(plan.len(), above, "shrink moves only the blocks above");
                    assert_eq!(h.kv.num_blocks(), target);
                    assert_eq!(h.storage.num_blocks(), target);
                }
            }
            Action::Grow { extra } => {
                let n = h.kv.num_blocks();
                let target = n + extra;
                if target > MAX_BLOCKS {
                    let before = h.snapshot();
                    assert_eq!(
                        pagedkv::executor::grow_to(&mut h.kv, target, &mut h.storage),
                        Err(Error::ArenaLimit {
                            requested: target,
                            max: MAX_BLOCKS
                        })
                    );
                    assert_eq!(h.snapshot(), before);
                } else {
                    let tables = h.snapshot().tables;
                    pagedkv::executor::grow_to(&mut h.kv, target, &mut h.storage).unwrap();
                    assert_eq!(h.snapshot().tables, tables, "growing moves nothing");
                    assert_eq!(h.kv.num_blocks(), target);
                }
            }
        }
        h.verify();
    }
    // Full compaction at the end, then shrink to exactly the resident blocks.
    h.defragment(DefragOptions::FULL);
    let frag = h.kv.fragmentation();
    let resident = (frag.live_blocks + frag.cached_blocks).max(1);
    let plan = pagedkv::executor::shrink_to(&mut h.kv, resident, &mut h.storage).unwrap();
    assert!(plan.is_empty(), "a compacted arena shrinks without moves");
    h.verify();
}

proptest! {
    #![proptest_config(crate::support::proptest_config(256))]

    #[test]
    fn random_workloads_keep_every_byte(actions in prop::collection::vec(action(), 1..80)) {
        run(actions);
    }
}

// ---- named scenarios --------------------------------------------------------------

/// Every other block live: fragmentation 31/63, and half the live blocks above the
/// resident count must move.
#[test]
fn checkerboard() {
    let mut h = Harness::new(64, 0);
    let seqs: Vec<SeqId> = (0..64).map(|_| h.admit(BLOCK_SIZE).unwrap()).collect();
    for s in seqs.iter().skip(1).step_by(2) {
        h.free(*s);
    }
    let f = h.kv.fragmentation();
    assert_eq!(
        (f.live_blocks, f.high_water_blocks, f.holes_below_high_water),
        (32, 63, 31)
    );
    assert_eq!(f.largest_free_run_blocks, 1);
    assert_eq!(f.moves_to_compact, 16);
    assert!((f.fragmentation - 31.0 / 63.0).abs() < 1e-12);
    let plan = h.defragment(DefragOptions::FULL);
    assert_eq!(plan.len(), 16);
    let f = h.kv.fragmentation();
    assert_eq!((f.high_water_blocks, f.largest_free_run_blocks), (32, 32));
    h.verify();
    // A second compaction has nothing to do.
    assert!(h.defragment(DefragOptions::FULL).is_empty());
}

/// A few long-lived sequences pin the top of a mostly free arena: the figure is near
/// 1, incremental steps lower the high-water mark, and the result shrinks to 16 blocks.
#[test]
fn long_lived_sequences_at_the_top() {
    let mut h = Harness::new(256, 0);
    let fillers: Vec<SeqId> = (0..60).map(|_| h.admit(4 * BLOCK_SIZE).unwrap()).collect();
    // Four sequences of four blocks each, decoded in lockstep so their tables
    // interleave, at blocks 240..256.
    let long: Vec<SeqId> = (0..4).map(|_| h.admit(BLOCK_SIZE - 1).unwrap()).collect();
    for _ in 0..3 * BLOCK_SIZE + 1 {
        for &s in &long {
            h.append(s, 1);
        }
    }
    for s in fillers {
        h.free(s);
    }
    let f = h.kv.fragmentation();
    assert_eq!((f.live_blocks, f.high_water_blocks), (16, 256));
    assert!((f.fragmentation - 240.0 / 256.0).abs() < 1e-12);
    assert_eq!(
        f.max_runs_per_sequence, 4,
        "lockstep decode interleaves tables"
    );
    assert_eq!(f.largest_free_run_blocks, 240);
    h.verify();

    // Below the threshold nothing happens; above it, four-move steps.
    assert!(h.defragment(DefragOptions::FULL.above(0.95)).is_empty());
    for step in 0..4 {
        let plan = h.defragment(DefragOptions::incremental(4).above(0.01));
        assert_eq!(plan.len(), 4, "step {step}");
        // The highest blocks go first: the high-water mark drops by four a step, and
        // to the resident count on the last one.
        let f = h.kv.fragmentation();
        let expect = if step < 3 { 256 - 4 * (step + 1) } else { 16 };
        assert_eq!(f.high_water_blocks, expect, "step {step}");
        h.verify();
    }
    let f = h.kv.fragmentation();
    assert_eq!((f.high_water_blocks, f.fragmentation), (16, 0.0));
    assert!(h.defragment(DefragOptions::FULL).is_empty());

    assert!(pagedkv::executor::shrink_to(&mut h.kv, 16, &mut h.storage)
        .unwrap()
        .is_empty());
    assert_eq!(h.storage.num_blocks(), 16);
    h.verify();
    // Decoding continues in the shrunk arena until it is full.
    assert_eq!(h.kv.num_available_blocks(), 0);
    pagedkv::executor::grow_to(&mut h.kv, 32, &mut h.storage).unwrap();
    for &s in &long {
        h.append(s, BLOCK_SIZE);
    }
    h.verify();
}

/// Shrinking without a prior compaction moves only what lies above the new size.
#[test]
fn shrink_moves_only_the_tail() {
    let mut h = Harness::new(64, 0);
    let seqs: Vec<SeqId> = (0..64).map(|_| h.admit(BLOCK_SIZE).unwrap()).collect();
    for s in &seqs[8..60] {
        h.free(*s);
    }
    // Live: 0..8 and 60..64. Shrinking to 40 moves the four at the top.
    let plan = pagedkv::executor::shrink_to(&mut h.kv, 40, &mut h.storage).unwrap();
    let moves: Vec<(u32, u32)> = plan.moves().iter().map(|m| (m.src.0, m.dst.0)).collect();
    assert_eq!(moves, vec![(60, 8), (61, 9), (62, 10), (63, 11)]);
    assert_eq!(plan.runs(), vec![(60, 8, 4)]);
    assert_eq!(h.kv.num_blocks(), 40);
    h.verify();
    // New allocations take the lowest free block, not a freed source.
    let s = h.admit(BLOCK_SIZE).unwrap();
    assert_eq!(h.kv.block_table(s).unwrap(), &[BlockId(12)]);
    h.verify();
}

/// Heavy forking: shared blocks move once and keep every sharer.
#[test]
fn heavy_forking_before_compaction() {
    let mut h = Harness::new(128, 0);
    let filler: Vec<SeqId> = (0..40).map(|_| h.admit(BLOCK_SIZE).unwrap()).collect();
    let parent = h.admit(6 * BLOCK_SIZE + 2).unwrap();
    let children: Vec<SeqId> = (0..16).map(|_| h.fork(parent)).collect();
    for (i, &c) in children.iter().enumerate() {
        // Copy-on-write of the shared last block, then private blocks.
        h.append(c, 1 + i % 7);
    }
    for &c in children.iter().step_by(3) {
        let grandchild = h.fork(c);
        h.append(grandchild, 3);
    }
    h.free(parent);
    for s in filler.iter().step_by(2) {
        h.free(*s);
    }
    h.verify();
    let before = h.kv.fragmentation();
    assert!(before.moves_to_compact > 0);
    let shared: Vec<BlockId> = h.kv.block_table(children[0]).unwrap()[..6].to_vec();
    let plan = h.defragment(DefragOptions::FULL);
    assert_eq!(plan.len(), before.moves_to_compact);
    // Every child still shares the same six prompt blocks, wherever they went.
    let moved: HashMap<BlockId, BlockId> = plan.moves().iter().map(|m| (m.src, m.dst)).collect();
    let expect: Vec<BlockId> = shared.iter().map(|b| *moved.get(b).unwrap_or(b)).collect();
    for &c in &children {
        assert_eq!(&h.kv.block_table(c).unwrap()[..6], &expect[..]);
    }
    assert_eq!(h.refcount(expect[0]), 16 + 6);
    h.verify();
}

// ---- bad input and failing storage -------------------------------------------------

#[test]
fn shrink_below_live_and_grow_past_max_are_typed_errors() {
    let mut h = Harness::new(32, 48);
    let seqs: Vec<SeqId> = (0..10).map(|_| h.admit(2 * BLOCK_SIZE).unwrap()).collect();
    h.free(seqs[3]);
    let before = h.snapshot();
    assert_eq!(
        pagedkv::executor::shrink_to(&mut h.kv, 17, &mut h.storage),
        Err(Error::ShrinkBelowResident {
            requested: 17,
            live: 18,
            cached: 0
        })
    );
    assert_eq!(
        pagedkv::executor::grow_to(&mut h.kv, 49, &mut h.storage),
        Err(Error::ArenaLimit {
            requested: 49,
            max: 48
        })
    );
    assert!(matches!(
        pagedkv::executor::shrink_to(&mut h.kv, 33, &mut h.storage),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        pagedkv::executor::grow_to(&mut h.kv, 31, &mut h.storage),
        Err(Error::InvalidConfig { .. })
    ));
    let mut other = HostStorage::new(layout(), 33).unwrap();
    assert!(matches!(
        pagedkv::executor::shrink_to(&mut h.kv, 20, &mut other),
        Err(Error::ShapeMismatch { .. })
    ));
    assert_eq!(h.snapshot(), before);
    h.verify();
    // Exactly the live size works.
    pagedkv::executor::shrink_to(&mut h.kv, 18, &mut h.storage).unwrap();
    h.verify();
    pagedkv::executor::grow_to(&mut h.kv, 48, &mut h.storage).unwrap();
    h.verify();
}

#[test]
fn shrink_respects_the_watermark() {
    let layout = layout();
    let mut config = CacheConfig::new(32);
    config.watermark_blocks = 4;
    let mut kv = KvCache::new(layout, config).unwrap();
    let mut storage = HostStorage::new(layout, 32).unwrap();
    assert!(matches!(
        pagedkv::executor::shrink_to(&mut kv, 4, &mut storage),
        Err(Error::InvalidConfig {
            field: "num_blocks",
            ..
        })
    ));
    pagedkv::executor::shrink_to(&mut kv, 5, &mut storage).unwrap();
    assert_eq!(kv.config().num_blocks, 5);
}

/// A storage that fails on request, to prove failed calls change nothing.
struct Flaky {
    inner: HostStorage,
    fail_copy: bool,
    fail_resize: bool,
}

// No host tier: per-layer swaps and host-block I/O keep the trait's refusal.
pagedkv::delegate_storage! {
    Flaky => inner, except [
        copy_blocks, num_host_blocks, resize, swap_layer, read_host_block, write_host_block,
    ];

    fn copy_blocks(&mut self, plan: &CopyPlan) -> pagedkv::Result<()> {
        if self.fail_copy {
            // Fail half-way, after writing some destinations.
            let mut half = CopyPlan::new();
            for c in &plan.copies()[..plan.len() / 2] {
                half.push(c.src, c.dst);
            }
            self.inner.copy_blocks(&half)?;
            return Err(Error::Cuda("injected copy failure".into()));
        }
        self.inner.copy_blocks(plan)
    }
    fn num_host_blocks(&self) -> usize {
        0
    }
    fn resize(&mut self, num_blocks: usize) -> pagedkv::Result<()> {
        if self.fail_resize {
            return Err(Error::Cuda("injected resize failure".into()));
        }
        self.inner.resize(num_blocks)
    }
}

#[test]
fn failing_storage_leaves_everything_unchanged() {
    let storage = Flaky {
        inner: HostStorage::new(layout(), 64).unwrap(),
        fail_copy: false,
        fail_resize: false,
    };
    let mut h = Harness::with_storage(64, 128, storage);
    let seqs: Vec<SeqId> = (0..64).map(|_| h.admit(BLOCK_SIZE).unwrap()).collect();
    for s in seqs.iter().step_by(2) {
        h.free(*s);
    }
    let before = h.snapshot();

    h.storage.fail_copy = true;
    assert!(
        pagedkv::executor::defragment_with(&mut h.kv, &mut h.storage, DefragOptions::FULL).is_err()
    );
    assert!(pagedkv::executor::shrink_to(&mut h.kv, 40, &mut h.storage).is_err());
    assert_eq!(h.snapshot(), before);
    h.verify();

    h.storage.fail_copy = false;
    h.storage.fail_resize = true;
    assert!(pagedkv::executor::shrink_to(&mut h.kv, 40, &mut h.storage).is_err());
    assert!(pagedkv::executor::grow_to(&mut h.kv, 100, &mut h.storage).is_err());
    assert_eq!(h.snapshot(), before);
    h.verify();

    h.storage.fail_resize = false;
    pagedkv::executor::shrink_to(&mut h.kv, 40, &mut h.storage).unwrap();
    h.verify();
}

#[test]
fn move_plan_converts_to_the_same_copies() {
    let mut plan = MovePlan::new();
    plan.push(BlockId(9), BlockId(1));
    plan.push(BlockId(10), BlockId(2));
    let copies = plan.to_copy_plan();
    assert_eq!(copies.copies(), plan.moves());
    assert_eq!(CopyPlan::from(plan.clone()), copies);
    assert_eq!(plan.runs(), vec![(9, 1, 2)]);
}
