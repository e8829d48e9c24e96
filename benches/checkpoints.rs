//! Prefix hits of a hybrid model's recurrent state on a multi-turn chat trace:
//! pagedkv's checkpoints (16-token attention blocks, the state checkpointed at shared
//! prefix ends, prompt ends and turn ends by `CheckpointPolicy::chat`) beside vLLM's
//! `mamba_cache_mode="align"` (the attention block raised to the state's page size,
//! the state cached at every block boundary), run in the same process on the same
//! arena bytes, both through the real `KvCache` (bookkeeping only: no bytes move).
//!
//! The aligned block size is vLLM's rule (`Platform._align_hybrid_block_size`, the
//! `align` branch): with one recurrent layer's state `mamba_page` bytes (conv plus
//! SSM state) and one attention layer's K/V of one token `attn_token` bytes,
//! `block = 16 x ceil(mamba_page / (16 x attn_token))`. The state and K/V sizes come
//! from `pagedkv::plan` on the model configs of `tests/data`; the arena is 32 GiB in
//! both runs. `KvLayout` takes blocks of at most 1,024 tokens: an aligned block
//! above that is run as blocks of its half (or third...), with the state cached
//! only at multiples of the aligned block (`CheckpointPolicy::every_tokens`, and
//! `checkpoint_grouped` called only there), so hits fall where vLLM's would.
//!
//! The trace, from a fixed seed: 8 system prompts of 200-1,500 tokens; 256
//! conversations, each on one of them, of 2-8 turns; each turn a user message of
//! 50-2,000 tokens and a reply of 20-400 tokens. The prompt of a turn is the whole
//! conversation so far (system prompt, then every message and reply) plus the new
//! message. 32 conversations are under way at once; the next turn is one of theirs
//! at random, and a conversation that ends makes room for the next. Each turn runs
//! alone: the
//! admission (`admit_tokens_grouped`), the reply decoded one token at a time
//! (`append_tokens_grouped`, then `checkpoint_grouped`), then its free.
//!
//! pagedkv runs twice: calling `checkpoint_grouped` at every block boundary of the
//! decode (the turn end exact to the block), and every 4 blocks only (fewer state
//! copies: the engine chooses).
//!
//! Printed: the hit rate (prompt tokens served from the cache / prompt tokens) beside
//! its bound (the attention layers alone, as a model without recurrent layers would
//! hit, same arena), the
//! prompt tokens recomputed, the state copies into checkpoints (a rolling turn-end
//! checkpoint is one copy per block decoded), and the hit rate of first and later
//! turns and by prompt length (the whole prompt: system prompt and history
//! included). No speed is measured.
//!
//! `cargo bench --bench checkpoints`

use pagedkv::plan::{ModelSpec, PlanInput};
use pagedkv::{
    AdmitOptions, CheckpointPolicy, DType, GroupSpec, GroupStep, KvCache, KvLayout, ModelShape,
    SeqId,
};

const SEED: u64 = 34;
const GPU_BYTES: u64 = 141 << 30;
const ARENA_BYTES: u64 = 32 << 30;
const SMALL_BLOCK: usize = 16;
const SYSTEM_PROMPTS: usize = 8;
const SYSTEM_TOKENS: (usize, usize) = (200, 1_500);
const CONVERSATIONS: usize = 256;
/// Conversations under way at once.
const ACTIVE: usize = 32;
const TURNS: (usize, usize) = (2, 8);
const MESSAGE_TOKENS: (usize, usize) = (50, 2_000);
const REPLY_TOKENS: (usize, usize) = (20, 400);
const MAX_PER_CHAIN: usize = 8;
/// The second pagedkv run calls `checkpoint_grouped` every this many tokens of decode
/// only (4 blocks): a quarter of the state copies, a turn end up to 48 tokens earlier.
const SPARSE_TURN_END: usize = 64;
/// Upper bounds of the prompt-length buckets, in tokens.
const BUCKETS: [usize; 6] = [512, 1_024, 2_048, 4_096, 8_192, usize::MAX];

/// SplitMix64: the trace must not depend on a crate's RNG version.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn range(&mut self, (lo, hi): (usize, usize)) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 150_000) as u32).collect()
    }
}

/// One turn: the new user message and the reply.
struct Turn {
    message: Vec<u32>,
    reply: Vec<u32>,
}

struct Conversation {
    system: usize,
    turns: Vec<Turn>,
}

struct Trace {
    systems: Vec<Vec<u32>>,
    conversations: Vec<Conversation>,
    /// The turns in the order they run: conversation index (its next turn).
    order: Vec<usize>,
}

fn trace() -> Trace {
    let mut rng = Rng(SEED);
    let systems = (0..SYSTEM_PROMPTS)
        .map(|_| {
            let n = rng.range(SYSTEM_TOKENS);
            rng.tokens(n)
        })
        .collect();
    let conversations: Vec<Conversation> = (0..CONVERSATIONS)
        .map(|_| {
            let system = rng.range((0, SYSTEM_PROMPTS - 1));
            let turns = (0..rng.range(TURNS))
                .map(|_| {
                    let (m, r) = (rng.range(MESSAGE_TOKENS), rng.range(REPLY_TOKENS));
                    Turn {
                        message: rng.tokens(m),
                        reply: rng.tokens(r),
                    }
                })
                .collect();
            Conversation { system, turns }
        })
        .collect();
    // Every turn once: ACTIVE conversations at a time, the next turn of a random one
    // of them; a conversation that ends makes room for the next.
    let mut order = Vec::new();
    let mut left: Vec<usize> = conversations.iter().map(|c| c.turns.len()).collect();
    let mut active: Vec<usize> = (0..ACTIVE.min(CONVERSATIONS)).collect();
    let mut joining = active.len();
    while !active.is_empty() {
        let i = (rng.next() % active.len() as u64) as usize;
        let c = active[i];
        order.push(c);
        left[c] -= 1;
        if left[c] == 0 {
            match joining < CONVERSATIONS {
                true => {
                    active[i] = joining;
                    joining += 1;
                }
                false => {
                    active.swap_remove(i);
                }
            }
        }
    }
    Trace {
        systems,
        conversations,
        order,
    }
}

/// One model's numbers: K/V bytes of one token (all attention layers), state bytes of
/// one sequence, vLLM's aligned block size, the arena bytes.
struct Model {
    name: &'static str,
    kv_bytes_per_token: usize,
    state_bytes: u64,
    /// One recurrent layer's state and one attention layer's K/V of one token: the
    /// inputs of vLLM's rule.
    mamba_page: u64,
    attn_token: u64,
    aligned_block: usize,
    arena_bytes: u64,
}

fn model(name: &'static str, file: &str) -> Model {
    let path = format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"));
    let plan = PlanInput::new(ModelSpec::from_file(path).expect("config"), GPU_BYTES)
        .plan()
        .expect("plan");
    let st = plan.state.expect("a hybrid model has a state");
    let mamba_page = st.conv_bytes_per_layer + st.ssm_bytes_per_layer;
    let attn_token = plan.kv_bytes_per_token / st.attention_layers as u64;
    let aligned_block = SMALL_BLOCK * mamba_page.div_ceil(SMALL_BLOCK as u64 * attn_token) as usize;
    Model {
        name,
        kv_bytes_per_token: plan.kv_bytes_per_token as usize,
        state_bytes: st.bytes_per_sequence,
        mamba_page,
        attn_token,
        aligned_block,
        arena_bytes: ARENA_BYTES,
    }
}

/// A hybrid cache of `m` with attention blocks of `block` tokens over the arena: one
/// attention group (every attention layer in a page) and one state group.
fn cache(m: &Model, block: usize) -> KvCache {
    // The largest divisor of `block` that `KvLayout` takes, in 16-token steps.
    let parts = (1..)
        .find(|k| block.is_multiple_of(k * SMALL_BLOCK) && block / k <= 1_024)
        .unwrap_or(1);
    let block = block / parts;
    let layout = page_layout(m, block);
    let pages = (m.arena_bytes / layout.block_bytes() as u64) as usize;
    let state = GroupSpec::state_for_bytes(layout, m.state_bytes).expect("state group");
    KvCache::hybrid(&[GroupSpec::full(layout), state], pages).expect("cache")
}

/// The attention group of [`cache`] alone (16-token blocks, the same arena): the hit
/// rate a model without recurrent layers would get, the bound of both runs.
fn attention_only(m: &Model) -> KvCache {
    let layout = page_layout(m, SMALL_BLOCK);
    let pages = (m.arena_bytes / layout.block_bytes() as u64) as usize;
    KvCache::hybrid(&[GroupSpec::full(layout)], pages).expect("cache")
}

#[derive(Default, Clone, Copy)]
struct Counts {
    prompts: usize,
    prompt_tokens: usize,
    hit_tokens: usize,
}

impl Counts {
    fn add(&mut self, prompt: usize, hit: usize) {
        self.prompts += 1;
        self.prompt_tokens += prompt;
        self.hit_tokens += hit;
    }

    fn rate(&self) -> f64 {
        100.0 * self.hit_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

struct Run {
    all: Counts,
    buckets: [Counts; BUCKETS.len()],
    /// First turns, later turns.
    by_turn: [Counts; 2],
    checkpoints: usize,
}

/// Runs the trace through `kv` and counts its prefix hits.
/// `state_every`: the decode checkpoints the state at multiples of this many tokens.
fn run(t: &Trace, kv: &mut KvCache, state_every: usize) -> Run {
    let opts = AdmitOptions::default();
    let mut step = GroupStep::default();
    let mut history: Vec<Vec<u32>> = t
        .conversations
        .iter()
        .map(|c| t.systems[c.system].clone())
        .collect();
    let mut next_turn = vec![0; t.conversations.len()];
    let mut out = Run {
        all: Counts::default(),
        buckets: [Counts::default(); BUCKETS.len()],
        by_turn: [Counts::default(); 2],
        checkpoints: 0,
    };
    for (i, &c) in t.order.iter().enumerate() {
        let turn = &t.conversations[c].turns[next_turn[c]];
        next_turn[c] += 1;
        let prompt = &mut history[c];
        prompt.extend_from_slice(&turn.message);
        let seq = SeqId(i as u64);
        let a = kv
            .admit_tokens_grouped(seq, prompt, &opts, &mut step)
            .expect("the arena holds one sequence");
        out.checkpoints += step.checkpoints.len();
        out.all.add(prompt.len(), a.cached_tokens);
        out.by_turn[usize::from(next_turn[c] > 1)].add(prompt.len(), a.cached_tokens);
        let b = BUCKETS
            .iter()
            .position(|&hi| prompt.len() < hi)
            .unwrap_or(0);
        out.buckets[b].add(prompt.len(), a.cached_tokens);
        for &token in &turn.reply {
            kv.append_tokens_grouped(seq, &[token], &mut step)
                .expect("append");
            let at = kv.num_computed_tokens(seq).expect("computed");
            if at.is_multiple_of(state_every)
                && kv.checkpoint_grouped(seq, &mut step).expect("checkpoint")
            {
                out.checkpoints += 1;
            }
        }
        prompt.extend_from_slice(&turn.reply);
        kv.free(seq).expect("free");
    }
    out
}

fn main() {
    let t = trace();
    let turns = t.order.len();
    println!(
        "Multi-turn chat trace (seed {SEED}): {CONVERSATIONS} conversations ({ACTIVE} at once), \
         {turns} turns, {SYSTEM_PROMPTS} system prompts of {}-{} tokens, messages of {}-{}, replies of {}-{}.",
        SYSTEM_TOKENS.0, SYSTEM_TOKENS.1, MESSAGE_TOKENS.0, MESSAGE_TOKENS.1, REPLY_TOKENS.0,
        REPLY_TOKENS.1
    );
    for (name, file) in [
        ("Qwen3-Next-80B-A3B", "qwen3-next-80b-a3b.json"),
        ("Nemotron-H-8B", "nemotron-h-8b.json"),
    ] {
        let m = model(name, file);
        let chat = CheckpointPolicy::chat(MAX_PER_CHAIN);
        let mut paged = cache(&m, SMALL_BLOCK);
        paged.set_checkpoint_policy(chat).expect("policy");
        let mut sparse = cache(&m, SMALL_BLOCK);
        sparse.set_checkpoint_policy(chat).expect("policy");
        let mut aligned = cache(&m, m.aligned_block);
        aligned
            .set_checkpoint_policy(CheckpointPolicy {
                every_tokens: m.aligned_block,
                ..CheckpointPolicy::default()
            })
            .expect("policy");
        let runs = [
            run(&t, &mut paged, SMALL_BLOCK),
            run(&t, &mut sparse, SPARSE_TURN_END),
            run(&t, &mut aligned, m.aligned_block),
        ];
        let bound = run(&t, &mut attention_only(&m), SMALL_BLOCK);
        println!();
        println!(
            "{}: state {:.2} MiB/seq, K/V {} B/token, arena {:.1} GiB; vLLM-aligned block \
             {} tokens = 16 x ceil({} B state per layer / (16 x {} B K/V per token and layer))",
            m.name,
            m.state_bytes as f64 / (1 << 20) as f64,
            m.kv_bytes_per_token,
            m.arena_bytes as f64 / (1u64 << 30) as f64,
            m.aligned_block,
            m.mamba_page,
            m.attn_token
        );
        println!(
            "| | pagedkv (16-token blocks, chat checkpoints) | pagedkv, turn end rolled every \
             {SPARSE_TURN_END} tokens | vLLM-aligned ({}-token blocks) |",
            m.aligned_block
        );
        println!("|---|---|---|---|");
        let row = |what: String, cell: &dyn Fn(&Run) -> String| {
            let cells: Vec<String> = runs.iter().map(cell).collect();
            println!("| {what} | {} |", cells.join(" | "));
        };
        row("hit rate (cached / prompt tokens)".into(), &|r| {
            format!("{:.1} %", r.all.rate())
        });
        println!(
            "| bound: the attention layers alone, 16-token blocks | {:.1} % | | |",
            bound.all.rate()
        );
        row("prompt tokens recomputed".into(), &|r| {
            (r.all.prompt_tokens - r.all.hit_tokens).to_string()
        });
        row("state copies into checkpoints".into(), &|r| {
            r.checkpoints.to_string()
        });
        for (i, what) in ["first turns", "later turns"].iter().enumerate() {
            let n = runs[0].by_turn[i].prompts;
            row(format!("{what} ({n} prompts)"), &|r| {
                format!("{:.1} %", r.by_turn[i].rate())
            });
        }
        let mut lo = 0;
        for (i, &hi) in BUCKETS.iter().enumerate() {
            let range = match hi {
                usize::MAX => format!(">= {lo}"),
                _ => format!("{lo}-{}", hi - 1),
            };
            let n = runs[0].buckets[i].prompts;
            if n > 0 {
                row(format!("prompts of {range} tokens ({n} prompts)"), &|r| {
                    format!("{:.1} %", r.buckets[i].rate())
                });
            }
            lo = hi;
        }
    }
}

/// A page-sized layout of `block` tokens: one layer of `kv_bytes_per_token / 8` f32
/// elements per token (K and V), so a page holds the model's K/V bytes of its tokens.
fn page_layout(m: &Model, block: usize) -> KvLayout {
    KvLayout::new(
        ModelShape {
            num_layers: 1,
            num_q_heads: 1,
            num_kv_heads: 1,
            head_dim: m.kv_bytes_per_token / 8,
            kv_dtype: DType::F32,
        },
        block,
    )
    .expect("layout")
}
