#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
// Library code returns errors; `unwrap`/`expect` are for tests only.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

// The layers, bottom up (DESIGN.md); a module names only modules at or below its own
// layer, which `tests/layering.rs` checks on every file of `src/`.
pub mod error;
pub mod ids;
mod sync;

pub mod layout;

pub mod pool;

pub mod manager;

pub mod tables;

pub mod executor;

pub mod attention;

pub mod baseline;
pub mod broker;
pub mod chart;
pub mod events;
pub mod export;
pub mod gguf;
pub mod metrics;
pub mod plan;

pub use baseline::{CacheAllocator, ContiguousCache};
pub use error::{Error, Result};
pub use executor::shard::ShardedStorage;
pub use executor::storage::{HostStorage, Storage, SwapFence};
pub use executor::tier::{DiskTier, TransferEngine, TransferEvent};
pub use export::groups::{
    export_group_sequence, exported_group_len, import_group_sequence, GroupExportView, GroupRecord,
};
pub use export::{
    export_blocks, export_sequence, exported_len, import_sequence, ExportHeader, ExportView,
    ImportedSequence,
};
pub use ids::{BlockId, DiskSlot, PinId, SeqHandle, SeqId, SwapTicket};
pub use layout::plans::{BlockCopy, CopyPlan, MovePlan, SwapDirection, SwapPair, SwapPlan};
pub use layout::shape::{DType, KvKind, ModelConfig, ModelShape};
pub use layout::{Kv, KvLayout, Slot};
pub use manager::groups::{
    GroupSpec, GroupStats, GroupStep, GroupSwapJob, KvCacheGroups, PendingGroupDefrag,
};
pub use manager::preempt::{
    CostModel, PreemptAction, PreemptEvent, PreemptMode, PreemptPolicy, PreemptReason, Preemption,
};
pub use manager::{
    CacheBuilder, CacheConfig, CacheStats, DefragOptions, FragStats, KvCacheManager, PendingDefrag,
    PendingResize, PendingTierMove, SharedKvCacheManager, StepBuffers, StepEntry,
};
pub use manager::{PendingPrefixRestore, PendingPrefixSpill, PrefixRestore, PrefixSpill};
pub use manager::{PrefixHit, SwapJob, TierBlock, TierConfig, TierStats};
pub use pool::prefix::{
    Admission, AdmitOptions, BlockDigest, BlockHash, Medium, PinnedPrefix, PrefixConfig,
    PrefixEvent, PrefixReset, PrefixStats, Xxh3Hasher,
};
pub use pool::{BlockPool, BlockState};
pub use tables::{CsrTables, PaddedTables};
