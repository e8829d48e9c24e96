//! The block-table validation that guards kernel launches (harness shared with
//! `tests/cache/fuzz_corpus.rs`).
#![no_main]

#[path = "../../tests/support/fuzz_tables.rs"]
mod fuzz_tables;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_tables::run(data));
