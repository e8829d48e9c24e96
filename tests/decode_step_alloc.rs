//! The host half of a capturable decode step (`stage_decode_step`, what
//! `DecodeGraphStep::stage` runs) allocates nothing: a counting global allocator
//! watches a 2,000-step decode trace whose batch, lengths and split plans change every
//! step, refused steps included. Runs without a GPU.

use pagedkv::attention::{stage_decode_step, StepCapacity};
use pagedkv::tables::PaddedTables;
use pagedkv::{DType, KvLayout, ModelShape};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Allocations (and reallocations) made by this thread.
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

fn bump() {
    // `try_with`: a thread being torn down has no counter left; it is not the test's.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards every call to the system allocator unchanged; the counter is a
// const-initialised thread local that never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bump();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        bump();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        bump();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> usize {
    ALLOCS.with(Cell::get)
}

#[test]
fn staging_a_step_allocates_nothing() {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 64,
        num_kv_heads: 8,
        head_dim: 128,
        kv_dtype: DType::BF16,
    };
    let layout = KvLayout::new(shape, 16).unwrap();
    let cap = StepCapacity {
        max_batch: 64,
        max_blocks_per_seq: 320,
        max_splits: 8,
    };
    let num_blocks = 64 * 320;
    // Every buffer of the trace is made before counting starts; the step reuses them.
    let mut staging = vec![0u32; cap.staging_words()];
    let mut tables = PaddedTables {
        tables: vec![0; 64 * 320],
        context_lens: Vec::with_capacity(65),
        batch: 0,
        max_blocks: 320,
    };
    for (i, id) in tables.tables.iter_mut().enumerate() {
        *id = ((i * 7919) % num_blocks) as u32;
    }
    let mut plans = [0usize; 9];
    let mut refused = 0;
    let before = allocs();
    for step in 0..2000usize {
        // Batch 1..=64 and lengths 0..~5000 changing every step; every 97th step
        // asks for 65 sequences, over the capacity.
        let batch = if step % 97 == 96 {
            65
        } else {
            1 + step * 37 % 64
        };
        tables.batch = batch;
        tables.context_lens.clear();
        tables
            .context_lens
            .extend((0..batch).map(|i| ((step * 131 + i * 977) % 5000) as u32));
        tables.max_blocks = if batch > 64 { 1 } else { 320 };
        if batch > 64 {
            tables.context_lens.iter_mut().for_each(|l| *l = 1);
            tables.tables.truncate(65);
        }
        match stage_decode_step(
            &layout,
            num_blocks,
            &cap,
            &tables,
            None,
            132,
            3,
            &mut staging,
        ) {
            Ok(st) => plans[st.plan.num_splits as usize] += 1,
            Err(_) => refused += 1,
        }
        if batch > 64 {
            // Back to the full table without allocating: truncate kept the capacity.
            tables.tables.resize(64 * 320, 0);
        }
    }
    let counted = allocs() - before;
    assert_eq!(
        counted, 0,
        "the host half of 2,000 steps allocated {counted} times"
    );
    // The counter does count: one allocation of this thread shows.
    let probe: Vec<u8> = std::hint::black_box(Vec::with_capacity(1));
    assert_eq!(allocs() - before, 1);
    drop(probe);
    // The trace did exercise different plans and the refusal path.
    assert!(refused >= 20, "{refused}");
    assert!(plans.iter().filter(|&&n| n > 0).count() >= 2, "{plans:?}");
}

/// The step path engines use (`reserve_step` into `StepBuffers`, `commit_step`)
/// allocates nothing once its batch is admitted and the tables' capacity is set
/// (`CacheConfig::table_capacity_blocks`): 48 sequences decode 400 steps, crossing
/// dozens of block boundaries each, with forks sharing last blocks (copy-on-write
/// every step a sibling writes), speculative steps that commit part of their drafts,
/// and refused steps (a duplicate in the batch).
#[test]
fn the_step_path_allocates_nothing_once_admitted() {
    use pagedkv::{CacheConfig, KvCache, SeqId, StepBuffers, StepEntry};
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        kv_dtype: DType::F16,
    };
    let layout = KvLayout::new(shape, 16).unwrap();
    let max_len = 2_048;
    let cfg = CacheConfig {
        watermark_blocks: 0,
        max_seq_len_tokens: max_len,
        table_capacity_blocks: max_len / 16,
        ..CacheConfig::new(48 * max_len / 16)
    };
    let mut kv = KvCache::new(layout, cfg).unwrap();
    let mut slots = Vec::new();
    let mut handles = Vec::new();
    for i in 0..48u64 {
        if i % 4 == 3 {
            // A fork of the sequence before it: their last block is shared.
            kv.fork(SeqId(i - 1), SeqId(i)).unwrap();
        } else {
            kv.admit(SeqId(i), 17 + 7 * i as usize, &mut slots).unwrap();
        }
        handles.push(kv.handle(SeqId(i)).unwrap());
    }
    let mut step = StepBuffers::new(64, 256, max_len / 16);
    let mut entries = Vec::with_capacity(64);
    let mut accepted = Vec::with_capacity(64);
    let mut refused = 0;
    let mut before = allocs();
    for t in 0..400usize {
        if t == 1 {
            // Step 0 is the warm-up: the buffers' and the pool's first use.
            before = allocs();
        }
        entries.clear();
        entries.extend(handles.iter().enumerate().map(|(i, &seq)| StepEntry {
            seq,
            // Every fifth sequence verifies 3 drafts.
            new_tokens: if i % 5 == 0 { 4 } else { 1 },
            lookahead: 0,
        }));
        if t % 40 == 39 {
            entries.push(entries[0]);
            assert!(kv.reserve_step(&entries, &mut step).is_err());
            refused += 1;
            continue;
        }
        kv.reserve_step(&entries, &mut step).unwrap();
        accepted.clear();
        accepted.extend(entries.iter().map(|e| (e.seq, 1 + (t % e.new_tokens))));
        kv.commit_step(&accepted).unwrap();
    }
    let counted = allocs() - before;
    assert_eq!(counted, 0, "399 steps allocated {counted} times");
    kv.check_invariants().unwrap();
    assert!(refused >= 10);
    assert!(kv.num_computed_tokens(SeqId(0)).unwrap() > 17 + 400);
}

/// The same of a hybrid cache (a full and a window group over one arena,
/// `reserve_step_grouped` into one `StepBuffers` per group, `commit_step`): 300 steps
/// that cross block boundaries, release window blocks and move pages between the
/// groups allocate nothing once the sequences are admitted.
#[test]
fn the_hybrid_step_path_allocates_nothing_once_admitted() {
    use pagedkv::{GroupSpec, GroupStep, KvCache, SeqId, StepBuffers, StepEntry};
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        kv_dtype: DType::F16,
    };
    let layout = KvLayout::new(shape, 16).unwrap();
    let width = 1_024 / 16;
    let specs = [GroupSpec::full(layout), GroupSpec::window(layout, 64)];
    let mut kv = KvCache::hybrid(&specs, 2 * 32 * width)
        .unwrap()
        .with_watermark_blocks(0)
        .unwrap()
        .with_table_capacity_blocks(width);
    let mut group_step = GroupStep::default();
    let mut handles = Vec::new();
    for i in 0..32u64 {
        kv.admit_grouped(SeqId(i), 17 + 9 * i as usize, &mut group_step)
            .unwrap();
        handles.push(kv.handle(SeqId(i)).unwrap());
    }
    let mut bufs = [
        StepBuffers::new(32, 128, width),
        StepBuffers::new(32, 128, width),
    ];
    let mut entries = Vec::with_capacity(32);
    let mut accepted = Vec::with_capacity(32);
    let mut before = allocs();
    for t in 0..300usize {
        if t == 1 {
            before = allocs();
        }
        entries.clear();
        entries.extend(handles.iter().enumerate().map(|(i, &seq)| StepEntry {
            seq,
            new_tokens: if i % 5 == 0 { 3 } else { 1 },
            lookahead: 0,
        }));
        kv.reserve_step_grouped(&entries, &mut bufs).unwrap();
        accepted.clear();
        accepted.extend(entries.iter().map(|e| (e.seq, 1 + (t % e.new_tokens))));
        kv.commit_step(&accepted).unwrap();
    }
    let counted = allocs() - before;
    assert_eq!(counted, 0, "299 hybrid steps allocated {counted} times");
    kv.check_invariants().unwrap();
    assert!(kv.group_stats().page_moves > 0);
    assert!(kv.num_computed_tokens(SeqId(0)).unwrap() > 17 + 300);
}
