//! Stream ordering between `CudaStorage` and reads of its arena on other streams:
//! each test holds one stream behind a gate (a host function that blocks it until a
//! timer opens it) so that work queued behind the gate runs late, then checks that what
//! the other stream did waited for it by event, not by luck:
//!
//! - a decode on a caller's stream after a gated K/V write reads the new K/V;
//! - a graph step's replay after a gated write reads the new K/V;
//! - a swap-in and a K/V write (a freed block reused) wait for a gated decode still
//!   reading the blocks on another stream;
//! - a shrink waits for a gated decode still reading the tail it unmaps (run under
//!   memcheck too: `.ci/gpu-check --memcheck`).
//!
//! Without the ordering each of these reads the wrong bytes (or unmapped memory). They
//! need a GPU and skip with a visible message without one; none has run on a GPU yet.

use crate::support::cuda;

use cuda::{storage_or_skip, Rng};
use cudarc::driver::{CudaSlice, CudaStream};
use pagedkv::attention::cuda::{CudaAttention, DeviceTables, Outputs, Queries, Tables};
use pagedkv::attention::{AttentionParams, StepCapacity};
use pagedkv::executor::storage::{CudaStorage, CudaStorageConfig};
use pagedkv::layout::plans::SwapDirection;
use pagedkv::layout::Slot;
use pagedkv::tables::PaddedTables;
use pagedkv::{BlockId, DType, KvLayout, ModelShape, Storage, SwapPlan};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LAYER: usize = 0;
const BS: usize = 16;
/// How long a gate holds its stream: long against a launch, short against the lease.
const HOLD: Duration = Duration::from_millis(400);

/// f32, head dim 128, GQA 8 (one KV head), 16-token pages: a prebuilt specialisation.
fn layout() -> KvLayout {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 8,
        num_kv_heads: 1,
        head_dim: 128,
        kv_dtype: DType::F32,
    };
    KvLayout::new(shape, BS).unwrap()
}

/// A gate on a stream: a host function enqueued on it that returns once the gate is
/// open, so everything queued on the stream after it waits.
struct Gate(Arc<AtomicBool>);

unsafe extern "C" fn wait_for_gate(data: *mut c_void) {
    // SAFETY: `data` is the `Arc` leaked by `Gate::hold` for this one call.
    let open = unsafe { Arc::from_raw(data as *const AtomicBool) };
    let t0 = Instant::now();
    // A bound, so a broken test cannot hang the lease.
    while !open.load(Ordering::Acquire) && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Gate {
    /// Holds `stream` until [`Self::open_after`]'s timer fires.
    fn hold(stream: &CudaStream) -> Gate {
        let open = Arc::new(AtomicBool::new(false));
        let data = Arc::into_raw(open.clone()) as *mut c_void;
        // SAFETY: the host function takes ownership of one reference to `open`
        // (released when it returns); it makes no CUDA call.
        unsafe {
            cudarc::driver::sys::cuLaunchHostFunc(stream.cu_stream(), Some(wait_for_gate), data)
        }
        .result()
        .unwrap();
        Gate(open)
    }

    /// Opens the gate from another thread after `HOLD`, so host calls that block on the
    /// gated work in the meantime (a shrink) cannot deadlock the test.
    fn open_after(self) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            std::thread::sleep(HOLD);
            self.0.store(true, Ordering::Release);
        })
    }
}

struct Setup {
    storage: CudaStorage,
    attn: CudaAttention,
    reader: Arc<CudaStream>,
    padded: PaddedTables,
    tables: DeviceTables,
    q: Vec<f32>,
    params: AttentionParams,
    /// Slots of the sequence's tokens, in order.
    slots: Vec<Slot>,
}

/// One sequence of `context` tokens in `blocks`, random K/V written and synchronised
/// unless `leave_zero`; tables uploaded; a caller's stream.
fn setup(
    test: &str,
    config: CudaStorageConfig,
    blocks: &[u32],
    context: usize,
    leave_zero: bool,
) -> Option<Setup> {
    let l = layout();
    let mut storage = storage_or_skip(test, l, config)?;
    let attn = CudaAttention::new(&storage).unwrap();
    let reader = storage.context().new_stream().unwrap();
    let padded = PaddedTables {
        tables: blocks.to_vec(),
        context_lens: vec![context as u32],
        batch: 1,
        max_blocks: blocks.len(),
    };
    let tables = attn
        .upload_tables(&storage, Tables::Padded(&padded))
        .unwrap();
    let mut rng = Rng(0x5eed ^ context as u64);
    let q: Vec<f32> = (0..8 * 128).map(|_| rng.f32()).collect();
    let slots: Vec<Slot> = (0..context)
        .map(|p| Slot((blocks[p / BS] as usize * BS + p % BS) as u64))
        .collect();
    if !leave_zero {
        let (k, v) = random_kv(&mut rng, context);
        storage.write_slots(LAYER, &slots, &k, &v).unwrap();
    }
    storage.sync_compute().unwrap();
    Some(Setup {
        storage,
        attn,
        reader,
        padded,
        tables,
        q,
        params: AttentionParams::new(128),
        slots,
    })
}

fn random_kv(rng: &mut Rng, tokens: usize) -> (Vec<u8>, Vec<u8>) {
    let mut one = || -> Vec<u8> {
        (0..tokens * 128)
            .flat_map(|_| rng.f32().to_le_bytes())
            .collect()
    };
    (one(), one())
}

/// The decode of the whole sequence on the compute stream, waited for.
fn decode_now(s: &mut Setup) -> Vec<f32> {
    let (out, _) = s
        .attn
        .decode_host(
            &s.storage,
            LAYER,
            &s.q,
            Tables::Padded(&s.padded),
            &s.params,
            Some(1),
        )
        .unwrap();
    assert!(
        out.iter().any(|&x| x != 0.0),
        "a zero output would hide the race"
    );
    out
}

/// Enqueues the decode on the reader stream (no wait) and returns its output buffer.
fn decode_on_reader(s: &mut Setup) -> CudaSlice<f32> {
    let d_q = s.reader.clone_htod(&s.q).unwrap();
    let mut out = s.reader.alloc_zeros::<f32>(s.q.len()).unwrap();
    let mut lse = s.reader.alloc_zeros::<f32>(8).unwrap();
    s.attn
        .decode_io_on(
            &s.storage,
            &s.reader,
            LAYER,
            Queries::F32(&d_q),
            &s.tables,
            &s.params,
            Some(1),
            Outputs::F32(&mut out),
            &mut lse,
        )
        .unwrap();
    out
}

fn read_back(stream: &Arc<CudaStream>, out: &CudaSlice<f32>) -> Vec<f32> {
    let v = stream.clone_dtoh(out).unwrap();
    stream.synchronize().unwrap();
    v
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// New K/V for `slots`, uploaded to the device and synchronised before any gate, so
/// the write itself is one kernel launch with nothing to wait for on the host.
fn device_kv(s: &Setup, seed: u64) -> (CudaSlice<u64>, CudaSlice<u8>, CudaSlice<u8>) {
    let (k, v) = random_kv(&mut Rng(seed), s.slots.len());
    let c = s.storage.compute_stream();
    let ids: Vec<u64> = s.slots.iter().map(|s| s.0).collect();
    let out = (
        c.clone_htod(&ids).unwrap(),
        c.clone_htod(&k).unwrap(),
        c.clone_htod(&v).unwrap(),
    );
    c.synchronize().unwrap();
    out
}

/// The common case: 60 tokens in blocks 3, 9, 5, 12 of a 64-block arena.
fn small(test: &str, leave_zero: bool) -> Option<Setup> {
    setup(
        test,
        CudaStorageConfig::blocks(64),
        &[3, 9, 5, 12],
        60,
        leave_zero,
    )
}

/// Holds the compute stream behind a gate and queues new K/V for the sequence's slots
/// behind it (one kernel launch; the data went up before the gate).
fn gated_write(s: &mut Setup, seed: u64) -> Gate {
    let (slots, k, v) = device_kv(s, seed);
    let gate = Gate::hold(s.storage.compute_stream());
    let n = s.slots.len();
    s.storage
        .reshape_and_cache_device(LAYER, &slots, &k, &v, n, DType::F32, 1.0, 1.0)
        .unwrap();
    gate
}

#[test]
fn a_decode_on_another_stream_waits_for_a_gated_write() {
    let test = "a_decode_on_another_stream_waits_for_a_gated_write";
    let Some(mut s) = small(test, true) else {
        return;
    };
    let gate = gated_write(&mut s, 11);
    // Enqueued while the write still waits behind the gate: without an event wait on
    // the compute stream it would read the zeroed arena.
    let out = decode_on_reader(&mut s);
    let opener = gate.open_after();
    let got = read_back(&s.reader, &out);
    opener.join().unwrap();
    let want = decode_now(&mut s);
    assert_eq!(
        bits(&got),
        bits(&want),
        "the decode did not see the write queued before it"
    );
}

#[test]
fn a_graph_step_replay_waits_for_a_gated_write() {
    let test = "a_graph_step_replay_waits_for_a_gated_write";
    let Some(mut s) = small(test, true) else {
        return;
    };
    let cap = StepCapacity {
        max_batch: 1,
        max_blocks_per_seq: 8,
        max_splits: 4,
    };
    let mut step = s
        .attn
        .graph_step(&s.storage, &s.reader, cap, &s.params)
        .unwrap();
    step.stage(&s.storage, &s.padded).unwrap();
    step.stage_queries(&s.q).unwrap();
    step.capture(&s.storage, &[LAYER], true).unwrap();
    let gate = gated_write(&mut s, 12);
    step.replay(&s.storage).unwrap();
    let opener = gate.open_after();
    let got = read_back(&s.reader, step.outputs().0);
    opener.join().unwrap();
    // Another kernel path (fixed grid, its own split plan): equal within rounding.
    let want = decode_now(&mut s);
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * scale + 1e-6,
            "element {i}: replay {g}, want {w}"
        );
    }
    // Dropping the step waits for its stream (its staging is read by raw pointer).
    drop(step);
    s.storage.context().check_err().unwrap();
}

#[test]
fn a_swap_in_waits_for_a_decode_still_reading_on_another_stream() {
    let test = "a_swap_in_waits_for_a_decode_still_reading_on_another_stream";
    let config = CudaStorageConfig {
        host_blocks: 4,
        ..CudaStorageConfig::blocks(64)
    };
    let Some(mut s) = setup(test, config, &[3, 9, 5, 12], 60, false) else {
        return;
    };
    let want = decode_now(&mut s);
    // Other bytes in the host tier, swapped over blocks 9 and 5 while the read waits.
    let mut rng = Rng(13);
    for h in 0..2 {
        let bytes = rng.bytes(s.storage.layout().block_bytes());
        let floats: Vec<u8> = bytes
            .chunks(4)
            .flat_map(|c| (c[0] as f32 / 64.0).to_le_bytes())
            .collect();
        s.storage
            .write_host_block(BlockId(h), &floats[..bytes.len()])
            .unwrap();
    }
    let mut plan = SwapPlan::new(SwapDirection::In);
    plan.push(BlockId(0), BlockId(9));
    plan.push(BlockId(1), BlockId(5));
    let gate = Gate::hold(&s.reader);
    let out = decode_on_reader(&mut s);
    assert!(s.storage.foreign_readers() >= 1);
    s.storage.swap(&plan).unwrap();
    let opener = gate.open_after();
    let got = read_back(&s.reader, &out);
    opener.join().unwrap();
    s.storage.sync_transfers().unwrap();
    assert_eq!(
        bits(&got),
        bits(&want),
        "the swap-in overwrote blocks a decode was reading"
    );
    // And the swap did land: the decode now differs.
    let after = decode_now(&mut s);
    assert_ne!(bits(&after), bits(&want));
}

#[test]
fn a_write_into_a_reused_block_waits_for_a_decode_still_reading_it() {
    let test = "a_write_into_a_reused_block_waits_for_a_decode_still_reading_it";
    let Some(mut s) = small(test, false) else {
        return;
    };
    let want = decode_now(&mut s);
    let gate = Gate::hold(&s.reader);
    let out = decode_on_reader(&mut s);
    // The manager freed the sequence and handed its blocks to another: new K/V land in
    // the same slots on the compute stream, which is not gated.
    let (k, v) = random_kv(&mut Rng(14), s.slots.len());
    let slots = s.slots.clone();
    s.storage.write_slots(LAYER, &slots, &k, &v).unwrap();
    let opener = gate.open_after();
    let got = read_back(&s.reader, &out);
    opener.join().unwrap();
    assert_eq!(
        bits(&got),
        bits(&want),
        "the write overwrote blocks a decode was reading"
    );
}

#[test]
fn a_shrink_waits_for_a_decode_still_reading_the_tail() {
    let test = "a_shrink_waits_for_a_decode_still_reading_the_tail";
    // One-granule chunks, so the shrink really unmaps the tail the decode reads.
    let probe = CudaStorageConfig {
        granule_chunks: true,
        ..CudaStorageConfig::blocks(1)
    };
    let Some(p) = storage_or_skip(test, layout(), probe) else {
        return;
    };
    let granule = p.mapping_granule_bytes().unwrap();
    drop(p);
    let per_granule = granule / layout().block_bytes_per_layer();
    let blocks = 4 * per_granule;
    let config = CudaStorageConfig {
        granule_chunks: true,
        ..CudaStorageConfig::blocks(blocks)
    };
    let tail: Vec<u32> = (0..4).map(|i| (blocks - 1 - 3 * i) as u32).collect();
    let Some(mut s) = setup(test, config, &tail, 60, false) else {
        return;
    };
    let want = decode_now(&mut s);
    let gate = Gate::hold(&s.reader);
    let out = decode_on_reader(&mut s);
    let opener = gate.open_after();
    let t0 = Instant::now();
    s.storage.resize(per_granule).unwrap();
    let waited = t0.elapsed();
    let got = read_back(&s.reader, &out);
    opener.join().unwrap();
    assert_eq!(
        s.storage.mapped_bytes(LAYER).unwrap().0,
        granule,
        "the tail was unmapped"
    );
    assert!(
        waited >= HOLD / 2,
        "the shrink returned after {waited:?}, before the gated decode could have finished"
    );
    assert_eq!(
        bits(&got),
        bits(&want),
        "the decode read the tail after it was unmapped"
    );
    assert_eq!(
        s.storage.foreign_readers(),
        0,
        "a shrink leaves no read in flight"
    );
}
