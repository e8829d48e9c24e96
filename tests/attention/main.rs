//! Attention on the CPU: paged decode and prefill against the f64 reference, MLA's
//! latent slots, and the serve example's GPU path replayed on the CPU.

#[path = "../support/mod.rs"]
mod support;

mod cpu;
mod mla;
mod serve_prefill_chunks;
