//! Fixtures shared by the test binaries, included by each as
//! `#[path = "../support/mod.rs"] mod support;` (`"support/mod.rs"` from a single-file
//! binary in `tests/`). Each binary uses its own part, hence `allow(dead_code)`.
//!
//! The `fuzz_*` harnesses are also the fuzz targets' (`fuzz/fuzz_targets/*.rs` include
//! them by path), so they stay free of anything the fuzz crate lacks.
#![allow(dead_code)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod faulty_storage;
pub mod fuzz_export;
pub mod fuzz_gguf;
pub mod fuzz_manager;
pub mod fuzz_plan;
pub mod fuzz_tables;
pub mod kv_bytes;
pub mod kv_events;
pub mod snapshot;
pub mod tiers;
pub mod two_groups;

use proptest::test_runner::{Config as ProptestConfig, FileFailurePersistence};

/// proptest's default config with `cases` cases, reading and writing failing seeds in
/// `<source>.proptest-regressions` beside the test's source file. (proptest's default,
/// `SourceParallel`, would look for `tests/proptest-regressions/<file>.txt` once the
/// source sits beside a `main.rs`.)
pub fn proptest_config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}
