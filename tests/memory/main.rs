//! Where a block's bytes live and how they move: swap and preemption, the prefix
//! cache's host and disk levels and their I/O on the transfer engine, copies failing
//! partway, prefix spill, defragmentation and resize, the movers (nothing moves a block
//! the current step writes), the memory broker, sharded storage and the pool from many
//! threads.

#[path = "../support/mod.rs"]
mod support;

mod broker;
mod broker_model;
mod concurrent;
mod defrag;
mod disk_cache;
mod disk_tier_cache;
mod hybrid_disk_cache;
mod hybrid_host_cache;
mod hybrid_resize;
mod movers;
mod prefix_spill;
mod shard;
mod swap;
mod tier_cache;
mod tier_engine;
mod transfer_faults;
