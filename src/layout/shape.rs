//! Model shapes, KV dtypes, and reading Hugging Face `config.json` files.

use crate::error::{Error, Result};

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit float, e4m3 (OCP "fn" variant: no infinities, one NaN pattern), with scales.
    Fp8E4M3,
}

impl DType {
    /// Every dtype, in order of decreasing size.
    pub const ALL: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::Fp8E4M3];

    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Fp8E4M3 => 1,
        }
    }

    /// Short lowercase name (`f32`, `f16`, `bf16`, `fp8`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Fp8E4M3 => "fp8",
        }
    }

    /// Parses the names used by this crate and by Hugging Face (`float16`, `bfloat16`, ...).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown name.
    pub fn parse(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Ok(DType::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "fp8" | "fp8_e4m3" | "fp8-e4m3" | "e4m3" | "float8_e4m3fn" => Ok(DType::Fp8E4M3),
            other => Err(Error::config("dtype", format!("unknown dtype {other:?}"))),
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The part of a model's shape that decides the size of its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelShape {
    /// Transformer layers, each with its own K and V.
    pub num_layers: usize,
    /// Query (attention) heads.
    pub num_q_heads: usize,
    /// Key/value heads (GQA: fewer than query heads; MQA: one).
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Element type of the cache.
    pub kv_dtype: DType,
}

impl ModelShape {
    /// Checks that every field is positive and the heads divide into groups.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first field at fault.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("num_q_heads", self.num_q_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return Err(Error::config(field, "must be positive"));
            }
            if v > 1 << 16 {
                return Err(Error::config(field, format!("{v} is implausibly large")));
            }
        }
        if self.num_q_heads % self.num_kv_heads != 0 {
            return Err(Error::config(
                "num_kv_heads",
                format!(
                    "{} query heads do not divide into {} KV heads",
                    self.num_q_heads, self.num_kv_heads
                ),
            ));
        }
        Ok(())
    }

    /// Query heads per KV head (1 = MHA, `num_q_heads` = MQA).
    pub const fn group_size(&self) -> usize {
        self.num_q_heads / self.num_kv_heads
    }

    /// Bytes of K and V for one token across all layers.
    pub const fn kv_bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.size_bytes()
    }

    /// The same shape with another KV dtype.
    pub const fn with_dtype(mut self, kv_dtype: DType) -> Self {
        self.kv_dtype = kv_dtype;
        self
    }
}

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
        let head_dim = match uint("head_dim")? {
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
            tie_word_embeddings: obj
                .get("tie_word_embeddings")
                .and_then(|b| b.as_bool())
                .unwrap_or(false),
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
