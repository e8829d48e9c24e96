//! The serve simulation: continuous batching over a seeded, long-tailed request trace,
//! run twice on the same host-memory arena — once with paged allocation, once with
//! contiguous `max_len` reservations — with every token's K and V really written into
//! the arena through the slot mapping.
//!
//! ```text
//! cargo run --release --example serve                # table
//! cargo run --release --example serve -- --json      # {"paged": {...}, "contiguous": {...}}
//! cargo run --release --example serve -- --help
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use pagedkv::{
    CacheAllocator, CacheConfig, ContiguousCache, CopyPlan, HostStorage, KvCacheManager, KvLayout,
    ModelConfig, SeqId, Slot, Storage,
};

#[derive(Parser, Debug)]
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
    /// Trace seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// splitmix64: a small, seeded generator, so the trace is the same on every machine.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
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
}

#[derive(Debug, Clone)]
struct Request {
    id: u64,
    arrival_step: u64,
    prompt_len: usize,
    output_len: usize,
    samples: usize,
}

fn make_trace(args: &Args) -> Vec<Request> {
    let mut rng = Rng(args.seed);
    let mut step = 0.0;
    (0..args.requests as u64)
        .map(|id| {
            step += -rng.unit().max(1e-12).ln() / args.arrival_rate;
            let prompt_len = (rng.lognormal(250.0, 0.9) as usize).clamp(8, args.max_len / 2);
            let output_len =
                (rng.lognormal(120.0, 0.8) as usize).clamp(4, args.max_len - prompt_len);
            let samples = if rng.unit() < args.fork_share {
                2 + (rng.next_u64() % 3) as usize
            } else {
                1
            };
            Request {
                id,
                arrival_step: step as u64,
                prompt_len,
                output_len,
                samples,
            }
        })
        .collect()
}

/// The K/V value of one token: a function of (request, sample, position, layer) only,
/// so both allocators must end with identical bytes for every sequence. Prompt tokens
/// are shared by all samples of a request.
fn token_word(req: u64, sample: usize, pos: usize, prompt_len: usize, layer: usize) -> u64 {
    let sample = if pos < prompt_len { 0 } else { sample as u64 };
    let mut z = req.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (sample << 48)
        ^ ((pos as u64) << 16)
        ^ layer as u64;
    z = (z ^ (z >> 31)).wrapping_mul(0xd6e8_feb8_6659_fd93);
    z ^ (z >> 32)
}

fn fnv1a(hash: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *hash ^= u64::from(b);
        *hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
}

/// A running sequence: one sample of a request.
struct Running {
    seq: SeqId,
    req: usize,
    sample: usize,
    generated: usize,
}

/// Tokens to write this step: (request index, sample, position) with its slot.
#[derive(Default)]
struct WriteBatch {
    tokens: Vec<(u64, usize, usize, usize)>,
    slots: Vec<Slot>,
    k: Vec<u8>,
    v: Vec<u8>,
}

impl WriteBatch {
    fn push(&mut self, req: &Request, sample: usize, first_pos: usize, slots: &[Slot]) {
        for (i, &s) in slots.iter().enumerate() {
            self.tokens
                .push((req.id, sample, first_pos + i, req.prompt_len));
            self.slots.push(s);
        }
    }

    /// Writes every layer's K/V of the batch through the slot mapping.
    fn flush(&mut self, store: &mut HostStorage) -> pagedkv::Result<()> {
        let layout = *store.layout();
        let per_token =
            layout.shape().num_kv_heads * layout.shape().head_dim * layout.dtype().size_bytes();
        for layer in 0..layout.num_layers() {
            self.k.clear();
            self.v.clear();
            for &(req, sample, pos, prompt_len) in &self.tokens {
                let w = token_word(req, sample, pos, prompt_len, layer);
                fill_words(&mut self.k, w, per_token);
                fill_words(&mut self.v, !w, per_token);
            }
            store.write_slots(layer, &self.slots, &self.k, &self.v)?;
        }
        self.tokens.clear();
        self.slots.clear();
        Ok(())
    }
}

fn fill_words(out: &mut Vec<u8>, word: u64, len: usize) {
    let bytes = word.to_le_bytes();
    out.extend((0..len).map(|i| bytes[i % 8]));
}

#[derive(Debug, Default, Clone)]
struct Summary {
    requests_served: usize,
    sequences_served: usize,
    tokens_generated: usize,
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
}

impl Summary {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "requests_served": self.requests_served,
            "sequences_served": self.sequences_served,
            "tokens_generated": self.tokens_generated,
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
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_generated as f64 / self.wall_seconds.max(1e-9),
            "kv_checksum": self.kv_checksum,
        })
    }
}

/// Runs the trace on one allocator and one arena.
fn simulate(
    alloc: &mut dyn CacheAllocator,
    store: &mut HostStorage,
    trace: &[Request],
    bar: &ProgressBar,
) -> pagedkv::Result<Summary> {
    let layout = *alloc.layout();
    let start = Instant::now();
    let mut alloc_time = Duration::ZERO;
    let mut sum = Summary::default();
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut next_arrival = 0;
    let mut next_seq = 0u64;
    let mut delayed = vec![false; trace.len()];
    let (mut slots, mut copies, mut batch) = (Vec::new(), CopyPlan::new(), WriteBatch::default());
    let mut checksum = 0u64;
    let (mut util_sum, mut util_load_sum, mut load_steps, mut conc_sum, mut waste_sum) =
        (0.0, 0.0, 0u64, 0.0, 0.0);
    let arena_slots = (store.num_blocks() * layout.block_size()) as f64;
    let mut step = 0u64;
    bar.set_length(trace.len() as u64);
    bar.set_position(0);
    while sum.requests_served < trace.len() {
        while next_arrival < trace.len() && trace[next_arrival].arrival_step <= step {
            waiting.push_back(next_arrival);
            next_arrival += 1;
        }
        // Admit in arrival order; the head of the queue blocks the rest (no skipping).
        while let Some(&r) = waiting.front() {
            let req = &trace[r];
            let t = Instant::now();
            let admitted = admit_request(
                alloc,
                req,
                &mut next_seq,
                &mut slots,
                &mut copies,
                &mut running,
                r,
            )?;
            alloc_time += t.elapsed();
            if !admitted {
                delayed[r] = true;
                break;
            }
            waiting.pop_front();
            // The prompt's K/V, then the forks' copies (contiguous forks copy the prompt).
            batch.push(req, 0, 0, &slots);
            batch.flush(store)?;
            store.copy_blocks(&copies)?;
            sum.cow_copies += copies.len();
            copies.clear();
        }
        // One decode step: every running sequence appends one token.
        let mut i = 0;
        while i < running.len() {
            let (seq, r, sample) = (running[i].seq, running[i].req, running[i].sample);
            let t = Instant::now();
            let res = alloc.append(seq, 1, &mut slots, &mut copies);
            alloc_time += t.elapsed();
            match res {
                Ok(()) => {
                    store.copy_blocks(&copies)?;
                    sum.cow_copies += copies.len();
                    copies.clear();
                    batch.push(&trace[r], sample, alloc.num_tokens(seq)? - 1, &slots);
                    running[i].generated += 1;
                    i += 1;
                }
                Err(pagedkv::Error::OutOfBlocks { .. }) => {
                    // Preempt by recompute: the most recently admitted request gives
                    // back all its sequences and goes back to the head of the queue.
                    let victim = running
                        .iter()
                        .map(|s| s.req)
                        .max_by_key(|&q| trace[q].arrival_step)
                        .unwrap_or(r);
                    let t = Instant::now();
                    for s in running.iter().filter(|s| s.req == victim) {
                        alloc.free(s.seq)?;
                    }
                    alloc_time += t.elapsed();
                    let before = running.len();
                    let kept_before_i = running[..i].iter().filter(|s| s.req != victim).count();
                    running.retain(|s| s.req != victim);
                    batch.tokens.retain(|t| t.0 != trace[victim].id);
                    // Slots of the victim's tokens written this step are dropped with them.
                    rebuild_slots(&mut batch, alloc, &running, trace)?;
                    i = kept_before_i;
                    sum.preemptions += 1;
                    debug_assert!(running.len() < before);
                    waiting.push_front(victim);
                }
                Err(e) => return Err(e),
            }
        }
        batch.flush(store)?;
        // Retire finished sequences; a request is served when all its samples are.
        let mut j = 0;
        while j < running.len() {
            let s = &running[j];
            let req = &trace[s.req];
            if s.generated >= req.output_len {
                checksum ^= sequence_checksum(store, alloc, s.seq, req, s.sample)?;
                let t = Instant::now();
                alloc.free(s.seq)?;
                alloc_time += t.elapsed();
                sum.sequences_served += 1;
                sum.tokens_generated += req.output_len;
                let r = s.req;
                running.swap_remove(j);
                if !running.iter().any(|o| o.req == r) {
                    sum.requests_served += 1;
                    bar.inc(1);
                }
            } else {
                j += 1;
            }
        }
        let stats = alloc.stats();
        let util = stats.live_token_slots as f64 / arena_slots;
        sum.peak_concurrent_seqs = sum.peak_concurrent_seqs.max(stats.num_sequences);
        sum.peak_kv_utilization = sum.peak_kv_utilization.max(util);
        util_sum += util;
        conc_sum += stats.num_sequences as f64;
        waste_sum += stats.internal_waste_slots as f64 / arena_slots;
        if !waiting.is_empty() {
            util_load_sum += util;
            load_steps += 1;
        }
        sum.peak_used_blocks = sum.peak_used_blocks.max(stats.used_blocks);
        step += 1;
    }
    sum.steps = step;
    sum.mean_kv_utilization = util_sum / step as f64;
    sum.mean_kv_utilization_under_load = if load_steps == 0 {
        0.0
    } else {
        util_load_sum / load_steps as f64
    };
    sum.mean_concurrent_seqs = conc_sum / step as f64;
    sum.mean_internal_waste = waste_sum / step as f64;
    sum.admissions_delayed = delayed.iter().filter(|d| **d).count();
    sum.alloc_seconds = alloc_time.as_secs_f64();
    sum.wall_seconds = start.elapsed().as_secs_f64();
    sum.kv_checksum = checksum;
    Ok(sum)
}

/// Admits a request and forks its samples, all or nothing. Returns false when it does
/// not fit now (nothing is left allocated).
fn admit_request(
    alloc: &mut dyn CacheAllocator,
    req: &Request,
    next_seq: &mut u64,
    slots: &mut Vec<Slot>,
    copies: &mut CopyPlan,
    running: &mut Vec<Running>,
    r: usize,
) -> pagedkv::Result<bool> {
    if !alloc.can_admit(req.prompt_len) {
        return Ok(false);
    }
    let first = SeqId(*next_seq);
    alloc.admit(first, req.prompt_len, slots)?;
    let mut seqs = vec![first];
    for _ in 1..req.samples {
        let child = SeqId(*next_seq + seqs.len() as u64);
        match alloc.fork(first, child, copies) {
            Ok(()) => seqs.push(child),
            Err(pagedkv::Error::OutOfBlocks { .. }) => {
                for s in seqs {
                    alloc.free(s)?;
                }
                copies.clear();
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
    }
    *next_seq += seqs.len() as u64;
    running.extend(seqs.into_iter().enumerate().map(|(sample, seq)| Running {
        seq,
        req: r,
        sample,
        generated: 0,
    }));
    Ok(true)
}

/// After a preemption, the pending batch's slots are recomputed from the surviving
/// sequences' tables (a freed block may have been handed out again).
fn rebuild_slots(
    batch: &mut WriteBatch,
    alloc: &dyn CacheAllocator,
    running: &[Running],
    trace: &[Request],
) -> pagedkv::Result<()> {
    let layout = *alloc.layout();
    batch.slots.clear();
    for &(req_id, sample, pos, _) in &batch.tokens {
        let s = running
            .iter()
            .find(|s| trace[s.req].id == req_id && s.sample == sample)
            .ok_or(pagedkv::Error::UnknownSequence(SeqId(req_id)))?;
        let (b, off) = layout.locate(alloc.block_table(s.seq)?, pos)?;
        batch.slots.push(layout.slot(b, off));
    }
    Ok(())
}

/// Checks a finished sequence's K/V (first and last layer) against the values it must
/// hold, then returns their FNV-1a hash, so the two runs can be compared as a whole.
fn sequence_checksum(
    store: &HostStorage,
    alloc: &dyn CacheAllocator,
    seq: SeqId,
    req: &Request,
    sample: usize,
) -> pagedkv::Result<u64> {
    let layout = *store.layout();
    let n = alloc.num_tokens(seq)?;
    let table = alloc.block_table(seq)?;
    let per_token =
        layout.shape().num_kv_heads * layout.shape().head_dim * layout.dtype().size_bytes();
    let (mut k, mut v) = (vec![0u8; n * per_token], vec![0u8; n * per_token]);
    let mut want = Vec::with_capacity(per_token);
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for layer in [0, layout.num_layers() - 1] {
        store.read_tokens(layer, table, n, &mut k, &mut v)?;
        for pos in 0..n {
            let w = token_word(req.id, sample, pos, req.prompt_len, layer);
            for (data, word) in [(&k, w), (&v, !w)] {
                want.clear();
                fill_words(&mut want, word, per_token);
                if data[pos * per_token..(pos + 1) * per_token] != want[..] {
                    return Err(pagedkv::Error::CorruptBlockTable(format!(
                        "request {} sample {sample}: token {pos} of layer {layer} holds the wrong K/V",
                        req.id
                    )));
                }
            }
        }
        fnv1a(&mut hash, &k);
        fnv1a(&mut hash, &v);
    }
    Ok(hash)
}

/// One line of the summary table: how to print a figure.
type Row = Box<dyn Fn(&Summary) -> String>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let config = match pagedkv::shape::builtin::by_name(&args.model) {
        Some(text) => ModelConfig::from_json_str(text)?,
        None => ModelConfig::from_file(&args.model)?,
    };
    let layout = KvLayout::new(config.shape, args.block_size)?;
    let arena_bytes = (args.arena_gib * (1u64 << 30) as f64) as usize;
    let num_blocks = layout.blocks_for_budget(arena_bytes);
    if args.max_len == 0 || layout.blocks_for_tokens(args.max_len) > num_blocks {
        return Err(format!(
            "max_len {} does not fit an arena of {num_blocks} blocks",
            args.max_len
        )
        .into());
    }
    let trace = make_trace(&args);
    let bar = if args.quiet || args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(trace.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>10} [{bar:40}] {pos}/{len} requests {elapsed}")?
            .progress_chars("=> "),
    );

    let cfg = CacheConfig {
        num_blocks,
        watermark_blocks: num_blocks / 100,
        max_seq_len_tokens: args.max_len,
        ..CacheConfig::new(0)
    };
    let mut paged = KvCacheManager::new(layout, cfg)?;
    let mut store = HostStorage::new(layout, num_blocks)?;
    bar.set_prefix("paged");
    let p = simulate(&mut paged, &mut store, &trace, &bar)?;
    paged
        .check_invariants()
        .map_err(|e| format!("invariant broken after the run: {e}"))?;

    let mut contiguous = ContiguousCache::new(layout, num_blocks, args.max_len)?;
    let mut store = HostStorage::new(layout, num_blocks)?;
    bar.set_prefix("contiguous");
    let c = simulate(&mut contiguous, &mut store, &trace, &bar)?;
    bar.finish_and_clear();

    if p.kv_checksum != c.kv_checksum {
        return Err("paged and contiguous runs left different K/V bytes".into());
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "paged": p.json(), "contiguous": c.json() })
        );
        return Ok(());
    }
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
    let rows: [(&str, Row); 13] = [
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
            "wall time",
            Box::new(|s| format!("{:.2} s", s.wall_seconds)),
        ),
    ];
    println!("{:<32} {:>14} {:>14}", "", "paged", "contiguous");
    for (name, f) in rows.iter() {
        println!("{:<32} {:>14} {:>14}", name, f(&p), f(&c));
    }
    println!(
        "\npaged holds {:.1}x the peak concurrent sequences of contiguous; K/V bytes of every sequence match (checksum {:016x}).",
        p.peak_concurrent_seqs as f64 / c.peak_concurrent_seqs.max(1) as f64,
        p.kv_checksum
    );
    Ok(())
}
