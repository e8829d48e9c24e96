#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
// Library code returns errors; `unwrap`/`expect` are for tests only.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod attention;
pub mod baseline;
pub mod chart;
pub mod concurrent;
pub mod convert;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod export;
pub mod gguf;
pub mod layout;
pub mod manager;
pub mod metrics;
pub mod plan;
pub mod pool;
pub mod preempt;
pub mod prefix;
pub mod shape;
pub mod shard;
pub mod storage;
mod sync;
pub mod tier;
pub mod transfer;

pub use baseline::{CacheAllocator, ContiguousCache};
pub use error::{Error, Result};
pub use export::{
    export_blocks, export_sequence, exported_len, import_sequence, ExportHeader, ExportView,
    ImportedSequence,
};
pub use layout::{Kv, KvLayout, Slot};
pub use manager::{
    CacheConfig, CacheStats, CsrTables, DefragOptions, FragStats, KvCacheManager, PaddedTables,
    PendingDefrag, SharedKvCacheManager,
};
pub use manager::{SwapJob, SwapTicket, TierBlock, TierConfig, TierStats};
pub use pool::{BlockPool, BlockState};
pub use preempt::{
    CostModel, PreemptAction, PreemptEvent, PreemptMode, PreemptPolicy, PreemptReason, Preemption,
};
pub use prefix::{
    Admission, AdmitOptions, BlockHash, PinId, PinnedPrefix, PrefixConfig, PrefixEvent, PrefixStats,
};
pub use shape::{DType, ModelConfig, ModelShape};
pub use shard::ShardedStorage;
pub use storage::{HostStorage, Storage};
pub use tier::{DiskSlot, DiskTier, TransferEngine, TransferEvent};
pub use transfer::{BlockCopy, CopyPlan, MovePlan, SwapDirection, SwapPair, SwapPlan};

/// A physical block: an index into the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The id as an index.
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for BlockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A sequence (request, or one branch of a fork), named by the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seq {}", self.0)
    }
}
