//! On a GPU (feature `cuda`): the decode and prefill kernels against references,
//! `CudaStorage` against `HostStorage`, stream ordering, the broker's VMM chunk moves.
//! Without a GPU each test prints a SKIPPED line (`support::cuda`), and fails under
//! `PAGEDKV_REQUIRE_GPU=1`. `.ci/gpu-check` runs the modules one by one by filter
//! (`attention::`, `prefill::`, ...).
#![cfg(feature = "cuda")]

#[path = "../support/mod.rs"]
mod support;

mod attention;
mod broker;
mod codecs;
mod prefill;
mod storage;
mod streams;
