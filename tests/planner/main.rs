//! The capacity planner: published configs against hand calculations, absurd sizes
//! as typed errors, and the GGUF reader.

#[path = "../support/mod.rs"]
mod support;

mod gguf;
mod overflow;
mod plan;
