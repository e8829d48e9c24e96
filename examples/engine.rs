//! A continuous-batching engine written on the public API only: the reference for how
//! an engine drives the engine contract (`pagedkv::guide::engine_contract`: computed
//! tokens, this step's reserved tokens, lookahead slots) one step at a time.
//!
//! Each step, in this order:
//!
//! 1. arrivals join the waiting queue; swapped-out groups come back while they fit;
//! 2. running sequences are scheduled under the token budget: decodes first (the
//!    pending token, `k` drafts, `k` lookahead slots for the next drafts), then prefill
//!    chunks;
//! 3. the step's whole need (`blocks_needed_batch`, in reservation order) is compared
//!    with what is available; when short, `preempt_for(need)` swaps or drops groups
//!    *before* any slot of the step is handed out;
//! 4. one `reserve_step` for the scheduled running sequences (it fills the step's
//!    slot mapping, tables and copies), then waiting requests are admitted with the
//!    budget left (`lookup_prefix` -> `can_admit_hit` -> `admit_prompt` -> `reserve` of
//!    a first chunk);
//! 5. copy-on-write copies run, then one model forward over the whole batch (prefill
//!    chunks and draft verification in one ragged batch);
//! 6. `commit` of what was accepted (rejected drafts are dropped by committing fewer),
//!    sampling, forks for parallel sampling, retirement and aborts.
//!
//! The same trace runs three times: (a) a roomy arena, (b) a squeezed arena with a host
//! tier, forcing swaps and recomputes, (c) speculation off. Every request's tokens must
//! be identical across the three; the example exits non-zero naming the first request
//! that differs.
//!
//! ```text
//! cargo run --release --example engine                  # 40 requests, a few seconds
//! cargo run --release --example engine -- --quick       # 12 requests
//! cargo run --release --example engine -- --requests 200 --squeezed-blocks 48
//! ```

use std::collections::{HashMap, VecDeque};
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use pagedkv::attention::model::{SplitMix64, TinyModel};
use pagedkv::layout::Slot;
use pagedkv::manager::preempt::{CostModel, PreemptAction, PreemptReason, Preemption};
use pagedkv::tables::PaddedTables;
use pagedkv::{
    AdmitOptions, BlockId, CopyPlan, DType, Error, HostStorage, KvCache, KvLayout, ModelShape,
    PreemptPolicy, PrefixHit, SeqId, StepEntry, Storage, TierConfig,
};

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Continuous batching with chunked prefill, speculative decoding, \
                   prefix caching, forks, aborts and preemption, checked for identical outputs"
)]
struct Args {
    /// A small trace (12 requests) for CI.
    #[arg(long)]
    quick: bool,
    /// Requests in the trace (ignored with --quick).
    #[arg(long, default_value_t = 40)]
    requests: usize,
    /// Seed of the trace and the model.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Drafts per decode step when speculation is on.
    #[arg(long, default_value_t = 3)]
    spec_k: usize,
    /// Device blocks of runs (a) and (c).
    #[arg(long, default_value_t = 1024)]
    roomy_blocks: usize,
    /// Device blocks of run (b).
    #[arg(long, default_value_t = 32)]
    squeezed_blocks: usize,
    /// Host-tier blocks of run (b): small, so that preemptions recompute once it is full.
    #[arg(long, default_value_t = 6)]
    host_blocks: usize,
}

/// Query tokens one step computes: prefill chunks, pending decode tokens and drafts.
const TOKEN_BUDGET: usize = 96;
/// Sequences one step runs (the batch dimension of the captured buffers).
const MAX_BATCH: usize = 32;
/// Longest sequence, in tokens (the manager refuses longer ones).
const MAX_SEQ_LEN: usize = 256;
/// Most drafts per decode step the buffers are sized for.
const MAX_SPEC_K: usize = 8;
/// Blocks the manager keeps free at admission so running sequences can grow.
const WATERMARK_BLOCKS: usize = 2;
/// A run that has not finished after this many steps is stuck: fail loudly.
const MAX_STEPS: u64 = 100_000;
/// Samples per request fit in the low bits of a sequence id.
const SAMPLE_BITS: u32 = 3;

/// One request of the trace.
#[derive(Debug, Clone)]
struct Request {
    id: u64,
    arrival_step: u64,
    prompt: Vec<u32>,
    max_new_tokens: usize,
    /// Parallel samples (`n`): forks of the prompt once it is computed.
    samples: usize,
    /// The client cancels part-way.
    abort: Option<Abort>,
}

/// A cancellation: the client disconnects at step `at_step`, having read the first
/// `after_tokens` tokens of every sample. It is acted on once both hold (the engine
/// waits for a slow sample to reach `after_tokens`), so what the client read is the
/// same under every schedule and the three runs stay comparable; the step makes it
/// land wherever the sequences are then: running, swapped out or waiting to be
/// recomputed.
#[derive(Debug, Clone, Copy)]
struct Abort {
    after_tokens: usize,
    at_step: u64,
}

fn random_tokens(rng: &mut SplitMix64, len: usize, vocab: u32) -> Vec<u32> {
    (0..len)
        .map(|_| rng.below(u64::from(vocab)) as u32)
        .collect()
}

/// A fixed-seed trace: most prompts start with one of two system prompts (prefix cache),
/// a quarter sample 2 or 3 outputs, some are cancelled part-way.
fn make_trace(requests: usize, seed: u64, vocab: u32) -> Vec<Request> {
    let mut rng = SplitMix64::new(seed);
    let systems = [
        random_tokens(&mut rng, 40, vocab),
        random_tokens(&mut rng, 57, vocab),
    ];
    let mut arrival_step = 0;
    (0..requests as u64)
        .map(|id| {
            arrival_step += rng.below(3);
            let mut prompt = Vec::new();
            if rng.next_f32() < 0.6 {
                prompt.extend_from_slice(&systems[rng.below(2) as usize]);
            }
            let user_len = 6 + rng.below(40) as usize;
            prompt.extend(random_tokens(&mut rng, user_len, vocab));
            let max_new_tokens = 12 + rng.below(36) as usize;
            let samples = if rng.next_f32() < 0.25 {
                2 + rng.below(2) as usize
            } else {
                1
            };
            let abort = (rng.next_f32() < 0.15).then(|| Abort {
                after_tokens: 3 + rng.below(max_new_tokens as u64 - 6) as usize,
                at_step: arrival_step + rng.below(60),
            });
            Request {
                id,
                arrival_step,
                prompt,
                max_new_tokens,
                samples,
                abort,
            }
        })
        .collect()
}

fn seq_id(req: usize, sample: usize) -> SeqId {
    SeqId(((req as u64) << SAMPLE_BITS) | sample as u64)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The sampler: sample 0 is greedy; the other samples of a request take a token drawn
/// from (request, sample, position) at their first position and at one position in
/// four, the target's argmax elsewhere. It stands in for seeded sampling and is a pure
/// function of the argmax and the position, so speculation's accept test (draft ==
/// sampled token) gives exactly the tokens decoding without drafts gives.
fn sample_token(argmax: u32, req: &Request, sample: usize, pos: usize, vocab: u32) -> u32 {
    if sample == 0 {
        return argmax;
    }
    let h = mix(req.id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (sample as u64) << 40 ^ pos as u64);
    if pos == req.prompt.len() || h.is_multiple_of(4) {
        (h >> 8) as u32 % vocab
    } else {
        argmax
    }
}

/// The toy drafter: prompt lookup (vLLM's n-gram speculator). Proposes the `k` tokens
/// that followed the latest earlier occurrence of the context's last two tokens, or a
/// hash of the last token when there is none. Cheap and deterministic.
fn draft(context: &[u32], k: usize, vocab: u32, out: &mut Vec<u32>) {
    let n = context.len();
    let found = (n >= 3)
        .then(|| {
            (1..n - 1)
                .rev()
                .find(|&j| context[j - 1..=j] == context[n - 2..])
        })
        .flatten();
    for i in 0..k {
        let t = match found {
            Some(j) if j + 1 + i < n => context[j + 1 + i],
            _ => (mix(u64::from(context[n - 1]) + i as u64) % u64::from(vocab)) as u32,
        };
        out.push(t);
    }
}

/// One configuration of the engine.
#[derive(Debug, Clone, Copy)]
struct RunConfig {
    name: &'static str,
    num_blocks: usize,
    host_blocks: usize,
    /// Drafts per decode step (0: speculation off).
    spec_k: usize,
}

/// The engine's side of a sequence (the manager holds its blocks and computed count).
#[derive(Debug, Clone)]
struct SeqState {
    req: usize,
    sample: usize,
    /// Prompt, then generated ids. While decoding, the last one is *pending*: sampled,
    /// its K/V not computed yet (it is the first query token of the next step).
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Leading ids the manager knows (`admit_prompt`, then `add_token_ids`): only full
    /// computed blocks of known ids are registered in the prefix cache.
    ids_known: usize,
    /// False once the manager stopped registering it (a duplicate block, a swap-in).
    registering: bool,
    done: bool,
}

impl SeqState {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// A sequence's share of one step.
#[derive(Debug, Clone, Copy)]
struct Scheduled {
    seq: SeqId,
    /// Query tokens: known tokens not computed yet, then `drafts` drafts.
    n: usize,
    drafts: usize,
    /// Where its drafts start in [`StepBuffers::drafts`].
    draft_start: usize,
    /// Slots allocated after the query for the next step's drafts (never context).
    lookahead: usize,
}

/// What waits for admission: a new request, or a sequence preempted for recompute
/// (re-admitted with its prompt and the ids it generated so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    New(usize),
    Readmit(SeqId),
}

/// Every per-step buffer of the batch, allocated once at a fixed capacity and reused
/// every step. This is what a CUDA-graph engine does: the captured graph reads its
/// inputs (ids, positions, slot mapping, block tables, context lengths) from tensors
/// at fixed addresses, and each step only writes into them. [`Engine::capacities`] is
/// checked after every step: no buffer may grow.
///
/// TinyModel itself still allocates its activations (and `next_tokens` its logits) on
/// every call; a CUDA engine's model would run from the graph's memory pool.
struct StepBuffers {
    plan: Vec<Scheduled>,
    seqs: Vec<SeqId>,
    query_start_loc: Vec<usize>,
    input_ids: Vec<u32>,
    /// The slots `reserve` handed out for the query tokens, in batch order (the input of
    /// a `reshape_and_cache` kernel).
    slot_mapping: Vec<Slot>,
    /// One `reserve` call's slots.
    slots: Vec<Slot>,
    /// The plan as `blocks_needed_batch` reads it: `(seq, n, lookahead)` per entry.
    need: Vec<(SeqId, usize, usize)>,
    /// The running sequences' part of the plan, by handle, for `reserve_step`.
    entries: Vec<StepEntry>,
    /// What `reserve_step` fills for them.
    step: pagedkv::StepBuffers,
    drafts: Vec<u32>,
    tables: PaddedTables,
    hidden_in: Vec<f32>,
    hidden_out: Vec<f32>,
    /// The hidden rows that are sampled (vLLM's `logits_indices`).
    sample_hidden: Vec<f32>,
    /// Copy-on-write copies of the step (`CopyPlan` has no capacity API; it keeps the
    /// capacity it grew to).
    copies: CopyPlan,
}

impl StepBuffers {
    fn new(hidden: usize, max_blocks_per_seq: usize) -> Self {
        StepBuffers {
            plan: Vec::with_capacity(MAX_BATCH),
            seqs: Vec::with_capacity(MAX_BATCH),
            query_start_loc: Vec::with_capacity(MAX_BATCH + 1),
            input_ids: Vec::with_capacity(TOKEN_BUDGET),
            slot_mapping: Vec::with_capacity(TOKEN_BUDGET),
            slots: Vec::with_capacity(TOKEN_BUDGET + MAX_SPEC_K),
            need: Vec::with_capacity(MAX_BATCH),
            entries: Vec::with_capacity(MAX_BATCH),
            step: pagedkv::StepBuffers::new(MAX_BATCH, TOKEN_BUDGET, max_blocks_per_seq),
            drafts: Vec::with_capacity(TOKEN_BUDGET),
            tables: PaddedTables {
                tables: Vec::with_capacity(MAX_BATCH * max_blocks_per_seq),
                context_lens: Vec::with_capacity(MAX_BATCH),
                batch: 0,
                max_blocks: 0,
            },
            hidden_in: vec![0.0; TOKEN_BUDGET * hidden],
            hidden_out: vec![0.0; TOKEN_BUDGET * hidden],
            sample_hidden: vec![0.0; TOKEN_BUDGET * hidden],
            copies: CopyPlan::new(),
        }
    }
}

/// Counters of one run.
#[derive(Debug, Default, Clone)]
struct RunStats {
    steps: u64,
    prompt_tokens: usize,
    computed_tokens: usize,
    generated_tokens: usize,
    drafts_proposed: usize,
    drafts_accepted: usize,
    forks: usize,
    cow_copies: usize,
    swap_outs: usize,
    swap_ins: usize,
    recomputes: usize,
    recomputes_host_full: usize,
    recomputed_tokens: usize,
    readmissions: usize,
    /// Re-admissions that joined a sibling's fork group again.
    rejoined: usize,
    readmitted_cached_tokens: usize,
    batch_trimmed: usize,
    aborted_requests: usize,
    aborted_live_seqs: usize,
    aborted_swapped_seqs: usize,
    aborted_waiting_seqs: usize,
    prefix_hit_rate: f64,
    prefix_hit_tokens: u64,
    prefix_query_tokens: u64,
    peak_used_blocks: usize,
    num_blocks: usize,
    wall_seconds: f64,
}

/// Generated ids of every request, by sample (truncated where the client cancelled).
type Outputs = Vec<Vec<Vec<u32>>>;

struct Engine<'a> {
    cfg: RunConfig,
    model: &'a TinyModel,
    trace: &'a [Request],
    kv: KvCache,
    store: HostStorage,
    policy: PreemptPolicy,
    seqs: HashMap<SeqId, SeqState>,
    /// Resident sequences, oldest admission first.
    running: Vec<SeqId>,
    /// Swapped-out fork groups, oldest first.
    swapped: VecDeque<Vec<SeqId>>,
    waiting: VecDeque<Waiting>,
    forked: Vec<bool>,
    finished: Vec<bool>,
    next_arrival: usize,
    step: u64,
    hit: PrefixHit,
    buf: StepBuffers,
    capacities_at_start: [usize; NUM_CAPACITIES],
    stats: RunStats,
}

/// Buffers whose capacity [`Engine::capacities`] watches.
const NUM_CAPACITIES: usize = 13;

impl<'a> Engine<'a> {
    fn new(
        cfg: RunConfig,
        model: &'a TinyModel,
        trace: &'a [Request],
        block_size: usize,
    ) -> pagedkv::Result<Self> {
        let layout = KvLayout::new(*model.shape(), block_size)?;
        let store = HostStorage::with_host_tier(layout, cfg.num_blocks, cfg.host_blocks)?;
        // The host tier's size is given once, to the storage; the manager's comes from it.
        let kv = KvCache::builder(layout)
            .num_blocks(cfg.num_blocks)
            .watermark_blocks(WATERMARK_BLOCKS)
            .max_seq_len_tokens(MAX_SEQ_LEN)
            .tiers(TierConfig::for_storage(&store))
            .build()?;
        // Fixed figures rather than a probe, so that every run decides the same way: a
        // PCIe-class link and a modest prefill rate make swapping the cheaper choice
        // until the (small) host tier is full; then the manager recomputes.
        let policy = PreemptPolicy::cost_based(CostModel::new(8e9, 20_000.0)?);
        let buf = StepBuffers::new(model.hidden_size(), MAX_SEQ_LEN.div_ceil(block_size));
        let mut engine = Engine {
            cfg,
            model,
            trace,
            kv,
            store,
            policy,
            seqs: HashMap::new(),
            running: Vec::with_capacity(MAX_BATCH),
            swapped: VecDeque::new(),
            waiting: VecDeque::new(),
            forked: vec![false; trace.len()],
            finished: vec![false; trace.len()],
            next_arrival: 0,
            step: 0,
            hit: PrefixHit::default(),
            buf,
            capacities_at_start: [0; NUM_CAPACITIES],
            stats: RunStats::default(),
        };
        engine.capacities_at_start = engine.capacities();
        Ok(engine)
    }

    fn vocab(&self) -> u32 {
        self.model.vocab_size() as u32
    }

    /// Rows of the batch `seq` will take: its own, plus its forks-to-be when it is a
    /// prompt not computed yet of a request with `n > 1`.
    fn batch_slots(&self, seq: SeqId) -> usize {
        let s = &self.seqs[&seq];
        if s.sample == 0 && !self.forked[s.req] {
            self.trace[s.req].samples
        } else {
            1
        }
    }

    /// Rows the running sequences will take, forks-to-be included.
    fn rows_promised(&self) -> usize {
        self.running.iter().map(|&s| self.batch_slots(s)).sum()
    }

    fn capacities(&self) -> [usize; NUM_CAPACITIES] {
        let b = &self.buf;
        [
            b.plan.capacity(),
            b.seqs.capacity(),
            b.query_start_loc.capacity(),
            b.input_ids.capacity(),
            b.slot_mapping.capacity(),
            b.slots.capacity(),
            b.drafts.capacity(),
            b.tables.tables.capacity(),
            b.tables.context_lens.capacity(),
            b.hidden_in.capacity(),
            b.hidden_out.capacity(),
            b.sample_hidden.capacity(),
            self.running.capacity(),
        ]
    }

    fn run(mut self) -> pagedkv::Result<(Outputs, RunStats)> {
        let start = Instant::now();
        while self.finished.iter().any(|f| !f) {
            if self.step == MAX_STEPS {
                return Err(Error::Unsupported(format!(
                    "{}: no progress after {MAX_STEPS} steps",
                    self.cfg.name
                )));
            }
            self.step()?;
        }
        self.kv
            .check_invariants()
            .map_err(Error::CorruptBlockTable)?;
        let kv_stats = self.kv.stats();
        assert_eq!(kv_stats.used_blocks, 0, "every sequence was freed");
        assert_eq!(
            self.kv.tier_stats().swapped_sequences,
            0,
            "nothing left on the host"
        );
        let prefix = self.kv.prefix_stats();
        let tiers = self.kv.tier_stats();
        let s = &mut self.stats;
        s.steps = self.step;
        s.prefix_hit_rate = prefix.hit_rate();
        s.prefix_hit_tokens = prefix.hit_tokens;
        s.prefix_query_tokens = prefix.query_tokens;
        s.peak_used_blocks = kv_stats.peak_used_blocks;
        s.num_blocks = kv_stats.num_blocks;
        assert_eq!(tiers.preempt_swaps as usize, s.swap_outs);
        assert_eq!(tiers.preempt_recomputes as usize, s.recomputes);
        s.wall_seconds = start.elapsed().as_secs_f64();

        let outputs = (0..self.trace.len())
            .map(|r| {
                let req = &self.trace[r];
                (0..req.samples)
                    .map(|sample| {
                        let s = &self.seqs[&seq_id(r, sample)];
                        let mut out = s.tokens[s.prompt_len..].to_vec();
                        // The client read `after_tokens` of every sample, whether the
                        // cancellation or the end of the request came first.
                        if let Some(a) = req.abort {
                            out.truncate(a.after_tokens);
                        }
                        out
                    })
                    .collect()
            })
            .collect();
        Ok((outputs, self.stats))
    }

    fn step(&mut self) -> pagedkv::Result<()> {
        while let Some(r) = self.trace.get(self.next_arrival) {
            if r.arrival_step > self.step {
                break;
            }
            self.waiting.push_back(Waiting::New(self.next_arrival));
            self.next_arrival += 1;
        }
        self.swap_in_ready()?;
        self.schedule_running()?;
        self.reserve_running()?;
        self.admit_waiting()?;
        if !self.buf.plan.is_empty() {
            self.forward()?;
            self.commit_and_sample()?;
        }
        self.retire()?;
        self.abort_due()?;
        let now = self.capacities();
        assert_eq!(
            now, self.capacities_at_start,
            "a step buffer grew: the fixed-capacity buffers must be sized for the worst step"
        );
        self.step += 1;
        Ok(())
    }

    /// Brings swapped-out groups back, oldest first, while they fit with room to grow
    /// (or unconditionally when nothing runs, so a lone group cannot wait forever).
    fn swap_in_ready(&mut self) -> pagedkv::Result<()> {
        while let Some(group) = self.swapped.front() {
            if self.rows_promised() + group.iter().map(|&s| self.batch_slots(s)).sum::<usize>()
                > MAX_BATCH
            {
                return Ok(());
            }
            let mut blocks = 0;
            for &seq in group {
                blocks += self.kv.swapped_table(seq)?.len();
            }
            let headroom = self.kv.config().watermark_blocks + self.running.len() + group.len();
            if !self.running.is_empty() && self.kv.num_available_blocks() < blocks + headroom {
                return Ok(());
            }
            let job = match self.kv.swap_in_group(group) {
                Ok(job) => job,
                Err(Error::OutOfBlocks { .. }) => return Ok(()),
                Err(e) => return Err(e),
            };
            self.store.swap(&job.plan)?;
            self.kv.complete_swap(job.ticket)?;
            self.stats.swap_ins += 1;
            if let Some(group) = self.swapped.pop_front() {
                self.running.extend(group);
            }
        }
        Ok(())
    }

    /// Chooses each running sequence's query for this step under the token budget, then
    /// makes sure the whole step fits, preempting before any slot is handed out.
    fn schedule_running(&mut self) -> pagedkv::Result<()> {
        let vocab = self.vocab();
        let b = &mut self.buf;
        b.plan.clear();
        b.drafts.clear();
        let mut budget = TOKEN_BUDGET;
        // Decodes first (latency): the pending token (or a prompt's last one, left by
        // chunking) plus up to `spec_k` drafts, never more than the tokens the request
        // may still generate.
        for &seq in &self.running {
            let s = &self.seqs[&seq];
            let computed = self.kv.num_computed_tokens(seq)?;
            if s.tokens.len() - computed != 1 || budget == 0 {
                continue;
            }
            // No drafts for the last prompt token: its row samples the first token
            // alone, the one forks for parallel sampling start from.
            let remaining = self.trace[s.req].max_new_tokens - s.generated();
            let k = match s.generated() {
                0 => 0,
                _ => self.cfg.spec_k.min(remaining - 1).min(budget - 1),
            };
            let draft_start = b.drafts.len();
            draft(&s.tokens, k, vocab, &mut b.drafts);
            budget -= 1 + k;
            b.plan.push(Scheduled {
                seq,
                n: 1 + k,
                drafts: k,
                draft_start,
                lookahead: self.cfg.spec_k,
            });
        }
        // Then prefill chunks, oldest first.
        for &seq in &self.running {
            let uncomputed = self.seqs[&seq].tokens.len() - self.kv.num_computed_tokens(seq)?;
            if uncomputed <= 1 || budget == 0 {
                continue;
            }
            let n = uncomputed.min(budget);
            budget -= n;
            b.plan.push(Scheduled {
                seq,
                n,
                drafts: 0,
                draft_start: 0,
                lookahead: 0,
            });
        }
        loop {
            // The whole need of the step, as the manager counts it (new blocks, copies
            // of shared blocks written into, lookahead), not the shortfall. One batch
            // count, not a sum of `blocks_needed`: fork siblings sharing a last block
            // take one copy fewer than their number (the last writes in place).
            let b = &mut self.buf;
            b.need.clear();
            b.need
                .extend(b.plan.iter().map(|e| (e.seq, e.n, e.lookahead)));
            let need = self.kv.blocks_needed_batch(&b.need)?;
            if need <= self.kv.num_available_blocks() {
                return Ok(());
            }
            match self.kv.preempt_for(need, &self.policy) {
                Ok(preempted) if preempted.is_empty() => {
                    return Err(Error::Unsupported(format!(
                        "preempt_for({need}) preempted nothing with {} available",
                        self.kv.num_available_blocks()
                    )))
                }
                Ok(preempted) => {
                    for p in preempted {
                        self.apply_preemption(p)?;
                    }
                }
                Err(Error::OutOfBlocks { .. }) => {
                    // Even preempting every other group would not free enough: run one
                    // sequence fewer this step (the newest; its drafts stay unused).
                    if self.buf.plan.pop().is_none() {
                        return Err(Error::Unsupported(
                            "the arena cannot hold the oldest sequence".into(),
                        ));
                    }
                    self.stats.batch_trimmed += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn apply_preemption(&mut self, p: Preemption) -> pagedkv::Result<()> {
        let victims = p.seqs;
        self.running.retain(|s| !victims.contains(s));
        self.buf.plan.retain(|e| !victims.contains(&e.seq));
        match p.action {
            PreemptAction::Swap(job) => {
                // Synchronous here; an engine with a copy stream would overlap it and
                // call `complete_swap` when the transfer lands.
                self.store.swap(&job.plan)?;
                self.kv.complete_swap(job.ticket)?;
                self.stats.swap_outs += 1;
                self.swapped.push_back(victims);
            }
            PreemptAction::SwapGroups(job) => {
                // A hybrid cache's swap: one plan per KV-cache group.
                for plan in &job.plans {
                    self.store.swap(plan)?;
                }
                self.kv.complete_swap_grouped(&job)?;
                self.stats.swap_outs += 1;
                self.swapped.push_back(victims);
            }
            PreemptAction::Recompute { tokens } => {
                self.stats.recomputes += 1;
                self.stats.recomputed_tokens += tokens.iter().map(|t| t.1).sum::<usize>();
                if p.reason == PreemptReason::HostTierFull {
                    self.stats.recomputes_host_full += 1;
                }
                // Back to the head of the queue, oldest first; re-admitted with their
                // prompt and generated ids (the prefix cache may still hold part).
                for &seq in victims.iter().rev() {
                    self.waiting.push_front(Waiting::Readmit(seq));
                }
            }
        }
        Ok(())
    }

    /// Reserves every scheduled running sequence in one call (the whole step was
    /// checked to fit): their query slots start the step's slot mapping, their
    /// copy-on-write copies its copy plan. An engine keeps each sequence's handle
    /// from admission or swap-in; this one looks them up each step for brevity.
    fn reserve_running(&mut self) -> pagedkv::Result<()> {
        let b = &mut self.buf;
        b.entries.clear();
        for e in &b.plan {
            b.entries.push(StepEntry {
                seq: self.kv.handle(e.seq)?,
                new_tokens: e.n,
                lookahead: e.lookahead,
            });
        }
        self.kv.reserve_step(&b.entries, &mut b.step)?;
        b.slot_mapping.clear();
        b.slot_mapping
            .extend(b.step.slot_mapping().iter().map(|&s| Slot(s as u64)));
        b.copies.clear();
        for c in b.step.copies().copies() {
            b.copies.push(c.src, c.dst);
        }
        Ok(())
    }

    /// Reserves the slots of plan entry `i` (an admission): its query tokens, then
    /// its lookahead.
    fn reserve_scheduled(&mut self, i: usize) -> pagedkv::Result<()> {
        let e = self.buf.plan[i];
        self.kv.reserve(
            e.seq,
            e.n,
            e.lookahead,
            &mut self.buf.slots,
            &mut self.buf.copies,
        )?;
        self.buf
            .slot_mapping
            .extend_from_slice(&self.buf.slots[..e.n]);
        Ok(())
    }

    /// Tells the manager the ids sampled for `seq` since it last heard (drafts never:
    /// they may be rejected). Their blocks are registered once full and computed.
    fn record_ids(&mut self, seq: SeqId) -> pagedkv::Result<()> {
        let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
        if !s.registering || s.ids_known == s.tokens.len() {
            return Ok(());
        }
        match self
            .kv
            .add_token_ids(seq, s.ids_known, &s.tokens[s.ids_known..])
        {
            Ok(_) => s.ids_known = s.tokens.len(),
            // The manager stopped registering this sequence (a swap-in, a duplicate
            // block); it keeps its blocks, they are just not shared.
            Err(Error::SequenceState { .. }) => s.registering = false,
            Err(err) => return Err(err),
        }
        Ok(())
    }

    /// Admits waiting requests with the budget the running sequences left, in order;
    /// the head of the queue blocks the rest, and swapped-out groups go first.
    fn admit_waiting(&mut self) -> pagedkv::Result<()> {
        let trace = self.trace;
        let mut budget = TOKEN_BUDGET - self.buf.plan.iter().map(|e| e.n).sum::<usize>();
        while budget > 0 && self.swapped.is_empty() {
            let Some(&w) = self.waiting.front() else {
                break;
            };
            let (seq, width) = match w {
                Waiting::New(r) => (seq_id(r, 0), trace[r].samples),
                Waiting::Readmit(seq) => (seq, self.batch_slots(seq)),
            };
            if self.rows_promised() + width > MAX_BATCH {
                break;
            }
            let tokens: &[u32] = match w {
                Waiting::New(r) => &trace[r].prompt,
                Waiting::Readmit(seq) => &self.seqs[&seq].tokens,
            };
            self.kv
                .lookup_prefix(tokens, &AdmitOptions::default(), &mut self.hit)?;
            if !self.kv.can_admit_hit(&self.hit) {
                break;
            }
            let admission = self.kv.admit_prompt(seq, tokens, &self.hit)?;
            let n = (tokens.len() - admission.cached_tokens).min(budget);
            let len = tokens.len();
            self.waiting.pop_front();
            match w {
                Waiting::New(r) => {
                    self.stats.prompt_tokens += len;
                    self.seqs.insert(
                        seq,
                        SeqState {
                            req: r,
                            sample: 0,
                            tokens: trace[r].prompt.clone(),
                            prompt_len: len,
                            ids_known: len,
                            registering: true,
                            done: false,
                        },
                    );
                }
                Waiting::Readmit(seq) => {
                    self.stats.readmissions += 1;
                    self.stats.readmitted_cached_tokens += admission.cached_tokens;
                    let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
                    s.ids_known = len;
                    s.registering = true;
                    // Re-admitted alone it would be a fork group of its own: join a
                    // sibling the manager still holds, so that preemption keeps the
                    // request's samples together again.
                    let req = s.req;
                    let sibling = self
                        .seqs
                        .iter()
                        .filter(|&(&id, st)| id != seq && st.req == req && !st.done)
                        .map(|(&id, _)| id)
                        .find(|&id| self.kv.num_tokens(id).is_ok());
                    if let Some(sibling) = sibling {
                        self.kv.join_fork_group(seq, sibling)?;
                        self.stats.rejoined += 1;
                    }
                }
            }
            self.running.push(seq);
            self.buf.plan.push(Scheduled {
                seq,
                n,
                drafts: 0,
                draft_start: 0,
                lookahead: 0,
            });
            // Cannot fail: `can_admit_hit` counted the whole prompt plus the watermark.
            self.reserve_scheduled(self.buf.plan.len() - 1)?;
            budget -= n;
        }
        Ok(())
    }

    /// Copy-on-write, then one forward pass over the batch; leaves the sampled rows'
    /// argmax for [`Self::commit_and_sample`] in `self.buf` order.
    fn forward(&mut self) -> pagedkv::Result<()> {
        let b = &mut self.buf;
        b.seqs.clear();
        b.input_ids.clear();
        b.query_start_loc.clear();
        b.query_start_loc.push(0);
        for e in &b.plan {
            let s = &self.seqs[&e.seq];
            let computed = self.kv.num_computed_tokens(e.seq)?;
            let known = e.n - e.drafts;
            b.input_ids
                .extend_from_slice(&s.tokens[computed..computed + known]);
            b.input_ids
                .extend_from_slice(&b.drafts[e.draft_start..e.draft_start + e.drafts]);
            b.seqs.push(e.seq);
            b.query_start_loc.push(b.input_ids.len());
        }
        // Copies first: a reservation that writes into a shared block got a fresh block
        // whose computed part must be copied before the model writes the rest.
        self.store.copy_blocks(&b.copies)?;
        self.stats.cow_copies += b.copies.len();
        self.kv.fill_padded(&b.seqs, &mut b.tables)?;
        // The rows `reserve_step` wrote (reused where they did not change) are the
        // tables of the running sequences, zero past their blocks.
        for i in 0..b.entries.len() {
            let (want, got) = (b.tables.row(i), b.step.tables().row(i));
            let (head, tail) = got.split_at(want.len());
            if head != want || tail.iter().any(|&x| x != 0) {
                return Err(Error::CorruptBlockTable(format!(
                    "row {i}: reserve_step wrote {got:?}, fill_padded {want:?}"
                )));
            }
        }
        check_slot_mapping(
            self.store.layout(),
            &b.tables,
            &b.query_start_loc,
            &b.slot_mapping,
        )?;
        let h = self.model.hidden_size();
        let t = b.input_ids.len();
        self.model.embed(&b.input_ids, &mut b.hidden_in[..t * h])?;
        // Decode rows go through the prefill path too: TinyModel's decode is the same,
        // bit for bit, as a prefill of one token, and one ragged batch serves both.
        self.model.prefill(
            &mut self.store,
            &b.tables,
            &b.query_start_loc,
            &b.hidden_in[..t * h],
            &mut b.hidden_out[..t * h],
        )?;
        self.stats.computed_tokens += t;
        Ok(())
    }

    /// Samples, verifies drafts and commits what was accepted; forks samples of a
    /// request whose prompt just finished.
    fn commit_and_sample(&mut self) -> pagedkv::Result<()> {
        let h = self.model.hidden_size();
        let vocab = self.vocab();
        // Gather the rows to sample: every row of a decode (the pending token and each
        // draft), the last row of a prefill chunk that reaches the end of the prompt.
        let mut rows = 0;
        for (i, e) in self.buf.plan.iter().enumerate() {
            let computed = self.kv.num_computed_tokens(e.seq)?;
            let end = self.buf.query_start_loc[i + 1];
            let sampled = if computed + e.n - e.drafts == self.seqs[&e.seq].tokens.len() {
                1 + e.drafts
            } else {
                0
            };
            for row in end - sampled..end {
                self.buf.sample_hidden[rows * h..(rows + 1) * h]
                    .copy_from_slice(&self.buf.hidden_out[row * h..(row + 1) * h]);
                rows += 1;
            }
        }
        let argmax = self.model.next_tokens(&self.buf.sample_hidden[..rows * h]);
        let mut next = 0;
        for i in 0..self.buf.plan.len() {
            let e = self.buf.plan[i];
            let known = e.n - e.drafts;
            let s = self
                .seqs
                .get_mut(&e.seq)
                .ok_or(Error::UnknownSequence(e.seq))?;
            let computed = self.kv.num_computed_tokens(e.seq)?;
            if computed + known < s.tokens.len() {
                // A prefill chunk short of the end: nothing to sample.
                self.kv.commit(e.seq, e.n)?;
                continue;
            }
            let req = &self.trace[s.req];
            let rows = &argmax[next..next + 1 + e.drafts];
            next += 1 + e.drafts;
            // Row j predicts the token after query token j. Accept drafts while each
            // equals what the sampler takes from the row before it; the first mismatch
            // (or the last row) gives one more token of the target's own.
            let drafts = &self.buf.drafts[e.draft_start..e.draft_start + e.drafts];
            let mut accepted = 0;
            loop {
                let pos = s.tokens.len();
                let t = sample_token(rows[accepted], req, s.sample, pos, vocab);
                s.tokens.push(t);
                if accepted == e.drafts || drafts[accepted] != t {
                    break;
                }
                accepted += 1;
            }
            // The pending token and the accepted drafts are computed; the rejected
            // drafts' slots are simply reserved again next step.
            self.kv.commit(e.seq, known + accepted)?;
            self.stats.drafts_proposed += e.drafts;
            self.stats.drafts_accepted += accepted;
            self.stats.generated_tokens += accepted + 1;
            let (r, first_token) = (s.req, s.generated() == 1);
            self.record_ids(e.seq)?;
            if first_token && req.samples > 1 && !self.forked[r] {
                self.fork_samples(e.seq, rows[0])?;
            }
        }
        Ok(())
    }

    /// Parallel sampling: the prompt of `parent` is computed, so its blocks are shared
    /// by `samples - 1` forks; each takes its own first token from the same last row.
    fn fork_samples(&mut self, parent: SeqId, argmax: u32) -> pagedkv::Result<()> {
        let p = self.seqs[&parent].clone();
        let req = &self.trace[p.req];
        self.forked[p.req] = true;
        for sample in 1..req.samples {
            let child = seq_id(p.req, sample);
            self.kv.fork(parent, child)?;
            let mut tokens = req.prompt.clone();
            tokens.push(sample_token(
                argmax,
                req,
                sample,
                req.prompt.len(),
                self.vocab(),
            ));
            self.seqs.insert(
                child,
                SeqState {
                    sample,
                    tokens,
                    ids_known: p.prompt_len,
                    ..p.clone()
                },
            );
            self.record_ids(child)?;
            self.running.push(child);
            self.stats.forks += 1;
            self.stats.generated_tokens += 1;
        }
        Ok(())
    }

    /// Frees sequences that generated all their tokens.
    fn retire(&mut self) -> pagedkv::Result<()> {
        let mut i = 0;
        while i < self.running.len() {
            let seq = self.running[i];
            let s = self.seqs.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
            if s.generated() < self.trace[s.req].max_new_tokens {
                i += 1;
                continue;
            }
            s.done = true;
            let r = s.req;
            self.kv.free(seq)?;
            self.running.remove(i);
            self.finished[r] = (0..self.trace[r].samples)
                .all(|sample| self.seqs.get(&seq_id(r, sample)).is_some_and(|s| s.done));
        }
        Ok(())
    }

    /// Cancels requests whose client went away (see [`Abort`]): each live sample is
    /// freed wherever it is (running, swapped out, or waiting to be recomputed).
    fn abort_due(&mut self) -> pagedkv::Result<()> {
        for r in 0..self.trace.len() {
            let req = &self.trace[r];
            let Some(Abort {
                after_tokens,
                at_step,
            }) = req.abort
            else {
                continue;
            };
            if self.finished[r] || self.step < at_step {
                continue;
            }
            let all_streamed = (0..req.samples).all(|sample| {
                self.seqs
                    .get(&seq_id(r, sample))
                    .is_some_and(|s| s.generated() >= after_tokens)
            });
            if !all_streamed {
                continue;
            }
            for sample in 0..req.samples {
                let seq = seq_id(r, sample);
                let Some(s) = self.seqs.get_mut(&seq) else {
                    continue;
                };
                if s.done {
                    continue;
                }
                s.done = true;
                if self.kv.is_swapped(seq) {
                    self.stats.aborted_swapped_seqs += 1;
                } else if !self.kv.contains(seq) {
                    self.stats.aborted_waiting_seqs += 1;
                }
                if self.kv.contains(seq) {
                    // Resident or swapped out: `free` releases device or host blocks.
                    self.kv.free(seq)?;
                    self.stats.aborted_live_seqs += 1;
                }
                self.running.retain(|&x| x != seq);
                self.waiting.retain(|&w| w != Waiting::Readmit(seq));
                for group in &mut self.swapped {
                    group.retain(|&x| x != seq);
                }
            }
            self.swapped.retain(|g| !g.is_empty());
            self.finished[r] = true;
            self.stats.aborted_requests += 1;
        }
        Ok(())
    }
}

/// The slots `reserve` handed out are where the query tokens' K/V goes: position `p` of
/// row `i` lives at `table[p / block_size] * block_size + p % block_size`, the last
/// `n` positions of the context. A CUDA engine passes `slot_mapping` to its
/// `reshape_and_cache` kernel; TinyModel derives the slots from the tables, so this
/// checks that both agree.
fn check_slot_mapping(
    layout: &KvLayout,
    tables: &PaddedTables,
    query_start_loc: &[usize],
    slot_mapping: &[Slot],
) -> pagedkv::Result<()> {
    let bs = layout.block_size();
    for i in 0..tables.batch {
        let ctx = tables.context_lens[i] as usize;
        let (start, end) = (query_start_loc[i], query_start_loc[i + 1]);
        for (j, &got) in slot_mapping[start..end].iter().enumerate() {
            let p = ctx - (end - start) + j;
            let want = layout.slot(BlockId(tables.row(i)[p / bs]), p % bs);
            if got != want {
                return Err(Error::CorruptBlockTable(format!(
                    "row {i} position {p}: reserve gave slot {} but the table says {}",
                    got.0, want.0
                )));
            }
        }
    }
    Ok(())
}

fn print_summary(cfg: &RunConfig, s: &RunStats) {
    let pct = |a: f64, b: f64| if b == 0.0 { 0.0 } else { 100.0 * a / b };
    println!("{}", cfg.name);
    println!(
        "  {} steps in {:.2} s; tokens: {} prompt, {} computed, {} generated; peak {} of {} blocks",
        s.steps,
        s.wall_seconds,
        s.prompt_tokens,
        s.computed_tokens,
        s.generated_tokens,
        s.peak_used_blocks,
        s.num_blocks
    );
    println!(
        "  prefix cache: {:.1} % of admitted tokens hit, re-admissions included ({} of {}); {} forks, {} CoW copies",
        100.0 * s.prefix_hit_rate,
        s.prefix_hit_tokens,
        s.prefix_query_tokens,
        s.forks,
        s.cow_copies
    );
    println!(
        "  drafts: {} proposed, {} accepted ({:.1} %)",
        s.drafts_proposed,
        s.drafts_accepted,
        pct(s.drafts_accepted as f64, s.drafts_proposed as f64)
    );
    println!(
        "  preemptions: {} by swap ({} swapped back in), {} by recompute ({} with the host tier full; \
         {} computed tokens dropped, {} re-admissions got {} tokens from the prefix cache, \
         {} joined a sibling's fork group); batch trimmed {} times",
        s.swap_outs,
        s.swap_ins,
        s.recomputes,
        s.recomputes_host_full,
        s.recomputed_tokens,
        s.readmissions,
        s.readmitted_cached_tokens,
        s.rejoined,
        s.batch_trimmed
    );
    println!(
        "  aborts: {} requests; freed {} live sequences ({} of them swapped out), dropped {} waiting for recompute",
        s.aborted_requests, s.aborted_live_seqs, s.aborted_swapped_seqs, s.aborted_waiting_seqs
    );
}

/// The first request whose outputs differ between two runs.
fn first_difference(trace: &[Request], a: &Outputs, b: &Outputs) -> Option<String> {
    for (r, req) in trace.iter().enumerate() {
        for sample in 0..req.samples {
            let (x, y) = (&a[r][sample], &b[r][sample]);
            if x != y {
                let at = x
                    .iter()
                    .zip(y)
                    .position(|(p, q)| p != q)
                    .unwrap_or(x.len().min(y.len()));
                return Some(format!(
                    "request {} sample {sample}: {} vs {} tokens, first difference at generated token {at}",
                    req.id,
                    x.len(),
                    y.len()
                ));
            }
        }
    }
    None
}

fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.spec_k > MAX_SPEC_K {
        return Err(format!("--spec-k is at most {MAX_SPEC_K}").into());
    }
    let requests = if args.quick { 12 } else { args.requests };
    let shape = ModelShape {
        num_layers: 2,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 32,
        kv_dtype: DType::F16,
    };
    let model = TinyModel::with_dims(shape, 64, 256, args.seed)?;
    let trace = make_trace(requests, args.seed, model.vocab_size() as u32);
    let forks = trace.iter().filter(|r| r.samples > 1).count();
    let aborts = trace.iter().filter(|r| r.abort.is_some()).count();
    println!(
        "{} requests ({} with n > 1, {} cancelled part-way), block size {}, budget {} tokens/step, k = {}",
        trace.len(),
        forks,
        aborts,
        args.block_size,
        TOKEN_BUDGET,
        args.spec_k
    );
    let configs = [
        RunConfig {
            name: "(a) roomy arena, speculation on",
            num_blocks: args.roomy_blocks,
            host_blocks: 0,
            spec_k: args.spec_k,
        },
        RunConfig {
            name: "(b) squeezed arena + host tier, speculation on",
            num_blocks: args.squeezed_blocks,
            host_blocks: args.host_blocks,
            spec_k: args.spec_k,
        },
        RunConfig {
            name: "(c) roomy arena, speculation off",
            num_blocks: args.roomy_blocks,
            host_blocks: 0,
            spec_k: 0,
        },
    ];
    let mut outputs = Vec::new();
    for cfg in configs {
        let (out, stats) = Engine::new(cfg, &model, &trace, args.block_size)?.run()?;
        print_summary(&cfg, &stats);
        outputs.push(out);
    }
    for (i, cfg) in configs.iter().enumerate().skip(1) {
        if let Some(diff) = first_difference(&trace, &outputs[0], &outputs[i]) {
            eprintln!(
                "error: {} differs from {}: {diff}",
                cfg.name, configs[0].name
            );
            return Ok(ExitCode::FAILURE);
        }
    }
    let tokens: usize = outputs[0].iter().flatten().map(Vec::len).sum();
    println!("outputs identical across 3 configurations ({tokens} generated tokens compared)");
    Ok(ExitCode::SUCCESS)
}
