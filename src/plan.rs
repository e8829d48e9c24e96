//! Capacity planner: model shape + memory budget -> blocks, tokens, max concurrency.
//!
//! The top layer of the crate. Given a model (`config.json` or a built-in name), the
//! precision of its weights, the KV dtype, the GPU's memory and the serving targets, it
//! answers the questions asked before a deployment: how many KV blocks are left once
//! the weights and the activations are in, how many tokens they hold, how many requests
//! of a given context run at once, and, when the target does not fit, what to change.
//!
//! All numbers are **per GPU**. With tensor parallelism of degree `tp`, each GPU holds
//! `1/tp` of the weights (norms are replicated) and `num_kv_heads / tp` KV heads; a
//! degree that does not divide the query and KV heads is an error
//! ([`Error::UnevenTensorParallel`]).
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
//! Bytes: the linear layers (attention + mlp) are stored in the chosen
//! [`WeightPrecision`]; embedding, lm_head, biases and norms stay in 16 bits (32 with
//! fp32 weights), as GPTQ/AWQ/fp8 checkpoints keep them. Per GPU every part is divided
//! by `tp` (rounded up) except the norms, which every GPU holds whole.
//!
//! Memory budget per GPU:
//!
//! ```text
//! usable      = floor(gpu_memory_bytes * gpu_memory_utilization)
//! kv_budget   = usable - weights_per_gpu - reserve            (0 when negative)
//! num_blocks  = floor(kv_budget / block_bytes)
//! block_bytes = block_size * 2 * L * (num_kv_heads/tp) * head_dim * kv_dtype_bytes
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
//! with `act_bytes` 2 (4 for fp32 weights). It is the peak of one forward pass over
//! `max_batch_tokens` tokens, the quantity vLLM measures with a profiling run; it is an
//! estimate, and [`PlanInput::reserve_bytes`] overrides it with a measured value.
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
use crate::layout::shape::{builtin, DType, ModelConfig};
use crate::layout::KvLayout;

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
    /// 4-bit weights (GPTQ/AWQ style) with one f16 scale per `group_size` weights.
    /// Zero points of asymmetric schemes are not counted.
    Int4 {
        /// Weights sharing one scale (128 is the common choice).
        group_size: usize,
    },
}

impl WeightPrecision {
    /// The precisions the planner tries when suggesting a smaller one, largest first.
    pub const LADDER: [WeightPrecision; 4] = [
        WeightPrecision::F32,
        WeightPrecision::F16,
        WeightPrecision::Int8,
        WeightPrecision::Int4 { group_size: 128 },
    ];

    /// Parses `fp32`/`f32`, `fp16`/`f16`/`bf16`, `int8`/`fp8`, `int4` (group 128) or
    /// `int4-gN` (group `N`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown name or a group size of 0.
    pub fn parse(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        match lower.as_str() {
            "fp32" | "f32" | "float32" => Ok(WeightPrecision::F32),
            "fp16" | "f16" | "bf16" | "float16" | "bfloat16" | "16-bit" => Ok(WeightPrecision::F16),
            "int8" | "fp8" | "w8" => Ok(WeightPrecision::Int8),
            "int4" | "w4" => Ok(WeightPrecision::Int4 { group_size: 128 }),
            other => {
                let group = other
                    .strip_prefix("int4-g")
                    .and_then(|g| g.parse::<usize>().ok())
                    .filter(|&g| g > 0)
                    .ok_or_else(|| {
                        Error::config(
                            "weight_precision",
                            format!("unknown precision {name:?}; expected fp32, fp16, bf16, int8, fp8, int4 or int4-gN"),
                        )
                    })?;
                Ok(WeightPrecision::Int4 { group_size: group })
            }
        }
    }

    /// Short name (`fp32`, `16-bit`, `int8`, `int4-g128`); [`Self::parse`] reads it back.
    pub fn name(&self) -> String {
        match self {
            WeightPrecision::F32 => "fp32".into(),
            WeightPrecision::F16 => "16-bit".into(),
            WeightPrecision::Int8 => "int8".into(),
            WeightPrecision::Int4 { group_size } => format!("int4-g{group_size}"),
        }
    }

    /// Bytes of `params` linear-layer weights: `4n`, `2n`, `n`, or `ceil(n/2) + 2 *
    /// ceil(n / group_size)` for int4.
    pub const fn linear_bytes(&self, params: u64) -> u64 {
        match *self {
            WeightPrecision::F32 => 4 * params,
            WeightPrecision::F16 => 2 * params,
            WeightPrecision::Int8 => params,
            WeightPrecision::Int4 { group_size } => {
                // A group size of 0 is rejected by `PlanInput::validate`; `max(1)` keeps
                // this const fn total anyway.
                let g = if group_size == 0 {
                    1
                } else {
                    group_size as u64
                };
                params.div_ceil(2) + 2 * params.div_ceil(g)
            }
        }
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
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::ModelConfig(format!("not valid JSON: {e}")))?;
        let obj = v
            .get("text_config")
            .filter(|_| v.get("num_hidden_layers").is_none());
        let obj = obj.unwrap_or(&v);
        let attention_bias = match obj.get("attention_bias").and_then(|b| b.as_bool()) {
            Some(b) => b,
            None => obj
                .get("model_type")
                .and_then(|t| t.as_str())
                .is_some_and(|t| t == "qwen2" || t == "qwen2_moe"),
        };
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

    /// A built-in name ([`builtin::NAMES`]) or else a path to a `config.json`.
    ///
    /// # Errors
    /// As [`Self::from_file`] when the name is not built in.
    pub fn resolve(name_or_path: &str) -> Result<Self> {
        match builtin::by_name(name_or_path) {
            Some(text) => Self::from_json_str(text),
            None => Self::from_file(name_or_path),
        }
    }

    /// Parameter counts of the whole (unsharded) model, by part.
    pub fn param_counts(&self) -> ParamCounts {
        let c = &self.config;
        let s = &c.shape;
        let (h, i, v, l) = (
            c.hidden_size as u64,
            c.intermediate_size as u64,
            c.vocab_size as u64,
            s.num_layers as u64,
        );
        let q = (s.num_q_heads * s.head_dim) as u64;
        let kv = (s.num_kv_heads * s.head_dim) as u64;
        ParamCounts {
            embedding: v * h,
            attention: l * (h * q + 2 * h * kv + q * h),
            attention_bias: if self.attention_bias {
                l * (q + 2 * kv)
            } else {
                0
            },
            mlp: l * 3 * h * i,
            norms: (2 * l + 1) * h,
            lm_head: if c.tie_word_embeddings { 0 } else { v * h },
        }
    }
}

/// Parameters of a model, by part (see the module docs for the formulas).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ParamCounts {
    /// Token embedding.
    pub embedding: u64,
    /// q, k, v and o projections of all layers.
    pub attention: u64,
    /// q, k, v biases of all layers (0 for models without them).
    pub attention_bias: u64,
    /// gate, up and down projections of all layers.
    pub mlp: u64,
    /// RMSNorm weights.
    pub norms: u64,
    /// Output projection (0 when tied to the embedding).
    pub lm_head: u64,
}

impl ParamCounts {
    /// All parameters.
    pub const fn total(&self) -> u64 {
        self.embedding + self.attention + self.attention_bias + self.mlp + self.norms + self.lm_head
    }

    /// Bytes one GPU holds with weights in `precision` split `tp` ways.
    pub const fn bytes_per_gpu(&self, precision: WeightPrecision, tp: usize) -> u64 {
        let tp = if tp == 0 { 1 } else { tp as u64 };
        let dense = precision.dense_elem_bytes();
        let linear = precision.linear_bytes((self.attention + self.mlp).div_ceil(tp));
        let sharded_dense = (self.embedding + self.lm_head + self.attention_bias).div_ceil(tp);
        linear + dense * sharded_dense + dense * self.norms
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
}

impl PlanInput {
    /// Defaults: weights in 16 bits, KV in bf16, utilisation 0.9, estimated reserve,
    /// 8192 batch tokens, 16-token blocks, the model's whole context (4096 when the
    /// config does not say), 1 request, no tensor parallelism.
    pub fn new(model: ModelSpec, gpu_memory_bytes: u64) -> Self {
        let context = match model.config.max_position_embeddings {
            0 => 4096,
            n => n,
        };
        PlanInput {
            model,
            weight_precision: WeightPrecision::F16,
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
    /// [`Error::OutOfRange`] unless `gib` is finite and positive.
    pub fn set_gpu_memory_gib(&mut self, gib: f64) -> Result<()> {
        if !(gib.is_finite() && gib > 0.0) {
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
    /// [`Error::InvalidConfig`] for a bad block size.
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
        self.layout().map(|_| ())
    }

    /// The KV layout of one GPU: the model's shape with `num_kv_heads / tp` heads.
    fn layout(&self) -> Result<KvLayout> {
        let mut shape = self.model.config.shape.with_dtype(self.kv_dtype);
        shape.num_kv_heads /= self.tensor_parallel.max(1);
        shape.num_q_heads /= self.tensor_parallel.max(1);
        KvLayout::new(shape, self.block_size)
    }

    /// The estimated reserve for activations and workspace of one GPU (module docs).
    pub fn estimated_reserve_bytes(&self) -> u64 {
        let c = &self.model.config;
        let s = &c.shape;
        let tp = self.tensor_parallel.max(1) as u64;
        let act = self.weight_precision.dense_elem_bytes();
        let h = c.hidden_size as u64;
        let qkv = ((s.num_q_heads + 2 * s.num_kv_heads) * s.head_dim) as u64;
        let per_token = 2 * h + qkv / tp + 2 * c.intermediate_size as u64 / tp;
        let logits_rows = self.concurrency.min(self.max_batch_tokens) as u64;
        WORKSPACE_BYTES
            + self.max_batch_tokens as u64 * act * per_token
            + logits_rows * c.vocab_size as u64 * 4
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
        let params = self.model.param_counts();
        let weights = params.bytes_per_gpu(self.weight_precision, self.tensor_parallel);
        let reserve = self
            .reserve_bytes
            .unwrap_or_else(|| self.estimated_reserve_bytes());
        let usable = (self.gpu_memory_bytes as f64 * self.gpu_memory_utilization).floor() as u64;
        let kv_budget = usable.saturating_sub(weights).saturating_sub(reserve);
        let block_bytes = layout.block_bytes() as u64;
        let num_blocks = kv_budget / block_bytes;
        let blocks_per_request = layout.blocks_for_tokens(self.context_tokens) as u64;
        let max_concurrency = num_blocks / blocks_per_request;
        let needed_blocks = blocks_per_request * self.concurrency as u64;
        let verdict = if weights + reserve > usable {
            Verdict::DoesNotFit {
                shortfall: Shortfall::Weights {
                    needed_bytes: weights + reserve,
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
            weight_bytes: weights,
            reserve_bytes: reserve,
            usable_bytes: usable,
            kv_budget_bytes: kv_budget,
            kv_bytes_per_token: layout.token_bytes() as u64,
            block_bytes,
            num_blocks,
            capacity_tokens: num_blocks * self.block_size as u64,
            blocks_per_request,
            max_concurrency,
            verdict,
        })
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
        if plan.weight_bytes + plan.reserve_bytes <= plan.usable_bytes {
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
            let blocks_each = plan.num_blocks / self.concurrency as u64;
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
            if shape.num_q_heads % tp == 0 && shape.num_kv_heads % tp == 0 {
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
        let current = self.weight_precision.linear_bytes(1 << 20);
        for precision in WeightPrecision::LADDER {
            if precision.linear_bytes(1 << 20) < current {
                let mut alt = self.clone();
                alt.weight_precision = precision;
                if let Some(max_concurrency) = fits(&alt) {
                    out.push(Suggestion::WeightPrecision {
                        precision,
                        max_concurrency,
                    });
                    break;
                }
            }
        }
        let needed = plan.weight_bytes
            + plan.reserve_bytes
            + plan.blocks_per_request * self.concurrency as u64 * plan.block_bytes;
        // Rounded up to whole MiB, then checked: `usable` is floored, so the exact
        // quotient can fall a byte short.
        const MIB: u64 = 1 << 20;
        let mut gpu = (needed as f64 / self.gpu_memory_utilization).ceil() as u64;
        gpu = gpu.div_ceil(MIB) * MIB;
        for _ in 0..4 {
            let mut alt = self.clone();
            alt.gpu_memory_bytes = gpu;
            if fits(&alt).is_some() {
                break;
            }
            gpu += MIB;
        }
        out.push(Suggestion::GpuMemory {
            gpu_memory_bytes: gpu,
        });
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
        /// `concurrency * blocks_per_request`.
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
    /// Parameters of the whole model.
    pub params: u64,
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
    /// Blocks one request of `context_tokens` needs.
    pub blocks_per_request: u64,
    /// Requests of `context_tokens` tokens that fit at once.
    pub max_concurrency: u64,
    /// Whether the target fits, and what to change if not.
    pub verdict: Verdict,
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
            "weight_bytes": self.weight_bytes,
            "reserve_bytes": self.reserve_bytes,
            "usable_bytes": self.usable_bytes,
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "capacity_tokens": self.capacity_tokens,
            "blocks_per_request": self.blocks_per_request,
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
            format!("{:.2} B", self.params as f64 / 1e9),
        )?;
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
