//! The host tier as a level of the prefix cache, on a multi-turn chat trace whose device
//! cache is too small to keep a conversation between its turns.
//!
//! The trace, generated from a fixed seed: 16 conversations of 3-5 turns, each starting
//! with one of 4 shared system prompts (192-384 tokens); a turn sends the whole history
//! so far (system prompt, every earlier user message and answer) plus a new user message
//! (24-96 tokens) and gets an answer (32-128 tokens). Turns are served round-robin over
//! the conversations (each round in a shuffled order), one request at a time, so 15
//! other requests pass between two turns of a conversation. The KV shape is
//! Llama-3-8B's (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token, 2 MiB per
//! 16-token block); the device arena holds 96 blocks (1,536 tokens, about one and a half
//! conversations), the host tier 1,024 blocks.
//!
//! The same trace runs, in one process, through the device-only prefix cache (host
//! level off) and through device + host level with three store policies
//! (write-through, write-back of the 64 blocks nearest eviction, selective with
//! `min_hits: 1`). Every load and store plan is executed on `HostStorage` (all 32
//! layers of every block are copied between its arena and its host tier), then
//! completed. Every computed token's layer-0 K/V is written (a pattern of the token's
//! whole prefix), and after each prefill the whole prompt's layer-0 K/V is read back
//! through the block table and checked, so a device hit or a host load that brought the
//! wrong bytes fails the bench.
//!
//! Modeled prefill time: a token the cache does not serve is recomputed at a prefill
//! throughput (`TIERS_PREFILL_TOK_S`, default 25,000 tokens/s: Llama-3-8B costs about
//! 2 x 8e9 = 16 GFLOP per prompt token, and an H200's 989 dense bf16 TFLOP/s at 40 %
//! utilization gives about 24,700 tokens/s); a host hit costs its bytes over the
//! host->device bandwidth probed in the same run on `HostStorage::swap` (a memcpy on
//! this machine; on a GPU it would be PCIe). Saved time is against computing every
//! prompt token; the gain of a tier variant is against the device-only row of the same
//! run. The bench also prints the copy time it really spent in the load plans.
//!
//! `cargo bench --bench tiers` prints a markdown table and one JSON line.

use std::time::{Duration, Instant};

use pagedkv::attention::model::SplitMix64;
use pagedkv::layout::plans::SwapDirection;
use pagedkv::layout::Slot;
use pagedkv::manager::{HostCacheConfig, HostStorePolicy};
use pagedkv::{
    AdmitOptions, BlockId, CopyPlan, DType, HostStorage, KvCache, KvLayout, ModelShape, PrefixHit,
    SeqId, Storage, SwapPlan, TierConfig,
};

const BLOCK_SIZE: usize = 16;
const DEVICE_BLOCKS: usize = 96;
const HOST_BLOCKS: usize = 1024;
const CONVERSATIONS: usize = 16;
const SYSTEM_PROMPTS: usize = 4;
const SEED: u64 = 33;
/// Most blocks one store plan copies (one plan after each prefill and after each free).
const STORE_MAX_BLOCKS: usize = 256;
/// Default prefill throughput, tokens/s (see the module docs).
const DEFAULT_PREFILL_TOK_S: f64 = 25_000.0;

fn layout() -> KvLayout {
    // Llama-3-8B's KV shape.
    let shape = ModelShape {
        num_layers: 32,
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        kv_dtype: DType::BF16,
    };
    KvLayout::new(shape, BLOCK_SIZE).expect("layout")
}

/// Bytes of one block, all layers.
fn block_bytes(l: &KvLayout) -> usize {
    l.block_bytes_per_layer() * l.num_layers()
}

/// Bytes of one token's K (or V) in one layer.
fn row_bytes(l: &KvLayout) -> usize {
    l.shape().num_kv_heads * l.shape().head_dim * l.dtype().size_bytes()
}

// ---- the trace ---------------------------------------------------------------------

struct Rng(SplitMix64);

impl Rng {
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.0.below((hi - lo + 1) as u64) as usize
    }
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.0.below(128_000) as u32).collect()
    }
}

/// One request: the prompt (the conversation so far plus a new user message) and the
/// answer it gets.
struct Turn {
    conversation: usize,
    prompt: Vec<u32>,
    answer: Vec<u32>,
}

/// The requests in serving order.
fn make_trace() -> Vec<Turn> {
    let mut rng = Rng(SplitMix64::new(SEED));
    let systems: Vec<Vec<u32>> = (0..SYSTEM_PROMPTS)
        .map(|_| {
            let n = rng.range(192, 384);
            rng.tokens(n)
        })
        .collect();
    // Per conversation: its turns, each (prompt, answer).
    let mut convs: Vec<Vec<(Vec<u32>, Vec<u32>)>> = Vec::new();
    for _ in 0..CONVERSATIONS {
        let mut history = systems[rng.range(0, SYSTEM_PROMPTS - 1)].clone();
        let turns = rng.range(3, 5);
        let mut out = Vec::new();
        for _ in 0..turns {
            let user = rng.range(24, 96);
            history.extend(rng.tokens(user));
            let n = rng.range(32, 128);
            let answer = rng.tokens(n);
            out.push((history.clone(), answer.clone()));
            history.extend(answer);
        }
        convs.push(out);
    }
    // Round-robin over the conversations, each round in a shuffled order.
    let rounds = convs.iter().map(Vec::len).max().unwrap_or(0);
    let mut trace = Vec::new();
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..CONVERSATIONS).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.range(0, i));
        }
        for c in order {
            if let Some((prompt, answer)) = convs[c].get(round) {
                trace.push(Turn {
                    conversation: c,
                    prompt: prompt.clone(),
                    answer: answer.clone(),
                });
            }
        }
    }
    trace
}

// ---- K/V bytes ---------------------------------------------------------------------

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One value per token, a function of the token and everything before it, so equal
/// prefixes hold equal bytes.
fn prefix_values(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0u64;
    tokens
        .iter()
        .map(|&t| {
            h = mix(h ^ u64::from(t).wrapping_add(0x9e37_79b9_7f4a_7c15));
            h
        })
        .collect()
}

/// Layer-0 K and V rows of tokens with `values`: the value's bytes repeated (V: its
/// complement).
fn kv_rows(row: usize, values: &[u64], k: &mut Vec<u8>, v: &mut Vec<u8>) {
    k.clear();
    v.clear();
    for &x in values {
        for _ in 0..row / 8 {
            k.extend_from_slice(&x.to_le_bytes());
            v.extend_from_slice(&(!x).to_le_bytes());
        }
    }
}

// ---- one run -------------------------------------------------------------------------

#[derive(Debug, Default, Clone)]
struct Figures {
    prompt_tokens: u64,
    device_hit_tokens: u64,
    host_hit_tokens: u64,
    recomputed_tokens: u64,
    stored_blocks: u64,
    stored_bytes: u64,
    loaded_blocks: u64,
    loaded_bytes: u64,
    /// Wall time of the load plans' copies on `HostStorage`.
    load_copy: Duration,
    /// Wall time of the store plans' copies.
    store_copy: Duration,
    /// Bytes read back and checked.
    checked_tokens: u64,
    wall: Duration,
}

/// Runs `trace` on a device arena of [`DEVICE_BLOCKS`]; with `policy`, a host level of
/// [`HOST_BLOCKS`] storing by it.
fn run(trace: &[Turn], policy: Option<HostStorePolicy>) -> pagedkv::Result<Figures> {
    let start = Instant::now();
    let l = layout();
    let host = if policy.is_some() { HOST_BLOCKS } else { 0 };
    let mut kv = KvCache::builder(l)
        .num_blocks(DEVICE_BLOCKS)
        .watermark_blocks(0)
        .tiers(TierConfig {
            num_host_blocks: host,
            ..TierConfig::default()
        })
        .build()?;
    let mut st = if let Some(store) = policy {
        kv.set_host_cache(HostCacheConfig {
            store,
            ..HostCacheConfig::default()
        })?;
        HostStorage::with_host_tier(l, DEVICE_BLOCKS, HOST_BLOCKS)?
    } else {
        HostStorage::new(l, DEVICE_BLOCKS)?
    };
    let row = row_bytes(&l);
    let opts = AdmitOptions::default();
    let mut f = Figures::default();
    let (mut hit, mut slots, mut copies) =
        (PrefixHit::default(), Vec::<Slot>::new(), CopyPlan::new());
    let (mut k, mut v, mut rk, mut rv) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, turn) in trace.iter().enumerate() {
        let seq = SeqId(i as u64);
        let prompt = &turn.prompt;
        let values = prefix_values(&[prompt.as_slice(), &turn.answer].concat());
        kv.lookup_prefix(prompt, &opts, &mut hit)?;
        let a = kv.admit_prompt(seq, prompt, &hit)?;
        if a.loading_tokens > 0 {
            let job = kv.load_job(seq).expect("a load was recorded");
            let t = Instant::now();
            st.swap(&job.plan)?;
            f.load_copy += t.elapsed();
            kv.complete_swap(job.ticket)?;
        }
        let computed = kv.num_computed_tokens(seq)?;
        assert_eq!(computed, a.cached_tokens + a.loading_tokens);
        f.prompt_tokens += prompt.len() as u64;
        f.device_hit_tokens += a.cached_tokens as u64;
        f.host_hit_tokens += a.loading_tokens as u64;
        f.recomputed_tokens += (prompt.len() - computed) as u64;
        // Prefill of the tail the cache did not serve: layer 0's K/V written.
        let tail = prompt.len() - computed;
        kv.reserve(seq, tail, 0, &mut slots, &mut copies)?;
        assert!(copies.is_empty());
        kv_rows(row, &values[computed..prompt.len()], &mut k, &mut v);
        st.write_slots(0, &slots, &k, &v)?;
        kv.commit(seq, tail)?;
        // Every prompt token's layer-0 K/V, hits and loads included, is the prompt's.
        let n = prompt.len();
        rk.resize(n * row, 0);
        rv.resize(n * row, 0);
        st.read_tokens(0, kv.block_table(seq)?, n, &mut rk, &mut rv)?;
        kv_rows(row, &values[..n], &mut k, &mut v);
        assert!(
            rk == k && rv == v,
            "conversation {}: K/V of the prompt differ after admission",
            turn.conversation
        );
        f.checked_tokens += n as u64;
        store(&mut kv, &mut st, &mut f)?;
        // The answer, decoded: its K/V written, its blocks registered.
        kv.append_tokens(seq, &turn.answer, &mut slots, &mut copies)?;
        assert!(copies.is_empty());
        kv_rows(row, &values[n..], &mut k, &mut v);
        st.write_slots(0, &slots, &k, &v)?;
        kv.free(seq)?;
        store(&mut kv, &mut st, &mut f)?;
    }
    let h = kv.host_cache_stats();
    f.stored_blocks = h.stored_blocks;
    f.stored_bytes = h.stored_bytes;
    f.loaded_blocks = h.loaded_blocks;
    f.loaded_bytes = h.loaded_bytes;
    assert_eq!(h.host_hit_tokens, f.host_hit_tokens);
    f.wall = start.elapsed();
    Ok(f)
}

/// One store plan by the configured policy, copied and completed (between steps, when
/// the K/V registered so far is written).
fn store(kv: &mut KvCache, st: &mut HostStorage, f: &mut Figures) -> pagedkv::Result<()> {
    if st.num_host_blocks() == 0 {
        return Ok(());
    }
    if let Some(job) = kv.plan_host_store(STORE_MAX_BLOCKS)? {
        let t = Instant::now();
        st.swap(&job.plan)?;
        f.store_copy += t.elapsed();
        kv.complete_swap(job.ticket)?;
    }
    Ok(())
}

/// Host -> device copy bandwidth of `HostStorage::swap`, bytes/s: the median of 7
/// loads of 32 scattered blocks (64 MiB) from its host tier.
fn probe_load_bandwidth() -> pagedkv::Result<f64> {
    const N: u32 = 32;
    let l = layout();
    let mut st = HostStorage::with_host_tier(l, 2 * N as usize, N as usize)?;
    let (mut out, mut load) = (
        SwapPlan::new(SwapDirection::Out),
        SwapPlan::new(SwapDirection::In),
    );
    for b in 0..N {
        out.push(BlockId(b), BlockId(b));
        load.push(BlockId(2 * b + 1), BlockId(N - 1 - b));
    }
    st.swap(&out)?; // touches every host page first
    st.swap(&load)?;
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            st.swap(&load).map(|_| t.elapsed().as_secs_f64())
        })
        .collect::<pagedkv::Result<_>>()?;
    times.sort_by(f64::total_cmp);
    Ok(N as f64 * block_bytes(&l) as f64 / times[3])
}

fn main() -> pagedkv::Result<()> {
    // The table is the whole bench: the arguments `cargo bench` passes are ignored.
    let prefill_tok_s: f64 = std::env::var("TIERS_PREFILL_TOK_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_PREFILL_TOK_S);
    let trace = make_trace();
    let l = layout();
    let token_bytes = (block_bytes(&l) / BLOCK_SIZE) as f64;
    let bandwidth = probe_load_bandwidth()?;
    let variants: [(&str, Option<HostStorePolicy>); 4] = [
        ("device only", None),
        (
            "device + host, write-through",
            Some(HostStorePolicy::WriteThrough),
        ),
        (
            "device + host, write-back (64 ahead)",
            Some(HostStorePolicy::WriteBack { ahead_blocks: 64 }),
        ),
        (
            "device + host, selective (min_hits 1)",
            Some(HostStorePolicy::Selective { min_hits: 1 }),
        ),
    ];
    let runs: Vec<(&str, Figures)> = variants
        .iter()
        .map(|(name, p)| run(&trace, *p).map(|f| (*name, f)))
        .collect::<pagedkv::Result<_>>()?;
    let prompt_tokens = runs[0].1.prompt_tokens;
    for (_, f) in &runs {
        assert_eq!(f.prompt_tokens, prompt_tokens);
    }
    // Modeled seconds to have every prompt's K/V ready: the tokens no tier served
    // recomputed, the host hits loaded.
    let recompute_s = |f: &Figures| f.recomputed_tokens as f64 / prefill_tok_s;
    let load_s = |f: &Figures| f.loaded_bytes as f64 / bandwidth;
    let prefill_s = |f: &Figures| recompute_s(f) + load_s(f);
    let all_s = prompt_tokens as f64 / prefill_tok_s;
    let base_s = prefill_s(&runs[0].1);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "tiers: {} requests ({CONVERSATIONS} conversations, {SYSTEM_PROMPTS} system prompts), {prompt_tokens} prompt tokens (every prompt's layer-0 K/V checked after admission); \
         device {DEVICE_BLOCKS} blocks, host {HOST_BLOCKS} blocks of {BLOCK_SIZE} tokens, {:.0} KiB per token",
        trace.len(),
        token_bytes / 1024.0
    );
    println!(
        "probed host->device copy (HostStorage::swap, 32 blocks): {:.2} GB/s; prefill {prefill_tok_s:.0} tokens/s \
         (loading beats recomputing above {:.2} GB/s)",
        bandwidth / 1e9,
        token_bytes * prefill_tok_s / 1e9
    );
    println!();
    println!(
        "| variant | device hit tokens | host hit tokens | recomputed tokens | host blocks stored / loaded | MiB stored / loaded | modeled recompute + load | modeled prefill (saved of {all_s:.2} s) | modeled prefill / device only | load copies, measured |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, f) in &runs {
        println!(
            "| {name} | {} | {} | {} ({:.1} %) | {} / {} | {:.0} / {:.0} | {:.2} + {:.2} s | {:.2} s ({:.2} s) | {:.2}x | {} |",
            f.device_hit_tokens,
            f.host_hit_tokens,
            f.recomputed_tokens,
            100.0 * f.recomputed_tokens as f64 / f.prompt_tokens as f64,
            f.stored_blocks,
            f.loaded_blocks,
            mib(f.stored_bytes),
            mib(f.loaded_bytes),
            recompute_s(f),
            load_s(f),
            prefill_s(f),
            all_s - prefill_s(f),
            prefill_s(f) / base_s,
            if f.loaded_bytes == 0 {
                "-".to_string()
            } else {
                format!(
                    "{:.2} s ({:.2} GB/s)",
                    f.load_copy.as_secs_f64(),
                    f.loaded_bytes as f64 / f.load_copy.as_secs_f64() / 1e9
                )
            },
        );
    }
    println!();
    let json_runs: Vec<String> = runs
        .iter()
        .map(|(name, f)| {
            format!(
                "{{\"variant\":\"{name}\",\"prompt_tokens\":{},\"device_hit_tokens\":{},\"host_hit_tokens\":{},\
                 \"recomputed_tokens\":{},\"host_blocks_stored\":{},\"host_blocks_loaded\":{},\"stored_bytes\":{},\
                 \"loaded_bytes\":{},\"load_copy_s\":{:.6},\"store_copy_s\":{:.6},\"checked_tokens\":{},\
                 \"modeled_recompute_s\":{:.6},\"modeled_load_s\":{:.6},\"modeled_prefill_s\":{:.6},\
                 \"modeled_saved_vs_device_only_s\":{:.6},\"wall_s\":{:.3}}}",
                f.prompt_tokens,
                f.device_hit_tokens,
                f.host_hit_tokens,
                f.recomputed_tokens,
                f.stored_blocks,
                f.loaded_blocks,
                f.stored_bytes,
                f.loaded_bytes,
                f.load_copy.as_secs_f64(),
                f.store_copy.as_secs_f64(),
                f.checked_tokens,
                recompute_s(f),
                load_s(f),
                prefill_s(f),
                base_s - prefill_s(f),
                f.wall.as_secs_f64()
            )
        })
        .collect();
    println!(
        "{{\"bench\":\"tiers\",\"requests\":{},\"prompt_tokens\":{prompt_tokens},\"token_bytes\":{token_bytes},\
         \"probed_load_bytes_per_s\":{bandwidth:.0},\"prefill_tokens_per_s\":{prefill_tok_s},\"runs\":[{}]}}",
        trace.len(),
        json_runs.join(",")
    );
    Ok(())
}
