//! Paged KV-cache management for LLM serving engines.
//!
//! The KV cache is one arena, preallocated once (VRAM on a GPU, host memory by
//! default) and cut into blocks of `block_size` tokens. Every sequence owns a block
//! table that maps its token positions to blocks, so memory is taken a block at a time
//! instead of `max_len` per request. Forks share blocks copy-on-write, full computed
//! blocks are shared across requests through a prefix cache, cold sequences move to a
//! host or disk tier, and the arena can be compacted, shrunk and grown. The manager
//! only does bookkeeping: every byte movement is an explicit plan
//! ([`CopyPlan`], [`SwapPlan`], [`MovePlan`]) that a [`Storage`] carries out.
//!
//! # The engine path
//!
//! Admit a prompt through the prefix cache, then run each model step as one
//! [`KvCache::reserve_step`] into fixed [`StepBuffers`] and one
//! [`KvCache::commit_step`] of what the step accepted:
//!
//! ```
//! use pagedkv::{AdmitOptions, CacheConfig, DType, KvCache, KvLayout, ModelShape,
//!               PrefixHit, SeqId, StepBuffers, StepEntry};
//!
//! let shape = ModelShape { num_layers: 32, num_q_heads: 32, num_kv_heads: 8, head_dim: 128,
//!                          kv_dtype: DType::BF16 };              // Llama-3-8B's KV
//! let mut kv = KvCache::new(KvLayout::new(shape, 16)?, CacheConfig::new(256))?;
//! let mut step = StepBuffers::new(8, 512, 64); // rows, query tokens, blocks per row
//! let (mut hit, opts) = (PrefixHit::default(), AdmitOptions::default());
//!
//! let prompt: Vec<u32> = (0..100).collect();
//! kv.lookup_prefix(&prompt, &opts, &mut hit)?;
//! kv.admit_prompt(SeqId(1), &prompt, &hit)?;
//! let seq = kv.handle(SeqId(1))?;
//! kv.reserve_step(&[StepEntry { seq, new_tokens: 100, lookahead: 0 }], &mut step)?;
//! // run step.copies(), write K/V through step.slot_mapping(), attend over step.tables()
//! kv.commit_step(&[(seq, 100)])?;
//! assert_eq!(kv.lookup_prefix(&prompt, &opts, &mut hit)?, 96); // 6 full blocks shared
//! # Ok::<(), pagedkv::Error>(())
//! ```
//!
//! # The names at the root
//!
//! The root holds what an engine names; everything else is reached through its module
//! (`pagedkv::manager::PendingDefrag`, `pagedkv::export::export_sequence`, ...).
//!
//! | for | names |
//! |---|---|
//! | the cache | [`KvCache`], [`CacheBuilder`], [`CacheConfig`], [`CacheStats`], [`TierConfig`], [`PreemptPolicy`] |
//! | a model step | [`StepBuffers`], [`StepEntry`], [`SeqHandle`] |
//! | the prefix cache | [`AdmitOptions`], [`PrefixHit`], [`PrefixConfig`] |
//! | hybrid models | [`GroupSpec`], [`GroupStep`] |
//! | ids and errors | [`SeqId`], [`BlockId`], [`Error`], [`Result`] |
//! | the arena's shape | [`ModelShape`], [`DType`], [`KvKind`], [`KvLayout`] |
//! | moving bytes | [`Storage`], [`HostStorage`], [`CopyPlan`], [`SwapPlan`], [`MovePlan`] |
//!
//! With the `planner` feature, `ModelConfig` (a Hugging Face `config.json`) joins them.
//!
//! # Layers
//!
//! Imports run one way, downward (`tests/io/layering.rs` fails on an upward import):
//!
//! | layer (bottom up) | modules | what it holds |
//! |---|---|---|
//! | ids, errors | [`ids`], [`error`] | [`BlockId`], [`SeqId`], [`SeqHandle`], tickets; the one [`Error`] enum |
//! | layout and plans | [`layout`] | [`ModelShape`], dtypes and their conversions, [`KvLayout`] (all addressing), plans as plain data |
//! | pools | [`pool`] | [`BlockPool`](pool::BlockPool) (free list, refcounts), the prefix index and its eviction policies, the sharded pool |
//! | manager | [`manager`] | [`KvCache`], over one or more KV-cache groups: sequences to block tables, the engine contract, prefix-cache use, tiers, preemption, defragmentation *plans*; never touches memory |
//! | batch tables | [`tables`] | [`tables::PaddedTables`], [`tables::CsrTables`] and their validation |
//! | executor | [`executor`] | [`Storage`], [`HostStorage`], the CUDA storage, [`ShardedStorage`](executor::shard::ShardedStorage), the disk tier, [`executor::tier::TransferEngine`]; the one-call conveniences (defragment, shrink, spill) as plan + execute + commit |
//! | attention | [`attention`] | f64 reference, CPU (rayon, AVX2) decode and chunked prefill, RoPE fused with the cache write, MLA decode, the CUDA kernels' launchers |
//! | around | [`metrics`], [`export`], [`broker`], [`chart`], `plan`, `baseline` | metrics facade, KV export/import, the multi-model memory broker, SVG charts; the capacity planner with its `config.json` and GGUF readers (feature `planner`), the contiguous baseline (feature `testing`) |
//!
//! # Features
//!
//! `cuda` (default) builds the CUDA storage and kernels through `cudarc` with dynamic
//! loading: building needs no CUDA install, and at run time the crate falls back to
//! host memory without a GPU. `--no-default-features` builds without `cudarc`. No
//! kernel has run on a GPU yet; see [`guide::gpu`].
//!
//! The other features are off by default:
//!
//! | feature | what it adds | dependencies |
//! |---|---|---|
//! | `planner` | `plan`: the capacity planner, Hugging Face `config.json` reading (`plan::config`), GGUF reading (`plan::gguf`) | `serde_json` |
//! | `prometheus` | the Prometheus text exporter of [`metrics`] | `metrics-exporter-prometheus` |
//! | `vllm-hash` | a block hasher compatible with vLLM's `sha256_cbor` prefix hashing | `sha2` |
//! | `nixl` | `executor::nixl` (a NIXL agent over UCX: arena registration, metadata, block READs) and `export::nixl` (a sequence pulled page to page between two processes, the export header as control message); needs `libnixl_capi.so` at run time (the `nixl-cu13` wheel), probed before the first call | `nixl-sys` (`stub-api`: g++ and libclang to build) |
//! | `testing` | what the crate's own tests, benches and examples measure against: the contiguous baseline (`baseline`), a seeded random attention stack (`attention::model`), the lane-by-lane replay of the tensor-core decode kernel (in `attention::decode_mma`), with `cuda` the static SASS speed model of the decode kernel (`executor::cuda::sass`) | none |
//!
//! The crate's tests, benches and examples turn `planner`, `prometheus` and `testing` on
//! through a dev-dependency on the crate itself, so a plain `cargo test` sees them.
//!
//! # The guide
//!
//! [`guide`] explains the crate chapter by chapter: [the engine
//! contract](guide::engine_contract), [the prefix cache](guide::prefix_cache), [tiers
//! and preemption](guide::tiers), [defragmentation and resize](guide::defrag), [hybrid
//! models](guide::hybrid), [sizing](guide::sizing), [sharing an arena, a budget or a
//! sequence](guide::sharing), [metrics](guide::metrics), [the GPU path](guide::gpu),
//! [robustness](guide::robustness) and [how figures are measured](guide::measurement).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
// Library code returns errors; `unwrap`/`expect` are for tests only.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

// The layers, bottom up (the table under "Layers" above); a module names only modules
// at or below its own layer, which `tests/io/layering.rs` checks on every file of `src/`.
pub mod error;
pub mod ids;
mod sync;

pub mod layout;

pub mod pool;

pub mod manager;

pub mod tables;

pub mod executor;

pub mod attention;

#[cfg(feature = "testing")]
pub mod baseline;
pub mod broker;
pub mod chart;
pub mod events;
pub mod export;
pub mod metrics;
#[cfg(feature = "planner")]
pub mod plan;

// The guide's chapters are `src/guide/*.md` (their Rust examples are doc tests). The
// module is inline rather than `src/guide/mod.rs` because `tests/io/layering.rs` gives
// every `.rs` file under `src/` a layer, and documentation is none.
pub mod guide {
    #![doc = include_str!("guide/index.md")]

    #[doc = include_str!("guide/engine_contract.md")]
    pub mod engine_contract {}
    #[doc = include_str!("guide/prefix_cache.md")]
    pub mod prefix_cache {}
    #[doc = include_str!("guide/tiers.md")]
    pub mod tiers {}
    #[doc = include_str!("guide/defrag.md")]
    pub mod defrag {}
    #[doc = include_str!("guide/hybrid.md")]
    pub mod hybrid {}
    #[doc = include_str!("guide/sizing.md")]
    pub mod sizing {}
    #[doc = include_str!("guide/sharing.md")]
    pub mod sharing {}
    #[doc = include_str!("guide/metrics.md")]
    pub mod metrics {}
    #[doc = include_str!("guide/gpu.md")]
    pub mod gpu {}
    #[doc = include_str!("guide/robustness.md")]
    pub mod robustness {}
    #[doc = include_str!("guide/measurement.md")]
    pub mod measurement {}

    // The README's code blocks run as doc tests; it is not rendered here (its links
    // point into the repository).
    #[cfg(doctest)]
    #[doc = include_str!("../README.md")]
    struct Readme;
}

// The names an engine needs, and only those; everything else is reached through its
// module (`pagedkv::manager::PendingDefrag`, `pagedkv::export::export_sequence`, ...).
pub use error::{Error, Result};
pub use executor::storage::{HostStorage, Storage};
pub use ids::{BlockId, SeqHandle, SeqId};
pub use layout::plans::{CopyPlan, MovePlan, SwapPlan};
pub use layout::shape::{DType, KvKind, ModelShape};
pub use layout::KvLayout;
pub use manager::groups::{CheckpointPolicy, GroupSpec, GroupStep, StateCheckpoint};
pub use manager::preempt::PreemptPolicy;
pub use manager::{
    CacheBuilder, CacheConfig, CacheStats, KvCache, PrefixHit, StepBuffers, StepEntry, TierConfig,
};
#[cfg(feature = "planner")]
pub use plan::ModelConfig;
pub use pool::prefix::{AdmitOptions, PrefixConfig};
