//! The transfer paths under storage faults: a copy that fails partway through a swap-out
//! or swap-in run by the `TransferEngine` (per-layer and whole-plan backends, single
//! sequences and fork groups), a disk spill or restore, a prefix-cache spill or restore.
//! Each time: the failure is reported, the sequence goes back to a state it can be
//! retried or freed from with the manager exactly as before (snapshot), every byte
//! intact, invariants hold; then the retry succeeds and the bytes read back.

use crate::support::faulty_storage;
use crate::support::kv_bytes;
use crate::support::snapshot;

use std::collections::BTreeMap;
use std::path::PathBuf;

use faulty_storage::FlakyStorage;
use kv_bytes::{check_values, write_values};
use pagedkv::executor::tier::{restore_spilled_prefixes, spill_cached_prefixes};
use pagedkv::executor::tier::{DiskTier, TransferEngine};
use pagedkv::executor::{restore_from_disk, spill_to_disk};
use pagedkv::ids::SwapTicket;
use pagedkv::manager::SwapJob;
use pagedkv::{
    AdmitOptions, CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape,
    SeqId, Storage, TierConfig,
};
use snapshot::snapshot;

const LAYERS: usize = 3;
const DEVICE: usize = 16;
const HOST: usize = 16;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: LAYERS,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    KvLayout::new(shape, 4).unwrap()
}

fn manager(disk_slots: usize) -> KvCache {
    let mut config = CacheConfig::new(DEVICE);
    config.watermark_blocks = 0;
    let tiers = TierConfig {
        num_host_blocks: HOST,
        num_disk_slots: disk_slots,
    };
    KvCache::with_tiers(layout(), config, tiers).unwrap()
}

fn flaky(per_layer: bool) -> FlakyStorage {
    FlakyStorage::new(
        HostStorage::with_host_tier(layout(), DEVICE, HOST).unwrap(),
        per_layer,
    )
}

/// A manager, its storage behind a transfer engine, and every live sequence's token
/// values (what its K/V bytes must hold).
struct Rig {
    kv: KvCache,
    engine: TransferEngine<FlakyStorage>,
    values: BTreeMap<SeqId, Vec<u32>>,
    next: u32,
}

impl Rig {
    fn new(per_layer: bool) -> Self {
        Rig {
            kv: manager(0),
            engine: TransferEngine::new(flaky(per_layer)),
            values: BTreeMap::new(),
            next: 1,
        }
    }

    fn fresh(&mut self, n: usize) -> Vec<u32> {
        let v: Vec<u32> = (self.next..self.next + n as u32).collect();
        self.next += n as u32;
        v
    }

    fn admit(&mut self, seq: SeqId, n: usize) {
        let mut slots = Vec::new();
        self.kv.admit(seq, n, &mut slots).unwrap();
        let values = self.fresh(n);
        write_values(&mut *self.engine.storage().lock(), &slots, &values);
        self.values.insert(seq, values);
    }

    fn append(&mut self, seq: SeqId, n: usize) {
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        self.kv.append(seq, n, &mut slots, &mut copies).unwrap();
        let values = self.fresh(n);
        let mut st = self.engine.storage().lock();
        st.copy_blocks(&copies).unwrap();
        write_values(&mut *st, &slots, &values);
        self.values.get_mut(&seq).unwrap().extend(values);
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) {
        self.kv.fork(parent, child).unwrap();
        let v = self.values[&parent].clone();
        self.values.insert(child, v);
    }

    /// Submits `job`, waits, and returns the outcome `poll_completed` reports for it.
    fn run(&mut self, job: &SwapJob) -> pagedkv::Result<()> {
        self.engine.submit(job).unwrap();
        let waited = self.engine.wait(job.ticket);
        let done = self.engine.poll_completed();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].0, job.ticket);
        assert_eq!(done[0].1, waited, "wait and poll_completed disagree");
        waited
    }

    /// Runs `job`; completes it on success, aborts it on failure.
    fn finish(&mut self, job: &SwapJob) -> pagedkv::Result<()> {
        match self.run(job) {
            Ok(()) => {
                self.kv.complete_swap(job.ticket).unwrap();
                Ok(())
            }
            Err(e) => {
                self.kv.abort_swap(job.ticket).unwrap();
                Err(e)
            }
        }
    }

    /// Every resident sequence's bytes, and the manager's invariants.
    fn check(&self) {
        self.kv.check_invariants().unwrap();
        let st = self.engine.storage().lock();
        for (seq, values) in &self.values {
            if self.kv.is_swapped(*seq) {
                continue;
            }
            let table = self.kv.block_table(*seq).unwrap();
            assert_eq!(check_values(&*st, table, values), Ok(()), "{seq} bytes");
        }
    }

    fn fail_next_swap(&self, at_layer: usize) {
        let mut st = self.engine.storage().lock();
        st.swap_failures = 1;
        st.fail_at_layer = at_layer;
    }
}

fn is_simulated(r: pagedkv::Result<()>) -> bool {
    matches!(r, Err(Error::Cuda(m)) if m.contains("simulated"))
}

/// A swap-out that fails partway (at each layer of a per-layer backend, or halfway
/// through a whole-plan one) leaves the sequences resident as before; a second
/// sequence decodes on; the retry swaps out, and the swap-in brings every byte back.
#[test]
fn a_swap_out_failing_partway_leaves_the_sequences_resident_and_retries() {
    for (per_layer, at_layer) in [(true, 0), (true, 1), (true, 2), (false, 0)] {
        let mut r = Rig::new(per_layer);
        r.admit(SeqId(1), 10);
        r.fork(SeqId(1), SeqId(2));
        r.append(SeqId(2), 3);
        r.admit(SeqId(3), 5);
        let before = snapshot(&r.kv);
        r.fail_next_swap(at_layer);
        let job = r.kv.swap_out_group(&[SeqId(1), SeqId(2)]).unwrap();
        assert!(is_simulated(r.finish(&job)), "layer {at_layer}");
        assert_eq!(
            snapshot(&r.kv),
            before,
            "per_layer {per_layer} at {at_layer}"
        );
        assert!(!r.kv.is_swapped(SeqId(1)) && r.kv.swap_in_flight(SeqId(1)).is_none());
        r.check();
        // The engine forgot the job: nothing waits on it.
        assert!(r.engine.is_layer_ready(SeqId(1), LAYERS - 1));
        assert!(matches!(
            r.engine.wait(job.ticket),
            Err(Error::UnknownTicket(_))
        ));

        // The sequences stay usable: one decodes, then the group swaps out for real.
        r.append(SeqId(1), 2);
        r.append(SeqId(3), 1);
        r.check();
        let job = r.kv.swap_out_group(&[SeqId(1), SeqId(2)]).unwrap();
        r.finish(&job).unwrap();
        assert!(r.kv.is_swapped(SeqId(1)) && r.kv.is_swapped(SeqId(2)));
        r.check();
        let job = r.kv.swap_in_group(&[SeqId(1), SeqId(2)]).unwrap();
        r.finish(&job).unwrap();
        r.check();
        for s in [1, 2, 3] {
            r.kv.free(SeqId(s)).unwrap();
        }
        assert_eq!(r.kv.stats().used_blocks, 0);
        assert_eq!(r.kv.tier_stats().host_used_blocks, 0);
    }
}

/// A swap-in that fails partway has written some of the device blocks it was given;
/// the abort frees them and keeps the host copy, which another sequence's writes into
/// the freed blocks cannot touch. The retry brings back every byte; or the swapped
/// sequence is freed, leaving nothing behind.
#[test]
fn a_swap_in_failing_partway_keeps_the_host_copy_and_retries_or_frees() {
    for (per_layer, at_layer, retry) in [
        (true, 1, true),
        (true, 2, false),
        (false, 0, true),
        (false, 0, false),
    ] {
        let mut r = Rig::new(per_layer);
        r.admit(SeqId(1), 13);
        r.fork(SeqId(1), SeqId(2));
        r.append(SeqId(1), 2);
        let job = r.kv.swap_out_group(&[SeqId(1), SeqId(2)]).unwrap();
        r.finish(&job).unwrap();
        let swapped = snapshot(&r.kv);
        r.fail_next_swap(at_layer);
        let job = r.kv.swap_in_group(&[SeqId(1), SeqId(2)]).unwrap();
        assert!(is_simulated(r.finish(&job)));
        assert_eq!(
            snapshot(&r.kv),
            swapped,
            "per_layer {per_layer} at {at_layer}"
        );
        r.check();
        // Another sequence takes the device blocks the failed swap-in wrote.
        r.admit(SeqId(3), 4 * DEVICE - 20);
        r.check();
        r.kv.free(SeqId(3)).unwrap();
        r.values.remove(&SeqId(3));
        if retry {
            let job = r.kv.swap_in_group(&[SeqId(1), SeqId(2)]).unwrap();
            r.finish(&job).unwrap();
            assert!(!r.kv.is_swapped(SeqId(1)) && !r.kv.is_swapped(SeqId(2)));
            r.check();
            r.append(SeqId(2), 1);
            r.check();
        }
        for s in [1, 2] {
            r.kv.free(SeqId(s)).unwrap();
        }
        r.kv.check_invariants().unwrap();
        assert_eq!(r.kv.stats().used_blocks, 0);
        assert_eq!(r.kv.tier_stats().host_used_blocks, 0);
    }
}

/// One failing job does not disturb the jobs queued behind it on the same worker.
#[test]
fn a_failed_job_does_not_disturb_the_next_in_the_queue() {
    let mut r = Rig::new(true);
    r.admit(SeqId(1), 9);
    r.admit(SeqId(2), 7);
    r.fail_next_swap(1);
    let a = r.kv.swap_out(SeqId(1)).unwrap();
    let b = r.kv.swap_out(SeqId(2)).unwrap();
    r.engine.submit(&a).unwrap();
    r.engine.submit(&b).unwrap();
    assert!(is_simulated(r.engine.wait(a.ticket)));
    r.engine.wait(b.ticket).unwrap();
    let done: Vec<(SwapTicket, bool)> = r
        .engine
        .poll_completed()
        .into_iter()
        .map(|(t, res)| (t, res.is_ok()))
        .collect();
    assert_eq!(done, vec![(a.ticket, false), (b.ticket, true)]);
    r.kv.abort_swap(a.ticket).unwrap();
    r.kv.complete_swap(b.ticket).unwrap();
    assert!(!r.kv.is_swapped(SeqId(1)) && r.kv.is_swapped(SeqId(2)));
    r.check();
    let back = r.kv.swap_in(SeqId(2)).unwrap();
    r.finish(&back).unwrap();
    assert!(!r.kv.is_swapped(SeqId(2)));
    r.check();
}

/// A disk-tier file in the temp dir, removed on drop.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A disk spill whose host-tier reads fail after some blocks went to disk, and a disk
/// restore whose host-tier writes fail after some blocks came back: each leaves the
/// sequences where they were; the retries succeed and the swap-in reads every byte.
#[test]
fn a_disk_spill_or_restore_failing_partway_changes_nothing_and_retries() {
    let file = TempFile(
        std::env::temp_dir().join(format!("pagedkv-transfer-faults-{}", std::process::id())),
    );
    let mut disk = DiskTier::create(&file.0, &layout(), 8).unwrap();
    let mut kv = manager(8);
    let mut st = flaky(true);
    let mut slots = Vec::new();
    kv.admit(SeqId(1), 10, &mut slots).unwrap();
    let a: Vec<u32> = (100..110).collect();
    write_values(&mut st, &slots, &a);
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    kv.admit(SeqId(3), 6, &mut slots).unwrap();
    let c: Vec<u32> = (200..206).collect();
    write_values(&mut st, &slots, &c);
    let job = kv.swap_out_group(&[SeqId(1), SeqId(2)]).unwrap();
    st.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();

    let before = snapshot(&kv);
    for ok_blocks in [0, 1, 2] {
        st.fail_host_io_after(ok_blocks);
        let e = spill_to_disk(&mut kv, &[SeqId(1), SeqId(2)], &st, &mut disk);
        assert!(matches!(e, Err(Error::Io(_))), "{e:?}");
        assert_eq!(snapshot(&kv), before, "spill failing after {ok_blocks}");
        kv.check_invariants().unwrap();
    }
    assert_eq!(
        spill_to_disk(&mut kv, &[SeqId(1), SeqId(2)], &st, &mut disk),
        Ok(3)
    );
    kv.check_invariants().unwrap();

    let spilled = snapshot(&kv);
    for ok_blocks in [0, 2] {
        st.fail_host_io_after(ok_blocks);
        let e = restore_from_disk(&mut kv, &[SeqId(1), SeqId(2)], &mut st, &disk);
        assert!(matches!(e, Err(Error::Io(_))), "{e:?}");
        assert_eq!(snapshot(&kv), spilled, "restore failing after {ok_blocks}");
        kv.check_invariants().unwrap();
    }
    assert_eq!(
        restore_from_disk(&mut kv, &[SeqId(1), SeqId(2)], &mut st, &disk),
        Ok(3)
    );
    let job = kv.swap_in_group(&[SeqId(1), SeqId(2)]).unwrap();
    st.swap(&job.plan).unwrap();
    kv.complete_swap(job.ticket).unwrap();
    kv.check_invariants().unwrap();
    for (seq, values) in [(1, &a), (2, &a), (3, &c)] {
        let table = kv.block_table(SeqId(seq)).unwrap();
        assert_eq!(check_values(&st, table, values), Ok(()), "seq {seq}");
    }
}

/// The prefix cache's spill to the host tier and its restore, each failing halfway
/// through the copy: nothing changes (the prompt still hits where it did); the retries
/// succeed, and a hit after the restore reads the prompt's bytes.
#[test]
fn a_prefix_spill_or_restore_failing_partway_changes_nothing_and_retries() {
    let mut kv = manager(0);
    let mut st = flaky(true);
    let prompt: Vec<u32> = (0..13).map(|t| t * 3 + 1).collect();
    let opts = AdmitOptions::default();
    let mut slots = Vec::new();
    kv.admit_tokens(SeqId(1), &prompt, &opts, &mut slots)
        .unwrap();
    write_values(&mut st, &slots, &prompt);
    kv.free(SeqId(1)).unwrap();
    let state = |kv: &KvCache| (snapshot(kv), kv.cached_prefix_len(&prompt, &opts).unwrap());

    let before = state(&kv);
    assert_eq!(before.1, 12);
    st.swap_failures = 1;
    assert!(is_simulated(
        spill_cached_prefixes(&mut kv, &mut st).map(|_| ())
    ));
    assert_eq!(state(&kv), before);
    kv.check_invariants().unwrap();
    let spill = spill_cached_prefixes(&mut kv, &mut st).unwrap();
    assert_eq!(spill.spilled_blocks, 3);
    // Scribble over the device blocks the prefix left.
    kv.admit(SeqId(2), 4 * DEVICE, &mut slots).unwrap();
    write_values(&mut st, &slots, &vec![7; 4 * DEVICE]);
    kv.free(SeqId(2)).unwrap();

    let spilled = state(&kv);
    assert_eq!(spilled.1, 0);
    st.swap_failures = 1;
    assert!(is_simulated(
        restore_spilled_prefixes(&mut kv, &mut st).map(|_| ())
    ));
    assert_eq!(state(&kv), spilled);
    kv.check_invariants().unwrap();
    let restore = restore_spilled_prefixes(&mut kv, &mut st).unwrap();
    assert_eq!(restore.restored_blocks, 3);
    assert_eq!(kv.cached_prefix_len(&prompt, &opts).unwrap(), 12);
    let hit = kv
        .admit_tokens(SeqId(3), &prompt, &opts, &mut slots)
        .unwrap();
    assert_eq!(hit.cached_tokens, 12);
    write_values(&mut st, &slots, &prompt[12..]);
    let table = kv.block_table(SeqId(3)).unwrap();
    assert_eq!(check_values(&st, table, &prompt), Ok(()));
    kv.check_invariants().unwrap();
}
