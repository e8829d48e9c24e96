//! Sliding-window groups keep the blocks they give back (`manager/groups/window_cache.rs`).
//!
//! * a shared system prompt hits in every group after its first holder decoded past
//!   the window and was freed (or is still live past it); the window blocks served
//!   from the cache hold the prompt's K/V, read back byte for byte from
//!   `HostStorage`;
//! * the hit needs the whole window at its end: evicting blocks before it changes
//!   nothing, evicting one inside it ends the hit;
//! * cached window pages count as free: an allocation of another group takes them,
//!   and a window group takes the full group's cached pages;
//! * refusals change nothing (full `Debug` snapshots of every group);
//! * the batch step path keeps what it gives back as the per-sequence calls do (the
//!   dead window of an admitted prompt, given back by its first step's reservation),
//!   so a seeded schedule serves the same hits through either;
//! * a model-based property test: admissions of shared prompts, decodes, frees,
//!   evictions, forks, chunked prefills, swaps and compactions against a byte shadow
//!   keyed by token position, with `check_invariants` after every step and every
//!   refused call changing nothing.

use pagedkv::{
    AdmitOptions, BlockId, DType, Error, GroupSpec, GroupStep, HostStorage, KvCache, KvLayout,
    ModelShape, SeqId, Storage,
};
use proptest::prelude::*;

use crate::support::kv_bytes;
use kv_bytes::{check_values, write_values};

const BS: usize = 4;
const WINDOW: usize = 8;

fn layout(layers: usize) -> KvLayout {
    let shape = ModelShape {
        num_layers: layers,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: 2,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, BS).unwrap()
}

fn specs() -> [GroupSpec; 2] {
    let l = layout(2);
    [GroupSpec::full(l), GroupSpec::window(l, WINDOW)]
}

/// The value of the token at `pos` of a sequence whose tokens up to `pos` are
/// `owner`'s (a prompt family, or a sequence's own decode), in group `g`.
fn value(g: usize, owner: u32, pos: usize) -> u32 {
    (owner * 4 + g as u32) * 4096 + pos as u32
}

fn prompt(family: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| family * 1000 + i).collect()
}

use crate::support::snapshot::groups_snapshot as snapshot;

/// Writes the slots of `step` (tokens from `first`) with `owner`'s values.
fn write(store: &mut HostStorage, step: &GroupStep, owner: &[u32], first: usize) {
    for (g, slots) in step.slots.iter().enumerate() {
        store.copy_blocks(&step.copies[g]).unwrap();
        let vals: Vec<u32> = (0..slots.len())
            .map(|i| value(g, owner[first + i], first + i))
            .collect();
        write_values(store, slots, &vals);
    }
}

/// Checks that `seq` reads, in every group, `owner`'s value at every computed
/// position it still holds (after its window holes).
fn check(kv: &KvCache, store: &HostStorage, seq: SeqId, owner: &[u32]) {
    let n = kv.num_computed_tokens(seq).unwrap();
    for g in 0..kv.num_groups() {
        let (table, computed) = kv.group(g).readable_blocks(seq).unwrap();
        assert_eq!(computed, n);
        let holes = table
            .iter()
            .take_while(|&&b| b == BlockId::RELEASED)
            .count();
        let first = holes * BS;
        let want: Vec<u32> = (first..n).map(|p| value(g, owner[p], p)).collect();
        assert_eq!(
            check_values(store, &table[holes..], &want),
            Ok(()),
            "{seq} group {g}: tokens {first}..{n}"
        );
    }
}

struct Bench {
    kv: KvCache,
    store: HostStorage,
    step: GroupStep,
}

const HOST_BLOCKS: usize = 32;

impl Bench {
    fn new(pages: usize) -> Self {
        Bench {
            kv: KvCache::hybrid_with_host_tier(&specs(), pages, HOST_BLOCKS).unwrap(),
            store: HostStorage::with_host_tier(specs()[0].layout, pages, HOST_BLOCKS).unwrap(),
            step: GroupStep::default(),
        }
    }

    /// Admits `seq` with family `family`'s prompt of `len`, writes it; the hit.
    fn admit(&mut self, seq: u64, family: u32, len: usize) -> usize {
        let tokens = prompt(family, len);
        let opts = AdmitOptions::default();
        let looked = self.kv.cached_prefix_len(&tokens, &opts).unwrap();
        let a = self
            .kv
            .admit_tokens_grouped(SeqId(seq), &tokens, &opts, &mut self.step)
            .unwrap();
        assert_eq!(a.cached_tokens, looked);
        write(
            &mut self.store,
            &self.step,
            &vec![family; len],
            a.cached_tokens,
        );
        self.kv.check_invariants().unwrap();
        a.cached_tokens
    }

    /// Decodes `n` tokens of `seq` (its own values from position `from`).
    fn decode(&mut self, seq: u64, n: usize) {
        for _ in 0..n {
            let at = self.kv.num_computed_tokens(SeqId(seq)).unwrap();
            self.kv
                .append_grouped(SeqId(seq), 1, &mut self.step)
                .unwrap();
            let owner = vec![100 + seq as u32; at + 1];
            write(&mut self.store, &self.step, &owner, at);
        }
        self.kv.check_invariants().unwrap();
    }

    fn window_table(&self, seq: u64) -> Vec<BlockId> {
        self.kv.group(1).block_table(SeqId(seq)).unwrap().to_vec()
    }
}

#[test]
fn a_shared_prompt_hits_in_every_group_after_its_holder_decoded_past_and_left() {
    for keep_a_live in [false, true] {
        let mut b = Bench::new(64);
        assert_eq!(b.admit(1, 7, 30), 0);
        let a_window = b.window_table(1);
        b.decode(1, 40); // far past the prompt's window
        assert!(b.window_table(1)[..7]
            .iter()
            .all(|&p| p == BlockId::RELEASED));
        if !keep_a_live {
            b.kv.free(SeqId(1)).unwrap();
        }
        b.kv.check_invariants().unwrap();
        // The query at 28 reads from 21: window blocks 5 and 6, the ones A wrote.
        assert_eq!(b.admit(2, 7, 30), 28, "keep A live: {keep_a_live}");
        let t = b.window_table(2);
        assert!(t[..5].iter().all(|&p| p == BlockId::RELEASED));
        assert_eq!(t[5..7], a_window[5..7], "the cached pages A gave back");
        assert_eq!(
            b.kv.group(0).block_table(SeqId(2)).unwrap()[..7].len(),
            7,
            "the full group shares the whole chain"
        );
        // B reads A's prompt bytes through its tables in every group, byte for byte.
        check(&b.kv, &b.store, SeqId(2), &[7; 30]);
        // And decodes on: its window moves through the blocks it wrote itself.
        b.decode(2, 12);
        let mut owner = vec![7; 30];
        owner.extend([102; 12]);
        check(&b.kv, &b.store, SeqId(2), &owner);
    }
}

#[test]
fn the_hit_needs_every_block_of_its_window_and_only_those() {
    let mut b = Bench::new(64);
    b.admit(1, 7, 30);
    b.decode(1, 40);
    // A is live: its full blocks are not evictable, so evictions take the cached
    // window pages, oldest first (blocks 0, 1, ... in the order A gave them back).
    let cached = b.kv.group_stats().cached_pages;
    assert!(cached >= 7, "{cached}");
    assert_eq!(b.kv.evict_cached(2), 2);
    b.kv.check_invariants().unwrap();
    let opts = AdmitOptions::default();
    assert_eq!(
        b.kv.cached_prefix_len(&prompt(7, 30), &opts).unwrap(),
        28,
        "blocks 0 and 1 lie before the window of every hit"
    );
    // Blocks 2..=5 go: block 5 is inside the window of the hit at 28, and every
    // shorter hit's window holds an evicted block too.
    assert_eq!(b.kv.evict_cached(4), 4);
    assert_eq!(b.kv.cached_prefix_len(&prompt(7, 30), &opts).unwrap(), 0);
    assert_eq!(b.admit(2, 7, 30), 0);
    check(&b.kv, &b.store, SeqId(2), &[7; 30]);
}

#[test]
fn cached_window_pages_are_free_pages_for_every_group_and_refusals_change_nothing() {
    let mut b = Bench::new(24);
    b.admit(1, 7, 30); // 8 pages in each group
    b.decode(1, 6); // 36 tokens: full 9 pages; window blocks 7 and 8 held, 0..=6 cached
    let st = b.kv.group_stats();
    assert_eq!((st.used_pages, st.cached_pages), (11, 7));
    assert_eq!((st.free_pages, b.kv.num_available_blocks()), (13, 13));
    // 24 tokens of another prompt: 12 pages, 6 free ones and 6 cached window pages.
    assert_eq!(b.admit(3, 9, 24), 0);
    let st = b.kv.group_stats();
    assert_eq!((st.used_pages, st.cached_pages, st.free_pages), (23, 1, 1));
    // 28 tokens need 14 pages: refused, nothing changed.
    let before = snapshot(&b.kv);
    let opts = AdmitOptions::default();
    let bad =
        b.kv.admit_tokens_grouped(SeqId(4), &prompt(5, 28), &opts, &mut b.step);
    assert!(matches!(bad, Err(Error::OutOfBlocks { .. })), "{bad:?}");
    assert_eq!(snapshot(&b.kv), before);
    // The other way: the full group's cached pages go to the window group.
    b.kv.free(SeqId(1)).unwrap();
    b.kv.free(SeqId(3)).unwrap();
    b.kv.check_invariants().unwrap();
    assert_eq!(b.kv.group_stats().free_pages, 24);
    assert_eq!(b.admit(5, 11, 48), 0); // the whole arena
    assert_eq!(b.kv.group_stats().cached_pages, 0);
    check(&b.kv, &b.store, SeqId(5), &[11; 48]);
}

#[test]
fn a_hit_that_does_not_fit_changes_nothing() {
    let mut b = Bench::new(24);
    b.admit(1, 7, 30);
    b.decode(1, 34); // 64 tokens: every page of A's prompt window cached or gone
    b.kv.free(SeqId(1)).unwrap();
    let opts = AdmitOptions::default();
    assert_eq!(b.kv.cached_prefix_len(&prompt(7, 40), &opts).unwrap(), 28);
    // Take most of the arena with another prompt, then ask for more than is left.
    let free = b.kv.group_stats().free_pages;
    assert!(free >= 20, "{free}");
    b.admit(2, 9, 32); // 16 pages
    let before = snapshot(&b.kv);
    let bad =
        b.kv.admit_tokens_grouped(SeqId(3), &prompt(7, 60), &opts, &mut b.step);
    assert!(matches!(bad, Err(Error::OutOfBlocks { .. })), "{bad:?}");
    assert_eq!(snapshot(&b.kv), before);
    b.kv.check_invariants().unwrap();
}

#[derive(Debug, Clone)]
enum Action {
    /// Admit family `.0`'s prompt of `.1` tokens (whole, or chunked when `.2`).
    Admit(u32, usize, bool),
    /// Decode `.1` tokens of sequence `.0` (modulo the live ones).
    Decode(usize, usize),
    Free(usize),
    Fork(usize),
    Evict(usize),
    /// Swap a live sequence out (plans run on the storage), or one back in.
    SwapOut(usize),
    SwapIn(usize),
    /// Compact the arena (the cached window pages move like any page).
    Defrag,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (0u32..3, 1usize..48, any::<bool>()).prop_map(|(f, n, c)| Action::Admit(f, n, c)),
        4 => (0usize..8, 1usize..12).prop_map(|(s, n)| Action::Decode(s, n)),
        2 => (0usize..8).prop_map(Action::Free),
        1 => (0usize..8).prop_map(Action::Fork),
        1 => (0usize..12).prop_map(Action::Evict),
        1 => (0usize..8).prop_map(Action::SwapOut),
        1 => (0usize..8).prop_map(Action::SwapIn),
        1 => Just(Action::Defrag),
    ]
}

struct Model {
    b: Bench,
    /// Live sequences and the owner of each of their positions.
    seqs: Vec<(u64, Vec<u32>)>,
    /// Swapped-out sequences, as `seqs`.
    swapped: Vec<(u64, Vec<u32>)>,
    next: u64,
    hits: usize,
    /// Tokens per chunk of a chunked prefill.
    chunk: usize,
}

impl Model {
    fn new(pages: usize) -> Self {
        Model {
            b: Bench::new(pages),
            seqs: Vec::new(),
            swapped: Vec::new(),
            next: 1,
            hits: 0,
            chunk: 8,
        }
    }

    fn apply(&mut self, a: &Action) {
        let before = snapshot(&self.b.kv);
        let opts = AdmitOptions::default();
        let result = match *a {
            Action::Admit(f, n, chunked) => {
                let id = self.next;
                self.next += 1;
                let tokens = prompt(f, n);
                let looked = self.b.kv.cached_prefix_len(&tokens, &opts).unwrap();
                let r = if chunked {
                    self.b.kv.admit_prompt_grouped(SeqId(id), &tokens, &opts)
                } else {
                    self.b
                        .kv
                        .admit_tokens_grouped(SeqId(id), &tokens, &opts, &mut self.b.step)
                };
                r.map(|adm| {
                    assert_eq!(adm.cached_tokens, looked);
                    self.hits += adm.cached_tokens;
                    let owner = vec![f; n];
                    if chunked {
                        self.seqs.push((id, owner[..adm.cached_tokens].to_vec()));
                        self.prefill(id, &owner, adm.cached_tokens);
                    } else {
                        write(&mut self.b.store, &self.b.step, &owner, adm.cached_tokens);
                        self.seqs.push((id, owner));
                    }
                })
            }
            Action::Decode(s, n) => {
                if self.seqs.is_empty() {
                    return;
                }
                let i = s % self.seqs.len();
                let id = self.seqs[i].0;
                let at = self.seqs[i].1.len();
                let r = self.b.kv.append_grouped(SeqId(id), n, &mut self.b.step);
                if r.is_ok() {
                    self.seqs[i]
                        .1
                        .extend(std::iter::repeat_n(100 + id as u32, n));
                    write(&mut self.b.store, &self.b.step, &self.seqs[i].1, at);
                }
                r
            }
            Action::Free(s) => {
                if self.seqs.is_empty() {
                    return;
                }
                let (id, _) = self.seqs.swap_remove(s % self.seqs.len());
                self.b.kv.free(SeqId(id))
            }
            Action::Fork(s) => {
                if self.seqs.is_empty() {
                    return;
                }
                let i = s % self.seqs.len();
                let id = self.next;
                self.next += 1;
                let r = self
                    .b
                    .kv
                    .fork_grouped(SeqId(self.seqs[i].0), SeqId(id), &mut self.b.step);
                if r.is_ok() {
                    for (g, plan) in self.b.step.copies.iter().enumerate() {
                        assert!(plan.is_empty(), "group {g}: a KV fork copies nothing");
                    }
                    let owner = self.seqs[i].1.clone();
                    self.seqs.push((id, owner));
                }
                r
            }
            Action::Evict(n) => {
                self.b.kv.evict_cached(n);
                Ok(())
            }
            Action::SwapOut(s) => {
                if self.seqs.is_empty() {
                    return;
                }
                let i = s % self.seqs.len();
                let r = self.b.kv.swap_out_grouped(SeqId(self.seqs[i].0));
                r.map(|job| {
                    for plan in &job.plans {
                        self.b.store.swap(plan).unwrap();
                    }
                    self.b.kv.complete_swap_grouped(&job).unwrap();
                    let w = self.seqs.swap_remove(i);
                    self.swapped.push(w);
                })
            }
            Action::SwapIn(s) => {
                if self.swapped.is_empty() {
                    return;
                }
                let i = s % self.swapped.len();
                let r = self.b.kv.swap_in_grouped(SeqId(self.swapped[i].0));
                r.map(|job| {
                    for plan in &job.plans {
                        self.b.store.swap(plan).unwrap();
                    }
                    self.b.kv.complete_swap_grouped(&job).unwrap();
                    let w = self.swapped.swap_remove(i);
                    self.seqs.push(w);
                })
            }
            Action::Defrag => {
                let pending = self.b.kv.plan_defragment_grouped().unwrap();
                self.b
                    .store
                    .copy_blocks(&pending.plan().to_copy_plan())
                    .unwrap();
                pending.commit().map(drop)
            }
        };
        if result.is_err() {
            assert_eq!(
                snapshot(&self.b.kv),
                before,
                "{a:?} failed and changed state"
            );
        }
        self.b.kv.check_invariants().unwrap();
        for (id, owner) in &self.seqs {
            check(&self.b.kv, &self.b.store, SeqId(*id), owner);
        }
    }

    /// Chunked prefill of `owner`'s prompt from `from`, in chunks of `chunk` tokens; frees
    /// the sequence when a chunk does not fit.
    fn prefill(&mut self, id: u64, owner: &[u32], from: usize) {
        let mut at = from;
        while at < owner.len() {
            let n = (owner.len() - at).min(self.chunk);
            if self
                .b
                .kv
                .reserve_grouped(SeqId(id), n, 0, &mut self.b.step)
                .is_err()
            {
                let i = self.seqs.iter().position(|s| s.0 == id).unwrap();
                self.seqs.swap_remove(i);
                self.b.kv.free(SeqId(id)).unwrap();
                return;
            }
            write(&mut self.b.store, &self.b.step, owner, at);
            self.b.kv.commit(SeqId(id), n).unwrap();
            at += n;
            let i = self.seqs.iter().position(|s| s.0 == id).unwrap();
            self.seqs[i].1 = owner[..at].to_vec();
        }
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(64))]
    #[test]
    fn window_hits_read_the_prompts_true_bytes(
        actions in prop::collection::vec(action(), 1..60),
        chunk in 1usize..20,
    ) {
        let mut m = Model::new(48);
        m.chunk = chunk;
        for a in &actions {
            m.apply(a);
        }
        let all = std::mem::take(&mut m.seqs).into_iter().chain(std::mem::take(&mut m.swapped));
        for (id, _) in all {
            m.b.kv.free(SeqId(id)).unwrap();
        }
        m.b.kv.check_invariants().unwrap();
        prop_assert_eq!(m.b.kv.group_stats().used_pages, 0);
    }
}

#[test]
fn the_property_test_serves_window_hits_from_the_cache() {
    // A fixed run of the model: a prompt decoded past its window and freed, then hit.
    let mut m = Model::new(48);
    for a in [
        Action::Admit(1, 30, false),
        Action::Decode(0, 11),
        Action::Decode(0, 11),
        Action::Free(0),
        Action::Admit(1, 40, true),
        Action::Fork(0),
        Action::Decode(1, 9),
        Action::Admit(1, 33, false),
    ] {
        m.apply(&a);
    }
    // 28 from the cache A left, then 32: the chunked 40-token prompt registered 8
    // full blocks, and a live sequence holds the window at 32.
    assert_eq!(m.hits, 28 + 32);
}

#[test]
fn the_batch_step_path_keeps_the_window_blocks_it_gives_back() {
    let mut b = Bench::new(64);
    b.admit(1, 7, 30);
    let h = b.kv.handle(SeqId(1)).unwrap();
    let mut bufs = [
        pagedkv::StepBuffers::new(4, 64, 64),
        pagedkv::StepBuffers::new(4, 64, 64),
    ];
    for _ in 0..20 {
        let e = [pagedkv::StepEntry {
            seq: h,
            new_tokens: 1,
            lookahead: 0,
        }];
        b.kv.reserve_step_grouped(&e, &mut bufs).unwrap();
        b.kv.commit_step(&[(h, 1)]).unwrap();
        b.kv.check_invariants().unwrap();
    }
    assert!(b.window_table(1)[..7]
        .iter()
        .all(|&p| p == BlockId::RELEASED));
    b.kv.free(SeqId(1)).unwrap();
    assert_eq!(b.admit(2, 7, 30), 28);
    check(&b.kv, &b.store, SeqId(2), &[7; 30]);
}

#[test]
fn a_chunk_longer_than_the_window_keeps_the_blocks_it_computes_and_gives_back() {
    // Chunks of 16 tokens under a window of 8: each commit computes 4 blocks, registers
    // them in the full group and gives back the window blocks before the next query,
    // some of them computed by that very chunk.
    let mut m = Model::new(48);
    m.chunk = 16;
    m.apply(&Action::Admit(3, 40, true));
    assert_eq!(m.b.kv.num_computed_tokens(SeqId(1)).unwrap(), 40);
    m.apply(&Action::Free(0));
    // A prompt of 25 of those tokens hits 24: the query at 24 reads from 17, blocks 4
    // and 5, computed by the second chunk and given back by its own commit (at 32,
    // the window starts at 25), before their hash was known.
    m.apply(&Action::Admit(3, 25, false));
    assert_eq!(m.hits, 24);
}

#[test]
fn the_batch_step_keeps_the_window_blocks_its_first_reservation_gives_back() {
    // A's admission computes 30 tokens and gives nothing back; its first step's query
    // at 30 reads from 23, so that step gives back window blocks 0 to 4, the prompt's.
    let mut b = Bench::new(64);
    b.admit(1, 7, 30);
    let h = b.kv.handle(SeqId(1)).unwrap();
    let mut bufs = [
        pagedkv::StepBuffers::new(4, 64, 64),
        pagedkv::StepBuffers::new(4, 64, 64),
    ];
    let e = [pagedkv::StepEntry {
        seq: h,
        new_tokens: 1,
        lookahead: 0,
    }];
    b.kv.reserve_step_tokens_grouped(&e, &[9], &mut bufs)
        .unwrap();
    assert!(b.window_table(1)[..5]
        .iter()
        .all(|&p| p == BlockId::RELEASED));
    b.kv.check_invariants().unwrap();
    b.kv.commit_step(&[(h, 1)]).unwrap();
    b.kv.check_invariants().unwrap();
    // B's query at 20 reads from 13: window blocks 3 and 4, kept from that step.
    assert_eq!(b.admit(2, 7, 21), 20);
    check(&b.kv, &b.store, SeqId(2), &[7; 21]);
}

/// Runs a seeded schedule of admissions of one shared 12-token prompt with tails of
/// their own, decode steps of every live sequence and frees, through the batch step
/// path or the per-sequence calls; returns each admission's hit.
fn hits_of_schedule(step_path: bool, seed: u64) -> Vec<usize> {
    let mut rng = seed;
    let mut next = move |n: u64| {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    let mut kv = KvCache::hybrid(&specs(), 256).unwrap();
    let mut step = GroupStep::default();
    let mut bufs = [
        pagedkv::StepBuffers::new(16, 64, 64),
        pagedkv::StepBuffers::new(16, 64, 64),
    ];
    let (mut live, mut hits) = (Vec::new(), Vec::new());
    let (mut id, mut token) = (0u64, 90_000u32);
    for _ in 0..200 {
        match next(4) {
            0 if live.len() < 8 => {
                id += 1;
                let mut p = prompt(1, 12);
                p.extend((0..next(10) as u32).map(|i| 50_000 + id as u32 * 100 + i));
                let a = kv
                    .admit_tokens_grouped(SeqId(id), &p, &AdmitOptions::default(), &mut step)
                    .unwrap();
                hits.push(a.cached_tokens);
                live.push(id);
            }
            1 if !live.is_empty() => {
                let k = next(live.len() as u64) as usize;
                kv.free(SeqId(live.remove(k))).unwrap();
            }
            _ if !live.is_empty() => {
                let ids: Vec<u32> = live
                    .iter()
                    .map(|_| {
                        token += 1;
                        token
                    })
                    .collect();
                if step_path {
                    let e: Vec<_> = live
                        .iter()
                        .map(|&s| pagedkv::StepEntry {
                            seq: kv.handle(SeqId(s)).unwrap(),
                            new_tokens: 1,
                            lookahead: 0,
                        })
                        .collect();
                    kv.reserve_step_tokens_grouped(&e, &ids, &mut bufs).unwrap();
                    let accepted: Vec<_> = e.iter().map(|e| (e.seq, 1)).collect();
                    kv.commit_step(&accepted).unwrap();
                } else {
                    for (&s, &t) in live.iter().zip(&ids) {
                        kv.append_tokens_grouped(SeqId(s), &[t], &mut step).unwrap();
                    }
                }
            }
            _ => {}
        }
        kv.check_invariants().unwrap();
    }
    hits
}

#[test]
fn the_batch_step_path_serves_the_hits_the_per_sequence_calls_serve() {
    let mut served = 0;
    for seed in 0..20 {
        let per_seq = hits_of_schedule(false, seed);
        assert_eq!(hits_of_schedule(true, seed), per_seq, "seed {seed}");
        served += per_seq.iter().filter(|&&h| h > 0).count();
    }
    assert!(served > 100, "{served} hits");
}
