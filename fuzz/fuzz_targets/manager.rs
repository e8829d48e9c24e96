//! The manager under arbitrary action sequences, against a shadow model with byte
//! patterns on `HostStorage` (the harness is shared with `tests/cache/fuzz_corpus.rs`).
#![no_main]

#[path = "../../tests/support/fuzz_manager.rs"]
mod fuzz_manager;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_manager::run(data));
