//! Swapping, the disk tier, the transfer engine and preemption, checked byte for byte
//! on `HostStorage`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam_channel::{unbounded, Receiver};
use pagedkv::executor::tier::{DiskTier, TransferEngine};
use pagedkv::layout::plans::SwapDirection;
use pagedkv::layout::Slot;
use pagedkv::manager::preempt::{CostModel, PreemptAction, PreemptReason};
use pagedkv::manager::{SwapJob, TierBlock};
use pagedkv::{
    BlockId, CacheConfig, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape,
    PreemptPolicy, SeqId, Storage, SwapPlan, TierConfig,
};

// ---- fixtures ------------------------------------------------------------------

const BLOCK_SIZE: usize = 4;
const LAYERS: usize = 3;

fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: LAYERS,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 4,
        kv_dtype: DType::F16,
    };
    KvLayout::new(shape, BLOCK_SIZE).unwrap()
}

struct Rig {
    kv: KvCache,
    storage: HostStorage,
    /// Token values of every live sequence: token `i` of `seq` was written with the
    /// byte pattern of `values[seq][i]`.
    values: HashMap<SeqId, Vec<u32>>,
    next_value: u32,
}

fn rig(device: usize, host: usize, disk: usize) -> Rig {
    let l = layout();
    let mut config = CacheConfig::new(device);
    config.watermark_blocks = 0;
    // The host tier's size is given once, to the storage.
    let storage = HostStorage::with_host_tier(l, device, host).unwrap();
    let tiers = TierConfig {
        num_disk_slots: disk,
        ..TierConfig::for_storage(&storage)
    };
    Rig {
        kv: KvCache::with_tiers(l, config, tiers).unwrap(),
        storage,
        values: HashMap::new(),
        next_value: 1,
    }
}

/// The byte of one element: a mix of everything that names it, so any misplaced
/// block, layer, head or token shows.
fn pattern(value: u32, layer: usize, kv: usize, head: usize, byte: usize) -> u8 {
    let mut h = u64::from(value).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for x in [layer, kv, head, byte] {
        h = (h ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h >> 29) as u8
}

fn token_data(l: &KvLayout, layer: usize, values: &[u32]) -> (Vec<u8>, Vec<u8>) {
    let heads = l.shape().num_kv_heads;
    let hb = l.shape().head_dim * l.dtype().size_bytes();
    let mut k = Vec::with_capacity(values.len() * heads * hb);
    let mut v = Vec::with_capacity(values.len() * heads * hb);
    for &val in values {
        for h in 0..heads {
            for b in 0..hb {
                k.push(pattern(val, layer, 0, h, b));
                v.push(pattern(val, layer, 1, h, b));
            }
        }
    }
    (k, v)
}

impl Rig {
    fn fresh_values(&mut self, n: usize) -> Vec<u32> {
        let v = (self.next_value..self.next_value + n as u32).collect();
        self.next_value += n as u32;
        v
    }

    fn write(&mut self, slots: &[Slot], values: &[u32]) {
        let l = *self.kv.layout();
        for layer in 0..LAYERS {
            let (k, v) = token_data(&l, layer, values);
            self.storage.write_slots(layer, slots, &k, &v).unwrap();
        }
    }

    fn admit(&mut self, seq: SeqId, tokens: usize) -> Result<(), Error> {
        let mut slots = Vec::new();
        self.kv.admit(seq, tokens, &mut slots)?;
        let values = self.fresh_values(tokens);
        self.write(&slots, &values);
        self.values.insert(seq, values);
        Ok(())
    }

    fn append(&mut self, seq: SeqId, n: usize) -> Result<(), Error> {
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        self.kv.append(seq, n, &mut slots, &mut copies)?;
        self.storage.copy_blocks(&copies).unwrap();
        let values = self.fresh_values(n);
        self.write(&slots, &values);
        self.values.get_mut(&seq).unwrap().extend(values);
        Ok(())
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), Error> {
        self.kv.fork(parent, child)?;
        let v = self.values[&parent].clone();
        self.values.insert(child, v);
        Ok(())
    }

    fn free(&mut self, seq: SeqId) -> Result<(), Error> {
        self.kv.free(seq)?;
        self.values.remove(&seq);
        Ok(())
    }

    /// Plans, executes and completes a swap.
    fn run(&mut self, job: SwapJob) -> SwapJob {
        self.storage.swap(&job.plan).unwrap();
        self.kv.complete_swap(job.ticket).unwrap();
        job
    }

    fn swap_out(&mut self, seqs: &[SeqId]) -> Result<SwapJob, Error> {
        let job = self.kv.swap_out_group(seqs)?;
        Ok(self.run(job))
    }

    fn swap_in(&mut self, seqs: &[SeqId]) -> Result<SwapJob, Error> {
        let job = self.kv.swap_in_group(seqs)?;
        Ok(self.run(job))
    }

    /// Every K/V byte of `seq` on the device equals what was written for its tokens.
    fn verify(&self, seq: SeqId) {
        let l = *self.kv.layout();
        let values = &self.values[&seq];
        let table = self.kv.block_table(seq).unwrap();
        for layer in 0..LAYERS {
            let (want_k, want_v) = token_data(&l, layer, values);
            let (mut k, mut v) = (vec![0; want_k.len()], vec![0; want_v.len()]);
            self.storage
                .read_tokens(layer, table, values.len(), &mut k, &mut v)
                .unwrap();
            assert!(k == want_k && v == want_v, "{seq} layer {layer} differs");
        }
    }

    fn check(&self) {
        self.kv.check_invariants().unwrap();
    }
}

/// Everything observable about the bookkeeping, to prove a failed call changed nothing.
fn snapshot(kv: &KvCache) -> String {
    let mut ids: Vec<SeqId> = kv.sequence_ids().chain(kv.swapped_sequence_ids()).collect();
    ids.sort();
    let mut s = format!("{:?}\n{:?}\n", kv.stats(), kv.tier_stats());
    for id in ids {
        let table = match kv.block_table(id) {
            Ok(t) => format!("device {t:?} in flight {:?}", kv.swap_in_flight(id)),
            Err(_) => format!("tiers {:?}", kv.swapped_table(id).unwrap()),
        };
        s += &format!("{id}: {:?} tokens, {table}\n", kv.num_tokens(id).ok());
    }
    s
}

static FILES: AtomicUsize = AtomicUsize::new(0);

/// A disk-tier file in the temp dir, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new() -> Self {
        let n = FILES.fetch_add(1, Ordering::Relaxed);
        TempFile(std::env::temp_dir().join(format!("pagedkv-swap-{}-{n}", std::process::id())))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn state_err(r: Result<impl std::fmt::Debug, Error>) -> &'static str {
    match r {
        Err(Error::SequenceState { state, .. }) => state,
        other => panic!("expected SequenceState, got {other:?}"),
    }
}

// ---- round trips ---------------------------------------------------------------

#[test]
fn swap_round_trip_survives_reuse_of_the_device_blocks() {
    let mut r = rig(8, 8, 0);
    r.admit(SeqId(1), 14).unwrap(); // 4 blocks
    r.admit(SeqId(2), 9).unwrap(); // 3 blocks
    let job = r.swap_out(&[SeqId(1)]).unwrap();
    assert_eq!(job.plan.direction(), SwapDirection::Out);
    assert_eq!(job.plan.len(), 4);
    assert!(r.kv.is_swapped(SeqId(1)));
    assert_eq!(r.kv.tier_stats().host_used_blocks, 4);
    r.check();

    // Give the freed device blocks to another sequence and overwrite them all.
    r.admit(SeqId(3), 20).unwrap();
    assert_eq!(r.kv.stats().free_blocks, 0);
    r.free(SeqId(3)).unwrap();
    r.admit(SeqId(4), 4).unwrap();

    let back = r.swap_in(&[SeqId(1)]).unwrap();
    assert_eq!(back.plan.direction(), SwapDirection::In);
    assert!(!r.kv.is_swapped(SeqId(1)));
    for s in [1, 2, 4] {
        r.verify(SeqId(s));
    }
    // It grows again like any resident sequence.
    r.free(SeqId(4)).unwrap();
    r.append(SeqId(1), 3).unwrap();
    r.verify(SeqId(1));
    let t = r.kv.tier_stats();
    assert_eq!((t.swaps_out, t.swaps_in, t.host_used_blocks), (1, 1, 0));
    let bytes = 4 * layout().block_bytes() as u64;
    assert_eq!((t.bytes_swapped_out, t.bytes_swapped_in), (bytes, bytes));
    r.check();
}

#[test]
fn device_blocks_stay_taken_until_the_swap_completes() {
    let mut r = rig(6, 8, 0);
    r.admit(SeqId(1), 12).unwrap(); // 3 blocks
    r.admit(SeqId(2), 12).unwrap(); // 3 blocks: full
    let job = r.kv.swap_out(SeqId(1)).unwrap();
    assert_eq!(r.kv.num_available_blocks(), 0);
    assert!(matches!(
        r.kv.admit(SeqId(3), 1, &mut Vec::new()),
        Err(Error::OutOfBlocks { .. })
    ));
    // The sequence is readable (attention may still run) but frozen.
    assert_eq!(r.kv.block_table(SeqId(1)).unwrap().len(), 3);
    r.verify(SeqId(1));
    assert_eq!(state_err(r.append(SeqId(1), 1)), "swapping out");
    assert_eq!(state_err(r.kv.fork(SeqId(1), SeqId(9))), "swapping out");
    assert_eq!(state_err(r.kv.free(SeqId(1))), "swapping out");
    assert_eq!(state_err(r.kv.truncate(SeqId(1), 1)), "swapping out");
    assert_eq!(state_err(r.kv.swap_out(SeqId(1))), "swapping out");
    assert_eq!(r.kv.tier_stats().in_flight_transfers, 1);
    r.check();

    r.storage.swap(&job.plan).unwrap();
    r.kv.complete_swap(job.ticket).unwrap();
    assert_eq!(r.kv.num_available_blocks(), 3);
    assert_eq!(
        r.kv.complete_swap(job.ticket),
        Err(Error::UnknownTicket(job.ticket))
    );
    r.check();
}

#[test]
fn swapped_sequences_refuse_mutation_and_batch_views() {
    let mut r = rig(8, 8, 0);
    r.admit(SeqId(1), 5).unwrap();
    r.swap_out(&[SeqId(1)]).unwrap();
    let before = snapshot(&r.kv);
    assert_eq!(state_err(r.append(SeqId(1), 1)), "swapped out");
    assert_eq!(state_err(r.kv.fork(SeqId(1), SeqId(2))), "swapped out");
    assert_eq!(state_err(r.kv.truncate(SeqId(1), 1)), "swapped out");
    assert_eq!(state_err(r.kv.block_table(SeqId(1))), "swapped out");
    assert_eq!(
        state_err(r.kv.fill_padded(&[SeqId(1)], &mut Default::default())),
        "swapped out"
    );
    assert_eq!(state_err(r.kv.swap_out(SeqId(1))), "swapped out");
    assert!(matches!(
        r.kv.admit(SeqId(1), 1, &mut Vec::new()),
        Err(Error::DuplicateSequence(_))
    ));
    assert_eq!(
        r.kv.swap_in(SeqId(7)),
        Err(Error::UnknownSequence(SeqId(7)))
    );
    assert_eq!(snapshot(&r.kv), before);
    assert_eq!(r.kv.num_tokens(SeqId(1)).unwrap(), 5);
    // Free works on a swapped sequence and returns its host blocks.
    r.free(SeqId(1)).unwrap();
    assert_eq!(r.kv.tier_stats().host_used_blocks, 0);
    r.check();
}

#[test]
fn fork_group_swaps_shared_blocks_once_and_stays_shared() {
    let mut r = rig(16, 16, 0);
    r.admit(SeqId(1), 10).unwrap(); // 3 blocks, last one half full
    r.fork(SeqId(1), SeqId(2)).unwrap();
    r.fork(SeqId(1), SeqId(3)).unwrap();
    r.append(SeqId(2), 3).unwrap(); // copy-on-write of the last block
    let group = [SeqId(1), SeqId(2), SeqId(3)];
    // Distinct blocks: 2 shared full blocks, the original tail (1 and 3), 2's copy of
    // it and 2's fourth block.
    let job = r.swap_out(&group).unwrap();
    assert_eq!(job.plan.len(), 5);
    assert_eq!(r.kv.tier_stats().host_used_blocks, 5);
    assert_eq!(r.kv.stats().used_blocks, 0);
    let t1 = r.kv.swapped_table(SeqId(1)).unwrap().to_vec();
    assert_eq!(t1, r.kv.swapped_table(SeqId(3)).unwrap());
    assert_eq!(t1[..2], r.kv.swapped_table(SeqId(2)).unwrap()[..2]);
    r.check();

    r.admit(SeqId(9), 60).unwrap(); // scribble over the arena
    r.free(SeqId(9)).unwrap();
    let job = r.swap_in(&group).unwrap();
    assert_eq!(job.plan.len(), 5);
    assert_eq!(r.kv.stats().used_blocks, 5);
    let t1 = r.kv.block_table(SeqId(1)).unwrap().to_vec();
    assert_eq!(r.kv.pool().refcount(t1[0]).unwrap(), 3);
    for s in group {
        r.verify(s);
    }
    r.check();
}

#[test]
fn one_fork_swaps_out_while_its_siblings_stay_resident() {
    let mut r = rig(16, 16, 0);
    r.admit(SeqId(1), 10).unwrap();
    r.fork(SeqId(1), SeqId(2)).unwrap();
    let job = r.kv.swap_out(SeqId(2)).unwrap();
    // The sibling keeps writing while the transfer is in flight: copy-on-write keeps
    // the shared block the transfer reads unchanged.
    r.append(SeqId(1), 5).unwrap();
    r.storage.swap(&job.plan).unwrap();
    r.kv.complete_swap(job.ticket).unwrap();
    r.verify(SeqId(1));
    r.check();
    r.append(SeqId(1), 2).unwrap();
    r.swap_in(&[SeqId(2)]).unwrap();
    r.verify(SeqId(1));
    r.verify(SeqId(2));
    r.append(SeqId(2), 4).unwrap();
    r.verify(SeqId(1));
    r.verify(SeqId(2));
    r.check();
}

#[test]
fn host_tier_full_is_a_typed_error_and_the_sequence_stays_resident() {
    let mut r = rig(16, 3, 0);
    r.admit(SeqId(1), 13).unwrap(); // 4 blocks > 3 host blocks
    let before = snapshot(&r.kv);
    assert_eq!(
        r.kv.swap_out(SeqId(1)),
        Err(Error::TierFull {
            tier: "host",
            needed: 4,
            free: 3
        })
    );
    assert_eq!(snapshot(&r.kv), before);
    r.append(SeqId(1), 1).unwrap();
    r.verify(SeqId(1));
    r.check();
}

#[test]
fn swap_in_without_room_changes_nothing() {
    let mut r = rig(4, 8, 0);
    r.admit(SeqId(1), 12).unwrap();
    r.swap_out(&[SeqId(1)]).unwrap();
    r.admit(SeqId(2), 8).unwrap();
    let before = snapshot(&r.kv);
    assert_eq!(
        r.kv.swap_in(SeqId(1)),
        Err(Error::OutOfBlocks { needed: 3, free: 2 })
    );
    assert_eq!(snapshot(&r.kv), before);
    r.free(SeqId(2)).unwrap();
    r.swap_in(&[SeqId(1)]).unwrap();
    r.verify(SeqId(1));
}

/// A hand-written `TierConfig` larger than the storage's host tier is accepted by the
/// manager (it never sees the storage); the first transfer that reaches past the
/// storage's tier names the mismatch and moves nothing, and the abort loses nothing.
#[test]
fn a_host_tier_larger_than_the_storage_is_a_clear_error_that_loses_nothing() {
    let l = layout();
    let mut config = CacheConfig::new(8);
    config.watermark_blocks = 0;
    let storage = HostStorage::with_host_tier(l, 8, 2).unwrap();
    let tiers = TierConfig {
        num_host_blocks: 8,
        num_disk_slots: 0,
    };
    let mut r = Rig {
        kv: KvCache::with_tiers(l, config, tiers).unwrap(),
        storage,
        values: HashMap::new(),
        next_value: 1,
    };
    r.admit(SeqId(1), 3 * BLOCK_SIZE).unwrap();
    let before = snapshot(&r.kv);
    let job = r.kv.swap_out(SeqId(1)).unwrap();
    let err = r.storage.swap(&job.plan).unwrap_err();
    assert!(
        matches!(err, Error::HostBlockOutOfRange { host_blocks: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("TierConfig::for_storage"), "{err}");
    for layer in 0..LAYERS {
        assert!(matches!(
            r.storage.swap_layer(layer, &job.plan),
            Err(Error::HostBlockOutOfRange { .. })
        ));
    }
    r.kv.abort_swap(job.ticket).unwrap();
    assert_eq!(snapshot(&r.kv), before);
    r.verify(SeqId(1));
    r.check();
}

#[test]
fn aborted_swaps_leave_the_sequence_where_it_was() {
    let mut r = rig(8, 8, 0);
    r.admit(SeqId(1), 9).unwrap();
    let before = snapshot(&r.kv);
    let job = r.kv.swap_out(SeqId(1)).unwrap();
    r.kv.abort_swap(job.ticket).unwrap();
    assert_eq!(snapshot(&r.kv), before);
    r.verify(SeqId(1));

    r.swap_out(&[SeqId(1)]).unwrap();
    let swapped = snapshot(&r.kv);
    let job = r.kv.swap_in(SeqId(1)).unwrap();
    // Half the transfer ran, then it failed.
    r.storage.swap_layer(0, &job.plan).unwrap();
    r.kv.abort_swap(job.ticket).unwrap();
    assert_eq!(snapshot(&r.kv), swapped);
    r.swap_in(&[SeqId(1)]).unwrap();
    r.verify(SeqId(1));
    r.check();
}

#[test]
fn host_blocks_are_consecutive_so_runs_merge() {
    let mut r = rig(32, 32, 0);
    // A sequence on consecutive device blocks swaps out in one run.
    r.admit(SeqId(1), 32).unwrap();
    let job = r.swap_out(&[SeqId(1)]).unwrap();
    assert_eq!(job.plan.len(), 8);
    assert_eq!(job.plan.runs().len(), 1);
    // Interleaved growth scatters device blocks; the host side stays one run, so runs
    // merge exactly where the device side is consecutive too.
    r.admit(SeqId(2), 4).unwrap();
    r.admit(SeqId(3), 4).unwrap();
    for _ in 0..5 {
        r.append(SeqId(2), 4).unwrap();
        r.append(SeqId(3), 4).unwrap();
    }
    let job = r.swap_out(&[SeqId(2)]).unwrap();
    let hosts: Vec<u32> = job.plan.pairs().iter().map(|p| p.host.0).collect();
    assert!(hosts.windows(2).all(|w| w[1] == w[0] + 1), "{hosts:?}");
    let device_breaks = job
        .plan
        .pairs()
        .windows(2)
        .filter(|w| w[1].device.0 != w[0].device.0 + 1)
        .count();
    assert_eq!(job.plan.runs().len(), device_breaks + 1);
    // Swapping back in takes one run of free device blocks.
    r.free(SeqId(3)).unwrap();
    let back = r.swap_in(&[SeqId(2)]).unwrap();
    assert_eq!(back.plan.runs().len(), 1);
    r.verify(SeqId(2));
    r.swap_in(&[SeqId(1)]).unwrap();
    r.verify(SeqId(1));
}

// ---- transfer engine -----------------------------------------------------------

/// A storage whose per-layer swaps wait for a token, so a test can hold a transfer
/// between layers; `per_layer: false` makes it a backend without per-layer swaps.
struct Gated {
    inner: HostStorage,
    gate: Receiver<()>,
    per_layer: bool,
}

// Host-block I/O keeps the trait's refusal.
pagedkv::delegate_storage! {
    Gated => inner, except [swap, swap_layer, read_host_block, write_host_block];

    fn swap(&mut self, plan: &SwapPlan) -> pagedkv::Result<()> {
        let _ = self.gate.recv();
        self.inner.swap(plan)
    }
    fn swap_layer(&mut self, layer: usize, plan: &SwapPlan) -> pagedkv::Result<()> {
        if !self.per_layer {
            return Err(Error::Unsupported("test".into()));
        }
        let _ = self.gate.recv();
        self.inner.swap_layer(layer, plan)
    }
}

fn wait_until(mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(start.elapsed().as_secs() < 20, "timed out");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn transfer_engine_signals_each_layer_before_the_last_arrives() {
    let mut r = rig(8, 8, 0);
    r.admit(SeqId(1), 10).unwrap();
    r.swap_out(&[SeqId(1)]).unwrap();
    r.admit(SeqId(2), 16).unwrap(); // overwrite the old device blocks
    r.free(SeqId(2)).unwrap();
    let (tx, rx) = unbounded();
    let Rig {
        mut kv,
        storage,
        values,
        ..
    } = r;
    let mut engine = TransferEngine::new(Gated {
        inner: storage,
        gate: rx,
        per_layer: true,
    });
    let job = kv.swap_in(SeqId(1)).unwrap();
    engine.submit(&job).unwrap();
    assert!(engine.submit(&job).is_err());
    assert!(!engine.is_layer_ready(SeqId(1), 0));
    tx.send(()).unwrap();
    wait_until(|| engine.is_layer_ready(SeqId(1), 0));
    // Layer 0 has landed while layers 1 and 2 have not. (The worker now waits inside
    // the storage lock for layer 1, so the test does not read the storage here.)
    assert!(!engine.is_layer_ready(SeqId(1), 1));
    assert!(!engine.is_done(job.ticket));
    let l = layout();
    let table = kv.block_table(SeqId(1)).unwrap().to_vec();
    assert!(engine.poll_completed().is_empty());
    tx.send(()).unwrap();
    tx.send(()).unwrap();
    engine.wait(job.ticket).unwrap();
    assert!(engine.is_layer_ready(SeqId(1), LAYERS - 1));
    assert_eq!(engine.poll_completed(), vec![(job.ticket, Ok(()))]);
    kv.complete_swap(job.ticket).unwrap();
    kv.check_invariants().unwrap();
    let st = engine.storage().lock();
    for layer in 0..LAYERS {
        let (want_k, want_v) = token_data(&l, layer, &values[&SeqId(1)]);
        let (mut k, mut v) = (vec![0; want_k.len()], vec![0; want_v.len()]);
        st.read_tokens(layer, &table, 10, &mut k, &mut v).unwrap();
        assert!(k == want_k && v == want_v);
    }
}

#[test]
fn transfer_engine_falls_back_to_one_batched_swap_and_reports_errors() {
    let (tx, rx) = unbounded();
    let l = layout();
    let inner = HostStorage::with_host_tier(l, 8, 8).unwrap();
    let mut engine = TransferEngine::new(Gated {
        inner,
        gate: rx,
        per_layer: false,
    });
    let tiers = TierConfig {
        num_host_blocks: 8,
        num_disk_slots: 0,
    };
    let mut kv = KvCache::with_tiers(l, CacheConfig::new(8), tiers).unwrap();
    kv.admit(SeqId(1), 8, &mut Vec::new()).unwrap();
    let job = kv.swap_out(SeqId(1)).unwrap();
    engine.submit(&job).unwrap();
    assert!(!engine.is_layer_ready(SeqId(1), 0));
    tx.send(()).unwrap();
    engine.wait(job.ticket).unwrap();
    for layer in 0..LAYERS {
        assert!(engine.is_layer_ready(SeqId(1), layer));
    }
    // A plan the storage rejects comes back as the job's error.
    let mut bad = job.clone();
    bad.ticket = pagedkv::ids::SwapTicket(999);
    bad.plan = SwapPlan::new(SwapDirection::Out);
    bad.plan.push(BlockId(100), BlockId(0));
    engine.submit(&bad).unwrap();
    tx.send(()).unwrap();
    assert!(matches!(
        engine.wait(bad.ticket),
        Err(Error::BlockOutOfRange { .. })
    ));
    let done = engine.poll_completed();
    assert_eq!(done.len(), 2);
    assert_eq!(done[0], (job.ticket, Ok(())));
    kv.complete_swap(job.ticket).unwrap();
    assert!(matches!(
        engine.wait(bad.ticket),
        Err(Error::UnknownTicket(_))
    ));
}

#[test]
fn the_engine_keeps_decoding_other_sequences_while_a_swap_is_in_flight() {
    let mut r = rig(16, 16, 0);
    r.admit(SeqId(1), 20).unwrap();
    r.admit(SeqId(2), 3).unwrap();
    let Rig {
        mut kv,
        storage,
        mut values,
        mut next_value,
    } = r;
    let mut engine = TransferEngine::new(storage);
    let job = kv.swap_out(SeqId(1)).unwrap();
    engine.submit(&job).unwrap();
    let l = layout();
    // Decode steps for sequence 2 interleave with the transfer on the shared storage.
    for _ in 0..20 {
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        kv.append(SeqId(2), 1, &mut slots, &mut copies).unwrap();
        let mut st = engine.storage().lock();
        st.copy_blocks(&copies).unwrap();
        for layer in 0..LAYERS {
            let (k, v) = token_data(&l, layer, &[next_value]);
            st.write_slots(layer, &slots, &k, &v).unwrap();
        }
        values.get_mut(&SeqId(2)).unwrap().push(next_value);
        next_value += 1;
    }
    engine.wait(job.ticket).unwrap();
    for (ticket, result) in engine.poll_completed() {
        result.unwrap();
        kv.complete_swap(ticket).unwrap();
    }
    let back = kv.swap_in(SeqId(1)).unwrap();
    engine.submit(&back).unwrap();
    engine.wait(back.ticket).unwrap();
    kv.complete_swap(back.ticket).unwrap();
    kv.check_invariants().unwrap();
    let st = engine.storage().lock();
    for seq in [SeqId(1), SeqId(2)] {
        let table = kv.block_table(seq).unwrap();
        for layer in 0..LAYERS {
            let (want_k, want_v) = token_data(&l, layer, &values[&seq]);
            let (mut k, mut v) = (vec![0; want_k.len()], vec![0; want_v.len()]);
            st.read_tokens(layer, table, values[&seq].len(), &mut k, &mut v)
                .unwrap();
            assert!(k == want_k && v == want_v, "{seq} layer {layer}");
        }
    }
}

// ---- disk tier -----------------------------------------------------------------

fn disk_rig(device: usize, host: usize, slots: usize) -> (Rig, DiskTier, TempFile) {
    let r = rig(device, host, slots);
    let file = TempFile::new();
    let disk = DiskTier::create(&file.0, &layout(), slots).unwrap();
    (r, disk, file)
}

#[test]
fn disk_round_trip_through_the_host_tier() {
    let (mut r, mut disk, _f) = disk_rig(8, 6, 8);
    r.admit(SeqId(1), 10).unwrap();
    r.fork(SeqId(1), SeqId(2)).unwrap();
    r.append(SeqId(2), 1).unwrap();
    r.swap_out(&[SeqId(1), SeqId(2)]).unwrap();
    assert_eq!(r.kv.tier_stats().host_used_blocks, 4);
    let written =
        pagedkv::executor::spill_to_disk(&mut r.kv, &[SeqId(1), SeqId(2)], &r.storage, &mut disk)
            .unwrap();
    assert_eq!(written, 4);
    let t = r.kv.tier_stats();
    assert_eq!((t.host_used_blocks, t.disk_used_slots), (0, 4));
    assert!(r
        .kv
        .swapped_table(SeqId(2))
        .unwrap()
        .iter()
        .all(|e| matches!(e, TierBlock::Disk(_))));
    assert_eq!(state_err(r.kv.swap_in(SeqId(1))), "partly on disk");
    r.check();

    // Reuse the host tier in between: swap another sequence through it.
    r.admit(SeqId(3), 20).unwrap();
    r.swap_out(&[SeqId(3)]).unwrap();
    r.swap_in(&[SeqId(3)]).unwrap();
    r.free(SeqId(3)).unwrap();

    let read = pagedkv::executor::restore_from_disk(
        &mut r.kv,
        &[SeqId(1), SeqId(2)],
        &mut r.storage,
        &disk,
    )
    .unwrap();
    assert_eq!(read, 4);
    r.swap_in(&[SeqId(1), SeqId(2)]).unwrap();
    r.verify(SeqId(1));
    r.verify(SeqId(2));
    let t = r.kv.tier_stats();
    assert_eq!(
        (t.blocks_spilled, t.blocks_restored, t.disk_used_slots),
        (4, 4, 0)
    );
    r.check();
}

#[test]
fn disk_full_is_a_typed_error_and_changes_nothing() {
    let (mut r, mut disk, _f) = disk_rig(8, 8, 2);
    r.admit(SeqId(1), 10).unwrap(); // 3 blocks > 2 slots
    r.swap_out(&[SeqId(1)]).unwrap();
    let before = snapshot(&r.kv);
    assert_eq!(
        pagedkv::executor::spill_to_disk(&mut r.kv, &[SeqId(1)], &r.storage, &mut disk),
        Err(Error::TierFull {
            tier: "disk",
            needed: 3,
            free: 2
        })
    );
    assert_eq!(snapshot(&r.kv), before);
    r.swap_in(&[SeqId(1)]).unwrap();
    r.verify(SeqId(1));
}

#[test]
fn a_failed_disk_write_changes_nothing() {
    // /dev/full accepts the open and fails every write with ENOSPC.
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/full")
    else {
        eprintln!("skipped: /dev/full is not available here");
        return;
    };
    let mut r = rig(8, 8, 4);
    let mut disk = DiskTier::with_file(file, &layout(), 4).unwrap();
    r.admit(SeqId(1), 7).unwrap();
    r.admit(SeqId(2), 5).unwrap();
    r.swap_out(&[SeqId(1)]).unwrap();
    let before = snapshot(&r.kv);
    assert!(matches!(
        pagedkv::executor::spill_to_disk(&mut r.kv, &[SeqId(1)], &r.storage, &mut disk),
        Err(Error::Io(_))
    ));
    assert_eq!(snapshot(&r.kv), before);
    r.swap_in(&[SeqId(1)]).unwrap();
    r.verify(SeqId(1));
    r.verify(SeqId(2));
    r.check();
}

#[test]
fn a_corrupt_disk_block_fails_its_checksum_and_changes_nothing() {
    use std::os::unix::fs::FileExt;
    let (mut r, mut disk, f) = disk_rig(8, 8, 8);
    r.admit(SeqId(1), 10).unwrap();
    r.admit(SeqId(2), 6).unwrap();
    r.swap_out(&[SeqId(1)]).unwrap();
    pagedkv::executor::spill_to_disk(&mut r.kv, &[SeqId(1)], &r.storage, &mut disk).unwrap();
    let TierBlock::Disk(slot) = r.kv.swapped_table(SeqId(1)).unwrap()[1] else {
        panic!("not on disk");
    };
    // Flip one byte in the middle of the second block's slot.
    let raw = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(&f.0)
        .unwrap();
    let at = disk.slot_offset(slot) + 100;
    let mut b = [0u8];
    raw.read_exact_at(&mut b, at).unwrap();
    raw.write_all_at(&[b[0] ^ 0x10], at).unwrap();
    let before = snapshot(&r.kv);
    assert!(matches!(
        pagedkv::executor::restore_from_disk(&mut r.kv, &[SeqId(1)], &mut r.storage, &disk),
        Err(Error::Checksum { .. })
    ));
    assert_eq!(snapshot(&r.kv), before);
    r.verify(SeqId(2));
    r.check();
    // Repair the byte: the same data now restores.
    raw.write_all_at(&b, at).unwrap();
    pagedkv::executor::restore_from_disk(&mut r.kv, &[SeqId(1)], &mut r.storage, &disk).unwrap();
    r.swap_in(&[SeqId(1)]).unwrap();
    r.verify(SeqId(1));
}

#[test]
fn a_mismatched_disk_tier_is_rejected() {
    let (mut r, _disk, _f) = disk_rig(8, 8, 4);
    let other = TempFile::new();
    let mut wrong = DiskTier::create(&other.0, &layout(), 5).unwrap();
    r.admit(SeqId(1), 4).unwrap();
    r.swap_out(&[SeqId(1)]).unwrap();
    assert!(matches!(
        pagedkv::executor::spill_to_disk(&mut r.kv, &[SeqId(1)], &r.storage, &mut wrong),
        Err(Error::InvalidConfig { .. })
    ));
}

// ---- preemption ----------------------------------------------------------------

fn model(swap_bytes_per_s: f64, prefill_tokens_per_s: f64) -> PreemptPolicy {
    PreemptPolicy::cost_based(CostModel::new(swap_bytes_per_s, prefill_tokens_per_s).unwrap())
}

#[test]
fn preemption_takes_the_lowest_priority_then_the_newest_group() {
    let mut r = rig(12, 32, 0);
    for s in 1..=4 {
        r.admit(SeqId(s), 12).unwrap(); // 3 blocks each: full
    }
    r.fork(SeqId(2), SeqId(20)).unwrap();
    r.kv.set_preempt_priority(SeqId(1), -1).unwrap();
    let policy = model(1e12, 1.0); // swapping is far cheaper
    let p = r.kv.preempt_for(4, &policy).unwrap();
    // Seq 1 (lowest priority) first, then the newest admission, seq 4.
    let groups: Vec<Vec<SeqId>> = p.iter().map(|p| p.seqs.clone()).collect();
    assert_eq!(groups, vec![vec![SeqId(1)], vec![SeqId(4)]]);
    for pre in &p {
        assert_eq!(pre.reason, PreemptReason::SwapCheaper);
        assert!(pre.swap_seconds < pre.recompute_seconds);
        let PreemptAction::Swap(job) = &pre.action else {
            panic!("expected a swap")
        };
        r.storage.swap(&job.plan).unwrap();
        r.kv.complete_swap(job.ticket).unwrap();
    }
    assert_eq!(r.kv.num_available_blocks(), 6);
    // The fork group (2 and 20) goes as one and stays shared.
    let p = r.kv.preempt_for(10, &policy).unwrap();
    assert_eq!(p[0].seqs, vec![SeqId(3)]);
    assert_eq!(p[1].seqs, vec![SeqId(2), SeqId(20)]);
    let t = r.kv.tier_stats();
    assert_eq!(
        (t.preemptions, t.preempt_swaps, t.preempt_recomputes),
        (4, 4, 0)
    );
    assert_eq!(r.kv.take_preempt_events().len(), 4);
    assert!(r.kv.take_preempt_events().is_empty());
    r.check();
}

/// Siblings a recompute sent back are re-admitted one by one, each its own group;
/// `join_fork_group` makes them one group again, so the next preemption takes them
/// together instead of splitting the request.
#[test]
fn rejoined_siblings_are_preempted_together_after_a_recompute() {
    let fast_prefill = model(1.0, 1e9);
    let readmit = |r: &mut Rig| {
        for s in [1, 2] {
            r.values.remove(&SeqId(s));
            r.admit(SeqId(s), 8).unwrap();
        }
    };
    for join in [false, true] {
        let mut r = rig(16, 0, 0);
        r.admit(SeqId(1), 8).unwrap();
        r.fork(SeqId(1), SeqId(2)).unwrap();
        let p = r.kv.preempt_for(16, &fast_prefill).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].seqs, vec![SeqId(1), SeqId(2)], "one group");
        readmit(&mut r);
        r.admit(SeqId(3), 4).unwrap(); // a newer, smaller request
        if join {
            let before = snapshot(&r.kv);
            assert_eq!(
                r.kv.join_fork_group(SeqId(2), SeqId(9)),
                Err(Error::UnknownSequence(SeqId(9)))
            );
            assert!(r.kv.join_fork_group(SeqId(9), SeqId(1)).is_err());
            assert_eq!(snapshot(&r.kv), before);
            r.kv.join_fork_group(SeqId(2), SeqId(1)).unwrap();
        }
        // Room for 8 more blocks: the newest group goes first, then as few as needed.
        let p = r.kv.preempt_for(16 - 5 + 2, &fast_prefill).unwrap();
        let taken: Vec<Vec<SeqId>> = p.iter().map(|e| e.seqs.clone()).collect();
        if join {
            assert_eq!(taken, vec![vec![SeqId(3)], vec![SeqId(1), SeqId(2)]]);
        } else {
            // Re-admitted apart, 2 (newer than 1) goes alone and 1 stays.
            assert_eq!(taken, vec![vec![SeqId(3)], vec![SeqId(2)]]);
            assert!(r.kv.contains(SeqId(1)));
        }
        r.check();
    }
}

#[test]
fn cost_model_chooses_recompute_when_prefill_is_cheaper_and_when_the_host_is_full() {
    let mut r = rig(8, 2, 0);
    r.admit(SeqId(1), 8).unwrap(); // 2 blocks
    r.admit(SeqId(2), 24).unwrap(); // 6 blocks
                                    // Slow link, fast prefill: recompute.
    let p = r.kv.preempt_for(2, &model(1.0, 1e9)).unwrap();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].seqs, vec![SeqId(2)]);
    assert_eq!(p[0].reason, PreemptReason::RecomputeCheaper);
    assert_eq!(
        p[0].action,
        PreemptAction::Recompute {
            tokens: vec![(SeqId(2), 24)]
        }
    );
    assert!(!r.kv.contains(SeqId(2)));
    assert_eq!(r.kv.num_available_blocks(), 6);
    r.values.remove(&SeqId(2));
    // Swapping is cheaper, but 6 blocks do not fit 2 host blocks.
    r.admit(SeqId(3), 24).unwrap();
    let p = r.kv.preempt_for(1, &model(1e12, 1.0)).unwrap();
    assert_eq!(p[0].reason, PreemptReason::HostTierFull);
    assert!(matches!(p[0].action, PreemptAction::Recompute { .. }));
    r.check();
}

#[test]
fn forced_modes_override_the_cost_model() {
    use pagedkv::manager::preempt::PreemptMode;
    let mut r = rig(4, 8, 0);
    r.admit(SeqId(1), 8).unwrap();
    r.admit(SeqId(2), 8).unwrap();
    let cost = CostModel::new(1.0, 1e12).unwrap(); // recompute far cheaper
    let swap = PreemptPolicy {
        mode: PreemptMode::AlwaysSwap,
        cost,
        unschedule_below: None,
    };
    let p = r.kv.preempt_for(1, &swap).unwrap();
    assert_eq!(p[0].reason, PreemptReason::Forced);
    assert!(matches!(p[0].action, PreemptAction::Swap(_)));
    let recompute = PreemptPolicy {
        mode: PreemptMode::AlwaysRecompute,
        cost: CostModel::new(1e12, 1.0).unwrap(),
        unschedule_below: None,
    };
    let p = r.kv.preempt_for(4, &recompute).unwrap();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].seqs, vec![SeqId(1)]);
    assert_eq!(p[0].reason, PreemptReason::Forced);
    assert!(matches!(p[0].action, PreemptAction::Recompute { .. }));
    let events = r.kv.take_preempt_events();
    assert_eq!(
        events.iter().map(|e| e.swapped).collect::<Vec<_>>(),
        vec![true, false]
    );
}

#[test]
fn preemption_that_cannot_free_enough_changes_nothing() {
    let mut r = rig(8, 8, 0);
    r.admit(SeqId(1), 8).unwrap();
    r.fork(SeqId(1), SeqId(2)).unwrap();
    let before = snapshot(&r.kv);
    assert_eq!(
        r.kv.preempt_for(20, &model(1e9, 1e3)),
        Err(Error::OutOfBlocks {
            needed: 20,
            free: 8
        })
    );
    assert_eq!(snapshot(&r.kv), before);
    assert_eq!(r.kv.tier_stats().preemptions, 0);
    // Enough already available: nothing preempted.
    assert!(r.kv.preempt_for(6, &model(1e9, 1e3)).unwrap().is_empty());
    // Blocks an in-flight swap-out will free count too.
    let job = r.kv.swap_out_group(&[SeqId(1), SeqId(2)]).unwrap();
    assert!(r.kv.preempt_for(8, &model(1e9, 1e3)).unwrap().is_empty());
    r.kv.abort_swap(job.ticket).unwrap();
}

#[test]
fn the_probe_measures_a_positive_bandwidth_without_changing_device_data() {
    let mut r = rig(8, 8, 0);
    r.admit(SeqId(1), 20).unwrap();
    let cost = pagedkv::executor::probe_cost_model(&mut r.storage, 8, 5000.0).unwrap();
    assert!(cost.swap_bytes_per_s > 0.0);
    assert_eq!(cost.prefill_tokens_per_s, 5000.0);
    r.verify(SeqId(1));
    assert!(pagedkv::executor::probe_cost_model(&mut r.storage, 9, 1.0).is_err());
    assert!(CostModel::new(0.0, 1.0).is_err());
    assert!(CostModel::new(1.0, f64::NAN).is_err());
}

// ---- model-based property test -------------------------------------------------

mod properties {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Action {
        Admit(usize),
        Append(usize, usize),
        Fork(usize),
        Free(usize),
        SwapOut {
            pick: usize,
            group: bool,
            defer: bool,
        },
        SwapIn {
            pick: usize,
            group: bool,
            defer: bool,
        },
        Finish {
            abort: bool,
        },
        Spill(usize),
        Restore(usize),
        Preempt {
            needed: usize,
            swap_cheaper: bool,
        },
    }

    fn action() -> impl Strategy<Value = Action> {
        prop_oneof![
            3 => (0usize..20).prop_map(Action::Admit),
            4 => (any::<usize>(), 1usize..6).prop_map(|(p, n)| Action::Append(p, n)),
            2 => any::<usize>().prop_map(Action::Fork),
            1 => any::<usize>().prop_map(Action::Free),
            3 => (any::<usize>(), any::<bool>(), any::<bool>())
                .prop_map(|(pick, group, defer)| Action::SwapOut { pick, group, defer }),
            3 => (any::<usize>(), any::<bool>(), any::<bool>())
                .prop_map(|(pick, group, defer)| Action::SwapIn { pick, group, defer }),
            2 => any::<bool>().prop_map(|abort| Action::Finish { abort }),
            1 => any::<usize>().prop_map(Action::Spill),
            1 => any::<usize>().prop_map(Action::Restore),
            1 => (1usize..8, any::<bool>())
                .prop_map(|(needed, swap_cheaper)| Action::Preempt { needed, swap_cheaper }),
        ]
    }

    struct World {
        r: Rig,
        disk: DiskTier,
        _file: TempFile,
        /// Fork group of each live sequence (the test's own record).
        group_of: HashMap<SeqId, u64>,
        next_id: u64,
        /// Transfers planned and not yet executed.
        pending: Vec<SwapJob>,
    }

    impl World {
        fn ids(&self) -> Vec<SeqId> {
            let mut ids: Vec<SeqId> = self.r.values.keys().copied().collect();
            ids.sort();
            ids
        }

        fn pick(&self, p: usize) -> Option<SeqId> {
            let ids = self.ids();
            (!ids.is_empty()).then(|| ids[p % ids.len()])
        }

        fn group(&self, seq: SeqId) -> Vec<SeqId> {
            let g = self.group_of[&seq];
            self.ids()
                .into_iter()
                .filter(|s| self.group_of[s] == g)
                .collect()
        }

        fn swapping_in(&self) -> Vec<SeqId> {
            self.pending
                .iter()
                .filter(|j| j.plan.direction() == SwapDirection::In)
                .flat_map(|j| j.seqs.clone())
                .collect()
        }

        /// Every resident sequence's bytes are what was written (those whose swap-in
        /// has not run yet excepted).
        fn verify_resident(&self) {
            let skip = self.swapping_in();
            for id in self.r.kv.sequence_ids() {
                if !skip.contains(&id) {
                    self.r.verify(id);
                }
            }
        }

        fn finish(&mut self, job: SwapJob, abort: bool) {
            if abort {
                self.r.kv.abort_swap(job.ticket).unwrap();
            } else {
                self.r.storage.swap(&job.plan).unwrap();
                self.r.kv.complete_swap(job.ticket).unwrap();
            }
        }

        fn step(&mut self, a: &Action) -> Result<(), Error> {
            match *a {
                Action::Admit(n) => {
                    let id = SeqId(self.next_id);
                    self.next_id += 1;
                    self.r.admit(id, n)?;
                    self.group_of.insert(id, id.0);
                }
                Action::Append(p, n) => {
                    if let Some(id) = self.pick(p) {
                        self.r.append(id, n)?;
                    }
                }
                Action::Fork(p) => {
                    if let Some(id) = self.pick(p) {
                        let child = SeqId(self.next_id);
                        self.next_id += 1;
                        self.r.fork(id, child)?;
                        self.group_of.insert(child, self.group_of[&id]);
                    }
                }
                Action::Free(p) => {
                    if let Some(id) = self.pick(p) {
                        self.r.free(id)?;
                        self.group_of.remove(&id);
                    }
                }
                Action::SwapOut { pick, group, defer } | Action::SwapIn { pick, group, defer } => {
                    let Some(id) = self.pick(pick) else {
                        return Ok(());
                    };
                    let seqs = if group { self.group(id) } else { vec![id] };
                    let job = if matches!(a, Action::SwapOut { .. }) {
                        self.r.kv.swap_out_group(&seqs)?
                    } else {
                        self.r.kv.swap_in_group(&seqs)?
                    };
                    if defer {
                        self.pending.push(job);
                    } else {
                        self.finish(job, false);
                    }
                }
                Action::Finish { abort } => {
                    if !self.pending.is_empty() {
                        let job = self.pending.remove(0);
                        self.finish(job, abort);
                    }
                }
                Action::Spill(p) => {
                    if let Some(id) = self.pick(p) {
                        let seqs = self.group(id);
                        pagedkv::executor::spill_to_disk(
                            &mut self.r.kv,
                            &seqs,
                            &self.r.storage,
                            &mut self.disk,
                        )?;
                    }
                }
                Action::Restore(p) => {
                    if let Some(id) = self.pick(p) {
                        let seqs = self.group(id);
                        pagedkv::executor::restore_from_disk(
                            &mut self.r.kv,
                            &seqs,
                            &mut self.r.storage,
                            &self.disk,
                        )?;
                    }
                }
                Action::Preempt {
                    needed,
                    swap_cheaper,
                } => {
                    let policy = if swap_cheaper {
                        model(1e15, 1.0)
                    } else {
                        model(1.0, 1e15)
                    };
                    for p in self.r.kv.preempt_for(needed, &policy)? {
                        match p.action {
                            PreemptAction::Swap(job) => self.finish(job, false),
                            PreemptAction::SwapGroups(_) => {
                                panic!("a one-group cache swaps with a SwapJob")
                            }
                            PreemptAction::Recompute { tokens } => {
                                for (id, _) in tokens {
                                    self.r.values.remove(&id);
                                    self.group_of.remove(&id);
                                }
                            }
                        }
                    }
                }
            }
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(crate::support::proptest_config(96))]

        #[test]
        fn random_swaps_keep_every_invariant_and_every_byte(
            actions in proptest::collection::vec(action(), 1..80)
        ) {
            let file = TempFile::new();
            let disk = DiskTier::create(&file.0, &layout(), 10).unwrap();
            let mut w = World {
                r: rig(20, 14, 10),
                disk,
                _file: file,
                group_of: HashMap::new(),
                next_id: 1,
                pending: Vec::new(),
            };
            for a in &actions {
                let before = snapshot(&w.r.kv);
                match w.step(a) {
                    Ok(()) => {}
                    Err(e) => {
                        prop_assert!(
                            !matches!(e, Error::CorruptBlockTable(_) | Error::DoubleFree(_)
                                | Error::UnknownSequence(_)),
                            "{a:?}: {e}"
                        );
                        prop_assert_eq!(&snapshot(&w.r.kv), &before, "{:?} failed with {} and changed state", a, e);
                    }
                }
                if let Err(msg) = w.r.kv.check_invariants() {
                    prop_assert!(false, "after {:?}: {}", a, msg);
                }
                w.verify_resident();
            }
            // Drain: finish transfers, bring everything back, compare, free it all.
            while let Some(job) = w.pending.pop() {
                w.finish(job, false);
            }
            for id in w.ids() {
                if w.r.kv.is_swapped(id) {
                    let g: Vec<SeqId> = w.group(id).into_iter().filter(|s| w.r.kv.is_swapped(*s)).collect();
                    let _ = pagedkv::executor::restore_from_disk(&mut w.r.kv, &g, &mut w.r.storage, &w.disk);
                    if w.r.kv.swap_in_group(&g).map(|j| w.finish(j, false)).is_ok() {
                        for s in g {
                            w.r.verify(s);
                        }
                    }
                }
            }
            w.verify_resident();
            for id in w.ids() {
                w.r.free(id).unwrap();
            }
            let t = w.r.kv.tier_stats();
            prop_assert_eq!((w.r.kv.stats().used_blocks, t.host_used_blocks, t.disk_used_slots), (0, 0, 0));
            w.r.kv.check_invariants().unwrap();
        }
    }
}
