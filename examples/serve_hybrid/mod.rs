//! `serve --hybrid`: a hybrid model served from one KV byte budget on a seeded
//! long-context trace and one continuous-batching scheduler, its KV-cache groups
//! writing and checking real bytes.
//!
//! **Models** (`--model`): `gemma-3` (default), Gemma-3-like, 5 sliding-window layers
//! of 1,024 tokens per global layer, 48 layers of 8 KV heads x 256; `nemotron-h`,
//! Nemotron-H-8B from `tests/data/nemotron-h-8b.json`: 4 attention layers (a full
//! group) and 24 Mamba-2 layers (a recurrent-state group of the planner's state bytes,
//! 390 pages of 256 KiB per sequence).
//!
//! **The comparison at the budget** (`--budget-gib`, 24): for `gemma-3`, three ways:
//!
//! * **all full**: the same model with every layer full attention (one manager);
//! * **groups**: `KvCache::hybrid`, one arena of pages shared by a full group and five
//!   window groups of 8 layers each (vLLM's layout; window pages are given back as
//!   sequences advance and memory moves freely between groups);
//! * **split**: two managers (the 8 global layers, the 40 window layers) on the budget
//!   split in proportion to what the trace's mean request holds in each: the fixed
//!   ratio the groups replace.
//!
//! All full and split are bookkeeping only; the groups run writes and checks every
//! byte (below). `nemotron-h` has the groups run only (no all-full or split
//! equivalent of a state model).
//!
//! **Under memory pressure** (`--pressure-budget-gib`, 8; `--host-gib`, 16;
//! `--pressure-watermark-pct`, 0), two groups runs, both with bytes: recompute
//! preemption without prefix caching, and prefix caching with swap preemption (the
//! newest running request goes to the host tier with `swap_out_grouped` and comes back
//! with `swap_in_grouped` before anything new is admitted; recompute only when the
//! tier is full). With a state group, a prompt is computed in chunks ending at the end
//! of its shared prefix and at its last full block, each followed by
//! `checkpoint_grouped`, and a sequence's last block boundary before it finishes is
//! checkpointed too, so follow-up turns and system prompts resume from a checkpoint.
//!
//! **The trace** is document-style traffic (log-normal prompts, median 3,000 tokens;
//! outputs median 400; contexts up to 16,384), with token ids: 40 % of requests start
//! with one of four system prompts (512 to 4,096 tokens, `--system-prompt-share`), 20 %
//! continue an earlier conversation, their prompt starting with its whole history
//! (`--multi-turn-share`); the lengths are the same either way. Each step admits
//! waiting requests in order while the arena can hold their prompt above the
//! watermark, then decodes one token for every running request
//! (`reserve_step_grouped`, or `reserve_step_tokens_grouped` with prefix caching); a
//! step that finds no memory preempts the newest running request.
//!
//! **Bytes** (`bytes.rs`): K and V of every slot a call hands out are written from
//! (token id, position, layer); a state group's pages are rewritten at every step from
//! a rolling hash of the token history, read back from the pages as a recurrent
//! kernel reads its state. Checked against a recomputation from the token ids: every
//! step, each row's new token in every KV group and its whole state, read through the
//! row's table of the step's buffers; every 8 steps one row's whole readable context
//! (a window group's: its window); each sequence in full after a prefix hit, a
//! swap-in and before its free. A mismatch fails the run; the table prints the bytes
//! checked and their checksum. The storage holds the arena's pages with 1 KV head of
//! 4 (Gemma) or 2 (Nemotron) bf16 elements per layer instead of the model's heads:
//! 48 MiB at the default budgets, host tier included. `--corrupt-at STEP` flips one
//! byte of the first row's new K (`--corrupt-state`: its state) after the writes of
//! that step, and the run must fail.
//!
//! ```text
//! cargo run --release --example serve -- --hybrid [--model gemma-3|nemotron-h] [--budget-gib 24]
//!     [--pressure-budget-gib 8] [--host-gib 16] [--requests 300] [--arrival-rate 0.5] [--seed 7] [--json]
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

mod bytes;

use bytes::{ByteOutcome, Model, Policy};
use pagedkv::attention::model::SplitMix64;
use pagedkv::{CopyPlan, DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape, SeqId};

/// Layers of the model, one global per `GLOBAL_EVERY`.
pub const LAYERS: usize = 48;
/// 5 local : 1 global.
pub const GLOBAL_EVERY: usize = 6;
/// Sliding window of the local layers, tokens.
pub const WINDOW: usize = 1024;
/// Tokens per block.
pub const BLOCK: usize = 16;
/// Longest context of the trace.
pub const MAX_LEN: usize = 16_384;

/// Gemma-3-12B's KV shape (8 KV heads of 256, bf16) with `layers` layers.
pub fn shape(layers: usize) -> ModelShape {
    ModelShape {
        num_layers: layers,
        num_q_heads: 16,
        num_kv_heads: 8,
        head_dim: 256,
        kv_dtype: DType::BF16,
    }
}

/// One request: arrival step, prompt tokens, output tokens.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    /// Step at which it arrives.
    pub arrival: u64,
    /// Prompt tokens.
    pub prompt: usize,
    /// Tokens to generate.
    pub output: usize,
}

/// The seeded long-context trace.
pub fn trace(requests: usize, seed: u64, arrivals_per_step: f64) -> Vec<Request> {
    let mut rng = SplitMix64::new(seed);
    let mut unit = move || (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let lognormal = |median: f64, sigma: f64, unit: &mut dyn FnMut() -> f64| {
        let (u1, u2) = (unit().max(1e-12), unit());
        let normal = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        median * (sigma * normal).exp()
    };
    let mut step = 0.0;
    (0..requests)
        .map(|_| {
            step += -unit().max(1e-12).ln() / arrivals_per_step;
            let prompt = (lognormal(3000.0, 0.8, &mut unit) as usize).clamp(64, MAX_LEN * 3 / 4);
            let output = (lognormal(400.0, 0.7, &mut unit) as usize).clamp(8, MAX_LEN - prompt);
            Request {
                arrival: step as u64,
                prompt,
                output,
            }
        })
        .collect()
}

/// What the scheduler needs from a KV allocator.
pub trait Alloc {
    /// Whether a prompt of `tokens` fits now above the watermark.
    fn can_admit(&self, tokens: usize) -> bool;
    /// Admits `id` with `tokens` prompt tokens (all groups at once).
    fn admit(&mut self, id: SeqId, tokens: usize) -> pagedkv::Result<()>;
    /// Appends one decoded token; fails with nothing changed when memory is short.
    fn append(&mut self, id: SeqId) -> pagedkv::Result<()>;
    /// Frees `id`.
    fn free(&mut self, id: SeqId) -> pagedkv::Result<()>;
    /// KV bytes held by sequences now.
    fn used_bytes(&self) -> u64;
}

/// Every layer full: one manager.
pub struct AllFull {
    kv: KvCache,
    slots: Vec<pagedkv::layout::Slot>,
    copies: CopyPlan,
}

impl AllFull {
    /// The whole model in one layout on `budget` bytes.
    pub fn new(budget: u64) -> pagedkv::Result<Self> {
        let l = KvLayout::new(shape(LAYERS), BLOCK)?;
        let blocks = (budget / l.block_bytes() as u64) as usize;
        let kv = KvCache::builder(l)
            .num_blocks(blocks)
            .watermark_blocks(blocks / 100)
            .build()?;
        Ok(AllFull {
            kv,
            slots: Vec::new(),
            copies: CopyPlan::new(),
        })
    }
}

impl Alloc for AllFull {
    fn can_admit(&self, tokens: usize) -> bool {
        self.kv.can_admit(tokens)
    }
    fn admit(&mut self, id: SeqId, tokens: usize) -> pagedkv::Result<()> {
        self.kv.admit(id, tokens, &mut self.slots)
    }
    fn append(&mut self, id: SeqId) -> pagedkv::Result<()> {
        self.kv.append(id, 1, &mut self.slots, &mut self.copies)
    }
    fn free(&mut self, id: SeqId) -> pagedkv::Result<()> {
        self.kv.free(id)
    }
    fn used_bytes(&self) -> u64 {
        (self.kv.stats().used_blocks * self.kv.layout().block_bytes()) as u64
    }
}

/// The hybrid model as KV-cache groups over one arena of pages (bookkeeping only:
/// `examples/hybrid.rs`; `serve --hybrid` runs the groups with bytes, `bytes.rs`).
#[allow(dead_code)] // not used by `serve --hybrid`
pub struct Groups {
    /// The groups.
    pub kv: KvCache,
    step: GroupStep,
}

#[allow(dead_code)] // not used by `serve --hybrid`
impl Groups {
    /// One full group and `LAYERS / GLOBAL_EVERY - 1` window groups, 8 layers each,
    /// on `budget` bytes.
    pub fn new(budget: u64) -> pagedkv::Result<Self> {
        let per_group = LAYERS / GLOBAL_EVERY;
        let l = KvLayout::new(shape(per_group), BLOCK)?;
        let mut specs = vec![GroupSpec::full(l)];
        specs.extend((1..GLOBAL_EVERY).map(|_| GroupSpec::window(l, WINDOW)));
        let pages = (budget / l.block_bytes() as u64) as usize;
        let kv = KvCache::hybrid(&specs, pages)?.with_watermark_blocks(pages / 100)?;
        Ok(Groups {
            kv,
            step: GroupStep::default(),
        })
    }
}

impl Alloc for Groups {
    fn can_admit(&self, tokens: usize) -> bool {
        self.kv.can_admit(tokens)
    }
    fn admit(&mut self, id: SeqId, tokens: usize) -> pagedkv::Result<()> {
        self.kv.admit_grouped(id, tokens, &mut self.step)
    }
    fn append(&mut self, id: SeqId) -> pagedkv::Result<()> {
        self.kv.append_grouped(id, 1, &mut self.step)
    }
    fn free(&mut self, id: SeqId) -> pagedkv::Result<()> {
        self.kv.free(id)
    }
    fn used_bytes(&self) -> u64 {
        (self.kv.stats().used_blocks * self.kv.block_bytes()) as u64
    }
}

/// The hybrid model as two managers on a fixed split of the budget.
pub struct Split {
    global: KvCache,
    local: KvCache,
    slots: Vec<pagedkv::layout::Slot>,
    copies: CopyPlan,
}

impl Split {
    /// The global layers get `global_share` of `budget`, the window layers the rest.
    pub fn new(budget: u64, global_share: f64) -> pagedkv::Result<Self> {
        let global = LAYERS / GLOBAL_EVERY;
        let gl = KvLayout::new(shape(global), BLOCK)?;
        let lo = KvLayout::new(shape(LAYERS - global), BLOCK)?;
        let g_bytes = (budget as f64 * global_share) as u64;
        let gb = (g_bytes / gl.block_bytes() as u64) as usize;
        let lb = ((budget - g_bytes) / lo.block_bytes() as u64) as usize;
        Ok(Split {
            global: KvCache::builder(gl)
                .num_blocks(gb)
                .watermark_blocks(gb / 100)
                .build()?,
            local: KvCache::builder(lo)
                .num_blocks(lb)
                .watermark_blocks(lb / 100)
                .sliding_window(WINDOW)
                .build()?,
            slots: Vec::new(),
            copies: CopyPlan::new(),
        })
    }

    /// The global layers' share of the budget by what the trace's requests hold on
    /// average at their end in each part.
    pub fn share_for(trace: &[Request]) -> f64 {
        let (mut g, mut l) = (0.0, 0.0);
        for r in trace {
            let ctx = r.prompt + r.output;
            g += (LAYERS / GLOBAL_EVERY) as f64 * ctx.div_ceil(BLOCK) as f64;
            let held = ctx.min(WINDOW + BLOCK).div_ceil(BLOCK);
            l += (LAYERS - LAYERS / GLOBAL_EVERY) as f64 * held as f64;
        }
        g / (g + l)
    }
}

impl Alloc for Split {
    fn can_admit(&self, tokens: usize) -> bool {
        self.global.can_admit(tokens) && self.local.can_admit(tokens)
    }
    fn admit(&mut self, id: SeqId, tokens: usize) -> pagedkv::Result<()> {
        // Both or neither: check both first (can_admit without the watermark).
        for kv in [&self.global, &self.local] {
            let needed = kv.layout().blocks_for_tokens(tokens);
            if needed > kv.num_available_blocks() {
                return Err(pagedkv::Error::OutOfBlocks {
                    needed,
                    free: kv.num_available_blocks(),
                });
            }
        }
        self.global.admit(id, tokens, &mut self.slots)?;
        self.local.admit(id, tokens, &mut self.slots)
    }
    fn append(&mut self, id: SeqId) -> pagedkv::Result<()> {
        for kv in [&self.global, &self.local] {
            let needed = kv.blocks_needed(id, 1, 0)?;
            if needed > kv.num_available_blocks() {
                return Err(pagedkv::Error::OutOfBlocks {
                    needed,
                    free: kv.num_available_blocks(),
                });
            }
        }
        self.global
            .append(id, 1, &mut self.slots, &mut self.copies)?;
        self.local.append(id, 1, &mut self.slots, &mut self.copies)
    }
    fn free(&mut self, id: SeqId) -> pagedkv::Result<()> {
        self.global.free(id)?;
        self.local.free(id)
    }
    fn used_bytes(&self) -> u64 {
        (self.global.stats().used_blocks * self.global.layout().block_bytes()
            + self.local.stats().used_blocks * self.local.layout().block_bytes()) as u64
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Highest number of requests running at once.
    pub peak_running: usize,
    /// Mean running requests over the steps.
    pub mean_running: f64,
    /// Highest KV bytes held.
    pub peak_bytes: u64,
    /// Mean KV bytes held per running request (over steps with one running).
    pub bytes_per_running: f64,
    /// Decode steps until the last request finished.
    pub steps: u64,
    /// Requests finished.
    pub finished: usize,
    /// Preemptions (recompute).
    pub preemptions: usize,
    /// Time spent in allocator calls.
    pub alloc_time: Duration,
}

/// Serves `trace` on `alloc`. Errors other than running out of memory are returned.
pub fn serve(
    alloc: &mut dyn Alloc,
    trace: &[Request],
) -> Result<Outcome, Box<dyn std::error::Error>> {
    struct Running {
        id: SeqId,
        req: usize,
        done: usize,
    }
    let mut out = Outcome::default();
    let mut waiting: VecDeque<(usize, usize)> = VecDeque::new(); // (request, generated)
    let mut running: Vec<Running> = Vec::new();
    let (mut next_arrival, mut next_id, mut step) = (0usize, 0u64, 0u64);
    let (mut sum_running, mut sum_bytes, mut busy_steps) = (0u64, 0f64, 0u64);
    while out.finished < trace.len() {
        while next_arrival < trace.len() && trace[next_arrival].arrival <= step {
            waiting.push_back((next_arrival, 0));
            next_arrival += 1;
        }
        // Admit in order (a recomputed request re-prefills what it had generated).
        while let Some(&(r, done)) = waiting.front() {
            let tokens = trace[r].prompt + done;
            let t = Instant::now();
            let fits = alloc.can_admit(tokens);
            if !fits {
                out.alloc_time += t.elapsed();
                break;
            }
            let id = SeqId(next_id);
            next_id += 1;
            alloc.admit(id, tokens)?;
            out.alloc_time += t.elapsed();
            waiting.pop_front();
            running.push(Running { id, req: r, done });
        }
        if let (true, Some(&(r, _))) = (running.is_empty(), waiting.front()) {
            return Err(format!("request {r} does not fit the empty budget").into());
        }
        // Decode one token each; an append that finds no memory preempts the newest.
        let mut i = 0;
        while i < running.len() {
            let t = Instant::now();
            let r = alloc.append(running[i].id);
            out.alloc_time += t.elapsed();
            match r {
                Ok(()) => {
                    running[i].done += 1;
                    i += 1;
                }
                Err(pagedkv::Error::OutOfBlocks { .. }) => {
                    let victim = running.len() - 1;
                    let v = running.swap_remove(victim);
                    alloc.free(v.id)?;
                    waiting.push_front((v.req, v.done));
                    out.preemptions += 1;
                    // Retry `i` unless it was the victim.
                }
                Err(e) => return Err(e.into()),
            }
        }
        sum_running += running.len() as u64;
        out.peak_running = out.peak_running.max(running.len());
        let bytes = alloc.used_bytes();
        out.peak_bytes = out.peak_bytes.max(bytes);
        if !running.is_empty() {
            sum_bytes += bytes as f64 / running.len() as f64;
            busy_steps += 1;
        }
        let mut k = 0;
        while k < running.len() {
            if running[k].done >= trace[running[k].req].output {
                let f = running.swap_remove(k);
                alloc.free(f.id)?;
                out.finished += 1;
            } else {
                k += 1;
            }
        }
        step += 1;
    }
    out.steps = step;
    out.mean_running = sum_running as f64 / step.max(1) as f64;
    out.bytes_per_running = sum_bytes / busy_steps.max(1) as f64;
    Ok(out)
}

fn flag<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One column of a table: a name, the scheduler's figures, and what a byte run
/// measured besides.
type Run = (String, Outcome, Option<ByteOutcome>);

/// Prints `runs` as a table of figures per run.
fn print_table(runs: &[Run]) {
    let mib = |b: f64| b / (1u64 << 20) as f64;
    print!("{:<34}", "");
    for (name, _, _) in runs {
        print!("{name:>18}");
    }
    println!();
    let row = |label: &str, f: &dyn Fn(&Outcome, Option<&ByteOutcome>) -> String| {
        print!("{label:<34}");
        for (_, o, b) in runs {
            print!("{:>18}", f(o, b.as_ref()));
        }
        println!();
    };
    let brow = |label: &str, f: &dyn Fn(&ByteOutcome) -> String| {
        row(label, &|_, b| b.map_or("-".to_string(), f))
    };
    row("peak concurrent requests", &|o, _| {
        o.peak_running.to_string()
    });
    row("mean concurrent requests", &|o, _| {
        format!("{:.1}", o.mean_running)
    });
    row("peak KV MiB held", &|o, _| {
        format!("{:.0}", mib(o.peak_bytes as f64))
    });
    row("mean KV MiB per running request", &|o, _| {
        format!("{:.0}", mib(o.bytes_per_running))
    });
    row("decode steps to serve the trace", &|o, _| {
        o.steps.to_string()
    });
    row("preemptions", &|o, _| o.preemptions.to_string());
    brow("  of which swapped out (back in)", &|b| {
        format!("{} ({})", b.swap_outs, b.swap_ins)
    });
    brow("prefix-cache hit rate (tokens)", &|b| {
        format!(
            "{:.1} %",
            100.0 * b.hit_tokens as f64 / b.prompt_tokens.max(1) as f64
        )
    });
    brow("state checkpoints", &|b| b.checkpoints.to_string());
    brow("MiB written (K/V and state)", &|b| {
        format!("{:.0}", mib(b.bytes_written as f64))
    });
    brow("MiB read back and checked", &|b| {
        format!("{:.0}", mib(b.bytes_checked as f64))
    });
    brow("checksum of the bytes checked", &|b| {
        format!("{:016x}", b.checksum)
    });
    row("time in allocator calls", &|o, _| {
        format!("{:.1} ms", o.alloc_time.as_secs_f64() * 1e3)
    });
    brow("wall time of the run", &|b| {
        format!("{:.1} s", b.wall.as_secs_f64())
    });
}

fn run_json(o: &Outcome, b: Option<&ByteOutcome>) -> serde_json::Value {
    let mut v = serde_json::json!({
        "peak_running": o.peak_running,
        "mean_running": o.mean_running,
        "peak_kv_bytes": o.peak_bytes,
        "kv_bytes_per_running_request": o.bytes_per_running,
        "steps": o.steps,
        "finished": o.finished,
        "preemptions": o.preemptions,
        "alloc_seconds": o.alloc_time.as_secs_f64(),
        "writes_bytes": b.is_some(),
    });
    if let (Some(b), Some(obj)) = (b, v.as_object_mut()) {
        let extra = serde_json::json!({
            "swap_outs": b.swap_outs,
            "swap_ins": b.swap_ins,
            "prompt_tokens": b.prompt_tokens,
            "prefix_hit_tokens": b.hit_tokens,
            "state_checkpoints": b.checkpoints,
            "bytes_written": b.bytes_written,
            "bytes_checked": b.bytes_checked,
            "checksum": format!("{:016x}", b.checksum),
            "storage_bytes": b.storage_bytes,
            "wall_seconds": b.wall.as_secs_f64(),
        });
        if let Some(extra) = extra.as_object() {
            obj.extend(extra.clone());
        }
    }
    v
}

/// `serve --hybrid`: the runs and their tables (or JSON).
pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let gib = (1u64 << 30) as f64;
    let budget = (flag(&args, "--budget-gib", 24.0f64) * gib) as u64;
    let pressure = (flag(&args, "--pressure-budget-gib", 8.0f64) * gib) as u64;
    let host = (flag(&args, "--host-gib", 16.0f64) * gib) as u64;
    let requests = flag(&args, "--requests", 300usize);
    let seed = flag(&args, "--seed", 7u64);
    let rate = flag(&args, "--arrival-rate", 0.5f64);
    let system_share = flag(&args, "--system-prompt-share", 0.4f64);
    let follow_up_share = flag(&args, "--multi-turn-share", 0.2f64);
    let model_name = flag(&args, "--model", "gemma-3".to_string());
    let json = args.iter().any(|a| a == "--json");
    let model = match model_name.as_str() {
        "gemma-3" => Model::gemma3()?,
        "nemotron-h" => Model::nemotron_h()?,
        other => return Err(format!("--model {other}: gemma-3 or nemotron-h").into()),
    };
    let recompute = Policy {
        prefix: false,
        host_blocks: 0,
        watermark_per_10k: 100,
        corrupt_at: args
            .iter()
            .position(|a| a == "--corrupt-at")
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok()),
        corrupt_state: args.iter().any(|a| a == "--corrupt-state"),
    };
    let prefix_swap = Policy {
        prefix: true,
        host_blocks: (host / model.page_bytes()) as usize,
        watermark_per_10k: (flag(&args, "--pressure-watermark-pct", 0.0f64) * 100.0) as usize,
        ..recompute
    };
    let trace = trace(requests, seed, rate);
    let hist = bytes::histories(&trace, seed, system_share, follow_up_share);
    let with_bytes = |budget: u64, policy: Policy| -> Result<Run, Box<dyn std::error::Error>> {
        let b = bytes::serve_bytes(&model, budget, policy, &trace, &hist)?;
        let name = if policy.prefix {
            "prefix+swap"
        } else {
            "groups"
        };
        Ok((name.to_string(), b.outcome.clone(), Some(b)))
    };
    // The comparison at the budget: every layer full and the fixed split are
    // bookkeeping only (Gemma-3-like model; a state model has no such baselines).
    let mut main_runs: Vec<Run> = Vec::new();
    let share = Split::share_for(&trace);
    let gemma = model.name == "gemma-3";
    if gemma {
        let o = serve(&mut AllFull::new(budget)?, &trace)?;
        main_runs.push(("all full".into(), o, None));
    }
    main_runs.push(with_bytes(budget, recompute)?);
    if gemma {
        let o = serve(&mut Split::new(budget, share)?, &trace)?;
        main_runs.push(("split".into(), o, None));
    }
    // Under memory pressure, both with bytes: recompute without prefix caching, and
    // prefix caching with swap to the host tier.
    let pressure_runs: Vec<Run> = vec![
        with_bytes(
            pressure,
            Policy {
                watermark_per_10k: prefix_swap.watermark_per_10k,
                ..recompute
            },
        )?,
        with_bytes(pressure, prefix_swap)?,
    ];
    let storage_mib = |runs: &[Run]| {
        runs.iter()
            .filter_map(|(_, _, b)| b.as_ref())
            .map(|b| b.storage_bytes)
            .max()
            .unwrap_or(0) as f64
            / (1u64 << 20) as f64
    };
    if json {
        let mut obj = serde_json::Map::new();
        obj.insert("model".into(), model.name.clone().into());
        for (name, o, b) in &main_runs {
            obj.insert(name.replace(' ', "_"), run_json(o, b.as_ref()));
        }
        let mut p = serde_json::Map::new();
        for (name, o, b) in &pressure_runs {
            p.insert(name.replace('+', "_"), run_json(o, b.as_ref()));
        }
        obj.insert("pressure".into(), p.into());
        obj.insert("budget_bytes".into(), budget.into());
        obj.insert("pressure_budget_bytes".into(), pressure.into());
        obj.insert("host_tier_bytes".into(), host.into());
        obj.insert("requests".into(), requests.into());
        if gemma {
            obj.insert("split_global_share".into(), share.into());
        }
        println!("{}", serde_json::Value::Object(obj));
    } else {
        println!(
            "{}, block {BLOCK}; {requests} requests (seed {seed}; {:.0} % start with a \
             system prompt, {:.0} % continue an earlier conversation)",
            model.about,
            system_share * 100.0,
            follow_up_share * 100.0
        );
        println!(
            "\nbudget {:.0} GiB; groups writes and checks every K/V and state byte{}:",
            budget as f64 / gib,
            if gemma {
                " (all full and split: bookkeeping only)"
            } else {
                ""
            }
        );
        print_table(&main_runs);
        if gemma {
            println!(
                "split: global layers get {:.1} % of the budget",
                share * 100.0
            );
        }
        println!(
            "\nbudget {:.0} GiB, watermark {:.1} %, host tier {:.0} GiB; both write and check \
             every byte (recompute without prefix caching; prefix caching with swap \
             preemption):",
            pressure as f64 / gib,
            prefix_swap.watermark_per_10k as f64 / 100.0,
            host as f64 / gib
        );
        print_table(&pressure_runs);
        println!(
            "\nbytes: the storage holds the same pages with 1 KV head of {} bf16 elements per \
             layer ({:.0} MiB at most, host tier included), not the model's heads",
            model.byte_layout.block_bytes_per_layer() / BLOCK / 4,
            storage_mib(&main_runs).max(storage_mib(&pressure_runs))
        );
    }
    for (name, o, _) in main_runs.iter().chain(&pressure_runs) {
        if o.finished != requests {
            return Err(format!("{name}: {} of {requests} finished", o.finished).into());
        }
    }
    Ok(())
}
