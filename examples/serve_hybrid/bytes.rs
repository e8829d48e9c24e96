//! The byte-carrying runs of `serve --hybrid`: the groups cache over a `HostStorage`
//! whose bytes are really written and checked (see the [parent module](super)).
//!
//! * **K/V**: every slot a call hands out is written with bytes derived from (token id,
//!   position, layer) through `Storage::write_slots`; the copy-on-write copies of each
//!   call run first.
//! * **State** (a recurrent-state group): at every step the engine reads the state word
//!   from the sequence's state pages, folds in the step's tokens and rewrites every
//!   byte of the state pages from the new value, as a recurrent kernel rewrites its
//!   state in place.
//! * **Checks**, against a recomputation from the token ids alone: every decode step,
//!   the new token of every row in every KV group and the whole state of every row,
//!   both read through the row's table of the step's buffers; the whole readable
//!   context of one row per step (round robin) through its table; the whole sequence,
//!   every group, after a prefix hit, after a swap-in and before it is freed. A
//!   mismatch ends the run with an error.
//!
//! The bookkeeping runs on the model's real page size; the storage holds the same
//! pages with narrower heads ([`Model::byte_layout`]: 1 KV head, same layers and block
//! size), so a slot or page id means the same page in both.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use pagedkv::attention::model::SplitMix64;
use pagedkv::layout::Slot;
use pagedkv::{
    AdmitOptions, BlockId, DType, Error, GroupSpec, GroupStep, HostStorage, KvCache, KvLayout,
    ModelShape, SeqId, StepBuffers, StepEntry, Storage,
};

use super::{Outcome, Request, BLOCK, GLOBAL_EVERY, LAYERS, MAX_LEN, WINDOW};

/// A hybrid model as KV-cache groups: the bookkeeping specs at the real shapes and the
/// narrow layout the byte storage uses for the same pages.
#[derive(Debug, Clone)]
pub struct Model {
    /// Its name in the output.
    pub name: String,
    /// One spec per group, at the model's real shapes.
    pub specs: Vec<GroupSpec>,
    /// The storage's layout: the groups' layers and block size, 1 KV head of
    /// `byte_head_dim` bf16 elements.
    pub byte_layout: KvLayout,
    /// One line on where the shapes come from.
    pub about: String,
}

impl Model {
    /// The Gemma-3-like model of the three-way comparison: one full group and five
    /// window groups of 8 layers.
    pub fn gemma3() -> pagedkv::Result<Self> {
        let per_group = LAYERS / GLOBAL_EVERY;
        let l = KvLayout::new(super::shape(per_group), BLOCK)?;
        let mut specs = vec![GroupSpec::full(l)];
        specs.extend((1..GLOBAL_EVERY).map(|_| GroupSpec::window(l, WINDOW)));
        Ok(Model {
            name: "gemma-3".into(),
            specs,
            byte_layout: narrow(per_group, 4)?,
            about: format!(
                "Gemma-3-like: {LAYERS} layers, 1 full + {} window ({WINDOW}) groups of \
                 {per_group} layers, 8 KV heads x 256 bf16",
                GLOBAL_EVERY - 1
            ),
        })
    }

    /// Nemotron-H-8B (`tests/data/nemotron-h-8b.json`): its 4 attention layers as one
    /// full group (8 KV heads x 128, bf16) and its 24 Mamba-2 layers as one state
    /// group of the planner's state bytes per sequence.
    pub fn nemotron_h() -> Result<Self, Box<dyn std::error::Error>> {
        use pagedkv::plan::{ModelSpec, PlanInput};
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/nemotron-h-8b.json");
        let mut input = PlanInput::new(ModelSpec::from_file(path)?, 141 << 30);
        input.block_size = BLOCK;
        let plan = input.plan()?;
        let state = plan.state.ok_or("nemotron-h: the planner found no state")?;
        let attention = KvLayout::new(
            ModelShape {
                num_layers: state.attention_layers,
                num_q_heads: 32,
                num_kv_heads: 8,
                head_dim: 128,
                kv_dtype: DType::BF16,
            },
            BLOCK,
        )?;
        if attention.block_bytes() as u64 != plan.block_bytes {
            return Err(format!(
                "nemotron-h: page of {} B, the planner's {} B",
                attention.block_bytes(),
                plan.block_bytes
            )
            .into());
        }
        let specs = vec![
            GroupSpec::full(attention),
            GroupSpec::state_for_bytes(attention, state.bytes_per_sequence)?,
        ];
        Ok(Model {
            name: "nemotron-h".into(),
            about: format!(
                "Nemotron-H-8B: {} attention layers (8 KV heads x 128 bf16) as a full group, \
                 {} {} layers as a state group of {} MiB ({} pages) per sequence",
                state.attention_layers,
                state.recurrent_layers,
                state.mixer,
                state.bytes_per_sequence >> 20,
                state.pages_per_sequence
            ),
            byte_layout: narrow(state.attention_layers, 2)?,
            specs,
        })
    }

    /// Bytes of one page at the real shapes.
    pub fn page_bytes(&self) -> u64 {
        self.specs[0].layout.block_bytes() as u64
    }

    /// Whether a group holds a recurrent state.
    pub fn has_state(&self) -> bool {
        self.specs.iter().any(|s| s.state_pages.is_some())
    }
}

/// The storage layout: `layers` layers of 1 KV head of `head_dim` bf16 elements.
fn narrow(layers: usize, head_dim: usize) -> pagedkv::Result<KvLayout> {
    KvLayout::new(
        ModelShape {
            num_layers: layers,
            num_q_heads: 1,
            num_kv_heads: 1,
            head_dim,
            kv_dtype: DType::BF16,
        },
        BLOCK,
    )
}

/// SplitMix64's finaliser: the bytes' only source of variety.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `out` with the words `mix(key + i)`.
fn fill(key: u64, out: &mut [u8]) {
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = mix(key.wrapping_add(i as u64)).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// The key of the K bytes of `token` at `pos` in layer `layer` of the model (group
/// `g`'s layer `j` is `g * layers_per_group + j`); V's is the key + 1 << 63.
fn kv_key(token: u32, pos: usize, layer: usize) -> u64 {
    mix(((token as u64) << 32) ^ pos as u64 ^ ((layer as u64) << 56))
}

/// Whether `got` holds the bytes [`fill`] writes for `key` (compared word by word:
/// the runs compare gigabytes in pieces of 4 to 16 bytes).
fn matches(key: u64, got: &[u8]) -> bool {
    got.chunks(8).enumerate().all(|(i, c)| {
        let w = mix(key.wrapping_add(i as u64)).to_le_bytes();
        match <[u8; 8]>::try_from(c) {
            Ok(c) => c == w,
            Err(_) => c.iter().zip(w).all(|(a, b)| *a == b),
        }
    })
}

/// Folds checked bytes into the run's checksum and count: the bytes' word sum, mixed
/// into the checksum once per call (order-sensitive across calls).
fn fold(out: &mut ByteOutcome, bytes: &[u8]) {
    let mut sum = bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        sum = sum.wrapping_add(u64::from_le_bytes(w.try_into().unwrap_or_default()));
    }
    for (i, b) in words.remainder().iter().enumerate() {
        sum = sum.wrapping_add((*b as u64) << (8 * i));
    }
    out.checksum = mix(out.checksum ^ sum);
    out.bytes_checked += bytes.len() as u64;
}

/// Every this many decode steps, one row (round robin) has its whole readable context
/// checked through its tables; every row's new token and state are checked at every
/// step, and every sequence in full after a hit, a swap-in and before its free.
const CONTEXT_CHECK_EVERY: u64 = 8;

/// The recurrent state before any token.
const STATE_SEED: u64 = 0x05EE_D0F5_7A7E;

/// The state after `token` at `pos`, from the state before it.
fn next_state(state: u64, token: u32, pos: usize) -> u64 {
    mix(state.rotate_left(17) ^ token as u64 ^ ((pos as u64) << 32))
}

/// The state after `tokens` (from the start).
fn state_of(tokens: &[u32]) -> u64 {
    tokens
        .iter()
        .enumerate()
        .fold(STATE_SEED, |s, (p, &t)| next_state(s, t, p))
}

/// The state's bytes in page `i` of a sequence's state pages, layer slot `layer`:
/// the first word of page 0 is the state itself (what the next step reads back), the
/// rest derived from it.
fn state_bytes(state: u64, layer: usize, i: usize, out: &mut [u8]) {
    let word = state_word(state, layer, i).to_le_bytes();
    for w in out.chunks_exact_mut(8) {
        w.copy_from_slice(&word);
    }
    if i == 0 {
        out[..8].copy_from_slice(&(state ^ layer as u64).to_le_bytes());
    }
}

/// The word that fills page `i` of a state in layer slot `layer` (one word repeated:
/// a state page is rewritten and read whole at every step of every row, gigabytes a
/// run; a page from another state or another page differs in every word).
fn state_word(state: u64, layer: usize, i: usize) -> u64 {
    mix(state ^ ((layer as u64) << 48) ^ ((i as u64) << 32))
}

/// Whether `got` holds what [`state_bytes`] writes.
fn state_matches(state: u64, layer: usize, i: usize, got: &[u8]) -> bool {
    let word = state_word(state, layer, i);
    got.chunks_exact(8).enumerate().all(|(k, w)| {
        let w = u64::from_le_bytes(w.try_into().unwrap_or_default());
        w == if i == 0 && k == 0 {
            state ^ layer as u64
        } else {
            word
        }
    })
}

/// Shared system prompts: their lengths (block multiples).
const SYSTEM_PROMPTS: [usize; 4] = [512, 1024, 2048, 4096];

/// Token ids of every request's whole history (prompt, then output), and the tokens
/// each shares with a system prompt or an earlier request: a share of requests start
/// with one of a few system prompts; a share continue an earlier conversation (their
/// prompt starts with its whole history). The lengths are the trace's.
pub fn histories(
    trace: &[Request],
    seed: u64,
    system_share: f64,
    follow_up_share: f64,
) -> Histories {
    let mut rng = SplitMix64::new(seed ^ 0x070C_E115);
    let mut unit = move || (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let token = |key: u64| (mix(key) % 150_000) as u32;
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(trace.len());
    let mut shared = Vec::with_capacity(trace.len());
    for (r, req) in trace.iter().enumerate() {
        let u = unit();
        let pick = unit();
        let mut h: Vec<u32> = Vec::with_capacity(req.prompt + req.output);
        if u < follow_up_share {
            // The latest of the last 32 requests whose history fits the prompt.
            let parent = (r.saturating_sub(32)..r)
                .rev()
                .find(|&p| out[p].len() + BLOCK <= req.prompt && pick < 0.9);
            if let Some(p) = parent {
                h.extend_from_slice(&out[p]);
            }
        } else if u < follow_up_share + system_share {
            let k = (pick * SYSTEM_PROMPTS.len() as f64) as usize % SYSTEM_PROMPTS.len();
            if SYSTEM_PROMPTS[k] + BLOCK <= req.prompt {
                h.extend((0..SYSTEM_PROMPTS[k]).map(|i| token((k as u64) << 40 ^ i as u64)));
            }
        }
        let own = (r as u64 + 1) << 40;
        let start = h.len();
        shared.push(start);
        h.extend((start..req.prompt + req.output).map(|i| token(own ^ i as u64 ^ seed << 20)));
        out.push(h);
    }
    Histories {
        tokens: out,
        shared,
    }
}

/// Every request's token ids and the prefix it shares.
#[derive(Debug, Clone)]
pub struct Histories {
    /// Each request's prompt then output token ids.
    pub tokens: Vec<Vec<u32>>,
    /// The leading tokens each shares with a system prompt or an earlier request (the
    /// end of the system prompt or of the previous turn, which the engine knows).
    pub shared: Vec<usize>,
}

/// How the byte run serves: prefix caching, and swap to a host tier (else recompute).
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Admit with token ids and serve prefix hits (checkpointing the state at block
    /// boundaries of prompts when the model has a state group).
    pub prefix: bool,
    /// Host-tier blocks to swap preempted requests to (0: recompute).
    pub host_blocks: usize,
    /// Pages kept free at admission, per 10,000 pages of the arena.
    pub watermark_per_10k: usize,
    /// Flip one byte after the writes of this decode step (a self-check that a
    /// corruption fails the run): of the newest K/V token of the first row, or with
    /// `corrupt_state` of its state.
    pub corrupt_at: Option<u64>,
    /// Corrupt the state rather than K/V.
    pub corrupt_state: bool,
}

/// What a byte run measured, beyond the bookkeeping outcome.
#[derive(Debug, Clone, Default)]
pub struct ByteOutcome {
    /// The scheduler's figures.
    pub outcome: Outcome,
    /// Prompt tokens admitted (recomputed ones included).
    pub prompt_tokens: u64,
    /// Of those, served from the prefix cache.
    pub hit_tokens: u64,
    /// Swap-outs (preemptions that kept the bytes on the host tier).
    pub swap_outs: usize,
    /// Swap-ins.
    pub swap_ins: usize,
    /// State checkpoints made.
    pub checkpoints: usize,
    /// Bytes written into the storage (K/V and state).
    pub bytes_written: u64,
    /// Bytes read back and checked.
    pub bytes_checked: u64,
    /// A checksum of the bytes checked (equal across runs of the same flags).
    pub checksum: u64,
    /// Bytes of the storage (arena and host tier).
    pub storage_bytes: u64,
    /// Wall time of the whole run.
    pub wall: Duration,
}

/// A request on the device, swapped out, or waiting.
#[derive(Debug, Clone, Copy)]
struct Live {
    id: SeqId,
    req: usize,
    /// Output tokens computed.
    done: usize,
    /// The state after its computed tokens, from the token ids (the check's side).
    state: u64,
}

/// The byte run: the cache, the storage and the checker.
struct Engine<'a> {
    model: &'a Model,
    kv: KvCache,
    store: HostStorage,
    step: GroupStep,
    bufs: Vec<StepBuffers>,
    histories: &'a Histories,
    trace: &'a [Request],
    /// Layers per group (every group has the storage's layers).
    layers: usize,
    /// K (or V) bytes of one token in one layer of the storage.
    token_bytes: usize,
    /// Scratch.
    k: Vec<u8>,
    v: Vec<u8>,
    expect: Vec<u8>,
    table: Vec<BlockId>,
    slots: Vec<Slot>,
    out: ByteOutcome,
}

type Failure = Box<dyn std::error::Error>;

impl<'a> Engine<'a> {
    fn new(
        model: &'a Model,
        budget: u64,
        policy: &Policy,
        trace: &'a [Request],
        histories: &'a Histories,
    ) -> Result<Self, Failure> {
        let pages = (budget / model.page_bytes()) as usize;
        let kv = KvCache::hybrid_with_host_tier(&model.specs, pages, policy.host_blocks)?
            .with_watermark_blocks(pages * policy.watermark_per_10k / 10_000)?;
        let store = HostStorage::with_host_tier(model.byte_layout, pages, policy.host_blocks)?;
        let width = model
            .specs
            .iter()
            .filter_map(|s| s.state_pages)
            .max()
            .unwrap_or(0)
            .max(MAX_LEN.div_ceil(BLOCK) + 1);
        let bufs = (0..model.specs.len())
            .map(|_| StepBuffers::new(1024, 1024, width))
            .collect();
        let layers = model.byte_layout.num_layers();
        let token_bytes = model.byte_layout.block_bytes_per_layer() / BLOCK / 2;
        let storage_bytes = ((pages + policy.host_blocks) * model.byte_layout.block_bytes()) as u64;
        Ok(Engine {
            model,
            kv,
            store,
            step: GroupStep::default(),
            bufs,
            histories,
            trace,
            layers,
            token_bytes,
            k: Vec::new(),
            v: Vec::new(),
            expect: Vec::new(),
            table: Vec::new(),
            slots: Vec::new(),
            out: ByteOutcome {
                storage_bytes,
                ..ByteOutcome::default()
            },
        })
    }

    fn is_state(&self, g: usize) -> bool {
        self.model.specs[g].state_pages.is_some()
    }

    /// Runs the copy plans of the last call, every group.
    fn run_copies(&mut self) -> Result<(), Failure> {
        for c in &self.step.copies {
            self.store.copy_blocks(c)?;
        }
        Ok(())
    }

    /// Writes K/V of `tokens[first..first + slots.len()]` of `hist` into `slots` of
    /// group `g`, every layer.
    fn write_kv(
        &mut self,
        g: usize,
        slots: &[Slot],
        hist: &[u32],
        first: usize,
    ) -> Result<(), Failure> {
        let tb = self.token_bytes;
        for j in 0..self.layers {
            let layer = g * self.layers + j;
            self.k.resize(slots.len() * tb, 0);
            self.v.resize(slots.len() * tb, 0);
            for (i, pos) in (first..first + slots.len()).enumerate() {
                let key = kv_key(hist[pos], pos, layer);
                fill(key, &mut self.k[i * tb..(i + 1) * tb]);
                fill(key ^ 1 << 63, &mut self.v[i * tb..(i + 1) * tb]);
            }
            self.store.write_slots(j, slots, &self.k, &self.v)?;
            self.out.bytes_written += 2 * (slots.len() * tb) as u64;
        }
        Ok(())
    }

    /// Reads tokens `from..to` of `hist` in group `g` through `table` (a block table
    /// whose entries before `from`'s block may be holes) and checks them.
    fn check_kv(
        &mut self,
        g: usize,
        table: &[BlockId],
        hist: &[u32],
        from: usize,
        to: usize,
    ) -> Result<(), Failure> {
        let tb = self.token_bytes;
        let first_block = from / BLOCK;
        let n = to - first_block * BLOCK;
        for j in 0..self.layers {
            let layer = g * self.layers + j;
            self.k.resize(n * tb, 0);
            self.v.resize(n * tb, 0);
            self.store
                .read_tokens(j, &table[first_block..], n, &mut self.k, &mut self.v)?;
            self.expect.resize(tb, 0);
            for (pos, &token) in hist.iter().enumerate().take(to).skip(from) {
                let i = pos - first_block * BLOCK;
                let key = kv_key(token, pos, layer);
                for (half, bytes) in [(0u64, &self.k), (1 << 63, &self.v)] {
                    let got = &bytes[i * tb..(i + 1) * tb];
                    if !matches(key ^ half, got) {
                        fill(key ^ half, &mut self.expect);
                        return Err(format!(
                            "group {g} layer {j}: {} at position {pos} (token id {}) reads {got:02x?}, \
                             expected {:02x?}",
                            if half == 0 { "K" } else { "V" },
                            token,
                            self.expect
                        )
                        .into());
                    }
                    fold(&mut self.out, got);
                }
            }
        }
        Ok(())
    }

    /// Reads the state word a step starts from: page 0, layer slot 0.
    fn read_state(&self, pages: &[BlockId]) -> Result<u64, Failure> {
        let b = self.store.block_bytes(0, pages[0])?;
        Ok(u64::from_le_bytes(b[..8].try_into()?))
    }

    /// Writes state `state` into every byte of `pages`.
    fn write_state(&mut self, pages: &[BlockId], state: u64) {
        let layout = self.model.byte_layout;
        let n = layout.block_bytes_per_layer();
        for j in 0..self.layers {
            let region = self.store.region_mut(j);
            for (i, &p) in pages.iter().enumerate() {
                let at = layout.block_byte_offset(p);
                state_bytes(state, j, i, &mut region[at..at + n]);
            }
        }
        self.out.bytes_written += (pages.len() * n * self.layers) as u64;
    }

    /// Checks that `pages` hold state `state`.
    fn check_state(&mut self, pages: &[BlockId], state: u64) -> Result<(), Failure> {
        for j in 0..self.layers {
            for (i, &p) in pages.iter().enumerate() {
                let got = self.store.block_bytes(j, p)?;
                if !state_matches(state, j, i, got) {
                    return Err(format!(
                        "state page {i} ({p:?}) layer {j} does not hold the state of the token \
                         history"
                    )
                    .into());
                }
                fold(&mut self.out, got);
            }
        }
        Ok(())
    }

    /// Checks everything `live` holds on the device, every group.
    fn check_sequence(&mut self, live: &Live) -> Result<(), Failure> {
        let histories = self.histories;
        let hist = histories.tokens[live.req].as_slice();
        for g in 0..self.model.specs.len() {
            if self.is_state(g) {
                self.table.clear();
                self.table
                    .extend_from_slice(self.kv.group(g).block_table(live.id)?);
                let pages = std::mem::take(&mut self.table);
                self.check_state(&pages, live.state)?;
                self.table = pages;
                continue;
            }
            let (table, computed) = self.kv.group(g).readable_blocks(live.id)?;
            let first = table
                .iter()
                .position(|&b| b != BlockId::RELEASED)
                .unwrap_or(table.len());
            let table = table.to_vec();
            self.check_kv(g, &table, hist, first * BLOCK, computed)?;
        }
        Ok(())
    }

    /// Computes tokens `from..to` of `live` after a call that handed out their slots
    /// (`self.step`): copies, K/V, the state.
    fn compute(&mut self, live: &mut Live, from: usize, to: usize) -> Result<(), Failure> {
        self.run_copies()?;
        let histories = self.histories;
        let hist = &histories.tokens[live.req];
        for g in 0..self.model.specs.len() {
            if self.is_state(g) {
                let pages = self.kv.group(g).block_table(live.id)?.to_vec();
                let mut s = if from == 0 {
                    STATE_SEED
                } else {
                    self.read_state(&pages)?
                };
                for (p, &t) in hist.iter().enumerate().take(to).skip(from) {
                    s = next_state(s, t, p);
                }
                self.write_state(&pages, s);
                continue;
            }
            let slots = std::mem::take(&mut self.step.slots[g]);
            // A window group may hand out the slots of the last tokens only.
            self.write_kv(g, &slots, hist, to - slots.len())?;
            self.step.slots[g] = slots;
        }
        live.state = hist[from..to]
            .iter()
            .enumerate()
            .fold(live.state, |s, (i, &t)| next_state(s, t, from + i));
        Ok(())
    }

    /// Admits `live` with its prompt and generated tokens and computes them; false
    /// (nothing held) when memory is short. With prefix caching and a state group,
    /// the prompt is computed in chunks that end on the block boundaries where later
    /// prompts may hit (the end of the shared prefix, the last full block), the state
    /// checkpointed after each.
    fn admit(&mut self, live: &mut Live, policy: &Policy) -> Result<bool, Failure> {
        let histories = self.histories;
        let hist = &histories.tokens[live.req];
        let n = self.trace[live.req].prompt + live.done;
        live.state = STATE_SEED;
        if !policy.prefix {
            let t = Instant::now();
            let r = self.kv.admit_grouped(live.id, n, &mut self.step);
            self.out.outcome.alloc_time += t.elapsed();
            match r {
                Err(Error::OutOfBlocks { .. }) => return Ok(false),
                r => r?,
            }
            self.out.prompt_tokens += n as u64;
            self.compute(live, 0, n)?;
            self.check_sequence(live)?;
            return Ok(true);
        }
        let opts = AdmitOptions::default();
        let mut ends = vec![n];
        if self.model.has_state() {
            // Chunks end after what the cache serves (a hit is below its admission's
            // length), at the end of the shared prefix and the prompt's last block.
            let cached = self.kv.cached_prefix_len(&hist[..n], &opts)?;
            let shared = histories.shared[live.req].min(n);
            ends = vec![shared / BLOCK * BLOCK, n / BLOCK * BLOCK, n];
            ends.retain(|&e| e > cached);
            ends.dedup();
        }
        let t = Instant::now();
        let r = self
            .kv
            .admit_tokens_grouped(live.id, &hist[..ends[0]], &opts, &mut self.step);
        self.out.outcome.alloc_time += t.elapsed();
        let a = match r {
            Err(Error::OutOfBlocks { .. }) => return Ok(false),
            r => r?,
        };
        self.out.prompt_tokens += n as u64;
        self.out.hit_tokens += a.cached_tokens as u64;
        let mut from = a.cached_tokens;
        if from > 0 {
            // The hit's bytes, and the checkpoint's state once its copies ran.
            live.state = state_of(&hist[..from]);
            self.run_copies()?;
            self.step.copies.iter_mut().for_each(|c| c.clear());
            self.check_prefix(live, from)?;
        }
        for (c, &end) in ends.iter().enumerate() {
            if c > 0 {
                let t = Instant::now();
                let r = self
                    .kv
                    .append_tokens_grouped(live.id, &hist[from..end], &mut self.step);
                self.out.outcome.alloc_time += t.elapsed();
                match r {
                    Err(Error::OutOfBlocks { .. }) => {
                        self.kv.free(live.id)?;
                        return Ok(false);
                    }
                    r => r?,
                }
            }
            self.compute(live, from, end)?;
            from = end;
            if self.model.has_state() && end.is_multiple_of(BLOCK) {
                self.checkpoint(live.id)?;
            }
        }
        self.check_sequence(live)?;
        Ok(true)
    }

    /// Checkpoints the state of `seq` where the cache allows it (see
    /// `KvCache::checkpoint_grouped`), running the copies.
    fn checkpoint(&mut self, seq: SeqId) -> Result<(), Failure> {
        match self.kv.checkpoint_grouped(seq, &mut self.step) {
            Ok(true) => {
                self.run_copies()?;
                self.out.checkpoints += 1;
                Ok(())
            }
            Ok(false) | Err(Error::OutOfBlocks { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Checks the first `n` tokens of `live` right after a hit: K/V in every KV group
    /// that holds them, the restored state.
    fn check_prefix(&mut self, live: &Live, n: usize) -> Result<(), Failure> {
        let histories = self.histories;
        let hist = histories.tokens[live.req].as_slice();
        for g in 0..self.model.specs.len() {
            if self.is_state(g) {
                let pages = self.kv.group(g).block_table(live.id)?.to_vec();
                self.check_state(&pages, live.state)?;
                continue;
            }
            let table = self.kv.group(g).block_table(live.id)?.to_vec();
            let first = table
                .iter()
                .position(|&b| b != BlockId::RELEASED)
                .unwrap_or(table.len());
            let from = (first * BLOCK).min(n);
            self.check_kv(g, &table, hist, from, n)?;
        }
        Ok(())
    }

    /// Preempts the newest running request: swaps it out when the host tier has room,
    /// else frees it for recompute.
    fn preempt(
        &mut self,
        running: &mut Vec<Live>,
        swapped: &mut VecDeque<Live>,
        waiting: &mut VecDeque<Live>,
    ) -> Result<(), Failure> {
        let v = running.pop().ok_or("nothing to preempt")?;
        self.out.outcome.preemptions += 1;
        match self.kv.swap_out_grouped(v.id) {
            Ok(job) => {
                for p in &job.plans {
                    self.store.swap(p)?;
                }
                self.kv.complete_swap_grouped(&job)?;
                self.out.swap_outs += 1;
                swapped.push_back(v);
            }
            Err(Error::TierFull { .. }) => {
                self.kv.free(v.id)?;
                waiting.push_front(v);
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// One decode step of every running request through the step path; returns the
    /// rows that ran.
    fn decode(
        &mut self,
        running: &mut Vec<Live>,
        swapped: &mut VecDeque<Live>,
        waiting: &mut VecDeque<Live>,
        policy: &Policy,
        step: u64,
    ) -> Result<(), Failure> {
        let histories = self.histories;
        let mut entries: Vec<StepEntry> = Vec::with_capacity(running.len());
        let mut ids: Vec<u32> = Vec::with_capacity(running.len());
        loop {
            entries.clear();
            ids.clear();
            for r in running.iter() {
                entries.push(StepEntry {
                    seq: self.kv.handle(r.id)?,
                    new_tokens: 1,
                    lookahead: 0,
                });
                ids.push(self.histories.tokens[r.req][self.trace[r.req].prompt + r.done]);
            }
            let t = Instant::now();
            let r = if policy.prefix {
                self.kv
                    .reserve_step_tokens_grouped(&entries, &ids, &mut self.bufs)
            } else {
                self.kv.reserve_step_grouped(&entries, &mut self.bufs)
            };
            self.out.outcome.alloc_time += t.elapsed();
            match r {
                Ok(()) => break,
                Err(Error::OutOfBlocks { .. }) if !running.is_empty() => {
                    self.preempt(running, swapped, waiting)?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if running.is_empty() {
            return Ok(());
        }
        // Execute: copies, then every row's K/V through the slot mapping, its state
        // through its table.
        let groups = self.model.specs.len();
        let bufs = std::mem::take(&mut self.bufs);
        for (g, b) in bufs.iter().enumerate() {
            self.store.copy_blocks(b.copies())?;
            let tables = b.tables();
            if self.is_state(g) {
                let pages = self.model.specs[g].state_pages.unwrap_or(0);
                for (i, &token) in ids.iter().enumerate() {
                    let row: Vec<BlockId> =
                        tables.row(i)[..pages].iter().map(|&p| BlockId(p)).collect();
                    let pos = b.positions()[i] as usize;
                    let s = next_state(self.read_state(&row)?, token, pos);
                    self.write_state(&row, s);
                }
                continue;
            }
            self.slots.clear();
            self.slots
                .extend(b.slot_mapping().iter().map(|&s| Slot(s as u64)));
            let slots = std::mem::take(&mut self.slots);
            let tb = self.token_bytes;
            for j in 0..self.layers {
                let layer = g * self.layers + j;
                self.k.resize(slots.len() * tb, 0);
                self.v.resize(slots.len() * tb, 0);
                for (i, (&token, &pos)) in ids.iter().zip(b.positions()).enumerate() {
                    let key = kv_key(token, pos as usize, layer);
                    fill(key, &mut self.k[i * tb..(i + 1) * tb]);
                    fill(key ^ 1 << 63, &mut self.v[i * tb..(i + 1) * tb]);
                }
                self.store.write_slots(j, &slots, &self.k, &self.v)?;
                self.out.bytes_written += 2 * (slots.len() * tb) as u64;
            }
            self.slots = slots;
        }
        for live in running.iter_mut() {
            let pos = self.trace[live.req].prompt + live.done;
            live.state = next_state(live.state, self.histories.tokens[live.req][pos], pos);
        }
        if policy.corrupt_at == Some(step) {
            self.corrupt(&bufs, policy.corrupt_state)?;
        }
        // Check what each row reads through its tables: the new token in every KV
        // group, the state; one row's whole readable context.
        let sampled = step
            .is_multiple_of(CONTEXT_CHECK_EVERY)
            .then(|| (step / CONTEXT_CHECK_EVERY) as usize % running.len());
        for (g, b) in bufs.iter().enumerate().take(groups) {
            let tables = b.tables();
            for (i, live) in running.iter().enumerate() {
                let len = tables.context_lens[i] as usize;
                let row = tables.row(i);
                if self.is_state(g) {
                    let pages = self.model.specs[g].state_pages.unwrap_or(0);
                    let row: Vec<BlockId> = row[..pages].iter().map(|&p| BlockId(p)).collect();
                    self.check_state(&row, live.state)?;
                    continue;
                }
                let blocks = len.div_ceil(BLOCK);
                let row: Vec<BlockId> = row[..blocks].iter().map(|&p| BlockId(p)).collect();
                let from = if sampled == Some(i) {
                    let first = row
                        .iter()
                        .position(|&b| b != BlockId::RELEASED)
                        .unwrap_or(blocks);
                    first * BLOCK
                } else {
                    len - 1
                };
                let hist = histories.tokens[live.req].as_slice();
                self.check_kv(g, &row, hist, from, len)?;
            }
        }
        self.bufs = bufs;
        let accepted: Vec<_> = entries.iter().map(|e| (e.seq, 1)).collect();
        let t = Instant::now();
        self.kv.commit_step(&accepted)?;
        self.out.outcome.alloc_time += t.elapsed();
        for live in running.iter_mut() {
            live.done += 1;
        }
        Ok(())
    }

    /// Flips one byte the checks read this step: the first row's new K in the last KV
    /// group, or its state.
    fn corrupt(&mut self, bufs: &[StepBuffers], state: bool) -> Result<(), Failure> {
        let g = (0..self.model.specs.len())
            .rev()
            .find(|&g| self.is_state(g) == state)
            .ok_or("--corrupt-state: the model has no state group")?;
        if state {
            let n = self.model.byte_layout.block_bytes_per_layer();
            let at = bufs[g].tables().row(0)[0] as usize * n + n / 2;
            self.store.region_mut(0)[at] ^= 1;
        } else {
            // Read the token's K and V back through its block, flip, write it again.
            let slot = Slot(bufs[g].slot_mapping()[0] as u64);
            let (block, offset) = self.model.byte_layout.split_slot(slot);
            let tb = self.token_bytes;
            self.k.resize((offset + 1) * tb, 0);
            self.v.resize((offset + 1) * tb, 0);
            self.store
                .read_tokens(0, &[block], offset + 1, &mut self.k, &mut self.v)?;
            let (mut k, v) = (
                self.k[offset * tb..].to_vec(),
                self.v[offset * tb..].to_vec(),
            );
            k[0] ^= 1;
            self.store.write_slots(0, &[slot], &k, &v)?;
        }
        eprintln!(
            "corrupted one byte of the first row's {} in group {g}",
            if state { "state" } else { "new K" }
        );
        Ok(())
    }
}

/// Serves `trace` with bytes on `model`'s groups over `budget` bytes of (real) pages.
pub fn serve_bytes(
    model: &Model,
    budget: u64,
    policy: Policy,
    trace: &[Request],
    histories: &Histories,
) -> Result<ByteOutcome, Failure> {
    let start = Instant::now();
    let mut e = Engine::new(model, budget, &policy, trace, histories)?;
    let mut waiting: VecDeque<Live> = VecDeque::new();
    let mut swapped: VecDeque<Live> = VecDeque::new();
    let mut running: Vec<Live> = Vec::new();
    let (mut next_arrival, mut next_id, mut step) = (0usize, 0u64, 0u64);
    let (mut sum_running, mut sum_bytes, mut busy_steps) = (0u64, 0f64, 0u64);
    while e.out.outcome.finished < trace.len() {
        while next_arrival < trace.len() && trace[next_arrival].arrival <= step {
            waiting.push_back(Live {
                id: SeqId(0),
                req: next_arrival,
                done: 0,
                state: STATE_SEED,
            });
            next_arrival += 1;
        }
        // Swapped-out requests come back first, in order, when they fit above the
        // watermark; nothing new is admitted before them.
        while let Some(&front) = swapped.front() {
            let ctx = trace[front.req].prompt + front.done;
            if !e.kv.can_admit(ctx) {
                break;
            }
            let t = Instant::now();
            let job = match e.kv.swap_in_grouped(front.id) {
                Ok(job) => job,
                Err(Error::OutOfBlocks { .. }) => break,
                Err(err) => return Err(err.into()),
            };
            e.out.outcome.alloc_time += t.elapsed();
            for p in &job.plans {
                e.store.swap(p)?;
            }
            e.kv.complete_swap_grouped(&job)?;
            e.out.swap_ins += 1;
            swapped.pop_front();
            e.check_sequence(&front)?;
            running.push(front);
        }
        while swapped.is_empty() {
            let Some(&front) = waiting.front() else { break };
            let tokens = trace[front.req].prompt + front.done;
            if !e.kv.can_admit(tokens) {
                break;
            }
            let mut live = front;
            live.id = SeqId(next_id);
            next_id += 1;
            if !e.admit(&mut live, &policy)? {
                break;
            }
            waiting.pop_front();
            running.push(live);
        }
        if running.is_empty() {
            if let Some(w) = waiting.front().or(swapped.front()) {
                return Err(format!("request {} does not fit the empty budget", w.req).into());
            }
        }
        e.decode(&mut running, &mut swapped, &mut waiting, &policy, step)?;
        if policy.prefix && model.has_state() {
            // The last block boundary of a history: where a follow-up turn resumes.
            for live in &running {
                let ctx = trace[live.req].prompt + live.done;
                if ctx.is_multiple_of(BLOCK) && trace[live.req].output - live.done < BLOCK {
                    e.checkpoint(live.id)?;
                }
            }
        }
        sum_running += running.len() as u64;
        let o = &mut e.out.outcome;
        o.peak_running = o.peak_running.max(running.len());
        let bytes = (e.kv.group_stats().used_pages as u64) * model.page_bytes();
        o.peak_bytes = o.peak_bytes.max(bytes);
        if !running.is_empty() {
            sum_bytes += bytes as f64 / running.len() as f64;
            busy_steps += 1;
        }
        let mut k = 0;
        while k < running.len() {
            let live = running[k];
            if live.done >= trace[live.req].output {
                e.check_sequence(&live)?;
                running.remove(k);
                e.kv.free(live.id)?;
                e.out.outcome.finished += 1;
            } else {
                k += 1;
            }
        }
        step += 1;
    }
    e.kv.check_invariants()?;
    let o = &mut e.out.outcome;
    o.steps = step;
    o.mean_running = sum_running as f64 / step.max(1) as f64;
    o.bytes_per_running = sum_bytes / busy_steps.max(1) as f64;
    e.out.wall = start.elapsed();
    Ok(e.out)
}
