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
//! The last variant adds the disk level: a host level of only
//! [`HOST_BLOCKS_WITH_DISK`] blocks (write-through), every host entry written through
//! to a `DiskPrefixStore` of [`DISK_SLOTS`] slots in a directory under the target
//! directory (removed at the end), and loads staged from disk into host blocks, then
//! copied to the device. A disk hit costs its bytes over the disk read bandwidth probed
//! in the same run (`DiskPrefixStore::load` of 32 blocks, checksum included, after
//! writing them: on this machine mostly the page cache, not the medium) plus the
//! host->device copy.
//!
//! `cargo bench --bench tiers` prints a markdown table and one JSON line.

use std::time::{Duration, Instant};

use std::path::{Path, PathBuf};

use pagedkv::attention::model::SplitMix64;
use pagedkv::executor::tier::{spill_host_prefixes_to_disk, stage_disk_load, DiskPrefixStore};
use pagedkv::layout::plans::SwapDirection;
use pagedkv::layout::Slot;
use pagedkv::manager::{HostCacheConfig, HostStorePolicy};
use pagedkv::pool::prefix::{BlockHash, DiskEntry};
use pagedkv::{
    AdmitOptions, BlockId, CopyPlan, DType, HostStorage, KvCache, KvLayout, ModelShape, PrefixHit,
    SeqId, Storage, SwapPlan, TierConfig,
};

const BLOCK_SIZE: usize = 16;
const DEVICE_BLOCKS: usize = 96;
const HOST_BLOCKS: usize = 1024;
/// The host level of the device + host + disk variant: small, so entries live on disk.
const HOST_BLOCKS_WITH_DISK: usize = 128;
/// Slots of the disk level.
const DISK_SLOTS: usize = 1024;
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
    disk_hit_tokens: u64,
    recomputed_tokens: u64,
    stored_blocks: u64,
    stored_bytes: u64,
    loaded_blocks: u64,
    loaded_bytes: u64,
    /// Wall time of the load plans' copies on `HostStorage`.
    load_copy: Duration,
    /// Wall time of the store plans' copies.
    store_copy: Duration,
    /// Blocks written to the disk level, and loaded from it.
    disk_stored_blocks: u64,
    disk_loaded_blocks: u64,
    /// Wall time of the disk writes and of the disk -> host staging.
    disk_write: Duration,
    disk_read: Duration,
    /// Bytes read back and checked.
    checked_tokens: u64,
    wall: Duration,
}

/// Runs `trace` on a device arena of [`DEVICE_BLOCKS`]; with `policy`, a host level of
/// [`HOST_BLOCKS`] storing by it; with `disk` too, a host level of
/// [`HOST_BLOCKS_WITH_DISK`] written through to a disk level in that directory.
fn run(
    trace: &[Turn],
    policy: Option<HostStorePolicy>,
    disk: Option<&Path>,
) -> pagedkv::Result<Figures> {
    let start = Instant::now();
    let l = layout();
    let host = match (policy, disk) {
        (None, _) => 0,
        (Some(_), None) => HOST_BLOCKS,
        (Some(_), Some(_)) => HOST_BLOCKS_WITH_DISK,
    };
    let mut disk_store = match disk {
        Some(dir) => Some(DiskPrefixStore::create(dir, &l, DISK_SLOTS)?),
        None => None,
    };
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
        HostStorage::with_host_tier(l, DEVICE_BLOCKS, host)?
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
        let disk_before = kv.disk_cache_stats().disk_hit_tokens;
        if a.loading_tokens > 0 {
            if let Some(ds) = disk_store.as_mut() {
                let t = Instant::now();
                stage_disk_load(&mut kv, &mut st, ds, seq)?;
                f.disk_read += t.elapsed();
            }
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
        let disk_hit = kv.disk_cache_stats().disk_hit_tokens - disk_before;
        f.disk_hit_tokens += disk_hit;
        f.host_hit_tokens += a.loading_tokens as u64 - disk_hit;
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
        store(&mut kv, &mut st, disk_store.as_mut(), &mut f)?;
        // The answer, decoded: its K/V written, its blocks registered.
        kv.append_tokens(seq, &turn.answer, &mut slots, &mut copies)?;
        assert!(copies.is_empty());
        kv_rows(row, &values[n..], &mut k, &mut v);
        st.write_slots(0, &slots, &k, &v)?;
        kv.free(seq)?;
        store(&mut kv, &mut st, disk_store.as_mut(), &mut f)?;
    }
    let h = kv.host_cache_stats();
    f.stored_blocks = h.stored_blocks;
    f.stored_bytes = h.stored_bytes;
    f.loaded_blocks = h.loaded_blocks;
    f.loaded_bytes = h.loaded_bytes;
    assert_eq!(h.host_hit_tokens, f.host_hit_tokens);
    let d = kv.disk_cache_stats();
    f.disk_stored_blocks = d.stored_blocks;
    f.disk_loaded_blocks = d.loaded_blocks;
    assert_eq!(d.disk_hit_tokens, f.disk_hit_tokens);
    f.wall = start.elapsed();
    Ok(f)
}

/// One store plan by the configured policy, copied and completed (between steps, when
/// the K/V registered so far is written); with a disk level, the new host entries are
/// then written through to it.
fn store(
    kv: &mut KvCache,
    st: &mut HostStorage,
    disk: Option<&mut DiskPrefixStore>,
    f: &mut Figures,
) -> pagedkv::Result<()> {
    if st.num_host_blocks() == 0 {
        return Ok(());
    }
    if let Some(job) = kv.plan_host_store(STORE_MAX_BLOCKS)? {
        let t = Instant::now();
        st.swap(&job.plan)?;
        f.store_copy += t.elapsed();
        kv.complete_swap(job.ticket)?;
    }
    if let Some(ds) = disk {
        let t = Instant::now();
        spill_host_prefixes_to_disk(kv, st, ds, STORE_MAX_BLOCKS)?;
        f.disk_write += t.elapsed();
    }
    Ok(())
}

/// Disk -> memory read bandwidth of `DiskPrefixStore::load` (checksum included),
/// bytes/s: the median of 7 reads of 32 blocks (64 MiB) written just before.
fn probe_disk_read_bandwidth(dir: &Path) -> pagedkv::Result<f64> {
    const N: usize = 32;
    let l = layout();
    let bb = block_bytes(&l);
    let mut store = DiskPrefixStore::create(dir, &l, N)?;
    let mut rng = SplitMix64::new(SEED);
    let mut buf: Vec<u8> = (0..bb).map(|_| rng.below(256) as u8).collect();
    for i in 0..N {
        buf[0] = i as u8;
        let entry = DiskEntry {
            hash: BlockHash(0x5eed_0000 + i as u64),
            parent: None,
            tokens: vec![i as u32; BLOCK_SIZE].into(),
            namespace: None,
            extra_key: None,
            priority: 0,
            digest: None,
        };
        let _stored = store.store(&entry, &buf)?;
    }
    store.sync()?;
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for i in 0..N {
                let found = store.load(BlockHash(0x5eed_0000 + i as u64), &mut buf)?;
                assert!(found);
            }
            Ok(t.elapsed().as_secs_f64())
        })
        .collect::<pagedkv::Result<_>>()?;
    times.sort_by(f64::total_cmp);
    Ok((N * bb) as f64 / times[3])
}

/// A fresh directory for the bench's disk stores, under the target directory.
fn disk_dir(name: &str) -> PathBuf {
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| PathBuf::from("target"), PathBuf::from);
    let dir = target
        .join(format!("pagedkv-bench-tiers-{}", std::process::id()))
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
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
    let probe_dir = disk_dir("probe");
    let disk_bandwidth = probe_disk_read_bandwidth(&probe_dir)?;
    let level_dir = disk_dir("level");
    let variants: [(&str, Option<HostStorePolicy>, bool); 5] = [
        ("device only", None, false),
        (
            "device + host, write-through",
            Some(HostStorePolicy::WriteThrough),
            false,
        ),
        (
            "device + host, write-back (64 ahead)",
            Some(HostStorePolicy::WriteBack { ahead_blocks: 64 }),
            false,
        ),
        (
            "device + host, selective (min_hits 1)",
            Some(HostStorePolicy::Selective { min_hits: 1 }),
            false,
        ),
        (
            "device + host (128) + disk, write-through",
            Some(HostStorePolicy::WriteThrough),
            true,
        ),
    ];
    let runs: Vec<(&str, Figures)> = variants
        .iter()
        .map(|(name, p, disk)| {
            run(&trace, *p, disk.then_some(level_dir.as_path())).map(|f| (*name, f))
        })
        .collect::<pagedkv::Result<_>>()?;
    if let Some(parent) = probe_dir.parent() {
        let _ = std::fs::remove_dir_all(parent);
    }
    let prompt_tokens = runs[0].1.prompt_tokens;
    for (_, f) in &runs {
        assert_eq!(f.prompt_tokens, prompt_tokens);
    }
    // Modeled seconds to have every prompt's K/V ready: the tokens no tier served
    // recomputed, the host hits loaded, the disk hits read and loaded.
    let bb = block_bytes(&l) as f64;
    let recompute_s = |f: &Figures| f.recomputed_tokens as f64 / prefill_tok_s;
    let load_s = |f: &Figures| {
        let disk_bytes = f.disk_loaded_blocks as f64 * bb;
        (f.loaded_bytes as f64 + disk_bytes) / bandwidth + disk_bytes / disk_bandwidth
    };
    let prefill_s = |f: &Figures| recompute_s(f) + load_s(f);
    let all_s = prompt_tokens as f64 / prefill_tok_s;
    let base_s = prefill_s(&runs[0].1);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "tiers: {} requests ({CONVERSATIONS} conversations, {SYSTEM_PROMPTS} system prompts), {prompt_tokens} prompt tokens (every prompt's layer-0 K/V checked after admission); \
         device {DEVICE_BLOCKS} blocks, host {HOST_BLOCKS} blocks (with disk: {HOST_BLOCKS_WITH_DISK}, disk {DISK_SLOTS} slots) of {BLOCK_SIZE} tokens, {:.0} KiB per token",
        trace.len(),
        token_bytes / 1024.0
    );
    println!(
        "probed host->device copy (HostStorage::swap, 32 blocks): {:.2} GB/s; prefill {prefill_tok_s:.0} tokens/s \
         (loading beats recomputing above {:.2} GB/s)",
        bandwidth / 1e9,
        token_bytes * prefill_tok_s / 1e9
    );
    println!(
        "probed disk read (DiskPrefixStore::load, 32 blocks, checksummed): {:.2} GB/s",
        disk_bandwidth / 1e9
    );
    println!();
    println!(
        "| variant | device hit tokens | host hit tokens | disk hit tokens | recomputed tokens | host blocks stored / loaded | disk blocks stored / loaded | MiB stored / loaded (host) | modeled recompute + load | modeled prefill (saved of {all_s:.2} s) | modeled prefill / device only | load copies, measured | disk write / read, measured |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, f) in &runs {
        println!(
            "| {name} | {} | {} | {} | {} ({:.1} %) | {} / {} | {} / {} | {:.0} / {:.0} | {:.2} + {:.2} s | {:.2} s ({:.2} s) | {:.2}x | {} | {} |",
            f.device_hit_tokens,
            f.host_hit_tokens,
            f.disk_hit_tokens,
            f.recomputed_tokens,
            100.0 * f.recomputed_tokens as f64 / f.prompt_tokens as f64,
            f.stored_blocks,
            f.loaded_blocks,
            f.disk_stored_blocks,
            f.disk_loaded_blocks,
            mib(f.stored_bytes),
            mib(f.loaded_bytes),
            recompute_s(f),
            load_s(f),
            prefill_s(f),
            all_s - prefill_s(f),
            prefill_s(f) / base_s,
            if f.loaded_bytes + f.disk_loaded_blocks == 0 {
                "-".to_string()
            } else {
                // Host->device copies of host hits and of disk hits staged in host blocks.
                let copied = f.loaded_bytes as f64 + f.disk_loaded_blocks as f64 * bb;
                format!(
                    "{:.2} s ({:.2} GB/s)",
                    f.load_copy.as_secs_f64(),
                    copied / f.load_copy.as_secs_f64() / 1e9
                )
            },
            if f.disk_stored_blocks == 0 {
                "-".to_string()
            } else {
                format!(
                    "{:.2} / {:.2} s",
                    f.disk_write.as_secs_f64(),
                    f.disk_read.as_secs_f64()
                )
            },
        );
    }
    println!();
    let json_runs: Vec<String> = runs
        .iter()
        .map(|(name, f)| {
            format!(
                "{{\"variant\":\"{name}\",\"prompt_tokens\":{},\"device_hit_tokens\":{},\"host_hit_tokens\":{},\"disk_hit_tokens\":{},\"disk_blocks_stored\":{},\"disk_blocks_loaded\":{},\
                 \"recomputed_tokens\":{},\"host_blocks_stored\":{},\"host_blocks_loaded\":{},\"stored_bytes\":{},\
                 \"loaded_bytes\":{},\"load_copy_s\":{:.6},\"store_copy_s\":{:.6},\"checked_tokens\":{},\
                 \"modeled_recompute_s\":{:.6},\"modeled_load_s\":{:.6},\"modeled_prefill_s\":{:.6},\
                 \"modeled_saved_vs_device_only_s\":{:.6},\"wall_s\":{:.3}}}",
                f.prompt_tokens,
                f.device_hit_tokens,
                f.host_hit_tokens,
                f.disk_hit_tokens,
                f.disk_stored_blocks,
                f.disk_loaded_blocks,
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
         \"probed_load_bytes_per_s\":{bandwidth:.0},\"probed_disk_read_bytes_per_s\":{disk_bandwidth:.0},\"prefill_tokens_per_s\":{prefill_tok_s},\"runs\":[{}]}}",
        trace.len(),
        json_runs.join(",")
    );
    Ok(())
}
