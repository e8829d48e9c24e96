//! `serve --hybrid`: a Gemma-3-like hybrid model (5 sliding-window layers of 1,024
//! tokens per global layer) served from one KV byte budget three ways, on the same
//! seeded long-context trace and the same continuous-batching scheduler:
//!
//! * **all full**: the same model with every layer full attention (one manager);
//! * **groups**: `KvCache::hybrid`, one arena of pages shared by a full group and five
//!   window groups of 8 layers each (vLLM's layout; window pages are given back as
//!   sequences advance and memory moves freely between groups);
//! * **split**: two managers (the 8 global layers, the 40 window layers) on the budget
//!   split in proportion to what the trace's mean request holds in each: the fixed
//!   ratio the groups replace.
//!
//! The trace is document-style traffic (log-normal prompts, median 3,000 tokens;
//! outputs median 400; contexts up to 16,384). Each step admits waiting requests in
//! order while the allocator can hold their prompt above a 1 % watermark, then decodes
//! one token for every running request; an append that finds no memory preempts the
//! newest running request, which is recomputed later from its prompt and the tokens it
//! had generated. Bookkeeping only: no K/V bytes are written here (the byte checks of
//! a shared arena are `tests/groups.rs`).
//!
//! ```text
//! cargo run --release --example serve -- --hybrid [--budget-gib 24] [--requests 300] [--arrival-rate 0.5] [--seed 7] [--json]
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

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

/// The hybrid model as KV-cache groups over one arena of pages.
pub struct Groups {
    /// The groups.
    pub kv: KvCache,
    step: GroupStep,
}

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

/// `serve --hybrid`: the three runs and their table (or JSON).
pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let budget = (flag(&args, "--budget-gib", 24.0f64) * (1u64 << 30) as f64) as u64;
    let requests = flag(&args, "--requests", 300usize);
    let seed = flag(&args, "--seed", 7u64);
    let rate = flag(&args, "--arrival-rate", 0.5f64);
    let json = args.iter().any(|a| a == "--json");
    let trace = trace(requests, seed, rate);
    let share = Split::share_for(&trace);
    let mut runs: Vec<(&str, Outcome)> = Vec::new();
    runs.push(("all_full", serve(&mut AllFull::new(budget)?, &trace)?));
    let mut groups = Groups::new(budget)?;
    let g = serve(&mut groups, &trace)?;
    groups.kv.check_invariants()?;
    let moves = groups.kv.group_stats().page_moves;
    runs.push(("groups", g));
    runs.push(("split", serve(&mut Split::new(budget, share)?, &trace)?));
    let mib = |b: f64| b / (1u64 << 20) as f64;
    if json {
        let obj: serde_json::Map<String, serde_json::Value> = runs
            .iter()
            .map(|(name, o)| {
                (
                    name.to_string(),
                    serde_json::json!({
                        "peak_running": o.peak_running,
                        "mean_running": o.mean_running,
                        "peak_kv_bytes": o.peak_bytes,
                        "kv_bytes_per_running_request": o.bytes_per_running,
                        "steps": o.steps,
                        "finished": o.finished,
                        "preemptions": o.preemptions,
                        "alloc_seconds": o.alloc_time.as_secs_f64(),
                    }),
                )
            })
            .collect();
        let mut obj = obj;
        obj.insert("budget_bytes".into(), budget.into());
        obj.insert("requests".into(), requests.into());
        obj.insert("split_global_share".into(), share.into());
        obj.insert("groups_page_moves".into(), moves.into());
        println!("{}", serde_json::Value::Object(obj));
    } else {
        println!(
            "Gemma-3-like hybrid: {LAYERS} layers ({} window {WINDOW}, {} global), 8 KV heads \
             x 256, bf16, block {BLOCK}; {requests} requests (seed {seed}); budget {:.0} GiB",
            LAYERS - LAYERS / GLOBAL_EVERY,
            LAYERS / GLOBAL_EVERY,
            budget as f64 / (1u64 << 30) as f64
        );
        println!(
            "{:<34}{:>14}{:>14}{:>14}",
            "", "all full", "groups", "split"
        );
        let row = |label: &str, f: &dyn Fn(&Outcome) -> String| {
            print!("{label:<34}");
            for (_, o) in &runs {
                print!("{:>14}", f(o));
            }
            println!();
        };
        row("peak concurrent requests", &|o| o.peak_running.to_string());
        row("mean concurrent requests", &|o| {
            format!("{:.1}", o.mean_running)
        });
        row("peak KV MiB held", &|o| {
            format!("{:.0}", mib(o.peak_bytes as f64))
        });
        row("mean KV MiB per running request", &|o| {
            format!("{:.0}", mib(o.bytes_per_running))
        });
        row("decode steps to serve the trace", &|o| o.steps.to_string());
        row("preemptions (recompute)", &|o| o.preemptions.to_string());
        row("time in allocator calls", &|o| {
            format!("{:.1} ms", o.alloc_time.as_secs_f64() * 1e3)
        });
        println!(
            "split: global layers get {:.1} % of the budget; groups moved {moves} pages \
             between groups",
            share * 100.0
        );
    }
    for (name, o) in &runs {
        if o.finished != requests {
            return Err(format!("{name}: {} of {requests} finished", o.finished).into());
        }
    }
    Ok(())
}
