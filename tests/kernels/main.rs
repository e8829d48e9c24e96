//! The CUDA kernels without a GPU (feature `cuda`): every specialisation compiles under
//! NVRTC (`compile`), and the static speed model from `cuobjdump -sass` (`speed`).
//! Without NVRTC the tests print a SKIPPED line; `PAGEDKV_REQUIRE_NVRTC=1` (set by
//! `.ci/nvrtc-env`) makes that a failure.
#![cfg(feature = "cuda")]

mod compile;
mod speed;
