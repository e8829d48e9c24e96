//! The host tier as a level of the prefix cache: stores (write-through, write-back,
//! selective), lookups split by tier, loads that count as computed only once they
//! complete, aborts that change nothing, swap-outs taking room from host entries,
//! events per tier, and a model-based interleaving with a byte shadow. Bytes are
//! checked through the block tables on `HostStorage`.

use crate::support::faulty_storage;
use crate::support::kv_bytes;
use crate::support::snapshot;
use crate::support::tiers::{hit_of, layout, prompt, BS};

use std::collections::BTreeMap;

use faulty_storage::FlakyStorage;
use kv_bytes::{check_values, write_values};
use pagedkv::executor::tier::{load_prefix_from_host, store_prefixes_to_host, TransferEngine};
use pagedkv::ids::SwapTicket;
use pagedkv::manager::{HostCacheConfig, HostCacheStats, HostStorePolicy};
use pagedkv::pool::prefix::{CostAwarePolicy, Medium, PrefixEvent};
use pagedkv::{
    AdmitOptions, CopyPlan, Error, HostStorage, KvCache, PrefixHit, SeqId, Storage, TierConfig,
};
use proptest::prelude::*;

fn setup(blocks: usize, host: usize, store: HostStorePolicy) -> (KvCache, HostStorage) {
    let mut kv = KvCache::builder(layout())
        .num_blocks(blocks)
        .watermark_blocks(0)
        .record_events(true)
        .tiers(TierConfig {
            num_host_blocks: host,
            ..TierConfig::default()
        })
        .build()
        .unwrap();
    kv.set_host_cache(HostCacheConfig {
        store,
        ..HostCacheConfig::default()
    })
    .unwrap();
    let storage = HostStorage::with_host_tier(layout(), blocks, host).unwrap();
    (kv, storage)
}

/// Admits `prompt` as `seq` through the prefix cache and computes it whole: writes
/// the K/V of every token the cache did not serve and commits.
fn compute(kv: &mut KvCache, st: &mut HostStorage, seq: u64, prompt: &[u32]) -> usize {
    let mut slots = Vec::new();
    let a = kv
        .admit_tokens(SeqId(seq), prompt, &AdmitOptions::default(), &mut slots)
        .unwrap();
    write_values(st, &slots, &prompt[a.cached_tokens..]);
    a.cached_tokens
}

/// Fills every free device block with junk bytes, so a block that a load did not write
/// cannot hold the expected bytes by chance (a freed block keeps its old content).
fn scrub_free_blocks(kv: &mut KvCache, st: &mut HostStorage) {
    let n = kv.pool().num_free() * BS;
    if n == 0 {
        return;
    }
    let mut slots = Vec::new();
    kv.admit(SeqId(9_999), n, &mut slots).unwrap();
    let junk: Vec<u32> = (0..n as u32).map(|i| 0xdead_0000 + i).collect();
    write_values(st, &slots, &junk);
    kv.free(SeqId(9_999)).unwrap();
}

/// Everything observable, with the host level's entries and in-flight work (not its
/// cumulative counters of aborts and hits).
fn state(kv: &KvCache) -> String {
    let h = kv.host_cache_stats();
    format!(
        "{}host entries {} stored {} removed {} in flight {}/{}",
        snapshot::snapshot(kv),
        h.cached_blocks,
        h.stored_blocks,
        h.removed_blocks,
        h.stores_in_flight,
        h.loads_in_flight
    )
}

// ---- store, lookup, load ---------------------------------------------------------

/// Write K/V for a prompt, free it, store to host, evict part of it from the device,
/// admit the same prompt: the hit is split device/host, the load runs on the storage,
/// and the bytes read back through the new table are the prompt's.
#[test]
fn host_hit_is_split_by_tier_and_byte_exact() {
    let (mut kv, mut st) = setup(12, 8, HostStorePolicy::WriteThrough);
    let p = prompt(17, 100); // 4 full blocks + 1 token
    compute(&mut kv, &mut st, 1, &p);
    kv.free(SeqId(1)).unwrap();
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        4
    );
    assert_eq!(kv.host_cache_stats().cached_blocks, 4);
    // Leaves go first: the last two blocks leave the device.
    assert_eq!(kv.evict_cached(2), 2);
    kv.check_invariants().unwrap();
    assert_eq!(
        kv.cached_prefix_len(&p, &AdmitOptions::default()).unwrap(),
        8
    );
    scrub_free_blocks(&mut kv, &mut st);

    let hit = hit_of(&kv, &p);
    assert_eq!((hit.device_tokens(), hit.host_tokens()), (8, 8));
    assert_eq!(hit.total_tokens(), 16);
    // Admission counts the loaded blocks as needed: 2 loaded + 1 for a first chunk.
    let free = kv.num_available_blocks();
    assert!(kv.can_admit_chunk(&hit, 1));
    kv.admit(SeqId(77), (free - 2) * BS, &mut Vec::new())
        .unwrap();
    assert!(
        !kv.can_admit_chunk(&hit, 1),
        "the first chunk needs a third block"
    );
    assert!(kv.can_admit_hit(&hit) == kv.can_admit_chunk(&hit, 1));
    kv.free(SeqId(77)).unwrap();
    let a = kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    assert_eq!((a.cached_tokens, a.loading_tokens), (8, 8));
    // Loaded tokens are not computed before the load completes.
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 8);
    assert_eq!(kv.num_tokens(SeqId(2)).unwrap(), 16);
    kv.check_invariants().unwrap();
    // Nothing may read the loading blocks meanwhile: reserve is refused, typed.
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    let before = state(&kv);
    assert!(matches!(
        kv.reserve(SeqId(2), 1, 0, &mut slots, &mut copies),
        Err(Error::SequenceState { .. })
    ));
    assert!(matches!(
        kv.free(SeqId(2)),
        Err(Error::SequenceState { .. })
    ));
    assert_eq!(state(&kv), before);

    let job = kv.load_job(SeqId(2)).unwrap();
    assert_eq!(job.plan.len(), 2);
    st.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 16);
    let table = kv.block_table(SeqId(2)).unwrap().to_vec();
    check_values(&st, &table, &p[..16]).unwrap();
    // The loaded blocks are registered on the device again: findable there.
    assert_eq!(
        kv.cached_prefix_len(&p, &AdmitOptions::default()).unwrap(),
        16
    );
    let stats = kv.host_cache_stats();
    assert_eq!((stats.loaded_blocks, stats.host_hit_tokens), (2, 8));
    assert_eq!(stats.loaded_bytes, 2 * layout().block_bytes() as u64);
    assert_eq!(stats.cached_blocks, 4, "the host copies stay a cache level");
    // The sequence goes on as any other.
    kv.reserve(SeqId(2), 1, 0, &mut slots, &mut copies).unwrap();
    write_values(&mut st, &slots, &p[16..]);
    kv.commit(SeqId(2), 1).unwrap();
    kv.free(SeqId(2)).unwrap();
    kv.check_invariants().unwrap();
}

/// A lookup with no host part reads exactly as without a host level; a host chain
/// with nothing on the device is found from the first block.
#[test]
fn lookup_without_host_part_is_unchanged_and_host_only_hits_work() {
    let (mut kv, mut st) = setup(12, 8, HostStorePolicy::WriteThrough);
    let p = prompt(13, 7);
    compute(&mut kv, &mut st, 1, &p);
    kv.free(SeqId(1)).unwrap();
    let hit = hit_of(&kv, &p);
    assert_eq!((hit.cached_tokens(), hit.host_tokens()), (12, 0));
    store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
    let hit = hit_of(&kv, &p);
    assert_eq!((hit.cached_tokens(), hit.host_tokens()), (12, 0));
    kv.evict_cached(usize::MAX);
    scrub_free_blocks(&mut kv, &mut st);
    let hit = hit_of(&kv, &p);
    assert_eq!((hit.cached_tokens(), hit.host_tokens()), (0, 12));
    // admit_tokens serves device hits only (it hands out slots at once).
    let mut slots = Vec::new();
    let a = kv
        .admit_tokens(SeqId(5), &p, &AdmitOptions::default(), &mut slots)
        .unwrap();
    assert_eq!((a.cached_tokens, a.loading_tokens), (0, 0));
    kv.free(SeqId(5)).unwrap();
    // Another salt finds nothing on the host either.
    let salted = AdmitOptions {
        cache_salt: b"tenant",
        ..AdmitOptions::default()
    };
    let mut hit = PrefixHit::default();
    kv.lookup_prefix(&p, &salted, &mut hit).unwrap();
    assert_eq!(hit.total_tokens(), 0);

    kv.evict_cached(usize::MAX);
    scrub_free_blocks(&mut kv, &mut st);
    let hit = hit_of(&kv, &p);
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    assert_eq!(
        load_prefix_from_host(&mut kv, &mut st, SeqId(2)).unwrap(),
        3
    );
    let table = kv.block_table(SeqId(2)).unwrap().to_vec();
    check_values(&st, &table, &p[..12]).unwrap();
    kv.check_invariants().unwrap();
}

/// Write-through stores every registered block (a running sequence's too); write-back
/// only the cached blocks nearest eviction, at most N; selective only blocks hit
/// often enough. None stores a block twice.
#[test]
fn store_policies_choose_their_blocks() {
    // Write-through: the live sequence's full blocks are stored too.
    let (mut kv, mut st) = setup(16, 16, HostStorePolicy::WriteThrough);
    compute(&mut kv, &mut st, 1, &prompt(9, 0)); // 2 registered blocks, live
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        2
    );
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        0
    );
    compute(&mut kv, &mut st, 2, &prompt(13, 0)); // shares 2, registers 1 more
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        1
    );
    assert_eq!(kv.host_cache_stats().cached_blocks, 3);
    kv.check_invariants().unwrap();

    // Write-back: live blocks are not stored; of the cached ones, the N nearest
    // eviction (the leaves, least recently used first).
    let (mut kv, mut st) = setup(16, 16, HostStorePolicy::WriteBack { ahead_blocks: 2 });
    compute(&mut kv, &mut st, 1, &prompt(17, 0));
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        0
    );
    kv.free(SeqId(1)).unwrap();
    let job = kv.plan_host_store(usize::MAX).unwrap().unwrap();
    assert_eq!(job.plan.len(), 2);
    st.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    kv.check_invariants().unwrap();
    // Evicting the two leaves loses nothing: the host has them.
    assert_eq!(kv.evict_cached(2), 2);
    let hit = hit_of(&kv, &prompt(17, 0));
    assert_eq!((hit.device_tokens(), hit.host_tokens()), (8, 8));

    // Selective: nothing until a block is hit at least once.
    let (mut kv, mut st) = setup(16, 16, HostStorePolicy::Selective { min_hits: 1 });
    compute(&mut kv, &mut st, 1, &prompt(9, 0));
    kv.free(SeqId(1)).unwrap();
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        0
    );
    // A prompt that shares only the first block hits it once.
    let mut other = prompt(9, 0);
    other[5] = 999;
    compute(&mut kv, &mut st, 2, &other);
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        1
    );
    let stats = kv.host_cache_stats();
    assert_eq!((stats.cached_blocks, stats.stored_blocks), (1, 1));
    kv.check_invariants().unwrap();
}

/// While a store is in flight its device blocks are held: not evictable, not freed;
/// an abort gives the host blocks back and changes nothing else.
#[test]
fn aborted_store_changes_nothing() {
    let (mut kv, mut st) = setup(8, 8, HostStorePolicy::WriteThrough);
    let p = prompt(13, 50);
    compute(&mut kv, &mut st, 1, &p);
    kv.free(SeqId(1)).unwrap();
    let before = state(&kv);
    let available = kv.num_available_blocks();
    let job = kv.plan_host_store(usize::MAX).unwrap().unwrap();
    assert_eq!(job.plan.len(), 3);
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_available_blocks(), available - 3);
    assert_eq!(
        kv.evict_cached(usize::MAX),
        0,
        "held blocks are not evictable"
    );
    // A second plan does not store them twice.
    assert!(kv.plan_host_store(usize::MAX).unwrap().is_none());
    // Defragmentation does not move blocks a transfer reads.
    assert!(kv.plan_defragment(Default::default()).is_err());
    kv.abort_swap(job.ticket).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(state(&kv), before);
    assert_eq!(kv.host_cache_stats().aborted_stores, 1);
    assert!(matches!(
        kv.complete_swap(job.ticket),
        Err(Error::UnknownTicket(_))
    ));
    // The device copy is still the one requests find.
    assert_eq!(
        kv.cached_prefix_len(&p, &AdmitOptions::default()).unwrap(),
        12
    );
    assert_eq!(hit_of(&kv, &p).host_tokens(), 0);
    // A block evicted from the device once stored is not lost.
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        3
    );
    kv.evict_cached(usize::MAX);
    assert_eq!(hit_of(&kv, &p).host_tokens(), 12);
}

/// A failed or aborted load leaves the sequence with its device-hit tokens computed,
/// the loaded device blocks freed and the host copies intact; a retry then loads the
/// same bytes.
#[test]
fn failed_load_loses_nothing() {
    let (mut kv, mut st) = setup(12, 8, HostStorePolicy::WriteThrough);
    let p = prompt(17, 300);
    compute(&mut kv, &mut st, 1, &p);
    kv.free(SeqId(1)).unwrap();
    store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
    kv.evict_cached(3);
    scrub_free_blocks(&mut kv, &mut st);
    let host_before = kv.host_cache_stats().cached_blocks;
    let hit = hit_of(&kv, &p);
    assert_eq!((hit.device_tokens(), hit.host_tokens()), (4, 12));
    let free_before = kv.pool().num_free();

    // An explicit abort.
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    let job = kv.load_job(SeqId(2)).unwrap();
    kv.abort_swap(job.ticket).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 4);
    assert_eq!(kv.num_tokens(SeqId(2)).unwrap(), 4);
    assert_eq!(kv.block_table(SeqId(2)).unwrap().len(), 1);
    assert_eq!(kv.pool().num_free(), free_before);
    assert_eq!(kv.host_cache_stats().cached_blocks, host_before);
    assert!(kv.load_job(SeqId(2)).is_none());
    let before_free = state(&kv);
    kv.free(SeqId(2)).unwrap();

    // A storage error: the convenience aborts and reports it.
    let mut flaky = FlakyStorage::new(st, false);
    flaky.swap_failures = 1;
    let hit = hit_of(&kv, &p);
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    assert!(load_prefix_from_host(&mut kv, &mut flaky, SeqId(2)).is_err());
    kv.check_invariants().unwrap();
    assert_eq!(state(&kv), before_free);
    assert_eq!(kv.host_cache_stats().aborted_loads, 2);
    let mut st = flaky.inner;
    // The sequence goes on: it computes the rest itself.
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    kv.reserve(SeqId(2), 13, 0, &mut slots, &mut copies)
        .unwrap();
    write_values(&mut st, &slots, &p[4..]);
    kv.commit(SeqId(2), 13).unwrap();
    kv.free(SeqId(2)).unwrap();

    // The host copies were intact: a load now reads the prompt's bytes.
    kv.evict_cached(usize::MAX);
    scrub_free_blocks(&mut kv, &mut st);
    let hit = hit_of(&kv, &p);
    assert_eq!(hit.host_tokens(), 16);
    kv.admit_prompt(SeqId(3), &p, &hit).unwrap();
    load_prefix_from_host(&mut kv, &mut st, SeqId(3)).unwrap();
    let table = kv.block_table(SeqId(3)).unwrap().to_vec();
    check_values(&st, &table, &p[..16]).unwrap();
    kv.check_invariants().unwrap();
}

/// Swapped sequences come first: a swap-out evicts host entries (leaves first, with
/// Host-medium removal events) instead of failing, but never an entry a load reads;
/// when even that is not enough it fails and changes nothing.
#[test]
fn swap_outs_evict_host_entries() {
    let (mut kv, mut st) = setup(16, 4, HostStorePolicy::WriteThrough);
    let p = prompt(17, 0);
    compute(&mut kv, &mut st, 1, &p);
    kv.free(SeqId(1)).unwrap();
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        4
    );
    let mut events = Vec::new();
    kv.drain_prefix_events(&mut events);
    let host_stored = events
        .iter()
        .filter(|e| {
            matches!(
                e,
                PrefixEvent::BlockStored {
                    medium: Medium::Host,
                    ..
                }
            )
        })
        .count();
    assert_eq!(host_stored, 4);
    assert_eq!(kv.num_free_host_blocks(), 0);

    // A sequence of 2 blocks swaps out: the two deepest host entries go.
    let q = prompt(6, 500);
    compute(&mut kv, &mut st, 2, &q);
    let job = kv.swap_out(SeqId(2)).unwrap();
    st.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.host_cache_stats().cached_blocks, 2);
    kv.drain_prefix_events(&mut events);
    let removed: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            PrefixEvent::BlockRemoved {
                medium: Medium::Host,
                hash,
                ..
            } => Some(*hash),
            _ => None,
        })
        .collect();
    assert_eq!(removed.len(), 2);
    // The chain's head is still findable on the host.
    kv.evict_cached(usize::MAX);
    assert_eq!(hit_of(&kv, &p).host_tokens(), 8);

    // A load reading both remaining entries pins them: a swap-out that needs them
    // fails and changes nothing.
    let hit = hit_of(&kv, &p);
    kv.admit_prompt(SeqId(3), &p, &hit).unwrap();
    compute(&mut kv, &mut st, 4, &prompt(5, 900));
    let before = state(&kv);
    assert!(matches!(
        kv.swap_out(SeqId(4)),
        Err(Error::TierFull { tier: "host", .. })
    ));
    assert_eq!(state(&kv), before);
    load_prefix_from_host(&mut kv, &mut st, SeqId(3)).unwrap();
    let job = kv.swap_out(SeqId(4)).unwrap();
    st.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    assert_eq!(kv.host_cache_stats().cached_blocks, 0);
    kv.check_invariants().unwrap();
}

/// Host eviction order: LRU evicts the entry used longest ago; the frequency-aware
/// policy keeps the entry loaded (hit) before, even when it is older.
#[test]
fn host_eviction_lru_and_frequency() {
    for frequency in [false, true] {
        let (mut kv, mut st) = setup(16, 2, HostStorePolicy::WriteThrough);
        if frequency {
            kv.set_host_cache(HostCacheConfig {
                store: HostStorePolicy::WriteThrough,
                eviction: Box::new(CostAwarePolicy::default()),
            })
            .unwrap();
        }
        let (a, b) = (prompt(5, 0), prompt(5, 100));
        compute(&mut kv, &mut st, 1, &a);
        kv.free(SeqId(1)).unwrap();
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
        // Hit `a` from the host once.
        kv.evict_cached(usize::MAX);
        let hit = hit_of(&kv, &a);
        kv.admit_prompt(SeqId(2), &a, &hit).unwrap();
        load_prefix_from_host(&mut kv, &mut st, SeqId(2)).unwrap();
        kv.free(SeqId(2)).unwrap();
        // Then store `b`, more recent.
        compute(&mut kv, &mut st, 3, &b);
        kv.free(SeqId(3)).unwrap();
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
        assert_eq!(kv.host_cache_stats().cached_blocks, 2);
        kv.evict_host_cache(1).unwrap();
        kv.evict_cached(usize::MAX);
        let (ha, hb) = (hit_of(&kv, &a).host_tokens(), hit_of(&kv, &b).host_tokens());
        if frequency {
            // `a`: (1 + 1 hit) * (1 + depth 1) = 4 > `b`: 2.
            assert_eq!((ha, hb), (4, 0), "cost-aware keeps the hit entry");
        } else {
            // `a` was used (loaded) before `b` was stored.
            assert_eq!((ha, hb), (0, 4), "LRU evicts the older entry");
        }
        kv.check_invariants().unwrap();
    }
}

/// A store and a load run by the transfer engine on its worker thread.
#[test]
fn transfer_engine_runs_stores_and_loads() {
    let (mut kv, mut st) = setup(12, 8, HostStorePolicy::WriteThrough);
    let p = prompt(13, 40);
    compute(&mut kv, &mut st, 1, &p);
    kv.free(SeqId(1)).unwrap();
    let mut engine = TransferEngine::new(st);
    let job = kv.plan_host_store(usize::MAX).unwrap().unwrap();
    engine.submit(&job).unwrap();
    engine.wait(job.ticket).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    kv.evict_cached(usize::MAX);
    {
        let mut guard = engine.storage().lock();
        scrub_free_blocks(&mut kv, &mut guard);
    }
    let hit = hit_of(&kv, &p);
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    let job = kv.load_job(SeqId(2)).unwrap();
    engine.submit(&job).unwrap();
    engine.wait(job.ticket).unwrap();
    assert!(engine.is_layer_ready(SeqId(2), 1));
    kv.complete_swap(job.ticket).unwrap();
    let table = kv.block_table(SeqId(2)).unwrap().to_vec();
    let guard = engine.storage().lock();
    check_values(&*guard, &table, &p[..12]).unwrap();
    kv.check_invariants().unwrap();
}

/// A host hit is confirmed like a device hit: the namespace (cache salt) and block
/// keys of the first block, the chain and the ids; another namespace finds nothing.
#[test]
fn host_hits_respect_namespaces_and_block_keys() {
    let (mut kv, mut st) = setup(12, 8, HostStorePolicy::WriteThrough);
    let p = prompt(9, 70);
    let keys = [(5usize, &b"image"[..])];
    let salted = AdmitOptions {
        cache_salt: b"tenant",
        block_keys: &keys,
        ..AdmitOptions::default()
    };
    let mut slots = Vec::new();
    kv.admit_tokens(SeqId(1), &p, &salted, &mut slots).unwrap();
    write_values(&mut st, &slots, &p);
    kv.free(SeqId(1)).unwrap();
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        2
    );
    kv.evict_cached(usize::MAX);
    let mut hit = PrefixHit::default();
    kv.lookup_prefix(&p, &salted, &mut hit).unwrap();
    assert_eq!(hit.host_tokens(), 8);
    kv.lookup_prefix(&p, &AdmitOptions::default(), &mut hit)
        .unwrap();
    assert_eq!(hit.total_tokens(), 0, "another namespace");
    let other_key = [(5usize, &b"other"[..])];
    let rekeyed = AdmitOptions {
        block_keys: &other_key,
        ..salted
    };
    kv.lookup_prefix(&p, &rekeyed, &mut hit).unwrap();
    assert_eq!(
        hit.host_tokens(),
        4,
        "the first block only: the key is in the second"
    );
    kv.lookup_prefix(&p, &salted, &mut hit).unwrap();
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    load_prefix_from_host(&mut kv, &mut st, SeqId(2)).unwrap();
    let table = kv.block_table(SeqId(2)).unwrap().to_vec();
    check_values(&st, &table, &p[..8]).unwrap();
    kv.check_invariants().unwrap();
}

/// The one-group store refuses on a hybrid cache (its grouped form and the hybrid
/// host level are tested in `memory/hybrid_host_cache.rs`).
#[test]
fn hybrid_refuses() {
    use pagedkv::manager::groups::GroupSpec;
    let specs = [GroupSpec::full(layout()), GroupSpec::full(layout())];
    let Ok(mut kv) = KvCache::hybrid(&specs, 16) else {
        return;
    };
    assert!(matches!(
        kv.plan_host_store(1),
        Err(Error::NotOnHybrid { .. })
    ));
    kv.set_host_cache(HostCacheConfig::default()).unwrap();
    assert_eq!(kv.host_cache_stats(), HostCacheStats::default());
}

// ---- model-based interleaving ----------------------------------------------------

#[derive(Debug, Clone)]
enum Action {
    Admit { seq: u8, prompt: u8 },
    Free { seq: u8 },
    Store { max: u8, now: bool },
    FinishStore { pick: u8, ok: bool },
    FinishLoad { seq: u8, ok: bool },
    EvictDevice { n: u8 },
    EvictHost { n: u8 },
    SwapOut { seq: u8 },
    SwapIn { seq: u8 },
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0..4u8, 0..5u8).prop_map(|(seq, prompt)| Action::Admit { seq, prompt }),
        4 => (0..4u8).prop_map(|seq| Action::Free { seq }),
        5 => (1..8u8, any::<bool>()).prop_map(|(max, now)| Action::Store { max, now }),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(pick, ok)| Action::FinishStore { pick, ok }),
        5 => (any::<u8>(), any::<bool>()).prop_map(|(seq, ok)| Action::FinishLoad { seq, ok }),
        3 => (0..8u8).prop_map(|n| Action::EvictDevice { n }),
        1 => (0..4u8).prop_map(|n| Action::EvictHost { n }),
        1 => (0..8u8).prop_map(|seq| Action::SwapOut { seq }),
        1 => (0..8u8).prop_map(|seq| Action::SwapIn { seq }),
    ]
}

/// The prompts share prefixes, so chains branch and hits are partial.
fn prompts() -> Vec<Vec<u32>> {
    let base = prompt(21, 1000);
    let mut b = base.clone();
    b[10] = 7;
    let mut c = base.clone();
    c[2] = 8;
    vec![
        base[..9].to_vec(),
        base[..17].to_vec(),
        base.clone(),
        b[..14].to_vec(),
        c[..13].to_vec(),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shadow {
    Computed,
    Loading,
    Swapped,
}

struct Model {
    kv: KvCache,
    st: HostStorage,
    prompts: Vec<Vec<u32>>,
    seqs: BTreeMap<u8, (usize, Shadow)>,
    stores: Vec<SwapTicket>,
}

impl Model {
    /// Computes the rest of `seq`'s prompt (after a load completed or aborted, or an
    /// admission without one).
    fn finish_prompt(&mut self, seq: u8) {
        let p = &self.prompts[self.seqs[&seq].0];
        let id = SeqId(u64::from(seq));
        let done = self.kv.num_computed_tokens(id).unwrap();
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
        match self
            .kv
            .reserve(id, p.len() - done, 0, &mut slots, &mut copies)
        {
            Ok(()) => {
                assert!(copies.is_empty());
                write_values(&mut self.st, &slots, &p[done..]);
                self.kv.commit(id, p.len() - done).unwrap();
                self.seqs.insert(seq, (self.seqs[&seq].0, Shadow::Computed));
            }
            Err(Error::OutOfBlocks { .. }) => {
                self.kv.free(id).unwrap();
                self.seqs.remove(&seq);
            }
            Err(e) => panic!("reserve of {id}: {e}"),
        }
    }

    fn step(&mut self, a: &Action) {
        match *a {
            Action::Admit { seq, prompt } => {
                // A slot in use is freed first (when it can be), so admissions keep
                // coming.
                match self.seqs.get(&seq) {
                    Some((_, Shadow::Loading)) => return,
                    Some(_) => {
                        self.kv.free(SeqId(u64::from(seq))).unwrap();
                        self.seqs.remove(&seq);
                    }
                    None => {}
                }
                let p = self.prompts[prompt as usize].clone();
                let hit = hit_of(&self.kv, &p);
                let before = state(&self.kv);
                match self.kv.admit_prompt(SeqId(u64::from(seq)), &p, &hit) {
                    Ok(adm) => {
                        let id = SeqId(u64::from(seq));
                        assert_eq!(adm.loading_tokens, hit.host_tokens());
                        assert_eq!(self.kv.num_computed_tokens(id).unwrap(), adm.cached_tokens);
                        let table = self.kv.block_table(id).unwrap().to_vec();
                        check_values(&self.st, &table, &p[..adm.cached_tokens]).unwrap();
                        if adm.loading_tokens > 0 {
                            self.seqs.insert(seq, (prompt as usize, Shadow::Loading));
                        } else {
                            self.seqs.insert(seq, (prompt as usize, Shadow::Computed));
                            self.finish_prompt(seq);
                        }
                    }
                    Err(Error::OutOfBlocks { .. }) => assert_eq!(state(&self.kv), before),
                    Err(e) => panic!("admit: {e}"),
                }
            }
            Action::Free { seq } => {
                let Some(&(_, shadow)) = self.seqs.get(&seq) else {
                    return;
                };
                let r = self.kv.free(SeqId(u64::from(seq)));
                if shadow == Shadow::Loading {
                    assert!(matches!(r, Err(Error::SequenceState { .. })));
                } else {
                    r.unwrap();
                    self.seqs.remove(&seq);
                }
            }
            Action::Store { max, now } => {
                if let Some(job) = self.kv.plan_host_store(usize::from(max)).unwrap() {
                    // The copy runs now; the completion comes now or later (async).
                    self.st.swap(&job.plan).unwrap();
                    if now {
                        self.kv.complete_swap(job.ticket).unwrap();
                    } else {
                        self.stores.push(job.ticket);
                    }
                }
            }
            Action::FinishStore { pick, ok } => {
                if self.stores.is_empty() {
                    return;
                }
                let t = self.stores.remove(usize::from(pick) % self.stores.len());
                if ok {
                    self.kv.complete_swap(t).unwrap();
                } else {
                    let before = self.kv.host_cache_stats().cached_blocks;
                    self.kv.abort_swap(t).unwrap();
                    assert_eq!(self.kv.host_cache_stats().cached_blocks, before);
                }
            }
            Action::FinishLoad { seq: pick, ok } => {
                let loading: Vec<u8> = self
                    .seqs
                    .iter()
                    .filter(|(_, &(_, s))| s == Shadow::Loading)
                    .map(|(&q, _)| q)
                    .collect();
                if loading.is_empty() {
                    return;
                }
                let seq = loading[usize::from(pick) % loading.len()];
                let pi = self.seqs[&seq].0;
                let id = SeqId(u64::from(seq));
                let job = self.kv.load_job(id).unwrap();
                let device = self.kv.num_computed_tokens(id).unwrap();
                if ok {
                    self.st.swap(&job.plan).unwrap();
                    self.kv.complete_swap(job.ticket).unwrap();
                    let n = self.kv.num_computed_tokens(id).unwrap();
                    assert_eq!(n, device + job.plan.len() * BS);
                    let table = self.kv.block_table(id).unwrap().to_vec();
                    check_values(&self.st, &table, &self.prompts[pi][..n]).unwrap();
                } else {
                    self.kv.abort_swap(job.ticket).unwrap();
                    assert_eq!(self.kv.num_computed_tokens(id).unwrap(), device);
                    assert_eq!(self.kv.num_tokens(id).unwrap(), device);
                }
                self.seqs.insert(seq, (pi, Shadow::Computed));
                self.finish_prompt(seq);
            }
            Action::EvictDevice { n } => {
                self.kv.evict_cached(usize::from(n));
            }
            Action::EvictHost { n } => {
                self.kv.evict_host_cache(usize::from(n)).unwrap();
            }
            Action::SwapOut { seq } => {
                let Some(&(pi, Shadow::Computed)) = self.seqs.get(&seq) else {
                    return;
                };
                let before = state(&self.kv);
                match self.kv.swap_out(SeqId(u64::from(seq))) {
                    Ok(job) => {
                        self.st.swap(&job.plan).unwrap();
                        self.kv.complete_swap(job.ticket).unwrap();
                        self.seqs.insert(seq, (pi, Shadow::Swapped));
                    }
                    Err(Error::TierFull { .. }) => assert_eq!(state(&self.kv), before),
                    Err(e) => panic!("swap out: {e}"),
                }
            }
            Action::SwapIn { seq } => {
                let Some(&(pi, Shadow::Swapped)) = self.seqs.get(&seq) else {
                    return;
                };
                let id = SeqId(u64::from(seq));
                match self.kv.swap_in(id) {
                    Ok(job) => {
                        self.st.swap(&job.plan).unwrap();
                        self.kv.complete_swap(job.ticket).unwrap();
                        self.seqs.insert(seq, (pi, Shadow::Computed));
                    }
                    Err(Error::OutOfBlocks { .. }) => {}
                    Err(e) => panic!("swap in: {e}"),
                }
            }
        }
    }

    /// Every computed sequence's bytes through its table.
    fn check_bytes(&self) {
        for (&seq, &(pi, shadow)) in &self.seqs {
            if shadow != Shadow::Computed {
                continue;
            }
            let id = SeqId(u64::from(seq));
            let table = self.kv.block_table(id).unwrap();
            let p = &self.prompts[pi];
            assert_eq!(self.kv.num_computed_tokens(id).unwrap(), p.len());
            check_values(&self.st, table, p)
                .unwrap_or_else(|layer| panic!("{id}: layer {layer} differs"));
        }
    }
}

proptest! {
    #![proptest_config(crate::support::proptest_config(128))]

    /// Random interleavings of admit / free / store / evict / load / complete / abort /
    /// swap against a shadow of which sequence holds which prompt: the invariants hold
    /// after every step and every computed sequence reads its prompt's bytes.
    #[test]
    fn interleavings_keep_bytes_and_invariants(
        actions in proptest::collection::vec(action(), 10..70),
        policy in 0..3u8,
    ) {
        let store = match policy {
            0 => HostStorePolicy::WriteThrough,
            1 => HostStorePolicy::WriteBack { ahead_blocks: 3 },
            _ => HostStorePolicy::Selective { min_hits: 1 },
        };
        let (kv, st) = setup(12, 8, store);
        let mut m = Model { kv, st, prompts: prompts(), seqs: BTreeMap::new(), stores: Vec::new() };
        for a in &actions {
            m.step(a);
            if let Err(e) = m.kv.check_invariants() {
                panic!("after {a:?}: {e}");
            }
            m.check_bytes();
        }
        // Every load still in flight ends, completed or aborted, and is checked.
        for pick in 0..8u8 {
            m.step(&Action::FinishLoad { seq: 0, ok: pick % 2 == 0 });
            if let Err(e) = m.kv.check_invariants() {
                panic!("after the final loads: {e}");
            }
            m.check_bytes();
        }
    }
}
