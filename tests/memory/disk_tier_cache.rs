//! The disk tier as the third level of the prefix cache: host entries stored to a
//! `DiskPrefixStore` (the manager keeps the index, the store the bytes), lookups that go
//! on device -> host -> disk, loads through staging host blocks that count as computed
//! only once they complete, a restart that serves the same bytes from a reopened tier
//! directory, corrupt or missing slots as typed misses, and the manager's index kept
//! equal to the store's through evictions. Bytes are checked through the block tables.

use crate::support::kv_bytes;
use crate::support::tiers::{
    assert_index_matches, flip, hit_of, layout, prompt, tiers, TempDir, BS,
};

use std::path::Path;

use kv_bytes::{check_values, write_values};
use pagedkv::executor::tier::{
    adopt_disk_store, load_prefix_from_host, load_prefix_from_tiers, spill_host_prefixes_to_disk,
    stage_disk_load, store_prefixes_to_host, DiskPrefixStore, TransferEngine, DISK_SLOT_ALIGN,
};
use pagedkv::ids::DiskSlot;
use pagedkv::manager::{DiskCacheConfig, DiskPlacement, DiskStorePolicy};
use pagedkv::pool::prefix::{BlockHash, Medium, PrefixEvent};
use pagedkv::{
    AdmitOptions, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape, SeqId,
    Storage, TierConfig,
};
use proptest::prelude::*;

fn setup(blocks: usize, host: usize) -> (KvCache, HostStorage) {
    setup_with(blocks, host)
}

fn setup_with(blocks: usize, host: usize) -> (KvCache, HostStorage) {
    let kv = KvCache::builder(layout())
        .num_blocks(blocks)
        .watermark_blocks(0)
        .record_events(true)
        .tiers(TierConfig {
            num_host_blocks: host,
            ..TierConfig::default()
        })
        .build()
        .unwrap();
    let storage = HostStorage::with_host_tier(layout(), blocks, host).unwrap();
    (kv, storage)
}

/// Admits `prompt` as `seq`, writes the K/V of every uncached token, frees it (its full
/// blocks stay cached on the device).
fn compute_and_free(kv: &mut KvCache, st: &mut HostStorage, seq: u64, prompt: &[u32]) {
    let mut slots = Vec::new();
    let a = kv
        .admit_tokens(SeqId(seq), prompt, &AdmitOptions::default(), &mut slots)
        .unwrap();
    write_values(st, &slots, &prompt[a.cached_tokens..]);
    kv.free(SeqId(seq)).unwrap();
}

/// Fills every free device block and every free host block with junk, so a block a
/// load did not write cannot hold the expected bytes by chance.
fn scrub(kv: &mut KvCache, st: &mut HostStorage) {
    let n = kv.pool().num_free() * BS;
    if n > 0 {
        let mut slots = Vec::new();
        kv.admit(SeqId(9_999), n, &mut slots).unwrap();
        let junk: Vec<u32> = (0..n as u32).map(|i| 0xdead_0000 + i).collect();
        write_values(st, &slots, &junk);
        kv.free(SeqId(9_999)).unwrap();
    }
    let junk = vec![0x5a; layout().block_bytes()];
    for b in 0..st.num_host_blocks() {
        st.write_host_block(pagedkv::BlockId(b as u32), &junk)
            .unwrap();
    }
}

fn disk_events(kv: &mut KvCache) -> (Vec<BlockHash>, Vec<BlockHash>) {
    let mut events = Vec::new();
    kv.drain_prefix_events(&mut events);
    let (mut stored, mut removed) = (Vec::new(), Vec::new());
    for e in events {
        match e {
            PrefixEvent::BlockStored {
                hash,
                medium: Medium::Disk,
                ..
            } => stored.push(hash),
            PrefixEvent::BlockRemoved {
                hash,
                medium: Medium::Disk,
                ..
            } => removed.push(hash),
            _ => {}
        }
    }
    (stored, removed)
}

/// Computes `p`, stores its full blocks to the host and from there to a new store in
/// `dir`; returns the hashes stored, in chain order.
fn fill_dir(dir: &Path, p: &[u32], capacity: usize) -> Vec<BlockHash> {
    let (mut kv, mut st) = setup(12, 8);
    let mut store = DiskPrefixStore::create(dir, &layout(), capacity).unwrap();
    compute_and_free(&mut kv, &mut st, 1, p);
    let full = p.len() / BS;
    assert_eq!(
        store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap(),
        full
    );
    let spill = spill_host_prefixes_to_disk(&mut kv, &st, &mut store, usize::MAX).unwrap();
    assert_eq!(spill.stored_blocks, full);
    kv.check_invariants().unwrap();
    assert_index_matches(&kv, &store);
    let (stored, removed) = disk_events(&mut kv);
    assert_eq!((stored.len(), removed.len()), (full, 0));
    // Chain order: parents first.
    let hashes: Vec<BlockHash> = store.entries().iter().map(|(_, e)| e.hash).collect();
    assert_eq!(hashes, stored);
    store.sync().unwrap();
    hashes
}

/// Reopens `dir` into a new cache and storage (as after a restart).
fn reopen(dir: &Path) -> (KvCache, HostStorage, DiskPrefixStore) {
    reopen_with(dir, 8)
}

fn reopen_with(dir: &Path, host: usize) -> (KvCache, HostStorage, DiskPrefixStore) {
    let (mut kv, mut st) = setup_with(12, host);
    let store = DiskPrefixStore::open(dir, &layout()).unwrap();
    let n = adopt_disk_store(&mut kv, &store).unwrap();
    assert_eq!(n, store.len());
    assert_eq!(kv.disk_cache_stats().adopted_blocks, n as u64);
    let (stored, removed) = disk_events(&mut kv);
    assert_eq!(
        (stored.len(), removed.len()),
        (n, 0),
        "adopted entries are announced"
    );
    kv.check_invariants().unwrap();
    scrub(&mut kv, &mut st);
    (kv, st, store)
}

// ---- restart ---------------------------------------------------------------------

/// Write K/V for a prompt, store it through the host to disk, drop everything,
/// reopen the tier directory into a new cache: the same prompt hits on disk, the load
/// counts as computed only once complete, and the bytes through the new table are the
/// prompt's.
#[test]
fn restart_serves_disk_hit_byte_exact() {
    let dir = TempDir::new();
    let p = prompt(17, 300); // 4 full blocks + 1 token
    fill_dir(&dir.0, &p, 16);

    let (mut kv, mut st, mut store) = reopen(&dir.0);
    let hit = hit_of(&kv, &p);
    assert_eq!(tiers(&hit), (0, 0, 16));
    assert_eq!(hit.total_tokens(), 16);
    assert!(kv.can_admit_hit(&hit));
    let a = kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    assert_eq!((a.cached_tokens, a.loading_tokens), (0, 16));
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 0);
    kv.check_invariants().unwrap();

    // The device copies may not complete before the disk part is staged.
    let job = kv.load_job(SeqId(2)).unwrap();
    assert!(matches!(
        kv.complete_swap(job.ticket),
        Err(Error::SequenceState { .. })
    ));
    // Nor may the host-only helper run it.
    assert!(matches!(
        load_prefix_from_host(&mut kv, &mut st, SeqId(2)),
        Err(Error::Unsupported(_))
    ));
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 0);
    kv.check_invariants().unwrap();
    assert_eq!(kv.disk_load_job(SeqId(2)).unwrap().items.len(), 4);

    assert_eq!(
        load_prefix_from_tiers(&mut kv, &mut st, &mut store, SeqId(2)).unwrap(),
        4
    );
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 16);
    let table = kv.block_table(SeqId(2)).unwrap().to_vec();
    check_values(&st, &table, &p[..16]).unwrap();
    // Staging blocks released, the disk copies stay, the blocks are on the device.
    assert!(kv.disk_load_job(SeqId(2)).is_none());
    assert_eq!(kv.disk_cache_stats().cached_blocks, 4);
    assert_eq!(
        kv.cached_prefix_len(&p, &AdmitOptions::default()).unwrap(),
        16
    );
    let d = kv.disk_cache_stats();
    assert_eq!((d.loaded_blocks, d.disk_hit_tokens), (4, 16));
    assert_eq!(kv.host_cache_stats().host_hit_tokens, 0);
    // The sequence goes on as any other.
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    kv.reserve(SeqId(2), 1, 0, &mut slots, &mut copies).unwrap();
    write_values(&mut st, &slots, &p[16..]);
    kv.commit(SeqId(2), 1).unwrap();
    check_values(&st, kv.block_table(SeqId(2)).unwrap(), &p).unwrap();
    kv.free(SeqId(2)).unwrap();
    kv.check_invariants().unwrap();
}

/// A hit across the three tiers, with the host entry's bytes intact: device, host and
/// disk parts load in one job, byte-exact, and each tier's hit tokens are counted.
#[test]
fn three_tier_load_is_byte_exact() {
    let dir = TempDir::new();
    let (mut kv, mut st) = setup(12, 8);
    let mut store = DiskPrefixStore::create(&dir.0, &layout(), 16).unwrap();
    let p = prompt(17, 500);
    compute_and_free(&mut kv, &mut st, 1, &p);
    store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
    spill_host_prefixes_to_disk(&mut kv, &st, &mut store, usize::MAX).unwrap();
    assert_eq!(kv.evict_host_cache(2).unwrap(), 2);
    assert_eq!(kv.evict_cached(3), 3);
    let (_, removed) = disk_events(&mut kv);
    assert!(
        removed.is_empty(),
        "host and device evictions leave the disk"
    );
    let before = kv.host_cache_stats().device_hit_tokens;

    let hit = hit_of(&kv, &p);
    assert_eq!(tiers(&hit), (4, 4, 8));
    let a = kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    assert_eq!((a.cached_tokens, a.loading_tokens), (4, 12));
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 4);
    kv.check_invariants().unwrap();
    assert_eq!(kv.load_job(SeqId(2)).unwrap().plan.len(), 3);
    assert_eq!(kv.disk_load_job(SeqId(2)).unwrap().items.len(), 2);
    assert_eq!(
        load_prefix_from_tiers(&mut kv, &mut st, &mut store, SeqId(2)).unwrap(),
        3
    );
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 16);
    check_values(&st, kv.block_table(SeqId(2)).unwrap(), &p[..16]).unwrap();
    let h = kv.host_cache_stats();
    assert_eq!(h.device_hit_tokens - before, 4);
    assert_eq!(h.host_hit_tokens, 4);
    assert_eq!(kv.disk_cache_stats().disk_hit_tokens, 8);
}

/// A disk part larger than the host tier can stage loads as far as staging blocks
/// go (the rest is computed); the one-call admission serves device hits only.
#[test]
fn staging_is_limited_by_host_tier() {
    let dir = TempDir::new();
    let p = prompt(17, 1_300);
    fill_dir(&dir.0, &p, 16);
    let (mut kv, mut st, mut store) = reopen_with(&dir.0, 2);
    let hit = hit_of(&kv, &p);
    assert_eq!(tiers(&hit), (0, 0, 16));
    let a = kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    assert_eq!(a.loading_tokens, 8);
    kv.check_invariants().unwrap();
    assert_eq!(
        load_prefix_from_tiers(&mut kv, &mut st, &mut store, SeqId(2)).unwrap(),
        2
    );
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 8);
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    kv.reserve(SeqId(2), 9, 0, &mut slots, &mut copies).unwrap();
    write_values(&mut st, &slots, &p[8..]);
    kv.commit(SeqId(2), 9).unwrap();
    check_values(&st, kv.block_table(SeqId(2)).unwrap(), &p).unwrap();
    kv.check_invariants().unwrap();
    // admit_tokens hands out slots at once: it computes the disk part again.
    let mut slots = Vec::new();
    drop(store);
    let q = prompt(17, 1_300);
    let (mut kv2, _, _) = reopen_with(&dir.0, 2);
    let a = kv2
        .admit_tokens(SeqId(3), &q, &AdmitOptions::default(), &mut slots)
        .unwrap();
    assert_eq!((a.cached_tokens, a.loading_tokens, slots.len()), (0, 0, 17));
    kv2.check_invariants().unwrap();
}

/// The host -> device part of a disk load runs on a `TransferEngine` once staged:
/// layer by layer, with per-layer readiness for attention, completed on the ticket.
#[test]
fn staged_disk_load_runs_on_transfer_engine() {
    let dir = TempDir::new();
    let p = prompt(13, 1_500);
    fill_dir(&dir.0, &p, 16);
    let (mut kv, st, mut store) = reopen(&dir.0);
    let hit = hit_of(&kv, &p);
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    let mut engine = TransferEngine::new(st);
    {
        let mut guard = engine.storage().lock();
        assert_eq!(
            stage_disk_load(&mut kv, &mut *guard, &mut store, SeqId(2)).unwrap(),
            3
        );
    }
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 0);
    let job = kv.load_job(SeqId(2)).unwrap();
    engine.submit(&job).unwrap();
    engine.wait(job.ticket).unwrap();
    for layer in 0..layout().num_layers() {
        assert!(engine.is_layer_ready(SeqId(2), layer));
    }
    kv.complete_swap(job.ticket).unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 12);
    let guard = engine.storage().lock();
    check_values(&*guard, kv.block_table(SeqId(2)).unwrap(), &p[..12]).unwrap();
    kv.check_invariants().unwrap();
}

// ---- misses: corrupt, missing, truncated -----------------------------------------

/// A flipped byte in a slot: the load fails with a typed checksum error and is a miss
/// (the sequence keeps what it had computed, no wrong byte counts), the entry leaves
/// the disk index with a Removed event, and a new lookup stops before it.
#[test]
fn corrupt_slot_is_a_typed_miss() {
    let dir = TempDir::new();
    let p = prompt(17, 700);
    let hashes = fill_dir(&dir.0, &p, 16);
    let (mut kv, mut st, mut store) = reopen(&dir.0);
    let bad = hashes[2];
    let slot = kv.disk_cache_slot(bad).unwrap();
    flip(
        &dir.0.join("slots.bin"),
        u64::from(slot.0) * DISK_SLOT_ALIGN + 9,
    );
    disk_events(&mut kv);

    let hit = hit_of(&kv, &p);
    assert_eq!(tiers(&hit), (0, 0, 16));
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    let err = load_prefix_from_tiers(&mut kv, &mut st, &mut store, SeqId(2)).unwrap_err();
    assert!(matches!(err, Error::Checksum { .. }), "{err:?}");
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 0);
    assert_eq!(kv.num_tokens(SeqId(2)).unwrap(), 0);
    assert!(kv.load_job(SeqId(2)).is_none());
    assert_eq!(kv.disk_cache_slot(bad), None);
    assert!(!store.contains(bad));
    assert_index_matches(&kv, &store);
    let (_, removed) = disk_events(&mut kv);
    assert_eq!(removed, vec![bad]);
    let d = kv.disk_cache_stats();
    assert_eq!(
        (d.dropped_blocks, d.loaded_blocks, d.disk_hit_tokens),
        (1, 0, 0)
    );
    // Only the blocks before it still hit.
    assert_eq!(tiers(&hit_of(&kv, &p)), (0, 0, 8));
    // The sequence computes the prompt itself and reads its own bytes.
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    kv.reserve(SeqId(2), p.len(), 0, &mut slots, &mut copies)
        .unwrap();
    write_values(&mut st, &slots, &p);
    kv.commit(SeqId(2), p.len()).unwrap();
    check_values(&st, kv.block_table(SeqId(2)).unwrap(), &p).unwrap();
    kv.free(SeqId(2)).unwrap();
    kv.check_invariants().unwrap();
}

/// An entry the store lost between admission and load (removed behind the manager's
/// back): a typed miss, and the entry leaves the index.
#[test]
fn missing_slot_is_a_typed_miss() {
    let dir = TempDir::new();
    let p = prompt(13, 900);
    let hashes = fill_dir(&dir.0, &p, 16);
    let (mut kv, mut st, mut store) = reopen(&dir.0);
    let hit = hit_of(&kv, &p);
    assert_eq!(tiers(&hit), (0, 0, 12));
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    store.remove(hashes[1]).unwrap().unwrap();
    let err = load_prefix_from_tiers(&mut kv, &mut st, &mut store, SeqId(2)).unwrap_err();
    assert_eq!(err, Error::DiskEntryMissing { hash: hashes[1].0 });
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 0);
    assert_eq!(kv.disk_cache_slot(hashes[1]), None);
    assert_index_matches(&kv, &store);
    assert_eq!(tiers(&hit_of(&kv, &p)), (0, 0, 4));
}

/// A journal cut inside its last record: the reopen drops that record, and the
/// entries before it still hit, byte-exact.
#[test]
fn truncated_journal_keeps_earlier_entries() {
    let dir = TempDir::new();
    let p = prompt(17, 1_100);
    fill_dir(&dir.0, &p, 16);
    let journal = dir.0.join("index.journal");
    let len = std::fs::metadata(&journal).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&journal)
        .unwrap()
        .set_len(len - 5)
        .unwrap();
    let (mut kv, mut st, mut store) = reopen(&dir.0);
    assert!(store.recovery().dropped_tail_bytes > 0);
    assert_eq!(store.len(), 3);
    let hit = hit_of(&kv, &p);
    assert_eq!(tiers(&hit), (0, 0, 12));
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    assert_eq!(
        load_prefix_from_tiers(&mut kv, &mut st, &mut store, SeqId(2)).unwrap(),
        3
    );
    check_values(&st, kv.block_table(SeqId(2)).unwrap(), &p[..12]).unwrap();
    kv.check_invariants().unwrap();
}

// ---- stores ----------------------------------------------------------------------

/// A second spill stores nothing again; a full store's evictions are mirrored in the
/// index with Disk-medium Removed events; the policies pick their entries.
#[test]
fn disk_stores_are_unique_and_evictions_mirrored() {
    let dir = TempDir::new();
    let (mut kv, mut st) = setup(16, 8);
    let mut store = DiskPrefixStore::create(&dir.0, &layout(), 3).unwrap();
    let a = prompt(9, 10); // 2 blocks
    let b = prompt(9, 60); // 2 blocks
    compute_and_free(&mut kv, &mut st, 1, &a);
    store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
    let s = spill_host_prefixes_to_disk(&mut kv, &st, &mut store, usize::MAX).unwrap();
    assert_eq!((s.stored_blocks, s.evicted_blocks), (2, 0));
    // Nothing new: no plan, no store call.
    let again = spill_host_prefixes_to_disk(&mut kv, &st, &mut store, usize::MAX).unwrap();
    assert_eq!(again.stored_blocks + again.already_present, 0);
    assert_eq!(store.stats().duplicate_stores, 0);
    disk_events(&mut kv);

    compute_and_free(&mut kv, &mut st, 2, &b);
    store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
    let s = spill_host_prefixes_to_disk(&mut kv, &st, &mut store, usize::MAX).unwrap();
    assert_eq!((s.stored_blocks, s.evicted_blocks), (2, 1));
    kv.check_invariants().unwrap();
    assert_index_matches(&kv, &store);
    let (stored, removed) = disk_events(&mut kv);
    assert_eq!((stored.len(), removed.len()), (2, 1));
    assert!(!store.contains(removed[0]));
    let d = kv.disk_cache_stats();
    assert_eq!(
        (d.stored_blocks, d.evicted_blocks, d.cached_blocks),
        (4, 1, 3)
    );
}

/// Write-back stores only the host entries nearest host eviction; a plan holds its
/// host entries (not evicted) until completed; a foreign placement is refused with
/// nothing changed; an empty completion aborts.
#[test]
fn disk_store_plans_hold_and_validate() {
    let (mut kv, mut st) = setup(16, 8);
    kv.set_disk_cache(DiskCacheConfig {
        store: DiskStorePolicy::WriteBack { ahead_blocks: 1 },
    })
    .unwrap();
    let p = prompt(13, 40); // 3 blocks
    compute_and_free(&mut kv, &mut st, 1, &p);
    store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
    let job = kv.plan_disk_store(usize::MAX).unwrap().unwrap();
    assert_eq!(job.items.len(), 1);
    kv.check_invariants().unwrap();
    // The host entry read is not evictable while the store is in flight.
    let held = job.items[0].entry.hash;
    kv.evict_host_cache(usize::MAX).unwrap();
    assert!(kv.host_cache_contains(held));
    kv.check_invariants().unwrap();
    let before = format!("{:?}", kv.disk_cache_stats());
    let foreign = DiskPlacement {
        hash: BlockHash(12_345),
        slot: DiskSlot(0),
        evicted: None,
    };
    assert!(matches!(
        kv.complete_disk_store(job.ticket, &[foreign]),
        Err(Error::CorruptBlockTable(_))
    ));
    assert_eq!(format!("{:?}", kv.disk_cache_stats()), before);
    kv.complete_disk_store(job.ticket, &[]).unwrap();
    assert_eq!(kv.disk_cache_stats().cached_blocks, 0);
    assert!(matches!(
        kv.complete_disk_store(job.ticket, &[]),
        Err(Error::UnknownTicket(_))
    ));
    kv.check_invariants().unwrap();
    assert!(kv.evict_host_cache(usize::MAX).unwrap() >= 1);
    kv.check_invariants().unwrap();
}

/// Adopting a store of another layout is refused with nothing changed; adopting the
/// same store twice takes nothing the second time.
#[test]
fn adopt_checks_layout_and_is_idempotent() {
    let dir = TempDir::new();
    let p = prompt(9, 77);
    fill_dir(&dir.0, &p, 8);
    let store = DiskPrefixStore::open(&dir.0, &layout()).unwrap();
    let other = KvLayout::new(
        ModelShape {
            num_layers: 1,
            num_q_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            kv_dtype: DType::F32,
        },
        BS,
    )
    .unwrap();
    let mut wrong = KvCache::builder(other).num_blocks(8).build().unwrap();
    assert!(matches!(
        adopt_disk_store(&mut wrong, &store),
        Err(Error::ShapeMismatch { .. })
    ));
    assert_eq!(wrong.disk_cache_stats().cached_blocks, 0);
    let (mut kv, _) = setup(12, 8);
    assert_eq!(adopt_disk_store(&mut kv, &store).unwrap(), 2);
    assert_eq!(adopt_disk_store(&mut kv, &store).unwrap(), 0);
    kv.check_invariants().unwrap();
    assert_index_matches(&kv, &store);
}

// ---- model-based interleaving ----------------------------------------------------

#[derive(Debug, Clone)]
enum Action {
    /// Admit prompt `i` through every tier, load what hits, compute the rest, check
    /// every byte through the table, free.
    Compute(usize),
    StoreHost(usize),
    SpillDisk(usize),
    EvictHost(usize),
    EvictDevice(usize),
    /// Drop cache, storage and store; reopen the tier directory into new ones.
    Reopen,
    /// Flip a byte in the slot of the `i`-th held disk entry.
    Corrupt(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => (0..4usize).prop_map(Action::Compute),
        2 => (1..6usize).prop_map(Action::StoreHost),
        2 => (1..6usize).prop_map(Action::SpillDisk),
        1 => (1..4usize).prop_map(Action::EvictHost),
        2 => (1..8usize).prop_map(Action::EvictDevice),
        1 => Just(Action::Reopen),
        1 => (0..8usize).prop_map(Action::Corrupt),
    ]
}

/// Four prompts that share leading blocks in pairs (values are the token ids, so a
/// shared block has the same bytes in every prompt).
fn model_prompt(i: usize) -> Vec<u32> {
    let mut p = prompt(8, 2_000 + (i as u32 / 2) * 100);
    p.extend(prompt(9, 3_000 + i as u32 * 100));
    p
}

fn run_model(actions: &[Action]) -> Result<(), TestCaseError> {
    let dir = TempDir::new();
    let fresh = || {
        let (kv, st) = setup_with(10, 4);
        (kv, st)
    };
    let (mut kv, mut st) = fresh();
    let mut store = DiskPrefixStore::create(&dir.0, &layout(), 6).unwrap();
    for a in actions {
        match *a {
            Action::Compute(i) => {
                let p = model_prompt(i);
                let hit = hit_of(&kv, &p);
                prop_assert!(hit.total_tokens() <= 16);
                if !kv.can_admit_hit(&hit) {
                    continue;
                }
                kv.admit_prompt(SeqId(1), &p, &hit).unwrap();
                match load_prefix_from_tiers(&mut kv, &mut st, &mut store, SeqId(1)) {
                    Ok(_) | Err(Error::Checksum { .. }) | Err(Error::DiskEntryMissing { .. }) => {}
                    Err(e) => prop_assert!(false, "load: {e:?}"),
                }
                kv.check_invariants().unwrap();
                let done = kv.num_computed_tokens(SeqId(1)).unwrap();
                prop_assert_eq!(kv.num_tokens(SeqId(1)).unwrap(), done);
                // Whatever counts as computed holds the prompt's bytes.
                check_values(&st, kv.block_table(SeqId(1)).unwrap(), &p[..done])
                    .map_err(|l| TestCaseError::fail(format!("layer {l} differs")))?;
                let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
                kv.reserve(SeqId(1), p.len() - done, 0, &mut slots, &mut copies)
                    .unwrap();
                prop_assert!(copies.is_empty());
                write_values(&mut st, &slots, &p[done..]);
                kv.commit(SeqId(1), p.len() - done).unwrap();
                check_values(&st, kv.block_table(SeqId(1)).unwrap(), &p)
                    .map_err(|l| TestCaseError::fail(format!("layer {l} differs")))?;
                kv.free(SeqId(1)).unwrap();
            }
            Action::StoreHost(n) => {
                store_prefixes_to_host(&mut kv, &mut st, n).unwrap();
            }
            Action::SpillDisk(n) => {
                spill_host_prefixes_to_disk(&mut kv, &st, &mut store, n).unwrap();
            }
            Action::EvictHost(n) => {
                kv.evict_host_cache(n).unwrap();
            }
            Action::EvictDevice(n) => {
                kv.evict_cached(n);
            }
            Action::Reopen => {
                drop(store);
                (kv, st) = fresh();
                store = DiskPrefixStore::open(&dir.0, &layout()).unwrap();
                adopt_disk_store(&mut kv, &store).unwrap();
            }
            Action::Corrupt(i) => {
                let entries: Vec<DiskSlot> = store.entries().iter().map(|(s, _)| *s).collect();
                if let Some(slot) = entries.get(i % entries.len().max(1)) {
                    flip(
                        &dir.0.join("slots.bin"),
                        u64::from(slot.0) * DISK_SLOT_ALIGN + 3,
                    );
                }
            }
        }
        kv.check_invariants().unwrap();
        assert_index_matches(&kv, &store);
    }
    Ok(())
}

proptest! {
    #![proptest_config(crate::support::proptest_config(48))]

    /// Any interleaving of computes, stores, spills, evictions, restarts and corrupt
    /// slots: the invariants hold, the manager's disk index equals the store's, and
    /// every computed token holds its prompt's bytes.
    #[test]
    fn tiers_interleave_with_a_byte_shadow(actions in proptest::collection::vec(action(), 1..40)) {
        run_model(&actions)?;
    }
}
