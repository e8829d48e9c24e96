//! Allocator operations, paged beside the contiguous-reservation baseline.
//!
//! `cargo bench --bench allocator`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use pagedkv::baseline::{CacheAllocator, ContiguousCache};
use pagedkv::{CacheConfig, CopyPlan, DType, KvCache, KvLayout, ModelShape, SeqId};

const BLOCKS: usize = 16_384;
const MAX_LEN: usize = 2048;

fn layout() -> KvLayout {
    let s = ModelShape {
        num_layers: 32,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        kv_dtype: DType::BF16,
    };
    KvLayout::new(s, 16).unwrap()
}

fn paged() -> KvCache {
    let cfg = CacheConfig {
        num_blocks: BLOCKS,
        watermark_blocks: 0,
        max_seq_len_tokens: MAX_LEN,
        ..CacheConfig::new(0)
    };
    KvCache::new(layout(), cfg).unwrap()
}

fn contiguous() -> ContiguousCache {
    ContiguousCache::new(layout(), BLOCKS, MAX_LEN).unwrap()
}

fn allocators() -> [Box<dyn CacheAllocator>; 2] {
    [Box::new(paged()), Box::new(contiguous())]
}

/// Admit and free a one-block sequence, with 32 other sequences resident.
fn alloc_free_churn(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free");
    for mut a in allocators() {
        let mut slots = Vec::new();
        for i in 0..32 {
            a.admit(SeqId(1_000 + i), 100, &mut slots).unwrap();
        }
        g.bench_function(a.name(), |b| {
            b.iter(|| {
                a.admit(SeqId(1), black_box(16), &mut slots).unwrap();
                a.free(SeqId(1)).unwrap();
            })
        });
    }
    g.finish();
}

/// Decode: 64 sequences append one token each per step, 256 steps; time per token.
fn decode_trace(c: &mut Criterion) {
    const SEQS: u64 = 64;
    const STEPS: usize = 256;
    let mut g = c.benchmark_group("decode_append");
    g.throughput(Throughput::Elements(SEQS * STEPS as u64));
    for name in ["paged", "contiguous"] {
        g.bench_function(name, |b| {
            b.iter_batched_ref(
                || {
                    let mut a: Box<dyn CacheAllocator> = if name == "paged" {
                        Box::new(paged())
                    } else {
                        Box::new(contiguous())
                    };
                    let mut slots = Vec::new();
                    for s in 0..SEQS {
                        a.admit(SeqId(s), 200, &mut slots).unwrap();
                    }
                    (a, slots, CopyPlan::new())
                },
                |(a, slots, copies)| {
                    for _ in 0..STEPS {
                        for s in 0..SEQS {
                            a.append(SeqId(s), 1, slots, copies).unwrap();
                        }
                    }
                    black_box(slots.len());
                },
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

/// Fork a 1,000-token sequence and free the child.
fn fork(c: &mut Criterion) {
    let mut g = c.benchmark_group("fork");
    for mut a in allocators() {
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::new());
        a.admit(SeqId(0), 1000, &mut slots).unwrap();
        g.bench_function(a.name(), |b| {
            b.iter(|| {
                copies.clear();
                a.fork(SeqId(0), SeqId(1), &mut copies).unwrap();
                a.free(SeqId(1)).unwrap();
                black_box(copies.len());
            })
        });
    }
    g.finish();
}

criterion_group!(benches, alloc_free_churn, decode_trace, fork);
criterion_main!(benches);
