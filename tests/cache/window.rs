//! Sliding-window freeing: blocks entirely before the window of a sequence's next
//! query go back to the pool, leaving `BlockId::RELEASED` holes that no reader touches.
//!
//! * counts: a decoding sequence holds at most `ceil(W / bs) + 1` blocks, and the
//!   probe of a reported bug (window 64, context 320, block 16) holds 5 instead of 20;
//! * a model-based property test with byte checks on `HostStorage`: every token the
//!   engine writes carries its own id in its K and V bytes; after every action, every
//!   computed position inside the window of each sequence's next query holds its own
//!   token, and the batch views pass the manager's validation (no hole, no free block
//!   inside any window);
//! * CPU attention over a table with holes whose released blocks are poisoned with NaN
//!   equals a contiguous cache of the whole sequence under the same window.

use pagedkv::attention::cpu::{contiguous_decode, paged_decode, ContiguousKv};
use pagedkv::attention::AttentionParams;
use pagedkv::layout::Slot;
use pagedkv::tables::validate_tables_window;
use pagedkv::tables::PaddedTables;
use pagedkv::{
    BlockId, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape, SeqId, Storage,
};
use proptest::prelude::*;

fn layout(bs: usize, dtype: DType, head_dim: usize) -> KvLayout {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 2,
        num_kv_heads: 1,
        head_dim,
        kv_dtype: dtype,
    };
    KvLayout::new(shape, bs).unwrap()
}

fn window_manager(bs: usize, num_blocks: usize, window: Option<usize>) -> KvCache {
    let b = KvCache::builder(layout(bs, DType::F32, 4))
        .num_blocks(num_blocks)
        .watermark_blocks(0);
    match window {
        Some(w) => b.sliding_window(w),
        None => b,
    }
    .build()
    .unwrap()
}

/// The reported probe: prefill 64 tokens, then decode to 320 tokens.
fn probe_blocks(window: Option<usize>) -> (usize, usize) {
    let mut kv = window_manager(16, 64, window);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 64, &mut slots).unwrap();
    let mut most = kv.stats().used_blocks;
    while kv.num_tokens(SeqId(1)).unwrap() < 320 {
        kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap();
        most = most.max(kv.stats().used_blocks);
        kv.check_invariants().unwrap();
    }
    (kv.stats().used_blocks, most)
}

#[test]
fn probe_window_64_context_320_holds_4_blocks_at_most_5() {
    let (full, _) = probe_blocks(None);
    let (window, most) = probe_blocks(Some(64));
    eprintln!("window 64, context 320, block 16: {full} blocks without freeing, {window} with");
    assert_eq!(full, 20);
    // The last query (position 319) reads 256..=319: four blocks.
    assert_eq!(window, 4);
    // ceil(64 / 16) + 1 at every decode step.
    assert!(most <= 5, "held {most}");
}

#[test]
fn decode_holds_at_most_ceil_w_over_bs_plus_one() {
    for (bs, w) in [(16, 64), (16, 100), (4, 1), (4, 5), (8, 17), (16, 1024)] {
        let mut kv = window_manager(bs, 512, Some(w));
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        kv.admit(SeqId(7), 3, &mut slots).unwrap();
        for _ in 0..(3 * w + 5 * bs) {
            kv.append(SeqId(7), 1, &mut slots, &mut copies).unwrap();
            let held = kv
                .block_table(SeqId(7))
                .unwrap()
                .iter()
                .filter(|&&b| b != BlockId::RELEASED)
                .count();
            assert!(
                held <= w.div_ceil(bs) + 1,
                "bs {bs} window {w}: {held} blocks"
            );
        }
        kv.check_invariants().unwrap();
        kv.free(SeqId(7)).unwrap();
        assert_eq!(kv.stats().used_blocks, 0);
    }
}

#[test]
fn chunked_prefill_releases_at_commit_and_refuses_what_needs_released_blocks() {
    let mut kv = window_manager(4, 64, Some(6));
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 0, &mut slots).unwrap();
    kv.reserve(SeqId(1), 20, 0, &mut slots, &mut copies)
        .unwrap();
    assert_eq!(kv.stats().used_blocks, 5);
    kv.commit(SeqId(1), 20).unwrap();
    // The next query (position 20) reads 15..=20: blocks 3 and 4 stay.
    assert_eq!(
        kv.block_table(SeqId(1)).unwrap(),
        &[BlockId::RELEASED; 3][..]
            .iter()
            .chain(&kv.block_table(SeqId(1)).unwrap()[3..])
            .copied()
            .collect::<Vec<_>>()[..]
    );
    assert_eq!(kv.stats().used_blocks, 2);
    kv.check_invariants().unwrap();
    // Truncating into the released part is refused, inside the window accepted.
    assert!(matches!(
        kv.truncate(SeqId(1), 12),
        Err(Error::SequenceState { .. })
    ));
    kv.truncate(SeqId(1), 18).unwrap();
    kv.check_invariants().unwrap();
    // Slots of released positions are refused.
    assert!(kv.slots(SeqId(1), 0..4, &mut slots).is_err());
    // No prefix hits from a window manager.
    let prompt: Vec<u32> = (0..16).collect();
    let opts = pagedkv::AdmitOptions::default();
    kv.admit_tokens(SeqId(2), &prompt, &opts, &mut slots)
        .unwrap();
    kv.free(SeqId(2)).unwrap();
    let a = kv
        .admit_tokens(SeqId(3), &prompt, &opts, &mut slots)
        .unwrap();
    assert_eq!(a.cached_tokens, 0);
    kv.check_invariants().unwrap();
}

#[test]
fn holed_sequence_swaps_only_its_held_blocks_and_preemption_may_swap_it() {
    let mut kv = KvCache::builder(layout(4, DType::F32, 4))
        .num_blocks(8)
        .watermark_blocks(0)
        .tiers(pagedkv::TierConfig {
            num_host_blocks: 16,
            num_disk_slots: 0,
        })
        .sliding_window(4)
        .build()
        .unwrap();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 4, &mut slots).unwrap();
    for _ in 0..10 {
        kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap();
    }
    let table = kv.block_table(SeqId(1)).unwrap().to_vec();
    let held = table.iter().filter(|&&b| b != BlockId::RELEASED).count();
    assert!(table[0] == BlockId::RELEASED && held < table.len());
    // Only the held blocks move; the holes come back as holes.
    let job = kv.swap_out(SeqId(1)).unwrap();
    assert_eq!(job.plan.len(), held);
    kv.complete_swap(job.ticket).unwrap();
    assert_eq!(kv.swapped_table(SeqId(1)).unwrap().len(), held);
    kv.check_invariants().unwrap();
    let job = kv.swap_in(SeqId(1)).unwrap();
    assert_eq!(job.plan.len(), held);
    kv.complete_swap(job.ticket).unwrap();
    let back = kv.block_table(SeqId(1)).unwrap();
    assert_eq!(back.len(), table.len());
    assert!(back[..table.len() - held]
        .iter()
        .all(|&b| b == BlockId::RELEASED));
    kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap();
    kv.check_invariants().unwrap();
    let policy = pagedkv::PreemptPolicy {
        mode: pagedkv::manager::preempt::PreemptMode::AlwaysSwap,
        cost: pagedkv::manager::preempt::CostModel::new(1e9, 1e3).unwrap(),
        unschedule_below: None,
    };
    let p = kv
        .preempt_for(kv.num_available_blocks() + 1, &policy)
        .unwrap();
    assert_eq!(p.len(), 1);
    assert_eq!(
        p[0].reason,
        pagedkv::manager::preempt::PreemptReason::Forced
    );
    assert!(matches!(
        p[0].action,
        pagedkv::manager::preempt::PreemptAction::Swap(_)
    ));
    kv.check_invariants().unwrap();
}

#[test]
fn cpu_attention_never_reads_released_blocks() {
    let (bs, d, w) = (4, 8, 7);
    let layout = layout(bs, DType::F32, d);
    let mut kv = KvCache::builder(layout)
        .num_blocks(32)
        .watermark_blocks(0)
        .sliding_window(w)
        .build()
        .unwrap();
    let mut st = HostStorage::new(layout, 32).unwrap();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    let total = 29;
    // The whole sequence's K/V, kept contiguous by the test.
    let kf = |p: usize, i: usize| ((p * 7 + i * 3) % 11) as f32 * 0.25 - 1.0;
    let vf = |p: usize, i: usize| ((p * 5 + i) % 13) as f32 * 0.5 - 2.0;
    let bytes = |f: &dyn Fn(usize, usize) -> f32, p: usize| -> Vec<u8> {
        (0..d).flat_map(|i| f(p, i).to_le_bytes()).collect()
    };
    kv.admit(SeqId(1), 1, &mut slots).unwrap();
    st.write_slots(0, &slots, &bytes(&kf, 0), &bytes(&vf, 0))
        .unwrap();
    for p in 1..total {
        kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap();
        st.write_slots(0, &slots, &bytes(&kf, p), &bytes(&vf, p))
            .unwrap();
    }
    let table = kv.block_table(SeqId(1)).unwrap().to_vec();
    assert!(table[..5].iter().all(|&b| b == BlockId::RELEASED));
    // Poison every block that is not in the table: released blocks are free now.
    let held: Vec<BlockId> = table
        .iter()
        .copied()
        .filter(|&b| b != BlockId::RELEASED)
        .collect();
    let nan = f32::NAN.to_le_bytes();
    let block_len = layout.block_bytes_per_layer();
    for b in 0..32u32 {
        if !held.contains(&BlockId(b)) {
            let off = layout.block_byte_offset(BlockId(b));
            for c in st.region_mut(0)[off..off + block_len].chunks_exact_mut(4) {
                c.copy_from_slice(&nan);
            }
        }
    }
    let mut tables = PaddedTables::default();
    kv.fill_padded(&[SeqId(1)], &mut tables).unwrap();
    kv.check_padded(&tables).unwrap();
    let q: Vec<f32> = (0..2 * d).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut params = AttentionParams::new(d);
    params.sliding_window = Some(w);
    let mut paged = vec![0f32; 2 * d];
    paged_decode(&st, 0, &q, &tables, &params, &mut paged, None).unwrap();
    // Without the window the holes are inside what the kernel would read: refused.
    let mut full = AttentionParams::new(d);
    full.sliding_window = None;
    assert!(paged_decode(&st, 0, &q, &tables, &full, &mut paged.clone(), None).is_err());

    let kc: Vec<u8> = (0..total).flat_map(|p| bytes(&kf, p)).collect();
    let vc: Vec<u8> = (0..total).flat_map(|p| bytes(&vf, p)).collect();
    let ckv = ContiguousKv {
        k: &kc,
        v: &vc,
        dtype: DType::F32,
        batch: 1,
        max_tokens: total,
        num_kv_heads: 1,
        head_dim: d,
    };
    let mut want = vec![0f32; 2 * d];
    contiguous_decode(&ckv, 2, &q, &[total as u32], &params, None, &mut want, None).unwrap();
    for (a, b) in paged.iter().zip(&want) {
        assert!(
            a.is_finite() && (a - b).abs() < 1e-5,
            "{paged:?} vs {want:?}"
        );
    }
    // Both kernels above take the window from `AttentionParams::window_start`; check
    // them against the rule written here from the definition (the last `w` positions,
    // the query's own included: keys `t <= p` with `p - t < w`).
    let p = total - 1;
    let seen: Vec<usize> = (0..=p).filter(|&t| p - t < w).collect();
    assert_eq!(seen.len(), w);
    for h in 0..2 {
        let qh = &q[h * d..(h + 1) * d];
        let logits: Vec<f64> = seen
            .iter()
            .map(|&t| {
                let dot: f64 = (0..d).map(|i| f64::from(qh[i]) * f64::from(kf(t, i))).sum();
                dot * f64::from(params.scale)
            })
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        for i in 0..d {
            let o: f64 = seen
                .iter()
                .zip(&logits)
                .map(|(&t, l)| (l - m).exp() / sum * f64::from(vf(t, i)))
                .sum();
            let got = f64::from(paged[h * d + i]);
            assert!((got - o).abs() < 1e-5, "head {h} dim {i}: {got} vs {o}");
        }
    }
}

// ---- model-based property test ----------------------------------------------------

const BS: usize = 4;
const HD: usize = 4;
const DRAFT: u32 = 1 << 30;

#[derive(Debug, Clone)]
enum Action {
    Admit {
        len: u8,
    },
    /// reserve `n` (+ `lookahead`), write, commit `accept` (clamped).
    Step {
        pick: u16,
        n: u8,
        lookahead: u8,
        accept: u8,
    },
    /// One-call append of `n` tokens.
    Append {
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
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        2 => (0u8..24).prop_map(|len| Action::Admit { len }),
        5 => (any::<u16>(), 1u8..9, 0u8..3, 0u8..9).prop_map(|(pick, n, lookahead, accept)| {
            Action::Step { pick, n, lookahead, accept }
        }),
        6 => (any::<u16>(), 1u8..4).prop_map(|(pick, n)| Action::Append { pick, n }),
        1 => any::<u16>().prop_map(|pick| Action::Fork { pick }),
        1 => any::<u16>().prop_map(|pick| Action::Free { pick }),
        1 => (any::<u16>(), 0u8..8).prop_map(|(pick, back)| Action::Truncate { pick, back }),
    ]
}

struct Engine {
    kv: KvCache,
    st: HostStorage,
    window: usize,
    /// Each live sequence and its true token ids (`tokens[p]` for every computed `p`).
    seqs: Vec<(SeqId, Vec<u32>)>,
    next_seq: u64,
    next_token: u32,
}

impl Engine {
    fn write(&mut self, slots: &[Slot], ids: &[u32]) {
        for (s, &id) in slots.iter().zip(ids) {
            let mut k = vec![0u8; HD * 4];
            k[..4].copy_from_slice(&id.to_le_bytes());
            self.st.write_slots(0, &[*s], &k, &k).unwrap();
        }
    }

    fn fresh(&mut self, n: usize) -> Vec<u32> {
        let out = (0..n as u32).map(|i| self.next_token + i).collect();
        self.next_token += n as u32;
        out
    }

    /// The token id stored in K and V at position `p` of `table`.
    fn read(&self, table: &[BlockId], p: usize) -> (u32, u32) {
        let layout = self.st.layout();
        let b = table[p / BS];
        assert_ne!(b, BlockId::RELEASED, "position {p} is in a released block");
        let bytes = self.st.block_bytes(0, b).unwrap();
        let tok = (p % BS) * HD * 4;
        let v = layout.block_bytes_per_layer() / 2 + tok;
        let get = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        (get(tok), get(v))
    }

    /// The batch view of `id` for a step whose queries are its last `queries`
    /// context tokens: no hole and no free block inside any query's window.
    fn check_view(&self, id: SeqId, queries: usize) {
        let mut t = PaddedTables::default();
        self.kv.fill_padded(&[id], &mut t).unwrap();
        validate_tables_window(
            self.st.layout(),
            self.kv.num_blocks(),
            &t,
            Some(self.window),
            Some(&[0, queries]),
        )
        .unwrap();
        self.kv.check_padded(&t).unwrap();
    }

    /// Every computed position inside the window of the next query holds its token.
    fn check(&self) {
        self.kv.check_invariants().unwrap();
        for (id, tokens) in &self.seqs {
            let computed = self.kv.num_computed_tokens(*id).unwrap();
            assert_eq!(computed, tokens.len());
            let table = self.kv.block_table(*id).unwrap();
            let start = (computed + 1).saturating_sub(self.window);
            for (p, &tok) in tokens.iter().enumerate().skip(start) {
                assert_eq!(self.read(table, p), (tok, tok), "{id} position {p}");
            }
            // Exactly the blocks before that window may be released.
            let held = table.iter().filter(|&&b| b != BlockId::RELEASED).count();
            let released = table.len() - held;
            assert!(
                released <= start / BS,
                "{id}: {released} released, window from {start}"
            );
            assert!(table[..released].iter().all(|&b| b == BlockId::RELEASED));
        }
    }

    fn apply(&mut self, a: &Action) {
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        let pick = |p: u16, n: usize| (n > 0).then(|| p as usize % n);
        match *a {
            Action::Admit { len } => {
                let id = SeqId(self.next_seq);
                self.next_seq += 1;
                if self.kv.admit(id, len as usize, &mut slots).is_ok() {
                    let toks = self.fresh(len as usize);
                    self.write(&slots, &toks);
                    self.seqs.push((id, toks));
                }
            }
            Action::Step {
                pick: p,
                n,
                lookahead,
                accept,
            } => {
                let Some(i) = pick(p, self.seqs.len()) else {
                    return;
                };
                let id = self.seqs[i].0;
                let (n, la) = (n as usize, lookahead as usize);
                if self.kv.reserve(id, n, la, &mut slots, &mut copies).is_err() {
                    return;
                }
                self.st.copy_blocks(&copies).unwrap();
                self.check_view(id, n);
                let accept = (accept as usize).min(n);
                let mut ids = self.fresh(accept);
                ids.extend((0..n - accept).map(|j| DRAFT + j as u32));
                self.write(&slots[..n], &ids);
                self.kv.commit(id, accept).unwrap();
                self.seqs[i].1.extend_from_slice(&ids[..accept]);
            }
            Action::Append { pick: p, n } => {
                let Some(i) = pick(p, self.seqs.len()) else {
                    return;
                };
                let id = self.seqs[i].0;
                if self
                    .kv
                    .append(id, n as usize, &mut slots, &mut copies)
                    .is_err()
                {
                    return;
                }
                self.st.copy_blocks(&copies).unwrap();
                self.check_view(id, n as usize);
                let ids = self.fresh(n as usize);
                self.write(&slots, &ids);
                self.seqs[i].1.extend_from_slice(&ids);
            }
            Action::Fork { pick: p } => {
                let Some(i) = pick(p, self.seqs.len()) else {
                    return;
                };
                let child = SeqId(self.next_seq);
                self.next_seq += 1;
                if self.kv.fork(self.seqs[i].0, child).is_ok() {
                    let toks = self.seqs[i].1.clone();
                    self.seqs.push((child, toks));
                }
            }
            Action::Free { pick: p } => {
                let Some(i) = pick(p, self.seqs.len()) else {
                    return;
                };
                self.kv.free(self.seqs.swap_remove(i).0).unwrap();
            }
            Action::Truncate { pick: p, back } => {
                let Some(i) = pick(p, self.seqs.len()) else {
                    return;
                };
                let id = self.seqs[i].0;
                let len = self.kv.num_tokens(id).unwrap();
                let new_len = len.saturating_sub(back as usize);
                let before = self.kv.block_table(id).unwrap().to_vec();
                match self.kv.truncate(id, new_len) {
                    Ok(()) => self.seqs[i].1.truncate(new_len),
                    Err(Error::SequenceState { .. }) => {
                        assert_eq!(self.kv.block_table(id).unwrap(), &before[..]);
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(96))]
    #[test]
    fn window_positions_always_hold_their_tokens(
        window in 1usize..14,
        num_blocks in 6usize..40,
        actions in proptest::collection::vec(action(), 1..120),
    ) {
        let layout = layout(BS, DType::F32, HD);
        let kv = KvCache::builder(layout)
            .num_blocks(num_blocks)
            .watermark_blocks(0)
            .sliding_window(window)
            .build()
            .unwrap();
        let mut e = Engine {
            kv,
            st: HostStorage::new(layout, num_blocks).unwrap(),
            window,
            seqs: Vec::new(),
            next_seq: 0,
            next_token: 1,
        };
        for a in &actions {
            e.apply(a);
            e.check();
        }
        let ids: Vec<SeqId> = e.seqs.iter().map(|s| s.0).collect();
        for id in ids {
            e.kv.free(id).unwrap();
        }
        prop_assert_eq!(e.kv.stats().used_blocks, 0);
    }
}

/// A window manager holds only the window, so its longest sequence is not capped by
/// the arena: 8 blocks of 16 serve a 1,000-token decode with window 32. A full
/// manager of the same arena refuses past 128 tokens.
#[test]
fn window_manager_decodes_past_its_arena() {
    let mut kv = window_manager(16, 8, Some(32));
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
    kv.admit(SeqId(1), 16, &mut slots).unwrap();
    for _ in 16..1000 {
        kv.append(SeqId(1), 1, &mut slots, &mut copies).unwrap();
    }
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_tokens(SeqId(1)).unwrap(), 1000);
    let mut full = window_manager(16, 8, None);
    full.admit(SeqId(1), 128, &mut slots).unwrap();
    assert!(matches!(
        full.append(SeqId(1), 1, &mut slots, &mut copies),
        Err(Error::TooLong {
            tokens: 129,
            limit: 128
        })
    ));
}

/// The step path gives a window's blocks back at the commit that moves the window past
/// them (not later): after each `commit_step` of a decode, the sequence holds exactly
/// the blocks from the next query's window on, and every earlier entry is a hole.
#[test]
fn the_step_path_releases_at_the_commit_that_passes_a_block() {
    let (bs, w) = (4, 6);
    let mut kv = window_manager(bs, 32, Some(w));
    kv.admit(SeqId(1), 5, &mut Vec::new()).unwrap();
    let h = kv.handle(SeqId(1)).unwrap();
    let mut step = pagedkv::StepBuffers::new(1, 4, 32);
    for _ in 0..40 {
        let entry = pagedkv::StepEntry {
            seq: h,
            new_tokens: 1,
            lookahead: 0,
        };
        kv.reserve_step(&[entry], &mut step).unwrap();
        kv.commit_step(&[(h, 1)]).unwrap();
        let computed = kv.num_computed_tokens(SeqId(1)).unwrap();
        let first = (computed + 1).saturating_sub(w) / bs;
        let table = kv.block_table(SeqId(1)).unwrap();
        assert!(
            table[..first].iter().all(|&b| b == BlockId::RELEASED),
            "{computed}: {table:?}"
        );
        assert!(
            table[first..].iter().all(|&b| b != BlockId::RELEASED),
            "{computed}: {table:?}"
        );
        assert_eq!(kv.stats().used_blocks, table.len() - first);
        kv.check_invariants().unwrap();
    }
}
