//! Capacity planner: model shape + memory budget -> blocks, tokens, max concurrency.
//!
//! The top layer of the crate. Given a model (`config.json` or a built-in name), the
//! precision of its weights, the KV dtype, the GPU's memory and the serving targets, it
//! answers the questions asked before a deployment: how many KV blocks are left once
//! the weights and the activations are in, how many tokens they hold, how many requests
//! of a given context run at once, and, when the target does not fit, what to change.
//!
//! All numbers are **per GPU**. With tensor parallelism of degree `tp`, each GPU holds
//! `1/tp` of the weights (norms are replicated) and `num_kv_heads / tp` KV heads (an
//! MLA latent is held whole by every GPU); a degree that does not divide the query and
//! KV heads is an error ([`Error::UnevenTensorParallel`]).
//!
//! # Formulas
//!
//! Weight parameters, read from the config (`h` = `hidden_size`, `i` =
//! `intermediate_size`, `V` = `vocab_size`, `L` = layers, `q = num_attention_heads *
//! head_dim`, `kv = num_key_value_heads * head_dim`):
//!
//! ```text
//! embedding   = V * h
//! attention   = L * (h*q + 2*h*kv + q*h)        q, k, v and o projections (GQA: k, v are h x kv)
//! attn bias   = L * (q + 2*kv)                  only where the model has q/k/v biases (Qwen2)
//! mlp         = L * 3*h*i                       gate, up, down
//! norms       = (2*L + 1) * h                   two RMSNorms per layer and the final one
//! lm_head     = V * h                           0 when tie_word_embeddings
//! ```
//!
//! Mixture-of-experts configs (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, gpt-oss, Llama-4,
//! read by [`config::ModelArch`]): with `E` routed experts of intermediate size
//! `e`, `S` shared experts, `k` experts per token and `M` MoE layers (the others dense
//! with their own intermediate size):
//!
//! ```text
//! experts     = M * E * 3*h*e                   every expert: all are resident
//! mlp         = (L - M) * 3*h*i_dense + M * S * 3*h*e_shared
//! router      = M * (E*h [+ E bias] [+ h shared-expert gate])
//! active      = total - experts + M * k * 3*h*e
//! ```
//!
//! Latent attention (DeepSeek-V2/V3/R1) counts its low-rank projections (`q_a`, `q_b`,
//! `kv_a_proj_with_mqa`, `kv_b`, `o`) and their norms, and its cache is the latent
//! layout ([`crate::layout::shape::KvKind::Latent`]): one vector of `kv_lora_rank +
//! qk_rope_head_dim` per token and layer, no K/V split and no KV heads. Every query
//! head reads that one vector, so under tensor parallelism each GPU holds all of it
//! (as vLLM's MLA backends do); only the query heads are split. A config with fields
//! that change memory and that the reader does not understand is refused unless told
//! to assume a dense model ([`PlanInput::assume_dense`]). Every count is checked
//! arithmetic: a config whose counts overflow 64 bits is an [`Error::ModelConfig`],
//! not a wrapped number.
//!
//! Bytes: the linear layers (attention, mlp, experts) are stored in the chosen
//! [`WeightPrecision`] (by default the one the config's `quantization_config` states);
//! embedding, lm_head, routers, biases and norms stay in 16 bits (32 with fp32
//! weights), as GPTQ/AWQ/fp8 checkpoints keep them. Per GPU every part is divided by
//! `tp` (rounded up) except the norms, which every GPU holds whole.
//!
//! Memory budget per GPU:
//!
//! ```text
//! usable      = floor(gpu_memory_bytes * gpu_memory_utilization)
//! kv_budget   = usable - weights_per_gpu - reserve            (0 when negative)
//! num_blocks  = floor(kv_budget / block_bytes)
//! block_bytes = block_size * 2 * L * (num_kv_heads/tp) * head_dim * kv_dtype_bytes
//! block_bytes = block_size * L * (kv_lora_rank + qk_rope_head_dim) * kv_dtype_bytes
//!                                                            (MLA, on every GPU)
//! ```
//!
//! Hybrid models (Qwen3-Next, Nemotron-H, Jamba, Granite 4.0-H; read into
//! [`config::HybridConfig`]): `L` above counts only the attention layers
//! in the attention and KV formulas, and each recurrent layer adds its projections
//! (`d` = `d_inner`, `G` groups, `N` state, `H` heads, `R` = `dt_rank`; gated DeltaNet
//! with key width `k = Hk Dk` and value width `v = Hv Dv`):
//!
//! ```text
//! Mamba-2     h*(2d + 2GN + H) + d*h             in_proj (z, x, B, C, dt), out_proj
//! Mamba       h*2d + d*(R + 2N) + R*d + d*h      in, x, dt and out projections
//! DeltaNet    h*(2k + 2v) + h*2Hv + v*h          in_proj_qkvz, in_proj_ba, out_proj
//! ```
//!
//! and its conv1d, `A_log`, `D`, `dt_bias` and norms, counted with the norms. Each
//! sequence holds a fixed recurrent state besides its KV blocks
//! ([`PlanInput::state_bytes_per_layer`]), in whole pages of the same arena:
//!
//! ```text
//! state_pages       = ceil(recurrent layers x (conv + ssm bytes) / block_bytes)
//! max_concurrency   = num_blocks / (blocks_per_request + state_pages)
//! ```
//!
//! The reserve for activations and workspace, when not given, is estimated as
//!
//! ```text
//! reserve = WORKSPACE_BYTES                                  CUDA context, cuBLAS and
//!                                                            attention workspaces, graphs
//!         + max_batch_tokens * act_bytes * (2*h + (q + 2*kv)/tp + 2*i/tp)
//!                                                            residual + normed input,
//!                                                            qkv output, gate+up output
//!         + min(concurrency, max_batch_tokens) * V * 4       f32 logits of the sampled rows
//! ```
//!
//! with `act_bytes` 2 (4 for fp32 weights). For MLA the qkv width `q + 2*kv` is
//! `heads * (qk_nope + qk_rope + qk_nope + v_head) + kv_lora_rank + qk_rope` (the
//! query, `kv_b` and `kv_a` outputs), divided by `tp` like the others. It is the peak
//! of one forward pass over `max_batch_tokens` tokens, the quantity vLLM measures with
//! a profiling run; it is an estimate, and [`PlanInput::reserve_bytes`] overrides it
//! with a measured value.
//!
//! ```
//! use pagedkv::plan::{ModelSpec, PlanInput, Verdict, GIB};
//!
//! let model = ModelSpec::resolve("llama3-8b")?;
//! let mut input = PlanInput::new(model, 80 * GIB);
//! input.context_tokens = 8192;
//! input.concurrency = 32;
//! let plan = input.plan()?;
//! assert_eq!(plan.kv_bytes_per_token, 128 * 1024); // 2 * 32 layers * 8 heads * 128 * 2 B
//! assert!(matches!(plan.verdict, Verdict::Fits));
//! println!("{plan}");
//! # Ok::<(), pagedkv::Error>(())
//! ```

use std::fmt;

use crate::error::{Error, Result};
use crate::layout::shape::{DType, KvKind};
use crate::layout::KvLayout;
use crate::manager::groups::GroupSpec;

pub mod config;
pub mod gguf;

pub use config::ModelConfig;
use config::{builtin, HybridConfig, LayerKind, QuantScheme, Quantization, StateMixer};

/// Bytes in one GiB.
pub const GIB: u64 = 1 << 30;

/// Fixed part of the estimated reserve: CUDA context, cuBLAS and attention workspaces,
/// CUDA graphs (1 GiB).
pub const WORKSPACE_BYTES: u64 = GIB;

/// Default for [`PlanInput::max_batch_tokens`] (tokens in one forward pass).
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 8192;

/// Largest tensor-parallel degree the planner suggests: one node of eight GPUs.
pub const MAX_SUGGESTED_TP: usize = 8;

/// GPU sizes, in GiB, of the sweep mode.
pub const SWEEP_GPU_GIB: [f64; 4] = [24.0, 48.0, 80.0, 141.0];

/// KV dtypes of the sweep mode (f16 is the size of bf16, so it is left out).
pub const SWEEP_KV_DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::Fp8E4M3];

/// How the weights of the linear layers are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightPrecision {
    /// 32-bit floats.
    F32,
    /// 16-bit floats (f16 or bf16).
    F16,
    /// 8-bit weights (int8 or fp8). Per-tensor or per-channel scales are under 0.1 % of
    /// the bytes and not counted.
    Int8,
    /// 4-bit weights (GPTQ/AWQ style) with one f16 scale per `group_size` weights and no
    /// zero points (symmetric).
    Int4 {
        /// Weights sharing one scale (128 is the common choice).
        group_size: usize,
    },
    /// 4-bit weights with one f16 scale and one 4-bit zero point per `group_size`
    /// weights (AWQ; GPTQ checkpoints store zero points even when symmetric). GPTQ's
    /// per-input-row `g_idx` (4 bytes a row, about 0.1 %) is not counted.
    Int4Zp {
        /// Weights sharing one scale and zero point.
        group_size: usize,
    },
    /// 8-bit floats with one f32 scale per `rows x cols` block (DeepSeek-V3's
    /// `weight_block_size: [128, 128]`).
    Fp8Block {
        /// Block rows.
        rows: usize,
        /// Block columns.
        cols: usize,
    },
    /// bitsandbytes 4-bit (NF4/FP4): blocks of 64 weights with an f32 absmax each, or
    /// with `double_quant` an 8-bit absmax each plus one f32 per 256 blocks.
    Nf4 {
        /// `bnb_4bit_use_double_quant`.
        double_quant: bool,
    },
    /// MXFP4: 4-bit floats with one 8-bit shared exponent per 32 weights.
    Mxfp4,
}

impl WeightPrecision {
    /// The precisions the planner tries when suggesting a smaller one, largest first.
    pub const LADDER: [WeightPrecision; 4] = [
        WeightPrecision::F32,
        WeightPrecision::F16,
        WeightPrecision::Int8,
        WeightPrecision::Int4 { group_size: 128 },
    ];

    /// Parses `fp32`/`f32`, `fp16`/`f16`/`bf16`, `int8`/`fp8`, `int4` (group 128),
    /// `int4-gN` (group `N`), `int4zp-gN` (with zero points), `fp8-bRxC` (block-wise
    /// fp8), `nf4`, `nf4-dq` or `mxfp4`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown name or a group or block size of 0.
    pub fn parse(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        let positive = |t: &str| t.parse::<usize>().ok().filter(|&g| g > 0);
        let parsed = match lower.as_str() {
            "fp32" | "f32" | "float32" => Some(WeightPrecision::F32),
            "fp16" | "f16" | "bf16" | "float16" | "bfloat16" | "16-bit" => {
                Some(WeightPrecision::F16)
            }
            "int8" | "fp8" | "w8" => Some(WeightPrecision::Int8),
            "int4" | "w4" => Some(WeightPrecision::Int4 { group_size: 128 }),
            "nf4" => Some(WeightPrecision::Nf4 {
                double_quant: false,
            }),
            "nf4-dq" => Some(WeightPrecision::Nf4 { double_quant: true }),
            "mxfp4" => Some(WeightPrecision::Mxfp4),
            other => {
                if let Some(g) = other.strip_prefix("int4zp-g") {
                    positive(g).map(|group_size| WeightPrecision::Int4Zp { group_size })
                } else if let Some(g) = other.strip_prefix("int4-g") {
                    positive(g).map(|group_size| WeightPrecision::Int4 { group_size })
                } else if let Some(b) = other.strip_prefix("fp8-b") {
                    b.split_once('x').and_then(|(r, c)| {
                        Some(WeightPrecision::Fp8Block {
                            rows: positive(r)?,
                            cols: positive(c)?,
                        })
                    })
                } else {
                    None
                }
            }
        };
        parsed.ok_or_else(|| {
            Error::config(
                "weight_precision",
                format!("unknown precision {name:?}; expected fp32, fp16, bf16, int8, fp8, int4, int4-gN, int4zp-gN, fp8-bRxC, nf4, nf4-dq or mxfp4"),
            )
        })
    }

    /// Short name (`fp32`, `16-bit`, `int8`, `int4-g128`, ...); [`Self::parse`] reads it
    /// back.
    pub fn name(&self) -> String {
        match self {
            WeightPrecision::F32 => "fp32".into(),
            WeightPrecision::F16 => "16-bit".into(),
            WeightPrecision::Int8 => "int8".into(),
            WeightPrecision::Int4 { group_size } => format!("int4-g{group_size}"),
            WeightPrecision::Int4Zp { group_size } => format!("int4zp-g{group_size}"),
            WeightPrecision::Fp8Block { rows, cols } => format!("fp8-b{rows}x{cols}"),
            WeightPrecision::Nf4 {
                double_quant: false,
            } => "nf4".into(),
            WeightPrecision::Nf4 { double_quant: true } => "nf4-dq".into(),
            WeightPrecision::Mxfp4 => "mxfp4".into(),
        }
    }

    /// The precision a checkpoint's `quantization_config` describes.
    ///
    /// GPTQ's per-column groups (`group_size: -1`) are counted as groups of `hidden_size`.
    pub fn from_quantization(q: &Quantization, hidden_size: usize) -> Self {
        match q.scheme {
            QuantScheme::Fp8 { block: None } | QuantScheme::Int8 => WeightPrecision::Int8,
            QuantScheme::Fp8 {
                block: Some((rows, cols)),
            } => WeightPrecision::Fp8Block { rows, cols },
            QuantScheme::Int4 {
                group_size,
                zero_point,
            } => {
                let group_size = group_size.unwrap_or(hidden_size).max(1);
                if zero_point {
                    WeightPrecision::Int4Zp { group_size }
                } else {
                    WeightPrecision::Int4 { group_size }
                }
            }
            QuantScheme::Nf4 { double_quant } => WeightPrecision::Nf4 { double_quant },
            QuantScheme::Mxfp4 => WeightPrecision::Mxfp4,
        }
    }

    /// Bytes of `params` linear-layer weights: `4n`, `2n`, `n`; `ceil(n/2) + 2 *
    /// ceil(n / group_size)` for int4 (plus `ceil(groups / 2)` zero-point bytes for
    /// int4zp); `n + 4 * ceil(n / (rows * cols))` for block-wise fp8; `ceil(n/2) +
    /// 4 * ceil(n/64)` for nf4 (`ceil(n/64) + 4 * ceil(n/16384)` of absmax with double
    /// quantization); `ceil(n/2) + ceil(n/32)` for mxfp4.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] when the bytes do not fit in a `u64`, or for a group or
    /// block size of 0.
    pub fn linear_bytes(&self, params: u64) -> Result<u64> {
        let overflow = || Error::OutOfRange {
            field: "weight parameters",
            value: params as f64,
            allowed: "few enough that their bytes fit in 64 bits",
        };
        let per = |size: usize| -> Result<u64> {
            if size == 0 {
                return Err(Error::OutOfRange {
                    field: "group or block size",
                    value: 0.0,
                    allowed: "at least 1",
                });
            }
            Ok(params.div_ceil(size as u64))
        };
        let half = params.div_ceil(2);
        let bytes = match *self {
            WeightPrecision::F32 => params.checked_mul(4),
            WeightPrecision::F16 => params.checked_mul(2),
            WeightPrecision::Int8 => Some(params),
            WeightPrecision::Int4 { group_size } => {
                let groups = per(group_size)?;
                groups.checked_mul(2).and_then(|s| s.checked_add(half))
            }
            WeightPrecision::Int4Zp { group_size } => {
                let groups = per(group_size)?;
                groups
                    .checked_mul(2)
                    .and_then(|s| s.checked_add(half))
                    .and_then(|s| s.checked_add(groups.div_ceil(2)))
            }
            WeightPrecision::Fp8Block { rows, cols } => {
                let block = rows.checked_mul(cols).ok_or_else(overflow)?;
                per(block)?
                    .checked_mul(4)
                    .and_then(|s| s.checked_add(params))
            }
            WeightPrecision::Nf4 { double_quant } => {
                let blocks = per(64)?;
                let absmax = if double_quant {
                    blocks.checked_add(per(64 * 256)?.saturating_mul(4))
                } else {
                    blocks.checked_mul(4)
                };
                absmax.and_then(|a| a.checked_add(half))
            }
            WeightPrecision::Mxfp4 => per(32)?.checked_add(half),
        };
        bytes.ok_or_else(overflow)
    }

    /// Bytes per element of the parts kept unquantized (embedding, lm_head, norms,
    /// biases) and of activations: 4 for fp32 weights, 2 otherwise.
    pub const fn dense_elem_bytes(&self) -> u64 {
        match self {
            WeightPrecision::F32 => 4,
            _ => 2,
        }
    }
}

impl fmt::Display for WeightPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// A model as the planner sees it: its config plus what the config says about biases.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The parsed `config.json`.
    pub config: ModelConfig,
    /// Whether the q/k/v projections carry biases (`attention_bias`; Qwen2 models do
    /// without saying so).
    pub attention_bias: bool,
}

/// Checked product of named factors; the error names them and their values.
fn product(what: &str, factors: &[(&str, u64)]) -> Result<u64> {
    factors
        .iter()
        .try_fold(1u64, |acc, &(_, f)| acc.checked_mul(f))
        .ok_or_else(|| {
            let terms: Vec<String> = factors.iter().map(|(n, v)| format!("{n} {v}")).collect();
            Error::ModelConfig(format!("{what} overflows 64 bits: {}", terms.join(" x ")))
        })
}

/// Checked sum; the error names what was summed.
fn sum(what: &str, parts: &[u64]) -> Result<u64> {
    parts
        .iter()
        .try_fold(0u64, |acc, &p| acc.checked_add(p))
        .ok_or_else(|| Error::ModelConfig(format!("{what} overflows 64 bits: {parts:?}")))
}

impl ModelSpec {
    /// Reads a `config.json` text.
    ///
    /// # Errors
    /// As [`ModelConfig::from_json_str`]; [`Error::ModelConfig`] when the config lacks
    /// `intermediate_size` or `vocab_size`, which the weight estimate needs.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let config = ModelConfig::from_json_str(text)?;
        if config.intermediate_size == 0 || config.vocab_size == 0 {
            return Err(Error::ModelConfig(format!(
                "{}: the planner needs intermediate_size and vocab_size (got {} and {})",
                config.name, config.intermediate_size, config.vocab_size
            )));
        }
        let attention_bias = config.arch.attention_bias;
        Ok(ModelSpec {
            config,
            attention_bias,
        })
    }

    /// Reads a `config.json` file.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read, otherwise as [`Self::from_json_str`].
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        Self::from_json_str(&text)
    }

    /// A built-in name ([`builtin::NAMES`]), a `.gguf` file (shape from its metadata; its
    /// quantization is not read: weights count at 16 bits unless overridden), or else a
    /// path to a `config.json`.
    ///
    /// # Errors
    /// As [`Self::from_file`] when the name is not built in.
    pub fn resolve(name_or_path: &str) -> Result<Self> {
        if let Some(text) = builtin::by_name(name_or_path) {
            return Self::from_json_str(text);
        }
        if name_or_path.ends_with(".gguf") {
            // The shape from the GGUF's metadata; its per-tensor quantization is not
            // read, so weights count at 16 bits unless the caller says otherwise.
            let config = ModelConfig::from_gguf_file(name_or_path, DType::BF16)?;
            return Ok(ModelSpec {
                config,
                attention_bias: false,
            });
        }
        Self::from_file(name_or_path)
    }

    /// The precision of the linear layers the config states (`quantization_config`),
    /// or `None` for an unquantized checkpoint.
    pub fn config_precision(&self) -> Option<WeightPrecision> {
        self.config
            .arch
            .quantization
            .as_ref()
            .map(|q| WeightPrecision::from_quantization(q, self.config.hidden_size))
    }

    /// Parameter counts of the whole (unsharded) model, by part. Every routed expert
    /// is counted: all are resident.
    ///
    /// # Errors
    /// [`Error::ModelConfig`] when the config has fields that change memory and that
    /// the reader does not understand ([`config::ModelArch::unrecognized`], named
    /// in the message), or when a count overflows 64 bits.
    pub fn param_counts(&self) -> Result<ParamCounts> {
        self.refuse_unrecognized()?;
        self.counts()
    }

    /// As [`Self::param_counts`], but counts a config with unrecognized fields as the
    /// dense model its other fields describe (the `--assume-dense` override).
    ///
    /// # Errors
    /// [`Error::ModelConfig`] when a count overflows 64 bits.
    pub fn param_counts_assuming_dense(&self) -> Result<ParamCounts> {
        self.counts()
    }

    /// [`Error::ModelConfig`] naming the fields this planner does not understand.
    fn refuse_unrecognized(&self) -> Result<()> {
        let arch = &self.config.arch;
        if arch.unrecognized.is_empty() {
            return Ok(());
        }
        Err(Error::ModelConfig(format!(
            "{} (model_type {}): fields that change memory and that the planner does not understand: {}; refusing to guess (assume_dense / --assume-dense counts it as a dense model)",
            self.config.name,
            arch.model_type.as_deref().unwrap_or("absent"),
            arch.unrecognized.join(", ")
        )))
    }

    fn counts(&self) -> Result<ParamCounts> {
        let c = &self.config;
        let s = &c.shape;
        let a = &c.arch;
        let (h, v, l) = (
            c.hidden_size as u64,
            c.vocab_size as u64,
            s.num_layers as u64,
        );
        let heads = s.num_q_heads as u64;
        let q = product(
            "query width",
            &[
                ("num_attention_heads", heads),
                ("head_dim", s.head_dim as u64),
            ],
        )?;
        let kv = product(
            "key/value width",
            &[
                ("num_key_value_heads", s.num_kv_heads as u64),
                ("head_dim", s.head_dim as u64),
            ],
        )?;
        let hp = ("hidden_size", h);
        let lp = ("num_hidden_layers", l);
        // A hybrid model has attention in some layers only (module docs).
        let hybrid = a.hybrid.as_ref();
        let alp = (
            "attention layers",
            hybrid.map_or(l, |hy| hy.count(LayerKind::Attention) as u64),
        );

        // Attention projections of one layer, and the norms inside attention.
        let (attn_layer, attn_norms_layer, qk_width) = match &a.mla {
            Some(m) => {
                let qk_head = sum(
                    "qk head dim",
                    &[m.qk_nope_head_dim as u64, m.qk_rope_head_dim as u64],
                )?;
                let q_out = product(
                    "MLA query width",
                    &[("num_attention_heads", heads), ("qk_nope+rope", qk_head)],
                )?;
                let (q_proj, q_norm) = match m.q_lora_rank {
                    Some(r) => {
                        let r = r as u64;
                        (
                            sum(
                                "MLA query projections",
                                &[
                                    product("q_a_proj", &[hp, ("q_lora_rank", r)])?,
                                    product(
                                        "q_b_proj",
                                        &[("q_lora_rank", r), ("heads x qk head", q_out)],
                                    )?,
                                ],
                            )?,
                            r,
                        )
                    }
                    None => (product("q_proj", &[hp, ("heads x qk head", q_out)])?, 0),
                };
                let kvr = m.kv_lora_rank as u64;
                let kv_a = product(
                    "kv_a_proj_with_mqa",
                    &[
                        hp,
                        (
                            "kv_lora_rank+qk_rope_head_dim",
                            sum("kv_a width", &[kvr, m.qk_rope_head_dim as u64])?,
                        ),
                    ],
                )?;
                let kv_b_out = product(
                    "kv_b width",
                    &[
                        ("num_attention_heads", heads),
                        (
                            "qk_nope+v head dim",
                            sum(
                                "kv_b head",
                                &[m.qk_nope_head_dim as u64, m.v_head_dim as u64],
                            )?,
                        ),
                    ],
                )?;
                let kv_b = product(
                    "kv_b_proj",
                    &[("kv_lora_rank", kvr), ("heads x (nope+v)", kv_b_out)],
                )?;
                let o = product(
                    "o_proj",
                    &[
                        ("num_attention_heads", heads),
                        ("v_head_dim", m.v_head_dim as u64),
                        hp,
                    ],
                )?;
                (
                    sum("MLA attention", &[q_proj, kv_a, kv_b, o])?,
                    sum("MLA norms", &[q_norm, kvr])?,
                    0,
                )
            }
            None => {
                let qkv_o = sum(
                    "attention",
                    &[
                        product("q_proj", &[hp, ("q width", q)])?,
                        product("k_proj + v_proj", &[hp, ("kv width", kv), ("k and v", 2)])?,
                        product("o_proj", &[("q width", q), hp])?,
                        // Qwen3-Next's q_proj also outputs a gate as wide as the queries.
                        if hybrid.is_some_and(|h| h.attention_output_gate) {
                            product("output gate", &[hp, ("q width", q)])?
                        } else {
                            0
                        },
                    ],
                )?;
                (
                    qkv_o,
                    0,
                    if a.qk_norm {
                        product(
                            "q/k norms",
                            &[("head_dim", s.head_dim as u64), ("q and k", 2)],
                        )?
                    } else {
                        0
                    },
                )
            }
        };
        let attention = product("attention", &[alp, ("per layer", attn_layer)])?;
        let mut bias_layer = 0u64;
        if self.attention_bias {
            bias_layer = sum("q/k/v biases", &[q, kv, kv])?;
        }
        if a.o_proj_bias {
            bias_layer = sum("o bias", &[bias_layer, h])?;
        }
        if a.attention_sinks {
            bias_layer = sum("attention sinks", &[bias_layer, heads])?;
        }
        let attention_bias = product("attention biases", &[alp, ("per layer", bias_layer)])?;

        // Feed-forward: dense layers, shared experts, routed experts, routers.
        let ffn = |what: &str, width: u64| {
            product(what, &[("gate, up, down", 3), hp, ("intermediate", width)])
        };
        let (mlp, experts, active_experts, router) = match &a.moe {
            None if hybrid.is_some() => {
                let hy =
                    hybrid.map(|hy| (hy.ffn_layers, hy.ffn_matrices, hy.ffn_intermediate_size));
                let (layers, matrices, width) = hy.unwrap_or_default();
                (
                    product(
                        "mlp",
                        &[
                            ("feed-forward layers", layers as u64),
                            ("matrices", matrices as u64),
                            hp,
                            ("intermediate", width as u64),
                        ],
                    )?,
                    0,
                    0,
                    0,
                )
            }
            None => (
                product(
                    "mlp",
                    &[lp, ("per layer", ffn("mlp", c.intermediate_size as u64)?)],
                )?,
                0,
                0,
                0,
            ),
            Some(m) => {
                let moe_layers = m.num_moe_layers as u64;
                let dense_layers = l - moe_layers.min(l);
                let dense = product(
                    "dense mlp",
                    &[
                        ("dense layers", dense_layers),
                        (
                            "per layer",
                            ffn("dense mlp", m.dense_intermediate_size as u64)?,
                        ),
                    ],
                )?;
                let mut expert = ffn("expert", m.expert_intermediate_size as u64)?;
                if m.expert_bias {
                    // gate+up bias (2 i) and down bias (h)
                    expert = sum(
                        "expert biases",
                        &[
                            expert,
                            product(
                                "gate/up bias",
                                &[
                                    ("2", 2),
                                    ("intermediate", m.expert_intermediate_size as u64),
                                ],
                            )?,
                            h,
                        ],
                    )?;
                }
                let shared = product(
                    "shared experts",
                    &[
                        ("moe layers", moe_layers),
                        ("n_shared_experts", m.num_shared_experts as u64),
                        (
                            "per expert",
                            ffn("shared expert", m.shared_intermediate_size as u64)?,
                        ),
                    ],
                )?;
                let experts = product(
                    "routed experts",
                    &[
                        ("moe layers", moe_layers),
                        ("experts", m.num_experts as u64),
                        ("per expert", expert),
                    ],
                )?;
                let active = product(
                    "active experts",
                    &[
                        ("moe layers", moe_layers),
                        (
                            "experts per token",
                            m.experts_per_token.min(m.num_experts) as u64,
                        ),
                        ("per expert", expert),
                    ],
                )?;
                let mut router_layer = product("router", &[hp, ("experts", m.num_experts as u64)])?;
                if m.router_bias || m.router_score_bias {
                    router_layer = sum("router bias", &[router_layer, m.num_experts as u64])?;
                }
                if m.shared_expert_gate {
                    router_layer = sum("shared expert gate", &[router_layer, h])?;
                }
                let router = product(
                    "routers",
                    &[("moe layers", moe_layers), ("per layer", router_layer)],
                )?;
                (sum("mlp", &[dense, shared])?, experts, active, router)
            }
        };
        let norm_vectors = sum(
            "norms",
            &[
                product(
                    "layer norms",
                    &[lp, ("per layer", a.norms_per_layer as u64)],
                )?,
                1,
            ],
        )?;
        let norms = sum(
            "norms",
            &[
                product("hidden norms", &[("norm vectors", norm_vectors), hp])?,
                product(
                    "attention norms",
                    &[
                        alp,
                        (
                            "per layer",
                            sum("attention norms", &[attn_norms_layer, qk_width])?,
                        ),
                    ],
                )?,
            ],
        )?;
        let (recurrent, recurrent_small) = match hybrid {
            Some(hy) => {
                let n = hy.count(LayerKind::Recurrent) as u64;
                let (linear, small) = recurrent_layer_params(hy, h)?;
                (
                    product(
                        "recurrent layers",
                        &[("recurrent layers", n), ("per layer", linear)],
                    )?,
                    product(
                        "recurrent small tensors",
                        &[("recurrent layers", n), ("per layer", small)],
                    )?,
                )
            }
            None => (0, 0),
        };
        let norms = sum("norms", &[norms, recurrent_small])?;
        let embedding = product("embedding", &[("vocab_size", v), hp])?;
        let counts = ParamCounts {
            recurrent,
            embedding,
            attention,
            attention_bias,
            mlp,
            norms,
            lm_head: if c.tie_word_embeddings { 0 } else { embedding },
            experts,
            active_experts,
            router,
        };
        // The total must fit too, so `total()` never saturates for counts made here.
        sum(
            "parameter count",
            &[
                counts.embedding,
                counts.attention,
                counts.attention_bias,
                counts.mlp,
                counts.norms,
                counts.lm_head,
                counts.experts,
                counts.router,
                counts.recurrent,
            ],
        )?;
        Ok(counts)
    }
}

/// Channels of a recurrent layer's depthwise convolution, on one GPU of `tp` (the
/// conv state's width): `d_inner` (Mamba), `d_inner + 2 groups N` (Mamba-2, with the
/// caller's group count), `2 Hk Dk + Hv Dv` (gated DeltaNet's q, k and v).
fn conv_channels(mixer: &StateMixer, mamba2_groups: usize) -> Result<u64> {
    match *mixer {
        StateMixer::Mamba1 { d_inner, .. } => Ok(d_inner as u64),
        StateMixer::Mamba2 {
            d_inner, d_state, ..
        } => sum(
            "conv channels",
            &[
                d_inner as u64,
                product(
                    "B and C channels",
                    &[
                        ("2", 2),
                        ("groups", mamba2_groups as u64),
                        ("d_state", d_state as u64),
                    ],
                )?,
            ],
        ),
        StateMixer::GatedDeltaNet { .. } => {
            let (key, value) = deltanet_widths(mixer)?;
            sum("conv channels", &[key, key, value])
        }
    }
}

/// Gated DeltaNet's key and value widths, `Hk Dk` and `Hv Dv` (0 for Mamba).
fn deltanet_widths(mixer: &StateMixer) -> Result<(u64, u64)> {
    match *mixer {
        StateMixer::GatedDeltaNet {
            num_k_heads,
            num_v_heads,
            head_k_dim,
            head_v_dim,
            ..
        } => Ok((
            product(
                "key width",
                &[("heads", num_k_heads as u64), ("dim", head_k_dim as u64)],
            )?,
            product(
                "value width",
                &[("heads", num_v_heads as u64), ("dim", head_v_dim as u64)],
            )?,
        )),
        _ => Ok((0, 0)),
    }
}

/// Parameters of one recurrent layer of `hy` with hidden size `h`: (projections,
/// small tensors), as the models' reference implementations build them (module docs).
fn recurrent_layer_params(hy: &HybridConfig, h: u64) -> Result<(u64, u64)> {
    let hp = ("hidden_size", h);
    let conv_bias = u64::from(hy.conv_bias);
    let proj_bias = u64::from(hy.proj_bias);
    match hy.mixer {
        StateMixer::GatedDeltaNet {
            num_v_heads,
            head_v_dim,
            conv_kernel,
            ..
        } => {
            let (key, value) = deltanet_widths(&hy.mixer)?;
            let nv = num_v_heads as u64;
            let qkvz = sum("q, k, v, z", &[key, key, value, value])?;
            let linear = sum(
                "gated DeltaNet projections",
                &[
                    product("in_proj_qkvz", &[hp, ("2 key + 2 value", qkvz)])?,
                    product("in_proj_ba", &[hp, ("2 value heads", 2 * nv)])?,
                    product("out_proj", &[("value width", value), hp])?,
                ],
            )?;
            let conv_dim = conv_channels(&hy.mixer, 0)?;
            let small = sum(
                "gated DeltaNet small tensors",
                &[
                    product(
                        "conv1d",
                        &[
                            ("channels", conv_dim),
                            ("kernel", conv_kernel as u64 + conv_bias),
                        ],
                    )?,
                    2 * nv,            // dt_bias, A_log
                    head_v_dim as u64, // gated RMSNorm
                ],
            )?;
            Ok((linear, small))
        }
        StateMixer::Mamba2 {
            d_inner,
            num_heads,
            d_state,
            n_groups,
            conv_kernel,
            ..
        } => {
            let d = d_inner as u64;
            let bc = product(
                "B and C",
                &[
                    ("2", 2),
                    ("n_groups", n_groups as u64),
                    ("d_state", d_state as u64),
                ],
            )?;
            let in_width = sum("in_proj width", &[d, d, bc, num_heads as u64])?;
            let linear = sum(
                "Mamba-2 projections",
                &[
                    product("in_proj", &[hp, ("z, x, B, C, dt", in_width)])?,
                    product("out_proj", &[("d_inner", d), hp])?,
                    proj_bias * sum("projection biases", &[in_width, h])?,
                ],
            )?;
            let conv_dim = conv_channels(&hy.mixer, n_groups)?;
            let small = sum(
                "Mamba-2 small tensors",
                &[
                    product(
                        "conv1d",
                        &[
                            ("channels", conv_dim),
                            ("kernel", conv_kernel as u64 + conv_bias),
                        ],
                    )?,
                    3 * num_heads as u64, // dt_bias, A_log, D
                    d,                    // gated RMSNorm
                ],
            )?;
            Ok((linear, small))
        }
        StateMixer::Mamba1 {
            d_inner,
            d_state,
            conv_kernel,
            dt_rank,
        } => {
            let (d, n, r) = (d_inner as u64, d_state as u64, dt_rank as u64);
            let linear = sum(
                "Mamba projections",
                &[
                    product("in_proj", &[hp, ("x and z", 2 * d)])?,
                    product(
                        "x_proj",
                        &[("d_inner", d), ("dt_rank + 2 d_state", r + 2 * n)],
                    )?,
                    product("dt_proj", &[("dt_rank", r), ("d_inner", d)])?,
                    product("out_proj", &[("d_inner", d), hp])?,
                    proj_bias * sum("projection biases", &[2 * d, h])?,
                ],
            )?;
            let small = sum(
                "Mamba small tensors",
                &[
                    product(
                        "conv1d",
                        &[("channels", d), ("kernel", conv_kernel as u64 + conv_bias)],
                    )?,
                    d, // dt_proj bias
                    product("A_log", &[("d_inner", d), ("d_state", n)])?,
                    d,         // D
                    r + 2 * n, // Jamba's dt, B, C norms
                ],
            )?;
            Ok((linear, small))
        }
    }
}

/// Parameters of a model, by part (see the module docs for the formulas).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ParamCounts {
    /// Token embedding.
    pub embedding: u64,
    /// Attention projections of all layers (q, k, v, o; MLA's low-rank projections).
    pub attention: u64,
    /// Attention biases of all layers (0 for models without them), and gpt-oss's sinks.
    pub attention_bias: u64,
    /// Dense feed-forward layers (gate, up, down) and shared experts.
    pub mlp: u64,
    /// Norm weights, and the small per-channel tensors of recurrent layers (conv1d
    /// weights and biases, `A_log`, `D`, `dt_bias`), kept in 16 bits and replicated.
    pub norms: u64,
    /// Output projection (0 when tied to the embedding).
    pub lm_head: u64,
    /// Every routed expert of every MoE layer (all are resident), with their biases.
    pub experts: u64,
    /// The routed-expert parameters one token uses (`experts_per_token` per MoE layer).
    pub active_experts: u64,
    /// Routers (and shared-expert gates, score-correction biases), kept in 16 bits.
    pub router: u64,
    /// The projections of a hybrid model's recurrent (Mamba, gated-DeltaNet) layers,
    /// stored like the other linear layers; their convolutions, decay and skip vectors
    /// and norms count with [`Self::norms`].
    pub recurrent: u64,
}

impl ParamCounts {
    /// All parameters (saturating; counts from [`ModelSpec::param_counts`] are checked
    /// to fit, and a saturated sum can only overstate memory).
    pub const fn total(&self) -> u64 {
        self.embedding
            .saturating_add(self.attention)
            .saturating_add(self.attention_bias)
            .saturating_add(self.mlp)
            .saturating_add(self.norms)
            .saturating_add(self.lm_head)
            .saturating_add(self.experts)
            .saturating_add(self.router)
            .saturating_add(self.recurrent)
    }

    /// Parameters one token uses: everything but the routed experts it is not sent to.
    /// Publications differ on whether the input embedding counts; see
    /// [`Self::active_without_embedding`].
    pub const fn active(&self) -> u64 {
        self.total()
            .saturating_sub(self.experts)
            .saturating_add(self.active_experts)
    }

    /// [`Self::active`] less the input embedding (a lookup, not a matmul): the
    /// convention of the gpt-oss and DeepSeek model cards.
    pub const fn active_without_embedding(&self) -> u64 {
        self.active().saturating_sub(self.embedding)
    }

    /// Bytes one GPU holds with the linear layers in `precision` split `tp` ways.
    ///
    /// # Errors
    /// As [`Self::bytes_per_gpu_mixed`].
    pub fn bytes_per_gpu(&self, precision: WeightPrecision, tp: usize) -> Result<u64> {
        self.bytes_per_gpu_mixed(precision, precision, tp)
    }

    /// Bytes one GPU holds with the feed-forward layers and experts in `linear`, the
    /// attention projections in `attention`, split `tp` ways (norms replicated).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] when a byte count overflows 64 bits.
    pub fn bytes_per_gpu_mixed(
        &self,
        linear: WeightPrecision,
        attention: WeightPrecision,
        tp: usize,
    ) -> Result<u64> {
        let tp = tp.max(1) as u64;
        let overflow = || Error::OutOfRange {
            field: "weight bytes",
            value: self.total() as f64,
            allowed: "a model whose bytes fit in 64 bits",
        };
        let dense = linear.dense_elem_bytes();
        let (attn, ffn) = if linear == attention {
            (
                0,
                linear.linear_bytes(
                    self.attention
                        .checked_add(self.mlp)
                        .and_then(|n| n.checked_add(self.experts))
                        .and_then(|n| n.checked_add(self.recurrent))
                        .ok_or_else(overflow)?
                        .div_ceil(tp),
                )?,
            )
        } else {
            (
                attention.linear_bytes(self.attention.div_ceil(tp))?,
                linear.linear_bytes(
                    self.mlp
                        .checked_add(self.experts)
                        .and_then(|n| n.checked_add(self.recurrent))
                        .ok_or_else(overflow)?
                        .div_ceil(tp),
                )?,
            )
        };
        let sharded_dense = self
            .embedding
            .checked_add(self.lm_head)
            .and_then(|n| n.checked_add(self.attention_bias))
            .and_then(|n| n.checked_add(self.router))
            .ok_or_else(overflow)?
            .div_ceil(tp);
        dense
            .checked_mul(sharded_dense)
            .and_then(|d| d.checked_add(dense.checked_mul(self.norms)?))
            .and_then(|d| d.checked_add(attn))
            .and_then(|d| d.checked_add(ffn))
            .ok_or_else(overflow)
    }
}

/// Optional hook for reading a GPU's memory size; a CUDA backend implements it so the
/// planner can use the real number instead of one typed by hand.
pub trait DeviceMemory {
    /// Total memory of the device, in bytes.
    ///
    /// # Errors
    /// Whatever the backend reports (no device, driver failure).
    fn total_memory_bytes(&self) -> Result<u64>;
}

/// Everything the planner needs. Build it with [`PlanInput::new`] and change the fields.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    /// The model.
    pub model: ModelSpec,
    /// Storage of the linear-layer weights.
    pub weight_precision: WeightPrecision,
    /// Element type of the KV cache.
    pub kv_dtype: DType,
    /// Memory of one GPU, in bytes.
    pub gpu_memory_bytes: u64,
    /// Fraction of the GPU's memory the engine may use, in `(0, 1]` (vLLM's
    /// `gpu_memory_utilization`).
    pub gpu_memory_utilization: f64,
    /// Bytes kept for activations and workspace; `None` estimates them (module docs).
    pub reserve_bytes: Option<u64>,
    /// Tokens in one forward pass (vLLM's `max_num_batched_tokens`), for the reserve
    /// estimate.
    pub max_batch_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Tokens of one request (prompt + output) the deployment must serve.
    pub context_tokens: usize,
    /// Requests of `context_tokens` tokens that must run at once.
    pub concurrency: usize,
    /// Tensor-parallel degree (GPUs one replica spans).
    pub tensor_parallel: usize,
    /// Storage of the attention projections when it differs from `weight_precision`
    /// (gpt-oss keeps attention in 16 bits and quantizes only the experts); `None`:
    /// the same.
    pub attention_precision: Option<WeightPrecision>,
    /// Plan a model whose config has fields the planner does not understand as the
    /// dense model its other fields describe, instead of refusing. The plan's notes say
    /// what was assumed.
    pub assume_dense: bool,
    /// Element type of the recurrent layers' conv state (hybrid models). Default: the
    /// model's own dtype (`torch_dtype`), as vLLM's `mamba_cache_dtype="auto"` keeps it.
    pub conv_state_dtype: DType,
    /// Element type of the recurrent layers' SSM / DeltaNet state (hybrid models).
    /// Default: what the config asks for (`mamba_ssm_cache_dtype`), else f32. The
    /// state is a running sum over the whole context, which the reference kernels
    /// (`mamba_ssm`, flash-linear-attention) accumulate in f32 and SGLang keeps in f32
    /// by default; vLLM's `"auto"` stores the model dtype instead, half the bytes. f32
    /// is the larger of the two, so a plan made with it is never short of memory; set
    /// bf16 to match an engine that stores it so.
    pub ssm_state_dtype: DType,
}

impl PlanInput {
    /// Defaults: weights as the config's `quantization_config` says (16 bits when it
    /// says nothing), KV in bf16, utilisation 0.9, estimated reserve, 8192 batch tokens,
    /// 16-token blocks, the model's whole context (4096 when the config does not say),
    /// 1 request, no tensor parallelism, no dense assumption.
    pub fn new(model: ModelSpec, gpu_memory_bytes: u64) -> Self {
        let context = match model.config.max_position_embeddings {
            0 => 4096,
            n => n,
        };
        let weight_precision = model.config_precision().unwrap_or(WeightPrecision::F16);
        let conv_state_dtype = model.config.shape.kv_dtype;
        let ssm_state_dtype = model
            .config
            .arch
            .hybrid
            .as_ref()
            .and_then(|h| h.ssm_dtype)
            .unwrap_or(DType::F32);
        let attention_precision = model
            .config
            .arch
            .quantization
            .filter(|q| q.attention_unquantized)
            .map(|_| WeightPrecision::F16);
        PlanInput {
            model,
            weight_precision,
            attention_precision,
            assume_dense: false,
            conv_state_dtype,
            ssm_state_dtype,
            kv_dtype: DType::BF16,
            gpu_memory_bytes,
            gpu_memory_utilization: 0.9,
            reserve_bytes: None,
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
            block_size: 16,
            context_tokens: context,
            concurrency: 1,
            tensor_parallel: 1,
        }
    }

    /// Sets the GPU memory from `gib` GiB.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] unless `gib` is finite, positive and at most 2^64 bytes.
    pub fn set_gpu_memory_gib(&mut self, gib: f64) -> Result<()> {
        // `as u64` would saturate silently above 2^64 bytes.
        if !(gib.is_finite() && gib > 0.0 && gib * (GIB as f64) < u64::MAX as f64) {
            return Err(Error::OutOfRange {
                field: "gpu_memory_gib",
                value: gib,
                allowed: "a positive number of GiB",
            });
        }
        self.gpu_memory_bytes = (gib * GIB as f64) as u64;
        Ok(())
    }

    /// Reads the GPU memory from a device.
    ///
    /// # Errors
    /// What the device reports.
    pub fn set_gpu_memory_from(&mut self, device: &dyn DeviceMemory) -> Result<()> {
        self.gpu_memory_bytes = device.total_memory_bytes()?;
        Ok(())
    }

    /// Checks every input.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for zero memory, a utilisation outside `(0, 1]`, a zero
    /// context, concurrency, batch or tensor-parallel degree, or an int4 group of 0;
    /// [`Error::ContextTooLong`] past `max_position_embeddings`;
    /// [`Error::UnevenTensorParallel`] when `tp` does not divide the query or KV heads;
    /// [`Error::InvalidConfig`] for a bad block size. Unless [`Self::assume_dense`]:
    /// [`Error::ModelConfig`] naming the config's fields that change memory and that
    /// the planner does not understand.
    pub fn validate(&self) -> Result<()> {
        let positive = |field: &'static str, v: usize| {
            if v == 0 {
                Err(Error::OutOfRange {
                    field,
                    value: 0.0,
                    allowed: "at least 1",
                })
            } else {
                Ok(())
            }
        };
        if self.gpu_memory_bytes == 0 {
            return Err(Error::OutOfRange {
                field: "gpu_memory_bytes",
                value: 0.0,
                allowed: "more than 0 bytes",
            });
        }
        let u = self.gpu_memory_utilization;
        if !(u > 0.0 && u <= 1.0) {
            return Err(Error::OutOfRange {
                field: "gpu_memory_utilization",
                value: u,
                allowed: "in (0, 1]",
            });
        }
        positive("context_tokens", self.context_tokens)?;
        positive("concurrency", self.concurrency)?;
        positive("max_batch_tokens", self.max_batch_tokens)?;
        positive("tensor_parallel", self.tensor_parallel)?;
        if let WeightPrecision::Int4 { group_size: 0 } = self.weight_precision {
            positive("int4 group_size", 0)?;
        }
        let max_pos = self.model.config.max_position_embeddings;
        if max_pos > 0 && self.context_tokens > max_pos {
            return Err(Error::ContextTooLong {
                context_tokens: self.context_tokens,
                max_position_embeddings: max_pos,
            });
        }
        let shape = &self.model.config.shape;
        let tp = self.tensor_parallel;
        for (what, count) in [
            ("num_attention_heads", shape.num_q_heads),
            ("num_key_value_heads", shape.num_kv_heads),
        ] {
            if count % tp != 0 {
                return Err(Error::UnevenTensorParallel { what, count, tp });
            }
        }
        if let Some(h) = &self.model.config.arch.hybrid {
            let dims: &[(&'static str, usize)] = match h.mixer {
                StateMixer::Mamba1 { d_inner, .. } => &[("mamba d_inner", d_inner)],
                StateMixer::Mamba2 { num_heads, .. } => &[("mamba heads", num_heads)],
                StateMixer::GatedDeltaNet {
                    num_k_heads,
                    num_v_heads,
                    ..
                } => &[
                    ("linear_num_key_heads", num_k_heads),
                    ("linear_num_value_heads", num_v_heads),
                ],
            };
            for &(what, count) in dims {
                if !count.is_multiple_of(tp) {
                    return Err(Error::UnevenTensorParallel { what, count, tp });
                }
            }
        }
        if !self.assume_dense {
            self.model.refuse_unrecognized()?;
        }
        self.layout().map(|_| ())
    }

    /// Bytes of one sequence's recurrent state in one recurrent layer on one GPU, as
    /// (conv state, SSM state); `None` for a model without recurrent layers. The
    /// shapes are those of vLLM's `MambaStateShapeCalculator`
    /// (`vllm/model_executor/layers/mamba/mamba_utils.py`: `mamba1_state_shape`,
    /// `mamba2_state_shape`, `gated_delta_net_state_shape`, without speculative
    /// slots), which match the caches of the models' transformers implementations:
    ///
    /// ```text
    /// Mamba-1       conv (K-1) x d_inner/tp                        ssm d_inner/tp x N
    /// Mamba-2       conv (K-1) x (d_inner + 2 G' N)/tp             ssm H/tp x P x N
    ///               G' = G, or tp when G does not divide by tp (the groups are
    ///               replicated so each GPU's heads keep theirs)
    /// DeltaNet      conv (K-1) x (2 Hk Dk + Hv Dv)/tp              ssm Hv/tp x Dk x Dv
    /// ```
    ///
    /// with the conv state in [`Self::conv_state_dtype`] and the SSM state in
    /// [`Self::ssm_state_dtype`].
    ///
    /// # Errors
    /// [`Error::UnevenTensorParallel`] when `tp` does not divide the conv channels;
    /// [`Error::ModelConfig`] when a size overflows 64 bits.
    pub fn state_bytes_per_layer(&self) -> Result<Option<(u64, u64)>> {
        let Some(h) = &self.model.config.arch.hybrid else {
            return Ok(None);
        };
        let tp = self.tensor_parallel.max(1);
        let split = |what: &'static str, count: u64| -> Result<u64> {
            if !count.is_multiple_of(tp as u64) {
                return Err(Error::UnevenTensorParallel {
                    what,
                    count: count as usize,
                    tp,
                });
            }
            Ok(count / tp as u64)
        };
        let (window, conv_channels, ssm_elems) = match h.mixer {
            StateMixer::Mamba1 {
                d_inner,
                d_state,
                conv_kernel,
                ..
            } => {
                let d = split("mamba d_inner", d_inner as u64)?;
                (
                    conv_kernel as u64 - 1,
                    d,
                    product("SSM state", &[("d_inner", d), ("d_state", d_state as u64)])?,
                )
            }
            StateMixer::Mamba2 {
                num_heads,
                head_dim,
                d_state,
                n_groups,
                conv_kernel,
                ..
            } => {
                let groups = if n_groups.is_multiple_of(tp) {
                    n_groups
                } else {
                    tp.max(n_groups)
                };
                let channels = split("mamba conv channels", conv_channels(&h.mixer, groups)?)?;
                (
                    conv_kernel as u64 - 1,
                    channels,
                    product(
                        "SSM state",
                        &[
                            ("heads", split("mamba heads", num_heads as u64)?),
                            ("head_dim", head_dim as u64),
                            ("d_state", d_state as u64),
                        ],
                    )?,
                )
            }
            StateMixer::GatedDeltaNet {
                num_v_heads,
                head_k_dim,
                head_v_dim,
                conv_kernel,
                ..
            } => {
                let channels = split("q, k, v conv channels", conv_channels(&h.mixer, 0)?)?;
                (
                    conv_kernel as u64 - 1,
                    channels,
                    product(
                        "recurrent state",
                        &[
                            (
                                "value heads",
                                split("linear_num_value_heads", num_v_heads as u64)?,
                            ),
                            ("head_k_dim", head_k_dim as u64),
                            ("head_v_dim", head_v_dim as u64),
                        ],
                    )?,
                )
            }
        };
        let conv = product(
            "conv state",
            &[
                ("kernel - 1", window),
                ("channels", conv_channels),
                ("dtype bytes", self.conv_state_dtype.size_bytes() as u64),
            ],
        )?;
        let ssm = product(
            "SSM state",
            &[
                ("elements", ssm_elems),
                ("dtype bytes", self.ssm_state_dtype.size_bytes() as u64),
            ],
        )?;
        Ok(Some((conv, ssm)))
    }

    /// The KV layout of one GPU: the model's shape with `num_kv_heads / tp` heads, or
    /// for MLA the whole latent (every query head reads it, so tensor parallelism,
    /// which splits heads, replicates it).
    fn layout(&self) -> Result<KvLayout> {
        let tp = self.tensor_parallel.max(1);
        let config = &self.model.config;
        match config.kv_kind() {
            KvKind::Standard => {
                // cache_shape: the attention layers only, for a hybrid model.
                let mut shape = config.cache_shape()?.with_dtype(self.kv_dtype);
                shape.num_kv_heads /= tp;
                shape.num_q_heads /= tp;
                KvLayout::new(shape, self.block_size)
            }
            kind @ KvKind::Latent { .. } => {
                let mut shape = config.cache_shape()?.with_dtype(self.kv_dtype);
                shape.num_q_heads /= tp;
                KvLayout::with_kind(shape, self.block_size, kind)
            }
        }
    }

    /// The KV-cache groups of one GPU, for [`crate::KvCache::hybrid`]: the model's layers
    /// split into groups of the same number of layers, so that every group's page has
    /// the same bytes (vLLM's hybrid allocator does the same): `gcd(full layers, window
    /// layers)` layers a group, the full-attention (or latent) groups first, then the
    /// window groups with the config's window (see [`window_layers`]). A model without
    /// window layers is one group of every layer. Group `g`'s layer slot `j` holds the
    /// `j`-th layer of its kind in that group's share, in model order; that mapping is
    /// the engine's. Gemma-3 (8 global, 40 local layers) gives one full group and five
    /// window groups of 8 layers; gpt-oss-20b (12 and 12) one of each.
    ///
    /// # Errors
    /// As the plan's layout: [`Error::InvalidConfig`] for a shape the layout refuses.
    pub fn kv_cache_groups(&self) -> Result<Vec<GroupSpec>> {
        let layout = self.layout()?;
        let layers = layout.shape().num_layers;
        let (windowed, window) = window_layers(&self.model.config.arch, layers);
        let full = layers - windowed;
        let (mut a, mut b) = (full, windowed);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        let per_group = a;
        let mut shape = *layout.shape();
        shape.num_layers = per_group;
        let group = KvLayout::with_kind(shape, self.block_size, layout.kind())?;
        let mut specs = vec![GroupSpec::full(group); full / per_group];
        specs.extend(std::iter::repeat_n(
            GroupSpec::window(group, window),
            windowed / per_group,
        ));
        Ok(specs)
    }

    /// The estimated reserve for activations and workspace of one GPU (module docs).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] (field `max_batch_tokens`) when it overflows 64 bits.
    pub fn estimated_reserve_bytes(&self) -> Result<u64> {
        let c = &self.model.config;
        let s = &c.shape;
        let tp = self.tensor_parallel.max(1) as u64;
        let act = self.weight_precision.dense_elem_bytes();
        let h = c.hidden_size as u64;
        let overflow = || Error::OutOfRange {
            field: "max_batch_tokens",
            value: self.max_batch_tokens as f64,
            allowed: "few enough tokens that the activation estimate fits in 64 bits",
        };
        let reserve = (|| {
            let qkv = match &c.arch.mla {
                // q, kv_b and kv_a outputs; divided by tp below with the rest (the
                // replicated kv_a output is 576 of ~57,000 elements for DeepSeek-V3).
                Some(m) => {
                    let qk = (m.qk_nope_head_dim as u64).checked_add(m.qk_rope_head_dim as u64)?;
                    let kv_b = (m.qk_nope_head_dim as u64).checked_add(m.v_head_dim as u64)?;
                    (s.num_q_heads as u64)
                        .checked_mul(qk.checked_add(kv_b)?)?
                        .checked_add(
                            (m.kv_lora_rank as u64).checked_add(m.qk_rope_head_dim as u64)?,
                        )?
                }
                None => (s.num_kv_heads as u64)
                    .checked_mul(2)?
                    .checked_add(s.num_q_heads as u64)?
                    .checked_mul(s.head_dim as u64)?,
            };
            let per_token = h
                .checked_mul(2)?
                .checked_add(qkv / tp)?
                .checked_add((c.intermediate_size as u64).checked_mul(2)? / tp)?;
            let logits_rows = self.concurrency.min(self.max_batch_tokens) as u64;
            WORKSPACE_BYTES
                .checked_add(
                    (self.max_batch_tokens as u64)
                        .checked_mul(act)?
                        .checked_mul(per_token)?,
                )?
                .checked_add(
                    logits_rows
                        .checked_mul(c.vocab_size as u64)?
                        .checked_mul(4)?,
                )
        })();
        reserve.ok_or_else(overflow)
    }

    /// Runs the planner.
    ///
    /// # Errors
    /// As [`Self::validate`].
    pub fn plan(&self) -> Result<Plan> {
        let mut plan = self.plan_numbers()?;
        if !plan.verdict.fits() {
            let found = self.suggestions(&plan);
            if let Verdict::DoesNotFit { suggestions, .. } = &mut plan.verdict {
                *suggestions = found;
            }
        }
        Ok(plan)
    }

    /// The plan without suggestions (they re-run this with other inputs).
    fn plan_numbers(&self) -> Result<Plan> {
        self.validate()?;
        let layout = self.layout()?;
        let params = if self.assume_dense {
            self.model.param_counts_assuming_dense()?
        } else {
            self.model.param_counts()?
        };
        let weights = params.bytes_per_gpu_mixed(
            self.weight_precision,
            self.attention_precision.unwrap_or(self.weight_precision),
            self.tensor_parallel,
        )?;
        let reserve = match self.reserve_bytes {
            Some(r) => r,
            None => self.estimated_reserve_bytes()?,
        };
        let weights_and_reserve = weights.checked_add(reserve).ok_or(Error::OutOfRange {
            field: "reserve_bytes",
            value: reserve as f64,
            allowed: "small enough that weights + reserve fit in 64 bits",
        })?;
        let usable = (self.gpu_memory_bytes as f64 * self.gpu_memory_utilization).floor() as u64;
        let kv_budget = usable.saturating_sub(weights_and_reserve);
        let block_bytes = layout.block_bytes() as u64;
        let num_blocks = kv_budget / block_bytes;
        let blocks_per_request = self.blocks_per_request(&layout);
        let state = self.state_plan(&layout, num_blocks, blocks_per_request)?;
        // Each request holds its context's KV blocks and, in a hybrid model, its
        // state's pages, all from the one arena.
        let pages_per_request =
            blocks_per_request + state.as_ref().map_or(0, |s| s.pages_per_sequence);
        let max_concurrency = num_blocks / pages_per_request;
        let needed_blocks = pages_per_request
            .checked_mul(self.concurrency as u64)
            .ok_or(Error::OutOfRange {
                field: "concurrency",
                value: self.concurrency as f64,
                allowed: "small enough that concurrency x blocks per request fits in 64 bits",
            })?;
        // num_blocks <= kv_budget / block_bytes and block_bytes >= block_size, so this
        // cannot overflow; checked all the same.
        let capacity_tokens =
            num_blocks
                .checked_mul(self.block_size as u64)
                .ok_or(Error::OutOfRange {
                    field: "block_size",
                    value: self.block_size as f64,
                    allowed: "blocks x block size within 64 bits",
                })?;
        let verdict = if weights_and_reserve > usable {
            Verdict::DoesNotFit {
                shortfall: Shortfall::Weights {
                    needed_bytes: weights_and_reserve,
                    usable_bytes: usable,
                },
                suggestions: Vec::new(),
            }
        } else if needed_blocks > num_blocks {
            Verdict::DoesNotFit {
                shortfall: Shortfall::Blocks {
                    needed_blocks,
                    num_blocks,
                },
                suggestions: Vec::new(),
            }
        } else {
            Verdict::Fits
        };
        Ok(Plan {
            model: self.model.config.name.clone(),
            weight_precision: self.weight_precision,
            kv_dtype: self.kv_dtype,
            tensor_parallel: self.tensor_parallel,
            block_size: self.block_size,
            context_tokens: self.context_tokens,
            concurrency: self.concurrency,
            gpu_memory_bytes: self.gpu_memory_bytes,
            gpu_memory_utilization: self.gpu_memory_utilization,
            params: params.total(),
            active_params: params.active(),
            notes: self.notes(),
            weight_bytes: weights,
            reserve_bytes: reserve,
            usable_bytes: usable,
            kv_budget_bytes: kv_budget,
            kv_bytes_per_token: layout.token_bytes() as u64,
            block_bytes,
            num_blocks,
            capacity_tokens,
            blocks_per_request,
            pages_per_request,
            state,
            max_concurrency,
            verdict,
        })
    }

    /// The recurrent state of a hybrid model in pages of the KV arena (`None` for a
    /// model without recurrent layers): each sequence's state, every recurrent layer's
    /// conv and SSM tensors together, takes `ceil(state bytes / block_bytes)` pages of
    /// the attention layers' block size, so the arena needs no second page size and no
    /// raised block size (vLLM's hybrid allocator instead grows the attention block
    /// until one page holds a layer's state); the padding of the last page is the waste.
    fn state_plan(
        &self,
        layout: &KvLayout,
        num_blocks: u64,
        blocks_per_request: u64,
    ) -> Result<Option<StatePlan>> {
        let Some((conv, ssm)) = self.state_bytes_per_layer()? else {
            return Ok(None);
        };
        let Some(h) = &self.model.config.arch.hybrid else {
            return Ok(None);
        };
        let layers = h.count(LayerKind::Recurrent);
        let bytes = product(
            "state per sequence",
            &[
                ("recurrent layers", layers as u64),
                ("conv + ssm bytes", sum("state per layer", &[conv, ssm])?),
            ],
        )?;
        let page = layout.block_bytes() as u64;
        let pages = bytes.div_ceil(page).max(1);
        Ok(Some(StatePlan {
            mixer: h.mixer.name(),
            recurrent_layers: layers,
            attention_layers: h.count(LayerKind::Attention),
            conv_state_dtype: self.conv_state_dtype,
            ssm_state_dtype: self.ssm_state_dtype,
            conv_bytes_per_layer: conv,
            ssm_bytes_per_layer: ssm,
            bytes_per_sequence: bytes,
            pages_per_sequence: pages,
            waste_bytes_per_sequence: pages * page - bytes,
            kv_limited_concurrency: num_blocks / blocks_per_request.max(1),
            state_limited_concurrency: num_blocks / pages,
        }))
    }

    /// Whole-model blocks one request of `context_tokens` holds. Full-attention layers
    /// hold the whole context; sliding-window layers (a manager with
    /// `CacheBuilder::sliding_window`) at most `ceil(window / block_size) + 1` blocks:
    /// KV bytes = layer block bytes x (full layers x blocks(context) + window layers x
    /// min(blocks(context), ceil(window / block_size) + 1)), rounded up to whole-model
    /// blocks.
    fn blocks_per_request(&self, layout: &KvLayout) -> u64 {
        let full = layout.blocks_for_tokens(self.context_tokens) as u64;
        let layers = layout.num_layers() as u64;
        let (windowed, window) = window_layers(&self.model.config.arch, layout.num_layers());
        if windowed == 0 || layers == 0 {
            return full;
        }
        let windowed = windowed as u64;
        let in_window = full.min(window.div_ceil(self.block_size) as u64 + 1);
        ((layers - windowed) * full + windowed * in_window).div_ceil(layers)
    }

    /// What the plan assumed or left out, in words, for the output.
    fn notes(&self) -> Vec<String> {
        let spec = &self.model;
        let arch = &spec.config.arch;
        let mut notes = Vec::new();
        if self.assume_dense && !arch.unrecognized.is_empty() {
            notes.push(format!(
                "--assume-dense: ignored fields the planner does not understand: {}",
                arch.unrecognized.join(", ")
            ));
        }
        if let Some(m) = &arch.mla {
            notes.push(format!(
                "latent attention (MLA): one latent of kv_lora_rank {} + qk_rope_head_dim {} per token and layer, no K/V split{}",
                m.kv_lora_rank,
                m.qk_rope_head_dim,
                if self.tensor_parallel > 1 {
                    "; every GPU holds all of it (tensor parallelism splits query heads)"
                } else {
                    ""
                }
            ));
        }
        if !arch.known {
            notes.push(format!(
                "model_type {} is not one the planner knows: counted as a Llama-style dense decoder (gated MLP, 2 norms per layer)",
                arch.model_type.as_deref().unwrap_or("(absent)")
            ));
        }
        match spec.config_precision() {
            Some(p) if p != self.weight_precision => notes.push(format!(
                "the config's quantization_config says {p}; planned with {} as asked",
                self.weight_precision
            )),
            Some(p) => notes.push(format!("weights in {p}, from quantization_config")),
            None => {}
        }
        if let Some(p) = self.attention_precision {
            if p != self.weight_precision {
                notes.push(format!("attention projections in {p}"));
            }
        }
        if let Some(w) = arch.sliding_window {
            let total = spec.config.shape.num_layers;
            let (windowed, _) = window_layers(arch, total);
            notes.push(format!(
                "sliding window of {w} tokens on {windowed} of {total} layers: those layers sized for at most ceil({w} / block) + 1 blocks per request (a manager with sliding_window frees the rest)"
            ));
        }
        if let Some(h) = &arch.hybrid {
            let total = spec.config.shape.num_layers;
            let source = if h.ssm_dtype == Some(self.ssm_state_dtype) {
                "as the config's mamba_ssm_cache_dtype says"
            } else if h.ssm_dtype.is_none() && self.ssm_state_dtype == DType::F32 {
                "f32 by default: the kernels accumulate it in f32"
            } else {
                "as asked"
            };
            notes.push(format!(
                "hybrid: {} of {total} layers are attention and hold KV; {} {} layers hold a fixed state per sequence (conv state in {}, SSM state in {}, {source}){}",
                h.count(LayerKind::Attention),
                h.count(LayerKind::Recurrent),
                h.mixer.name(),
                self.conv_state_dtype,
                self.ssm_state_dtype,
                match h.count(LayerKind::Mlp) {
                    0 => String::new(),
                    n => format!("; {n} MLP-only layers hold nothing"),
                }
            ));
        }
        if arch.mtp_layers > 0 {
            notes.push(format!(
                "{} multi-token-prediction layer(s) not counted (loaded only for speculative decoding)",
                arch.mtp_layers
            ));
        }
        notes
    }

    /// Concrete changes that would make `plan` fit, each checked by planning again.
    fn suggestions(&self, plan: &Plan) -> Vec<Suggestion> {
        let mut out = Vec::new();
        let fits = |input: &PlanInput| {
            input
                .plan_numbers()
                .ok()
                .filter(|p| p.verdict.fits())
                .map(|p| p.max_concurrency)
        };
        if plan
            .weight_bytes
            .checked_add(plan.reserve_bytes)
            .is_some_and(|n| n <= plan.usable_bytes)
        {
            // Blocks are short: the KV-side levers apply.
            for dtype in [DType::BF16, DType::Fp8E4M3] {
                if dtype.size_bytes() < self.kv_dtype.size_bytes() {
                    let mut alt = self.clone();
                    alt.kv_dtype = dtype;
                    if let Some(max_concurrency) = fits(&alt) {
                        out.push(Suggestion::KvDtype {
                            kv_dtype: dtype,
                            max_concurrency,
                        });
                        break;
                    }
                }
            }
            // A request's state pages come off its share first.
            let state_pages = plan.pages_per_request - plan.blocks_per_request;
            let blocks_each =
                (plan.num_blocks / self.concurrency as u64).saturating_sub(state_pages);
            if blocks_each > 0 {
                out.push(Suggestion::Context {
                    max_context_tokens: blocks_each * self.block_size as u64,
                });
            }
            if plan.max_concurrency > 0 {
                out.push(Suggestion::Concurrency {
                    max_concurrency: plan.max_concurrency,
                });
            }
        }
        let shape = &self.model.config.shape;
        for tp in self.tensor_parallel + 1..=MAX_SUGGESTED_TP.max(self.tensor_parallel) {
            if shape.num_q_heads.is_multiple_of(tp) && shape.num_kv_heads.is_multiple_of(tp) {
                let mut alt = self.clone();
                alt.tensor_parallel = tp;
                if let Some(max_concurrency) = fits(&alt) {
                    out.push(Suggestion::TensorParallel {
                        tensor_parallel: tp,
                        max_concurrency,
                    });
                    break;
                }
            }
        }
        let current = self.weight_precision.linear_bytes(1 << 20).ok();
        for precision in WeightPrecision::LADDER {
            if precision.linear_bytes(1 << 20).ok() < current {
                let mut alt = self.clone();
                alt.weight_precision = precision;
                alt.attention_precision = None;
                if let Some(max_concurrency) = fits(&alt) {
                    out.push(Suggestion::WeightPrecision {
                        precision,
                        max_concurrency,
                    });
                    break;
                }
            }
        }
        // A GPU size only when the bytes needed fit in 64 bits and a GPU of that size
        // is checked to fit.
        let needed = plan
            .pages_per_request
            .checked_mul(self.concurrency as u64)
            .and_then(|b| b.checked_mul(plan.block_bytes))
            .and_then(|kv| kv.checked_add(plan.weight_bytes))
            .and_then(|n| n.checked_add(plan.reserve_bytes));
        // Rounded up to whole MiB, then checked: `usable` is floored, so the exact
        // quotient can fall a byte short.
        const MIB: u64 = 1 << 20;
        let first = needed.and_then(|n| {
            let gpu = (n as f64 / self.gpu_memory_utilization).ceil();
            (gpu < (u64::MAX - 8 * MIB) as f64).then(|| (gpu as u64).div_ceil(MIB) * MIB)
        });
        if let Some(first) = first {
            let found = (0..4).map(|k| first + k * MIB).find(|&gpu| {
                let mut alt = self.clone();
                alt.gpu_memory_bytes = gpu;
                fits(&alt).is_some()
            });
            if let Some(gpu_memory_bytes) = found {
                out.push(Suggestion::GpuMemory { gpu_memory_bytes });
            }
        }
        out
    }

    /// One plan per GPU size of [`SWEEP_GPU_GIB`] and KV dtype of [`SWEEP_KV_DTYPES`],
    /// GPU size outermost; every other input as in `self`.
    ///
    /// # Errors
    /// As [`Self::plan`].
    pub fn sweep(&self) -> Result<Vec<Plan>> {
        let mut plans = Vec::new();
        for gib in SWEEP_GPU_GIB {
            for dtype in SWEEP_KV_DTYPES {
                let mut alt = self.clone();
                alt.set_gpu_memory_gib(gib)?;
                alt.kv_dtype = dtype;
                plans.push(alt.plan()?);
            }
        }
        Ok(plans)
    }
}

/// Why a plan does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shortfall {
    /// Weights and reserve alone exceed the usable memory: no KV cache at all.
    Weights {
        /// Weights plus reserve, bytes.
        needed_bytes: u64,
        /// Usable memory, bytes.
        usable_bytes: u64,
    },
    /// The cache holds fewer blocks than the target concurrency at the context needs.
    Blocks {
        /// `concurrency * pages_per_request` (KV blocks and recurrent-state pages).
        needed_blocks: u64,
        /// Blocks that fit.
        num_blocks: u64,
    },
}

/// One change that makes a plan fit (or, for context and concurrency, the most the
/// current memory allows).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Suggestion {
    /// Store KV in a smaller dtype.
    KvDtype {
        /// The largest dtype that fits.
        kv_dtype: DType,
        /// Requests at the context it then holds.
        max_concurrency: u64,
    },
    /// Shorten the context to serve the target concurrency.
    Context {
        /// The longest context (a whole number of blocks) that does.
        max_context_tokens: u64,
    },
    /// Serve fewer requests at once.
    Concurrency {
        /// Requests at the context the cache holds.
        max_concurrency: u64,
    },
    /// Split the model over more GPUs.
    TensorParallel {
        /// The smallest degree (up to [`MAX_SUGGESTED_TP`]) that fits.
        tensor_parallel: usize,
        /// Requests at the context it then holds.
        max_concurrency: u64,
    },
    /// Quantize the weights further.
    WeightPrecision {
        /// The largest precision that fits.
        precision: WeightPrecision,
        /// Requests at the context it then holds.
        max_concurrency: u64,
    },
    /// A GPU with at least this much memory (all other inputs unchanged), rounded up to
    /// a whole MiB.
    GpuMemory {
        /// Bytes.
        gpu_memory_bytes: u64,
    },
}

impl fmt::Display for Suggestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Suggestion::KvDtype {
                kv_dtype,
                max_concurrency,
            } => write!(
                f,
                "KV dtype {kv_dtype}: fits, up to {max_concurrency} requests"
            ),
            Suggestion::Context { max_context_tokens } => {
                write!(f, "context of at most {max_context_tokens} tokens")
            }
            Suggestion::Concurrency { max_concurrency } => {
                write!(f, "at most {max_concurrency} concurrent requests")
            }
            Suggestion::TensorParallel {
                tensor_parallel,
                max_concurrency,
            } => write!(
                f,
                "tensor parallel {tensor_parallel}: fits, up to {max_concurrency} requests"
            ),
            Suggestion::WeightPrecision {
                precision,
                max_concurrency,
            } => write!(
                f,
                "weights in {precision}: fits, up to {max_concurrency} requests"
            ),
            Suggestion::GpuMemory { gpu_memory_bytes } => {
                write!(f, "a GPU with at least {} GiB", gib(gpu_memory_bytes))
            }
        }
    }
}

impl Suggestion {
    fn to_json(self) -> serde_json::Value {
        use serde_json::json;
        match self {
            Suggestion::KvDtype {
                kv_dtype,
                max_concurrency,
            } => {
                json!({"change": "kv_dtype", "kv_dtype": kv_dtype.name(), "max_concurrency": max_concurrency})
            }
            Suggestion::Context { max_context_tokens } => {
                json!({"change": "context", "max_context_tokens": max_context_tokens})
            }
            Suggestion::Concurrency { max_concurrency } => {
                json!({"change": "concurrency", "max_concurrency": max_concurrency})
            }
            Suggestion::TensorParallel {
                tensor_parallel,
                max_concurrency,
            } => {
                json!({"change": "tensor_parallel", "tensor_parallel": tensor_parallel, "max_concurrency": max_concurrency})
            }
            Suggestion::WeightPrecision {
                precision,
                max_concurrency,
            } => {
                json!({"change": "weight_precision", "weight_precision": precision.name(), "max_concurrency": max_concurrency})
            }
            Suggestion::GpuMemory { gpu_memory_bytes } => {
                json!({"change": "gpu_memory", "gpu_memory_bytes": gpu_memory_bytes})
            }
        }
    }
}

/// Whether the target fits.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// `concurrency` requests of `context_tokens` tokens fit.
    Fits,
    /// They do not.
    DoesNotFit {
        /// What ran out.
        shortfall: Shortfall,
        /// What to change, each alternative checked by planning again.
        suggestions: Vec<Suggestion>,
    },
}

impl Verdict {
    /// Whether this is [`Verdict::Fits`].
    pub const fn fits(&self) -> bool {
        matches!(self, Verdict::Fits)
    }
}

/// The planner's answer; every byte count is per GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Model name from the config.
    pub model: String,
    /// Weight precision planned with.
    pub weight_precision: WeightPrecision,
    /// KV dtype planned with.
    pub kv_dtype: DType,
    /// Tensor-parallel degree.
    pub tensor_parallel: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Tokens per request.
    pub context_tokens: usize,
    /// Target concurrent requests.
    pub concurrency: usize,
    /// Memory of one GPU.
    pub gpu_memory_bytes: u64,
    /// Utilisation fraction.
    pub gpu_memory_utilization: f64,
    /// Parameters of the whole model (every expert: all are resident).
    pub params: u64,
    /// Parameters one token uses ([`ParamCounts::active`]); equals `params` for dense
    /// models.
    pub active_params: u64,
    /// What the plan assumed or left out (dense assumption, sliding windows recorded,
    /// precision from the config...).
    pub notes: Vec<String>,
    /// Weight bytes on one GPU.
    pub weight_bytes: u64,
    /// Reserve for activations and workspace.
    pub reserve_bytes: u64,
    /// `floor(gpu_memory_bytes * gpu_memory_utilization)`.
    pub usable_bytes: u64,
    /// Bytes left for KV.
    pub kv_budget_bytes: u64,
    /// KV bytes of one token on one GPU.
    pub kv_bytes_per_token: u64,
    /// KV bytes of one block on one GPU.
    pub block_bytes: u64,
    /// Blocks that fit.
    pub num_blocks: u64,
    /// Tokens the cache holds: `num_blocks * block_size`.
    pub capacity_tokens: u64,
    /// KV blocks one request of `context_tokens` needs.
    pub blocks_per_request: u64,
    /// Pages one request holds: its KV blocks plus, for a hybrid model, its recurrent
    /// state's pages ([`StatePlan::pages_per_sequence`]); `blocks_per_request` otherwise.
    pub pages_per_request: u64,
    /// The recurrent state of a hybrid model (Mamba, gated DeltaNet layers); `None`
    /// when every layer is attention.
    pub state: Option<StatePlan>,
    /// Requests of `context_tokens` tokens that fit at once: `num_blocks /
    /// pages_per_request`, both limits together.
    pub max_concurrency: u64,
    /// Whether the target fits, and what to change if not.
    pub verdict: Verdict,
}

/// The recurrent state of a hybrid model on one GPU, per sequence: fixed, whatever the
/// context length ([`PlanInput::state_bytes_per_layer`] gives the shapes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatePlan {
    /// The recurrent layers' kind: `mamba`, `mamba2` or `gated_deltanet`.
    pub mixer: &'static str,
    /// Layers that hold a state.
    pub recurrent_layers: usize,
    /// Layers that hold K and V (the KV figures count these only).
    pub attention_layers: usize,
    /// Element type of the conv state.
    pub conv_state_dtype: DType,
    /// Element type of the SSM / DeltaNet state.
    pub ssm_state_dtype: DType,
    /// Conv-state bytes of one sequence in one recurrent layer.
    pub conv_bytes_per_layer: u64,
    /// SSM-state bytes of one sequence in one recurrent layer.
    pub ssm_bytes_per_layer: u64,
    /// `recurrent_layers x (conv + ssm)`.
    pub bytes_per_sequence: u64,
    /// Pages of the arena one sequence's state takes: `ceil(bytes / block_bytes)`.
    pub pages_per_sequence: u64,
    /// Padding in the last of those pages.
    pub waste_bytes_per_sequence: u64,
    /// Requests the arena would hold for their KV alone: `num_blocks /
    /// blocks_per_request`.
    pub kv_limited_concurrency: u64,
    /// Sequences whose states alone fill the arena: `num_blocks / pages_per_sequence`.
    pub state_limited_concurrency: u64,
}

impl StatePlan {
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "mixer": self.mixer,
            "recurrent_layers": self.recurrent_layers,
            "attention_layers": self.attention_layers,
            "conv_state_dtype": self.conv_state_dtype.name(),
            "ssm_state_dtype": self.ssm_state_dtype.name(),
            "conv_bytes_per_layer": self.conv_bytes_per_layer,
            "ssm_bytes_per_layer": self.ssm_bytes_per_layer,
            "bytes_per_sequence": self.bytes_per_sequence,
            "pages_per_sequence": self.pages_per_sequence,
            "waste_bytes_per_sequence": self.waste_bytes_per_sequence,
            "kv_limited_concurrency": self.kv_limited_concurrency,
            "state_limited_concurrency": self.state_limited_concurrency,
        })
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / GIB as f64)
}

impl Plan {
    /// The plan as JSON (byte counts as integers, the verdict as
    /// `{"fits": bool, "shortfall": ..., "suggestions": [...]}`).
    pub fn to_json(&self) -> serde_json::Value {
        let (shortfall, suggestions) = match &self.verdict {
            Verdict::Fits => (serde_json::Value::Null, Vec::new()),
            Verdict::DoesNotFit {
                shortfall,
                suggestions,
            } => (
                match *shortfall {
                    Shortfall::Weights {
                        needed_bytes,
                        usable_bytes,
                    } => {
                        serde_json::json!({"kind": "weights", "needed_bytes": needed_bytes, "usable_bytes": usable_bytes})
                    }
                    Shortfall::Blocks {
                        needed_blocks,
                        num_blocks,
                    } => {
                        serde_json::json!({"kind": "blocks", "needed_blocks": needed_blocks, "num_blocks": num_blocks})
                    }
                },
                suggestions.iter().map(|s| s.to_json()).collect(),
            ),
        };
        serde_json::json!({
            "model": self.model,
            "weight_precision": self.weight_precision.name(),
            "kv_dtype": self.kv_dtype.name(),
            "tensor_parallel": self.tensor_parallel,
            "block_size": self.block_size,
            "context_tokens": self.context_tokens,
            "concurrency": self.concurrency,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "params": self.params,
            "active_params": self.active_params,
            "notes": self.notes,
            "weight_bytes": self.weight_bytes,
            "reserve_bytes": self.reserve_bytes,
            "usable_bytes": self.usable_bytes,
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "capacity_tokens": self.capacity_tokens,
            "blocks_per_request": self.blocks_per_request,
            "pages_per_request": self.pages_per_request,
            "state": self.state.as_ref().map(StatePlan::to_json),
            "max_concurrency": self.max_concurrency,
            "fits": self.verdict.fits(),
            "shortfall": shortfall,
            "suggestions": suggestions,
        })
    }

    /// Header of [`Self::sweep_line`].
    pub const SWEEP_HEADER: &'static str =
        "gpu GiB  kv     weights GiB  KV GiB   blocks    tokens      max reqs  verdict";

    /// One line of the sweep table.
    pub fn sweep_line(&self) -> String {
        format!(
            "{:>7}  {:<5}  {:>11}  {:>6}  {:>7}  {:>10}  {:>8}  {}",
            gib(self.gpu_memory_bytes),
            self.kv_dtype.name(),
            gib(self.weight_bytes),
            gib(self.num_blocks * self.block_bytes),
            self.num_blocks,
            self.capacity_tokens,
            self.max_concurrency,
            if self.verdict.fits() {
                "fits"
            } else {
                "does not fit"
            }
        )
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, k: &str, v: String| writeln!(f, "  {k:<28} {v}");
        writeln!(
            f,
            "{}: weights {}, KV {}, tp {}, block {} tokens",
            self.model, self.weight_precision, self.kv_dtype, self.tensor_parallel, self.block_size
        )?;
        row(
            f,
            "GPU memory (per GPU)",
            format!(
                "{} GiB x {} = {} GiB usable",
                gib(self.gpu_memory_bytes),
                self.gpu_memory_utilization,
                gib(self.usable_bytes)
            ),
        )?;
        row(
            f,
            "parameters",
            if self.active_params == self.params {
                format!("{:.2} B", self.params as f64 / 1e9)
            } else {
                format!(
                    "{:.2} B ({:.2} B active per token)",
                    self.params as f64 / 1e9,
                    self.active_params as f64 / 1e9
                )
            },
        )?;
        for note in &self.notes {
            row(f, "note", note.clone())?;
        }
        row(
            f,
            "weights (per GPU)",
            format!("{} GiB", gib(self.weight_bytes)),
        )?;
        row(
            f,
            "activations + workspace",
            format!("{} GiB", gib(self.reserve_bytes)),
        )?;
        row(f, "KV budget", format!("{} GiB", gib(self.kv_budget_bytes)))?;
        row(
            f,
            "KV bytes per token",
            format!(
                "{} B ({} KiB)",
                self.kv_bytes_per_token,
                self.kv_bytes_per_token / 1024
            ),
        )?;
        row(
            f,
            "KV bytes per block",
            format!("{} B ({} KiB)", self.block_bytes, self.block_bytes / 1024),
        )?;
        row(f, "blocks", self.num_blocks.to_string())?;
        row(
            f,
            "tokens the cache holds",
            self.capacity_tokens.to_string(),
        )?;
        if let Some(st) = &self.state {
            row(
                f,
                "recurrent state / sequence",
                format!(
                    "{} B: {} {} layers x (conv {} B {} + ssm {} B {}), {} pages ({} B padding)",
                    st.bytes_per_sequence,
                    st.recurrent_layers,
                    st.mixer,
                    st.conv_bytes_per_layer,
                    st.conv_state_dtype,
                    st.ssm_bytes_per_layer,
                    st.ssm_state_dtype,
                    st.pages_per_sequence,
                    st.waste_bytes_per_sequence
                ),
            )?;
            row(
                f,
                "limits",
                format!(
                    "KV alone {} requests, state alone {} sequences",
                    st.kv_limited_concurrency, st.state_limited_concurrency
                ),
            )?;
        }
        row(
            f,
            "max concurrent requests",
            format!("{} at {} tokens", self.max_concurrency, self.context_tokens),
        )?;
        match &self.verdict {
            Verdict::Fits => row(
                f,
                "verdict",
                format!(
                    "fits: {} requests x {} tokens",
                    self.concurrency, self.context_tokens
                ),
            ),
            Verdict::DoesNotFit {
                shortfall,
                suggestions,
            } => {
                let why = match *shortfall {
                    Shortfall::Weights {
                        needed_bytes,
                        usable_bytes,
                    } => format!(
                        "weights + reserve need {} GiB of {} GiB usable",
                        gib(needed_bytes),
                        gib(usable_bytes)
                    ),
                    Shortfall::Blocks {
                        needed_blocks,
                        num_blocks,
                    } => format!(
                        "{} requests x {} tokens need {needed_blocks} blocks, {num_blocks} fit",
                        self.concurrency, self.context_tokens
                    ),
                };
                row(f, "verdict", format!("does NOT fit: {why}"))?;
                for s in suggestions {
                    row(f, "  try", s.to_string())?;
                }
                Ok(())
            }
        }
    }
}

/// Sliding-window layers of `arch` out of `num_layers`, and the window: the
/// `sliding_attention` entries of `layer_types` when the config lists them; Gemma-2
/// (whose configs do not) alternates, local on even layers (`ceil(n / 2)`); any other
/// model with a `sliding_window` applies it on every layer (Mistral-7B-v0.1).
pub fn window_layers(arch: &config::ModelArch, num_layers: usize) -> (usize, usize) {
    let Some(w) = arch.sliding_window else {
        return (0, 0);
    };
    let n = if !arch.layer_types.is_empty() {
        arch.layer_types
            .iter()
            .filter(|t| *t == "sliding_attention")
            .count()
    } else if arch.model_type.as_deref() == Some("gemma2") {
        num_layers.div_ceil(2)
    } else {
        num_layers
    };
    (n.min(num_layers), w)
}
