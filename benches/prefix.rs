//! Prefix caching: admitting a prompt whose 1,024-token prefix is cached, beside the
//! same admission cold, a plain (cache-free) admission and the contiguous baseline;
//! the cost of a prefix lookup per block beside hashing alone; and the two block
//! hashers side by side (`prefix_block_hash`: the standard [`Xxh3Hasher`], the
//! default, against this crate's [`ChainHasher`]) at 16 tokens per block (one-shot
//! XXH3 from a stack buffer) and 128 (528 encoded bytes: streaming XXH3).
//!
//! `cargo bench --bench prefix -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pagedkv::baseline::{CacheAllocator, ContiguousCache};
use pagedkv::pool::prefix::{ChainHasher, PrefixHasher, Xxh3Hasher};
use pagedkv::{AdmitOptions, CacheConfig, DType, KvCache, KvLayout, ModelShape, SeqId};

const BLOCKS: usize = 16_384;
const BLOCK_SIZE: usize = 16;
const PREFIX_TOKENS: usize = 1024;
/// The cached prefix plus one block of new tokens.
const PROMPT_TOKENS: usize = PREFIX_TOKENS + BLOCK_SIZE;

fn layout() -> KvLayout {
    let s = ModelShape {
        num_layers: 32,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        kv_dtype: DType::BF16,
    };
    KvLayout::new(s, BLOCK_SIZE).unwrap()
}

fn manager() -> KvCache {
    let cfg = CacheConfig {
        num_blocks: BLOCKS,
        watermark_blocks: 0,
        max_seq_len_tokens: 4096,
        ..CacheConfig::new(0)
    };
    KvCache::new(layout(), cfg).unwrap()
}

fn prompt(first: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (0..PROMPT_TOKENS as u32).map(|t| t * 7 + 3).collect();
    p[0] = first;
    p
}

fn bench_prefix(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix");
    let opts = AdmitOptions::default();
    let mut slots = Vec::new();

    // Admission of a 1,040-token prompt, then free.
    g.throughput(Throughput::Elements(PROMPT_TOKENS as u64));
    {
        let mut kv = manager();
        let p = prompt(0);
        kv.admit_tokens(SeqId(0), &p, &opts, &mut slots).unwrap();
        kv.free(SeqId(0)).unwrap();
        g.bench_function("admit_1040_tokens/cached_1024_prefix", |b| {
            b.iter(|| {
                let a = kv.admit_tokens(SeqId(1), &p, &opts, &mut slots).unwrap();
                debug_assert_eq!(a.cached_tokens, PREFIX_TOKENS);
                kv.free(SeqId(1)).unwrap();
                black_box(a)
            })
        });
    }
    {
        // Every prompt new: all blocks allocated and registered; once the arena fills,
        // each admission also evicts old cached chains (the steady state).
        let mut kv = manager();
        let mut p = prompt(0);
        let mut n = 0u32;
        g.bench_function("admit_1040_tokens/cold", |b| {
            b.iter(|| {
                n = n.wrapping_add(1);
                p[0] = n;
                let a = kv.admit_tokens(SeqId(1), &p, &opts, &mut slots).unwrap();
                kv.free(SeqId(1)).unwrap();
                black_box(a)
            })
        });
    }
    {
        let mut kv = manager();
        g.bench_function("admit_1040_tokens/plain_no_cache", |b| {
            b.iter(|| {
                kv.admit(SeqId(1), PROMPT_TOKENS, &mut slots).unwrap();
                kv.free(SeqId(1)).unwrap();
            })
        });
    }
    {
        let mut cc = ContiguousCache::new(layout(), BLOCKS, 4096).unwrap();
        g.bench_function("admit_1040_tokens/contiguous_baseline", |b| {
            b.iter(|| {
                cc.admit(SeqId(1), PROMPT_TOKENS, &mut slots).unwrap();
                cc.free(SeqId(1)).unwrap();
            })
        });
    }

    // Lookup of a 64-block cached prefix, per block.
    g.throughput(Throughput::Elements((PREFIX_TOKENS / BLOCK_SIZE) as u64));
    {
        let mut kv = manager();
        let p = prompt(0);
        kv.admit_tokens(SeqId(0), &p, &opts, &mut slots).unwrap();
        let lookup = &p[..PREFIX_TOKENS + 1];
        assert_eq!(kv.cached_prefix_len(lookup, &opts).unwrap(), PREFIX_TOKENS);
        g.bench_function("lookup_64_blocks/confirmed_lookup", |b| {
            b.iter(|| black_box(kv.cached_prefix_len(black_box(lookup), &opts).unwrap()))
        });
        // The manager's hasher (the default, Xxh3Hasher) alone over the same blocks.
        let h = Xxh3Hasher;
        g.bench_function("lookup_64_blocks/hash_chain_only", |b| {
            b.iter(|| black_box(hash_chain(&h, black_box(lookup), BLOCK_SIZE)))
        });
    }
    g.finish();
}

/// The chained hash of every whole block of `tokens`, as a lookup computes it.
fn hash_chain(h: &dyn PrefixHasher, tokens: &[u32], block_size: usize) -> u64 {
    let mut last = h.namespace(b"", b"");
    for chunk in tokens.chunks_exact(block_size) {
        last = h.block(last, chunk, b"");
    }
    last.0
}

/// Xxh3Hasher (standard, recomputable by a router) beside ChainHasher (this crate's
/// own mix) over the same 1,024 tokens, per block.
fn bench_block_hash(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix_block_hash");
    let tokens: Vec<u32> = (0..PREFIX_TOKENS as u32).map(|t| t * 7 + 3).collect();
    for block_size in [BLOCK_SIZE, 128] {
        g.throughput(Throughput::Elements((PREFIX_TOKENS / block_size) as u64));
        let hashers: [(&str, &dyn PrefixHasher); 2] =
            [("xxh3", &Xxh3Hasher), ("chain_baseline", &ChainHasher)];
        for (name, h) in hashers {
            g.bench_function(format!("block_{block_size}_tokens/{name}"), |b| {
                b.iter(|| black_box(hash_chain(h, black_box(&tokens), block_size)))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench_prefix, bench_block_hash);
criterion_main!(benches);
