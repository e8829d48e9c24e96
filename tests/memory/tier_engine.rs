//! The disk level's file I/O on the `TransferEngine`'s worker: stores and disk -> host
//! stagings submitted as jobs and completed by polling while the caller keeps
//! stepping other sequences; I/O and checksum failures coming back through the poll
//! and leaving the manager exactly as the synchronous helpers do; the in-flight byte
//! budget (refused submissions change nothing, room comes back with completions).

use crate::support::kv_bytes;
use crate::support::snapshot;
use crate::support::tiers::{assert_index_matches, flip, hit_of, layout, prompt, tiers, TempDir};

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_bytes::{check_values, write_values};
use pagedkv::executor::tier::{
    adopt_disk_store, complete_disk_jobs, load_prefix_from_tiers, spill_host_prefixes_to_disk,
    store_prefixes_to_host, submit_disk_stage, submit_disk_store, DiskJobReport, DiskPrefixStore,
    TransferEngine, DISK_SLOT_ALIGN,
};
use pagedkv::pool::prefix::BlockHash;
use pagedkv::{AdmitOptions, CopyPlan, Error, HostStorage, KvCache, SeqId, Storage, TierConfig};

fn setup(blocks: usize, host: usize) -> (KvCache, HostStorage) {
    let kv = KvCache::builder(layout())
        .num_blocks(blocks)
        .watermark_blocks(0)
        .tiers(TierConfig {
            num_host_blocks: host,
            ..TierConfig::default()
        })
        .build()
        .unwrap();
    let storage = HostStorage::with_host_tier(layout(), blocks, host).unwrap();
    (kv, storage)
}

/// Admits `prompt` as `seq`, writes the K/V of every uncached token, frees it.
fn compute_and_free<S: Storage + ?Sized>(kv: &mut KvCache, st: &mut S, seq: u64, prompt: &[u32]) {
    let mut slots = Vec::new();
    let a = kv
        .admit_tokens(SeqId(seq), prompt, &AdmitOptions::default(), &mut slots)
        .unwrap();
    write_values(st, &slots, &prompt[a.cached_tokens..]);
    kv.free(SeqId(seq)).unwrap();
}

/// One step of another sequence: reserve `n` tokens, write them, commit.
fn step_other<S: Storage + ?Sized>(kv: &mut KvCache, st: &mut S, seq: u64, values: &[u32]) {
    if kv.num_tokens(SeqId(seq)).is_err() {
        kv.admit(SeqId(seq), 0, &mut Vec::new()).unwrap();
    }
    let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
    kv.reserve(SeqId(seq), values.len(), 0, &mut slots, &mut copies)
        .unwrap();
    write_values(st, &slots, values);
    kv.commit(SeqId(seq), values.len()).unwrap();
}

/// Everything observable, with the host and disk levels' entries and work in flight.
fn state(kv: &KvCache) -> String {
    let h = kv.host_cache_stats();
    format!(
        "{}host {} in flight {}/{}\ndisk {:?}",
        snapshot::snapshot(kv),
        h.cached_blocks,
        h.stores_in_flight,
        h.loads_in_flight,
        kv.disk_cache_stats()
    )
}

/// Polls until `n` disk jobs have been reported, completing each on the manager.
fn complete_n(
    kv: &mut KvCache,
    engine: &mut TransferEngine<HostStorage>,
    n: usize,
) -> Vec<DiskJobReport> {
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < n {
        assert!(start.elapsed() < Duration::from_secs(20), "worker stuck");
        out.extend(complete_disk_jobs(kv, engine).unwrap());
        std::thread::sleep(Duration::from_millis(1));
    }
    out
}

/// Computes `p`, stores it to the host and (synchronously) to a new store in `dir`.
fn fill_dir(dir: &Path, p: &[u32]) -> Vec<BlockHash> {
    let (mut kv, mut st) = setup(12, 8);
    let mut store = DiskPrefixStore::create(dir, &layout(), 16).unwrap();
    compute_and_free(&mut kv, &mut st, 1, p);
    store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
    spill_host_prefixes_to_disk(&mut kv, &st, &mut store, usize::MAX).unwrap();
    store.sync().unwrap();
    store.entries().iter().map(|(_, e)| e.hash).collect()
}

/// A restart over `dir`: a new cache, storage and store, the store's entries adopted.
fn reopen(dir: &Path) -> (KvCache, HostStorage, DiskPrefixStore) {
    let (mut kv, st) = setup(12, 8);
    let store = DiskPrefixStore::open(dir, &layout()).unwrap();
    adopt_disk_store(&mut kv, &store).unwrap();
    (kv, st, store)
}

// ---- the worker does the file I/O ----------------------------------------------------

/// A store to disk and a staging from disk run on the worker: while the store's lock
/// is held (the worker is stuck in "file I/O"), the caller keeps reserving, writing
/// and committing another sequence and nothing is reported; once released, polling
/// completes each job on the manager, and the loaded prompt is byte-exact.
#[test]
fn disk_store_and_load_run_on_the_worker_while_other_sequences_step() {
    let dir = TempDir::new();
    let (mut kv, st) = setup(16, 8);
    let mut engine = TransferEngine::new(st);
    engine.attach_disk_store(DiskPrefixStore::create(&dir.0, &layout(), 16).unwrap());
    let disk = Arc::clone(engine.disk_store());
    let p = prompt(17, 100);
    {
        let mut st = engine.storage().lock();
        compute_and_free(&mut kv, &mut *st, 1, &p);
        assert_eq!(
            store_prefixes_to_host(&mut kv, &mut *st, usize::MAX).unwrap(),
            4
        );
    }

    // Store: the worker waits on the store's lock; the step goes on.
    let held = disk.lock();
    let ticket = submit_disk_store(&mut kv, &mut engine, usize::MAX)
        .unwrap()
        .unwrap();
    assert_eq!(kv.disk_cache_stats().stores_in_flight, 1);
    let other = prompt(12, 7_000);
    for chunk in other.chunks(4) {
        let mut st = engine.storage().lock();
        step_other(&mut kv, &mut *st, 50, chunk);
        drop(st);
        assert!(complete_disk_jobs(&mut kv, &mut engine).unwrap().is_empty());
    }
    assert_eq!(engine.disk_jobs_in_flight(), 1);
    assert_eq!(engine.in_flight_bytes(), 4 * layout().block_bytes() as u64);
    drop(held);
    let reports = complete_n(&mut kv, &mut engine, 1);
    match &reports[0] {
        DiskJobReport::Store {
            ticket: t,
            spill,
            error,
            bytes,
            ..
        } => {
            assert_eq!(*t, ticket);
            assert_eq!((spill.stored_blocks, error), (4, &None));
            assert_eq!(*bytes, 4 * layout().block_bytes() as u64);
        }
        r => panic!("{r:?}"),
    }
    assert_eq!(engine.in_flight_bytes(), 0);
    kv.check_invariants().unwrap();
    assert_index_matches(&kv, disk.lock().as_ref().unwrap());
    assert_eq!(kv.disk_cache_stats().stored_blocks, 4);

    // Only the disk holds the prompt now.
    kv.evict_host_cache(usize::MAX).unwrap();
    kv.evict_cached(usize::MAX);
    let hit = hit_of(&kv, &p);
    assert_eq!(tiers(&hit), (0, 0, 16));
    kv.admit_prompt(SeqId(2), &p, &hit).unwrap();
    let held = disk.lock();
    let ticket = submit_disk_stage(&mut kv, &mut engine, SeqId(2))
        .unwrap()
        .unwrap();
    for chunk in prompt(8, 7_012).chunks(4) {
        let mut st = engine.storage().lock();
        step_other(&mut kv, &mut *st, 50, chunk);
        drop(st);
        assert!(complete_disk_jobs(&mut kv, &mut engine).unwrap().is_empty());
    }
    assert!(kv.load_job(SeqId(2)).is_some());
    drop(held);
    let reports = complete_n(&mut kv, &mut engine, 1);
    assert!(
        matches!(&reports[0], DiskJobReport::Stage { ticket: t, result: Ok(4), drop_entry: None, .. } if *t == ticket),
        "{reports:?}"
    );
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 0);
    let job = kv.load_job(SeqId(2)).unwrap();
    engine.submit(&job).unwrap();
    engine.wait(job.ticket).unwrap();
    assert_eq!(engine.poll_completed(), vec![(job.ticket, Ok(()))]);
    kv.complete_swap(job.ticket).unwrap();
    assert_eq!(kv.num_computed_tokens(SeqId(2)).unwrap(), 16);
    assert_eq!(kv.disk_cache_stats().disk_hit_tokens, 16);
    let st = engine.storage().lock();
    check_values(&*st, kv.block_table(SeqId(2)).unwrap(), &p[..16]).unwrap();
    let mut all = other.clone();
    all.extend(prompt(8, 7_012));
    check_values(&*st, kv.block_table(SeqId(50)).unwrap(), &all).unwrap();
    drop(st);
    kv.check_invariants().unwrap();
}

// ---- failures through the poll ---------------------------------------------------

/// Runs the load of `p` from `dir` synchronously and through the engine, after
/// `damage` on each of two identical directories; returns the two errors and states.
fn sync_vs_engine(p: &[u32], damage: impl Fn(&Path, &KvCache)) -> [(Error, String); 2] {
    let dirs = [TempDir::new(), TempDir::new()];
    for d in &dirs {
        fill_dir(&d.0, p);
    }
    // Synchronous.
    let (mut kv, mut st, mut store) = reopen(&dirs[0].0);
    damage(&dirs[0].0, &kv);
    let hit = hit_of(&kv, p);
    kv.admit_prompt(SeqId(2), p, &hit).unwrap();
    let e_sync = load_prefix_from_tiers(&mut kv, &mut st, &mut store, SeqId(2)).unwrap_err();
    kv.check_invariants().unwrap();
    assert_index_matches(&kv, &store);
    let s_sync = state(&kv);
    // Through the engine.
    let (mut kv, st, store) = reopen(&dirs[1].0);
    damage(&dirs[1].0, &kv);
    let mut engine = TransferEngine::new(st);
    engine.attach_disk_store(store);
    let hit = hit_of(&kv, p);
    kv.admit_prompt(SeqId(2), p, &hit).unwrap();
    submit_disk_stage(&mut kv, &mut engine, SeqId(2))
        .unwrap()
        .unwrap();
    let reports = complete_n(&mut kv, &mut engine, 1);
    let DiskJobReport::Stage {
        result: Err(e_engine),
        ..
    } = &reports[0]
    else {
        panic!("{reports:?}")
    };
    assert!(kv.load_job(SeqId(2)).is_none(), "the load was aborted");
    kv.check_invariants().unwrap();
    assert_index_matches(&kv, engine.disk_store().lock().as_ref().unwrap());
    [(e_sync, s_sync), (e_engine.clone(), state(&kv))]
}

/// A flipped byte in a slot: the checksum error comes back through the poll, the load
/// is aborted and the entry dropped, exactly as `load_prefix_from_tiers` leaves it.
#[test]
fn checksum_failure_through_the_poll_matches_the_synchronous_helper() {
    let p = prompt(17, 300);
    let [(e_sync, s_sync), (e_engine, s_engine)] = sync_vs_engine(&p, |dir, kv| {
        let bad = hit_of(kv, &p);
        assert_eq!(tiers(&bad), (0, 0, 16));
        let hashes = DiskPrefixStore::open(dir, &layout()).unwrap();
        let third = hashes.entries()[2].1.hash;
        let slot = kv.disk_cache_slot(third).unwrap();
        flip(
            &dir.join("slots.bin"),
            u64::from(slot.0) * DISK_SLOT_ALIGN + 9,
        );
    });
    assert!(matches!(e_sync, Error::Checksum { .. }), "{e_sync:?}");
    assert_eq!(e_engine, e_sync);
    assert_eq!(s_engine, s_sync);
    assert!(s_engine.contains("dropped_blocks: 1"), "{s_engine}");
}

/// The slots file cut short under an open store: an I/O error through the poll, the
/// load aborted and the entries kept, as the synchronous helper leaves them.
#[test]
fn io_failure_through_the_poll_matches_the_synchronous_helper() {
    let p = prompt(13, 600);
    let [(e_sync, s_sync), (e_engine, s_engine)] = sync_vs_engine(&p, |dir, _| {
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("slots.bin"))
            .unwrap()
            .set_len(0)
            .unwrap();
    });
    assert!(matches!(e_sync, Error::Io(_)), "{e_sync:?}");
    assert_eq!(e_engine, e_sync);
    assert_eq!(s_engine, s_sync);
    assert!(s_engine.contains("dropped_blocks: 0"), "{s_engine}");
}

// ---- backpressure ----------------------------------------------------------------

/// With a budget of three blocks: a first store of one block is taken, the next store
/// is clamped to the two blocks left, a third store and a staging are refused with
/// `TransferBudget` and change nothing; once the completions are polled the budget
/// has room again. A job larger than the whole budget runs alone.
#[test]
fn in_flight_budget_refuses_and_clamps() {
    let dir = TempDir::new();
    let (mut kv, st) = setup(24, 16);
    let bb = layout().block_bytes() as u64;
    let mut engine = TransferEngine::new(st);
    engine.attach_disk_store(DiskPrefixStore::create(&dir.0, &layout(), 32).unwrap());
    engine.set_in_flight_budget(Some(3 * bb));
    let disk = Arc::clone(engine.disk_store());
    let (p, q) = (prompt(25, 100), prompt(9, 900));
    {
        let mut st = engine.storage().lock();
        compute_and_free(&mut kv, &mut *st, 1, &p);
        compute_and_free(&mut kv, &mut *st, 2, &q);
        assert_eq!(
            store_prefixes_to_host(&mut kv, &mut *st, usize::MAX).unwrap(),
            8
        );
    }
    let held = disk.lock();
    submit_disk_store(&mut kv, &mut engine, 1).unwrap().unwrap();
    assert_eq!(engine.budget_room_blocks(), 2);
    submit_disk_store(&mut kv, &mut engine, usize::MAX)
        .unwrap()
        .unwrap();
    assert_eq!(kv.disk_cache_stats().stores_in_flight, 2);
    assert_eq!(engine.in_flight_bytes(), 3 * bb);
    let before = state(&kv);
    let err = submit_disk_store(&mut kv, &mut engine, usize::MAX).unwrap_err();
    assert_eq!(
        err,
        Error::TransferBudget {
            needed: bb,
            in_flight: 3 * bb,
            budget: 3 * bb
        }
    );
    assert_eq!(state(&kv), before);
    assert_eq!(
        (engine.disk_jobs_in_flight(), engine.in_flight_bytes()),
        (2, 3 * bb)
    );
    // A swap past the budget is refused the same way.
    kv.admit(SeqId(9), 4, &mut Vec::new()).unwrap();
    let before = state(&kv);
    let swap = kv.swap_out(SeqId(9)).unwrap();
    assert!(matches!(
        engine.submit(&swap).unwrap_err(),
        Error::TransferBudget { .. }
    ));
    kv.abort_swap(swap.ticket).unwrap();
    assert_eq!(state(&kv), before);
    drop(held);
    let reports = complete_n(&mut kv, &mut engine, 2);
    let stored: Vec<usize> = reports
        .iter()
        .map(|r| match r {
            DiskJobReport::Store { spill, .. } => spill.stored_blocks,
            r => panic!("{r:?}"),
        })
        .collect();
    assert_eq!(stored, vec![1, 2]);
    assert_eq!(engine.in_flight_bytes(), 0);
    kv.check_invariants().unwrap();

    // Nothing in flight: the rest (5 blocks, more than the budget) runs alone.
    let held = disk.lock();
    submit_disk_store(&mut kv, &mut engine, usize::MAX)
        .unwrap()
        .unwrap();
    assert_eq!(engine.in_flight_bytes(), 5 * bb);
    kv.evict_cached(usize::MAX);
    let hit = hit_of(&kv, &q);
    assert_eq!(tiers(&hit), (0, 8, 0));
    drop(held);
    complete_n(&mut kv, &mut engine, 1);
    assert_index_matches(&kv, disk.lock().as_ref().unwrap());
    kv.evict_host_cache(usize::MAX).unwrap();
    let hit = hit_of(&kv, &p);
    assert_eq!(tiers(&hit), (0, 0, 24));
    kv.admit_prompt(SeqId(3), &p, &hit).unwrap();
    let held = disk.lock();
    let hit_q = hit_of(&kv, &q);
    kv.admit_prompt(SeqId(4), &q, &hit_q).unwrap();
    submit_disk_stage(&mut kv, &mut engine, SeqId(3))
        .unwrap()
        .unwrap();
    let before = state(&kv);
    assert!(matches!(
        submit_disk_stage(&mut kv, &mut engine, SeqId(4)).unwrap_err(),
        Error::TransferBudget { .. }
    ));
    assert_eq!(state(&kv), before);
    drop(held);
    complete_n(&mut kv, &mut engine, 1);
    // Room again: the refused staging goes through.
    submit_disk_stage(&mut kv, &mut engine, SeqId(4))
        .unwrap()
        .unwrap();
    let reports = complete_n(&mut kv, &mut engine, 1);
    assert!(
        matches!(reports[0], DiskJobReport::Stage { result: Ok(2), .. }),
        "{reports:?}"
    );
    kv.check_invariants().unwrap();
}

/// Without an attached store a submission is refused and changes nothing.
#[test]
fn submissions_without_a_store_change_nothing() {
    let (mut kv, mut st) = setup(8, 8);
    compute_and_free(&mut kv, &mut st, 1, &prompt(9, 1));
    store_prefixes_to_host(&mut kv, &mut st, usize::MAX).unwrap();
    let mut engine = TransferEngine::new(st);
    let before = state(&kv);
    assert!(matches!(
        submit_disk_store(&mut kv, &mut engine, usize::MAX).unwrap_err(),
        Error::Unsupported(_)
    ));
    assert_eq!(state(&kv), before);
}
