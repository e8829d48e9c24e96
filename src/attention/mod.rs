//! Paged attention over a storage backend's arena and a batch's block tables.
//!
//! This file is the minimal version from the `cuda` branch: the attention parameters,
//! the launch checks and split planner every kernel uses (pure, no GPU needed), and
//! the CUDA decode behind the `cuda` feature. The CPU attention lives beside it.

mod kernel_plan;

pub use kernel_plan::{
    plan_splits, split_plan_with, validate_csr, validate_params, validate_tables, SplitPlan,
    MAX_CONTEXT_TOKENS, MAX_SPLITS, MIN_TOKENS_PER_SPLIT,
};

#[cfg(feature = "cuda")]
pub mod cuda;

/// Parameters of one attention call.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionParams {
    /// Softmax scale applied to `q . k` (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// ALiBi slope per query head: `slope * (pos - (context_len - 1))` is added to the
    /// logit of the token at `pos`.
    pub alibi_slopes: Option<Vec<f32>>,
    /// Attend only to the last `n` tokens of each sequence.
    pub sliding_window: Option<usize>,
    /// Dequantisation scale of K for an fp8 cache (`k = stored * k_scale`); ignored for
    /// other dtypes.
    pub k_scale: f32,
    /// Dequantisation scale of V for an fp8 cache; ignored for other dtypes.
    pub v_scale: f32,
}

impl AttentionParams {
    /// Plain attention with `scale = 1 / sqrt(head_dim)` and unit fp8 scales.
    pub fn new(head_dim: usize) -> Self {
        AttentionParams {
            scale: 1.0 / (head_dim as f32).sqrt(),
            alibi_slopes: None,
            sliding_window: None,
            k_scale: 1.0,
            v_scale: 1.0,
        }
    }
}
