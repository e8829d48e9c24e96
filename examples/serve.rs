//! The serve simulation: continuous batching over a seeded, long-tailed request trace,
//! run on the same host-memory arena with paged allocation (prefix cache on and off)
//! and with contiguous `max_len` reservations. Every token's K and V is really written
//! into the arena through the slot mapping, and every finished sequence is read back
//! and checked against the values it must hold.
//!
//! ```text
//! cargo run --release --example serve                  # table, and the memory timeline SVG under target/
//! cargo run --release --example serve -- --json        # {"paged": {...}, "contiguous": {...}, ...}
//! cargo run --release --example serve -- --elastic     # shrink the arena mid-trace, then grow it
//! cargo run --release --example serve -- --svg kv.svg  # the timeline to another path (--no-svg: none)
//! cargo run --release --example serve -- --backend cuda  # the same runs on CudaStorage + CUDA kernels, checked against the host
//! cargo run --release --example serve -- --hybrid      # Gemma-3-like hybrid: KV-cache groups
//! cargo run --release --example serve -- --kv-events tcp://127.0.0.1:5557  # the prefix run's events on vLLM's ZMQ wire
//! cargo run --release --example serve -- --host-cache 2048  # adds a run with the host tier as a prefix-cache level
//! cargo run --release --example serve -- --help
//! ```

#[path = "serve_gpu/mod.rs"]
mod gpu;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use clap::Parser;
use gpu::{ModelCache, StorageKind};
use indicatif::{ProgressBar, ProgressStyle};
use pagedkv::attention::model::{SplitMix64, TinyModel};
use pagedkv::baseline::{CacheAllocator, ContiguousCache};
use pagedkv::chart::{EventKind, MemoryChart, Timeline};
use pagedkv::events::{ZmqEventPublisher, ZmqPublisherConfig};
use pagedkv::layout::Slot;
use pagedkv::manager::preempt::PreemptAction;
use pagedkv::manager::{FragStats, HostCacheConfig, HostStorePolicy};
use pagedkv::pool::prefix::{AdmitOptions, PrefixConfig};
use pagedkv::tables::PaddedTables;
use pagedkv::{
    CacheConfig, CopyPlan, HostStorage, KvCache, KvLayout, ModelConfig, PrefixHit, SeqId, Storage,
    SwapPlan,
};
use pagedkv::{PreemptPolicy, TierConfig};

#[path = "serve_hybrid/mod.rs"]
mod hybrid;

#[derive(Parser, Debug, Clone)]
#[command(about = "Continuous-batching simulation: paged vs contiguous KV allocation on one arena")]
struct Args {
    /// Model config.json path, or a built-in name (llama3-8b, qwen2.5-7b, llama3-70b).
    #[arg(long, default_value = "llama3-8b")]
    model: String,
    /// Arena size in GiB of host memory (KV for all layers).
    #[arg(long, default_value_t = 2.0)]
    arena_gib: f64,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Longest sequence (prompt + output); what each contiguous reservation holds.
    #[arg(long, default_value_t = 2048)]
    max_len: usize,
    /// Requests in the trace.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Mean request arrivals per decode step.
    #[arg(long, default_value_t = 0.5)]
    arrival_rate: f64,
    /// Share of requests that sample several outputs (forks of the prompt).
    #[arg(long, default_value_t = 0.1)]
    fork_share: f64,
    /// Share of requests that start with one of a few shared system prompts.
    #[arg(long, default_value_t = 0.4)]
    system_prompt_share: f64,
    /// Share of requests that continue an earlier conversation (resend its history).
    #[arg(long, default_value_t = 0.2)]
    multi_turn_share: f64,
    /// Run paged without the prefix cache only (skips the prefix-cache run).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Shrink the paged arena mid-trace (another model needs the memory), then grow it.
    #[arg(long)]
    elastic: bool,
    /// Add a run on a squeezed arena with a host tier: preemption is forced, and a cost
    /// model picks swap or recompute for each victim.
    #[arg(long)]
    overload: bool,
    /// Fraction of the arena the overload run keeps.
    #[arg(long, default_value_t = 0.3)]
    overload_fraction: f64,
    /// Prefill throughput the cost model assumes, tokens/s (default: measured on the
    /// simulation's attention model at start-up, or 5,000 without it).
    #[arg(long)]
    prefill_tokens_per_s: Option<f64>,
    /// Fraction of the arena kept while shrunk.
    #[arg(long, default_value_t = 0.5)]
    elastic_fraction: f64,
    /// Skip the attention model (by default a small random-weight attention stack of the
    /// configured shape, scaled down, runs over the same block tables every step).
    #[arg(long)]
    no_attend: bool,
    /// Trace seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Write the SVG of KV memory over time (paged vs contiguous) to this path instead
    /// of `serve-timeline.svg` in the target directory.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
    /// Draw no SVG.
    #[arg(long, conflicts_with = "svg")]
    no_svg: bool,
    /// Where the arenas live: `host`, or `cuda` (CudaStorage, the cache-write, prefill
    /// and decode kernels; the runs are repeated on the host and must agree).
    #[arg(long, value_enum, default_value_t = StorageKind::Host)]
    backend: StorageKind,
    /// The attention model prefills prompts in launches of at most this many tokens
    /// (0: the whole uncached tail at once), all in the step that admits the request.
    #[arg(long, default_value_t = 0)]
    prefill_chunk: usize,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Publish the prefix-cache run's KV events on vLLM's ZMQ wire: the PUB socket
    /// binds this `tcp://HOST:PORT` (a router's SUB socket connects to it).
    #[arg(long)]
    kv_events: Option<String>,
    /// The replay ROUTER socket's `tcp://HOST:PORT` (with `--kv-events`).
    #[arg(long, requires = "kv_events")]
    kv_events_replay: Option<String>,
    /// The topic frame of every event message (with `--kv-events`).
    #[arg(long, default_value = "", requires = "kv_events")]
    kv_events_topic: String,
    /// The data-parallel rank (with `--kv-events`): both ports move up by it and the
    /// batches carry it, as vLLM's publisher does.
    #[arg(long, default_value_t = 0, requires = "kv_events")]
    kv_events_rank: u32,
    /// Add a run whose prefix cache has a host level of this many blocks (the host
    /// tier): computed prefixes are stored to it between steps, and a prompt that hits
    /// there is admitted with a load, run and completed before the sequence's first step.
    #[arg(long)]
    host_cache: Option<usize>,
    /// What the host level stores (with `--host-cache`): every registered block, the 64
    /// cached blocks nearest eviction, or blocks hit at least once on the device.
    #[arg(long, value_enum, default_value_t = StorePolicyArg::WriteThrough, requires = "host_cache")]
    host_store_policy: StorePolicyArg,
}

/// `--host-store-policy`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum StorePolicyArg {
    WriteThrough,
    WriteBack,
    Selective,
}

impl StorePolicyArg {
    fn policy(self) -> HostStorePolicy {
        match self {
            StorePolicyArg::WriteThrough => HostStorePolicy::WriteThrough,
            StorePolicyArg::WriteBack => HostStorePolicy::WriteBack { ahead_blocks: 64 },
            StorePolicyArg::Selective => HostStorePolicy::Selective { min_hits: 1 },
        }
    }
}

/// Most blocks one store to the host level copies (one store after every step).
const HOST_STORE_MAX_BLOCKS: usize = 256;

/// The crate's seeded generator, so the trace is the same on every machine.
struct Rng(SplitMix64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Log-normal with the given median and shape: the long tail of chat traffic.
    fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        let (u1, u2) = (self.unit().max(1e-12), self.unit());
        let normal = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        median * (sigma * normal).exp()
    }
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next_u64() % 128_000) as u32).collect()
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The token a sample generates at output position `i` (the simulation's "model").
fn generated_token(req: u64, sample: usize, i: usize) -> u32 {
    (mix(req.wrapping_mul(0x1000_0000_01b3) ^ ((sample as u64) << 40) ^ i as u64) % 128_000) as u32
}

/// Hash of a token prefix, one token further. The K/V of a token is a function of the
/// whole prefix up to it, as in a real model, so identical prefixes hold identical
/// K/V and may be shared.
fn chain(prev: u64, token: u32) -> u64 {
    mix(prev.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(token))
}

#[derive(Debug, Clone)]
struct Request {
    id: u64,
    arrival_step: u64,
    prompt: Vec<u32>,
    output_len: usize,
    samples: usize,
}

fn make_trace(args: &Args) -> Vec<Request> {
    let mut rng = Rng(SplitMix64::new(args.seed));
    let system: Vec<Vec<u32>> = (0..4)
        .map(|_| {
            let n = (rng.lognormal(300.0, 0.5) as usize).clamp(64, args.max_len / 4);
            rng.tokens(n)
        })
        .collect();
    let mut trace: Vec<Request> = Vec::with_capacity(args.requests);
    let mut step = 0.0;
    let max_prompt = args.max_len * 3 / 4;
    for id in 0..args.requests as u64 {
        step += -rng.unit().max(1e-12).ln() / args.arrival_rate;
        let kind = rng.unit();
        let mut prompt = if kind < args.multi_turn_share && !trace.is_empty() {
            // A follow-up turn: an earlier conversation, its first answer, a new question.
            let prev = &trace[trace.len() - 1 - (rng.next_u64() as usize % trace.len().min(20))];
            let mut p = prev.prompt.clone();
            p.extend((0..prev.output_len).map(|i| generated_token(prev.id, 0, i)));
            p
        } else if kind < args.multi_turn_share + args.system_prompt_share {
            system[rng.next_u64() as usize % system.len()].clone()
        } else {
            Vec::new()
        };
        let tail =
            (rng.lognormal(if prompt.is_empty() { 250.0 } else { 80.0 }, 0.9) as usize).max(8);
        prompt.extend(rng.tokens(tail));
        prompt.truncate(max_prompt);
        let output_len = (rng.lognormal(120.0, 0.8) as usize).clamp(4, args.max_len - prompt.len());
        let samples = if rng.unit() < args.fork_share {
            2 + (rng.next_u64() % 3) as usize
        } else {
            1
        };
        trace.push(Request {
            id,
            arrival_step: step as u64,
            prompt,
            output_len,
            samples,
        });
    }
    trace
}

/// The allocator under test, with what differs between the kinds.
enum Backend<'a> {
    Paged {
        kv: &'a mut KvCache,
        prefix_cache: bool,
    },
    Contiguous(&'a mut ContiguousCache),
}

impl Backend<'_> {
    fn alloc(&self) -> &dyn CacheAllocator {
        match self {
            Backend::Paged { kv, .. } => &**kv,
            Backend::Contiguous(c) => &**c,
        }
    }
    fn alloc_mut(&mut self) -> &mut dyn CacheAllocator {
        match self {
            Backend::Paged { kv, .. } => &mut **kv,
            Backend::Contiguous(c) => &mut **c,
        }
    }
    fn can_admit(&self, prompt: &[u32]) -> bool {
        match self {
            Backend::Paged {
                kv,
                prefix_cache: true,
            } => kv.can_admit_tokens(prompt, &AdmitOptions::default()),
            _ => self.alloc().can_admit(prompt.len()),
        }
    }
    /// Admits a prompt; returns how many leading tokens were already cached.
    fn admit(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        slots: &mut Vec<Slot>,
    ) -> pagedkv::Result<usize> {
        match self {
            Backend::Paged {
                kv,
                prefix_cache: true,
            } => Ok(kv
                .admit_tokens(seq, prompt, &AdmitOptions::default(), slots)?
                .cached_tokens),
            _ => self.alloc_mut().admit(seq, prompt.len(), slots).map(|()| 0),
        }
    }
    fn append(
        &mut self,
        seq: SeqId,
        token: u32,
        slots: &mut Vec<Slot>,
        copies: &mut CopyPlan,
    ) -> pagedkv::Result<()> {
        match self {
            Backend::Paged {
                kv,
                prefix_cache: true,
            } => kv.append_tokens(seq, &[token], slots, copies),
            _ => self.alloc_mut().append(seq, 1, slots, copies),
        }
    }
    fn paged(&mut self) -> Option<&mut KvCache> {
        match self {
            Backend::Paged { kv, .. } => Some(kv),
            Backend::Contiguous(_) => None,
        }
    }
}

/// A running sequence: one sample of a request.
struct Running {
    seq: SeqId,
    req: usize,
    sample: usize,
    generated: usize,
    /// Chain hash of every token so far.
    hash: u64,
    /// Hash of the attention model's outputs for this sequence so far.
    model_hash: u64,
}

/// Tokens to write this step: the K/V word of each and its slot.
#[derive(Default)]
struct WriteBatch {
    words: Vec<(u64, SeqId)>,
    slots: Vec<Slot>,
    k: Vec<u8>,
    v: Vec<u8>,
}

/// The bytes of one token's K (and, inverted, V) in one layer.
fn fill_token(out: &mut Vec<u8>, word: u64, layer: usize, len: usize) {
    let w = mix(word ^ (layer as u64).wrapping_mul(0xd6e8_feb8_6659_fd93)).to_le_bytes();
    out.extend((0..len).map(|i| w[i % 8]));
}

impl WriteBatch {
    /// Writes every layer's K/V of the batch through the slot mapping.
    fn flush(&mut self, store: &mut Mirror) -> pagedkv::Result<()> {
        let layout = *store.layout();
        let per_token =
            layout.shape().num_kv_heads * layout.shape().head_dim * layout.dtype().size_bytes();
        for layer in 0..layout.num_layers() {
            self.k.clear();
            self.v.clear();
            for &(w, _) in &self.words {
                fill_token(&mut self.k, w, layer, per_token);
                fill_token(&mut self.v, !w, layer, per_token);
            }
            store.write_slots(layer, &self.slots, &self.k, &self.v)?;
        }
        self.words.clear();
        self.slots.clear();
        Ok(())
    }
}

/// The arena (the real model shape, where every token's K/V bytes are written and
/// checked) and, when the attention model runs, its own cache (the scaled-down shape,
/// same blocks). Every plan runs on both, so one set of block tables serves both.
struct Mirror {
    main: gpu::Arena,
    model: Option<Box<dyn ModelCache>>,
    /// The model's prefill launches hold at most this many tokens (0: no limit).
    prefill_chunk: usize,
}

// Plans run on both storages; token I/O goes to the arena only (the model writes its
// own cache). Per-layer swaps and host-block I/O keep the trait's refusal, so callers
// fall back to `swap`, which mirrors.
pagedkv::delegate_storage! {
    Mirror => main, except [
        copy_blocks, swap, resize, swap_layer, read_host_block, write_host_block,
    ];

    fn copy_blocks(&mut self, plan: &CopyPlan) -> pagedkv::Result<()> {
        self.main.copy_blocks(plan)?;
        self.model.as_mut().map_or(Ok(()), |m| m.copy_blocks(plan))
    }
    fn swap(&mut self, plan: &SwapPlan) -> pagedkv::Result<()> {
        self.main.swap(plan)?;
        self.model.as_mut().map_or(Ok(()), |m| m.swap(plan))
    }
    fn resize(&mut self, num_blocks: usize) -> pagedkv::Result<()> {
        self.main.resize(num_blocks)?;
        self.model.as_mut().map_or(Ok(()), |m| m.resize(num_blocks))
    }
}

/// Prefill throughput of the simulation's attention model, tokens/s: what the cost
/// model weighs recomputation with.
fn measure_prefill(model: &TinyModel, block_size: usize) -> pagedkv::Result<f64> {
    let tokens: usize = 512;
    let blocks = tokens.div_ceil(block_size);
    let mut store = HostStorage::new(KvLayout::new(*model.shape(), block_size)?, blocks)?;
    let tables = PaddedTables {
        tables: (0..blocks as u32).collect(),
        context_lens: vec![tokens as u32],
        batch: 1,
        max_blocks: blocks,
    };
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|t| t % model.vocab_size() as u32)
        .collect();
    let mut hidden = vec![0f32; tokens * model.hidden_size()];
    let t = Instant::now();
    model.prefill_tokens(&mut store, &tables, &[0, tokens], &ids, &mut hidden)?;
    Ok(tokens as f64 / t.elapsed().as_secs_f64().max(1e-9))
}

#[derive(Debug, Default, Clone)]
struct Elastic {
    shrinks: usize,
    grows: usize,
    blocks_released: usize,
    moves: usize,
    bytes_moved: usize,
    seconds: f64,
    preemptions: usize,
    fragmentation_before: f64,
    fragmentation_after: f64,
}

#[derive(Debug, Default, Clone)]
struct Overload {
    arena_blocks: usize,
    swaps: usize,
    recomputes: usize,
    bytes_swapped_out: u64,
    bytes_swapped_in: u64,
    recomputed_tokens: usize,
    /// The cost model's estimate of the time the preemptions cost (chosen action).
    simulated_seconds_lost: f64,
    probe_swap_gb_per_s: f64,
    prefill_tokens_per_s: f64,
}

/// The host level of the prefix cache (`--host-cache`).
#[derive(Debug, Default, Clone)]
struct HostFigures {
    blocks: usize,
    policy: String,
    /// Prompt tokens served by device hits and by host loads.
    device_hit_tokens: u64,
    host_hit_tokens: u64,
    stored_blocks: u64,
    stored_bytes: u64,
    loaded_blocks: u64,
    loaded_bytes: u64,
    /// Wall time of the store and load copies (both arenas of the mirror).
    copy_seconds: f64,
}

#[derive(Debug, Default, Clone)]
struct Summary {
    requests_served: usize,
    sequences_served: usize,
    tokens_generated: usize,
    prompt_tokens: usize,
    prefill_tokens_saved: usize,
    steps: u64,
    peak_concurrent_seqs: usize,
    mean_concurrent_seqs: f64,
    mean_kv_utilization: f64,
    mean_kv_utilization_under_load: f64,
    peak_kv_utilization: f64,
    mean_internal_waste: f64,
    peak_used_blocks: usize,
    admissions_delayed: usize,
    preemptions: usize,
    cow_copies: usize,
    alloc_seconds: f64,
    wall_seconds: f64,
    kv_checksum: u64,
    /// Hash of the running sequences of every step.
    schedule_hash: u64,
    /// Hash of every sequence's attention-model outputs (next-token ids and final
    /// hidden state bits), or 0 without the model.
    model_checksum: u64,
    model_seconds: f64,
    elastic: Option<Elastic>,
    overload: Option<Overload>,
    host: Option<HostFigures>,
}

impl Summary {
    fn json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "requests_served": self.requests_served,
            "sequences_served": self.sequences_served,
            "tokens_generated": self.tokens_generated,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens_saved": self.prefill_tokens_saved,
            "prefix_hit_rate": self.prefix_hit_rate(),
            "steps": self.steps,
            "peak_concurrent_seqs": self.peak_concurrent_seqs,
            "mean_concurrent_seqs": self.mean_concurrent_seqs,
            "mean_kv_utilization": self.mean_kv_utilization,
            "mean_kv_utilization_under_load": self.mean_kv_utilization_under_load,
            "peak_kv_utilization": self.peak_kv_utilization,
            "mean_internal_waste": self.mean_internal_waste,
            "peak_used_blocks": self.peak_used_blocks,
            "admissions_delayed": self.admissions_delayed,
            "preemptions": self.preemptions,
            "cow_copies": self.cow_copies,
            "alloc_seconds": self.alloc_seconds,
            "alloc_share_of_wall": self.alloc_seconds / self.wall_seconds.max(1e-9),
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_generated as f64 / self.wall_seconds.max(1e-9),
            "kv_checksum": self.kv_checksum,
            "schedule_hash": self.schedule_hash,
            "model_checksum": self.model_checksum,
            "model_seconds": self.model_seconds,
        });
        if let Some(o) = &self.overload {
            v["overload"] = serde_json::json!({
                "arena_blocks": o.arena_blocks,
                "swaps": o.swaps,
                "recomputes": o.recomputes,
                "bytes_swapped_out": o.bytes_swapped_out,
                "bytes_swapped_in": o.bytes_swapped_in,
                "recomputed_tokens": o.recomputed_tokens,
                "simulated_seconds_lost": o.simulated_seconds_lost,
                "probe_swap_gb_per_s": o.probe_swap_gb_per_s,
                "prefill_tokens_per_s": o.prefill_tokens_per_s,
            });
        }
        if let Some(h) = &self.host {
            v["host_cache"] = serde_json::json!({
                "host_blocks": h.blocks,
                "store_policy": h.policy,
                "device_hit_tokens": h.device_hit_tokens,
                "host_hit_tokens": h.host_hit_tokens,
                "stored_blocks": h.stored_blocks,
                "stored_bytes": h.stored_bytes,
                "loaded_blocks": h.loaded_blocks,
                "loaded_bytes": h.loaded_bytes,
                "copy_seconds": h.copy_seconds,
            });
        }
        if let Some(e) = &self.elastic {
            v["elastic"] = serde_json::json!({
                "shrinks": e.shrinks,
                "grows": e.grows,
                "blocks_released": e.blocks_released,
                "moves": e.moves,
                "bytes_moved": e.bytes_moved,
                "seconds": e.seconds,
                "preemptions": e.preemptions,
                "fragmentation_before": e.fragmentation_before,
                "fragmentation_after": e.fragmentation_after,
            });
        }
        v
    }

    fn prefix_hit_rate(&self) -> f64 {
        self.prefill_tokens_saved as f64 / self.prompt_tokens.max(1) as f64
    }
}

/// When the arena shrinks and grows again, in decode steps.
#[derive(Debug, Clone, Copy)]
struct ElasticPlan {
    shrink_at: u64,
    grow_at: u64,
    shrunk_blocks: usize,
}

/// One run of the trace on one allocator and one arena.
struct Sim<'a> {
    backend: Backend<'a>,
    store: &'a mut Mirror,
    model: Option<&'a TinyModel>,
    tables: PaddedTables,
    hidden: Vec<f32>,
    /// Overload mode: how to preempt, and the groups swapped out to the host tier.
    policy: Option<PreemptPolicy>,
    swapped: VecDeque<Vec<Running>>,
    trace: &'a [Request],
    waiting: VecDeque<usize>,
    running: Vec<Running>,
    next_seq: u64,
    slots: Vec<Slot>,
    copies: CopyPlan,
    batch: WriteBatch,
    alloc_time: Duration,
    model_time: Duration,
    sum: Summary,
    timeline: Timeline,
    step: u64,
    /// Where each step's prefix events go (`--kv-events`).
    events: Option<&'a mut ZmqEventPublisher>,
    /// The prefix cache has a host level (`--host-cache`): lookups, loads, stores.
    host_level: bool,
    hit: PrefixHit,
}

impl<'a> Sim<'a> {
    fn new(
        backend: Backend<'a>,
        store: &'a mut Mirror,
        model: Option<&'a TinyModel>,
        trace: &'a [Request],
        name: &str,
    ) -> Self {
        Sim {
            backend,
            store,
            model,
            tables: PaddedTables::default(),
            hidden: Vec::new(),
            policy: None,
            swapped: VecDeque::new(),
            trace,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_seq: 0,
            slots: Vec::new(),
            copies: CopyPlan::new(),
            batch: WriteBatch::default(),
            alloc_time: Duration::ZERO,
            model_time: Duration::ZERO,
            sum: Summary::default(),
            timeline: Timeline::new(name),
            step: 0,
            events: None,
            host_level: false,
            hit: PrefixHit::default(),
        }
    }

    fn timed<T>(
        &mut self,
        f: impl FnOnce(&mut Backend<'a>, &mut Vec<Slot>, &mut CopyPlan) -> T,
    ) -> T {
        let t = Instant::now();
        let out = f(&mut self.backend, &mut self.slots, &mut self.copies);
        self.alloc_time += t.elapsed();
        out
    }

    fn run(
        mut self,
        bar: &ProgressBar,
        elastic: Option<ElasticPlan>,
    ) -> pagedkv::Result<(Summary, Timeline)> {
        let start = Instant::now();
        let trace = self.trace;
        let mut next_arrival = 0;
        let mut delayed = vec![false; trace.len()];
        let (mut util_sum, mut util_load_sum, mut load_steps, mut conc_sum, mut waste_sum) =
            (0.0, 0.0, 0u64, 0.0, 0.0);
        bar.set_length(trace.len() as u64);
        bar.set_position(0);
        while self.sum.requests_served < trace.len() {
            while next_arrival < trace.len() && trace[next_arrival].arrival_step <= self.step {
                self.waiting.push_back(next_arrival);
                next_arrival += 1;
            }
            if let Some(plan) = elastic {
                self.elastic_phase(plan)?;
            }
            self.swap_in_ready()?;
            // Admit in arrival order; the head of the queue blocks the rest (no skipping),
            // and swapped-out requests come back before new ones start.
            while let Some(&r) = self.waiting.front().filter(|_| self.swapped.is_empty()) {
                if !self.admit_request(r)? {
                    delayed[r] = true;
                    break;
                }
                self.waiting.pop_front();
            }
            self.decode_step()?;
            self.retire(bar)?;
            self.store_to_host()?;
            let stats = self.backend.alloc().stats();
            let arena_slots = (self.store.num_blocks() * self.store.layout().block_size()) as f64;
            let util = stats.live_token_slots as f64 / arena_slots;
            self.sum.peak_concurrent_seqs = self.sum.peak_concurrent_seqs.max(stats.num_sequences);
            self.sum.peak_kv_utilization = self.sum.peak_kv_utilization.max(util);
            self.sum.peak_used_blocks = self.sum.peak_used_blocks.max(stats.used_blocks);
            util_sum += util;
            conc_sum += stats.num_sequences as f64;
            waste_sum += stats.internal_waste_slots as f64 / arena_slots;
            if !self.waiting.is_empty() {
                util_load_sum += util;
                load_steps += 1;
            }
            self.timeline.record(self.step, &stats, 0)?;
            // Which sequences ran in which step: the scheduling decisions in one word.
            let mut h = mix(self.sum.schedule_hash ^ self.step);
            for r in &self.running {
                h = mix(h ^ r.seq.0);
            }
            self.sum.schedule_hash = h;
            if let (Some(events), Some(kv)) = (self.events.as_deref_mut(), self.backend.paged()) {
                events.publish_drained(kv)?;
            }
            self.step += 1;
        }
        if let Some(m) = &self.store.model {
            m.verify()?;
        }
        let steps = self.step as f64;
        let s = &mut self.sum;
        s.steps = self.step;
        s.mean_kv_utilization = util_sum / steps;
        s.mean_kv_utilization_under_load = if load_steps == 0 {
            0.0
        } else {
            util_load_sum / load_steps as f64
        };
        s.mean_concurrent_seqs = conc_sum / steps;
        s.mean_internal_waste = waste_sum / steps;
        s.admissions_delayed = delayed.iter().filter(|d| **d).count();
        s.alloc_seconds = self.alloc_time.as_secs_f64();
        s.wall_seconds = start.elapsed().as_secs_f64();
        s.model_seconds = self.model_time.as_secs_f64();
        if let Some(kv) = self.backend.paged() {
            kv.check_invariants()
                .map_err(pagedkv::Error::CorruptBlockTable)?;
            if let Some(h) = self.sum.host.as_mut() {
                let t = kv.host_cache_stats();
                h.stored_blocks = t.stored_blocks;
                h.stored_bytes = t.stored_bytes;
                h.loaded_blocks = t.loaded_blocks;
                h.loaded_bytes = t.loaded_bytes;
                if t.host_hit_tokens != h.host_hit_tokens {
                    return Err(pagedkv::Error::CorruptBlockTable(format!(
                        "host level: {} hit tokens counted, {} loaded",
                        h.host_hit_tokens, t.host_hit_tokens
                    )));
                }
            }
            if let (Some(o), Some(policy)) = (self.sum.overload.as_mut(), self.policy) {
                let t = kv.tier_stats();
                o.bytes_swapped_out = t.bytes_swapped_out;
                o.bytes_swapped_in = t.bytes_swapped_in;
                o.arena_blocks = kv.num_blocks();
                o.probe_swap_gb_per_s = policy.cost.swap_bytes_per_s / 1e9;
                o.prefill_tokens_per_s = policy.cost.prefill_tokens_per_s;
            }
        }
        Ok((self.sum, self.timeline))
    }

    /// Admits a request and forks its samples, all or nothing; writes the K/V of the
    /// prompt tokens that were not already cached. Returns false when it does not fit.
    fn admit_request(&mut self, r: usize) -> pagedkv::Result<bool> {
        let trace = self.trace;
        let req = &trace[r];
        let first = SeqId(self.next_seq);
        // With a host level the prompt is admitted (and its host part loaded) first.
        let host_admitted = if self.host_level {
            match self.admit_with_host(first, &req.prompt)? {
                Some(cached) => Some(cached),
                None => return Ok(false),
            }
        } else {
            None
        };
        let admitted = self.timed(
            |b, slots, copies| -> pagedkv::Result<Option<(usize, Vec<SeqId>)>> {
                let cached = match host_admitted {
                    Some(cached) => cached,
                    None => {
                        if !b.can_admit(&req.prompt) {
                            return Ok(None);
                        }
                        b.admit(first, &req.prompt, slots)?
                    }
                };
                let mut seqs = vec![first];
                for i in 1..req.samples {
                    let child = SeqId(first.0 + i as u64);
                    match b.alloc_mut().fork(first, child, copies) {
                        Ok(()) => seqs.push(child),
                        Err(pagedkv::Error::OutOfBlocks { .. }) => {
                            for s in seqs {
                                b.alloc_mut().free(s)?;
                            }
                            copies.clear();
                            return Ok(None);
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok(Some((cached, seqs)))
            },
        )?;
        let Some((cached, seqs)) = admitted else {
            return Ok(false);
        };
        self.next_seq += seqs.len() as u64;
        // The prompt's K/V (only the uncached tail), then the forks' copies.
        let mut hash = 0;
        for (pos, &t) in req.prompt.iter().enumerate() {
            hash = chain(hash, t);
            if pos >= cached {
                self.batch.words.push((hash, first));
            }
        }
        self.batch.slots.extend_from_slice(&self.slots);
        self.batch.flush(self.store)?;
        if let Some(model) = self.model {
            // The model computes K/V of the uncached tail over the whole context (the
            // cached prefix's K/V was written by an earlier request with the same tokens).
            let t = Instant::now();
            let vocab = model.vocab_size() as u32;
            let tail: Vec<u32> = req.prompt[cached..].iter().map(|t| t % vocab).collect();
            fill_tables(self.backend.alloc(), &[first], &mut self.tables)?;
            let store = self
                .store
                .model
                .as_mut()
                .ok_or(pagedkv::Error::Unsupported("no model cache".into()))?;
            gpu::prefill_chunked(
                model,
                store.as_mut(),
                &self.tables,
                cached,
                &tail,
                self.store.prefill_chunk,
                &mut self.hidden,
            )?;
            self.model_time += t.elapsed();
        }
        self.store.copy_blocks(&self.copies)?;
        self.sum.cow_copies += self.copies.len();
        self.copies.clear();
        self.sum.prompt_tokens += req.prompt.len();
        self.sum.prefill_tokens_saved += cached;
        self.running
            .extend(seqs.into_iter().enumerate().map(|(sample, seq)| Running {
                seq,
                req: r,
                sample,
                generated: 0,
                hash,
                model_hash: 0,
            }));
        Ok(true)
    }

    /// Admits `prompt` as `first` through the prefix cache's device and host levels: a
    /// host part is loaded into fresh device blocks (the copies run on both arenas and
    /// complete here, before the sequence's first step), then the uncached tail is
    /// reserved and committed, its slots in `self.slots`. Returns the tokens the cache
    /// served (device and host), or `None` when the prompt does not fit now.
    fn admit_with_host(&mut self, first: SeqId, prompt: &[u32]) -> pagedkv::Result<Option<usize>> {
        let Backend::Paged { kv, .. } = &mut self.backend else {
            return Err(pagedkv::Error::Unsupported(
                "a host level needs the paged cache".into(),
            ));
        };
        let t = Instant::now();
        kv.lookup_prefix(prompt, &AdmitOptions::default(), &mut self.hit)?;
        if !kv.can_admit_hit(&self.hit) {
            self.alloc_time += t.elapsed();
            return Ok(None);
        }
        let a = kv.admit_prompt(first, prompt, &self.hit)?;
        let job = kv.load_job(first);
        self.alloc_time += t.elapsed();
        let h = self.sum.host.get_or_insert_with(HostFigures::default);
        if let Some(job) = job {
            let t = Instant::now();
            self.store.swap(&job.plan)?;
            h.copy_seconds += t.elapsed().as_secs_f64();
            kv.complete_swap(job.ticket)?;
        }
        h.device_hit_tokens += a.cached_tokens as u64;
        h.host_hit_tokens += a.loading_tokens as u64;
        let t = Instant::now();
        let cached = a.cached_tokens + a.loading_tokens;
        let tail = prompt.len() - cached;
        kv.reserve(first, tail, 0, &mut self.slots, &mut self.copies)?;
        kv.commit(first, tail)?;
        self.alloc_time += t.elapsed();
        Ok(Some(cached))
    }

    /// With a host level: one store of the blocks the policy picks (every block
    /// registered so far has its K/V written by now), run on both arenas and completed.
    fn store_to_host(&mut self) -> pagedkv::Result<()> {
        if !self.host_level {
            return Ok(());
        }
        let Backend::Paged { kv, .. } = &mut self.backend else {
            return Ok(());
        };
        let t = Instant::now();
        let job = kv.plan_host_store(HOST_STORE_MAX_BLOCKS)?;
        self.alloc_time += t.elapsed();
        if let Some(job) = job {
            let t = Instant::now();
            self.store.swap(&job.plan)?;
            let h = self.sum.host.get_or_insert_with(HostFigures::default);
            h.copy_seconds += t.elapsed().as_secs_f64();
            kv.complete_swap(job.ticket)?;
        }
        Ok(())
    }

    /// Every running sequence appends one token; a sequence that cannot grow preempts
    /// the most recently admitted request (recompute).
    fn decode_step(&mut self) -> pagedkv::Result<()> {
        self.reserve_for_step()?;
        let mut i = 0;
        while i < self.running.len() {
            let run = &self.running[i];
            let (seq, req, sample) = (run.seq, &self.trace[run.req], run.sample);
            let token = generated_token(req.id, sample, run.generated);
            let res = self.timed(|b, slots, copies| b.append(seq, token, slots, copies));
            match res {
                Ok(()) => {
                    self.store.copy_blocks(&self.copies)?;
                    self.sum.cow_copies += self.copies.len();
                    self.copies.clear();
                    let run = &mut self.running[i];
                    run.hash = chain(run.hash, token);
                    run.generated += 1;
                    self.batch.words.push((run.hash, seq));
                    self.batch.slots.extend_from_slice(&self.slots);
                    i += 1;
                }
                Err(pagedkv::Error::OutOfBlocks { .. }) => {
                    let victim = self.youngest_request().unwrap_or(self.running[i].req);
                    let kept_before_i =
                        self.running[..i].iter().filter(|s| s.req != victim).count();
                    self.preempt(victim)?;
                    i = kept_before_i;
                }
                Err(e) => return Err(e),
            }
        }
        self.batch.flush(self.store)?;
        self.model_decode()
    }

    /// One decode step of the attention model for every running sequence: the token
    /// just appended goes in, its K/V is written through the tables, attention runs over
    /// the whole context, and the outputs are folded into each sequence's hash.
    fn model_decode(&mut self) -> pagedkv::Result<()> {
        let Some(model) = self.model else {
            return Ok(());
        };
        if self.running.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let seqs: Vec<SeqId> = self.running.iter().map(|r| r.seq).collect();
        let tokens: Vec<u32> = self
            .running
            .iter()
            .map(|r| {
                generated_token(self.trace[r.req].id, r.sample, r.generated - 1)
                    % model.vocab_size() as u32
            })
            .collect();
        fill_tables(self.backend.alloc(), &seqs, &mut self.tables)?;
        self.hidden.resize(seqs.len() * model.hidden_size(), 0.0);
        let store = self
            .store
            .model
            .as_mut()
            .ok_or(pagedkv::Error::Unsupported("no model cache".into()))?;
        let next = model.decode_tokens(store.as_mut(), &self.tables, &tokens, &mut self.hidden)?;
        let h = model.hidden_size();
        for (i, run) in self.running.iter_mut().enumerate() {
            let mut x = run.model_hash ^ u64::from(next[i]);
            for v in &self.hidden[i * h..(i + 1) * h] {
                x = mix(x ^ u64::from(v.to_bits()));
            }
            run.model_hash = x;
        }
        self.model_time += t.elapsed();
        Ok(())
    }

    /// Overload mode: before the step, frees the blocks this step's appends need with
    /// the manager's preemption policy (swap or recompute per victim, by cost).
    fn reserve_for_step(&mut self) -> pagedkv::Result<()> {
        let Some(policy) = self.policy else {
            return Ok(());
        };
        let Backend::Paged { kv, .. } = &mut self.backend else {
            return Ok(());
        };
        // The step's whole need (one token per running sequence), as the manager
        // counts it: new blocks plus copies of shared blocks written into.
        let mut needed = 0;
        for r in &self.running {
            needed += kv.blocks_needed(r.seq, 1, 0)?;
        }
        if needed <= kv.num_available_blocks() {
            return Ok(());
        }
        let t = Instant::now();
        // `preempt_for` takes the whole need and counts what is available itself.
        let preempted = match kv.preempt_for(needed, &policy) {
            Ok(p) => p,
            // Not enough to preempt: the in-step fallback (recompute) handles it.
            Err(pagedkv::Error::OutOfBlocks { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut o = self.sum.overload.take().unwrap_or_default();
        for p in preempted {
            let group: Vec<Running> = {
                let (out, keep): (Vec<Running>, Vec<Running>) = self
                    .running
                    .drain(..)
                    .partition(|r| p.seqs.contains(&r.seq));
                self.running = keep;
                out
            };
            let Some(req) = group.first().map(|r| r.req) else {
                continue;
            };
            match p.action {
                PreemptAction::Swap(job) => {
                    self.store.swap(&job.plan)?;
                    if let Backend::Paged { kv, .. } = &mut self.backend {
                        kv.complete_swap(job.ticket)?;
                    }
                    o.swaps += 1;
                    o.simulated_seconds_lost += p.swap_seconds;
                    self.swapped.push_back(group);
                }
                PreemptAction::SwapGroups(job) => {
                    // A hybrid cache's swap: one plan per KV-cache group.
                    for plan in &job.plans {
                        self.store.swap(plan)?;
                    }
                    if let Backend::Paged { kv, .. } = &mut self.backend {
                        kv.complete_swap_grouped(&job)?;
                    }
                    o.swaps += 1;
                    o.simulated_seconds_lost += p.swap_seconds;
                    self.swapped.push_back(group);
                }
                PreemptAction::Recompute { tokens } => {
                    // The manager freed the group; the request starts over.
                    o.recomputes += 1;
                    o.recomputed_tokens += tokens.iter().map(|t| t.1).sum::<usize>();
                    o.simulated_seconds_lost += p.recompute_seconds;
                    self.waiting.push_front(req);
                }
            }
            self.sum.preemptions += 1;
            self.timeline.mark(self.step, EventKind::Preemption);
        }
        self.sum.overload = Some(o);
        self.alloc_time += t.elapsed();
        Ok(())
    }

    /// Brings swapped-out groups back, oldest first, while they fit with room to grow.
    fn swap_in_ready(&mut self) -> pagedkv::Result<()> {
        while let Some(group) = self.swapped.front() {
            let Backend::Paged { kv, .. } = &mut self.backend else {
                return Ok(());
            };
            let seqs: Vec<SeqId> = group.iter().map(|r| r.seq).collect();
            let blocks = kv.swapped_table(seqs[0])?.len();
            if kv.num_available_blocks()
                < blocks + kv.config().watermark_blocks + self.running.len() / 4 + 1
            {
                return Ok(());
            }
            let job = match kv.swap_in_group(&seqs) {
                Ok(job) => job,
                Err(pagedkv::Error::OutOfBlocks { .. }) => return Ok(()),
                Err(e) => return Err(e),
            };
            self.store.swap(&job.plan)?;
            kv.complete_swap(job.ticket)?;
            if let Some(group) = self.swapped.pop_front() {
                self.running.extend(group);
            }
        }
        Ok(())
    }

    fn youngest_request(&self) -> Option<usize> {
        self.running
            .iter()
            .map(|s| s.req)
            .max_by_key(|&q| (self.trace[q].arrival_step, q))
    }

    /// Preempts a request by recompute: all its sequences are freed and it goes back to
    /// the head of the queue, to start over.
    fn preempt(&mut self, victim: usize) -> pagedkv::Result<()> {
        let seqs: Vec<SeqId> = self
            .running
            .iter()
            .filter(|s| s.req == victim)
            .map(|s| s.seq)
            .collect();
        self.timed(|b, _, _| seqs.iter().try_for_each(|&s| b.alloc_mut().free(s)))?;
        self.running.retain(|s| s.req != victim);
        // Tokens of the victim queued for writing this step are dropped with it, and the
        // others' slots are looked up again (a freed block may be handed out again).
        let keep: Vec<bool> = self
            .batch
            .words
            .iter()
            .map(|(_, s)| !seqs.contains(s))
            .collect();
        let mut k = keep.iter();
        self.batch.words.retain(|_| *k.next().unwrap_or(&true));
        let mut k = keep.iter();
        self.batch.slots.retain(|_| *k.next().unwrap_or(&true));
        self.sum.preemptions += 1;
        if self.policy.is_some() {
            // In overload mode this is the in-step fallback when the reservation before
            // the step fell short: a recompute, outside the cost model.
            let o = self.sum.overload.get_or_insert_with(Overload::default);
            o.recomputes += 1;
        }
        self.timeline.mark(self.step, EventKind::Preemption);
        self.waiting.push_front(victim);
        Ok(())
    }

    /// Retires finished sequences, checking their K/V; a request is served when all its
    /// samples are.
    fn retire(&mut self, bar: &ProgressBar) -> pagedkv::Result<()> {
        let mut j = 0;
        while j < self.running.len() {
            let s = &self.running[j];
            let req = &self.trace[s.req];
            if s.generated < req.output_len {
                j += 1;
                continue;
            }
            let (seq, r, sample) = (s.seq, s.req, s.sample);
            self.sum.model_checksum ^=
                mix(s.model_hash ^ req.id.wrapping_mul(0x9e37) ^ sample as u64);
            self.sum.kv_checksum ^= self.check_sequence(seq, req, sample)?;
            self.timed(|b, _, _| b.alloc_mut().free(seq))?;
            self.sum.sequences_served += 1;
            self.sum.tokens_generated += req.output_len;
            self.running.swap_remove(j);
            if !self.running.iter().any(|o| o.req == r) {
                self.sum.requests_served += 1;
                bar.inc(1);
            }
        }
        Ok(())
    }

    /// Checks a finished sequence's K/V (first and last layer) against the values it
    /// must hold; returns their FNV-1a hash, so runs can be compared as a whole.
    fn check_sequence(&self, seq: SeqId, req: &Request, sample: usize) -> pagedkv::Result<u64> {
        let alloc = self.backend.alloc();
        let layout = *self.store.layout();
        let n = alloc.num_tokens(seq)?;
        let table = alloc.block_table(seq)?;
        let per_token =
            layout.shape().num_kv_heads * layout.shape().head_dim * layout.dtype().size_bytes();
        let tokens = req
            .prompt
            .iter()
            .copied()
            .chain((0..req.output_len).map(|i| generated_token(req.id, sample, i)));
        let mut words = Vec::with_capacity(n);
        let mut hash = 0;
        for t in tokens.take(n) {
            hash = chain(hash, t);
            words.push(hash);
        }
        let (mut k, mut v) = (vec![0u8; n * per_token], vec![0u8; n * per_token]);
        let mut want = Vec::with_capacity(per_token);
        let mut fnv = 0xcbf2_9ce4_8422_2325u64;
        for layer in [0, layout.num_layers() - 1] {
            self.store.read_tokens(layer, table, n, &mut k, &mut v)?;
            for (pos, &w) in words.iter().enumerate() {
                for (data, word) in [(&k, w), (&v, !w)] {
                    want.clear();
                    fill_token(&mut want, word, layer, per_token);
                    if data[pos * per_token..(pos + 1) * per_token] != want[..] {
                        return Err(pagedkv::Error::CorruptBlockTable(format!(
                            "request {} sample {sample}: token {pos} of layer {layer} holds the wrong K/V",
                            req.id
                        )));
                    }
                }
            }
            for b in k.iter().chain(&v) {
                fnv = (fnv ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        Ok(fnv)
    }

    /// Another model needs memory: free enough (cached blocks first, then by
    /// preemption), compact and shrink the arena; later grow it back.
    fn elastic_phase(&mut self, plan: ElasticPlan) -> pagedkv::Result<()> {
        if self.step != plan.shrink_at && self.step != plan.grow_at {
            return Ok(());
        }
        let full = self.store.num_blocks();
        let mut e = self.sum.elastic.take().unwrap_or_default();
        let t = Instant::now();
        if self.step == plan.shrink_at {
            let kv = self
                .backend
                .paged()
                .ok_or(pagedkv::Error::Unsupported("elastic needs paging".into()))?;
            e.fragmentation_before = kv.fragmentation().fragmentation;
            kv.evict_cached(usize::MAX);
            // Keep the watermark and a block per running sequence free after shrinking.
            let headroom = kv.config().watermark_blocks + self.running.len();
            while self.backend.alloc().stats().used_blocks + headroom > plan.shrunk_blocks {
                let Some(victim) = self.youngest_request() else {
                    break;
                };
                self.preempt(victim)?;
                e.preemptions += 1;
            }
            let kv = self
                .backend
                .paged()
                .ok_or(pagedkv::Error::Unsupported("elastic needs paging".into()))?;
            // Preempted requests' blocks went to the prefix cache; the memory is leaving.
            kv.evict_cached(usize::MAX);
            let moves = pagedkv::executor::shrink_to(kv, plan.shrunk_blocks, &mut *self.store)?;
            let frag: FragStats = kv.fragmentation();
            e.fragmentation_after = frag.fragmentation;
            e.moves += moves.len();
            e.bytes_moved += moves.len() * self.store.layout().block_bytes();
            e.blocks_released += full - plan.shrunk_blocks;
            e.shrinks += 1;
        } else {
            let target = self.store.num_blocks() + e.blocks_released / e.shrinks.max(1);
            let kv = self
                .backend
                .paged()
                .ok_or(pagedkv::Error::Unsupported("elastic needs paging".into()))?;
            pagedkv::executor::grow_to(kv, target, &mut *self.store)?;
            e.grows += 1;
        }
        e.seconds += t.elapsed().as_secs_f64();
        self.timeline.mark(self.step, EventKind::Defragmentation);
        self.sum.elastic = Some(e);
        Ok(())
    }
}

/// One line of the summary table: how to print a figure.
type Row = Box<dyn Fn(&Summary) -> String>;

/// The runs of one backend, with what describes them.
struct Outcome {
    config: ModelConfig,
    layout: KvLayout,
    num_blocks: usize,
    trace: Vec<Request>,
    runs: Vec<(&'static str, Summary, Timeline)>,
    /// The overload run's preemption policy (its cost model was probed on this backend).
    overload_policy: Option<PreemptPolicy>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().any(|a| a == "--hybrid") {
        return hybrid::main(); // its own trace and flags: see examples/serve_hybrid/mod.rs
    }
    let args = Args::parse();
    let mut events = match &args.kv_events {
        Some(endpoint) => {
            let mut config = ZmqPublisherConfig::new(endpoint)
                .topic(&args.kv_events_topic)
                .data_parallel_rank(args.kv_events_rank);
            config.replay_endpoint = args.kv_events_replay.clone();
            Some(ZmqEventPublisher::bind(config)?)
        }
        None => None,
    };
    let checks = gpu::SharedChecks::default();
    checks.borrow_mut().tolerance = gpu::tolerance(args.max_len);
    // The GPU runs first (a missing GPU fails at once), then the host runs they must
    // agree with.
    let out = match args.backend {
        StorageKind::Host => simulate(&args, StorageKind::Host, &checks, None, events.as_mut())?,
        StorageKind::Cuda => {
            let dev = match simulate(&args, StorageKind::Cuda, &checks, None, events.as_mut()) {
                Ok(dev) => dev,
                Err(e) => {
                    eprintln!(
                        "serve --backend cuda failed (there is no fallback to the host): {e}"
                    );
                    std::process::exit(1);
                }
            };
            let host = simulate(&args, StorageKind::Host, &checks, dev.overload_policy, None)?;
            let figures = |o: &Outcome| -> Vec<(String, serde_json::Value)> {
                o.runs
                    .iter()
                    .map(|r| (r.0.to_string(), r.1.json()))
                    .collect()
            };
            if let Err(e) = gpu::compare_runs(&figures(&host), &figures(&dev)) {
                eprintln!("serve --backend cuda: the GPU runs differ from the host runs: {e}");
                std::process::exit(1);
            }
            let c = checks.borrow().clone();
            if !args.no_attend
                && (c.prefill_launches == 0 || c.decode_launches == 0 || c.cache_compares == 0)
            {
                eprintln!("serve --backend cuda: the model ran, yet nothing was checked: {c:?}");
                std::process::exit(1);
            }
            dev
        }
    };
    if let Some(p) = events {
        // Dropping the publisher sends what is queued (1 s at most).
        eprintln!("KV events: {:?}", p.stats());
    }
    let Outcome {
        config,
        layout,
        num_blocks,
        trace,
        runs,
        ..
    } = out;
    // The picture is the simulation's main output, so it is drawn unless `--no-svg`. A
    // path the user chose must be writable; the default one may not exist (a binary
    // copied to another machine), which costs the picture, not the run.
    let svg_note = if args.no_svg {
        None
    } else {
        let title = format!(
            "{}: {} blocks of {} tokens, paged vs contiguous",
            config.name, num_blocks, args.block_size
        );
        let paged_tl = runs[0].2.clone();
        let contig_tl = runs[runs.len() - 1].2.clone();
        let chart = MemoryChart::new(title, &layout, num_blocks, paged_tl, contig_tl);
        match &args.svg {
            Some(path) => {
                chart.write_svg(path)?;
                Some(format!("memory timeline: {}", path.display()))
            }
            None => {
                let path = default_svg_path();
                // One level only: a missing `target/` (cargo built elsewhere, through
                // `build.target-dir`) is made; a directory whose parent is gone (the
                // binary copied to another machine) is not.
                if let Some(dir) = path.parent() {
                    let _ = std::fs::create_dir(dir);
                }
                Some(match chart.write_svg(&path) {
                    Ok(()) => format!("memory timeline: {}", path.display()),
                    Err(e) => {
                        format!("memory timeline not written ({e}); --svg PATH chooses another")
                    }
                })
            }
        }
    };
    let cuda = (args.backend == StorageKind::Cuda).then(|| checks.borrow().clone());
    if args.json {
        let mut out = serde_json::Map::new();
        for (name, s, _) in &runs {
            out.insert((*name).to_string(), s.json());
        }
        if let Some(c) = &cuda {
            out.insert("cuda_checks".into(), c.json());
        }
        println!("{}", serde_json::Value::Object(out));
        // Standard output stays one JSON object.
        if let Some(note) = svg_note {
            eprintln!("{note}");
        }
        return Ok(());
    }
    print_table(&args, &config, &layout, num_blocks, &trace, &runs);
    if let Some(c) = &cuda {
        c.print();
    }
    if let Some(note) = svg_note {
        println!("\n{note}");
    }
    Ok(())
}

/// Where the timeline goes without `--svg`: `serve-timeline.svg` in the target
/// directory: `CARGO_TARGET_DIR` when set (the run inherits it from the shell that ran
/// cargo; a relative one is relative to the working directory, as for cargo), else
/// `target/` in the crate.
fn default_svg_path() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"))
        .join("serve-timeline.svg")
}

/// Runs the trace on every configuration the arguments ask for, with `kind`'s storages.
fn simulate(
    args: &Args,
    kind: StorageKind,
    checks: &gpu::SharedChecks,
    reuse_policy: Option<PreemptPolicy>,
    mut events: Option<&mut ZmqEventPublisher>,
) -> Result<Outcome, Box<dyn std::error::Error>> {
    let config = match pagedkv::plan::config::builtin::by_name(&args.model) {
        Some(text) => ModelConfig::from_json_str(text)?,
        None => ModelConfig::from_file(&args.model)?,
    };
    let layout = KvLayout::new(config.shape, args.block_size)?;
    let arena_bytes = (args.arena_gib * (1u64 << 30) as f64) as usize;
    let num_blocks = layout.blocks_for_budget(arena_bytes);
    if args.max_len < 16 || layout.blocks_for_tokens(args.max_len) > num_blocks {
        return Err(format!(
            "max_len {} does not fit an arena of {num_blocks} blocks",
            args.max_len
        )
        .into());
    }
    let trace = make_trace(args);
    let bar = if args.quiet || args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(trace.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>18} [{bar:40}] {pos}/{len} requests {elapsed}")?
            .progress_chars("=> "),
    );
    let cfg = CacheConfig {
        num_blocks,
        watermark_blocks: num_blocks / 100,
        max_seq_len_tokens: args.max_len,
        ..CacheConfig::new(num_blocks)
    };
    let elastic = args.elastic.then(|| ElasticPlan {
        shrink_at: trace[trace.len() / 3].arrival_step,
        grow_at: trace[2 * trace.len() / 3]
            .arrival_step
            .max(trace[trace.len() / 3].arrival_step + 1),
        shrunk_blocks: ((num_blocks as f64 * args.elastic_fraction) as usize)
            .max(layout.blocks_for_tokens(args.max_len) + cfg.watermark_blocks + 1),
    });

    let mut runs: Vec<(&str, Summary, Timeline)> = Vec::new();
    let paged_runs: &[(&str, bool)] = if args.no_prefix_cache {
        &[("paged", false)]
    } else {
        &[("paged", true), ("paged_prefix_off", false)]
    };
    let model = if args.no_attend {
        None
    } else {
        Some(TinyModel::new(
            TinyModel::scaled_shape(layout.shape()),
            args.seed,
        )?)
    };
    let mirror = |num_blocks, host_blocks| -> pagedkv::Result<Mirror> {
        let model_cache = match &model {
            Some(m) => Some(gpu::model_cache(
                kind,
                KvLayout::new(*m.shape(), args.block_size)?,
                num_blocks,
                host_blocks,
                checks,
            )?),
            None => None,
        };
        Ok(Mirror {
            main: gpu::arena(kind, layout, num_blocks, host_blocks)?,
            model: model_cache,
            prefill_chunk: args.prefill_chunk,
        })
    };
    for &(name, prefix_cache) in paged_runs {
        // `--kv-events`: the prefix-cache run records its events and publishes them.
        let events = events.take().filter(|_| prefix_cache);
        let mut kv = if events.is_some() {
            let mut prefix = PrefixConfig::for_arena(num_blocks);
            prefix.record_events = true;
            KvCache::with_prefix_config(layout, cfg, prefix)?
        } else {
            KvCache::new(layout, cfg)?
        };
        let mut store = mirror(num_blocks, 0)?;
        bar.set_prefix(name);
        let backend = Backend::Paged {
            kv: &mut kv,
            prefix_cache,
        };
        let mut sim = Sim::new(backend, &mut store, model.as_ref(), &trace, "paged");
        if let Some(p) = events {
            eprintln!(
                "{name}: KV events on tcp://{}{}",
                p.local_addr(),
                p.replay_addr()
                    .map_or(String::new(), |a| format!(", replay on tcp://{a}"))
            );
            sim.events = Some(p);
        }
        let (sum, tl) = sim.run(&bar, elastic)?;
        runs.push((name, sum, tl));
    }
    if let (Some(host_blocks), false) = (args.host_cache, args.no_prefix_cache) {
        // The prefix-cache run again, with the host tier as a level of the prefix cache.
        let tiers = TierConfig {
            num_host_blocks: host_blocks,
            num_disk_slots: 0,
        };
        let mut kv = KvCache::with_tiers(layout, cfg, tiers)?;
        kv.set_host_cache(HostCacheConfig {
            store: args.host_store_policy.policy(),
            ..HostCacheConfig::default()
        })?;
        let mut store = mirror(num_blocks, host_blocks)?;
        bar.set_prefix("paged_host");
        let backend = Backend::Paged {
            kv: &mut kv,
            prefix_cache: true,
        };
        let mut sim = Sim::new(backend, &mut store, model.as_ref(), &trace, "paged");
        sim.host_level = true;
        sim.sum.host = Some(HostFigures {
            blocks: host_blocks,
            policy: format!("{:?}", args.host_store_policy.policy()),
            ..HostFigures::default()
        });
        let (sum, tl) = sim.run(&bar, elastic)?;
        runs.push(("paged_host", sum, tl));
    }
    let mut overload_policy = None;
    if args.overload {
        // The same trace on a squeezed arena with a host tier as large as the full arena:
        // preemption is forced, and every request must still end with the same outputs.
        let squeezed = ((num_blocks as f64 * args.overload_fraction) as usize)
            .max(layout.blocks_for_tokens(args.max_len) + cfg.watermark_blocks + 1);
        let cfg = CacheConfig {
            num_blocks: squeezed,
            watermark_blocks: squeezed / 100,
            ..cfg
        };
        let tiers = TierConfig {
            num_host_blocks: num_blocks,
            num_disk_slots: 0,
        };
        let mut kv = KvCache::with_tiers(layout, cfg, tiers)?;
        let mut store = mirror(squeezed, num_blocks)?;
        let policy = match reuse_policy {
            // The host run after a GPU run decides with the GPU run's cost model, so
            // the two can be compared decision for decision.
            Some(p) => p,
            None => {
                let prefill = match (args.prefill_tokens_per_s, &model) {
                    (Some(rate), _) => rate,
                    (None, Some(m)) => measure_prefill(m, args.block_size)?,
                    (None, None) => 5_000.0,
                };
                // The probe swaps real blocks of this storage out and back before any
                // data lands.
                PreemptPolicy::cost_based(pagedkv::executor::probe_cost_model(
                    &mut store, 16, prefill,
                )?)
            }
        };
        overload_policy = Some(policy);
        bar.set_prefix("paged_overload");
        let backend = Backend::Paged {
            kv: &mut kv,
            prefix_cache: true,
        };
        let mut sim = Sim::new(backend, &mut store, model.as_ref(), &trace, "paged");
        sim.policy = Some(policy);
        let (sum, tl) = sim.run(&bar, None)?;
        runs.push(("paged_overload", sum, tl));
    }
    let mut contiguous = ContiguousCache::new(layout, num_blocks, args.max_len)?;
    let mut store = mirror(num_blocks, 0)?;
    bar.set_prefix("contiguous");
    let backend = Backend::Contiguous(&mut contiguous);
    let (c, ctl) =
        Sim::new(backend, &mut store, model.as_ref(), &trace, "contiguous").run(&bar, None)?;
    runs.push(("contiguous", c, ctl));
    bar.finish_and_clear();

    if runs
        .iter()
        .any(|r| r.1.kv_checksum != runs[0].1.kv_checksum)
    {
        return Err("the runs left different K/V bytes".into());
    }
    // On the GPU a token's model outputs depend on whether the prefill or the decode
    // kernel computed it (a prefix-cache hit can hold decode-computed K/V that another
    // run recomputes by prefill), so only the host runs must match bit for bit; each
    // GPU launch was checked against the host path instead.
    if kind == StorageKind::Host
        && runs
            .iter()
            .any(|r| r.1.model_checksum != runs[0].1.model_checksum)
    {
        return Err("the attention model's outputs differ between runs".into());
    }
    Ok(Outcome {
        config,
        layout,
        num_blocks,
        trace,
        runs,
        overload_policy,
    })
}

fn print_table(
    args: &Args,
    config: &ModelConfig,
    layout: &KvLayout,
    num_blocks: usize,
    trace: &[Request],
    runs: &[(&str, Summary, Timeline)],
) {
    println!(
        "model {} ({} layers, {} KV heads x {}, {}), {:.2} GiB arena = {} blocks of {} tokens, max_len {}",
        config.name,
        layout.num_layers(),
        layout.shape().num_kv_heads,
        layout.shape().head_dim,
        layout.dtype(),
        args.arena_gib,
        num_blocks,
        args.block_size,
        args.max_len
    );
    println!(
        "trace: {} requests, seed {}, arrival rate {}/step\n",
        trace.len(),
        args.seed,
        args.arrival_rate
    );
    let mut rows: Vec<(&str, Row)> = vec![
        (
            "requests served",
            Box::new(|s| s.requests_served.to_string()),
        ),
        (
            "sequences served",
            Box::new(|s| s.sequences_served.to_string()),
        ),
        (
            "peak concurrent sequences",
            Box::new(|s| s.peak_concurrent_seqs.to_string()),
        ),
        (
            "mean concurrent sequences",
            Box::new(|s| format!("{:.1}", s.mean_concurrent_seqs)),
        ),
        (
            "mean KV utilization",
            Box::new(|s| format!("{:.1} %", 100.0 * s.mean_kv_utilization)),
        ),
        (
            "mean KV utilization under load",
            Box::new(|s| format!("{:.1} %", 100.0 * s.mean_kv_utilization_under_load)),
        ),
        (
            "peak KV utilization",
            Box::new(|s| format!("{:.1} %", 100.0 * s.peak_kv_utilization)),
        ),
        (
            "mean internal waste",
            Box::new(|s| format!("{:.2} %", 100.0 * s.mean_internal_waste)),
        ),
        (
            "prefix hit rate (prompt tokens)",
            Box::new(|s| format!("{:.1} %", 100.0 * s.prefix_hit_rate())),
        ),
        (
            "prefill tokens saved",
            Box::new(|s| s.prefill_tokens_saved.to_string()),
        ),
        (
            "admissions delayed",
            Box::new(|s| s.admissions_delayed.to_string()),
        ),
        ("preemptions", Box::new(|s| s.preemptions.to_string())),
        ("decode steps", Box::new(|s| s.steps.to_string())),
        (
            "time in allocator calls",
            Box::new(|s| format!("{:.1} ms", 1e3 * s.alloc_seconds)),
        ),
        (
            "time in the attention model",
            Box::new(|s| format!("{:.2} s", s.model_seconds)),
        ),
        (
            "wall time",
            Box::new(|s| format!("{:.2} s", s.wall_seconds)),
        ),
        (
            "generated tokens / s",
            Box::new(|s| format!("{:.0}", s.tokens_generated as f64 / s.wall_seconds)),
        ),
    ];
    if args.overload {
        let o = |f: fn(&Overload) -> String| -> Row {
            Box::new(move |s| s.overload.as_ref().map_or("-".into(), f))
        };
        rows.push(("overload: arena blocks", o(|o| o.arena_blocks.to_string())));
        rows.push(("overload: swapped out (groups)", o(|o| o.swaps.to_string())));
        rows.push((
            "overload: recomputed (groups)",
            o(|o| o.recomputes.to_string()),
        ));
        rows.push((
            "overload: MiB swapped out/in",
            o(|o| {
                format!(
                    "{:.0}/{:.0}",
                    o.bytes_swapped_out as f64 / 1048576.0,
                    o.bytes_swapped_in as f64 / 1048576.0
                )
            }),
        ));
        rows.push((
            "overload: tokens recomputed",
            o(|o| o.recomputed_tokens.to_string()),
        ));
        rows.push((
            "overload: est. time lost",
            o(|o| format!("{:.2} s", o.simulated_seconds_lost)),
        ));
        rows.push((
            "overload: swap GB/s, prefill tok/s",
            o(|o| {
                format!(
                    "{:.1}, {:.0}",
                    o.probe_swap_gb_per_s, o.prefill_tokens_per_s
                )
            }),
        ));
    }
    if args.host_cache.is_some() {
        let h = |f: fn(&HostFigures) -> String| -> Row {
            Box::new(move |s| s.host.as_ref().map_or("-".into(), f))
        };
        rows.push((
            "host level: hit tokens device/host",
            h(|h| format!("{}/{}", h.device_hit_tokens, h.host_hit_tokens)),
        ));
        rows.push((
            "host level: blocks stored/loaded",
            h(|h| format!("{}/{}", h.stored_blocks, h.loaded_blocks)),
        ));
        rows.push((
            "host level: MiB stored/loaded",
            h(|h| {
                format!(
                    "{:.0}/{:.0}",
                    h.stored_bytes as f64 / 1048576.0,
                    h.loaded_bytes as f64 / 1048576.0
                )
            }),
        ));
        rows.push((
            "host level: copy time",
            h(|h| format!("{:.2} s", h.copy_seconds)),
        ));
    }
    if args.elastic {
        let e = |f: fn(&Elastic) -> String| -> Row {
            Box::new(move |s| s.elastic.as_ref().map_or("-".into(), f))
        };
        rows.push((
            "elastic: blocks released",
            e(|e| e.blocks_released.to_string()),
        ));
        rows.push(("elastic: blocks moved", e(|e| e.moves.to_string())));
        rows.push((
            "elastic: MiB moved",
            e(|e| format!("{:.1}", e.bytes_moved as f64 / (1 << 20) as f64)),
        ));
        rows.push((
            "elastic: shrink+grow time",
            e(|e| format!("{:.1} ms", 1e3 * e.seconds)),
        ));
        rows.push(("elastic: preemptions", e(|e| e.preemptions.to_string())));
        rows.push((
            "elastic: frag. before/after",
            e(|e| format!("{:.3}/{:.3}", e.fragmentation_before, e.fragmentation_after)),
        ));
    }
    print!("{:<34}", "");
    for (name, _, _) in runs {
        print!(" {name:>16}");
    }
    println!();
    for (label, f) in &rows {
        print!("{label:<34}");
        for (_, s, _) in runs {
            print!(" {:>16}", f(s));
        }
        println!();
    }
    let (p, c) = (&runs[0].1, &runs[runs.len() - 1].1);
    println!(
        "\npaged holds {:.1}x the peak concurrent sequences of contiguous; every sequence's K/V was checked and the runs match (checksum {:016x}).",
        p.peak_concurrent_seqs as f64 / c.peak_concurrent_seqs.max(1) as f64,
        p.kv_checksum
    );
    if !args.no_attend {
        println!(
            "the attention model's outputs (next tokens and hidden states, every step of every sequence) are identical across runs (checksum {:016x}).",
            p.model_checksum
        );
    }
}

/// Padded block tables of `seqs` from any allocator (both implement `block_table`).
fn fill_tables(
    alloc: &dyn CacheAllocator,
    seqs: &[SeqId],
    out: &mut PaddedTables,
) -> pagedkv::Result<()> {
    let mut max_blocks = 0;
    for &s in seqs {
        max_blocks = max_blocks.max(alloc.block_table(s)?.len());
    }
    out.tables.clear();
    out.tables.resize(seqs.len() * max_blocks, 0);
    out.context_lens.clear();
    out.batch = seqs.len();
    out.max_blocks = max_blocks;
    for (i, &s) in seqs.iter().enumerate() {
        for (d, b) in out.tables[i * max_blocks..]
            .iter_mut()
            .zip(alloc.block_table(s)?)
        {
            *d = b.0;
        }
        out.context_lens.push(alloc.num_tokens(s)? as u32);
    }
    Ok(())
}
