//! A single KV export received from outside: parse and import, directly or through the
//! prefix cache, with checksums optionally repaired so mutations reach the import
//! (the harness is shared with `tests/cache/fuzz_corpus.rs`).
#![no_main]

#[path = "../../tests/support/fuzz_export.rs"]
mod fuzz_export;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_export::run_single(data);
});
