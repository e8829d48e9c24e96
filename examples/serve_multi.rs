//! Several models, one memory budget: the serve simulation for `serve --models 3`.
//!
//! Three models of different shapes and block sizes (a chat model, an embedding model
//! and a reranker; 64, 128 and 192 KiB blocks) share one host-memory budget through
//! `pagedkv::broker::Broker`, under a load that shifts between them: each is the busy
//! one for a phase of the trace while the other two see light traffic. The same trace
//! runs under three allocations:
//!
//! * **broker**: each model starts at its floor and takes memory as it needs it (free
//!   budget, then other models' idle blocks, then their prefix caches);
//! * **static equal**: the budget split in three, fixed;
//! * **static hindsight**: the fixed split with the best total throughput, found by a
//!   sweep over splits on this very trace (a split no real server could know ahead).
//!
//! Every model also runs **alone** with the whole budget, and each run's checksum of
//! the generated tokens and of every finished sequence's K/V (layer 0 of every token,
//! written through the slot mapping at prefill and decode and read back when the
//! request finishes) must equal the alone run's: the moves (shrinks copy blocks),
//! preemptions and recomputes change nothing a request sees.
//!
//! A separate example rather than a mode of `examples/serve.rs`: that file is one
//! model's simulation with its own scheduler state threaded through ~1400 lines, and
//! the broker needs a scheduler per model. This one shares no private code with it.
//! The models are stepped in lockstep on one thread so the table is reproducible; the
//! broker's thread safety is tested in `tests/memory/broker.rs`.
//!
//! With `--shared-prefix-tokens N`, every request starts with one of a few system
//! prompts of its model and is admitted with token ids, so the prefix cache serves
//! them; with `--sleep-idle-steps N`, two more broker runs put a model idle for N steps
//! to sleep (evicting its prefix cache, or spilling it to the host tier) and wake it
//! when a request arrives. A model with no sequence for `--cold-cache-steps` steps
//! (default 20) has a cold prefix cache, which the others take whatever its priority;
//! `--cache-protected-by-priority` runs the older rule (a cache is protected like
//! running work) for comparison.
//!
//! ```text
//! cargo run --release --example serve_multi -- --models 3
//! cargo run --release --example serve_multi -- --models 3 --json
//! cargo run --release --example serve_multi -- --models 3 --svg broker.svg
//! cargo run --release --example serve_multi -- --models 3 --shared-prefix-tokens 64 --sleep-idle-steps 20
//! ```

use std::collections::VecDeque;

use clap::Parser;
use pagedkv::broker::{Broker, BrokerConfig, ModelId, ModelLimits, MoveReason, SleepOptions};
use pagedkv::{
    AdmitOptions, CopyPlan, DType, HostStorage, KvCache, KvLayout, ModelShape, SeqId, Storage,
    TierConfig,
};

#[derive(Parser, Debug, Clone)]
#[command(about = "Several models sharing one KV memory budget: broker vs static splits")]
struct Args {
    /// Models sharing the budget (2 or 3).
    #[arg(long, default_value_t = 3)]
    models: usize,
    /// Budget, MiB.
    #[arg(long, default_value_t = 48)]
    budget_mib: usize,
    /// Chunk (the unit of every move), MiB.
    #[arg(long, default_value_t = 1)]
    chunk_mib: usize,
    /// Steps of each phase (one busy model per phase).
    #[arg(long, default_value_t = 300)]
    phase_steps: u64,
    /// Requests per step of the busy model.
    #[arg(long, default_value_t = 0.7)]
    busy_rate: f64,
    /// Requests per step of a quiet model.
    #[arg(long, default_value_t = 0.06)]
    quiet_rate: f64,
    /// Granularity of the hindsight sweep, in chunks.
    #[arg(long, default_value_t = 4)]
    sweep_chunks: usize,
    /// Trace seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Print the JSON summary instead of the table.
    #[arg(long)]
    json: bool,
    /// Write the broker run's moves as an SVG.
    #[arg(long)]
    svg: Option<String>,
    /// Tokens of a system prompt that starts every request (one of `--prefixes` per
    /// model); 0: no shared prompts and no prefix cache (the default table).
    #[arg(long, default_value_t = 0)]
    shared_prefix_tokens: usize,
    /// System prompts per model.
    #[arg(long, default_value_t = 4)]
    prefixes: u64,
    /// When above 0, two more broker runs put a model with nothing to do for this many
    /// steps to sleep (one evicting its prefix cache, one spilling it to the host tier)
    /// and wake it when a request arrives.
    #[arg(long, default_value_t = 0)]
    sleep_idle_steps: u64,
    /// Host tier of each model (swap space, spilled prefixes), MiB.
    #[arg(long, default_value_t = 16)]
    host_mib: usize,
    /// Steps without a sequence after which a model's prefix cache is cold: taken by a
    /// model under pressure whatever the holder's priority (`BrokerConfig::cold_cache_steps`).
    #[arg(long, default_value_t = BrokerConfig::DEFAULT_COLD_CACHE_STEPS)]
    cold_cache_steps: u64,
    /// The older rule, for comparison: a model's cache is protected by its priority
    /// however long it has been idle (`cold_cache_steps: None`).
    #[arg(long)]
    cache_protected_by_priority: bool,
}

/// When a model is put to sleep in a broker run.
#[derive(Debug, Clone, Copy)]
struct SleepPolicy {
    idle_steps: u64,
    spill: bool,
}

/// Where K/V bytes and token ids come from: the shared system prompt (the same for
/// every request that has it) or the request itself.
#[derive(Debug, Clone, Copy)]
struct Content {
    shared_tokens: usize,
    prefixes: u64,
}

impl Content {
    /// The system prompt request `req` of `model` starts with.
    fn prefix_of(&self, model: usize, req: usize) -> u64 {
        mix(((model as u64) << 40) ^ req as u64) % self.prefixes.max(1)
    }

    /// Leading tokens of the request that are its system prompt.
    fn shared_len(&self, req: &Request) -> usize {
        self.shared_tokens.min(req.prompt)
    }

    /// The key of position `pos` of request `req`'s K/V: the request, or its system
    /// prompt within the shared part (so a block shared through the prefix cache holds
    /// the same bytes whoever computed it). Without shared prompts, the request.
    fn key(&self, model: usize, req: usize, r: &Request, pos: usize) -> u64 {
        if pos < self.shared_len(r) {
            mix((1 << 62) ^ self.prefix_of(model, req))
        } else {
            req as u64
        }
    }

    /// The token id at `pos` of request `req` admitted with `generated` tokens so far:
    /// system prompt ids, then ids unique to the request, then the generated tokens.
    fn token_id(&self, model: usize, req: usize, r: &Request, pos: usize) -> u32 {
        if pos < self.shared_len(r) {
            (mix(((model as u64) << 40) ^ (self.prefix_of(model, req) << 20) ^ pos as u64)
                % 100_000) as u32
        } else if pos < r.prompt {
            100_000 + (req * 2048 + pos) as u32
        } else {
            generated_token(model, req, pos - r.prompt) as u32
        }
    }
}

/// Most requests a model runs at once.
const MAX_BATCH: usize = 256;

struct Spec {
    name: &'static str,
    layout: KvLayout,
    priority: i32,
    prompt_median: f64,
    output_median: f64,
    /// Longest request (prompt + output), tokens.
    max_len: usize,
}

fn specs(n: usize) -> Vec<Spec> {
    let shape = |layers, heads, dim, dtype| ModelShape {
        num_layers: layers,
        num_q_heads: heads * 4,
        num_kv_heads: heads,
        head_dim: dim,
        kv_dtype: dtype,
    };
    let all = vec![
        // 8 layers x 2 KV heads x 64, f16, 16 tokens: 64 KiB blocks, 16 per MiB.
        Spec {
            name: "chat",
            layout: KvLayout::new(shape(8, 2, 64, DType::F16), 16).expect("layout"),
            priority: 2,
            prompt_median: 160.0,
            output_median: 64.0,
            max_len: 1024,
        },
        // 4 layers x 4 KV heads x 64, f16, 32 tokens: 128 KiB blocks, 8 per MiB.
        Spec {
            name: "embed",
            layout: KvLayout::new(shape(4, 4, 64, DType::F16), 32).expect("layout"),
            priority: 0,
            prompt_median: 256.0,
            output_median: 24.0,
            max_len: 1024,
        },
        // 12 layers x 1 KV head x 128, f32, 16 tokens: 192 KiB blocks, 5 per MiB.
        Spec {
            name: "rerank",
            layout: KvLayout::new(shape(12, 1, 128, DType::F32), 16).expect("layout"),
            priority: 1,
            prompt_median: 96.0,
            output_median: 48.0,
            max_len: 512,
        },
    ];
    all.into_iter().take(n).collect()
}

struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        let (u1, u2) = (self.unit().max(1e-12), self.unit());
        let normal = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        median * (sigma * normal).exp()
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[derive(Debug, Clone, Copy)]
struct Request {
    arrival: u64,
    prompt: usize,
    output: usize,
}

/// Each model's requests: busy in its own phase, quiet in the others.
fn make_traces(args: &Args, specs: &[Spec]) -> Vec<Vec<Request>> {
    let mut rng = SplitMix(args.seed);
    let phases = specs.len() as u64;
    let mut traces = vec![Vec::new(); specs.len()];
    for step in 0..phases * args.phase_steps {
        let phase = (step / args.phase_steps) as usize;
        for (m, spec) in specs.iter().enumerate() {
            let rate = if m == phase {
                args.busy_rate
            } else {
                args.quiet_rate
            };
            // Bernoulli arrivals, several per step when the rate is above 1.
            let mut r = rate;
            while r > 0.0 {
                if rng.unit() < r.min(1.0) {
                    let output = (rng.lognormal(spec.output_median, 0.6) as usize).clamp(4, 512);
                    let prompt = (rng.lognormal(spec.prompt_median, 0.8) as usize)
                        .clamp(8, spec.max_len - output);
                    traces[m].push(Request {
                        arrival: step,
                        prompt,
                        output,
                    });
                }
                r -= 1.0;
            }
        }
    }
    traces
}

/// K (kind 0) or V (kind 1) of layer 0 at `pos` of the content `key`
/// ([`Content::key`]): its bytes.
fn token_bytes(
    layout: &KvLayout,
    model: usize,
    key: u64,
    pos: usize,
    kind: u64,
    out: &mut Vec<u8>,
) {
    let n = layout.shape().num_kv_heads * layout.shape().head_dim * layout.dtype().size_bytes();
    let mut z = mix(((model as u64) << 56) ^ (key << 24) ^ ((pos as u64) << 1) ^ kind);
    for _ in 0..n.div_ceil(8) {
        z = mix(z);
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(out.len() - (n.div_ceil(8) * 8 - n));
}

/// The token request `req` generates at output position `i` (the simulated model).
fn generated_token(model: usize, req: usize, i: usize) -> u64 {
    mix(((model as u64) << 48) ^ ((req as u64) << 20) ^ i as u64) % 128_000
}

struct Running {
    req: usize,
    seq: SeqId,
    len: usize,
    generated: usize,
}

#[derive(Debug, Clone, Default)]
struct ModelReport {
    name: String,
    tokens: u64,
    finished: usize,
    requests: usize,
    last_step: u64,
    delayed: u64,
    wait_steps: u64,
    preemptions: u64,
    peak_granted_bytes: usize,
    peak_used_bytes: usize,
    token_checksum: u64,
    kv_checksum: u64,
    /// Prompt tokens served by the prefix cache at admissions.
    hit_tokens: u64,
    sleeps: u64,
    spilled_blocks: u64,
    evicted_blocks: u64,
    restored_blocks: u64,
}

impl ModelReport {
    fn throughput(&self) -> f64 {
        self.tokens as f64 / self.last_step.max(1) as f64
    }
}

struct ModelRun<'t> {
    index: usize,
    id: ModelId,
    trace: &'t [Request],
    next: usize,
    waiting: VecDeque<(usize, usize)>,
    running: Vec<Running>,
    admitted_once: Vec<bool>,
    next_seq: u64,
    report: ModelReport,
    content: Content,
    sleep: Option<SleepPolicy>,
    asleep: bool,
    idle_steps: u64,
}

impl ModelRun<'_> {
    fn step(&mut self, broker: &Broker<HostStorage>, step: u64) -> pagedkv::Result<()> {
        while self.next < self.trace.len() && self.trace[self.next].arrival <= step {
            self.waiting.push_back((self.next, 0));
            self.next += 1;
        }
        if self.asleep && !self.waiting.is_empty() {
            // Wake with room for the floor and every spilled prefix block.
            let (spilled, block_bytes) = {
                let g = broker.lock(self.id)?;
                (
                    g.kv().spilled_prefix_blocks(),
                    g.kv().layout().block_bytes(),
                )
            };
            let floor = broker.stats().models[self.id.0 as usize].floor_bytes;
            let w = broker.wake(self.id, floor + spilled * block_bytes)?;
            self.report.restored_blocks += w.restored_blocks as u64;
            self.asleep = false;
        }
        let mut g = broker.lock(self.id)?;
        let layout = *g.kv().layout();
        let bs = layout.block_size();
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
        let (mut k, mut v) = (Vec::new(), Vec::new());

        // Decode: every running request generates one token; a token at a block
        // boundary needs a new block.
        let mut need = self.running.iter().filter(|r| r.len % bs == 0).count();
        if need > g.kv().num_available_blocks() {
            g.ensure_available(need)?;
        }
        while need > g.kv().num_available_blocks() {
            // Preempt the youngest for recompute; it goes back to the queue's front.
            let Some(victim) = self.running.pop() else {
                break;
            };
            g.kv_mut().free(victim.seq)?;
            self.waiting.push_front((victim.req, victim.generated));
            self.report.preemptions += 1;
            need = self.running.iter().filter(|r| r.len % bs == 0).count();
        }
        let mut done = Vec::new();
        for (i, r) in self.running.iter_mut().enumerate() {
            let (kv, storage) = g.parts_mut();
            kv.append(r.seq, 1, &mut slots, &mut copies)?;
            debug_assert!(copies.is_empty());
            k.clear();
            v.clear();
            let key = self
                .content
                .key(self.index, r.req, &self.trace[r.req], r.len);
            token_bytes(&layout, self.index, key, r.len, 0, &mut k);
            token_bytes(&layout, self.index, key, r.len, 1, &mut v);
            storage.write_slots(0, &slots, &k, &v)?;
            self.report.token_checksum ^=
                mix(generated_token(self.index, r.req, r.generated) ^ (r.req as u64) << 32);
            r.len += 1;
            r.generated += 1;
            self.report.tokens += 1;
            if r.generated == self.trace[r.req].output {
                done.push(i);
            }
        }
        for &i in done.iter().rev() {
            let r = self.running.remove(i);
            // Read the whole sequence back and check it against what was written.
            let table = g.kv().block_table(r.seq)?.to_vec();
            let n = r.len
                * layout.shape().num_kv_heads
                * layout.shape().head_dim
                * layout.dtype().size_bytes();
            let (mut rk, mut rv) = (vec![0u8; n], vec![0u8; n]);
            g.storage()
                .read_tokens(0, &table, r.len, &mut rk, &mut rv)?;
            k.clear();
            v.clear();
            for pos in 0..r.len {
                let key = self.content.key(self.index, r.req, &self.trace[r.req], pos);
                token_bytes(&layout, self.index, key, pos, 0, &mut k);
                token_bytes(&layout, self.index, key, pos, 1, &mut v);
            }
            assert!(
                rk == k && rv == v,
                "{}: request {} K/V differs",
                self.report.name,
                r.req
            );
            self.report.kv_checksum ^=
                mix(xxhash_rust::xxh64::xxh64(&rk, r.req as u64)
                    ^ xxhash_rust::xxh64::xxh64(&rv, 1));
            g.kv_mut().free(r.seq)?;
            self.report.finished += 1;
            self.report.last_step = step + 1;
        }

        // Admissions, first come first served; a recompute re-admits prompt + output
        // so far and writes their K/V again.
        while let Some(&(req, generated)) = self.waiting.front() {
            if self.running.len() >= MAX_BATCH {
                break;
            }
            let tokens = self.trace[req].prompt + generated;
            let need = layout.blocks_for_tokens(tokens + 1);
            if g.kv().num_available_blocks() < need {
                g.ensure_available(need)?;
            }
            if g.kv().num_available_blocks() < need || tokens + 1 > g.kv().max_seq_len() {
                break;
            }
            let seq = SeqId(self.next_seq);
            self.next_seq += 1;
            let (kv, storage) = g.parts_mut();
            let r = &self.trace[req];
            let cached = if self.content.shared_tokens > 0 {
                let ids: Vec<u32> = (0..tokens)
                    .map(|pos| self.content.token_id(self.index, req, r, pos))
                    .collect();
                kv.admit_tokens(seq, &ids, &AdmitOptions::default(), &mut slots)?
                    .cached_tokens
            } else {
                kv.admit(seq, tokens, &mut slots)?;
                0
            };
            self.report.hit_tokens += cached as u64;
            k.clear();
            v.clear();
            for pos in cached..tokens {
                let key = self.content.key(self.index, req, r, pos);
                token_bytes(&layout, self.index, key, pos, 0, &mut k);
                token_bytes(&layout, self.index, key, pos, 1, &mut v);
            }
            storage.write_slots(0, &slots, &k, &v)?;
            if !self.admitted_once[req] {
                self.admitted_once[req] = true;
                let arrival = self.trace[req].arrival;
                if step > arrival {
                    self.report.delayed += 1;
                    self.report.wait_steps += step - arrival;
                }
            }
            self.running.push(Running {
                req,
                seq,
                len: tokens,
                generated,
            });
            self.waiting.pop_front();
        }
        let used = g.kv().stats().used_blocks * layout.block_bytes();
        self.report.peak_used_bytes = self.report.peak_used_bytes.max(used);
        drop(g);
        if let Some(policy) = self.sleep {
            if self.asleep || !self.waiting.is_empty() || !self.running.is_empty() {
                self.idle_steps = 0;
            } else {
                self.idle_steps += 1;
                if self.idle_steps >= policy.idle_steps {
                    let opts = SleepOptions {
                        spill_cached_prefixes: policy.spill,
                        ..SleepOptions::default()
                    };
                    let r = broker.sleep(self.id, opts)?;
                    self.report.sleeps += 1;
                    self.report.spilled_blocks += r.spilled_blocks as u64;
                    self.report.evicted_blocks += r.evicted_blocks as u64;
                    self.asleep = true;
                    self.idle_steps = 0;
                }
            }
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.next == self.trace.len() && self.waiting.is_empty() && self.running.is_empty()
    }
}

/// How each model's share is set.
#[derive(Debug, Clone)]
enum Allocation {
    /// Floors of `floor_chunks`, ceilings of the whole budget: the broker moves memory.
    Broker { floor_chunks: Vec<usize> },
    /// Fixed chunks per model (floor = ceiling).
    Static(Vec<usize>),
}

struct RunResult {
    models: Vec<ModelReport>,
    steps: u64,
    moves: usize,
    moved_bytes: usize,
    /// Highest bytes held by all models together (the budget less the free part).
    peak_total_bytes: usize,
    svg: Option<String>,
}

/// Runs `models` (indices into `specs`) on one budget under `alloc`.
fn simulate(
    args: &Args,
    specs: &[Spec],
    traces: &[Vec<Request>],
    models: &[usize],
    budget_chunks: usize,
    alloc: &Allocation,
    sleep: Option<SleepPolicy>,
) -> pagedkv::Result<RunResult> {
    let chunk = args.chunk_mib << 20;
    let cold = (!args.cache_protected_by_priority).then_some(args.cold_cache_steps);
    let mut broker =
        Broker::new(BrokerConfig::new(budget_chunks * chunk, chunk).with_cold_cache_steps(cold))?;
    let mut runs = Vec::new();
    for (slot, &m) in models.iter().enumerate() {
        let spec = &specs[m];
        let bpc = broker.blocks_per_chunk(&spec.layout)?;
        let (start, limits) = match alloc {
            Allocation::Broker { floor_chunks } => (
                floor_chunks[slot],
                ModelLimits::new(floor_chunks[slot] * chunk, budget_chunks * chunk)
                    .with_priority(spec.priority),
            ),
            Allocation::Static(split) => (
                split[slot],
                ModelLimits::new(split[slot] * chunk, split[slot] * chunk),
            ),
        };
        let blocks = start * bpc;
        // A host tier only where a sleep can use it (the default table has none).
        let host = match sleep {
            Some(_) => (args.host_mib << 20) / spec.layout.block_bytes(),
            None => 0,
        };
        let kv = KvCache::builder(spec.layout)
            .num_blocks(blocks)
            .watermark_blocks(0)
            .tiers(TierConfig {
                num_host_blocks: host,
                ..TierConfig::default()
            })
            .build()?;
        let storage = HostStorage::with_host_tier(spec.layout, blocks, host)?;
        let id = broker.register(spec.name, kv, storage, limits)?;
        runs.push(ModelRun {
            index: m,
            id,
            trace: &traces[m],
            next: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            admitted_once: vec![false; traces[m].len()],
            next_seq: 0,
            report: ModelReport {
                name: spec.name.to_string(),
                requests: traces[m].len(),
                ..ModelReport::default()
            },
            content: Content {
                shared_tokens: args.shared_prefix_tokens,
                prefixes: args.prefixes,
            },
            sleep,
            asleep: false,
            idle_steps: 0,
        });
    }
    let horizon = traces
        .iter()
        .flatten()
        .map(|r| r.arrival)
        .max()
        .unwrap_or(0)
        + 1;
    let mut step = 0;
    while runs.iter().any(|r| !r.finished()) {
        broker.set_clock(step);
        for r in &mut runs {
            r.step(&broker, step)?;
        }
        step += 1;
        if step > 20 * horizon {
            break; // a request that can never fit; reported as unfinished
        }
    }
    if let Err(e) = broker.check_invariants() {
        panic!("broker invariants: {e}");
    }
    let stats = broker.stats();
    let events = broker.events();
    let moves: Vec<_> = events
        .iter()
        .filter(|e| !matches!(e.reason, MoveReason::Register))
        .collect();
    let mut reports: Vec<ModelReport> = runs.into_iter().map(|r| r.report).collect();
    for (rep, b) in reports.iter_mut().zip(&stats.models) {
        rep.peak_granted_bytes = b.peak_bytes;
    }
    Ok(RunResult {
        models: reports,
        steps: step,
        moves: moves.len(),
        moved_bytes: moves.iter().map(|e| e.bytes).sum(),
        peak_total_bytes: stats.peak_used_bytes,
        svg: args
            .svg
            .as_ref()
            .map(|_| broker.events_svg("KV memory held per model (broker run)")),
    })
}

fn total_throughput(r: &RunResult) -> f64 {
    let tokens: u64 = r.models.iter().map(|m| m.tokens).sum();
    let last = r.models.iter().map(|m| m.last_step).max().unwrap_or(1);
    tokens as f64 / last.max(1) as f64
}

/// The fewest chunks that hold a model's longest request.
fn min_chunks(spec: &Spec, chunk: usize) -> usize {
    let bpc = chunk / spec.layout.block_bytes();
    spec.layout
        .blocks_for_tokens(spec.max_len + 1)
        .div_ceil(bpc)
        + 1
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if !(2..=3).contains(&args.models) {
        return Err("--models must be 2 or 3".into());
    }
    let specs = specs(args.models);
    let traces = make_traces(&args, &specs);
    let budget = args.budget_mib / args.chunk_mib;
    let chunk = args.chunk_mib << 20;
    let models: Vec<usize> = (0..specs.len()).collect();
    let mins: Vec<usize> = specs.iter().map(|s| min_chunks(s, chunk)).collect();
    if mins.iter().sum::<usize>() > budget {
        return Err(
            format!("a budget of {budget} chunks is below the models' minimums {mins:?}").into(),
        );
    }

    let broker_run = simulate(
        &args,
        &specs,
        &traces,
        &models,
        budget,
        &Allocation::Broker {
            floor_chunks: mins.clone(),
        },
        None,
    )?;
    let equal: Vec<usize> = vec![budget / specs.len(); specs.len()];
    let equal_run = simulate(
        &args,
        &specs,
        &traces,
        &models,
        budget,
        &Allocation::Static(equal.clone()),
        None,
    )?;

    // Hindsight: every split on a grid of `sweep_chunks`, each model at least its
    // minimum, the remainder to the last model.
    let mut splits = Vec::new();
    let step = args.sweep_chunks.max(1);
    let mut first = mins[0];
    while first + mins[1..].iter().sum::<usize>() <= budget {
        if specs.len() == 2 {
            splits.push(vec![first, budget - first]);
        } else {
            let mut second = mins[1];
            while first + second + mins[2] <= budget {
                splits.push(vec![first, second, budget - first - second]);
                second += step;
            }
        }
        first += step;
    }
    let mut best: Option<(Vec<usize>, RunResult)> = None;
    for split in splits.iter() {
        let run = simulate(
            &args,
            &specs,
            &traces,
            &models,
            budget,
            &Allocation::Static(split.clone()),
            None,
        )?;
        if best
            .as_ref()
            .is_none_or(|(_, b)| total_throughput(&run) > total_throughput(b))
        {
            best = Some((split.clone(), run));
        }
    }
    let (best_split, hindsight_run) = best.ok_or("no split to sweep")?;

    // Each model alone with the whole budget: the reference outputs.
    let mut alone = Vec::new();
    for m in 0..specs.len() {
        let run = simulate(
            &args,
            &specs,
            &traces,
            &[m],
            budget,
            &Allocation::Static(vec![budget]),
            None,
        )?;
        alone.push(run.models.into_iter().next().ok_or("no model")?);
    }

    // Broker runs that put idle models to sleep, evicting or spilling their caches.
    let mut sleep_runs = Vec::new();
    if args.sleep_idle_steps > 0 {
        for spill in [false, true] {
            let policy = SleepPolicy {
                idle_steps: args.sleep_idle_steps,
                spill,
            };
            let run = simulate(
                &args,
                &specs,
                &traces,
                &models,
                budget,
                &Allocation::Broker {
                    floor_chunks: mins.clone(),
                },
                Some(policy),
            )?;
            let name = if spill {
                ("broker + sleep, spill to host", "broker_sleep_spill")
            } else {
                ("broker + sleep, evict", "broker_sleep_evict")
            };
            sleep_runs.push((name, run));
        }
    }

    let runs = [
        ("broker", &broker_run, format!("floors {mins:?} chunks")),
        ("static equal", &equal_run, format!("{equal:?} chunks")),
        (
            "static hindsight",
            &hindsight_run,
            format!("{best_split:?} chunks, best of {} splits", splits.len()),
        ),
    ];
    let mut identical = true;
    let all_runs = runs
        .iter()
        .map(|(_, run, _)| *run)
        .chain(sleep_runs.iter().map(|(_, run)| run));
    for run in all_runs {
        for (m, rep) in run.models.iter().enumerate() {
            identical &= rep.finished == rep.requests
                && rep.token_checksum == alone[m].token_checksum
                && rep.kv_checksum == alone[m].kv_checksum;
        }
    }
    let mib = |b: usize| b as f64 / (1 << 20) as f64;

    if args.json {
        let run_json = |run: &RunResult, alloc: &str| {
            serde_json::json!({
                "allocation": alloc,
                "total_tokens_per_step": total_throughput(run),
                "steps": run.steps,
                "moves": run.moves,
                "moved_mib": mib(run.moved_bytes),
                "peak_total_granted_mib": mib(run.peak_total_bytes),
                "models": run.models.iter().map(|m| serde_json::json!({
                    "name": m.name,
                    "requests": m.requests,
                    "finished": m.finished,
                    "tokens": m.tokens,
                    "last_step": m.last_step,
                    "tokens_per_step": m.throughput(),
                    "admissions_delayed": m.delayed,
                    "mean_wait_steps": m.wait_steps as f64 / m.requests.max(1) as f64,
                    "preemptions": m.preemptions,
                    "peak_granted_mib": mib(m.peak_granted_bytes),
                    "peak_used_mib": mib(m.peak_used_bytes),
                    "token_checksum": format!("{:016x}", m.token_checksum),
                    "kv_checksum": format!("{:016x}", m.kv_checksum),
                })).collect::<Vec<_>>(),
            })
        };
        let mut out = serde_json::Map::new();
        for (name, run, alloc) in &runs {
            out.insert(name.replace(' ', "_"), run_json(run, alloc));
        }
        for ((name, key), run) in &sleep_runs {
            let mut j = run_json(run, name);
            if let Some(models) = j.get_mut("models").and_then(|m| m.as_array_mut()) {
                for (mj, m) in models.iter_mut().zip(&run.models) {
                    mj["prefix_hit_tokens"] = m.hit_tokens.into();
                    mj["sleeps"] = m.sleeps.into();
                    mj["spilled_blocks"] = m.spilled_blocks.into();
                    mj["evicted_blocks"] = m.evicted_blocks.into();
                    mj["restored_blocks"] = m.restored_blocks.into();
                }
            }
            out.insert(key.to_string(), j);
        }
        out.insert("budget_mib".into(), (budget * args.chunk_mib).into());
        out.insert("chunk_mib".into(), args.chunk_mib.into());
        out.insert("outputs_identical_to_alone".into(), identical.into());
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::Value::Object(out))?
        );
    } else {
        println!(
            "{} models sharing {} MiB in {} MiB chunks; load shifts every {} steps (busy {} req/step, quiet {})",
            specs.len(),
            budget * args.chunk_mib,
            args.chunk_mib,
            args.phase_steps,
            args.busy_rate,
            args.quiet_rate
        );
        for (s, t) in specs.iter().zip(&traces) {
            println!(
                "  {:<7} {:>3} KiB blocks of {:>2} tokens, {} per chunk, priority {}, {} requests",
                s.name,
                s.layout.block_bytes() >> 10,
                s.layout.block_size(),
                chunk / s.layout.block_bytes(),
                s.priority,
                t.len()
            );
        }
        println!();
        println!(
            "| allocation | model | tokens/step | finished at step | admissions delayed | mean wait (steps) | preemptions | peak granted MiB | peak used MiB |"
        );
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
        for (name, run, alloc) in &runs {
            for m in &run.models {
                println!(
                    "| {name} | {} | {:.2} | {} | {} | {:.1} | {} | {:.0} | {:.1} |",
                    m.name,
                    m.throughput(),
                    m.last_step,
                    m.delayed,
                    m.wait_steps as f64 / m.requests.max(1) as f64,
                    m.preemptions,
                    mib(m.peak_granted_bytes),
                    mib(m.peak_used_bytes)
                );
            }
            println!(
                "| **{name}** ({alloc}) | **total** | **{:.2}** | {} | {} | | {} | {:.0} | |",
                total_throughput(run),
                run.models.iter().map(|m| m.last_step).max().unwrap_or(0),
                run.models.iter().map(|m| m.delayed).sum::<u64>(),
                run.models.iter().map(|m| m.preemptions).sum::<u64>(),
                mib(run.peak_total_bytes),
            );
        }
        if !sleep_runs.is_empty() {
            println!();
            println!(
                "| run | model | tokens/step | prefix hit tokens | sleeps | blocks spilled | blocks evicted by sleeps | blocks restored |"
            );
            println!("|---|---|---:|---:|---:|---:|---:|---:|");
            let sleepless = ("broker, no sleep", &broker_run);
            for (name, run) in
                std::iter::once(sleepless).chain(sleep_runs.iter().map(|((n, _), r)| (*n, r)))
            {
                for m in &run.models {
                    println!(
                        "| {name} | {} | {:.2} | {} | {} | {} | {} | {} |",
                        m.name,
                        m.throughput(),
                        m.hit_tokens,
                        m.sleeps,
                        m.spilled_blocks,
                        m.evicted_blocks,
                        m.restored_blocks
                    );
                }
                println!(
                    "| **{name}** | **total** | **{:.2}** | {} | {} | {} | {} | {} |",
                    total_throughput(run),
                    run.models.iter().map(|m| m.hit_tokens).sum::<u64>(),
                    run.models.iter().map(|m| m.sleeps).sum::<u64>(),
                    run.models.iter().map(|m| m.spilled_blocks).sum::<u64>(),
                    run.models.iter().map(|m| m.evicted_blocks).sum::<u64>(),
                    run.models.iter().map(|m| m.restored_blocks).sum::<u64>(),
                );
            }
        }
        println!();
        println!(
            "broker: {} moves, {:.0} MiB moved. Outputs (generated tokens and every sequence's K/V) identical to each model alone: {}",
            broker_run.moves,
            mib(broker_run.moved_bytes),
            if identical { "yes" } else { "NO" }
        );
        for (m, a) in alone.iter().enumerate() {
            println!(
                "  {:<7} alone: token checksum {:016x}, kv checksum {:016x}",
                specs[m].name, a.token_checksum, a.kv_checksum
            );
        }
    }
    if let (Some(path), Some(svg)) = (&args.svg, &broker_run.svg) {
        std::fs::write(path, svg)?;
        eprintln!("wrote {path}");
    }
    if !identical {
        return Err("a run's outputs differ from the model running alone".into());
    }
    Ok(())
}
