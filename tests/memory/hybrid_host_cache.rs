//! The host tier as a prefix-cache level of a hybrid cache (two full groups over one
//! arena and one host tier, one host level per group): a prompt evicted from VRAM hits
//! from the host on its next turn with the same K/V bytes in every group, loaded
//! through each group's plan; a load is refused every call until it completes, and an
//! aborted one frees the loaded pages and keeps the device part; groups whose device
//! parts differ load from the common device part on; a full host tier evicts leaf
//! first, and a swap-out takes room from the host entries or refuses typed with
//! nothing changed. Invariants after every call; refusals compared on full snapshots.

use crate::support::kv_bytes::write_values;
use crate::support::snapshot::groups_snapshot as snapshot;
use crate::support::tiers::{layout, prompt, BS};
use crate::support::two_groups::{prompts, value, TwoGroups};

use pagedkv::manager::groups::GroupSwapJob;
use pagedkv::manager::{HostCacheConfig, HostStorePolicy};
use pagedkv::{AdmitOptions, Error, GroupSpec, GroupStep, HostStorage, KvCache, SeqId, Storage};

struct World {
    kv: KvCache,
    st: HostStorage,
    step: GroupStep,
}

impl World {
    /// Two full groups over `pages` pages and a host tier of `host` blocks,
    /// write-through host levels.
    fn new(pages: usize, host: usize) -> Self {
        let l = layout();
        let mut kv =
            KvCache::hybrid_with_host_tier(&[GroupSpec::full(l), GroupSpec::full(l)], pages, host)
                .unwrap();
        kv.set_host_cache(HostCacheConfig::default()).unwrap();
        World {
            kv,
            st: HostStorage::with_host_tier(l, pages, host).unwrap(),
            step: GroupStep::default(),
        }
    }

    /// Stores every registered block to the host levels; returns the blocks copied.
    fn store(&mut self) -> usize {
        let Some(job) = self.kv.plan_host_store_grouped(usize::MAX).unwrap() else {
            return 0;
        };
        self.check();
        for plan in &job.plans {
            self.st.swap(plan).unwrap();
        }
        self.kv.complete_swap_grouped(&job).unwrap();
        self.check();
        job.plans.iter().map(|p| p.len()).sum()
    }

    /// Runs the load of `seq` and completes it.
    fn load(&mut self, seq: u64) -> GroupSwapJob {
        let job = self.kv.load_job_grouped(SeqId(seq)).expect("a load");
        for plan in &job.plans {
            self.st.swap(plan).unwrap();
        }
        self.kv.complete_swap_grouped(&job).unwrap();
        self.check();
        job
    }

    /// Fills every device page with junk: bytes read later come from the host.
    fn scribble(&mut self) {
        for layer in 0..self.st.layout().num_layers() {
            self.st.region_mut(layer).fill(0xA5);
        }
    }
}

impl TwoGroups for World {
    fn parts(&mut self) -> (&mut KvCache, &mut HostStorage, &mut GroupStep) {
        (&mut self.kv, &mut self.st, &mut self.step)
    }
    fn cache(&self) -> &KvCache {
        &self.kv
    }
    fn storage(&self) -> &HostStorage {
        &self.st
    }
}

#[test]
fn a_prompt_evicted_from_vram_hits_from_the_host_with_its_bytes() {
    let mut w = World::new(24, 16);
    let p = prompt(4 * BS + 2, 0);
    assert_eq!(w.compute(1, &p), 0);
    w.kv.free(SeqId(1)).unwrap();
    // Write-through: every registered block of both groups, 4 each.
    assert_eq!(w.store(), 8);
    let stats = w.kv.host_cache_stats();
    assert_eq!((stats.cached_blocks, stats.stored_blocks), (8, 8));
    // Nothing left to store.
    assert_eq!(w.store(), 0);
    assert_eq!(w.kv.evict_cached(usize::MAX), 8);
    w.check();
    w.scribble();

    // The next turn: the whole prefix (4 blocks a group) comes from the host.
    assert_eq!(w.admit_prompt(2, &p), (0, 4 * BS));
    assert_eq!(w.kv.num_computed_tokens(SeqId(2)).unwrap(), 0);
    // Loading: every call that reads or changes its blocks is refused, nothing changed.
    let before = snapshot(&w.kv);
    let e =
        w.kv.reserve_grouped(SeqId(2), 2, 0, &mut w.step)
            .unwrap_err();
    assert!(matches!(e, Error::SequenceState { .. }), "{e:?}");
    let e = w.kv.swap_out_grouped(SeqId(2)).unwrap_err();
    assert!(matches!(e, Error::SequenceState { .. }), "{e:?}");
    assert_eq!(snapshot(&w.kv), before);
    w.check();

    let job = w.load(2);
    assert_eq!(
        job.plans.iter().map(|p| p.len()).collect::<Vec<_>>(),
        [4, 4]
    );
    assert_eq!(w.kv.num_computed_tokens(SeqId(2)).unwrap(), 4 * BS);
    w.assert_bytes(2, &p, 4 * BS);
    let stats = w.kv.host_cache_stats();
    assert_eq!(stats.loaded_blocks, 8);
    assert_eq!(stats.host_hit_tokens, 2 * 4 * BS as u64);
    // The rest of the prompt computes as after any hit, and the loaded blocks are
    // registered on the device again: a third request shares them there.
    w.kv.reserve_grouped(SeqId(2), 2, 0, &mut w.step).unwrap();
    w.kv.commit(SeqId(2), 2).unwrap();
    w.check();
    assert_eq!(w.admit_prompt(3, &p), (4 * BS, 0));
}

#[test]
fn an_aborted_load_frees_the_loaded_pages_and_keeps_the_device_part() {
    let mut w = World::new(32, 24);
    let short = prompt(2 * BS + 1, 0);
    let long = prompt(6 * BS + 1, 0); // `short`'s first 2 blocks, then 4 more
    w.compute(1, &long);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store(), 12);
    w.kv.evict_cached(usize::MAX);
    w.scribble();
    // Load the first 2 blocks back and free them: on the device (cached) again.
    assert_eq!(w.admit_prompt(2, &short), (0, 2 * BS));
    w.load(2);
    w.kv.free(SeqId(2)).unwrap();
    w.check();

    // Device part of 2 blocks in both groups, then 4 from the host.
    let used = w.kv.group_stats().used_pages;
    let host_before = w.kv.host_cache_stats();
    assert_eq!(w.admit_prompt(3, &long), (2 * BS, 4 * BS));
    assert_eq!(w.kv.group_stats().used_pages, used + 2 * 6);
    let job = w.kv.load_job_grouped(SeqId(3)).unwrap();
    w.kv.abort_swap_grouped(&job).unwrap();
    w.check();
    // The loaded pages are free, the device part stays computed with its bytes, the
    // host copies stay.
    assert_eq!(w.kv.num_computed_tokens(SeqId(3)).unwrap(), 2 * BS);
    assert_eq!(w.kv.group_stats().used_pages, used + 2 * 2);
    for g in 0..2 {
        assert_eq!(w.kv.group(g).block_table(SeqId(3)).unwrap().len(), 2);
    }
    w.assert_bytes(3, &long, 2 * BS);
    let host = w.kv.host_cache_stats();
    assert_eq!(host.cached_blocks, host_before.cached_blocks);
    assert_eq!(host.aborted_loads, host_before.aborted_loads + 2);
    assert_eq!(host.loads_in_flight, 0);
    // The sequence goes on; another request loads the same host blocks, byte exact.
    w.kv.reserve_grouped(SeqId(3), 1, 0, &mut w.step).unwrap();
    w.kv.commit(SeqId(3), 1).unwrap();
    w.check();
    assert_eq!(w.admit_prompt(4, &long), (2 * BS, 4 * BS));
    w.load(4);
    w.assert_bytes(4, &long, 6 * BS);
}

#[test]
fn groups_whose_device_parts_differ_load_the_rest_from_the_host() {
    let mut w = World::new(24, 16);
    let p = prompt(4 * BS + 1, 0);
    w.compute(1, &p);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store(), 8);
    // Group 0 evicts first: it keeps 1 block on the device, group 1 all 4.
    assert_eq!(w.kv.evict_cached(3), 3);
    assert_eq!(w.kv.group(0).stats().cached_blocks, 1);
    // The sequence is computed as far as every group holds on the device; every
    // group loads the rest from its host level (group 1 too: its device copies are
    // past the common device part).
    assert_eq!(w.admit_prompt(2, &p), (BS, 3 * BS));
    let job = w.load(2);
    assert_eq!(
        job.plans.iter().map(|p| p.len()).collect::<Vec<_>>(),
        [3, 3]
    );
    w.assert_bytes(2, &p, 4 * BS);
    // One-shot admissions serve device hits only (as on one group).
    let a =
        w.kv.admit_tokens_grouped(SeqId(3), &p, &AdmitOptions::default(), &mut w.step)
            .unwrap();
    assert_eq!((a.cached_tokens, a.loading_tokens), (4 * BS, 0));
    w.check();
    // Without host copies, the hit is the device part every group holds.
    w.kv.free(SeqId(2)).unwrap();
    w.kv.free(SeqId(3)).unwrap();
    assert_eq!(w.kv.evict_host_cache(usize::MAX).unwrap(), 8);
    assert_eq!(w.kv.evict_cached(3), 3);
    assert_eq!(w.admit_prompt(4, &p), (BS, 0));
    assert!(w.kv.load_job_grouped(SeqId(4)).is_none());
}

#[test]
fn a_full_host_tier_evicts_leaf_first_and_swap_outs_come_first() {
    // 4 host blocks: 2 per group.
    let mut w = World::new(24, 4);
    let a = prompt(2 * BS + 1, 0);
    let b = prompt(BS + 1, 500);
    w.compute(1, &a);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store(), 4);
    assert_eq!(w.kv.num_free_host_blocks(), 0);
    // `b`'s block takes the place of `a`'s leaf in each group, not its root.
    w.compute(2, &b);
    w.kv.free(SeqId(2)).unwrap();
    assert_eq!(w.store(), 2);
    let st = w.kv.host_cache_stats();
    assert_eq!((st.cached_blocks, st.removed_blocks), (4, 2));
    w.kv.evict_cached(usize::MAX);
    assert_eq!(w.admit_prompt(3, &a), (0, BS));
    w.load(3);
    w.assert_bytes(3, &a, BS);
    w.kv.free(SeqId(3)).unwrap();

    // A swap-out takes its room from the host entries no load reads...
    let mut step = GroupStep::default();
    w.kv.admit_grouped(SeqId(4), 2 * BS, &mut step).unwrap();
    let job = w.kv.swap_out_grouped(SeqId(4)).unwrap();
    w.check();
    assert_eq!(w.kv.host_cache_stats().cached_blocks, 0);
    w.kv.abort_swap_grouped(&job).unwrap();
    w.check();
    // ...and refuses typed, changing nothing, when loads read what it would need.
    w.kv.evict_cached(usize::MAX);
    w.compute(5, &b);
    w.kv.free(SeqId(5)).unwrap();
    assert_eq!(w.store(), 2);
    w.kv.evict_cached(usize::MAX);
    assert_eq!(w.admit_prompt(6, &b), (0, BS));
    let before = snapshot(&w.kv);
    let e = w.kv.swap_out_grouped(SeqId(4)).unwrap_err();
    assert_eq!(
        e,
        Error::TierFull {
            tier: "host",
            needed: 4,
            free: 2
        }
    );
    assert_eq!(snapshot(&w.kv), before);
    w.check();
}

#[test]
fn the_host_level_refuses_hybrid_caches_with_a_window_or_state_group() {
    let l = layout();
    for specs in [
        vec![GroupSpec::full(l), GroupSpec::window(l, 8)],
        vec![GroupSpec::full(l), GroupSpec::state(l, 2)],
    ] {
        let mut kv = KvCache::hybrid_with_host_tier(&specs, 16, 8).unwrap();
        let before = snapshot(&kv);
        let e = kv.set_host_cache(HostCacheConfig {
            store: HostStorePolicy::Selective { min_hits: 1 },
            ..HostCacheConfig::default()
        });
        assert!(matches!(e, Err(Error::NotOnHybrid { .. })), "{e:?}");
        let e = kv.plan_host_store_grouped(4).map(|j| j.is_some());
        assert!(matches!(e, Err(Error::NotOnHybrid { .. })), "{e:?}");
        assert_eq!(snapshot(&kv), before);
        kv.check_invariants().unwrap();
    }
}

#[test]
fn a_host_hit_is_the_prefix_every_group_holds() {
    // 5 host blocks: shares of 3 and 2, so group 0 stores 3 blocks of 4, group 1 2.
    let mut w = World::new(24, 5);
    let p = prompt(4 * BS + 1, 0);
    w.compute(1, &p);
    w.kv.free(SeqId(1)).unwrap();
    assert_eq!(w.store(), 5);
    assert_eq!(w.kv.group(0).host_cache_stats().cached_blocks, 3);
    w.kv.evict_cached(usize::MAX);
    w.scribble();
    assert_eq!(w.admit_prompt(2, &p), (0, 2 * BS));
    let job = w.load(2);
    assert_eq!(
        job.plans.iter().map(|p| p.len()).collect::<Vec<_>>(),
        [2, 2]
    );
    w.assert_bytes(2, &p, 2 * BS);
}

// ---- model-based interleaving ----------------------------------------------------

/// Runs and completes a planned swap; returns the refusal when there was one.
fn run_swap(w: &mut World, r: Result<GroupSwapJob, Error>) -> Option<Error> {
    if let Ok(job) = &r {
        for plan in &job.plans {
            w.st.swap(plan).unwrap();
        }
        w.kv.complete_swap_grouped(job).unwrap();
    }
    r.err()
}

use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Action {
    /// Admit through `admit_prompt_grouped` (host hits load) or, with `one_shot`,
    /// `admit_tokens_grouped`; compute the rest unless loading.
    Admit {
        seq: u8,
        prompt: u8,
        one_shot: bool,
    },
    /// Complete (`ok`) or abort the load of the `pick`-th loading sequence, then
    /// compute the rest.
    FinishLoad {
        pick: u8,
        ok: bool,
    },
    /// Free, then (with `store`) store every registered block to the host.
    Free {
        seq: u8,
        store: bool,
    },
    Store {
        max: u8,
        ok: bool,
    },
    EvictDevice {
        n: u8,
    },
    EvictHost {
        n: u8,
    },
    SwapOut {
        seq: u8,
    },
    SwapIn {
        seq: u8,
    },
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (0..4u8, 0..4u8, any::<bool>())
            .prop_map(|(seq, prompt, one_shot)| Action::Admit { seq, prompt, one_shot }),
        3 => (0..6u8, any::<bool>()).prop_map(|(pick, ok)| Action::FinishLoad { pick, ok }),
        4 => (0..4u8, any::<bool>()).prop_map(|(seq, store)| Action::Free { seq, store }),
        3 => (1..8u8, 0..4u8).prop_map(|(max, ok)| Action::Store { max, ok: ok > 0 }),
        3 => (1..64u8).prop_map(|n| Action::EvictDevice { n }),
        1 => (1..4u8).prop_map(|n| Action::EvictHost { n }),
        1 => (0..6u8).prop_map(|seq| Action::SwapOut { seq }),
        1 => (0..6u8).prop_map(|seq| Action::SwapIn { seq }),
    ]
}

impl World {
    /// Every resident, idle sequence reads its prompt's bytes up to its computed
    /// tokens in every group.
    fn assert_all_bytes(&self, live: &BTreeMap<u64, usize>, ps: &[Vec<u32>]) {
        for (&seq, &p) in live {
            let id = SeqId(seq);
            if self.kv.is_swapped(id) || self.kv.swap_in_flight(id).is_some() {
                continue;
            }
            let n = self.kv.num_computed_tokens(id).unwrap();
            self.assert_bytes(seq, &ps[p], n);
        }
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(64))]

    /// Random interleavings of admissions (host hits loading), loads completed or
    /// aborted, frees, stores completed or aborted, evictions and swaps on a hybrid
    /// cache of two full groups: the invariants hold after every step, a refused call
    /// changes nothing, and every computed token reads its bytes in both groups.
    #[test]
    fn hybrid_host_level_interleavings_keep_bytes_and_invariants(
        actions in proptest::collection::vec(action(), 10..60),
    ) {
        let mut w = World::new(40, 24);
        let ps = prompts();
        // Live sequences (resident or swapped) and their prompt.
        let mut live: BTreeMap<u64, usize> = BTreeMap::new();
        for a in actions {
            let before = snapshot(&w.kv);
            let refused = match a {
                Action::Admit { seq, prompt, one_shot } => {
                    let (seq, p) = (u64::from(seq), usize::from(prompt));
                    let opts = AdmitOptions::default();
                    if one_shot {
                        let r = w.kv.admit_tokens_grouped(SeqId(seq), &ps[p], &opts, &mut w.step);
                        if let Ok(adm) = &r {
                            for g in 0..2 {
                                let values: Vec<u32> =
                                    ps[p][adm.cached_tokens..].iter().map(|&t| value(g, t)).collect();
                                write_values(&mut w.st, &w.step.slots[g], &values);
                            }
                            live.insert(seq, p);
                        }
                        r.err()
                    } else {
                        let r = w.kv.admit_prompt_grouped(SeqId(seq), &ps[p], &opts);
                        if let Ok(adm) = &r {
                            live.insert(seq, p);
                            if adm.loading_tokens == 0 {
                                w.compute_rest(seq, &ps[p], adm.cached_tokens);
                            }
                        }
                        r.err()
                    }
                }
                Action::FinishLoad { pick, ok } => {
                    let loading: Vec<u64> = live
                        .keys()
                        .copied()
                        .filter(|&s| w.kv.load_job_grouped(SeqId(s)).is_some())
                        .collect();
                    match (!loading.is_empty()).then(|| loading[usize::from(pick) % loading.len()]) {
                        None => None,
                        Some(seq) => {
                            let job = w.kv.load_job_grouped(SeqId(seq)).unwrap();
                            if ok {
                                for plan in &job.plans {
                                    w.st.swap(plan).unwrap();
                                }
                                w.kv.complete_swap_grouped(&job).unwrap();
                            } else {
                                w.kv.abort_swap_grouped(&job).unwrap();
                            }
                            w.check();
                            let from = w.kv.num_computed_tokens(SeqId(seq)).unwrap();
                            w.compute_rest(seq, &ps[live[&seq]], from);
                            None
                        }
                    }
                }
                Action::Free { seq, store } => {
                    let seq = u64::from(seq);
                    let r = w.kv.free(SeqId(seq));
                    if r.is_ok() {
                        live.remove(&seq);
                        if store {
                            w.store();
                        }
                    }
                    r.err()
                }
                Action::Store { max, ok } => {
                    match w.kv.plan_host_store_grouped(usize::from(max)).unwrap() {
                        None => None,
                        Some(job) => {
                            w.check();
                            if ok {
                                for plan in &job.plans {
                                    w.st.swap(plan).unwrap();
                                }
                                w.kv.complete_swap_grouped(&job).unwrap();
                            } else {
                                w.kv.abort_swap_grouped(&job).unwrap();
                            }
                            None
                        }
                    }
                }
                Action::EvictDevice { n } => {
                    w.kv.evict_cached(usize::from(n));
                    None
                }
                Action::EvictHost { n } => {
                    w.kv.evict_host_cache(usize::from(n)).unwrap();
                    None
                }
                Action::SwapOut { seq } => {
                    let r = w.kv.swap_out_grouped(SeqId(u64::from(seq)));
                    run_swap(&mut w, r)
                }
                Action::SwapIn { seq } => {
                    let r = w.kv.swap_in_grouped(SeqId(u64::from(seq)));
                    run_swap(&mut w, r)
                }
            };
            if let Some(e) = refused {
                prop_assert!(
                    !matches!(e, Error::CorruptBlockTable(_)),
                    "{a:?}: {e:?}"
                );
                prop_assert_eq!(snapshot(&w.kv), before, "{:?} refused with {:?}", a, e);
            }
            w.check();
            w.assert_all_bytes(&live, &ps);
        }
    }
}

#[test]
fn the_executor_helpers_store_and_load_every_group_and_abort_on_a_failed_copy() {
    use crate::support::faulty_storage::FlakyStorage;
    use pagedkv::executor::tier::{load_prefix_from_host, store_prefixes_to_host};

    let mut w = World::new(24, 16);
    let p = prompt(3 * BS + 1, 0);
    w.compute(1, &p);
    w.kv.free(SeqId(1)).unwrap();
    let spare = HostStorage::with_host_tier(layout(), 24, 16).unwrap();
    let mut flaky = FlakyStorage::new(std::mem::replace(&mut w.st, spare), false);
    // A copy failing halfway: the store is aborted (the device blocks it held are
    // cached again), nothing findable on the host.
    flaky.swap_failures = 1;
    let before = w.kv.group_stats();
    assert!(store_prefixes_to_host(&mut w.kv, &mut flaky, 64).is_err());
    w.check();
    assert_eq!(w.kv.host_cache_stats().cached_blocks, 0);
    assert_eq!(w.kv.host_cache_stats().aborted_stores, 2);
    assert_eq!(w.kv.group_stats(), before);
    assert_eq!(
        store_prefixes_to_host(&mut w.kv, &mut flaky, 64).unwrap(),
        6
    );
    w.kv.evict_cached(usize::MAX);
    // A failed load is aborted: the sequence keeps its (empty) device part.
    let a =
        w.kv.admit_prompt_grouped(SeqId(2), &p, &AdmitOptions::default())
            .unwrap();
    assert_eq!((a.cached_tokens, a.loading_tokens), (0, 3 * BS));
    flaky.swap_failures = 1;
    assert!(load_prefix_from_host(&mut w.kv, &mut flaky, SeqId(2)).is_err());
    w.check();
    assert_eq!(w.kv.num_computed_tokens(SeqId(2)).unwrap(), 0);
    assert!(w.kv.load_job_grouped(SeqId(2)).is_none());
    w.kv.free(SeqId(2)).unwrap();
    // And the helpers load every group's part, byte exact.
    w.kv.admit_prompt_grouped(SeqId(3), &p, &AdmitOptions::default())
        .unwrap();
    assert_eq!(
        load_prefix_from_host(&mut w.kv, &mut flaky, SeqId(3)).unwrap(),
        6
    );
    w.st = flaky.inner;
    w.check();
    w.assert_bytes(3, &p, 3 * BS);
}
