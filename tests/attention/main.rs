//! Attention on the CPU: paged decode and prefill against the f64 reference, MLA's
//! latent slots. (The serve example's GPU path, replayed on the CPU, is tested by the
//! example itself: `examples/serve_gpu/tests.rs`.)

#[path = "../support/mod.rs"]
mod support;

mod cpu;
mod mla;
