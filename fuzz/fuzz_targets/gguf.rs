//! The GGUF reader on arbitrary bytes: never panics, returned tensor data lies inside
//! the input, an accepted model config has a valid shape (the harness is shared with
//! `tests/cache/fuzz_corpus.rs`).
#![no_main]

#[path = "../../tests/support/fuzz_gguf.rs"]
mod fuzz_gguf;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_gguf::run(data));
