//! The cache's bookkeeping as an engine drives it: the step path (engine contract, batches,
//! reservations ahead), the manager against a shadow model, named fragmentation
//! scenarios, the prefix cache, KV-cache groups, recurrent-state groups and sliding
//! windows; invalid and out-of-range input and the readable-state predicate; the fuzz
//! corpora replayed through the fuzz harnesses.

#[path = "../support/mod.rs"]
mod support;

mod async_steps;
mod batch;
mod engine_contract;
mod fuzz_corpus;
mod groups;
mod invalid_input;
mod manager_model;
mod out_of_range;
mod prefix;
mod readable_state;
mod scenarios;
mod state_export;
mod state_groups;
mod window;
mod window_cache;
