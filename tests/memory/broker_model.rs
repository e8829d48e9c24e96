//! The memory broker driven from several threads at once, model-based: one scheduler
//! thread per model (admit with shared prefixes, append, a step reserved under the lock
//! and committed after releasing it, free, `ensure_available`, sleep and wake of its own
//! model, swap-in of what a sleep swapped out), and one outside thread (external
//! reservations with deadlines, sleep and wake of any model with and without swap-out
//! and prefix spill, the broker clock, `check_invariants`). Limits, priorities, budget
//! and the cold-cache rule are drawn per seed (the broker fixes them at registration).
//!
//! Checked: the ledger always sums to the budget and no model leaves `[floor, ceiling]`
//! (`Broker::check_invariants` from the outside thread while the others run, and after);
//! every scheduler's admitted sequence is still there at the end (resident, or swapped
//! out by a sleep, the one documented way a sequence leaves the device) and reads back
//! its K/V byte for byte; while a model is mid-step with its lock released, nothing about
//! it changes but a grow at its end (tables, block states, cached blocks as they were),
//! so the step's slots stay valid and the step's bytes read back after its commit; a refused admission or sleep changes nothing; an external
//! reservation gets exactly its rounded bytes or times out having found less.

use crate::support::kv_bytes;
use crate::support::snapshot;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kv_bytes::{check_values, write_values};
use pagedkv::attention::model::SplitMix64;
use pagedkv::broker::{
    Broker, BrokerConfig, ModelGuard, ModelId, ModelLimits, MoveReason, Party, SleepOptions,
};
use pagedkv::pool::BlockState;
use pagedkv::{
    AdmitOptions, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape, SeqId,
    Storage, TierConfig,
};
use snapshot::snapshot;

const CHUNK: usize = 1024;
const MODELS: usize = 3;
/// Steps of each scheduler thread; the outside thread runs until they finish.
const STEPS: usize = 300;
const SEEDS: [u64; 8] = [1, 2, 3, 4, 5, 6, 0x5eed, 0x00b2_0ce4];

/// 256-byte blocks of 4 tokens (4 per chunk); 128-byte blocks of 2 tokens (8 per
/// chunk); 384-byte blocks of 8 tokens (2 per chunk, 256 bytes of each chunk unused).
fn layouts() -> [KvLayout; MODELS] {
    let shape = |layers, heads, dim, dtype| ModelShape {
        num_layers: layers,
        num_q_heads: 2 * heads,
        num_kv_heads: heads,
        head_dim: dim,
        kv_dtype: dtype,
    };
    [
        KvLayout::new(shape(2, 1, 8, DType::F16), 4).unwrap(),
        KvLayout::new(shape(1, 2, 4, DType::F32), 2).unwrap(),
        KvLayout::new(shape(3, 1, 4, DType::BF16), 8).unwrap(),
    ]
}

/// Host-tier blocks: room for everything, room for a few (a sleep's spill fills it and
/// evicts the rest), none (a sleep that swaps out is refused, `TierFull`).
const HOST_BLOCKS: [usize; MODELS] = [48, 6, 0];

/// The value standing for token `t` at position `pos` (its K/V bytes are a function of
/// it): equal prefixes hold equal bytes, so prefix-cache hits read true data.
fn value(t: u32, pos: usize) -> u32 {
    t.wrapping_mul(0x9e37_79b1) ^ (pos as u32).rotate_left(16)
}

fn values(tokens: &[u32], first: usize) -> Vec<u32> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| value(t, first + i))
        .collect()
}

/// A broker over the three models with limits drawn from `rng`; returns it and what
/// was drawn (for the failure message).
fn broker(rng: &mut SplitMix64) -> (Broker<HostStorage>, Vec<ModelId>, String) {
    let budget = 10 + rng.below(9) as usize;
    let cold = [None, Some(2), Some(5)][rng.below(3) as usize];
    let config = BrokerConfig::new(budget * CHUNK, CHUNK).with_cold_cache_steps(cold);
    let mut b = Broker::new(config).unwrap();
    let mut ids = Vec::new();
    let mut drawn = format!("budget {budget} chunks, cold after {cold:?};");
    for (i, layout) in layouts().into_iter().enumerate() {
        let bpc = b.blocks_per_chunk(&layout).unwrap();
        let floor = 1 + rng.below(2) as usize;
        let ceiling = floor + 2 + rng.below((budget / 2 - floor - 1) as u64) as usize;
        let priority = rng.below(3) as i32 - 1;
        let kv = KvCache::builder(layout)
            .num_blocks(floor * bpc)
            .watermark_blocks(0)
            .tiers(TierConfig {
                num_host_blocks: HOST_BLOCKS[i],
                ..TierConfig::default()
            })
            .build()
            .unwrap();
        let storage = HostStorage::with_host_tier(layout, floor * bpc, HOST_BLOCKS[i]).unwrap();
        let limits = ModelLimits::new(floor * CHUNK, ceiling * CHUNK).with_priority(priority);
        drawn += &format!(" m{i}: floor {floor} ceiling {ceiling} priority {priority};");
        ids.push(b.register(format!("m{i}"), kv, storage, limits).unwrap());
    }
    (b, ids, drawn)
}

/// What the bookkeeping says about the sequences themselves, which no other thread may
/// change (another model's take may shrink this one and move its blocks, between
/// steps): ids, lengths, where they live, spilled prefix blocks.
fn sequences(kv: &KvCache) -> String {
    let mut ids: Vec<SeqId> = kv.sequence_ids().chain(kv.swapped_sequence_ids()).collect();
    ids.sort();
    ids.dedup();
    let mut s = format!("spilled {}\n", kv.spilled_prefix_blocks());
    for id in ids {
        s += &format!(
            "{id}: {:?} computed, swapped {}\n",
            kv.num_computed_tokens(id).ok(),
            kv.is_swapped(id)
        );
    }
    s
}

/// What a model mid-step must keep while its lock is released: every sequence's table,
/// lengths and place, and the state of every block that was not free. Meanwhile a wake
/// from another thread may grow the arena (free blocks past its end) and restore
/// spilled prefix blocks into free blocks; nothing else may happen.
struct StepView {
    tables: String,
    states: Vec<BlockState>,
}

impl StepView {
    fn of(kv: &KvCache) -> Self {
        let mut tables = String::new();
        for id in kv.sequence_ids() {
            tables += &format!("{id}: {:?}\n", kv.block_table(id).unwrap());
        }
        // Not the spilled count: a wake's restore lowers it.
        for line in sequences(kv).lines().filter(|l| !l.starts_with("spilled")) {
            tables += line;
            tables.push('\n');
        }
        StepView {
            tables,
            states: kv.pool().states().to_vec(),
        }
    }

    /// Panics unless `now` is this view changed only as a mid-step model may be.
    fn check(&self, now: &StepView, id: ModelId) {
        assert_eq!(
            now.tables, self.tables,
            "{id}: a table changed while mid-step with its lock released"
        );
        assert!(
            now.states.len() >= self.states.len(),
            "{id} shrank mid-step"
        );
        for (i, (was, is)) in self.states.iter().zip(&now.states).enumerate() {
            assert!(
                was == is || *was == BlockState::Free,
                "{id}: block {i} went from {was:?} to {is:?} while mid-step"
            );
        }
    }
}

type Guard<'a> = ModelGuard<'a, HostStorage>;

/// Brings a sequence a sleep swapped out back to the device, asking the broker for the
/// room; false when there is none now.
fn swap_in(g: &mut Guard<'_>, seq: SeqId) -> bool {
    let need = g.kv().swapped_table(seq).unwrap().len();
    g.ensure_available(need).unwrap();
    let (kv, st) = g.parts_mut();
    match kv.swap_in(seq) {
        Ok(job) => {
            st.swap(&job.plan).unwrap();
            kv.complete_swap(job.ticket).unwrap();
            true
        }
        Err(Error::OutOfBlocks { .. }) => false,
        Err(e) => panic!("swap_in: {e}"),
    }
}

fn check_seq(g: &Guard<'_>, seq: SeqId, tokens: &[u32]) {
    let table = g.kv().block_table(seq).unwrap();
    assert_eq!(
        check_values(g.storage(), table, &values(tokens, 0)),
        Ok(()),
        "{} {seq}: K/V bytes differ (layer shown)",
        g.id()
    );
}

/// What one scheduler did, for the coverage assertions.
#[derive(Debug, Default, Clone, Copy)]
struct Done {
    admitted: usize,
    refused: usize,
    steps_across_release: usize,
    sleeps: usize,
    swapped_in: usize,
    grown_mid_step: usize,
}

/// One model's scheduler: `STEPS` random actions; returns its live sequences' tokens.
fn scheduler(
    b: &Broker<HostStorage>,
    id: ModelId,
    m: usize,
    seed: u64,
) -> (BTreeMap<SeqId, Vec<u32>>, Done) {
    let mut rng = SplitMix64::new(seed.wrapping_mul(0x100_0000_01b3) ^ m as u64);
    let mut live: BTreeMap<SeqId, Vec<u32>> = BTreeMap::new();
    let mut done = Done::default();
    let mut next_seq = 0u64;
    let mut next_token = 1_000_000 * (m as u32 + 1);
    let mut fresh = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                next_token += 1;
                next_token
            })
            .collect()
    };
    let bs = layouts()[m].block_size();
    for _ in 0..STEPS {
        let pick = live
            .keys()
            .nth(rng.below(live.len().max(1) as u64) as usize)
            .copied();
        match rng.below(100) {
            // Admit a prompt: one of three shared 8-token prefixes, then its own tokens.
            0..=24 => {
                let prefix = rng.below(3) as u32;
                let mut tokens: Vec<u32> = (0..8).map(|i| prefix * 1000 + i).collect();
                tokens.extend(fresh(1 + rng.below(40) as usize));
                let seq = SeqId(next_seq);
                next_seq += 1;
                // A scheduler with work wakes its model (most of the time).
                if b.lock(id).unwrap().is_sleeping() && rng.below(4) > 0 {
                    b.wake(id, tokens.len().div_ceil(bs) * CHUNK).unwrap();
                }
                let mut g = b.lock(id).unwrap();
                g.ensure_available(tokens.len().div_ceil(bs)).unwrap();
                let before = snapshot(g.kv());
                let mut slots = Vec::new();
                let (kv, st) = g.parts_mut();
                match kv.admit_tokens(seq, &tokens, &AdmitOptions::default(), &mut slots) {
                    Ok(a) => {
                        let first = a.cached_tokens;
                        write_values(st, &slots, &values(&tokens[first..], first));
                        live.insert(seq, tokens);
                        done.admitted += 1;
                    }
                    Err(Error::OutOfBlocks { .. } | Error::TooLong { .. }) => {
                        assert_eq!(snapshot(g.kv()), before, "a refused admission");
                        done.refused += 1;
                    }
                    Err(e) => panic!("admit: {e}"),
                }
            }
            // Decode a few tokens at once.
            25..=39 => {
                let Some(seq) = pick else { continue };
                let mut g = b.lock(id).unwrap();
                if g.kv().is_swapped(seq) {
                    if !swap_in(&mut g, seq) {
                        continue;
                    }
                    done.swapped_in += 1;
                }
                let new = fresh(1 + rng.below(6) as usize);
                g.ensure_available(new.len().div_ceil(bs) + 1).unwrap();
                let have = live.get_mut(&seq).unwrap();
                let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
                let (kv, st) = g.parts_mut();
                match kv.append_tokens(seq, &new, &mut slots, &mut copies) {
                    Ok(_) => {
                        st.copy_blocks(&copies).unwrap();
                        write_values(st, &slots, &values(&new, have.len()));
                        have.extend(new);
                    }
                    Err(Error::OutOfBlocks { .. } | Error::TooLong { .. }) => {}
                    Err(e) => panic!("append: {e}"),
                }
            }
            // A step reserved under the lock, the lock released while it "runs" (the
            // other threads may try to take this model's memory or put it to sleep),
            // then written and committed: the slots handed out must still be valid.
            40..=54 => {
                let Some(seq) = pick else { continue };
                let mut g = b.lock(id).unwrap();
                if g.kv().is_swapped(seq) && !swap_in(&mut g, seq) {
                    continue;
                }
                let (n, lookahead) = (1 + rng.below(5) as usize, rng.below(3) as usize);
                g.ensure_available((n + lookahead).div_ceil(bs) + 1)
                    .unwrap();
                let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
                let (kv, st) = g.parts_mut();
                match kv.reserve(seq, n, lookahead, &mut slots, &mut copies) {
                    Ok(()) => st.copy_blocks(&copies).unwrap(),
                    Err(Error::OutOfBlocks { .. } | Error::TooLong { .. }) => continue,
                    Err(e) => panic!("reserve: {e}"),
                }
                let blocks = g.kv().num_blocks();
                let held = StepView::of(g.kv());
                drop(g);
                std::thread::sleep(Duration::from_micros(rng.below(400)));
                let mut g = b.lock(id).unwrap();
                held.check(&StepView::of(g.kv()), id);
                done.grown_mid_step += usize::from(g.kv().num_blocks() > blocks);
                let new = fresh(n);
                let have = live.get_mut(&seq).unwrap();
                let first = have.len();
                let accepted = rng.below(n as u64 + 1) as usize;
                let (kv, st) = g.parts_mut();
                write_values(st, &slots[..n], &values(&new, first));
                // Drafts' slots hold other bytes, as rejected drafts would.
                write_values(st, &slots[n..], &vec![7; lookahead]);
                kv.commit(seq, accepted).unwrap();
                kv.add_token_ids(seq, first, &new[..accepted]).unwrap();
                have.extend(&new[..accepted]);
                done.steps_across_release += 1;
            }
            55..=71 => {
                let Some(seq) = pick else { continue };
                b.lock(id).unwrap().kv_mut().free(seq).unwrap();
                live.remove(&seq);
            }
            72..=84 => {
                let mut g = b.lock(id).unwrap();
                let before = g.kv().num_available_blocks();
                let want = 1 + rng.below(40) as usize;
                let after = g.ensure_available(want).unwrap();
                assert!(g.is_sleeping() || after >= before.min(want));
            }
            85..=86 => {
                let opts = SleepOptions {
                    swap_out_sequences: rng.below(2) == 0,
                    spill_cached_prefixes: rng.below(2) == 0,
                };
                let before = sequences(b.lock(id).unwrap().kv());
                match b.sleep(id, opts) {
                    Ok(_) => {
                        done.sleeps += 1;
                        // (The outside thread may have woken it since.)
                        let g = b.lock(id).unwrap();
                        if opts.swap_out_sequences {
                            assert_eq!(g.kv().stats().num_sequences, 0);
                        }
                    }
                    Err(Error::ShrinkBelowResident { .. } | Error::TierFull { .. }) => {
                        assert_eq!(sequences(b.lock(id).unwrap().kv()), before);
                    }
                    Err(e) => panic!("sleep: {e}"),
                }
            }
            87..=89 => {
                b.wake(id, (1 + rng.below(10) as usize) * CHUNK).unwrap();
            }
            // Checkpoint: every resident sequence's bytes.
            _ => {
                let g = b.lock(id).unwrap();
                g.kv().check_invariants().unwrap();
                for (seq, tokens) in &live {
                    if !g.kv().is_swapped(*seq) {
                        check_seq(&g, *seq, tokens);
                    }
                }
            }
        }
    }
    (live, done)
}

/// The outside thread: reservations with deadlines, sleeps and wakes of any model, the
/// clock, invariant checks, until `stop`. Returns (reservations granted, timed out,
/// sleeps refused mid-step).
fn outside(
    b: &Broker<HostStorage>,
    ids: &[ModelId],
    seed: u64,
    stop: &std::sync::atomic::AtomicBool,
) -> (usize, usize, usize) {
    use std::sync::atomic::Ordering;
    let mut rng = SplitMix64::new(!seed);
    let mut held = Vec::new();
    let (mut granted, mut timed_out, mut mid_step) = (0, 0, 0);
    let mut clock = 0;
    while !stop.load(Ordering::Relaxed) {
        match rng.below(16) {
            0..=4 => {
                let chunks = 1 + rng.below(5) as usize;
                let timeout = Duration::from_micros([0, 300, 2000][rng.below(3) as usize]);
                match b.reserve(chunks * CHUNK - 1, timeout) {
                    Ok(r) => {
                        assert_eq!(r.bytes(), chunks * CHUNK);
                        granted += 1;
                        held.push(r);
                    }
                    Err(Error::ReservationTimeout {
                        requested, found, ..
                    }) => {
                        assert!(found < requested);
                        timed_out += 1;
                    }
                    Err(Error::OutOfRange { .. }) => {}
                    Err(e) => panic!("reserve: {e}"),
                }
                if held.len() > 2 {
                    b.release(held.remove(0)).unwrap();
                }
            }
            5..=7 => {
                if !held.is_empty() {
                    let r = held.swap_remove(rng.below(held.len() as u64) as usize);
                    b.release(r).unwrap();
                }
            }
            8 | 9 => {
                let id = ids[rng.below(ids.len() as u64) as usize];
                let opts = SleepOptions {
                    swap_out_sequences: rng.below(2) == 0,
                    spill_cached_prefixes: rng.below(2) == 0,
                };
                match b.sleep(id, opts) {
                    Ok(_) => {}
                    Err(Error::SequenceState { .. }) => mid_step += 1,
                    Err(Error::ShrinkBelowResident { .. } | Error::TierFull { .. }) => {}
                    Err(e) => panic!("sleep {id}: {e}"),
                }
            }
            10 => {
                let id = ids[rng.below(ids.len() as u64) as usize];
                b.wake(id, (1 + rng.below(8) as usize) * CHUNK).unwrap();
            }
            11..=13 => {
                clock += rng.below(3);
                b.set_clock(clock);
            }
            _ => {
                b.check_invariants().unwrap();
                let s = b.stats();
                assert!(s.peak_used_bytes <= s.budget_bytes);
            }
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    for r in held {
        b.release(r).unwrap();
    }
    (granted, timed_out, mid_step)
}

/// After the threads: every sequence is there and reads back its bytes (the swapped
/// ones after a swap-in, once the resident ones are freed to make room), and freeing
/// everything leaves no block used.
fn final_check(b: &Broker<HostStorage>, ids: &[ModelId], live: &[BTreeMap<SeqId, Vec<u32>>]) {
    b.check_invariants().unwrap();
    for (m, &id) in ids.iter().enumerate() {
        b.wake(id, 0).unwrap();
        let mut g = b.lock(id).unwrap();
        let mut known: Vec<SeqId> = g
            .kv()
            .sequence_ids()
            .chain(g.kv().swapped_sequence_ids())
            .collect();
        known.sort();
        known.dedup();
        assert_eq!(
            known,
            live[m].keys().copied().collect::<Vec<_>>(),
            "m{m} lost a sequence"
        );
        for (seq, tokens) in &live[m] {
            if !g.kv().is_swapped(*seq) {
                check_seq(&g, *seq, tokens);
                g.kv_mut().free(*seq).unwrap();
            }
        }
    }
    for (m, &id) in ids.iter().enumerate() {
        let mut g = b.lock(id).unwrap();
        for (seq, tokens) in &live[m] {
            if g.kv().is_swapped(*seq) {
                assert!(swap_in(&mut g, *seq), "m{m} {seq}: no room to swap in");
                check_seq(&g, *seq, tokens);
                g.kv_mut().free(*seq).unwrap();
            }
        }
        assert_eq!(g.kv().stats().used_blocks, 0, "m{m} leaked blocks");
    }
    b.check_invariants().unwrap();
    let s = b.stats();
    let granted: usize = s.models.iter().map(|m| m.granted_bytes).sum();
    assert_eq!(granted + s.reserved_bytes + s.free_bytes, s.budget_bytes);
    assert_eq!(s.reserved_bytes, 0);
}

#[test]
fn schedulers_and_an_outside_thread_share_the_budget_and_lose_nothing() {
    let mut total = Done::default();
    let (mut reservations, mut mid_step_refusals, mut between_models) = (0, 0, 0);
    let mut reasons = std::collections::BTreeSet::new();
    for seed in SEEDS {
        let mut rng = SplitMix64::new(seed);
        let (b, ids, drawn) = broker(&mut rng);
        let b = Arc::new(b);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let result = std::thread::scope(|s| {
            let schedulers: Vec<_> = ids
                .iter()
                .enumerate()
                .map(|(m, &id)| {
                    let b = &b;
                    s.spawn(move || scheduler(b, id, m, seed))
                })
                .collect();
            let out = s.spawn(|| outside(&b, &ids, seed, &stop));
            let lives: Vec<_> = schedulers.into_iter().map(|h| h.join()).collect();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            (lives, out.join())
        });
        let (lives, out) = result;
        let mut live = Vec::new();
        for r in lives {
            match r {
                Ok((l, d)) => {
                    live.push(l);
                    total.admitted += d.admitted;
                    total.refused += d.refused;
                    total.steps_across_release += d.steps_across_release;
                    total.sleeps += d.sleeps;
                    total.swapped_in += d.swapped_in;
                    total.grown_mid_step += d.grown_mid_step;
                }
                Err(p) => {
                    eprintln!("seed {seed:#x}: {drawn}");
                    std::panic::resume_unwind(p);
                }
            }
        }
        let (granted, _, mid) = out.unwrap_or_else(|p| {
            eprintln!("seed {seed:#x}: {drawn}");
            std::panic::resume_unwind(p)
        });
        reservations += granted;
        mid_step_refusals += mid;
        final_check(&b, &ids, &live);
        for e in b.events() {
            reasons.insert(format!("{:?}", e.reason));
            between_models += usize::from(
                matches!(e.from, Party::Model(_))
                    && matches!(e.to, Party::Model(_) | Party::External(_)),
            );
        }
    }
    eprintln!(
        "{total:?}; {reservations} reservations granted, {mid_step_refusals} sleeps refused \
         mid-step, {between_models} moves out of a model; reasons {reasons:?}"
    );
    assert!(total.admitted > 50 && total.steps_across_release > 50 && total.sleeps > 0);
    assert!(reservations > 0 && between_models > 0);
    assert!(reasons.contains(&format!("{:?}", MoveReason::Sleep)));
}
