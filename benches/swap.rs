//! Swap plan execution on `HostStorage` against one `memcpy` of the same bytes, and the
//! effect of run merging (scattered vs consecutive blocks).
//!
//! Run: `cargo bench --bench swap -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv::layout::plans::SwapDirection;
use pagedkv::{BlockId, DType, HostStorage, KvLayout, ModelShape, Storage, SwapPlan};

const BLOCKS: usize = 1024;

/// Two layers of a GQA model in 16-token pages, `kv_heads` KV heads of `head_dim`
/// (bf16): one block of one layer, the length of one contiguous run of a scattered
/// plan, is `2 * kv_heads * 16 * head_dim * 2` bytes.
fn layout(kv_heads: usize, head_dim: usize) -> KvLayout {
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 4 * kv_heads,
        num_kv_heads: kv_heads,
        head_dim,
        kv_dtype: DType::BF16,
    };
    KvLayout::new(shape, 16).expect("valid layout")
}

/// A permutation of `0..n` from a fixed-seed generator (no `rand` dependency).
fn shuffled(n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn plan(device: &[u32]) -> SwapPlan {
    let mut p = SwapPlan::new(SwapDirection::Out);
    for (h, &d) in device.iter().enumerate() {
        p.push(BlockId(d), BlockId(h as u32));
    }
    p
}

fn swap(c: &mut Criterion) {
    let mut g = c.benchmark_group("swap");
    g.sample_size(20);
    // 32 KiB runs (4 KV heads x 128) and 4 KiB runs (1 KV head x 64).
    for (kv_heads, head_dim) in [(4, 128), (1, 64)] {
        let l = layout(kv_heads, head_dim);
        let run_kib = format!("{}KiB", l.block_bytes_per_layer() / 1024);
        let bytes = BLOCKS * l.block_bytes();
        let mut storage = HostStorage::with_host_tier(l, BLOCKS, BLOCKS).expect("storage");
        for layer in 0..l.num_layers() {
            for (i, b) in storage.region_mut(layer).iter_mut().enumerate() {
                *b = i as u8;
            }
        }
        let scattered = plan(&shuffled(BLOCKS));
        let consecutive = plan(&(0..BLOCKS as u32).collect::<Vec<_>>());
        println!(
            "swap/{run_kib}: {BLOCKS} blocks, {} MiB; runs: scattered {}, consecutive {}",
            bytes >> 20,
            scattered.runs().len(),
            consecutive.runs().len()
        );
        let src = vec![7u8; bytes];
        let mut dst = vec![0u8; bytes];
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(BenchmarkId::new("memcpy", &run_kib), |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&dst);
            })
        });
        g.bench_function(BenchmarkId::new("plan_scattered", &run_kib), |b| {
            b.iter(|| storage.swap(black_box(&scattered)).expect("swap"))
        });
        g.bench_function(BenchmarkId::new("plan_consecutive", &run_kib), |b| {
            b.iter(|| storage.swap(black_box(&consecutive)).expect("swap"))
        });
    }
    g.finish();
}

criterion_group!(benches, swap);
criterion_main!(benches);
