//! The decode specialisations `examples/gpu_bench` launches, here (feature `testing`)
//! so that a CPU test (`tests/kernels/compile.rs`) holds them to the prebuilt cubins
//! without including the example: the GPU machine has no NVRTC and loads only what
//! [`catalog`] (from [`PREBUILT_ATTENTION`](super::PREBUILT_ATTENTION)) holds.

use super::{catalog, nvrtc_present, AttentionSpec, KernelSpec};
use crate::error::{Error, Result};
use crate::layout::shape::{DType, ModelShape};
use crate::layout::KvLayout;

/// Tokens per page of every bench case.
pub const BLOCK_SIZE: usize = 16;

/// The cache dtypes of the decode cases.
pub const DECODE_DTYPES: [DType; 2] = [DType::BF16, DType::Fp8E4M3];

/// 64 query / 8 KV heads, head dim 128 (a Llama-3-70B layer).
pub fn shape(dtype: DType) -> ModelShape {
    ModelShape {
        num_layers: 1,
        num_q_heads: 64,
        num_kv_heads: 8,
        head_dim: 128,
        kv_dtype: dtype,
    }
}

/// Every attention specialisation the bench launches.
///
/// # Errors
/// Whatever [`KvLayout::new`] says of a bench shape (nothing: the shapes are valid).
pub fn decode_specs() -> Result<Vec<AttentionSpec>> {
    DECODE_DTYPES
        .iter()
        .map(|&d| {
            Ok(AttentionSpec::for_layout(&KvLayout::new(
                shape(d),
                BLOCK_SIZE,
            )?))
        })
        .collect()
}

/// `spec` is prebuilt, or NVRTC is here to compile it.
///
/// # Errors
/// [`Error::Unsupported`] naming the specialisation.
pub fn check_prebuilt(spec: &AttentionSpec) -> Result<()> {
    if catalog().contains(&KernelSpec::Attention(*spec)) || nvrtc_present() {
        return Ok(());
    }
    Err(Error::Unsupported(format!(
        "{spec:?} is not prebuilt (PREBUILT_ATTENTION) and there is no NVRTC here"
    )))
}
