//! The tiers below the device arena, and the machinery that moves blocks between them.
//!
//! | tier | holds | moved by |
//! |---|---|---|
//! | device arena | resident sequences | — |
//! | host tier | swapped-out sequences (a second [`crate::pool::BlockPool`] in the manager), the host level of the prefix cache (stores and loads), spilled prefix-cache blocks | [`crate::SwapPlan`]s, executed by a [`crate::Storage`] directly or by a [`TransferEngine`] on a worker thread |
//! | disk tier | host-tier blocks spilled to one preallocated file ([`DiskTier`]) | [`crate::executor::spill_to_disk`] / [`crate::executor::restore_from_disk`] (plans of the manager, executed here), checksummed |
//! | disk level of the prefix cache | cached blocks in a tier directory whose journaled index survives a restart ([`DiskPrefixStore`]); the manager keeps its index (`manager/disk_level.rs`) | [`spill_host_prefixes_to_disk`] (host entries to slots), [`stage_disk_load`] / [`load_prefix_from_tiers`] (slot to staging host block to device), [`adopt_disk_store`] after a restart; checksummed. Off the caller's thread: [`submit_disk_store`] / [`submit_disk_stage`] on a [`TransferEngine`] with the store attached, completed by [`complete_disk_jobs`] |
//!
//! The manager keeps the bookkeeping of every tier (which block of which tier holds
//! what, refcounts); this module holds the parts that touch memory or files.

mod disk;
mod disk_cache;
mod engine;
mod prefix;

pub use disk::{DiskTier, DISK_SLOT_ALIGN};
pub use disk_cache::{
    DiskCacheStats, DiskEntry, DiskEviction, DiskPrefixStore, DiskRecovery, DiskStoreOutcome,
    DISK_CACHE_FORMAT_VERSION, MAX_DISK_KEY_BYTES,
};
pub use engine::{DiskJobReport, DiskTransferCounters, TransferEngine, TransferEvent};
pub use prefix::{
    adopt_disk_store, complete_disk_jobs, load_prefix_from_host, load_prefix_from_tiers,
    load_prefix_from_tiers_grouped, restore_spilled_prefixes, spill_cached_prefixes,
    spill_host_prefixes_to_disk, spill_host_prefixes_to_disk_grouped, stage_disk_load,
    store_prefixes_to_host, submit_disk_stage, submit_disk_store, DiskSpill,
};
