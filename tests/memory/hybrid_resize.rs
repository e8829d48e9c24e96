//! Resizing a hybrid cache (full + window + state groups over one arena) and a broker
//! moving memory between a hybrid model and a one-group model:
//!
//! * shrink moves every held page above the cut (live, cached prompt pages, kept
//!   window pages, state pages, checkpoints) below it, whichever group owns it, and
//!   the bytes follow, read back through every group's tables; grow adds pages that
//!   every group can take;
//! * refused shrinks and grows, and dropped plans, change nothing;
//! * a broker grows a hybrid model by shrinking a one-group one, and back;
//! * a broker's sleep swaps a hybrid model's sequences out, one job per sequence, all
//!   or none (a host tier too small, a transfer failing partway: nothing changed), and
//!   they swap back in with their bytes.

use pagedkv::broker::{Broker, BrokerConfig, ModelId, ModelLimits, SleepOptions};
use pagedkv::executor::{grow_to, shrink_to};
use pagedkv::layout::Slot;
use pagedkv::{
    AdmitOptions, BlockId, DType, Error, GroupSpec, GroupStep, HostStorage, KvCache, KvLayout,
    ModelShape, SeqId, Storage,
};

const BS: usize = 4;
const HEAD_DIM: usize = 2;
const WINDOW: usize = 6;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: HEAD_DIM,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, BS).unwrap()
}

use crate::support::faulty_storage::FlakyStorage;
use crate::support::snapshot::groups_snapshot as snapshot;

/// The value group `g` holds for sequence `id` at position `pos` (exact in f32).
fn value(g: usize, id: u64, pos: usize) -> f32 {
    (g * 1_000_000 + id as usize * 1_000 + pos) as f32
}

fn rows(values: impl Iterator<Item = f32>) -> (Vec<u8>, Vec<u8>) {
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for x in values {
        for _ in 0..HEAD_DIM {
            k.extend_from_slice(&x.to_le_bytes());
            v.extend_from_slice(&(-x).to_le_bytes());
        }
    }
    (k, v)
}

/// A hybrid cache, its storage, and what every live sequence holds.
struct Fixture {
    kv: KvCache,
    store: HostStorage,
    step: GroupStep,
    /// Live sequences and their computed tokens.
    seqs: Vec<(SeqId, usize)>,
    /// State groups (their pages hold the sequence's state, not tokens).
    state: Vec<bool>,
}

impl Fixture {
    fn new(specs: &[GroupSpec], pages: usize) -> Self {
        Fixture {
            kv: KvCache::hybrid(specs, pages).unwrap(),
            store: HostStorage::new(layout(), pages).unwrap(),
            step: GroupStep::default(),
            seqs: Vec::new(),
            state: specs.iter().map(|s| s.state_pages.is_some()).collect(),
        }
    }

    /// Writes the step's slots from position `first` as `id`'s tokens, and `id`'s
    /// state into its state pages.
    fn write(&mut self, id: SeqId, first: usize) {
        for g in 0..self.kv.num_groups() {
            self.store.copy_blocks(&self.step.copies[g]).unwrap();
            if self.state[g] {
                let pages = self.kv.group(g).block_table(id).unwrap().to_vec();
                let slots: Vec<Slot> = (0..pages.len() * BS)
                    .map(|i| Slot(u64::from(pages[i / BS].0) * BS as u64 + (i % BS) as u64))
                    .collect();
                let (k, v) = rows((0..slots.len()).map(|i| value(g, id.0, i)));
                self.store.write_slots(0, &slots, &k, &v).unwrap();
                continue;
            }
            let slots = &self.step.slots[g];
            let (k, v) = rows((0..slots.len()).map(|i| value(g, id.0, first + i)));
            self.store.write_slots(0, slots, &k, &v).unwrap();
        }
    }

    fn admit(&mut self, id: u64, tokens: usize) {
        let id = SeqId(id);
        self.kv.admit_grouped(id, tokens, &mut self.step).unwrap();
        self.write(id, 0);
        self.seqs.push((id, tokens));
    }

    /// Admits `prompt` through the prefix caches (registered, so its blocks stay
    /// cached once freed).
    fn admit_tokens(&mut self, id: u64, prompt: &[u32]) {
        let id = SeqId(id);
        let opts = AdmitOptions::default();
        let adm = self
            .kv
            .admit_tokens_grouped(id, prompt, &opts, &mut self.step)
            .unwrap();
        self.write(id, adm.cached_tokens);
        self.seqs.push((id, prompt.len()));
    }

    fn append(&mut self, id: u64, n: usize) {
        let i = self.seqs.iter().position(|s| s.0 == SeqId(id)).unwrap();
        let first = self.seqs[i].1;
        self.kv
            .append_grouped(SeqId(id), n, &mut self.step)
            .unwrap();
        self.write(SeqId(id), first);
        self.seqs[i].1 += n;
    }

    fn free(&mut self, id: u64) {
        self.kv.free(SeqId(id)).unwrap();
        self.seqs.retain(|s| s.0 != SeqId(id));
    }

    /// Invariants, and every token inside each group's reach (its window) and every
    /// state page read back byte for byte through the tables.
    fn check(&self) {
        let seqs: Vec<(SeqId, usize, u64)> =
            self.seqs.iter().map(|&(id, n)| (id, n, id.0)).collect();
        check_bytes(&self.kv, &self.store, &seqs, &self.state);
    }
}

/// Invariants, and for each `(id, computed, writer)` of `seqs` every token inside each
/// group's reach (its window) and every state page read back byte for byte through
/// the tables, as sequence `writer` wrote them (a fork reads its parent's).
fn check_bytes(kv: &KvCache, store: &HostStorage, seqs: &[(SeqId, usize, u64)], state: &[bool]) {
    kv.check_invariants().unwrap();
    assert_eq!(store.num_blocks(), kv.num_blocks());
    assert_eq!(state.len(), kv.num_groups());
    for &(id, computed, writer) in seqs {
        assert_eq!(kv.num_computed_tokens(id).unwrap(), computed);
        for (g, &is_state) in state.iter().enumerate() {
            let group = kv.group(g);
            let (table, len) = if is_state {
                let t = group.block_table(id).unwrap();
                (t, t.len() * BS)
            } else {
                group.readable_blocks(id).unwrap()
            };
            let from = match group.sliding_window() {
                Some(w) => (len + 1).saturating_sub(w),
                None => 0,
            };
            let mut k = vec![0u8; BS * HEAD_DIM * 4];
            let mut v = k.clone();
            for pos in from..len {
                let b = table[pos / BS];
                assert_ne!(b, BlockId::RELEASED, "group {g} {id} pos {pos}");
                store.read_tokens(0, &[b], BS, &mut k, &mut v).unwrap();
                let off = (pos % BS) * HEAD_DIM * 4;
                let got = f32::from_le_bytes(k[off..off + 4].try_into().unwrap());
                assert_eq!(
                    got,
                    value(g, writer, pos),
                    "group {g} {id} pos {pos} page {b}"
                );
                let got_v = f32::from_le_bytes(v[off..off + 4].try_into().unwrap());
                assert_eq!(got_v, -value(g, writer, pos));
            }
        }
    }
}

fn full_window() -> Vec<GroupSpec> {
    vec![
        GroupSpec::full(layout()),
        GroupSpec::window(layout(), WINDOW),
    ]
}

/// Fills a cache of 48 pages from the bottom, then frees two sequences: the pages
/// still held (live, a cached prompt, kept window pages) sit around holes.
fn fragmented(specs: &[GroupSpec]) -> Fixture {
    let mut f = Fixture::new(specs, 48);
    f.admit(1, 10);
    f.admit(2, 9);
    f.admit_tokens(3, &(0..8).collect::<Vec<u32>>());
    f.admit(4, 7);
    f.append(4, 6); // the window group gives 4's first pages back
    f.admit(5, 5);
    f.free(2); // holes between held pages
    f.free(3); // its prompt pages stay cached
    f.check();
    f
}

#[test]
fn shrink_moves_every_groups_pages_below_the_cut_with_their_bytes() {
    let mut f = fragmented(&full_window());
    let st = f.kv.group_stats();
    let held = st.used_pages + st.cached_pages;
    assert!(st.cached_pages > 0, "{st:?}");
    assert!(
        f.kv.high_water_blocks() > held + 2,
        "nothing to move: {st:?}"
    );
    let target = held + 1;
    let plan = shrink_to(&mut f.kv, target, &mut f.store).unwrap();
    assert!(!plan.is_empty());
    assert!(plan.moves().iter().all(|m| m.dst.index() < target));
    assert_eq!(f.kv.num_blocks(), target);
    assert_eq!(f.kv.group_stats().num_pages, target);
    assert_eq!(f.kv.group_stats().cached_pages, st.cached_pages);
    assert!(f.kv.high_water_blocks() <= target);
    f.check();
    // The cached prompt followed its pages: it still hits.
    let opts = AdmitOptions::default();
    let prompt: Vec<u32> = (0..9).collect();
    assert_eq!(f.kv.cached_prefix_len(&prompt, &opts).unwrap(), 8);
    // The shrunk arena serves as before: decode until the last free page is used.
    f.append(5, 3);
    f.admit(6, 2);
    f.check();
}

#[test]
fn grow_adds_pages_every_group_can_take() {
    let mut f = fragmented(&full_window());
    let before = f.kv.group_stats().owned_per_group;
    grow_to(&mut f.kv, 128, &mut f.store).unwrap();
    let after = f.kv.group_stats();
    assert_eq!(after.num_pages, 128);
    // The new pages belong to group 0, as at construction.
    assert_eq!(after.owned_per_group[0], before[0] + 80);
    assert_eq!(after.owned_per_group[1], before[1]);
    f.check();
    // A sequence longer than the old arena (48 pages of 4 tokens) now fits; the
    // window group takes pages from group 0 as it needs them.
    f.admit(7, 50 * BS);
    f.append(7, 3 * BS);
    assert!(f.kv.group_stats().owned_per_group[1] > before[1]);
    f.check();
    // And it shrinks back once that sequence is gone.
    f.free(7);
    let st = f.kv.group_stats();
    shrink_to(&mut f.kv, st.used_pages + st.cached_pages, &mut f.store).unwrap();
    f.check();
}

#[test]
fn state_pages_move_with_a_shrink_and_bound_it() {
    let specs = vec![
        GroupSpec::full(layout()),
        GroupSpec::window(layout(), WINDOW),
        GroupSpec::state(layout(), 2),
    ];
    let mut f = Fixture::new(&specs, 24);
    f.admit(1, 12);
    f.admit(2, 6);
    f.admit(3, 9);
    f.free(1);
    f.free(2);
    f.check();
    let st = f.kv.group_stats();
    let held = st.used_pages + st.cached_pages;
    assert!(f.kv.high_water_blocks() > held);
    let plan = shrink_to(&mut f.kv, held, &mut f.store).unwrap();
    assert!(!plan.is_empty());
    assert_eq!(f.kv.high_water_blocks(), held);
    f.check();
    grow_to(&mut f.kv, 30, &mut f.store).unwrap();
    f.admit(4, 20);
    f.check();
    // A state group's pages per sequence bound the smallest arena, even when empty.
    let mut empty = KvCache::hybrid(&specs, 24).unwrap();
    assert!(matches!(
        empty.plan_shrink(1).map(|p| p.num_blocks()),
        Err(Error::InvalidConfig { .. })
    ));
    empty.plan_shrink(2).unwrap().commit().unwrap();
    empty.check_invariants().unwrap();
}

#[test]
fn refused_shrinks_and_grows_change_nothing() {
    let mut f = fragmented(&full_window());
    let st = f.kv.group_stats();
    let held = st.used_pages + st.cached_pages;
    let before = snapshot(&f.kv);
    let store_before = f.store.num_blocks();

    // Below the held pages: refused, nothing moved, the storage untouched.
    let e = shrink_to(&mut f.kv, held - 1, &mut f.store).unwrap_err();
    assert_eq!(
        e,
        Error::ShrinkBelowResident {
            requested: held - 1,
            live: st.used_pages,
            cached: st.cached_pages,
        }
    );
    assert_eq!(snapshot(&f.kv), before);
    assert_eq!(f.store.num_blocks(), store_before);
    // Above the arena, or a grow below it.
    assert!(matches!(
        f.kv.plan_shrink(49).map(|p| p.num_blocks()),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        f.kv.plan_grow(10).map(|p| p.num_blocks()),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        f.kv.plan_grow(usize::MAX).map(|p| p.num_blocks()),
        Err(Error::ArenaLimit { .. })
    ));
    assert_eq!(snapshot(&f.kv), before);
    // Dropped plans abort.
    let pending = f.kv.plan_shrink(held).unwrap();
    assert!(!pending.plan().is_empty());
    drop(pending);
    drop(f.kv.plan_grow(60).unwrap());
    assert_eq!(snapshot(&f.kv), before);
    f.check();

    // A step writing into a page above the cut: refused until it commits.
    let high = f
        .seqs
        .iter()
        .map(|&(id, _)| id)
        .max_by_key(|&id| f.kv.group(0).block_table(id).unwrap().iter().max().copied())
        .unwrap();
    f.kv.reserve_grouped(high, 1, 0, &mut f.step).unwrap();
    let before = snapshot(&f.kv);
    let e = f.kv.plan_shrink(held + 1).map(|p| p.num_blocks());
    assert!(matches!(e, Err(Error::SequenceState { .. })), "{e:?}");
    assert_eq!(snapshot(&f.kv), before);
}

#[test]
fn broker_moves_memory_between_a_hybrid_and_a_one_group_model() {
    let l = layout();
    let chunk = 4 * l.block_bytes();
    let mut broker: Broker<HostStorage> = Broker::new(BrokerConfig::new(8 * chunk, chunk)).unwrap();
    let bpc = broker.blocks_per_chunk(&l).unwrap();
    assert_eq!(bpc, 4);
    // Four chunks each: the whole budget.
    let hybrid = KvCache::hybrid(&full_window(), 4 * bpc).unwrap();
    let h = broker
        .register(
            "hybrid",
            hybrid,
            HostStorage::new(l, 4 * bpc).unwrap(),
            ModelLimits::new(chunk, 8 * chunk),
        )
        .unwrap();
    // A floor at or below the hybrid cache's watermark is refused.
    let watermarked = KvCache::hybrid(&full_window(), 4 * bpc)
        .unwrap()
        .with_watermark_blocks(bpc)
        .unwrap();
    let e = broker.register(
        "watermarked",
        watermarked,
        HostStorage::new(l, 4 * bpc).unwrap(),
        ModelLimits::new(chunk, 8 * chunk),
    );
    assert!(matches!(e, Err(Error::InvalidConfig { .. })), "{e:?}");
    let one = KvCache::builder(l).num_blocks(4 * bpc).build().unwrap();
    let o = broker
        .register(
            "one",
            one,
            HostStorage::new(l, 4 * bpc).unwrap(),
            ModelLimits::new(chunk, 8 * chunk),
        )
        .unwrap();
    broker.check_invariants().unwrap();

    // The hybrid model holds sequence 2 low in its arena and 9 at its top, with bytes.
    let mut step = GroupStep::default();
    {
        let mut g = broker.lock(h).unwrap();
        let (kv, store) = g.parts_mut();
        for (id, tokens) in [(2, 2 * BS), (1, 5 * BS), (9, 1)] {
            kv.admit_grouped(SeqId(id), tokens, &mut step).unwrap();
            for gr in 0..2 {
                let (k, v) = rows((0..step.slots[gr].len()).map(|i| value(gr, id, i)));
                store.write_slots(0, &step.slots[gr], &k, &v).unwrap();
            }
        }
        kv.free(SeqId(1)).unwrap();
        assert_eq!(kv.high_water_blocks(), 4 * bpc);
    }
    // While a step of the hybrid model is writing (in any group), it gives nothing.
    broker
        .lock(h)
        .unwrap()
        .kv_mut()
        .reserve_grouped(SeqId(2), 1, 0, &mut step)
        .unwrap();
    assert_eq!(
        broker.lock(o).unwrap().ensure_available(6 * bpc).unwrap(),
        4 * bpc
    );
    assert_eq!(broker.lock(h).unwrap().kv().num_blocks(), 4 * bpc);
    broker.lock(h).unwrap().kv_mut().cancel(SeqId(2)).unwrap();
    // The one-group model needs more than its arena: the hybrid one gives chunks.
    {
        let mut g = broker.lock(o).unwrap();
        let got = g.ensure_available(6 * bpc).unwrap();
        assert!(got >= 5 * bpc, "{got}");
    }
    broker.check_invariants().unwrap();
    let hybrid_pages = broker.lock(h).unwrap().kv().num_blocks();
    assert!(hybrid_pages < 4 * bpc, "{hybrid_pages}");
    // The hybrid sequences' bytes followed the shrink.
    let g = broker.lock(h).unwrap();
    for (id, gr) in [(2, 0), (2, 1), (9, 0), (9, 1)] {
        {
            let kv = g.kv().group(gr);
            let (table, len) = kv.readable_blocks(SeqId(id)).unwrap();
            let from = kv
                .sliding_window()
                .map_or(0, |w| (len + 1).saturating_sub(w));
            let mut k = vec![0u8; BS * HEAD_DIM * 4];
            let mut v = k.clone();
            for pos in from..len {
                g.storage()
                    .read_tokens(0, &[table[pos / BS]], BS, &mut k, &mut v)
                    .unwrap();
                let off = (pos % BS) * HEAD_DIM * 4;
                let got = f32::from_le_bytes(k[off..off + 4].try_into().unwrap());
                assert_eq!(got, value(gr, id, pos), "{id} group {gr} pos {pos}");
            }
        }
    }
    drop(g);
    // And back: the one-group model frees its memory, the hybrid one takes it.
    {
        let mut g = broker.lock(h).unwrap();
        let got = g.ensure_available(6 * bpc).unwrap();
        assert!(got >= 5 * bpc, "{got}");
        let (kv, _) = g.parts_mut();
        kv.admit_grouped(SeqId(3), 5 * bpc * BS / 2, &mut step)
            .unwrap();
    }
    broker.check_invariants().unwrap();
    let pages = broker.lock(h).unwrap().kv().num_blocks();
    assert!(pages > 4 * bpc, "{pages}");
    // Sleep cannot spill a hybrid model's prefixes: refused whole, the swap-out that
    // would come first included (swapping out alone: see `sleep_swaps_a_hybrid_..`).
    let refused = |swap: bool, spill: bool| {
        let before = snapshot(broker.lock(h).unwrap().kv());
        let opts = SleepOptions {
            swap_out_sequences: swap,
            spill_cached_prefixes: spill,
        };
        let e = broker.sleep(h, opts).unwrap_err();
        assert!(matches!(e, Error::NotOnHybrid { .. }), "{e:?}");
        assert_eq!(snapshot(broker.lock(h).unwrap().kv()), before);
        broker.check_invariants().unwrap();
    };
    refused(true, true);
    for id in [2, 3, 9] {
        broker.lock(h).unwrap().kv_mut().free(SeqId(id)).unwrap();
    }
    refused(false, true);
    // A plain sleep shrinks it to its floor, and it wakes.
    broker.sleep(h, SleepOptions::default()).unwrap();
    assert_eq!(broker.lock(h).unwrap().kv().num_blocks(), bpc);
    broker.check_invariants().unwrap();
    broker.wake(h, 3 * chunk).unwrap();
    assert_eq!(broker.lock(h).unwrap().kv().num_blocks(), 3 * bpc);
    broker.check_invariants().unwrap();
}

#[test]
fn checkpoints_move_with_a_shrink_and_still_serve_their_state() {
    let specs = vec![GroupSpec::full(layout()), GroupSpec::state(layout(), 2)];
    let mut f = Fixture::new(&specs, 40);
    f.admit(1, 20); // low in the arena, freed below
    let prompt: Vec<u32> = (0..16).collect();
    f.admit_tokens(2, &prompt);
    assert!(f.kv.checkpoint_grouped(SeqId(2), &mut f.step).unwrap());
    f.store.copy_blocks(&f.step.copies[1]).unwrap();
    f.free(1);
    f.free(2); // its prompt stays cached, its state checkpointed
    f.check();
    let st = f.kv.group_stats();
    let held = st.used_pages + st.cached_pages;
    assert!(held > 0 && f.kv.high_water_blocks() > held, "{st:?}");
    let plan = shrink_to(&mut f.kv, held, &mut f.store).unwrap();
    assert!(!plan.is_empty());
    f.check();
    // The checkpoint followed its pages: a longer prompt resumes from it, and its
    // copies carry sequence 2's state into the new sequence's state pages.
    grow_to(&mut f.kv, 40, &mut f.store).unwrap();
    let longer: Vec<u32> = (0..20).collect();
    let opts = AdmitOptions::default();
    let adm =
        f.kv.admit_tokens_grouped(SeqId(3), &longer, &opts, &mut f.step)
            .unwrap();
    assert_eq!(adm.cached_tokens, 16);
    f.store.copy_blocks(&f.step.copies[1]).unwrap();
    let pages = f.kv.group(1).block_table(SeqId(3)).unwrap().to_vec();
    let mut k = vec![0u8; BS * HEAD_DIM * 4];
    let mut v = k.clone();
    for (i, &p) in pages.iter().enumerate() {
        f.store.read_tokens(0, &[p], BS, &mut k, &mut v).unwrap();
        for j in 0..BS {
            let off = j * HEAD_DIM * 4;
            let got = f32::from_le_bytes(k[off..off + 4].try_into().unwrap());
            assert_eq!(got, value(1, 2, i * BS + j), "state page {i} slot {j}");
        }
    }
    f.kv.check_invariants().unwrap();
}

/// A broker whose one model is a hybrid cache (full + window groups) of 4 chunks of 4
/// pages, floor 1 chunk, with a host tier of `host_blocks` blocks, holding sequences
/// with bytes: 1 (10 tokens), 2 (12 tokens, its first window page given back), 3
/// (an 8-token prompt) and 4, a fork of 3 sharing every page. Returns the sequences as
/// `(id, computed, writer)`.
fn sleepy_hybrid(host_blocks: usize) -> (Broker<FlakyStorage>, ModelId, Vec<(SeqId, usize, u64)>) {
    let l = layout();
    let chunk = 4 * l.block_bytes();
    let mut broker = Broker::new(BrokerConfig::new(8 * chunk, chunk)).unwrap();
    let kv = KvCache::hybrid_with_host_tier(&full_window(), 16, host_blocks).unwrap();
    let store = HostStorage::with_host_tier(l, 16, host_blocks).unwrap();
    let id = broker
        .register(
            "hybrid",
            kv,
            FlakyStorage::new(store, false),
            ModelLimits::new(chunk, 8 * chunk),
        )
        .unwrap();
    let mut g = broker.lock(id).unwrap();
    let (kv, store) = g.parts_mut();
    let mut step = GroupStep::default();
    let write = |step: &GroupStep, id: u64, first: usize, store: &mut FlakyStorage| {
        for gr in 0..2 {
            let slots = &step.slots[gr];
            let (k, v) = rows((0..slots.len()).map(|i| value(gr, id, first + i)));
            store.inner.write_slots(0, slots, &k, &v).unwrap();
        }
    };
    kv.admit_grouped(SeqId(1), 10, &mut step).unwrap();
    write(&step, 1, 0, store);
    kv.admit_grouped(SeqId(2), 5, &mut step).unwrap();
    write(&step, 2, 0, store);
    kv.append_grouped(SeqId(2), 6, &mut step).unwrap();
    write(&step, 2, 5, store);
    kv.append_grouped(SeqId(2), 1, &mut step).unwrap();
    write(&step, 2, 11, store);
    let prompt: Vec<u32> = (0..8).collect();
    kv.admit_tokens_grouped(SeqId(3), &prompt, &AdmitOptions::default(), &mut step)
        .unwrap();
    write(&step, 3, 0, store);
    kv.fork(SeqId(3), SeqId(4)).unwrap();
    assert_eq!(
        kv.group(1).block_table(SeqId(2)).unwrap()[0],
        BlockId::RELEASED
    );
    assert_eq!(kv.group_stats().used_pages, 15);
    drop(g);
    broker.check_invariants().unwrap();
    let seqs = vec![
        (SeqId(1), 10, 1),
        (SeqId(2), 12, 2),
        (SeqId(3), 8, 3),
        (SeqId(4), 8, 3),
    ];
    (broker, id, seqs)
}

fn swap_sleep() -> SleepOptions {
    SleepOptions {
        swap_out_sequences: true,
        spill_cached_prefixes: false,
    }
}

#[test]
fn sleep_swaps_a_hybrid_models_sequences_out_and_they_come_back_with_their_bytes() {
    // Every group's blocks, each sequence's own: 6 + 5 + 4 + 4 (the fork's shared
    // pages once per sequence) = 19 host blocks.
    let (broker, id, seqs) = sleepy_hybrid(19);
    let state = [false, false];
    let report = broker.sleep(id, swap_sleep()).unwrap();
    broker.check_invariants().unwrap();
    let chunk = 4 * layout().block_bytes();
    assert_eq!(report.freed_bytes, 3 * chunk);
    {
        let mut g = broker.lock(id).unwrap();
        let kv = g.kv();
        assert_eq!(kv.num_blocks(), 4);
        assert_eq!(kv.sequence_ids().count(), 0);
        assert_eq!(kv.num_free_host_blocks(), 0);
        for &(s, _, _) in &seqs {
            assert!(kv.is_swapped(s), "{s}");
        }
        // Scribble over the arena: the bytes read below can only come from the host.
        let (_, store) = g.parts_mut();
        store.inner.region_mut(0).fill(0xA5);
    }
    // Wake to 8 chunks and swap every sequence in.
    broker.wake(id, 8 * chunk).unwrap();
    let mut g = broker.lock(id).unwrap();
    let (kv, store) = g.parts_mut();
    for &(s, _, _) in &seqs {
        let job = kv.swap_in_grouped(s).unwrap();
        for plan in &job.plans {
            store.swap(plan).unwrap();
        }
        kv.complete_swap_grouped(&job).unwrap();
    }
    check_bytes(kv, &store.inner, &seqs, &state);
    // The full group's prompt pages are shared again (the swap-in finds them
    // registered in its prefix cache); the window group's come back one copy each.
    let table = |gr: usize, s: u64| kv.group(gr).block_table(SeqId(s)).unwrap().to_vec();
    assert_eq!(table(0, 3), table(0, 4));
    assert_ne!(table(1, 3), table(1, 4));
    assert_eq!(kv.group_stats().used_pages, 17);
    // The window group's hole stayed a hole.
    assert_eq!(
        kv.group(1).block_table(SeqId(2)).unwrap()[0],
        BlockId::RELEASED
    );
    drop(g);
    broker.check_invariants().unwrap();
}

#[test]
fn a_hybrid_sleep_that_cannot_swap_every_sequence_out_changes_nothing() {
    let state = [false, false];
    // One host block short of every sequence's blocks: refused before any job.
    let (broker, id, seqs) = sleepy_hybrid(18);
    let before = snapshot(broker.lock(id).unwrap().kv());
    let e = broker.sleep(id, swap_sleep()).unwrap_err();
    assert_eq!(
        e,
        Error::TierFull {
            tier: "host",
            needed: 19,
            free: 18
        }
    );
    assert_eq!(snapshot(broker.lock(id).unwrap().kv()), before);
    broker.check_invariants().unwrap();
    {
        let g = broker.lock(id).unwrap();
        check_bytes(g.kv(), &g.storage().inner, &seqs, &state);
    }

    // Room for all, but a transfer fails halfway: every job aborted, the sequences
    // resident with their bytes, the arena unshrunk.
    let (broker, id, seqs) = sleepy_hybrid(19);
    let tables = |kv: &KvCache| {
        let mut out = vec![format!("{:?}", kv.group_stats())];
        for &(s, _, _) in &seqs {
            for gr in 0..kv.num_groups() {
                out.push(format!("{s} {gr} {:?}", kv.group(gr).block_table(s)));
            }
        }
        out.push(format!("host free {}", kv.num_free_host_blocks()));
        out
    };
    let before = tables(broker.lock(id).unwrap().kv());
    broker.lock(id).unwrap().parts_mut().1.swap_failures = 1;
    let e = broker.sleep(id, swap_sleep()).unwrap_err();
    assert!(matches!(e, Error::Cuda(_)), "{e:?}");
    assert_eq!(tables(broker.lock(id).unwrap().kv()), before);
    broker.check_invariants().unwrap();
    {
        let g = broker.lock(id).unwrap();
        assert_eq!(g.kv().num_blocks(), 16);
        for &(s, _, _) in &seqs {
            assert!(!g.kv().is_swapped(s) && g.kv().swap_in_flight(s).is_none());
        }
        check_bytes(g.kv(), &g.storage().inner, &seqs, &state);
    }
    // The fault is gone: the same sleep now swaps everything out.
    broker.sleep(id, swap_sleep()).unwrap();
    assert_eq!(broker.lock(id).unwrap().kv().num_blocks(), 4);
    broker.check_invariants().unwrap();
}

#[test]
fn swap_out_each_grouped_plans_all_or_nothing_on_a_one_group_twin_too() {
    // The same calls on a one-group cache and on a hybrid one whose group 0 is the
    // same: both refuse a host tier one block short, changing nothing, and both plan
    // one job per sequence when it fits.
    let l = layout();
    let one = KvCache::builder(l)
        .num_blocks(16)
        .watermark_blocks(0)
        .tiers(pagedkv::TierConfig {
            num_host_blocks: 5,
            ..Default::default()
        })
        .build()
        .unwrap();
    let hybrid = KvCache::hybrid_with_host_tier(&[GroupSpec::full(l)], 16, 5).unwrap();
    for mut kv in [one, hybrid] {
        let mut step = GroupStep::default();
        kv.admit_grouped(SeqId(1), 10, &mut step).unwrap(); // 3 blocks
        kv.fork(SeqId(1), SeqId(2)).unwrap(); // 3 more host blocks, shared on device
        let before = snapshot(&kv);
        let e = kv.swap_out_each_grouped(&[SeqId(1), SeqId(2)]).unwrap_err();
        assert_eq!(
            e,
            Error::TierFull {
                tier: "host",
                needed: 6,
                free: 5
            },
            "hybrid: {}",
            kv.is_hybrid()
        );
        assert_eq!(snapshot(&kv), before);
        let e = kv.swap_out_each_grouped(&[SeqId(1), SeqId(1)]).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
        assert_eq!(snapshot(&kv), before);
        kv.free(SeqId(2)).unwrap();
        kv.admit_grouped(SeqId(3), 8, &mut step).unwrap(); // 2 blocks
        let jobs = kv.swap_out_each_grouped(&[SeqId(1), SeqId(3)]).unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].seq, SeqId(1));
        assert_eq!(jobs[0].plans[0].len(), 3);
        assert_eq!(jobs[1].plans[0].len(), 2);
        for job in &jobs {
            kv.complete_swap_grouped(job).unwrap();
        }
        assert!(kv.is_swapped(SeqId(1)) && kv.is_swapped(SeqId(3)));
        assert_eq!(kv.num_free_host_blocks(), 0);
        kv.check_invariants().unwrap();
    }
}
