//! The allocator hot path on a whole decode trace, paged beside the
//! contiguous-reservation baseline and a bare free list with `Vec` tables (no checks,
//! no refcounts: the lower bound) in the same run; a fork of a 1,000-token sequence
//! plus its free; and the raw block pool.
//!
//! The trace, generated from a fixed seed: 2,000 sequences, at most 256 running,
//! prompts of 128-2,048 tokens, 64-1,024 decode tokens each, block size 16, 65,536
//! blocks. Half the prompts start with one of 8 shared 1,024-token prefixes. Each step
//! appends one token to every running sequence (their ids come as one dense array per
//! step, as a sampler hands them over); finished sequences are freed at the end of the
//! step, then new ones are admitted. Admission, appends and frees are all
//! timed; the figure is the time of the whole replay over the decode tokens appended.
//!
//! The paged manager runs twice per setting: through the per-sequence calls
//! (`append`, `append_tokens`), through the batch decode step (`append_batch`,
//! `append_tokens_batch`, by handle), and through the step path engines use
//! (`reserve_step` into `StepBuffers`, which also writes positions, query start
//! locations and the padded block tables the bare list never builds; `commit_step`;
//! with prefix caching `reserve_step_tokens`, which takes the step's ids). Before
//! criterion runs, a summary table (median of interleaved replays) prints ns per
//! appended token and the ratio to the bare list (`TRACE_SUMMARY=0` skips it).
//!
//! The one cache type over KV-cache groups runs the same trace through its `_grouped`
//! per-sequence calls and through its step path (`reserve_step_grouped`, one
//! `StepBuffers` per group, then `commit_step`) on the same bytes: one group (a plain cache of 16-layer pages)
//! beside two groups (a full and a 1,024-token window group of 16 layers each, as
//! `KvCache::hybrid` builds a Gemma-like model), prefix caching off and on.
//!
//! `cargo bench --bench trace -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use pagedkv::baseline::{CacheAllocator, ContiguousCache};
use pagedkv::layout::Slot;
use pagedkv::pool::BlockPool;
use pagedkv::{
    AdmitOptions, BlockId, CacheConfig, CopyPlan, DType, GroupSpec, GroupStep, KvCache, KvLayout,
    ModelShape, SeqHandle, SeqId, StepBuffers, StepEntry,
};

const SEED: u64 = 18;
const NUM_SEQS: usize = 2_000;
const MAX_RUNNING: usize = 256;
const PROMPT_MIN: usize = 128;
const PROMPT_MAX: usize = 2_048;
const DECODE_MIN: usize = 64;
const DECODE_MAX: usize = 1_024;
const BLOCK_SIZE: usize = 16;
const NUM_BLOCKS: usize = 65_536;
const SHARED_PREFIXES: usize = 8;
const PREFIX_TOKENS: usize = 1_024;
const VOCAB: u32 = 32_000;

/// SplitMix64: the trace must not depend on a crate's RNG version.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    fn token(&mut self) -> u32 {
        (self.next() % u64::from(VOCAB)) as u32
    }
}

struct SeqSpec {
    /// `tokens[start..start + prompt]` is the prompt, the next `decode` ids the
    /// sampled tokens.
    start: usize,
    prompt: usize,
    decode: usize,
}

struct Trace {
    seqs: Vec<SeqSpec>,
    tokens: Vec<u32>,
    decode_tokens: usize,
    /// The ids each step samples, in batch order, one step after another: what an
    /// engine's sampler hands over as one dense array per step. (The schedule depends
    /// on the trace alone, so it is recorded once; reading each id from its sequence's
    /// place in `tokens` instead cost the replay a cache miss per token that no engine
    /// pays.)
    sampled: Vec<u32>,
}

impl Trace {
    fn generate() -> Trace {
        let mut rng = Rng(SEED);
        let prefixes: Vec<Vec<u32>> = (0..SHARED_PREFIXES)
            .map(|_| (0..PREFIX_TOKENS).map(|_| rng.token()).collect())
            .collect();
        let mut tokens = Vec::new();
        let mut seqs = Vec::with_capacity(NUM_SEQS);
        let mut decode_tokens = 0;
        for _ in 0..NUM_SEQS {
            let start = tokens.len();
            let shared = rng.next().is_multiple_of(2);
            let prompt = if shared {
                let p = &prefixes[rng.range(0, SHARED_PREFIXES - 1)];
                tokens.extend_from_slice(p);
                // Longer than the prefix, so every prefix block can hit.
                rng.range(PREFIX_TOKENS + 1, PROMPT_MAX)
            } else {
                rng.range(PROMPT_MIN, PROMPT_MAX)
            };
            let decode = rng.range(DECODE_MIN, DECODE_MAX);
            while tokens.len() < start + prompt + decode {
                tokens.push(rng.token());
            }
            decode_tokens += decode;
            seqs.push(SeqSpec {
                start,
                prompt,
                decode,
            });
        }
        let mut trace = Trace {
            seqs,
            tokens,
            decode_tokens,
            sampled: Vec::new(),
        };
        let mut record = Recorder(Vec::with_capacity(decode_tokens));
        replay(&trace, &mut record);
        trace.sampled = record.0;
        trace
    }

    fn prompt(&self, i: usize) -> &[u32] {
        let s = &self.seqs[i];
        &self.tokens[s.start..s.start + s.prompt]
    }

    /// The id sampled at decode step `j` of sequence `i`.
    fn decode_token(&self, i: usize, j: usize) -> u32 {
        let s = &self.seqs[i];
        self.tokens[s.start + s.prompt + j]
    }
}

/// One decode step: the token at decode step `done[k]` goes to sequence `running[k]`,
/// and `sampled[k]` is its id (empty while the trace records them).
struct Step<'a> {
    running: &'a [usize],
    done: &'a [usize],
    sampled: &'a [u32],
}

/// What a cache must do to replay the trace; `i` is the sequence's index in the trace.
trait Replay {
    fn admit(&mut self, trace: &Trace, i: usize);
    /// Appends one token to every sequence of `step` and fills the step's slot mapping.
    fn step(&mut self, trace: &Trace, step: &Step<'_>, slots: &mut Vec<Slot>);
    fn free(&mut self, i: usize);
}

/// Records the ids the trace samples, step by step in batch order (`Trace::sampled`).
struct Recorder(Vec<u32>);

impl Replay for Recorder {
    fn admit(&mut self, _: &Trace, _: usize) {}
    fn step(&mut self, trace: &Trace, step: &Step<'_>, slots: &mut Vec<Slot>) {
        for (&i, &j) in step.running.iter().zip(step.done) {
            self.0.push(trace.decode_token(i, j));
            slots.push(Slot(0));
        }
    }
    fn free(&mut self, _: usize) {}
}

/// Replays the whole trace; returns the wall time (admission, appends and frees).
fn replay(trace: &Trace, cache: &mut impl Replay) -> Duration {
    let mut running: Vec<usize> = Vec::with_capacity(MAX_RUNNING);
    let mut done: Vec<usize> = Vec::with_capacity(MAX_RUNNING);
    let mut slots: Vec<Slot> = Vec::with_capacity(MAX_RUNNING);
    let mut next = 0;
    let mut cursor = 0;
    let t = Instant::now();
    while next < trace.seqs.len() && running.len() < MAX_RUNNING {
        cache.admit(trace, next);
        running.push(next);
        done.push(0);
        next += 1;
    }
    while !running.is_empty() {
        slots.clear();
        let sampled = trace
            .sampled
            .get(cursor..cursor + running.len())
            .unwrap_or(&[]);
        cursor += running.len();
        let step = Step {
            running: &running,
            done: &done,
            sampled,
        };
        cache.step(trace, &step, &mut slots);
        debug_assert_eq!(slots.len(), running.len());
        black_box(&slots);
        let mut k = 0;
        while k < running.len() {
            done[k] += 1;
            if done[k] == trace.seqs[running[k]].decode {
                cache.free(running[k]);
                running.swap_remove(k);
                done.swap_remove(k);
            } else {
                k += 1;
            }
        }
        while next < trace.seqs.len() && running.len() < MAX_RUNNING {
            cache.admit(trace, next);
            running.push(next);
            done.push(0);
            next += 1;
        }
    }
    t.elapsed()
}

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

/// Half the model's layers: the page of a group of 16 layers (two to a block's bytes).
fn half_layout() -> KvLayout {
    let s = ModelShape {
        num_layers: 16,
        ..*layout().shape()
    };
    KvLayout::new(s, BLOCK_SIZE).unwrap()
}

/// The window of [`Grouped`]'s window group, in tokens.
const WINDOW: usize = 1_024;

fn manager() -> KvCache {
    let cfg = CacheConfig {
        num_blocks: NUM_BLOCKS,
        watermark_blocks: 0,
        max_seq_len_tokens: PROMPT_MAX + DECODE_MAX,
        ..CacheConfig::new(0)
    };
    KvCache::new(layout(), cfg).unwrap()
}

/// How [`Paged`] runs the decode step.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    /// `append` / `append_tokens`, one call per sequence by id.
    PerSeq,
    /// One `append_batch` / `append_tokens_batch` call by handle.
    Batch,
    /// The step path engines use: one `reserve_step` into `StepBuffers` (slot
    /// mapping, positions, query start locations and the padded block tables), or
    /// `reserve_step_tokens` with the step's ids (prefix on), then one `commit_step`.
    Step,
}

/// The paged manager: `admit` (prefix caching off: no token ids) or `admit_tokens`
/// (on), then each decode step through one of the [`Path`]s; handles are taken once at
/// admission.
struct Paged {
    kv: KvCache,
    prefix: bool,
    path: Path,
    slots: Vec<Slot>,
    copies: CopyPlan,
    /// Handle of each trace sequence, set at admission (batch mode).
    handles: Vec<Option<SeqHandle>>,
    step_handles: Vec<SeqHandle>,
    entries: Vec<StepEntry>,
    accepted: Vec<(SeqHandle, usize)>,
    buffers: StepBuffers,
}

impl Paged {
    fn new(prefix: bool, path: Path) -> Self {
        let width = (PROMPT_MAX + DECODE_MAX).div_ceil(BLOCK_SIZE);
        Paged {
            kv: manager(),
            prefix,
            path,
            slots: Vec::new(),
            copies: CopyPlan::new(),
            handles: vec![None; NUM_SEQS],
            step_handles: Vec::with_capacity(MAX_RUNNING),
            entries: Vec::with_capacity(MAX_RUNNING),
            accepted: Vec::with_capacity(MAX_RUNNING),
            buffers: StepBuffers::new(MAX_RUNNING, MAX_RUNNING, width),
        }
    }
}

impl Replay for Paged {
    fn admit(&mut self, trace: &Trace, i: usize) {
        let id = SeqId(i as u64);
        if self.prefix {
            let opts = AdmitOptions::default();
            self.kv
                .admit_tokens(id, trace.prompt(i), &opts, &mut self.slots)
                .unwrap();
        } else {
            self.kv
                .admit(id, trace.seqs[i].prompt, &mut self.slots)
                .unwrap();
        }
        if self.path != Path::PerSeq {
            self.handles[i] = Some(self.kv.handle(id).unwrap());
        }
    }
    fn step(&mut self, _: &Trace, step: &Step<'_>, slots: &mut Vec<Slot>) {
        let (running, sampled) = (step.running, step.sampled);
        if self.path == Path::Step {
            self.entries.clear();
            self.entries.extend(running.iter().map(|&i| StepEntry {
                seq: self.handles[i].unwrap(),
                new_tokens: 1,
                lookahead: 0,
            }));
            if self.prefix {
                self.kv
                    .reserve_step_tokens(&self.entries, sampled, &mut self.buffers)
                    .unwrap();
            } else {
                self.kv
                    .reserve_step(&self.entries, &mut self.buffers)
                    .unwrap();
            }
            self.accepted.clear();
            self.accepted
                .extend(self.entries.iter().map(|e| (e.seq, e.new_tokens)));
            self.kv.commit_step(&self.accepted).unwrap();
            let mapping = self.buffers.slot_mapping();
            slots.extend(mapping.iter().map(|&s| Slot(s as u64)));
            return;
        }
        if self.path == Path::Batch {
            self.step_handles.clear();
            self.step_handles
                .extend(running.iter().map(|&i| self.handles[i].unwrap()));
            if self.prefix {
                self.kv
                    .append_tokens_batch(&self.step_handles, sampled, slots, &mut self.copies)
                    .unwrap();
            } else {
                self.kv
                    .append_batch(&self.step_handles, slots, &mut self.copies)
                    .unwrap();
            }
            return;
        }
        for (&i, &t) in running.iter().zip(sampled) {
            let id = SeqId(i as u64);
            if self.prefix {
                self.kv
                    .append_tokens(id, &[t], &mut self.slots, &mut self.copies)
                    .unwrap();
            } else {
                self.kv
                    .append(id, 1, &mut self.slots, &mut self.copies)
                    .unwrap();
            }
            slots.extend_from_slice(&self.slots);
        }
    }
    fn free(&mut self, i: usize) {
        self.kv.free(SeqId(i as u64)).unwrap();
    }
}

/// The one cache type through its `_grouped` calls, one call per sequence: one group
/// of 16-layer pages, or a full and a window group of 16 layers each over one arena
/// of the same bytes.
struct Grouped {
    kv: KvCache,
    prefix: bool,
    step: GroupStep,
    /// The step path (`reserve_step_grouped` into one `StepBuffers` per group, then
    /// `commit_step`) instead of one `append_grouped` per sequence.
    step_path: bool,
    handles: Vec<Option<SeqHandle>>,
    entries: Vec<StepEntry>,
    accepted: Vec<(SeqHandle, usize)>,
    buffers: Vec<StepBuffers>,
}

impl Grouped {
    fn new(groups: usize, prefix: bool, step_path: bool) -> Self {
        let l = half_layout();
        let pages = 2 * NUM_BLOCKS;
        let kv = if groups == 1 {
            let cfg = CacheConfig {
                num_blocks: pages,
                watermark_blocks: 0,
                max_seq_len_tokens: PROMPT_MAX + DECODE_MAX,
                ..CacheConfig::new(0)
            };
            KvCache::new(l, cfg).unwrap()
        } else {
            KvCache::hybrid(&[GroupSpec::full(l), GroupSpec::window(l, WINDOW)], pages)
                .unwrap()
                .with_watermark_blocks(0)
                .unwrap()
        };
        let width = (PROMPT_MAX + DECODE_MAX).div_ceil(BLOCK_SIZE);
        Grouped {
            kv,
            prefix,
            step: GroupStep::default(),
            step_path,
            handles: vec![None; NUM_SEQS],
            entries: Vec::with_capacity(MAX_RUNNING),
            accepted: Vec::with_capacity(MAX_RUNNING),
            buffers: (0..groups)
                .map(|_| StepBuffers::new(MAX_RUNNING, MAX_RUNNING, width))
                .collect(),
        }
    }
}

impl Replay for Grouped {
    fn admit(&mut self, trace: &Trace, i: usize) {
        let id = SeqId(i as u64);
        if self.prefix {
            let opts = AdmitOptions::default();
            self.kv
                .admit_tokens_grouped(id, trace.prompt(i), &opts, &mut self.step)
                .unwrap();
        } else {
            self.kv
                .admit_grouped(id, trace.seqs[i].prompt, &mut self.step)
                .unwrap();
        }
        if self.step_path {
            self.handles[i] = Some(self.kv.handle(id).unwrap());
        }
    }
    fn step(&mut self, _: &Trace, step: &Step<'_>, slots: &mut Vec<Slot>) {
        if self.step_path {
            self.entries.clear();
            self.entries.extend(step.running.iter().map(|&i| StepEntry {
                seq: self.handles[i].unwrap(),
                new_tokens: 1,
                lookahead: 0,
            }));
            if self.prefix {
                self.kv
                    .reserve_step_tokens_grouped(&self.entries, step.sampled, &mut self.buffers)
                    .unwrap();
            } else {
                self.kv
                    .reserve_step_grouped(&self.entries, &mut self.buffers)
                    .unwrap();
            }
            self.accepted.clear();
            self.accepted
                .extend(self.entries.iter().map(|e| (e.seq, e.new_tokens)));
            self.kv.commit_step(&self.accepted).unwrap();
            let mapping = self.buffers[0].slot_mapping();
            slots.extend(mapping.iter().map(|&s| Slot(s as u64)));
            return;
        }
        for (&i, &t) in step.running.iter().zip(step.sampled) {
            let id = SeqId(i as u64);
            if self.prefix {
                self.kv
                    .append_tokens_grouped(id, &[t], &mut self.step)
                    .unwrap();
            } else {
                self.kv.append_grouped(id, 1, &mut self.step).unwrap();
            }
            // The full group's slot: the one a whole-model slot mapping would hold.
            slots.extend_from_slice(&self.step.slots[0]);
        }
    }
    fn free(&mut self, i: usize) {
        self.kv.free(SeqId(i as u64)).unwrap();
    }
}

/// Contiguous `max_len` reservations (each sequence reserves prompt + decode maximum).
struct Contiguous {
    cc: ContiguousCache,
    slots: Vec<Slot>,
    copies: CopyPlan,
}

impl Replay for Contiguous {
    fn admit(&mut self, trace: &Trace, i: usize) {
        self.cc
            .admit(SeqId(i as u64), trace.seqs[i].prompt, &mut self.slots)
            .unwrap();
    }
    fn step(&mut self, _: &Trace, step: &Step<'_>, slots: &mut Vec<Slot>) {
        for &i in step.running {
            self.cc
                .append(SeqId(i as u64), 1, &mut self.slots, &mut self.copies)
                .unwrap();
            slots.extend_from_slice(&self.slots);
        }
    }
    fn free(&mut self, i: usize) {
        self.cc.free(SeqId(i as u64)).unwrap();
    }
}

/// The lower bound: a free stack and `Vec` tables indexed by the trace position, no
/// checks, no refcounts, no ids to look up. Its prompt slots are written too.
struct Bare {
    free: Vec<u32>,
    tables: Vec<Vec<u32>>,
    lens: Vec<usize>,
    slots: Vec<Slot>,
}

impl Bare {
    fn new(trace: &Trace) -> Self {
        Bare {
            free: (0..NUM_BLOCKS as u32).rev().collect(),
            tables: vec![Vec::new(); trace.seqs.len()],
            lens: vec![0; trace.seqs.len()],
            slots: Vec::new(),
        }
    }
    fn push_token(&mut self, i: usize) -> Slot {
        let pos = self.lens[i];
        let table = &mut self.tables[i];
        if pos.is_multiple_of(BLOCK_SIZE) {
            table.push(self.free.pop().expect("the trace fits the arena"));
        }
        self.lens[i] = pos + 1;
        Slot(u64::from(table[pos / BLOCK_SIZE]) * BLOCK_SIZE as u64 + (pos % BLOCK_SIZE) as u64)
    }
}

impl Replay for Bare {
    fn admit(&mut self, trace: &Trace, i: usize) {
        self.slots.clear();
        self.tables[i].reserve((trace.seqs[i].prompt + trace.seqs[i].decode).div_ceil(BLOCK_SIZE));
        for _ in 0..trace.seqs[i].prompt {
            let s = self.push_token(i);
            self.slots.push(s);
        }
        black_box(&self.slots);
    }
    fn step(&mut self, _: &Trace, step: &Step<'_>, slots: &mut Vec<Slot>) {
        for &i in step.running {
            let s = self.push_token(i);
            slots.push(s);
        }
    }
    fn free(&mut self, i: usize) {
        let table = std::mem::take(&mut self.tables[i]);
        self.free.extend(table.iter().rev());
        self.lens[i] = 0;
    }
}

type Factory = fn(&Trace) -> Box<dyn ReplayBox>;

/// Object-safe wrapper so the variants can sit in one list.
trait ReplayBox {
    fn run(&mut self, trace: &Trace) -> Duration;
    fn hit_rate(&self) -> Option<f64> {
        None
    }
}

impl ReplayBox for Paged {
    fn run(&mut self, trace: &Trace) -> Duration {
        replay(trace, self)
    }
    fn hit_rate(&self) -> Option<f64> {
        self.prefix.then(|| self.kv.prefix_stats().hit_rate())
    }
}
impl ReplayBox for Grouped {
    fn run(&mut self, trace: &Trace) -> Duration {
        replay(trace, self)
    }
    fn hit_rate(&self) -> Option<f64> {
        self.prefix
            .then(|| self.kv.group(0).prefix_stats().hit_rate())
    }
}
impl ReplayBox for Contiguous {
    fn run(&mut self, trace: &Trace) -> Duration {
        replay(trace, self)
    }
}
impl ReplayBox for Bare {
    fn run(&mut self, trace: &Trace) -> Duration {
        replay(trace, self)
    }
}

fn variants() -> Vec<(&'static str, Factory)> {
    vec![
        ("bare_free_list", |t| Box::new(Bare::new(t))),
        ("paged_prefix_off", |_| {
            Box::new(Paged::new(false, Path::PerSeq))
        }),
        ("paged_prefix_off_batch", |_| {
            Box::new(Paged::new(false, Path::Batch))
        }),
        ("paged_prefix_off_step", |_| {
            Box::new(Paged::new(false, Path::Step))
        }),
        ("paged_prefix_on", |_| {
            Box::new(Paged::new(true, Path::PerSeq))
        }),
        ("paged_prefix_on_batch", |_| {
            Box::new(Paged::new(true, Path::Batch))
        }),
        ("paged_prefix_on_step", |_| {
            Box::new(Paged::new(true, Path::Step))
        }),
        ("groups_1_prefix_off", |_| {
            Box::new(Grouped::new(1, false, false))
        }),
        ("groups_2_full_window_prefix_off", |_| {
            Box::new(Grouped::new(2, false, false))
        }),
        ("groups_1_prefix_off_step", |_| {
            Box::new(Grouped::new(1, false, true))
        }),
        ("groups_2_full_window_prefix_off_step", |_| {
            Box::new(Grouped::new(2, false, true))
        }),
        ("groups_1_prefix_on", |_| {
            Box::new(Grouped::new(1, true, false))
        }),
        ("groups_2_full_window_prefix_on", |_| {
            Box::new(Grouped::new(2, true, false))
        }),
        ("groups_1_prefix_on_step", |_| {
            Box::new(Grouped::new(1, true, true))
        }),
        ("groups_2_full_window_prefix_on_step", |_| {
            Box::new(Grouped::new(2, true, true))
        }),
        ("contiguous", |_| {
            Box::new(Contiguous {
                cc: ContiguousCache::new(layout(), NUM_BLOCKS, PROMPT_MAX + DECODE_MAX).unwrap(),
                slots: Vec::new(),
                copies: CopyPlan::new(),
            })
        }),
    ]
}

/// Interleaved replays of every variant; prints the median ns per appended token and
/// the ratio to the bare list.
fn summary(trace: &Trace) {
    const ROUNDS: usize = 5;
    let vs = variants();
    let mut times = vec![Vec::new(); vs.len()];
    let mut hits = vec![None; vs.len()];
    for _ in 0..ROUNDS {
        for (k, (_, make)) in vs.iter().enumerate() {
            let mut cache = make(trace);
            times[k].push(cache.run(trace));
            hits[k] = cache.hit_rate();
        }
    }
    let per_token = |k: usize| {
        let mut t = times[k].clone();
        t.sort();
        t[ROUNDS / 2].as_nanos() as f64 / trace.decode_tokens as f64
    };
    let bare = per_token(0);
    println!(
        "trace: {} sequences, {} decode tokens, {} prompt tokens; median of {ROUNDS} replays",
        trace.seqs.len(),
        trace.decode_tokens,
        trace.seqs.iter().map(|s| s.prompt).sum::<usize>()
    );
    println!("| variant | ns per appended token | ratio to bare list | prefix hit rate |");
    println!("|---|---|---|---|");
    for (k, (name, _)) in vs.iter().enumerate() {
        let ns = per_token(k);
        let hit = hits[k].map_or("-".to_string(), |h| format!("{:.1} %", h * 100.0));
        println!("| {name} | {ns:.2} | {:.2} | {hit} |", ns / bare);
    }
}

fn bench_trace(c: &mut Criterion) {
    let trace = Trace::generate();
    // `TRACE_SUMMARY=0` skips the table (when profiling one criterion bench).
    if std::env::var("TRACE_SUMMARY").as_deref() != Ok("0") {
        summary(&trace);
    }
    let mut g = c.benchmark_group("trace");
    g.sample_size(10);
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(Throughput::Elements(trace.decode_tokens as u64));
    for (name, make) in variants() {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mut cache = make(&trace);
                    total += cache.run(&trace);
                }
                total
            })
        });
    }
    g.finish();
}

/// Fork a 1,000-token sequence and free the child: the paged manager (prompt admitted
/// with and without token ids) beside a `Vec` table with bare refcounts.
fn bench_fork(c: &mut Criterion) {
    let mut g = c.benchmark_group("fork_free_1000_tokens");
    for prefix in [false, true] {
        let mut kv = manager();
        let mut slots = Vec::new();
        if prefix {
            let prompt: Vec<u32> = (0..1_000).collect();
            kv.admit_tokens(SeqId(0), &prompt, &AdmitOptions::default(), &mut slots)
                .unwrap();
        } else {
            kv.admit(SeqId(0), 1_000, &mut slots).unwrap();
        }
        let name = if prefix { "paged_prefix_on" } else { "paged" };
        g.bench_function(name, |b| {
            b.iter(|| {
                kv.fork(SeqId(0), black_box(SeqId(1))).unwrap();
                kv.free(SeqId(1)).unwrap();
            })
        });
    }
    {
        let table: Vec<u32> = (0..1_000u32.div_ceil(BLOCK_SIZE as u32)).collect();
        let mut refcount = vec![1u32; NUM_BLOCKS];
        g.bench_function("bare_refcounts", |b| {
            b.iter(|| {
                let child = black_box(&table).clone();
                for &x in &child {
                    refcount[x as usize] += 1;
                }
                for &x in child.iter().rev() {
                    refcount[x as usize] -= 1;
                }
                black_box(child)
            })
        });
    }
    g.finish();
}

/// Raw pool: allocate a batch of `n` blocks then free them, pool 75 % full; per block
/// allocated or freed (2n operations per iteration). Beside a bare `Vec<u32>` stack.
fn bench_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool_per_block_op");
    for n in [1usize, 4, 16, 64] {
        g.throughput(Throughput::Elements(2 * n as u64));
        let mut pool = BlockPool::new(NUM_BLOCKS).unwrap();
        let mut held = Vec::new();
        pool.allocate_n(NUM_BLOCKS * 3 / 4, &mut held).unwrap();
        let mut batch: Vec<BlockId> = Vec::with_capacity(n);
        g.bench_function(format!("block_pool/batch_{n}"), |b| {
            b.iter(|| {
                pool.allocate_n(black_box(n), &mut batch).unwrap();
                for &x in &batch {
                    pool.decref(x).unwrap();
                }
                batch.clear();
            })
        });
        let mut free: Vec<u32> = (0..(NUM_BLOCKS / 4) as u32).collect();
        let mut out: Vec<u32> = Vec::with_capacity(n);
        g.bench_function(format!("bare_stack/batch_{n}"), |b| {
            b.iter(|| {
                for _ in 0..black_box(n) {
                    out.push(free.pop().unwrap());
                }
                free.extend(out.drain(..).rev());
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_trace, bench_fork, bench_pool);
criterion_main!(benches);
