//! Model shapes and KV dtypes: what decides the size of a KV cache. Reading them from a
//! Hugging Face `config.json` is the planner's business (`plan::config`, feature `planner`).

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

/// What one token of one layer puts in the cache.
///
/// A [`ModelShape`] alone describes the standard form; a [`crate::layout::KvLayout`]
/// carries the kind, so that every existing `ModelShape` keeps its meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvKind {
    /// A key and a value vector of `head_dim` per KV head.
    #[default]
    Standard,
    /// Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2): one vector of
    /// `kv_lora_rank + rope_dim` elements per token, shared by every query head, with
    /// no K/V split. Its first `kv_lora_rank` elements (the compressed latent `c`) are
    /// the values of the absorbed form; the whole vector (`c` and the roped key part)
    /// is the key.
    Latent {
        /// `kv_lora_rank`: the compressed latent (512 for DeepSeek-V3).
        kv_lora_rank: usize,
        /// `qk_rope_head_dim`: the decoupled rotary key (64 for DeepSeek-V3).
        rope_dim: usize,
    },
}

impl KvKind {
    /// Vectors of `head_dim` one token of one layer caches per KV head: 2 (K and V) in
    /// the standard form, 1 (the latent) otherwise.
    pub const fn vectors_per_head(&self) -> usize {
        match self {
            KvKind::Standard => 2,
            KvKind::Latent { .. } => 1,
        }
    }

    /// Width of the latent vector, `kv_lora_rank + rope_dim` (`None` for the standard
    /// form).
    pub const fn latent_dim(&self) -> Option<usize> {
        match self {
            KvKind::Standard => None,
            KvKind::Latent {
                kv_lora_rank,
                rope_dim,
            } => Some(*kv_lora_rank + *rope_dim),
        }
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
        if !self.num_q_heads.is_multiple_of(self.num_kv_heads) {
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

    /// The shape of a latent (MLA) cache: one "KV head" whose `head_dim` is the
    /// latent width `kv_lora_rank + rope_dim`, read by `num_q_heads` query heads. Pair
    /// it with [`KvKind::Latent`] in [`crate::layout::KvLayout::with_kind`].
    pub const fn latent(
        num_layers: usize,
        num_q_heads: usize,
        kv_lora_rank: usize,
        rope_dim: usize,
        kv_dtype: DType,
    ) -> Self {
        ModelShape {
            num_layers,
            num_q_heads,
            num_kv_heads: 1,
            head_dim: kv_lora_rank + rope_dim,
            kv_dtype,
        }
    }

    /// Bytes of K and V for one token across all layers, in the standard form (a
    /// latent cache holds half of this for its shape: see
    /// [`crate::layout::KvLayout::token_bytes`]).
    pub const fn kv_bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.size_bytes()
    }

    /// The same shape with another KV dtype.
    pub const fn with_dtype(mut self, kv_dtype: DType) -> Self {
        self.kv_dtype = kv_dtype;
        self
    }
}
