//! What crosses the crate's edge: export/import of sequences, block hashes other
//! programs compute (XXH3, vLLM's), prefix events on vLLM's wire and over ZMQ,
//! Prometheus metrics, SVG charts; and the source layering check.

#[path = "../support/mod.rs"]
mod support;

mod broker_svg;
mod chart;
mod export;
mod export_short_headers;
mod kv_events;
mod layering;
mod metrics;
mod prefix_hash;
mod vllm_wire;
