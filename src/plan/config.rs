//! Reading Hugging Face `config.json` files: a model's KV shape and the dimensions the
//! capacity planner needs to estimate its weights (experts, latent attention,
//! quantization, hybrid layer mixes).

use crate::error::{Error, Result};
use crate::layout::shape::{DType, KvKind, ModelShape};
use crate::layout::KvLayout;

/// What a Hugging Face `config.json` says about a model: its KV shape plus the
/// dimensions the capacity planner needs to estimate weights.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Model name or `model_type`, for display.
    pub name: String,
    /// The KV-cache shape (dtype from `torch_dtype`).
    pub shape: ModelShape,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size` (0 when absent).
    pub intermediate_size: usize,
    /// `vocab_size` (0 when absent).
    pub vocab_size: usize,
    /// `max_position_embeddings` (0 when absent).
    pub max_position_embeddings: usize,
    /// `tie_word_embeddings` (false when absent).
    pub tie_word_embeddings: bool,
    /// What else the config says that changes the weights: experts, latent attention,
    /// quantization, biases and norms, and the fields this reader did not understand.
    pub arch: ModelArch,
}

impl ModelConfig {
    /// Reads a `config.json` text.
    ///
    /// Needs `num_hidden_layers`, `num_attention_heads`, `hidden_size`; takes
    /// `num_key_value_heads` (default: MHA), `head_dim` (default
    /// `hidden_size / num_attention_heads`) and `torch_dtype` (default bf16).
    ///
    /// # Errors
    /// [`Error::ModelConfig`] on malformed JSON or a missing, mistyped or nonsensical field.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::ModelConfig(format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| Error::ModelConfig("top level is not an object".into()))?;
        // Multimodal configs nest the language model under `text_config`.
        let obj = match obj.get("text_config").and_then(|t| t.as_object()) {
            Some(inner) if !obj.contains_key("num_hidden_layers") => inner,
            _ => obj,
        };
        let uint = |key: &str| -> Result<Option<usize>> {
            match obj.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .map(Some)
                    .ok_or_else(|| {
                        Error::ModelConfig(format!("{key} must be a non-negative integer, got {x}"))
                    }),
            }
        };
        let need = |key: &str| -> Result<usize> {
            uint(key)?.ok_or_else(|| Error::ModelConfig(format!("missing field {key}")))
        };
        let num_layers = need("num_hidden_layers")?;
        let num_q_heads = need("num_attention_heads")?;
        let hidden_size = need("hidden_size")?;
        let num_kv_heads = uint("num_key_value_heads")?.unwrap_or(num_q_heads);
        if num_q_heads == 0 {
            return Err(Error::ModelConfig("num_attention_heads is 0".into()));
        }
        // Nemotron-H names the attention head width `attention_head_dim`.
        let head_dim = match uint("head_dim")?.or(uint("attention_head_dim")?) {
            Some(d) => d,
            None => {
                if hidden_size % num_q_heads != 0 {
                    return Err(Error::ModelConfig(format!(
                        "hidden_size {hidden_size} is not divisible by num_attention_heads {num_q_heads} and head_dim is absent"
                    )));
                }
                hidden_size / num_q_heads
            }
        };
        let kv_dtype = match obj.get("torch_dtype").or_else(|| obj.get("dtype")) {
            None | Some(serde_json::Value::Null) => DType::BF16,
            Some(serde_json::Value::String(s)) => DType::parse(s)
                .map_err(|_| Error::ModelConfig(format!("unknown torch_dtype {s:?}")))?,
            Some(x) => {
                return Err(Error::ModelConfig(format!(
                    "torch_dtype must be a string, got {x}"
                )))
            }
        };
        let shape = ModelShape {
            num_layers,
            num_q_heads,
            num_kv_heads,
            head_dim,
            kv_dtype,
        };
        shape
            .validate()
            .map_err(|e| Error::ModelConfig(e.to_string()))?;
        let name = ["_name_or_path", "model_type"]
            .iter()
            .find_map(|k| obj.get(*k).and_then(|s| s.as_str()))
            .unwrap_or("unnamed")
            .to_string();
        Ok(ModelConfig {
            name,
            shape,
            hidden_size,
            intermediate_size: uint("intermediate_size")?.unwrap_or(0),
            vocab_size: uint("vocab_size")?.unwrap_or(0),
            max_position_embeddings: uint("max_position_embeddings")?.unwrap_or(0),
            // transformers' default differs by family: Gemma ties, the others do not.
            tie_word_embeddings: obj
                .get("tie_word_embeddings")
                .and_then(|b| b.as_bool())
                .unwrap_or_else(|| {
                    obj.get("model_type")
                        .and_then(|t| t.as_str())
                        .is_some_and(|t| t.starts_with("gemma"))
                }),
            arch: ModelArch::read(obj, &shape)?,
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

    /// What the cache holds per token and layer: a latent for latent-attention (MLA)
    /// configs (`kv_lora_rank`), K and V per KV head otherwise.
    pub fn kv_kind(&self) -> KvKind {
        match &self.arch.mla {
            Some(m) => KvKind::Latent {
                kv_lora_rank: m.kv_lora_rank,
                rope_dim: m.qk_rope_head_dim,
            },
            None => KvKind::Standard,
        }
    }

    /// The shape of the paged cache: [`Self::shape`] for standard attention, less the
    /// recurrent and MLP-only layers of a hybrid model (only its attention layers keep
    /// K and V: see [`ModelArch::hybrid`]); for MLA [`ModelShape::latent`] (one vector
    /// of `kv_lora_rank + qk_rope_head_dim` per token and layer; `num_key_value_heads`
    /// and `head_dim` do not enter).
    ///
    /// # Errors
    /// [`Error::ModelConfig`] when the latent width overflows or is not a valid shape.
    pub fn cache_shape(&self) -> Result<ModelShape> {
        let s = self.shape;
        match self.kv_kind() {
            KvKind::Standard => Ok(match &self.arch.hybrid {
                Some(h) => ModelShape {
                    num_layers: h.count(LayerKind::Attention),
                    ..s
                },
                None => s,
            }),
            KvKind::Latent {
                kv_lora_rank,
                rope_dim,
            } => {
                let width = kv_lora_rank.checked_add(rope_dim).ok_or_else(|| {
                    Error::ModelConfig(format!(
                        "kv_lora_rank {kv_lora_rank} + qk_rope_head_dim {rope_dim} overflows"
                    ))
                })?;
                let shape = ModelShape {
                    num_layers: s.num_layers,
                    num_q_heads: s.num_q_heads,
                    num_kv_heads: 1,
                    head_dim: width,
                    kv_dtype: s.kv_dtype,
                };
                shape
                    .validate()
                    .map_err(|e| Error::ModelConfig(format!("latent cache: {e}")))?;
                Ok(shape)
            }
        }
    }

    /// The layout of this model's whole (unsharded) cache in `kv_dtype` with blocks of
    /// `block_size` tokens: standard or latent as the config says.
    ///
    /// ```
    /// use pagedkv::{DType, ModelConfig};
    ///
    /// let v3 = ModelConfig::from_json_str(include_str!("../../tests/data/deepseek-v3.json"))?;
    /// let layout = v3.kv_layout(DType::BF16, 64)?;
    /// assert_eq!(layout.token_bytes(), 61 * (512 + 64) * 2);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Self::cache_shape`]; [`Error::InvalidConfig`] for a bad block size.
    pub fn kv_layout(&self, kv_dtype: DType, block_size: usize) -> Result<KvLayout> {
        let shape = self.cache_shape()?.with_dtype(kv_dtype);
        KvLayout::with_kind(shape, block_size, self.kv_kind())
    }
}

/// Architectures whose weights the reader counts exactly. Anything else is read as a
/// Llama-style dense decoder, and refused if it carries fields that change memory.
pub const KNOWN_MODEL_TYPES: [&str; 21] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "llama4_text",
    "phimoe",
    "olmoe",
    "qwen3_next",
    "nemotron_h",
    "jamba",
    "granitemoehybrid",
];

/// Substrings of config keys that can change the size of the weights or of the cache.
/// A key containing one of them that the reader does not consume for the config's
/// `model_type` is recorded in [`ModelArch::unrecognized`].
const SIZE_KEY_PATTERNS: [&str; 16] = [
    "expert",
    "moe",
    "lora_rank",
    "head_dim",
    "dense_replace",
    "sparse_step",
    "mlp_only",
    "intermediate_size",
    "nextn",
    "linear_",
    "mamba",
    "ssm",
    "conv_kernel",
    "state_size",
    "ffn",
    "num_local",
];

/// Mixture-of-experts feed-forward layers, as a config describes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer (`num_local_experts`, `num_experts`,
    /// `n_routed_experts`).
    pub num_experts: usize,
    /// Routed experts each token uses (`num_experts_per_tok`).
    pub experts_per_token: usize,
    /// Intermediate size of one routed expert (`moe_intermediate_size`, or
    /// `intermediate_size` for Mixtral, gpt-oss and Llama-4).
    pub expert_intermediate_size: usize,
    /// Layers whose FFN is a mixture of experts; the others are dense.
    pub num_moe_layers: usize,
    /// Intermediate size of the dense FFN layers (`intermediate_size`, or
    /// `intermediate_size_mlp` for Llama-4).
    pub dense_intermediate_size: usize,
    /// Always-active shared experts per MoE layer (`n_shared_experts`; one for
    /// Qwen2-MoE and Llama-4).
    pub num_shared_experts: usize,
    /// Intermediate size of one shared expert.
    pub shared_intermediate_size: usize,
    /// A sigmoid gate `hidden -> 1` on the shared expert (Qwen2-MoE).
    pub shared_expert_gate: bool,
    /// The router has a bias (gpt-oss).
    pub router_bias: bool,
    /// The router keeps a per-expert score-correction bias (DeepSeek-V3 `noaux_tc`).
    pub router_score_bias: bool,
    /// The experts' projections have biases (gpt-oss).
    pub expert_bias: bool,
}

/// Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value
/// projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaConfig {
    /// `q_lora_rank` (`None`: a full query projection).
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`: the latent the cache holds (with the rope part, see
    /// [`KvKind::Latent`]).
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim`.
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
}

/// How a checkpoint's linear layers are quantized (`quantization_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantScheme {
    /// 8-bit floats, with one f32 scale per `rows x cols` block when block-wise
    /// (`quant_method: fp8`, `weight_block_size`).
    Fp8 {
        /// `weight_block_size`, when given.
        block: Option<(usize, usize)>,
    },
    /// 4-bit integers with one f16 scale per group, and a 4-bit zero point per group
    /// when `zero_point` (AWQ; GPTQ stores zero points either way).
    Int4 {
        /// Weights per group (`group_size`; GPTQ's -1, one group per column, is read
        /// as `None`).
        group_size: Option<usize>,
        /// Whether zero points are stored.
        zero_point: bool,
    },
    /// 8-bit integers (GPTQ 8-bit, bitsandbytes `load_in_8bit`).
    Int8,
    /// bitsandbytes NF4/FP4 (`load_in_4bit`): blocks of 64 with an absmax each.
    Nf4 {
        /// `bnb_4bit_use_double_quant`: the absmax values quantized to 8 bits.
        double_quant: bool,
    },
    /// MXFP4 (gpt-oss): 4-bit floats with one 8-bit exponent per 32.
    Mxfp4,
}

/// `quantization_config`, as far as it changes sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantization {
    /// The scheme.
    pub scheme: QuantScheme,
    /// `modules_to_not_convert` names the attention projections: they stay 16-bit
    /// (gpt-oss quantizes only the experts).
    pub attention_unquantized: bool,
}

/// What mixes tokens in one layer of a hybrid model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Attention: K and V of every token stay in the paged cache.
    Attention,
    /// A recurrent layer (Mamba or gated DeltaNet): one fixed-size state per sequence,
    /// whatever its length.
    Recurrent,
    /// A feed-forward layer with no mixer and no cache (Nemotron-H's `-`).
    Mlp,
}

/// The recurrent layers of a hybrid model, with the dimensions that size their state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateMixer {
    /// Mamba (Mamba-1, selective scan; Jamba): a conv state of `(conv_kernel - 1) x
    /// d_inner` and an SSM state of `d_inner x d_state`.
    Mamba1 {
        /// `mamba_expand x hidden_size`.
        d_inner: usize,
        /// `mamba_d_state`.
        d_state: usize,
        /// `mamba_d_conv`.
        conv_kernel: usize,
        /// `mamba_dt_rank` (`"auto"`: `ceil(hidden_size / 16)`).
        dt_rank: usize,
    },
    /// Mamba-2 (SSD; Nemotron-H, Granite 4.0-H): a conv state of `(conv_kernel - 1) x
    /// (d_inner + 2 n_groups d_state)` and an SSM state of `num_heads x head_dim x
    /// d_state`.
    Mamba2 {
        /// `num_heads x head_dim`.
        d_inner: usize,
        /// SSM heads (`mamba_num_heads`, `mamba_n_heads`).
        num_heads: usize,
        /// Width of one head (`mamba_head_dim`, `mamba_d_head`).
        head_dim: usize,
        /// `ssm_state_size`, `mamba_d_state`.
        d_state: usize,
        /// Groups sharing B and C (`n_groups`, `mamba_n_groups`).
        n_groups: usize,
        /// `conv_kernel`, `mamba_d_conv`.
        conv_kernel: usize,
    },
    /// Gated DeltaNet (Qwen3-Next's linear attention): a conv state over the q, k and
    /// v channels, `(conv_kernel - 1) x (2 num_k_heads head_k_dim + num_v_heads
    /// head_v_dim)`, and a recurrent state of `num_v_heads x head_k_dim x head_v_dim`.
    GatedDeltaNet {
        /// `linear_num_key_heads`.
        num_k_heads: usize,
        /// `linear_num_value_heads`.
        num_v_heads: usize,
        /// `linear_key_head_dim`.
        head_k_dim: usize,
        /// `linear_value_head_dim`.
        head_v_dim: usize,
        /// `linear_conv_kernel_dim`.
        conv_kernel: usize,
    },
}

impl StateMixer {
    /// Short name: `mamba`, `mamba2` or `gated_deltanet`.
    pub const fn name(&self) -> &'static str {
        match self {
            StateMixer::Mamba1 { .. } => "mamba",
            StateMixer::Mamba2 { .. } => "mamba2",
            StateMixer::GatedDeltaNet { .. } => "gated_deltanet",
        }
    }
}

/// The layer mix of a hybrid model, as its `config.json` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HybridConfig {
    /// Every layer's kind, in model order (`num_hidden_layers` of them).
    pub layers: Vec<LayerKind>,
    /// The recurrent layers' mixer.
    pub mixer: StateMixer,
    /// The recurrent layers' depthwise convolution has a bias.
    pub conv_bias: bool,
    /// The recurrent layers' input and output projections have biases.
    pub proj_bias: bool,
    /// The SSM-state dtype the config asks for (`mamba_ssm_cache_dtype`,
    /// `mamba_ssm_dtype`), if it says.
    pub ssm_dtype: Option<DType>,
    /// Layers with a feed-forward block (every layer but in Nemotron-H, whose
    /// feed-forward blocks are layers of their own).
    pub ffn_layers: usize,
    /// Matrices of one dense feed-forward block: 3 gated (gate, up, down), 2 not
    /// (Nemotron-H's squared-ReLU up and down).
    pub ffn_matrices: usize,
    /// Width of a dense feed-forward block.
    pub ffn_intermediate_size: usize,
    /// The attention layers' query projection also produces an output gate as wide as
    /// the queries (Qwen3-Next's gated attention).
    pub attention_output_gate: bool,
}

impl HybridConfig {
    /// Layers of `kind`.
    pub fn count(&self, kind: LayerKind) -> usize {
        self.layers.iter().filter(|k| **k == kind).count()
    }
}

/// Reads the layer mix of the hybrid `model_type`s the planner knows (Qwen3-Next,
/// Nemotron-H, Jamba, Granite 4.0-H); `None` for every other model. A layer type the
/// reader does not know is [`Error::UnknownLayerType`]; a missing dimension is
/// [`Error::ModelConfig`].
fn read_hybrid(
    obj: &serde_json::Map<String, serde_json::Value>,
    mt: &str,
    num_layers: usize,
    consumed: &mut Vec<&'static str>,
) -> Result<Option<HybridConfig>> {
    use serde_json::Value;
    if !matches!(
        mt,
        "qwen3_next" | "nemotron_h" | "jamba" | "granitemoehybrid"
    ) {
        return Ok(None);
    }
    let uint = |key: &str| -> Result<Option<usize>> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    Error::ModelConfig(format!("{key} must be a non-negative integer, got {x}"))
                }),
        }
    };
    let need = |key: &str| -> Result<usize> {
        match uint(key)? {
            Some(n) if n > 0 => Ok(n),
            _ => Err(Error::ModelConfig(format!(
                "{mt}: the recurrent layers need a positive {key}"
            ))),
        }
    };
    let flag = |key: &str| obj.get(key).and_then(Value::as_bool);
    // Layer names as each family spells them; anything else is refused.
    let named = |names: &[(&str, LayerKind)]| -> Result<Option<Vec<LayerKind>>> {
        let key = ["layer_types", "layers_block_type"]
            .into_iter()
            .find(|k| obj.contains_key(*k));
        let Some(key) = key else { return Ok(None) };
        let list = obj[key]
            .as_array()
            .ok_or_else(|| Error::ModelConfig(format!("{key} must be a list of layer names")))?;
        list.iter()
            .enumerate()
            .map(|(i, v)| {
                let name = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                names
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, kind)| *kind)
                    .ok_or_else(|| unknown_layer_type(mt, i, &name))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    };
    let hidden = need("hidden_size")?;
    let (layers, mixer) = match mt {
        "qwen3_next" => {
            consumed.extend([
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            ]);
            let layers = match named(&[
                ("full_attention", LayerKind::Attention),
                ("linear_attention", LayerKind::Recurrent),
            ])? {
                Some(l) => l,
                // transformers' default: every `full_attention_interval`-th layer is
                // full attention, the others linear.
                None => {
                    let every = uint("full_attention_interval")?.unwrap_or(4).max(1);
                    (0..num_layers)
                        .map(|i| {
                            if (i + 1) % every == 0 {
                                LayerKind::Attention
                            } else {
                                LayerKind::Recurrent
                            }
                        })
                        .collect()
                }
            };
            let mixer = StateMixer::GatedDeltaNet {
                num_k_heads: need("linear_num_key_heads")?,
                num_v_heads: need("linear_num_value_heads")?,
                head_k_dim: need("linear_key_head_dim")?,
                head_v_dim: need("linear_value_head_dim")?,
                conv_kernel: need("linear_conv_kernel_dim")?,
            };
            (layers, mixer)
        }
        "nemotron_h" => {
            consumed.extend([
                "mamba_num_heads",
                "mamba_head_dim",
                "ssm_state_size",
                "conv_kernel",
                "mamba_hidden_act",
                "mamba_proj_bias",
                "mamba_ssm_cache_dtype",
            ]);
            let layers = match obj.get("hybrid_override_pattern").and_then(Value::as_str) {
                Some(pattern) => pattern
                    .chars()
                    .enumerate()
                    .map(|(i, c)| match c {
                        'M' => Ok(LayerKind::Recurrent),
                        '*' => Ok(LayerKind::Attention),
                        '-' => Ok(LayerKind::Mlp),
                        other => Err(unknown_layer_type(mt, i, &other.to_string())),
                    })
                    .collect::<Result<Vec<_>>>()?,
                None => named(&[
                    ("mamba", LayerKind::Recurrent),
                    ("attention", LayerKind::Attention),
                    ("mlp", LayerKind::Mlp),
                ])?
                .ok_or_else(|| {
                    Error::ModelConfig(
                        "nemotron_h needs hybrid_override_pattern or layers_block_type".into(),
                    )
                })?,
            };
            let (num_heads, head_dim) = (need("mamba_num_heads")?, need("mamba_head_dim")?);
            let mixer = StateMixer::Mamba2 {
                d_inner: num_heads * head_dim,
                num_heads,
                head_dim,
                d_state: need("ssm_state_size")?,
                n_groups: need("n_groups")?,
                conv_kernel: need("conv_kernel")?,
            };
            (layers, mixer)
        }
        "jamba" => {
            consumed.extend([
                "mamba_d_state",
                "mamba_d_conv",
                "mamba_expand",
                "mamba_dt_rank",
                "mamba_conv_bias",
                "mamba_proj_bias",
                "use_mamba_kernels",
            ]);
            let period = need("attn_layer_period")?;
            let offset = uint("attn_layer_offset")?.unwrap_or(0);
            let layers = (0..num_layers)
                .map(|i| {
                    if i % period == offset % period {
                        LayerKind::Attention
                    } else {
                        LayerKind::Recurrent
                    }
                })
                .collect();
            let dt_rank = match obj.get("mamba_dt_rank") {
                None | Some(Value::Null) => hidden.div_ceil(16),
                Some(Value::String(s)) if s == "auto" => hidden.div_ceil(16),
                Some(_) => need("mamba_dt_rank")?,
            };
            let mixer = StateMixer::Mamba1 {
                d_inner: need("mamba_expand")?.checked_mul(hidden).ok_or_else(|| {
                    Error::ModelConfig("mamba_expand x hidden_size overflows".into())
                })?,
                d_state: need("mamba_d_state")?,
                conv_kernel: need("mamba_d_conv")?,
                dt_rank,
            };
            (layers, mixer)
        }
        _ => {
            // granitemoehybrid
            consumed.extend([
                "mamba_n_heads",
                "mamba_d_head",
                "mamba_d_state",
                "mamba_n_groups",
                "mamba_d_conv",
                "mamba_expand",
                "mamba_chunk_size",
                "mamba_conv_bias",
                "mamba_proj_bias",
            ]);
            let layers = named(&[
                ("mamba", LayerKind::Recurrent),
                ("attention", LayerKind::Attention),
            ])?
            .ok_or_else(|| Error::ModelConfig("granitemoehybrid needs layer_types".into()))?;
            let (num_heads, head_dim) = (need("mamba_n_heads")?, need("mamba_d_head")?);
            let d_inner = num_heads * head_dim;
            if let Some(expand) = uint("mamba_expand")? {
                if expand * hidden != d_inner {
                    return Err(Error::ModelConfig(format!(
                        "mamba_n_heads {num_heads} x mamba_d_head {head_dim} = {d_inner} is not mamba_expand {expand} x hidden_size {hidden}"
                    )));
                }
            }
            let mixer = StateMixer::Mamba2 {
                d_inner,
                num_heads,
                head_dim,
                d_state: need("mamba_d_state")?,
                n_groups: need("mamba_n_groups")?,
                conv_kernel: need("mamba_d_conv")?,
            };
            (layers, mixer)
        }
    };
    // Keys of these families that match a size pattern and change nothing here.
    consumed.extend([
        "full_attention_interval",
        "use_conv_bias",
        "mamba_ssm_dtype",
    ]);
    if layers.len() != num_layers {
        return Err(Error::ModelConfig(format!(
            "{mt}: {} layer types for num_hidden_layers {num_layers}",
            layers.len()
        )));
    }
    if !layers.contains(&LayerKind::Attention) {
        return Err(Error::ModelConfig(format!(
            "{mt}: no attention layer; a purely recurrent model has no paged KV cache to plan"
        )));
    }
    let ssm_dtype = match ["mamba_ssm_cache_dtype", "mamba_ssm_dtype"]
        .iter()
        .find_map(|k| obj.get(*k).and_then(Value::as_str))
    {
        None | Some("auto") => None,
        Some(name) => Some(
            DType::parse(name)
                .map_err(|_| Error::ModelConfig(format!("unknown SSM state dtype {name:?}")))?,
        ),
    };
    let nemotron = mt == "nemotron_h";
    let ffn_layers = if nemotron {
        layers.iter().filter(|k| **k == LayerKind::Mlp).count()
    } else {
        num_layers
    };
    let ffn_intermediate_size = if mt == "granitemoehybrid" {
        uint("shared_intermediate_size")?.unwrap_or(0)
    } else {
        uint("intermediate_size")?.unwrap_or(0)
    };
    Ok(Some(HybridConfig {
        layers,
        mixer,
        conv_bias: flag("mamba_conv_bias")
            .or(flag("use_conv_bias"))
            .unwrap_or(mt != "qwen3_next"),
        proj_bias: flag("mamba_proj_bias").unwrap_or(false),
        ssm_dtype,
        ffn_layers,
        ffn_matrices: if nemotron { 2 } else { 3 },
        ffn_intermediate_size,
        attention_output_gate: mt == "qwen3_next",
    }))
}

/// What a config says about the weights beyond the dense Llama shape.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelArch {
    /// `model_type` (of `text_config` for multimodal configs).
    pub model_type: Option<String>,
    /// Whether `model_type` is one of [`KNOWN_MODEL_TYPES`].
    pub known: bool,
    /// The q, k, v projections have biases (`attention_bias`; always for Qwen2).
    pub attention_bias: bool,
    /// The output projection has a bias too (Llama-style `attention_bias`, gpt-oss).
    pub o_proj_bias: bool,
    /// One learned attention-sink logit per head (gpt-oss).
    pub attention_sinks: bool,
    /// RMSNorms of `head_dim` on queries and keys (Qwen3, Gemma-3, OLMoE over the
    /// whole q and k widths).
    pub qk_norm: bool,
    /// Norm vectors of `hidden_size` per layer (2; 4 for Gemma-2/3).
    pub norms_per_layer: usize,
    /// Mixture-of-experts layers.
    pub moe: Option<MoeConfig>,
    /// Latent attention.
    pub mla: Option<MlaConfig>,
    /// Quantized checkpoint.
    pub quantization: Option<Quantization>,
    /// `sliding_window` when sliding-window attention is in use (recorded only: the
    /// planner sizes every layer's KV for the full context).
    pub sliding_window: Option<usize>,
    /// `layer_types` (`full_attention`, `sliding_attention` per layer).
    pub layer_types: Vec<String>,
    /// The layer mix of a hybrid model (attention beside Mamba or gated-DeltaNet
    /// layers), `None` for a model whose every layer is attention.
    pub hybrid: Option<HybridConfig>,
    /// Multi-token-prediction layers (`num_nextn_predict_layers`), not counted: engines
    /// load them only for speculative decoding.
    pub mtp_layers: usize,
    /// Fields that can change memory and that the reader did not understand for this
    /// `model_type`, as `key` or `key = value`. Planning refuses a model with any
    /// unless told to assume a dense model.
    pub unrecognized: Vec<String>,
}

impl ModelArch {
    /// Reads the architecture fields of a (text) config object.
    fn read(obj: &serde_json::Map<String, serde_json::Value>, shape: &ModelShape) -> Result<Self> {
        use serde_json::Value;
        let uint = |key: &str| -> Result<Option<usize>> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .map(Some)
                    .ok_or_else(|| {
                        Error::ModelConfig(format!("{key} must be a non-negative integer, got {x}"))
                    }),
            }
        };
        let flag = |key: &str| obj.get(key).and_then(Value::as_bool);
        let model_type = obj
            .get("model_type")
            .and_then(Value::as_str)
            .map(str::to_string);
        let mt = model_type.as_deref().unwrap_or("");
        let known = KNOWN_MODEL_TYPES.contains(&mt);
        let mut consumed: Vec<&str> = vec!["head_dim", "attention_head_dim", "intermediate_size"];
        let qwen2 = mt == "qwen2" || mt == "qwen2_moe";
        let attention_bias = flag("attention_bias").unwrap_or(qwen2);
        // Qwen2 hard-codes biases on q, k, v and none on o; Llama-style models put
        // `attention_bias` on all four.
        let o_proj_bias = attention_bias && !qwen2 && known;
        let num_layers = shape.num_layers;

        let moe = match mt {
            "mixtral" | "phimoe" | "gpt_oss" | "olmoe" => {
                let (experts_key, num_experts) = match uint("num_local_experts")? {
                    Some(n) => ("num_local_experts", Some(n)),
                    None => ("num_experts", uint("num_experts")?),
                };
                consumed.extend([experts_key, "num_experts_per_tok", "experts_per_token"]);
                match num_experts {
                    Some(n) if n > 0 => Some(MoeConfig {
                        num_experts: n,
                        experts_per_token: need_moe(
                            uint("num_experts_per_tok")?.or(uint("experts_per_token")?),
                            "num_experts_per_tok",
                        )?,
                        expert_intermediate_size: need_moe(
                            uint("intermediate_size")?,
                            "intermediate_size",
                        )?,
                        num_moe_layers: num_layers,
                        dense_intermediate_size: 0,
                        num_shared_experts: 0,
                        shared_intermediate_size: 0,
                        shared_expert_gate: false,
                        router_bias: mt == "gpt_oss",
                        router_score_bias: false,
                        expert_bias: mt == "gpt_oss",
                    }),
                    _ => None,
                }
            }
            "qwen2_moe" | "qwen3_moe" | "qwen3_next" => {
                consumed.extend([
                    "num_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "shared_expert_intermediate_size",
                    "decoder_sparse_step",
                    "mlp_only_layers",
                ]);
                let mlp_only: Vec<u64> = match obj.get("mlp_only_layers") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|x| {
                            x.as_u64().ok_or_else(|| {
                                Error::ModelConfig(format!(
                                    "mlp_only_layers must hold layer indices, got {x}"
                                ))
                            })
                        })
                        .collect::<Result<_>>()?,
                    Some(x) => {
                        return Err(Error::ModelConfig(format!(
                            "mlp_only_layers must be a list, got {x}"
                        )))
                    }
                };
                let step = uint("decoder_sparse_step")?.unwrap_or(1);
                match uint("num_experts")? {
                    Some(n) if n > 0 && step > 0 => {
                        let num_moe_layers = (0..num_layers)
                            .filter(|&i| !mlp_only.contains(&(i as u64)) && (i + 1) % step == 0)
                            .count();
                        let shared = uint("shared_expert_intermediate_size")?.unwrap_or(0);
                        Some(MoeConfig {
                            num_experts: n,
                            experts_per_token: need_moe(
                                uint("num_experts_per_tok")?,
                                "num_experts_per_tok",
                            )?,
                            expert_intermediate_size: need_moe(
                                uint("moe_intermediate_size")?,
                                "moe_intermediate_size",
                            )?,
                            num_moe_layers,
                            dense_intermediate_size: uint("intermediate_size")?.unwrap_or(0),
                            num_shared_experts: usize::from(shared > 0),
                            shared_intermediate_size: shared,
                            shared_expert_gate: shared > 0,
                            router_bias: false,
                            router_score_bias: false,
                            expert_bias: false,
                        })
                    }
                    _ => None,
                }
            }
            "deepseek_v2" | "deepseek_v3" => {
                consumed.extend([
                    "n_routed_experts",
                    "n_shared_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "first_k_dense_replace",
                    "moe_layer_freq",
                    "ep_size",
                    "num_nextn_predict_layers",
                ]);
                let first_dense = uint("first_k_dense_replace")?.unwrap_or(0);
                let freq = uint("moe_layer_freq")?.unwrap_or(1);
                match uint("n_routed_experts")? {
                    Some(n) if n > 0 && freq > 0 => {
                        let num_moe_layers = (0..num_layers)
                            .filter(|&i| i >= first_dense && i % freq == 0)
                            .count();
                        let expert =
                            need_moe(uint("moe_intermediate_size")?, "moe_intermediate_size")?;
                        Some(MoeConfig {
                            num_experts: n,
                            experts_per_token: need_moe(
                                uint("num_experts_per_tok")?,
                                "num_experts_per_tok",
                            )?,
                            expert_intermediate_size: expert,
                            num_moe_layers,
                            dense_intermediate_size: uint("intermediate_size")?.unwrap_or(0),
                            num_shared_experts: uint("n_shared_experts")?.unwrap_or(0),
                            shared_intermediate_size: expert,
                            shared_expert_gate: false,
                            router_bias: false,
                            router_score_bias: obj.get("topk_method").and_then(Value::as_str)
                                == Some("noaux_tc"),
                            expert_bias: false,
                        })
                    }
                    _ => None,
                }
            }
            "jamba" => {
                consumed.extend([
                    "num_experts",
                    "num_experts_per_tok",
                    "expert_layer_period",
                    "expert_layer_offset",
                ]);
                let period = uint("expert_layer_period")?.unwrap_or(2);
                let offset = uint("expert_layer_offset")?.unwrap_or(1);
                match uint("num_experts")? {
                    // One expert is Jamba's way of saying dense.
                    Some(n) if n > 1 && period > 0 => {
                        let i = need_moe(uint("intermediate_size")?, "intermediate_size")?;
                        Some(MoeConfig {
                            num_experts: n,
                            experts_per_token: need_moe(
                                uint("num_experts_per_tok")?,
                                "num_experts_per_tok",
                            )?,
                            expert_intermediate_size: i,
                            num_moe_layers: (0..num_layers)
                                .filter(|&l| l % period == offset % period)
                                .count(),
                            dense_intermediate_size: i,
                            num_shared_experts: 0,
                            shared_intermediate_size: 0,
                            shared_expert_gate: false,
                            router_bias: false,
                            router_score_bias: false,
                            expert_bias: false,
                        })
                    }
                    _ => None,
                }
            }
            "granitemoehybrid" => {
                consumed.extend([
                    "num_local_experts",
                    "num_experts_per_tok",
                    "shared_intermediate_size",
                ]);
                // Every layer's FFN is the routed experts plus one shared expert; with
                // no experts only the shared one, a dense gated MLP (Granite-4.0-H-Micro).
                match uint("num_local_experts")? {
                    Some(n) if n > 0 => Some(MoeConfig {
                        num_experts: n,
                        experts_per_token: need_moe(
                            uint("num_experts_per_tok")?,
                            "num_experts_per_tok",
                        )?,
                        expert_intermediate_size: need_moe(
                            uint("intermediate_size")?,
                            "intermediate_size",
                        )?,
                        num_moe_layers: num_layers,
                        dense_intermediate_size: 0,
                        num_shared_experts: usize::from(
                            uint("shared_intermediate_size")?.unwrap_or(0) > 0,
                        ),
                        shared_intermediate_size: uint("shared_intermediate_size")?.unwrap_or(0),
                        shared_expert_gate: false,
                        router_bias: false,
                        router_score_bias: false,
                        expert_bias: false,
                    }),
                    _ => None,
                }
            }
            "llama4_text" => {
                consumed.extend([
                    "num_local_experts",
                    "num_experts_per_tok",
                    "intermediate_size_mlp",
                    "interleave_moe_layer_step",
                    "moe_layers",
                ]);
                let step = uint("interleave_moe_layer_step")?.unwrap_or(1);
                match uint("num_local_experts")? {
                    Some(n) if n > 0 && step > 0 => {
                        let expert = need_moe(uint("intermediate_size")?, "intermediate_size")?;
                        Some(MoeConfig {
                            num_experts: n,
                            experts_per_token: need_moe(
                                uint("num_experts_per_tok")?,
                                "num_experts_per_tok",
                            )?,
                            expert_intermediate_size: expert,
                            num_moe_layers: (0..num_layers)
                                .filter(|&i| (i + 1) % step == 0)
                                .count(),
                            dense_intermediate_size: uint("intermediate_size_mlp")?.unwrap_or(0),
                            num_shared_experts: 1,
                            shared_intermediate_size: expert,
                            shared_expert_gate: false,
                            router_bias: false,
                            router_score_bias: false,
                            expert_bias: false,
                        })
                    }
                    _ => None,
                }
            }
            _ => None,
        };

        let mla = if mt == "deepseek_v2" || mt == "deepseek_v3" {
            consumed.extend([
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
            ]);
            match uint("kv_lora_rank")? {
                Some(kv_lora_rank) => {
                    let need = |k: &str| -> Result<usize> {
                        uint(k)?.ok_or_else(|| {
                            Error::ModelConfig(format!("latent attention (kv_lora_rank) needs {k}"))
                        })
                    };
                    Some(MlaConfig {
                        q_lora_rank: uint("q_lora_rank")?,
                        kv_lora_rank,
                        qk_nope_head_dim: need("qk_nope_head_dim")?,
                        qk_rope_head_dim: need("qk_rope_head_dim")?,
                        v_head_dim: need("v_head_dim")?,
                    })
                }
                None => None,
            }
        } else {
            None
        };

        let hybrid = read_hybrid(obj, mt, num_layers, &mut consumed)?;

        let mut unrecognized: Vec<String> = obj
            .keys()
            .filter(|k| {
                let lower = k.to_ascii_lowercase();
                SIZE_KEY_PATTERNS.iter().any(|p| lower.contains(p))
                    && !consumed.contains(&k.as_str())
                    && !matches!(obj.get(k.as_str()), Some(serde_json::Value::Null))
            })
            .cloned()
            .collect();

        let sliding_window = match flag("use_sliding_window") {
            Some(false) => None,
            _ => uint("sliding_window").ok().flatten(),
        };
        let layer_types: Vec<String> = obj
            .get("layer_types")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|t| t.as_str().unwrap_or("?").to_string())
                    .collect()
            })
            .unwrap_or_default();
        // A hybrid reader checked its own layer names; any other config may name only
        // attention layers. Anything else is refused, never guessed.
        if hybrid.is_none() {
            if let Some((layer, odd)) = layer_types
                .iter()
                .enumerate()
                .find(|(_, t)| *t != "full_attention" && *t != "sliding_attention")
            {
                return Err(unknown_layer_type(mt, layer, odd));
            }
        }

        let quantization = match obj.get("quantization_config") {
            None | Some(Value::Null) => None,
            Some(q) => match read_quantization(q) {
                Ok(q) => Some(q),
                Err(what) => {
                    unrecognized.push(format!("quantization_config: {what}"));
                    None
                }
            },
        };
        unrecognized.sort();

        let mtp_layers = if mla.is_some() || moe.is_some() {
            uint("num_nextn_predict_layers")?.unwrap_or(0)
        } else {
            0
        };
        Ok(ModelArch {
            known,
            attention_bias,
            o_proj_bias,
            attention_sinks: mt == "gpt_oss",
            qk_norm: matches!(
                mt,
                "qwen3" | "qwen3_moe" | "qwen3_next" | "gemma3_text" | "olmoe"
            ),
            norms_per_layer: match mt {
                "gemma2" | "gemma3_text" => 4,
                // One norm before each block's single mixer or MLP.
                "nemotron_h" => 1,
                _ => 2,
            },
            moe,
            mla,
            quantization,
            sliding_window,
            layer_types,
            hybrid,
            mtp_layers,
            unrecognized,
            model_type,
        })
    }
}

fn unknown_layer_type(model_type: &str, layer: usize, layer_type: &str) -> Error {
    Error::UnknownLayerType {
        model_type: if model_type.is_empty() {
            "absent".into()
        } else {
            model_type.into()
        },
        layer,
        layer_type: layer_type.into(),
    }
}

fn need_moe(v: Option<usize>, key: &str) -> Result<usize> {
    match v {
        Some(n) if n > 0 => Ok(n),
        _ => Err(Error::ModelConfig(format!(
            "a mixture-of-experts config needs a positive {key}"
        ))),
    }
}

/// Reads `quantization_config`; `Err` says what was not understood.
fn read_quantization(q: &serde_json::Value) -> std::result::Result<Quantization, String> {
    use serde_json::Value;
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .ok_or("no quant_method")?
        .to_ascii_lowercase();
    let uint = |k: &str| {
        q.get(k)
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
    };
    let scheme = match method.as_str() {
        "fp8" => {
            let block = match q.get("weight_block_size") {
                None | Some(Value::Null) => None,
                Some(Value::Array(a)) if a.len() == 2 => {
                    let side = |i: usize| {
                        a[i].as_u64()
                            .and_then(|n| usize::try_from(n).ok())
                            .filter(|&n| n > 0)
                            .ok_or(format!("weight_block_size = {}", Value::Array(a.clone())))
                    };
                    Some((side(0)?, side(1)?))
                }
                Some(x) => return Err(format!("weight_block_size = {x}")),
            };
            QuantScheme::Fp8 { block }
        }
        "awq" | "gptq" => {
            let bits = uint("bits")
                .or(uint("w_bit"))
                .ok_or(format!("{method} without bits"))?;
            let group = match q.get("group_size").or(q.get("q_group_size")) {
                Some(g) if g.as_i64() == Some(-1) => None,
                Some(g) => Some(
                    g.as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .filter(|&n| n > 0)
                        .ok_or(format!("group_size = {g}"))?,
                ),
                None => Some(128),
            };
            match bits {
                4 => QuantScheme::Int4 {
                    group_size: group,
                    zero_point: method == "gptq"
                        || q.get("zero_point").and_then(Value::as_bool).unwrap_or(true),
                },
                8 => QuantScheme::Int8,
                other => return Err(format!("{method} with bits = {other}")),
            }
        }
        "bitsandbytes" => {
            let on = |k: &str| q.get(k).and_then(Value::as_bool).unwrap_or(false);
            if on("load_in_4bit") {
                QuantScheme::Nf4 {
                    double_quant: on("bnb_4bit_use_double_quant"),
                }
            } else if on("load_in_8bit") {
                QuantScheme::Int8
            } else {
                return Err("bitsandbytes with neither load_in_4bit nor load_in_8bit".into());
            }
        }
        "mxfp4" => QuantScheme::Mxfp4,
        other => return Err(format!("quant_method = {other:?}")),
    };
    let attention_unquantized = q
        .get("modules_to_not_convert")
        .and_then(Value::as_array)
        .is_some_and(|m| {
            m.iter()
                .filter_map(Value::as_str)
                .any(|s| s.contains("self_attn"))
        });
    Ok(Quantization {
        scheme,
        attention_unquantized,
    })
}

/// Built-in model configs, written by hand from the models' public `config.json` values.
pub mod builtin {
    /// Llama-3-8B: 32 layers, 32 query / 8 KV heads, head dim 128.
    pub const LLAMA3_8B: &str = include_str!("../../tests/data/llama-3-8b.json");
    /// Qwen2.5-7B: 28 layers, 28 query / 4 KV heads, head dim 128.
    pub const QWEN2_5_7B: &str = include_str!("../../tests/data/qwen2.5-7b.json");
    /// Llama-3-70B: 80 layers, 64 query / 8 KV heads, head dim 128.
    pub const LLAMA3_70B: &str = include_str!("../../tests/data/llama-3-70b.json");

    /// Looks a built-in config up by a short name (`llama3-8b`, `qwen2.5-7b`, `llama3-70b`).
    pub fn by_name(name: &str) -> Option<&'static str> {
        match name {
            "llama3-8b" | "llama-3-8b" => Some(LLAMA3_8B),
            "qwen2.5-7b" | "qwen2-7b" => Some(QWEN2_5_7B),
            "llama3-70b" | "llama-3-70b" => Some(LLAMA3_70B),
            _ => None,
        }
    }

    /// The names [`by_name`] knows.
    pub const NAMES: [&str; 3] = ["llama3-8b", "qwen2.5-7b", "llama3-70b"];
}
