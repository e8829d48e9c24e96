//! A recurrent state through export and import, and the checkpoint policy, on a
//! hybrid cache of one attention group and one state group over `HostStorage`:
//!
//! * export and import carry every K/V byte and every state byte into a second cache
//!   whose arena is fragmented (the pages land elsewhere, the bytes are equal);
//! * a corrupted buffer, a group entry that contradicts its record, a receiver of
//!   another state size or block size, a receiver without a state group and a full
//!   receiver are typed errors that change nothing;
//! * the checkpoint policy: a simulated engine whose state is a fold of the token
//!   history computes each step from the bytes in its state pages, and a shadow folds
//!   the whole history; the turn end's checkpoint serves the next turn, and the state
//!   the hit resumes from equals the recomputed one byte for byte; shared prefix ends
//!   serve other conversations; a chain keeps at most `max_per_chain` checkpoints; a
//!   checkpoint whose prefix was evicted is dropped; one without room is skipped (at
//!   admission) or refused; a reused sequence id keeps its last owner's turn end;
//!   policy errors change nothing; a proptest of chat turns in a small arena checks
//!   every hit's state against the shadow.

use crate::state_groups::{layout, BS, HEAD_DIM, LAYERS, STATE_PAGES};
use pagedkv::export::groups::{
    export_group_sequence, exported_group_len, import_group_sequence, GroupExportView,
};
use pagedkv::layout::Slot;
use pagedkv::pool::prefix::Admission;
use pagedkv::{
    AdmitOptions, BlockId, CheckpointPolicy, DType, Error, GroupSpec, GroupStep, HostStorage,
    KvCache, KvLayout, ModelShape, SeqId, Storage,
};

/// Bytes of one token's K (or V) row in one layer.
const ROW: usize = HEAD_DIM * 4;
const PAGES: usize = 64;

fn cache_with(state_pages: usize) -> (KvCache, HostStorage) {
    let specs = [
        GroupSpec::full(layout()),
        GroupSpec::state(layout(), state_pages),
    ];
    (
        KvCache::hybrid(&specs, PAGES).unwrap(),
        HostStorage::new(layout(), PAGES).unwrap(),
    )
}

fn cache() -> (KvCache, HostStorage) {
    cache_with(STATE_PAGES)
}

/// Every group's tables and counters.
fn snapshot(kv: &KvCache) -> Vec<String> {
    let mut out: Vec<String> = (0..kv.num_groups())
        .map(|g| format!("{:?}", kv.group(g)))
        .collect();
    out.push(format!("{:?}", kv.group_stats()));
    out.push(format!("{:?}", kv.checkpoint_policy()));
    out.push(format!("{}", kv.num_state_checkpoints()));
    out
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Every slot of `pages`, in order.
fn page_slots(pages: &[BlockId]) -> Vec<Slot> {
    pages
        .iter()
        .flat_map(|p| (0..BS).map(move |o| layout().slot(*p, o)))
        .collect()
}

/// Every byte of `pages` (each layer's block bytes, page after page).
fn page_bytes(store: &HostStorage, pages: &[BlockId]) -> Vec<u8> {
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        for &p in pages {
            out.extend_from_slice(store.block_bytes(layer, p).unwrap());
        }
    }
    out
}

/// K/V bytes of the first `n` tokens of `table`, every layer.
fn token_bytes(store: &HostStorage, table: &[BlockId], n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        let (mut k, mut v) = (vec![0; n * ROW], vec![0; n * ROW]);
        store.read_tokens(layer, table, n, &mut k, &mut v).unwrap();
        out.extend(k);
        out.extend(v);
    }
    out
}

fn state_pages(kv: &KvCache, seq: SeqId) -> Vec<BlockId> {
    kv.group(1).block_table(seq).unwrap().to_vec()
}

/// The K and V bytes of state `h` in one layer of `pages` pages: `h` itself first (so
/// the engine reads it back), then bytes that depend on `h`, the layer and the place.
fn encode(h: u64, layer: usize, pages: usize) -> (Vec<u8>, Vec<u8>) {
    let n = pages * BS * ROW;
    let byte = |half: u64, i: usize| {
        (mix(h ^ (half << 40) ^ ((layer as u64) << 32) ^ i as u64) & 0xFF) as u8
    };
    let mut k: Vec<u8> = (0..n).map(|i| byte(1, i)).collect();
    let v = (0..n).map(|i| byte(2, i)).collect();
    if layer == 0 {
        k[..8].copy_from_slice(&h.to_le_bytes());
    }
    (k, v)
}

fn write_state(store: &mut HostStorage, pages: &[BlockId], h: u64) {
    let slots = page_slots(pages);
    for layer in 0..LAYERS {
        let (k, v) = encode(h, layer, pages.len());
        store.write_slots(layer, &slots, &k, &v).unwrap();
    }
}

/// The state in `pages`, checked to be a whole, exact encoding.
fn read_state(store: &HostStorage, pages: &[BlockId]) -> u64 {
    let mut k = vec![0; pages.len() * BS * ROW];
    let mut v = k.clone();
    store
        .read_tokens(0, pages, pages.len() * BS, &mut k, &mut v)
        .unwrap();
    let h = u64::from_le_bytes(k[..8].try_into().unwrap());
    assert_eq!(
        page_bytes(store, pages),
        state_bytes(h, pages),
        "a torn state"
    );
    h
}

/// The bytes `page_bytes` reads for state `h` in `pages`.
fn state_bytes(h: u64, pages: &[BlockId]) -> Vec<u8> {
    let mut s = HostStorage::new(layout(), PAGES).unwrap();
    write_state(&mut s, pages, h);
    page_bytes(&s, pages)
}

/// The recurrence: the state after `tokens`, from state `h`.
fn fold(h: u64, tokens: &[u32]) -> u64 {
    tokens.iter().fold(h, |h, &t| mix(h ^ u64::from(t)))
}

const H0: u64 = 0x5EED;

// ---- export and import ------------------------------------------------------------

/// A sender with sequence 1 of 13 tokens (K/V written) and a state written.
fn sender() -> (KvCache, HostStorage) {
    let (mut kv, mut store) = cache();
    let mut step = GroupStep::default();
    kv.admit_grouped(SeqId(1), 12, &mut step).unwrap();
    let k: Vec<u8> = (0..12 * ROW).map(|i| (i * 7 % 251) as u8).collect();
    let v: Vec<u8> = (0..12 * ROW).map(|i| (i * 13 % 241) as u8).collect();
    for layer in 0..LAYERS {
        store.write_slots(layer, &step.slots[0], &k, &v).unwrap();
    }
    kv.append_grouped(SeqId(1), 1, &mut step).unwrap();
    for layer in 0..LAYERS {
        store
            .write_slots(layer, &step.slots[0], &[9; ROW], &[10; ROW])
            .unwrap();
    }
    write_state(&mut store, &state_pages(&kv, SeqId(1)), 0xABCD);
    (kv, store)
}

fn export(kv: &KvCache, store: &HostStorage, seq: SeqId) -> Vec<u8> {
    let mut wire = vec![0; exported_group_len(kv, store, seq, false).unwrap()];
    export_group_sequence(kv, store, seq, None, &mut wire).unwrap();
    wire
}

/// A receiver whose free pages are scattered: sequences admitted, every other freed.
fn fragmented() -> (KvCache, HostStorage) {
    let (mut kv, store) = cache();
    let mut step = GroupStep::default();
    for s in 0..6 {
        kv.admit_grouped(SeqId(100 + s), 5, &mut step).unwrap();
    }
    for s in (0..6).step_by(2) {
        kv.free(SeqId(100 + s)).unwrap();
    }
    (kv, store)
}

#[test]
fn state_and_kv_survive_export_and_import_byte_for_byte() {
    let (kv, store) = sender();
    let wire = export(&kv, &store, SeqId(1));
    let view = GroupExportView::parse(&wire).unwrap();
    assert_eq!(view.records()[1].state_pages, Some(STATE_PAGES));
    assert_eq!(view.records()[0].state_pages, None);

    let (mut rx, mut rx_store) = fragmented();
    import_group_sequence(&mut rx, &mut rx_store, SeqId(9), &wire).unwrap();
    rx.check_invariants().unwrap();
    assert_eq!(rx.num_computed_tokens(SeqId(9)).unwrap(), 13);
    // The pages differ (the arena is fragmented), the bytes do not.
    let (sent, got) = (state_pages(&kv, SeqId(1)), state_pages(&rx, SeqId(9)));
    assert_ne!(sent, got);
    assert_eq!(page_bytes(&rx_store, &got), page_bytes(&store, &sent));
    assert_eq!(read_state(&rx_store, &got), 0xABCD);
    let (t_sent, t_got) = (
        kv.group(0).block_table(SeqId(1)).unwrap(),
        rx.group(0).block_table(SeqId(9)).unwrap(),
    );
    assert_ne!(t_sent, t_got);
    assert_eq!(
        token_bytes(&rx_store, t_got, 13),
        token_bytes(&store, t_sent, 13)
    );
    // And back again: the re-export of the import is the same buffer.
    assert_eq!(export(&rx, &rx_store, SeqId(9)), wire);
}

#[test]
fn bad_state_exports_are_typed_errors_and_change_nothing() {
    let (kv, store) = sender();
    let wire = export(&kv, &store, SeqId(1));
    let check = |rx: &mut KvCache, rx_store: &mut HostStorage, buf: &[u8]| {
        let before = (snapshot(rx), rx_store.region(0).to_vec());
        let e = import_group_sequence(rx, rx_store, SeqId(9), buf).unwrap_err();
        assert_eq!((snapshot(rx), rx_store.region(0).to_vec()), before, "{e:?}");
        assert!(!rx.contains(SeqId(9)));
        rx.check_invariants().unwrap();
        e
    };

    // A flipped byte in the state record (the last one): its checksum.
    let (mut rx, mut rx_store) = fragmented();
    let mut bad = wire.clone();
    let at = bad.len() - 5;
    bad[at] ^= 0x10;
    assert!(matches!(
        check(&mut rx, &mut rx_store, &bad),
        Error::Checksum { .. }
    ));
    // A receiver whose state takes 2 pages, not 3.
    let (mut rx2, mut rx2_store) = cache_with(2);
    assert!(matches!(
        check(&mut rx2, &mut rx2_store, &wire),
        Error::ExportShape {
            what: "state pages per sequence",
            sender: 3,
            receiver: 2
        }
    ));
    // A receiver whose second group is a KV group.
    let full = [GroupSpec::full(layout()), GroupSpec::full(layout())];
    let (mut rx3, mut rx3_store) = (
        KvCache::hybrid(&full, PAGES).unwrap(),
        HostStorage::new(layout(), PAGES).unwrap(),
    );
    assert!(matches!(
        check(&mut rx3, &mut rx3_store, &wire),
        Error::ExportShape {
            sender: 1,
            receiver: 0,
            ..
        }
    ));
    // A receiver whose pages hold 8 tokens, not 4: 3 pages of other bytes.
    let wide = KvLayout::new(
        ModelShape {
            num_layers: LAYERS,
            num_q_heads: 2,
            num_kv_heads: 1,
            head_dim: HEAD_DIM,
            kv_dtype: DType::F32,
        },
        2 * BS,
    )
    .unwrap();
    let specs = [GroupSpec::full(wide), GroupSpec::state(wide, STATE_PAGES)];
    let (mut rx4, mut rx4_store) = (
        KvCache::hybrid(&specs, PAGES).unwrap(),
        HostStorage::new(wide, PAGES).unwrap(),
    );
    assert!(matches!(
        check(&mut rx4, &mut rx4_store, &wire),
        Error::ExportShape {
            what: "state page tokens (block size of the state group)",
            ..
        }
    ));
    // A receiver without room for the state pages: 4 K/V pages fit, 3 more do not.
    let (mut rx5, mut rx5_store) = cache();
    let mut step = GroupStep::default();
    kv_fill(&mut rx5, &mut step, PAGES - 6);
    assert!(matches!(
        check(&mut rx5, &mut rx5_store, &wire),
        Error::OutOfBlocks { .. }
    ));
    // The import through the prefix caches cannot carry a state.
    let mut ids = vec![0; exported_group_len(&kv, &store, SeqId(1), true).unwrap()];
    let tokens: Vec<u32> = (0..13).collect();
    export_group_sequence(&kv, &store, SeqId(1), Some(&tokens), &mut ids).unwrap();
    let (mut rx6, mut rx6_store) = cache();
    let before = snapshot(&rx6);
    let e = GroupExportView::parse(&ids).unwrap().import_into_cache(
        &mut rx6,
        &mut rx6_store,
        SeqId(9),
        &AdmitOptions::default(),
    );
    assert!(matches!(e, Err(Error::NotOnHybrid { .. })), "{e:?}");
    assert_eq!(snapshot(&rx6), before);
}

/// Admits one sequence holding `pages` pages in all.
fn kv_fill(kv: &mut KvCache, step: &mut GroupStep, pages: usize) {
    let kv_pages = pages - STATE_PAGES;
    kv.admit_grouped(SeqId(500), kv_pages * BS, step).unwrap();
    assert_eq!(kv.group_stats().used_pages, pages);
}

// ---- the checkpoint policy, against a shadow ----------------------------------------

/// An engine whose state is a fold of the tokens it computed, reading each step's
/// starting state from the bytes of its state pages.
struct Engine {
    kv: KvCache,
    store: HostStorage,
    step: GroupStep,
}

impl Engine {
    fn new(policy: CheckpointPolicy) -> Self {
        let (mut kv, store) = cache();
        kv.set_checkpoint_policy(policy).unwrap();
        Engine {
            kv,
            store,
            step: GroupStep::default(),
        }
    }

    fn run_copies(&mut self) {
        for c in &self.step.copies {
            self.store.copy_blocks(c).unwrap();
        }
    }

    /// Admits and computes `prompt`; returns the admission and the state the hit
    /// resumed from (before any token was computed).
    fn admit(&mut self, seq: SeqId, prompt: &[u32]) -> (Admission, u64) {
        let opts = AdmitOptions::default();
        let a = self
            .kv
            .admit_tokens_grouped(seq, prompt, &opts, &mut self.step)
            .unwrap();
        let pages = state_pages(&self.kv, seq);
        self.run_copies();
        let mut h = match a.cached_tokens {
            0 => H0,
            _ => read_state(&self.store, &pages),
        };
        let resumed = h;
        let mut at = a.cached_tokens;
        for ck in self.step.checkpoints.clone() {
            h = fold(h, &prompt[at..ck.position]);
            write_state(&mut self.store, &pages, h);
            for c in &ck.copies {
                self.store.copy_blocks(c).unwrap();
            }
            at = ck.position;
        }
        write_state(&mut self.store, &pages, fold(h, &prompt[at..]));
        self.kv.check_invariants().unwrap();
        (a, resumed)
    }

    /// Decodes `tokens` one by one, checkpointing at each block boundary.
    fn decode(&mut self, seq: SeqId, tokens: &[u32]) {
        let pages = state_pages(&self.kv, seq);
        for &t in tokens {
            self.kv
                .append_tokens_grouped(seq, &[t], &mut self.step)
                .unwrap();
            let h = fold(read_state(&self.store, &pages), &[t]);
            write_state(&mut self.store, &pages, h);
            if self.kv.checkpoint_grouped(seq, &mut self.step).unwrap() {
                self.run_copies();
            }
        }
        self.kv.check_invariants().unwrap();
    }
}

fn words(from: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| from + i).collect()
}

#[test]
fn the_turn_end_checkpoint_resumes_the_next_turn_with_the_recomputed_state() {
    let mut e = Engine::new(CheckpointPolicy::chat(8));
    // Turn 1: a prompt of 37 tokens (its last full block ends at 36), a reply of 10.
    let mut history = words(1, 37);
    let (a, _) = e.admit(SeqId(1), &history);
    assert_eq!(a.cached_tokens, 0);
    assert_eq!(e.step.checkpoints.len(), 1);
    assert_eq!(e.step.checkpoints[0].position, 36);
    let reply = words(1_000, 10);
    e.decode(SeqId(1), &reply);
    history.extend(&reply);
    // Rolled: 36 -> 40 -> 44 in the same pages; one checkpoint.
    assert_eq!(e.kv.num_state_checkpoints(), 1);
    e.kv.free(SeqId(1)).unwrap();

    // Turn 2: the history (47 tokens) and a new message.
    history.extend(words(2_000, 6));
    let (a, resumed) = e.admit(SeqId(2), &history);
    assert_eq!(
        a.cached_tokens, 44,
        "the turn end: the last block boundary decoded"
    );
    assert_eq!(resumed, fold(H0, &history[..44]));
    let pages = state_pages(&e.kv, SeqId(2));
    assert_eq!(read_state(&e.store, &pages), fold(H0, &history));
    e.kv.check_invariants().unwrap();
}

#[test]
fn a_shared_prefix_end_serves_the_next_conversation() {
    let mut e = Engine::new(CheckpointPolicy::chat(8));
    let system = words(1, 20);
    let conv = |tag: u32, n: usize| {
        let mut p = system.clone();
        p.extend(words(tag, n));
        p
    };
    // A computes system + its message: a checkpoint at its prompt end only.
    let (a, _) = e.admit(SeqId(1), &conv(100, 9));
    assert_eq!(a.cached_tokens, 0);
    e.kv.free(SeqId(1)).unwrap();
    // B shares the system prompt's 5 blocks with A: no checkpoint there yet, so no
    // hit; B checkpoints where the attention hit ends (20). Its prompt end (24) is
    // past blocks B recomputed as duplicates of A's, so not registered before B's
    // next call: skipped.
    let (b, _) = e.admit(SeqId(2), &conv(200, 7));
    assert_eq!(b.cached_tokens, 0);
    let at: Vec<usize> = e.step.checkpoints.iter().map(|c| c.position).collect();
    assert_eq!(at, [20]);
    e.kv.free(SeqId(2)).unwrap();
    // C resumes at the end of the system prompt, with its state.
    let c_prompt = conv(300, 11);
    let (c, resumed) = e.admit(SeqId(3), &c_prompt);
    assert_eq!(c.cached_tokens, 20);
    assert_eq!(resumed, fold(H0, &system));
    assert_eq!(
        read_state(&e.store, &state_pages(&e.kv, SeqId(3))),
        fold(H0, &c_prompt)
    );
}

#[test]
fn a_chain_keeps_at_most_max_per_chain_checkpoints() {
    let mut e = Engine::new(CheckpointPolicy::chat(2));
    let mut history = Vec::new();
    for turn in 0..4u32 {
        history.extend(words(100 * (turn + 1), 9));
        let seq = SeqId(u64::from(turn));
        let (a, resumed) = e.admit(seq, &history);
        if turn > 0 {
            // The previous turn's end is kept: it is the most recently used.
            assert!(a.cached_tokens > 0, "turn {turn}");
            assert_eq!(resumed, fold(H0, &history[..a.cached_tokens]));
        }
        e.decode(seq, &words(50 * (turn + 1), 5));
        history.extend(words(50 * (turn + 1), 5));
        e.kv.free(seq).unwrap();
        assert!(e.kv.num_state_checkpoints() <= 2, "turn {turn}");
    }
    assert_eq!(e.kv.num_state_checkpoints(), 2);
}

#[test]
fn policy_errors_change_nothing() {
    let (mut kv, _) = cache();
    let before = snapshot(&kv);
    let bad = |kv: &mut KvCache, p: CheckpointPolicy| {
        let e = kv.set_checkpoint_policy(p);
        assert!(matches!(e, Err(Error::InvalidConfig { .. })), "{e:?}");
    };
    bad(&mut kv, CheckpointPolicy::chat(0));
    bad(
        &mut kv,
        CheckpointPolicy {
            every_tokens: BS + 1,
            ..CheckpointPolicy::default()
        },
    );
    assert_eq!(snapshot(&kv), before);
    // A cache without a state group has no state to checkpoint.
    let mut plain = KvCache::hybrid(&[GroupSpec::full(layout())], PAGES).unwrap();
    bad(&mut plain, CheckpointPolicy::chat(4));
    assert_eq!(plain.checkpoint_policy(), CheckpointPolicy::default());
    kv.set_checkpoint_policy(CheckpointPolicy::chat(4)).unwrap();
    assert_eq!(kv.checkpoint_policy(), CheckpointPolicy::chat(4));
}

#[test]
fn a_checkpoint_whose_prefix_was_evicted_is_dropped() {
    let mut e = Engine::new(CheckpointPolicy::chat(8));
    let first = words(1, 37);
    e.admit(SeqId(1), &first);
    e.kv.free(SeqId(1)).unwrap();
    // 9 cached K/V pages and a checkpoint of 3 pages (both count as cached).
    assert_eq!(e.kv.num_state_checkpoints(), 1);
    assert_eq!(e.kv.group_stats().cached_pages, 12);
    // The next admission takes no checkpoint of its own (no shared prefix).
    let shared_only = CheckpointPolicy {
        shared_prefix_end: true,
        ..CheckpointPolicy::default()
    };
    e.kv.set_checkpoint_policy(shared_only).unwrap();
    // 50 K/V pages and 3 state pages: one cached page of the first prompt goes, the
    // last of its chain, which the checkpoint at 36 stands on.
    let (a, _) = e.admit(SeqId(2), &words(10_000, 200));
    assert_eq!(a.cached_tokens, 0);
    let opts = AdmitOptions::default();
    assert_eq!(e.kv.group(0).cached_prefix_len(&first, &opts).unwrap(), 32);
    // The checkpoint could serve no hit: it is gone, its pages back in the arena.
    assert_eq!(e.kv.num_state_checkpoints(), 0);
    assert_eq!(e.kv.group_stats().cached_pages, 8);
    e.kv.check_invariants().unwrap();
}

#[test]
fn a_freed_sequence_id_reused_keeps_the_turn_end_of_its_last_owner() {
    let mut e = Engine::new(CheckpointPolicy::chat(8));
    let mut a = words(1, 21);
    e.admit(SeqId(1), &a);
    e.decode(SeqId(1), &words(500, 6));
    a.extend(words(500, 6));
    e.kv.free(SeqId(1)).unwrap();
    // Another conversation under the same id, of a prompt shorter than a block (no
    // prompt end's checkpoint): the checkpoints its decode takes are its own.
    e.admit(SeqId(1), &words(9_000, 3));
    e.decode(SeqId(1), &words(9_500, 8));
    e.kv.free(SeqId(1)).unwrap();
    a.extend(words(700, 3));
    let (hit, resumed) = e.admit(SeqId(2), &a);
    assert_eq!(hit.cached_tokens, 24, "the first conversation's turn end");
    assert_eq!(resumed, fold(H0, &a[..24]));
}

#[test]
fn a_checkpoint_without_room_is_skipped_or_refused_and_changes_nothing() {
    let mut e = Engine::new(CheckpointPolicy::chat(8));
    // Sequence 7 holds 8 + 3 pages; sequence 1's prompt of 199 tokens takes the other
    // 53 (50 K/V, 3 state), and its checkpoint at 196 would need 3 more.
    let mut step = GroupStep::default();
    e.kv.admit_grouped(SeqId(7), 8 * BS, &mut step).unwrap();
    let prompt = words(1, 199);
    let a =
        e.kv.admit_tokens_grouped(SeqId(1), &prompt, &AdmitOptions::default(), &mut step)
            .unwrap();
    // 11 + 53 = 64: the admission fits only without its checkpoint.
    assert_eq!(a.cached_tokens, 0);
    assert!(step.checkpoints.is_empty(), "no room: skipped");
    assert_eq!(e.kv.num_state_checkpoints(), 0);
    e.kv.check_invariants().unwrap();
    // The decode reaches 200, a block boundary: no room, a typed refusal.
    e.kv.append_tokens_grouped(SeqId(1), &[5], &mut step)
        .unwrap();
    let before = snapshot(&e.kv);
    let r = e.kv.checkpoint_grouped(SeqId(1), &mut step);
    assert!(matches!(r, Err(Error::OutOfBlocks { .. })), "{r:?}");
    assert_eq!(snapshot(&e.kv), before);
    // With room again, it is taken.
    e.kv.free(SeqId(7)).unwrap();
    assert!(e.kv.checkpoint_grouped(SeqId(1), &mut step).unwrap());
    e.kv.check_invariants().unwrap();
}

mod model {
    use super::*;
    use proptest::prelude::*;

    /// Turns of 3 conversations over 2 system prompts, in a small arena (evictions of
    /// cached blocks and checkpoints): every admission resumes from the state of its
    /// hit's prefix, every state ends as the fold of its prompt and reply.
    #[derive(Debug, Clone)]
    struct Turn {
        conv: usize,
        message: usize,
        reply: usize,
    }

    fn turn() -> impl Strategy<Value = Turn> {
        (0..3usize, 1..14usize, 0..11usize).prop_map(|(conv, message, reply)| Turn {
            conv,
            message,
            reply,
        })
    }

    proptest! {
        #![proptest_config(crate::support::proptest_config(48))]
        #[test]
        fn every_hit_resumes_from_the_state_of_its_prefix(
            turns in proptest::collection::vec(turn(), 1..24),
            max_per_chain in 1..4usize,
        ) {
            let mut e = Engine::new(CheckpointPolicy::chat(max_per_chain));
            let systems = [words(1, 9), words(1, 6)];
            let mut history: Vec<Vec<u32>> =
                (0..3).map(|c| systems[c % 2].clone()).collect();
            for (i, t) in turns.iter().enumerate() {
                let seq = SeqId(i as u64);
                let tag = 1_000 * (i as u32 + 1);
                let h = &mut history[t.conv];
                h.extend(words(tag, t.message));
                if h.len() > 120 {
                    // The conversation is over; a new one starts on its system prompt.
                    *h = systems[t.conv % 2].clone();
                    h.extend(words(tag, t.message));
                }
                let (a, resumed) = e.admit(seq, h);
                prop_assert_eq!(resumed, if a.cached_tokens == 0 {
                    H0
                } else {
                    fold(H0, &h[..a.cached_tokens])
                });
                prop_assert_eq!(
                    read_state(&e.store, &state_pages(&e.kv, seq)),
                    fold(H0, h)
                );
                let reply = words(tag + 500, t.reply);
                e.decode(seq, &reply);
                h.extend(&reply);
                prop_assert_eq!(
                    read_state(&e.store, &state_pages(&e.kv, seq)),
                    fold(H0, h)
                );
                e.kv.free(seq).unwrap();
                e.kv.check_invariants().unwrap();
            }
        }
    }
}

/// Rewrites the group header's checksums after an edit of its fields.
fn repair_group_header(buf: &mut [u8], groups: usize) {
    let head = 40 + 24 * groups;
    let table = pagedkv::export::xxh64(&buf[40..head]);
    buf[32..40].copy_from_slice(&table.to_le_bytes());
    buf[16..24].fill(0);
    let fixed = pagedkv::export::xxh64(&buf[..40]);
    buf[16..24].copy_from_slice(&fixed.to_le_bytes());
}

#[test]
fn a_state_entry_that_contradicts_its_record_is_a_format_error() {
    let (kv, store) = sender();
    let wire = export(&kv, &store, SeqId(1));
    let field = |g: usize, i: usize| 40 + 24 * g + 8 * i;
    let edits: [(&str, usize, u64); 3] = [
        // The state group with a hole.
        ("state holes", field(1, 1), 1),
        // The state group claimed a KV group: 12 "tokens" for a sequence of 13.
        ("state as KV", field(1, 0), 0),
        // The KV group claimed a state group: 13 tokens are not whole pages of 4.
        ("KV as state", field(0, 0), u64::MAX),
    ];
    for (what, at, value) in edits {
        let mut bad = wire.clone();
        bad[at..at + 8].copy_from_slice(&value.to_le_bytes());
        repair_group_header(&mut bad, 2);
        let (mut rx, mut rx_store) = fragmented();
        let before = (snapshot(&rx), rx_store.region(0).to_vec());
        let e = import_group_sequence(&mut rx, &mut rx_store, SeqId(9), &bad);
        assert!(
            matches!(e, Err(Error::ExportFormat { .. })),
            "{what}: {e:?}"
        );
        assert_eq!(
            (snapshot(&rx), rx_store.region(0).to_vec()),
            before,
            "{what}"
        );
    }
    // The repair alone leaves a valid buffer.
    let mut same = wire.clone();
    repair_group_header(&mut same, 2);
    assert_eq!(same, wire);
}
