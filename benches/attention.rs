//! Paged decode attention vs the same kernel over a contiguous cache.
//!
//! Shape: 32 query / 4 KV heads (GQA 8), head dim 128; batch 1 and 32; contexts 512 and
//! 8192; bf16 and f32. Three variants per point, over the same data:
//!
//! * `paged`: a block table that is a random permutation of the arena (worst case for
//!   locality);
//! * `contiguous-blocks`: the same kernel and arena, but each sequence's blocks are
//!   consecutive (what `ContiguousCache` reservations give);
//! * `contiguous-tensor`: the same kernel over a plain `[batch, tokens, kv_heads, head_dim]`
//!   tensor (what an engine without paging would keep).
//!
//! Every timed call starts with cold caches (a 128 MiB buffer is written first, outside
//! the measurement): in a real engine the layers before evict a layer's KV, and without
//! this the variants that share an arena warm the cache for each other.
//!
//! After the criterion measurements, each point is also timed *interleaved* (paged,
//! contiguous-blocks, contiguous-tensor, paged, ...) and the median ratios are printed:
//! on a shared or throttled machine that is the fairer comparison.
//!
//! `PAGEDKV_BENCH_QUICK=1` shortens the measurement.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BatchSize, BenchmarkId, Criterion, SamplingMode, Throughput};
use pagedkv::attention::cpu::{contiguous_decode, paged_decode, plan_split_tokens, ContiguousKv};
use pagedkv::attention::model::SplitMix64;
use pagedkv::attention::AttentionParams;
use pagedkv::tables::PaddedTables;
use pagedkv::{DType, HostStorage, KvLayout, ModelShape};

const Q_HEADS: usize = 32;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 128;
const BLOCK: usize = 16;

/// Fills `bytes` with random values of `dtype` in [-1, 1].
fn fill(bytes: &mut [u8], dtype: DType, rng: &mut SplitMix64) {
    // A 1 MiB random pattern, repeated: cheap to make, and no cache can hold it.
    let n = (1 << 20) / dtype.size_bytes();
    let vals: Vec<f32> = (0..n).map(|_| rng.uniform(1.0)).collect();
    let mut pattern = vec![0u8; n * dtype.size_bytes()];
    pagedkv::layout::convert::encode(dtype, &vals, 1.0, &mut pattern).unwrap();
    for c in bytes.chunks_mut(pattern.len()) {
        let l = c.len();
        c.copy_from_slice(&pattern[..l]);
    }
}

struct Setup {
    storage: HostStorage,
    paged: PaddedTables,
    contiguous: PaddedTables,
    tensor_k: Vec<u8>,
    tensor_v: Vec<u8>,
    q: Vec<f32>,
}

fn setup(dtype: DType, batch: usize, ctx: usize) -> Setup {
    let shape = ModelShape {
        num_layers: 1,
        num_q_heads: Q_HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        kv_dtype: dtype,
    };
    let layout = KvLayout::new(shape, BLOCK).unwrap();
    let per_seq = layout.blocks_for_tokens(ctx);
    let num_blocks = batch * per_seq;
    let mut rng = SplitMix64::new(0x5eed);
    let mut storage = HostStorage::new(layout, num_blocks).unwrap();
    fill(storage.region_mut(0), dtype, &mut rng);
    let mut perm: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let tables = |ids: Vec<u32>| PaddedTables {
        tables: ids,
        context_lens: vec![ctx as u32; batch],
        batch,
        max_blocks: per_seq,
    };
    let bytes = batch * ctx * KV_HEADS * HEAD_DIM * dtype.size_bytes();
    let mut tensor_k = vec![0u8; bytes];
    let mut tensor_v = vec![0u8; bytes];
    fill(&mut tensor_k, dtype, &mut rng);
    fill(&mut tensor_v, dtype, &mut rng);
    Setup {
        storage,
        paged: tables(perm),
        contiguous: tables((0..num_blocks as u32).collect()),
        tensor_k,
        tensor_v,
        q: (0..batch * Q_HEADS * HEAD_DIM)
            .map(|_| rng.uniform(1.0))
            .collect(),
    }
}

/// Evicts the caches by writing a buffer larger than any last-level cache.
struct Flusher(Vec<u8>);

impl Flusher {
    fn new() -> Self {
        Flusher(vec![0; 128 << 20])
    }
    fn flush(&mut self) {
        for x in self.0.iter_mut().step_by(64) {
            *x = x.wrapping_add(1);
        }
        black_box(&self.0);
    }
}

/// Interleaved timings of the three variants: median seconds per call of each.
fn interleaved(
    s: &Setup,
    params: &AttentionParams,
    split: usize,
    rounds: usize,
    flusher: &mut Flusher,
) -> [f64; 3] {
    let batch = s.paged.batch;
    let ctx = s.paged.context_lens[0] as usize;
    let dtype = pagedkv::Storage::layout(&s.storage).dtype();
    let kvt = ContiguousKv {
        k: &s.tensor_k,
        v: &s.tensor_v,
        dtype,
        batch,
        max_tokens: ctx,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    };
    let mut out = vec![0f32; s.q.len()];
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..rounds {
        for (v, t) in times.iter_mut().enumerate() {
            flusher.flush();
            let start = Instant::now();
            match v {
                0 => paged_decode(&s.storage, 0, &s.q, &s.paged, params, &mut out, None).unwrap(),
                1 => paged_decode(&s.storage, 0, &s.q, &s.contiguous, params, &mut out, None)
                    .unwrap(),
                _ => contiguous_decode(
                    &kvt,
                    Q_HEADS,
                    &s.q,
                    &s.paged.context_lens,
                    params,
                    Some(split),
                    &mut out,
                    None,
                )
                .unwrap(),
            }
            black_box(&out);
            t.push(start.elapsed().as_secs_f64());
        }
    }
    times.map(|mut t| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    })
}

fn bench_attention(c: &mut Criterion) {
    let quick = std::env::var_os("PAGEDKV_BENCH_QUICK").is_some();
    let ratios = std::env::args().any(|a| a == "--bench");
    let mut table = Vec::new();
    let mut flusher = Flusher::new();
    let mut g = c.benchmark_group("attention");
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(if quick { 300 } else { 1000 }));
    g.measurement_time(Duration::from_millis(if quick { 1000 } else { 3000 }));
    let params = AttentionParams::new(HEAD_DIM);
    let threads = rayon::current_num_threads();
    // `cargo test --benches` runs each benchmark once, in a debug build: one small point.
    let (batches, ctxs): (&[usize], &[usize]) = if ratios {
        (&[1, 32], &[512, 8192])
    } else {
        (&[1], &[512])
    };
    for dtype in [DType::BF16, DType::F32] {
        for &batch in batches {
            for &ctx in ctxs {
                let s = setup(dtype, batch, ctx);
                let kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * dtype.size_bytes();
                g.throughput(Throughput::Bytes(kv_bytes as u64));
                let split = plan_split_tokens(&s.paged.context_lens, KV_HEADS, BLOCK, threads);
                let mut out = vec![0f32; s.q.len()];
                let point = format!("{dtype}/b{batch}/ctx{ctx}");
                for (name, tables) in [("paged", &s.paged), ("contiguous-blocks", &s.contiguous)] {
                    g.bench_with_input(BenchmarkId::new(name, &point), tables, |b, t| {
                        b.iter_batched(
                            || flusher.flush(),
                            |()| {
                                paged_decode(
                                    &s.storage,
                                    0,
                                    black_box(&s.q),
                                    t,
                                    &params,
                                    &mut out,
                                    None,
                                )
                                .unwrap();
                                black_box(&out);
                            },
                            BatchSize::PerIteration,
                        )
                    });
                }
                let kvt = ContiguousKv {
                    k: &s.tensor_k,
                    v: &s.tensor_v,
                    dtype,
                    batch,
                    max_tokens: ctx,
                    num_kv_heads: KV_HEADS,
                    head_dim: HEAD_DIM,
                };
                g.bench_with_input(
                    BenchmarkId::new("contiguous-tensor", &point),
                    &kvt,
                    |b, kvt| {
                        b.iter_batched(
                            || flusher.flush(),
                            |()| {
                                contiguous_decode(
                                    kvt,
                                    Q_HEADS,
                                    black_box(&s.q),
                                    &s.paged.context_lens,
                                    &params,
                                    Some(split),
                                    &mut out,
                                    None,
                                )
                                .unwrap();
                                black_box(&out);
                            },
                            BatchSize::PerIteration,
                        )
                    },
                );
                if ratios {
                    let rounds = if batch * ctx >= 32 * 8192 { 7 } else { 31 };
                    table.push((point, interleaved(&s, &params, split, rounds, &mut flusher)));
                }
            }
        }
    }
    g.finish();
    if ratios {
        println!("\ninterleaved medians ({threads} threads): paged / contiguous");
        println!(
            "{:<22} {:>12} {:>12} {:>12} {:>10} {:>10}",
            "point", "paged", "contig-blk", "contig-tns", "p/blk", "p/tns"
        );
        for (p, [a, b, c]) in table {
            println!(
                "{p:<22} {:>10.3}ms {:>10.3}ms {:>10.3}ms {:>10.3} {:>10.3}",
                a * 1e3,
                b * 1e3,
                c * 1e3,
                a / b,
                a / c
            );
        }
    }
}

criterion_group!(benches, bench_attention);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
