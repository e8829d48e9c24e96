//! The engine contract: computed vs allocated tokens, reservations with lookahead,
//! commits, chunked prefill, and prefix registration only of computed blocks.
//!
//! The model-based test drives the manager the way an engine does and keeps a shadow
//! of what K/V each device slot really holds (the engine writes the true token of every
//! position it computes, draft tokens where it speculates, nothing in lookahead slots;
//! copy and swap plans move the shadow bytes). After every step, every computed
//! position of every sequence must hold that sequence's true token: a prefix hit on a
//! block whose K/V was never written, or was written by a rejected draft, fails it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use pagedkv::layout::plans::SwapDirection;
use pagedkv::layout::Slot;
use pagedkv::manager::preempt::{CostModel, PreemptMode};
use pagedkv::{
    AdmitOptions, CopyPlan, DType, Error, KvCache, KvLayout, ModelShape, PreemptPolicy, PrefixHit,
    SeqId, SwapPlan, TierConfig,
};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

const BS: usize = 4;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    KvLayout::new(shape, BS).unwrap()
}

fn manager(num_blocks: usize, host_blocks: usize) -> KvCache {
    KvCache::builder(layout())
        .num_blocks(num_blocks)
        .watermark_blocks(0)
        .tiers(TierConfig {
            num_host_blocks: host_blocks,
            num_disk_slots: 0,
        })
        .build()
        .unwrap()
}

/// Token ids of a draft never equal a true token: true ids are below 1,000.
const DRAFT: u32 = 1 << 30;

#[derive(Debug, Clone)]
enum Action {
    /// Admit a prompt for chunked prefill: one of a few shared prefixes + a tail.
    Admit {
        prefix: u8,
        tail: u8,
    },
    /// Admit and compute the whole prompt in one call (`admit_tokens`).
    AdmitWhole {
        prefix: u8,
        tail: u8,
    },
    /// One step of sequence `pick`: reserve `n` (prefill chunk or 1 + drafts) plus
    /// `lookahead`, write, then commit `accept` of them (clamped).
    Step {
        pick: u16,
        n: u8,
        lookahead: u8,
        accept: u8,
    },
    /// Reserve and cancel (an aborted step: `commit(seq, 0)`).
    Cancel {
        pick: u16,
        n: u8,
    },
    Fork {
        pick: u16,
    },
    Free {
        pick: u16,
    },
    Truncate {
        pick: u16,
        back: u8,
    },
    SwapOutIn {
        pick: u16,
    },
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        2 => (0u8..4, 0u8..12).prop_map(|(prefix, tail)| Action::Admit { prefix, tail }),
        1 => (0u8..4, 0u8..12).prop_map(|(prefix, tail)| Action::AdmitWhole { prefix, tail }),
        8 => (any::<u16>(), 1u8..7, 0u8..4, 0u8..7)
            .prop_map(|(pick, n, lookahead, accept)| Action::Step { pick, n, lookahead, accept }),
        1 => (any::<u16>(), 1u8..5).prop_map(|(pick, n)| Action::Cancel { pick, n }),
        1 => any::<u16>().prop_map(|pick| Action::Fork { pick }),
        1 => any::<u16>().prop_map(|pick| Action::Free { pick }),
        1 => (any::<u16>(), 0u8..6).prop_map(|(pick, back)| Action::Truncate { pick, back }),
        1 => any::<u16>().prop_map(|pick| Action::SwapOutIn { pick }),
    ]
}

/// The engine's view of one sequence: its whole token stream (prompt, then generated
/// tokens as they are accepted); `truth[..computed]` is what its K/V must hold.
#[derive(Debug, Clone)]
struct Shadow {
    truth: Vec<u32>,
    prompt_len: usize,
}

struct Harness {
    kv: KvCache,
    /// What each device slot holds (absent: never written).
    device: HashMap<u64, u32>,
    /// What each host-tier slot holds.
    host: HashMap<u64, u32>,
    seqs: HashMap<SeqId, Shadow>,
    next_id: u64,
    next_token: u32,
    slots: Vec<Slot>,
    copies: CopyPlan,
    hit: PrefixHit,
    hits: usize,
    /// Blocks copied on write (copy plans run).
    cow_copies: usize,
    /// Swap-outs and swap-ins completed that moved blocks.
    swaps: usize,
}

fn prompt(prefix: u8, tail: u8, salt: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (0..10).map(|i| u32::from(prefix) * 100 + i).collect();
    p.extend((0..u32::from(tail)).map(|i| 500 + salt % 7 * 20 + i));
    p
}

impl Harness {
    fn new() -> Self {
        Harness {
            kv: manager(24, 32),
            device: HashMap::new(),
            host: HashMap::new(),
            seqs: HashMap::new(),
            next_id: 1,
            next_token: 0,
            slots: Vec::new(),
            copies: CopyPlan::new(),
            hit: PrefixHit::default(),
            hits: 0,
            cow_copies: 0,
            swaps: 0,
        }
    }

    fn pick(&self, pick: u16) -> Option<SeqId> {
        let mut ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        ids.sort();
        (!ids.is_empty()).then(|| ids[usize::from(pick) % ids.len()])
    }

    fn run_copies(&mut self) {
        for c in self.copies.copies() {
            self.cow_copies += 1;
            for off in 0..BS as u64 {
                let src = u64::from(c.src.0) * BS as u64 + off;
                let dst = u64::from(c.dst.0) * BS as u64 + off;
                match self.device.get(&src).copied() {
                    Some(v) => self.device.insert(dst, v),
                    None => self.device.remove(&dst),
                };
            }
        }
        self.copies.clear();
    }

    fn run_swap(&mut self, plan: &SwapPlan) {
        let (from, to) = match plan.direction() {
            SwapDirection::Out => (&self.device, &mut self.host),
            SwapDirection::In => (&self.host, &mut self.device),
        };
        for p in plan.pairs() {
            let (src, dst) = match plan.direction() {
                SwapDirection::Out => (p.device.0, p.host.0),
                SwapDirection::In => (p.host.0, p.device.0),
            };
            for off in 0..BS as u64 {
                let s = u64::from(src) * BS as u64 + off;
                let d = u64::from(dst) * BS as u64 + off;
                match from.get(&s).copied() {
                    Some(v) => to.insert(d, v),
                    None => to.remove(&d),
                };
            }
        }
    }

    fn admit(&mut self, tokens: Vec<u32>, whole: bool) {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let opts = AdmitOptions::default();
        let result = if whole {
            self.kv
                .admit_tokens(id, &tokens, &opts, &mut self.slots)
                .map(|a| a.cached_tokens)
        } else {
            self.kv
                .lookup_prefix(&tokens, &opts, &mut self.hit)
                .and_then(|_| self.kv.admit_prompt(id, &tokens, &self.hit))
                .map(|a| a.cached_tokens)
        };
        match result {
            Ok(cached) => {
                self.hits += cached;
                if whole {
                    // The engine writes every slot it was given.
                    for (i, s) in self.slots.iter().enumerate() {
                        self.device.insert(s.0, tokens[cached + i]);
                    }
                }
                let prompt_len = tokens.len();
                self.seqs.insert(
                    id,
                    Shadow {
                        truth: tokens,
                        prompt_len,
                    },
                );
            }
            Err(Error::OutOfBlocks { .. }) => {}
            Err(e) => panic!("admit: {e}"),
        }
    }

    fn step(&mut self, id: SeqId, n: usize, lookahead: usize, accept: usize) {
        let computed = self.kv.num_computed_tokens(id).unwrap();
        let sh = &self.seqs[&id];
        let in_prefill = computed < sh.prompt_len;
        // In prefill the chunk is all prompt (all accepted unless the step is cut);
        // in decode it is one true token plus drafts.
        let n = if in_prefill {
            n.min(sh.prompt_len - computed)
        } else {
            n
        };
        match self
            .kv
            .reserve(id, n, lookahead, &mut self.slots, &mut self.copies)
        {
            Ok(()) => {}
            Err(Error::OutOfBlocks { .. } | Error::TooLong { .. }) => return,
            Err(Error::SequenceState { .. }) => return, // swapped or mid-swap
            Err(e) => panic!("reserve: {e}"),
        }
        assert_eq!(self.slots.len(), n + lookahead);
        assert_eq!(self.kv.context_len(id).unwrap(), computed + n);
        self.run_copies();
        // Decode: extend the true stream by one token per accepted position.
        let accept = if in_prefill { n } else { accept.clamp(1, n) };
        let sh = self.seqs.get_mut(&id).unwrap();
        while sh.truth.len() < computed + accept {
            sh.truth.push(self.next_token % 1000);
            self.next_token += 1;
        }
        for (i, s) in self.slots[..n].iter().enumerate() {
            let pos = computed + i;
            let v = if i < accept {
                sh.truth[pos]
            } else {
                DRAFT | pos as u32
            };
            self.device.insert(s.0, v);
        }
        // Lookahead slots are not written (a drafter would write them next step).
        self.kv.commit(id, accept).unwrap();
        if !in_prefill {
            sh.truth.truncate(computed + accept);
            let ids = sh.truth[computed..].to_vec();
            match self.kv.add_token_ids(id, computed, &ids) {
                Ok(_) | Err(Error::SequenceState { .. }) => {}
                Err(e) => panic!("add_token_ids: {e}"),
            }
        }
    }

    fn apply(&mut self, a: &Action) {
        match *a {
            Action::Admit { prefix, tail } => {
                let t = prompt(prefix, tail, self.next_id as u32);
                self.admit(t, false);
            }
            Action::AdmitWhole { prefix, tail } => {
                let t = prompt(prefix, tail, self.next_id as u32);
                self.admit(t, true);
            }
            Action::Step {
                pick,
                n,
                lookahead,
                accept,
            } => {
                if let Some(id) = self.pick(pick) {
                    self.step(id, n.into(), lookahead.into(), accept.into());
                }
            }
            Action::Cancel { pick, n } => {
                if let Some(id) = self.pick(pick) {
                    if self
                        .kv
                        .reserve(id, n.into(), 0, &mut self.slots, &mut self.copies)
                        .is_ok()
                    {
                        self.run_copies();
                        // The step was dropped after the engine wrote some slots.
                        for s in &self.slots {
                            self.device.insert(s.0, DRAFT);
                        }
                        assert_eq!(self.kv.commit(id, 0).unwrap(), 0);
                    }
                }
            }
            Action::Fork { pick } => {
                if let Some(id) = self.pick(pick) {
                    let child = SeqId(self.next_id);
                    if self.kv.fork(id, child).is_ok() {
                        self.next_id += 1;
                        let sh = self.seqs[&id].clone();
                        self.seqs.insert(child, sh);
                    }
                }
            }
            Action::Free { pick } => {
                if let Some(id) = self.pick(pick) {
                    self.kv.free(id).unwrap();
                    self.seqs.remove(&id);
                }
            }
            Action::Truncate { pick, back } => {
                if let Some(id) = self.pick(pick) {
                    let Ok(len) = self.kv.num_tokens(id) else {
                        return;
                    };
                    let new_len = len.saturating_sub(back.into());
                    if self.kv.truncate(id, new_len).is_ok() {
                        let computed = self.kv.num_computed_tokens(id).unwrap();
                        let sh = self.seqs.get_mut(&id).unwrap();
                        if new_len < sh.prompt_len {
                            // The truncation cut the known ids; the engine gives the
                            // prompt's back.
                            let rest = sh.truth[new_len..sh.prompt_len].to_vec();
                            match self.kv.add_token_ids(id, new_len, &rest) {
                                Ok(_) | Err(Error::SequenceState { .. }) => {}
                                Err(e) => panic!("add_token_ids: {e}"),
                            }
                        } else {
                            sh.truth.truncate(computed.max(sh.prompt_len));
                        }
                    }
                }
            }
            Action::SwapOutIn { pick } => {
                if let Some(id) = self.pick(pick) {
                    let Ok(job) = self.kv.swap_out(id) else {
                        return;
                    };
                    self.run_swap(&job.plan);
                    self.kv.complete_swap(job.ticket).unwrap();
                    self.swaps += usize::from(!job.plan.is_empty());
                    // Scribble over the blocks the swap freed: they hold nothing now.
                    for p in job.plan.pairs() {
                        if self.kv.pool().state(p.device) != Ok(pagedkv::pool::BlockState::Free) {
                            continue;
                        }
                        for off in 0..BS as u64 {
                            self.device
                                .insert(u64::from(p.device.0) * BS as u64 + off, DRAFT);
                        }
                    }
                    if let Ok(job) = self.kv.swap_in(id) {
                        self.run_swap(&job.plan);
                        self.kv.complete_swap(job.ticket).unwrap();
                        self.swaps += usize::from(!job.plan.is_empty());
                    }
                }
            }
        }
    }

    /// Every computed position of every resident sequence holds its true token.
    fn check(&self) {
        self.kv.check_invariants().unwrap();
        let mut slots = Vec::new();
        for (&id, sh) in &self.seqs {
            if self.kv.is_swapped(id) {
                continue;
            }
            let computed = self.kv.num_computed_tokens(id).unwrap();
            assert!(computed <= self.kv.num_tokens(id).unwrap());
            self.kv.slots(id, 0..computed, &mut slots).unwrap();
            for (pos, s) in slots.iter().enumerate() {
                assert_eq!(
                    self.device.get(&s.0).copied(),
                    Some(sh.truth[pos]),
                    "{id}: position {pos} of {computed} computed tokens holds the wrong K/V"
                );
            }
        }
    }
}

/// Cases of one property run that saw each kind of event. Counted over the whole run
/// and checked once it is over, so the random actions cannot drift into covering
/// nothing (a run with the strategy broken, or a manager that stopped serving hits,
/// fails here rather than passing vacuously).
#[derive(Debug, Default)]
struct Coverage {
    cases: AtomicUsize,
    hits: AtomicUsize,
    cow: AtomicUsize,
    swaps: AtomicUsize,
}

impl Coverage {
    fn note(&self, h: &Harness) {
        let bump = |c: &AtomicUsize, seen: bool| {
            c.fetch_add(usize::from(seen), Ordering::Relaxed);
        };
        bump(&self.cases, true);
        bump(&self.hits, h.hits > 0);
        bump(&self.cow, h.cow_copies > 0);
        bump(&self.swaps, h.swaps > 0);
    }

    /// Each event in at least the given percentage of the cases: hits, copies on
    /// write, swaps.
    fn assert_at_least(&self, [hits, cow, swaps]: [usize; 3]) {
        let cases = self.cases.load(Ordering::Relaxed);
        eprintln!("coverage over {cases} cases: {self:?}");
        for (what, c, percent) in [
            ("a prefix hit", &self.hits, hits),
            ("a copy-on-write", &self.cow, cow),
            ("a swap", &self.swaps, swaps),
        ] {
            let n = c.load(Ordering::Relaxed);
            assert!(
                n * 100 >= cases * percent,
                "only {n} of {cases} cases saw {what} (want {percent} %)"
            );
        }
    }
}

/// The model-based test (a `TestRunner` rather than `proptest!`, so that the run's
/// coverage is checked at its end; the persisted seeds in
/// `engine_contract.proptest-regressions` still run first).
#[test]
fn computed_positions_always_hold_their_tokens() {
    let config = ProptestConfig {
        source_file: Some(file!()),
        ..crate::support::proptest_config(192)
    };
    let mut runner = TestRunner::new(config);
    let seen = Coverage::default();
    let result = runner.run(&prop::collection::vec(action(), 1..120), |actions| {
        let mut h = Harness::new();
        for a in &actions {
            h.apply(a);
            h.check();
        }
        seen.note(&h);
        let ids: Vec<SeqId> = h.seqs.keys().copied().collect();
        for id in ids {
            h.kv.free(id).unwrap();
        }
        h.kv.check_invariants().unwrap();
        prop_assert_eq!(h.kv.stats().used_blocks, 0);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}\n{runner}");
    }
    // A run of 192 cases sees hits in about 85 % of them, copies on write in 65 %,
    // swaps in 85 % (short cases see none); the floors are many deviations below.
    seen.assert_at_least([50, 35, 50]);
}

/// The harness really exercises hits: a fixed script where the second request hits
/// the first's computed blocks, and not its uncomputed ones.
#[test]
fn chunked_prefill_registers_only_computed_blocks() {
    let mut kv = manager(16, 0);
    let p: Vec<u32> = (0..14).collect();
    let opts = AdmitOptions::default();
    let (mut hit, mut slots, mut copies) = (PrefixHit::default(), Vec::new(), CopyPlan::new());
    kv.lookup_prefix(&p, &opts, &mut hit).unwrap();
    kv.admit_prompt(SeqId(1), &p, &hit).unwrap();
    kv.reserve(SeqId(1), 6, 0, &mut slots, &mut copies).unwrap();
    // Before the commit nothing is shareable: the K/V may not be written yet.
    assert_eq!(kv.cached_prefix_len(&p, &opts).unwrap(), 0);
    assert_eq!(kv.commit(SeqId(1), 6).unwrap(), 1); // block 0 (tokens 0..4) is full
    assert_eq!(kv.cached_prefix_len(&p, &opts).unwrap(), 4);
    // A second request admitted now shares only block 0, not the rest of the prompt.
    let a = kv.admit_tokens(SeqId(2), &p, &opts, &mut slots).unwrap();
    assert_eq!(a.cached_tokens, 4);
    kv.reserve(SeqId(1), 8, 0, &mut slots, &mut copies).unwrap();
    assert_eq!(kv.commit(SeqId(1), 8).unwrap(), 0); // SeqId(2) registered them first
    kv.check_invariants().unwrap();
}

#[test]
fn rejected_drafts_cost_no_copy_and_lookahead_is_not_context() {
    let mut kv = manager(16, 0);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 4, &mut slots).unwrap(); // one full block
    kv.reserve(SeqId(1), 4, 3, &mut slots, &mut copies).unwrap();
    assert_eq!(kv.num_tokens(SeqId(1)).unwrap(), 11);
    assert_eq!(kv.context_len(SeqId(1)).unwrap(), 8);
    let mut tables = pagedkv::tables::PaddedTables::default();
    kv.fill_padded(&[SeqId(1)], &mut tables).unwrap();
    assert_eq!((tables.context_lens[0], tables.max_blocks), (8, 2));
    kv.commit(SeqId(1), 1).unwrap(); // three drafts rejected
    assert_eq!(kv.context_len(SeqId(1)).unwrap(), 5);
    // A fork shares every block, lookahead blocks too. The child's next step writes
    // into the shared partial block (copied: it holds a computed token) and into the
    // shared lookahead block (taken fresh: nothing computed there).
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    kv.reserve(SeqId(2), 4, 0, &mut slots, &mut copies).unwrap();
    assert_eq!(copies.len(), 1);
    kv.check_invariants().unwrap();
}

#[test]
fn ids_that_arrive_late_resume_registration() {
    let mut kv = manager(16, 0);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    let opts = AdmitOptions::default();
    let p: Vec<u32> = (0..4).collect();
    kv.admit_tokens(SeqId(1), &p, &opts, &mut slots).unwrap();
    // Asynchronous scheduling: four decode steps whose ids are sampled later.
    for _ in 0..4 {
        kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap();
    }
    let stream: Vec<u32> = (0..8).collect();
    assert_eq!(
        kv.cached_prefix_len(&[&stream[..], &[99]].concat(), &opts)
            .unwrap(),
        4
    );
    assert_eq!(kv.add_token_ids(SeqId(1), 4, &stream[4..]).unwrap(), 1);
    assert_eq!(
        kv.cached_prefix_len(&[&stream[..], &[99]].concat(), &opts)
            .unwrap(),
        8
    );
    assert!(kv.is_registering(SeqId(1)).unwrap());
    // Ids after a gap of unknown ones are refused and change nothing.
    assert!(matches!(
        kv.add_token_ids(SeqId(1), 10, &[1]),
        Err(Error::TokenIdsGap {
            first: 10,
            known: 8,
            ..
        })
    ));
    kv.check_invariants().unwrap();
}

#[test]
fn typed_errors_change_nothing() {
    let mut kv = manager(8, 8);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 5, &mut slots).unwrap();
    let before = kv.stats();
    assert_eq!(
        kv.truncate(SeqId(1), 6),
        Err(Error::PastEnd {
            seq: SeqId(1),
            end: 6,
            len: 5
        })
    );
    assert!(matches!(
        kv.slots(SeqId(1), 0..9, &mut slots),
        Err(Error::PastEnd { end: 9, len: 5, .. })
    ));
    kv.reserve(SeqId(1), 2, 0, &mut slots, &mut copies).unwrap();
    assert_eq!(
        kv.commit(SeqId(1), 3),
        Err(Error::CommitPastReservation {
            seq: SeqId(1),
            committed: 3,
            reserved: 2
        })
    );
    // A second reservation before the commit is a state error.
    assert!(matches!(
        kv.reserve(SeqId(1), 1, 0, &mut slots, &mut copies),
        Err(Error::SequenceState { .. })
    ));
    // So are forks and swaps of a sequence in this step's batch.
    assert!(matches!(
        kv.fork(SeqId(1), SeqId(2)),
        Err(Error::SequenceState { .. })
    ));
    assert!(matches!(
        kv.swap_out(SeqId(1)),
        Err(Error::SequenceState { .. })
    ));
    kv.commit(SeqId(1), 0).unwrap();
    assert_eq!(kv.stats().used_blocks, before.used_blocks);
    kv.check_invariants().unwrap();
}

/// An id that is swapped out is taken: admitting it again was accepted and left the
/// sequence both swapped and on the device.
#[test]
fn admitting_a_swapped_out_id_is_a_duplicate() {
    let mut kv = manager(8, 8);
    let mut slots = Vec::new();
    let opts = AdmitOptions::default();
    kv.admit(SeqId(1), 5, &mut slots).unwrap();
    let job = kv.swap_out(SeqId(1)).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    assert_eq!(
        kv.admit_tokens(SeqId(1), &[1, 2, 3], &opts, &mut slots),
        Err(Error::DuplicateSequence(SeqId(1)))
    );
    let mut hit = PrefixHit::default();
    kv.lookup_prefix(&[1, 2, 3], &opts, &mut hit).unwrap();
    assert_eq!(
        kv.admit_prompt(SeqId(1), &[1, 2, 3], &hit),
        Err(Error::DuplicateSequence(SeqId(1)))
    );
    assert_eq!(
        kv.admit(SeqId(1), 3, &mut slots),
        Err(Error::DuplicateSequence(SeqId(1)))
    );
    kv.check_invariants().unwrap();
}

/// A stale hit (its blocks evicted and reused since the lookup) shares only what is
/// still there.
#[test]
fn a_stale_hit_is_checked_at_admission() {
    let mut kv = manager(4, 0);
    let (mut slots, mut hit) = (Vec::new(), PrefixHit::default());
    let opts = AdmitOptions::default();
    let p: Vec<u32> = (0..9).collect();
    kv.admit_tokens(SeqId(1), &p, &opts, &mut slots).unwrap();
    kv.free(SeqId(1)).unwrap();
    kv.lookup_prefix(&p, &opts, &mut hit).unwrap();
    assert_eq!(hit.cached_tokens(), 8);
    // Another request takes the whole arena, evicting the cached blocks.
    kv.admit(SeqId(2), 16, &mut slots).unwrap();
    kv.free(SeqId(2)).unwrap();
    let a = kv.admit_prompt(SeqId(3), &p, &hit).unwrap();
    assert_eq!(a.cached_tokens, 0);
    kv.check_invariants().unwrap();
}

/// `can_admit_chunk` says yes exactly when admitting the hit and reserving its first
/// chunk succeeds, counting the cached blocks the hit shares and those it revives.
#[test]
fn a_chunked_prompt_is_admitted_when_its_first_chunk_fits() {
    let opts = AdmitOptions::default();
    let shared: Vec<u32> = (0..3 * BS as u32).collect();
    let mut prompt = shared.clone();
    prompt.extend(500..500 + 20 * BS as u32);
    let mut outcomes = [0; 2];
    for live in [false, true] {
        for chunk in 1..=12 * BS {
            let mut kv = manager(24, 0);
            let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
            // A sequence whose three cached blocks the prompt shares, alive or freed
            // (then they are revived from the cache), and one holding 12 blocks.
            kv.admit_tokens(SeqId(1), &shared, &opts, &mut slots)
                .unwrap();
            kv.admit(SeqId(2), 12 * BS, &mut slots).unwrap();
            if !live {
                kv.free(SeqId(1)).unwrap();
            }
            let mut hit = PrefixHit::default();
            kv.lookup_prefix(&prompt, &opts, &mut hit).unwrap();
            assert_eq!(hit.cached_tokens(), 3 * BS);
            assert!(!kv.can_admit_hit(&hit));
            let says = kv.can_admit_chunk(&hit, chunk);
            let a = kv.admit_prompt(SeqId(3), &prompt, &hit).unwrap();
            let does = kv
                .reserve(SeqId(3), chunk, 0, &mut slots, &mut copies)
                .is_ok();
            assert_eq!(says, does, "live {live}, chunk {chunk}, {a:?}");
            outcomes[usize::from(does)] += 1;
            kv.check_invariants().unwrap();
        }
    }
    // 9 blocks are left for the new tokens: chunks up to 36 tokens fit.
    assert_eq!(outcomes, [2 * 12, 2 * 36]);
}

/// With `unschedule_below`, a lower-priority group already reserved this step is
/// taken for a higher-priority one: its reservation is cancelled and reported.
/// Without the option the only candidate left is the asking sequence itself.
#[test]
fn priority_preemption_unschedules_a_reserved_lower_priority_sequence() {
    let setup = || {
        let mut kv = manager(8, 16);
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        kv.admit(SeqId(1), 12, &mut slots).unwrap(); // 3 full blocks
        kv.admit(SeqId(2), 11, &mut slots).unwrap(); // 3 blocks, room for 1 token
        kv.admit(SeqId(3), 7, &mut slots).unwrap(); // 2 blocks: the arena is full
        kv.set_preempt_priority(SeqId(1), 5).unwrap();
        kv.set_preempt_priority(SeqId(2), 5).unwrap();
        kv.set_preempt_priority(SeqId(3), 1).unwrap();
        // Sequences 2 and 3 are in this step's batch (their tokens fit their
        // blocks); sequence 3 has the lowest priority.
        kv.reserve(SeqId(3), 1, 0, &mut slots, &mut copies).unwrap();
        kv.reserve(SeqId(2), 1, 0, &mut slots, &mut copies).unwrap();
        kv
    };
    let plain = PreemptPolicy {
        mode: PreemptMode::AlwaysRecompute,
        cost: CostModel::new(1e9, 1e4).unwrap(),
        unschedule_below: None,
    };
    let mut kv = setup();
    let need = kv.blocks_needed(SeqId(1), 1, 0).unwrap();
    assert_eq!(need, 1);
    let out = kv.preempt_for(need, &plain).unwrap();
    assert_eq!(out[0].seqs, vec![SeqId(1)]);
    assert!(out[0].unscheduled.is_empty());
    kv.commit(SeqId(3), 1).unwrap();
    kv.check_invariants().unwrap();

    // Only groups below priority 5 may be unscheduled: sequence 2 stays reserved.
    let mut kv = setup();
    let out = kv.preempt_for(need, &plain.unscheduling_below(5)).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].seqs, vec![SeqId(3)]);
    assert_eq!(out[0].unscheduled, vec![SeqId(3)]);
    assert!(!kv.contains(SeqId(3)));
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap();
    kv.commit(SeqId(2), 1).unwrap();
    kv.check_invariants().unwrap();

    // The same by swap: the unscheduled sequence goes to the host tier whole.
    let mut kv = setup();
    let swap = PreemptPolicy {
        mode: PreemptMode::AlwaysSwap,
        ..plain.unscheduling_below(5)
    };
    let out = kv.preempt_for(need, &swap).unwrap();
    assert_eq!(out[0].unscheduled, vec![SeqId(3)]);
    let pagedkv::manager::preempt::PreemptAction::Swap(job) = &out[0].action else {
        panic!("{:?}", out[0].action)
    };
    kv.complete_swap(job.ticket).unwrap();
    assert!(kv.is_swapped(SeqId(3)));
    kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap();
    kv.check_invariants().unwrap();
}

/// `preempt_for` takes the whole need and never picks this step's batch.
#[test]
fn preemption_respects_the_step_and_takes_the_whole_need() {
    let mut kv = manager(8, 16);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 12, &mut slots).unwrap(); // 3 full blocks
    kv.admit(SeqId(2), 12, &mut slots).unwrap(); // 3 full blocks
    kv.admit(SeqId(3), 7, &mut slots).unwrap(); // 2 blocks: the arena is full
                                                // Sequence 3 (the newest, so the first victim otherwise) is in this step's batch.
    kv.reserve(SeqId(3), 1, 0, &mut slots, &mut copies).unwrap();
    let need = kv.blocks_needed(SeqId(1), 1, 0).unwrap();
    assert_eq!(need, 1);
    assert_eq!(kv.num_available_blocks(), 0);
    let policy = PreemptPolicy {
        mode: PreemptMode::AlwaysRecompute,
        cost: CostModel::new(1e9, 1e4).unwrap(),
        unschedule_below: None,
    };
    let out = kv.preempt_for(need, &policy).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].seqs, vec![SeqId(2)]);
    assert!(kv.num_available_blocks() >= need);
    kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap();
    kv.commit(SeqId(3), 1).unwrap();
    kv.check_invariants().unwrap();
}
