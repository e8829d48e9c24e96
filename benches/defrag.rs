//! Defragmentation: planning time on a 1M-block arena, and plan execution bandwidth.
//!
//! Each measurement sits beside its baseline in the same group:
//! - `plan/*`: the compaction planner (and plan + table commit) against one pass that
//!   only reads every block-table entry, the floor for any planner that remaps tables;
//! - `execute/*`: `HostStorage::copy_blocks` of a compaction plan against one
//!   `copy_from_slice` of the same number of bytes.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use pagedkv::manager::DefragOptions;
use pagedkv::{
    CacheConfig, CopyPlan, DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId, Storage,
};
use std::hint::black_box;

/// A small deterministic generator so runs are comparable.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

fn layout(num_kv_heads: usize, head_dim: usize) -> KvLayout {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: num_kv_heads,
        num_kv_heads,
        head_dim,
        kv_dtype: DType::BF16,
    };
    KvLayout::new(shape, 16).expect("valid layout")
}

/// A full arena of `num_seqs` sequences decoded in lockstep (so tables interleave),
/// then a random half of them freed: about 50 % of the blocks live, scattered.
fn scattered(layout: KvLayout, num_blocks: usize, num_seqs: usize) -> KvCache {
    let mut config = CacheConfig::new(num_blocks);
    config.watermark_blocks = 0;
    let mut kv = KvCache::new(layout, config).expect("manager");
    let mut slots = Vec::new();
    let mut copies = CopyPlan::new();
    let bs = layout.block_size();
    for s in 0..num_seqs {
        kv.admit(SeqId(s as u64), bs, &mut slots).expect("admit");
    }
    for _ in 1..num_blocks / num_seqs {
        for s in 0..num_seqs {
            kv.append(SeqId(s as u64), bs, &mut slots, &mut copies)
                .expect("append");
        }
    }
    let mut rng = Lcg(42);
    let mut freed = 0;
    while freed < num_seqs / 2 {
        let s = SeqId(rng.next() % num_seqs as u64);
        if kv.contains(s) {
            kv.free(s).expect("free");
            freed += 1;
        }
    }
    kv
}

fn defrag(c: &mut Criterion) {
    let mut g = c.benchmark_group("defrag");
    g.sample_size(10);

    // ---- planning: 1M blocks, 50 % scattered ----------------------------------------
    let num_blocks = 1 << 20;
    let mut kv = scattered(layout(1, 8), num_blocks, 1024);
    let f = kv.fragmentation();
    eprintln!(
        "plan arena: {} blocks, {} live, high water {}, fragmentation {:.3}, {} moves to compact",
        f.num_blocks, f.live_blocks, f.high_water_blocks, f.fragmentation, f.moves_to_compact
    );
    let seqs: Vec<SeqId> = kv.sequence_ids().collect();
    g.throughput(Throughput::Elements(num_blocks as u64));
    g.bench_function("plan/1M_blocks/pagedkv_plan", |b| {
        b.iter(|| {
            let pending = kv.plan_defragment(DefragOptions::FULL).expect("plan");
            black_box(pending.plan().len())
        })
    });
    g.bench_function("plan/1M_blocks/pagedkv_plan_and_commit", |b| {
        b.iter_batched_ref(
            || kv.clone(),
            |kv| {
                let pending = kv.plan_defragment(DefragOptions::FULL).expect("plan");
                black_box(pending.commit().expect("commit").len())
            },
            BatchSize::LargeInput,
        )
    });
    g.bench_function("plan/1M_blocks/baseline_read_every_table_entry", |b| {
        b.iter(|| {
            let mut sum = 0u64;
            for &s in &seqs {
                for blk in kv.block_table(s).expect("table") {
                    sum = sum.wrapping_add(u64::from(blk.0));
                }
            }
            black_box(sum)
        })
    });
    drop(kv);

    // ---- execution: compaction plan on HostStorage vs one memcpy --------------------
    // 64 KiB blocks (8 KV heads x head dim 128 x 16 tokens, bf16, K and V), 2048 of
    // them: a 128 MiB arena; single-block sequences make the moves scattered.
    let layout = layout(8, 128);
    let num_blocks = 2048;
    let mut kv = scattered(layout, num_blocks, num_blocks);
    let mut storage = HostStorage::new(layout, num_blocks).expect("storage");
    let plan = kv
        .plan_defragment(DefragOptions::FULL)
        .expect("plan")
        .plan()
        .to_copy_plan();
    let bytes = plan.len() * layout.block_bytes();
    eprintln!(
        "execute: {} moves of {} KiB = {} MiB, {} merged runs",
        plan.len(),
        layout.block_bytes() / 1024,
        bytes >> 20,
        pagedkv::layout::plans::merge_runs(plan.copies().iter().map(|c| (c.src.0, c.dst.0))).len()
    );
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("execute/pagedkv_copy_blocks", |b| {
        b.iter(|| storage.copy_blocks(black_box(&plan)).expect("copy"))
    });
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    g.bench_function("execute/baseline_one_memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    g.finish();
}

criterion_group!(benches, defrag);
criterion_main!(benches);
