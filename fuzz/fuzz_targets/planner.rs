//! The capacity planner and the attention entry points under arbitrary numbers (the
//! harness is shared with `tests/cache/fuzz_corpus.rs`).
#![no_main]

#[path = "../../tests/support/fuzz_plan.rs"]
mod fuzz_plan;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_plan::run(data));
