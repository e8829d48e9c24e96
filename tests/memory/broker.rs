//! The memory broker, model-based: random actions on three models of different shapes
//! and block sizes sharing one budget, external reservations, sleep and wake; after
//! every step the broker's invariants (budget never exceeded, no model below its floor
//! or above its ceiling, every chunk accounted for, event log replaying to the ledger)
//! and every live token's K/V read back byte for byte from `HostStorage` (so the data
//! survives every shrink, with its block moves, and every grow).
//! Plus a concurrency stress: a thread per model scheduling while another reserves and
//! releases external bytes, bounded in time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagedkv::broker::{
    Broker, BrokerConfig, ModelGuard, ModelId, ModelLimits, MoveReason, Party, SleepOptions,
};
use pagedkv::layout::Slot;
use pagedkv::{
    AdmitOptions, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape, SeqId,
    Storage, TierConfig,
};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

const CHUNK: usize = 1024;

/// Three shapes: 256-byte blocks of 4 tokens (4 per chunk), 1 KiB blocks of 8 tokens
/// (1 per chunk), 192-byte blocks of 2 tokens (5 per chunk, 64 bytes of each chunk
/// unused).
fn layouts() -> [KvLayout; 3] {
    let shape = |layers, heads, dim, dtype| ModelShape {
        num_layers: layers,
        num_q_heads: heads,
        num_kv_heads: heads,
        head_dim: dim,
        kv_dtype: dtype,
    };
    [
        KvLayout::new(shape(2, 1, 8, DType::F16), 4).unwrap(),
        KvLayout::new(shape(1, 2, 8, DType::F32), 8).unwrap(),
        KvLayout::new(shape(3, 1, 4, DType::F32), 2).unwrap(),
    ]
}

/// Host-tier blocks of the three models: room for swapped sequences and spilled
/// prefixes, room for a few (a spill that fills it and evicts the rest), none.
const HOST_BLOCKS: [usize; 3] = [32, 3, 0];

fn broker(budget_chunks: usize, floors: [usize; 3]) -> (Broker<HostStorage>, Vec<ModelId>) {
    broker_with(BrokerConfig::new(budget_chunks * CHUNK, CHUNK), floors)
}

/// Model `i` has priority `i` and a ceiling of half the budget.
fn broker_with(config: BrokerConfig, floors: [usize; 3]) -> (Broker<HostStorage>, Vec<ModelId>) {
    let budget_chunks = config.budget_bytes / config.chunk_bytes;
    let mut b = Broker::new(config).unwrap();
    let mut ids = Vec::new();
    for (i, layout) in layouts().into_iter().enumerate() {
        let bpc = b.blocks_per_chunk(&layout).unwrap();
        let blocks = floors[i] * bpc;
        let kv = KvCache::builder(layout)
            .num_blocks(blocks)
            .watermark_blocks(0)
            .tiers(TierConfig {
                num_host_blocks: HOST_BLOCKS[i],
                ..TierConfig::default()
            })
            .build()
            .unwrap();
        let storage = HostStorage::with_host_tier(layout, blocks, HOST_BLOCKS[i]).unwrap();
        let limits =
            ModelLimits::new(floors[i] * CHUNK, budget_chunks * CHUNK / 2).with_priority(i as i32);
        ids.push(b.register(format!("m{i}"), kv, storage, limits).unwrap());
    }
    (b, ids)
}

/// The byte pattern of one token's K (kind 0) or V (kind 1) in one layer: a function
/// of the token id and position, so a block shared through the prefix cache holds the
/// same bytes whoever wrote it.
fn token_bytes(
    layout: &KvLayout,
    token: u32,
    pos: usize,
    layer: usize,
    kind: u64,
    out: &mut Vec<u8>,
) {
    let n = layout.shape().num_kv_heads * layout.shape().head_dim * layout.dtype().size_bytes();
    let mut z = (u64::from(token) << 32) ^ (pos as u64) << 8 ^ (layer as u64) << 2 ^ kind;
    for _ in 0..n {
        z = z
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(0x632b_e59b_d9b4_e019);
        out.push((z >> 56) as u8);
    }
}

fn write_tokens(storage: &mut HostStorage, tokens: &[u32], first_pos: usize, slots: &[Slot]) {
    let layout = *storage.layout();
    for layer in 0..layout.num_layers() {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (i, &t) in tokens.iter().enumerate() {
            token_bytes(&layout, t, first_pos + i, layer, 0, &mut k);
            token_bytes(&layout, t, first_pos + i, layer, 1, &mut v);
        }
        storage.write_slots(layer, slots, &k, &v).unwrap();
    }
}

fn check_tokens(kv: &KvCache, storage: &HostStorage, seq: SeqId, tokens: &[u32]) {
    let layout = *storage.layout();
    let table = kv.block_table(seq).unwrap();
    for layer in 0..layout.num_layers() {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (i, &t) in tokens.iter().enumerate() {
            token_bytes(&layout, t, i, layer, 0, &mut k);
            token_bytes(&layout, t, i, layer, 1, &mut v);
        }
        let (mut rk, mut rv) = (vec![0; k.len()], vec![0; v.len()]);
        storage
            .read_tokens(layer, table, tokens.len(), &mut rk, &mut rv)
            .unwrap();
        assert!(rk == k && rv == v, "{seq} layer {layer}: K/V bytes changed");
    }
}

/// Admits `tokens` as `seq`, asking the broker for the blocks first; writes the K/V of
/// the tokens the prefix cache did not hold. Returns whether it was admitted.
fn admit(g: &mut ModelGuard<'_, HostStorage>, seq: SeqId, tokens: &[u32]) -> bool {
    let need = g.kv().layout().blocks_for_tokens(tokens.len());
    g.ensure_available(need).unwrap();
    let mut slots = Vec::new();
    let (kv, storage) = g.parts_mut();
    match kv.admit_tokens(seq, tokens, &AdmitOptions::default(), &mut slots) {
        Ok(a) => {
            write_tokens(storage, &tokens[a.cached_tokens..], a.cached_tokens, &slots);
            true
        }
        Err(Error::OutOfBlocks { .. }) | Err(Error::TooLong { .. }) => false,
        Err(e) => panic!("admit: {e}"),
    }
}

fn append(
    g: &mut ModelGuard<'_, HostStorage>,
    seq: SeqId,
    have: &mut Vec<u32>,
    new: &[u32],
) -> bool {
    // At most one block per token plus the partly filled last one.
    let need = new.len().div_ceil(g.kv().block_size()) + 1;
    g.ensure_available(need).unwrap();
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    let (kv, storage) = g.parts_mut();
    match kv.append_tokens(seq, new, &mut slots, &mut copies) {
        Ok(_) => {
            storage.copy_blocks(&copies).unwrap();
            write_tokens(storage, new, have.len(), &slots);
            have.extend_from_slice(new);
            true
        }
        Err(Error::OutOfBlocks { .. }) | Err(Error::TooLong { .. }) => false,
        Err(e) => panic!("append: {e}"),
    }
}

#[derive(Debug, Clone)]
enum Action {
    /// A prompt of `len` tokens whose first 8 come from one of 3 shared prefixes.
    Admit {
        model: usize,
        prefix: u32,
        len: usize,
    },
    Append {
        model: usize,
        pick: usize,
        n: usize,
    },
    Free {
        model: usize,
        pick: usize,
    },
    Ensure {
        model: usize,
        blocks: usize,
    },
    Reserve {
        chunks: usize,
    },
    Release {
        pick: usize,
    },
    Sleep {
        model: usize,
        swap_out: bool,
        spill: bool,
    },
    Wake {
        model: usize,
        chunks: usize,
    },
    /// Advances the broker clock, so caches turn cold.
    Tick {
        steps: u64,
    },
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => (0..3usize, 0..3u32, 1..40usize).prop_map(|(model, prefix, len)| Action::Admit { model, prefix, len }),
        3 => (0..3usize, any::<usize>(), 1..12usize).prop_map(|(model, pick, n)| Action::Append { model, pick, n }),
        3 => (0..3usize, any::<usize>()).prop_map(|(model, pick)| Action::Free { model, pick }),
        1 => (0..3usize, 1..40usize).prop_map(|(model, blocks)| Action::Ensure { model, blocks }),
        1 => (1..6usize).prop_map(|chunks| Action::Reserve { chunks }),
        1 => any::<usize>().prop_map(|pick| Action::Release { pick }),
        1 => (0..3usize, any::<bool>(), any::<bool>()).prop_map(|(model, swap_out, spill)| Action::Sleep { model, swap_out, spill }),
        1 => (0..3usize, 1..12usize).prop_map(|(model, chunks)| Action::Wake { model, chunks }),
        2 => (0..6u64).prop_map(|steps| Action::Tick { steps }),
    ]
}

/// The shadow model: every live sequence's tokens, per model.
type Shadow = [BTreeMap<SeqId, Vec<u32>>; 3];

fn check_all(b: &Broker<HostStorage>, ids: &[ModelId], shadow: &Shadow) {
    b.check_invariants().unwrap();
    for (m, seqs) in shadow.iter().enumerate() {
        let g = b.lock(ids[m]).unwrap();
        for (seq, tokens) in seqs {
            if !g.kv().is_swapped(*seq) {
                check_tokens(g.kv(), g.storage(), *seq, tokens);
            }
        }
    }
    let stats = b.stats();
    let granted: usize = stats.models.iter().map(|m| m.granted_bytes).sum();
    assert_eq!(
        granted + stats.reserved_bytes + stats.free_bytes,
        stats.budget_bytes
    );
    for m in &stats.models {
        assert!(
            m.granted_bytes >= m.floor_bytes,
            "{} below its floor",
            m.name
        );
    }
}

/// Runs `actions`; returns the broker, its models and the blocks each model's wakes
/// restored.
fn run(
    actions: Vec<Action>,
    budget_chunks: usize,
) -> (Broker<HostStorage>, Vec<ModelId>, [usize; 3]) {
    // Caches turn cold within a few ticks, so runs of this length see it happen.
    let config = BrokerConfig::new(budget_chunks * CHUNK, CHUNK).with_cold_cache_steps(Some(3));
    let (b, ids) = broker_with(config, [2, 2, 2]);
    let mut restored = [0; 3];
    let mut shadow: Shadow = Default::default();
    let mut reservations = Vec::new();
    let mut next_seq = 0u64;
    let mut next_token = 1000u32;
    // The cold-cache rule, checked from the outside: the clock, and the last clock at
    // which each model held a sequence (every step ends with each model's lock
    // released by `check_all`, which is when the broker looks).
    let (mut clock, mut active_at) = (0u64, [0u64; 3]);
    let cold_steps = b.config().cold_cache_steps.unwrap();
    for a in actions {
        let seen = b.events().len();
        let idle: Vec<bool> = shadow.iter().map(|s| s.is_empty()).collect();
        match a {
            Action::Admit { model, prefix, len } => {
                let mut tokens: Vec<u32> = (0..8).map(|i| prefix * 100 + i).collect();
                tokens.extend((0..len).map(|_| {
                    next_token += 1;
                    next_token
                }));
                let seq = SeqId(next_seq);
                next_seq += 1;
                let mut g = b.lock(ids[model]).unwrap();
                if admit(&mut g, seq, &tokens) {
                    shadow[model].insert(seq, tokens);
                }
            }
            Action::Append { model, pick, n } => {
                let Some((&seq, _)) = shadow[model].iter().nth(pick % shadow[model].len().max(1))
                else {
                    continue;
                };
                let mut g = b.lock(ids[model]).unwrap();
                if g.kv().is_swapped(seq) {
                    continue;
                }
                let new: Vec<u32> = (0..n)
                    .map(|_| {
                        next_token += 1;
                        next_token
                    })
                    .collect();
                let have = shadow[model].get_mut(&seq).unwrap();
                append(&mut g, seq, have, &new);
            }
            Action::Free { model, pick } => {
                let Some((&seq, _)) = shadow[model].iter().nth(pick % shadow[model].len().max(1))
                else {
                    continue;
                };
                let mut g = b.lock(ids[model]).unwrap();
                g.kv_mut().free(seq).unwrap();
                shadow[model].remove(&seq);
            }
            Action::Ensure { model, blocks } => {
                let mut g = b.lock(ids[model]).unwrap();
                let before = g.kv().num_available_blocks();
                let after = g.ensure_available(blocks).unwrap();
                assert!(after >= before.min(blocks));
            }
            Action::Reserve { chunks } => match b.reserve(chunks * CHUNK - 1, Duration::ZERO) {
                Ok(r) => {
                    assert_eq!(r.bytes(), chunks * CHUNK);
                    reservations.push(r);
                }
                Err(Error::ReservationTimeout { found, .. }) => assert!(found < chunks * CHUNK),
                Err(Error::OutOfRange { .. }) => {}
                Err(e) => panic!("reserve: {e}"),
            },
            Action::Release { pick } => {
                if !reservations.is_empty() {
                    let r = reservations.swap_remove(pick % reservations.len());
                    b.release(r).unwrap();
                }
            }
            Action::Sleep {
                model,
                swap_out,
                spill,
            } => {
                let opts = SleepOptions {
                    swap_out_sequences: swap_out,
                    spill_cached_prefixes: spill,
                };
                let cached = b.lock(ids[model]).unwrap().kv().stats().cached_blocks;
                let spilled_before = b.lock(ids[model]).unwrap().kv().spilled_prefix_blocks();
                match b.sleep(ids[model], opts) {
                    Ok(r) => {
                        let g = b.lock(ids[model]).unwrap();
                        assert!(g.is_sleeping());
                        assert_eq!(g.kv().stats().cached_blocks, 0);
                        assert_eq!(
                            g.kv().spilled_prefix_blocks(),
                            spilled_before + r.spilled_blocks
                        );
                        if !spill {
                            assert_eq!(r.spilled_blocks, 0);
                        }
                        if !swap_out {
                            // Nothing was released by a swap-out: the cache was all there was.
                            assert_eq!(r.spilled_blocks + r.evicted_blocks, cached);
                        }
                    }
                    // Live blocks over the floor without swapping, or a host tier
                    // these models do not have.
                    Err(Error::ShrinkBelowResident { .. }) | Err(Error::TierFull { .. }) => {}
                    Err(e) => panic!("sleep: {e}"),
                }
            }
            Action::Wake { model, chunks } => {
                let spilled = b.lock(ids[model]).unwrap().kv().spilled_prefix_blocks();
                let r = b.wake(ids[model], chunks * CHUNK).unwrap();
                restored[model] += r.restored_blocks;
                assert_eq!(
                    r.restored_blocks + r.dropped_blocks + r.still_spilled_blocks,
                    spilled
                );
                let g = b.lock(ids[model]).unwrap();
                assert_eq!(g.kv().spilled_prefix_blocks(), r.still_spilled_blocks);
                assert_eq!(r.granted_bytes, b.stats().models[model].granted_bytes);
            }
            Action::Tick { steps } => {
                clock += steps;
                b.set_clock(clock);
            }
        }
        // A model's cache went to a model of lower priority only when it was cold: no
        // sequence, and none for `cold_steps` of the clock.
        for e in &b.events()[seen..] {
            if let (MoveReason::TakeCached, Party::Model(from), Party::Model(to)) =
                (e.reason, e.from, e.to)
            {
                let (g, t) = (from.0 as usize, to.0 as usize);
                if g > t {
                    assert!(
                        idle[g] && clock - active_at[g] >= cold_steps,
                        "{e:?} from a warm model (clock {clock}, active at {})",
                        active_at[g]
                    );
                }
            }
        }
        check_all(&b, &ids, &shadow);
        for (m, seqs) in shadow.iter().enumerate() {
            if !seqs.is_empty() {
                active_at[m] = clock;
            }
        }
    }
    for r in reservations {
        b.release(r).unwrap();
    }
    check_all(&b, &ids, &shadow);
    (b, ids, restored)
}

/// Adds the moves of each kind in `events` to `t`, so a run shows which paths it
/// exercised.
fn tally(events: &[pagedkv::broker::MoveEvent], t: &mut [usize; 7]) {
    for e in events {
        match e.reason {
            MoveReason::TakeIdle => t[0] += 1,
            MoveReason::TakeCached => t[1] += 1,
            _ => {}
        }
        t[2] += e.moved_blocks;
        t[3] +=
            usize::from(matches!(e.to, Party::External(_)) && matches!(e.from, Party::Model(_)));
        if e.reason == MoveReason::Sleep {
            t[4] += e.spilled_blocks;
            // A spill that found the host tier full.
            t[5] += usize::from(e.spilled_blocks > 0 && e.evicted_blocks > 0);
        }
        // A cold cache taken by a model of lower priority.
        if let (MoveReason::TakeCached, Party::Model(f), Party::Model(to)) =
            (e.reason, e.from, e.to)
        {
            t[6] += usize::from(f.0 > to.0);
        }
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(64))]
    #[test]
    fn broker_keeps_budget_floors_and_bytes(
        actions in prop::collection::vec(action(), 1..80),
        budget_chunks in 12..48usize,
    ) {
        run(actions, budget_chunks);
    }
}

#[test]
fn the_property_run_exercises_every_move() {
    // Runs the property above on a fixed set of seeds' worth of cases and checks that
    // each kind of move happened in some case (taking idle and cached memory, block
    // moves during a shrink, reservations served from an arena).
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop::collection::vec(action(), 40..80);
    let (mut t, mut restored) = ([0; 7], 0);
    for case in 0..40 {
        // Roomy and tight budgets: a cold cache is taken only when free budget and
        // idle blocks run out.
        let budget = if case % 2 == 0 { 40 } else { 16 };
        let (b, _, r) = run(strategy.new_tree(&mut runner).unwrap().current(), budget);
        tally(&b.events(), &mut t);
        restored += r.iter().sum::<usize>();
    }
    eprintln!(
        "take_idle {}, take_cached {}, blocks moved {}, arena->reservation {}, \
         blocks spilled {}, spills into a full host tier {}, \
         cold caches taken by a lower priority {}",
        t[0], t[1], t[2], t[3], t[4], t[5], t[6]
    );
    eprintln!("spilled prefix blocks restored by wakes {restored}");
    assert!(
        t.iter().all(|&n| n > 0) && restored > 0,
        "{t:?}, {restored}"
    );
}

#[test]
fn a_model_under_pressure_takes_idle_then_cached_memory() {
    let (b, ids) = broker(12, [2, 2, 2]);
    // 6 chunks are free; model 0 grows to its ceiling of 6 chunks (of 4 blocks).
    let mut g = b.lock(ids[0]).unwrap();
    assert_eq!(g.ensure_available(1000).unwrap(), 6 * 4);
    drop(g);
    // Model 2 (priority 2) fills its prefix cache, then frees: cached blocks.
    let mut g2 = b.lock(ids[2]).unwrap();
    let tokens: Vec<u32> = (0..20).collect();
    assert!(admit(&mut g2, SeqId(1), &tokens));
    g2.kv_mut().free(SeqId(1)).unwrap();
    assert!(g2.kv().stats().cached_blocks > 0);
    drop(g2);
    // Model 1 needs 3 more chunks: the 2 free ones, then model 0's idle memory; model
    // 2's cache is not touched (idle memory goes first, and its priority is higher).
    let mut g1 = b.lock(ids[1]).unwrap();
    assert_eq!(g1.ensure_available(5).unwrap(), 5);
    drop(g1);
    let events = b.events();
    assert!(events.iter().any(|e| e.reason == MoveReason::TakeIdle
        && e.from == Party::Model(ids[0])
        && e.to == Party::Model(ids[1])));
    assert!(!events.iter().any(|e| e.reason == MoveReason::TakeCached));
    b.check_invariants().unwrap();
    let svg = b.events_svg("moves");
    assert!(svg.starts_with("<svg") && svg.contains("take_idle"));
}

/// Model 2 (priority 2) serves a request and goes quiet: its blocks stay cached. Model 0
/// holds the rest of the budget live. Model 1 (priority 1) then needs 2 chunks: returns
/// the state in which it got them.
fn quiet_cache_then_pressure(
    config: BrokerConfig,
    keep_one_sequence: bool,
    clock: u64,
) -> (Broker<HostStorage>, Vec<ModelId>, usize) {
    let (b, ids) = broker_with(config, [2, 2, 2]);
    let mut g2 = b.lock(ids[2]).unwrap();
    let tokens: Vec<u32> = (0..40).collect();
    assert!(admit(&mut g2, SeqId(1), &tokens));
    g2.kv_mut().free(SeqId(1)).unwrap();
    if keep_one_sequence {
        assert!(admit(&mut g2, SeqId(2), &[7, 7]));
    }
    assert!(g2.kv().stats().cached_blocks >= 15);
    drop(g2);
    assert_eq!(b.stats().models[2].granted_bytes, 4 * CHUNK);
    let mut g0 = b.lock(ids[0]).unwrap();
    let tokens: Vec<u32> = (100..196).collect();
    assert!(admit(&mut g0, SeqId(3), &tokens));
    drop(g0);
    assert_eq!(b.stats().free_bytes, 0);
    b.set_clock(clock);
    let mut g1 = b.lock(ids[1]).unwrap();
    let available = g1.ensure_available(4).unwrap();
    drop(g1);
    b.check_invariants().unwrap();
    (b, ids, available)
}

#[test]
fn a_cold_cache_is_taken_whatever_its_holders_priority() {
    let cfg = BrokerConfig::new(12 * CHUNK, CHUNK);
    let steps = cfg.cold_cache_steps.unwrap();
    let takes = |b: &Broker<HostStorage>, ids: &[ModelId]| {
        b.events()
            .iter()
            .filter(|e| {
                e.reason == MoveReason::TakeCached
                    && e.from == Party::Model(ids[2])
                    && e.to == Party::Model(ids[1])
            })
            .count()
    };
    // Warm (quiet for fewer steps than `cold_cache_steps`): priority protects the cache.
    let (b, ids, available) = quiet_cache_then_pressure(cfg, false, steps - 1);
    assert_eq!((available, takes(&b, &ids)), (2, 0));
    // Cold: model 1 takes 2 chunks of model 2's cache, which goes down to its floor.
    let (b, ids, available) = quiet_cache_then_pressure(cfg, false, steps);
    assert_eq!((available, takes(&b, &ids)), (4, 2));
    assert_eq!(b.stats().models[2].granted_bytes, 2 * CHUNK);
    // A model holding a sequence is warm however long ago it started.
    let (b, ids, available) = quiet_cache_then_pressure(cfg, true, 10 * steps);
    assert_eq!((available, takes(&b, &ids)), (2, 0));
    assert_eq!(b.stats().models[2].granted_bytes, 4 * CHUNK);
    // `None`: the cache is protected by priority always.
    let (b, ids, available) =
        quiet_cache_then_pressure(cfg.with_cold_cache_steps(None), false, 10 * steps);
    assert_eq!((available, takes(&b, &ids)), (2, 0));
}

#[test]
fn reservation_times_out_with_a_typed_error_and_gives_back() {
    let (b, ids) = broker(8, [2, 2, 2]);
    // Everything but the floors is free: 2 chunks.
    let r = b.reserve(2 * CHUNK, Duration::from_millis(10)).unwrap();
    let before = b.stats();
    let err = b.reserve(CHUNK, Duration::from_millis(20)).unwrap_err();
    assert!(
        matches!(err, Error::ReservationTimeout { found: 0, .. }),
        "{err}"
    );
    assert_eq!(b.stats().free_bytes, before.free_bytes);
    // Beyond the budget less the floors: refused at once.
    assert!(matches!(
        b.reserve(3 * CHUNK, Duration::from_secs(10)),
        Err(Error::OutOfRange { .. })
    ));
    b.release(r).unwrap();
    assert_eq!(b.stats().free_bytes, 2 * CHUNK);
    // Sleeping model 0 (empty) gives nothing (at its floor); waking grows it back.
    b.sleep(ids[0], SleepOptions::default()).unwrap();
    assert_eq!(b.wake(ids[0], 4 * CHUNK).unwrap().granted_bytes, 4 * CHUNK);
    b.check_invariants().unwrap();
}

#[test]
fn sleep_swaps_sequences_out_and_shrinks_to_the_floor() {
    let mut b = Broker::new(BrokerConfig::new(16 * CHUNK, CHUNK)).unwrap();
    let layout = layouts()[0];
    let kv = KvCache::builder(layout)
        .num_blocks(32)
        .watermark_blocks(0)
        .tiers(pagedkv::TierConfig {
            num_host_blocks: 64,
            ..Default::default()
        })
        .build()
        .unwrap();
    let storage = HostStorage::with_host_tier(layout, 32, 64).unwrap();
    let id = b
        .register("m", kv, storage, ModelLimits::new(CHUNK, 16 * CHUNK))
        .unwrap();
    let mut g = b.lock(id).unwrap();
    let tokens: Vec<u32> = (0..60).collect();
    assert!(admit(&mut g, SeqId(7), &tokens));
    drop(g);
    // 15 live blocks do not fit the floor of 4 blocks without swapping.
    assert!(matches!(
        b.sleep(id, SleepOptions::default()),
        Err(Error::ShrinkBelowResident { .. })
    ));
    let given = b
        .sleep(
            id,
            SleepOptions {
                swap_out_sequences: true,
                spill_cached_prefixes: false,
            },
        )
        .unwrap();
    assert_eq!(given.freed_bytes, 7 * CHUNK);
    b.check_invariants().unwrap();
    // Wake, swap back in, and the bytes are the ones written.
    b.wake(id, 8 * CHUNK).unwrap();
    let mut g = b.lock(id).unwrap();
    let (kv, storage) = g.parts_mut();
    let job = kv.swap_in(SeqId(7)).unwrap();
    storage.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    check_tokens(g.kv(), g.storage(), SeqId(7), &tokens);
}

#[test]
fn concurrent_schedulers_and_reservations() {
    let (b, ids) = broker(48, [2, 2, 2]);
    let b = Arc::new(b);
    let stop = Arc::new(AtomicBool::new(false));
    let run_for = Duration::from_millis(1500);
    let mut handles = Vec::new();
    for (m, &id) in ids.iter().enumerate() {
        let (b, stop) = (Arc::clone(&b), Arc::clone(&stop));
        handles.push(std::thread::spawn(move || {
            let mut live: BTreeMap<SeqId, Vec<u32>> = BTreeMap::new();
            let mut rng = 0x1234_5678_u64 + m as u64;
            let mut next = 0u64;
            let mut steps = 0u64;
            let mut max_wait = Duration::ZERO;
            while !stop.load(Ordering::Relaxed) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let t0 = Instant::now();
                let mut g = b.lock(id).unwrap();
                max_wait = max_wait.max(t0.elapsed());
                // The load shifts: each model is busy a third of the time.
                let busy = (t0.elapsed().as_millis() as u64 / 100 + m as u64).is_multiple_of(3)
                    || rng.is_multiple_of(4);
                if busy || live.is_empty() {
                    let seq = SeqId(next);
                    next += 1;
                    let tokens: Vec<u32> = (0..(rng % 24 + 1) as u32)
                        .map(|i| i + (next as u32) * 64)
                        .collect();
                    if admit(&mut g, seq, &tokens) {
                        live.insert(seq, tokens);
                    }
                }
                let seqs: Vec<SeqId> = live.keys().copied().collect();
                for seq in seqs {
                    let have = live.get_mut(&seq).unwrap();
                    let t = have.len() as u32 + 7_000_000;
                    append(&mut g, seq, have, &[t]);
                }
                if live.len() > 6 || (!busy && !live.is_empty()) {
                    let (&seq, tokens) = live.iter().next().unwrap();
                    check_tokens(g.kv(), g.storage(), seq, tokens);
                    g.kv_mut().free(seq).unwrap();
                    live.remove(&seq);
                }
                drop(g);
                steps += 1;
                std::thread::yield_now();
            }
            let g = b.lock(id).unwrap();
            for (seq, tokens) in &live {
                check_tokens(g.kv(), g.storage(), *seq, tokens);
            }
            (steps, max_wait)
        }));
    }
    let reserver = {
        let (b, stop) = (Arc::clone(&b), Arc::clone(&stop));
        std::thread::spawn(move || {
            let (mut ok, mut timed_out) = (0, 0);
            let mut n = 1usize;
            while !stop.load(Ordering::Relaxed) {
                n = n % 8 + 1;
                match b.reserve(n * CHUNK, Duration::from_millis(5)) {
                    Ok(r) => {
                        ok += 1;
                        std::thread::sleep(Duration::from_millis(2));
                        b.release(r).unwrap();
                    }
                    Err(Error::ReservationTimeout { .. }) => timed_out += 1,
                    Err(e) => panic!("reserve: {e}"),
                }
            }
            (ok, timed_out)
        })
    };
    let start = Instant::now();
    while start.elapsed() < run_for {
        std::thread::sleep(Duration::from_millis(100));
        b.check_invariants().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for (m, h) in handles.into_iter().enumerate() {
        let (steps, max_wait) = h.join().unwrap();
        eprintln!("model {m}: {steps} steps, longest wait for its own lock {max_wait:?}");
        assert!(steps > 0);
    }
    let (ok, timed_out) = reserver.join().unwrap();
    eprintln!("reservations: {ok} granted, {timed_out} timed out");
    b.check_invariants().unwrap();
    let stats = b.stats();
    assert_eq!(stats.reserved_bytes, 0);
    let events = b.events();
    assert!(events.iter().any(|e| e.reason == MoveReason::Reserve));
    assert!(ok > 0);
}

/// One model with a host tier: two prompts (3 and 2 full blocks) computed, written
/// and freed into the prefix cache.
fn cached_model(host_blocks: usize) -> (Broker<HostStorage>, ModelId, Vec<Vec<u32>>) {
    let mut b = Broker::new(BrokerConfig::new(16 * CHUNK, CHUNK)).unwrap();
    let layout = layouts()[0]; // 4 tokens per block, 4 blocks per chunk
    let kv = KvCache::builder(layout)
        .num_blocks(16)
        .watermark_blocks(0)
        .tiers(TierConfig {
            num_host_blocks: host_blocks,
            ..TierConfig::default()
        })
        .build()
        .unwrap();
    let storage = HostStorage::with_host_tier(layout, 16, host_blocks).unwrap();
    let id = b
        .register("m", kv, storage, ModelLimits::new(CHUNK, 16 * CHUNK))
        .unwrap();
    let prompts: Vec<Vec<u32>> = vec![(0..13).collect(), (500..509).collect()];
    let mut g = b.lock(id).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        assert!(admit(&mut g, SeqId(i as u64), p));
        g.kv_mut().free(SeqId(i as u64)).unwrap();
    }
    assert_eq!(g.kv().stats().cached_blocks, 5);
    drop(g);
    (b, id, prompts)
}

/// Admits `prompt` again after a wake: returns the cached tokens it found, and checks
/// every token's K/V (the hit blocks' included) against the pattern written at first.
fn readmit(b: &Broker<HostStorage>, id: ModelId, seq: SeqId, prompt: &[u32]) -> usize {
    let mut g = b.lock(id).unwrap();
    let cached = g
        .kv()
        .cached_prefix_len(prompt, &AdmitOptions::default())
        .unwrap();
    assert!(admit(&mut g, seq, prompt));
    check_tokens(g.kv(), g.storage(), seq, prompt);
    cached
}

/// Scribbles over every block of the device arena, so that bytes read later can only
/// have come back from the host tier.
fn scribble(b: &Broker<HostStorage>, id: ModelId) {
    let mut g = b.lock(id).unwrap();
    let (_, storage) = g.parts_mut();
    for layer in 0..storage.layout().num_layers() {
        storage.region_mut(layer).fill(0xA5);
    }
}

#[test]
fn sleep_spills_the_prefix_cache_and_wake_restores_it_byte_exact() {
    let (b, id, prompts) = cached_model(8);
    let report = b
        .sleep(
            id,
            SleepOptions {
                spill_cached_prefixes: true,
                ..SleepOptions::default()
            },
        )
        .unwrap();
    assert_eq!(report.freed_bytes, 3 * CHUNK);
    assert_eq!((report.spilled_blocks, report.evicted_blocks), (5, 0));
    let sleep = *b.events().last().unwrap();
    assert_eq!(sleep.reason, MoveReason::Sleep);
    assert_eq!((sleep.spilled_blocks, sleep.evicted_blocks), (5, 0));
    {
        let g = b.lock(id).unwrap();
        assert_eq!(g.kv().num_blocks(), 4); // the floor
        assert_eq!(g.kv().stats().cached_blocks, 0);
        assert_eq!(g.kv().spilled_prefix_blocks(), 5);
        assert_eq!(g.kv().tier_stats().host_used_blocks, 5);
        assert_eq!(g.kv().tier_stats().spilled_prefix_blocks, 5);
        // Not on the device: no hit while asleep.
        let opts = AdmitOptions::default();
        assert_eq!(g.kv().cached_prefix_len(&prompts[0], &opts).unwrap(), 0);
    }
    b.check_invariants().unwrap();
    scribble(&b, id);
    let wake = b.wake(id, 4 * CHUNK).unwrap();
    assert_eq!(wake.granted_bytes, 4 * CHUNK);
    assert_eq!(
        (
            wake.restored_blocks,
            wake.dropped_blocks,
            wake.still_spilled_blocks
        ),
        (5, 0, 0)
    );
    b.check_invariants().unwrap();
    {
        let g = b.lock(id).unwrap();
        assert_eq!(g.kv().stats().cached_blocks, 5);
        assert_eq!(g.kv().tier_stats().host_used_blocks, 0);
    }
    // Both prompts hit in full (all whole blocks before the last token), and the
    // bytes the hits share are the ones written before the sleep.
    assert_eq!(readmit(&b, id, SeqId(10), &prompts[0]), 12);
    assert_eq!(readmit(&b, id, SeqId(11), &prompts[1]), 8);
    b.check_invariants().unwrap();
}

#[test]
fn a_full_host_tier_spills_parents_first_and_evicts_the_rest() {
    let (b, id, prompts) = cached_model(2);
    let opts = SleepOptions {
        spill_cached_prefixes: true,
        ..SleepOptions::default()
    };
    let report = b.sleep(id, opts).unwrap();
    assert_eq!((report.spilled_blocks, report.evicted_blocks), (2, 3));
    let sleep = *b.events().last().unwrap();
    assert_eq!((sleep.spilled_blocks, sleep.evicted_blocks), (2, 3));
    scribble(&b, id);
    let wake = b.wake(id, 4 * CHUNK).unwrap();
    assert_eq!(wake.restored_blocks, 2);
    b.check_invariants().unwrap();
    // The two first blocks of the prompts (depth 1, the most recent first) came back:
    // each prompt hits its first block, byte exact.
    assert_eq!(readmit(&b, id, SeqId(10), &prompts[0]), 4);
    assert_eq!(readmit(&b, id, SeqId(11), &prompts[1]), 4);
    // Without the option, the cache is evicted and the event says so.
    let (b, id, _) = cached_model(8);
    let report = b.sleep(id, SleepOptions::default()).unwrap();
    assert_eq!((report.spilled_blocks, report.evicted_blocks), (0, 5));
    let sleep = *b.events().last().unwrap();
    assert_eq!((sleep.spilled_blocks, sleep.evicted_blocks), (0, 5));
}

#[test]
fn a_failed_spill_or_restore_changes_nothing() {
    use pagedkv::executor::tier::{restore_spilled_prefixes, spill_cached_prefixes};
    let layout = layouts()[0];
    let tiers = TierConfig {
        num_host_blocks: 8,
        ..TierConfig::default()
    };
    let mut kv = KvCache::builder(layout)
        .num_blocks(16)
        .tiers(tiers)
        .build()
        .unwrap();
    // The manager thinks the host tier has 8 blocks; this storage has 2, so the copy
    // to host blocks 2.. is refused.
    let mut small = HostStorage::with_host_tier(layout, 16, 2).unwrap();
    let mut good = HostStorage::with_host_tier(layout, 16, 8).unwrap();
    let prompt: Vec<u32> = (0..13).collect();
    let mut slots = Vec::new();
    kv.admit_tokens(SeqId(1), &prompt, &AdmitOptions::default(), &mut slots)
        .unwrap();
    kv.free(SeqId(1)).unwrap();
    let snapshot = |kv: &KvCache| {
        (
            kv.stats(),
            kv.tier_stats(),
            kv.spilled_prefix_blocks(),
            kv.cached_prefix_len(&prompt, &AdmitOptions::default())
                .unwrap(),
        )
    };
    // Fill host blocks 0 and 1 first, so the spill needs blocks 2.. (absent in `small`).
    kv.admit(SeqId(2), 8, &mut slots).unwrap();
    let job = kv.swap_out(SeqId(2)).unwrap();
    good.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    let before = snapshot(&kv);
    assert!(spill_cached_prefixes(&mut kv, &mut small).is_err());
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();
    let spill = spill_cached_prefixes(&mut kv, &mut good).unwrap();
    assert_eq!(spill.spilled_blocks, 3);
    let before = snapshot(&kv);
    assert!(restore_spilled_prefixes(&mut kv, &mut small).is_err());
    assert_eq!(snapshot(&kv), before);
    kv.check_invariants().unwrap();
    let restore = restore_spilled_prefixes(&mut kv, &mut good).unwrap();
    assert_eq!(restore.restored_blocks, 3);
    assert_eq!(
        kv.cached_prefix_len(&prompt, &AdmitOptions::default())
            .unwrap(),
        12
    );
    kv.check_invariants().unwrap();
}

/// Bytes a storage maps for `blocks` blocks of `layout` when every layer region is
/// mapped in whole granules (what `CudaStorage` does), computed here independently.
fn mapped_in_granules(layout: &KvLayout, blocks: usize, granule: usize) -> usize {
    let per_layer = blocks * layout.block_bytes() / layout.num_layers();
    layout.num_layers() * per_layer.div_ceil(granule) * granule
}

#[test]
fn a_chunk_maps_exactly_its_bytes_per_layer_granule() {
    use pagedkv::broker::chunk_bytes_for;
    const MIB: usize = 1 << 20;
    let shape = |layers, heads, dim, dtype| ModelShape {
        num_layers: layers,
        num_q_heads: heads * 4,
        num_kv_heads: heads,
        head_dim: dim,
        kv_dtype: dtype,
    };
    // The shapes of the CUDA test: 4 layers of 16 KiB per block, 3 layers of 64 KiB.
    let gpu = [
        KvLayout::new(shape(4, 2, 128, DType::BF16), 16).unwrap(),
        KvLayout::new(shape(3, 4, 64, DType::F32), 16).unwrap(),
    ];
    let chunk = chunk_bytes_for(&gpu, 2 * MIB).unwrap();
    assert_eq!(chunk, 24 * MIB);
    for l in &gpu {
        let bpc = chunk / l.block_bytes();
        assert_eq!(bpc * l.block_bytes(), chunk);
        for n in 1..6 {
            assert_eq!(mapped_in_granules(l, n * bpc, 2 * MIB), n * chunk);
        }
    }
    // A 2 MiB chunk does not fit the 4-layer model: each layer's 512 KiB share would
    // map a whole granule (8 MiB in all). Refused at registration, nothing changed.
    let config = BrokerConfig::new(48 * MIB, 2 * MIB).with_granule(2 * MIB);
    let mut b: Broker<HostStorage> = Broker::new(config).unwrap();
    let bpc = b.blocks_per_chunk(&gpu[0]).unwrap();
    let kv = KvCache::builder(gpu[0]).num_blocks(bpc).build().unwrap();
    let storage = HostStorage::new(gpu[0], bpc).unwrap();
    let err = b
        .register("m", kv, storage, ModelLimits::new(2 * MIB, 48 * MIB))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    assert_eq!((b.num_models(), b.stats().free_bytes), (0, 48 * MIB));
    assert!(b.events().is_empty());
    // The chunk of `chunk_bytes_for` is accepted, and the broker reports that a chunk
    // maps exactly itself.
    let mut b: Broker<HostStorage> =
        Broker::new(BrokerConfig::new(4 * chunk, chunk).with_granule(2 * MIB)).unwrap();
    for (i, l) in gpu.iter().enumerate() {
        let bpc = b.blocks_per_chunk(l).unwrap();
        let kv = KvCache::builder(*l).num_blocks(bpc).build().unwrap();
        let storage = HostStorage::new(*l, bpc).unwrap();
        b.register(
            format!("m{i}"),
            kv,
            storage,
            ModelLimits::new(chunk, 3 * chunk),
        )
        .unwrap();
    }
    for m in b.stats().models {
        assert_eq!(m.mapped_bytes_per_chunk, chunk, "{}", m.name);
    }
    // Without a granule the rounding is the unused tail of the chunk: 5 blocks of 192
    // bytes in a 1 KiB chunk map 960 bytes.
    let (b, _) = broker(8, [2, 2, 2]);
    let m = &b.stats().models[2];
    assert_eq!((m.blocks_per_chunk, m.mapped_bytes_per_chunk), (5, 960));
}

/// A host storage that reports the mapping granule it is given, as a `CudaStorage`
/// reports its VMM granule (`None`: backed by chunks larger than the granule).
struct Granular {
    inner: HostStorage,
    granule: Option<usize>,
}

pagedkv::delegate_storage! {
    Granular => inner, except [mapping_granule_bytes];
    fn mapping_granule_bytes(&self) -> Option<usize> {
        self.granule
    }
}

#[test]
fn registration_reads_the_storages_granule() {
    const MIB: usize = 1 << 20;
    let shape = ModelShape {
        num_layers: 4,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 128,
        kv_dtype: DType::BF16,
    };
    // 16 KiB per block per layer: a 2 MiB chunk is 512 KiB per layer, not whole granules.
    let layout = KvLayout::new(shape, 16).unwrap();
    let try_register = |chunk: usize, declared: usize, granule: Option<usize>| {
        let config = BrokerConfig::new(8 * chunk, chunk).with_granule(declared);
        let mut b: Broker<Granular> = Broker::new(config).unwrap();
        let bpc = b.blocks_per_chunk(&layout).unwrap();
        let kv = KvCache::builder(layout).num_blocks(bpc).build().unwrap();
        let storage = Granular {
            inner: HostStorage::new(layout, bpc).unwrap(),
            granule,
        };
        let r = b.register("m", kv, storage, ModelLimits::new(chunk, 8 * chunk));
        if r.is_err() {
            // Refused: nothing granted, no event.
            assert_eq!((b.num_models(), b.stats().free_bytes), (0, 8 * chunk));
            assert!(b.events().is_empty());
        }
        r.map(|_| b.stats().models[0].mapped_bytes_per_chunk)
    };
    let refused = |r: pagedkv::Result<usize>| matches!(r, Err(Error::InvalidConfig { .. }));
    // No granule declared: the storage's 2 MiB granule refuses a 2 MiB chunk (it would
    // map 8 MiB) and accepts 8 MiB (2 MiB per layer).
    assert!(refused(try_register(2 * MIB, 0, Some(2 * MIB))));
    assert_eq!(try_register(8 * MIB, 0, Some(2 * MIB)).unwrap(), 8 * MIB);
    // Byte-exact storage (the host's 1): any chunk, as before.
    assert_eq!(try_register(2 * MIB, 0, Some(1)).unwrap(), 2 * MIB);
    // A storage that can keep a straddling chunk after a shrink: refused.
    assert!(refused(try_register(8 * MIB, 0, None)));
    assert!(refused(try_register(8 * MIB, 2 * MIB, None)));
    // A declared granule must be a multiple of the storage's.
    assert!(refused(try_register(8 * MIB, 3 * MIB, Some(2 * MIB))));
    assert_eq!(
        try_register(8 * MIB, 2 * MIB, Some(2 * MIB)).unwrap(),
        8 * MIB
    );
}

proptest! {
    #![proptest_config(crate::support::proptest_config(200))]
    /// For small random shapes and granules, `chunk_bytes_for` is the smallest chunk
    /// that every model fills with whole blocks while each layer maps whole granules
    /// (found here by trying every multiple of the granule below it).
    #[test]
    fn chunk_bytes_for_is_the_smallest_exact_chunk(
        models in prop::collection::vec((1..5usize, 1..3usize, 1..4usize, 1..5usize), 1..4),
        granule_pow in 4..9u32,
    ) {
        use pagedkv::broker::chunk_bytes_for;
        let granule = 1usize << granule_pow;
        let layouts: Vec<KvLayout> = models
            .iter()
            .map(|&(layers, heads, dim, block)| {
                let shape = ModelShape {
                    num_layers: layers,
                    num_q_heads: heads,
                    num_kv_heads: heads,
                    head_dim: dim * 2,
                    kv_dtype: DType::F16,
                };
                KvLayout::new(shape, block).unwrap()
            })
            .collect();
        let exact = |c: usize| {
            layouts.iter().all(|l| {
                c.is_multiple_of(l.block_bytes())
                    && mapped_in_granules(l, c / l.block_bytes(), granule) == c
            })
        };
        let chunk = chunk_bytes_for(&layouts, granule).unwrap();
        prop_assert!(exact(chunk));
        prop_assert!(chunk.is_multiple_of(granule));
        let mut c = granule;
        while c < chunk {
            prop_assert!(!exact(c), "{c} is exact and below {chunk}");
            c += granule;
        }
    }
}

/// A recorder for the metrics test: every counter's total and every gauge's last value,
/// by name and sorted labels.
mod recorder {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use metrics::{
        Counter, CounterFn, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder,
        SharedString, Unit,
    };

    /// A metric's name and labels, sorted.
    pub type MetricKey = (String, Vec<(String, String)>);

    #[derive(Default)]
    pub struct Cell {
        counter: AtomicU64,
        gauge: Mutex<Option<f64>>,
    }

    impl CounterFn for Cell {
        fn increment(&self, value: u64) {
            self.counter.fetch_add(value, Ordering::Relaxed);
        }
        fn absolute(&self, value: u64) {
            self.counter.fetch_max(value, Ordering::Relaxed);
        }
    }

    impl GaugeFn for Cell {
        fn increment(&self, value: f64) {
            let mut g = self.gauge.lock().unwrap();
            *g = Some(g.unwrap_or(0.0) + value);
        }
        fn decrement(&self, value: f64) {
            GaugeFn::increment(self, -value);
        }
        fn set(&self, value: f64) {
            *self.gauge.lock().unwrap() = Some(value);
        }
    }

    #[derive(Default)]
    pub struct TestRecorder {
        counters: Mutex<BTreeMap<MetricKey, Arc<Cell>>>,
        gauges: Mutex<BTreeMap<MetricKey, Arc<Cell>>>,
    }

    fn metric_key(key: &Key) -> MetricKey {
        let mut labels: Vec<(String, String)> = key
            .labels()
            .map(|l| (l.key().to_string(), l.value().to_string()))
            .collect();
        labels.sort();
        (key.name().to_string(), labels)
    }

    impl TestRecorder {
        /// Counters by key (those registered and never incremented read 0).
        pub fn counters(&self) -> BTreeMap<MetricKey, u64> {
            let c = self.counters.lock().unwrap();
            c.iter()
                .map(|(k, v)| (k.clone(), v.counter.load(Ordering::Relaxed)))
                .collect()
        }

        /// Gauges that were set, by key.
        pub fn gauges(&self) -> BTreeMap<MetricKey, f64> {
            let g = self.gauges.lock().unwrap();
            g.iter()
                .filter_map(|(k, v)| v.gauge.lock().unwrap().map(|x| (k.clone(), x)))
                .collect()
        }
    }

    impl Recorder for TestRecorder {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            let mut c = self.counters.lock().unwrap();
            Counter::from_arc(c.entry(metric_key(key)).or_default().clone())
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            let mut g = self.gauges.lock().unwrap();
            Gauge::from_arc(g.entry(metric_key(key)).or_default().clone())
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }
}

/// Every move the broker publishes on the metrics facade, checked against its own
/// accounting: over deterministic runs of the property test's actions (every kind of
/// move, reservations, spilling sleeps and restoring wakes), a recorder installed for
/// the run must hold exactly the counters the event log sums to (bytes and moves per
/// `from`/`to`/`reason`, blocks spilled and evicted per model) and the blocks the wakes
/// restored, and gauges equal to the ledger's last state.
#[test]
fn metrics_match_the_event_log_and_the_ledger() {
    use pagedkv::broker::metric_names as n;
    use recorder::{MetricKey, TestRecorder};
    let key = |name: &str, labels: &[(&str, &str)]| -> MetricKey {
        let mut l: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        l.sort();
        (name.to_string(), l)
    };
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop::collection::vec(action(), 40..80);
    let mut reasons = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let actions = strategy.new_tree(&mut runner).unwrap().current();
        let rec = TestRecorder::default();
        let (b, ids, restored) = metrics::with_local_recorder(&rec, || run(actions, 40));
        let names: Vec<String> = ids
            .iter()
            .map(|&id| b.name(id).unwrap().to_string())
            .collect();
        let label = |p: Party| match p {
            Party::Free => "free".to_string(),
            Party::External(_) => "external".to_string(),
            Party::Model(m) => names[m.0 as usize].clone(),
        };
        let mut want = std::collections::BTreeMap::<MetricKey, u64>::new();
        for e in b.events() {
            reasons.insert(e.reason.name());
            let (f, t) = (label(e.from), label(e.to));
            let labels = [("from", &*f), ("to", &*t), ("reason", e.reason.name())];
            *want.entry(key(n::MOVED_BYTES, &labels)).or_default() += e.bytes as u64;
            *want.entry(key(n::MOVES, &labels)).or_default() += 1;
            for (name, count) in [
                (n::SPILLED_BLOCKS, e.spilled_blocks),
                (n::EVICTED_BLOCKS, e.evicted_blocks),
            ] {
                if count > 0 {
                    *want.entry(key(name, &[("model", &*f)])).or_default() += count as u64;
                }
            }
        }
        for (i, &r) in restored.iter().enumerate() {
            if r > 0 {
                want.insert(key(n::RESTORED_BLOCKS, &[("model", &names[i])]), r as u64);
            }
        }
        assert_eq!(rec.counters(), want);
        let stats = b.stats();
        let mut want_gauges = std::collections::BTreeMap::new();
        want_gauges.insert(key(n::FREE_BYTES, &[]), stats.free_bytes as f64);
        want_gauges.insert(key(n::RESERVED_BYTES, &[]), stats.reserved_bytes as f64);
        for m in &stats.models {
            let g = key(n::GRANTED_BYTES, &[("model", &m.name)]);
            want_gauges.insert(g, m.granted_bytes as f64);
        }
        assert_eq!(rec.gauges(), want_gauges);
    }
    // The runs published every kind of move but a failed grow (a storage refusing).
    for r in [
        "register",
        "grow",
        "take_idle",
        "take_cached",
        "sleep",
        "wake",
        "reserve",
        "release",
    ] {
        assert!(reasons.contains(r), "no {r} move in {reasons:?}");
    }
}
