//! A KV group export received from outside: parse and import into a hybrid cache
//! (a full and a sliding-window group), directly or through the prefix caches, with
//! checksums optionally repaired (the harness is shared with `tests/cache/fuzz_corpus.rs`).
#![no_main]

#[path = "../../tests/support/fuzz_export.rs"]
mod fuzz_export;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_export::run_group(data);
});
