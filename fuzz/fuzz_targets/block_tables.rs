//! The block-table validation that guards kernel launches (harness shared with
//! `tests/fuzz_replay.rs`).
#![no_main]

#[path = "../../tests/common/fuzz_tables.rs"]
mod fuzz_tables;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_tables::run(data));
